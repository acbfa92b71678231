"""What the NPU computes for a QDQ model, measured on the HTP, in a child process.

``probe(...)`` compiles the QDQ model for one chip (QNN EP, in memory of a temp folder), runs it
on the HTP (the x86_64 simulator here) over held-out samples, and compares its outputs with the
prepared float model and with the same QDQ model on the CPU EP. With ``locate = True`` every
activation of the QDQ model is also made a graph output, so the comparison is tensor by tensor:
the first tensor (in graph order) where the HTP and the CPU QDQ model part ways names the op that
the HTP computes differently (e.g. 16-bit weights in a dilated convolution).

``python -m pipeline.htp.probe JOB.json`` is the child; the parent never loads QNN itself.

The x86_64 simulator runs a graph on one thread and spins a second one (measured: 8.9 s for 6
samples on two cores, 9.1 s pinned to one; two unpinned probes side by side were slower than one,
two pinned ones 1.65x faster). So the samples are shared out by work stealing: the child claims
them one by one from the front (an exclusive claim file each), and a helper per further core
(Linux, 4 GiB of available memory each), started with the child and pinned to its own core,
loads the very same context as soon as the child has compiled it and claims from the back; the
child pins itself to one core when its run starts. A helper that started late (it waited a
second of the run before: a third of a 2.6 s run on SqueezeNet) left most samples to the child.
The child then waits for the helpers' outputs, runs itself any sample whose claimer died, and
compares. On a quick model the helper finds every sample claimed and ends without loading: its
start-up ran on the other core.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from qnn_ctx_runtime.typed import parse, to_json_value

from ..core.accuracy import BELOW_STEP, Accuracy, worst_snr
from ..core.cpu import cpu_session
from ..core.fileio import link_or_copy, sha256_file
from ..core.layout import (
    AGREE_SAMPLES,
    ENOUGH_SAMPLES,
    HTP_MIN_SAMPLES,
    evidence_order,
    past_htp_budget,
    simulator_seconds,
)
from ..core.memory import adapt_heap_to, release_freed_memory, rss_bytes
from ..core.metrics import OutputComparison, packed_parts, power_snr_db, storable
from ..core.records import EpNodes, HtpLoad, NodeRef
from .isolation import (
    Finished,
    Started,
    await_job,
    die_with_parent,
    hand_over,
    start_module,
    wait_for,
)

MODULE = "pipeline.htp.probe"
DIVERGENCE_DB = 30.0  # HTP vs CPU QDQ below this at one tensor: they compute it differently
# The locator's activations, a sample: the HTP's run, the CPU QDQ model's and the comparison
# each hold them all (a 1x3x1024x2048 LR-ASPP: every activation at once took 4.3 GiB).
EXPOSED_BYTES = 256 << 20
EXPLAINS_DB = 3.0  # ... and at most this much above the worst output's: it explains the output
CARRIED_TENSORS = 64  # a parting followed this far through its readers reaches the output
CTX_NAME = "probe_ctx.onnx"
RESULT_NAME = "probe_result.json"  # the main child's result, which its helpers watch
# The CPUs this process may use when it starts, before it pins itself to one for its run.
ALL_CORES = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
STASH = "htp_outputs"  # each sample's HTP outputs (<i>.npz) and who claimed it (<i>.claim)


@dataclass(frozen=True)
class ProbeJob:
    qdq: str
    float_model: str
    samples: list[str]  # .npz feeds
    work: str  # a folder the child may write to
    result: str
    soc_model: int
    htp_arch: int
    qnn_options: dict[str, str] = field(default_factory=dict)
    locate: bool = False
    ctx: str = ""  # a helper: load this context (the main child's) instead of compiling
    helper: bool = False  # claim samples from the back, run them, stash the outputs; no compare
    core: int = -1  # pin this process (and the threads QNN starts) to this CPU
    run_core: int = -1  # the main child, helped: pin itself to this CPU when its run starts
    budget_s: float = 0.0  # no new sample after this many seconds of running (0: every sample)
    min_samples: int = HTP_MIN_SAMPLES  # ... once this many are claimed
    references: str = ""  # a folder of <index>.npz: the float model's outputs on each sample
    enough_db: float = 0.0  # no new sample once ``enough_samples`` ran at this SNR vs float, pooled
    enough_floor_db: float = 0.0  # ... and each of them at this one at least (0: ``enough_db``)
    enough_samples: int = ENOUGH_SAMPLES
    # ... or once ``agree_samples`` are enough so and the ctx is at ``agree_db`` vs the CPU QDQ
    # model pooled (the CPU QDQ model's outputs on each sample: ``qdq_references``)
    qdq_references: str = ""
    agree_db: float = 0.0
    agree_samples: int = AGREE_SAMPLES
    # ... or once ``enough_samples`` are below ``losing_db`` vs float pooled (``losing``): the
    # judge's best candidate so far less a margin, which this one then cannot beat
    losing: bool = False
    losing_db: float = 0.0


@dataclass(frozen=True)
class TensorAgreement:
    """One activation: how closely the HTP reproduces the CPU QDQ model there."""

    name: str
    op_type: str  # the op that produced it
    node: str
    snr_db: float
    # the dequantized activations computed from it next (through one op and its Q/DQ)
    readers: list[str] = field(default_factory=list)


@dataclass
class ProbeResult:
    status: str = "running"  # running | ok | failed
    stage: str = "start"
    error: str = ""
    qnn_sdk: str = ""
    onnxruntime_qnn: str = ""
    ctx_sha256: str = ""
    sample_sha256: list[str] = field(default_factory=list)
    partitions: int = 0
    cpu_nodes: int = 0
    samples: int = 0  # compared: all of those asked for, or fewer when the budget ran out
    requested: int = 0  # asked for
    # why fewer ran: "budget" (the simulator's time), "evidence" (enough_db), "agreement"
    # (agree_db: the HTP agreed with the CPU QDQ model) or "losing" (below losing_db)
    cut_by: str = ""
    seconds_per_sample: float = 0.0  # the simulator's, in one process
    ctx_vs_float: dict[str, Accuracy] = field(default_factory=dict)
    ctx_vs_qdq: dict[str, Accuracy] = field(default_factory=dict)
    qdq_vs_float: dict[str, Accuracy] = field(default_factory=dict)
    tensors: list[TensorAgreement] = field(default_factory=list)
    exposable: int = 0  # activations the locator could expose (``tensors`` holds those it did)
    seconds: float = 0.0
    compile_s: float = 0.0  # the offline compile of the QDQ model (what loading it online costs)
    load: HtpLoad | None = None  # the main child's session on its ctx, when its load was timed

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def worst_ctx_vs_float(self) -> float:
        return worst_snr(self.ctx_vs_float)

    @property
    def worst_ctx_vs_qdq(self) -> float:
        return worst_snr(self.ctx_vs_qdq)

    def first_divergence(self, threshold: float = DIVERGENCE_DB) -> TensorAgreement | None:
        """The first tensor, in graph order, where the HTP and the CPU QDQ model part ways as
        far as at the worst output (within ``EXPLAINS_DB``): a milder divergence earlier (an
        unselected branch of a Where, a tensor whose error later ops absorb) is not what the
        output is short by, and leaving it in fp16 moves nothing (a wake-word head: its
        verifier's Sigmoid at 19.9 dB came first, the score's at 0 dB was the output's)."""
        outputs = self.worst_ctx_vs_qdq
        if outputs == outputs:  # not NaN: some output compared
            threshold = min(threshold, outputs + EXPLAINS_DB)
        by_name = {t.name: t for t in self.tensors}

        def carried(tensor: TensorAgreement) -> bool:
            """Whether the parting reaches past what reads it: exposed as an output, a tensor
            can come out wrong where the graph around it is right (a Relu the HTP folds into
            its Conv read -0.5 dB, the MaxPool after it 53; a norm's Mul -0.4, the tensor after
            it 68.8), and leaving it in fp16 moved nothing. So can a chain of them: a magnitude's
            n / m for m = n = 0 (a silent STFT bin: 0/0, computed differently) read -2.4 dB and
            so did the three ops after it, but the m * root that ends it agreed at 60 dB (GTCRN).
            Followed through readers that part ways too, up to ``CARRIED_TENSORS``; a tensor
            whose readers are unknown (not exposed, a graph output) counts as carrying it."""
            seen, todo = {tensor.name}, [tensor]
            while todo:
                if len(seen) > CARRIED_TENSORS:
                    return True
                current = todo.pop()
                known = [by_name[r] for r in current.readers if r in by_name]
                if not known:
                    return True
                for reader in known:
                    if reader.snr_db < threshold and reader.name not in seen:
                        seen.add(reader.name)
                        todo.append(reader)
            return False

        return next((t for t in self.tensors if t.snr_db < threshold and carried(t)), None)

    def sources_db(self, tensor: TensorAgreement) -> float | None:
        """The worst agreement among the exposed tensors ``tensor`` is computed from (those
        that list it among their readers); None when none of them was exposed (a graph input,
        a constant)."""
        found = [t.snr_db for t in self.tensors if tensor.name in t.readers]
        return min(found) if found else None


def _save(path: Path, result: ProbeResult) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(to_json_value(result)), encoding="utf-8")
    tmp.replace(path)


