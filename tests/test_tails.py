"""ai.onnx.ml post-processing tails (ArgMax -> ArrayFeatureExtractor label lookup, ZipMap score
map): found by rule, kept on the CPU as a declared tail, and a model ending in one builds,
compiles whole on the NPU otherwise, publishes, and runs from the release with the non-tensor
outputs onnxruntime gives."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.parser
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

from pipeline.compile import coverage
from pipeline.core.accuracy import LABELS, MAP_VALUES, Accuracy, worst_snr
from pipeline.core.config import InputsSection
from pipeline.core.errors import ModelError
from pipeline.core.metrics import OutputComparison, comparable
from pipeline.graph.prepare import prepare_model
from pipeline.graph.tails import model_tail, summary_tail
from qnn_ctx_runtime import qnn

RNG = np.random.default_rng(5)
LABEL_NAMES = ["cat", "dog", "bird"]


def classifier(string_labels: bool = True) -> onnx.ModelProto:
    """Conv -> GlobalAveragePool -> Flatten -> Gemm -> Softmax, then the converters' tail:
    ArgMax -> ArrayFeatureExtractor (label) and ZipMap (label -> score)."""
    classes = len(LABEL_NAMES)
    if string_labels:
        labels = oh.make_tensor(
            "labels", TensorProto.STRING, [classes], [s.encode() for s in LABEL_NAMES]
        )
        zipmap = oh.make_node(
            "ZipMap",
            ["probs"],
            ["scores"],
            domain="ai.onnx.ml",
            classlabels_strings=LABEL_NAMES,
        )
        label_type, key_type = TensorProto.STRING, TensorProto.STRING
    else:
        labels = numpy_helper.from_array(np.arange(classes, dtype=np.int64), "labels")
        zipmap = oh.make_node(
            "ZipMap",
            ["probs"],
            ["scores"],
            domain="ai.onnx.ml",
            classlabels_int64s=list(range(classes)),
        )
        label_type, key_type = TensorProto.INT64, TensorProto.INT64
    inits = [
        numpy_helper.from_array((RNG.standard_normal((4, 3, 3, 3)) * 0.5).astype("f4"), "w"),
        numpy_helper.from_array((RNG.standard_normal((classes, 4)) * 2).astype("f4"), "fc_w"),
        numpy_helper.from_array(np.zeros(classes, "f4"), "fc_b"),
        labels,
    ]
    nodes = [
        oh.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        oh.make_node("Relu", ["c"], ["r"], name="relu"),
        oh.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"),
        oh.make_node("Flatten", ["p"], ["f"], name="flatten"),
        oh.make_node("Gemm", ["f", "fc_w", "fc_b"], ["logits"], name="fc", transB=1),
        oh.make_node("Softmax", ["logits"], ["probs"], name="softmax"),
        oh.make_node("ArgMax", ["probs"], ["index"], name="argmax", axis=1),
        oh.make_node(
            "ArrayFeatureExtractor",
            ["labels", "index"],
            ["label"],
            name="lookup",
            domain="ai.onnx.ml",
        ),
        zipmap,
    ]
    zipmap.name = "zipmap"
    seq_map = oh.make_sequence_type_proto(
        oh.make_map_type_proto(key_type, oh.make_tensor_type_proto(TensorProto.FLOAT, []))
    )
    graph = oh.make_graph(
        nodes,
        "classifier",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [
            oh.make_tensor_value_info("label", label_type, ["batch", 1]),
            oh.make_value_info("scores", seq_map),
        ],
        inits,
    )
    model = oh.make_model(
        graph, opset_imports=[oh.make_opsetid("", 13), oh.make_opsetid("ai.onnx.ml", 1)]
    )
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def released(root: Path, model: onnx.ModelProto, name: str, inputs: str, samples: int) -> Path:
    """``model`` through quantize, compile (the HTP simulator) and publish from a project at
    ``root`` (random calibration, one target); the artifacts folder."""
    from pipeline.__main__ import main

    (root / "configs").mkdir(parents=True)
    onnx.save(model, str(root / "configs" / f"{name}.onnx"))
    config = root / "configs" / f"{name}.toml"
    config.write_text(
        f'[model]\nname = "{name}"\nversion = "1.0.0"\nsource = "{name}.onnx"\n{inputs}'
        f'[calibration]\nkind = "random"\nsamples = {samples}\n'
        '[compile]\ntargets = ["snapdragon-x-elite"]\nmin_snr_db = 20.0\n',
        encoding="utf-8",
    )
    artifacts = root / "artifacts"
    for stage in ("quantize", "compile", "publish"):
        assert main([stage, "--artifacts", str(artifacts), str(config)]) == 0, stage
    return artifacts


def run(model: onnx.ModelProto | str, x: np.ndarray) -> list:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    payload = model if isinstance(model, str) else model.SerializeToString()
    session = ort.InferenceSession(payload, options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


def test_the_tail_is_the_ml_ops_and_the_index_that_feeds_them() -> None:
    model = classifier()
    tail = model_tail(model)
    ops = sorted(model.graph.node[i].op_type for i in tail.nodes)
    assert ops == ["ArgMax", "ArrayFeatureExtractor", "ZipMap"]
    assert tail.outputs == ("label", "scores") and tail.inputs == ("probs",)


def test_a_model_without_ml_ops_has_no_tail() -> None:
    model = classifier()
    keep = [n for n in model.graph.node if n.domain != "ai.onnx.ml" and n.op_type != "ArgMax"]
    del model.graph.node[:]
    model.graph.node.extend(keep)
    del model.graph.output[:]
    model.graph.output.append(oh.make_tensor_value_info("probs", TensorProto.FLOAT, None))
    assert not model_tail(model)


@pytest.mark.parametrize("string_labels", [True, False], ids=["strings", "int64"])
def test_preparation_keeps_the_tail_typed_and_static(string_labels: bool) -> None:
    """Shape inference gives the label lookup no shape and a map no tensor shape: the prepared
    model keeps their types, gives the label its static shape, and computes the same."""
    source = classifier(string_labels)
    prepared, changes = prepare_model(
        source, InputsSection(dims={"batch": 1}, shapes={}, constants={})
    )
    label = next(o for o in prepared.graph.output if o.name == "label")
    assert [d.dim_value for d in label.type.tensor_type.shape.dim] == [1, 1]
    assert any(c.step == "static_tail_outputs" and c.changed for c in changes)
    x = RNG.standard_normal((1, 3, 8, 8)).astype(np.float32)
    want, got = run(source, x), run(prepared, x)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1][0].keys() == want[1][0].keys()
    for key in want[1][0]:
        assert got[1][0][key] == pytest.approx(want[1][0][key], rel=1e-5, abs=1e-6)


def linear_classifier() -> onnx.NodeProto:
    """A two-class ai.onnx.ml LinearClassifier on x [*, 2]: label and scores."""
    return oh.make_node(
        "LinearClassifier",
        ["x"],
        ["label", "scores"],
        domain="ai.onnx.ml",
        name="linear",
        classlabels_ints=[0, 1],
        coefficients=[0.5, -0.5, 1.0, 2.0],
        intercepts=[0.0, 0.1],
    )


def test_a_model_that_is_all_tail_is_refused_at_preparation() -> None:
    """A model of ai.onnx.ml ops only (a tree ensemble, a linear classifier) leaves nothing for
    the NPU: preparation says so, rather than compile finding an empty context."""
    node = linear_classifier()
    graph = oh.make_graph(
        [node],
        "linear",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2])],
        [
            oh.make_tensor_value_info("label", TensorProto.INT64, ["batch"]),
            oh.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", 2]),
        ],
    )
    model = oh.make_model(
        graph, opset_imports=[oh.make_opsetid("", 13), oh.make_opsetid("ai.onnx.ml", 1)]
    )
    model.ir_version = 8
    # An Identity in front, as onnxmltools writes: later steps drop it, it changes nothing.
    model.graph.node.insert(0, oh.make_node("Identity", ["x"], ["x_copy"], name="copy"))
    model.graph.node[1].input[0] = "x_copy"
    heard: list[str] = []
    with pytest.raises(
        ModelError, match=r"Nothing in this model can run on the NPU.*LinearClassifier"
    ):
        prepare_model(
            model, InputsSection(dims={"batch": 1}, shapes={}, constants={}), heard.append
        )
    # Said as soon as the ai.onnx.ml ops that become standard ops have, not after every step
    # (a LightGBM classifier's 30 MB of trees: 156 s -> 50 s), and the steps are not rerun.
    assert heard[-1] == "refuse_cpu_only" and heard.count("refuse_cpu_only") == 1, heard


def test_outputs_are_compared_by_kind() -> None:
    maps = [{"b": 0.25, "a": 0.75}]
    kind, values = comparable(maps)
    assert kind == MAP_VALUES and values.tolist() == [[0.75, 0.25]]  # key order: a, b
    assert comparable(np.array([["cat"]], dtype=object))[0] == LABELS
    assert comparable(np.array([[3]], dtype=np.int64))[0] == LABELS
    assert comparable(np.zeros(3, np.float32))[0] is None
    comparison = OutputComparison()
    comparison.add(
        {"label": np.array([["cat"]], dtype=object), "scores": maps},
        {"label": np.array([["dog"]], dtype=object), "scores": [{"a": 0.75, "b": 0.25}]},
    )
    comparison.add(
        {"label": np.array([["cat"]], dtype=object), "scores": maps},
        {"label": np.array([["cat"]], dtype=object), "scores": [{"a": 0.70, "b": 0.30}]},
    )
    summary = comparison.summary()
    assert summary["label"].compared_as == LABELS and summary["label"].agreement == 0.5
    assert summary["scores"].compared_as == MAP_VALUES and np.isfinite(summary["scores"].snr_db)
    assert worst_snr(summary) == summary["scores"].snr_db  # labels carry no SNR


def test_maps_kept_as_their_values_still_compare_as_maps(tmp_path: Path) -> None:
    """The HTP probe reads the judge's kept references (a ZipMap's maps as their values in key
    order) instead of running the CPU models again: they must still count as maps, not as a
    plain tensor the report would show without its note."""
    from pipeline.core.metrics import map_outputs, storable

    path = tmp_path / "classifier.onnx"
    onnx.save(classifier(), str(path))
    assert map_outputs(path) == {"scores"}
    maps = [{"b": 0.25, "a": 0.75}]
    comparison = OutputComparison.for_models(path)
    comparison.add({"scores": storable(maps)}, {"scores": storable([{"a": 0.7, "b": 0.3}])})
    kept = comparison.summary()["scores"]
    direct = OutputComparison()
    direct.add({"scores": maps}, {"scores": [{"a": 0.7, "b": 0.3}]})
    assert kept == direct.summary()["scores"] and kept.compared_as == MAP_VALUES
    assert OutputComparison().maps == frozenset()  # without the model: a plain tensor
    plain = OutputComparison()
    plain.add({"scores": storable(maps)}, {"scores": storable(maps)})
    assert plain.summary()["scores"].compared_as is None


def test_the_judge_keeps_a_classifiers_outputs_as_references(tmp_path: Path) -> None:
    """The float outputs the quantize stage kept are the HTP judge's references for its early
    stops: a ZipMap's scores (values in key order) and a string label are kept too, as arrays
    a file holds without pickle (before, such a model had none and ran every sample)."""
    from pipeline.quantize.evaluate import KeptRuns, kept_outputs

    path = tmp_path / "classifier.onnx"
    onnx.save(classifier(), str(path))
    samples = []
    floats = KeptRuns(path)
    for index in range(3):
        x = RNG.standard_normal((1, 3, 8, 8)).astype("f4")
        samples.append(tmp_path / f"sample_{index}.npz")
        np.savez(samples[-1], x=x)
        floats.run_named(floats.output_names(), {"x": x})
    references = kept_outputs(path, samples)
    assert references is not None and len(references) == 3
    for reference, sample in zip(references, samples, strict=True):
        assert set(reference) == {"label", "scores"}
        assert reference["scores"].dtype == np.float64 and reference["scores"].shape == (1, 3)
        assert reference["label"].dtype.kind == "U"
        label, scores = run(str(path), np.load(sample)["x"])
        np.testing.assert_allclose(
            reference["scores"][0], [scores[0][k] for k in sorted(LABEL_NAMES)]
        )
        np.savez(tmp_path / "stored.npz", **reference)
        with np.load(tmp_path / "stored.npz", allow_pickle=False) as stored:
            assert stored["label"].tolist() == np.asarray(label).astype(str).tolist()


def test_coverage_reports_the_tail_apart_from_the_gate() -> None:
    N = qnn.NodeInfo
    nodes = [
        N("ctx", "EPContext", "com.microsoft", ["x"], ["probs_q", "index"]),
        N("dq", "DequantizeLinear", "", ["probs_q", "s", "z"], ["probs"]),
        N("lookup", "ArrayFeatureExtractor", "ai.onnx.ml", ["labels", "index"], ["label"]),
        N("zipmap", "ZipMap", "ai.onnx.ml", ["probs"], ["scores"]),
    ]
    summary = qnn.ModelSummary(
        10,
        {},
        {},
        [qnn.ValueInfo("x", "float32", [1, 3, 8, 8])],
        [qnn.ValueInfo("label", "type8", [1, 1]), qnn.ValueInfo("scores", "", [])],
        nodes,
        {"labels", "s", "z"},
    )
    assert sorted(
        nodes[i].name for i in summary_tail(nodes, {"label": "type8", "scores": ""}).nodes
    ) == [
        "lookup",
        "zipmap",
    ]
    cpu = [("dq", "DequantizeLinear"), ("lookup", "ArrayFeatureExtractor"), ("zipmap", "ZipMap")]
    result = coverage.summarize(
        [("QNNExecutionProvider", [("ctx", "EPContext")]), ("CPUExecutionProvider", cpu)], summary
    )
    assert result.passed and result.cpu_compute_nodes == []
    assert sorted(n.name for n in result.cpu_tail_nodes or []) == ["dq", "lookup", "zipmap"]
    assert "declared CPU tail" in result.gate
    # Any other op on the CPU still fails the gate.
    extra = [*cpu, ("relu", "Relu")]
    nodes.append(N("relu", "Relu", "", ["probs"], ["other"]))
    failed = coverage.summarize(
        [("QNNExecutionProvider", [("ctx", "EPContext")]), ("CPUExecutionProvider", extra)], summary
    )
    # (the DequantizeLinear now also serves the Relu: no longer the tail's alone)
    assert not failed.passed and [n.name for n in failed.cpu_compute_nodes] == ["dq", "relu"]


@pytest.mark.qnn
def test_a_classifier_with_a_tail_builds_and_runs_from_its_release(tmp_path: Path) -> None:
    """quantize -> compile (HTP simulator) -> publish -> qnn_ctx_runtime.load -> run."""
    import qnn_ctx_runtime
    from pipeline.core.layout import ModelPaths
    from pipeline.core.records import VariantRecord, read_record

    root = tmp_path / "proj"
    artifacts = released(root, classifier(), "clf", "[inputs]\ndims = { batch = 1 }\n", 24)
    paths = ModelPaths.of(artifacts, "clf")
    variant_dir = next(p for p in (paths.ctx).glob("*/snapdragon-x-elite"))
    record, why = read_record(VariantRecord, variant_dir / "variant.json")
    assert record is not None and record.coverage is not None, why
    assert record.coverage.qnn_partitions == 1 and record.coverage.cpu_compute_nodes == []
    assert {n.op_type for n in record.coverage.cpu_tail_nodes or []} >= {"ZipMap"}
    assert {o.name: o.dtype for o in record.outputs} == {
        "label": "str",
        "scores": "seq(map(string,tensor(float)))",
    }
    assert (
        record.validation is not None
        and record.validation.ctx_vs_float["label"].compared_as == LABELS
    )
    # The HTP judged it (its non-tensor outputs stashed and compared like the CPU's), and the
    # compile stage adopted the judge's context and its run on the held-out samples.
    judged = json.loads(paths.report.with_suffix(".json").read_text("utf-8"))["htp"]
    assert judged["judge"] == "htp", judged["reason"]
    # The declared tail is not CPU compute to the judge either: the quantized model met the
    # target whole on the NPU, so it is the only round (no whole-model fp16 tried for nothing).
    assert [(r["label"], r["partitions"], r["cpu_nodes"]) for r in judged["rounds"]] == [
        ("as quantized", 1, 0)
    ], judged["rounds"]
    assert judged["chosen"] == "as quantized"
    # Every variant passed: the compile report's remarks are notes, not problems.
    compiled = (paths.ctx / "report.md").read_text("utf-8")
    assert "## Notes" in compiled and "## Problems" not in compiled
    assert "declared CPU tail" in compiled
    assert record.validation.measured_by.startswith("the quantize stage's HTP judge")
    assert record.validation.ctx_vs_float["scores"].compared_as == MAP_VALUES
    loaded = qnn_ctx_runtime.load(artifacts / "releases" / "clf" / "1.0.0")
    source = str(root / "configs" / "clf.onnx")  # the model built above (seeded weights)
    for _ in range(3):
        x = RNG.standard_normal((1, 3, 8, 8)).astype(np.float32)
        got = loaded.run({"x": x})
        want = dict(zip(["label", "scores"], run(source, x), strict=True))
        assert isinstance(got["scores"], list) and isinstance(got["scores"][0], dict)
        assert got["scores"][0].keys() == want["scores"][0].keys()
        for key, value in want["scores"][0].items():
            assert got["scores"][0][key] == pytest.approx(value, abs=0.02)
        assert got["label"].dtype == object and got["label"].shape == want["label"].shape


# -- label-only models: judged by the scores their labels are computed from -------------------


def segmenter(head: str = "argmax") -> onnx.ModelProto:
    """Conv -> Relu -> Conv (3 class scores per pixel), then only labels out: an ArgMax class
    map (``argmax``), that map cast to float (``float_map``), a per-pixel decision on the first
    class (``threshold``), or the first and the last (``both``)."""
    rng = np.random.default_rng(11)  # its own: the same weights whichever tests run first
    inits = [
        numpy_helper.from_array((rng.standard_normal((6, 3, 3, 3)) * 0.4).astype("f4"), "w1"),
        numpy_helper.from_array((rng.standard_normal((3, 6, 1, 1)) * 0.6).astype("f4"), "w2"),
        numpy_helper.from_array(np.array([0.5], "f4"), "cut"),
        numpy_helper.from_array(np.array([0], np.int64), "first"),
    ]
    nodes = [
        oh.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        oh.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        oh.make_node("Conv", ["r1", "w2"], ["logits"], name="conv2"),
        oh.make_node("ArgMax", ["logits"], ["classes"], name="argmax", axis=1, keepdims=0),
        oh.make_node("Gather", ["logits", "first"], ["first_logit"], name="pick", axis=1),
        oh.make_node("Greater", ["first_logit", "cut"], ["mask"], name="decide"),
        oh.make_node("Cast", ["classes"], ["class_map"], name="as_float", to=TensorProto.FLOAT),
    ]
    outputs = {
        "argmax": [oh.make_tensor_value_info("classes", TensorProto.INT64, [1, 16, 16])],
        "threshold": [oh.make_tensor_value_info("mask", TensorProto.BOOL, [1, 1, 16, 16])],
        "float_map": [oh.make_tensor_value_info("class_map", TensorProto.FLOAT, [1, 16, 16])],
    }
    chosen = outputs.get(head, outputs["argmax"] + outputs["threshold"])
    graph = oh.make_graph(
        nodes,
        "segmenter",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        chosen,
        inits,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 13)])
    model.ir_version = 8
    used = {i for n in model.graph.node for i in n.input}
    reached = {o.name for o in chosen}
    keep = []  # only the nodes the chosen outputs need
    for node in reversed(list(model.graph.node)):
        if set(node.output) & reached:
            keep.append(node)
            reached |= set(node.input)
    del model.graph.node[:]
    model.graph.node.extend(reversed(keep))
    kept_inits = [i for i in model.graph.initializer if i.name in reached and i.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept_inits)
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize(
    ("head", "scores"),
    [
        ("argmax", ["logits"]),
        ("threshold", ["first_logit"]),
        ("float_map", ["logits"]),
        ("both", ["logits", "first_logit"]),
    ],
)
def test_a_label_only_model_is_judged_by_its_scores(head: str, scores: list[str]) -> None:
    """Preparation adds the float tensors the labels are computed from as outputs (listed in
    the metadata, for the quantize stage to drop from the QDQ it ships): an ArgMax's scores,
    a comparison's operand (the Gather that picks it computes a float: it ends the walk)."""
    from pipeline.graph.tails import (
        JUDGED_OUTPUTS_KEY,
        drop_judged_outputs,
        expose_label_scores,
        judged_outputs,
    )

    model = segmenter(head)
    labels = [o.name for o in model.graph.output]
    prepared, _ = prepare_model(model, InputsSection())
    metadata = {p.key: p.value for p in prepared.metadata_props}
    assert judged_outputs(metadata) == scores
    assert [o.name for o in prepared.graph.output] == labels + scores
    assert all(edit_shape(prepared, s) for s in scores)  # typed and static, as outputs must be
    x = RNG.standard_normal((1, 3, 16, 16)).astype("f4")
    got = dict(zip([*labels, *scores], run(prepared, x), strict=True))
    if "logits" in got:
        np.testing.assert_array_equal(got["logits"].argmax(axis=1), run(model, x)[0])
    shipped = drop_judged_outputs(prepared, judged_outputs(metadata))
    assert [o.name for o in shipped.graph.output] == labels
    # Once is enough: a prepared model (its scores listed) is left as it is.
    again, change = expose_label_scores(prepared)
    assert again is prepared and not change.changed
    assert JUDGED_OUTPUTS_KEY in metadata


