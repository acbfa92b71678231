"""Opening a release: its manifest, and every file it lists, byte for byte.

``verify_folder`` checks a release folder; ``extract_archive`` unpacks a release archive safely
(no absolute paths, no '..', no links or special files, nothing the manifest does not list) and
checks every byte on the way; ``opened_release`` gives either as a folder for the duration of a
block. Everything a release holds is refused at once, listing every offender.

Standard library only: this module runs on the device.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .errors import ReleaseError
from .manifest import MANIFEST_FILE, Manifest, safe_relative_path

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".zip")
_CHUNK = 1 << 20


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hash a file in 1 MiB chunks, so big ctx binaries never sit in memory whole."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def is_archive(path: Path) -> bool:
    return path.is_file() and path.name.lower().endswith(ARCHIVE_SUFFIXES)


def _copy_hashing(source: IO[bytes], target: IO[bytes]) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    while chunk := source.read(_CHUNK):
        digest.update(chunk)
        target.write(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


def _raise_issues(what: str, issues: list[str], tip: str) -> None:
    if issues:
        shown = issues[:25] + ([f"… and {len(issues) - 25} more"] if len(issues) > 25 else [])
        raise ReleaseError(f"{what}:\n  - " + "\n  - ".join(shown), tip=tip)


_TAMPERED_TIP = "Do not use this copy: download or publish the release again."


def verify_folder(root: Path) -> Manifest:
    """Check a release folder: a valid manifest, and every listed file with its exact bytes."""
    root = Path(root)
    manifest = Manifest.read(root / MANIFEST_FILE)
    issues = []
    base = root.resolve()
    for entry in manifest.files():
        path = root / entry.path
        if path.is_symlink():
            issues.append(f"{entry.path} is a symbolic link")
        elif not path.resolve().is_relative_to(base):
            issues.append(f"{entry.path} points outside the release folder")
        elif not path.is_file():
            issues.append(f"{entry.path} is listed in the manifest but missing")
        else:
            sha256, size = sha256_file(path), path.stat().st_size
            if sha256 != entry.sha256 or size != entry.size:
                issues.append(
                    f"{entry.path}: sha256 {sha256[:16]}… ({size} bytes) does not match the "
                    f"manifest's {entry.sha256[:16]}… ({entry.size} bytes); it was modified"
                )
    _raise_issues(f"Release {root} failed verification", issues, _TAMPERED_TIP)
    return manifest


def _check_archive_checksum(archive: Path) -> None:
    """If ``<archive>.sha256`` is beside it, the archive's bytes must match."""
    sidecar = archive.with_name(archive.name + ".sha256")
    if not sidecar.is_file():
        return
    words = sidecar.read_text("utf-8", errors="replace").split()
    expected = words[0].lower() if words else ""
    actual = sha256_file(archive)
    if actual != expected:
        raise ReleaseError(
            f"{archive}: sha256 {actual} does not match {sidecar.name} ({expected or 'empty'}).",
            tip=_TAMPERED_TIP,
        )


@dataclass
class _Member:
    name: str
    kind: str  # "file", "dir", "link", "other"
    handle: Any


def _members(archive: Path, opened: Any) -> list[_Member]:
    out = []
    if isinstance(opened, zipfile.ZipFile):
        for info in opened.infolist():
            mode = (info.external_attr >> 16) & 0o170000
            kind = (
                "link"
                if mode == 0o120000
                else "dir"
                if info.is_dir()
                else "file"
                if mode in (0, 0o100000)
                else "other"
            )
            out.append(_Member(info.filename.rstrip("/"), kind, info))
    else:
        for info in opened.getmembers():
            kind = (
                "link"
                if info.issym() or info.islnk()
                else "dir"
                if info.isdir()
                else "file"
                if info.isfile()
                else "other"
            )
            out.append(_Member(info.name.rstrip("/"), kind, info))
    return out


def _open_member(opened: Any, member: _Member) -> IO[bytes]:
    if isinstance(opened, zipfile.ZipFile):
        return opened.open(member.handle)
    handle = opened.extractfile(member.handle)
    if handle is None:
        raise ReleaseError(f"Cannot read {member.name} from the archive.", tip=_TAMPERED_TIP)
    return handle


