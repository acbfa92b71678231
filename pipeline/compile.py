"""Stage 2: QDQ model -> QNN EP-context model per target chip and pinned QNN toolchain.

This process only plans, isolates and reports. Each variant (model, toolchain, target) is built
by ``pipeline.compile_worker`` in a child process with a timeout, because the QNN EP can abort
the process from native code or hang (FACTS §4); a dead child costs one variant, and the log it
leaves names the step, nodes, op types and QNN error codes.
"""

from __future__ import annotations

import argparse
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import qnn
from .config import EXAMPLE_CONFIGS, ModelConfig, load_config
from .errors import CompileError, GateError, ModelError, ToolchainError
from .fileio import atomic_dir, sha256_file, write_json
from .records import pipeline_code_digest, read_record, update_record
from .report import fmt, json_safe, table, write_report
from .targets import Target, get_target
from .toolchains import PINS_FILE, Pins, Toolchain, load_pins
from .variant import VARIANT_FILE, TensorSpec, VariantRecord

HELP = """\
Compile QDQ models into QNN EP-context models for each target chip and pinned QNN toolchain.

Reads <artifacts>/build/<model>/qdq.onnx, float.onnx and heldout/ (from `nox -s quantize`).
For every target in compile.targets, with the onnxruntime-qnn installed in this interpreter:
compiles with onnxruntime's ModelCompiler (ERROR_IF_NO_NODES_COMPILED), proves QNN compiled it
(EPContext nodes, ep_sdk_version = the pinned SDK, ep_compatibility_info = the requested
soc/arch), measures coverage (QNN partitions, nodes left on CPU), validates the ctx model on the
HTP simulator against the QDQ and float models on held-out samples, and times session creation
QDQ (online compile) vs ctx. Each variant runs in a child process with compile.timeout_s, so a
native abort or a hang is reported and the other variants still build.

Writes <artifacts>/build/<model>/ctx/<onnxruntime-qnn>/<target>/ with
<model>_<target>_qnn<SDK>_ctx.onnx (+ a .bin when compile.embed = false), variant.json and
compile.log, and <artifacts>/build/<model>/ctx/report.md + report.json over all toolchains.
A variant whose inputs did not change is skipped. Exits non-zero if any variant failed.

examples:
  python -m pipeline compile configs/example.toml
  python -m pipeline compile --toolchain 2.5.0 configs/example.toml   (in a 2.5.0 environment)
  nox -s "compile_ctx(qnn='2.5.0')"
"""

WORKER = "pipeline.compile_worker"
STAGE_MARKER = "[compile_worker] stage: "  # printed by the worker at each step
# Our modules whose code decides what a variant is: editing one rebuilds.
CODE = ("compile", "compile_worker", "coverage", "metrics", "qnn")
VALIDATE_SAMPLES = 16  # held-out samples run on the HTP simulator (slow for big graphs)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "configs", nargs="*", type=Path, help="model configs (default: the bundled examples)"
    )
    parser.add_argument(
        "--toolchain",
        metavar="VERSION",
        help="onnxruntime-qnn pin to build, e.g. 2.7.0; it must be the one installed here. "
        "Configs whose compile.toolchains do not include it are skipped. Default: the installed "
        "onnxruntime-qnn, which must be pinned.",
    )
    parser.add_argument("--artifacts", type=Path, default=Path("artifacts"), help="output root")
    parser.add_argument("--force", action="store_true", help="rebuild even if nothing changed")
    parser.add_argument(
        "--log-severity",
        type=int,
        default=qnn.LOG_WARNING,
        choices=range(5),
        help="onnxruntime log level in the child (0 verbose .. 3 error); default 2",
    )


# -- the toolchain -------------------------------------------------------------------------------


