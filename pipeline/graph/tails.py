"""Post-processing tails that stay on the CPU: ai.onnx.ml ops and non-tensor outputs.

Classifiers exported by converters (WinMLTools, OnnxMLTools, skl2onnx) end in ArgMax ->
ArrayFeatureExtractor (a label lookup) and ZipMap (a class -> score map). Their outputs are
string or integer label tensors and sequences of maps; the QNN HTP backend holds neither, and
ONNX shape inference gives them no static shape. The tensor part of such a model goes to the
NPU; this tail stays on the CPU as a *declared* part of the model: the preparation keeps its
types, the quantizer leaves it alone, and the coverage report lists it apart from the gate.

Only this class is a tail (an unseen model must not hide real CPU fallbacks behind it):

- nodes of the ai.onnx.ml domain, and nodes that write a non-tensor or string value;
- nodes whose outputs are all non-float (an ArgMax index, a Cast to int) and are read only by
  tail nodes or are graph outputs of the tail: the index a label lookup reads.

The rule is written over plain node tuples so that the compile stage can apply it to a compiled
model (``qnn_ctx_runtime.qnn.ModelSummary``) without onnx.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TAIL_DOMAINS = frozenset({"ai.onnx.ml"})
# Ops whose outputs are indices or labels (never float), whatever their input.
INDEX_OPS = frozenset({"ArgMax", "ArgMin"})
# onnx TensorProto elem types that are float.
FLOAT_TYPES = frozenset({1, 10, 11, 16})  # FLOAT, FLOAT16, DOUBLE, BFLOAT16
STRING_TYPE = 8


@dataclass(frozen=True)
class Tail:
    """The CPU tail of a model: its nodes (by index), the graph outputs it writes, and the
    tensors it reads from the rest of the model (those stay plain tensors on the NPU side)."""

    nodes: frozenset[int]
    outputs: tuple[str, ...]
    inputs: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.nodes)


def find_tail(
    nodes: Sequence[Any],
    inputs_of: Callable[[Any], Sequence[str]],
    outputs_of: Callable[[Any], Sequence[str]],
    graph_outputs: Iterable[str],
    is_plain: Callable[[str], bool | None],
    is_float: Callable[[Any, str], bool],
) -> Tail:
    """The tail of a graph given as ``nodes`` (with accessors for their tensor names).

    ``is_plain(tensor)`` says whether a value is a numeric tensor (False: a string tensor, a
    sequence or a map; None: unknown). ``is_float(node, tensor)`` says whether an output of
    ``node`` is a float tensor.
    """
    outputs = list(graph_outputs)
    readers: dict[str, list[int]] = {}
    for index, node in enumerate(nodes):
        for name in inputs_of(node):
            if name:
                readers.setdefault(name, []).append(index)
    tail = {
        i
        for i, node in enumerate(nodes)
        if node.domain in TAIL_DOMAINS or any(is_plain(o) is False for o in outputs_of(node) if o)
    }
    if not tail:
        return Tail(frozenset(), (), ())
    changed = True
    while changed:  # nodes with non-float outputs that only the tail reads join it
        changed = False
        for index, node in enumerate(nodes):
            if index in tail:
                continue
            outs = [o for o in outputs_of(node) if o]
            if not outs or any(is_float(node, o) for o in outs):
                continue
            read = [r for o in outs for r in readers.get(o, [])]
            if read and all(r in tail for r in read):
                tail.add(index)
                changed = True
    produced = {o for i in tail for o in outputs_of(nodes[i]) if o}
    inner = {o for i, node in enumerate(nodes) if i not in tail for o in outputs_of(node) if o}
    feeds = sorted(
        {n for i in tail for n in inputs_of(nodes[i]) if n and n not in produced and n in inner}
    )
    return Tail(frozenset(tail), tuple(o for o in outputs if o in produced), tuple(feeds))


def model_tail(model: Any) -> Tail:
    """The tail of an ``onnx.ModelProto``'s main graph (types from its stored value info and
    from schema inference where that gives them)."""
    import onnx

    graph = model.graph
    types: dict[str, Any] = {}
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph
        values: Iterable[Any] = (*inferred.value_info, *inferred.output, *inferred.input)
    except Exception:  # inference failing on an odd model must not hide the stored types
        values = ()
    for value in (*graph.value_info, *graph.input, *values, *graph.output):
        if value.type.WhichOneof("value"):
            types[value.name] = value.type
    for init in graph.initializer:
        types[init.name] = onnx.helper.make_tensor_type_proto(init.data_type, list(init.dims))

    def is_plain(name: str) -> bool | None:
        kind = types.get(name)
        if kind is None:
            return None
        if kind.WhichOneof("value") != "tensor_type":
            return False
        return kind.tensor_type.elem_type != STRING_TYPE

    def is_float(node: Any, name: str) -> bool:
        if node.op_type in INDEX_OPS:
            return False
        kind = types.get(name)
        if kind is None or kind.WhichOneof("value") != "tensor_type":
            return kind is None  # unknown: assume float (keeps it off the tail)
        return kind.tensor_type.elem_type in FLOAT_TYPES

    return find_tail(
        list(graph.node),
        lambda n: list(n.input),
        lambda n: list(n.output),
        [o.name for o in graph.output],
        is_plain,
        is_float,
    )


def summary_tail(nodes: Sequence[Any], graph_outputs: Mapping[str, str]) -> Tail:
    """The tail of a compiled model read by ``qnn_ctx_runtime.qnn.read_model_summary``.

    ``graph_outputs`` maps output name -> dtype as that reader gives it ("" for a non-tensor
    value, "string" for a string tensor). Intermediate types are unknown there, so non-float
    outputs are recognised by op: ArgMax/ArgMin, and Cast to a non-float type.
    """

    def is_plain(name: str) -> bool | None:
        if name not in graph_outputs:
            return None
        return graph_outputs[name] not in ("", "string", "object", f"type{STRING_TYPE}")

    def is_float(node: Any, name: str) -> bool:
        if node.op_type in INDEX_OPS:
            return False
        if node.op_type == "Cast":
            return int(node.attributes.get("to", 1)) in FLOAT_TYPES
        return True

    return find_tail(
        list(nodes),
        lambda n: list(n.inputs),
        lambda n: list(n.outputs),
        list(graph_outputs),
        is_plain,
        is_float,
    )


def node_names(model: Any, tail: Tail) -> list[str]:
    """Names of the tail's nodes in an ``onnx.ModelProto`` (nodes without one are skipped)."""
    return [model.graph.node[i].name for i in sorted(tail.nodes) if model.graph.node[i].name]


