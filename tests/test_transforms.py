"""Each graph transform on a tiny model: it does its edit, keeps the numbers, and is a no-op
when there is nothing to do. Numbers are checked by running both models in onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.parser
import onnxruntime as ort
import pytest
from compile_fixtures import build_whole_on_htp
from onnx import TensorProto, numpy_helper

from pipeline.core.config import InputsSection
from pipeline.core.errors import ModelError
from pipeline.graph import edit
from pipeline.graph import transforms as t
from pipeline.graph.prepare import prepare_model

RNG = np.random.default_rng(0)


def parse(text: str, check: bool = False) -> onnx.ModelProto:
    model = onnx.parser.parse_model(text)
    if check:
        onnx.checker.check_model(model)
    return model


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return session.run(None, feeds)


def ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def weights(*arrays: tuple[str, np.ndarray]) -> list[TensorProto]:
    return [numpy_helper.from_array(a, name) for name, a in arrays]


def with_inits(model: onnx.ModelProto, *arrays: tuple[str, np.ndarray]) -> onnx.ModelProto:
    model.graph.initializer.extend(weights(*arrays))
    onnx.checker.check_model(model)
    return model


def test_change_reports_changed() -> None:
    assert not t.Change("x").changed
    change = t.Change("x", ("a", "b", "c", "d"))
    assert change.changed
    assert change.summary(2) == "x: 4 edit(s): a; b; … 2 more"


# --- IR version and initializer inputs -----------------------------------------------------


def test_set_ir_version_lowers_ir_14_and_is_noop_at_10() -> None:
    model = parse(
        '<ir_version: 10, opset_import: ["": 13]> g (float[2] x) => (float[2] y) { y = Relu(x) }'
    )
    model.ir_version = 14
    fixed, change = t.set_ir_version(model)
    assert fixed.ir_version == 10 and change.details == ("IR version 14 -> 10",)
    assert model.ir_version == 14  # input untouched
    _, again = t.set_ir_version(fixed)
    assert not again.changed


def test_drop_initializer_inputs() -> None:
    model = parse(
        '<ir_version: 3, opset_import: ["": 7]> g (float[2] x, float[2] w) => (float[2] y) '
        "{ y = Add(x, w) }"
    )
    model.graph.initializer.extend(weights(("w", np.ones(2, np.float32))))
    dropped, change = t.drop_initializer_inputs(model)
    assert [i.name for i in dropped.graph.input] == ["x"] and change.changed
    assert dropped.ir_version >= 4
    _, again = t.drop_initializer_inputs(dropped)
    assert not again.changed


def test_raw_initializer_data_keeps_every_value_bit_for_bit() -> None:
    """Weights stored one value per protobuf field (as WinML and Custom Vision export them)
    become raw bytes with the same values, type and outputs (bfloat16 too); raw ones and
    strings stay as they are, and a model with nothing to move is returned as it is."""
    model = parse(
        '<ir_version: 8, opset_import: ["": 13]> g (float[2, 3] x) => (float[2, 4] y, '
        "int64[2] s) { m = MatMul(x, w)\n y = Add(m, b)\n s = Add(k, k) }"
    )
    w = RNG.normal(size=(3, 4)).astype(np.float32)
    w[0, 0] = -0.0  # the sign of a zero survives
    b = RNG.normal(size=4).astype(np.float16).astype(np.float32)
    model.graph.initializer.extend(
        [
            oh.make_tensor("w", TensorProto.FLOAT, [3, 4], w.ravel().tolist()),
            numpy_helper.from_array(b, "b"),  # raw already
            oh.make_tensor("k", TensorProto.INT64, [2], [7, -(2**40)]),
            oh.make_tensor("names", TensorProto.STRING, [1], [b"a"]),
            oh.make_tensor("bf", TensorProto.BFLOAT16, [1], [1.5]),
        ]
    )
    moved, change = t.raw_initializer_data(model)
    inits = {i.name: i for i in moved.graph.initializer}
    assert change.details == ("3 initializer(s) stored as raw bytes: w, k, bf",)
    for name in ("w", "k", "bf"):
        assert inits[name].raw_data and not inits[name].float_data and not inits[name].int64_data
    assert numpy_helper.to_array(inits["w"]).tobytes() == w.tobytes()
    assert numpy_helper.to_array(inits["k"]).tolist() == [7, -(2**40)]
    assert inits["bf"].data_type == TensorProto.BFLOAT16 and inits["bf"].dims == [1]
    assert float(numpy_helper.to_array(inits["bf"])[0]) == 1.5
    assert inits["names"].string_data == [b"a"] and not inits["names"].raw_data
    assert model.graph.initializer[0].float_data  # input untouched
    x = RNG.normal(size=(2, 3)).astype(np.float32)
    runnable = edit.copy_model(model)
    del runnable.graph.initializer[3:]
    ran = edit.copy_model(moved)
    del ran.graph.initializer[3:]
    for before, after in zip(run(runnable, {"x": x}), run(ran, {"x": x}), strict=True):
        assert before.tobytes() == after.tobytes()
    same, again = t.raw_initializer_data(moved)
    assert same is moved and not again.changed


# --- fixed inputs ---------------------------------------------------------------------------

DYNAMIC = """<ir_version: 8, opset_import: ["": 13]>
g (float[batch, 4] x, int64 sr) => (float[batch, 4] y) {
  y = Relu(x)
}"""


def test_bake_constant_inputs_makes_an_initializer() -> None:
    baked, change = t.bake_constant_inputs(parse(DYNAMIC), {"sr": 16000})
    assert [i.name for i in baked.graph.input] == ["x"]
    (init,) = baked.graph.initializer
    assert init.name == "sr" and numpy_helper.to_array(init).tolist() == 16000
    assert change.details == ("input 'sr' baked in as constant 16000",)
    _, noop = t.bake_constant_inputs(parse(DYNAMIC), {})
    assert not noop.changed


MASKED = """<ir_version: 8, opset_import: ["": 13]>
g (float[1, 4] x, float[1, 4] mask, float[batch, 4] bias) => (float[1, 4] y) {
  s = Add(x, mask)
  y = Add(s, bias)
}"""


def test_bake_constant_inputs_fills_a_shape_with_one_number() -> None:
    """A padding mask of zeros is one number in TOML, not a list of its every value."""
    baked, change = t.bake_constant_inputs(
        parse(MASKED), {"mask": 0.0, "bias": 0.5}, {"bias": [1, 4]}
    )
    assert change.details[0] == "input 'mask' baked in as constant [[0.0, 0.0, 0.0, 0.0]]"
    values = {i.name: numpy_helper.to_array(i) for i in baked.graph.initializer}
    assert values["mask"].shape == (1, 4) and not values["mask"].any()
    assert values["bias"].shape == (1, 4) and (values["bias"] == 0.5).all()
    assert [i.name for i in baked.graph.input] == ["x"]
    fixed, _ = t.fix_input_shapes(baked, {}, {"bias": [1, 4]})  # a baked input's shape is done
    assert [i.name for i in fixed.graph.input] == ["x"]
    with pytest.raises(ModelError, match=r"constants.bias has shape \[\].*'\?'") as error:
        t.bake_constant_inputs(parse(MASKED), {"bias": 0.5})  # dynamic, no [inputs] shapes
    assert "one number to fill it" in str(error.value.tip)


def test_bake_constant_inputs_fills_a_shape_that_dims_make_static() -> None:
    """A batch's lengths, int64[batch_size] (NeMo's mel front end): [inputs] dims sets the
    batch for every input, so the lengths input is one number too, without its own shape."""
    baked, _ = t.bake_constant_inputs(parse(MASKED), {"bias": 0.5}, {}, {"batch": 1})
    values = {i.name: numpy_helper.to_array(i) for i in baked.graph.initializer}
    assert values["bias"].shape == (1, 4) and (values["bias"] == 0.5).all()


def test_bake_constant_inputs_unknown_name_has_hint() -> None:
    with pytest.raises(ModelError, match=r"'sr_'.*did you mean 'sr'\?"):
        t.bake_constant_inputs(parse(DYNAMIC), {"sr_": 16000})


def test_fix_input_shapes_by_dim_param_and_by_shape() -> None:
    fixed, change = t.fix_input_shapes(parse(DYNAMIC), {"batch": 2}, {"sr": []})
    assert edit.value_shape(fixed.graph.input[0]) == (2, 4)
    assert change.details == ("input 'x': ['batch', 4] -> [2, 4]",)
    fixed, _ = t.fix_input_shapes(parse(DYNAMIC), {}, {"x": [3, 4]})
    assert edit.value_shape(fixed.graph.input[0]) == (3, 4)
    _, noop = t.fix_input_shapes(fixed, {}, {})
    assert not noop.changed


def test_a_negative_size_is_dynamic() -> None:
    """Older paddle2onnx writes a dynamic size as -1 (PP-OCRv2's recognizer: [-1, 3, ?, ?])."""
    model = parse(DYNAMIC)
    model.graph.input[0].type.tensor_type.shape.dim[0].Clear()
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = -1
    fixed, change = t.fix_input_shapes(model, {}, {"x": [3, 4]})
    assert edit.value_shape(fixed.graph.input[0]) == (3, 4)
    assert change.details == ("input 'x': ['?', 4] -> [3, 4]",)
    with pytest.raises(ModelError, match=r"dim 0 .* is dynamic"):
        t.fix_input_shapes(model, {}, {})


def test_fix_input_shapes_names_input_dim_and_config_key() -> None:
    with pytest.raises(ModelError) as info:
        t.fix_input_shapes(parse(DYNAMIC), {}, {})
    message = str(info.value)
    assert "input 'x' dim 0 (batch) is dynamic" in message
    assert "[inputs] dims = {batch = N}" in message and "[inputs] shapes" in message


@pytest.mark.parametrize(
    ("dims", "shapes", "message"),
    [
        ({"btch": 1}, {}, "did you mean 'batch'"),
        ({}, {"x": [1, 4, 4]}, "has rank 3"),
        ({}, {"xx": [1, 4]}, "'xx', not an input; did you mean 'x'"),
    ],
)
def test_fix_input_shapes_rejects_bad_config(dims, shapes, message) -> None:
    with pytest.raises(ModelError, match=message.replace("[", r"\[")):
        t.fix_input_shapes(parse(DYNAMIC), dims, shapes)


FIXED_CONV = """<ir_version: 8, opset_import: ["": 13]>
g (float[10, 3, 8, 8] x) => (float[10, 4, 8, 8] y) {
  y = Conv<pads = [1, 1, 1, 1]>(x, w)
}"""


def test_inputs_shapes_may_change_sizes_the_model_fixes() -> None:
    """A model exported at a dummy size (CenterFace: 10x3x32x32) is built at the size its
    app feeds; the stale output dims go, and the Conv computes at the new size."""
    model = with_inits(
        parse(FIXED_CONV, False), ("w", RNG.standard_normal((4, 3, 3, 3)).astype(np.float32))
    )
    assert t.resized_inputs(model, {"x": [1, 3, 16, 24]}) == ["x"]
    assert t.resized_inputs(model, {"x": [10, 3, 8, 8]}) == []
    fixed, change = t.fix_input_shapes(model, {}, {"x": [1, 3, 16, 24]})
    assert change.details == (
        "input 'x': [10, 3, 8, 8] -> [1, 3, 16, 24] (sizes the model fixes, as [inputs] "
        "shapes asks)",
    )
    output_dims = fixed.graph.output[0].type.tensor_type.shape.dim
    assert [d.HasField("dim_value") for d in output_dims] == [False] * 4  # rank kept
    x = RNG.standard_normal((1, 3, 16, 24)).astype(np.float32)
    assert run(fixed, {"x": x})[0].shape == (1, 4, 16, 24)
    # The source as the reference runs at that size too, with its input dims freed.
    free = edit.free_input_dims(model, ["x"])
    np.testing.assert_array_equal(run(free, {"x": x})[0], run(fixed, {"x": x})[0])
    # A named dynamic dim keeps its name ([inputs] dims may still use it).
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    names = [
        d.dim_param
        for d in edit.free_input_dims(model, ["x"]).graph.input[0].type.tensor_type.shape.dim
    ]
    assert names == ["batch", "x_dim1", "x_dim2", "x_dim3"]


def test_a_size_the_graph_cannot_take_is_refused_with_what_inference_said() -> None:
    model = with_inits(
        parse(
            '<ir_version: 8, opset_import: ["": 13]> g (float[10, 4] x) => (float[10, 2] y) '
            "{ y = MatMul(x, w) }",
            False,
        ),
        ("w", RNG.standard_normal((4, 2)).astype(np.float32)),
    )
    fixed, _ = t.fix_input_shapes(model, {}, {"x": [1, 4]})
    assert edit.value_shape(fixed.graph.input[0]) == (1, 4)
    with pytest.raises(ModelError) as info:
        t.fix_input_shapes(model, {}, {"x": [1, 5]})
    message = str(info.value)
    assert "'x' [10, 4] -> [1, 5]" in message
    assert "does not take the new shape" in message and "MatMul" in message
    assert "exported for" in info.value.tip


# --- Constant nodes and folding -------------------------------------------------------------


def test_constants_to_initializers() -> None:
    model = parse(
        '<ir_version: 8, opset_import: ["": 13]> g (float[2] x) => (float[2] y) '
        "{ c = Constant<value_floats: floats = [1.0, 2.0]>() \n y = Add(x, c) }"
    )
    converted, change = t.constants_to_initializers(model)
    assert ops(converted) == ["Add"] and change.changed
    assert numpy_helper.to_array(converted.graph.initializer[0]).tolist() == [1.0, 2.0]
    _, noop = t.constants_to_initializers(converted)
    assert not noop.changed


SHAPE_CHAIN = """<ir_version: 8, opset_import: ["": 13]>
g (float[1, 6] x) => (float[?, ?] y) {
  s = Shape(x)
  n = Gather<axis = 0>(s, idx)
  y = Reshape(x, n)
}"""


def test_fold_constants_makes_reshape_shape_schema_static() -> None:
    model = with_inits(parse(SHAPE_CHAIN, False), ("idx", np.array([1, 0], np.int64)))
    assert edit.dynamic_outputs(model), "the Reshape output needs data propagation before folding"
    folded, change = t.fold_constants(model)
    assert ops(folded) == ["Reshape"] and change.changed
    assert edit.dynamic_outputs(folded) == []
    x = RNG.standard_normal((1, 6)).astype(np.float32)
    np.testing.assert_array_equal(run(folded, {"x": x})[0], x.reshape(6, 1))
    _, noop = t.fold_constants(folded)
    assert not noop.changed


def test_fold_constants_reads_a_constant_sequence_and_keeps_it_a_node() -> None:
    """A mask baked into a constant and split into a sequence (Longformer's global attention:
    SplitToSequence, SequenceAt): onnxruntime returns the sequence as a list, whose size the
    fold took as an array's ('list' object has no attribute 'nbytes', preparation crashed).
    What reads the sequence folds; the sequence itself is no initializer."""
    model = parse(
        """<ir_version: 8, opset_import: ["": 17]>
        g (float[4] x) => (float[4] y) {
          c = Constant <value = int64[4] {2, 3, 4, 5}> ()
          s = SplitToSequence <keepdims = 0> (c)
          i = Constant <value = int64 {1}> ()
          e = SequenceAt (s, i)
          f = Cast <to = 1> (e)
          y = Mul (x, f)
        }"""
    )
    folded, change = t.fold_constants(model)
    assert change.changed and ops(folded) == ["Mul"], ops(folded)
    x = RNG.standard_normal(4).astype(np.float32)
    np.testing.assert_array_equal(run(folded, {"x": x})[0], x * 3)


IF_MODEL = """<ir_version: 8, opset_import: ["": 13]>
g (float[2] x) => (float[2] y) {
  cond = Equal(sr, k)
  y = If(cond) <
    then_branch = t () => (float[2] a) { a = Relu(x) },
    else_branch = e () => (float[2] b) { b = Neg(x) }
  >
}"""


@pytest.mark.parametrize(("sr", "expected"), [(16000, "Relu"), (8000, "Neg")])
def test_fold_constants_inlines_if_on_constant_condition(sr: int, expected: str) -> None:
    model = with_inits(
        parse(IF_MODEL, False), ("sr", np.array(sr, np.int64)), ("k", np.array(16000, np.int64))
    )
    folded, change = t.fold_constants(model)
    assert ops(folded) == [expected]
    assert any("inlined" in line for line in change.details)
    x = np.array([-1.0, 2.0], np.float32)
    np.testing.assert_array_equal(run(folded, {"x": x})[0], run(model, {"x": x})[0])


GATED = """<ir_version: 8, opset_import: ["": 13]>
g (float[1, 4] x) => (float[1, 4] y, float[1, 1] score) {
  lo = ReduceMin<keepdims = 1>(x)
  score = Sigmoid(lo)
  cond = Greater(score, half)
  y = If(cond) <
    then_branch = t () => (THEN a) { h = Sqrt(x) \n a = Mul(h, two) },
    else_branch = e () => (float[1, 4] b) { h = Neg(x) \n b = Add(h, score) }
  >
}"""


def gated_model(then_type: str = "float[1, 4]", two: tuple[int, ...] = ()) -> onnx.ModelProto:
    """A score-gated branch; both branches define a local ``h`` (inlining must rename one)."""
    return with_inits(
        parse(GATED.replace("THEN", then_type)),
        ("half", np.array(0.5, np.float32)),
        ("two", np.full(two, 2.0, np.float32)),
    )


def test_lower_data_dependent_ifs_computes_both_branches_and_selects() -> None:
    """An If on a computed score becomes both branches + Where and computes the same, including
    inputs where the branch not taken gives NaN (Sqrt of a negative)."""
    model = gated_model()
    lowered, change = t.lower_data_dependent_ifs(model)
    onnx.checker.check_model(lowered, full_check=True)
    assert "If" not in ops(lowered) and "Where" in ops(lowered)
    assert list(change.details) == ["computed both branches of If 'y' and selected with Where"]
    taken = set()
    for x in (RNG.uniform(0.1, 2.0, (1, 4)), RNG.uniform(-2.0, 2.0, (1, 4)), -np.ones((1, 4))):
        feeds = {"x": x.astype(np.float32)}
        expected, got = run(model, feeds), run(lowered, feeds)
        taken.add(bool(expected[1].item() > 0.5))
        for a, b in zip(expected, got, strict=True):
            np.testing.assert_array_equal(a, b)
            assert np.isfinite(b).all()
    assert taken == {True, False}, "both branches must be exercised"
    _, noop = t.lower_data_dependent_ifs(lowered)
    assert not noop.changed


def test_lower_data_dependent_ifs_keeps_an_if_whose_branches_differ_in_shape() -> None:
    model = gated_model(then_type="float[2, 4]", two=(2, 1))  # a broadcast Where would hide it
    lowered, change = t.lower_data_dependent_ifs(model)
    assert ops(lowered) == ops(model)  # kept, and the report says why
    assert len(change.details) == 1 and "different or unknown shapes" in change.details[0]


def test_lower_data_dependent_ifs_keeps_an_if_with_a_random_branch() -> None:
    model = gated_model()
    branch = next(a.g for a in model.graph.node[-1].attribute if a.name == "then_branch")
    branch.node[0].CopyFrom(oh.make_node("RandomNormalLike", ["x"], ["h"]))
    lowered, change = t.lower_data_dependent_ifs(model)
    assert "If" in ops(lowered) and "RandomNormalLike" in change.details[0]


@pytest.mark.qnn
def test_score_gated_verifier_compiles_whole_on_the_htp(tmp_path) -> None:
    """A keyword spotter's "run the verifier when the first score passes" head: before the
    lowering, qnn_preprocess failed on the If; now it builds whole on the HTP and accurate."""
    text = """<ir_version: 8, opset_import: ["": 13]>
    g (float[1, 16] x) => (float[1, 1] p) {
      z = MatMul(x, w1)
      s = Sigmoid(z)
      cond = GreaterOrEqual(s, half)
      p = If(cond) <
        then_branch = t () => (float[1, 1] q) {
          h = MatMul(x, w2) \n r = Relu(h) \n v = MatMul(r, w3) \n q = Sigmoid(v)
        },
        else_branch = e () => (float[1, 1] r) { r = Identity(s) }
      >
    }"""
    rng = np.random.default_rng(3)
    model = with_inits(
        parse(text),
        ("w1", (rng.standard_normal((16, 1)) * 0.3).astype(np.float32)),
        ("w2", (rng.standard_normal((16, 8)) * 0.3).astype(np.float32)),
        ("w3", (rng.standard_normal((8, 1)) * 0.3).astype(np.float32)),
        ("half", np.array(0.5, np.float32)),
    )
    build_whole_on_htp(tmp_path, "gated", model, samples=32)


def test_fold_constants_keeps_results_that_would_bloat_the_model() -> None:
    model = with_inits(
        parse(
            '<ir_version: 8, opset_import: ["": 13]> g (float[1024, 1024] x) => '
            "(float[1024, 1024] y) { big = Expand(one, shape) \n y = Add(x, big) }"
        ),
        ("one", np.ones(1, np.float32)),
        ("shape", np.array([1024, 1024], np.int64)),
    )
    folded, change = t.fold_constants(model, max_bytes=1 << 20)
    assert ops(folded) == ["Expand", "Add"] and not change.changed


def test_fold_constants_reads_a_shared_weight_once() -> None:
    """A module applied 3 times: the exporter reads its weight through an Identity per use
    (and a Reshape per use here). Folded, each use reads the one weight the graph holds, not a
    copy of its own (an 85 MB transformer had grown to 642 MB); a weight that differs in one
    value stays its own."""
    w = (RNG.standard_normal((64, 64)) * 0.1).astype(np.float32)
    near = w.copy()
    near[3, 5] += 1e-3
    model = with_inits(
        parse(
            """<ir_version: 8, opset_import: ["": 13]>
            g (float[2, 64] x) => (float[2, 64] y) {
              w1 = Identity(w)
              w2 = Identity(w)
              w3 = Identity(near)
              f1 = Reshape(w, flat)
              f2 = Reshape(w, flat)
              a = MatMul(x, w1)
              b = MatMul(a, w2)
              c = MatMul(b, w3)
              r1 = Reshape(f1, square)
              r2 = Reshape(f2, square)
              d = MatMul(c, r1)
              y = MatMul(d, r2)
            }"""
        ),
        ("w", w),
        ("near", near),
        ("flat", np.array([4096], np.int64)),
        ("square", np.array([64, 64], np.int64)),
    )
    folded, change = t.fold_constants(model)
    assert ops(folded) == ["MatMul"] * 5
    weights = [i for i in folded.graph.initializer if i.dims and i.dims[-1] == 64]
    assert sorted(i.name for i in weights) == ["near", "w"]
    assert [n.input[1] for n in folded.graph.node] == ["w", "w", "near", "w", "w"]
    assert any("3 Identity node(s) of a constant" in line for line in change.details)
    assert any("equal to a constant held" in line for line in change.details)  # the Reshapes
    x = RNG.standard_normal((2, 64)).astype(np.float32)
    np.testing.assert_array_equal(run(folded, {"x": x})[0], run(model, {"x": x})[0])


# --- batch norm -----------------------------------------------------------------------------


def bn_params(channels: int) -> list[tuple[str, np.ndarray]]:
    return [
        ("gamma", RNG.uniform(0.5, 1.5, channels).astype(np.float32)),
        ("beta", RNG.standard_normal(channels).astype(np.float32)),
        ("mean", RNG.standard_normal(channels).astype(np.float32)),
        ("var", RNG.uniform(0.5, 2.0, channels).astype(np.float32)),
    ]


def assert_same(a: onnx.ModelProto, b: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    for x, y in zip(run(a, feeds), run(b, feeds), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


CONV_BN = """<ir_version: 8, opset_import: ["": 13]>
g (float[1, 3, 8, 8] x) => (float[1, 4, 8, 8] y) {
  c = Conv<pads = [1, 1, 1, 1]>(x, w)
  y = BatchNormalization<epsilon = 0.001>(c, gamma, beta, mean, var)
}"""


def test_fold_batchnorm_into_conv() -> None:
    model = with_inits(
        parse(CONV_BN, False),
        ("w", RNG.standard_normal((4, 3, 3, 3)).astype(np.float32)),
        *bn_params(4),
    )
    folded, change = t.fold_batchnorm(model)
    assert ops(folded) == ["Conv"] and len(change.details) == 1
    assert_same(model, folded, {"x": RNG.standard_normal((1, 3, 8, 8)).astype(np.float32)})


def test_fold_batchnorm_into_grouped_conv_transpose() -> None:
    model = with_inits(
        parse(
            '<ir_version: 8, opset_import: ["": 13]> g (float[1, 4, 5, 5] x) => '
            "(float[1, 6, 6, 6] y) { c = ConvTranspose<group = 2>(x, w, b) \n"
            " y = BatchNormalization(c, gamma, beta, mean, var) }"
        ),
        ("w", RNG.standard_normal((4, 3, 2, 2)).astype(np.float32)),
        ("b", RNG.standard_normal(6).astype(np.float32)),
        *bn_params(6),
    )
    folded, change = t.fold_batchnorm(model)
    assert ops(folded) == ["ConvTranspose"] and change.changed
    assert_same(model, folded, {"x": RNG.standard_normal((1, 4, 5, 5)).astype(np.float32)})


@pytest.mark.parametrize("trans_b", [0, 1])
def test_fold_batchnorm_into_gemm(trans_b: int) -> None:
    w_shape = (5, 3) if trans_b else (3, 5)
    model = with_inits(
        parse(
            '<ir_version: 8, opset_import: ["": 13]> g (float[2, 3] x) => (float[2, 5] y) {'
            f" c = Gemm<transB = {trans_b}, beta = 0.5>(x, w, b) \n"
            " y = BatchNormalization(c, gamma, beta, mean, var) }"
        ),
        ("w", RNG.standard_normal(w_shape).astype(np.float32)),
        ("b", RNG.standard_normal(5).astype(np.float32)),
        *bn_params(5),
    )
    folded, _ = t.fold_batchnorm(model)
    assert ops(folded) == ["Gemm"]
    assert_same(model, folded, {"x": RNG.standard_normal((2, 3)).astype(np.float32)})


def test_fold_batchnorm_into_matmul_adds_the_shift() -> None:
    model = with_inits(
        parse(
            '<ir_version: 8, opset_import: ["": 13]> g (float[2, 3] x) => (float[2, 5] y) {'
            " c = MatMul(x, w) \n y = BatchNormalization(c, gamma, beta, mean, var) }"
        ),
        ("w", RNG.standard_normal((3, 5)).astype(np.float32)),
        *bn_params(5),
    )
    folded, _ = t.fold_batchnorm(model)
    assert ops(folded) == ["MatMul", "Add"]
    assert_same(model, folded, {"x": RNG.standard_normal((2, 3)).astype(np.float32)})


def test_fold_batchnorm_noop_when_conv_output_has_another_reader() -> None:
    model = with_inits(
        parse(
            '<ir_version: 8, opset_import: ["": 13]> g (float[1, 3, 8, 8] x) => '
            "(float[1, 4, 8, 8] y, float[1, 4, 8, 8] c) {"
            " c = Conv<pads = [1, 1, 1, 1]>(x, w) \n"
            " y = BatchNormalization(c, gamma, beta, mean, var) }"
        ),
        ("w", RNG.standard_normal((4, 3, 3, 3)).astype(np.float32)),
        *bn_params(4),
    )
    folded, change = t.fold_batchnorm(model)
    assert ops(folded) == ["Conv", "BatchNormalization"] and not change.changed


CONV_TRANSPOSE_AFFINE = """<ir_version: 8, opset_import: ["": 13]>
g (float[1, 4, 5, 5] x) => (float[1, 6, 10, 10] y) {
  c = ConvTranspose<group = 2, strides = [2, 2]>(x, w)
  biased = Add(bias, c)
  normed = BatchNormalization(biased, gamma, beta, mean, var)
  halved = Div(normed, two)
  y = Sub(halved, shift)
}"""


def conv_transpose_affine(**changed: np.ndarray) -> onnx.ModelProto:
    """ConvTranspose without bias, then a per-channel Add, a BatchNorm, a scalar Div and a
    per-channel Sub: what Paddle's exporter writes for a detector's upsampling head."""
    arrays = {
        "w": RNG.standard_normal((4, 3, 2, 2)).astype(np.float32),
        "bias": RNG.standard_normal((1, 6, 1, 1)).astype(np.float32),
        **dict(bn_params(6)),
        "two": np.array(2.0, np.float32),
        "shift": RNG.standard_normal((6, 1, 1)).astype(np.float32),
    }
    arrays.update(changed)
    return with_inits(parse(CONV_TRANSPOSE_AFFINE), *arrays.items())


def test_fold_conv_affine_folds_a_chain_into_a_conv_transpose() -> None:
    model = conv_transpose_affine()
    folded, change = t.fold_conv_affine(model)
    assert ops(folded) == ["ConvTranspose"], ops(folded)
    assert len(change.details) == 4 and "Add" in change.details[0]
    assert_same(model, folded, {"x": RNG.standard_normal((1, 4, 5, 5)).astype(np.float32)})


@pytest.mark.parametrize(
    ("changed", "kept"),
    [
        # a constant that varies over space is not a bias: the chain stops at it
        (
            {"bias": np.ones((1, 6, 10, 10), np.float32)},
            ["ConvTranspose", "Add", "BatchNormalization", "Div", "Sub"],
        ),
        # a Div by a zero stays (and what follows it)
        ({"two": np.array(0.0, np.float32)}, ["ConvTranspose", "Div", "Sub"]),
    ],
)
def test_fold_conv_affine_stops_where_the_constant_is_not_per_channel(
    changed: dict[str, np.ndarray], kept: list[str]
) -> None:
    folded, _ = t.fold_conv_affine(conv_transpose_affine(**changed))
    assert ops(folded) == kept, ops(folded)


def test_fold_conv_affine_leaves_an_output_read_twice_and_a_constant_minus_conv() -> None:
    model = with_inits(
        parse(
            '<ir_version: 8, opset_import: ["": 13]> g (float[1, 3, 8, 8] x) => '
            "(float[1, 4, 8, 8] y, float[1, 4, 8, 8] z) {"
            " c = Conv<pads = [1, 1, 1, 1]>(x, w) \n y = Add(c, b) \n"
            " d = Conv<pads = [1, 1, 1, 1]>(x, w) \n z = Sub(b, d) }"
        ),
        ("w", RNG.standard_normal((4, 3, 3, 3)).astype(np.float32)),
        ("b", RNG.standard_normal((4, 1, 1)).astype(np.float32)),
    )
    model.graph.output.append(oh.make_tensor_value_info("c", TensorProto.FLOAT, [1, 4, 8, 8]))
    folded, change = t.fold_conv_affine(model)
    assert ops(folded) == ["Conv", "Add", "Conv", "Sub"] and not change.changed


def test_preparation_folds_a_bias_add_and_the_batchnorm_behind_it() -> None:
    """In prepare_model's order, nothing of the chain is left beside the ConvTranspose."""
    model = conv_transpose_affine()
    prepared, _ = prepare_model(model, InputsSection())
    assert ops(prepared) == ["ConvTranspose"], ops(prepared)
    assert_same(model, prepared, {"x": RNG.standard_normal((1, 4, 5, 5)).astype(np.float32)})


def quantized_ctx_vs_qdq(
    work: Path, variants: dict[str, onnx.ModelProto], samples: list[dict[str, np.ndarray]]
) -> dict[str, float]:
    """Each float model of ``variants`` quantized with onnxruntime's QNN recipe on
    ``samples``, then its ctx vs its QDQ model on the HTP simulator (first sample), in dB."""
    from compile_fixtures import _quantize_qnn, ctx_vs_qdq_on_htp

    np.savez(work / "sample.npz", **samples[0])
    results = {}
    for name, float_model in variants.items():
        onnx.save(float_model, str(work / f"{name}.onnx"))
        _quantize_qnn(work / f"{name}.onnx", work / f"{name}_qdq.onnx", samples)
        results[name] = ctx_vs_qdq_on_htp(
            work / f"{name}_qdq.onnx", work / f"{name}.onnx", work / "sample.npz", work / name
        )
    return results


@pytest.mark.qnn
def test_the_htp_computes_a_folded_conv_transpose_bias_right(tmp_path: Path) -> None:
    """Quantized apart, a ConvTranspose and its bias Add are fused by the HTP with the Add's
    zero point dropped (every output shifted by it); folded, the bias is the op's own."""
    rng = np.random.default_rng(11)
    model = with_inits(
        parse(
            '<ir_version: 10, opset_import: ["": 21]> g (float[1, 8, 12, 12] x) => '
            "(float[1, 8, 24, 24] y) { c = ConvTranspose<strides = [2, 2]>(x, w) \n"
            " y = Add(c, bias) }"
        ),
        ("w", rng.normal(0, 0.3, (8, 8, 2, 2)).astype(np.float32)),
        ("bias", rng.normal(1.0, 0.5, (1, 8, 1, 1)).astype(np.float32)),
    )
    samples = [{"x": rng.normal(0, 1, (1, 8, 12, 12)).astype(np.float32)} for _ in range(4)]
    variants = {"apart": model, "folded": t.fold_conv_affine(model)[0]}
    results = quantized_ctx_vs_qdq(tmp_path, variants, samples)
    assert results["folded"] > 50.0, results
    # If a new QNN SDK keeps the zero point, this says so: the rule is then only a cleanup.
    assert results["apart"] < results["folded"] - 15.0, results


def wide_rgb_conv(kernel: int = 9, channels: int = 3, pads: int = 4) -> onnx.ModelProto:
    """A Conv over an image's 3 channels with a 9x9 kernel and 'same' padding: the first
    layer of Johnson-style style transfer nets (WinML's fast-neural-style models)."""
    rng = np.random.default_rng(17)
    fan_in = channels * kernel * kernel
    return with_inits(
        parse(
            f'<ir_version: 10, opset_import: ["": 21]> g (float[1, {channels}, 24, 24] x) => '
            f"(float[1, 8, {24 + 2 * pads - kernel + 1}, {24 + 2 * pads - kernel + 1}] y) "
            f"{{ y = Conv<pads = [{pads}, {pads}, {pads}, {pads}]>(x, w, b) }}"
        ),
        ("w", rng.normal(0, 1 / np.sqrt(fan_in), (8, channels, kernel, kernel)).astype(np.float32)),
        ("b", rng.normal(0, 0.1, 8).astype(np.float32)),
    )


@pytest.mark.parametrize(
    ("kernel", "channels", "pads", "rewritten"),
    [(9, 3, 4, True), (9, 3, 2, True), (9, 3, 0, False), (7, 3, 3, False), (9, 4, 4, False)],
)
def test_a_padded_9x9_conv_of_3_channels_gets_an_explicit_pad(
    kernel: int, channels: int, pads: int, rewritten: bool
) -> None:
    model = wide_rgb_conv(kernel, channels, pads)
    result, change = t.explicit_conv_pads(model)
    assert change.changed is rewritten
    if not rewritten:
        return
    assert [n.op_type for n in result.graph.node] == ["Pad", "Conv"]
    conv = result.graph.node[1]
    assert not any(a.name == "pads" for a in conv.attribute)
    x = np.random.default_rng(5).normal(0, 1, (1, channels, 24, 24)).astype(np.float32)
    np.testing.assert_allclose(run(result, {"x": x})[0], run(model, {"x": x})[0], atol=1e-5)
    assert ops(prepare_model(model, InputsSection())[0]) == ["Pad", "Conv"]


@pytest.mark.qnn
def test_the_htp_computes_a_9x9_conv_of_3_channels_right_after_an_explicit_pad(
    tmp_path: Path,
) -> None:
    """With its own pads and a 16-bit input whose zero point is not 0, the HTP's result is
    garbage; after a Pad of zeros it agrees with the CPU."""
    rng = np.random.default_rng(19)
    model = wide_rgb_conv()
    samples = [{"x": rng.normal(0, 1, (1, 3, 24, 24)).astype(np.float32)} for _ in range(4)]
    variants = {"own": model, "explicit": t.explicit_conv_pads(model)[0]}
    results = quantized_ctx_vs_qdq(tmp_path, variants, samples)
    assert results["explicit"] > 40.0, results
    # If a new QNN SDK pads this Conv right, this says so: the rule is then only exact.
    assert results["own"] < 20.0, results


REDUCE_FUNCTIONS = ["ReduceSumSquare", "ReduceL1", "ReduceLogSum"]


def conv_then(op: str, channels: int = 8) -> onnx.ModelProto:
    """Conv -> ``op``: Mish (YOLOv4-style activations), a 2-group GroupNormalization, or a
    reduction over the channels of |Conv| (an audio front end's power: re^2 + im^2)."""
    rng = np.random.default_rng(13)
    inits = [("w", rng.normal(0, 0.5, (channels, 3, 3, 3)).astype(np.float32))]
    inputs, attrs, out_channels = ["c"], {}, channels
    if op == "GroupNormalization":
        inits += [
            ("g", rng.uniform(0.5, 1.5, channels).astype(np.float32)),
            ("b", rng.normal(0, 1, channels).astype(np.float32)),
        ]
        inputs, attrs = ["c", "g", "b"], {"num_groups": 2}
    nodes = [oh.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1])]
    if op in REDUCE_FUNCTIONS:
        inits.append(("axes", np.array([1], np.int64)))
        nodes.append(oh.make_node("Abs", ["c"], ["a"]))
        inputs, out_channels = ["a", "axes"], 1
    graph = oh.make_graph(
        [*nodes, oh.make_node(op, inputs, ["y"], **attrs)],
        "g",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, out_channels, 16, 16])],
        weights(*inits),
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