def resolve_toolchain(pins: Pins, requested: str | None, installed: qnn.InstalledQnn) -> Toolchain:
    """The pin to build with; it must be exactly what this interpreter has installed."""
    env_tip = (
        f"Run `nox -s \"compile_ctx(qnn='{requested or pins.default}')\"`, which installs the "
        "pinned pair in its own environment."
    )
    if requested:
        pin = pins.get(requested)  # ToolchainError listing the pins when unknown
    if not installed.present:
        raise ToolchainError(
            f"onnxruntime-qnn is not installed in {sys.executable}, so nothing can compile for "
            "the NPU.",
            tip=env_tip,
        )
    if requested:
        if installed.package_version != pin.onnxruntime_qnn:
            raise ToolchainError(
                f"--toolchain {requested} needs onnxruntime-qnn {pin.onnxruntime_qnn}, but "
                f"{sys.executable} has {installed.describe()}.",
                tip=env_tip,
            )
    else:
        found = pins.toolchains.get(installed.package_version)
        if found is None:
            raise ToolchainError(
                f"The installed onnxruntime-qnn {installed.package_version} is not pinned in "
                f"{PINS_FILE}. Pinned: {', '.join(pins.toolchains)}.",
                tip="Install a pinned pair (nox -s compile_ctx does) or add a verified row.",
            )
        pin = found
    if installed.onnxruntime != pin.onnxruntime:
        raise ToolchainError(
            f"onnxruntime-qnn {pin.onnxruntime_qnn} is not known to work with onnxruntime "
            f"{installed.onnxruntime or '(none)'}; pin {pin.onnxruntime} ({PINS_FILE.name}). "
            "A wrong pair does not fail: ORT falls back to CPU without an error.",
            tip=f"pip install onnxruntime=={pin.onnxruntime} beside onnxruntime-qnn=="
            f"{pin.onnxruntime_qnn}, or use `nox -s compile_ctx`.",
        )
    if installed.qnn_sdk and qnn.sdk_version(installed.qnn_sdk) != pin.qnn_sdk:
        raise ToolchainError(
            f"onnxruntime-qnn {pin.onnxruntime_qnn} here bundles QNN SDK {installed.qnn_sdk}, "
            f"but {PINS_FILE.name} says {pin.qnn_sdk}.",
            tip="Fix qnn_sdk in the pin to what the package reports.",
        )
    return pin


# -- one model -----------------------------------------------------------------------------------


@dataclass
class ModelInputs:
    """The quantize stage's outputs for one model, checked."""

    config: ModelConfig
    folder: Path
    qdq: Path
    float_model: Path
    heldout: list[Path]
    qdq_sha256: str
    float_sha256: str
    heldout_digest: str


def model_inputs(config: ModelConfig, artifacts: Path) -> ModelInputs:
    folder = Path(artifacts) / "build" / config.model.name
    qdq = folder / "qdq.onnx"
    run_quantize = f"Run `nox -s quantize -- {config.path}` first."
    if not qdq.is_file():
        raise ModelError(
            f"{config.model.name}: no QDQ model at {qdq}; the quantize stage has not run.",
            tip=run_quantize,
        )
    record = read_record(folder).get("quantize")
    if not record:
        raise ModelError(
            f"{config.model.name}: {folder / 'record.json'} has no quantize record, so {qdq} "
            "may be half-written.",
            tip=run_quantize,
        )
    qdq_sha = sha256_file(qdq)
    if record.get("qdq_sha256") and record["qdq_sha256"] != qdq_sha:
        raise ModelError(
            f"{config.model.name}: {qdq} changed after the quantize stage recorded it.",
            tip=run_quantize,
        )
    float_model = folder / "float.onnx"
    heldout = sorted((folder / "heldout").glob("sample_*.npz"))
    return ModelInputs(
        config=config,
        folder=folder,
        qdq=qdq,
        float_model=float_model,
        heldout=heldout,
        qdq_sha256=qdq_sha,
        float_sha256=sha256_file(float_model) if float_model.is_file() else "",
        heldout_digest=heldout_digest(heldout),
    )


