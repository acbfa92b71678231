"""Exact rewrites of numerically fragile patterns (pipeline/graph/numerics.py), checked in float."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.graph.numerics import (
    bounded_atan_ratios,
    finite_scatter_fills,
    log_of_large_gain,
    rewrite_sqrt_of_sigmoids,
    shifted_log_sum_exps,
    split_wide_means,
    thresholds_on_logits,
)

RNG = np.random.default_rng(20261122)


def _score_model(extra_use: bool = False, factors: int = 2) -> onnx.ModelProto:
    """sqrt(sigmoid(a) * sigmoid(b) [* sigmoid(c)]): a detection head's geometric-mean score."""
    names = "abc"[:factors]
    nodes = [helper.make_node("Sigmoid", [n], [f"p_{n}"], name=f"sig_{n}") for n in names]
    product = "p_a"
    for n in names[1:]:
        nodes.append(helper.make_node("Mul", [product, f"p_{n}"], [f"prod_{n}"], name=f"mul_{n}"))
        product = f"prod_{n}"
    nodes.append(helper.make_node("Sqrt", [product], ["score"], name="sqrt"))
    outputs = [helper.make_tensor_value_info("score", TensorProto.FLOAT, [1, 64])]
    if extra_use:  # a factor used elsewhere too: the rewrite must leave the graph alone
        outputs.append(helper.make_tensor_value_info("p_a", TensorProto.FLOAT, [1, 64]))
    graph = helper.make_graph(
        nodes,
        "score",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 64]) for n in names],
        outputs,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["score"], feeds)[0]


def test_sqrt_of_sigmoid_product_becomes_exp_of_softplus_sum_exactly():
    for factors in (2, 3):
        model = _score_model(factors=factors)
        rewritten, change = rewrite_sqrt_of_sigmoids(model)
        assert len(change.details) == 1 and f"product of {factors} sigmoids" in change.details[0]
        ops = [n.op_type for n in rewritten.graph.node]
        assert "Sqrt" not in ops and "Sigmoid" not in ops
        assert ops.count("Softplus") == factors and ops.count("Exp") == 1
        # Logits from confident background (-20) to confident object (+8): the tiny products
        # are where the original form loses everything in fp16.
        feeds = {n: RNG.uniform(-20, 8, (1, 64)).astype(np.float32) for n in "abc"[:factors]}
        original, got = _run(model, feeds), _run(rewritten, feeds)
        logits = np.stack([feeds[n].astype(np.float64) for n in feeds])
        truth = np.sqrt(np.prod(1.0 / (1.0 + np.exp(-logits)), axis=0))
        assert float(truth.min()) < 1e-6  # the range the rewrite is for
        # Same function: the rewrite matches float64 to float32 rounding, everywhere ...
        np.testing.assert_allclose(got, truth, rtol=1e-5, atol=1e-30)
        # ... and the original float32 graph within the lossless bound (onnxruntime's own
        # Sigmoid is an approximation that flushes large negative logits to 0).
        error = float(np.sum((original - got) ** 2))
        assert 10 * np.log10(float(np.sum(original.astype(np.float64) ** 2)) / error) > 60


def test_sqrt_rewrite_leaves_shared_factors_and_other_sqrts_alone():
    _, change = rewrite_sqrt_of_sigmoids(_score_model(extra_use=True))
    assert not change.details
    plain = helper.make_graph(
        [helper.make_node("Sqrt", ["x"], ["y"])],
        "plain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
    )
    model = helper.make_model(plain, opset_imports=[helper.make_opsetid("", 21)])
    _, change = rewrite_sqrt_of_sigmoids(model)
    assert not change.details


def _log_front_end(form: str, gain: float = 2.0**20, shared: bool = False) -> onnx.ModelProto:
    """x [1, 1, 256] -> a 16-bin STFT-like Conv -> |.| -> log(1 + gain * m) (``form`` "offset",
    either operand order) or log(gain * m) ("plain") -> a 1x1 Conv: Silero VAD v4's front end.
    ``shared``: the magnitude times the gain is also a graph output."""
    rng = np.random.default_rng(41)
    gain_first = form == "offset_swapped"
    nodes = [
        helper.make_node("Conv", ["x", "basis"], ["spec"], strides=[16], name="stft"),
        helper.make_node("Abs", ["spec"], ["mag"], name="abs"),
        helper.make_node("Mul", ["gain", "mag"] if gain_first else ["mag", "gain"], ["scaled"]),
    ]
    if form == "plain":
        nodes.append(helper.make_node("Log", ["scaled"], ["logs"], name="log"))
    else:
        operands = ["scaled", "one"] if gain_first else ["one", "scaled"]
        nodes.append(helper.make_node("Add", operands, ["lifted"], name="lift"))
        nodes.append(helper.make_node("Log", ["lifted"], ["logs"], name="log"))
    nodes.append(helper.make_node("Conv", ["logs", "mix"], ["y"], name="mix"))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16])]
    if shared:
        outputs.append(helper.make_tensor_value_info("scaled", TensorProto.FLOAT, [1, 16, 16]))
    inits = [
        numpy_helper.from_array(
            (rng.standard_normal((16, 1, 16)) * 0.25).astype(np.float32), "basis"
        ),
        numpy_helper.from_array((rng.standard_normal((4, 16, 1)) * 0.2).astype(np.float32), "mix"),
        numpy_helper.from_array(np.array(gain, np.float32), "gain"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
    ]
    graph = helper.make_graph(
        nodes,
        "front",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 256])],
        outputs,
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def _quiet_and_loud(count: int) -> list[np.ndarray]:
    """Frames from near silence (1e-6) to loud (1): the magnitudes span six decades."""
    rng = np.random.default_rng(42)
    return [
        (rng.standard_normal((1, 1, 256)) * 10.0 ** rng.uniform(-6, 0)).astype(np.float32)
        for _ in range(count)
    ]


