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
from compile_fixtures import build_inputs, small_cnn
from venvs import REPO_ROOT, run_in, toolchain_python

from pipeline import qnn
from pipeline.toolchains import load_pins
from pipeline.variant import VariantRecord

pytestmark = pytest.mark.qnn

TARGETS = 'targets = ["snapdragon-x-elite", "snapdragon-8-gen-3"]\nmin_snr_db = 20.0'
COMPILE = "import sys; from pipeline.__main__ import main; sys.exit(main(sys.argv[1:]))"


def compile_in(python: Path, root: Path, *args: str) -> subprocess.CompletedProcess:
    return run_in(python, COMPILE, "compile", "--artifacts", str(root / "artifacts"), *args)


def test_bad_pair_fails_with_the_explanation_not_a_cpu_build(tmp_path: Path) -> None:
    python = toolchain_python("2.3.0", "1.31.1")
    config = build_inputs(tmp_path, "tiny", small_cnn, TARGETS + '\ntoolchains = ["2.3.0"]')
    # The hazard is real in this environment: a plain session "works", on the CPU only.
    probe = run_in(
        python,
        "import onnxruntime as ort, onnxruntime_qnn as oq, sys\n"
        "ort.register_execution_provider_library('QNNExecutionProvider', oq.get_library_path())\n"
        "d = [x for x in ort.get_ep_devices() if x.ep_name == 'QNNExecutionProvider']\n"
        "so = ort.SessionOptions(); so.log_severity_level = 3\n"
        "so.add_provider_for_devices(d, {'backend_type': 'htp', 'soc_model': '60'})\n"
        "print(ort.InferenceSession(sys.argv[1], so).get_providers())\n",
        str(tmp_path / "artifacts/build/tiny/qdq.onnx"),
    )
    assert probe.returncode == 0
    assert probe.stdout.strip().splitlines()[-1] == "['CPUExecutionProvider']"

    done = compile_in(python, tmp_path, "--toolchain", "2.3.0", str(config))
    assert done.returncode == 1, done.stdout + done.stderr
    assert (
        "onnxruntime-qnn 2.3.0 is not known to work with onnxruntime 1.31.1; pin 1.26.0"
        in done.stderr
    )
    assert "falls back to CPU" in done.stderr
    assert not (tmp_path / "artifacts/build/tiny/ctx").exists()

    # Second line of defence: the worker itself, given a job despite the pin check, reports the
    # EP failure as a toolchain error and writes no ctx model.
    out = tmp_path / "out"
    out.mkdir()
    job = {
        "qdq": str(tmp_path / "artifacts/build/tiny/qdq.onnx"),
        "float_model": "",
        "heldout": [],
        "out_dir": str(out),
        "ctx_name": "tiny_ctx.onnx",
        "result": str(tmp_path / "result.json"),
        "soc_model": 60,
        "htp_arch": 73,
        "qnn_sdk": "2.47.0",
    }
    (tmp_path / "job.json").write_text(json.dumps(job))
    worker = run_in(
        python,
        "import sys; from pipeline.compile_worker import main; sys.exit(main(sys.argv[1:]))",
        str(tmp_path / "job.json"),
    )
    result = json.loads((tmp_path / "result.json").read_text())
    assert worker.returncode == 1 and result["status"] == "failed"
    assert result["error"]["stage"] == "compile" and result["error"]["kind"] == "toolchain"
    assert "not a working pair" in result["error"]["message"]
    assert not (out / "tiny_ctx.onnx").exists()


def test_two_toolchains_two_targets_one_report(tmp_path: Path) -> None:
    """The same model for 2 targets with 2.7.0 (this interpreter) and 2.5.0 (its own venv)."""
    installed = qnn.installed_qnn()
    pins = load_pins()
    if (
        installed.package_version != "2.7.0"
        or installed.onnxruntime != pins.get("2.7.0").onnxruntime
    ):
        pytest.skip(f"this interpreter has {installed.describe()}, not the 2.7.0 pin")
    python = toolchain_python("2.5.0", pins.get("2.5.0").onnxruntime)
    config = build_inputs(
        tmp_path, "tiny", small_cnn, TARGETS + '\ntoolchains = ["2.7.0", "2.5.0"]'
    )
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

    ctx = tmp_path / "artifacts/build/tiny/ctx"
    report = json.loads((ctx / "report.json").read_text())
    rows = {(r["toolchain"], r["target"]): r for r in report["variants"]}
    assert set(rows) == {
        (tc, t) for tc in ("2.7.0", "2.5.0") for t in ("snapdragon-x-elite", "snapdragon-8-gen-3")
    }
    for (toolchain, target), row in rows.items():
        assert row["passed"], row
        assert row["qnn_sdk"] == pins.get(toolchain).qnn_sdk
        assert row["qnn_partitions"] == 1 and row["cpu_compute_nodes"] == []
        # Load times are measured (benchmarks compare them); a test only checks they were taken.
        assert row["snr_ctx_vs_qdq_db"] > 30 and row["load_ratio"] > 0
        record = VariantRecord.read(ctx / toolchain / target)
        assert record.onnxruntime == pins.get(toolchain).onnxruntime
        assert record.ep_compatibility_info.startswith("v2:")
    markdown = (ctx / "report.md").read_text()
    assert markdown.count("| pass |") == 4
    record = json.loads((tmp_path / "artifacts/build/tiny/record.json").read_text())
    assert set(record["compile"]) == {"2.7.0", "2.5.0"}


def test_oldest_pin_writes_the_v1_compatibility_format(tmp_path: Path) -> None:
    """2.3.0 with its pinned onnxruntime works, and its older metadata format is understood."""
    pin = load_pins().get("2.3.0")
    python = toolchain_python(pin.onnxruntime_qnn, pin.onnxruntime)
    config = build_inputs(
        tmp_path, "tiny", small_cnn, 'targets = ["snapdragon-x-elite"]\ntoolchains = ["2.3.0"]'
    )
    done = compile_in(python, tmp_path, "--toolchain", "2.3.0", str(config))
    assert done.returncode == 0, done.stdout + done.stderr
    record = VariantRecord.read(tmp_path / "artifacts/build/tiny/ctx/2.3.0/snapdragon-x-elite")
    info = qnn.parse_compatibility_info(record.ep_compatibility_info)
    assert (info.format, info.sdk, info.htp_archs, info.soc_models) == ("v1", "2.47.0", (73,), ())
    assert record.qnn_sdk_version == "2.47.0" and record.passed
