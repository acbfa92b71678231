"""The child side of ``compile``: build, check, load, validate and time ONE variant.

``python -m pipeline.compile.worker JOB.json``. The parent runs this in a separate process
because the QNN EP can abort the whole process from native code (``terminate called ...``,
FACTS §4) or hang; here such a failure costs one variant, not the build. After every step the
worker rewrites its result file, so when it dies the parent still knows the last step reached.

A variant is every bucket (static shape) of a model. One bucket is compiled into one ctx
(embedded or with a ``.bin``, as configured). Several buckets are compiled in one process with
``ep.share_ep_contexts=1`` (the last with ``ep.stop_share_ep_contexts=1``) and embed mode 0: the
QNN EP then keeps one context, adds every bucket's graph to it with HTP weight sharing, and writes
one ``_qnn.bin`` that every bucket's ``_ctx.onnx`` references (FACTS §7). The x86_64 HTP simulator
cannot load such a shared context with several graphs (QNN 2.49 NOT_SUPPORTED, 2.51 SIGSEGV), so
a probe in a separate process tries; where it fails (or ``packaging`` asks for it) each bucket is
also compiled on its own (``standalone/``) from the same QDQ model with the same options, and
coverage and validation run on that set. The record says which set was validated.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from qnn_ctx_runtime import qnn

from ..core.accuracy import LABELS, Accuracy, worst_snr
from ..core.cpu import cpu_session
from ..core.dtypes import np_dtype
from ..core.fileio import sha256_file
from ..core.layout import (
    AGREE_SAMPLES,
    ENOUGH_MARGIN_DB,
    ENOUGH_SAMPLES,
    HTP_MIN_SAMPLES,
    HTP_PROBE_CTX,
    STANDALONE_DIR,
    evidence_order,
    past_htp_budget,
    simulator_seconds,
)
from ..core.memory import release_freed_memory, rss_bytes
from ..core.metrics import (
    OutputComparison,
    Parts,
    angle_outputs,
    label_outputs,
    packed_parts,
    picked_outputs,
)
from ..core.records import (
    BucketOutcome,
    Coverage,
    CtxFacts,
    CtxSet,
    Failure,
    HtpLoad,
    HtpProbeRecord,
    LoadTimes,
    Memory,
    TensorSpec,
    Validation,
    read_record,
)
from ..core.stream import run_closed_loop
from ..graph.tails import judged_outputs
from ..htp.isolation import await_job, die_with_parent
from . import coverage as coverage_mod
from .job import (
    LOWERED_GATE,
    BucketJob,
    CompileJob,
    WorkerResult,
    read_message,
    stage_line,
    write_message,
)

# ORT's own record of which EP runs which node: the coverage report is built from it.
RECORD_ASSIGNMENT = {"session.record_ep_graph_assignment_info": "1"}
SHARE = {"ep.share_ep_contexts": "1"}
PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import onnxruntime as ort
from qnn_ctx_runtime import qnn
spec = json.loads(sys.argv[2])
ep = qnn.find_qnn_ep()
sessions = []
for i, path in enumerate(spec["models"]):
    config = {"ep.share_ep_contexts": "1", "session.disable_model_compile": "1"}
    if i == len(spec["models"]) - 1:
        config["ep.stop_share_ep_contexts"] = "1"
    options = ep.session_options(qnn.QnnOptions(spec["backend"]), config, log_severity=3)
    sessions.append(ort.InferenceSession(path, options))
    if qnn.EP_NAME not in sessions[-1].get_providers():
        raise SystemExit("the QNN EP did not attach")
print("PROBE_OK", flush=True)
"""


class StepFailed(Exception):
    """A step could not produce what the next one needs; ``kind`` classifies it."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class Progress:
    """The result file and the log's step markers."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.result = WorkerResult()
        self.save()

    def stage(self, name: str) -> None:
        self.result.stage = name
        self.save()
        print(stage_line(name), flush=True)

    def save(self) -> None:
        write_message(self.path, self.result)


def ort_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


def classify(message: str, installed: qnn.InstalledQnn) -> tuple[str, str]:
    """(kind, message) for an onnxruntime exception text."""
    if qnn.looks_like_wrong_pair(message):
        return "toolchain", (
            f"the QNN EP could not be created: {installed.describe()} is not a working pair "
            f"(onnxruntime would otherwise fall back to CPU). {message}"
        )
    if "Failed to compose Qnn graph" in message:
        return "compose", message
    return "error", message


def _options(job: CompileJob) -> qnn.QnnOptions:
    extra = tuple(sorted(job.qnn_options.items()))
    return qnn.QnnOptions(job.backend_type, job.soc_model, job.htp_arch, extra)


# -- compiling and checking -------------------------------------------------------------------------