def heldout_digest(paths: list[Path]) -> str:
    """One digest over the held-out samples' names and contents: other samples, other variant."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode())
        digest.update(sha256_file(path).encode())
    return digest.hexdigest()


def compile_settings(config: ModelConfig) -> dict[str, Any]:
    """The settings that shape one variant (not the lists of targets and toolchains)."""
    settings = dataclasses.asdict(config.compile)
    settings.pop("targets")
    settings.pop("toolchains")
    return settings


def variant_digest(
    inputs: ModelInputs, toolchain: Toolchain, onnxruntime: str, target: Target
) -> str:
    """Everything that went into a variant; equal digests mean the variant can be reused."""
    data = {
        "model": dataclasses.asdict(inputs.config.model),
        "qdq_sha256": inputs.qdq_sha256,
        "float_sha256": inputs.float_sha256,
        "heldout": inputs.heldout_digest,
        "compile": compile_settings(inputs.config),
        "toolchain": dataclasses.asdict(toolchain),
        "onnxruntime": onnxruntime,
        "target": dataclasses.asdict(target),
        "code": pipeline_code_digest(CODE),
        "validate_samples": VALIDATE_SAMPLES,
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def ctx_file_name(model: str, target: Target, toolchain: Toolchain) -> str:
    return f"{model}_{target.name}_qnn{toolchain.qnn_sdk}_ctx.onnx"


def make_job(
    inputs: ModelInputs,
    toolchain: Toolchain,
    target: Target,
    out_dir: Path,
    result: Path,
    log_severity: int,
) -> dict[str, Any]:
    settings = inputs.config.compile
    return {
        "qdq": str(inputs.qdq.resolve()),
        "float_model": str(inputs.float_model.resolve()) if inputs.float_model.is_file() else "",
        "heldout": [str(p.resolve()) for p in inputs.heldout],
        "out_dir": str(out_dir.resolve()),
        "ctx_name": ctx_file_name(inputs.config.model.name, target, toolchain),
        "result": str(result.resolve()),
        "soc_model": target.soc_model,
        "htp_arch": target.htp_arch,
        "qnn_sdk": toolchain.qnn_sdk,
        "embed": settings.embed,
        "log_severity": log_severity,
        "load_runs": settings.load_runs,
        "max_partitions": settings.max_partitions,
        "allowed_cpu_ops": list(settings.allowed_cpu_ops),
        "min_snr_db": settings.min_snr_db,
        "validate_samples": VALIDATE_SAMPLES,
    }


# -- the child process -----------------------------------------------------------------------------


@dataclass
class ChildOutcome:
    result: dict[str, Any]
    returncode: int | None
    timed_out: bool
    seconds: float
    log: str


def run_child(
    job: dict[str, Any],
    work: Path,
    log_path: Path,
    timeout_s: float,
    on_tick: Callable[[str, float], None] | None = None,
    worker: str = WORKER,
) -> ChildOutcome:
    """Run the worker module on ``job``; kill its whole process group on timeout."""
    job_path = work / "job.json"
    job_path.write_text(json.dumps(job, indent=2), encoding="utf-8")
    result_path = Path(job["result"])
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    started = time.monotonic()
    timed_out = False
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", worker, str(job_path)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group, so a kill takes its children too
        )
        try:
            while True:
                try:
                    proc.wait(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    elapsed = time.monotonic() - started
                    if on_tick:
                        on_tick(_read_json(result_path).get("stage", "start"), elapsed)
                    if elapsed > timeout_s:
                        timed_out = True
                        _kill_group(proc)
                        break
        except BaseException:  # Ctrl-C: leave no orphan compiling in the background
            _kill_group(proc)
            raise
    log_text = log_path.read_text("utf-8", errors="replace") if log_path.is_file() else ""
    return ChildOutcome(
        result=_read_json(result_path),
        returncode=proc.returncode,
        timed_out=timed_out,
        seconds=time.monotonic() - started,
        log=log_text,
    )


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text("utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}


def _signal_name(returncode: int | None) -> str:
    if returncode is None or returncode >= 0:
        return f"exit code {returncode}"
    try:
        return f"signal {signal.Signals(-returncode).name}"
    except ValueError:
        return f"signal {-returncode}"


def interpret(outcome: ChildOutcome, timeout_s: float) -> tuple[str, dict[str, Any]]:
    """(status, error) from what the child left: its result file, exit status and log."""
    result = outcome.result
    stage = result.get("stage", "start")
    # Facts from the failing step's own output; the whole log only adds context.
    facts = qnn.parse_ep_log(stage_log(outcome.log, stage))
    load = result.get("load", {})
    died = outcome.timed_out or result.get("status") not in ("ok", "failed")
    if died and stage == "benchmark" and load.get("step") == "qdq" and "validation" in result:
        # The ctx model compiled, loaded and validated; only the QDQ model's online compile (the
        # benchmark's reference) died. The artifact is fine; the load ratio is unknown.
        why = "timed out" if outcome.timed_out else _describe_death(outcome, facts)
        load["qdq_error"] = f"creating the QDQ session with QNN (online compile) {why}"
        load.pop("step", None)
        result["load"] = load
        return "ok", {}
    if result.get("status") == "ok" and not outcome.timed_out:
        return "ok", {}
    if outcome.timed_out:
        error = {
            "stage": stage,
            "kind": "timeout",
            "message": f"no result after {timeout_s:g} s in step '{stage}' (hang, or a model "
            "too big for compile.timeout_s)",
        }
    elif result.get("status") == "failed":
        error = dict(result.get("error", {}))
        message = error.get("message", "")
        if "Failed to compose Qnn graph" in message or "Failed to compose Qnn graph" in outcome.log:
            error["kind"] = "compose"
    else:
        error = {
            "stage": stage,
            "kind": "abort" if facts.abort or "terminate called" in outcome.log else "crash",
            "message": f"the worker died in step '{stage}': {_describe_death(outcome, facts)}",
        }
    error.update(facts.to_dict())
    rejected = qnn.parse_ep_log(outcome.log).rejected
    if rejected:
        error["rejected_by_qnn"] = rejected
        shown = ", ".join(f"{r['node']} ({r['op_type']}, code {r['code']})" for r in rejected[:8])
        more = f" and {len(rejected) - 8} more" if len(rejected) > 8 else ""
        error["rejected_earlier"] = f"QNN declined {shown}{more}, leaving them to the CPU"
    return "failed", error


def stage_log(log: str, stage: str) -> str:
    """The part of the worker's log written during ``stage`` (its last run)."""
    marker = f"{STAGE_MARKER}{stage}"
    lines = log.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == marker]
    if not starts:
        return log
    segment = []
    for line in lines[starts[-1] + 1 :]:
        if line.startswith(STAGE_MARKER):
            break
        segment.append(line)
    return "\n".join(segment)


