"""The one-pass MinMax calibration writes what onnxruntime's own calibration writes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.calibration.ranges import read_cache
from pipeline.core.config import load_config
from pipeline.quantize import quantizer

RNG = np.random.default_rng(11)


def small_net() -> onnx.ModelProto:
    """Conv -> Relu -> pool -> Gemm -> Softmax, a Sigmoid branch, and an fp16 side path (a Cast
    to float16 and back): tensors of both float types, an input, initializers, an output."""
    w = numpy_helper.from_array(RNG.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(RNG.standard_normal(4).astype(np.float32), "b")
    fc = numpy_helper.from_array(RNG.standard_normal((4, 5)).astype(np.float32), "fc")
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv"], ["relu"]),
        helper.make_node("Sigmoid", ["conv"], ["gate"]),
        helper.make_node("Mul", ["relu", "gate"], ["gated"]),
        helper.make_node("Cast", ["gated"], ["half"], to=TensorProto.FLOAT16),
        helper.make_node("Cast", ["half"], ["back"], to=TensorProto.FLOAT),
        helper.make_node("GlobalAveragePool", ["back"], ["pool"]),
        helper.make_node("Flatten", ["pool"], ["flat"]),
        helper.make_node("Gemm", ["flat", "fc"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probs"]),
    ]
    graph = helper.make_graph(
        nodes,
        "net",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [1, 5])],
        [w, b, fc],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return onnx.shape_inference.infer_shapes(model)


@pytest.mark.parametrize("count", [5, 37])  # under one onnxruntime chunk, and over two
def test_one_pass_minmax_equals_onnxruntime_calibration(tmp_path: Path, count: int) -> None:
    model_path = tmp_path / "net.onnx"
    onnx.save(small_net(), str(model_path))
    config_path = tmp_path / "net.toml"
    config_path.write_text(
        '[model]\nname = "net"\nversion = "1.0.0"\nsource = "net.onnx"\n'
        '[calibration]\nkind = "random"\nsamples = 8\n',
        encoding="utf-8",
    )
    config = load_config(config_path)
    assert config.quantization.method == "MinMax"
    samples = [
        {"x": (RNG.standard_normal((1, 3, 8, 8)) * (1 + i % 4)).astype(np.float32)}
        for i in range(count)
    ]

    ours = quantizer.calibrate(
        config, model_path, samples, tmp_path / "ours.json", tmp_path / "unused.onnx", "net"
    )
    quantizer._run_quantizer(
        config, model_path, tmp_path / "ort.onnx", samples, tmp_path / "ort.json", {}
    )

    assert not (tmp_path / "unused.onnx").exists()  # no throwaway QDQ model any more
    _, mine = read_cache(ours.cache)
    _, theirs = read_cache(tmp_path / "ort.json")
    assert mine.keys() == theirs.keys()
    assert {"x", "conv", "gate", "probs"} <= mine.keys()  # input, activations, output
    assert mine == theirs  # the very same float32 values, not merely close
    # The statistics of the same pass: RMS on the first samples of every calibrated tensor.
    assert ours.rms_samples == min(count, quantizer.RMS_SAMPLES)
    first = samples[: quantizer.RMS_SAMPLES]
    want = float(np.sqrt(np.mean([np.mean(s["x"].astype(np.float64) ** 2) for s in first])))
    assert ours.rms["x"] == pytest.approx(want, rel=1e-5)


def test_evaluate_measures_the_same_files_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mixed precision measures the QDQ model it starts from, the stage's report measures the
    one it ends with: when they are the same file, the CPU runs happen once."""
    from pipeline.quantize import evaluate as evaluate_mod

    reference, test = tmp_path / "ref.onnx", tmp_path / "test.onnx"
    onnx.save(small_net(), str(reference))
    onnx.save(small_net(), str(test))
    heldout = tmp_path / "heldout"
    heldout.mkdir()
    for i in range(3):
        np.savez(heldout / f"sample_{i:04d}.npz", x=RNG.standard_normal((1, 3, 8, 8)).astype("f"))
    runs: list[Path] = []
    measure = evaluate_mod._evaluate

    def counted(ref: Path, tst: Path, folder: Path) -> dict:
        runs.append(tst)
        return measure(ref, tst, folder)

    monkeypatch.setattr(evaluate_mod, "_evaluate", counted)
    first = evaluate_mod.evaluate(reference, test, heldout)
    assert evaluate_mod.evaluate(reference, test, heldout) == first and len(runs) == 1
    changed = small_net()
    changed.graph.initializer[0].raw_data = np.zeros((4, 3, 3, 3), np.float32).tobytes()
    onnx.save(changed, str(test))  # another model under the same name: measured again
    assert evaluate_mod.evaluate(reference, test, heldout) != first and len(runs) == 2
    np.savez(heldout / "sample_0003.npz", x=np.ones((1, 3, 8, 8), np.float32))
    evaluate_mod.evaluate(reference, test, heldout)  # another sample: measured again
    assert len(runs) == 3


