"""The child side of ``compile``: build, check, load, validate and time ONE variant.

``python -m pipeline.compile_worker JOB.json``. The parent runs this in a separate process
because the QNN EP can abort the whole process from native code (``terminate called ...``,
FACTS §4) or hang; here such a failure costs one variant, not the build. After every step the
worker rewrites the result file (``job["result"]``) with what it knows so far, so when it dies
the parent still knows the last step reached and everything measured before it.

The job is a JSON object written by ``pipeline.compile.make_job``; see ``Job`` for its fields.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from . import coverage as coverage_mod
from . import qnn
from .metrics import OutputComparison, worst_snr

JobT = TypeVar("JobT")
# ORT's own record of which EP runs which node: the coverage report is built from it.
RECORD_ASSIGNMENT = {"session.record_ep_graph_assignment_info": "1"}


@dataclass
class Job:
    """One variant: which files, for which chip, checked against which toolchain."""

    qdq: str
    float_model: str
    heldout: list[str]
    out_dir: str
    ctx_name: str
    result: str
    soc_model: int
    htp_arch: int
    qnn_sdk: str  # the pinned SDK the EPContext nodes must report
    backend_type: str = "htp"
    embed: bool = True
    log_severity: int = qnn.LOG_WARNING
    load_runs: int = 3
    max_partitions: int = 1
    allowed_cpu_ops: list[str] = field(default_factory=list)
    min_snr_db: float = 0.0
    validate_samples: int = 16
    seed: int = 0

    @classmethod
    def read(cls, path: Path) -> Job:
        return read_job(cls, path)

    @property
    def options(self) -> qnn.QnnOptions:
        return qnn.QnnOptions(self.backend_type, self.soc_model, self.htp_arch)


def read_job(cls: type[JobT], path: Path) -> JobT:
    """A job dataclass from its JSON file; a field it does not know is a parent/child mismatch."""
    data = json.loads(Path(path).read_text("utf-8"))
    unknown = sorted(set(data) - set(cls.__dataclass_fields__))
    if unknown:
        raise ValueError(f"{path}: unknown job field(s) {unknown}")
    return cls(**data)


class StepFailed(Exception):
    """A step could not produce what the next one needs; ``kind`` classifies it."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class Result:
    """The result file, rewritten atomically after every step."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"stage": "register", "status": "running"}
        self.save()

    def stage(self, name: str) -> None:
        self.data["stage"] = name
        self.save()
        print(f"[compile_worker] stage: {name}", flush=True)

    def save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str), encoding="utf-8")
        os.replace(tmp, self.path)


def _ort_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


def _classify(message: str, installed: qnn.InstalledQnn) -> tuple[str, str]:
    """(kind, message) for an onnxruntime exception text."""
    if qnn.looks_like_wrong_pair(message):
        return "toolchain", (
            f"the QNN EP could not be created: {installed.describe()} is not a working pair "
            f"(onnxruntime would otherwise fall back to CPU). {message}"
        )
    if "Failed to compose Qnn graph" in message:
        return "compose", message
    return "error", message


# -- steps -----------------------------------------------------------------------------------------


def compile_ctx(job: Job, ep: qnn.QnnEp, result: Result) -> Path:
    import onnxruntime as ort

    out_dir = Path(job.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = out_dir / job.ctx_name
    # Stale outputs must not pass for new ones: the EP names its .bin after the ctx file.
    for stale in [ctx, *out_dir.glob(f"{ctx.stem}*.bin")]:
        stale.unlink(missing_ok=True)
    options = ep.session_options(job.options, log_severity=job.log_severity)
    started = time.perf_counter()
    try:
        compiler = ort.ModelCompiler(
            options,
            job.qdq,
            embed_compiled_data_into_model=job.embed,
            flags=ort.OrtCompileApiFlags.ERROR_IF_NO_NODES_COMPILED,
        )
        compiler.compile_to_file(str(ctx))
    except Exception as exc:
        kind, message = _classify(_ort_error(exc), ep.installed)
        raise StepFailed(kind, message) from exc
    result.data["compile_time_s"] = time.perf_counter() - started
    if not ctx.is_file():
        raise StepFailed("error", f"ModelCompiler returned but wrote no {ctx.name}")
    return ctx


def verify_ctx(job: Job, ctx: Path) -> dict[str, Any]:
    """Prove the QNN toolchain compiled it, for the requested chip (each check explains itself)."""
    summary = qnn.read_model_summary(ctx)
    nodes = summary.nodes_of(coverage_mod.EP_CONTEXT)
    if not nodes:
        raise StepFailed(
            "verify",
            f"{ctx.name} holds no EPContext node: QNN compiled nothing (CPU fallback).",
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
    compat: dict[str, Any] = {}
    if not raw_compat:
        problems.append(f"model metadata has no {qnn.COMPATIBILITY_KEY}")
    else:
        try:
            info = qnn.parse_compatibility_info(raw_compat)
        except ValueError as exc:
            problems.append(str(exc))
        else:
            compat = {
                "format": info.format,
                "sdk": info.sdk,
                "htp_archs": list(info.htp_archs),
                "soc_models": list(info.soc_models),
            }
            problems += qnn.compatibility_problems(info, job.soc_model, job.htp_arch)
            if info.sdk and qnn.sdk_version(info.sdk) != job.qnn_sdk:
                problems.append(f"{qnn.COMPATIBILITY_KEY} names SDK {info.sdk}, not {job.qnn_sdk}")
    modes = sorted({int(n.attributes.get("embed_mode", 1)) for n in nodes})
    if modes != [1 if job.embed else 0]:
        problems.append(f"embed_mode {modes} but compile.embed = {job.embed}")
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
    return {
        "ep_context_nodes": len(nodes),
        "ep_sdk_version": raw_sdks[0],
        "qnn_sdk_version": sdks[0],
        "ep_compatibility_info": raw_compat,
        "compatibility": compat,
        "embed_mode": modes[0],
        "files": files,
        "sizes": {f: (ctx.parent / f).stat().st_size for f in files},
        "qdq_size": Path(job.qdq).stat().st_size,
    }


_NP_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int16)": np.int16,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(uint16)": np.uint16,
    "tensor(bool)": np.bool_,
}


def _specs(args: list[Any]) -> list[dict[str, Any]]:
    return [
        {
            "name": a.name,
            "shape": [d if isinstance(d, int) else -1 for d in a.shape],
            "dtype": np.dtype(_NP_TYPES.get(a.type, np.float32)).name,
        }
        for a in args
    ]


def load_ctx(job: Job, ep: qnn.QnnEp, ctx: Path) -> tuple[Any, dict[str, Any]]:
    """Create the ctx session on QNN and measure coverage from ORT's own node assignment."""
    import onnxruntime as ort

    options = ep.session_options(job.options, RECORD_ASSIGNMENT, job.log_severity)
    try:
        session = ort.InferenceSession(str(ctx), options)
    except Exception as exc:
        kind, message = _classify(_ort_error(exc), ep.installed)
        raise StepFailed(kind, message) from exc
    if qnn.EP_NAME not in session.get_providers():
        raise StepFailed(
            "toolchain",
            f"the ctx session runs on {session.get_providers()} only: the QNN EP did not start "
            f"({ep.installed.describe()}).",
        )
    graph = qnn.read_model_summary(ctx)
    report = coverage_mod.summarize(
        coverage_mod.assignment_from_session(session),
        graph,
        job.max_partitions,
        job.allowed_cpu_ops,
    )
    return session, report