def _load(cls: type, path: Path) -> Any:
    issues: list[str] = []
    value = parse(cls, json.loads(Path(path).read_text("utf-8")), "", issues)
    if issues or value is None:
        raise ValueError(f"{path}: " + "; ".join(issues[:5]))
    return value


# -- the parent -----------------------------------------------------------------------------------


def qnn_available() -> str:
    """'' when this interpreter can run the QNN EP, else why not (checked without loading it)."""
    from qnn_ctx_runtime import qnn

    installed = qnn.installed_qnn()
    if not installed.present:
        return "onnxruntime-qnn is not installed in this environment"
    return ""


def _cores(samples: int, locate: bool) -> list[int]:
    """The CPUs a probe may use, one simulator process each: every core this process may run on
    (Linux, where a process can be pinned), no more than there are samples, and each extra
    process only with 4 GiB of memory available. A locator run (every activation an output)
    stays in one process."""
    if locate or samples < 2 or not hasattr(os, "sched_getaffinity"):
        return []
    cores = sorted(os.sched_getaffinity(0))
    available = _available_bytes()
    if available is not None:
        cores = cores[: 1 + int(available // HELPER_MEMORY)]
    return cores[:samples] if len(cores) >= 2 else []


HELPER_MEMORY = 4 << 30  # bytes of available memory asked for each extra simulator process


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def probe(
    qdq: Path,
    float_model: Path,
    samples: list[Path],
    work: Path,
    soc_model: int,
    htp_arch: int,
    qnn_options: dict[str, str] | None = None,
    locate: bool = False,
    timeout_s: float = 900.0,
    budget_s: float = 0.0,
    references: Sequence[dict[str, np.ndarray]] | None = None,
    enough_db: float = 0.0,
    enough_floor_db: float = 0.0,
    qdq_references: list[dict[str, np.ndarray]] | None = None,
    agree_db: float = 0.0,
    losing_db: float | None = None,
    on_progress: Callable[[str, float], None] | None = None,
) -> ProbeResult:
    """Compile ``qdq`` for the HTP, run it there and compare; a dead child is a failed result.
    With ``budget_s``, the samples still unstarted after that many seconds of running are left
    out (``HTP_MIN_SAMPLES`` at least run): ``samples`` < ``requested`` says so. With
    ``references`` (the float model's outputs on each sample) and ``enough_db``, so are those
    still unstarted once ``ENOUGH_SAMPLES`` have run at ``enough_db`` vs float pooled, each of
    them at ``enough_floor_db`` at least (0: ``enough_db`` each); with ``qdq_references`` (the
    CPU QDQ model's outputs on each sample) and ``agree_db``, once ``AGREE_SAMPLES`` are so and
    at ``agree_db`` vs the CPU QDQ model, pooled; with ``losing_db``, once ``ENOUGH_SAMPLES``
    are below it vs float, pooled (the candidate cannot be kept). Either set of outputs, where
    given, is also what the comparison takes instead of running that model again.
    ``on_progress`` hears what the child is at (compiling, or samples done of the requested)
    and the seconds waited, every ``PROGRESS_EVERY_S``: a 1024x1024 segmenter's first round
    ran 11 minutes on the simulator without a line."""
    work.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work / STASH, ignore_errors=True)  # outputs and claims of an earlier probe
    reference_folder = work / "references"
    shutil.rmtree(reference_folder, ignore_errors=True)
    # Outputs the caller has are written for the child: its early stops read them, and its
    # comparison takes them instead of running the model again.
    with_references = not locate and references is not None and len(references) == len(samples)
    if with_references:
        _write_outputs(reference_folder, references)
    else:
        enough_db = 0.0
    qdq_folder = work / "qdq_references"
    shutil.rmtree(qdq_folder, ignore_errors=True)
    with_qdq = not locate and qdq_references is not None and len(qdq_references) == len(samples)
    if with_qdq:
        _write_outputs(qdq_folder, qdq_references)
    if not (enough_db and agree_db and with_qdq):
        agree_db = 0.0
    for stale in [work / RESULT_NAME, work / CTX_NAME, *work.glob("probe_helper_*")]:
        stale.unlink(missing_ok=True)  # its stage or context must not pass for this probe's
    cores = _cores(len(samples), locate)
    job = ProbeJob(
        qdq=str(qdq.resolve()),
        float_model=str(float_model.resolve()),
        samples=[str(p.resolve()) for p in samples],
        work=str(work.resolve()),
        result=str((work / RESULT_NAME).resolve()),
        soc_model=soc_model,
        htp_arch=htp_arch,
        qnn_options=dict(qnn_options or {}),
        locate=locate,
        run_core=cores[0] if cores else -1,
        budget_s=budget_s,
        references=str(reference_folder.resolve()) if with_references else "",
        enough_db=enough_db,
        enough_floor_db=enough_floor_db,
        qdq_references=str(qdq_folder.resolve()) if with_qdq else "",
        agree_db=agree_db,
        losing=losing_db is not None and enough_db > 0,
        losing_db=losing_db if losing_db is not None else 0.0,
    )
    warm = _SPARES.take(len(cores[1:])) if _SPARES is not None else None
    if warm is not None:  # started ahead, QNN registered: the job is all they wait for
        main, helpers = warm
        _hand_over(main, job)
        for k, (helper, core) in enumerate(zip(helpers, cores[1:], strict=True), start=1):
            _hand_over(helper, _helper_job(job, work, k, core))
    else:
        job_path = work / "probe_job.json"
        job_path.write_text(json.dumps(to_json_value(job)), encoding="utf-8")
        helpers = _start_helpers(job, work, cores[1:])
        main = start_module(MODULE, job_path, work / "probe.log")
    tick = _reaper(helpers)
    if on_progress is not None:
        tick = _reporting(tick, on_progress, work, len(samples))
    try:
        done = wait_for(main, timeout_s, tick)
    finally:
        for helper in helpers:  # the main child is done (or dead): nothing left for them
            if helper.proc.poll() is None:
                helper.kill()
            helper.finish()
    return _outcome(job, done, timeout_s)


def _write_outputs(folder: Path, outputs: Sequence[dict[str, np.ndarray]]) -> None:
    """One ``<index>.npz`` per sample: a model's outputs there, for the children to read.
    Outputs on disk (``evaluate.OutputsOnDisk``, computed as asked for) are linked for the
    samples the early stop reads only, the first ``ENOUGH_SAMPLES`` of its order: the children
    compute the others' where they need them (and once a round stops there, none)."""
    folder.mkdir()
    on_disk = getattr(outputs, "path", None)
    count = len(outputs)
    if on_disk is None:
        for index in range(count):
            np.savez(folder / f"{index:04d}.npz", **outputs[index])
        return
    for index in evidence_order(count)[:ENOUGH_SAMPLES]:
        link_or_copy(on_disk(index), folder / f"{index:04d}.npz")


def _helper_job(job: ProbeJob, work: Path, k: int, core: int) -> ProbeJob:
    return replace(
        job,
        result=str((work / f"probe_helper_{k}.json").resolve()),
        ctx=str((work / CTX_NAME).resolve()),
        helper=True,
        core=core,
        run_core=-1,
    )


def _start_helpers(job: ProbeJob, work: Path, cores: list[int]) -> list[Started]:
    """One helper per extra core, each pinned to it: it waits for the main child's context."""
    started = []
    for k, core in enumerate(cores, start=1):
        path = work / f"probe_helper_{k}_job.json"
        path.write_text(json.dumps(to_json_value(_helper_job(job, work, k, core))), "utf-8")
        started.append(start_module(MODULE, path, work / f"probe_helper_{k}.log"))
    return started


# -- probe processes started ahead of their job ---------------------------------------------------

AWAIT = "--await"  # the child's option: warm up, then wait for the job file to appear


@dataclass
class _Spares:
    """Probe processes (a main child and a helper per extra core) started while the stage
    prepares and calibrates, each importing onnxruntime and registering QNN (0.25-0.5 s of a
    probe's start, measured on SqueezeNet) on a core the stage leaves idle, then waiting for
    its job file. The first probe takes them; later ones start their own."""

    folder: Path
    main: Started
    helpers: list[Started]

    def take(self, helpers: int) -> tuple[Started, list[Started]] | None:
        """The main child and ``helpers`` helpers (extra ones are ended), once."""
        global _SPARES
        _SPARES = None
        died = any(child.proc.poll() is not None for child in [self.main, *self.helpers])
        if died or helpers > len(self.helpers):
            self.close()  # one died waiting (QNN failed to load?): a cold start says how
            return None
        for extra in self.helpers[helpers:]:
            extra.kill()
            extra.finish()
        return self.main, self.helpers[:helpers]

    def close(self) -> None:
        for child in [self.main, *self.helpers]:
            if not child.log.closed:
                if child.proc.poll() is None:
                    child.kill()
                child.finish()


_SPARES: _Spares | None = None


def _hand_over(child: Started, job: ProbeJob) -> None:
    hand_over(child, json.dumps(to_json_value(job)))


@contextmanager
def spare_probes(scratch: Path) -> Iterator[None]:
    """While the block runs, the first ``probe`` finds its processes started and warm. Nothing
    is started where the probe could not run (no onnxruntime-qnn); whatever was not taken is
    ended on the way out, and the folder of their job files and logs removed."""
    global _SPARES
    if _SPARES is not None or qnn_available():
        yield
        return
    folder = Path(tempfile.mkdtemp(prefix=".htp-spares-", dir=scratch))
    cores = _cores(2, locate=False)
    main = start_module(MODULE, folder / "main.json", folder / "main.log", (AWAIT,))
    helpers = [
        start_module(MODULE, folder / f"helper{k}.json", folder / f"helper{k}.log", (AWAIT,))
        for k in range(1, len(cores))
    ]
    spares = _SPARES = _Spares(folder, main, helpers)
    try:
        yield
    finally:
        if _SPARES is spares:
            _SPARES = None
        spares.close()
        shutil.rmtree(folder, ignore_errors=True)


def _reaper(helpers: list[Started]) -> Callable[[float], None]:
    """Reaps a dead helper while the main child runs, so the child sees its claims orphaned."""

    def tick(_elapsed: float) -> None:
        for helper in helpers:
            helper.proc.poll()

    return tick


PROGRESS_EVERY_S = 30.0  # how often a waiting probe tells what its child is at


def _reporting(
    tick: Callable[[float], None],
    on_progress: Callable[[str, float], None],
    work: Path,
    requested: int,
) -> Callable[[float], None]:
    """``tick``, and every ``PROGRESS_EVERY_S`` of the wait: the child's step, read from its
    files (no context yet: compiling; then the samples whose HTP outputs are stashed)."""
    told = [0.0]

    def report(elapsed: float) -> None:
        tick(elapsed)
        if elapsed - told[0] < PROGRESS_EVERY_S:
            return
        told[0] = elapsed
        if not (work / CTX_NAME).is_file():
            on_progress("compiling for the HTP", elapsed)
            return
        ran = sum(1 for _ in (work / STASH).glob("[0-9]*.npz")) if (work / STASH).is_dir() else 0
        on_progress(f"{ran} of {requested} samples run on the HTP", elapsed)

    return report


def _pin_threads(core: int) -> None:
    """Pin every thread of this process (QNN's spinning one too) to ``core``."""
    try:
        for task in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(task), {core})
    except (OSError, ValueError):
        return  # this is no Linux: the helpers still help


