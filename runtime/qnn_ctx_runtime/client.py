"""The client of the NPU worker: ``connect(release, python=...)`` from any process, then ``run``.

On a Snapdragon laptop the app's Python (x64 under emulation, or any venv with packages that have
no ARM64 wheels) cannot drive the NPU: QNN's ARM64 drivers kill an emulated process (exit 127).
``connect`` starts ``python -m qnn_ctx_runtime serve RELEASE`` in the Python that can (``python=``,
e.g. a native ARM64 one with onnxruntime-qnn), waits for its READY frame (which carries
``facts()``), and returns a :class:`WorkerModel` whose ``run(feeds)`` behaves like
``load(...).run(feeds)``: same outputs, same exceptions with the same messages (a ``FeedError``
raised in the worker is raised here), the worker's warnings re-issued here.

Tensors cross as raw bytes (``qnn_ctx_runtime.wire``): small ones in the pipe, large ones through
shared memory, written once by the sender and read in place by the receiver. Outputs that came
through shared memory are views of it; a segment is reused only when no returned array still
views it.

The client never hangs: the handshake and every call have a deadline (``start_timeout``,
``call_timeout``, or ``run(..., timeout=)``); a watchdog kills a worker that passes it, even while
a write into a full pipe blocks. A worker that dies (exit 127, a native abort, a signal, an HTP
subsystem restart that takes the process down) is reported with its exit code or signal and the
last lines of its stderr, restarted once, and the call retried; a second death before a call
succeeds again is a :class:`WorkerError`. A timeout stops the worker and raises
:class:`WorkerTimeout`; the next call starts a new one.

Standard library and numpy only, so it runs in a Python without onnxruntime.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import io
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from . import wire
from .errors import ActionableError, FeedError, ReleaseError, ToolchainError, UsageError
from .manifest import TensorInfo

STDERR_LINES = 20
CLOSE_WAIT_S = 5.0

_REBUILT = {c.__name__: c for c in (FeedError, ReleaseError, ToolchainError, UsageError)}
_REBUILT["ActionableError"] = ActionableError


class WorkerError(ActionableError):
    """The NPU worker died, could not start, or raised something that has no type here.

    ``returncode`` is its exit code (negative: the signal that killed it, on POSIX) when it
    ended, ``stderr`` its last lines.
    """

    def __init__(
        self,
        message: str,
        tip: str | None = None,
        returncode: int | None = None,
        stderr: list[str] | None = None,
    ) -> None:
        super().__init__(message, tip)
        self.returncode = returncode
        self.stderr = stderr or []


class WorkerTimeout(WorkerError):
    """The worker gave no answer before the deadline; it was stopped."""


def describe_exit(code: int | None) -> str:
    """An exit status in words: the signal's name, 127's meaning on Windows ARM64, NTSTATUS."""
    if code is None:
        return "no exit status"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {-code} ({name})"
    if code == 127:
        return (
            "exit code 127 (on Windows ARM64: an x86/x64 Python under emulation, killed by "
            "QNN's ARM64 drivers)"
        )
    status = code & 0xFFFFFFFF
    if status >= 0xC0000000:
        known = {
            0xC0000005: "access violation",
            0xC000001D: "illegal instruction",
            0xC0000409: "fail-fast / stack buffer overrun",
            0xC0000374: "heap corruption",
        }
        return f"exit status {status:#010x} ({known.get(status, 'NTSTATUS')})"
    return f"exit code {code}"


class _Ended(Exception):
    """The worker's stdout ended (it died, or wrote something that is not a frame)."""

    def __init__(self, error: BaseException | None = None) -> None:
        super().__init__(str(error or "end of stream"))
        self.error = error


class _Died(Exception):
    """The worker is gone; ``error`` is the WorkerError that says why."""

    def __init__(self, error: WorkerError) -> None:
        super().__init__(error.message)
        self.error = error


