"""The build matrix simulated on this machine: plan, every job in its own folder, merge, publish.

Each job of ``python -m pipeline plan`` runs as its own process (the real stages: quantize with
onnxruntime, compile with onnxruntime-qnn 2.7.0 on the HTP simulator, publish) in a fresh
folder holding what a fresh checkout gives it, plus only the paths its plan entry ``reads`` from
the shards of the jobs it ``needs``; what it ``produces`` is copied out as its shard. Not a
``git clone``: the code the jobs run is the installed package (HEAD would not hold uncommitted
work), so a job's folder gets the config and its source model, which is what a checkout adds.

Every job and the single-machine build run one after another in the *same* folder path, as
CI runners do (every GitHub-hosted Linux job runs in /home/runner/work/<repo>/<repo>): the QNN EP
names a compiled partition after a hash of the QDQ model's path as given, so the ctx bytes of
builds in different folders differ in that name (measured; see README, "Builds on CI runners").
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from compile_fixtures import IR_VERSION, small_cnn, write_config
from onnx import helper

from pipeline.__main__ import main
from pipeline.core.config import load_config
from pipeline.core.errors import ConfigError
from pipeline.core.fileio import sha256_file
from pipeline.core.layout import ModelPaths
from pipeline.core.records import QuantizeRecord, read_record, write_record
from pipeline.plan import plan_build

MODEL = "tiny"
TOOLCHAIN = "2.7.0"
TARGETS = ["snapdragon-x-elite", "snapdragon-8-gen-3"]
COMPILE = f'targets = {json.dumps(TARGETS)}\ntoolchains = ["{TOOLCHAIN}"]\nload_runs = 1'
CONFIG = f"configs/{MODEL}.toml"
# Measurements, not results: the load benchmark's timings and the worker's memory.
MEASURED_LOAD_KEYS = {"ctx_s", "all_s", "buckets", "qdq_s", "ratio", "qdq_error", "memory"}


# -- a tiny CI ------------------------------------------------------------------------------------


def make_checkout(root: Path) -> Path:
    """What a checkout holds for this build: the config and its seeded source model."""
    config = write_config(root, MODEL, COMPILE)
    model = helper.make_model(
        small_cnn(np.random.default_rng(0)), opset_imports=[helper.make_opsetid("", 17)]
    )
    model.ir_version = IR_VERSION
    onnx.save(model, str(config.parent / f"{MODEL}.onnx"))
    return root


def fresh_runner(runner: Path, checkout: Path) -> Path:
    """An empty job folder at the runners' one path, with the checkout's files in it."""
    if runner.exists():
        shutil.rmtree(runner)
    shutil.copytree(checkout / "configs", runner / "configs")
    return runner


def pipeline_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """One plain CLI call, as a CI job step makes it."""
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args], cwd=cwd, capture_output=True, text=True
    )


def copy_path(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        shutil.copytree(source, target)
    else:
        shutil.copyfile(source, target)


def job_command(job: dict) -> list[str]:
    """The stage call of one plan entry, as .github/workflows/build.yml makes it."""
    if job["stage"] == "quantize":
        return ["quantize", job["config"], "--artifacts", "artifacts"]
    if job["stage"] == "compile":
        return [
            "compile",
            job["config"],
            "--artifacts",
            "artifacts",
            "--toolchain",
            job["toolchain"],
        ]
    froms = [f"shards/{need}" for need in job["needs"]]
    return ["publish", job["config"], "--artifacts", "artifacts", "--from", *froms]


def run_job(job: dict, runner: Path, checkout: Path, shards: Path) -> Path:
    """Run one plan job in a fresh folder from the shards it needs; returns its own shard."""
    work = fresh_runner(runner, checkout)
    for read in job["reads"]:
        holders = [n for n in job["needs"] if (shards / n / read).exists()]
        assert holders, f"{job['job']} reads {read}, which no shard of {job['needs']} holds"
        if job["stage"] != "publish":  # only what it reads, in its artifacts folder
            copy_path(shards / holders[0] / read, work / "artifacts" / read)
    if job["stage"] == "publish":  # every shard it needs, each in its own folder (--from)
        for need in job["needs"]:
            shutil.copytree(shards / need, work / "shards" / need)
    done = pipeline_cli(work, *job_command(job))
    assert done.returncode == 0, f"{job['job']} failed:\n{done.stdout}\n{done.stderr}"
    shard = shards / job["job"]
    for path in job["produces"]:
        assert (work / "artifacts" / path).exists(), f"{job['job']} did not produce {path}"
        copy_path(work / "artifacts" / path, shard / path)
    return shard


@dataclass(frozen=True)
class Matrix:
    checkout: Path
    plan: dict
    shards: Path
    release: Path  # from the matrix
    single: Path  # from one machine, same config, same folder path


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Matrix]:
    pytest.importorskip("onnxruntime_qnn")
    base = tmp_path_factory.mktemp("matrix")
    checkout = make_checkout(base / "checkout")
    runner = base / "runner" / "work"  # one path for every job, like CI runners
    shards = base / "shards"

    planned = pipeline_cli(fresh_runner(runner, checkout), "plan", CONFIG, "--json")
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    for stage in ("quantize", "compile", "publish"):
        for job in plan[stage]["include"]:
            run_job(job, runner, checkout, shards)
    (publish_job,) = plan["publish"]["include"]
    release = shards / publish_job["job"] / publish_job["produces"][0]

    work = fresh_runner(runner, checkout)
    for args in (
        ["quantize", CONFIG],
        ["compile", CONFIG, "--toolchain", TOOLCHAIN],
        ["publish", CONFIG],
    ):
        done = pipeline_cli(work, *args, "--artifacts", "artifacts")
        assert done.returncode == 0, f"{args[0]} failed:\n{done.stdout}\n{done.stderr}"
    single = base / "single"
    shutil.copytree(work / "artifacts" / publish_job["produces"][0], single)
    yield Matrix(checkout, plan, shards, release, single)


# -- the matrix build is the single-machine build --------------------------------------------------


@pytest.mark.qnn
def test_plan_of_one_model_one_toolchain(matrix: Matrix) -> None:
    jobs = {s: [j["job"] for j in matrix.plan[s]["include"]] for s in matrix.plan}
    assert jobs == {
        "quantize": ["tiny@quantize"],
        "compile": ["tiny@compile-2.7.0"],  # both targets in one job
        "publish": ["tiny@publish"],
    }
    (compile_job,) = matrix.plan["compile"]["include"]
    assert compile_job["targets"] == TARGETS
    assert compile_job["produces"] == ["build/tiny/ctx/2.7.0"]


def _files(release: Path) -> dict[str, str]:
    return {
        p.relative_to(release).as_posix(): sha256_file(p)
        for p in sorted(release.rglob("*"))
        if p.is_file()
    }


def _comparable(manifest: dict) -> dict:
    """The manifest without its timestamp and without what was measured, not built."""
    manifest = dict(manifest, created=None)
    variants = []
    for variant in manifest["variants"]:
        load = {k: v for k, v in variant["load"].items() if k not in MEASURED_LOAD_KEYS}
        variants.append(dict(variant, load=load))
    return dict(manifest, variants=variants)


@pytest.mark.qnn
def test_matrix_release_equals_the_single_machine_release(matrix: Matrix) -> None:
    mine = json.loads((matrix.release / "manifest.json").read_text("utf-8"))
    single = json.loads((matrix.single / "manifest.json").read_text("utf-8"))
    assert [v["id"] for v in mine["variants"]] == [f"{t}_qnn-2.51.0" for t in TARGETS], (
        "both targets published"
    )
    assert all(v["passed"] for v in mine["variants"])
    # Equal except the timestamp and the load benchmark's timings and memory (measurements).
    assert _comparable(mine) == _comparable(single)
    assert mine["variants"][0]["load"]["ctx_s"] is not None
    # Every file equal by digest (the ctx binaries too: same QDQ, same path, same compiler),
    # except the manifest and the archive holding it, which differ by the fields above.
    differing = {"manifest.json", "tiny-1.0.0.tar.gz", "tiny-1.0.0.tar.gz.sha256"}
    files, single_files = _files(matrix.release), _files(matrix.single)
    assert files.keys() == single_files.keys()
    assert {f for f in files if files[f] != single_files[f]} <= differing
    ctx = [f for f in files if f.endswith("_ctx.onnx")]
    assert len(ctx) == 2 and all(files[f] == single_files[f] for f in ctx)


@pytest.mark.qnn
def test_same_shards_again_is_a_no_op(matrix: Matrix, tmp_path: Path, capsys) -> None:
    froms = [str(matrix.shards / n) for n in ("tiny@quantize", "tiny@compile-2.7.0")]
    config = str(matrix.checkout / CONFIG)
    args = ["publish", config, "--artifacts", str(tmp_path / "out"), "--from", *froms]
    assert main(args) == 0
    assert main(args) == 0
    assert "already published with the same content" in capsys.readouterr().out


# -- shards that do not fit are refused, naming the shard and why ---------------------------------


def _copy_shards(matrix: Matrix, into: Path) -> tuple[Path, Path]:
    shutil.copytree(matrix.shards / "tiny@quantize", into / "tiny@quantize")
    shutil.copytree(matrix.shards / "tiny@compile-2.7.0", into / "tiny@compile-2.7.0")
    return into / "tiny@quantize", into / "tiny@compile-2.7.0"


def _other_qdq(quantize_shard: Path, into: Path) -> tuple[Path, str]:
    """The quantize shard of a build whose QDQ model came out different (another onnxruntime,
    say): same source and config, its own QDQ bytes, and a record naming them."""
    other = into / "other@quantize"
    shutil.copytree(quantize_shard, other)
    paths = ModelPaths.of(other, MODEL)
    qdq = paths.bucket("static").qdq
    model = onnx.load(str(qdq))
    helper.set_model_props(model, {"quantized_by": "another runner"})
    onnx.save(model, str(qdq))
    record, _ = read_record(QuantizeRecord, paths.record)
    assert record is not None
    bucket = dataclasses.replace(record.buckets[0], qdq_sha256=sha256_file(qdq))
    write_record(paths.record, dataclasses.replace(record, buckets=[bucket]))
    return other, sha256_file(qdq)


def _publish(checkout: Path, out: Path, *froms: Path) -> list[str]:
    return [
        "publish",
        str(checkout / CONFIG),
        "--artifacts",
        str(out),
        "--from",
        *map(str, froms),
    ]


def _refused(args: list[str], capsys) -> str:
    assert main(args) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return captured.err


@pytest.mark.qnn
def test_shard_compiled_from_another_qdq_is_refused(matrix: Matrix, tmp_path: Path, capsys):
    quantized, compiled = _copy_shards(matrix, tmp_path / "shards")
    other, other_qdq = _other_qdq(quantized, tmp_path / "shards")
    out = tmp_path / "out"
    err = _refused(_publish(matrix.checkout, out, other, compiled), capsys)
    original = sha256_file(ModelPaths.of(quantized, MODEL).bucket("static").qdq)
    assert f"Shard {compiled} does not fit" in err
    assert "different QDQ digest" in err
    assert original[:12] in err and other_qdq[:12] in err
    assert f"quantize shard {other}" in err
    # Nothing was gathered or published.
    assert not (out / "build" / MODEL).exists()
    assert not (out / "releases").exists()

    # Two quantize shards that disagree are refused too, naming both.
    err = _refused(_publish(matrix.checkout, out, quantized, other, compiled), capsys)
    assert f"Shards {quantized} and {other} hold different quantize builds" in err
    assert "bucket static QDQ" in err


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text("utf-8")
    assert old in text
    path.write_text(text.replace(old, new), "utf-8")


@pytest.mark.qnn
@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ("compile", "different config digest: compiled with [compile] settings"),
        ("quantize", "was quantized with other settings than"),
        ("source", "was built from another source model"),
    ],
)
def test_shards_that_do_not_fit_the_config_are_refused(
    matrix: Matrix, tmp_path: Path, capsys, change: str, expected: str
) -> None:
    checkout = tmp_path / "checkout"
    shutil.copytree(matrix.checkout, checkout)
    config = checkout / CONFIG
    if change == "compile":
        _edit(config, "load_runs = 1", "load_runs = 2")
    elif change == "quantize":
        _edit(config, 'kind = "random"', 'kind = "random"\nsamples = 32')
    else:
        source = config.parent / f"{MODEL}.onnx"
        model = onnx.load(str(source))
        helper.set_model_props(model, {"exported_by": "someone else"})
        onnx.save(model, str(source))
    quantized, compiled = _copy_shards(matrix, tmp_path / "shards")
    err = _refused(_publish(checkout, tmp_path / "out", quantized, compiled), capsys)
    assert expected in err
    assert str(compiled if change == "compile" else quantized) in err


@pytest.mark.qnn
def test_missing_or_misplaced_shards_are_named(matrix: Matrix, tmp_path: Path, capsys) -> None:
    quantized, compiled = _copy_shards(matrix, tmp_path / "shards")
    out = tmp_path / "out"
    err = _refused(_publish(matrix.checkout, out, quantized), capsys)
    assert "No --from folder holds tiny / onnxruntime-qnn 2.7.0 / snapdragon-x-elite" in err
    assert "tiny@compile-2.7.0" in err

    err = _refused(_publish(matrix.checkout, out, compiled), capsys)
    assert "No --from folder holds the quantize build of tiny" in err

    nested = tmp_path / "download"
    shutil.copytree(quantized, nested / "tiny@quantize")  # one level too deep
    err = _refused(_publish(matrix.checkout, out, nested, compiled), capsys)
    assert f"--from {nested}: no build/<model>/ of tiny in it" in err

    twice = tmp_path / "again"
    shutil.copytree(compiled, twice)
    err = _refused(_publish(matrix.checkout, out, quantized, compiled, twice), capsys)
    assert f"Shards {compiled} and {twice} both hold tiny / onnxruntime-qnn 2.7.0" in err


@pytest.mark.qnn
def test_gathering_over_another_build_is_refused(matrix: Matrix, tmp_path: Path, capsys) -> None:
    quantized, compiled = _copy_shards(matrix, tmp_path / "shards")
    other, _ = _other_qdq(quantized, tmp_path / "shards")
    out = tmp_path / "out"
    shutil.copytree(other / "build", out / "build")  # a local build of something else
    err = _refused(_publish(matrix.checkout, out, quantized, compiled), capsys)
    assert "already holds another build of tiny" in err
    assert not (out / "releases").exists()


# -- the plan ------------------------------------------------------------------------------------


def _config(root: Path, name: str, compile_section: str) -> Path:
    path = write_config(root, name, compile_section)
    (path.parent / f"{name}.onnx").write_bytes(b"")  # plan reads no model
    return path


def test_plan_order_shape_and_paths(tmp_path: Path, monkeypatch, capsys) -> None:
    b = _config(
        tmp_path, "b_model", 'targets = ["snapdragon-x-elite"]\ntoolchains = ["2.7.0", "2.5.0"]'
    )
    a = _config(tmp_path, "a_model", "")
    monkeypatch.chdir(tmp_path)
    plan = plan_build([load_config(b), load_config(a)], tmp_path)
    again = plan_build([load_config(a), load_config(b)], tmp_path)
    assert plan.to_json() == again.to_json(), "the order of the configs does not matter"
    matrix = json.loads(plan.to_json())
    assert list(matrix) == ["quantize", "compile", "publish"]
    ids = {s: [j["job"] for j in matrix[s]["include"]] for s in matrix}
    assert ids == {
        "quantize": ["a_model@quantize", "b_model@quantize"],
        "compile": ["a_model@compile-2.7.0", "b_model@compile-2.5.0", "b_model@compile-2.7.0"],
        "publish": ["a_model@publish", "b_model@publish"],
    }
    jobs = {j["job"]: j for s in matrix for j in matrix[s]["include"]}
    publish_b = jobs["b_model@publish"]
    assert publish_b["config"] == "configs/b_model.toml"
    assert publish_b["needs"] == [
        "b_model@quantize",
        "b_model@compile-2.5.0",
        "b_model@compile-2.7.0",
    ]
    assert publish_b["produces"] == ["releases/b_model/1.0.0"]
    for job in jobs.values():
        for need in job["needs"]:
            assert jobs[need]["stage"] != job["stage"]
        # everything a job reads is produced by a job it needs
        for read in job["reads"]:
            assert any(
                read == made or read.startswith(made + "/")
                for need in job["needs"]
                for made in jobs[need]["produces"]
            ), (job["job"], read)
        # usable as a CI artifact name and a folder name
        assert not set(job["job"]) & set('"/\\:<>|*? ')

    assert main(["plan", str(b), str(a)]) == 0
    table = capsys.readouterr().out
    assert "2 model(s) x 2 toolchain(s) (2.5.0, 2.7.0): 2 quantize + 3 compile + 2 publish" in table
    assert "b_model@compile-2.5.0" in table and "build/b_model/ctx/2.5.0" in table
    assert main(["plan", str(b), str(a), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == matrix


def test_plan_refuses_clashing_models_and_configs_outside_the_checkout(tmp_path: Path) -> None:
    a = load_config(_config(tmp_path / "x", "same", ""))
    b = load_config(_config(tmp_path / "y", "same", ""))
    with pytest.raises(ConfigError, match="both build model 'same'"):
        plan_build([a, b], tmp_path)
    with pytest.raises(ConfigError, match=r"outside .* the folder the jobs run in"):
        plan_build([a], tmp_path / "y")
