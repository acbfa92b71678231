"""prepare_model end to end: small dynamic models become static, float32 and whole on the NPU,
and the real models in ../shared/models all come out strictly static with unchanged outputs."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from pipeline.core.accuracy import LABELS
from pipeline.core.config import InputsSection, load_config
from pipeline.core.dtypes import np_dtype
from pipeline.core.errors import ModelError
from pipeline.core.metrics import comparable, snr_db
from pipeline.graph import edit
from pipeline.graph.prepare import dynamic_tensors, prepare_model, quantization_issues
from pipeline.graph.tails import model_tail
from pipeline.quantize.build import load_source_model

ROOT = Path(__file__).resolve().parent.parent
RNG = np.random.default_rng(1)

# Dynamic N/H/W, batch-norm parameters as Constant nodes (ppocr), a Shape->Gather->Concat->
# Reshape flatten (ultraface, ppocr_rec) and x**2 (silero).
CNN = """<ir_version: 8, opset_import: ["": 11]>
g (float[N, 3, H, W] x) => (float[N, ?] y) {
  gamma = Constant<value = float[4] {1.5, 0.5, 1.0, 2.0}>()
  beta = Constant<value = float[4] {0.1, -0.2, 0.3, 0.0}>()
  mean = Constant<value = float[4] {0.0, 0.5, -0.5, 1.0}>()
  var = Constant<value = float[4] {1.0, 2.0, 0.5, 1.5}>()
  c = Conv<pads = [1, 1, 1, 1]>(x, w)
  b = BatchNormalization(c, gamma, beta, mean, var)
  p = Pow(b, two)
  s = Shape(p)
  n = Gather<axis = 0>(s, zero)
  n1 = Unsqueeze<axes = [0]>(n)
  shape = Concat<axis = 0>(n1, minus_one)
  y = Reshape(p, shape)
}"""


def cnn() -> onnx.ModelProto:
    model = onnx.parser.parse_model(CNN)
    model.graph.initializer.extend(
        [
            numpy_helper.from_array(RNG.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"),
            numpy_helper.from_array(np.array(2.0, np.float32), "two"),
            numpy_helper.from_array(np.array(0, np.int64), "zero"),
            numpy_helper.from_array(np.array([-1], np.int64), "minus_one"),
        ]
    )
    onnx.checker.check_model(model)
    return model


def run(model: onnx.ModelProto | str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    source = model if isinstance(model, str) else model.SerializeToString()
    session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


CNN_INPUTS = InputsSection(dims={"N": 1}, shapes={"x": [1, 3, 8, 12]})


def test_prepare_makes_the_cnn_static_float_and_foldless() -> None:
    model = cnn()
    assert dynamic_tensors(model)
    prepared, changes = prepare_model(model, CNN_INPUTS)
    assert dynamic_tensors(prepared) == []
    ops = collections.Counter(n.op_type for n in prepared.graph.node)
    assert ops == {"Conv": 1, "Mul": 1, "Reshape": 1}, ops
    assert prepared.ir_version == 10
    assert [o.version for o in prepared.opset_import if o.domain == ""] == [21]
    assert [d.dim_value for d in prepared.graph.output[0].type.tensor_type.shape.dim] == [1, 384]
    changed = {c.step for c in changes if c.changed}
    assert {"fix_input_shapes", "fold_constants", "fold_batchnorm", "rewrite_for_htp"} <= changed
    x = RNG.standard_normal((1, 3, 8, 12)).astype(np.float32)
    np.testing.assert_allclose(run(prepared, {"x": x})[0], run(model, {"x": x})[0], rtol=1e-4)


def test_steps_edit_the_model_the_step_before_made_never_the_callers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Preparation hands each step the model the step before made, to edit in place (each of
    ~110 steps copied the whole model, most of them to change nothing); the caller's model is
    never edited, and only a step's own ``edit.writable`` takes what was handed over."""
    copies: list[str] = []  # the copies ``writable`` made
    real_copy = edit.copy_model

    def counted(m: onnx.ModelProto) -> onnx.ModelProto:
        copies.append(sys._getframe(1).f_code.co_name)
        return real_copy(m)

    monkeypatch.setattr(edit, "copy_model", counted)
    model = cnn()
    before = model.SerializeToString()
    prepared, _ = prepare_model(model, CNN_INPUTS)
    assert model.SerializeToString() == before
    assert prepared is not model
    handing_over = copies.count("writable")
    del copies[:]
    real_hand_over = edit.handed_over
    monkeypatch.setattr(edit, "handed_over", lambda model, step: real_hand_over(None, step))
    same, _ = prepare_model(model, CNN_INPUTS)
    assert same.SerializeToString() == prepared.SerializeToString()
    # 84 copies without the hand-over, 6 with it (helpers that steps call on their input)
    assert copies.count("writable") - handing_over >= 70, (copies.count("writable"), handing_over)
    monkeypatch.setattr(edit, "handed_over", real_hand_over)

    def step(m: onnx.ModelProto) -> onnx.ModelProto:
        return edit.writable(m)

    def twice(m: onnx.ModelProto) -> tuple[onnx.ModelProto, onnx.ModelProto]:
        return edit.writable(m), edit.writable(m)

    def through_a_helper(m: onnx.ModelProto) -> onnx.ModelProto:
        return step(m)  # a helper's edits would land under its caller's feet: a copy

    with edit.handed_over(model, step):
        assert step(model) is model
        assert step(model) is not model  # handed over once
    assert step(model) is not model  # outside a hand-over: a copy
    with edit.handed_over(model, twice):
        first, second = twice(model)
        assert first is model and second is not model
    with edit.handed_over(model, through_a_helper):
        assert through_a_helper(model) is not model
    with edit.handed_over(None, step):
        assert step(model) is not model

    def passing_on(m: onnx.ModelProto) -> onnx.ModelProto:
        return step(edit.passed_on(m))  # the step says it reads its model no more

    with edit.handed_over(model, passing_on):
        assert passing_on(model) is model
    with edit.handed_over(model, through_a_helper):
        assert passing_on(model) is not model  # only the step it was handed to passes it on