def _describe_death(outcome: ChildOutcome, facts: qnn.LogFacts) -> str:
    how = _signal_name(outcome.returncode)
    if facts.abort:
        return f"native abort ({how}): terminate called, what(): {facts.abort}"
    last = [line for line in outcome.log.splitlines() if line.strip()][-3:]
    return f"{how}; last output: {' / '.join(last)[:400]}"


# -- building variants -------------------------------------------------------------------------------


@dataclass
class Built:
    record: VariantRecord
    folder: Path
    skipped: bool
    seconds: float = 0.0


def _existing(folder: Path) -> VariantRecord | None:
    try:
        record = VariantRecord.read(folder)
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if any(not (folder / f).is_file() for f in record.files):
        return None
    return record


def new_record(
    config: ModelConfig,
    toolchain: Toolchain,
    installed: qnn.InstalledQnn,
    target: Target,
    digest: str,
    embed_mode: int,
) -> VariantRecord:
    """The record of a variant about to be built; the worker's result fills in the rest."""
    return VariantRecord(
        model=config.model.name,
        model_version=config.model.version,
        toolchain=toolchain.onnxruntime_qnn,
        onnxruntime=installed.onnxruntime,
        target=target.name,
        soc_model=target.soc_model,
        htp_arch=target.htp_arch,
        embed_mode=embed_mode,
        inputs_digest=digest,
    )


def build_variant(
    inputs: ModelInputs,
    toolchain: Toolchain,
    installed: qnn.InstalledQnn,
    target: Target,
    ctx_root: Path,
    force: bool,
    log_severity: int,
    progress: Progress,
) -> Built:
    config = inputs.config
    folder = ctx_root / toolchain.onnxruntime_qnn / target.name
    digest = variant_digest(inputs, toolchain, installed.onnxruntime, target)
    existing = _existing(folder)
    if not force and existing is not None and existing.inputs_digest == digest:
        return Built(existing, folder, skipped=True)
    record = new_record(
        config, toolchain, installed, target, digest, 1 if config.compile.embed else 0
    )
    work = Path(tempfile.mkdtemp(prefix=".work-", dir=ctx_root))
    try:
        # The whole variant folder is replaced at once: stale files from an earlier build (an old
        # .bin after switching to embed mode, a ctx beside a now-failed record) cannot survive.
        with atomic_dir(folder) as out:
            job = make_job(inputs, toolchain, target, out, work / "result.json", log_severity)
            outcome = run_child(
                job,
                work,
                out / "compile.log",
                config.compile.timeout_s,
                on_tick=progress.tick,
            )
            status, error = interpret(outcome, config.compile.timeout_s)
            _fill(record, outcome.result, status, error, out)
            write_json(out / VARIANT_FILE, json_safe(record.to_dict()))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return Built(record, folder, skipped=False, seconds=outcome.seconds)


