"""Compile every shape bucket of a model and target into ONE weight-shared QNN context.

All buckets of a (model, target, toolchain) are compiled in one process with
``ep.share_ep_contexts=1`` (the last with ``ep.stop_share_ep_contexts=1``), embed mode 0 and a
unique ``ep.context_node_name_prefix`` per bucket: the QNN EP then keeps one QNN context across the
compilations, adds every bucket's graph to it with HTP weight sharing (static tensors with the same
name and bytes are stored once), and writes one ``_qnn.bin`` that every bucket's ``_ctx.onnx``
references (FACTS §7). The quantize stage guarantees that same name means same bytes.

Checks, each failure explained: every ctx passes the single-variant checks of
``pipeline.compile_worker.verify_ctx`` (EPContext nodes, pinned SDK, requested soc/arch, embed 0),
exactly one ``.bin`` exists and every EPContext node that references a binary references it, and
EPContext node and partition names are unique across buckets.

Measured here (QNN 2.47, 2.49 and 2.51 on x86_64): the x86_64 HTP simulator cannot create a
context from a weight-shared binary holding several graphs (2.49: QNN_COMMON_ERROR_NOT_SUPPORTED
from contextCreateFromBinary; 2.51: the process dies with SIGSEGV), while a shared binary with one
graph, or an unshared binary with several graphs, loads. So a probe in a separate process tries to
load the shared set; where it does not load (this machine), or when ``[buckets] packaging`` asks
for it, each bucket is also compiled on its own (``standalone/``) from the same QDQ model with the
same options. Coverage and validation run on the shared set where it loads (a device) and on the
standalone set otherwise, and the records say which.

The parent side (``bucket_inputs``, ``build_bucket_variant``, the record and the report) runs in
the compile stage (``pipeline.compile.compile_model``) and reuses its child-process isolation
(``pipeline.compile.run_child`` / ``interpret``); ``python -m pipeline.bucket_compile JOB.json``
is the child.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import compile_worker as cw
from . import qnn
from .errors import ModelError

WORKER = "pipeline.bucket_compile"
BUCKETS_FILE = "buckets.json"
STANDALONE_DIR = "standalone"
SHARE = {"ep.share_ep_contexts": "1"}
# Our modules whose code decides what a bucketed variant is: editing one rebuilds.
CODE = (
    "bucket_compile",
    "bucket_quantize",
    "buckets",
    "compile",
    "compile_worker",
    "coverage",
    "metrics",
    "qnn",
)
PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import onnxruntime as ort
from pipeline import qnn
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


# -- the child ------------------------------------------------------------------------------------


@dataclass
class BucketJob:
    """All buckets of one (model, target, toolchain)."""

    model: str
    target: str
    buckets: list[dict[str, Any]]  # {name, qdq, float_model, heldout, ctx_name}, smallest first
    out_dir: str
    result: str
    soc_model: int
    htp_arch: int
    qnn_sdk: str
    packaging: list[str]
    backend_type: str = "htp"
    embed: bool = False  # for the standalone set; the shared set is always embed mode 0
    qnn_options: dict[str, str] = field(default_factory=dict)
    log_severity: int = qnn.LOG_WARNING
    load_runs: int = 3
    max_partitions: int = 1
    allowed_cpu_ops: list[str] = field(default_factory=list)
    min_snr_db: float = 0.0
    validate_samples: int = 16
    probe_timeout_s: float = 300.0

    @classmethod
    def read(cls, path: Path) -> BucketJob:
        return cw.read_job(cls, path)

    @property
    def options(self) -> qnn.QnnOptions:
        extra = tuple(sorted(self.qnn_options.items()))
        return qnn.QnnOptions(self.backend_type, self.soc_model, self.htp_arch, extra)

    def single(self, bucket: dict[str, Any], out_dir: Path, embed: bool) -> cw.Job:
        """The single-model job of one bucket, for compile_worker's checks."""
        return cw.Job(
            qdq=bucket["qdq"],
            float_model=bucket["float_model"],
            heldout=list(bucket["heldout"]),
            out_dir=str(out_dir),
            ctx_name=bucket["ctx_name"],
            result=self.result,
            soc_model=self.soc_model,
            htp_arch=self.htp_arch,
            qnn_sdk=self.qnn_sdk,
            backend_type=self.backend_type,
            embed=embed,
            log_severity=self.log_severity,
            load_runs=self.load_runs,
            max_partitions=self.max_partitions,
            allowed_cpu_ops=list(self.allowed_cpu_ops),
            min_snr_db=self.min_snr_db,
            validate_samples=self.validate_samples,
        )