def test_prepare_names_the_unfixed_dim_and_the_key_to_set() -> None:
    with pytest.raises(ModelError) as info:
        prepare_model(cnn(), InputsSection(dims={"N": 1}))
    message = str(info.value)
    assert "input 'x' dim 2 (H) is dynamic" in message and "[inputs] dims = {H = N}" in message
    assert "input 'x' dim 3 (W)" in message


def test_prepare_names_tensors_that_stay_dynamic_and_their_op() -> None:
    model = onnx.parser.parse_model(
        '<ir_version: 8, opset_import: ["": 13]> g (float[4] x) => (int64[1, ?] y) '
        "{ y = NonZero(x) }"
    )
    with pytest.raises(ModelError, match=r"'y' from NonZero") as info:
        prepare_model(model, InputsSection())
    assert "as many values as the data decides" in (info.value.tip or "")  # no dims fix it


def string_encoder_model(version: int) -> onnx.ModelProto:
    """A grapheme-to-phoneme classifier's shape: letters -> ai.onnx.ml LabelEncoder -> ids ->
    an embedding -> a layer (version 1 of the encoder, as an old exporter wrote it, has no
    inferred output shape; version 2 has one)."""
    h = onnx.helper
    encoding = (
        {"classes_strings": ["-", "a", "b", "c"], "default_int64": 0}
        if version == 1
        else {"keys_strings": ["a", "b", "c"], "values_int64s": [1, 2, 3], "default_int64": 0}
    )
    nodes = [
        h.make_node(
            "LabelEncoder", ["letters"], ["ids"], "encode", domain="ai.onnx.ml", **encoding
        ),
        h.make_node("Gather", ["table", "ids"], ["embedded"]),
        h.make_node("MatMul", ["embedded", "weight"], ["y"]),
    ]
    table = RNG.standard_normal((4, 3)).astype(np.float32)
    weight = RNG.standard_normal((3, 2)).astype(np.float32)
    graph = h.make_graph(
        nodes,
        "g2p",
        [h.make_tensor_value_info("letters", onnx.TensorProto.STRING, [1, 8])],
        [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 8, 2])],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(weight, "weight")],
    )
    opsets = [h.make_opsetid("", 13), h.make_opsetid("ai.onnx.ml", version)]
    return h.make_model(graph, ir_version=8, opset_imports=opsets)


@pytest.mark.parametrize("version", [1, 2])
def test_prepare_refuses_string_inputs_naming_the_encoder_and_the_cut(version: int) -> None:
    """Strings in: version 1 of the encoder stopped the build with every tensor after it
    "dynamic" and a tip to fix [inputs] dims; version 2 got through preparation and died in
    calibration on a numpy error (object arrays in the sample files). Now both are refused at
    once, with the op that reads the strings and the cut that builds the numeric part."""
    model = string_encoder_model(version)
    letters = np.array([["a", "b", "z", "c", "a", "a", "b", "c"]], dtype=object)
    assert run(model, {"letters": letters})[0].shape == (1, 8, 2)  # a model onnxruntime runs
    with pytest.raises(ModelError) as info:
        prepare_model(model, InputsSection())
    assert "Input 'letters' holds strings, read by ai.onnx.ml:LabelEncoder 'encode'" in str(
        info.value
    )
    tip = info.value.tip or ""
    assert "input_names=['ids']" in tip and "[inputs]" not in tip  # no dims fix it


