"""The HTP is the judge: precision choices are checked on what the NPU computes.

The CPU QDQ model is not the HTP: on detectors and segmenters the context on the HTP simulator
was 5-12 dB from the CPU QDQ model that met its target (FACTS §10), the drift starting at the
convolutions whose weights mixed precision had raised to 16 bits. So after the CPU-guided choices
(pipeline.quantize.mixed_precision), the QDQ model is compiled for the first target and run on the
HTP (``pipeline.htp.probe``), and its context-vs-float SNR decides. While it is short:

1. when the HTP loses more than ``HTP_GAP_DB`` against the CPU QDQ model, the divergence locator
   (every activation exposed) names the first tensor where they part ways; weights raised to 16
   bits go back to 8 bits per channel (the HTP reproduces those), or else the diverging tensor
   is left in float16, unless it parts from the CPU about as far as what it is computed from
   (``DRIFT_DB``: a drift passed on layer by layer, which the whole model in fp16 answers);
2. when the quantization itself is short (the HTP agrees with the CPU), the tensors that cost the
   output most *at their current precision* (16-bit activations included) go to float16, which
   the HTP runs in fp16; but where the HTP is further from the CPU QDQ model than that model is
   from float, and below the target, the whole model in fp16 runs first (tensors ranked on the
   CPU do not mend what the HTP adds), the per-tensor rounds after it only if it is short;
3. the whole model in fp16 on the HTP: straight away when the quantized model is already
   ``FLOAT16_FIRST_DB`` short of the target on the CPU (one tensor range spanning channels whose
   scales differ by 10^4, as in PP-PicoDet's first convolutions, leaves no 16-bit scale that
   serves them all), next when it is short there at all and the simulator takes
   ``SLOW_SAMPLE_S`` or more a sample, and always before the judge gives up short of it. On such
   a simulator a model short only on the HTP gets no locate either (16-bit weights still go to
   8 bits per channel first): one runs at the end, for the report, only if nothing passed.

Each candidate is compiled and measured; the best one by context-vs-float SNR is kept, and every
round is reported. Two rounds are not spent: a remedy's candidate ``CANNOT_WIN_DB`` below the
best context so far already on the CPU is not run on the HTP (a "not run" round, the CPU figure
shown), and tensors left in float16 that made the context worse end the remedies in fp16 (the
conversions around them cost this model more than they save: more of them did not help).
Without onnxruntime-qnn in this environment the CPU decision stands and the report says so.
"""

from __future__ import annotations

import math
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qnn_ctx_runtime.targets import Target, get_target

from ..core.accuracy import worst_snr
from ..core.config import ModelConfig
from ..core.fileio import atomic_path, sha256_file
from ..core.layout import (
    AGREE_MARGIN_DB,
    ENOUGH_MARGIN_DB,
    ENOUGH_SAMPLES,
    HTP_BUDGET_S,
    HTP_PROBE_CTX,
    VALIDATE_SAMPLES,
    spread,
)
from ..core.progress import Progress
from ..core.records import HtpProbeRecord, write_record
from ..htp.probe import CTX_NAME, ProbeResult, TensorAgreement, probe, qnn_available
from ..report_html import MIN_COMPARED, preload_plotting
from .evaluate import Feeds, OutputsOnDisk, cpu_accuracy, float16_conditioning, kept_outputs
from .mixed_precision import EIGHT_BIT, HOPELESS_DB, SIXTEEN_BIT, measure

HTP_GAP_DB = 3.0  # the HTP may lose this much against the CPU QDQ model before it is "diverging"
MAX_REMEDIES = 3  # re-quantize-and-probe rounds after the first probe
FLOAT16_FIRST = 4  # tensors left in float16 in the first round of that remedy (doubling after)
LOCATE_SAMPLES = 8  # a locator run exposes every activation: fewer samples, one child
# A quantized model HOPELESS_DB below the target on the CPU (after mixed precision) goes straight
# to fp16: raising single tensors has not closed such gaps on any model measured (PP-PicoDet: 1 dB).
# So does one FLOAT16_FIRST_DB below it: the HTP has come out at most 3.5 dB above the CPU QDQ
# model (a PP-OCR recogniser: 25.4 on the CPU, 28.8 on the HTP; at most 2.2 in 29 remedy rounds),
# so its round could not pass, and on a slow simulator it cost minutes (a PP-OCRv5 text detector
# at 960x960: 79 s before the fp16 round that passed). Should fp16 fall short, it runs after all.
FLOAT16_FIRST_DB = 5.0
# A context at the target by less than this gets one raise of 16-bit tensors where the HTP agrees
# with the CPU (``raised_where_agreeing``), then, still short of it, the whole model in fp16: its
# figure on other inputs falls either side of the target (a segmenter at 25.6 dB on the HTP, a
# person parser at 26.0 with 4 tensors in fp16; 25 the target). Each is kept only if better.
HEADROOM_DB = 1.0
# A remedy that moved the context by less than this changed nothing that matters: the locator
# (whose exposed outputs change what the HTP fuses) did not find the cause, so the next round is
# the whole model in fp16 instead of another locate (PP-OCRv4's detector: 3 rounds at 17.4 dB).
STALLED_DB = 0.5
# A simulator this slow (CPU seconds a sample, layout.simulator_seconds: the machine's load
# does not move it, so the same build takes the same rounds) makes each per-tensor round a minute or
# more: with the quantized model short of the target on the CPU already, the whole model in fp16
# is the next round (a 800x608 layout detector, 10.6 s a sample quantized and 65 s in fp16: 5
# rounds, 9.5 minutes, before the fp16 candidate that passed). A model short only on the HTP
# still gets the per-tensor remedies (16-bit weights back to 8 bits fixed the drift measured).
SLOW_SAMPLE_S = 8.0
# A remedy's candidate is first run on the CPU, on the same samples: the HTP has come out at most
# 2.2 dB above the CPU QDQ model (29 rounds on real models), so a candidate this far below the
# best context so far cannot win, and its simulator run is skipped (gtcrn's 8-bit weights: 10.0
# dB on the CPU against 24.8 on the HTP, 7 s of simulator). ``NOT_RUN`` rounds say so.
CANNOT_WIN_DB = HTP_GAP_DB
# The first diverging tensor within this of what it is computed from: the HTP drifts from the
# CPU layer by layer (a PP-LCNet text recognizer: 28.8, 23.4, 21.5, 22.4, ... 19.7 dB along its
# blocks), no op of it is computed wrongly, and that tensor left in fp16 moved the context by
# under 0.5 dB on every such model (a layout detector, a text detector, 3 recognizers): the next
# round is the whole model in fp16. An op the HTP computes wrongly drops far more than this
# below its inputs (16-bit dilated weights: exact inputs, 20-30 dB out).
DRIFT_DB = 6.0
NOT_RUN = "not run"
HTP_PROBE_FAILED = "the HTP probe failed"  # a judgement's reason when no candidate ran there
# A remedy's round stops starting samples once ENOUGH_SAMPLES have run this far below the best
# context so far, pooled: it cannot be kept (a whisper front end's Log left in fp16: -1.5 dB
# against 2.2 on 12 samples, 68 s of simulator).
LOSING_MARGIN_DB = 3.0


