"""Release attacks, as a hostile-but-fair user would try them on a real published release.

Edit ``passed`` or a variant's claims in the manifest, swap a ctx for another build's and
re-hash, plant files, bloat archive members, drop the .sha256 sidecar, sign with another key,
feed NaN: each is refused or reported, and the tests say by which check (pinned manifest digest,
Ed25519 signature, the binaries' own EPContext facts, sizes before writing).
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
from release_fixtures import MODEL, VERSION, cached_build, run_python

import qnn_ctx_runtime
from pipeline.core.config import load_config
from pipeline.publish.release import publish_model
from qnn_ctx_runtime.errors import FeedError, ReleaseError, UsageError
from qnn_ctx_runtime.manifest import MANIFEST_FILE
from qnn_ctx_runtime.release import manifest_sha256, sha256_file
from qnn_ctx_runtime.trust import SIGNATURE_FILE

X_ELITE = "snapdragon-x-elite"
FEED = {"x": np.random.default_rng(3).standard_normal((1, 3, 16, 16)).astype(np.float32)}
ARCHIVE = f"{MODEL}-{VERSION}.tar.gz"

pytestmark = pytest.mark.qnn


def ed25519_key(folder: Path, name: str) -> tuple[Path, Path]:
    """A fresh Ed25519 key pair as PEM files: (private, public)."""
    pytest.importorskip("cryptography")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    private = folder / f"{name}.pem"
    public = folder / f"{name}.pub.pem"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private, public


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    folder = tmp_path_factory.mktemp("keys")
    return {"ours": ed25519_key(folder, "ours"), "theirs": ed25519_key(folder, "theirs")}


@pytest.fixture(scope="module")
def published(tmp_path_factory, keys) -> dict[str, Path]:
    """The same build published unsigned and signed (with our key)."""
    build = cached_build(tmp_path_factory)
    out = {}
    for kind in ("unsigned", "signed"):
        copy = build.copy(tmp_path_factory.mktemp(kind) / "project")
        key = keys["ours"][0] if kind == "signed" else None
        out[kind] = publish_model(load_config(copy.config), copy.artifacts, sign_key=key).folder
    return out


@pytest.fixture(scope="module")
def other_build_release(tmp_path_factory) -> Path:
    """Another seed's release: real ctx binaries with the same SDK, arch and names."""
    build = cached_build(tmp_path_factory, "other", seed=7)
    copy = build.copy(tmp_path_factory.mktemp("other") / "project")
    return publish_model(load_config(copy.config), copy.artifacts).folder


@pytest.fixture
def release(published, tmp_path: Path) -> Path:
    dest = tmp_path / "unsigned"
    shutil.copytree(published["unsigned"], dest)
    return dest


@pytest.fixture
def signed(published, tmp_path: Path) -> Path:
    dest = tmp_path / "signed"
    shutil.copytree(published["signed"], dest)
    return dest


def edit_manifest(folder: Path, change) -> dict:
    data = json.loads((folder / MANIFEST_FILE).read_text("utf-8"))
    change(data)
    (folder / MANIFEST_FILE).write_text(json.dumps(data, indent=2), "utf-8")
    return data


def x_elite(data: dict) -> dict:
    return next(v for v in data["variants"] if v["target"] == X_ELITE)


