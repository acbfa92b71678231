"""Exact rewrites of numerically fragile patterns, so that 16-bit and fp16 arithmetic keep them.

A quantized tensor has one uniform step over its range; fp16 has ~3 decimal digits and flushes
values below 6e-8 to zero. Some float patterns only survive in float32: the square root of a
product of probabilities (the geometric-mean score of GFL/PP-PicoDet/NanoDet-style detection
heads, ``sqrt(sigmoid(cls) * sigmoid(obj))``) takes values like 1e-10, whose square root (1e-5) is
the answer: quantizing the product uniformly, or rounding it in fp16, leaves nothing of it. The
rewrites here compute the same function through tensors whose ranges are well conditioned.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from . import edit
from .edit import (
    DEFAULT_DOMAINS,
    Change,
    FreshNames,
    checked_change,
    inferred_values,
    node_label,
    remove_dead_nodes,
    set_nodes,
    value_shape,
    writable,
)
from .transforms import scalar_const, topological_sort


def _producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {out: node for node in graph.node for out in node.output}


def _consumers(graph: onnx.GraphProto) -> dict[str, int]:
    count: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            count[name] = count.get(name, 0) + 1
    for out in graph.output:
        count[out.name] = count.get(out.name, 0) + 1
    return count


def rewrite_sqrt_of_sigmoids(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Sqrt(Sigmoid(a) * Sigmoid(b) * ...) -> Exp(-0.5 * (Softplus(-a) + Softplus(-b) + ...)).

    Exact: log(sigmoid(x)) = -softplus(-x), so the geometric mean of probabilities is the
    exponential of half the sum of their log-probabilities. Every new tensor is well scaled
    (softplus of a logit, a sum, an exponent), where the product it replaces spans ten decades
    near zero. Measured on PP-PicoDet (HTP simulator, fp16): class scores 5.6 dB -> 32.5 dB vs
    float. Only products whose every factor is a Sigmoid used nowhere else are rewritten.
    """
    model = writable(model)
    graph = model.graph
    producer = _producers(graph)
    uses = _consumers(graph)
    fresh = FreshNames(model)
    drop: set[int] = set()
    added: list[onnx.NodeProto] = []
    details = []
    for node in graph.node:
        if node.op_type != "Sqrt" or node.domain not in ("", "ai.onnx"):
            continue
        factors, inner = _sigmoid_factors(node.input[0], producer, uses)
        if len(factors) < 2:
            continue
        half = fresh("geomean_half")
        graph.initializer.append(numpy_helper.from_array(np.array(-0.5, np.float32), half))
        terms = []
        for logit in factors:
            negated, soft = fresh("neg_logit"), fresh("softplus")
            added += [
                helper.make_node("Neg", [logit], [negated], name=fresh("geomean_neg")),
                helper.make_node("Softplus", [negated], [soft], name=fresh("geomean_softplus")),
            ]
            terms.append(soft)
        total = terms[0]
        for term in terms[1:]:
            summed = fresh("softplus_sum")
            added.append(
                helper.make_node("Add", [total, term], [summed], name=fresh("geomean_add"))
            )
            total = summed
        scaled = fresh("half_log_mean")
        added += [
            helper.make_node("Mul", [total, half], [scaled], name=fresh("geomean_mul")),
            helper.make_node("Exp", [scaled], [node.output[0]], name=fresh("geomean_exp")),
        ]
        drop.add(id(node))
        drop.update(id(n) for n in inner)
        details.append(
            f"{node_label(node)}: sqrt of a product of {len(factors)} sigmoids -> "
            "exp(-0.5 * sum(softplus(-logit)))"
        )
    if not details:
        return checked_change(model, "rewrite_sqrt_of_sigmoids", [])
    kept = [n for n in graph.node if id(n) not in drop]
    del graph.node[:]
    graph.node.extend(kept + added)
    model, _ = topological_sort(model)
    return checked_change(model, "rewrite_sqrt_of_sigmoids", details)


def _sigmoid_factors(
    tensor: str, producer: dict[str, onnx.NodeProto], uses: dict[str, int]
) -> tuple[list[str], list[onnx.NodeProto]]:
    """The logits of a product of sigmoids (Mul trees whose leaves are Sigmoid outputs used only
    there), and the nodes of that product; ([], []) when ``tensor`` is not such a product."""
    node = producer.get(tensor)
    if node is None or uses.get(tensor, 0) != 1 or node.domain not in ("", "ai.onnx"):
        return [], []
    if node.op_type == "Sigmoid":
        return [node.input[0]], [node]
    if node.op_type != "Mul" or len(node.input) != 2:
        return [], []
    logits, nodes = [], [node]
    for operand in node.input:
        found, inner = _sigmoid_factors(operand, producer, uses)
        if not found:
            return [], []
        logits += found
        nodes += inner
    return logits, nodes


# A constant gain this large inside a Log is taken out of it (2^8: a power spectrum times it
# nears fp16's 65504 long before the Log's output, which is only ~ln(65504) = 11, does).
LOG_GAIN = 256.0


def _gain(name: str, inits: dict[str, onnx.TensorProto]) -> float | None:
    """The value of a constant whose elements all equal one value >= ``LOG_GAIN``."""
    value = scalar_const(inits, name)
    return value if value is not None and value >= LOG_GAIN else None