def test_an_input_passed_through_as_an_output_is_refused_naming_the_outputs_to_build() -> None:
    """A model that returns an input unchanged beside what it computes: its build stopped with
    "no static shape: 'y' from Conv" (onnx's inference gave up on the graph once that output's
    shape was cleared) or, shaped, in onnxruntime's quantizer ("Graph is not a DAG")."""
    model = onnx.parser.parse_model(
        '<ir_version: 8, opset_import: ["": 17]> g (float[1, 3, 8, 8] x) => '
        "(float[1, 2, 8, 8] y, float[1, 3, 8, 8] x) { y = Conv <pads = [1, 1, 1, 1]> (x, w) }"
    )
    model.graph.initializer.append(
        numpy_helper.from_array(RNG.standard_normal((2, 3, 3, 3)).astype(np.float32), "w")
    )
    assert edit.dynamic_outputs(model) == []  # its shapes infer, the passthrough's kept
    with pytest.raises(ModelError) as info:
        prepare_model(model, InputsSection())
    assert "Output(s) 'x' are graph inputs passed through unchanged" in info.value.message
    assert 'outputs = ["y"]' in (info.value.tip or "")


def test_prepare_names_an_unshaped_ml_op_in_front_of_the_network() -> None:
    """A Normalizer over rank 3 (not rewritten: onnxruntime's kernel strides over the last
    axis of rank 1 or 2 only) leaves its output without an inferred shape, and every tensor
    after it dynamic: the refusal names that op, not the dims."""
    model = onnx.parser.parse_model(
        '<ir_version: 8, opset_import: ["": 13, "ai.onnx.ml": 1]> g (float[1, 2, 4] x) => '
        '(float[1, 2, 3] y) { n = ai.onnx.ml.Normalizer<norm = "L2">(x) '
        "y = MatMul(n, w) }"
    )
    weight = RNG.standard_normal((4, 3)).astype(np.float32)
    model.graph.initializer.append(numpy_helper.from_array(weight, "w"))
    with pytest.raises(ModelError) as info:
        prepare_model(model, InputsSection())
    assert "computed from 'n', which ai.onnx.ml:Normalizer writes in front" in str(info.value)
    assert "input_names=['n']" in (info.value.tip or "")


def detector_with_nms() -> onnx.ModelProto:
    """A detector exported 'with post': a Conv head, then NMS keeps as many boxes as the data
    decides."""
    model = onnx.parser.parse_model(
        '<ir_version: 8, opset_import: ["": 13]> g (float[1, 4, 8, 1] x) => (float[?, 4] kept) {'
        " h = Conv(x, w) \n hs = Squeeze(h, three) \n boxes = Transpose<perm = [0, 2, 1]>(hs) \n"
        " s = ReduceMean<axes = [1], keepdims = 1>(hs) \n scores = Sigmoid(s) \n"
        " k = Constant<value = int64[1] {5}>() \n i = NonMaxSuppression(boxes, scores, k) \n"
        " c = Constant<value = int64[1] {2}>() \n j = Gather<axis = 1>(i, c) \n"
        " r = Constant<value = int64[2] {8, 4}>() \n b = Reshape(boxes, r) \n"
        " jj = Squeeze(j) \n kept = Gather(b, jj) }"
    )
    rng = np.random.default_rng(3)
    model.graph.initializer.extend(
        [
            numpy_helper.from_array(rng.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32), "w"),
            numpy_helper.from_array(np.array([3], np.int64), "three"),
        ]
    )
    return model


def test_a_detector_with_its_nms_gets_a_tip_to_leave_it_out() -> None:
    with pytest.raises(ModelError) as info:
        prepare_model(detector_with_nms(), InputsSection())
    assert "from NonMaxSuppression" in str(info.value)
    tip = info.value.tip or ""
    assert "[model] outputs" in tip and "Fix more dims" not in tip


