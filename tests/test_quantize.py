"""The quantize stage end to end on the generated example, plus its bad-input cases."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from pipeline.__main__ import main
from pipeline.example import ensure_example

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of the example config and data (tests never touch the repo's artifacts)."""
    root = tmp_path_factory.mktemp("proj")
    ensure_example(root)
    (root / "configs").mkdir()
    shutil.copy(ROOT / "configs" / "example.toml", root / "configs" / "example.toml")
    return root


def run(root: Path, *args: str) -> int:
    return main(["quantize", "--artifacts", str(root / "artifacts"), *args])


def test_example_builds_static_qdq_with_report(
    example: Path, capsys: pytest.CaptureFixture
) -> None:
    from pipeline.prepare import dynamic_tensors

    assert run(example, str(example / "configs" / "example.toml"), "--force") == 0
    out = example / "artifacts" / "build" / "example_cnn"
    qdq = onnx.load(str(out / "qdq.onnx"))
    assert any(n.op_type == "QuantizeLinear" for n in qdq.graph.node)
    assert dynamic_tensors(qdq) == []
    report = json.loads((out / "report.json").read_text())
    snr = report["accuracy"]["qdq_vs_float"]["probabilities"]["snr_db"]
    assert 20 < float(snr) < 200
    assert report["calibration"]["samples"] == 36 and report["calibration"]["heldout"] == 12
    assert len(list((out / "heldout").glob("*.npz"))) == 12
    record = json.loads((out / "record.json").read_text())["quantize"]
    assert record["status"] == "ok" and len(record["inputs"]["source_sha256"]) == 64
    assert "onnxruntime" in record["inputs"]["tools"]
    assert "QDQ written" in capsys.readouterr().out
    # BatchNorm folded and the dynamic batch fixed: visible in the report.
    steps = {c["step"] for c in report["prepare"] if c["details"]}
    assert steps, "preparation reported no change on a model with BatchNorm and a dynamic dim"


def test_rerun_is_skipped_and_change_rebuilds(example: Path, capsys: pytest.CaptureFixture) -> None:
    config = example / "configs" / "example.toml"
    assert run(example, str(config)) == 0
    capsys.readouterr()
    assert run(example, str(config)) == 0
    assert "up to date, nothing to do" in capsys.readouterr().out
    changed = example / "configs" / "changed.toml"
    changed.write_text(config.read_text().replace("samples = 48", "samples = 40"))
    assert run(example, str(changed)) == 0
    assert "QDQ written" in capsys.readouterr().out


def write_config(root: Path, source: str, calibration: str = "") -> Path:
    calibration = calibration or 'kind = "random"\nsamples = 4'
    path = root / "bad.toml"
    path.write_text(
        f'[model]\nname = "bad"\nsource = "{source}"\n[inputs]\ndims = {{ batch = 1 }}\n'
        f"[calibration]\n{calibration}\n"
    )
    return path


def test_truncated_model(example: Path, capsys: pytest.CaptureFixture) -> None:
    data = (example / "artifacts" / "example" / "example_cnn.onnx").read_bytes()
    (example / "trunc.onnx").write_bytes(data[: len(data) // 3])
    assert run(example, str(write_config(example, "trunc.onnx"))) == 1
    err = capsys.readouterr().err
    assert "trunc.onnx" in err and "truncated" in err
    assert not (example / "artifacts" / "build" / "bad" / "qdq.onnx").exists()


def test_missing_model(example: Path, capsys: pytest.CaptureFixture) -> None:
    assert run(example, str(write_config(example, "absent.onnx"))) == 1
    assert "absent.onnx does not exist" in capsys.readouterr().err


def test_unknown_config_key(example: Path, capsys: pytest.CaptureFixture) -> None:
    path = write_config(example, "x.onnx")
    path.write_text(path.read_text() + "[quantization]\nweight_typ = 'uint8'\n")
    assert run(example, str(path)) == 1
    assert "did you mean 'weight_type'" in capsys.readouterr().err


def test_bad_calibration_leaves_nothing_half_written(
    example: Path, capsys: pytest.CaptureFixture
) -> None:
    shutil.copy(example / "artifacts" / "example" / "example_cnn.onnx", example / "m.onnx")
    data = example / "wrongdtype"
    data.mkdir()
    for i in range(4):
        np.save(data / f"s{i}.npy", np.zeros((1, 3, 32, 32), np.float64))
    config = write_config(example, "m.onnx", 'kind = "tensors"\npath = "wrongdtype"')
    assert run(example, str(config)) == 1
    assert "dtype float64" in capsys.readouterr().err
    out = example / "artifacts" / "build" / "bad"
    assert not (out / "qdq.onnx").exists() and not (out / "record.json").exists()
    leftovers = [p.name for p in out.rglob("*") if ".tmp" in p.name]
    assert leftovers == []


def test_empty_calibration_folder(example: Path, capsys: pytest.CaptureFixture) -> None:
    shutil.copy(example / "artifacts" / "example" / "example_cnn.onnx", example / "m.onnx")
    (example / "empty").mkdir(exist_ok=True)
    config = write_config(example, "m.onnx", 'kind = "tensors"\npath = "empty"')
    assert run(example, str(config)) == 1
    assert "holds no tensor files" in capsys.readouterr().err


def test_help_lists_stages(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for stage in ("quantize", "compile", "publish", "doctor"):
        assert stage in out