# QNN's native libraries print this at every start: it tells nothing of how a child died.
_START_NOISE = "# LIBNATIVE:"


def _telling(line: str) -> bool:
    return bool(line.strip()) and not line.lstrip().startswith(_START_NOISE)


def _outcome(job: ProbeJob, done: Finished, timeout_s: float) -> ProbeResult:
    """The child's result file, or a failed result saying how it died."""
    try:
        result: ProbeResult = _load(ProbeResult, Path(job.result))
    except (OSError, ValueError):
        result = ProbeResult()
    if done.timed_out:
        result.status, result.error = "failed", f"timed out after {timeout_s:g} s in {result.stage}"
    elif done.out_of_memory:
        result.status = "failed"
        result.error = f"the HTP child ran out of memory in {result.stage}: {done.out_of_memory}"
    elif result.status != "ok" and not result.error:
        tail = [line for line in done.log.splitlines() if _telling(line)][-2:]
        outside = (
            ", killed from outside the build: the kernel's out-of-memory killer or an operator"
            if done.killed_from_outside()
            else ""
        )
        result.status = "failed"
        result.error = f"the HTP child died in {result.stage} ({done.signal_name()}{outside})" + (
            ": " + " / ".join(tail) if tail else ""
        )
    result.seconds = done.seconds
    return result


