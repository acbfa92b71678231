"""Build records: what each stage made, from what, and how it went, as typed dataclasses.

One dataclass per message, shared by whoever writes and reads it: the quantize stage writes a
``QuantizeRecord`` that compile and publish read; the compile worker fills the ``Coverage``,
``Validation``, ``LoadTimes`` and ``Failure`` that end up in the ``VariantRecord`` the compile stage
writes and publish turns into the manifest. Files are read with the strict parser of
``qnn_ctx_runtime.typed``: a record that does not parse is no record (the stage rebuilds), and
publish says which fields are wrong.

Every record carries the digests of what it was built from (source -> prepared float -> QDQ ->
ctx), so a later stage can prove its inputs are the ones the record names.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from qnn_ctx_runtime.buckets import CropRule, PadRule
from qnn_ctx_runtime.typed import parse, to_json_value

from .accuracy import Accuracy
from .fileio import sha256_file, write_json

PACKAGE_DIR = Path(__file__).resolve().parent.parent
RecordT = TypeVar("RecordT")


# -- reading and writing ----------------------------------------------------------------------


def write_record(path: Path, record: Any) -> None:
    """Write a record atomically (inf/nan kept, as Python's json reads them back)."""
    write_json(path, to_json_value(record))


def read_record(cls: type[RecordT], path: Path) -> tuple[RecordT | None, list[str]]:
    """(record, []) or (None, why it cannot be used): absent, not JSON, or not this type."""
    path = Path(path)
    if not path.is_file():
        return None, [f"{path} does not exist"]
    try:
        data = json.loads(path.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, [f"{path} is not readable JSON: {exc}"]
    issues: list[str] = []
    record = parse(cls, data, "", issues)
    if issues or record is None:
        return None, [f"{path}: {issue}" for issue in issues[:10]] or [f"{path} is malformed"]
    return record, []


# -- what a build depends on ------------------------------------------------------------------


def tool_versions(*distributions: str) -> dict[str, str]:
    """Exact installed versions (``"absent"`` when not installed) and Python's."""
    versions = {"python": platform.python_version()}
    for name in distributions:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def code_digest(*parts: str) -> str:
    """A hash of the builder's code a stage runs (subpackages or modules of ``pipeline``, and
    the runtime it shares), so that editing a transform rebuilds what it made."""
    import qnn_ctx_runtime

    digest = hashlib.sha256()
    roots = [PACKAGE_DIR / p for p in parts] + [Path(qnn_ctx_runtime.__file__).parent]
    for root in roots:
        files = [root.with_suffix(".py")] if not root.is_dir() else sorted(root.rglob("*.py"))
        for path in files:
            if path.is_file():
                digest.update(path.name.encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def folder_digest(folder: Path, pattern: str = "*") -> str:
    """Hash of every file below ``folder`` matching ``pattern`` (names and bytes), or of a file."""
    digest = hashlib.sha256()
    if folder.is_file():
        digest.update(sha256_file(folder).encode())
        return digest.hexdigest()
    for path in sorted(p for p in folder.rglob(pattern) if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode())
        digest.update(sha256_file(path).encode())
    return digest.hexdigest()


def settings_digest(settings: Any) -> str:
    """A stable hash of a dataclass or JSON-like value."""
    data = dataclasses.asdict(settings) if dataclasses.is_dataclass(settings) else settings
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


# -- quantize ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildInputs:
    """Everything that determines a quantize build; equal inputs mean the outputs are reusable."""

    source: str
    source_sha256: str
    config_digest: str  # the settings quantize reads (not model.version, not [compile])
    calibration_digest: str
    reader_digest: str
    code: str
    tools: dict[str, str]
    # The external data files of a model saved with them (location -> SHA-256): its weights.
    source_data: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class BucketArtifacts:
    """One static shape's prepared float and QDQ models and its held-out samples."""

    name: str
    shapes: dict[str, list[int]]
    float_sha256: str
    qdq_sha256: str
    heldout_digest: str
    heldout_samples: int
    # LSTM/GRU/RNN cells QNN builds for the QDQ model: they lengthen compile's time limit
    recurrent_steps: int = 0


@dataclass(frozen=True)
class QuantizeSummary:
    """The short quantization summary that the release manifest carries."""

    activation_type: str
    weight_type: str
    method: str
    calibration_samples: int
    heldout_samples: int
    worst_snr_db: float
    outputs: dict[str, Accuracy]
    prepare_steps: list[str]
    mixed_precision: list[str]  # tensors raised to 16 bit
    # A pre-quantized model's own rounding floor per output (dB): the model against itself with
    # its inputs moved by half a step. Empty for a model this pipeline quantized.
    rounding_floor_db: dict[str, float] = field(default_factory=dict)
    # Integer outputs a QuantizeLinear writes (a model with int8 I/O): [scale, zero point], so
    # that compile compares them as values (its environment may have no onnx to read them).
    output_grids: dict[str, list[float]] = field(default_factory=dict)
    # Float outputs a DequantizeLinear writes: its scale, the output's step on the NPU, so that
    # compile judges an output below its step as quantize did (metrics.BELOW_STEP).
    output_steps: dict[str, float] = field(default_factory=dict)
    # Why the HTP judge fell back to the CPU when its probe failed on the HTP (a native crash
    # of the simulator, a finalize error): compile will meet the same. Empty otherwise.
    htp_failure: str = ""
    # A streaming model's state input -> the output that feeds it (``calibration.recurrent``, or
    # found in its held-out windows): the state an app carries from call to call, which compile
    # feeds the ctx back on the HTP (``Validation.closed_loop``). Empty for other models.
    stream_states: dict[str, str] = field(default_factory=dict)
    # "whole" or "partial" when the kept model leaves tensors in float16 on the HTP: the CPU
    # computes those in float32, so ``worst_snr_db`` then says nothing of what the NPU computes.
    float16_on_htp: str = ""


@dataclass(frozen=True)
class QuantizeRecord:
    """What the quantize stage made (``record.json``), written last: no record, no build."""

    status: str  # "ok" | "failed" (below quantization.min_snr_db)
    model: str
    inputs: BuildInputs
    buckets: list[BucketArtifacts]  # smallest first; one for a model with one static shape
    pads: list[PadRule]
    crops: list[CropRule]
    summary: QuantizeSummary

    def bucket(self, name: str) -> BucketArtifacts:
        return next(b for b in self.buckets if b.name == name)


# -- compile: what the worker measures ------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: list[int]  # -1 where the buckets differ
    dtype: str  # numpy dtype name, e.g. "float32"


@dataclass(frozen=True)
class NodeRef:
    name: str
    op_type: str
    bucket: str = ""


@dataclass(frozen=True)
class Coverage:
    """Which nodes QNN runs and which stay on the CPU, and the gate on that."""

    qnn_partitions: int
    qnn_nodes: int
    cpu_compute_nodes: list[NodeRef]
    cpu_ops: dict[str, int]
    cpu_allowed_nodes: list[NodeRef]
    cpu_io_qdq_nodes: int
    passed: bool
    gate: str
    problems: list[str]
    # The declared CPU tail (ai.onnx.ml post-processing, non-tensor outputs; see
    # pipeline.graph.tails): reported, not counted against the gate.
    cpu_tail_nodes: list[NodeRef] | None = None


@dataclass(frozen=True)
class Validation:
    """The ctx on the HTP (simulator here) vs the QDQ and float models on the CPU EP."""

    ctx_vs_qdq: dict[str, Accuracy]
    ctx_vs_float: dict[str, Accuracy]
    qdq_vs_float: dict[str, Accuracy]
    worst_snr_db: float  # ctx vs QDQ, the gate's figure
    worst_snr_vs_float_db: float | None
    samples: int
    samples_source: str  # "heldout" | "random"
    passed: bool
    gate: str
    # "" when this variant ran its ctx itself; else who ran the same ctx bytes on the same
    # samples (the quantize stage's HTP judge, see HtpProbeRecord).
    measured_by: str = ""
    # held-out samples there were to run; more than ``samples`` when the simulator's time
    # budget (pipeline.core.layout.HTP_BUDGET_S) left the rest out. 0: not recorded.
    requested: int = 0
    cut_by: str = ""  # why fewer ran: "budget", "evidence", "agreement" (HtpProbeRecord), "labels"
    # A streaming model's ctx fed its own state window after window on the HTP, vs float on the
    # held-out windows in order (``core.stream.run_closed_loop``): shown, not gated. How many
    # windows ran, and how many of them were fed the ctx's own state.
    closed_loop: dict[str, Accuracy] = field(default_factory=dict)
    closed_loop_windows: int = 0
    closed_loop_carried: int = 0
    # ... and the CPU QDQ model fed its own state on the same windows ({} for a whole-fp16 model)
    closed_loop_qdq: dict[str, Accuracy] = field(default_factory=dict)


@dataclass(frozen=True)
class EpNodes:
    """One subgraph of a session's assignment: the EP that runs it and its nodes."""

    ep: str
    nodes: list[NodeRef]


@dataclass(frozen=True)
class HtpLoad:
    """The HTP judge's own session on its ctx: what compile's worker would find loading the
    same bytes (the EP assignment, the I/O, resident memory around the load) and the time a
    session takes to create, min of ``runs`` (``pipeline.htp.probe``)."""

    assignment: list[EpNodes]
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    rss_before_bytes: int
    rss_after_bytes: int
    runs: int
    ctx_load_s: float


@dataclass(frozen=True)
class HtpProbeRecord:
    """What the quantize stage's HTP judge measured on one bucket's kept QDQ model
    (``buckets/<b>/htp_probe.json``). A compile of the same QDQ to the same ctx bytes, run on
    the same samples by the same simulator, would measure the same: compile reuses it."""

    qdq_sha256: str
    ctx_sha256: str
    onnxruntime_qnn: str
    qnn_sdk: str
    soc_model: int
    htp_arch: int
    qnn_options: dict[str, str]
    sample_sha256: list[str]  # the held-out sample files it ran, in order
    partitions: int
    cpu_nodes: int
    ctx_vs_qdq: dict[str, Accuracy]
    ctx_vs_float: dict[str, Accuracy]
    qdq_vs_float: dict[str, Accuracy]
    compile_s: float | None = None  # its offline compile of the QDQ model, in the probe child
    # the samples asked for; more than ran when the simulator's time budget left some out
    requested: int = 0
    cut_by: str = ""  # why fewer ran: "budget", "evidence" or "agreement" (pipeline.htp.probe)
    load: HtpLoad | None = None  # its session on the ctx, when the load was timed


@dataclass(frozen=True)
class CtxFacts:
    """What a compiled ctx model says about itself (EPContext nodes, model metadata)."""

    ep_context_nodes: int
    ep_sdk_version: str  # raw attribute, e.g. "v2.51.0.260929181845"
    qnn_sdk_version: str  # e.g. "2.51.0"
    ep_compatibility_info: str
    htp_archs: list[int]
    soc_models: list[int]
    embed_mode: int
    files: list[str]  # the ctx first, then the binaries it references (names in its folder)
    sizes: dict[str, int]


@dataclass(frozen=True)
class CtxSet:
    """One set of ctx files of a variant: one ctx per bucket, and the binaries they use.

    ``kind``: "single" (one bucket), "shared" (every bucket over one weight-shared binary) or
    "standalone" (one context per bucket). Paths are relative to the variant folder.
    """

    kind: str
    ctx_files: dict[str, str]  # bucket -> ctx .onnx
    bins: list[str]
    facts: dict[str, CtxFacts]
    total_bytes: int
    bucket_bytes: dict[str, int]  # what each bucket needs on its own

    @property
    def files(self) -> list[str]:
        return [*self.ctx_files.values(), *self.bins]


@dataclass(frozen=True)
class LoadTimes:
    """Session creation: from the ctx (min of runs) vs from the QDQ model with QNN compiling."""

    runs: int
    ctx_s: float | None = None  # the largest bucket's
    all_s: float | None = None  # every bucket's session, one after another
    buckets: dict[str, float] = field(default_factory=dict)
    qdq_s: float | None = None
    ratio: float | None = None
    qdq_error: str | None = None
    # "" when qdq_s is a session created here with QNN compiling online; else what it is
    qdq_timed_by: str = ""


@dataclass(frozen=True)
class Memory:
    """Resident memory of the worker around opening the buckets' sessions."""

    set: str
    rss_before_bytes: int
    rss_one_bucket_bytes: int
    rss_all_buckets_bytes: int


@dataclass(frozen=True)
class Failure:
    """Why a variant failed: the step, a kind, the message, and what the EP log said."""

    stage: str
    kind: str  # abort | crash | timeout | compose | toolchain | verify | error | killed | memory
    message: str
    nodes: list[str] = field(default_factory=list)
    op_types: list[str] = field(default_factory=list)
    qnn_error_codes: list[str] = field(default_factory=list)
    log_errors: list[str] = field(default_factory=list)
    abort: str = ""
    rejected_earlier: str = ""

    @property
    def infrastructure(self) -> bool:
        """Killed from outside, or stopped for the machine's memory (not the model's own
        doing, or not on every machine): never cached as the model's failure."""
        return self.kind in ("killed", "memory")


@dataclass(frozen=True)
class BucketOutcome:
    """A bucket's coverage and validation, and its session's inputs and outputs."""

    coverage: Coverage
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    validation: Validation | None = None


@dataclass(frozen=True)
class BuiltFrom:
    """The digests a variant was compiled from: publish checks them against the build."""

    source_sha256: str
    config_digest: str
    qdq_sha256: dict[str, str]  # bucket -> QDQ model
    float_sha256: dict[str, str]
    heldout_digest: dict[str, str]
    # ModelConfig.compile_digest(): the [compile] settings it was built with, so a shard from a
    # CI job proves it fits the config (pipeline.publish.shards); None in older records.
    compile_digest: str | None = None


@dataclass(frozen=True)
class VariantRecord:
    """Everything known about one compiled variant (``variant.json``); a variant is one
    (model, toolchain, target) triple with all its buckets."""

    model: str  # the release's version is not here: a new model.version only re-publishes
    toolchain: str  # onnxruntime-qnn version
    onnxruntime: str
    qnn_sdk: str  # the pinned SDK the toolchain bundles
    target: str
    soc_model: int
    htp_arch: int
    backend: str
    status: str  # "ok" | "failed"
    inputs_digest: str  # cache key: equal means the variant can be reused
    built_from: BuiltFrom
    sets: list[CtxSet]  # the primary set first
    validated_with: str  # the set kind coverage and validation ran on
    shared_load_probe: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    coverage: Coverage | None
    validation: Validation | None
    buckets: dict[str, BucketOutcome]
    load: LoadTimes | None
    memory: Memory | None
    compile_time_s: float
    error: Failure | None
    # QNN EP options the context was compiled with beyond backend, chip and arch ({}: QNN's
    # defaults), e.g. the HTP graph finalization level [compile] chose (CompileSection)
    qnn_options: dict[str, str] = field(default_factory=dict)

    @property
    def deferred_to_device(self) -> bool:
        """A gpu variant whose backend cannot start on the build machine (no Adreno GPU): its
        coverage gate runs at load on the device (pipeline.compile.gpu)."""
        return (
            self.backend == "gpu"
            and self.status == "ok"
            and self.error is not None
            and self.error.kind == "unavailable"
        )

    @property
    def passed(self) -> bool:
        return (
            self.status == "ok"
            and (self.deferred_to_device or (self.coverage is not None and self.coverage.passed))
            and self.validation is not None
            and self.validation.passed
        )

    def set_of(self, kind: str) -> CtxSet | None:
        return next((s for s in self.sets if s.kind == kind), None)

    @property
    def files(self) -> list[str]:
        """Every file of every set, relative to the variant folder."""
        return [f for s in self.sets for f in s.files]

    def failed_gates(self) -> list[str]:
        """Why this variant may not be published (empty when it passed)."""
        reasons = []
        if self.status != "ok":
            error = self.error
            reasons.append(f"{error.stage}: {error.message}" if error else f"status {self.status}")
        for name, section in (("coverage", self.coverage), ("validation", self.validation)):
            if section is None and name == "coverage" and self.deferred_to_device:
                continue
            if section is None:
                if self.status == "ok":
                    reasons.append(f"{name}: not measured")
            elif not section.passed:
                reasons.append(f"{name}: {section.gate or 'gate not passed'}")
        return reasons
