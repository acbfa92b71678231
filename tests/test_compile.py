"""The compile stage: real QDQ models, the real QNN EP and its HTP simulator, real failures."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from compile_fixtures import (
    BUCKET,
    build_inputs,
    cnn_with_op,
    heavy_imports,
    model_paths,
    shape_tail,
    small_cnn,
    stock_chain,
    write_config,
)

from pipeline.__main__ import main
from pipeline.compile import coverage
from pipeline.compile.build import resolve_toolchain
from pipeline.compile.child import ChildOutcome, interpret
from pipeline.compile.eplog import parse_ep_log
from pipeline.compile.job import WorkerResult
from pipeline.core.errors import ToolchainError
from pipeline.core.records import (
    BucketOutcome,
    Coverage,
    LoadTimes,
    NodeRef,
    QuantizeRecord,
    Validation,
    VariantRecord,
    read_record,
)
from qnn_ctx_runtime import qnn
from qnn_ctx_runtime.toolchains import load_toolchains
from qnn_ctx_runtime.typed import parse

TWO_TARGETS = 'targets = ["snapdragon-x-elite", "snapdragon-8-gen-3"]\nmin_snr_db = 20.0'


def compile_cli(root: Path, *args: str) -> int:
    return main(["compile", "--artifacts", str(root / "artifacts"), *args])


def installed_pin() -> str:
    return qnn.installed_qnn().package_version


def variant(root: Path, model: str, target: str, toolchain: str | None = None) -> VariantRecord:
    """The variant.json of one variant, parsed strictly (a malformed record fails the test)."""
    path = model_paths(root, model).variant(toolchain or installed_pin(), target).record
    record, why = read_record(VariantRecord, path)
    assert record is not None, why
    return record


def report_variants(root: Path, model: str) -> list[VariantRecord]:
    """The variants of ctx/report.json, parsed as the VariantRecords they are."""
    data = json.loads((model_paths(root, model).ctx / "report.json").read_text())
    issues: list[str] = []
    records = [
        parse(VariantRecord, v, f"variants[{i}]", issues) for i, v in enumerate(data["variants"])
    ]
    assert not issues, issues
    return records


# -- bad input that needs no QNN -------------------------------------------------------------------


def test_missing_qdq_says_to_run_quantize(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = write_config(tmp_path, "never_quantized", "")
    assert compile_cli(tmp_path, str(config)) == 1
    err = capsys.readouterr().err
    assert "no usable quantize record" in err and "nox -s quantize" in err


def test_qdq_not_the_recorded_one_says_to_run_quantize(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The record names each bucket's QDQ model by sha256: a changed or lost one is refused."""
    config = build_inputs(tmp_path, "m", small_cnn)
    qdq = model_paths(tmp_path, "m").bucket(BUCKET).qdq
    model = onnx.load(str(qdq))
    model.doc_string = "edited after the quantize stage"
    onnx.save(model, str(qdq))
    assert compile_cli(tmp_path, str(config)) == 1
    err = capsys.readouterr().err
    assert f"{qdq} changed after the quantize stage recorded it" in err
    assert "nox -s quantize" in err
    qdq.unlink()
    assert compile_cli(tmp_path, str(config)) == 1
    err = capsys.readouterr().err
    assert f"{qdq} is missing" in err and "nox -s quantize" in err
    assert not model_paths(tmp_path, "m").ctx.exists()


