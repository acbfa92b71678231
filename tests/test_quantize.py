"""The quantize stage end to end on the generated example, plus its bad-input cases."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from compile_fixtures import heavy_imports

from pipeline.__main__ import main
from pipeline.core.fileio import sha256_file
from pipeline.core.layout import ModelPaths, samples_in
from pipeline.core.records import QuantizeRecord, read_record
from pipeline.example_models import ensure_example
from qnn_ctx_runtime.manifest import SINGLE_BUCKET

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of the example config and data (tests never touch the repo's artifacts)."""
    root = tmp_path_factory.mktemp("proj")
    ensure_example(root)
    (root / "configs").mkdir()
    shutil.copy(ROOT / "configs" / "example.toml", root / "configs" / "example.toml")
    return root


def run(root: Path, *args: str) -> int:
    return main(["quantize", "--artifacts", str(root / "artifacts"), *args])


def test_example_builds_static_qdq_with_report(
    example: Path, capsys: pytest.CaptureFixture
) -> None:
    from pipeline.graph.prepare import dynamic_tensors

    assert run(example, str(example / "configs" / "example.toml"), "--force") == 0
    out = example / "artifacts" / "build" / "example_cnn"
    paths = ModelPaths.of(example / "artifacts", "example_cnn")
    assert paths.root == out
    # A model without [buckets] is one bucket named "static"; nothing in the old flat layout.
    static = paths.bucket(SINGLE_BUCKET)
    assert static.root == out / "buckets" / "static"
    assert not (out / "qdq.onnx").exists()
    assert sorted(p.name for p in paths.buckets.iterdir()) == ["static"]
    qdq = onnx.load(str(static.qdq))
    assert any(n.op_type == "QuantizeLinear" for n in qdq.graph.node)
    assert dynamic_tensors(qdq) == []
    assert dynamic_tensors(onnx.load(str(static.float_model))) == []
    report = json.loads((out / "report.json").read_text())
    (bucket,) = report["buckets"]
    assert bucket["name"] == "static" and bucket["shapes"] == {"input": [1, 3, 32, 32]}
    snr = bucket["qdq_vs_float"]["probabilities"]["snr_db"]
    assert 20 < float(snr) < 200
    assert report["calibration_samples"] == 36 and report["heldout_samples"] == 12
    assert bucket["calibration_samples"] == 36 and bucket["heldout_samples"] == 12
    assert len(samples_in(paths.heldout)) == 12
    assert len(samples_in(static.heldout)) == 12
    record, problems = read_record(QuantizeRecord, paths.record)
    assert record is not None, problems
    assert record.status == "ok" and len(record.inputs.source_sha256) == 64
    assert "onnxruntime" in record.inputs.tools
    assert [b.name for b in record.buckets] == ["static"]
    assert record.bucket("static").qdq_sha256 == sha256_file(static.qdq)
    assert record.pads == [] and record.crops == []
    assert "QDQ written" in capsys.readouterr().out
    # BatchNorm folded and the dynamic batch fixed: visible in the report and the record.
    changed = {c["step"]: c["details"] for c in report["prepare"] if c["details"]}
    assert {"fold_batchnorm", "fix_input_shapes"} <= changed.keys(), changed
    assert len(changed["fold_batchnorm"]) == 3  # one BatchNormalization after each conv
    assert any("'batch'" in d and "[1, 3, 32, 32]" in d for d in changed["fix_input_shapes"])
    assert not any(n.op_type == "BatchNormalization" for n in qdq.graph.node)
    assert set(record.summary.prepare_steps) == set(changed)


def test_rerun_is_skipped_and_change_rebuilds(example: Path, capsys: pytest.CaptureFixture) -> None:
    config = example / "configs" / "example.toml"
    assert run(example, str(config)) == 0
    capsys.readouterr()
    assert run(example, str(config)) == 0
    assert "up to date, nothing to do" in capsys.readouterr().out
    # The check alone, in its own process: it imports neither numpy nor onnx (0.25 s of a
    # 0.35 s rerun), so a rerun stays fast however many models a run names.
    argv = ("quantize", "--artifacts", str(example / "artifacts"), str(config))
    assert heavy_imports(*argv, cwd=example) == []
    changed = example / "configs" / "changed.toml"
    changed.write_text(config.read_text().replace("samples = 48", "samples = 40"))
    assert run(example, str(changed)) == 0
    assert "QDQ written" in capsys.readouterr().out


