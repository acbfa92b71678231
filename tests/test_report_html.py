"""report.html per model and build/index.html: drawn from the reports of real stage runs.

The models are the small seeded graphs of compile_fixtures; the quantize stage, the HTP judge and
the compile stage run for real (onnxruntime, the QNN EP and its HTP simulator).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import onnx
import pytest
from compile_fixtures import IR_VERSION, build_inputs, model_paths, shape_tail, small_cnn
from onnx import helper

from pipeline import report_html
from pipeline.__main__ import main
from pipeline.core.layout import INDEX_HTML, REPORT_HTML

VOID = {"meta", "br", "hr", "img", "input", "link", "wbr", "col", "area", "base", "source"}
PLOTS = ("mixed_curve", "sensitivity", "judge", "accuracy", "load")


class _Balance(HTMLParser):
    """Every element that is opened is closed, in order (a page a browser reads as written)."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
            return
        self.stack.pop()


def check_self_contained(page: Path) -> str:
    """The page's text, after checking it needs nothing outside itself and is well nested."""
    text = page.read_text(encoding="utf-8")
    lowered = text.lower()
    for outside in ("http://", "https://", "src=", "<script", "<link", "@import", "//cdn"):
        assert outside not in lowered, f"{page} refers outside itself: {outside}"
    # Every reference inside an SVG points into the page itself.
    assert all(
        ref.startswith("#")
        for ref in re.findall(r'href="([^"]*)"', text)
        if ".html" not in ref and ".md" not in ref
    )
    assert all(ref.startswith("#") for ref in re.findall(r"url\(([^)]*)\)", text))
    ids = re.findall(r'\bid="([^"]+)"', text)
    assert len(ids) == len(set(ids)), "element ids repeat across the inline plots"
    parser = _Balance()
    parser.feed(text)
    parser.close()
    assert not parser.errors and parser.stack == [], (parser.errors, parser.stack)
    return text


def plots_in(text: str) -> set[str]:
    return {name for name in PLOTS if f'id="fig-{name}-' in text}


def compile_cli(root: Path, *configs: Path) -> int:
    return main(["compile", "--artifacts", str(root / "artifacts"), *map(str, configs)])


# -- a whole build: quantize with mixed precision and the HTP judge, then compile -----------------


