"""Graph transforms that turn a float ONNX model into a static, float32, NPU-friendly one.

Each transform maps a model to a new model: it copies its input, does no file I/O of its own
(``qnn_preprocess`` has to hand ONNX Runtime a temporary file), runs ``onnx.checker`` on its
output and returns a ``Change`` that lists every edit, one line each. An empty ``Change`` means
the transform had nothing to do.

Why these exist: the QNN HTP backend only takes static shapes, float32 calibration, folded
batch norms and ops it has kernels for; a model that misses one of those falls back to the CPU
in pieces or fails to compile. ``pipeline.prepare`` chains the transforms in a working order.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from ..core.dtypes import constant_feed
from ..core.errors import ModelError
from .edit import (
    DEFAULT_DOMAINS,
    Change,
    FreshNames,
    NodeRewrite,
    all_graphs,
    ancestors,
    attribute,
    bypass_nodes,
    checked_change,
    copy_model,
    defined_names,
    delete_where,
    drop_nodes,
    inferred_values,
    initializers_by_name,
    int_constant,
    min_ir_version,
    node_label,
    numpy_dtype,
    opset_version,
    pad_first_input,
    passed_on,
    readers_by_tensor,
    remove_dead_nodes,
    rename_tensors,
    replace_attributes,
    replace_by_op,
    replace_nodes,
    restore_weight_data,
    set_nodes,
    sort_graph,
    subgraphs,
    used_names,
    value_shape,
    with_inferred_shapes,
    without_weight_data,
    writable,
)

# onnxruntime 1.24+ loads IR <= 11 at least and the quantizer needs opset 21 (IR 10) for 16-bit
# Q/DQ; onnx 1.23 would write IR 14, which onnxruntime 1.31 refuses.
DEFAULT_IR_VERSION = 10
# Highest IR version the onnxruntime we pin (1.31) loads.
ORT_MAX_IR_VERSION = 13
# The opset the quantizer converts to for 16-bit activations; converting ourselves first avoids
# its silent version-converter failures on legacy ops and fp16 graphs.
TARGET_OPSET = 21
# Constant folding keeps a node whose result would be bigger than this and than its inputs, so
# that e.g. an Expand of a scalar does not turn into a multi-megabyte weight.
FOLD_MAX_BYTES = 1 << 20
# A folded result this big that equals a constant already held reads that constant instead.
SHARED_MIN_BYTES = 1 << 12

_FLOAT = onnx.TensorProto.FLOAT
_DOUBLE = onnx.TensorProto.DOUBLE
_FLOAT16 = onnx.TensorProto.FLOAT16
_NONDETERMINISTIC = {
    "RandomNormal",
    "RandomNormalLike",
    "RandomUniform",
    "RandomUniformLike",
    "Multinomial",
    "Bernoulli",
}
# Experimental ops of opset 1-9 that the onnx version converter cannot upgrade.
_LEGACY_OPS = {"ImageScaler", "Scale", "Affine", "ScaledTanh", "ParametricSoftplus"}
# Quantization nodes of a pre-quantized model carry its quantization; folding them would lose it.
_NEVER_FOLD = _NONDETERMINISTIC | {
    "QuantizeLinear",
    "DequantizeLinear",
    "DynamicQuantizeLinear",
    "If",
    "Loop",
    "Scan",
}


# --------------------------------------------------------------------------------------------
# 0. IR version and initializers listed as inputs


def set_ir_version(
    model: onnx.ModelProto, version: int = DEFAULT_IR_VERSION
) -> tuple[onnx.ModelProto, Change]:
    """Set an IR version onnxruntime loads: onnx 1.23 writes 14, onnxruntime 1.31 reads <= 13.

    Raised to what the model's opsets need if that is higher than ``version``.
    """
    model = writable(model)
    target = max(version, min_ir_version(model))
    if target > ORT_MAX_IR_VERSION:
        raise ModelError(
            f"The model's opsets need IR version {target}, above {ORT_MAX_IR_VERSION}, the highest "
            "the pinned onnxruntime loads.",
            tip="Export the model with an older opset.",
        )
    details = []
    if model.ir_version != target:
        details.append(f"IR version {model.ir_version} -> {target}")
        model.ir_version = target
    return checked_change(model, "set_ir_version", details)


_TYPED_FIELDS = ("float_data", "int32_data", "int64_data", "double_data", "uint64_data")


def _stored_per_value(init: onnx.TensorProto) -> bool:
    """A tensor whose values sit in a typed repeated field, one protobuf element each."""
    return (
        init.data_type != onnx.TensorProto.STRING
        and init.data_location != onnx.TensorProto.EXTERNAL
        and not init.HasField("segment")
        and any(len(getattr(init, field)) for field in _TYPED_FIELDS)
    )


def raw_initializer_data(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Initializers stored value by value (float_data, int64_data... : WinML and Custom Vision
    exports) as raw bytes instead: the same values bit for bit, and every later copy of the
    model (each step makes one) moves a block of bytes instead of one field per value (a 2.9
    MB classifier: 4.4 ms a copy, its 63 unchanged steps 0.38 s of its preparation)."""
    if not any(_stored_per_value(init) for init in model.graph.initializer):
        return checked_change(model, "raw_initializer_data", [])
    model = copy_model(model)
    moved = []
    for init in model.graph.initializer:
        if not _stored_per_value(init):
            continue
        try:
            raw = numpy_helper.from_array(numpy_helper.to_array(init), init.name)
        except (TypeError, ValueError):  # a type onnx's numpy helpers do not convert
            continue
        if raw.data_type != init.data_type or list(raw.dims) != list(init.dims):
            continue  # a type numpy does not hold as itself: left as it is
        raw.doc_string = init.doc_string
        init.CopyFrom(raw)
        moved.append(init.name)
    details = [f"{len(moved)} initializer(s) stored as raw bytes: {', '.join(moved[:5])}"]
    return checked_change(model, "raw_initializer_data", details if moved else [])


def drop_initializer_inputs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Remove graph inputs that only shadow initializers (IR < 4 style).

    Left in, the quantizer and the QNN EP treat those weights as runtime inputs: they are not
    quantized as weights and cannot be folded. Needs IR >= 4 (run ``set_ir_version`` first).
    """
    model = writable(model)
    inits = {t.name for t in model.graph.initializer}
    keep = [i for i in model.graph.input if i.name not in inits]
    dropped = [i.name for i in model.graph.input if i.name in inits]
    if dropped:
        if model.ir_version < 4:
            model.ir_version = 4
        del model.graph.input[:]
        model.graph.input.extend(keep)
    details = (
        [f"input {len(dropped)} initializer(s) no longer listed as graph inputs"] if dropped else []
    )
    return checked_change(model, "drop_initializer_inputs", details)


def drop_unread_inputs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Remove graph inputs that no node reads (nor the graph returns).

    onnxruntime still requires a feed for them, so calibration asked which input the images
    feed, and the context would carry an input that does nothing. An exporter leaves such an
    input for an argument the module ignores; onnxruntime, saving an IR-3 model after folding
    a BatchNorm, left the folded scale listed as an input. The checks that run the source feed
    it zeros (``quantize.lossless``, ``quantize.evaluate``).
    """
    used = used_names(model.graph)
    unread = [i.name for i in model.graph.input if not used[i.name]]
    if not unread or len(unread) == len(model.graph.input):  # a model of constants: as it is
        return model, Change("drop_unread_inputs")
    model = copy_model(model)
    keep = [i for i in model.graph.input if i.name not in unread]
    del model.graph.input[:]
    model.graph.input.extend(keep)
    return checked_change(
        model, "drop_unread_inputs", [f"input {name!r} is read by no node" for name in unread]
    )


