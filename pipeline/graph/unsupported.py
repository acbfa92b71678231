"""Ops the QNN EP has no kernel for, written with ops it has, for static shapes.

Each stays on the CPU otherwise and cuts the graph in two partitions (measured on the HTP
simulator, one op between two Convs, onnxruntime-qnn 2.7.0): GlobalLpPool, Hardmax, OneHot,
Trilu, a float Mod and a standalone Erf (a GELU's Erf is fused into Gelu by
``attention.fuse_erf_gelu`` first). The rewrites compute the same, except Erf, whose
polynomial form is within 1.5e-7 of it (Abramowitz and Stegun 7.1.26; 5e-7 in float32), and
Mod where a / b rounds to an integer it is not (fmod's 0 or b there, a step either way).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper

from .edit import DEFAULT_DOMAINS, Change, NodeRewrite, node_label, replace_nodes

Rewrite = tuple[list[onnx.NodeProto], str]


def _attr(node: onnx.NodeProto, name: str, default: object) -> object:
    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return default


def _scalar(context: NodeRewrite, name: str) -> float | None:
    """The value of a one-element constant input, None when it is computed."""
    if not name or name not in context.inits:
        return None
    value = onnx.numpy_helper.to_array(context.inits[name])
    return float(value.reshape(-1)[0]) if value.size == 1 else None


def _global_lp_pool(node: onnx.NodeProto, context: NodeRewrite) -> Rewrite | None:
    """GlobalLpPool(x, p) -> ReduceL2 (p = 2) or ReduceSum of |x| (p = 1) over the spatial axes
    (other p would need a Pow, which the HTP refuses quantized: left as it is)."""
    shape = context.shape(node.input[0])
    p = int(_attr(node, "p", 2))
    if shape is None or len(shape) < 3 or p not in (1, 2):
        return None
    axes = context.constant(np.arange(2, len(shape), dtype=np.int64), f"{node.output[0]}_axes")
    (out,) = node.output
    if p == 2:
        nodes = [helper.make_node("ReduceL2", [node.input[0], axes], [out], keepdims=1)]
        return nodes, f"{node_label(node)} -> ReduceL2 over the spatial axes"
    size = context.fresh(f"{out}_abs")
    nodes = [
        helper.make_node("Abs", [node.input[0]], [size]),
        helper.make_node("ReduceSum", [size, axes], [out], keepdims=1),
    ]
    return nodes, f"{node_label(node)} -> ReduceSum of |x| over the spatial axes"


def _positions(context: NodeRewrite, rank: int, axis: int, size: int, base: str) -> str:
    """A constant 0..size-1 laid along ``axis`` of a rank-``rank`` tensor (1 elsewhere)."""
    shape = [1] * rank
    shape[axis] = size
    return context.constant(np.arange(size, dtype=np.int64).reshape(shape), base)


def _hardmax(node: onnx.NodeProto, context: NodeRewrite) -> Rewrite | None:
    """Hardmax(x, axis) -> Cast(Equal(ArgMax(x, axis), positions along axis)): the first
    maximum only, as Hardmax (Equal(x, max) would mark every tie, and ties are common once
    quantized)."""
    shape = context.shape(node.input[0])
    if shape is None:
        return None
    axis = int(_attr(node, "axis", -1))
    axis = axis + len(shape) if axis < 0 else axis
    (out,) = node.output
    first, same = context.fresh(f"{out}_argmax"), context.fresh(f"{out}_is_max")
    where = _positions(context, len(shape), axis, shape[axis], f"{out}_positions")
    elem = context.elem_type(node.input[0]) or onnx.TensorProto.FLOAT
    nodes = [
        helper.make_node("ArgMax", [node.input[0]], [first], axis=axis, keepdims=1),
        helper.make_node("Equal", [first, where], [same]),
        helper.make_node("Cast", [same], [out], to=elem),
    ]
    return nodes, f"{node_label(node)} -> ArgMax == position along axis {axis}"


def _one_hot(node: onnx.NodeProto, context: NodeRewrite) -> Rewrite | None:
    """OneHot(indices, depth, [off, on], axis) with constant depth and values -> Where(
    Equal(indices (negative ones + depth) unsqueezed at axis, positions), on, off)."""
    shape = context.shape(node.input[0])
    depth = _scalar(context, node.input[1])
    values = context.inits.get(node.input[2])
    if shape is None or depth is None or values is None:
        return None
    pair = onnx.numpy_helper.to_array(values).reshape(-1)
    rank = len(shape) + 1
    axis = int(_attr(node, "axis", -1))
    axis = axis + rank if axis < 0 else axis
    (out,) = node.output
    fresh = context.fresh
    as_int, negative, wrapped, index, expanded, hit = (
        fresh(f"{out}_{s}") for s in ("int", "negative", "wrapped", "index", "expanded", "hit")
    )
    zero = context.constant(np.array(0, np.int64), f"{out}_zero")
    count = context.constant(np.array(int(depth), np.int64), f"{out}_depth")
    axes = context.constant(np.array([axis], np.int64), f"{out}_axis")
    where = _positions(context, rank, axis, int(depth), f"{out}_positions")
    off = context.constant(pair[:1].reshape(()).copy(), f"{out}_off")
    on = context.constant(pair[1:2].reshape(()).copy(), f"{out}_on")
    nodes = [
        helper.make_node("Cast", [node.input[0]], [as_int], to=onnx.TensorProto.INT64),
        helper.make_node("Less", [as_int, zero], [negative]),
        helper.make_node("Add", [as_int, count], [wrapped]),
        helper.make_node("Where", [negative, wrapped, as_int], [index]),
        helper.make_node("Unsqueeze", [index, axes], [expanded]),
        helper.make_node("Equal", [expanded, where], [hit]),
        helper.make_node("Where", [hit, on, off], [out]),
    ]
    return nodes, f"{node_label(node)} -> Where(index == position along axis {axis})"


def _trilu(node: onnx.NodeProto, context: NodeRewrite) -> Rewrite | None:
    """Trilu(x, k) with constant k -> x * a constant 0/1 triangle of x's last two axes."""
    shape = context.shape(node.input[0])
    k = _scalar(context, node.input[1]) if len(node.input) > 1 and node.input[1] else 0.0
    if shape is None or len(shape) < 2 or k is None:
        return None
    rows, cols = shape[-2:]
    upper = bool(_attr(node, "upper", 1))
    make = np.triu if upper else np.tril
    elem = context.elem_type(node.input[0]) or onnx.TensorProto.FLOAT
    mask = make(np.ones((rows, cols)), int(k)).astype(onnx.helper.tensor_dtype_to_np_dtype(elem))
    triangle = context.constant(mask, f"{node.output[0]}_triangle")
    nodes = [helper.make_node("Mul", [node.input[0], triangle], list(node.output))]
    which = "upper" if upper else "lower"
    return nodes, f"{node_label(node)} -> x * the {which} triangle (k = {int(k)})"