# -- the child ------------------------------------------------------------------------------------


def _exposed(
    qdq_path: str, out: Path, budget: int = EXPOSED_BYTES
) -> tuple[Path, list[tuple[str, str, str]], int, dict[str, list[str]]]:
    """The QDQ model with dequantized activations as graph outputs, their producers, how many
    there were, and which each is read into (``_dequantized_readers``): all of them when they
    fit ``budget`` bytes a sample, else a subset spread evenly over the graph by size (the
    first divergence is then named to within a stretch)."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(qdq_path)
    inits = {i.name for i in model.graph.initializer}
    outputs = {o.name for o in model.graph.output}
    producer = {o: n for n in model.graph.node for o in n.output}
    candidates = []
    for node in model.graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] in inits:
            continue
        quantize = producer.get(node.input[0])
        source = producer.get(quantize.input[0]) if quantize is not None else None
        op, name = (source.op_type, source.name) if source is not None else ("input", "")
        candidates.append((node.output[0], op, name))
    exposed = _spread(candidates, _float_bytes(model, [t for t, _, _ in candidates]), budget)
    for tensor, _, _ in exposed:
        if tensor not in outputs:  # graph outputs are compared already, in their place
            model.graph.output.append(
                helper.make_tensor_value_info(tensor, TensorProto.FLOAT, None)
            )
    readers = _dequantized_readers(model, inits)
    path = out / "probe_qdq.onnx"
    onnx.save(model, str(path))
    return path, exposed, len(candidates), readers


def _dequantized_readers(model: Any, inits: set[str]) -> dict[str, list[str]]:
    """Each dequantized activation -> those computed from it next: its readers' outputs, each
    through its QuantizeLinear and DequantizeLinear."""
    readers: dict[str, list[Any]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    following: dict[str, list[str]] = {}
    for node in model.graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] in inits:
            continue
        names = []
        for reader in readers.get(node.output[0], []):
            if reader.op_type in ("QuantizeLinear", "DequantizeLinear"):
                continue
            for out in reader.output:
                for q in readers.get(out, []):
                    if q.op_type != "QuantizeLinear":
                        continue
                    names += [
                        d.output[0]
                        for d in readers.get(q.output[0], [])
                        if d.op_type == "DequantizeLinear"
                    ]
        following[node.output[0]] = names
    return following


def _float_bytes(model: Any, names: list[str]) -> dict[str, int]:
    """Bytes of each named tensor as float32 (0 where shape inference leaves it unknown)."""
    from ..graph.edit import inferred_values, value_shape

    values = inferred_values(model)
    sizes = {}
    for name in names:
        shape = value_shape(values[name]) if name in values else None
        sizes[name] = 4 * math.prod(shape) if shape is not None else 0
    return sizes


def _spread(
    candidates: list[tuple[str, str, str]], sizes: dict[str, int], budget: int
) -> list[tuple[str, str, str]]:
    """All ``candidates`` when their sizes fit ``budget``, else about ``budget`` bytes of them
    spread evenly by size: each tensor earns its share of the budget, and is kept once what it
    and those before it earned covers it."""
    total = sum(sizes.values())
    if total <= budget:
        return candidates
    kept, credit = [], 0.0
    for candidate in candidates:
        size = sizes[candidate[0]]
        credit += size * budget / total
        if credit >= size:
            kept.append(candidate)
            credit -= size
    return kept


def _run(job: ProbeJob, result: ProbeResult, path: Path) -> None:
    def stage(name: str) -> None:
        result.stage = name
        _save(path, result)

    work = Path(job.work)
    stash = work / STASH
    stash.mkdir(exist_ok=True)
    if job.helper:
        # Before any import of onnxruntime or QNN: on a quick model the child has claimed
        # every sample by then, and a helper that only waited cost nothing measurable (one
        # that registered QNN meanwhile cost the small models 0.25 s).
        stage("wait")
        if not _context_ready(job, stash):
            result.status = "ok"
            stage("done")
            return  # the main child failed or ended, or it has every sample: nothing to help with
    if job.samples:  # an uncompressed .npz: its size is the sample's
        adapt_heap_to(Path(job.samples[0]).stat().st_size)
    model_path, exposed, result.exposable, readers = (
        _exposed(job.qdq, work) if job.locate else (Path(job.qdq), [], 0, {})
    )
    outputs = _output_names(job.float_model)
    names = outputs + [t for t, _, _ in exposed if t not in outputs]
    time_load = _run_on_htp(job, result, stage, model_path, names, stash)
    if not job.helper:
        if hasattr(os, "sched_setaffinity"):  # pinned for its run when helped: compare on all
            os.sched_setaffinity(0, ALL_CORES)
        stage("compare")
        _compare(job, result, model_path, outputs, names, exposed, readers, stash)
    result.status = "ok"
    stage("done")
    if time_load is not None:  # after "done" is saved: should QNN kill it now, the run stands
        result.load = time_load()
        if result.load is not None:
            _save(path, result)


def _output_names(float_model: str) -> list[str]:
    """Read over mmap: the child imports onnx only to expose a locator's tensors (7 MiB)."""
    from qnn_ctx_runtime.qnn import read_model_summary

    return [o.name for o in read_model_summary(float_model).outputs]


