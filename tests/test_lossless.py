"""Lossless preparation: the prepared float model is compared with the source, and a step that
changed the function is found by running the preparation one step at a time."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import pytest
from onnx import TensorProto, numpy_helper

from pipeline.core.config import InputsSection
from pipeline.core.errors import GateError
from pipeline.graph import prepare as prepare_mod
from pipeline.graph.edit import Change
from pipeline.graph.prepare import prepare_model
from pipeline.quantize import lossless
from pipeline.quantize.lossless import StepFigure, check_preparation, culprit

RNG = np.random.default_rng(3)
NO_INPUTS = InputsSection(dims={}, shapes={}, constants={})


def tiny(dtype: int = TensorProto.FLOAT, upsample: bool = False) -> onnx.ModelProto:
    """Conv -> Relu (-> opset-9 bilinear Upsample) on 1x2x6x6."""
    np_type = np.float16 if dtype == TensorProto.FLOAT16 else np.float32
    w = numpy_helper.from_array(RNG.standard_normal((2, 2, 3, 3)).astype(np_type), "w")
    nodes = [
        oh.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        oh.make_node("Relu", ["c"], ["r" if upsample else "y"]),
    ]
    inits = [w]
    out_shape = [1, 2, 6, 6]
    if upsample:
        inits.append(numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "s"))
        nodes.append(oh.make_node("Upsample", ["r", "s"], ["y"], mode="linear"))
        out_shape = [1, 2, 12, 12]
    graph = oh.make_graph(
        nodes,
        "tiny",
        [oh.make_tensor_value_info("x", dtype, [1, 2, 6, 6])],
        [oh.make_tensor_value_info("y", dtype, out_shape)],
        inits,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 9 if upsample else 13)])
    model.ir_version = 7
    return model


def heldout(folder: Path, count: int = 4) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        np.savez(folder / f"sample_{i:05d}.npz", x=RNG.standard_normal((1, 2, 6, 6)).astype("f4"))
    return folder


def prepared_file(model: onnx.ModelProto, folder: Path) -> Path:
    ready, _ = prepare_model(model, NO_INPUTS)
    path = folder / "float.onnx"
    onnx.save(ready, str(path))
    return path


def test_a_lossless_preparation_passes(tmp_path: Path) -> None:
    source = tiny(upsample=True)
    check = check_preparation(
        "m", source, NO_INPUTS, prepared_file(source, tmp_path), heldout(tmp_path / "h")
    )
    assert check.passed and check.samples == 4
    assert check.snr_db is not None and check.snr_db >= lossless.MIN_PREPARED_SNR_DB
    assert check.steps == []  # per-step figures only when it fails


def test_a_step_that_changes_the_function_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the pinning of legacy Upsample semantics the opset upgrade changes bilinear
    upsampling (half_pixel instead of asymmetric): the check fails and names that step."""
    from pipeline.graph import legacy

    source = tiny(upsample=True)

    def no_pin(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
        return model, Change("pin_legacy_semantics")

    monkeypatch.setattr(legacy, "pin_legacy_semantics", no_pin)
    path = prepared_file(source, tmp_path)
    check = check_preparation("m", source, NO_INPUTS, path, heldout(tmp_path / "h"))
    assert not check.passed
    assert check.snr_db is not None and check.snr_db < lossless.MIN_PREPARED_SNR_DB
    assert check.culprit == "upgrade_opset"
    figures = {s.step: s.snr_db for s in check.steps}
    assert figures["upgrade_opset"] < 60 and figures["set_ir_version"] == float("inf")
    assert "upgrade_opset" in check.message("m")


def test_a_model_that_moves_as_far_with_its_float_arithmetic_reordered_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The floor drops to the source's figure against itself, run by onnxruntime with its
    graph optimizations and without, less 3 dB: an ill-conditioned model (a fingerprint
    network: 53.2 dB from itself so) cannot be held nearer than that by any preparation. A
    well-conditioned one is its own exact copy so, and the plain floor stands."""
    from pipeline.graph import legacy

    source = tiny(upsample=True)
    samples = lossless._limited(heldout(tmp_path / "h"), 4)
    own = lossless.float_floor(source, samples, NO_INPUTS)
    assert own is not None and own > 100  # the plain floor stands: the step above is named
    monkeypatch.setattr(
        legacy, "pin_legacy_semantics", lambda m: (m, Change("pin_legacy_semantics"))
    )
    path = prepared_file(source, tmp_path)
    failed = check_preparation("m", source, NO_INPUTS, path, tmp_path / "h")
    assert not failed.passed and failed.snr_db is not None and failed.float_floor_db == own
    for floor, passes in ((failed.snr_db + 2.0, True), (failed.snr_db + 4.0, False)):
        monkeypatch.setattr(lossless, "float_floor", lambda *args, f=floor: f)
        check = check_preparation("m", source, NO_INPUTS, path, tmp_path / "h")
        assert check.passed is passes and check.float_floor_db == floor
        assert check.min_snr_db == pytest.approx(floor - lossless.OWN_ROUNDING_MARGIN_DB)
        assert (check.culprit == "") is passes


def test_a_step_that_changes_the_function_fails_the_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the quantize stage: a GateError naming the step, the figures in the report."""
    from pipeline.__main__ import main
    from pipeline.example_models import ensure_example

    root = tmp_path / "proj"
    ensure_example(root)
    (root / "configs").mkdir()
    repo = Path(__file__).resolve().parent.parent
    shutil.copy(repo / "configs" / "example.toml", root / "configs" / "example.toml")
    original = prepare_mod.preparation_steps

    def lossy(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
        model = onnx.ModelProto.FromString(model.SerializeToString())
        out = model.graph.output[0].name
        for node in model.graph.node:
            node.output[:] = [f"{o}_pre" if o == out else o for o in node.output]
        model.graph.initializer.append(numpy_helper.from_array(np.array(1.01, np.float32), "k"))
        model.graph.node.append(oh.make_node("Mul", [f"{out}_pre", "k"], [out]))
        return model, Change("lossy_step", ("output x 1.01",))

    monkeypatch.setattr(
        prepare_mod, "preparation_steps", lambda inputs, *more: [*original(inputs, *more), lossy]
    )
    args = ["quantize", "--artifacts", str(tmp_path / "a"), str(root / "configs" / "example.toml")]
    with pytest.raises(GateError) as info:
        from pipeline.core.config import load_config
        from pipeline.quantize.build import quantize_model

        quantize_model(load_config(root / "configs" / "example.toml"), tmp_path / "a")
    assert "lossy_step" in info.value.message
    report = (tmp_path / "a" / "build" / "example_cnn" / "report.md").read_text()
    assert "lossy_step" in report and "FAILED" in report
    assert main(args) != 0


def test_float16_source_is_compared_in_float32(tmp_path: Path) -> None:
    source = tiny(TensorProto.FLOAT16)
    check = check_preparation(
        "m", source, NO_INPUTS, prepared_file(source, tmp_path), heldout(tmp_path / "h")
    )
    assert check.passed and "float32" in check.reference
    assert check.float16_snr_db is not None and check.float16_snr_db < check.snr_db


def test_a_float16_source_runs_the_prepared_model_once_for_both_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both references (float32 and float16) are compared with one run of the prepared model
    per sample: it is the largest of the three, a 1024x1024 segmenter's took 4 s a run."""
    source = tiny(TensorProto.FLOAT16)
    prepared = prepared_file(source, tmp_path)
    runs: list[str] = []
    real = lossless.cpu_session

    class Counted:
        def __init__(self, session: object) -> None:
            self.session = session

        def __getattr__(self, name: str) -> object:
            return getattr(self.session, name)

        def run(self, *args: object) -> object:
            runs.append("prepared")
            return self.session.run(*args)  # type: ignore[attr-defined]

    def counting(model: object, optimize: bool = True) -> object:
        session = real(model, optimize)
        return Counted(session) if model == prepared else session

    monkeypatch.setattr(lossless, "cpu_session", counting)
    check = check_preparation("m", source, NO_INPUTS, prepared, heldout(tmp_path / "h", 3))
    assert check.passed and check.samples == 3 and check.float16_snr_db is not None
    assert runs == ["prepared"] * 3


def test_a_float16_model_with_float32_io_is_compared_in_float32(tmp_path: Path) -> None:
    """onnxconverter-common's ``keep_io_types`` form: float32 inputs cast to float16, the
    weights in Constant nodes, the result cast back. Taken for a float32 model (no float16
    initializer, input or output), its float32 preparation was compared with its float16 run:
    a PP-OCR classifier so converted failed at 49.3 dB (onnxruntime runs some of its float16
    ops in float16; this small one it runs through float32 casts, so only the reference
    tells)."""
    from pipeline.graph.source import SourceModel, computes_in_float16

    width = 16
    nodes = [oh.make_node("Cast", ["x"], ["h0"], to=TensorProto.FLOAT16)]
    for k in range(12):
        weight = numpy_helper.from_array(
            (RNG.standard_normal((width, 2 if k == 0 else width, 3, 3)) / 3).astype(np.float16)
        )
        nodes.append(oh.make_node("Constant", [], [f"w{k}"], value=weight))
        nodes.append(oh.make_node("Conv", [f"h{k}", f"w{k}"], [f"c{k}"], pads=[1, 1, 1, 1]))
        nodes.append(oh.make_node("Tanh", [f"c{k}"], [f"h{k + 1}"]))
    nodes.append(oh.make_node("Cast", ["h12"], ["y"], to=TensorProto.FLOAT))
    graph = oh.make_graph(
        nodes,
        "keep_io_types",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 6, 6])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, width, 6, 6])],
    )
    source = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 13)])
    source.ir_version = 7
    path = prepared_file(source, tmp_path)
    samples = heldout(tmp_path / "h")
    assert computes_in_float16(source.graph) and SourceModel.of(source).float16
    assert not computes_in_float16(tiny().graph)
    check = check_preparation("m", source, NO_INPUTS, path, samples)
    assert check.passed and "float32" in check.reference, check
    assert check.float16_snr_db is not None


