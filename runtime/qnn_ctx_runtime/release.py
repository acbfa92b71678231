"""Opening a release: its manifest, and every file it lists, byte for byte.

``verify_folder`` checks a release folder; ``extract_archive`` unpacks a release archive safely
(no absolute paths, no '..', no links or special files, nothing the manifest does not list, no
member larger than the manifest says, checked before a byte is written) and checks every byte on
the way; ``opened_release`` gives either as a folder for the duration of a block. Everything a
release holds is refused at once, listing every offender: files the manifest does not list are
refused too. The manifest itself can be pinned or signed (``qnn_ctx_runtime.trust``), and what
it claims about each ctx binary (QNN SDK, compatibility string, HTP arch, soc model) must be what
the binary says (``claim_problems``).

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

from . import qnn
from .errors import ReleaseError
from .manifest import MANIFEST_FILE, Manifest, Variant, safe_relative_path
from .targets import TARGETS
from .trust import SIGNATURE_FILE, TrustPolicy, TrustReport, check_manifest

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".zip")
_CHUNK = 1 << 20
MAX_MANIFEST_BYTES = 16 << 20  # a manifest lists files; more than this is not a manifest


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hash a file in 1 MiB chunks, so big ctx binaries never sit in memory whole."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def is_archive(path: Path) -> bool:
    return path.is_file() and path.name.lower().endswith(ARCHIVE_SUFFIXES)


def _copy_hashing(source: IO[bytes], target: Any, limit: int) -> tuple[str, int]:
    """Copy at most ``limit`` bytes; one byte more and the copy stops: (sha256, size)."""
    digest, size = hashlib.sha256(), 0
    while chunk := source.read(min(_CHUNK, limit + 1 - size)):
        digest.update(chunk)
        target.write(chunk)
        size += len(chunk)
        if size > limit:
            break
    return digest.hexdigest(), size


@contextlib.contextmanager
def _writing(dest: Path) -> Iterator[None]:
    """An OSError while writing into the extraction folder is about that folder (full,
    read-only), not about the archive: say so."""
    try:
        yield
    except OSError as exc:
        raise ReleaseError(
            f"Cannot extract into {dest}: {exc.strerror or exc}"
            + (f" ({exc.filename})" if exc.filename else "")
            + ".",
            tip="Pass extract_to= a writable folder with room for the release.",
        ) from None


class _Checked:
    """A file whose write errors are reported as the extraction folder's (``_writing``)."""

    def __init__(self, handle: IO[bytes], dest: Path) -> None:
        self.handle, self.dest = handle, dest

    def write(self, data: bytes) -> int:
        with _writing(self.dest):
            return self.handle.write(data)


def _read_limited(source: IO[bytes], what: str) -> bytes:
    data = source.read(MAX_MANIFEST_BYTES + 1)
    if len(data) > MAX_MANIFEST_BYTES:
        raise ReleaseError(
            f"{what} is larger than {MAX_MANIFEST_BYTES >> 20} MiB: not a release manifest.",
            tip=_TAMPERED_TIP,
        )
    return data


def _raise_issues(what: str, issues: list[str], tip: str) -> None:
    if issues:
        shown = issues[:25] + ([f"… and {len(issues) - 25} more"] if len(issues) > 25 else [])
        raise ReleaseError(f"{what}:\n  - " + "\n  - ".join(shown), tip=tip)


_TAMPERED_TIP = "Do not use this copy: download or publish the release again."


