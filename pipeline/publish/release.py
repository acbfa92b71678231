"""Writing a release: immutable, atomic, reproducible, and refused if it would change.

``<artifacts>/releases/<model>/<version>/`` holds ``manifest.json``, one folder per variant named
``<target>_qnn-<QNN SDK>`` with its ctx ``.onnx`` files (and ``.bin``), ``cpu/`` with the QDQ model
for an explicit CPU fallback, and ``<model>-<version>.tar.gz`` with its ``.sha256``.

A release is never changed once visible: it is assembled in a hidden temporary folder beside its
final place and renamed into place in one step, so a kill at any moment leaves the previous state
or the complete release. Publishing the same content again is a no-op; different content under
an existing version is refused, naming what differs.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from qnn_ctx_runtime.manifest import MANIFEST_FILE, Manifest
from qnn_ctx_runtime.release import manifest_sha256, verify_folder
from qnn_ctx_runtime.trust import SIGNATURE_FILE

from ..core.config import ModelConfig
from ..core.errors import PipelineError, PublishError
from ..core.fileio import sha256_file
from ..core.layout import release_dir
from ..core.lock import locked
from .collect import Source, build_manifest
from .sign import load_signing_key, sign_manifest, signing_key_path

_TEMP_MARK = ".publish-"


@dataclass
class PublishResult:
    folder: Path
    manifest: Manifest
    unchanged: bool
    manifest_sha256: str = ""  # what a consumer pins: load(..., expect_manifest_sha256=)

    def summary_line(self) -> str:
        m = self.manifest
        pin = f"\n  manifest sha256 {self.manifest_sha256}" if self.manifest_sha256 else ""
        signed = " (signed)" if (self.folder / SIGNATURE_FILE).is_file() else ""
        if self.unchanged:
            return (
                f"{m.model} {m.version}: already published with the same content "
                f"({self.folder}){signed}{pin}"
            )
        passed = sum(v.passed for v in m.variants)
        text = f"{m.model} {m.version}: published {passed} variant(s)"
        if len(m.variants) > passed:
            text += f" and {len(m.variants) - passed} marked failed"
        if m.excluded:
            text += f", left out {len(m.excluded)} ({'; '.join(e.id for e in m.excluded)})"
        return f"{text} -> {self.folder}{signed}{pin}"


def archive_name(manifest: Manifest) -> str:
    return f"{manifest.model}-{manifest.version}.tar.gz"


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# gzip's own default, not GzipFile's 9: quantized weights and context binaries hardly compress,
# and 9 took 7x as long for 0.8% less (a small detector's release: 0.19 s vs 0.03 s).
ARCHIVE_GZIP_LEVEL = 6


def _write_archive(folder: Path, manifest: Manifest) -> Path:
    """A reproducible tar.gz of the release (sorted, fixed times and owners), with its .sha256."""
    target = folder / archive_name(manifest)
    signature = [SIGNATURE_FILE] if (folder / SIGNATURE_FILE).is_file() else []
    names = [MANIFEST_FILE, *signature, *sorted(e.path for e in manifest.files())]
    with (
        open(target, "xb") as raw,
        gzip.GzipFile(
            filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=ARCHIVE_GZIP_LEVEL
        ) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for name in names:
            info = tar.gettarinfo(str(folder / name), arcname=name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            info.mode = 0o644
            with open(folder / name, "rb") as handle:
                tar.addfile(info, handle)
    (folder / f"{target.name}.sha256").write_text(
        f"{sha256_file(target)}  {target.name}\n", encoding="utf-8"
    )
    return target


def _assemble(
    folder: Path, manifest: Manifest, sources: list[Source], sign_key: Path | None = None
) -> None:
    """Copy and re-hash every file into ``folder``, then write the manifest (and its Ed25519
    signature, with a key) and the archive."""
    for item in sources:
        target = folder / item.entry.path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(item.source, target)
        if sha256_file(target) != item.entry.sha256:
            raise PublishError(
                f"{item.source} changed while it was being published.",
                tip="Do not rebuild while publishing; run publish again.",
            )
        _fsync_file(target)
    raw = manifest.to_json().encode("utf-8")
    (folder / MANIFEST_FILE).write_bytes(raw)
    _fsync_file(folder / MANIFEST_FILE)
    if sign_key is not None:
        (folder / SIGNATURE_FILE).write_bytes(sign_manifest(raw, sign_key))
        _fsync_file(folder / SIGNATURE_FILE)
    archive = _write_archive(folder, manifest)
    _fsync_file(archive)
    for sub in {folder / Path(e.path).parent for e in manifest.files()} | {folder}:
        _fsync_dir(sub)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _remove_stale_temps(parent: Path) -> None:
    """Hidden folders of publish runs that were killed (their process is gone)."""
    if not parent.is_dir() or os.name != "posix":
        return
    for path in parent.iterdir():
        if not (path.name.startswith(".") and _TEMP_MARK in path.name):
            continue
        pid_text = path.name.split(_TEMP_MARK, 1)[1].split("-", 1)[0]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            shutil.rmtree(path, ignore_errors=True)


def _same_or_refuse(final: Path, manifest: Manifest) -> Manifest:
    """An existing release: the same content is fine (it is verified), different is refused."""
    try:
        existing = verify_folder(final)
    except PipelineError as exc:
        raise PublishError(
            f"Release {final} already exists but is damaged:\n{exc.message}",
            tip="Releases are immutable: remove that folder by hand only if nobody uses it, "
            "or bump model.version.",
        ) from None
    if manifest.identity() != existing.identity():
        differences = manifest.differences(existing)
        raise PublishError(
            f"Release {manifest.model} {manifest.version} already exists in {final} with "
            f"different content:\n  - " + "\n  - ".join(differences),
            tip="Releases are immutable: bump model.version in the config to publish this build.",
        )
    return existing


@locked("publish")
def publish_model(
    config: ModelConfig,
    artifacts: Path,
    allow_partial: bool = False,
    cpu_fallback: bool = True,
    sign_key: Path | None = None,
) -> PublishResult:
    """Publish one model's release, atomically; the same content again is a no-op.

    ``sign_key`` (or $QNN_CTX_SIGN_KEY) signs the manifest with Ed25519 (publish.sign)."""
    sign_key = signing_key_path(sign_key)
    if sign_key is not None:
        load_signing_key(sign_key)  # a bad key is refused before any work
    manifest, sources = build_manifest(config, artifacts, allow_partial, cpu_fallback)
    final = release_dir(artifacts, manifest.model, manifest.version)
    parent = final.parent
    if final.exists():
        existing = _same_or_refuse(final, manifest)
        return PublishResult(final, existing, True, manifest_sha256(final))
    parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(parent)
    temp = Path(
        tempfile.mkdtemp(prefix=f".{manifest.version}{_TEMP_MARK}{os.getpid()}-", dir=parent)
    )
    try:
        _assemble(temp, manifest, sources, sign_key)
        os.chmod(temp, 0o755)  # mkdtemp makes it 0700
        try:
            os.rename(temp, final)  # atomic; fails if another publish got there first
        except OSError:
            if not final.exists():
                raise
            existing = _same_or_refuse(final, manifest)
            return PublishResult(final, existing, True, manifest_sha256(final))
        _fsync_dir(parent)
    finally:
        with contextlib.suppress(OSError):
            if temp.exists():
                shutil.rmtree(temp)
    return PublishResult(final, manifest, False, manifest_sha256(final))