ACTIVATION_FUNCTIONS = ["Mish", "Softsign", "Celu", "Shrink"]
# Their function bodies read an attribute default through a Constant (axes, lambd).
NORMALIZATIONS = ["GroupNormalization", "MeanVarianceNormalization"]


@pytest.mark.parametrize("op", [*ACTIVATION_FUNCTIONS, *NORMALIZATIONS, *REDUCE_FUNCTIONS])
def test_function_ops_the_qnn_ep_refuses_become_their_onnx_definition(op: str) -> None:
    model = conv_then(op)
    expanded, change = t.expand_function_ops(model)
    assert change.changed and op not in ops(expanded)
    feeds = {"x": RNG.standard_normal((1, 3, 16, 16)).astype(np.float32)}
    assert_same(model, expanded, feeds)
    prepared, _ = prepare_model(model, InputsSection())
    assert op not in ops(prepared) and "Shape" not in ops(prepared)  # the shape math folded
    assert_same(model, prepared, feeds)


@pytest.mark.qnn
def test_mish_is_refused_by_the_qnn_ep_and_its_definition_is_whole(tmp_path: Path) -> None:
    """Mish itself does not compile for the HTP, Softsign, Celu and Shrink stay on the CPU;
    expanded, the real stages build them whole and accurate (as GroupNormalization, whose own
    layout transform the EP refuses, MeanVarianceNormalization, which qnn_preprocess_model
    leaves untyped, and the reductions the EP leaves on the CPU)."""
    from pipeline.htp.probe import probe

    np.savez(tmp_path / "sample.npz", x=RNG.standard_normal((1, 3, 16, 16)).astype(np.float32))
    for op in ACTIVATION_FUNCTIONS:
        path = tmp_path / f"{op}.onnx"
        onnx.save(conv_then(op), str(path))
        result = probe(path, path, [tmp_path / "sample.npz"], tmp_path / f"as_is_{op}", 60, 73)
        # If a new QNN SDK compiles the op, this says so: its expansion is then only exact.
        whole = result.ok and result.partitions == 1 and result.cpu_nodes == 0
        assert not whole, (op, result.error, result.partitions, result.cpu_nodes)
    for op in (*ACTIVATION_FUNCTIONS, *NORMALIZATIONS, *REDUCE_FUNCTIONS):
        (tmp_path / op).mkdir()
        build_whole_on_htp(tmp_path / op, op.lower(), conv_then(op))