def test_a_model_with_external_data_rebuilds_when_its_weights_change(
    example: Path, capsys: pytest.CaptureFixture
) -> None:
    """The weights of a model saved with external data are not in its .onnx file: the build
    records their digest and is not "up to date" once they change."""
    source = onnx.load(str(example / "artifacts" / "example" / "example_cnn.onnx"))
    folder = example / "external"
    folder.mkdir()

    def save(model: onnx.ModelProto, name: str) -> None:
        onnx.save(
            model,
            str(folder / name),
            save_as_external_data=True,
            location="cnn.weights",
            size_threshold=0,
        )

    save(source, "cnn.onnx")
    config = example / "configs" / "external.toml"
    text = (example / "configs" / "example.toml").read_text()
    config.write_text(
        text.replace('name = "example_cnn"', 'name = "external_cnn"').replace(
            "../artifacts/example/example_cnn.onnx", "../external/cnn.onnx"
        )
    )
    assert "../external/cnn.onnx" in config.read_text()
    assert run(example, str(config)) == 0
    record, _ = read_record(
        QuantizeRecord, ModelPaths.of(example / "artifacts", "external_cnn").record
    )
    assert record is not None
    assert record.inputs.source_data == {"cnn.weights": sha256_file(folder / "cnn.weights")}
    capsys.readouterr()
    assert run(example, str(config)) == 0
    assert "up to date" in capsys.readouterr().out
    scaled = onnx.load(str(folder / "cnn.onnx"))  # the same .onnx file, other weights
    weight = next(i for i in scaled.graph.initializer if len(i.dims) == 4)
    values = onnx.numpy_helper.to_array(weight) * 1.5
    weight.CopyFrom(onnx.numpy_helper.from_array(values, weight.name))
    (folder / "cnn.weights").unlink()  # onnx appends to a data file that exists
    save(scaled, "new.onnx")
    reread = onnx.load(str(folder / "cnn.onnx"))  # the old .onnx reads the new weights
    changed = next(i for i in reread.graph.initializer if i.name == weight.name)
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(changed), values)
    assert run(example, str(config)) == 0
    assert "QDQ written" in capsys.readouterr().out


def write_config(root: Path, source: str, calibration: str = "") -> Path:
    calibration = calibration or 'kind = "random"\nsamples = 4'
    path = root / "bad.toml"
    path.write_text(
        f'[model]\nname = "bad"\nsource = "{source}"\n[inputs]\ndims = {{ batch = 1 }}\n'
        f"[calibration]\n{calibration}\n"
    )
    return path