def _stashed(stash: Path, index: int) -> Path:
    return stash / f"{index:04d}.npz"


SKIPPED = "skipped"  # a claim file's content for a sample the budget left out


def _claim(stash: Path, index: int, mark: str = "") -> bool:
    """Take sample ``index`` for this process (or mark it left out); False when another
    process has it."""
    try:
        fd = os.open(stash / f"{index:04d}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as claim:
        claim.write(mark or str(os.getpid()))
    return True


def _claimer_alive(stash: Path, index: int) -> bool:
    """Whether the process that claimed ``index`` may still deliver it (a zombie, dead but not
    yet reaped by the parent, will not)."""
    try:
        pid = int((stash / f"{index:04d}.claim").read_text())
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, ValueError):  # being written, or not ours to signal: assume alive
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def _run_on_htp(
    job: ProbeJob,
    result: ProbeResult,
    stage: Callable[[str], None],
    model_path: Path,
    names: list[str],
    stash: Path,
) -> Callable[[], HtpLoad | None] | None:
    """Compile (or, a helper, load the main child's context), measure the partitioning, then run
    the samples this process claims and stash their outputs (written whole, then renamed, so
    another process only ever sees complete files). The main child then waits for the helpers'
    samples and runs itself any whose claimer died."""
    import onnxruntime as ort

    from qnn_ctx_runtime import qnn

    from ..compile.coverage import assignment_from_session, summarize, tensor_specs

    stage("register")
    ep = qnn.find_qnn_ep()
    result.qnn_sdk = ep.installed.qnn_sdk
    result.onnxruntime_qnn = ep.installed.package_version
    work = Path(job.work)
    if job.helper:
        ctx_path = Path(job.ctx)
    else:
        stage("compile")
        extra = tuple(sorted(job.qnn_options.items()))
        options = ep.session_options(
            qnn.QnnOptions("htp", job.soc_model, job.htp_arch, extra), {}, 3
        )
        ctx_path = work / CTX_NAME
        partial = work / f".{CTX_NAME}.partial.onnx"
        partial.unlink(missing_ok=True)
        started = time.perf_counter()
        ort.ModelCompiler(
            options, str(model_path), embed_compiled_data_into_model=True
        ).compile_to_file(str(partial))
        result.compile_s = time.perf_counter() - started
        partial.replace(ctx_path)
        # The compile's freed working memory stays in the heap otherwise, under every run
        # after it: a small recognizer's child 337 -> 254 MiB at its peak.
        release_freed_memory()
    result.ctx_sha256 = sha256_file(ctx_path)
    stage("load")
    record = {"session.record_ep_graph_assignment_info": "1"}
    rss_before = rss_bytes()
    began = time.perf_counter()
    ctx = ort.InferenceSession(str(ctx_path), ep.session_options(qnn.QnnOptions("htp"), record, 3))
    first_load_s = time.perf_counter() - began
    rss_after = rss_bytes()
    ctx.disable_fallback()  # a failed run retried on the CPU hides the QNN EP's own error
    # The same account compile's coverage gate keeps: Q/DQ at the graph I/O and a declared CPU
    # tail (ai.onnx.ml post-processing) are not CPU compute; counting them disqualified every
    # such model's candidates, and the judge went on to try the whole model in fp16 for nothing.
    assignment = assignment_from_session(ctx)
    coverage = summarize(assignment, qnn.read_model_summary(ctx_path))
    result.partitions = coverage.qnn_partitions
    result.cpu_nodes = len(coverage.cpu_compute_nodes)
    on_qnn = qnn.EP_NAME in ctx.get_providers()
    session_io = None  # for compile (``HtpLoad``); unreadable: compile's worker reads them itself
    with contextlib.suppress(Exception):  # never the probe's failure
        session_io = (tensor_specs(ctx.get_inputs()), tensor_specs(ctx.get_outputs()))

    # The HTP's outputs go to disk first and its session is closed before the CPU models run:
    # the simulator and two CPU sessions of a 1024x2048 model side by side took 1.7 GiB.
    stage("run")
    if job.run_core >= 0:
        _pin_threads(job.run_core)  # a helper has its own core: keep off it
    count = len(job.samples)
    simulated, ran = 0.0, 0  # the simulator's CPU seconds (simulator_seconds), samples run
    order = _claim_order(job, count)
    for index in order:
        if _over_budget(job, stash, simulated, ran) or _wait_for_evidence(job, stash, order):
            break  # the samples left unclaimed are left out, by every process alike
        if _claim(stash, index):
            started = simulator_seconds()
            _run_sample(ctx, job.samples[index], names, _stashed(stash, index))
            simulated += simulator_seconds() - started
            _note_figure(job, stash, index, names)
            ran += 1
            if job.helper:  # its file says what it delivered, should the parent end it now
                result.samples = ran
                stage("run")
    if ran:
        result.seconds_per_sample = simulated / ran
    if not job.helper:
        # Whatever is unclaimed now is left out, for good: a helper claiming it after this
        # would add a sample the comparison did not wait for.
        left_out = [index for index in range(count) if _claim(stash, index, SKIPPED)]
        if left_out:
            result.cut_by = _cut_by(job, stash, order)
    while not job.helper:
        missing = [i for i in _claimed(stash, count) if not _stashed(stash, i).is_file()]
        if not missing:
            break
        for index in missing:
            if not _claimer_alive(stash, index) and not _stashed(stash, index).is_file():
                # its helper died: this process runs it after all
                _run_sample(ctx, job.samples[index], names, _stashed(stash, index))
        time.sleep(0.02)
    del ctx  # its session holds the simulator; the CPU models run next
    release_freed_memory()
    if (
        job.helper
        or job.locate
        or not on_qnn
        or session_io is None
        or first_load_s > TIMED_LOAD_MAX_S
    ):
        return None
    inputs, outputs = session_io

    def time_load() -> HtpLoad | None:
        """The session's account and its load timed (``HtpLoad``), or None: a load that fails
        here is compile's worker's to report, never this probe's failure."""
        try:
            return HtpLoad(
                [EpNodes(name, [NodeRef(n, op) for n, op in nodes]) for name, nodes in assignment],
                inputs,
                outputs,
                rss_before,
                rss_after,
                LOAD_RUNS,
                min(first_load_s, _ctx_load_s(ep, ctx_path, LOAD_RUNS - 1)),
            )
        except Exception:
            return None

    return time_load