def quiet_load(path: Path, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return qnn_ctx_runtime.load(path, target=X_ELITE, **kwargs)


# -- the manifest's own digest: pinned -----------------------------------------------------------


def test_publish_prints_the_digest_to_pin(tmp_path_factory, capsys) -> None:
    from pipeline.__main__ import main

    build = cached_build(tmp_path_factory)
    copy = build.copy(tmp_path_factory.mktemp("cli") / "project")
    assert main(["publish", str(copy.config), "--artifacts", str(copy.artifacts)]) == 0
    out = capsys.readouterr().out
    folder = copy.release()
    digest = hashlib.sha256((folder / MANIFEST_FILE).read_bytes()).hexdigest()
    assert f"manifest sha256 {digest}" in out
    assert manifest_sha256(folder) == digest == manifest_sha256(folder / ARCHIVE)


def test_pinned_manifest_loads_and_says_so(release: Path) -> None:
    digest = manifest_sha256(release)
    with quiet_load(release, expect_manifest_sha256=digest.upper()) as model:
        trust = model.facts()["trust"]
        assert trust["manifest_pinned"] and trust["manifest_sha256"] == digest
        assert trust["signature"] == "unsigned"
        model.run(FEED)


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(
            lambda d: x_elite(d).update(passed=False, failed_gates=["coverage"]), id="failed"
        ),
        pytest.param(lambda d: d["variants"][1].update(passed=True, failed_gates=[]), id="passed"),
        pytest.param(lambda d: d.update(version="9.9.9"), id="version"),
    ],
)
def test_an_edited_manifest_is_refused_when_pinned(release: Path, edit) -> None:
    digest = manifest_sha256(release)
    edit_manifest(release, edit)
    with pytest.raises(ReleaseError, match=f"not the pinned {digest}"):
        quiet_load(release, expect_manifest_sha256=digest)
    with pytest.raises(ReleaseError, match="pinned"):
        qnn_ctx_runtime.verify(release / ".." / release.name, expect_manifest_sha256=digest)


def test_a_swapped_and_rehashed_ctx_is_caught_by_the_pin(
    release: Path, other_build_release
) -> None:
    """Another build's real ctx, the manifest's sha256 and size updated: every file check and
    every claim passes (same SDK, arch, soc), so only the pin (or a signature) can tell."""
    digest = manifest_sha256(release)

    def swap(data: dict) -> None:
        for entry in x_elite(data)["files"]:
            source = other_build_release / entry["path"]
            shutil.copyfile(source, release / entry["path"])
            entry.update(sha256=sha256_file(source), size=source.stat().st_size)

    edit_manifest(release, swap)
    with quiet_load(release) as model:  # unpinned: a consistent release, nothing to notice
        assert model.facts()["trust"]["manifest_pinned"] is False
    with pytest.raises(ReleaseError, match="not the pinned"):
        quiet_load(release, expect_manifest_sha256=digest)


def test_a_malformed_pin_is_a_usage_error(release: Path) -> None:
    with pytest.raises(UsageError, match="64 hex digits"):
        quiet_load(release, expect_manifest_sha256="abc")


def test_pin_is_checked_before_an_archive_is_extracted(release: Path, tmp_path: Path) -> None:
    archive = release / ARCHIVE
    kept = tmp_path / "kept"
    with pytest.raises(ReleaseError, match="not the pinned"):
        quiet_load(archive, extract_to=kept, expect_manifest_sha256="0" * 64)
    assert not kept.exists() or list(kept.iterdir()) == []


# -- Ed25519 signatures --------------------------------------------------------------------------


def test_a_signed_release_verifies_with_its_key(signed: Path, keys) -> None:
    for path in (signed, signed / ARCHIVE):
        with quiet_load(path, public_key=keys["ours"][1]) as model:
            assert model.facts()["trust"]["signature"].startswith("verified (ed25519, key ")
            model.run(FEED)
    with tarfile.open(signed / ARCHIVE) as tar:
        assert SIGNATURE_FILE in tar.getnames()


def test_an_edit_after_signing_is_refused(signed: Path, keys) -> None:
    edit_manifest(signed, lambda d: x_elite(d).update(passed=False, failed_gates=["x"]))
    with pytest.raises(ReleaseError, match="changed after it was signed"):
        quiet_load(signed, public_key=keys["ours"][1])


def test_re_signed_by_another_key_is_refused(signed: Path, keys) -> None:
    from pipeline.publish.sign import sign_manifest

    edit_manifest(signed, lambda d: x_elite(d).update(passed=False, failed_gates=["x"]))
    raw = (signed / MANIFEST_FILE).read_bytes()
    (signed / SIGNATURE_FILE).write_bytes(sign_manifest(raw, keys["theirs"][0]))
    with pytest.raises(ReleaseError, match=r"is signed by key \w+, not by the given key"):
        quiet_load(signed, public_key=keys["ours"][1])


def test_unsigned_release_is_refused_when_a_key_is_given(release: Path, keys) -> None:
    with pytest.raises(ReleaseError, match="is not signed"):
        quiet_load(release, public_key=keys["ours"][1])