def conv_pad_conv(mode: str, axes: list[int], pads: list[int]) -> onnx.ModelProto:
    """Conv -> Pad(mode, pads of ``axes`` only) -> Conv, opset 21 (the axes input: opset 18)."""
    rng = np.random.default_rng(5)
    conv = [rng.normal(0, 0.4, (8, c, 3, 3)).astype(np.float32) for c in (3, 8)]
    graph = oh.make_graph(
        [
            oh.make_node("Conv", ["x", "w1"], ["c"]),
            oh.make_node("Pad", ["c", "pads", "", "axes"], ["p"], mode=mode),
            oh.make_node("Conv", ["p", "w2"], ["y"]),
        ],
        "pad_axes",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 18, 18])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, "h", "w"])],
        weights(
            ("w1", conv[0]),
            ("w2", conv[1]),
            ("pads", np.array(pads, np.int64)),
            ("axes", np.array(axes, np.int64)),
        ),
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize(
    ("mode", "axes", "pads"),
    [("reflect", [2, 3], [1, 2, 2, 1]), ("constant", [-1], [0, 3]), ("edge", [3, 2], [1, 0, 0, 2])],
)
def test_pads_of_some_axes_become_pads_of_every_axis(mode: str, axes: list, pads: list) -> None:
    model = conv_pad_conv(mode, axes, pads)
    full, change = t.pads_over_every_axis(model)
    assert change.changed
    (pad,) = [n for n in full.graph.node if n.op_type == "Pad"]
    assert len(pad.input) == 2 and edit.initializers_by_name(full.graph)[pad.input[1]].dims == [8]
    feeds = {"x": RNG.standard_normal((1, 3, 18, 18)).astype(np.float32)}
    assert_same(model, full, feeds)
    assert not t.pads_over_every_axis(full)[1].changed


def center_crop_then_rms_norm() -> onnx.ModelProto:
    """Conv -> CenterCropPad to 12x20 (crops H, pads W) -> RMSNormalization over the channels
    (opset 23: an image model's crop and a modern normalization, both function ops)."""
    rng = np.random.default_rng(6)
    graph = oh.make_graph(
        [
            oh.make_node("Conv", ["x", "w1"], ["c"], pads=[1, 1, 1, 1]),
            oh.make_node("CenterCropPad", ["c", "size"], ["cropped"], axes=[2, 3]),
            oh.make_node("Transpose", ["cropped"], ["last"], perm=[0, 2, 3, 1]),
            oh.make_node("RMSNormalization", ["last", "scale"], ["normed"], axis=-1),
            oh.make_node("Transpose", ["normed"], ["back"], perm=[0, 3, 1, 2]),
            oh.make_node("Conv", ["back", "w2"], ["y"], pads=[1, 1, 1, 1]),
        ],
        "crop_norm",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 12, 20])],
        weights(
            ("w1", rng.normal(0, 0.4, (8, 3, 3, 3)).astype(np.float32)),
            ("w2", rng.normal(0, 0.4, (8, 8, 3, 3)).astype(np.float32)),
            ("size", np.array([12, 20], np.int64)),
            ("scale", rng.uniform(0.5, 1.5, 8).astype(np.float32)),
        ),
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 23)], ir_version=10)


def test_center_crop_pad_and_rms_norm_become_their_definitions_exactly() -> None:
    model = center_crop_then_rms_norm()
    prepared, changes = prepare_model(model, InputsSection())
    kinds = set(ops(prepared))
    assert not kinds & {"CenterCropPad", "RMSNormalization", "Shape"}, kinds
    pads = [n for n in prepared.graph.node if n.op_type == "Pad"]
    assert all(len(n.input) < 4 or not n.input[3] for n in pads)  # no axes left
    assert any(c.step == "pads_over_every_axis" and c.changed for c in changes)
    assert_same(model, prepared, {"x": RNG.standard_normal((1, 3, 16, 16)).astype(np.float32)})


def test_rotary_embedding_becomes_its_definition_exactly() -> None:
    """RotaryEmbedding-23 over [batch, heads, sequence, head size] with cos/sin caches read at
    position ids (a decoder's attention): the QNN EP has no kernel for it."""
    rng = np.random.default_rng(7)
    angles = np.outer(np.arange(16), 1.0 / 10000 ** (np.arange(4) / 4)).astype(np.float32)
    graph = oh.make_graph(
        [oh.make_node("RotaryEmbedding", ["x", "cos", "sin", "positions"], ["y"])],
        "rope",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 6, 8])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 6, 8])],
        weights(
            ("cos", np.cos(angles)),
            ("sin", np.sin(angles)),
            ("positions", np.arange(3, 9, dtype=np.int64).reshape(1, 6)),
        ),
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 23)], ir_version=10)
    expanded, change = t.expand_function_ops(model)
    assert change.changed and "RotaryEmbedding" not in ops(expanded)
    feeds = {"x": rng.standard_normal((1, 2, 6, 8)).astype(np.float32)}
    assert_same(model, expanded, feeds)


@pytest.mark.qnn
def test_pads_of_some_axes_and_center_crops_are_whole_on_the_htp(tmp_path: Path) -> None:
    """A reflect Pad of H and W only and a CenterCropPad: every context of either failed to
    build before; now whole on the HTP and accurate."""
    for name, model in (
        ("pad_axes", conv_pad_conv("reflect", [2, 3], [1, 2, 2, 1])),
        ("crop_norm", center_crop_then_rms_norm()),
    ):
        (tmp_path / name).mkdir()
        build_whole_on_htp(tmp_path / name, name, model)


def einsum_model(equation: str, shapes: list[tuple[int, ...]], out: list[int]) -> onnx.ModelProto:
    inputs = [f"x{i}" for i in range(len(shapes))]
    graph = oh.make_graph(
        [oh.make_node("Einsum", inputs, ["y"], equation=equation)],
        "einsum",
        [
            oh.make_tensor_value_info(n, TensorProto.FLOAT, s)
            for n, s in zip(inputs, shapes, strict=True)
        ],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, out)],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize(
    ("equation", "shapes", "out"),
    [
        ("bhqd,bhkd->bhqk", [(2, 3, 4, 5), (2, 3, 6, 5)], [2, 3, 4, 6]),
        ("abc,cde->abde", [(2, 4, 6), (6, 3, 5)], [2, 4, 3, 5]),  # Keras MHA projection
        ("aecd,abcd->acbe", [(2, 5, 3, 4), (2, 6, 3, 4)], [2, 3, 6, 5]),  # Keras MHA scores
        ("bi,bi->b", [(3, 4), (3, 4)], [3]),
        ("i,j", [(3,), (4,)], [3, 4]),  # implicit output: outer product
        ("ijk,kl->jl", [(2, 3, 4), (4, 5)], [3, 5]),  # i summed on its own side first
        ("bij->jb", [(2, 3, 4)], [3, 2]),
    ],
)
def test_einsum_becomes_matmul_transpose_and_reshape(
    equation: str, shapes: list[tuple[int, ...]], out: list[int]
) -> None:
    model = einsum_model(equation, shapes, out)
    rewritten, change = t.einsum_to_matmul(model)
    assert change.changed and "Einsum" not in ops(rewritten)
    feeds = {f"x{i}": RNG.standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)}
    assert_same(model, rewritten, feeds)


@pytest.mark.parametrize(
    ("equation", "shapes", "out"),
    [
        ("...ij,...jk", [(2, 3, 4), (2, 4, 5)], [2, 3, 5]),  # ellipsis
        ("ii->i", [(3, 3)], [3]),  # a diagonal
        ("bij,bjk->bik", [(1, 3, 4), (2, 4, 5)], [2, 3, 5]),  # b broadcast from 1
    ],
)
def test_einsum_this_rewrite_cannot_express_stays(
    equation: str, shapes: list[tuple[int, ...]], out: list[int]
) -> None:
    assert not t.einsum_to_matmul(einsum_model(equation, shapes, out))[1].changed


def keras_einsum_attention() -> onnx.ModelProto:
    """Keras MultiHeadAttention's einsums (2 heads of 4 over 8 features, 6 tokens)."""
    rng = np.random.default_rng(17)
    nodes = [
        oh.make_node("Einsum", ["x", name], [out], equation="abc,cde->abde")
        for name, out in (("wq", "q"), ("wk", "k"), ("wv", "v"))
    ]
    nodes += [
        oh.make_node("Einsum", ["k", "q"], ["scores"], equation="aecd,abcd->acbe"),
        oh.make_node("Softmax", ["scores"], ["p"], axis=-1),
        oh.make_node("Einsum", ["p", "v"], ["heads"], equation="acbe,aecd->abcd"),
        oh.make_node("Einsum", ["heads", "wo"], ["y"], equation="abcd,cde->abe"),
    ]
    graph = oh.make_graph(
        nodes,
        "keras_attention",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, 8])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, 8])],
        weights(
            *((n, rng.normal(0, 0.35, (8, 2, 4)).astype(np.float32)) for n in ("wq", "wk", "wv")),
            ("wo", rng.normal(0, 0.35, (2, 4, 8)).astype(np.float32)),
        ),
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


@pytest.mark.qnn
def test_keras_einsum_attention_builds_whole_on_the_htp(tmp_path: Path) -> None:
    model = keras_einsum_attention()
    assert "Einsum" not in ops(prepare_model(model, InputsSection())[0])
    build_whole_on_htp(tmp_path, "einsum_attention", model)


# --- float16, legacy ops, opset -------------------------------------------------------------


def test_float16_to_float32_everywhere() -> None:
    model = with_inits(
        parse(
            '<ir_version: 8, opset_import: ["": 13]> g (float16[3] x) => (float16[3] y) {'
            " a = Add(x, w) \n f = Cast<to = 1>(a) \n y = Cast<to = 10>(f) }"
        ),
        ("w", np.array([1.5, -2.0, 0.25], np.float16)),
    )
    converted, change = t.float16_to_float32(model)
    elem = lambda v: v.type.tensor_type.elem_type  # noqa: E731
    assert elem(converted.graph.input[0]) == elem(converted.graph.output[0]) == TensorProto.FLOAT
    assert converted.graph.initializer[0].data_type == TensorProto.FLOAT
    assert any("Cast" in line for line in change.details)
    x = np.array([1.0, 2.0, 3.0], np.float32)
    np.testing.assert_allclose(run(converted, {"x": x})[0], [2.5, 0.0, 3.25])
    _, noop = t.float16_to_float32(converted)
    assert not noop.changed


