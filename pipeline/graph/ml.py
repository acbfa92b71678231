"""ai.onnx.ml ops that are plain arithmetic, rewritten into the standard ops that compute it.

Converters from scikit-learn (skl2onnx, onnxmltools) write a StandardScaler, MinMaxScaler or
RobustScaler in front of a network as an ai.onnx.ml ``Scaler``, a SimpleImputer as an
``Imputer``, a Normalizer as a ``Normalizer``, a Binarizer as a ``Binarizer``, a
ColumnTransformer's columns as ``ArrayFeatureExtractor`` and ``FeatureVectorizer``, a
linear model as a ``LinearRegressor``, a category id's learned value as a numeric
``LabelEncoder`` and its one-hot columns as a ``OneHotEncoder``. The QNN EP runs no
ai.onnx.ml op, and ONNX infers no shape for their outputs: an MLP regressor behind a Scaler had no static shape anywhere and its
build stopped. Each computes what a few standard ops compute, as onnxruntime's kernels do it
(onnxruntime/core/providers/cpu/ml): Sub and Mul, Where of IsNaN, Greater, a row's norm with a
norm of 0 leaving the row as it is, Gather, Concat, Gemm. Written so, it runs on the NPU and
inference goes on.

Only the model's head is rewritten: an op behind an ai.onnx.ml op that stays (a
LinearClassifier's Normalizer) is part of the CPU tail (``graph.tails``) and stays with it.
Where onnxruntime's kernel cycles through features with a stride (Scaler, Imputer,
Normalizer), only inputs of rank 1 or 2, whose stride is the last axis.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper

from . import edit
from .edit import Change, NodeRewrite

ML_DOMAIN = "ai.onnx.ml"
Rule = Callable[[onnx.NodeProto, NodeRewrite], list[onnx.NodeProto] | None]


def _features(node: onnx.NodeProto, context: NodeRewrite) -> int | None:
    """The per-feature length onnxruntime's kernel cycles through (the last axis of a rank-1
    or rank-2 input), None for an input of another or unknown rank."""
    shape = context.shape(node.input[0])
    if shape is None or not 1 <= len(shape) <= 2:
        return None
    return shape[-1]


def _as_float(node: onnx.NodeProto, context: NodeRewrite, made: list[onnx.NodeProto]) -> str:
    """The node's input as float32 (a Cast appended to ``made`` for an integer input, as the
    kernels convert each value)."""
    x = node.input[0]
    if context.elem_type(x) in (None, TensorProto.FLOAT):
        return x
    cast = context.fresh(f"{x}_float")
    made.append(helper.make_node("Cast", [x], [cast], to=TensorProto.FLOAT))
    return cast


def _per_feature(values: list[float], features: int) -> np.ndarray | None:
    """One value per feature or one for all, as float32; None for any other length."""
    if len(values) not in (1, features):
        return None
    return np.asarray(values, np.float32)


def _scaler(node: onnx.NodeProto, context: NodeRewrite) -> list[onnx.NodeProto] | None:
    """Y = (X - offset) * scale."""
    features = _features(node, context)
    if features is None:
        return None
    offset = _per_feature(list(edit.attribute(node, "offset", [])), features)
    scale = _per_feature(list(edit.attribute(node, "scale", [])), features)
    if offset is None or scale is None or offset.size != scale.size:
        return None
    made: list[onnx.NodeProto] = []
    x = _as_float(node, context, made)
    base = node.output[0]
    shifted = context.fresh(f"{base}_shifted")
    made += [
        helper.make_node("Sub", [x, context.constant(offset, f"{base}_offset")], [shifted]),
        helper.make_node("Mul", [shifted, context.constant(scale, f"{base}_factor")], [base]),
    ]
    return made


def _imputer(node: onnx.NodeProto, context: NodeRewrite) -> list[onnx.NodeProto] | None:
    """Each X equal to replaced_value_float (NaN: each NaN) -> its feature's imputed value."""
    features = _features(node, context)
    if features is None:
        return None
    imputed = _per_feature(list(edit.attribute(node, "imputed_value_floats", [])), features)
    replaced = edit.attribute(node, "replaced_value_float", None)
    if imputed is None or replaced is None:
        return None
    if context.elem_type(node.input[0]) != TensorProto.FLOAT:
        return None
    x, base = node.input[0], node.output[0]
    hit = context.fresh(f"{base}_missing")
    if math.isnan(replaced):
        test = helper.make_node("IsNaN", [x], [hit])
    else:
        value = context.constant(np.asarray(replaced, np.float32), f"{base}_replaced")
        test = helper.make_node("Equal", [x, value], [hit])
    fill = context.constant(imputed, f"{base}_imputed")
    return [test, helper.make_node("Where", [hit, fill, x], [base])]