def log_of_large_gain(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Log(a + c * x) -> Log(x + a / c) + log(c), and Log(c * x) -> Log(x) + log(c), for a
    constant gain c >= ``LOG_GAIN``.

    Exact for c > 0. An audio front end's ``log(1 + 2^20 * magnitude)`` (Silero VAD v4) makes
    a tensor of ~3.6e7 on the way: in fp16 it overflows to inf, and scaling the input to fit
    flushes the quiet frames' magnitudes to zero (whole fp16 on the HTP: 11.1 dB vs float, or
    15.7 dB scaled); taken out of the Log, the largest tensor is the magnitude itself (37.1 dB).
    Only chains whose intermediate tensors nothing else reads are rewritten.
    """
    model = writable(model)
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    producer = _producers(graph)
    uses = _consumers(graph)
    fresh = FreshNames(model)
    replaced: dict[int, list[onnx.NodeProto]] = {}  # node index -> what takes its place
    index_of = {id(node): i for i, node in enumerate(graph.node)}
    details = []
    for node in graph.node:
        if node.op_type != "Log" or node.domain not in ("", "ai.onnx"):
            continue
        inner = producer.get(node.input[0])
        if inner is None or uses.get(node.input[0]) != 1 or id(inner) in replaced:
            continue
        offset = None  # the constant a of a + c * x
        mul = inner
        if inner.op_type == "Add" and len(inner.input) == 2:
            const = [i for i in inner.input if i in inits]
            other = [i for i in inner.input if i not in inits]
            if len(const) != 1 or len(other) != 1 or uses.get(other[0]) != 1:
                continue
            offset, mul = const[0], producer.get(other[0])
        if mul is None or mul.op_type != "Mul" or len(mul.input) != 2:
            continue
        gains = [(i, _gain(n, inits)) for i, n in enumerate(mul.input)]
        found = [(i, g) for i, g in gains if g is not None and mul.input[1 - i] not in inits]
        if not found:
            continue
        slot, gain = found[0]
        x = mul.input[1 - slot]
        base = node.name or node.output[0]
        log_c = fresh(f"{base}_log_gain")
        graph.initializer.append(numpy_helper.from_array(np.array(np.log(gain), np.float32), log_c))
        raw = fresh(f"{base}_without_gain")
        nodes = []
        if offset is not None:
            shifted_value = numpy_helper.to_array(inits[offset]).astype(np.float64) / gain
            shifted = fresh(f"{offset}_over_gain")
            graph.initializer.append(
                numpy_helper.from_array(shifted_value.astype(np.float32), shifted)
            )
            summed = fresh(f"{base}_shifted")
            nodes.append(helper.make_node("Add", [x, shifted], [summed], name=summed))
            x = summed
        nodes.append(helper.make_node("Log", [x], [raw], name=raw))
        nodes.append(helper.make_node("Add", [raw, log_c], [node.output[0]], name=log_c))
        replaced[index_of[id(node)]] = nodes
        replaced[index_of[id(mul)]] = []
        if inner is not mul:
            replaced[index_of[id(inner)]] = []
        form = "Log(a + c*x)" if offset is not None else "Log(c*x)"
        details.append(f"{node_label(node)}: {form} with c = {gain:g} -> log of x, plus log(c)")
    if details:
        set_nodes(graph, [n for i, node in enumerate(graph.node) for n in replaced.get(i, [node])])
    return checked_change(model, "log_of_large_gain", details)


# Ops that only move or repeat values: a comparison after them compares the same values.
_VALUE_MOVES = frozenset(
    {"Reshape", "Unsqueeze", "Squeeze", "Flatten", "Transpose", "Tile", "Expand", "Identity"}
)
# order comparisons, which an increasing function leaves as they are on either side
_COMPARISONS = frozenset({"Less", "Greater", "LessOrEqual", "GreaterOrEqual"})


def thresholds_on_logits(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Sigmoid(x) compared with a constant c in (0, 1) -> x compared with logit(c).

    Exact in real numbers (the sigmoid is strictly increasing), also through ops that only
    move values between the Sigmoid and the comparison. Why: near the threshold the HTP's
    Sigmoid (fp16, or a quantized grid) is off by a step, and a mask decided there flips:
    Mask2Former's masked attention thresholds sigmoid(mask logits) at 0.5 on every layer (on
    the simulator 192 of 5120 positions flipped, the model at 18.4 dB in fp16; on logits,
    35.7 dB quantized); a detection head's ``sigmoid(score) > threshold`` alike. The Sigmoid
    stays for any other reader.
    """
    model = writable(model)
    graph = model.graph
    producer = _producers(graph)
    inits = {i.name: i for i in graph.initializer}
    fresh = FreshNames(model)
    added: list[onnx.NodeProto] = []
    details = []
    for node in graph.node:
        if node.op_type not in _COMPARISONS or node.domain not in ("", "ai.onnx"):
            continue
        for side in (0, 1):
            threshold = scalar_const(inits, node.input[1 - side])
            if threshold is None or not 0.0 < threshold < 1.0:
                continue
            moves, current = [], node.input[side]
            while current in producer and producer[current].op_type in _VALUE_MOVES:
                moves.append(producer[current])
                current = producer[current].input[0]
            sigmoid = producer.get(current)
            if sigmoid is None or sigmoid.op_type != "Sigmoid":
                continue
            logit = fresh(f"{node.output[0]}_logit_threshold")
            value = np.float32(np.log(threshold) - np.log1p(-threshold))
            graph.initializer.append(numpy_helper.from_array(np.array(value), logit))
            moved = sigmoid.input[0]
            for move in reversed(moves):  # the same moves, of the logits
                out = fresh(f"{move.output[0]}_of_logits")
                added.append(
                    helper.make_node(
                        move.op_type,
                        [moved, *move.input[1:]],
                        [out],
                        name=fresh(f"{move.name or move.output[0]}_of_logits"),
                        domain=move.domain,
                    )
                )
                added[-1].attribute.extend(move.attribute)
                moved = out
            node.input[side], node.input[1 - side] = moved, logit
            details.append(
                f"{node_label(node)}: sigmoid({sigmoid.input[0]!r}) vs {threshold:g} -> the "
                f"logits vs {float(value):.6g}"
            )
            break
    if not details:
        return model, Change("thresholds_on_logits")
    graph.node.extend(added)
    model = topological_sort(model)[0]
    remove_dead_nodes(model.graph)
    return checked_change(model, "thresholds_on_logits", details)


