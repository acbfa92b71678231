"""The compile stage: real QDQ models, the real QNN EP and its HTP simulator, real failures."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from compile_fixtures import build_inputs, cnn_with_op, shape_tail, small_cnn, stock_chain

from pipeline import coverage, qnn
from pipeline.__main__ import main
from pipeline.compile import ChildOutcome, interpret, resolve_toolchain
from pipeline.errors import ToolchainError
from pipeline.toolchains import load_pins
from pipeline.variant import VariantRecord

TWO_TARGETS = 'targets = ["snapdragon-x-elite", "snapdragon-8-gen-3"]\nmin_snr_db = 20.0'


def compile_cli(root: Path, *args: str) -> int:
    return main(["compile", "--artifacts", str(root / "artifacts"), *args])


def installed_pin() -> str:
    return qnn.installed_qnn().package_version


def variant(root: Path, model: str, target: str, toolchain: str | None = None) -> VariantRecord:
    folder = root / "artifacts" / "build" / model / "ctx" / (toolchain or installed_pin()) / target
    return VariantRecord.read(folder)


# -- bad input that needs no QNN -------------------------------------------------------------------


def test_missing_qdq_says_to_run_quantize(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from compile_fixtures import write_config

    config = write_config(tmp_path, "never_quantized", "")
    assert compile_cli(tmp_path, str(config)) == 1
    err = capsys.readouterr().err
    assert "no QDQ model" in err and "nox -s quantize" in err


def test_unknown_target_lists_the_known_ones(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from compile_fixtures import write_config

    config = write_config(tmp_path, "m", 'targets = ["snapdragon-x-elit"]')
    assert compile_cli(tmp_path, str(config)) == 1
    err = capsys.readouterr().err
    assert "Unknown target 'snapdragon-x-elit'" in err
    assert "Did you mean 'snapdragon-x-elite'" in err and "snapdragon-8-gen-3" in err


def test_unpinned_toolchain(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from compile_fixtures import write_config

    config = write_config(tmp_path, "m", "")
    assert compile_cli(tmp_path, "--toolchain", "2.4.0", str(config)) == 1
    err = capsys.readouterr().err
    assert "onnxruntime-qnn '2.4.0' is not pinned" in err and "2.7.0" in err
    config = write_config(tmp_path, "m", 'toolchains = ["9.9.9"]')
    assert compile_cli(tmp_path, str(config)) == 1
    assert "'9.9.9' is not pinned" in capsys.readouterr().err


def test_wrong_onnxruntime_beside_onnxruntime_qnn_is_refused() -> None:
    """The versions of FACTS §2's silent CPU fallback: refused before anything is compiled."""
    pins = load_pins()
    bad = qnn.InstalledQnn("2.3.0", "2.47.0", "1.31.1", "plugin")
    with pytest.raises(ToolchainError) as info:
        resolve_toolchain(pins, "2.3.0", bad)
    assert "onnxruntime-qnn 2.3.0 is not known to work with onnxruntime 1.31.1; pin 1.26.0" in str(
        info.value
    )
    with pytest.raises(ToolchainError, match=r"needs onnxruntime-qnn 2\.5\.0"):
        resolve_toolchain(pins, "2.5.0", qnn.InstalledQnn("2.7.0", "2.51.0", "1.31.1", "plugin"))
    with pytest.raises(ToolchainError, match="not pinned"):
        resolve_toolchain(pins, None, qnn.InstalledQnn("2.6.0", "2.50.40", "1.31.1", "plugin"))
    with pytest.raises(ToolchainError, match="onnxruntime-qnn is not installed"):
        resolve_toolchain(pins, "2.7.0", qnn.InstalledQnn("", "", "1.31.1", "none"))
    good = qnn.InstalledQnn("2.7.0", "2.51.0", "1.31.1", "plugin")
    assert resolve_toolchain(pins, None, good).qnn_sdk == "2.51.0"


# -- facts the EP leaves behind --------------------------------------------------------------------


def test_compatibility_info_both_formats() -> None:
    v2 = qnn.parse_compatibility_info("v2:6:2.51.0:5.51.0:73:60:0:0")
    assert (v2.format, v2.sdk, v2.htp_archs, v2.soc_models) == ("v2", "2.51.0", (73,), (60,))
    assert qnn.compatibility_problems(v2, 60, 73) == []
    assert qnn.compatibility_problems(v2, 57, 75) == [
        "built for HTP arch [73], not the requested 75",
        "built for soc_model [60], not 57",
    ]
    # onnxruntime-qnn 2.3.0 writes the older form, without a soc model (FACTS §1: arch 68).
    v1 = qnn.parse_compatibility_info("6:2.47.0:5.47.0:0.0.0:68:0")
    assert (v1.format, v1.sdk, v1.htp_archs, v1.soc_models) == ("v1", "2.47.0", (68,), ())
    assert qnn.compatibility_problems(v1, 60, 73) == [
        "built for HTP arch [68], not the requested 73"
    ]
    with pytest.raises(ValueError, match="unknown ep_compatibility_info"):
        qnn.parse_compatibility_info("garbage")
    assert qnn.sdk_version("v2.49.40.260810104044") == "2.49.40"


