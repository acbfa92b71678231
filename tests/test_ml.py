"""ai.onnx.ml ops that are plain arithmetic (a scikit-learn Scaler, Imputer, Normalizer,
Binarizer, LinearRegressor, a LabelEncoder of numbers) rewritten into standard ops: the same numbers as onnxruntime's own
kernels, static shapes behind them, and the NPU running the model whole."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import pytest
from onnx import TensorProto, numpy_helper
from test_legacy import run  # one CPU run of input x, its first output

from pipeline.core.config import InputsSection
from pipeline.graph.edit import dynamic_outputs
from pipeline.graph.ml import standard_ml_ops
from pipeline.graph.prepare import prepare_model

RNG = np.random.default_rng(11)
FEATURES = 5
NO_INPUTS = InputsSection(dims={}, shapes={}, constants={})


def ml_model(
    nodes: list[onnx.NodeProto],
    inits: list[onnx.TensorProto] = (),  # type: ignore[assignment]
    shape: list[int | str] = (1, FEATURES),  # type: ignore[assignment]
    elem_type: int = TensorProto.FLOAT,
    out_shape: list[int | str] | None = None,
) -> onnx.ModelProto:
    """``nodes`` from input x to output y (its dims unknown unless ``out_shape`` says)."""
    out = out_shape or [f"d{i}" for i in range(len(shape))]
    graph = oh.make_graph(
        nodes,
        "ml",
        [oh.make_tensor_value_info("x", elem_type, list(shape))],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, list(out))],
        list(inits),
    )
    model = oh.make_model(
        graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("ai.onnx.ml", 1)]
    )
    model.ir_version = 8
    return model


def ml(op: str, inputs: list[str], output: str, **attrs: object) -> onnx.NodeProto:
    return oh.make_node(op, inputs, [output], domain="ai.onnx.ml", **attrs)


def features(rows: int = 1, dtype: type = np.float32) -> np.ndarray:
    return (RNG.standard_normal((rows, FEATURES)) * 4).astype(dtype)


def rewritten(model: onnx.ModelProto) -> onnx.ModelProto:
    result, change = standard_ml_ops(model)
    assert change.changed
    assert not [n.op_type for n in result.graph.node if n.domain == "ai.onnx.ml"]
    return result


SCALER = {"offset": [1.0, -2.0, 0.5, 3.0, 0.0], "scale": [0.5, 2.0, 1.5, 0.25, 4.0]}


@pytest.mark.parametrize(
    ("node", "dtype", "exact"),
    [
        (ml("Scaler", ["x"], "y", **SCALER), np.float32, True),
        (ml("Scaler", ["x"], "y", offset=[1.5], scale=[0.3]), np.float32, True),
        (ml("Scaler", ["x"], "y", **SCALER), np.int64, True),  # counts cast to float first
        (ml("Binarizer", ["x"], "y", threshold=0.7), np.float32, True),
        (ml("Normalizer", ["x"], "y", norm="MAX"), np.float32, True),
        (ml("Normalizer", ["x"], "y", norm="L1"), np.float32, False),
        (ml("Normalizer", ["x"], "y", norm="L2"), np.float32, False),
        (
            ml(
                "LinearRegressor",
                ["x"],
                "y",
                coefficients=RNG.standard_normal(2 * FEATURES).tolist(),
                intercepts=[0.25, -1.0],
                targets=2,
            ),
            np.float32,
            False,
        ),
    ],
    ids=["scaler", "scaler-one", "scaler-int", "binarizer", "max", "l1", "l2", "linear"],
)
def test_each_op_computes_what_onnxruntimes_kernel_does(
    node: onnx.NodeProto, dtype: type, exact: bool
) -> None:
    elem = TensorProto.INT64 if dtype == np.int64 else TensorProto.FLOAT
    model = ml_model([node], shape=[3, FEATURES], elem_type=elem)
    result = rewritten(model)
    x = features(3, dtype)
    want, got = run(model, x), run(result, x)
    assert got.dtype == np.float32 and got.shape == want.shape
    if exact:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)


def test_an_imputer_fills_nans_per_feature_and_a_norm_of_zero_leaves_the_row() -> None:
    imputed = [9.0, 8.0, 7.0, 6.0, 5.0]
    nodes = [
        ml("Imputer", ["x"], "filled", imputed_value_floats=imputed, replaced_value_float=np.nan),
        ml("Normalizer", ["filled"], "y", norm="L1"),
    ]
    model = ml_model(nodes, shape=[3, FEATURES])
    x = features(3)
    x[0, 1] = x[2, 4] = np.nan
    x[1] = [0.0, 0.0, 0.0, 0.0, 0.0]  # no NaN and a norm of 0: the row as it is
    result = rewritten(model)  # the chain: the Normalizer gets its input's shape once rewritten
    np.testing.assert_allclose(run(result, x), run(model, x), rtol=2e-6)
    assert run(result, x)[1].tolist() == [0.0] * FEATURES


def test_an_imputer_of_a_value_replaces_that_value() -> None:
    node = ml("Imputer", ["x"], "y", imputed_value_floats=[-1.0], replaced_value_float=0.0)
    model = ml_model([node], shape=[2, FEATURES])
    x = np.array([[0.0, 1.0, 0.0, 2.0, np.nan], [3.0, 0.0, 4.0, 0.0, 5.0]], np.float32)
    np.testing.assert_array_equal(run(rewritten(model), x), run(model, x))


def test_a_column_transformer_selects_scales_and_joins_columns_as_standard_ops() -> None:
    """skl2onnx's ColumnTransformer: ArrayFeatureExtractor picks columns, each group is
    scaled (or cast), a FeatureVectorizer joins them; all exact, no ml op left."""
    nodes = [
        ml("ArrayFeatureExtractor", ["x", "first"], "a"),
        ml("ArrayFeatureExtractor", ["x", "rest"], "b"),
        ml("Scaler", ["a"], "a_scaled", offset=[1.0, 2.0], scale=[0.5, 0.25]),
        ml("FeatureVectorizer", ["a_scaled", "b"], "y", inputdimensions=[2, 3]),
    ]
    inits = [
        numpy_helper.from_array(np.array([0, 3], np.int64), "first"),
        numpy_helper.from_array(np.array([[1, 2, 4]], np.int64), "rest"),  # any shape: flat
    ]
    model = ml_model(nodes, inits, shape=[4, FEATURES])
    result = rewritten(model)
    assert [n.op_type for n in result.graph.node] == ["Gather", "Gather", "Sub", "Mul", "Concat"]
    x = features(4)
    np.testing.assert_array_equal(run(result, x), run(model, x))


def test_ops_it_cannot_write_exactly_stay() -> None:
    """A rank-3 input (onnxruntime's stride is then not one axis), an unknown post transform,
    a Binarizer without its threshold (onnxruntime's default is not the spec's), and a
    Normalizer behind a LinearClassifier (the classifier's CPU tail) are left as they are."""
    cases = [
        ml_model([ml("Scaler", ["x"], "y", **SCALER)], shape=[1, 2, FEATURES]),
        ml_model(
            [
                ml(
                    "LinearRegressor",
                    ["x"],
                    "y",
                    coefficients=[1.0] * FEATURES,
                    targets=1,
                    post_transform="PROBIT",
                )
            ]
        ),
        ml_model([ml("Binarizer", ["x"], "y")]),
    ]
    for model in cases:
        result, change = standard_ml_ops(model)
        assert not change.changed and [n.op_type for n in result.graph.node] == [
            n.op_type for n in model.graph.node
        ]
    classify = oh.make_node(
        "LinearClassifier",
        ["x"],
        ["label", "scores"],
        domain="ai.onnx.ml",
        coefficients=RNG.standard_normal(3 * FEATURES).tolist(),
        intercepts=[0.0, 0.1, 0.2],
        classlabels_ints=[0, 1, 2],
    )
    graph = oh.make_graph(
        [classify, ml("Normalizer", ["scores"], "y", norm="L1")],
        "clf",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, FEATURES])],
        [
            oh.make_tensor_value_info("label", TensorProto.INT64, [1]),
            oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3]),
        ],
    )
    model = oh.make_model(
        graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("ai.onnx.ml", 1)]
    )
    result, change = standard_ml_ops(model)
    assert not change.changed
    assert [n.op_type for n in result.graph.node] == ["LinearClassifier", "Normalizer"]


