"""STFT and DFT -> Conv and MatMul with the Fourier bases (pipeline.graph.spectral)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest
from compile_fixtures import build_whole_on_htp
from onnx import TensorProto, numpy_helper

from pipeline.graph import spectral

RNG = np.random.default_rng(0)


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def log_mel(samples: int = 4000, length: int = 400, step: int = 160, window: bool = True,
            onesided: int = 1, flat: bool = False) -> onnx.ModelProto:  # fmt: skip
    """x [1, samples] -> STFT -> power -> mel MatMul -> log: a torch.stft log-mel front end.
    ``flat``: the STFT reads x [1, samples] itself, without a frame length or an onesided
    attribute (onnx-asr's front ends: onnxruntime takes it as a real signal)."""
    bins = length // 2 + 1 if onesided else length
    frames = 1 + (samples - length) // step
    hann = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(length) / length)
    inits = [
        numpy_helper.from_array(np.array(step, np.int64), "step"),
        numpy_helper.from_array(np.array(length, np.int64), "length"),
        numpy_helper.from_array(np.array([2], np.int64), "channel"),
        numpy_helper.from_array(np.abs(RNG.normal(0, 0.1, (bins, 16))).astype(np.float32), "mel"),
        numpy_helper.from_array(np.array(1e-6, np.float32), "floor"),
    ]
    stft_inputs = ["signal", "step", "", "length"]
    if window:
        inits.append(numpy_helper.from_array(hann.astype(np.float32), "window"))
        stft_inputs[2] = "window"
    nodes = [
        oh.make_node("Unsqueeze", ["x", "channel"], ["signal"]),
        oh.make_node("STFT", stft_inputs, ["spectrum"], onesided=onesided),
    ]
    if flat:
        nodes = [oh.make_node("STFT", ["x", "step", "window"], ["spectrum"])]
    nodes += [
        oh.make_node("Mul", ["spectrum", "spectrum"], ["squares"]),
        oh.make_node("ReduceSum", ["squares", "last"], ["power"], keepdims=0),
        oh.make_node("MatMul", ["power", "mel"], ["mels"]),
        oh.make_node("Add", ["mels", "floor"], ["floored"]),
        oh.make_node("Log", ["floored"], ["y"]),
    ]
    inits.append(numpy_helper.from_array(np.array([3], np.int64), "last"))
    graph = oh.make_graph(
        nodes,
        "log_mel",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, samples])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, frames, 16])],
        inits,
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize(("window", "onesided"), [(True, 1), (False, 1), (True, 0)])
def test_an_stft_is_a_strided_conv_of_windowed_fourier_kernels(window: bool, onesided: int) -> None:
    model = log_mel(window=window, onesided=onesided)
    rewritten, change = spectral.stft_to_conv(model)
    assert change.changed and "STFT" not in [n.op_type for n in rewritten.graph.node]
    x = RNG.normal(0, 0.3, (1, 4000)).astype(np.float32)
    np.testing.assert_allclose(run(rewritten, x), run(model, x), rtol=1e-4, atol=1e-4)
    assert not spectral.stft_to_conv(rewritten)[1].changed


def test_an_stft_of_a_flat_signal_is_rewritten_and_prepared() -> None:
    """STFT of x [1, L] with no frame length (the window's) and the default onesided: ONNX
    shape inference gives it 400 bins where onnxruntime computes 201, so the mel MatMul after it
    failed onnxruntime's own inference in preparation ("Incompatible dimensions"). Rewritten,
    and the stored shapes of the old op dropped, the whole preparation computes the same."""
    from pipeline.core.config import InputsSection
    from pipeline.graph.prepare import prepare_model

    model = log_mel(flat=True)
    rewritten, change = spectral.stft_to_conv(model)
    assert change.changed and "STFT" not in [n.op_type for n in rewritten.graph.node]
    x = RNG.normal(0, 0.3, (1, 4000)).astype(np.float32)
    np.testing.assert_allclose(run(rewritten, x), run(model, x), rtol=1e-4, atol=1e-4)
    prepared, _ = prepare_model(model, InputsSection())
    np.testing.assert_allclose(run(prepared, x), run(model, x), rtol=1e-4, atol=1e-4)