def compile_set(
    job: CompileJob,
    ep: qnn.QnnEp,
    out_dir: Path,
    share: bool,
    seconds: dict[str, float] | None = None,
) -> dict[str, Path]:
    """Compile every bucket in this process; with ``share`` into one weight-shared context.
    ``seconds`` gets each bucket's own compile time (not a shared or adopted one's)."""
    import onnxruntime as ort

    out_dir.mkdir(parents=True, exist_ok=True)
    # Stale outputs must not pass for new ones: the EP names its .bin after the ctx file.
    for stale in [*out_dir.glob("*_ctx.onnx"), *out_dir.glob("*.bin")]:
        stale.unlink()
    ctxs = {}
    for index, bucket in enumerate(job.buckets):
        adopted = None if share else adoptable_probe_ctx(job, ep.installed, bucket)
        if adopted is not None:
            ctx = out_dir / bucket.ctx_name
            shutil.copyfile(adopted, ctx)
            print(
                f"[compile_worker] {ctx.name}: the HTP judge's context, adopted (compiled by "
                f"onnxruntime-qnn {ep.installed.package_version} from this QDQ for this chip with "
                "these options, every digest checked)",
                flush=True,
            )
            ctxs[bucket.name] = ctx
            continue
        config: dict[str, str] = {}
        if share:
            config = {**SHARE, "ep.context_node_name_prefix": f"{bucket.name}_"}
            if index == len(job.buckets) - 1:
                config["ep.stop_share_ep_contexts"] = "1"
        options = ep.session_options(_options(job), config, job.log_severity)
        ctx = out_dir / bucket.ctx_name
        what = f"bucket {bucket.name}: " if job.multi else ""
        started = time.perf_counter()
        try:
            ort.ModelCompiler(
                options,
                bucket.qdq,
                embed_compiled_data_into_model=not share and job.embed,
                flags=ort.OrtCompileApiFlags.ERROR_IF_NO_NODES_COMPILED,
            ).compile_to_file(str(ctx))
        except Exception as exc:  # onnxruntime's error types are not importable by name
            kind, message = classify(ort_error(exc), ep.installed)
            raise StepFailed(kind, what + message) from exc
        if seconds is not None and not share:
            seconds[bucket.name] = time.perf_counter() - started
        if not ctx.is_file():
            raise StepFailed("error", f"{what}ModelCompiler returned but wrote no {ctx.name}")
        ctxs[bucket.name] = ctx
    # QNN's compile leaves its freed working memory in the heap: 100 MiB of 250 on a small
    # recognizer, carried through every load and run after it unless given back now.
    release_freed_memory()
    return ctxs


def verify_ctx(job: CompileJob, ctx: Path, embed: bool) -> CtxFacts:
    """Prove the QNN toolchain compiled it, for the requested chip (each check explains itself)."""
    summary = qnn.read_model_summary(ctx)
    nodes = summary.nodes_of(coverage_mod.EP_CONTEXT)
    if not nodes:
        raise StepFailed(
            "verify", f"{ctx.name} holds no EPContext node: QNN compiled nothing (CPU fallback)."
        )
    problems = []
    raw_sdks = sorted({str(n.attributes.get("ep_sdk_version", "")) for n in nodes})
    sdks = sorted({qnn.sdk_version(s) for s in raw_sdks})
    if sdks != [job.qnn_sdk]:
        problems.append(
            f"EPContext ep_sdk_version {raw_sdks} is not the pinned QNN SDK {job.qnn_sdk}"
        )
    sources = sorted({str(n.attributes.get("source", "")) for n in nodes})
    if sources != [qnn.EP_NAME]:
        problems.append(f"EPContext source is {sources}, not {qnn.EP_NAME}")
    raw_compat = summary.metadata.get(qnn.COMPATIBILITY_KEY, "")
    archs: list[int] = []
    socs: list[int] = []
    if not raw_compat:
        problems.append(f"model metadata has no {qnn.COMPATIBILITY_KEY}")
    else:
        try:
            info = qnn.parse_compatibility_info(raw_compat)
        except ValueError as exc:
            problems.append(str(exc))
        else:
            archs, socs = list(info.htp_archs), list(info.soc_models)
            problems += qnn.compatibility_problems(info, job.soc_model, job.htp_arch)
            if info.sdk and qnn.sdk_version(info.sdk) != job.qnn_sdk:
                problems.append(f"{qnn.COMPATIBILITY_KEY} names SDK {info.sdk}, not {job.qnn_sdk}")
    modes = sorted({int(n.attributes.get("embed_mode", 1)) for n in nodes})
    if modes != [1 if embed else 0]:
        problems.append(f"embed_mode {modes} but {'1' if embed else '0'} was asked for")
    files = [ctx.name]
    for node in nodes:
        if int(node.attributes.get("embed_mode", 1)) == 0:
            name = str(node.attributes.get("ep_cache_context", ""))
            if not (ctx.parent / name).is_file():
                problems.append(f"EPContext {node.name} points at {name!r}, which was not written")
            elif name not in files:
                files.append(name)
    if problems:
        raise StepFailed("verify", f"{ctx.name}: " + "; ".join(problems) + ".")
    return CtxFacts(
        ep_context_nodes=len(nodes),
        ep_sdk_version=raw_sdks[0],
        qnn_sdk_version=sdks[0],
        ep_compatibility_info=raw_compat,
        htp_archs=archs,
        soc_models=socs,
        embed_mode=modes[0],
        files=files,
        sizes={f: (ctx.parent / f).stat().st_size for f in files},
    )


def verify_set(job: CompileJob, ctxs: dict[str, Path], kind: str, out: Path) -> CtxSet:
    """Per-bucket checks; a shared set must also have one binary every bucket references, and
    EPContext node and partition names must be unique across the buckets."""
    embed = job.embed if kind != "shared" else False
    facts = {}
    for name, ctx in ctxs.items():
        try:
            facts[name] = verify_ctx(job, ctx, embed)
        except StepFailed as exc:
            where = f"bucket {name}: " if job.multi else ""
            raise StepFailed(exc.kind, where + exc.message) from exc
    folder = next(iter(ctxs.values())).parent
    problems = []
    seen: dict[str, str] = {}
    referenced: dict[str, set[str]] = {}
    for name, ctx in ctxs.items():
        for node in qnn.read_model_summary(ctx).nodes_of("EPContext"):
            for key in (node.name, str(node.attributes.get("partition_name", ""))):
                if key and key in seen and seen[key] != name:
                    problems.append(f"EPContext name {key!r} is in buckets {seen[key]} and {name}")
                seen.setdefault(key, name)
            if int(node.attributes.get("embed_mode", 1)) == 0:
                referenced.setdefault(name, set()).add(str(node.attributes["ep_cache_context"]))
    bins = sorted(set().union(*referenced.values())) if referenced else []
    on_disk = sorted(p.name for p in folder.glob("*.bin"))
    if kind == "shared":
        if len(bins) != 1:
            problems.append(
                f"the buckets reference {len(bins)} context binaries ({bins}); weight sharing "
                "writes exactly one that every bucket's EPContext node points at"
            )
        missing = [n for n in ctxs if n not in referenced]
        if missing:
            problems.append(f"bucket(s) {missing} reference no external context binary")
    if on_disk != bins:
        problems.append(f"binaries on disk {on_disk} are not the referenced ones {bins}")
    if problems:
        raise StepFailed("verify", f"{kind} context set: " + "; ".join(problems) + ".")
    prefix = "" if folder == out else f"{folder.relative_to(out).as_posix()}/"
    ctx_bytes = sum(p.stat().st_size for p in ctxs.values())
    return CtxSet(
        kind=kind,
        ctx_files={n: prefix + p.name for n, p in ctxs.items()},
        bins=[prefix + b for b in bins],
        facts=facts,
        total_bytes=ctx_bytes + sum((folder / b).stat().st_size for b in bins),
        bucket_bytes={n: sum(f.sizes.values()) for n, f in facts.items()},
    )