def scaled_mlp() -> onnx.ModelProto:
    """skl2onnx's form of StandardScaler -> MLPRegressor: a Scaler, then MatMul/Add/Relu, with
    the batch dim stored as a 0-length dim (no shape inference goes past the Scaler)."""
    hidden = 16
    w1 = numpy_helper.from_array(RNG.standard_normal((FEATURES, hidden)).astype("f4"), "w1")
    b1 = numpy_helper.from_array(RNG.standard_normal(hidden).astype("f4"), "b1")
    w2 = numpy_helper.from_array(RNG.standard_normal((hidden, 1)).astype("f4") * 0.3, "w2")
    nodes = [
        ml("Scaler", ["x"], "scaled", **SCALER),
        oh.make_node("Cast", ["scaled"], ["cast"], to=TensorProto.FLOAT),
        oh.make_node("MatMul", ["cast", "w1"], ["h"]),
        oh.make_node("Add", ["h", "b1"], ["hb"]),
        oh.make_node("Relu", ["hb"], ["r"]),
        oh.make_node("MatMul", ["r", "w2"], ["y"]),
    ]
    return ml_model(nodes, [w1, b1, w2], shape=["N", FEATURES], out_shape=["N", 1])


def test_a_scaled_mlp_prepares_static_with_no_ml_op_left() -> None:
    model = scaled_mlp()
    inputs = InputsSection(dims={"N": 1}, shapes={}, constants={})
    prepared, changes = prepare_model(model, inputs)
    assert dynamic_outputs(prepared) == []
    assert "ai.onnx.ml" not in {n.domain for n in prepared.graph.node}
    assert any(c.step == "standard_ml_ops" and c.changed for c in changes)
    x = features()
    np.testing.assert_allclose(run(prepared, x), run(model, x), rtol=1e-5, atol=1e-5)


