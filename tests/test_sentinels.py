"""Marks among real values (finfo.max / inf fills): left out of calibrated ranges, saturating
when quantized, measured as marks (pipeline.calibration.ranges SENTINEL, core.metrics)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from compile_fixtures import build_whole_on_htp
from onnx import TensorProto, helper, numpy_helper

from pipeline.calibration.ranges import (
    activation_statistics,
    sentinel_constant_ranges,
    sentinel_tensors,
)

BIG = float(np.finfo(np.float32).max)


def anchored_boxes(fill: float = BIG) -> onnx.ModelProto:
    """RT-DETR's encoder head in small: box logits = features @ W + anchors, where the anchors
    of invalid positions are a fill (finfo.max in Hugging Face's export, inf in others), and
    boxes = Sigmoid(logits); both are outputs."""
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((16, 4)) * 0.5).astype(np.float32)
    anchors = rng.standard_normal((1, 64, 4)).astype(np.float32)
    anchors[0, ::8, :] = fill
    anchors[0, 5::16, 1] = -fill
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Add", ["h", "anchors"], ["logits"]),
        helper.make_node("Sigmoid", ["logits"], ["boxes"]),
    ]
    graph = helper.make_graph(
        nodes,
        "anchored_boxes",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 16])],
        [
            helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [1, 64, 4]),
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 64, 4]),
        ],
        [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(anchors, "anchors")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_ranges_without_sentinels_are_the_real_values() -> None:
    """MinMax over a finfo.max mark reaches 3.4e38 (a 16-bit step of 5e33); calibrated again
    without the marks, the range is the real values' (and 0), with the same extremes the
    marks' positions left out give."""
    model = anchored_boxes()
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.standard_normal((1, 64, 16)).astype(np.float32)} for _ in range(3)]
    names = ["h", "logits", "boxes"]
    plain = activation_statistics(model, feeds, names, range_names=names)
    assert sentinel_tensors(plain.ranges) == ["logits"]
    assert float(plain.ranges["logits"][1][0]) == BIG
    again = activation_statistics(
        model, feeds, ["logits"], range_names=["logits"], without_sentinels=True
    )
    anchors = numpy_helper.to_array(model.graph.initializer[1])
    real = np.abs(anchors) < 1e30
    values = [
        (f["x"] @ numpy_helper.to_array(model.graph.initializer[0]) + anchors)[real] for f in feeds
    ]
    low, high = again.ranges["logits"]
    assert float(low[0]) == min(0.0, min(float(v.min()) for v in values))
    assert abs(float(high[0]) - max(float(v.max()) for v in values)) < 1e-5
    assert np.isfinite(again.rms["logits"]) and again.rms["logits"] < 10
    assert not sentinel_tensors(again.ranges)


def test_a_marked_constant_is_quantized_on_its_real_range_stretched_past_its_marks() -> None:
    """The anchors' weight range: their real values' range, stretched on each mark's side by
    the span of the Add's output, so a mark still drives that output to its range's end. A
    constant read by an op that does not pass its values on (MatMul) is left alone."""
    model = anchored_boxes()
    anchors = numpy_helper.to_array(model.graph.initializer[1])
    real = anchors[np.abs(anchors) < 1e30]
    ranges = {"h": (-3.0, 3.0), "logits": (-5.0, 6.0), "boxes": (0.0, 1.0)}
    weights, names = sentinel_constant_ranges(model, ranges)
    assert names == ["anchors"]
    low, high = weights["anchors"]
    assert abs(high - (float(real.max()) + 11.0)) < 1e-6
    assert abs(low - (float(real.min()) - 11.0)) < 1e-6
    model.graph.node[1].op_type = "Mul"  # a product of a mark is no mark to saturate
    assert sentinel_constant_ranges(model, ranges) == ({}, [])


@pytest.mark.parametrize("fill", [BIG, float("inf")], ids=["finfo_max", "inf"])
def test_marked_anchors_build_whole_and_accurate_on_the_htp(tmp_path: Path, fill: float) -> None:
    """End to end on the simulator: the quantized model had a 5e33 (or infinite) scale, QDQ vs
    float 12 dB, and a finfo.max output read 0 dB with a cosine of 1; now it runs whole and
    both outputs pass 30 dB, the marks measured as marks (the logits output holds them)."""
    build_whole_on_htp(tmp_path, "anchored_boxes", anchored_boxes(fill))


def test_a_negative_mark_on_its_way_to_a_softmax_stays_for_the_mask_rules() -> None:
    """Attention scores plus a finfo.min mask: mask_fill_ranges finds the mask by the mark in
    its calibrated range and gives it the cut it needs below the scores; calibrated without
    the mark, the mask bias would read 0 and every masked score would count. So a negative
    mark that reaches a Softmax (through Add, Where, shape ops) is left in; a positive one,
    or one that reaches no Softmax, is taken out."""
    scores = helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 4, 8])
    mask = numpy_helper.from_array(
        np.where(np.arange(8) < 5, 0.0, -BIG).astype(np.float32).reshape(1, 1, 8), "mask"
    )
    nodes = [
        helper.make_node("Add", ["scores", "mask"], ["masked"]),
        helper.make_node("Reshape", ["masked", "shape"], ["flat"]),
        helper.make_node("Softmax", ["flat"], ["weights"], axis=-1),
        helper.make_node("Sigmoid", ["masked"], ["gates"]),
    ]
    shape = numpy_helper.from_array(np.array([4, 8], np.int64), "shape")
    graph = helper.make_graph(
        nodes,
        "masked_attention",
        [scores],
        [
            helper.make_tensor_value_info("weights", TensorProto.FLOAT, [4, 8]),
            helper.make_tensor_value_info("gates", TensorProto.FLOAT, [1, 4, 8]),
        ],
        [mask, shape],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    low, high = np.array([-BIG], np.float32), np.array([5.0], np.float32)
    ranges = {"masked": (low, high), "flat": (low, high), "gates": (np.zeros(1), np.ones(1))}
    assert sentinel_tensors(ranges) == ["masked", "flat"]
    assert sentinel_tensors(ranges, model) == []
    ranges["masked"] = (np.array([-5.0]), np.array([BIG]))  # a positive mark: an anchor's
    assert sentinel_tensors(ranges, model) == ["masked"]
    del model.graph.node[2]  # no Softmax: nothing to leave to the mask rules
    ranges["masked"] = (low, high)
    assert sentinel_tensors(ranges, model) == ["masked", "flat"]
