"""Atomic writes and streamed hashing: no half-written artifact is ever visible."""

from __future__ import annotations

import contextlib
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
    "link_or_copy",
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
