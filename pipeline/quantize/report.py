"""The quantize stage's report: one typed record (``report.json``), one render per section (``.md``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from qnn_ctx_runtime.buckets import CropRule, PadRule

from ..calibration.ranges import BiasFloor
from ..core.accuracy import Accuracy, comparison_note, figure, worst_snr
from ..core.layout import (
    AGREE_BOUND_DB,
    AGREE_MARGIN_DB,
    AGREE_SAMPLES,
    ENOUGH_MARGIN_DB,
    ENOUGH_SAMPLES,
    HTP_BUDGET_S,
)
from ..core.records import BuildInputs
from ..core.report import fmt, table, write_report
from .evaluate import EndToEnd
from .judge import LOSING_MARGIN_DB, WHOLE_FLOAT16, Divergence, HtpJudgement
from .lossless import PreparationCheck
from .mixed_precision import MixedPrecision


@dataclass(frozen=True)
class PrepareStep:
    step: str
    details: list[str]


@dataclass(frozen=True)
class RangeRules:
    """What pipeline.calibration.ranges changed in the calibrated ranges."""

    clamped: int
    widened: int
    bias_floor: list[BiasFloor]
    mask_fills: list[str] | None = None  # attention scores cut to their unmasked range
    bias_corrections: int = 0  # layers whose bias absorbed their weight's mean rounding error
    filled: int = 0  # 16-bit inputs of saturating ops given their whole live range
    swish_splits: list[str] | None = None  # x * sigmoid(x) given a requantized copy of x
    log_outputs: list[str] | None = None  # Log outputs widened to the HTP's smallest Log scale
    signed_products: list[str] | None = None  # act x act MatMul outputs re-encoded as int16
    selections: list[str] | None = None  # Where outputs widened to both inputs' grids
    coarse_sums: list[str] | None = None  # Add/Sub outputs no finer than their inputs
    integer_inputs: list[str] | None = None  # floats cast to integers, on an integer grid
    unseen_ranges: list[str] | None = None  # flat calibrated ranges given their reach
    loop_shared: int = 0  # tensors of unrolled loop iterations given one range
    hard_sigmoids: list[str] | None = None  # 16-bit HardSigmoid outputs on the HTP's grid
    raised_weight_scales: list[str] | None = None  # weight scales the HTP requantizes right
    requantized_moves: list[str] | None = None  # Reshape-like ops between two grids split
    split_weights: list[str] | None = None  # int16-weight layers as two int8-weight ones
    dequantized_inputs: list[str] | None = None  # integer inputs' Casts as DequantizeLinear
    scatter_sums: list[str] | None = None  # scatter-adds' inputs onto their output's grid
    packed_outputs: list[str] | None = None  # outputs packing parts of different scale, in fp16
    sentinel_constants: list[str] | None = None  # constants holding finfo.max / inf marks


@dataclass(frozen=True)
class BucketReport:
    """One static shape: its samples, sizes and QDQ-vs-float accuracy."""

    name: str
    shapes: dict[str, list[int]]
    calibration_samples: int
    calibrated_with_smaller: bool  # no sample of its own: every sample that fits, padded
    heldout_samples: int
    heldout_from_calibration: bool  # no held-out sample fits: validated on calibration samples
    float_nodes: int
    float_bytes: int
    qdq_bytes: int
    qdq_vs_float: dict[str, Accuracy]


@dataclass(frozen=True)
class WeightSharing:
    """Initializers of the buckets' QDQ models: same name must mean the same bytes."""

    shared_initializers: int
    shared_bytes: int
    bucket_specific: list[str]
    bucket_specific_bytes: int


@dataclass(frozen=True)
class OwnQuantization:
    """A pre-quantized model (pipeline.graph.prequantized): the quantization it brought, and
    either what was converted for the HTP (kept) or what requantize removed."""

    kept: bool  # False: requantize = true removed it and the pipeline quantized the float model
    summary: str  # its Q/DQ and QLinear nodes, activation and weight types
    conversions: list[PrepareStep]  # the exact rewrites for the HTP (kept)
    float_edges: list[str]  # tensors left without Q/DQ between two ops: float ops on the HTP
    removed: list[str]  # requantize: what dequantizing did
    # The model against itself with its float inputs moved by up to half its own input step:
    # how far any implementation that rounds differently can be expected to land.
    input_jitter: dict[str, Accuracy]


