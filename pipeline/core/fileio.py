"""Atomic writes and streamed hashing: no half-written artifact is ever visible."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from qnn_ctx_runtime.release import sha256_file

__all__ = [
    "atomic_dir",
    "atomic_path",
    "check_writable_folder",
    "describe_os_error",
    "link_or_copy",
    "pid_scratch",
    "sha256_bytes",
    "sha256_file",
    "write_json",
    "write_text",
]


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temp path beside ``target``; rename it into place only if the block succeeds."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def restored_after(target: str | os.PathLike[str]) -> Iterator[None]:
    """``target`` as it is now is back in place when the block ends, however it ends: the
    block may overwrite it meanwhile (a file copy where rebuilding it would cost more)."""
    target = Path(target)
    fd, kept_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".kept", dir=target.parent)
    os.close(fd)
    shutil.copyfile(target, kept_name)
    try:
        yield
    finally:
        os.replace(kept_name, target)


def write_text(target: str | os.PathLike[str], text: str) -> None:
    with atomic_path(target) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(target: str | os.PathLike[str], data: Any) -> None:
    write_text(target, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temp folder beside ``target``; move it into place only if the block succeeds.

    A reader never sees a partly written ``target``: before the swap it is the old folder, after
    it the complete new one. POSIX cannot rename a folder over a non-empty one, so the old folder
    is first renamed aside; for that instant ``target`` is absent (a reader sees no folder, never
    a partial one). If moving the new folder in fails, the old one is renamed back, and the
    error propagates; the old folder is deleted only after the new one is in place.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield tmp
        if not target.exists():
            os.replace(tmp, target)
            return
        aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
        os.rmdir(aside)  # only its unique name is needed
        os.replace(target, aside)
        try:
            os.replace(tmp, target)
        except BaseException:
            os.replace(aside, target)  # put the old folder back
            raise
        shutil.rmtree(aside, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def link_or_copy(source: Path, target: Path) -> None:
    """``target`` with the bytes of ``source``: a hard link where the file system allows one."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


# errno -> (what it means here, the fix)
_OS_FIXES = {
    errno.ENOSPC: ("the disk is full", "Free space there, or pass --artifacts on another disk."),
    errno.EDQUOT: ("the disk quota is used up", "Free space, or pass --artifacts elsewhere."),
    errno.EFBIG: (
        "the file grew past the size limit",
        "Raise the limit (ulimit -f) or free space.",
    ),
    errno.EROFS: ("the file system is read-only", "Pass --artifacts on a writable disk."),
    errno.EACCES: (
        "permission denied",
        "Pass --artifacts a folder you may write, or fix its rights.",
    ),
    errno.EPERM: ("not permitted", "Pass --artifacts a folder you may write, or fix its rights."),
    errno.ENOTDIR: ("a path in it is a file, not a folder", "Remove or rename that file."),
    errno.EISDIR: ("it is a folder, not a file", "Remove or rename that folder."),
}


def describe_os_error(exc: OSError) -> tuple[str, str]:
    """(message naming the path and the cause, tip) for an OSError met while building."""
    where = exc.filename or "a file"
    cause, fix = _OS_FIXES.get(exc.errno or -1, (exc.strerror or str(exc), ""))
    other = f" -> {exc.filename2}" if exc.filename2 else ""
    return (
        f"Cannot write or read {where}{other}: {cause} ({exc.strerror or exc}). Nothing "
        "half-written was kept: every artifact is written to a temporary name and renamed "
        "into place.",
        fix or "Check the path and the disk, then run the stage again.",
    )


def check_writable_folder(folder: Path, what: str = "--artifacts") -> None:
    """``folder`` exists (or is created) as a folder this process can write into; else an
    ArtifactsError naming it, before any work is done."""
    from .errors import ArtifactsError

    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ArtifactsError(
            f"{what} {folder} is a file, not a folder.",
            tip=f"Pass a folder as {what} (it is created when missing).",
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        cause, fix = _OS_FIXES.get(exc.errno or -1, (exc.strerror or str(exc), ""))
        raise ArtifactsError(
            f"{what} {folder} cannot be written: {cause} ({exc.strerror or exc}).",
            tip=fix or f"Pass a writable folder as {what}.",
        ) from None


def pid_scratch(prefix: str) -> tempfile.TemporaryDirectory[str]:
    """A scratch folder in the system temp folder whose name carries this process's id, so a
    later run can tell the litter of a killed run (its process is gone) from a live one's."""
    sweep_dead_scratch(prefix)
    return tempfile.TemporaryDirectory(prefix=f"{prefix}{os.getpid()}-")


def sweep_dead_scratch(prefix: str) -> list[Path]:
    """Remove ``<tmp>/<prefix><pid>-*`` folders whose process no longer runs."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob(f"{prefix}*-*"):
        pid = path.name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def pid_alive(pid: int) -> bool:
    """True when a process with this id runs (or may run: no right to signal it)."""
    if pid == os.getpid():
        return True
    if os.name != "posix":
        return True  # no cheap check: never delete another run's folder
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