def ssd_with_per_class_post_processing(classes: int = 3) -> onnx.ModelProto:
    """SSDlite's export 'with post', small: a head's boxes and class scores, then per class a
    column of the scores, a threshold, NonZero's positions, the boxes and scores gathered there
    and NMS over them (torchvision's postprocess_detections, traced)."""
    h = onnx.helper
    f = onnx.TensorProto.FLOAT
    nodes = [
        h.make_node("Conv", ["x", "w"], ["feat"]),  # [1, 4 + classes, 8, 1]
        h.make_node("Squeeze", ["feat", "three"], ["flat"]),  # [1, 4 + classes, 8]
        h.make_node("Transpose", ["flat"], ["rows"], perm=[0, 2, 1]),  # [1, 8, 4 + classes]
        h.make_node("Split", ["rows", "sizes"], ["boxes", "logits"], axis=2),
        h.make_node("Softmax", ["logits"], ["scores"], axis=2),
        h.make_node("Squeeze", ["boxes", "zero"], ["box_rows"]),  # [8, 4]
    ]
    kept = []
    for c in range(classes):
        nodes += [
            h.make_node("Gather", ["scores", f"c{c}"], [f"col{c}"], axis=2),  # [1, 8]
            h.make_node("Squeeze", [f"col{c}", "zero"], [f"s{c}"]),  # [8]
            h.make_node("Greater", [f"s{c}", "threshold"], [f"over{c}"]),
            h.make_node("NonZero", [f"over{c}"], [f"nz{c}"]),
            h.make_node("Squeeze", [f"nz{c}", "zero"], [f"at{c}"]),
            h.make_node("Gather", ["box_rows", f"at{c}"], [f"b{c}"]),
            h.make_node("Gather", [f"s{c}", f"at{c}"], [f"p{c}"]),
        ]
        kept += [f"b{c}", f"p{c}"]
    nodes.append(h.make_node("Concat", kept[0::2], ["all_boxes"], axis=0))
    rng = np.random.default_rng(5)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (4 + classes, 4, 1, 1)).astype(np.float32), "w"),
        numpy_helper.from_array(np.array([3], np.int64), "three"),
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array([4, classes], np.int64), "sizes"),
        numpy_helper.from_array(np.array(0.2, np.float32), "threshold"),
        *[numpy_helper.from_array(np.array(c, np.int64), f"c{c}") for c in range(classes)],
    ]
    graph = h.make_graph(
        nodes,
        "ssd",
        [h.make_tensor_value_info("x", f, [1, 4, 8, 1])],
        [h.make_tensor_value_info("all_boxes", f, None)],
        inits,
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 13)], ir_version=8)


def test_a_data_sized_refusal_names_the_network_outputs_to_cut_at() -> None:
    """The data-sized op's own inputs are a per-class slice of the scores after a threshold
    (SSDlite: 751 shapeless tensors behind 90 NonZeros): the tip names the head's boxes and
    scores instead, and cutting there builds."""
    from pipeline.graph.prepare import post_processing_inputs
    from pipeline.graph.transforms import cut_at_outputs

    model = ssd_with_per_class_post_processing()
    with pytest.raises(ModelError) as info:
        prepare_model(model, InputsSection())
    assert "from NonZero" in str(info.value)
    tip = info.value.tip or ""
    assert 'Set [model] outputs = ["scores", "box_rows"]' in tip, tip
    # the detector with one NMS: its inputs, the boxes and scores, are the cut
    dynamic = {name for name, _ in edit.dynamic_outputs(detector_with_nms())}
    assert post_processing_inputs(detector_with_nms(), dynamic) == ["boxes", "scores"]
    cut = cut_at_outputs(model, ["scores", "box_rows"])
    prepare_model(cut, InputsSection())  # static all the way: it builds


def test_model_outputs_cut_the_source_before_its_post_processing() -> None:
    from pipeline.graph.transforms import cut_at_outputs

    model = detector_with_nms()
    cut = cut_at_outputs(model, ["boxes", "scores"])
    assert [o.name for o in cut.graph.output] == ["boxes", "scores"]
    assert "NonMaxSuppression" not in {n.op_type for n in cut.graph.node}
    x = np.random.default_rng(4).normal(0, 1, (1, 4, 8, 1)).astype(np.float32)
    whole = onnx.helper.make_tensor_value_info("boxes", onnx.TensorProto.FLOAT, None)
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    exposed.graph.output.append(whole)
    want = run(exposed, {"x": x})[1]
    np.testing.assert_array_equal(run(cut, {"x": x})[0], want)
    prepared, _ = prepare_model(cut, InputsSection())  # static all the way: it builds
    assert [o.name for o in prepared.graph.output] == ["boxes", "scores"]
    with pytest.raises(ModelError, match=r"'score' \(did you mean 'scores'\?\)"):
        cut_at_outputs(model, ["boxes", "score"])


