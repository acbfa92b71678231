"""pipeline.runtime: verified loading, safe extraction, version-aware choice, faults."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import tarfile
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest
from release_fixtures import (
    MODEL,
    TARGETS,
    VERSION,
    cached_build,
    run_python,
    write_config,
    write_quantize_record,
    write_variant,
)
from test_manifest import manifest as manifest_data
from test_manifest import variant as make_variant
from venvs import run_in, toolchain_python

from pipeline import qnn, runtime
from pipeline.config import load_config
from pipeline.errors import PipelineError, ReleaseError
from pipeline.manifest import MANIFEST_FILE, Manifest
from pipeline.publish import publish_model

X_ELITE, GEN3 = "snapdragon-x-elite", "snapdragon-8-gen-3"
FEED = {"x": np.random.default_rng(3).standard_normal((1, 3, 16, 16)).astype(np.float32)}


# -- no QNN needed ------------------------------------------------------------------------------


def test_import_pulls_in_nothing_heavy():
    code = textwrap.dedent(
        """
        import sys
        import pipeline.runtime
        print(sorted({m.split('.')[0] for m in sys.modules} & {'onnx', 'PIL', 'tqdm', 'onnxruntime'}))
        """
    )
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def fake_runtime(sdk: str, package: str = "2.7.0") -> qnn.InstalledQnn:
    """Version facts only: choose_variant must decide from them without touching QNN."""
    return qnn.InstalledQnn(package, sdk, "1.31.1", "plugin")


def sdk_manifest(*specs: tuple[str, int, str]) -> Manifest:
    """Variants (sdk, htp_arch, onnxruntime-qnn) of one model, for choice rules without QNN."""
    data = manifest_data(cpu_fallback=None)
    data["variants"] = []
    for sdk, arch, toolchain in specs:
        v = dataclasses.asdict(make_variant(f"t{arch}_qnn-{sdk}", sdk, arch))
        data["variants"].append(v | {"onnxruntime_qnn": toolchain})
    return Manifest.from_dict(data)


RELEASE = sdk_manifest(("2.49.40", 73, "2.5.0"), ("2.51.0", 73, "2.7.0"), ("2.51.0", 69, "2.7.0"))


@pytest.mark.parametrize(
    ("runtime_sdk", "target", "expected"),
    [
        ("2.51.0", "snapdragon-x-elite", "t73_qnn-2.51.0"),  # exact arch, newest SDK
        ("2.50.40", "snapdragon-x-elite", "t73_qnn-2.49.40"),  # newest SDK <= runtime's
        ("2.51.0", "snapdragon-8-gen-1", "t69_qnn-2.51.0"),  # v73 is too new for a v69 device
        ("2.51.0", "snapdragon-8-gen-3", "t73_qnn-2.51.0"),  # v75 device: closest lower arch
        ("2.52.0", None, "t73_qnn-2.51.0"),  # arch unknown: newest SDK, then highest arch
    ],
)
def test_choice_rule(runtime_sdk, target, expected):
    chosen = runtime.choose_variant(RELEASE, fake_runtime(runtime_sdk), runtime.device_for(target))
    assert chosen.id == expected


def test_runtime_sdk_too_old_names_both_sdks_and_the_fixes():
    with pytest.raises(ReleaseError) as info:
        runtime.choose_variant(RELEASE, fake_runtime("2.47.0", "2.3.0"), runtime.device_for(None))
    error = info.value
    assert "onnxruntime-qnn 2.3.0 (QNN SDK 2.47.0)" in error.message
    assert "the release has QNN SDK 2.49.40, 2.51.0" in error.message
    assert "built with QNN SDK 2.49.40 > runtime's 2.47.0" in error.message
    assert error.tip.startswith("Install onnxruntime-qnn 2.5.0 (QNN SDK 2.49.40) with onnxruntime")
    assert "rebuild with toolchain 2.3.0 (QNN SDK 2.47.0)" in error.tip


def test_device_arch_too_old_says_which_target_to_add():
    with pytest.raises(ReleaseError) as info:
        runtime.choose_variant(
            RELEASE, fake_runtime("2.51.0"), runtime.device_for("snapdragon-888")
        )
    assert "built for HTP v69 > device's v68" in info.value.message
    assert info.value.tip.startswith("Add target 'snapdragon-888' (HTP v68) to compile.targets")


def test_unknown_sdk_uses_a_pin_free_fix():
    with pytest.raises(ReleaseError) as info:
        runtime.choose_variant(RELEASE, fake_runtime("2.40.0", "1.23.2"), runtime.device_for(None))
    assert "rebuild with a toolchain whose QNN SDK is <= 2.40.0" in info.value.tip


def test_unknown_target_lists_known_ones():
    with pytest.raises(ReleaseError, match="Did you mean 'snapdragon-x-elite'"):
        runtime.device_for("snapdragon-x-elit")


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("v2.51.0.260929181845", (2, 51, 0)), ("2.49.40", (2, 49, 40)), ("2.47", (2, 47))],
)
def test_parse_version(text, parsed):
    assert runtime.parse_version(text) == parsed


# -- with the QNN EP and its HTP simulator ------------------------------------------------------


@pytest.fixture(scope="session")
def release(tmp_path_factory) -> Path:
    """A published release of the two-variant build (x-elite embedded, 8 Gen 3 with .bin)."""
    build = cached_build(tmp_path_factory)
    folder = tmp_path_factory.mktemp("runtime-release")
    copy = build.copy(folder / "project")
    return publish_model(load_config(copy.config), copy.artifacts).folder


@pytest.fixture
def release_copy(release: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "release"
    shutil.copytree(release, dest)
    return dest


def qdq_reference(release: Path) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(release / "cpu" / f"{MODEL}_qdq.onnx"))
    return session.run(None, FEED)[0]


@pytest.mark.qnn
@pytest.mark.parametrize(
    ("target", "variant"),
    [
        (X_ELITE, f"{X_ELITE}_qnn-2.51.0"),
        (GEN3, f"{GEN3}_qnn-2.51.0"),
        ("snapdragon-8-elite", f"{GEN3}_qnn-2.51.0"),  # v79 device runs the v75 binary
        (None, f"{GEN3}_qnn-2.51.0"),  # simulator, no target: the variant's own arch
    ],
)
def test_load_folder_and_run_on_the_simulator(release: Path, target, variant):
    with runtime.load(release, target=target) as model:
        assert model.variant.id == variant
        assert model.provider == "QNNExecutionProvider" and not model.on_cpu
        facts = model.facts()
        assert facts["qnn_sdk_version"] == "2.51.0" and facts["runtime"].startswith(
            "onnxruntime-qnn 2.7.0"
        )
        out = model.run(FEED)
    assert set(out) == {"y"} and out["y"].shape == (1, 4, 16, 16)
    assert np.abs(out["y"] - qdq_reference(release)).max() < 0.1


@pytest.mark.qnn
def test_load_archive_extracts_verifies_and_cleans_up(release: Path, tmp_path: Path):
    archive = release / f"{MODEL}-{VERSION}.tar.gz"
    model = runtime.load(archive, target=GEN3)
    extracted = model.root
    assert extracted.is_dir() and not extracted.is_relative_to(release)
    assert (extracted / model.variant.files[1].path).is_file()  # the .bin beside its ctx
    np.testing.assert_allclose(
        model.run(FEED)["y"], runtime.load(release, target=GEN3).run(FEED)["y"]
    )
    model.close()
    assert not extracted.exists()
    kept = tmp_path / "kept"
    with runtime.load(archive, target=X_ELITE, extract_to=kept) as model:
        assert model.root == kept
    assert (kept / MANIFEST_FILE).is_file()
    with pytest.raises(ReleaseError, match="is not empty"):
        runtime.load(archive, extract_to=kept)


@pytest.mark.qnn
def test_no_heavy_modules_after_a_real_load(release: Path):
    code = textwrap.dedent(
        """
        import sys, numpy as np
        from pipeline import qnn, runtime
        model = runtime.load(sys.argv[1], target="snapdragon-x-elite")
        model.run({"x": np.zeros((1, 3, 16, 16), np.float32)})
        print(sorted({m.split('.')[0] for m in sys.modules} & {'onnx', 'PIL', 'tqdm'}))
        """
    )
    done = run_python(code, str(release))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    index = len(data) // 2 if offset is None else offset
    data[index] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.qnn
@pytest.mark.parametrize("which", ["ctx", "bin", "cpu"])
def test_one_flipped_byte_in_a_folder_is_refused(release_copy: Path, which: str):
    manifest = Manifest.read(release_copy / MANIFEST_FILE)
    gen3 = next(v for v in manifest.variants if v.target == GEN3)
    path = {
        "ctx": gen3.files[0].path,
        "bin": gen3.files[1].path,
        "cpu": manifest.cpu_fallback.model,
    }[which]
    flip_byte(release_copy / path)
    with pytest.raises(ReleaseError) as info:
        runtime.load(release_copy, target=GEN3)
    assert f"{path}: sha256" in info.value.message and "it was modified" in info.value.message
    assert "failed verification" in info.value.message


@pytest.mark.qnn
def test_one_flipped_byte_in_the_archive_is_refused(release_copy: Path):
    archive = release_copy / f"{MODEL}-{VERSION}.tar.gz"
    flip_byte(archive, offset=200)
    with pytest.raises(ReleaseError, match=r"does not match tiny-1\.0\.0\.tar\.gz\.sha256"):
        runtime.load(archive)


def rebuild_archive(release: Path, dest: Path, extra=(), drop=(), tamper=None, fmt="tar"):
    """Re-pack ``release`` into ``dest``, adding members, dropping some, or changing one."""
    manifest = Manifest.read(release / MANIFEST_FILE)
    names = [MANIFEST_FILE, *(e.path for e in manifest.files())]
    members = [(n, (release / n).read_bytes()) for n in names if n not in drop]
    if tamper:
        members = [
            (n, bytes(b[:-1]) + bytes([b[-1] ^ 1]) if n == tamper else b) for n, b in members
        ]
    if fmt == "zip":
        with zipfile.ZipFile(dest, "w") as zf:
            for name, data in members:
                zf.writestr(name, data)
            for item in extra:
                item(zf)
        return dest
    with tarfile.open(dest, "w:gz") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for item in extra:
            item(tar)
    return dest


def tar_file(name: str, data: bytes = b"evil"):
    def add(tar):
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    return add


def tar_link(name: str, target: str, hard: bool = False):
    def add(tar):
        info = tarfile.TarInfo(name)
        info.type = tarfile.LNKTYPE if hard else tarfile.SYMTYPE
        info.linkname = target
        tar.addfile(info)

    return add


def zip_symlink(name: str, target: str):
    def add(zf):
        info = zipfile.ZipInfo(name)
        info.external_attr = (0o120777 << 16) | 0
        zf.writestr(info, target)

    return add


@pytest.mark.qnn
@pytest.mark.parametrize(
    ("extra", "fmt", "expected"),
    [
        ([tar_file("../escape.txt")], "tar", "'../escape.txt' has '..'"),
        ([tar_file("cpu/../../escape.txt")], "tar", "has '..'"),
        ([tar_file("/tmp/absolute-escape.txt")], "tar", "is absolute"),
        ([tar_link("cpu/link.onnx", "/etc/passwd")], "tar", "cpu/link.onnx is a link"),
        ([tar_link("cpu/hard.onnx", "manifest.json", hard=True)], "tar", "is a link"),
        ([zip_symlink("cpu/link.onnx", "../../etc/passwd")], "zip", "cpu/link.onnx is a link"),
        ([tar_file("cpu/extra.onnx")], "tar", "cpu/extra.onnx is in the archive but not in the"),
    ],
)
def test_unsafe_or_inconsistent_archives_are_refused(release, tmp_path, extra, fmt, expected):
    suffix = ".zip" if fmt == "zip" else ".tar.gz"
    archive = rebuild_archive(release, tmp_path / f"bad{suffix}", extra=extra, fmt=fmt)
    with pytest.raises(ReleaseError) as info:
        runtime.load(archive)
    assert expected in info.value.message
    assert str(archive) in info.value.message
    assert not (tmp_path.parent / "escape.txt").exists()
    assert not Path("/tmp/absolute-escape.txt").exists()


@pytest.mark.qnn
def test_archive_missing_a_manifest_file_is_refused(release: Path, tmp_path: Path):
    manifest = Manifest.read(release / MANIFEST_FILE)
    dropped = manifest.cpu_fallback.model
    archive = rebuild_archive(release, tmp_path / "short.tar.gz", drop=[dropped])
    with pytest.raises(ReleaseError, match=f"{dropped} is in the manifest but not in the archive"):
        runtime.load(archive)


@pytest.mark.qnn
def test_archive_with_a_flipped_member_byte_is_refused(release: Path, tmp_path: Path):
    manifest = Manifest.read(release / MANIFEST_FILE)
    target = manifest.variants[0].files[0].path
    archive = rebuild_archive(release, tmp_path / "flip.tar.gz", tamper=target)
    with pytest.raises(ReleaseError) as info:
        runtime.load(archive)
    assert "files were modified" in info.value.message and target in info.value.message
    assert not any(p.name.startswith("qnn-release-") for p in tmp_path.iterdir())


@pytest.mark.qnn
def test_truncated_archive_is_refused(release: Path, tmp_path: Path):
    data = (release / f"{MODEL}-{VERSION}.tar.gz").read_bytes()
    archive = tmp_path / "cut.tar.gz"  # no .sha256 beside it: the archive itself must tell
    archive.write_bytes(data[: len(data) // 2])
    with pytest.raises(ReleaseError, match="is damaged or truncated"):
        runtime.load(archive)


@pytest.mark.qnn
def test_not_a_release():
    with pytest.raises(ReleaseError, match="neither a release folder nor a release archive"):
        runtime.load(Path(__file__))


@pytest.mark.qnn
def test_bad_feeds_are_named(release: Path):
    with runtime.load(release, target=X_ELITE) as model, pytest.raises(PipelineError) as info:
        model.run({"x": FEED["x"].astype(np.float64)[:, :, :8], "z": 1})
    message = info.value.message
    assert "'z' is not an input" in message
    assert "dtype float64, expected float32" in message
    assert "shape [1, 3, 8, 16], expected [1, 3, 16, 16]" in message


@pytest.mark.qnn
def test_cpu_fallback_only_when_asked_and_it_says_so(release: Path):
    with pytest.raises(ReleaseError, match="built for HTP v73 > device's v68"):
        runtime.load(release, target="snapdragon-888")
    with pytest.warns(RuntimeWarning, match="on the CPU, not the NPU: No variant"):
        model = runtime.load(release, target="snapdragon-888", allow_cpu_fallback=True)
    assert model.on_cpu and model.provider == "CPUExecutionProvider"
    assert "HTP v73 > device's v68" in model.facts()["fallback_reason"]
    np.testing.assert_allclose(model.run(FEED)["y"], qdq_reference(release), rtol=0, atol=1e-6)


@pytest.mark.qnn
def test_cpu_fallback_needs_a_cpu_model(tmp_path_factory):
    build = cached_build(tmp_path_factory).copy(tmp_path_factory.mktemp("nocpu") / "p")
    folder = publish_model(load_config(build.config), build.artifacts, cpu_fallback=False).folder
    with pytest.raises(ReleaseError, match="the release has no CPU model"):
        runtime.load(folder, target="snapdragon-888", allow_cpu_fallback=True)


class _EngineErrorOnce:
    """Fault injection: the HTP subsystem restart (SSR) cannot be caused on the simulator, so
    the first run of the real session raises onnxruntime's real EngineError instead."""

    def __init__(self, real, times: int = 1) -> None:
        self.real, self.left = real, times

    def run(self, names, feeds):
        from onnxruntime.capi.onnxruntime_pybind11_state import EngineError

        if self.left:
            self.left -= 1
            raise EngineError("QNN HTP SSR detected (injected)")
        return self.real.run(names, feeds)

    def get_providers(self):
        return self.real.get_providers()


