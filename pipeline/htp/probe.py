"""What the NPU computes for a QDQ model, measured on the HTP, in a child process.

``probe(...)`` compiles the QDQ model for one chip (QNN EP, in memory of a temp folder), runs it
on the HTP (the x86_64 simulator here) over held-out samples, and compares its outputs with the
prepared float model and with the same QDQ model on the CPU EP. With ``locate = True`` every
activation of the QDQ model is also made a graph output, so the comparison is tensor by tensor:
the first tensor (in graph order) where the HTP and the CPU QDQ model part ways names the op that
the HTP computes differently (e.g. 16-bit weights in a dilated convolution).

``python -m pipeline.htp.probe JOB.json`` is the child; the parent never loads QNN itself.

The x86_64 simulator runs a graph on one thread and spins a second one (measured: 8.9 s for 6
samples on two cores, 9.1 s pinned to one; two unpinned probes side by side were slower than one).
So on Linux with several cores the samples are split: the first child compiles the context and
runs its share, one helper per further core loads that very context and runs its own, each
pinned to its core, and a last child (unpinned, CPU only unless a helper died and left samples
to run) compares everything: the HTP's part takes about 1/cores of the time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from qnn_ctx_runtime.typed import parse, to_json_value

from ..core.cpu import cpu_session
from ..core.fileio import sha256_file
from ..core.metrics import Accuracy, OutputComparison, worst_snr
from .isolation import Finished, Started, die_with_parent, run_module, start_module

MODULE = "pipeline.htp.probe"
DIVERGENCE_DB = 30.0  # HTP vs CPU QDQ below this at one tensor: they compute it differently
CTX_NAME = "probe_ctx.onnx"


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
    ctx: str = ""  # a context compiled by another child: load it instead of compiling
    run: list[int] | None = None  # the samples (indices) to run on the HTP; None: all not run yet
    compare: bool = True  # compare every sample's stashed HTP outputs with the CPU models
    core: int = -1  # pin this process (and the threads QNN starts) to this CPU


@dataclass(frozen=True)
class TensorAgreement:
    """One activation: how closely the HTP reproduces the CPU QDQ model there."""

    name: str
    op_type: str  # the op that produced it
    node: str
    snr_db: float


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
    samples: int = 0
    ctx_vs_float: dict[str, Accuracy] = field(default_factory=dict)
    ctx_vs_qdq: dict[str, Accuracy] = field(default_factory=dict)
    qdq_vs_float: dict[str, Accuracy] = field(default_factory=dict)
    tensors: list[TensorAgreement] = field(default_factory=list)
    seconds: float = 0.0

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
        """The first tensor, in graph order, where the HTP and the CPU QDQ model part ways."""
        return next((t for t in self.tensors if t.snr_db < threshold), None)


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


def _ways(samples: int, locate: bool) -> list[int]:
    """The CPUs to split a probe over: one per core (Linux, where a process can be pinned), no
    more than there are samples, and each extra simulator process only with 4 GiB available."""
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
) -> ProbeResult:
    """Compile ``qdq`` for the HTP, run it there and compare; a dead child is a failed result."""
    work.mkdir(parents=True, exist_ok=True)
    job = ProbeJob(
        qdq=str(qdq.resolve()),
        float_model=str(float_model.resolve()),
        samples=[str(p.resolve()) for p in samples],
        work=str(work.resolve()),
        result=str((work / "probe_result.json").resolve()),
        soc_model=soc_model,
        htp_arch=htp_arch,
        qnn_options=dict(qnn_options or {}),
        locate=locate,
    )
    shutil.rmtree(work / "htp_outputs", ignore_errors=True)  # outputs stashed by an earlier probe
    cores = _ways(len(samples), locate)
    if not cores:
        return _run_child(job, work / "probe_job.json", work / "probe.log", timeout_s)
    return _probe_split(job, work, cores, timeout_s)


def _run_child(
    job: ProbeJob,
    job_path: Path,
    log: Path,
    timeout_s: float,
    on_tick: Callable[[float], None] | None = None,
) -> ProbeResult:
    job_path.write_text(json.dumps(to_json_value(job)), encoding="utf-8")
    return _outcome(job, run_module(MODULE, job_path, log, timeout_s, on_tick), timeout_s)


def _outcome(job: ProbeJob, done: Finished, timeout_s: float) -> ProbeResult:
    """The child's result file, or a failed result saying how it died."""
    try:
        result: ProbeResult = _load(ProbeResult, Path(job.result))
    except (OSError, ValueError):
        result = ProbeResult()
    if done.timed_out:
        result.status, result.error = "failed", f"timed out after {timeout_s:g} s in {result.stage}"
    elif result.status != "ok" and not result.error:
        tail = [line for line in done.log.splitlines() if line.strip()][-2:]
        result.status = "failed"
        result.error = (
            f"the HTP child died in {result.stage} ({done.signal_name()}): " + " / ".join(tail)
        )
    result.seconds = done.seconds
    return result


