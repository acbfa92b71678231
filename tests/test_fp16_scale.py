"""pipeline.graph.fp16_scale: an input scaled by 2^-k so that a log-power front end fits fp16."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

from pipeline.graph.fp16_scale import (
    FLOAT16_TARGET,
    asins_from_atan,
    bounded_float16_atans,
    decomposed_gelus,
    exact_float16_forms,
    exact_sigmoids,
    exact_softpluses,
    exact_tanhs,
    finite_float16_logs,
    fit_float16,
    float16_large_divisors,
    float16_residual_streams,
    float16_safe_norms,
    float16_scaled_l2_norms,
    floored_float16_exps,
    log_softmaxes_written_out,
    max_for_small_clip_floors,
    normal_float16_weights,
    padded_float16_resizes,
    rounds_of_float16_integers,
    separable_float16_pools,
)

RNG = np.random.default_rng(11)
FRAMES, TAPS, BINS, MELS = 12, 64, 16, 8


def log_power(gate: str = "", joined: bool = False) -> onnx.ModelProto:
    """Raw int16-scale audio -> STFT-like Conv (real, imag) -> power -> mel MatMul -> Clip ->
    10 log10: openWakeWord/torchaudio-style front ends. Also outputs the real part (degree 1),
    which must come back unscaled. ``gate`` puts a non-homogeneous op on the input ("Where": a
    constant mask zeroing the last frame, which is homogeneous); ``joined``
    also outputs the real part concatenated with the log spectrum (degrees 1 and 0 meet)."""
    real_w = (RNG.standard_normal((BINS, 1, TAPS)) / TAPS).astype(np.float32)
    imag_w = (RNG.standard_normal((BINS, 1, TAPS)) / TAPS).astype(np.float32)
    mel = np.abs(RNG.standard_normal((BINS, MELS))).astype(np.float32)
    samples = TAPS * FRAMES
    source = "x"
    nodes = []
    if gate == "Where":  # samples past the clip's length zeroed, as NeMo's preprocessor does
        nodes.append(oh.make_node("Where", ["keep", "x", "zero"], ["gated"]))
        source = "gated"
    elif gate:
        nodes.append(oh.make_node(gate, ["x"], ["gated"]))
        source = "gated"
    nodes += [
        oh.make_node("Conv", [source, "wr"], ["re"], strides=[TAPS]),
        oh.make_node("Conv", [source, "wi"], ["im"], strides=[TAPS]),
        oh.make_node("Mul", ["re", "re"], ["re2"]),
        oh.make_node("Mul", ["im", "im"], ["im2"]),
        oh.make_node("Add", ["re2", "im2"], ["power"]),
        oh.make_node("Transpose", ["power"], ["frames"], perm=[0, 2, 1]),
        oh.make_node("MatMul", ["frames", "mel"], ["melspec"]),
        oh.make_node("Clip", ["melspec", "floor", ""], ["floored"]),
        oh.make_node("Log", ["floored"], ["ln"]),
        oh.make_node("Mul", ["ln", "ten_over_ln10"], ["db"]),
    ]
    outputs = [
        oh.make_tensor_value_info("db", TensorProto.FLOAT, [1, FRAMES, MELS]),
        oh.make_tensor_value_info("re", TensorProto.FLOAT, [1, BINS, FRAMES]),
    ]
    if joined:
        nodes.append(oh.make_node("Transpose", ["re"], ["re_frames"], perm=[0, 2, 1]))
        nodes.append(oh.make_node("Concat", ["re_frames", "db"], ["joined"], axis=2))
        outputs.append(oh.make_tensor_value_info("joined", TensorProto.FLOAT, [1, FRAMES, 24]))
    graph = oh.make_graph(
        nodes,
        "log_power",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, samples])],
        outputs,
        [
            numpy_helper.from_array(real_w, "wr"),
            numpy_helper.from_array(imag_w, "wi"),
            numpy_helper.from_array(mel, "mel"),
            numpy_helper.from_array(np.array(1e-10, np.float32), "floor"),
            numpy_helper.from_array(np.array(10 / np.log(10), np.float32), "ten_over_ln10"),
            numpy_helper.from_array(np.arange(samples).reshape(1, 1, -1) < samples - TAPS, "keep"),
            numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
        ],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def audio(count: int) -> list[np.ndarray]:
    """int16-valued samples: loud and quiet, as a raw-PCM reader feeds them."""
    return [
        np.clip(RNG.standard_normal((1, 1, TAPS * FRAMES)) * 10 ** RNG.uniform(2, 4), -32768, 32767)
        .round()
        .astype(np.float32)
        for _ in range(count)
    ]


def every_tensor(model: onnx.ModelProto, x: np.ndarray) -> dict[str, np.ndarray]:
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    known = {o.name for o in exposed.graph.output}
    for node in exposed.graph.node:
        for out in node.output:
            if out not in known:
                exposed.graph.output.append(oh.make_empty_tensor_value_info(out))
    session = ort.InferenceSession(exposed.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, {"x": x}), strict=True))


def peaks_of(model: onnx.ModelProto, samples: list[np.ndarray]) -> dict[str, float]:
    peaks: dict[str, float] = {"x": max(float(np.abs(s).max()) for s in samples)}
    for x in samples:
        for name, value in every_tensor(model, x).items():
            peaks[name] = max(peaks.get(name, 0.0), float(np.abs(value).max()))
    return peaks


def test_fit_float16_scales_the_input_and_computes_the_same() -> None:
    model = log_power()
    samples = audio(6)
    peaks = peaks_of(model, samples)
    assert peaks["melspec"] > 1e6, "the front end must overflow fp16 to test anything"
    fitted, change = fit_float16(model, peaks)
    assert fitted is not None, change.details
    assert "input 'x' scaled by 2^-" in change.details[0]
    assert "1 Log(s) corrected" in change.details[0]
    for x in samples:
        got, want = every_tensor(fitted, x), every_tensor(model, x)
        np.testing.assert_allclose(got["db"], want["db"], rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(got["re"], want["re"], rtol=1e-5, atol=1e-3)
        inner = [v for n, v in got.items() if n not in ("db", "re", "x")]
        assert max(float(np.abs(v).max()) for v in inner) <= FLOAT16_TARGET


def test_fit_float16_scales_back_a_tensor_that_meets_an_unscaled_one() -> None:
    """The real part concatenated with the log spectrum (Silero VAD v4 joins its magnitude
    and log spectrum so): the scaled operand is brought back (times 2^shift) before the
    Concat, which was refused ("mixes tensors of different scale"); exact in float32."""
    model = log_power(joined=True)
    samples = [x / 4 for x in audio(6)]
    peaks = peaks_of(model, samples)
    assert peaks["melspec"] > 1e6 and peaks["re"] <= FLOAT16_TARGET
    fitted, change = fit_float16(model, peaks)
    assert fitted is not None, change.details
    assert "1 operand(s) scaled back" in change.details[0]
    for x in samples:
        got, want = every_tensor(fitted, x), every_tensor(model, x)
        np.testing.assert_allclose(got["joined"], want["joined"], rtol=1e-5, atol=1e-3)
    peaks["re_frames"] = FLOAT16_TARGET * 2  # one too wide to come back is refused, and said
    refused, change = fit_float16(model, peaks)
    assert refused is None and "too wide" in change.details[0]


def with_floor(model: onnx.ModelProto, floor: float) -> onnx.ModelProto:
    """``model`` (a ``log_power``) with its Log's floor at ``floor``."""
    model.graph.initializer[3].CopyFrom(
        numpy_helper.from_array(np.array(floor, np.float32), "floor")
    )
    return model


def test_fit_float16_leaves_a_model_that_fits() -> None:
    """Peaks under the target and a Log floor fp16 holds as a normal number: nothing to do."""
    model = with_floor(log_power(), 1e-3)
    quiet = [x / 1000 for x in audio(3)]
    fitted, change = fit_float16(model, peaks_of(model, quiet))
    assert fitted is None and not change.changed


@pytest.mark.parametrize("gate", ["Sigmoid", "Exp"])
def test_fit_float16_refuses_a_non_homogeneous_front_end(gate: str) -> None:
    """Sigmoid or Exp of the input: no input scale gives the same function; said, not done."""
    model = log_power(gate)
    peaks = {"x": 3e4, "melspec": 1e9}
    fitted, change = fit_float16(model, peaks)
    assert fitted is None
    assert f"{gate} 'gated'" in change.details[0] or "not homogeneous" in change.details[0]


@pytest.mark.qnn
def test_the_htp_runs_the_fitted_front_end_in_fp16(tmp_path: Path) -> None:
    """Measured: as it is, the fp16 ctx overflows (~0 dB vs float); fitted it agrees."""
    from compile_fixtures import whole_ctx_vs_float

    model = log_power()
    samples = audio(4)
    fitted, _ = fit_float16(model, peaks_of(model, samples))
    assert fitted is not None
    models = {"float": model, "fitted": fitted}
    results = whole_ctx_vs_float(tmp_path, models, [{"x": x} for x in samples])
    assert results["fitted"] > 25.0, results
    assert results["float"] < 10.0, results