@dataclass(frozen=True)
class QuantizeReport:
    model: str
    version: str
    config: str
    inputs: BuildInputs
    graph_inputs: list[str]
    prepare: list[PrepareStep]  # of the largest bucket (the others differ only in shapes)
    calibration_kind: str
    calibration_samples: int
    heldout_samples: int
    calibration_chunk: int
    merged_tensors: int
    activation_type: str
    weight_type: str
    per_channel: bool
    method: str
    tensor_overrides: dict[str, str]
    op_type_overrides: dict[str, str]
    range_rules: RangeRules
    mixed_precision: MixedPrecision | None
    buckets: list[BucketReport]
    pads: list[PadRule]
    crops: list[CropRule]
    weights: WeightSharing
    end_to_end: EndToEnd
    worst_snr_db: float  # QDQ vs float, worst output of the worst bucket
    # the gate: quantization.min_snr_db (0 = off); a kept pre-quantized model's own rounding
    # floor less a margin where that is lower
    min_snr_db: float
    passed: bool
    source_bytes: int
    timings_s: dict[str, float]
    preparation_check: PreparationCheck | None = None  # prepared float vs source (>= 60 dB)
    prequantized: OwnQuantization | None = None  # the model brought its own quantization
    htp: HtpJudgement | None = None  # how precision was decided on the HTP (or why not)
    # A streaming model (calibration.recurrent): the QDQ model fed its own state window after
    # window vs float (``evaluate.closed_loop``); every other figure feeds it float's state.
    closed_loop: dict[str, Accuracy] = field(default_factory=dict)
    # ... its state pairs: state input -> the output that feeds it (compile runs the ctx so too)
    stream_states: dict[str, str] = field(default_factory=dict)
    # ... of which inferred, not declared (build._inferred_recurrent)
    recurrent_inferred: dict[str, str] = field(default_factory=dict)

    @property
    def multi(self) -> bool:
        return len(self.buckets) > 1


# -- sections ---------------------------------------------------------------------------------


def _header(r: QuantizeReport) -> list[str]:
    shapes = f" ({len(r.buckets)} buckets)" if r.multi else ""
    return [
        f"# Quantization report: {r.model} {r.version}{shapes}",
        "",
        f"Source: `{r.inputs.source}` (sha256 `{r.inputs.source_sha256[:16]}…`)"
        + "".join(
            f", its data `{name}` (sha256 `{digest[:16]}…`)"
            for name, digest in r.inputs.source_data.items()
        ),
        f"Config: `{r.config}`",
        f"Inputs: {'; '.join(r.graph_inputs)}",
    ]


def _prepare_section(r: QuantizeReport) -> list[str]:
    rows = [
        [s.step, len(s.details), "; ".join(s.details[:3]) + (" …" if len(s.details) > 3 else "")]
        for s in r.prepare
    ]
    lines = ["", "## Graph preparation", "", table(["step", "changes", "what"], rows)]
    return lines + _preparation_check(r.preparation_check)


def _preparation_check(check: PreparationCheck | None) -> list[str]:
    """The lossless-preparation gate: prepared float vs source, and per step when it failed."""
    if check is None:
        return []
    if check.snr_db is None:
        return ["", f"Prepared vs source: not measured ({check.error})."]
    verdict = "passed" if check.passed else "FAILED"
    text = (
        f"Prepared float vs {check.reference}: {fmt(check.snr_db)} dB on {check.samples} "
        f"held-out sample(s) (floor {check.min_snr_db:.4g} dB) — {verdict}."
    )
    if check.rounding_floor_db is not None and check.min_snr_db < 60:
        text += (
            f" The floor is the model's own rounding floor ({fmt(check.rounding_floor_db)} dB, "
            "below) less 3 dB: its Q/DQ turn a float32 rounding a step changes into whole "
            "quantization steps, so no rewrite of it lands nearer than that."
        )
    if check.float_floor_db is not None:
        text += (
            " The source against itself, run by onnxruntime with its graph optimizations and "
            f"without: {fmt(check.float_floor_db)} dB"
            + (
                " (the floor is that less 3 dB: the model moves so far with its float32 "
                "arithmetic merely reordered)."
                if check.min_snr_db < 60
                else "."
            )
        )
    if check.float16_snr_db is not None:
        text += f" Against the float16 source run: {fmt(check.float16_snr_db)} dB."
    lines = ["", text]
    if check.steps:
        rows = [[s.step, s.snr_db if s.snr_db is not None else "-", s.note] for s in check.steps]
        lines += [
            "",
            f"Each step's prefix vs the source (the first below the floor changed the "
            f"function: **{check.culprit or 'not found'}**):",
            "",
            table(["after step", "SNR vs source (dB)", "note"], rows),
        ]
    return lines


def _own_quantization_section(own: OwnQuantization) -> list[str]:
    """A pre-quantized model: its own quantization kept (or removed by requantize)."""
    if not own.kept:
        return [
            "",
            "## Own quantization removed"
            + (" (quantized at run time)" if "dynamic:" in own.summary else " (requantize = true)"),
            "",
            f"The source is pre-quantized ({own.summary}). Its quantization was removed and the float "
            "model behind it is the reference below, calibrated and quantized like any float "
            "model: " + "; ".join(own.removed),
        ]
    rows = [
        [c.step, len(c.details), "; ".join(c.details[:3]) + (" …" if len(c.details) > 3 else "")]
        for c in own.conversions
    ]
    lines = [
        "",
        "## Quantization: the model's own, kept",
        "",
        f"The model is pre-quantized ({own.summary}). Its own scales, zero points and types are "
        "kept: no calibration, no second quantization (set requantize = true in "
        "[quantization] to recalibrate instead). Its float reference is the model itself, run "
        "by onnxruntime on the CPU, so QDQ vs float below measures only these rewrites for "
        "the QNN HTP, exact but for int16 weights split in two, a 16-bit SiLU's "
        "requantized copy and activations quantized per channel put on one grid "
        "(pipeline/graph/prequantized.py):",
        "",
        table(["rewrite", "changes", "what"], rows) if rows else "No rewrite was needed.",
    ]
    if own.float_edges:
        shown = ", ".join(own.float_edges[:6])
        more = f" and {len(own.float_edges) - 6} more" if len(own.float_edges) > 6 else ""
        lines += ["", f"Left without Q/DQ (float ops on the HTP): {shown}{more}."]
    if own.input_jitter:
        shown = ", ".join(f"{k} {fmt(figure(v))} dB" for k, v in own.input_jitter.items())
        lines += [
            "",
            "Own rounding floor: the model against itself with its inputs moved across its own "
            "input rounding (by up to half a step, or one whole step for a quarter of the "
            f"values of an input already on its grid): {shown}. An implementation that rounds "
            "differently (the HTP) lands about that far from the model on the CPU.",
        ]
    return lines