def compile_set(job: BucketJob, ep: qnn.QnnEp, out_dir: Path, share: bool) -> dict[str, Path]:
    """Compile every bucket in this process; with ``share`` into one weight-shared context."""
    import onnxruntime as ort

    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*out_dir.glob("*_ctx.onnx"), *out_dir.glob("*.bin")]:
        stale.unlink()
    ctxs = {}
    last = len(job.buckets) - 1
    for index, bucket in enumerate(job.buckets):
        config: dict[str, str] = {}
        if share:
            config = {**SHARE, "ep.context_node_name_prefix": f"{bucket['name']}_"}
            if index == last:
                config["ep.stop_share_ep_contexts"] = "1"
        options = ep.session_options(job.options, config, job.log_severity)
        ctx = out_dir / bucket["ctx_name"]
        try:
            ort.ModelCompiler(
                options,
                bucket["qdq"],
                embed_compiled_data_into_model=not share and job.embed,
                flags=ort.OrtCompileApiFlags.ERROR_IF_NO_NODES_COMPILED,
            ).compile_to_file(str(ctx))
        except Exception as exc:
            kind, message = cw._classify(cw._ort_error(exc), ep.installed)
            raise cw.StepFailed(kind, f"bucket {bucket['name']}: {message}") from exc
        if not ctx.is_file():
            raise cw.StepFailed("error", f"bucket {bucket['name']}: no {ctx.name} was written")
        ctxs[bucket["name"]] = ctx
    return ctxs


def verify_set(job: BucketJob, ctxs: dict[str, Path], shared: bool) -> dict[str, Any]:
    """Per-bucket EP checks, then (shared) one binary that every EPContext node points at."""
    embed = False if shared else job.embed
    facts = {}
    for bucket in job.buckets:
        ctx = ctxs[bucket["name"]]
        try:
            facts[bucket["name"]] = cw.verify_ctx(job.single(bucket, ctx.parent, embed), ctx)
        except cw.StepFailed as exc:
            raise cw.StepFailed(exc.kind, f"bucket {bucket['name']}: {exc.message}") from exc
    folder = next(iter(ctxs.values())).parent
    problems = []
    node_names: dict[str, str] = {}
    partitions: dict[str, str] = {}
    referenced: dict[str, set[str]] = {}
    for name, ctx in ctxs.items():
        for node in qnn.read_model_summary(ctx).nodes_of("EPContext"):
            for seen, key in (
                (node_names, node.name),
                (partitions, node.attributes.get("partition_name", "")),
            ):
                if key and key in seen and seen[key] != name:
                    problems.append(f"EPContext name {key!r} is in buckets {seen[key]} and {name}")
                seen.setdefault(key, name)
            if int(node.attributes.get("embed_mode", 1)) == 0 and node.attributes.get(
                "ep_cache_context"
            ):
                referenced.setdefault(name, set()).add(str(node.attributes["ep_cache_context"]))
    bins = sorted(set().union(*referenced.values())) if referenced else []
    on_disk = sorted(p.name for p in folder.glob("*.bin"))
    summary: dict[str, Any] = {"facts": facts, "bins_referenced": bins, "bins_on_disk": on_disk}
    if shared:
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
        if bins:
            summary["binary"] = bins[0]
            summary["bin_bytes"] = (folder / bins[0]).stat().st_size
    summary["ctx_bytes"] = {n: p.stat().st_size for n, p in ctxs.items()}
    # What each bucket needs on its own (its ctx and the binaries it references).
    summary["bucket_bytes"] = {n: sum(f["sizes"].values()) for n, f in facts.items()}
    summary["bin_total_bytes"] = sum((folder / b).stat().st_size for b in on_disk)
    summary["total_bytes"] = sum(summary["ctx_bytes"].values()) + summary["bin_total_bytes"]
    if problems:
        raise cw.StepFailed("verify", "weight-shared context: " + "; ".join(problems) + ".")
    return summary


