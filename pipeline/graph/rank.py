"""Rank-6 tensors with a leading unit axis computed at rank 5, that axis dropped.

The HTP holds no tensor above rank 5 (``recurrent.MAX_RANK``); ``recurrent.lower_high_rank``
rewrites the patterns that make one from a rank-5 source. Multi-scale deformable attention
(RT-DETR, Deformable DETR, DINO) computes its sampling locations at rank 6 throughout,
[batch, queries, heads, levels, points, 2] with batch 1: reference points unsqueezed to rank 6,
sliced, multiplied into the reshaped offsets, added, and gathered per level. Every node of such
a region went to the CPU (an RT-DETR decoder: 3 partitions, 24 CPU compute nodes). Where every
rank-6 tensor of the graph has a leading 1, dropping it is exact: shape ops get their shapes
without it, axes move down by one, elementwise ops broadcast as before (numpy aligns trailing
axes), and a Gather or Squeeze whose result leaves the region gets its unit axis back. A graph
with any other rank > 5 tensor, or one read by an op or an axis not listed here, is left.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from . import edit
from .edit import Change
from .recurrent import MAX_RANK

HIGH_RANK = MAX_RANK + 1
# Ops computed element by element with numpy broadcasting: the same at one rank less.
_BROADCASTING = frozenset(
    {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Where", "Equal", "Less", "Greater"}
    | {"Relu", "Sigmoid", "Tanh", "Exp", "Log", "Neg", "Abs", "Sqrt", "Reciprocal", "Clip"}
    | {"Floor", "Ceil", "Round", "Sign", "Cast", "Not", "And", "Or", "Identity", "Softplus"}
)
# Ops whose one axis attribute indexes their first input (default 0 or -1).
_AXIS_ATTRIBUTE = {"Gather": 0, "Concat": 0, "Split": 0, "Softmax": -1, "LogSoftmax": -1}
# Ops whose axes are a constant input, at this index.
_AXES_INPUT = {"Squeeze": 1, "Slice": 3, "ReduceMean": 1, "ReduceSum": 1, "ReduceMax": 1}
_AXES_INPUT |= {"ReduceMin": 1}
# Ops whose result, read from a rank-6 input, has the unit axis at 0 when it has rank <= 5.
_GIVE_BACK = frozenset({"Gather", "Squeeze"})


def drop_leading_unit_axis(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Every rank-6 tensor with a leading 1 -> the same tensor without it (module doc)."""
    values = edit.inferred_values(model)
    graph = model.graph
    inits = edit.initializers_by_name(graph)

    def shape(name: str) -> tuple[int, ...] | None:
        if name in inits:
            return tuple(inits[name].dims)
        return edit.value_shape(values[name]) if name in values else None

    high = {n for node in graph.node for n in node.output if n and len(shape(n) or ()) > MAX_RANK}
    high |= {i.name for i in graph.initializer if len(i.dims) > MAX_RANK}
    unchanged = model, Change("drop_leading_unit_axis")
    if not high or high & {o.name for o in graph.output}:
        return unchanged
    if any((s := shape(n)) is None or len(s) != HIGH_RANK or s[0] != 1 for n in high):
        return unchanged
    touched = [n for n in graph.node if set(n.input) & high or set(n.output) & high]
    if not all(_takes(node, high, inits) for node in touched):
        return unchanged
    return _apply(model, high, shape, len(touched))


def _axes(node: onnx.NodeProto, inits: Mapping[str, onnx.TensorProto]) -> list[int] | None:
    """The constant axes a node of ``_AXES_INPUT`` or ``_AXIS_ATTRIBUTE`` works on (its own
    indexing), None when computed or absent (all axes)."""
    if node.op_type in _AXIS_ATTRIBUTE:
        return [int(edit.attribute(node, "axis", _AXIS_ATTRIBUTE[node.op_type]))]
    index = _AXES_INPUT[node.op_type]
    name = node.input[index] if len(node.input) > index else ""
    if not name or name not in inits:
        return None
    return [int(a) for a in numpy_helper.to_array(inits[name]).reshape(-1)]