def _binarizer(node: onnx.NodeProto, context: NodeRewrite) -> list[onnx.NodeProto] | None:
    """Y = 1 where X > threshold, else 0 (onnxruntime's default threshold is not the spec's:
    a node without one is left alone)."""
    threshold = edit.attribute(node, "threshold", None)
    if threshold is None or context.elem_type(node.input[0]) != TensorProto.FLOAT:
        return None
    base = node.output[0]
    above = context.fresh(f"{base}_above")
    limit = context.constant(np.asarray(threshold, np.float32), f"{base}_threshold")
    return [
        helper.make_node("Greater", [node.input[0], limit], [above]),
        helper.make_node("Cast", [above], [base], to=TensorProto.FLOAT),
    ]


def _normalizer(node: onnx.NodeProto, context: NodeRewrite) -> list[onnx.NodeProto] | None:
    """Each row divided by its MAX, L1 or L2 norm; a row whose norm is 0 stays as it is."""
    norm = edit.attribute(node, "norm", b"MAX")
    norm = norm.decode() if isinstance(norm, bytes) else str(norm)
    if _features(node, context) is None or norm not in ("MAX", "L1", "L2"):
        return None
    made: list[onnx.NodeProto] = []
    x = _as_float(node, context, made)
    base = node.output[0]
    name = {k: context.fresh(f"{base}_{k}") for k in ("term", "total", "norm", "zero", "divisor")}
    reduce = "ReduceMax" if norm == "MAX" else "ReduceSum"
    if norm == "L1":
        made.append(helper.make_node("Abs", [x], [name["term"]]))
    elif norm == "L2":
        made.append(helper.make_node("Mul", [x, x], [name["term"]]))
    term = x if norm == "MAX" else name["term"]
    total = name["norm"] if norm != "L2" else name["total"]
    # axes an input: ReduceSum's since opset 13, ReduceMax's since 18
    if edit.opset_version(context.model) >= (18 if reduce == "ReduceMax" else 13):
        axes = context.constant(np.array([-1], np.int64), f"{base}_axes")
        made.append(helper.make_node(reduce, [term, axes], [total], keepdims=1))
    else:
        made.append(helper.make_node(reduce, [term], [total], axes=[-1], keepdims=1))
    if norm == "L2":
        made.append(helper.make_node("Sqrt", [total], [name["norm"]]))
    zero = context.constant(np.asarray(0.0, np.float32), f"{base}_zero")
    one = context.constant(np.asarray(1.0, np.float32), f"{base}_one")
    made += [
        helper.make_node("Equal", [name["norm"], zero], [name["zero"]]),
        helper.make_node("Where", [name["zero"], one, name["norm"]], [name["divisor"]]),
        helper.make_node("Div", [x, name["divisor"]], [base]),
    ]
    return made


def _linear_regressor(node: onnx.NodeProto, context: NodeRewrite) -> list[onnx.NodeProto] | None:
    """Y = X W^T + intercepts (post_transform NONE; onnxruntime takes float X only)."""
    shape = context.shape(node.input[0])
    post = edit.attribute(node, "post_transform", b"NONE")
    post = post.decode() if isinstance(post, bytes) else str(post)
    targets = int(edit.attribute(node, "targets", 1))
    coefficients = np.asarray(edit.attribute(node, "coefficients", []), np.float32)
    if shape is None or len(shape) != 2 or post != "NONE":
        return None
    if context.elem_type(node.input[0]) != TensorProto.FLOAT:
        return None
    if coefficients.size != targets * shape[1]:
        return None
    base = node.output[0]
    inputs = [node.input[0], context.constant(coefficients.reshape(targets, shape[1]), f"{base}_w")]
    intercepts = list(edit.attribute(node, "intercepts", []))
    if len(intercepts) == targets:  # onnxruntime ignores intercepts of another length
        inputs.append(context.constant(np.asarray(intercepts, np.float32), f"{base}_b"))
    return [helper.make_node("Gemm", inputs, [base], transB=1)]


def _feature_extractor(node: onnx.NodeProto, context: NodeRewrite) -> list[onnx.NodeProto] | None:
    """Z = X[..., indices] for constant indices within the last axis (a ColumnTransformer's
    column selection). A label lookup (computed indices into class labels) is not one."""
    shape = context.shape(node.input[0])
    indices = context.inits.get(node.input[1])
    if shape is None or len(shape) < 2 or indices is None:
        return None
    if context.elem_type(node.input[0]) != TensorProto.FLOAT:
        return None
    picked = onnx.numpy_helper.to_array(indices).astype(np.int64).reshape(-1)
    if picked.size == 0 or picked.min() < 0 or picked.max() >= shape[-1]:
        return None
    where = context.constant(picked, f"{node.output[0]}_columns")
    return [helper.make_node("Gather", [node.input[0], where], [node.output[0]], axis=-1)]


