"""How close an output is to its reference, as every stage records and reports it.

Why a module of its own: records, reports and the skip check of a rebuild read these figures,
and must not import numpy to do so (0.2 s of a 0.3 s rerun); ``metrics`` computes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# How an output is compared (``Accuracy.compared_as``): numeric tensors by SNR (None), sequences
# of maps (ZipMap's class -> score) by SNR of their values in key order, labels (string,
# integer and bool tensors) by the share of elements that agree.
MAP_VALUES = "map values"
LABELS = "labels"
# A float output whose every reference value lies within one step of its grid (the scale of the
# DequantizeLinear writing it), or below float16's smallest value, is zero to any NPU arithmetic:
# its SNR measures nothing (the CPU's 1e-8 against the HTP's 0 reads 0 dB). It is judged by its
# largest error instead: within two steps it passes (``BELOW_STEP``), else it is compared by SNR.
BELOW_STEP = "below its step"
# A float output computed from a TopK's indices (a detector's best rows, picked by rank): near
# ties trade places and move whole rows, so its SNR measures the ties. It is shown, left out of
# the worst SNR and the gates; the tensors it picks from are judged in its place
# (``graph.tails.expose_selection_sources``).
PICKED = "picked by rank"
# An output picked by rank whose rows are a TopK's picks, compared with the TopK's indices
# beside it (``graph.tails.picked_rows``): each reference row against the test's row of the
# same pick, rows picked by one side only left out. Its SNR measures the arithmetic after
# the pick (a DETR's decoder); gated.
MATCHED = "rows matched by pick"
# A float output computed from an Atan (``graph.tails.angle_outputs``): where the reference and
# the test are both angles in [-pi, pi] more than pi apart, the test is taken the short way
# round the circle (one value just across the cut at +-pi is the same direction). Gated.
ANGLES = "angles"
# One part of an output a Concat packs (``graph.tails.packed_output_parts``: a detector's class
# probabilities beside its pixel boxes), compared on its own elements: the output's one SNR is
# its largest part's energy. Shown, and named where it is short; the output itself is gated.
PART = "part of a packed output"


@dataclass(frozen=True)
class Accuracy:
    """How close one output is to its reference, pooled over samples."""

    snr_db: float  # inf when identical; nan for labels (see agreement)
    max_abs: float
    cosine: float
    # None: values; MAP_VALUES; LABELS; BELOW_STEP; PICKED; ANGLES; PART
    compared_as: str | None = None
    agreement: float | None = None  # labels: fraction of elements equal to the reference


def figure(accuracy: Accuracy | None) -> float | str | None:
    """A report cell: the SNR of a numeric output, the agreement of a label output."""
    if accuracy is None:
        return None
    if accuracy.compared_as == LABELS:
        return f"{100.0 * (accuracy.agreement or 0.0):.1f}% agree"
    if accuracy.compared_as == BELOW_STEP:
        return f"below its step (max abs {accuracy.max_abs:.3g})"
    if accuracy.compared_as == PICKED:
        return f"picked by rank ({accuracy.snr_db:.2f} dB, not gated)"
    if accuracy.compared_as == MATCHED:
        return f"{accuracy.snr_db:.2f} dB, rows matched by pick"
    if accuracy.compared_as == PART:
        return f"part: {accuracy.snr_db:.2f} dB"
    return accuracy.snr_db


def comparison_note(summaries: list[Mapping[str, Accuracy]]) -> str:
    """One sentence for reports with non-tensor outputs: how those were compared."""
    kinds = {a.compared_as for s in summaries for a in s.values()} - {None}
    parts = []
    below = ""
    if BELOW_STEP in kinds:
        below = (
            "Outputs below their step (every reference value within one step of their 16-bit "
            "grid, or below float16's smallest value: zero to any NPU arithmetic, and their SNR "
            "measures nothing) are judged by their largest error: within two steps they pass, "
            "and their SNR is left out of the worst."
        )
    if MAP_VALUES in kinds:
        parts.append("sequences of maps are compared by the SNR of their values in key order")
    if LABELS in kinds:
        parts.append("labels (string/integer outputs) by the share of elements that agree")
    labelled = ("Non-tensor outputs: " + "; ".join(parts) + ".") if parts else ""
    picked = ""
    if PICKED in kinds:
        picked = (
            "Outputs picked by rank (rows gathered by a TopK's indices: near-equal scores trade "
            "places and move whole rows) are shown but not gated; the tensors they pick from "
            "are compared in their place."
        )
    if MATCHED in kinds:
        picked += (" " if picked else "") + (
            "Outputs whose rows are a TopK's picks are compared row by row with the test's row "
            "of the same pick (rows only one side picked are left out): that measures the "
            "arithmetic after the pick, and is gated."
        )
    angles = ""
    if ANGLES in kinds:
        angles = (
            "Angle outputs (computed from an Atan through element-wise ops) are compared the "
            "short way round the circle: a value put just across the cut at +-pi is the same "
            "direction, and counts by its distance around it."
        )
    packed = ""
    if PART in kinds:
        packed = (
            "Rows 'output / tensor' are the parts of an output a Concat packs, each compared on "
            "its own elements: the output's SNR is mostly its largest part's, and a small part "
            "(a detector's class probabilities beside its pixel boxes) may be far below it. "
            "They are shown, not gated."
        )
    return " ".join(part for part in (labelled, below, picked, angles, packed) if part)


def worst_snr(summary: Mapping[str, Accuracy]) -> float:
    """The lowest SNR over the outputs; inf when there are none (nothing differs).

    Label outputs have no SNR: the scores they are derived from carry the figure. An output
    below its step has none that means anything: its error is within two steps.
    """
    return min(
        (
            v.snr_db
            for v in summary.values()
            if v.compared_as not in (LABELS, BELOW_STEP, PICKED, PART)
        ),
        default=float("inf"),
    )
