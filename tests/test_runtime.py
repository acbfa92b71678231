"""qnn_ctx_runtime: verified loading, safe extraction, version-aware choice, faults, and
releases of every manifest format."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import tarfile
import tempfile
import textwrap
import warnings
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
    write_variant,
)
from test_manifest import manifest as manifest_data
from test_manifest import variant as make_variant
from venvs import run_in, toolchain_python

import qnn_ctx_runtime
from pipeline.core.config import load_config
from pipeline.publish.release import publish_model
from qnn_ctx_runtime import qnn
from qnn_ctx_runtime.device import (
    detect_device,
    device_for,
    emulated_on_arm64,
    native_machine,
    process_machine,
)
from qnn_ctx_runtime.errors import FeedError, ReleaseError, UsageError
from qnn_ctx_runtime.manifest import MANIFEST_FILE, SINGLE_BUCKET, Manifest, SchemaVersion
from qnn_ctx_runtime.release import sha256_file
from qnn_ctx_runtime.select import SIMULATOR_REFUSES_SHARED, choose_variant, parse_version

X_ELITE, GEN3 = "snapdragon-x-elite", "snapdragon-8-gen-3"
FEED = {"x": np.random.default_rng(3).standard_normal((1, 3, 16, 16)).astype(np.float32)}


# -- no QNN needed ------------------------------------------------------------------------------

# Every module of the runtime, imported in a child with ``pipeline`` made unimportable: the
# device side must neither import the builder nor need it (the builder is importable here).
IMPORT_ALL = """
import pkgutil, sys
sys.modules["pipeline"] = None  # any import of pipeline now raises ImportError
import qnn_ctx_runtime
names = sorted(m.name for m in pkgutil.walk_packages(qnn_ctx_runtime.__path__, "qnn_ctx_runtime."))
for name in names:
    __import__(name)
print(",".join(names))
print(sorted({m.split('.')[0] for m in sys.modules} & {'onnx', 'PIL', 'tqdm', 'onnxruntime'}))
"""


def test_import_pulls_in_nothing_heavy():
    done = run_python(IMPORT_ALL)
    assert done.returncode == 0, done.stderr
    modules, heavy = done.stdout.strip().splitlines()
    assert {"qnn_ctx_runtime.loader", "qnn_ctx_runtime.sessions"} <= set(modules.split(","))
    assert heavy == "[]"


def test_runtime_imports_nothing_from_pipeline():
    """qnn_ctx_runtime is its own distribution: not one of its modules imports ``pipeline``."""
    done = run_python(IMPORT_ALL)
    assert done.returncode == 0, done.stderr  # an import of pipeline would raise ImportError
    assert len(done.stdout.splitlines()[0].split(",")) >= 12, done.stdout
    code = textwrap.dedent(
        """
        import pkgutil, sys
        import qnn_ctx_runtime
        for m in pkgutil.walk_packages(qnn_ctx_runtime.__path__, "qnn_ctx_runtime."):
            __import__(m.name)
        print(sorted(m for m in sys.modules if m == "pipeline" or m.startswith("pipeline.")))
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
        ("2.52.0", None, "t69_qnn-2.51.0"),  # not identified: lowest arch, then newest SDK
    ],
)
def test_choice_rule(runtime_sdk, target, expected):
    device = detect_device(target, facts=[], machine="x86_64")  # nothing read from this machine
    chosen = choose_variant(RELEASE, fake_runtime(runtime_sdk), device)
    assert chosen.id == expected


def test_runtime_sdk_too_old_names_both_sdks_and_the_fixes():
    with pytest.raises(ReleaseError) as info:
        choose_variant(RELEASE, fake_runtime("2.47.0", "2.3.0"), device_for(None))
    error = info.value
    assert "onnxruntime-qnn 2.3.0 (QNN SDK 2.47.0)" in error.message
    assert "the release has QNN SDK 2.49.40, 2.51.0" in error.message
    assert "built with QNN SDK 2.49.40 > runtime's 2.47.0" in error.message
    assert error.tip.startswith("Install onnxruntime-qnn 2.5.0 (QNN SDK 2.49.40) with onnxruntime")
    assert "rebuild with toolchain 2.3.0 (QNN SDK 2.47.0)" in error.tip