def _feature_vectorizer(node: onnx.NodeProto, context: NodeRewrite) -> list[onnx.NodeProto] | None:
    """Y = the inputs side by side as float, each [N, its inputdimensions entry] (an input of
    another width would be padded or cut by onnxruntime: left alone)."""
    widths = list(edit.attribute(node, "inputdimensions", []))
    shapes = [context.shape(name) for name in node.input]
    if len(widths) != len(node.input) or any(s is None or len(s) != 2 for s in shapes):
        return None
    if len({s[0] for s in shapes}) != 1 or any(
        s[1] != w for s, w in zip(shapes, widths, strict=True)
    ):
        return None
    made: list[onnx.NodeProto] = []
    parts = []
    for name in node.input:
        if context.elem_type(name) == TensorProto.FLOAT:
            parts.append(name)
            continue
        cast = context.fresh(f"{name}_float")
        made.append(helper.make_node("Cast", [name], [cast], to=TensorProto.FLOAT))
        parts.append(cast)
    made.append(helper.make_node("Concat", parts, [node.output[0]], axis=1))
    return made


LOOKUP_KEYS = 4096  # a LabelEncoder's keys written as one Equal each: [..., keys] at once


def _axes_as_inputs(context: NodeRewrite) -> bool:
    """Whether the model's opset reads Unsqueeze's axes as an input (13 on; a pre-quantized
    model keeps its older opset)."""
    domains = ("", "ai.onnx")
    return next((o.version for o in context.model.opset_import if o.domain in domains), 0) >= 13


def _matches(
    node: onnx.NodeProto, context: NodeRewrite, keys: np.ndarray, hit: str
) -> list[onnx.NodeProto]:
    """``hit`` [..., len(keys)] = the node's input equals each key (Equal on the input with a
    last axis of 1: one comparison per key)."""
    base = node.output[0]
    column = context.fresh(f"{base}_column")
    last = context.constant(np.asarray([-1], np.int64), f"{base}_last_axis")
    return [
        helper.make_node("Unsqueeze", [node.input[0], last], [column]),
        helper.make_node("Equal", [column, context.constant(keys, f"{base}_keys")], [hit]),
    ]


def _lookup_table(node: onnx.NodeProto, kind: str) -> tuple[np.ndarray, int] | None:
    """A LabelEncoder's numeric ``keys`` or ``values`` (``kind``) and their elem type, from
    whichever of its attribute forms it has (``*_int64s``, ``*_floats``, ``*_tensor``)."""
    for suffix, elem in (("int64s", TensorProto.INT64), ("floats", TensorProto.FLOAT)):
        found = edit.attribute(node, f"{kind}_{suffix}", None)
        if found is not None:
            return np.asarray(found, np.int64 if elem == TensorProto.INT64 else np.float32), elem
    tensor = edit.attribute(node, f"{kind}_tensor", None)
    if tensor is not None and tensor.data_type in (TensorProto.INT64, TensorProto.FLOAT):
        return onnx.numpy_helper.to_array(tensor).reshape(-1), tensor.data_type
    return None


