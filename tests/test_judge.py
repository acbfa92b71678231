"""The HTP is the judge (pipeline/quantize/judge.py, pipeline/htp/probe.py), on the real simulator.

Small seeded models through the real quantize stage: a dilated convolution whose 16-bit weights the
HTP computes differently from the CPU (FACTS §10) is located and moved to 8 bits per channel; a
tensor whose channels differ by five decades, which no uniform 16-bit grid holds, goes to fp16 on
the HTP; without QNN the CPU decision stands and the report says so.
"""

from __future__ import annotations

import dataclasses
import json
import os
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.core.config import load_config
from pipeline.core.layout import ModelPaths
from pipeline.quantize.build import quantize_model

pytestmark = pytest.mark.qnn


def _init(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array, dtype=np.float32), name)


def _write(tmp: Path, model: onnx.ModelProto, samples: list[np.ndarray], quantization: str) -> Path:
    onnx.save(model, str(tmp / "m.onnx"))
    (tmp / "calib").mkdir()
    for i, sample in enumerate(samples):
        np.save(tmp / "calib" / f"s{i:03d}.npy", sample.astype(np.float32))
    config = tmp / "m.toml"
    config.write_text(
        textwrap.dedent(
            """
            [model]
            name = "m"
            source = "m.onnx"
            [calibration]
            kind = "tensors"
            path = "calib"
            samples = 16
            held_out = 0.25
            [quantization]
            """
        )
        + textwrap.dedent(quantization)
    )
    return config


def _report(tmp: Path) -> dict:
    return json.loads(
        (ModelPaths.of(tmp / "artifacts", "m").report.with_suffix(".json")).read_text()
    )


def _dilated_model(rng: np.random.Generator) -> onnx.ModelProto:
    """Conv 3x3 dilation 4 -> Relu -> Conv 3x3 dilation 4: what DeepLab's atrous blocks do."""
    nodes = [
        helper.make_node(
            "Conv", ["x", "w1", "b1"], ["c1"], dilations=[4, 4], pads=[4, 4, 4, 4], name="atrous1"
        ),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu"),
        helper.make_node(
            "Conv", ["r1", "w2", "b2"], ["y"], dilations=[4, 4], pads=[4, 4, 4, 4], name="atrous2"
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "dilated",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 24, 24])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 24, 24])],
        [
            _init("w1", rng.normal(0, 0.2, (16, 16, 3, 3))),
            _init("b1", rng.normal(0, 0.1, 16)),
            _init("w2", rng.normal(0, 0.2, (16, 16, 3, 3))),
            _init("b2", rng.normal(0, 0.1, 16)),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def _build_dilated_int16(
    tmp_path: Path,
    target_snr_db: float,
    monkeypatch: pytest.MonkeyPatch | None = None,
) -> dict:
    """Quantize the dilated model with both weights forced to int16 and mixed precision off;
    its report. With ``monkeypatch``, the int16 weights reach the HTP as int16 (the split into
    two int8 layers, ``qdq_htp.split_sixteen_bit_weights``, is off): the HTP computes them
    otherwise than the CPU, a divergence for the judge's rounds to find and remedy."""
    if monkeypatch is not None:
        from pipeline.graph import qdq_htp
        from pipeline.graph.edit import Change

        monkeypatch.setattr(
            qdq_htp, "split_sixteen_bit_weights", lambda m: (m, Change("split_sixteen_bit_weights"))
        )
    rng = np.random.default_rng(7)
    samples = [rng.normal(0, 1, (1, 16, 24, 24)) for _ in range(16)]
    settings = (
        'activation_type = "uint16"\nweight_type = "uint8"\nauto_mixed_precision = false\n'
        f"target_snr_db = {target_snr_db}\nmin_snr_db = 0.0\n"
        '[quantization.overrides]\ntensors = { w1 = "int16", w2 = "int16" }\n'
    )
    config = _write(tmp_path, _dilated_model(rng), samples, settings)
    quantize_model(load_config(config), tmp_path / "artifacts", force=True)
    return _report(tmp_path)


def test_int16_weights_split_into_two_int8_layers_agree_on_the_htp(tmp_path: Path):
    """The dilated Convs' int16 weights, computed as two int8 layers: the HTP agrees with the
    CPU in the first round (as int16 it lost 10 dB and more: the test below)."""
    htp = _build_dilated_int16(tmp_path, 38.0)["htp"]
    first = htp["rounds"][0]
    assert first["label"] == "as quantized" == htp["chosen"]
    assert first["ctx_vs_qdq_db"] > 60 and first["ctx_vs_float_db"] > 60
    report = _report(tmp_path)
    assert len(report["range_rules"]["split_weights"]) == 2


def test_htp_divergence_at_16_bit_weights_is_located_and_moved_to_8_bit_per_channel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    htp = _build_dilated_int16(tmp_path, 38.0, monkeypatch)["htp"]
    assert htp["judge"] == "htp", htp["reason"]
    first = htp["rounds"][0]
    assert first["label"] == "as quantized"
    # The HTP loses far more than the CPU QDQ model: 16-bit dilated weights are computed otherwise.
    assert first["qdq_vs_float_db"] - first["ctx_vs_float_db"] > 10
    assert htp["divergence"]["op_type"] == "Conv"
    assert htp["divergence"]["node"] in ("atrous1", "atrous2")
    kept = next(r for r in htp["rounds"] if r["label"] == htp["chosen"])
    assert htp["chosen"] == "weights int8 per channel"
    assert kept["ctx_vs_float_db"] > first["ctx_vs_float_db"] + 10
    assert kept["ctx_vs_qdq_db"] > 50  # the HTP reproduces 8-bit per-channel weights
    # The QDQ model on disk is the kept one: both weights int8, one scale per output channel.
    qdq = onnx.load(str(ModelPaths.of(tmp_path / "artifacts", "m").bucket("static").qdq))
    inits = {i.name: i for i in qdq.graph.initializer}
    for node in qdq.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0].startswith("w"):
            assert inits[node.input[0]].data_type == TensorProto.INT8
            assert numpy_helper.to_array(inits[node.input[1]]).shape == (16,)