def test_culprit_names_the_unrunnable_steps_before_the_drop() -> None:
    steps = [StepFigure("a", float("inf")), StepFigure("b", None), StepFigure("c", 12.0)]
    assert culprit(steps) == "b or c"
    assert culprit([StepFigure("a", 80.0), StepFigure("d", 30.0)]) == "d"
    assert culprit([StepFigure("a", 80.0)]) == ""


def test_a_pre_quantized_source_passes_within_its_own_rounding_floor(tmp_path: Path) -> None:
    """Conv -> Q -> DQ -> Relu: a prepared model whose float32 rounding differs (weights 1 ulp
    off, as a fused rewrite does) flips some quantized values. Against 60 dB it fails; within
    3 dB of the model's own rounding floor it passes, and says which floor it used."""
    rng = np.random.default_rng(11)
    w = rng.standard_normal((2, 2, 3, 3)).astype(np.float32)
    inits = [
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(np.array(0.05, np.float32), "s"),
        numpy_helper.from_array(np.array(128, np.uint8), "z"),
    ]
    nodes = [
        oh.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        oh.make_node("QuantizeLinear", ["c", "s", "z"], ["q"]),
        oh.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]),
        oh.make_node("Relu", ["d"], ["y"]),
    ]
    graph = oh.make_graph(
        nodes, "qdq", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 6, 6])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 6, 6])], inits,
    )  # fmt: skip
    source = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    nudged = onnx.ModelProto()
    nudged.CopyFrom(source)
    nudged.graph.initializer[0].CopyFrom(
        numpy_helper.from_array(np.nextafter(w, np.float32(np.inf)) * np.float32(1.002), "w")
    )
    path = tmp_path / "float.onnx"
    onnx.save(nudged, str(path))
    samples = heldout(tmp_path / "h", 8)
    strict = check_preparation("m", source, NO_INPUTS, path, samples)
    assert not strict.passed and strict.snr_db is not None and strict.snr_db < 60
    floor = strict.snr_db + 2.0
    lenient = check_preparation("m", source, NO_INPUTS, path, samples, rounding_floor_db=floor)
    assert lenient.passed and lenient.min_snr_db == pytest.approx(floor - 3.0)
    assert lenient.rounding_floor_db == floor
    tight = check_preparation("m", source, NO_INPUTS, path, samples, strict.snr_db + 4.0)
    assert not tight.passed