class _Process:
    """One worker process: its frame streams, and its last stderr lines (a thread drains them,
    so a chatty worker never blocks on a full stderr pipe)."""

    def __init__(
        self, command: list[str], env: Mapping[str, str] | None, cwd: str | None, echo: bool
    ) -> None:
        flags = getattr(subprocess, "CREATE_NO_WINDOW", 0) if sys.platform == "win32" else 0
        self.command = command
        self.started = time.monotonic()
        self.popen = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            bufsize=0,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            creationflags=flags,
        )
        self.reader = io.BufferedReader(self.popen.stdout, 1 << 16)  # type: ignore[arg-type]
        self.tail: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        self._echo = echo
        self._stderr = threading.Thread(
            target=self._read_stderr, daemon=True, name="qnn-worker-stderr"
        )
        self._stderr.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _read_stderr(self) -> None:
        assert self.popen.stderr is not None
        with io.BufferedReader(self.popen.stderr) as stream:  # type: ignore[arg-type]
            for raw in stream:
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                self.tail.append(line)
                if self._echo:
                    print(line, file=sys.stderr, flush=True)

    def send(self, kind: wire.Kind, meta: dict[str, Any] | None = None, **kw: Any) -> None:
        assert self.popen.stdin is not None
        wire.write_frame(self.popen.stdin, kind, meta, **kw)  # type: ignore[arg-type]

    def next(self) -> wire.Frame:
        """The next frame, read in the calling thread (no thread hop per call); blocks until
        it comes or the stream ends, which the watchdog's kill guarantees by the deadline."""
        try:
            frame = wire.read_frame(self.reader)
        except Exception as exc:  # EOF inside a frame, or not a frame at all
            raise _Ended(exc) from None
        if frame is None:
            raise _Ended()
        return frame

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()

    def end(self, wait: float = CLOSE_WAIT_S) -> int | None:
        """Wait for the exit (killing it after ``wait`` s) and for the last stderr lines."""
        try:
            code = self.popen.wait(wait)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            code = self.popen.wait()
        self._stderr.join(2.0)
        for stream in (self.popen.stdin, self.reader, self.popen.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        return code

    def stderr_tail(self) -> list[str]:
        return list(self.tail)


class _Watchdog:
    """Kills the worker of a call that passes its deadline, wherever the caller is blocked: in a
    read of the answer, or in a write into a full pipe. The kill ends the worker's streams, so the
    blocked call returns. Woken only when a deadline comes before the time it sleeps until, so a
    call usually costs two lock round trips, not a thread switch."""

    def __init__(self, expire: Callable[[], None]) -> None:
        self._expire = expire
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._sleeps_until = float("inf")
        self._stopped = False
        self.expired = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="qnn-worker-watchdog")
        self._thread.start()

    def arm(self, deadline: float) -> None:
        with self._cond:
            self._deadline, self.expired = deadline, False
            if deadline < self._sleeps_until:
                self._cond.notify()

    def disarm(self) -> bool:
        """Stop watching; True when the deadline passed (and the worker was killed)."""
        with self._cond:
            self._deadline = None
            return self.expired

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _loop(self) -> None:
        with self._cond:
            while not self._stopped:
                if self._deadline is None:
                    self._sleeps_until = float("inf")
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._sleeps_until = self._deadline
                    self._cond.wait(left)
                    continue
                self._deadline, self.expired = None, True
                self._expire()


class _Slot:
    """A response segment and the lease (an array over it) that the last outputs view."""

    def __init__(self, segment: wire.Segment) -> None:
        self.segment = segment
        self.lease: weakref.ref[np.ndarray] | None = None

    @property
    def free(self) -> bool:
        return self.lease is None or self.lease() is None