def score_head() -> onnx.ModelProto:
    """A detector's score head: Conv -> Sigmoid -> Reshape -> Transpose -> output (sparse
    scores, logits near -7), beside a gate Sigmoid inside the model (x * sigmoid(x))."""
    rng = np.random.default_rng(9)
    w = rng.normal(0, 0.3, (4, 8, 1, 1)).astype(np.float32)
    b = np.full(4, -7.0, np.float32)
    nodes = [
        oh.make_node("Conv", ["x", "w", "b"], ["logits"]),
        oh.make_node("Sigmoid", ["logits"], ["scores"]),
        oh.make_node("Reshape", ["scores", "shape"], ["flat"]),
        oh.make_node("Transpose", ["flat"], ["y"], perm=[0, 2, 1]),
        oh.make_node("Sigmoid", ["x"], ["gate"]),
        oh.make_node("Mul", ["x", "gate"], ["z"]),
    ]
    graph = oh.make_graph(
        nodes,
        "head",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 32, 32])],
        [
            oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1024, 4]),
            oh.make_tensor_value_info("z", TensorProto.FLOAT, [1, 8, 32, 32]),
        ],
        [
            numpy_helper.from_array(w, "w"),
            numpy_helper.from_array(b, "b"),
            numpy_helper.from_array(np.array([1, 4, 1024], np.int64), "shape"),
        ],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


def test_every_sigmoid_is_computed_from_exp_and_the_same() -> None:
    """The score map's Sigmoid (read through Reshape and Transpose) and the gate inside are
    computed from Exp; float32 outputs agree to rounding."""
    model = score_head()
    exact, change = exact_sigmoids(model)
    assert len(change.details) == 2 and all("Sigmoid" in d for d in change.details)
    ops = [n.op_type for n in exact.graph.node]
    assert ops.count("Sigmoid") == 0 and ops.count("Exp") == 4
    x = np.random.default_rng(1).normal(0, 2, (1, 8, 32, 32)).astype(np.float32)
    before, after = (
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"x": x}
        )
        for m in (model, exact)
    )
    for expected, got in zip(before, after, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert exact_sigmoids(exact)[1].changed is False


def test_the_htp_computes_small_scores_right_from_exp(tmp_path: Path) -> None:
    """Measured: in fp16 on the HTP, Sigmoid's small scores are 23 dB from float; from exp,
    63 dB."""
    from compile_fixtures import whole_ctx_vs_float

    model = score_head()
    model.graph.output.pop()  # the score map alone
    exact, _ = exact_sigmoids(model)
    rng = np.random.default_rng(2)
    samples = [{"x": rng.normal(0, 2, (1, 8, 32, 32)).astype(np.float32)} for _ in range(2)]
    results = whole_ctx_vs_float(tmp_path, {"float": model, "exact": exact}, samples)
    assert results["exact"] > 50.0, results
    assert results["float"] < results["exact"] - 10.0, results


def test_the_htp_computes_large_scores_right_too(tmp_path: Path) -> None:
    """A text detector's map: logits far on both sides (here ~N(-7, 21), up to +-99). Measured: as
    e^x / (1 + e^x) the HTP's fp16 division flushed scores of x > 9.7 to 0 (0.9 dB on a real
    one); exp(min(x, 0)) / (1 + exp(-|x|)) keeps its denominator in [1, 2], and x is clipped
    to +-80: the HTP's fp16 Exp returns -131008 below -88."""
    from compile_fixtures import whole_ctx_vs_float

    model = score_head()
    model.graph.output.pop()
    exact, _ = exact_sigmoids(model)
    rng = np.random.default_rng(3)
    samples = [{"x": rng.normal(0, 25, (1, 8, 32, 32)).astype(np.float32)} for _ in range(2)]
    results = whole_ctx_vs_float(tmp_path, {"float": model, "exact": exact}, samples)
    assert results["exact"] > 45.0, results


def activation_stack(activation: str, layers: int = 10, channels: int = 16) -> onnx.ModelProto:
    """``layers`` x (1x1 Conv -> ``activation``; "SiLU": x * sigmoid(x)), seeded: each layer
    adds the activation's error and the next ones carry it, as in a real network."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for k in range(layers):
        w = rng.normal(0, 1.6 / np.sqrt(channels), (channels, channels, 1, 1))
        inits += [
            numpy_helper.from_array(w.astype(np.float32), f"w{k}"),
            numpy_helper.from_array(rng.normal(0, 0.5, channels).astype(np.float32), f"b{k}"),
        ]
        y = "y" if k == layers - 1 else f"y{k}"
        nodes.append(oh.make_node("Conv", [x, f"w{k}", f"b{k}"], [f"c{k}"]))
        if activation == "SiLU":
            nodes += [
                oh.make_node("Sigmoid", [f"c{k}"], [f"s{k}"]),
                oh.make_node("Mul", [f"c{k}", f"s{k}"], [y]),
            ]
        else:
            nodes.append(oh.make_node(activation, [f"c{k}"], [y]))
        x = y
    shape = [1, channels, 32, 32]
    graph = oh.make_graph(
        nodes,
        "activation_stack",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        inits,
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


def test_the_htp_computes_a_network_of_silus_right_from_exp(tmp_path: Path) -> None:
    """Measured: 10 Conv + SiLU layers whole in fp16 on the HTP, 35.7 dB from float with the
    Sigmoid op (its ~1e-3 error at every layer), 47.8 dB from exp (a real YOLOX-nano: 20.9 ->
    33.2 dB). If a new QNN SDK makes the op exact, both pass the first bound and the second
    fails: the rewrite may then go."""
    from compile_fixtures import whole_ctx_vs_float

    model = activation_stack("SiLU")
    exact, change = exact_sigmoids(model)
    assert len(change.details) == 10
    samples = stack_samples()
    results = whole_ctx_vs_float(tmp_path, {"float": model, "exact": exact}, samples)
    assert results["exact"] > 44.0, results
    assert results["float"] < results["exact"] - 8.0, results


def stack_samples() -> list[dict[str, np.ndarray]]:
    """Two seeded N(0, 1) inputs for ``activation_stack``."""
    rng = np.random.default_rng(2)
    return [{"x": rng.normal(0, 1, (1, 16, 32, 32)).astype(np.float32)} for _ in range(2)]


def test_every_tanh_is_computed_from_exp_and_the_same() -> None:
    """Values far on both sides, near 0 and exactly 0 agree with Tanh to float32 rounding."""
    model = activation_stack("Tanh", layers=2)
    exact, change = exact_tanhs(model)
    assert len(change.details) == 2
    assert [n.op_type for n in exact.graph.node].count("Tanh") == 0
    x = np.random.default_rng(1).normal(0, 30, (1, 16, 32, 32)).astype(np.float32)
    x[0, 0, 0, :4] = [0.0, 1e-6, -1e-3, 50.0]
    np.testing.assert_allclose(cpu_outputs(exact, x), cpu_outputs(model, x), rtol=1e-5, atol=1e-6)
    assert exact_tanhs(exact)[1].changed is False


def test_the_htp_computes_tanh_right_from_exp(tmp_path: Path) -> None:
    """Measured: 10 Conv + Tanh layers whole in fp16 on the HTP, 30.6 dB from float with the Tanh
    op, 53.2 dB from exp. If a new QNN SDK makes the op exact, the second bound fails: the
    rewrite may then go."""
    from compile_fixtures import whole_ctx_vs_float

    model = activation_stack("Tanh")
    exact, _ = exact_tanhs(model)
    samples = stack_samples()
    results = whole_ctx_vs_float(tmp_path, {"float": model, "exact": exact}, samples)
    assert results["exact"] > 48.0, results
    assert results["float"] < results["exact"] - 12.0, results


def cpu_outputs(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_a_gelu_becomes_its_tanh_form_as_a_sigmoid(approximate: str) -> None:
    """The tanh GELU exactly, the erf GELU within the approximation's 4.7e-4; every Gelu, and
    through exact_sigmoids no Sigmoid op is left either."""
    model = activation_stack("Gelu", layers=1)  # one: a second layer's Conv carries the error
    for node in model.graph.node:
        if node.op_type == "Gelu":
            node.attribute.append(oh.make_attribute("approximate", approximate))
    decomposed, change = decomposed_gelus(model)
    assert len(change.details) == 1
    exact, _ = exact_sigmoids(decomposed)
    ops = [n.op_type for n in exact.graph.node]
    assert "Gelu" not in ops and "Sigmoid" not in ops
    x = np.random.default_rng(4).normal(0, 3, (1, 16, 32, 32)).astype(np.float32)
    x[0, 0, 0, :3] = [0.0, -60.0, 60.0]
    tolerance = 1e-5 if approximate == "tanh" else 5e-4
    np.testing.assert_allclose(
        cpu_outputs(exact, x), cpu_outputs(model, x), rtol=1e-4, atol=tolerance
    )


def test_every_softplus_is_computed_from_exp_and_the_same() -> None:
    model = activation_stack("Softplus", layers=2)
    exact, change = exact_softpluses(model)
    assert len(change.details) == 2
    assert "Softplus" not in [n.op_type for n in exact.graph.node]
    x = np.random.default_rng(5).normal(0, 30, (1, 16, 32, 32)).astype(np.float32)
    x[0, 0, 0, :3] = [0.0, -100.0, 100.0]
    np.testing.assert_allclose(cpu_outputs(exact, x), cpu_outputs(model, x), rtol=1e-5, atol=1e-6)


def test_the_htp_computes_gelu_and_softplus_right_decomposed(tmp_path: Path) -> None:
    """Measured, 10 Conv + activation layers whole in fp16 on the HTP vs float: Gelu 41.3 dB as
    the op, 50.4 decomposed; Softplus 39.0 as the op, 62.9 from exp. If a new QNN SDK makes an op
    exact, its second bound fails: that rewrite may then go."""
    from compile_fixtures import whole_ctx_vs_float

    samples = stack_samples()
    gelu = activation_stack("Gelu")
    gelu_exact = exact_sigmoids(decomposed_gelus(gelu)[0])[0]
    softplus = activation_stack("Softplus")
    for folder in ("gelu", "softplus"):
        (tmp_path / folder).mkdir()
    gelus = whole_ctx_vs_float(tmp_path / "gelu", {"float": gelu, "exact": gelu_exact}, samples)
    assert gelus["exact"] > 47.0 and gelus["float"] < gelus["exact"] - 6.0, gelus
    softpluses = whole_ctx_vs_float(
        tmp_path / "softplus",
        {"float": softplus, "exact": exact_softpluses(softplus)[0]},
        samples,
    )
    assert softpluses["exact"] > 55.0, softpluses
    assert softpluses["float"] < softpluses["exact"] - 12.0, softpluses


def test_a_sigmoid_picked_by_a_where_is_rewritten_too() -> None:
    """A wake-word head: score = sigmoid(x), output = score unless it passes 0.5 (then a
    verifier's). The score reaches the output through the Where's picked value, and its
    comparison with 0.5 reads the same function; the verifier's Sigmoid likewise."""
    half = numpy_helper.from_array(np.array(0.5, np.float32), "half")
    nodes = [
        oh.make_node("Sigmoid", ["x"], ["score"]),
        oh.make_node("GreaterOrEqual", ["score", "half"], ["passed"]),
        oh.make_node("Sigmoid", ["v"], ["verified"]),
        oh.make_node("Where", ["passed", "verified", "score"], ["y"]),
    ]
    tensor = oh.make_tensor_value_info
    graph = oh.make_graph(
        nodes,
        "head",
        [tensor("x", TensorProto.FLOAT, [1, 1]), tensor("v", TensorProto.FLOAT, [1, 1])],
        [tensor("y", TensorProto.FLOAT, [1, 1])],
        [half],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)
    exact, change = exact_sigmoids(model)
    assert len(change.details) == 2
    assert [n.op_type for n in exact.graph.node].count("Sigmoid") == 0


def samples_in_unit_range(count: int) -> list[np.ndarray]:
    """Audio as a float reader gives it, in [-1, 1], loud and quiet: quiet frames' power and
    the log's floor (1e-10) lie under fp16's smallest normal (2^-14). Its own generator, so
    the lift's bound does not depend on the tests run before."""
    rng = np.random.default_rng(7)
    return [
        (rng.standard_normal((1, 1, TAPS * FRAMES)) * 10 ** rng.uniform(-3, -0.5)).astype(
            np.float32
        )
        for _ in range(count)
    ]


def test_fit_float16_lifts_a_log_floor_under_fp16s_normals() -> None:
    """Nothing overflows, but the Log's floor is in fp16's subnormals: the input is scaled up
    as far as the calibrated peaks allow (2^10 would reach 2^-14; the mel peak allows 2^4 at
    degree 2), and the model computes the same in float32."""
    model = log_power()
    samples = samples_in_unit_range(6)
    peaks = peaks_of(model, samples)
    assert max(peaks.values()) < FLOAT16_TARGET / 100, "the lift must be bounded by a peak"
    fitted, change = fit_float16(model, peaks)
    assert fitted is not None, change.details
    assert "input 'x' scaled by 2^" in change.details[0] and "2^-" not in change.details[0]
    assert "floor 1e-10" in change.details[0] and "1 Log(s) corrected" in change.details[0]
    inner = peaks_of(fitted, samples)
    for name in ("db", "re", "x"):
        inner.pop(name)
    assert FLOAT16_TARGET / 4 < max(inner.values()) <= FLOAT16_TARGET  # as far as it goes
    for x in samples:
        got, want = every_tensor(fitted, x), every_tensor(model, x)
        np.testing.assert_allclose(got["db"], want["db"], rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(got["re"], want["re"], rtol=1e-5, atol=1e-7)
    full = {name: min(peak * 1e4, FLOAT16_TARGET) for name, peak in peaks.items()}
    assert fit_float16(model, full)[0] is None  # peaks at the target leave no room to lift
    assert fit_float16(with_floor(log_power(), 1e-3), peaks)[0] is None  # fp16 holds 1e-3


def log_energy() -> onnx.ModelProto:
    """Samples in [-1, 1] -> x^2 + 1e-10 -> 10 log10: a log-energy front end, elementwise."""
    nodes = [
        oh.make_node("Mul", ["x", "x"], ["energy"]),
        oh.make_node("Add", ["energy", "eps"], ["floored"]),
        oh.make_node("Log", ["floored"], ["ln"]),
        oh.make_node("Mul", ["ln", "ten_over_ln10"], ["db"]),
    ]
    graph = oh.make_graph(
        nodes,
        "log_energy",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4096])],
        [oh.make_tensor_value_info("db", TensorProto.FLOAT, [1, 4096])],
        [
            numpy_helper.from_array(np.array(1e-10, np.float32), "eps"),
            numpy_helper.from_array(np.array(10 / np.log(10), np.float32), "ten_over_ln10"),
        ],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


@pytest.mark.qnn
def test_the_htp_computes_a_lifted_log_floor_right(tmp_path: Path) -> None:
    """The whole-fp16 path (exact_float16_forms after fit_float16), with and without the lift,
    on the simulator against float32. Measured: 20.0 dB kept (energies under 2^-24 get the
    floor's log, those under 2^-14 few bits), 60.8 dB lifted by 2^6."""
    from compile_fixtures import whole_ctx_vs_float

    rng = np.random.default_rng(3)
    samples = [
        (rng.choice([-1, 1], (1, 4096)) * 10 ** rng.uniform(-6, 0, (1, 4096))).astype(np.float32)
        for _ in range(3)
    ]
    model = log_energy()
    fitted, change = fit_float16(model, peaks_of(model, samples))
    assert fitted is not None and "scaled by 2^6" in change.details[0], change.details
    models = {
        "float": model,
        "kept": exact_float16_forms(model)[0],
        "lifted": exact_float16_forms(fitted)[0],
    }
    results = whole_ctx_vs_float(tmp_path, models, [{"x": x} for x in samples])
    assert results["lifted"] > 50.0 and results["kept"] < 30.0, results


def floored_log(floor_op: str) -> onnx.ModelProto:
    """A log-mel's last steps: power [1, 8, 256] -> a floor of 1e-10 (``floor_op``: Clip's min,
    Max or Add with it, or none) -> Log -> / ln 10."""
    nodes = []
    source = "p"
    if floor_op:
        nodes.append(oh.make_node(floor_op, ["p", "eps"], ["floored"]))
        source = "floored"
    nodes += [oh.make_node("Log", [source], ["l"]), oh.make_node("Div", ["l", "ln10"], ["y"])]
    graph = oh.make_graph(
        nodes,
        "floored_log",
        [oh.make_tensor_value_info("p", TensorProto.FLOAT, [1, 8, 256])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 256])],
        [
            numpy_helper.from_array(np.array(1e-10, np.float32), "eps"),
            numpy_helper.from_array(np.array(np.log(10.0), np.float32), "ln10"),
        ],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