@pytest.mark.qnn
def test_engine_error_recreates_the_session_once(release: Path):
    import onnxruntime as ort

    with runtime.load(release, target=X_ELITE) as model:
        expected = model.run(FEED)["y"]
        model._session = _EngineErrorOnce(model._session)
        with pytest.warns(RuntimeWarning, match="ENGINE_ERROR"):
            out = model.run(FEED)
        assert model.restarts == 1
        assert isinstance(model._session, ort.InferenceSession)  # a fresh real session
        np.testing.assert_array_equal(out["y"], expected)


@pytest.mark.qnn
def test_engine_error_twice_is_an_error(release: Path, monkeypatch):
    with runtime.load(release, target=X_ELITE) as model:
        real_create = model._create_session
        model._session = _EngineErrorOnce(model._session)
        monkeypatch.setattr(model, "_create_session", lambda: _EngineErrorOnce(real_create()))
        with pytest.warns(RuntimeWarning), pytest.raises(ReleaseError, match="again"):
            model.run(FEED)
        assert model.restarts == 1


# -- a real second environment: onnxruntime-qnn 2.5.0 (QNN SDK 2.49.40) -------------------------

LOAD_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import onnxruntime as ort
    from pipeline import qnn, runtime
    from pipeline.errors import ReleaseError
    try:
        model = runtime.load(sys.argv[1])
    except ReleaseError as exc:
        qnn = [d for d in ort.get_ep_devices() if d.ep_name == "QNNExecutionProvider"]
        print(json.dumps({"error": exc.message, "tip": exc.tip, "qnn_registered": bool(qnn)}))
    else:
        y = model.run({"x": np.load(sys.argv[2])})["y"]
        np.save(sys.argv[3], y)
        print(json.dumps({"variant": model.variant.id, "facts": model.facts()}))
    """
)

COMPILE_SCRIPT = textwrap.dedent(
    """
    import sys
    import onnxruntime as ort, onnxruntime_qnn as oq
    ort.register_execution_provider_library("QNNExecutionProvider", oq.get_library_path())
    devs = [d for d in ort.get_ep_devices() if d.ep_name == "QNNExecutionProvider"]
    so = ort.SessionOptions()
    so.add_provider_for_devices(devs, {"backend_type": "htp", "soc_model": "60", "htp_arch": "73"})
    ort.ModelCompiler(so, sys.argv[1], embed_compiled_data_into_model=True,
                      flags=ort.OrtCompileApiFlags.ERROR_IF_NO_NODES_COMPILED).compile_to_file(sys.argv[2])
    """
)


@pytest.fixture(scope="session")
def python_250() -> Path:
    pytest.importorskip("onnxruntime_qnn")
    return toolchain_python("2.5.0", "1.31.1")


def run_load(python: Path, release: Path, tmp: Path) -> dict:
    np.save(tmp / "x.npy", FEED["x"])
    done = run_in(python, LOAD_SCRIPT, str(release), str(tmp / "x.npy"), str(tmp / "y.npy"))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.qnn
def test_release_from_2_7_0_in_a_2_5_0_environment_fails_cleanly(release, python_250, tmp_path):
    result = run_load(python_250, release, tmp_path)
    assert "error" in result, result
    assert "onnxruntime-qnn 2.5.0 (QNN SDK 2.49.40)" in result["error"]
    assert "the release has QNN SDK 2.51.0" in result["error"]
    assert "built with QNN SDK 2.51.0 > runtime's 2.49.40" in result["error"]
    assert result["tip"].startswith("Install onnxruntime-qnn 2.7.0 (QNN SDK 2.51.0)")
    assert "rebuild with toolchain 2.5.0 (QNN SDK 2.49.40)" in result["tip"]
    assert result["qnn_registered"] is False  # refused before any QNN call


@pytest.fixture(scope="session")
def two_sdk_release(tmp_path_factory, python_250) -> Path:
    """x-elite compiled by 2.7.0 (SDK 2.51.0, here) and by 2.5.0 (SDK 2.49.40, in its venv)."""
    build = cached_build(tmp_path_factory).copy(tmp_path_factory.mktemp("two-sdk") / "p")
    write_config(build.root, [t for t, _ in TARGETS], ["2.7.0", "2.5.0"], VERSION)
    write_quantize_record(build)
    folder = build.variant_folder(X_ELITE, "2.5.0")
    folder.mkdir(parents=True)
    ctx = folder / f"{MODEL}_{X_ELITE}_ctx.onnx"
    done = run_in(python_250, COMPILE_SCRIPT, str(build.build / "qdq.onnx"), str(ctx))
    assert done.returncode == 0, done.stderr[-3000:]
    write_variant(folder, [ctx.name], X_ELITE, toolchain="2.5.0", onnxruntime="1.31.1")
    return publish_model(load_config(build.config), build.artifacts).folder


@pytest.mark.qnn
def test_each_environment_picks_the_newest_sdk_it_can_run(two_sdk_release, python_250, tmp_path):
    manifest = Manifest.read(two_sdk_release / MANIFEST_FILE)
    assert sorted(v.id for v in manifest.variants) == [
        f"{GEN3}_qnn-2.51.0",
        f"{X_ELITE}_qnn-2.49.40",
        f"{X_ELITE}_qnn-2.51.0",
    ]
    assert [e.id for e in manifest.excluded] == [f"{GEN3}_qnn-2.49.40"]
    old = run_load(python_250, two_sdk_release, tmp_path)
    assert old["variant"] == f"{X_ELITE}_qnn-2.49.40", old
    y_old = np.load(tmp_path / "y.npy")
    with runtime.load(two_sdk_release, target=X_ELITE) as model:
        assert model.variant.id == f"{X_ELITE}_qnn-2.51.0"
        y_new = model.run(FEED)["y"]
    assert np.abs(y_old - qdq_reference(two_sdk_release)).max() < 0.1
    assert np.abs(y_new - y_old).max() < 0.1


@pytest.mark.qnn
def test_an_older_sdk_binary_runs_on_a_newer_runtime(two_sdk_release, tmp_path):
    """FACTS §3: binaries of an older SDK load on a newer runtime; keep only the 2.49.40 one."""
    dest = tmp_path / "old-only"
    shutil.copytree(two_sdk_release, dest)
    data = json.loads((dest / MANIFEST_FILE).read_text("utf-8"))
    data["variants"] = [v for v in data["variants"] if v["qnn_sdk_version"] == "2.49.40"]
    (dest / MANIFEST_FILE).write_text(json.dumps(data), "utf-8")
    with runtime.load(dest, target=X_ELITE) as model:
        assert model.variant.qnn_sdk_version == "2.49.40"
        assert np.abs(model.run(FEED)["y"] - qdq_reference(dest)).max() < 0.1


def test_emulation_check_is_false_on_native_linux():
    if os.name == "nt":
        pytest.skip("checks the Linux answer")
    assert runtime.native_machine() == runtime.process_machine()
    assert runtime.emulated_on_arm64() is False
