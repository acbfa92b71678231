"""Ops the QNN EP has no kernel for, written with ops it has, for static shapes.

Each stays on the CPU otherwise and cuts the graph in two partitions (measured on the HTP
simulator, one op between two Convs, quantized, onnxruntime-qnn 2.7.0): GlobalLpPool, Hardmax,
OneHot, Trilu, a float Mod, a standalone Erf (a GELU's Erf is fused into Gelu by
``attention.fuse_erf_gelu`` first), CumSum reversed or exclusive, a 3D MaxPool, a MaxPool's
indices, MaxUnpool, Pad in wrap mode, Sinh, Cosh, Asinh, Acosh, Atanh and Acos; and forms it
takes not: Gemm with alpha or beta, Compress with a constant condition; and ops the HTP takes
but computes wrongly: an integer Mod (in fp16) and LpPool. The rewrites compute the same,
except Erf, whose polynomial form is within 1.5e-7 of it (Abramowitz and Stegun 7.1.26; 5e-7 in float32),
and Mod where a / b rounds to an integer it is not (fmod's 0 or b there, a step either way).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from .edit import (
    DEFAULT_DOMAINS,
    Change,
    NodeRewrite,
    NodeRule,
    attribute,
    node_label,
    passed_on,
    replace_by_op,
)

Rewrite = tuple[list[onnx.NodeProto], str]


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
    p = int(attribute(node, "p", 2))
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
    axis = int(attribute(node, "axis", -1))
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
    axis = int(attribute(node, "axis", -1))
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
    upper = bool(attribute(node, "upper", 1))
    make = np.triu if upper else np.tril
    elem = context.elem_type(node.input[0]) or onnx.TensorProto.FLOAT
    mask = make(np.ones((rows, cols)), int(k)).astype(onnx.helper.tensor_dtype_to_np_dtype(elem))
    triangle = context.constant(mask, f"{node.output[0]}_triangle")
    nodes = [helper.make_node("Mul", [node.input[0], triangle], list(node.output))]
    which = "upper" if upper else "lower"
    return nodes, f"{node_label(node)} -> x * the {which} triangle (k = {int(k)})"


_SIGNED_INTEGERS = (
    onnx.TensorProto.INT8,
    onnx.TensorProto.INT16,
    onnx.TensorProto.INT32,
    onnx.TensorProto.INT64,
)
_UNSIGNED_INTEGERS = (
    onnx.TensorProto.UINT8,
    onnx.TensorProto.UINT16,
    onnx.TensorProto.UINT32,
    onnx.TensorProto.UINT64,
)


def _integer_mod(node: onnx.NodeProto, context: NodeRewrite) -> Rewrite:
    """An integer Mod -> a - b * (a / b), integer division truncating as C's does; with
    fmod = 0 (Python's, the remainder takes the divisor's sign) + b where the signs differ.

    Why: the HTP computes an integer Mod in fp16 (CANINE's hash embeddings, (id + 1) * prime
    mod 16384: 25518 mod 16384 came out 9136, and beyond 65504 it saturated; its lookups read
    the wrong rows, 5.6 dB), while its integer Div, Mul and Sub are exact."""
    a, b = node.input
    (out,) = node.output
    quotient, taken = context.fresh(f"{out}_quotient"), context.fresh(f"{out}_taken")
    python_mod = not attribute(node, "fmod", 0)
    signed = context.elem_type(a) in _SIGNED_INTEGERS
    remainder = context.fresh(f"{out}_remainder") if python_mod and signed else out
    nodes = [
        helper.make_node("Div", [a, b], [quotient]),
        helper.make_node("Mul", [quotient, b], [taken]),
        helper.make_node("Sub", [a, taken], [remainder]),
    ]
    if remainder == out:
        return nodes, f"{node_label(node)} -> a - b * (a / b), in integers"
    product, differ, shifted = (
        context.fresh(f"{out}_{s}") for s in ("product", "differ", "shifted")
    )
    zero = context.constant(
        np.zeros((), onnx.helper.tensor_dtype_to_np_dtype(context.elem_type(a))), f"{out}_zero"
    )
    nodes += [
        helper.make_node("Mul", [remainder, b], [product]),
        helper.make_node("Less", [product, zero], [differ]),
        helper.make_node("Add", [remainder, b], [shifted]),
        helper.make_node("Where", [differ, shifted, remainder], [out]),
    ]
    return nodes, f"{node_label(node)} -> a - b * (a / b), + b where its sign is not b's"


def _mod(node: onnx.NodeProto, context: NodeRewrite) -> Rewrite | None:
    """A float Mod (fmod = 1, C's fmod) -> a - b * trunc(a / b), trunc(z) = sign(z) floor(|z|);
    an integer one: ``_integer_mod``."""
    elem = context.elem_type(node.input[0])
    if elem in _SIGNED_INTEGERS or elem in _UNSIGNED_INTEGERS:
        return _integer_mod(node, context)
    if elem not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16) or not attribute(
        node, "fmod", 0
    ):
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


def _flip(node_out: str, source: str, axis: int, context: NodeRewrite) -> onnx.NodeProto:
    """``source`` reversed along ``axis`` (a Slice with step -1)."""
    starts = context.constant(np.array([-1], np.int64), f"{node_out}_flip_start")
    ends = context.constant(np.array([-(2**62)], np.int64), f"{node_out}_flip_end")
    axes = context.constant(np.array([axis], np.int64), f"{node_out}_flip_axis")
    steps = context.constant(np.array([-1], np.int64), f"{node_out}_flip_step")
    return helper.make_node("Slice", [source, starts, ends, axes, steps], [node_out])


def _cum_sum(node: onnx.NodeProto, context: NodeRewrite) -> Rewrite | None:
    """CumSum with reverse or exclusive (the QNN EP takes the plain one): reversed as a Slice
    of step -1 before and after, exclusive as the inclusive sum less the element."""
    reverse, exclusive = int(attribute(node, "reverse", 0)), int(attribute(node, "exclusive", 0))
    axis = _scalar(context, node.input[1])
    shape = context.shape(node.input[0])
    if not (reverse or exclusive) or axis is None or shape is None:
        return None
    axis_i = int(axis) + len(shape) if axis < 0 else int(axis)
    (out,) = node.output
    fresh = context.fresh
    nodes = []
    source = node.input[0]
    if reverse:
        flipped = fresh(f"{out}_reversed_input")
        nodes.append(_flip(flipped, source, axis_i, context))
        source = flipped
    summed = fresh(f"{out}_inclusive")
    nodes.append(helper.make_node("CumSum", [source, node.input[1]], [summed]))
    if exclusive:
        excluded = fresh(f"{out}_exclusive")
        nodes.append(helper.make_node("Sub", [summed, source], [excluded]))
        summed = excluded
    if reverse:
        nodes.append(_flip(out, summed, axis_i, context))
    else:
        nodes[-1].output[0] = out
    forms = " and ".join(f for f, on in (("reversed", reverse), ("exclusive", exclusive)) if on)
    return nodes, f"{node_label(node)} ({forms}) -> CumSum of the plain kind"


def _max_pool_3d(node: onnx.NodeProto, context: NodeRewrite) -> Rewrite | None:
    """A 3D MaxPool -> a 2D MaxPool over (H, W) with depth folded into channels, then one over
    (D, 1) with H * W laid along the last axis (max is separable, and so are its -inf pads)."""
    kernel = list(attribute(node, "kernel_shape", []))
    shape = context.shape(node.input[0])
    result = context.shape(node.output[0])
    dilations = list(attribute(node, "dilations", [1, 1, 1]))
    if (
        len(kernel) != 3
        or shape is None
        or result is None
        or len(node.output) != 1
        or any(d != 1 for d in dilations)
        or attribute(node, "auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET")
    ):
        return None
    strides = list(attribute(node, "strides", [1, 1, 1]))
    pads = list(attribute(node, "pads", [0] * 6))
    ceil = int(attribute(node, "ceil_mode", 0))
    n, c, d, h, w = shape
    _, _, d2, h2, w2 = result
    (out,) = node.output
    fresh = context.fresh

    def dims(values: list[int], base: str) -> str:
        return context.constant(np.array(values, np.int64), f"{out}_{base}")

    planes, pooled, columns, deep = (fresh(f"{out}_{s}") for s in ("planes", "hw", "cols", "d"))
    nodes = [
        helper.make_node(
            "Reshape", [node.input[0], dims([n, c * d, h, w], "planes_shape")], [planes]
        ),
        helper.make_node(
            "MaxPool",
            [planes],
            [pooled],
            kernel_shape=kernel[1:],
            strides=strides[1:],
            pads=[pads[1], pads[2], pads[4], pads[5]],
            ceil_mode=ceil,
        ),
        helper.make_node("Reshape", [pooled, dims([n, c, d, h2 * w2], "cols_shape")], [columns]),
        helper.make_node(
            "MaxPool",
            [columns],
            [deep],
            kernel_shape=[kernel[0], 1],
            strides=[strides[0], 1],
            pads=[pads[0], 0, pads[3], 0],
            ceil_mode=ceil,
        ),
        helper.make_node("Reshape", [deep, dims([n, c, d2, h2, w2], "shape")], [out]),
    ]
    return nodes, f"{node_label(node)} (3D) -> MaxPool over (H, W), then over D"


def _lp_pool(node: onnx.NodeProto, context: NodeRewrite) -> Rewrite | None:
    """LpPool(x, p = 1 or 2) -> AveragePool (pads counted, as LpPool's zeros) of |x| or x * x,
    times the window's size, and a Sqrt for p = 2.

    Why: the HTP's own LpPool is wrong (measured: 16 channels of 16x16, 3 x 3 windows, ctx vs
    QDQ 3.9 dB; written so, 53 dB). Other p would need a Pow, which the HTP refuses quantized;
    dilated or ceil-mode windows (opset 18) are left as they are."""
    kernel = [int(k) for k in attribute(node, "kernel_shape", [])]
    p = int(attribute(node, "p", 2))
    auto_pad = attribute(node, "auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if (
        p not in (1, 2)
        or not kernel
        or auto_pad not in ("NOTSET", "VALID")
        or int(attribute(node, "ceil_mode", 0))
        or any(int(d) != 1 for d in attribute(node, "dilations", []))
    ):
        return None
    (x,) = node.input
    (out,) = node.output
    strides = [int(s) for s in attribute(node, "strides", [1] * len(kernel))]
    pads = [0] * (2 * len(kernel)) if auto_pad == "VALID" else attribute(node, "pads", None)
    pads = [int(v) for v in pads] if pads else [0] * (2 * len(kernel))
    magnitude, mean = context.fresh(f"{out}_magnitude"), context.fresh(f"{out}_mean")
    size = context.constant(np.array(float(np.prod(kernel)), np.float32), f"{out}_window")
    nodes = [
        helper.make_node("Mul", [x, x], [magnitude])
        if p == 2
        else helper.make_node("Abs", [x], [magnitude]),
        helper.make_node(
            "AveragePool",
            [magnitude],
            [mean],
            kernel_shape=kernel,
            strides=strides,
            pads=pads,
            count_include_pad=1,
        ),
    ]
    if p == 1:
        nodes.append(helper.make_node("Mul", [mean, size], [out]))
        return nodes, f"{node_label(node)} (p = 1) -> AveragePool of |x| times the window's size"
    total = context.fresh(f"{out}_sum_of_squares")
    nodes += [
        helper.make_node("Mul", [mean, size], [total]),
        helper.make_node("Sqrt", [total], [out]),
    ]
    return (
        nodes,
        f"{node_label(node)} (p = 2) -> sqrt(AveragePool of x * x times the window's size)",
    )


def _max_pool_indices(node: onnx.NodeProto, context: NodeRewrite) -> Rewrite | None:
    """MaxPool(x) -> (y, indices) with windows that do not overlap (stride = kernel <= 3, no
    pads, dilations or ceil mode, row-major indices) -> the MaxPool for y, and the indices
    computed: each window's origin (a constant, ((n C + c) H + h) W + w as ONNX counts) plus
    the offset i W + j of its first maximum, found by comparing the k * k strided slices of x.

    Why: the QNN EP takes no MaxPool with an Indices output (SegNet's and ENet's encoders, whose
    decoders unpool at the indices: ``_max_unpool``). The slices of one tensor share its
    quantization, so their comparisons are exact on the HTP too; the first maximum wins ties,
    as onnxruntime's MaxPool."""
    kernel = [int(k) for k in attribute(node, "kernel_shape", [])]
    shape = context.shape(node.input[0])
    result = context.shape(node.output[0])
    if (
        shape is None
        or result is None
        or len(shape) != 4
        or len(kernel) != 2
        or kernel[0] > 3
        or kernel[1] > 3
        or [int(s) for s in attribute(node, "strides", [1, 1])] != kernel
        or any(int(v) for v in attribute(node, "pads", []))
        or any(int(d) != 1 for d in attribute(node, "dilations", []))
        or int(attribute(node, "ceil_mode", 0))
        or int(attribute(node, "storage_order", 0))
        or attribute(node, "auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET", b"VALID", "VALID")
    ):
        return None
    n, c, h, w = shape
    rows, cols = result[2], result[3]
    out, indices = node.output[0], node.output[1]
    fresh = context.fresh
    pool = helper.make_node(
        "MaxPool", [node.input[0]], [out], name=node.name, kernel_shape=kernel, strides=kernel
    )
    planes = (np.arange(n * c, dtype=np.int64) * h * w).reshape(n, c, 1, 1)
    origins = planes + (np.arange(rows, dtype=np.int64) * kernel[0] * w).reshape(1, 1, rows, 1)
    origins = origins + (np.arange(cols, dtype=np.int64) * kernel[1]).reshape(1, 1, 1, cols)
    origin = context.constant(origins, f"{indices}_origins")
    if kernel == [1, 1]:  # every window is one position: the indices are the positions
        nodes = [pool, helper.make_node("Identity", [origin], [indices])]
        return nodes, f"{node_label(node)} (1x1 windows): indices -> the constant positions"
    axes = context.constant(np.array([2, 3], np.int64), f"{indices}_axes")
    steps = context.constant(np.array(kernel, np.int64), f"{indices}_steps")
    offsets = [(i, j) for i in range(kernel[0]) for j in range(kernel[1])]
    nodes = [pool]
    slices = []
    for i, j in offsets:
        piece = fresh(f"{indices}_at_{i}_{j}")
        starts = context.constant(np.array([i, j], np.int64), f"{indices}_start_{i}_{j}")
        ends = context.constant(
            np.array([i + rows * kernel[0], j + cols * kernel[1]], np.int64),
            f"{indices}_end_{i}_{j}",
        )
        nodes.append(helper.make_node("Slice", [node.input[0], starts, ends, axes, steps], [piece]))
        slices.append(piece)
    # Position p is the first maximum when no earlier one is and it is >= every later one.
    chosen = context.constant(
        np.array(offsets[-1][0] * w + offsets[-1][1], np.int64), f"{indices}_offset_last"
    )
    for p in range(len(offsets) - 2, -1, -1):
        tests = []
        for q in range(p + 1, len(offsets)):
            test = fresh(f"{indices}_{p}_ge_{q}")
            nodes.append(helper.make_node("GreaterOrEqual", [slices[p], slices[q]], [test]))
            tests.append(test)
        while len(tests) > 1:
            both = fresh(f"{indices}_{p}_max")
            nodes.append(helper.make_node("And", tests[:2], [both]))
            tests = [both, *tests[2:]]
        i, j = offsets[p]
        offset = context.constant(np.array(i * w + j, np.int64), f"{indices}_offset_{i}_{j}")
        picked = fresh(f"{indices}_offset_from_{p}")
        nodes.append(helper.make_node("Where", [tests[0], offset, chosen], [picked]))
        chosen = picked
    nodes.append(helper.make_node("Add", [origin, chosen], [indices]))
    return nodes, (
        f"{node_label(node)} ({kernel[0]}x{kernel[1]} windows): indices -> window origins + "
        "the offset of each window's first maximum"
    )


def _max_pool(node: onnx.NodeProto, context: NodeRewrite) -> Rewrite | None:
    """A MaxPool with indices: ``_max_pool_indices``; a 3D one: ``_max_pool_3d``."""
    if len(node.output) > 1 and node.output[1]:
        return _max_pool_indices(node, context)
    return _max_pool_3d(node, context)


def _max_unpool(node: onnx.NodeProto, context: NodeRewrite) -> Rewrite | None:
    """MaxUnpool(x, indices) -> zeros of the output's size, flat, ScatterND of x's values at
    the indices, reshaped to the output's shape (static, output_shape input or not).

    Why: the QNN EP has no MaxUnpool (SegNet's and ENet's decoders). Indices that repeat (from
    overlapping windows) write one of their values, as MaxUnpool leaves it open which."""
    result = context.shape(node.output[0])
    shape = context.shape(node.input[0])
    if result is None or shape is None:
        return None
    out = node.output[0]
    fresh = context.fresh
    elem = context.elem_type(node.input[0]) or onnx.TensorProto.FLOAT
    zero = context.constant(np.zeros((), helper.tensor_dtype_to_np_dtype(elem)), f"{out}_zero")
    total = context.constant(np.array([int(np.prod(result))], np.int64), f"{out}_size")
    rows = context.constant(np.array([-1, 1], np.int64), f"{out}_rows")
    flat_shape = context.constant(np.array([-1], np.int64), f"{out}_flat_shape")
    final = context.constant(np.array(result, np.int64), f"{out}_shape")
    zeros, where, values, written = (
        fresh(f"{out}_{s}") for s in ("zeros", "where", "values", "flat")
    )
    nodes = [
        helper.make_node("Expand", [zero, total], [zeros]),
        helper.make_node("Reshape", [node.input[1], rows], [where]),
        helper.make_node("Reshape", [node.input[0], flat_shape], [values]),
        helper.make_node("ScatterND", [zeros, where, values], [written]),
        helper.make_node("Reshape", [written, final], [out]),
    ]
    return nodes, f"{node_label(node)} -> ScatterND of x at the indices into zeros"


def _pad_wrap(node: onnx.NodeProto, context: NodeRewrite) -> Rewrite | None:
    """Pad(mode = wrap) with constant, non-negative pads -> a Concat of the slices it wraps."""
    shape = context.shape(node.input[0])
    pads = context.inits.get(node.input[1]) if len(node.input) > 1 else None
    if (
        attribute(node, "mode", b"constant") not in (b"wrap", "wrap")
        or shape is None
        or pads is None
    ):
        return None
    if len(node.input) > 3 and node.input[3]:
        axes_init = context.inits.get(node.input[3])
        if axes_init is None:
            return None
        axes = [int(a) % len(shape) for a in onnx.numpy_helper.to_array(axes_init)]
    else:
        axes = list(range(len(shape)))
    amounts = onnx.numpy_helper.to_array(pads).astype(int).tolist()
    begins, ends = amounts[: len(axes)], amounts[len(axes) :]
    if any(v < 0 for v in amounts) or any(
        b > shape[a] or e > shape[a] for a, b, e in zip(axes, begins, ends, strict=True)
    ):
        return None
    (out,) = node.output
    fresh = context.fresh
    nodes = []
    current = node.input[0]
    for axis, begin, end in zip(axes, begins, ends, strict=True):
        if not begin and not end:
            continue
        parts = []
        axis_name = context.constant(np.array([axis], np.int64), f"{out}_axis{axis}")
        for start, stop, tag in ((shape[axis] - begin, shape[axis], "head"), (0, end, "tail")):
            if stop > start:
                piece = fresh(f"{out}_{tag}{axis}")
                bounds = [
                    context.constant(np.array([v], np.int64), f"{out}_{tag}{axis}_{k}")
                    for k, v in (("start", start), ("stop", stop))
                ]
                nodes.append(helper.make_node("Slice", [current, *bounds, axis_name], [piece]))
                parts.append((tag, piece))
        joined = fresh(f"{out}_wrapped{axis}")
        ordered = (
            [p for t, p in parts if t == "head"] + [current] + [p for t, p in parts if t == "tail"]
        )
        nodes.append(helper.make_node("Concat", ordered, [joined], axis=axis))
        current = joined
    if not nodes:
        return None
    nodes[-1].output[0] = out
    return nodes, f"{node_label(node)} (wrap) -> Concat of the wrapped slices"


def _from_exp(node: onnx.NodeProto, context: NodeRewrite) -> Rewrite | None:
    """Sinh, Cosh -> (e^x -+ e^-x) / 2; Asinh -> sign(x) log(|x| + sqrt(x^2 + 1)); Acosh ->
    log(x + sqrt(x^2 - 1)); Atanh -> log((1 + x) / (1 - x)) / 2; Acos -> pi / 2 - Asin(x)."""
    (x,) = node.input
    (out,) = node.output
    fresh = context.fresh
    op = node.op_type

    def const(value: float, base: str) -> str:
        return context.constant(np.array(value, np.float32), f"{out}_{base}")

    if op in ("Sinh", "Cosh"):
        up, negated, down, combined = (
            fresh(f"{out}_{s}") for s in ("exp", "neg", "exp_neg", "sum")
        )
        nodes = [
            helper.make_node("Exp", [x], [up]),
            helper.make_node("Neg", [x], [negated]),
            helper.make_node("Exp", [negated], [down]),
            helper.make_node("Sub" if op == "Sinh" else "Add", [up, down], [combined]),
            helper.make_node("Mul", [combined, const(0.5, "half")], [out]),
        ]
        return nodes, f"{node_label(node)} -> (e^x {'-' if op == 'Sinh' else '+'} e^-x) / 2"
    if op == "Acos":
        sine = fresh(f"{out}_asin")
        nodes = [
            helper.make_node("Asin", [x], [sine]),
            helper.make_node("Sub", [const(np.pi / 2, "half_pi"), sine], [out]),
        ]
        return nodes, f"{node_label(node)} -> pi / 2 - Asin(x)"
    if op == "Atanh":
        plus, minus, ratio, logged = (
            fresh(f"{out}_{s}") for s in ("plus", "minus", "ratio", "log")
        )
        one = const(1.0, "one")
        nodes = [
            helper.make_node("Add", [one, x], [plus]),
            helper.make_node("Sub", [one, x], [minus]),
            helper.make_node("Div", [plus, minus], [ratio]),
            helper.make_node("Log", [ratio], [logged]),
            helper.make_node("Mul", [logged, const(0.5, "half")], [out]),
        ]
        return nodes, f"{node_label(node)} -> log((1 + x) / (1 - x)) / 2"
    size, square, shifted, root, total, logged, sign = (
        fresh(f"{out}_{s}") for s in ("abs", "sq", "shifted", "sqrt", "sum", "log", "sign")
    )
    if op == "Asinh":  # odd, and from |x| so that large negative x loses nothing to cancellation
        nodes = [
            helper.make_node("Abs", [x], [size]),
            helper.make_node("Mul", [x, x], [square]),
            helper.make_node("Add", [square, const(1.0, "one")], [shifted]),
            helper.make_node("Sqrt", [shifted], [root]),
            helper.make_node("Add", [size, root], [total]),
            helper.make_node("Log", [total], [logged]),
            helper.make_node("Sign", [x], [sign]),
            helper.make_node("Mul", [sign, logged], [out]),
        ]
        return nodes, f"{node_label(node)} -> sign(x) log(|x| + sqrt(x^2 + 1))"
    nodes = [  # Acosh
        helper.make_node("Mul", [x, x], [square]),
        helper.make_node("Sub", [square, const(1.0, "one")], [shifted]),
        helper.make_node("Sqrt", [shifted], [root]),
        helper.make_node("Add", [x, root], [total]),
        helper.make_node("Log", [total], [out]),
    ]
    return nodes, f"{node_label(node)} -> log(x + sqrt(x^2 - 1))"


def _gemm_scaled(node: onnx.NodeProto, context: NodeRewrite) -> Rewrite | None:
    """Gemm with alpha or beta other than 1 and constant B and C -> alpha folded into B, beta
    into C. Why: the QNN EP leaves such a Gemm on the CPU, and onnxruntime's quantizer
    quantizes its bias as if beta were 1 (measured: alpha 0.5, beta 2, 8.7 dB vs float)."""
    alpha, beta = float(attribute(node, "alpha", 1.0)), float(attribute(node, "beta", 1.0))
    weights = context.inits.get(node.input[1])
    bias = context.inits.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    has_bias = len(node.input) > 2 and bool(node.input[2])
    if (alpha == 1.0 and beta == 1.0) or weights is None or (has_bias and bias is None):
        return None
    out = node.output[0]
    scaled_w = onnx.numpy_helper.to_array(weights).astype(np.float64) * alpha
    inputs = [node.input[0], context.constant(scaled_w.astype(np.float32), f"{out}_alpha_b")]
    if bias is not None:
        scaled_c = onnx.numpy_helper.to_array(bias).astype(np.float64) * beta
        inputs.append(context.constant(scaled_c.astype(np.float32), f"{out}_beta_c"))
    kept = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    kept = {k: v for k, v in kept.items() if k in ("transA", "transB")}
    rewritten = helper.make_node("Gemm", inputs, list(node.output), name=node.name, **kept)
    return [rewritten], f"{node_label(node)}: alpha {alpha:g} into B, beta {beta:g} into C"


def _compress(node: onnx.NodeProto, context: NodeRewrite) -> Rewrite | None:
    """Compress with a constant condition -> Gather of the indices it keeps (a static shape;
    a computed condition keeps its data-dependent size and the error that says so)."""
    condition = context.inits.get(node.input[1])
    shape = context.shape(node.input[0])
    if condition is None or shape is None:
        return None
    kept = np.flatnonzero(onnx.numpy_helper.to_array(condition).astype(bool)).astype(np.int64)
    out = node.output[0]
    indices = context.constant(kept, f"{out}_kept")
    axis = attribute(node, "axis", None)
    if axis is None:  # over the flattened input
        flat = context.fresh(f"{out}_flat")
        whole = context.constant(np.array([-1], np.int64), f"{out}_flat_shape")
        nodes = [
            helper.make_node("Reshape", [node.input[0], whole], [flat]),
            helper.make_node("Gather", [flat, indices], [out], axis=0),
        ]
    else:
        nodes = [helper.make_node("Gather", [node.input[0], indices], [out], axis=int(axis))]
    return nodes, f"{node_label(node)} -> Gather of the {kept.size} constant indices it keeps"


_REWRITES: dict[str, NodeRule] = {
    "GlobalLpPool": _global_lp_pool,
    "Hardmax": _hardmax,
    "OneHot": _one_hot,
    "Trilu": _trilu,
    "Mod": _mod,
    "Erf": _erf,
    "CumSum": _cum_sum,
    "MaxPool": _max_pool,
    "MaxUnpool": _max_unpool,
    "Pad": _pad_wrap,
    "LpPool": _lp_pool,
    "Sinh": _from_exp,
    "Cosh": _from_exp,
    "Asinh": _from_exp,
    "Acosh": _from_exp,
    "Atanh": _from_exp,
    "Acos": _from_exp,
    "Gemm": _gemm_scaled,
    "Compress": _compress,
}


def ops_without_qnn_kernels(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Each op of ``_REWRITES`` the QNN EP has no kernel for -> ops it runs (module doc)."""

    return replace_by_op(passed_on(model), "ops_without_qnn_kernels", _REWRITES, DEFAULT_DOMAINS)


# How many nodes may lie between a NonZero and the indices / updates of the ScatterND that
# writes at its positions (TorchScript spends ~20 on ``x[torch.where(c)] = v``).
_POSITION_CHAIN_MAX = 64


def _chain_from_nonzero(
    names: list[str], context: NodeRewrite
) -> tuple[onnx.NodeProto, list[onnx.NodeProto]] | None:
    """The one NonZero that ``names`` are computed from, with nothing else but constants, and
    the nodes between (in graph order); None for anything else (a graph input, a second
    NonZero, a tensor of the network, a chain over ``_POSITION_CHAIN_MAX``)."""
    nonzero: onnx.NodeProto | None = None
    chain: dict[str, onnx.NodeProto] = {}
    stack = [n for n in names if n]
    seen: set[str] = set()
    while stack:
        name = stack.pop()
        if name in seen or name in context.inits:
            continue
        seen.add(name)
        producer = context.producers.get(name)
        if producer is None or producer.domain not in DEFAULT_DOMAINS:
            return None
        if producer.op_type == "NonZero":
            if nonzero is not None and nonzero.output[0] != name:
                return None
            nonzero = producer
            continue
        if any(True for a in producer.attribute if a.type in (a.GRAPH, a.GRAPHS)):
            return None
        chain.setdefault(producer.output[0], producer)
        if len(chain) > _POSITION_CHAIN_MAX:
            return None
        stack.extend(i for i in producer.input if i)
    if nonzero is None:
        return None
    order = {n.output[0]: i for i, n in enumerate(context.model.graph.node) if n.output}
    return nonzero, sorted(chain.values(), key=lambda n: order.get(n.output[0], 0))


def _probe_conditions(shape: tuple[int, ...]) -> list[np.ndarray]:
    """Conditions whose positions tell a chain that passes NonZero's positions on from one
    that computes something else with them: one true value, and three (seeded)."""
    size = int(np.prod(shape))
    rng = np.random.default_rng(0)
    probes = []
    for count in sorted({1, min(3, size)}):
        flat = np.zeros(size, bool)
        flat[rng.choice(size, count, replace=False)] = True
        probes.append(flat.reshape(shape))
    return probes


def _positions_fill(
    node: onnx.NodeProto,
    nonzero: onnx.NodeProto,
    chain: list[onnx.NodeProto],
    condition_shape: tuple[int, ...],
    data_shape: tuple[int, ...],
    context: NodeRewrite,
) -> np.ndarray | None:
    """The one value ``node`` writes, when its indices are exactly NonZero's positions (as
    rows) and its updates that value at each, for every probe condition; else None."""
    from .transforms import run_nodes

    rank = len(condition_shape)
    fill: np.ndarray | None = None
    needed = {i for n in chain for i in n.input if i in context.inits}
    constants = {i: onnx.numpy_helper.to_array(context.inits[i]) for i in needed}
    for condition in _probe_conditions(condition_shape):
        positions = np.array(np.nonzero(condition), np.int64)
        values = {**constants, nonzero.output[0]: positions}
        try:
            computed = run_nodes(chain, values, context.model) if chain else {}
        except Exception:  # onnxruntime cannot run the chain alone: keep the scatter
            return None
        computed = {**values, **computed}
        indices, updates = computed.get(node.input[1]), computed.get(node.input[2])
        if indices is None or updates is None:
            return None
        count = positions.shape[1]
        if indices.shape != (count, rank) or not np.array_equal(indices, positions.T):
            return None
        if updates.shape != (count, *data_shape[rank:]) or updates.size == 0:
            return None
        value = updates.reshape(-1)[:1]
        if not (updates == value[0]).all() or (fill is not None and fill[0] != value[0]):
            return None
        fill = value
    return fill


def _scatter_at_positions(node: onnx.NodeProto, context: NodeRewrite) -> Rewrite | None:
    """ScatterND(data, indices, updates) whose indices are NonZero(c)'s positions and whose
    updates one value v -> Where(c, v, data) (``reduction = "add"``: Where(c, data + v, data)).

    TorchScript writes ``x[torch.where(c)] = v`` so (Mask2Former/OneFormer's masked attention:
    ``attn_mask[torch.where(attn_mask.sum(-1) == attn_mask.shape[-1])] = False``): NonZero ->
    Transpose -> Split -> Squeeze -> Expand -> Concat -> ScatterND, every shape after the
    NonZero decided by the data, so nothing after it reaches the NPU. NonZero lists each
    position once, so a scatter there is a select. Whether indices and updates are that is
    not read from the ops between (each exporter spells them its own way) but computed: the
    chain runs on the positions of probe conditions, and must give them back as rows and one
    value for each."""
    reduction = attribute(node, "reduction", b"none")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    found = _chain_from_nonzero([node.input[1], node.input[2]], context)
    if reduction not in ("none", "add") or found is None:
        return None  # before any shape: inferring them is the costly part
    data_shape = context.shape(node.input[0])
    if data_shape is None:
        return None
    nonzero, chain = found
    condition_shape = context.shape(nonzero.input[0])
    if (
        condition_shape is None
        or not condition_shape
        or 0 in condition_shape
        or tuple(data_shape[: len(condition_shape)]) != tuple(condition_shape)
    ):
        return None
    fill = _positions_fill(node, nonzero, chain, condition_shape, data_shape, context)
    if fill is None or (reduction == "add" and fill.dtype == np.bool_):
        return None
    out = node.output[0]
    nodes = []
    condition = nonzero.input[0]
    if context.elem_type(condition) != onnx.TensorProto.BOOL:  # NonZero takes x != 0
        condition = context.fresh(f"{out}_condition")
        nodes.append(
            helper.make_node("Cast", [nonzero.input[0]], [condition], to=onnx.TensorProto.BOOL)
        )
    trailing = len(data_shape) - len(condition_shape)
    if trailing:
        shape = np.array([*condition_shape, *[1] * trailing], np.int64)
        reshaped = context.fresh(f"{out}_condition")
        target = context.constant(shape, f"{out}_condition_shape")
        nodes.append(helper.make_node("Reshape", [condition, target], [reshaped]))
        condition = reshaped
    label = f"{node_label(node)} at the positions of NonZero '{nonzero.name}' ({len(chain)} node(s) between)"
    if fill.dtype == np.bool_:  # onnxruntime's CPU has no boolean Where: logic says the same
        if fill[0]:
            nodes.append(helper.make_node("Or", [node.input[0], condition], [out]))
            return nodes, f"{label} -> Or(data, condition)"
        kept = context.fresh(f"{out}_kept")
        nodes.append(helper.make_node("Not", [condition], [kept]))
        nodes.append(helper.make_node("And", [node.input[0], kept], [out]))
        return nodes, f"{label} -> And(data, Not(condition))"
    value = context.constant(fill.reshape(()), f"{out}_fill")
    written = value
    if reduction == "add":
        written = context.fresh(f"{out}_added")
        nodes.append(helper.make_node("Add", [node.input[0], value], [written]))
    nodes.append(helper.make_node("Where", [condition, written, node.input[0]], [out]))
    what = "data + " if reduction == "add" else ""
    return nodes, f"{label} -> Where(condition, {what}{fill[0].item()!r}, data)"


def positions_written_as_where(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A ScatterND writing one value at the positions a NonZero lists -> a Where over its
    condition (``_scatter_at_positions``): the NonZero and its data-sized chain go with it."""

    return replace_by_op(
        passed_on(model),
        "positions_written_as_where",
        {"ScatterND": _scatter_at_positions},
        DEFAULT_DOMAINS,
    )