def test_kept_runs_serve_the_same_model_on_the_same_feeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The end-to-end check runs the QDQ and float models on the held-out samples that mixed
    precision ran them on: a kept run is served without a session; another file, other feeds
    or a full budget run the model."""
    from pipeline.quantize import evaluate as evaluate_mod

    monkeypatch.setattr(evaluate_mod, "_KEPT", {})
    monkeypatch.setattr(evaluate_mod, "_KEPT_BYTES", [0])
    path = tmp_path / "net.onnx"
    onnx.save(small_net(), str(path))
    feeds = {"x": RNG.standard_normal((1, 3, 8, 8)).astype(np.float32)}
    first = evaluate_mod.KeptRuns(path)
    want = first.run_named(["probs"], feeds)
    again = evaluate_mod.KeptRuns(path)
    assert again.run_named(["probs"], dict(feeds))["probs"] is want["probs"]
    assert again._session is None  # served from what the first one kept
    other = {"x": feeds["x"] + 1}
    got = again.run_named(["probs"], other)
    assert again._session is not None and not np.array_equal(got["probs"], want["probs"])

    changed = small_net()
    changed.graph.initializer[0].raw_data = np.zeros((4, 3, 3, 3), np.float32).tobytes()
    onnx.save(changed, str(path))  # another model under the same name
    third = evaluate_mod.KeptRuns(path)
    assert not np.array_equal(third.run_named(["probs"], feeds)["probs"], want["probs"])

    monkeypatch.setattr(evaluate_mod, "KEEP_BYTES", 0)  # nothing fits: nothing is kept
    before = dict(evaluate_mod._KEPT)
    evaluate_mod.KeptRuns(path).run_named(["probs"], {"x": feeds["x"] * 2})
    assert evaluate_mod._KEPT.keys() == before.keys()


def test_held_outputs_share_one_budget_a_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The end-to-end check's source outputs get what the kept runs leave of ``KEEP_BYTES``:
    a full allowance spills them to disk (read back the same), a free one keeps them."""
    from pipeline.quantize import evaluate as evaluate_mod

    monkeypatch.setattr(evaluate_mod, "_KEPT_BYTES", [evaluate_mod.KEEP_BYTES])
    outputs = {"y": RNG.standard_normal((2, 5)).astype(np.float32)}
    full = evaluate_mod.SampleOutputs(tmp_path)
    full.put(0, outputs)
    assert 0 in full and (tmp_path / "000000.npz").is_file()
    np.testing.assert_array_equal(full.get(0)["y"], outputs["y"])
    monkeypatch.setattr(evaluate_mod, "_KEPT_BYTES", [0])
    free = evaluate_mod.SampleOutputs(tmp_path / "unused")
    free.put(0, outputs)
    assert free.get(0)["y"] is outputs["y"] and not (tmp_path / "unused").exists()