def test_truncated_model(example: Path, capsys: pytest.CaptureFixture) -> None:
    data = (example / "artifacts" / "example" / "example_cnn.onnx").read_bytes()
    (example / "trunc.onnx").write_bytes(data[: len(data) // 3])
    assert run(example, str(write_config(example, "trunc.onnx"))) == 1
    err = capsys.readouterr().err
    assert "trunc.onnx" in err and "truncated" in err
    bad = ModelPaths.of(example / "artifacts", "bad")
    assert not bad.bucket(SINGLE_BUCKET).qdq.exists() and not bad.record.exists()


def test_a_model_onnxruntime_refuses_names_itself(tmp_path: Path) -> None:
    """Any model the stages open on the CPU and onnxruntime refuses: a ModelError that names
    the file and says whose fault it is, not a raw traceback."""
    from onnx import TensorProto
    from onnx import helper as oh

    from pipeline.core.cpu import cpu_session
    from pipeline.core.errors import ModelError

    bad = oh.make_model(
        oh.make_graph(
            [oh.make_node("Transpose", ["x"], ["y"], perm=[0, 2, 3, 1])],
            "g",
            [oh.make_tensor_value_info("x", TensorProto.FLOAT, [36])],
            [oh.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        ),
        opset_imports=[oh.make_opsetid("", 21)],
        ir_version=10,
    )
    path = tmp_path / "qdq.onnx"
    onnx.save(bad, str(path))
    with pytest.raises(ModelError) as info:
        cpu_session(path)
    assert str(path) in str(info.value) and "perm" in str(info.value)
    assert "pipeline bug" in info.value.tip
    with pytest.raises(ModelError, match="model 'g' does not load"):
        cpu_session(bad)


def test_a_source_onnxruntime_refuses_is_blamed_before_the_step_it_broke(
    example: Path, capsys: pytest.CaptureFixture
) -> None:
    """A hand-built export whose Add broadcasts [1, 4, 8, 8] with [1, 5, 1, 1] passes the
    onnx checker; preparation then failed in qnn_preprocess_model ("Incompatible
    dimensions"), which read like a pipeline fault. The error now says the source does not
    load in onnxruntime and that the fix is in the export."""
    from onnx import TensorProto
    from onnx import helper as oh

    rng = np.random.default_rng(0)
    model = oh.make_model(
        oh.make_graph(
            [
                oh.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                oh.make_node("Add", ["c", "b"], ["y"]),
            ],
            "g",
            [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
            [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, 8, 8])],
            [
                onnx.numpy_helper.from_array(rng.normal(size=(4, 3, 3, 3)).astype("f4"), "w"),
                onnx.numpy_helper.from_array(rng.normal(size=(1, 5, 1, 1)).astype("f4"), "b"),
            ],
        ),
        opset_imports=[oh.make_opsetid("", 17)],
        ir_version=8,
    )
    onnx.save(model, str(example / "unloadable.onnx"))
    assert run(example, str(write_config(example, "unloadable.onnx"))) == 1
    err = capsys.readouterr().err
    assert "source model does not load in onnxruntime" in err and "Incompatible" in err
    assert "Fix the export" in err
    assert not ModelPaths.of(example / "artifacts", "bad").bucket(SINGLE_BUCKET).qdq.exists()


def test_missing_model(example: Path, capsys: pytest.CaptureFixture) -> None:
    assert run(example, str(write_config(example, "absent.onnx"))) == 1
    assert "absent.onnx does not exist" in capsys.readouterr().err


def test_unknown_config_key(example: Path, capsys: pytest.CaptureFixture) -> None:
    path = write_config(example, "x.onnx")
    path.write_text(path.read_text() + "[quantization]\nweight_typ = 'uint8'\n")
    assert run(example, str(path)) == 1
    assert "did you mean 'weight_type'" in capsys.readouterr().err


def test_bad_calibration_leaves_nothing_half_written(
    example: Path, capsys: pytest.CaptureFixture
) -> None:
    shutil.copy(example / "artifacts" / "example" / "example_cnn.onnx", example / "m.onnx")
    data = example / "wrongdtype"
    data.mkdir()
    for i in range(4):
        np.save(data / f"s{i}.npy", np.zeros((1, 3, 32, 32), np.float64))
    config = write_config(example, "m.onnx", 'kind = "tensors"\npath = "wrongdtype"')
    assert run(example, str(config)) == 1
    assert "dtype float64" in capsys.readouterr().err
    out = example / "artifacts" / "build" / "bad"
    static = ModelPaths.of(example / "artifacts", "bad").bucket(SINGLE_BUCKET)
    assert not static.qdq.exists() and not (out / "record.json").exists()
    # Temporary files and folders (atomic writes, staged held-out samples) are hidden.
    leftovers = [p.name for p in out.rglob("*") if ".tmp" in p.name or p.name.startswith(".")]
    assert leftovers == []


@pytest.mark.parametrize("shape", [(1, 3, 32, 31), (1, 3, 16, 16), (3, 32, 40)])
def test_calibration_tensor_of_another_shape_is_refused(
    example: Path, capsys: pytest.CaptureFixture, shape: tuple[int, ...]
) -> None:
    """Without [buckets] the model has one static shape: every sample must have exactly it (a
    missing batch axis is added), and the error names the file and the shape the model needs."""
    shutil.copy(example / "artifacts" / "example" / "example_cnn.onnx", example / "m.onnx")
    data = example / "wrongshape"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir()
    for i in range(4):
        np.save(data / f"s{i}.npy", np.zeros(shape, np.float32))
    config = write_config(example, "m.onnx", 'kind = "tensors"\npath = "wrongshape"')
    assert run(example, str(config)) == 1
    err = capsys.readouterr().err
    assert "Calibration sample" in err and str(data / "s") in err and ".npy" in err
    assert "the model takes exactly [1, 3, 32, 32]" in err
    assert "[inputs]" in err  # the tip: a single shape is fixed in [inputs]
    paths = ModelPaths.of(example / "artifacts", "bad")
    assert not paths.bucket(SINGLE_BUCKET).qdq.exists() and not paths.record.exists()


def test_empty_calibration_folder(example: Path, capsys: pytest.CaptureFixture) -> None:
    shutil.copy(example / "artifacts" / "example" / "example_cnn.onnx", example / "m.onnx")
    (example / "empty").mkdir(exist_ok=True)
    config = write_config(example, "m.onnx", 'kind = "tensors"\npath = "empty"')
    assert run(example, str(config)) == 1
    assert "holds no tensor files" in capsys.readouterr().err


def test_help_lists_stages(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for stage in ("quantize", "compile", "publish", "doctor"):
        assert stage in out


def test_validation_samples_are_spread_over_the_held_out_set() -> None:
    """The HTP runs a few held-out samples; a stream's first windows (a file's silent start)
    are not a fair choice, so they are spread evenly, first and last included."""
    from pipeline.core.layout import spread

    files = [Path(f"sample_{i:04d}.npz") for i in range(100)]
    chosen = spread(files, 5)
    assert [int(p.stem[-4:]) for p in chosen] == [0, 25, 50, 74, 99]
    assert spread(files[:3], 16) == files[:3] and spread(files, 1) == files[:1]
    assert len(set(spread(files, 16))) == 16


def test_a_run_that_stops_on_an_error_leaves_a_diagnosis(
    example: Path, capsys: pytest.CaptureFixture
) -> None:
    """A model that cannot be built still gets its report: the error and tip, the steps that
    finished, the source model's facts; the console tip points at it, and nothing claims
    success (no record, no QDQ model)."""
    shutil.copy(example / "artifacts" / "example" / "example_cnn.onnx", example / "m.onnx")
    data = example / "wrongdtype2"
    data.mkdir(exist_ok=True)
    for i in range(4):
        np.save(data / f"s{i}.npy", np.zeros((1, 3, 32, 32), np.float64))
    config = write_config(example, "m.onnx", 'kind = "tensors"\npath = "wrongdtype2"')
    assert run(example, str(config)) == 1
    paths = ModelPaths.of(example / "artifacts", "bad")
    err = capsys.readouterr().err
    assert f"The failure report: {paths.report}" in err
    report = json.loads((paths.root / "report.json").read_text())
    assert report["status"] == "failed" and report["error_type"] == "CalibrationError"
    assert "dtype float64" in report["error"] and report["traceback"] == ""
    assert list(report["steps_done"]) == ["prepare"]  # it stopped routing the samples
    source = report["source"]
    assert source["op_types"]["Conv"] >= 1 and source["inputs"][0].startswith("input: float [")
    markdown = paths.report.read_text()
    assert "quantize stopped with an error" in markdown and "## The source model" in markdown
    html = (paths.root / "report.html").read_text()
    assert "Quantize stopped with an error" in html and "dtype float64" in html
    index = (example / "artifacts" / "build" / "index.html").read_text()
    assert "FAIL: stopped with an error" in index
    assert not paths.record.exists() and not paths.bucket(SINGLE_BUCKET).qdq.exists()
    # compile, asked next, says that quantize failed and where it said why
    assert main(["compile", "--artifacts", str(example / "artifacts"), str(config)]) == 1
    err = capsys.readouterr().err
    assert "the last quantize run stopped with an error" in err and "dtype float64" in err
    assert str(paths.report) in err


def test_a_fault_in_the_pipeline_keeps_its_traceback_in_the_report(
    example: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception that is not one of the pipeline's errors (a bug) still propagates, and
    the report keeps where it came from for the bug report."""
    from pipeline.quantize import build

    def broken(*_args: object, **_kwargs: object) -> None:
        raise ValueError("a fault in the preparation check")

    monkeypatch.setattr(build, "check_preparation", broken)
    shutil.copy(example / "artifacts" / "example" / "example_cnn.onnx", example / "m.onnx")
    config = write_config(example, "m.onnx")
    with pytest.raises(ValueError, match="a fault in the preparation check"):
        run(example, str(config), "--force")
    paths = ModelPaths.of(example / "artifacts", "bad")
    report = json.loads((paths.root / "report.json").read_text())
    assert report["error_type"] == "ValueError" and "in broken" in report["traceback"]
    # The check runs once the held-out samples are drawn, before calibration holds its data.
    done = report["steps_done"]
    assert "route" in done and "check_preparation" not in done and "calibrate" not in done
    assert "a fault in the pipeline" in paths.report.read_text()
    assert not paths.record.exists()


def test_held_out_samples_are_read_once_and_again_when_rewritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every check reads the held-out folder again: the feeds are kept (read-only, so no
    check can change another's inputs), and a file written anew is read anew."""
    from pipeline.quantize import evaluate

    for index in range(3):
        np.savez(tmp_path / f"sample_{index:04d}.npz", x=np.full((2, 2), index, np.float32))
    reads: list[str] = []
    real_load = np.load

    def counted(path: object, *args: object, **kwargs: object) -> object:
        reads.append(str(path))
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(evaluate.np, "load", counted)
    first = [feeds["x"][0, 0] for feeds in evaluate.iter_samples(tmp_path)]
    again = list(evaluate.iter_samples(tmp_path))
    assert first == [0, 1, 2] and [f["x"][0, 0] for f in again] == [0, 1, 2]
    assert len(reads) == 3
    with pytest.raises(ValueError):
        again[0]["x"][0, 0] = 7.0
    np.savez(tmp_path / "sample_0001.npz", x=np.full((3, 3), 9, np.float32))
    assert [f["x"][0, 0] for f in evaluate.iter_samples(tmp_path)] == [0, 9, 2]
    assert len(reads) == 4


def _quantize_resized(root: Path, name: str, model: onnx.ModelProto, shape: list[int]) -> int:
    """Quantize ``model`` (input ``x``) with ``[inputs] shapes`` giving ``x`` ``shape`` (random
    calibration, the CPU judge, no mixed precision): the stage's exit code."""
    onnx.save(model, str(root / f"{name}.onnx"))
    config = root / f"{name}.toml"
    config.write_text(
        f'[model]\nname = "{name}"\nsource = "{name}.onnx"\n'
        f"[inputs]\nshapes = {{ x = {shape} }}\n"
        '[calibration]\nkind = "random"\nsamples = 8\n'
        '[quantization]\njudge = "cpu"\nauto_mixed_precision = false\n'
    )
    return main(["quantize", "--artifacts", str(root / "art"), str(config)])


def test_a_model_exported_at_a_dummy_size_builds_at_the_size_the_config_gives(
    tmp_path: Path,
) -> None:
    """An export at a fixed dummy size (CenterFace ships 10x3x32x32; its app loosens the dims
    and feeds the image's size) builds at ``[inputs] shapes``, and the source model, run at
    that size with its dims freed, is the reference of the lossless and end-to-end checks."""
    from onnx import TensorProto
    from onnx import helper as oh

    rng = np.random.default_rng(3)
    model = oh.make_model(
        oh.make_graph(
            [
                oh.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                oh.make_node("Relu", ["c"], ["y"]),
            ],
            "g",
            [oh.make_tensor_value_info("x", TensorProto.FLOAT, [10, 3, 8, 8])],
            [oh.make_tensor_value_info("y", TensorProto.FLOAT, [10, 4, 8, 8])],
            [onnx.numpy_helper.from_array(rng.normal(size=(4, 3, 3, 3)).astype("f4"), "w")],
        ),
        opset_imports=[oh.make_opsetid("", 13)],
        ir_version=8,
    )
    assert _quantize_resized(tmp_path, "dummy", model, [1, 3, 16, 24]) == 0
    paths = ModelPaths.of(tmp_path / "art", "dummy")
    built = onnx.load(str(paths.bucket(SINGLE_BUCKET).qdq))
    dims = [d.dim_value for d in built.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [1, 3, 16, 24]
    report = json.loads(paths.report.with_suffix(".json").read_text())
    check = report["preparation_check"]
    assert check["error"] == "" and check["samples"] > 0 and float(check["snr_db"]) > 60
    assert report["end_to_end"]["samples"] > 0 and not report["end_to_end"]["error"]


def test_a_new_size_the_graph_cannot_take_past_an_op_inference_skips_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Strict shape inference stops at an op it has no schema for (a legacy ImageScaler), so a
    Gemm that cannot take the new size fails later, in a preparation step's own words; the
    error then says which input the config resized."""
    from onnx import TensorProto
    from onnx import helper as oh

    rng = np.random.default_rng(4)
    model = oh.make_model(
        oh.make_graph(
            [
                oh.make_node("ImageScaler", ["x"], ["scaled"], scale=1 / 255, bias=[0.0]),
                oh.make_node("Flatten", ["scaled"], ["flat"]),
                oh.make_node("Gemm", ["flat", "w", "b"], ["y"]),
            ],
            "g",
            [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])],
            [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])],
            [
                onnx.numpy_helper.from_array(rng.normal(size=(16, 2)).astype("f4"), "w"),
                onnx.numpy_helper.from_array(np.zeros(2, "f4"), "b"),
            ],
        ),
        opset_imports=[oh.make_opsetid("", 7)],
        ir_version=4,
    )
    assert _quantize_resized(tmp_path, "legacy", model, [1, 1, 8, 8]) == 1
    err = capsys.readouterr().err
    assert "[inputs] shapes gives 'x' a size the model fixes" in err
    assert "exported for" in err
    assert not ModelPaths.of(tmp_path / "art", "legacy").bucket(SINGLE_BUCKET).qdq.exists()


def test_a_kept_candidate_that_is_not_whole_on_the_npu_is_said_at_quantize(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No candidate ran whole (a watermark encoder's rank-5 Tanhs on the CPU, its fp16 one
    failing to finalize): the judge keeps the best and quantize passes, so it says that
    compile's coverage gate will fail; a whole one, or CPU nodes the config allows, says
    nothing."""
    from pipeline.core.config import load_config
    from pipeline.quantize.build import _note_not_whole
    from pipeline.quantize.judge import HtpJudgement, JudgeRound

    config_path = tmp_path / "m.toml"
    config_path.write_text(
        '[model]\nname = "frames"\nversion = "1.0.0"\nsource = "m.onnx"\n'
        '[calibration]\nkind = "random"\n',
        encoding="utf-8",
    )
    (tmp_path / "m.onnx").write_bytes(b"")
    config = load_config(config_path)

    def judged(partitions: int, cpu_nodes: int) -> HtpJudgement:
        rounds = [
            JudgeRound("as quantized", 57.3, 85.4, 57.5, partitions, cpu_nodes, 1.0),
            JudgeRound("whole model in fp16", None, None, None, 0, 0, 1.0, error="EPFail"),
        ]
        return HtpJudgement("htp", "judged", rounds=rounds, chosen="as quantized")

    _note_not_whole(config, judged(5, 12))
    said = capsys.readouterr().out
    assert "NOTE frames: no candidate ran whole on the NPU" in said
    assert "(as quantized) ran in 5 QNN partition(s) with 12 CPU node(s)" in said
    _note_not_whole(config, judged(1, 0))
    assert capsys.readouterr().out == ""
    allowing = dataclasses.replace(
        config, compile=dataclasses.replace(config.compile, allowed_cpu_ops=["Tanh"])
    )
    _note_not_whole(allowing, judged(1, 3))
    assert capsys.readouterr().out == ""


def test_fp16_conditioning_tells_a_cancelling_model_from_a_linear_one(tmp_path: Path) -> None:
    """x - 100 of inputs 100 + 0.01 * noise: fp16's rounding of 100 (2^-11 of it, 0.05) is
    larger than the signal, so the model is below 0 dB from itself; 2 * x is ~70 dB."""
    import onnx.helper as oh
    from onnx import TensorProto, numpy_helper

    from pipeline.quantize.evaluate import float16_conditioning

    rng = np.random.default_rng(0)
    paths = []
    for index in range(3):
        paths.append(tmp_path / f"sample_{index:04d}.npz")
        x = (100.0 + 0.01 * rng.standard_normal((1, 64))).astype(np.float32)
        np.savez(paths[-1], x=x)
    figures = {}
    for name, op in (("cancelling", "Sub"), ("linear", "Mul")):
        graph = oh.make_graph(
            [oh.make_node(op, ["x", "c"], ["y"])],
            name,
            [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
            [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
            [numpy_helper.from_array(np.array(100.0 if op == "Sub" else 2.0, np.float32), "c")],
        )
        path = tmp_path / f"{name}.onnx"
        model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=9)
        onnx.save(model, str(path))
        figures[name] = float16_conditioning(path, paths)["y"].snr_db
    assert figures["cancelling"] < 0.0 < 60.0 < figures["linear"] < 90.0, figures
