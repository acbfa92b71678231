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
