"""Small, generic helpers for editing ONNX graphs, shared by every graph transform.

They copy, name, sort, prune and look things up; none of them decides anything about the HTP.
Transforms stay pure by starting from ``copy_model`` (or ``writable``) and ending with
``checked_change``.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from ..core.errors import ModelError

DEFAULT_DOMAINS = ("", "ai.onnx")


@dataclass(frozen=True)
class Change:
    """What one transform did: one human-readable line per edit; no lines means a no-op."""

    step: str
    details: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.details)

    def summary(self, limit: int = 3) -> str:
        """One line for logs: the step, the number of edits and the first few of them."""
        if not self.details:
            return f"{self.step}: no change"
        shown = "; ".join(self.details[:limit])
        more = f"; … {len(self.details) - limit} more" if len(self.details) > limit else ""
        return f"{self.step}: {len(self.details)} edit(s): {shown}{more}"


def copy_model(model: onnx.ModelProto) -> onnx.ModelProto:
    result = onnx.ModelProto()
    result.CopyFrom(model)
    return result


# (model, code of the step function it was handed to, or None once the step passed it on),
# set by ``handed_over`` for one step.
_HANDED_OVER: contextvars.ContextVar[tuple[onnx.ModelProto, Any] | None] = contextvars.ContextVar(
    "handed_over", default=None
)


def writable(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` to edit: a copy (``copy_model``), or ``model`` itself when the step runner
    handed it over to the calling function and has no further use for it (``handed_over``).

    A transform calls it as its first use of its argument (``model = edit.writable(model)``),
    so it never sees the model before its own edits. Preparation's ~110 steps each copied the
    model, ~100 of them to change nothing: 0.23 s a step at 530 MB (VGG-11), and the model
    twice in memory during each."""
    if _handed_to(model, sys._getframe(1).f_code, passed_on=True):
        _HANDED_OVER.set(None)  # once: a recursive call on a subgraph's model copies
        return model
    return copy_model(model)


def _handed_to(model: onnx.ModelProto, code: Any, passed_on: bool = False) -> bool:
    """Whether ``model`` is handed over to the function running ``code`` (or, with
    ``passed_on``, was passed on by its step to whichever function asks next)."""
    handed = _HANDED_OVER.get()
    if handed is None or handed[0] is not model:
        return False
    return handed[1] is code or (passed_on and handed[1] is None)