def edit_shape(model: onnx.ModelProto, name: str) -> tuple[int, ...] | None:
    from pipeline.graph.edit import value_shape

    return next(value_shape(o) for o in model.graph.output if o.name == name)


def test_models_with_a_figure_already_are_left_alone() -> None:
    """A classifier whose ZipMap carries the scores, a model with any float output, an int8
    output a QuantizeLinear writes (a value on a grid, compared as one) and labels read only
    from a shape get no extra output."""
    from pipeline.graph.tails import expose_label_scores

    with_float = segmenter("argmax")
    with_float.graph.output.append(
        oh.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 3, 16, 16])
    )
    quantized = segmenter("argmax")
    quantized.graph.node.append(
        oh.make_node("QuantizeLinear", ["logits", "qs", "qz"], ["logits_q"], name="q")
    )
    quantized.graph.initializer.extend(
        [
            numpy_helper.from_array(np.array(0.1, "f4"), "qs"),
            numpy_helper.from_array(np.array(0, np.int8), "qz"),
        ]
    )
    del quantized.graph.output[:]
    quantized.graph.output.append(
        oh.make_tensor_value_info("logits_q", TensorProto.INT8, [1, 3, 16, 16])
    )
    sized = oh.make_model(
        oh.make_graph(
            [oh.make_node("Relu", ["x"], ["r"]), oh.make_node("Shape", ["r"], ["shape"])],
            "sized",
            [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
            [oh.make_tensor_value_info("shape", TensorProto.INT64, [2])],
        ),
        opset_imports=[oh.make_opsetid("", 13)],
    )
    for model in (classifier(), with_float, quantized, sized):
        inferred = onnx.shape_inference.infer_shapes(model)
        same, change = expose_label_scores(inferred)
        assert same is inferred and not change.changed, model.graph.name
    # The segmenter itself, inferred the same way, does get its scores.
    _, change = expose_label_scores(onnx.shape_inference.infer_shapes(segmenter("argmax")))
    assert change.changed
    # A float label read by another output (a copy of the map) is walked through, not exposed.
    copied = segmenter("float_map")
    copied.graph.node.append(oh.make_node("Identity", ["class_map"], ["map_copy"]))
    copied.graph.output.append(
        oh.make_tensor_value_info("map_copy", TensorProto.FLOAT, [1, 16, 16])
    )
    exposed, _ = expose_label_scores(onnx.shape_inference.infer_shapes(copied))
    assert [o.name for o in exposed.graph.output] == ["class_map", "map_copy", "logits"]


def test_labels_beside_a_float_output_of_other_scores_are_judged_by_their_own() -> None:
    """A multitask model: an ArgMax class map beside a float depth head computed from the
    shared features, not from the class logits. The depth map carried every figure and the
    logits were judged by nothing; now they are output too. A float output computed from the
    logits themselves (their softmax) covers them: nothing is added."""
    from pipeline.graph.tails import expose_label_scores, judged_outputs

    rng = np.random.default_rng(5)
    depth_weights = numpy_helper.from_array(
        (rng.standard_normal((1, 6, 1, 1)) * 0.5).astype("f4"), "w_depth"
    )

    def with_head(op: str, reads: str) -> onnx.ModelProto:
        model = segmenter("argmax")
        model.graph.initializer.append(depth_weights)
        node = (
            oh.make_node("Conv", [reads, "w_depth"], ["head"], name="depth")
            if op == "Conv"
            else oh.make_node("Softmax", [reads], ["head"], name="probs", axis=1)
        )
        model.graph.node.append(node)
        channels = 1 if op == "Conv" else 3
        model.graph.output.append(
            oh.make_tensor_value_info("head", TensorProto.FLOAT, [1, channels, 16, 16])
        )
        return onnx.shape_inference.infer_shapes(model)

    exposed, change = expose_label_scores(with_head("Conv", "r1"))
    meta = {e.key: e.value for e in exposed.metadata_props}
    assert judged_outputs(meta) == ["logits"]
    assert [o.name for o in exposed.graph.output] == ["classes", "head", "logits"]
    assert list(change.details) == [
        "'logits' (what 'classes' is computed from) output too, to judge accuracy by; the "
        "shipped model does not output it"
    ]
    covered = with_head("Softmax", "logits")
    same, change = expose_label_scores(covered)
    assert same is covered and not change.changed


@pytest.mark.parametrize("head", ["argmax", "float_map"])
def test_a_label_only_model_is_gated_on_its_scores(tmp_path: Path, head: str) -> None:
    """Its labels alone read "inf dB" (a float class map: the SNR of class ids) and passed
    every gate; now the scores carry the figure, a gate it cannot meet fails the stage, and
    the QDQ written (on a model that passes) outputs the labels only, compared as labels."""
    from pipeline.__main__ import main
    from pipeline.core.layout import ModelPaths

    root = tmp_path / "proj"
    (root / "configs").mkdir(parents=True)
    model = segmenter(head)
    label = model.graph.output[0].name
    onnx.save(model, str(root / "configs" / "seg.onnx"))

    def build(min_snr_db: float) -> int:
        config = root / "configs" / "seg.toml"
        config.write_text(
            '[model]\nname = "seg"\nversion = "1.0.0"\nsource = "seg.onnx"\n'
            '[calibration]\nkind = "random"\nsamples = 16\n'
            f'[quantization]\njudge = "cpu"\nmin_snr_db = {min_snr_db}\n'
            f"target_snr_db = {min_snr_db}\nauto_mixed_precision = false\n",
            encoding="utf-8",
        )
        return main(["quantize", "--artifacts", str(root / "artifacts"), "--force", str(config)])

    paths = ModelPaths.of(root / "artifacts", "seg")
    assert build(20.0) == 0
    report = json.loads(paths.report.with_suffix(".json").read_text("utf-8"))
    assert 20.0 <= report["worst_snr_db"] < 200.0  # the scores' figure, not "inf"
    qdq = onnx.load(str(paths.bucket(report["buckets"][0]["name"]).qdq))
    assert [o.name for o in qdq.graph.output] == [label]
    accuracy = report["buckets"][0]["qdq_vs_float"][label]
    assert accuracy["compared_as"] == LABELS and accuracy["agreement"] > 0.9, accuracy
    assert build(200.0) != 0  # 16-bit scores are not 200 dB from float


@pytest.mark.qnn
def test_a_label_only_model_ships_its_labels_judged_on_the_htp(tmp_path: Path) -> None:
    """quantize (the HTP judge on the scores) -> compile -> publish -> run from the release:
    the judge's figure is the scores', and the context, its record and the release output the
    labels alone, as the user's model does."""
    import qnn_ctx_runtime
    from pipeline.compile.report import describe
    from pipeline.core.layout import ModelPaths
    from pipeline.core.records import VariantRecord, read_record

    root = tmp_path / "proj"
    artifacts = released(root, segmenter("argmax"), "seg", "", 16)
    source = root / "configs" / "seg.onnx"
    paths = ModelPaths.of(artifacts, "seg")
    judged = json.loads(paths.report.with_suffix(".json").read_text("utf-8"))["htp"]
    assert judged["judge"] == "htp", judged["reason"]
    assert 20.0 <= judged["ctx_vs_float_db"] < 200.0  # the scores', on the simulator
    variant_dir = next(p for p in paths.ctx.glob("*/snapdragon-x-elite"))
    record, why = read_record(VariantRecord, variant_dir / "variant.json")
    assert record is not None and record.validation is not None, why
    assert [o.name for o in record.outputs] == ["classes"]
    assert record.validation.ctx_vs_float["classes"].compared_as == LABELS
    assert "labels as the QDQ's" in describe(record) and "inf dB" not in describe(record)
    # The ctx gave the CPU QDQ model's labels on every pixel of the first 2 held-out samples:
    # the scores were judged on the HTP, so the other samples were not run (seeded: it does).
    validation = record.validation
    assert (validation.cut_by, validation.samples) == ("labels", 2), validation
    assert validation.requested > 2 and validation.passed
    assert "every output is a label" in (paths.ctx / "report.md").read_text("utf-8")
    loaded = qnn_ctx_runtime.load(artifacts / "releases" / "seg" / "1.0.0")
    x = RNG.standard_normal((1, 3, 16, 16)).astype(np.float32)
    got = loaded.run({"x": x})
    assert list(got) == ["classes"] and got["classes"].shape == (1, 16, 16)
    agree = np.mean(got["classes"] == run(str(source), x)[0])
    assert agree > 0.9, agree


def test_a_classifier_with_only_its_label_lookup_is_judged_by_its_probabilities() -> None:
    """A converter's classifier without its ZipMap: a string label from ArgMax and a lookup
    alone. The walk goes through the lookup (its class names are a constant) and the ArgMax
    to the Softmax's probabilities; the label lookup stays the declared tail."""
    model = classifier()
    zipmap = next(n for n in model.graph.node if n.op_type == "ZipMap")
    model.graph.node.remove(zipmap)
    model.graph.output.pop()
    prepared, _ = prepare_model(model, InputsSection(dims={"batch": 1}))
    assert [o.name for o in prepared.graph.output] == ["label", "probs"]
    assert model_tail(prepared).outputs == ("label",)
    label, probs = run(prepared, RNG.standard_normal((1, 3, 8, 8)).astype("f4"))
    assert np.asarray(label).astype(str).tolist() == [[LABEL_NAMES[int(np.argmax(probs))]]]


def test_labels_all_agree_only_when_every_output_is_a_label_given_exactly() -> None:
    from pipeline.compile.worker import labels_all_agree

    comparison = OutputComparison()
    comparison.add({"c": np.array([1, 2, 3])}, {"c": np.array([1, 2, 3])})
    assert labels_all_agree(comparison.summary())
    comparison.add({"c": np.array([1, 2, 3])}, {"c": np.array([1, 2, 0])})
    assert not labels_all_agree(comparison.summary())  # 5 of 6: the rest are run
    scored = OutputComparison()
    scored.add(
        {"c": np.array([1]), "p": np.array([0.5], "f4")},
        {"c": np.array([1]), "p": np.array([0.5], "f4")},
    )
    assert not labels_all_agree(scored.summary())  # a float output: its SNR decides
    assert not labels_all_agree({})


def test_float_outputs_that_hold_labels_are_found_by_what_computes_them(tmp_path: Path) -> None:
    """A Cast to float of an index or a truth value, through moves: a label. A Cast of a
    float, TopK's values and a float the labels are compared with are values."""
    from pipeline.core.metrics import label_outputs
    from pipeline.graph.tails import float_label_outputs

    nodes = [
        ("ArgMax", ["s"], ["i"]),
        ("Unsqueeze", ["i", "axes"], ["u"]),
        ("Cast", ["u"], ["class_map"]),  # an index, cast and moved
        ("TopK", ["s", "k"], ["top_values", "top_index"]),
        ("Cast", ["top_index"], ["top_float"]),  # TopK's indices
        ("Cast", ["top_values"], ["values_half"]),  # its values: values
        ("Greater", ["s", "c"], ["g"]),
        ("Cast", ["g"], ["decision"]),  # a truth value
        ("Cast", ["s"], ["s_half"]),  # a float cast: a value
        ("ArgMax", ["s"], ["plain"]),  # a label by its dtype already: no Cast, not listed
    ]
    outputs = ["class_map", "top_float", "values_half", "decision", "s_half", "plain", "s"]
    assert float_label_outputs(nodes, outputs) == {"class_map", "top_float", "decision"}
    path = tmp_path / "float_map.onnx"
    onnx.save(segmenter("float_map"), str(path))
    assert label_outputs(path) == {"class_map"}
    comparison = OutputComparison(labels=label_outputs(path))
    comparison.add({"class_map": np.array([1.0, 2.0])}, {"class_map": np.array([1.0, 0.0])})
    summary = comparison.summary()["class_map"]
    assert summary.compared_as == LABELS and summary.agreement == 0.5
    assert worst_snr(comparison.summary()) == float("inf")  # no SNR of class ids


@pytest.mark.qnn
def test_labels_judged_on_the_cpu_are_validated_on_every_sample(tmp_path: Path) -> None:
    """With the CPU as the judge nothing ran the scores on the HTP: compile validates the
    labels on every held-out sample, not stopping at the first two that agree."""
    from pipeline.core.layout import ModelPaths
    from pipeline.core.records import VariantRecord, read_record

    judge = '[quantization]\njudge = "cpu"\n'
    artifacts = released(tmp_path / "proj", segmenter("argmax"), "seg", judge, 16)
    variant_dir = next(ModelPaths.of(artifacts, "seg").ctx.glob("*/snapdragon-x-elite"))
    record, why = read_record(VariantRecord, variant_dir / "variant.json")
    assert record is not None and record.validation is not None, why
    validation = record.validation
    assert validation.cut_by != "labels" and validation.samples == validation.requested > 2


# --- outputs picked by rank (an end-to-end detector head) ---------------------------------------

ANCHORS, BEST = 64, 10


def end_to_end_head() -> onnx.ModelProto:
    """A YOLOv10-style head: per-anchor boxes and class scores, the best score per anchor
    ranked by TopK, the best rows' boxes gathered by its indices beside their scores."""
    rng = np.random.default_rng(11)
    inits = [
        numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w"),
        numpy_helper.from_array(np.array([4, 4], np.int64), "split"),
        numpy_helper.from_array(np.array([-1], np.int64), "last"),
        numpy_helper.from_array(np.array([BEST], np.int64), "k"),
        numpy_helper.from_array(np.array([1, 1, 4], np.int64), "reps"),
    ]
    nodes = [
        oh.make_node("MatMul", ["x", "w"], ["features"]),
        oh.make_node("Split", ["features", "split"], ["boxes", "logits"], axis=2),
        oh.make_node("Sigmoid", ["logits"], ["scores"]),
        oh.make_node("ReduceMax", ["scores", "last"], ["best"], keepdims=0),
        oh.make_node("TopK", ["best", "k"], ["values", "indices"], axis=1),
        oh.make_node("Unsqueeze", ["indices", "last"], ["indices3"]),
        oh.make_node("Tile", ["indices3", "reps"], ["rows"]),
        oh.make_node("GatherElements", ["boxes", "rows"], ["picked_boxes"], axis=1),
        oh.make_node("Unsqueeze", ["values", "last"], ["values3"]),
        oh.make_node("Concat", ["picked_boxes", "values3"], ["detections"], axis=2),
        oh.make_node("ReduceMean", ["scores", "last"], ["mean_score"], keepdims=0),
    ]
    graph = oh.make_graph(
        nodes,
        "end_to_end",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, ANCHORS, 8])],
        [
            oh.make_tensor_value_info("detections", TensorProto.FLOAT, [1, BEST, 5]),
            oh.make_tensor_value_info("mean_score", TensorProto.FLOAT, [1, ANCHORS]),
        ],
        inits,
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