def assert_released_whole_on_the_npu(
    root: Path, model: onnx.ModelProto, name: str, inputs: str = ""
) -> None:
    """``model`` through quantize, compile and publish: 1 QNN partition, no CPU node, no tail."""
    pytest.importorskip("onnxruntime_qnn")
    from test_tails import released

    from pipeline.core.layout import ModelPaths
    from pipeline.core.records import VariantRecord, read_record

    artifacts = released(root, model, name, inputs, 24)
    folder = next(ModelPaths.of(artifacts, name).ctx.glob("*/snapdragon-x-elite"))
    record, why = read_record(VariantRecord, folder / "variant.json")
    assert record is not None and record.coverage is not None, why
    assert record.coverage.qnn_partitions == 1 and record.coverage.cpu_compute_nodes == []
    assert not record.coverage.cpu_tail_nodes
    assert record.passed


@pytest.mark.qnn
def test_a_scaled_mlp_builds_whole_on_the_npu(tmp_path: Path) -> None:
    assert_released_whole_on_the_npu(tmp_path, scaled_mlp(), "mlp", "[inputs]\ndims = { N = 1 }\n")


def encoder_model(
    keys: dict[str, object], values: dict[str, object], in_type: int, out_type: int, **attrs: object
) -> onnx.ModelProto:
    """x [3, FEATURES] -> a LabelEncoder of numbers (ai.onnx.ml 2: numeric keys) -> y."""
    graph = oh.make_graph(
        [ml("LabelEncoder", ["x"], "y", **keys, **values, **attrs)],
        "encode",
        [oh.make_tensor_value_info("x", in_type, [3, FEATURES])],
        [oh.make_tensor_value_info("y", out_type, [3, FEATURES])],
    )
    opsets = [oh.make_opsetid("", 17), oh.make_opsetid("ai.onnx.ml", 2)]
    return oh.make_model(graph, ir_version=8, opset_imports=opsets)


IDS = {"keys_int64s": [0, 3, 7, -2, 40]}


@pytest.mark.parametrize(
    ("keys", "values", "in_type", "out_type", "attrs"),
    [
        (IDS, {"values_floats": [0.5, -1.25, 3.0, 7.5, 0.1]}, TensorProto.INT64, TensorProto.FLOAT, {}),
        (IDS, {"values_floats": [0.5, -1.25, 3.0, 7.5, 0.1]}, TensorProto.INT64, TensorProto.FLOAT,
         {"default_float": 2.5}),
        (IDS, {"values_int64s": [10, 11, 12, -13, 14]}, TensorProto.INT64, TensorProto.INT64, {}),
        ({"keys_floats": [0.5, 1.5, -2.0]}, {"values_int64s": [1, 2, 3]}, TensorProto.FLOAT,
         TensorProto.INT64, {"default_int64": 9}),
    ],
    ids=["ids-to-floats", "ids-to-floats-default", "ids-to-ids", "floats-to-ids"],
)  # fmt: skip
def test_a_label_encoder_of_numbers_computes_what_onnxruntimes_kernel_does(
    keys: dict[str, object],
    values: dict[str, object],
    in_type: int,
    out_type: int,
    attrs: dict[str, object],
) -> None:
    """A category id -> its encoding, in front of a network: one Equal per key and a MatMul
    picking the match's value, the default where none matches, as onnxruntime's kernel."""
    model = encoder_model(keys, values, in_type, out_type, **attrs)
    result = rewritten(model)
    key_list = list(next(iter(keys.values())))  # type: ignore[call-overload]
    pool = np.asarray([*key_list, 1, 2, 100, -5], np.float32)  # every key and some misses
    x = RNG.choice(pool, size=(3, FEATURES)).astype(
        np.int64 if in_type == TensorProto.INT64 else np.float32
    )
    want, got = run(model, x), run(result, x)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_a_one_hot_encoder_of_ids_computes_what_onnxruntimes_kernel_does() -> None:
    """Category ids -> one-hot columns, an unknown id all zeros (zeros = 1), as Equal + Cast."""
    node = ml("OneHotEncoder", ["x"], "y", cats_int64s=[3, 1, 7, -2], zeros=1)
    graph = oh.make_graph(
        [node],
        "one_hot",
        [oh.make_tensor_value_info("x", TensorProto.INT64, [3, FEATURES])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [3, FEATURES, 4])],
    )
    opsets = [oh.make_opsetid("", 17), oh.make_opsetid("ai.onnx.ml", 1)]
    model = oh.make_model(graph, ir_version=8, opset_imports=opsets)
    result = rewritten(model)
    x = RNG.choice(np.array([3, 1, 7, -2, 0, 5]), size=(3, FEATURES)).astype(np.int64)
    np.testing.assert_array_equal(run(result, x), run(model, x))
    left = (  # raises on an unknown id; string categories
        ml("OneHotEncoder", ["x"], "y", cats_int64s=[1, 2], zeros=0),
        ml("OneHotEncoder", ["x"], "y", cats_strings=["a", "b"]),
    )
    for other in left:
        model.graph.node[0].CopyFrom(other)
        assert not standard_ml_ops(model)[1].changed


