"""Ops on rank-6 tensors computed at rank <= 5 (``graph.merged_axes``), then the reshapes on
either side of each rank-6 tensor joined (``rank.collapse_high_rank_reshapes``): the same
values bit for bit on onnxruntime, and no tensor above rank 5 left. The shapes are Hiera's
(mask units, q/k/v split, query pooling) and the other ops' forms around them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.graph import edit
from pipeline.graph.merged_axes import _transpose_steps, high_rank_ops_at_rank_5
from pipeline.graph.rank import collapse_high_rank_reshapes


def _int64(name: str, values: list[int]) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _model(
    nodes: list[onnx.NodeProto],
    x_shape: list[int],
    y_shapes: dict[str, list[int]],
    inits: list[onnx.TensorProto],
    y_type: int = TensorProto.FLOAT,
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info(n, y_type, s) for n, s in y_shapes.items()],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def _max_rank(model: onnx.ModelProto) -> int:
    values = edit.inferred_values(model)
    shapes = [edit.value_shape(v) for v in values.values()]
    return max(len(s) for s in shapes if s is not None)


def _run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


def _lowered(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    merged, change = high_rank_ops_at_rank_5(model)
    collapsed, _ = collapse_high_rank_reshapes(merged)
    return collapsed, list(change.details)


def _cases() -> dict[str, tuple[onnx.ModelProto, list[int]]]:
    """name -> (model, input shape): each reads x, makes a rank-6 tensor by a Reshape, does
    one op on it and gets back to rank <= 5 (the rank-6 inputs and outputs around the op)."""
    cases = {}
    # Hiera's mask units: no two axes stay together -> two transposes.
    cases["transpose_apart"] = (
        _model(
            [
                helper.make_node("Reshape", ["x", "s6"], ["b"]),
                helper.make_node("Transpose", ["b"], ["t"], perm=[0, 2, 4, 1, 3, 5]),
                helper.make_node("Reshape", ["t", "s4"], ["y"]),
            ],
            [4, 28, 28, 8],
            {"y": [16, 14, 14, 8]},
            [_int64("s6", [4, 14, 2, 14, 2, 8]), _int64("s4", [16, 14, 14, 8])],
        ),
        [4, 28, 28, 8],
    )
    # a transpose keeping two axes together: one transpose at rank 5
    cases["transpose_pair"] = (
        _model(
            [
                helper.make_node("Reshape", ["x", "s6"], ["b"]),
                helper.make_node("Transpose", ["b"], ["t"], perm=[0, 3, 1, 2, 4, 5]),
                helper.make_node("Reshape", ["t", "s4"], ["y"]),
            ],
            [2, 6, 20, 8],
            {"y": [2, 5, 6, 32]},
            [_int64("s6", [2, 3, 2, 5, 4, 8]), _int64("s4", [2, 5, 6, 32])],
        ),
        [2, 6, 20, 8],
    )
    # Hiera's q/k/v: Split along a leading 3, each squeezed to rank 5
    cases["split_squeeze"] = (
        _model(
            [
                helper.make_node("Reshape", ["x", "s6"], ["b"]),
                helper.make_node("Split", ["b", "sizes"], ["q", "k", "v"], axis=0),
                helper.make_node("Squeeze", ["q", "zero"], ["y0"]),
                helper.make_node("Squeeze", ["k", "zero"], ["y1"]),
                helper.make_node("Squeeze", ["v", "zero"], ["y2"]),
            ],
            [12, 49, 16, 8],
            {"y0": [1, 4, 49, 16, 8], "y1": [1, 4, 49, 16, 8], "y2": [1, 4, 49, 16, 8]},
            [
                _int64("s6", [3, 1, 4, 49, 16, 8]),
                _int64("sizes", [1, 1, 1]),
                _int64("zero", [0]),
            ],
        ),
        [12, 49, 16, 8],
    )
    # Hiera's query pooling: ReduceMax over one inner axis, keepdims 0
    for op in ("ReduceMax", "ReduceMean", "ReduceSum"):
        cases[f"{op}_inner"] = (
            _model(
                [
                    helper.make_node("Reshape", ["x", "s6"], ["b"]),
                    helper.make_node(op, ["b", "axes"], ["y"], keepdims=0),
                ],
                [1, 2, 49, 64, 8],
                {"y": [1, 2, 49, 16, 8]},
                [_int64("s6", [1, 2, 49, 4, 16, 8]), _int64("axes", [3])],
            ),
            [1, 2, 49, 64, 8],
        )
    # two adjacent axes reduced, kept
    cases["reduce_two_keepdims"] = (
        _model(
            [
                helper.make_node("Reshape", ["x", "s6"], ["b"]),
                helper.make_node("ReduceMax", ["b", "axes"], ["r"], keepdims=1),
                helper.make_node("Reshape", ["r", "s4"], ["y"]),
            ],
            [2, 3, 4, 30],
            {"y": [2, 3, 1, 5]},
            [
                _int64("s6", [2, 3, 2, 2, 6, 5]),
                _int64("axes", [2, 3, 4]),
                _int64("s4", [2, 3, 1, 5]),
            ],
        ),
        [2, 3, 4, 30],
    )
    # element-wise: a unary op, a broadcast against a per-channel constant and one over two axes
    channel = np.linspace(-1, 1, 8, dtype=np.float32).reshape(1, 1, 1, 1, 1, 8)
    block = np.linspace(0.5, 2, 15, dtype=np.float32).reshape(1, 3, 1, 5, 1, 1)
    cases["unary_and_broadcasts"] = (
        _model(
            [
                helper.make_node("Reshape", ["x", "s6"], ["b"]),
                helper.make_node("Tanh", ["b"], ["t"]),
                helper.make_node("Mul", ["t", "channel"], ["m"]),
                helper.make_node("Add", ["m", "block"], ["a"]),
                helper.make_node("Reshape", ["a", "s4"], ["y"]),
            ],
            [2, 6, 20, 8],
            {"y": [2, 6, 20, 8]},
            [
                _int64("s6", [2, 3, 2, 5, 4, 8]),
                numpy_helper.from_array(channel, "channel"),
                numpy_helper.from_array(block, "block"),
                _int64("s4", [2, 6, 20, 8]),
            ],
        ),
        [2, 6, 20, 8],
    )
    # Softmax over the last axis, a Slice of an inner axis, a Concat along it, a batched MatMul
    cases["softmax_slice_concat_matmul"] = (
        _model(
            [
                helper.make_node("Reshape", ["x", "s6"], ["b"]),
                helper.make_node("Softmax", ["b"], ["p"], axis=-1),
                helper.make_node("Slice", ["p", "starts", "ends", "axes"], ["s"]),
                helper.make_node("Concat", ["s", "p"], ["c"], axis=3),
                helper.make_node("Transpose", ["c"], ["ct"], perm=[0, 1, 2, 3, 5, 4]),
                helper.make_node("MatMul", ["c", "ct"], ["g"]),
                helper.make_node("Reshape", ["g", "s4"], ["y"]),
            ],
            [2, 6, 20, 8],
            {"y": [2, 6, 7, 16]},
            [
                _int64("s6", [2, 3, 2, 5, 4, 8]),
                _int64("starts", [1]),
                _int64("ends", [3]),
                _int64("axes", [3]),
                _int64("s4", [2, 6, 7, 16]),
            ],
        ),
        [2, 6, 20, 8],
    )
    # Gathers along an inner axis: a vector of positions, and the scalar positions the dynamo
    # exporter's adaptive average pooling picks window offsets with (a rank-5 output each)
    cases["gather_inner"] = (
        _model(
            [
                helper.make_node("Reshape", ["x", "s6"], ["b"]),
                helper.make_node("Gather", ["b", "index"], ["g"], axis=3),
                helper.make_node("Reshape", ["g", "s4"], ["y"]),
            ],
            [2, 6, 20, 8],
            {"y": [2, 6, 8, 8]},
            [
                _int64("s6", [2, 3, 2, 5, 4, 8]),
                _int64("index", [0, 2]),
                _int64("s4", [2, 6, 8, 8]),
            ],
        ),
        [2, 6, 20, 8],
    )
    return cases


def _windows(size: int, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Adaptive pooling's windows along one axis: [bins, longest] positions (the last valid
    one repeated) and which of them are inside."""
    starts = [(i * size) // bins for i in range(bins)]
    ends = [-(-(i + 1) * size // bins) for i in range(bins)]
    longest = max(e - s for s, e in zip(starts, ends, strict=True))
    offsets = np.arange(longest)
    positions = np.array(
        [np.minimum(s + offsets, e - 1) for s, e in zip(starts, ends, strict=True)]
    )
    inside = np.array([s + offsets < e for s, e in zip(starts, ends, strict=True)])
    return positions, inside


def adaptive_average_pool(x: np.ndarray, bins: tuple[int, int]) -> np.ndarray:
    """torch's adaptive_avg_pool2d in numpy: the reference."""
    (height, width), out = x.shape[2:], np.zeros((*x.shape[:2], *bins), np.float64)
    for i in range(bins[0]):
        top, bottom = (i * height) // bins[0], -(-(i + 1) * height // bins[0])
        for j in range(bins[1]):
            left, right = (j * width) // bins[1], -(-(j + 1) * width // bins[1])
            out[:, :, i, j] = x[:, :, top:bottom, left:right].mean(axis=(2, 3))
    return out


def adaptive_pool_selects(
    channels: int = 8, size: tuple[int, int] = (11, 16), bins: tuple[int, int] = (3, 3)
) -> onnx.ModelProto:
    """Adaptive average pooling as the dynamo exporter writes it where the sizes do not
    divide (torch's decomposition): the map transposed to [H, W, N, C], a GatherND of every
    window's positions ([bins, longest] each way: rank 6 with a leading bins), transposed to
    [N, C, bins, kh, bins, kw], the positions past each window's end masked to 0, a scalar
    Gather per row offset then per column offset (rank 5, then 4), summed, divided by each
    window's size. Fast-SCNN's and PSPNet's pyramid pooling (bins 3 and 6 of a 32 x 64 map)
    left 20 such Gathers and their Reshapes on the CPU in 2 partitions."""
    rows, rows_inside = _windows(size[0], bins[0])
    cols, cols_inside = _windows(size[1], bins[1])
    kh, kw = rows.shape[1], cols.shape[1]
    grid = np.stack(np.broadcast_arrays(rows[:, :, None, None], cols[None, None]), -1)
    counts = np.outer(rows_inside.sum(1), cols_inside.sum(1)).astype(np.float32)
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Transpose", ["r"], ["hwnc"], perm=[2, 3, 0, 1]),
        helper.make_node("GatherND", ["hwnc", "grid"], ["picked"]),
        helper.make_node("Transpose", ["picked"], ["windows"], perm=[4, 5, 0, 1, 2, 3]),
        helper.make_node("Where", ["rows_outside", "zero", "windows"], ["masked_rows"]),
        helper.make_node("Where", ["cols_outside", "zero", "masked_rows"], ["masked"]),
    ]
    for k in range(kh):
        nodes.append(helper.make_node("Gather", ["masked", f"i{k}"], [f"row{k}"], axis=3))
    nodes.append(helper.make_node("Sum", [f"row{k}" for k in range(kh)], ["rows"]))
    for k in range(kw):
        nodes.append(helper.make_node("Gather", ["rows", f"i{k}"], [f"col{k}"], axis=4))
    nodes += [
        helper.make_node("Sum", [f"col{k}" for k in range(kw)], ["total"]),
        helper.make_node("Div", ["total", "counts"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(grid.astype(np.int64), "grid"),
        numpy_helper.from_array(~rows_inside[:, :, None, None], "rows_outside"),
        numpy_helper.from_array(~cols_inside, "cols_outside"),
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
        numpy_helper.from_array(counts, "counts"),
    ]
    inits += [numpy_helper.from_array(np.array(k, np.int64), f"i{k}") for k in range(max(kh, kw))]
    return _model(nodes, [1, channels, *size], {"y": [1, channels, *bins]}, inits)


def test_adaptive_pool_selects_prepared_whole_rank_5_and_exact() -> None:
    """Through every preparation step: no tensor above rank 5 left, and the values are
    adaptive average pooling's (checked against numpy)."""
    from pipeline.core.config import InputsSection
    from pipeline.graph.prepare import prepare_model

    model = adaptive_pool_selects()
    assert _max_rank(model) == 6
    prepared, changes = prepare_model(model, InputsSection())
    assert _max_rank(prepared) <= 5
    merged = next(c for c in changes if c.step == "high_rank_ops_at_rank_5")
    assert sum(d.startswith("Gather") for d in merged.details) == 5  # the row offsets
    # ... which read one merged view of the windows (one Reshape, not one each)
    gathers = [n for n in prepared.graph.node if n.op_type == "Gather"]
    assert len(gathers) == 12 and len({n.input[0] for n in gathers}) == 3
    x = np.random.default_rng(9).normal(0, 1, (1, 8, 11, 16)).astype(np.float32)
    want = adaptive_average_pool(np.maximum(x, 0), (3, 3))
    np.testing.assert_allclose(_run(prepared, x)[0], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_run(model, x)[0], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(_cases()))
def test_rank_6_ops_compute_at_rank_5_with_the_same_values(name: str) -> None:
    model, shape = _cases()[name]
    assert _max_rank(model) == 6
    lowered, details = _lowered(model)
    assert details, "nothing rewritten"
    assert _max_rank(lowered) <= 5, [(n.op_type, n.name) for n in lowered.graph.node]
    onnx.checker.check_model(lowered, full_check=True)
    x = np.random.default_rng(7).normal(0, 1, shape).astype(np.float32)
    for want, got in zip(_run(model, x), _run(lowered, x), strict=True):
        np.testing.assert_array_equal(got, want)


def test_transpose_steps_cover_every_order_of_six_axes() -> None:
    """Every order of six axes of sizes > 1 is one transpose of at most five merged axes or
    two; each composes to the order asked for."""
    import itertools

    shape = [2, 3, 4, 5, 6, 7]
    for perm in itertools.permutations(range(6)):
        steps = _transpose_steps(shape, perm)
        assert steps is not None and len(steps) <= 2, perm
        order = list(range(6))
        for step in steps:
            order = [order[a] for a in step]
        assert order == list(perm)


def test_an_op_it_does_not_know_is_left(tmp_path: Path) -> None:
    """A rank-6 op outside its lists (a GatherElements along an inner axis) is left as it was."""
    index = np.zeros((2, 3, 2, 2, 4, 8), np.int64)
    model = _model(
        [
            helper.make_node("Reshape", ["x", "s6"], ["b"]),
            helper.make_node("GatherElements", ["b", "index"], ["g"], axis=3),
            helper.make_node("Reshape", ["g", "s4"], ["y"]),
        ],
        [2, 6, 20, 8],
        {"y": [2, 6, 8, 8]},
        [
            _int64("s6", [2, 3, 2, 5, 4, 8]),
            numpy_helper.from_array(index, "index"),
            _int64("s4", [2, 6, 8, 8]),
        ],
    )
    merged, change = high_rank_ops_at_rank_5(model)
    assert not change.changed and merged is model


def hiera_block() -> onnx.ModelProto:
    """Hiera's three rank-6 forms in one block: mask units (a transpose that keeps no two
    axes together), a q/k/v split along a leading 3 and squeezed, a query-pooling ReduceMax,
    with compute between them."""
    rng = np.random.default_rng(3)
    weight = numpy_helper.from_array(rng.normal(0, 0.5, (6, 6)).astype(np.float32), "w")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Reshape", ["h", "units"], ["u"]),
        helper.make_node("Transpose", ["u"], ["ut"], perm=[0, 2, 4, 1, 3, 5]),
        helper.make_node("Reshape", ["ut", "qkv"], ["packed"]),
        helper.make_node("Split", ["packed", "sizes"], ["q", "k", "v"], axis=0),
        helper.make_node("Squeeze", ["q", "zero"], ["q5"]),
        helper.make_node("Squeeze", ["k", "zero"], ["k5"]),
        helper.make_node("Squeeze", ["v", "zero"], ["v5"]),
        helper.make_node("Add", ["q5", "k5"], ["qk"]),
        helper.make_node("Mul", ["qk", "v5"], ["mixed"]),
        helper.make_node("Reshape", ["mixed", "pool_view"], ["pooled_view"]),
        helper.make_node("ReduceMax", ["pooled_view", "pool_axis"], ["y"], keepdims=0),
    ]
    inits = [
        weight,
        _int64("units", [4, 4, 2, 4, 2, 6]),
        _int64("qkv", [3, 1, 2, 2, 16, 8]),
        _int64("sizes", [1, 1, 1]),
        _int64("zero", [0]),
        _int64("pool_view", [1, 2, 2, 4, 4, 8]),
        _int64("pool_axis", [3]),
    ]
    return _model(nodes, [4, 8, 8, 6], {"y": [1, 2, 2, 4, 8]}, inits)


def test_hiera_block_is_the_same_at_rank_5() -> None:
    model = hiera_block()
    lowered, details = _lowered(model)
    assert [d.split(" ")[0] for d in details] == ["Transpose", "Split", "ReduceMax"]
    assert _max_rank(lowered) <= 5
    x = np.random.default_rng(8).normal(0, 1, (4, 8, 8, 6)).astype(np.float32)
    np.testing.assert_array_equal(_run(lowered, x)[0], _run(model, x)[0])


def test_the_htp_runs_a_hiera_block_whole_quantized(tmp_path: Path) -> None:
    """Quantized and compiled by the real stages: whole on the HTP (a Hiera classifier: 7
    partitions and 121 CPU nodes before, its rank-6 ops and their Q/DQ)."""
    from compile_fixtures import build_whole_on_htp

    build_whole_on_htp(tmp_path, "hiera_block", hiera_block())


def test_the_htp_runs_adaptive_pool_selects_whole_quantized(tmp_path: Path) -> None:
    """The dynamo exporter's adaptive average pooling (above) between two Convs, quantized
    and compiled by the real stages: whole on the HTP."""
    from compile_fixtures import build_whole_on_htp

    rng = np.random.default_rng(5)
    pool = adaptive_pool_selects()
    graph = pool.graph
    conv_in = numpy_helper.from_array(rng.normal(0, 0.4, (8, 8, 3, 3)).astype(np.float32), "w0")
    conv_out = numpy_helper.from_array(rng.normal(0, 0.4, (4, 8, 1, 1)).astype(np.float32), "w1")
    graph.initializer.extend([conv_in, conv_out])
    graph.node[0].input[0] = "features"
    graph.node.insert(0, helper.make_node("Conv", ["x", "w0"], ["features"], pads=[1, 1, 1, 1]))
    graph.node[-1].output[0] = "pooled"
    graph.node.append(helper.make_node("Conv", ["pooled", "w1"], ["y"]))
    graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 3, 3]))
    build_whole_on_htp(tmp_path, "adaptive_pool_selects", pool)
