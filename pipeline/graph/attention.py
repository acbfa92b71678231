"""Transformer encoders: contrib ops shape inference cannot type, infinite attention-mask fills.

- ``standard_gelu``: onnxruntime's ``qnn_preprocess_model`` fuses the Erf-GELU patterns of
  TensorFlow and Keras exports into a *com.microsoft* ``Gelu`` (only PyTorch's pattern becomes
  the opset-20 ai.onnx ``Gelu`` via onnxruntime's own optimizer); ONNX shape inference has no
  schema for it, every tensor after it loses its type, and ``store_inferred_shapes`` ends in
  "Field 'shape' of 'type' is required but missing". At opset >= 20 the same functions are
  standard ops: Gelu, FastGelu (= Gelu tanh approximation) and BiasGelu (= Add + Gelu).
- ``fuse_erf_gelu``: PyTorch writes GELU below opset 20 as ``x * (erf(x / sqrt 2) + 1) * 0.5``
  (in several association orders). onnxruntime fuses it into one op only at session load, and
  ``qnn_preprocess_model`` only in the TensorFlow/Keras orders; quantized, the Erf of the others
  stays on the CPU (the QNN HTP takes no quantized Erf), cutting every encoder layer out of the
  NPU graph (a 6-layer MiniLM: 7 partitions, 18 CPU nodes). Every order becomes ai.onnx Gelu.
- ``finite_mask_fills``: ``Where(mask, -inf, scores) -> Softmax`` (PyTorch ``masked_fill``)
  gives every masked score -inf. In float that is exp(-inf) = 0; quantized, the tensor's range
  is infinite, the scale inf, and QNN refuses the graph ("Failed to compose Qnn graph"). A
  finite fill far below any score (``MASK_FILL``) gives the same Softmax in float32 (exp
  underflows to exactly 0 below -104); the range rule ``mask_fill_ranges`` of
  ``pipeline.calibration.ranges`` then keeps the masked positions from stretching the range.
  The additive form of current transformers exports, ``scores + (1 - mask) * finfo.min``, has
  the same problem in its constant: finfo.min's symmetric range overflows to an infinite
  span (NaN zero points; QDQ vs float 0.2 dB on a small block). Its Mul constant gets the
  same finite fill.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import numpy_helper

from . import edit
from .edit import Change

# Far below any attention score, far above float32's lowest: exp(MASK_FILL - score) is exactly
# 0 in float32 for any score above -1e9 + 104, and adding a bias to it cannot overflow.
MASK_FILL = -1e9
# Ops between a masked score tensor and its Softmax that move values without changing them.
SHAPE_OPS = frozenset({"Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Identity"})
# Ops that only select or repeat the values of their first input (a mask bias on its way to
# the scores it is added to).
MASK_CARRIERS = SHAPE_OPS | {"Slice", "Expand", "Tile", "Gather"}
_DEFAULT = ("", "ai.onnx")
_MS = "com.microsoft"


def _plain_readers(
    model: onnx.ModelProto,
) -> Callable[[str], list[onnx.NodeProto] | None]:
    """A lookup: the nodes reading a tensor, or None when it is a graph output, unread, or
    read by an op outside the default domain (a walk over readers stops there)."""
    readers = edit.readers_by_tensor(model.graph)
    outputs = {o.name for o in model.graph.output}

    def lookup(name: str) -> list[onnx.NodeProto] | None:
        found = readers.get(name, [])
        if not found or name in outputs or any(n.domain not in _DEFAULT for n in found):
            return None
        return found

    return lookup


def softmax_chains(model: onnx.ModelProto, start: str) -> list[list[str]]:
    """The tensors from ``start`` to each Softmax it reaches through ``SHAPE_OPS`` only
    (``start`` first, the Softmax input last); [] when a reader is anything else."""
    plain_readers = _plain_readers(model)
    chains: list[list[str]] = []

    def walk(path: list[str]) -> bool:
        name = path[-1]
        found = plain_readers(name)
        if found is None:
            return False
        for node in found:
            if node.op_type == "Softmax" and node.input[0] == name:
                chains.append(path)
            elif node.op_type in SHAPE_OPS and node.input[0] == name:
                if not walk([*path, node.output[0]]):
                    return False
            else:
                return False
        return True

    return chains if walk([start]) else []


def _additive_mask(model: onnx.ModelProto, start: str) -> bool:
    """True when every path from ``start`` is added to scores on their way to a Softmax:
    through ``MASK_CARRIERS`` (a Slice of a mask made for the longest sequence, the Expand of
    a padding bias to every head, the Gather of a learned position bias whose padding row is
    -inf), then an Add whose result reaches Softmax (``softmax_chains``) or is itself such a
    bias (T5 adds the mask to its position bias, then that to every layer's
    scores). One bias may feed every layer's Add."""
    plain_readers = _plain_readers(model)

    def added(name: str) -> bool:
        found = plain_readers(name)
        if found is None:
            return False
        for node in found:
            if node.op_type in MASK_CARRIERS and node.input[0] == name:
                if not added(node.output[0]):
                    return False
            elif node.op_type != "Add" or not (
                softmax_chains(model, node.output[0]) or added(node.output[0])
            ):
                return False
        return True

    return added(start)