def _feeds(job: Job, session: Any) -> Iterator[dict[str, np.ndarray]]:
    """Held-out samples from quantize, else seeded random feeds shaped like the inputs."""
    for path in job.heldout[: job.validate_samples or None]:
        with np.load(path, allow_pickle=False) as data:
            yield {k: data[k] for k in data.files}
    if job.heldout:
        return
    rng = np.random.default_rng(job.seed)
    for _ in range(max(1, min(job.validate_samples or 4, 4))):
        feeds = {}
        for spec in session.get_inputs():
            shape = [d if isinstance(d, int) and d > 0 else 1 for d in spec.shape]
            dtype = _NP_TYPES.get(spec.type, np.float32)
            if np.issubdtype(dtype, np.floating):
                feeds[spec.name] = rng.standard_normal(shape).astype(dtype)
            else:
                feeds[spec.name] = np.zeros(shape, dtype)
        yield feeds


def validate(job: Job, ctx_session: Any) -> dict[str, Any]:
    """ctx on QNN (the HTP simulator on x86_64) vs QDQ and float on the CPU EP."""
    import onnxruntime as ort

    cpu_options = ort.SessionOptions()
    cpu_options.log_severity_level = 3
    cpu = ["CPUExecutionProvider"]
    qdq = ort.InferenceSession(job.qdq, cpu_options, providers=cpu)
    flt = (
        ort.InferenceSession(job.float_model, cpu_options, providers=cpu)
        if job.float_model and Path(job.float_model).is_file()
        else None
    )
    names = [o.name for o in ctx_session.get_outputs()]
    float_names = [o.name for o in flt.get_outputs()] if flt else []
    # The quantizer keeps output names; if a float model names them otherwise, pair by position.
    float_map = dict(
        zip(names, float_names if set(names) - set(float_names) else names, strict=False)
    )
    vs_qdq, vs_float, qdq_vs_float = OutputComparison(), OutputComparison(), OutputComparison()
    for feeds in _feeds(job, ctx_session):
        got = dict(zip(names, ctx_session.run(names, feeds), strict=True))
        ref_qdq = dict(zip(names, qdq.run(names, feeds), strict=True))
        vs_qdq.add(ref_qdq, got)
        if flt is not None:
            ref_flt = dict(zip(names, flt.run([float_map[n] for n in names], feeds), strict=True))
            vs_float.add(ref_flt, got)
            qdq_vs_float.add(ref_flt, ref_qdq)
    summary = vs_qdq.summary()
    worst = worst_snr(summary)
    passed = job.min_snr_db <= 0 or worst >= job.min_snr_db
    return {
        "ctx_vs_qdq": summary,
        "ctx_vs_float": vs_float.summary(),
        "qdq_vs_float": qdq_vs_float.summary(),
        "worst_snr_db": worst,
        "worst_snr_vs_float_db": worst_snr(vs_float.summary()) if flt is not None else None,
        "samples": vs_qdq.samples,
        "samples_source": "heldout" if job.heldout else "random",
        "passed": passed,
        "gate": (
            f"worst ctx vs QDQ SNR >= {job.min_snr_db} dB" if job.min_snr_db > 0 else "no SNR gate"
        ),
    }


