"""Stage 2: QDQ models -> QNN EP-context variants, one per target chip and pinned QNN toolchain.

This process only plans, isolates and records. Each variant (all buckets of one model, for one
target, with one toolchain) is built by ``pipeline.compile.worker`` in a child process with a
timeout (``pipeline.compile.child``), because the QNN EP can abort the process from native code
or hang (FACTS §4); a dead child costs one variant, and the log it leaves names the step, nodes,
op types and QNN error codes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from qnn_ctx_runtime import qnn
from qnn_ctx_runtime.targets import Target, get_target
from qnn_ctx_runtime.toolchains import Toolchain, Toolchains

from ..core.config import ModelConfig
from ..core.errors import ModelError, PipelineError, ToolchainError
from ..core.fileio import atomic_dir, sha256_file, write_text
from ..core.layout import (
    CLOSED_LOOP_BUDGET_S,
    CLOSED_LOOP_WINDOWS,
    ENOUGH_MARGIN_DB,
    GPU_TARGET,
    HTP_BUDGET_S,
    REPORT_JSON,
    VALIDATE_SAMPLES,
    ModelPaths,
    VariantPaths,
    samples_in,
    spread,
)
from ..core.lock import locked
from ..core.progress import Progress
from ..core.records import (
    BucketArtifacts,
    BuiltFrom,
    QuantizeRecord,
    VariantRecord,
    code_digest,
    folder_digest,
    read_record,
    write_record,
)
from ..report_html import preload_plotting, write_html_reports
from . import coverage as coverage_mod
from .child import ChildOutcome, interpret, run_child
from .job import BucketJob, CompileJob
from .report import closed_loop_note, describe, write_model_report

# The builder's code that decides what a variant is: editing it rebuilds.
CODE = ("core", "compile")
# A pre-quantized model's ctx may land this far below its own rounding floor (the HTP rounds
# ties half up where onnxruntime rounds them to even) before validation calls it wrong.
ROUNDING_MARGIN_DB = 3.0


# -- the toolchain -------------------------------------------------------------------------------


def resolve_toolchain(
    table: Toolchains, requested: str | None, installed: qnn.InstalledQnn
) -> Toolchain:
    """The pin to build with; it must be exactly what this interpreter has installed."""
    env_tip = (
        f"Run `nox -s \"compile_ctx(qnn='{requested or table.default}')\"`, which installs the "
        "pinned pair in its own environment."
    )
    pin = table.get(requested) if requested else None  # ToolchainError listing the pins
    if not installed.present:
        raise ToolchainError(
            f"onnxruntime-qnn is not installed in {sys.executable}, so nothing can compile for "
            "the NPU.",
            tip=env_tip,
        )
    if pin is not None:
        if installed.package_version != pin.onnxruntime_qnn:
            raise ToolchainError(
                f"--toolchain {requested} needs onnxruntime-qnn {pin.onnxruntime_qnn}, but "
                f"{sys.executable} has {installed.describe()}.",
                tip=env_tip,
            )
    else:
        pin = table.pinned.get(installed.package_version)
        if pin is None:
            raise ToolchainError(
                f"The installed onnxruntime-qnn {installed.package_version} is not pinned in "
                f"{table.source}. Pinned: {', '.join(table.pinned)}.",
                tip="Install a pinned pair (nox -s compile_ctx does) or add a verified row.",
            )
    if installed.onnxruntime != pin.onnxruntime:
        raise ToolchainError(
            f"onnxruntime-qnn {pin.onnxruntime_qnn} is not known to work with onnxruntime "
            f"{installed.onnxruntime or '(none)'}; the pin is {pin.onnxruntime} ({table.source}). "
            "A wrong pair does not fail: ORT falls back to CPU without an error.",
            tip=f"pip install onnxruntime=={pin.onnxruntime} beside onnxruntime-qnn=="
            f"{pin.onnxruntime_qnn}, or use `nox -s compile_ctx`.",
        )
    if installed.qnn_sdk and qnn.sdk_version(installed.qnn_sdk) != pin.qnn_sdk:
        raise ToolchainError(
            f"onnxruntime-qnn {pin.onnxruntime_qnn} here bundles QNN SDK {installed.qnn_sdk}, "
            f"but {table.source} says {pin.qnn_sdk}.",
            tip="Fix qnn_sdk in the table to what the package reports.",
        )
    return pin


# -- what the quantize stage left ------------------------------------------------------------------


@dataclass(frozen=True)
class ModelInputs:
    """The quantize stage's outputs for one model, checked against its record."""

    config: ModelConfig
    paths: ModelPaths
    record: QuantizeRecord
    heldout: dict[str, list[Path]]  # bucket -> held-out sample files
    built_from: BuiltFrom

    @property
    def buckets(self) -> list[BucketArtifacts]:
        return self.record.buckets