def test_unknown_target_lists_the_known_ones(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = write_config(tmp_path, "m", 'targets = ["snapdragon-x-elit"]')
    assert compile_cli(tmp_path, str(config)) == 1
    err = capsys.readouterr().err
    assert "compile.targets names 'snapdragon-x-elit', not a known chip" in err
    assert "did you mean 'snapdragon-x-elite'" in err and "snapdragon-8-gen-3" in err


def test_unpinned_toolchain(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = write_config(tmp_path, "m", "")
    assert compile_cli(tmp_path, "--toolchain", "2.4.0", str(config)) == 1
    err = capsys.readouterr().err
    assert "onnxruntime-qnn 2.4.0 (QNN SDK 2.48.40) is known but not pinned" in err
    assert "2.7.0" in err
    config = write_config(tmp_path, "m", 'toolchains = ["9.9.9"]')
    assert compile_cli(tmp_path, str(config)) == 1
    err = capsys.readouterr().err
    assert "compile.toolchains names '9.9.9', which is not pinned" in err and "2.7.0" in err


def test_wrong_onnxruntime_beside_onnxruntime_qnn_is_refused() -> None:
    """The versions of FACTS §2's silent CPU fallback: refused before anything is compiled."""
    table = load_toolchains()
    bad = qnn.InstalledQnn("2.3.0", "2.47.0", "1.31.1", "plugin")
    with pytest.raises(ToolchainError) as info:
        resolve_toolchain(table, "2.3.0", bad)
    assert (
        "onnxruntime-qnn 2.3.0 is not known to work with onnxruntime 1.31.1; the pin is 1.26.0"
        in str(info.value)
    )
    assert "falls back to CPU" in str(info.value)
    with pytest.raises(ToolchainError, match=r"needs onnxruntime-qnn 2\.5\.0"):
        resolve_toolchain(table, "2.5.0", qnn.InstalledQnn("2.7.0", "2.51.0", "1.31.1", "plugin"))
    with pytest.raises(ToolchainError, match="not pinned"):
        resolve_toolchain(table, None, qnn.InstalledQnn("2.6.0", "2.50.40", "1.31.1", "plugin"))
    with pytest.raises(ToolchainError, match="onnxruntime-qnn is not installed"):
        resolve_toolchain(table, "2.7.0", qnn.InstalledQnn("", "", "1.31.1", "none"))
    good = qnn.InstalledQnn("2.7.0", "2.51.0", "1.31.1", "plugin")
    assert resolve_toolchain(table, None, good).qnn_sdk == "2.51.0"


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
    facts = parse_ep_log(log)
    assert facts.nodes == ["_token_282"]
    assert facts.op_types == ["Conv2d"]
    assert facts.error_codes == ["6007"]
    # A warning-level rejection is a node QNN left to the CPU: context, not the failure.
    assert facts.rejected == [{"node": "shape", "op_type": "Shape", "code": "3110"}]
    assert facts.abort == "Tensor name not found."
    assert any("Failed to compose Qnn graph" in line for line in facts.error_lines)
    assert parse_ep_log("all fine\n").to_dict()["nodes"] == []


def _passed_bucket() -> BucketOutcome:
    cov = Coverage(1, 10, [], {}, [], 2, True, "gate", [])
    val = Validation({}, {}, {}, 40.0, 30.0, 4, "heldout", True, "gate")
    return BucketOutcome(cov, [], [], val)


def _benchmarking() -> WorkerResult:
    """A worker that validated its context and is timing the QDQ model's online compile."""
    return WorkerResult(
        stage="benchmark",
        status="running",
        buckets={BUCKET: _passed_bucket()},
        load=LoadTimes(runs=3, ctx_s=0.01, all_s=0.01, buckets={BUCKET: 0.01}),
        timing_online_compile=True,
    )


def test_death_in_qdq_benchmark_keeps_the_variant() -> None:
    """If only the QDQ reference session (online compile) dies, the ctx artifact still counts."""
    result = _benchmarking()
    log = "[compile_worker] stage: benchmark\nterminate called after throwing\n  what():  boom\n"
    status, failure = interpret(ChildOutcome(result, -6, False, 1.0, log), 60)
    assert status == "ok" and failure is None
    assert result.load is not None and result.load.qdq_error is not None
    assert "native abort" in result.load.qdq_error and "boom" in result.load.qdq_error
    assert not result.timing_online_compile
    result = WorkerResult(stage="load", status="running")
    status, failure = interpret(ChildOutcome(result, -6, False, 1.0, log), 60)
    assert status == "failed" and failure is not None
    assert failure.kind == "abort" and failure.stage == "load" and failure.abort == "boom"
    assert not failure.infrastructure


def test_a_worker_stopped_for_memory_is_named_so_and_never_cached() -> None:
    """The build's memory guard SIGKILLs the worker: that is 'memory' (what it held, where),
    not an outside kill nor the model's crash, and like an outside kill it is never reused."""
    held = "it held 21.3 GiB resident with 0.9 GiB of the machine's 23.5 GiB left available"
    result = WorkerResult(stage="compile", status="running")
    outcome = ChildOutcome(result, -signal.SIGKILL, False, 30.0, "# LIBNATIVE: x\n", held)
    status, failure = interpret(outcome, 900)
    assert status == "failed" and failure is not None
    assert failure.kind == "memory" and failure.stage == "compile" and failure.infrastructure
    assert failure.message.startswith("the worker ran out of memory in step 'compile': it held")
    assert "SIGKILL" not in failure.message
    # Past the context, only the QDQ model's online compile (the load reference) died so.
    result = _benchmarking()
    status, failure = interpret(ChildOutcome(result, -9, False, 30.0, "", held), 900)
    assert status == "ok" and failure is None and result.load is not None
    assert "ran out of memory (it held 21.3 GiB" in (result.load.qdq_error or "")


def test_outside_kill_is_not_the_models_failure() -> None:
    """SIGKILL/SIGTERM with no abort in the log is an outside kill, never cached as the model's."""
    for sig in (signal.SIGKILL, signal.SIGTERM):
        result = WorkerResult(stage="validate", status="running")
        status, failure = interpret(ChildOutcome(result, -sig, False, 1.0, "plain output\n"), 60)
        assert status == "failed" and failure is not None
        assert failure.kind == "killed" and failure.stage == "validate" and failure.infrastructure
        assert sig.name in failure.message
    # A SIGKILL by the timeout is the timeout; a segfault is the model's crash.
    result = WorkerResult(stage="compile", status="running")
    status, failure = interpret(ChildOutcome(result, -9, True, 5.0, ""), 5)
    assert failure is not None and failure.kind == "timeout" and not failure.infrastructure
    status, failure = interpret(ChildOutcome(result, -11, False, 1.0, ""), 5)
    assert failure is not None and failure.kind == "crash" and not failure.infrastructure


def test_model_summary_matches_onnx(tmp_path: Path) -> None:
    build_inputs(tmp_path, "m", small_cnn)
    path = model_paths(tmp_path, "m").bucket(BUCKET).qdq
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


def test_model_summary_keeps_the_values_of_small_int64_initializers(tmp_path: Path) -> None:
    """A TopK's K, axes, a shape: int64 tensors of at most SMALL_INTS elements, in raw_data
    or in int64_data, negative ones too; not larger ones, nor other types."""
    from onnx import TensorProto, numpy_helper
    from onnx import helper as oh

    inits = [
        numpy_helper.from_array(np.array([10], np.int64), "k"),
        numpy_helper.from_array(np.array(-3, np.int64), "scalar"),
        oh.make_tensor("listed", TensorProto.INT64, [3], [1, -2, 1 << 40]),
        numpy_helper.from_array(np.arange(qnn.SMALL_INTS + 1, dtype=np.int64), "large"),
        numpy_helper.from_array(np.ones(2, np.int32), "int32"),
        numpy_helper.from_array(np.ones(2, np.float32), "float"),
    ]
    graph = oh.make_graph(
        [oh.make_node("Identity", ["x"], ["y"])],
        "g",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        inits,
    )
    path = tmp_path / "ints.onnx"
    onnx.save(oh.make_model(graph), str(path))
    summary = qnn.read_model_summary(path)
    assert summary.small_ints == {"k": [10], "scalar": [-3], "listed": [1, -2, 1 << 40]}
    assert summary.initializers == {i.name for i in inits}


def test_coverage_counts_cpu_nodes_but_not_graph_io_qdq(tmp_path: Path) -> None:
    build_inputs(tmp_path, "m", cnn_with_op("Erf"))
    graph = qnn.read_model_summary(model_paths(tmp_path, "m").bucket(BUCKET).qdq)
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
    assert strict.qnn_partitions == 2 and strict.cpu_io_qdq_nodes == 2
    assert {n.op_type for n in strict.cpu_compute_nodes} == {
        "Erf",
        "QuantizeLinear",
        "DequantizeLinear",
    }
    assert not strict.passed and "Erf x1" in strict.problems[1]

    relaxed = coverage.summarize(assignment, graph, max_partitions=2, allowed_cpu_ops=["Erf"])
    assert relaxed.passed, relaxed.problems
    assert len(relaxed.cpu_allowed_nodes) == 3 and relaxed.cpu_compute_nodes == []

    only_io = [("QNNExecutionProvider", qnn_nodes)] + [
        ("CPUExecutionProvider", [n]) for n in cpu[:2]
    ]
    assert coverage.summarize(only_io, graph).passed


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
    paths = model_paths(two_targets, "tiny")
    quantized, why = read_record(QuantizeRecord, paths.record)
    assert quantized is not None, why
    assert compile_cli(two_targets, str(config), "--force") == 0
    pin = load_toolchains().get(installed_pin())
    for name, soc, arch in (("snapdragon-x-elite", 60, 73), ("snapdragon-8-gen-3", 57, 75)):
        record = variant(two_targets, "tiny", name)
        folder = paths.variant(pin.onnxruntime_qnn, name).root
        assert record.passed and record.status == "ok", record.error
        assert (record.model, record.toolchain, record.target) == (
            "tiny",
            pin.onnxruntime_qnn,
            name,
        )
        assert (record.qnn_sdk, record.onnxruntime) == (pin.qnn_sdk, pin.onnxruntime)
        assert (record.soc_model, record.htp_arch) == (soc, arch)
        assert record.inputs_digest and record.error is None
        # Compiled from exactly the QDQ model the quantize record names.
        assert record.built_from.qdq_sha256 == {BUCKET: quantized.bucket(BUCKET).qdq_sha256}
        assert [s.kind for s in record.sets] == ["single"]
        assert record.files == [f"tiny_{name}_qnn{pin.qnn_sdk}_ctx.onnx"]
        facts = record.sets[0].facts[BUCKET]
        assert facts.qnn_sdk_version == pin.qnn_sdk and facts.embed_mode == 1
        info = qnn.parse_compatibility_info(facts.ep_compatibility_info)
        assert (info.soc_models, info.htp_archs) == ((soc,), (arch,))
        ctx = qnn.read_model_summary(folder / record.files[0])
        assert [n.op_type for n in ctx.nodes].count("EPContext") == 1
        assert record.coverage is not None and record.validation is not None
        assert record.coverage.qnn_partitions == 1
        assert record.coverage.cpu_compute_nodes == []
        assert record.coverage.cpu_io_qdq_nodes == 2  # graph-input Q and graph-output DQ
        assert record.validation.samples == 4 and record.validation.samples_source == "heldout"
        assert record.validation.worst_snr_db > 30  # ctx on the HTP simulator vs QDQ on CPU
        assert record.validation.ctx_vs_float["y"].cosine > 0.99
        load = record.load
        assert load is not None and load.qdq_s and load.ctx_s and load.ratio
        assert load.qdq_s > 0 and load.ctx_s > 0 and load.ratio > 0
        assert (folder / "compile.log").is_file()
    rows = report_variants(two_targets, "tiny")
    assert [(r.target, r.passed) for r in rows] == [
        ("snapdragon-x-elite", True),
        ("snapdragon-8-gen-3", True),
    ]
    assert "| pass |" in (paths.ctx / "report.md").read_text()
    # The variants of this toolchain are its variant.json files; the quantize record is the
    # quantize stage's alone and the compile stage leaves it as it was.
    toolchain_dir = paths.ctx / pin.onnxruntime_qnn
    assert sorted(p.name for p in toolchain_dir.iterdir()) == sorted(
        ["snapdragon-x-elite", "snapdragon-8-gen-3"]
    )
    after, why = read_record(QuantizeRecord, paths.record)
    assert after == quantized and after is not None and after.status == "ok", why
    assert "compile" not in json.loads(paths.record.read_text())


@pytest.mark.qnn
def test_each_variant_runs_in_a_worker_started_ahead(
    two_targets: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """compile starts a worker per variant before it needs it (onnxruntime imported and QNN
    registered while the stage reads its configs and models, or while the variant before
    runs); each variant's job goes to one, its output is the variant's compile.log. Only the
    variants to build get one: a rerun with nothing changed starts none, leaving no files."""
    from pipeline.compile import child

    started: list[tuple[str, ...]] = []
    real = child.start_module

    def spy(module: str, job: Path, log: Path, options: tuple[str, ...] = ()) -> Any:
        started.append(options)
        return real(module, job, log, options)

    monkeypatch.setattr(child, "start_module", spy)
    config = two_targets / "configs" / "tiny.toml"
    paths = model_paths(two_targets, "tiny")
    assert compile_cli(two_targets, str(config), "--force") == 0
    assert started == [(child.AWAIT,), (child.AWAIT,)]  # one per variant, none cold
    for name in ("snapdragon-x-elite", "snapdragon-8-gen-3"):
        record = variant(two_targets, "tiny", name)
        assert record.passed and record.status == "ok", record.error
        log = paths.variant(installed_pin(), name).log.read_text()
        assert log.startswith("[compile_worker] stage: register") and "stage: done" in log
    started.clear()
    assert compile_cli(two_targets, str(config)) == 0  # nothing changed: no variant built
    assert started == []
    assert not list((two_targets / "artifacts").glob(".compile-spares-*"))
    # One variant's record gone: that variant alone is built, in the one worker started.
    gone = paths.variant(installed_pin(), "snapdragon-8-gen-3").record
    gone.unlink()
    kept = paths.variant(installed_pin(), "snapdragon-x-elite").record.read_bytes()
    assert compile_cli(two_targets, str(config)) == 0
    assert started == [(child.AWAIT,)]
    assert gone.is_file() and variant(two_targets, "tiny", "snapdragon-8-gen-3").passed
    assert paths.variant(installed_pin(), "snapdragon-x-elite").record.read_bytes() == kept
    assert not list((two_targets / "artifacts").glob(".compile-spares-*"))


@pytest.mark.qnn
def test_rerun_is_skipped_and_embed_change_rebuilds_without_stale_files(
    two_targets: Path, capsys: pytest.CaptureFixture
) -> None:
    config = two_targets / "configs" / "tiny.toml"
    assert compile_cli(two_targets, str(config)) == 0
    capsys.readouterr()
    assert compile_cli(two_targets, str(config)) == 0
    assert capsys.readouterr().out.count("(unchanged, skipped)") == 2
    # In its own process, the rerun reads records only: no numpy, onnx(runtime) or matplotlib.
    argv = ("compile", "--artifacts", str(two_targets / "artifacts"), str(config))
    assert heavy_imports(*argv, cwd=two_targets) == []
    config.write_text(config.read_text() + "embed = false\n")
    assert compile_cli(two_targets, str(config)) == 0
    assert "skipped" not in capsys.readouterr().out
    record = variant(two_targets, "tiny", "snapdragon-x-elite")
    folder = model_paths(two_targets, "tiny").variant(installed_pin(), "snapdragon-x-elite").root
    assert record.sets[0].facts[BUCKET].embed_mode == 0
    assert len(record.files) == 2 and record.files[1].endswith(".bin")
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
    assert record.coverage is not None
    assert record.status == "ok" and not record.coverage.passed and not record.passed
    assert record.coverage.cpu_compute_nodes == [NodeRef("odd_op", "Softsign")]
    report = (model_paths(tmp_path, "softsign").ctx / "report.md").read_text()
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
        error = record.error
        assert record.status == "failed" and error is not None and error.kind == "abort", error
        assert error.stage == "load"
        assert error.abort == "Tensor name not found."
        assert "terminate called" in error.message
        assert "Shape" in error.rejected_earlier
        # The model's own failure: the record is reused until its inputs change.
        assert not error.infrastructure and record.inputs_digest
        assert f"FAILED shape_tail {target}" in err
    assert variant(tmp_path, "tiny", "snapdragon-x-elite").passed  # built after the crash
    report = (model_paths(tmp_path, "shape_tail").ctx / "report.md").read_text()
    assert "abort in step `load`" in report and "Tensor name not found." in report


# A real hang or kill inside the worker: Python imports ``sitecustomize`` at the start of every
# process whose sys.path has it, and the compile stage starts its worker with this process's
# environment (its own PYTHONPATH entries first). This process started before the variable was
# set, so only the worker runs the hook. The hook marks where it took over (the pid in a file).
WORKER_HOOK = """\
import os
import signal
import threading

import onnxruntime


def _take_over(self, *args, **kwargs):
    with open({marker!r}, "w") as handle:
        handle.write(str(os.getpid()))
    print("[test hook] ModelCompiler.compile_to_file taken over: {action}", flush=True)
    if {action!r} == "hang":
        threading.Event().wait()  # never set: a compile that never returns
    os.kill(os.getpid(), signal.SIGKILL)  # an outside kill (the OOM killer, an operator)


onnxruntime.ModelCompiler.compile_to_file = _take_over
"""


def hook_worker(monkeypatch: pytest.MonkeyPatch, where: Path, action: str) -> Path:
    """Make ``ModelCompiler.compile_to_file`` in the worker ``hang`` or ``kill`` it; returns the
    file the hook writes the worker's pid to when it takes over."""
    folder = where / "hook"
    folder.mkdir()
    marker = where / "hooked.pid"
    (folder / "sitecustomize.py").write_text(WORKER_HOOK.format(marker=str(marker), action=action))
    parts = [str(folder), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in parts if p))
    return marker


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.qnn
def test_hang_is_cut_by_the_timeout(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """compile_to_file never returns: compile.timeout_s kills the worker, whatever the speed."""
    pytest.importorskip("onnxruntime_qnn")
    # Far longer than the worker needs to reach the compile step (under a second here), far
    # shorter than the default 900 s: only a real hang runs into it.
    config = build_inputs(tmp_path, "slow", small_cnn, "timeout_s = 20")
    marker = hook_worker(monkeypatch, tmp_path, "hang")
    assert compile_cli(tmp_path, str(config)) == 1
    assert marker.is_file(), "the worker never reached ModelCompiler.compile_to_file"
    assert not is_alive(int(marker.read_text())), "the hung worker was left running"
    record = variant(tmp_path, "slow", "snapdragon-x-elite")
    error = record.error
    assert record.status == "failed" and error is not None and error.kind == "timeout", error
    assert error.stage == "compile"
    assert "no result after 20 s in step 'compile'" in error.message
    assert record.sets == [] and record.files == []
    err = capsys.readouterr().err
    assert "timeout in compile" in err
    log = model_paths(tmp_path, "slow").variant(installed_pin(), "snapdragon-x-elite").log
    assert "compile_to_file taken over: hang" in log.read_text()
    ctx = model_paths(tmp_path, "slow").ctx
    work = [p for p in ctx.rglob(".*")]
    assert work == [], "the worker's scratch folder was left behind"


@pytest.mark.qnn
def test_outside_kill_is_recorded_and_rebuilt_next_time(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker SIGKILLed from outside is 'killed', not the model's failure: never reused."""
    pytest.importorskip("onnxruntime_qnn")
    config = build_inputs(tmp_path, "victim", small_cnn)
    marker = hook_worker(monkeypatch, tmp_path, "kill")
    assert compile_cli(tmp_path, str(config)) == 1
    assert marker.is_file(), "the worker never reached ModelCompiler.compile_to_file"
    record = variant(tmp_path, "victim", "snapdragon-x-elite")
    error = record.error
    assert record.status == "failed" and error is not None and error.kind == "killed", error
    assert error.stage == "compile" and "SIGKILL" in error.message and error.infrastructure
    assert record.inputs_digest == ""
    err = capsys.readouterr().err
    assert "killed in compile" in err

    monkeypatch.undo()  # the next run has no hook
    marker.unlink()
    assert compile_cli(tmp_path, str(config)) == 0
    out = capsys.readouterr().out
    assert "skipped" not in out and not marker.exists()
    record = variant(tmp_path, "victim", "snapdragon-x-elite")
    assert record.status == "ok" and record.passed and record.error is None
    assert record.inputs_digest
    # Now the variant is the model's own result, and reused.
    assert compile_cli(tmp_path, str(config)) == 0
    assert "(unchanged, skipped)" in capsys.readouterr().out


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
    assert error is not None
    assert error.kind == "compose" and error.stage == "compile"
    assert "Failed to compose Qnn graph" in error.message
    assert error.op_types == ["Conv2d"] and error.qnn_error_codes == ["6007"]
    assert len(error.nodes) == 1