def _read_file(path: Path, what: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return _read_limited(handle, what)
    except OSError as exc:
        raise ReleaseError(
            f"Cannot read {what} {path}: {exc.strerror or exc}.",
            tip="Pass a release folder that holds manifest.json, or its archive.",
        ) from None


def verify_folder(root: Path, policy: TrustPolicy | None = None) -> Manifest:
    """Check a release folder: a valid (pinned, signed) manifest, every listed file with its
    exact bytes, no file it does not list, and binaries that are what the manifest claims."""
    return open_folder(root, policy)[0]


def open_folder(root: Path, policy: TrustPolicy | None = None) -> tuple[Manifest, TrustReport]:
    """``verify_folder``, and what was checked about the manifest itself."""
    root = Path(root)
    raw = _read_file(root / MANIFEST_FILE, "the release manifest")
    sig_path = root / SIGNATURE_FILE
    signature = _read_file(sig_path, "the signature") if sig_path.is_file() else None
    digest, signed = check_manifest(raw, signature, policy or TrustPolicy(), str(root))
    manifest = Manifest.from_json(raw, str(root / MANIFEST_FILE))
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
    issues += [
        f"{name} is in the release folder but not in the manifest"
        for name in _extras(root, manifest)
    ]
    _raise_issues(f"Release {root} failed verification", issues, _TAMPERED_TIP)
    check_claims(root, manifest, str(root))
    pinned = bool(policy and policy.manifest_sha256)
    return manifest, TrustReport(digest, pinned, signed, "not an archive (a release folder)")


def _extras(root: Path, manifest: Manifest) -> list[str]:
    """Files in a release folder that are neither listed nor the release's own metadata
    (manifest, signature, the archive publish puts beside them and its checksum)."""
    archive = f"{manifest.model}-{manifest.version}.tar.gz"
    known = {e.path for e in manifest.files()} | {
        MANIFEST_FILE,
        SIGNATURE_FILE,
        archive,
        f"{archive}.sha256",
    }
    found = []
    for folder, _, names in os.walk(root):
        for name in names:
            relative = (Path(folder) / name).relative_to(root).as_posix()
            if relative not in known:
                found.append(relative)
    return sorted(found)


def claim_problems(root: Path, manifest: Manifest) -> list[str]:
    """Where what the manifest claims about a variant (QNN SDK, EPContext ep_sdk_version,
    compatibility string, HTP arch, soc model, embed mode) is not what its binaries say."""
    issues: list[str] = []
    for variant in manifest.variants:
        issues += _variant_claims(root, variant)
    return issues


def _variant_claims(root: Path, v: Variant) -> list[str]:
    label = f"variant {v.id}"
    issues = []
    chip = TARGETS.get(v.target) if v.backend == "htp" else None
    if chip is not None and (chip.soc_model, chip.htp_arch) != (v.soc_model, v.htp_arch):
        issues.append(
            f"{label}: target {v.target} is soc_model {chip.soc_model} / HTP v{chip.htp_arch}, "
            f"but the manifest says {v.soc_model} / v{v.htp_arch}"
        )
    for index, entry in enumerate(v.buckets.entries):
        where = f"{label}: {entry.model}"
        try:
            summary = qnn.read_model_summary(root / entry.model)
        except (OSError, ValueError, IndexError) as exc:
            issues.append(f"{where} is not a readable ONNX file ({exc})")
            continue
        nodes = summary.nodes_of("EPContext")
        if v.backend != "htp":  # gpu: a float model QNN compiles on the device, no context
            if nodes:
                issues.append(f"{where} holds EPContext nodes, but the manifest says {v.backend}")
            continue
        if not nodes:
            issues.append(f"{where} has no EPContext node: it is not a compiled context")
            continue
        raw_sdks = sorted({str(n.attributes.get("ep_sdk_version", "")) for n in nodes})
        if {qnn.sdk_version(s) for s in raw_sdks} != {v.qnn_sdk_version}:
            issues.append(
                f"{where}: the manifest says QNN SDK {v.qnn_sdk_version}, its EPContext node "
                f"says {raw_sdks}"
            )
        elif index == 0 and v.ep_sdk_version not in raw_sdks:
            issues.append(
                f"{where}: the manifest says ep_sdk_version {v.ep_sdk_version!r}, its EPContext "
                f"node says {raw_sdks}"
            )
        modes = {int(n.attributes.get("embed_mode", 1)) for n in nodes}
        if modes != {v.embed_mode}:
            issues.append(
                f"{where}: the manifest says embed_mode {v.embed_mode}, it has {sorted(modes)}"
            )
        compat = summary.metadata.get(qnn.COMPATIBILITY_KEY, "")
        if index == 0 and compat != v.ep_compatibility_info:
            issues.append(
                f"{where}: the manifest says ep_compatibility_info {v.ep_compatibility_info!r}, "
                f"the binary says {compat!r}"
            )
        if not compat:
            continue
        try:
            info = qnn.parse_compatibility_info(compat)
        except ValueError as exc:
            issues.append(f"{where}: {exc}")
            continue
        for problem in qnn.compatibility_problems(info, v.soc_model, v.htp_arch):
            issues.append(
                f"{where} is {problem} (the manifest claims soc_model {v.soc_model} / HTP "
                f"v{v.htp_arch})"
            )
        if info.sdk and qnn.sdk_version(info.sdk) != v.qnn_sdk_version:
            issues.append(
                f"{where}: its compatibility string names QNN SDK {info.sdk}, the manifest "
                f"{v.qnn_sdk_version}"
            )
    return issues


def check_claims(root: Path, manifest: Manifest, where: str) -> None:
    """A ReleaseError listing every claim of the manifest its binaries contradict."""
    _raise_issues(
        f"Release {where}: the manifest's claims do not match its ctx binaries (it was edited "
        "and re-hashed, or built wrongly)",
        claim_problems(root, manifest),
        _TAMPERED_TIP,
    )


def _check_archive_checksum(archive: Path) -> str:
    """``<archive>.sha256`` beside it must match the archive's bytes; its absence is reported
    (the status returned), never taken as nothing to check."""
    sidecar = archive.with_name(archive.name + ".sha256")
    if not sidecar.is_file():
        return f"missing: no {sidecar.name} beside the archive, so the archive as a whole was not checked"
    words = sidecar.read_text("utf-8", errors="replace").split()
    expected = words[0].lower() if words else ""
    actual = sha256_file(archive)
    if actual != expected:
        raise ReleaseError(
            f"{archive}: sha256 {actual} does not match {sidecar.name} ({expected or 'empty'}).",
            tip=_TAMPERED_TIP,
        )
    return f"matched {sidecar.name}"


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


def extract_archive(archive: Path, dest: Path, policy: TrustPolicy | None = None) -> Manifest:
    """Safely extract a release archive into the empty folder ``dest`` and verify it.

    Refused, listing every offender: absolute paths, '..', links and special files, files not in
    the manifest, manifest files missing from the archive, members larger than the manifest
    says (before anything is written), and any byte that differs.
    """
    return open_archive(archive, dest, policy)[0]


def open_archive(
    archive: Path, dest: Path, policy: TrustPolicy | None = None
) -> tuple[Manifest, TrustReport]:
    """``extract_archive``, and what was checked about the manifest and the archive."""
    archive = Path(archive)
    checksum = _check_archive_checksum(archive)
    try:
        manifest, digest, signed = _extract(archive, Path(dest), policy or TrustPolicy())
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, OSError) as exc:
        raise ReleaseError(
            f"{archive} is damaged or truncated: {type(exc).__name__}: {exc}.", tip=_TAMPERED_TIP
        ) from None
    check_claims(Path(dest), manifest, str(archive))
    pinned = bool(policy and policy.manifest_sha256)
    return manifest, TrustReport(digest, pinned, signed, checksum)


