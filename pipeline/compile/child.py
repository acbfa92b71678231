"""Running one variant's worker in its own process, and reading what it left behind.

The QNN EP can abort the whole process from native code or hang (FACTS §4). ``run_child`` starts
the worker in its own process group with a timeout (a timeout or Ctrl-C kills the whole group),
and ``interpret`` turns its result file, exit status and log into a status and a ``Failure``:
which step, what kind (abort, crash, timeout, compose, toolchain, killed, ...), the nodes, op types
and QNN error codes the EP printed. A worker killed by an outside signal is ``killed``: an
infrastructure failure, never cached as the model's own.
"""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from qnn_ctx_runtime.typed import to_json_value

from ..core.records import Failure
from ..htp.isolation import Started, hand_over, start_module, wait_for
from .eplog import LogFacts, parse_ep_log
from .job import STAGE_MARKER, CompileJob, WorkerResult, read_message, write_message

WORKER = "pipeline.compile.worker"
AWAIT = "--await"  # the worker's option: warm up, then wait for its job file to appear
# Signals that come from outside the worker (an operator, the OOM killer, a shutdown).
OUTSIDE_SIGNALS = {signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


@dataclass
class ChildOutcome:
    result: WorkerResult
    returncode: int | None
    timed_out: bool
    seconds: float
    log: str
    out_of_memory: str = ""  # stopped by the build for the machine's memory: what it held


def run_child(
    job: CompileJob,
    work: Path,
    log_path: Path,
    timeout_s: float,
    on_tick: Callable[[str, float], None] | None = None,
) -> ChildOutcome:
    """Run the worker on ``job``; kill its whole process group on timeout or interruption."""
    result_path = Path(job.result)

    def tick(elapsed: float) -> None:
        if on_tick:
            on_tick(_read_result(result_path).stage, elapsed)

    spare = _SPARES.take() if _SPARES is not None else None
    if spare is None:
        job_path = work / "job.json"
        write_message(job_path, job)
        finished = wait_for(start_module(WORKER, job_path, log_path), timeout_s, tick)
    else:
        hand_over(spare, json.dumps(to_json_value(job)))
        finished = wait_for(spare, timeout_s, tick)
        log_path.write_text(finished.log, "utf-8")  # its warm-up's lines, then the job's
    return ChildOutcome(
        result=_read_result(result_path),
        returncode=finished.returncode,
        timed_out=finished.timed_out,
        seconds=finished.seconds,
        log=finished.log,
        out_of_memory=finished.out_of_memory,
    )


class _Spares:
    """A worker started before it is needed, warming up (onnxruntime imported, the QNN EP
    registered: 0.3-0.4 s of a worker's life) on the core the stage leaves idle while it reads
    its configs and models; whoever takes it gets the next one started, while workers may still
    be wanted."""

    def __init__(self, folder: Path, wanted: int) -> None:
        self.folder = folder
        self.wanted = wanted
        self.started = 0
        self.waiting: Started | None = None
        self._start()

    def _start(self) -> None:
        if self.started < self.wanted:
            self.started += 1
            job = self.folder / f"worker{self.started}.json"
            log = self.folder / f"worker{self.started}.log"
            self.waiting = start_module(WORKER, job, log, (AWAIT,))

    def take(self) -> Started | None:
        """A warm worker, or None (none wanted any more, or it died waiting: a cold start then
        reports why, in the variant's own log)."""
        spare, self.waiting = self.waiting, None
        if spare is not None and spare.proc.poll() is not None:
            spare.finish()
            spare = None
        self._start()
        return spare

    def close(self) -> None:
        if self.waiting is not None:
            self.waiting.kill()
            self.waiting.finish()
            self.waiting = None


_SPARES: _Spares | None = None


@contextmanager
def spare_workers(scratch: Path, wanted: int) -> Iterator[None]:
    """While the block runs, up to ``wanted`` workers are each started before ``run_child``
    needs them; one that is not taken is ended on the way out, its folder removed."""
    global _SPARES
    if _SPARES is not None or wanted < 1:
        yield
        return
    scratch.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=".compile-spares-", dir=scratch))
    spares = _SPARES = _Spares(folder, wanted)
    try:
        yield
    finally:
        _SPARES = None
        spares.close()
        shutil.rmtree(folder, ignore_errors=True)


def _read_result(path: Path) -> WorkerResult:
    """The worker's last saved result; a missing or half-written file is 'nothing yet'."""
    try:
        return read_message(WorkerResult, path)
    except (OSError, ValueError):
        return WorkerResult(stage="start")


