"""One job in a child process: its own process group, a time limit, death with the parent.

The parent writes the job file and waits; the child rewrites a result file after every step, so
when QNN kills it the parent still knows how far it got. A timeout or Ctrl-C kills the whole
process group; the child asks Linux to kill it when the parent dies (``die_with_parent``).
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import qnn_ctx_runtime

# Signals that come from outside the worker (an operator, the OOM killer, a shutdown).
OUTSIDE_SIGNALS = {signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
ANSI_CODES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass
class Finished:
    """How the child ended: exit status (negative: the signal), whether the time ran out."""

    returncode: int | None
    timed_out: bool
    seconds: float
    log: str

    def signal_name(self) -> str:
        code = self.returncode
        if code is None or code >= 0:
            return f"exit code {code}"
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"

    def killed_from_outside(self) -> bool:
        code = self.returncode
        if self.timed_out or code is None or code >= 0 or "terminate called" in self.log:
            return False
        try:
            return signal.Signals(-code) in OUTSIDE_SIGNALS
        except ValueError:
            return False


def child_env() -> dict[str, str]:
    """This process's environment, with this checkout's pipeline and qnn_ctx_runtime importable."""
    env = dict(os.environ)
    roots = [
        str(Path(__file__).resolve().parents[2]),
        str(Path(qnn_ctx_runtime.__file__).parents[1]),
    ]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*roots, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_module(
    module: str,
    job_path: Path,
    log_path: Path,
    timeout_s: float,
    on_tick: Callable[[float], None] | None = None,
) -> Finished:
    """``python -m module job_path`` with output to ``log_path``; killed after ``timeout_s``."""
    started = time.monotonic()
    timed_out = False
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, str(job_path)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env(),
            start_new_session=True,  # its own process group, so a kill takes its children too
        )
        try:
            while True:
                try:
                    proc.wait(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    elapsed = time.monotonic() - started
                    if on_tick:
                        on_tick(elapsed)
                    if elapsed > timeout_s:
                        timed_out = True
                        kill_group(proc)
                        break
        except BaseException:  # Ctrl-C: leave no orphan compiling in the background
            kill_group(proc)
            raise
    text = log_path.read_text("utf-8", errors="replace") if log_path.is_file() else ""
    plain = ANSI_CODES.sub("", text)
    if plain != text:  # onnxruntime colours its log lines even into a file; logs stay plain
        log_path.write_text(plain, "utf-8")
    return Finished(proc.returncode, timed_out, time.monotonic() - started, plain)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def die_with_parent() -> None:
    """Linux: SIGKILL this process when the process that started it dies (kill -9 included),
    so no orphan keeps compiling; the process-group kill covers its own children."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)