def test_a_constant_input_filled_from_one_number_feeds_the_source(tmp_path: Path) -> None:
    """``constants = { mask = 0.5 }`` for a [batch, 2, 6, 6] mask: the source model is run with
    the mask filled to the shape [inputs] gives it, as the prepared model has it baked in."""
    graph = oh.make_graph(
        [oh.make_node("Add", ["x", "mask"], ["s"]), oh.make_node("Relu", ["s"], ["y"])],
        "masked",
        [
            oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 6, 6]),
            oh.make_tensor_value_info("mask", TensorProto.FLOAT, ["batch", 2, 6, 6]),
        ],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 6, 6])],
    )
    source = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 13)])
    source.ir_version = 8
    inputs = InputsSection(dims={}, shapes={"mask": [1, 2, 6, 6]}, constants={"mask": 0.5})
    ready, _ = prepare_model(source, inputs)
    assert [i.name for i in ready.graph.input] == ["x"]
    path = tmp_path / "float.onnx"
    onnx.save(ready, str(path))
    check = check_preparation("m", source, inputs, path, heldout(tmp_path / "h"))
    assert not check.error and check.samples == 4
    assert check.passed and check.snr_db is not None and check.snr_db >= 60


def test_a_step_more_exact_than_onnxruntimes_sigmoid_is_not_blamed_for_its_error(
    tmp_path: Path,
) -> None:
    """A detector's geometric-mean score, sqrt(sigmoid(a) * sigmoid(b)), over background logits:
    onnxruntime's CPU Sigmoid is off by up to 1.5e-7 absolutely (0 below x = -17), which the
    square root of tiny products magnifies, and preparation computes the score exactly in log
    space (``rewrite_sqrt_of_sigmoids``). Against the source as onnxruntime computes it the
    prepared model reads far below 60 dB; with every Sigmoid computed from exp in both, it is
    the same function, and the report says how the reference was computed."""
    nodes = [
        oh.make_node("Sigmoid", ["a"], ["pa"]),
        oh.make_node("Sigmoid", ["b"], ["pb"]),
        oh.make_node("Mul", ["pa", "pb"], ["p"]),
        oh.make_node("Sqrt", ["p"], ["y"]),
    ]
    shape = [1, 256]
    graph = oh.make_graph(
        nodes,
        "score",
        [oh.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in "ab"],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
    )
    source = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 13)])
    source.ir_version = 7
    path = prepared_file(source, tmp_path)
    assert "Sigmoid" not in {n.op_type for n in onnx.load(str(path)).graph.node}
    folder = tmp_path / "h"
    folder.mkdir()
    for i in range(4):  # background: one class's logit far below zero, the other's below
        a = RNG.uniform(-24, -10, shape).astype("f4")
        np.savez(folder / f"sample_{i:05d}.npz", a=a, b=RNG.uniform(-8, -2, shape).astype("f4"))
    plain, _ = lossless.compare(source, path, lossless._limited(folder, 4), NO_INPUTS)
    assert plain < lossless.MIN_PREPARED_SNR_DB  # onnxruntime's Sigmoid, not the step
    check = check_preparation("m", source, NO_INPUTS, path, folder)
    assert check.passed and check.snr_db is not None and check.snr_db > 100, check
    assert lossless.SIGMOIDS_FROM_EXP in check.reference


