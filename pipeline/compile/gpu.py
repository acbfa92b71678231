"""The gpu variant: the prepared float model, or its fp16 copy, for QNN's GPU backend.

``[compile] gpu = "float32" | "float16"`` asks for it: a published fallback for devices whose
NPU cannot run the release (no HTP variant fits, or the chosen context fails to open). It is not
a context binary: QNN's GPU backend compiles the model when the device loads it, so it is built
for no chip (``target = "gpu"``, soc_model and htp_arch 0) and with no SDK constraint.

Building it, per bucket: the prepared ``float.onnx`` is copied (float32) or converted with
onnxruntime's own fp16 converter, inputs and outputs kept float32 so the caller feeds the same
arrays (float16). The model is checked against the float model on the CPU EP over the held-out
samples (what the fp16 conversion costs). Then, in a child process (QNN may abort), a session
on QNN's GPU backend with ``session.disable_cpu_ep_fallback=1``: a graph the GPU runs only in part
fails instead of running on the CPU. Where that session opens (a machine with an Adreno GPU), its
coverage and outputs are measured like a ctx's. Where the backend cannot initialise (this x86_64
build machine: no OpenCL GPU, ``QNN_BACKEND_ERROR_CANNOT_INITIALIZE``) the variant is recorded as
``deferred_to_device``: published, unverified on hardware, and its coverage gate runs at load on
the device with the same setting. Any other failure of that session fails the variant.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from qnn_ctx_runtime import qnn
from qnn_ctx_runtime.toolchains import Toolchain

from ..core.accuracy import worst_snr
from ..core.cpu import cpu_session
from ..core.errors import ToolchainError
from ..core.fileio import atomic_dir
from ..core.layout import GPU_TARGET, VALIDATE_SAMPLES, VariantPaths, spread
from ..core.metrics import OutputComparison
from ..core.records import (
    BucketOutcome,
    CtxSet,
    Failure,
    TensorSpec,
    Validation,
    VariantRecord,
    code_digest,
    write_record,
)
from . import coverage as coverage_mod
from .worker import combine_validation, merge_specs

PRECISIONS = ("float32", "float16")

CODE = ("core", "compile")
# The log lines of a QNN GPU backend that cannot start: no Adreno GPU / OpenCL driver here.
UNAVAILABLE = ("QNN_BACKEND_ERROR_CANNOT_INITIALIZE", "Failed to initialize backend")
DEFERRED = (
    "QNN's GPU backend cannot initialise on this machine ({why}); the gpu variant is "
    "published unverified on hardware, and its coverage gate runs at load on the device "
    "(session.disable_cpu_ep_fallback=1)"
)

PROBE = """
import json, sys
import numpy as np
import onnxruntime as ort
from qnn_ctx_runtime import qnn
spec = json.loads(sys.argv[1])
ep = qnn.find_qnn_ep()
out = {"buckets": {}}
for name, bucket in spec["buckets"].items():
    config = {"session.disable_cpu_ep_fallback": "1", "session.record_ep_graph_assignment_info": "1"}
    options = ep.session_options(qnn.QnnOptions("gpu"), config, spec["log_severity"])
    session = ort.InferenceSession(bucket["model"], sess_options=options)
    assignment = [
        (s.ep_name, [(n.name, n.op_type) for n in s.get_nodes()])
        for s in session.get_provider_graph_assignment_info()
    ]
    outputs = []
    for index, sample in enumerate(bucket["samples"]):
        with np.load(sample) as data:
            feeds = {k: data[k] for k in data.files}
        path = f"{spec['out']}/{name}_{index}.npz"
        np.savez(path, *session.run(None, feeds))
        outputs.append(path)
    out["buckets"][name] = {"assignment": assignment, "outputs": outputs}
