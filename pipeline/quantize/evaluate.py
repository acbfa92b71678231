"""How far the built models are from the user's model, on held-out samples (CPU EP).

``evaluate`` compares two models of one bucket sample by sample (QDQ vs prepared float).
``end_to_end`` does what the runtime will do, on the held-out samples at their true size: pick
the bucket, pad, run, crop; and compares that with the *source* model run at the true size. Its
``float_vs_source`` is what preparation (and padding) changed, ``qdq_vs_source`` adds
quantization. A figure that cannot be measured says why instead of vanishing.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qnn_ctx_runtime import buckets as bk

from ..core.accuracy import Accuracy
from ..core.config import ModelConfig
from ..core.cpu import cpu_session
from ..core.dtypes import constant_feed, np_dtype, unread_input_feed
from ..core.fileio import sha256_file
from ..core.layout import samples_in
from ..core.memory import release_freed_memory
from ..core.metrics import OutputComparison, storable
from ..core.progress import Progress
from ..core.records import folder_digest
from ..core.stream import follows, run_closed_loop
from ..graph.buckets import BucketPlan

Feeds = dict[str, np.ndarray]


SAMPLE_CACHE_BYTES = 64 << 20  # held-out feeds kept per process, read again by every check
_SAMPLES: dict[tuple[str, int, int], Feeds] = {}  # (path, size, mtime) -> its feeds, read-only
_SAMPLE_BYTES = [0]


def iter_samples(folder: Path | list[Path]) -> Iterator[Feeds]:
    """The feeds saved in a held-out folder (or these sample files), one at a time.

    Small ones are kept in memory after the first read (up to ``SAMPLE_CACHE_BYTES`` a
    process, keyed by the file's path, size and time): mixed precision, the judge and the end-to-end check read the
    same folder again and again (a streaming model's 300 windows: 2700 reads, 4.6 s of its
    quantize stage). The arrays are read-only; a new dict is yielded each time."""
    for path in folder if isinstance(folder, list) else samples_in(folder):
        stat = path.stat()
        key = (str(path), stat.st_size, stat.st_mtime_ns)
        feeds = _SAMPLES.get(key)
        if feeds is None:
            with np.load(path, allow_pickle=False) as data:
                feeds = {k: data[k] for k in data.files}
            size = sum(v.nbytes for v in feeds.values())
            # Only small samples: large ones are few, and memory is what they cost.
            if size <= SAMPLE_CACHE_BYTES // 64 and _SAMPLE_BYTES[0] + size <= SAMPLE_CACHE_BYTES:
                for value in feeds.values():
                    value.flags.writeable = False
                _SAMPLES[key] = feeds
                _SAMPLE_BYTES[0] += size
        yield dict(feeds)


def run_named(session: Any, names: list[str], feeds: Feeds) -> Feeds:
    """``names`` of ``session``'s outputs; paired by position where the model renamed them."""
    outputs = [o.name for o in session.get_outputs()]
    values = session.run(None, feeds)
    by_name = dict(zip(outputs, values, strict=True))
    if all(n in by_name for n in names):
        return {n: by_name[n] for n in names}
    return dict(zip(names, values, strict=False))


@dataclass(frozen=True)
class _Arg:
    name: str
    type: str


KEEP_BYTES = 64 << 20  # outputs kept per process for the next comparison of the same model
_KEPT: dict[tuple[str, str], list[Any]] = {}  # (model digest, feeds digest) -> its outputs
_KEPT_BYTES = [0]
_META: dict[str, tuple[list[_Arg], list[str]]] = {}  # model digest -> (inputs, output names)


class KeptRuns:
    """A model file on the CPU EP whose outputs on given feeds are kept (up to ``KEEP_BYTES`` a
    process) for the next comparison that runs the same file on the same feeds: the end-to-end
    check runs the QDQ and float models on the very held-out samples mixed precision has just
    run them on (silero: 934 samples, 0.6 s). Keyed by the file's and the feeds' digests; the
    session is only created when a run is not kept."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.digest = sha256_file(path)
        self._session: Any = None
        self.last_kept = False  # the last run's outputs are held in the kept store

    def _open(self) -> Any:
        if self._session is None:
            self._session = cpu_session(self.path)
            _META[self.digest] = (
                [_Arg(i.name, i.type) for i in self._session.get_inputs()],
                [o.name for o in self._session.get_outputs()],
            )
        return self._session

    def get_inputs(self) -> list[_Arg]:
        if self.digest not in _META:
            self._open()
        return _META[self.digest][0]

    def output_names(self) -> list[str]:
        if self.digest not in _META:
            self._open()
        return _META[self.digest][1]

    def run_named(self, names: list[str], feeds: Feeds) -> Feeds:
        """As ``run_named`` on a session of this file."""
        key = (self.digest, _feeds_digest(feeds))
        values = _KEPT.get(key)
        self.last_kept = values is not None
        if values is None:
            values = self._open().run(None, feeds)
            size = sum(storable(v).nbytes for v in values)
            if _KEPT_BYTES[0] + size <= KEEP_BYTES:
                _KEPT[key] = values
                _KEPT_BYTES[0] += size
                self.last_kept = True
        by_name = dict(zip(self.output_names(), values, strict=True))
        if all(n in by_name for n in names):
            return {n: by_name[n] for n in names}
        return dict(zip(names, values, strict=False))


def kept_outputs(model: Path, samples: list[Path]) -> list[Feeds] | None:
    """``model``'s outputs on each sample file, if this process kept them all (``KeptRuns``),
    else None: nothing is run for them. Each as ``storable`` makes it (a classifier's ZipMap
    and label too), so the HTP judge's early stops hold for such models as well."""
    digest = sha256_file(model)
    if digest not in _META:
        return None
    names = _META[digest][1]
    found = []
    for path in samples:
        with np.load(path, allow_pickle=False) as data:
            feeds = {k: data[k] for k in data.files}
        values = _KEPT.get((digest, _feeds_digest(feeds)))
        if values is None:
            return None
        found.append({n: storable(v) for n, v in zip(names, values, strict=True)})
    return found


class OutputsOnDisk:
    """``model``'s outputs on each of ``samples``, as ``kept_outputs`` gives them, computed on
    first use one sample at a time and kept as ``<index>.npz`` in ``folder``.

    Why: the HTP judge stops a round early only against the float model's outputs, and this
    process keeps outputs in memory up to ``KEEP_BYTES``: a Zero-DCE at 256x256 (7 MiB of
    outputs a sample) ran all 12 held-out samples on the simulator in every round, 4.6 s each,
    where 4 decided. On disk they cost one CPU run a sample, which the probe's own comparison
    then does not repeat; never more than one sample's outputs in memory."""

    def __init__(self, model: Path, samples: list[Path], folder: Path) -> None:
        self.model = model
        self.samples = list(samples)
        self.folder = folder
        self._runs: KeptRuns | None = None

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Feeds:
        with np.load(self.path(index), allow_pickle=False) as data:
            return {k: data[k] for k in data.files}

    def __iter__(self) -> Iterator[Feeds]:
        for index in range(len(self)):
            yield self[index]

    def path(self, index: int) -> Path:
        """The ``.npz`` of sample ``index``'s outputs, computed now if it is not on disk."""
        target = self.folder / f"{index:04d}.npz"
        if target.is_file():
            return target
        if self._runs is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._runs = KeptRuns(self.model)
        with np.load(self.samples[index], allow_pickle=False) as data:
            feeds = {k: data[k] for k in data.files}
        names = self._runs.output_names()
        outputs = self._runs.run_named(names, feeds)
        partial = target.with_name(f".{target.stem}.partial.npz")
        np.savez(partial, **{n: storable(outputs[n]) for n in names})
        partial.replace(target)
        return target


def _feeds_digest(feeds: Feeds) -> str:
    digest = hashlib.sha256()
    for name in sorted(feeds):
        value = np.ascontiguousarray(feeds[name])
        digest.update(f"{name}\0{value.dtype.str}\0{value.shape}\0".encode())
        digest.update(value.data if value.dtype.kind != "O" else repr(value.tolist()).encode())
    return digest.hexdigest()


# (reference digest, test digest, held-out folder digest) -> what ``evaluate`` measured on them
_MEASURED: dict[tuple[str, str, str], dict[str, Accuracy]] = {}


def evaluate(reference_model: Path, test_model: Path, heldout: Path) -> dict[str, Accuracy]:
    """Per output SNR / max abs / cosine of ``test_model`` against ``reference_model``.

    The same two files on the same samples are measured once per process (the digests are the
    key): mixed precision measures the QDQ model it starts from, which is usually the one the
    quantize stage reports (fastestdet: 0.4 s, retinaface: 2.2 s of CPU runs)."""
    key = (sha256_file(reference_model), sha256_file(test_model), folder_digest(heldout))
    if key not in _MEASURED:
        _MEASURED[key] = _evaluate(reference_model, test_model, heldout)
    return dict(_MEASURED[key])


def cpu_accuracy(
    reference_model: Path, test_model: Path, samples: list[Path]
) -> dict[str, Accuracy]:
    """``evaluate`` on these sample files (``.npz``, in one folder), not a held-out folder's."""
    return _evaluate(reference_model, test_model, samples)


def _evaluate(
    reference_model: Path, test_model: Path, heldout: Path | list[Path]
) -> dict[str, Accuracy]:
    """One session at a time (``SampleOutputs``): the reference over every sample, then the
    test model."""
    spill_in = heldout[0].parent.parent if isinstance(heldout, list) else heldout.parent
    count = len(heldout) if isinstance(heldout, list) else len(samples_in(heldout))
    # Silent on quick models (a log line at most every LOG_EVERY_S); a 36,637-node unrolled
    # BiLSTM's evaluation ran 17 minutes without a line before.
    label = f"compare {test_model.name} with {reference_model.name} on held-out samples"
    with (
        tempfile.TemporaryDirectory(prefix=".evaluate-", dir=spill_in) as spill,
        Progress(2 * count, label, "run") as progress,
    ):
        expected = SampleOutputs(Path(spill))
        ref = KeptRuns(reference_model)
        names = ref.output_names()
        for index, feeds in enumerate(iter_samples(heldout)):
            outputs = ref.run_named(names, feeds)
            expected.put(index, outputs, held_elsewhere=ref.last_kept)
            progress.update(1)
        del ref
        release_freed_memory()  # the reference's session
        test = KeptRuns(test_model)
        comparison = OutputComparison.for_models(reference_model, test_model)
        for index, feeds in enumerate(iter_samples(heldout)):
            got = test.run_named(names, feeds)
            comparison.add(expected.get(index), got)
            del got
            progress.update(1)
    return comparison.summary()


@dataclass(frozen=True)
class EndToEnd:
    """The runtime's path (pad into the bucket, run, crop) vs the source model at true size."""

    samples: int
    qdq_vs_source: dict[str, Accuracy] = field(default_factory=dict)
    float_vs_source: dict[str, Accuracy] = field(default_factory=dict)
    source_failures: int = 0  # samples the source model itself could not run
    shape_mismatches: int = 0  # outputs whose cropped shape differs from the true-size run
    error: str = ""  # why nothing could be measured
    # A requantized model (requantize = true, or quantized at run time): its file as shipped vs
    # the float model behind it, the source of the figures above (``_shipped_vs_source``).
    shipped_vs_source: dict[str, Accuracy] = field(default_factory=dict)
    shipped_error: str = ""


class SampleOutputs:
    """Each held-out sample's reference outputs, so that one model's session runs at a time:
    kept in memory up to ``budget`` bytes, the rest written to ``folder`` (a build folder's
    temporary one). A CPU session holds its weights, and more once optimized (a 1024x1024
    U-Net's 176 MB: 495 MB of process memory), and the end-to-end check had three open.

    The budget is what ``KeptRuns`` leaves of ``KEEP_BYTES``: one allowance a process for the
    outputs it holds (a 257x257 segmenter's end-to-end check held 39 MB of source outputs on
    top of the 64 MiB kept, its build's peak; a spilled sample costs a write and a read of it).
    """

    def __init__(self, folder: Path, budget: int | None = None) -> None:
        self.folder = folder
        self.budget = max(0, KEEP_BYTES - _KEPT_BYTES[0]) if budget is None else budget
        self._kept: dict[int, Feeds] = {}
        self._spilled: set[int] = set()
        self._bytes = 0

    def put(self, index: int, outputs: Feeds, held_elsewhere: bool = False) -> None:
        """``held_elsewhere``: the arrays are ``KeptRuns``' own, already counted in its store
        (a reference run kept): held here too at no cost. Counted again, they had spilled
        every sample of a streaming model's later comparisons to disk and read it back (GTCRN:
        1500 writes and 2400 reads of 300 frames' outputs, 3.4 s of its quantize stage)."""
        if held_elsewhere:
            self._kept[index] = outputs
            return
        size = sum(np.asarray(v).nbytes for v in outputs.values())
        storable = all(isinstance(v, np.ndarray) and v.dtype.kind != "O" for v in outputs.values())
        if self._bytes + size <= self.budget or not storable:
            self._kept[index] = outputs
            self._bytes += size
            return
        np.savez(self.folder / f"{index:06d}.npz", **outputs)
        self._spilled.add(index)

    def __contains__(self, index: int) -> bool:
        return index in self._kept or index in self._spilled

    def get(self, index: int) -> Feeds:
        if index in self._kept:
            return self._kept[index]
        with np.load(self.folder / f"{index:06d}.npz", allow_pickle=False) as data:
            return {k: data[k] for k in data.files}


def end_to_end(
    config: ModelConfig,
    source: Any,
    plan: BucketPlan,
    floats: dict[str, Path],
    qdqs: dict[str, Path],
    heldout: Path,
    shipped: Path | None = None,
) -> EndToEnd:
    """Held-out samples at their true size through the buckets, vs the source model (a
    ``ModelProto`` or a ``pipeline.graph.source.SourceModel``); with ``shipped`` (the file of a
    model requantized from the float model behind it), that file vs the source too.

    One model at a time: the source over every sample first (its outputs kept, or spilled to a
    temporary folder beside ``heldout``), then the QDQ buckets, then the float ones, each
    closed before the next opens."""
    from ..graph.source import as_source

    # A log line every LOG_EVERY_S, a bar on a terminal: a streaming GRU's 300 windows through
    # three models took 7.5 s without a line between the judge's last and the summary.
    count = len(samples_in(heldout)) * (4 if shipped is not None else 3)
    with (
        tempfile.TemporaryDirectory(prefix=".end-to-end-", dir=heldout.parent) as spill,
        Progress(count, "compare with the source model at true sizes", "run") as progress,
    ):
        expected = SampleOutputs(Path(spill))
        try:
            kept = as_source(source)
            names, failures, first_failure = _source_outputs(
                config, kept.runnable(), heldout, expected, kept.optimize, progress.update
            )
        except _SourceDoesNotLoad as exc:
            return EndToEnd(0, error=_unloadable_source(kept, str(exc))[:400])
        release_freed_memory()  # the source's session
        shipped_figures: tuple[dict[str, Accuracy], str] = ({}, "")
        if shipped is not None:
            shipped_figures = _shipped_vs_source(
                config, shipped, names, heldout, expected, progress.update
            )
            release_freed_memory()
        vs_qdq, vs_float = (OutputComparison.for_models(*qdqs.values()) for _ in range(2))
        mismatched = _compare_buckets(plan, qdqs, heldout, names, expected, vs_qdq, progress.update)
        release_freed_memory()
        _compare_buckets(plan, floats, heldout, names, expected, vs_float, progress.update)
    return EndToEnd(
        samples=vs_qdq.samples,
        qdq_vs_source=vs_qdq.summary(),
        float_vs_source=vs_float.summary(),
        source_failures=failures,
        shape_mismatches=mismatched,
        error="" if vs_qdq.samples else (first_failure or "no held-out samples"),
        shipped_vs_source=shipped_figures[0],
        shipped_error=shipped_figures[1],
    )


class _SourceDoesNotLoad(Exception):
    pass


ORT_OLDEST_OPSET = 7  # onnxruntime runs no model of an older ai.onnx opset


def _unloadable_source(source: Any, error: str) -> str:
    """Why the source-model comparison could not run, in words: a Caffe2-era model (opset 3-6)
    is not an export fault, onnxruntime simply runs none that old."""
    from ..graph.edit import opset_version

    try:
        opset = opset_version(source.load())
    except Exception:  # unreadable: onnxruntime's own message says enough
        opset = None
    if opset is not None and 0 < opset < ORT_OLDEST_OPSET:
        return (
            f"the source model is opset {opset}, which onnxruntime does not run (opset "
            f"{ORT_OLDEST_OPSET} and newer), so the prepared model could not be compared with it; "
            "its older forms are rewritten by exact rules (pipeline/graph/legacy.py, checked "
            "against numpy in tests/test_legacy.py)"
        )
    return f"the source model does not load on the CPU EP: {error}"


def _source_outputs(
    config: ModelConfig,
    runnable: Any,
    heldout: Path,
    expected: SampleOutputs,
    optimize: bool = True,
    on_run: Callable[[], object] = lambda: None,
) -> tuple[list[str], int, str]:
    """The source model's outputs on each held-out sample at its true size, into ``expected``;
    its output names, how many samples it could not run, and the first such error."""
    try:
        reference = cpu_session(runnable, optimize)
    except Exception as exc:  # onnxruntime's own error types; the reason goes to the report
        raise _SourceDoesNotLoad(str(exc)) from exc
    names = [o.name for o in reference.get_outputs()]
    failures, first_failure = 0, ""
    for index, outputs in _true_size_runs(config, reference, names, heldout):
        on_run()
        if isinstance(outputs, Exception):  # e.g. the source needs an input no sample gives
            failures += 1
            first_failure = first_failure or f"{type(outputs).__name__}: {outputs}"[:300]
            continue
        expected.put(index, outputs)
        del outputs
    return names, failures, first_failure


def _true_size_runs(
    config: ModelConfig, session: Any, names: list[str], heldout: Path
) -> Iterator[tuple[int, Feeds | Exception]]:
    """``session`` (a model as the user gave it) on each held-out sample at its true size: the
    sample's inputs in the model's types, the config's constants, and inputs the preparation
    dropped as read by no node; the outputs ``names``, or the exception the run raised."""
    types = {i.name: i.type for i in session.get_inputs()}
    shapes = {i.name: i.shape for i in session.get_inputs()}
    constants = {
        name: constant_feed(
            value, np_dtype(types[name]), config.inputs.shapes.get(name, shapes[name])
        )
        for name, value in config.inputs.constants.items()
        if name in types
    }
    for index, own in enumerate(iter_samples(heldout)):
        feeds = {n: v.astype(np_dtype(types[n])) for n, v in own.items() if n in types}
        unread = {  # inputs the preparation dropped as read by no node: no sample holds them
            n: unread_input_feed(np_dtype(kind), shapes[n])
            for n, kind in types.items()
            if n not in feeds and n not in constants
        }
        try:
            outputs = session.run(names, {**feeds, **constants, **unread})
        except Exception as exc:
            yield index, exc
            continue
        named = dict(zip(names, outputs, strict=True))
        # Nothing of this sample stays in this frame through the next run: a 1024x2048
        # segmenter's outputs are 152 MiB a model.
        del outputs, feeds, own, unread
        yield index, named
        del named


def _shipped_vs_source(
    config: ModelConfig,
    shipped: Path,
    names: list[str],
    heldout: Path,
    expected: SampleOutputs,
    on_run: Callable[[], object] = lambda: None,
) -> tuple[dict[str, Accuracy], str]:
    """A requantized model's file as shipped (its own quantization, dynamic or static) against
    the float model behind it, which every other figure is measured against: how far the
    user's quantized model itself is from that reference. (summary, why not measured)."""
    try:
        session = cpu_session(shipped)
    except Exception as exc:  # onnxruntime's own error types
        return {}, f"{type(exc).__name__}: {exc}"[:300]
    comparison = OutputComparison.for_models(shipped)
    for index, outputs in _true_size_runs(config, session, names, heldout):
        on_run()
        if isinstance(outputs, Exception) or index not in expected:
            continue
        comparison.add(expected.get(index), outputs)
    del session
    return comparison.summary(), "" if comparison.samples else "no held-out sample ran"


def _compare_buckets(
    plan: BucketPlan,
    models: dict[str, Path],
    heldout: Path,
    names: list[str],
    expected: SampleOutputs,
    comparison: OutputComparison,
    on_run: Callable[[], object] = lambda: None,
) -> int:
    """Each held-out sample through its bucket's model (padded, run, cropped) against the
    source's outputs; the number of outputs whose cropped shape differs."""
    runs = {n: KeptRuns(p) for n, p in models.items()}
    rules: dict[str, list[bk.PadRule]] = {}
    for rule in plan.pads:
        rules.setdefault(rule.input, []).append(rule)
    mismatched = 0
    for index, own in enumerate(iter_samples(heldout)):
        if index not in expected:
            continue
        bucket = bk.choose_bucket(plan.buckets, plan.pads, {k: v.shape for k, v in own.items()})
        types = {i.name: np_dtype(i.type) for i in runs[bucket.name].get_inputs()}
        feeds = {
            name: bk.pad_input(own[name], shape, rules.get(name, []))[0]
            if name in own
            else np.zeros(shape, types.get(name, np.float32))
            for name, shape in bucket.shapes.items()
        }
        got = bk.crop_outputs(
            plan.pads, plan.crops, bucket, own, runs[bucket.name].run_named(names, feeds)
        )
        del feeds
        reference = expected.get(index)
        same = {n for n in names if np.shape(reference[n]) == np.shape(got[n])}
        mismatched += len(names) - len(same)
        comparison.add({n: reference[n] for n in same}, {n: got[n] for n in same})
        del got, reference, own
        on_run()
    return mismatched


def _on_grid(value: np.ndarray, step: float) -> bool:
    """Every value a whole number of ``step``s (the zero point is an integer too)."""
    units = value.astype(np.float64) / step
    return bool(np.all(np.abs(units - np.round(units)) < 1e-3))


def input_jitter(
    model: Path, heldout: Path, steps: dict[str, float], seed: int = 0
) -> dict[str, Accuracy]:
    """``model`` against itself with each input in ``steps`` moved by up to half its step.

    For a pre-quantized model ``steps`` are its own input quantization steps: the jitter only
    moves values across its own rounding boundaries, so the figure is how reproducible the
    model's integer arithmetic is, the floor for any implementation that rounds differently.
    Such a jitter moves a quarter of the values one step on average; an input already on its
    grid (integer pixels at step 1) would not move at all, so there a quarter of the values
    move one whole step instead.
    """
    rng = np.random.default_rng(seed)

    def move(feeds: Feeds) -> Feeds:
        moved = dict(feeds)
        for name, step in steps.items():
            if name not in moved:
                continue
            value = moved[name]
            if np.issubdtype(value.dtype, np.integer):  # int8 I/O: already its own integers
                info = np.iinfo(value.dtype)
                noise = rng.choice([-1, 0, 1], value.shape, p=[0.125, 0.75, 0.125])
                moved[name] = np.clip(value.astype(np.int64) + noise, info.min, info.max).astype(
                    value.dtype
                )
            elif np.issubdtype(value.dtype, np.floating):
                if _on_grid(value, step):
                    noise = step * rng.choice([-1.0, 0.0, 1.0], value.shape, p=[0.125, 0.75, 0.125])
                else:
                    noise = rng.uniform(-0.5 * step, 0.5 * step, value.shape)
                moved[name] = (value + noise).astype(value.dtype)
        return moved

    return _against_itself(model, heldout, move)


def _against_itself(
    model: Path, samples: Path | list[Path], move: Callable[[Feeds], Feeds]
) -> dict[str, Accuracy]:
    """``model`` on each sample against itself on the sample as ``move`` changes it (CPU)."""
    session = cpu_session(model)
    names = [o.name for o in session.get_outputs()]
    comparison = OutputComparison.for_models(model)
    for feeds in iter_samples(samples):
        expected = dict(zip(names, session.run(names, feeds), strict=True))
        comparison.add(expected, dict(zip(names, session.run(names, move(feeds)), strict=True)))
    return comparison.summary()


# fp16's relative rounding: half a unit in the last place of its 11-bit significand.
FLOAT16_ROUNDING = 2.0**-11


def float16_conditioning(model: Path, samples: list[Path], seed: int = 0) -> dict[str, Accuracy]:
    """``model`` against itself, in float32 on the CPU, with every float input moved by a
    relative fp16 rounding (up to ``FLOAT16_ROUNDING`` of each value).

    No NPU precision rounds less than that, and every op rounds again: a model whose outputs
    this alone moves below the target cannot meet it on these inputs, whatever is quantized or
    kept in fp16 (a seeded EfficientNetV2 whose BatchNorm statistics came from noise, not from
    images like the held-out ones: 8 dB from a 1e-3 input noise, 5.6 dB whole in fp16 on the
    HTP). Inputs outside the distribution the model's normalizations were fitted to (a wrong
    mean, std or scale in the config) make a trained model so too."""
    rng = np.random.default_rng(seed)

    def move(feeds: Feeds) -> Feeds:
        moved = dict(feeds)
        for name, value in feeds.items():
            if np.issubdtype(value.dtype, np.floating):
                jitter = rng.uniform(-FLOAT16_ROUNDING, FLOAT16_ROUNDING, value.shape)
                moved[name] = (value * (1.0 + jitter)).astype(value.dtype)
        return moved

    return _against_itself(model, samples, move)


def state_like_inputs(model: Path) -> set[str]:
    """Inputs shaped like an output (same dtype and shape): where a stream's state may come
    back in. An image-to-image model has them too; ``carried_states`` tells the two apart."""
    from qnn_ctx_runtime.qnn import read_model_summary

    summary = read_model_summary(model)
    shapes = {(o.dtype, tuple(o.shape)) for o in summary.outputs}
    return {i.name for i in summary.inputs if (i.dtype, tuple(i.shape)) in shapes}


def unfed_states(model: Path, fed: Iterable[str]) -> tuple[dict[str, str], list[str]]:
    """State inputs the data does not feed (a float input not in ``fed`` shaped like an output)
    paired with the output that feeds them: the one output of that shape, or among several the
    one whose name starts with the input's (h -> hn, state -> stateN), each output once.
    Returns (input -> output, inputs left unpaired: no output told apart by name)."""
    from qnn_ctx_runtime.qnn import read_model_summary

    summary = read_model_summary(model)
    fed = set(fed)
    pairs: dict[str, str] = {}
    unpaired: list[str] = []
    for spec in summary.inputs:
        if spec.name in fed or not spec.dtype.startswith("float"):
            continue
        same = [
            o.name
            for o in summary.outputs
            if (o.dtype, tuple(o.shape)) == (spec.dtype, tuple(spec.shape))
            and o.name not in pairs.values()
        ]
        named = [o for o in same if o.lower().startswith(spec.name.lower())]
        if len(same) == 1 or len(named) == 1:
            pairs[spec.name] = same[0] if len(same) == 1 else named[0]
        elif same:
            unpaired.append(spec.name)
    return pairs, unpaired


def carried_states(reference_model: Path, heldout: Path) -> dict[str, str]:
    """State input -> the output that feeds it, found in the held-out windows themselves: an
    input that, window after window, holds what an output of the same shape gave on the window
    before (non-zero), twice at least. A python reader that carries a stream's state itself
    declares no ``calibration.recurrent``; an image-to-image model, whose output is never its
    next input, has none. Nothing runs for a model with no input shaped like an output."""
    inputs = state_like_inputs(reference_model)
    if not inputs:
        return {}
    ref = KeptRuns(reference_model)
    names = ref.output_names()
    pairs: dict[tuple[str, str], int] = {}
    previous: Feeds | None = None
    for feeds in iter_samples(heldout):
        outputs = ref.run_named(names, feeds)
        if previous is not None:
            for inp in inputs & set(feeds):
                value = np.asarray(feeds[inp])
                if value.dtype.kind != "f" or not np.any(value):
                    continue
                for out, before in previous.items():
                    if follows(value, before):
                        pairs[(inp, out)] = pairs.get((inp, out), 0) + 1
        previous = {n: np.asarray(v) for n, v in outputs.items() if np.asarray(v).dtype.kind == "f"}
    found = {inp: out for (inp, out), count in sorted(pairs.items()) if count >= 2}
    return found if len(set(found.values())) == len(found) else {}


def closed_loop(
    reference_model: Path, test_model: Path, heldout: Path, recurrent: dict[str, str]
) -> dict[str, Accuracy]:
    """``test_model`` fed its own state, window after window, as a streaming app runs it,
    against ``reference_model`` on the held-out windows as stored (whose state inputs are the
    reference's own outputs: ``calibration.recurrent``); ``recurrent``: state input -> the
    output that feeds it (``core.stream.run_closed_loop``). Empty when no window continues
    another. The state outputs themselves are not compared (they drift where the outputs an
    app reads may not), unless they are all."""
    ref = KeptRuns(reference_model)
    test = KeptRuns(test_model)
    names = ref.output_names()
    comparison = OutputComparison.for_models(reference_model, test_model)
    _, carried = run_closed_loop(
        iter_samples(heldout),
        lambda feeds: ref.run_named(names, feeds),
        lambda feeds: test.run_named(names, feeds),
        recurrent,
        comparison.add,
    )
    return comparison.summary() if carried else {}