def fill_record(
    record: VariantRecord, result: dict[str, Any], status: str, error: dict[str, Any]
) -> None:
    """The record fields every kind of variant takes from its worker's result file."""
    ctx = result.get("ctx", {})
    record.status = status
    record.error = error
    record.compile_time_s = float(result.get("compile_time_s", 0.0))
    record.qnn_sdk_version = ctx.get("qnn_sdk_version", "")
    record.ep_sdk_version = ctx.get("ep_sdk_version", "")
    record.ep_compatibility_info = ctx.get("ep_compatibility_info", "")
    record.embed_mode = int(ctx.get("embed_mode", record.embed_mode))
    record.inputs = [TensorSpec(**t) for t in result.get("inputs", [])]
    record.outputs = [TensorSpec(**t) for t in result.get("outputs", [])]
    record.coverage = result.get("coverage", {})
    record.validation = result.get("validation", {})


def present_files(out: Path, files: list[str], recursive: bool = False) -> list[str]:
    """``files`` that exist in ``out``; with none listed (the worker failed before its checks),
    what the compiler left there (below it when ``recursive``), ctx first."""
    if not files:
        found = out.rglob("*") if recursive else out.iterdir()
        files = sorted(
            (str(p.relative_to(out)) for p in found if p.suffix in (".onnx", ".bin")),
            key=lambda name: (not name.endswith("_ctx.onnx"), name),
        )
    return [f for f in files if (out / f).is_file()]


def _fill(
    record: VariantRecord, result: dict[str, Any], status: str, error: dict[str, Any], out: Path
) -> None:
    ctx = result.get("ctx", {})
    fill_record(record, result, status, error)
    record.files = present_files(out, ctx.get("files") or [])
    sizes = {f: (out / f).stat().st_size for f in record.files}
    record.load = {**result.get("load", {}), "sizes": sizes, "qdq_size": ctx.get("qdq_size")}


# -- progress ----------------------------------------------------------------------------------------


class Progress:
    """A tqdm bar over variants when tqdm is installed, else one line per step."""

    def __init__(self, total: int, desc: str) -> None:
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        if not sys.stderr.isatty():  # logs (nox, CI) get plain lines, not redrawn bars
            tqdm = None
        self.bar = tqdm(total=total, desc=desc, unit="variant", file=sys.stderr) if tqdm else None
        self.label = ""
        self.last = ""

    def start(self, label: str) -> None:
        self.label = label
        self.last = ""
        self.tick("start", 0.0)

    def tick(self, stage: str, elapsed: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"{self.label}: {stage} {elapsed:.0f}s", refresh=True)
        elif stage != self.last:
            print(f"  {self.label}: {stage}", file=sys.stderr, flush=True)
        self.last = stage

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def describe(built: Built) -> str:
    r = built.record
    head = f"{r.model} {r.target} onnxruntime-qnn {r.toolchain}"
    if built.skipped:
        head += " (unchanged, skipped)"
    if r.status != "ok":
        e = r.error
        text = f"FAILED {head}: {e.get('kind', 'error')} in {e.get('stage', '?')}: "
        text += e.get("message", "")[:600]
        extra = [
            f"{key}: {', '.join(str(v) for v in e[key][:8])}"
            for key in ("nodes", "op_types", "qnn_error_codes")
            if e.get(key)
        ]
        if e.get("rejected_earlier"):
            extra.append(e["rejected_earlier"])
        return text + (" [" + "; ".join(extra) + "]" if extra else "")
    c, v, load = r.coverage, r.validation, r.load
    verdict = "ok" if r.passed else "FAILED gate"
    text = (
        f"{verdict} {head}: {c.get('qnn_partitions')} QNN partition(s), "
        f"{len(c.get('cpu_compute_nodes', []))} CPU node(s), "
        f"ctx vs QDQ {fmt(v.get('worst_snr_db'), 1)} dB, "
        f"load {fmt(load.get('ratio'), 1)}x faster than QDQ"
    )
    problems = list(c.get("problems", []))
    if v and not v.get("passed"):
        problems.append(f"validation: {v.get('gate')} (worst {fmt(v.get('worst_snr_db'), 1)} dB)")
    return text + (" -- " + "; ".join(problems) if problems else "")