def test_rows_picked_by_rank_are_found_and_what_they_pick_from_exposed() -> None:
    from pipeline.graph.tails import expose_selection_sources, judged_outputs, selection_outputs

    model = end_to_end_head()
    nodes = [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node]
    assert selection_outputs(nodes, ["detections", "mean_score"]) == {"detections"}
    exposed, change = expose_selection_sources(onnx.shape_inference.infer_shapes(model))
    added = [o.name for o in exposed.graph.output][2:]
    # The boxes of every anchor, the per-anchor best score TopK ranks, and the ranked values
    # (sorted, they move smoothly); nothing computed from the indices, but the indices
    # themselves: the detections' rows are their picks, compared pick by pick.
    assert set(added) == {"boxes", "best", "values3", "indices"}, added
    meta = {e.key: e.value for e in exposed.metadata_props}
    assert judged_outputs(meta) == added and len(change.details) == 4


def test_rows_of_the_same_picks_are_compared_and_gated_with_the_indices_beside_them(
    tmp_path: Path,
) -> None:
    """With the TopK indices output beside the detections (as preparation exposes them),
    each reference row is compared with the test's row of the same pick: near-equal scores
    trading places cost nothing, a row only one side picked is left out, and an error in the
    rows' own values is measured and gated (a DETR's decoder after its query selection read
    37.3 dB so, and 9.3 dB by rank). Without the indices: picked by rank, as before."""
    from pipeline.core.accuracy import MATCHED, PICKED
    from pipeline.core.metrics import picked_row_indices
    from pipeline.graph.tails import expose_selection_sources

    exposed, _ = expose_selection_sources(onnx.shape_inference.infer_shapes(end_to_end_head()))
    path = tmp_path / "head_judged.onnx"
    onnx.save(exposed, str(path))
    assert picked_row_indices(path) == {"detections": ("indices", 1)}
    rng = np.random.default_rng(13)
    rows = rng.standard_normal((1, BEST, 5)).astype(np.float32)
    picks = rng.permutation(ANCHORS)[:BEST].reshape(1, BEST).astype(np.int64)
    order = [1, 0, *range(2, BEST)]  # the first two trade places, their picks with them
    traded_rows, traded_picks = rows[:, order], picks[:, order]
    other = picks.copy()
    other[0, -1] = next(a for a in range(ANCHORS) if a not in picks)  # the last one differs
    scores = np.linspace(0.1, 0.9, ANCHORS, dtype=np.float32).reshape(1, ANCHORS)

    def compare(test_rows: np.ndarray, test_picks: np.ndarray | None) -> Accuracy:
        comparison = OutputComparison.for_models(path)
        reference = {"detections": rows, "mean_score": scores, "indices": picks}
        test = {"detections": test_rows, "mean_score": scores, "indices": test_picks}
        if test_picks is None:
            reference.pop("indices"), test.pop("indices")
        comparison.add(reference, test)
        return comparison.summary()["detections"]

    assert compare(traded_rows, traded_picks).snr_db == float("inf")
    unmatched_last = rows.copy()
    unmatched_last[0, -1] += 100.0
    assert compare(unmatched_last, other).snr_db == float("inf")
    noisy = compare(traded_rows * 1.01, traded_picks)
    assert noisy.compared_as == MATCHED and 39 < noisy.snr_db < 41
    assert worst_snr({"detections": noisy}) == noisy.snr_db  # gated
    by_rank = compare(traded_rows, None)
    assert by_rank.compared_as == PICKED and by_rank.snr_db < 20