def _open_archive(archive: Path) -> Any:
    try:
        if archive.name.lower().endswith(".zip"):
            return zipfile.ZipFile(archive)
        return tarfile.open(archive, "r:*")
    except (tarfile.TarError, zipfile.BadZipFile, OSError, EOFError) as exc:
        raise ReleaseError(
            f"{archive} is not a readable archive: {exc}.", tip=_TAMPERED_TIP
        ) from None


def extract_archive(archive: Path, dest: Path) -> Manifest:
    """Safely extract a release archive into the empty folder ``dest`` and verify it.

    Refused, listing every offender: absolute paths, '..', links and special files, files not in
    the manifest, manifest files missing from the archive, and any byte that differs.
    """
    archive = Path(archive)
    _check_archive_checksum(archive)
    try:
        return _extract(archive, Path(dest))
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, OSError) as exc:
        raise ReleaseError(
            f"{archive} is damaged or truncated: {type(exc).__name__}: {exc}.", tip=_TAMPERED_TIP
        ) from None


def _extract(archive: Path, dest: Path) -> Manifest:
    with _open_archive(archive) as opened:
        members = _members(archive, opened)
        issues = []
        files: dict[str, _Member] = {}
        for member in members:
            problem = safe_relative_path(member.name)
            if problem:
                issues.append(f"{member.name!r} {problem}")
            elif member.kind == "link":
                issues.append(f"{member.name} is a link")
            elif member.kind == "other":
                issues.append(f"{member.name} is not a regular file or folder")
            elif member.kind == "file":
                if member.name in files:
                    issues.append(f"{member.name} appears twice")
                files[member.name] = member
        _raise_issues(f"In {archive}, unsafe members", issues, _TAMPERED_TIP)
        if MANIFEST_FILE not in files:
            raise ReleaseError(f"{archive} has no {MANIFEST_FILE}.", tip=_TAMPERED_TIP)
        with _open_member(opened, files[MANIFEST_FILE]) as handle:
            manifest = Manifest.from_json(handle.read(), f"{archive}!{MANIFEST_FILE}")
        listed = {entry.path: entry for entry in manifest.files()}
        for name in sorted(files.keys() - listed.keys() - {MANIFEST_FILE}):
            issues.append(f"{name} is in the archive but not in the manifest")
        for name in sorted(listed.keys() - files.keys()):
            issues.append(f"{name} is in the manifest but not in the archive")
        _raise_issues(f"In {archive}, archive and manifest disagree", issues, _TAMPERED_TIP)

        base = Path(dest).resolve()
        base.mkdir(parents=True, exist_ok=True)
        for name, member in files.items():
            target = (base / name).resolve()
            if not target.is_relative_to(base):  # defence in depth after safe_relative_path
                raise ReleaseError(f"In {archive}, {name} escapes the extraction folder.")
            target.parent.mkdir(parents=True, exist_ok=True)
            with _open_member(opened, member) as source, open(target, "xb") as out:
                sha256, size = _copy_hashing(source, out)
            entry = listed.get(name)
            if entry is not None and (sha256 != entry.sha256 or size != entry.size):
                issues.append(
                    f"{name}: sha256 {sha256[:16]}… ({size} bytes) does not match the "
                    f"manifest's {entry.sha256[:16]}… ({entry.size} bytes)"
                )
        _raise_issues(f"In {archive}, files were modified", issues, _TAMPERED_TIP)
    return manifest


@contextlib.contextmanager
def opened_release(path: str | os.PathLike[str]) -> Iterator[tuple[Path, Manifest]]:
    """(folder, verified manifest) of a release folder or archive, for the block's duration."""
    path = Path(path)
    if path.is_dir():
        yield path, verify_folder(path)
        return
    if not is_archive(path):
        raise ReleaseError(
            f"{path} is neither a release folder nor a release archive "
            f"({', '.join(ARCHIVE_SUFFIXES)}).",
            tip="Pass artifacts/releases/<model>/<version> or the archive inside it.",
        )
    folder = Path(tempfile.mkdtemp(prefix="qnn-release-"))
    try:
        yield folder, extract_archive(path, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def verify(path: str | os.PathLike[str]) -> Manifest:
    """Verify a release folder or archive completely; return its manifest."""
    with opened_release(path) as (_, manifest):
        return manifest
