"""One job in a child process: its own process group, a time limit, death with the parent.

The parent writes the job file and waits; the child rewrites a result file after every step, so
when QNN kills it the parent still knows how far it got. A timeout or Ctrl-C kills the whole
process group; the child asks Linux to kill it when the parent dies (``die_with_parent``). On
Windows, which has neither process groups to kill nor a parent-death signal, each child runs in a
job object that kills every process in it when its last handle closes: when the parent ends,
``kill -9``-style (TerminateProcess) included.
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import qnn_ctx_runtime

# Signals that come from outside the worker (an operator, the OOM killer, a shutdown).
OUTSIDE_SIGNALS = {signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
ANSI_CODES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass
class Finished:
    """How the child ended: exit status (negative: the signal), whether the time ran out, and
    whether the build stopped it for the machine's memory (what it held, and what was left)."""

    returncode: int | None
    timed_out: bool
    seconds: float
    log: str
    out_of_memory: str = ""

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
        if (
            self.timed_out
            or self.out_of_memory
            or code is None
            or code >= 0
            or "terminate called" in self.log
        ):
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


@dataclass
class Started:
    """A child started by ``start_module``: the process, its log file and its Windows job."""

    proc: subprocess.Popen
    log: Any  # the open log file, closed by ``finish``
    log_path: Path
    job: WindowsJob | None
    started: float

    def kill(self) -> None:
        kill_group(self.proc, self.job)

    def finish(self, timed_out: bool = False, out_of_memory: str = "") -> Finished:
        """Close the log (plain text, no ANSI codes) and the job; how the child ended."""
        self.log.close()
        if self.job is not None:
            self.job.close()
        path = self.log_path
        text = path.read_text("utf-8", errors="replace") if path.is_file() else ""
        plain = ANSI_CODES.sub("", text)
        if plain != text:  # onnxruntime colours its log lines even into a file; logs stay plain
            path.write_text(plain, "utf-8")
        seconds = time.monotonic() - self.started
        return Finished(self.proc.returncode, timed_out, seconds, plain, out_of_memory)


def start_module(
    module: str, job_path: Path, log_path: Path, options: tuple[str, ...] = ()
) -> Started:
    """Start ``python -m module [options] job_path`` with output to ``log_path``; do not wait."""
    started = time.monotonic()
    job = WindowsJob.create() if sys.platform == "win32" else None
    log = open(log_path, "wb")  # noqa: SIM115 - closed by Started.finish
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *options, str(job_path)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env(),
            start_new_session=True,  # its own process group, so a kill takes its children too
        )
    except BaseException:
        log.close()
        if job is not None:
            job.close()
        raise
    if job is not None:
        job.assign(proc)
    return Started(proc, log, log_path, job, started)


def hand_over(child: Started, job_text: str) -> None:
    """Give a child started with its job file's path last on its command line, and waiting
    for that file (``await_job``), its job: written whole, then renamed into that path. Its
    time is the job's from now, not the wait's."""
    path = Path(child.proc.args[-1])  # type: ignore[index]  # python -m MODULE ... JOB
    partial = path.with_name(path.name + ".partial")
    partial.write_text(job_text, encoding="utf-8")
    child.started = time.monotonic()
    partial.replace(path)


def await_job(job_path: Path) -> None:
    """In a child started ahead: wait for the parent to write the job (it dies with the
    parent, or is killed unused)."""
    while not job_path.is_file():
        time.sleep(0.005)


def run_module(
    module: str,
    job_path: Path,
    log_path: Path,
    timeout_s: float,
    on_tick: Callable[[float], None] | None = None,
) -> Finished:
    """``python -m module job_path`` with output to ``log_path``; killed after ``timeout_s``."""
    return wait_for(start_module(module, job_path, log_path), timeout_s, on_tick)


# A child is cut once it has run ``timeout_s`` of wall time *and* used as much CPU time (its
# process group's, every thread's), or after HANG_WALL_FACTOR times ``timeout_s`` whatever it
# used: beside other work a QNN compile that gets a third of a core is slow, not hung (a
# pyannote-like VAD's compile ran past its limit beside two other builds), and a hang that
# uses no CPU is still cut. Alone on the machine a single-threaded child is cut as before.
HANG_WALL_FACTOR = 3.0


