"""Rewrites of a *quantized* (QDQ) model for patterns the HTP computes wrongly.

The QNN HTP backend (QNN 2.51, onnxruntime-qnn 2.7.0, measured on the simulator) fuses
``x * Sigmoid(x)`` (SiLU/Swish: YOLOv5/v8, EfficientNet and most detectors since) into one
op when both factors read the *same* 16-bit quantized tensor. That fused op is wrong for some
tensor shapes: a Conv -> SiLU at 12x12 or 10x10 (not 8x8, 14x14 or 16x16) came out at 2-5 dB
against the CPU QDQ model, a third of the elements wrong; inside a YOLOv8n the whole model
fell from 46 dB (CPU QDQ) to 12 dB on the HTP, with run-to-run differences on the same input.
With 8-bit activations, or with the pattern broken, it is right (64-80 dB).

``split_swish_input`` breaks the pattern without changing what the model computes: the Mul's
direct factor gets its own QuantizeLinear/DequantizeLinear pair with a scale larger by
``SPLIT_SCALE`` (a requantization the HTP runs as a Convert; it adds at most half a 16-bit step
of rounding, ~90 dB below the signal), so the HTP no longer sees one tensor on both sides.
tests/test_qdq_htp.py builds the failing case and checks both the rewrite and the HTP's result.

``signed_activation_products``: the HTP computes a MatMul of two uint16 activations into a uint16
output as if its second operand had 8 bits (attention's probs @ V: 39.9 dB from float where the
CPU QDQ model is at 75 dB, the very figure of an 8-bit V); with a signed 16-bit output it keeps
all 16 (67.9 dB). The rewrite re-encodes that output's uint16 grid as int16 (zero point - 32768,
same scale): the same values on the CPU, exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from .edit import (
    Change,
    FreshNames,
    attribute,
    checked_change,
    copy_model,
    readers_by_tensor,
    remove_dead_nodes,
    replace_attributes,
    sort_graph,
)

# Activations the HTP gates a tensor with itself through (x * f(x)); measured wrong: Sigmoid.
SELF_GATES = ("Sigmoid",)
SIXTEEN_BIT = (onnx.TensorProto.UINT16, onnx.TensorProto.INT16)
# The copy's scale: larger, so nothing clips, and different enough that the QNN EP does not drop
# the requantization as a no-op.
SPLIT_SCALE = 1.0 + 2.0**-10
UINT16_TO_INT16 = 32768  # an int16 grid holds a uint16 one shifted by this, same scale


def _editable(model: onnx.ModelProto) -> tuple[Any, Any, dict[str, Any], dict[str, Any], Any, Any]:
    """A copy to edit and its lookups: graph, initializers, producers, readers, fresh names."""
    out = copy_model(model)
    graph = out.graph
    inits = {i.name: i for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output if o}
    return out, graph, inits, producer, readers_by_tensor(graph), FreshNames(out)


def _requantized(
    source: str, params: list[str], label: str, fresh: FreshNames
) -> tuple[list[onnx.NodeProto], str]:
    """Q then DQ of ``source`` on the grid of ``params`` (scale, zero point): the nodes and the
    DQ's output, which the HTP runs as a Convert where a Q of another grid reads it."""
    coded, decoded = fresh(f"{source}_{label}_q"), fresh(f"{source}_{label}")
    nodes = [
        onnx.helper.make_node(op, ins, [made], name=fresh(f"{made}_{op}"))
        for op, ins, made in (
            ("QuantizeLinear", [source, *params], coded),
            ("DequantizeLinear", [coded, *params], decoded),
        )
    ]
    return nodes, decoded


def _with_added(
    model: onnx.ModelProto,
    edited: onnx.ModelProto,
    added: list[onnx.NodeProto],
    step: str,
    details: list[str],
) -> tuple[onnx.ModelProto, Change]:
    """``edited`` with the ``added`` nodes in order, or ``model`` as it was when no details."""
    if not details:
        return model, Change(step)
    edited.graph.node.extend(added)
    sort_graph(edited.graph)
    return checked_change(edited, step, details)