def _signal_name(returncode: int | None) -> str:
    if returncode is None or returncode >= 0:
        return f"exit code {returncode}"
    try:
        return f"signal {signal.Signals(-returncode).name}"
    except ValueError:
        return f"signal {-returncode}"


def stage_log(log: str, stage: str) -> str:
    """The part of the worker's log written during ``stage`` (its last run)."""
    marker = f"{STAGE_MARKER}{stage}"
    lines = log.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == marker]
    if not starts:
        return log
    segment = []
    for line in lines[starts[-1] + 1 :]:
        if line.startswith(STAGE_MARKER):
            break
        segment.append(line)
    return "\n".join(segment)


def _describe_death(outcome: ChildOutcome, facts: LogFacts) -> str:
    how = _signal_name(outcome.returncode)
    if facts.abort:
        return f"native abort ({how}): terminate called, what(): {facts.abort}"
    last = [line for line in outcome.log.splitlines() if line.strip()][-3:]
    return f"{how}; last output: {' / '.join(last)[:400]}"


def _killed_from_outside(outcome: ChildOutcome, facts: LogFacts) -> bool:
    code = outcome.returncode
    if outcome.timed_out or code is None or code >= 0 or facts.abort:
        return False
    try:
        return signal.Signals(-code) in OUTSIDE_SIGNALS
    except ValueError:
        return False


def interpret(outcome: ChildOutcome, timeout_s: float) -> tuple[str, Failure | None]:
    """(status, failure) from what the child left: its result file, exit status and log."""
    result = outcome.result
    stage = result.stage
    # Facts from the failing step's own output; the whole log only adds context.
    facts = parse_ep_log(stage_log(outcome.log, stage))
    died = outcome.timed_out or outcome.out_of_memory or result.status not in ("ok", "failed")
    if died and result.timing_online_compile and result.load is not None:
        # The ctx compiled, loaded and validated; only the QDQ model's online compile (the load
        # benchmark's reference) died. The artifact is fine; the load ratio is unknown.
        why = (
            "timed out"
            if outcome.timed_out
            else f"ran out of memory ({outcome.out_of_memory})"
            if outcome.out_of_memory
            else _describe_death(outcome, facts)
        )
        result.load = replace(
            result.load, qdq_error=f"creating the QDQ session with QNN (online compile) {why}"
        )
        result.timing_online_compile = False
        return "ok", None
    if result.status == "ok" and not (outcome.timed_out or outcome.out_of_memory):
        return "ok", None
    if outcome.timed_out:
        failure = Failure(
            stage,
            "timeout",
            f"no result after {timeout_s:g} s in step '{stage}' (hang, or a model too big for "
            "compile.timeout_s)",
        )
    elif outcome.out_of_memory:
        failure = Failure(
            stage,
            "memory",
            f"the worker ran out of memory in step '{stage}': {outcome.out_of_memory}; free "
            "memory (or build this target on a larger machine) and run compile again",
        )
    elif result.status == "failed" and result.error is not None:
        failure = result.error
        if "Failed to compose Qnn graph" in failure.message + outcome.log:
            failure = replace(failure, kind="compose")
    elif _killed_from_outside(outcome, facts):
        failure = Failure(
            stage,
            "killed",
            f"the worker was killed from outside ({_signal_name(outcome.returncode)}) in step "
            f"'{stage}'; this is not the model's failure, run compile again",
        )
    else:
        abort = facts.abort or "terminate called" in outcome.log
        failure = Failure(
            stage,
            "abort" if abort else "crash",
            f"the worker died in step '{stage}': {_describe_death(outcome, facts)}",
        )
    failure = replace(
        failure,
        nodes=failure.nodes or facts.nodes,
        op_types=failure.op_types or facts.op_types,
        qnn_error_codes=failure.qnn_error_codes or facts.error_codes,
        log_errors=failure.log_errors or facts.error_lines,
        abort=failure.abort or facts.abort,
    )
    rejected = parse_ep_log(outcome.log).rejected
    if rejected:
        shown = ", ".join(f"{r['node']} ({r['op_type']}, code {r['code']})" for r in rejected[:8])
        more = f" and {len(rejected) - 8} more" if len(rejected) > 8 else ""
        failure = replace(
            failure, rejected_earlier=f"QNN declined {shown}{more}, leaving them to the CPU"
        )
    return "failed", failure