def _finite_fill(
    graph: onnx.GraphProto, namer: edit.FreshNames, name: str, value: np.ndarray
) -> str:
    """A new initializer holding ``MASK_FILL`` in the shape and type of ``value``."""
    fill = namer(f"{name}_finite_mask_fill")
    graph.initializer.append(
        numpy_helper.from_array(np.full(value.shape, MASK_FILL, value.dtype), fill)
    )
    return fill


def finite_mask_fills(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A mask fill far below ``MASK_FILL`` (-inf, finfo.min) -> ``MASK_FILL``: the constant of
    Where(c, fill, x) / Where(c, x, fill) feeding only Softmax, or only added to scores that
    go to Softmax (masked_fill of a mask bias); the scalar c of Mul(m, c) only added to
    scores that go to Softmax (``(1 - mask) * finfo.min``); and the fills inside a constant
    mask only added to scores (CLIP's causal mask, finfo.min above the diagonal: its text
    encoder quantized was at -2.1 dB vs float on the CPU even with 16 bits everywhere).

    Same function in float32 (exp of the fill underflows to exactly 0, as exp(-inf) does),
    except on a row where *every* position is masked: -inf gives NaN there, the finite fill a
    uniform distribution. The fill gets its own initializer, so a constant shared with
    something else keeps its value there.
    """
    model = edit.writable(model)
    graph = model.graph
    inits = edit.initializers_by_name(graph)
    namer = edit.FreshNames(model)
    details = []
    # The fill's slots: Where(c, fill, x) / Where(c, x, fill); Mul(m, c) / Mul(c, m).
    slots = {"Where": (3, (1, 2), "mask fill"), "Mul": (2, (0, 1), "additive mask scale")}
    for node in graph.node:
        if node.op_type not in slots or node.domain not in _DEFAULT:
            continue
        arity, candidates, what = slots[node.op_type]
        if len(node.input) != arity:
            continue
        for slot in candidates:
            name = node.input[slot]
            if name not in inits:
                continue
            value = numpy_helper.to_array(inits[name])
            if value.size != 1 or value.dtype.kind != "f" or not (value < MASK_FILL).all():
                continue
            out = node.output[0]
            into_softmax = node.op_type == "Where" and softmax_chains(model, out)
            if not into_softmax and not _additive_mask(model, out):
                continue
            node.input[slot] = _finite_fill(graph, namer, name, value)
            details.append(f"{edit.node_label(node)}: {what} {value.flat[0]:g} -> {MASK_FILL:g}")
    for init in list(graph.initializer):  # a mask made whole, its fill in it (causal masks)
        value = numpy_helper.to_array(init)
        if value.size < 2 or value.dtype.kind != "f" or not (value < MASK_FILL).any():
            continue
        if not _additive_mask(model, init.name):
            continue
        # every reader adds it to scores (``_additive_mask``): its value changes in place
        init.CopyFrom(
            numpy_helper.from_array(np.where(value < MASK_FILL, MASK_FILL, value), init.name)
        )
        details.append(
            f"constant mask {init.name!r}: {int((value < MASK_FILL).sum())} fill(s) "
            f"{value.min():g} -> {MASK_FILL:g}"
        )
    edit.remove_dead_nodes(graph)
    return edit.checked_change(model, "finite_mask_fills", details)


def _near(value: float | None, target: float) -> bool:
    return value is not None and abs(value - target) <= 1e-4 * abs(target)


def _erf_gelu_match(
    node: onnx.NodeProto,
    producer: Callable[[str], onnx.NodeProto | None],
    only_reader: Callable[[str], onnx.NodeProto | None],
    scalar: Callable[[str], float | None],
) -> tuple[str, str] | None:
    """(x, output) when the Erf ``node`` is the core of x * (erf(x / sqrt 2) + 1) * 0.5 in any
    association order and every intermediate has that chain as its only reader; else None."""

    def other(mul: onnx.NodeProto, name: str) -> str | None:
        if mul.op_type != "Mul" or len(mul.input) != 2 or name not in mul.input:
            return None
        return mul.input[1] if mul.input[0] == name else mul.input[0]

    scaled = producer(node.input[0])
    if scaled is None or len(scaled.input) != 2:
        return None
    a, b = scaled.input
    by_divisor = scaled.op_type == "Div" and _near(scalar(b), 2**0.5)
    if by_divisor or (scaled.op_type == "Mul" and _near(scalar(b), 0.5**0.5)):
        x = a
    elif scaled.op_type == "Mul" and _near(scalar(a), 0.5**0.5):
        x = b
    else:
        return None
    if only_reader(node.input[0]) is None:
        return None
    add = only_reader(node.output[0])
    if add is None or add.op_type != "Add" or len(add.input) != 2:
        return None
    if not _near(scalar(add.input[1] if add.input[0] == node.output[0] else add.input[0]), 1.0):
        return None
    first = only_reader(add.output[0])
    partner = other(first, add.output[0]) if first is not None else None
    if first is None or partner is None:
        return None
    if partner == x or _near(scalar(partner), 0.5):  # (x * f) * 0.5 or (f * 0.5) * x
        second = only_reader(first.output[0])
        rest = other(second, first.output[0]) if second is not None else None
        if rest is None or not (_near(scalar(rest), 0.5) if partner == x else rest == x):
            return None
        return x, second.output[0]
    half_x = producer(partner)  # f * (x * 0.5)
    if half_x is None or only_reader(partner) is None or other(half_x, x) is None:
        return None
    if not _near(scalar(other(half_x, x) or ""), 0.5):
        return None
    return x, first.output[0]


def fuse_erf_gelu(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """x * (erf(x / sqrt 2) + 1) * 0.5, in any association order -> ai.onnx Gelu (opset >= 20;
    below, com.microsoft Gelu).

    The same function (ai.onnx Gelu's definition); the QNN HTP computes Gelu but no quantized
    Erf. Intermediates read by anything else keep the chain as it is.
    """
    model = edit.writable(model)
    # Below opset 20 (a pre-quantized model keeps its opset) there is no ai.onnx Gelu: the
    # com.microsoft Gelu onnxruntime's own fusion writes, which the QNN EP takes too.
    contrib = edit.opset_version(model) < 20
    graph = model.graph
    inits = edit.initializers_by_name(graph)
    producers = {o: n for n in graph.node for o in n.output}
    plain_readers = _plain_readers(model)

    def only_reader(name: str) -> onnx.NodeProto | None:
        found = plain_readers(name)
        return found[0] if found is not None and len(found) == 1 else None

    def scalar(name: str) -> float | None:
        if name not in inits:
            return None
        array = numpy_helper.to_array(inits[name])
        if array.size != 1 or array.dtype.kind != "f":
            return None
        return float(array.flat[0])

    namer = edit.FreshNames(model)
    details = []
    fused: dict[str, onnx.NodeProto] = {}  # the chain's last output -> its Gelu
    for node in graph.node:
        if node.op_type != "Erf" or node.domain not in _DEFAULT:
            continue
        match = _erf_gelu_match(node, producers.get, only_reader, scalar)
        if match is None:
            continue
        x, out = match
        name = namer(f"{node.name or out}_gelu")
        fused[out] = _gelu(x, out, name, "none")
        if contrib:
            fused[out].domain = _MS
        details.append(f"{edit.node_label(node)}: x * (erf(x / sqrt 2) + 1) * 0.5 -> Gelu")
    if fused:
        nodes = [fused.get(n.output[0], n) if n.output else n for n in graph.node]
        edit.set_nodes(graph, nodes)
        edit.remove_dead_nodes(graph)
        if contrib and not any(o.domain == _MS for o in model.opset_import):
            model.opset_import.append(onnx.helper.make_opsetid(_MS, 1))
    return edit.checked_change(model, "fuse_erf_gelu", details)


def _gelu(x: str, y: str, name: str, approximate: str) -> onnx.NodeProto:
    if approximate == "none":
        return onnx.helper.make_node("Gelu", [x], [y], name=name)
    return onnx.helper.make_node("Gelu", [x], [y], name=name, approximate=approximate)


def standard_gelu(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """com.microsoft Gelu / FastGelu / BiasGelu -> ai.onnx Gelu (+ Add for a bias), opset >= 20.

    The contrib ops compute 0.5 x (1 + erf(x / sqrt 2)) (Gelu, BiasGelu of x + bias) and the
    tanh approximation (FastGelu), exactly what ai.onnx Gelu computes with approximate "none"
    and "tanh"; ONNX shape inference types the standard op.
    """
    model = edit.writable(model)
    if edit.opset_version(model) < 20:
        return edit.checked_change(model, "standard_gelu", [])
    graph = model.graph
    namer = edit.FreshNames(model)
    details = []
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        kind = node.op_type if node.domain == _MS else ""
        if kind not in ("Gelu", "FastGelu", "BiasGelu"):
            nodes.append(node)
            continue
        base = node.name or namer(f"{node.output[0]}_gelu")
        approximate = "tanh" if kind == "FastGelu" else "none"
        x = node.input[0]
        bias = node.input[1] if len(node.input) > 1 and node.input[1] else ""
        if bias:
            summed = namer(f"{node.output[0]}_biased")
            nodes.append(
                onnx.helper.make_node("Add", [x, bias], [summed], name=namer(f"{base}_bias"))
            )
            x = summed
        nodes.append(_gelu(x, node.output[0], base, approximate))
        ops = "Add + Gelu" if bias else "Gelu"
        details.append(f"{kind} {base!r} (com.microsoft) -> {ops} (approximate {approximate})")
    if details:
        edit.set_nodes(graph, nodes)
        used = {n.domain for g in edit.all_graphs(graph) for n in g.node}
        if _MS not in used:
            kept = [onnx.helper.make_opsetid(o.domain, o.version) for o in model.opset_import]
            kept = [o for o in kept if o.domain != _MS]
            del model.opset_import[:]
            model.opset_import.extend(kept)
    return edit.checked_change(model, "standard_gelu", details)


def layernorm_over_last_axis(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A LayerNormalization over several trailing axes (PyTorch ``nn.LayerNorm((C, F))``,
    axis -2) -> Reshape to one flat last axis, LayerNormalization over it, Reshape back.

    The same function: the statistics are taken over the same elements and scale and bias
    are flattened in the same order. The QNN EP takes LayerNorm over the last axis only and
    leaves the others on the CPU with their Q/DQ (LiSenNet's dual-path blocks: 4 LayerNorms
    cut the graph into 6 partitions). Left alone: unknown shapes, a scale or bias that is not
    a constant, or the optional mean / inverse-deviation outputs read by something.
    """
    model = edit.writable(model)
    graph = model.graph
    targets = [
        i
        for i, node in enumerate(graph.node)
        if node.op_type == "LayerNormalization" and node.domain in _DEFAULT
    ]
    if not targets:
        return edit.checked_change(model, "layernorm_over_last_axis", [])
    values = edit.inferred_values(model)
    inits = edit.initializers_by_name(graph)
    fresh = edit.FreshNames(model)
    details = []
    replace: dict[int, list[onnx.NodeProto]] = {}
    for index in targets:
        node = graph.node[index]
        x = values.get(node.input[0])
        shape = edit.value_shape(x) if x is not None else None
        if shape is None or any(d <= 0 for d in shape):
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), -1) % len(shape)
        if axis == len(shape) - 1 or any(name for name in node.output[1:]):
            continue
        params = [n for n in node.input[1:3] if n]
        if any(name not in inits for name in params):
            continue
        normalized = shape[axis:]
        flat = [*shape[:axis], int(np.prod(normalized))]
        base = node.name or node.output[0]
        flat_params = []
        for name in params:
            array = numpy_helper.to_array(inits[name])
            flattened = np.broadcast_to(array, normalized).reshape(-1).astype(array.dtype)
            flat_params.append(fresh(f"{name}_flat"))
            graph.initializer.append(numpy_helper.from_array(flattened, flat_params[-1]))
        shapes = {}
        for tag, dims in (("flat_shape", flat), ("shape", list(shape))):
            shapes[tag] = fresh(f"{base}_{tag}")
            graph.initializer.append(numpy_helper.from_array(np.array(dims, np.int64), shapes[tag]))
        flat_x, flat_y = fresh(f"{base}_flat_in"), fresh(f"{base}_flat_out")
        norm = onnx.helper.make_node(
            "LayerNormalization", [flat_x, *flat_params], [flat_y], name=base, axis=-1
        )
        norm.attribute.extend(a for a in node.attribute if a.name not in ("axis",))
        replace[index] = [
            onnx.helper.make_node(
                "Reshape",
                [node.input[0], shapes["flat_shape"]],
                [flat_x],
                name=fresh(f"{base}_flatten"),
            ),
            norm,
            onnx.helper.make_node(
                "Reshape",
                [flat_y, shapes["shape"]],
                [node.output[0]],
                name=fresh(f"{base}_unflatten"),
            ),
        ]
        details.append(
            f"{edit.node_label(node)}: over {len(normalized)} axes {list(normalized)} -> over one of "
            f"{flat[-1]}"
        )
    if replace:
        nodes = [n for i, node in enumerate(graph.node) for n in replace.get(i, [node])]
        edit.set_nodes(graph, nodes)
        edit.remove_dead_nodes(graph)
    return edit.checked_change(model, "layernorm_over_last_axis", details)