def silent_power(seed: int) -> np.ndarray:
    """A power spectrum with silent frames (exact zeros) and quiet bins down to 1e-7."""
    rng = np.random.default_rng(seed)
    power = (10.0 ** rng.uniform(-7, 2, (1, 8, 256))).astype(np.float32)
    power[..., 128:] = 0.0  # padding, as whisper pads to 30 s
    return power


@pytest.mark.parametrize("floor_op", ["Clip", "Max", "Add"])
def test_a_floor_under_fp16s_smallest_value_gives_its_own_log(floor_op: str) -> None:
    """Where fp16 holds only 0 the Log gives log(floor), as float32 does; elsewhere its own."""
    model = floored_log(floor_op)
    finite, change = finite_float16_logs(model)
    assert change.changed and "1e-10" in change.details[0]
    power = silent_power(1)
    power[0, 0, :4] = [2.0**-24, 2.0**-23, 1.0, 3e-8]  # at the edge, and one fp16 cannot hold
    before, after = (
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"p": power}
        )[0]
        for m in (model, finite)
    )
    held = power >= 2.0**-24
    np.testing.assert_allclose(after[held], before[held], rtol=1e-6)
    np.testing.assert_allclose(after[power == 0], -10.0, rtol=1e-6)
    assert not finite_float16_logs(finite)[1].changed  # its own Max(x, 2^-24) is a floor fp16 holds