def static_tail_outputs(model: Any) -> tuple[Any, Any]:
    """Give the tensor outputs of a CPU tail the static shape one run on zeros shows.

    ONNX shape inference leaves a label lookup's output (ArrayFeatureExtractor) without a
    static shape; the QNN EP refuses a model with a dynamic graph output ("Dynamic shape is not
    supported yet, for output: classLabel") even when the CPU computes it. Its shape follows
    from the static input shapes alone (the index tensor's shape), so one run tells it.
    """
    import numpy as np
    import onnx
    import onnxruntime as ort

    from . import edit  # onnx: not in the compile environment, which reads summaries only

    model = edit.copy_model(model)
    tail = model_tail(model)
    graph = model.graph
    wanted = [
        o
        for o in graph.output
        if o.name in tail.outputs
        and o.type.HasField("tensor_type")
        and edit.value_shape(o) is None
        and o.type.tensor_type.HasField("shape")
    ]
    if not wanted:
        return edit.checked_change(model, "static_tail_outputs", [])
    inits = {i.name for i in graph.initializer}
    feeds = {}
    for value in graph.input:
        if value.name in inits:
            continue
        shape = edit.value_shape(value)
        if shape is None:  # the static-shape check names it; nothing to learn here
            return edit.checked_change(model, "static_tail_outputs", [])
        dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        feeds[value.name] = np.zeros(shape, dtype)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in wanted]
    details = []
    for value, result in zip(wanted, session.run(names, feeds), strict=True):
        shape = list(np.asarray(result).shape)
        dims = value.type.tensor_type.shape
        if len(dims.dim) != len(shape):
            continue
        for dim, size in zip(dims.dim, shape, strict=True):
            dim.Clear()
            dim.dim_value = int(size)
        details.append(f"tail output {value.name!r} shape -> {shape}")
    return edit.checked_change(model, "static_tail_outputs", details)