def _quantization_section(r: QuantizeReport) -> list[str]:
    if r.prequantized is not None and r.prequantized.kept:
        return _own_quantization_section(r.prequantized)
    removed = _own_quantization_section(r.prequantized) if r.prequantized else []
    row = [
        r.activation_type,
        r.weight_type,
        r.per_channel,
        r.method,
        f"{r.calibration_samples} {r.calibration_kind}",
        r.heldout_samples,
    ]
    lines = [
        "",
        "## Quantization",
        "",
        table(
            ["activations", "weights", "per-channel", "method", "calibration", "held-out"], [row]
        ),
        *removed,
    ]
    rules = r.range_rules
    floors = ", ".join(f"`{f.tensor}`" for f in rules.bias_floor) or "none"
    lines += [
        "",
        f"Calibrated ranges (pipeline/calibration/ranges.py): {rules.clamped} cut to what their "
        f"saturating readers can tell apart, {rules.widened} widened for unseen values; widened "
        f"so the int32 biases fit: {floors}.",
    ]
    if rules.filled:
        lines.append(
            f"Saturating readers: {rules.filled} 16-bit input(s) of Sigmoid/Tanh/Clip-like ops "
            "cover their whole live range, not only the side calibration saw."
        )
    if rules.bias_corrections:
        lines.append(
            f"Bias correction: {rules.bias_corrections} layer(s) absorb in their bias the mean "
            "error their weight's rounding adds (pipeline/quantize/bias_correction.py)."
        )
    if rules.swish_splits:
        lines.append(
            f"SiLU for the HTP: {len(rules.swish_splits)} x * sigmoid(x) read a requantized copy "
            "of x (the HTP's fused 16-bit SiLU is wrong for some shapes; "
            "pipeline/graph/qdq_htp.py)."
        )
    if rules.sentinel_constants:
        names = ", ".join(f"`{n}`" for n in rules.sentinel_constants[:5])
        more = len(rules.sentinel_constants) - 5
        lines.append(
            f"Marks: constant(s) {names}{f' and {more} more' if more > 0 else ''} hold values "
            "of 1e30 or more (finfo.max or inf fills) beside real ones: they and the tensors "
            "carrying them are quantized on the real values' range, a mark saturating at its "
            "end (pipeline/calibration/ranges.py `SENTINEL`)."
        )
    if rules.selections:
        lines.append(
            f"Selections: {len(rules.selections)} Where output(s) cover what bounds their "
            "inputs (a Sigmoid's [0, 1], a Clip's limits), whichever branch calibration saw "
            "picked (pipeline/calibration/ranges.py)."
        )
    if rules.signed_products:
        lines.append(
            f"Products of two activations for the HTP: {len(rules.signed_products)} MatMul "
            "output(s) re-encoded from uint16 to int16, the same values (the HTP computes a "
            "uint16 x uint16 -> uint16 MatMul with 8 bits of its second operand; "
            "pipeline/graph/qdq_htp.py)."
        )
    if rules.coarse_sums:
        lines.append(
            f"Sums for the HTP: {len(rules.coarse_sums)} 16-bit Add/Sub of an activation and a "
            "constant given an output scale no finer than its inputs' (the HTP computes a "
            "finer one wrongly; pipeline/graph/qdq_htp.py)."
        )
    if rules.raised_weight_scales:
        lines.append(
            f"Weight scales for the HTP: {len(rules.raised_weight_scales)} Conv/Gemm/MatMul "
            "layer(s) with channels whose requantization factor (input x weight / output scale) "
            "was under 2^-22 (2^-17 where a PRelu/LeakyRelu reads the layer) got that factor, "
            "their weights and bias re-rounded (the HTP pins such a channel to an end of its "
            "grid; pipeline/graph/qdq_htp.py)."
        )
    if rules.requantized_moves:
        lines.append(
            f"Moves for the HTP: {len(rules.requantized_moves)} change(s) of grid around ops "
            "that only move values made a requantization of their own, the same values: a "
            "Reshape-like op between two grids kept on its input's, a Concat's input from a "
            "Transpose or Reshape put on the Concat's grid first (the HTP loses such a change "
            "of grid; pipeline/graph/qdq_htp.py)."
        )
    if rules.dequantized_inputs:
        lines.append(
            f"Integer inputs for the HTP: {len(rules.dequantized_inputs)} Cast(s) of an 8- or "
            "16-bit integer input to float read it through a DequantizeLinear of scale 1, the "
            "same values (the HTP takes no such Cast from int8/int16/uint16 and computes one "
            "from uint8 as a cast to bool; pipeline/graph/qdq_htp.py)."
        )
    if rules.scatter_sums:
        lines.append(
            f"Scatter sums for the HTP: {len(rules.scatter_sums)} ScatterElements/ScatterND "
            "adding into its output had its data and updates requantized onto the output's "
            "grid (the HTP adds their integers as if they were on it; "
            "pipeline/graph/qdq_htp.py)."
        )
    if rules.split_weights:
        lines.append(
            f"16-bit weights for the HTP: {len(rules.split_weights)} Conv/ConvTranspose/Gemm/"
            "MatMul layer(s) "
            "with int16 weights computed as two layers, their weights rounded to int8 and the "
            "int8 residual, summed (the HTP floors a layer's accumulator with 16-bit weights to "
            "about twice its input step times its largest weight; pipeline/graph/qdq_htp.py)."
        )
    if rules.loop_shared:
        lines.append(
            f"Unrolled loops: {rules.loop_shared} tensor(s) share the range of their Loop body "
            "tensor over every iteration (pipeline/calibration/ranges.py)."
        )
    if rules.unseen_ranges:
        lines.append(
            f"Unseen values: {len(rules.unseen_ranges)} tensor(s) calibration saw at one value "
            "(a mask it never flipped there) quantized over what their producer can reach "
            "(pipeline/calibration/ranges.py)."
        )
    if rules.integer_inputs:
        lines.append(
            f"Integers: {len(rules.integer_inputs)} float tensor(s) that a Cast turns into "
            "integers or booleans or a comparison reads against an integer (ids, a flipped "
            "attention mask), and those they are moved from, quantized on an integer grid "
            "(scale 1), so every integer is exact (pipeline/calibration/ranges.py)."
        )
    if rules.packed_outputs:
        lines.append(
            "Packed outputs kept in float (fp16 on the HTP) from their Concat on, each part at "
            "its own precision (pipeline/calibration/ranges.py `packed_outputs`): "
            + "; ".join(rules.packed_outputs)
            + "."
        )
    if rules.hard_sigmoids:
        lines.append(
            f"HardSigmoid for the HTP: {len(rules.hard_sigmoids)} 16-bit HardSigmoid output(s) "
            "on the HTP's fixed grid, [0, 1) in steps of 2^-16 (on any other range its result "
            "is off by a share of it; pipeline/calibration/ranges.py)."
        )
    if rules.log_outputs:
        lines.append(
            f"Log for the HTP: {len(rules.log_outputs)} 16-bit Log output(s) widened to a scale "
            "just above 2^-14, where the HTP's Log starts to compute (at or below it every "
            "output is the range's minimum; pipeline/calibration/ranges.py)."
        )
    if rules.mask_fills:
        shown = ", ".join(f"`{n}`" for n in rules.mask_fills[:6])
        more = f" and {len(rules.mask_fills) - 6} more" if len(rules.mask_fills) > 6 else ""
        lines.append(
            f"Attention-mask fills: {len(rules.mask_fills)} tensor(s) on the way to Softmax keep "
            f"the unmasked scores' range plus a saturating margin ({shown}{more})."
        )
    if r.multi:
        lines += [
            "",
            "One calibration over samples of varied size, each padded into the smallest bucket "
            "that holds it; the ranges of all buckets are merged, so every bucket is quantized "
            "with the same parameters.",
        ]
    return lines