def test_a_kept_reference_is_not_spilled_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``evaluate`` holds the reference's outputs while the test model runs: those the kept
    runs already hold are taken as they are, not counted a second time against the allowance
    and spilled (a streaming model's 300 frames were written and read back at every mixed-
    precision round). Measured the same either way; nothing kept, they spill as before."""
    from pipeline.quantize import evaluate as evaluate_mod

    monkeypatch.setattr(evaluate_mod, "_KEPT", {})
    monkeypatch.setattr(evaluate_mod, "_MEASURED", {})
    heldout = tmp_path / "heldout"
    heldout.mkdir()
    for k in range(6):
        x = RNG.standard_normal((1, 3, 8, 8)).astype(np.float32)
        np.savez(heldout / f"sample_{k:04d}.npz", x=x)
    reference, test = tmp_path / "float.onnx", tmp_path / "test.onnx"
    onnx.save(small_net(), str(reference))
    changed = small_net()
    weight = numpy_helper.to_array(changed.graph.initializer[0])
    changed.graph.initializer[0].raw_data = (weight * 1.01).astype(np.float32).tobytes()
    onnx.save(changed, str(test))
    spills: list[int] = []
    put = evaluate_mod.SampleOutputs.put

    def counting_put(self, index, outputs, **how):
        put(self, index, outputs, **how)
        spills.extend([index] if index in self._spilled else [])

    monkeypatch.setattr(evaluate_mod.SampleOutputs, "put", counting_put)
    other = tmp_path / "other.onnx"
    changed.graph.initializer[0].raw_data = (weight * 0.99).astype(np.float32).tobytes()
    onnx.save(changed, str(other))
    results = []
    # the allowance just holds the reference's 6 runs ([1, 5] float32 each), then nothing
    for keep in (6 * 5 * 4, 0):
        monkeypatch.setattr(evaluate_mod, "_KEPT", {})
        monkeypatch.setattr(evaluate_mod, "_MEASURED", {})
        monkeypatch.setattr(evaluate_mod, "_KEPT_BYTES", [0])
        monkeypatch.setattr(evaluate_mod, "KEEP_BYTES", keep)
        evaluate_mod.evaluate(reference, test, heldout)  # the reference's runs kept, if they fit
        spills.clear()  # the second comparison of the same reference: its runs served kept
        results.append((evaluate_mod.evaluate(reference, other, heldout), len(spills)))
    (kept, kept_spills), (unkept, unkept_spills) = results
    assert kept_spills == 0 and unkept_spills == 6
    assert kept["probs"].snr_db == pytest.approx(unkept["probs"].snr_db)


def test_matmul_weights_go_per_channel_and_stay_whole_on_the_htp(tmp_path: Path) -> None:
    """A 2-D MatMul weight gets int8 symmetric scales per output column by default, like a
    Gemm's (a MiniLM encoder at 8-bit weights: 14.9 dB per tensor, 24.5 dB per column); the
    QNN HTP takes it in one partition. Columns 100x apart: per tensor, the small ones round
    to a few steps. A batched [B, K, N] constant stays per tensor (axis 1 is not its columns)."""
    from compile_fixtures import build_whole_on_htp, model_paths

    rng = np.random.default_rng(21)
    weight = rng.standard_normal((16, 8)) * np.where(np.arange(8) < 4, 1.0, 0.01)
    batched = rng.standard_normal((2, 4, 3))
    model = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("MatMul", ["x", "w"], ["h"], name="columns"),
                helper.make_node("Reshape", ["h", "shape"], ["h2"], name="split"),
                helper.make_node("MatMul", ["h2", "wb"], ["y"], name="batched"),
            ],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 1, 3])],
            [
                numpy_helper.from_array(weight.astype(np.float32), "w"),
                numpy_helper.from_array(np.array([2, 1, 4], np.int64), "shape"),
                numpy_helper.from_array(batched.astype(np.float32), "wb"),
            ],
        ),
        opset_imports=[helper.make_opsetid("", 13)],
        ir_version=8,
    )
    assert quantizer.per_channel_weights(model) == {"w": "int8_per_channel"}
    build_whole_on_htp(tmp_path, "columns", model)
    qdq = onnx.load(str(model_paths(tmp_path, "columns").bucket("static").qdq))
    inits = {i.name: numpy_helper.to_array(i) for i in qdq.graph.initializer}
    dq = next(
        n for n in qdq.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == "w_quantized"
    )
    assert inits[dq.input[1]].shape == (8,) and inits["w_quantized"].dtype == np.int8
    variant = next(model_paths(tmp_path, "columns").ctx.glob("*/*/variant.json"))
    assert json.loads(variant.read_text())["validation"]["worst_snr_vs_float_db"] > 30


def test_a_product_of_two_activations_keeps_16_bits_on_the_htp(tmp_path: Path) -> None:
    """Attention's probs @ V: the HTP computes a MatMul of two uint16 activations into a uint16
    output as if V had 8 bits (~45 dB from the CPU QDQ model here); re-encoded as int16 (then
    converted back for its readers) it keeps all 16 (~64 dB). A MatMul of an activation and a
    weight is left as it is."""
    from compile_fixtures import build_whole_on_htp, ctx_vs_qdq_on_htp, model_paths

    rng = np.random.default_rng(5)
    model = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("Mul", ["scores", "gain"], ["logits"]),
                helper.make_node("Softmax", ["logits"], ["probs"]),
                helper.make_node("MatMul", ["probs", "v"], ["context"], name="probs_v"),
                helper.make_node("MatMul", ["context", "w"], ["y"], name="projection"),
            ],
            "attention",
            [
                helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 4, 64, 64]),
                helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, 4, 64, 32]),
            ],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 64, 32])],
            [
                numpy_helper.from_array(np.array(3.0, np.float32), "gain"),
                numpy_helper.from_array(rng.standard_normal((32, 32)).astype(np.float32), "w"),
            ],
        ),
        opset_imports=[helper.make_opsetid("", 21)],
        ir_version=10,
    )
    build_whole_on_htp(tmp_path, "attention", model)
    paths = model_paths(tmp_path, "attention")
    qdq_path = paths.bucket("static").qdq
    qdq = onnx.load(str(qdq_path))
    zero_types = {i.name: i.data_type for i in qdq.graph.initializer}
    quantized = {
        n.input[0]: zero_types[n.input[2]] for n in qdq.graph.node if n.op_type == "QuantizeLinear"
    }
    assert quantized["context"] == TensorProto.INT16  # the product, re-encoded
    projection = next(n for n in qdq.graph.node if n.name == "projection")
    assert quantized[projection.output[0]] == TensorProto.UINT16  # activation x weight
    sample = tmp_path / "sample.npz"
    np.savez(
        sample,
        scores=rng.standard_normal((1, 4, 64, 64)).astype(np.float32),
        v=rng.standard_normal((1, 4, 64, 32)).astype(np.float32),
    )
    assert (
        ctx_vs_qdq_on_htp(qdq_path, paths.bucket("static").float_model, sample, tmp_path / "p") > 55
    )


@pytest.mark.parametrize("mixed", [False, True])
def test_the_quantizer_with_indexed_renames_writes_the_same_model(
    tmp_path: Path, mixed: bool
) -> None:
    """``_indexed_renames`` changes how fast onnxruntime renames, not what it writes: the
    same bytes as onnxruntime alone (the net's output is quantized too, the output rename), and
    onnxruntime's own methods are back afterwards."""
    from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize_static
    from onnxruntime.quantization.onnx_model import ONNXModel

    onnx.save(small_net(), str(tmp_path / "net.onnx"))
    samples = [{"x": RNG.standard_normal((1, 3, 8, 8)).astype(np.float32)} for _ in range(3)]

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.samples = iter(samples)

        def get_next(self) -> dict | None:
            return next(self.samples, None)

    # A tensor at 8 bits among 16-bit ones: onnxruntime converts between them (more renames).
    overrides = {"TensorQuantOverrides": {"gate": [{"quant_type": QuantType.QUInt8}]}}

    def quantize(name: str) -> bytes:
        quantize_static(
            tmp_path / "net.onnx",
            tmp_path / name,
            Reader(),
            per_channel=True,
            activation_type=QuantType.QUInt16,
            weight_type=QuantType.QInt8,
            extra_options=overrides if mixed else {},
        )
        return (tmp_path / name).read_bytes()

    originals = (ONNXModel.replace_input_of_all_nodes, ONNXModel.replace_output_of_all_nodes)
    theirs = quantize("theirs.onnx")
    with quantizer._indexed_renames():
        assert ONNXModel.replace_input_of_all_nodes is not originals[0]
        ours = quantize("ours.onnx")
    assert ours == theirs
    assert (
        ONNXModel.replace_input_of_all_nodes,
        ONNXModel.replace_output_of_all_nodes,
    ) == originals
    qdq = onnx.load(str(tmp_path / "ours.onnx"))
    assert any(n.op_type == "QuantizeLinear" and "probs" in n.input[0] for n in qdq.graph.node)


def test_a_long_comparison_shows_progress_in_a_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A comparison over held-out samples counts its runs: a log hears of it every
    LOG_EVERY_S (a 36,637-node unrolled BiLSTM's evaluation ran 17 minutes without a line)."""
    from pipeline.core import progress as progress_mod
    from pipeline.quantize import evaluate as evaluate_mod

    monkeypatch.setattr(evaluate_mod, "_KEPT", {})
    monkeypatch.setattr(progress_mod, "LOG_EVERY_S", 0.0)  # every run is "long" here
    heldout = tmp_path / "heldout"
    heldout.mkdir()
    for k in range(3):
        x = RNG.standard_normal((1, 3, 8, 8)).astype(np.float32)
        np.savez(heldout / f"sample_{k:04d}.npz", x=x)
    model = tmp_path / "float.onnx"
    onnx.save(small_net(), str(model))
    evaluate_mod.cpu_accuracy(model, model, sorted(heldout.glob("*.npz")))
    err = capsys.readouterr().err
    assert "compare float.onnx with float.onnx on held-out samples: 6 of 6 runs" in err, err


def detector_head(class_bias: float = -6.0) -> onnx.ModelProto:
    """A detector's packed output, as YOLOv8 writes it: 4 rows of boxes decoded to pixels
    (a Sigmoid x 640) and 2 rows of class probabilities (mostly small), concatenated on the
    channel axis and transposed to [1, anchors, 6]."""
    rng = np.random.default_rng(31)
    inits = [
        numpy_helper.from_array(rng.standard_normal((4, 8, 1)).astype(np.float32), "wb"),
        numpy_helper.from_array(0.3 * rng.standard_normal((2, 8, 1)).astype(np.float32), "wc"),
        numpy_helper.from_array(np.full(2, class_bias, np.float32), "bc"),
        numpy_helper.from_array(np.array(640.0, np.float32), "pixels"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "wb"], ["box_logits"]),
        helper.make_node("Sigmoid", ["box_logits"], ["box_unit"]),
        helper.make_node("Mul", ["box_unit", "pixels"], ["box"]),
        helper.make_node("Conv", ["x", "wc", "bc"], ["class_logits"]),
        helper.make_node("Sigmoid", ["class_logits"], ["classes"]),
        helper.make_node("Concat", ["box", "classes"], ["packed"], axis=1, name="pack"),
        helper.make_node("Transpose", ["packed"], ["y"], perm=[0, 2, 1]),
    ]
    graph = helper.make_graph(
        nodes,
        "head",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, 6])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def test_an_output_packing_parts_of_different_scale_stays_float_from_its_concat() -> None:
    """Boxes to 640 px beside probabilities under 1: the Concat and the move after it stay
    float. Parts of one scale, or a Concat read by more than moves, are left to one grid."""
    from pipeline.calibration.ranges import PACKED_RATIO, packed_outputs

    model = detector_head()
    ranges = {"box": (0.0, 640.0), "classes": (0.0, 0.5), "packed": (0.0, 640.0), "y": (0.0, 640.0)}
    kept = packed_outputs(model, ranges)
    assert set(kept) == {"packed", "y"}
    assert "'y' packs parts peaking at 0.5 and 640 in Concat 'pack'" in kept["y"]
    close = {**ranges, "classes": (0.0, 640.0 / PACKED_RATIO * 1.01)}
    assert packed_outputs(model, close) == {}
    assert packed_outputs(model, {"box": (0.0, 640.0)}) == {}  # a part never calibrated
    model.graph.node[-1].CopyFrom(helper.make_node("Relu", ["packed"], ["y"]))
    assert packed_outputs(model, ranges) == {}  # computed on: not a packing of results


