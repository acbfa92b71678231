"""Our pipeline vs Olive on the same models, side by side in one run.

    python benchmarks/olive_compare.py [configs/shared/*.toml] [--artifacts DIR]

For each config (bucketed ones are skipped, so are models whose file is absent), two chains run
as child processes, each timed (wall) and measured (peak RSS from ``os.wait4``, the largest of
the process and the workers it waited for; output goes to a log file, never a pipe):

* Olive, the reference workflow of ../shared/FACTS.md §9: DynamicToFixedShape (the shapes of our
  config's [inputs]) -> QNNPreprocess -> OnnxStaticQuantization (uint16 activations, uint8
  weights, MinMax, 4 random samples) -> EPContextBinaryGenerator (soc_model/htp_arch of the
  config's first target, context embedded); a first run on an empty Olive cache, then a rerun
  with nothing changed. Olive exits 0 on most failures, so its output must exist and hold an
  EPContext node; that ctx is then loaded with the QNN EP here and ORT's own node assignment
  (``session.record_ep_graph_assignment_info``) gives QNN partitions and CPU compute nodes, and
  (untimed, after our run) it runs on the HTP simulator on our held-out real inputs, compared
  with the float model on the CPU: the same ctx-vs-float SNR as ours.
* Ours: ``python -m pipeline quantize`` and ``compile`` with ``--force`` and ``publish`` (a
  versioned release; an earlier benchmark's release of the model is removed first), then all
  three again without it (the skip cache; publish finds the release there with the same
  content). Partitions, CPU nodes and ctx-vs-float SNR (held-out real inputs on the HTP
  simulator) come from the variant report. Our compile also validates the ctx on the
  HTP simulator and benchmarks session loads (no flag turns these off), and quantize evaluates
  the QDQ model on held-out inputs: the figures include that work, Olive's do not.

Olive is never a dependency of this project. It lives in its own venv, created once and cached
under ``~/.cache/qnn-pipeline/envs/olive-0.13.0/`` (``QNN_PIPELINE_ENVS`` moves the root, as for
tests/venvs.py), with onnxruntime 1.31.1 and onnxruntime-qnn 2.7.0. ``pip install
olive-ai==0.13.0`` would pull torch with CUDA (GBs of nvidia-* wheels), so olive-ai is installed
with ``--no-deps`` plus the runtime deps that ``import olive`` and these four passes need (found
by trial: ``import olive`` imports torch, transformers, onnxscript, torchmetrics, optuna and its
telemetry; the calibration data loader is torch's), with torch's CPU build: a local
``torch-*+cpu*.whl`` from the pip/uv find-links directories when there is one, else uv's
``--torch-backend cpu``. Left out: pandas, questionary and CUDA.

Two things are done to let Olive run here at all, neither changes what it computes:
* onnxruntime 1.24-1.31's ``qnn_preprocess_model`` raises ``TypeError: cannot convert dictionary
  update sequence element #0`` on any model with ``metadata_props`` (FACTS §9), and Olive writes
  its version into every model's metadata, so QNNPreprocess always fails after another pass. The
  Olive venv gets the one-line fix (``{p.key: p.value for p in ...}``) in that file.
* ``olive run`` only registers plugin EPs on Windows; on Linux its local target then has no
  QNNExecutionProvider and refuses the workflow. A short driver registers the onnxruntime-qnn
  library and calls Olive's own CLI entry point (``olive run --config``) in the same process: the
  cheapest way to run it (a PythonEnvironment target would start and import Olive a second time
  for the context pass). Telemetry is off (``OLIVE_DISABLE_TELEMETRY=1``, ``CI=1``) so no run
  waits on the network.

Olive's peak RSS is this install's (CPU torch, no pandas): FACTS §9's 1.1 GB came from another.

Prints a Markdown table (also written to <artifacts>/olive_compare.md): per model both sides'
coverage, wall time, peak RSS, rerun time and ctx-vs-float SNR, our calibration sample count and
our time to a loaded ctx (where Olive stops), then medians and the Olive / ours ratios.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import date
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "tests"))
from shared_configs import compile_bytecode, runnable_configs  # noqa: E402
from venvs import env_lock, envs_root, uv_command  # noqa: E402  (cached uv envs, shared with tests)

from pipeline.core.config import ModelConfig  # noqa: E402
from pipeline.core.layout import release_dir  # noqa: E402
from pipeline.core.records import VariantRecord, read_record  # noqa: E402
from pipeline.core.report import fmt, table  # noqa: E402

OLIVE = "0.13.0"
ONNXRUNTIME = "1.31.1"
ONNXRUNTIME_QNN = "2.7.0"
# What `import olive` and DynamicToFixedShape/QNNPreprocess/OnnxStaticQuantization/
# EPContextBinaryGenerator need from olive-ai's requirements (torch comes separately, CPU build).
OLIVE_DEPS = (
    "onnx-ir>=0.1.2",
    "onnxscript>=0.5.3",
    "opentelemetry-sdk>=1.39.1",
    "optuna",
    "pydantic>=2.0",
    "pyyaml",
    "requests",
    "torchmetrics>=1.0.0",
    "transformers",
)
READY_FILE = ".qnn-pipeline-ready"
EXCEPTION_LINE = re.compile(r"^([\w.]*(?:Error|Exception|Invalid\w*|Fail\w*)): (.*)$")
MAX_ERROR = 400
VALIDATE_SAMPLES = 16  # held-out samples per model, as our compile's validation uses
# Our compile prints "  <target>: validate" when the ctx is compiled, verified and loaded (its
# coverage measured) and validation on the simulator begins, or "  <target>: benchmark" at that
# point when it reuses the HTP judge's run of the same ctx bytes instead of validating again.
LOADED_MARKS = (": validate (", ": benchmark (")
CALIBRATION_SAMPLES = 4
# onnxruntime/quantization/execution_providers/qnn/preprocess.py, 1.24-1.31 (FACTS §9).
PREPROCESS_FILE = "onnxruntime/quantization/execution_providers/qnn/preprocess.py"
PREPROCESS_BUG = "ret_metaprops.update(ret_model.metadata_props)"
PREPROCESS_FIX = "ret_metaprops.update({p.key: p.value for p in ret_model.metadata_props})"

DRIVER = """\
import sys
import onnxruntime, onnxruntime_qnn
onnxruntime.register_execution_provider_library("QNNExecutionProvider", onnxruntime_qnn.get_library_path())
from olive.cli.launcher import main
sys.argv[0] = "olive"
main()
"""

# Olive's calibration data: a dataset registered from a user script, 4 random samples.
DATA_SCRIPT = """\
import numpy as np
from olive.data.registry import Registry