def _ceiling_diagnosis(mixed: MixedPrecision) -> list[str]:
    """Why 16 bits did not help: outlier channels, outputs their own grid cannot hold, periodic
    ops whose phase no precision holds."""
    lines = []
    if mixed.outlier_channels:
        shown = "; ".join(
            f"`{o.tensor}` ({o.op}) channel {o.channel} peaks at {o.peak:.4g} where the median "
            f"channel peaks at {o.median_peak:.4g} ({o.peak / o.median_peak:.0f}x)"
            for o in mixed.outlier_channels
        )
        lines.append(
            f"Outlier channels: {shown}. With one scale per tensor the other channels keep few "
            "steps at any bit width; the HTP judge's fp16 candidates do not quantize them."
        )
    if mixed.output_grids:
        shown = "; ".join(
            f"`{g.output}`: its grid (scale {g.scale:.3g}) alone is {fmt(g.snr_db)} dB from "
            f"the float outputs, whose RMS is {g.rms:.3g}"
            for g in mixed.output_grids
        )
        lines.append(
            f"Output grids: {shown}. Values a few steps of their output's 16-bit grid or "
            "smaller (QNN fixes a 16-bit Sigmoid's to 1/65536) cannot be held to the target by "
            "any precision inside the model; the HTP judge's fp16 candidates have no grid."
        )
    if mixed.phase_limits:
        shown = "; ".join(
            f"{p.op} `{p.node}` reads arguments up to {p.peak:.3g} rad, where a 16-bit grid "
            f"steps {p.grid_step:.2g} rad and "
            + (
                f"fp16 {p.float16_step:.2g} rad"
                if p.float16_step != float("inf")
                else "fp16 overflows (65504 at most)"
            )
            + ": its output is "
            f"{fmt(p.snr_db)} dB at best"
            for p in mixed.phase_limits
        )
        lines.append(
            f"Periodic ops: {shown}. No precision of the NPU holds that phase (Fourier features "
            "or a sinusoidal embedding of a large value): compute them in float32 before the "
            "model (in the app, the model cut there), or feed their argument reduced modulo 2 pi."
        )
    return lines