def test_a_remedy_that_changes_nothing_ends_the_rounds_with_fp16(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """With every move counted as "nothing" (STALLED_DB huge), the round after the first remedy
    is the whole model in fp16, not another locate."""
    from pipeline.quantize import judge

    monkeypatch.setattr(judge, "STALLED_DB", 1e9)
    htp = _build_dilated_int16(tmp_path, 70.0, monkeypatch)["htp"]
    labels = [r["label"] for r in htp["rounds"]]
    assert labels[-1] == "whole model in fp16" and labels.count("the HTP diverges (locate)") == 1
    assert any("moved the context by under" in r for r in htp["remedies"]), htp["remedies"]


def _imbalanced_model(rng: np.random.Generator) -> onnx.ModelProto:
    """A Conv whose output channels span five decades (a BN-folded dead channel next to live
    ones), then a 1x1 Conv that reads the tiny channel with a huge weight: no uniform 16-bit grid
    holds both, so quantization cannot meet the target; fp16 on the HTP can."""
    scale = np.ones((8, 1, 1, 1), np.float32)
    scale[0] = 2000.0  # one huge channel sets the range
    scale[1] = 0.01  # one tiny channel carries the signal
    w1 = rng.normal(0, 0.3, (8, 4, 3, 3)).astype(np.float32) * scale
    w2 = rng.normal(0, 0.05, (4, 8, 1, 1)).astype(np.float32)
    w2[:, 1] = 60.0  # ... amplified by the next layer
    w2[:, 0] = 1e-4
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], name="imbalanced"),
        helper.make_node("Conv", ["c1", "w2"], ["y"], name="reader"),
    ]
    graph = helper.make_graph(
        nodes,
        "imbalanced",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, 16])],
        [_init("w1", w1), _init("w2", w2)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def _build_imbalanced(tmp_path: Path, target_snr_db: float) -> dict:
    """Quantize the imbalanced model (u16 activations, u8 weights); its report."""
    rng = np.random.default_rng(11)
    samples = [rng.normal(0, 1, (1, 4, 16, 16)) for _ in range(16)]
    settings = (
        f'activation_type = "uint16"\nweight_type = "uint8"\ntarget_snr_db = {target_snr_db}\n'
        "min_snr_db = 0.0\n"
    )
    config = _write(tmp_path, _imbalanced_model(rng), samples, settings)
    quantize_model(load_config(config), tmp_path / "artifacts", force=True)
    return _report(tmp_path)


def test_what_no_16_bit_grid_holds_goes_to_fp16_on_the_htp(tmp_path: Path):
    report = _build_imbalanced(tmp_path, 30.0)
    htp = report["htp"]
    assert htp["judge"] == "htp", htp["reason"]
    # Quantized, the tiny channel is lost: even every tensor at 16 bits is far short on the CPU,
    # so mixed precision skips its analysis and the HTP runs the whole model in fp16 first.
    mixed = report["mixed_precision"]
    assert mixed["ceiling_snr_db"] < 10 and mixed["measured"] == 0 and mixed["tensors"] == []
    assert [r["label"] for r in htp["rounds"]] == ["whole model in fp16"]
    assert any("dB short on the CPU" in r for r in htp["remedies"])
    kept = next(r for r in htp["rounds"] if r["label"] == htp["chosen"])
    assert "float16" in htp["chosen"] or "fp16" in htp["chosen"]
    assert kept["ctx_vs_float_db"] >= 30 and kept["partitions"] == 1 and kept["cpu_nodes"] == 0
    assert "c1" in htp["float16"] or htp["whole_float16"]
    if htp["whole_float16"]:  # nothing quantized: the gate judges what the HTP computes
        assert float(report["worst_snr_db"]) == pytest.approx(kept["ctx_vs_float_db"])
    # The kept candidate ran on the validation samples too: its run is what compile reuses.
    from pipeline.core.fileio import sha256_file
    from pipeline.core.records import HtpProbeRecord, read_record

    bucket = ModelPaths.of(tmp_path / "artifacts", "m").bucket("static")
    record, why = read_record(HtpProbeRecord, bucket.htp_probe)
    assert record is not None, why
    assert record.qdq_sha256 == sha256_file(bucket.qdq)
    assert round(min(a.snr_db for a in record.ctx_vs_float.values()), 6) == round(
        kept["ctx_vs_float_db"], 6
    )


def test_a_quantized_model_5_db_short_on_the_cpu_goes_to_fp16_first(tmp_path: Path):
    """7 dB short (the imbalanced model at 0 dB, the target 7): more than the HTP has ever made
    up over the CPU QDQ model, so the quantized model's round is not run before fp16's, which
    passes and ends the judging."""
    htp = _build_imbalanced(tmp_path, 7.0)["htp"]
    assert [r["label"] for r in htp["rounds"]] == ["whole model in fp16"], htp["rounds"]
    assert any("7 dB short on the CPU" in r for r in htp["remedies"]), htp["remedies"]


def test_a_raise_the_ceiling_rules_out_is_not_searched_again(tmp_path: Path, monkeypatch):
    """4 dB short (the imbalanced model at 0 dB, the target 4): the quantized model runs, the
    HTP agrees with the CPU QDQ model, so the judge would raise more tensors to 16 bits on the
    CPU; mixed precision measured already that every 8-bit tensor at 16 bits stays under 1 dB,
    so that search is not run a second time (it re-quantized and re-measured the same ceiling:
    15 s on a YOLOX-nano), and the judging goes on to the tensors in fp16 as before."""
    from pipeline.quantize import build

    aims: list[float] = []
    real = build.raise_precision

    def counted(config, *args, **kwargs):
        aims.append(config.quantization.target_snr_db)
        return real(config, *args, **kwargs)

    monkeypatch.setattr(build, "raise_precision", counted)
    report = _build_imbalanced(tmp_path, 4.0)
    mixed, htp = report["mixed_precision"], report["htp"]
    assert mixed["ceiling_snr_db"] < mixed["before_snr_db"] + 3.0 and mixed["tensors"] == []
    first = htp["rounds"][0]
    assert first["label"] == "as quantized" and first["ctx_vs_float_db"] < 4.0
    assert first["ctx_vs_qdq_db"] == "inf" or float(first["ctx_vs_qdq_db"]) > 7.0  # agreeing
    assert aims == [4.0], aims  # mixed precision's own search only
    assert htp["chosen"] != "as quantized" and _score_of(htp) >= 4.0


def _score_of(htp: dict) -> float:
    return float(next(r for r in htp["rounds"] if r["label"] == htp["chosen"])["ctx_vs_float_db"])


def test_fp16_first_still_runs_the_quantized_model_when_it_falls_short(tmp_path: Path):
    """A target even fp16 misses: the quantized model runs too, and the better one is kept."""
    htp = _build_imbalanced(tmp_path, 150.0)["htp"]
    labels = [r["label"] for r in htp["rounds"]]
    assert labels[:2] == ["whole model in fp16", "as quantized"], labels
    assert htp["chosen"] == "whole model in fp16" and htp["whole_float16"]
    qdq = ModelPaths.of(tmp_path / "artifacts", "m").bucket("static").qdq
    assert not any(n.op_type == "QuantizeLinear" for n in onnx.load(str(qdq)).graph.node)
    report = ModelPaths.of(tmp_path / "artifacts", "m").report.read_text("utf-8")
    assert "SNR fp16 model vs float (dB)" in report and "SNR QDQ vs float" not in report
    # Its CPU figure is the float32 graph's, and the table says so.
    assert "For the whole model in fp16 the CPU column is its float32 graph" in report
    # Nothing passed: the report says whether the float model itself could (fp16's rounding of
    # its inputs alone leaves it ~70 dB from itself, far under 150 dB).
    assert any("the float model itself: fp16's rounding" in r for r in htp["remedies"])


def test_cpu_judge_keeps_the_cpu_decision_and_says_so(tmp_path: Path):
    rng = np.random.default_rng(3)
    samples = [rng.normal(0, 1, (1, 16, 24, 24)) for _ in range(16)]
    config = _write(tmp_path, _dilated_model(rng), samples, 'judge = "cpu"\n')
    quantize_model(load_config(config), tmp_path / "artifacts", force=True)
    htp = _report(tmp_path)["htp"]
    assert htp["judge"] == "cpu" and "quantization.judge = 'cpu'" in htp["reason"]
    assert htp["rounds"] == []
    assert "Judged on the HTP" in (tmp_path / "artifacts/build/m/report.md").read_text()


def _judged_for_compile(tmp_path: Path) -> tuple[Any, Path, ModelPaths, Path]:
    """The dilated model quantized with the HTP judge: (config, artifacts, its paths, the
    judge's probe record of its bucket)."""
    rng = np.random.default_rng(5)
    samples = [rng.normal(0, 1, (1, 16, 24, 24)) for _ in range(16)]
    config = load_config(_write(tmp_path, _dilated_model(rng), samples, ""))
    artifacts = tmp_path / "artifacts"
    quantize_model(config, artifacts, force=True)
    paths = ModelPaths.of(artifacts, "m")
    return config, artifacts, paths, paths.bucket("static").htp_probe


def test_compile_reuses_the_judges_figures_for_the_same_ctx_and_only_then(tmp_path: Path):
    """The judge's first probe runs the ctx compile would build (same bytes) on the samples it
    would validate on; compile reuses those figures, proven by digests, and measures itself as
    soon as any digest differs. The reused figures equal the ones it measures itself."""
    from pipeline.compile.build import compile_model
    from pipeline.core.records import VariantRecord, read_record
    from qnn_ctx_runtime import qnn
    from qnn_ctx_runtime.toolchains import load_toolchains

    config, artifacts, paths, probe = _judged_for_compile(tmp_path)
    assert probe.is_file()
    table = load_toolchains()
    toolchain = table.get(table.default)

    def compiled(force: bool) -> VariantRecord:
        compile_model(config, artifacts, table, toolchain, qnn.installed_qnn(), force, out=str)
        folder = paths.variant(toolchain.onnxruntime_qnn, config.compile.targets[0])
        record, why = read_record(VariantRecord, folder.record)
        assert record is not None, why
        return record

    first = compiled(force=True)
    reused = first.validation
    assert reused.measured_by.startswith("the quantize stage's HTP judge")
    # The QDQ model's online-compile load is the judge's offline compile of it, not a second one.
    from pipeline.compile.worker import JUDGE_LOAD

    judge_compile_s = json.loads(probe.read_text())["compile_s"]
    assert first.load.qdq_timed_by == JUDGE_LOAD and first.load.qdq_s == judge_compile_s > 0
    # Compile adopted the very context the judge ran instead of compiling it again.
    from pipeline.core.fileio import sha256_file

    folder = paths.variant(toolchain.onnxruntime_qnn, config.compile.targets[0])
    (ctx,) = folder.root.glob("*_ctx.onnx")
    judged = json.loads(probe.read_text())["ctx_sha256"]
    assert sha256_file(ctx) == judged == sha256_file(paths.bucket("static").htp_probe_ctx)
    assert "No worker ran for this variant" in folder.log.read_text()
    assert reused.samples == 16 // 4  # every held-out sample (held_out = 0.25)
    # A probe record that no longer matches the ctx: compile runs the simulator itself.
    record = json.loads(probe.read_text())
    probe.write_text(json.dumps({**record, "ctx_sha256": "0" * 64}))
    measured = compiled(force=True).validation
    assert measured.measured_by == ""
    assert measured.ctx_vs_qdq == reused.ctx_vs_qdq and measured.ctx_vs_float == reused.ctx_vs_float
    # The record of another QDQ model: compile compiles the context itself, and that offline
    # compile of this QDQ model is the online-compile figure (not a second compile).
    from pipeline.compile.worker import OWN_COMPILE

    probe.write_text(json.dumps({**record, "qdq_sha256": "0" * 64}))
    own = compiled(force=True)
    timed = own.load
    assert "adopted" not in folder.log.read_text()
    assert timed.qdq_timed_by == OWN_COMPILE and timed.qdq_s is not None
    assert own.compile_time_s is not None and 0 < timed.qdq_s <= own.compile_time_s


def test_the_judges_variant_needs_no_worker_and_is_the_one_a_worker_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """When the judge's child compiled, ran and timed the very ctx compile would build, compile
    starts no worker for it (none is warmed up either) and writes the record a worker writes
    from the same bytes: the same ctx, coverage, I/O and validation; the load times the
    judge's child measured. A probe record from before that timing: a worker builds it."""
    from pipeline.compile import build as compile_build
    from pipeline.compile import child, worker
    from pipeline.compile.build import compile_model, variants_to_build
    from pipeline.core.records import VariantRecord, read_record
    from qnn_ctx_runtime import qnn
    from qnn_ctx_runtime.toolchains import load_toolchains

    config, artifacts, paths, probe = _judged_for_compile(tmp_path)
    load = json.loads(probe.read_text())["load"]
    assert load["runs"] == 3 and load["ctx_load_s"] > 0 and load["inputs"][0]["name"] == "x"
    table = load_toolchains()
    toolchain = table.get(table.default)
    installed = qnn.installed_qnn()
    workers: list[str] = []
    real_run_child = child.run_child

    def counted(job, *args, **kwargs):
        workers.append(job.target)
        return real_run_child(job, *args, **kwargs)

    monkeypatch.setattr(compile_build, "run_child", counted)
    folder = paths.variant(toolchain.onnxruntime_qnn, config.compile.targets[0])

    def compiled() -> VariantRecord:
        compile_model(config, artifacts, table, toolchain, installed, True, out=str)
        record, why = read_record(VariantRecord, folder.record)
        assert record is not None, why
        return record

    assert variants_to_build(config, artifacts, table, toolchain, installed, True) == 0
    judged = compiled()
    assert workers == [] and judged.passed and judged.status == "ok"
    assert "No worker ran for this variant" in folder.log.read_text()
    assert judged.load.ctx_s == load["ctx_load_s"] and judged.load.ratio > 1
    assert judged.memory.rss_one_bucket_bytes >= judged.memory.rss_before_bytes > 0

    monkeypatch.setattr(worker, "judged_variant", lambda job, installed: None)
    built = compiled()
    assert workers == [config.compile.targets[0]]
    assert "the HTP judge's context, adopted" in folder.log.read_text()
    assert built.coverage == judged.coverage and built.coverage.qnn_partitions == 1
    assert (built.inputs, built.outputs) == (judged.inputs, judged.outputs)
    assert built.validation == judged.validation  # both the judge's run on those samples
    assert [s.facts for s in built.sets] == [s.facts for s in judged.sets]  # the same ctx bytes
    assert built.load.qdq_s == judged.load.qdq_s  # the judge's offline compile, in both

    monkeypatch.undo()
    # This path failing other than on the disk (here: its coverage account) is not the
    # variant's failure: a worker builds it, as it builds every other variant.
    monkeypatch.setattr(compile_build, "run_child", counted)

    def broken(*args, **kwargs):
        raise RuntimeError("an account this path cannot read")

    monkeypatch.setattr(worker.coverage_mod, "summarize", broken)
    assert compiled().coverage == judged.coverage and len(workers) == 2
    assert "stage: register" in folder.log.read_text()
    monkeypatch.undo()
    record = json.loads(probe.read_text())
    probe.write_text(json.dumps({k: v for k, v in record.items() if k != "load"}))
    assert variants_to_build(config, artifacts, table, toolchain, installed, True) == 1
    monkeypatch.setattr(compile_build, "run_child", counted)
    assert compiled().coverage == judged.coverage and len(workers) == 3


def _cpu_judged_dilated(tmp_path: Path, seed: int, count: int = 16) -> tuple[Any, list[Path]]:
    """The dilated model quantized without the HTP judge: its bucket and held-out samples (a
    quarter of ``count``)."""
    rng = np.random.default_rng(seed)
    samples = [rng.normal(0, 1, (1, 16, 24, 24)) for _ in range(count)]
    config_path = _write(tmp_path, _dilated_model(rng), samples, 'judge = "cpu"\n')
    config_path.write_text(config_path.read_text().replace("samples = 16", f"samples = {count}"))
    config = load_config(config_path)
    quantize_model(config, tmp_path / "artifacts", force=True)
    bucket = ModelPaths.of(tmp_path / "artifacts", "m").bucket("static")
    return bucket, sorted(bucket.heldout.glob("sample_*.npz"))


# Sitecustomize for the probe's processes (tests/test_compile.py's way of making a hang or a
# death real): the main child's first HTP run waits for a helper's claim, so a helper always
# joins, whatever the speed; with "die" the helper then kills itself holding its claim.
PROBE_HOOK = """\
import os
import signal
import sys
import time
from pathlib import Path

import onnxruntime

_run = onnxruntime.InferenceSession.run
_first = []


def _hooked(self, *args, **kwargs):
    job = Path(sys.argv[-1])
    if not _first and job.name.startswith("probe_"):
        _first.append(1)
        stash = job.parent / "htp_outputs"
        if job.name == "probe_job.json":
            mine = str(os.getpid())
            while not [c for c in stash.glob("*.claim") if c.read_text() not in ("", mine)]:
                time.sleep(0.01)
        elif {action!r} == "die":
            os.kill(os.getpid(), signal.SIGKILL)
    return _run(self, *args, **kwargs)


onnxruntime.InferenceSession.run = _hooked
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity"), reason="Linux pinning")
@pytest.mark.parametrize("action", ["help", "die"])
def test_helpers_on_other_cores_measure_what_one_child_does_and_a_dead_one_costs_nothing(
    tmp_path: Path, monkeypatch, action: str
):
    """Helpers started with the probe (pinned, loading the main child's context once it is
    compiled, claiming samples from the back) give the figures of one child running every
    sample; a helper that dies holding a claim leaves its sample to the main child."""
    import os

    from pipeline.htp import probe as probe_mod

    bucket, heldout = _cpu_judged_dilated(tmp_path, seed=5)
    assert len(heldout) == 4

    def run(work: str):
        result = probe_mod.probe(
            bucket.qdq, bucket.float_model, heldout, tmp_path / work, 60, 73, timeout_s=300
        )
        assert result.ok, result.error
        return result

    monkeypatch.setattr(probe_mod, "_cores", lambda count, locate: [])
    one = run("one")  # one process runs every sample
    assert not list((tmp_path / "one").glob("probe_helper_*"))
    core = min(os.sched_getaffinity(0))
    monkeypatch.setattr(probe_mod, "_cores", lambda count, locate: [core, core])
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(PROBE_HOOK.format(action=action))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p)
    )
    shared = run("shared")
    helper_log = (tmp_path / "shared" / "probe_helper_1.log").read_text()
    helper_file = tmp_path / "shared" / "probe_helper_1.json"
    delivered = json.loads(helper_file.read_text())["samples"] if helper_file.is_file() else 0
    # The parent ends a helper still running when the main child is done: on a loaded machine
    # that can be after its last sample and before its final "ok". What it delivered counts.
    if action == "die":
        assert delivered == 0, helper_log
    else:
        assert delivered >= 1, helper_file.read_text()
    assert shared.samples == one.samples == 4
    assert shared.ctx_sha256 == one.ctx_sha256 and shared.sample_sha256 == one.sample_sha256
    assert (shared.partitions, shared.cpu_nodes) == (one.partitions, one.cpu_nodes) == (1, 0)
    assert shared.ctx_vs_float == one.ctx_vs_float
    assert shared.ctx_vs_qdq == one.ctx_vs_qdq and shared.qdq_vs_float == one.qdq_vs_float


# Sitecustomize for the probe's processes: the main child dies (SIGKILL, as a native abort
# would end it) creating its second session on the ctx, i.e. while timing its load.
DIES_TIMING_LOAD = """\
import os
import signal
import sys

import onnxruntime

_init = onnxruntime.InferenceSession.__init__
_ctx_sessions = []


def _hooked(self, path, *args, **kwargs):
    if sys.argv[-1].endswith("probe_job.json") and str(path).endswith("_ctx.onnx"):
        _ctx_sessions.append(path)
        if len(_ctx_sessions) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
    return _init(self, path, *args, **kwargs)


onnxruntime.InferenceSession.__init__ = _hooked
"""


def test_a_death_while_timing_the_load_leaves_the_run_standing(tmp_path: Path, monkeypatch):
    """The judge's child times its ctx's load after its run is saved: a native death there
    leaves the run's figures as measured, only without the load (compile then uses a worker)."""
    import os

    from pipeline.htp import probe as probe_mod

    bucket, heldout = _cpu_judged_dilated(tmp_path, seed=5)
    monkeypatch.setattr(probe_mod, "_cores", lambda count, locate: [])

    def run(work: str):
        return probe_mod.probe(
            bucket.qdq, bucket.float_model, heldout, tmp_path / work, 60, 73, timeout_s=300
        )

    whole = run("whole")
    assert whole.ok and whole.load is not None and whole.load.runs == probe_mod.LOAD_RUNS
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(DIES_TIMING_LOAD)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p)
    )
    died = run("died")
    assert died.ok and died.load is None, died.error
    assert died.stage == "done" and died.samples == whole.samples == len(heldout)
    assert died.ctx_vs_float == whole.ctx_vs_float and died.ctx_vs_qdq == whole.ctx_vs_qdq


