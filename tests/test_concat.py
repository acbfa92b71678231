"""pipeline.graph.concat: a Split that takes apart what a Concat joined."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

from pipeline.graph.concat import split_of_concat

ANCHORS = 96


def joined_head(sizes: tuple[int, int] = (4, 3)) -> onnx.ModelProto:
    """A detector head: boxes in pixels (hundreds) and class probabilities (mostly ~1e-3) joined
    on the channels, laid out anchor-major, split again on the last axis into ``sizes``."""
    rng = np.random.default_rng(21)
    inits = [
        numpy_helper.from_array(rng.standard_normal((7, 8, 1)).astype(np.float32), "w"),
        numpy_helper.from_array(np.array([4, 3], np.int64), "channels"),
        numpy_helper.from_array(np.array(sizes, np.int64), "pieces"),
        numpy_helper.from_array(np.full((1, 4, 1), 200.0, np.float32), "pixels"),
        numpy_helper.from_array(np.full((1, 3, 1), -7.0, np.float32), "prior"),
    ]
    nodes = [
        oh.make_node("Conv", ["x", "w"], ["features"], "head", kernel_shape=[1]),
        oh.make_node("Split", ["features", "channels"], ["raw_boxes", "logits"], "parts", axis=1),
        oh.make_node("Mul", ["raw_boxes", "pixels"], ["boxes"], "scale"),
        oh.make_node("Add", ["logits", "prior"], ["shifted"], "bias"),
        oh.make_node("Sigmoid", ["shifted"], ["scores"], "sigmoid"),
        oh.make_node("Concat", ["boxes", "scores"], ["joined"], "join", axis=1),
        oh.make_node("Transpose", ["joined"], ["rows"], "layout", perm=[0, 2, 1]),
        oh.make_node("Split", ["rows", "pieces"], ["box_rows", "score_rows"], "cut", axis=-1),
    ]
    graph = oh.make_graph(
        nodes,
        "joined_head",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, ANCHORS])],
        [
            oh.make_tensor_value_info("box_rows", TensorProto.FLOAT, [1, ANCHORS, sizes[0]]),
            oh.make_tensor_value_info("score_rows", TensorProto.FLOAT, [1, ANCHORS, sizes[1]]),
        ],
        inits,
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


def run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


def test_a_split_undoing_a_concat_becomes_the_joined_tensors_moved() -> None:
    model = joined_head()
    rewritten, change = split_of_concat(model)
    assert len(change.details) == 1, change.details
    ops = collections.Counter(n.op_type for n in rewritten.graph.node)
    assert ops["Concat"] == 0 and ops["Split"] == 1 and ops["Transpose"] == 2  # the head's own
    x = np.random.default_rng(22).standard_normal((1, 8, ANCHORS)).astype(np.float32)
    for got, want in zip(run(rewritten, x), run(model, x), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_split_cutting_elsewhere_is_left() -> None:
    """Pieces of 3 and 4 out of a 4 + 3 join: each piece mixes both tensors."""
    model = joined_head((3, 4))
    same, change = split_of_concat(model)
    assert not change.changed and same is model


@pytest.mark.qnn
def test_the_split_head_keeps_its_probabilities_on_the_htp(tmp_path: Path) -> None:
    """Quantized, judged and compiled by the real stages: whole on the HTP, >= 30 dB on both
    outputs, and kept quantized (joined, the probabilities had the boxes' 16-bit grid, ~0.01 a
    step for values around 1e-3: 12.9 dB quantized, and the judge kept the model in fp16)."""
    from compile_fixtures import build_whole_on_htp, model_paths

    build_whole_on_htp(tmp_path, "joined_head", joined_head())
    kept = onnx.load(str(model_paths(tmp_path, "joined_head").bucket("static").qdq))
    assert "QuantizeLinear" in {n.op_type for n in kept.graph.node}