def write_quantize_config(root: Path) -> Path:
    """small_cnn at 8-bit activations with a 60 dB target: mixed precision raises tensors; two
    targets, so the page's accuracy and load plots compare two variants."""
    rng = np.random.default_rng(0)
    model = helper.make_model(small_cnn(rng), opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = IR_VERSION
    onnx.save(model, str(root / "cnn.onnx"))
    config = root / "cnn.toml"
    config.write_text(
        '[model]\nname = "cnn"\nversion = "1.0.0"\nsource = "cnn.onnx"\n'
        '[calibration]\nkind = "random"\nsamples = 16\n'
        '[quantization]\nactivation_type = "uint8"\nweight_type = "uint8"\nper_channel = false\n'
        'target_snr_db = 60.0\njudge = "htp"\n'
        '[compile]\nmin_snr_db = 10.0\ntargets = ["snapdragon-x-elite", "snapdragon-8-gen-3"]\n',
        encoding="utf-8",
    )
    return config


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("onnxruntime_qnn")
    root = tmp_path_factory.mktemp("html_full")
    config = write_quantize_config(root)
    assert main(["quantize", "--artifacts", str(root / "artifacts"), str(config)]) == 0
    assert compile_cli(root, config) == 0
    return root


@pytest.mark.qnn
def test_whole_build_page_has_every_plot_and_section(full: Path) -> None:
    paths = model_paths(full, "cnn")
    text = check_self_contained(paths.root / REPORT_HTML)
    report = json.loads((paths.root / "report.json").read_text())
    mixed = report["mixed_precision"]
    assert mixed["tensors"] and mixed["rounds"]  # the data the curve and the bars need
    assert report["htp"]["judge"] == "htp" and len(report["htp"]["rounds"]) == 1
    # one judge round is a table row, not a plot; every other plot compares two or more
    assert plots_in(text) == set(PLOTS) - {"judge"}
    for heading in (
        "Gates",
        "Quantization",
        "Graph preparation",
        "Mixed precision",
        "Precision judged on the HTP",
        "Accuracy on held-out samples",
        "Compile: EP-context variants",
        "Load times",
        "Sizes",
        "Timings",
    ):
        assert f">{heading}" in text, heading
    assert "not device latency" in text and "HTP simulator" in text
    for tensor in mixed["tensors"]:  # every raised tensor, in the table and the bars
        assert f"<td>{tensor['name']}</td>" in text
    variant = json.loads(
        next(paths.ctx.glob("*/snapdragon-x-elite/variant.json")).read_text(encoding="utf-8")
    )
    assert f"{variant['validation']['worst_snr_db']:.1f}" in text
    index = check_self_contained(full / "artifacts" / "build" / INDEX_HTML)
    assert f'href="cnn/{REPORT_HTML}"' in index and "not device latency" in index
    # The compile report's Markdown says where its load times come from.
    assert "(sim)" in (paths.ctx / "report.md").read_text(encoding="utf-8")


@pytest.mark.qnn
def test_page_is_redrawn_only_when_what_it_shows_changes(full: Path) -> None:
    paths = model_paths(full, "cnn")
    page = paths.root / REPORT_HTML
    index = full / "artifacts" / "build" / INDEX_HTML
    before, index_before = page.stat().st_mtime_ns, index.stat().st_mtime_ns
    config = full / "cnn.toml"
    assert main(["quantize", "--artifacts", str(full / "artifacts"), str(config)]) == 0
    assert compile_cli(full, config) == 0  # both up to date: the pages are left as they are
    assert page.stat().st_mtime_ns == before and index.stat().st_mtime_ns == index_before
    variant = next(paths.ctx.glob("*/snapdragon-x-elite/variant.json"))
    saved = variant.read_bytes()
    figures = paths.root / report_html.FIGURES

    def drawn() -> dict[str, tuple[str, int]]:
        return {
            f.name.rsplit("-", 1)[0]: (f.name, f.stat().st_mtime_ns) for f in figures.glob("*.svg")
        }

    first = drawn()
    assert first.keys() == set(PLOTS) - {"judge"}
    try:
        data = json.loads(saved)
        data["load"]["ratio"] = 1234.5
        variant.write_text(json.dumps(data), encoding="utf-8")
        assert report_html.write_html_reports(paths.root) == page
        assert "1234.5" in page.read_text(encoding="utf-8")
        assert index.stat().st_mtime_ns != index_before  # a report it reads changed
        # Only the plots drawn from the variants are drawn again (and the old ones removed);
        # the quantize report's plots are the files drawn before.
        again = drawn()
        assert again.keys() == first.keys()
        redrawn = {name for name in first if again[name] != first[name]}
        assert redrawn == {"accuracy", "load"}, redrawn
    finally:
        variant.write_bytes(saved)
        report_html.write_html_reports(paths.root)


# -- missing sections, failures and no matplotlib --------------------------------------------------


def _strip(report: dict) -> dict:
    """A float model that needed no mixed precision and no judge, from an older build."""
    for key in ("mixed_precision", "htp", "preparation_check", "end_to_end", "range_rules"):
        report.pop(key, None)
    report["prepare"] = "not a list"  # a field of an unexpected type is skipped, not fatal
    return report


@pytest.mark.qnn
def test_missing_sections_and_a_failed_variant_render(full: Path, tmp_path: Path) -> None:
    source = model_paths(full, "cnn").root
    root = tmp_path / "artifacts" / "build" / "cnn"
    (root / "ctx").mkdir(parents=True)
    report = _strip(json.loads((source / "report.json").read_text()))
    (root / "report.json").write_text(json.dumps(report), encoding="utf-8")
    shutil.copy(source / "record.json", root / "record.json")
    variant_json = next(source.glob("ctx/*/snapdragon-x-elite/variant.json"))
    failed = json.loads(variant_json.read_text())
    failed.update(status="failed", coverage=None, validation=None, load=None, memory=None)
    failed["error"] = {
        "stage": "compile",
        "kind": "abort",
        "message": "QNN said no",
        "nodes": ["conv2"],
    }
    folder = root / "ctx" / failed["toolchain"] / "snapdragon-8-gen-3"
    folder.mkdir(parents=True)
    failed["target"] = "snapdragon-8-gen-3"
    (folder / "variant.json").write_text(json.dumps(failed), encoding="utf-8")
    warnings: list[str] = []
    page = report_html.write_html_reports(root, warnings.append)
    assert warnings == [] and page == root / REPORT_HTML
    text = check_self_contained(page)
    assert "FAILED (abort in compile)" in text and "QNN said no" in text and "conv2" in text
    assert plots_in(text) == set()  # nothing to draw: no mixed precision, judge or validation
    assert ">Mixed precision" not in text and ">Precision judged on the HTP" not in text
    index = check_self_contained(root.parent / INDEX_HTML)
    assert "FAILED (abort in compile)" in index


def test_rows_matched_by_pick_are_named_in_the_accuracy_table(full: Path, tmp_path: Path) -> None:
    """An output compared row by row with the test's row of the same TopK pick is gated: its
    cell is its figure, said to be matched (a picked one says it is not gated)."""
    from pipeline.core.accuracy import MATCHED

    source = model_paths(full, "cnn").root
    root = tmp_path / "artifacts" / "build" / "cnn"
    root.mkdir(parents=True)
    report = json.loads((source / "report.json").read_text())
    figures = report["buckets"][-1]["qdq_vs_float"]
    output = next(iter(figures))
    figures[output] = {**figures[output], "snr_db": 37.25, "compared_as": MATCHED}
    (root / "report.json").write_text(json.dumps(report), encoding="utf-8")
    shutil.copy(source / "record.json", root / "record.json")
    page = report_html.write_html_reports(root, lambda warning: None)
    assert "37.25 (rows matched by pick)" in check_self_contained(page)


@pytest.mark.qnn
def test_compile_fixtures_without_quantize_report_and_a_native_abort(tmp_path: Path) -> None:
    """The compile fixtures leave a record but no quantize report; shape_tail's ctx aborts the
    loading process: both pages render, and the index lists both."""
    good = build_inputs(tmp_path, "tiny", small_cnn)
    crash = build_inputs(tmp_path, "shape_tail", shape_tail)
    assert compile_cli(tmp_path, good, crash) == 1  # shape_tail's variant failed
    tiny = check_self_contained(model_paths(tmp_path, "tiny").root / REPORT_HTML)
    assert plots_in(tiny) == set()  # one output of one variant: its tables say it all
    assert ">Compile: EP-context variants" in tiny
    assert "No quantize report.json beside the record" in tiny
    crashed = check_self_contained(model_paths(tmp_path, "shape_tail").root / REPORT_HTML)
    assert "FAILED (abort in load)" in crashed and "Tensor name not found." in crashed
    index = check_self_contained(tmp_path / "artifacts" / "build" / INDEX_HTML)
    assert 'href="tiny/report.html"' in index and 'href="shape_tail/report.html"' in index
    assert "2 model(s); 1 failed" in index


@pytest.mark.qnn
def test_a_page_that_cannot_be_written_is_a_warning_not_a_failed_stage(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    config = build_inputs(tmp_path, "tiny", small_cnn)
    page = model_paths(tmp_path, "tiny").root / REPORT_HTML
    page.mkdir(parents=True)  # a folder where the page goes: replacing it fails
    assert compile_cli(tmp_path, config) == 0
    out = capsys.readouterr().out
    assert "WARNING: tiny: report.html not written" in out
    assert page.is_dir() and (tmp_path / "artifacts" / "build" / INDEX_HTML).is_file()


@pytest.mark.qnn
def test_without_matplotlib_the_page_keeps_its_tables(
    full: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "build" / "cnn"
    shutil.copytree(model_paths(full, "cnn").root, root, ignore=shutil.ignore_patterns("*.onnx"))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert not report_html.plots_available()
    page = report_html.write_html_reports(root)
    assert page is not None
    text = check_self_contained(page)
    assert "<svg" not in text and report_html.PLOTS_MISSING.split(":")[0] in text
    assert ">Mixed precision" in text and ">Load times" in text and "<table>" in text


@pytest.mark.qnn
def test_a_plot_is_drawn_only_where_it_compares(full: Path, tmp_path: Path) -> None:
    """One judge round, one variant: their tables only, and no matplotlib import for them; a
    second round or variant brings the plot (a picture then reads faster than the table)."""
    root = tmp_path / "build" / "cnn"
    shutil.copytree(model_paths(full, "cnn").root, root, ignore=shutil.ignore_patterns("*.onnx"))
    report = json.loads((root / "report.json").read_text())
    for extra in root.glob("ctx/*/snapdragon-8-gen-3"):
        shutil.rmtree(extra)
    shutil.rmtree(root / report_html.FIGURES)
    report.pop("mixed_precision")
    (root / "report.json").write_text(json.dumps(report), encoding="utf-8")
    data = report_html.load_model(root)
    assert not report_html.plots_wanted(data)
    text = check_self_contained(report_html.write_model_html(root))
    assert plots_in(text) == set() and ">Load times" in text and ">Precision judged" in text
    assert not (root / report_html.FIGURES).exists()  # nothing drawn, nothing cached

    report["htp"]["rounds"].append({**report["htp"]["rounds"][0], "label": "again"})
    (root / "report.json").write_text(json.dumps(report), encoding="utf-8")
    assert report_html.plots_wanted(report_html.load_model(root))
    assert plots_in(check_self_contained(report_html.write_model_html(root))) == {"judge"}


def test_unreadable_report_is_named_on_the_page(tmp_path: Path) -> None:
    root = tmp_path / "build" / "broken"
    root.mkdir(parents=True)
    (root / "report.json").write_text('{"model": "broken", "buckets": [', encoding="utf-8")
    warnings: list[str] = []
    page = report_html.write_html_reports(root, warnings.append)
    assert warnings == [] and page is not None
    text = check_self_contained(page)
    assert "report.json could not be read" in text and "Not compiled yet" in text


def test_a_streams_closed_loop_is_a_bar_of_the_accuracy_plot() -> None:
    """A streaming model's ctx fed its own state (compile's closed loop) is a fourth bar per
    output it was measured on; its state outputs, read by no app, have none."""
    figure = {"snr_db": 30.0}
    validation = {
        "ctx_vs_qdq": {"y": figure, "state": figure},
        "ctx_vs_float": {"y": figure, "state": figure},
        "qdq_vs_float": {"y": figure, "state": figure},
        "closed_loop": {"y": {"snr_db": 21.5}},
    }
    groups, values = report_html._accuracy_groups([{"validation": validation}])
    assert groups == ["y", "state"] and values["closed_loop"] == [21.5, None]
    _, plain = report_html._accuracy_groups([{"validation": {**validation, "closed_loop": {}}}])
    assert "closed_loop" not in plain