def _member_size(member: _Member) -> int:
    """The size the archive's header declares for a member."""
    info = member.handle
    return int(info.file_size if isinstance(info, zipfile.ZipInfo) else info.size)


def _extract(archive: Path, dest: Path, policy: TrustPolicy) -> tuple[Manifest, str, str]:
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
            raw = _read_limited(handle, f"{archive}!{MANIFEST_FILE}")
        signature = None
        if SIGNATURE_FILE in files:
            with _open_member(opened, files[SIGNATURE_FILE]) as handle:
                signature = _read_limited(handle, f"{archive}!{SIGNATURE_FILE}")
        # Pinned or signed: decided before a single byte is written.
        digest, signed = check_manifest(raw, signature, policy, str(archive))
        manifest = Manifest.from_json(raw, f"{archive}!{MANIFEST_FILE}")
        listed = {entry.path: entry for entry in manifest.files()}
        for name in sorted(files.keys() - listed.keys() - {MANIFEST_FILE, SIGNATURE_FILE}):
            issues.append(f"{name} is in the archive but not in the manifest")
        for name in sorted(listed.keys() - files.keys()):
            issues.append(f"{name} is in the manifest but not in the archive")
        for name, member in sorted(files.items()):
            entry = listed.get(name)
            if entry is not None and _member_size(member) != entry.size:
                issues.append(
                    f"{name} is {_member_size(member)} bytes in the archive, but the manifest "
                    f"lists {entry.size}"
                )
        _raise_issues(f"In {archive}, archive and manifest disagree", issues, _TAMPERED_TIP)

        base = Path(dest).resolve()
        with _writing(base):
            base.mkdir(parents=True, exist_ok=True)
        for name, member in files.items():
            target = (base / name).resolve()
            if not target.is_relative_to(base):  # defence in depth after safe_relative_path
                raise ReleaseError(f"In {archive}, {name} escapes the extraction folder.")
            entry = listed.get(name)
            # Never more than the manifest's size (+1 to notice), whatever the header said.
            limit = entry.size if entry is not None else MAX_MANIFEST_BYTES
            with _writing(base):
                target.parent.mkdir(parents=True, exist_ok=True)
                out = open(target, "xb")  # noqa: SIM115 - closed below, errors wrapped
            with out, _open_member(opened, member) as source:
                sha256, size = _copy_hashing(source, _Checked(out, base), limit)
            if size > limit:
                issues.append(
                    f"{name} holds more than the {limit} bytes the manifest lists; extraction "
                    "stopped there"
                )
            elif entry is not None and (sha256 != entry.sha256 or size != entry.size):
                issues.append(
                    f"{name}: sha256 {sha256[:16]}… ({size} bytes) does not match the "
                    f"manifest's {entry.sha256[:16]}… ({entry.size} bytes)"
                )
        _raise_issues(f"In {archive}, files were modified", issues, _TAMPERED_TIP)
    return manifest, digest, signed