WHOLE_FLOAT16 = "whole model in fp16"  # the candidate's label


@dataclass(frozen=True)
class JudgeRound:
    """One candidate, compiled and run on the HTP."""

    label: str
    ctx_vs_float_db: float | None
    ctx_vs_qdq_db: float | None
    qdq_vs_float_db: float | None
    partitions: int
    cpu_nodes: int
    seconds: float
    error: str = ""
    samples: int = 0  # held-out samples it ran on
    requested: int = 0  # asked for: more when the simulator's time budget ran out first
    seconds_per_sample: float = 0.0  # the simulator's pace, one process
    cut_by: str = ""  # why fewer ran: "budget" or "evidence" (pipeline.htp.probe.ProbeResult)


@dataclass(frozen=True)
class Divergence:
    """The first tensor (graph order) where the HTP and the CPU QDQ model part ways."""

    tensor: str
    op_type: str
    node: str
    snr_db: float
    exposed: int = 0  # activations compared: all ``exposable`` ones unless a large model's
    exposable: int = 0  # would not fit the locator's memory budget (probe.EXPOSED_BYTES)


@dataclass(frozen=True)
class HtpJudgement:
    """How the precision was decided: on the HTP (with its rounds) or, failing that, the CPU."""

    judge: str  # "htp" | "cpu"
    reason: str
    target: str = ""
    qnn_sdk: str = ""
    rounds: list[JudgeRound] = field(default_factory=list)
    divergence: Divergence | None = None
    remedies: list[str] = field(default_factory=list)
    chosen: str = ""  # the label of the round that was kept
    ctx_vs_float_db: float | None = None
    float16: list[str] = field(default_factory=list)  # tensors left unquantized (fp16 on the HTP)
    whole_float16: bool = False


@dataclass
class Candidate:
    """Precision choices for every bucket: per-tensor overrides, or the whole model in fp16."""

    label: str
    overrides: dict[str, str]
    whole_float16: bool = False


class Builder:
    """What the judge needs from the quantize stage: rebuild the probe bucket's QDQ model, and
    (``raise_to``) raise 8-bit tensors to 16 bits until the CPU QDQ model reaches a figure."""

    def __init__(
        self,
        requantize: Callable[[dict[str, str]], object],
        use_float: Callable[[], object],
        raise_to: Callable[[float, dict[str, str]], dict[str, str] | None] | None = None,
    ) -> None:
        self.requantize = requantize
        self.use_float = use_float
        # (CPU figure to reach, overrides to start from) -> the overrides it chose, left on
        # disk (None: nothing raised, the model on disk as it was)
        self.raise_to = raise_to
        self.built: Candidate | None = None  # the candidate on disk (None: the one judged first)

    def build(self, candidate: Candidate) -> None:
        if candidate is self.built:
            return  # on disk already (a raise leaves its best variant there)
        self.built = candidate
        if candidate.whole_float16:
            self.use_float()
        else:
            self.requantize(candidate.overrides)

    def raised(self, goal_db: float, base: Candidate) -> Candidate | None:
        """``base`` with more tensors at 16 bits, the CPU QDQ model at ``goal_db`` (plus the
        mixed-precision search's own margin) if the search gets there; built on disk."""
        if self.raise_to is None or base.whole_float16:
            return None
        chosen = self.raise_to(goal_db, dict(base.overrides))
        self.built = base  # nothing raised: the search leaves base's quantization on disk
        if not chosen or chosen == base.overrides:
            return None
        more = len(chosen) - len(base.overrides)
        candidate = Candidate(f"{more} more tensor(s) at 16 bits", chosen)
        self.built = candidate
        return candidate