def test_values_picked_at_an_argmax_are_picked_by_rank_and_a_label_lookup_is_not() -> None:
    """A pitch tracker: its estimate averages the bins around the peak bin an ArgMax finds
    (GatherElements at ArgMax + offsets), and its confidence is read at the peak: near-equal
    bins trade the peak (an HTP build read the estimate 18.9 dB from the CPU with the same
    logits 51.6 dB apart), so both are picked by rank and the logits judged instead. A
    classifier's label lookup of an ArgMax picks no values and stays a label."""
    from pipeline.graph.tails import selection_outputs, selection_sources

    model = onnx.parser.parse_model(
        """<ir_version: 10, opset_import: ["": 21]>
        g (float[1, 40] x) => (float[1] estimate, float[1] confidence) {
            logits = Relu(x)
            peak = ArgMax<axis = 1>(logits)
            window = Add(peak, offsets)
            picked = GatherElements<axis = 1>(logits, window)
            weights = Softmax<axis = 1>(picked)
            bins = Cast<to = 1>(window)
            weighted = Mul(weights, bins)
            estimate = ReduceSum<keepdims = 0>(weighted, axes)
            probs = Sigmoid(logits)
            best = Squeeze(peak)
            confidence = Gather<axis = 1>(probs, best)
        }"""
    )
    model.graph.initializer.extend(
        [
            numpy_helper.from_array(np.array([[-1, 0, 1]], np.int64), "offsets"),
            numpy_helper.from_array(np.array([1], np.int64), "axes"),
        ]
    )
    nodes = [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node]
    assert selection_outputs(nodes, ["estimate", "confidence"]) == {"estimate", "confidence"}
    assert set(selection_sources(onnx.shape_inference.infer_shapes(model))) == {
        "logits",
        "probs",
    }
    lookup = [
        ("ArgMax", ["scores"], ["index"]),
        ("ArrayFeatureExtractor", ["classes", "index"], ["label"]),
    ]
    assert selection_outputs(lookup, ["label"]) == set()


