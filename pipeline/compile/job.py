"""The messages between the compile stage and its worker process, typed once for both sides.

The parent writes a ``CompileJob`` (JSON) and starts ``python -m pipeline.compile.worker JOB``;
the worker rewrites a ``WorkerResult`` after every step, so that when QNN kills it the parent still
knows the last step reached and everything measured before it, and prints ``stage_line(step)`` in
its log so the parent can cut the log by step.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from qnn_ctx_runtime.typed import parse, to_json_value

from ..core.records import BucketOutcome, CtxSet, Failure, LoadTimes, Memory

STAGE_MARKER = "[compile_worker] stage: "
# In a validation gate's text where a pre-quantized model's output is held to its own floor.
LOWERED_GATE = "lowered to the pre-quantized model's own rounding floor, less a margin"
T = TypeVar("T")


def stage_line(stage: str) -> str:
    """The log line the worker prints when it starts ``stage``; the parent searches for it."""
    return f"{STAGE_MARKER}{stage}"


@dataclass(frozen=True)
class BucketJob:
    """One static shape of the variant: its QDQ model, float model and held-out samples."""

    name: str
    qdq: str
    float_model: str
    heldout: list[str]
    ctx_name: str
    htp_probe: str = ""  # the quantize stage's HtpProbeRecord of this QDQ, if it left one
    # A streaming model: every held-out window in order (``heldout`` is spread over them), for
    # the closed loop (``CompileJob.stream_states``).
    stream: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class CompileJob:
    """One variant: every bucket of one model for one target chip with one toolchain."""

    model: str
    target: str
    buckets: list[BucketJob]  # smallest first
    out_dir: str
    result: str
    soc_model: int
    htp_arch: int
    qnn_sdk: str  # the pinned SDK the EPContext nodes must report
    packaging: list[str]  # with several buckets: "shared" and/or "standalone"
    backend_type: str = "htp"
    embed: bool = True  # a single ctx or the standalone set; a shared set is always embed 0
    qnn_options: dict[str, str] = field(default_factory=dict)
    log_severity: int = 2
    load_runs: int = 3
    max_partitions: int = 1
    allowed_cpu_ops: list[str] = field(default_factory=list)
    # Integer outputs a QuantizeLinear writes: [scale, zero point] (the quantize record's), to
    # compare them as values.
    output_grids: dict[str, list[float]] = field(default_factory=dict)
    output_steps: dict[str, float] = field(default_factory=dict)  # metrics.output_steps
    min_snr_db: float = 0.0
    # Per output, a lower gate for a pre-quantized model: its own rounding floor less a margin
    # (an implementation that rounds ties otherwise lands about that far from the CPU).
    snr_floor_db: dict[str, float] = field(default_factory=dict)
    validate_samples: int = 16
    validate_budget_s: float = 0.0  # HTP seconds for validation (core.layout.HTP_BUDGET_S); 0: none
    # Validation stops once ENOUGH_SAMPLES (core.layout) have run this far or more vs float pooled,
    # each of them ENOUGH_MARGIN_DB less at least, as the quantize stage's judge does (its target
    # plus that margin; 0: every sample runs, as for a model keeping its own quantization).
    enough_db: float = 0.0
    probe_timeout_s: float = 300.0
    # A streaming model's state input -> the output that feeds it (the quantize record's): the
    # ctx is also run fed its own state over ``BucketJob.stream``: this many windows at most,
    # none started after this many HTP seconds (core.layout.CLOSED_LOOP_WINDOWS, ..._BUDGET_S).
    stream_states: dict[str, str] = field(default_factory=dict)
    closed_loop_windows: int = 0
    closed_loop_budget_s: float = 0.0
    seed: int = 0

    @property
    def multi(self) -> bool:
        return len(self.buckets) > 1

    @property
    def largest(self) -> BucketJob:
        return self.buckets[-1]


@dataclass
class WorkerResult:
    """What the worker knows so far; rewritten atomically after every step."""

    stage: str = "register"
    status: str = "running"  # running | ok | failed
    installed: dict[str, str] = field(default_factory=dict)
    sets: list[CtxSet] = field(default_factory=list)
    shared_load_probe: str = ""
    validated_with: str = ""
    buckets: dict[str, BucketOutcome] = field(default_factory=dict)
    memory: Memory | None = None
    load: LoadTimes | None = None
    timing_online_compile: bool = False  # an abort now is the QDQ benchmark's, not the ctx's
    compile_time_s: float = 0.0
    error: Failure | None = None


def write_message(path: Path, message: object) -> None:
    """Write a job or result atomically (the reader never sees half a file)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(to_json_value(message), indent=2), encoding="utf-8")
    os.replace(tmp, path)


def read_message(cls: type[T], path: Path) -> T:
    """A job or result from its file; a field either side does not know is a ValueError."""
    data = json.loads(Path(path).read_text("utf-8"))
    issues: list[str] = []
    message = parse(cls, data, "", issues)
    if issues or message is None:
        raise ValueError(f"{path}: " + "; ".join(issues[:5]))
    return message
