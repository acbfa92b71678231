"""Ops on tensors of rank > 5 computed at rank <= 5, their neighbouring axes merged.

The HTP holds no tensor above rank 5 (``recurrent.MAX_RANK``): the QNN EP leaves every op that
reads or writes one on the CPU with its Q/DQ. Vision transformers reach rank 6 on the way
between windows and tokens: Hiera's mask units ([4, 14, 2, 14, 2, 48] transposed
[0, 2, 4, 1, 3, 5]), its q/k/v split along a leading 3 of [3, 1, 4, 49, 16, 48] then squeezed,
its query pooling (a ReduceMax over one axis of [1, 2, 49, 4, 16, 48]): 7 partitions and 121
CPU nodes. Most such ops only care about some of their axes (the one reduced, split, gathered
from or softmaxed; the two a MatMul contracts; the ones a broadcast stretches): a run of
neighbouring axes the op treats alike is one axis to it, with the same elements in the same
order. The dynamo exporter's adaptive average pooling, where the sizes do not divide, picks
window offsets from a rank-6 [N, C, bins, kh, bins, kw] view with scalar Gathers. So each
op gets its input reshaped to those merged axes, the op itself, and its output reshaped back;
``rank.collapse_high_rank_reshapes``, which runs next, then joins the Reshapes on either side of
each rank-6 tensor into one, and the rank-6 tensors are gone. A Transpose that keeps no two
axes together is done as two that each do (a search over the 720 orders of six axes).

Unit axes merge with anything. An op this module does not know, or one whose axes leave more
than five groups, is left as it was.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from . import edit
from .edit import Change
from .rank import RESHAPE_OPS
from .recurrent import MAX_RANK

# Element-wise ops of one input: any grouping.
_UNARY = frozenset(
    {"Relu", "Sigmoid", "Tanh", "Exp", "Log", "Neg", "Abs", "Sqrt", "Reciprocal", "Erf"}
    | {"Softplus", "Softsign", "Elu", "Selu", "LeakyRelu", "HardSigmoid", "HardSwish", "Gelu"}
    | {"Floor", "Ceil", "Round", "Sign", "Sin", "Cos", "Not", "Identity", "Cast", "Clip"}
)
# Element-wise ops with numpy broadcasting over all their inputs.
_BROADCAST = frozenset(
    {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Mean", "Sum", "Where", "PRelu"}
    | {"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor", "Mod"}
)
_REDUCE = frozenset(
    {"ReduceMax", "ReduceMin", "ReduceSum", "ReduceMean", "ReduceProd", "ReduceL1", "ReduceL2"}
    | {"ReduceLogSumExp", "ReduceSumSquare", "ReduceLogSum"}
)
# Ops along one axis (an attribute, CumSum's a constant input).
_ONE_AXIS = {"Softmax": -1, "LogSoftmax": -1, "ArgMax": 0, "ArgMin": 0, "Split": 0}
_ONE_AXIS |= {"Concat": 0, "CumSum": 0}

Groups = list[list[int]]


def _runs(flags: Sequence[object], shape: Sequence[int]) -> Groups:
    """Consecutive axes with equal ``flags`` as groups; a unit axis joins its neighbour (the
    one before it, or the next where it leads) whatever its flag."""
    groups: Groups = []
    kinds: list[object] = []
    pending: list[int] = []  # leading unit axes, waiting for a group to join
    for axis, (flag, size) in enumerate(zip(flags, shape, strict=True)):
        if size == 1:
            if groups:
                groups[-1].append(axis)
            else:
                pending.append(axis)
            continue
        if groups and kinds[-1] == flag:
            groups[-1].append(axis)
        else:
            groups.append([*pending, axis])
            kinds.append(flag)
            pending = []
    if pending:  # every axis is a unit one
        groups.append(pending)
    return groups


def _merged(shape: Sequence[int], groups: Groups) -> list[int]:
    return [math.prod(shape[a] for a in group) for group in groups]


def _group_of(groups: Groups, axis: int) -> int:
    return next(i for i, group in enumerate(groups) if axis in group)


def _transpose_runs(shape: Sequence[int], perm: Sequence[int]) -> Groups:
    """The input axes of a Transpose as groups that stay together, in order, in its output;
    unit axes dropped into their neighbours."""
    kept = [axis for axis in perm if shape[axis] != 1]
    groups: Groups = []
    for axis in kept:
        if (
            groups
            and groups[-1][-1] < axis
            and all(shape[a] == 1 for a in range(groups[-1][-1] + 1, axis))
        ):
            groups[-1].append(axis)
        else:
            groups.append([axis])
    return groups


def _transpose_rank(shape: Sequence[int], perm: Sequence[int]) -> int:
    return max(len(_transpose_runs(shape, perm)), 1)


def _transpose_steps(shape: Sequence[int], perm: Sequence[int]) -> list[list[int]] | None:
    """``perm`` as one or two transposes of at most five merged axes each; None if not."""
    if _transpose_rank(shape, perm) <= MAX_RANK:
        return [list(perm)]
    rank = len(perm)
    for first in itertools.permutations(range(rank)):
        if _transpose_rank(shape, first) > MAX_RANK:
            continue
        middle = [shape[a] for a in first]
        # then[i] = the axis of the middle tensor that holds output axis i
        then = [first.index(p) for p in perm]
        if _transpose_rank(middle, then) <= MAX_RANK:
            return [list(first), then]
    return None


def _constant_axes(
    node: onnx.NodeProto, slot: int, inits: Mapping[str, onnx.TensorProto]
) -> list[int] | None:
    """Axes given as attribute ``axes`` or as constant input ``slot``; None where computed,
    [] where absent."""
    attr = edit.attribute(node, "axes", None)
    if attr is not None:
        return [int(a) for a in attr]
    name = node.input[slot] if len(node.input) > slot else ""
    if not name:
        return []
    if name not in inits:
        return None
    return [int(a) for a in numpy_helper.to_array(inits[name]).reshape(-1)]


@dataclass
class _Plan:
    """One op's rewrite: its inputs' new shapes (None: as they are), the attributes and
    constant inputs (slot -> value) it gets; a Transpose's steps instead."""

    shapes: list[list[int] | None]
    attributes: dict[str, object] = field(default_factory=dict)
    inputs: dict[int, np.ndarray] = field(default_factory=dict)
    steps: list[list[int]] = field(default_factory=list)