def _probe_split(job: ProbeJob, work: Path, cores: list[int], timeout_s: float) -> ProbeResult:
    """The samples split over ``cores``: compile and run share 0, helpers run the others on the
    same context bytes (started as soon as it exists, or when the first child ends), then one
    child compares (and runs what a dead helper left). A helper's failure only costs time; the
    first child's is the probe's."""
    started = time.monotonic()
    count = len(job.samples)
    shares = [list(range(k, count, len(cores))) for k in range(len(cores))]
    ctx_path = work / CTX_NAME
    ctx_path.unlink(missing_ok=True)
    helpers: list[tuple[ProbeJob, Started]] = []

    def start_helpers(_elapsed: float) -> None:
        if helpers or not ctx_path.is_file():
            return
        for k in range(1, len(cores)):
            helper = replace(
                job,
                result=str((work / f"probe_result_{k}.json").resolve()),
                ctx=str(ctx_path.resolve()),
                run=shares[k],
                compare=False,
                core=cores[k],
            )
            path = work / f"probe_job_{k}.json"
            path.write_text(json.dumps(to_json_value(helper)), encoding="utf-8")
            helpers.append((helper, start_module(MODULE, path, work / f"probe_{k}.log")))

    first_job = replace(job, result=str((work / "probe_result_0.json").resolve()), run=shares[0])
    first_job = replace(first_job, compare=False, core=cores[0])
    try:
        first = _run_child(
            first_job, work / "probe_job_0.json", work / "probe_0.log", timeout_s, start_helpers
        )
        if first.ok:
            start_helpers(0.0)  # the first child was too quick for a tick: they run now
        for _, helper in helpers:  # they run shares of the same size: not long after the first
            left = timeout_s - (time.monotonic() - started)
            try:
                helper.proc.wait(timeout=max(left, 0.0))
            except subprocess.TimeoutExpired:
                helper.kill()
    finally:
        for _, helper in helpers:
            if helper.proc.poll() is None:
                helper.kill()
            helper.finish()
    if not first.ok:
        return first
    final = replace(job, ctx=str(ctx_path.resolve()))
    left = max(timeout_s - (time.monotonic() - started), 1.0)
    result = _run_child(final, work / "probe_job.json", work / "probe.log", left)
    if result.ok:  # the first child loaded the context; the last one may not have needed to
        result.partitions, result.cpu_nodes = first.partitions, first.cpu_nodes
        result.qnn_sdk, result.onnxruntime_qnn = first.qnn_sdk, first.onnxruntime_qnn
    result.seconds = time.monotonic() - started
    return result


# -- the child ------------------------------------------------------------------------------------