def _mod(node: onnx.NodeProto, context: NodeRewrite) -> Rewrite | None:
    """A float Mod (fmod = 1, C's fmod) -> a - b * trunc(a / b), trunc(z) = sign(z) floor(|z|)."""
    elem = context.elem_type(node.input[0])
    if elem not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16) or not _attr(node, "fmod", 0):
        return None
    a, b = node.input
    (out,) = node.output
    ratio, size, floor, sign, whole, taken = (
        context.fresh(f"{out}_{s}") for s in ("ratio", "abs", "floor", "sign", "trunc", "taken")
    )
    nodes = [
        helper.make_node("Div", [a, b], [ratio]),
        helper.make_node("Abs", [ratio], [size]),
        helper.make_node("Floor", [size], [floor]),
        helper.make_node("Sign", [ratio], [sign]),
        helper.make_node("Mul", [sign, floor], [whole]),
        helper.make_node("Mul", [whole, b], [taken]),
        helper.make_node("Sub", [a, taken], [out]),
    ]
    return nodes, f"{node_label(node)} -> a - b * trunc(a / b)"


# Abramowitz and Stegun 7.1.26: erf(x) = 1 - t (a1 + t (a2 + ...)) exp(-x^2), t = 1 / (1 + p x),
# for x >= 0, within 1.5e-7; odd.
_ERF_P = 0.3275911
_ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def _erf(node: onnx.NodeProto, context: NodeRewrite) -> Rewrite | None:
    """Erf(x) -> sign(x) (1 - t poly(t) exp(-x^2)), t = 1 / (1 + p |x|)."""
    (x,) = node.input
    (out,) = node.output
    fresh = context.fresh

    def const(value: float, base: str) -> str:
        return context.constant(np.array(value, np.float32), f"{out}_{base}")

    one = const(1.0, "one")
    size, scaled, denominator, t, square, negative, decay = (
        fresh(f"{out}_{s}") for s in ("abs", "px", "den", "t", "sq", "neg_sq", "exp")
    )
    nodes = [
        helper.make_node("Abs", [x], [size]),
        helper.make_node("Mul", [size, const(_ERF_P, "p")], [scaled]),
        helper.make_node("Add", [scaled, one], [denominator]),
        helper.make_node("Div", [one, denominator], [t]),
    ]
    poly = const(_ERF_A[-1], "a5")
    for index, coefficient in reversed(list(enumerate(_ERF_A[:-1], start=1))):
        times, plus = fresh(f"{out}_times_{index}"), fresh(f"{out}_plus_{index}")
        nodes += [
            helper.make_node("Mul", [poly, t], [times]),
            helper.make_node("Add", [times, const(coefficient, f"a{index}")], [plus]),
        ]
        poly = plus
    tail, loss, positive, sign = (fresh(f"{out}_{s}") for s in ("tail", "loss", "pos", "sign"))
    nodes += [
        helper.make_node("Mul", [x, x], [square]),
        helper.make_node("Neg", [square], [negative]),
        helper.make_node("Exp", [negative], [decay]),
        helper.make_node("Mul", [poly, t], [tail]),
        helper.make_node("Mul", [tail, decay], [loss]),
        helper.make_node("Sub", [one, loss], [positive]),
        helper.make_node("Sign", [x], [sign]),
        helper.make_node("Mul", [sign, positive], [out]),
    ]
    return nodes, f"{node_label(node)} -> sign(x) (1 - t poly(t) exp(-x^2)) (within 1.5e-7)"


_REWRITES: dict[str, Callable[[onnx.NodeProto, NodeRewrite], Rewrite | None]] = {
    "GlobalLpPool": _global_lp_pool,
    "Hardmax": _hardmax,
    "OneHot": _one_hot,
    "Trilu": _trilu,
    "Mod": _mod,
    "Erf": _erf,
}


def ops_without_qnn_kernels(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """GlobalLpPool, Hardmax, OneHot, Trilu, a float Mod and Erf -> ops the QNN EP runs."""

    def rewrite(node: onnx.NodeProto, context: NodeRewrite) -> Rewrite | None:
        rule = _REWRITES.get(node.op_type)
        if rule is None or node.domain not in DEFAULT_DOMAINS:
            return None
        return rule(node, context)

    return replace_nodes(model, "ops_without_qnn_kernels", rewrite)