def test_ep_log_facts_from_real_lines() -> None:
    """Lines as the 2.7.0 EP prints them here (ultraface_rfb320 and the shape_tail abort)."""
    log = (
        "\x1b[1;31m2026-11-21 16:30:41.665774689 [E:onnxruntime:, qnn_model_wrapper.cc:776 "
        "ComposeQnnGraph] QNN.graphAddNode() failed for node `_token_282` of type `Conv2d` with "
        "error code 6007\x1b[m\n"
        "onnxruntime.capi.onnxruntime_pybind11_state.EPFail: [ONNXRuntimeError] : 11 : EP_FAIL :"
        " Failed to compose Qnn graph.\n"
        "\x1b[0;93m2026-11-21 [W:onnxruntime:, qnn_model_wrapper.cc:565 CreateQnnNode] "
        "QNN.backendValidateOpConfig() failed for node `shape` of type `Shape` with error code "
        "3110\n"
        "terminate called after throwing an instance of 'Ort::Exception'\n"
        "  what():  Tensor name not found.\n"
    )
    facts = qnn.parse_ep_log(log)
    assert facts.nodes == ["_token_282"]
    assert facts.op_types == ["Conv2d"]
    assert facts.error_codes == ["6007"]
    # A warning-level rejection is a node QNN left to the CPU: context, not the failure.
    assert facts.rejected == [{"node": "shape", "op_type": "Shape", "code": "3110"}]
    assert facts.abort == "Tensor name not found."
    assert any("Failed to compose Qnn graph" in line for line in facts.error_lines)
    assert qnn.parse_ep_log("all fine\n").to_dict()["nodes"] == []


def test_death_in_qdq_benchmark_keeps_the_variant() -> None:
    """If only the QDQ reference session (online compile) dies, the ctx artifact still counts."""
    result = {
        "stage": "benchmark",
        "status": "running",
        "validation": {"passed": True},
        "load": {"runs": 3, "ctx_s": 0.01, "step": "qdq"},
    }
    log = "[compile_worker] stage: benchmark\nterminate called after throwing\n  what():  boom\n"
    status, error = interpret(ChildOutcome(result, -6, False, 1.0, log), 60)
    assert status == "ok" and error == {}
    assert "native abort" in result["load"]["qdq_error"] and "boom" in result["load"]["qdq_error"]
    result = {"stage": "load", "status": "running"}
    status, error = interpret(ChildOutcome(result, -6, False, 1.0, log), 60)
    assert status == "failed" and error["kind"] == "abort" and error["stage"] == "load"


def test_model_summary_matches_onnx(tmp_path: Path) -> None:
    build_inputs(tmp_path, "m", small_cnn)
    path = tmp_path / "artifacts" / "build" / "m" / "qdq.onnx"
    model = onnx.load(str(path))
    summary = qnn.read_model_summary(path)
    assert [(n.name, n.op_type, n.inputs, n.outputs) for n in summary.nodes] == [
        (n.name, n.op_type, list(n.input), list(n.output)) for n in model.graph.node
    ]
    assert [(v.name, v.dtype, v.shape) for v in summary.inputs] == [
        ("x", "float32", [1, 3, 16, 16])
    ]
    assert [v.name for v in summary.outputs] == ["y"]
    assert summary.ir_version == model.ir_version
    assert summary.initializers == {i.name for i in model.graph.initializer}