@Registry.register_dataset()
def random_inputs(inputs, samples=4, seed=0, **kwargs):
    # inputs: name -> [shape, dtype, constant or None]; floats uniform in [0, 1), ints in [0, 256)
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(samples):
        feed = {}
        for name, (shape, dtype, constant) in inputs.items():
            if constant is not None:
                feed[name] = np.full(shape, constant, dtype=dtype)
            elif np.issubdtype(np.dtype(dtype), np.floating):
                feed[name] = rng.random(shape, dtype=np.float32).astype(dtype)
            else:
                feed[name] = rng.integers(0, 256, size=shape).astype(dtype)
        data.append((feed, 0))
    return data
"""

ONNX_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "float16": "float16",
    "double": "float64",
    "int64": "int64",
    "int32": "int32",
    "int8": "int8",
    "uint8": "uint8",
    "bool": "bool",
}


# -- the Olive environment ---------------------------------------------------------------------


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(
            f"Creating the Olive environment failed: {' '.join(cmd)}\n"
            f"{(done.stderr or done.stdout).strip()[-3000:]}"
        )


def _torch_cpu() -> list[str]:
    """A local torch CPU wheel from the find-links directories, else uv's CPU backend."""
    dirs = []
    for var in ("UV_FIND_LINKS", "PIP_FIND_LINKS"):
        dirs += [d for d in os.environ.get(var, "").replace(",", " ").split() if d]
    for directory in dirs:
        py = f"cp{sys.version_info.major}{sys.version_info.minor}"
        wheels = sorted(glob.glob(os.path.join(directory, f"torch-*+cpu-{py}-*.whl")))
        if wheels:
            return [wheels[-1]]
    return ["--torch-backend", "cpu", "torch"]