# A fill this far out is no value a max (min) over real data returns: it only marks "nothing yet".
_EMPTY_FILL = 1e30
# Groups x updates a scatter's max (min) may be computed over densely, as a masked reduction.
_MASKED_ELEMENTS = 1 << 22


def _masked_extreme(
    node: onnx.NodeProto,
    groups: int,
    index_type: int,
    rank: int,
    reduce: str,
    extreme: str,
    fresh: FreshNames,
    inits: list[onnx.TensorProto],
) -> list[onnx.NodeProto]:
    """out[g] = max over n of (updates[n] where indices[n] is g (or g - groups), else
    ``extreme``): a ScatterElements' max along axis 0 into a constant that only marks
    "nothing yet", as elementwise ops and one reduction."""
    base = node.output[0]
    shape = [groups] + [1] * rank
    ids = np.arange(groups).reshape(shape)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(index_type)
    names = {k: fresh(f"{base}_{k}") for k in ("ids", "wrapped", "first", "second")}
    inits += [
        numpy_helper.from_array(ids.astype(dtype), names["ids"]),
        numpy_helper.from_array((ids - groups).astype(dtype), names["wrapped"]),
        numpy_helper.from_array(np.array([0], np.int64), names["first"]),
        numpy_helper.from_array(np.array([1], np.int64), names["second"]),
    ]
    made = {k: fresh(f"{base}_{k}") for k in ("index", "is", "is_wrapped", "mask", "rows", "sel")}
    return [
        helper.make_node("Unsqueeze", [node.input[1], names["first"]], [made["index"]]),
        helper.make_node("Equal", [made["index"], names["ids"]], [made["is"]]),
        helper.make_node("Equal", [made["index"], names["wrapped"]], [made["is_wrapped"]]),
        helper.make_node("Or", [made["is"], made["is_wrapped"]], [made["mask"]]),
        helper.make_node("Unsqueeze", [node.input[2], names["first"]], [made["rows"]]),
        helper.make_node("Where", [made["mask"], made["rows"], extreme], [made["sel"]]),
        helper.make_node(reduce, [made["sel"], names["second"]], list(node.output), keepdims=0),
    ]