def benchmark(job: Job, ep: qnn.QnnEp, ctx: Path, result: Result) -> None:
    """Session creation time, min of N: QDQ with QNN compiling online vs the ctx model."""
    import onnxruntime as ort

    runs = max(1, job.load_runs)
    load: dict[str, Any] = {"runs": runs}
    result.data["load"] = load

    def best(model: str) -> float:
        times = []
        for _ in range(runs):
            options = ep.session_options(job.options, log_severity=job.log_severity)
            started = time.perf_counter()
            session = ort.InferenceSession(model, options)
            times.append(time.perf_counter() - started)
            if qnn.EP_NAME not in session.get_providers():
                raise RuntimeError(f"{Path(model).name} loaded without the QNN EP")
            del session
        return min(times)

    load["ctx_s"] = best(str(ctx))
    result.save()
    load["step"] = "qdq"  # an abort from here on is the online compile's, not the ctx's
    result.save()
    try:
        load["qdq_s"] = best(job.qdq)
        load["ratio"] = load["qdq_s"] / load["ctx_s"] if load["ctx_s"] > 0 else None
    except Exception as exc:
        load["qdq_error"] = _ort_error(exc)
    load.pop("step", None)
    result.save()


def register(qnn_sdk: str, result: Result) -> qnn.QnnEp:
    """The QNN EP of this interpreter, which must bundle the pinned QNN SDK ``qnn_sdk``."""
    result.stage("register")
    try:
        ep = qnn.find_qnn_ep()
    except Exception as exc:  # ToolchainError or an onnxruntime error
        raise StepFailed("toolchain", getattr(exc, "message", None) or _ort_error(exc)) from exc
    result.data["installed"] = {
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


def run(job: Job, result: Result) -> None:
    ep = register(job.qnn_sdk, result)
    result.stage("compile")
    ctx = compile_ctx(job, ep, result)
    result.stage("verify")
    result.data["ctx"] = verify_ctx(job, ctx)
    result.stage("load")
    session, coverage = load_ctx(job, ep, ctx)
    result.data["coverage"] = coverage
    result.data["inputs"] = _specs(session.get_inputs())
    result.data["outputs"] = _specs(session.get_outputs())
    result.stage("validate")
    try:
        result.data["validation"] = validate(job, session)
    except Exception as exc:
        kind, message = _classify(_ort_error(exc), ep.installed)
        raise StepFailed(kind, f"validation run failed: {message}") from exc
    del session
    result.stage("benchmark")
    benchmark(job, ep, ctx, result)
    result.data["status"] = "ok"
    result.stage("done")


def main(argv: list[str] | None = None) -> int:
    return child_main(argv, "pipeline.compile_worker", Job, run)


def child_main(
    argv: list[str] | None, module: str, job_type: Any, run_job: Callable[[Any, Result], None]
) -> int:
    """``python -m <module> JOB.json``: run the job; any failure is left in the result file."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(f"usage: python -m {module} JOB.json", file=sys.stderr)
        return 2
    job = job_type.read(Path(args[0]))
    result = Result(Path(job.result))
    try:
        run_job(job, result)
    except StepFailed as exc:
        result.data["status"] = "failed"
        result.data["error"] = {
            "stage": result.data["stage"],
            "kind": exc.kind,
            "message": exc.message,
        }
        result.save()
        return 1
    except Exception as exc:  # anything unforeseen still gets reported with its step
        result.data["status"] = "failed"
        result.data["error"] = {
            "stage": result.data["stage"],
            "kind": "error",
            "message": _ort_error(exc),
        }
        result.save()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
