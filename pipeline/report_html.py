"""A report people look at: ``report.html`` beside each model's report.md/json, and one
``build/index.html`` over every model of a run.

The entry function is ``write_html_reports``, called at the end of the quantize and the compile
stage. It renders from the files the stages already wrote (``report.json`` of quantize,
``ctx/report.json`` and each variant's ``variant.json`` of compile, ``record.json``), read
leniently as plain JSON: a section whose data is absent (no mixed precision, a pre-quantized
model, a failed variant, a build from an older schema) is left out, and a failure to render is a
warning line, never a failed stage. A page is self-contained (inline CSS, inline SVG plots, no
script, no external URL), so it opens offline from a CI artifact.

Plots: matplotlib (a build extra), driven through ``matplotlib.figure.Figure`` (no pyplot, no
display, no global state). Without matplotlib a page keeps its tables and says how to get the
plots. A model's page is only re-rendered when its inputs (or this module) changed, so a warm
rebuild does not pay for matplotlib; the index is rewritten every time (tables only, cheap).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import io
import json
import math
import re
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

from .core.accuracy import BELOW_STEP, MATCHED, PICKED
from .core.fileio import write_text
from .core.layout import INDEX_HTML, REPORT_HTML, REPORT_JSON, REPORT_MD, VARIANT_FILE, ModelPaths

# The page says so wherever a load time appears: a ratio of session creations on the build
# machine's HTP simulator tells nothing about load latency on a device's NPU.
SIMULATOR_NOTE = (
    "measured on the build machine's x86_64 HTP simulator: session creation there, "
    "not device latency"
)
PLOTS_MISSING = (
    "Plots need matplotlib, a build extra: pip install 'qnn-ctx-pipeline[build]' "
    "(or matplotlib) in the environment that runs the stage."
)
_DIGEST_META = "qnn-ctx-report-inputs"
_MAX_BARS = 40  # tensors shown in the sensitivity plot; the table below lists them all
_MAX_GROUPS = 24  # output x variant groups in the accuracy plot
MIN_COMPARED = 2  # a plot compares this many things (rounds, outputs, variants) or is left out
# One colour per comparison, the same in every plot and page.
COLOURS = {
    "ctx_vs_qdq": "#1f77b4",
    "ctx_vs_float": "#ff7f0e",
    "qdq_vs_float": "#2ca02c",
    "closed_loop": "#8c564b",  # a stream's ctx fed its own state (compile's closed loop)
    "qdq_load": "#9467bd",
    "ctx_load": "#1f77b4",
    "all_load": "#17becf",
    "weight": "#1f77b4",
    "activation": "#ff7f0e",
    "target": "#d62728",
}


# -- lenient reading ------------------------------------------------------------------------------


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _num(value: Any) -> float | None:
    """A JSON number, or "inf"/"nan" as report.json writes them; None for anything else."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _finite(value: Any) -> float | None:
    number = _num(value)
    return number if number is not None and math.isfinite(number) else None


def _read_json(path: Path, problems: list[str]) -> Any:
    """The parsed file, or None (absent: silently; unreadable: noted on the page)."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        problems.append(f"{path.name} could not be read: {exc}")
        return None


def _version_key(text: str) -> tuple[Any, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"[.\-]", text))


@dataclass
class ModelData:
    """What the stages left for one model, as plain JSON ({} or [] where absent)."""

    name: str
    root: Path
    quantize: dict[str, Any] = field(default_factory=dict)  # report.json
    record: dict[str, Any] = field(default_factory=dict)  # record.json
    ctx: dict[str, Any] = field(default_factory=dict)  # ctx/report.json
    variants: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def built(self) -> bool:
        return bool(self.quantize or self.ctx or self.variants)


def _input_files(root: Path) -> list[Path]:
    """Every file a model's page is rendered from."""
    paths = ModelPaths(root)
    files = [root / REPORT_JSON, paths.record, paths.ctx / REPORT_JSON, *_variant_files(paths)]
    return [f for f in files if f.is_file()]


def _variant_files(paths: ModelPaths) -> list[Path]:
    """``ctx/<toolchain>/<target>/variant.json``, every variant on disk."""
    return sorted(paths.ctx.glob(f"*/*/{VARIANT_FILE}"))


def load_model(root: Path) -> ModelData:
    """Read one ``build/<model>/`` folder; variants come from their variant.json on disk (the
    newest word), else from ctx/report.json."""
    paths = ModelPaths(root)
    data = ModelData(root.name, root)
    data.quantize = _dict(_read_json(root / REPORT_JSON, data.problems))
    data.record = _dict(_read_json(paths.record, data.problems))
    data.ctx = _dict(_read_json(paths.ctx / REPORT_JSON, data.problems))
    on_disk = [_dict(_read_json(path, data.problems)) for path in _variant_files(paths)]
    variants = [v for v in on_disk if v] or [_dict(v) for v in _list(data.ctx.get("variants"))]
    data.variants = sorted(
        (v for v in variants if v),
        key=lambda v: (_version_key(str(v.get("toolchain", ""))), str(v.get("target", ""))),
    )
    data.name = str(data.quantize.get("model") or data.ctx.get("model") or root.name)
    return data


# -- facts derived from the JSON ------------------------------------------------------------------


def _where(v: dict[str, Any]) -> str:
    return f"{v.get('target', '?')} / qnn {v.get('toolchain', '?')}"


def _variant_verdict(v: dict[str, Any]) -> tuple[str, bool]:
    """(what to show, passed) for one variant; mirrors VariantRecord.passed on plain JSON."""
    error = _dict(v.get("error"))
    if v.get("status") != "ok":
        kind = error.get("kind")
        return (f"FAILED ({kind} in {error.get('stage')})" if kind else "FAILED"), False
    deferred = v.get("backend") == "gpu" and error.get("kind") == "unavailable"
    coverage = _dict(v.get("coverage"))
    validation = _dict(v.get("validation"))
    if not (deferred or coverage.get("passed")):
        return "FAIL coverage gate", False
    if not validation:
        return ("deferred to device" if deferred else "not validated"), deferred
    if not validation.get("passed"):
        return "FAIL SNR gate", False
    return "pass", True


def _stale(data: ModelData, v: dict[str, Any]) -> bool:
    """The variant was compiled from other QDQ models than the quantize record names."""
    built = _dict(_dict(v.get("built_from")).get("qdq_sha256"))
    recorded = {
        str(b.get("name")): b.get("qdq_sha256")
        for b in map(_dict, _list(data.record.get("buckets")))
    }
    return bool(built and recorded) and built != recorded


def _quantize_verdict(data: ModelData) -> tuple[str, bool | None]:
    q = data.quantize
    if q.get("status") == "failed":
        return "FAIL: stopped with an error", False
    if q:
        check = _dict(q.get("preparation_check"))
        if check and check.get("passed") is False:
            return "FAIL preparation check", False
        return ("pass", True) if q.get("passed", True) else ("FAIL SNR gate", False)
    status = data.record.get("status")
    if status:
        return ("pass", True) if status == "ok" else ("FAIL", False)
    return "not run", None


def _worst_section(section: Any) -> float | None:
    values = [_num(_dict(a).get("snr_db")) for a in _dict(section).values()]
    values = [x for x in values if x is not None and not math.isnan(x)]
    return min(values) if values else None


# -- HTML pieces ----------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 1) -> str:
    """A cell: floats at fixed digits, inf for identical, ints with separators, - when unknown."""
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    number = _num(value) if isinstance(value, float) or value in _SPECIAL else None
    if number is None:
        return str(value)
    if math.isinf(number):
        return "inf" if number > 0 else "-inf"
    if math.isnan(number):
        return "nan"
    return f"{number:.{digits}f}"


_SPECIAL = ("inf", "-inf", "nan", "Infinity", "-Infinity", "NaN")


def _cell(value: Any, digits: int = 1) -> str:
    if isinstance(value, _Raw):
        return value.html
    return escape(_fmt(value, digits))


@dataclass(frozen=True)
class _Raw:
    """Cell content that is already HTML (a badge, a link)."""

    html: str


def _badge(text: str, ok: bool | None) -> _Raw:
    kind = "na" if ok is None else ("ok" if ok else "bad")
    return _Raw(f'<span class="badge {kind}">{escape(text)}</span>')