def finite_scatter_fills(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """ScatterElements/ScatterND taking the max (min) into a constant filled with -inf (+inf)
    -> into the least (greatest) of its updates, broadcast to the data's shape.

    PyTorch exports ``scatter_reduce(..., "amax", include_self=False)`` (PyG's global max
    pooling over a graph's nodes) so: the infinite constant gave the quantizer an infinite
    scale (a DequantizeLinear of scale inf in the QDQ model). The same result wherever an
    update lands; where none does, the least update instead of -inf (which no NPU tensor
    holds). A ScatterElements along axis 0 whose groups times updates are few (a readout: a
    batch of graphs' features) is computed densely instead, as the max over its updates masked
    by their group (``_masked_extreme``), with no scatter left: a molecular GNN's max readout
    stayed on the CPU as a scatter, QNN's validation refusing it (error 3110, which a
    standalone copy of it with the same shapes and grids did not reproduce)."""
    model = writable(model)
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    fresh = FreshNames(model)
    added: list[tuple[int, list[onnx.NodeProto]]] = []
    replaced: set[int] = set()  # scatters computed densely instead
    values: dict[str, onnx.ValueInfoProto] | None = None
    details = []
    for index, node in enumerate(graph.node):
        if node.op_type not in ("ScatterElements", "ScatterND") or node.domain not in (
            "",
            "ai.onnx",
        ):
            continue
        reduction = next((a.s for a in node.attribute if a.name == "reduction"), b"none")
        if reduction not in (b"max", b"min") or node.input[0] not in inits:
            continue
        data = numpy_helper.to_array(inits[node.input[0]])
        sign = -1.0 if reduction == b"max" else 1.0
        if data.dtype.kind != "f" or not (data * sign >= _EMPTY_FILL).all():
            continue
        extreme = fresh(f"{node.input[2]}_{'least' if sign < 0 else 'greatest'}")
        reduce = "ReduceMin" if sign < 0 else "ReduceMax"
        least = helper.make_node(reduce, [node.input[2]], [extreme], keepdims=0)
        if values is None:
            values = inferred_values(model)
        updates = values.get(node.input[2])
        indices = values.get(node.input[1])
        shape = value_shape(updates) if updates is not None else None
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if (
            node.op_type == "ScatterElements"
            and axis in (0, -data.ndim)
            and shape is not None
            and indices is not None
            and value_shape(indices) == shape
            and tuple(data.shape[1:]) == tuple(shape[1:])
            and data.shape[0] * int(np.prod(shape)) <= _MASKED_ELEMENTS
        ):
            new_inits: list[onnx.TensorProto] = []
            masked = _masked_extreme(
                node,
                data.shape[0],
                indices.type.tensor_type.elem_type,
                len(shape),
                "ReduceMax" if sign < 0 else "ReduceMin",
                extreme,
                fresh,
                new_inits,
            )
            graph.initializer.extend(new_inits)
            added.append((index, [least, *masked]))
            replaced.add(index)
            details.append(
                f"{node_label(node)}: its {reduction.decode()} into {sign * np.inf:g} over "
                f"{data.shape[0]} group(s) computed as the {reduction.decode()} of its updates "
                f"masked by their group (the {'least' if sign < 0 else 'greatest'} where none)"
            )
            continue
        fill_shape = fresh(f"{node.input[0]}_shape")
        filled = fresh(f"{node.input[0]}_from_updates")
        graph.initializer.append(
            numpy_helper.from_array(np.array(data.shape, np.int64), fill_shape)
        )
        added.append((index, [least, helper.make_node("Expand", [extreme, fill_shape], [filled])]))
        details.append(
            f"{node_label(node)}: its {reduction.decode()} into {sign * np.inf:g} taken into "
            f"the {'least' if sign < 0 else 'greatest'} of its updates"
        )
        node.input[0] = filled
    if not added:
        return checked_change(model, "finite_scatter_fills", [])
    nodes = list(graph.node)
    for index, made in reversed(added):
        nodes[index : index + (index in replaced)] = made  # a dense form replaces its scatter
    set_nodes(graph, nodes)
    remove_dead_nodes(graph)
    return checked_change(model, "finite_scatter_fills", details)


# The most values one mean may sum on the HTP: it adds a 16-bit tensor's integers (less their
# zero point) in 32 bits, and 2^15 of them stay within int32 whatever they are.
MEAN_TERMS_MAX = 2**15


def split_wide_means(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A GlobalAveragePool, an AveragePool over the whole map, or a ReduceMean / ReduceSum over
    several axes holding more than ``MEAN_TERMS_MAX`` values -> the same reduction in stages,
    from the last axis, each over at most that many.

    Exact (a mean of equal-sized means, a sum of sums), and each stage sums few enough values
    for the HTP's accumulator: quantized, each of them over a one-sided 16-bit input (zero point
    0: an image in [0, 1], a Sigmoid's output) came out at 0-2 dB from 256x256 (65536 values)
    on and right up to 160x256; AnimeGANv3's instance norms at 480x640: 1.5 dB at the first
    mean (the model 24 dB from its CPU QDQ model, kept in fp16), right at 256x320 where its
    values sum smaller. AnimeGANv3's face model normalizes over C x H x W (32 x 480 x 640):
    9.4 dB quantized on the HTP, and -8.0 in fp16, which its 32 x 256 x 256 took. A ReduceMean
    or ReduceSum over one axis that long (a clip's energy over 4 s of 16 kHz audio) is reshaped
    into rows first, where its length factors into rows of at most that many; left alone
    otherwise, as is a reduction over several axes one of which is that long.
    """
    model = writable(model)
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    values = None
    fresh = FreshNames(model)
    nodes: list[onnx.NodeProto] = []
    details = []
    for node in graph.node:
        nodes.append(node)
        if node.domain not in ("", "ai.onnx") or node.op_type not in _WIDE_REDUCTIONS:
            continue
        if values is None:
            values = inferred_values(model)
        shapes = [
            value_shape(values[t]) if t in values else None
            for t in (*node.input[:1], node.output[0])
        ]
        shape = shapes[0]
        if shape is None or len(shape) < (3 if "Pool" in node.op_type else 1):
            continue
        keepdims = next((a.i for a in node.attribute if a.name == "keepdims"), 1)
        axes = list(range(2, len(shape)))  # the pools': every spatial axis
        if node.op_type == "AveragePool" and not _whole_map_pool(node, shape, shapes[1]):
            continue
        if node.op_type in ("ReduceMean", "ReduceSum"):
            if len(node.input) < 2 or node.input[1] not in inits:
                continue  # computed axes, or none (every axis: noop_with_empty_axes aside)
            axes = sorted(int(a) % len(shape) for a in numpy_helper.to_array(inits[node.input[1]]))
        terms = int(np.prod([shape[a] for a in axes]))
        if terms <= MEAN_TERMS_MAX:
            continue
        op = "ReduceSum" if node.op_type == "ReduceSum" else "ReduceMean"
        if len(axes) == 1 and node.op_type == op:
            row = _split_length(terms)
            if row and shapes[1] is not None:
                nodes[-1:] = _fold_long_axis(graph, node, shape, axes[0], row, shapes[1], fresh)
                details.append(
                    f"{node_label(node)}: {terms} values along one axis -> {terms // row} rows "
                    f"of {row}, each row first (the HTP's sum of over {MEAN_TERMS_MAX} overflows)"
                )
            continue
        if max(shape[a] for a in axes) > MEAN_TERMS_MAX:
            continue
        stages = _stages([(a, shape[a]) for a in axes])
        nodes[-1:] = _in_stages(
            graph, fresh, op, node.input[0], node.output[0], stages, axes, keepdims, node.name
        )
        counts = " x ".join(str(int(np.prod([shape[a] for a in group]))) for group in stages)
        details.append(
            f"{node_label(node)}: {terms} values -> {counts} in turn (the HTP's sum of over "
            f"{MEAN_TERMS_MAX} overflows)"
        )
    if details:
        set_nodes(graph, nodes)
    return checked_change(model, "split_wide_means", details)


_WIDE_REDUCTIONS = frozenset({"GlobalAveragePool", "AveragePool", "ReduceMean", "ReduceSum"})


def _split_length(length: int) -> int:
    """The longest row (at most ``MEAN_TERMS_MAX``) that ``length`` values fold into evenly,
    with at most that many rows; 0 if there is none (a prime length, say)."""
    for row in range(min(length, MEAN_TERMS_MAX), 1, -1):
        if length % row == 0:
            return row if length // row <= MEAN_TERMS_MAX else 0
    return 0


def _in_stages(
    graph: onnx.GraphProto,
    fresh: FreshNames,
    op: str,
    source: str,
    target: str,
    stages: list[list[int]],
    axes: list[int],
    keepdims: int,
    name: str,
) -> list[onnx.NodeProto]:
    """``op`` over ``axes`` of ``source`` into ``target``, one stage per group of ``stages`` (the
    reduced axes kept as 1), the last over every axis again: keepdims = 0 drops them all."""
    base = name or target
    chain = []
    groups = [*stages[:-1], axes]
    for index, group in enumerate(groups):
        group_axes = fresh(f"{base}_axes")
        graph.initializer.append(numpy_helper.from_array(np.array(group, np.int64), group_axes))
        last = index == len(groups) - 1
        out = target if last else fresh(f"{base}_partial")
        attrs = {"keepdims": keepdims} if last else {}
        chain.append(
            helper.make_node(op, [source, group_axes], [out], name=base if last else out, **attrs)
        )
        source = out
    return chain


def _fold_long_axis(
    graph: onnx.GraphProto,
    node: onnx.NodeProto,
    shape: tuple[int, ...],
    axis: int,
    row: int,
    out_shape: tuple[int, ...],
    fresh: FreshNames,
) -> list[onnx.NodeProto]:
    """A reduction over one axis of more than ``MEAN_TERMS_MAX`` values -> that axis reshaped
    into rows of ``row``, reduced over each row, then over the rows, and reshaped to the
    output's shape."""
    base = node.name or node.output[0]
    folded_shape = [*shape[:axis], shape[axis] // row, row, *shape[axis + 1 :]]
    rows, target = fresh(f"{base}_rows"), fresh(f"{base}_shape")
    graph.initializer.extend(
        [
            numpy_helper.from_array(np.array(folded_shape, np.int64), rows),
            numpy_helper.from_array(np.array(out_shape, np.int64), target),
        ]
    )
    folded, whole = fresh(f"{base}_folded"), fresh(f"{base}_whole")
    return [
        helper.make_node("Reshape", [node.input[0], rows], [folded], name=folded),
        *_in_stages(
            graph,
            fresh,
            node.op_type,
            folded,
            whole,
            [[axis + 1], [axis]],
            [axis, axis + 1],
            1,
            whole,
        ),
        helper.make_node("Reshape", [whole, target], [node.output[0]], name=base),
    ]


def _stages(axes: list[tuple[int, int]]) -> list[list[int]]:
    """The axes (with their lengths) in groups from the last, each holding at most
    ``MEAN_TERMS_MAX`` values: one reduction each."""
    groups: list[list[int]] = []
    size = 0
    for axis, length in reversed(axes):
        if groups and size * length <= MEAN_TERMS_MAX:
            groups[-1].insert(0, axis)
            size *= length
        else:
            groups.append([axis])
            size = length
    return groups


def _whole_map_pool(
    node: onnx.NodeProto, shape: tuple[int, ...], out: tuple[int, ...] | None
) -> bool:
    """An AveragePool whose one window is the whole map (no pads, a 1x1 output): a mean."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    kernel = list(attrs.get("kernel_shape", []))
    return (
        kernel == list(shape[2:])
        and not any(attrs.get("pads", []))
        and attrs.get("auto_pad", b"NOTSET") in (b"NOTSET", b"VALID")
        and out is not None
        and all(d == 1 for d in out[2:])
    )


# Keeps min / max of |y| and |x| from dividing 0 by 0 where both are 0 (torch's y / x there is
# NaN; the angle of the origin is 0 here). Above fp16's smallest subnormal (6e-8), so the HTP's
# fp16 arithmetic does not flush it to 0; it moves nothing whose larger side exceeds it.
ATAN_EPS = 1e-7


def bounded_atan_ratios(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Atan(y / x) -> the same angle from min(|y|, |x|) / max(|y|, |x|), a ratio in [0, 1].

    Why: ONNX has no atan2, so exporters (torch.onnx, tf2onnx) divide y by x, take Atan and
    fix the quadrant after. Where x nears 0 the quotient spans millions (a fingerprint
    network's orientation head peaks at 4.1e6), which no 16-bit grid holds (a step of ~126)
    and fp16 overflows, while the angle it encodes is bounded. Here t = atan(min / max) lies in
    [0, pi/4]; where |y| > |x| the angle is pi/2 - t; its sign is y's times x's, taken with
    two Wheres (a product y * x could overflow fp16). Equal to atan(y / x) up to float rounding;
    x = 0 gives +-pi/2 = atan(+-inf) as before. Only a Div of two computed tensors is
    rewritten (a constant divisor keeps the quotient in the numerator's own range); a Div read
    elsewhere stays for its other readers.
    """
    model = writable(model)
    graph = model.graph
    producer = _producers(graph)
    inits = {t.name for t in graph.initializer}
    fresh = FreshNames(model)
    constants: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    details = []
    for node in graph.node:
        div = producer.get(node.input[0]) if node.op_type == "Atan" and node.input else None
        if (
            node.domain not in ("", "ai.onnx")
            or div is None
            or div.op_type != "Div"
            or div.domain not in ("", "ai.onnx")
            or any(_constant(name, inits, producer) for name in div.input)
        ):
            nodes.append(node)
            continue
        y, x = div.input
        base = node.name or node.output[0]
        t = {k: fresh(f"{base}_bounded_{k}") for k in ATAN_TENSORS}
        constants += [
            numpy_helper.from_array(np.array(ATAN_EPS, np.float32), t["eps"]),
            numpy_helper.from_array(np.array(np.pi / 2, np.float32), t["half_pi"]),
            numpy_helper.from_array(np.array(0.0, np.float32), t["zero"]),
        ]
        for op, inputs, out in (
            ("Abs", [y], "abs_y"),
            ("Abs", [x], "abs_x"),
            ("Min", [t["abs_y"], t["abs_x"]], "low"),
            ("Max", [t["abs_y"], t["abs_x"]], "high"),
            ("Max", [t["high"], t["eps"]], "den"),
            ("Div", [t["low"], t["den"]], "ratio"),
            ("Atan", [t["ratio"]], "angle"),
            ("Sub", [t["half_pi"], t["angle"]], "steep_angle"),
            ("Greater", [t["abs_y"], t["abs_x"]], "steep"),
            ("Where", [t["steep"], t["steep_angle"], t["angle"]], "first"),
            ("Neg", [t["first"]], "first_neg"),
            ("Less", [y, t["zero"]], "y_neg"),
            ("Where", [t["y_neg"], t["first_neg"], t["first"]], "signed"),
            ("Neg", [t["signed"]], "signed_neg"),
            ("Less", [x, t["zero"]], "x_neg"),
        ):
            nodes.append(helper.make_node(op, inputs, [t[out]], name=fresh(f"{base}_{out}")))
        nodes.append(
            helper.make_node(
                "Where", [t["x_neg"], t["signed_neg"], t["signed"]], [node.output[0]], name=base
            )
        )
        details.append(
            f"{node_label(node)} of {node_label(div)}: atan(y / x) -> "
            "atan(min(|y|, |x|) / max(|y|, |x|)) with its octant restored"
        )
    if not details:
        return checked_change(model, "bounded_atan_ratios", [])
    graph.initializer.extend(constants)
    set_nodes(graph, nodes)
    remove_dead_nodes(graph)  # each Div read by its Atan alone
    model, _ = topological_sort(model)
    return checked_change(model, "bounded_atan_ratios", details)


def _constant(name: str, inits: set[str], producer: dict[str, onnx.NodeProto]) -> bool:
    node = producer.get(name)
    return name in inits or (node is not None and node.op_type == "Constant")


ATAN_TENSORS = (
    "eps", "half_pi", "zero", "abs_y", "abs_x", "low", "high", "den", "ratio", "angle",
    "steep_angle", "steep", "first", "first_neg", "y_neg", "signed", "signed_neg", "x_neg",
)  # fmt: skip


def shifted_log_sum_exps(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """ReduceLogSumExp(x) -> log(sum(exp(x - m))) + m, m = max(x) over the same axes.

    Why: the QNN EP takes a float ReduceLogSumExp but not a quantized one: a SuperGlue-style
    matcher's 20 Sinkhorn iterations (40 of them) left 41 partitions and 120 CPU nodes in its
    quantized model. ONNX's own definition, log(sum(exp(x))), overflows fp16 for x > 11 and
    needs a range of exp(x) no 16-bit grid holds; shifted by the maximum, exp sees x - m <= 0
    and the sum lies in [1, n]: the same function in float32, in ranges both paths keep.
    """
    return edit.replace_by_op(
        edit.passed_on(model),
        "shifted_log_sum_exps",
        {"ReduceLogSumExp": _shifted_log_sum_exp},
        DEFAULT_DOMAINS,
    )


def _shifted_log_sum_exp(
    node: onnx.NodeProto, context: edit.NodeRewrite
) -> tuple[list[onnx.NodeProto], str] | None:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("noop_with_empty_axes", 0) or "axes" in attrs:  # opset < 18: an attribute
        return None
    keepdims = int(attrs.get("keepdims", 1))
    axes = list(node.input[1:2])
    y, base = node.output[0], node.name or node.output[0]
    names = {p: context.fresh(f"{y}_{p}") for p in ("max", "shifted", "exp", "sum", "log")}
    nodes = [
        helper.make_node("ReduceMax", [node.input[0], *axes], [names["max"]], keepdims=1),
        helper.make_node("Sub", [node.input[0], names["max"]], [names["shifted"]]),
        helper.make_node("Exp", [names["shifted"]], [names["exp"]]),
        helper.make_node("ReduceSum", [names["exp"], *axes], [names["sum"]], keepdims=keepdims),
        helper.make_node("Log", [names["sum"]], [names["log"]]),
    ]
    top = names["max"]
    if not keepdims:
        top = context.fresh(f"{y}_max_dropped")
        nodes.append(helper.make_node("ReduceMax", [node.input[0], *axes], [top], keepdims=0))
    nodes.append(helper.make_node("Add", [names["log"], top], [y]))
    for index, made in enumerate(nodes):
        made.name = context.fresh(f"{base}_{index}")
    return nodes, f"{node_label(node)}: log(sum(exp(x - max(x)))) + max(x)"


# Ops whose float output holds integers wherever their float inputs do (moves, integer
# arithmetic, rounding); a Cast to float of an integer or bool tensor makes one too.
_KEEPS_INTEGERS = frozenset(
    {"Identity", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Transpose", "Slice", "Expand"}
    | {"Tile", "Split", "Concat", "Gather", "GatherElements", "GatherND", "DepthToSpace"}
    | {"SpaceToDepth", "Add", "Sub", "Mul", "Neg", "Abs", "Relu", "Max", "Min", "Sum", "Round"}
    | {"Floor", "Ceil", "Sign", "ReduceSum", "ReduceMax", "ReduceMin", "CumSum", "Pad"}
)
# Ops whose other inputs are indices, shapes or axes: only the data must hold integers.
_DATA_FIRST = frozenset(
    {"Gather", "GatherElements", "GatherND", "Expand", "Tile", "Slice", "Reshape", "Unsqueeze"}
    | {"Squeeze", "Split", "ReduceSum", "ReduceMax", "ReduceMin", "CumSum"}
)
_COMPARISONS = ("Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual")
_FLOAT = onnx.TensorProto.FLOAT


def compared_float_inputs(model: onnx.ModelProto) -> set[str]:
    """The float graph inputs whose values reach a comparison (Equal, Greater, ...) through ops
    that keep integers integer: those a sample must show integer-valued for
    ``integer_comparisons`` to apply."""
    inputs = {v.name for v in model.graph.input if v.type.tensor_type.elem_type == _FLOAT}
    sources: dict[str, set[str]] = {name: {name} for name in inputs}
    found: set[str] = set()
    for node in model.graph.node:
        if node.op_type in _COMPARISONS:
            for name in node.input:
                found |= sources.get(name, set())
        elif node.op_type in _KEEPS_INTEGERS or node.op_type in ("Where", "Cast"):
            reached = set().union(*(sources.get(i, set()) for i in node.input))
            for out in node.output:
                if reached:
                    sources[out] = reached
    return found


def integer_comparisons(
    model: onnx.ModelProto, integer_inputs: set[str]
) -> tuple[onnx.ModelProto, Change]:
    """A comparison of float tensors that hold integers (labels, flags, counts: ``integer_inputs``
    are the graph inputs every sample shows integer-valued) -> the same test with a margin of
    one half: Equal(a, b) -> |a - b| < 0.5, Greater(a, b) -> a - b > 0.5, GreaterOrEqual -> a -
    b > -0.5, and so on.

    Why: quantized, a tensor holding -1, 0 and 1 dequantizes to -1.00002 and 1.00001, and its
    Equal with -1 is false everywhere: a SAM-style mask decoder's point labels (``labels ==
    -1``: padding points) read 11.4 dB quantized on the CPU whatever the precision, the judge
    fell back to fp16; with the margins, 43.3 dB quantized on the HTP. On integers the margins
    change nothing; they absorb any rounding under half a unit."""
    return _compared_with_margins(model, _integral_tensors(model, integer_inputs))


def _compared_with_margins(
    model: onnx.ModelProto, integral: set[str]
) -> tuple[onnx.ModelProto, Change]:
    """``integer_comparisons`` for the float tensors ``integral`` known to hold integers."""
    inits = edit.initializers_by_name(model.graph)
    targets = [
        index
        for index, node in enumerate(model.graph.node)
        if node.op_type in _COMPARISONS
        and all(i in integral for i in node.input[:2])
        and not all(i in inits for i in node.input[:2])
    ]
    if not targets:
        return model, Change("integer_comparisons")
    result = edit.copy_model(model)
    fresh = edit.FreshNames(result)
    half = {v: fresh(f"integer_margin_{'minus_' if v < 0 else ''}half") for v in (0.5, -0.5)}
    result.graph.initializer.extend(
        numpy_helper.from_array(np.array(v, np.float32), name) for v, name in half.items()
    )
    replaced: dict[int, list[onnx.NodeProto]] = {}
    details = []
    for index in targets:
        node = result.graph.node[index]
        a, b = node.input[:2]
        y, base = node.output[0], node.name or node.output[0]
        difference = fresh(f"{y}_difference")
        nodes = [helper.make_node("Sub", [a, b], [difference], fresh(f"{base}_difference"))]
        if node.op_type == "Equal":
            size = fresh(f"{y}_size")
            nodes += [
                helper.make_node("Abs", [difference], [size], fresh(f"{base}_size")),
                helper.make_node("Less", [size, half[0.5]], [y], base),
            ]
            test = "|a - b| < 0.5"
        else:
            op, margin = {
                "Greater": ("Greater", 0.5),
                "GreaterOrEqual": ("Greater", -0.5),
                "Less": ("Less", -0.5),
                "LessOrEqual": ("Less", 0.5),
            }[node.op_type]
            nodes.append(helper.make_node(op, [difference, half[margin]], [y], base))
            test = f"a - b {'>' if op == 'Greater' else '<'} {margin:+g}"
        replaced[index] = nodes
        details.append(f"{edit.node_label(node)} of integer values -> {test}")
    nodes = []
    for index, node in enumerate(result.graph.node):
        nodes.extend(replaced.get(index, [node]))
    set_nodes(result.graph, nodes)
    return checked_change(result, "integer_comparisons", details)


# Ops whose output holds integers whatever their input holds.
_ROUNDINGS = frozenset({"Floor", "Ceil", "Round"})


def _integral_tensors(model: onnx.ModelProto, integer_inputs: set[str]) -> set[str]:
    """The float tensors that hold integers by construction: ``integer_inputs``, constants of
    integer values, roundings' outputs, casts of integers, and what ``_KEEPS_INTEGERS`` ops
    compute from those alone."""
    integral = set(integer_inputs)
    for name, tensor in edit.initializers_by_name(model.graph).items():
        if tensor.data_type == _FLOAT:
            values = numpy_helper.to_array(tensor)
            if values.size <= 1 << 16 and np.array_equal(values, np.round(values)):
                integral.add(name)
    elem = {v.name: v.type.tensor_type.elem_type for v in model.graph.input}
    values: dict[str, onnx.ValueInfoProto] | None = None
    for node in model.graph.node:
        if node.op_type in _ROUNDINGS:
            integral.update(o for o in node.output if o)
        elif node.op_type == "Cast":
            if values is None:
                values = edit.inferred_values(model)
            source = node.input[0]
            kind = elem.get(source) or (
                values[source].type.tensor_type.elem_type if source in values else 0
            )
            if kind in _INTEGER_TYPES or source in integral:
                integral.update(node.output)
        elif node.op_type in _KEEPS_INTEGERS or node.op_type == "Where":
            data = _data_inputs(node)
            if data and all(i in integral for i in data):
                integral.update(o for o in node.output if o)
    return integral


def integer_casts_with_margin(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Comparisons of tensors that hold integers by construction (``integer_comparisons``
    seeded by no input: positions from a Floor, counts from a Cast) get its margins, and a
    Cast of such a float tensor to an integer type reads x + 0.25 sign(x), so an integer off
    by less than a quarter still casts to itself.

    Why: quantized, a position computed as Floor(x * scale) dequantizes to 14.99998, which a
    Cast truncates to 14 (a GatherElements at positions a Floor computed: quantized ctx vs
    float 1.6 dB; with the margin 86.7 dB). A quarter, not a half: in fp16 (the whole-fp16
    candidate) integers from 1024 to 2048 are one apart, x + 0.5 is a tie that rounds to the
    even neighbour, and the HTP cast every odd position one too high (its Round is no help:
    1024 -> 1025 there). On exact integers both rewrites change nothing."""
    integral = _integral_tensors(model, set())  # the comparisons' rewrite keeps these names
    model, compared = _compared_with_margins(model, integral)
    to_integers = _INTEGER_TYPES - {onnx.TensorProto.BOOL}
    quarter: list[str] = []  # one shared 0.25, made on first use

    def to_nearest(
        node: onnx.NodeProto, context: edit.NodeRewrite
    ) -> tuple[list[onnx.NodeProto], str] | None:
        x = node.input[0]
        if x not in integral or edit.attribute(node, "to", 0) not in to_integers:
            return None
        if context.elem_type(x) != _FLOAT:
            return None
        if not quarter:
            quarter.append(context.constant(np.array(0.25, np.float32), "integer_cast_quarter"))
        fresh, base = context.fresh, node.name or node.output[0]
        sign, shift, moved = (fresh(f"{x}_{s}") for s in ("sign", "shift", "to_nearest"))
        rounded = onnx.NodeProto()
        rounded.CopyFrom(node)
        rounded.input[0] = moved
        nodes = [
            helper.make_node("Sign", [x], [sign], fresh(f"{base}_sign")),
            helper.make_node("Mul", [sign, quarter[0]], [shift], fresh(f"{base}_shift")),
            helper.make_node("Add", [x, shift], [moved], fresh(f"{base}_to_nearest")),
            rounded,
        ]
        return nodes, f"{edit.node_label(node)} of integer values -> Cast(x + 0.25 sign(x))"

    result, cast = edit.replace_by_op(
        model, "integer_casts_with_margin", {"Cast": to_nearest}, edit.DEFAULT_DOMAINS
    )
    return result, Change("integer_casts_with_margin", compared.details + cast.details)


def _data_inputs(node: onnx.NodeProto) -> list[str]:
    """The inputs of ``node`` whose values its float output carries (not its indices or axes)."""
    if node.op_type in _DATA_FIRST:
        return [node.input[0]]
    if node.op_type == "Where":
        return list(node.input[1:3])
    if node.op_type == "Pad":  # the data and the constant it pads with
        return [node.input[0], *(node.input[2:3] if len(node.input) > 2 and node.input[2] else [])]
    return [i for i in node.input if i]


_INTEGER_TYPES = frozenset(
    {
        onnx.TensorProto.BOOL, onnx.TensorProto.INT8, onnx.TensorProto.UINT8,
        onnx.TensorProto.INT16, onnx.TensorProto.UINT16, onnx.TensorProto.INT32,
        onnx.TensorProto.UINT32, onnx.TensorProto.INT64, onnx.TensorProto.UINT64,
    }
)  # fmt: skip