class _Segments:
    """The client's shared memory: one request segment (reused every call), and response
    segments that are reused only when no returned array views them any more."""

    KEEP_FREE = 2

    def __init__(self) -> None:
        self.request: wire.Segment | None = None
        self.slots: list[_Slot] = []
        self.response_bytes = 0
        self.drops: list[str] = []

    def for_request(self, size: int) -> wire.Segment | None:
        if not size:
            return None
        if self.request is None or self.request.size < size:
            if self.request is not None:
                self._retire(self.request)
            self.request = wire.Segment.create(size)
        return self.request

    def offer(self) -> _Slot | None:
        """A free response slot, at least as large as the last outputs needed."""
        free = [s for s in self.slots if s.free]
        for extra in sorted(free, key=lambda s: s.segment.size)[: -self.KEEP_FREE or None]:
            self._drop_slot(extra)
            free.remove(extra)
        big = [s for s in free if s.segment.size >= self.response_bytes]
        if big:
            return min(big, key=lambda s: s.segment.size)
        if not self.response_bytes:
            return None
        for small in free:
            self._drop_slot(small)
        return self._new_slot(self.response_bytes)

    def grow(self, size: int, offered: _Slot | None) -> _Slot:
        """A slot of ``size`` bytes after the worker said the offered one is too small."""
        self.response_bytes = max(self.response_bytes, size)
        if offered is not None:
            self._drop_slot(offered)
        return self._new_slot(self.response_bytes)

    def lease(self, slot: _Slot) -> np.ndarray:
        """An array over the slot's memory that the returned outputs view; while any of them
        lives, the slot is not offered again."""
        lease = np.frombuffer(slot.segment.buffer, np.uint8)
        slot.lease = weakref.ref(lease)
        return lease

    def take_drops(self) -> list[str]:
        drops, self.drops = self.drops, []
        return drops

    def close(self) -> None:
        if self.request is not None:
            self.request.close()
        for slot in self.slots:
            slot.segment.close()
        self.request, self.slots, self.drops = None, [], []

    def _new_slot(self, size: int) -> _Slot:
        slot = _Slot(wire.Segment.create(size))
        self.slots.append(slot)
        return slot

    def _drop_slot(self, slot: _Slot) -> None:
        self.slots.remove(slot)
        self._retire(slot.segment)

    def _retire(self, segment: wire.Segment) -> None:
        segment.close()  # arrays still viewing it keep the memory; the worker unmaps its copy
        self.drops.append(segment.name)