# The judge's child times its ctx's session creation (what compile's worker would, loading the
# same bytes) when the first took this long at most, in every round (which one is kept is not
# known yet): compile then needs no worker of its own for it
# (``pipeline.compile.worker.judged_variant``); a slower load is left to compile, once.
TIMED_LOAD_MAX_S = 0.25
LOAD_RUNS = 3  # the first load and as many more: compile's [compile] load_runs default


def _ctx_load_s(ep: Any, ctx_path: Path, runs: int) -> float:
    """Session creation on the ctx, min of ``runs``, with compile's benchmark's options."""
    import onnxruntime as ort

    from qnn_ctx_runtime import qnn

    times = [float("inf")]
    for _ in range(runs):
        began = time.perf_counter()
        session = ort.InferenceSession(
            str(ctx_path), ep.session_options(qnn.QnnOptions("htp"), {}, 3)
        )
        times.append(time.perf_counter() - began)
        del session
    return min(times)


def _over_budget(job: ProbeJob, stash: Path, simulated: float, ran: int) -> bool:
    """Whether the next sample would end past the budget (at this process's pace so far),
    once ``min_samples`` are claimed by all processes together."""
    if not past_htp_budget(simulated, ran, job.budget_s):
        return False
    return len(list(stash.glob("*.claim"))) >= job.min_samples


def _claim_order(job: ProbeJob, count: int) -> list[int]:
    """The order every process claims samples in. Without ``enough_db``, the main child from
    the front and a helper from the back. With it, all of them in one order that starts with
    ``enough_samples`` spread over the list: whether those are enough, and so which samples
    the figures are on, is then the same however many processes ran and however fast."""
    if job.enough_db <= 0 or count <= job.enough_samples:
        return list(reversed(range(count))) if job.helper else list(range(count))
    return evidence_order(count, job.enough_samples)


def _enough(job: ProbeJob, stash: Path, order: list[int]) -> str:
    """Whether the first ``enough_samples`` of ``order`` ran at ``enough_db`` or more vs float
    pooled (per output: their signal powers summed over their noise powers summed; the worst
    output), each of them at ``enough_floor_db`` at least, or the first ``agree_samples`` are
    at ``enough_floor_db`` pooled and agree with the CPU QDQ model at ``agree_db`` pooled:
    "enough", "short" (they did not, or one cannot be waited for), or "pending" (the ones not
    yet done are running in live processes). Per-sample figures vary by tens of dB on a
    classifier's probabilities (a file-type model: 26 to 112 dB), so requiring the margin of
    every sample ran every one; agreeing, one of the two may be below the target itself: the
    CPU QDQ model's figure that carries the statement is over every held-out sample, that one's
    noise counted (a SqueezeNet's judge 6 -> 2 samples, 3.0 -> 1.4 s, at 58.7 dB from the CPU)."""
    if job.enough_db <= 0 or len(order) <= job.enough_samples:
        return "short"
    if job.agree_db > 0:
        verdict = _pooled_verdict(job, stash, order[: job.agree_samples], agree=True)
        if verdict != "short":  # enough, or wait for them: the figures must not depend on pace
            return verdict
    verdict = _pooled_verdict(job, stash, order[: job.enough_samples], agree=False)
    if verdict == "short" and job.losing:
        return _losing_verdict(job, stash, order[: job.enough_samples])
    return verdict


def _losing_verdict(job: ProbeJob, stash: Path, indices: list[int]) -> str:
    """ "enough" once these samples ran below ``losing_db`` vs float pooled (this candidate
    cannot be kept: the figure over them is the judge's best less a margin), "pending" while
    some of them run in live processes, else "short"."""
    noted, state = _noted_figures(stash, indices)
    if state != "done":
        return state
    return "enough" if _pooled_worst(noted, "powers") < job.losing_db else "short"