@pytest.mark.parametrize("form", ["offset", "offset_swapped", "plain"])
def test_a_large_gain_is_taken_out_of_the_log(form: str) -> None:
    model = _log_front_end(form)
    rewritten, change = log_of_large_gain(model)
    assert change.changed
    ops = [n.op_type for n in rewritten.graph.node]
    assert "Mul" not in ops and ops.count("Log") == 1
    before, after = (
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        for m in (model, rewritten)
    )
    for x in _quiet_and_loud(4):
        want, got = before.run(["y"], {"x": x})[0], after.run(["y"], {"x": x})[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_a_small_gain_or_a_shared_product_stays() -> None:
    assert not log_of_large_gain(_log_front_end("offset", gain=100.0))[1].changed
    assert not log_of_large_gain(_log_front_end("offset", shared=True))[1].changed


def test_the_htp_runs_the_front_end_in_fp16_without_the_gain(tmp_path: Path) -> None:
    """Measured: as it is, the whole-fp16 ctx overflows in the gain product (Silero VAD v4:
    11.1 dB vs float); with the gain taken out of the Log it agrees."""
    from compile_fixtures import whole_ctx_vs_float

    model = _log_front_end("offset")
    models = {"float": model, "rewritten": log_of_large_gain(model)[0]}
    results = whole_ctx_vs_float(tmp_path, models, [{"x": x} for x in _quiet_and_loud(6)])
    assert results["rewritten"] > 30.0, results
    assert results["float"] < 10.0, results


def _masked(extra_use: bool = False) -> onnx.ModelProto:
    """Mask2Former's masked attention in small: sigmoid(mask logits), tiled over heads,
    compared with 0.5; the mask picks -100 or the scores. ``extra_use``: the probabilities
    are an output too."""
    nodes = [
        helper.make_node("Mul", ["x", "two"], ["logits"]),  # computed, as mask logits are
        helper.make_node("Sigmoid", ["logits"], ["p"]),
        helper.make_node("Unsqueeze", ["p", "axis"], ["p1"]),
        helper.make_node("Tile", ["p1", "repeats"], ["tiled"]),
        helper.make_node("Less", ["tiled", "half"], ["masked"]),
        helper.make_node("Where", ["masked", "fill", "scores"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(np.array(2.0, np.float32), "two"),
        numpy_helper.from_array(np.array([1], np.int64), "axis"),
        numpy_helper.from_array(np.array([1, 4, 1], np.int64), "repeats"),
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
        numpy_helper.from_array(np.array(-100.0, np.float32), "fill"),
        numpy_helper.from_array(
            np.random.default_rng(9).standard_normal((1, 4, 64)).astype(np.float32), "scores"
        ),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 64])]
    if extra_use:
        outputs.append(helper.make_tensor_value_info("p", TensorProto.FLOAT, [1, 64]))
    graph = helper.make_graph(
        nodes,
        "masked",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        outputs,
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


@pytest.mark.parametrize("extra_use", [False, True])
def test_a_threshold_on_sigmoids_compares_the_logits(extra_use: bool) -> None:
    """sigmoid(x) < 0.5 through an Unsqueeze and a Tile -> x < 0 through the same moves: the
    same mask (the sigmoid is increasing); a Sigmoid read elsewhere stays for that reader."""
    source = _masked(extra_use)
    rewritten, change = thresholds_on_logits(source)
    assert change.changed and "vs 0.5 -> the logits vs 0" in change.details[0]
    ops = [n.op_type for n in rewritten.graph.node]
    assert ("Sigmoid" in ops) == extra_use
    before = ort.InferenceSession(source.SerializeToString(), providers=["CPUExecutionProvider"])
    after = ort.InferenceSession(rewritten.SerializeToString(), providers=["CPUExecutionProvider"])
    for scale in (0.01, 1.0, 10.0):
        x = (RNG.standard_normal((1, 64)) * scale).astype(np.float32)
        for got, want in zip(after.run(None, {"x": x}), before.run(None, {"x": x}), strict=True):
            np.testing.assert_array_equal(got, want)
    assert not thresholds_on_logits(rewritten)[1].changed


@pytest.mark.qnn
def test_the_htp_flips_a_mask_near_its_threshold_and_not_on_logits(tmp_path: Path) -> None:
    """Measured on the simulator, in the judge's whole-fp16 form (every Sigmoid as
    exp(min(x, 0)) / (1 + exp(-|x|)), ``fp16_scale.exact_sigmoids``): logits within 0.05 of 0,
    as random weights leave Mask2Former's, flip where that sigmoid rounds across 0.5 (192 of
    5120 in Mask2Former); compared as logits, none."""
    from compile_fixtures import whole_ctx_vs_float

    from pipeline.graph.fp16_scale import exact_sigmoids
    from pipeline.htp.probe import qnn_available

    if qnn_available():
        pytest.skip(qnn_available())
    models = {
        "float": _masked(),
        "exact_sigmoids": exact_sigmoids(_masked())[0],
        "logits": exact_sigmoids(thresholds_on_logits(_masked())[0])[0],
    }
    x = (np.random.default_rng(4).uniform(-0.025, 0.025, (1, 64))).astype(np.float32)
    snr = whole_ctx_vs_float(tmp_path, models, [{"x": x}])
    assert snr["exact_sigmoids"] < 30.0 and snr["logits"] > 60.0, snr


def _max_pool_over_graphs(fill: float = -np.inf, reduction: str = "max") -> onnx.ModelProto:
    """PyG's global max pooling as PyTorch exports it: scatter_reduce(amax, include_self=False)
    of 6 nodes' features into 2 graphs by the batch vector, into a constant full of ``fill``."""
    nodes = [
        helper.make_node("Unsqueeze", ["batch", "axis"], ["column"]),
        helper.make_node("Expand", ["column", "shape"], ["index"]),
        helper.make_node(
            "ScatterElements", ["empty", "index", "x"], ["y"], axis=0, reduction=reduction
        ),
    ]
    inits = [
        numpy_helper.from_array(np.full((2, 4), fill, np.float32), "empty"),
        numpy_helper.from_array(np.array([1], np.int64), "axis"),
        numpy_helper.from_array(np.array([6, 4], np.int64), "shape"),
    ]
    graph = helper.make_graph(
        nodes,
        "pool",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 4]),
            helper.make_tensor_value_info("batch", TensorProto.INT64, [6]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


@pytest.mark.parametrize("dense", [True, False])
@pytest.mark.parametrize(("reduction", "fill"), [("max", -np.inf), ("min", np.inf)])
def test_a_max_scatter_into_infinity_takes_the_least_update_instead(
    reduction: str, fill: float, dense: bool, monkeypatch
) -> None:
    """Few groups (a readout): the max over the updates masked by their group, no scatter left;
    many (the limit lowered here): the scatter into the least update."""
    from pipeline.graph import numerics

    if not dense:
        monkeypatch.setattr(numerics, "_MASKED_ELEMENTS", 0)
    model = _max_pool_over_graphs(fill, reduction)
    rewritten, change = finite_scatter_fills(model)
    ops = [n.op_type for n in rewritten.graph.node]
    least = "ReduceMin" if reduction == "max" else "ReduceMax"
    if dense:
        assert change.changed and "ScatterElements" not in ops and "Where" in ops, ops
        assert ops[-1] == ("ReduceMax" if reduction == "max" else "ReduceMin")
    else:
        assert change.changed and ops[-3:] == [least, "Expand", "ScatterElements"], ops
    assert all(np.isfinite(numpy_helper.to_array(i)).all() for i in rewritten.graph.initializer)

    def run(m: onnx.ModelProto, batch: list[int]) -> np.ndarray:
        session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        x = RNG.standard_normal((6, 4)).astype(np.float32)
        return session.run(None, {"x": x, "batch": np.array(batch, np.int64)})

    # every graph gets a node (negative indices count from the end, as ScatterElements does)
    for batch in ([0, 0, 0, 1, 1, 1], [0, 1, 0, 1, 1, 0], [0, -1, 0, 1, -2, -1]):
        rng_state = RNG.bit_generator.state
        want = run(model, batch)[0]
        RNG.bit_generator.state = rng_state
        np.testing.assert_array_equal(run(rewritten, batch)[0], want)
    rng_state = RNG.bit_generator.state  # graph 1 gets none: the least (greatest) update
    want = run(model, [0] * 6)[0]
    RNG.bit_generator.state = rng_state
    got = run(rewritten, [0] * 6)[0]
    np.testing.assert_array_equal(got[0], want[0])
    assert np.isinf(want[1]).all() and np.isfinite(got[1]).all()


def test_a_scatter_into_finite_data_or_a_sum_stays() -> None:
    assert not finite_scatter_fills(_max_pool_over_graphs(0.0))[1].changed
    assert not finite_scatter_fills(_max_pool_over_graphs(-np.inf, "add"))[1].changed


@pytest.mark.qnn
def test_a_max_readout_over_graphs_builds_whole_on_the_htp(tmp_path: Path) -> None:
    """PyG's max pooling, by the real stages on real batch vectors: computed as a masked max
    (no scatter left) it is whole on the HTP and close to float there (as a ScatterElements, a
    molecular GNN's readout stayed on the CPU, QNN refusing it)."""
    from pipeline.__main__ import main
    from pipeline.core.layout import ModelPaths
    from pipeline.core.records import VariantRecord, read_record
    from pipeline.htp.probe import qnn_available

    if qnn_available():
        pytest.skip(qnn_available())
    onnx.save(_max_pool_over_graphs(), str(tmp_path / "pool.onnx"))
    (tmp_path / "calib").mkdir()
    rng = np.random.default_rng(7)
    for i in range(16):
        batch = np.sort(rng.integers(0, 2, 6))
        batch[0], batch[-1] = 0, 1  # every graph has a node
        x = rng.standard_normal((6, 4)).astype(np.float32)
        np.savez(tmp_path / "calib" / f"s{i:02d}.npz", x=x, batch=batch.astype(np.int64))
    config = tmp_path / "pool.toml"
    config.write_text(
        '[model]\nname = "pool"\nversion = "1.0.0"\nsource = "pool.onnx"\n'
        '[calibration]\nkind = "tensors"\npath = "calib"\nsamples = 16\nheld_out = 0.25\n'
        '[compile]\ntargets = ["snapdragon-x-elite"]\nmin_snr_db = 30.0\n',
        encoding="utf-8",
    )
    artifacts = tmp_path / "artifacts"
    for stage in ("quantize", "compile"):
        assert main([stage, "--artifacts", str(artifacts), str(config)]) == 0, stage
    folder = next(ModelPaths.of(artifacts, "pool").ctx.glob("*/snapdragon-x-elite"))
    record, why = read_record(VariantRecord, folder / "variant.json")
    assert record is not None and record.coverage is not None, why
    assert record.coverage.qnn_partitions == 1 and record.coverage.cpu_compute_nodes == []
    assert record.validation is not None and record.validation.worst_snr_vs_float_db > 30.0


def _means(height: int, width: int) -> onnx.ModelProto:
    """Reductions of a Sigmoid's output (one sided, as an image in [0, 1] is): a
    GlobalAveragePool, an AveragePool over the whole map, a ReduceMean (axes 2, -1; keepdims 0)
    and a ReduceSum (axes 2, 3), and a ReduceMean over the last axis alone."""
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["s"]),
        helper.make_node("GlobalAveragePool", ["s"], ["pooled"], name="pool"),
        helper.make_node(
            "AveragePool", ["s"], ["window"], kernel_shape=[height, width], name="window"
        ),
        helper.make_node("ReduceMean", ["s", "hw"], ["flat"], keepdims=0, name="moments"),
        helper.make_node("ReduceSum", ["s", "both"], ["total"], name="total"),
        helper.make_node("ReduceMean", ["s", "w"], ["rows"], name="rows"),
    ]
    inits = [
        numpy_helper.from_array(np.array([2, -1], np.int64), "hw"),
        numpy_helper.from_array(np.array([2, 3], np.int64), "both"),
        numpy_helper.from_array(np.array([3], np.int64), "w"),
    ]
    shapes = {
        "pooled": [1, 3, 1, 1],
        "window": [1, 3, 1, 1],
        "flat": [1, 3],
        "total": [1, 3, 1, 1],
        "rows": [1, 3, height, 1],
    }
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, d) for n, d in shapes.items()]
    graph = helper.make_graph(
        nodes,
        "means",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, height, width])],
        outputs,
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def test_a_mean_of_over_2_15_values_is_taken_in_two_stages_exactly() -> None:
    model = _means(256, 256)
    split, change = split_wide_means(model)
    assert [d.split(":")[0] for d in change.details] == [
        "GlobalAveragePool 'pool'",
        "AveragePool 'window'",
        "ReduceMean 'moments'",
        "ReduceSum 'total'",
    ]
    assert change.details[0] == (
        "GlobalAveragePool 'pool': 65536 values -> 256 x 256 in turn (the HTP's sum of over "
        "32768 overflows)"
    )
    ops = [n.op_type for n in split.graph.node]
    assert ops.count("ReduceMean") == 7 and ops.count("ReduceSum") == 2  # rows: one axis, left
    assert "GlobalAveragePool" not in ops and "AveragePool" not in ops
    x = RNG.standard_normal((1, 3, 256, 256)).astype(np.float32)
    runs = [
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"x": x}
        )
        for m in (model, split)
    ]
    for got, want in zip(runs[1], runs[0], strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5)
    assert not split_wide_means(split)[1].changed
    assert not split_wide_means(_means(128, 256))[1].changed  # 32768 values: within the sum


