"""pipeline.core.metrics: pooled SNR / max abs / cosine, float32 sums and their float64 fallback."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.core.metrics import OutputComparison, snr_db

RNG = np.random.default_rng(5)


def pooled(pairs: list[tuple[np.ndarray, np.ndarray]]):
    comparison = OutputComparison()
    for ref, test in pairs:
        comparison.add({"y": ref}, {"y": test})
    return comparison.summary()["y"]


def test_the_same_infinity_on_both_sides_is_left_out_and_one_sided_is_an_error() -> None:
    """Masked scores (-inf where a mask rules a position out, as a pitch tracker's bins
    outside its range): every implementation computes that -inf exactly, and summed it made
    the SNR nan; the finite positions carry the figure. An infinity on one side only stays
    an infinite error."""
    ref = RNG.standard_normal(1000).astype(np.float32)
    test = ref + (RNG.standard_normal(1000) * 1e-2).astype(np.float32)
    masked_ref, masked_test = ref.copy(), test.copy()
    masked_ref[::7] = masked_test[::7] = -np.inf
    keep = np.ones(1000, bool)
    keep[::7] = False
    got = pooled([(masked_ref, masked_test)])
    assert got.snr_db == pytest.approx(snr_db(ref[keep], test[keep]), abs=1e-3)
    assert np.isfinite(got.max_abs)
    masked_test[::7] = -65504.0  # the HTP's fp16 saturates the -inf it was given
    assert pooled([(masked_ref, masked_test)]).snr_db == pytest.approx(got.snr_db, abs=1e-3)
    masked_test[3] = -np.inf  # only the test has it
    assert pooled([(masked_ref, masked_test)]).snr_db == -np.inf


def test_a_finite_sentinel_is_left_out_where_the_test_keeps_it_beyond_the_rest() -> None:
    """torch's finfo.max as a fill (RT-DETR's invalid anchors, added to its box logits) is a
    mark, not a value: the HTP's fp16 holds 65504 or inf there, a quantized model a value
    above every real one; measured, it read 0 dB with a cosine of 1 and the judge kept a
    model at "0 dB". Left out there, the other positions carry the figure; a test that puts a
    mark among the real values is an infinite error."""
    ref = RNG.standard_normal(1000).astype(np.float32)
    test = ref + (RNG.standard_normal(1000) * 1e-2).astype(np.float32)
    keep = np.ones(1000, bool)
    keep[::9] = keep[4::9] = False
    expected = snr_db(ref[keep], test[keep])
    big = np.finfo(np.float32).max
    marked_ref = ref.copy()
    marked_ref[::9] = big
    marked_ref[4::9] = -big
    peak = float(np.abs(test[keep]).max())
    above = peak + np.linspace(0.0, 1.0, len(range(0, 1000, 9)), dtype=np.float32)
    for top in (65504.0, np.inf, peak, above):  # fp16, inf, a grid's upper part
        marked_test = test.copy()
        marked_test[::9] = top
        marked_test[4::9] = -top if np.isscalar(top) else -top[: len(marked_test[4::9])]
        got = pooled([(marked_ref, marked_test)])
        assert got.snr_db == pytest.approx(expected, abs=1e-3), top
        assert np.isfinite(got.max_abs) and got.cosine > 0.99
    marked_test = test.copy()
    marked_test[::9], marked_test[4::9] = 65504.0, -65504.0
    marked_test[9] = 0.0  # among the real values: the test lost that mark
    assert pooled([(marked_ref, marked_test)]).snr_db == -np.inf


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e6, 1e20])
def test_float32_sums_agree_with_float64(scale: float) -> None:
    """float32 BLAS sums (the fast path) give the float64 figures to 1e-3 dB; at 1e20 the
    float32 squares overflow and the float64 fallback takes over."""
    pairs = []
    for _ in range(3):
        ref = (RNG.standard_normal(50_000) * scale).astype(np.float32)
        noise = (RNG.standard_normal(50_000) * scale * 1e-3).astype(np.float32)
        pairs.append((ref, ref + noise))
    got = pooled(pairs)
    ref64 = np.concatenate([r.astype(np.float64) for r, _ in pairs])
    test64 = np.concatenate([t.astype(np.float64) for _, t in pairs])
    assert np.isfinite(got.snr_db) and abs(got.snr_db - snr_db(ref64, test64)) < 1e-3
    assert got.max_abs == pytest.approx(float(np.max(np.abs(ref64 - test64))), rel=1e-6)
    cos = float(ref64 @ test64 / np.sqrt((ref64 @ ref64) * (test64 @ test64)))
    assert got.cosine == pytest.approx(cos, abs=1e-6)


def test_identical_outputs_are_inf_and_nan_stays_visible() -> None:
    ref = RNG.standard_normal(100).astype(np.float32)
    assert pooled([(ref, ref.copy())]).snr_db == float("inf")
    broken = ref.copy()
    broken[3] = np.nan
    assert np.isnan(pooled([(ref, broken)]).snr_db)


def test_other_dtypes_take_the_float64_path() -> None:
    ref = RNG.standard_normal(1000)
    test = ref + 1e-9
    got = pooled([(ref, test), (ref.astype(np.float16), ref.astype(np.float16))])
    assert got.snr_db > 150  # float64 data keeps its precision


def test_quantized_integer_outputs_compare_as_the_values_they_stand_for(tmp_path) -> None:
    """A model with int8 outputs (TFLite int8 I/O): its integers are quantized values, not
    labels; compared as labels, two steps apart on 30% of the values read '70% agree' and
    no SNR gate applied."""
    import onnx
    import onnx.helper as oh
    from onnx import TensorProto, numpy_helper

    from pipeline.core.accuracy import LABELS
    from pipeline.core.metrics import quantized_output_grids

    graph = oh.make_graph(
        [oh.make_node("QuantizeLinear", ["x", "s", "z"], ["y"])],
        "g",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [oh.make_tensor_value_info("y", TensorProto.INT8, [4])],
        [
            numpy_helper.from_array(np.float32(0.5), "s"),
            numpy_helper.from_array(np.int8(-100), "z"),
        ],
    )
    path = tmp_path / "q.onnx"
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 13)]), str(path))
    grids = quantized_output_grids(path, None)
    assert grids == {"y": (0.5, -100)}
    reference = {"y": np.array([-100, -90, -80, -60], np.int8)}  # 0, 5, 10, 20
    test = {"y": np.array([-100, -90, -80, -61], np.int8)}  # 20 -> 19.5
    as_values = OutputComparison(grids)
    as_values.add(reference, test)
    (accuracy,) = as_values.summary().values()
    expected = snr_db(np.array([0.0, 5.0, 10.0, 20.0]), np.array([0.0, 5.0, 10.0, 19.5]))
    assert accuracy.compared_as is None and accuracy.snr_db == pytest.approx(expected)
    as_labels = OutputComparison()
    as_labels.add(reference, test)
    assert as_labels.summary()["y"].compared_as == LABELS  # without its grid: a label


def dead_head_model(path) -> None:
    """Two Tanh heads on QNN's fixed 16-bit grid (step 2/65536): a live one and one whose
    weights training drove to ~0, so every value it gives is ~1e-8 (an SSR-Net's stage
    offset, a note detector's onset probability on audio without notes)."""
    import onnx
    import onnx.helper as oh
    from onnx import TensorProto, numpy_helper

    step = np.float32(2 / 65536)
    nodes = []
    for head in ("live", "dead"):
        nodes += [
            oh.make_node("QuantizeLinear", [head, "step", "zero"], [f"{head}_q"]),
            oh.make_node("DequantizeLinear", [f"{head}_q", "step", "zero"], [f"{head}_out"]),
        ]
    graph = oh.make_graph(
        nodes,
        "heads",
        [oh.make_tensor_value_info(h, TensorProto.FLOAT, [64]) for h in ("live", "dead")],
        [oh.make_tensor_value_info(f"{h}_out", TensorProto.FLOAT, [64]) for h in ("live", "dead")],
        [numpy_helper.from_array(step, "step"), numpy_helper.from_array(np.int16(0), "zero")],
    )
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)]), str(path))