def test_a_bfloat16_model_becomes_float32_exactly_and_prepares() -> None:
    """A .bfloat16() export: onnxruntime's CPU EP runs no bfloat16 Conv, numpy feeds none."""
    w = np.array([0.5, -1.25, 3.0, 0.0078125], np.float32).reshape(4, 1, 1, 1)
    graph = oh.make_graph(
        [oh.make_node("Conv", ["x", "w"], ["y"], group=4)],
        "bf16",
        [oh.make_tensor_value_info("x", TensorProto.BFLOAT16, [1, 4, 2, 2])],
        [oh.make_tensor_value_info("y", TensorProto.BFLOAT16, [1, 4, 2, 2])],
        [oh.make_tensor("w", TensorProto.BFLOAT16, [4, 1, 1, 1], w.flatten().tolist())],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    converted, change = t.bfloat16_to_float32(model)
    elem = lambda v: v.type.tensor_type.elem_type  # noqa: E731
    assert elem(converted.graph.input[0]) == elem(converted.graph.output[0]) == TensorProto.FLOAT
    np.testing.assert_array_equal(numpy_helper.to_array(converted.graph.initializer[0]), w)
    assert any("bfloat16 initializer" in line for line in change.details)
    x = np.arange(16, dtype=np.float32).reshape(1, 4, 2, 2)
    prepared, _ = prepare_model(model, InputsSection(dims={}, shapes={}, constants={}))
    np.testing.assert_array_equal(run(prepared, {"x": x})[0], x * w.reshape(1, 4, 1, 1))


def test_float16_model_with_float_io_keeps_no_cast() -> None:
    """fp16 inside, fp32 at the edges: after float16_to_float32 its Casts are float -> float
    and preparation removes them (quantized, each would be a requantization on the HTP)."""
    model = with_inits(
        parse(
            '<ir_version: 8, opset_import: ["": 13]> g (float[3] x) => (float[3] y) {'
            " h = Cast<to = 10>(x) \n a = Add(h, w) \n y = Cast<to = 1>(a) }"
        ),
        ("w", np.array([1.5, -2.0, 0.25], np.float16)),
    )
    prepared, _ = prepare_model(model, InputsSection(dims={}, shapes={}, constants={}))
    assert ops(prepared) == ["Add"]
    x = np.array([1.0, 2.0, 3.0], np.float32)
    np.testing.assert_allclose(run(prepared, {"x": x})[0], [2.5, 0.0, 3.25])


def test_a_float64_tail_becomes_float32_and_prepares() -> None:
    """A float32 network whose decoding an exporter wrote in double: Cast(double) -> Softmax
    -> Mul by a double constant -> a double output (SwiftF0's pitch)."""
    model = with_inits(
        parse(
            '<ir_version: 8, opset_import: ["": 17]> g (float[1, 8] x) => (double[1, 8] y) {'
            " d = Cast<to = 11>(x) \n p = Softmax<axis = -1>(d) \n y = Mul(p, w) }"
        ),
        ("w", np.linspace(50.0, 2000.0, 8)),
    )
    converted, change = t.float64_to_float32(model)
    elem = lambda v: v.type.tensor_type.elem_type  # noqa: E731
    assert elem(converted.graph.output[0]) == TensorProto.FLOAT
    assert converted.graph.initializer[0].data_type == TensorProto.FLOAT
    assert any("Cast" in line for line in change.details)
    x = np.random.default_rng(2).normal(0, 2, (1, 8)).astype(np.float32)
    want = run(model, {"x": x})[0]
    np.testing.assert_allclose(run(converted, {"x": x})[0], want, rtol=1e-5)
    prepared, _ = prepare_model(model, InputsSection(dims={}, shapes={}, constants={}))
    assert ops(prepared) == ["Softmax", "Mul"]  # the Cast to float32 of a float32 goes
    np.testing.assert_allclose(run(prepared, {"x": x})[0], want, rtol=1e-5)


def test_replace_legacy_image_scaler_then_upgrade() -> None:
    model = parse(
        '<ir_version: 4, opset_import: ["": 8]> g (float[1, 2, 2, 2] x) => (float[1, 2, 2, 2] y)'
        " { y = ImageScaler<scale: float = 2.0, bias: floats = [1.0, -1.0]>(x) }"
    )
    with pytest.raises(ModelError, match="ImageScaler"):
        t.upgrade_opset(model)
    replaced, change = t.replace_legacy_ops(model)
    assert ops(replaced) == ["Mul", "Add"] and change.changed
    upgraded, change = t.upgrade_opset(replaced)
    assert edit.opset_version(upgraded) == 21 and change.details == ("opset 8 -> 21",)
    x = RNG.standard_normal((1, 2, 2, 2)).astype(np.float32)
    np.testing.assert_allclose(run(upgraded, {"x": x})[0], run(model, {"x": x})[0], rtol=1e-6)
    _, noop = t.replace_legacy_ops(upgraded)
    assert not noop.changed
    _, noop = t.upgrade_opset(upgraded)
    assert not noop.changed


# --- HTP rewrites, qnn_preprocess, order, shapes ---------------------------------------------


def hardswish_pair(order: str = "x, s", alpha: float = 1 / 6) -> onnx.ModelProto:
    """x * HardSigmoid(x; alpha, 1/2) with named nodes, as qnn_preprocess writes a HardSwish."""
    nodes = [
        oh.make_node("HardSigmoid", ["x"], ["s"], name="gate", alpha=alpha, beta=0.5),
        oh.make_node("Mul", [a.strip() for a in order.split(",")], ["y"], name="swish"),
    ]
    shape = [1, 16, 40, 40]
    graph = oh.make_graph(
        nodes,
        "g",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


def shared_bias_convs() -> onnx.ModelProto:
    """Two Convs sharing their bias ``b``, the first one's output named ``b0``: the name
    onnxruntime's quantizer gives its copy of ``b`` (TensorFlow exports name tensors so:
    basic-pitch's ``conv1d_25`` bias, shared by 5 Convs, and ``conv1d_252`` output)."""
    rng = np.random.default_rng(21)
    graph = oh.make_graph(
        [
            oh.make_node("Conv", ["x", "w1", "b"], ["b0"], name="first", pads=[1, 1, 1, 1]),
            oh.make_node("Neg", ["b0"], ["n"], name="neg"),
            oh.make_node("Conv", ["n", "w2", "b"], ["y"], name="second", pads=[1, 1, 1, 1]),
        ],
        "g",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        weights(
            ("w1", rng.normal(0, 0.5, (4, 4, 3, 3)).astype(np.float32)),
            ("w2", rng.normal(0, 0.5, (4, 4, 3, 3)).astype(np.float32)),
            ("b", rng.normal(0, 0.5, 4).astype(np.float32)),
        ),
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


def _quantized_loads(model: onnx.ModelProto, folder: Path) -> bool:
    """Whether onnxruntime's own QDQ quantizer writes a model of ``model`` that loads."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.samples = iter([{"x": RNG.standard_normal((1, 4, 8, 8)).astype(np.float32)}])

        def get_next(self) -> dict | None:
            return next(self.samples, None)

    onnx.save(model, str(folder / "float.onnx"))
    quantize_static(folder / "float.onnx", folder / "qdq.onnx", Reader(), QuantFormat.QDQ)
    try:
        ort.InferenceSession(str(folder / "qdq.onnx"), providers=["CPUExecutionProvider"])
    except Exception:  # onnxruntime's load errors are untyped
        return False
    return True


def test_unshare_biases_gives_each_conv_its_own_and_the_quantizer_a_loadable_model(
    tmp_path: Path,
) -> None:
    model = shared_bias_convs()
    unshared, change = t.unshare_biases(model)
    assert len(change.details) == 1 and "second" in change.details[0]
    assert len({n.input[2] for n in unshared.graph.node if n.op_type == "Conv"}) == 2
    feeds = {"x": RNG.standard_normal((1, 4, 8, 8)).astype(np.float32)}
    assert_same(model, unshared, feeds)
    assert not t.unshare_biases(unshared)[1].changed
    (tmp_path / "shared").mkdir()
    (tmp_path / "own").mkdir()
    # If onnxruntime names its copies apart from other tensors, this says so.
    assert not _quantized_loads(model, tmp_path / "shared")
    assert _quantized_loads(unshared, tmp_path / "own")


def test_unshare_biases_covers_the_dynamo_group_norms_instance_norm(tmp_path: Path) -> None:
    """torch's dynamo exporter writes GroupNorm(1, C) as Reshape -> InstanceNormalization ->
    Reshape, one scale/bias pair shared by every such norm, and names tensors ``val_<n>``:
    onnxruntime's quantizer copied the bias ``val_11`` as ``val_110``, an activation's name
    (a PoolFormer's quantization stopped: "Quantization parameter shared mode is not
    supported for weight yet")."""
    rng = np.random.default_rng(5)

    def group_norm(x: str, flat: str, y: str) -> list[onnx.NodeProto]:
        return [
            oh.make_node("Reshape", [x, "to_flat"], [flat]),
            oh.make_node("InstanceNormalization", [flat, "one", "val_11"], [f"{y}_n"]),
            oh.make_node("Reshape", [f"{y}_n", "to_map"], [y]),
        ]

    graph = oh.make_graph(
        [
            *group_norm("x", "val_10", "a"),
            oh.make_node("Conv", ["a", "w"], ["c"], pads=[1, 1, 1, 1]),
            *group_norm("c", "val_110", "y"),
        ],
        "g",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        weights(
            ("to_flat", np.array([0, 1, -1], np.int64)),
            ("to_map", np.array([1, 4, 8, 8], np.int64)),
            ("one", np.ones(1, np.float32)),
            ("val_11", np.zeros(1, np.float32)),
            ("w", rng.normal(0, 0.5, (4, 4, 3, 3)).astype(np.float32)),
        ),
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)
    unshared, change = t.unshare_biases(model)
    norms = [n for n in unshared.graph.node if n.op_type == "InstanceNormalization"]
    assert change.changed and len({n.input[2] for n in norms}) == 2
    feeds = {"x": RNG.standard_normal((1, 4, 8, 8)).astype(np.float32)}
    assert_same(model, unshared, feeds)
    (tmp_path / "shared").mkdir()
    (tmp_path / "own").mkdir()
    with pytest.raises(ValueError, match="shared mode"):  # onnxruntime's own failure, as seen
        _quantized_loads(model, tmp_path / "shared")
    assert _quantized_loads(unshared, tmp_path / "own")


@pytest.mark.parametrize("order", ["x, s", "s, x"])
def test_fuse_hardswish_rejoins_the_pair(order: str) -> None:
    model = hardswish_pair(order)
    fused, change = t.fuse_hardswish(model)
    assert ops(fused) == ["HardSwish"] and change.changed
    x = np.random.default_rng(0).normal(0, 30, (1, 16, 40, 40)).astype(np.float32)
    np.testing.assert_allclose(run(fused, {"x": x})[0], run(model, {"x": x})[0], atol=1e-5)


def test_fuse_hardswish_leaves_other_pairs() -> None:
    """Another slope is not HardSwish; a gate read twice stays where it is."""
    _, change = t.fuse_hardswish(hardswish_pair(alpha=0.2))
    assert not change.changed
    twice = hardswish_pair()
    twice.graph.output.append(oh.make_tensor_value_info("s", TensorProto.FLOAT, [1, 16, 40, 40]))
    _, change = t.fuse_hardswish(twice)
    assert not change.changed


def test_preparation_keeps_a_hardswish_whole() -> None:
    """qnn_preprocess splits HardSwish into the pair; preparation ends with one op again."""
    model = oh.make_model(
        oh.make_graph(
            [oh.make_node("HardSwish", ["x"], ["y"])],
            "g",
            [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
            [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
        ),
        opset_imports=[oh.make_opsetid("", 21)],
        ir_version=10,
    )
    prepared, _ = prepare_model(model, InputsSection())
    assert ops(prepared) == ["HardSwish"]


def spelled_hardswish(
    form: str = "divide", three: float = 3.0, six: float = 6.0
) -> onnx.ModelProto:
    """x * Clip(x + 3, 0, 6) / 6 as Paddle2ONNX writes it (``divide``), with a product by 1/6
    (``sixth``), or with the gate divided first (``gate_first``); a Conv in front."""
    nodes = [
        oh.make_node("Conv", ["image", "w"], ["x"], name="conv", pads=[1, 1, 1, 1]),
        oh.make_node("Add", ["x", "three"], ["shifted"], name="shift"),
        oh.make_node("Clip", ["shifted", "zero", "six"], ["gate"], name="relu6"),
    ]
    if form == "gate_first":
        nodes += [
            oh.make_node("Div", ["gate", "six"], ["scaled"], name="scale"),
            oh.make_node("Mul", ["scaled", "x"], ["y"], name="swish"),
        ]
    else:
        nodes.append(oh.make_node("Mul", ["x", "gate"], ["product"], name="product"))
        nodes.append(
            oh.make_node("Div", ["product", "six"], ["y"], name="swish")
            if form == "divide"
            else oh.make_node("Mul", ["sixth", "product"], ["y"], name="swish")
        )
    graph = oh.make_graph(
        nodes,
        "g",
        [oh.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, 12, 12])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 12, 12])],
        weights(
            ("w", np.random.default_rng(5).normal(0, 2, (8, 3, 3, 3)).astype(np.float32)),
            ("three", np.array([three], np.float32)),
            ("zero", np.array(0.0, np.float32)),
            ("six", np.array(six, np.float32)),
            ("sixth", np.array(1 / 6, np.float32)),
        ),
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize("form", ["divide", "sixth", "gate_first"])
def test_a_spelled_out_hardswish_becomes_the_op(form: str) -> None:
    model = spelled_hardswish(form)
    fused, change = t.hardswish_from_clip(model)
    assert ops(fused) == ["Conv", "HardSwish"] and len(change.details) == 1
    assert [i.name for i in fused.graph.initializer] == ["w"]
    feeds = {"image": RNG.standard_normal((1, 3, 12, 12)).astype(np.float32)}
    np.testing.assert_allclose(run(fused, feeds)[0], run(model, feeds)[0], rtol=1e-6, atol=1e-6)


def test_what_is_not_a_hardswish_stays() -> None:
    """Another shift or bound is another function; a gate or product read elsewhere too
    stays computed; below opset 14 there is no HardSwish."""
    for other in (spelled_hardswish(three=2.0), spelled_hardswish(six=5.0)):
        assert not t.hardswish_from_clip(other)[1].changed
    for shared in ("gate", "product"):
        model = spelled_hardswish()
        model.graph.output.append(
            oh.make_tensor_value_info(shared, TensorProto.FLOAT, [1, 8, 12, 12])
        )
        assert not t.hardswish_from_clip(model)[1].changed
    old = spelled_hardswish()
    old.opset_import[0].version = 13
    assert not t.hardswish_from_clip(old)[1].changed


@pytest.mark.qnn
def test_the_htp_computes_the_pair_wrong_in_fp16_and_hardswish_right(tmp_path: Path) -> None:
    """Measured: the QNN EP's own fusion of x * HardSigmoid(x) computes x * x above 3 in fp16
    (-30.6 dB); HardSwish itself is right."""
    from compile_fixtures import whole_ctx_vs_float

    pair = hardswish_pair()
    fused, _ = t.fuse_hardswish(pair)
    rng = np.random.default_rng(1)
    samples = [{"x": rng.normal(0, 30, (1, 16, 40, 40)).astype(np.float32)} for _ in range(2)]
    results = whole_ctx_vs_float(tmp_path, {"float": pair, "fused": fused}, samples)
    assert results["fused"] > 60.0, results
    assert results["float"] < 0.0, results


POW = """<ir_version: 8, opset_import: ["": 13]>
g (float[4] x) => (float[4] y) { y = Pow(x, p) }"""


def test_rewrite_for_htp_pow_2_becomes_mul() -> None:
    model = with_inits(parse(POW, False), ("p", np.array(2.0, np.float32)))
    rewritten, change = t.rewrite_for_htp(model)
    assert ops(rewritten) == ["Mul"] and change.changed
    x = np.array([-1.5, 0.0, 0.5, 3.0], np.float32)
    np.testing.assert_array_equal(run(rewritten, {"x": x})[0], run(model, {"x": x})[0])
    odd = with_inits(parse(POW, False), ("p", np.array(3.0, np.float32)))
    same, noop = t.rewrite_for_htp(odd)
    assert ops(same) == ["Pow"] and not noop.changed


@pytest.mark.parametrize(
    ("op", "value", "expected"),
    [("Max", -np.inf, []), ("Min", np.inf, []), ("Max", 0.0, ["Relu"]), ("Max", 1.0, ["Max"])],
)
def test_rewrite_for_htp_neutral_and_zero_constants(op: str, value: float, expected) -> None:
    model = with_inits(
        parse(
            '<ir_version: 8, opset_import: ["": 13]> g (float[4] x) => (float[4] y)'
            f" {{ m = {op}(c, x) \n y = Neg(m) }}"
        ),
        ("c", np.array(value, np.float32)),
    )
    rewritten, change = t.rewrite_for_htp(model)
    assert ops(rewritten) == [*expected, "Neg"] and change.changed == (expected != [op])
    x = np.array([-1.5, 0.0, 0.5, 3.0], np.float32)
    np.testing.assert_array_equal(run(rewritten, {"x": x})[0], run(model, {"x": x})[0])


TOP_DB = """<ir_version: 8, opset_import: ["": 13]>
g (float[1, 8, 6] x) => (float[1, 8, 6] y) {
  db = Mul(x, ten)
  peak = ReduceMax<keepdims = 0>(db)
  floor = Sub(peak, eighty)
  y = Clip(db, LO, HI)
}"""


@pytest.mark.parametrize(
    ("bounds", "expected"),
    [
        (("floor", "big"), ["Max"]),  # a log-mel top_db floor; float max is no bound at all
        (("floor", "hi"), ["Max", "Min"]),
        (("", "floor"), ["Min"]),
        (("lo", "floor"), ["Max", "Min"]),
    ],
)
def test_split_computed_clips_gives_max_and_min(bounds: tuple[str, str], expected) -> None:
    """Only a Clip with a computed bound is split; rewrite_for_htp then drops a no-op bound."""
    model = with_inits(
        parse(TOP_DB.replace("LO", bounds[0]).replace("HI", bounds[1])),
        ("ten", np.array(10.0, np.float32)),
        ("eighty", np.array(80.0, np.float32)),
        ("big", np.array(np.finfo(np.float32).max, np.float32)),
        ("hi", np.array(-5.0, np.float32)),
        ("lo", np.array(-30.0, np.float32)),
    )
    split, change = t.split_computed_clips(model)
    cleaned, _ = t.rewrite_for_htp(split)
    assert ops(cleaned)[3:] == expected and "Clip" not in ops(cleaned)
    assert "computed bound 'floor'" in change.details[0]
    x = (RNG.standard_normal((1, 8, 6)) * 5).astype(np.float32)
    np.testing.assert_array_equal(run(cleaned, {"x": x})[0], run(model, {"x": x})[0])
    constant = with_inits(
        parse(TOP_DB.replace("LO", "lo").replace("HI", "hi")),
        ("ten", np.array(10.0, np.float32)),
        ("eighty", np.array(80.0, np.float32)),
        ("hi", np.array(-5.0, np.float32)),
        ("lo", np.array(-30.0, np.float32)),
    )
    same, noop = t.split_computed_clips(constant)
    assert ops(same) == ops(constant) and not noop.changed


@pytest.mark.qnn
def test_top_db_floor_compiles_whole_on_the_htp(tmp_path) -> None:
    """A Conv -> dB -> Clip(x, max(x) - 80) tail: the computed Clip stayed on the CPU."""
    model = with_inits(
        parse(
            """<ir_version: 8, opset_import: ["": 13]>
            g (float[1, 2, 8, 8] x) => (float[1, 3, 8, 8] y) {
              c = Conv(x, w)
              db = Mul(c, ten)
              peak = ReduceMax<keepdims = 0>(db)
              floor = Sub(peak, eighty)
              y = Clip(db, floor, big)
            }"""
        ),
        ("w", (RNG.standard_normal((3, 2, 1, 1)) * 0.5).astype(np.float32)),
        ("ten", np.array(10.0, np.float32)),
        ("eighty", np.array(12.0, np.float32)),  # so that the floor cuts real values
        ("big", np.array(np.finfo(np.float32).max, np.float32)),
    )
    build_whole_on_htp(tmp_path, "topdb", model)


def test_rewrite_for_htp_drops_noop_expand_and_identity_but_keeps_output_names() -> None:
    model = with_inits(
        parse(
            '<ir_version: 8, opset_import: ["": 13]> g (float[1, 4] x) => (float[1, 4] y)'
            " { e = Expand(x, s) \n r = Relu(e) \n y = Identity(r) }"
        ),
        ("s", np.array([1, 4], np.int64)),
    )
    rewritten, change = t.rewrite_for_htp(model)
    assert ops(rewritten) == ["Relu"] and rewritten.graph.node[0].output[0] == "y"
    assert rewritten.graph.node[0].input[0] == "x" and change.changed


def test_qnn_preprocess_keeps_metadata_props() -> None:
    model = parse(
        '<ir_version: 8, opset_import: ["": 13]> g (float[4] x) => (float[4] y) { y = Relu(x) }'
    )
    onnx.helper.set_model_props(model, {"author": "me", "license": "MIT"})
    result, change = t.qnn_preprocess(model)
    assert {p.key: p.value for p in result.metadata_props} == {"author": "me", "license": "MIT"}
    assert change.details == ("named 1 unnamed node(s)",)
    _, noop = t.qnn_preprocess(result)
    assert not noop.changed


def test_qnn_preprocess_names_no_tensor_a_later_fusion_names_again() -> None:
    """onnxruntime's MatMul+Add -> Gemm fusion names its shape constants gemm_input_shape, ...
    and again at each later session load for pairs left then, over the constants already there
    ("Attempt to replace the existing tensor": a BERT exported at opset 23 no longer loaded
    once prepared). What qnn_preprocess adds is renamed: a pair added after it fuses at load."""
    rng = np.random.default_rng(4)
    c = numpy_helper.from_array
    model = parse(
        """<ir_version: 10, opset_import: ["": 21]>
        g (float[1, 8, 16] x) => (float[1, 8, 16] y) {
            m = MatMul(x, w)
            a = Add(m, b)
            y = Relu(a)
        }"""
    )
    model.graph.initializer.extend(
        [
            c(rng.normal(size=(16, 16)).astype(np.float32), "w"),
            c(rng.normal(size=16).astype(np.float32), "b"),
        ]
    )
    result, change = t.qnn_preprocess(model)
    assert "Gemm: 0 -> 1 node(s)" in change.details
    minted = {i.name for i in result.graph.initializer} - {"w", "b"}
    assert minted and all(name.startswith("qnn_preprocess/") for name in minted)
    # A pair the first pass left: its fusion at load must not meet a name it mints.
    result.graph.initializer.extend(
        [
            c(rng.normal(size=(16, 16)).astype(np.float32), "w2"),
            c(rng.normal(size=16).astype(np.float32), "b2"),
        ]
    )
    old_output = result.graph.output[0].name
    result.graph.node.extend(
        [
            oh.make_node("MatMul", [old_output, "w2"], ["m2"]),
            oh.make_node("Add", ["m2", "b2"], ["a2"]),
            oh.make_node("Relu", ["a2"], ["y2"]),
        ]
    )
    result.graph.output[0].name = "y2"
    x = rng.normal(size=(1, 8, 16)).astype(np.float32)
    session = ort.InferenceSession(result.SerializeToString(), providers=["CPUExecutionProvider"])
    assert session.run(None, {"x": x})[0].shape == (1, 8, 16)


def test_one_value_constants_become_scalars_where_that_means_the_same() -> None:
    """A LayerNorm whose exponent and epsilon are stored as [1] (onnxruntime's
    qnn_preprocess_model then failed: "only 0-dimensional arrays can be converted to Python
    scalars"): they become scalars and it fuses; a [1] constant added to a scalar input (the
    sum's rank is the constant's) and one a subgraph reads stay as they are."""
    model = parse(
        """<ir_version: 10, opset_import: ["": 21]>
        g (float[2, 8] x, float s) => (float[2, 8] y, float[1] t) {
            axes = Constant <value = int64[1] {-1}> ()
            mean = ReduceMean (x, axes)
            d = Sub(x, mean)
            sq = Pow(d, two)
            var = ReduceMean (sq, axes)
            ve = Add(var, eps)
            root = Sqrt(ve)
            n = Div(d, root)
            scaled = Mul(n, gamma)
            y = Add(scaled, beta)
            t = Add(s, one)
        }"""
    )
    inits = {
        "two": np.array([2.0], np.float32),
        "eps": np.array([1e-5], np.float32),
        "one": np.array([1.0], np.float32),
        "gamma": RNG.uniform(0.5, 1.5, 8).astype(np.float32),
        "beta": RNG.uniform(-0.5, 0.5, 8).astype(np.float32),
    }
    model.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in inits.items())
    scalars, change = t.scalar_shaped_constants(model)
    shapes = {i.name: list(i.dims) for i in scalars.graph.initializer}
    assert shapes["two"] == shapes["eps"] == [] and shapes["one"] == [1], change.details
    feeds = {"x": RNG.standard_normal((2, 8)).astype(np.float32), "s": np.array(2.0, np.float32)}
    for got, want in zip(run(scalars, feeds), run(model, feeds), strict=True):
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    # the whole preparation (the axes folded, the fusion's pattern then matched): it failed
    ln_only = edit.copy_model(model)
    del ln_only.graph.output[1], ln_only.graph.input[1], ln_only.graph.node[-1]
    prepared, _ = prepare_model(ln_only, InputsSection(dims={}, shapes={}, constants={}))
    assert ops(prepared) == ["LayerNormalization"]
    x = {"x": feeds["x"]}
    np.testing.assert_allclose(run(prepared, x)[0], run(ln_only, x)[0], rtol=1e-5, atol=1e-5)
    _, again = t.scalar_shaped_constants(scalars)
    assert not again.changed


def test_topological_sort_orders_and_detects_cycles() -> None:
    relu = oh.make_node("Relu", ["a"], ["y"], name="second")
    neg = oh.make_node("Neg", ["x"], ["a"], name="first")
    x = oh.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = oh.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    graph = oh.make_graph([relu, neg], "g", [x], [y])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 13)], ir_version=8)
    ordered, change = t.topological_sort(model)
    assert [n.name for n in ordered.graph.node] == ["first", "second"] and change.changed
    _, noop = t.topological_sort(ordered)
    assert not noop.changed
    loop = oh.make_graph(
        [oh.make_node("Relu", ["b"], ["a"]), oh.make_node("Neg", ["a"], ["b"]),
         oh.make_node("Add", ["x", "a"], ["y"])],
        "g", [x], [y],
    )  # fmt: skip
    with pytest.raises(ModelError, match="cycle"):
        t.topological_sort(oh.make_model(loop, opset_imports=[oh.make_opsetid("", 13)]))
    # A tensor two nodes write (a converter's duplicate Cast names) is refused: sorting it
    # pushed each reader once per producer, and those readers' readers again, without end
    # (a 248-Cast detector grew to 7 GB in load_source_model before the checker could object).
    twice = oh.make_graph(
        [oh.make_node("Relu", ["x"], ["c"], name="r"), oh.make_node("Neg", ["x"], ["c"], name="n"),
         oh.make_node("Abs", ["c"], ["y"])],
        "g", [x], [y],
    )  # fmt: skip
    with pytest.raises(ModelError, match="'c' is written by two nodes"):
        edit.sorted_order(twice)