def _round(label: str, result: ProbeResult) -> JudgeRound:
    def db(value: float) -> float | None:
        return None if np.isnan(value) else float(value)

    if result.status == NOT_RUN:
        cpu = db(worst_snr(result.qdq_vs_float))
        return JudgeRound(label, None, None, cpu, 0, 0, result.seconds, result.error)
    if not result.ok:
        return JudgeRound(label, None, None, None, 0, 0, result.seconds, result.error[:500])
    return JudgeRound(
        label,
        db(result.worst_ctx_vs_float),
        db(result.worst_ctx_vs_qdq),
        db(worst_snr(result.qdq_vs_float)),
        result.partitions,
        result.cpu_nodes,
        result.seconds,
        samples=result.samples,
        requested=result.requested,
        seconds_per_sample=result.seconds_per_sample,
        cut_by=result.cut_by,
    )


def _sixteen_bit_weights_at_8(candidate: Candidate) -> Candidate | None:
    """``candidate`` with its int16 weights back at 8 bits (its 16-bit activations kept), or
    None when it has none. Why: QNN refuses some ops with an int16 weight (an
    InstanceNormalization's scale: ``mixed_precision.EIGHT_BIT_ONLY_WEIGHTS``), and one such
    weight fails the whole quantized model; tried before the whole model in fp16, which the
    device runs slower, when a quantized model fails on the HTP."""
    if candidate.whole_float16:
        return None
    kept = {n: t for n, t in candidate.overrides.items() if not t.startswith("int16")}
    dropped = len(candidate.overrides) - len(kept)
    if not dropped:
        return None
    return Candidate(f"its {dropped} 16-bit weight(s) at 8 bits", kept)


# The QNN EP's words for an op it rewrote to NHWC and then refused in its quantized form (an LRN
# feeding a Conv with 16-bit activations; an InstanceNormalization's int16 scale)
_REFUSED_AFTER_NHWC = re.compile(
    r"OpType:(\w+) with domain:com\.ms\.internal\.nhwc was inserted using the NHWC format"
)


def _refused_op_at_8(
    candidate: Candidate, error: str, float_path: Path, activation_type: str
) -> Candidate | None:
    """``candidate`` with the outputs of the op type the QNN EP refused (``error``) at 8 bits,
    or None when the error names none, the model has no such node with a 16-bit output, or the
    activations are 8-bit already. Why: QNN takes some ops in some places with 8-bit
    activations only (an LRN that feeds a Conv; one feeding a MaxPool it takes at 16 bits): a
    CaffeNet-like model at uint16 fell back to fp16 whole, with its LRNs' outputs at 8 bits it
    reads 31.3 dB on the HTP. One such node sank the whole quantized model."""
    found = _REFUSED_AFTER_NHWC.search(error or "")
    eight = EIGHT_BIT_OF.get(activation_type)
    if found is None or eight is None or candidate.whole_float16:
        return None
    import onnx

    op_type = found.group(1)
    model = onnx.load(str(float_path), load_external_data=False)
    outputs = [
        o
        for n in model.graph.node
        if n.op_type == op_type
        for o in n.output
        if o and candidate.overrides.get(o) != eight
    ]
    if not outputs:
        return None
    return Candidate(
        f"the outputs of its {op_type} node(s) at 8 bits",
        {**candidate.overrides, **dict.fromkeys(outputs, eight)},
    )


EIGHT_BIT_OF = {"uint16": "uint8", "int16": "int8"}  # an activation type's 8-bit form
REFUSED_OP_RETRIES = 3  # op types refused in turn, each named by the QNN EP's error


def _score(result: ProbeResult) -> float:
    """What the NPU delivers (whole on it: a partition count above 1 or CPU nodes disqualify)."""
    if not result.ok or result.partitions != 1 or result.cpu_nodes:
        return float("-inf")
    return result.worst_ctx_vs_float


def _conditioning(float_path: Path, samples: list[Path], target_db: float) -> str:
    """The report's line on whether the float model itself amplifies fp16-sized changes of its
    inputs past the target (``evaluate.float16_conditioning``): then no precision meets it."""
    worst = worst_snr(float16_conditioning(float_path, samples))
    if worst < target_db:
        return (
            f"the float model itself: fp16's rounding of its inputs alone (2^-11 of each value) "
            f"moves its outputs to {worst:.1f} dB on the CPU in float32, under the target, which "
            "no precision on the NPU can then meet on these inputs (a model fed inputs unlike "
            "those its normalizations were fitted to is so: check the config's scale, mean and "
            "std against the model's training)"
        )
    return (
        f"not the float model's own conditioning: fp16's rounding of its inputs moves its "
        f"outputs to {worst:.1f} dB only (CPU, float32)"
    )


