"""Where every artifact lives, named once: each stage asks this module for its paths.

    <artifacts>/build/<model>/
        record.json                       the quantize record (written last: no record, no build)
        report.md | report.json           preparation, quantization, accuracy
        report.html                       the quantize and compile reports with plots, one page
        ranges.json                       calibrated ranges, merged over the buckets
        heldout/sample_NNNN.npz           held-out samples at their true size (+ index.json)
        buckets/<bucket>/float.onnx       prepared static float model of one shape
        buckets/<bucket>/qdq.onnx         its QDQ model
        buckets/<bucket>/heldout/         the held-out samples that fit it, padded into it
        ctx/report.md | report.json       one row per compiled variant
        ctx/<onnxruntime-qnn>/<target>/   one variant: variant.json, compile.log, ctx files
                                          (standalone/ holds one context per bucket)
    <artifacts>/build/index.html          every model of the run: status, SNRs, links
    <artifacts>/releases/<model>/<version>/   a published release

No artifact's name starts with '.': such names are the temporary files and folders of a run
(atomic writes, scratch folders), so the stage holding a model's lock removes them (core.lock).

A model with one static shape has one bucket, named ``static``. Every name that becomes a folder
(model, version, bucket, toolchain, target) is one safe path component (``config.SAFE_COMPONENT``),
so nothing is ever written outside ``<artifacts>``.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .config import SAFE_COMPONENT_RULE, unsafe_component
from .errors import ConfigError

BUILD_DIR = "build"
RELEASES_DIR = "releases"
RECORD_FILE = "record.json"
VARIANT_FILE = "variant.json"
REPORT_MD = "report.md"
REPORT_JSON = "report.json"
REPORT_HTML = "report.html"  # per model, beside report.md (pipeline.report_html)
INDEX_HTML = "index.html"  # build/index.html over every model
SAMPLE_GLOB = "sample_*.npz"
# Held-out samples a context runs on the HTP (the simulator here) to be validated: compile's
# validation, and the quantize stage's first HTP probe, whose figures compile can then reuse.
VALIDATE_SAMPLES = 16
# Seconds of HTP simulator time one validation (or one judge round) may spend on its samples:
# past it, no new sample starts once HTP_MIN_SAMPLES have run. The simulator takes ~1 s a
# sample for a 224x224 CNN and minutes for a 1024x1024 segmenter, whose 16 samples would take
# hours; the report says on how many of the samples the figures are, and why. Counted in
# ``simulator_seconds``, not wall time, which the machine's load stretches: the same build cuts
# at the same sample however busy the machine is.
HTP_BUDGET_S = 120.0
HTP_MIN_SAMPLES = 2  # one per simulator process on two cores: run side by side, at no extra time
# A streaming model's ctx fed its own state (compile's closed loop): its held-out windows run in
# order, one after another (no sample shared out to a second core or skipped), up to
# CLOSED_LOOP_WINDOWS of them, and no new one after CLOSED_LOOP_BUDGET_S of HTP simulator time.
CLOSED_LOOP_WINDOWS = 64
CLOSED_LOOP_BUDGET_S = 10.0
# A judge round needs no more samples once this many have each run on the HTP at least
# ENOUGH_MARGIN_DB above the target SNR vs float: the figure over them is above it too (a pooled
# SNR is at least its samples' lowest), and the choice it decides is made.
ENOUGH_SAMPLES = 4
ENOUGH_MARGIN_DB = 3.0
# Fewer suffice when the HTP agrees with the CPU QDQ model: once AGREE_SAMPLES are at the target
# (pooled: one may be below it, a sample the CPU's figure below counts too) and the ctx is AGREE_MARGIN_DB or more closer to the CPU QDQ model (pooled)
# than that model is to float over the held-out samples, the HTP adds a noise 10x weaker than
# the quantization's, and the ctx is within 20 log10(1 + 10^-0.5) = 2.4 dB of the CPU's figure
# (the two noises add at worst in amplitude). Applied when the CPU QDQ model, measured on every
# held-out sample, is ENOUGH_MARGIN_DB above the target: the ctx is then above it as well (that
# figure, not the two samples', carries the statement: they need not reach the margin).
AGREE_SAMPLES = 2
AGREE_MARGIN_DB = 10.0
AGREE_BOUND_DB = 20 * math.log10(1 + 10 ** (-AGREE_MARGIN_DB / 20))  # 2.4 dB


def evidence_order(count: int, enough: int = ENOUGH_SAMPLES) -> list[int]:
    """The order samples run in where ``enough`` of them may decide: ``enough`` spread over the
    ``count`` first, then the others in order. The same in the judge's probes and compile's
    validation, so whichever stops early, its figures are on the same samples."""
    if count <= enough:
        return list(range(count))
    first = [round(i * (count - 1) / (enough - 1)) for i in range(enough)]
    return first + [i for i in range(count) if i not in first]


def simulator_seconds() -> float:
    """CPU seconds the HTP simulator has taken in this process so far: read around its runs
    (the only work a probe child or compile worker does then), their difference is its pace.
    Not the wall clock, which the machine's load stretches (a detector: 0.36 s a sample, 0.80 s
    beside three busy loops on two cores). The calling thread's CPU time (user and system: page
    faults of a large model's tensors are its work too) plus the user CPU time of the process's
    other threads: the simulator computes some graphs in its own HVX threads while the caller
    waits (a sample of gtcrn's GRUs: 0.13 s of the caller's CPU, 0.62 s of the process's user
    time; picodet in fp16: 0.78 and 2.62 s; a PP-OCRv4 text detector in fp16: 2.1 and 22.6 s),
    and their waiting is system time, left out (deeplab: 2.08 s of user and 1.43 s of system
    time alone, 1.80 and 0.02 s beside a second simulator). Measured alone, beside a second
    simulator and beside a running build, this figure stayed within 15% on those four models
    (the calling thread's alone: 2x on gtcrn, 20% on the detector)."""
    try:
        import resource

        own_user = resource.getrusage(resource.RUSAGE_THREAD).ru_utime
    except (ImportError, AttributeError):  # no per-thread usage (Windows, macOS)
        return os.times().user
    return time.thread_time() + os.times().user - own_user


def past_htp_budget(elapsed_s: float, ran: int, budget_s: float) -> bool:
    """Whether one more sample, at the pace of the ``ran`` so far, would end past the budget
    (never before a first sample, nor without a budget). The caller adds HTP_MIN_SAMPLES."""
    return budget_s > 0 and ran > 0 and elapsed_s + elapsed_s / ran > budget_s


HTP_PROBE_CTX = "htp_probe_ctx.onnx"  # beside htp_probe.json: the context the HTP judge ran
STANDALONE_DIR = "standalone"
# The gpu variant's folder beside the target chips' (ctx/<toolchain>/gpu/) and its manifest target.
GPU_TARGET = "gpu"


def component(value: str, what: str) -> str:
    """``value`` if it is one safe folder name, else a ConfigError naming it."""
    if unsafe_component(value):
        raise ConfigError(
            f"{what} {value!r} cannot be used as a folder name: {SAFE_COMPONENT_RULE}.",
            tip="Nothing is written outside --artifacts; rename it in the config.",
        )
    return value


def sample_name(index: int) -> str:
    return f"sample_{index:04d}.npz"


def samples_in(folder: Path) -> list[Path]:
    """The sample files of a held-out folder, in order."""
    return sorted(Path(folder).glob(SAMPLE_GLOB))


def spread(samples: list[Path], count: int = VALIDATE_SAMPLES) -> list[Path]:
    """``count`` samples evenly spaced over ``samples`` (all of them when there are fewer).

    Not the first ones: held-out samples come in file order, and the first windows of a
    stream (a file's silent start, its first frames) can be all a short prefix holds."""
    if len(samples) <= count:
        return list(samples)
    if count <= 1:
        return list(samples[:count])
    last = len(samples) - 1
    return [samples[round(i * last / (count - 1))] for i in range(count)]


# Beside a bucket's float.onnx: that model before its channels were balanced (graph.balance),
# which the whole-model fp16 candidate is built from: balancing is for integer grids, and a
# kernel scaled down by it can fall into fp16's subnormals.
UNBALANCED_FLOAT = "float_unbalanced.onnx"


@dataclass(frozen=True)
class BucketPaths:
    root: Path

    @property
    def float_model(self) -> Path:
        return self.root / "float.onnx"

    @property
    def qdq(self) -> Path:
        return self.root / "qdq.onnx"

    @property
    def heldout(self) -> Path:
        return self.root / "heldout"

    @property
    def htp_probe(self) -> Path:
        """What the quantize stage's HTP judge measured on this QDQ model (pipeline.htp.probe):
        compile reuses it for a ctx of the same bytes instead of running the simulator again."""
        return self.root / "htp_probe.json"

    @property
    def htp_probe_ctx(self) -> Path:
        """The context the judge ran (embedded, for its chip): compile adopts these very bytes
        when the QDQ, toolchain, chip and QNN options match, instead of compiling again (QNN does
        not always compile a recurrent graph to the same bytes twice)."""
        return self.root / HTP_PROBE_CTX


@dataclass(frozen=True)
class VariantPaths:
    root: Path

    @property
    def record(self) -> Path:
        return self.root / VARIANT_FILE

    @property
    def log(self) -> Path:
        return self.root / "compile.log"

    @property
    def standalone(self) -> Path:
        return self.root / STANDALONE_DIR


@dataclass(frozen=True)
class ModelPaths:
    """The build folder of one model."""

    root: Path

    @classmethod
    def of(cls, artifacts: Path, model: str) -> ModelPaths:
        return cls(Path(artifacts) / BUILD_DIR / component(model, "model.name"))

    @property
    def record(self) -> Path:
        return self.root / RECORD_FILE

    @property
    def lock(self) -> Path:
        """``build/.<model>.lock``: held by the stage building this model (core.lock)."""
        return self.root.parent / f".{self.root.name}.lock"

    @property
    def report(self) -> Path:
        return self.root / REPORT_MD

    @property
    def report_html(self) -> Path:
        return self.root / REPORT_HTML

    @property
    def ranges(self) -> Path:
        return self.root / "ranges.json"

    @property
    def heldout(self) -> Path:
        return self.root / "heldout"

    @property
    def buckets(self) -> Path:
        return self.root / "buckets"

    def bucket(self, name: str) -> BucketPaths:
        return BucketPaths(self.buckets / component(name, "bucket name"))

    @property
    def ctx(self) -> Path:
        return self.root / "ctx"

    @property
    def ctx_report(self) -> Path:
        return self.ctx / REPORT_MD

    def toolchain(self, toolchain: str) -> Path:
        """``ctx/<onnxruntime-qnn>/``: every target of one toolchain (one compile job's shard)."""
        return self.ctx / component(toolchain, "toolchain")

    def variant(self, toolchain: str, target: str) -> VariantPaths:
        return VariantPaths(
            self.ctx / component(toolchain, "toolchain") / component(target, "target")
        )


def release_dir(artifacts: Path, model: str, version: str) -> Path:
    """``<artifacts>/releases/<model>/<version>``."""
    return (
        Path(artifacts)
        / RELEASES_DIR
        / component(model, "model.name")
        / component(version, "model.version")
    )