def test_coverage_counts_cpu_nodes_but_not_graph_io_qdq(tmp_path: Path) -> None:
    build_inputs(tmp_path, "m", cnn_with_op("Erf"))
    graph = qnn.read_model_summary(tmp_path / "artifacts" / "build" / "m" / "qdq.onnx")
    q_in = next(n for n in graph.nodes if n.op_type == "QuantizeLinear" and n.inputs[0] == "x")
    dq_out = next(n for n in graph.nodes if n.op_type == "DequantizeLinear" and n.outputs[0] == "y")
    erf = next(n for n in graph.nodes if n.op_type == "Erf")
    dq_erf = next(n for n in graph.nodes if erf.inputs[0] in n.outputs)
    q_erf = next(n for n in graph.nodes if n.inputs and n.inputs[0] == erf.outputs[0])
    cpu = [(n.name, n.op_type) for n in (q_in, dq_out, erf, dq_erf, q_erf)]
    qnn_nodes = [(n.name, n.op_type) for n in graph.nodes if (n.name, n.op_type) not in cpu]
    assignment = [("QNNExecutionProvider", qnn_nodes[:3]), ("QNNExecutionProvider", qnn_nodes[3:])]
    assignment += [("CPUExecutionProvider", [node]) for node in cpu]

    strict = coverage.summarize(assignment, graph)
    assert strict["qnn_partitions"] == 2 and strict["cpu_io_qdq_nodes"] == 2
    assert {n["op_type"] for n in strict["cpu_compute_nodes"]} == {
        "Erf",
        "QuantizeLinear",
        "DequantizeLinear",
    }
    assert not strict["passed"] and "Erf x1" in strict["problems"][1]

    relaxed = coverage.summarize(assignment, graph, max_partitions=2, allowed_cpu_ops=["Erf"])
    assert relaxed["passed"], relaxed["problems"]
    assert len(relaxed["cpu_allowed_nodes"]) == 3 and relaxed["cpu_compute_nodes"] == []

    only_io = [("QNNExecutionProvider", qnn_nodes)] + [
        ("CPUExecutionProvider", [n]) for n in cpu[:2]
    ]
    assert coverage.summarize(only_io, graph)["passed"]


# -- the real thing ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_targets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("onnxruntime_qnn")
    root = tmp_path_factory.mktemp("compile")
    build_inputs(root, "tiny", small_cnn, TWO_TARGETS)
    return root


@pytest.mark.qnn
def test_two_targets_compile_with_full_coverage(
    two_targets: Path, capsys: pytest.CaptureFixture
) -> None:
    config = two_targets / "configs" / "tiny.toml"
    assert compile_cli(two_targets, str(config), "--force") == 0
    pin = load_pins().get(installed_pin())
    build = two_targets / "artifacts" / "build" / "tiny"
    for name, soc, arch in (("snapdragon-x-elite", 60, 73), ("snapdragon-8-gen-3", 57, 75)):
        record = variant(two_targets, "tiny", name)
        folder = build / "ctx" / pin.onnxruntime_qnn / name
        assert record.passed and record.status == "ok", record.error
        assert record.files == [f"tiny_{name}_qnn{pin.qnn_sdk}_ctx.onnx"]
        assert record.qnn_sdk_version == pin.qnn_sdk
        info = qnn.parse_compatibility_info(record.ep_compatibility_info)
        assert (info.soc_models, info.htp_archs) == ((soc,), (arch,))
        ctx = qnn.read_model_summary(folder / record.files[0])
        assert [n.op_type for n in ctx.nodes].count("EPContext") == 1
        assert record.coverage["qnn_partitions"] == 1
        assert record.coverage["cpu_compute_nodes"] == []
        assert record.coverage["cpu_io_qdq_nodes"] == 2  # graph-input Q and graph-output DQ
        assert (
            record.validation["samples"] == 4 and record.validation["samples_source"] == "heldout"
        )
        assert record.validation["worst_snr_db"] > 30  # ctx on the HTP simulator vs QDQ on CPU
        assert record.validation["ctx_vs_float"]["y"]["cosine"] > 0.99
        assert record.load["qdq_s"] > 0 and record.load["ctx_s"] > 0 and record.load["ratio"] > 0
        assert (folder / "compile.log").is_file()
    report = json.loads((build / "ctx" / "report.json").read_text())
    assert [(r["target"], r["passed"]) for r in report["variants"]] == [
        ("snapdragon-x-elite", True),
        ("snapdragon-8-gen-3", True),
    ]
    assert "| pass |" in (build / "ctx" / "report.md").read_text()
    section = json.loads((build / "record.json").read_text())["compile"][pin.onnxruntime_qnn]
    assert section["qnn_sdk"] == pin.qnn_sdk and set(section["variants"]) == {
        "snapdragon-x-elite",
        "snapdragon-8-gen-3",
    }
    assert json.loads((build / "record.json").read_text())["quantize"]["status"] == "ok"


@pytest.mark.qnn
def test_rerun_is_skipped_and_embed_change_rebuilds_without_stale_files(
    two_targets: Path, capsys: pytest.CaptureFixture
) -> None:
    config = two_targets / "configs" / "tiny.toml"
    assert compile_cli(two_targets, str(config)) == 0
    capsys.readouterr()
    assert compile_cli(two_targets, str(config)) == 0
    assert capsys.readouterr().out.count("(unchanged, skipped)") == 2
    config.write_text(config.read_text() + "embed = false\n")
    assert compile_cli(two_targets, str(config)) == 0
    assert "skipped" not in capsys.readouterr().out
    record = variant(two_targets, "tiny", "snapdragon-x-elite")
    folder = two_targets / "artifacts/build/tiny/ctx" / installed_pin() / "snapdragon-x-elite"
    assert record.embed_mode == 0 and len(record.files) == 2 and record.files[1].endswith(".bin")
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [*record.files, "variant.json", "compile.log"]
    )
    ctx = qnn.read_model_summary(folder / record.files[0]).nodes_of("EPContext")[0]
    assert ctx.attributes["ep_cache_context"] == record.files[1]
    assert record.passed
    # One target dropped from the config: its folder goes too.
    config.write_text(config.read_text().replace(', "snapdragon-8-gen-3"', ""))
    assert compile_cli(two_targets, str(config)) == 0
    toolchain_dir = folder.parent
    assert sorted(p.name for p in toolchain_dir.iterdir()) == ["snapdragon-x-elite"]