def _failed_quantize(paths: ModelPaths) -> str:
    """The error of a quantize run that stopped on one (its report.json says so), else ''."""
    try:
        report = json.loads((paths.root / "report.json").read_text("utf-8"))
    except (OSError, ValueError):
        return ""
    if not isinstance(report, dict) or report.get("status") != "failed":
        return ""
    return str(report.get("error", "no message"))[:300]


def model_inputs(config: ModelConfig, artifacts: Path) -> ModelInputs:
    """The QDQ models of every bucket, each proven to be the one the quantize record names."""
    paths = ModelPaths.of(artifacts, config.model.name)
    run_quantize = (
        f"Run the quantize stage first: `nox -s quantize -- {config.path}` (or `python -m "
        f"pipeline quantize {config.path} --artifacts {artifacts}`)."
    )
    record, why = read_record(QuantizeRecord, paths.record)
    failed = _failed_quantize(paths)
    if record is None and failed:
        raise ModelError(
            f"{config.model.name}: the last quantize run stopped with an error ({failed}); "
            f"nothing was recorded to compile. Its report: {paths.report}.",
            tip="Fix what the report says, then run the quantize stage again. " + run_quantize,
        )
    if record is None:
        raise ModelError(
            f"{config.model.name}: no usable quantize record ({'; '.join(why)}), so the QDQ "
            "models may be missing or half-written.",
            tip=run_quantize,
        )
    heldout, qdq_sha, float_sha, held_sha = {}, {}, {}, {}
    for bucket in record.buckets:
        where = paths.bucket(bucket.name)
        if not where.qdq.is_file():
            raise ModelError(f"{config.model.name}: {where.qdq} is missing.", tip=run_quantize)
        actual = sha256_file(where.qdq)
        if actual != bucket.qdq_sha256:
            raise ModelError(
                f"{config.model.name}: {where.qdq} changed after the quantize stage recorded it.",
                tip=run_quantize,
            )
        heldout[bucket.name] = samples_in(where.heldout)
        qdq_sha[bucket.name] = actual
        float_sha[bucket.name] = bucket.float_sha256
        held_sha[bucket.name] = folder_digest(where.heldout, "sample_*.npz")
    built_from = BuiltFrom(
        source_sha256=record.inputs.source_sha256,
        config_digest=record.inputs.config_digest,
        qdq_sha256=qdq_sha,
        float_sha256=float_sha,
        heldout_digest=held_sha,
        compile_digest=config.compile_digest(),
    )
    return ModelInputs(config, paths, record, heldout, built_from)


# -- one variant -----------------------------------------------------------------------------------


def compile_settings(config: ModelConfig, multi: bool) -> dict[str, object]:
    """The settings that shape one variant (not the lists of targets and toolchains)."""
    settings = dataclasses.asdict(config.compile)
    settings.pop("targets")
    settings.pop("toolchains")
    settings.pop("gpu")  # the gpu variant is built on its own (pipeline.compile.gpu)
    if multi:
        settings["packaging"] = list(config.buckets.packaging)
        settings["qnn_options"] = dict(config.buckets.qnn_options)
    return settings