@pytest.mark.qnn
def test_a_packed_output_keeps_its_small_part_precise_on_the_htp(tmp_path: Path) -> None:
    """Built with the real stages: whole on the HTP, the output made in fp16 from its Concat on,
    and the class probabilities there close to float, where the output's one uint16 grid for
    0..640 px would have left them a few dozen steps (computed: far below)."""
    pytest.importorskip("onnxruntime_qnn")
    import onnxruntime as ort
    from compile_fixtures import build_whole_on_htp, model_paths

    from qnn_ctx_runtime import qnn

    model = detector_head()
    build_whole_on_htp(tmp_path, "head", model)
    paths = model_paths(tmp_path, "head")
    qdq = onnx.load(str(paths.bucket("static").qdq))
    producer = {o: n for n in qdq.graph.node for o in n.output}
    assert producer["y"].op_type == "Transpose" and producer["packed"].op_type == "Concat"
    report = (paths.root / "report.md").read_text()
    assert "Packed outputs kept in float" in report
    # Each part has its row in the accuracy table, the classes' own figure there too.
    assert "| y / box | part: " in report and "| y / classes | part: " in report
    notes = (paths.ctx / "report.md").read_text()
    assert "Parts of the outputs a Concat packs" in notes and "'y / classes' " in notes
    ctx = next(paths.ctx.glob("*/snapdragon-x-elite/*.onnx"))
    options = qnn.find_qnn_ep().session_options(qnn.QnnOptions("htp", 60, 73))
    htp = ort.InferenceSession(str(ctx), options)
    cpu = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(5)
    got, want = [], []
    for _ in range(4):
        x = rng.standard_normal((1, 8, 64)).astype(np.float32)
        got.append(htp.run(None, {"x": x})[0][..., 4:])
        want.append(cpu.run(None, {"x": x})[0][..., 4:])
    classes, reference = np.concatenate(got), np.concatenate(want)

    def snr(test: np.ndarray) -> float:
        return float(10 * np.log10(np.sum(reference**2) / np.sum((test - reference) ** 2)))

    shared_grid = np.round(reference / (640.0 / 65535)) * (640.0 / 65535)
    assert snr(classes) > 40.0 and snr(shared_grid) < 30.0, (snr(classes), snr(shared_grid))