def split_swish_input(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Give the direct factor of every 16-bit ``x * Sigmoid(x)`` its own requantized copy."""
    out = copy_model(model)
    graph = out.graph
    inits = {i.name: i for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output if o}
    fresh = FreshNames(out)

    def dequantized_from(tensor: str) -> onnx.NodeProto | None:
        """The 16-bit, per-tensor DequantizeLinear of an activation that produces ``tensor``."""
        node = producer.get(tensor)
        if node is None or node.op_type != "DequantizeLinear" or len(node.input) < 3:
            return None
        scale, zero = inits.get(node.input[1]), inits.get(node.input[2])
        if node.input[0] in inits or scale is None or zero is None:
            return None  # a weight, or parameters computed at run time
        if zero.data_type not in SIXTEEN_BIT or numpy_helper.to_array(scale).size != 1:
            return None
        return node

    def gate_source(tensor: str) -> str | None:
        """The quantized tensor that a Sigmoid -> Q -> DQ chain ending in ``tensor`` reads."""
        dq = producer.get(tensor)
        if dq is None or dq.op_type != "DequantizeLinear":
            return None
        q = producer.get(dq.input[0])
        if q is None or q.op_type != "QuantizeLinear":
            return None
        gate = producer.get(q.input[0])
        if gate is None or gate.op_type not in SELF_GATES:
            return None
        source = dequantized_from(gate.input[0])
        return source.input[0] if source is not None else None

    details: list[str] = []
    added: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type != "Mul" or len(node.input) != 2:
            continue
        for direct, other in ((0, 1), (1, 0)):
            dq = dequantized_from(node.input[direct])
            if dq is None or gate_source(node.input[other]) != dq.input[0]:
                continue
            scale = numpy_helper.to_array(inits[dq.input[1]])
            scale_name = fresh(f"{dq.input[0]}_htp_split_scale")
            graph.initializer.append(
                numpy_helper.from_array((scale * SPLIT_SCALE).astype(scale.dtype), scale_name)
            )
            nodes, copy_dq = _requantized(
                node.input[direct], [scale_name, dq.input[2]], "htp_split", fresh
            )
            added.extend(nodes)
            node.input[direct] = copy_dq
            details.append(
                f"Mul {node.name or node.output[0]!r}: x * sigmoid(x) reads a requantized copy "
                f"of {dq.input[0]!r} (the HTP's fused 16-bit SiLU is wrong for some shapes)"
            )
            break
    return _with_added(model, out, added, "split_swish_input", details)


def signed_activation_products(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Re-encode as int16 the uint16 output of every MatMul of two activations (exact)."""
    out, graph, inits, producer, readers, fresh = _editable(model)
    added: list[onnx.NodeProto] = []

    def activation(tensor: str) -> bool:
        """Dequantized at run time from a quantized activation, not from a stored weight."""
        node = producer.get(tensor)
        return (
            node is not None and node.op_type == "DequantizeLinear" and node.input[0] not in inits
        )

    details: list[str] = []
    for node in graph.node:
        if node.op_type != "MatMul" or not all(activation(name) for name in node.input[:2]):
            continue
        quantizers = readers.get(node.output[0], [])
        if len(quantizers) != 1 or quantizers[0].op_type != "QuantizeLinear":
            continue
        q = quantizers[0]
        zero = inits.get(q.input[2]) if len(q.input) > 2 else None
        if zero is None or zero.data_type != onnx.TensorProto.UINT16 or q.input[1] not in inits:
            continue
        signed = numpy_helper.to_array(zero).astype("int32") - UINT16_TO_INT16
        zero_name = fresh(f"{q.input[2]}_int16")
        graph.initializer.append(numpy_helper.from_array(signed.astype("int16"), zero_name))
        nodes, decoded = _requantized(node.output[0], [q.input[1], zero_name], "int16", fresh)
        added.extend(nodes)
        q.input[0] = decoded  # consumers read the uint16 grid as before (a Convert on the HTP)
        details.append(
            f"MatMul {node.name or node.output[0]!r}: its uint16 output {node.output[0]!r} "
            "re-encoded as int16 (the HTP keeps 16 bits of both operands only then)"
        )
    return _with_added(model, out, added, "signed_activation_products", details)


# Integer graph inputs a model casts to float, and the numpy type of each (a zero point's).
_CAST_INPUT_TYPES = {
    onnx.TensorProto.UINT8: np.uint8,
    onnx.TensorProto.INT8: np.int8,
    onnx.TensorProto.UINT16: np.uint16,
    onnx.TensorProto.INT16: np.int16,
}
_FLOAT_TARGETS = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16}