class _State:
    """What the finalizer needs to stop a worker nobody closed (no reference to the model)."""

    def __init__(self) -> None:
        self.process: _Process | None = None
        self.segments = _Segments()
        self.watchdog = _Watchdog(self.kill)

    def kill(self) -> None:
        process = self.process
        if process is not None:
            process.kill()

    def shutdown(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            with contextlib.suppress(OSError, ValueError):
                process.send(wire.Kind.CLOSE)
            process.end(CLOSE_WAIT_S)
        self.segments.close()
        self.watchdog.stop()


class WorkerModel:
    """A release loaded in a worker process; ``run`` like :class:`qnn_ctx_runtime.LoadedModel`."""

    def __init__(
        self,
        release: str | os.PathLike[str],
        python: str | os.PathLike[str] | None = None,
        *,
        start_timeout: float = 120.0,
        call_timeout: float = 60.0,
        inline_limit: int = wire.INLINE_LIMIT,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        echo_stderr: bool = False,
        load_options: Mapping[str, Any] | None = None,
    ) -> None:
        for name, value in (("start_timeout", start_timeout), ("call_timeout", call_timeout)):
            if not value > 0:
                raise UsageError(
                    f"{name}={value!r}: a worker call needs a deadline.",
                    tip=f"Pass {name}= a number of seconds > 0.",
                )
        self.release = os.fspath(release)
        self.python = os.fspath(python) if python is not None else sys.executable
        self.start_timeout = float(start_timeout)
        self.call_timeout = float(call_timeout)
        self.inline_limit = int(inline_limit)
        self.load_options = dict(load_options or {})
        self._env = env
        self._cwd = os.fspath(cwd) if cwd is not None else None
        self._echo = echo_stderr
        self._lock = threading.RLock()
        self._state = _State()
        self._finalizer = weakref.finalize(self, self._state.shutdown)
        self._ready: dict[str, Any] = {}
        self._start_s: float | None = None
        self._closed = False
        self._broken: WorkerError | None = None
        self._unproven = False  # restarted, and no call has succeeded since
        self.restarts = 0
        self.inputs: list[TensorInfo] = []
        self.outputs: list[TensorInfo] = []
        try:
            self._start(None)
        except BaseException:
            self.close()
            raise

    @property
    def command(self) -> list[str]:
        """The worker's command line, to reproduce it by hand."""
        return [
            self.python,
            "-m",
            "qnn_ctx_runtime",
            "serve",
            self.release,
            *wire.option_args(self.load_options),
        ]

    @property
    def pid(self) -> int | None:
        process = self._state.process
        return process.pid if process is not None else None

    @property
    def provider(self) -> str:
        return str(self._ready.get("facts", {}).get("provider", ""))

    @property
    def on_cpu(self) -> bool:
        return self.provider == "CPUExecutionProvider"

    def facts(self) -> dict[str, Any]:
        """The worker's ``load(...).facts()``, plus ``worker``: its pid, Python, machine,
        protocol, start time and restarts."""
        ready = self._ready
        return {
            **ready.get("facts", {}),
            "worker": {
                "pid": ready.get("pid"),
                "python": ready.get("python"),
                "machine": ready.get("machine"),
                "protocol": ready.get("protocol"),
                "start_s": self._start_s,
                "restarts": self.restarts,
            },
        }

    def stderr(self) -> list[str]:
        """The last lines the current worker wrote to its stderr."""
        process = self._state.process
        return process.stderr_tail() if process is not None else []

    def run(
        self,
        feeds: Mapping[str, Any],
        output_names: list[str] | None = None,
        *,
        timeout: float | None = None,
    ) -> dict[str, np.ndarray]:
        """Run once in the worker; ``timeout`` overrides ``call_timeout`` for this call."""
        with self._lock:
            if self._closed:
                raise UsageError(f"The worker model of {self.release} was closed.", tip=_RECONNECT)
            if self._broken is not None:
                raise self._broken
            payloads = [wire.Payload.of(str(name), value) for name, value in feeds.items()]
            limit = self.call_timeout if timeout is None else float(timeout)
            if self._state.process is None:  # stopped after a timeout: a new worker
                self.restarts += 1
                self._start(None)
            try:
                outputs = self._call(payloads, output_names, limit)
            except _Died as first:
                if self._unproven:
                    self._give_up(first.error, "again before any call succeeded after a restart")
                self._start(first.error)
                try:
                    outputs = self._call(payloads, output_names, limit)
                except _Died as second:
                    self._give_up(second.error, "again when the call was retried")
            self._unproven = False
            return outputs

    def close(self) -> None:
        """Stop the worker (CLOSE, then a kill after a few seconds) and free shared memory."""
        with self._lock:
            self._closed = True
            self._finalizer()

    def __enter__(self) -> WorkerModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        facts = self._ready.get("facts", {})
        return (
            f"<WorkerModel {facts.get('model')} {facts.get('version')} {facts.get('variant')} on "
            f"{facts.get('provider')}, pid {self.pid}>"
        )

    # -- the worker process ---------------------------------------------------------------------

    def _start(self, after: WorkerError | None) -> None:
        """Start a worker and wait for READY; a death at start is restarted once."""
        if after is not None:
            self._restarting(after)
        try:
            self._spawn()
        except _Died as died:
            if after is not None:
                self._give_up(died.error, "again when it was restarted")
            self._restarting(died.error)
            try:
                self._spawn()
            except _Died as again:
                self._give_up(again.error, "again when it was restarted")

    def _restarting(self, error: WorkerError) -> None:
        warnings.warn(f"{error.message}\nRestarting the worker once.", RuntimeWarning, stacklevel=4)
        self.restarts += 1
        self._unproven = True

    def _give_up(self, error: WorkerError, when: str) -> None:
        self._broken = WorkerError(
            f"{error.message}\nThe worker died {when}; giving up.",
            tip=error.tip or _RECONNECT,
            returncode=error.returncode,
            stderr=error.stderr,
        )
        self._stop_process()
        raise self._broken

    def _spawn(self) -> None:
        self._stop_process()
        self._state.segments.close()  # a new worker maps new segments
        try:
            process = _Process(self.command, self._env, self._cwd, self._echo)
        except OSError as exc:
            raise WorkerError(
                f"Cannot start the NPU worker with {self.python}: {exc}",
                tip="Pass python= the interpreter that has qnn-ctx-runtime and onnxruntime-qnn.",
            ) from exc
        self._state.process = process
        self._state.watchdog.arm(process.started + self.start_timeout)
        try:
            frame = process.next()
        except _Ended as ended:
            if self._state.watchdog.disarm():
                raise self._timed_out(
                    f"sent no READY within start_timeout={self.start_timeout:g} s", process
                ) from None
            raise _Died(self._death(process, "before it was ready", ended)) from None
        except BaseException:
            self._state.watchdog.disarm()
            self._stop_process()
            raise
        if self._state.watchdog.disarm():  # READY came as the deadline passed: not usable
            raise self._timed_out(
                f"sent no READY within start_timeout={self.start_timeout:g} s", process
            )
        if frame.kind == wire.Kind.ERROR:
            self._warn(frame.meta.get("warnings", []))
            process.end(CLOSE_WAIT_S)
            self._state.process = None
            raise _rebuild(frame.meta, process.pid)
        if frame.kind != wire.Kind.READY or frame.meta.get("protocol") != wire.PROTOCOL:
            self._stop_process()
            raise WorkerError(
                f"The NPU worker {self.python} speaks another protocol "
                f"(got {frame.kind.name} {frame.meta.get('protocol')!r}, expected "
                f"READY {wire.PROTOCOL}).",
                tip="Install the same qnn-ctx-runtime version in both Pythons.",
            )
        self._ready = frame.meta
        self._start_s = time.monotonic() - process.started
        self.inputs = [TensorInfo(n, list(s), d) for n, s, d in frame.meta["inputs"]]
        self.outputs = [TensorInfo(n, list(s), d) for n, s, d in frame.meta["outputs"]]
        self._warn(frame.meta.get("warnings", []))

    def _stop_process(self) -> None:
        process, self._state.process = self._state.process, None
        if process is not None:
            process.kill()
            process.end(CLOSE_WAIT_S)

    def _death(self, process: _Process, when: str, ended: _Ended) -> WorkerError:
        broken = ended.error is not None and not isinstance(ended.error, EOFError)
        if broken:  # it wrote something that is not a frame: alive, but of no use
            process.kill()
        code = process.end(CLOSE_WAIT_S)
        self._state.process = None
        lines = process.stderr_tail()
        how = describe_exit(code)
        if broken:
            how += f" after its output stream broke ({ended.error})"
        tip = (
            "Point python= at a native ARM64 Python that has onnxruntime-qnn."
            if code == 127
            else f"Reproduce by hand: {' '.join(self.command)}"
        )
        return WorkerError(
            f"The NPU worker (pid {process.pid}, {self.python}) for {self.release} died {when}: "
            f"{how}." + _tail(lines),
            tip=tip,
            returncode=code,
            stderr=lines,
        )

    def _timed_out(self, what: str, process: _Process) -> WorkerTimeout:
        process.kill()
        code = process.end(CLOSE_WAIT_S)
        self._state.process = None
        lines = process.stderr_tail()
        return WorkerTimeout(
            f"The NPU worker (pid {process.pid}) for {self.release} {what}; it was stopped."
            + _tail(lines),
            tip="Raise the timeout if the model is just slow; the next call starts a new worker.",
            returncode=code,
            stderr=lines,
        )

    # -- one call -------------------------------------------------------------------------------

    def _call(
        self, payloads: list[wire.Payload], output_names: list[str] | None, timeout: float
    ) -> dict[str, np.ndarray]:
        state = self._state
        process = state.process
        assert process is not None
        segments = state.segments
        deadline = time.monotonic() + timeout
        offsets, needed = wire.placements(payloads, self.inline_limit)
        request = segments.for_request(needed)
        slot = segments.offer()
        meta: dict[str, Any] = {"outputs": output_names, "inline": self.inline_limit}
        if request is not None:
            meta["request"] = request.describe()
        if slot is not None:
            meta["response"] = slot.segment.describe()
        drops = segments.take_drops()
        if drops:
            meta["drop"] = drops
        state.watchdog.arm(deadline)
        try:
            process.send(
                wire.Kind.RUN,
                meta,
                payloads=payloads,
                offsets=offsets,
                segment=request.buffer if request is not None else None,
            )
            frame = process.next()
            if frame.kind == wire.Kind.NEED:
                slot = segments.grow(frame.meta["bytes"], slot)
                space: dict[str, Any] = {"response": slot.segment.describe()}
                drops = segments.take_drops()
                if drops:
                    space["drop"] = drops
                process.send(wire.Kind.SPACE, space)
                frame = process.next()
        except (_Ended, OSError) as exc:
            expired = state.watchdog.disarm()
            if expired:
                raise self._timed_out(f"gave no answer within {timeout:g} s", process) from None
            ended = exc if isinstance(exc, _Ended) else _Ended()
            raise _Died(self._death(process, "during a call", ended)) from None
        except BaseException:  # KeyboardInterrupt: the stream's state is unknown, start afresh
            state.watchdog.disarm()
            self._stop_process()
            raise
        if state.watchdog.disarm():  # the answer came, the kill too: the next call restarts
            self._stop_process()
        if request is not None:
            request.unlink()  # the worker has it mapped now
        self._warn(frame.meta.get("warnings", []))
        if frame.kind == wire.Kind.ERROR:
            raise _rebuild(frame.meta, process.pid)
        if frame.kind != wire.Kind.RESULT:
            self._stop_process()
            raise WorkerError(f"The NPU worker answered a run with {frame.kind.name}.")
        lease = None
        if "segment" in frame.meta and slot is not None:
            slot.segment.unlink()
            lease = segments.lease(slot)
        return {t.name: t.value_in(lease) for t in frame.tensors}

    def _warn(self, caught: list[dict[str, str]]) -> None:
        for item in caught:
            category = getattr(builtins, item.get("category", ""), None)
            if not (isinstance(category, type) and issubclass(category, Warning)):
                category = RuntimeWarning
            warnings.warn(item.get("message", ""), category, stacklevel=4)


_RECONNECT = "Call qnn_ctx_runtime.connect() again."


def _tail(lines: list[str]) -> str:
    if not lines:
        return " It wrote nothing to stderr."
    return "\nLast lines of its stderr:\n" + "\n".join(f"  {line}" for line in lines)


def _rebuild(meta: dict[str, Any], pid: int) -> Exception:
    """The worker's exception as the same type with the same message, where that type exists
    here (the runtime's errors, Python's built-in ones); otherwise a WorkerError naming it."""
    exc: Exception | None = None
    for name in meta.get("mro", []):
        if name in _REBUILT:
            exc = _REBUILT[name](meta["message"], meta.get("tip"))
            break
    if exc is None and meta.get("module") == "builtins":
        kind = getattr(builtins, meta.get("type", ""), None)
        if isinstance(kind, type) and issubclass(kind, Exception):
            try:
                args = meta.get("args")
                exc = kind(*args) if args is not None else kind(meta["message"])
            except Exception:
                exc = None
    if exc is None:
        exc = WorkerError(
            f"The NPU worker raised {meta.get('module')}.{meta.get('type')}: {meta['message']}",
            tip="Its traceback is in the exception's notes.",
        )
        exc.add_note("Traceback in the worker:\n" + meta.get("traceback", ""))
    exc.add_note(f"(raised in the NPU worker, pid {pid})")
    return exc


def connect(
    release: str | os.PathLike[str],
    python: str | os.PathLike[str] | None = None,
    *,
    start_timeout: float = 120.0,
    call_timeout: float = 60.0,
    inline_limit: int = wire.INLINE_LIMIT,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    echo_stderr: bool = False,
    **load_options: Any,
) -> WorkerModel:
    """Start ``python -m qnn_ctx_runtime serve RELEASE`` and return the model it serves.

    ``python`` is the interpreter that can drive the NPU (default: this one); on a Snapdragon
    laptop, the native ARM64 Python with ``qnn-ctx-runtime[qnn]`` installed. ``load_options`` are
    ``load()``'s (``target=``, ``allow_cpu_fallback=``, ...). ``start_timeout`` bounds the start
    (Python, onnxruntime and the release), ``call_timeout`` each run; tensors larger than
    ``inline_limit`` bytes go through shared memory. ``env`` and ``cwd`` are the worker's (default:
    this process's); ``echo_stderr`` copies its stderr here (its last lines are always kept for
    error messages, see ``stderr()``).
    """
    return WorkerModel(
        release,
        python,
        start_timeout=start_timeout,
        call_timeout=call_timeout,
        inline_limit=inline_limit,
        env=env,
        cwd=cwd,
        echo_stderr=echo_stderr,
        load_options=load_options,
    )