def test_a_floor_fp16_holds_is_left_alone_and_a_bare_log_is_kept_finite() -> None:
    model = floored_log("Clip")
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.array(1e-4, np.float32), "eps"))
    same, change = finite_float16_logs(model)
    assert not change.changed and same is model
    bare, change = finite_float16_logs(floored_log(""))
    assert change.changed and "Max(x, 2^-24)" in change.details[0]
    power = silent_power(4)
    (got,) = ort.InferenceSession(bare.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"p": power}
    )
    np.testing.assert_allclose(got[power == 0], -24 * np.log10(2.0), rtol=1e-6)
    held = power >= 2.0**-24
    np.testing.assert_allclose(got[held], np.log10(power[held]), rtol=1e-5)


def test_the_htp_gives_a_silent_frame_its_floor(tmp_path: Path) -> None:
    """Measured: the HTP's fp16 Log of 0 is -7.625, so clamp(min=1e-10) -> log10 turned every
    silent frame into -3.3 instead of -10 (a whisper log-mel: -2.0 dB whole fp16)."""
    from compile_fixtures import whole_ctx_vs_float

    model = floored_log("Clip")
    finite, _ = finite_float16_logs(model)
    samples = [{"p": silent_power(seed)} for seed in (2, 3)]
    results = whole_ctx_vs_float(tmp_path, {"float": model, "finite": finite}, samples)
    assert results["finite"] > 50.0, results
    assert results["float"] < 20.0, results


def mel_floor_log(with_max: bool = False) -> onnx.ModelProto:
    """A Kaldi fbank's end: power [1, 100, 64] -> mel MatMul -> Clip(float32 eps) -> Log."""
    weights = np.abs(np.random.default_rng(5).normal(0, 0.1, (64, 32))).astype(np.float32)
    clip_inputs = ["mel", "eps", "top"] if with_max else ["mel", "eps"]
    graph = oh.make_graph(
        [
            oh.make_node("MatMul", ["p", "w"], ["mel"]),
            oh.make_node("Clip", clip_inputs, ["floored"], name="floor"),
            oh.make_node("Log", ["floored"], ["y"]),
        ],
        "mel_floor_log",
        [oh.make_tensor_value_info("p", TensorProto.FLOAT, [1, 100, 64])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 100, 32])],
        [
            numpy_helper.from_array(weights, "w"),
            numpy_helper.from_array(np.array(np.finfo(np.float32).eps, np.float32), "eps"),
            numpy_helper.from_array(np.array(50.0, np.float32), "top"),
        ],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


def quiet_power(seed: int) -> np.ndarray:
    """Frames from silence to speech: mel powers from under 1e-7 to ~1e-2."""
    rng = np.random.default_rng(seed)
    power = 10.0 ** rng.uniform(-10, -4, (1, 100, 64)) * 10.0 ** rng.uniform(-3, 2, (1, 100, 1))
    return power.astype(np.float32)


@pytest.mark.parametrize("with_max", [False, True])
def test_a_clip_floor_in_fp16s_subnormals_becomes_max(with_max: bool) -> None:
    model = mel_floor_log(with_max)
    floored, change = max_for_small_clip_floors(model)
    assert change.changed and "Clip 'floor'" in change.details[0]
    assert "Clip" not in [n.op_type for n in floored.graph.node]
    power = quiet_power(1)
    power[0, :3] *= 1e6  # mels over the Clip's max too
    before, after = (
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"p": power}
        )[0]
        for m in (model, floored)
    )
    np.testing.assert_array_equal(after, before)
    normal = mel_floor_log()
    normal.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.array(1e-4, "f4"), "eps"))
    assert not max_for_small_clip_floors(normal)[1].changed


def test_the_htp_floors_a_fused_clip_wrong_and_a_max_right(tmp_path: Path) -> None:
    """Measured: the HTP fuses the Clip into the MatMul in fp16 and floors at ~3e-5 there."""
    from compile_fixtures import whole_ctx_vs_float

    model = mel_floor_log()
    floored, _ = max_for_small_clip_floors(model)
    samples = [{"p": quiet_power(seed)} for seed in (2, 3)]
    results = whole_ctx_vs_float(tmp_path, {"float": model, "floored": floored}, samples)
    assert results["floored"] > results["float"] + 10.0, results


def tiny_weights_net(scale: float) -> onnx.ModelProto:
    """Conv (weights ~ ``scale``, fed raw 0..255 pixels) -> Relu -> Conv: a first layer's
    folded weights in fp16's subnormals."""
    rng = np.random.default_rng(4)
    w1 = (rng.standard_normal((16, 3, 3, 3)) * scale).astype(np.float32)
    b1 = (rng.standard_normal(16) * 1e-3).astype(np.float32)
    w2 = (rng.standard_normal((8, 16, 3, 3)) * 0.3).astype(np.float32)
    nodes = [
        oh.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="first"),
        oh.make_node("Relu", ["c1"], ["r1"]),
        oh.make_node("Conv", ["r1", "w2"], ["y"], pads=[1, 1, 1, 1]),
    ]
    graph = oh.make_graph(
        nodes,
        "tiny",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 32])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 32, 32])],
        [numpy_helper.from_array(v, k) for k, v in {"w1": w1, "b1": b1, "w2": w2}.items()],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


def test_subnormal_conv_weights_are_lifted_and_computed_the_same() -> None:
    model = tiny_weights_net(1e-6)
    lifted, change = normal_float16_weights(model, {"x": 255.0})
    assert len(change.details) == 1 and "'first'" in change.details[0], change.details
    weights = {i.name: numpy_helper.to_array(i) for i in lifted.graph.initializer}
    first = next(n for n in lifted.graph.node if n.name == "first")
    assert np.abs(weights[first.input[1]]).max() > 2.0**-14  # out of the subnormals
    x = np.random.default_rng(1).uniform(0, 255, (1, 3, 32, 32)).astype(np.float32)
    (before,), (after,) = (
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"x": x}
        )
        for m in (model, lifted)
    )
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-9)
    # Weights fp16 holds, or no calibrated peak for the input: left alone.
    assert not normal_float16_weights(tiny_weights_net(0.1), {"x": 255.0})[1].changed
    assert not normal_float16_weights(model, {})[1].changed


def test_only_channels_whose_subnormal_weights_matter_are_lifted() -> None:
    """A few subnormal taps in a channel of normal weights carry nothing fp16 would miss: that
    channel keeps its weights (and no Mul back after it); a channel all subnormal is lifted."""
    model = tiny_weights_net(0.1)
    weights = next(i for i in model.graph.initializer if i.name == "w1")
    w = numpy_helper.to_array(weights).copy()
    w[:, 0, 0, 0] = 1e-6  # a subnormal tap in every channel, ~1e-5 of its L1 norm
    w[3] *= 1e-5  # channel 3: every weight subnormal
    weights.CopyFrom(numpy_helper.from_array(w, "w1"))
    lifted, change = normal_float16_weights(model, {"x": 255.0})
    assert list(change.details) == ["Conv 'first': 1 of 16 output channel(s) scaled by up to "
                                    "2^14 out of fp16's subnormals"], change.details  # fmt: skip
    back = next(i for i in lifted.graph.initializer if "unscale" in i.name)
    gains = 1.0 / numpy_helper.to_array(back).reshape(-1)
    assert gains[3] > 1.0 and np.all(np.delete(gains, 3) == 1.0)


def test_a_huge_input_bounds_the_lift() -> None:
    """The output's hard bound (weights' L1 norm x input peak + bias) stays under fp16's half."""
    model = tiny_weights_net(1e-6)
    lifted, _ = normal_float16_weights(model, {"x": 255.0})
    limited, _ = normal_float16_weights(model, {"x": 1e8})
    gains = [
        max(
            1.0 / numpy_helper.to_array(i).min() for i in m.graph.initializer if "unscale" in i.name
        )
        for m in (lifted, limited)
    ]
    assert gains[1] < gains[0]


def test_an_input_that_stays_at_zero_lifts_quietly() -> None:
    """A Conv whose calibrated input peak is 0 and whose bias is 0 bounds its output at 0: the
    lift is the weights' own, with no float32 overflow warning on the console (a PP-OCRv4
    recogniser's build printed one)."""
    model = tiny_weights_net(1e-6)
    bias = next(i for i in model.graph.initializer if i.name == "b1")
    bias.CopyFrom(numpy_helper.from_array(np.zeros(16, np.float32), "b1"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, change = normal_float16_weights(model, {"x": 0.0})
    assert change.changed


@pytest.mark.qnn
def test_the_htp_computes_lifted_weights_right(tmp_path: Path) -> None:
    """Measured: weights ~1e-6 fed 0..255 pixels came out 38 dB from float in fp16 on the HTP
    (it flushes fp16 subnormals); lifted, 67 dB."""
    from compile_fixtures import whole_ctx_vs_float

    model = tiny_weights_net(1e-6)
    lifted, _ = normal_float16_weights(model, {"x": 255.0})
    rng = np.random.default_rng(2)
    samples = [{"x": rng.uniform(0, 255, (1, 3, 32, 32)).astype(np.float32)} for _ in range(2)]
    results = whole_ctx_vs_float(tmp_path, {"float": model, "lifted": lifted}, samples)
    assert results["lifted"] > 60.0, results
    # If a new QNN SDK keeps fp16 subnormals, this says so: the rule is then only harmless.
    assert results["float"] < results["lifted"] - 15.0, results


def unary_model(op_type: str) -> onnx.ModelProto:
    """x -> ``op_type`` -> y, over 4096 values."""
    graph = oh.make_graph(
        [oh.make_node(op_type, ["x"], ["y"])],
        op_type.lower(),
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4096])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4096])],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