def _mixed_section(r: QuantizeReport) -> list[str]:
    mixed = r.mixed_precision
    if mixed is not None and not mixed.tensors and mixed.rounds:
        # Raising what the analysis ranked first never helped, though 16 bits everywhere may.
        tried = ", ".join(f"{r.tensors}: {fmt(r.snr_db)} dB" for r in mixed.rounds)
        ceiling = mixed.ceiling_snr_db
        return [
            "",
            f"Mixed precision: no round improved the worst SNR of {fmt(mixed.before_snr_db)} dB "
            f"at 8 bits (target {fmt(mixed.target_snr_db)} dB; tensors raised: {tried}), so "
            "none is kept"
            + (
                f"; with every 8-bit tensor at 16 bits it is {fmt(ceiling)} dB"
                if ceiling is not None
                else ""
            )
            + ". The tensors that matter act together, not one by one; the HTP judge's fp16 "
            "candidates come next.",
        ]
    if mixed is not None and not mixed.tensors and mixed.ceiling_snr_db is not None:
        lower = mixed.ceiling_snr_db < mixed.before_snr_db
        why = (
            "16 bits is worse here, so what is short is not 8-bit rounding: the model "
            "amplifies its activations' 16-bit rounding from layer to layer (a PP-OCRv2 "
            "recogniser with every tensor at 16 bits: 75.7 dB after one block, 30.4 four "
            "layers on; at its output 21.0 dB with plain int16 weights, 20.7 with them split, "
            "22.7 at 8 bits), and 16-bit steps are fixed by each tensor's range; fp16, whose "
            "steps are relative to each value, held that recogniser at 43.1 dB on the HTP"
            if lower
            else "what is short is not 8-bit rounding"
        )
        return [
            "",
            f"Mixed precision: not used. With every 8-bit tensor at 16 bits the worst SNR is "
            f"{fmt(mixed.ceiling_snr_db)} dB (8 bits: {fmt(mixed.before_snr_db)} dB, target "
            f"{fmt(mixed.target_snr_db)} dB): {why}.",
            *_ceiling_diagnosis(mixed),
        ]
    if mixed is None or not mixed.tensors:
        return []
    where = f" (chosen on bucket {mixed.bucket}, applied to all)" if r.multi else ""
    unmeasured = [t for t in mixed.tensors if t.alone_snr_db != t.alone_snr_db]  # nan
    rows = [
        [t.name, t.kind, t.to, "not measured" if t in unmeasured else t.alone_snr_db]
        for t in mixed.tensors[:12]
    ]
    if len(mixed.tensors) > 12:
        rows.append([f"… {len(mixed.tensors) - 12} more", "", "", ""])
    budget = (
        [
            "",
            f"{len(unmeasured)} of them were raised without a measurement of their own: the "
            f"analysis' time budget ran out after {mixed.measured} of {mixed.candidates} "
            f"tensors ({fmt(mixed.analysis_s)} s), and those it left follow the measured ones "
            "in graph order.",
        ]
        if unmeasured
        else []
    )
    return [
        "",
        f"Mixed precision{where}: raised {len(mixed.tensors)} tensor(s) to 16 bit; worst SNR "
        f"{fmt(mixed.before_snr_db)} dB -> {fmt(mixed.after_snr_db)} dB. Chosen by each 8-bit "
        "tensor's measured effect on the output (pipeline/quantize/mixed_precision.py); the "
        "last column is the output SNR with only that tensor at 8 bit.",
        "",
        table(["tensor", "kind", "to", "output SNR alone (dB)"], rows),
        *budget,
    ]


def _buckets_section(r: QuantizeReport) -> list[str]:
    if not r.multi:
        return []
    rows = [
        [
            b.name,
            "; ".join(f"{k} {v}" for k, v in b.shapes.items()),
            b.calibration_samples,
            "yes" if b.calibrated_with_smaller else "no",
            f"{b.heldout_samples}" + (" (calibration)" if b.heldout_from_calibration else ""),
            worst_snr(b.qdq_vs_float) if b.qdq_vs_float else None,
            b.qdq_bytes,
        ]
        for b in r.buckets
    ]
    pads = [[p.dim, f"{p.input}[{p.axis}]", p.value, p.side] for p in r.pads]
    crops = [[c.output, c.axis, f"{c.input}[{c.input_axis}] ({c.dim})"] for c in r.crops]
    w = r.weights
    return [
        "",
        "## Buckets",
        "",
        table(
            [
                "bucket",
                "shapes",
                "calibration samples",
                "fallback",
                "held-out run",
                "SNR QDQ vs float dB",
                "QDQ bytes",
            ],
            rows,
        ),
        "",
        f"held-out run: a bucket runs every held-out sample that fits it, padded, so each of the "
        f"{r.heldout_samples} held-out samples counts in its own bucket and in every larger one "
        "(heldout/index.json names each sample's own bucket).",
        "",
        "Padding (into the bucket):",
        "",
        table(["dim", "axis", "value", "side"], pads) if pads else "none",
        "",
        "Outputs cropped back to the true size:",
        "",
        table(["output", "axis", "follows"], crops) if crops else "none",
        "",
        f"Weights: {w.shared_initializers} initializers ({w.shared_bytes:,} bytes) "
        f"byte-identical in every bucket; {len(w.bucket_specific)} bucket-specific "
        f"({w.bucket_specific_bytes:,} bytes).",
    ]