# Sitecustomize for the probe's processes: the main child kills itself with SIGKILL at its
# first session run, as the kernel's out-of-memory killer does (an outside kill).
MAIN_KILLED = """\
import os
import signal
import sys
from pathlib import Path

import onnxruntime

_run = onnxruntime.InferenceSession.run


def _killed(self, *args, **kwargs):
    if Path(sys.argv[-1]).name == "probe_job.json":
        print("# LIBNATIVE: start-up noise, as QNN prints it", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return _run(self, *args, **kwargs)


onnxruntime.InferenceSession.run = _killed
"""


def test_a_probe_killed_from_outside_says_so_not_qnns_start_up_noise(
    tmp_path: Path, monkeypatch
) -> None:
    """A SIGKILL from outside (the OOM killer on a 45 MB diffusion UNet's quantized compile)
    read "died in compile (signal SIGKILL): # LIBNATIVE: No alternate configuration..." (QNN's
    start-up line, not the cause); it now says who kills that way."""
    import os

    from pipeline.htp import probe as probe_mod

    bucket, heldout = _cpu_judged_dilated(tmp_path, seed=5, count=4)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(MAIN_KILLED)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p)
    )
    monkeypatch.setattr(probe_mod, "_cores", lambda count, locate: [])
    result = probe_mod.probe(
        bucket.qdq, bucket.float_model, heldout, tmp_path / "w", 60, 73, timeout_s=300
    )
    assert not result.ok
    assert "signal SIGKILL, killed from outside the build" in result.error, result.error
    assert "out-of-memory killer" in result.error and "LIBNATIVE" not in result.error


# Sitecustomize for the probe's process: every session run first sleeps (a loaded machine: the
# wall clock stretches, the simulator's CPU time does not).
SLOW_WALL_CLOCK = """\
import time

import onnxruntime

_run = onnxruntime.InferenceSession.run


def _sleepy(self, *args, **kwargs):
    time.sleep(0.5)
    return _run(self, *args, **kwargs)


onnxruntime.InferenceSession.run = _sleepy
"""


def test_the_simulators_pace_is_its_cpu_time_not_the_wall_clock(tmp_path: Path, monkeypatch):
    """Each HTP run half a second late by the wall clock (a sleep, as a busy machine would make
    it): the pace the judge's rules read (SLOW_SAMPLE_S, the budget) stays the simulator's own
    CPU time, so the same build takes the same rounds and samples however busy the machine."""
    result = _probe_with_hook(tmp_path, monkeypatch, SLOW_WALL_CLOCK)
    assert result.seconds > 0.5 * 4  # the sleeps happened
    assert 0 < result.seconds_per_sample < 0.4, result.seconds_per_sample


# Sitecustomize for the probe's process: every session run first has another thread compute
# for 0.5 s of its own user CPU time (however fast the machine), as the simulator's HVX threads
# do for some graphs.
WORK_IN_ANOTHER_THREAD = """\
import resource
import threading

import onnxruntime

_run = onnxruntime.InferenceSession.run


def _busy():
    while resource.getrusage(resource.RUSAGE_THREAD).ru_utime < 0.5:
        for _ in range(100_000):
            pass


def _helped(self, *args, **kwargs):
    worker = threading.Thread(target=_busy)
    worker.start()
    worker.join()
    return _run(self, *args, **kwargs)


onnxruntime.InferenceSession.run = _helped
"""


def test_the_simulators_pace_counts_its_own_threads(tmp_path: Path, monkeypatch):
    """The simulator computes some graphs in its own HVX threads while the calling thread waits
    (gtcrn's GRUs: 0.13 s of the caller's CPU a sample, 0.62 s of the process's): their CPU time
    is the pace too, or a slow model would pass for a quick one under SLOW_SAMPLE_S and the
    budget."""
    result = _probe_with_hook(tmp_path, monkeypatch, WORK_IN_ANOTHER_THREAD)
    assert result.seconds_per_sample >= 0.5, result.seconds_per_sample


def _probe_with_hook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hook_source: str):
    """The probe (one process) on a small dilated model's 4 held-out samples, with
    ``hook_source`` as the child's sitecustomize."""
    from pipeline.htp import probe as probe_mod

    bucket, heldout = _cpu_judged_dilated(tmp_path, seed=5)
    monkeypatch.setattr(probe_mod, "_cores", lambda count, locate: [])  # one process
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(hook_source)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p)
    )
    result = probe_mod.probe(
        bucket.qdq, bucket.float_model, heldout, tmp_path / "p", 60, 73, timeout_s=300
    )
    assert result.ok and result.samples == len(heldout) == 4, result.error
    return result


def test_a_helper_loads_the_context_only_while_samples_are_left(tmp_path: Path):
    """A helper waits for the main child's compile; it bows out when the child failed or ended,
    or has claimed every sample (a quick model), and joins while some sample is unclaimed."""
    from pipeline.htp import probe as probe_mod

    stash = tmp_path / probe_mod.STASH
    stash.mkdir()
    job = probe_mod.ProbeJob(
        qdq="",
        float_model="",
        samples=["a", "b"],
        work=str(tmp_path),
        result="",
        soc_model=60,
        htp_arch=73,
        helper=True,
    )
    main = tmp_path / probe_mod.RESULT_NAME

    def ready(**state) -> bool:
        main.write_text(json.dumps(state))
        return probe_mod._context_ready(job, stash)

    assert ready(status="running", stage="run")
    assert ready(status="running", stage="load")
    (stash / "0000.claim").write_text("1")
    assert ready(status="running", stage="run")
    (stash / "0001.claim").write_text("1")
    assert not ready(status="running", stage="run")
    assert not ready(status="failed", stage="compile")
    assert not ready(status="running", stage="compare")


def test_probes_started_ahead_take_the_first_job_and_unused_ones_end(tmp_path: Path):
    """``spare_probes`` starts the probe's processes ahead (warming up while the stage works):
    the first probe hands them its job and measures what a cold start does; later probes start
    their own; whatever was not taken ends with the block, its folder removed."""
    from pipeline.htp import probe as probe_mod

    bucket, heldout = _cpu_judged_dilated(tmp_path, seed=6)

    def run(work: str) -> probe_mod.ProbeResult:
        result = probe_mod.probe(
            bucket.qdq, bucket.float_model, heldout, tmp_path / work, 60, 73, timeout_s=300
        )
        assert result.ok, result.error
        return result

    cold = run("cold")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with probe_mod.spare_probes(scratch):
        spares = probe_mod._SPARES
        assert spares is not None
        warm = run("warm")
        assert probe_mod._SPARES is None  # taken by the first probe
        job = json.loads((spares.folder / "main.json").read_text())
        assert job["work"] == str((tmp_path / "warm").resolve())  # it ran the warm probe's job
        assert spares.main.proc.returncode == 0
        again = run("again")  # started cold: nothing is left to take
        assert not list(spares.folder.glob("*again*"))
    assert not spares.folder.exists()
    for result in (warm, again):
        assert result.samples == cold.samples and result.sample_sha256 == cold.sample_sha256
        assert result.ctx_vs_float == cold.ctx_vs_float and result.ctx_vs_qdq == cold.ctx_vs_qdq
        assert (result.partitions, result.cpu_nodes) == (1, 0)

    with probe_mod.spare_probes(scratch):  # never taken: every process ends with the block
        spares = probe_mod._SPARES
        assert spares is not None
        children = [spares.main, *spares.helpers]
    assert all(child.proc.returncode is not None for child in children)
    assert not spares.folder.exists() and probe_mod._SPARES is None