def test_an_output_picked_by_rank_is_shown_but_not_gated(tmp_path: Path) -> None:
    """Two near-equal best scores trading ranks move whole rows of the detections: their SNR
    is shown, the worst SNR (and so every gate) is the other outputs'."""
    path = tmp_path / "head.onnx"
    onnx.save(end_to_end_head(), str(path))
    comparison = OutputComparison.for_models(path)
    rows = np.random.default_rng(12).standard_normal((1, BEST, 5)).astype(np.float32)
    swapped = rows[:, [1, 0, *range(2, BEST)], :]
    scores = np.linspace(0.1, 0.9, ANCHORS, dtype=np.float32).reshape(1, ANCHORS)
    comparison.add(
        {"detections": rows, "mean_score": scores},
        {"detections": swapped, "mean_score": scores * 1.001},
    )
    summary = comparison.summary()
    assert summary["detections"].compared_as == "picked by rank"
    assert summary["detections"].snr_db < 20 < worst_snr(summary) == summary["mean_score"].snr_db
    assert "detections" not in comparison.powers()


@pytest.mark.qnn
def test_an_end_to_end_head_builds_judged_by_what_it_picks_from(tmp_path: Path) -> None:
    """Quantized, judged and compiled by the real stages: whole on the HTP, its gates on the
    boxes, scores and ranked values (>= 30 dB), the shipped model without them."""
    from compile_fixtures import build_whole_on_htp, model_paths

    build_whole_on_htp(tmp_path, "head", end_to_end_head())
    paths = model_paths(tmp_path, "head")
    shipped = onnx.load(str(paths.bucket("static").qdq))
    assert [o.name for o in shipped.graph.output] == ["detections", "mean_score"]
    report = json.loads((paths.root / "report.json").read_text())
    assert "expose_selection_sources" in json.dumps(report["prepare"])