def _takes(node: onnx.NodeProto, high: set[str], inits: Mapping[str, onnx.TensorProto]) -> bool:
    """Whether this rewrite knows ``node``, which reads or writes a rank-6 tensor."""
    op = node.op_type
    reads = any(i in high for i in node.input)
    if node.domain not in edit.DEFAULT_DOMAINS:
        return False
    if op in _BROADCASTING:
        return True
    if op in ("Reshape", "Expand"):
        return node.input[1] in inits
    if op == "Unsqueeze":
        return not reads  # a rank-5 source made rank 6: written as a Reshape
    if op == "Transpose":
        perm = edit.attribute(node, "perm", None)
        return perm is not None and perm[0] == 0
    if op in _AXIS_ATTRIBUTE or op in _AXES_INPUT:
        if op.startswith("Reduce") and not int(edit.attribute(node, "keepdims", 1)):
            return False
        if reads and node.input[0] not in high:  # a rank-6 index or bound, not the data
            return False
        axes = _axes(node, inits)  # rank 6 in: 0 and -6 name the unit axis
        return axes is not None and all(a not in (0, -HIGH_RANK) for a in axes)
    return False


def _apply(
    model: onnx.ModelProto,
    high: set[str],
    shape: Callable[[str], tuple[int, ...] | None],
    touched: int,
) -> tuple[onnx.ModelProto, Change]:
    model = edit.copy_model(model)
    graph = model.graph
    inits = edit.initializers_by_name(graph)
    fresh = edit.FreshNames(model)
    added: list[onnx.TensorProto] = []

    def ints(values: list[int], base: str) -> str:
        name = fresh(base)
        added.append(numpy_helper.from_array(np.array(values, np.int64), name))
        return name

    for init in graph.initializer:  # rank-6 constants: squeezed in place
        if init.name in high:
            array = numpy_helper.to_array(init)
            init.CopyFrom(numpy_helper.from_array(array.reshape(array.shape[1:]), init.name))
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        reads = any(i in high for i in node.input)
        writes = any(o in high for o in node.output)
        nodes.append(node)
        if not (reads or writes):
            continue
        op, base = node.op_type, node.name or node.output[0]
        if op in ("Reshape", "Expand") and writes:
            node.input[1] = ints(list(shape(node.output[0]) or ())[1:], f"{base}_rank5")
        elif op == "Unsqueeze":  # rank <= 5 in, rank 6 out
            node.op_type = "Reshape"
            target = ints(list(shape(node.output[0]) or ())[1:], f"{base}_rank5")
            node.input[:] = [node.input[0], target]
        elif op == "Transpose":
            perm = [int(p) - 1 for p in edit.attribute(node, "perm", [])[1:]]
            edit.replace_attributes(node, ("perm",), perm=perm)
        elif op in _AXIS_ATTRIBUTE or op in _AXES_INPUT:
            moved = [a - 1 if a > 0 else a for a in _axes(node, inits) or []]
            if op in _AXIS_ATTRIBUTE:
                edit.replace_attributes(node, ("axis",), axis=moved[0])
            else:
                node.input[_AXES_INPUT[op]] = ints(moved, f"{base}_rank5_axes")
        if reads and op in _GIVE_BACK:  # its rank <= 5 result had the unit axis at 0
            for index, name in enumerate(node.output):
                if name and name not in high:
                    inner = fresh(f"{name}_without_unit_axis")
                    node.output[index] = inner
                    unit = ints([0], f"{name}_unit_axis")
                    nodes.append(helper.make_node("Unsqueeze", [inner, unit], [name]))
    graph.initializer.extend(added)
    edit.set_nodes(graph, nodes)
    kept = [v for v in graph.value_info if v.name not in high]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    details = [
        f"{len(high)} rank-6 tensor(s) with a leading 1 computed at rank 5, "
        f"{touched} node(s) adjusted"
    ]
    return edit.checked_change(model, "drop_leading_unit_axis", details)


# Ops that only reshape their first input (their other inputs constants): the same elements in
# the same order, so any chain of them is one Reshape to its last shape.
RESHAPE_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten"})