def gated_figure(r: QuantizeReport) -> str:
    """What the quantize gate judges: QDQ vs float, and the HTP judge's ctx vs float where it
    ran; for a model left whole in fp16 (nothing quantized, so QDQ vs float would compare the
    float model with itself) the HTP's ctx alone."""
    if r.htp is not None and r.htp.whole_float16:
        return "whole-fp16 ctx vs float on the HTP"
    if r.htp is not None and r.htp.judge == "htp" and r.htp.ctx_vs_float_db is not None:
        return "QDQ vs float on the CPU, and ctx vs float on the HTP"
    return "QDQ vs float"


def _accuracy_section(r: QuantizeReport) -> list[str]:
    e2e = r.end_to_end
    largest = r.buckets[-1].qdq_vs_float
    outputs = list(largest) or list(e2e.qdq_vs_source)
    rows = [
        [
            out,
            figure(largest.get(out)),
            fmt(largest[out].max_abs, 5) if out in largest else None,
            fmt(largest[out].cosine, 5) if out in largest else None,
            figure(e2e.qdq_vs_source.get(out)),
            figure(e2e.float_vs_source.get(out)),
        ]
        for out in outputs
    ]
    # A model kept whole in fp16 is written in place of the QDQ model: say which it is.
    kept = "fp16 model" if r.htp is not None and r.htp.whole_float16 else "QDQ"
    headers = [
        "output",
        f"SNR {kept} vs float (dB)",
        "max abs",
        "cosine",
        f"{kept} vs source (dB)",
        "prepared vs source (dB)",
    ]
    lines = [
        "",
        f"## Accuracy on held-out samples (CPU EP, {e2e.samples} at their true size)",
        "",
        table(headers, rows),
        "",
        (
            "fp16 model vs float: the model kept, whole in fp16 and not quantized, run on the "
            "CPU EP (its HTP figure is in the judge's table above), against the prepared float "
            "model"
            if kept != "QDQ"
            else "QDQ vs float: the QDQ model against the prepared float model"
        )
        + (" of the largest bucket" if r.multi else "")
        + ". vs source: "
        + ("padded into the bucket, run and cropped back, " if r.multi else "")
        + (
            "against the float model behind the pre-quantized source (its quantization "
            "removed), not the quantized file itself, whose own rounding is not in these figures."
            if r.prequantized is not None and not r.prequantized.kept
            else "against the source model as the user exported it."
        ),
    ]
    notes = []
    how = comparison_note([largest, e2e.qdq_vs_source])
    if how:
        notes.append(how)
    if e2e.error:
        notes.append(f"The source-model comparison could not run: {e2e.error}")
    if e2e.source_failures:
        notes.append(f"{e2e.source_failures} held-out sample(s) did not run on the source model.")
    if e2e.shape_mismatches:
        notes.append(f"{e2e.shape_mismatches} cropped output(s) differ in shape from the source.")
    if e2e.shipped_vs_source:
        shipped = worst_snr(e2e.shipped_vs_source)
        notes.append(
            f"The quantized file as shipped is {fmt(shipped)} dB (worst output) from that float "
            f"model on the same samples, the {kept} {fmt(worst_snr(e2e.qdq_vs_source))} dB: its "
            "own quantization's distance from the model every figure here is measured against."
        )
    elif e2e.shipped_error:
        notes.append(f"The quantized file as shipped could not be compared: {e2e.shipped_error}")
    if r.recurrent_inferred:
        shown = ", ".join(f"{inp} <- {out}" for inp, out in r.recurrent_inferred.items())
        notes.append(
            f"State inputs carried window to window from the outputs that feed them, inferred "
            f"(no calibration.recurrent; the data does not feed them, each is shaped like that "
            f"output): {shown}. Zeros would calibrate them to nothing."
        )
    if r.closed_loop:
        shown = ", ".join(
            f"{name} {fmt(a.snr_db)} dB"
            for name, a in r.closed_loop.items()
            if a.compared_as is None
        )
        notes.append(
            f"Closed loop (each held-out window fed the {kept} model's own state from the "
            "window before, as a streaming app runs it; the table feeds every window the float "
            f"model's state): worst {fmt(worst_snr(r.closed_loop))} dB vs float ({shown}). "
            "Shown, not gated."
        )
    lines += [f"- {n}" for n in notes]
    verdict = "passed" if r.passed else "FAILED"
    if r.min_snr_db > 0:
        lines += ["", f"Gate: min SNR {r.min_snr_db:.4g} dB ({gated_figure(r)}) — {verdict}."]
    return lines


