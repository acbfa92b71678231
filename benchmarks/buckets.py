"""Shape buckets: size of k buckets in one weight-shared context vs k separate ctx models vs one.

For each bucketed config, runs the quantize and compile stages (cached: a rerun with nothing
changed does no work), then prints per target:

- the weight-shared set: every bucket's ``_ctx.onnx`` plus the one ``_qnn.bin`` they reference;
- k separate ctx models: each bucket compiled on its own (ctx + its own bin);
- one bucket alone (each, and the largest, which is what padding everything to the maximum needs);
- resident memory after opening every bucket's session, in a fresh process per measurement,
  for the standalone set and for the shared set (which the x86_64 HTP simulator cannot load: that
  is reported as such, with how the loading process failed).

    python benchmarks/buckets.py [--artifacts DIR] [configs...]

Defaults: configs/example_buckets.toml, and configs/shared/ppocr_rec_buckets.toml when
../shared/models holds the PP-OCR recogniser; for the latter the shared total must be <= 1.3x the
largest bucket alone (exit code 1 otherwise). Needs onnxruntime-qnn (the compile stage does).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# config -> largest allowed (shared total / largest bucket alone); None = report only. A tiny
# model's per-graph overhead dominates its weights, so its ratio is only reported.
BENCHMARKS = {
    "configs/example_buckets.toml": None,
    "configs/shared/ppocr_rec_buckets.toml": 1.3,
}

MEMORY = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
spec = json.loads(sys.argv[2])

def rss():
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

import onnxruntime as ort
from qnn_ctx_runtime import qnn
ep = qnn.find_qnn_ep()
before = rss()
after = []
sessions = []
for i, path in enumerate(spec["models"]):
    config = {"session.disable_model_compile": "1"}
    if spec["shared"]:
        config["ep.share_ep_contexts"] = "1"
        if i == len(spec["models"]) - 1:
            config["ep.stop_share_ep_contexts"] = "1"
    options = ep.session_options(qnn.QnnOptions("htp"), config, log_severity=3)
    sessions.append(ort.InferenceSession(path, options))
    after.append(rss())
print(json.dumps({"before": before, "after": after}), flush=True)
"""


def stage(name: str, config: str, artifacts: Path) -> None:
    """One pipeline stage in a child process, as `python -m pipeline` runs it."""
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", name, config, "--artifacts", str(artifacts)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-12:])
        raise SystemExit(f"`python -m pipeline {name} {config}` failed:\n{tail}")


def memory(models: list[Path], shared: bool) -> str:
    """RSS growth from opening every session in a fresh process, or why it could not."""
    spec = json.dumps({"models": [str(m) for m in models], "shared": shared})
    done = subprocess.run(
        [sys.executable, "-c", MEMORY, str(ROOT / "runtime"), spec],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        if done.returncode < 0:
            import signal

            return f"does not load here (the process died with {signal.Signals(-done.returncode).name})"
        last = [line for line in done.stderr.splitlines() if line.strip()]
        return f"does not load here ({last[-1][-160:] if last else done.returncode})"
    data = json.loads(done.stdout.strip().splitlines()[-1])
    after = data["after"]
    total = (after[-1] - data["before"]) / 2**20
    first = (after[0] - data["before"]) / 2**20
    if len(after) == 1:
        return f"+{total:.1f} MiB (most of it the QNN backend libraries themselves)"
    return (
        f"+{total:.1f} MiB: +{first:.1f} with the first session (QNN backend libraries "
        f"included), +{total - first:.1f} for the other {len(after) - 1}"
    )


def db(value: object) -> str:
    """An SNR from report.json, where inf is written as a string."""
    try:
        return f"{float(value):.1f} dB"  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "-"


def mb(value: float) -> str:
    return f"{value / 1e6:.3f} MB"


def report(config_path: str, artifacts: Path, limit: float | None) -> bool:
    from pipeline.core.config import load_config
    from pipeline.core.layout import ModelPaths
    from pipeline.core.records import VariantRecord, read_record

    config = load_config(ROOT / config_path)
    stage("quantize", config_path, artifacts)
    stage("compile", config_path, artifacts)
    paths = ModelPaths.of(artifacts, config.model.name)
    quantize = json.loads(paths.report.with_suffix(".json").read_text("utf-8"))
    e2e = quantize["end_to_end"]
    ok = True
    print(f"\n## {config.model.name} ({config_path})")
    weights = quantize["weights"]
    print(
        f"buckets: {', '.join(b['name'] for b in quantize['buckets'])}; "
        f"{weights['shared_initializers']} initializers ({weights['shared_bytes']:,} bytes) "
        "byte-identical in every bucket"
    )
    for out, figures in e2e["qdq_vs_source"].items():
        pad_only = e2e["float_vs_source"].get(out, {})
        print(
            f"end to end (pad, run QDQ, crop) vs float at the true size, {out}: "
            f"SNR {db(figures['snr_db'])} (padding alone: {db(pad_only.get('snr_db'))})"
        )
    for record_file in sorted(paths.ctx.glob("*/*/variant.json")):
        folder = record_file.parent
        record, why = read_record(VariantRecord, record_file)
        if record is None:
            print(f"\n{folder}: unreadable record: {'; '.join(why)}")
            ok = False
            continue
        shared, standalone = record.set_of("shared"), record.set_of("standalone")
        if standalone is None:
            print(f"\n{folder}: no standalone set to compare with (packaging)")
            continue
        names = list(standalone.bucket_bytes)
        alone = standalone.bucket_bytes
        largest = max(alone.values())
        print(f"\n{folder.parent.name} / {folder.name}:")
        print(f"  k={len(names)} buckets weight-shared : {mb(shared.total_bytes if shared else 0)}")
        print(f"  k={len(names)} separate ctx models  : {mb(standalone.total_bytes)}")
        for name in names:
            print(f"  one bucket alone, {name:<12}: {mb(alone[name])}")
        if shared is not None:
            ratio = shared.total_bytes / largest
            verdict = ""
            if limit is not None:
                passed = ratio <= limit
                ok &= passed
                verdict = f"  (limit {limit}: {'PASS' if passed else 'FAIL'})"
            print(f"  shared / largest bucket alone: {ratio:.2f}x{verdict}")
            print(
                f"  separate / shared            : {standalone.total_bytes / shared.total_bytes:.2f}x"
            )
        standalone_models = [folder / standalone.ctx_files[n] for n in names]
        print(
            f"  memory, all {len(names)} standalone buckets open: {memory(standalone_models, False)}"
        )
        print(
            f"  memory, largest bucket alone open       : {memory(standalone_models[-1:], False)}"
        )
        if shared is not None:
            shared_models = [folder / shared.ctx_files[n] for n in names]
            print(f"  memory, all buckets over the shared context: {memory(shared_models, True)}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", help="bucketed configs (default: see module doc)")
    parser.add_argument("--artifacts", type=Path, default=None, help="default: a temp folder")
    args = parser.parse_args()
    configs = args.configs or list(BENCHMARKS)
    with tempfile.TemporaryDirectory(prefix="buckets-bench-") as tmp:
        artifacts = (args.artifacts or Path(tmp)).resolve()
        subprocess.run([sys.executable, "-m", "pipeline", "example"], cwd=ROOT, check=True)
        ok = True
        for config in configs:
            from pipeline.core.config import load_config

            try:
                load_config(ROOT / config)
            except Exception as exc:  # e.g. ../shared/models absent
                print(f"\n## {config}: skipped ({getattr(exc, 'message', exc)})")
                continue
            ok &= report(config, artifacts, BENCHMARKS.get(config))
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