def test_device_arch_too_old_says_which_target_to_add():
    with pytest.raises(ReleaseError) as info:
        choose_variant(RELEASE, fake_runtime("2.51.0"), device_for("snapdragon-888"))
    assert "built for HTP v69 > device's v68" in info.value.message
    assert info.value.tip.startswith("Add target 'snapdragon-888' (HTP v68) to compile.targets")


def test_unknown_sdk_uses_a_pin_free_fix():
    with pytest.raises(ReleaseError) as info:
        choose_variant(RELEASE, fake_runtime("2.40.0", "1.23.2"), device_for(None))
    assert "rebuild with a toolchain whose QNN SDK is <= 2.40.0" in info.value.tip


def test_unknown_target_lists_known_ones():
    with pytest.raises(UsageError, match="Did you mean 'snapdragon-x-elite'") as info:
        device_for("snapdragon-x-elit")
    assert "Known targets: snapdragon-888, " in info.value.message
    with pytest.raises(UsageError, match="Unknown target 'snapdragon-x-elit'"):
        qnn_ctx_runtime.load(Path(__file__), target="snapdragon-x-elit")


def bucketed_variant(vid: str, shared: bool) -> dict:
    """A two-bucket variant (width 8 and 16): over one weight-shared binary, or standalone."""
    data = dataclasses.asdict(make_variant(vid))
    small, large = f"{vid}/m_w8_ctx.onnx", f"{vid}/m_w16_ctx.onnx"
    files = [small, large, *([f"{vid}/m_qnn.bin"] if shared else [])]
    sha = data["files"][0]["sha256"]
    data["files"] = [{"path": f, "sha256": sha, "size": 10} for f in files]
    data["model"] = large
    data["inputs"] = [{"name": "x", "shape": [1, 3, 16, -1], "dtype": "float32"}]
    entry = data["buckets"]["entries"][0]
    data["buckets"] = {
        "shared_binary": files[2] if shared else None,
        "axes": [{"input": "x", "axis": 3, "dim": "width", "pad_value": 0.0, "pad_side": "end"}],
        "crops": [],
        "entries": [
            entry | {"name": f"w{w}", "model": m, "inputs": [entry["inputs"][0] | {"shape": s}]}
            for w, m, s in ((8, small, [1, 3, 16, 8]), (16, large, [1, 3, 16, 16]))
        ],
    }
    return data


def bucketed_release(*variants: dict) -> Manifest:
    data = manifest_data(cpu_fallback=None)
    data["variants"] = list(variants)
    return Manifest.from_dict(data)


def test_bucketed_choice_shared_on_a_device_standalone_on_the_simulator():
    release = bucketed_release(
        bucketed_variant("x_qnn-2.51.0", shared=True),
        bucketed_variant("x_qnn-2.51.0_standalone", shared=False),
    )
    simulator = dataclasses.replace(device_for(X_ELITE), simulator=True)  # as on x86_64
    chosen = choose_variant(release, fake_runtime("2.51.0"), simulator)
    assert chosen.id == "x_qnn-2.51.0_standalone"
    on_device = dataclasses.replace(simulator, simulator=False)
    assert choose_variant(release, fake_runtime("2.51.0"), on_device).id == "x_qnn-2.51.0"