def test_a_cut_keeps_an_ai_onnx_ml_outputs_declared_shape() -> None:
    """onnx infers a TreeEnsembleClassifier's label without a shape; cut at it, the model
    took that as its output and failed onnx's check in the first step with a tip calling it a
    bug (a LightGBM classifier from PyPI, label kept, ZipMap left out). The source's declared
    output is kept; the preparation then says the NPU runs none of it."""
    from pipeline.graph.transforms import cut_at_outputs

    trees = onnx.helper.make_node(
        "TreeEnsembleClassifier",
        ["x"],
        ["label", "scores"],
        domain="ai.onnx.ml",
        class_ids=[0, 1],
        class_nodeids=[1, 2],
        class_treeids=[0, 0],
        class_weights=[1.0, 1.0],
        classlabels_int64s=[0, 1],
        nodes_falsenodeids=[2, 0, 0],
        nodes_featureids=[0, 0, 0],
        nodes_modes=["BRANCH_LEQ", "LEAF", "LEAF"],
        nodes_nodeids=[0, 1, 2],
        nodes_treeids=[0, 0, 0],
        nodes_truenodeids=[1, 0, 0],
        nodes_values=[0.5, 0.0, 0.0],
    )
    zipmap = onnx.helper.make_node(
        "ZipMap", ["scores"], ["probabilities"], domain="ai.onnx.ml", classlabels_int64s=[0, 1]
    )
    maps = onnx.helper.make_sequence_type_proto(
        onnx.helper.make_map_type_proto(
            onnx.TensorProto.INT64, onnx.helper.make_tensor_type_proto(onnx.TensorProto.FLOAT, None)
        )
    )
    graph = onnx.helper.make_graph(
        [trees, zipmap],
        "trees",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3])],
        [
            onnx.helper.make_tensor_value_info("label", onnx.TensorProto.INT64, [1]),
            onnx.helper.make_value_info("probabilities", maps),
        ],
    )
    model = onnx.helper.make_model(
        graph,
        opset_imports=[onnx.helper.make_opsetid("", 9), onnx.helper.make_opsetid("ai.onnx.ml", 1)],
        ir_version=4,
    )
    cut = cut_at_outputs(model, ["label"])
    onnx.checker.check_model(cut)
    assert [o.name for o in cut.graph.output] == ["label"]
    assert cut.graph.output[0].type.tensor_type.shape.dim[0].dim_value == 1
    with pytest.raises(ModelError, match="Nothing in this model can run on the NPU"):
        prepare_model(cut, InputsSection())


def test_a_cut_at_a_tensor_whose_rank_only_preparation_tells_builds() -> None:
    """A Reshape to a shape the source computes at run time (paddle2onnx's dynamic dims) has no
    rank onnx can infer from the source; cut there, it was refused at once ("not even its
    rank": a PP-Structure table model's backbone output, which built at 43.5 dB before). Its
    shape is static once preparation bakes and folds the shape: it builds."""
    from pipeline.graph.transforms import cut_at_outputs

    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Reshape", ["x", "shape"], ["r"]),
            onnx.helper.make_node("Transpose", ["r"], ["t"], perm=[1, 0]),
            onnx.helper.make_node("Relu", ["t"], ["y"]),
        ],
        "reshaped",
        [
            onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 12]),
            onnx.helper.make_tensor_value_info("shape", onnx.TensorProto.INT64, ["k"]),
        ],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
    )
    model = onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8
    )
    cut = cut_at_outputs(model, ["t"])
    prepared, _ = prepare_model(cut, InputsSection(constants={"shape": [3, 4]}))
    (output,) = prepared.graph.output
    assert [d.dim_value for d in output.type.tensor_type.shape.dim] == [4, 3]


def test_a_detector_cut_before_its_nms_builds(tmp_path: Path) -> None:
    """The quantize stage with [model] outputs: the part before the NMS is the model every
    figure refers to (the source as cut), and its QDQ model ends at those tensors."""
    from pipeline.__main__ import main

    onnx.save(detector_with_nms(), str(tmp_path / "m.onnx"))
    config = tmp_path / "m.toml"
    config.write_text(
        '[model]\nname = "det"\nsource = "m.onnx"\noutputs = ["boxes", "scores"]\n\n'
        '[calibration]\nkind = "random"\nsamples = 8\n\n[quantization]\nmin_snr_db = 20.0\n'
    )
    assert main(["quantize", "--artifacts", str(tmp_path / "a"), str(config)]) == 0
    qdq = onnx.load(str(tmp_path / "a" / "build" / "det" / "buckets" / "static" / "qdq.onnx"))
    assert [o.name for o in qdq.graph.output] == ["boxes", "scores"]
    assert "NonMaxSuppression" not in {n.op_type for n in qdq.graph.node}


def test_where_the_source_is_cut_is_part_of_the_quantize_key(tmp_path: Path) -> None:
    """A new cut must re-quantize; a config without one keeps its digest (no rebuild)."""
    base = '[model]\nname = "m"\nsource = "m.onnx"\n'
    rest = '\n[calibration]\nkind = "random"\nsamples = 4\n'
    (tmp_path / "m.onnx").write_bytes(b"")
    digests = []
    for extra in ("", 'outputs = ["boxes", "scores"]\n', 'outputs = ["boxes"]\n'):
        path = tmp_path / f"c{len(digests)}.toml"
        path.write_text(base + extra + rest)
        digests.append(load_config(path, check_files=False).quantize_digest())
    assert len(set(digests)) == 3


