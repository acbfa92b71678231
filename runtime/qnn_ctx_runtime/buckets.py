"""Shape buckets at run time: which static shape holds an input, and the pad and crop around it.

QNN HTP needs static shapes. A release variant is a set of one or more static shapes ("buckets")
with identical weights; the loader pads each input into the smallest bucket that holds it and crops
the outputs that follow a padded axis back to the true size. A model with one static shape is a
set of one bucket with nothing to pad. The builder plans the buckets (``pipeline.buckets``) and
uses these same functions when it evaluates, so the runtime does exactly what was measured.

Pure functions over plain data; the standard library and numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy is imported where an array is padded: the builder's skip check reads
    import numpy as np  # these rules and stays numpy-free

from .errors import FeedError


@dataclass(frozen=True)
class Bucket:
    """One static shape of every model input."""

    name: str
    shapes: dict[str, tuple[int, ...]]

    @property
    def elements(self) -> int:
        """Values fed per run: what "smallest bucket" means."""
        return sum(math.prod(shape) for shape in self.shapes.values())

    def describe(self) -> str:
        return f"{self.name} (" + ", ".join(f"{k} {list(v)}" for k, v in self.shapes.items()) + ")"


@dataclass(frozen=True)
class PadRule:
    """How the runtime pads ``input`` along ``axis`` (a bucket dim named ``dim``)."""

    input: str
    axis: int
    dim: str
    value: float = 0.0
    side: str = "end"  # "end" (right/bottom) or "start"


@dataclass(frozen=True)
class CropRule:
    """Output ``output`` along ``axis`` follows ``input`` along ``input_axis``: crop it back.

    The output length for an input of size n is ``max(1, (n * num + add) // den + shift)``:
    exact for chains of strided convolutions and pools (nested floor divisions compose into one)
    and for upsampling by an integer factor. The quantize stage fits ``add`` and ``shift`` to the
    lengths the source model really produces (``fit_length_rule``).
    """

    output: str
    axis: int
    input: str
    input_axis: int
    dim: str
    num: int = 1
    den: int = 1
    add: int = 0
    shift: int = 0

    def length(self, size: int) -> int:
        return max(1, (size * self.num + self.add) // self.den + self.shift)


@dataclass(frozen=True)
class Padding:
    """What the runtime padded: per input, (axis, values before, values after)."""

    bucket: str
    inputs: dict[str, list[tuple[int, int, int]]]


def _pattern(shape: Sequence[int], axes: set[int]) -> str:
    return "[" + ", ".join(f"<={d}" if i in axes else str(d) for i, d in enumerate(shape)) + "]"


def shape_problems(
    buckets: Sequence[Bucket], pads: Sequence[PadRule], shapes: Mapping[str, Sequence[int]]
) -> list[tuple[str, str]]:
    """(message, tip) for every input whose rank or fixed dims no bucket can take."""
    axes: dict[str, set[int]] = {}
    for rule in pads:
        axes.setdefault(rule.input, set()).add(rule.axis)
    largest = buckets[-1]
    problems = []
    for name, shape in shapes.items():
        want = largest.shapes[name]
        bucket_axes = axes.get(name, set())
        if len(shape) != len(want):
            problems.append(
                (
                    f"Input {name!r} has rank {len(shape)} (shape {list(shape)}); the model takes "
                    f"rank {len(want)}: {_pattern(want, bucket_axes)}.",
                    "Add or remove the batch/channel axes so the input has the model's rank.",
                )
            )
            continue
        empty = [axis for axis in bucket_axes if shape[axis] < 1]
        if empty:
            problems.append((f"Input {name!r} is empty along axis {empty[0]}.", ""))
        fixed = [a for a, size in enumerate(shape) if a not in bucket_axes and size != want[a]]
        if not fixed:
            continue
        if not pads:  # one static shape: nothing may vary
            problems.append(
                (
                    f"Input {name!r} has shape {list(shape)}; the model takes exactly "
                    f"{list(want)}.",
                    "The model's inputs are static: feed exactly the shapes listed in "
                    "model.inputs.",
                )
            )
        else:
            axis = fixed[0]
            problems.append(
                (
                    f"Input {name!r} has size {shape[axis]} on axis {axis}; the model needs "
                    f"{want[axis]} there ({_pattern(want, bucket_axes)}): only the bucket dims "
                    "may vary.",
                    "Only the dims listed in [buckets] are dynamic; fix the others.",
                )
            )
    return problems


def choose_bucket(
    buckets: Sequence[Bucket], pads: Sequence[PadRule], shapes: Mapping[str, Sequence[int]]
) -> Bucket:
    """The smallest bucket (``buckets`` are smallest first) that holds inputs of ``shapes``.

    Every axis the buckets do not vary must match exactly; a FeedError names every input that
    does not fit, the axis and, when the input is too large, the largest bucket.
    """
    largest = buckets[-1]
    problems = shape_problems(buckets, pads, shapes)
    if problems:
        tip = next((t for _, t in problems if t), None)
        raise FeedError(" ".join(m for m, _ in problems), tip=tip)
    for bucket in buckets:
        if all(
            all(size <= bucket.shapes[name][axis] for axis, size in enumerate(shape))
            for name, shape in shapes.items()
        ):
            return bucket
    too_big = [
        f"{name!r} has {shape[rule.axis]} on axis {rule.axis} ({rule.dim})"
        for rule in pads
        for name, shape in shapes.items()
        if name == rule.input and shape[rule.axis] > largest.shapes[name][rule.axis]
    ]
    raise FeedError(
        f"The input is larger than every bucket: {'; '.join(too_big)}. The largest bucket is "
        f"{largest.describe()}.",
        tip="Split the input into pieces that fit, or rebuild with a larger size in "
        "[buckets] dims.",
    )


def pad_input(
    array: np.ndarray, shape: Sequence[int], rules: Sequence[PadRule]
) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """``array`` padded to ``shape`` along the axes of ``rules``; returns what was added."""
    applied = []
    widths = [(0, 0)] * array.ndim
    values = [(0.0, 0.0)] * array.ndim
    for rule in rules:
        extra = int(shape[rule.axis]) - array.shape[rule.axis]
        if extra <= 0:
            continue
        before, after = (extra, 0) if rule.side == "start" else (0, extra)
        widths[rule.axis] = (before, after)
        values[rule.axis] = (rule.value, rule.value)
        applied.append((rule.axis, before, after))
    if not applied:
        return array, []
    import numpy as np

    padded = np.pad(array, widths, mode="constant", constant_values=values)
    return padded.astype(array.dtype, copy=False), applied


def crop_output(
    value: np.ndarray, rule: CropRule, true_size: int, bucket_size: int, side: str
) -> np.ndarray:
    """The part of an output that follows the real (unpadded) input."""
    keep = min(value.shape[rule.axis], rule.length(true_size))
    index: list[slice] = [slice(None)] * value.ndim
    size = value.shape[rule.axis]
    index[rule.axis] = slice(size - keep, size) if side == "start" else slice(0, keep)
    return value[tuple(index)]


def crop_outputs(
    pads: Sequence[PadRule],
    crops: Sequence[CropRule],
    bucket: Bucket,
    own: Mapping[str, np.ndarray],
    outputs: Mapping[str, np.ndarray],
) -> dict[str, np.ndarray]:
    """``outputs`` of ``bucket`` run on ``own`` (the true-size inputs), each output that
    ``crops`` declares cropped to what follows its input; the others as they are."""
    sides = {(r.input, r.axis): r.side for r in pads}
    result = dict(outputs)
    for rule in crops:
        if rule.output not in result or rule.input not in own:
            continue
        result[rule.output] = crop_output(
            result[rule.output],
            rule,
            own[rule.input].shape[rule.input_axis],
            bucket.shapes[rule.input][rule.input_axis],
            sides.get((rule.input, rule.input_axis), "end"),
        )
    return result