def probe_shared(job: CompileJob, ctxs: dict[str, Path]) -> tuple[bool, str]:
    """Can this machine load the weight-shared set? Tried in a separate process: it may crash."""
    spec = {"models": [str(ctxs[b.name]) for b in job.buckets], "backend": job.backend_type}
    root = str(Path(qnn.__file__).resolve().parent.parent)
    try:
        done = subprocess.run(
            [sys.executable, "-c", PROBE, root, json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=job.probe_timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return False, f"loading the shared contexts did not finish in {job.probe_timeout_s:g} s"
    if done.returncode == 0 and "PROBE_OK" in done.stdout:
        return True, "the weight-shared contexts load here"
    if done.returncode < 0:
        try:
            how = f"the loading process died with {signal.Signals(-done.returncode).name}"
        except ValueError:
            how = f"the loading process died with signal {-done.returncode}"
    else:
        errors = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        how = errors[-1][-400:] if errors else f"exit code {done.returncode}"
    return False, f"the weight-shared contexts do not load on this machine: {how}"


# -- loading, validating, timing ------------------------------------------------------------------


def merge_specs(per_bucket: list[list[TensorSpec]]) -> list[TensorSpec]:
    """One spec list for the variant: the largest bucket's, with -1 where the buckets differ."""
    merged = []
    for spec in per_bucket[-1]:
        shape = list(spec.shape)
        for other in per_bucket[:-1]:
            match = next((o for o in other if o.name == spec.name), None)
            if match is None:
                continue
            for axis, size in enumerate(match.shape):
                if axis < len(shape) and size != shape[axis]:
                    shape[axis] = -1
        merged.append(TensorSpec(spec.name, shape, spec.dtype))
    return merged


def _session_config(job: CompileJob, index: int, shared: bool) -> dict[str, str]:
    config: dict[str, str] = dict(SHARE) if shared else {}
    if shared and index == len(job.buckets) - 1:
        config["ep.stop_share_ep_contexts"] = "1"
    return config


def load_bucket(
    job: CompileJob, ep: qnn.QnnEp, bucket: BucketJob, index: int, ctx: Path, shared: bool
) -> tuple[Any, Coverage]:
    """A session on one bucket's ctx (over the shared context when ``shared``) and its coverage."""
    import onnxruntime as ort

    config = {**RECORD_ASSIGNMENT, **_session_config(job, index, shared)}
    options = ep.session_options(qnn.QnnOptions(job.backend_type), config, job.log_severity)
    what = f"bucket {bucket.name}: " if job.multi else ""
    try:
        session = ort.InferenceSession(str(ctx), options)
    except Exception as exc:  # onnxruntime's error types are not importable by name
        kind, message = classify(ort_error(exc), ep.installed)
        raise StepFailed(kind, what + message) from exc
    # A failed run would be retried on the CPU alone, which refuses the EPContext node: its
    # error hid the QNN EP's own ("ORT Tensor data size does not match QNN tensor data size").
    session.disable_fallback()
    if qnn.EP_NAME not in session.get_providers():
        raise StepFailed(
            "toolchain",
            f"{what}the ctx session runs on {session.get_providers()} only: the QNN EP did not "
            f"start ({ep.installed.describe()}).",
        )
    coverage = coverage_mod.summarize(
        coverage_mod.assignment_from_session(session),
        qnn.read_model_summary(ctx),
        job.max_partitions,
        job.allowed_cpu_ops,
    )
    return session, coverage


def _feed_count(job: CompileJob, bucket: BucketJob) -> int:
    """How many feeds ``_feeds`` gives: held-out samples, else up to 4 random ones."""
    held = len(bucket.heldout[: job.validate_samples or None])
    return held or max(1, min(job.validate_samples or 4, 4))


def _feeds(
    job: CompileJob, bucket: BucketJob, session: Any, order: list[int] | None = None
) -> Iterator[dict[str, np.ndarray]]:
    """Held-out samples from quantize (in ``order``, else as listed), else seeded random feeds
    shaped like the inputs."""
    held = bucket.heldout[: job.validate_samples or None]
    for index in order if order is not None else range(len(held)):
        with np.load(held[index], allow_pickle=False) as data:
            yield {k: data[k] for k in data.files}
    if bucket.heldout:
        return
    rng = np.random.default_rng(job.seed)
    for _ in range(_feed_count(job, bucket)):
        feeds = {}
        for spec in session.get_inputs():
            shape = [d if isinstance(d, int) and d > 0 else 1 for d in spec.shape]
            dtype = np_dtype(spec.type)
            if np.issubdtype(dtype, np.floating):
                feeds[spec.name] = rng.standard_normal(shape).astype(dtype)
            else:
                feeds[spec.name] = np.zeros(shape, dtype)
        yield feeds


def output_comparison(
    job: CompileJob, bucket: BucketJob, parts: Parts | None = None
) -> OutputComparison:
    """A comparison of this bucket's outputs as the quantize stage compared them: integer
    outputs on their grids, labels, steps, outputs picked by rank, angles (and ``parts``)."""
    grids = {n: (scale, int(zero_point)) for n, (scale, zero_point) in job.output_grids.items()}
    return OutputComparison(
        grids,
        label_outputs(bucket.qdq),
        dict(job.output_steps),
        picked_outputs(bucket.qdq),
        angles=angle_outputs(bucket.qdq),
        parts=parts,
    )


def validate(job: CompileJob, bucket: BucketJob, ctx_session: Any) -> Validation:
    """ctx on QNN (the HTP simulator on x86_64) vs QDQ and float on the CPU EP."""
    qdq = cpu_session(bucket.qdq)
    flt = (
        cpu_session(bucket.float_model)
        if bucket.float_model and Path(bucket.float_model).is_file()
        else None
    )
    names = [o.name for o in ctx_session.get_outputs()]
    float_names = [o.name for o in flt.get_outputs()] if flt else []
    # The quantizer keeps output names; if a float model names them otherwise, pair by position.
    float_map = dict(
        zip(names, float_names if set(names) - set(float_names) else names, strict=False)
    )
    parts = packed_parts(bucket.float_model or None, bucket.qdq)
    vs_qdq, vs_float, qdq_vs_float = (output_comparison(job, bucket, parts) for _ in range(3))
    scored = (  # its labels' scores were judged on the HTP (graph.tails.expose_label_scores)
        flt is not None
        and bool(bucket.htp_probe)
        and bool(judged_outputs(qnn.read_model_summary(bucket.float_model).metadata))
    )
    # The simulator's CPU seconds (simulator_seconds): past the budget, no new sample (once
    # HTP_MIN_SAMPLES ran). Its CPU time, not the wall clock's, which the machine's load stretches.
    on_htp = 0.0
    cut_by = ""
    count = _feed_count(job, bucket)
    # As the judge: once ENOUGH_SAMPLES spread over the held-out ones have run at enough_db vs
    # float pooled, each within ENOUGH_MARGIN_DB of it, the figure over them carries the
    # statement (a target or toolchain the judge did not run: its every sample ran before).
    evidence = (
        job.enough_db > 0 and flt is not None and bool(bucket.heldout) and count > ENOUGH_SAMPLES
    )
    each: list[float] = []  # each sample's worst SNR vs float, while the first ones run
    for feeds in _feeds(job, bucket, ctx_session, evidence_order(count) if evidence else None):
        ran = vs_qdq.samples
        if ran >= HTP_MIN_SAMPLES and past_htp_budget(on_htp, ran, job.validate_budget_s):
            cut_by = "budget"
            break
        if scored and ran >= AGREE_SAMPLES and labels_all_agree(vs_qdq.summary()):
            cut_by = "labels"
            break
        if evidence and ran == ENOUGH_SAMPLES and _enough(each, vs_float, job.enough_db):
            cut_by = "evidence"
            break
        started = simulator_seconds()
        got = dict(zip(names, ctx_session.run(names, feeds), strict=True))
        on_htp += simulator_seconds() - started
        ref_qdq = dict(zip(names, qdq.run(names, feeds), strict=True))
        vs_qdq.add(ref_qdq, got)
        if flt is not None:
            ref_flt = dict(zip(names, flt.run([float_map[n] for n in names], feeds), strict=True))
            vs_float.add(ref_flt, got)
            qdq_vs_float.add(ref_flt, ref_qdq)
            if evidence and ran < ENOUGH_SAMPLES:
                alone = output_comparison(job, bucket, parts)
                alone.add(ref_flt, got)
                each.append(worst_snr(alone.summary()))
    summary = vs_qdq.summary()
    worst = worst_snr(summary)
    passed, gate = snr_gate(job.min_snr_db, job.snr_floor_db, summary, vs_float.summary())
    return Validation(
        ctx_vs_qdq=summary,
        ctx_vs_float=vs_float.summary(),
        qdq_vs_float=qdq_vs_float.summary(),
        worst_snr_db=worst,
        worst_snr_vs_float_db=worst_snr(vs_float.summary()) if flt is not None else None,
        samples=vs_qdq.samples,
        samples_source="heldout" if bucket.heldout else "random",
        passed=passed,
        gate=gate,
        requested=_feed_count(job, bucket),
        cut_by=cut_by if vs_qdq.samples < _feed_count(job, bucket) else "",
    )


def _enough(each: list[float], vs_float: OutputComparison, enough_db: float) -> bool:
    """Whether the samples run so far decide: pooled at ``enough_db`` vs float, each of them
    ``ENOUGH_MARGIN_DB`` below that at least (a NaN, nothing to compare, decides nothing)."""
    pooled = worst_snr(vs_float.summary())
    floor = enough_db - ENOUGH_MARGIN_DB
    return pooled >= enough_db and all(figure >= floor for figure in each)


def closed_loop_on_htp(
    job: CompileJob, bucket: BucketJob, ctx_session: Any
) -> tuple[int, int, dict[str, Accuracy], dict[str, Accuracy]] | None:
    """The ctx fed its own state window after window on the HTP, as a streaming app runs it,
    vs the float model on the held-out windows in order (``core.stream.run_closed_loop``):
    ``job.closed_loop_windows`` at most, none started after ``job.closed_loop_budget_s`` of
    simulator time. None for a model with no stream state, or when no window continued
    another; else (windows run, windows fed the ctx's own state, the figures per output, and
    the CPU QDQ model's fed its own state on the same windows: {} for a whole-fp16 model, which
    the CPU runs in float32). Why on the HTP and not only on the CPU: the state fed back is what
    the NPU computed. Why the CPU's beside it: a closed loop over some windows is not one over
    all of them (DTLN: 37.7 dB over the first 64 held-out windows, 27.0 over all 500 on the
    CPU); the two on the same windows say whether the HTP adds to the CPU's."""
    if not job.stream_states or not bucket.stream or not bucket.float_model:
        return None
    flt = cpu_session(bucket.float_model)
    names = [o.name for o in ctx_session.get_outputs()]
    if set(names) != {o.name for o in flt.get_outputs()}:
        return None  # outputs renamed on the way: the pairs cannot be matched

    def reference(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(names, flt.run(names, feeds), strict=True))

    on_htp = [0.0]

    def on_the_htp(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        started = simulator_seconds()
        got = dict(zip(names, ctx_session.run(names, feeds), strict=True))
        on_htp[0] += simulator_seconds() - started
        return got

    def windows() -> Iterator[dict[str, np.ndarray]]:
        for path in bucket.stream:
            with np.load(path, allow_pickle=False) as data:
                yield {k: data[k] for k in data.files}

    htp = output_comparison(job, bucket)
    ran, carried = run_closed_loop(
        windows(),
        reference,
        on_the_htp,
        job.stream_states,
        htp.add,
        lambda ran: (
            ran < 2 or (ran < job.closed_loop_windows and on_htp[0] < job.closed_loop_budget_s)
        ),
    )
    if not carried:
        return None
    cpu = output_comparison(job, bucket)
    if qnn.read_model_summary(bucket.qdq).nodes_of("QuantizeLinear"):
        qdq = cpu_session(bucket.qdq)
        run_closed_loop(
            itertools.islice(windows(), ran),
            reference,
            lambda feeds: dict(zip(names, qdq.run(names, feeds), strict=True)),
            job.stream_states,
            cpu.add,
        )
    return ran, carried, htp.summary(), cpu.summary() if cpu.samples else {}


def labels_all_agree(summary: dict[str, Any]) -> bool:
    """Whether every output is a label and the ctx gave the CPU QDQ model's label on every
    element so far. The quantize stage judged the scores such labels are computed from on the
    HTP (``graph.tails.expose_label_scores``); where the context's labels are the CPU's
    exactly, more samples measure nothing new: a label-only Magika validated on 25 samples on
    the simulator, 31 s, for 100% agreement."""
    return bool(summary) and all(
        a.compared_as == LABELS and a.agreement == 1.0 for a in summary.values()
    )


def snr_gate(
    min_snr_db: float,
    floors: dict[str, float],
    summary: dict[str, Any],
    itself: dict[str, Any] | None = None,
) -> tuple[bool, str]:
    """ctx vs QDQ per output against ``min_snr_db``, lowered for a pre-quantized model's output
    to its own rounding floor less a margin (``floors``): differences at ties are the model's
    own sensitivity, not a wrong HTP. Such an output also passes on ctx vs the model itself
    (``itself``: its prepared source, its own Q/DQ on the CPU): the QDQ model is that
    quantization rewritten for the HTP, and where a rewrite moved the CPU's figures while the
    HTP still computes the user's model, the artifact keeps the promise (quantize gates a
    kept model on that figure too)."""
    if min_snr_db <= 0:
        return True, "no SNR gate"
    lowered = {
        name: floors[name] for name in summary if name in floors and floors[name] < min_snr_db
    }
    own = itself or {}

    def meets(name: str, accuracy: Any) -> bool:
        bar = lowered.get(name, min_snr_db)
        if worst_snr({name: accuracy}) >= bar:
            return True
        return name in floors and name in own and worst_snr({name: own[name]}) >= bar

    passed = all(meets(name, accuracy) for name, accuracy in summary.items())
    gate = f"worst ctx vs QDQ SNR >= {min_snr_db} dB"
    if lowered:
        shown = ", ".join(f"{name} {value:.1f} dB" for name, value in lowered.items())
        gate += f"; {LOWERED_GATE}: {shown}"
    if floors:
        gate += (
            "; a pre-quantized model's output passes on ctx vs the model itself as well (its "
            "QDQ is the form rewritten for the HTP)"
        )
    return passed, gate


def judged_here(
    job: CompileJob, installed: qnn.InstalledQnn, bucket: BucketJob
) -> HtpProbeRecord | None:
    """The quantize stage's HTP judge record of this bucket, if it describes this very compile:
    same QDQ bytes, onnxruntime-qnn, chip and QNN options, one bucket on the HTP."""
    if job.multi or not bucket.htp_probe or job.backend_type != "htp":
        return None
    record, _ = read_record(HtpProbeRecord, Path(bucket.htp_probe))
    if (
        record is None
        or record.onnxruntime_qnn != installed.package_version
        or (record.soc_model, record.htp_arch) != (job.soc_model, job.htp_arch)
        or record.qnn_options != job.qnn_options
        or record.qdq_sha256 != sha256_file(Path(bucket.qdq))
    ):
        return None
    return record


def adoptable_probe_ctx(
    job: CompileJob, installed: qnn.InstalledQnn, bucket: BucketJob
) -> Path | None:
    """The context the judge compiled and ran, when compiling again would be the same compile
    (``judged_here``) and it is embedded. QNN does not always compile a graph to the same bytes
    twice (recurrent ones), so adopting it is what lets the judge's run stand as this context's
    validation."""
    record = judged_here(job, installed, bucket) if job.embed else None
    if record is None:
        return None
    ctx = Path(bucket.htp_probe).with_name(HTP_PROBE_CTX)
    return ctx if ctx.is_file() and record.ctx_sha256 == sha256_file(ctx) else None


def probe_validation(
    job: CompileJob, installed: qnn.InstalledQnn, bucket: BucketJob, ctx: Path
) -> Validation | None:
    """The quantize stage's HTP judge already ran this very ctx (the same bytes, compiled by the
    same onnxruntime-qnn from the same QDQ) on these very held-out samples: its figures are what
    running it again would measure. None unless every one of those is proven by digest."""
    record = judged_here(job, installed, bucket)
    samples = bucket.heldout[: job.validate_samples or None]
    if record is None or not samples or record.ctx_sha256 != sha256_file(ctx):
        return None
    digests = [sha256_file(Path(s)) for s in samples]
    # All of them; or, when the simulator's time budget cut the judge's run short, the ones it
    # ran (what validating here would run too, under the same budget).
    cut_short = record.requested == len(samples) and len(record.sample_sha256) >= min(
        HTP_MIN_SAMPLES, len(samples)
    )
    if record.sample_sha256 != digests and not (
        cut_short and _in_order(record.sample_sha256, digests)
    ):
        return None
    passed, gate = snr_gate(
        job.min_snr_db, job.snr_floor_db, record.ctx_vs_qdq, record.ctx_vs_float
    )
    return Validation(
        ctx_vs_qdq=record.ctx_vs_qdq,
        ctx_vs_float=record.ctx_vs_float,
        qdq_vs_float=record.qdq_vs_float,
        worst_snr_db=worst_snr(record.ctx_vs_qdq),
        worst_snr_vs_float_db=worst_snr(record.ctx_vs_float) if record.ctx_vs_float else None,
        samples=len(record.sample_sha256),
        samples_source="heldout",
        passed=passed,
        gate=gate,
        measured_by="the quantize stage's HTP judge: the same ctx bytes on the same held-out "
        "samples (sha256 of each checked)",
        requested=len(samples),
        cut_by=record.cut_by if len(record.sample_sha256) < len(samples) else "",
    )


def _in_order(part: list[str], whole: list[str]) -> bool:
    """Whether ``part`` is ``whole`` with some items left out (order kept)."""
    rest = iter(whole)
    return all(any(item == other for other in rest) for item in part)


def combine_validation(per_bucket: dict[str, Validation]) -> Validation:
    """One verdict over the buckets: the worst SNRs, the largest bucket's per-output figures."""
    sections = list(per_bucket.values())
    largest = sections[-1]
    vs_float = [s.worst_snr_vs_float_db for s in sections if s.worst_snr_vs_float_db is not None]
    return Validation(
        ctx_vs_qdq=largest.ctx_vs_qdq,
        ctx_vs_float=largest.ctx_vs_float,
        qdq_vs_float=largest.qdq_vs_float,
        worst_snr_db=min(s.worst_snr_db for s in sections),
        worst_snr_vs_float_db=min(vs_float) if vs_float else None,
        samples=sum(s.samples for s in sections),
        samples_source=largest.samples_source,
        passed=all(s.passed for s in sections),
        gate=largest.gate,
        measured_by=largest.measured_by if len({s.measured_by for s in sections}) == 1 else "",
        requested=sum(s.requested or s.samples for s in sections),
        closed_loop=largest.closed_loop,  # a streaming model has one bucket
        closed_loop_windows=largest.closed_loop_windows,
        closed_loop_carried=largest.closed_loop_carried,
        closed_loop_qdq=largest.closed_loop_qdq,
        cut_by=next(
            (
                c
                for c in ("budget", "evidence", "agreement", "labels")
                if any(s.cut_by == c for s in sections)
            ),
            "",
        ),
    )


JUDGE_COMPILE = (
    "the quantize stage's HTP judge: its offline compile of this very QDQ model (same "
    "onnxruntime-qnn, chip and options), the work QNN does when it compiles online at load"
)
OWN_COMPILE = (
    "this stage's offline compile of this very QDQ model (same onnxruntime-qnn, chip and "
    "options), the work QNN does when it compiles online at load"
)


def benchmark(
    job: CompileJob,
    ep: qnn.QnnEp,
    ctxs: dict[str, Path],
    shared: bool,
    progress: Progress,
    judge_compile_s: float | None = None,
    timed_by: str = JUDGE_COMPILE,
) -> None:
    """Session creation, min of N: every bucket, all buckets in turn; and once, the largest
    bucket's QDQ model with QNN compiling online (what loading costs without a context binary:
    seconds where the context takes milliseconds, so one run tells the ratio; three took a
    third of the stage on the larger models). When the HTP judge, or this stage itself
    (``timed_by`` says which), compiled this very QDQ model offline (``judge_compile_s``), that
    compile is the figure instead of a second one: they agree within 4% (PP-OCR rec: 4.26 s
    offline, 4.42 s online), and it was the bulk of this stage (an Arabic diacritizer whose
    label outputs the judge compiled another model for: 65 s of 211)."""
    import onnxruntime as ort

    runs = max(1, job.load_runs)
    per_bucket: dict[str, float] = {}
    totals = []
    for _ in range(runs):
        started = time.perf_counter()
        sessions = []
        for index, bucket in enumerate(job.buckets):
            options = ep.session_options(
                qnn.QnnOptions(job.backend_type),
                _session_config(job, index, shared),
                job.log_severity,
            )
            begin = time.perf_counter()
            session = ort.InferenceSession(str(ctxs[bucket.name]), options)
            took = time.perf_counter() - begin
            if qnn.EP_NAME not in session.get_providers():
                raise StepFailed("toolchain", f"{ctxs[bucket.name].name} loaded without the QNN EP")
            sessions.append(session)
            per_bucket[bucket.name] = min(per_bucket.get(bucket.name, float("inf")), took)
        totals.append(time.perf_counter() - started)
        del sessions
    ctx_s = per_bucket[job.largest.name]
    if judge_compile_s is not None:
        ratio = judge_compile_s / ctx_s if ctx_s > 0 else None
        progress.result.load = LoadTimes(
            runs, ctx_s, min(totals), per_bucket, judge_compile_s, ratio, None, timed_by
        )
        progress.save()
        return
    progress.result.load = LoadTimes(runs, ctx_s, min(totals), per_bucket)
    progress.result.timing_online_compile = True  # an abort from here on is the QDQ's, not ours
    progress.save()
    qdq_s: float | None = None
    error: str | None = None
    try:
        options = ep.session_options(_options(job), log_severity=job.log_severity)
        started = time.perf_counter()
        session = ort.InferenceSession(job.largest.qdq, options)
        qdq_s = time.perf_counter() - started
        del session
    except Exception as exc:  # onnxruntime's error types are not importable by name
        error = ort_error(exc)
    ratio = qdq_s / ctx_s if qdq_s is not None and ctx_s > 0 else None
    progress.result.load = LoadTimes(runs, ctx_s, min(totals), per_bucket, qdq_s, ratio, error)
    progress.result.timing_online_compile = False
    progress.save()


def register(qnn_sdk: str, progress: Progress) -> qnn.QnnEp:
    """The QNN EP of this interpreter, which must bundle the pinned QNN SDK ``qnn_sdk``."""
    progress.stage("register")
    try:
        ep = qnn.find_qnn_ep()
    except Exception as exc:  # ToolchainError or an onnxruntime error
        raise StepFailed("toolchain", getattr(exc, "message", None) or ort_error(exc)) from exc
    progress.result.installed = {
        "onnxruntime_qnn": ep.installed.package_version,
        "onnxruntime": ep.installed.onnxruntime,
        "qnn_sdk": ep.installed.qnn_sdk,
    }
    if ep.installed.qnn_sdk and qnn.sdk_version(ep.installed.qnn_sdk) != qnn_sdk:
        raise StepFailed(
            "toolchain",
            f"{ep.installed.describe()} bundles QNN SDK {ep.installed.qnn_sdk}, but the pin "
            f"says {qnn_sdk}.",
        )
    return ep


# -- the variant ------------------------------------------------------------------------------------


def judge_loaded(
    job: CompileJob, installed: qnn.InstalledQnn
) -> tuple[HtpProbeRecord, HtpLoad, Path, Validation] | None:
    """The quantize stage's HTP judge record, its session's account, its ctx and its run as this
    variant's validation, when they are this whole variant: one embedded bucket on the HTP with no stream to run in a closed loop,
    the judge's ctx adoptable (``adoptable_probe_ctx``) and its run this variant's validation
    (``probe_validation``), and its child's load of that ctx timed (``HtpLoad``). A worker
    would compile nothing then, and load, validate and time the same bytes again."""
    if job.multi or job.stream_states or job.backend_type != "htp":
        return None
    if installed.qnn_sdk and qnn.sdk_version(installed.qnn_sdk) != job.qnn_sdk:
        return None  # the worker's registration names that mismatch
    bucket = job.largest
    record = judged_here(job, installed, bucket)
    source = adoptable_probe_ctx(job, installed, bucket) if record is not None else None
    if record is None or record.load is None or record.compile_s is None or source is None:
        return None
    if record.load.runs < job.load_runs:  # [compile] load_runs asks for more than it timed
        return None
    validation = probe_validation(job, installed, bucket, source)
    return None if validation is None else (record, record.load, source, validation)


def judged_variant(job: CompileJob, installed: qnn.InstalledQnn) -> WorkerResult | None:
    """The variant built from ``judge_loaded`` in this process, without a worker (0.3-0.5 s of
    a small model's compile stage: its start, imports and QNN's teardown): the judge's ctx
    copied and verified, its coverage gated with this config's limits, its I/O, memory and
    load time as its child measured them. None: a worker builds it (also where the copy fails
    verification: the worker then fails it the same way, with its own record; and where this
    path itself fails other than on the disk: the worker's is the one every variant can take)."""
    ctx = Path(job.out_dir) / job.largest.ctx_name
    try:
        return _judged_variant(job, installed, ctx)
    except OSError:
        raise  # a full disk, a folder turned read-only: the stage reports it, as for a worker
    except Exception as exc:
        ctx.unlink(missing_ok=True)
        print(
            f"NOTE {job.model} {job.target}: built in a worker instead of from the HTP judge's "
            f"run ({type(exc).__name__}: {exc})",
            flush=True,
        )
        return None


def _judged_variant(job: CompileJob, installed: qnn.InstalledQnn, ctx: Path) -> WorkerResult | None:
    found = judge_loaded(job, installed)
    if found is None:
        return None
    record, load, source, validation = found
    bucket = job.largest
    out = Path(job.out_dir)
    started = time.perf_counter()
    shutil.copyfile(source, ctx)
    result = WorkerResult(
        installed={
            "onnxruntime_qnn": installed.package_version,
            "onnxruntime": installed.onnxruntime,
            "qnn_sdk": installed.qnn_sdk,
        },
        validated_with="single",
    )
    result.compile_time_s = time.perf_counter() - started
    try:
        result.sets.append(verify_set(job, {bucket.name: ctx}, "single", out))
    except StepFailed:
        ctx.unlink()
        return None
    coverage = coverage_mod.summarize(
        coverage_mod.recorded_assignment(load.assignment),
        qnn.read_model_summary(ctx),
        job.max_partitions,
        job.allowed_cpu_ops,
    )
    result.buckets[bucket.name] = BucketOutcome(coverage, load.inputs, load.outputs, validation)
    result.memory = Memory(
        "single", load.rss_before_bytes, load.rss_after_bytes, load.rss_after_bytes
    )
    ctx_s = load.ctx_load_s
    ratio = record.compile_s / ctx_s if record.compile_s and ctx_s > 0 else None
    result.load = LoadTimes(
        load.runs, ctx_s, ctx_s, {bucket.name: ctx_s}, record.compile_s, ratio, None, JUDGE_LOAD
    )
    result.stage, result.status = "done", "ok"
    return result


JUDGE_LOAD = (
    "the quantize stage's HTP judge: its offline compile of this very QDQ model (same "
    "onnxruntime-qnn, chip and options), the work QNN does when it compiles online at load; "
    "the ctx's session creation timed by the judge's child, on these very bytes"
)


def run(job: CompileJob, progress: Progress) -> None:
    ep = register(job.qnn_sdk, progress)
    out = Path(job.out_dir)
    result = progress.result
    kind = "shared" if job.multi and "shared" in job.packaging else "single"
    if job.multi and kind == "single":
        kind = "standalone"
    progress.stage("compile")
    started = time.perf_counter()
    target_dir = out / STANDALONE_DIR if kind == "standalone" else out
    offline: dict[str, float] = {}  # each bucket compiled here alone: its compile time
    primary = compile_set(job, ep, target_dir, share=kind == "shared", seconds=offline)
    result.compile_time_s = time.perf_counter() - started
    progress.stage("verify")
    result.sets.append(verify_set(job, primary, kind, out))
    # The set that is loaded, measured and validated here: the primary one, unless this machine
    # cannot load a shared set (then the standalone set, same QDQ graphs and options).
    ctxs, shared, validated = primary, kind == "shared", kind
    if kind == "shared":  # in a separate process: a machine that cannot load it may crash
        progress.stage("probe")
        loads, result.shared_load_probe = probe_shared(job, primary)
        if "standalone" in job.packaging or not loads:
            progress.stage("compile_standalone")
            standalone = compile_set(job, ep, out / STANDALONE_DIR, share=False)
            progress.stage("verify_standalone")
            result.sets.append(verify_set(job, standalone, "standalone", out))
            if not loads:
                ctxs, shared, validated = standalone, False, "standalone"
    result.validated_with = validated

    progress.stage("load")
    sessions = {}
    rss_before = rss_bytes()
    rss_first = rss_before
    for index, bucket in enumerate(job.buckets):
        session, coverage = load_bucket(job, ep, bucket, index, ctxs[bucket.name], shared)
        sessions[bucket.name] = session
        result.buckets[bucket.name] = BucketOutcome(
            coverage,
            coverage_mod.tensor_specs(session.get_inputs()),
            coverage_mod.tensor_specs(session.get_outputs()),
        )
        if index == 0:
            rss_first = rss_bytes()
    result.memory = Memory(result.validated_with, rss_before, rss_first, rss_bytes())
    progress.save()

    progress.stage("validate")
    for bucket in job.buckets:
        try:
            validation = probe_validation(job, ep.installed, bucket, ctxs[bucket.name]) or validate(
                job, bucket, sessions[bucket.name]
            )
            loop = closed_loop_on_htp(job, bucket, sessions[bucket.name])
        except Exception as exc:  # onnxruntime's error types are not importable by name
            kind_, message = classify(ort_error(exc), ep.installed)
            what = f"bucket {bucket.name}: " if job.multi else ""
            raise StepFailed(kind_, f"{what}validation run failed: {message}") from exc
        if loop is not None:
            ran, carried, summary, on_cpu = loop
            validation = dataclasses.replace(
                validation,
                closed_loop=summary,
                closed_loop_windows=ran,
                closed_loop_carried=carried,
                closed_loop_qdq=on_cpu,
            )
        outcome = result.buckets[bucket.name]
        result.buckets[bucket.name] = BucketOutcome(
            outcome.coverage, outcome.inputs, outcome.outputs, validation
        )
    sessions.clear()
    progress.save()

    progress.stage("benchmark")
    judged = judged_here(job, ep.installed, job.largest)
    if judged is not None:
        benchmark(job, ep, ctxs, shared, progress, judged.compile_s)
    elif validated == kind and job.largest.name in offline:  # the very context loaded here
        benchmark(job, ep, ctxs, shared, progress, offline[job.largest.name], OWN_COMPILE)
    else:
        benchmark(job, ep, ctxs, shared, progress)
    result.status = "ok"
    progress.stage("done")


# -- the process -----------------------------------------------------------------------------------


def _warm_up() -> None:
    """What every worker does first, done while a spare waits for its job (see
    pipeline.compile.child.spare_workers): the QNN EP's registration, kept per process. A
    failure here is the job's to report, at its register step."""
    try:
        qnn.find_qnn_ep()
    except Exception:
        return


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.compile.worker [--await] JOB.json``: any failure is left in the
    result file. ``--await``: warm up first, then wait for JOB.json to appear."""
    args = sys.argv[1:] if argv is None else argv
    waiting = args[:1] == ["--await"]
    args = args[1:] if waiting else args
    if len(args) != 1:
        print("usage: python -m pipeline.compile.worker [--await] JOB.json", file=sys.stderr)
        return 2
    die_with_parent()
    if waiting:
        _warm_up()
        await_job(Path(args[0]))
    job = read_message(CompileJob, Path(args[0]))
    progress = Progress(Path(job.result))
    try:
        run(job, progress)
    except StepFailed as exc:
        progress.result.status = "failed"
        progress.result.error = Failure(progress.result.stage, exc.kind, exc.message)
        progress.save()
        return 1
    except Exception as exc:  # anything unforeseen still gets reported with its step
        progress.result.status = "failed"
        progress.result.error = Failure(progress.result.stage, "error", ort_error(exc))
        progress.save()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