def dequantized_integer_inputs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A Cast to float of an 8- or 16-bit integer graph input becomes a DequantizeLinear with
    scale 1 and zero point 0: the same values exactly, in a quantized model or a float one.

    Why: the QNN HTP takes no Cast from int8, int16 or uint16 to float (validation fails and
    the Cast stays on the CPU: a VAD fed int16 PCM, NeMo's MarbleNet, ran in two pieces), and
    it computes a Cast from uint8 in a float (fp16) graph as a cast to bool: every nonzero
    pixel came back 1.0. An integer input read through a DequantizeLinear is what the HTP
    takes as a quantized input: it runs whole, its values exact (tests/test_qdq_htp.py).
    """
    out = copy_model(model)
    graph = out.graph
    fresh = FreshNames(out)
    inputs = {
        i.name: i.type.tensor_type.elem_type
        for i in graph.input
        if i.type.tensor_type.elem_type in _CAST_INPUT_TYPES
    }
    details: list[str] = []
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        to = attribute(node, "to", None) if node.op_type == "Cast" else None
        if node.domain not in ("", "ai.onnx") or to not in _FLOAT_TARGETS:
            nodes.append(node)
            continue
        if not node.input or node.input[0] not in inputs:
            nodes.append(node)
            continue
        source = node.input[0]
        scale, zero = fresh(f"{source}_unit_scale"), fresh(f"{source}_zero_point")
        graph.initializer.extend(
            [
                numpy_helper.from_array(np.array(1.0, _FLOAT_TARGETS[to]), scale),
                numpy_helper.from_array(np.array(0, _CAST_INPUT_TYPES[inputs[source]]), zero),
            ]
        )
        nodes.append(
            onnx.helper.make_node(
                "DequantizeLinear", [source, scale, zero], [node.output[0]], name=node.name
            )
        )
        details.append(
            f"Cast {node.name or node.output[0]!r} of the "
            f"{onnx.helper.tensor_dtype_to_np_dtype(inputs[source])} input {source!r}: a "
            "DequantizeLinear (scale 1, zero point 0), which the HTP takes"
        )
    if not details:
        return model, Change("dequantized_integer_inputs")
    del graph.node[:]
    graph.node.extend(nodes)
    return checked_change(out, "dequantized_integer_inputs", details)


# Ops that reshape values without arithmetic and leave a change of grid to the op before them:
# the HTP folds the requantization into that op's output (a Conv, Gather, Concat, MaxPool...,
# through a Transpose too), but after a graph input, a Reshape or an Identity a change of zero
# point is lost (a Reshape from zero point 32768 to 0, the grid of a ReLU that onnxruntime's
# quantizer folded into it: 5.0 dB against the CPU), after a Slice in some graphs (19.4 dB
# after a 1x1 Conv's Slice; right after a 3x3 one's), and DepthToSpace/SpaceToDepth lose a
# change of scale too. A Resize counts when it picks values (mode nearest). After the ops of
# ``PASS_THROUGH`` the change gets a requantization of its own (exact, one Convert more where
# the HTP was right already).
GRID_BLIND_MOVES = frozenset(
    {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "DepthToSpace", "SpaceToDepth", "Resize"}
)
PASS_THROUGH = GRID_BLIND_MOVES | {"Transpose", "Slice", "Identity", "Tile", "Expand"}


def _grid(node: onnx.NodeProto, inits: dict[str, Any]) -> tuple[bytes, bytes] | None:
    """A per-tensor Q or DQ node's grid (scale, zero point and its type) by value: two nodes
    may hold one grid in different initializers. None for a per-axis or computed one."""
    if node.input[1] not in inits or (len(node.input) > 2 and node.input[2] not in inits):
        return None
    scale = numpy_helper.to_array(inits[node.input[1]])
    zero = numpy_helper.to_array(inits[node.input[2]]) if len(node.input) > 2 else None
    if scale.size != 1:
        return None
    return scale.tobytes(), b"" if zero is None else zero.tobytes() + str(zero.dtype).encode()


def requantize_after_moves(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A Reshape-like op (``GRID_BLIND_MOVES``) between two different grids, after a graph input
    or a ``PASS_THROUGH`` op -> the op on its input's grid, then a requantization to the
    output's (Q, DQ on the input grid before the output's Q): exact, its values are on the
    input's grid already; the HTP runs the requantization as a Convert, which it gets right.

    A Concat input that a ``PASS_THROUGH`` op wrote on another grid than the Concat's -> that
    input requantized onto the Concat's grid first (exact: the Concat only moves values, and its
    output's Q rounds them onto that grid the same way). The HTP folds the Concat's change of
    grid back through the move and loses it: a Transpose (or a channel shuffle's Reshape ->
    Transpose -> Reshape) into a Concat on a grid 18% coarser came out 19.1 dB from the CPU QDQ
    model (Reshapes alone, or a graph input straight into the Concat: right); a YOLOv8-lite
    face detector concatenates its ShuffleNet backbone's shuffle with the neck's upsampling:
    19.9 dB from the CPU QDQ model on the HTP, 45.2 with the requantization."""
    out, graph, inits, producer, readers, fresh = _editable(model)
    added: list[onnx.NodeProto] = []
    details: list[str] = []
    for node in graph.node:
        if node.op_type != "Concat" or node.domain not in ("", "ai.onnx"):
            continue
        quantizers = readers.get(node.output[0], [])
        if len(quantizers) != 1 or quantizers[0].op_type != "QuantizeLinear":
            continue
        target = _grid(quantizers[0], inits)
        if target is None:
            continue
        moved = []
        for slot, tensor in enumerate(node.input):
            dq = producer.get(tensor)
            if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] in inits:
                continue
            quantizer = producer.get(dq.input[0])
            written = producer.get(quantizer.input[0]) if quantizer is not None else None
            if written is None or quantizer.op_type != "QuantizeLinear":
                continue
            if written.op_type not in PASS_THROUGH or _grid(dq, inits) in (None, target):
                continue
            nodes, decoded = _requantized(
                tensor, list(quantizers[0].input[1:]), "on_concat_grid", fresh
            )
            added.extend(nodes)
            node.input[slot] = decoded
            moved.append(f"{written.op_type} {written.name or written.output[0]!r}")
        if moved:
            details.append(
                f"Concat {node.name or node.output[0]!r}: its input(s) from {', '.join(moved)} "
                "requantized onto its grid first (the HTP loses a change of grid behind a move)"
            )
    for node in graph.node:
        if node.op_type not in GRID_BLIND_MOVES or node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Resize":
            mode = next((a.s for a in node.attribute if a.name == "mode"), b"nearest")
            if mode != b"nearest":
                continue
        dq = producer.get(node.input[0])
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] in inits:
            continue
        upstream = producer.get(dq.input[0])  # its Q, or None for an integer graph input
        if upstream is not None and upstream.op_type == "QuantizeLinear":
            upstream = producer.get(upstream.input[0])  # None for a float graph input
        if upstream is not None and upstream.op_type not in PASS_THROUGH:
            continue  # a layer before it takes the requantization into its own output
        quantizers = readers.get(node.output[0], [])
        if not quantizers or any(q.op_type != "QuantizeLinear" for q in quantizers):
            continue
        grid = _grid(dq, inits)
        if grid is None or all(_grid(q, inits) == grid for q in quantizers):
            continue
        nodes, decoded = _requantized(node.output[0], list(dq.input[1:]), "on_input_grid", fresh)
        added.extend(nodes)
        for q in quantizers:
            q.input[0] = decoded
        details.append(
            f"{node.op_type} {node.name or node.output[0]!r}: kept on its input's grid, then "
            "requantized (the HTP moves the values without changing their grid)"
        )
    return _with_added(model, out, added, "requantize_after_moves", details)


