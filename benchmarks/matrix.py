"""The build matrix on this machine: what each CI job costs, and the same build on one machine.

Plans the configs (``python -m pipeline plan``), then runs every job as a CI runner would: an
empty folder (always the same path, as on hosted runners) with the checkout's ``configs/`` and
``calibration/``, a fresh environment made with uv from its warm cache (what a runner with a
restored uv cache does: reported as *setup*), the shards the job needs, one CLI call (*run*);
what it produces is copied out as its shard (*shard*: the upload/download stand-in). Then the
same build on one machine, in one folder, serially, with the environments already there. Prints
markdown: one row per job, then the totals.

    python benchmarks/matrix.py [--work DIR] [configs...]

Default: the bundled examples (the quantize job generates them first, as the workflow does).
Real models need ../shared beside the checkout (it is linked beside the runner folder). Needs uv.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "runtime"))
sys.path.insert(0, str(ROOT))

from qnn_ctx_runtime.toolchains import load_toolchains  # noqa: E402

TABLE = load_toolchains()
NEWEST = TABLE.pinned[TABLE.default]
RUNTIME = ["-e", str(ROOT / "runtime")]
# The noxfile's environments (quantize, compile_ctx per pin, publish), installed with uv.
ENVIRONMENTS = {
    "quantize": [*NEWEST.requirements, *RUNTIME, "-e", f"{ROOT}[build]"],
    "publish": [f"onnxruntime=={NEWEST.onnxruntime}", "numpy", *RUNTIME],
}
CHECKOUT = ("configs", "calibration")  # what a job's configs and readers need from a checkout


def environment_requirements(stage: str, toolchain: str) -> list[str]:
    if stage == "compile":
        return [*TABLE.get(toolchain).requirements, *RUNTIME, "numpy", "tqdm>=4.66"]
    return ENVIRONMENTS[stage]


def make_environment(folder: Path, requirements: list[str]) -> Path:
    """A fresh venv with ``requirements``, from uv's cache; returns its python."""
    uv = shutil.which("uv") or "uv"
    shutil.rmtree(folder, ignore_errors=True)
    subprocess.run([uv, "venv", "-q", str(folder), "--python", sys.executable], check=True)
    python = folder / "bin" / "python"
    subprocess.run([uv, "pip", "install", "-q", "--python", str(python), *requirements], check=True)
    return python


def fresh_runner(runner: Path) -> Path:
    if runner.exists():
        shutil.rmtree(runner)
    runner.mkdir(parents=True)
    for name in CHECKOUT:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, runner / name)
    return runner


def cli(python: Path, cwd: Path, *args: str) -> float:
    """One ``python -m pipeline`` call with the checkout's code; its wall time in seconds."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    started = time.perf_counter()
    done = subprocess.run(
        [str(python), "-m", "pipeline", *args], cwd=cwd, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"`pipeline {' '.join(args)}` failed:\n{done.stdout}\n{done.stderr}")
    return time.perf_counter() - started


def copy_into(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        shutil.copytree(source, target, dirs_exist_ok=True)
    else:
        shutil.copyfile(source, target)


def run_job(job: dict, runner: Path, envs: Path, shards: Path) -> dict[str, float]:
    """Setup, run and shard times of one job, as a fresh CI runner would spend them."""
    times = {}
    started = time.perf_counter()
    work = fresh_runner(runner)
    python = make_environment(
        envs / job["stage"], environment_requirements(job["stage"], job["toolchain"])
    )
    for need in job["needs"]:  # a download of each needed shard
        target = work / "shards" / need if job["stage"] == "publish" else work / "artifacts"
        copy_into(shards / need, target)
    times["setup"] = time.perf_counter() - started
    art = ["--artifacts", "artifacts"]
    if job["stage"] == "quantize":
        times["run"] = cli(python, work, "example") + cli(
            python, work, "quantize", job["config"], *art
        )
    elif job["stage"] == "compile":
        times["run"] = cli(
            python, work, "compile", job["config"], *art, "--toolchain", job["toolchain"]
        )
    else:
        froms = [f"shards/{n}" for n in job["needs"]]
        times["run"] = cli(python, work, "publish", job["config"], *art, "--from", *froms)
    started = time.perf_counter()
    for path in job["produces"]:  # an upload of the job's shard
        copy_into(work / "artifacts" / path, shards / job["job"] / path)
    times["shard"] = time.perf_counter() - started
    return times


def single_machine(plan: dict, runner: Path, envs: Path) -> dict[str, float]:
    """The same build in one folder, serially, with every environment made beforehand."""
    configs = [j["config"] for j in plan["quantize"]["include"]]
    toolchains = sorted({j["toolchain"] for j in plan["compile"]["include"]})
    pythons = {
        key: make_environment(envs / f"single-{key}", environment_requirements(stage, tc))
        for key, stage, tc in [
            ("quantize", "quantize", ""),
            ("publish", "publish", ""),
            *[(f"compile-{tc}", "compile", tc) for tc in toolchains],
        ]
    }
    work = fresh_runner(runner)
    art = ["--artifacts", "artifacts"]
    times = {"quantize": cli(pythons["quantize"], work, "example")}
    times["quantize"] += cli(pythons["quantize"], work, "quantize", *configs, *art)
    times["compile"] = sum(
        cli(pythons[f"compile-{tc}"], work, "compile", *configs, *art, "--toolchain", tc)
        for tc in toolchains
    )
    times["publish"] = cli(pythons["publish"], work, "publish", *configs, *art)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", help="configs relative to the checkout's root")
    parser.add_argument("--work", type=Path, default=Path("/tmp/qnn-matrix-benchmark"))
    args = parser.parse_args()
    work = args.work.resolve()
    shutil.rmtree(work / "shards", ignore_errors=True)
    runner = work / "runner" / "work"
    shared = ROOT.parent / "shared"
    if shared.is_dir() and not (runner.parent / "shared").exists():
        runner.parent.mkdir(parents=True, exist_ok=True)
        (runner.parent / "shared").symlink_to(shared)  # ../shared beside the checkout
    plan_run = subprocess.run(
        [sys.executable, "-m", "pipeline", "plan", *args.configs, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'runtime'}"),
    )
    if plan_run.returncode != 0:
        raise SystemExit(plan_run.stderr)
    plan = json.loads(plan_run.stdout)
    rows, totals = [], {"setup": 0.0, "run": 0.0, "shard": 0.0}
    for stage in ("quantize", "compile", "publish"):
        for job in plan[stage]["include"]:
            times = run_job(job, runner, work / "envs", work / "shards")
            rows.append((job["job"], len(job["targets"]), times))
            for key in totals:
                totals[key] += times[key]
    single = single_machine(plan, runner, work / "envs")

    print(
        "| job | targets | setup s (fresh env from warm uv cache, shards in) | run s | shard out s |"
    )
    print("|---|---|---|---|---|")
    for name, targets, t in rows:
        print(
            f"| {name} | {targets or '-'} | {t['setup']:.1f} | {t['run']:.1f} | {t['shard']:.2f} |"
        )
    print(
        f"| **{len(rows)} jobs, serially** | | {totals['setup']:.1f} | {totals['run']:.1f} | "
        f"{totals['shard']:.2f} |"
    )
    print()
    print(
        "one machine, one folder, environments made beforehand: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in single.items())
        + f", total {sum(single.values()):.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
