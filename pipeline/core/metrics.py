"""Accuracy figures used by every stage: SNR (dB), max abs error and cosine similarity."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

_TINY = 1e-20


@dataclass(frozen=True)
class Accuracy:
    """How close one output is to its reference, pooled over samples."""

    snr_db: float  # inf when identical
    max_abs: float
    cosine: float


def snr_db(reference: np.ndarray, test: np.ndarray) -> float:
    """Signal-to-noise ratio of ``test`` against ``reference``; inf when they are identical."""
    ref = np.asarray(reference, dtype=np.float64).ravel()
    err = ref - np.asarray(test, dtype=np.float64).ravel()
    noise = float(np.sum(err * err))
    signal = float(np.sum(ref * ref))
    if noise <= _TINY:
        return float("inf")
    return 10.0 * np.log10(max(signal, _TINY) / noise)


def max_abs(reference: np.ndarray, test: np.ndarray) -> float:
    diff = np.asarray(reference, np.float64) - np.asarray(test, np.float64)
    return float(np.max(np.abs(diff))) if diff.size else 0.0


def cosine(reference: np.ndarray, test: np.ndarray) -> float:
    a = np.asarray(reference, dtype=np.float64).ravel()
    b = np.asarray(test, dtype=np.float64).ravel()
    denom = float(np.linalg.norm(a) * np.linalg.norm(b))
    if denom <= _TINY:
        return 1.0 if np.allclose(a, b) else 0.0
    return float(np.dot(a, b) / denom)


class OutputComparison:
    """Accumulates reference/test pairs per output over samples, without keeping the samples.

    SNR is computed over all samples pooled (sum of signal / sum of noise), which is steadier
    than averaging per-sample SNRs.
    """

    def __init__(self) -> None:
        self._signal: dict[str, float] = {}
        self._noise: dict[str, float] = {}
        self._max_abs: dict[str, float] = {}
        self._dot: dict[str, float] = {}
        self._norm_ref: dict[str, float] = {}
        self._norm_test: dict[str, float] = {}
        self.samples = 0

    def add(self, reference: Mapping[str, np.ndarray], test: Mapping[str, np.ndarray]) -> None:
        for name, ref in reference.items():
            r = np.asarray(ref, np.float64).ravel()
            t = np.asarray(test[name], np.float64).ravel()
            e = r - t
            self._signal[name] = self._signal.get(name, 0.0) + float(r @ r)
            self._noise[name] = self._noise.get(name, 0.0) + float(e @ e)
            worst = float(np.max(np.abs(e))) if e.size else 0.0
            self._max_abs[name] = max(self._max_abs.get(name, 0.0), worst)
            self._dot[name] = self._dot.get(name, 0.0) + float(r @ t)
            self._norm_ref[name] = self._norm_ref.get(name, 0.0) + float(r @ r)
            self._norm_test[name] = self._norm_test.get(name, 0.0) + float(t @ t)
        self.samples += 1

    def summary(self) -> dict[str, Accuracy]:
        """Per output: SNR, max abs error and cosine, pooled over the samples added."""
        result = {}
        for name in self._signal:
            noise = self._noise[name]
            snr = (
                float("inf")
                if noise <= _TINY
                else 10.0 * float(np.log10(max(self._signal[name], _TINY) / noise))
            )
            denom = float(np.sqrt(self._norm_ref[name] * self._norm_test[name]))
            cos = self._dot[name] / denom if denom > _TINY else 1.0
            result[name] = Accuracy(snr, self._max_abs[name], cos)
        return result


def worst_snr(summary: Mapping[str, Accuracy]) -> float:
    """The lowest SNR over the outputs; inf when there are none (nothing differs)."""
    return min((v.snr_db for v in summary.values()), default=float("inf"))