def test_a_summary_of_outputs_all_picked_by_rank_does_not_read_inf_db() -> None:
    """Compile's one-line summary: with no output gated by SNR the worst is inf, which read as
    "ctx vs QDQ inf dB (vs float inf dB)" (a YOLOv10 at 7 dB on its picked rows); it says what
    they are and their figure instead."""
    from types import SimpleNamespace

    from pipeline.compile.report import _snr_line
    from pipeline.core.accuracy import Accuracy

    picked = {"detections": Accuracy(7.0, 1248.7, 0.9, compared_as="picked by rank")}
    validation = SimpleNamespace(
        ctx_vs_qdq=picked, worst_snr_db=float("inf"), worst_snr_vs_float_db=float("inf")
    )
    line = _snr_line(validation)
    assert "inf" not in line and "picked by rank, not gated" in line and "7.0 dB" in line
    gated = {**picked, "scores": Accuracy(41.0, 0.01, 1.0)}
    validation = SimpleNamespace(
        ctx_vs_qdq=gated, worst_snr_db=41.0, worst_snr_vs_float_db=30.0, requested=16, samples=16
    )
    assert _snr_line(validation).startswith("ctx vs QDQ 41.0 dB (vs float 30.0 dB)")
    # Stopped early (the judge's evidence, the simulator's budget): the line says on how many.
    validation.requested, validation.samples = 16, 4
    assert _snr_line(validation).startswith("ctx vs QDQ 41.0 dB on 4 of 16 samples (vs float")
    # ... and beside it the QDQ model's figure on every held-out sample (a classifier read
    # 79.6 dB on 2 of 6, 57.6 on all 6), but not for a model left in fp16 on the HTP, whose
    # CPU figure is float32 arithmetic.
    quantized = SimpleNamespace(worst_snr_db=27.5, heldout_samples=16, float16_on_htp="")
    line = _snr_line(validation, None, quantized)  # type: ignore[arg-type]
    assert "(vs float 30.0 dB; the QDQ model on all 16: 27.5 dB)" in line
    quantized.float16_on_htp = "whole"
    assert "all 16" not in _snr_line(validation, None, quantized)  # type: ignore[arg-type]
    quantized.float16_on_htp, validation.samples = "", 16  # every sample ran: its own figure
    assert "all 16" not in _snr_line(validation, None, quantized)  # type: ignore[arg-type]


def test_a_table_of_outputs_all_picked_by_rank_does_not_read_inf_db() -> None:
    """The compile report's tables likewise: an RT-DETR's every output picked by rank showed
    "SNR vs QDQ inf" beside a cosine of 0.797; the cell is "-" (no output has an SNR that
    counts), and a gated output's figure stays."""
    from pipeline.compile.report import _snr_cell
    from pipeline.core.accuracy import Accuracy

    picked = {"boxes": Accuracy(3.9, 2.2, 0.797, compared_as="picked by rank")}
    assert _snr_cell(picked, float("inf")) == "-"
    gated = {**picked, "scores": Accuracy(41.04, 0.01, 1.0)}
    assert _snr_cell(gated, 41.04) == "41.0"
    assert _snr_cell({"y": Accuracy(float("inf"), 0.0, 1.0)}, float("inf")) == "inf"


def test_a_gate_lowered_to_a_rounding_floor_is_said_in_the_compile_report() -> None:
    """The report's gate line is compile.min_snr_db; a pre-quantized model's variant is held to
    its own rounding floor instead (an int8 keyword spotter passing at 19.3 dB under a 20 dB
    line, with nothing saying why): its note gives the gate that was applied."""
    from types import SimpleNamespace

    from pipeline.compile.report import _notes
    from pipeline.core.accuracy import Accuracy

    lowered = (
        "worst ctx vs QDQ SNR >= 20.0 dB; lowered to the pre-quantized model's own rounding "
        "floor, less a margin: dense 7.5 dB"
    )
    figures = {"dense": Accuracy(19.3, 0.19, 0.99)}

    def row(gate: str) -> SimpleNamespace:
        validation = SimpleNamespace(
            gate=gate, ctx_vs_qdq=figures, ctx_vs_float=figures, measured_by="", passed=True,
            requested=16, samples=16, cut_by="", closed_loop={},
        )  # fmt: skip
        record = SimpleNamespace(
            error=None, coverage=None, validation=validation, load=None, shared_load_probe="",
            qnn_options={},
        )  # fmt: skip
        return SimpleNamespace(record=record, where="snapdragon-x-elite / onnxruntime-qnn 2.7.0")

    notes = "\n".join(_notes([row(lowered)]))
    assert "gate applied" in notes and "dense 7.5 dB" in notes
    assert "gate applied" not in "\n".join(_notes([row("worst ctx vs QDQ SNR >= 20.0 dB")]))
    # The console line says it too: "ok ... ctx vs QDQ 19.3 dB" read as a pass at 20 dB.
    from pipeline.compile.report import describe

    def line(gate: str, target: float | None = None) -> str:
        validation = row(gate).record.validation
        validation.worst_snr_db, validation.worst_snr_vs_float_db = 19.3, 19.3
        record = SimpleNamespace(
            model="kws", target="snapdragon-x-elite", toolchain="2.7.0", status="ok",
            coverage=SimpleNamespace(qnn_partitions=1, cpu_compute_nodes=[], problems=[]),
            validation=validation, load=None, sets=[], passed=True,
        )  # fmt: skip
        return describe(record, False, target)  # type: ignore[arg-type]

    assert line(lowered).endswith(
        "; passed on the pre-quantized model's own rounding floor (dense 7.5 dB)"
    )
    assert "rounding floor" not in line("worst ctx vs QDQ SNR >= 20.0 dB")
    # Under quantization's target vs float, the line says so (it passed the gate, not the aim).
    assert "(vs float 19.3 dB, under the target of 25.0 dB)" in line(lowered, 25.0)
    assert "under the target" not in line(lowered, 19.0) + line(lowered)
    assert " samples" not in line(lowered)  # all 16 ran