def asin_model() -> onnx.ModelProto:
    """x in [-1, 1] -> Asin -> y."""
    return unary_model("Asin")


def test_asin_is_computed_from_atan_and_the_same() -> None:
    model = asin_model()
    rewritten, change = asins_from_atan(model)
    assert change.changed and "Asin" not in {n.op_type for n in rewritten.graph.node}
    x = np.linspace(-1, 1, 4096, dtype=np.float32).reshape(1, -1)  # both ends included
    np.testing.assert_allclose(cpu_outputs(rewritten, x), cpu_outputs(model, x), atol=3e-7)


@pytest.mark.qnn
def test_the_htp_runs_asin_whole_in_fp16_from_atan(tmp_path: Path) -> None:
    """Measured: the fp16 Asin stays on the CPU (no partition); from Atan it runs whole, and
    the half-angle form keeps x = +-1 finite (atan(x / sqrt(1 - x^2)) there: -72.5 dB)."""
    from compile_fixtures import whole_ctx_vs_float

    rewritten, _ = asins_from_atan(asin_model())
    x = np.linspace(-1, 1, 4096, dtype=np.float32).reshape(1, -1)
    models = {"float": rewritten}  # the reference is computed on the CPU from the same form
    results = whole_ctx_vs_float(tmp_path, models, [{"x": x}])
    assert results["float"] > 50.0, results


def log_softmax_model(shape: list[int], axis: int) -> onnx.ModelProto:
    graph = oh.make_graph(
        [oh.make_node("LogSoftmax", ["x"], ["y"], axis=axis)],
        "log_softmax",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize(("shape", "axis"), [([1, 50, 129], -1), ([1, 65, 4, 4], 1), ([3, 7], 0)])
def test_a_log_softmax_is_written_out_from_its_max_and_the_same(
    shape: list[int], axis: int
) -> None:
    model = log_softmax_model(shape, axis)
    rewritten, change = log_softmaxes_written_out(model)
    assert change.changed and f"axis {axis}" in change.details[0]
    assert "LogSoftmax" not in {n.op_type for n in rewritten.graph.node}
    x = (RNG.standard_normal(shape) * 10).astype(np.float32)
    np.testing.assert_allclose(cpu_outputs(rewritten, x), cpu_outputs(model, x), atol=2e-5)
    assert "LogSoftmax" not in {n.op_type for n in exact_float16_forms(model)[0].graph.node}


@pytest.mark.qnn
def test_the_htp_computes_a_log_softmax_over_64k_plus_1_values_right_written_out(
    tmp_path: Path,
) -> None:
    """Measured on the simulator (fp16): a CTC head's log_softmax over 128 tokens and a blank
    is garbage as the HTP's own op, right written out."""
    from compile_fixtures import whole_ctx_vs_float

    model = log_softmax_model([1, 64, 129], -1)
    models = {"float": model, "written": log_softmaxes_written_out(model)[0]}
    x = (np.random.default_rng(0).standard_normal((1, 64, 129)) * 3).astype(np.float32)
    results = whole_ctx_vs_float(tmp_path, models, [{"x": x}])
    assert results["float"] < 40.0 and results["written"] > 60.0, results  # 66 dB at 128


def pool_model(op: str, kernel: int, stride: int, size: int = 33, **attrs) -> onnx.ModelProto:
    node = oh.make_node(op, ["x"], ["y"], kernel_shape=[kernel, kernel], strides=[stride] * 2,
                        **attrs)  # fmt: skip
    graph = oh.make_graph(
        [node],
        "pool",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, size, size])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32, "h", "w"])],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize(
    ("op", "kernel", "stride", "attrs"),
    [("MaxPool", 7, 2, {}), ("MaxPool", 8, 2, {"pads": [3, 2, 4, 1], "ceil_mode": 1}),
     ("AveragePool", 9, 3, {}), ("AveragePool", 9, 2, {"pads": [4, 4, 4, 4]}),
     ("AveragePool", 17, 2, {"pads": [8, 8, 8, 8], "count_include_pad": 1}),
     ("MaxPool", 9, 2, {"dilations": [2, 1], "pads": [2, 2, 2, 2]})],
)  # fmt: skip
def test_a_large_strided_pool_is_two_passes_and_the_same(
    op: str, kernel: int, stride: int, attrs: dict
) -> None:
    model = pool_model(op, kernel, stride, **attrs)
    rewritten, change = separable_float16_pools(model)
    assert change.changed and [n.op_type for n in rewritten.graph.node] == [op, op]
    x = (RNG.standard_normal((1, 32, 33, 33)) * 3).astype(np.float32)
    np.testing.assert_allclose(cpu_outputs(rewritten, x), cpu_outputs(model, x), atol=2e-6)
    for kept in (pool_model(op, 5, 2), pool_model(op, 9, 1), pool_model("MaxPool", 3, 3)):
        assert not separable_float16_pools(kept)[1].changed


@pytest.mark.qnn
def test_the_htp_computes_large_strided_pools_right_in_two_passes(tmp_path: Path) -> None:
    """Measured on the simulator (fp16): MaxPool 7x7 at stride 2 reads ~25 dB against the
    CPU and AveragePool 9x9 at stride 2 ~12 dB; in two passes both are right."""
    from compile_fixtures import whole_ctx_vs_float

    x = np.random.default_rng(3).standard_normal((1, 32, 33, 33)).astype(np.float32)
    for op, kernel in (("MaxPool", 7), ("AveragePool", 9)):
        model = pool_model(op, kernel, 2)
        models = {"float": model, "passes": separable_float16_pools(model)[0]}
        (tmp_path / op).mkdir()
        results = whole_ctx_vs_float(tmp_path / op, models, [{"x": x}])
        assert results["float"] < 35.0 and results["passes"] > 60.0, (op, results)


def resize_model(
    width: int, wide: int, mode: str = "linear", transform: str = "asymmetric"
) -> onnx.ModelProto:
    """x [1, 32, 8, width] -> Resize to [1, 32, 16, wide] (sizes)."""
    graph = oh.make_graph(
        [
            oh.make_node(
                "Resize",
                ["x", "", "", "sizes"],
                ["y"],
                mode=mode,
                coordinate_transformation_mode=transform,
            )
        ],
        "resize",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 8, width])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32, 16, wide])],
        [numpy_helper.from_array(np.array([1, 32, 16, wide], np.int64), "sizes")],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize(("width", "wide"), [(33, 66), (17, 68), (65, 130)])
def test_an_asymmetric_resize_of_16k_plus_1_columns_is_padded_and_the_same(
    width: int, wide: int
) -> None:
    model = resize_model(width, wide)
    rewritten, change = padded_float16_resizes(model)
    assert change.changed and f"{width} columns" in change.details[0]
    x = RNG.standard_normal((1, 32, 8, width)).astype(np.float32)
    np.testing.assert_allclose(cpu_outputs(rewritten, x), cpu_outputs(model, x), atol=1e-6)
    for kept in (resize_model(25, 50), resize_model(33, 65), resize_model(33, 66, "linear",
                 "half_pixel"), resize_model(33, 66, "nearest")):  # fmt: skip
        assert not padded_float16_resizes(kept)[1].changed


@pytest.mark.qnn
def test_the_htp_resizes_16k_plus_1_columns_right_padded(tmp_path: Path) -> None:
    """Measured on the simulator (fp16): a linear asymmetric x2 from 33 columns reads ~7-20 dB
    against the CPU; from 34 columns, the extra ones cut off, it is right."""
    from compile_fixtures import whole_ctx_vs_float

    model = resize_model(33, 66)
    models = {"float": model, "padded": padded_float16_resizes(model)[0]}
    x = np.random.default_rng(3).standard_normal((1, 32, 8, 33)).astype(np.float32)
    results = whole_ctx_vs_float(tmp_path, models, [{"x": x}])
    assert results["float"] < 35.0 and results["padded"] > 55.0, results


# --- norms whose squares overflow fp16 ---------------------------------------------------------

WIDTH = 64


