"""The compile stage's report: a line per variant on the console, and ``ctx/report.md|json``.

One row per variant (toolchain x target) with its coverage, accuracy and load times; a row per
bucket and the sizes of the context sets when a model has several buckets; then every problem.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qnn_ctx_runtime.targets import Target
from qnn_ctx_runtime.toolchains import Toolchain

from ..core.accuracy import BELOW_STEP, LABELS, PART, PICKED, comparison_note, worst_snr
from ..core.config import ModelConfig
from ..core.layout import ModelPaths, VariantPaths
from ..core.records import Failure, QuantizeRecord, QuantizeSummary, VariantRecord, read_record
from ..core.report import fmt, table, write_report
from .job import LOWERED_GATE


def failure_details(e: Failure, limit: int) -> str:
    """The nodes, op types and QNN error codes a failure names, and what QNN declined before."""
    parts = [
        f"{key}: {', '.join(str(v) for v in values[:limit])}"
        for key, values in (
            ("nodes", e.nodes),
            ("op_types", e.op_types),
            ("qnn_error_codes", e.qnn_error_codes),
        )
        if values
    ]
    if e.rejected_earlier:
        parts.append(e.rejected_earlier)
    return "; ".join(parts)


def qdq_on_every_sample(v: Any, quantized: QuantizeSummary | None) -> str:
    """When the ctx ran some of the held-out samples only: the QDQ model's figure vs float on
    every one of them (what the quantize stage measured on the CPU), "" otherwise. Not where
    the kept model leaves tensors in float16 (the CPU computes those in float32).

    Why: a headline on the samples the early stops ran may read far above the rest (a
    classifier's 79.6 dB on 2 of 6 held-out samples, 57.6 on all 6 on the HTP)."""
    if v is None or quantized is None or quantized.float16_on_htp:
        return ""
    if not v.requested > v.samples > 0 or not math.isfinite(quantized.worst_snr_db):
        return ""
    return f"the QDQ model on all {quantized.heldout_samples}: {fmt(quantized.worst_snr_db, 1)} dB"


def _snr_line(
    v: Any, target_snr_db: float | None = None, quantized: QuantizeSummary | None = None
) -> str:
    picked = (
        v is not None
        and v.ctx_vs_qdq
        and all(a.compared_as == PICKED for a in v.ctx_vs_qdq.values())
    )
    if picked:  # no output is gated by SNR: "inf dB" would say they are exact
        worst = min(a.snr_db for a in v.ctx_vs_qdq.values())
        return f"outputs picked by rank, not gated (ctx vs QDQ {fmt(worst, 1)} dB), "
    vs_float = v.worst_snr_vs_float_db if v else None
    under = (
        f", under the target of {fmt(target_snr_db, 1)} dB"
        if vs_float is not None and target_snr_db is not None and vs_float < target_snr_db
        else ""
    )
    # Figures on some of the held-out samples (the judge's early stop, the simulator's time
    # budget) say so: a harvest's headline on 4 of 16 read 6 dB above its worst over all 16.
    some = f" on {v.samples} of {v.requested} samples" if v and v.requested > v.samples > 0 else ""
    every = qdq_on_every_sample(v, quantized)
    return f"ctx vs QDQ {fmt(v.worst_snr_db if v else None, 1)} dB{some}" + (
        f" (vs float {fmt(vs_float, 1)} dB{under}{'; ' + every if every else ''}), "
        if vs_float is not None
        else ", "
    )


def closed_loop_text(v: Any) -> str:
    """A streaming model's ctx fed its own state on the HTP (``Validation.closed_loop``), in
    words; "" when it was not run."""
    if v is None or not v.closed_loop:
        return ""
    shown = ", ".join(f"{n} {fmt(a.snr_db, 1)} dB" for n, a in v.closed_loop.items())
    on_cpu = (
        f"; the CPU QDQ model fed its own state on the same windows: "
        f"{fmt(worst_snr(v.closed_loop_qdq), 1)} dB (the quantize report's closed loop runs every "
        "held-out window)"
        if v.closed_loop_qdq
        else ""
    )
    return (
        f"fed its own state window after window on the HTP (closed loop, as a streaming app "
        f"runs it) the ctx is {fmt(worst_snr(v.closed_loop), 1)} dB from float ({shown}) over "
        f"{v.closed_loop_windows} held-out windows in order, {v.closed_loop_carried} of them fed "
        f"its own state{on_cpu}; shown, not gated (every other figure feeds each window the float "
        "model's state)"
    )


def closed_loop_note(r: VariantRecord, target_snr_db: float) -> str:
    """The console's NOTE when the closed loop is under the target, else ""."""
    v = r.validation
    if v is None or not v.closed_loop or worst_snr(v.closed_loop) >= target_snr_db:
        return ""
    return (
        f"NOTE {r.model} {r.target}: {closed_loop_text(v)}; under the target of "
        f"{fmt(target_snr_db, 1)} dB."
    )


def _labels_line(v: Any) -> str:
    """For a model whose outputs are all labels (no SNR: "inf dB" said nothing), the least
    share of them the ctx computes as the QDQ and the float model do."""
    if v is None or not v.ctx_vs_qdq:
        return ""
    if any(a.compared_as != LABELS for a in v.ctx_vs_qdq.values()):
        return ""

    def least(section: dict[str, Any]) -> str:
        shares = [a.agreement or 0.0 for a in section.values() if a.compared_as == LABELS]
        return f"{100.0 * min(shares):.1f}%" if shares else "-"

    line = f"labels as the QDQ's {least(v.ctx_vs_qdq)}"
    if v.ctx_vs_float:
        line += f" (as float's {least(v.ctx_vs_float)})"
    return line + ", "


def describe(
    r: VariantRecord,
    skipped: bool = False,
    target_snr_db: float | None = None,
    quantized: QuantizeSummary | None = None,
) -> str:
    """The console line of one variant: verdict, coverage, accuracy and load, or the failure;
    ``target_snr_db`` (quantization's): said when the ctx is under it vs float (it passed the
    gate, not the aim); ``quantized`` (the quantize record's summary): the QDQ model's figure
    on every held-out sample, when the ctx ran some."""
    head = f"{r.model} {r.target} onnxruntime-qnn {r.toolchain}"
    if skipped:
        head += " (unchanged, skipped)"
    if r.status != "ok":
        e = r.error
        if e is None:
            return f"FAILED {head}"
        text = f"FAILED {head}: {e.kind} in {e.stage}: {e.message[:600]}"
        extra = failure_details(e, 8)
        return text + (f" [{extra}]" if extra else "")
    c, v, load = r.coverage, r.validation, r.load
    verdict = "ok" if r.passed else "FAILED gate"
    text = (
        f"{verdict} {head}: {c.qnn_partitions if c else '-'} QNN partition(s), "
        f"{len(c.cpu_compute_nodes) if c else '-'} CPU node(s), "
        + (_labels_line(v) or _snr_line(v, target_snr_db, quantized))
        + f"load {fmt(load.ratio if load else None, 1)}x faster than QDQ (HTP simulator, "
        "not device latency)"
    )
    primary = r.sets[0] if r.sets else None
    if primary is not None and primary.kind == "shared":
        standalone = r.set_of("standalone")
        text += (
            f"; {len(primary.ctx_files)} buckets in one shared context "
            f"{primary.total_bytes / 1e6:.3f} MB"
            + (f" (standalone {standalone.total_bytes / 1e6:.3f} MB)" if standalone else "")
            + f", validated with the {r.validated_with} set"
        )
    problems = list(c.problems) if c else []
    if v and not v.passed:
        problems.append(f"validation: {v.gate} (worst {fmt(v.worst_snr_db, 1)} dB)")
    elif v and LOWERED_GATE in v.gate:  # a low figure that passed: say on which gate
        lowered = v.gate.split(f"{LOWERED_GATE}: ", 1)[1].split(";", 1)[0]
        text += f"; passed on the pre-quantized model's own rounding floor ({lowered})"
    return text + (" -- " + "; ".join(problems) if problems else "")


def _num(value: Any, pattern: str) -> str:
    """A table cell: fixed format, ``inf`` for exact matches, ``-`` when unknown."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "inf" if value == float("inf") else pattern.format(value)
    return fmt(value)


def _snr_cell(section: dict[str, Any], worst: float | None) -> str:
    """The worst SNR; "-" where no output has one that counts (labels, outputs picked by rank:
    an RT-DETR's every output), whose "inf" read as an exact match."""
    if section and _worst(section, min, "snr_db") is None:
        return "-"
    return _num(worst, "{:.1f}")


def _ms(seconds: float | None) -> float | None:
    return seconds * 1000.0 if seconds is not None else None


def _mb(value: int | None) -> str:
    return f"{value / 1e6:.3f}" if value else "-"


def _worst(section: dict[str, Any], pick: Callable[..., float], key: str) -> float | None:
    # as worst_snr; a part's max abs and cosine are its output's already
    skipped = (LABELS, BELOW_STEP, PICKED, PART) if key == "snr_db" else (LABELS, PART)
    values = [getattr(a, key) for a in section.values() if a.compared_as not in skipped]
    return pick(values) if values else None


@dataclass(frozen=True)
class _Row:
    toolchain: Toolchain
    target: Target
    record: VariantRecord

    @property
    def where(self) -> str:
        return f"{self.target.name} / onnxruntime-qnn {self.toolchain.onnxruntime_qnn}"


def _variant_rows(rows: list[_Row]) -> list[list[Any]]:
    lines = []
    for row in rows:
        r = row.record
        c, v, load = r.coverage, r.validation, r.load
        ops = ", ".join(f"{op} x{n}" for op, n in (c.cpu_ops if c else {}).items()) or "0"
        result = "pass" if r.passed else ("FAIL gate" if r.status == "ok" else "FAILED")
        vs_qdq = v.ctx_vs_qdq if v else {}
        primary = r.sets[0] if r.sets else None
        lines.append(
            [
                r.toolchain,
                r.qnn_sdk,
                r.target,
                result,
                c.qnn_partitions if c else None,
                ops,
                _snr_cell(vs_qdq, v.worst_snr_db if v else None),
                _snr_cell(v.ctx_vs_float if v else {}, v.worst_snr_vs_float_db if v else None),
                _num(_worst(vs_qdq, max, "max_abs"), "{:.3g}"),
                _num(_worst(vs_qdq, min, "cosine"), "{:.5f}"),
                _mb(primary.total_bytes if primary else None),
                _num(r.compile_time_s if r.status == "ok" else None, "{:.2f}"),
                _num(_ms(load.qdq_s if load else None), "{:.1f}"),
                _num(_ms(load.ctx_s if load else None), "{:.1f}"),
                _num(load.ratio if load else None, "{:.1f}"),
            ]
        )
    return lines


def _bucket_rows(rows: list[_Row]) -> list[list[Any]]:
    lines = []
    for row in rows:
        r = row.record
        loads = r.load.buckets if r.load else {}
        for name, outcome in r.buckets.items():
            cov, val = outcome.coverage, outcome.validation
            lines.append(
                [
                    r.toolchain,
                    r.target,
                    name,
                    "pass" if cov.passed and val and val.passed else "FAIL",
                    cov.qnn_partitions,
                    len(cov.cpu_compute_nodes),
                    _snr_cell(val.ctx_vs_qdq if val else {}, val.worst_snr_db if val else None),
                    _snr_cell(
                        val.ctx_vs_float if val else {},
                        val.worst_snr_vs_float_db if val else None,
                    ),
                    fmt(loads[name] * 1000, 1) if name in loads else "-",
                ]
            )
    return lines


def _size_rows(rows: list[_Row]) -> list[list[Any]]:
    lines = []
    for row in rows:
        r = row.record
        shared, standalone = r.set_of("shared"), r.set_of("standalone")
        largest = max(standalone.bucket_bytes.values(), default=0) if standalone else 0
        lines.append(
            [
                r.toolchain,
                r.target,
                r.status,
                _mb(shared.total_bytes if shared else None),
                _mb(standalone.total_bytes if standalone else None),
                _mb(largest),
                fmt(shared.total_bytes / largest, 2) if shared and largest else "-",
                fmt(r.load.all_s * 1000, 1) if r.load and r.load.all_s else "-",
            ]
        )
    return lines


def _notes(rows: list[_Row], quantized: QuantizeSummary | None = None) -> list[str]:
    notes = []
    for row in rows:
        r, where = row.record, row.where
        e = r.error
        if e is not None:
            detail = failure_details(e, 10)
            notes.append(
                f"- **{where}** {e.kind} in step `{e.stage}`: {e.message[:800]}"
                + (f" ({detail})" if detail else "")
            )
        for problem in r.coverage.problems if r.coverage else []:
            notes.append(f"- **{where}** coverage: {problem}")
        if r.qnn_options:
            shown = ", ".join(f"`{k} = {v}`" for k, v in sorted(r.qnn_options.items()))
            notes.append(f"- **{where}** compiled with the QNN EP options {shown}")
        tail = r.coverage.cpu_tail_nodes if r.coverage else None
        if tail:
            names = ", ".join(f"{n.name} ({n.op_type})" for n in tail[:10])
            notes.append(
                f"- **{where}** declared CPU tail, not counted by the gate (ai.onnx.ml "
                f"post-processing, non-tensor outputs): {names}"
            )
        if r.validation is not None:
            own = {n: a for n, a in r.validation.ctx_vs_qdq.items() if a.compared_as != PART}
            how = comparison_note([own])
            parts = {n: a for n, a in r.validation.ctx_vs_float.items() if a.compared_as == PART}
            if parts:
                shown = ", ".join(f"'{n}' {fmt(a.snr_db, 1)} dB" for n, a in parts.items())
                how += (
                    " Parts of the outputs a Concat packs, each on its own elements, ctx vs "
                    f"float (shown, not gated: the output's figure is mostly its largest part's): "
                    f"{shown}."
                )
            labels = {
                name: a.agreement
                for name, a in r.validation.ctx_vs_float.items()
                if a.compared_as == LABELS
            }
            if labels:
                shown = ", ".join(f"{n} {100.0 * (v or 0.0):.1f}%" for n, v in labels.items())
                how += f" Labels agreeing with the float model: {shown}."
            if how:
                notes.append(f"- **{where}** {how.strip()}")
        if r.validation is not None and r.validation.closed_loop:
            notes.append(f"- **{where}** {closed_loop_text(r.validation)}.")
        if r.validation is not None and r.validation.measured_by:
            notes.append(f"- **{where}** validation figures measured by {r.validation.measured_by}")
        if r.validation is not None and "lowered" in r.validation.gate:
            # the gate line above is compile.min_snr_db; this variant was held to its floor
            notes.append(f"- **{where}** gate applied: {r.validation.gate}")
        v = r.validation
        if v is not None and v.requested > v.samples and v.cut_by == "evidence":
            notes.append(
                f"- **{where}** validated on {v.samples} of {v.requested} held-out samples: "
                "pooled, they reached the target SNR vs float with the margin "
                "(pipeline.core.layout.ENOUGH_MARGIN_DB) on the HTP, each of them the target, "
                "so the rest were not run"
            )
        elif v is not None and v.requested > v.samples and v.cut_by == "labels":
            notes.append(
                f"- **{where}** validated on {v.samples} of {v.requested} held-out samples: "
                "every output is a label, the ctx gave the CPU QDQ model's on every element, "
                "and the scores they are computed from were judged on the HTP by the quantize "
                "stage, so the rest were not run"
            )
        elif v is not None and v.requested > v.samples and v.cut_by == "agreement":
            notes.append(
                f"- **{where}** validated on {v.samples} of {v.requested} held-out samples: "
                "at the target, the HTP agreed with the CPU QDQ model "
                "(pipeline.core.layout.AGREE_MARGIN_DB closer than that model is to float on "
                "every held-out sample, where it is above the target with the margin), so the "
                "rest were not run"
            )
        elif v is not None and v.requested > v.samples:
            notes.append(
                f"- **{where}** validated on {v.samples} of {v.requested} held-out samples: the "
                "HTP simulator's time budget (pipeline.core.layout.HTP_BUDGET_S s) ran out "
                "before the rest"
            )
        every = qdq_on_every_sample(v, quantized)
        if every:
            notes.append(
                f"- **{where}** vs float over every held-out sample, {every} on the CPU (the "
                f"ctx's {fmt(v.worst_snr_vs_float_db, 1)} dB is on its {v.samples})"
            )
        if r.load is not None and r.load.qdq_timed_by:
            notes.append(f"- **{where}** QDQ load (online compile) timed by {r.load.qdq_timed_by}")
        if r.validation is not None and not r.validation.passed:
            notes.append(f"- **{where}** validation below the gate (compile.min_snr_db)")
        if r.load is not None and r.load.qdq_error:
            notes.append(f"- **{where}** load benchmark: {r.load.qdq_error}")
        if r.shared_load_probe:
            notes.append(
                f"- **{where}**: {r.shared_load_probe}; validated with the {r.validated_with} "
                "contexts."
            )
    return notes


VARIANT_HEADERS = [
    "toolchain",
    "QNN SDK",
    "target",
    "result",
    "partitions",
    "CPU nodes",
    "SNR vs QDQ dB",
    "SNR vs float dB",
    "max abs vs QDQ",
    "cosine vs QDQ",
    "ctx MB",
    "compile s",
    "load QDQ ms (sim)",
    "load ctx ms (sim)",
    "load ratio (sim)",
]
BUCKET_HEADERS = [
    "toolchain",
    "target",
    "bucket",
    "result",
    "partitions",
    "CPU nodes",
    "SNR vs QDQ dB",
    "SNR vs float dB",
    "load ctx ms (sim)",
]
SIZE_HEADERS = [
    "toolchain",
    "target",
    "status",
    "shared total MB",
    "standalone total MB",
    "largest bucket alone MB",
    "shared / largest",
    "load all ms (sim)",
]


def write_model_report(
    config: ModelConfig,
    paths: ModelPaths,
    quantize: QuantizeRecord,
    toolchains: list[Toolchain],
    targets: list[Target],
) -> Path:
    """report.md / report.json over every variant on disk that the config asks for."""
    rows = []
    for toolchain in toolchains:
        for target in targets:
            folder: VariantPaths = paths.variant(toolchain.onnxruntime_qnn, target.name)
            record, _ = read_record(VariantRecord, folder.record)
            if record is not None:
                rows.append(_Row(toolchain, target, record))
    settings = config.compile
    multi = len(quantize.buckets) > 1
    gates = (
        f"Gates: all compute nodes on QNN in <= {settings.max_partitions} partition(s)"
        + (
            f", allowed on CPU: {', '.join(settings.allowed_cpu_ops)}"
            if settings.allowed_cpu_ops
            else ""
        )
        + (
            f"; worst ctx vs QDQ SNR >= {settings.min_snr_db} dB"
            if settings.min_snr_db > 0
            else "; no SNR gate"
        )
        + ". Graph-I/O Q/DQ left on CPU by offload_graph_io_quantization are not counted."
    )
    lines = [f"# Compile report: {config.model.name} {config.model.version}", ""]
    if quantize.status != "ok":
        lines += [
            "Note: this QDQ model did not pass the quantize stage's own gate "
            "(quantization.min_snr_db, see ../report.md).",
            "",
        ]
    lines += [
        gates,
        "Validation: the ctx model on the QNN HTP backend (the x86_64 HTP simulator here) vs "
        "the QDQ and the float model on the CPU EP, over held-out samples. Load: ctx session "
        f"creation, min of {settings.load_runs}, vs one creation of the QDQ model with QNN "
        "compiling online; timed on this build machine (the simulator), not device latency.",
        "",
        table(VARIANT_HEADERS, _variant_rows(rows)) if rows else "No variant has been built yet.",
    ]
    if multi and rows:
        lines += [
            "",
            "## Buckets",
            "",
            "Every target's buckets are compiled in one process into one weight-shared QNN "
            "context (one _qnn.bin that every bucket's _ctx.onnx references) where packaging "
            "asks for it, and each bucket also on its own (standalone). Coverage and validation "
            "per bucket, over held-out samples padded into it.",
            "",
            table(BUCKET_HEADERS, _bucket_rows(rows)),
            "",
            "## Sizes",
            "",
            table(SIZE_HEADERS, _size_rows(rows)),
        ]
    notes = _notes(rows, quantize.summary)
    if notes:
        # Failures and failed gates are problems; on variants that all passed, what is left is
        # how they were measured (adopted runs, declared CPU tails, label agreement).
        failed = any(not row.record.passed for row in rows)
        lines += ["", "## Problems" if failed else "## Notes", "", *notes]
    data = {
        "model": config.model.name,
        "version": config.model.version,
        "quantize_status": quantize.status,
        "gates": {
            "max_partitions": settings.max_partitions,
            "allowed_cpu_ops": settings.allowed_cpu_ops,
            "min_snr_db": settings.min_snr_db,
        },
        "variants": [row.record for row in rows],
    }
    return write_report(paths.ctx, "\n".join(lines), data)