def test_an_atan2_output_is_an_angle_through_element_wise_ops_and_moves() -> None:
    """torch.onnx's atan2 (Div, Atan, +-pi by the signs) is an angle output, so is a Concat
    of it with a score map; an Atan followed by a Conv, or a model without one, is not."""
    from pipeline.graph.tails import angle_outputs

    atan2 = [
        ("Div", ["y", "x"], ["slope"]),
        ("Atan", ["slope"], ["atan"]),
        ("Add", ["atan", "pi"], ["plus"]),
        ("Sub", ["atan", "pi"], ["minus"]),
        ("Greater", ["y", "zero"], ["upper"]),
        ("Where", ["upper", "plus", "minus"], ["left"]),
        ("Less", ["x", "zero"], ["is_left"]),
        ("Where", ["is_left", "left", "atan"], ["angle"]),
        ("Sigmoid", ["s"], ["score"]),
        ("Unsqueeze", ["angle", "axes"], ["angle_1"]),
        ("Concat", ["angle_1", "score"], ["head"]),
        ("Conv", ["angle_1", "w"], ["mixed"]),
    ]
    outputs = ["angle", "head", "score", "mixed", "is_left"]
    assert angle_outputs(atan2, outputs) == {"angle", "head"}
    assert angle_outputs(atan2[:1] + atan2[8:9], ["slope", "score"]) == set()


def packed_model(quantized: bool = False) -> onnx.ModelProto:
    """boxes [1, 4, 3] and scores [1, 2, 3] packed on axis 1, transposed and flattened to
    [1, 18] as a detector's head writes them; ``quantized``: the Concat's inputs through a
    Q/DQ pair each, as a QDQ model has them."""
    nodes = []
    sources = []
    for name in ("boxes", "scores"):
        if quantized:
            nodes += [
                oh.make_node("QuantizeLinear", [name, "s", "z"], [f"{name}_q"]),
                oh.make_node("DequantizeLinear", [f"{name}_q", "s", "z"], [f"{name}_dq"]),
            ]
        sources.append(f"{name}_dq" if quantized else name)
    nodes += [
        oh.make_node("Concat", sources, ["packed"], axis=1),
        oh.make_node("Transpose", ["packed"], ["rows"], perm=[0, 2, 1]),
        oh.make_node("Reshape", ["rows", "flat"], ["y"]),
    ]
    graph = oh.make_graph(
        nodes,
        "packed",
        [
            oh.make_tensor_value_info("boxes", TensorProto.FLOAT, [1, 4, 3]),
            oh.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 2, 3]),
        ],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 18])],
        [
            numpy_helper.from_array(np.array([1, -1], np.int64), "flat"),
            numpy_helper.from_array(np.array(0.01, np.float32), "s"),
            numpy_helper.from_array(np.array(0, np.uint16), "z"),
        ],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize("quantized", [False, True])
def test_a_packed_outputs_parts_are_followed_through_its_moves(quantized: bool) -> None:
    """Each part's elements of the output, as onnxruntime moves them (its values marked by
    part), named by the tensor packed (a QDQ model's by its float model's name)."""
    from pipeline.graph.tails import packed_output_parts

    model = packed_model(quantized)
    names, labels = packed_output_parts(model)["y"]
    assert names == ["y / boxes", "y / scores"]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {
        "boxes": np.full((1, 4, 3), 1.0, np.float32),
        "scores": np.zeros((1, 2, 3), np.float32),
    }
    marked = session.run(None, feeds)[0].reshape(-1)
    assert labels.shape == (18,) and labels.dtype == np.int8  # a byte an element, any parts
    np.testing.assert_array_equal(labels, np.where(marked == 1.0, 0, 1))


def test_an_output_not_packed_by_moves_alone_has_no_parts() -> None:
    from pipeline.graph.tails import packed_output_parts

    model = packed_model()
    model.graph.node[-1].CopyFrom(oh.make_node("Relu", ["rows"], ["y2"]))
    model.graph.node.append(oh.make_node("Reshape", ["y2", "flat"], ["y"]))
    assert packed_output_parts(model) == {}


def test_parts_are_compared_apart_shown_and_not_gated() -> None:
    """The small part's own figure, far under the output's; worst_snr and the pooled powers
    leave it out (the output is gated as it was)."""
    from pipeline.core.accuracy import PART

    mask = np.zeros(18, bool)
    mask[[4, 5, 10, 11, 16, 17]] = True  # where a [1, 3, 6] row of 4 boxes + 2 scores puts them
    rng = np.random.default_rng(3)
    reference = np.where(mask, rng.uniform(0, 0.5, 18), rng.uniform(0, 640, 18))
    test = reference + np.where(mask, 0.05, 0.05)  # the same error everywhere
    labels = mask.astype(np.int8)  # 0: boxes, 1: scores
    comparison = OutputComparison(parts={"y": (["y / boxes", "y / scores"], labels)})
    comparison.add({"y": reference.reshape(1, 18)}, {"y": test.reshape(1, 18)})
    summary = comparison.summary()
    assert list(summary) == ["y", "y / boxes", "y / scores"]
    assert summary["y / scores"].compared_as == PART and summary["y"].compared_as is None
    assert summary["y / scores"].snr_db < summary["y"].snr_db - 30
    assert worst_snr(summary) == summary["y"].snr_db
    assert set(comparison.powers()) == {"y"}


def test_a_cpu_only_model_given_another_size_is_refused_for_what_it_is(tmp_path: Path) -> None:
    """An ai.onnx.ml-only model whose [inputs] shapes changes the size it fixes: the refusal
    says the NPU runs none of it, not that the size may be wrong (a logistic regression from
    onnxruntime's datasets, declared [3, 2], given [1, 4]: the tip said to give it its size)."""
    from pipeline.__main__ import main

    node = linear_classifier()
    graph = oh.make_graph(
        [node],
        "linear",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [3, 2])],
        [
            oh.make_tensor_value_info("label", TensorProto.INT64, [3]),
            oh.make_tensor_value_info("scores", TensorProto.FLOAT, [3, 2]),
        ],
    )
    model = oh.make_model(
        graph, opset_imports=[oh.make_opsetid("", 13), oh.make_opsetid("ai.onnx.ml", 1)]
    )
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "linear.onnx"))
    config = tmp_path / "linear.toml"
    config.write_text(
        '[model]\nname = "linear"\nversion = "1.0.0"\nsource = "linear.onnx"\n'
        '[inputs]\nshapes = { x = [1, 2] }\n[calibration]\nkind = "random"\nsamples = 4\n',
        encoding="utf-8",
    )
    assert main(["quantize", "--artifacts", str(tmp_path / "artifacts"), str(config)]) == 1
    report = (tmp_path / "artifacts" / "build" / "linear" / "report.md").read_text()
    assert "Nothing in this model can run on the NPU" in report
    assert "a size the model fixes" not in report and "exported for" not in report


def nearest_neighbour_classifier(k_input: str = "k") -> onnx.ModelProto:
    """A DGCNN-style block: each point's K nearest neighbours (TopK of negative squared
    distances), their features gathered and max-pooled over the K, then logits; beside them
    the gathered neighbour rows themselves, which keep the K axis."""
    points, k, channels, classes = 16, 4, 3, 5
    model = onnx.parser.parse_model(
        f"""<ir_version: 10, opset_import: ["": 21]>
        g (float[1, {points}, {channels}] x) => (float[1, {classes}] logits,
                                                 float[1, {points}, {k}, {channels}] neighbours) {{
            xt = Transpose<perm = [0, 2, 1]>(x)
            inner = MatMul(x, xt)
            squares = Mul(x, x)
            norms = ReduceSum<keepdims = 1>(squares, last)
            normst = Transpose<perm = [0, 2, 1]>(norms)
            twice = Add(inner, inner)
            near = Sub(twice, norms)
            score = Sub(near, normst)
            values, indices = TopK<axis = -1>(score, {k_input})
            flat = Reshape(indices, flat_shape)
            rows = Reshape(x, rows_shape)
            picked = Gather<axis = 0>(rows, flat)
            neighbours = Reshape(picked, out_shape)
            pooled = ReduceMax<keepdims = 0>(neighbours, pool_axes)
            features = Reshape(pooled, feature_shape)
            logits = MatMul(features, weights)
        }}"""
    )
    rng = np.random.default_rng(3)
    model.graph.initializer.extend(
        [
            numpy_helper.from_array(np.array([k], np.int64), "k"),
            numpy_helper.from_array(np.array([-1], np.int64), "last"),
            numpy_helper.from_array(np.array([-1], np.int64), "flat_shape"),
            numpy_helper.from_array(np.array([points, channels], np.int64), "rows_shape"),
            numpy_helper.from_array(np.array([1, points, k, channels], np.int64), "out_shape"),
            numpy_helper.from_array(np.array([2], np.int64), "pool_axes"),
            numpy_helper.from_array(np.array([1, points * channels], np.int64), "feature_shape"),
            numpy_helper.from_array(
                rng.standard_normal((points * channels, classes)).astype(np.float32), "weights"
            ),
        ]
    )
    if k_input != "k":  # K computed at run time: a Shape's length, no constant to read
        model.graph.node.insert(0, oh.make_node("Shape", ["x"], [k_input], start=2, end=3))
    onnx.checker.check_model(model)
    return model