def rfft(shape: list[int], axis: int, length: int | None, onesided: int = 1) -> onnx.ModelProto:
    """x -> Unsqueeze(-1) -> DFT along ``axis`` (opset 20: axis and length are inputs)."""
    size = shape[axis]
    points = length or size
    bins = points // 2 + 1 if onesided else points
    out = [*shape, 2]
    out[axis] = bins
    inits = [
        numpy_helper.from_array(np.array([-1], np.int64), "last"),
        numpy_helper.from_array(np.array(axis, np.int64), "axis"),
    ]
    inputs = ["real", "", "axis"]
    if length:
        inits.append(numpy_helper.from_array(np.array(length, np.int64), "points"))
        inputs[1] = "points"
    graph = oh.make_graph(
        [
            oh.make_node("Unsqueeze", ["x", "last"], ["real"]),
            oh.make_node("DFT", inputs, ["y"], onesided=onesided),
        ],
        "rfft",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, out)],
        inits,
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize(
    ("shape", "axis", "length", "onesided"),
    [([1, 20, 512], 2, None, 1), ([1, 512, 20], 1, None, 1), ([2, 20, 400], 2, 512, 1),
     ([1, 20, 512], 2, 256, 0)],
)  # fmt: skip
def test_a_dft_is_a_matmul_with_the_fourier_bases(
    shape: list[int], axis: int, length: int | None, onesided: int
) -> None:
    model = rfft(shape, axis, length, onesided)
    rewritten, change = spectral.dft_to_matmul(model)
    assert change.changed and "DFT" not in [n.op_type for n in rewritten.graph.node]
    x = RNG.normal(0, 1, shape).astype(np.float32)
    np.testing.assert_allclose(run(rewritten, x), run(model, x), rtol=1e-4, atol=2e-4)


def dft(shape: list[int], axis: int, length: int | None, inverse: int) -> onnx.ModelProto:
    """x [..., 1 or 2] -> DFT along ``axis``, both sides of the spectrum (``inverse`` 0 or 1)."""
    out = list(shape)
    out[axis], out[-1] = length or shape[axis], 2
    inits = [numpy_helper.from_array(np.array(axis, np.int64), "axis")]
    inputs = ["x", "", "axis"]
    if length:
        inits.append(numpy_helper.from_array(np.array(length, np.int64), "points"))
        inputs[1] = "points"
    graph = oh.make_graph(
        [oh.make_node("DFT", inputs, ["y"], inverse=inverse)],
        "dft",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, out)],
        inits,
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize(
    ("shape", "axis", "length", "inverse"),
    [([1, 512, 2], 1, None, 1), ([1, 512, 2], 1, None, 0), ([2, 20, 64, 2], 2, 80, 1),
     ([1, 64, 3, 2], 1, 48, 0), ([1, 64, 1], 1, None, 1)],
)  # fmt: skip
def test_a_complex_or_inverse_dft_is_one_matmul_with_its_basis(
    shape: list[int], axis: int, length: int | None, inverse: int
) -> None:
    model = dft(shape, axis, length, inverse)
    rewritten, change = spectral.dft_to_matmul(model)
    assert change.changed and "DFT" not in [n.op_type for n in rewritten.graph.node]
    assert [n.op_type for n in rewritten.graph.node].count("MatMul") == 1
    x = RNG.normal(0, 1, shape).astype(np.float32)
    np.testing.assert_allclose(run(rewritten, x), run(model, x), rtol=1e-4, atol=2e-4)


@pytest.mark.qnn
def test_an_inverse_complex_dft_builds_whole_in_fp16_and_quantized(tmp_path: Path) -> None:
    """A streaming enhancer's iSTFT frame: [1, 512, 2] -> inverse DFT. Flattened as it lies
    (real and imaginary interleaved) the HTP failed to finalize the fp16 graph (a memory
    allocation error); planar it compiles, and agrees with the CPU."""
    from pipeline.htp.probe import probe

    rewritten, _ = spectral.dft_to_matmul(dft([1, 512, 2], 1, None, 1))
    onnx.save(rewritten, tmp_path / "float.onnx")
    np.savez(tmp_path / "sample.npz", x=RNG.normal(0, 1, (1, 512, 2)).astype(np.float32))
    path = tmp_path / "float.onnx"
    result = probe(path, path, [tmp_path / "sample.npz"], tmp_path / "fp16", 60, 73)
    assert result.ok, result.error
    assert result.partitions == 1 and result.cpu_nodes == 0
    assert result.worst_ctx_vs_float > 40.0, result.worst_ctx_vs_float
    build_whole_on_htp(tmp_path, "inverse_dft", dft([1, 512, 2], 1, None, 1))


def test_an_inverse_half_spectrum_dft_of_a_real_signal_is_left_alone() -> None:
    """IRFFT takes a complex half spectrum; of a real one the op's meaning is not defined."""
    model = rfft([1, 20, 64], 2, None)
    next(n for n in model.graph.node if n.op_type == "DFT").attribute.append(
        oh.make_attribute("inverse", 1)
    )
    assert not spectral.dft_to_matmul(model)[1].changed