def _table(
    headers: Sequence[str], rows: Iterable[Sequence[Any]], digits: int = 1, cls: str = ""
) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = []
        for value in row:
            numeric = isinstance(value, int | float) and not isinstance(value, bool)
            attr = ' class="num"' if numeric or _num(value) is not None else ""
            cells.append(f"<td{attr}>{_cell(value, digits)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    klass = f' class="{cls}"' if cls else ""
    return f"<table{klass}><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _p(text: str) -> str:
    return f"<p>{escape(text)}</p>"


def _ul(items: Iterable[str]) -> str:
    items = list(items)
    return "<ul>" + "".join(f"<li>{escape(i)}</li>" for i in items) + "</ul>" if items else ""


def _details(summary: str, body: str) -> str:
    return f"<details><summary>{escape(summary)}</summary>{body}</details>"


def _bar_cell(value: float, largest: float, text: str) -> _Raw:
    """A number with a proportional CSS bar behind it (timings)."""
    width = 0.0 if largest <= 0 else max(0.0, min(100.0, 100.0 * value / largest))
    return _Raw(
        f'<div class="bar"><span style="width:{width:.1f}%"></span><em>{escape(text)}</em></div>'
    )


CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1d2330;
 margin:0;background:#f6f7f9}
main{max-width:1180px;margin:0 auto;padding:18px 28px 60px;background:#fff;min-height:100vh}
h1{font-size:22px;margin:8px 0 4px}h2{font-size:18px;margin:34px 0 8px;padding-top:6px;
 border-top:1px solid #e3e6eb}h3{font-size:15px;margin:22px 0 6px}
.sub{color:#5b6475;margin:0 0 10px}code{font-size:12px;background:#f0f2f5;padding:1px 4px;
 border-radius:3px}
table{border-collapse:collapse;margin:8px 0 12px;font-size:13px}
th,td{border:1px solid #dde1e7;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#eef1f5;font-weight:600}tbody tr:nth-child(even){background:#fafbfc}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.badge{display:inline-block;padding:0 7px;border-radius:9px;font-size:12px;font-weight:600;
 white-space:nowrap}.ok{background:#dcf3e3;color:#17612f}.bad{background:#fde1e1;color:#9b1c1c}
.na{background:#eceff3;color:#4a5263}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:12px 0}
.card{border:1px solid #dde1e7;border-radius:6px;padding:8px 12px;min-width:150px}
.card b{display:block;font-size:18px}.card span{color:#5b6475;font-size:12px}
figure{margin:10px 0 16px}figcaption{color:#5b6475;font-size:12px;max-width:900px}
figure svg{max-width:100%;height:auto}
.note{background:#fff8e1;border-left:3px solid #e0b400;padding:6px 10px;margin:8px 0}
.bar{position:relative;min-width:160px;height:18px}.bar span{position:absolute;left:0;top:2px;
 bottom:2px;background:#cfe0f5;border-radius:2px}.bar em{position:relative;font-style:normal;
 padding-left:4px}
details{margin:6px 0}summary{cursor:pointer;color:#2b5aa5}
nav a{margin-right:12px}
"""


def _page(title: str, body: str, digest: str = "") -> str:
    meta = f'<meta name="{_DIGEST_META}" content="{digest}">\n' if digest else ""
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'{meta}<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{escape(title)}</title>\n<style>{CSS}</style>\n</head>\n"
        f"<body><main>\n{body}\n</main></body>\n</html>\n"
    )


# -- plots ----------------------------------------------------------------------------------------


def plots_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


_PRELOADING = False


def preload_plotting() -> None:
    """Import matplotlib in a background thread, so its ~1 s import overlaps the stage's own
    work (onnxruntime and the worker processes run outside the GIL) instead of adding to it.
    Python's import lock makes a later import wait for this one, never repeat it. Called
    where a plot becomes likely (a second judge round, mixed precision), and once only."""
    global _PRELOADING
    if _PRELOADING or not plots_available():
        return
    _PRELOADING = True

    def load() -> None:
        try:
            import matplotlib.backends.backend_svg
            import matplotlib.figure  # noqa: F401
        except Exception:  # the page says what is missing when it is drawn
            return

    threading.Thread(target=load, name="preload-matplotlib", daemon=True).start()


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100)


# Inches per character and per line of the plots' text (font.size 9, tick labels 8): the SVG's
# text is set by the viewer's font, so an estimate is as exact as a measurement here.
_CHAR_IN = 0.067
_LINE_IN = 0.17
_PAD_IN = 0.06
_TICK_IN = 0.1  # a tick and the gap to its label
_LEGEND_COLUMNS = 3


def _lay_out(fig: Any) -> None:
    """Margins from the text the figure holds: tick labels, axis labels, title, legend rows.

    Why not matplotlib's constrained layout: it draws every text twice to measure it, 70% of
    a report's plotting time (0.36 of 0.52 s for a detector's three plots), for margins the
    viewer's font decides anyway."""
    if len(fig.axes) != 1:
        return
    ax = fig.axes[0]
    width, height = fig.get_size_inches()
    ticks = [t.get_text() for t in ax.get_yticklabels()] or [""]
    widest = max(len(line) for t in ticks for line in (t.splitlines() or [""]))
    left = 2 * _PAD_IN + _TICK_IN + widest * _CHAR_IN * 8 / 9
    left += (_LINE_IN + _PAD_IN) * bool(ax.get_ylabel())
    bottom = _PAD_IN + _TICK_IN + _LINE_IN + (_LINE_IN + _PAD_IN) * bool(ax.get_xlabel())
    for legend in fig.legends:
        bottom += _LINE_IN * -(-len(legend.get_texts()) // _LEGEND_COLUMNS) + 2 * _PAD_IN
    top = 2 * _PAD_IN + _LINE_IN * bool(ax.get_title())
    fig.subplots_adjust(
        left=min(0.6, left / width),
        right=1 - 2 * _PAD_IN / width,
        bottom=min(0.6, bottom / height),
        top=max(0.4, 1 - top / height),
    )


_RC = {
    "svg.fonttype": "none",  # text stays text: small, searchable, selectable
    "svg.hashsalt": "qnn-ctx",  # the same data gives the same SVG
    "font.size": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.axisbelow": True,
}


def _svg(fig: Any, prefix: str) -> str:
    """The figure as inline SVG: no XML prolog or metadata, ids made unique within the page."""
    import matplotlib

    buffer = io.StringIO()
    with matplotlib.rc_context(_RC):
        _lay_out(fig)
        fig.savefig(buffer, format="svg", metadata={"Date": None, "Creator": None})
    text = buffer.getvalue()
    text = text[text.index("<svg") :]
    text = re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.S)
    text = re.sub(r'\s+xmlns(:xlink)?="[^"]*"', "", text)
    text = text.replace("xlink:href=", "href=")
    text = re.sub(r'\bid="([^"]+)"', rf'id="{prefix}-\1"', text)
    text = re.sub(r"url\(#([^)]+)\)", rf"url(#{prefix}-\1)", text)
    text = re.sub(r'href="#([^"]+)"', rf'href="#{prefix}-\1"', text)
    return text


def _short(name: str, limit: int = 44) -> str:
    return name if len(name) <= limit else name[: limit // 2 - 1] + "…" + name[-(limit // 2) :]


def fig_mixed_curve(mixed: dict[str, Any]) -> Any | None:
    """Worst output SNR vs the number of tensors raised to 16 bit (measured rounds)."""
    before = _finite(mixed.get("before_snr_db"))
    raised = _list(mixed.get("tensors"))
    if before is None or not raised:
        return None
    points = [(0, before)]
    for r in map(_dict, _list(mixed.get("rounds"))):
        n, snr = r.get("tensors"), _finite(r.get("snr_db"))
        if isinstance(n, int) and snr is not None:
            points.append((n, snr))
    after = _finite(mixed.get("after_snr_db"))
    chosen = (len(raised), after) if after is not None else None
    if chosen and chosen not in points:
        points.append(chosen)
    points.sort()
    fig = _figure(7.2, 3.2)
    ax = fig.add_subplot()
    xs, ys = zip(*points, strict=True)
    ax.plot(
        xs,
        ys,
        marker="o",
        linestyle=":",
        color=COLOURS["ctx_vs_qdq"],
        label="measured rounds (QDQ vs float, CPU EP)",
    )
    for x, y in points:
        ax.annotate(f"{y:.1f}", (x, y), textcoords="offset points", xytext=(0, 7), ha="center")
    if chosen:
        ax.plot(
            *chosen,
            marker="*",
            markersize=15,
            color="#2ca02c",
            linestyle="none",
            label=f"kept: {chosen[0]} tensor(s)",
        )
    target = _finite(mixed.get("target_snr_db"))
    if target is not None:
        _limit_line(ax.axhline, target, f"target {target:g} dB")
    ax.set_xlabel("tensors raised to 16 bit")
    ax.set_ylabel("worst output SNR vs float (dB)")
    ax.set_title("Mixed precision: output SNR vs tensors raised to 16 bit")
    low = min([*ys, target if target is not None else ys[0]])
    high = max([*ys, target if target is not None else ys[0]])
    ax.set_ylim(low - 0.12 * (high - low + 1), high + 0.2 * (high - low + 1))
    ax.set_xlim(-0.5, max(xs) * 1.05 + 0.5)
    _legend(fig, *ax.get_legend_handles_labels())
    return fig


def fig_sensitivity(mixed: dict[str, Any]) -> Any | None:
    """Each raised tensor's output SNR with only it at 8 bit, lowest (costliest) on top."""
    tensors = [
        (str(t.get("name", "?")), str(t.get("kind", "")), _finite(t.get("alone_snr_db")))
        for t in map(_dict, _list(mixed.get("tensors")))
    ]
    tensors = sorted((t for t in tensors if t[2] is not None), key=lambda t: t[2])
    if not tensors:
        return None
    shown = tensors[:_MAX_BARS]
    fig = _figure(7.2, 1.2 + 0.2 * len(shown))
    ax = fig.add_subplot()
    ys = range(len(shown))
    values = [t[2] for t in shown]
    colours = [COLOURS.get(t[1], "#7f7f7f") for t in shown]
    ax.barh(list(ys), values, color=colours, height=0.7)
    ax.set_yticks(list(ys), [_short(t[0]) for t in shown], fontsize=8)
    ax.invert_yaxis()
    for y, v in zip(ys, values, strict=True):
        _bar_label(ax, f"{v:.1f}", v, y)
    target = _finite(mixed.get("target_snr_db"))
    kinds = sorted({t[1] for t in shown})
    handles = [_patch(COLOURS.get(k, "#7f7f7f"), k) for k in kinds]
    if target is not None:
        handles.append(_limit_line(ax.axvline, target, f"target {target:g} dB"))
    lo, hi = min([*values, 0.0]), max([*values, target or 0.0])
    ax.set_xlim(lo - 0.08 * (hi - lo + 1), hi + 0.1 * (hi - lo + 1))
    ax.set_xlabel("output SNR vs float with only this tensor at 8 bit (dB): lower costs more")
    _legend(fig, handles, [h.get_label() for h in handles])
    more = f" (the {len(shown)} costliest of {len(tensors)})" if len(tensors) > len(shown) else ""
    ax.set_title(f"Sensitivity of the raised tensors{more}")
    ax.grid(axis="y", visible=False)
    return fig


def _bar_label(ax: Any, text: str, x: float, y: float) -> None:
    """``text`` just past the end of a horizontal bar (left of it for a negative one)."""
    ax.annotate(
        text,
        (x, y),
        textcoords="offset points",
        xytext=(3 if x >= 0 else -3, 0),
        ha="left" if x >= 0 else "right",
        va="center",
        fontsize=7,
    )


def _limit_line(draw: Any, value: float, label: str) -> Any:
    """A target or gate: ``draw`` is the axes' axvline or axhline."""
    return draw(value, color=COLOURS["target"], linestyle="--", linewidth=1, label=label)


def _legend(fig: Any, handles: list[Any], labels: list[str]) -> None:
    """Below the plot, never over a bar."""
    fig.legend(
        handles,
        labels,
        loc="lower center",
        bbox_to_anchor=(0.5, 0.0),
        ncols=min(_LEGEND_COLUMNS, len(handles)),
        fontsize=8,
        frameon=False,
    )


def _patch(colour: str, label: str, hatch: str = "") -> Any:
    from matplotlib.patches import Patch

    return Patch(facecolor=colour, label=label, hatch=hatch)


def _hbar_groups(
    ax: Any,
    groups: list[str],
    series: list[tuple[str, str, list[float | None]]],
    gate_db: float | None = None,
) -> None:
    """Grouped horizontal bars; inf is drawn hatched at the right edge, a missing value as n/a;
    ``gate_db``: a dashed line (the gate the first series must reach)."""
    finite = [v for _, _, vals in series for v in vals if v is not None and math.isfinite(v)]
    lo = min([*finite, 0.0])
    hi = max([*finite, 1.0])
    span = hi - lo
    cap = hi + 0.12 * span  # where an exact match (inf) is drawn
    height = 0.8 / max(1, len(series))
    for k, (label, colour, values) in enumerate(series):
        for g, value in enumerate(values):
            y = g + (k - (len(series) - 1) / 2) * height
            if value is None or math.isnan(value):
                ax.annotate("n/a", (0, y), fontsize=7, va="center", ha="left", color="#777")
                continue
            infinite = math.isinf(value)
            drawn = (cap if value > 0 else lo) if infinite else value
            ax.barh(
                y,
                drawn,
                height=height * 0.95,
                color=colour,
                hatch="//" if infinite else "",
                edgecolor="white" if infinite else colour,
                label=label if g == 0 else None,
            )
            text = ("inf (identical)" if value > 0 else "-inf") if infinite else f"{value:.1f}"
            _bar_label(ax, text, drawn, y)
    ax.set_yticks(range(len(groups)), groups, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(lo - 0.1 * span if lo < 0 else 0, cap + 0.22 * span)
    ax.grid(axis="y", visible=False)
    handles = [_patch(colour, label) for label, colour, _ in series]
    if gate_db:
        handles.append(_limit_line(ax.axvline, gate_db, f"gate: ctx vs QDQ >= {gate_db:g} dB"))
    _legend(ax.figure, handles, [h.get_label() for h in handles])


def fig_judge(htp: dict[str, Any]) -> Any | None:
    """The HTP judge's rounds: each candidate's ctx vs float on the HTP, and its QDQ on the CPU."""
    rounds = [_dict(r) for r in _list(htp.get("rounds"))]
    if not rounds:
        return None
    chosen = htp.get("chosen")
    groups = []
    for i, r in enumerate(rounds, 1):
        label = _short(str(r.get("label", "?")), 40)
        mark = "  [kept]" if r.get("label") == chosen else ""
        error = str(r.get("error") or "")
        # a remedy the CPU already showed could not win was never run on the HTP: no failure
        note = "  [not run]" if error.startswith("not run") else "  [error]" if error else ""
        groups.append(f"{i}. {label}{mark}{note}")
    series = [
        (
            "ctx vs float (HTP simulator)",
            COLOURS["ctx_vs_float"],
            [_num(r.get("ctx_vs_float_db")) for r in rounds],
        ),
        (
            "QDQ vs float (CPU EP)",
            COLOURS["qdq_vs_float"],
            [_num(r.get("qdq_vs_float_db")) for r in rounds],
        ),
    ]
    fig = _figure(7.2, 1.3 + 0.55 * len(rounds))
    ax = fig.add_subplot()
    _hbar_groups(ax, groups, series)
    ax.set_xlabel("worst output SNR vs the float model (dB)")
    ax.set_title("HTP judge: the candidates in the order tried")
    return fig


def _accuracy_groups(
    variants: list[dict[str, Any]],
) -> tuple[list[str], dict[str, list[float | None]]]:
    """(group labels, comparison -> values) over every variant, bucket and output."""
    groups: list[str] = []
    values: dict[str, list[float | None]] = {k: [] for k in COLOURS if "_vs_" in k}
    if any(_dict(v.get("validation")).get("closed_loop") for v in variants):
        values["closed_loop"] = []
    several = len(variants) > 1
    for v in variants:
        buckets = _dict(v.get("buckets"))
        per_bucket = len(buckets) > 1
        sources = (
            [(name, _dict(_dict(b).get("validation"))) for name, b in buckets.items()]
            if per_bucket
            else [("", _dict(v.get("validation")))]
        )
        for bucket, validation in sources:
            if not validation:
                continue
            outputs = list(_dict(validation.get("ctx_vs_qdq")))
            for output in outputs:
                if _dict(_dict(validation.get("ctx_vs_qdq")).get(output)).get("compared_as") == (
                    "labels"
                ):
                    continue  # compared by agreement, not SNR: in the table
                parts = [_short(output, 34)]
                if bucket:
                    parts.append(f"bucket {bucket}")
                if several:
                    parts.append(_where(v))
                groups.append("\n".join(parts))
                for key in values:
                    values[key].append(
                        _num(_dict(_dict(validation.get(key)).get(output)).get("snr_db"))
                    )
    return groups, values


def fig_accuracy(variants: list[dict[str, Any]], gate_db: float | None = None) -> Any | None:
    """ctx vs QDQ vs float per output (and bucket) and per variant, as grouped bars; the
    compile gate (ctx vs QDQ) as a line."""
    groups, values = _accuracy_groups(variants)
    if not groups:
        return None
    dropped = len(groups) - _MAX_GROUPS
    groups = groups[:_MAX_GROUPS]
    labels = {
        "ctx_vs_qdq": "ctx (HTP) vs QDQ (CPU)",
        "ctx_vs_float": "ctx (HTP) vs float (CPU)",
        "qdq_vs_float": "QDQ vs float (both CPU)",
        "closed_loop": "ctx (HTP) fed its own state vs float",
    }
    series = [(labels[k], COLOURS[k], vals[: len(groups)]) for k, vals in values.items()]
    lines = max(g.count("\n") + 1 for g in groups)
    fig = _figure(7.2, 1.4 + len(groups) * max(0.75, 0.3 * lines + 0.3))
    ax = fig.add_subplot()
    _hbar_groups(ax, groups, series, gate_db)
    ax.set_xlabel("SNR over the held-out samples (dB)")
    more = f" (first {len(groups)}; {dropped} more in the tables)" if dropped > 0 else ""
    ax.set_title(f"Accuracy per output: ctx vs QDQ vs float{more}")
    return fig


def _load_rows(
    variants: list[dict[str, Any]],
) -> list[tuple[str, float | None, float | None, float | None, float | None]]:
    """(variant, QDQ load s, ctx load s, every bucket's ctx s, ratio) per measured variant."""
    rows = []
    for v in variants:
        load = _dict(v.get("load"))
        qdq, ctx, every = (_finite(load.get(k)) for k in ("qdq_s", "ctx_s", "all_s"))
        if ctx is None and qdq is None:
            continue
        several = len(_dict(load.get("buckets"))) > 1
        rows.append((_where(v), qdq, ctx, every if several else None, _finite(load.get("ratio"))))
    return rows


def fig_load(variants: list[dict[str, Any]]) -> Any | None:
    """Session creation per variant: QDQ (QNN compiling online) vs ctx, on the simulator."""
    rows = _load_rows(variants)
    if not rows:
        return None
    fig = _figure(7.2, 1.5 + 0.6 * len(rows))
    ax = fig.add_subplot()
    series: list[tuple[str, str, list[float | None]]] = [
        (
            "QDQ model, QNN compiling online",
            COLOURS["qdq_load"],
            [r[1] * 1000 if r[1] is not None else None for r in rows],
        ),
        (
            "ctx model (largest bucket)",
            COLOURS["ctx_load"],
            [r[2] * 1000 if r[2] is not None else None for r in rows],
        ),
    ]
    if any(r[3] is not None for r in rows):
        series.append(
            (
                "ctx, every bucket",
                COLOURS["all_load"],
                [r[3] * 1000 if r[3] is not None else None for r in rows],
            )
        )
    groups = [f"{r[0]}" + (f"\nratio {r[4]:.0f}x" if r[4] else "") for r in rows]
    height = 0.8 / len(series)
    for k, (label, colour, vals) in enumerate(series):
        for g, value in enumerate(vals):
            if value is None:
                continue
            y = g + (k - (len(series) - 1) / 2) * height
            ax.barh(y, value, height=height * 0.95, color=colour, label=label if g == 0 else None)
            _bar_label(ax, f"{value:.1f} ms", value, y)
    ax.set_xscale("log")
    # Plain tick labels: the log axis's default "10^k" goes through mathtext, a third of this
    # figure's drawing time.
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    finite = [x for _, _, vals in series for x in vals if x]
    ax.set_xlim(min(finite) / 2, max(finite) * 4)
    ax.set_yticks(range(len(groups)), groups, fontsize=8)
    ax.invert_yaxis()
    ax.grid(axis="y", visible=False)
    handles = [_patch(c, lb) for lb, c, _ in series]
    _legend(fig, handles, [h.get_label() for h in handles])
    ax.set_xlabel("session creation on the build machine (ms, log scale)")
    ax.set_title("Load on the x86_64 HTP simulator: not device latency")
    return fig


def figure_inputs(data: ModelData) -> dict[str, tuple[Any, Callable[[], Any] | None]]:
    """Every plot of a model's page: name -> (the data it is drawn from, how to draw it, or
    None when a picture would not read faster than the table beside it: one judge round, one
    output of one variant, one variant's load times). Deciding that before matplotlib is
    imported keeps its import (0.3-0.4 s a stage) out of the builds that draw nothing."""
    mixed = _dict(data.quantize.get("mixed_precision"))
    htp = _dict(data.quantize.get("htp"))
    min_snr = _num(_dict(data.ctx.get("gates")).get("min_snr_db"))
    variants = data.variants
    compared = len(_accuracy_groups(variants)[0]) >= MIN_COMPARED
    loads = len(_load_rows(variants)) >= MIN_COMPARED
    rounds = len(_list(htp.get("rounds"))) >= MIN_COMPARED
    raised = bool(_list(mixed.get("tensors")))  # mixed precision that met its target at 8 bits
    return {
        "mixed_curve": (mixed, (lambda: fig_mixed_curve(mixed)) if raised else None),
        "sensitivity": (mixed, (lambda: fig_sensitivity(mixed)) if raised else None),
        "judge": (htp, (lambda: fig_judge(htp)) if rounds else None),
        "accuracy": (
            [variants, min_snr],
            (lambda: fig_accuracy(variants, min_snr)) if compared else None,
        ),
        "load": (variants, (lambda: fig_load(variants)) if loads else None),
    }


def plots_wanted(data: ModelData) -> bool:
    """Whether the page draws any plot it has not drawn before (its import is then worth
    starting early: ``preload_plotting``)."""
    return any(draw is not None for _, draw in figure_inputs(data).values())


# -- the model page -------------------------------------------------------------------------------


@dataclass
class _Page:
    """Sections of one model's page, and the plots rendered into it."""

    data: ModelData
    svgs: dict[str, str]
    plot_error: str = ""
    parts: list[str] = field(default_factory=list)

    def add(self, *html: str) -> None:
        self.parts.extend(h for h in html if h)

    def figure(self, name: str, caption: str) -> str:
        svg = self.svgs.get(name)
        if svg is None:
            return ""
        return f"<figure>{svg}<figcaption>{escape(caption)}</figcaption></figure>"


def _header(page: _Page) -> None:
    d, q = page.data, page.data.quantize
    version = q.get("version") or d.ctx.get("version") or ""
    inputs = _dict(q.get("inputs")) or _dict(d.record.get("inputs"))
    page.add(
        f'<nav><a href="../{INDEX_HTML}">all models</a>'
        + (f'<a href="{REPORT_MD}">report.md</a>' if (d.root / REPORT_MD).is_file() else "")
        + (
            f'<a href="ctx/{REPORT_MD}">ctx/report.md</a>'
            if ModelPaths(d.root).ctx_report.is_file()
            else ""
        )
        + "</nav>",
        f"<h1>{escape(d.name)} {escape(str(version))}</h1>",
    )
    facts = []
    if inputs.get("source"):
        sha = str(inputs.get("source_sha256", ""))[:16]
        facts.append(f"Source <code>{escape(str(inputs['source']))}</code> (sha256 {escape(sha)}…)")
    if q.get("config"):
        facts.append(f"config <code>{escape(str(q['config']))}</code>")
    tools = _dict(inputs.get("tools"))
    if tools:
        facts.append("tools " + escape(", ".join(f"{k} {v}" for k, v in tools.items())))
    if facts:
        page.add(f'<p class="sub">{"; ".join(facts)}.</p>')
    if q.get("graph_inputs"):
        page.add(
            f'<p class="sub">Inputs: {escape("; ".join(map(str, _list(q["graph_inputs"]))))}</p>'
        )
    if d.problems:
        page.add('<div class="note">' + escape("; ".join(d.problems)) + "</div>")
    if page.plot_error:
        page.add(f'<div class="note">{escape(page.plot_error)}</div>')
    page.add(_cards(d))


def _card(value: str, label: str, ok: bool | None = None) -> str:
    klass = "" if ok is None else (" ok" if ok else " bad")
    return f'<div class="card{klass}"><b>{escape(value)}</b><span>{escape(label)}</span></div>'


def _cards(d: ModelData) -> str:
    q = d.quantize
    verdict, ok = _quantize_verdict(d)
    cards = [_card(verdict, "quantize", ok)]
    worst = (
        _num(q.get("worst_snr_db"))
        if q
        else _num(_dict(d.record.get("summary")).get("worst_snr_db"))
    )
    if worst is not None:
        cards.append(_card(f"{_fmt(worst)} dB", "worst QDQ vs float (CPU)"))
    raised = _list(_dict(q.get("mixed_precision")).get("tensors"))
    if raised:
        cards.append(_card(str(len(raised)), "tensors raised to 16 bit"))
    htp = _dict(q.get("htp"))
    if _num(htp.get("ctx_vs_float_db")) is not None:
        cards.append(_card(f"{_fmt(htp['ctx_vs_float_db'])} dB", "HTP judge: ctx vs float"))
    for v in d.variants:
        text, passed = _variant_verdict(v)
        validation = _dict(v.get("validation"))
        coverage = _dict(v.get("coverage"))
        value = text
        if validation:
            value = f"{_fmt(validation.get('worst_snr_vs_float_db'))} dB"
        label = f"{_where(v)}: {text}"
        if coverage:
            label += f", {coverage.get('qnn_partitions', '-')} partition(s)"
        if validation:
            label += ", ctx vs float"
        cards.append(_card(value, label, passed))
    return '<div class="cards">' + "".join(cards) + "</div>"


def _steps_rows(steps: list[Any]) -> list[list[Any]]:
    rows = []
    for s in map(_dict, steps):
        details = [str(x) for x in _list(s.get("details"))]
        shown = "; ".join(details[:3]) + (
            f" … ({len(details) - 3} more)" if len(details) > 3 else ""
        )
        rows.append([s.get("step", "?"), len(details), shown])
    return rows


def _quantize_sections(page: _Page) -> None:
    q = page.data.quantize
    if not q:
        record = page.data.record
        if record:
            summary = _dict(record.get("summary"))
            page.add(
                "<h2>Quantization</h2>",
                _p(
                    "No quantize report.json beside the record (the QDQ models were made "
                    "elsewhere); from record.json:"
                ),
                _table(
                    [
                        "status",
                        "activations",
                        "weights",
                        "method",
                        "calibration",
                        "held-out",
                        "worst QDQ vs float dB",
                    ],
                    [
                        [
                            record.get("status"),
                            summary.get("activation_type"),
                            summary.get("weight_type"),
                            summary.get("method"),
                            summary.get("calibration_samples"),
                            summary.get("heldout_samples"),
                            summary.get("worst_snr_db"),
                        ]
                    ],
                ),
            )
        return
    own = _dict(q.get("prequantized"))
    page.add("<h2>Quantization</h2>")
    if own.get("kept"):
        page.add(
            _p(
                f"Pre-quantized model ({own.get('summary', '')}): its own scales, zero points and "
                "types are kept; QDQ vs float below measures only the rewrites for the HTP."
            ),
            _table(["rewrite", "changes", "what"], _steps_rows(_list(own.get("conversions")))),
        )
        jitter = _dict(own.get("input_jitter"))
        if jitter:
            shown = ", ".join(f"{k} {_fmt(_dict(a).get('snr_db'))} dB" for k, a in jitter.items())
            page.add(_p(f"Own rounding floor (inputs moved across their own rounding): {shown}."))
    else:
        if own:
            page.add(_p(f"Own quantization removed (requantize = true): {own.get('summary', '')}."))
        page.add(
            _table(
                [
                    "activations",
                    "weights",
                    "per-channel",
                    "method",
                    "calibration",
                    "held-out",
                    "chunk",
                    "merged tensors",
                ],
                [
                    [
                        q.get("activation_type"),
                        q.get("weight_type"),
                        q.get("per_channel"),
                        q.get("method"),
                        f"{q.get('calibration_samples', '-')} {q.get('calibration_kind', '')}",
                        q.get("heldout_samples"),
                        q.get("calibration_chunk"),
                        q.get("merged_tensors"),
                    ]
                ],
            )
        )
        rules = _dict(q.get("range_rules"))
        if rules:
            floors = [str(_dict(f).get("tensor")) for f in _list(rules.get("bias_floor"))]
            page.add(
                _p(
                    f"Calibrated ranges: {rules.get('clamped', 0)} cut to what their saturating "
                    f"readers can tell apart, {rules.get('widened', 0)} widened for unseen values, "
                    f"{len(floors)} widened so int32 biases fit, "
                    f"{rules.get('bias_corrections', 0)} bias correction(s), "
                    f"{len(_list(rules.get('mask_fills')))} attention-mask fill(s)."
                )
            )
        overrides = {**_dict(q.get("tensor_overrides")), **_dict(q.get("op_type_overrides"))}
        if overrides:
            page.add(_p("Overrides: " + ", ".join(f"{k} -> {v}" for k, v in overrides.items())))
    _prepare_section(page)
    _mixed_section(page)
    _judge_section(page)
    _buckets_section(page)
    _accuracy_section(page)


def _prepare_section(page: _Page) -> None:
    q = page.data.quantize
    steps = _list(q.get("prepare"))
    if not steps and not q.get("preparation_check"):
        return
    changed = [r for r in _steps_rows(steps) if r[1]]
    idle = [str(_dict(s).get("step")) for s in steps if not _list(_dict(s).get("details"))]
    page.add(
        "<h3>Graph preparation</h3>",
        _table(["step", "changes", "what"], changed)
        if changed
        else _p("No step changed the graph."),
        _p(f"{len(idle)} step(s) had nothing to do: {', '.join(idle)}.") if idle else "",
    )
    check = _dict(q.get("preparation_check"))
    if check:
        snr = check.get("snr_db")
        verdict = "passed" if check.get("passed") else "FAILED"
        text = (
            f"Prepared float vs {check.get('reference', 'source')}: {_fmt(snr)} dB on "
            f"{check.get('samples', '-')} held-out sample(s), floor {_fmt(check.get('min_snr_db'))} dB: "
            f"{verdict}."
            if snr is not None
            else f"Prepared vs source: not measured ({check.get('error', '')})."
        )
        page.add(_p(text))
        if _list(check.get("steps")):
            page.add(
                _p(
                    f"Each step's prefix vs the source (culprit: {check.get('culprit') or 'not found'}):"
                ),
                _table(
                    ["after step", "SNR vs source dB", "note"],
                    [
                        [_dict(s).get("step"), _dict(s).get("snr_db"), _dict(s).get("note")]
                        for s in _list(check.get("steps"))
                    ],
                ),
            )


def _mixed_section(page: _Page) -> None:
    q = page.data.quantize
    mixed = _dict(q.get("mixed_precision"))
    if not mixed:
        return
    tensors = [_dict(t) for t in _list(mixed.get("tensors"))]
    page.add("<h3>Mixed precision</h3>")
    if not tensors:
        page.add(
            _p(
                f"Nothing raised: worst SNR {_fmt(mixed.get('before_snr_db'))} dB against a target of "
                f"{_fmt(mixed.get('target_snr_db'))} dB."
            )
        )
        return
    where = (
        f" (chosen on bucket {mixed.get('bucket')}, applied to all)"
        if len(_list(q.get("buckets"))) > 1
        else ""
    )
    page.add(
        _p(
            f"Raised {len(tensors)} tensor(s) to 16 bit{where}: worst output SNR "
            f"{_fmt(mixed.get('before_snr_db'))} -> {_fmt(mixed.get('after_snr_db'))} dB "
            f"(target {_fmt(mixed.get('target_snr_db'))} dB). {mixed.get('measured', '-')} of "
            f"{mixed.get('candidates', '-')} candidate 8-bit tensors measured on "
            f"{mixed.get('analysis_samples', '-')} sample(s) in {_fmt(mixed.get('analysis_s'))} s."
        ),
        page.figure(
            "mixed_curve",
            "Each point is a measured round of the search (the QDQ model on the CPU EP against "
            "the float model); the star is the set kept.",
        ),
        page.figure(
            "sensitivity",
            "The output SNR with only that tensor at 8 bit (all others as kept): the shorter "
            "the bar, the more that tensor alone costs the output.",
        ),
    )
    rows = [[t.get("name"), t.get("kind"), t.get("to"), t.get("alone_snr_db")] for t in tensors]
    headers = ["tensor", "kind", "to", "output SNR alone (dB)"]
    if len(rows) > 12:
        page.add(_details(f"All {len(rows)} raised tensors", _table(headers, rows)))
    else:
        page.add(_table(headers, rows))


def _judge_section(page: _Page) -> None:
    htp = _dict(page.data.quantize.get("htp"))
    if not htp:
        return
    page.add("<h3>Precision judged on the HTP</h3>", _p(str(htp.get("reason", "")) + "."))
    rounds = [_dict(r) for r in _list(htp.get("rounds"))]
    if rounds:
        page.add(
            page.figure(
                "judge",
                "Each candidate compiled for the target and run on the HTP simulator over "
                "held-out samples; the kept one is marked.",
            ),
            _table(
                [
                    "#",
                    "candidate",
                    "QDQ vs float (CPU) dB",
                    "ctx vs float (HTP) dB",
                    "ctx vs QDQ dB",
                    "partitions",
                    "CPU nodes",
                    "s",
                    "",
                ],
                [
                    [
                        i,
                        r.get("label"),
                        r.get("qdq_vs_float_db"),
                        r.get("ctx_vs_float_db"),
                        r.get("ctx_vs_qdq_db"),
                        "-" if r.get("error") else r.get("partitions"),  # it measured nothing
                        "-" if r.get("error") else r.get("cpu_nodes"),
                        r.get("seconds"),
                        r.get("error") or ("kept" if r.get("label") == htp.get("chosen") else ""),
                    ]
                    for i, r in enumerate(rounds, 1)
                ],
            ),
        )
    divergence = _dict(htp.get("divergence"))
    if divergence:
        page.add(
            _p(
                f"First divergence between the HTP and the CPU QDQ model: {divergence.get('tensor')} "
                f"from {divergence.get('op_type')} {divergence.get('node')}, "
                f"{_fmt(divergence.get('snr_db'))} dB"
                + (
                    f" (among {divergence.get('exposed')} of {divergence.get('exposable')} "
                    "activations, spread over the graph: the locator's memory budget)."
                    if 0 < (divergence.get("exposed") or 0) < (divergence.get("exposable") or 0)
                    else "."
                )
            )
        )
    page.add(_ul(map(str, _list(htp.get("remedies")))))
    if htp.get("whole_float16"):
        page.add(_p("Kept: the whole model runs in fp16 on the HTP (it is not quantized)."))
    elif _list(htp.get("float16")):
        names = ", ".join(map(str, _list(htp["float16"])))
        page.add(_p(f"Kept in float16 (fp16 on the HTP): {names}."))


def _buckets_section(page: _Page) -> None:
    q = page.data.quantize
    buckets = [_dict(b) for b in _list(q.get("buckets"))]
    if len(buckets) <= 1:
        return
    rows = [
        [
            b.get("name"),
            "; ".join(f"{k} {v}" for k, v in _dict(b.get("shapes")).items()),
            b.get("calibration_samples"),
            b.get("calibrated_with_smaller"),
            f"{b.get('heldout_samples', '-')}"
            + (" (calibration)" if b.get("heldout_from_calibration") else ""),
            _worst_section(b.get("qdq_vs_float")),
            b.get("qdq_bytes"),
        ]
        for b in buckets
    ]
    pads = [
        [
            _dict(p).get("dim"),
            f"{_dict(p).get('input')}[{_dict(p).get('axis')}]",
            _dict(p).get("value"),
            _dict(p).get("side"),
        ]
        for p in _list(q.get("pads"))
    ]
    crops = [
        [_dict(c).get("output"), _dict(c).get("axis"), _dict(c).get("dim")]
        for c in _list(q.get("crops"))
    ]
    weights = _dict(q.get("weights"))
    page.add(
        "<h3>Buckets</h3>",
        _table(
            [
                "bucket",
                "shapes",
                "calibration samples",
                "padded from smaller",
                "held-out run",
                "worst QDQ vs float dB",
                "QDQ bytes",
            ],
            rows,
        ),
        _p(
            "held-out run: a bucket runs every held-out sample that fits it, padded, so each "
            f"of the {q.get('heldout_samples', '-')} held-out samples counts in its own bucket "
            "and in every larger one."
        ),
        _table(["padded dim", "axis", "value", "side"], pads) if pads else "",
        _table(["cropped output", "axis", "follows"], crops) if crops else "",
        _p(
            f"Weights: {weights.get('shared_initializers', '-')} initializers "
            f"({_fmt(weights.get('shared_bytes'))} bytes) identical in every bucket; "
            f"{len(_list(weights.get('bucket_specific')))} bucket-specific."
        )
        if weights
        else "",
    )


def _accuracy_section(page: _Page) -> None:
    q = page.data.quantize
    buckets = [_dict(b) for b in _list(q.get("buckets"))]
    largest = _dict(buckets[-1].get("qdq_vs_float")) if buckets else {}
    e2e = _dict(q.get("end_to_end"))
    vs_source, float_source = _dict(e2e.get("qdq_vs_source")), _dict(e2e.get("float_vs_source"))
    outputs = list(largest) or list(vs_source)
    if not outputs:
        return

    def figure(section: dict[str, Any], out: str) -> Any:
        a = _dict(section.get(out))
        if a.get("compared_as") == "labels":
            return f"{100 * (_num(a.get('agreement')) or 0):.1f}% agree"
        if a.get("compared_as") == BELOW_STEP:
            return f"below its step (max abs {_num(a.get('max_abs')) or 0:.3g})"
        if a.get("compared_as") == PICKED:
            return f"picked by rank ({_num(a.get('snr_db')) or 0:.2f} dB, not gated)"
        if a.get("compared_as") == MATCHED:
            return f"{_num(a.get('snr_db')) or 0:.2f} (rows matched by pick)"
        return a.get("snr_db")

    def fixed(out: str, key: str, pattern: str) -> str | None:
        value = _finite(_dict(largest.get(out)).get(key))
        return pattern.format(value) if value is not None else None

    rows = [
        [
            out,
            figure(largest, out),
            fixed(out, "max_abs", "{:.4g}"),
            fixed(out, "cosine", "{:.5f}"),
            figure(vs_source, out),
            figure(float_source, out),
        ]
        for out in outputs
    ]
    page.add(
        f"<h3>Accuracy on held-out samples (CPU EP, {e2e.get('samples', '-')} at their true size)</h3>",
        _table(
            [
                "output",
                "QDQ vs float dB",
                "max abs",
                "cosine",
                "QDQ vs source dB",
                "prepared float vs source dB",
            ],
            rows,
            digits=2,
        ),
    )
    if e2e.get("error"):
        page.add(_p(f"The source-model comparison could not run: {e2e['error']}"))


def _compile_sections(page: _Page) -> None:
    d = page.data
    if not d.variants and not d.ctx:
        page.add("<h2>Compile</h2>", _p("Not compiled yet (python -m pipeline compile)."))
        return
    gates = _dict(d.ctx.get("gates"))
    page.add("<h2>Compile: EP-context variants</h2>")
    if gates:
        allowed = _list(gates.get("allowed_cpu_ops"))
        snr = _num(gates.get("min_snr_db")) or 0
        page.add(
            _p(
                f"Gates: every compute node on QNN in <= {gates.get('max_partitions', '-')} "
                "partition(s)"
                + (f" (allowed on CPU: {', '.join(map(str, allowed))})" if allowed else "")
                + (f"; worst ctx vs QDQ SNR >= {snr:g} dB." if snr > 0 else "; no SNR gate.")
            )
        )
    if d.ctx.get("quantize_status") not in (None, "ok"):
        page.add('<div class="note">These QDQ models did not pass the quantize gate.</div>')
    rows = []
    for v in d.variants:
        coverage, validation = _dict(v.get("coverage")), _dict(v.get("validation"))
        load = _dict(v.get("load"))
        text, passed = _variant_verdict(v)
        primary = _dict(_list(v.get("sets"))[0]) if _list(v.get("sets")) else {}
        ops = ", ".join(f"{op} x{n}" for op, n in _dict(coverage.get("cpu_ops")).items())
        rows.append(
            [
                v.get("toolchain"),
                v.get("qnn_sdk"),
                v.get("target"),
                _badge(text + (" (stale)" if _stale(d, v) else ""), passed),
                coverage.get("qnn_partitions"),
                ops or (0 if coverage else None),
                validation.get("worst_snr_db"),
                validation.get("worst_snr_vs_float_db"),
                validation.get("samples"),
                (_num(primary.get("total_bytes")) or 0) / 1e6 if primary else None,
                v.get("compile_time_s") if v.get("status") == "ok" else None,
                _ms(load.get("qdq_s")),
                _ms(load.get("ctx_s")),
                load.get("ratio"),
            ]
        )
    page.add(
        _table(
            [
                "toolchain",
                "QNN SDK",
                "target",
                "result",
                "partitions",
                "CPU nodes",
                "ctx vs QDQ dB",
                "ctx vs float dB",
                "samples",
                "ctx MB",
                "compile s",
                "load QDQ ms (sim)",
                "load ctx ms (sim)",
                "load ratio (sim)",
            ],
            rows,
        )
    )
    if any(_stale(d, v) for v in d.variants):
        page.add(
            '<div class="note">stale: compiled from other QDQ models than the current quantize '
            "record names; compile again.</div>"
        )
    page.add(
        page.figure(
            "accuracy",
            "The ctx model on the QNN HTP backend (the x86_64 HTP simulator here) against the "
            "QDQ and the float model on the CPU EP, per output over held-out samples; "
            "hatched bars are exact matches (infinite SNR).",
        )
    )
    _variant_buckets(page)
    _load_section(page)
    _sizes_section(page)
    _problems(page)


def _ms(seconds: Any) -> float | None:
    value = _finite(seconds)
    return value * 1000 if value is not None else None


def _variant_buckets(page: _Page) -> None:
    rows = []
    for v in page.data.variants:
        loads = _dict(_dict(v.get("load")).get("buckets"))
        buckets = _dict(v.get("buckets"))
        if len(buckets) <= 1:
            continue
        for name, outcome in buckets.items():
            coverage = _dict(_dict(outcome).get("coverage"))
            validation = _dict(_dict(outcome).get("validation"))
            ok = bool(coverage.get("passed")) and bool(validation.get("passed"))
            rows.append(
                [
                    _where(v),
                    name,
                    _badge("pass" if ok else "FAIL", ok),
                    coverage.get("qnn_partitions"),
                    len(_list(coverage.get("cpu_compute_nodes"))),
                    validation.get("worst_snr_db"),
                    validation.get("worst_snr_vs_float_db"),
                    validation.get("samples"),
                    _ms(loads.get(name)),
                ]
            )
    if rows:
        page.add(
            "<h3>Per bucket</h3>",
            _table(
                [
                    "variant",
                    "bucket",
                    "result",
                    "partitions",
                    "CPU nodes",
                    "ctx vs QDQ dB",
                    "ctx vs float dB",
                    "samples",
                    "load ctx ms (sim)",
                ],
                rows,
            ),
        )


def _load_section(page: _Page) -> None:
    if not any(_dict(v.get("load")) for v in page.data.variants):
        return
    runs = {_dict(v.get("load")).get("runs") for v in page.data.variants} - {None}
    page.add(
        "<h3>Load times</h3>",
        f'<div class="note">Load times and ratios are {escape(SIMULATOR_NOTE)}.</div>',
        page.figure(
            "load",
            "Session creation of the EP-context model (min of "
            f"{', '.join(map(str, sorted(runs))) or '-'} run(s)) against the QDQ model's with QNN "
            "compiling it online, on the build machine. A device's NPU loads differently: these "
            "are not device latencies."
            + "".join(
                f" {_where(v)}: the QDQ load is timed by {how}."
                for v in page.data.variants
                if (how := _dict(v.get("load")).get("qdq_timed_by"))
            ),
        ),
    )
    errors = [
        f"{_where(v)}: {_dict(v.get('load')).get('qdq_error')}"
        for v in page.data.variants
        if _dict(v.get("load")).get("qdq_error")
    ]
    page.add(_ul(errors))


def _sizes_section(page: _Page) -> None:
    d = page.data
    q = d.quantize
    rows: list[list[Any]] = []
    if q:
        buckets = [_dict(b) for b in _list(q.get("buckets"))]
        rows.append(["source model", "", q.get("source_bytes")])
        rows.append(
            [
                "prepared float",
                "all buckets",
                sum(int(_num(b.get("float_bytes")) or 0) for b in buckets),
            ]
        )
        rows.append(
            ["QDQ", "all buckets", sum(int(_num(b.get("qdq_bytes")) or 0) for b in buckets)]
        )
    for v in d.variants:
        for s in map(_dict, _list(v.get("sets"))):
            rows.append([f"ctx {s.get('kind', '')}", _where(v), s.get("total_bytes")])
        memory = _dict(v.get("memory"))
        if memory:
            before = _num(memory.get("rss_before_bytes")) or 0
            after = _num(memory.get("rss_all_buckets_bytes")) or 0
            rows.append(
                [
                    f"RSS added by opening every bucket ({memory.get('set', '')})",
                    _where(v),
                    int(after - before),
                ]
            )
    if rows:
        page.add("<h3>Sizes</h3>", _table(["what", "where", "bytes"], rows))


def _problems(page: _Page) -> None:
    notes = []
    for v in page.data.variants:
        where = _where(v)
        error = _dict(v.get("error"))
        if error and error.get("kind") != "unavailable":
            extra = "; ".join(
                f"{k}: {', '.join(map(str, _list(error.get(k))[:10]))}"
                for k in ("nodes", "op_types", "qnn_error_codes")
                if _list(error.get(k))
            )
            notes.append(
                f"{where}: {error.get('kind')} in step {error.get('stage')}: "
                f"{str(error.get('message', ''))[:800]}" + (f" ({extra})" if extra else "")
            )
        coverage = _dict(v.get("coverage"))
        notes += [f"{where} coverage: {p}" for p in _list(coverage.get("problems"))]
        cpu = [_dict(n) for n in _list(coverage.get("cpu_compute_nodes"))]
        if cpu:
            names = ", ".join(f"{n.get('name')} ({n.get('op_type')})" for n in cpu[:12])
            notes.append(f"{where}: on the CPU: {names}" + (" …" if len(cpu) > 12 else ""))
        if v.get("shared_load_probe"):
            notes.append(
                f"{where}: {v['shared_load_probe']}; validated with the {v.get('validated_with')} contexts"
            )
    if notes:
        page.add("<h3>Problems</h3>", _ul(notes))


def _gates(page: _Page) -> None:
    d, q = page.data, page.data.quantize
    rows = []
    if q:
        gate = _num(q.get("min_snr_db")) or 0
        rows.append(
            [
                "quantize: worst QDQ vs float SNR",
                f">= {gate:g} dB" if gate else "off",
                f"{_fmt(q.get('worst_snr_db'))} dB",
                _badge(*_quantize_verdict(d)),
            ]
        )
        check = _dict(q.get("preparation_check"))
        if check:
            ok = check.get("passed")
            rows.append(
                [
                    "quantize: prepared float vs source",
                    f">= {_fmt(check.get('min_snr_db'))} dB",
                    f"{_fmt(check.get('snr_db'))} dB",
                    _badge("pass" if ok else "FAIL", bool(ok)),
                ]
            )
    for v in d.variants:
        coverage, validation = _dict(v.get("coverage")), _dict(v.get("validation"))
        if coverage:
            ok = bool(coverage.get("passed"))
            rows.append(
                [
                    f"{_where(v)}: coverage",
                    coverage.get("gate", ""),
                    f"{coverage.get('qnn_partitions', '-')} partition(s), "
                    f"{len(_list(coverage.get('cpu_compute_nodes')))} CPU node(s)",
                    _badge("pass" if ok else "FAIL", ok),
                ]
            )
        if validation:
            ok = bool(validation.get("passed"))
            rows.append(
                [
                    f"{_where(v)}: validation",
                    validation.get("gate", ""),
                    f"{_fmt(validation.get('worst_snr_db'))} dB ctx vs QDQ",
                    _badge("pass" if ok else "FAIL", ok),
                ]
            )
    if rows:
        page.add("<h2>Gates</h2>", _table(["gate", "setting", "measured", "verdict"], rows))


def _timings(page: _Page) -> None:
    d, q = page.data, page.data.quantize
    timings = [(str(k), _finite(t)) for k, t in _dict(q.get("timings_s")).items()]
    timings = [(k, t) for k, t in timings if t is not None]
    compile_times = [(f"compile {_where(v)}", _finite(v.get("compile_time_s"))) for v in d.variants]
    timings += [(k, t) for k, t in compile_times if t is not None]
    if timings:
        largest = max(t for _, t in timings)
        page.add(
            "<h2>Timings</h2>",
            _table(
                ["step", "seconds"], [[k, _bar_cell(t, largest, f"{t:.2f}")] for k, t in timings]
            ),
            _p("Wall time on the build machine; compile includes validation on the HTP simulator."),
        )


def render_model(
    data: ModelData, svgs: dict[str, str], plot_error: str = "", digest: str = ""
) -> str:
    """The HTML page of one model from its data and its rendered plots."""
    page = _Page(data, svgs, plot_error)
    _header(page)
    if data.quantize.get("status") == "failed":
        _failure(page)
        version = data.ctx.get("version") or ""
        return _page(f"{data.name} {version}: build report", "\n".join(page.parts), digest)
    _gates(page)
    _quantize_sections(page)
    _compile_sections(page)
    _timings(page)
    version = data.quantize.get("version") or data.ctx.get("version") or ""
    return _page(f"{data.name} {version}: build report", "\n".join(page.parts), digest)


FIGURES = "figures"  # build/<model>/figures/<name>-<digest>.svg: plots drawn already


@functools.cache
def _code_digest() -> str:
    """This module's digest: what a page and each plot also depend on (read once a process)."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def _failure(page: _Page) -> None:
    """A quantize run that stopped on an error: the error, its tip, how far it got, the source
    model's facts and, for a fault in the pipeline, its traceback (report.json's fields)."""
    q = page.data.quantize
    page.add(
        "<h2>Quantize stopped with an error</h2>",
        f'<div class="note"><b>{escape(str(q.get("error_type", "")))}</b>: '
        f"{escape(str(q.get('error', '')))}</div>",
    )
    if q.get("tip"):
        page.add(_p(f"Tip: {q['tip']}"))
    done = _dict(q.get("steps_done"))
    page.add(
        _p(
            "Steps finished before it: " + ", ".join(f"{k} ({_fmt(v)} s)" for k, v in done.items())
            if done
            else "It stopped in the first step (prepare)."
        )
    )
    source = _dict(q.get("source"))
    if source:
        ops = ", ".join(f"{k} ×{v}" for k, v in _dict(source.get("op_types")).items())
        rows = [
            ("opsets", ", ".join(f"{k} {v}" for k, v in _dict(source.get("opsets")).items())),
            ("producer", source.get("producer") or "not stated"),
            ("nodes", source.get("nodes")),
            ("inputs", "; ".join(map(str, _list(source.get("inputs"))))),
            ("outputs", "; ".join(map(str, _list(source.get("outputs"))))),
            ("ops", ops),
            ("already quantized", source.get("quantization") or "no"),
        ]
        page.add("<h2>The source model</h2>", _table(["", ""], rows))
    if q.get("traceback"):
        page.add(
            "<h2>Where it failed</h2>",
            _p("A fault in the pipeline, not in the model or config: please report it."),
            f"<pre>{escape(str(q['traceback']))}</pre>",
        )


def _render_svgs(data: ModelData) -> tuple[dict[str, str], str]:
    """(name -> inline SVG, why there are none); a plot that fails is left out, not fatal.

    Each plot is kept under ``figures/`` by the digest of what it is drawn from (and of this
    module): compile redraws only its own plots, not those of the quantize report it did not
    change (3 of 5, half a second of matplotlib per stage)."""
    if not plots_available():
        return {}, PLOTS_MISSING
    svgs: dict[str, str] = {}
    failed: list[str] = []
    folder = data.root / FIGURES
    code = _code_digest()
    kept: set[Path] = set()
    for name, (inputs, draw) in figure_inputs(data).items():
        if draw is None:  # nothing to compare: no file, and no matplotlib import for it
            continue
        key = hashlib.sha256(
            json.dumps([code, name, inputs], sort_keys=True, default=str).encode()
        ).hexdigest()[:32]
        cached = folder / f"{name}-{key}.svg"
        kept.add(cached)
        if cached.is_file():
            text = cached.read_text("utf-8")
            if text:  # empty: the data allows no such plot
                svgs[name] = text
            continue
        try:
            import matplotlib

            with matplotlib.rc_context(_RC):
                fig = draw()
                text = "" if fig is None else _svg(fig, f"fig-{name}")
        except Exception as exc:  # a plot is a convenience: its table is on the page
            failed.append(f"{name} ({type(exc).__name__}: {exc})")
            continue
        if text:
            svgs[name] = text
        folder.mkdir(exist_ok=True)
        write_text(cached, text)
    for stale in folder.glob("*.svg") if folder.is_dir() else []:
        if stale not in kept:
            stale.unlink(missing_ok=True)
    return svgs, ("Plots not drawn: " + "; ".join(failed)) if failed else ""


def _digest(root: Path) -> str:
    """What a page depends on: its input files, this module, and whether it can plot."""
    h = hashlib.sha256(_code_digest().encode())
    h.update(b"plots" if plots_available() else b"tables")
    for path in _input_files(root):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _current_digest(page: Path) -> str:
    try:
        with page.open(encoding="utf-8") as handle:
            head = handle.read(4096)
    except OSError:
        return ""
    found = re.search(rf'<meta name="{_DIGEST_META}" content="([0-9a-f]+)">', head)
    return found.group(1) if found else ""


def write_model_html(root: Path) -> Path:
    """``build/<model>/report.html``, re-rendered only when what it shows changed."""
    target = root / REPORT_HTML
    digest = _digest(root)
    if target.is_file() and _current_digest(target) == digest:
        return target
    data = load_model(root)
    failed = data.quantize.get("status") == "failed"  # nothing to plot: an error and its context
    if (data.quantize or data.ctx or data.variants) and not failed:
        svgs, plot_error = _render_svgs(data)
    else:
        svgs, plot_error = {}, ""
    write_text(target, render_model(data, svgs, plot_error, digest))
    return target


# -- the index of a run ---------------------------------------------------------------------------


def render_index(models: list[ModelData], digest: str = "") -> str:
    """One row per model and variant: status, partitions, SNRs, a link to the model's page."""
    rows = []
    failures = 0
    for d in models:
        q = d.quantize
        verdict, ok = _quantize_verdict(d)
        failures += ok is False
        summary = _dict(d.record.get("summary"))
        worst = q.get("worst_snr_db") if q else summary.get("worst_snr_db")
        raised = len(_list(_dict(q.get("mixed_precision")).get("tensors")))
        judge = _dict(q.get("htp")).get("ctx_vs_float_db")
        name = escape(d.name)
        if (d.root / REPORT_HTML).is_file():
            name = f'<a href="{escape(d.root.name)}/{REPORT_HTML}">{name}</a>'
        model_cells = [
            _Raw(f"<b>{name}</b>"),
            q.get("version") or d.ctx.get("version"),
            _badge(verdict, ok),
            worst,
            raised or "-",
            judge,
        ]
        variants = d.variants or [{}]
        for i, v in enumerate(variants):
            coverage, validation = _dict(v.get("coverage")), _dict(v.get("validation"))
            if v:
                text, passed = _variant_verdict(v)
                failures += not passed
                status: Any = _badge(text + (" (stale)" if _stale(d, v) else ""), passed)
            else:
                status = _badge("not compiled", None)
            cells = [
                _where(v) if v else "-",
                status,
                coverage.get("qnn_partitions"),
                len(_list(coverage.get("cpu_compute_nodes"))) if coverage else None,
                validation.get("worst_snr_db"),
                validation.get("worst_snr_vs_float_db"),
                _ms(_dict(v.get("load")).get("ctx_s")),
                _dict(v.get("load")).get("ratio"),
            ]
            rows.append((model_cells if i == 0 else None, len(variants), cells))
    headers = [
        "model",
        "version",
        "quantize",
        "QDQ vs float dB",
        "raised to 16 bit",
        "HTP judge ctx vs float dB",
        "variant",
        "compile",
        "partitions",
        "CPU nodes",
        "ctx vs QDQ dB",
        "ctx vs float dB",
        "load ctx ms (sim)",
        "load ratio (sim)",
    ]
    body = []
    for model_cells, span, cells in rows:
        tr = []
        if model_cells is not None:
            tr += [f'<td rowspan="{span}"{_num_class(c)}>{_cell(c)}</td>' for c in model_cells]
        tr += [f"<td{_num_class(c)}>{_cell(c)}</td>" for c in cells]
        body.append("<tr>" + "".join(tr) + "</tr>")
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    table = f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
    summary = (
        f"{len(models)} model(s); {failures} failed gate(s) or variant(s)."
        if models
        else "No model has been built yet."
    )
    body_html = (
        "<h1>Build reports</h1>"
        + _p(summary)
        + table
        + f'<p class="sub">SNRs over held-out samples: QDQ vs float on the CPU EP, ctx on the '
        f"HTP simulator vs QDQ and float. Load times and ratios are {escape(SIMULATOR_NOTE)}.</p>"
    )
    return _page("Build reports", body_html, digest)


def _num_class(value: Any) -> str:
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    return ' class="num"' if numeric or (isinstance(value, str) and _num(value) is not None) else ""


def write_index(build: Path) -> Path:
    """``build/index.html`` from whatever model folders hold a report now, re-rendered only
    when one of their reports changed: every stage of every model writes it, and reading every
    model's reports grows with the run (19 models: a quarter of a rerun's work)."""
    roots = sorted(p for p in build.iterdir() if p.is_dir() and not p.name.startswith("."))
    h = hashlib.sha256(b"index")
    for root in roots:
        h.update(root.name.encode() + b"\0" + _digest(root).encode())
    digest = h.hexdigest()
    target = build / INDEX_HTML
    if target.is_file() and _current_digest(target) == digest:
        return target
    models = [data for data in map(load_model, roots) if data.built]
    write_text(target, render_index(models, digest))
    return target


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def write_html_reports(model_root: Path, out: Callable[[str], None] | None = None) -> Path | None:
    """The model's ``report.html`` and the run's ``index.html``; returns the page (None if it
    could not be written). Never raises: a report must not fail the build it reports on, so a
    failure is one warning line through ``out`` (stderr by default)."""
    say = out or _stderr
    page = None
    try:
        page = write_model_html(Path(model_root))
    except Exception as exc:  # a build's outcome never depends on its pretty page
        say(
            f"WARNING: {Path(model_root).name}: report.html not written: {type(exc).__name__}: {exc}"
        )
    try:
        write_index(Path(model_root).parent)
    except Exception as exc:
        say(f"WARNING: index.html not written: {type(exc).__name__}: {exc}")
    return page