def test_a_label_encoder_it_cannot_write_exactly_stays() -> None:
    """Integer values a float32 cannot hold, duplicate keys, and keys of another type than the
    input's are left to the CPU (as a tail after the network, or named in front of it)."""
    cases = [
        encoder_model(
            IDS, {"values_int64s": [1, 2, 3, 4, 2**25]}, TensorProto.INT64, TensorProto.INT64
        ),
        encoder_model(
            {"keys_int64s": [1, 1, 2, 3, 4]},
            {"values_floats": [0.0, 1.0, 2.0, 3.0, 4.0]},
            TensorProto.INT64,
            TensorProto.FLOAT,
        ),
        encoder_model(
            {"keys_floats": [1.0, 2.0]}, {"values_floats": [0.0, 1.0]}, TensorProto.INT64,
            TensorProto.FLOAT,
        ),
    ]  # fmt: skip
    for model in cases:
        result, change = standard_ml_ops(model)
        assert not change.changed and [n.op_type for n in result.graph.node] == ["LabelEncoder"]


def encoded_mlp() -> onnx.ModelProto:
    """Category ids [1, FEATURES] -> a LabelEncoder (id -> a learned value, unknown ids -> 0;
    half of the random calibration's ids 0..255 are keys) -> MatMul/Relu/MatMul: an encoder
    in front of the network."""
    hidden = 8
    w1 = numpy_helper.from_array(RNG.standard_normal((FEATURES, hidden)).astype("f4"), "w1")
    w2 = numpy_helper.from_array(RNG.standard_normal((hidden, 2)).astype("f4"), "w2")
    encode = ml(
        "LabelEncoder", ["x"], "encoded", keys_int64s=list(range(0, 256, 2)),
        values_floats=RNG.standard_normal(128).tolist(), default_float=0.0,
    )  # fmt: skip
    nodes = [
        encode,
        oh.make_node("MatMul", ["encoded", "w1"], ["h"]),
        oh.make_node("Relu", ["h"], ["r"]),
        oh.make_node("MatMul", ["r", "w2"], ["y"]),
    ]
    graph = oh.make_graph(
        nodes,
        "encoded_mlp",
        [oh.make_tensor_value_info("x", TensorProto.INT64, [1, FEATURES])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])],
        [w1, w2],
    )
    opsets = [oh.make_opsetid("", 17), oh.make_opsetid("ai.onnx.ml", 2)]
    return oh.make_model(graph, ir_version=8, opset_imports=opsets)


def test_an_encoder_in_front_of_the_network_is_not_its_cpu_tail() -> None:
    """Only what follows the network is the declared CPU tail: an encoder left in front of it
    (here: one with keys past LOOKUP_KEYS) is a CPU node the coverage gate counts."""
    from pipeline.graph.ml import LOOKUP_KEYS
    from pipeline.graph.tails import model_tail

    model = encoded_mlp()
    encode = model.graph.node[0]
    for attr in encode.attribute:
        if attr.name == "keys_int64s":
            attr.ints[:] = range(LOOKUP_KEYS + 1)
        if attr.name == "values_floats":
            attr.floats[:] = [0.5] * (LOOKUP_KEYS + 1)
    assert not standard_ml_ops(model)[1].changed
    assert not model_tail(model)


@pytest.mark.qnn
def test_an_encoded_mlp_builds_whole_on_the_npu(tmp_path: Path) -> None:
    assert_released_whole_on_the_npu(tmp_path, encoded_mlp(), "encoded")