def test_a_long_axis_is_reduced_in_rows_exactly() -> None:
    """A clip's energy over 4 s of 16 kHz audio (64000 values on one axis) -> rows of 32000,
    then the 2 rows; a prime length, which no rows fold, is left as it is."""
    nodes = [
        helper.make_node("Mul", ["x", "x"], ["power"]),
        helper.make_node("ReduceMean", ["power", "last"], ["energy"], name="energy"),
        helper.make_node("ReduceSum", ["power", "last"], ["total"], keepdims=0, name="total"),
        helper.make_node("Mul", ["p", "p"], ["prime_power"]),
        helper.make_node("ReduceMean", ["prime_power", "last"], ["prime"], name="prime"),
    ]
    graph = helper.make_graph(
        nodes,
        "audio",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 64000]),
            helper.make_tensor_value_info("p", TensorProto.FLOAT, [1, 40009]),
        ],
        [
            helper.make_tensor_value_info("energy", TensorProto.FLOAT, [1, 2, 1]),
            helper.make_tensor_value_info("total", TensorProto.FLOAT, [1, 2]),
            helper.make_tensor_value_info("prime", TensorProto.FLOAT, [1, 1]),
        ],
        [numpy_helper.from_array(np.array([-1], np.int64), "last")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    split, change = split_wide_means(model)
    assert change.details == (
        "ReduceMean 'energy': 64000 values along one axis -> 2 rows of 32000, each row first "
        "(the HTP's sum of over 32768 overflows)",
        "ReduceSum 'total': 64000 values along one axis -> 2 rows of 32000, each row first "
        "(the HTP's sum of over 32768 overflows)",
    )
    feeds = {
        "x": RNG.standard_normal((1, 2, 64000)).astype(np.float32),
        "p": RNG.standard_normal((1, 40009)).astype(np.float32),
    }
    runs = [
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, feeds
        )
        for m in (model, split)
    ]
    for got, want in zip(runs[1], runs[0], strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5)
    assert not split_wide_means(split)[1].changed