def wait_for(
    child: Started,
    timeout_s: float,
    on_tick: Callable[[float], None] | None = None,
    memory: MemoryGuard | None = None,
) -> Finished:
    """Wait for a started child, killed (with what it started) after ``timeout_s`` from now
    of wall and CPU time both (``HANG_WALL_FACTOR``), on Ctrl-C, or when ``memory`` (by
    default: the machine's, ``MemoryGuard.for_machine``) says it holds what the machine cannot
    spare; how it ended."""
    guard = memory if memory is not None else MemoryGuard.for_machine()
    waiting = time.monotonic()
    timed_out = False
    out_of_memory = ""
    try:
        while True:
            try:
                _wait(child.proc, 0.5)
                break
            except subprocess.TimeoutExpired:
                elapsed = time.monotonic() - waiting
                if on_tick:
                    on_tick(elapsed)
                out_of_memory = guard.verdict(child.proc.pid)
                if out_of_memory:
                    child.kill()
                    break
                if elapsed > timeout_s and (
                    elapsed > timeout_s * HANG_WALL_FACTOR
                    or group_cpu_seconds(child.proc.pid) >= timeout_s
                ):
                    timed_out = True
                    child.kill()
                    break
    except BaseException:  # Ctrl-C: leave no orphan compiling in the background
        child.kill()
        child.finish()
        raise
    return child.finish(timed_out, out_of_memory)


GIB = 1 << 30


@dataclass(frozen=True)
class MemoryGuard:
    """When a child (with what it started) must be stopped for memory: when the machine has
    less than ``reserve_bytes`` available (memory and free swap) while the child holds more
    than that, or when the child holds more than ``limit_bytes`` (0: no cap of its own).

    Why: QNN's HTP compile of a 2103-node diffusion UNet grew to 23.8 GiB of a 24 GiB machine;
    the kernel's out-of-memory killer ended it (it may as well have picked the build or the
    user's editor) and the build could only report a SIGKILL. Stopped first, the child's end
    names what it held and what was left. Linux only (``/proc``); elsewhere nothing is checked.
    """

    reserve_bytes: int
    limit_bytes: int = 0

    @classmethod
    def for_machine(cls) -> MemoryGuard:
        """Keep 5% of the machine's memory, 512 MiB at least, for everything else."""
        total = _meminfo().get("MemTotal", 0)
        return cls(max(512 << 20, total // 20))

    def verdict(self, pgid: int) -> str:
        """Why the process group ``pgid`` must stop now, or "" (also where /proc is absent)."""
        if self.limit_bytes:
            held = group_resident_bytes(pgid)
            if held > self.limit_bytes:
                return (
                    f"it held {held / GIB:.2f} GiB resident, over the "
                    f"{self.limit_bytes / GIB:.2f} GiB allowed"
                )
        info = _meminfo()  # first: the group's processes are only read when the machine is short
        available, total = info.get("MemAvailable"), info.get("MemTotal", 0)
        if available is None:
            return ""
        # Free swap counts as room: with it the kernel pages out and the child goes on (slowly);
        # only with memory and swap both nearly gone does its out-of-memory killer pick.
        available += info.get("SwapFree", 0)
        if available >= self.reserve_bytes:
            return ""
        held = group_resident_bytes(pgid)
        if held <= self.reserve_bytes:
            return ""
        return (
            f"it held {held / GIB:.1f} GiB resident with {available / GIB:.1f} GiB of the "
            f"machine's {total / GIB:.1f} GiB (and its swap) left available (the build stops a child below "
            f"{self.reserve_bytes / GIB:.1f} GiB, before the kernel's out-of-memory killer picks "
            "a process)"
        )


def _meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes ({} where there is none)."""
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return {}
    found = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            found[key] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return found


def _group_members(pgid: int) -> Iterator[tuple[str, list[bytes]]] | None:
    """Each process of group ``pgid`` as (its /proc entry, its stat fields from the state on),
    or None where /proc is absent."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None

    def members() -> Iterator[tuple[str, list[bytes]]]:
        for entry in entries:
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_bytes()
                # after the command name (which may hold spaces and parentheses): state, ppid,
                # pgrp, ... utime, stime, cutime, cstime (fields 11-14 from the state on)
                fields = stat[stat.rindex(b")") + 2 :].split()
                if int(fields[2]) == pgid:
                    yield entry, fields
            except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
                continue

    return members()


def group_resident_bytes(pgid: int) -> int:
    """The resident memory of every process in process group ``pgid`` (0 where /proc is absent
    or the group is gone)."""
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    total = 0
    for entry, _ in _group_members(pgid) or ():
        try:
            total += int(Path(f"/proc/{entry}/statm").read_bytes().split()[1]) * page
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return total


def group_cpu_seconds(pgid: int) -> float:
    """The CPU time (user and system, every thread, and the children it waited for) of every
    process in process group ``pgid``; infinite where /proc is absent (the wall time alone then
    decides)."""
    members = _group_members(pgid)
    if members is None:
        return float("inf")
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return sum(sum(int(f) for f in fields[11:15]) for _, fields in members) / ticks


def _wait(proc: subprocess.Popen, timeout_s: float) -> None:
    """``proc.wait(timeout_s)``, woken the moment the child exits where Linux gives a pidfd:
    Popen's own wait with a timeout polls, sleeping up to 50 ms between looks (25 ms on
    average after every probe child and compile worker of a build)."""
    if proc.poll() is None and hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(proc.pid)
        except OSError:  # an old kernel, or the child already gone: Popen's wait says which
            fd = None
        if fd is not None:
            try:
                select.select([fd], [], [], timeout_s)
            finally:
                os.close(fd)
            proc.wait(timeout=0.05)  # exited (or TimeoutExpired, as before)
            return
    proc.wait(timeout=timeout_s)


def kill_group(proc: subprocess.Popen, job: WindowsJob | None = None) -> None:
    """Kill the child and whatever it started: its process group (POSIX) or its job (Windows)."""
    if job is not None:
        job.terminate()
    elif hasattr(os, "killpg"):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
    else:
        proc.kill()
    proc.wait()


class _BasicLimits(ctypes.Structure):
    """JOBOBJECT_BASIC_LIMIT_INFORMATION (winnt.h)."""

    _fields_ = [
        ("PerProcessUserTimeLimit", ctypes.c_int64),
        ("PerJobUserTimeLimit", ctypes.c_int64),
        ("LimitFlags", ctypes.c_uint32),
        ("MinimumWorkingSetSize", ctypes.c_size_t),
        ("MaximumWorkingSetSize", ctypes.c_size_t),
        ("ActiveProcessLimit", ctypes.c_uint32),
        ("Affinity", ctypes.c_size_t),
        ("PriorityClass", ctypes.c_uint32),
        ("SchedulingClass", ctypes.c_uint32),
    ]


class _IoCounters(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "ReadOperationCount",
            "WriteOperationCount",
            "OtherOperationCount",
            "ReadTransferCount",
            "WriteTransferCount",
            "OtherTransferCount",
        )
    ]


class JobLimits(ctypes.Structure):
    """JOBOBJECT_EXTENDED_LIMIT_INFORMATION (winnt.h): 144 bytes on 64-bit Windows."""

    _fields_ = [
        ("BasicLimitInformation", _BasicLimits),
        ("IoInfo", _IoCounters),
        ("ProcessMemoryLimit", ctypes.c_size_t),
        ("JobMemoryLimit", ctypes.c_size_t),
        ("PeakProcessMemoryUsed", ctypes.c_size_t),
        ("PeakJobMemoryUsed", ctypes.c_size_t),
    ]


JOB_OBJECT_EXTENDED_LIMIT_INFORMATION = 9  # JOBOBJECTINFOCLASS
JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE = 0x2000


def kill_on_close_limits() -> JobLimits:
    """The limits that make a job kill its processes when its last handle closes."""
    limits = JobLimits()
    limits.BasicLimitInformation.LimitFlags = JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE
    return limits


def _kernel32() -> Any:
    return ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined]