def _installed(python: Path) -> dict[str, str]:
    script = (
        "import importlib.metadata as m, json\n"
        "print(json.dumps({d.metadata['Name'].lower(): d.version for d in m.distributions()}))"
    )
    done = subprocess.run([str(python), "-c", script], capture_output=True, text=True)
    return json.loads(done.stdout) if done.returncode == 0 else {}


def _patch_preprocess(env: Path) -> None:
    """The one-line upstream fix for qnn_preprocess_model on models with metadata."""
    files = glob.glob(str(env / "lib" / "python*" / "site-packages" / PREPROCESS_FILE))
    if len(files) != 1:
        raise SystemExit(f"{env}: expected one {PREPROCESS_FILE}, found {files}")
    path = Path(files[0])
    text = path.read_text()
    if PREPROCESS_BUG in text:
        path.write_text(text.replace(PREPROCESS_BUG, PREPROCESS_FIX))
    elif PREPROCESS_FIX not in text:
        raise SystemExit(f"{path} changed: neither the known bug nor its fix is there")
    _run([str(env / "bin" / "python"), "-m", "compileall", "-q", str(path)])


def olive_python() -> Path:
    """The python of the cached Olive venv, created on first use."""
    env = envs_root() / f"olive-{OLIVE}"
    python = env / "bin" / "python"
    onnx_version = version("onnx")
    wanted = {
        "olive-ai": OLIVE,
        "onnxruntime": ONNXRUNTIME,
        "onnxruntime-qnn": ONNXRUNTIME_QNN,
        "onnx": onnx_version,
    }
    with env_lock(env.with_name(env.name + ".lock")):
        ready = env / READY_FILE
        if ready.is_file() and python.exists() and json.loads(ready.read_text()) == wanted:
            return python
        print(f"creating the Olive environment in {env} (once) ...", flush=True)
        if env.exists():
            shutil.rmtree(env)
        uv = uv_command()
        _run([*uv, "venv", "--quiet", "--python", sys.executable, str(env)])
        install = [*uv, "pip", "install", "--quiet", "--compile-bytecode", "--python", str(python)]
        _run([*install, *_torch_cpu()])
        _run(
            [
                *install,
                f"onnxruntime=={ONNXRUNTIME}",
                f"onnxruntime-qnn=={ONNXRUNTIME_QNN}",
                f"onnx=={onnx_version}",
                *OLIVE_DEPS,
            ]
        )
        _run([*install, "--no-deps", f"olive-ai=={OLIVE}"])
        _patch_preprocess(env)
        have = _installed(python)
        wrong = {k: (v, have.get(k)) for k, v in wanted.items() if have.get(k) != v}
        if wrong or "+cpu" not in have.get("torch", "+cpu"):
            raise SystemExit(f"{env} does not hold what was asked (wanted, found): {wrong}")
        ready.write_text(json.dumps(wanted))
    return python


# -- measuring a child -------------------------------------------------------------------------


@dataclass
class Run:
    seconds: float
    returncode: int
    peak_mib: float
    log: Path
    marks: dict[str, float] = field(default_factory=dict)  # text -> seconds to its first sight