def _label_encoder(node: onnx.NodeProto, context: NodeRewrite) -> list[onnx.NodeProto] | None:
    """Y = the value of X's key, the default where no key matches, for numeric keys and
    values (a category id -> its encoding in front of a network): X compared with every key
    (Equal), the one match's value picked by a MatMul, the default where the row of matches
    is empty. Strings, duplicate or NaN keys, and integer values a float32 cannot hold exactly
    are left alone."""
    keys, values = _lookup_table(node, "keys"), _lookup_table(node, "values")
    if keys is None or values is None or context.elem_type(node.input[0]) != keys[1]:
        return None
    (key_array, _), (value_array, value_type) = keys, values
    if not 0 < key_array.size <= LOOKUP_KEYS or key_array.size != value_array.size:
        return None
    if np.unique(key_array).size != key_array.size or np.isnan(key_array.astype(float)).any():
        return None
    if not _axes_as_inputs(context):
        return None
    tensor = edit.attribute(node, "default_tensor", None)
    if tensor is not None:  # opset 4's form of the default
        default = float(onnx.numpy_helper.to_array(tensor).reshape(-1)[0])
    elif value_type == TensorProto.INT64:
        default = float(edit.attribute(node, "default_int64", -1))
    else:
        default = float(edit.attribute(node, "default_float", -0.0))
    if value_type == TensorProto.INT64 and np.abs(np.append(value_array, default)).max() >= 2**24:
        return None
    if np.isnan(value_array.astype(float)).any() or math.isnan(default):
        return None
    base = node.output[0]
    keys_of = ("hit", "hits", "picked", "count", "miss", "fill", "y")
    name = {k: context.fresh(f"{base}_{k}") for k in keys_of}
    table = context.constant(value_array.astype(np.float32), f"{base}_values")
    made = [
        *_matches(node, context, key_array, name["hit"]),
        helper.make_node("Cast", [name["hit"]], [name["hits"]], to=TensorProto.FLOAT),
        # at most one 1 in a row (the keys are unique): its value exactly, or 0
        helper.make_node("MatMul", [name["hits"], table], [name["picked"]]),
    ]
    result = name["picked"]
    if default != 0.0:  # + default * (1 - matches): exact, as matches is 0 or 1
        ones = context.constant(np.ones(key_array.size, np.float32), f"{base}_ones")
        one = context.constant(np.asarray(1.0, np.float32), f"{base}_one")
        fill = context.constant(np.asarray(default, np.float32), f"{base}_default")
        made += [
            helper.make_node("MatMul", [name["hits"], ones], [name["count"]]),
            helper.make_node("Sub", [one, name["count"]], [name["miss"]]),
            helper.make_node("Mul", [name["miss"], fill], [name["fill"]]),
            helper.make_node("Add", [name["picked"], name["fill"]], [name["y"]]),
        ]
        result = name["y"]
    to = TensorProto.INT64 if value_type == TensorProto.INT64 else TensorProto.FLOAT
    if result == name["picked"] and to == TensorProto.FLOAT:
        made[-1].output[0] = base
    else:
        made.append(helper.make_node("Cast", [result], [base], to=to))
    return made


def _one_hot_encoder(node: onnx.NodeProto, context: NodeRewrite) -> list[onnx.NodeProto] | None:
    """Y[..., k] = 1 where X equals the k-th category, for integer categories of an integer
    input, an unknown one all zeros (``zeros = 1``, the default; with 0 onnxruntime raises on
    it instead: left alone, as are string categories and float inputs, which it truncates)."""
    cats = edit.attribute(node, "cats_int64s", None)
    if not cats or len(cats) > LOOKUP_KEYS or int(edit.attribute(node, "zeros", 1)) != 1:
        return None
    if context.elem_type(node.input[0]) != TensorProto.INT64:
        return None
    if not _axes_as_inputs(context):
        return None
    hit = context.fresh(f"{node.output[0]}_hit")
    return [
        *_matches(node, context, np.asarray(cats, np.int64), hit),
        helper.make_node("Cast", [hit], [node.output[0]], to=TensorProto.FLOAT),
    ]


RULES: dict[str, Rule] = {
    "LabelEncoder": _label_encoder,
    "OneHotEncoder": _one_hot_encoder,
    "ArrayFeatureExtractor": _feature_extractor,
    "FeatureVectorizer": _feature_vectorizer,
    "Scaler": _scaler,
    "Imputer": _imputer,
    "Binarizer": _binarizer,
    "Normalizer": _normalizer,
    "LinearRegressor": _linear_regressor,
}


def _behind_ml_ops(graph: onnx.GraphProto) -> set[str]:
    """Tensors computed from the output of an ai.onnx.ml node (nodes in topological order)."""
    tainted: set[str] = set()
    for node in graph.node:
        if node.domain == ML_DOMAIN or any(i in tainted for i in node.input):
            tainted.update(o for o in node.output if o)
    return tainted


def standard_ml_ops(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """The ai.onnx.ml ops at the model's head that ``RULES`` can write as standard ops, so
    written; a chain of them one by one (each rewrite gives the next its input's shape)."""
    details: list[str] = []
    for _ in range(sum(n.domain == ML_DOMAIN for n in model.graph.node)):
        behind = _behind_ml_ops(model.graph)

        def rewrite(
            node: onnx.NodeProto, context: NodeRewrite, behind: set[str] = behind
        ) -> tuple[list[onnx.NodeProto], str] | None:
            rule = RULES.get(node.op_type)
            if node.domain != ML_DOMAIN or rule is None or any(i in behind for i in node.input):
                return None
            made = rule(node, context)
            if made is None:
                return None
            return made, f"{edit.node_label(node)} -> {'+'.join(n.op_type for n in made)}"

        model, change = edit.replace_nodes(model, "standard_ml_ops", rewrite)
        if not change.changed:
            break
        details += change.details
    return edit.checked_change(model, "standard_ml_ops", details)