def test_shared_only_release_is_refused_on_the_simulator_with_the_fix():
    release = bucketed_release(bucketed_variant("x_qnn-2.51.0", shared=True))
    with pytest.raises(ReleaseError) as info:
        simulator = dataclasses.replace(device_for(X_ELITE), simulator=True)
        choose_variant(release, fake_runtime("2.51.0"), simulator)
    assert f"x_qnn-2.51.0: {SIMULATOR_REFUSES_SHARED}" in info.value.message
    assert 'packaging = ["shared", "standalone"]' in info.value.tip


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("v2.51.0.260929181845", (2, 51, 0)), ("2.49.40", (2, 49, 40)), ("2.47", (2, 47))],
)
def test_parse_version(text, parsed):
    assert parse_version(text) == parsed


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
    ("target", "variant", "warning"),
    [
        (X_ELITE, f"{X_ELITE}_qnn-2.51.0", None),
        ("X1E-78-100", f"{X_ELITE}_qnn-2.51.0", None),  # a part number names the chip too
        (GEN3, f"{GEN3}_qnn-2.51.0", None),
        # a v79 device runs the v75 binary, and is told so: never another arch silently
        ("snapdragon-8-elite", f"{GEN3}_qnn-2.51.0", "no variant for the device's HTP v79"),
        (None, f"{X_ELITE}_qnn-2.51.0", None),  # simulator, not identified: the lowest arch
    ],
)
def test_load_folder_and_run_on_the_simulator(release: Path, target, variant, warning):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = qnn_ctx_runtime.load(release, target=target)
    said = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert said == [] if warning is None else len(said) == 1 and warning in said[0], said
    with model:
        assert model.variant.id == variant
        if target is None:
            detection = model.facts()["detection"]
            assert not detection["identified"] and detection["simulator"]
            assert model.facts()["choice"].startswith("device not identified: the lowest HTP arch")
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
    model = qnn_ctx_runtime.load(archive, target=GEN3)
    extracted = model.root
    assert extracted.is_dir() and not extracted.is_relative_to(release)
    assert (extracted / model.variant.files[1].path).is_file()  # the .bin beside its ctx
    np.testing.assert_allclose(
        model.run(FEED)["y"], qnn_ctx_runtime.load(release, target=GEN3).run(FEED)["y"]
    )
    model.close()
    assert not extracted.exists()
    kept = tmp_path / "kept"
    with qnn_ctx_runtime.load(archive, target=X_ELITE, extract_to=kept) as model:
        assert model.root == kept
    assert (kept / MANIFEST_FILE).is_file()
    with pytest.raises(UsageError, match="is not empty"):
        qnn_ctx_runtime.load(archive, extract_to=kept)


@pytest.mark.qnn
def test_no_heavy_modules_after_a_real_load(release: Path):
    """A real load and run needs neither onnx, PIL, tqdm nor anything of the builder."""
    code = textwrap.dedent(
        """
        import sys, numpy as np
        sys.modules["pipeline"] = None  # any import of pipeline now raises ImportError
        import qnn_ctx_runtime
        model = qnn_ctx_runtime.load(sys.argv[1], target="snapdragon-x-elite")
        y = model.run({"x": np.zeros((1, 3, 16, 16), np.float32)})["y"]
        print(model.provider, y.shape)
        print(sorted({m.split('.')[0] for m in sys.modules} & {'onnx', 'PIL', 'tqdm'}))
        print(sorted(m for m in sys.modules if m.startswith("pipeline.")))
        """
    )
    done = run_python(code, str(release))
    assert done.returncode == 0, done.stderr
    ran, heavy, builder = done.stdout.strip().splitlines()[-3:]
    assert ran == "QNNExecutionProvider (1, 4, 16, 16)"
    assert heavy == "[]" and builder == "[]"


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
        qnn_ctx_runtime.load(release_copy, target=GEN3)
    assert f"{path}: sha256" in info.value.message and "it was modified" in info.value.message
    assert "failed verification" in info.value.message


@pytest.mark.qnn
def test_one_flipped_byte_in_the_archive_is_refused(release_copy: Path):
    archive = release_copy / f"{MODEL}-{VERSION}.tar.gz"
    flip_byte(archive, offset=200)
    with pytest.raises(ReleaseError, match=r"does not match tiny-1\.0\.0\.tar\.gz\.sha256"):
        qnn_ctx_runtime.load(archive)


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
        qnn_ctx_runtime.load(archive)
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
        qnn_ctx_runtime.load(archive)


@pytest.mark.qnn
def test_archive_with_a_flipped_member_byte_is_refused(release: Path, tmp_path: Path, monkeypatch):
    manifest = Manifest.read(release / MANIFEST_FILE)
    target = manifest.variants[0].files[0].path
    archive = rebuild_archive(release, tmp_path / "flip.tar.gz", tamper=target)
    temp = tmp_path / "temp"  # where load() extracts to: nothing may be left there
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    with pytest.raises(ReleaseError) as info:
        qnn_ctx_runtime.load(archive)
    assert "files were modified" in info.value.message and target in info.value.message
    assert list(temp.iterdir()) == []
    with qnn_ctx_runtime.load(release / f"{MODEL}-{VERSION}.tar.gz") as model:
        assert model.root.parent == temp  # the same place a good archive is extracted to
    assert list(temp.iterdir()) == []