def test_an_output_below_its_step_is_judged_by_its_error_not_its_snr(tmp_path) -> None:
    """The CPU's 1e-8 against the NPU's 0 read 0 dB and failed the gate whatever the NPU did:
    an output every reference value of which lies within one step of its grid is judged by
    its largest error (two steps at most) and left out of the worst SNR and the pooled powers."""
    from pipeline.core.accuracy import BELOW_STEP, worst_snr
    from pipeline.core.metrics import output_steps

    path = tmp_path / "heads.onnx"
    dead_head_model(path)
    steps = output_steps(path)
    assert steps == {"live_out": pytest.approx(2 / 65536), "dead_out": pytest.approx(2 / 65536)}
    live = RNG.uniform(-1, 1, 64).astype(np.float32)
    dead = (RNG.standard_normal(64) * 1e-8).astype(np.float32)
    noisy_live = live + (RNG.standard_normal(64) * 1e-3).astype(np.float32)
    zeros = np.zeros(64, np.float32)
    one_step = np.full(64, 2 / 65536, np.float32)
    for test in (zeros, one_step):
        comparison = OutputComparison.for_models(path)
        comparison.add(
            {"live_out": live, "dead_out": dead}, {"live_out": noisy_live, "dead_out": test}
        )
        summary = comparison.summary()
        assert summary["dead_out"].compared_as == BELOW_STEP and summary["dead_out"].snr_db < 1.0
        assert worst_snr(summary) == summary["live_out"].snr_db > 40.0
        assert set(comparison.powers()) == {"live_out"}
    # Wrong by more than two steps: compared by its SNR, and the gate sees it.
    wrong = OutputComparison.for_models(path)
    wrong.add({"dead_out": dead}, {"dead_out": np.full(64, 0.01, np.float32)})
    (accuracy,) = wrong.summary().values()
    assert accuracy.compared_as is None and worst_snr(wrong.summary()) < -100.0