@pytest.mark.qnn
def test_op_qnn_rejects_fails_the_gate_listing_it(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    pytest.importorskip("onnxruntime_qnn")
    config = build_inputs(tmp_path, "softsign", cnn_with_op("Softsign"))
    assert compile_cli(tmp_path, str(config)) == 1
    err = capsys.readouterr().err
    assert "1 variant(s) failed" in err
    assert "2 QNN partitions (max_partitions = 1)" in err
    assert "1 node(s) on CPU: Softsign x1; nodes: odd_op (Softsign)" in err
    record = variant(tmp_path, "softsign", "snapdragon-x-elite")
    assert record.status == "ok" and not record.coverage["passed"] and not record.passed
    assert record.coverage["cpu_compute_nodes"] == [{"name": "odd_op", "op_type": "Softsign"}]
    report = (tmp_path / "artifacts/build/softsign/ctx/report.md").read_text()
    assert "FAIL gate" in report and "Softsign x1" in report
    # The config can relax the gate for an op known to stay on the CPU.
    config.write_text(config.read_text() + 'max_partitions = 2\nallowed_cpu_ops = ["Softsign"]\n')
    assert compile_cli(tmp_path, str(config)) == 0
    assert variant(tmp_path, "softsign", "snapdragon-x-elite").passed


@pytest.mark.qnn
def test_native_abort_is_reported_and_the_build_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A real native abort: loading shape_tail's ctx model kills the process (SIGABRT)."""
    pytest.importorskip("onnxruntime_qnn")
    crash = build_inputs(tmp_path, "shape_tail", shape_tail, TWO_TARGETS)
    good = build_inputs(tmp_path, "tiny", small_cnn)
    assert compile_cli(tmp_path, str(crash), str(good)) == 1
    err = capsys.readouterr().err
    assert "2 variant(s) failed" in err
    for target in ("snapdragon-x-elite", "snapdragon-8-gen-3"):
        record = variant(tmp_path, "shape_tail", target)
        assert record.status == "failed" and record.error["kind"] == "abort", record.error
        assert record.error["stage"] == "load"
        assert record.error["abort"] == "Tensor name not found."
        assert "terminate called" in record.error["message"]
        assert "Shape" in record.error["rejected_earlier"]
        assert f"FAILED shape_tail {target}" in err
    assert variant(tmp_path, "tiny", "snapdragon-x-elite").passed  # built after the crash
    report = (tmp_path / "artifacts/build/shape_tail/ctx/report.md").read_text()
    assert "abort in step `load`" in report and "Tensor name not found." in report


@pytest.mark.qnn
def test_hang_is_cut_by_the_timeout(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("onnxruntime_qnn")
    config = build_inputs(tmp_path, "slow", small_cnn, "timeout_s = 0.5")
    assert compile_cli(tmp_path, str(config)) == 1
    record = variant(tmp_path, "slow", "snapdragon-x-elite")
    assert record.status == "failed" and record.error["kind"] == "timeout"
    assert "no result after 0.5 s" in record.error["message"]
    assert "timeout" in capsys.readouterr().err
    work = [p for p in (tmp_path / "artifacts/build/slow/ctx").iterdir() if p.name.startswith(".")]
    assert work == [], "the worker's scratch folder was left behind"


@pytest.mark.qnn
@pytest.mark.real
def test_compose_failure_names_node_op_and_qnn_code(tmp_path: Path) -> None:
    """ultraface_rfb320 through the stock chain (FACTS §4): QNN cannot compose one Conv2d."""
    pytest.importorskip("onnxruntime_qnn")
    source = Path(__file__).resolve().parents[2] / "shared" / "models" / "ultraface_rfb320.onnx"
    if not source.is_file():
        pytest.skip(f"{source} is absent (the real models live in ../shared/models)")
    config = stock_chain(tmp_path, "ultraface", source)
    assert compile_cli(tmp_path, str(config)) == 1
    error = variant(tmp_path, "ultraface", "snapdragon-x-elite").error
    assert error["kind"] == "compose" and error["stage"] == "compile"
    assert "Failed to compose Qnn graph" in error["message"]
    assert error["op_types"] == ["Conv2d"] and error["qnn_error_codes"] == ["6007"]
    assert len(error["nodes"]) == 1