def test_without_a_key_facts_say_the_signature_was_not_checked(signed: Path) -> None:
    with quiet_load(signed) as model:
        assert "not checked: pass public_key=" in model.facts()["trust"]["signature"]


def test_bad_signing_key_is_refused_before_publishing(tmp_path_factory, tmp_path: Path) -> None:
    from pipeline.__main__ import main

    build = cached_build(tmp_path_factory)
    copy = build.copy(tmp_path / "project")
    key = tmp_path / "not-a-key.pem"
    key.write_text("hello")
    assert (
        main(
            [
                "publish",
                str(copy.config),
                "--artifacts",
                str(copy.artifacts),
                "--sign-key",
                str(key),
            ]
        )
        == 1
    )
    assert not copy.release().exists()


WITHOUT_CRYPTOGRAPHY = textwrap.dedent(
    """
    import sys, warnings
    sys.modules["cryptography"] = None  # as on a device where it does not install
    import numpy as np, qnn_ctx_runtime
    warnings.simplefilter("ignore")
    model = qnn_ctx_runtime.load(sys.argv[1], target="snapdragon-x-elite")
    model.run({"x": np.zeros((1, 3, 16, 16), np.float32)})
    print(model.facts()["trust"]["signature"])
    try:
        qnn_ctx_runtime.load(sys.argv[1], target="snapdragon-x-elite", public_key=sys.argv[2])
    except qnn_ctx_runtime.ReleaseError as exc:
        print("refused:", exc.message)
    """
)


def test_numpy_and_onnxruntime_alone_still_load_and_say_what_was_not_checked(
    signed: Path, keys
) -> None:
    done = run_python(WITHOUT_CRYPTOGRAPHY, str(signed), str(keys["ours"][1]))
    assert done.returncode == 0, done.stderr
    facts, refused = done.stdout.strip().splitlines()[-2:]
    assert "not checked" in facts
    assert refused.startswith("refused:") and "cryptography package is not installed" in refused


def test_importing_the_runtime_does_not_import_cryptography() -> None:
    done = run_python("import sys, qnn_ctx_runtime; print('cryptography' in sys.modules)")
    assert done.stdout.strip() == "False", done.stderr


# -- the manifest's claims against the binaries ---------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda v: v.update(target="snapdragon-8-elite", soc_model=69, htp_arch=79),
            "built for HTP arch [73], not the requested 79",
        ),
        (lambda v: v.update(htp_arch=75), "target snapdragon-x-elite is soc_model 60 / HTP v73"),
        (lambda v: v.update(qnn_sdk_version="2.99.0"), "the manifest says QNN SDK 2.99.0"),
        (lambda v: v.update(ep_sdk_version="v2.51.0.1"), "the manifest says ep_sdk_version"),
        (
            lambda v: v.update(ep_compatibility_info="v2:6:2.51.0:5.51.0:79:69:0:0"),
            "the manifest says ep_compatibility_info",
        ),
        (lambda v: v.update(embed_mode=0), "the manifest says embed_mode 0"),
    ],
)
def test_claims_that_the_binary_contradicts_are_refused(release: Path, edit, message) -> None:
    edit_manifest(release, lambda d: edit(x_elite(d)))
    with pytest.raises(ReleaseError, match="claims do not match its ctx binaries") as info:
        quiet_load(release)
    assert message in info.value.message, info.value.message


def test_a_non_context_model_posing_as_a_variant_is_refused(release: Path) -> None:
    """The QDQ model (the CPU fallback) copied over a ctx, files re-hashed: not a context."""

    def swap(data: dict) -> None:
        entry = x_elite(data)["files"][0]
        shutil.copyfile(release / data["cpu_fallback"]["model"], release / entry["path"])
        entry.update(
            sha256=sha256_file(release / entry["path"]),
            size=(release / entry["path"]).stat().st_size,
        )

    edit_manifest(release, swap)
    with pytest.raises(ReleaseError, match="has no EPContext node"):
        quiet_load(release)


# -- files and archives --------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["top.txt", "snapdragon-x-elite_qnn-2.51.0/libQnnHtp.so"])
def test_files_the_manifest_does_not_list_are_refused(release: Path, where: str) -> None:
    (release / where).write_bytes(b"planted")
    with pytest.raises(
        ReleaseError, match=f"{where} is in the release folder but not in the manifest"
    ):
        quiet_load(release)