def _footer(r: QuantizeReport) -> list[str]:
    qdq = sum(b.qdq_bytes for b in r.buckets)
    flt = sum(b.float_bytes for b in r.buckets)
    return [
        "",
        f"Sizes: source {r.source_bytes:,} B, prepared float {flt:,} B, QDQ {qdq:,} B"
        + (" (all buckets)." if r.multi else "."),
        "Timings: " + ", ".join(f"{k} {v:.2f} s" for k, v in r.timings_s.items()),
    ]


def _htp_section(r: QuantizeReport) -> list[str]:
    """Precision judged on what the NPU computes: each candidate compiled and run on the HTP."""
    j = r.htp
    if j is None:
        return []
    lines = ["", "## Judged on the HTP", "", j.reason + "."]
    if not j.rounds:
        return lines
    rows = [
        [
            x.label,
            x.qdq_vs_float_db,
            x.ctx_vs_float_db,
            x.ctx_vs_qdq_db,
            "-" if x.error else x.partitions,  # a failed round measured nothing
            "-" if x.error else x.cpu_nodes,
            _samples(x.samples, x.requested),
            f"{x.seconds:.1f}",
            x.error or ("kept" if x.label == j.chosen else ""),
        ]
        for x in j.rounds
    ]
    headers = [
        "candidate",
        "QDQ vs float (CPU) dB",
        "ctx vs float (HTP) dB",
        "ctx vs QDQ dB",
        "partitions",
        "CPU nodes",
        "samples",
        "s",
        "",
    ]
    lines += ["", table(headers, rows)]
    if any(x.label == WHOLE_FLOAT16 and x.qdq_vs_float_db is not None for x in j.rounds):
        lines += [
            "",
            f"For the {WHOLE_FLOAT16} the CPU column is its float32 graph on the CPU EP, which "
            "computes it in float32: it says how exact the graph's fp16 rewrites are, not what "
            "fp16 arithmetic does; the HTP column is the fp16 figure.",
        ]
    enough = [x for x in j.rounds if x.requested > x.samples > 0 and x.cut_by == "evidence"]
    if enough:
        lines += [
            "",
            f"A round stops starting samples once {ENOUGH_SAMPLES} have run at "
            f"{ENOUGH_MARGIN_DB:g} dB or more above the target SNR vs float on the HTP, pooled "
            "over them, each of them at the target at least (pipeline.core.layout."
            "ENOUGH_SAMPLES): the figure over them is above it, and the round's choice is "
            "made. Its figures are on the samples it ran.",
        ]
    if any(x.requested > x.samples > 0 and x.cut_by == "agreement" for x in j.rounds):
        lines += [
            "",
            f"The first round stopped after {AGREE_SAMPLES} samples: at the target on the "
            "HTP, pooled, its ctx was "
            f"{AGREE_MARGIN_DB:g} dB or more closer to the CPU QDQ model than that model is "
            "to float over every held-out sample (measured on the CPU, above the target with "
            "the margin). The HTP's own noise is then a tenth of the quantization's at most, "
            f"and the ctx within {AGREE_BOUND_DB:.1f} dB of the CPU figure "
            "(pipeline.core.layout.AGREE_SAMPLES): over all held-out samples, ctx vs float "
            f"≥ {fmt(r.worst_snr_db - AGREE_BOUND_DB)} dB. Its "
            f"figures in the table are on those {AGREE_SAMPLES} samples.",
        ]
    if any(x.requested > x.samples > 0 and x.cut_by == "losing" for x in j.rounds):
        lines += [
            "",
            f"A remedy's round stops starting samples once {ENOUGH_SAMPLES} have run "
            f"{LOSING_MARGIN_DB:g} dB or more below the best context so far, pooled "
            "(pipeline.quantize.judge.LOSING_MARGIN_DB): it cannot be kept. Its figures are on "
            "the samples it ran.",
        ]
    short = [
        x
        for x in j.rounds
        if x.requested > x.samples > 0 and x.cut_by not in ("evidence", "agreement", "losing")
    ]
    if short:
        pace = max(x.seconds_per_sample for x in short)
        lines += [
            "",
            f"The simulator took up to {pace:.0f} s of CPU a sample (one process): a round runs "
            f"no new sample after {HTP_BUDGET_S:g} s of it (pipeline.core.layout.HTP_BUDGET_S), "
            "so its figures are on the samples it ran (the samples column), not on every "
            "held-out sample.",
        ]
    if j.divergence is not None:
        d = j.divergence
        lines += [
            "",
            f"First divergence between the HTP and the CPU QDQ model: `{d.tensor}` from "
            f"{d.op_type} `{d.node}`, {fmt(d.snr_db)} dB{_exposure(d)}.",
        ]
    lines += [f"- {remedy}" for remedy in j.remedies]
    if j.whole_float16:
        lines += ["", "Kept: the whole model runs in fp16 on the HTP (it is not quantized)."]
    elif j.float16:
        lines += ["", f"Kept: {len(j.float16)} tensor(s) in float16 (fp16 on the HTP)."]
    return lines


def _exposure(divergence: Divergence) -> str:
    """Why the locator may name a tensor past the first that diverged: it compared a subset."""
    if 0 < divergence.exposed < divergence.exposable:
        return (
            f" (among {divergence.exposed} of {divergence.exposable} activations, spread over "
            "the graph: all of them a sample would not fit the locator's memory budget, "
            "pipeline.htp.probe.EXPOSED_BYTES)"
        )
    return ""