def _dilated_with_ten_heldout(tmp_path: Path) -> Any:
    """The dilated model's config with 30 calibration and 10 held-out samples."""
    rng = np.random.default_rng(7)
    samples = [rng.normal(0, 1, (1, 16, 24, 24)) for _ in range(40)]
    config_path = _write(tmp_path, _dilated_model(rng), samples, "")
    config_path.write_text(config_path.read_text().replace("samples = 16", "samples = 40"))
    return load_config(config_path)


def test_the_simulators_time_budget_leaves_samples_out_and_says_so(tmp_path: Path, monkeypatch):
    """A model the simulator takes minutes a sample on (a 1024x1024 segmenter) cannot run 16
    samples: past the budget no new sample starts once two ran (one per process). The figures
    are those of the samples that ran, exactly what a run on only those measures; the report
    says how many of how many; compile adopts that run and says so, and its own validation
    keeps the same budget. A budget of a microsecond makes the cut certain, whatever the speed."""
    from pipeline.compile import build as compile_build
    from pipeline.compile.build import compile_model
    from pipeline.core.records import VariantRecord, read_record
    from pipeline.htp import probe as probe_mod
    from pipeline.quantize import judge as judge_mod
    from qnn_ctx_runtime import qnn
    from qnn_ctx_runtime.toolchains import load_toolchains

    config = _dilated_with_ten_heldout(tmp_path)
    artifacts = tmp_path / "artifacts"
    monkeypatch.setattr(judge_mod, "HTP_BUDGET_S", 1e-6)
    monkeypatch.setattr(judge_mod, "AGREE_MARGIN_DB", 1000.0)  # no stop on agreement
    quantize_model(config, artifacts, force=True)
    first = _report(tmp_path)["htp"]["rounds"][0]
    assert first["requested"] == 10 and 2 <= first["samples"] < 10, first
    assert "The simulator took up to" in ModelPaths.of(artifacts, "m").report.read_text()

    paths = ModelPaths.of(artifacts, "m")
    bucket = paths.bucket("static")
    record = json.loads(bucket.htp_probe.read_text())
    assert len(record["sample_sha256"]) == first["samples"] and record["requested"] == 10
    from pipeline.core.fileio import sha256_file

    heldout = sorted(bucket.heldout.glob("sample_*.npz"))
    ran = [p for p in heldout if sha256_file(p) in record["sample_sha256"]]
    alone = probe_mod.probe(
        bucket.qdq, bucket.float_model, ran, tmp_path / "alone", 60, 73, timeout_s=300
    )
    assert alone.ok and alone.samples == len(ran) == first["samples"]
    assert alone.ctx_vs_qdq == record_accuracy(record["ctx_vs_qdq"], alone.ctx_vs_qdq)

    table = load_toolchains()
    toolchain = table.get(table.default)

    def compiled() -> VariantRecord:
        compile_model(config, artifacts, table, toolchain, qnn.installed_qnn(), True, out=str)
        folder = paths.variant(toolchain.onnxruntime_qnn, config.compile.targets[0])
        variant, why = read_record(VariantRecord, folder.record)
        assert variant is not None, why
        return variant

    adopted = compiled().validation
    assert adopted.measured_by.startswith("the quantize stage's HTP judge")
    assert (adopted.samples, adopted.requested) == (first["samples"], 10)
    notes = paths.ctx_report.read_text()
    assert f"validated on {first['samples']} of 10 held-out samples" in notes
    # Its own validation (the judge's record no longer matches) keeps the same budget.
    bucket.htp_probe.write_text(json.dumps({**record, "ctx_sha256": "0" * 64}))
    monkeypatch.setattr(compile_build, "HTP_BUDGET_S", 1e-6)
    own = compiled().validation
    assert own.measured_by == "" and (own.samples, own.requested) == (2, 10)


@pytest.mark.parametrize("stop", ["evidence", "agreement", "evidence, outputs too large to keep"])
def test_a_round_stops_once_enough_samples_are_well_above_the_target(
    tmp_path: Path, monkeypatch, stop: str
):
    """The dilated model is at ~41 dB on the HTP, the target 25: once 4 samples spread over
    the held-out ones have each run 3 dB or more above it, no new one starts (a process that
    finds the last of them running waits for it). Its ctx is ~75 dB from the CPU QDQ model,
    which is ~41 dB from float on every held-out sample: 2 samples then suffice (agreement;
    without it, evidence: a margin no ctx reaches). The figures are exactly a run on those
    samples alone; the report and compile's adopted validation say why fewer ran. Where this
    process could not keep the float model's outputs in memory (a Zero-DCE's 7 MiB a sample:
    every round ran all 12 samples), the judge writes them to disk as they are needed."""
    from pipeline.compile.build import compile_model
    from pipeline.core.fileio import sha256_file
    from pipeline.core.layout import AGREE_SAMPLES, ENOUGH_SAMPLES
    from pipeline.core.records import VariantRecord, read_record
    from pipeline.htp import probe as probe_mod
    from pipeline.quantize import evaluate as evaluate_mod
    from pipeline.quantize import judge as judge_mod
    from qnn_ctx_runtime import qnn
    from qnn_ctx_runtime.toolchains import load_toolchains

    if stop.startswith("evidence"):
        monkeypatch.setattr(judge_mod, "AGREE_MARGIN_DB", 1000.0)
    if stop.startswith("evidence, "):  # agreement needs the CPU QDQ model's, kept in memory
        monkeypatch.setattr(evaluate_mod, "KEEP_BYTES", 0)
        stop = "evidence"
    count = ENOUGH_SAMPLES if stop == "evidence" else AGREE_SAMPLES
    config = _dilated_with_ten_heldout(tmp_path)
    artifacts = tmp_path / "artifacts"
    quantize_model(config, artifacts, force=True)
    first = _report(tmp_path)["htp"]["rounds"][0]
    assert first["cut_by"] == stop, first
    assert (first["requested"], first["samples"]) == (10, count), first
    assert first["ctx_vs_float_db"] >= 28.0
    paths = ModelPaths.of(artifacts, "m")
    told = {
        "evidence": "A round stops starting samples once 4",
        "agreement": "The first round stopped after 2 samples",
    }
    assert told[stop] in paths.report.read_text()

    bucket = paths.bucket("static")
    record = json.loads(bucket.htp_probe.read_text())
    assert record["cut_by"] == stop and len(record["sample_sha256"]) == first["samples"]
    heldout = sorted(bucket.heldout.glob("sample_*.npz"))
    ran = [p for p in heldout if sha256_file(p) in record["sample_sha256"]]
    # The same ones whoever ran them: spread over the 10, first of every process's claim order.
    assert ran == [heldout[i] for i in (0, 3, 6, 9)[:count]]
    alone = probe_mod.probe(
        bucket.qdq, bucket.float_model, ran, tmp_path / "alone", 60, 73, timeout_s=300
    )
    assert alone.ok and alone.cut_by == "" and alone.samples == len(ran)
    assert alone.ctx_vs_float == record_accuracy(record["ctx_vs_float"], alone.ctx_vs_float)

    table = load_toolchains()
    toolchain = table.get(table.default)
    compile_model(config, artifacts, table, toolchain, qnn.installed_qnn(), True, out=str)
    folder = paths.variant(toolchain.onnxruntime_qnn, config.compile.targets[0])
    variant, why = read_record(VariantRecord, folder.record)
    assert variant is not None, why
    adopted = variant.validation
    assert adopted.measured_by.startswith("the quantize stage's HTP judge")
    assert (adopted.samples, adopted.requested, adopted.cut_by) == (first["samples"], 10, stop)
    noted = {
        "evidence": "pooled, they reached the target SNR vs float",
        "agreement": "the HTP agreed with the CPU QDQ model",
    }
    assert noted[stop] in paths.ctx_report.read_text()
    # A variant the judge did not run (another target or toolchain; here its record no longer
    # matches) validates itself and stops by the same rule, on the same 4 samples.
    bucket.htp_probe.write_text(json.dumps({**record, "ctx_sha256": "0" * 64}))
    compile_model(config, artifacts, table, toolchain, qnn.installed_qnn(), True, out=str)
    own, why = read_record(VariantRecord, folder.record)
    assert own is not None, why
    check = own.validation
    assert check.measured_by == "" and check.cut_by == "evidence", check
    assert (check.samples, check.requested) == (ENOUGH_SAMPLES, 10)
    assert check.worst_snr_vs_float_db >= 28.0


def _outlier_row_matmul() -> tuple[onnx.ModelProto, list[np.ndarray]]:
    """A MatMul whose weight's first row is 40x the others, read by a feature 40x smaller: one
    int8 scale per output column spends its steps on that row, the other rows, which make the
    output, keep ~3 of them (20.4 dB on the CPU); at 16 bits the weight is exact."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    w[0, :] *= 40.0
    model = helper.make_model(
        helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["y"])],
            "m",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 64])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 32])],
            [numpy_helper.from_array(w, "w")],
        ),
        opset_imports=[helper.make_opsetid("", 21)],
    )
    model.ir_version = 10
    samples = [rng.standard_normal((1, 8, 64)) for _ in range(16)]
    for sample in samples:
        sample[..., 0] /= 40.0
    return model, samples


def test_a_context_short_where_the_htp_agrees_gets_more_16_bit_tensors(tmp_path: Path, monkeypatch):
    """The CPU QDQ model is at 20.4 dB, the target 20: mixed precision does not run. The first
    round's figure vs float is lowered by 2 dB (as an HTP that lost that much would give; its
    figure vs the CPU QDQ model, ~60 dB, is left as measured): the judge raises the CPU QDQ
    model's precision to the target plus that loss (plus mixed precision's margin) instead of
    leaving tensors in fp16, and the next round, run as it is, passes."""
    from pipeline.core.accuracy import Accuracy
    from pipeline.quantize import judge as judge_mod

    model, samples = _outlier_row_matmul()
    config = _write(tmp_path, model, samples, "min_snr_db = 15.0\ntarget_snr_db = 20.0\n")
    real_probe, calls = judge_mod.probe, []

    def lost_two_db(*args: Any, **kwargs: Any) -> Any:
        result = real_probe(*args, **kwargs)
        calls.append(result)
        if len(calls) == 1:
            result.ctx_vs_float = {
                name: Accuracy(a.snr_db - 2.0, a.max_abs, a.cosine)
                for name, a in result.ctx_vs_float.items()
            }
        return result

    monkeypatch.setattr(judge_mod, "probe", lost_two_db)
    quantize_model(load_config(config), tmp_path / "artifacts", force=True)
    report = _report(tmp_path)
    assert report["mixed_precision"]["tensors"] == []  # 20.4 dB at 8 bits: not run
    first, second = report["htp"]["rounds"][:2]
    assert first["ctx_vs_float_db"] < 20.0 < first["ctx_vs_qdq_db"] - 3.0, first
    assert second["label"] == "1 more tensor(s) at 16 bits", second
    assert second["ctx_vs_float_db"] > 40.0 and report["htp"]["chosen"] == second["label"]
    assert "the HTP agrees with it" in report["htp"]["remedies"][0]
    assert "float16" not in json.dumps(report["htp"]["remedies"])


def test_a_context_at_the_target_by_a_hair_gets_headroom_where_the_htp_agrees(tmp_path: Path):
    """The CPU QDQ model at 20.4 dB, the target 20 (no mixed precision): the context passes by
    under 1 dB, and the HTP agrees with the CPU, so one raise of 16-bit tensors runs and, far
    better, is kept; the first round's candidate stays in the report."""
    model, samples = _outlier_row_matmul()
    config = _write(tmp_path, model, samples, "min_snr_db = 15.0\ntarget_snr_db = 20.0\n")
    quantize_model(load_config(config), tmp_path / "artifacts", force=True)
    report = _report(tmp_path)
    first, second = report["htp"]["rounds"]
    assert 20.0 <= first["ctx_vs_float_db"] < 21.0, first
    assert second["label"] == "1 more tensor(s) at 16 bits" and second["ctx_vs_float_db"] > 40
    assert report["htp"]["chosen"] == second["label"]