def measure(
    cmd: list[str],
    log: Path,
    cwd: Path,
    env: dict[str, str] | None = None,
    marks: tuple[str, ...] = (),
) -> Run:
    """Wall time, exit code and peak RSS of one child; its output goes to ``log``.

    ``marks`` are texts the child prints at known points (our compile's stage lines): the time
    each first shows up in the log is recorded, polling every 50 ms.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    seen: dict[str, float] = {}
    with open(log, "wb") as out, open(log, "rb") as tail:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env)
        text = b""
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG if marks else 0)
            now = time.perf_counter() - start
            if marks:
                text += tail.read()
                for mark in marks:
                    if mark not in seen and mark.encode() in text:
                        seen[mark] = now
            if pid:
                break
            time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4, not by Popen
    return Run(now, proc.returncode, usage.ru_maxrss / 1024, log, seen)


def last_error(log: Path) -> str:
    """Why a run failed, from its log: the failing Olive pass (if any) and the last exception."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    where = ""
    for line in lines:
        if m := re.search(r"Running pass (\S+)", line):
            where = m.group(1)
        if "Pass run failed" in line:
            break
    else:
        where = ""
    errors = [m for line in lines if (m := EXCEPTION_LINE.match(line))]
    if errors:
        kind, message = errors[-1].group(1).rsplit(".", 1)[-1], errors[-1].group(2)
        text = f"{kind}: {' '.join(message.split())}"
    else:
        keys = ("Error", "error:", "No output model", "failed")
        hits = [line for line in lines if any(k in line for k in keys)]
        text = (hits or lines or ["(empty log)"])[-1]
    if len(text) > MAX_ERROR:
        text = text[: MAX_ERROR // 2] + " ... " + text[-MAX_ERROR // 2 :]
    return f"{where} failed: {text}" if where else text


# -- Olive -------------------------------------------------------------------------------------


def olive_inputs(config: ModelConfig) -> dict[str, list[Any]]:
    """name -> [fixed shape, dtype, constant or None] for every real graph input."""
    from qnn_ctx_runtime.qnn import read_model_summary

    summary = read_model_summary(config.source_path)
    inputs = {}
    for value in summary.inputs:
        if value.name in summary.initializers:
            continue  # a weight listed as an input (ultraface): ORT feeds the initializer
        shape = config.inputs.shapes.get(value.name)
        if shape is None:
            shape = [config.inputs.dims.get(d, d) if isinstance(d, str) else d for d in value.shape]
        unknown = [d for d in shape if not isinstance(d, int) or d <= 0]
        if unknown:
            raise ValueError(f"input {value.name} keeps dims {unknown}; [inputs] does not fix them")
        inputs[value.name] = [
            list(shape),
            ONNX_DTYPES.get(value.dtype, value.dtype),
            config.inputs.constants.get(value.name),
        ]
    return inputs


def olive_config(config: ModelConfig, work: Path, soc_model: int, htp_arch: int) -> dict:
    inputs = olive_inputs(config)
    accelerators = [{"device": "npu", "execution_providers": ["QNNExecutionProvider"]}]
    return {
        "input_model": {"type": "ONNXModel", "model_path": str(config.source_path)},
        "systems": {"local_system": {"type": "LocalSystem", "accelerators": accelerators}},
        "data_configs": [
            {
                "name": "calibration",
                "user_script": str(work / "data.py"),
                "load_dataset_config": {
                    "type": "random_inputs",
                    "params": {"inputs": inputs, "samples": CALIBRATION_SAMPLES},
                },
                "dataloader_config": {"type": "no_auto_batch_dataloader"},
            }
        ],
        "passes": {
            "fixed": {
                "type": "DynamicToFixedShape",
                "input_name": list(inputs),
                "input_shape": [v[0] for v in inputs.values()],
            },
            "preprocess": {"type": "QNNPreprocess"},
            "quantize": {
                "type": "OnnxStaticQuantization",
                "data_config": "calibration",
                "activation_type": "uint16",
                "precision": "uint8",
                "calibrate_method": "MinMax",
            },
            "ctx": {
                "type": "EPContextBinaryGenerator",
                "provider_options": {"soc_model": str(soc_model), "htp_arch": str(htp_arch)},
                "embed_context": True,
            },
        },
        "host": "local_system",
        "target": "local_system",
        "cache_dir": str(work / "cache"),
        "output_dir": str(work / "out"),
    }


def load_ctx(request: dict[str, Any]) -> dict[str, Any]:
    """Open a ctx model with the QNN EP, summarise ORT's node assignment, and (given held-out
    samples) its SNR vs the float model; runs in a child of this script."""
    import numpy as np
    import onnxruntime as ort

    from pipeline.compile import coverage
    from pipeline.core import metrics
    from pipeline.core.accuracy import worst_snr
    from qnn_ctx_runtime import qnn

    path = request["ctx"]
    ep = qnn.find_qnn_ep()
    options = ep.session_options(
        qnn.QnnOptions(soc_model=request["soc_model"], htp_arch=request["htp_arch"]),
        {"session.record_ep_graph_assignment_info": "1"},
    )
    session = ort.InferenceSession(path, options)
    report = coverage.summarize(
        coverage.assignment_from_session(session), qnn.read_model_summary(path)
    )
    result = {
        "qnn_partitions": report.qnn_partitions,
        "cpu_compute_nodes": len(report.cpu_compute_nodes),
        "cpu_ops": dict(report.cpu_ops),
        "snr_db": None,
    }
    samples = request.get("samples") or []
    if not samples:
        return result
    cpu_options = ort.SessionOptions()
    cpu_options.log_severity_level = 3
    reference = ort.InferenceSession(
        request["float"], cpu_options, providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in session.get_outputs()]
    types = {i.name: i.type for i in session.get_inputs()}
    np_types = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
    constants = request.get("constants", {})
    comparison = metrics.OutputComparison()
    for sample in samples:
        with np.load(sample, allow_pickle=False) as data:
            feeds = {}
            for name, kind in types.items():
                if name in data.files:
                    value = data[name]
                elif name in constants:
                    value = np.asarray(constants[name])
                else:
                    result["snr_note"] = f"no held-out value for input {name}"
                    return result
                feeds[name] = value.astype(np_types.get(kind, value.dtype), copy=False)
        got = session.run(names, feeds)
        want = reference.run(names, feeds)
        comparison.add(
            dict(zip(names, (np.asarray(w, np.float32) for w in want), strict=True)),
            dict(zip(names, (np.asarray(g, np.float32) for g in got), strict=True)),
        )
    result["snr_db"] = worst_snr(comparison.summary())
    return result


@dataclass
class Side:
    """One chain's figures for one model."""

    whole: str = "-"
    partitions: Any = "-"
    cpu_nodes: Any = "-"
    seconds: float | None = None
    to_ctx_s: float | None = None  # ours: until simulator validation starts
    peak_mib: float | None = None
    rerun_s: float | None = None
    rerun_peak_mib: float | None = None
    snr_db: float | None = None
    notes: list[str] = field(default_factory=list)
    ctx: Path | None = None  # Olive: its output model, checked after our run
    calibration: int | None = None  # samples calibrated on


def coverage_verdict(side: Side, partitions: int, cpu_nodes: int, cpu_ops: dict) -> None:
    side.partitions, side.cpu_nodes = partitions, cpu_nodes
    whole = partitions == 1 and cpu_nodes == 0
    side.whole = "yes" if whole else "no"
    if cpu_ops:
        ops = ", ".join(f"{op} x{n}" for op, n in sorted(cpu_ops.items(), key=lambda i: -i[1]))
        side.notes.append(f"on CPU: {ops}")


def run_olive(config: ModelConfig, python: Path, work: Path, soc_model: int, htp_arch: int) -> Side:
    side = Side()
    if work.exists():
        shutil.rmtree(work)  # a first run starts from an empty Olive cache
    work.mkdir(parents=True)
    try:
        spec = olive_config(config, work, soc_model, htp_arch)
    except ValueError as exc:
        side.whole = "not run"
        side.notes.append(str(exc))
        return side
    (work / "data.py").write_text(DATA_SCRIPT)
    (work / "driver.py").write_text(DRIVER)
    (work / "olive.json").write_text(json.dumps(spec, indent=1))
    env = {**os.environ, "OLIVE_DISABLE_TELEMETRY": "1", "CI": "1"}
    cmd = [str(python), str(work / "driver.py"), "run", "--config", str(work / "olive.json")]
    first = measure(cmd, work / "run1.log", work, env)
    again = measure(cmd, work / "run2.log", work, env)
    side.seconds, side.peak_mib = first.seconds, first.peak_mib
    side.rerun_s, side.rerun_peak_mib = again.seconds, again.peak_mib
    ctx = work / "out" / "model.onnx"
    from qnn_ctx_runtime.qnn import read_model_summary

    if not ctx.is_file() or not read_model_summary(ctx).nodes_of("EPContext"):
        side.whole = "no output"
        side.notes.append(f"exit {first.returncode}; {last_error(first.log)}")
        return side
    side.ctx = ctx
    if first.returncode != 0:
        side.notes.append(f"exit {first.returncode}")
    return side


def check_olive_ctx(
    side: Side, config: ModelConfig, heldout: list[Path], soc_model: int, htp_arch: int
) -> None:
    """Coverage of Olive's ctx with the QNN EP, and its SNR vs float on our held-out inputs."""
    request = {
        "ctx": str(side.ctx),
        "float": str(config.source_path),
        "soc_model": soc_model,
        "htp_arch": htp_arch,
        "samples": [str(p) for p in heldout[:VALIDATE_SAMPLES]],
        "constants": dict(config.inputs.constants),
    }
    done = subprocess.run(
        [sys.executable, __file__, "--load-ctx", json.dumps(request)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if done.returncode != 0:
        side.whole = "does not load"
        tail = (done.stderr or done.stdout).strip().splitlines() or ["?"]
        side.notes.append(f"loading its ctx: {tail[-1][:MAX_ERROR]}")
        return
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    coverage_verdict(side, loaded["qnn_partitions"], loaded["cpu_compute_nodes"], loaded["cpu_ops"])
    side.snr_db = loaded["snr_db"]
    if loaded.get("snr_note"):
        side.notes.append(f"no SNR: {loaded['snr_note']}")


# -- ours --------------------------------------------------------------------------------------


# Our cold build, as issue #13 defines it: quantize, compile and publish (a versioned release).
STAGES = ("quantize", "compile", "publish")


def run_ours(path: Path, config: ModelConfig, artifacts: Path) -> Side:
    side = Side()
    name = config.model.name
    logs = artifacts / "olive_compare_logs"
    base = [sys.executable, "-m", "pipeline"]
    art = ["--artifacts", str(artifacts)]
    runs = {}
    # a release is immutable: an earlier benchmark's would refuse this build's (QNN compiles
    # recurrent graphs to other bytes each time)
    shutil.rmtree(release_dir(artifacts, name, config.model.version), ignore_errors=True)
    for label, force in (("first", ["--force"]), ("rerun", [])):
        for stage in STAGES:
            flags = force if stage != "publish" else []  # a release is never overwritten
            runs[label, stage] = measure(
                [*base, stage, str(path), *art, *flags],
                logs / f"{name}-{stage}-{label}.log",
                ROOT,
                marks=LOADED_MARKS if stage == "compile" else (),
            )
    side.seconds = sum(runs["first", s].seconds for s in STAGES)
    side.peak_mib = max(runs["first", s].peak_mib for s in STAGES)
    # The stage lines are polled by compile twice a second: a compile that finishes within that
    # shows none, and its whole time is the bound.
    loaded = [runs["first", "compile"].marks.get(mark) for mark in LOADED_MARKS]
    seen = [t for t in loaded if t is not None]
    side.to_ctx_s = runs["first", "quantize"].seconds + (
        min(seen) if seen else runs["first", "compile"].seconds
    )
    side.rerun_s = sum(runs["rerun", s].seconds for s in STAGES)
    side.rerun_peak_mib = max(runs["rerun", s].peak_mib for s in STAGES)
    variants = sorted((artifacts / "build" / name / "ctx").glob("*/*/variant.json"))
    if not variants:
        side.whole = "no output"
        failed = next((r for r in runs.values() if r.returncode != 0), runs["first", "compile"])
        side.notes.append(last_error(failed.log))
        return side
    report = artifacts / "build" / name / "report.json"
    if report.is_file():
        side.calibration = json.loads(report.read_text())["calibration_samples"]
    variant, why = read_record(VariantRecord, variants[0])
    if variant is None or variant.coverage is None:
        side.whole = "no output"
        side.notes.append("; ".join(why) or "the variant has no coverage (it failed)")
        return side
    cov = variant.coverage
    coverage_verdict(side, cov.qnn_partitions, len(cov.cpu_compute_nodes), cov.cpu_ops)
    side.snr_db = variant.validation.worst_snr_vs_float_db if variant.validation else None
    for (label, stage), run in runs.items():
        if run.returncode != 0:
            side.notes.append(f"{stage} ({label}) exit {run.returncode}: {last_error(run.log)}")
    return side


# -- the table ---------------------------------------------------------------------------------


def _versions(python: Path) -> str:
    have = _installed(python)
    ours = []
    for name in ("onnxruntime", "onnxruntime-qnn", "onnx"):
        try:
            ours.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            ours.append(f"{name} absent")
    olive = ", ".join(
        f"{n} {have.get(n, '?')}"
        for n in ("olive-ai", "onnxruntime", "onnxruntime-qnn", "onnx", "torch", "transformers")
    )
    return f"Olive env: {olive}. Ours: {', '.join(ours)}"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def render(results: list[tuple[str, Side, Side]], header: str, notes: list[str]) -> str:
    headers = [
        "model",
        "Olive: whole on NPU",
        "QNN partitions",
        "CPU nodes",
        "wall s",
        "peak RSS MiB",
        "rerun s",
        "SNR ctx vs float dB",
        "ours: whole on NPU",
        "QNN partitions",
        "CPU nodes",
        "calibration samples",
        "wall s (quantize + compile + publish)",
        "of which to a loaded ctx",
        "peak RSS MiB",
        "rerun s",
        "SNR ctx vs float dB",
    ]
    rows = []
    for name, olive, ours in results:
        rows.append(
            [
                name,
                olive.whole,
                olive.partitions,
                olive.cpu_nodes,
                _num(olive.seconds),
                _num(olive.peak_mib, 0),
                _num(olive.rerun_s),
                _num(olive.snr_db),
                ours.whole,
                ours.partitions,
                ours.cpu_nodes,
                ours.calibration,
                _num(ours.seconds),
                _num(ours.to_ctx_s),
                _num(ours.peak_mib, 0),
                _num(ours.rerun_s),
                _num(ours.snr_db),
            ]
        )
    med = {
        (side, key): _median([getattr(r[i], key) for r in results])
        for i, side in ((1, "olive"), (2, "ours"))
        for key in ("seconds", "to_ctx_s", "peak_mib", "rerun_s")
    }
    whole = {side: sum(r[i].whole == "yes" for r in results) for i, side in ((1, "o"), (2, "u"))}
    rows.append(
        [
            "**median**",
            f"{whole['o']} of {len(results)}",
            "",
            "",
            _num(med["olive", "seconds"]),
            _num(med["olive", "peak_mib"], 0),
            _num(med["olive", "rerun_s"]),
            "",
            f"{whole['u']} of {len(results)}",
            "",
            "",
            "",
            _num(med["ours", "seconds"]),
            _num(med["ours", "to_ctx_s"]),
            _num(med["ours", "peak_mib"], 0),
            _num(med["ours", "rerun_s"]),
            "",
        ]
    )

    def ratio(key: str, ours: str = "") -> str:
        a, b = med["olive", key], med["ours", ours or key]
        return f"{a / b:.1f}x" if a and b else "-"

    lines = [
        header,
        "",
        table(headers, [[fmt(v, 1) if isinstance(v, float) else v for v in r] for r in rows]),
        "",
        f"Olive / ours, medians: wall time {ratio('seconds')} (to a loaded ctx: "
        f"{ratio('seconds', 'to_ctx_s')}), peak RSS {ratio('peak_mib')}, "
        f"rerun {ratio('rerun_s')}.",
    ]
    details = [
        f"- {name}, {who}: {'; '.join(side.notes)}"
        for name, olive, ours in results
        for who, side in (("Olive", olive), ("ours", ours))
        if side.notes
    ]
    if details or notes:
        lines += ["", *details, *[f"- {n}" for n in notes]]
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--load-ctx":
        print(json.dumps(load_ctx(json.loads(sys.argv[2]))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", type=Path)
    parser.add_argument("--artifacts", type=Path, default=ROOT / "artifacts" / "olive_compare")
    args = parser.parse_args()
    from qnn_ctx_runtime.targets import get_target

    configs, notes = runnable_configs(args.configs, "not compared")
    python = olive_python()
    notes.append(compile_bytecode("both sides run from bytecode (Olive's venv is installed so)"))
    artifacts = args.artifacts.resolve()
    results = []
    load = os.getloadavg()[0]
    for path, config in configs:
        name = config.model.name
        target = get_target(config.compile.targets[0])
        print(f"{name}: Olive ...", flush=True)
        olive = run_olive(
            config, python, artifacts / "olive" / name, target.soc_model, target.htp_arch
        )
        print(f"{name}: ours ...", flush=True)
        ours = run_ours(path, config, artifacts)
        if olive.ctx is not None:
            print(f"{name}: loading Olive's ctx ...", flush=True)
            heldout = sorted((artifacts / "build" / name / "heldout").glob("*.npz"))
            check_olive_ctx(olive, config, heldout, target.soc_model, target.htp_arch)
        results.append((name, olive, ours))
    header = (
        f"Olive {OLIVE} vs this pipeline, {date.today().isoformat()}, {os.cpu_count()} cores "
        f"(1-minute load average {load:.1f} at start, {os.getloadavg()[0]:.1f} at the end: "
        f"the machine is shared). {_versions(python)}."
    )
    notes += [
        "Olive: the FACTS §9 workflow with 4 random calibration samples (floats uniform in "
        "[0, 1), integers in [0, 256), whatever the model's real input range; Olive checks "
        "nothing). "
        "Afterwards, untimed, its ctx is loaded with the QNN EP here (partitions, CPU nodes) "
        "and run on the HTP simulator on the same held-out real inputs as ours, vs the float "
        "model on the CPU (its SNR column). Its wall time counts failed runs too.",
        "Ours: real calibration data; quantize also evaluates the QDQ model on held-out inputs "
        "and runs it as a ctx on the HTP simulator (up to 16 held-out samples, 4 when those are "
        "well above the target, 2 when the HTP also agrees with the CPU QDQ model: the HTP "
        "judge, which "
        "raises tensors or the whole model to 16 bit where the HTP needs it); compile reuses "
        "that run as its validation when the ctx bytes match (else it validates again, the SNR "
        "column) and benchmarks session loads. 'of which to a loaded ctx' stops the clock when "
        "the ctx is compiled, verified and loaded with its coverage measured, i.e. where Olive "
        "stops, but it includes the judge's simulator run (compile has no flag to skip the rest; "
        "its stage line is polled every 50 ms; a compile too quick to print it counts whole).",
        "peak RSS: the largest process of the run (os.wait4); ours is the larger of the two "
        "stages. rerun: the same commands again with nothing changed (Olive's cache, our skip).",
    ]
    text = render(results, header, notes)
    print(text)
    artifacts.mkdir(parents=True, exist_ok=True)
    (artifacts / "olive_compare.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