print("GPU_PROBE " + json.dumps(out), flush=True)
"""


def file_name(model: str, bucket: str | None, precision: str, toolchain: Toolchain) -> str:
    middle = f"{bucket}_" if bucket else ""
    return f"{model}_{middle}gpu-{precision}_qnn{toolchain.qnn_sdk}.onnx"


def digest(inputs: Any, toolchain: Toolchain, onnxruntime: str, precision: str) -> str:
    """Everything the gpu variant depends on; equal digests mean it can be reused."""
    data = {
        "model": inputs.config.model.name,
        "built_from": {
            "float_sha256": inputs.built_from.float_sha256,
            "heldout_digest": inputs.built_from.heldout_digest,
        },
        "precision": precision,
        "min_snr_db": inputs.config.compile.min_snr_db,
        "toolchain": toolchain.onnxruntime_qnn,
        "onnxruntime": onnxruntime,
        "code": code_digest(*CODE),
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def write_model(float_model: Path, dest: Path, precision: str) -> None:
    """The float model as it is, or converted to fp16 with float32 inputs and outputs."""
    if precision == "float32":
        shutil.copyfile(float_model, dest)
        return
    try:
        import onnx
        from onnxruntime.transformers.float16 import convert_float_to_float16
    except ImportError as exc:
        raise ToolchainError(
            f"compile.gpu = 'float16' converts the float model with onnx and onnxruntime's fp16 "
            f"converter, which this environment lacks ({exc}).",
            tip="pip install onnx==1.23.2 beside onnxruntime, or use compile.gpu = 'float32'.",
        ) from None
    model = onnx.load(str(float_model))
    converted = convert_float_to_float16(model, keep_io_types=True)
    converted.ir_version = model.ir_version  # onnxruntime refuses IR versions newer than it reads
    onnx.save(converted, str(dest))


def _specs(path: Path) -> tuple[list[TensorSpec], list[TensorSpec]]:
    summary = qnn.read_model_summary(path)

    def spec(values: list[qnn.ValueInfo]) -> list[TensorSpec]:
        return [
            TensorSpec(v.name, [d if isinstance(d, int) else -1 for d in v.shape], v.dtype)
            for v in values
        ]

    return spec(summary.inputs), spec(summary.outputs)


def _compare(model: Path, float_model: Path, samples: list[Path], gpu_outputs: list[Path] | None):
    """The gpu model (its GPU outputs when given, else the model on the CPU EP) vs float."""
    reference = cpu_session(float_model)
    names = [o.name for o in reference.get_outputs()]
    test = cpu_session(model) if gpu_outputs is None else None
    comparison = OutputComparison.for_models(float_model)  # labels, angles... as elsewhere
    for index, sample in enumerate(samples):
        with np.load(sample) as data:
            feeds = {k: data[k] for k in data.files}
        ref = dict(zip(names, reference.run(names, feeds), strict=True))
        if gpu_outputs is None:
            got = dict(zip(names, test.run(names, feeds), strict=True))
        else:
            with np.load(gpu_outputs[index]) as data:
                got = dict(zip(names, (data[f"arr_{i}"] for i in range(len(names))), strict=True))
        comparison.add(ref, got)
    return comparison


def _validation(comparison: OutputComparison, min_snr_db: float, where: str) -> Validation:
    summary = comparison.summary()
    worst = worst_snr(summary)
    return Validation(
        ctx_vs_qdq={},
        ctx_vs_float=summary,
        qdq_vs_float={},
        worst_snr_db=worst,
        worst_snr_vs_float_db=worst,
        samples=comparison.samples,
        samples_source="heldout",
        passed=min_snr_db <= 0 or worst >= min_snr_db,
        gate=f"{where} vs the float model"
        + (f": worst SNR >= {min_snr_db} dB" if min_snr_db > 0 else " (no SNR gate)"),
    )


def probe(
    models: dict[str, Path],
    samples: dict[str, list[Path]],
    work: Path,
    log: Path,
    timeout_s: float,
    log_severity: int,
) -> tuple[str, dict[str, Any] | None, str]:
    """(outcome, result, message) of a QNN GPU session per bucket, in a child process; its
    outputs go to ``work``.

    outcome: "ok" (every bucket opened on the GPU, outputs written), "unavailable" (the GPU
    backend cannot start here) or "failed" (it started, and the session still failed)."""
    spec = {
        "out": str(work),
        "log_severity": log_severity,
        "buckets": {
            name: {"model": str(path), "samples": [str(s) for s in samples[name]]}
            for name, path in models.items()
        },
    }
    roots = [str(Path(qnn.__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*roots, os.environ.get("PYTHONPATH", "")]))
    try:
        done = subprocess.run(
            [sys.executable, "-c", PROBE, json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "failed", None, f"the QNN GPU session did not open within {timeout_s:g} s"
    text = done.stdout + done.stderr
    log.write_text(text, encoding="utf-8")
    line = next((x for x in done.stdout.splitlines() if x.startswith("GPU_PROBE ")), None)
    if done.returncode == 0 and line is not None:
        return "ok", json.loads(line[len("GPU_PROBE ") :]), "the QNN GPU session opened"
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    unavailable = next((x for x in lines if any(m in x for m in UNAVAILABLE)), None)
    if unavailable is not None:
        return "unavailable", None, _plain(unavailable)
    how = f"exit code {done.returncode}" if done.returncode >= 0 else f"signal {-done.returncode}"
    return (
        "failed",
        None,
        f"the QNN GPU session failed ({how}): {_plain(lines[-1]) if lines else 'no output'}",
    )


def _plain(line: str) -> str:
    """An onnxruntime log line without its colour codes and timestamp."""
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)
    return re.sub(r"^\d{4}-\d\d-\d\d [\d:.]+ \[\w:[^\]]*\] ", "", line)[:400]


def build(
    inputs: Any,
    toolchain: Toolchain,
    installed: qnn.InstalledQnn,
    precision: str,
    force: bool,
    log_severity: int,
) -> tuple[VariantRecord, Path, bool, float]:
    """Build (or reuse) the gpu variant of one model; (record, folder, skipped, seconds)."""
    from .build import existing_variant  # the same reuse rule as the ctx variants

    folder = inputs.paths.variant(toolchain.onnxruntime_qnn, GPU_TARGET)
    key = digest(inputs, toolchain, installed.onnxruntime, precision)
    existing = existing_variant(folder)
    if not force and existing is not None and existing.inputs_digest == key:
        return existing, folder.root, True, 0.0
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix=".gpu-", dir=inputs.paths.root))
    try:
        return _build(inputs, toolchain, installed, precision, log_severity, key, work, started)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _build(
    inputs: Any,
    toolchain: Toolchain,
    installed: qnn.InstalledQnn,
    precision: str,
    log_severity: int,
    key: str,
    work: Path,
    started: float,
) -> tuple[VariantRecord, Path, bool, float]:
    config = inputs.config
    folder = inputs.paths.variant(toolchain.onnxruntime_qnn, GPU_TARGET)
    multi = len(inputs.buckets) > 1
    with atomic_dir(folder.root) as out:
        models, samples, sizes = {}, {}, {}
        for bucket in inputs.buckets:
            where = inputs.paths.bucket(bucket.name)
            name = file_name(
                config.model.name, bucket.name if multi else None, precision, toolchain
            )
            write_model(where.float_model, out / name, precision)
            models[bucket.name] = out / name
            sizes[bucket.name] = (out / name).stat().st_size
            samples[bucket.name] = spread(inputs.heldout[bucket.name], VALIDATE_SAMPLES)
        outcome, result, message = probe(
            models, samples, work, VariantPaths(out).log, config.compile.timeout_s, log_severity
        )
        buckets: dict[str, BucketOutcome] = {}
        validations, coverages, error = {}, {}, None
        for name, path in models.items():
            float_model = inputs.paths.bucket(name).float_model
            spec_in, spec_out = _specs(path)
            if outcome == "ok" and result is not None:
                measured = result["buckets"][name]
                coverages[name] = coverage_mod.summarize(
                    [(ep, [tuple(n) for n in nodes]) for ep, nodes in measured["assignment"]],
                    qnn.read_model_summary(path),
                    config.compile.max_partitions,
                    config.compile.allowed_cpu_ops,
                )
                gpu_outputs = [Path(p) for p in measured["outputs"]]
                where = f"the {precision} model on QNN's GPU backend"
            else:
                gpu_outputs, where = None, f"the {precision} model on the CPU EP (GPU unverified)"
            comparison = _compare(path, float_model, samples[name], gpu_outputs)
            validations[name] = _validation(comparison, config.compile.min_snr_db, where)
            if name in coverages:
                buckets[name] = BucketOutcome(coverages[name], spec_in, spec_out, validations[name])
        if outcome == "unavailable":
            error = Failure("probe", "unavailable", DEFERRED.format(why=message))
        elif outcome == "failed":
            error = Failure("probe", "error", message)
        names = [b.name for b in inputs.buckets]
        specs = [_specs(models[n]) for n in names]
        record = VariantRecord(
            model=config.model.name,
            toolchain=toolchain.onnxruntime_qnn,
            onnxruntime=installed.onnxruntime,
            qnn_sdk=toolchain.qnn_sdk,
            target=GPU_TARGET,
            soc_model=0,
            htp_arch=0,
            backend="gpu",
            status="failed" if outcome == "failed" else "ok",
            inputs_digest=key,
            built_from=inputs.built_from,
            sets=[
                CtxSet(
                    kind="single" if not multi else "standalone",
                    ctx_files={n: p.name for n, p in models.items()},
                    bins=[],
                    facts={},
                    total_bytes=sum(sizes.values()),
                    bucket_bytes=sizes,
                )
            ],
            validated_with="gpu" if outcome == "ok" else "cpu",
            shared_load_probe="",
            inputs=merge_specs([s[0] for s in specs]),
            outputs=merge_specs([s[1] for s in specs]),
            coverage=coverage_mod.combine(coverages) if coverages else None,
            validation=combine_validation(validations),
            buckets=buckets,
            load=None,
            memory=None,
            compile_time_s=time.perf_counter() - started,
            error=error,
        )
        write_record(VariantPaths(out).record, record)
    return record, folder.root, False, time.perf_counter() - started


def describe(record: VariantRecord, skipped: bool) -> str:
    """The console line of the gpu variant."""
    head = f"{record.model} gpu onnxruntime-qnn {record.toolchain}"
    if skipped:
        head += " (unchanged, skipped)"
    v = record.validation
    snr = f"{v.worst_snr_db:.1f} dB vs float" if v and v.worst_snr_db != float("inf") else "exact"
    if record.status != "ok":
        return f"FAILED {head}: {record.error.message if record.error else 'failed'}"
    if record.deferred_to_device:
        return f"ok {head}: {snr} on the CPU EP; unverified on hardware ({record.error.message})"
    verdict = "ok" if record.passed else "FAILED gate"
    c = record.coverage
    return (
        f"{verdict} {head}: {c.qnn_partitions if c else '-'} QNN partition(s), "
        f"{len(c.cpu_compute_nodes) if c else '-'} CPU node(s), GPU {snr}"
    )