@dataclass
class WindowsJob:
    """A Windows job object holding one child (and what it starts), killed with its parent.

    The handle is not inheritable, so only this process holds it: when this process ends for
    any reason the system closes it and, with KILL_ON_JOB_CLOSE, ends the child.
    """

    handle: int

    @classmethod
    def create(cls) -> WindowsJob | None:
        """A kill-on-close job, or None (said on stderr) when Windows refuses one."""
        kernel32 = _kernel32()
        kernel32.CreateJobObjectW.restype = ctypes.c_void_p
        handle = kernel32.CreateJobObjectW(None, None)
        limits = kill_on_close_limits()
        if not handle or not kernel32.SetInformationJobObject(
            ctypes.c_void_p(handle),
            JOB_OBJECT_EXTENDED_LIMIT_INFORMATION,
            ctypes.byref(limits),
            ctypes.sizeof(limits),
        ):
            print(
                f"warning: no job object for the worker (Windows error {ctypes.get_last_error()}):"
                " it may outlive this process if this process is killed",
                file=sys.stderr,
            )
            if handle:
                kernel32.CloseHandle(ctypes.c_void_p(handle))
            return None
        return cls(handle)

    def assign(self, proc: subprocess.Popen) -> None:
        process = int(proc._handle)  # type: ignore[attr-defined]  # Popen's own process handle
        if not _kernel32().AssignProcessToJobObject(
            ctypes.c_void_p(self.handle), ctypes.c_void_p(process)
        ):
            print(
                f"warning: the worker is not in a job object (Windows error "
                f"{ctypes.get_last_error()}): it may outlive this process if this process is killed",
                file=sys.stderr,
            )

    def terminate(self) -> None:
        _kernel32().TerminateJobObject(ctypes.c_void_p(self.handle), 1)

    def close(self) -> None:
        if self.handle:
            _kernel32().CloseHandle(ctypes.c_void_p(self.handle))
            self.handle = 0


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