def test_a_wide_reduction_is_grouped_from_its_last_axis() -> None:
    """Each stage sums at most 2^15 values (axes with their lengths, reduced last first)."""
    from pipeline.graph.numerics import _stages

    assert _stages([(2, 256), (3, 256)]) == [[3], [2]]
    assert _stages([(1, 32), (2, 480), (3, 640)]) == [[3], [1, 2]]  # AnimeGANv3's layer norm
    assert _stages([(1, 200), (2, 200), (3, 200)]) == [[3], [2], [1]]
    assert _stages([(2, 8), (3, 4096)]) == [[2, 3]]


@pytest.mark.qnn
def test_the_htp_sums_a_wide_quantized_mean_right_only_in_stages(tmp_path: Path) -> None:
    """A 16-bit GlobalAveragePool over 256x256 values in [0, 1] (zero point 0): the HTP's sum
    overflows (1.8 dB against the CPU QDQ model); the quantize stage's model, the mean split
    (``split_wide_means``), agrees. If a new QNN SDK sums it right, this says so."""
    from compile_fixtures import ctx_vs_qdq_on_htp, model_paths, quantize_on_noise

    x = RNG.uniform(0, 1, (1, 3, 256, 256)).astype(np.float32)
    step, mean_step = np.float32(1 / 65535), np.float32(0.6 / 65535)
    qdq = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("QuantizeLinear", ["x", "xs", "zero"], ["xq"]),
                helper.make_node("DequantizeLinear", ["xq", "xs", "zero"], ["xd"]),
                helper.make_node("GlobalAveragePool", ["xd"], ["m"]),
                helper.make_node("QuantizeLinear", ["m", "ms", "zero"], ["mq"]),
                helper.make_node("DequantizeLinear", ["mq", "ms", "zero"], ["y"]),
            ],
            "gap",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 256, 256])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 1, 1])],
            [
                numpy_helper.from_array(step, "xs"),
                numpy_helper.from_array(mean_step, "ms"),
                numpy_helper.from_array(np.uint16(0), "zero"),
            ],
        ),
        opset_imports=[helper.make_opsetid("", 21)],
        ir_version=10,
    )
    float_model = helper.make_model(
        helper.make_graph(
            [helper.make_node("GlobalAveragePool", ["x"], ["y"])],
            "gap",
            list(qdq.graph.input),
            list(qdq.graph.output),
        ),
        opset_imports=[helper.make_opsetid("", 21)],
        ir_version=10,
    )
    onnx.save(qdq, str(tmp_path / "qdq.onnx"))
    onnx.save(float_model, str(tmp_path / "float.onnx"))
    np.savez(tmp_path / "sample.npz", x=x)
    as_one = ctx_vs_qdq_on_htp(
        tmp_path / "qdq.onnx", tmp_path / "float.onnx", tmp_path / "sample.npz", tmp_path / "one"
    )
    pooled = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("Sigmoid", ["x"], ["s"]),
                helper.make_node("GlobalAveragePool", ["s"], ["y"]),
            ],
            "pooled",
            list(qdq.graph.input),
            list(qdq.graph.output),
        ),
        opset_imports=[helper.make_opsetid("", 21)],
        ir_version=10,
    )
    assert quantize_on_noise(tmp_path, "pooled", pooled, 'judge = "cpu"') == 0
    bucket = model_paths(tmp_path, "pooled").bucket("static")
    sample = sorted(bucket.heldout.glob("sample_*.npz"))[0]
    staged = ctx_vs_qdq_on_htp(bucket.qdq, bucket.float_model, sample, tmp_path / "staged")
    assert staged > 60.0, staged
    assert as_one < 20.0, f"the HTP sums a wide mean right now: {as_one:.1f} dB"