def test_with_sigmoids_from_exp_a_step_that_changes_the_function_is_still_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second comparison is a second opinion on rounding, not a pass: the legacy Upsample
    upgraded without its pinned semantics (as in the test above), after a Sigmoid, still fails
    and the steps are measured with the Sigmoids expanded on both sides."""
    from pipeline.graph import legacy

    source = tiny(upsample=True)
    relu = next(n for n in source.graph.node if n.op_type == "Relu")
    relu.op_type = "Sigmoid"

    def no_pin(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
        return model, Change("pin_legacy_semantics")

    monkeypatch.setattr(legacy, "pin_legacy_semantics", no_pin)
    path = prepared_file(source, tmp_path)
    check = check_preparation("m", source, NO_INPUTS, path, heldout(tmp_path / "h"))
    assert not check.passed and check.culprit == "upgrade_opset", check
    assert lossless.SIGMOIDS_FROM_EXP in check.reference


def test_an_input_no_node_reads_is_dropped_and_fed_zeros_in_the_source(tmp_path: Path) -> None:
    """onnxruntime requires a feed for a graph input that no node reads (an argument the module
    ignores; a BatchNorm scale onnxruntime folded and left listed as an input). Preparation
    drops it (so no sample holds it, and calibration no longer asks which input the images
    feed); the checks that run the source feed it zeros."""
    from pipeline.graph.transforms import drop_unread_inputs

    source = tiny()
    source.graph.input.append(oh.make_tensor_value_info("unused", TensorProto.FLOAT, [3]))
    dropped, change = drop_unread_inputs(source)
    assert [i.name for i in dropped.graph.input] == ["x"] and "'unused'" in change.details[0]
    path = prepared_file(source, tmp_path)
    assert [i.name for i in onnx.load(str(path)).graph.input] == ["x"]
    check = check_preparation("m", source, NO_INPUTS, path, heldout(tmp_path / "h"))
    assert check.passed and check.samples == 4 and not check.error, check
    lonely = tiny()
    lonely.graph.input[0].name = "never_read"  # its only input: a model of constants, kept
    assert not drop_unread_inputs(lonely)[1].changed


def test_a_label_only_model_is_checked_on_its_scores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A segmenter that outputs its ArgMax class map alone: the legacy Upsample upgraded
    without its semantics moves the scores, yet the labels mostly agree and have no SNR. The
    check compares the scores the labels come from (which preparation outputs for judging) and
    still names the step; with the semantics kept it passes."""
    from pipeline.graph import legacy

    source = tiny(upsample=True)
    source.graph.node.append(oh.make_node("ArgMax", ["y"], ["labels"], axis=1, keepdims=0))
    del source.graph.output[:]
    source.graph.output.append(oh.make_tensor_value_info("labels", TensorProto.INT64, [1, 12, 12]))
    folder = heldout(tmp_path / "h")
    good = check_preparation("m", source, NO_INPUTS, prepared_file(source, tmp_path), folder)
    assert good.passed and good.snr_db is not None and good.snr_db >= 60, good

    def no_pin(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
        return model, Change("pin_legacy_semantics")

    monkeypatch.setattr(legacy, "pin_legacy_semantics", no_pin)
    path = prepared_file(source, tmp_path)
    check = check_preparation("m", source, NO_INPUTS, path, folder)
    assert not check.passed and check.culprit == "upgrade_opset", check
    assert check.snr_db is not None and check.snr_db < lossless.MIN_PREPARED_SNR_DB


def test_scores_are_paired_by_name_else_by_position_and_shape() -> None:
    """The source's tensor of the judged name where it has one; else its own label scores,
    paired by position, only where their shapes are the judged ones (an optimizer that moved
    a Transpose past the ArgMax left scores of another layout: compared, they read 0.73 dB)."""
    source = tiny()
    source.graph.node.append(oh.make_node("ArgMax", ["y"], ["labels"], axis=1, keepdims=0))
    del source.graph.output[:]
    source.graph.output.append(oh.make_tensor_value_info("labels", TensorProto.INT64, [1, 6, 6]))

    def outputs(model: onnx.ModelProto) -> list[str]:
        return [o.name for o in model.graph.output]

    assert outputs(lossless._exposing(source, [("c", [1, 2, 6, 6])])) == ["labels", "c"]
    assert outputs(lossless._exposing(source, [("renamed", [1, 2, 6, 6])])) == ["labels", "y"]
    assert outputs(lossless._exposing(source, [("renamed", [1, 6, 6, 2])])) == ["labels"]
    assert outputs(lossless._exposing(source, [("a", [1]), ("b", [1])])) == ["labels"]