def test_a_context_at_the_target_by_a_hair_without_a_raise_tries_fp16(tmp_path: Path):
    """The same model with mixed precision off (no raise to try): at the target by under 1 dB,
    the whole model in fp16 runs next and, better, is kept."""
    model, samples = _outlier_row_matmul()
    settings = "min_snr_db = 15.0\ntarget_snr_db = 20.0\nauto_mixed_precision = false\n"
    config = _write(tmp_path, model, samples, settings)
    quantize_model(load_config(config), tmp_path / "artifacts", force=True)
    htp = _report(tmp_path)["htp"]
    assert [r["label"] for r in htp["rounds"]] == ["as quantized", "whole model in fp16"], htp
    assert htp["rounds"][0]["ctx_vs_float_db"] < 21.0 and htp["whole_float16"]
    assert any("under 1 dB above the target" in r for r in htp["remedies"]), htp["remedies"]


def test_every_sample_runs_while_one_is_short_of_the_margin(tmp_path: Path):
    """Given the float outputs and a figure no sample reaches, every sample runs."""
    from pipeline.htp import probe as probe_mod
    from pipeline.quantize.evaluate import KeptRuns, kept_outputs

    bucket, heldout = _cpu_judged_dilated(tmp_path, seed=3, count=24)
    floats = KeptRuns(bucket.float_model)
    for path in heldout:  # the float outputs this process keeps, as the judge finds them
        with np.load(path) as data:
            floats.run_named(floats.output_names(), {k: data[k] for k in data.files})
    references = kept_outputs(bucket.float_model, heldout)
    assert references is not None and len(references) == len(heldout) > 4
    result = probe_mod.probe(
        bucket.qdq,
        bucket.float_model,
        heldout,
        tmp_path / "all",
        60,
        73,
        timeout_s=300,
        references=references,
        enough_db=1000.0,
    )
    assert result.ok and result.cut_by == "" and result.samples == len(heldout), result


