"""The whole chain on every real-model config, one row per model, side by side in one run.

    python benchmarks/real_models.py [configs/shared/*.toml] [--artifacts DIR] [--target NAME]

For each config: `python -m pipeline quantize` then `python -m pipeline compile` (each in a child
process, timed with --force so nothing is reused), then the figures are read from the reports:
preparation steps applied, quantize and compile time, QNN partitions, CPU compute nodes, SNR of
QDQ vs float and of ctx (HTP simulator) vs float on held-out real inputs, ctx / QDQ / float file
sizes, and session creation with online compile (QDQ) vs from the ctx model, with their ratio.
Prints a Markdown table (and writes it to <artifacts>/real_models.md). Bucketed configs are rows
like any other (sizes: the primary context set, all buckets' QDQ and float models); their sharing
sizes and memory are in benchmarks/buckets.py. Models whose file is absent (../shared/models not
here) are listed as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import date
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shared_configs import compile_bytecode, runnable_configs  # noqa: E402

from pipeline.core.records import VariantRecord, read_record  # noqa: E402
from pipeline.core.report import fmt, table  # noqa: E402

SHORT_STEPS = {
    "drop_initializer_inputs": "drop-init-inputs",
    "bake_constant_inputs": "bake",
    "fix_input_shapes": "fix-shapes",
    "float16_to_float32": "fp16->fp32",
    "replace_legacy_ops": "legacy-ops",
    "upgrade_opset": "opset21",
    "constants_to_initializers": "const->init",
    "fold_constants": "fold",
    "fold_batchnorm": "fold-BN",
    "fold_conv_affine": "fold-affine",
    "output_padding_to_pads": "output-padding",
    "avg_pool_ceil_mode": "avgpool-floor",
    "expand_function_ops": "expand-functions",
    "einsum_to_matmul": "einsum",
    "rewrite_for_htp": "htp-rewrites",
    "qnn_preprocess": "qnn-preprocess",
    "fuse_erf_gelu": "erf-gelu",
    "gathernd_to_gather": "gathernd",
    "log_of_large_gain": "log-gain",
}


def run_stage(argv: list[str]) -> tuple[float, int, str, float]:
    """Run one stage as a child; wall seconds, exit code, output tail, peak RSS (MiB).

    The peak is the largest of the stage process and the worker processes it waited for.
    """
    with tempfile.TemporaryFile() as log:
        start = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline", *argv], cwd=ROOT, stdout=log, stderr=log
        )
        _, status, usage = os.wait4(proc.pid, 0)
        elapsed = time.perf_counter() - start
        log.seek(0)
        tail = log.read().decode(errors="replace")[-1500:]
    return elapsed, os.waitstatus_to_exitcode(status), tail, usage.ru_maxrss / 1024


def versions() -> str:
    parts = []
    for name in ("onnxruntime", "onnxruntime-qnn", "onnx"):
        try:
            parts.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            parts.append(f"{name} absent")
    return ", ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", type=Path)
    parser.add_argument("--artifacts", type=Path, default=ROOT / "artifacts" / "bench")
    args = parser.parse_args()
    configs, notes = runnable_configs(args.configs)
    notes.append(compile_bytecode())
    rows = []
    target = "-"
    for path, config in configs:
        name = config.model.name
        art = str(args.artifacts)
        q_time, q_rc, q_log, q_rss = run_stage(
            ["quantize", str(path), "--artifacts", art, "--force"]
        )
        build = args.artifacts / "build" / name
        if q_rc != 0 and not (build / "record.json").is_file():
            notes.append(f"{name}: quantize failed: {q_log.strip().splitlines()[-1]}")
            continue
        c_time, c_rc, c_log, c_rss = run_stage(
            ["compile", str(path), "--artifacts", art, "--force"]
        )
        report = json.loads((build / "report.json").read_text())
        variants = sorted((build / "ctx").glob("*/*/variant.json"))
        if not variants:
            notes.append(f"{name}: compile produced no variant: {c_log.strip().splitlines()[-1]}")
            continue
        variant, why = read_record(VariantRecord, variants[0])
        if variant is None:
            notes.append(f"{name}: unreadable variant record: {'; '.join(why)}")
            continue
        target = variant.target
        steps = sorted(
            {SHORT_STEPS.get(c["step"], c["step"]) for c in report["prepare"] if c["details"]}
            - {"set_ir_version", "topological_sort", "store_inferred_shapes"}
        )
        primary = variant.sets[0] if variant.sets else None
        cov, val, load = variant.coverage, variant.validation, variant.load
        mixed = report.get("mixed_precision") or {}
        buckets = report["buckets"]
        rows.append(
            [
                name + (f" ({len(buckets)} buckets)" if len(buckets) > 1 else ""),
                ", ".join(steps),
                q_time,
                c_time,
                max(q_rss, c_rss),
                cov.qnn_partitions if cov else None,
                (
                    f"{len(cov.cpu_compute_nodes)}"
                    + (f" (+{len(cov.cpu_tail_nodes)} tail)" if cov.cpu_tail_nodes else "")
                    if cov
                    else None
                ),
                (report.get("preparation_check") or {}).get("snr_db"),
                report["worst_snr_db"],
                val.worst_snr_vs_float_db if val else None,
                f"{len(mixed.get('tensors', []))} raised" if mixed.get("tensors") else "-",
                f"{(primary.total_bytes if primary else 0) / 1e6:.2f} / "
                f"{sum(b['qdq_bytes'] for b in buckets) / 1e6:.2f} / "
                f"{sum(b['float_bytes'] for b in buckets) / 1e6:.2f}",
                load.qdq_s if load else None,
                load.ctx_s if load else None,
                f"{load.ratio:.0f}x" if load and load.ratio else "-",
                "ok" if variant.passed and q_rc == 0 and c_rc == 0 else "FAILED",
            ]
        )
    headers = [
        "model",
        "preparation",
        "quantize s",
        "compile s",
        "peak RSS MiB",
        "QNN partitions",
        "CPU compute nodes",
        "prepared vs source dB",
        "SNR QDQ vs float dB",
        "SNR ctx vs float dB",
        "mixed precision",
        "MB ctx / QDQ / float",
        "load QDQ s",
        "load ctx s",
        "ratio",
        "status",
    ]
    text = "\n".join(
        [
            f"Real models, {date.today().isoformat()}, {versions()}, target {target} (HTP simulator)",
            "",
            table(headers, [[fmt(v, 3) if isinstance(v, float) else v for v in r] for r in rows]),
            *(["", *notes] if notes else []),
        ]
    )
    print(text)
    args.artifacts.mkdir(parents=True, exist_ok=True)
    (args.artifacts / "real_models.md").write_text(text + "\n")
    return 0 if all(r[-1] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