# -- report ------------------------------------------------------------------------------------------


def _row(record: VariantRecord) -> dict[str, Any]:
    c, v, load = record.coverage, record.validation, record.load
    sizes = load.get("sizes", {})
    ctx_file = record.files[0] if record.files else ""
    return {
        "toolchain": record.toolchain,
        "onnxruntime": record.onnxruntime,
        "qnn_sdk": record.qnn_sdk_version,
        "target": record.target,
        "soc_model": record.soc_model,
        "htp_arch": record.htp_arch,
        "status": record.status,
        "passed": record.passed,
        "qnn_partitions": c.get("qnn_partitions"),
        "cpu_compute_nodes": c.get("cpu_compute_nodes", []),
        "cpu_ops": c.get("cpu_ops", {}),
        "cpu_io_qdq_nodes": c.get("cpu_io_qdq_nodes"),
        "coverage_passed": c.get("passed"),
        "coverage_problems": c.get("problems", []),
        "snr_ctx_vs_qdq_db": v.get("worst_snr_db"),
        "snr_ctx_vs_float_db": v.get("worst_snr_vs_float_db"),
        "validation": {k: v.get(k) for k in ("ctx_vs_qdq", "ctx_vs_float", "qdq_vs_float")},
        "validation_samples": v.get("samples"),
        "validation_passed": v.get("passed"),
        "ctx_file": ctx_file,
        "ctx_bytes": sizes.get(ctx_file),
        "bin_bytes": sum(n for f, n in sizes.items() if f.endswith(".bin")) or None,
        "qdq_bytes": load.get("qdq_size"),
        "embed_mode": record.embed_mode,
        "compile_s": record.compile_time_s,
        "load_qdq_s": load.get("qdq_s"),
        "load_ctx_s": load.get("ctx_s"),
        "load_ratio": load.get("ratio"),
        "load_note": load.get("qdq_error", ""),
        "ep_sdk_version": record.ep_sdk_version,
        "ep_compatibility_info": record.ep_compatibility_info,
        "error": record.error,
    }