def judge_on_htp(
    config: ModelConfig,
    float_path: Path,
    qdq_path: Path,
    heldout: list[Path],
    calibration: Iterable[dict[str, np.ndarray]],
    overrides: dict[str, str],
    builder: Builder,
    scratch: Path,
    probe_record: Path | None = None,
    cpu_snr_db: float | None = None,
    decide: bool = True,
    on_short: Callable[[], None] | None = None,
    diagnose_below_db: float = float("-inf"),
    recurrent_steps: int = 0,
) -> tuple[HtpJudgement, Candidate]:
    """Check the current QDQ model on the HTP and improve it while it is short of the target.

    Returns the judgement and the candidate that was kept (already built on disk when it is
    not the last one tried: the caller rebuilds every bucket with it). Every candidate runs on
    the validation samples, so the kept one's figures go to ``probe_record`` for the compile
    stage to reuse (``HtpProbeRecord``). ``cpu_snr_db``, the QDQ model's worst SNR on the CPU:
    ``FLOAT16_FIRST_DB`` or more short of the target, the whole model in fp16 is tried first, and
    the quantized model only runs on the HTP when fp16 does not reach the target either.
    ``decide = False`` (a pre-quantized model keeping its own quantization): one run, measured
    and reported, no remedy. ``on_short`` is called once, before any remedy, when the first
    round is short of the target: it may raise to rebuild on another preparation.
    ``diagnose_below_db``: with nothing to decide, a context below it is located all the same
    (the report names where the HTP parts from the CPU). ``recurrent_steps``: the LSTM/GRU
    cells QNN builds, which lengthen each round's time limit (``CompileSection.timeout_for``)."""
    q = config.quantization
    current = Candidate("as quantized" if decide else "its own quantization", dict(overrides))
    initial = current  # on disk until the builder builds another
    if probe_record is not None:
        probe_record.unlink(missing_ok=True)
        probe_record.with_name(HTP_PROBE_CTX).unlink(missing_ok=True)
    why_not = "quantization.judge = 'cpu'" if q.judge == "cpu" else qnn_available()
    if why_not:
        return HtpJudgement("cpu", f"judged on the CPU: {why_not}"), current
    if not heldout:
        return HtpJudgement("cpu", "judged on the CPU: no held-out samples to run"), current
    chip = get_target(config.compile.targets[0])
    timeout_s = config.compile.timeout_for(recurrent_steps)
    qnn_options = config.compile.qnn_options_for(recurrent_steps)  # compile's own, to adopt
    # Every candidate runs on the samples compile validates on, so compile can reuse the run of
    # the one kept (its digests proven) instead of running the simulator again; the locator
    # only needs to find a tensor.
    samples = spread(heldout, VALIDATE_SAMPLES)
    locate_samples = spread(heldout, LOCATE_SAMPLES)
    target_db = q.target_snr_db if decide else float("-inf")
    # Enough samples once ENOUGH_SAMPLES are ENOUGH_MARGIN_DB above the target pooled, each at
    # the target at least: from the float outputs this process kept when it compared QDQ and
    # float (none: every sample runs).
    enough_db = target_db + ENOUGH_MARGIN_DB if decide else 0.0
    work = Path(tempfile.mkdtemp(prefix=".htp-judge-", dir=scratch))
    references: Sequence[Feeds] | None = kept_outputs(float_path, samples) if decide else None
    if decide and references is None:  # too large to keep in memory: on disk, as they run
        references = OutputsOnDisk(float_path, samples, work / "float_outputs")
    rounds: list[JudgeRound] = []
    ctx_of: dict[int, Path] = {}  # each probe's context file, by id of its result
    remedies: list[str] = []
    divergence: Divergence | None = None
    progress = Progress(MAX_REMEDIES + 3, f"HTP judge ({chip.name})", "round")
    try:

        def cannot_win(label: str) -> ProbeResult | None:
            """A ``NOT_RUN`` result when the QDQ model on disk is ``CANNOT_WIN_DB`` below the
            best context so far on the CPU already (None: it may win, run it). On as many
            samples as that context ran (a large model's simulator budget may have allowed a
            few: its CPU runs of all 16 would cost more than they save), spread likewise."""
            bar = _score(best_result) - CANNOT_WIN_DB
            if not np.isfinite(bar):
                return None
            progress.status(f"round {len(rounds) + 1}: {label}: on the CPU first")
            started = time.perf_counter()
            count = max(best_result.samples, ENOUGH_SAMPLES)
            on_cpu = cpu_accuracy(float_path, qdq_path, spread(samples, count))
            figure = worst_snr(on_cpu)
            if not figure < bar:
                return None
            outcome = ProbeResult(
                status=NOT_RUN,
                qdq_vs_float=on_cpu,
                seconds=time.perf_counter() - started,
                error=f"not run on the HTP: {figure:.1f} dB on the CPU, {CANNOT_WIN_DB:g} dB or "
                f"more below the best context so far ({_score(best_result):.1f} dB)",
            )
            rounds.append(_round(label, outcome))
            progress.update(1)
            return outcome

        def run(
            label: str,
            locate: bool = False,
            on: list[Path] | None = None,
            agree: bool = False,
            losing: bool = False,
        ) -> ProbeResult:
            """``agree``: the QDQ model on disk is the one ``cpu_snr_db`` measured; at the
            target with the margin there, two samples suffice if the HTP agrees with it.
            ``losing``: a candidate that can only be kept by beating the best so far stops
            once ``ENOUGH_SAMPLES`` are ``LOSING_MARGIN_DB`` below that, pooled."""
            bar = _score(best_result) - LOSING_MARGIN_DB if losing else float("-inf")
            shown = label + (" (locate)" if locate else "")
            agree_db = 0.0
            # the CPU QDQ model's outputs, where this process kept them: the probe compares
            # with them instead of running that model again, and they decide agreement
            on_cpu = kept_outputs(qdq_path, samples) if on is None else None
            measured = cpu_snr_db if agree and decide and on is None else None
            if measured is not None and measured >= target_db + ENOUGH_MARGIN_DB:
                agree_db = measured + AGREE_MARGIN_DB
            progress.status(f"round {len(rounds) + 1}: {shown}: compile and run on the HTP")
            if len(rounds) + 1 >= MIN_COMPARED:  # report.html plots the rounds: import now
                preload_plotting()
            folder = work / f"p{len(rounds)}"
            result = probe(
                qdq_path,
                float_path,
                samples if on is None else on,
                folder,
                chip.soc_model,
                chip.htp_arch,
                qnn_options=qnn_options,
                locate=locate,
                timeout_s=timeout_s,
                budget_s=HTP_BUDGET_S,
                references=references if on is None else None,
                enough_db=enough_db,
                enough_floor_db=target_db if decide else 0.0,
                qdq_references=on_cpu,
                agree_db=agree_db,
                losing_db=bar if np.isfinite(bar) else None,
                on_progress=lambda text, seconds: progress.status(
                    f"round {len(rounds) + 1}: {shown}: {text}", seconds
                ),
            )
            rounds.append(_round(shown, result))
            ctx_of[id(result)] = folder / CTX_NAME
            progress.update(1)
            db = "failed" if not result.ok else f"{result.worst_ctx_vs_float:.1f} dB vs float"
            if result.ok and (result.partitions != 1 or result.cpu_nodes):
                # compile's coverage gate will refuse it: said now, not minutes later
                db += f", {result.partitions} QNN partitions and {result.cpu_nodes} CPU nodes"
            progress.status(f"round {len(rounds)}: {shown}: {db}")
            return result

        def locate() -> tuple[ProbeResult, TensorAgreement | None]:
            """Run the locator on the QDQ model on disk; its first diverging tensor (None when
            it found none), also the report's ``divergence`` if that is still unnamed."""
            nonlocal divergence
            located = run("the HTP diverges", locate=True, on=locate_samples)
            found = located.first_divergence() if located.ok else None
            if found is not None and divergence is None:
                divergence = Divergence(
                    found.name,
                    found.op_type,
                    found.node,
                    found.snr_db,
                    len(located.tensors),
                    located.exposable,
                )
            return located, found

        tried_float16 = False

        def whole_float16(why: str) -> Candidate:
            nonlocal tried_float16
            if tried_float16:  # it ran already (ahead of the per-tensor rounds): they end here
                remedies.append(f"the rounds end (the whole model in fp16 ran already): {why}")
            else:
                remedies.append(f"the whole model in fp16 on the HTP (no quantization): {why}")
            tried_float16 = True
            return Candidate(WHOLE_FLOAT16, {}, whole_float16=True)

        # (candidate, its run, the QDQ digest it ran): fp16 first for a hopeless quantization
        early: tuple[Candidate, ProbeResult, str] | None = None
        if cpu_snr_db is not None and target_db - cpu_snr_db > FLOAT16_FIRST_DB:
            fp16 = whole_float16(
                f"the quantized model is {target_db - cpu_snr_db:.0f} dB short on the CPU"
            )
            builder.build(fp16)
            early = (fp16, run(fp16.label), sha256_file(qdq_path))
        if early is not None and _score(early[1]) >= target_db:
            current, first, first_sha = early  # fp16 is enough: the quantized model never runs
        else:
            if early is not None:
                builder.build(current)  # back to the quantized model, judged as usual
            first = run(current.label, agree=early is None)
            first_sha = sha256_file(qdq_path)
            if not first.ok and early is not None and early[1].ok:
                current, first, first_sha = early  # fp16 ran where the quantized model did not
                builder.build(current)
            elif not first.ok and early is None and decide:  # QNN refused or crashed on it
                quantized = current
                failed = first.error.splitlines()[0][:160] if first.error else "no message"
                # an int16 weight QNN refuses sinks the whole model; a compile that ran out of
                # time would only run out again
                timed_out = first.error.startswith("timed out")
                # then the op types the QNN EP names as refused, each one's outputs at 8 bits
                # (on top of what failed before it), before the whole model in fp16
                activations = config.quantization.activation_type
                weights = None if timed_out else _sixteen_bit_weights_at_8(current)
                retry = weights or (
                    None
                    if timed_out
                    else _refused_op_at_8(current, first.error, float_path, activations)
                )
                runs_left = REFUSED_OP_RETRIES + (weights is not None)
                built_retry = False
                while retry is not None and runs_left > 0:
                    runs_left -= 1
                    built_retry = True
                    remedies.append(
                        f"{retry.label}: the quantized model failed on the HTP ({failed})"
                    )
                    builder.build(retry)
                    retried = run(retry.label)
                    if retried.ok:
                        current, first, first_sha = retry, retried, sha256_file(qdq_path)
                        break
                    if retried.error.startswith("timed out"):
                        break
                    failed = (retried.error.splitlines() or ["no message"])[0][:160]
                    retry = _refused_op_at_8(retry, retried.error, float_path, activations)
                if not first.ok and built_retry:  # the QDQ on disk is a failed retry's
                    builder.build(quantized)
            if not first.ok and early is None and decide:
                fp16 = whole_float16(
                    f"the quantized model failed on the HTP ({first.error.splitlines()[0][:160]})"
                    if first.error
                    else "the quantized model failed on the HTP"
                )
                builder.build(fp16)
                early = (fp16, run(fp16.label), sha256_file(qdq_path))
                if early[1].ok:
                    current, first, first_sha = early
                else:
                    builder.build(quantized)  # neither ran: the CPU's judgement, as before
                    current = quantized
        if not first.ok:
            return (
                HtpJudgement(
                    "cpu",
                    f"judged on the CPU: {HTP_PROBE_FAILED} ({first.error[:300]})",
                    chip.name,
                    rounds=rounds,
                ),
                current,
            )
        best, best_result, best_sha = current, first, first_sha
        if early is not None and _score(early[1]) > _score(first):
            best, best_result, best_sha = early
        if on_short is not None and decide and _score(best_result) < target_db:
            on_short()
        result = first
        float16: list[str] = []
        ranked: list[str] | None = None
        per_channel_done = False
        raised_done = False  # one raise of the CPU QDQ model's precision at most
        weights = channel_weights(float_path)

        # The whole model in fp16, run ahead of the per-tensor rounds and short of the target:
        # a later remedy that picks it takes this figure instead of running it twice.
        early_float16: ProbeResult | None = None

        def attempt(candidate: Candidate) -> ProbeResult:
            nonlocal best, best_result, best_sha, current, early_float16
            builder.build(candidate)
            if candidate.whole_float16 and early_float16 is not None:
                current, outcome, early_float16 = candidate, early_float16, None
                return outcome
            outcome = None if candidate.whole_float16 else cannot_win(candidate.label)
            outcome = outcome or run(candidate.label, losing=True)
            current = candidate
            if _score(outcome) > _score(best_result):
                best, best_result, best_sha = candidate, outcome, sha256_file(qdq_path)
            return outcome

        def raised_where_agreeing(result: ProbeResult) -> Candidate | None:
            """More 16-bit tensors (``Builder.raised``) where the HTP agrees with the CPU QDQ
            model well above the target: what the context lacks is then the quantization's own
            noise, which they lower on the CPU and the HTP alike (an SCRFD face detector at
            25.9 dB on the CPU, 24.9 on the HTP, 36.0 between them: one weight at 16 bits took
            them to 33.2 and 31.7; its 4 costliest activations in fp16 instead, to 25.05). The
            CPU is aimed at the target plus what the HTP lost against it plus ``HEADROOM_DB``
            (and mixed precision's own margin above that)."""
            nonlocal raised_done
            cpu_db, htp_own = worst_snr(result.qdq_vs_float), result.worst_ctx_vs_qdq
            if not decide or current.whole_float16 or not result.ok:
                return None
            if not (htp_own >= target_db + HTP_GAP_DB and cpu_db < htp_own):
                return None
            raised_done = True
            loss = max(0.0, cpu_db - result.worst_ctx_vs_float)
            progress.status(f"round {len(rounds) + 1}: more tensors at 16 bits on the CPU first")
            goal = math.ceil((target_db + loss + HEADROOM_DB) * 10) / 10  # shown in its progress
            candidate = builder.raised(goal, current)
            if candidate is not None:
                remedies.append(
                    f"{candidate.label} until the CPU QDQ model is {loss:.1f} dB (what the HTP "
                    f"lost to it) and {HEADROOM_DB:g} dB above the target: the HTP agrees with it "
                    f"({htp_own:.1f} dB between them), so what the context lacks is the "
                    f"quantization's ({cpu_db:.1f} dB on the CPU, {result.worst_ctx_vs_float:.1f} "
                    "on the HTP)"
                )
            return candidate

        previous_db = result.worst_ctx_vs_float
        last_float16 = False  # the last remedy left more tensors in float16
        unlocated: Candidate | None = None  # short on the HTP, not located: the simulator's pace
        for step in range(MAX_REMEDIES):
            if tried_float16 and early_float16 is None:
                break
            if result.status == NOT_RUN:  # (no context figure: its worst is +inf)
                result = attempt(whole_float16(f"{current.label}: {result.error}"))
                continue
            if result.worst_ctx_vs_float >= target_db:
                if result.worst_ctx_vs_float < target_db + HEADROOM_DB:
                    # At the target by a hair: other inputs fall either side of it. Where the
                    # HTP agrees with the CPU, more 16-bit tensors buy headroom; failing that,
                    # the whole model in fp16 (each kept only if better).
                    candidate = None if raised_done else raised_where_agreeing(result)
                    if candidate is not None:
                        result = attempt(candidate)
                    if _score(best_result) < target_db + HEADROOM_DB and not tried_float16:
                        attempt(
                            whole_float16(
                                f"the best context is {_score(best_result):.2f} dB, under "
                                f"{HEADROOM_DB:g} dB above the target: other inputs would fall "
                                "either side of it"
                            )
                        )
                break
            short_on_cpu = target_db - worst_snr(result.qdq_vs_float)
            if step and abs(result.worst_ctx_vs_float - previous_db) < STALLED_DB:
                result = attempt(
                    whole_float16(f"the last remedy moved the context by under {STALLED_DB:g} dB")
                )
                continue
            if step and last_float16 and result.worst_ctx_vs_float < previous_db - STALLED_DB:
                # Tensors left in float16 made the context worse while the CPU gained: the HTP's
                # conversions around them cost more than they save, and more of them will not
                # help (4 such models: the next rounds, 8-bit weights or more tensors in fp16,
                # never came back; each ended whole in fp16).
                result = attempt(
                    whole_float16(
                        f"tensors left in float16 took the context from {previous_db:.1f} to "
                        f"{result.worst_ctx_vs_float:.1f} dB"
                    )
                )
                continue
            previous_db = result.worst_ctx_vs_float
            if short_on_cpu > HOPELESS_DB:
                # Mixed precision already raised what the CPU said mattered and the quantized
                # model is still far off: per-tensor remedies will not close that gap.
                result = attempt(
                    whole_float16(f"the quantized model is {short_on_cpu:.0f} dB short on the CPU")
                )
                continue
            if short_on_cpu > 0 and result.seconds_per_sample >= SLOW_SAMPLE_S:
                result = attempt(
                    whole_float16(
                        f"the quantized model is {short_on_cpu:.1f} dB short on the CPU and the "
                        f"simulator takes {result.seconds_per_sample:.0f} s a sample: a "
                        "per-tensor round would cost minutes"
                    )
                )
                continue
            candidate: Candidate | None = None
            gap = worst_snr(result.qdq_vs_float) - result.worst_ctx_vs_float
            if gap > HTP_GAP_DB:
                sixteen = int16_weights_left(
                    qdq_path, [n for n, p in current.overrides.items() if p.startswith("int16")]
                )
                lower = bool(sixteen) and not per_channel_done
                found, located = None, None
                if result.seconds_per_sample < SLOW_SAMPLE_S:
                    located, found = locate()
                elif unlocated is None:
                    unlocated = current  # located at the end if nothing passes
                if lower:
                    # Every weight to 8 bits with one scale per output channel: the format the
                    # HTP reproduces (55-80 dB against the CPU), and the finest 8-bit one.
                    per_channel_done = True
                    remedies.append(
                        f"{len(sixteen)} weight(s) raised to int16 and every other weight to int8 "
                        "per channel: the HTP computes 16-bit weights differently from the CPU"
                    )
                    candidate = Candidate(
                        "weights int8 per channel",
                        {
                            **{n: p for n, p in current.overrides.items() if n not in sixteen},
                            **dict.fromkeys(weights, "int8_per_channel"),
                        },
                    )
                elif located is None:
                    # On a simulator this slow a locate (every activation exposed) and a round
                    # per tensor take minutes each, and on the slow models hunted the locate never
                    # decided the remedy: 16-bit weights went to 8 bits (CenterFace, Mask2Former)
                    # or the whole model in fp16 was kept after it (a text detector's Sigmoid in
                    # fp16 changed nothing; a layout detector drifted).
                    candidate = whole_float16(
                        f"the HTP is {gap:.1f} dB below the CPU QDQ model and the simulator "
                        f"takes {result.seconds_per_sample:.0f} s a sample: a locate and a "
                        "round per tensor would take minutes each"
                    )
                elif found is not None and drifts(located, found):
                    candidate = whole_float16(
                        f"the HTP parts from the CPU QDQ model layer by layer: {found.name} "
                        f"({found.op_type}) at {found.snr_db:.1f} dB is computed from tensors "
                        f"at {located.sources_db(found):.1f} dB, and no tensor left in fp16 "
                        "stops a drift"
                    )
                elif found is not None and (
                    tensor := float_tensor_of(qdq_path, float_path, found.name)
                ):
                    float16.append(tensor)
                    remedies.append(f"{tensor} ({found.op_type}) left in float16 on the HTP")
                    candidate = Candidate(
                        f"{tensor} in float16", {**current.overrides, tensor: "float16"}
                    )
            htp_own = result.worst_ctx_vs_qdq
            if (
                candidate is None
                and not tried_float16
                and htp_own < min(target_db, worst_snr(result.qdq_vs_float))
            ):
                # The HTP is further from the CPU QDQ model than that model is from float, and
                # below the target: what the context lacks is mostly the HTP's, which tensors
                # ranked by their cost on the CPU rarely mend (gtcrn: 23.7 dB from the CPU, 26.9
                # from float there; its 4 costliest tensors in fp16 took the context 24.8 ->
                # 21.9; a PP-OCRv2 recogniser 23.6 -> 22.8), so the whole model in fp16 runs
                # first. Where fp16 falls short of the target (it is below 16-bit quantization
                # at very high targets), the per-tensor round still follows, from the quantized
                # candidate, and fp16 is not run again at the end.
                quantized = current
                ahead = attempt(
                    whole_float16(
                        f"the HTP is {htp_own:.1f} dB from the CPU QDQ model, further than that "
                        f"model is from float ({worst_snr(result.qdq_vs_float):.1f} dB) and below "
                        "the target: tensors ranked on the CPU seldom mend what the HTP adds"
                    )
                )
                if _score(ahead) >= target_db:
                    break
                early_float16, current = ahead, quantized
                builder.build(current)
            if candidate is None and not raised_done:
                candidate = raised_where_agreeing(result)
            if candidate is None:
                if ranked is None:
                    found_all, signal, _, _ = measure(
                        float_path,
                        qdq_path,
                        calibration,
                        {**EIGHT_BIT, **SIXTEEN_BIT},
                        kinds=("activation",),
                    )
                    goal = {o: max(signal[o], 1e-30) for o in signal}
                    ranked = [
                        c.name
                        for c in sorted(
                            (c for c in found_all if c.kind == "activation" and c.noise),
                            key=lambda c: max(c.noise.get(o, 0.0) / goal[o] for o in goal),
                            reverse=True,
                        )
                    ]
                count = FLOAT16_FIRST * 2**step
                chosen = [t for t in ranked[:count] if t not in float16]
                if step == MAX_REMEDIES - 1 or not chosen:
                    candidate = whole_float16("the last remedy")
                else:
                    float16 += chosen
                    remedies.append(
                        f"{len(chosen)} tensor(s) that cost the output most at 16 bits left in "
                        f"float16: {', '.join(chosen[:6])}" + (" …" if len(chosen) > 6 else "")
                    )
                    candidate = Candidate(
                        f"{len(float16)} tensors in float16",
                        {**current.overrides, **dict.fromkeys(float16, "float16")},
                    )
            last_float16 = not candidate.whole_float16 and any(
                p == "float16" and current.overrides.get(t) != "float16"
                for t, p in candidate.overrides.items()
            )
            result = attempt(candidate)
        if not tried_float16 and _score(best_result) < target_db:
            result = attempt(whole_float16("every other remedy left it short of the target"))
        if not decide and _score(best_result) < diagnose_below_db:
            # Nothing to decide for a model kept as it is, but one the HTP computes this far
            # from itself gets its diagnosis: where the two part ways (an A16W8 PP-PicoDet by
            # AMD Quark: from 61.2 dB into its first depthwise Conv to 7.9 out of it).
            locate()
        if unlocated is not None and divergence is None and _score(best_result) < target_db:
            # Nothing passed: the report names where the HTP parts from the CPU after all.
            builder.build(unlocated)
            locate()
        if decide and _score(best_result) < target_db:  # nothing passed: is the model itself?
            remedies.append(_conditioning(float_path, samples, target_db))
        if (builder.built or initial) is not best:
            builder.build(best)  # leave the kept candidate on disk
        if probe_record is not None:
            _write_probe_record(
                probe_record,
                qdq_path,
                best_sha,
                best_result,
                chip,
                ctx_of[id(best_result)],
                qnn_options,
            )
        where = f"the HTP simulator for {chip.name} (soc {chip.soc_model}, HTP v{chip.htp_arch})"
        return (
            HtpJudgement(
                "htp",
                f"judged on {where}"
                if decide
                else f"the model's own quantization is kept (nothing to decide), measured on {where}",
                chip.name,
                first.qnn_sdk,
                rounds,
                divergence,
                remedies,
                best.label,
                _db_or_none(best_result.worst_ctx_vs_float),
                [t for t, p in best.overrides.items() if p == "float16"],
                best.whole_float16,
            ),
            best,
        )
    finally:
        progress.close()
        shutil.rmtree(work, ignore_errors=True)