def probe_shared(job: BucketJob, ctxs: dict[str, Path]) -> tuple[bool, str]:
    """Can this machine load the weight-shared set? Tried in a separate process: it may crash."""
    spec = {"models": [str(ctxs[b["name"]]) for b in job.buckets], "backend": job.backend_type}
    root = str(Path(__file__).resolve().parent.parent)
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


def _rss_bytes() -> int:
    """Resident memory of this process now (Linux /proc; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def load_bucket(
    job: BucketJob, ep: qnn.QnnEp, bucket: dict[str, Any], ctx: Path, shared: bool
) -> tuple[Any, dict[str, Any]]:
    """A session on one bucket's ctx (over the shared context when ``shared``) and its coverage."""
    import onnxruntime as ort

    from . import coverage as coverage_mod

    config = {**cw.RECORD_ASSIGNMENT, **(SHARE if shared else {})}
    options = ep.session_options(qnn.QnnOptions(job.backend_type), config, job.log_severity)
    try:
        session = ort.InferenceSession(str(ctx), options)
    except Exception as exc:
        kind, message = cw._classify(cw._ort_error(exc), ep.installed)
        raise cw.StepFailed(kind, f"bucket {bucket['name']}: {message}") from exc
    if qnn.EP_NAME not in session.get_providers():
        raise cw.StepFailed(
            "toolchain",
            f"bucket {bucket['name']}: the ctx session runs on {session.get_providers()} only.",
        )
    report = coverage_mod.summarize(
        coverage_mod.assignment_from_session(session),
        qnn.read_model_summary(ctx),
        job.max_partitions,
        job.allowed_cpu_ops,
    )
    return session, report


def benchmark(
    job: BucketJob, ep: qnn.QnnEp, ctxs: dict[str, Path], shared: bool, result: cw.Result
) -> dict[str, Any]:
    """Session creation: every bucket (min of N), all buckets together, and QDQ online compile."""
    import onnxruntime as ort

    runs = max(1, job.load_runs)
    load: dict[str, Any] = {"runs": runs, "buckets": {}}
    result.data["load"] = load

    def create(path: Path, config: dict[str, str]) -> Any:
        options = ep.session_options(qnn.QnnOptions(job.backend_type), config, job.log_severity)
        return ort.InferenceSession(str(path), options)

    totals = []
    for _ in range(runs):
        started = time.perf_counter()
        sessions = []
        for index, bucket in enumerate(job.buckets):
            config = dict(SHARE) if shared else {}
            if shared and index == len(job.buckets) - 1:
                config["ep.stop_share_ep_contexts"] = "1"
            begin = time.perf_counter()
            sessions.append(create(ctxs[bucket["name"]], config))
            took = time.perf_counter() - begin
            previous = load["buckets"].get(bucket["name"], float("inf"))
            load["buckets"][bucket["name"]] = min(previous, took)
        totals.append(time.perf_counter() - started)
        del sessions
    load["all_s"] = min(totals)
    largest = job.buckets[-1]
    load["ctx_s"] = load["buckets"][largest["name"]]
    result.save()
    load["step"] = "qdq"  # an abort from here on is the online compile's, not the ctx's
    result.save()
    try:
        options = ep.session_options(job.options, log_severity=job.log_severity)
        started = time.perf_counter()
        session = ort.InferenceSession(largest["qdq"], options)
        load["qdq_s"] = time.perf_counter() - started
        del session
        load["qdq_bucket"] = largest["name"]
        load["ratio"] = load["qdq_s"] / load["ctx_s"] if load["ctx_s"] > 0 else None
    except Exception as exc:
        load["qdq_error"] = cw._ort_error(exc)
    load.pop("step", None)
    result.save()
    return load