def test_store_inferred_shapes_fixes_stale_output_dims() -> None:
    fixed, _ = t.fix_input_shapes(parse(DYNAMIC), {"batch": 1}, {"sr": []})
    stored, change = t.store_inferred_shapes(fixed)
    assert edit.value_shape(stored.graph.output[0]) == (1, 4)
    assert change.details == ("output 'y' shape -> [1, 4]",)
    _, noop = t.store_inferred_shapes(stored)
    assert not noop.changed


def test_dynamic_outputs_ignores_stored_value_info() -> None:
    model = with_inits(parse(SHAPE_CHAIN, False), ("idx", np.array([1, 0], np.int64)))
    # A stored shape that only data propagation could justify does not count.
    model.graph.value_info.append(oh.make_tensor_value_info("y", TensorProto.FLOAT, [6, 1]))
    names = [name for name, _ in edit.dynamic_outputs(model)]
    assert names == ["y"]


def _weighted_reshape() -> onnx.ModelProto:
    """A Conv with a 64 KiB weight, then a Reshape whose target is an initializer (data that
    shape inference must read) and a Resize by float scales."""
    rng = np.random.default_rng(4)
    graph = oh.make_graph(
        [
            oh.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
            oh.make_node("Resize", ["c", "", "scales"], ["r"], mode="nearest"),
            oh.make_node("Reshape", ["r", "shape"], ["y"]),
        ],
        "weighted",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 8, 8])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, "h", "w"])],
        [
            numpy_helper.from_array(rng.standard_normal((64, 16, 4, 4)).astype(np.float32), "w"),
            numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
            numpy_helper.from_array(np.array([1, 64, -1], np.int64), "shape"),
        ],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)])


def test_shape_inference_skips_the_weights_bytes_and_derives_the_same_shapes() -> None:
    """Weights' data is never read by shape inference, only serialized to C++ and back (+680 MB
    on a 176 MB U-Net): it infers on a copy without it, with the same result."""
    model = _weighted_reshape()
    full = onnx.shape_inference.infer_shapes(edit.strip_shape_info(model), data_prop=False)
    fast = edit.infer_shapes(model)
    assert list(fast.graph.value_info) == list(full.graph.value_info)
    assert list(fast.graph.output) == list(full.graph.output)
    assert edit.value_shape(fast.graph.output[0]) == (1, 64, 196)  # "scales", "shape" read
    weight = next(i for i in fast.graph.initializer if i.name == "w")
    assert not weight.raw_data and list(weight.dims) == [64, 16, 4, 4]
    # The model stored with those shapes keeps its weights.
    stored, change = t.store_inferred_shapes(model)
    assert change.changed and stored.graph.initializer[0] == model.graph.initializer[0]
    assert list(stored.graph.value_info) == list(full.graph.value_info)


def test_the_opset_upgrade_converts_without_the_weights_bytes_to_the_same_model() -> None:
    """The version converter copies the model to C++ and back (+1152 MB on a 176 MB U-Net): it
    converts a copy without the weights' data, which are put back, byte for byte the model a
    conversion with them gives; a weight the conversion changed is not put back."""
    from onnx import version_converter

    rng = np.random.default_rng(6)
    graph = oh.make_graph(
        [
            oh.make_node("Conv", ["x", "w"], ["c"]),
            oh.make_node("Clip", ["c"], ["y"], min=-1.0, max=1.0),  # opset 6: attributes
        ],
        "old",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 8, 8])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32, 6, 6])],
        [numpy_helper.from_array(rng.standard_normal((32, 16, 3, 3)).astype(np.float32), "w")],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 9)], ir_version=7)
    upgraded, change = t.upgrade_opset(model)
    reference = version_converter.convert_version(model, 21)
    reference.ir_version = upgraded.ir_version
    assert change.changed and upgraded.SerializeToString() == reference.SerializeToString()
    assert any(n.op_type == "Clip" and len(n.input) == 3 for n in upgraded.graph.node)

    bare = edit.without_weight_data(model)
    assert not bare.graph.initializer[0].raw_data
    bare.graph.initializer[0].dims[0] = 16  # as if an adapter had reshaped it
    assert not edit.restore_weight_data(bare, model)


def test_a_model_of_ai_onnx_ml_ops_alone_gets_the_default_domain_without_conversion() -> None:
    """onnxmltools wrote classifiers importing ai.onnx.ml alone (onnxruntime's own
    datasets/logreg_iris.onnx): the converter read "opset 0" and failed. There is nothing of
    the default domain to convert: its import is added, and the ai.onnx.ml ops reach the rule
    that says the NPU runs none of them."""
    graph = oh.make_graph(
        [
            oh.make_node(
                "LinearClassifier",
                ["x"],
                ["label", "scores"],
                domain="ai.onnx.ml",
                coefficients=[0.5, -0.25, 1.0, 0.75],
                intercepts=[0.1, -0.1],
                classlabels_ints=[0, 1],
                post_transform="LOGISTIC",
            )
        ],
        "iris",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [
            oh.make_tensor_value_info("label", TensorProto.INT64, [1]),
            oh.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 2]),
        ],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("ai.onnx.ml", 1)], ir_version=3)
    upgraded, change = t.upgrade_opset(model)
    assert change.details == ("no ai.onnx import -> opset 21",)
    assert {(o.domain, o.version) for o in upgraded.opset_import} == {("ai.onnx.ml", 1), ("", 21)}
    assert upgraded.graph == model.graph
    session = ort.InferenceSession(upgraded.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.array([[1.0, 2.0]], np.float32)
    before = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for got, want in zip(session.run(None, {"x": x}), before.run(None, {"x": x}), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    ("data_shape", "index"),
    [
        ((2, 3, 4), [[1, 2], [0, -1], [1, 0]]),  # depth 2: rows of 4
        ((2, 3, 4), [[[1], [0]]]),  # depth 1, indices of rank 3
        ((2, 3, 4), [[1, 2, 3], [0, 0, -4]]),  # full depth: scalars
    ],
)
def test_constant_gathernd_becomes_gather(data_shape: tuple[int, ...], index: list) -> None:
    indices = np.array(index, np.int64)
    out_rank = indices.ndim - 1 + len(data_shape) - indices.shape[-1]
    model = oh.make_model(
        oh.make_graph(
            [oh.make_node("GatherND", ["x", "i"], ["y"], name="lookup")],
            "g",
            [oh.make_tensor_value_info("x", TensorProto.FLOAT, list(data_shape))],
            [oh.make_tensor_value_info("y", TensorProto.FLOAT, [None] * out_rank)],
            weights(("i", indices)),
        ),
        opset_imports=[oh.make_opsetid("", 13)],
        ir_version=8,
    )
    rewritten, change = t.gathernd_to_gather(model)
    assert change.changed and ops(rewritten) == ["Reshape", "Gather"]
    feeds = {"x": RNG.standard_normal(data_shape).astype(np.float32)}
    np.testing.assert_array_equal(run(rewritten, feeds)[0], run(model, feeds)[0])


def test_gathernd_with_computed_indices_or_batch_dims_stays() -> None:
    computed = parse(
        '<ir_version: 8, opset_import: ["": 13]> g (float[2, 3] x, int64[2, 1] i) => '
        "(float[2, 3] y) { y = GatherND(x, i) }"
    )
    assert not t.gathernd_to_gather(computed)[1].changed
    batched = with_inits(
        parse(
            '<ir_version: 8, opset_import: ["": 13]> g (float[2, 3] x) => (float[2] y) '
            "{ y = GatherND <batch_dims = 1> (x, i) }"
        ),
        ("i", np.array([[1], [2]], np.int64)),
    )
    assert not t.gathernd_to_gather(batched)[1].changed


def as_strided_head(index: np.ndarray) -> onnx.ModelProto:
    """The dynamo exporter's ``as_strided`` after a global mean: Conv -> ReduceMean ->
    Reshape to 1-D -> Gather of constant indices shaped [1, k, 1, 1] -> a 1x1 Conv."""
    return with_inits(
        parse(
            """<ir_version: 8, opset_import: ["": 18]>
            g (float[1, 3, 16, 16] x) => (float[1, 4, 1, 1] y) {
              c = Conv<pads = [1, 1, 1, 1]>(x, w1)
              r = Relu(c)
              m = ReduceMean<keepdims = 1>(r, axes)
              f = Reshape(m, flat)
              g4 = Gather<axis = 0>(f, i)
              y = Conv(g4, w2)
            }"""
        ),
        ("w1", (RNG.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32)),
        ("axes", np.array([2, 3], np.int64)),
        ("flat", np.array([-1], np.int64)),
        ("i", index.astype(np.int64)),
        ("w2", (RNG.standard_normal((4, index.size, 1, 1)) * 0.3).astype(np.float32)),
    )


@pytest.mark.parametrize(
    ("index", "expected"),
    [
        (np.arange(8).reshape(1, 8, 1, 1), ["Reshape"]),  # the whole axis in order
        (np.array([3, 1, -1, 0, 2, 7, 6, 5]).reshape(1, 8, 1, 1), ["Gather", "Reshape"]),
        (np.arange(2, 6).reshape(1, 4, 1, 1), ["Gather", "Reshape"]),  # a part of it
    ],
)
def test_gather_of_shaped_constant_indices_becomes_flat(index: np.ndarray, expected) -> None:
    model = as_strided_head(index)
    rewritten, change = t.flat_gather_indices(model)
    gathered = ops(rewritten)[ops(rewritten).index("Reshape") + 1 : -1]
    assert change.changed and gathered == expected
    assert all(
        len(next(i for i in rewritten.graph.initializer if i.name == n.input[1]).dims) == 1
        for n in rewritten.graph.node
        if n.op_type == "Gather"
    )
    feeds = {"x": RNG.standard_normal((1, 3, 16, 16)).astype(np.float32)}
    np.testing.assert_array_equal(run(rewritten, feeds)[0], run(model, feeds)[0])


def test_gather_of_flat_or_computed_indices_stays() -> None:
    assert not t.flat_gather_indices(as_strided_head(np.arange(8)))[1].changed
    computed = parse(
        '<ir_version: 8, opset_import: ["": 13]> g (float[4, 3] x, int64[1, 2, 1] i) => '
        "(float[1, 2, 1, 3] y) { y = Gather(x, i) }"
    )
    assert not t.flat_gather_indices(computed)[1].changed


@pytest.mark.qnn
def test_dynamo_as_strided_head_compiles_whole_on_the_htp(tmp_path) -> None:
    """onnxruntime-qnn 2.7.0 aborted the process compiling this Gather (timm's ConvNeXt and
    EdgeNeXt exported by torch 2.14's dynamo exporter): SIGABRT, "Assertion '__n <
    this->size()' failed". If a new QNN SDK compiles it as it is, the rewrite is only a tidy-up."""
    build_whole_on_htp(tmp_path, "as_strided", as_strided_head(np.arange(8).reshape(1, 8, 1, 1)))


def short_row_gather(channels: int, index: np.ndarray) -> onnx.ModelProto:
    """Conv + ReLU -> its [1, C, 30, 40] map flattened to rows [1200, 1, C] -> Gather of rows
    -> back to a map -> Conv: the dynamo exporter's GatherND of window positions, as
    ``gathernd_to_gather`` leaves it."""
    count = index.size
    nodes = [
        oh.make_node("Conv", ["x", "w0"], ["c"], pads=[1, 1, 1, 1]),
        oh.make_node("Relu", ["c"], ["r"]),
        oh.make_node("Transpose", ["r"], ["hwnc"], perm=[2, 3, 0, 1]),
        oh.make_node("Reshape", ["hwnc", "rows_shape"], ["rows"]),
        oh.make_node("Gather", ["rows", "index"], ["picked"], axis=0),
        oh.make_node("Reshape", ["picked", "flat"], ["flat_rows"]),
        oh.make_node("Transpose", ["flat_rows"], ["columns"], perm=[1, 0]),
        oh.make_node("Reshape", ["columns", "map"], ["m"]),
        oh.make_node("Conv", ["m", "w1"], ["y"]),
    ]
    rng = np.random.default_rng(11)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.3, (channels, 8, 3, 3)).astype("f4"), "w0"),
        numpy_helper.from_array(np.array([1200, 1, channels], np.int64), "rows_shape"),
        numpy_helper.from_array(index.astype(np.int64), "index"),
        numpy_helper.from_array(np.array([count, channels], np.int64), "flat"),
        numpy_helper.from_array(np.array([1, channels, 1, count], np.int64), "map"),
        numpy_helper.from_array(rng.normal(0, 0.3, (8, channels, 1, 1)).astype("f4"), "w1"),
    ]
    graph = oh.make_graph(
        nodes,
        "short_rows",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 30, 40])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 1, count])],
        inits,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def _rows_read(seed: int) -> np.ndarray:
    """Every row once in some order, then the last one twice more (its first read: zeros)."""
    return np.concatenate([np.random.default_rng(seed).permutation(1200), [1199, -1]])