def collapse_high_rank_reshapes(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A chain of reshapes through a tensor of rank > 5 -> one Reshape from its start.

    Why: tf2onnx spells some layout moves as Unsqueeze, a rank-6 Reshape and a Squeeze (a
    Keras LayerNormalization's mean over channels: [1, 1, 64, 64] -> [1, 1, 1, 64, 64, 1] ->
    [1, 1, 64, 64, 1] -> [1, 1, 64, 64], the identity), and the HTP holds no rank-6 tensor: each
    such chain and its Q/DQ stayed on the CPU (a fingerprint network: 4 of them, 6 partitions).
    Reshapes keep the elements in order, so the chain is one Reshape from its first input to
    its last shape (an identity one goes at the next step). Only chains through rank > 5 change.
    """
    graph = model.graph
    if not any(n.op_type in RESHAPE_OPS for n in graph.node):
        return model, Change("collapse_high_rank_reshapes")
    values = edit.inferred_values(model)
    inits = edit.initializers_by_name(graph)

    def shape(name: str) -> tuple[int, ...] | None:
        return edit.value_shape(values[name]) if name in values else None

    def reshape(node: onnx.NodeProto) -> bool:
        return (
            node.op_type in RESHAPE_OPS
            and node.domain in edit.DEFAULT_DOMAINS
            and all(not n or n in inits for n in node.input[1:])
        )

    nodes = list(graph.node)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    plans: dict[int, tuple[str, tuple[int, ...]]] = {}
    for index, node in enumerate(nodes):
        out = shape(node.output[0]) if node.output else None
        if not reshape(node) or out is None or len(out) > MAX_RANK:
            continue
        source, through_high = node.input[0], False
        while (at := producer.get(source)) is not None and reshape(nodes[at]):
            through_high |= len(shape(source) or ()) > MAX_RANK
            source = nodes[at].input[0]
        start = shape(source)
        if through_high and start is not None and len(start) <= MAX_RANK:
            plans[index] = (source, out)
    if not plans:
        return model, Change("collapse_high_rank_reshapes")
    result = edit.copy_model(model)
    fresh = edit.FreshNames(result)
    details = {}
    for index, (source, out) in plans.items():
        node = result.graph.node[index]
        target = fresh(f"{node.name or node.output[0]}_shape")
        result.graph.initializer.append(numpy_helper.from_array(np.array(out, np.int64), target))
        details[node.output[0]] = (
            f"{edit.node_label(node)}: the reshapes from {source!r} -> Reshape to {list(out)}"
        )
        node.op_type = "Reshape"
        del node.attribute[:]
        node.input[:] = [source, target]
    edit.remove_dead_nodes(result.graph)  # a chain's inner links, read by its end alone
    produced = {o for n in result.graph.node for o in n.output}
    shown = [line for name, line in details.items() if name in produced]
    return edit.checked_change(result, "collapse_high_rank_reshapes", shown)


def moves_only_unit_axes(shape: Sequence[int], perm: Sequence[int]) -> bool:
    """Whether transposing ``shape`` by ``perm`` keeps every axis longer than 1 in its order:
    the same elements in the same order, a Reshape."""
    kept = [p for p in perm if shape[p] != 1]
    return kept == sorted(kept)


def input_unit_axis_transposes(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A Transpose of a graph input that moves only axes of size 1 -> the Reshape it is.

    Why: a grayscale NHWC input [1, H, W, 1] made NCHW by Transpose(0, 3, 1, 2) for a dilated
    Conv while another branch reads the same input (through Unsqueeze and Reshape, as tf2onnx
    writes a TF stem) compiled whole, but its context failed every run on the HTP simulator
    ("ORT Tensor data size does not match QNN tensor data size", then the session fell back to
    the CPU and refused the EPContext node; measured with both branches, either alone ran). A
    Reshape moves the same elements and ran right. Only Transposes of graph inputs change.
    """
    graph = model.graph
    inputs = {i.name: edit.value_shape(i) for i in graph.input}
    targets: dict[int, tuple[int, ...]] = {}
    for index, node in enumerate(graph.node):
        if node.op_type != "Transpose" or node.domain not in edit.DEFAULT_DOMAINS:
            continue
        shape = inputs.get(node.input[0])
        perm = [int(p) for p in edit.attribute(node, "perm", [])]
        if shape is None or sorted(perm) != list(range(len(shape))) or perm == sorted(perm):
            continue
        if moves_only_unit_axes(shape, perm):
            targets[index] = tuple(shape[p] for p in perm)
    if not targets:
        return model, Change("input_unit_axis_transposes")
    result = edit.copy_model(model)
    fresh = edit.FreshNames(result)
    details = []
    for index, out in targets.items():
        node = result.graph.node[index]
        target = fresh(f"{node.name or node.output[0]}_shape")
        result.graph.initializer.append(numpy_helper.from_array(np.array(out, np.int64), target))
        details.append(
            f"{edit.node_label(node)} of input {node.input[0]!r} -> Reshape to {list(out)}"
        )
        node.op_type = "Reshape"
        del node.attribute[:]
        node.input.append(target)
    return edit.checked_change(result, "input_unit_axis_transposes", details)


# Element-wise ops the QNN EP leaves on the CPU at rank 5 and takes at rank 4, measured with
# 8- and 16-bit Q/DQ and in fp16 (onnxruntime-qnn 2.7.0; Sigmoid, Relu, Exp, Abs, LeakyRelu,
# Clip and Reciprocal run at rank 5 in both; HardSigmoid and HardSwish quantized only), and
# their trigonometric kin.
RANK5_REFUSED = frozenset(
    {"Tanh", "Log", "Sqrt", "Neg", "Softplus", "Elu", "Selu", "Celu", "Gelu", "Erf", "Floor"}
    | {"Ceil", "Round", "Sign", "Softsign", "Sin", "Cos", "Tan", "Asin", "Acos", "Atan"}
    | {"Sinh", "Cosh", "Asinh", "Acosh", "Atanh", "ThresholdedRelu", "HardSigmoid", "HardSwish"}
)


# Other ops the QNN EP leaves on the CPU at rank 5: a LayerNormalization over trailing axes
# and a MatMul by a 1-D or 2-D weight, whose two leading axes merge exactly; an ArgMax or ArgMin
# over a trailing axis likewise (its rank-5 context failed to finalize: MEM_ALLOC); a Resize
# that leaves a unit axis as it is, without that axis.
_RANK5_OTHERS = frozenset({"LayerNormalization", "MatMul", "ArgMax", "ArgMin", "Resize"})


def _last_unit_axis(shape: Sequence[int]) -> int | None:
    return next((axis for axis in range(len(shape) - 1, -1, -1) if shape[axis] == 1), None)


def rank4_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """A rank-5 ``shape`` with the same elements in the same order at rank 4: a unit axis
    dropped (the last one, the depth of a Conv3d used on frames), else the last two merged."""
    unit = _last_unit_axis(shape)
    if unit is not None:
        return tuple(s for axis, s in enumerate(shape) if axis != unit)
    return (*shape[:3], shape[3] * shape[4])


_CROP = (b"tf_crop_and_resize", "tf_crop_and_resize")


def _resize_at_rank_4(
    node: onnx.NodeProto, shape: Sequence[int], inits: Mapping[str, onnx.TensorProto]
) -> tuple[tuple[int, ...], dict[int, np.ndarray]] | None:
    """A rank-5 Resize's rank-4 form: its unit axis (``rank4_shape``'s) dropped where it is not
    resized, with the scales or sizes (constant) of the other axes; None for any other."""
    lower = rank4_shape(shape)
    unit = _last_unit_axis(shape)
    if unit is None or edit.attribute(node, "axes", None) is not None:
        return None
    mode = edit.attribute(node, "coordinate_transformation_mode", b"half_pixel")
    roi = node.input[1] if len(node.input) > 1 else ""
    if roi and (roi not in inits or numpy_helper.to_array(inits[roi]).size or mode in _CROP):
        return None
    for slot in (2, 3):
        name = node.input[slot] if len(node.input) > slot else ""
        if not name or name not in inits:
            continue
        values = numpy_helper.to_array(inits[name]).reshape(-1)
        if values.size == 0:
            continue
        if values.size != 5 or values[unit] != 1:
            return None
        return tuple(lower), {slot: np.delete(values, unit)}
    return None


def rank5_elementwise_at_rank_4(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """An element-wise op of ``RANK5_REFUSED`` on a rank-5 tensor -> Reshape to rank 4, the op,
    Reshape back: the same values, in an op the HTP takes. So too the ``_RANK5_OTHERS`` (a
    LayerNormalization, a MatMul by a weight, an ArgMax, a Resize), each at its rank-4 form.

    Why: a RivaGAN watermark encoder computes on [1, C, 1, H, W] frames (Conv3d with a unit
    depth); every op of it ran on the HTP but its 16-bit Tanhs, which the QNN EP left on the
    CPU (5 partitions, 12 CPU nodes), and the whole model in fp16 failed to finalize."""
    values = edit.inferred_values(model)
    targets: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # in: rank 5, rank 4
    back: dict[int, tuple[int, ...]] = {}  # the output's rank-5 shape, where not the input's
    replaced: dict[int, dict[int, np.ndarray]] = {}  # constant inputs given at rank 4 (slot)
    inits = edit.initializers_by_name(model.graph)

    def shape_of(name: str) -> tuple[int, ...] | None:
        found = values.get(name)
        shape = edit.value_shape(found) if found is not None else None
        return None if shape is None else tuple(shape)

    for index, node in enumerate(model.graph.node):
        op = node.op_type
        if node.domain not in edit.DEFAULT_DOMAINS or op not in RANK5_REFUSED | _RANK5_OTHERS:
            continue
        shape = shape_of(node.input[0]) if node.input else None
        if shape is None or len(shape) != 5 or len(node.output) != 1:
            continue
        merged = (shape[0] * shape[1], *shape[2:])
        out_shape = shape_of(node.output[0])
        if op in RANK5_REFUSED:
            targets[index] = (shape, rank4_shape(shape))
        elif op == "LayerNormalization" and int(edit.attribute(node, "axis", -1)) % 5 >= 2:
            # its normalized axes stay; the two leading ones merge (the axis counted from the
            # end, the same axes at rank 4)
            targets[index] = (shape, merged)
        elif (op == "MatMul" and len(shape_of(node.input[1]) or ()) in (1, 2)) or (
            op in ("ArgMax", "ArgMin") and int(edit.attribute(node, "axis", 0)) % 5 >= 2
        ):  # a layer's weight, or an index over a trailing axis: the leading ones are a batch
            kept = op == "MatMul" or int(edit.attribute(node, "keepdims", 1))
            if out_shape is not None and len(out_shape) == 5 - (not kept):
                back[index] = out_shape  # [..., K] by [K, N]: [..., N] back
                targets[index] = (shape, merged)
        elif (
            op == "Resize"
            and out_shape is not None
            and (found := _resize_at_rank_4(node, shape, inits)) is not None
        ):
            targets[index], back[index] = (shape, found[0]), out_shape
            replaced[index] = found[1]
    if not targets:
        return model, Change("rank5_elementwise_at_rank_4")
    result = edit.copy_model(model)
    graph = result.graph
    fresh = edit.FreshNames(result)
    nodes: list[onnx.NodeProto] = []
    details = []
    for index, node in enumerate(graph.node):
        if index not in targets:
            nodes.append(node)
            continue
        shape, lower = targets[index]
        base = node.name or node.output[0]
        flat, restore = fresh(f"{base}_rank4_shape"), fresh(f"{base}_rank5_shape")
        graph.initializer.extend(
            [
                numpy_helper.from_array(np.array(lower, np.int64), flat),
                numpy_helper.from_array(np.array(back.get(index, shape), np.int64), restore),
            ]
        )
        into, out = fresh(f"{base}_rank4_in"), fresh(f"{base}_rank4_out")
        moved = onnx.NodeProto()
        moved.CopyFrom(node)
        moved.input[0], moved.output[0] = into, out
        for attr in moved.attribute:
            if node.op_type != "MatMul" and attr.name == "axis":  # counted from the end
                attr.i = attr.i % 5 - 5
        for slot, array in replaced.get(index, {}).items():
            moved.input[slot] = fresh(f"{base}_rank4_{slot}")
            graph.initializer.append(numpy_helper.from_array(array, moved.input[slot]))
        nodes += [
            helper.make_node("Reshape", [node.input[0], flat], [into]),
            moved,
            helper.make_node("Reshape", [out, restore], [node.output[0]]),
        ]
        details.append(f"{edit.node_label(node)}: {list(shape)} -> {list(lower)}")
    edit.set_nodes(graph, nodes)
    return edit.checked_change(result, "rank5_elementwise_at_rank_4", details)