def _write_probe_record(
    path: Path,
    qdq_path: Path,
    qdq_sha: str,
    result: ProbeResult,
    chip: Target,
    ctx: Path,
    qnn_options: dict[str, str],
) -> None:
    """The kept candidate's figures, for compile to reuse, if the QDQ on disk is still the one
    probed (re-quantizing the same choices is deterministic, but only the digest proves it)."""
    if not result.ok or not result.ctx_sha256 or sha256_file(qdq_path) != qdq_sha:
        return
    kept = path.with_name(HTP_PROBE_CTX)
    if ctx.is_file() and sha256_file(ctx) == result.ctx_sha256:
        with atomic_path(kept) as tmp:
            shutil.copyfile(ctx, tmp)
    else:
        kept.unlink(missing_ok=True)
    record = HtpProbeRecord(
        qdq_sha256=qdq_sha,
        ctx_sha256=result.ctx_sha256,
        onnxruntime_qnn=result.onnxruntime_qnn,
        qnn_sdk=result.qnn_sdk,
        soc_model=chip.soc_model,
        htp_arch=chip.htp_arch,
        qnn_options=dict(qnn_options),
        sample_sha256=list(result.sample_sha256),
        requested=result.requested,
        cut_by=result.cut_by,
        partitions=result.partitions,
        cpu_nodes=result.cpu_nodes,
        ctx_vs_qdq=result.ctx_vs_qdq,
        ctx_vs_float=result.ctx_vs_float,
        qdq_vs_float=result.qdq_vs_float,
        compile_s=result.compile_s or None,
        load=result.load,
    )
    write_record(path, record)