def test_short_row_gather_reads_padded_data_with_the_same_values() -> None:
    model = short_row_gather(16, _rows_read(0))
    rewritten, change = t.pad_short_row_gathers(model)
    assert change.changed and "rows of 16 values" in change.details[0]
    assert ops(rewritten).count("Pad") == 1
    gather = next(n for n in rewritten.graph.node if n.op_type == "Gather")
    index = next(i for i in rewritten.graph.initializer if i.name == gather.input[1])
    assert numpy_helper.to_array(index).min() >= 0  # -1 no longer means the pad row
    feeds = {"x": RNG.standard_normal((1, 8, 30, 40)).astype(np.float32)}
    np.testing.assert_array_equal(run(rewritten, feeds)[0], run(model, feeds)[0])
    again, change = t.pad_short_row_gathers(rewritten)  # bucket models are prepared again
    assert not change.changed and ops(again).count("Pad") == 1
    assert not t.pad_short_row_gathers(short_row_gather(24, _rows_read(0)))[1].changed
    few = np.array([3, 1199, 7, -1])  # a few picks of many rows: right on the HTP
    assert not t.pad_short_row_gathers(short_row_gather(16, few))[1].changed


@pytest.mark.qnn
def test_short_row_gather_agrees_with_the_cpu_on_the_htp(tmp_path: Path) -> None:
    """Unpadded, the HTP gave zeros for the first read of the last row: the ctx 34.5 dB from
    the CPU QDQ model (80.4 padded)."""
    build_whole_on_htp(tmp_path, "short_rows", short_row_gather(16, _rows_read(1)), min_db=60.0)


def unbind_model(split: np.ndarray | None, keepdims: int, positions: list[int]) -> onnx.ModelProto:
    """x [2, 6, 4] -> SplitToSequence on axis 1 -> SequenceAt each position -> Relu each."""
    nodes = [
        oh.make_node(
            "SplitToSequence", ["x", *(["s"] if split is not None else [])], ["seq"],
            axis=1, keepdims=keepdims,
        )
    ]  # fmt: skip
    inits = [] if split is None else weights(("s", split))
    outputs = []
    for k, position in enumerate(positions):
        inits += weights((f"p{k}", np.array(position, np.int64)))
        nodes += [
            oh.make_node("SequenceAt", ["seq", f"p{k}"], [f"item{k}"]),
            oh.make_node("Relu", [f"item{k}"], [f"y{k}"]),
        ]
        rank = 2 if split is None and not keepdims else 3
        outputs.append(oh.make_tensor_value_info(f"y{k}", TensorProto.FLOAT, [None] * rank))
    return oh.make_model(
        oh.make_graph(
            nodes, "g", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6, 4])], outputs,
            inits,
        ),
        opset_imports=[oh.make_opsetid("", 18)],
        ir_version=8,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("split", "keepdims", "op"),
    [
        (None, 0, "Gather"),  # torch.unbind
        (None, 1, "Slice"),
        (np.array(3, np.int64), 0, "Slice"),  # a scalar: pieces of 3
        (np.array([1, 3, 2], np.int64), 0, "Slice"),  # torch.split with sizes
    ],
)
def test_sequence_items_at_constant_positions_become_slices(split, keepdims, op) -> None:
    pieces = 6 if split is None else (2 if split.ndim == 0 else len(split))
    model = unbind_model(split, keepdims, [0, pieces - 1, -1])
    rewritten, change = t.sequence_at_to_slices(model)
    assert change.changed
    assert "SplitToSequence" not in ops(rewritten) and "SequenceAt" not in ops(rewritten)
    assert ops(rewritten).count(op) == 3
    feeds = {"x": RNG.standard_normal((2, 6, 4)).astype(np.float32)}
    if split is not None and split.ndim == 0:  # onnxruntime 1.31 fails on a scalar split
        pieces = np.maximum(np.split(feeds["x"], 2, axis=1), 0)
        expected = [pieces[0], pieces[1], pieces[1]]
    else:
        expected = run(model, feeds)
    for want, got in zip(expected, run(rewritten, feeds), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("joined", [("cache", "empty"), ("empty", "cache", "x")])
def test_empty_concat_inputs_are_left_out(joined: tuple[str, ...]) -> None:
    """A cache of length 0 joined to a frame: x[:, :0] is empty (the QNN EP holds none)."""
    width = 2 if len(joined) == 3 else 1
    model = with_inits(
        parse(
            '<ir_version: 8, opset_import: ["": 18]> g (float[1, 1, 4] x, float[1, 1, 4] cache)'
            f" => (float[1, {width}, 4] y) {{ empty = Slice(x, zero, zero, one) \n"
            f" joined = Concat<axis = 1>({', '.join(joined)}) \n y = Relu(joined) }}"
        ),
        ("zero", np.array([0], np.int64)),
        ("one", np.array([1], np.int64)),
    )
    rewritten, change = t.drop_empty_concat_inputs(model)
    assert change.changed and "Slice" not in ops(rewritten)
    assert ops(rewritten) == (["Relu"] if width == 1 else ["Concat", "Relu"])
    rng = np.random.default_rng(4)
    feeds = {name: rng.normal(0, 1, (1, 1, 4)).astype(np.float32) for name in ("x", "cache")}
    np.testing.assert_array_equal(run(rewritten, feeds)[0], run(model, feeds)[0])


def test_identities_go_and_a_batchnorm_behind_one_folds() -> None:
    """Conv -> Mul -> Identity -> Add -> Identity -> output (paddle2onnx's BatchNorm): the
    Identities go, so both affine ops fold into the Conv; an Identity writing a graph output
    stays."""
    rng = np.random.default_rng(6)
    model = with_inits(
        parse(
            '<ir_version: 8, opset_import: ["": 17]> g (float[1, 3, 8, 8] x) =>'
            " (float[1, 4, 8, 8] y, float[1, 4, 8, 8] z) {"
            " c = Conv<pads = [1, 1, 1, 1]>(x, w) \n m = Mul(c, s) \n i1 = Identity(m) \n"
            " a = Add(i1, b) \n i2 = Identity(a) \n y = Relu(i2) \n z = Identity(i2) }"
        ),
        ("w", rng.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32)),
        ("s", rng.uniform(0.01, 5.0, (1, 4, 1, 1)).astype(np.float32)),
        ("b", rng.normal(0, 1.0, (1, 4, 1, 1)).astype(np.float32)),
    )
    dropped, change = t.drop_identities(model)
    assert change.details == ("2 Identity node(s) dropped",)
    assert ops(dropped) == ["Conv", "Mul", "Add", "Relu", "Identity"]
    prepared, _ = prepare_model(model, InputsSection(dims={}, shapes={}, constants={}))
    assert ops(prepared) == ["Conv", "Relu", "Identity"]
    feeds = {"x": rng.normal(0, 1, (1, 3, 8, 8)).astype(np.float32)}
    for want, got in zip(run(model, feeds), run(prepared, feeds), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_sequence_read_otherwise_stays() -> None:
    model = unbind_model(None, 0, [0])
    model.graph.node.append(oh.make_node("SequenceLength", ["seq"], ["n"]))
    model.graph.output.append(oh.make_tensor_value_info("n", TensorProto.INT64, []))
    assert not t.sequence_at_to_slices(model)[1].changed


def test_padding_mask_lookup_builds_whole_on_the_htp(tmp_path) -> None:
    """transformers' vmap'd padding-mask lookup (int64 mask -> bool -> GatherND with constant
    indices -> Where fill -> scores -> Softmax): the GatherND stayed on the CPU; as a Gather,
    the block builds whole on the HTP."""
    seq = 8
    index = np.zeros((1, seq, seq, 2), np.int64)  # [0, q, k] -> (0, k): mask[0, k]
    index[..., 1] = np.arange(seq)
    text = f"""<ir_version: 8, opset_import: ["": 17]>
    g (float[1, {seq}, 16] x, int64[1, {seq}] mask) => (float[1, {seq}, 16] y) {{
      keep = Cast <to = 9> (mask)
      picked = GatherND(keep, idx)
      bias = Where(picked, zero, fill)
      q = MatMul(x, wq)
      k = MatMul(x, wk)
      kt = Transpose <perm = [0, 2, 1]> (k)
      s = MatMul(q, kt)
      masked = Add(s, bias)
      p = Softmax <axis = -1> (masked)
      y = MatMul(p, x)
    }}"""
    rng = np.random.default_rng(5)
    model = with_inits(
        parse(text),
        ("idx", index),
        ("zero", np.array(0.0, np.float32)),
        ("fill", np.array(-1e9, np.float32)),
        ("wq", (rng.standard_normal((16, 16)) * 0.3).astype(np.float32)),
        ("wk", (rng.standard_normal((16, 16)) * 0.3).astype(np.float32)),
    )
    build_whole_on_htp(tmp_path, "mask_lookup", model)


@pytest.mark.parametrize("mode", [True, False])
def test_a_model_exported_in_training_mode_is_refused(mode: bool) -> None:
    """Dropout with training_mode = true (a wrapper left in training mode when exported): a
    clear error that names the node and the fix; in inference mode it prepares as usual."""
    model = with_inits(
        parse(
            '<ir_version: 8, opset_import: ["": 17]> g (float[1, 8] x) => (float[1, 8] y) '
            "{ h = MatMul(x, w) \n y = Dropout(h, ratio, training) }"
        ),
        ("w", RNG.standard_normal((8, 8)).astype(np.float32)),
        ("ratio", np.array(0.1, np.float32)),
        ("training", np.array(mode)),
    )
    if not mode:
        prepare_model(model, InputsSection(dims={}, shapes={}, constants={}))
        return
    with pytest.raises(ModelError) as caught:
        prepare_model(model, InputsSection(dims={}, shapes={}, constants={}))
    assert "training mode" in str(caught.value) and "Dropout" in str(caught.value)
    assert "model.eval()" in (caught.value.tip or "")


def test_a_batchnorm_in_training_mode_is_refused() -> None:
    model = with_inits(
        parse(
            '<ir_version: 8, opset_import: ["": 15]> g (float[1, 4, 3, 3] x) => '
            "(float[1, 4, 3, 3] y) { y = BatchNormalization <training_mode = 1> (x, s, b, m, v) }"
        ),
        *[(n, np.ones(4, np.float32)) for n in ("s", "b", "m", "v")],
    )
    with pytest.raises(ModelError, match="training mode"):
        t.refuse_training_mode(model)


def gemm_with_bias(bias_shape: list[int], trans_b: int = 0) -> onnx.ModelProto:
    """x [2, 4] @ W + C, C broadcast from ``bias_shape`` (what qnn_preprocess fuses MatMul+Add to)."""
    rng = np.random.default_rng(5)
    weight = rng.standard_normal((6, 4) if trans_b else (4, 6)).astype(np.float32)
    bias = rng.standard_normal(bias_shape).astype(np.float32)
    graph = oh.make_graph(
        [oh.make_node("Gemm", ["x", "w", "c"], ["y"], transB=trans_b)],
        "g",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2, 6])],
        [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "c")],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize(("bias_shape", "trans_b"), [([1, 6], 0), ([1, 6], 1), ([1], 0), ([], 1)])
def test_flatten_gemm_biases_gives_one_value_per_column(
    bias_shape: list[int], trans_b: int
) -> None:
    model = gemm_with_bias(bias_shape, trans_b)
    flat, change = t.flatten_gemm_biases(model)
    assert change.changed
    bias = {i.name: i for i in flat.graph.initializer}[flat.graph.node[0].input[2]]
    assert list(bias.dims) == [6]
    assert_same(model, flat, {"x": RNG.standard_normal((2, 4)).astype(np.float32)})
    assert not t.flatten_gemm_biases(flat)[1].changed


def gemm_with_computed_bias(trans_b: int = 0, beta: float = 1.0) -> onnx.ModelProto:
    """x [1, 64] @ W + s (an input: a recurrent cell's state term), then Tanh."""
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((8, 64) if trans_b else (64, 8)).astype(np.float32) * 0.05
    graph = oh.make_graph(
        [
            oh.make_node("Gemm", ["x", "w", "s"], ["p"], transB=trans_b, beta=beta),
            oh.make_node("Tanh", ["p"], ["y"]),
        ],
        "g",
        [
            oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64]),
            oh.make_tensor_value_info("s", TensorProto.FLOAT, [1, 8]),
        ],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
        [numpy_helper.from_array(weight, "w")],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize(("trans_b", "beta"), [(0, 1.0), (1, 0.5)])
def test_a_gemms_computed_bias_is_added_after_it(trans_b: int, beta: float) -> None:
    model = gemm_with_computed_bias(trans_b, beta)
    split, change = t.gemm_computed_bias_as_add(model)
    assert change.changed and ops(split) == ["Gemm", *(["Mul"] if beta != 1 else []), "Add", "Tanh"]
    assert list(split.graph.node[0].input) == ["x", "w"]
    feeds = {"x": RNG.standard_normal((1, 64)).astype(np.float32)}
    assert_same(model, split, {**feeds, "s": RNG.standard_normal((1, 8)).astype(np.float32)})
    assert not t.gemm_computed_bias_as_add(split)[1].changed
    assert not t.gemm_computed_bias_as_add(gemm_with_bias([6]))[1].changed  # a constant C stays
    dequantized = gemm_with_bias([6])  # C = DequantizeLinear(int32 bias): constant too
    bias = dequantized.graph.initializer[1]
    bias.CopyFrom(numpy_helper.from_array(np.arange(6, dtype=np.int32), "c_int32"))
    dequantized.graph.initializer.append(numpy_helper.from_array(np.float32(0.01), "c_scale"))
    dequantized.graph.node.insert(
        0, oh.make_node("DequantizeLinear", ["c_int32", "c_scale"], ["c"], name="c_dq")
    )
    assert not t.gemm_computed_bias_as_add(dequantized)[1].changed


def test_a_cell_whose_gemm_adds_a_computed_term_runs_whole_on_the_htp(tmp_path: Path) -> None:
    """Quantized with its Gemm's computed C, the QNN EP left the weight's DequantizeLinear on
    the CPU (1 CPU node); as Gemm + Add the ctx is whole on the HTP. The HTP judge is off so
    that the quantized model itself reaches compile's coverage gate."""
    build_whole_on_htp(tmp_path, "cell", gemm_with_computed_bias(), quantization='judge = "cpu"')


def test_a_gemm_bias_per_row_is_left_alone() -> None:
    model = gemm_with_bias([1, 6])
    model.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.ones((2, 6), np.float32), "c"))
    assert not t.flatten_gemm_biases(model)[1].changed


def test_onnxruntime_quantizes_a_flattened_gemm_bias_per_channel(tmp_path: Path) -> None:
    """Why the step exists: int8 per-column weights index the bias by column."""
    from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.samples = iter([{"x": RNG.standard_normal((2, 4)).astype(np.float32)}])

        def get_next(self) -> dict | None:
            return next(self.samples, None)

    def quantize(model: onnx.ModelProto, name: str) -> None:
        onnx.save(model, str(tmp_path / f"{name}.onnx"))
        quantize_static(
            tmp_path / f"{name}.onnx",
            tmp_path / f"{name}_qdq.onnx",
            Reader(),
            per_channel=True,
            weight_type=QuantType.QInt8,
            activation_type=QuantType.QUInt16,
            extra_options={"WeightSymmetric": True},
        )

    model = gemm_with_bias([1, 6])
    # If onnxruntime learns to read a broadcast bias, this says so: the step is then only tidy.
    with pytest.raises(ValueError, match="ambiguous"):
        quantize(model, "broadcast")
    quantize(t.flatten_gemm_biases(model)[0], "flat")
    ort.InferenceSession(str(tmp_path / "flat_qdq.onnx"), providers=["CPUExecutionProvider"])