def norm_block(form: str) -> onnx.ModelProto:
    """x [1, 8, WIDTH] -> a norm over the last axis -> MatMul. ``form``: "rms" is T5's
    x * (1 / sqrt(mean(x * x) + eps)) * w; "layer" a layer norm written out, (x - mean) /
    sqrt(mean((x - mean) ** 2) + eps)."""
    w = (RNG.uniform(0.5, 1.5, WIDTH)).astype(np.float32)
    proj = (RNG.standard_normal((WIDTH, 16)) / np.sqrt(WIDTH)).astype(np.float32)
    inits = [
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(proj, "proj"),
        numpy_helper.from_array(np.array(1e-6, np.float32), "eps"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        numpy_helper.from_array(np.array(2.0, np.float32), "two"),
        numpy_helper.from_array(np.array([-1], np.int64), "last"),
    ]
    if form == "rms":
        nodes = [
            oh.make_node("Mul", ["x", "x"], ["sq"]),
            oh.make_node("ReduceMean", ["sq", "last"], ["ms"], keepdims=1),
            oh.make_node("Add", ["ms", "eps"], ["v"]),
            oh.make_node("Sqrt", ["v"], ["root"]),
            oh.make_node("Div", ["one", "root"], ["inv"]),
            oh.make_node("Mul", ["x", "inv"], ["normed"]),
        ]
    else:
        nodes = [
            oh.make_node("ReduceMean", ["x", "last"], ["mu"], keepdims=1),
            oh.make_node("Sub", ["x", "mu"], ["d"]),
            oh.make_node("Pow", ["d", "two"], ["sq"]),
            oh.make_node("ReduceMean", ["sq", "last"], ["ms"], keepdims=1),
            oh.make_node("Add", ["ms", "eps"], ["v"]),
            oh.make_node("Sqrt", ["v"], ["root"]),
            oh.make_node("Div", ["d", "root"], ["normed"]),
        ]
    nodes += [
        oh.make_node("Mul", ["normed", "w"], ["scaled"]),
        oh.make_node("MatMul", ["scaled", "proj"], ["y"]),
    ]
    graph = oh.make_graph(
        nodes,
        "norm",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, WIDTH])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16])],
        inits,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def outlier_rows(count: int) -> list[np.ndarray]:
    """Rows of ~1 with one channel near 3000 (a residual stream's outlier): squares near 1e7."""
    rows = []
    for _ in range(count):
        x = RNG.standard_normal((1, 8, WIDTH)).astype(np.float32)
        x[..., 5] = RNG.uniform(2000, 3000, (1, 8))
        rows.append(x)
    return rows


@pytest.mark.parametrize("form", ["rms", "layer"])
def test_a_norm_whose_squares_overflow_fp16_is_computed_over_the_row_maximum(form: str) -> None:
    model = norm_block(form)
    squared = "x" if form == "rms" else "d"
    rewritten, change = float16_safe_norms(model, {squared: 3000.0})
    assert change.changed and "root mean square" in change.details[0]
    ops = [n.op_type for n in rewritten.graph.node]
    assert "ReduceMax" in ops and "Abs" in ops
    for x in [*outlier_rows(3), np.zeros((1, 8, WIDTH), np.float32)]:
        np.testing.assert_allclose(
            cpu_outputs(rewritten, x), cpu_outputs(model, x), rtol=1e-4, atol=1e-5
        )
    assert not float16_safe_norms(model, {squared: 50.0})[1].changed  # 2500 fits fp16


@pytest.mark.qnn
def test_the_htp_runs_a_norm_of_large_values_in_fp16(tmp_path: Path) -> None:
    """Measured: whole in fp16 the squares overflow (the row's outlier alone squares to 9e6)
    and the output is garbage; over the row maximum it agrees with float."""
    from compile_fixtures import whole_ctx_vs_float

    model = norm_block("rms")
    rewritten, _ = float16_safe_norms(model, {"x": 3000.0})
    results = whole_ctx_vs_float(
        tmp_path, {"float": model, "rewritten": rewritten}, [{"x": x} for x in outlier_rows(2)]
    )
    assert results["float"] < 10.0, results
    assert results["rewritten"] > 40.0, results


VOCAB = 40


def _rms(x: str, out: str, gain: str) -> list[onnx.NodeProto]:
    """T5's RMS norm as preparation leaves it (``rewrite_for_htp``: its Pow of 2 a Mul):
    x * 1 / sqrt(mean(x * x) + eps) * gain."""
    return [
        oh.make_node("Mul", [x, x], [f"{out}_sq"]),
        oh.make_node("ReduceMean", [f"{out}_sq", "last"], [f"{out}_ms"], keepdims=1),
        oh.make_node("Add", [f"{out}_ms", "eps"], [f"{out}_v"]),
        oh.make_node("Sqrt", [f"{out}_v"], [f"{out}_root"]),
        oh.make_node("Div", ["one", f"{out}_root"], [f"{out}_inv"]),
        oh.make_node("Mul", [x, f"{out}_inv"], [f"{out}_n"]),
        oh.make_node("Mul", [f"{out}_n", gain], [out]),
    ]


def residual_block(read_by_softmax: bool = False, final: str = "rms") -> onnx.ModelProto:
    """A T5-like encoder layer: token embeddings with one outlier channel near 5e4, an FFN
    branch (norm, wi, Relu, wo) that adds more to it, the stream past fp16's 65504, then
    the final norm and a projection. The embedding table is read by a tied output head too
    (scaled down: its logits fit fp16)."""
    rng = np.random.default_rng(23)  # its own: the same block whatever ran before
    table = rng.standard_normal((VOCAB, WIDTH)).astype(np.float32)
    table[:, 5] = rng.uniform(4e4, 5e4, VOCAB)
    wi = (rng.standard_normal((WIDTH, 96)) / np.sqrt(WIDTH)).astype(np.float32)
    wo = (rng.standard_normal((96, WIDTH)) / np.sqrt(96)).astype(np.float32)
    wo[:, 5] = np.abs(wo[:, 5]) * 3e4
    inits = [
        numpy_helper.from_array(table, "table"),
        numpy_helper.from_array(wi, "wi"),
        numpy_helper.from_array(wo, "wo"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, WIDTH).astype(np.float32), "g1"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, WIDTH).astype(np.float32), "g2"),
        numpy_helper.from_array(np.array(1e-6, np.float32), "eps"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        numpy_helper.from_array(np.array([-1], np.int64), "last"),
        numpy_helper.from_array(np.array(1e-4, np.float32), "head_scale"),
        numpy_helper.from_array(np.zeros(WIDTH, np.float32), "b2"),
    ]
    nodes = [
        oh.make_node("Gather", ["table", "ids"], ["h0"]),
        *_rms("h0", "n1", "g1"),
        oh.make_node("MatMul", ["n1", "wi"], ["hid"]),
        oh.make_node("Relu", ["hid"], ["act"]),
        oh.make_node("MatMul", ["act", "wo"], ["ffn"]),
        oh.make_node("Add", ["h0", "ffn"], ["h1"]),
        *(
            _rms("h1", "n2", "g2")
            if final == "rms"
            else [oh.make_node("LayerNormalization", ["h1", "g2", "b2"], ["n2"], epsilon=1e-6)]
        ),
        oh.make_node("Transpose", ["table"], ["tied"], perm=[1, 0]),
        oh.make_node("Mul", ["tied", "head_scale"], ["head"]),
        oh.make_node("MatMul", ["n2", "head"], ["y"]),
    ]
    if read_by_softmax:
        nodes.append(oh.make_node("Softmax", ["h1"], ["p"], axis=-1))
    outputs = [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, VOCAB])]
    if read_by_softmax:
        outputs.append(oh.make_tensor_value_info("p", TensorProto.FLOAT, [1, 8, WIDTH]))
    graph = oh.make_graph(
        nodes,
        "t5ish",
        [oh.make_tensor_value_info("ids", TensorProto.INT64, [1, 8])],
        outputs,
        inits,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def _stream_peaks(model: onnx.ModelProto, ids: list[np.ndarray]) -> dict[str, float]:
    """Every float tensor's max |value| over ``ids`` (the calibrated peaks, as the build has)."""
    names = [n.output[0] for n in model.graph.node]
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(oh.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names)
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    peaks: dict[str, float] = {}
    for sample in ids:
        for name, value in zip(names, session.run(names, {"ids": sample}), strict=True):
            peaks[name] = max(peaks.get(name, 0.0), float(np.abs(value).max()))
    return peaks


def token_ids(count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(29)
    return [rng.integers(0, VOCAB, (1, 8)).astype(np.int64) for _ in range(count)]


@pytest.mark.parametrize("final", ["rms", "layer"])
def test_a_residual_stream_past_fp16_is_scaled_by_its_constants_and_computes_the_same(
    final: str,
) -> None:
    """The stream (h0, ffn, h1) times 2^-k with the table read by the Gather, wo and the two
    norms' eps scaled (an RMS norm's operand, a LayerNormalization's attribute); the tied head
    still reads the table as it was. The same outputs in float32, and every stream tensor
    under fp16's target."""
    model = residual_block(final=final)
    ids = token_ids(4)
    peaks = _stream_peaks(model, ids)
    assert peaks["h1"] > 65504.0
    rewritten, change, factors = float16_residual_streams(model, peaks)
    assert change.changed and "times 2^-" in change.details[0], change
    assert set(factors) >= {"h0", "ffn", "h1"} and "y" not in factors and "n2" not in factors
    assert all(peaks[t] * factors[t] <= FLOAT16_TARGET for t in ("h0", "ffn", "h1"))
    if final == "rms":
        assert factors["n2_sq"] == factors["h1"] ** 2
    else:
        norm = next(n for n in rewritten.graph.node if n.op_type == "LayerNormalization")
        assert oh.get_attribute_value(norm.attribute[0]) == pytest.approx(1e-6 * factors["h1"] ** 2)
    head = next(n for n in rewritten.graph.node if n.op_type == "Transpose")
    assert head.input[0] == "table"  # the tied head reads the unscaled table
    for sample in ids:
        before = _run_ids(model, sample)
        after = _run_ids(rewritten, sample)
        np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-4 * np.abs(before).max())


def _run_ids(model: onnx.ModelProto, ids: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["y"], {"ids": ids})[0]


def test_a_stream_read_by_anything_but_sums_and_norms_is_left_alone() -> None:
    """A Softmax of the stream is not scale-free: no exact scaling exists, nothing changes."""
    model = residual_block(read_by_softmax=True)
    peaks = _stream_peaks(model, token_ids(2))
    _, change, factors = float16_residual_streams(model, peaks)
    assert not change.changed and not factors


@pytest.mark.qnn
def test_the_htp_runs_a_scaled_residual_stream_in_fp16(tmp_path: Path) -> None:
    """Measured: whole in fp16 the stream overflows to inf and the output is lost; with only
    its norms over the row maximum it still is; scaled (and those norms) it agrees with float."""
    from compile_fixtures import whole_ctx_vs_float

    model = residual_block()
    ids = token_ids(4)
    peaks = _stream_peaks(model, ids)
    norms_only, _ = float16_safe_norms(model, peaks)
    scaled, _, factors = float16_residual_streams(model, peaks)
    scaled, _ = float16_safe_norms(scaled, {t: p * factors.get(t, 1.0) for t, p in peaks.items()})
    results = whole_ctx_vs_float(
        tmp_path,
        {"float": model, "norms_only": norms_only, "scaled": scaled},
        [{"ids": sample} for sample in ids[:2]],
    )
    assert results["float"] < 10.0, results
    assert results["norms_only"] < 10.0, results
    assert results["scaled"] > 40.0, results


def test_fit_float16_scales_through_a_mask_that_fills_with_a_constant() -> None:
    """A Where zeroing the samples past a clip's length (NeMo's preprocessor) is homogeneous:
    the fill is scaled with the samples; the same function. (Last in this file: it draws from
    the module's generator, which the tests above share.)"""
    model = log_power("Where")
    samples = audio(6)
    peaks = peaks_of(model, samples)
    fitted, change = fit_float16(model, peaks)
    assert fitted is not None and "input 'x' scaled by 2^-" in change.details[0], change.details
    for x in samples:
        got, want = every_tensor(fitted, x), every_tensor(model, x)
        np.testing.assert_allclose(got["db"], want["db"], rtol=1e-5, atol=1e-4)


def linear_attention() -> onnx.ModelProto:
    """EfficientViT's LiteMLA over 256 tokens of 16 channels, after a HardSwish (so no input
    scale reaches it): q, k = ReLU(x W), v padded with a column of ones, q (K^T [V 1]), its
    last column the denominator (+ eps). The sums over the tokens pass fp16's 65504 while
    every input of them and their ratio are small."""
    rng = np.random.default_rng(4)
    weights = {n: rng.normal(0, 1.0, (16, 8)).astype(np.float32) for n in ("wq", "wk", "wv")}
    nodes = [
        oh.make_node("HardSwish", ["x"], ["h"]),
        oh.make_node("Transpose", ["h"], ["tokens"], perm=[0, 2, 1]),
        oh.make_node("MatMul", ["tokens", "wq"], ["q_lin"]),
        oh.make_node("Relu", ["q_lin"], ["q"]),
        oh.make_node("MatMul", ["tokens", "wk"], ["k_lin"]),
        oh.make_node("Relu", ["k_lin"], ["k"]),
        oh.make_node("MatMul", ["tokens", "wv"], ["v"]),
        oh.make_node("Pad", ["v", "pads", "one"], ["v1"]),
        oh.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        oh.make_node("MatMul", ["kt", "v1"], ["kv"]),
        oh.make_node("MatMul", ["q", "kv"], ["qkv"]),
        oh.make_node("Slice", ["qkv", "start", "last", "axis"], ["num"]),
        oh.make_node("Slice", ["qkv", "last", "end", "axis"], ["den"]),
        oh.make_node("Add", ["den", "eps"], ["den_eps"]),
        oh.make_node("Div", ["num", "den_eps"], ["y"]),
    ]
    constants = {
        **weights,
        "pads": np.array([0, 0, 0, 0, 0, 1], np.int64),
        "one": np.array(1.0, np.float32),
        "start": np.array([0], np.int64),
        "last": np.array([8], np.int64),
        "end": np.array([9], np.int64),
        "axis": np.array([2], np.int64),
        "eps": np.array(1e-5, np.float32),
    }
    graph = oh.make_graph(
        nodes,
        "lite_mla",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 256])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 256, 8])],
        [numpy_helper.from_array(value, name) for name, value in constants.items()],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