def variant_digest(
    inputs: ModelInputs, toolchain: Toolchain, onnxruntime: str, target: Target
) -> str:
    """Everything that went into a variant; equal digests mean the variant can be reused.

    Not the release's version or description: a new ``model.version`` re-publishes only."""
    multi = len(inputs.buckets) > 1
    data = {
        "model": inputs.config.model.name,
        "built_from": dataclasses.asdict(inputs.built_from),
        "compile": compile_settings(inputs.config, multi),
        "toolchain": dataclasses.asdict(toolchain),
        "onnxruntime": onnxruntime,
        "target": dataclasses.asdict(target),
        "code": code_digest(*CODE),
        "validate_samples": VALIDATE_SAMPLES,
        "validate_budget_s": HTP_BUDGET_S,
        "closed_loop": [CLOSED_LOOP_WINDOWS, CLOSED_LOOP_BUDGET_S],
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def ctx_file_name(model: str, bucket: str | None, target: Target, toolchain: Toolchain) -> str:
    middle = f"{bucket}_" if bucket else ""
    return f"{model}_{middle}{target.name}_qnn{toolchain.qnn_sdk}_ctx.onnx"


def qnn_options(inputs: ModelInputs) -> dict[str, str]:
    """The QNN EP options of a variant: [compile]'s for its graphs (the HTP judge compiled the
    same way, so its context can be adopted), then the buckets' own QNN options over them."""
    steps = max((b.recurrent_steps for b in inputs.buckets), default=0)
    return {
        **inputs.config.compile.qnn_options_for(steps),
        **inputs.config.buckets.qnn_options,
    }


def make_job(
    inputs: ModelInputs,
    toolchain: Toolchain,
    target: Target,
    out: Path,
    result: Path,
    log_severity: int,
) -> CompileJob:
    config = inputs.config
    settings = config.compile
    multi = len(inputs.buckets) > 1
    states = {} if multi else dict(inputs.record.summary.stream_states)
    buckets = []
    for bucket in inputs.buckets:
        where = inputs.paths.bucket(bucket.name)
        buckets.append(
            BucketJob(
                name=bucket.name,
                qdq=str(where.qdq.resolve()),
                float_model=str(where.float_model.resolve()) if where.float_model.is_file() else "",
                heldout=[str(p.resolve()) for p in spread(inputs.heldout[bucket.name])],
                ctx_name=ctx_file_name(
                    config.model.name, bucket.name if multi else None, target, toolchain
                ),
                htp_probe=str(where.htp_probe.resolve()) if where.htp_probe.is_file() else "",
                stream=[str(p.resolve()) for p in inputs.heldout[bucket.name]] if states else [],
            )
        )
    return CompileJob(
        model=config.model.name,
        target=target.name,
        buckets=buckets,
        out_dir=str(out.resolve()),
        result=str(result.resolve()),
        soc_model=target.soc_model,
        htp_arch=target.htp_arch,
        qnn_sdk=toolchain.qnn_sdk,
        packaging=list(config.buckets.packaging) if multi else [],
        embed=settings.embed,
        qnn_options=qnn_options(inputs),
        log_severity=log_severity,
        load_runs=settings.load_runs,
        max_partitions=settings.max_partitions,
        allowed_cpu_ops=list(settings.allowed_cpu_ops),
        output_grids=dict(inputs.record.summary.output_grids),
        output_steps=dict(inputs.record.summary.output_steps),
        min_snr_db=settings.min_snr_db,
        snr_floor_db={
            name: floor - ROUNDING_MARGIN_DB
            for name, floor in inputs.record.summary.rounding_floor_db.items()
        },
        validate_samples=VALIDATE_SAMPLES,
        validate_budget_s=HTP_BUDGET_S,
        # the judge's early stop (a model keeping its own quantization: every sample, as there)
        enough_db=0.0
        if inputs.record.summary.rounding_floor_db
        else config.quantization.target_snr_db + ENOUGH_MARGIN_DB,
        stream_states=states,
        closed_loop_windows=CLOSED_LOOP_WINDOWS,
        closed_loop_budget_s=CLOSED_LOOP_BUDGET_S,
        seed=config.calibration.seed,
    )


@dataclass
class Built:
    record: VariantRecord
    folder: Path
    skipped: bool
    seconds: float = 0.0


def reusable_variant(folder: VariantPaths, digest: str) -> VariantRecord | None:
    """The variant on disk when it was built from inputs of this ``variant_digest``."""
    existing = existing_variant(folder)
    return existing if existing is not None and existing.inputs_digest == digest else None


def variants_to_build(
    config: ModelConfig,
    artifacts: Path,
    table: Toolchains,
    toolchain: Toolchain,
    installed: qnn.InstalledQnn,
    force: bool = False,
) -> int:
    """How many HTP variants of ``config`` this run will build with ``toolchain`` in a worker:
    as many workers are warmed up, so a rerun with nothing changed starts none, and neither
    does a variant the HTP judge's child already loaded (``worker.judge_loaded``). A model that
    cannot be compiled counts none; ``compile_model`` says why."""
    targets = {get_target(n) for n in config.compile.targets}
    if toolchain not in table.selected(config.compile.toolchains):
        return 0
    try:
        inputs = model_inputs(config, artifacts)
    except PipelineError:
        return 0 if not force else len(targets)
    wanted = 0
    for target in targets:
        folder = inputs.paths.variant(toolchain.onnxruntime_qnn, target.name)
        digest = variant_digest(inputs, toolchain, installed.onnxruntime, target)
        if not force and reusable_variant(folder, digest) is not None:
            continue
        from .worker import judge_loaded  # numpy: only for a variant that is built

        job = make_job(inputs, toolchain, target, folder.root, folder.root / "result.json", 0)
        try:
            wanted += judge_loaded(job, installed) is None
        except Exception:  # build_variant finds out again, and a worker builds it then
            wanted += 1
    return wanted


JUDGED_LOG = (
    "No worker ran for this variant: the quantize stage's HTP judge compiled this QDQ model for "
    "this chip with this onnxruntime-qnn and these options, and its child loaded, ran and timed "
    "that very ctx (every digest checked). Its coverage, I/O, memory, load time and validation "
    "are that child's, in variant.json.\n"
)


def plots_likely(inputs: ModelInputs, variants: int) -> bool:
    """Whether the page will compare several things in a plot of compile's (variants, buckets,
    outputs or parts of a packed one; see ``report_html.figure_inputs``), read from what the
    quantize report compared: one output of one variant is a table, and labels are apart."""
    if variants >= 2 or len(inputs.buckets) >= 2:
        return True
    try:
        report = json.loads((inputs.paths.root / REPORT_JSON).read_text("utf-8"))
        compared = report["end_to_end"]["qdq_vs_source"]
        return sum(c.get("compared_as") != "labels" for c in compared.values()) >= 2
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return True


def existing_variant(folder: VariantPaths) -> VariantRecord | None:
    """The variant on disk, if its record parses and every file it lists is there."""
    record, _ = read_record(VariantRecord, folder.record)
    if record is None or any(not (folder.root / f).is_file() for f in record.files):
        return None
    return record


def build_variant(
    inputs: ModelInputs,
    toolchain: Toolchain,
    installed: qnn.InstalledQnn,
    target: Target,
    force: bool,
    log_severity: int,
    progress: Progress,
    plots: bool = True,
) -> Built:
    """One target's variant, or the one on disk when it is up to date. ``plots``: the page
    will likely draw a plot from it (``plots_likely``), so matplotlib is imported meanwhile."""
    config = inputs.config
    folder = inputs.paths.variant(toolchain.onnxruntime_qnn, target.name)
    digest = variant_digest(inputs, toolchain, installed.onnxruntime, target)
    existing = None if force else reusable_variant(folder, digest)
    if existing is not None:
        return Built(existing, folder.root, skipped=True)
    # Imported for a variant that is built: a rerun with nothing changed reads records only,
    # without numpy or matplotlib (whose import in a thread would contend with it).
    from .worker import combine_validation, judged_variant, merge_specs

    if plots:
        preload_plotting()  # report.html at the end: its import overlaps the variants' workers
    # k buckets: compiled (twice when a shared set is validated through the standalone one),
    # loaded and validated in one child, so the time limit grows with them, and with the
    # recurrent cells QNN builds for each.
    timeout = (
        sum(config.compile.timeout_for(b.recurrent_steps) for b in inputs.buckets)
        or config.compile.timeout_s
    )
    inputs.paths.ctx.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".work-", dir=inputs.paths.ctx))

    def tick(stage: str, elapsed: float) -> None:
        progress.status(f"{target.name}: {stage}", elapsed)

    try:
        # The whole variant folder is replaced at once: stale files from an earlier build (an old
        # .bin after switching to embed mode, a ctx beside a now-failed record) cannot survive.
        with atomic_dir(folder.root) as out:
            job = make_job(inputs, toolchain, target, out, work / "result.json", log_severity)
            began = time.monotonic()
            judged = judged_variant(job, installed)
            if judged is not None:  # the judge's child loaded these bytes: no worker
                write_text(VariantPaths(out).log, JUDGED_LOG)
                outcome = ChildOutcome(judged, 0, False, time.monotonic() - began, JUDGED_LOG)
            else:
                outcome = run_child(job, work, VariantPaths(out).log, timeout, on_tick=tick)
            status, failure = interpret(outcome, timeout)
            result = outcome.result
            per_bucket = result.buckets
            coverage = (
                coverage_mod.combine({n: b.coverage for n, b in per_bucket.items()})
                if per_bucket
                else None
            )
            validations = {n: b.validation for n, b in per_bucket.items() if b.validation}
            complete = per_bucket and len(validations) == len(per_bucket)
            names = [b.name for b in job.buckets]
            record = VariantRecord(
                model=config.model.name,
                toolchain=toolchain.onnxruntime_qnn,
                onnxruntime=installed.onnxruntime,
                qnn_sdk=toolchain.qnn_sdk,
                target=target.name,
                soc_model=target.soc_model,
                htp_arch=target.htp_arch,
                backend=job.backend_type,
                status=status,
                # An outside kill is not the model's failure: never reuse that record.
                inputs_digest="" if failure is not None and failure.infrastructure else digest,
                built_from=inputs.built_from,
                sets=[s for s in result.sets if all((out / f).is_file() for f in s.files)],
                validated_with=result.validated_with,
                shared_load_probe=result.shared_load_probe,
                inputs=merge_specs([per_bucket[n].inputs for n in names if n in per_bucket])
                if per_bucket
                else [],
                outputs=merge_specs([per_bucket[n].outputs for n in names if n in per_bucket])
                if per_bucket
                else [],
                coverage=coverage,
                validation=combine_validation(validations) if complete else None,
                buckets=dict(per_bucket),
                load=result.load,
                memory=result.memory,
                compile_time_s=result.compile_time_s,
                error=failure,
                qnn_options=dict(job.qnn_options),
            )
            write_record(VariantPaths(out).record, record)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return Built(record, folder.root, skipped=False, seconds=outcome.seconds)