def tar_with(release: Path, dest: Path, replace: dict[str, bytes]) -> Path:
    """The release's archive with some members' bytes replaced (sizes follow the bytes)."""
    with tarfile.open(release / ARCHIVE) as source, tarfile.open(dest, "w:gz") as out:
        for info in source.getmembers():
            data = source.extractfile(info).read() if info.isfile() else None
            if info.name in replace:
                data = replace[info.name]
                info.size = len(data)
            out.addfile(info, io.BytesIO(data) if data is not None else None)
    return dest


def test_an_oversized_member_is_refused_before_anything_is_written(release: Path, tmp_path) -> None:
    """A member the manifest lists at its size but 8 MiB in the archive: nothing is written."""
    manifest = json.loads((release / MANIFEST_FILE).read_text())
    cpu = manifest["cpu_fallback"]["files"][0]["path"]
    archive = tar_with(release, tmp_path / ARCHIVE, {cpu: b"\0" * (8 << 20)})
    kept = tmp_path / "kept"
    with pytest.raises(ReleaseError) as info:
        quiet_load(archive, extract_to=kept)
    assert f"{cpu} is {8 << 20} bytes in the archive, but the manifest lists" in info.value.message
    assert not kept.exists() or list(kept.rglob("*")) == []


def test_extraction_never_writes_more_than_the_manifest_lists(release: Path, tmp_path) -> None:
    """Even a member whose header lies low is cut at the manifest's size (+1 byte)."""
    from qnn_ctx_runtime.release import _copy_hashing

    sink = io.BytesIO()
    _, size = _copy_hashing(io.BytesIO(b"\1" * (5 << 20)), sink, 10)
    assert size == 11 and len(sink.getvalue()) == 11


def test_a_missing_sidecar_is_reported(release: Path, tmp_path: Path) -> None:
    archive = tmp_path / ARCHIVE
    shutil.copyfile(release / ARCHIVE, archive)  # without its .sha256
    with pytest.warns(RuntimeWarning, match=f"no {ARCHIVE}.sha256 beside the archive"):
        model = qnn_ctx_runtime.load(archive, target=X_ELITE)
    with model:
        assert model.facts()["trust"]["archive_checksum"].startswith("missing")
    digest = manifest_sha256(archive)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # pinned: the sidecar adds nothing
        with qnn_ctx_runtime.load(archive, target=X_ELITE, expect_manifest_sha256=digest) as model:
            assert model.facts()["trust"]["archive_checksum"].startswith("missing")
    with quiet_load(release / ARCHIVE) as model:
        assert model.facts()["trust"]["archive_checksum"] == f"matched {ARCHIVE}.sha256"


def test_extract_to_a_file_or_an_unwritable_folder(release: Path, tmp_path: Path) -> None:
    target = tmp_path / "a-file"
    target.write_text("keep me")
    with pytest.raises(UsageError, match="is a file, not a folder"):
        quiet_load(release / ARCHIVE, extract_to=target)
    assert target.read_text() == "keep me"
    below_a_file = target / "sub"
    with pytest.raises(ReleaseError, match=f"Cannot extract into {below_a_file}"):
        quiet_load(release / ARCHIVE, extract_to=below_a_file)


# -- run(): NaN and infinity ---------------------------------------------------------------------


def test_nan_and_inf_inputs_warn_by_default_and_error_on_request(release: Path) -> None:
    bad = FEED["x"].copy()
    bad[0, 0, 0, :3] = [np.nan, np.inf, -np.inf]
    with quiet_load(release) as model:
        with pytest.warns(RuntimeWarning, match=r"'x': 1 NaN and 2 infinite of 768 values"):
            model.run({"x": bad})
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            model.run(FEED)  # finite inputs: no word
    with (
        quiet_load(release, nonfinite="error") as model,
        pytest.raises(FeedError, match="hold NaN or infinity"),
    ):
        model.run({"x": bad})
    with quiet_load(release, nonfinite="ignore") as model, warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        model.run({"x": bad})
    with pytest.raises(UsageError, match="nonfinite='maybe'"):
        quiet_load(release, nonfinite="maybe")