def _merge_specs(per_bucket: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One spec list for the variant: the largest bucket's, with -1 where the buckets differ."""
    merged = [dict(s, shape=list(s["shape"])) for s in per_bucket[-1]]
    for spec in merged:
        for other in per_bucket[:-1]:
            match = next((o for o in other if o["name"] == spec["name"]), None)
            if match is None:
                continue
            for axis, size in enumerate(match["shape"]):
                if axis < len(spec["shape"]) and size != spec["shape"][axis]:
                    spec["shape"][axis] = -1
    return merged


def _aggregate(per_bucket: dict[str, dict[str, Any]], key: str) -> dict[str, Any]:
    sections = {name: data[key] for name, data in per_bucket.items() if key in data}
    if key == "coverage":
        problems = [f"{n}: {p}" for n, s in sections.items() for p in s.get("problems", [])]
        return {
            "qnn_partitions": max(
                (s.get("qnn_partitions", 0) for s in sections.values()), default=0
            ),
            "qnn_nodes": sum(s.get("qnn_nodes", 0) for s in sections.values()),
            "cpu_compute_nodes": [
                dict(n, bucket=b)
                for b, s in sections.items()
                for n in s.get("cpu_compute_nodes", [])
            ],
            "cpu_ops": {
                op: sum(s.get("cpu_ops", {}).get(op, 0) for s in sections.values())
                for op in sorted({o for s in sections.values() for o in s.get("cpu_ops", {})})
            },
            "cpu_io_qdq_nodes": sum(s.get("cpu_io_qdq_nodes", 0) for s in sections.values()),
            "passed": bool(sections) and all(s.get("passed") for s in sections.values()),
            "gate": next((s.get("gate") for s in sections.values()), ""),
            "problems": problems,
            "buckets": sections,
        }
    from .metrics import worst_snr

    worst = [s["worst_snr_db"] for s in sections.values() if s.get("worst_snr_db") is not None]
    vs_float = [
        s["worst_snr_vs_float_db"]
        for s in sections.values()
        if s.get("worst_snr_vs_float_db") is not None
    ]
    largest = list(sections.values())[-1] if sections else {}
    return {
        "ctx_vs_qdq": largest.get("ctx_vs_qdq", {}),
        "ctx_vs_float": largest.get("ctx_vs_float", {}),
        "qdq_vs_float": largest.get("qdq_vs_float", {}),
        "worst_snr_db": min(worst) if worst else worst_snr({}),
        "worst_snr_vs_float_db": min(vs_float) if vs_float else None,
        "samples": sum(s.get("samples", 0) for s in sections.values()),
        "passed": bool(sections) and all(s.get("passed") for s in sections.values()),
        "gate": next((s.get("gate") for s in sections.values()), ""),
        "buckets": sections,
    }


def run(job: BucketJob, result: cw.Result) -> None:
    ep = cw.register(job.qnn_sdk, result)
    out = Path(job.out_dir)
    share = "shared" in job.packaging
    shared_ctxs: dict[str, Path] = {}
    started = time.perf_counter()
    if share:
        result.stage("compile")
        shared_ctxs = compile_set(job, ep, out, share=True)
        result.data["compile_time_s"] = time.perf_counter() - started
        result.stage("verify")
        result.data["shared"] = verify_set(job, shared_ctxs, shared=True)
    use_shared = False
    if share:  # in a separate process: a machine that cannot load it may crash instead
        result.stage("probe")
        use_shared, note = probe_shared(job, shared_ctxs)
        result.data["shared_load_probe"] = note
    # One context per bucket: when it is published, or to validate where the shared set does not
    # load (the x86 simulator); it is also the "k separate ctx models" of the size comparison.
    standalone: dict[str, Path] = {}
    if "standalone" in job.packaging or not use_shared:
        result.stage("compile_standalone")
        begin = time.perf_counter()
        standalone = compile_set(job, ep, out / STANDALONE_DIR, share=False)
        result.data["standalone_compile_time_s"] = time.perf_counter() - begin
        result.data.setdefault("compile_time_s", result.data["standalone_compile_time_s"])
        result.stage("verify_standalone")
        result.data["standalone"] = verify_set(job, standalone, shared=False)
    ctxs = shared_ctxs if use_shared else standalone
    result.data["validated_with"] = "shared" if use_shared else "standalone"

    result.stage("load")
    per_bucket: dict[str, dict[str, Any]] = {b["name"]: {} for b in job.buckets}
    sessions = {}
    rss_before = _rss_bytes()
    for index, bucket in enumerate(job.buckets):
        session, coverage = load_bucket(job, ep, bucket, ctxs[bucket["name"]], use_shared)
        sessions[bucket["name"]] = session
        per_bucket[bucket["name"]]["coverage"] = coverage
        per_bucket[bucket["name"]]["inputs"] = cw._specs(session.get_inputs())
        per_bucket[bucket["name"]]["outputs"] = cw._specs(session.get_outputs())
        if index == 0:
            rss_first = _rss_bytes()
    result.data["memory"] = {
        "rss_before_bytes": rss_before,
        "rss_one_bucket_bytes": rss_first,
        "rss_all_buckets_bytes": _rss_bytes(),
        "set": "shared" if use_shared else "standalone",
    }
    result.data["coverage"] = _aggregate(per_bucket, "coverage")
    result.data["buckets"] = per_bucket
    result.save()

    result.stage("validate")
    for bucket in job.buckets:
        single = job.single(bucket, ctxs[bucket["name"]].parent, job.embed)
        try:
            per_bucket[bucket["name"]]["validation"] = cw.validate(single, sessions[bucket["name"]])
        except Exception as exc:
            kind, message = cw._classify(cw._ort_error(exc), ep.installed)
            raise cw.StepFailed(
                kind, f"bucket {bucket['name']}: validation run failed: {message}"
            ) from exc
    sessions.clear()
    result.data["validation"] = _aggregate(per_bucket, "validation")
    result.data["inputs"] = _merge_specs([per_bucket[b["name"]]["inputs"] for b in job.buckets])
    result.data["outputs"] = _merge_specs([per_bucket[b["name"]]["outputs"] for b in job.buckets])
    result.save()

    result.stage("benchmark")
    benchmark(job, ep, ctxs, use_shared, result)
    facts = (result.data.get("shared") or result.data.get("standalone") or {})["facts"]
    first = facts[job.buckets[0]["name"]]
    result.data["ctx"] = {
        key: first[key]
        for key in ("ep_sdk_version", "qnn_sdk_version", "ep_compatibility_info", "embed_mode")
    }
    result.data["status"] = "ok"
    result.stage("done")


def main(argv: list[str] | None = None) -> int:
    return cw.child_main(argv, WORKER, BucketJob, run)


# -- the parent (compile stage) -------------------------------------------------------------------


@dataclass
class BucketInputs:
    """The bucketed quantize stage's outputs for one model, checked."""

    config: Any
    folder: Path
    plan: Any
    buckets: list[dict[str, Any]]  # name, qdq, float_model, heldout, sha256s


def bucket_inputs(config: Any, artifacts: Path) -> BucketInputs:
    from .bucket_quantize import bucket_folder, plan_from_dict
    from .compile import heldout_digest
    from .fileio import sha256_file
    from .records import read_record

    folder = Path(artifacts) / "build" / config.model.name
    run_quantize = f"Run `nox -s quantize -- {config.path}` first."
    record = read_record(folder).get("quantize") or {}
    if not record.get("buckets"):
        raise ModelError(
            f"{config.model.name}: {folder / 'record.json'} records no bucketed quantize build.",
            tip=run_quantize,
        )
    buckets = []
    for entry in record["buckets"]:
        where = bucket_folder(folder, entry["name"])
        qdq = where / "qdq.onnx"
        if not qdq.is_file():
            raise ModelError(f"{config.model.name}: {qdq} is missing.", tip=run_quantize)
        qdq_sha = sha256_file(qdq)
        if qdq_sha != entry["qdq_sha256"]:
            raise ModelError(
                f"{config.model.name}: {qdq} changed after the quantize stage recorded it.",
                tip=run_quantize,
            )
        heldout = sorted((where / "heldout").glob("sample_*.npz"))
        buckets.append(
            {
                "name": entry["name"],
                "shapes": entry["shapes"],
                "qdq": qdq,
                "float_model": where / "float.onnx",
                "heldout": heldout,
                "qdq_sha256": qdq_sha,
                "float_sha256": entry.get("float_sha256", ""),
                "heldout_digest": heldout_digest(heldout),
            }
        )
    return BucketInputs(config, folder, plan_from_dict(record["plan"]), buckets)


def ctx_file_name(model: str, bucket: str, target: str, qnn_sdk: str) -> str:
    return f"{model}_{bucket}_{target}_qnn{qnn_sdk}_ctx.onnx"


def variant_digest(inputs: BucketInputs, toolchain: Any, onnxruntime: str, target: Any) -> str:
    from .compile import VALIDATE_SAMPLES, compile_settings
    from .records import pipeline_code_digest

    section = dataclasses.asdict(inputs.config.buckets)
    data = {
        "model": dataclasses.asdict(inputs.config.model),
        "buckets": [
            {k: b[k] for k in ("name", "qdq_sha256", "float_sha256", "heldout_digest")}
            for b in inputs.buckets
        ],
        "packaging": section["packaging"],
        "qnn_options": section["qnn_options"],
        "compile": compile_settings(inputs.config),
        "toolchain": dataclasses.asdict(toolchain),
        "onnxruntime": onnxruntime,
        "target": dataclasses.asdict(target),
        "code": pipeline_code_digest(CODE),
        "validate_samples": VALIDATE_SAMPLES,
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def make_job(
    inputs: BucketInputs, toolchain: Any, target: Any, out: Path, result: Path, log_severity: int
) -> dict[str, Any]:
    from .compile import VALIDATE_SAMPLES

    config = inputs.config
    settings = config.compile
    return dataclasses.asdict(
        BucketJob(
            model=config.model.name,
            target=target.name,
            buckets=[
                {
                    "name": b["name"],
                    "qdq": str(b["qdq"].resolve()),
                    "float_model": str(b["float_model"].resolve())
                    if b["float_model"].is_file()
                    else "",
                    "heldout": [str(p.resolve()) for p in b["heldout"]],
                    "ctx_name": ctx_file_name(
                        config.model.name, b["name"], target.name, toolchain.qnn_sdk
                    ),
                }
                for b in inputs.buckets
            ],
            out_dir=str(out.resolve()),
            result=str(result.resolve()),
            soc_model=target.soc_model,
            htp_arch=target.htp_arch,
            qnn_sdk=toolchain.qnn_sdk,
            packaging=list(config.buckets.packaging),
            embed=settings.embed,
            qnn_options=dict(config.buckets.qnn_options),
            log_severity=log_severity,
            load_runs=settings.load_runs,
            max_partitions=settings.max_partitions,
            allowed_cpu_ops=list(settings.allowed_cpu_ops),
            min_snr_db=settings.min_snr_db,
            validate_samples=VALIDATE_SAMPLES,
        )
    )


def _fill(
    record: Any, result: dict[str, Any], status: str, error: dict[str, Any], out: Path
) -> dict[str, Any]:
    """The variant record (variant.json) and the bucket details (buckets.json) from the child."""
    from .compile import fill_record, present_files

    fill_record(record, result, status, error)
    shared = result.get("shared") or {}
    standalone = result.get("standalone") or {}
    main = shared or standalone
    prefix = "" if shared else f"{STANDALONE_DIR}/"
    names = list(main.get("ctx_bytes", {}))
    files = [prefix + (main["facts"][n]["files"][0]) for n in names] if main.get("facts") else []
    files += [prefix + b for b in main.get("bins_on_disk", [])]
    record.files = present_files(out, files, recursive=True)
    sizes = {f: (out / f).stat().st_size for f in record.files}
    record.load = {**result.get("load", {}), "sizes": sizes}
    return {
        "packaging": "shared" if shared else "standalone",
        "validated_with": result.get("validated_with"),
        "shared_load_probe": result.get("shared_load_probe"),
        "shared": {k: v for k, v in shared.items() if k != "facts"},
        "standalone": {k: v for k, v in standalone.items() if k != "facts"},
        "standalone_files": {
            n: [f"{STANDALONE_DIR}/{f}" for f in standalone["facts"][n]["files"]]
            for n in standalone.get("facts", {})
        },
        "ctx_files": {n: prefix + main["facts"][n]["files"][0] for n in main.get("facts", {})},
        "memory": result.get("memory", {}),
        "buckets": result.get("buckets", {}),
        "compile_time_s": {
            "shared": result.get("compile_time_s") if shared else None,
            "standalone": result.get("standalone_compile_time_s"),
        },
    }


def read_buckets_file(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(folder) / BUCKETS_FILE).read_text("utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}


def build_bucket_variant(
    inputs: BucketInputs,
    toolchain: Any,
    installed: qnn.InstalledQnn,
    target: Any,
    ctx_root: Path,
    force: bool,
    log_severity: int,
    progress: Any,
) -> Any:
    from . import compile as compile_mod
    from .fileio import atomic_dir, write_json
    from .report import json_safe
    from .variant import VARIANT_FILE

    config = inputs.config
    folder = ctx_root / toolchain.onnxruntime_qnn / target.name
    digest = variant_digest(inputs, toolchain, installed.onnxruntime, target)
    existing = compile_mod._existing(folder)
    if (
        not force
        and existing is not None
        and existing.inputs_digest == digest
        and (folder / BUCKETS_FILE).is_file()
    ):
        return compile_mod.Built(existing, folder, skipped=True)
    record = compile_mod.new_record(config, toolchain, installed, target, digest, embed_mode=0)
    # Compile, verify, validate and time k buckets, twice (shared and standalone).
    timeout = config.compile.timeout_s * max(1, len(inputs.buckets))
    work = Path(tempfile.mkdtemp(prefix=".work-", dir=ctx_root))
    try:
        with atomic_dir(folder) as out:
            job = make_job(inputs, toolchain, target, out, work / "result.json", log_severity)
            outcome = compile_mod.run_child(
                job, work, out / "compile.log", timeout, on_tick=progress.tick, worker=WORKER
            )
            status, error = compile_mod.interpret(outcome, timeout)
            details = _fill(record, outcome.result, status, error, out)
            details["plan"] = {
                "pads": [dataclasses.asdict(p) for p in inputs.plan.pads],
                "crops": [dataclasses.asdict(c) for c in inputs.plan.crops],
                "buckets": [{"name": b["name"], "shapes": b["shapes"]} for b in inputs.buckets],
            }
            write_json(out / BUCKETS_FILE, json_safe(details))
            write_json(out / VARIANT_FILE, json_safe(record.to_dict()))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return compile_mod.Built(record, folder, skipped=False, seconds=outcome.seconds)


def describe_bucketed(built: Any) -> str:
    """The compile stage's line for a variant, plus what sharing the context saved."""
    from .compile import describe

    return describe(built) + _describe_buckets(built.folder)


def _describe_buckets(folder: Path) -> str:
    details = read_buckets_file(folder)
    shared = details.get("shared") or {}
    standalone = details.get("standalone") or {}
    if not shared.get("total_bytes"):
        return ""
    return (
        f"; {len(details.get('ctx_files', {}))} buckets in one shared context "
        f"{shared['total_bytes'] / 1e6:.3f} MB (standalone {standalone.get('total_bytes', 0) / 1e6:.3f} MB), "
        f"validated with the {details.get('validated_with')} set"
    )


def update_build_record(
    inputs: BucketInputs, toolchain: Any, installed: qnn.InstalledQnn, built: list[Any]
) -> None:
    from .compile import compile_settings, variant_outcomes
    from .records import pipeline_code_digest, read_record, update_record

    section = dict(read_record(inputs.folder).get("compile", {}))
    section[toolchain.onnxruntime_qnn] = {
        "onnxruntime": installed.onnxruntime,
        "qnn_sdk": toolchain.qnn_sdk,
        "buckets": [{k: b[k] for k in ("name", "qdq_sha256")} for b in inputs.buckets],
        "settings": compile_settings(inputs.config),
        "packaging": list(inputs.config.buckets.packaging),
        "code": pipeline_code_digest(CODE),
        "variants": variant_outcomes(built),
    }
    update_record(inputs.folder, "compile", section)


def write_bucket_report(
    config: Any, ctx_root: Path, toolchains: list[Any], targets: list[Any]
) -> Path:
    """report.md / report.json: one row per (toolchain, target, bucket), plus the sharing sizes."""
    from . import compile as compile_mod
    from .report import fmt, table, write_report

    rows, size_rows, notes, data = [], [], [], []
    for toolchain in toolchains:
        for target in targets:
            folder = ctx_root / toolchain.onnxruntime_qnn / target.name
            record = compile_mod._existing(folder)
            if record is None:
                continue
            details = read_buckets_file(folder)
            where = f"{target.name} / onnxruntime-qnn {toolchain.onnxruntime_qnn}"
            data.append(
                {
                    "toolchain": toolchain.onnxruntime_qnn,
                    "target": target.name,
                    "record": record.to_dict(),
                    "buckets": details,
                }
            )
            if record.error:
                notes.append(
                    f"- **{where}** {record.error.get('kind')} in step "
                    f"`{record.error.get('stage')}`: {record.error.get('message', '')[:800]}"
                )
            for problem in record.coverage.get("problems", []):
                notes.append(f"- **{where}** coverage: {problem}")
            if details.get("shared_load_probe"):
                notes.append(
                    f"- **{where}**: {details['shared_load_probe']}; validated with the "
                    f"{details.get('validated_with')} contexts."
                )
            loads = record.load.get("buckets", {})
            for name, info in details.get("buckets", {}).items():
                cov = info.get("coverage", {})
                val = info.get("validation", {})
                rows.append(
                    [
                        toolchain.onnxruntime_qnn,
                        target.name,
                        name,
                        "pass" if cov.get("passed") and val.get("passed") else "FAIL",
                        cov.get("qnn_partitions"),
                        len(cov.get("cpu_compute_nodes", [])),
                        fmt(val.get("worst_snr_db"), 1),
                        fmt(val.get("worst_snr_vs_float_db"), 1),
                        fmt((loads.get(name) or 0) * 1000, 1) if name in loads else "-",
                    ]
                )
            shared = details.get("shared") or {}
            standalone = details.get("standalone") or {}
            largest = max(standalone.get("bucket_bytes", {}).values(), default=0)
            size_rows.append(
                [
                    toolchain.onnxruntime_qnn,
                    target.name,
                    record.status,
                    _mb(shared.get("total_bytes")),
                    _mb(standalone.get("total_bytes")),
                    _mb(largest),
                    fmt(shared["total_bytes"] / largest, 2)
                    if shared.get("total_bytes") and largest
                    else "-",
                    fmt(record.load.get("all_s", 0) * 1000, 1) if record.load.get("all_s") else "-",
                ]
            )
    markdown = "\n".join(
        [
            f"# Compile report: {config.model.name} {config.model.version} (shape buckets)",
            "",
            "Every target's buckets are compiled in one process into one weight-shared QNN context "
            "(one _qnn.bin that every bucket's _ctx.onnx references), and each bucket also on its own "
            "(standalone). Coverage and validation per bucket: the ctx on QNN (HTP simulator here) vs "
            "the bucket's QDQ and float models on the CPU EP, over held-out samples padded into it.",
            "",
            table(
                [
                    "toolchain",
                    "target",
                    "bucket",
                    "result",
                    "partitions",
                    "CPU nodes",
                    "SNR vs QDQ dB",
                    "SNR vs float dB",
                    "load ctx ms",
                ],
                rows,
            )
            if rows
            else "No variant yet.",
            "",
            "## Sizes",
            "",
            table(
                [
                    "toolchain",
                    "target",
                    "status",
                    "shared total MB",
                    "standalone total MB",
                    "largest bucket alone MB",
                    "shared / largest",
                    "load all ms",
                ],
                size_rows,
            )
            if size_rows
            else "-",
            "",
            *(["## Notes", "", *notes, ""] if notes else []),
        ]
    )
    return write_report(ctx_root, markdown, {"model": config.model.name, "variants": data})


def _mb(value: Any) -> str:
    return f"{value / 1e6:.3f}" if isinstance(value, (int, float)) and value else "-"


if __name__ == "__main__":
    sys.exit(main())
