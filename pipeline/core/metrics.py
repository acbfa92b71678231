"""Computes the accuracy figures of every stage: SNR (dB), max abs error and cosine similarity
(``core.accuracy`` holds what they are recorded as)."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from qnn_ctx_runtime.qnn import ModelSummary

from .accuracy import (
    ANGLES,
    BELOW_STEP,
    LABELS,
    MAP_VALUES,
    MATCHED,
    PART,
    PICKED,
    Accuracy,
)

_TINY = 1e-20
_CHUNK = 1 << 20  # values compared at a time
FLOAT16_MAX = 65504.0  # float16's largest finite value
FLOAT16_TINY = 2.0**-24  # float16's smallest subnormal: the finest value the HTP's fp16 holds
# A reference value this large marks a position (finfo.max, -1e38, inf), it measures nothing.
SENTINEL = 1e30


def comparable(value: Any) -> tuple[str | None, np.ndarray]:
    """(how it is compared, the array compared) for one output value as onnxruntime returns it.

    A sequence of maps becomes a [n, keys] float array of the values in key order; string,
    integer and bool tensors are labels; float tensors are compared as they are.
    """
    if isinstance(value, Mapping):
        value = [value]
    if isinstance(value, list | tuple) and value and all(isinstance(v, Mapping) for v in value):
        keys = sorted(value[0])
        rows = [[float(m.get(k, np.nan)) for k in keys] for m in value]
        return MAP_VALUES, np.asarray(rows, np.float64)
    array = np.asarray(value)
    if array.dtype.kind in "fc" or (array.dtype.kind == "O" and array.size == 0):
        return None, array
    return LABELS, array


def storable(value: Any) -> np.ndarray:
    """An output as an array ``np.load`` reads without pickle and that compares as the output
    itself (``comparable``): a ZipMap's sequence of maps as its values in key order, a string
    tensor (onnxruntime's object array) as a unicode one."""
    _, array = comparable(value)
    return array.astype(str) if array.dtype.kind == "O" else array


def power_snr_db(signal: float, noise: float) -> float:
    """10 log10(signal / noise) of summed powers; inf when there is no noise."""
    if noise <= _TINY:
        return float("inf")
    return 10.0 * float(np.log10(max(signal, _TINY) / noise))


def snr_db(reference: np.ndarray, test: np.ndarray) -> float:
    """Signal-to-noise ratio of ``test`` against ``reference``; inf when they are identical."""
    ref = np.asarray(reference, dtype=np.float64).ravel()
    err = ref - np.asarray(test, dtype=np.float64).ravel()
    return power_snr_db(float(np.sum(ref * ref)), float(np.sum(err * err)))


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


def _sums(r: np.ndarray, t: np.ndarray) -> tuple[float, float, float, float, float]:
    """(r.r, e.e, r.t, t.t, max |e|) with e = r - t, in the arrays' own precision."""
    e = r - t
    worst = float(np.max(np.abs(e))) if e.size else 0.0
    return float(r @ r), float(e @ e), float(r @ t), float(t @ t), worst


def _sums_of_finite(r: np.ndarray, t: np.ndarray) -> tuple[float, float, float, float, float]:
    """``_sums`` without the positions where the reference holds a mark (an infinity, or a
    finite value of ``SENTINEL`` or more: torch's ``finfo.max`` / ``finfo.min`` fills) and the
    test one of that sign beyond every value it holds elsewhere: a masked score (-inf where a
    mask rules a position out, a pitch tracker's bins outside its range) or a detector's
    invalid anchors (RT-DETR: finfo.max) are not values to measure, only to stay above (below)
    every real one, as fp16's 65504 and a quantized grid's upper part do; summed, the infinity
    made the SNR nan and finfo.max made it 0 dB with a cosine of 1. A mark the test does not
    keep beyond the rest, and an infinity the reference does not hold, are infinite errors; a
    NaN stays a NaN (the figure shows it)."""
    if np.isnan(r).any() or np.isnan(t).any():
        return _sums(r, t)
    sentinel = np.abs(r) >= SENTINEL
    finite = ~sentinel & np.isfinite(t)
    real = t[finite]
    # Beyond every real value of the test (fp16's largest will do; with none, nothing less).
    top = min(float(real.max()), FLOAT16_MAX) if real.size else FLOAT16_MAX
    bottom = max(float(real.min()), -FLOAT16_MAX) if real.size else -FLOAT16_MAX
    agree = sentinel & np.where(r > 0, t >= top, t <= bottom)
    sums = _sums(r[finite], t[finite])
    if np.all(finite | agree):
        return sums
    return sums[0], math.inf, sums[2], sums[3], math.inf


# (scale, zero point) of an integer output that a QuantizeLinear writes.
Grid = tuple[float, int]
_GRIDS: dict[tuple[str, int, int], dict[str, Grid]] = {}


def quantized_output_grids(*models: str | Path | None) -> dict[str, Grid]:
    """Graph outputs of ``models`` written by a per-tensor QuantizeLinear with constant scale
    and zero point: a model exported with int8 outputs (TFLite int8 I/O). Their integers
    are quantized values, not labels, and are compared as the values they stand for."""
    grids: dict[str, Grid] = {}
    for found in _per_file(models, _GRIDS, _read_output_grids):
        grids.update(found)
    return grids


def _per_file(
    models: Iterable[str | Path | None], cache: dict[tuple[str, int, int], Any], read: Any
) -> Iterator[Any]:
    """``read(path)`` of each existing model file, kept by path, size and mtime."""
    for model in models:
        if model is None or not Path(model).is_file():
            continue
        stat = Path(model).stat()
        key = (str(model), stat.st_size, stat.st_mtime_ns)
        if key not in cache:
            cache[key] = read(Path(model))
        yield cache[key]


_SUMMARIES: dict[tuple[str, int, int], ModelSummary] = {}


def _structure(path: Path) -> ModelSummary:
    """``qnn_ctx_runtime.qnn.read_model_summary`` of ``path``, read once per file version: the
    output readers below each ask it of the same few files (16 parses, 0.2 s of a small
    detector's quantize stage). Callers only read it."""
    from qnn_ctx_runtime.qnn import read_model_summary

    return next(_per_file([path], _SUMMARIES, read_model_summary))


def _read_output_grids(path: Path) -> dict[str, Grid]:
    # The outputs' types first, over mmap: loading a model to find none costs its size in memory
    # (a segmenter's 176 MB) where the quantize stage's peak is measured.
    quantized_types = {"int8", "uint8", "int16", "uint16"}
    if not any(o.dtype in quantized_types for o in _structure(path).outputs):
        return {}
    return {
        name: (float(params[0]), int(params[1]))
        for name, params in _output_writers(path, "QuantizeLinear").items()
        if len(params) == 2
    }


def _output_writers(path: Path, op_type: str) -> dict[str, list[np.ndarray]]:
    """Per graph output that a node of ``op_type`` writes with constant one-value parameters
    (its scale and zero point, as given): those values. Empty without onnx (a compile
    environment may lack it)."""
    try:
        import onnx
        from onnx import numpy_helper
    except ImportError:
        return {}
    graph = onnx.load(str(path), load_external_data=False).graph
    inits = {i.name: i for i in graph.initializer}
    outputs = {o.name for o in graph.output}
    found = {}
    for node in graph.node:
        if node.op_type != op_type or node.output[0] not in outputs:
            continue
        params = [inits.get(name) for name in node.input[1:3] if name]
        if not params or any(p is None or p.data_location for p in params):
            continue
        values = [numpy_helper.to_array(p) for p in params]  # type: ignore[arg-type]
        if all(v.size == 1 for v in values):
            found[node.output[0]] = [v.reshape(()) for v in values]
    return found


_STEPS: dict[tuple[str, int, int], dict[str, float]] = {}


def output_steps(*models: str | Path | None) -> dict[str, float]:
    """Float graph outputs of ``models`` written by a DequantizeLinear with a constant
    per-tensor scale (a QDQ model's outputs): that scale, the output's step on the NPU."""
    steps: dict[str, float] = {}
    for found in _per_file(models, _STEPS, _read_output_steps):
        steps.update(found)
    return steps


def _read_output_steps(path: Path) -> dict[str, float]:
    summary = _structure(path)  # over mmap first: most models have no such output
    outputs = {o.name for o in summary.outputs}
    if not any(n.op_type == "DequantizeLinear" and outputs & set(n.outputs) for n in summary.nodes):
        return {}
    return {
        name: float(params[0]) for name, params in _output_writers(path, "DequantizeLinear").items()
    }


_LABELS: dict[tuple[str, int, int], set[str]] = {}


def label_outputs(*models: str | Path | None) -> set[str]:
    """Graph outputs of ``models`` that hold labels in a float type (a Cast of an ArgMax map,
    ``graph.tails.float_label_outputs``): compared as labels, as their integer forms are. Read
    from the files' structure over mmap (no tensor data)."""
    from ..graph.tails import float_label_outputs

    return _outputs_by_structure(models, _LABELS, float_label_outputs)


_MAPS: dict[tuple[str, int, int], set[str]] = {}


def map_outputs(*models: str | Path | None) -> set[str]:
    """Graph outputs of ``models`` written by a ZipMap (sequences of maps): compared by their
    values in key order, kept as those values (``storable``) or as the maps they are."""
    return _outputs_by_structure(models, _MAPS, _zipmap_outputs)


def _zipmap_outputs(
    nodes: Iterable[tuple[str, Sequence[str], Sequence[str]]], outputs: Iterable[str]
) -> set[str]:
    wanted = set(outputs)
    return {name for op, _, written in nodes if op == "ZipMap" for name in written} & wanted


_PICKED: dict[tuple[str, int, int], set[str]] = {}


def _with_shapes(path: Path, finder: Callable[..., Any]) -> Any:
    """``finder`` over a file's nodes (op, inputs, outputs), outputs, their shapes and its
    small int64 initializers, from its structure over mmap."""
    summary = _structure(path)
    return finder(
        ((n.op_type, n.inputs, n.outputs) for n in summary.nodes),
        (o.name for o in summary.outputs),
        {o.name: o.shape for o in summary.outputs},
        summary.small_ints,
    )


def picked_outputs(*models: str | Path | None) -> set[str]:
    """Graph outputs of ``models`` computed from a TopK's indices
    (``graph.tails.selection_outputs``), read from the files' structure over mmap."""
    from ..graph.tails import selection_outputs

    return set().union(
        *_per_file(models, _PICKED, lambda path: _with_shapes(path, selection_outputs))
    )


_ROWS: dict[tuple[str, int, int], dict[str, tuple[str, int]]] = {}


def picked_row_indices(*models: str | Path | None) -> dict[str, tuple[str, int]]:
    """Outputs picked by rank whose rows are the picks of a TopK whose indices the file also
    outputs (``graph.tails.picked_rows``): output -> (those indices, its axis of rows)."""
    from ..graph.tails import picked_rows

    found: dict[str, tuple[str, int]] = {}
    for rows in _per_file(models, _ROWS, lambda path: _with_shapes(path, picked_rows)):
        found.update(rows)
    return found


_ANGLES: dict[tuple[str, int, int], set[str]] = {}


def angle_outputs(*models: str | Path | None) -> set[str]:
    """Graph outputs of ``models`` computed from an Atan (``graph.tails.angle_outputs``), read
    from the files' structure over mmap."""
    from ..graph.tails import angle_outputs as finder

    return _outputs_by_structure(models, _ANGLES, finder)


# An angle output's values as a quantized or fp16 model writes them: pi, a step or a rounding
# beyond it (fp16's pi is 3.1406; a 16-bit grid over [-pi, pi] rounds to 1e-4).
ANGLE_BOUND = np.pi * 1.01


def the_short_way_round(r: np.ndarray, t: np.ndarray) -> np.ndarray:
    """``t`` with 2 pi taken off or added where ``r`` and ``t`` are both angles (within
    ``ANGLE_BOUND``) more than pi apart: the same direction, measured around the circle."""
    with np.errstate(invalid="ignore"):
        d = t - r
        far = (np.abs(d) > np.pi) & (np.abs(r) <= ANGLE_BOUND) & (np.abs(t) <= ANGLE_BOUND)
    if not far.any():
        return t
    moved = np.array(t, copy=True)
    moved[far] -= (np.sign(d[far]) * 2.0 * np.pi).astype(moved.dtype)
    return moved


def _outputs_by_structure(
    models: tuple[str | Path | None, ...],
    cache: dict[tuple[str, int, int], set[str]],
    finder: Callable[[Iterable[tuple[str, Sequence[str], Sequence[str]]], Iterable[str]], set[str]],
) -> set[str]:
    """The outputs ``finder`` picks from each file's nodes (op, inputs, outputs) and outputs."""

    def read(path: Path) -> set[str]:
        summary = _structure(path)
        return finder(
            ((n.op_type, n.inputs, n.outputs) for n in summary.nodes),
            (o.name for o in summary.outputs),
        )

    return set().union(*_per_file(models, cache, read))


# output -> (its parts' names, each flat element's part index: ``graph.tails.packed_output_parts``)
Parts = dict[str, tuple[list[str], np.ndarray]]
_PARTS: dict[tuple[str, int, int], Parts] = {}


def packed_parts(*models: str | Path | None) -> Parts:
    """The parts of the graph outputs a Concat packs (``graph.tails.packed_output_parts``), from
    the first of ``models`` that has any; the file is loaded (without external data) only where
    its structure, read over mmap, has such an output."""

    def read(path: Path) -> Parts:
        from ..graph.tails import packed_output_candidates, packed_output_parts

        summary = _structure(path)
        nodes = ((n.op_type, n.inputs, n.outputs) for n in summary.nodes)
        if not packed_output_candidates(nodes, (o.name for o in summary.outputs)):
            return {}
        import onnx

        try:
            return packed_output_parts(onnx.load(str(path), load_external_data=False))
        except Exception:  # a part's figure is a report's extra, never fatal
            return {}

    return next((parts for parts in _per_file(models, _PARTS, read) if parts), {})


def _dequantized(value: Any, grid: Grid) -> Any:
    array = np.asarray(value)
    if array.dtype.kind not in "iu":
        return value
    return (array.astype(np.float64) - grid[1]) * grid[0]


@dataclass(frozen=True)
class OutputKinds:
    """Outputs compared as other than plain values, read from a model's structure: labels in a
    float type (``label_outputs``) and angles (``angle_outputs``)."""

    labels: frozenset[str] = frozenset()
    angles: frozenset[str] = frozenset()

    @classmethod
    def of(cls, *models: str | Path | None) -> OutputKinds:
        return cls(frozenset(label_outputs(*models)), frozenset(angle_outputs(*models)))

    def comparison(self) -> OutputComparison:
        return OutputComparison(labels=self.labels, angles=self.angles)


PLAIN = OutputKinds()  # every output compared as its values


def _rows_of_the_same_picks(
    ref: np.ndarray,
    test: np.ndarray,
    reference: Mapping[str, Any],
    tested: Mapping[str, Any],
    index_name: str,
    axis: int,
) -> tuple[np.ndarray, np.ndarray] | None:
    """The rows of ``ref`` and ``test`` (along ``axis``) that hold the same TopK pick, paired
    (rows only one side picked left out); None without both sides' indices, or where the
    shapes do not fit them."""
    if index_name not in reference or index_name not in tested:
        return None
    ref_index = np.asarray(reference[index_name])
    test_index = np.asarray(tested[index_name])
    lead = ref_index.shape
    if test_index.shape != lead or ref.shape != test.shape or ref.shape[: axis + 1] != lead:
        return None
    groups = int(np.prod(lead[:-1], dtype=np.int64))
    ref_rows = ref.reshape(groups, lead[-1], -1)
    test_rows = test.reshape(groups, lead[-1], -1)
    ref_picks = ref_index.reshape(groups, -1)
    test_picks = test_index.reshape(groups, -1)
    paired_ref, paired_test = [], []
    for group in range(groups):
        _, in_ref, in_test = np.intersect1d(
            ref_picks[group], test_picks[group], assume_unique=True, return_indices=True
        )
        paired_ref.append(ref_rows[group, in_ref])
        paired_test.append(test_rows[group, in_test])
    return np.concatenate(paired_ref), np.concatenate(paired_test)


class OutputComparison:
    """Accumulates reference/test pairs per output over samples, without keeping the samples.

    SNR is computed over all samples pooled (sum of signal / sum of noise), which is steadier
    than averaging per-sample SNRs. Outputs in ``grids`` (``quantized_output_grids``) are
    compared as the values their integers stand for; outputs in ``labels``
    (``label_outputs``) as labels whatever their type.
    """

    def __init__(
        self,
        grids: Mapping[str, Grid] | None = None,
        labels: Collection[str] = (),
        steps: Mapping[str, float] | None = None,
        picked: Collection[str] = (),
        maps: Collection[str] = (),
        angles: Collection[str] = (),
        parts: Parts | None = None,
        rows: Mapping[str, tuple[str, int]] | None = None,
    ) -> None:
        self.grids = dict(grids or {})
        # picked outputs whose rows are a TopK's picks: (its indices, the axis) (``MATCHED``)
        self.rows = dict(rows or {})
        self.parts = dict(parts or {})  # packed outputs' parts, compared apart (``PART``)
        self.angles = frozenset(angles)  # outputs computed from an Atan (``angle_outputs``)
        self.labels = frozenset(labels)
        self.picked = frozenset(picked)  # outputs picked by rank (``picked_outputs``)
        self.maps = frozenset(maps)  # ZipMap outputs, maybe given as their values (``storable``)
        self.steps = dict(steps or {})  # float outputs' grid steps (``output_steps``)
        self._peak: dict[str, float] = {}  # the largest |reference value| per output
        self._signal: dict[str, float] = {}
        self._noise: dict[str, float] = {}
        self._max_abs: dict[str, float] = {}
        self._dot: dict[str, float] = {}
        self._norm_ref: dict[str, float] = {}
        self._norm_test: dict[str, float] = {}
        self._kind: dict[str, str | None] = {}
        self._agree: dict[str, int] = {}
        self._count: dict[str, int] = {}
        self.samples = 0

    @classmethod
    def for_models(cls, *models: str | Path | None, parts: Parts | None = None) -> OutputComparison:
        """A comparison of these model files' outputs, each compared as what it holds
        (``quantized_output_grids``, ``label_outputs``, ``output_steps``); ``parts``: the
        packed outputs' parts when not the files' own (``packed_parts``; {} for none)."""
        return cls(
            quantized_output_grids(*models),
            label_outputs(*models),
            output_steps(*models),
            picked_outputs(*models),
            map_outputs(*models),
            angle_outputs(*models),
            packed_parts(*models) if parts is None else parts,
            picked_row_indices(*models),
        )

    def add(self, reference: Mapping[str, Any], test: Mapping[str, Any]) -> None:
        for name, ref in reference.items():
            other = test[name]
            if name in self.grids:
                ref, other = (
                    _dequantized(ref, self.grids[name]),
                    _dequantized(other, self.grids[name]),
                )
            kind, ref_array = comparable(ref)
            _, test_array = comparable(other)
            kind = LABELS if name in self.labels else kind
            kind = PICKED if kind is None and name in self.picked else kind
            kind = MAP_VALUES if kind is None and name in self.maps else kind
            kind = ANGLES if kind is None and name in self.angles else kind
            if kind == PICKED and name in self.rows:
                matched = _rows_of_the_same_picks(
                    ref_array, test_array, reference, test, *self.rows[name]
                )
                if matched is not None:
                    kind, (ref_array, test_array) = MATCHED, matched
            self._kind[name] = kind
            if kind == LABELS:
                same = ref_array.shape == test_array.shape
                agree = int(np.sum(ref_array == test_array)) if same else 0
                self._agree[name] = self._agree.get(name, 0) + agree
                self._count[name] = self._count.get(name, 0) + max(ref_array.size, 1)
                continue
            self._add_values(name, np.ravel(ref_array), np.ravel(test_array))
            if kind is None and name in self.parts:
                self._add_parts(name, np.ravel(ref_array), np.ravel(test_array))
        self.samples += 1

    def _add_parts(self, name: str, ref: np.ndarray, test: np.ndarray) -> None:
        """Each part of a packed output on its own elements (a shape that does not match the
        parts, a bucket's cropped output, gets none)."""
        names, labels = self.parts[name]
        if labels.size != ref.size or labels.size != test.size:
            return
        for index, part in enumerate(names):
            mask = labels == index  # one part's at a time
            self._kind[part] = PART
            self._add_values(part, ref[mask], test[mask])

    def _add_values(self, name: str, ref: np.ndarray, test: np.ndarray) -> None:
        """Sums a chunk at a time: a 1024x2048 segmentation map is 40 M values, and float64
        copies of it whole would cost a gigabyte per comparison. float32 outputs are summed by
        float32 BLAS (10x faster than converting to float64 first, the bulk of every
        evaluation; 1e-6 relative, far below the 0.01 dB shown), float64 where that overflows."""
        signal = noise = dot = test_power = worst = peak = 0.0
        angles = self._kind.get(name) == ANGLES
        for start in range(0, max(ref.size, 1), _CHUNK):
            r, t = ref[start : start + _CHUNK], test[start : start + _CHUNK]
            t = the_short_way_round(r, t) if angles else t
            fast = r.dtype == np.float32 and t.dtype == np.float32
            with np.errstate(over="ignore", invalid="ignore"):  # an overflow falls back
                sums = _sums(r, t) if fast else None
            if sums is None or not np.isfinite(sums).all():
                sums = _sums(np.asarray(r, np.float64), np.asarray(t, np.float64))
            if not np.isfinite(sums).all() or (r.size and np.max(np.abs(r)) >= SENTINEL):
                sums = _sums_of_finite(np.asarray(r, np.float64), np.asarray(t, np.float64))
            signal += sums[0]
            noise += sums[1]
            dot += sums[2]
            test_power += sums[3]
            worst = max(worst, sums[4])
            peak = max(peak, float(np.max(np.abs(r)))) if r.size else peak
        self._signal[name] = self._signal.get(name, 0.0) + signal
        self._noise[name] = self._noise.get(name, 0.0) + noise
        self._max_abs[name] = max(self._max_abs.get(name, 0.0), worst)
        self._peak[name] = max(self._peak.get(name, 0.0), peak)
        self._dot[name] = self._dot.get(name, 0.0) + dot
        self._norm_ref[name] = self._norm_ref.get(name, 0.0) + signal
        self._norm_test[name] = self._norm_test.get(name, 0.0) + test_power

    def powers(self) -> dict[str, tuple[float, float]]:
        """Per numeric output: (signal, noise) power summed over the samples added, so that
        figures of separate samples can be pooled later. An output ``below_step`` is left out,
        as ``worst_snr`` leaves it out."""
        return {
            name: (self._signal[name], self._noise[name])
            for name in self._signal
            if not self.below_step(name) and self._kind.get(name) not in (PICKED, PART)
        }

    def below_step(self, name: str) -> bool:
        """Whether every reference value of this float output so far lies within one step of
        its grid (at least float16's smallest value) and the test is within two steps of it
        everywhere: zero to the NPU, judged by that error instead of an SNR (``BELOW_STEP``)."""
        if name not in self._peak:
            return False
        step = max(self.steps.get(name, 0.0), FLOAT16_TINY)
        return self._peak[name] <= step and self._max_abs[name] <= 2 * step

    def summary(self) -> dict[str, Accuracy]:
        """Per output: SNR, max abs error and cosine, pooled over the samples added."""
        result = {}
        for name, count in self._count.items():
            share = self._agree[name] / count
            result[name] = Accuracy(float("nan"), float("nan"), float("nan"), LABELS, share)
        for name in self._signal:
            snr = power_snr_db(self._signal[name], self._noise[name])
            denom = float(np.sqrt(self._norm_ref[name] * self._norm_test[name]))
            cos = self._dot[name] / denom if denom > _TINY else 1.0
            kind = self._kind.get(name)
            kind = BELOW_STEP if kind != PART and self.below_step(name) else kind
            result[name] = Accuracy(snr, self._max_abs[name], cos, kind)
        return {name: result[name] for name in self._kind if name in result}