def drifts(located: ProbeResult, found: TensorAgreement) -> bool:
    """Whether the first diverging tensor parts from the CPU QDQ model within ``DRIFT_DB`` of
    what it is computed from: a drift passed on layer by layer, not an op the HTP computes
    otherwise (which the tensor in fp16 would mend)."""
    sources = located.sources_db(found)
    return sources is not None and sources < found.snr_db + DRIFT_DB


def int16_weights_left(qdq_path: Path, names: list[str]) -> list[str]:
    """Those of ``names`` (weights raised to int16) that reach the HTP as int16: not split into
    two int8 layers (pipeline.graph.qdq_htp.split_sixteen_bit_weights), whose result the
    judge's 8-bit remedy cannot improve on. A weight under another name than onnxruntime's
    ``<name>_quantized`` counts as left."""
    import onnx

    qdq = onnx.load(str(qdq_path), load_external_data=False)
    types = {i.name: i.data_type for i in qdq.graph.initializer}
    return [
        n
        for n in names
        if types.get(f"{n}_quantized", onnx.TensorProto.INT16) == onnx.TensorProto.INT16
    ]


def float_tensor_of(qdq_path: Path, float_path: Path, name: str) -> str | None:
    """The prepared float model's tensor that a QDQ model's ``name`` stands for, the one a
    precision override can name: up through requantizations (a DQ of a Q of a tensor: the
    quantizer's own DQ output, a SiLU's requantized copy) to their source, else down to the
    first tensor read from it that the float model has (two int8 halves of an int16-weight
    layer: their sum). None when neither way finds one."""
    import onnx

    float_model = onnx.load(str(float_path), load_external_data=False)
    known = {o for n in float_model.graph.node for o in n.output}
    known |= {i.name for i in float_model.graph.input}
    qdq = onnx.load(str(qdq_path), load_external_data=False)
    from ..graph.edit import readers_by_tensor

    producer = {o: n for n in qdq.graph.node for o in n.output}
    readers = readers_by_tensor(qdq.graph)
    source = name
    while source not in known:
        dequantizer = producer.get(source)
        if dequantizer is None or dequantizer.op_type != "DequantizeLinear":
            break
        quantizer = producer.get(dequantizer.input[0])
        if quantizer is None or quantizer.op_type != "QuantizeLinear":
            break
        source = quantizer.input[0]
    if source in known:
        return source
    queue, seen = [name], {name}
    while queue:
        for node in readers.get(queue.pop(0), []):
            for output in node.output:
                if output in known:
                    return output
                if output and output not in seen:
                    seen.add(output)
                    queue.append(output)
    return None


def channel_weights(float_path: Path) -> list[str]:
    """Weights that have output channels: those of Conv, ConvTranspose, Gemm and MatMul."""
    import onnx

    model = onnx.load(str(float_path), load_external_data=False)
    inits = {i.name: len(i.dims) for i in model.graph.initializer}
    found = []
    for node in model.graph.node:
        if node.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul") and len(node.input) > 1:
            weight = node.input[1]
            if inits.get(weight, 0) >= 2 and weight not in found:
                found.append(weight)
    return found


def _db_or_none(value: float) -> float | None:
    return None if np.isnan(value) else float(value)
