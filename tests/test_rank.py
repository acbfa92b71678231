"""pipeline.graph.rank: rank-6 tensors with a leading unit axis computed at rank 5, and the
element-wise ops the HTP refuses at rank 5 computed at rank 4."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

from pipeline.graph.rank import (
    collapse_high_rank_reshapes,
    drop_leading_unit_axis,
    input_unit_axis_transposes,
    rank4_shape,
    rank5_elementwise_at_rank_4,
)

QUERIES = 10


def deformable_locations(batch: int = 1, gather_axis: int = 3) -> onnx.ModelProto:
    """Multi-scale deformable attention's sampling locations, as an RT-DETR export writes
    them: offsets viewed at rank 6, reference points unsqueezed to rank 6 and sliced, the sum,
    one level gathered (rank 5 again), a transposed and reduced copy viewed back."""
    c = numpy_helper.from_array
    inits = [
        c(np.array([batch, QUERIES, 2, 3, 2, 2], np.int64), "view"),
        c(np.array([2, 3, 4], np.int64), "ref_axes"),
        c(np.array([0], np.int64), "s0"),
        c(np.array([2], np.int64), "s2"),
        c(np.array([4], np.int64), "s4"),
        c(np.array([5], np.int64), "last"),
        c(np.array([-1], np.int64), "minus_one"),
        c(np.array(1, np.int64), "level"),
        c(np.array([3], np.int64), "points"),
        c(np.array([batch, QUERIES, 8], np.int64), "flat"),
        c(np.array([batch, 2, QUERIES, 4], np.int64), "back"),
        c(np.full((1, 1, 1, 1, 1, 2), 0.5, np.float32), "half"),
    ]
    nodes = [
        oh.make_node("Reshape", ["x", "view"], ["offsets"]),
        oh.make_node("Unsqueeze", ["ref", "ref_axes"], ["ref6"]),
        oh.make_node("Slice", ["ref6", "s0", "s2", "last"], ["centre"]),
        oh.make_node("Slice", ["ref6", "s2", "s4", "minus_one"], ["size"]),
        oh.make_node("Mul", ["offsets", "size"], ["scaled"]),
        oh.make_node("Mul", ["scaled", "half"], ["halved"]),
        oh.make_node("Add", ["centre", "halved"], ["locations"]),
        oh.make_node("Gather", ["locations", "level"], ["one_level"], axis=gather_axis),
        oh.make_node("Reshape", ["one_level", "flat"], ["y1"]),
        oh.make_node("Transpose", ["locations"], ["moved"], perm=[0, 2, 1, 3, 4, 5]),
        oh.make_node("ReduceSum", ["moved", "points"], ["summed"], keepdims=1),
        oh.make_node("Reshape", ["summed", "back"], ["y2"]),
    ]
    graph = oh.make_graph(
        nodes,
        "deformable",
        [
            oh.make_tensor_value_info("x", TensorProto.FLOAT, [batch, QUERIES, 24]),
            oh.make_tensor_value_info("ref", TensorProto.FLOAT, [batch, QUERIES, 4]),
        ],
        [
            oh.make_tensor_value_info("y1", TensorProto.FLOAT, [batch, QUERIES, 8]),
            oh.make_tensor_value_info("y2", TensorProto.FLOAT, [batch, 2, QUERIES, 4]),
        ],
        inits,
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def highest_rank(model: onnx.ModelProto) -> int:
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    return max(len(v.type.tensor_type.shape.dim) for v in inferred.graph.value_info)


def test_rank_6_locations_are_computed_at_rank_5_and_the_same() -> None:
    model = deformable_locations()
    assert highest_rank(model) == 6
    lowered, change = drop_leading_unit_axis(model)
    assert change.changed and "rank-6 tensor(s)" in change.details[0], change.details
    assert highest_rank(lowered) == 5
    rng = np.random.default_rng(0)
    feeds = {
        "x": rng.standard_normal((1, QUERIES, 24)).astype(np.float32),
        "ref": rng.uniform(0, 1, (1, QUERIES, 4)).astype(np.float32),
    }
    for got, want in zip(run(lowered, feeds), run(model, feeds), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(("batch", "axis"), [(2, 3), (1, 0)])
def test_another_batch_or_the_unit_axis_itself_is_left(batch: int, axis: int) -> None:
    """Rank 6 with batch 2 has no unit axis to drop; a Gather along the unit axis cannot lose
    it: both left as they are (lower_high_rank's own patterns may still apply)."""
    model = deformable_locations(batch=batch, gather_axis=axis)
    same, change = drop_leading_unit_axis(model)
    assert not change.changed and same is model


@pytest.mark.qnn
def test_the_htp_runs_the_locations_whole_quantized(tmp_path: Path) -> None:
    """Quantized and compiled by the real stages: whole on the HTP (before: its rank-6 nodes
    on the CPU, compile's gate failed)."""
    from compile_fixtures import build_whole_on_htp

    build_whole_on_htp(tmp_path, "deformable", deformable_locations())


def channel_mean_through_rank_6(size: int = 8, channels: int = 4) -> onnx.ModelProto:
    """A Keras LayerNormalization over channels as tf2onnx writes it in NCHW: the mean's
    layout move spelled Unsqueeze, rank-6 Reshape, Squeeze, Reshape (the identity), then the
    centring, between two Convs."""
    c = numpy_helper.from_array
    rng = np.random.default_rng(3)
    inits = [
        c(rng.standard_normal((channels, channels, 3, 3)).astype(np.float32), "w1"),
        c(rng.standard_normal((channels, channels, 1, 1)).astype(np.float32), "w2"),
        c(np.array([1], np.int64), "channel_axis"),
        c(np.array([0], np.int64), "front"),
        c(np.array([1, 1, -1, 0, 0, 1], np.int64), "six"),
        c(np.array([1, 1, size, size], np.int64), "four"),
    ]
    nodes = [
        oh.make_node("Conv", ["x", "w1"], ["a"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        oh.make_node("ReduceMean", ["a", "channel_axis"], ["mean"], keepdims=1),
        oh.make_node("Unsqueeze", ["mean", "front"], ["mean5"]),
        oh.make_node("Reshape", ["mean5", "six"], ["mean6"]),
        oh.make_node("Squeeze", ["mean6", "front"], ["back5"]),
        oh.make_node("Reshape", ["back5", "four"], ["back4"]),
        oh.make_node("Sub", ["a", "back4"], ["centred"]),
        oh.make_node("Conv", ["centred", "w2"], ["y"], kernel_shape=[1, 1]),
    ]
    for index, node in enumerate(nodes):  # named, as exporters do: qnn_preprocess then
        node.name = f"{node.op_type}_{index}"  # keeps its input (onnxruntime's fusions unsaved)
    return x_to_y(
        nodes, "channel_mean", [1, channels, size, size], [1, channels, size, size], inits
    )


def test_reshapes_through_rank_6_become_one_reshape_and_compute_the_same() -> None:
    model = channel_mean_through_rank_6()
    assert highest_rank(model) == 6
    collapsed, change = collapse_high_rank_reshapes(model)
    assert len(change.details) == 1 and "Reshape to [1, 1, 8, 8]" in change.details[0]
    assert highest_rank(collapsed) == 4
    ops = [n.op_type for n in collapsed.graph.node]
    assert "Unsqueeze" not in ops and "Squeeze" not in ops and ops.count("Reshape") == 1
    feeds = {"x": np.random.default_rng(4).standard_normal((1, 4, 8, 8)).astype(np.float32)}
    np.testing.assert_array_equal(run(collapsed, feeds)[0], run(model, feeds)[0])


def test_reshapes_below_rank_6_are_left() -> None:
    """A Flatten then a Reshape at rank <= 5: nothing the HTP refuses, nothing to change."""
    model = channel_mean_through_rank_6()
    for init in model.graph.initializer:
        if init.name == "six":
            init.CopyFrom(numpy_helper.from_array(np.array([1, 1, 1, 8, 8], np.int64), "six"))
    same, change = collapse_high_rank_reshapes(model)
    assert not change.changed and same is model


@pytest.mark.qnn
def test_the_htp_runs_the_collapsed_channel_mean_whole(tmp_path: Path) -> None:
    """Quantized and compiled by the real stages: whole on the HTP (before: the rank-6 Reshape,
    the Squeeze and their Q/DQ on the CPU)."""
    from compile_fixtures import build_whole_on_htp

    build_whole_on_htp(tmp_path, "channel_mean", channel_mean_through_rank_6())


def gray_stem(size: int = 12) -> onnx.ModelProto:
    """A grayscale NHWC input read twice, as tf2onnx writes a TF stem: Transpose(0, 3, 1, 2) to
    NCHW for a dilated Conv, Unsqueeze then Reshape for a plain one; their sum."""
    c = numpy_helper.from_array
    rng = np.random.default_rng(5)
    inits = [
        c(rng.standard_normal((4, 1, 3, 3)).astype(np.float32), "w1"),
        c(rng.standard_normal((4, 1, 3, 3)).astype(np.float32), "w2"),
        c(np.array([0], np.int64), "front"),
        c(np.array([-1, 1, 0, 0], np.int64), "to4"),
    ]
    nodes = [
        oh.make_node("Transpose", ["x"], ["nchw"], "to_nchw", perm=[0, 3, 1, 2]),
        oh.make_node(
            "Conv",
            ["nchw", "w1"],
            ["a"],
            "conv_a",
            kernel_shape=[3, 3],
            dilations=[2, 2],
            pads=[2] * 4,
        ),
        oh.make_node("Unsqueeze", ["x", "front"], ["x5"], "unsqueeze"),
        oh.make_node("Reshape", ["x5", "to4"], ["x4"], "reshape"),
        oh.make_node("Conv", ["x4", "w2"], ["b"], "conv_b", kernel_shape=[3, 3], pads=[1] * 4),
        oh.make_node("Add", ["a", "b"], ["y"], "sum"),
    ]
    return x_to_y(nodes, "gray_stem", [1, size, size, 1], [1, 4, size, size], inits)


def test_a_transpose_of_an_input_moving_unit_axes_is_a_reshape() -> None:
    model = gray_stem()
    reshaped, change = input_unit_axis_transposes(model)
    assert len(change.details) == 1 and "Reshape to [1, 1, 12, 12]" in change.details[0]
    assert "Transpose" not in [n.op_type for n in reshaped.graph.node]
    feeds = {"x": np.random.default_rng(6).standard_normal((1, 12, 12, 1)).astype(np.float32)}
    np.testing.assert_array_equal(run(reshaped, feeds)[0], run(model, feeds)[0])
    colour = onnx.ModelProto()
    colour.CopyFrom(model)
    colour.graph.input[0].type.tensor_type.shape.dim[3].dim_value = 3  # moves real data
    assert not input_unit_axis_transposes(colour)[1].changed


@pytest.mark.qnn
def test_the_htp_runs_a_gray_stem_read_twice(tmp_path: Path) -> None:
    """Quantized, compiled and run by the real stages: whole and right on the HTP (with the
    Transpose: compiled whole, but every run of its context failed on the simulator; measured
    so only with both branches and the Conv dilated)."""
    from compile_fixtures import build_whole_on_htp

    build_whole_on_htp(tmp_path, "gray_stem", gray_stem())


def x_to_y(
    nodes: list[onnx.NodeProto],
    name: str,
    x_shape: list[int],
    y_shape: list[int],
    inits: list[onnx.TensorProto],
) -> onnx.ModelProto:
    """A float graph from input x to output y (opset 21)."""
    graph = oh.make_graph(
        nodes,
        name,
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
        inits,
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


def frames_through_conv3d(activation: str = "Tanh", depth: int = 1) -> onnx.ModelProto:
    """A watermark encoder's shape: [1, 3, depth, 16, 16] frames through a Conv3d of kernel
    [1, 3, 3], an element-wise activation at rank 5, and another Conv3d."""
    rng = np.random.default_rng(5)
    c = numpy_helper.from_array
    inits = [
        c((rng.standard_normal((6, 3, 1, 3, 3)) * 0.3).astype(np.float32), "w1"),
        c((rng.standard_normal((4, 6, 1, 3, 3)) * 0.3).astype(np.float32), "w2"),
    ]
    pads = [0, 1, 1, 0, 1, 1]
    nodes = [
        oh.make_node("Conv", ["x", "w1"], ["a"], pads=pads),
        oh.make_node(activation, ["a"], ["t"]),
        oh.make_node("Conv", ["t", "w2"], ["y"], pads=pads),
    ]
    return x_to_y(nodes, "frames", [1, 3, depth, 16, 16], [1, 4, depth, 16, 16], inits)


@pytest.mark.parametrize("depth", [1, 2])
def test_a_rank_5_tanh_is_computed_at_rank_4_and_the_same(depth: int) -> None:
    """Its unit axis dropped, or (none) its last two axes merged: the same values."""
    model = frames_through_conv3d(depth=depth)
    result, change = rank5_elementwise_at_rank_4(model)
    assert change.changed
    ops = [n.op_type for n in result.graph.node]
    assert ops == ["Conv", "Reshape", "Tanh", "Reshape", "Conv"]
    inferred = onnx.shape_inference.infer_shapes(result, strict_mode=True)
    tanh_in = next(n.input[0] for n in result.graph.node if n.op_type == "Tanh")
    rank = {v.name: len(v.type.tensor_type.shape.dim) for v in inferred.graph.value_info}
    assert rank[tanh_in] == 4
    x = np.random.default_rng(0).standard_normal((1, 3, depth, 16, 16)).astype(np.float32)
    np.testing.assert_array_equal(run(result, {"x": x})[0], run(model, {"x": x})[0])


def test_rank4_shapes_keep_the_elements_in_order() -> None:
    assert rank4_shape((1, 8, 1, 32, 32)) == (1, 8, 32, 32)  # the last unit axis dropped
    assert rank4_shape((2, 8, 3, 4, 5)) == (2, 8, 3, 20)  # none: the last two merged


def test_ops_the_htp_takes_at_rank_5_are_left() -> None:
    model = frames_through_conv3d("Sigmoid")
    result, change = rank5_elementwise_at_rank_4(model)
    assert not change.changed and result is model


def test_the_htp_runs_a_rank_5_tanh_whole_quantized(tmp_path: Path) -> None:
    """Quantized and compiled by the real stages: whole on the HTP (before: the Tanh on the
    CPU, 2 partitions, compile's gate failed)."""
    from compile_fixtures import build_whole_on_htp

    build_whole_on_htp(tmp_path, "frames", frames_through_conv3d())


def layer_norm_at_rank_5(axis: int = -1) -> onnx.ModelProto:
    """A LayerNormalization over the trailing axes of a [1, 2, 3, 4, 8] tensor, then a MatMul
    by an [8, 6] weight (its output [1, 2, 3, 4, 6])."""
    rng = np.random.default_rng(6)
    c = numpy_helper.from_array
    normalized = [1, 2, 3, 4, 8][axis:]
    inits = [
        c((rng.standard_normal(normalized) * 0.5 + 1).astype(np.float32), "gamma"),
        c((rng.standard_normal(normalized) * 0.1).astype(np.float32), "beta"),
        c((rng.standard_normal((8, 6)) * 0.3).astype(np.float32), "w"),
    ]
    nodes = [
        oh.make_node("LayerNormalization", ["x", "gamma", "beta"], ["n"], axis=axis),
        oh.make_node("MatMul", ["n", "w"], ["y"]),
    ]
    return x_to_y(nodes, "ln5", [1, 2, 3, 4, 8], [1, 2, 3, 4, 6], inits)


@pytest.mark.parametrize("axis", [-1, 3, -3])
def test_a_rank_5_layer_norm_is_computed_at_rank_4_and_the_same(axis: int) -> None:
    """Its two leading axes merged, its normalized axes as they were (counted from the end)."""
    model = layer_norm_at_rank_5(axis)
    result, change = rank5_elementwise_at_rank_4(model)
    assert change.changed
    norm = next(n for n in result.graph.node if n.op_type == "LayerNormalization")
    assert [a.i for a in norm.attribute if a.name == "axis"] == [axis % 5 - 5]
    x = np.random.default_rng(1).standard_normal((1, 2, 3, 4, 8)).astype(np.float32)
    np.testing.assert_allclose(
        run(result, {"x": x})[0], run(model, {"x": x})[0], rtol=1e-5, atol=1e-5
    )
    left = rank5_elementwise_at_rank_4(layer_norm_at_rank_5(1))[1].details  # axis 1: left,
    assert [d.split(" ")[0] for d in left] == ["MatMul"]  # its MatMul by a weight merged


def test_the_htp_runs_a_rank_5_layer_norm_whole_quantized(tmp_path: Path) -> None:
    from compile_fixtures import build_whole_on_htp

    build_whole_on_htp(tmp_path, "ln5", layer_norm_at_rank_5())


@pytest.mark.parametrize("keepdims", [0, 1])
def test_a_rank_5_argmax_over_a_trailing_axis_is_computed_at_rank_4(keepdims: int) -> None:
    """A 3-D segmenter's class index over its last axis: the rank-5 context failed to finalize
    on the HTP (QNN_COMMON_ERROR_MEM_ALLOC); its leading axes merged, the same indices."""
    out_shape = [1, 2, 3, 4, 1] if keepdims else [1, 2, 3, 4]
    graph = oh.make_graph(
        [oh.make_node("ArgMax", ["x"], ["y"], axis=4, keepdims=keepdims)],
        "argmax5",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3, 4, 8])],
        [oh.make_tensor_value_info("y", TensorProto.INT64, out_shape)],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)
    result, change = rank5_elementwise_at_rank_4(model)
    assert [d.split(":")[1].strip() for d in change.details] == ["[1, 2, 3, 4, 8] -> [2, 3, 4, 8]"]
    argmax = next(n for n in result.graph.node if n.op_type == "ArgMax")
    assert [a.i for a in argmax.attribute if a.name == "axis"] == [-1]
    x = np.random.default_rng(2).standard_normal((1, 2, 3, 4, 8)).astype(np.float32)
    np.testing.assert_array_equal(run(result, {"x": x})[0], run(model, {"x": x})[0])


def upsampled_frames(mode: str = "nearest") -> onnx.ModelProto:
    """Conv3d-shaped frames [1, 3, 1, 8, 8] upsampled 2x in H and W by a rank-5 Resize (which
    the QNN EP leaves on the CPU), then another Conv3d."""
    rng = np.random.default_rng(7)
    c = numpy_helper.from_array
    inits = [
        c((rng.standard_normal((4, 3, 1, 3, 3)) * 0.3).astype(np.float32), "w1"),
        c((rng.standard_normal((2, 4, 1, 3, 3)) * 0.3).astype(np.float32), "w2"),
        c(np.array([1, 1, 1, 2, 2], np.float32), "scales"),
        c(np.array([], np.float32), "roi"),
    ]
    pads = [0, 1, 1, 0, 1, 1]
    nodes = [
        oh.make_node("Conv", ["x", "w1"], ["a"], pads=pads),
        oh.make_node("Resize", ["a", "roi", "scales"], ["up"], mode=mode),
        oh.make_node("Conv", ["up", "w2"], ["y"], pads=pads),
    ]
    return x_to_y(nodes, "upsampled", [1, 3, 1, 8, 8], [1, 2, 1, 16, 16], inits)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_a_rank_5_resize_of_frames_is_computed_at_rank_4_and_the_same(mode: str) -> None:
    """Its unit depth axis, not resized, dropped with its scale: the same values."""
    model = upsampled_frames(mode)
    result, change = rank5_elementwise_at_rank_4(model)
    assert [d.split(":")[1].strip() for d in change.details] == ["[1, 4, 1, 8, 8] -> [1, 4, 8, 8]"]
    x = np.random.default_rng(3).standard_normal((1, 3, 1, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(
        run(result, {"x": x})[0], run(model, {"x": x})[0], rtol=1e-6, atol=1e-6
    )


def test_a_rank_5_resize_of_its_unit_axis_is_left() -> None:
    model = upsampled_frames()
    scales = next(i for i in model.graph.initializer if i.name == "scales")
    scales.CopyFrom(numpy_helper.from_array(np.array([1, 1, 2, 2, 2], np.float32), "scales"))
    assert not rank5_elementwise_at_rank_4(model)[1].changed


def test_the_htp_runs_upsampled_frames_whole_quantized(tmp_path: Path) -> None:
    from compile_fixtures import build_whole_on_htp

    build_whole_on_htp(tmp_path, "upsampled", upsampled_frames())


def test_a_hardswish_spelled_out_at_rank_5_ends_at_rank_4() -> None:
    """x * Clip(x + 3, 0, 6) / 6 on Conv3d frames becomes a HardSwish late in preparation (after
    the first rank-5 pass), which the QNN EP refuses at rank 5 in fp16: the pass runs again."""
    from pipeline.core.config import InputsSection
    from pipeline.graph.prepare import prepare_model

    c = numpy_helper.from_array
    rng = np.random.default_rng(8)
    inits = [
        c((rng.standard_normal((4, 3, 1, 3, 3)) * 0.3).astype(np.float32), "w1"),
        c((rng.standard_normal((2, 4, 1, 3, 3)) * 0.3).astype(np.float32), "w2"),
        c(np.array(3.0, np.float32), "three"),
        c(np.array(0.0, np.float32), "zero"),
        c(np.array(6.0, np.float32), "six"),
    ]
    pads = [0, 1, 1, 0, 1, 1]
    nodes = [
        oh.make_node("Conv", ["x", "w1"], ["a"], pads=pads),
        oh.make_node("Add", ["a", "three"], ["shifted"]),
        oh.make_node("Clip", ["shifted", "zero", "six"], ["clipped"]),
        oh.make_node("Mul", ["a", "clipped"], ["scaled"]),
        oh.make_node("Div", ["scaled", "six"], ["hs"]),
        oh.make_node("Conv", ["hs", "w2"], ["y"], pads=pads),
    ]
    model = x_to_y(nodes, "hardswish5", [1, 3, 1, 8, 8], [1, 2, 1, 8, 8], inits)
    prepared, _ = prepare_model(model, InputsSection())
    inferred = onnx.shape_inference.infer_shapes(prepared)
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in inferred.graph.value_info}
    ranks |= {i.name: len(i.type.tensor_type.shape.dim) for i in prepared.graph.input}
    fused = [n for n in prepared.graph.node if n.op_type == "HardSwish"]
    assert fused and all(ranks[n.input[0]] == 4 for n in fused)
    x = np.random.default_rng(4).standard_normal((1, 3, 1, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(run(prepared, {"x": x})[0], run(model, {"x": x})[0], atol=1e-5)