def scatter_sums_on_output_grid(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A ScatterElements or ScatterND that adds (``reduction = "add"``) -> its data and
    updates requantized onto its output's grid first.

    The HTP sums their quantized integers as if they were on the output's grid: a GNN's
    message aggregation (updates at 5e-5 a step, the sums at 4e-4) came out saturated, -15.7 dB
    against the CPU QDQ model, and a whole molecule model at 0.5 dB vs float; on one grid,
    78 dB, and that model 40.2 dB (measured on the simulator; a data input on its own grid
    cost as much, 6.5 dB; max, min and mul reductions were right on any grids)."""
    out, graph, inits, producer, readers, fresh = _editable(model)
    added: list[onnx.NodeProto] = []
    details: list[str] = []
    for node in graph.node:
        if node.op_type not in ("ScatterElements", "ScatterND") or node.domain not in (
            "",
            "ai.onnx",
        ):
            continue
        if attribute(node, "reduction", b"none") != b"add":
            continue
        quantizers = readers.get(node.output[0], [])
        if not quantizers or any(q.op_type != "QuantizeLinear" for q in quantizers):
            continue
        grid = _grid(quantizers[0], inits)
        if grid is None or any(_grid(q, inits) != grid for q in quantizers):
            continue
        moved = []
        for slot, role in ((0, "data"), (2, "updates")):
            dq = producer.get(node.input[slot])
            if dq is None or dq.op_type != "DequantizeLinear" or _grid(dq, inits) == grid:
                continue
            nodes, decoded = _requantized(
                node.input[slot], list(quantizers[0].input[1:]), "on_sum_grid", fresh
            )
            added.extend(nodes)
            node.input[slot] = decoded
            moved.append(role)
        if moved:
            details.append(
                f"{node.op_type} {node.name or node.output[0]!r}: {' and '.join(moved)} "
                "requantized onto its output's grid (the HTP adds them as if they were on it)"
            )
    return _with_added(model, out, added, "scatter_sums_on_output_grid", details)


# The HTP computes an output channel of a Conv, Gemm or MatMul wrongly once its requantization
# factor (input scale x weight scale / output scale) is below about 2^-24: the channel comes out
# pinned to an end of its grid (measured on a Gemm: right at 2^-22.5, 14 steps off at 2^-23.9,
# saturated from 2^-24.9 down). A channel whose weights are all zero or nearly so gets such a
# scale: MediaPipe's hand landmark head, the wrist's z landmark (0 on the CPU, 324 on the HTP).
HTP_MIN_REQUANT = 2.0**-22
# A layer whose output a PRelu or LeakyRelu reads (QNN fuses the two) goes wrong at larger
# factors: a channel with all-zero weights and a negative bias (always on the negative side), any
# slope from 1e-4 to 0.05, came out as its input's magnitude (43-80 where the CPU gives 2e-5)
# up to 2^-19 and right from 2^-18 on (slopes of 0.3 and more: right at 2^-22). MediaPipe's
# palm detector has such a channel in its first Conv: the whole model 2.3 dB on the HTP, 29.4 on
# the CPU. Raised to 2^-17, twice the boundary measured.
HTP_MIN_REQUANT_GATED = 2.0**-17
GATED_READERS = frozenset({"PRelu", "LeakyRelu"})
# Ops that only move values: the HTP may requantize a layer's output straight into the grid of
# the tensor they lead to.
_MOVE_ONLY = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Concat"})


def weight_scales_for_htp(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Raise every weight scale whose requantization factor is under ``HTP_MIN_REQUANT`` to it
    (``HTP_MIN_REQUANT_GATED`` for a layer a PRelu/LeakyRelu reads), re-rounding that channel's
    weights and bias (bias scale = input scale x weight scale).

    Such a channel's weights are below a 2^-22 output step per unit of input each: rounded on
    the coarser grid they move the output by a fraction of a step, where the HTP's own result for
    the channel is the end of its range. The output step is the coarsest one the layer's output
    reaches through ops that only move values (Reshape, Concat, ...): the HTP folds those
    requantizations into the layer's (a YOLOv8-seg head: mask coefficients at a 1e-5 step
    concatenated with box coordinates at 0.015, a factor of 2^-17 to its own grid, 2^-27 to the
    Concat's; every coefficient came out at an end of the output's range, -18.8 dB)."""
    out, graph, inits, producer, readers, _ = _editable(model)

    def per_tensor(tensor: str | None) -> float | None:
        value = numpy_helper.to_array(inits[tensor]) if tensor in inits else None
        return float(value.item()) if value is not None and value.size == 1 else None

    def coarsest_step(quantizer: onnx.NodeProto) -> float | None:
        """The output's step, or a coarser one its values are moved into unchanged."""
        step = per_tensor(quantizer.input[1])
        while step is not None:
            dequantizers = readers.get(quantizer.output[0], [])
            if len(dequantizers) != 1 or dequantizers[0].op_type != "DequantizeLinear":
                break
            movers = readers.get(dequantizers[0].output[0], [])
            if len(movers) != 1 or movers[0].op_type not in _MOVE_ONLY:
                break
            quantizers = readers.get(movers[0].output[0], [])
            if len(quantizers) != 1 or quantizers[0].op_type != "QuantizeLinear":
                break
            quantizer = quantizers[0]
            step = max(step, per_tensor(quantizer.input[1]) or step)
        return step

    def only_here(name: str, reader: onnx.NodeProto) -> bool:
        return _read_only_by(inits, readers, name, reader)

    def gated(quantizer: onnx.NodeProto) -> bool:
        """Whether a PRelu or LeakyRelu reads the layer's output (through its Q -> DQ)."""
        return any(
            reader.op_type in GATED_READERS
            for dq in readers.get(quantizer.output[0], [])
            if dq.op_type == "DequantizeLinear"
            for reader in readers.get(dq.output[0], [])
        )

    def replace(name: str, array: np.ndarray) -> None:
        _replace_constant(inits, name, array)

    details: list[str] = []
    for node in graph.node:
        if node.op_type not in ("Conv", "ConvTranspose", "Gemm", "MatMul") or len(node.input) < 2:
            continue
        x_dq, w_dq = producer.get(node.input[0]), producer.get(node.input[1])
        quantizers = readers.get(node.output[0], [])
        if (
            x_dq is None
            or w_dq is None
            or x_dq.op_type != "DequantizeLinear"
            or w_dq.op_type != "DequantizeLinear"
            or len(quantizers) != 1
            or quantizers[0].op_type != "QuantizeLinear"
            or readers.get(w_dq.output[0], []) != [node]
            or len(w_dq.input) < 3
            or not all(only_here(name, w_dq) for name in w_dq.input[:3])
        ):
            continue
        x_scale, y_scale = per_tensor(x_dq.input[1]), coarsest_step(quantizers[0])
        if x_scale is None or y_scale is None or x_scale <= 0 or y_scale <= 0:
            continue
        if inits[w_dq.input[0]].data_type not in (onnx.TensorProto.INT8, onnx.TensorProto.INT16):
            continue  # 4-bit weights are stored unpacked by numpy: left as they are
        values = numpy_helper.to_array(inits[w_dq.input[0]])
        scales = numpy_helper.to_array(inits[w_dq.input[1]]).astype(np.float64)
        if np.any(numpy_helper.to_array(inits[w_dq.input[2]])):
            continue  # symmetric weights only: a zero point would move with the scale
        least = HTP_MIN_REQUANT_GATED if gated(quantizers[0]) else HTP_MIN_REQUANT
        floor = least * y_scale / x_scale
        low = scales < floor * (1 - 1e-6)  # float32's rounding of a raised scale is not low
        if not np.any(low):
            continue
        axis = attribute(w_dq, "axis", 1) % values.ndim
        shape = [1] * values.ndim
        if scales.size > 1:
            shape[axis] = scales.size
        raised = np.maximum(scales, floor)
        info = np.iinfo(values.dtype)
        weights = values.astype(np.float64) * scales.reshape(shape)
        requantized = np.clip(np.round(weights / raised.reshape(shape)), -info.max, info.max)
        bias_dq = producer.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if bias_dq is not None and not (
            bias_dq.op_type == "DequantizeLinear"
            and readers.get(bias_dq.output[0], []) == [node]
            and all(only_here(name, bias_dq) for name in bias_dq.input[:2])
            and raised.size == numpy_helper.to_array(inits[bias_dq.input[1]]).size
        ):
            continue  # a bias QNN would read at a scale other than input x weight
        replace(w_dq.input[0], requantized.astype(values.dtype))
        replace(w_dq.input[1], raised.astype(np.float32).reshape(scales.shape))
        if bias_dq is not None:
            old_shape = numpy_helper.to_array(inits[bias_dq.input[1]]).shape
            bias_scale = (x_scale * raised).astype(np.float32)  # the shape it had: per tensor
            bias_scale = bias_scale.reshape(old_shape)  # or per channel, like the weights
            replace(bias_dq.input[0], _bias_at(inits, bias_dq, bias_scale))
            replace(bias_dq.input[1], bias_scale)
        count = int(np.sum(low))
        details.append(
            f"{node.op_type} {node.name or node.output[0]!r}: {count} of {scales.size} weight "
            f"scale(s) raised to {floor:.3g} (requantization factor 2^{np.log2(least):.0f} for "
            f"the HTP{', read by a PRelu/LeakyRelu' if least != HTP_MIN_REQUANT else ''})"
        )
    if not details:
        return model, Change("weight_scales_for_htp")
    return checked_change(out, "weight_scales_for_htp", details)


# The HTP floors the accumulator of a layer with 16-bit weights (on a 16-bit input) to about twice
# the input step times the channel's largest weight: a PAN segmenter's depthwise 3x3, weights up
# to 58, came out 46.5 dB from the float layer where the CPU QDQ model is exact (8-bit weights:
# 48.9 dB on the HTP and the CPU alike); the whole segmenter 6.2 dB on the HTP, 39.9 on the CPU.
# The same weights as an 8-bit part plus an 8-bit residual, two layers summed: 74.7 dB for that
# Conv (random Convs, dense or depthwise, and MatMuls: 9-16 dB above their int16 form on the
# HTP), the segmenter 30.4 dB; an ungrouped ConvTranspose 4-9 dB (but one case, -0.4). A grouped
# ConvTranspose is left as it is: its weights are per tensor, int16 there came out 64.8-70.2 dB
# from float on the HTP and a per-tensor split 4 dB below that (and beside per-tensor weights
# the HTP computes a per-channel bias scale wrongly: -12 dB against the CPU, a scalar one right).
SPLIT_WEIGHT_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
INT8_MAX = 127
# The residual's weight, scale and zero point are named after the main part's with this suffix
# (pipeline.quantize.mixed_precision counts such a pair as one 16-bit weight).
REST = "_rest"
# How far the main part's grid reaches past the output's, as a share of the output's range: the
# residual can bring back inside that range what the main part has beyond it (a ReLU folded into
# the output's grid clips the main part's negatives); the residual's own bound, often larger than
# the output's range, would coarsen the main part's grid with it (a PAN segmenter: 37.1 dB on the
# CPU with that bound, 39.0 with a 16th, 39.9 with its int16 weights; no margin: 18.1).
MAIN_MARGIN = 1 / 16


def _output_axis(node: onnx.NodeProto, rank: int) -> int | None:
    """The axis of a layer's weight (its second input) that indexes its output channels."""
    if node.op_type == "Conv":
        return 0
    if node.op_type == "Gemm":
        return 0 if attribute(node, "transB", 0) else 1
    if node.op_type == "ConvTranspose":  # [in, out / group, ...]: only ungrouped ones measured
        return 1 if attribute(node, "group", 1) == 1 else None
    return 1 if node.op_type == "MatMul" and rank == 2 else None


def _grid_span(node: onnx.NodeProto, inits: dict[str, Any]) -> tuple[float, float, Any] | None:
    """The real interval a per-tensor 16-bit Q/DQ grid holds, and its zero point's dtype."""
    if node.input[1] not in inits or len(node.input) < 3 or node.input[2] not in inits:
        return None
    scale = numpy_helper.to_array(inits[node.input[1]]).astype(np.float64)
    zero = numpy_helper.to_array(inits[node.input[2]])
    if scale.size != 1 or inits[node.input[2]].data_type not in SIXTEEN_BIT:
        return None
    info = np.iinfo(zero.dtype)
    step, offset = float(scale.item()), int(zero.reshape(-1)[0])  # a scalar, or one as [1]
    return step * (info.min - offset), step * (info.max - offset), zero.dtype


def _sixteen_bit_grid(low: float, high: float, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """Scale and zero point of a ``dtype`` grid holding [low, high] (and 0)."""
    info = np.iinfo(dtype)
    low, high = min(low, 0.0), max(high, 0.0)
    scale = max(high - low, float(np.finfo(np.float32).tiny)) / (int(info.max) - int(info.min))
    zero = int(np.clip(round(int(info.min) - low / scale), info.min, info.max))
    return np.array(scale, np.float32), np.array(zero, dtype)


def _int8_parts(
    weights: np.ndarray, axis: int, finest: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``weights`` as int8 per ``axis`` plus an int8 residual per ``axis``: both parts' integers
    and scales, and the residual's absolute sum per channel (what bounds its output). No scale
    is finer than ``finest`` (the int16 scales, per channel): an all-zero channel keeps the
    scale it had, not one whose bias scale underflows."""
    moved = np.moveaxis(weights, axis, 0)
    channels = moved.shape[0]
    shape = [1] * weights.ndim
    shape[axis] = channels
    finest = np.broadcast_to(finest.ravel(), (channels,)) if finest.size == 1 else finest.ravel()
    main_scale = np.maximum(np.abs(moved).reshape(channels, -1).max(axis=1) / INT8_MAX, finest)
    main = np.clip(np.round(weights / main_scale.reshape(shape)), -INT8_MAX, INT8_MAX)
    residual = weights - main * main_scale.reshape(shape)
    rest = np.abs(np.moveaxis(residual, axis, 0)).reshape(channels, -1)
    rest_scale = np.maximum(rest.max(axis=1) / INT8_MAX, finest)
    rest_values = np.clip(np.round(residual / rest_scale.reshape(shape)), -INT8_MAX, INT8_MAX)
    return main, main_scale, rest_values, rest_scale, rest.sum(axis=1)


def split_sixteen_bit_weights(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A Conv, ConvTranspose, Gemm or MatMul with int16 weights on a 16-bit input -> the layer
    with those weights rounded to int8 per output channel (the bias with it) plus the layer of
    their int8 residual, each on its own 16-bit grid, added into the layer's output: what the
    CPU computes with the int16 weights, to 15 bits of weight, on the path the HTP computes
    exactly (see ``SPLIT_WEIGHT_OPS``: a grouped ConvTranspose is left as it is).

    The residual's grid holds its bound (its absolute sum per channel times the input's largest
    magnitude); the main part's, the output's range widened by ``MAIN_MARGIN`` of it (or the
    bound, when smaller)."""
    out, graph, inits, producer, readers, fresh = _editable(model)
    added: list[onnx.NodeProto] = []
    details: list[str] = []

    def constant(base: str, array: np.ndarray) -> str:
        name = fresh(base)
        graph.initializer.append(numpy_helper.from_array(array, name))
        return name

    def replace(name: str, array: np.ndarray) -> None:
        _replace_constant(inits, name, array)

    def only(name: str, reader: onnx.NodeProto) -> bool:
        return _read_only_by(inits, readers, name, reader)

    def dequantizer(tensor: str) -> onnx.NodeProto | None:
        node = producer.get(tensor)
        return node if node is not None and node.op_type == "DequantizeLinear" else None

    for node in list(graph.node):
        if node.op_type not in SPLIT_WEIGHT_OPS or node.domain not in ("", "ai.onnx"):
            continue
        x_dq, w_dq = dequantizer(node.input[0]), dequantizer(node.input[1])
        quantizers = readers.get(node.output[0], [])
        if (
            x_dq is None
            or w_dq is None
            or readers.get(w_dq.output[0], []) != [node]
            or not all(only(name, w_dq) for name in w_dq.input[:2])
            or inits[w_dq.input[0]].data_type != onnx.TensorProto.INT16
            or len(quantizers) != 1
            or quantizers[0].op_type != "QuantizeLinear"
        ):
            continue
        x_span, y_span = _grid_span(x_dq, inits), _grid_span(quantizers[0], inits)
        if x_span is None or y_span is None:
            continue  # an 8-bit input or output: not what was measured
        zero_point = w_dq.input[2] if len(w_dq.input) > 2 else ""
        if zero_point and (
            not only(zero_point, w_dq) or np.any(numpy_helper.to_array(inits[zero_point]))
        ):
            continue  # symmetric weights only
        values = numpy_helper.to_array(inits[w_dq.input[0]]).astype(np.float64)
        scales = numpy_helper.to_array(inits[w_dq.input[1]]).astype(np.float64)
        axis = _output_axis(node, values.ndim)
        scale_axis = attribute(w_dq, "axis", 1) % values.ndim
        if axis is None or (scales.size > 1 and scale_axis != axis):
            continue
        shape = [1] * values.ndim
        if scales.size > 1:
            shape[axis] = scales.size
        bias_dq = dequantizer(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if bias_dq is not None and not (
            readers.get(bias_dq.output[0], []) == [node]
            and all(only(name, bias_dq) for name in bias_dq.input if name)
        ):
            continue  # a bias QNN would read at a scale other than input x weight
        main, main_scale, rest_values, rest_scale, rest_sums = _int8_parts(
            values * scales.reshape(shape), axis, scales
        )
        x_low, x_high, _ = x_span
        y_low, y_high, y_dtype = y_span
        bound = float(rest_sums.max()) * max(abs(x_low), abs(x_high))
        margin = min(bound, MAIN_MARGIN * (y_high - y_low))
        zeros = np.zeros(main_scale.size, np.int8)
        # The main part: int8 weights and zero points in place, its bias at input x weight scale.
        replace(w_dq.input[0], main.astype(np.int8))
        replace(w_dq.input[1], main_scale.astype(np.float32))
        if zero_point:
            replace(zero_point, zeros)
        else:
            w_dq.input.append(constant(f"{w_dq.input[0]}_zero_point", zeros))
        replace_attributes(w_dq, (), axis=axis)
        if bias_dq is not None:
            x_scale = float(numpy_helper.to_array(inits[x_dq.input[1]]).reshape(-1)[0])
            bias_scale = (x_scale * main_scale).astype(np.float32)
            integers = _bias_at(inits, bias_dq, bias_scale)
            replace(bias_dq.input[0], integers)
            replace(bias_dq.input[1], bias_scale)
            if len(bias_dq.input) > 2 and bias_dq.input[2]:
                replace(bias_dq.input[2], np.zeros(bias_scale.size, np.int32))
            replace_attributes(bias_dq, (), axis=max(integers.ndim - 1, 0))
        total = node.output[0]
        if not np.any(rest_values):  # int8 holds the weights exactly: no residual layer
            details.append(f"{node.op_type} {node.name or total!r}: int16 weights -> int8 (exact)")
            continue
        main_out, rest_out = fresh(f"{total}_int8_main"), fresh(f"{total}_int8_rest")
        node.output[0] = main_out
        rest_weights = fresh(f"{w_dq.output[0]}{REST}")
        rest_inputs = [
            constant(f"{w_dq.input[0]}{REST}", rest_values.astype(np.int8)),
            constant(f"{w_dq.input[1]}{REST}", rest_scale.astype(np.float32)),
            constant(f"{w_dq.input[0]}{REST}_zero_point", zeros),
        ]
        name = fresh(f"{rest_weights}_DequantizeLinear")
        added.append(
            onnx.helper.make_node(
                "DequantizeLinear", rest_inputs, [rest_weights], name=name, axis=axis
            )
        )
        rest_layer = onnx.helper.make_node(
            node.op_type,
            [node.input[0], rest_weights],
            [rest_out],
            name=fresh(f"{node.name or total}{REST}"),
        )
        rest_layer.attribute.extend(node.attribute)
        added.append(rest_layer)
        sums = []
        for part, (low, high) in (
            (main_out, (y_low - margin, y_high + margin)),
            (rest_out, (-bound, bound)),
        ):
            scale, zero = _sixteen_bit_grid(low, high, y_dtype)
            params = [constant(f"{part}_scale", scale), constant(f"{part}_zero_point", zero)]
            nodes, decoded = _requantized(part, params, "q16", fresh)
            added.extend(nodes)
            sums.append(decoded)
        added.append(onnx.helper.make_node("Add", sums, [total], name=fresh(f"{total}_Add")))
        details.append(
            f"{node.op_type} {node.name or total!r}: int16 weights -> int8 weights plus an int8 "
            f"residual {node.op_type}, summed (residual bound {bound:.3g})"
        )
    return _with_added(model, out, added, "split_sixteen_bit_weights", details)


def _bias_at(inits: dict[str, Any], bias_dq: onnx.NodeProto, scale: np.ndarray) -> np.ndarray:
    """The int32 integers of ``bias_dq``'s bias re-rounded at ``scale`` (clipped to int32)."""
    old = numpy_helper.to_array(inits[bias_dq.input[1]]).astype(np.float64)
    bias = numpy_helper.to_array(inits[bias_dq.input[0]]).astype(np.float64) * old
    limit = np.iinfo(np.int32)
    integers = np.round(bias / scale.astype(np.float64))
    return np.clip(integers, limit.min, limit.max).astype(np.int32)


def _read_only_by(
    inits: dict[str, Any], readers: dict[str, list[onnx.NodeProto]], name: str, reader: Any
) -> bool:
    """A constant that ``reader`` alone reads: rewritten in place, its name kept (mixed
    precision and the report name weights by their initializers)."""
    return name in inits and readers.get(name, []) == [reader]


def _replace_constant(inits: dict[str, Any], name: str, array: np.ndarray) -> None:
    inits[name].CopyFrom(numpy_helper.from_array(array, name))


def _rebias(
    node: onnx.NodeProto,
    activation: str,
    input_scale: float,
    graph: onnx.GraphProto,
    inits: dict[str, Any],
    producer: dict[str, onnx.NodeProto],
    fresh: FreshNames,
) -> bool:
    """Re-quantize the int32 bias of a Conv/ConvTranspose/Gemm that reads ``activation`` to
    ``input_scale`` x its weight scale, the scale QNN assumes a bias has: left at the old input
    scale, the HTP adds it wrongly (a 1x1 Conv after a coarsened sum, 3.6x: -7 dB against the
    CPU QDQ model, which dequantizes each operand on its own and so never sees it)."""
    if node.op_type not in ("Conv", "ConvTranspose", "Gemm") or len(node.input) < 3:
        return False
    if node.input[0] != activation or not node.input[2]:
        return False
    bias_dq, weight_dq = producer.get(node.input[2]), producer.get(node.input[1])
    if any(dq is None or dq.op_type != "DequantizeLinear" for dq in (bias_dq, weight_dq)):
        return False
    names = [bias_dq.input[0], bias_dq.input[1], weight_dq.input[1]]
    if any(name not in inits for name in names):
        return False
    values = numpy_helper.to_array(inits[names[0]])
    if values.dtype != np.int32:
        return False
    if len(bias_dq.input) > 2 and bias_dq.input[2]:
        zero = inits.get(bias_dq.input[2])
        if zero is None or np.any(numpy_helper.to_array(zero)):
            return False
    old_scale = numpy_helper.to_array(inits[names[1]]).astype(np.float64)
    weight_scale = numpy_helper.to_array(inits[names[2]]).astype(np.float64)
    new_scale = (input_scale * weight_scale).astype(np.float32)
    if np.allclose(old_scale, new_scale, rtol=1e-6, atol=0):
        return False
    requantized = np.round(values * old_scale / new_scale.astype(np.float64))
    info = np.iinfo(np.int32)
    requantized = np.clip(requantized, info.min, info.max).astype(np.int32)
    value_name, scale_name = fresh(f"{names[0]}_rebiased"), fresh(f"{names[1]}_rebiased")
    graph.initializer.append(numpy_helper.from_array(requantized, value_name))
    graph.initializer.append(
        numpy_helper.from_array(np.broadcast_to(new_scale, old_scale.shape).copy(), scale_name)
    )
    inits[value_name], inits[scale_name] = graph.initializer[-2], graph.initializer[-1]
    bias_dq.input[0], bias_dq.input[1] = value_name, scale_name
    return True


def clipped_outputs(float_model: onnx.ModelProto) -> set[str]:
    """Outputs of the float model's Clips with an upper bound: onnxruntime folds such a Clip
    into the quantized range of the tensor it reads (the range's ends are then its bounds)."""
    clipped = set()
    for node in float_model.graph.node:
        if node.op_type == "Clip" and (
            (len(node.input) > 2 and node.input[2]) or any(a.name == "max" for a in node.attribute)
        ):
            clipped.add(node.output[0])
    return clipped


# A sum's range cut far below its inputs' (an attention-mask sum cut to the scores' span, its
# inputs spanning the mask's -1e9) keeps its own grid: on its coarsest input's it would hold
# fewer levels than this, and the cut range's low end would round to 0 (CLIP's padding plus
# causal mask: every masked score then read as unmasked, 0.7 dB at the Softmax on the CPU).
MIN_SUM_LEVELS = 16


def sums_no_finer_than_inputs(
    model: onnx.ModelProto,
    clipped: set[str] = frozenset(),  # type: ignore[assignment]
) -> tuple[onnx.ModelProto, Change]:
    """Give a 16-bit Add/Sub of an activation and a constant an output scale no finer than its
    coarsest input's.

    Why: the HTP computes a 16-bit Add or Sub wrongly when its output scale is finer than an
    input's: measured on ``Relu(x - 1)`` (onnxruntime folds the Relu into the Sub's output range,
    [0, max] with zero point 0, 58 times finer than x's), the ctx agreed with the CPU QDQ model
    at 11 dB; with the output scale equal to x's at 72 dB, and already at 5 dB with it twice as
    fine (zero point 0; a centred zero point held to 2x, not 16x). The result of an Add or Sub
    of two quantized values carries their rounding anyway, so a finer grid only narrows the
    range: the coarser one loses nothing the inputs had. The zero point moves so that the old
    range's low end stays on the grid (0 for a folded Relu). Sums of two activations are left
    alone: PP-OCR's residual adds, up to 17x finer than an input, agree with the CPU at 40 dB;
    so is a sum whose range ends at a folded Clip's bound (``clipped``: a wider grid would drop
    the clamp), which the HTP computed right on PP-OCR (HardSwish's ``relu6(x + 3)``).
    """
    out, graph, inits, producer, readers, fresh = _editable(model)

    def per_tensor_scale(node: onnx.NodeProto | None, sixteen_bit: bool = True) -> float | None:
        if node is None or node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            return None
        scale = inits.get(node.input[1])
        zero = inits.get(node.input[2]) if len(node.input) > 2 else None
        if scale is None or zero is None or (sixteen_bit and zero.data_type not in SIXTEEN_BIT):
            return None
        value = numpy_helper.to_array(scale)
        return float(value.reshape(-1)[0]) if value.size == 1 else None

    details: list[str] = []
    for node in graph.node:
        if node.op_type not in ("Add", "Sub") or len(node.input) != 2:
            continue
        # The constant's own grid may be 8-bit (quantized as a weight): only its scale counts.
        inputs = [per_tensor_scale(producer.get(name), sixteen_bit=False) for name in node.input]
        quantizers = readers.get(node.output[0], [])
        if any(s is None for s in inputs) or len(quantizers) != 1:
            continue
        if not any(producer[name].input[0] in inits for name in node.input):
            continue  # two activations: measured right at 17x finer (PP-OCR's residual adds)
        if node.output[0] in clipped:
            continue  # a folded Clip: the range's top is its bound (HardSwish's relu6(x + 3))
        q = quantizers[0]
        old = per_tensor_scale(q)
        coarsest = max(s for s in inputs if s is not None)
        if old is None or old >= coarsest:
            continue
        zero = inits[q.input[2]]
        info = np.iinfo(numpy_helper.to_array(zero).dtype)
        low = (info.min - float(numpy_helper.to_array(zero).reshape(-1)[0])) * old  # its low end
        if coarsest * MIN_SUM_LEVELS > (info.max - info.min) * old:
            continue  # the old range would fit in a few steps of the coarse grid: nothing left
        new_zero = int(np.clip(np.round(info.min - low / coarsest), info.min, info.max))
        scale_name, zero_name = fresh(f"{q.input[1]}_coarse"), fresh(f"{q.input[2]}_coarse")
        graph.initializer.append(
            numpy_helper.from_array(np.array(coarsest, np.float32), scale_name)
        )
        graph.initializer.append(
            numpy_helper.from_array(
                np.array(new_zero, dtype=numpy_helper.to_array(zero).dtype), zero_name
            )
        )
        params = list(q.input[1:3])
        rebiased = []
        for coder in [q, *readers.get(q.output[0], [])]:  # its Q and the DQs of what it wrote
            if (
                coder.op_type in ("QuantizeLinear", "DequantizeLinear")
                and coder.input[1:3] == params
            ):
                coder.input[1], coder.input[2] = scale_name, zero_name
                if coder.op_type == "DequantizeLinear":
                    for reader in readers.get(coder.output[0], []):
                        if _rebias(
                            reader, coder.output[0], coarsest, graph, inits, producer, fresh
                        ):
                            rebiased.append(reader.name or reader.output[0])
        details.append(
            f"{node.op_type} {node.name or node.output[0]!r}: output scale {old:.3g} -> "
            f"{coarsest:.3g} (its coarsest input's; {coarsest / old:.1f}x)"
            + (f"; bias of {', '.join(map(repr, rebiased))} re-quantized to it" if rebiased else "")
        )
    if not details:
        return model, Change("sums_no_finer_than_inputs")
    remove_dead_nodes(graph)  # the biases re-quantized leave their old values unread
    return checked_change(out, "sums_no_finer_than_inputs", details)