def test_the_comparison_takes_the_outputs_the_parent_passed(tmp_path: Path):
    """The float and CPU QDQ outputs the judge's process kept are what the probe compares the
    HTP's with (neither model runs again in the child): given the true ones, the figures are
    those of a probe that ran both models itself; given outputs off by 2x, they are 6 dB, so
    they are the ones compared."""
    from pipeline.htp import probe as probe_mod
    from pipeline.quantize.evaluate import KeptRuns, kept_outputs

    bucket, heldout = _cpu_judged_dilated(tmp_path, seed=5, count=12)
    for model in (bucket.float_model, bucket.qdq):
        runs = KeptRuns(model)
        for path in heldout:
            with np.load(path) as data:
                runs.run_named(runs.output_names(), {k: data[k] for k in data.files})
    floats = kept_outputs(bucket.float_model, heldout)
    qdqs = kept_outputs(bucket.qdq, heldout)
    assert floats is not None and qdqs is not None

    def run(folder: str, **given: Any) -> Any:
        result = probe_mod.probe(
            bucket.qdq,
            bucket.float_model,
            heldout,
            tmp_path / folder,
            60,
            73,
            timeout_s=300,
            **given,
        )
        assert result.ok and result.samples == len(heldout), result
        return result

    def doubled(outputs: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        return [{k: v * 2 for k, v in named.items()} for named in outputs]

    itself = run("itself")
    given = run("given", references=floats, qdq_references=qdqs)
    for name, accuracy in itself.ctx_vs_float.items():
        assert given.ctx_vs_float[name].snr_db == pytest.approx(accuracy.snr_db, abs=0.01)
        assert given.ctx_vs_qdq[name].snr_db == pytest.approx(
            itself.ctx_vs_qdq[name].snr_db, abs=0.01
        )
        assert given.qdq_vs_float[name].snr_db == pytest.approx(
            itself.qdq_vs_float[name].snr_db, abs=0.01
        )
        assert accuracy.snr_db > 20.0
    wrong = run("wrong", references=doubled(floats), qdq_references=doubled(qdqs))
    for figures in (wrong.ctx_vs_float, wrong.ctx_vs_qdq):  # 2x against x: 20 log10(2)
        assert all(a.snr_db == pytest.approx(6.02, abs=0.2) for a in figures.values()), figures


@pytest.mark.parametrize("losing", [True, False])
def test_a_round_below_the_best_so_far_stops_and_says_so(tmp_path: Path, losing: bool):
    """A candidate whose first samples are, pooled, below the judge's best less the margin
    (``losing_db``) cannot be kept: no new sample starts once ENOUGH_SAMPLES of them ran, the
    same samples spread over the held-out ones whoever ran them; above it, every sample runs."""
    from pipeline.core.layout import ENOUGH_SAMPLES
    from pipeline.htp import probe as probe_mod
    from pipeline.quantize.evaluate import KeptRuns, kept_outputs

    bucket, heldout = _cpu_judged_dilated(tmp_path, seed=3, count=24)
    floats = KeptRuns(bucket.float_model)
    for path in heldout:
        with np.load(path) as data:
            floats.run_named(floats.output_names(), {k: data[k] for k in data.files})
    references = kept_outputs(bucket.float_model, heldout)
    result = probe_mod.probe(
        bucket.qdq,
        bucket.float_model,
        heldout,
        tmp_path / "losing",
        60,
        73,
        timeout_s=300,
        references=references,
        enough_db=1000.0,  # never enough: only the losing stop can cut the round
        losing_db=1000.0 if losing else -1000.0,
    )
    assert result.ok, result.error
    if losing:
        assert (result.cut_by, result.samples, result.requested) == (
            "losing",
            ENOUGH_SAMPLES,
            len(heldout),
        ), result
        ran = [p for p in heldout if probe_mod.sha256_file(p) in result.sample_sha256]
        last = len(heldout) - 1
        spread = [round(i * last / (ENOUGH_SAMPLES - 1)) for i in range(ENOUGH_SAMPLES)]
        assert ran == [heldout[i] for i in spread]
    else:
        assert result.cut_by == "" and result.samples == len(heldout), result


def test_evidence_waits_for_running_samples_and_not_for_left_out_ones(tmp_path: Path):
    """The verdict on the first samples of the claim order: pending while one of them runs in a
    live process; enough when their pooled figure reaches the margin and each the target (one
    sample under the margin but over the target is outweighed by the others); short when the
    pooled figure is below the margin, one sample below the target, left out or unclaimed."""
    import os

    from pipeline.htp import probe as probe_mod

    job = probe_mod.ProbeJob("q", "f", [f"s{i}" for i in range(10)], "", "", 60, 73)
    job = dataclasses.replace(job, enough_db=28.0, enough_floor_db=25.0)
    order = probe_mod._claim_order(job, 10)
    assert order[:4] == [0, 3, 6, 9] and sorted(order) == list(range(10))
    assert probe_mod._claim_order(dataclasses.replace(job, helper=True), 10) == order

    def noted(db: float, signal: float = 1.0) -> str:
        """A sample's figure as _note_figure writes it: one output, this signal power."""
        return json.dumps({"worst": db, "powers": {"y": [signal, signal / 10 ** (db / 10)]}})

    def ran(index: int, db: float) -> None:
        probe_mod._claim(tmp_path, index)
        (tmp_path / f"{index:04d}.db").write_text(noted(db))

    for index in (0, 3, 6):
        ran(index, 40.0)
    assert probe_mod._enough(job, tmp_path, order) == "short"  # 9: nobody runs it
    (tmp_path / "0009.claim").write_text(str(os.getpid()))  # running, in a live process
    assert probe_mod._enough(job, tmp_path, order) == "pending"
    (tmp_path / "0009.db").write_text(noted(30.0))
    assert probe_mod._enough(job, tmp_path, order) == "enough"
    (tmp_path / "0009.db").write_text(noted(26.0))  # under the margin, over the target
    assert probe_mod._enough(job, tmp_path, order) == "enough"  # pooled: 31.5 dB
    (tmp_path / "0009.db").write_text(noted(26.0, signal=100.0))  # the loudest sample
    assert probe_mod._enough(job, tmp_path, order) == "short"  # pooled: 26.1 dB
    (tmp_path / "0009.db").write_text(noted(24.5))  # below the target itself
    assert probe_mod._enough(job, tmp_path, order) == "short"
    (tmp_path / "0009.db").unlink()
    (tmp_path / "0009.claim").write_text(probe_mod.SKIPPED)
    assert probe_mod._enough(job, tmp_path, order) == "short"


def test_samples_that_leave_an_output_below_its_step_are_no_evidence_for_it(tmp_path: Path):
    """An output zero to the NPU (within one step of its grid) on the first samples has no SNR
    there: they stop a round only when the float model keeps it so on every held-out sample (a
    wake-word score of 1e-5 on silence read "inf dB" on 4 samples, 20.8 dB over all 75)."""
    from pipeline.htp import probe as probe_mod

    step = 2.0**-16
    scale, zero = (
        numpy_helper.from_array(np.float32(step), "s"),
        numpy_helper.from_array(np.uint16(0), "z"),
    )
    graph = helper.make_graph(
        [
            helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
            helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"]),
        ],
        "qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        [scale, zero],
    )
    qdq = tmp_path / "qdq.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), qdq)

    def verdict(peaks: list[float]) -> str:
        """The first 4 samples' verdict, each below the step, the float model's outputs on the
        held-out samples peaking at ``peaks``."""
        folder = tmp_path / f"refs{len(list(tmp_path.glob('refs*')))}"
        stash = folder / "stash"
        stash.mkdir(parents=True)
        for index, peak in enumerate(peaks):
            np.savez(folder / f"{index:04d}.npz", y=np.array([peak], np.float32))
        for index in range(4):
            below = {"worst": float("inf"), "powers": {}, "below": ["y"]}
            (stash / f"{index:04d}.db").write_text(json.dumps(below))
        job = probe_mod.ProbeJob(
            str(qdq), "f", [f"s{i}" for i in range(len(peaks))], "", "", 60, 73
        )
        job = dataclasses.replace(job, enough_db=28.0, enough_floor_db=25.0, references=str(folder))
        return probe_mod._pooled_verdict(job, stash, [0, 1, 2, 3], agree=False)

    assert verdict([1e-6] * 4 + [2.6e-4] + [1e-6] * 3) == "short"  # one reaches above the step
    assert verdict([1e-6] * 8) == "enough"  # zero to the NPU everywhere: nothing more to learn


def test_a_waiting_probe_tells_what_its_child_is_at(tmp_path: Path):
    """Every PROGRESS_EVERY_S of the wait, one line from the child's files: compiling until its
    context exists, then the samples whose HTP outputs are stashed (a partial one not yet);
    the reaper's tick runs on every call."""
    from pipeline.htp import probe as probe_mod

    heard, ticks = [], []
    report = probe_mod._reporting(ticks.append, lambda *said: heard.append(said), tmp_path, 3)
    every = probe_mod.PROGRESS_EVERY_S
    report(1.0)
    report(every)
    (tmp_path / probe_mod.CTX_NAME).write_bytes(b"ctx")
    stash = tmp_path / probe_mod.STASH
    stash.mkdir()
    (stash / "0000.npz").write_bytes(b"")
    (stash / ".0001.123.partial.npz").write_bytes(b"")
    report(every + 1.0)  # too soon after the last line
    report(2 * every)
    assert ticks == [1.0, every, every + 1.0, 2 * every]
    assert heard == [
        ("compiling for the HTP", every),
        ("1 of 3 samples run on the HTP", 2 * every),
    ]


def test_two_samples_suffice_when_the_htp_agrees_with_the_cpu(tmp_path: Path):
    """With ``agree_db``: the first 2 of the claim order are enough when they are at the
    target vs float pooled (one may be below it: the margin is the CPU QDQ model's, over every
    held-out sample, which counts that sample's noise) and at ``agree_db`` vs the CPU QDQ model
    pooled; short of that agreement, the 4-sample rule decides as before (each sample at the
    target)."""
    from pipeline.htp import probe as probe_mod

    job = probe_mod.ProbeJob("q", "f", [f"s{i}" for i in range(10)], "", "", 60, 73)
    job = dataclasses.replace(job, enough_db=28.0, enough_floor_db=25.0, agree_db=50.0)
    order = probe_mod._claim_order(job, 10)

    def ran(index: int, db: float, vs_qdq: float) -> None:
        probe_mod._claim(tmp_path, index)
        noted = {
            "worst": db,
            "powers": {"y": [1.0, 10 ** (-db / 10)]},
            "qdq_powers": {"y": [1.0, 10 ** (-vs_qdq / 10)]},
        }
        (tmp_path / f"{index:04d}.db").write_text(json.dumps(noted))

    ran(0, 35.0, 60.0)
    assert probe_mod._enough(job, tmp_path, order) == "short"  # 3: nobody runs it
    ran(3, 33.0, 55.0)
    assert probe_mod._enough(job, tmp_path, order) == "enough"
    assert probe_mod._cut_by(job, tmp_path, order) == "agreement"
    ran(3, 33.0, 45.0)  # the HTP adds more than a tenth of the quantization's noise
    assert probe_mod._enough(job, tmp_path, order) == "short"
    for index in (6, 9):
        ran(index, 35.0, 45.0)
    assert probe_mod._enough(job, tmp_path, order) == "enough"  # the 4-sample rule
    assert probe_mod._cut_by(job, tmp_path, order) == "evidence"
    ran(3, 24.0, 60.0)  # one of the two below the target, agreeing: the CPU's figure, over
    # every held-out sample, counts that sample's noise already; pooled the two are at 26.7 dB
    assert probe_mod._pooled_verdict(job, tmp_path, order[:2], True) == "enough"
    assert probe_mod._pooled_verdict(job, tmp_path, order[:2], False) == "short"
    ran(0, 25.5, 60.0)  # pooled below the target: agreement does not help
    assert probe_mod._pooled_verdict(job, tmp_path, order[:2], True) == "short"
    ran(0, 26.0, 60.0)  # both at the target, short of the margin: the CPU's figure carries it
    ran(3, 26.5, 60.0)
    assert probe_mod._pooled_verdict(job, tmp_path, order[:2], True) == "enough"
    assert probe_mod._pooled_verdict(job, tmp_path, order[:2], False) == "short"


def record_accuracy(stored: dict, like: dict) -> dict:
    """The probe record's per-output figures as the ProbeResult's type, to compare them."""
    from pipeline.core.accuracy import Accuracy
    from qnn_ctx_runtime.typed import parse

    issues: list[str] = []
    value = parse(dict[str, Accuracy], stored, "", issues)
    assert not issues and set(value) == set(like)
    return value


def test_samples_the_budget_left_out_stay_out(tmp_path: Path):
    """When the main child stops for the budget it marks every unclaimed sample left out, so a
    helper cannot take one after the child began waiting for the claimed ones (the comparison
    would read an output that never came); claimed samples are still waited for."""
    from pipeline.htp import probe as probe_mod

    assert probe_mod._claim(tmp_path, 0) and probe_mod._claim(tmp_path, 3)
    for index in range(5):
        probe_mod._claim(tmp_path, index, probe_mod.SKIPPED)
    assert not any(probe_mod._claim(tmp_path, index) for index in range(5))  # a late helper
    assert probe_mod._claimed(tmp_path, 5) == [0, 3]


def test_a_failed_round_shows_no_partition_figures() -> None:
    """A round that timed out or crashed measured no partitioning: the report says "-", not
    0 partitions and 0 CPU nodes (which read as a model the HTP ran whole)."""
    from types import SimpleNamespace

    from pipeline.quantize.judge import HtpJudgement, JudgeRound
    from pipeline.quantize.report import _htp_section

    failed = JudgeRound("as quantized", None, None, None, 0, 0, 900.0, "timed out after 900 s")
    ran = JudgeRound("fp16", 31.0, 40.0, 33.0, 1, 0, 12.0, samples=4, requested=4)
    judgement = HtpJudgement("htp", "judged", rounds=[failed, ran], chosen="fp16")
    text = "\n".join(_htp_section(SimpleNamespace(htp=judgement)))
    rows = [line for line in text.splitlines() if line.startswith("|")]
    failed_row = next(line for line in rows if "as quantized" in line)
    cells = [c.strip() for c in failed_row.strip("|").split("|")]
    assert cells[4:6] == ["-", "-"], cells
    assert "timed out after 900 s" in failed_row
    ran_row = next(line for line in rows if line.startswith("| fp16"))
    assert [c.strip() for c in ran_row.strip("|").split("|")][4:6] == ["1", "0"]


def test_the_divergence_named_is_one_that_explains_the_output():
    """The locator's tensor is the first, in graph order, that parts from the CPU QDQ model as
    far as the worst output does (within 3 dB): an earlier, milder one (a Where's unselected
    branch) is passed over; with no output figure, the first under 30 dB."""
    from pipeline.core.accuracy import Accuracy
    from pipeline.htp.probe import ProbeResult, TensorAgreement

    tensors = [
        TensorAgreement("logits", "Gemm", "n1", 82.6),
        TensorAgreement("verified", "Sigmoid", "n2", 28.5),
        TensorAgreement("score", "Sigmoid", "n3", 23.8),
        TensorAgreement("picked", "Where", "n4", 23.8),
    ]
    result = ProbeResult(tensors=tensors)
    assert result.first_divergence().name == "verified"  # no output compared: the first < 30
    result.ctx_vs_qdq = {"picked": Accuracy(23.8, 1e-3, 0.99)}
    assert result.first_divergence().name == "score"
    result.ctx_vs_qdq = {"picked": Accuracy(29.0, 1e-3, 0.99)}
    assert result.first_divergence().name == "verified"


def test_a_divergence_its_readers_do_not_carry_is_passed_over():
    """Exposed as an output, a tensor can come out of the HTP wrong where the graph around it
    is right (a Relu folded into its Conv read -0.5 dB, the MaxPool after it 53 dB; fp16 on it
    moved nothing): the named tensor is one whose readers part ways too."""
    from pipeline.core.accuracy import Accuracy
    from pipeline.htp.probe import ProbeResult, TensorAgreement

    tensors = [
        TensorAgreement("conv", "Conv", "n1", 60.0, ["relu"]),
        TensorAgreement("relu", "Relu", "n2", -0.5, ["pool"]),
        TensorAgreement("pool", "MaxPool", "n3", 53.0, ["head"]),
        TensorAgreement("head", "Conv", "n4", 6.0, ["out"]),
        TensorAgreement("out", "Sigmoid", "n5", 6.8, []),
    ]
    result = ProbeResult(tensors=tensors, ctx_vs_qdq={"out": Accuracy(6.8, 1e-1, 0.9)})
    assert result.first_divergence().name == "head"
    tensors[2] = TensorAgreement("pool", "MaxPool", "n3", 5.0, ["head"])
    assert ProbeResult(tensors=tensors).first_divergence().name == "relu"  # carried: named


def test_a_divergence_a_later_tensor_absorbs_is_passed_over():
    """A chain of tensors can part ways and end in one that agrees: a magnitude's n / m where
    m = n = 0 (a silent STFT bin: 0/0, computed differently), its square, 1 + it and its root,
    all wrong, and m * root right (m = 0). The named tensor is the first whose parting reaches
    the output; a chain that reaches a tensor of unknown readers is carried."""
    from pipeline.core.accuracy import Accuracy
    from pipeline.htp.probe import ProbeResult, TensorAgreement

    def chain(root_readers: list[str]) -> list[TensorAgreement]:
        return [
            TensorAgreement("ratio", "Div", "n1", -2.4, ["square"]),
            TensorAgreement("square", "Mul", "n2", -5.1, ["sum"]),
            TensorAgreement("sum", "Add", "n3", 6.3, ["root"]),
            TensorAgreement("root", "Sqrt", "n4", 13.5, root_readers),
            TensorAgreement("magnitude", "Mul", "n5", 60.4, ["bands"]),
            TensorAgreement("bands", "MatMul", "n6", 26.0, ["out"]),
            TensorAgreement("out", "Conv", "n7", 25.0, []),
        ]

    outputs = {"out": Accuracy(25.0, 1e-2, 0.99)}
    assert ProbeResult(
        tensors=chain(["magnitude"]), ctx_vs_qdq=outputs
    ).first_divergence().name == ("bands")
    # the root read by something not exposed: the chain may reach the output, so it is named
    named = ProbeResult(tensors=chain(["unexposed"]), ctx_vs_qdq=outputs).first_divergence()
    assert named.name == "ratio"


def test_the_locator_knows_what_each_activation_is_read_into(tmp_path: Path):
    from pipeline.htp.probe import _exposed

    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["a"]),
        helper.make_node("Relu", ["a"], ["r"]),
        helper.make_node("QuantizeLinear", ["r", "s", "z"], ["rq"]),
        helper.make_node("DequantizeLinear", ["rq", "s", "z"], ["b"]),
        helper.make_node("Sigmoid", ["b"], ["g"]),
        helper.make_node("QuantizeLinear", ["g", "s", "z"], ["gq"]),
        helper.make_node("DequantizeLinear", ["gq", "s", "z"], ["c"]),
    ]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, [1, 4])],
        [_init("s", np.array(0.1, np.float32)), _init("z", np.array(128, np.uint8))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    path = tmp_path / "chain.onnx"
    onnx.save(model, str(path))
    _, exposed, _, readers = _exposed(str(path), tmp_path)
    assert [t for t, _, _ in exposed] == ["a", "b", "c"]
    assert readers == {"a": ["b"], "b": ["c"], "c": []}


def _qdq_chain(widths: list[int]) -> onnx.ModelProto:
    """Per entry of ``widths``: x concatenated with itself ``width`` times on its channels, Relu,
    Q, DQ: dequantized activations of known, different sizes, in graph order."""
    nodes, inits, current = [], [_init("s", np.array(0.1, np.float32))], "x"
    inits.append(numpy_helper.from_array(np.array(128, np.uint8), "z"))
    for index, width in enumerate(widths):
        wide = f"wide{index}"
        nodes.append(helper.make_node("Concat", ["x"] * width, [wide], axis=1))
        nodes.append(helper.make_node("Relu", [wide], [f"r{index}"], name=f"relu{index}"))
        nodes.append(helper.make_node("QuantizeLinear", [f"r{index}", "s", "z"], [f"q{index}"]))
        nodes.append(helper.make_node("DequantizeLinear", [f"q{index}", "s", "z"], [f"d{index}"]))
        current = f"d{index}"
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 64, 64])],
        [helper.make_tensor_value_info(current, TensorProto.FLOAT, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def test_the_locator_exposes_every_activation_or_a_spread_within_its_budget(tmp_path: Path):
    """A 1x3x1024x2048 LR-ASPP with every activation exposed took the probe to 4.3 GiB: past
    ``EXPOSED_BYTES`` a sample the locator compares a subset spread evenly over the graph."""
    from pipeline.htp.probe import _exposed

    path = tmp_path / "chain.onnx"
    onnx.save(_qdq_chain([1, 4, 1, 4, 1, 4, 1, 4]), str(path))
    row = 64 * 64 * 4  # bytes of one 1x1x64x64 float tensor
    sizes = [w * row for w in [1, 4, 1, 4, 1, 4, 1, 4]]
    every, exposed, count, _ = _exposed(str(path), tmp_path, budget=1 << 30)
    assert count == 8 and [t for t, _, _ in exposed] == [f"d{k}" for k in range(8)]
    assert [op for _, op, _ in exposed] == ["Relu"] * 8
    assert len(onnx.load(str(every)).graph.output) == 8
    spread, exposed, count, _ = _exposed(str(path), tmp_path, budget=10 * row)  # half of them
    kept = [int(t[1:]) for t, _, _ in exposed]
    assert count == 8 and 1 < len(kept) < 8
    assert sum(sizes[k] for k in kept) <= 10 * row
    assert min(kept) < 4 <= max(kept)  # from the front half and the back half of the graph
    assert {o.name for o in onnx.load(str(spread)).graph.output} == {f"d{k}" for k in kept} | {"d7"}


def test_a_slow_simulator_goes_to_fp16_once_the_cpu_is_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The quantized model short of the target on the CPU (75.1 dB for a target of 80) and a
    simulator counted as slow (SLOW_SAMPLE_S = 0: any pace is slow, whatever this machine's
    speed): the round after the first is the whole model in fp16, not a locate."""
    from pipeline.quantize import judge as judge_mod

    monkeypatch.setattr(judge_mod, "SLOW_SAMPLE_S", 0.0)
    htp = _build_dilated_int16(tmp_path, 80.0)["htp"]
    labels = [r["label"] for r in htp["rounds"]]
    assert labels == ["as quantized", "whole model in fp16"], labels
    assert any("s a sample" in remedy for remedy in htp["remedies"]), htp["remedies"]


# Sitecustomize for the probe's processes: QNN "refuses" every quantized model (a real failure
# of the compile in the child, as "Failed to compose Qnn graph" is), fp16 models compile as usual.
REFUSE_QUANTIZED = """\
import onnxruntime

_init = onnxruntime.ModelCompiler.__init__
_compile = onnxruntime.ModelCompiler.compile_to_file


def _remember(self, options, model, *args, **kwargs):
    self._source = model
    _init(self, options, model, *args, **kwargs)


def _refuse(self, *args, **kwargs):
    import onnx

    graph = onnx.load(str(self._source), load_external_data=False).graph
    if any(n.op_type == "QuantizeLinear" for n in graph.node):
        raise RuntimeError("Failed to compose Qnn graph. (injected: the quantized model)")
    return _compile(self, *args, **kwargs)


onnxruntime.ModelCompiler.__init__ = _remember
onnxruntime.ModelCompiler.compile_to_file = _refuse
"""


def test_a_quantized_model_the_htp_refuses_runs_in_fp16(tmp_path: Path, monkeypatch) -> None:
    """QNN refusing the quantized model no longer leaves the CPU's decision (a QDQ the compile
    stage then fails on): the whole model in fp16 runs, and is kept when it does."""
    import os

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(REFUSE_QUANTIZED)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p)
    )
    rng = np.random.default_rng(3)
    samples = [rng.normal(0, 1, (1, 16, 24, 24)) for _ in range(16)]
    config = _write(tmp_path, _dilated_model(rng), samples, "")
    quantize_model(load_config(config), tmp_path / "artifacts", force=True)
    htp = _report(tmp_path)["htp"]
    assert htp["judge"] == "htp", htp["reason"]
    assert [r["label"] for r in htp["rounds"]][:2] == ["as quantized", "whole model in fp16"]
    assert "Failed to compose" in htp["rounds"][0]["error"]
    assert htp["whole_float16"] and any("failed on the HTP" in r for r in htp["remedies"])
    qdq = ModelPaths.of(tmp_path / "artifacts", "m").bucket("static").qdq
    assert not any(n.op_type == "QuantizeLinear" for n in onnx.load(str(qdq)).graph.node)


@pytest.mark.parametrize("target_db", [20.0, 40.0])
def test_lstms_kept_whole_for_the_budget_are_unrolled_when_the_htp_falls_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target_db: float
) -> None:
    """LSTMs past the unroll budget keep the HTP's own op, unless the judge's first round falls
    short of the target with it, that op, whole in fp16 on the simulator, misses the target too
    and the unrolled form does better: 2 layers of 32 over 20 steps read ~32 dB native, ~50 dB
    unrolled in the exact fp16 forms (the HTP's LSTM op has its own coarse gates; a Resemblyzer
    speaker encoder: 12.6 -> 39.6 dB). At a 20 dB target the quantized model meets it and the
    native op stands unmeasured in fp16; at 40 dB the build restarts on the unrolled form and
    the report says what both forms read."""
    from test_recurrent import lstm_stack

    import pipeline.graph.recurrent as rc

    monkeypatch.setattr(rc, "LSTM_UNROLL_NODES", 50)  # this small stack is over the budget
    rng = np.random.default_rng(3)
    walks = [
        (rng.standard_normal((1, 16)) + np.cumsum(0.3 * rng.standard_normal((20, 16)), 0))
        for _ in range(16)
    ]
    samples = [w.reshape(20, 1, 16) for w in walks]
    config = _write(
        tmp_path,
        lstm_stack(layers=2, hidden=32, steps=20, size=16),
        samples,
        f"target_snr_db = {target_db}\n",
    )
    quantize_model(load_config(config), tmp_path / "artifacts", force=True)
    unroll = next(s for s in _report(tmp_path)["prepare"] if s["step"] == "unroll_recurrent_ops")
    float_model = ModelPaths.of(tmp_path / "artifacts", "m").bucket("static").float_model
    lstms = [n for n in onnx.load(str(float_model)).graph.node if n.op_type == "LSTM"]
    if target_db < 30:
        assert len(lstms) == 2 and unroll["details"][0].startswith(rc.LSTMS_KEPT_WHOLE)
        assert unroll["details"][-1].startswith("the quantized model met the target"), unroll
        # QNN builds 2 layers x 20 cells: compile's time limit grows with them
        from pipeline.core.records import QuantizeRecord, read_record

        record, _ = read_record(QuantizeRecord, ModelPaths.of(tmp_path / "artifacts", "m").record)
        assert record is not None and record.buckets[0].recurrent_steps == 40
        assert "htp_lstm_check" not in _report(tmp_path)["timings_s"]
        return
    # If a new QNN SDK's LSTM op computes its gates as well, the unrolled form is no better:
    # the native op is then kept and this says so.
    assert not lstms and "unrolled up to" in unroll["details"][-1], unroll


def test_a_long_recurrent_graph_is_judged_and_compiled_at_the_fast_finalization(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A graph with many LSTM cells QNN builds is compiled at HTP finalization level 1, by the
    judge and by compile alike: the judge's record says so, compile adopts the judge's context
    (the same compile), and the variant's record and report name the option."""
    from test_recurrent import lstm_stack

    import pipeline.core.config as config_module
    import pipeline.graph.recurrent as rc
    from pipeline.compile.build import compile_model
    from pipeline.core.records import VariantRecord, read_record
    from qnn_ctx_runtime import qnn
    from qnn_ctx_runtime.toolchains import load_toolchains

    monkeypatch.setattr(rc, "LSTM_UNROLL_NODES", 50)  # kept whole: QNN builds its cells
    monkeypatch.setattr(config_module, "FAST_FINALIZE_RECURRENT_STEPS", 40)  # 2 layers x 20
    rng = np.random.default_rng(3)
    samples = [rng.standard_normal((20, 1, 16)) for _ in range(16)]
    config_path = _write(tmp_path, lstm_stack(layers=2, hidden=32, steps=20, size=16), samples, "")
    config = load_config(config_path)
    artifacts = tmp_path / "artifacts"
    quantize_model(config, artifacts, force=True)
    fast = {config_module.FINALIZATION_OPTION: "1"}
    paths = ModelPaths.of(artifacts, "m")
    assert json.loads(paths.bucket("static").htp_probe.read_text())["qnn_options"] == fast
    table = load_toolchains()
    toolchain = table.get(table.default)
    compile_model(config, artifacts, table, toolchain, qnn.installed_qnn(), True, out=str)
    folder = paths.variant(toolchain.onnxruntime_qnn, config.compile.targets[0])
    record, why = read_record(VariantRecord, folder.record)
    assert record is not None and record.status == "ok", why
    assert record.qnn_options == fast
    assert "No worker ran for this variant" in folder.log.read_text()  # the judge's ctx
    assert f"`{config_module.FINALIZATION_OPTION} = 1`" in paths.ctx_report.read_text()


def test_the_quantize_gate_holds_the_htp_judges_figure_too() -> None:
    """A model whose lookups the HTP computed wrongly (5.6 dB there, its CPU QDQ model at
    56.5) passed quantize and failed only at compile: the gate now reads the judge's ctx vs
    float where the judge ran on the HTP, and says which figure it gated."""
    from pipeline.quantize.build import judged_ctx_db
    from pipeline.quantize.judge import HtpJudgement

    assert judged_ctx_db(None) == float("inf")
    assert judged_ctx_db(HtpJudgement("cpu", "the probe failed", ctx_vs_float_db=None)) == float(
        "inf"
    )
    judged = HtpJudgement("htp", "judged on the HTP simulator", ctx_vs_float_db=5.6)
    assert judged_ctx_db(judged) == 5.6


def test_a_candidate_that_cannot_win_on_the_cpu_is_not_run_on_the_htp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """With every remedy counted as unable to win (CANNOT_WIN_DB below zero: even a candidate
    above the best context so far on the CPU), the 8-bit weights are measured on the CPU only,
    shown with that figure, and the next round is the whole model in fp16, which is kept and
    is the model on disk."""
    from pipeline.quantize import judge

    monkeypatch.setattr(judge, "CANNOT_WIN_DB", -1000.0)
    htp = _build_dilated_int16(tmp_path, 70.0, monkeypatch)["htp"]
    labels = [r["label"] for r in htp["rounds"]]
    assert labels == [
        "as quantized",
        "the HTP diverges (locate)",
        "weights int8 per channel",
        "whole model in fp16",
    ], labels
    skipped = htp["rounds"][2]
    assert skipped["error"].startswith("not run on the HTP")
    assert skipped["qdq_vs_float_db"] > 40 and skipped["ctx_vs_float_db"] is None
    assert skipped["samples"] == 0
    assert htp["chosen"] == "whole model in fp16" and htp["whole_float16"]
    assert any("weights int8 per channel: not run on the HTP" in r for r in htp["remedies"])
    qdq = onnx.load(str(ModelPaths.of(tmp_path / "artifacts", "m").bucket("static").qdq))
    assert not any(n.op_type == "QuantizeLinear" for n in qdq.graph.node)
    md = (tmp_path / "artifacts" / "build" / "m" / "report.md").read_text()
    assert "not run on the HTP" in md
    page = (tmp_path / "artifacts" / "build" / "m" / "report.html").read_text()
    assert "3. weights int8 per channel  [not run]" in page and "[error]" not in page


def test_tensors_in_float16_that_make_the_context_worse_end_in_fp16(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The split int16 weights agree with the CPU, whose quantization is short of a 78 dB
    target, and the HTP is further from the CPU QDQ model than that model is from float: the
    whole model in fp16 runs first, and at this target it is short too (66.4 dB: fp16 is below
    16-bit quantization here), so the costliest tensors in float16 follow, from the quantized
    model. Every move of the context counted as a loss (STALLED_DB below zero), the rounds end
    there: fp16, already measured, is not run again."""
    from pipeline.quantize import judge

    monkeypatch.setattr(judge, "STALLED_DB", -1000.0)
    htp = _build_dilated_int16(tmp_path, 78.0)["htp"]
    labels = [r["label"] for r in htp["rounds"]]
    assert labels[:2] == ["as quantized", "whole model in fp16"], labels
    assert len(labels) == 3 and labels[2].endswith("tensors in float16"), labels
    assert htp["rounds"][1]["ctx_vs_float_db"] < 78.0 and not htp["whole_float16"]
    assert any("tensors left in float16 took the context" in r for r in htp["remedies"])
    assert sum("whole model in fp16 on the HTP" in r for r in htp["remedies"]) == 1
    # The rounds' last remedy; then, nothing having passed, the float model's own conditioning
    assert "ran already" in htp["remedies"][-2], htp["remedies"]
    assert "float model itself" in htp["remedies"][-1], htp["remedies"]


def test_a_context_the_htp_alone_keeps_short_goes_to_fp16_before_cpu_ranked_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The int16 weights reach the HTP unsplit (20.6 dB from the CPU QDQ model, which is at
    77.6 dB from float), the gap counted as no divergence (HTP_GAP_DB huge: no locate, as for
    gtcrn's 2.1 dB): tensors ranked by their cost on the CPU would not mend what the HTP adds,
    so the whole model in fp16 is the next round, and it passes the 38 dB target."""
    from pipeline.quantize import judge

    monkeypatch.setattr(judge, "HTP_GAP_DB", 1000.0)
    htp = _build_dilated_int16(tmp_path, 38.0, monkeypatch)["htp"]
    labels = [r["label"] for r in htp["rounds"]]
    assert labels == ["as quantized", "whole model in fp16"], labels
    assert htp["chosen"] == "whole model in fp16" and htp["whole_float16"]
    (why,) = htp["remedies"]
    assert "further than that model is from float" in why, why


def test_a_divergence_passed_on_layer_by_layer_is_a_drift():
    """The first diverging tensor a few dB below what it is computed from is a drift (no op
    computed wrongly, fp16 on it mends nothing); far below its inputs, it is that op's."""
    from pipeline.core.accuracy import Accuracy
    from pipeline.htp.probe import ProbeResult, TensorAgreement
    from pipeline.quantize.judge import DRIFT_DB, drifts

    def chain(first_db: float) -> ProbeResult:
        tensors = [
            TensorAgreement("x", "input", "", 90.0, ["a"]),
            TensorAgreement("a", "Conv", "n1", first_db, ["b"]),
            TensorAgreement("b", "Conv", "n2", 22.0, ["c"]),
            TensorAgreement("c", "Add", "n3", 19.7, []),
        ]
        return ProbeResult(tensors=tensors, ctx_vs_qdq={"c": Accuracy(19.7, 1e-2, 0.99)})

    drifting = chain(24.0)
    found = drifting.first_divergence()
    assert found.name == "b" and drifting.sources_db(found) == 24.0
    assert drifting.sources_db(found) < found.snr_db + DRIFT_DB and drifts(drifting, found)
    wrong = chain(45.0)  # the op that makes b parts from inputs that agree: computed otherwise
    assert wrong.first_divergence().name == "b" and not drifts(wrong, wrong.first_divergence())
    inputs_only = chain(24.0)  # what a graph input feeds: its source is exposed too
    assert inputs_only.sources_db(inputs_only.tensors[1]) == 90.0
    assert inputs_only.sources_db(inputs_only.tensors[0]) is None


@pytest.mark.parametrize("drift", [True, False])
def test_a_drift_goes_to_fp16_and_an_op_to_its_tensor_in_fp16(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, drift: bool
):
    """The dilated int16 Convs diverge on the HTP; with no int16 weight counted as left (the
    8-bit remedy off), a divergence counted as a drift (DRIFT_DB huge) goes to the whole model
    in fp16 right after the locate, and one counted as an op's (DRIFT_DB below zero) to that
    tensor in fp16."""
    from pipeline.quantize import judge

    monkeypatch.setattr(judge, "int16_weights_left", lambda _qdq, _names: [])
    monkeypatch.setattr(judge, "DRIFT_DB", 1000.0 if drift else -1000.0)
    htp = _build_dilated_int16(tmp_path, 70.0, monkeypatch)["htp"]
    labels = [r["label"] for r in htp["rounds"]]
    assert labels[:2] == ["as quantized", "the HTP diverges (locate)"], labels
    if drift:
        assert labels[2:] == ["whole model in fp16"], labels
        assert any("layer by layer" in r for r in htp["remedies"]), htp["remedies"]
    else:
        assert labels[2].endswith(" in float16") and labels[2] != "whole model in fp16", labels
        assert not any("layer by layer" in r for r in htp["remedies"])


def test_a_slow_simulator_skips_the_locate_where_the_htp_alone_is_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Short only on the HTP with a simulator counted as slow (SLOW_SAMPLE_S = 0): no locate
    (every activation exposed: the slowest round there is); 16-bit weights still go to 8 bits
    per channel first, which the HTP reproduces and which passes here."""
    from pipeline.quantize import judge as judge_mod

    monkeypatch.setattr(judge_mod, "SLOW_SAMPLE_S", 0.0)
    htp = _build_dilated_int16(tmp_path, 38.0, monkeypatch)["htp"]
    labels = [r["label"] for r in htp["rounds"]]
    assert labels == ["as quantized", "weights int8 per channel"], labels
    assert htp["chosen"] == "weights int8 per channel" and htp.get("divergence") is None


def test_a_slow_simulator_without_16_bit_weights_goes_to_fp16_and_locates_only_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Short only on the HTP, nothing to lower to 8 bits, a simulator counted as slow: the next
    round is the whole model in fp16, not a locate; when even that is short of the target, the
    report still names the first diverging tensor, from one locate at the end."""
    from pipeline.quantize import judge as judge_mod

    monkeypatch.setattr(judge_mod, "SLOW_SAMPLE_S", 0.0)
    monkeypatch.setattr(judge_mod, "int16_weights_left", lambda _qdq, _names: [])
    htp = _build_dilated_int16(tmp_path, 70.0, monkeypatch)["htp"]
    labels = [r["label"] for r in htp["rounds"]]
    # fp16 reaches 66.4 dB here, short of 70: the locate comes last, for the report
    assert labels == ["as quantized", "whole model in fp16", "the HTP diverges (locate)"], labels
    assert any("s a sample" in r for r in htp["remedies"]), htp["remedies"]
    assert htp["chosen"] == "whole model in fp16" and htp["ctx_vs_float_db"] < 70.0
    assert htp["divergence"]["op_type"] == "Conv"
    assert htp["divergence"]["node"] in ("atrous1", "atrous2")
    # the kept model is the one on disk, not the quantized one the locate ran on
    qdq = onnx.load(str(ModelPaths.of(tmp_path / "artifacts", "m").bucket("static").qdq))
    assert not any(n.op_type == "QuantizeLinear" for n in qdq.graph.node)


def test_a_quantized_model_qnn_refuses_for_an_int16_weight_is_retried_with_it_at_8_bits(
    tmp_path: Path,
) -> None:
    """One int16 weight QNN refuses (an InstanceNormalization's scale: the QNN EP rewrites the
    norm to NHWC, then refuses it) fails the whole quantized model on the HTP. Before the whole
    model in fp16 (slower on the device), the judge tries the same candidate with its 16-bit
    weights back at 8 bits, and keeps it when it runs."""
    from test_mixed_precision import group_norm_block

    rng = np.random.default_rng(8)
    samples = [rng.normal(0, 1, (1, 3, 8, 8)) for _ in range(16)]
    config = _write(
        tmp_path,
        group_norm_block(),
        samples,
        "auto_mixed_precision = false\n[quantization.overrides]\n"
        'tensors = { "gn_scale" = "int16", "w2" = "int16" }\n',
    )
    quantize_model(load_config(config), tmp_path / "artifacts", force=True)
    htp = _report(tmp_path)["htp"]
    first, second = htp["rounds"][:2]
    assert first["ctx_vs_float_db"] is None and "not selected by that EP" in first["error"]
    assert second["label"] == "its 2 16-bit weight(s) at 8 bits" and not second["error"]
    assert second["ctx_vs_float_db"] is not None
    assert second["partitions"] == 1 and second["cpu_nodes"] == 0
    # the rounds go on from it (here a tensor the HTP computes wrongly goes to fp16), never to
    # the whole model in fp16
    assert not htp["whole_float16"] and all("whole model" not in r["label"] for r in htp["rounds"])
    assert htp["ctx_vs_float_db"] > 25.0
    qdq = onnx.load(str(ModelPaths.of(tmp_path / "artifacts", "m").bucket("static").qdq))
    types = {i.name: i.data_type for i in qdq.graph.initializer}
    assert types["gn_scale_quantized"] != TensorProto.INT16


def _lrn_model(rng: np.random.Generator) -> onnx.ModelProto:
    """Conv -> Relu -> LRN -> Conv, as in CaffeNet/GoogLeNet-era classifiers."""
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu"),
        helper.make_node("LRN", ["r1"], ["n1"], size=5, alpha=1e-4, beta=0.75, bias=1.0),
        helper.make_node("Conv", ["n1", "w2", "b2"], ["y"], name="conv2"),
    ]
    graph = helper.make_graph(
        nodes,
        "lrn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])],
        [
            _init("w1", rng.normal(0, 0.3, (16, 3, 3, 3))),
            _init("b1", rng.normal(0, 0.1, 16)),
            _init("w2", rng.normal(0, 0.3, (8, 16, 1, 1))),
            _init("b2", rng.normal(0, 0.1, 8)),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_an_op_qnn_refuses_with_16_bit_activations_is_retried_with_its_outputs_at_8_bits(
    tmp_path: Path,
) -> None:
    """The QNN EP refuses an LRN feeding a Conv at 16 bits: it rewrites it to NHWC,
    then refuses it, and the whole quantized model fails. The judge reads the op type from the
    QNN EP's error and tries the model with that op's outputs at 8 bits before the whole model
    in fp16; the first round failing is also the sentinel for a QNN that takes 16-bit LRN."""
    rng = np.random.default_rng(9)
    samples = [rng.normal(0, 1, (1, 3, 16, 16)) for _ in range(16)]
    config = _write(tmp_path, _lrn_model(rng), samples, "")
    quantize_model(load_config(config), tmp_path / "artifacts", force=True)
    htp = _report(tmp_path)["htp"]
    first, second = htp["rounds"][:2]
    assert first["ctx_vs_float_db"] is None and "OpType:LRN" in first["error"]
    assert second["label"] == "the outputs of its LRN node(s) at 8 bits" and not second["error"]
    assert second["partitions"] == 1 and second["cpu_nodes"] == 0
    assert not htp["whole_float16"] and htp["chosen"] == second["label"]
    qdq = onnx.load(str(ModelPaths.of(tmp_path / "artifacts", "m").bucket("static").qdq))
    quantized_lrn_output = next(
        n for n in qdq.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "n1"
    )
    types = {i.name: i.data_type for i in qdq.graph.initializer}
    assert types[quantized_lrn_output.input[2]] == TensorProto.UINT8  # its zero point's type
