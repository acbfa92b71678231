"""Bias correction (pipeline/quantize/bias_correction.py) on small models with seeded weights.

The arithmetic is checked exactly (a constant input: the corrected bias undoes the rounded
weights' shift to float precision, for grouped convolutions and both Gemm layouts), then the
effect on a real QDQ model from onnxruntime's quantizer: inputs far from zero-mean, as after
hardswish in BN-folded CNNs, where the correction is worth many dB.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.core.cpu import cpu_session
from pipeline.core.metrics import snr_db
from pipeline.quantize import bias_correction as bc

RNG = np.random.default_rng(7)


def _model(node: onnx.NodeProto, x_shape, y_shape, inits: dict[str, np.ndarray]):
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    return model


def _conv(channels: int, outputs: int, group: int, bias: bool = True):
    inits = {"w": RNG.standard_normal((outputs, channels // group, 3, 3)) * 0.3}
    inputs = ["x", "w"]
    if bias:
        inits["b"] = RNG.standard_normal(outputs) * 0.1
        inputs.append("b")
    node = helper.make_node("Conv", inputs, ["y"], group=group, kernel_shape=[3, 3], name="conv")
    return _model(node, [1, channels, 8, 8], [1, outputs, 6, 6], inits)


def _gemm(trans_b: bool):
    w = RNG.standard_normal((6, 10) if trans_b else (10, 6)) * 0.3
    node = helper.make_node(
        "Gemm", ["x", "w", "b"], ["y"], transB=int(trans_b), alpha=0.5, beta=2.0, name="fc"
    )
    return _model(node, [4, 10], [4, 6], {"w": w, "b": RNG.standard_normal(6) * 0.1})


def _rounded(weight: np.ndarray) -> np.ndarray:
    """int8 per output channel, as a QDQ model would see it (coarse on purpose: 3 bits)."""
    flat = weight.reshape(weight.shape[0], -1)
    scale = np.abs(flat).max(axis=1, keepdims=True) / 3
    return (np.round(flat / scale) * scale).reshape(weight.shape)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return cpu_session(model).run(["y"], {"x": x})[0]


@pytest.mark.parametrize(
    "make, x",
    [
        (
            lambda: _conv(4, 6, 1),
            np.ones((1, 4, 8, 8), np.float32) * [[[[2.0]], [[-1]], [[5]], [[0.5]]]],
        ),
        (
            lambda: _conv(6, 6, 3),
            np.ones((1, 6, 8, 8), np.float32) * np.arange(1, 7).reshape(1, 6, 1, 1),
        ),
        (lambda: _conv(4, 4, 4), np.full((1, 4, 8, 8), 3.0, np.float32)),
        (lambda: _gemm(True), np.tile(np.linspace(-2, 4, 10, dtype=np.float32), (4, 1))),
        (lambda: _gemm(False), np.tile(np.linspace(-2, 4, 10, dtype=np.float32), (4, 1))),
    ],
    ids=["conv", "grouped-conv", "depthwise", "gemm-transB", "gemm"],
)
def test_the_correction_undoes_the_rounded_weights_shift_for_a_constant_input(make, x):
    model = make()
    x = np.asarray(x, np.float32)
    means, used = bc.input_means(model, [{"x": x}])
    assert used == 1 and set(means) == {"x"}
    weight = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "w"))
    rounded = _rounded(weight)
    name, bias = bc.corrected_float_bias(model, "w", rounded, means)
    assert name == "b"

    def with_weights(w: np.ndarray, b: np.ndarray | None) -> onnx.ModelProto:
        out = onnx.ModelProto()
        out.CopyFrom(model)
        for init in out.graph.initializer:
            if init.name == "w":
                init.CopyFrom(numpy_helper.from_array(w.astype(np.float32), "w"))
            if init.name == "b" and b is not None:
                init.CopyFrom(numpy_helper.from_array(b, "b"))
        return out

    exact = _run(model, x)
    shifted = _run(with_weights(rounded, None), x)
    corrected = _run(with_weights(rounded, bias), x)
    assert np.abs(shifted - exact).max() > 0.05, "3-bit weights must shift the output"
    np.testing.assert_allclose(corrected, exact, atol=1e-4)


def _qdq(
    model: onnx.ModelProto,
    samples: list[dict[str, np.ndarray]],
    tmp_path,
    per_channel: bool = True,
) -> onnx.ModelProto:
    from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize_static
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.items = iter(samples)

        def get_next(self):
            return next(self.items, None)

    float_path, qdq_path = tmp_path / "f.onnx", tmp_path / "q.onnx"
    onnx.save(model, float_path)
    config = get_qnn_qdq_config(
        str(float_path),
        Reader(),
        activation_type=QuantType.QUInt16,
        weight_type=QuantType.QInt8 if per_channel else QuantType.QUInt8,
        per_channel=per_channel,
    )
    quantize_static(
        str(float_path),
        str(qdq_path),
        Reader(),
        quant_format=config.quant_format,
        op_types_to_quantize=config.op_types_to_quantize,
        per_channel=config.per_channel,
        activation_type=config.activation_type,
        weight_type=config.weight_type,
        extra_options=config.extra_options,
    )
    return onnx.load(qdq_path)


@pytest.mark.parametrize("bias", [True, False], ids=["with-bias", "without-bias"])
def test_qdq_model_with_offset_inputs_gains_from_the_correction(tmp_path, bias: bool):
    """Inputs at mean 6, spread 0.3 (|mean|/std 20, as after hardswish): the 8-bit weights'
    rounding shifts each output by much more than the spread it should resolve."""
    model = _conv(16, 16, 1, bias=bias)
    samples = [
        {"x": (6.0 + 0.3 * RNG.standard_normal((1, 16, 8, 8))).astype(np.float32)} for _ in range(8)
    ]
    qdq = _qdq(model, samples, tmp_path)
    means, _ = bc.input_means(model, samples)
    corrected, change = bc.correct_biases(qdq, model, means)
    assert len(change.details) == 1 and "conv" in change.details[0]
    if not bias:  # a bias was added, as an int32 DequantizeLinear like the quantizer's own
        conv = next(n for n in corrected.graph.node if n.op_type == "Conv")
        assert len(conv.input) == 3 and conv.input[2]
    held = {"x": (6.0 + 0.3 * RNG.standard_normal((1, 16, 8, 8))).astype(np.float32)}
    exact = _run(model, held["x"])
    plain = snr_db(exact, _run(qdq, held["x"]))
    better = snr_db(exact, _run(corrected, held["x"]))
    assert better > plain + 6.0, (plain, better)


def test_layers_left_in_float_are_not_touched(tmp_path):
    model = _conv(4, 4, 1)
    samples = [{"x": RNG.standard_normal((1, 4, 8, 8)).astype(np.float32) + 3} for _ in range(4)]
    means, _ = bc.input_means(model, samples)
    same, change = bc.correct_biases(model, model, means)  # a float model: no Q/DQ to read
    assert not change.changed
    assert same.SerializeToString() == model.SerializeToString()


def _offset_samples(count: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(29)
    return [
        {"x": (6.0 + 0.3 * rng.standard_normal((1, 16, 8, 8))).astype(np.float32)}
        for _ in range(count)
    ]


def _added_bias(model: onnx.ModelProto) -> onnx.NodeProto:
    producer = {o: n for n in model.graph.node for o in n.output}
    conv = next(n for n in model.graph.node if n.op_type == "Conv")
    return producer[conv.input[2]]


def test_an_added_bias_follows_a_per_tensor_weights_encoding(tmp_path) -> None:
    """A per-tensor weight (uint8, one scale) gets a bias with one scale, no axis."""
    model = _conv(16, 16, 1, bias=False)
    samples = _offset_samples(8)
    qdq = _qdq(model, samples, tmp_path, per_channel=False)
    corrected, change = bc.correct_biases(qdq, model, bc.input_means(model, samples)[0])
    assert change.changed
    bias_dq = _added_bias(corrected)
    scale = next(i for i in corrected.graph.initializer if i.name == bias_dq.input[1])
    assert list(scale.dims) == [] and not any(a.name == "axis" for a in bias_dq.attribute)


@pytest.mark.qnn
def test_the_htp_computes_a_per_tensor_conv_with_its_added_bias(tmp_path) -> None:
    """Beside a per-tensor weight, a bias DequantizeLinear with a vector of equal scales made
    the HTP compute the Conv as garbage; with one scale it agrees with the CPU."""
    from compile_fixtures import ctx_vs_qdq_on_htp

    model = _conv(16, 16, 1, bias=False)
    samples = _offset_samples(8)
    qdq = _qdq(model, samples, tmp_path, per_channel=False)
    corrected, _ = bc.correct_biases(qdq, model, bc.input_means(model, samples)[0])
    vector = onnx.ModelProto()
    vector.CopyFrom(corrected)
    bias_dq = _added_bias(vector)
    inits = {i.name: i for i in vector.graph.initializer}
    for name in bias_dq.input[1:3]:
        scalar = numpy_helper.to_array(inits[name])
        inits[name].CopyFrom(numpy_helper.from_array(np.full(16, scalar, scalar.dtype), name))
    bias_dq.attribute.append(helper.make_attribute("axis", 0))
    np.savez(tmp_path / "sample.npz", **samples[0])
    agreement = {}
    for name, candidate in (("scalar", corrected), ("vector", vector)):
        onnx.save(candidate, str(tmp_path / f"{name}.onnx"))
        agreement[name] = ctx_vs_qdq_on_htp(
            tmp_path / f"{name}.onnx",
            tmp_path / "f.onnx",
            tmp_path / "sample.npz",
            tmp_path / f"p_{name}",
        )
    assert agreement["scalar"] > 40.0, agreement
    # If a new QNN SDK reads the vector form right, this says so.
    assert agreement["vector"] < 10.0, agreement
