"""doctor: each barrier is detected, in this environment and in real second environments."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from release_fixtures import cached_build
from venvs import run_in, toolchain_python

from pipeline import doctor
from pipeline.__main__ import main
from pipeline.core.config import load_config
from pipeline.publish.release import publish_model
from qnn_ctx_runtime.toolchains import Toolchain, Toolchains, load_toolchains

X_ELITE = "snapdragon-x-elite"

# A table like runtime/qnn_ctx_runtime/toolchains.toml: two pins and one known, unpinned release.
PINS = Toolchains(
    default="2.7.0",
    known={
        "2.7.0": Toolchain("2.7.0", "2.51.0", "1.31.1"),
        "2.3.0": Toolchain("2.3.0", "2.47.0", "1.26.0"),
        "2.6.0": Toolchain("2.6.0", "2.50.40"),
    },
    source="pins.toml",
)


def test_probe_model_is_what_onnx_helper_builds():
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Add", ["x", "x"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="qnn-ctx-pipeline doctor"
    )
    model.ir_version = 7
    onnx.checker.check_model(model)
    assert model.SerializeToString() == doctor.PROBE_MODEL


@pytest.mark.parametrize(
    ("installed", "status", "words"),
    [
        ({"onnxruntime-qnn": "1.23.2", "onnxruntime": "1.19.0"}, "FAIL", "module clash"),
        ({"onnxruntime-qnn": "1.23.2"}, "OK", "onnxruntime-qnn 1.23.2"),
        ({"onnxruntime-qnn": "2.7.0"}, "FAIL", "needs the onnxruntime package"),
        ({"onnxruntime-qnn": "2.7.0", "onnxruntime": "1.31.1"}, "OK", "onnxruntime 1.31.1"),
        (
            {"onnxruntime-qnn": "2.7.0", "onnxruntime": "1.31.1", "onnxruntime-gpu": "1.31.1"},
            "WARN",
            "several onnxruntime flavours",
        ),
        ({"onnxruntime": "1.31.1"}, "FAIL", "onnxruntime-qnn is not installed"),
    ],
)
def test_packages(installed, status, words):
    row = doctor.check_packages(installed)
    assert (row.status, words in row.detail) == (status, True), row
    if status == "FAIL" and "clash" in words:
        assert row.fix.startswith("pip uninstall onnxruntime")


@pytest.mark.parametrize(
    ("installed", "status", "detail", "fix"),
    [
        (
            {"onnxruntime-qnn": "2.7.0", "onnxruntime": "1.31.1"},
            "OK",
            "onnxruntime-qnn 2.7.0 + onnxruntime 1.31.1, as pinned in pins.toml",
            "",  # nothing to fix
        ),
        (
            {"onnxruntime-qnn": "2.3.0", "onnxruntime": "1.31.1"},
            "FAIL",
            "onnxruntime-qnn 2.3.0 with onnxruntime 1.31.1; pins.toml pins 1.26.0",
            "pip install onnxruntime==1.26.0",
        ),
        (
            {"onnxruntime-qnn": "2.4.0", "onnxruntime": "1.31.1"},
            "WARN",
            "onnxruntime-qnn 2.4.0 is not pinned in pins.toml",
            "install a pinned pair, e.g. onnxruntime-qnn==2.7.0 onnxruntime==1.31.1, or verify "
            "2.4.0 and add a pin",
        ),
        (
            {"onnxruntime-qnn": "2.6.0", "onnxruntime": "1.31.1"},
            "WARN",
            "no verified onnxruntime for onnxruntime-qnn 2.6.0 in pins.toml",
            "verify the pair (see the QNN probe row) and pin it",
        ),
        ({"onnxruntime-qnn": "1.23.2"}, "SKIP", "no onnxruntime-qnn 2.x installed", ""),
    ],
)
def test_pinned_pair(installed, status, detail, fix):
    row = doctor.check_pinned_pair(installed, PINS)
    assert row.status == status, row
    assert row.detail.startswith(detail), row
    assert row.fix == fix, row


def test_pinned_pair_reads_the_packaged_table():
    """The real table: 2.5.0 is pinned with 1.31.1; 2.4.0 is known but has no verified pair."""
    table = load_toolchains()
    row = doctor.check_pinned_pair({"onnxruntime-qnn": "2.5.0", "onnxruntime": "1.31.1"}, table)
    assert (row.status, row.fix) == ("OK", "") and table.source in row.detail
    row = doctor.check_pinned_pair({"onnxruntime-qnn": "2.4.0", "onnxruntime": "1.31.1"}, table)
    assert (row.status, row.fix) == ("WARN", "verify the pair (see the QNN probe row) and pin it")


def test_emulated_x86_on_arm64_windows_fails():
    row = doctor.check_emulation("arm64", "x86_64", "win32")
    assert row.status == "FAIL" and "install native ARM64 Python" in row.fix
    assert doctor.check_emulation("arm64", "arm64", "win32").status == "OK"
    assert doctor.check_emulation("x86_64", "x86_64", "linux").status == "OK"


def test_non_ascii_paths():
    paths = {"python": "/usr/bin/python3", "artifacts": "/home/jörg/artifacts"}
    assert doctor.check_paths(paths, windows=True).status == "FAIL"
    row = doctor.check_paths(paths, windows=False)
    assert row.status == "WARN" and "artifacts: /home/jörg/artifacts" in row.detail
    assert "python" not in row.detail.split("in ", 1)[1]
    assert doctor.check_paths({"python": "/usr/bin/python3"}, windows=True).status == "OK"


def test_unreadable_release_is_a_failed_row(tmp_path: Path):
    release = tmp_path / "releases" / "m" / "1.0.0"
    release.mkdir(parents=True)
    (release / "manifest.json").write_text('{"schema_version": "7"}', "utf-8")
    (row,) = doctor.check_releases([release], None, None)
    assert row.status == "FAIL" and "unreadable manifest" in row.detail
    assert "schema_version '7' is not a format this qnn-ctx-runtime reads" in row.detail
    assert row.fix == "publish the release again"


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    build = cached_build(tmp_path_factory).copy(tmp_path_factory.mktemp("doctor") / "p")
    publish_model(load_config(build.config), build.artifacts)
    return build.artifacts


EXPECTED_CHECKS = {
    "python",
    "emulation",
    "packages",
    "pinned pair",
    "QNN SDK",
    "QNN probe",
    "device",
    "QNN GPU backend",
    "ASCII paths",
    "release tiny/1.0.0",
    "release tiny/1.0.0: snapdragon-x-elite_qnn-2.51.0",
    "release tiny/1.0.0: snapdragon-8-gen-3_qnn-2.51.0",
}


@pytest.mark.qnn
def test_doctor_here_prints_its_table(artifacts: Path, capsys):
    assert main(["doctor", "--artifacts", str(artifacts)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| check | status | detail | fix |")
    assert "| QNN probe | OK | 2 of 2 nodes on QNN" in out
    assert "No barrier found." in out
    assert main(["doctor", "--artifacts", str(artifacts), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["check"] for r in rows} == EXPECTED_CHECKS
    by_check = {r["check"]: r for r in rows}
    gpu = by_check.pop("QNN GPU backend")  # no Adreno GPU on an x86 machine
    assert gpu["status"] == "SKIP" and "QNN_BACKEND_ERROR_CANNOT_INITIALIZE" in gpu["detail"]
    assert "the GPU path is unverified on hardware" in gpu["detail"]
    assert all(r["status"] == "OK" for r in by_check.values()), rows
    assert by_check["device"]["detail"].startswith("not identified (an x86 machine")
    assert "the loader tries the lowest HTP arch first" in by_check["device"]["detail"]
    assert by_check["release tiny/1.0.0"]["detail"].endswith("loads snapdragon-x-elite_qnn-2.51.0")
    variant = by_check["release tiny/1.0.0: snapdragon-8-gen-3_qnn-2.51.0"]["detail"]
    assert variant.startswith("htp, QNN SDK 2.51.0 (runtime 2.51.0), HTP v75: tried 2 of 2")


def doctor_in(python: Path, artifacts: Path) -> tuple[int, dict[str, dict]]:
    done = run_in(
        python,
        "from pipeline.__main__ import main; import sys; sys.exit(main())",
        "doctor",
        "--json",
        "--artifacts",
        str(artifacts),
    )
    assert done.stdout.strip(), done.stderr[-3000:]
    return done.returncode, {r["check"]: r for r in json.loads(done.stdout)}


@pytest.mark.qnn
def test_bad_pair_falls_back_to_cpu_and_doctor_says_so(artifacts: Path):
    """onnxruntime-qnn 2.3.0 with onnxruntime 1.31.1 (FACTS §2): a real env, a real fallback."""
    python = toolchain_python("2.3.0", "1.31.1")
    code, rows = doctor_in(python, artifacts)
    assert code == 1
    assert rows["pinned pair"]["status"] == "FAIL"
    assert rows["pinned pair"]["fix"] == "pip install onnxruntime==1.26.0"
    assert rows["QNN probe"]["status"] == "FAIL"
    assert "the probe ran on CPU" in rows["QNN probe"]["detail"]
    assert rows["release tiny/1.0.0"]["status"] == "FAIL"  # SDK 2.51.0 > 2.47.0


@pytest.mark.qnn
def test_release_newer_than_the_runtime_is_flagged(artifacts: Path):
    python = toolchain_python("2.5.0", "1.31.1")
    code, rows = doctor_in(python, artifacts)
    assert code == 1
    assert rows["QNN probe"]["status"] == "OK" and rows["pinned pair"]["status"] == "OK"
    release = rows["release tiny/1.0.0"]
    assert release["status"] == "FAIL"
    assert "needs QNN SDK 2.51.0, runtime has 2.49.40" in release["detail"]
    assert release["fix"].startswith("Install onnxruntime-qnn 2.7.0")
    assert "rebuild with toolchain 2.5.0" in release["fix"]


@pytest.mark.qnn
def test_archive_release_is_checked_too(artifacts: Path, tmp_path: Path, capsys):
    archive = next((artifacts / "releases").rglob("*.tar.gz"))
    copy = shutil.copy(archive, tmp_path / archive.name)
    rows = doctor.diagnose(tmp_path / "none", [Path(copy)], "snapdragon-888", probe=False)
    row = next(r for r in rows if r.check == f"release {archive.name}")
    assert row.status == "FAIL"
    variant = next(r for r in rows if r.check == f"release {archive.name}: {X_ELITE}_qnn-2.51.0")
    assert variant.status == "SKIP" and variant.detail.endswith("built for HTP v73 > device's v68")
    assert "add target 'snapdragon-888'" in row.fix.lower()


# -- the device, the GPU backend, and each variant -------------------------------------------


def test_device_row_says_how_the_chip_was_found_or_that_it_was_not():
    from qnn_ctx_runtime.device import ChipFact, detect_device

    fact = ChipFact("Android getprop ro.soc.model", "SM8750")
    row = doctor.check_device(detect_device(facts=[fact], machine="arm64"))
    assert row.status == "OK"
    assert row.detail.startswith("snapdragon-8-elite (soc 69, HTP v79) from Android getprop")
    unknown = detect_device(
        facts=[ChipFact("/proc/cpuinfo Hardware", "Qualcomm QCS6490")], machine="arm64"
    )
    row = doctor.check_device(unknown)
    assert row.status == "WARN" and "pass --target" in row.fix
    assert "/proc/cpuinfo Hardware: 'Qualcomm QCS6490'" in row.detail
    assert "the loader tries the lowest HTP arch first" in row.detail
    simulator = doctor.check_device(detect_device(facts=[], machine="x86_64"))
    assert simulator.status == "OK" and simulator.fix == ""


def probed(gpu: str, stderr: str = "") -> doctor.Probed:
    return doctor.Probed(0, "", stderr, 180, {"gpu": gpu})


def test_gpu_row_on_a_device():
    from qnn_ctx_runtime.device import detect_device

    device = detect_device("snapdragon-x-elite", facts=[], machine="arm64")
    row = doctor.check_gpu(probed("ok"), device)
    assert row.status == "OK" and "unverified on hardware by this project" in row.detail
    failed = "[E:onnxruntime] QNN_BACKEND_ERROR_CANNOT_INITIALIZE: Backend failed to initialize"
    row = doctor.check_gpu(probed("FAIL : fallback to CPU EP has been disabled", failed), device)
    assert (
        row.status == "WARN"
        and "cannot initialise (QNN_BACKEND_ERROR_CANNOT_INITIALIZE)" in row.detail
    )
    assert row.fix.startswith("update the Adreno GPU (OpenCL) driver")
    assert doctor.check_gpu(None, device).status == "SKIP"


@pytest.mark.qnn
def test_a_release_without_the_devices_arch_is_a_warning_naming_the_target(artifacts: Path):
    releases = sorted((artifacts / "releases").glob("*/*"))
    rows = doctor.diagnose(artifacts, [], "snapdragon-8-elite", probe=False)
    row = next(r for r in rows if r.check == "release tiny/1.0.0")
    assert releases and row.status == "WARN"
    assert "loads snapdragon-8-gen-3_qnn-2.51.0, built for HTP v75" in row.detail
    assert row.fix == "add 'snapdragon-8-elite' to compile.targets and publish again"
    variant = next(r for r in rows if r.check == f"release tiny/1.0.0: {X_ELITE}_qnn-2.51.0")
    assert variant.status == "OK" and "tried 2 of 2" in variant.detail
