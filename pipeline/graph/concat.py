"""A Split that takes apart what a Concat just joined -> the joined tensors themselves.

A tensor quantizes with one scale. A detector head that joins its boxes (pixels, up to the image
size) and its class scores (probabilities) into one tensor, lays it out for its post-processing
and splits it again (YOLOv10's end-to-end head: Concat on the channels, Transpose, Split on the
last axis) gave its scores the boxes' 16-bit grid: 0.05 a step for probabilities that mostly lie
below 0.001 (0 dB on them). Where the Split's pieces are exactly the Concat's inputs (the same
axis once the Transposes between are followed, the same sizes), each piece is its input moved
by those Transposes: the same values, each on its own grid.
"""

from __future__ import annotations

import onnx
from onnx import helper, numpy_helper

from . import edit
from .edit import Change

STEP = "split_of_concat"


def _split_sizes(
    node: onnx.NodeProto, inits: dict[str, onnx.TensorProto], length: int
) -> list[int] | None:
    """The sizes a Split cuts along its axis (an input, an attribute, or equal parts)."""
    if len(node.input) > 1 and node.input[1]:
        if node.input[1] not in inits:
            return None
        return [int(v) for v in numpy_helper.to_array(inits[node.input[1]]).reshape(-1)]
    given = edit.attribute(node, "split", None)
    if given:
        return [int(v) for v in given]
    parts = len(node.output)
    return [length // parts] * parts if parts and length % parts == 0 else None


def split_of_concat(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Each Split that undoes a Concat (through Transposes) -> the Concat's inputs, moved."""
    graph = model.graph
    if not any(n.op_type == "Split" for n in graph.node):
        return model, Change(STEP)
    nodes = list(graph.node)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    used = edit.used_names(graph)
    outputs = {o.name for o in graph.output}
    inits = edit.initializers_by_name(graph)
    values = None
    plans: dict[int, list[onnx.NodeProto]] = {}
    details = []
    for index, split in enumerate(nodes):
        if split.op_type != "Split" or split.domain not in edit.DEFAULT_DOMAINS:
            continue
        perm: list[int] | None = None  # concat axis i is the split input's axis perm[i]
        name = split.input[0]
        while (at := producer.get(name)) is not None and nodes[at].op_type == "Transpose":
            if used[name] != 1 or name in outputs:
                break
            step = [int(p) for p in edit.attribute(nodes[at], "perm", [])]
            perm = step if perm is None else [step[p] for p in perm]
            name = nodes[at].input[0]
        at = producer.get(name)
        if at is None or nodes[at].op_type != "Concat" or used[name] != 1 or name in outputs:
            continue
        concat = nodes[at]
        if values is None:
            values = edit.inferred_values(model)
        shapes = [edit.value_shape(values[i]) if i in values else None for i in concat.input]
        if any(s is None for s in shapes) or not shapes:
            continue
        rank = len(shapes[0])
        perm = perm or list(range(rank))
        join = int(edit.attribute(concat, "axis", 0)) % rank
        cut = int(edit.attribute(split, "axis", 0)) % rank
        if perm[cut] != join:
            continue
        sizes = [s[join] for s in shapes]
        if _split_sizes(split, inits, sum(sizes)) != sizes or len(split.output) != len(sizes):
            continue
        moved = []
        for piece, (source, out) in enumerate(zip(concat.input, split.output, strict=True)):
            if perm == list(range(rank)):
                moved.append(helper.make_node("Identity", [source], [out], f"{out}/joined"))
            else:
                moved.append(
                    helper.make_node(
                        "Transpose", [source], [out], f"{split.name or out}/piece{piece}", perm=perm
                    )
                )
        plans[index] = moved
        details.append(
            f"{edit.node_label(split)} takes apart {edit.node_label(concat)}: its "
            f"{len(sizes)} pieces are the joined tensors, each on its own grid"
        )
    if not plans:
        return model, Change(STEP)
    result = edit.copy_model(model)
    kept = []
    for index, node in enumerate(result.graph.node):
        kept.extend(plans.get(index, [node]))
    edit.set_nodes(result.graph, kept)
    edit.sort_graph(result.graph)
    edit.remove_dead_nodes(result.graph)
    return edit.checked_change(result, STEP, details)