def _grouped(shape: Sequence[int], special: set[int], together: bool) -> Groups | None:
    """Groups where the ``special`` axes stay apart from the others (``together``: neighbouring
    special axes merge, as a reduction over both may; else each stands alone), at most five of
    them; None where more, or where a special axis is a unit one (an op along it is no op
    along its group)."""
    if any(shape[a] == 1 for a in special):
        return None
    flags = [(a in special) if together else (a if a in special else -1) for a in range(len(shape))]
    groups = _runs(flags, shape)
    return groups if len(groups) <= MAX_RANK else None


def _broadcast_groups(
    shapes: Sequence[Sequence[int]], out: Sequence[int]
) -> tuple[list[list[int]], Groups]:
    """The inputs' shapes padded to the rank of ``out`` (numpy's alignment), and ``out``'s
    axes grouped where every input is either full or unit along the whole run."""
    padded = [[1] * (len(out) - len(s)) + list(s) for s in shapes]
    flags = [tuple(p[axis] == out[axis] for p in padded) for axis in range(len(out))]
    return padded, _runs(flags, out)


def _plan(
    node: onnx.NodeProto,
    ins: list[tuple[int, ...] | None],
    outs: list[tuple[int, ...]],
    inits: Mapping[str, onnx.TensorProto],
    opset: int,
) -> _Plan | None:
    """How ``node``, which reads or writes a tensor of rank > 5, computes at rank <= 5."""
    op = node.op_type
    shape = ins[0]
    if shape is None or any(n and s is None for n, s in zip(node.input, ins, strict=True)):
        return None
    rank = len(shape)
    if op in _UNARY:
        if any(s is not None and math.prod(s) != 1 for s in ins[1:]):
            return None  # Clip's bounds are one value each; anything more is not element-wise
        merged = list(shape)
        while len(merged) > MAX_RANK:  # the leading axes merge
            merged[:2] = [merged[0] * merged[1]]
        return _Plan([merged])
    if op in _BROADCAST:
        padded, groups = _broadcast_groups([s for s in ins if s is not None], outs[0])
        if len(groups) > MAX_RANK:
            return None
        shapes: list[list[int] | None] = [
            None if math.prod(p) == 1 else _merged(p, groups) for p in padded
        ]
        return _Plan(shapes)
    if op == "MatMul":
        out, (a, b) = outs[0], ins
        if a is None or b is None or len(a) < 2 or len(b) < 2:
            return None
        batch = len(out) - 2  # the batch axes broadcast; the last two are the product's
        padded, groups = _broadcast_groups([s[:-2] for s in (a, b)], out[:batch])
        if len(groups) + 2 > MAX_RANK:
            return None
        return _Plan(
            [
                list(s) if len(s) == 2 else [*_merged(p, groups), *s[-2:]]
                for s, p in zip((a, b), padded, strict=True)
            ]
        )
    if op == "Transpose":
        perm = edit.attribute(node, "perm", None)
        perm = list(range(rank))[::-1] if perm is None else [int(p) for p in perm]
        if all(size == 1 for size in shape):
            return None
        steps = _transpose_steps(shape, perm)
        return None if steps is None else _Plan([None], steps=steps)
    if op in _REDUCE:
        axes = _constant_axes(node, 1, inits)
        if not axes or int(edit.attribute(node, "noop_with_empty_axes", 0)):
            return None  # computed, or every axis
        special = {a % rank for a in axes if shape[a % rank] != 1}  # a unit axis: no op
        if not special:
            return None
        groups = _grouped(shape, special, together=True)
        if groups is None:
            return None
        moved = sorted({_group_of(groups, a) for a in special})
        if edit.attribute(node, "axes", None) is not None:
            return _Plan([_merged(shape, groups)], attributes={"axes": moved})
        return _Plan([_merged(shape, groups)], inputs={1: np.array(moved, np.int64)})
    if op in ("Softmax", "LogSoftmax") and opset < 13:
        return None  # softmax over the flattened trailing axes
    if op in _ONE_AXIS:
        if op == "CumSum":
            if node.input[1] not in inits:
                return None
            axis = int(numpy_helper.to_array(inits[node.input[1]]).reshape(-1)[0]) % rank
        else:
            axis = int(edit.attribute(node, "axis", _ONE_AXIS[op])) % rank
        reference = outs[0] if op == "Concat" else shape  # a Concat input may be 1 along it
        groups = _grouped(reference, {axis}, together=False)
        if groups is None:
            return None
        at = _group_of(groups, axis)
        if op == "Concat":
            return _Plan([_merged(s, groups) for s in ins], attributes={"axis": at})  # type: ignore[arg-type]
        if op == "CumSum":
            return _Plan([_merged(shape, groups), None], inputs={1: np.array(at, np.int64)})
        return _Plan([_merged(shape, groups)], attributes={"axis": at})
    if op == "Gather":
        axis = int(edit.attribute(node, "axis", 0)) % rank
        indices = ins[1]
        if indices is None:
            return None
        groups = _grouped(shape, {axis}, together=False)
        if groups is None or len(groups) - 1 + len(indices) > MAX_RANK:
            return None
        at = _group_of(groups, axis)
        return _Plan([_merged(shape, groups), None], attributes={"axis": at})
    if op == "Slice":
        axes = _constant_axes(node, 3, inits)
        if not axes or any(n and n not in inits for n in node.input[1:]):
            return None
        special = {a % rank for a in axes}
        groups = _grouped(shape, special, together=False)
        if groups is None:
            return None
        moved = np.array([_group_of(groups, a % rank) for a in axes], np.int64)
        return _Plan([_merged(shape, groups)], inputs={3: moved})
    return None


