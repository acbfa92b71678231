"""NaN and infinity in a model's inputs: a warning by default, an error or nothing by choice.

A quantized model on the NPU maps NaN and +-inf to ordinary quantized values (QuantizeLinear
saturates), so such inputs give finite, plausible and wrong outputs, with no word from QNN. They
are nearly always a bug before the model (a division by zero in the preprocessing), so ``run``
says so. The default is a warning, not an error: a deployed app keeps running (and the warning
reaches its logs), while ``nonfinite="error"`` is there for tests and strict pipelines and
``"ignore"`` for models fed infinities on purpose (e.g. -inf attention masks). The check is one
pass of ``np.isfinite`` over the float inputs. Standard library and numpy only.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from .errors import FeedError, UsageError

NonFinite = Literal["warn", "error", "ignore"]
MODES: tuple[str, ...] = ("warn", "error", "ignore")


def check_mode(mode: str) -> NonFinite:
    if mode not in MODES:
        raise UsageError(
            f"nonfinite={mode!r} is not one of {', '.join(MODES)}.",
            tip='nonfinite="warn" (default) warns, "error" raises FeedError, "ignore" skips the check.',
        )
    return mode  # type: ignore[return-value]


def nonfinite_counts(feeds: Mapping[str, Any]) -> dict[str, tuple[int, int, int]]:
    """input name -> (NaN count, infinity count, size) for the float inputs that hold any."""
    found = {}
    for name, value in feeds.items():
        array = np.asarray(value)
        if array.dtype.kind not in "fc":
            continue
        finite = np.isfinite(array)
        if finite.all():
            continue
        nans = int(np.count_nonzero(np.isnan(array)))
        found[name] = (nans, int(array.size - np.count_nonzero(finite)) - nans, int(array.size))
    return found


def check_feeds(feeds: Mapping[str, Any], mode: NonFinite, label: str) -> None:
    """Warn about (or refuse) NaN and infinity in ``feeds``, naming each input and the counts."""
    if mode == "ignore":
        return
    found = nonfinite_counts(feeds)
    if not found:
        return
    text = "; ".join(
        f"{name!r}: {nans} NaN and {infs} infinite of {size} values"
        for name, (nans, infs, size) in found.items()
    )
    message = (
        f"Inputs of {label} hold NaN or infinity ({text}); a quantized model turns them into "
        "finite, plausible outputs, so the result would be silently wrong."
    )
    tip = (
        "Fix what produced them (often a division by zero in the preprocessing); "
        'load(..., nonfinite="ignore") silences this, "error" makes it a FeedError.'
    )
    if mode == "error":
        raise FeedError(message, tip=tip)
    warnings.warn(f"{message} {tip}", RuntimeWarning, stacklevel=3)