def _num(value: Any, pattern: str) -> str:
    """A table cell: fixed format, ``inf`` for exact matches, ``-`` when unknown."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return "inf" if value == float("inf") else pattern.format(value)
    return fmt(value)


def _ms(seconds: Any) -> float | None:
    return seconds * 1000.0 if isinstance(seconds, (int, float)) else None


def _worst(section: dict[str, Any], key: str, pick: Callable[..., float]) -> float | None:
    values = [o[key] for o in (section or {}).values() if isinstance(o, dict) and key in o]
    return pick(values) if values else None


def write_model_report(
    config: ModelConfig, ctx_root: Path, toolchains: list[Toolchain], targets: list[Target]
) -> Path:
    """report.md / report.json over every variant on disk that the config asks for."""
    rows = []
    for toolchain in toolchains:
        for target in targets:
            record = _existing(ctx_root / toolchain.onnxruntime_qnn / target.name)
            if record is not None:
                rows.append(_row(record))
    headers = [
        "toolchain",
        "QNN SDK",
        "target",
        "result",
        "partitions",
        "CPU nodes",
        "SNR vs QDQ dB",
        "SNR vs float dB",
        "max abs vs QDQ",
        "cosine vs QDQ",
        "ctx MB",
        "compile s",
        "load QDQ ms",
        "load ctx ms",
        "load ratio",
    ]
    lines = []
    for row in rows:
        ops = ", ".join(f"{op} x{n}" for op, n in row["cpu_ops"].items()) or "0"
        result = "pass" if row["passed"] else ("FAIL gate" if row["status"] == "ok" else "FAILED")
        vs_qdq = row["validation"].get("ctx_vs_qdq") or {}
        size = (row["ctx_bytes"] or 0) + (row["bin_bytes"] or 0)
        lines.append(
            [
                row["toolchain"],
                row["qnn_sdk"] or "-",
                row["target"],
                result,
                row["qnn_partitions"],
                ops,
                _num(row["snr_ctx_vs_qdq_db"], "{:.1f}"),
                _num(row["snr_ctx_vs_float_db"], "{:.1f}"),
                _num(_worst(vs_qdq, "max_abs", max), "{:.3g}"),
                _num(_worst(vs_qdq, "cosine", min), "{:.5f}"),
                _num(size / 1e6 if size else None, "{:.3f}"),
                _num(row["compile_s"] if row["status"] == "ok" else None, "{:.2f}"),
                _num(_ms(row["load_qdq_s"]), "{:.1f}"),
                _num(_ms(row["load_ctx_s"]), "{:.1f}"),
                _num(row["load_ratio"], "{:.1f}"),
            ]
        )
    notes = []
    for row in rows:
        where = f"{row['target']} / onnxruntime-qnn {row['toolchain']}"
        error = row["error"]
        if error:
            detail = "; ".join(
                f"{k}: {', '.join(str(x) for x in error[k][:10])}"
                for k in ("nodes", "op_types", "qnn_error_codes")
                if error.get(k)
            )
            if error.get("rejected_earlier"):
                detail += ("; " if detail else "") + error["rejected_earlier"]
            notes.append(
                f"- **{where}** {error.get('kind')} in step `{error.get('stage')}`: "
                f"{error.get('message', '')[:800]}" + (f" ({detail})" if detail else "")
            )
        for problem in row["coverage_problems"]:
            notes.append(f"- **{where}** coverage: {problem}")
        if row["validation_passed"] is False:
            notes.append(f"- **{where}** validation below the gate (compile.min_snr_db)")
        if row["load_note"]:
            notes.append(f"- **{where}** load benchmark: {row['load_note']}")
    settings = config.compile
    quantize = read_record(ctx_root.parent).get("quantize", {})
    quantize_note = (
        [
            "Note: this QDQ model did not pass the quantize stage's own gate "
            "(quantization.min_snr_db, see ../report.md).",
            "",
        ]
        if quantize.get("status", "ok") != "ok"
        else []
    )
    markdown = "\n".join(
        [
            f"# Compile report: {config.model.name} {config.model.version}",
            "",
            *quantize_note,
            f"Gates: all compute nodes on QNN in <= {settings.max_partitions} partition(s)"
            + (
                f", allowed on CPU: {', '.join(settings.allowed_cpu_ops)}"
                if settings.allowed_cpu_ops
                else ""
            )
            + (
                f"; worst ctx vs QDQ SNR >= {settings.min_snr_db} dB"
                if settings.min_snr_db > 0
                else "; no SNR gate"
            )
            + ". Graph-I/O Q/DQ left on CPU by offload_graph_io_quantization are not counted.",
            "Validation: the ctx model on the QNN HTP backend (the x86_64 HTP simulator here) vs "
            "the QDQ and the float model on the CPU EP, over held-out samples. Load: min of "
            f"{settings.load_runs} session creations, QDQ with QNN compiling online vs ctx.",
            "",
            table(headers, lines) if lines else "No variant has been built yet.",
            "",
            *(["## Problems", "", *notes, ""] if notes else []),
        ]
    )
    data = {
        "model": config.model.name,
        "version": config.model.version,
        "quantize_status": quantize.get("status"),
        "gates": {
            "max_partitions": settings.max_partitions,
            "allowed_cpu_ops": settings.allowed_cpu_ops,
            "min_snr_db": settings.min_snr_db,
        },
        "variants": rows,
    }
    return write_report(ctx_root, markdown, data)


# -- the stage ---------------------------------------------------------------------------------------


def _remove_stale(
    ctx_root: Path, toolchains: list[Toolchain], current: Toolchain, targets: list[Target]
) -> None:
    """Variants the config no longer asks for must not linger beside the ones it does."""
    if not ctx_root.is_dir():
        return
    wanted_toolchains = {t.onnxruntime_qnn for t in toolchains}
    for path in ctx_root.iterdir():
        if path.is_dir() and not path.name.startswith(".") and path.name not in wanted_toolchains:
            shutil.rmtree(path, ignore_errors=True)
    folder = ctx_root / current.onnxruntime_qnn
    if folder.is_dir():
        names = {t.name for t in targets}
        for path in folder.iterdir():
            if path.is_dir() and path.name not in names:
                shutil.rmtree(path, ignore_errors=True)


def compile_model(
    config: ModelConfig,
    artifacts: Path,
    pins: Pins,
    toolchain: Toolchain,
    installed: qnn.InstalledQnn,
    force: bool = False,
    log_severity: int = qnn.LOG_WARNING,
    out: Callable[[str], None] = print,
) -> list[Built]:
    """Build every target of one config with this toolchain; returns the variants (or [])."""
    targets = list({t.name: t for t in (get_target(n) for n in config.compile.targets)}.values())
    wanted = pins.selected(config.compile.toolchains)
    if toolchain not in wanted:
        out(
            f"{config.model.name}: skipped for onnxruntime-qnn {toolchain.onnxruntime_qnn}; "
            f"compile.toolchains asks for {', '.join(t.onnxruntime_qnn for t in wanted)}."
        )
        return []
    if config.buckets.enabled:  # all buckets of a target in one weight-shared context
        from . import bucket_compile as bc

        inputs: Any = bc.bucket_inputs(config, artifacts)
        build: Callable[..., Built] = bc.build_bucket_variant
        describe_one: Callable[[Built], str] = bc.describe_bucketed
        record_builds: Callable[..., None] = bc.update_build_record
        report_builds: Callable[..., Path] = bc.write_bucket_report
    else:
        inputs = model_inputs(config, artifacts)
        build, describe_one = build_variant, describe
        record_builds, report_builds = _update_build_record, write_model_report
    ctx_root = inputs.folder / "ctx"
    ctx_root.mkdir(parents=True, exist_ok=True)
    _remove_stale(ctx_root, wanted, toolchain, targets)
    progress = Progress(len(targets), f"{config.model.name} qnn {toolchain.onnxruntime_qnn}")
    built: list[Built] = []
    try:
        for target in targets:
            progress.start(target.name)
            result = build(
                inputs, toolchain, installed, target, ctx_root, force, log_severity, progress
            )
            built.append(result)
            progress.write(describe_one(result))
            progress.advance()
    finally:
        progress.close()
    record_builds(inputs, toolchain, installed, built)
    report = report_builds(config, ctx_root, wanted, targets)
    out(f"{config.model.name}: compile report -> {report}")
    return built


def _update_build_record(
    inputs: ModelInputs, toolchain: Toolchain, installed: qnn.InstalledQnn, built: list[Built]
) -> None:
    """The build record gains this toolchain's compile inputs and outcome."""
    section = dict(read_record(inputs.folder).get("compile", {}))
    section[toolchain.onnxruntime_qnn] = {
        "onnxruntime": installed.onnxruntime,
        "qnn_sdk": toolchain.qnn_sdk,
        "qdq_sha256": inputs.qdq_sha256,
        "float_sha256": inputs.float_sha256,
        "heldout_digest": inputs.heldout_digest,
        "settings": compile_settings(inputs.config),
        "code": pipeline_code_digest(CODE),
        "variants": variant_outcomes(built),
    }
    update_record(inputs.folder, "compile", section)