def _with_and_without(
    root: Path, monkeypatch: pytest.MonkeyPatch, step: str, name: str, model: onnx.ModelProto
) -> list[tuple[Any, Path]]:
    """``model`` through the quantize stage on noise (CPU judge, no gate), with the preparation
    step ``numerics.<step>`` and then with it switched off: each build's static bucket and
    folder."""
    from compile_fixtures import model_paths, quantize_on_noise

    from pipeline.graph import numerics

    built = []
    for label in ("with", "without"):
        if label == "without":
            monkeypatch.setattr(numerics, step, lambda m: (m, numerics.Change(step)))
        folder = root / label
        folder.mkdir()
        assert quantize_on_noise(folder, name, model, 'judge = "cpu"\nmin_snr_db = 0.0') == 0
        built.append((model_paths(folder, name).bucket("static"), folder))
    return built


@pytest.mark.qnn
def test_the_htp_sums_a_long_axis_right_only_in_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A quantized ReduceMean of 131072 Sigmoid outputs along one axis: as one sum the HTP
    overflows (3.0 dB against the CPU QDQ model), in rows it agrees (86.8). Both through the
    quantize stage, the first with the rule switched off. If a new QNN SDK sums it right, this
    says so."""
    from compile_fixtures import ctx_vs_qdq_on_htp

    model = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("Sigmoid", ["x"], ["p"]),
                helper.make_node("ReduceMean", ["p", "last"], ["y"]),
            ],
            "long",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 131072])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 1])],
            [numpy_helper.from_array(np.array([2], np.int64), "last")],
        ),
        opset_imports=[helper.make_opsetid("", 21)],
        ir_version=10,
    )
    results = {}
    built = _with_and_without(tmp_path, monkeypatch, "split_wide_means", "long", model)
    for label, (bucket, folder) in zip(("rows", "one_sum"), built, strict=True):
        ops = [n.op_type for n in onnx.load(str(bucket.float_model)).graph.node]
        assert (ops.count("ReduceMean") == 2) == (label == "rows"), ops
        sample = sorted(bucket.heldout.glob("sample_*.npz"))[0]
        results[label] = ctx_vs_qdq_on_htp(bucket.qdq, bucket.float_model, sample, folder / "w")
    assert results["rows"] > 60.0, results
    assert results["one_sum"] < 20.0, f"the HTP sums a long axis right now: {results}"


def _atan2(exporter: str, divisor: str = "computed", shared: bool = False) -> onnx.ModelProto:
    """A Conv whose two channels are y and x, then atan2(y, x) as ``exporter`` writes it:
    "torch" (Div, Atan, +-pi by the signs), "tf2onnx" (x + sign(x)^2 - 1 against a 0 divisor,
    the angle times sign(x)^2, +-pi after) or "atan" (Atan(y / x) alone). ``divisor``
    "constant" divides by a constant instead; ``shared``: the quotient is an output too."""
    rng = np.random.default_rng(5)
    inits = [
        numpy_helper.from_array((rng.standard_normal((2, 4, 3, 3)) * 0.3).astype(np.float32), "w"),
        numpy_helper.from_array(np.array(np.pi, np.float32), "pi"),
        numpy_helper.from_array(np.array(np.pi / 2, np.float32), "half_pi"),
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        numpy_helper.from_array(np.array(0.7, np.float32), "fixed"),
    ]
    make = helper.make_node
    nodes = [
        make("Conv", ["a", "w"], ["c"], pads=[1, 1, 1, 1]),
        make("Split", ["c"], ["y", "x"], axis=1, num_outputs=2),
    ]
    x = "x" if divisor == "computed" else "fixed"
    if exporter == "tf2onnx":
        nodes += [
            make("Sign", ["x"], ["sx"]),
            make("Mul", ["sx", "sx"], ["sx2"]),
            make("Sub", ["sx2", "one"], ["sx2m1"]),
            make("Add", ["x", "sx2m1"], ["safe_x"]),
        ]
        x = "safe_x"
    nodes += [make("Div", ["y", x], ["slope"]), make("Atan", ["slope"], ["atan"])]
    out = "atan"
    if exporter == "torch":
        nodes += [
            make("Add", ["atan", "pi"], ["plus"]),
            make("Sub", ["atan", "pi"], ["minus"]),
            make("Greater", ["y", "zero"], ["upper"]),
            make("Where", ["upper", "plus", "minus"], ["left"]),
            make("Less", ["x", "zero"], ["is_left"]),
            make("Where", ["is_left", "left", "atan"], ["angle"]),
        ]
        out = "angle"
    elif exporter == "tf2onnx":
        nodes += [
            make("Mul", ["sx2", "atan"], ["kept"]),
            make("Sign", ["y"], ["sy"]),
            make("Sub", ["one", "sx"], ["one_m_sx"]),
            make("Mul", ["sy", "one_m_sx"], ["turn"]),
            make("Mul", ["turn", "half_pi"], ["offset"]),
            make("Add", ["kept", "offset"], ["angle"]),
        ]
        out = "angle"
    outputs = [helper.make_tensor_value_info(out, TensorProto.FLOAT, [1, 1, 32, 32])]
    if shared:
        outputs.append(helper.make_tensor_value_info("slope", TensorProto.FLOAT, [1, 1, 32, 32]))
    graph = helper.make_graph(
        nodes,
        "atan2",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, 4, 32, 32])],
        outputs,
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _fields(count: int) -> list[dict[str, np.ndarray]]:
    """Seeded noise fields; among the first four, some pixel's |y / x| exceeds fp16's 65504."""
    return [
        {"a": np.random.default_rng(seed).standard_normal((1, 4, 32, 32)).astype(np.float32)}
        for seed in range(count)
    ]


@pytest.mark.parametrize("exporter", ["torch", "tf2onnx", "atan"])
def test_atan_of_a_quotient_is_taken_from_a_ratio_in_0_1(exporter: str) -> None:
    """The same angles in float (to rounding), where x is 0 (+-pi/2, as atan(+-inf)) and on
    every octant; the quotient and its Div are gone."""
    source = _atan2(exporter)
    rewritten, change = bounded_atan_ratios(source)
    assert len(change.details) == 1 and "min(|y|, |x|) / max(|y|, |x|)" in change.details[0]
    assert "slope" not in {o for n in rewritten.graph.node for o in n.output}
    before = ort.InferenceSession(source.SerializeToString(), providers=["CPUExecutionProvider"])
    after = ort.InferenceSession(rewritten.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = _fields(3)
    # A zero input: y = x = 0 everywhere (torch's quotient is NaN there, left out below).
    feeds.append({"a": np.zeros((1, 4, 32, 32), np.float32)})
    for feed in feeds:
        (want,), (got,) = before.run(None, feed), after.run(None, feed)
        finite = np.isfinite(want)
        np.testing.assert_allclose(got[finite], want[finite], atol=2e-6)
        assert np.all(np.abs(got) <= np.pi + 1e-6)
    axis = helper.make_graph(
        [
            helper.make_node("Div", ["y", "x"], ["slope"]),
            helper.make_node("Atan", ["slope"], ["angle"]),
        ],
        "axes",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [8]) for n in ("y", "x")],
        [helper.make_tensor_value_info("angle", TensorProto.FLOAT, [8])],
    )
    plain = helper.make_model(axis, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    rewritten, change = bounded_atan_ratios(plain)  # graph inputs are computed tensors too
    assert change.changed
    y = np.array([1, -1, 0, 2, -3, 0.5, -0.5, 0], np.float32)
    x = np.array([0, 0, 1, -2, -1, 4, -4, 0], np.float32)
    session = ort.InferenceSession(
        rewritten.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    (got,) = session.run(None, {"y": y, "x": x})
    with np.errstate(divide="ignore"):
        want = np.arctan(y[:7].astype(np.float64) / x[:7])
    np.testing.assert_allclose(got[:7], want, atol=1e-6)
    assert got[7] == 0.0  # the origin's angle, where torch's y / x is NaN


def test_a_constant_divisor_or_a_shared_quotient() -> None:
    """A constant divisor keeps the quotient in y's range: nothing to do. A quotient read
    elsewhere stays for that reader; the Atan still takes the bounded form."""
    assert not bounded_atan_ratios(_atan2("torch", divisor="constant"))[1].changed
    rewritten, change = bounded_atan_ratios(_atan2("torch", shared=True))
    assert change.changed
    assert "slope" in {o for n in rewritten.graph.node for o in n.output}


@pytest.mark.qnn
def test_the_htp_takes_atan2_from_a_bounded_ratio(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Measured on the simulator: unquantized (fp16), the quotient's atan2 is -61 dB from the
    float model and the bounded form 65 dB; quantized by the quantize stage on noise (its
    mixed precision raising nothing: both meet the target on the CPU), 31.3 dB against 45.2.
    The angle is compared around the circle (``metrics.the_short_way_round``)."""
    from compile_fixtures import whole_ctx_vs_float

    from pipeline.htp.probe import probe, qnn_available

    if qnn_available():
        pytest.skip(qnn_available())
    source = _atan2("torch")
    models = {"float": source, "bounded": bounded_atan_ratios(source)[0]}
    (tmp_path / "fp16").mkdir()
    fp16 = whole_ctx_vs_float(tmp_path / "fp16", models, _fields(4))
    assert fp16["bounded"] > 50.0 and fp16["float"] < 0.0, fp16
    quantized = {}
    built = _with_and_without(tmp_path, monkeypatch, "bounded_atan_ratios", "atan2", source)
    for label, (bucket, folder) in zip(("ratio", "quotient"), built, strict=True):
        samples = sorted(bucket.heldout.glob("sample_*.npz"))
        result = probe(bucket.qdq, bucket.float_model, samples, folder / "w", 60, 73)
        assert result.ok and result.partitions == 1 and result.cpu_nodes == 0, result.error
        quantized[label] = result.worst_ctx_vs_float
    report = json.loads((tmp_path / "with/artifacts/build/atan2/report.json").read_text("utf-8"))
    assert report["buckets"][0]["qdq_vs_float"]["angle"]["compared_as"] == "angles"
    assert quantized["ratio"] > 40.0 and quantized["quotient"] < quantized["ratio"] - 10, quantized


