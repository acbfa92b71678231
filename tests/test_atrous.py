"""pipeline.graph.atrous: TF's atrous Conv written as data moves -> one dilated Conv."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

from pipeline.graph.atrous import space_to_batch_convs, split_wide_dilations

RNG = np.random.default_rng(7)


def _const(name: str, values: list[int]) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _model(
    nodes: list[onnx.NodeProto],
    inits: list[onnx.TensorProto],
    shape: list[int],
    out_shape: list[int],
) -> onnx.ModelProto:
    for index, node in enumerate(nodes):  # named, as exporters do: qnn_preprocess then
        node.name = node.name or f"{node.op_type}_{index}"  # keeps its input unoptimized
    graph = oh.make_graph(
        nodes,
        "atrous",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
        inits,
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


def space_to_depth_spelling(size: int = 15, channels: int = 3, kernels: int = 4) -> onnx.ModelProto:
    """tf2onnx's SpaceToBatchND/BatchToSpaceND for a dynamic NHWC input, once its shapes are
    fixed: Pad to a multiple of the block, channels to the front so SpaceToDepth deals the
    pixels into the batch, a VALID Conv, DepthToSpace back, the extra rows cropped; rate 2,
    TF "SAME" (size 15: one extra padded row and column, cropped at the end)."""
    pad = 2 * (3 - 1) // 2
    extra = (-(size + 2 * pad)) % 2
    end = pad + extra
    inits = [
        _const("pads", [0, pad, pad, 0, 0, end, end, 0]),
        numpy_helper.from_array(
            RNG.standard_normal((kernels, channels, 3, 3)).astype(np.float32), "w"
        ),
        numpy_helper.from_array(RNG.standard_normal(kernels).astype(np.float32), "b"),
        _const("starts", [0, 0]),
        _const("ends", [size, size]),
        _const("axes", [2, 3]),
    ]
    nodes = [
        oh.make_node("Pad", ["x", "pads"], ["padded"]),
        oh.make_node("Transpose", ["padded"], ["cnhw"], perm=[3, 0, 1, 2]),
        oh.make_node("SpaceToDepth", ["cnhw"], ["dealt"], blocksize=2),
        oh.make_node("Transpose", ["dealt"], ["batch"], perm=[1, 0, 2, 3]),
        oh.make_node("Conv", ["batch", "w", "b"], ["conv"], "atrous", kernel_shape=[3, 3]),
        oh.make_node("Transpose", ["conv"], ["knhw"], perm=[1, 0, 2, 3]),
        oh.make_node("DepthToSpace", ["knhw"], ["joined"], blocksize=2),
        oh.make_node("Slice", ["joined", "starts", "ends", "axes"], ["cropped"]),
        oh.make_node("Transpose", ["cropped"], ["nkhw"], perm=[1, 0, 2, 3]),
        oh.make_node("Relu", ["nkhw"], ["y"]),
    ]
    return _model(nodes, inits, [1, size, size, channels], [1, kernels, size, size])


def six_d_spelling(
    block: tuple[int, int] = (2, 3), order: tuple[int, ...] = (2, 4, 0, 1, 3, 5)
) -> onnx.ModelProto:
    """The textbook SpaceToBatchND as rank-6 Reshape/Transpose (NHWC, blocks ``block``), the
    Conv in NCHW between layout Transposes, and BatchToSpaceND the same way. ``order`` deals the
    blocks into the batch; TF's is (2, 4, 0, 1, 3, 5): block offsets outermost."""
    bh, bw = block
    height, width, channels, kernels = 4 * bh, 4 * bw, 2, 5
    ph, pw = bh, bw  # kernel 3 at rate b: b on each side
    padded_h, padded_w = height + 2 * ph, width + 2 * pw
    h, w = padded_h // bh, padded_w // bw
    inits = [
        _const("pads", [0, ph, pw, 0, 0, ph, pw, 0]),
        _const("split", [1, h, bh, w, bw, channels]),
        _const("dealt", [bh * bw, h, w, channels]),
        numpy_helper.from_array(
            RNG.standard_normal((kernels, channels, 3, 3)).astype(np.float32), "w"
        ),
        _const("unsplit", [bh, bw, 1, h - 2, w - 2, kernels]),
        _const("joined", [1, (h - 2) * bh, (w - 2) * bw, kernels]),
    ]
    nodes = [
        oh.make_node("Pad", ["x", "pads"], ["padded"]),
        oh.make_node("Reshape", ["padded", "split"], ["six"]),
        oh.make_node("Transpose", ["six"], ["moved"], perm=list(order)),
        oh.make_node("Reshape", ["moved", "dealt"], ["batch_nhwc"]),
        oh.make_node("Transpose", ["batch_nhwc"], ["batch"], perm=[0, 3, 1, 2]),
        oh.make_node("Conv", ["batch", "w"], ["conv"], "atrous", kernel_shape=[3, 3]),
        oh.make_node("Transpose", ["conv"], ["conv_nhwc"], perm=[0, 2, 3, 1]),
        oh.make_node("Reshape", ["conv_nhwc", "unsplit"], ["six_out"]),
        oh.make_node("Transpose", ["six_out"], ["back"], perm=[2, 3, 0, 4, 1, 5]),
        oh.make_node("Reshape", ["back", "joined"], ["y"]),
    ]
    return _model(nodes, inits, [1, height, width, channels], [1, height, width, kernels])


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def _input(model: onnx.ModelProto) -> np.ndarray:
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    return RNG.standard_normal(shape).astype(np.float32)


def _ops(model: onnx.ModelProto) -> collections.Counter[str]:
    return collections.Counter(n.op_type for n in model.graph.node)