def test_a_data_dependent_loop_gets_a_tip_that_no_dims_can_fix() -> None:
    """An autoregressive decoder's Loop: the tip says to cut before it, not to fix dims."""
    model = onnx.parser.parse_model(
        '<ir_version: 8, opset_import: ["": 13]> g (float[1, 4] x) => (float[?, 1, 4] y) {'
        " s = ReduceSum<keepdims = 0>(x) \n n = Cast<to = 7>(s) \n"
        " go = Constant<value = bool {1}>() \n"
        " y = Loop(n, go) <body = step (int64 i, bool c) => (bool c_out, float[1, 4] v) {"
        " c_out = Identity(c) \n v = Identity(x) }> }"
    )
    with pytest.raises(ModelError) as info:
        prepare_model(model, InputsSection())
    assert "'y' from Loop" in str(info.value)
    tip = info.value.tip or ""
    assert "data-dependent number of iterations" in tip and "Fix more dims" not in tip


def test_prepare_inlines_if_on_baked_constant_and_converts_fp16() -> None:
    model = onnx.parser.parse_model(
        """<ir_version: 8, opset_import: ["": 13]>
        g (float16[B, 4] x, int64 sr) => (float16[B, 4] y) {
          cond = Equal(sr, k)
          y = If(cond) <
            then_branch = t () => (float16[B, 4] a) { a = Relu(x) },
            else_branch = e () => (float16[B, 4] b) { b = Neg(x) }
          >
        }"""
    )
    model.graph.initializer.append(numpy_helper.from_array(np.array(16000, np.int64), "k"))
    prepared, _ = prepare_model(model, InputsSection(dims={"B": 2}, constants={"sr": 16000}))
    assert [n.op_type for n in prepared.graph.node] == ["Relu"]
    assert [i.name for i in prepared.graph.input] == ["x"]
    assert prepared.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert dynamic_tensors(prepared) == []


@pytest.mark.parametrize(("scale", "bad"), [(0.01, False), (np.inf, True), (3e30, True)])
def test_quantization_issues_flags_overflowed_scales(scale: float, bad: bool) -> None:
    model = onnx.parser.parse_model(
        '<ir_version: 10, opset_import: ["": 21]> g (float[4] x) => (float[4] y) '
        "{ q = QuantizeLinear(x, s, z) \n y = DequantizeLinear(q, s, z) }"
    )
    model.graph.initializer.extend(
        [
            numpy_helper.from_array(np.array(scale, np.float32), "s"),
            numpy_helper.from_array(np.array(0, np.uint16), "z"),
        ]
    )
    issues = quantization_issues(model)
    assert issues == ([f"'x' (QuantizeLinear ''): scale {np.float32(scale):g}"] if bad else [])


@pytest.mark.qnn
def test_prepared_cnn_compiles_whole_on_htp(tmp_path: Path) -> None:
    """The point of preparing: one QNN partition, only the graph-I/O Q/DQ left on the CPU."""
    pytest.importorskip("onnxruntime_qnn")
    from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    from tests.release_fixtures import qnn_devices

    prepared, _ = prepare_model(cnn(), CNN_INPUTS)
    float_path, qdq_path, ctx_path = (tmp_path / n for n in ("f.onnx", "q.onnx", "ctx.onnx"))
    onnx.save(prepared, float_path)
    samples = [{"x": RNG.standard_normal((1, 3, 8, 12)).astype(np.float32)} for _ in range(4)]

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(samples)

        def get_next(self):  # type: ignore[override]
            return next(self.it, None)

    config = get_qnn_qdq_config(
        str(float_path), Reader(), activation_type=QuantType.QUInt16, weight_type=QuantType.QUInt8
    )
    quantize(str(float_path), str(qdq_path), config)
    qdq = onnx.load(qdq_path)
    assert dynamic_tensors(qdq) == []
    options = ort.SessionOptions()
    options.log_severity_level = 3
    provider = {"backend_type": "htp", "soc_model": "60", "htp_arch": "73"}
    options.add_provider_for_devices(qnn_devices(), provider)
    ort.ModelCompiler(
        options,
        str(qdq_path),
        embed_compiled_data_into_model=True,
        flags=ort.OrtCompileApiFlags.ERROR_IF_NO_NODES_COMPILED,
    ).compile_to_file(str(ctx_path))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_provider_for_devices(qnn_devices(), provider)
    options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    session = ort.InferenceSession(str(ctx_path), options)
    assignment = session.get_provider_graph_assignment_info()
    qnn = [s for s in assignment if s.ep_name == "QNNExecutionProvider"]
    cpu_ops = {
        n.op_type for s in assignment if s.ep_name != "QNNExecutionProvider" for n in s.get_nodes()
    }
    assert len(qnn) == 1 and cpu_ops <= {"QuantizeLinear", "DequantizeLinear"}, cpu_ops


