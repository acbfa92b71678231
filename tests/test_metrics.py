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

    from pipeline.core.metrics import LABELS, quantized_output_grids

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