def reverse_sequence(lengths: list[int], time_axis: int = 0) -> onnx.ModelProto:
    """ReverseSequence of x [5, 2, 3] (time major) or [2, 5, 3], then a Conv-free Mul."""
    shape = [5, 2, 3] if time_axis == 0 else [2, 5, 3]
    graph = oh.make_graph(
        [
            oh.make_node(
                "ReverseSequence",
                ["x", "lens"],
                ["r"],
                time_axis=time_axis,
                batch_axis=1 - time_axis,
            ),
            oh.make_node("Mul", ["r", "two"], ["y"]),
        ],
        "g",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [
            numpy_helper.from_array(np.array(lengths, np.int64), "lens"),
            numpy_helper.from_array(np.array(2.0, np.float32), "two"),
        ],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize(
    ("lengths", "time_axis"), [([5, 5], 0), ([3, 3], 0), ([5, 5], 1), ([2, 2], 1)]
)
def test_reverse_sequence_of_equal_lengths_becomes_a_gather(
    lengths: list[int], time_axis: int
) -> None:
    model = reverse_sequence(lengths, time_axis)
    gathered, change = t.reverse_sequence_to_gather(model)
    assert ops(gathered) == ["Gather", "Mul"] and change.changed
    shape = [5, 2, 3] if time_axis == 0 else [2, 5, 3]
    assert_same(model, gathered, {"x": RNG.standard_normal(shape).astype(np.float32)})


def test_reverse_sequence_of_unequal_lengths_is_kept() -> None:
    assert not t.reverse_sequence_to_gather(reverse_sequence([5, 3]))[1].changed


@pytest.mark.qnn
def test_a_reversed_sequence_runs_whole_on_the_htp(tmp_path: Path) -> None:
    """The QNN EP takes no ReverseSequence (tf2onnx's TensorFlow reverse); the Gather it is."""
    build_whole_on_htp(tmp_path, "reversed", reverse_sequence([5, 5]))


def class_map(op: str = "ArgMax", axis: int = 1, keepdims: int | None = None) -> onnx.ModelProto:
    """Conv -> ArgMax/ArgMin over ``axis`` as the output: a segmenter's int64 class map."""
    attrs = {"axis": axis} if keepdims is None else {"axis": axis, "keepdims": keepdims}
    shape = [1, 8, 16, 16]
    shape[axis] = 1 if keepdims in (None, 1) else shape[axis]
    out = shape if keepdims in (None, 1) else [d for i, d in enumerate(shape) if i != axis % 4]
    graph = oh.make_graph(
        [
            oh.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
            oh.make_node(op, ["c"], ["y"], **attrs),
        ],
        "class_map",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [oh.make_tensor_value_info("y", TensorProto.INT64, out)],
        weights(("w", RNG.normal(0, 0.5, (8, 3, 3, 3)).astype(np.float32))),
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize(("op", "axis"), [("ArgMax", 1), ("ArgMin", -1), ("ArgMax", -3)])
def test_argmax_keeps_its_dims_through_an_unsqueeze(op: str, axis: int) -> None:
    model = class_map(op, axis)
    rewritten, change = t.argmax_without_keepdims(model)
    assert change.changed and ops(rewritten) == ["Conv", op, "Unsqueeze"]
    assert_same(model, rewritten, {"x": RNG.standard_normal((1, 3, 16, 16)).astype(np.float32)})
    assert not t.argmax_without_keepdims(rewritten)[1].changed
    assert not t.argmax_without_keepdims(class_map(op, axis, keepdims=0))[1].changed


@pytest.mark.qnn
def test_a_class_map_output_loads_on_the_htp_without_keepdims(tmp_path: Path) -> None:
    """Measured: the keepdims form compiles, and its context fails every run; without keepdims
    it runs and the real stages build the class map whole (its labels agree)."""
    from pipeline.htp.probe import probe

    model = class_map()
    path = tmp_path / "keepdims.onnx"
    onnx.save(model, str(path))
    np.savez(tmp_path / "sample.npz", x=RNG.standard_normal((1, 3, 16, 16)).astype(np.float32))
    result = probe(path, path, [tmp_path / "sample.npz"], tmp_path / "as_is", 60, 73)
    # If a new QNN SDK loads it, this says so: the rewrite is then only a cleanup.
    assert not result.ok and "does not match QNN tensor data size" in result.error
    build_whole_on_htp(tmp_path, "class_map", model)


def test_tensor_names_with_semicolons_become_plain_inside_only() -> None:
    """TFLite converters' fused names; the graph's own outputs keep theirs."""
    model = with_inits(
        parse(
            '<ir_version: 8, opset_import: ["": 17]> g (float[1, 4] x) => (float[1, 4] y) {'
            ' "m/a;m/b" = Mul(x, "w;0") \n y = Relu("m/a;m/b") }'
        ),
        ("w;0", np.full((1, 4), 2.0, np.float32)),
    )
    renamed, change = t.plain_tensor_names(model)
    assert change.details == ("2 tensor name(s) with ';'",)
    names = {n for node in renamed.graph.node for n in (*node.input, *node.output)}
    assert not any(";" in n for n in names) and "m/a+m/b" in names
    x = np.array([[1.0, -2.0, 3.0, -4.0]], np.float32)
    np.testing.assert_array_equal(run(renamed, {"x": x})[0], run(model, {"x": x})[0])


def test_names_the_quantizer_would_give_are_freed_and_it_quantizes(tmp_path: Path) -> None:
    """A tensor ``s`` and a constant ``s_scale``: onnxruntime's quantizer adds ``s``'s scale
    under that name and then reads the model's constant as it (here a bias scale of the
    constant's shape, a ValueError). Renamed, it quantizes; the graph's own names stay."""
    from compile_fixtures import _quantize_qnn

    rng = np.random.default_rng(4)
    model = with_inits(
        parse(
            '<ir_version: 8, opset_import: ["": 21]> g (float[1, 5] x) => (float[1, 16] y) {'
            " d = Sub(x, s_offset) \n s = Mul(d, s_scale) \n y = Gemm(s, w, b) }"
        ),
        ("s_offset", rng.normal(0, 1, 5).astype(np.float32)),
        ("s_scale", rng.uniform(0.5, 2, 5).astype(np.float32)),
        ("w", rng.normal(0, 1, (5, 16)).astype(np.float32)),
        ("b", rng.normal(0, 1, 16).astype(np.float32)),
    )
    renamed, change = t.quantizer_free_names(model)
    assert change.details == ("s_scale -> s_scale_of_model",)
    assert [v.name for v in (*renamed.graph.input, *renamed.graph.output)] == ["x", "y"]
    x = rng.normal(0, 1, (1, 5)).astype(np.float32)
    np.testing.assert_array_equal(run(renamed, {"x": x})[0], run(model, {"x": x})[0])
    samples = [{"x": rng.normal(0, 1, (1, 5)).astype(np.float32)} for _ in range(4)]
    for name, candidate in (("as_named", model), ("freed", renamed)):
        onnx.save(candidate, tmp_path / f"{name}.onnx")
    with pytest.raises(ValueError, match="could not be broadcast"):
        _quantize_qnn(tmp_path / "as_named.onnx", tmp_path / "as_named_qdq.onnx", samples)
    _quantize_qnn(tmp_path / "freed.onnx", tmp_path / "freed_qdq.onnx", samples)
    # A graph output named like a derived name keeps it: the tensor it derives from is renamed.
    output_named = parse(
        '<ir_version: 8, opset_import: ["": 21]> g (float[2] x) => (float[2] r_scale) {'
        " r = Relu(x) \n r_scale = Neg(r) }"
    )
    _, change = t.quantizer_free_names(output_named)
    assert change.details == ("r -> r_of_model",)


@pytest.mark.qnn
def test_the_htp_locator_runs_once_names_are_plain(tmp_path: Path) -> None:
    """A Gemm output named as TFLite converters name it, read by a Sigmoid: exposing it (the
    judge's locator does) made the QNN EP abort loading the context ("Tensor name not found").
    If the first probe stops failing, a new QNN EP takes such names and the rule can go."""
    from compile_fixtures import _quantize_qnn

    from pipeline.htp.probe import probe

    rng = np.random.default_rng(8)
    model = with_inits(
        parse(
            '<ir_version: 8, opset_import: ["": 21]> g (float[1, 3, 8, 8] x) => (float[1, 1] y) {'
            " a = Conv(x, w) \n r = Relu(a) \n f = Flatten(r) \n"
            ' "m/fc/MatMul;m/fc/BiasAdd" = Gemm<transB = 1>(f, wg, bg) \n'
            ' y = Sigmoid("m/fc/MatMul;m/fc/BiasAdd") }'
        ),
        ("w", rng.normal(0, 0.5, (4, 3, 3, 3)).astype(np.float32)),
        ("wg", rng.normal(0, 0.1, (1, 144)).astype(np.float32)),
        ("bg", np.zeros(1, np.float32)),
    )
    samples = [{"x": rng.normal(0, 1, (1, 3, 8, 8)).astype(np.float32)} for _ in range(8)]
    np.savez(tmp_path / "sample.npz", **samples[0])
    results = {}
    for name, candidate in (("as_named", model), ("plain", t.plain_tensor_names(model)[0])):
        onnx.save(candidate, tmp_path / f"{name}.onnx")
        _quantize_qnn(tmp_path / f"{name}.onnx", tmp_path / f"{name}_qdq.onnx", samples)
        results[name] = probe(
            tmp_path / f"{name}_qdq.onnx", tmp_path / f"{name}.onnx", [tmp_path / "sample.npz"],
            tmp_path / name, 60, 73, locate=True,
        )  # fmt: skip
    assert not results["as_named"].ok and "Tensor name not found" in results["as_named"].error
    assert results["plain"].ok, results["plain"].error
    assert results["plain"].tensors and results["plain"].worst_ctx_vs_qdq > 30.0


def folded(kernel: int, stride: int, pad: int, image: int, dilation: int = 1) -> onnx.ModelProto:
    """VOLO's outlook attention ends in ``F.fold``: a 1x1 Conv makes C * k * k column values
    per block, a Reshape lays them out as [1, C * k * k, L], Col2Im sums them into the image,
    a 1x1 Conv follows."""
    grid = (image + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1
    channels = 4
    return with_inits(
        parse(
            f"""<ir_version: 8, opset_import: ["": 18]>
            g (float[1, 3, {grid}, {grid}] x) => (float[1, 2, {image}, {image}] y) {{
              c = Conv(x, w1)
              cols = Reshape(c, to_columns)
              img = Col2Im<strides = [{stride}, {stride}], pads = [{pad}, {pad}, {pad}, {pad}],
                           dilations = [{dilation}, {dilation}]>(cols, image_shape, block)
              y = Conv(img, w2)
            }}"""
        ),
        ("w1", (RNG.standard_normal((channels * kernel**2, 3, 1, 1)) * 0.3).astype(np.float32)),
        ("to_columns", np.array([1, channels * kernel**2, grid * grid], np.int64)),
        ("image_shape", np.array([image, image], np.int64)),
        ("block", np.array([kernel, kernel], np.int64)),
        ("w2", (RNG.standard_normal((2, channels, 1, 1)) * 0.3).astype(np.float32)),
    )


@pytest.mark.parametrize(
    ("kernel", "stride", "pad", "image", "dilation"),
    [(3, 2, 1, 20, 1), (3, 2, 1, 19, 1), (2, 2, 0, 8, 1), (3, 1, 1, 9, 1), (3, 1, 2, 10, 2)],
)
def test_col2im_becomes_a_grouped_conv_transpose(kernel, stride, pad, image, dilation) -> None:
    model = folded(kernel, stride, pad, image, dilation)
    rewritten, change = t.col2im_to_conv_transpose(model)
    assert change.changed and "ConvTranspose" in ops(rewritten) and "Col2Im" not in ops(rewritten)
    grid = (image + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1
    feeds = {"x": RNG.standard_normal((1, 3, grid, grid)).astype(np.float32)}
    np.testing.assert_allclose(run(rewritten, feeds)[0], run(model, feeds)[0], atol=1e-5)


@pytest.mark.qnn
def test_volo_fold_compiles_whole_on_the_htp(tmp_path) -> None:
    """The QNN EP has no Col2Im: VOLO-D1 (timm, dynamo export) left 4 on the CPU, 5 partitions."""
    build_whole_on_htp(tmp_path, "fold", folded(3, 2, 1, 20))


# --- Pads of slices --------------------------------------------------------------------------


def linear_attention(heads: int = 2, tokens: int = 8, dim: int = 4) -> onnx.ModelProto:
    """EfficientViT's ReLU linear attention (timm ``LiteMLA``): q and v are slices of one
    Transpose, v padded with ones along its last axis so that one MatMul also sums k for
    the normalizer."""
    return with_inits(
        parse(
            f"""<ir_version: 10, opset_import: ["": 21]>
            g (float[1, {heads}, {2 * dim}, {tokens}] r, float[1, {heads}, {dim}, {tokens}] k)
              => (float[1, {heads}, {tokens}, {dim + 1}] o) {{
              t = Transpose<perm = [0, 1, 3, 2]>(r)
              qs = Slice(t, zero, half, last)
              q = Relu(qs)
              v = Slice(t, half, full, last)
              vp = Pad<mode = "constant">(v, pads, one)
              kv = MatMul(k, vp)
              o = MatMul(q, kv)
            }}"""
        ),
        ("zero", np.array([0], np.int64)),
        ("half", np.array([dim], np.int64)),
        ("full", np.array([2 * dim], np.int64)),
        ("last", np.array([-1], np.int64)),
        ("pads", np.array([0, 0, 0, 0, 0, 0, 0, 1], np.int64)),
        ("one", np.array(1.0, np.float32)),
    )


def test_a_pad_of_a_slice_becomes_a_concat_with_constants() -> None:
    model = linear_attention()
    rewritten, change = t.pads_as_concat(model)
    assert change.changed and "Pad" not in ops(rewritten) and ops(rewritten).count("Concat") == 1
    feeds = {
        "r": RNG.standard_normal((1, 2, 8, 8)).astype(np.float32),
        "k": RNG.standard_normal((1, 2, 4, 8)).astype(np.float32),
    }
    np.testing.assert_array_equal(run(rewritten, feeds)[0], run(model, feeds)[0])


@pytest.mark.parametrize(
    ("pads", "axes", "value"),
    [([1, 0, 2, 0, 3, 1], None, 0.0), ([0, 2, 1, 0], [1, 2], -2.5), ([1, 1], [-1], 7.0)],
)
def test_a_pad_of_a_split_on_several_axes_is_the_same_tensor(pads, axes, value) -> None:
    axes_input = ", axes" if axes else ""
    model = parse(
        f"""<ir_version: 10, opset_import: ["": 21]>
        g (float[2, 6, 5] x) => (float[a, b, c] y, float[2, 3, 5] other) {{
          part, other = Split<axis = 1>(x, split)
          y = Pad<mode = "constant">(part, pads, value{axes_input})
        }}"""
    )
    arrays = [("split", np.array([3, 3], np.int64)), ("pads", np.array(pads, np.int64))]
    arrays.append(("value", np.array(value, np.float32)))
    if axes:
        arrays.append(("axes", np.array(axes, np.int64)))
    model = with_inits(model, *arrays)
    rewritten, change = t.pads_as_concat(model)
    assert change.changed and "Pad" not in ops(rewritten), change
    feeds = {"x": RNG.standard_normal((2, 6, 5)).astype(np.float32)}
    np.testing.assert_array_equal(run(rewritten, feeds)[0], run(model, feeds)[0])


def test_a_pad_of_anything_but_a_slice_or_not_constant_stays() -> None:
    conv_input = parse(
        """<ir_version: 10, opset_import: ["": 21]>
        g (float[1, 2, 6, 6] x) => (float[1, 2, 8, 8] y) {
          r = Relu(x)
          y = Pad<mode = "constant">(r, pads)
        }"""
    )
    conv_input = with_inits(conv_input, ("pads", np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64)))
    assert not t.pads_as_concat(conv_input)[1].changed
    reflected = linear_attention()
    pad = next(n for n in reflected.graph.node if n.op_type == "Pad")
    edit.replace_attributes(pad, (), mode="reflect")
    del pad.input[2:]
    assert not t.pads_as_concat(reflected)[1].changed


def end_padded(shape: list[int], end: int = 3, begin: int = 0) -> onnx.ModelProto:
    """A Relu, then a Pad of zeros at the end of its last axis (a time axis padded up to whole
    frames), then a Relu."""
    rank = len(shape)
    padded = [*shape[:-1], shape[-1] + begin + end]
    pads = [0] * (2 * rank)
    pads[rank - 1], pads[2 * rank - 1] = begin, end
    model = parse(
        f"""<ir_version: 10, opset_import: ["": 21]>
        g (float{shape} x) => (float{padded} y) {{
          r = Relu(x)
          p = Pad<mode = "constant">(r, pads)
          y = Relu(p)
        }}"""
    )
    return with_inits(model, ("pads", np.array(pads, np.int64)))


@pytest.mark.parametrize("shape", [[1, 8, 100], [1, 16, 16, 8]])
def test_a_pad_at_the_end_of_the_last_axis_becomes_a_concat(shape: list[int]) -> None:
    model = end_padded(shape)
    rewritten, change = t.pads_as_concat(model)
    assert change.changed and "Pad" not in ops(rewritten), change
    assert "end of its last axis" in change.details[0]
    feeds = {"x": RNG.standard_normal(shape).astype(np.float32)}
    np.testing.assert_array_equal(run(rewritten, feeds)[0], run(model, feeds)[0])


@pytest.mark.parametrize(
    ("shape", "begin"), [([1, 100], 0), ([1, 8, 100], 1)], ids=["rank-2", "both-ends"]
)
def test_a_pad_the_htp_writes_right_stays(shape: list[int], begin: int) -> None:
    assert not t.pads_as_concat(end_padded(shape, begin=begin))[1].changed


def test_a_pre_quantized_models_own_pad_is_left_to_its_rules() -> None:
    """A Pad between a model's own DQ and Q (a TFLite int8 export's "same" padding) is folded
    or completed by ``prequantized``'s rules, which keep its unit quantized; a Concat with a
    float constant there would not be."""
    model = parse(
        """<ir_version: 10, opset_import: ["": 21]>
        g (float[1, 8, 16, 16] x) => (float[1, 8, 17, 17] y) {
          q = QuantizeLinear(x, s, z)
          d = DequantizeLinear(q, s, z)
          p = Pad<mode = "constant">(d, pads)
          pq = QuantizeLinear(p, s, z)
          y = DequantizeLinear(pq, s, z)
        }"""
    )
    model = with_inits(
        model,
        ("s", np.array(0.02, np.float32)),
        ("z", np.array(-128, np.int8)),
        ("pads", np.array([0, 0, 0, 0, 0, 0, 1, 1], np.int64)),
    )
    assert not t.pads_as_concat(model)[1].changed
    assert not t.max_pool_pads_as_concat(model)[1].changed


@pytest.mark.qnn
def test_the_htp_pads_the_end_of_a_last_axis_right_as_a_concat(tmp_path) -> None:
    """In fp16 (the judge's fallback) the simulator pads the end of the last axis of a rank-3
    tensor wrongly (16 dB against the CPU); the Concat form agrees."""
    from compile_fixtures import whole_ctx_vs_float

    model = end_padded([1, 8, 100])
    samples = [{"x": RNG.standard_normal((1, 8, 100)).astype(np.float32) + 1.0}]
    variants = {"float": model, "as_concat": t.pads_as_concat(model)[0]}
    results = whole_ctx_vs_float(tmp_path, variants, samples)
    assert results["as_concat"] > 50.0, results
    # If a new QNN SDK pads it right, this says so: the rewrite is then only exact.
    assert results["float"] < 25.0, results


@pytest.mark.qnn
def test_the_htp_pads_a_slice_of_a_shared_transpose_right_as_a_concat(tmp_path) -> None:
    """The HTP fills a Pad of a slice of a Transpose that another Slice reads with what
    follows the slice in memory (QNN 2.51): EfficientViT's attention normalizer was garbage
    (whole model -0.7 dB); the Concat form agrees."""
    from compile_fixtures import whole_ctx_vs_float

    model = linear_attention()
    samples = [
        {
            "r": RNG.standard_normal((1, 2, 8, 8)).astype(np.float32),
            "k": np.abs(RNG.standard_normal((1, 2, 4, 8))).astype(np.float32),
        }
    ]
    variants = {"float": model, "as_concat": t.pads_as_concat(model)[0]}
    results = whole_ctx_vs_float(tmp_path, variants, samples)
    assert results["as_concat"] > 50.0, results
    # If a new QNN SDK pads such a slice right, this says so: the rewrite is then only exact.
    assert results["float"] < 20.0, results


@pytest.mark.qnn
def test_linear_attention_builds_whole_and_accurate_on_the_htp(tmp_path) -> None:
    """Through the real stages (quantized, judged on the simulator): the padded slice was 2.5 dB
    from the CPU QDQ model on the HTP before the rewrite, 41 dB after."""
    build_whole_on_htp(tmp_path, "linear_attention", linear_attention())


def test_replace_nodes_leaves_nothing_of_a_rewrite_that_keeps_its_node() -> None:
    """A rewrite may add constants before it decides to keep its node: they go with it."""
    model = linear_attention()

    def undecided(node: onnx.NodeProto, context: edit.NodeRewrite):
        context.constant(np.zeros(3, np.float32), "scratch")
        return None

    kept, change = edit.replace_nodes(model, "undecided", undecided)
    assert not change.changed
    assert [i.name for i in kept.graph.initializer] == [i.name for i in model.graph.initializer]

    def relu_as_max(node: onnx.NodeProto, context: edit.NodeRewrite):
        if node.op_type != "Relu":
            context.constant(np.zeros(3, np.float32), "scratch")
            return None
        zero = context.constant(np.array(0.0, np.float32), "zero")
        return [oh.make_node("Max", [node.input[0], zero], list(node.output))], "Relu -> Max"

    rewritten, change = edit.replace_nodes(model, "relu_as_max", relu_as_max)
    assert change.details == ("Relu -> Max",) and "Relu" not in ops(rewritten)
    assert not any(i.name.startswith("scratch") for i in rewritten.graph.initializer)
    feeds = {
        "r": RNG.standard_normal((1, 2, 8, 8)).astype(np.float32),
        "k": RNG.standard_normal((1, 2, 4, 8)).astype(np.float32),
    }
    np.testing.assert_array_equal(run(rewritten, feeds)[0], run(model, feeds)[0])


def _conv_9x9(
    kernel: int, stride: int, pads: list[int], channels: int = 16, size: int = 14,
    depthwise: bool = True,
) -> onnx.ModelProto:  # fmt: skip
    """A Conv of ``channels`` to ``channels``, depthwise or full, over a size x size input."""
    inputs = 1 if depthwise else channels
    w = np.random.default_rng(2).standard_normal((channels, inputs, kernel, kernel))
    out = (size + pads[0] + pads[2] - kernel) // stride + 1
    graph = oh.make_graph(
        [
            oh.make_node(
                "Conv",
                ["x", "w"],
                ["y"],
                kernel_shape=[kernel, kernel],
                strides=[stride, stride],
                pads=pads,
                group=channels if depthwise else 1,
            )
        ],
        "depthwise" if depthwise else "conv",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, size, size])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, channels, out, out])],
        [numpy_helper.from_array((w * 0.1 / np.sqrt(inputs)).astype(np.float32), "w")],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("depthwise", [True, False])