# --- the real models ------------------------------------------------------------------------

# Bucketed configs keep their dynamic dims on purpose (pipeline.graph.buckets plans them per bucket).
REAL = sorted(
    p.stem
    for p in (ROOT / "configs" / "shared").glob("*.toml")
    if not load_config(p, check_files=False).buckets.enabled
)


def _feed(info: ort.NodeArg, like: np.ndarray | None = None) -> np.ndarray:
    if like is not None:  # the same data for the source model, in its input type
        return like.astype(np.float16) if "float16" in info.type else like
    shape = list(info.shape)
    if "int" in info.type:  # 0/1: a valid token id, mask or segment in every vocabulary
        return RNG.integers(0, 2, size=shape).astype(np_dtype(info.type))
    return (RNG.standard_normal(shape) * 0.5).astype(np.float32)


@pytest.mark.real
@pytest.mark.parametrize("name", REAL)
def test_real_model_prepares_static_with_same_outputs(name: str) -> None:
    config = load_config(ROOT / "configs" / "shared" / f"{name}.toml", check_files=False)
    if not config.source_path.is_file():
        pytest.skip(f"real model {config.source_path} is not here (../shared/models)")
    source = load_source_model(config.source_path)  # sorted: some exporters leave it unsorted
    prepared, _ = prepare_model(source, config.inputs)
    tail = model_tail(prepared)  # a declared CPU tail (labels, score maps) may stay dynamic
    assert [n for n in dynamic_tensors(prepared) if n not in tail.outputs] == []
    assert "BatchNormalization" not in {n.op_type for n in prepared.graph.node}
    assert all(
        i.type.tensor_type.elem_type != onnx.TensorProto.FLOAT16 for i in prepared.graph.input
    )
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(prepared.SerializeToString(), options)
    feeds = {i.name: _feed(i) for i in session.get_inputs()}
    original = ort.InferenceSession(str(config.source_path), options)
    source_feeds = {}
    for info in original.get_inputs():
        if info.name in config.inputs.constants:
            value = config.inputs.constants[info.name]
            source_feeds[info.name] = np.array(value, dtype=np.int64)
        else:
            source_feeds[info.name] = _feed(info, feeds[info.name])
    for got, want in zip(session.run(None, feeds), original.run(None, source_feeds), strict=True):
        kind, want_values = comparable(want)
        if kind == LABELS:
            np.testing.assert_array_equal(comparable(got)[1], want_values)
        else:  # the lossless bound of the pipeline's own check (pipeline.quantize.lossless)
            assert snr_db(want_values, comparable(got)[1]) >= 60.0