def variant_outcomes(built: list[Built]) -> dict[str, Any]:
    """Per target, what the build record keeps of a variant: its inputs digest and its outcome."""
    return {
        b.record.target: {
            "inputs_digest": b.record.inputs_digest,
            "status": b.record.status,
            "passed": b.record.passed,
        }
        for b in built
    }


def run(args: argparse.Namespace) -> int:
    pins = load_pins()
    configs = [load_config(p, check_files=False) for p in (args.configs or EXAMPLE_CONFIGS)]
    for config in configs:  # bad targets and unpinned toolchains fail before any work
        for name in config.compile.targets:
            get_target(name)
        pins.selected(config.compile.toolchains)
    installed = qnn.installed_qnn()
    toolchain = resolve_toolchain(pins, args.toolchain, installed)
    print(
        f"Compiling with onnxruntime-qnn {toolchain.onnxruntime_qnn} (QNN SDK "
        f"{toolchain.qnn_sdk}) and onnxruntime {installed.onnxruntime}",
        flush=True,
    )
    failed: list[Built] = []
    for config in configs:
        built = compile_model(
            config,
            args.artifacts,
            pins,
            toolchain,
            installed,
            force=args.force,
            log_severity=args.log_severity,
        )
        failed += [b for b in built if not b.record.passed]
    if failed:
        lines = [describe(b) for b in failed]
        crashed = any(b.record.status != "ok" for b in failed)
        error = CompileError if crashed else GateError
        raise error(
            f"{len(failed)} variant(s) failed:\n  " + "\n  ".join(lines),
            tip="Details per variant are in <artifacts>/build/<model>/ctx/report.md and each "
            "variant's compile.log.",
        )
    return 0
