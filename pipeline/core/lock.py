"""One run per model at a time, and the litter of killed runs swept away.

Two stages on one model at once (quantize and quantize, compile and compile, compile and publish)
would replace each other's files half-way and delete each other's temporary folders. So each
stage's entry function holds ``build/.<model>.lock`` (``ModelPaths.lock``) for its whole run:
an OS file lock (``flock`` on POSIX, ``msvcrt.locking`` on Windows) taken without waiting. A
second run is refused at once with a ``BusyError`` that names the holder (stage, pid, start).
The OS releases the lock when its holder dies, ``kill -9`` included, so a lock is never stale.

Holding the lock, a stage knows that no other run works on the model, so every temporary name in
its build folder (a name starting with '.': no artifact has one, see core.layout) is the litter
of a killed run, and removes it before it starts.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from .errors import BusyError
from .layout import ModelPaths

F = TypeVar("F", bound=Callable[..., Any])
_HELD: dict[Path, int] = {}  # lock file -> depth: a stage may call another locked function


def _try_lock(fd: int) -> bool:
    if os.name == "nt":  # pragma: no cover - Windows
        import msvcrt

        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _holder(lock: Path) -> str:
    try:
        info = json.loads(lock.read_text("utf-8"))
        return f"`{info['stage']}` (pid {info['pid']} on {info['host']}, started {info['started']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another run"


@contextlib.contextmanager
def model_lock(paths: ModelPaths, stage: str) -> Iterator[None]:
    """Hold the model's lock for the block, or raise BusyError at once; sweep litter first."""
    lock = paths.lock.absolute()
    if lock in _HELD:
        _HELD[lock] += 1
        try:
            yield
        finally:
            _HELD[lock] -= 1
        return
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not _try_lock(fd):
            model = paths.root.name
            raise BusyError(
                f"{model} is busy: {_holder(lock)} is building it in {paths.root.parent.parent}; "
                f"`{stage}` on the same model at the same time would replace or delete that "
                "run's work.",
                tip=f"Wait until it ends (or stop it), then run `{stage}` again; a run that was "
                "killed frees the lock by itself. Builds of other models, or in another "
                "--artifacts folder, may run at the same time.",
            )
        info = {
            "stage": stage,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.datetime.now().isoformat(timespec="seconds"),
        }
        if os.name != "nt":  # Windows locks byte 0 against reads too; the holder stays unnamed
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps(info).encode())
        _HELD[lock] = 1
        try:
            sweep_litter(paths.root)
            yield
        finally:
            del _HELD[lock]
    finally:
        os.close(fd)  # releases the lock


def locked(stage: str) -> Callable[[F], F]:
    """Decorate a stage entry ``f(config, artifacts, ...)`` to run under the model's lock."""

    def decorate(function: F) -> F:
        @functools.wraps(function)
        def wrapper(config: Any, artifacts: Path, *args: Any, **kwargs: Any) -> Any:
            with model_lock(ModelPaths.of(artifacts, config.model.name), stage):
                return function(config, artifacts, *args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def sweep_litter(root: Path) -> list[Path]:
    """Remove every temporary name (starting with '.') under a model's build folder."""
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for folder, dirs, files in os.walk(root):
        base = Path(folder)
        for name in [d for d in dirs if d.startswith(".")]:
            dirs.remove(name)
            shutil.rmtree(base / name, ignore_errors=True)
            removed.append(base / name)
        for name in files:
            if name.startswith("."):
                with contextlib.suppress(OSError):
                    (base / name).unlink()
                removed.append(base / name)
    return removed