def _log_sum_exp(keepdims: int, axes: list[int] | None, shape: tuple[int, ...] = (1, 33, 34)):
    """x [1, 33, 34] @ a [34, 34] -> ReduceLogSumExp: a Sinkhorn step's log-normaliser."""
    inits = [numpy_helper.from_array(RNG.normal(0, 1, (34, 34)).astype(np.float32), "a")]
    inputs = ["scores"]
    reduced = range(len(shape)) if axes is None else axes
    out = [1 if d in reduced else n for d, n in enumerate(shape) if keepdims or d not in reduced]
    if axes is not None:
        inits.append(numpy_helper.from_array(np.array(axes, np.int64), "axes"))
        inputs.append("axes")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "a"], ["scores"]),
            helper.make_node("ReduceLogSumExp", inputs, ["y"], keepdims=keepdims),
        ],
        "log_sum_exp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize(("keepdims", "axes"), [(1, [2]), (0, [1]), (0, [1, 2]), (1, None)])
def test_a_log_sum_exp_is_shifted_by_its_max_and_the_same(keepdims: int, axes: list[int] | None):
    """Up to float rounding, also where exp(x) itself overflows float32 (x ~ 100)."""
    model = _log_sum_exp(keepdims, axes)
    rewritten, change = shifted_log_sum_exps(model)
    assert change.changed and "max(x)" in change.details[0]
    assert "ReduceLogSumExp" not in {n.op_type for n in rewritten.graph.node}
    for scale in (1.0, 12.0):
        feeds = {"x": (RNG.normal(0, scale, (1, 33, 34))).astype(np.float32)}
        expected, got = _outputs(model, feeds), _outputs(rewritten, feeds)
        assert expected.shape == got.shape
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.qnn
def test_a_log_sum_exp_builds_whole_and_quantized(tmp_path: Path) -> None:
    """The QNN EP takes no quantized ReduceLogSumExp (a matcher's 40: 41 partitions); shifted
    by its max it is whole on the HTP, quantized."""
    from compile_fixtures import build_whole_on_htp

    # judged on the CPU: the quantized model is compiled, not an fp16 fallback the HTP judge picks
    build_whole_on_htp(tmp_path, "log_sum_exp", _log_sum_exp(0, [2]), quantization='judge = "cpu"')