def _attention_op(node: onnx.NodeProto, context: edit.NodeRewrite) -> tuple[list, str] | None:
    """ONNX ``Attention`` (opset 23) -> per-head MatMul, scaled scores, the mask, Softmax and
    the weighted values (the forms ``finite_mask_fills`` and the range rules know). 3-D
    inputs are split into heads and merged back; fewer key/value heads than query heads
    (grouped-query attention) are repeated; past keys and values are joined in front.
    Left as it is: softcapped scores, the scores output, a causal mask beside past state."""
    given = [*node.input, *[""] * (6 - len(node.input))]
    q, k, v, mask, past_k, past_v = given[:6]
    used = [i for i, name in enumerate(node.output) if name]
    if any(i > 2 for i in used) or float(edit.attribute(node, "softcap", 0.0)):
        return None
    if len(node.input) > 6 and node.input[6]:
        return None  # the padded key lengths of opset 24
    causal = int(edit.attribute(node, "is_causal", 0))
    if causal and (past_k or past_v):
        return None
    if bool(past_k) != bool(past_v):
        return None
    q_shape, k_shape, v_shape = (context.shape(n) for n in (q, k, v))
    if q_shape is None or k_shape is None or v_shape is None:
        return None

    def heads_of(shape: tuple[int, ...], attribute: int) -> int | None:
        """A 4-D input's heads; a [B, S, H * D] one's from its attribute, when it divides."""
        if len(shape) == 4:
            return shape[1]
        ok = len(shape) == 3 and attribute > 0 and shape[2] % attribute == 0
        return attribute if ok else None

    kv_given = int(edit.attribute(node, "kv_num_heads", 0))
    q_heads = heads_of(q_shape, int(edit.attribute(node, "q_num_heads", 0)))
    kv_heads = heads_of(k_shape, kv_given)
    if q_heads is None or kv_heads is None or heads_of(v_shape, kv_given) is None:
        return None
    if q_heads % kv_heads:
        return None
    past_len = (context.shape(past_k) or (0, 0, 0))[2] if past_k else 0
    q_len = q_shape[2] if len(q_shape) == 4 else q_shape[1]
    k_len = past_len + (k_shape[2] if len(k_shape) == 4 else k_shape[1])
    out = node.output[0]
    fresh = context.fresh
    nodes: list[onnx.NodeProto] = []

    def const(value: object, dtype: type, base: str) -> str:
        return context.constant(np.array(value, dtype), f"{out}_{base}")

    def add(op: str, inputs: list[str], base: str, **attrs: object) -> str:
        name = fresh(f"{out}_{base}")
        nodes.append(onnx.helper.make_node(op, inputs, [name], **attrs))
        return name

    def to_heads(name: str, shape: tuple[int, ...], heads: int, base: str) -> str:
        """A [B, S, H * D] input as [B, H, S, D]; a 4-D one as it is."""
        if len(shape) == 4:
            return name
        split = add(
            "Reshape", [name, const([0, 0, heads, shape[2] // heads], np.int64, base)], base
        )
        return add("Transpose", [split], f"{base}_heads", perm=[0, 2, 1, 3])

    q4 = to_heads(q, q_shape, q_heads, "q")
    k4, v4 = to_heads(k, k_shape, kv_heads, "k"), to_heads(v, v_shape, kv_heads, "v")
    if past_k:
        k4 = add("Concat", [past_k, k4], "keys", axis=2)
        v4 = add("Concat", [past_v, v4], "values", axis=2)
    presents = {1: k4, 2: v4}
    group = q_heads // kv_heads
    head = q_shape[3] if len(q_shape) == 4 else q_shape[2] // q_heads
    batch = q_shape[0]
    keys, values = k4, v4
    if group > 1:  # each key/value head serves `group` query heads, in order
        repeated = []
        for name, width in (
            (k4, head),
            (v4, (v_shape[3] if len(v_shape) == 4 else v_shape[2] // kv_heads)),
        ):
            wide = add("Unsqueeze", [name, const([2], np.int64, "group_axis")], "grouped")
            wide = add(
                "Expand",
                [wide, const([batch, kv_heads, group, k_len, width], np.int64, "group_shape")],
                "expanded",
            )
            repeated.append(
                add(
                    "Reshape",
                    [wide, const([batch, q_heads, k_len, width], np.int64, "heads_shape")],
                    "repeated",
                )
            )
        keys, values = repeated
    scale = float(edit.attribute(node, "scale", 0.0)) or 1.0 / float(np.sqrt(head))
    keys_t = add("Transpose", [keys], "keys_t", perm=[0, 1, 3, 2])
    scores = add("MatMul", [q4, keys_t], "scores")
    scaled = add("Div", [scores, const(1.0 / scale, np.float32, "sqrt_d")], "scaled")
    keep = None
    logits = scaled
    if mask:
        mask_type = context.elem_type(mask)
        if mask_type == onnx.TensorProto.BOOL:
            keep = mask
        else:
            logits = add("Add", [scaled, mask], "masked")
    if causal:
        lower = np.tril(np.ones((q_len, k_len), dtype=bool))
        triangle = context.constant(lower, f"{out}_causal")
        keep = triangle if keep is None else add("And", [keep, triangle], "keep")
    if keep is not None:
        fill = const(-np.inf, np.float32, "fill")
        logits = add("Where", [keep, logits, fill], "masked")
    probs = add("Softmax", [logits], "probs", axis=-1)
    mixed = add("MatMul", [probs, values], "mixed")
    if len(q_shape) == 4:
        nodes[-1].output[0] = out
    else:
        merged = add("Transpose", [mixed], "merged", perm=[0, 2, 1, 3])
        nodes.append(
            onnx.helper.make_node(
                "Reshape", [merged, const([0, 0, -1], np.int64, "y_shape")], [out]
            )
        )
    for slot in (1, 2):
        if slot in used:
            nodes.append(onnx.helper.make_node("Identity", [presents[slot]], [node.output[slot]]))
    what = f"{edit.node_label(node)} -> {q_heads} heads of MatMul / Softmax"
    if group > 1:
        what += f" ({kv_heads} key/value heads repeated)"
    return nodes, what + (" with its mask" if mask or causal else "")


def attention_op_to_matmuls(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """ONNX ``Attention`` (opset 23: PyTorch's scaled_dot_product_attention as the dynamo
    exporter writes it there) -> the ops it computes. Why: the QNN EP runs no Attention op;
    left, each stayed on the CPU and cut the graph (a BERT encoder: 3 partitions, 2 CPU nodes)."""
    return edit.replace_by_op(
        edit.passed_on(model), "attention_op_to_matmuls", {"Attention": _attention_op}, _DEFAULT
    )