@contextlib.contextmanager
def opened_release(
    path: str | os.PathLike[str], policy: TrustPolicy | None = None
) -> Iterator[tuple[Path, Manifest]]:
    """(folder, verified manifest) of a release folder or archive, for the block's duration."""
    path = Path(path)
    if path.is_dir():
        yield path, verify_folder(path, policy)
        return
    if not is_archive(path):
        raise ReleaseError(
            f"{path} is neither a release folder nor a release archive "
            f"({', '.join(ARCHIVE_SUFFIXES)}).",
            tip="Pass artifacts/releases/<model>/<version> or the archive inside it.",
        )
    folder = Path(tempfile.mkdtemp(prefix="qnn-release-"))
    try:
        yield folder, extract_archive(path, folder, policy)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def verify(
    path: str | os.PathLike[str],
    expect_manifest_sha256: str | None = None,
    public_key: bytes | str | os.PathLike[str] | None = None,
) -> Manifest:
    """Verify a release folder or archive completely (optionally its pinned manifest digest
    and its signature, see ``load``); return its manifest."""
    policy = TrustPolicy(expect_manifest_sha256, public_key)
    with opened_release(path, policy) as (_, manifest):
        return manifest


def manifest_sha256(path: str | os.PathLike[str]) -> str:
    """The sha256 of a release's manifest.json (folder or archive): the value to pin."""
    path = Path(path)
    if path.is_dir():
        return hashlib.sha256(_read_file(path / MANIFEST_FILE, "the release manifest")).hexdigest()
    with _open_archive(path) as opened:
        for member in _members(path, opened):
            if member.name == MANIFEST_FILE and member.kind == "file":
                with _open_member(opened, member) as handle:
                    return hashlib.sha256(_read_limited(handle, str(path))).hexdigest()
    raise ReleaseError(f"{path} has no {MANIFEST_FILE}.", tip=_TAMPERED_TIP)