def _outputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def _point_prompts() -> onnx.ModelProto:
    """A SAM-style prompt encoder: points [1, 6, 2] with float labels [1, 6] (-1: padding, 0:
    background, 1: foreground); each point's Fourier features, replaced by a learned embedding
    where label == -1, plus a label embedding where label == 1, and a count of foreground
    points (label >= 1, and > 0.5 as a float threshold on a computed mean, left alone)."""
    rng = np.random.default_rng(7)
    inits = [
        numpy_helper.from_array(rng.normal(0, 1, (2, 16)).astype(np.float32), "gauss"),
        numpy_helper.from_array(rng.normal(0, 1, (32,)).astype(np.float32), "not_a_point"),
        numpy_helper.from_array(rng.normal(0, 1, (32,)).astype(np.float32), "foreground"),
        numpy_helper.from_array(rng.normal(0, 0.2, (32, 8)).astype(np.float32), "proj"),
        numpy_helper.from_array(np.array(-1.0, np.float32), "minus_one"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        numpy_helper.from_array(np.array(0.5, np.float32), "half_mean"),
        numpy_helper.from_array(np.array([-1], np.int64), "last"),
    ]
    nodes = [
        helper.make_node("MatMul", ["points", "gauss"], ["angles"]),
        helper.make_node("Sin", ["angles"], ["sin"]),
        helper.make_node("Cos", ["angles"], ["cos"]),
        helper.make_node("Concat", ["sin", "cos"], ["fourier"], axis=-1),
        helper.make_node("Unsqueeze", ["labels", "last"], ["label"]),
        helper.make_node("Equal", ["label", "minus_one"], ["padding"]),
        helper.make_node("Where", ["padding", "not_a_point", "fourier"], ["embedded"]),
        helper.make_node("Equal", ["label", "one"], ["is_foreground"]),
        helper.make_node("Cast", ["is_foreground"], ["foreground_weight"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["foreground_weight", "foreground"], ["label_embedding"]),
        helper.make_node("Add", ["embedded", "label_embedding"], ["tokens"]),
        helper.make_node("MatMul", ["tokens", "proj"], ["y"]),
        helper.make_node("GreaterOrEqual", ["labels", "one"], ["positive"]),
        helper.make_node("Cast", ["positive"], ["positive_float"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["positive_float"], ["count"], keepdims=0),
        helper.make_node("ReduceMean", ["points"], ["mean"], keepdims=0),
        helper.make_node("Greater", ["mean", "half_mean"], ["right_half"]),
        helper.make_node("Cast", ["right_half"], ["side"], to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(
        nodes,
        "prompts",
        [
            helper.make_tensor_value_info("points", TensorProto.FLOAT, [1, 6, 2]),
            helper.make_tensor_value_info("labels", TensorProto.FLOAT, [1, 6]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, 8]),
            helper.make_tensor_value_info("count", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("side", TensorProto.FLOAT, []),
        ],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _prompt_samples(count: int, seed: int = 3) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    samples = []
    for k in range(count):
        labels = np.full((1, 6), -1.0, np.float32)
        labels[0, : 1 + k % 5] = rng.integers(0, 2, 1 + k % 5)
        samples.append(
            {"points": rng.uniform(0, 1, (1, 6, 2)).astype(np.float32), "labels": labels}
        )
    return samples


def _all_outputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def test_comparisons_of_integer_labels_get_a_half_margin_and_mean_the_same() -> None:
    from pipeline.graph.numerics import compared_float_inputs, integer_comparisons

    model = _point_prompts()
    assert compared_float_inputs(model) == {"labels"}  # the points reach one through a mean
    rewritten, change = integer_comparisons(model, {"labels"})
    assert len(change.details) == 3  # both Equals and the >=; the float threshold stays
    assert not any("Greater '" in d and "right_half" in d for d in change.details)
    ops = [n.op_type for n in rewritten.graph.node]
    assert "Equal" not in ops and "GreaterOrEqual" not in ops and "Greater" in ops
    for feeds in _prompt_samples(6):
        for got, want in zip(
            _all_outputs(rewritten, feeds), _all_outputs(model, feeds), strict=True
        ):
            np.testing.assert_array_equal(got, want)
        # what quantization does to the labels (-1.00002, 1.00001): the same answers still
        rounded = dict(feeds, labels=feeds["labels"] * np.float32(1.00002))
        np.testing.assert_array_equal(
            _all_outputs(rewritten, rounded)[0], _all_outputs(model, feeds)[0]
        )
    assert not integer_comparisons(model, set())[1].changed  # labels not known to be integers


@pytest.mark.qnn
def test_a_prompt_encoder_with_float_labels_builds_quantized_with_its_comparisons(
    tmp_path: Path,
) -> None:
    """End to end: the labels are integer-valued on every sample, so the quantize stage writes
    the margins; quantized, Equal(label, -1) was false for every padding point."""
    from pipeline.__main__ import main
    from pipeline.core.layout import ModelPaths

    onnx.save(_point_prompts(), str(tmp_path / "prompts.onnx"))
    (tmp_path / "t").mkdir()
    for index, sample in enumerate(_prompt_samples(24)):
        np.savez(tmp_path / "t" / f"{index:03d}.npz", **sample)
    config = tmp_path / "prompts.toml"
    config.write_text(
        '[model]\nname = "prompts"\nversion = "1.0.0"\nsource = "prompts.onnx"\n'
        '[calibration]\nkind = "tensors"\npath = "t"\nsamples = 24\nheld_out = 0.25\n'
        '[quantization]\njudge = "cpu"\n[compile]\ntargets = ["snapdragon-x-elite"]\n',
        encoding="utf-8",
    )
    assert main(["quantize", "--artifacts", str(tmp_path / "a"), str(config)]) == 0
    folder = ModelPaths.of(tmp_path / "a", "prompts").report.parent
    report = json.loads((folder / "report.json").read_text())
    steps = {entry["step"]: entry["details"] for entry in report["prepare"]}
    assert len(steps["integer_comparisons"]) == 3, steps.get("integer_comparisons")
    assert report["worst_snr_db"] > 30.0, report["worst_snr_db"]


def _gathered_at_computed_positions(perturb: float = 1.0, compare: bool = True) -> onnx.ModelProto:
    """x [1, 8, 32] -> each row's value at a position the model computes (Floor(31 *
    sigmoid(mean))), and (``compare``) whether that position is the middle one (Equal to 15).
    ``perturb`` scales the Floor's output the way quantization moves it (2.99998 for 3)."""
    nodes = [
        helper.make_node("ReduceMean", ["x", "last"], ["mean"], keepdims=1),
        helper.make_node("Sigmoid", ["mean"], ["share"]),
        helper.make_node("Mul", ["share", "span"], ["spot"]),
        helper.make_node("Floor", ["spot"], ["position"]),
        helper.make_node("Mul", ["position", "perturb"], ["read"]),
        helper.make_node("Cast", ["read"], ["index"], to=TensorProto.INT64),
        helper.make_node("GatherElements", ["x", "index"], ["y"], axis=2),
        helper.make_node("Equal", ["read", "middle"], ["at_middle"]),
        helper.make_node("Cast", ["at_middle"], ["centred"], to=TensorProto.FLOAT),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 1])]
    if compare:
        outputs.append(helper.make_tensor_value_info("centred", TensorProto.FLOAT, [1, 8, 1]))
    else:
        del nodes[-2:]
    graph = helper.make_graph(
        nodes,
        "positions",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 32])],
        outputs,
        [
            numpy_helper.from_array(np.array([2], np.int64), "last"),
            numpy_helper.from_array(np.array(31.0, np.float32), "span"),
            numpy_helper.from_array(np.array(perturb, np.float32), "perturb"),
            numpy_helper.from_array(np.array(15.0, np.float32), "middle"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _positions_samples(count: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(11)
    # row means spread over (-3, 3): positions over most of 0..30, some rows at 15
    means = rng.uniform(-3, 3, (count, 1, 8, 1)).astype(np.float32)
    means[:, 0, 0, 0] = 0.0  # Floor(31 * 0.5) = 15
    noise = rng.normal(0, 1, (count, 1, 8, 32)).astype(np.float32)
    noise -= noise.mean(axis=-1, keepdims=True)
    return [{"x": m + n} for m, n in zip(means, noise, strict=True)]


def test_casts_and_comparisons_of_rounded_values_get_a_half_margin() -> None:
    """A Floor's output holds integers: the Cast of it gets a quarter's margin and the Equal
    a half's, so a 2.99998 (what quantization makes of 3) still reads 3; on exact integers
    nothing changes."""
    from pipeline.graph.numerics import integer_casts_with_margin

    for perturb in (1.0, 1.0 - 2e-5):
        model = _gathered_at_computed_positions(perturb)
        exact = _gathered_at_computed_positions()
        # a perturbing factor hides the integers: rewrite the exact model, then set its factor
        rewritten, change = integer_casts_with_margin(exact)
        assert len(change.details) == 2, change.details  # the Cast to int64 and the Equal
        perturb_init = next(i for i in rewritten.graph.initializer if i.name == "perturb")
        perturb_init.CopyFrom(numpy_helper.from_array(np.array(perturb, np.float32), "perturb"))
        for feeds in _positions_samples(8):
            want = _all_outputs(exact, feeds)
            assert want[1].any()  # the middle position is reached
            for got, expected in zip(_all_outputs(rewritten, feeds), want, strict=True):
                np.testing.assert_array_equal(got, expected)
        if perturb != 1.0:  # without the margins the moved integers read wrong
            feeds = _positions_samples(1)[0]
            truncated = _all_outputs(model, feeds)
            assert not np.array_equal(truncated[0], _all_outputs(exact, feeds)[0])
            assert not truncated[1].any()
    # a Cast of a computed float that is not known to hold integers stays a truncation
    plain = _gathered_at_computed_positions()
    for node in plain.graph.node:
        if node.op_type == "Floor":
            node.op_type = "Relu"
    assert not integer_casts_with_margin(plain)[1].changed


@pytest.mark.qnn
def test_positions_computed_by_a_floor_are_read_right_quantized(tmp_path: Path) -> None:
    """Quantized, Cast(Floor(..)) truncated 14.99998 to 14: the gathered values were wrong (ctx
    vs float 1.6 dB); with the margin the quantized ctx is whole on the HTP, 86.7 dB."""
    from compile_fixtures import build_whole_on_htp

    # judged on the CPU: the quantized model is compiled, not an fp16 fallback the HTP judge picks
    model = _gathered_at_computed_positions(compare=False)
    build_whole_on_htp(tmp_path, "positions", model, quantization='judge = "cpu"')


@pytest.mark.qnn
def test_positions_past_1024_are_cast_right_in_fp16_on_the_htp(tmp_path: Path) -> None:
    """The whole-fp16 candidate: integers from 1024 to 2048 are one apart in fp16, and a
    margin of a half made a tie that the HTP rounded to the even neighbour (every odd
    position read one too high); a quarter reads them all right."""
    from compile_fixtures import whole_ctx_vs_float

    nodes = [
        helper.make_node("Floor", ["at"], ["position"]),
        helper.make_node("Cast", ["position"], ["index"], to=TensorProto.INT64),
        helper.make_node("GatherElements", ["x", "index"], ["y"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "far_positions",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2048]),
            helper.make_tensor_value_info("at", TensorProto.FLOAT, [1, 64]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    from pipeline.graph.numerics import integer_casts_with_margin

    rewritten, change = integer_casts_with_margin(model)
    assert change.changed
    # a half's margin, for contrast: what the rule first wrote
    halved = onnx.ModelProto()
    halved.CopyFrom(rewritten)
    for init in halved.graph.initializer:
        if init.name.startswith("integer_cast_quarter"):
            init.CopyFrom(numpy_helper.from_array(np.array(0.5, np.float32), init.name))
    rng = np.random.default_rng(2)
    # unrelated neighbours, so one position off shows; odd and even positions past 1024
    samples = [
        {
            "x": rng.normal(0, 1, (1, 2048)).astype(np.float32),
            "at": rng.integers(1024, 2048, (1, 64)).astype(np.float32) + 0.25,
        }
        for _ in range(2)
    ]
    models = {"float": model, "rewritten": rewritten, "halved": halved}
    results = whole_ctx_vs_float(tmp_path, models, samples)
    assert results["rewritten"] > 60.0, results
    assert results["halved"] < 10.0, results