@pytest.mark.qnn
def test_truncated_archive_is_refused(release: Path, tmp_path: Path):
    data = (release / f"{MODEL}-{VERSION}.tar.gz").read_bytes()
    archive = tmp_path / "cut.tar.gz"  # no .sha256 beside it: the archive itself must tell
    archive.write_bytes(data[: len(data) // 2])
    with pytest.raises(ReleaseError, match="is damaged or truncated"):
        qnn_ctx_runtime.load(archive)


@pytest.mark.qnn
def test_not_a_release():
    with pytest.raises(ReleaseError, match="neither a release folder nor a release archive"):
        qnn_ctx_runtime.load(Path(__file__))


@pytest.mark.qnn
def test_bad_feeds_are_named(release: Path):
    with qnn_ctx_runtime.load(release, target=X_ELITE) as model:
        with pytest.raises(FeedError) as info:
            model.run({"x": FEED["x"].astype(np.float64), "z": 1})
        message = info.value.message
        assert "'z' is not an input (inputs: x)" in message
        assert "input 'x' has dtype float64, expected float32" in message
        with pytest.raises(FeedError, match="input 'x' is missing"):
            model.run({})
        with pytest.raises(FeedError) as info:
            model.run({"x": FEED["x"][:, :, :8]})
        message = info.value.message
        assert "Input 'x' has shape [1, 3, 8, 16]" in message and "[1, 3, 16, 16]" in message
        with pytest.raises(FeedError, match=r"Input 'x' has rank 3 \(shape \[3, 16, 16\]\)"):
            model.run({"x": FEED["x"][0]})
        assert model.run(FEED)["y"].shape == (1, 4, 16, 16)  # still usable after bad feeds


@pytest.mark.qnn
def test_bad_feeds_are_all_named_at_once(release: Path):
    with qnn_ctx_runtime.load(release, target=X_ELITE) as model, pytest.raises(FeedError) as info:
        model.run({"x": FEED["x"].astype(np.float64)[:, :, :8], "z": 1})
    message = info.value.message
    assert "'z' is not an input" in message
    assert "dtype float64, expected float32" in message
    assert "shape [1, 3, 8, 16]" in message


@pytest.mark.qnn
def test_cpu_fallback_only_when_asked_and_it_says_so(release: Path):
    with pytest.raises(ReleaseError, match="built for HTP v73 > device's v68"):
        qnn_ctx_runtime.load(release, target="snapdragon-888")
    with pytest.warns(RuntimeWarning, match="on the CPU, not the NPU: No variant"):
        model = qnn_ctx_runtime.load(release, target="snapdragon-888", allow_cpu_fallback=True)
    assert model.on_cpu and model.provider == "CPUExecutionProvider"
    assert "HTP v73 > device's v68" in model.facts()["fallback_reason"]
    np.testing.assert_allclose(model.run(FEED)["y"], qdq_reference(release), rtol=0, atol=1e-6)


@pytest.mark.qnn
def test_cpu_fallback_needs_a_cpu_model(tmp_path_factory):
    build = cached_build(tmp_path_factory).copy(tmp_path_factory.mktemp("nocpu") / "p")
    folder = publish_model(load_config(build.config), build.artifacts, cpu_fallback=False).folder
    with pytest.raises(ReleaseError, match="the release has no CPU model"):
        qnn_ctx_runtime.load(folder, target="snapdragon-888", allow_cpu_fallback=True)


class _EngineErrorOnce:
    """Fault injection: the HTP subsystem restart (SSR) cannot be caused on the simulator, so
    the first run of the real (QNN) session raises onnxruntime's real EngineError instead."""

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

    with qnn_ctx_runtime.load(release, target=X_ELITE) as model:
        expected = model.run(FEED)["y"]
        sessions = model._sessions  # the variant's sessions, one per bucket (one here)
        (real,) = sessions.sessions
        sessions.sessions = [_EngineErrorOnce(real)]
        with pytest.warns(RuntimeWarning, match="ENGINE_ERROR"):
            out = model.run(FEED)
        assert model.restarts == 1
        (fresh,) = sessions.sessions
        assert isinstance(fresh, ort.InferenceSession) and fresh is not real  # a new real one
        assert "QNNExecutionProvider" in fresh.get_providers()
        np.testing.assert_array_equal(out["y"], expected)


@pytest.mark.qnn
def test_engine_error_twice_is_an_error(release: Path, monkeypatch):
    with qnn_ctx_runtime.load(release, target=X_ELITE) as model:
        sessions = model._sessions
        real_open = sessions._open
        sessions.sessions = [_EngineErrorOnce(s) for s in sessions.sessions]
        monkeypatch.setattr(sessions, "_open", lambda: [_EngineErrorOnce(s) for s in real_open()])
        with pytest.warns(RuntimeWarning), pytest.raises(ReleaseError, match="again"):
            model.run(FEED)
        assert model.restarts == 1


# -- releases written in another manifest format -------------------------------------------------

# The fields format 1 (qnn-ctx-pipeline 0.1, pipeline/manifest.py before schema 2) wrote, in its
# order. A variant with one static shape had no ``buckets`` (it was optional then, and left out
# when absent), and bucket entries had no ``qdq_sha256``.
FORMAT_1_MANIFEST_FIELDS = (
    "schema_version",
    "model",
    "version",
    "created",
    "generator",
    "source_sha256",
    "config_digest",
    "quantization",
    "variants",
    "cpu_fallback",
    "excluded",
)
FORMAT_1_VARIANT_FIELDS = (
    "id",
    "target",
    "soc_model",
    "htp_arch",
    "backend",
    "qnn_sdk_version",
    "ep_sdk_version",
    "onnxruntime_qnn",
    "onnxruntime",
    "ep_compatibility_info",
    "embed_mode",
    "model",
    "files",
    "inputs",
    "outputs",
    "coverage",
    "accuracy",
    "load",
    "passed",
    "failed_gates",
)


def format_1_release(release: Path, dest: Path) -> Path:
    """``release`` (format 2) as qnn-ctx-pipeline 0.1 published it: the same files, a format-1
    manifest written field by field from that format's schema, and the archive re-packed
    around it with its .sha256."""
    shutil.copytree(release, dest)
    current = json.loads((release / MANIFEST_FILE).read_text("utf-8"))
    old = {key: current[key] for key in FORMAT_1_MANIFEST_FIELDS}
    old.update(schema_version="1", generator="qnn-ctx-pipeline 0.1.0")
    old["variants"] = [
        {key: variant[key] for key in FORMAT_1_VARIANT_FIELDS} for variant in current["variants"]
    ]
    (dest / MANIFEST_FILE).write_text(json.dumps(old, indent=2) + "\n", "utf-8")
    archive = dest / f"{MODEL}-{VERSION}.tar.gz"
    archive.unlink()
    rebuild_archive(dest, archive)
    (dest / f"{archive.name}.sha256").write_text(f"{sha256_file(archive)}  {archive.name}\n")
    return dest


@pytest.mark.qnn
def test_format_1_release_loads_and_runs(release: Path, tmp_path: Path):
    old = format_1_release(release, tmp_path / "format-1")
    data = json.loads((old / MANIFEST_FILE).read_text("utf-8"))
    assert data["schema_version"] == "1" and list(data) == list(FORMAT_1_MANIFEST_FIELDS)
    assert [list(v) for v in data["variants"]] == [list(FORMAT_1_VARIANT_FIELDS)] * 2
    manifest = qnn_ctx_runtime.verify(old)
    assert manifest.schema_version is SchemaVersion.V1
    assert manifest.files() == Manifest.read(release / MANIFEST_FILE).files()
    for target in (X_ELITE, GEN3):
        with qnn_ctx_runtime.load(old, target=target) as model:
            assert model.variant.id == f"{target}_qnn-2.51.0"
            assert not model.on_cpu and model.buckets is None
            (entry,) = model.variant.buckets.entries  # upgraded: the one static shape
            assert (entry.name, entry.model, entry.qdq_sha256) == (
                SINGLE_BUCKET,
                model.variant.model,
                None,
            )
            assert (entry.inputs, entry.outputs) == (model.variant.inputs, model.variant.outputs)
            y = model.run(FEED)["y"]
        with qnn_ctx_runtime.load(release, target=target) as current:
            np.testing.assert_array_equal(y, current.run(FEED)["y"])  # the same binary
        assert np.abs(y - qdq_reference(old)).max() < 0.1
    archive = old / f"{MODEL}-{VERSION}.tar.gz"
    with qnn_ctx_runtime.load(archive, target=GEN3) as model:
        assert model.manifest.schema_version is SchemaVersion.V1
        assert (
            model.variant.embed_mode == 0 and (model.root / model.variant.files[1].path).is_file()
        )
        assert np.abs(model.run(FEED)["y"] - qdq_reference(old)).max() < 0.1
    with pytest.warns(RuntimeWarning, match="on the CPU, not the NPU"):
        model = qnn_ctx_runtime.load(old, target="snapdragon-888", allow_cpu_fallback=True)
    with model:
        assert model.on_cpu
        np.testing.assert_allclose(model.run(FEED)["y"], qdq_reference(old), rtol=0, atol=1e-6)


@pytest.mark.qnn
def test_release_of_an_unknown_format_is_refused_naming_it(release_copy: Path, tmp_path: Path):
    data = json.loads((release_copy / MANIFEST_FILE).read_text("utf-8"))
    data["schema_version"] = "3"
    data["variants"][0]["signature"] = "a field format 3 might add"
    (release_copy / MANIFEST_FILE).write_text(json.dumps(data), "utf-8")
    expected = "schema_version '3' is not a format this qnn-ctx-runtime reads ('1', '2')."
    with pytest.raises(ReleaseError) as info:
        qnn_ctx_runtime.load(release_copy, target=X_ELITE)
    assert info.value.message == f"{release_copy / MANIFEST_FILE}: {expected}"
    assert info.value.tip.startswith("A newer release needs a newer qnn-ctx-runtime")
    archive = tmp_path / "format-3.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(release_copy / MANIFEST_FILE, MANIFEST_FILE)
    with pytest.raises(ReleaseError) as info:
        qnn_ctx_runtime.load(archive, allow_cpu_fallback=True)  # no fallback from an unknown format
    assert info.value.message == f"{archive}!{MANIFEST_FILE}: {expected}"


# -- a real second environment: onnxruntime-qnn 2.5.0 (QNN SDK 2.49.40) -------------------------

LOAD_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import onnxruntime as ort
    sys.modules["pipeline"] = None  # the device side alone, as on a device
    import qnn_ctx_runtime
    from qnn_ctx_runtime import ReleaseError
    try:
        model = qnn_ctx_runtime.load(sys.argv[1])
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
    # [compile] is not a quantize setting: the quantize record stays valid.
    write_config(build.root, [t for t, _ in TARGETS], ["2.7.0", "2.5.0"], VERSION)
    folder = build.variant_folder(X_ELITE, "2.5.0")
    folder.mkdir(parents=True)
    ctx = folder / f"{MODEL}_{X_ELITE}_qnn2.49.40_ctx.onnx"
    done = run_in(python_250, COMPILE_SCRIPT, str(build.qdq), str(ctx))
    assert done.returncode == 0, done.stderr[-3000:]
    # Coverage and validation are not measured here (another toolchain's binary).
    write_variant(build, X_ELITE, [ctx.name], "2.5.0", "1.31.1", measured=False)
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
    with qnn_ctx_runtime.load(two_sdk_release, target=X_ELITE) as model:
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
    for dropped in [v for v in data["variants"] if v["qnn_sdk_version"] != "2.49.40"]:
        for entry in dropped["files"]:  # a file the manifest does not list is refused
            (dest / entry["path"]).unlink()
    data["variants"] = [v for v in data["variants"] if v["qnn_sdk_version"] == "2.49.40"]
    (dest / MANIFEST_FILE).write_text(json.dumps(data), "utf-8")
    with qnn_ctx_runtime.load(dest, target=X_ELITE) as model:
        assert model.variant.qnn_sdk_version == "2.49.40"
        assert np.abs(model.run(FEED)["y"] - qdq_reference(dest)).max() < 0.1


def test_emulation_check_is_false_on_native_linux():
    if os.name == "nt":
        pytest.skip("checks the Linux answer")
    assert native_machine() == process_machine()
    assert emulated_on_arm64() is False
