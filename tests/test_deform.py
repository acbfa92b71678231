"""DeformConv -> per-tap GridSamples and a 1x1 Conv (pipeline.graph.deform)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

from pipeline.graph.deform import deform_conv_to_grid_samples

RNG = np.random.default_rng(19)


def deform_model(
    kernel: int = 3, stride: int = 1, dilation: int = 1, pad: int = 1, mask: bool = True,
    size: int = 12, channels: int = 4, out: int = 5, offset_scale: float = 3.0,
    offset_groups: int = 1,
) -> onnx.ModelProto:  # fmt: skip
    """x -> Conv (the offsets, and the mask through a Sigmoid, as DCNv2 computes them) ->
    DeformConv(x, offsets, mask): torchvision's deform_conv2d as the dynamo exporter writes it."""
    taps = kernel * kernel * offset_groups  # offsets and mask weights per offset group
    out_size = (size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1
    spec = dict(kernel_shape=[kernel, kernel], strides=[stride, stride], pads=[pad] * 4,
                dilations=[dilation, dilation])  # fmt: skip
    inits = [
        numpy_helper.from_array(
            (RNG.standard_normal((3 * taps, channels, kernel, kernel)) * offset_scale / 3)
            .astype(np.float32), "w_offset"),
        numpy_helper.from_array(
            RNG.standard_normal((out, channels, kernel, kernel)).astype(np.float32) * 0.2, "w"),
        numpy_helper.from_array(RNG.standard_normal(out).astype(np.float32), "b"),
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array([2 * taps], np.int64), "split"),
        numpy_helper.from_array(np.array([3 * taps], np.int64), "end"),
        numpy_helper.from_array(np.array([1], np.int64), "channel"),
    ]  # fmt: skip
    nodes = [
        oh.make_node("Conv", ["x", "w_offset"], ["raw"], **spec),
        oh.make_node("Slice", ["raw", "zero", "split", "channel"], ["offsets"]),
        oh.make_node("Slice", ["raw", "split", "end", "channel"], ["logits"]),
        oh.make_node("Sigmoid", ["logits"], ["mask"]),
        oh.make_node("DeformConv", ["x", "w", "offsets", "b", "mask" if mask else ""], ["y"],
                     offset_group=offset_groups, **spec),
    ]  # fmt: skip
    graph = oh.make_graph(
        nodes,
        "deform",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, size, size])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, out, out_size, out_size])],
        inits,
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize(
    "spec",
    [{}, {"mask": False}, {"stride": 2}, {"dilation": 2, "pad": 2}, {"kernel": 5, "pad": 0},
     {"offset_scale": 12.0}, {"offset_groups": 2}],
)  # fmt: skip
def test_a_deformable_conv_is_grid_samples_and_a_pointwise_conv(spec: dict) -> None:
    """Exact up to float rounding, offsets of several pixels included, and samples that land
    outside the image (offset_scale 12: most of them), where the op reads zeros."""
    model = deform_model(**spec)
    rewritten, change = deform_conv_to_grid_samples(model)
    assert change.changed and "DeformConv" not in {n.op_type for n in rewritten.graph.node}
    x = RNG.standard_normal((1, 4, 12, 12)).astype(np.float32)
    np.testing.assert_allclose(run(rewritten, x), run(model, x), rtol=1e-4, atol=1e-4)


def test_a_grouped_deformable_conv_is_left_alone() -> None:
    model = deform_model()
    node = next(n for n in model.graph.node if n.op_type == "DeformConv")
    node.attribute.append(oh.make_attribute("group", 2))
    assert not deform_conv_to_grid_samples(model)[1].changed


@pytest.mark.qnn
def test_a_deformable_conv_builds_whole_and_quantized(tmp_path: Path) -> None:
    """The QNN EP takes no DeformConv (a DCNv2 head: 2 partitions, the op on the CPU)."""
    from compile_fixtures import build_whole_on_htp

    build_whole_on_htp(tmp_path, "deform", deform_model(size=16, channels=8, out=8),
                       quantization='judge = "cpu"')  # fmt: skip