def test_an_output_that_pools_its_picks_away_is_gated_and_the_picked_rows_are_not(
    tmp_path: Path,
) -> None:
    """Logits max-pooled over each point's K nearest neighbours have no K axis left: they do
    not depend on the neighbours' order, only on which were picked, and their SNR measures the
    arithmetic (a DGCNN: 10.4 dB on the HTP, ungated, while the scores its TopKs rank read
    34.6 dB). The gathered rows keep the K axis and stay picked by rank, read from the model
    and from its file's summary alike; with K computed at run time, both stay picked."""
    from pipeline.core.metrics import picked_outputs
    from pipeline.graph.tails import selection_outputs, small_int_values, static_shapes

    model = nearest_neighbour_classifier()
    nodes = [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node]
    names = ["logits", "neighbours"]
    assert selection_outputs(nodes, names) == {"logits", "neighbours"}  # no shapes: as before
    graph = model.graph
    found = selection_outputs(nodes, names, static_shapes(graph), small_int_values(graph))
    assert found == {"neighbours"}
    path = tmp_path / "knn.onnx"
    onnx.save(model, str(path))
    assert picked_outputs(path) == {"neighbours"}

    runtime_k = nearest_neighbour_classifier("k_of_shape")
    path = tmp_path / "knn_runtime_k.onnx"
    onnx.save(runtime_k, str(path))
    assert picked_outputs(path) == {"logits", "neighbours"}
    comparison = OutputComparison.for_models(tmp_path / "knn.onnx")
    logits = np.linspace(-1, 1, 5, dtype=np.float32).reshape(1, 5)
    rows = np.ones((1, 16, 4, 3), np.float32)
    comparison.add({"logits": logits, "neighbours": rows}, {"logits": -logits, "neighbours": rows})
    summary = comparison.summary()
    assert summary["logits"].compared_as is None and worst_snr(summary) < 0


def test_a_layer_computing_on_values_picked_at_an_argmin_is_gated() -> None:
    """A VQ-VAE: each position's nearest codebook vector (ArgMin of distances, Gather) is
    decoded by a Conv: that output is the decoder's arithmetic on its picks, gated (it was
    left out of every figure, which read inf); the picked vectors themselves stay picked."""
    from pipeline.graph.tails import selection_outputs

    model = onnx.parser.parse_model(
        """<ir_version: 10, opset_import: ["": 21]>
        g (float[16, 4] latents) => (float[1, 3, 4, 4] image, float[16, 4] vectors) {
            booked = Transpose<perm = [1, 0]>(book)
            inner = MatMul(latents, booked)
            distance = Sub(norms, inner)
            code = ArgMin<axis = 1, keepdims = 0>(distance)
            vectors = Gather<axis = 0>(book, code)
            grid = Reshape(vectors, grid_shape)
            planes = Transpose<perm = [0, 3, 1, 2]>(grid)
            image = Conv<pads = [1, 1, 1, 1]>(planes, kernel)
        }"""
    )
    nodes = [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node]
    assert selection_outputs(nodes, ["image", "vectors"]) == {"vectors"}


def detr_with_post_processing() -> onnx.ModelProto:
    """An RT-DETR-style graph: the encoder's best anchors picked as queries (TopK 1), a
    "decoder" on them, then its post-processing: the class scores of every query and class
    ranked (TopK 2, through a Flatten) and the boxes of the queries picked gathered."""
    anchors, queries, width, classes = 12, 5, 6, 3
    model = onnx.parser.parse_model(
        f"""<ir_version: 10, opset_import: ["": 21]>
        g (float[{anchors}, {width}] features) => (float[1, {queries}, 4] boxes,
                                                  float[1, {queries}] scores) {{
            encoded = MatMul(features, w_score)
            anchor_scores = Reshape(encoded, row)
            best, picks = TopK<axis = -1>(anchor_scores, k)
            flat_picks = Reshape(picks, flat)
            picked = Gather<axis = 0>(features, flat_picks)
            query_features = Unsqueeze(picked, zero)
            logits = MatMul(query_features, w_class)
            query_boxes = MatMul(query_features, w_box)
            probs = Sigmoid(logits)
            flat_probs = Flatten<axis = 1>(probs)
            scores, ranked = TopK<axis = -1>(flat_probs, k)
            query = Div(ranked, class_count)
            query3 = Unsqueeze(query, last)
            query_rows = Tile(query3, reps)
            boxes = GatherElements<axis = 1>(query_boxes, query_rows)
        }}"""
    )
    rng = np.random.default_rng(21)
    model.graph.initializer.extend(
        [
            numpy_helper.from_array(rng.standard_normal((width, 1)).astype("f4"), "w_score"),
            numpy_helper.from_array(rng.standard_normal((width, classes)).astype("f4"), "w_class"),
            numpy_helper.from_array(rng.standard_normal((width, 4)).astype("f4"), "w_box"),
            numpy_helper.from_array(np.array([1, anchors], np.int64), "row"),
            numpy_helper.from_array(np.array([queries], np.int64), "k"),
            numpy_helper.from_array(np.array([-1], np.int64), "flat"),
            numpy_helper.from_array(np.array([0], np.int64), "zero"),
            numpy_helper.from_array(np.array(classes, np.int64), "class_count"),
            numpy_helper.from_array(np.array([-1], np.int64), "last"),
            numpy_helper.from_array(np.array([1, 1, 4], np.int64), "reps"),
        ]
    )
    onnx.checker.check_model(model, full_check=True)
    return onnx.shape_inference.infer_shapes(model)


def test_a_decoder_before_its_post_processing_picks_is_compared_pick_by_pick() -> None:
    """The outputs keep no one TopK's order (the boxes are gathered at the second TopK's
    queries, and both TopKs pick K): picked by rank. What the second pick reads, the
    decoder's class probabilities and boxes for every query, are rows of the first TopK's
    picks: output for the judge with those indices, compared pick by pick (an RT-DETR export
    with post-processing had its decoder judged by nothing)."""
    from pipeline.graph.tails import expose_selection_sources, rows_before_later_picks

    model = detr_with_post_processing()
    assert rows_before_later_picks(model) == {
        "probs": ("picks", 1),
        "query_boxes": ("picks", 1),
    }
    exposed, change = expose_selection_sources(model)
    added = [o.name for o in exposed.graph.output][2:]
    assert {"probs", "query_boxes", "picks"} <= set(added), added
    x = RNG.standard_normal((12, 6)).astype("f4")
    session = ort.InferenceSession(exposed.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in exposed.graph.output]
    got = dict(zip(names, session.run(None, {"features": x}), strict=True))
    assert got["probs"].shape == (1, 5, 3) and got["picks"].shape == (1, 5)
    assert any("a later pick reads" in d for d in change.details)
    from pipeline.graph.tails import picked_rows, small_int_values, static_shapes

    triples = [(n.op_type, list(n.input), list(n.output)) for n in exposed.graph.node]
    rows = picked_rows(
        triples,
        names,
        {**static_shapes(exposed.graph), "picks": [1, 5]},
        small_int_values(exposed.graph),
    )
    assert rows == {"probs": ("picks", 1), "query_boxes": ("picks", 1)}  # not the boxes