def _noted_figures(stash: Path, indices: list[int]) -> tuple[list[dict[str, Any]], str]:
    """The figures ``_note_figure`` left for these samples, and "done" when every one is
    there, "short" when one is not and nobody runs it (left out, unclaimed, its claimer
    dead), else "pending" (the rest run in live processes)."""
    noted, state = [], "done"
    for index in indices:
        try:
            figures = json.loads((stash / f"{index:04d}.db").read_text())
            float(figures["worst"])
            noted.append(figures)
        except (OSError, ValueError, KeyError, TypeError):  # not run yet, or being written
            try:
                mark = (stash / f"{index:04d}.claim").read_text()
            except OSError:
                return noted, "short"  # nobody runs it
            if mark == SKIPPED or not _claimer_alive(stash, index):
                return noted, "short"
            state = "pending"
    return noted, state


def _pooled_worst(noted: list[dict[str, Any]], kind: str) -> float:
    """The worst output's SNR over these samples' ``kind`` powers, pooled (each output's
    signal powers summed over its noise powers summed); inf with none."""
    totals: dict[str, list[float]] = {}
    for figures in noted:
        for name, (signal, noise) in figures.get(kind, {}).items():
            total = totals.setdefault(name, [0.0, 0.0])
            total[0] += signal
            total[1] += noise
    return min((power_snr_db(s, n) for s, n in totals.values()), default=math.inf)


def _unrepresented(job: ProbeJob, noted: list[dict[str, Any]]) -> bool:
    """True when an output was below its step (zero to the NPU, no SNR) on every one of these
    samples but not on every held-out sample: they say nothing of it. A wake-word classifier's
    score (1e-5 on silence) stopped a round at "inf dB" on 4 such samples while the CPU QDQ model
    read 20.8 dB over all 75, where the score reached 2.6e-4."""
    if not noted:
        return False
    below = set.intersection(*(set(figures.get("below", ())) for figures in noted))
    return bool(below) and not below <= _below_on_every_sample(job)


_BELOW_EVERYWHERE: dict[tuple[str, str], frozenset[str]] = {}


def _below_on_every_sample(job: ProbeJob) -> frozenset[str]:
    """The outputs the float model keeps below their step on every held-out sample (read once
    a probe, from the references the parent wrote)."""
    key = (job.references, job.qdq)
    if key not in _BELOW_EVERYWHERE:
        comparison = OutputComparison.for_models(job.qdq)
        for path in sorted(Path(job.references).glob("*.npz")):
            with np.load(path, allow_pickle=False) as data:
                outputs = {k: data[k] for k in data.files}
            comparison.add(outputs, outputs)
        _BELOW_EVERYWHERE[key] = frozenset(_below_step(comparison.summary()))
    return _BELOW_EVERYWHERE[key]


def _below_step(summary: dict[str, Accuracy]) -> list[str]:
    """The outputs a comparison judged below their step (metrics.BELOW_STEP), sorted."""
    return sorted(n for n, a in summary.items() if a.compared_as == BELOW_STEP)


def _cut_by(job: ProbeJob, stash: Path, order: list[int]) -> str:
    """Why samples were left out: "agreement" (two sufficed, the HTP agreeing with the CPU QDQ
    model), "evidence" (``enough_samples`` sufficed) or "budget" (the simulator's time)."""
    agreed = job.agree_db > 0 and _pooled_verdict(job, stash, order[: job.agree_samples], True)
    if agreed == "enough":
        return "agreement"
    first = order[: job.enough_samples]
    if _pooled_verdict(job, stash, first, agree=False) == "enough":
        return "evidence"
    if job.losing and _losing_verdict(job, stash, first) == "enough":
        return "losing"
    return "budget"


def _pooled_verdict(job: ProbeJob, stash: Path, indices: list[int], agree: bool) -> str:
    """``_enough`` for these samples; ``agree``: vs the CPU QDQ model at ``agree_db`` too, and
    the floor pooled only (the CPU QDQ model's figure over every held-out sample carries it)."""
    floor = job.enough_floor_db or job.enough_db
    noted, state = _noted_figures(stash, indices)
    if state == "short" or (
        not agree and any(float(figures["worst"]) < floor for figures in noted)
    ):
        return "short"
    if state == "pending":
        return "pending"
    if _unrepresented(job, noted):
        return "short"
    # Agreeing, the CPU QDQ model's figure over every held-out sample carries the statement
    # (pipeline.core.layout.AGREE_SAMPLES): these samples need only be at the target, pooled.
    if _pooled_worst(noted, "powers") < (floor if agree else job.enough_db):
        return "short"
    has_qdq = any(figures.get("qdq_powers") for figures in noted)
    if agree and (not has_qdq or _pooled_worst(noted, "qdq_powers") < job.agree_db):
        return "short"
    return "enough"


def _wait_for_evidence(job: ProbeJob, stash: Path, order: list[int]) -> bool:
    """True once the first samples are enough; while their last ones run elsewhere, wait for
    them instead of starting a sample that would then not count."""
    while True:
        verdict = _enough(job, stash, order)
        if verdict != "pending":
            return verdict == "enough"
        time.sleep(0.02)


def _note_figure(job: ProbeJob, stash: Path, index: int, names: list[str]) -> None:
    """Sample ``index``'s worst SNR vs float on the HTP (``<index>.db``), for ``_enough``."""
    reference = Path(job.references) / f"{index:04d}.npz"
    if job.enough_db <= 0 or not reference.is_file():  # not one the early stop reads
        return
    with np.load(reference, allow_pickle=False) as data:
        expected = {k: data[k] for k in data.files}
    with np.load(_stashed(stash, index)) as saved:
        got = {n: saved[f"arr_{i}"] for i, n in enumerate(names) if n in expected}
    comparison = OutputComparison.for_models(job.qdq)
    comparison.add(expected, got)
    summary = comparison.summary()
    figure = worst_snr(summary)
    noted = {
        "worst": figure if figure == figure else float("-inf"),
        "powers": comparison.powers(),
        "below": _below_step(summary),
    }
    if job.agree_db > 0:
        with np.load(Path(job.qdq_references) / f"{index:04d}.npz", allow_pickle=False) as data:
            on_cpu = {k: data[k] for k in data.files if k in got}
        versus_qdq = OutputComparison.for_models(job.qdq)
        versus_qdq.add(on_cpu, {k: got[k] for k in on_cpu})
        noted["qdq_powers"] = versus_qdq.powers()
    partial = stash / f".{index:04d}.{os.getpid()}.db"
    partial.write_text(json.dumps(noted))
    partial.replace(stash / f"{index:04d}.db")