def test_without_a_grid_only_values_below_float16s_smallest_are_below_the_step() -> None:
    """A float output with no DequantizeLinear (the whole-fp16 candidate): float16 holds down to
    2^-24, so 1e-8 is zero to it and 1e-6 is a value, compared by its SNR."""
    from pipeline.core.accuracy import BELOW_STEP

    for size, kind in ((1e-8, BELOW_STEP), (1e-6, None)):
        ref = (RNG.standard_normal(64) * size).astype(np.float32)
        assert pooled([(ref, np.zeros_like(ref))]).compared_as == kind


def _angles_near_the_cut(count: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Directions in [-pi, pi], a tenth of them within 0.01 of the cut at +-pi, and the same
    directions with 0.002 of noise, wrapped back into [-pi, pi] as atan2 returns them."""
    rng = np.random.default_rng(3)
    reference = rng.uniform(-np.pi, np.pi, count)
    reference[: count // 10] = np.pi - rng.uniform(0, 0.01, count // 10)
    test = np.angle(np.exp(1j * (reference + rng.normal(0, 0.002, count))))
    return reference.astype(np.float32), test.astype(np.float32)


def test_angles_are_compared_the_short_way_round_the_circle() -> None:
    """An angle put just across the cut at +-pi is the same direction: as numbers it is an
    error of ~2 pi (the SNR measures the cut, ~18 dB here), around the circle it is the noise
    (~64 dB). Values that are not both angles keep their error."""
    from pipeline.core.accuracy import ANGLES

    reference, test = _angles_near_the_cut()
    plain, circular = OutputComparison(), OutputComparison(angles=["direction"])
    for comparison in (plain, circular):
        comparison.add({"direction": reference}, {"direction": test})
    as_numbers, around = plain.summary()["direction"], circular.summary()["direction"]
    assert as_numbers.snr_db < 25.0 and as_numbers.max_abs > 6.0, as_numbers
    assert around.snr_db > 55.0 and around.max_abs < 0.02, around
    assert around.compared_as == ANGLES and around.cosine > as_numbers.cosine
    wide = OutputComparison(angles=["direction"])  # a value outside [-pi, pi]: no angle
    wide.add({"direction": np.array([3.1, 10.0], np.float32)}, {"direction": np.array([-3.1, 3.0])})
    assert wide.summary()["direction"].max_abs == pytest.approx(7.0, abs=1e-5)