def attention_inputs(count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    return [rng.normal(0, 3.0, (1, 16, 256)).astype(np.float32) for _ in range(count)]


def test_fit_float16_scales_inside_where_no_input_can() -> None:
    """The sums overflow fp16 (checked); no input scale passes the HardSwish, so tensors before
    them are scaled instead (the ratio cancels it): the same outputs in float32, every tensor
    under the target, no scaled tensor pushed under fp16's normals."""
    model = linear_attention()
    samples = attention_inputs(4)
    peaks = peaks_of(model, samples)
    assert peaks["qkv"] > 65504 and peaks["y"] < 100, peaks
    fitted, change = fit_float16(model, peaks)
    assert fitted is not None, change.details
    assert all(d.startswith("tensor '") for d in change.details), change.details
    for x in samples:
        got, want = every_tensor(fitted, x), every_tensor(model, x)
        np.testing.assert_allclose(got["y"], want["y"], rtol=1e-5, atol=1e-6)
        inner = {n: float(np.abs(v).max()) for n, v in got.items() if n != "x"}
        assert max(inner.values()) <= FLOAT16_TARGET, inner
        assert min(p for n, p in inner.items() if n.endswith("_scaled")) >= 2.0**-4


@pytest.mark.qnn
def test_the_htp_runs_a_linear_attention_scaled_inside_in_fp16(tmp_path: Path) -> None:
    """Measured: as it is, the fp16 ctx overflows in the sums (~0 dB vs float); scaled
    inside, it agrees."""
    from compile_fixtures import whole_ctx_vs_float

    model = linear_attention()
    samples = attention_inputs(3)
    fitted, _ = fit_float16(model, peaks_of(model, samples))
    assert fitted is not None
    results = whole_ctx_vs_float(
        tmp_path, {"float": model, "fitted": fitted}, [{"x": x} for x in samples]
    )
    assert results["float"] < 10.0, results
    assert results["fitted"] > 40.0, results


def fractions_model() -> onnx.ModelProto:
    """x -> x - Round(x): a phase or position's fractional part, over 4096 values."""
    graph = oh.make_graph(
        [oh.make_node("Round", ["x"], ["whole"]), oh.make_node("Sub", ["x", "whole"], ["y"])],
        "fractions",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4096])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4096])],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


def _float16_values(low: float, high: float, count: int) -> np.ndarray:
    """``count`` values of [low, high) that fp16 holds exactly (ties of .5 among them)."""
    return (RNG.uniform(low, high, (1, count)) * 4).round().astype(np.float16).astype(
        np.float32
    ) / 4


def test_rounds_keep_what_fp16_holds_as_integers_and_are_the_same() -> None:
    model = fractions_model()
    rewritten, change = rounds_of_float16_integers(model)
    assert change.changed and "Round" in {n.op_type for n in rewritten.graph.node}
    x = _float16_values(-3000, 3000, 4096)
    x[0, :4] = [2.5, -2.5, 1023.5, -1023.5]  # ties still go to the even neighbour
    np.testing.assert_array_equal(cpu_outputs(rewritten, x), cpu_outputs(model, x))
    assert rounds_of_float16_integers(asin_model())[1].changed is False


@pytest.mark.qnn
def test_the_htp_rounds_fp16_integers_to_themselves_with_the_rule(tmp_path: Path) -> None:
    """Measured: the HTP's fp16 Round adds one from 1024 on, so x - round(x) reads -1 there
    where it is 0; with the rule it agrees with the CPU."""
    from compile_fixtures import whole_ctx_vs_float

    model = fractions_model()
    x = _float16_values(-2048, 2048, 4096)
    models = {"float": model, "rewritten": rounds_of_float16_integers(model)[0]}
    results = whole_ctx_vs_float(tmp_path, models, [{"x": x}])
    assert results["rewritten"] > 50.0, results
    # If a new QNN SDK rounds fp16 integers right, this says so: the rule is then only harmless.
    assert results["float"] < 10.0, results


def _signed_decades(top: float) -> np.ndarray:
    """4096 fp16 values from 0.5 to ``top`` (infinity past fp16's largest), signs alternating."""
    x = np.geomspace(0.5, top, 4096).astype(np.float16).astype(np.float32).reshape(1, -1)
    x[0, ::2] *= -1
    return x