def _exposed(qdq_path: str, out: Path) -> tuple[Path, list[tuple[str, str, str]]]:
    """The QDQ model with every dequantized activation as a graph output, and their producers."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(qdq_path)
    inits = {i.name for i in model.graph.initializer}
    outputs = {o.name for o in model.graph.output}
    producer = {o: n for n in model.graph.node for o in n.output}
    exposed = []
    for node in model.graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] in inits:
            continue
        tensor = node.output[0]
        quantize = producer.get(node.input[0])
        source = producer.get(quantize.input[0]) if quantize is not None else None
        op, name = (source.op_type, source.name) if source is not None else ("input", "")
        if tensor not in outputs:  # graph outputs are compared already, in their place
            model.graph.output.append(
                helper.make_tensor_value_info(tensor, TensorProto.FLOAT, None)
            )
        exposed.append((tensor, op, name))
    path = out / "probe_qdq.onnx"
    onnx.save(model, str(path))
    return path, exposed


def _run(job: ProbeJob, result: ProbeResult, path: Path) -> None:
    def stage(name: str) -> None:
        result.stage = name
        _save(path, result)

    work = Path(job.work)
    stash = work / "htp_outputs"
    stash.mkdir(exist_ok=True)
    model_path, exposed = _exposed(job.qdq, work) if job.locate else (Path(job.qdq), [])
    outputs = _output_names(job.float_model)
    names = outputs + [t for t, _, _ in exposed if t not in outputs]
    wanted = range(len(job.samples)) if job.run is None else job.run
    to_run = [i for i in wanted if not _stashed(stash, i).is_file()]
    if not job.ctx or to_run:
        _run_on_htp(job, result, stage, model_path, names, to_run, stash)
    else:
        result.ctx_sha256 = sha256_file(Path(job.ctx))
        result.sample_sha256 = [sha256_file(Path(sample)) for sample in job.samples]
    if job.compare:
        stage("compare")
        _compare(job, result, model_path, outputs, names, exposed, stash)
    result.status = "ok"
    stage("done")


def _output_names(float_model: str) -> list[str]:
    import onnx

    return [o.name for o in onnx.load(float_model, load_external_data=False).graph.output]


def _stashed(stash: Path, index: int) -> Path:
    return stash / f"{index:04d}.npz"


def _run_on_htp(
    job: ProbeJob,
    result: ProbeResult,
    stage: Callable[[str], None],
    model_path: Path,
    names: list[str],
    indices: list[int],
    stash: Path,
) -> None:
    """Compile (or load ``job.ctx``), measure the partitioning, run ``indices`` and stash each
    sample's outputs (written whole, then renamed: another child only sees complete files)."""
    import onnxruntime as ort

    from qnn_ctx_runtime import qnn

    stage("register")
    ep = qnn.find_qnn_ep()
    result.qnn_sdk = ep.installed.qnn_sdk
    result.onnxruntime_qnn = ep.installed.package_version
    work = Path(job.work)
    if job.ctx:
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
        ort.ModelCompiler(
            options, str(model_path), embed_compiled_data_into_model=True
        ).compile_to_file(str(partial))
        partial.replace(ctx_path)  # helpers start when it appears: whole or not at all
    result.ctx_sha256 = sha256_file(ctx_path)
    result.sample_sha256 = [sha256_file(Path(sample)) for sample in job.samples]
    stage("load")
    record = {"session.record_ep_graph_assignment_info": "1"}
    ctx = ort.InferenceSession(str(ctx_path), ep.session_options(qnn.QnnOptions("htp"), record, 3))
    assignment = ctx.get_provider_graph_assignment_info()
    result.partitions = sum(
        1 for s in assignment for n in s.get_nodes() if s.ep_name == qnn.EP_NAME
    )
    io_qdq = {"QuantizeLinear", "DequantizeLinear"}
    result.cpu_nodes = sum(
        1
        for s in assignment
        if s.ep_name != qnn.EP_NAME
        for n in s.get_nodes()
        if n.op_type not in io_qdq
    )
    # The HTP's outputs go to disk first and its session is closed before the CPU models run:
    # the simulator and two CPU sessions of a 1024x2048 model side by side took 1.7 GiB.
    stage("run")
    for index in indices:
        with np.load(job.samples[index], allow_pickle=False) as data:
            feeds = {k: data[k] for k in data.files}
        target = _stashed(stash, index)
        partial = target.with_name(f".{target.stem}.{os.getpid()}.partial.npz")
        np.savez(partial, *ctx.run(names, feeds))
        partial.replace(target)
    del ctx, assignment  # the assignment info holds the session (and the simulator) alive


def _compare(
    job: ProbeJob,
    result: ProbeResult,
    model_path: Path,
    outputs: list[str],
    names: list[str],
    exposed: list[tuple[str, str, str]],
    stash: Path,
) -> None:
    qdq = cpu_session(model_path)
    flt = cpu_session(job.float_model)
    vs_float, vs_qdq, q_vs_f, tensors = (OutputComparison() for _ in range(4))
    for index, sample in enumerate(job.samples):
        with np.load(sample, allow_pickle=False) as data:
            feeds = {k: data[k] for k in data.files}
        with np.load(_stashed(stash, index)) as saved:
            got = dict(zip(names, (saved[f"arr_{i}"] for i in range(len(names))), strict=True))
        _stashed(stash, index).unlink()
        ref_f = dict(zip(outputs, flt.run(outputs, feeds), strict=True))
        vs_float.add(ref_f, {n: got[n] for n in outputs})
        ref_q = dict(zip(names, qdq.run(names, feeds), strict=True))
        vs_qdq.add({n: ref_q[n] for n in outputs}, {n: got[n] for n in outputs})
        q_vs_f.add(ref_f, {n: ref_q[n] for n in outputs})
        del ref_f
        if exposed:
            tensors.add({t: ref_q[t] for t, _, _ in exposed}, {t: got[t] for t, _, _ in exposed})
        del got, ref_q
    result.samples = vs_float.samples
    result.ctx_vs_float = vs_float.summary()
    result.ctx_vs_qdq = vs_qdq.summary()
    result.qdq_vs_float = q_vs_f.summary()
    per_tensor = tensors.summary()
    result.tensors = [TensorAgreement(t, op, node, per_tensor[t].snr_db) for t, op, node in exposed]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(f"usage: python -m {MODULE} JOB.json", file=sys.stderr)
        return 2
    die_with_parent()
    job: ProbeJob = _load(ProbeJob, Path(args[0]))
    if job.core >= 0 and hasattr(os, "sched_setaffinity"):
        # Before QNN starts its threads, which inherit the mask: the simulator's spinning
        # thread then shares this core instead of taking another probe's.
        os.sched_setaffinity(0, {job.core})
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