def test_an_invalid_step_is_named_though_checks_are_deferred(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Preparation checks its end result once (the checker serializes the whole model each
    time); when that fails, the steps run again, each checked, to name the one at fault."""
    import pipeline.graph.prepare as prepare_mod
    from pipeline.graph import edit

    original = prepare_mod.preparation_steps

    def dangling(model: onnx.ModelProto) -> tuple[onnx.ModelProto, edit.Change]:
        model = edit.copy_model(model)
        reader = next(n for n in model.graph.node if n.input)
        reader.input[0] = "nothing_defines_this"
        return edit.checked_change(model, "dangling_input", ["an input nothing defines"])

    checked: list[str] = []
    real_check = edit.check

    def counted(model: onnx.ModelProto, step: str) -> None:
        checked.append(step)
        real_check(model, step)

    monkeypatch.setattr(edit, "check", counted)
    prepare_model(cnn(), CNN_INPUTS)
    assert checked == ["preparation (the steps together)"]

    steps = original(CNN_INPUTS)
    monkeypatch.setattr(
        prepare_mod, "preparation_steps", lambda inputs, *_: [*steps[:3], dangling, *steps[3:]]
    )
    with pytest.raises(ModelError, match="'dangling_input' produced an invalid ONNX model"):
        prepare_model(cnn(), CNN_INPUTS)


def test_an_ir_3_model_with_weights_outside_its_inputs_loads_as_onnxruntime_runs_it(
    tmp_path: Path,
) -> None:
    """Before IR 4 every initializer had to be a graph input; old onnxmltools/WinML exports
    keep their weights out of the inputs, onnxruntime runs them with those weights as constants
    (as IR 4 reads them), and the checker refused them at load."""
    import onnx.helper as oh

    weight = numpy_helper.from_array(RNG.standard_normal((4, 3, 3, 3)).astype(np.float32), "W")
    graph = oh.make_graph(
        [oh.make_node("Conv", ["x", "W"], ["y"], kernel_shape=[3, 3])],
        "ir3",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 8, 8])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4, 6, 6])],
        [weight],
    )
    saved = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 8)], ir_version=3)
    path = tmp_path / "ir3.onnx"
    onnx.save(saved, str(path))
    with pytest.raises(onnx.checker.ValidationError, match="not in graph input"):
        onnx.checker.check_model(saved)
    loaded = load_source_model(path)
    assert loaded.ir_version == 4
    assert_same_on_cpu(saved, loaded)


def assert_same_on_cpu(saved: onnx.ModelProto, loaded: onnx.ModelProto) -> None:
    """onnxruntime computes the same for the file and for the model as loaded."""
    x = RNG.standard_normal((1, 3, 8, 8)).astype(np.float32)
    run = [
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"x": x}
        )[0]
        for m in (saved, loaded)
    ]
    np.testing.assert_array_equal(run[0], run[1])


def test_an_ir_1_model_with_opset_imports_loads_as_ir_3(tmp_path: Path) -> None:
    """PyTorch 0.2-0.3 wrote IR version 1 beside an opset import; onnxruntime runs such a
    file, and the checker refused it before anything else was looked at."""
    import onnx.helper as oh

    weight = numpy_helper.from_array(RNG.standard_normal((4, 3, 3, 3)).astype(np.float32), "W")
    graph = oh.make_graph(
        [
            oh.make_node("Conv", ["x", "W"], ["c"], kernel_shape=[3, 3]),
            oh.make_node("Relu", ["c"], ["y"]),
        ],
        "ir1",
        [
            oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 8, 8]),
            oh.make_tensor_value_info("W", onnx.TensorProto.FLOAT, [4, 3, 3, 3]),
        ],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4, 6, 6])],
        [weight],
    )
    saved = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 7)])
    saved.ir_version = 1
    path = tmp_path / "ir1.onnx"
    onnx.save(saved, str(path))
    with pytest.raises(onnx.checker.ValidationError, match="IR version < 3"):
        onnx.checker.check_model(saved)
    loaded = load_source_model(path)
    assert loaded.ir_version == 3
    assert_same_on_cpu(saved, loaded)


def test_a_merged_models_repeated_opset_imports_become_one_per_domain(tmp_path: Path) -> None:
    """``onnx.compose.merge_models`` lists each domain once per merged model; the opset
    upgrade raised only the first entry, onnxruntime read the last, and calibration's opset-18
    ReduceMean was refused ("has input size 2 not in range"). One entry per domain, the one
    onnxruntime runs the source at; the whole quantize stage then runs."""
    import onnx.helper as oh
    from compile_fixtures import quantize_on_noise

    weight = numpy_helper.from_array(RNG.standard_normal((4, 3, 3, 3)).astype(np.float32), "W")
    graph = oh.make_graph(
        [
            oh.make_node("Conv", ["x", "W"], ["c"], kernel_shape=[3, 3]),
            oh.make_node("Relu", ["c"], ["y"]),
        ],
        "merged",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 8, 8])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4, 6, 6])],
        [weight],
    )
    imports = [("", 13), ("com.microsoft", 1), ("", 17), ("com.microsoft", 1)]
    saved = oh.make_model(graph, opset_imports=[oh.make_opsetid(d, v) for d, v in imports])
    saved.ir_version = 8
    path = tmp_path / "merged.onnx"
    onnx.save(saved, str(path))
    loaded = load_source_model(path)
    assert [(o.domain, o.version) for o in loaded.opset_import] == [("", 17), ("com.microsoft", 1)]
    assert quantize_on_noise(tmp_path, "merged", saved, 'judge = "cpu"') == 0


def test_a_constant_for_an_input_no_node_reads_is_taken() -> None:
    """A tagger's ``length`` input that its graph never reads: the config that sets it, as
    the package's own code feeds it, was refused ("not an input of the model") because the
    unread input had been dropped before the constants were baked."""
    import onnx.helper as oh

    graph = oh.make_graph(
        [oh.make_node("Relu", ["x"], ["y"])],
        "unread",
        [
            oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4]),
            oh.make_tensor_value_info("length", onnx.TensorProto.INT64, [1]),
        ],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    prepared, _ = prepare_model(model, InputsSection(constants={"length": [4]}))
    assert [i.name for i in prepared.graph.input] == ["x"]