def refuse_training_mode(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A ModelError for a model exported from a module in training mode: a Dropout whose
    ``training_mode`` input is a constant true, or a BatchNormalization with
    ``training_mode = 1``. Such a model computes random or batch-dependent outputs (onnxruntime
    drops activations at random, a new mask in each session), and every comparison against it
    measures the dropout: a MiniLM exported that way scored 7 dB QDQ vs float, with nothing
    said. Nothing is changed otherwise."""
    inits = initializers_by_name(model.graph)
    found = []
    for node in model.graph.node:
        if node.domain not in DEFAULT_DOMAINS:
            continue
        mode = node.input[2] if node.op_type == "Dropout" and len(node.input) > 2 else ""
        dropping = mode in inits and bool(numpy_helper.to_array(inits[mode]).any())
        batch_stats = node.op_type == "BatchNormalization" and any(
            a.name == "training_mode" and a.i for a in node.attribute
        )
        if dropping or batch_stats:
            found.append(node)
    if found:
        shown = ", ".join(node_label(n) for n in found[:5])
        more = f" and {len(found) - 5} more" if len(found) > 5 else ""
        raise ModelError(
            f"The model was exported in training mode: {shown}{more} run(s) with "
            "training_mode = true, so its outputs are random or depend on the batch.",
            tip="Export it from the module in inference mode: torch.onnx.export(model.eval(), "
            "...) (the wrapper passed to the exporter too), or training=TrainingMode.EVAL.",
        )
    return model, Change("refuse_training_mode")


# --------------------------------------------------------------------------------------------
# 1. fixed inputs


def _hint(name: str, known: Iterable[str]) -> str:
    known = sorted(known)
    close = difflib.get_close_matches(name, known, n=1)
    return f"did you mean {close[0]!r}?" if close else f"known: {', '.join(known) or 'none'}."


def _toml_key(name: str) -> str:
    """``name`` as a TOML key: bare if it can be, quoted otherwise (``"p2o.Dim.0"``)."""
    import re

    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else json.dumps(name)


def _shape_hint(dims: Sequence[object]) -> str:
    return "[" + ", ".join(str(d) if isinstance(d, int) else "?" for d in dims) + "]"


def bake_constant_inputs(
    model: onnx.ModelProto,
    constants: Mapping[str, Any],
    shapes: Mapping[str, Sequence[int]] | None = None,
    dims: Mapping[str, int] | None = None,
) -> tuple[onnx.ModelProto, Change]:
    """Turn graph inputs with a known value (e.g. ``sr = 16000``) into initializers.

    Their consumers (and whole ``If`` branches on them) can then be folded away. A single
    number given for an input of more values fills its shape (``[inputs] shapes``, or
    ``[inputs] dims`` for its named dims, where the model leaves it dynamic): a padding mask of
    zeros, an attention mask of ones, a batch's lengths, which no one can write out in TOML.
    """
    shapes = shapes or {}
    dims = dims or {}
    model = copy_model(model)
    graph = model.graph
    inputs = {i.name: i for i in graph.input}
    details = []
    for name, value in constants.items():
        if name not in inputs:
            raise ModelError(
                f"[inputs] constants names {name!r}, which is not an input of the model; "
                + _hint(name, inputs),
                tip="Fix the input name in [inputs] constants of the model config.",
            )
        value_info = inputs[name]
        tensor_type = value_info.type.tensor_type
        try:
            array = np.asarray(value, dtype=numpy_dtype(tensor_type.elem_type))
        except (TypeError, ValueError, KeyError) as exc:
            raise ModelError(
                f"[inputs] constants.{name} = {value!r} does not convert to the input's type "
                f"{onnx.TensorProto.DataType.Name(tensor_type.elem_type)}: {exc}"
            ) from None
        if tensor_type.HasField("shape") or name in shapes:
            static = [
                d.dim_value
                if d.HasField("dim_value") and d.dim_value >= 0
                else dims.get(d.dim_param)
                if d.HasField("dim_param")
                else None
                for d in tensor_type.shape.dim
            ]
            if name in shapes:
                static = [int(size) for size in shapes[name]]
            array = constant_feed(array, array.dtype, static)
            if None not in static and array.size == math.prod(static):
                array = array.reshape(static)
            if array.ndim != len(static) or any(
                s is not None and s != a for s, a in zip(static, array.shape, strict=True)
            ):
                raise ModelError(
                    f"[inputs] constants.{name} has shape {list(array.shape)}, but input {name!r} "
                    f"has shape {[s if s is not None else '?' for s in static]}.",
                    tip="Give a value of the input's shape, or one number to fill it (with "
                    "[inputs] shapes where the input's shape is dynamic).",
                )
        graph.initializer.append(numpy_helper.from_array(array, name))
        graph.input.remove(value_info)
        filled = array.size > 1 and bool((array == array.flat[0]).all())
        shown = (
            array.tolist()
            if array.size <= 8
            else f"{array.flat[0].item()!r} filling {list(array.shape)}"
            if filled
            else f"array {list(array.shape)}"
        )
        details.append(f"input {name!r} baked in as constant {shown}")
    return checked_change(model, "bake_constant_inputs", details)


def _static_shape(
    value: onnx.ValueInfoProto,
    old: list[Any],
    dims: Mapping[str, int],
    shapes: Mapping[str, Sequence[int]],
    issues: list[str],
) -> list[int] | None:
    """The static shape the config gives one input, or None after saying why it cannot."""
    tensor_type = value.type.tensor_type
    if value.name in shapes:
        new = list(shapes[value.name])
        if tensor_type.HasField("shape") and len(old) != len(new):
            issues.append(
                f"[inputs] shapes.{value.name} = {new} has rank {len(new)}, but the model's "
                f"input has rank {len(old)} ({old})"
            )
            return None
        return new
    if not tensor_type.HasField("shape"):
        issues.append(
            f"input {value.name!r} has unknown rank; set [inputs] shapes = "
            f"{{{_toml_key(value.name)} = [...]}}"
        )
        return None
    new: list[int] = []
    missing = False
    for i, dim in enumerate(tensor_type.shape.dim):
        if dim.HasField("dim_value") and dim.dim_value > 0:
            new.append(dim.dim_value)
        elif dim.HasField("dim_param") and dim.dim_param in dims:
            new.append(dims[dim.dim_param])
        else:
            shape_key = f"[inputs] shapes = {{{_toml_key(value.name)} = {_shape_hint(old)}}}"
            if dim.dim_param:
                where = f"dim {i} ({dim.dim_param})"
                key = f"[inputs] dims = {{{_toml_key(dim.dim_param)} = N}} or {shape_key}"
            else:
                where, key = f"dim {i} (unnamed)", shape_key
            issues.append(f"input {value.name!r} {where} is dynamic; set {key}")
            missing = True
    return None if missing else new


def cut_at_outputs(model: onnx.ModelProto, outputs: Sequence[str]) -> onnx.ModelProto:
    """The part of ``model`` that computes ``outputs`` (``[model] outputs``), as its own model
    with those tensors as its outputs and only the inputs they need.

    Why: what follows them may be data-sized (NMS keeps as many boxes as the data decides),
    which no static-shape NPU graph holds; the user runs it on the CPU. Raises ModelError
    naming a tensor the model does not compute, with the closest name.
    """
    from onnx.utils import Extractor

    graph = model.graph
    produced = {o for n in graph.node for o in n.output if o}
    inputs = [i.name for i in graph.input]
    known = produced | set(inputs)
    missing = [name for name in outputs if name not in known]
    if missing:
        raise ModelError(
            "[model] outputs names tensors the model does not compute: "
            + "; ".join(f"{name!r} ({_hint(name, known)})" for name in missing),
            tip="Name tensors of the source model (Netron shows them), e.g. the inputs of its "
            "NonMaxSuppression.",
        )
    producer = {o: n for n in graph.node for o in n.output if o}
    # the tensors the outputs depend on, through subgraphs' outer references
    needed = ancestors(
        outputs,
        producer,
        lambda node: [
            *node.input,
            *(
                i
                for sub in subgraphs(node)
                for g in all_graphs(sub)
                for n in g.node
                for i in n.input
            ),
        ],
    )
    used_inputs = [name for name in inputs if name in needed]
    try:
        cut = Extractor(with_inferred_shapes(model)).extract_model(used_inputs, list(outputs))
    except ValueError as exc:  # shape inference could not type an output named
        raise ModelError(
            f"[model] outputs: onnx cannot tell the type of every tensor named ({exc}).",
            tip="Name tensors whose type shape inference finds, e.g. a Conv's or a Concat's "
            "output before the post-processing.",
        ) from None
    declared = {value.name: value for value in graph.output}
    for value in cut.graph.output:  # an ai.onnx.ml op's output is inferred without a shape
        if value.name in declared and not value.type.tensor_type.HasField("shape"):
            value.CopyFrom(declared[value.name])
    del cut.opset_import[:]
    cut.opset_import.extend(model.opset_import)
    cut.ir_version = model.ir_version
    return cut


def resized_inputs(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]]) -> list[str]:
    """The inputs whose ``[inputs] shapes`` entry changes a size the model fixes (same rank)."""
    resized = []
    for value in model.graph.input:
        if value.name not in shapes or not value.type.tensor_type.HasField("shape"):
            continue
        dims = value.type.tensor_type.shape.dim
        new = list(shapes[value.name])
        if len(dims) == len(new) and any(
            d.HasField("dim_value") and d.dim_value > 0 and d.dim_value != n
            for d, n in zip(dims, new, strict=True)
        ):
            resized.append(value.name)
    return resized


def fix_input_shapes(
    model: onnx.ModelProto,
    dims: Mapping[str, int],
    shapes: Mapping[str, Sequence[int]],
) -> tuple[onnx.ModelProto, Change]:
    """Give every graph input a fully static shape from ``dims`` (by dim_param) and ``shapes``.

    ``shapes`` may change a size the model fixes: an export at a dummy size (CenterFace at
    10x3x32x32, run by its app at the image's size) is built at the size the app feeds, and
    the source is run at that size as the reference (``edit.free_input_dims``). The graph must
    then infer at that size (strict shape inference: a MatMul's rows, a Reshape's sizes), or
    ModelError names the input, both shapes and what inference said.

    Raises ModelError listing every input dim the config leaves dynamic, with the key to set.
    Output shapes and stored value_info that mention fixed dims are cleared: inference redoes
    them (``store_inferred_shapes``).
    """
    model = copy_model(model)
    graph = model.graph
    inits = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in inits]
    names = {i.name for i in inputs}
    params = {
        d.dim_param
        for i in inputs
        if i.type.HasField("tensor_type")
        for d in i.type.tensor_type.shape.dim
        if d.HasField("dim_param")
    }
    issues = []
    for name in shapes:
        if name not in names and name not in inits:  # an input baked in as a constant is done
            issues.append(f"[inputs] shapes names {name!r}, not an input; " + _hint(name, names))
    for param in dims:
        if param not in params:
            issues.append(
                f"[inputs] dims names {param!r}, not a dim_param of any input; "
                + _hint(param, params)
            )
    details = []
    resizing = set(resized_inputs(model, shapes))
    resized: dict[str, tuple[list[Any], list[int]]] = {}
    for value in inputs:
        if not value.type.HasField("tensor_type"):
            issues.append(f"input {value.name!r} is not a tensor; only tensor inputs are supported")
            continue
        tensor_type = value.type.tensor_type
        old = [
            d.dim_param
            if d.HasField("dim_param")
            # A negative size is how some exporters (older paddle2onnx) write a dynamic one.
            else (d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else "?")
            for d in tensor_type.shape.dim
        ]
        new = _static_shape(value, old, dims, shapes, issues)
        if new is not None and old != new:
            tensor_type.ClearField("shape")
            for size in new:
                tensor_type.shape.dim.add().dim_value = int(size)
            note = " (sizes the model fixes, as [inputs] shapes asks)" * (value.name in resizing)
            details.append(f"input {value.name!r}: {old} -> {new}{note}")
            if value.name in resizing:
                resized[value.name] = (old, new)
    if issues:
        raise ModelError(
            "The model's inputs cannot be made static:\n  " + "\n  ".join(issues),
            tip="The QNN HTP backend needs static shapes: fix the [inputs] section of the config.",
        )
    if details:
        # Anything derived from the old dynamic shapes is stale now.
        for graph_ in all_graphs(graph):
            del graph_.value_info[:]
        for out in graph.output:
            for dim in out.type.tensor_type.shape.dim:
                if resized or not dim.HasField("dim_value"):
                    dim.Clear()  # unknown, keeping the rank
    if resized:
        _check_resized_inputs(model, resized)
    return checked_change(model, "fix_input_shapes", details)


def _check_resized_inputs(model: onnx.ModelProto, resized: Mapping[str, Any]) -> None:
    """Strict shape inference at the new sizes: ModelError when the graph cannot take them."""
    try:
        onnx.shape_inference.infer_shapes(
            without_weight_data(model), strict_mode=True, data_prop=True
        )
    except onnx.shape_inference.InferenceError as exc:
        said = " ".join(str(exc).split())[:400]
        changes = "; ".join(f"{name!r} {old} -> {new}" for name, (old, new) in resized.items())
        raise ModelError(
            f"[inputs] shapes changes sizes the model fixes ({changes}), and its graph does "
            f"not take the new shape: {said}",
            tip="Give the input the size the model was exported for, or one its layers take "
            "(the same channels and features), or re-export it with dynamic axes.",
        ) from None


# --------------------------------------------------------------------------------------------
# 2. Constant nodes, folding, If inlining


def constant_value(node: onnx.NodeProto) -> np.ndarray | None:
    for attr in node.attribute:
        if attr.ref_attr_name:
            return None
        if attr.name == "value":
            return numpy_helper.to_array(attr.t)
        if attr.name == "value_float":
            return np.array(attr.f, dtype=np.float32)
        if attr.name == "value_floats":
            return np.array(list(attr.floats), dtype=np.float32)
        if attr.name == "value_int":
            return np.array(attr.i, dtype=np.int64)
        if attr.name == "value_ints":
            return np.array(list(attr.ints), dtype=np.int64)
        if attr.name == "value_string":
            return np.array(attr.s.decode("utf-8"), dtype=object)
        if attr.name == "value_strings":
            return np.array([s.decode("utf-8") for s in attr.strings], dtype=object)
    return None  # sparse_value: leave it to onnxruntime


def constants_to_initializers(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Replace ``Constant`` nodes by initializers.

    The quantizer and ONNX Runtime's fusions (Conv+BatchNorm, ...) only treat initializers as
    weights; a Constant-node weight is quantized as an activation and blocks folding.
    """
    model = writable(model)
    details = []
    for graph in all_graphs(model.graph):
        outputs = {o.name for o in graph.output}
        keep = []
        for node in graph.node:
            value = None
            is_constant = node.op_type == "Constant" and node.domain in DEFAULT_DOMAINS
            if is_constant and node.output[0] not in outputs:
                value = constant_value(node)
            if value is None:
                keep.append(node)
                continue
            graph.initializer.append(numpy_helper.from_array(value, node.output[0]))
            details.append(
                f"Constant {node.output[0]!r} -> initializer {list(value.shape)} {value.dtype}"
            )
        if len(keep) != len(graph.node):
            set_nodes(graph, keep)
    return checked_change(model, "constants_to_initializers", details)


def _foldable(node: onnx.NodeProto) -> bool:
    if node.domain not in (*DEFAULT_DOMAINS, "ai.onnx.ml") or node.op_type in _NEVER_FOLD:
        return False
    if any(True for _ in subgraphs(node)):
        return False
    return bool(node.input) or node.op_type == "Constant"


def run_nodes(
    nodes: Sequence[onnx.NodeProto],
    values: Mapping[str, np.ndarray],
    model: onnx.ModelProto,
) -> dict[str, np.ndarray]:
    """Evaluate a constant subgraph with onnxruntime's CPU kernels (the ones that run it later)."""
    import onnxruntime as ort

    needed = {i for n in nodes for i in n.input if i} - {o for n in nodes for o in n.output}
    outputs = [o for n in nodes for o in n.output if o]
    graph = onnx.helper.make_graph(
        list(nodes),
        "fold",
        [],
        [onnx.ValueInfoProto(name=o) for o in outputs],
        initializer=[numpy_helper.from_array(values[name], name) for name in sorted(needed)],
    )
    sub = onnx.helper.make_model(graph, opset_imports=list(model.opset_import))
    sub.ir_version = max(DEFAULT_IR_VERSION, min_ir_version(sub))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 4
    session = ort.InferenceSession(
        sub.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return dict(zip(outputs, session.run(outputs, {}), strict=True))


def _nbytes(value: Any) -> int:
    """Bytes of a computed value: a tensor, or a sequence of them (onnxruntime returns a list)."""
    if isinstance(value, np.ndarray):
        return value.nbytes
    return sum(_nbytes(item) for item in value) if isinstance(value, (list, tuple)) else 0


def _evaluate_constants(model: onnx.ModelProto, details: list[str], max_bytes: int) -> bool:
    """Replace every node whose inputs are all constants by initializers of its results."""
    graph = model.graph
    inits = initializers_by_name(graph)
    outputs = {o.name for o in graph.output}
    if _bypass_constant_identities(graph, inits, outputs, details):
        return True
    constant = set(inits)
    candidates = []
    indices = []
    for index, node in enumerate(graph.node):
        if _foldable(node) and all(i in constant for i in node.input if i):
            candidates.append(node)
            indices.append(index)
            constant.update(o for o in node.output if o)
    if not candidates:
        return False
    values: dict[str, np.ndarray] = {}
    needed = {i for n in candidates for i in n.input if i} & set(inits)
    for name in needed:
        values[name] = numpy_helper.to_array(inits[name])
    try:
        values.update(run_nodes(candidates, values, model))
    except Exception:  # one odd node must not stop the others; retry one by one
        for node in candidates:
            if all(i in values for i in node.input if i):
                try:
                    values.update(run_nodes([node], values, model))
                except Exception:  # onnxruntime cannot run it: keep the node
                    continue
    used = used_names(graph)
    folded: set[int] = set()
    new_inits = []
    for index, node in zip(indices, candidates, strict=True):
        outs = [o for o in node.output if o]
        if any(o not in values for o in outs) or any(o in outputs for o in outs):
            continue
        if any(not isinstance(values[o], np.ndarray) for o in outs):
            continue  # a sequence (SplitToSequence) is no initializer; what reads it may fold
        in_bytes = sum(_nbytes(values[i]) for i in node.input if i in values)
        out_bytes = sum(values[o].nbytes for o in outs)
        if out_bytes > max(max_bytes, in_bytes):
            continue
        folded.add(index)
        for out in outs:
            if out in used:
                new_inits.append(numpy_helper.from_array(values[out], out))
        shapes = ", ".join(str(list(values[o].shape)) for o in outs)
        details.append(f"folded {node_label(node)} -> constant {shapes}")
    if not folded:
        return False
    drop_nodes(graph, folded)
    held = _already_held(new_inits, inits)
    graph.initializer.extend(t for t in new_inits if t.name not in held)
    delete_where(graph.value_info, lambda v: v.name in held)
    rename_tensors(graph, held)
    if held:
        details.append(f"{len(held)} folded result(s) equal to a constant held: read that one")
    return True


def _bypass_constant_identities(
    graph: onnx.GraphProto,
    inits: Mapping[str, onnx.TensorProto],
    outputs: set[str],
    details: list[str],
) -> bool:
    """Identity nodes of a constant: their readers read the constant itself, nothing is
    computed (the exporter's Identity per use of a shared weight: evaluated, 53 copies of 12 MB
    weights were 1.5 GB at once in the quantize process of a reaction transformer)."""
    dropped = _bypass_identities(graph, outputs, lambda source: source in inits)
    if dropped:
        details.append(f"{dropped} Identity node(s) of a constant: their readers read it")
    return bool(dropped)


def _bypass_identities(
    graph: onnx.GraphProto, outputs: set[str], reads: Callable[[str], bool]
) -> int:
    """Identity nodes whose input ``reads`` accepts, but not those writing a graph output:
    dropped, their readers reading that input; how many."""
    mapping: dict[str, str] = {}
    drop: set[int] = set()
    for index, node in enumerate(graph.node):
        if node.op_type != "Identity" or node.domain not in DEFAULT_DOMAINS or not node.input:
            continue
        if node.input[0] and reads(node.input[0]) and node.output[0] not in outputs:
            mapping[node.output[0]] = node.input[0]
            drop.add(index)
    if drop:
        bypass_nodes(graph, drop, mapping)
    return len(drop)


def _already_held(
    new_inits: list[onnx.TensorProto], inits: Mapping[str, onnx.TensorProto]
) -> dict[str, str]:
    """Folded results equal, byte for byte, to a constant the graph holds or to an earlier
    result: their name -> that constant's.

    Why: an exporter writes a module applied n times (shared weights, a recurrent step
    unrolled) as n Identity (or Reshape, Cast) nodes of one initializer; folding each into a
    copy of its own made an 85 MB transformer 642 MB, and every later step, the quantizer and
    the context carried the copies (5 GB peak). Small results (shapes, scalars) stay apart."""
    wanted = {
        (t.data_type, tuple(t.dims)) for t in new_inits if len(t.raw_data) >= SHARED_MIN_BYTES
    }
    if not wanted:
        return {}
    by_content: dict[tuple[int, tuple[int, ...], bytes], str] = {}

    def content(t: onnx.TensorProto) -> tuple[int, tuple[int, ...], bytes]:
        data = t.raw_data or numpy_helper.to_array(t).tobytes()
        return t.data_type, tuple(t.dims), hashlib.sha256(data).digest()

    for t in inits.values():
        if (t.data_type, tuple(t.dims)) in wanted and t.data_location != onnx.TensorProto.EXTERNAL:
            by_content.setdefault(content(t), t.name)
    held: dict[str, str] = {}
    for t in new_inits:
        if len(t.raw_data) < SHARED_MIN_BYTES:
            continue
        name = by_content.setdefault(content(t), t.name)
        if name != t.name:
            held[t.name] = name
    return held


def _fold_shape_nodes(model: onnx.ModelProto, details: list[str]) -> bool:
    """Shape/Size of a tensor whose static shape the schema gives -> constant."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    targets = [
        (i, n)
        for i, n in enumerate(graph.node)
        if n.op_type in ("Shape", "Size")
        and n.domain in DEFAULT_DOMAINS
        and n.output[0] not in outputs
    ]
    if not targets:
        return False
    values = inferred_values(model)
    folded: set[int] = set()
    for index, node in targets:
        shape = value_shape(values[node.input[0]]) if node.input[0] in values else None
        if shape is None:
            continue
        if node.op_type == "Size":
            result = np.array(math.prod(shape), dtype=np.int64)
        else:
            attrs = {a.name: a.i for a in node.attribute}
            rank = len(shape)
            start, end = attrs.get("start", 0), attrs.get("end", rank)
            start = min(max(start + rank if start < 0 else start, 0), rank)
            end = min(max(end + rank if end < 0 else end, 0), rank)
            result = np.array(shape[start:end], dtype=np.int64)
        graph.initializer.append(numpy_helper.from_array(result, node.output[0]))
        folded.add(index)
        details.append(f"folded {node_label(node)} of a static tensor -> {result.tolist()}")
    if not folded:
        return False
    drop_nodes(graph, folded)
    return True


def _inline_branch(
    model: onnx.ModelProto,
    index: int,
    branch: onnx.GraphProto,
    namer: FreshNames,
    results: Sequence[str] | None = None,
) -> list[onnx.NodeProto]:
    """The nodes of ``branch`` rewritten to live in the outer graph in place of ``node``.

    The branch's outputs get the names ``results`` (default: the If's own outputs).
    """
    node = model.graph.node[index]
    results = list(node.output) if results is None else list(results)
    body = onnx.GraphProto()
    body.CopyFrom(branch)
    # Names the branch defines must not clash with names elsewhere in the model.
    outer = defined_names(model.graph) - set(results)
    for position, other in enumerate(model.graph.node):
        if position != index:
            for sub in subgraphs(other):
                for g in all_graphs(sub):
                    outer |= defined_names(g)
    local = defined_names(body)
    rename_tensors(body, {name: namer(name) for name in local if name in outer})
    # Branch results take the If's output names, directly where a branch node produces them.
    produced = Counter(o for n in body.node for o in n.output if o)
    out_names = [o.name for o in body.output]
    mapping = {}
    extra = []
    for branch_out, if_out in zip(out_names, results, strict=True):
        if not if_out:
            continue
        if produced[branch_out] == 1 and out_names.count(branch_out) == 1:
            mapping[branch_out] = if_out
        else:
            extra.append(onnx.helper.make_node("Identity", [branch_out], [if_out]))
    rename_tensors(body, mapping)
    model.graph.initializer.extend(body.initializer)
    model.graph.sparse_initializer.extend(body.sparse_initializer)
    return [*body.node, *extra]


def _inline_constant_ifs(model: onnx.ModelProto, details: list[str]) -> bool:
    graph = model.graph
    inits = initializers_by_name(graph)
    namer: FreshNames | None = None
    new_nodes: list[onnx.NodeProto] = []
    changed = False
    for index, node in enumerate(graph.node):
        cond = inits.get(node.input[0]) if node.op_type == "If" and node.input else None
        if cond is None or node.domain not in DEFAULT_DOMAINS:
            new_nodes.append(node)
            continue
        value = numpy_helper.to_array(cond)
        if value.size != 1:
            new_nodes.append(node)
            continue
        taken = bool(value.reshape(()).item())
        branch_name = "then_branch" if taken else "else_branch"
        branch = next(a.g for a in node.attribute if a.name == branch_name)
        namer = namer or FreshNames(model)
        new_nodes.extend(_inline_branch(model, index, branch, namer))
        details.append(
            f"inlined {branch_name} of {node_label(node)}: its condition is constant {taken}"
        )
        changed = True
    if changed:
        set_nodes(graph, new_nodes)
    return changed


def _impure(branch: onnx.GraphProto) -> str | None:
    """An op that makes computing ``branch`` when it is not taken unsafe or wasteful."""
    for graph in all_graphs(branch):
        for node in graph.node:
            if node.op_type in _NONDETERMINISTIC or node.op_type in ("Loop", "Scan"):
                return node.op_type
    return None


def _lower_if(model: onnx.ModelProto, index: int) -> onnx.ModelProto | str:
    """``model`` with If node ``index`` computed as both branches + Where, or why not."""
    node = model.graph.node[index]
    branches = {a.name: a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH}
    for branch in branches.values():
        if op := _impure(branch):
            return f"a branch holds {op}, which must not run when the branch is not taken"
    candidate = copy_model(model)
    graph = candidate.graph
    namer = FreshNames(candidate)
    outputs = list(node.output)
    taken = {b: [namer(f"{o or 'unused'}_{b[:4]}") for o in outputs] for b in branches}
    then_nodes = _inline_branch(
        candidate, index, branches["then_branch"], namer, taken["then_branch"]
    )
    nodes = list(graph.node)
    set_nodes(graph, [*nodes[:index], *then_nodes, *nodes[index:]])
    index += len(then_nodes)
    else_nodes = _inline_branch(
        candidate, index, branches["else_branch"], namer, taken["else_branch"]
    )
    nodes = list(graph.node)
    set_nodes(graph, [*nodes[:index], *else_nodes, *nodes[index + 1 :]])
    inferred = inferred_values(candidate)  # one inference for the condition and the branches
    cond = inferred.get(node.input[0])
    cond_shape = value_shape(cond) if cond is not None else None
    if cond_shape is None or math.prod(cond_shape) != 1:
        return f"its condition {node.input[0]!r} has no static one-element shape"
    select: list[onnx.NodeProto] = []
    for out, then_out, else_out in zip(
        outputs, taken["then_branch"], taken["else_branch"], strict=True
    ):
        if not out:
            continue
        shapes = [value_shape(inferred[n]) if n in inferred else None for n in (then_out, else_out)]
        if shapes[0] is None or shapes[0] != shapes[1]:
            return f"its branches give {out!r} different or unknown shapes ({shapes[0]} vs {shapes[1]})"
        flag = namer(f"{node.input[0]}_for_{out}")
        shape = namer(f"{flag}_shape")
        graph.initializer.append(
            numpy_helper.from_array(np.ones(len(shapes[0]), dtype=np.int64), shape)
        )
        select.append(onnx.helper.make_node("Reshape", [node.input[0], shape], [flag]))
        select.append(onnx.helper.make_node("Where", [flag, then_out, else_out], [out]))
    graph.node.extend(select)
    sort_graph(graph)
    remove_dead_nodes(graph)
    return candidate


def lower_data_dependent_ifs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Compute an ``If`` on a computed condition as both branches and a ``Where``.

    Why: a keyword spotter's "run the verifier only above a threshold" is an If on a score. The
    QNN EP runs no control flow (the If and everything after it would stay on the CPU) and
    onnxruntime's qnn_preprocess_model breaks the If's subgraphs. Computing both branches and
    selecting is exact when the branches are pure and agree on shapes: a value of the branch not
    taken (even inf/NaN) never reaches the output. An If that fails those conditions is kept and
    named in the details.
    """
    model = writable(model)
    details: list[str] = []
    kept: set[tuple[str, ...]] = set()  # by outputs: indices move as branches are inlined
    while True:
        index = next(
            (
                i
                for i, n in enumerate(model.graph.node)
                if n.op_type == "If" and n.domain in DEFAULT_DOMAINS and tuple(n.output) not in kept
            ),
            None,
        )
        if index is None:
            break
        node = model.graph.node[index]
        lowered = _lower_if(model, index)
        if isinstance(lowered, str):
            details.append(f"kept {node_label(node)}: {lowered}")
            kept.add(tuple(node.output))
            continue
        details.append(f"computed both branches of {node_label(node)} and selected with Where")
        model = lowered
    return checked_change(model, "lower_data_dependent_ifs", details)


def fold_constants(
    model: onnx.ModelProto, max_bytes: int = FOLD_MAX_BYTES
) -> tuple[onnx.ModelProto, Change]:
    """Fold everything that is constant once the inputs are static, until nothing changes.

    Per round: inline ``If`` nodes on a constant condition, turn Shape/Size of tensors with a
    schema-inferred static shape into constants, evaluate nodes whose inputs are all constant
    with onnxruntime, drop dead nodes. This collapses Shape->Gather->Concat->Reshape chains, so
    that schema inference alone (what the QNN EP relies on) gives every shape.
    Q/DQ nodes, random ops and loops are never folded; results over ``max_bytes`` that are also
    bigger than their inputs are kept as nodes.
    """
    model = writable(model)
    graph = model.graph
    sort_graph(graph)
    details: list[str] = []
    removed = 0
    for _ in range(100):
        changed = _inline_constant_ifs(model, details)
        changed |= _evaluate_constants(model, details, max_bytes)
        removed += remove_dead_nodes(graph)
        changed |= _fold_shape_nodes(model, details)
        if not changed:
            break
        sort_graph(graph)
    removed += remove_dead_nodes(graph)
    if removed:
        details.append(f"removed {removed} node(s) whose results nothing reads")
    return checked_change(model, "fold_constants", details)


# --------------------------------------------------------------------------------------------
# 3. batch norm folding


def bn_params(
    node: onnx.NodeProto, inits: Mapping[str, onnx.TensorProto], used: Counter[str]
) -> tuple[np.ndarray, np.ndarray] | None:
    """(scale, shift) of an inference-mode BatchNormalization whose parameters are constants."""
    if len(node.input) < 5 or any(n not in inits for n in node.input[1:5]):
        return None
    attrs = {a.name: a for a in node.attribute}
    if "training_mode" in attrs and attrs["training_mode"].i:
        return None
    if "spatial" in attrs and attrs["spatial"].i == 0:
        return None
    if any(o and used[o] for o in node.output[1:]):
        return None
    eps = attrs["epsilon"].f if "epsilon" in attrs else 1e-5
    gamma, beta, mean, var = (
        numpy_helper.to_array(inits[n]).astype(np.float64) for n in node.input[1:5]
    )
    if not gamma.ndim == beta.ndim == mean.ndim == var.ndim == 1:
        return None
    scale = gamma / np.sqrt(var + eps)
    return scale, beta - mean * scale


class _BnFolder:
    """Shared state of one ``fold_batchnorm`` pass: constants, readers, producers, new names."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.graph = model.graph
        self.namer = FreshNames(model)
        self.inits = initializers_by_name(self.graph)
        self.outputs = {o.name for o in self.graph.output}
        self.used = used_names(self.graph)
        self.producer = {o: n for n in self.graph.node for o in n.output if o}
        self._shapes: dict[str, onnx.ValueInfoProto] | None = None

    def const(self, name: str) -> np.ndarray | None:
        return numpy_helper.to_array(self.inits[name]) if name in self.inits else None

    def new_init(self, array: np.ndarray, base: str) -> str:
        name = self.namer(base)
        self.graph.initializer.append(numpy_helper.from_array(array, name))
        self.inits[name] = self.graph.initializer[-1]
        return name

    def only_reader(self, name: str) -> bool:
        return self.used[name] == 1 and name not in self.outputs

    def rank(self, name: str) -> int | None:
        if self._shapes is None:
            self._shapes = inferred_values(self.model)
        value = self._shapes.get(name)
        if value is None or not value.type.tensor_type.HasField("shape"):
            return None
        return len(value.type.tensor_type.shape.dim)

    def set_weights(
        self, node: onnx.NodeProto, weight: np.ndarray, bias: np.ndarray, dtype: Any
    ) -> None:
        """Point ``node`` at new (weight, bias) initializers; the old ones may be shared."""
        w_name = self.new_init(weight.astype(dtype), f"{node.input[1]}_bnfold")
        b_name = self.new_init(bias.astype(dtype), f"{node.output[0]}_bnfold_bias")
        while len(node.input) < 3:
            node.input.append("")
        node.input[1], node.input[2] = w_name, b_name

    def fold_conv(self, conv: onnx.NodeProto, scale: np.ndarray, shift: np.ndarray) -> bool:
        """Conv: W[o] *= s[o]; ConvTranspose (W is [C_in, M/group, k...]) per output channel."""
        weight = self.const(conv.input[1])
        has_bias = len(conv.input) > 2 and bool(conv.input[2])
        bias = self.const(conv.input[2]) if has_bias else np.zeros(scale.shape)
        if weight is None or bias is None or bias.shape != scale.shape:
            return False
        channels = scale.shape[0]
        group = next((a.i for a in conv.attribute if a.name == "group"), 1)
        w64 = weight.astype(np.float64)
        if conv.op_type == "Conv":
            if weight.shape[0] != channels:
                return False
            w64 = w64 * scale.reshape((-1,) + (1,) * (weight.ndim - 1))
        else:
            if weight.shape[1] * group != channels or weight.shape[0] % group:
                return False
            grouped = w64.reshape((group, weight.shape[0] // group, *weight.shape[1:]))
            factor = scale.reshape((group, 1, channels // group) + (1,) * (weight.ndim - 2))
            w64 = (grouped * factor).reshape(weight.shape)
        self.set_weights(conv, w64, bias.astype(np.float64) * scale + shift, weight.dtype)
        return True

    def fold_gemm(self, gemm: onnx.NodeProto, scale: np.ndarray, shift: np.ndarray) -> bool:
        """Gemm: BN's channel is the output column; alpha stays, beta is folded into C."""
        attrs = {a.name: a for a in gemm.attribute}
        trans_b = attrs["transB"].i if "transB" in attrs else 0
        beta = attrs["beta"].f if "beta" in attrs else 1.0
        weight = self.const(gemm.input[1])
        has_bias = len(gemm.input) > 2 and bool(gemm.input[2])
        bias = self.const(gemm.input[2]) if has_bias else np.zeros(scale.shape)
        if weight is None or bias is None or weight.ndim != 2:
            return False
        if weight.shape[0 if trans_b else 1] != scale.shape[0]:
            return False
        try:
            new_bias = beta * bias.astype(np.float64) * scale + shift
        except ValueError:
            return False
        factor = scale[:, None] if trans_b else scale[None, :]
        self.set_weights(gemm, weight.astype(np.float64) * factor, new_bias, weight.dtype)
        for attr in [a for a in gemm.attribute if a.name == "beta"]:
            gemm.attribute.remove(attr)
        return True

    def fold_matmul(
        self, bn: onnx.NodeProto, prev: onnx.NodeProto, scale: np.ndarray, shift: np.ndarray
    ) -> bool:
        """MatMul(x, W) [+ Add(b)] with a 2-D output, where BN's dim 1 is W's column."""
        add = prev if prev.op_type == "Add" else None
        if add is not None:
            pair = [(i, self.producer.get(name)) for i, name in enumerate(add.input)]
            found = [(i, n) for i, n in pair if n is not None and n.op_type == "MatMul"]
            if len(found) != 1 or add.input[1 - found[0][0]] not in self.inits:
                return False
            matmul = found[0][1]
            bias_slot = 1 - found[0][0]
            if not self.only_reader(matmul.output[0]):
                return False
            bias = self.const(add.input[bias_slot])
        else:
            matmul, bias = prev, np.zeros(scale.shape)
        weight = self.const(matmul.input[1])
        if weight is None or weight.ndim != 2 or weight.shape[1] != scale.shape[0]:
            return False
        if bias is None or bias.size not in (1, scale.shape[0]) or bias.ndim > 2:
            return False
        if self.rank(matmul.output[0]) != 2:
            return False  # BN normalises dim 1, the MatMul's last dim only in 2-D
        dtype = weight.dtype
        w_name = self.new_init(
            (weight.astype(np.float64) * scale[None, :]).astype(dtype), f"{matmul.input[1]}_bnfold"
        )
        matmul.input[1] = w_name
        b_name = self.new_init(
            (bias.astype(np.float64).reshape(-1) * scale + shift).astype(dtype),
            f"{bn.output[0]}_bnfold_bias",
        )
        if add is not None:
            add.input[bias_slot] = b_name
            return True
        # No Add yet: the BN node becomes one, which keeps the node order topological.
        mid = self.namer(f"{matmul.output[0]}_scaled")
        matmul.output[0] = mid
        bn.CopyFrom(
            onnx.helper.make_node(
                "Add", [mid, b_name], [bn.output[0]], name=self.namer(f"{bn.name or 'bn'}_shift")
            )
        )
        return True


def fold_batchnorm(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Fold inference-mode BatchNormalization into the Conv, ConvTranspose, Gemm or MatMul(+Add)
    before it, when that op's weights are constants and only the BN reads its output.

    Unfused BNs are quantized on their own and often fall back to the CPU, splitting the QNN
    graph. The fold is exact up to float rounding (computed in float64).
    """
    model = writable(model)
    folder = _BnFolder(model)
    removed: set[int] = set()
    details = []
    for index, bn in enumerate(model.graph.node):
        if bn.op_type != "BatchNormalization" or bn.domain not in DEFAULT_DOMAINS:
            continue
        params = bn_params(bn, folder.inits, folder.used)
        prev = folder.producer.get(bn.input[0])
        if params is None or prev is None or prev.domain not in DEFAULT_DOMAINS:
            continue
        if not folder.only_reader(bn.input[0]):
            continue
        label, prev_label = bn.name or bn.output[0], node_label(prev)
        if prev.op_type in ("Conv", "ConvTranspose"):
            done = folder.fold_conv(prev, *params)
        elif prev.op_type == "Gemm":
            done = folder.fold_gemm(prev, *params)
        elif prev.op_type in ("MatMul", "Add"):
            done = folder.fold_matmul(bn, prev, *params)
            if done and bn.op_type == "Add":  # became the bias Add; nothing to remove
                folder.producer[bn.output[0]] = bn
                folder.used = used_names(model.graph)
                details.append(f"folded BatchNormalization {label!r} into {prev_label} (+Add)")
                continue
        else:
            done = False
        if not done:
            continue
        prev.output[0] = bn.output[0]
        folder.producer[bn.output[0]] = prev
        folder.used = used_names(model.graph)
        removed.add(index)
        details.append(f"folded BatchNormalization {label!r} into {prev_label}")
    if removed:
        drop_nodes(model.graph, removed)
    remove_dead_nodes(model.graph)
    return checked_change(model, "fold_batchnorm", details)


_AFFINE_OPS = ("Add", "Sub", "Mul", "Div")


def _channel_vector(value: np.ndarray, rank: int, channels: int) -> np.ndarray | None:
    """``value`` as a vector over axis 1 of a rank-``rank`` tensor with ``channels`` channels,
    or None when broadcasting it would vary along another axis or change the shape."""
    if value.ndim > rank or rank < 2 or value.dtype.kind != "f":
        return None
    shape = (1,) * (rank - value.ndim) + value.shape
    if any(d != 1 for i, d in enumerate(shape) if i != 1) or shape[1] not in (1, channels):
        return None
    return np.broadcast_to(value.astype(np.float64).reshape(-1), (channels,))


def _conv_channels(folder: _BnFolder, conv: onnx.NodeProto) -> int | None:
    weight = folder.const(conv.input[1]) if len(conv.input) > 1 else None
    if weight is None or weight.ndim < 3 or weight.dtype.kind != "f":
        return None
    group = next((a.i for a in conv.attribute if a.name == "group"), 1)
    return weight.shape[0] if conv.op_type == "Conv" else weight.shape[1] * group


def fold_conv_affine(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Fold a constant per-channel Add, Sub, Mul, Div or BatchNormalization after a Conv or
    ConvTranspose into its weights and bias (exact up to float rounding, computed in float64),
    chains of them too.

    Why: exporters write a ConvTranspose without bias followed by an Add (Paddle's p2o, some
    TF converters). Left apart, the two are quantized apart, and the QNN HTP fuses the Add
    into the convolution with the constant's zero point dropped: measured on a text
    detector's head, that tensor went from 71 dB to 22 dB against the CPU. A BatchNorm behind
    such an Add could not fold either. onnxruntime's own fusions cover Conv + Add only.
    """
    model = writable(model)
    folder = _BnFolder(model)
    details: list[str] = []
    removed: set[int] = set()
    changed = True
    while changed:
        changed = False
        for index, node in enumerate(model.graph.node):
            if index in removed or node.domain not in DEFAULT_DOMAINS:
                continue
            if node.op_type == "BatchNormalization":
                batchnorm = bn_params(node, folder.inits, folder.used)
                if batchnorm is None:
                    continue
            elif node.op_type not in _AFFINE_OPS or len(node.input) != 2:
                continue
            for side in (0, 1) if node.op_type in ("Add", "Mul") else (0,):
                conv = folder.producer.get(node.input[side])
                other = node.input[1 - side]
                if conv is None or conv.op_type not in ("Conv", "ConvTranspose"):
                    continue
                if conv.domain not in DEFAULT_DOMAINS or not folder.only_reader(node.input[side]):
                    continue
                channels = _conv_channels(folder, conv)
                if channels is None:
                    continue
                if node.op_type == "BatchNormalization":
                    scale, shift = batchnorm
                else:
                    rank = folder.rank(node.input[side])
                    value = folder.const(other)
                    vector = None
                    if rank is not None and value is not None:
                        vector = _channel_vector(value, rank, channels)
                    if vector is None or (node.op_type == "Div" and not np.all(vector)):
                        continue
                    ones, zeros = np.ones(channels), np.zeros(channels)
                    if node.op_type in ("Add", "Sub"):  # (a Div by zero is not folded)
                        scale, shift = ones, vector if node.op_type == "Add" else -vector
                    else:
                        scale = vector if node.op_type == "Mul" else 1.0 / vector
                        shift = zeros
                conv_label = node_label(conv)
                if not folder.fold_conv(conv, scale, shift):
                    continue
                conv.output[0] = node.output[0]
                folder.producer[node.output[0]] = conv
                node.input[side] = ""  # no longer read: the count below stays true
                folder.used = used_names(model.graph)
                removed.add(index)
                details.append(
                    f"folded {node.op_type} {node.name or node.output[0]!r} (constant per "
                    f"channel) into {conv_label}"
                )
                changed = True
                break
    if removed:
        drop_nodes(model.graph, removed)
        remove_dead_nodes(model.graph)
    return checked_change(model, "fold_conv_affine", details)


# --------------------------------------------------------------------------------------------
# 4. float16, float64 -> float32


def _to_float32(tensor: onnx.TensorProto) -> onnx.TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float32), tensor.name)


def _retype(type_proto: onnx.TypeProto, source: int = _FLOAT16) -> bool:
    """``source`` (float16, float64) -> float32 in a (possibly nested) type; True if changed."""
    which = type_proto.WhichOneof("value")
    if which == "tensor_type":
        if type_proto.tensor_type.elem_type == source:
            type_proto.tensor_type.elem_type = _FLOAT
            return True
    elif which == "sparse_tensor_type":
        if type_proto.sparse_tensor_type.elem_type == source:
            type_proto.sparse_tensor_type.elem_type = _FLOAT
            return True
    elif which == "sequence_type":
        return _retype(type_proto.sequence_type.elem_type, source)
    elif which == "optional_type":
        return _retype(type_proto.optional_type.elem_type, source)
    elif which == "map_type":
        return _retype(type_proto.map_type.value_type, source)
    return False


def float16_to_float32(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Make a float16 model float32 everywhere, graph inputs and outputs included.

    Calibration and the quantizer work on float32 (fp16 models fail with "Invalid input name"),
    and the QNN HTP quantized path does not need fp16 anywhere.
    """
    return _narrow_to_float32(passed_on(model), _FLOAT16, "float16_to_float32")


def bfloat16_to_float32(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Make a bfloat16 model (a ``.bfloat16()`` export) float32 everywhere, its inputs and
    outputs included: exact (bfloat16 is float32 with 16 fewer mantissa bits).

    onnxruntime's CPU EP runs no bfloat16 Conv ("Type 'tensor(bfloat16)' ... is invalid"), so
    neither calibration nor the quantizer can read the model, and numpy, which feeds it, has no
    bfloat16; the HTP computes in fp16 or quantized, never in bfloat16."""
    return _narrow_to_float32(passed_on(model), onnx.TensorProto.BFLOAT16, "bfloat16_to_float32")


def float64_to_float32(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Make float64 tensors, constants and Casts float32, graph inputs and outputs included.

    The HTP has no float64 and onnxruntime's quantizer cannot quantize it (a Softmax in float64
    after a Cast: "Only an existing tensor can be modified"); exporters write it where a
    constant or an arange defaulted to double (SwiftF0's pitch decoding). Double precision in
    a float32 network's tail changes its outputs by float32 rounding (the preparation check
    measures it).
    """
    return _narrow_to_float32(passed_on(model), _DOUBLE, "float64_to_float32")


def _narrow_to_float32(
    model: onnx.ModelProto, source: int, step: str
) -> tuple[onnx.ModelProto, Change]:
    model = writable(model)
    details = []
    top = model.graph
    name = onnx.helper.tensor_dtype_to_np_dtype(source).name
    for graph in all_graphs(model.graph):
        count = 0
        for i, init in enumerate(graph.initializer):
            if init.data_type == source:
                graph.initializer[i].CopyFrom(_to_float32(init))
                count += 1
        if count:
            details.append(f"{count} {name} initializer(s) -> float32")
        for kind, seq in (("input", graph.input), ("output", graph.output)):
            for value in seq:
                if _retype(value.type, source) and graph is top:
                    details.append(f"graph {kind} {value.name!r} {name} -> float32")
        for value in graph.value_info:
            _retype(value.type, source)
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.INT and attr.name in ("to", "dtype"):
                    if attr.i == source:
                        attr.i = _FLOAT
                        details.append(f"{node_label(node)}: {attr.name} {name} -> float32")
                elif attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == source:
                    attr.t.CopyFrom(_to_float32(attr.t))
                    details.append(f"{node_label(node)}: {attr.name} tensor {name} -> float32")
                elif attr.type == onnx.AttributeProto.TENSORS:
                    for t in attr.tensors:
                        if t.data_type == source:
                            t.CopyFrom(_to_float32(t))
    return checked_change(model, step, details)


# --------------------------------------------------------------------------------------------
# 5. opset


def _legacy_replacement(
    node: onnx.NodeProto, new_init: Any, namer: FreshNames
) -> list[onnx.NodeProto] | None:
    """Standard ops for experimental ops that the version converter has no adapter for."""
    if node.op_type not in _LEGACY_OPS:
        return None
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    x, y = node.input[0], node.output[0]
    base = node.name or y

    def mul_add(scale: Any, bias: Any, src: str, dst: str) -> list[onnx.NodeProto]:
        mid = namer(f"{base}_scaled")
        return [
            onnx.helper.make_node(
                "Mul", [src, new_init(scale, f"{base}_scale")], [mid], name=namer(f"{base}_mul")
            ),
            onnx.helper.make_node(
                "Add", [mid, new_init(bias, f"{base}_bias")], [dst], name=namer(f"{base}_add")
            ),
        ]

    if node.op_type == "ImageScaler":
        bias = np.asarray(attrs.get("bias", [0.0]), dtype=np.float32)
        return mul_add(
            np.array(attrs.get("scale", 1.0), dtype=np.float32), bias.reshape(1, -1, 1, 1), x, y
        )
    if node.op_type == "Scale":
        scale = np.array(attrs.get("scale", 1.0), dtype=np.float32)
        return [onnx.helper.make_node("Mul", [x, new_init(scale, f"{base}_scale")], [y], name=base)]
    if node.op_type == "Affine":
        alpha = np.array(attrs.get("alpha", 1.0), dtype=np.float32)
        return mul_add(alpha, np.array(attrs.get("beta", 0.0), dtype=np.float32), x, y)
    if node.op_type in ("ScaledTanh", "ParametricSoftplus"):
        inner, mid = namer(f"{base}_in"), namer(f"{base}_act")
        beta = np.array(attrs.get("beta", 1.0), dtype=np.float32)
        alpha = np.array(attrs.get("alpha", 1.0), dtype=np.float32)
        act = "Tanh" if node.op_type == "ScaledTanh" else "Softplus"
        return [
            onnx.helper.make_node(
                "Mul", [x, new_init(beta, f"{base}_beta")], [inner], name=namer(f"{base}_mul_in")
            ),
            onnx.helper.make_node(act, [inner], [mid], name=namer(f"{base}_{act.lower()}")),
            onnx.helper.make_node(
                "Mul", [mid, new_init(alpha, f"{base}_alpha")], [y], name=namer(f"{base}_mul_out")
            ),
        ]
    return None


def replace_legacy_ops(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Rewrite experimental ops (ImageScaler, Scale, Affine, ScaledTanh, ParametricSoftplus)
    into Mul/Add/Tanh/Softplus, because the onnx version converter has no adapter for them and
    fails when the quantizer upgrades the opset. Assumes float32 (run after float16_to_float32).
    """
    model = writable(model)
    namer = FreshNames(model)
    details = []
    for graph in all_graphs(model.graph):
        new_nodes: list[onnx.NodeProto] = []

        def new_init(array: Any, base: str, graph: onnx.GraphProto = graph) -> str:
            name = namer(base)
            graph.initializer.append(numpy_helper.from_array(np.asarray(array, np.float32), name))
            return name

        replaced = False
        for node in graph.node:
            replacement = (
                _legacy_replacement(node, new_init, namer)
                if node.domain in DEFAULT_DOMAINS
                else None
            )
            if replacement is None:
                new_nodes.append(node)
                continue
            replaced = True
            new_nodes.extend(replacement)
            ops = "+".join(n.op_type for n in replacement)
            details.append(f"{node_label(node)} -> {ops}")
        if replaced:
            set_nodes(graph, new_nodes)
    return checked_change(model, "replace_legacy_ops", details)


def upgrade_opset(
    model: onnx.ModelProto, target: int = TARGET_OPSET
) -> tuple[onnx.ModelProto, Change]:
    """Convert the default ONNX domain to opset ``target`` (no-op if already there or above).

    The quantizer converts to 21 itself for 16-bit Q/DQ and only warns when that fails; doing
    it here makes a failure loud, names the op, and lets later steps see the final ops.
    """

    current = opset_version(model)
    if current >= target:
        return checked_change(copy_model(model), "upgrade_opset", [])
    if not current and not any(
        n.domain in ("", "ai.onnx") for g in all_graphs(model.graph) for n in g.node
    ):  # only other domains' ops (an onnxmltools classifier imports ai.onnx.ml alone): the
        # converter reads "opset 0" and fails; there is nothing of the default domain to convert
        model = copy_model(model)
        model.opset_import.append(onnx.helper.make_opsetid("", target))
        model.ir_version = max(model.ir_version, min_ir_version(model))
        return checked_change(model, "upgrade_opset", [f"no ai.onnx import -> opset {target}"])
    legacy = sorted(
        {n.op_type for g in all_graphs(model.graph) for n in g.node} & (_LEGACY_OPS | {"Crop"})
    )
    if legacy:
        nodes = [
            t.name or t.output[0]
            for g in all_graphs(model.graph)
            for t in g.node
            if t.op_type in legacy
        ]
        raise ModelError(
            f"Ops {legacy} (nodes {nodes[:5]}) have no opset-{target} equivalent in the onnx "
            "version converter, and the exact rewrites that run before it (replace_legacy_ops, "
            "pipeline/graph/legacy.py) do not cover these nodes' attributes.",
            tip="Re-export the model with opset >= 11, or add an exact rewrite for this form of "
            "the op to pipeline/graph/legacy.py.",
        )
    try:
        # Without the weights' bytes (edit.without_weight_data): a 176 MB model cost +1152 MB
        # here. An adapter that changed a weight needs its data: converted again with it.
        converted = _convert_version(without_weight_data(model), target)
        if not restore_weight_data(converted, model):
            converted = _convert_version(model, target)
    except Exception as exc:  # the converter raises bare RuntimeErrors
        raise ModelError(
            f"The onnx version converter could not bring the model from opset {current} to "
            f"{target}: {exc}",
            tip="Re-export the model with a newer opset (>= 13).",
        ) from exc
    converted.ir_version = max(model.ir_version, min_ir_version(converted))
    return checked_change(converted, "upgrade_opset", [f"opset {current} -> {target}"])


def _convert_version(model: onnx.ModelProto, target: int) -> onnx.ModelProto:
    """onnx's version converter in one call, or else one opset at a time. Why: in one call it
    infers shapes once, on the source; an adapter that needs the shape of a tensor an earlier
    adapter changed then fails ("Shape of input 0 is not available": a Caffe2-era opset-4
    Reshape whose shape attribute became an input, then the Gemm after it), while each call
    of its own infers them again."""
    from onnx import version_converter

    try:
        return version_converter.convert_version(model, target)
    except Exception:
        current = opset_version(model)
        if target - current < 2:
            raise
        for opset in range(current + 1, target + 1):
            model = version_converter.convert_version(model, opset)
        return model


# --------------------------------------------------------------------------------------------
# 6. HTP-friendly rewrites


def scalar_const(inits: Mapping[str, onnx.TensorProto], name: str) -> float | None:
    """The value of a constant whose elements are all equal, else None."""
    if name not in inits:
        return None
    array = numpy_helper.to_array(inits[name])
    if array.size == 0 or array.dtype.kind != "f" or not (array == array.flat[0]).all():
        return None
    return float(array.flat[0])


def _htp_rewrite(
    node: onnx.NodeProto, inits: Mapping[str, onnx.TensorProto], shape: Any
) -> tuple[str, list[str], str] | None:
    """(new op, new inputs, why) for one node, or None. ``shape(name)`` gives static shapes;
    each rewrite keeps the output shape (checked against the input it keeps)."""
    same_shape = shape(node.output[0]) is not None
    if node.op_type == "Pow" and len(node.input) == 2:
        power = scalar_const(inits, node.input[1])
        x = node.input[0]
        if power is None or not same_shape or shape(x) != shape(node.output[0]):
            return None
        ops = {2.0: ("Mul", [x, x]), 1.0: ("Identity", [x]), 0.5: ("Sqrt", [x])}
        if power in ops:
            return (*ops[power], f"exponent {power:g}")
    elif node.op_type in ("Max", "Min"):
        # -inf / lowest float in a Max (+inf / max float in a Min) changes nothing, but as a
        # quantized constant it stretches the range until every real value rounds to one step.
        limit = float(np.finfo(np.float32).max)
        neutral = (lambda v: v <= -limit) if node.op_type == "Max" else (lambda v: v >= limit)
        keep = []
        for name in node.input:
            value = scalar_const(inits, name)
            if value is None or not neutral(value):
                keep.append(name)
        if keep and len(keep) < len(node.input):
            if len(keep) == 1 and shape(keep[0]) == shape(node.output[0]) and same_shape:
                return "Identity", keep, "drops a no-op ±inf operand"
            if len(keep) > 1:
                return node.op_type, keep, "drops a no-op ±inf operand"
        if node.op_type == "Max" and len(node.input) == 2:
            zero = [i for i, n in enumerate(node.input) if scalar_const(inits, n) == 0.0]
            if len(zero) == 1:
                x = node.input[1 - zero[0]]
                if same_shape and shape(x) == shape(node.output[0]):
                    return "Relu", [x], "Max with 0"
    elif node.op_type in ("Expand", "Reshape") and same_shape:
        unchanged = shape(node.input[0]) == shape(node.output[0])
        return (
            ("Identity", [node.input[0]], "output shape equals input shape") if unchanged else None
        )
    return None


def bypass_identities(graph: onnx.GraphProto) -> int:
    """Remove Identity nodes by reading their input directly (graph outputs keep their names)."""
    outputs = {o.name for o in graph.output}
    producers = {o: i for i, n in enumerate(graph.node) for o in n.output if o}
    used = used_names(graph)
    mapping: dict[str, str] = {}
    gone: set[int] = set()
    for index, node in enumerate(graph.node):
        if node.op_type != "Identity" or node.domain not in DEFAULT_DOMAINS:
            continue
        source, target = node.input[0], node.output[0]
        source = mapping.get(source, source)
        if target not in outputs:
            mapping[target] = source
            gone.add(index)
        elif source in producers and source not in outputs and used[source] == 1:
            graph.node[producers[source]].output[:] = [
                target if o == source else o for o in graph.node[producers[source]].output
            ]
            gone.add(index)
    if not gone:
        return 0
    drop_nodes(graph, gone)
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in mapping:
                node.input[i] = mapping[name]
        for sub in subgraphs(node):
            rename_tensors(sub, mapping)
    return len(gone)


def split_computed_clips(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Clip(x, lo, hi) with a computed bound -> Max(x, lo) then Min(., hi): exactly Clip's
    definition.

    Why: the QNN EP takes a Clip only with constant bounds; a computed one (a log-mel front
    end's ``top_db`` floor, ``max(x) - 80``) stays on the CPU and cuts the graph in two. A
    constant no-op bound (±float max) that comes along is dropped later by rewrite_for_htp.
    """
    model = writable(model)
    graph = model.graph
    inits = initializers_by_name(graph)
    nodes: list[onnx.NodeProto] = []
    details: list[str] = []
    namer: FreshNames | None = None
    for node in graph.node:
        bounds = list(node.input[1:3])
        computed = [b for b in bounds if b and b not in inits]
        if node.op_type != "Clip" or node.domain not in DEFAULT_DOMAINS or not computed:
            nodes.append(node)
            continue
        namer = namer or FreshNames(model)
        current = node.input[0]
        steps = [(op, b) for op, b in zip(("Max", "Min"), bounds, strict=False) if b]
        for position, (op, bound) in enumerate(steps):
            out = node.output[0] if position == len(steps) - 1 else namer(f"{node.output[0]}_lo")
            name = f"{node.name or node.output[0]}_{op.lower()}"
            nodes.append(onnx.helper.make_node(op, [current, bound], [out], name=name))
            current = out
        details.append(
            f"{node_label(node)} -> {' + '.join(op for op, _ in steps)} "
            f"(computed bound {', '.join(repr(b) for b in computed)})"
        )
    if details:
        set_nodes(graph, nodes)
    return checked_change(model, "split_computed_clips", details)


def rewrite_for_htp(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Exact rewrites of patterns the HTP backend or its quantization handles badly.

    - Pow(x, 2) -> Mul(x, x), Pow(x, 1) -> x, Pow(x, 0.5) -> Sqrt(x): a quantized
      ElementWisePower is rejected by HTP (error 3110) and costs a partition.
    - Max(x, -inf) / Min(x, +inf) -> x: the ±inf constant (a "no mask" sentinel in softmax
      decompositions) makes the quantized range infinite and the whole output garbage.
    - Max(x, 0) -> Relu(x): no quantized zero constant, a native HTP op.
    - Expand/Reshape to the shape they already have, and Identity nodes, are removed.
    """
    model = writable(model)
    graph = model.graph
    inits = initializers_by_name(graph)
    values: dict[str, onnx.ValueInfoProto] | None = None

    def shape(name: str) -> tuple[int, ...] | None:
        nonlocal values
        if name in inits:
            return tuple(inits[name].dims)
        values = values if values is not None else inferred_values(model)
        return value_shape(values[name]) if name in values else None

    details = []
    for node in graph.node:
        if node.domain not in DEFAULT_DOMAINS:
            continue
        rewrite = _htp_rewrite(node, inits, shape)
        if rewrite is None:
            continue
        op, inputs, why = rewrite
        details.append(f"{node_label(node)} -> {op} ({why})")
        del node.input[:]
        node.input.extend(inputs)
        node.op_type = op
        if op not in ("Max", "Min"):
            del node.attribute[:]
    removed = bypass_identities(graph)
    if removed:
        details.append(f"removed {removed} Identity node(s)")
    remove_dead_nodes(graph)
    return checked_change(model, "rewrite_for_htp", details)


def reverse_sequence_to_gather(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """ReverseSequence with constant, equal lengths -> Gather of constant time indices.

    Why: the QNN EP has no ReverseSequence, and tf2onnx writes one for every TensorFlow
    ``reverse`` (a Keras bidirectional RNN's backward half reverses its input and its outputs,
    with the sequence length as every batch entry's length): each stays on the CPU and cuts
    the graph. With the lengths constant and equal, the reversal is a fixed permutation of the
    time axis: reversed up to the length, unchanged after it.
    """
    model = writable(model)
    graph = model.graph
    inits = initializers_by_name(graph)
    fresh = FreshNames(model)
    values: dict[str, onnx.ValueInfoProto] | None = None
    details = []
    for index, node in enumerate(graph.node):
        if node.op_type != "ReverseSequence" or node.domain not in DEFAULT_DOMAINS:
            continue
        lengths = inits.get(node.input[1])
        if lengths is None:
            continue
        lens = numpy_helper.to_array(lengths).reshape(-1)
        values = values if values is not None else inferred_values(model)
        shape = value_shape(values[node.input[0]]) if node.input[0] in values else None
        attrs = {a.name: a.i for a in node.attribute}
        time_axis = attrs.get("time_axis", 0)
        if shape is None or lens.size == 0 or np.any(lens != lens[0]):
            continue
        steps, length = shape[time_axis], int(lens[0])
        if not 0 <= length <= steps:
            continue
        order = np.concatenate([np.arange(length)[::-1], np.arange(length, steps)]).astype(np.int64)
        indices = numpy_helper.from_array(order, fresh(f"{node.output[0]}_time_order"))
        graph.initializer.append(indices)
        graph.node[index].CopyFrom(
            onnx.helper.make_node(
                "Gather",
                [node.input[0], indices.name],
                list(node.output),
                name=node.name,
                axis=time_axis,
            )
        )
        details.append(
            f"{node_label(node)}: reversed the first {length} of {steps} steps by Gather"
        )
    return checked_change(model, "reverse_sequence_to_gather", details)


def gathernd_to_gather(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """GatherND with constant indices (batch_dims 0) on a static tensor -> Reshape + Gather.

    Each index tuple (i_0 .. i_q-1) picks row sum(i_k * stride_k) of the data flattened over
    its first q axes, so a Gather of those rows gives the same elements in GatherND's output
    shape. The QNN EP takes no GatherND: current transformers exports look their padding mask
    up with one (``attention_mask[batch_idx, kv_idx]`` under vmap), which left a node on the
    CPU of a MiniLM encoder.
    """
    return replace_nodes(passed_on(model), "gathernd_to_gather", _gathernd_as_gather)


def _gathernd_as_gather(
    node: onnx.NodeProto, context: NodeRewrite
) -> tuple[list[onnx.NodeProto], str] | None:
    batch_dims = next((a.i for a in node.attribute if a.name == "batch_dims"), 0)
    if node.op_type != "GatherND" or node.domain not in DEFAULT_DOMAINS or batch_dims:
        return None
    data, indices = node.input
    shape = context.shape(data) if indices in context.inits else None
    if shape is None:
        return None
    index = numpy_helper.to_array(context.inits[indices]).astype(np.int64)
    depth = index.shape[-1] if index.ndim else 0
    if not 0 < depth <= len(shape):
        return None
    dims = np.array(shape[:depth], np.int64)
    strides = np.array([int(np.prod(dims[k + 1 :])) for k in range(depth)], np.int64)
    rows = (np.mod(index, dims) * strides).sum(axis=-1)  # negative indices count from the end
    out = node.output[0]
    flat_shape = context.constant(np.array([-1, *shape[depth:]], np.int64), f"{out}_rows_shape")
    picked = context.constant(rows, f"{out}_rows")
    flat = context.fresh(f"{data}_rows")
    base = node.name or out
    return [
        onnx.helper.make_node("Reshape", [data, flat_shape], [flat], name=f"{base}_rows"),
        onnx.helper.make_node("Gather", [flat, picked], [out], name=base, axis=0),
    ], f"{node_label(node)} -> Reshape + Gather ({rows.size} constant rows)"


def flat_gather_indices(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Gather with constant indices of rank >= 2 on a static tensor -> a Gather of the
    flattened indices and a Reshape to the same output; one that picks every entry of its
    axis in order (an identity) -> the Reshape alone.

    Why: the dynamo exporter writes ``as_strided`` (timm's ConvNeXt and EdgeNeXt heads) as a
    Reshape to 1-D and a Gather of ``arange(n)`` shaped [1, n, 1, 1]; onnxruntime-qnn 2.7.0
    aborts the whole process compiling that Gather when layout transposes meet it (an
    assertion in a vector index, before a Conv or a Transpose; 1-D indices compile). The
    rewrite is exact: Gather's output is the data's leading dims, the indices' shape and the
    data's trailing dims, in the indices' row-major order.
    """
    return replace_nodes(passed_on(model), "flat_gather_indices", _gather_of_flat_indices)


def _gather_of_flat_indices(
    node: onnx.NodeProto, context: NodeRewrite
) -> tuple[list[onnx.NodeProto], str] | None:
    indices = context.inits.get(node.input[1]) if node.op_type == "Gather" else None
    if node.domain not in DEFAULT_DOMAINS or indices is None or len(indices.dims) < 2:
        return None
    data, out = node.input[0], node.output[0]
    shape = context.shape(data)
    if shape is None:
        return None
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0) % len(shape)
    index = np.mod(numpy_helper.to_array(indices).astype(np.int64), shape[axis]).reshape(-1)
    out_shape = [*shape[:axis], *indices.dims, *shape[axis + 1 :]]
    base = node.name or out
    target = context.constant(np.array(out_shape, np.int64), f"{out}_shape")
    if np.array_equal(index, np.arange(shape[axis])):
        return [
            onnx.helper.make_node("Reshape", [data, target], [out], name=base)
        ], f"{node_label(node)}: picks its whole axis in order -> Reshape"
    flat = context.constant(index, f"{node.input[1]}_flat")
    picked = context.fresh(f"{out}_flat")
    return [
        onnx.helper.make_node("Gather", [data, flat], [picked], name=f"{base}_flat", axis=axis),
        onnx.helper.make_node("Reshape", [picked, target], [out], name=base),
    ], f"{node_label(node)}: indices {list(indices.dims)} -> {index.size} flat + Reshape"


# The HTP's Gather of many short rows (measured with onnxruntime-qnn 2.7.0, QNN 2.51, on the
# simulator): gathering along the leading axis of a computed [N, 1, C] or [N, C] tensor with
# C <= 16 values a row (4, 8 and 16 measured, from a Conv + ReLU through a Transpose and a
# Reshape) returns zeros for the first output row that reads the data's last row (later reads
# of that row are right) with N = 384, 512, 1024, 1200 rows and as many indices or more; right
# are rows of 24 or 32 values, N = 64 or 256 (258 indices), or 4 or 64 indices of 1200 rows.
# One row of padding after the data makes it right.
SHORT_GATHER_ROW = 16
MANY_GATHERED = 256  # rows in the data and indices: above this both, where it was measured wrong


def pad_short_row_gathers(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A Gather along the leading axis of a computed tensor whose rows hold at most
    ``SHORT_GATHER_ROW`` values, with more than ``MANY_GATHERED`` rows and constant indices ->
    the same Gather of the data padded by one zero row at the end of that axis, its negative
    indices made positive (the pad row is never read: exact).

    Why: the dynamo exporter's adaptive average pooling of a 16-channel map (a GatherND of
    every window's positions from the map flattened to [H*W, 1, C]) came out of the HTP 45 dB
    from the CPU QDQ model, one window position read as zeros (above); padded, 62.6 dB (the
    gather of rows alone: 34.5 -> 80.4 dB).
    """
    return replace_nodes(passed_on(model), "pad_short_row_gathers", _padded_short_row_gather)


def _padded_short_row_gather(
    node: onnx.NodeProto, context: NodeRewrite
) -> tuple[list[onnx.NodeProto], str] | None:
    indices = context.inits.get(node.input[1]) if node.op_type == "Gather" else None
    if node.domain not in DEFAULT_DOMAINS or indices is None or node.input[0] in context.inits:
        return None
    shape = context.shape(node.input[0])
    producer = context.producers.get(node.input[0])
    if shape is None or len(shape) < 2 or (producer is not None and producer.op_type == "Pad"):
        return None  # a Pad before it: padded already (the step runs again on bucket models)
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0) % len(shape)
    if any(size != 1 for size in shape[:axis]) or math.prod(shape[axis + 1 :]) > SHORT_GATHER_ROW:
        return None
    if shape[axis] <= MANY_GATHERED or math.prod(indices.dims) <= MANY_GATHERED:
        return None  # a pick of a few slices, or from few rows: right as it is
    index = np.mod(numpy_helper.to_array(indices).astype(np.int64), shape[axis])
    pads = [0] * (2 * len(shape))
    pads[len(shape) + axis] = 1
    padded = context.fresh(f"{node.input[0]}_padded")
    pad_amounts = context.constant(np.array(pads, np.int64), f"{padded}_pads")
    positions = context.constant(index, f"{node.input[1]}_positive")
    base = node.name or node.output[0]
    return [
        onnx.helper.make_node("Pad", [node.input[0], pad_amounts], [padded], name=f"{base}_pad"),
        onnx.helper.make_node(
            "Gather", [padded, positions], [node.output[0]], name=base, axis=axis
        ),
    ], f"{node_label(node)}: rows of {math.prod(shape[axis + 1 :])} values: data padded by one row"


def col2im_to_conv_transpose(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Col2Im (``F.fold``) with constant image and block shapes -> Reshape of its columns to
    their block grid, then a ConvTranspose with ``group`` = channels and a one-hot weight.

    Col2Im sums each column's k_h x k_w values into the image at its block's place; a grouped
    ConvTranspose with weight ``W[c * kk + i * k_w + j, 0, i, j] = 1`` places input channel
    (c, i, j) of each grid position at offset (i, j) of that position's block, the same
    strides, dilations and pads, and ``output_padding`` makes up the image's size: exact.
    Why: the QNN EP has no Col2Im (VOLO's outlook attention folds 4 times: 5 partitions).
    """
    return replace_nodes(passed_on(model), "col2im_to_conv_transpose", _col2im_as_conv_transpose)


def _col2im_as_conv_transpose(
    node: onnx.NodeProto, context: NodeRewrite
) -> tuple[list[onnx.NodeProto], str] | None:
    if node.op_type != "Col2Im" or node.domain not in DEFAULT_DOMAINS:
        return None
    columns, image, block = node.input
    if image not in context.inits or block not in context.inits:
        return None
    shape = context.shape(columns)
    if shape is None:
        return None
    image_hw = [int(v) for v in numpy_helper.to_array(context.inits[image])]
    kernel = [int(v) for v in numpy_helper.to_array(context.inits[block])]
    attrs = {a.name: list(a.ints) for a in node.attribute}
    rank = len(kernel)
    strides = attrs.get("strides") or [1] * rank
    dilations = attrs.get("dilations") or [1] * rank
    pads = attrs.get("pads") or [0] * (2 * rank)
    grid = [
        (image_hw[a] + pads[a] + pads[a + rank] - dilations[a] * (kernel[a] - 1) - 1) // strides[a]
        + 1
        for a in range(rank)
    ]
    extra = [
        image_hw[a]
        - ((grid[a] - 1) * strides[a] - pads[a] - pads[a + rank])
        - dilations[a] * (kernel[a] - 1)
        - 1
        for a in range(rank)
    ]
    block_size = int(np.prod(kernel))
    n, stacked, length = shape
    if (
        rank != 2
        or length != int(np.prod(grid))
        or stacked % block_size
        or any(not 0 <= e < max(s, d) for e, s, d in zip(extra, strides, dilations, strict=True))
    ):
        return None
    channels = stacked // block_size
    weight = np.zeros((stacked, 1, *kernel), np.float32)
    for c in range(channels):
        for i in range(kernel[0]):
            for j in range(kernel[1]):
                weight[c * block_size + i * kernel[1] + j, 0, i, j] = 1.0
    base = node.name or node.output[0]
    target = context.constant(np.array([n, stacked, *grid], np.int64), f"{base}_grid_shape")
    placed = context.constant(weight, f"{base}_placement")
    gridded = context.fresh(f"{columns}_grid")
    return [
        onnx.helper.make_node("Reshape", [columns, target], [gridded], name=f"{base}_grid"),
        onnx.helper.make_node(
            "ConvTranspose",
            [gridded, placed],
            [node.output[0]],
            name=base,
            group=channels,
            kernel_shape=kernel,
            strides=strides,
            dilations=dilations,
            pads=pads,
            output_padding=extra,
        ),
    ], (
        f"{node_label(node)}: {channels} channels of {kernel[0]}x{kernel[1]} blocks on a "
        f"{grid[0]}x{grid[1]} grid -> Reshape + grouped ConvTranspose"
    )


def plain_tensor_names(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Inner tensors whose names hold a ';' -> the same name with '+' instead (made unique).

    TFLite converters name a fused op's output by joining the names of what it fused
    ("model/conv/MatMul;model/conv/BiasAdd"). The QNN EP compiles such a model, but a context
    model whose output is such a tensor aborts at load ("Tensor name not found", a native
    abort; a model output with ';' likewise): the HTP judge's locator exposes inner tensors as
    outputs, and it died on MediaPipe's hand landmark model. The graph's own inputs and
    outputs keep their names (the app reads them).
    """
    model = writable(model)
    graph = model.graph
    io = {v.name for v in (*graph.input, *graph.output)}
    fresh = FreshNames(model)
    mapping = {
        name: fresh(name.replace(";", "+"))
        for node in graph.node
        for name in node.output
        if ";" in name and name not in io
    }
    mapping |= {
        init.name: fresh(init.name.replace(";", "+"))
        for init in graph.initializer
        if ";" in init.name and init.name not in io
    }
    rename_tensors(graph, mapping)
    return checked_change(
        model, "plain_tensor_names", [f"{len(mapping)} tensor name(s) with ';'"] if mapping else []
    )


# Names onnxruntime's quantizer gives what it makes for a tensor T: T + each of these.
QUANTIZER_SUFFIXES = (
    "_scale",
    "_zero_point",
    "_quantized",
    "_QuantizeLinear",
    "_QuantizeLinear_Input",
    "_QuantizeLinear_Output",
    "_DequantizeLinear",
    "_DequantizeLinear_Input",
    "_DequantizeLinear_Output",
)


def quantizer_free_names(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A tensor named as onnxruntime's quantizer names what it makes for another tensor (T and
    ``T_scale``, ``T_zero_point``, ...) -> a fresh name.

    The quantizer adds T's scale as an initializer ``T_scale`` without looking whether one
    exists, then looks it up by name and finds the model's own: a Scaler rewritten as Sub and
    Mul by a constant ``scaled_scale`` behind a tensor ``scaled`` gave the Gemm reading it a
    bias scale of the constant's shape ("operands could not be broadcast together with shapes
    (5,) (16,)"). The graph's own inputs and outputs keep their names; a model with its own
    Q/DQ is left as its quantizer named it (the pipeline does not quantize it again).
    """
    model = writable(model)
    graph = model.graph
    if any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in graph.node):
        return checked_change(model, "quantizer_free_names", [])
    io = {v.name for v in (*graph.input, *graph.output)}
    names = {i.name for i in graph.initializer} | {o for n in graph.node for o in n.output if o}
    names |= {i.name for i in graph.input}
    fresh = FreshNames(model)
    mapping: dict[str, str] = {}
    for name in sorted(names):
        for suffix in QUANTIZER_SUFFIXES:
            owner = name.removesuffix(suffix)
            if owner == name or owner not in names:
                continue
            # Rename the one the app does not see: the derived-looking name, else its owner.
            if name not in io:
                mapping[name] = fresh(f"{owner}_{suffix.strip('_').lower()}_of_model")
            elif owner not in io:
                mapping[owner] = fresh(f"{owner}_of_model")
            break
    rename_tensors(graph, mapping)
    details = [f"{old} -> {new}" for old, new in mapping.items()]
    return checked_change(model, "quantizer_free_names", details)


def drop_identities(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Identity nodes -> their readers read the Identity's input (kept where the output is a
    graph output).

    The same tensors. paddle2onnx writes an Identity after most ops (192 in a PP-OCRv5
    detector); between a Conv and its BatchNorm's Mul and Add they hid the Add from
    ``fold_conv_affine``, which onnxruntime's optimizer then exposed too late: each Conv's
    output was quantized before its BatchNorm, one grid for channels of very different
    scales (the detector's QDQ model 6.7 dB from float on the CPU).
    """
    model = writable(model)
    outputs = {o.name for o in model.graph.output}
    dropped = _bypass_identities(model.graph, outputs, lambda _source: True)
    return checked_change(
        model, "drop_identities", [f"{dropped} Identity node(s) dropped"] if dropped else []
    )


def _pads_of_every_axis(
    node: onnx.NodeProto, context: NodeRewrite
) -> tuple[list[onnx.NodeProto], str] | None:
    """Pad(x, pads, value, axes) with constant pads and axes -> Pad(x, pads over every axis)."""
    if len(node.input) < 4 or not node.input[3]:
        return None
    shape = context.shape(node.input[0])
    pads, axes = context.inits.get(node.input[1]), context.inits.get(node.input[3])
    if shape is None or pads is None or axes is None:
        return None
    rank = len(shape)
    chosen = [int(a) % rank for a in numpy_helper.to_array(axes).reshape(-1)]
    amounts = numpy_helper.to_array(pads).astype(np.int64).reshape(-1)
    if len(amounts) != 2 * len(chosen) or len(set(chosen)) != len(chosen):
        return None
    full = np.zeros(2 * rank, np.int64)
    for k, axis in enumerate(chosen):
        full[axis], full[rank + axis] = amounts[k], amounts[len(chosen) + k]
    out = node.output[0]
    inputs = [node.input[0], context.constant(full, f"{out}_pads")]
    if len(node.input) > 2 and node.input[2]:
        inputs.append(node.input[2])
    mode = attribute(node, "mode", b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    padded = onnx.helper.make_node("Pad", inputs, list(node.output), name=node.name, mode=mode)
    return [padded], f"{node_label(node)}: pads of axes {chosen} -> pads over all {rank} axes"


def pads_over_every_axis(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A Pad with an ``axes`` input (opset 18; CenterCropPad's ONNX definition writes one) ->
    the same Pad with pads over every axis.

    Why: every context of a Pad with axes failed (reflect and constant modes, measured on the
    simulator), and the pad rules that follow (folds into Conv and pools, pads as Concat)
    read pads as one begin and end per axis."""
    return replace_by_op(
        passed_on(model), "pads_over_every_axis", {"Pad": _pads_of_every_axis}, DEFAULT_DOMAINS
    )


# op -> (the constant that leaves the other operand as it is, the input positions it may take)
_NEUTRAL_OPERANDS = {
    "Add": (0.0, (0, 1)),
    "Sub": (0.0, (1,)),
    "Mul": (1.0, (0, 1)),
    "Div": (1.0, (1,)),
}


_TypedShape = Callable[[str], tuple[tuple[int, ...], int] | None]  # name -> (shape, type)
# What a bypass rule sees: a node, the initializers, and a tensor's static shape and element
# type (None where unknown; computed once, on first use). It returns the input to read instead
# of the node's output and what it did, or None to keep the node.
_Bypass = Callable[
    [
        onnx.NodeProto,
        Mapping[str, onnx.TensorProto],
        _TypedShape,
    ],
    tuple[str, str] | None,
]


def _bypassed(model: onnx.ModelProto, step: str, rule: _Bypass) -> tuple[onnx.ModelProto, Change]:
    """``model`` without the default-domain nodes ``rule`` bypasses (their readers read the
    input it names; a node whose output is a graph output is kept)."""
    model = writable(model)
    graph = model.graph
    inits = initializers_by_name(graph)
    outputs = {o.name for o in graph.output}
    values: dict[str, onnx.ValueInfoProto] = {}

    def typed_shape(name: str) -> tuple[tuple[int, ...], int] | None:
        if not values:
            values.update(inferred_values(model))
        known = values.get(name)
        shape = value_shape(known) if known is not None else None
        return None if shape is None else (shape, known.type.tensor_type.elem_type)

    mapping: dict[str, str] = {}
    drop: set[int] = set()
    details: list[str] = []
    for index, node in enumerate(graph.node):
        if node.domain not in DEFAULT_DOMAINS or not node.output or node.output[0] in outputs:
            continue
        found = rule(node, inits, typed_shape)
        if found is not None:
            mapping[node.output[0]] = found[0]
            drop.add(index)
            details.append(f"{node_label(node)}: {found[1]}")
    if drop:
        bypass_nodes(graph, drop, mapping)
        remove_dead_nodes(graph)
    return checked_change(model, step, details)


def _fill_value(node: onnx.NodeProto) -> tuple[np.ndarray, int]:
    """A ConstantOfShape's fill as a 0-d array, and its data type (ONNX's default: float 0)."""
    value = next((a.t for a in node.attribute if a.name == "value"), None)
    if value is None:
        return np.zeros((), np.float32), onnx.TensorProto.FLOAT
    return numpy_helper.to_array(value).reshape(()), value.data_type


def _filled_constants(graph: onnx.GraphProto) -> dict[str, tuple[np.ndarray, int]]:
    """ConstantOfShape outputs of a constant shape: name -> (a broadcast view of the value it
    fills, its data type). Too large to fold (ZoeDepth's attractors add zeros of [1, 64, 192,
    256], 12.6 MB), they stayed on the CPU beside the QNN graph."""
    inits = initializers_by_name(graph)
    filled = {}
    for node in graph.node:
        if node.op_type != "ConstantOfShape" or node.domain not in DEFAULT_DOMAINS:
            continue
        if not node.input or node.input[0] not in inits:
            continue
        shape = tuple(int(d) for d in numpy_helper.to_array(inits[node.input[0]]).reshape(-1))
        fill, data_type = _fill_value(node)
        filled[node.output[0]] = (np.broadcast_to(fill, shape), data_type)
    return filled


def _neutral_operand(
    node: onnx.NodeProto,
    inits: Mapping[str, onnx.TensorProto],
    typed_shape: _TypedShape,
    filled: Mapping[str, tuple[np.ndarray, int]] | None = None,
) -> tuple[str, str] | None:
    """The other operand of x + 0, x - 0, x * 1, x / 1 that does not broadcast x; the 0 or 1
    an initializer or a ConstantOfShape of a constant shape (``_filled_constants``)."""
    neutral = _NEUTRAL_OPERANDS.get(node.op_type)
    if neutral is None or len(node.input) != 2:
        return None
    value, positions = neutral
    for position in positions:
        name, other = node.input[position], node.input[1 - position]
        if other in inits or not other:
            continue
        if name in inits:
            array, data_type = numpy_helper.to_array(inits[name]), inits[name].data_type
        elif filled and name in filled:
            array, data_type = filled[name]
        else:
            continue
        if array.dtype.kind != "f" or array.size == 0 or not np.all(array == value):
            continue
        known = typed_shape(other)
        if known is None or known[1] != data_type:
            continue
        try:
            if np.broadcast_shapes(array.shape, known[0]) != known[0]:
                continue  # x + zeros of a larger shape is x broadcast
        except ValueError:
            continue
        return other, f"{node.op_type} of {value:g} dropped"
    return None


def drop_neutral_arithmetic(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """x + 0, x - 0, x * 1, x / 1 (a constant that is that value everywhere and does not
    broadcast x to a larger shape) -> x (kept where the output is a graph output).

    The same tensors. Quantized, the HTP computes x + 0 as x on x's own grid: where the Add's
    output has another grid (a ReLU folded into it as a zero point of 0, a coarser scale), the
    requantization is lost (-0.1 dB for uint8, -15 dB for uint16 against the CPU QDQ model;
    0 + x, x - 0, x * 1 and x / 1 are right: dropped all the same, as the ops they are). A
    BatchNorm or GroupNorm with its initial shift of 0 (timm's MixNet and PoolFormer, their
    affine parameters as initialized) gave such Adds: MixNet-S at -13 dB on the HTP where its
    CPU QDQ model was at 32 dB. The 0 may be a ConstantOfShape too large to fold: ZoeDepth's
    two left on the CPU fed the QNN graph, whose context then failed to load ("The count of
    graph inputs should be at least the count of tensor_wrapper!").
    """
    filled = _filled_constants(model.graph)
    return _bypassed(
        model,
        "drop_neutral_arithmetic",
        lambda node, inits, typed_shape: _neutral_operand(node, inits, typed_shape, filled),
    )


def _filled_as_expand(node: onnx.NodeProto, context: NodeRewrite) -> tuple[list, str] | None:
    if node.op_type != "ConstantOfShape" or node.domain not in DEFAULT_DOMAINS:
        return None
    if not node.input or node.input[0] not in context.inits:
        return None
    fill, _ = _fill_value(node)
    if fill.dtype.kind != "f":
        return None  # integer fills are shapes and ids: the CPU's, and folded when small
    name = context.constant(fill, f"{node.output[0]}_value")
    expand = onnx.helper.make_node("Expand", [name, node.input[0]], list(node.output))
    expand.name = node.name
    return [expand], f"{node_label(node)}: Expand of {float(fill):g}"


def filled_constants_as_expand(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A float ConstantOfShape of a constant shape (left by ``fold_constants`` as too large to
    write) -> Expand(its value, shape): the same values. The QNN EP takes no ConstantOfShape,
    and one left on the CPU beside the QNN graph made its context fail to load ("The count of
    graph inputs should be at least the count of tensor_wrapper!", a zero-padding Concat of
    3 MB); the HTP expands the scalar."""
    return replace_nodes(passed_on(model), "filled_constants_as_expand", _filled_as_expand)


def _moves_nothing(
    node: onnx.NodeProto,
    inits: Mapping[str, onnx.TensorProto],
    shape: tuple[int, ...],
) -> bool:
    """Whether ``node`` gives back its input (of static ``shape``) unchanged, shape and values."""

    def constant(index: int) -> np.ndarray | None:
        name = node.input[index] if len(node.input) > index else ""
        return numpy_helper.to_array(inits[name]) if name in inits else None

    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    op = node.op_type
    if op == "Transpose":
        perm = list(attrs.get("perm", range(len(shape) - 1, -1, -1)))
        return perm == list(range(len(shape)))
    if op == "Slice":
        starts, ends = constant(1), constant(2)
        if starts is None or ends is None:
            return False
        axes = constant(3) if len(node.input) > 3 and node.input[3] else np.arange(len(starts))
        steps = constant(4) if len(node.input) > 4 and node.input[4] else np.ones(len(starts))
        if axes is None or steps is None:
            return False
        for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
            size = shape[int(axis)]
            if step != 1 or min(max(int(start) + (size if start < 0 else 0), 0), size) != 0:
                return False
            if min(int(end) + (size if end < 0 else 0), size) != size:
                return False
        return True
    if op == "Tile":
        repeats = constant(1)
        return repeats is not None and bool(np.all(repeats == 1))
    if op == "Pad":
        pads = constant(1)  # no padding at all: the same tensor whatever the mode and axes
        return pads is not None and bool(np.all(pads == 0))
    if op == "Concat":
        return len([i for i in node.input if i]) == 1
    if op in ("Reshape", "Expand"):
        target = constant(1)
        return target is not None and tuple(int(d) for d in target) == shape
    if op == "Resize":
        scales, sizes = constant(2), constant(3)
        same = (scales is not None and scales.size and bool(np.all(scales == 1))) or (
            sizes is not None and tuple(int(d) for d in sizes) == shape
        )
        mode = attrs.get("coordinate_transformation_mode", b"half_pixel")
        return bool(same) and mode != b"tf_crop_and_resize"
    return False


_MOVES = ("Transpose", "Slice", "Tile", "Pad", "Concat", "Reshape", "Expand", "Resize")


def drop_noop_moves(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A Transpose, Slice, Tile, Pad, Concat, Reshape, Expand or Resize that gives back its input
    as it is (the identity permutation, a slice of the whole tensor, repeats or scales of 1...)
    -> its input (kept where the output is a graph output).

    The same tensors. PyTorch exports leave them where a shape became static (``x[:, :n]`` with
    n the whole length). Quantized, the HTP drops such an op and with it the requantization to
    its output grid (onnxruntime folds a ReLU after it into that grid): a Conv -> whole-tensor
    Slice -> ReLU came out at 0.0 dB against the CPU QDQ model, an identity Transpose -0.0 dB.
    """

    def unmoved(
        node: onnx.NodeProto,
        inits: Mapping[str, onnx.TensorProto],
        typed_shape: _TypedShape,
    ) -> tuple[str, str] | None:
        source = node.input[0] if node.op_type in _MOVES and node.input else ""
        if not source or source in inits:
            return None
        known = typed_shape(source)
        if known is None or not _moves_nothing(node, inits, known[0]):
            return None
        return source, "gives back its input, dropped"

    return _bypassed(passed_on(model), "drop_noop_moves", unmoved)


def sequence_at_to_slices(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """SplitToSequence read only by SequenceAt at constant positions -> a Slice (or a Gather
    where the split's size-1 pieces are squeezed) per position read.

    The same tensors. PyTorch's dynamo exporter writes ``torch.unbind`` and ``split`` as a
    sequence and its items; the QNN EP takes no sequence op, so each pair stayed on the CPU
    (a streaming speech enhancer's attention caches: 8 CPU nodes, 4 partitions). Needs the
    split axis's size; the split sizes, if given, must be constants.
    """
    model = writable(model)
    graph = model.graph
    inits = initializers_by_name(graph)
    readers = readers_by_tensor(graph)
    outputs = {o.name for o in graph.output}
    values: dict[str, onnx.ValueInfoProto] | None = None
    fresh = FreshNames(model)
    details = []
    replace: dict[str, onnx.NodeProto] = {}  # a SequenceAt's output -> the node computing it
    for node in graph.node:
        if node.op_type != "SplitToSequence" or node.domain not in DEFAULT_DOMAINS:
            continue
        items = readers.get(node.output[0], [])
        if not items or node.output[0] in outputs or any(r.op_type != "SequenceAt" for r in items):
            continue
        positions = [int_constant(inits, r.input[1]) for r in items]
        if any(p is None for p in positions):
            continue
        if values is None:
            values = inferred_values(model)
        shape = value_shape(values[node.input[0]]) if node.input[0] in values else None
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if shape is None:
            continue
        axis = int(attrs.get("axis", 0)) % len(shape)
        size = shape[axis]
        split = node.input[1] if len(node.input) > 1 else ""
        if split and split not in inits:
            continue
        given = numpy_helper.to_array(inits[split]) if split else np.zeros(0)
        sizes = [int(v) for v in given.reshape(-1)]
        if split and given.ndim == 0:  # a scalar: equal pieces, the last one shorter
            sizes = [int(sizes[0])] * (-(-size // int(sizes[0])))
            sizes[-1] = size - int(sizes[0]) * (len(sizes) - 1)
        squeeze = not split and attrs.get("keepdims", 1) == 0
        sizes = sizes or [1] * size
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int).tolist()
        base = node.name or node.output[0]
        for reader, position in zip(items, positions, strict=True):
            index = position % len(sizes)
            out = reader.output[0]
            if squeeze:
                picked = fresh(f"{base}_item_{index}")
                graph.initializer.append(numpy_helper.from_array(np.array(index, np.int64), picked))
                replace[out] = onnx.helper.make_node(
                    "Gather", [node.input[0], picked], [out], name=reader.name or out, axis=axis
                )
                continue
            bounds = [fresh(f"{base}_{tag}_{index}") for tag in ("start", "end", "axis")]
            for name, value in zip(bounds, (starts[index], starts[index + 1], axis), strict=True):
                graph.initializer.append(numpy_helper.from_array(np.array([value], np.int64), name))
            replace[out] = onnx.helper.make_node(
                "Slice", [node.input[0], *bounds], [out], name=reader.name or out
            )
        details.append(
            f"{node_label(node)}: {len(items)} item(s) read at constant positions -> "
            + ("Gather" if squeeze else "Slice")
        )
    if replace:
        nodes = [replace.get(n.output[0], n) if n.output else n for n in graph.node]
        set_nodes(graph, nodes)
        remove_dead_nodes(graph)
    return checked_change(model, "sequence_at_to_slices", details)


def drop_empty_concat_inputs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Concat inputs with no elements along its axis -> left out (a Concat of one input left
    -> that input); what computed only them goes.

    The same tensor. A streaming model exported with a cache of length 0 (``x[:, :0]`` joined
    to the new frame) carries an empty tensor, which the QNN EP cannot hold: the Slice making
    it stayed on the CPU with its Q/DQ and cut the graph in two (LiSenNet).
    """
    model = writable(model)
    graph = model.graph
    concats = [
        i for i, n in enumerate(graph.node) if n.op_type == "Concat" and n.domain in DEFAULT_DOMAINS
    ]
    if not concats:
        return checked_change(model, "drop_empty_concat_inputs", [])
    values = inferred_values(model)
    outputs = {o.name for o in graph.output}
    renames: dict[str, str] = {}
    bypassed: set[int] = set()
    details = []
    for position in concats:
        node = graph.node[position]
        shapes = [value_shape(values[i]) if i in values else None for i in node.input]
        if any(shape is None for shape in shapes):
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        kept = [
            name
            for name, shape in zip(node.input, shapes, strict=True)
            if shape is not None and shape[axis % len(shape)] != 0
        ]
        if len(kept) == len(node.input) or not kept:
            continue
        details.append(f"{node_label(node)}: {len(node.input) - len(kept)} empty input(s) left out")
        if len(kept) > 1 or node.output[0] in outputs:
            del node.input[:]
            node.input.extend(kept)
            if len(kept) == 1:
                node.op_type = "Identity"
                del node.attribute[:]
            continue
        renames[node.output[0]] = kept[0]
        bypassed.add(position)
    if details:
        bypass_nodes(graph, bypassed, renames)
        remove_dead_nodes(graph)  # what computed only the empty inputs
    return checked_change(model, "drop_empty_concat_inputs", details)


HYPOT_EPS = 1e-12  # keeps max(|a|, |b|) = 0 from dividing 0 by 0 in the float model
# sqrt(a*a + b*b + c) with 0 <= c <= this is taken as hypot(a, b): off by at most sqrt(c) = 1e-4
# absolute (GTCRN adds 1e-12 to keep the gradient of its |STFT| finite).
HYPOT_MAX_FLOOR = 1e-8


def _hypot_floor(add: onnx.NodeProto, inits: Mapping[str, onnx.TensorProto]) -> str | None:
    """The other operand of ``add`` when one operand is a tiny constant c (0 <= c <= 1e-8)."""
    for index in (0, 1):
        value = scalar_const(inits, add.input[index])
        if value is not None and 0.0 <= value <= HYPOT_MAX_FLOOR:
            return add.input[1 - index]
    return None


def _hypot_nodes(
    a: str, b: str, out: str, base: str, fresh: Callable[[str], str]
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """``out`` = m * Sqrt(1 + (n / (m + eps))**2), m = Max(|a|,|b|), n = Min(|a|,|b|)."""
    t = {k: fresh(f"{base}_hypot_{k}") for k in ("abs_a", "abs_b", "m", "n", "den", "r")}
    t |= {k: fresh(f"{base}_hypot_{k}") for k in ("r2", "sum", "root", "eps", "one")}
    constants = [
        numpy_helper.from_array(np.array(HYPOT_EPS, np.float32), t["eps"]),
        numpy_helper.from_array(np.array(1.0, np.float32), t["one"]),
    ]
    make = onnx.helper.make_node
    nodes = [
        make("Abs", [a], [t["abs_a"]], name=fresh(f"{base}_hypot_abs_a")),
        make("Abs", [b], [t["abs_b"]], name=fresh(f"{base}_hypot_abs_b")),
        make("Max", [t["abs_a"], t["abs_b"]], [t["m"]], name=fresh(f"{base}_hypot_max")),
        make("Min", [t["abs_a"], t["abs_b"]], [t["n"]], name=fresh(f"{base}_hypot_min")),
        make("Add", [t["m"], t["eps"]], [t["den"]], name=fresh(f"{base}_hypot_den")),
        make("Div", [t["n"], t["den"]], [t["r"]], name=fresh(f"{base}_hypot_ratio")),
        make("Mul", [t["r"], t["r"]], [t["r2"]], name=fresh(f"{base}_hypot_r2")),
        make("Add", [t["r2"], t["one"]], [t["sum"]], name=fresh(f"{base}_hypot_sum")),
        make("Sqrt", [t["sum"]], [t["root"]], name=fresh(f"{base}_hypot_root")),
        make("Mul", [t["m"], t["root"]], [out], name=base),
    ]
    return nodes, constants


def _reduce_l2_pair(
    node: onnx.NodeProto,
    inits: Mapping[str, onnx.TensorProto],
    values: Mapping[str, onnx.ValueInfoProto],
) -> int | None:
    """The axis of a float ReduceL2 that reduces exactly one axis, of size 2 (a complex
    value's real and imaginary parts, as speech models store |STFT|); else None."""
    value = values.get(node.input[0])
    shape = value_shape(value) if value is not None else None
    if shape is None or value.type.tensor_type.elem_type != _FLOAT:
        return None
    axes = None
    if len(node.input) > 1 and node.input[1] in inits:
        axes = numpy_helper.to_array(inits[node.input[1]]).reshape(-1).tolist()
    else:
        axes = next((list(a.ints) for a in node.attribute if a.name == "axes"), None)
    if axes is None or len(axes) != 1:
        return None
    axis = int(axes[0]) % len(shape)
    return axis if shape[axis] == 2 else None


def _hypot_of_pair(
    node: onnx.NodeProto, axis: int, fresh: Callable[[str], str]
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """ReduceL2 over ``axis`` (size 2) as a Split into its two halves and the hypot form."""
    base = node.name or node.output[0]
    keepdims = next((a.i for a in node.attribute if a.name == "keepdims"), 1)
    a, b = fresh(f"{base}_hypot_a"), fresh(f"{base}_hypot_b")
    split = onnx.helper.make_node(
        "Split",
        [node.input[0]],
        [a, b],
        name=fresh(f"{base}_hypot_split"),
        axis=axis,
        num_outputs=2,
    )
    if keepdims:
        nodes, constants = _hypot_nodes(a, b, node.output[0], base, fresh)
        return [split, *nodes], constants
    kept = fresh(f"{base}_hypot_kept")
    nodes, constants = _hypot_nodes(a, b, kept, fresh(f"{base}_hypot"), fresh)
    axes = fresh(f"{base}_hypot_axes")
    constants.append(numpy_helper.from_array(np.array([axis], np.int64), axes))
    squeeze = onnx.helper.make_node("Squeeze", [kept, axes], [node.output[0]], name=base)
    return [split, *nodes, squeeze], constants


def rewrite_hypot(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Sqrt(a*a + b*b) -> m * Sqrt(1 + (n / (m + eps))**2), m = Max(|a|,|b|), n = Min(|a|,|b|).

    Why: a magnitude (|STFT| in audio front ends) quantized through its squares loses every
    small value. The squares span the square of the data's dynamic range: silero's spectrum
    reaches 755 as a square, so a 16-bit step is 0.012 and Sqrt turns that into errors up to
    0.08 on bins worth ~0.01 (29 dB at the Sqrt, 16 dB at the model output). In this form
    every intermediate keeps the data's own range (|a|, |b|, m) or lies in [0, 2]. Equal in
    float up to ``HYPOT_EPS``; only fires when the squares and the sum have no other reader.
    A tiny constant under the root (sqrt(a*a + b*b + 1e-12), <= ``HYPOT_MAX_FLOOR``) is dropped.
    A ReduceL2 over an axis of 2 (the same magnitude of a [..., 2] real/imaginary tensor) gets
    the same form: in fp16 its squares underflow below |x| ~ 2.4e-4 (FastEnhancer's power-law
    compression |X|^0.3 then read 0 for every quiet bin: -8 dB on the HTP in fp16).
    """
    model = writable(model)
    graph = model.graph
    used = used_names(graph)
    inits = initializers_by_name(graph)
    # Indices, not the node wrappers: protobuf hands out fresh ones for the same node.
    nodes_in = list(graph.node)
    producer = {o: i for i, n in enumerate(nodes_in) for o in n.output}
    fresh = FreshNames(model)
    details = []
    replace: dict[int, list[onnx.NodeProto]] = {}
    drop: set[int] = set()
    constants: list[onnx.TensorProto] = []
    values: dict[str, onnx.ValueInfoProto] | None = None
    for position, node in enumerate(nodes_in):
        if node.op_type == "ReduceL2" and node.domain in DEFAULT_DOMAINS:
            if values is None:
                values = inferred_values(model)
            pair = _reduce_l2_pair(node, inits, values)
            if pair is not None:
                replace[position], consts = _hypot_of_pair(node, pair, fresh)
                constants += consts
                details.append(f"{node_label(node)}: L2 norm over an axis of 2 -> hypot form")
            continue
        if node.op_type != "Sqrt" or node.domain not in DEFAULT_DOMAINS:
            continue
        at_add = producer.get(node.input[0])
        add = nodes_in[at_add] if at_add is not None else None
        if add is None or add.op_type != "Add" or used[add.output[0]] != 1:
            continue
        floor_add = _hypot_floor(add, inits)  # sqrt(a*a + b*b + tiny): the tiny term goes
        if floor_add is not None:
            at_floor, at_add = at_add, producer.get(floor_add)
            add = nodes_in[at_add] if at_add is not None else None
            if add is None or add.op_type != "Add" or used[add.output[0]] != 1:
                continue
        else:
            at_floor = None
        at_squares = [producer.get(name) for name in add.input]
        if any(i is None for i in at_squares):
            continue
        squares = [nodes_in[i] for i in at_squares if i is not None]
        if not all(
            sq.op_type == "Mul" and sq.input[0] == sq.input[1] and used[sq.output[0]] == 1
            for sq in squares
        ):
            continue
        a, b = squares[0].input[0], squares[1].input[0]
        nodes, consts = _hypot_nodes(a, b, node.output[0], node.name or node.output[0], fresh)
        replace[position] = nodes
        constants += consts
        drop |= {at_add, *(i for i in at_squares if i is not None)}
        if at_floor is not None:
            drop.add(at_floor)
        details.append(f"{node_label(node)}: sqrt({a}^2 + {b}^2) -> hypot form")
    if details:
        nodes: list[onnx.NodeProto] = []
        for i, node in enumerate(nodes_in):
            if i not in drop:
                nodes.extend(replace.get(i, [node]))
        set_nodes(graph, nodes)
        graph.initializer.extend(constants)
        sort_graph(graph)
    return checked_change(model, "rewrite_hypot", details)


def rewrite_reciprocal(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Reciprocal(x) -> Div(1, x), for float32 x.

    Why: QNN HTP's quantized 16-bit Reciprocal is wrong when the input range lies below 1
    (measured, QNN 2.51 HTP simulator: x in [0.0011, 0.2] gives 1/x divided by 5 exactly, 2 dB
    against the CPU QDQ model; ranges reaching 1 or more are right). magika's LayerNorm
    computes 1/sqrt(var) that way, and its ctx model fell to 6 dB. Div(1, x) is exact there
    (73 dB). Same value in float.
    """
    model = writable(model)
    graph = model.graph
    targets = [
        i
        for i, node in enumerate(graph.node)
        if node.op_type == "Reciprocal" and node.domain in DEFAULT_DOMAINS
    ]
    if not targets:
        return checked_change(model, "rewrite_reciprocal", [])
    values = inferred_values(model)
    fresh = FreshNames(model)
    one = fresh("reciprocal_one")
    details = []
    for i in targets:
        node = graph.node[i]
        value = values.get(node.input[0])
        if value is None or value.type.tensor_type.elem_type != _FLOAT:
            continue
        x = node.input[0]
        node.op_type = "Div"
        del node.input[:]
        node.input.extend([one, x])
        details.append(f"{node_label(node)}: Reciprocal({x}) -> Div(1, {x})")
    if details:
        graph.initializer.append(numpy_helper.from_array(np.array(1.0, np.float32), one))
    return checked_change(model, "rewrite_reciprocal", details)


# --------------------------------------------------------------------------------------------
# 7. onnxruntime's QNN preprocessing


# Shape inference's words when a layer's weights do not take the size that reaches them: with
# static input sizes from the config, the sizes given are the usual cause (a madmom BLSTM given
# 314 spectrogram bins where its Gemm takes 266).
_SIZE_MISMATCH = ("Dimension mismatch", "Incompatible dimensions")
_SIZE_MISMATCH_TIP = (
    "A layer does not take the size that reaches it (the message names the node and both "
    "sizes): check the sizes [inputs] dims/shapes give the inputs against what the model was "
    "exported for (channels, features, sequence length)."
)


# Ops that broadcast their inputs numpy-style: a [1] constant read by one of them is the same as
# a scalar wherever another input has rank 1 or more.
_BROADCASTING = frozenset(
    [
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Pow",
        "Max",
        "Min",
        "Sum",
        "Mean",
        "Mod",
        "PRelu",
        "Equal",
        "Less",
        "Greater",
        "LessOrEqual",
        "GreaterOrEqual",
        "And",
        "Or",
        "Xor",
        "Where",
    ]
)
_FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE)


def scalar_shaped_constants(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Float constants of shape [1] read only where a scalar means the same -> shape [].

    A [1] constant broadcast against a tensor of rank >= 1 gives what a scalar gives, and a
    Clip's bounds are scalars by the spec (onnxruntime takes [1]). But onnxruntime's
    ``qnn_preprocess_model`` reads a LayerNorm's epsilon with ``float()``, which numpy 2 refuses
    for a [1] array ("only 0-dimensional arrays can be converted to Python scalars": a
    DistilBERT whose scalars were stored as [1] could not be built). Only where every reader
    is such an op and every other input it broadcasts with has a known rank of 1 or more.
    """
    graph = model.graph
    inits = initializers_by_name(graph)
    io = {v.name for v in (*graph.input, *graph.output)}
    candidates = {
        name
        for name, tensor in inits.items()
        if list(tensor.dims) == [1] and tensor.data_type in _FLOAT_TYPES and name not in io
    }
    if not candidates:
        return model, Change("scalar_shaped_constants")
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for index, name in enumerate(node.input):
            if name in candidates:
                readers.setdefault(name, []).append((node, index))
    for sub in all_graphs(graph):
        if sub is not graph:  # read inside a subgraph: left as it is
            for node in sub.node:
                candidates.difference_update(node.input)
    values: dict[str, onnx.ValueInfoProto] | None = None

    def rank(name: str) -> int | None:
        nonlocal values
        if name in inits:
            return len(inits[name].dims)
        if values is None:
            values = inferred_values(model)
        value = values.get(name)
        if value is None or not value.type.tensor_type.HasField("shape"):
            return None
        return len(value.type.tensor_type.shape.dim)

    def as_scalar(node: onnx.NodeProto, index: int) -> bool:
        if node.domain not in DEFAULT_DOMAINS:
            return False
        if node.op_type == "Clip":
            return index in (1, 2)
        if node.op_type not in _BROADCASTING or (node.op_type == "Where" and index == 0):
            return False
        others = [name for i, name in enumerate(node.input) if i != index and name]
        return bool(others) and all((rank(name) or 0) >= 1 for name in others)

    chosen = sorted(
        name
        for name in candidates
        if readers.get(name) and all(as_scalar(node, index) for node, index in readers[name])
    )
    if not chosen:
        return model, Change("scalar_shaped_constants")
    model = copy_model(model)
    for tensor in model.graph.initializer:
        if tensor.name in chosen:
            del tensor.dims[:]
    kept = [v for v in model.graph.value_info if v.name not in chosen]  # their old [1] shape
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept)
    return checked_change(
        model, "scalar_shaped_constants", [f"{name}: [1] -> a scalar" for name in chosen]
    )


def qnn_preprocess(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """onnxruntime's ``qnn_preprocess_model``: fuses Gelu, LpNormalization, SpaceToDepth and
    (opset >= 17) LayerNormalization sequences into single ops QNN has kernels for.

    It crashes on models with ``metadata_props`` (onnxruntime 1.24-1.31, "cannot convert
    dictionary update sequence element #0"), so they are stripped around the call and restored.
    It only takes a file path for its output, hence the temporary folder.
    """
    import logging
    from pathlib import Path

    from onnxruntime.quantization.execution_providers.qnn import qnn_preprocess_model

    from ..core.fileio import pid_scratch

    work = copy_model(model)
    metadata = [(p.key, p.value) for p in work.metadata_props]
    del work.metadata_props[:]
    before = Counter(n.op_type for n in work.graph.node)
    unnamed = sum(1 for n in work.graph.node if not n.name and n.op_type != "Constant")
    logger = logging.getLogger()
    level = logger.level
    logger.setLevel(logging.ERROR)  # it warns once per unnamed node
    try:
        with pid_scratch("pipeline-qnnprep-") as tmp:  # a killed run's is swept next time
            out = Path(tmp) / "preprocessed.onnx"
            try:
                # It saves its input with external data, which rewrites the proto in place.
                modified = qnn_preprocess_model(
                    copy_model(work), out, fuse_layernorm=opset_version(work) >= 17
                )
            except Exception as exc:  # onnxruntime's errors are untyped
                sizes = any(word in str(exc) for word in _SIZE_MISMATCH)
                raise ModelError(
                    f"onnxruntime qnn_preprocess_model failed: {exc}",
                    tip=_SIZE_MISMATCH_TIP if sizes else None,
                ) from exc
            result = onnx.load(out) if modified else work
    finally:
        logger.setLevel(level)
    del result.metadata_props[:]
    onnx.helper.set_model_props(result, dict(metadata))
    result.ir_version = model.ir_version
    if modified:
        _own_minted_names(work, result)
    # onnxruntime writes an import for every domain it knows; keep the original ones plus any
    # domain a node really uses.
    used = {n.domain for g in all_graphs(result.graph) for n in g.node}
    known = {o.domain for o in model.opset_import}
    imports = [o for o in result.opset_import if o.domain in known or o.domain in used]
    if len(imports) != len(result.opset_import):
        kept = [onnx.OperatorSetIdProto(domain=o.domain, version=o.version) for o in imports]
        del result.opset_import[:]
        result.opset_import.extend(kept)
    details = []
    if modified:
        after = Counter(n.op_type for n in result.graph.node)
        for op in sorted(set(before) | set(after)):
            if before[op] != after[op]:
                details.append(f"{op}: {before[op]} -> {after[op]} node(s)")
        if unnamed:
            details.append(f"named {unnamed} unnamed node(s)")
    return checked_change(result, "qnn_preprocess", details)


def _own_minted_names(before: onnx.ModelProto, after: onnx.ModelProto) -> None:
    """The tensors onnxruntime's optimizer added to ``after`` renamed under "qnn_preprocess/".

    Why: its MatMul+Add -> Gemm fusion names its shape constants gemm_input_shape,
    gemm_input_shape_token_0, ... and does so again at every later session load, for the pairs
    the first pass left, without looking at the initializers already there: "AddInitializedOrtValue
    Attempt to replace the existing tensor", and the prepared model no longer loaded (a BERT
    exported at opset 23 once its Attention ops were written out: the feed-forward pairs fused
    here, the projections at load)."""
    known = {i.name for i in before.graph.initializer} | {i.name for i in before.graph.input}
    known |= {o for n in before.graph.node for o in n.output}
    minted = {i.name for i in after.graph.initializer} | {
        o for n in after.graph.node for o in n.output
    }
    mapping = {name: f"qnn_preprocess/{name}" for name in sorted(minted - known) if name}
    rename_tensors(after.graph, mapping)


# The ops whose input 2 onnxruntime's QDQ quantizer quantizes as a bias (operators/conv.py,
# gemm.py, norm.py): a bias shared between them is copied under a name that may be taken.
_BIASED_OPS = frozenset(
    {
        "Conv",
        "ConvTranspose",
        "Gemm",
        "InstanceNormalization",
        "LayerNormalization",
        "BatchNormalization",
    }
)


def unshare_biases(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Give every Conv, ConvTranspose, Gemm and normalization its own bias initializer.

    onnxruntime's QDQ quantizer copies a bias that several nodes share (each gets its own
    scale) and names the copy ``<bias><n>`` after the initializers only: TensorFlow exports
    name a Conv's output ``<bias>2`` (``conv1d_25`` and ``conv1d_252`` in Spotify's
    basic-pitch), the copy takes that name, the graph is rewired to it and the QDQ model does
    not load ("Invalid attribute perm {0, 2, 3, 1}, input shape = {36}"); the dynamo
    exporter's GroupNorm is an InstanceNormalization whose bias ``val_11`` all 24 of a
    PoolFormer's share, and its copy ``val_114`` is an activation's name ("Quantization
    parameter shared mode is not supported for weight yet"). A copy named here collides with
    nothing; the values are the same.
    """
    model = writable(model)
    graph = model.graph
    inits = initializers_by_name(graph)
    fresh = FreshNames(model)
    seen: set[str] = set()
    details = []
    for node in graph.node:
        if node.op_type not in _BIASED_OPS or len(node.input) < 3:
            continue
        bias = node.input[2]
        if node.domain not in DEFAULT_DOMAINS or bias not in inits:
            continue
        if bias not in seen:
            seen.add(bias)
            continue
        copy = onnx.TensorProto()
        copy.CopyFrom(inits[bias])
        copy.name = fresh(f"{bias}_{node.name or node.output[0]}")
        graph.initializer.append(copy)
        node.input[2] = copy.name
        details.append(f"{node_label(node)}: its own copy of the bias {bias!r}")
    return checked_change(model, "unshare_biases", details)


def flatten_gemm_biases(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A Gemm's broadcast bias ([1, N], [1, 1], [1] or a scalar) -> one value per column, [N].

    onnxruntime's quantizer reads a Gemm's C as one bias value per output channel: with int8
    per-column weights it indexes C by column and fails on any other shape ("The truth value
    of an array with more than one element is ambiguous"; a Keras LSTM step's MatMul + Add,
    fused into Gemm by qnn_preprocess_model, has a [1, 4 * units] bias). Gemm broadcasts C to
    [M, N], so [N] computes the same.
    """
    model = writable(model)
    graph = model.graph
    inits = initializers_by_name(graph)
    fresh = FreshNames(model)
    details = []
    for node in graph.node:
        if node.op_type != "Gemm" or node.domain not in DEFAULT_DOMAINS or len(node.input) < 3:
            continue
        weight, bias = inits.get(node.input[1]), inits.get(node.input[2])
        if weight is None or bias is None or len(weight.dims) != 2:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        columns = weight.dims[0] if attrs.get("transB", 0) else weight.dims[1]
        dims = list(bias.dims)
        if (
            dims == [columns]
            or math.prod(dims) not in (1, columns)
            or any(d != 1 for d in dims[:-1])
        ):
            continue
        value = numpy_helper.to_array(bias).reshape(-1)
        flat = numpy_helper.from_array(
            np.broadcast_to(value, (columns,)).copy(), fresh(f"{bias.name}_per_column")
        )
        graph.initializer.append(flat)
        node.input[2] = flat.name
        details.append(f"{node_label(node)}: bias {bias.name!r} {dims} -> [{columns}]")
    return checked_change(model, "flatten_gemm_biases", details)


def gemm_computed_bias_as_add(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A Gemm whose C is computed (not an initializer) -> the Gemm without C, then an Add of C
    (times beta): the same values, C broadcast to the product's [M, N] as Gemm does.

    qnn_preprocess_model's optimizer fuses MatMul + Add into a Gemm whatever the Add's other
    input is; quantized, the QNN EP then leaves that Gemm's weight DequantizeLinear on the CPU
    (a recurrent cell's input MatMul plus its state term: 1 CPU node, and the HTP judge fell
    back to fp16). Gemm(A, B) + Add runs whole on the HTP. A C computed from constants alone
    stays (a pre-quantized model's bias, DequantizeLinear of its int32 values).
    """
    model = writable(model)
    graph = model.graph
    constant = set(initializers_by_name(graph))
    for node in graph.node:  # in graph order: what only constants feed is constant
        if all(name in constant for name in node.input if name):
            constant.update(node.output)
    fresh = FreshNames(model)
    nodes: list[onnx.NodeProto] = []
    details = []
    for node in graph.node:
        computed = (
            node.op_type == "Gemm"
            and node.domain in DEFAULT_DOMAINS
            and len(node.input) >= 3
            and node.input[2] != ""
            and node.input[2] not in constant
        )
        if not computed:
            nodes.append(node)
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        beta = float(attrs.pop("beta", 1.0))
        bias, output = node.input[2], node.output[0]
        product = fresh(f"{output}_product")
        nodes.append(
            onnx.helper.make_node(
                "Gemm", list(node.input[:2]), [product], name=node.name or fresh("gemm"), **attrs
            )
        )
        if beta != 1.0:
            factor, scaled = fresh(f"{bias}_beta"), fresh(f"{bias}_times_beta")
            graph.initializer.append(numpy_helper.from_array(np.array(beta, np.float32), factor))
            nodes.append(onnx.helper.make_node("Mul", [bias, factor], [scaled], name=scaled))
            bias = scaled
        nodes.append(
            onnx.helper.make_node("Add", [product, bias], [output], name=fresh(f"{output}_add"))
        )
        details.append(f"{node_label(node)}: its computed C {node.input[2]!r} added after it")
    if details:
        del graph.node[:]
        graph.node.extend(nodes)
    return checked_change(model, "gemm_computed_bias_as_add", details)


def argmax_without_keepdims(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """ArgMax/ArgMin with keepdims=1 (ONNX's default) -> the same op with keepdims=0 and an
    Unsqueeze of its axis: the same int64 indices, the same shape.

    The QNN EP compiles the keepdims form, and its context then fails every run ("ORT Tensor
    data size does not match QNN tensor data size"; onnxruntime's retry on the CPU alone used
    to hide that behind "EPContext node ... is not compatible with any execution provider")
    when the indices are a graph output, also through an Identity (measured on the simulator:
    a segmenter's class map, a classifier's top-1); without keepdims, and with the Unsqueeze
    after it, the context runs and its indices match the CPU's.
    """
    model = writable(model)
    graph = model.graph
    fresh = FreshNames(model)
    nodes: list[onnx.NodeProto] = []
    details = []
    for node in graph.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if (
            node.op_type not in ("ArgMax", "ArgMin")
            or node.domain not in DEFAULT_DOMAINS
            or attrs.get("keepdims", 1) == 0
        ):
            nodes.append(node)
            continue
        axis = int(attrs.get("axis", 0))
        reduced, axes = fresh(f"{node.output[0]}_reduced"), fresh(f"{node.output[0]}_axis")
        graph.initializer.append(numpy_helper.from_array(np.array([axis], np.int64), axes))
        kept = {k: v for k, v in attrs.items() if k != "keepdims"}
        nodes += [
            onnx.helper.make_node(
                node.op_type, [node.input[0]], [reduced], name=node.name, keepdims=0, **kept
            ),
            onnx.helper.make_node(
                "Unsqueeze",
                [reduced, axes],
                [node.output[0]],
                name=fresh(f"{node.name or node.output[0]}_keepdims"),
            ),
        ]
        details.append(f"{node_label(node)}: keepdims=1 -> keepdims=0 + Unsqueeze(axis {axis})")
    if not details:
        return model, Change("argmax_without_keepdims")
    set_nodes(graph, nodes)
    return checked_change(model, "argmax_without_keepdims", details)


# (input channels, kernel height, kernel width) of the Convs whose own padding the HTP gets
# wrong. Measured on the simulator over kernels 3-13, 1-16 input channels and pads 1-5: only
# this one (the first and last layers of Johnson-style style transfer and SRCNN-like nets).
_MISPADDED_CONV = (3, 9, 9)


def explicit_conv_pads(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A padded Conv of a 9x9 kernel over 3 input channels -> a Pad of zeros and the Conv
    without pads: the same sums over the same zeros.

    Why: on the HTP such a Conv with its own padding computes garbage wherever its input's
    zero point is not 0 (a 16-bit input centred at 32768: 3 dB against the CPU; uint8 at 128:
    3.6 dB; measured on the simulator, in QNN 2.51), while the same Conv after an explicit Pad
    agrees (78 and 64 dB). WinML's fast-neural-style models (candy, udnie): 19.1 dB vs float
    on the HTP, 42 dB with this Conv in fp16. The Pad writes zeros, which the quantized graph
    holds exactly at the zero point. A pre-quantized model keeps its Convs: a Pad between its
    own DQ and Conv would end the unit the CPU computes in integers (another rounding).
    """
    from .prequantized import is_prequantized

    model = writable(model)
    if is_prequantized(model):
        return model, Change("explicit_conv_pads")
    graph = model.graph
    inits = initializers_by_name(graph)
    fresh = FreshNames(model)
    nodes: list[onnx.NodeProto] = []
    details = []
    for node in graph.node:
        nodes.append(node)
        if node.op_type != "Conv" or node.domain not in DEFAULT_DOMAINS or len(node.input) < 2:
            continue
        weight = inits.get(node.input[1])
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        pads = [int(p) for p in attrs.get("pads", [])]
        if (
            weight is None
            or tuple(weight.dims[1:]) != _MISPADDED_CONV
            or int(attrs.get("group", 1)) != 1
            or attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET")
            or not any(pads)
        ):
            continue
        pad_first_input(graph, nodes, node, pads, fresh)
        replace_attributes(node, ("pads",))
        details.append(f"{node_label(node)}: pads {pads} -> a Pad of zeros before it")
    if not details:
        return model, Change("explicit_conv_pads")
    set_nodes(graph, nodes)
    return checked_change(model, "explicit_conv_pads", details)


# A Conv of this kernel at stride 2 comes out of the HTP wrong (measured on the simulator, QNN
# 2.51, uint16 and fp16; uint8 right): depthwise over 32 channels or more at any size, and with
# 32 input channels or more where its windows leave input columns unread (20x20 -> 6x6: 1.5 dB;
# 21x21, which they tile exactly, right). 16-24 channels, kernels 3-8 and 10-33 at strides 2-4,
# 9x9 at strides 1, 3, 4 or (2, 1), 9x3 and 9x1 are right. Widened whatever its channels: exact.
_MISSTRIDED_KERNEL = ((9, 9), (2, 2))


def widen_9x9_stride_2(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A Conv with a 9x9 kernel at stride 2 -> the same kernel inside an 11x11 one of zeros,
    with one more pad on every side: the same sums, exactly.

    Why: on the HTP that Conv computes garbage over 32 channels or more (a depthwise one:
    -0.1 dB against the CPU over 14x14 inputs, -16.8 over 28x28, measured in fp16; a full one
    whose windows do not tile its input: 1.2 dB, quantized and in fp16); the 11x11 one is
    right (68.9 dB). MixNet's mixed depthwise convolutions use 3x3 to 11x11 kernels side by
    side (timm's tf_mixnet_s: the whole model 12.7 dB in fp16, its first stride-2 9x9 at -0.0
    dB; widened, 40.6 dB); a capsule network's primary capsules are a 9x9 stride-2 Conv of a
    20x20 map (the whole network 2.5 dB in fp16; widened, 26.1 dB)."""
    model = writable(model)
    graph = model.graph
    inits = initializers_by_name(graph)
    fresh = FreshNames(model)
    details = []
    for node in graph.node:
        if node.op_type != "Conv" or node.domain not in DEFAULT_DOMAINS or len(node.input) < 2:
            continue
        weight = inits.get(node.input[1])
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        kernel, strides = _MISSTRIDED_KERNEL
        if (
            weight is None
            or len(weight.dims) != 4
            or tuple(weight.dims[2:]) != kernel
            or tuple(int(v) for v in attrs.get("strides", [1, 1])) != strides
            or any(int(v) != 1 for v in attrs.get("dilations", [1, 1]))
            or attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET")
        ):
            continue
        values = numpy_helper.to_array(weight)
        wide = np.zeros((*values.shape[:2], kernel[0] + 2, kernel[1] + 2), values.dtype)
        wide[:, :, 1:-1, 1:-1] = values
        name = fresh(f"{node.input[1]}_11x11")
        graph.initializer.append(numpy_helper.from_array(wide, name))
        pads = [int(p) + 1 for p in attrs.get("pads", [0, 0, 0, 0])]
        node.input[1] = name
        replace_attributes(node, ("kernel_shape", "pads"), kernel_shape=[11, 11], pads=pads)
        kind = "depthwise" if int(attrs.get("group", 1)) == weight.dims[0] > 1 else "Conv"
        details.append(f"{node_label(node)}: 9x9 {kind} at stride 2 -> 11x11, pads {pads}")
    if not details:
        return model, Change("widen_9x9_stride_2")
    remove_dead_nodes(graph)  # the 9x9 weights, unless another node reads them
    return checked_change(model, "widen_9x9_stride_2", details)


def pads_as_concat(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A constant-mode Pad the HTP writes wrongly -> a Concat of its input with constant blocks
    of the pad value along each padded axis: the same tensor, exactly. A Concat with a
    constant is what the HTP writes right (measured in every case below).

    Why: on the simulator (QNN 2.51), in fp16,
    - a Pad at the end of the last axis of a rank-3 or rank-4 tensor (begin 0 there: padding a
      time axis up to whole frames, "same" padding of a width): 4.5-16.6 dB against the CPU
      over [1, 8, 100], [1, 64, 100], [1, 8, 16, 16], [1, 16, 16, 8] (right at rank 2 and 5,
      and with a begin pad on that axis). Quantized, the same Pads came out right; the Pads
      before a Conv or a pool fold into it first (``legacy.fold_pad_into_conv``);
    - a Pad of a Slice's or a Split's output, fp16 and quantized alike, where the sliced tensor
      is a Transpose's output another Slice reads: the padded entries hold whatever follows the
      slice in memory. EfficientViT's linear attention (timm ``LiteMLA``) pads its value slice
      with ones to get the softmax-free normalizer in the same MatMul; on the simulator the
      normalizer came out as garbage and the model at -0.7 dB vs float, the ctx of the Concat
      form agrees with the CPU at 64 dB.
    A Pad of anything else (both ends, or a Conv's input padding) stays a Pad.
    """
    return replace_nodes(passed_on(model), "pads_as_concat", _pad_as_concat)


def max_pool_pads_as_concat(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A constant Pad that only a MaxPool reads -> the Concat form of ``pads_as_concat``: the
    same tensor, exactly. Runs before ``qnn_preprocess``.

    Why: onnxruntime's PadFusion (in ``qnn_preprocess_model``'s optimizer, and in any session
    from the basic level up) folds a Pad of zeros into the MaxPool after it, whose own pads
    never win a max: where a window's values are all negative the result is that negative max
    instead of 0 (a Conv -> end Pad -> MaxPool block: up to 0.86-1.6 off ONNX's definition on
    normal inputs). ``legacy.fold_pad_into_pool`` folds the Pads where that is exact (-inf, or
    a ReLU's output); this keeps the rest out of PadFusion's reach (the Concat computes right
    on the HTP: 74 dB in fp16). The CPU sessions the pipeline measures with disable the fusion
    (``core.cpu.ONNX_EXACT``), so a source's reference follows ONNX too."""

    readers: dict[str, list[str]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node.op_type)

    def read_by_max_pool(pad: onnx.NodeProto) -> bool:
        return readers.get(pad.output[0]) == ["MaxPool"]

    return replace_nodes(
        model,
        "max_pool_pads_as_concat",
        lambda node, context: _pad_as_concat(node, context, read_by_max_pool),
    )


# Ranks at which the HTP pads the end of the last axis wrongly (fp16, QNN 2.51; 2 and 5 right).
_END_PADDED_RANKS = (3, 4)


def _pad_as_concat(
    node: onnx.NodeProto,
    context: NodeRewrite,
    only: Callable[[onnx.NodeProto], bool] | None = None,
) -> tuple[list[onnx.NodeProto], str] | None:
    """The Concat form of a Pad ``pads_as_concat`` takes or, with ``only``, of one it says."""
    if node.op_type != "Pad" or node.domain not in DEFAULT_DOMAINS:
        return None
    if only is not None and not only(node):
        return None
    mode = next((a.s.decode() for a in node.attribute if a.name == "mode"), "constant")
    source = context.producers.get(node.input[0])
    if mode != "constant" or (source is not None and source.op_type == "DequantizeLinear"):
        return None  # a pre-quantized model's own Pad: its rules fold it or write its 0 out
    data, out = node.input[0], node.output[0]
    inputs = [*node.input, "", "", ""][:4]
    shape, elem_type = context.shape(data), context.elem_type(data)
    if (
        shape is None
        or elem_type is None
        or inputs[1] not in context.inits
        or any(name and name not in context.inits for name in inputs[2:])
    ):
        return None
    pads = numpy_helper.to_array(context.inits[inputs[1]]).astype(np.int64).reshape(-1)
    rank = len(shape)
    axes = (
        [int(a) % rank for a in numpy_helper.to_array(context.inits[inputs[3]]).reshape(-1)]
        if inputs[3]
        else list(range(rank))
    )
    value = numpy_helper.to_array(context.inits[inputs[2]]) if inputs[2] else None
    dtype = onnx.helper.tensor_dtype_to_np_dtype(elem_type)
    fill = np.asarray(0 if value is None or value.size == 0 else value.reshape(-1)[0], dtype)
    if len(pads) != 2 * len(axes) or (pads < 0).any() or not pads.any():
        return None
    widened = [(axis, int(pads[i]), int(pads[i + len(axes)])) for i, axis in enumerate(axes)]
    widened = [(axis, before, after) for axis, before, after in widened if before or after]
    sliced = source is not None and source.op_type in ("Slice", "Split")
    end_of_last = rank in _END_PADDED_RANKS and any(
        axis == rank - 1 and not before for axis, before, _ in widened
    )
    if only is None and not (sliced or end_of_last):
        return None
    base = node.name or out
    nodes: list[onnx.NodeProto] = []
    current, running = data, list(shape)

    def block(width: int, axis: int, side: str) -> list[str]:
        """A constant of the pad value, ``width`` wide on ``axis`` (none when 0)."""
        if not width:
            return []
        shape = [*running[:axis], width, *running[axis + 1 :]]
        return [context.constant(np.full(shape, fill, dtype), f"{base}_{side}_{axis}")]

    for index, (axis, before, after) in enumerate(widened):
        last = index == len(widened) - 1
        joined = out if last else context.fresh(f"{base}_axis_{axis}")
        parts = [*block(before, axis, "before"), current, *block(after, axis, "after")]
        name = base if last else f"{base}_axis_{axis}"
        nodes.append(onnx.helper.make_node("Concat", parts, [joined], name=name, axis=axis))
        current, running[axis] = joined, running[axis] + before + after
    why = (
        "before a MaxPool"
        if only is not None
        else f"of {node_label(source)}'s output"
        if sliced
        else "at the end of its last axis"
    )
    return nodes, (
        f"{node_label(node)} {why}: "
        + ", ".join(f"axis {a} +{b}/+{c}" for a, b, c in widened)
        + f" of {fill.item():g} -> Concat with constants"
    )


def fuse_hardswish(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """x * HardSigmoid(x; alpha 1/6, beta 1/2) -> HardSwish(x) (opset >= 14), the same function
    by ONNX's definition of HardSwish.

    onnxruntime's ``qnn_preprocess_model`` writes every HardSwish out as that pair, as PyTorch
    exports nn.Hardswish below opset 14. The QNN EP fuses the pair itself, and in fp16 on the
    HTP the fused op computes x * x above 3 (measured: a PP-OCRv5 text detector's whole-fp16
    model at 0.9 dB, its first HardSwish 100x too large; the pair -30.6 dB alone, HardSwish
    72.4 dB). Quantized, both forms agree with the CPU.
    """
    model = writable(model)
    graph = model.graph
    if opset_version(model) < 14:
        return checked_change(model, "fuse_hardswish", [])
    # Indices, not the node wrappers: protobuf may hand out fresh ones for the same node.
    nodes = list(graph.node)
    producers = {o: i for i, n in enumerate(nodes) for o in n.output}
    readers = readers_by_tensor(graph)
    outputs = {o.name for o in graph.output}
    dropped: set[int] = set()
    replaced: dict[int, onnx.NodeProto] = {}
    details = []
    for position, node in enumerate(nodes):
        if node.op_type != "Mul" or node.domain not in DEFAULT_DOMAINS or len(node.input) != 2:
            continue
        for gate_name, x in (node.input, node.input[::-1]):
            at = producers.get(gate_name)
            gate = nodes[at] if at is not None else None
            if (
                gate is None
                or gate.op_type != "HardSigmoid"
                or gate.domain not in DEFAULT_DOMAINS
                or gate.input[0] != x
                or gate_name in outputs
                or len(readers.get(gate_name, [])) != 1
                or at in dropped
            ):
                continue
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in gate.attribute}
            if (
                abs(attrs.get("alpha", 0.2) - 1 / 6) > 1e-6
                or abs(attrs.get("beta", 0.5) - 0.5) > 1e-6
            ):
                continue
            dropped.add(at)
            replaced[position] = onnx.helper.make_node(
                "HardSwish", [x], [node.output[0]], name=node.name or gate.name
            )
            details.append(f"{node_label(node)} * {node_label(gate)} -> HardSwish")
            break
    if details:
        set_nodes(graph, [replaced.get(i, n) for i, n in enumerate(nodes) if i not in dropped])
    return checked_change(model, "fuse_hardswish", details)


def hardswish_from_clip(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """``x * Clip(x + 3, 0, 6) / 6`` (or ``* (1/6)``, or ``x * (Clip(x + 3, 0, 6) / 6)``)
    -> ``HardSwish(x)`` (opset >= 14): ONNX's definition of HardSwish, spelled out.

    Paddle2ONNX writes every hardswish so, and TF/Keras' ``x * relu6(x + 3) / 6`` is the same.
    Four ops become the HTP's one: quantized, three intermediate tensors less to round to 16
    bits; in fp16, a quarter of the ops to run. Measured side by side (QNN 2.51, simulator):
    PP-PicoDet-XS (78 of them) kept in fp16 30.47 -> 32.64 dB vs float and its judge 17.9 ->
    5.8 s; a PP-PicoDet layout detector as quantized 18.9 -> 21.3 dB (whole in fp16, the form
    it keeps, 43.6 -> 39.5 dB: not a gain everywhere); PP-OCR's classifier and recognizer (18
    each) 40.51 -> 40.04 and 28.30 -> 28.84 dB. A pre-quantized model keeps its spelled-out
    form: HardSwish rounds differently in float32, and the model's own Q/DQ make whole steps of
    that (an NNCF PP-PicoDet: 33.0 dB from itself, refused by the lossless check)."""
    from .prequantized import is_prequantized

    if opset_version(model) < 14 or is_prequantized(model):
        return checked_change(model, "hardswish_from_clip", [])
    graph = model.graph
    outputs = {o.name for o in graph.output}
    readers = readers_by_tensor(graph)

    def only_read_once(name: str) -> bool:
        return name not in outputs and len(readers.get(name, [])) == 1

    def scalar(ctx: NodeRewrite, name: str) -> float | None:
        """A one-element float constant (no broadcast that could change x's shape)."""
        init = ctx.inits.get(name)
        if init is None or math.prod(init.dims) != 1 or len(init.dims) > 1:
            return None
        return scalar_const(ctx.inits, name)

    def near(value: float | None, want: float) -> bool:
        return value is not None and abs(value - want) <= 1e-6 * abs(want)

    def made_by(ctx: NodeRewrite, name: str, op: str) -> onnx.NodeProto | None:
        node = ctx.producers.get(name)
        if node is None or node.op_type != op or node.domain not in DEFAULT_DOMAINS:
            return None
        return node if only_read_once(name) else None

    def sixth_of(ctx: NodeRewrite, node: onnx.NodeProto) -> str | None:
        """What ``node`` divides by 6 (a Div by 6 or a Mul by 1/6), else None."""
        if node.domain not in DEFAULT_DOMAINS or len(node.input) != 2:
            return None
        if node.op_type == "Div" and near(scalar(ctx, node.input[1]), 6.0):
            return node.input[0]
        if node.op_type == "Mul":
            for value, factor in (node.input, node.input[::-1]):
                if near(scalar(ctx, factor), 1 / 6):
                    return value
        return None

    def gated(ctx: NodeRewrite, name: str) -> str | None:
        """x when ``name`` is Clip(x + 3, 0, 6) read only here, else None."""
        clip = made_by(ctx, name, "Clip")
        if clip is None or len(clip.input) != 3:
            return None
        if scalar(ctx, clip.input[1]) != 0.0 or not near(scalar(ctx, clip.input[2]), 6.0):
            return None
        add = made_by(ctx, clip.input[0], "Add")
        if add is None:
            return None
        for x, three in (add.input, add.input[::-1]):
            if near(scalar(ctx, three), 3.0):
                return x
        return None

    def rewrite(node: onnx.NodeProto, ctx: NodeRewrite) -> tuple[list[onnx.NodeProto], str] | None:
        if node.domain not in DEFAULT_DOMAINS or node.op_type not in ("Div", "Mul"):
            return None
        pairs = []
        product = sixth_of(ctx, node)
        inner = made_by(ctx, product, "Mul") if product else None
        if inner is not None:  # (x * gate) / 6
            pairs += [inner.input, inner.input[::-1]]
        if node.op_type == "Mul":  # x * (gate / 6)
            for x, scaled in (node.input, node.input[::-1]):
                divide = ctx.producers.get(scaled)
                if divide is not None and only_read_once(scaled):
                    gate = sixth_of(ctx, divide)
                    if gate is not None:
                        pairs.append((x, gate))
        for x, gate in pairs:
            if gated(ctx, gate) == x:
                swish = onnx.helper.make_node(
                    "HardSwish", [x], [node.output[0]], name=ctx.fresh(f"{node.name}_hardswish")
                )
                return [swish], f"{node_label(node)}: x * Clip(x + 3, 0, 6) / 6 -> HardSwish"
        return None

    return replace_nodes(model, "hardswish_from_clip", rewrite)


# --------------------------------------------------------------------------------------------
# 8. order and shapes


def topological_sort(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Order nodes so each comes after its producers (ONNX requires it; Olive fails on silero
    without it). Subgraphs are sorted too; the original order is kept where possible."""
    model = writable(model)
    details = []
    for graph in all_graphs(model.graph):
        moved = sort_graph(graph)
        if moved:
            details.append(f"graph {graph.name!r}: {moved} node(s) reordered")
    return checked_change(model, "topological_sort", details)


def store_inferred_shapes(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Replace stored value_info and output shapes with what schema inference derives.

    Stale dynamic dims in graph outputs would make the QNN EP treat them as dynamic, and stored
    shapes that inference cannot justify hide real problems.
    """
    old = {o.name: value_shape(o) for o in model.graph.output}
    inferred = with_inferred_shapes(model)
    # Outputs inference cannot give a shape (a label lookup, an op it has no schema for) keep
    # their stored type: a graph output needs one, and the static-shape check names them.
    stored = {o.name: o.type for o in model.graph.output}
    for out in inferred.graph.output:
        untyped = out.type.HasField("tensor_type") and not out.type.tensor_type.HasField("shape")
        if (untyped or not out.type.WhichOneof("value")) and out.name in stored:
            out.type.CopyFrom(stored[out.name])
    details = []
    for out in inferred.graph.output:
        new = value_shape(out)
        if new != old.get(out.name):
            shown = list(new) if new is not None else "unknown"
            details.append(f"output {out.name!r} shape -> {shown}")
    return checked_change(inferred, "store_inferred_shapes", details)


# Ops that ONNX defines as a function of simpler ops and that the QNN EP cannot compile, measured
# on the simulator: Mish-18 ("Encountered an invalid node while compiling"; x * tanh(softplus(x))
# is whole and 49 dB in fp16), GroupNormalization-21 (its layout transform is refused), and
# ReduceSumSquare, ReduceL1, ReduceLogSum-18 (left on the CPU: an audio front end's power
# spectrum, re^2 + im^2 over one axis, cut a log-mel extractor in two partitions); Softsign (a
# Keras activation, and an RNN's), Celu-12 and Shrink stay on the CPU; MeanVarianceNormalization
# comes out of onnxruntime's qnn_preprocess_model with no type for shape inference;
# CenterCropPad (its context failed to build), RMSNormalization-23 and RotaryEmbedding-23
# (opset-23 ops the QNN EP leaves on the CPU).
EXPANDED_FUNCTION_OPS = frozenset(
    {
        "Mish", "GroupNormalization", "ReduceSumSquare", "ReduceL1", "ReduceLogSum",
        "Softsign", "Celu", "Shrink", "MeanVarianceNormalization",
        "CenterCropPad", "RMSNormalization", "RotaryEmbedding",
    }
)  # fmt: skip


def _function_body(
    node: onnx.NodeProto, opset: int, types: list[onnx.TypeProto]
) -> onnx.FunctionProto | None:
    """The schema's own function body of ``node`` (built for its attributes and input types
    when the schema's function depends on them), or None."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
    except onnx.defs.SchemaError:
        return None
    if schema.has_function:
        return schema.function_body
    if not schema.has_context_dependent_function or len(types) != len(node.input):
        return None
    built = onnx.FunctionProto()
    built.ParseFromString(
        schema.get_context_dependent_function(
            node.SerializeToString(), [t.SerializeToString() for t in types]
        )
    )
    return built


def expand_function_ops(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Replace each op of ``EXPANDED_FUNCTION_OPS`` by its ONNX function body (the op's own
    definition in simpler ops, with its attributes and fresh names for its inner tensors).

    Exact by definition: the body is what the ONNX standard says the op computes. Folding then
    removes the body's shape arithmetic (static shapes), and what is left is ops the HTP runs.
    """
    model = writable(model)
    graph = model.graph
    opset = opset_version(model)
    namer = FreshNames(model)
    values: dict[str, onnx.ValueInfoProto] | None = None
    nodes: list[onnx.NodeProto] = []
    details = []
    for node in graph.node:
        if node.op_type not in EXPANDED_FUNCTION_OPS or node.domain not in DEFAULT_DOMAINS:
            nodes.append(node)
            continue
        if values is None:
            values = inferred_values(model)
        types = [values[name].type for name in node.input if name in values]
        body = _function_body(node, opset, types)
        if body is None:
            nodes.append(node)
            continue
        nodes += _inlined(node, body, namer, _attribute_defaults(node, opset))
        details.append(f"{node_label(node)} -> its ONNX definition ({len(body.node)} ops)")
    if details:
        set_nodes(graph, nodes)
    return checked_change(model, "expand_function_ops", details)


def _attribute_defaults(node: onnx.NodeProto, opset: int) -> dict[str, onnx.AttributeProto]:
    """The schema's default value of each attribute of ``node``'s op that has one."""
    schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
    return {
        name: attribute.default_value
        for name, attribute in schema.attributes.items()
        if attribute.default_value.type != onnx.AttributeProto.UNDEFINED
    }


def _inlined(
    node: onnx.NodeProto,
    body: onnx.FunctionProto,
    namer: FreshNames,
    defaults: Mapping[str, onnx.AttributeProto] | None = None,
) -> list[onnx.NodeProto]:
    """``body``'s nodes wired to ``node``'s inputs and outputs, attribute references resolved
    from ``node``, else from the schema's ``defaults`` (a Constant that reads one, such as
    MeanVarianceNormalization's axes or Shrink's lambd, has no value without it), else dropped."""
    names = dict(zip(body.input, node.input, strict=False))
    names.update(zip(body.output, node.output, strict=False))
    base = node.name or node.output[0]
    attrs = {**(defaults or {}), **{a.name: a for a in node.attribute}}

    def rename(name: str) -> str:
        if not name:
            return name
        if name not in names:
            names[name] = namer(f"{base}/{name}")
        return names[name]

    inlined = []
    for inner in body.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(inner)
        copy.input[:] = [rename(n) for n in inner.input]
        copy.output[:] = [rename(n) for n in inner.output]
        copy.name = namer(f"{base}/{inner.name or inner.op_type}")
        kept = []
        for attr in copy.attribute:
            if not attr.ref_attr_name:
                kept.append(attr)
            elif attr.ref_attr_name in attrs:
                value = onnx.AttributeProto()
                value.CopyFrom(attrs[attr.ref_attr_name])
                value.name = attr.name
                kept.append(value)
        del copy.attribute[:]
        copy.attribute.extend(kept)
        inlined.append(copy)
    return inlined


def _einsum_terms(equation: str, inputs: int) -> tuple[list[str], str] | None:
    """The input terms and output term of an Einsum equation this rewrite takes: no ellipsis,
    no index repeated within a term, the output made explicit (implicit mode: the indices that
    appear once, in alphabetical order)."""
    equation = equation.replace(" ", "")
    if "..." in equation:
        return None
    left, _, right = equation.partition("->")
    terms = left.split(",")
    if len(terms) != inputs or any(len(set(term)) != len(term) for term in terms):
        return None
    if "->" not in equation:
        letters = "".join(terms)
        right = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    if len(set(right)) != len(right) or not set(right) <= set("".join(terms)):
        return None
    return terms, right


def _einsum_nodes(
    node: onnx.NodeProto,
    terms: list[str],
    out: str,
    shapes: list[tuple[int, ...]],
    names: FreshNames,
    graph: onnx.GraphProto,
) -> list[onnx.NodeProto] | None:
    """Einsum as ReduceSum / Transpose / Reshape / MatMul over static shapes, or None."""
    make = onnx.helper.make_node
    base = node.name or node.output[0]
    made: list[onnx.NodeProto] = []

    def const(values: list[int], what: str) -> str:
        name = names(f"{base}_{what}")
        graph.initializer.append(numpy_helper.from_array(np.array(values, np.int64), name))
        return name

    def step(op: str, inputs: list[str], what: str, **attrs: Any) -> str:
        name = names(f"{base}_{what}")
        made.append(make(op, inputs, [name], name=names(f"{base}_{what}_op"), **attrs))
        return name

    def arrange(tensor: str, term: str, order: str) -> str:
        return (
            tensor
            if term == order
            else step("Transpose", [tensor], "t", perm=[term.index(c) for c in order])
        )

    sizes: dict[str, int] = {}
    for term, shape in zip(terms, shapes, strict=True):
        if len(term) != len(shape):
            return None
        for c, d in zip(term, shape, strict=True):
            if sizes.setdefault(c, d) != d:
                return None  # broadcasting a size-1 index: not this rewrite
    current = list(node.input)
    kept_terms = []
    others = [set("".join(t for j, t in enumerate(terms) if j != i)) for i in range(len(terms))]
    for i, term in enumerate(terms):  # indices only this operand has and the output drops
        summed = [c for c in term if c not in others[i] and c not in out]
        if summed:
            axes = const([term.index(c) for c in summed], "axes")
            current[i] = step("ReduceSum", [current[i], axes], "sum", keepdims=0)
            term = "".join(c for c in term if c not in summed)
        kept_terms.append(term)
    if len(kept_terms) == 1:
        result, order = current[0], kept_terms[0]
    else:
        a, b = kept_terms
        batch = [c for c in a if c in b and c in out]
        contract = [c for c in a if c in b and c not in out]
        left = [c for c in a if c not in b]
        right = [c for c in b if c not in a]

        def dims(letters: list[str]) -> list[int]:
            return [sizes[c] for c in letters]

        def flat(letters: list[str]) -> int:
            return int(np.prod(dims(letters), dtype=np.int64))

        lhs = arrange(current[0], a, "".join(batch + left + contract))
        lhs = step("Reshape", [lhs, const([*dims(batch), flat(left), flat(contract)], "ls")], "l")
        rhs = arrange(current[1], b, "".join(batch + contract + right))
        rhs = step("Reshape", [rhs, const([*dims(batch), flat(contract), flat(right)], "rs")], "r")
        product = step("MatMul", [lhs, rhs], "mm")
        result = step("Reshape", [product, const(dims(batch + left + right), "os")], "o")
        order = "".join(batch + left + right)
    result = arrange(result, order, out)
    if made and made[-1].output[0] == result:  # the last op writes the Einsum's output
        made[-1].output[0] = node.output[0]
    else:  # nothing to compute (an identity equation)
        made.append(make("Identity", [result], [node.output[0]], name=names(f"{base}_id")))
    return made


def einsum_to_matmul(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Einsum with one or two operands -> ReduceSum / Transpose / Reshape / MatMul (exact up to
    the order of float sums).

    Why: the QNN EP takes no Einsum (it stays on the CPU and cuts the graph), and TF/Keras
    exports write attention and projections as Einsum (Keras MultiHeadAttention: "abc,cde->abde",
    "aecd,abcd->acbe"). Shared indices kept in the output are MatMul's batch, shared dropped
    ones its contraction; equations with an ellipsis, a repeated index or a broadcast index
    are left alone.
    """
    model = writable(model)
    graph = model.graph
    names = FreshNames(model)
    values: dict[str, onnx.ValueInfoProto] | None = None
    nodes: list[onnx.NodeProto] = []
    details = []
    for node in graph.node:
        attrs = {a.name: a for a in node.attribute}
        parsed = None
        if node.op_type == "Einsum" and node.domain in DEFAULT_DOMAINS and "equation" in attrs:
            equation = onnx.helper.get_attribute_value(attrs["equation"]).decode()
            parsed = _einsum_terms(equation, len(node.input)) if len(node.input) <= 2 else None
        if parsed is None:
            nodes.append(node)
            continue
        if values is None:
            values = inferred_values(model)
        shapes = [value_shape(values[n]) if n in values else None for n in node.input]
        made = None
        if all(s is not None for s in shapes):
            made = _einsum_nodes(node, *parsed, shapes, names, graph)  # type: ignore[arg-type]
        if made is None:
            nodes.append(node)
            continue
        nodes += made
        details.append(f"{node_label(node)} {equation!r} -> " + ", ".join(n.op_type for n in made))
    if details:
        set_nodes(graph, nodes)
    return checked_change(model, "einsum_to_matmul", details)