def test_an_atan_is_bounded_where_it_is_pi_over_2_already() -> None:
    model = unary_model("Atan")
    rewritten, change = bounded_float16_atans(model)
    assert change.changed
    x = _signed_decades(1e6)
    x[0, -2:] = [np.inf, -np.inf]
    np.testing.assert_allclose(cpu_outputs(rewritten, x), cpu_outputs(model, x), atol=3.1e-5)
    below = _signed_decades(32768.0)
    np.testing.assert_array_equal(cpu_outputs(rewritten, below), cpu_outputs(model, below))
    # the form's Asin from Atan reads ratios in [-1, 1]: no bound there
    formed, changes = exact_float16_forms(asin_model())
    assert not next(c for c in changes if c.step == "bounded_float16_atans").changed
    assert "Clip" not in {n.op_type for n in formed.graph.node}


@pytest.mark.qnn
def test_the_htp_takes_fp16_atans_of_large_values_right_bounded(tmp_path: Path) -> None:
    """Measured: the HTP's fp16 Atan returns +-131008 past |x| = 32768; bounded, pi/2."""
    from compile_fixtures import whole_ctx_vs_float

    model = unary_model("Atan")
    models = {"float": model, "bounded": bounded_float16_atans(model)[0]}
    results = whole_ctx_vs_float(tmp_path, models, [{"x": _signed_decades(65504.0)}])
    assert results["bounded"] > 50.0, results
    # If a new QNN SDK takes such Atans right, this says so: the rule is then only harmless.
    assert results["float"] < 0.0, results


def overlap_shares() -> onnx.ModelProto:
    """Boxes' widths and heights in pixels [1, 4096] -> the share of each box's area that a
    100 x 150 box at the same centre covers: intersection / area, per box."""
    graph = oh.make_graph(
        [
            oh.make_node("Mul", ["w", "h"], ["area"]),
            oh.make_node("Min", ["w", "box_w"], ["inter_w"]),
            oh.make_node("Min", ["h", "box_h"], ["inter_h"]),
            oh.make_node("Mul", ["inter_w", "inter_h"], ["inter"]),
            oh.make_node("Div", ["inter", "area"], ["y"]),
        ],
        "overlap_shares",
        [oh.make_tensor_value_info(n, TensorProto.FLOAT, [1, 4096]) for n in ("w", "h")],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4096])],
        [
            numpy_helper.from_array(np.float32(100.0), "box_w"),
            numpy_helper.from_array(np.float32(150.0), "box_h"),
        ],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


def _boxes(largest: float, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.uniform(2, largest, (1, 4096)).round().astype(np.float32) for n in "wh"}


def _shares(model: onnx.ModelProto, boxes: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, boxes)[0]


def test_a_large_divisor_is_divided_in_two_steps_exactly() -> None:
    model = overlap_shares()
    rewritten, change = float16_large_divisors(model, {"area": 40000.0})
    assert change.changed and "'area'" in change.details[0]
    for scale in (1.0, 0.15, 2.5e-4):  # both branches, and areas of 0.0025 at most
        boxes = {k: v * np.float32(scale) for k, v in _boxes(200.0, 1).items()}
        np.testing.assert_array_equal(_shares(rewritten, boxes), _shares(model, boxes))
    assert not float16_large_divisors(model, {"area": 2000.0})[1].changed
    constant = onnx.ModelProto()
    constant.CopyFrom(model)
    constant.graph.initializer.append(numpy_helper.from_array(np.float32(40000.0), "area"))
    del constant.graph.node[0]
    assert not float16_large_divisors(constant, {"area": 40000.0})[1].changed


@pytest.mark.qnn
def test_the_htp_divides_by_large_divisors_in_two_steps_right(tmp_path: Path) -> None:
    """Measured: the HTP's fp16 Div by a tensor of the dividend's shape reads 0 past 16384
    (boxes up to 250 x 250 pixels: every share of a box over 16384 pixels came out 0); divided
    in two steps, it agrees with the CPU."""
    from compile_fixtures import whole_ctx_vs_float

    model = overlap_shares()
    rewritten, _ = float16_large_divisors(model, {"area": 62500.0})
    models = {"float": model, "rewritten": rewritten}
    results = whole_ctx_vs_float(tmp_path, models, [_boxes(250.0, 3), _boxes(250.0, 4)])
    assert results["rewritten"] > 50.0, results
    # If a new QNN SDK divides by such values right, this says so: the rule is then harmless.
    assert results["float"] < 10.0, results


def normalized(keepdims: int = 1, axes: list[int] | None = None) -> onnx.ModelProto:
    """F.normalize as torch exports it: x / max(ReduceL2(x), eps), x [4, 1024]; with
    ``keepdims`` 0 the norm is an output of its own."""
    inits = [numpy_helper.from_array(np.float32(1e-12), "eps")]
    reduce_inputs = ["x"]
    if axes is not None:
        inits.append(numpy_helper.from_array(np.array(axes, np.int64), "axes"))
        reduce_inputs.append("axes")
    nodes = [oh.make_node("ReduceL2", reduce_inputs, ["norm"], keepdims=keepdims)]
    if keepdims:
        nodes += [
            oh.make_node("Clip", ["norm", "eps"], ["floor"]),
            oh.make_node("Div", ["x", "floor"], ["y"]),
        ]
        out = oh.make_tensor_value_info("y", TensorProto.FLOAT, [4, 1024])
    else:
        out = oh.make_tensor_value_info("norm", TensorProto.FLOAT, [4] if axes else [])
    graph = oh.make_graph(
        nodes,
        "normalized",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [4, 1024])],
        [out],
        inits,
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


def _features(norms: list[float], seed: int = 5) -> np.ndarray:
    rows = np.random.default_rng(seed).standard_normal((len(norms), 1024))
    rows *= np.array(norms)[:, None] / np.linalg.norm(rows, axis=1, keepdims=True)
    return rows.astype(np.float32)


@pytest.mark.parametrize(("keepdims", "axes"), [(1, [1]), (0, [1]), (0, None), (1, None)])
def test_a_large_l2_norm_is_taken_of_its_scaled_input_and_the_same(
    keepdims: int, axes: list[int] | None
) -> None:
    model = normalized(keepdims, axes)
    rewritten, change = float16_scaled_l2_norms(model, {"norm": 3000.0})
    assert change.changed, change
    x = _features([3000.0, 40.0, 1e-3, 0.0])  # a row of zeros stays 0, not nan
    np.testing.assert_allclose(cpu_outputs(rewritten, x), cpu_outputs(model, x), rtol=2e-6)
    assert not float16_scaled_l2_norms(model, {"norm": 40.0})[1].changed


@pytest.mark.qnn
def test_the_htp_takes_large_l2_norms_right_of_the_scaled_input(tmp_path: Path) -> None:
    """Measured: the HTP's fp16 ReduceL2 stops near 362, so F.normalize of features with norms
    up to 3000 came out up to 8x too large; of the scaled input it agrees."""
    from compile_fixtures import whole_ctx_vs_float

    model = normalized()
    rewritten, _ = float16_scaled_l2_norms(model, {"norm": 3000.0})
    models = {"float": model, "rewritten": rewritten}
    samples = [{"x": _features([100.0, 400.0, 1200.0, 3000.0], seed)} for seed in (1, 2)]
    results = whole_ctx_vs_float(tmp_path, models, samples)
    assert results["rewritten"] > 50.0, results
    # If a new QNN SDK takes such norms right, this says so: the rule is then only harmless.
    assert results["float"] < 10.0, results


def test_exps_that_could_read_past_88_are_floored_and_the_same() -> None:
    """The Sigmoid and Tanh forms clip their inputs: their Exps stay; the Softplus form's
    exp(-|x|) and a model's own Exp get the floor, which changes nothing in float32 that
    fp16 could hold."""
    for op_type, floored in (("Sigmoid", 0), ("Tanh", 0), ("Gelu", 0), ("Softplus", 1), ("Exp", 1)):
        _, changes = exact_float16_forms(unary_model(op_type))
        change = next(c for c in changes if c.step == "floored_float16_exps")
        assert len(change.details) == floored, (op_type, change.details)
    model = unary_model("Exp")
    rewritten, _ = floored_float16_exps(model)
    x = np.linspace(-400, 10, 4096, dtype=np.float32).reshape(1, -1)
    np.testing.assert_allclose(
        cpu_outputs(rewritten, x), cpu_outputs(model, x), rtol=1e-7, atol=2e-35
    )


@pytest.mark.qnn
def test_the_htp_takes_exps_past_88_right_floored(tmp_path: Path) -> None:
    """Measured: the HTP's fp16 Exp returns garbage (+-131008) between -88 and about -362, so
    the Softplus form over +-300 read -131008 inside a log; floored, it agrees."""
    from compile_fixtures import whole_ctx_vs_float

    model = unary_model("Softplus")
    unfloored, _ = exact_softpluses(model)
    models = {"float": model, "unfloored": unfloored, "formed": exact_float16_forms(model)[0]}
    x = np.linspace(-300, 300, 4096, dtype=np.float32).reshape(1, -1)
    results = whole_ctx_vs_float(tmp_path, models, [{"x": x.astype(np.float16).astype(np.float32)}])
    assert results["formed"] > 50.0, results
    # If a new QNN SDK takes such Exps right, this says so: the rule is then only harmless.
    assert results["unfloored"] < results["formed"] - 20.0, results