def test_a_9x9_conv_at_stride_2_is_widened_to_11x11_exactly(depthwise: bool) -> None:
    source = _conv_9x9(9, 2, [3, 3, 4, 4], depthwise=depthwise)
    wide, change = t.widen_9x9_stride_2(source)
    assert change.changed and "pads [4, 4, 5, 5]" in change.details[0]
    assert ("depthwise" in change.details[0]) == depthwise
    assert [list(i.dims)[2:] for i in wide.graph.initializer] == [[11, 11]]
    x = RNG.standard_normal((1, 16, 14, 14)).astype(np.float32)
    np.testing.assert_allclose(run(wide, {"x": x})[0], run(source, {"x": x})[0], atol=1e-5)
    for other in (_conv_9x9(9, 1, [4, 4, 4, 4]), _conv_9x9(7, 2, [3, 3, 3, 3], depthwise=False)):
        assert not t.widen_9x9_stride_2(other)[1].changed


@pytest.mark.qnn
def test_the_htp_computes_a_9x9_conv_at_stride_2_wrong_and_11x11_right(tmp_path: Path) -> None:
    """Measured on the simulator (fp16): MixNet's mixed depthwise kernels (9x9 at stride 2 over
    32 channels or more is wrong at any size; 7x7, 11x11 and 9x9 at stride 1 are right) and a
    capsule network's primary capsules (a full 9x9 stride-2 Conv over 32 channels or more is
    wrong where its windows leave input columns unread: 20x20; over 21x21 it is right)."""
    from compile_fixtures import whole_ctx_vs_float

    from pipeline.htp.probe import qnn_available

    if qnn_available():
        pytest.skip(qnn_available())
    models = {
        "float": _conv_9x9(9, 2, [3, 3, 4, 4], channels=32),  # right over 16 channels
        "full": _conv_9x9(9, 2, [0, 0, 0, 0], channels=32, size=20, depthwise=False),
        "tiled": _conv_9x9(9, 2, [0, 0, 0, 0], channels=32, size=21, depthwise=False),
    }
    x = {size: np.random.default_rng(1).uniform(0, 1, (1, 32, size, size)) for size in (14, 20, 21)}
    feeds = {name: {"x": x[m.graph.input[0].type.tensor_type.shape.dim[2].dim_value].astype(
        np.float32)} for name, m in models.items()}  # fmt: skip
    snr = {}
    for name, model in models.items():
        widened = t.widen_9x9_stride_2(model)[0]
        (tmp_path / name).mkdir()
        pair = whole_ctx_vs_float(tmp_path / name, {"float": model, "widened": widened},
                                  [feeds[name]])  # fmt: skip
        snr[name], snr[f"{name} widened"] = pair["float"], pair["widened"]
    assert snr["float"] < 10.0 and snr["full"] < 10.0 and snr["tiled"] > 50.0, snr
    assert min(snr["float widened"], snr["full widened"], snr["tiled widened"]) > 50.0, snr


def _neutral_arithmetic() -> onnx.ModelProto:
    """Conv -> x * 1 -> x + 0 -> Relu -> x - 0 -> x / 1, and four that change x: 0 - x, a
    zero Add that broadcasts x to a larger shape, a non-zero Add, a zero Add as graph output."""
    rng = np.random.default_rng(3)
    inits = [
        numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(np.ones((1, 4, 1, 1), np.float32), "ones"),
        numpy_helper.from_array(np.zeros((4, 1, 1), np.float32), "zeros"),
        numpy_helper.from_array(np.zeros((2, 4, 8, 8), np.float32), "wide_zeros"),
        numpy_helper.from_array(np.full((1, 4, 1, 1), 0.5, np.float32), "half"),
        numpy_helper.from_array(np.float32(0.0), "zero"),
        numpy_helper.from_array(np.float32(1.0), "one"),
    ]
    nodes = [
        oh.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        oh.make_node("Mul", ["ones", "c"], ["m"], name="times_one"),
        oh.make_node("Add", ["m", "zeros"], ["a"], name="plus_zero"),
        oh.make_node("Relu", ["a"], ["r"]),
        oh.make_node("Sub", ["r", "zero"], ["s"], name="minus_zero"),
        oh.make_node("Div", ["s", "one"], ["d"], name="over_one"),
        oh.make_node("Sub", ["zero", "d"], ["negated"]),
        oh.make_node("Add", ["d", "wide_zeros"], ["wide"]),
        oh.make_node("Add", ["d", "half"], ["shifted"]),
        oh.make_node("Add", ["shifted", "zero"], ["y"]),
    ]
    outputs = [
        oh.make_tensor_value_info(name, TensorProto.FLOAT, [batch, 4, 8, 8])
        for name, batch in (("negated", 1), ("wide", 2), ("y", 1))
    ]
    graph = oh.make_graph(
        nodes,
        "neutral",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        outputs,
        inits,
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)


def test_adds_of_zero_and_products_with_one_are_dropped_exactly() -> None:
    source = _neutral_arithmetic()
    dropped, change = t.drop_neutral_arithmetic(source)
    names = {n.name for n in dropped.graph.node}
    assert not names & {"times_one", "plus_zero", "minus_zero", "over_one"}, names
    assert len(change.details) == 4 and "Add of 0 dropped" in change.details[1]
    assert ops(dropped).count("Add") == 3 and ops(dropped).count("Sub") == 1  # the 4 kept
    assert {i.name for i in dropped.graph.initializer} == {
        "w",
        "wide_zeros",
        "half",
        "zero",
    }  # "ones", "zeros" and "one" went with their nodes
    x = RNG.standard_normal((1, 3, 8, 8)).astype(np.float32)
    for got, expected in zip(run(dropped, {"x": x}), run(source, {"x": x}), strict=True):
        np.testing.assert_array_equal(got, expected)
    assert not t.drop_neutral_arithmetic(dropped)[1].changed


def test_a_filled_constant_too_large_to_fold_is_neutral_too() -> None:
    """x + ConstantOfShape(shape, 0) and x * ConstantOfShape(shape, 1), their shapes constant
    (ZoeDepth's attractors add zeros of [1, 64, 192, 256], 12.6 MB, over what folding writes):
    dropped with the ConstantOfShape, which stayed on the CPU beside the QNN graph and made
    its context fail to load. Zeros of a wider shape, and a fill of 2, stay."""
    shape = numpy_helper.from_array(np.array([1, 4, 8, 8], np.int64), "shape")
    wide = numpy_helper.from_array(np.array([2, 4, 8, 8], np.int64), "wide_shape")

    def fill(value: float) -> onnx.TensorProto:
        return numpy_helper.from_array(np.array([value], np.float32), "value")

    nodes = [
        oh.make_node("ConstantOfShape", ["shape"], ["zeros"], value=fill(0.0)),
        oh.make_node("ConstantOfShape", ["shape"], ["ones"], value=fill(1.0)),
        oh.make_node("ConstantOfShape", ["shape"], ["twos"], value=fill(2.0)),
        oh.make_node("ConstantOfShape", ["wide_shape"], ["wide_zeros"], value=fill(0.0)),
        oh.make_node("Add", ["zeros", "x"], ["a"], name="plus_zeros"),
        oh.make_node("Mul", ["a", "ones"], ["m"], name="times_ones"),
        oh.make_node("Mul", ["m", "twos"], ["y"], name="times_twos"),
        oh.make_node("Add", ["m", "wide_zeros"], ["w"], name="plus_wide_zeros"),
    ]
    graph = oh.make_graph(
        nodes,
        "filled",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [
            oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8]),
            oh.make_tensor_value_info("w", TensorProto.FLOAT, [2, 4, 8, 8]),
        ],
        [shape, wide],
    )
    source = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    dropped, change = t.drop_neutral_arithmetic(source)
    names = {n.name for n in dropped.graph.node}
    assert not names & {"plus_zeros", "times_ones"} and len(change.details) == 2, names
    assert {"times_twos", "plus_wide_zeros"} <= names
    assert ops(dropped).count("ConstantOfShape") == 2  # the 2s and the wide zeros
    x = RNG.standard_normal((1, 4, 8, 8)).astype(np.float32)
    for got, expected in zip(run(dropped, {"x": x}), run(source, {"x": x}), strict=True):
        np.testing.assert_array_equal(got, expected)


def _zero_padded(channels: int = 64) -> onnx.ModelProto:
    """x [1, c, 96, 128] and c more channels of zeros from a ConstantOfShape (3 MB at c = 64:
    over what folding writes), then a Relu."""
    shape = numpy_helper.from_array(np.array([1, channels, 96, 128], np.int64), "shape")
    value = numpy_helper.from_array(np.array([0.0], np.float32), "value")
    nodes = [
        oh.make_node("ConstantOfShape", ["shape"], ["zeros"], value=value, name="fill"),
        oh.make_node("Concat", ["x", "zeros"], ["padded"], axis=1),
        oh.make_node("Relu", ["padded"], ["y"]),
    ]
    graph = oh.make_graph(
        nodes,
        "zero_padded",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, 96, 128])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2 * channels, 96, 128])],
        [shape],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)


def test_a_fill_too_large_to_fold_becomes_an_expand_of_its_value() -> None:
    source = _zero_padded()
    assert not t.fold_constants(source)[1].changed  # 3 MB: kept as a node
    expanded, change = t.filled_constants_as_expand(source)
    assert ops(expanded) == ["Expand", "Concat", "Relu"] and change.details == (
        "ConstantOfShape 'fill': Expand of 0",
    )
    x = RNG.standard_normal((1, 64, 96, 128)).astype(np.float32)
    np.testing.assert_array_equal(run(expanded, {"x": x})[0], run(source, {"x": x})[0])
    assert not t.filled_constants_as_expand(expanded)[1].changed


def test_the_htp_runs_the_expanded_fill_whole(tmp_path: Path) -> None:
    """Left on the CPU, the ConstantOfShape fed the QNN graph and its context failed to load
    ("The count of graph inputs should be at least the count of tensor_wrapper!"; ZoeDepth's,
    whose shape was constant only after qnn_preprocess had run); the Expand runs on the HTP."""
    from compile_fixtures import whole_ctx_vs_float

    expanded, _ = t.filled_constants_as_expand(_zero_padded())
    samples = [{"x": RNG.standard_normal((1, 64, 96, 128)).astype(np.float32)}]
    assert whole_ctx_vs_float(tmp_path, {"float": expanded}, samples)["float"] > 60.0


def _moves(noops: bool) -> onnx.ModelProto:
    """Conv -> a chain of moves -> ReLU: each of them gives back its input (``noops``), or
    each changes it (a half Slice, a swapping Transpose, two inputs, scale 2...)."""
    rng = np.random.default_rng(5)
    big = np.iinfo(np.int64).max
    i64 = {
        "zero": [0],
        "end": [big if noops else 4],
        "back": [-8 if noops else -4],
        "end2": [big],
        "axis": [2],
        "axis3": [3],
        "ones": [1, 1, 1, 1] if noops else [1, 1, 2, 1],
        "pads": [0] * 8 if noops else [0, 0, 1, 0, 0, 0, 1, 0],
        "shape": [1, 4, 8, 8],
    }
    inits = [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in i64.items()]
    inits += [
        numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(np.array([1, 1, 1, 1] if noops else [1, 1, 2, 2], np.float32), "s"),
    ]
    nodes = [
        oh.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        oh.make_node("Transpose", ["c"], ["t"], perm=[0, 1, 2, 3] if noops else [0, 1, 3, 2]),
        oh.make_node("Slice", ["t", "zero", "end", "axis"], ["s1"]),
        oh.make_node("Slice", ["s1", "back", "end2", "axis3"], ["s2"]),  # from -8 of 8
        oh.make_node("Tile", ["s2", "ones"], ["tiled"]),
        oh.make_node("Pad", ["tiled", "pads"], ["padded"]),
        oh.make_node("Concat", ["padded"] if noops else ["padded", "padded"], ["joined"], axis=1),
        oh.make_node("Resize", ["joined", "", "s"], ["resized"], mode="nearest"),
        oh.make_node("Relu", ["resized"], ["y"]),
    ]
    if noops:
        nodes.insert(-1, oh.make_node("Reshape", ["resized", "shape"], ["same"]))
        nodes[-1].input[0] = "same"
    graph = oh.make_graph(
        nodes,
        "moves",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [
            oh.make_tensor_value_info(
                "y", TensorProto.FLOAT, [1, 4, 8, 8] if noops else [1, 8, 20, 8]
            )
        ],
        inits,
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)


def test_moves_that_give_back_their_input_are_dropped_exactly() -> None:
    source = _moves(noops=True)
    dropped, change = t.drop_noop_moves(source)
    assert ops(dropped) == ["Conv", "Relu"], ops(dropped)
    assert len(change.details) == 8 and "gives back its input" in change.details[0]
    x = RNG.standard_normal((1, 3, 8, 8)).astype(np.float32)
    np.testing.assert_array_equal(run(dropped, {"x": x})[0], run(source, {"x": x})[0])
    changing = _moves(noops=False)
    kept, change = t.drop_noop_moves(changing)
    assert ops(kept) == ops(changing) and not change.changed


def test_input_sizes_a_layer_does_not_take_are_blamed_on_the_inputs_given() -> None:
    """A recurrent beat tracker fed 314 spectrogram bins where its Gemm takes 266 (the config's
    [inputs] sizes for dims the export left dynamic): onnxruntime's preprocessing names the
    node and both sizes, and the tip says which config keys set them."""
    from pipeline.graph.transforms import qnn_preprocess

    weights = numpy_helper.from_array(np.ones((266, 8), np.float32), "w")
    graph = oh.make_graph(
        [oh.make_node("Gemm", ["x", "w"], ["y"], name="frames_to_hidden")],
        "tracker",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 314])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, "h", "w"])],
        [weights],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)])
    model.ir_version = 10
    with pytest.raises(ModelError) as caught:
        qnn_preprocess(model)
    assert "314" in caught.value.message and "266" in caught.value.message
    assert "[inputs] dims/shapes" in (caught.value.tip or "")