def passed_on(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model``, which a step passes on to the helper that edits it (``return
    replace_nodes(edit.passed_on(model), ...)``): if it was handed over to the calling step
    (``handed_over``), the next ``writable(model)``, in whatever frame, takes it uncopied. The
    step must not read ``model`` after that call."""
    if _handed_to(model, sys._getframe(1).f_code):
        _HANDED_OVER.set((model, None))
    return model


@contextlib.contextmanager
def handed_over(model: onnx.ModelProto | None, step: Callable[..., Any]) -> Iterator[None]:
    """Within: ``step``'s own ``writable(model)`` returns ``model`` itself, uncopied. Only
    ``step``'s frame may take it (checked by its code object): a helper it calls on its input
    before copying must not edit the input under it. ``model=None`` hands nothing over."""
    code = getattr(step, "__code__", None)
    token = _HANDED_OVER.set(None if model is None or code is None else (model, code))
    try:
        yield
    finally:
        _HANDED_OVER.reset(token)


_CHECKS_DEFERRED = contextvars.ContextVar("checks_deferred", default=False)


@contextlib.contextmanager
def checks_deferred() -> Iterator[None]:
    """Within: ``checked_change`` does not check; the caller checks the end result once and,
    if it fails, runs the transforms again without this to name the one at fault. The checker
    serializes the whole model each time: 40 checks were 0.6 s of SqueezeNet's preparation."""
    token = _CHECKS_DEFERRED.set(True)
    try:
        yield
    finally:
        _CHECKS_DEFERRED.reset(token)


def check(model: onnx.ModelProto, step: str) -> None:
    """``onnx.checker`` on ``model``; a failure is a bug in ``step``, not in the user's model."""
    try:
        onnx.checker.check_model(model)
    except (onnx.checker.ValidationError, ValueError) as exc:
        raise ModelError(
            f"Graph preparation step {step!r} produced an invalid ONNX model: {exc}",
            tip="This is a bug in pipeline/transforms.py; please report it with the model.",
        ) from exc


def checked_change(
    model: onnx.ModelProto, step: str, details: Iterable[str]
) -> tuple[onnx.ModelProto, Change]:
    """Check the output of a transform (unless deferred, see ``checks_deferred``)."""
    if not _CHECKS_DEFERRED.get():
        check(model, step)
    return model, Change(step, tuple(details))


def node_label(node: onnx.NodeProto) -> str:
    name = node.name or (node.output[0] if node.output else "?")
    return f"{node.op_type} {name!r}"


def subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def all_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    yield graph
    for node in graph.node:
        for sub in subgraphs(node):
            yield from all_graphs(sub)


def defined_names(graph: onnx.GraphProto) -> set[str]:
    """Names a graph defines at its own level (not inside its subgraphs)."""
    names = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    names |= {s.values.name for s in graph.sparse_initializer}
    names |= {o for n in graph.node for o in n.output if o}
    return names


def outer_refs(graph: onnx.GraphProto) -> set[str]:
    """Names a (sub)graph uses without defining them: its implicit inputs from outer scopes."""
    defined = defined_names(graph)
    used: set[str] = {o.name for o in graph.output}
    for node in graph.node:
        used.update(i for i in node.input if i)
        for sub in subgraphs(node):
            used |= outer_refs(sub)
    return used - defined


def node_inputs(node: onnx.NodeProto) -> set[str]:
    """Explicit inputs plus the outer-scope names its subgraphs read."""
    names = {i for i in node.input if i}
    for sub in subgraphs(node):
        names |= outer_refs(sub)
    return names


def used_names(graph: onnx.GraphProto) -> Counter[str]:
    """How many times each name is read in ``graph`` (graph outputs count as a use)."""
    used: Counter[str] = Counter(o.name for o in graph.output)
    for node in graph.node:
        used.update(node_inputs(node))
    return used


def all_names(model: onnx.ModelProto) -> set[str]:
    names: set[str] = set()
    for graph in all_graphs(model.graph):
        names |= defined_names(graph)
        names |= {o.name for o in graph.output}
        names |= {v.name for v in graph.value_info}
        for node in graph.node:
            names.update(i for i in node.input if i)
    return names


class FreshNames:
    """Fresh tensor names that collide with nothing already in the model."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.taken = all_names(model)

    def __call__(self, base: str) -> str:
        name, i = base, 0
        while name in self.taken:
            i += 1
            name = f"{base}_{i}"
        self.taken.add(name)
        return name


def readers_by_tensor(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    """Tensor name -> the nodes of ``graph`` that read it (once per input slot), in order."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    return readers


def opset_version(model: onnx.ModelProto, domain: str = "") -> int:
    for op in model.opset_import:
        if op.domain in ((domain, "ai.onnx") if domain == "" else (domain,)):
            return op.version
    return 0


def initializers_by_name(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """Initializers that are true constants (an initializer listed as an input can be fed)."""
    inputs = {i.name for i in graph.input}
    return {t.name: t for t in graph.initializer if t.name not in inputs}


def int_constant(inits: Mapping[str, onnx.TensorProto], name: str) -> int | None:
    """The value of a scalar (or one-element) integer initializer, None if not one."""
    if not name or name not in inits:
        return None
    value = onnx.numpy_helper.to_array(inits[name])
    if value.size != 1 or value.dtype.kind not in "iu":
        return None
    return int(value.reshape(-1)[0])


def shape_in(values: Mapping[str, onnx.ValueInfoProto], name: str) -> tuple[int, ...] | None:
    """The static shape of tensor ``name`` among ``values`` (``inferred_values``), else None."""
    value = values.get(name)
    return value_shape(value) if value is not None else None


def value_shape(value: onnx.ValueInfoProto) -> tuple[int, ...] | None:
    """The static shape of a tensor value, or None if the rank or any dim is unknown."""
    if not value.type.HasField("tensor_type"):
        return None
    tensor_type = value.type.tensor_type
    if not tensor_type.HasField("shape"):
        return None
    dims = []
    for dim in tensor_type.shape.dim:
        if not dim.HasField("dim_value") or dim.dim_value < 0:
            return None
        dims.append(dim.dim_value)
    return tuple(dims)


def strip_shape_info(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy without stored value_info and output shapes, so inference must derive every shape."""
    bare = copy_model(model)
    for graph in all_graphs(bare.graph):
        del graph.value_info[:]
        inputs = {i.name for i in graph.input}
        for out in graph.output:
            # An input passed through as an output keeps the input's shape: cleared, onnx's
            # inference gave up on the whole graph and every tensor read as dynamic.
            if out.type.HasField("tensor_type") and out.name not in inputs:
                out.type.tensor_type.ClearField("shape")
    return bare


def free_input_dims(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """A copy whose inputs ``names`` take any shape of their rank: each fixed dim a fresh
    dim_param (named ones keep their names), and no stored shape derived from the old ones
    (value_info, output dims; rank kept).

    Why: a model exported at a dummy size (CenterFace at 10x3x32x32) is run by its app at
    another one, the declared dims loosened first (onnx's ``update_inputs_outputs_dims``);
    onnxruntime refuses any other shape for a fixed dim. The source model run as a reference
    at the size ``[inputs] shapes`` gives is this copy."""
    free = copy_model(model)
    wanted = set(names)
    for value in free.graph.input:
        if value.name in wanted and value.type.tensor_type.HasField("shape"):
            for axis, dim in enumerate(value.type.tensor_type.shape.dim):
                if not dim.dim_param:
                    dim.Clear()
                    dim.dim_param = f"{value.name}_dim{axis}"
    for graph in all_graphs(free.graph):
        del graph.value_info[:]
    for out in free.graph.output:
        for dim in out.type.tensor_type.shape.dim:
            dim.Clear()
    return free


WEIGHT_ELEMENTS = 1024  # a float initializer larger than this is a weight: no op reads its data


def _copy_fields(source: Any, target: Any, skip: tuple[str, ...] = ()) -> None:
    """Copy every set field of protobuf message ``source`` into ``target`` but ``skip``."""
    for field, value in source.ListFields():
        if field.name in skip:
            continue
        current = getattr(target, field.name)
        if hasattr(current, "extend"):
            current.extend(value)
        elif hasattr(current, "CopyFrom"):
            current.CopyFrom(value)
        else:
            setattr(target, field.name, value)


def _is_weight(init: onnx.TensorProto) -> bool:
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE)
    return init.data_type in floats and int(np.prod(init.dims)) > WEIGHT_ELEMENTS


def without_weight_data(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose large float initializers keep their name, type and dims but no data.

    onnx's shape inference and version converter read initializer data only for shape-like
    inputs (Reshape's shape, Slice's starts, Resize's scales: small or integer tensors); the
    weights' bytes only cost, since each call serializes the model, parses it in C++, and back.
    On a 176 MB U-Net one inference took +680 MB and 0.7 s, without the weights +14 MB and
    0.01 s; the conversion to opset 21 +1152 MB (the quantize stage's peak), without them +32 MB.
    The same shapes, and byte-identical conversions, on the 19 dev models."""
    bare = onnx.ModelProto()
    _copy_fields(model, bare, skip=("graph",))
    _copy_fields(model.graph, bare.graph, skip=("initializer",))
    for init in model.graph.initializer:
        if _is_weight(init):
            bare.graph.initializer.add(name=init.name, data_type=init.data_type, dims=init.dims)
        else:
            bare.graph.initializer.add().CopyFrom(init)
    return bare


def restore_weight_data(converted: onnx.ModelProto, source: onnx.ModelProto) -> bool:
    """Put ``source``'s weights back into ``converted`` (made from ``without_weight_data``),
    in place; False if the conversion changed one (its type or dims), which needs its data."""
    weights = {init.name: init for init in source.graph.initializer if _is_weight(init)}
    for init in converted.graph.initializer:
        original = weights.get(init.name)
        if original is None:
            continue
        if (init.data_type, list(init.dims)) != (original.data_type, list(original.dims)):
            return False
        if init.raw_data or init.float_data or init.double_data or init.int32_data:
            return False
        init.CopyFrom(original)
    return True


# onnxruntime contrib ops that keep their first input's type and shape. ONNX has no schema for
# them, so inference stops there; qnn_preprocess_model writes com.microsoft Gelu for every GELU
# it fuses, and a model that keeps an opset below 20 (a pre-quantized one) cannot have the
# ai.onnx Gelu instead (a Whisper encoder quantized by onnxruntime: every tensor after its first
# GELU had no shape, and the build stopped).
CONTRIB_ELEMENTWISE = frozenset({"Gelu", "FastGelu", "QuickGelu", "BiasGelu"})


def inferred_graph(model: onnx.ModelProto) -> onnx.GraphProto:
    """onnx's shape inference (lenient, stored value info kept) on a copy of ``model`` without
    its weights' data: the types and shapes only (a 530 MB VGG: 2.2 s with the weights, 0.01 s
    without). Raises what onnx raises."""
    bare = without_weight_data(model)
    return onnx.shape_inference.infer_shapes(bare, strict_mode=False).graph


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Schema-only shape inference without stored shapes (the strict criterion), on a copy
    of ``model`` without its weights' data (``without_weight_data``): for the shapes only.
    A ``CONTRIB_ELEMENTWISE`` op's output gets its first input's type, and inference goes on."""
    bare = strip_shape_info(without_weight_data(model))
    seeds: dict[str, onnx.ValueInfoProto] = {}
    try:
        inferred = onnx.shape_inference.infer_shapes(bare, strict_mode=False, data_prop=False)
        for _ in range(len(bare.graph.node)):  # a seed can type the input of the next one
            if not _seed_contrib_elementwise(inferred.graph, seeds):
                break
            seeded = copy_model(bare)
            seeded.graph.value_info.extend(seeds.values())
            inferred = onnx.shape_inference.infer_shapes(seeded, strict_mode=False, data_prop=False)
        return inferred
    except onnx.shape_inference.InferenceError as exc:
        raise ModelError(f"ONNX shape inference failed on the model: {exc}") from exc


def _seed_contrib_elementwise(
    graph: onnx.GraphProto, seeds: dict[str, onnx.ValueInfoProto]
) -> bool:
    """Give each contrib elementwise op's output its input's inferred type in ``seeds``;
    True if any seed is new or changed."""
    known = {v.name: v for v in (*graph.input, *graph.value_info, *graph.output)}
    changed = False
    for node in graph.node:
        if node.domain != "com.microsoft" or node.op_type not in CONTRIB_ELEMENTWISE:
            continue
        out, source = node.output[0], known.get(node.input[0])
        if source is None or not source.type.tensor_type.HasField("shape"):
            continue
        if out in seeds and seeds[out].type == source.type:
            continue
        seed = onnx.ValueInfoProto()
        seed.CopyFrom(source)
        seed.name = out
        seeds[out] = seed
        changed = True
    return changed


def with_inferred_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose value_info and graph outputs (every graph) are what
    ``infer_shapes`` derives."""
    inferred = infer_shapes(model)
    result = copy_model(model)
    for graph, shapes in zip(all_graphs(result.graph), all_graphs(inferred.graph), strict=True):
        del graph.value_info[:]
        graph.value_info.extend(shapes.value_info)
        del graph.output[:]
        graph.output.extend(shapes.output)
    return result


def inferred_values(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    inferred = infer_shapes(model)
    graph = inferred.graph
    values = {v.name: v for v in (*graph.input, *graph.value_info, *graph.output)}
    for init in graph.initializer:
        values[init.name] = onnx.helper.make_tensor_value_info(
            init.name, init.data_type, list(init.dims)
        )
    return values


def dynamic_outputs(model: onnx.ModelProto) -> list[tuple[str, onnx.NodeProto | None]]:
    """Tensors whose shape schema inference alone cannot pin down, with the node producing them.

    Graph inputs (node None) and every node output in every (sub)graph are checked, after
    dropping stored value_info: shapes that only data propagation could justify do not count,
    because the QNN EP sees the model without them.
    """
    inferred = infer_shapes(model)
    result: list[tuple[str, onnx.NodeProto | None]] = []
    for graph in all_graphs(inferred.graph):
        values = {v.name: v for v in (*graph.input, *graph.value_info, *graph.output)}
        inits = {t.name for t in graph.initializer}
        if graph is inferred.graph:
            for inp in graph.input:
                if inp.name not in inits and value_shape(inp) is None:
                    result.append((inp.name, None))
        for node in graph.node:
            for out in node.output:
                if out and (out not in values or value_shape(values[out]) is None):
                    result.append((out, node))
    return result


def bypass_nodes(graph: onnx.GraphProto, drop: set[int], mapping: Mapping[str, str]) -> None:
    """Drop the nodes at ``drop``, whose outputs (``mapping``'s keys) are the same tensors as
    other ones (its values): their readers, in subgraphs too, read those instead. Chains
    (an output mapped to another dropped output) resolve to their first tensor."""
    resolved = {}
    for name, source in mapping.items():
        while source in mapping:
            source = mapping[source]
        resolved[name] = source
    drop_nodes(graph, drop)
    delete_where(graph.value_info, lambda v: v.name in resolved)
    rename_tensors(graph, resolved)


def remove_dead_nodes(graph: onnx.GraphProto) -> int:
    """Drop nodes nothing reads and initializers nothing uses; returns how many nodes went."""
    removed = 0
    while True:
        used = used_names(graph)
        dead = {i for i, n in enumerate(graph.node) if not any(o in used for o in n.output if o)}
        if not dead:
            break
        removed += len(dead)
        drop_nodes(graph, dead)
    used = used_names(graph) | Counter(i.name for i in graph.input)
    delete_where(graph.initializer, lambda t: t.name not in used)
    defined = defined_names(graph)
    delete_where(graph.value_info, lambda v: v.name not in defined)
    return removed


def delete_where(items: Any, condition: Any) -> None:
    """Delete from a repeated protobuf field in place (no copies of big tensors)."""
    for index in reversed([i for i, item in enumerate(items) if condition(item)]):
        del items[index]


def rename_tensors(graph: onnx.GraphProto, mapping: Mapping[str, str]) -> None:
    """Rename tensors everywhere in ``graph`` and in the subgraphs that read them."""
    if not mapping:
        return
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in mapping:
                node.input[i] = mapping[name]
        for i, name in enumerate(node.output):
            if name in mapping:
                node.output[i] = mapping[name]
        for sub in subgraphs(node):
            rename_tensors(sub, mapping)
    for seq in (graph.input, graph.output, graph.value_info):
        for value in seq:
            if value.name in mapping:
                value.name = mapping[value.name]
    for init in graph.initializer:
        if init.name in mapping:
            init.name = mapping[init.name]


def pad_first_input(
    graph: onnx.GraphProto,
    nodes: list[onnx.NodeProto],
    node: onnx.NodeProto,
    pads: Sequence[int],
    namer: FreshNames,
    mode: str = "constant",
) -> None:
    """Feed ``node`` its first input through a Pad of its spatial axes by ``pads`` (ONNX order:
    begins, then ends), inserted just before ``node``, the last of ``nodes`` (a node list being
    rebuilt). Zeros by default. Dropping the node's own pads is the caller's part."""
    spatial = len(pads) // 2
    base = node.name or node.output[0]
    pads_name, padded = namer(f"{base}_pads"), namer(f"{base}_padded")
    full = [0, 0, *pads[:spatial], 0, 0, *pads[spatial:]]
    graph.initializer.append(onnx.numpy_helper.from_array(np.array(full, np.int64), pads_name))
    attrs = {"mode": mode} if mode != "constant" else {}
    pad = onnx.helper.make_node(
        "Pad", [node.input[0], pads_name], [padded], name=namer(f"{base}_pad"), **attrs
    )
    nodes.insert(len(nodes) - 1, pad)
    node.input[0] = padded


def replace_attributes(node: onnx.NodeProto, dropped: tuple[str, ...], **new: Any) -> None:
    """Drop ``dropped`` and set ``new`` on ``node`` (an attribute is replaced, not doubled)."""
    kept = [a for a in node.attribute if a.name not in dropped and a.name not in new]
    del node.attribute[:]
    node.attribute.extend(kept)
    node.attribute.extend(onnx.helper.make_attribute(k, v) for k, v in new.items())


def set_nodes(graph: onnx.GraphProto, nodes: Sequence[onnx.NodeProto]) -> None:
    """Replace the node list; copies first, since ``nodes`` may be views into it."""
    copies = []
    for node in nodes:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copies.append(copy)
    del graph.node[:]
    graph.node.extend(copies)


class NodeRewrite:
    """What a one-node rewrite of ``replace_nodes`` reads and adds: the model's constants, its
    inferred shapes (inferred once, on first use: most models hold no node to rewrite), fresh
    names and new initializers."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.inits = initializers_by_name(model.graph)
        self.fresh = FreshNames(model)
        self.producers = {out: node for node in model.graph.node for out in node.output if out}
        self._values: dict[str, onnx.ValueInfoProto] | None = None

    def _value(self, name: str) -> onnx.ValueInfoProto | None:
        if self._values is None:
            self._values = inferred_values(self.model)
        return self._values.get(name)

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The static shape of tensor ``name``, None where inference leaves it unknown."""
        value = self._value(name)
        return value_shape(value) if value is not None else None

    def elem_type(self, name: str) -> int | None:
        """The element type (``onnx.TensorProto`` enum) of tensor ``name``, None if unknown."""
        value = self._value(name)
        if value is None or not value.type.HasField("tensor_type"):
            return None
        return value.type.tensor_type.elem_type or None

    def constant(self, array: np.ndarray, base: str) -> str:
        """Add ``array`` as an initializer under a fresh name built from ``base``."""
        name = self.fresh(base)
        self.model.graph.initializer.append(onnx.numpy_helper.from_array(array, name))
        return name


def replace_nodes(
    model: onnx.ModelProto,
    step: str,
    rewrite: Callable[[onnx.NodeProto, NodeRewrite], tuple[list[onnx.NodeProto], str] | None],
) -> tuple[onnx.ModelProto, Change]:
    """Each node of the main graph that ``rewrite`` takes -> the nodes it returns in its place.

    ``rewrite(node, context)`` returns None to keep the node, or the replacement nodes (which
    write the node's outputs) and one line for the step's details; what the replaced nodes read
    and nothing else does any more goes.
    """
    model = writable(model)
    context = NodeRewrite(model)
    constants = len(model.graph.initializer)
    nodes: list[onnx.NodeProto] = []
    details: list[str] = []
    for node in model.graph.node:
        result = rewrite(node, context)
        if result is None:
            nodes.append(node)
            continue
        replacement, detail = result
        nodes.extend(replacement)
        details.append(detail)
    if details:
        set_nodes(model.graph, nodes)
        remove_dead_nodes(model.graph)  # and the constants of a rewrite that kept its node
    else:
        del model.graph.initializer[constants:]
    return checked_change(model, step, details)


NodeRule = Callable[[onnx.NodeProto, NodeRewrite], "tuple[list[onnx.NodeProto], str] | None"]


def replace_by_op(
    model: onnx.ModelProto, step: str, rules: Mapping[str, NodeRule], domains: Sequence[str]
) -> tuple[onnx.ModelProto, Change]:
    """``replace_nodes`` with one rule per op type, for nodes of ``domains`` only."""

    def rewrite(
        node: onnx.NodeProto, context: NodeRewrite
    ) -> tuple[list[onnx.NodeProto], str] | None:
        rule = rules.get(node.op_type)
        return None if rule is None or node.domain not in domains else rule(node, context)

    return replace_nodes(model, step, rewrite)


def attribute(node: onnx.NodeProto, name: str, default: Any) -> Any:
    """The value of ``node``'s attribute ``name``, ``default`` when it has none."""
    for attr in node.attribute:
        if attr.name == name:
            return onnx.helper.get_attribute_value(attr)
    return default


def drop_nodes(graph: onnx.GraphProto, indices: set[int]) -> None:
    # Indices, not id(): protobuf hands out fresh Python wrappers for the same node.
    set_nodes(graph, [n for i, n in enumerate(graph.node) if i not in indices])


def sorted_order(graph: onnx.GraphProto) -> list[int]:
    """Kahn's algorithm, keeping the original order wherever the data flow allows it."""
    import heapq

    available = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    available |= {s.values.name for s in graph.sparse_initializer}
    available |= outer_refs(graph)  # subgraphs may read names of the enclosing scope
    producer: dict[str, int] = {}
    for index, node in enumerate(graph.node):
        for out in node.output:
            if out and out in producer:  # not SSA: the sort below would never end
                raise ModelError(
                    f"Tensor {out!r} is written by two nodes, "
                    f"{node_label(graph.node[producer[out]])} and {node_label(node)}: the graph "
                    "is not in single static assignment form (onnxruntime refuses it too).",
                    tip="Re-export or re-convert the model (a converter that renamed its "
                    "Casts on a block list wrote the same name twice).",
                )
            if out:
                producer[out] = index
    waiting: list[set[str]] = []
    readers: dict[str, list[int]] = {}
    for index, node in enumerate(graph.node):
        missing = {i for i in node_inputs(node) if i not in available}
        undefined = [i for i in missing if i not in producer]
        if undefined:
            raise ModelError(
                f"Node {node_label(node)} reads {undefined[0]!r}, which no node, input or "
                "initializer defines.",
                tip="The model is malformed; re-export it.",
            )
        waiting.append(missing)
        for name in missing:
            readers.setdefault(name, []).append(index)
    ready = [i for i, missing in enumerate(waiting) if not missing]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        index = heapq.heappop(ready)
        order.append(index)
        for out in graph.node[index].output:
            for reader in readers.get(out, ()):
                if out in waiting[reader]:  # once per reader and name, so each node once
                    waiting[reader].discard(out)
                    if not waiting[reader]:
                        heapq.heappush(ready, reader)
    if len(order) != len(graph.node):
        stuck = next(graph.node[i] for i, missing in enumerate(waiting) if missing)
        raise ModelError(
            f"The graph has a cycle through node {node_label(stuck)}.",
            tip="ONNX graphs must be acyclic; re-export the model.",
        )
    return order


def sort_graph(graph: onnx.GraphProto) -> int:
    """Sort ``graph``'s nodes in place; returns how many changed position."""
    order = sorted_order(graph)
    moved = sum(1 for position, index in enumerate(order) if position != index)
    if moved:
        set_nodes(graph, [graph.node[i] for i in order])
    return moved


def numpy_dtype(elem_type: int) -> np.dtype:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))


def min_ir_version(model: onnx.ModelProto) -> int:
    return onnx.helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)


def ancestors(
    names: Iterable[str],
    producers: Mapping[str, Any],
    reads: Callable[[Any], Iterable[str]] = lambda node: node.input,
) -> set[str]:
    """Every tensor ``names`` are computed from, themselves included: walking back through
    each producing node's ``reads`` (its inputs; a caller adds its subgraphs' outer reads)."""
    seen: set[str] = set()
    pending = list(names)
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        node = producers.get(name)
        if node is not None:
            pending.extend(i for i in reads(node) if i and i not in seen)
    return seen