# -- the model -------------------------------------------------------------------------------------


def _remove_stale(
    paths: ModelPaths,
    wanted: list[Toolchain],
    current: Toolchain,
    targets: list[Target],
    others: frozenset[str] = frozenset(),
) -> None:
    """Variants the config no longer asks for must not linger beside the ones it does."""
    if not paths.ctx.is_dir():
        return
    wanted_toolchains = {t.onnxruntime_qnn for t in wanted}
    for path in paths.ctx.iterdir():
        if path.is_dir() and not path.name.startswith(".") and path.name not in wanted_toolchains:
            shutil.rmtree(path, ignore_errors=True)
    folder = paths.ctx / current.onnxruntime_qnn
    if folder.is_dir():
        names = {t.name for t in targets} | others
        for path in folder.iterdir():
            if path.is_dir() and not path.name.startswith(".") and path.name not in names:
                shutil.rmtree(path, ignore_errors=True)


@locked("compile")
def compile_model(
    config: ModelConfig,
    artifacts: Path,
    table: Toolchains,
    toolchain: Toolchain,
    installed: qnn.InstalledQnn,
    force: bool = False,
    log_severity: int = qnn.LOG_WARNING,
    out: Callable[[str], None] = print,
) -> list[Built]:
    """Build every target of one config with this toolchain; returns the variants (or [])."""
    targets = list({t.name: t for t in (get_target(n) for n in config.compile.targets)}.values())
    wanted = table.selected(config.compile.toolchains)
    if toolchain not in wanted:
        out(
            f"{config.model.name}: skipped for onnxruntime-qnn {toolchain.onnxruntime_qnn}; "
            f"compile.toolchains asks for {', '.join(t.onnxruntime_qnn for t in wanted)}."
        )
        return []
    inputs = model_inputs(config, artifacts)
    precision = config.compile.gpu
    gpu_wanted = precision != "off"
    others = frozenset({GPU_TARGET} if gpu_wanted else ())
    _remove_stale(inputs.paths, wanted, toolchain, targets, others)
    built: list[Built] = []
    plots = plots_likely(inputs, len(targets) + gpu_wanted)
    label = f"{config.model.name} qnn {toolchain.onnxruntime_qnn}"
    with Progress(len(targets) + gpu_wanted, label, unit="variant") as progress:
        for target in targets:
            progress.status(f"{target.name}: start")
            result = build_variant(
                inputs, toolchain, installed, target, force, log_severity, progress, plots
            )
            built.append(result)
            target_snr = config.quantization.target_snr_db
            progress.write(
                describe(result.record, result.skipped, target_snr, inputs.record.summary)
            )
            note = closed_loop_note(result.record, target_snr)
            if note:
                progress.write(note)
            progress.update()
        if gpu_wanted:  # the float/fp16 model for QNN's GPU backend, a published fallback
            from . import gpu as gpu_variant

            progress.status(f"{GPU_TARGET}: start")
            record, folder, skipped, seconds = gpu_variant.build(
                inputs, toolchain, installed, precision, force, log_severity
            )
            built.append(Built(record, folder, skipped, seconds))
            progress.write(gpu_variant.describe(record, skipped))
            progress.update()
    report = write_model_report(config, inputs.paths, inputs.record, wanted, targets)
    out(f"{config.model.name}: compile report -> {report}")
    page = write_html_reports(inputs.paths.root, out)  # never raises: a warning line on failure
    if page is not None:
        out(f"{config.model.name}: HTML report -> {page}")
    return built