def irfft(shape: list[int], axis: int, length: int) -> onnx.ModelProto:
    """x [..., bins, ..., 2] (a half spectrum) -> DFT(inverse=1, onesided=1): the real signal
    [..., length, ..., 1], as the dynamo exporter writes ``torch.fft.irfftn``."""
    out = list(shape)
    out[axis], out[-1] = length, 1
    graph = oh.make_graph(
        [oh.make_node("DFT", ["x", "points", "axis"], ["y"], inverse=1, onesided=1)],
        "irfft",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, out)],
        [
            numpy_helper.from_array(np.array(length, np.int64), "points"),
            numpy_helper.from_array(np.array(axis, np.int64), "axis"),
        ],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize(
    ("shape", "axis", "length"),
    [([1, 3, 16, 33, 2], 3, 64), ([1, 3, 32, 16, 2], 3, 31), ([1, 9, 5, 2], 1, 16)],
)
def test_an_inverse_half_spectrum_dft_is_one_matmul_to_a_real_signal(
    shape: list[int], axis: int, length: int
) -> None:
    """A Fourier convolution's way back (LaMa's FFC: irfftn over H and W): the bins between
    0 and length / 2 stand for their conjugates too; their imaginary parts at 0 and at
    length / 2 count for nothing, as in onnxruntime's kernel and numpy's irfft."""
    model = irfft(shape, axis, length)
    rewritten, change = spectral.dft_to_matmul(model)
    assert change.changed and "half-spectrum inverse" in change.details[0]
    assert [n.op_type for n in rewritten.graph.node].count("MatMul") == 1
    x = RNG.normal(0, 1, shape).astype(np.float32)
    np.testing.assert_allclose(run(rewritten, x), run(model, x), rtol=1e-4, atol=2e-5)
    spectrum = np.moveaxis(x[..., 0] + 1j * x[..., 1], axis, -1)
    signal = np.moveaxis(np.fft.irfft(spectrum, n=length, axis=-1), -1, axis)[..., None]
    np.testing.assert_allclose(run(rewritten, x), signal, rtol=1e-4, atol=2e-5)


def test_a_half_spectrum_of_another_length_is_left_alone() -> None:
    """40 bins for a 64-point inverse: not a half spectrum, whose meaning is not the irfft's."""
    assert not spectral.dft_to_matmul(irfft([1, 3, 40, 2], 2, 64))[1].changed


@pytest.mark.qnn
def test_a_log_mel_front_end_builds_whole_and_quantized(tmp_path: Path) -> None:
    """Measured: the QNN EP compiles STFT only in fp16 (quantized: "Failed to finalize QNN
    graph", a memory allocation error) and leaves DFT on the CPU; rewritten, the real stages build
    both whole. If a new QNN SDK compiles them, this still passes: the rewrite is exact."""
    from pipeline.core.layout import ModelPaths
    from qnn_ctx_runtime.manifest import SINGLE_BUCKET

    for name, model in (("log_mel", log_mel()), ("rfft", rfft([1, 20, 512], 2, None))):
        (tmp_path / name).mkdir()
        build_whole_on_htp(tmp_path / name, name, model)
        paths = ModelPaths.of(tmp_path / name / "artifacts", name)
        built = onnx.load(str(paths.bucket(SINGLE_BUCKET).qdq))
        assert "QuantizeLinear" in [n.op_type for n in built.graph.node], name  # not fp16


@pytest.mark.qnn
def test_a_fourier_filter_builds_whole_on_the_htp(tmp_path: Path) -> None:
    """rfft along the width, a per-bin gain, irfft back (a Fourier convolution's spectral
    branch): the inverse half spectrum had stayed a DFT on the CPU (LaMa-style FFC: 4 partitions,
    3 DFTs on the CPU); now both are MatMuls, whole on the HTP."""
    gain = np.abs(RNG.normal(1, 0.3, (1, 1, 1, 9, 2))).astype(np.float32)
    graph = oh.make_graph(
        [
            oh.make_node("Unsqueeze", ["x", "last"], ["real"]),
            oh.make_node("DFT", ["real", "points", "width"], ["spectrum"], onesided=1),
            oh.make_node("Mul", ["spectrum", "gain"], ["filtered"]),
            oh.make_node("DFT", ["filtered", "points", "width"], ["signal"], inverse=1, onesided=1),
            oh.make_node("Squeeze", ["signal", "last"], ["y"]),
        ],
        "fourier_filter",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16, 16])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, 16])],
        [
            numpy_helper.from_array(np.array([-1], np.int64), "last"),
            numpy_helper.from_array(np.array(16, np.int64), "points"),
            numpy_helper.from_array(np.array(3, np.int64), "width"),
            numpy_helper.from_array(gain, "gain"),
        ],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)
    build_whole_on_htp(tmp_path, "fourier_filter", model)