def _claimed(stash: Path, count: int) -> list[int]:
    """The samples some process took (all of them, unless the budget left some out)."""
    taken = []
    for index in range(count):
        try:
            mark = (stash / f"{index:04d}.claim").read_text()
        except OSError:
            continue
        if mark != SKIPPED:
            taken.append(index)
    return taken


def _context_ready(job: ProbeJob, stash: Path) -> bool:
    """A helper waits until the main child has compiled its context (it is loading or running
    it), and is needed only while some sample is unclaimed."""
    main = Path(job.work) / RESULT_NAME
    while True:
        try:
            state = json.loads(main.read_text("utf-8"))
        except (OSError, ValueError):  # not written yet, or being replaced
            state = {}
        if state.get("status") in ("ok", "failed") or state.get("stage") in ("compare", "done"):
            return False
        if state.get("stage") in ("load", "run"):
            claimed = len(list(stash.glob("*.claim")))
            return claimed < len(job.samples)
        time.sleep(0.02)


def _run_sample(session: Any, sample: str, names: list[str], target: Path) -> None:
    with np.load(sample, allow_pickle=False) as data:
        feeds = {k: data[k] for k in data.files}
    partial = target.with_name(f".{target.stem}.{os.getpid()}.partial.npz")
    np.savez(partial, *(storable(value) for value in session.run(names, feeds)))
    partial.replace(target)


def _compare(
    job: ProbeJob,
    result: ProbeResult,
    model_path: Path,
    outputs: list[str],
    names: list[str],
    exposed: list[tuple[str, str, str]],
    readers: dict[str, list[str]],
    stash: Path,
) -> None:
    done = _claimed(stash, len(job.samples))
    # The parent's own outputs of the float (and, agreeing, of the CPU QDQ) model on these
    # samples, where it passed them, are not computed again: neither session is created (a
    # SqueezeNet's probe 209 -> 191 MiB at its peak, this phase's two sessions gone). A ZipMap's
    # maps come as their values (``storable``) and still compare as maps (``map_outputs``).
    float_kept = _has_references(job.references, done)
    qdq_kept = not exposed and _has_references(job.qdq_references, done)
    qdq = None if qdq_kept else cpu_session(model_path)
    flt = None if float_kept else cpu_session(job.float_model)
    # The real outputs' parts are the QDQ model's; a located run's model exposes every
    # activation as an output, and its Concats' are not parts to compare.
    parts = packed_parts(job.qdq)
    vs_float, vs_qdq, q_vs_f = (
        OutputComparison.for_models(model_path, parts=parts) for _ in range(3)
    )
    tensors = OutputComparison.for_models(model_path, parts={})
    result.requested = len(job.samples)
    result.sample_sha256 = [sha256_file(Path(job.samples[i])) for i in done]
    for index in done:
        # The heavier QDQ run first with nothing else alive, the float run beside its outputs,
        # and the HTP's outputs read from disk only then: at 1x3x1024x2048 a 19-class map is
        # 152 MiB a set, and two sets under the QDQ run took this process to 1.7 GiB.
        feeds = {}
        if qdq is not None or flt is not None:
            with np.load(job.samples[index], allow_pickle=False) as data:
                feeds = {k: data[k] for k in data.files}
        if qdq is None:
            ref_q = _references(job.qdq_references, index)
        else:
            ref_q = dict(zip(names, qdq.run(names, feeds), strict=True))
        if flt is None:
            ref_f = _references(job.references, index)
        else:
            ref_f = dict(zip(outputs, flt.run(outputs, feeds), strict=True))
        del feeds
        q_vs_f.add(ref_f, {n: ref_q[n] for n in outputs})
        with np.load(_stashed(stash, index)) as saved:
            got = dict(zip(names, (saved[f"arr_{i}"] for i in range(len(names))), strict=True))
        _stashed(stash, index).unlink()
        vs_float.add(ref_f, {n: got[n] for n in outputs})
        del ref_f
        vs_qdq.add({n: ref_q[n] for n in outputs}, {n: got[n] for n in outputs})
        if exposed:
            tensors.add({t: ref_q[t] for t, _, _ in exposed}, {t: got[t] for t, _, _ in exposed})
        del got, ref_q
    result.samples = vs_float.samples
    result.ctx_vs_float = vs_float.summary()
    result.ctx_vs_qdq = vs_qdq.summary()
    result.qdq_vs_float = q_vs_f.summary()
    per_tensor = tensors.summary()
    result.tensors = [
        TensorAgreement(t, op, node, per_tensor[t].snr_db, readers.get(t, []))
        for t, op, node in exposed
    ]


def _has_references(folder: str, indices: list[int]) -> bool:
    """Whether ``folder`` (``_write_outputs``'s) holds a model's outputs on every one of these."""
    return bool(folder) and all((Path(folder) / f"{i:04d}.npz").is_file() for i in indices)


def _references(folder: str, index: int) -> dict[str, np.ndarray]:
    with np.load(Path(folder) / f"{index:04d}.npz", allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def _warm_up() -> None:
    """What every probe does first, done while it waits for its job: the imports, and the
    QNN EP's registration (kept per process). A failure here is the run's to report."""
    try:
        import onnxruntime  # noqa: F401

        from qnn_ctx_runtime import qnn

        from ..compile import coverage  # noqa: F401
        from ..core import cpu  # noqa: F401

        qnn.find_qnn_ep()
    except Exception:
        return


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    waiting = args[:1] == [AWAIT]
    args = args[1:] if waiting else args
    if len(args) != 1:
        print(f"usage: python -m {MODULE} [{AWAIT}] JOB.json", file=sys.stderr)
        return 2
    die_with_parent()
    if waiting:
        _warm_up()
        await_job(Path(args[0]))
    job: ProbeJob = _load(ProbeJob, Path(args[0]))
    if job.core >= 0 and hasattr(os, "sched_setaffinity"):
        # Before QNN starts its threads, which inherit the mask: the simulator's spinning
        # thread then shares this core instead of taking another probe's. (A warmed child
        # pins whatever threads it has, the same way.)
        _pin_threads(job.core)
    path = Path(job.result)
    result = ProbeResult()
    started = time.perf_counter()
    try:
        _run(job, result, path)
    except Exception as exc:  # reported with its step; the parent decides what it means
        result.status = "failed"
        result.error = f"{type(exc).__name__}: {exc}"[:1500]
    result.seconds = time.perf_counter() - started
    _save(path, result)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