def rewritten_once(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, object]]:
    """The model with its one atrous Conv rewritten, and that Conv's attributes; the rewrite
    computes what the model did."""
    rewritten, change = space_to_batch_convs(model)
    assert len(change.details) == 1, change.details
    x = _input(model)
    np.testing.assert_allclose(run(rewritten, x), run(model, x), rtol=1e-5, atol=1e-5)
    conv = next(n for n in rewritten.graph.node if n.op_type == "Conv")
    return rewritten, {a.name: oh.get_attribute_value(a) for a in conv.attribute}


def test_the_space_to_depth_spelling_becomes_one_dilated_conv() -> None:
    rewritten, attrs = rewritten_once(space_to_depth_spelling())
    # TF "SAME" at rate 2 pads 2 each side; the extra row for the block is cropped away again.
    assert attrs["dilations"] == [2, 2] and attrs["pads"] == [2, 2, 2, 2]
    ops = _ops(rewritten)
    assert (
        not ops["SpaceToDepth"] and not ops["DepthToSpace"] and not ops["Pad"] and not ops["Slice"]
    )


def test_the_six_d_spelling_with_unequal_blocks_becomes_one_dilated_conv() -> None:
    rewritten, attrs = rewritten_once(six_d_spelling())
    assert attrs["dilations"] == [2, 3] and attrs["pads"] == [2, 3, 2, 3]
    ranks = [
        len(v.type.tensor_type.shape.dim)
        for v in onnx.shape_inference.infer_shapes(rewritten).graph.value_info
    ]
    assert max(ranks) == 4  # no rank-6 tensor is left for the HTP to refuse


def test_a_batch_dealt_in_another_order_is_left_alone() -> None:
    """Blocks dealt column-major but gathered back row-major: the result is a convolution of
    the source with its blocks shuffled, no dilated Conv computes it."""
    model = six_d_spelling(order=(0, 4, 2, 1, 3, 5))
    rewritten, change = space_to_batch_convs(model)
    assert not change.changed
    assert rewritten is model


def test_a_batch_conv_without_moves_is_left_alone() -> None:
    inits = [numpy_helper.from_array(RNG.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")]
    model = _model(
        [oh.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3])],
        inits,
        [4, 3, 8, 8],
        [4, 4, 6, 6],
    )
    assert not space_to_batch_convs(model)[1].changed


@pytest.mark.qnn
def test_the_dilated_conv_builds_whole_on_the_htp(tmp_path: Path) -> None:
    """The dilated Conv it writes (rates 2 and 3, its pads in the Conv) quantized, compiled and
    run by the real stages: whole on the HTP, >= 30 dB from the float model there. (The moves
    it replaces are exact and ran whole too once other steps lowered their rank: what the
    rewrite saves is the device's full-resolution copies, measured nowhere here.)"""
    from compile_fixtures import build_whole_on_htp

    build_whole_on_htp(tmp_path, "atrous", six_d_spelling())


# --- dilations too wide for the HTP ---------------------------------------------------------


def temporal_conv(dilations: list[int], channels: int = 128, length: int = 1000) -> onnx.ModelProto:
    """One layer of a temporal convolution network: kernel 3 (3x3 for two dilations) at
    ``dilations``, with a bias, a ReLU after it; the input long enough for ``length`` outputs."""
    rank = len(dilations)
    kernel = [3] * rank
    spatial = [length + 2 * d for d in dilations] if rank == 1 else [16 + 2 * d for d in dilations]
    out = [length] if rank == 1 else [16] * rank
    weight = (RNG.standard_normal((channels, channels, *kernel)) * 0.05).astype(np.float32)
    inits = [
        numpy_helper.from_array(weight, "w"),
        numpy_helper.from_array(RNG.standard_normal(channels).astype(np.float32), "b"),
    ]
    nodes = [
        oh.make_node(
            "Conv", ["x", "w", "b"], ["c"], "tcn", dilations=dilations, kernel_shape=kernel
        ),
        oh.make_node("Relu", ["c"], ["y"], "relu"),
    ]
    return _model(nodes, inits, [1, channels, *spatial], [1, channels, *out])


def test_a_dilation_too_wide_becomes_shifted_slices_and_a_pointwise_conv() -> None:
    for dilations in ([2048], [64, 64]):
        channels = 128 if len(dilations) == 1 else 32
        model = temporal_conv(dilations, channels)
        split, change = split_wide_dilations(model)
        assert len(change.details) == 1, (dilations, change.details)
        ops = _ops(split)
        assert ops["Slice"] == 3 ** len(dilations) and ops["Concat"] == 1 and ops["Conv"] == 1
        conv = next(n for n in split.graph.node if n.op_type == "Conv")
        assert oh.get_attribute_value(conv.attribute[0]) == [1] * len(dilations)
        x = _input(model)
        np.testing.assert_allclose(run(split, x), run(model, x), rtol=1e-4, atol=1e-4)


def test_a_dilation_the_htp_takes_is_left() -> None:
    """Dilation 512 at 128 channels: a footprint of 131,200 values, below WIDE_FOOTPRINT."""
    model = temporal_conv([512])
    same, change = split_wide_dilations(model)
    assert not change.changed and same is model


@pytest.mark.qnn
def test_the_split_temporal_conv_builds_whole_on_the_htp(tmp_path: Path) -> None:
    """Dilation 2048 at 128 channels: "Failed to finalize QNN graph ... MEM_ALLOC" as it is;
    split, one QNN partition at >= 30 dB on the HTP simulator."""
    from compile_fixtures import build_whole_on_htp

    build_whole_on_htp(tmp_path, "tcn", temporal_conv([2048]), samples=8)