def high_rank_ops_at_rank_5(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Each op that reads or writes a tensor of rank > 5 -> Reshape to its merged axes, the
    op, Reshape back (module doc); reshapes themselves are ``collapse_high_rank_reshapes``'."""
    values = edit.inferred_values(model)
    graph = model.graph
    inits = edit.initializers_by_name(graph)
    opset = edit.opset_version(model) or 21

    def shape_of(name: str) -> tuple[int, ...] | None:
        if name in inits:
            return tuple(inits[name].dims)
        found = values.get(name)
        return None if found is None else edit.value_shape(found)

    plans: dict[int, _Plan] = {}
    for index, node in enumerate(graph.node):
        if node.domain not in edit.DEFAULT_DOMAINS or not node.input or node.op_type in RESHAPE_OPS:
            continue
        ins = [shape_of(n) if n else None for n in node.input]
        outs = [shape_of(n) for n in node.output if n]
        if not any(s is not None and len(s) > MAX_RANK for s in [*ins, *outs]):
            continue
        if any(s is None for s in outs):
            continue
        plan = _plan(node, ins, outs, inits, opset)  # type: ignore[arg-type]
        if plan is not None:
            plans[index] = plan
    if not plans:
        return model, Change("high_rank_ops_at_rank_5")
    return _apply(model, plans, shape_of)


def _apply(
    model: onnx.ModelProto,
    plans: dict[int, _Plan],
    shape_of: Callable[[str], tuple[int, ...] | None],
) -> tuple[onnx.ModelProto, Change]:
    result = edit.copy_model(model)
    rewrite = edit.NodeRewrite(result)  # its constants and fresh names
    inits, fresh, constant = rewrite.inits, rewrite.fresh, rewrite.constant
    nodes: list[onnx.NodeProto] = []
    details: list[str] = []

    made: dict[tuple[str, tuple[int, ...]], str] = {}

    def reshaped(name: str, shape: Sequence[int], base: str) -> str:
        """``name`` at ``shape``, one Reshape for every op that reads it so (the dynamo
        exporter's adaptive pooling picks 12 window offsets from one rank-6 tensor)."""
        key = (name, tuple(shape))
        if key not in made:
            made[key] = fresh(base)
            target = constant(np.array(shape, np.int64), f"{made[key]}_shape")
            nodes.append(helper.make_node("Reshape", [name, target], [made[key]]))
        return made[key]

    for index, node in enumerate(result.graph.node):
        plan = plans.get(index)
        if plan is None:
            nodes.append(node)
            continue
        base = node.name or node.output[0]
        shape = list(shape_of(node.input[0]) or ())
        if plan.steps:  # a Transpose: each step at its merged axes
            current = node.input[0]
            for number, perm in enumerate(plan.steps):
                runs = _transpose_runs(shape, perm)
                order = sorted(runs, key=lambda g: g[0])
                inner = reshaped(current, _merged(shape, order), f"{base}_step{number}_in")
                current = fresh(f"{base}_step{number}_out")
                step_perm = [order.index(g) for g in runs]
                nodes.append(helper.make_node("Transpose", [inner], [current], perm=step_perm))
                shape = [shape[a] for a in perm]
            target = constant(np.array(shape, np.int64), f"{base}_shape")
            nodes.append(helper.make_node("Reshape", [current, target], [node.output[0]]))
            details.append(
                f"{edit.node_label(node)}: rank {len(shape)} as {len(plan.steps)} "
                "transpose(s) of at most 5 merged axes"
            )
            continue
        moved = onnx.NodeProto()
        moved.CopyFrom(node)
        for slot, name in enumerate(node.input):
            if slot in plan.inputs:
                moved.input[slot] = constant(plan.inputs[slot], f"{base}_input{slot}")
            elif name and slot < len(plan.shapes) and plan.shapes[slot] is not None:
                target = plan.shapes[slot]
                if name in inits and list(shape_of(name) or ()) != target:  # a new constant
                    array = numpy_helper.to_array(inits[name]).reshape(target)
                    moved.input[slot] = constant(array, f"{name}_merged")
                elif list(shape_of(name) or ()) != target:
                    moved.input[slot] = reshaped(name, target, f"{base}_input{slot}_merged")
        for key, value in plan.attributes.items():
            edit.replace_attributes(moved, (key,), **{key: value})
        back = []
        for slot, name in enumerate(node.output):
            if name:
                moved.output[slot] = fresh(f"{name}_merged")
                target = constant(np.array(shape_of(name), np.int64), f"{name}_shape")
                back.append(helper.make_node("Reshape", [moved.output[slot], target], [name]))
        nodes += [moved, *back]
        details.append(f"{edit.node_label(node)}: rank {len(shape)} at merged axes")
    edit.set_nodes(result.graph, nodes)
    edit.remove_dead_nodes(result.graph)  # the rank-6 constants given anew
    return edit.checked_change(result, "high_rank_ops_at_rank_5", details)