def _samples(ran: int, requested: int) -> str:
    return f"{ran} of {requested}" if requested > ran else str(ran or "-")


SECTIONS = (
    _header,
    _prepare_section,
    _quantization_section,
    _mixed_section,
    _htp_section,
    _buckets_section,
    _accuracy_section,
    _footer,
)


def write(folder: Path, report: QuantizeReport) -> Path:
    """report.md (each section rendered in turn) and report.json (the record itself)."""
    lines = [line for section in SECTIONS for line in section(report)]
    return write_report(folder, "\n".join(lines), report)


# -- a run that stopped on an error ---------------------------------------------------------------


@dataclass(frozen=True)
class SourceFacts:
    """What the source model file says about itself: the context a failure is read in."""

    opsets: dict[str, int]  # domain ("" for ai.onnx) -> version
    producer: str
    nodes: int
    op_types: dict[str, int]  # "domain:op" or "op" -> count, most frequent first
    inputs: list[str]  # "name: dtype [dims]"
    outputs: list[str]
    quantization: str  # what Q/DQ or integer ops it already holds, "" for a float model


@dataclass(frozen=True)
class QuantizeFailure:
    """A quantize run that stopped on an error (``report.json`` with ``status = "failed"``):
    the error and its tip, the steps that finished before it, and the source model's facts, so
    a model that cannot be built still comes with a diagnosis beside its console error."""

    model: str
    status: str  # always "failed"
    error: str
    tip: str
    error_type: str  # the pipeline's error class, or the exception of a fault in the pipeline
    steps_done: dict[str, float]  # step -> seconds, in the order they ran
    source: SourceFacts | None
    traceback: str = ""  # only for a fault that is not one of the pipeline's own errors


def describe_source(path: Path) -> SourceFacts | None:
    """The facts of a model file (read without its external data), None if it does not load."""
    import onnx

    from ..graph import prequantized

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # the failure itself may be this unreadable file
        return None
    counts: dict[str, int] = {}
    for node in model.graph.node:
        key = (
            f"{node.domain}:{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
        )
        counts[key] = counts.get(key, 0) + 1

    def value(info: onnx.ValueInfoProto) -> str:
        tensor = info.type.tensor_type
        if not info.type.HasField("tensor_type"):
            return f"{info.name}: {info.type.WhichOneof('value') or 'unknown'}"
        dims = (
            [
                d.dim_param or (str(d.dim_value) if d.HasField("dim_value") else "?")
                for d in tensor.shape.dim
            ]
            if tensor.HasField("shape")
            else ["?"]
        )
        dtype = onnx.TensorProto.DataType.Name(tensor.elem_type).lower()
        return f"{info.name}: {dtype} [{', '.join(dims)}]"

    inits = {i.name for i in model.graph.initializer}
    quantization = ""
    try:
        if prequantized.is_prequantized(model):
            quantization = prequantized.summarize(model).describe()
    except Exception:  # a fact of the report, never a second failure
        quantization = ""
    return SourceFacts(
        opsets={o.domain or "ai.onnx": o.version for o in model.opset_import},
        producer=" ".join(p for p in (model.producer_name, model.producer_version) if p),
        nodes=len(model.graph.node),
        op_types=dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))),
        inputs=[value(i) for i in model.graph.input if i.name not in inits],
        outputs=[value(o) for o in model.graph.output],
        quantization=quantization,
    )


def render_failure(failure: QuantizeFailure) -> str:
    lines = [
        f"# {failure.model}: quantize stopped with an error",
        "",
        f"**{failure.error_type}**: {failure.error}",
    ]
    if failure.tip:
        lines += ["", f"Tip: {failure.tip}"]
    done = ", ".join(f"{step} ({seconds:.1f} s)" for step, seconds in failure.steps_done.items())
    lines += [
        "",
        f"Steps finished before it: {done}." if done else "It stopped in the first step (prepare).",
        "Nothing of this run is usable: no QDQ model was recorded, so compile and publish refuse "
        "this model until a quantize run passes.",
    ]
    s = failure.source
    if s is not None:
        opsets = ", ".join(f"{d} {v}" for d, v in s.opsets.items())
        ops = ", ".join(f"{op} ×{n}" for op, n in s.op_types.items())
        lines += [
            "",
            "## The source model",
            "",
            f"- opsets: {opsets}; producer: {s.producer or 'not stated'}; {s.nodes} nodes",
            f"- inputs: {'; '.join(s.inputs) or 'none'}",
            f"- outputs: {'; '.join(s.outputs) or 'none'}",
            f"- ops: {ops or 'none'}",
        ]
        if s.quantization:
            lines.append(f"- already quantized: {s.quantization}")
    if failure.traceback:
        lines += [
            "",
            "## Where it failed (a fault in the pipeline, not in your model or config: please "
            "report it with this file)",
            "",
            "```",
            failure.traceback.rstrip(),
            "```",
        ]
    return "\n".join(lines)


def write_failure(folder: Path, failure: QuantizeFailure) -> Path:
    """report.md and report.json of a run that stopped on an error."""
    return write_report(folder, render_failure(failure), failure)
