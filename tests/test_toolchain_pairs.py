"""Other QNN toolchains, each in its own real environment (tests/venvs.py, cached with uv).

- onnxruntime-qnn 2.3.0 with onnxruntime 1.31.1 is the pair FACTS §2 saw fall back to CPU
  without an error. The build must fail with the explanation, never "succeed" on the CPU.
- 2.5.0 builds the same model as the 2.7.0 in this interpreter; the report has both rows.
- 2.3.0 with its pinned onnxruntime 1.26.0 writes the older ep_compatibility_info format.

The first run downloads the wheels (about a minute per environment); later runs reuse them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from compile_fixtures import BUCKET, build_inputs, model_paths, small_cnn
from venvs import REPO_ROOT, run_in, toolchain_python

from pipeline.compile.job import BucketJob, CompileJob, WorkerResult, read_message, write_message
from pipeline.core.records import QuantizeRecord, VariantRecord, read_record
from qnn_ctx_runtime import qnn
from qnn_ctx_runtime.toolchains import load_toolchains
from qnn_ctx_runtime.typed import parse

pytestmark = pytest.mark.qnn

TARGETS = 'targets = ["snapdragon-x-elite", "snapdragon-8-gen-3"]\nmin_snr_db = 20.0'
COMPILE = "import sys; from pipeline.__main__ import main; sys.exit(main(sys.argv[1:]))"
WORKER = "import sys; from pipeline.compile.worker import main; sys.exit(main(sys.argv[1:]))"


def compile_in(python: Path, root: Path, *args: str) -> subprocess.CompletedProcess:
    return run_in(python, COMPILE, "compile", "--artifacts", str(root / "artifacts"), *args)


def variant(root: Path, toolchain: str, target: str) -> VariantRecord:
    """A variant.json, parsed strictly (a malformed record fails the test)."""
    record, why = read_record(
        VariantRecord, model_paths(root, "tiny").variant(toolchain, target).record
    )
    assert record is not None, why
    return record


def test_bad_pair_fails_with_the_explanation_not_a_cpu_build(tmp_path: Path) -> None:
    python = toolchain_python("2.3.0", "1.31.1")
    config = build_inputs(tmp_path, "tiny", small_cnn, TARGETS + '\ntoolchains = ["2.3.0"]')
    qdq = model_paths(tmp_path, "tiny").bucket(BUCKET).qdq
    # The hazard is real in this environment: a plain session "works", on the CPU only.
    probe = run_in(
        python,
        "import onnxruntime as ort, onnxruntime_qnn as oq, sys\n"
        "ort.register_execution_provider_library('QNNExecutionProvider', oq.get_library_path())\n"
        "d = [x for x in ort.get_ep_devices() if x.ep_name == 'QNNExecutionProvider']\n"
        "so = ort.SessionOptions(); so.log_severity_level = 3\n"
        "so.add_provider_for_devices(d, {'backend_type': 'htp', 'soc_model': '60'})\n"
        "print(ort.InferenceSession(sys.argv[1], so).get_providers())\n",
        str(qdq),
    )
    assert probe.returncode == 0
    assert probe.stdout.strip().splitlines()[-1] == "['CPUExecutionProvider']"

    done = compile_in(python, tmp_path, "--toolchain", "2.3.0", str(config))
    assert done.returncode == 1, done.stdout + done.stderr
    assert (
        "onnxruntime-qnn 2.3.0 is not known to work with onnxruntime 1.31.1; the pin is 1.26.0"
        in done.stderr
    )
    assert "falls back to CPU" in done.stderr
    assert not model_paths(tmp_path, "tiny").ctx.exists()

    # Second line of defence: the worker itself, given a job despite the pin check, reports the
    # EP failure as a toolchain error and writes no ctx model.
    out = tmp_path / "out"
    out.mkdir()
    job = CompileJob(
        model="tiny",
        target="snapdragon-x-elite",
        buckets=[BucketJob(BUCKET, str(qdq), "", [], "tiny_ctx.onnx")],
        out_dir=str(out),
        result=str(tmp_path / "result.json"),
        soc_model=60,
        htp_arch=73,
        qnn_sdk="2.47.0",
        packaging=[],
    )
    write_message(tmp_path / "job.json", job)
    worker = run_in(python, WORKER, str(tmp_path / "job.json"))
    result = read_message(WorkerResult, tmp_path / "result.json")
    assert worker.returncode == 1 and result.status == "failed", worker.stdout + worker.stderr
    assert result.error is not None
    assert result.error.stage == "compile" and result.error.kind == "toolchain", result.error
    assert "not a working pair" in result.error.message
    assert not (out / "tiny_ctx.onnx").exists()


def test_two_toolchains_two_targets_one_report(tmp_path: Path) -> None:
    """The same model for 2 targets with 2.7.0 (this interpreter) and 2.5.0 (its own venv)."""
    installed = qnn.installed_qnn()
    table = load_toolchains()
    if (
        installed.package_version != "2.7.0"
        or installed.onnxruntime != table.get("2.7.0").onnxruntime
    ):
        pytest.skip(f"this interpreter has {installed.describe()}, not the 2.7.0 pin")
    python = toolchain_python("2.5.0", table.get("2.5.0").onnxruntime)
    config = build_inputs(
        tmp_path, "tiny", small_cnn, TARGETS + '\ntoolchains = ["2.7.0", "2.5.0"]'
    )
    paths = model_paths(tmp_path, "tiny")
    quantized, why = read_record(QuantizeRecord, paths.record)
    assert quantized is not None, why
    here = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "compile",
            "--toolchain",
            "2.7.0",
            "--artifacts",
            str(tmp_path / "artifacts"),
            str(config),
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=600,
    )
    assert here.returncode == 0, here.stdout + here.stderr
    there = compile_in(python, tmp_path, "--toolchain", "2.5.0", str(config))
    assert there.returncode == 0, there.stdout + there.stderr

    report = json.loads((paths.ctx / "report.json").read_text())
    issues: list[str] = []
    rows = {}
    for index, data in enumerate(report["variants"]):
        row = parse(VariantRecord, data, f"variants[{index}]", issues)
        rows[(row.toolchain, row.target)] = row
    assert not issues, issues
    assert set(rows) == {
        (tc, t) for tc in ("2.7.0", "2.5.0") for t in ("snapdragon-x-elite", "snapdragon-8-gen-3")
    }
    for (toolchain, target), row in rows.items():
        assert row.passed, row
        assert row.qnn_sdk == table.get(toolchain).qnn_sdk
        assert row.coverage is not None and row.validation is not None and row.load is not None
        assert row.coverage.qnn_partitions == 1 and row.coverage.cpu_compute_nodes == []
        # Load times are measured (benchmarks compare them); a test only checks they were taken.
        assert row.validation.worst_snr_db > 30 and row.load.ratio and row.load.ratio > 0
        record = variant(tmp_path, toolchain, target)
        assert record == row
        assert record.onnxruntime == table.get(toolchain).onnxruntime
        assert record.sets[0].facts[BUCKET].ep_compatibility_info.startswith("v2:")
        assert record.built_from.qdq_sha256 == {BUCKET: quantized.bucket(BUCKET).qdq_sha256}
    markdown = (paths.ctx / "report.md").read_text()
    assert markdown.count("| pass |") == 4
    # Each toolchain's variants are in its own folder; the quantize record stays the quantize
    # stage's alone (no compile section), untouched by either build.
    toolchains = {p.name for p in paths.ctx.iterdir() if p.is_dir() and not p.name.startswith(".")}
    assert toolchains == {"2.7.0", "2.5.0"}
    after, why = read_record(QuantizeRecord, paths.record)
    assert after == quantized, why
    assert "compile" not in json.loads(paths.record.read_text())


def test_oldest_pin_writes_the_v1_compatibility_format(tmp_path: Path) -> None:
    """2.3.0 with its pinned onnxruntime works, and its older metadata format is understood."""
    pin = load_toolchains().get("2.3.0")
    python = toolchain_python(pin.onnxruntime_qnn, pin.onnxruntime)
    config = build_inputs(
        tmp_path, "tiny", small_cnn, 'targets = ["snapdragon-x-elite"]\ntoolchains = ["2.3.0"]'
    )
    done = compile_in(python, tmp_path, "--toolchain", "2.3.0", str(config))
    assert done.returncode == 0, done.stdout + done.stderr
    record = variant(tmp_path, "2.3.0", "snapdragon-x-elite")
    facts = record.sets[0].facts[BUCKET]
    info = qnn.parse_compatibility_info(facts.ep_compatibility_info)
    assert (info.format, info.sdk, info.htp_archs, info.soc_models) == ("v1", "2.47.0", (73,), ())
    assert facts.qnn_sdk_version == "2.47.0" and record.qnn_sdk == "2.47.0" and record.passed
