"""Real build trees for publish/runtime tests: a seeded CNN, quantized and compiled for QNN.

The float model comes from onnx.helper and goes through the real quantize stage
(``pipeline.quantize.build.quantize_model``), which writes ``build/<model>/record.json`` and the
one bucket ``buckets/static/{float,qdq}.onnx`` with its held-out samples. The ctx variants are
made the way the compile stage makes them, without its child processes and load benchmarks
(faster, and independent of compile's own behaviour): ctx from ort.ModelCompiler (HTP, on the
simulator here), coverage and validation measured on the simulator with the compile stage's own
functions, and a ``variant.json`` (``VariantRecord``) whose SDK facts are read from the compiled
file with onnx and whose ``built_from`` is what the compile stage records for the current QDQ
model (``pipeline.compile.build.model_inputs``). Everything is built once per test session and
cached under pytest's base temp folder.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

MODEL = "tiny"
VERSION = "1.0.0"
TOOLCHAIN = "2.7.0"
ONNXRUNTIME = "1.31.1"
BUCKET = "static"  # the one bucket of a model with a single static shape
# (target, embedded): one embedded ctx and one with its context binary in a .bin
TARGETS = (("snapdragon-x-elite", True), ("snapdragon-8-gen-3", False))
INPUT_SHAPE = [1, 3, 16, 16]
OUTPUT_SHAPE = [1, 4, 16, 16]


def float_model(path: Path, seed: int = 0, channels: int = 8, size: int = 16) -> Path:
    """Conv-Relu-Conv on 1x3xSxS; ``seed`` changes the weights and so every downstream byte."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(
            (rng.standard_normal((channels, 3, 3, 3)) * 0.3).astype(np.float32), "w1"
        ),
        numpy_helper.from_array((rng.standard_normal(channels) * 0.1).astype(np.float32), "b1"),
        numpy_helper.from_array(
            (rng.standard_normal((4, channels, 1, 1)) * 0.3).astype(np.float32), "w2"
        ),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Conv", ["r", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, size, size])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def qnn_devices() -> list:
    import onnxruntime as ort
    import onnxruntime_qnn as oq

    devices = [d for d in ort.get_ep_devices() if d.ep_name == "QNNExecutionProvider"]
    if not devices:
        ort.register_execution_provider_library("QNNExecutionProvider", oq.get_library_path())
        devices = [d for d in ort.get_ep_devices() if d.ep_name == "QNNExecutionProvider"]
    return devices


def compile_ctx(qdq: Path, out: Path, soc_model: int, htp_arch: int, embed: bool) -> list[str]:
    """Compile with the QNN EP; returns the files written, the ctx .onnx first."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_provider_for_devices(
        qnn_devices(),
        {"backend_type": "htp", "soc_model": str(soc_model), "htp_arch": str(htp_arch)},
    )
    ort.ModelCompiler(
        options,
        str(qdq),
        embed_compiled_data_into_model=embed,
        flags=ort.OrtCompileApiFlags.ERROR_IF_NO_NODES_COMPILED,
    ).compile_to_file(str(out))
    return [out.name, *(p.name for p in sorted(out.parent.glob("*.bin")))]


def ctx_facts_onnx(ctx: Path) -> dict:
    """SDK facts read the reference way, with onnx."""
    import onnx
    from onnx import helper

    model = onnx.load(str(ctx), load_external_data=False)
    node = next(n for n in model.graph.node if n.op_type == "EPContext")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    raw = attrs["ep_sdk_version"].decode()
    return {
        "ep_sdk_version": raw,
        "qnn_sdk_version": ".".join(raw.lstrip("v").split(".")[:3]),
        "embed_mode": int(attrs["embed_mode"]),
        "ep_compatibility_info": {p.key: p.value for p in model.metadata_props}.get(
            "ep_compatibility_info.QNNExecutionProvider", ""
        ),
    }


@dataclass
class Build:
    """A project-like tree: ``config`` (TOML) and ``artifacts`` with build/<model>/..."""

    root: Path
    config: Path
    artifacts: Path

    @property
    def paths(self):  # pipeline.core.layout.ModelPaths
        from pipeline.core.layout import ModelPaths

        return ModelPaths.of(self.artifacts, MODEL)

    @property
    def build(self) -> Path:
        return self.paths.root

    @property
    def qdq(self) -> Path:
        """The QDQ model of the one bucket, as the quantize stage writes it."""
        return self.paths.bucket(BUCKET).qdq

    def variant_folder(self, target: str, toolchain: str = TOOLCHAIN) -> Path:
        return self.paths.variant(toolchain, target).root

    def release(self, version: str = VERSION) -> Path:
        return self.artifacts / "releases" / MODEL / version

    def copy(self, dest: Path) -> Build:
        shutil.copytree(self.root, dest, symlinks=True)
        return Build(dest, dest / self.config.relative_to(self.root), dest / "artifacts")


def measure(ctx: Path, build: Build):
    """(Coverage, Validation) of a ctx on the HTP simulator, the way compile's worker measures:
    onnxruntime's node assignment, and the ctx vs the QDQ and float models on the CPU EP over
    the held-out samples that quantize wrote for the bucket."""
    import onnxruntime as ort

    from pipeline.compile import coverage as coverage_mod
    from pipeline.core.accuracy import worst_snr
    from pipeline.core.layout import samples_in
    from pipeline.core.metrics import OutputComparison
    from pipeline.core.records import Validation
    from qnn_ctx_runtime import qnn

    bucket = build.paths.bucket(BUCKET)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    options.add_provider_for_devices(qnn_devices(), {"backend_type": "htp"})
    session = ort.InferenceSession(str(ctx), sess_options=options)
    assert "QNNExecutionProvider" in session.get_providers()
    coverage = coverage_mod.summarize(
        coverage_mod.assignment_from_session(session), qnn.read_model_summary(ctx)
    )
    cpu = ["CPUExecutionProvider"]
    qdq = ort.InferenceSession(str(bucket.qdq), providers=cpu)
    flt = ort.InferenceSession(str(bucket.float_model), providers=cpu)
    vs_qdq, vs_float, qdq_vs_float = OutputComparison(), OutputComparison(), OutputComparison()
    samples = samples_in(bucket.heldout)
    assert samples, f"quantize wrote no held-out sample into {bucket.heldout}"
    for path in samples:
        with np.load(path) as data:
            feeds = {k: data[k] for k in data.files}
        got = {"y": session.run(["y"], feeds)[0]}
        ref_qdq = {"y": qdq.run(["y"], feeds)[0]}
        ref_float = {"y": flt.run(["y"], feeds)[0]}
        vs_qdq.add(ref_qdq, got)
        vs_float.add(ref_float, got)
        qdq_vs_float.add(ref_float, ref_qdq)
    validation = Validation(
        ctx_vs_qdq=vs_qdq.summary(),
        ctx_vs_float=vs_float.summary(),
        qdq_vs_float=qdq_vs_float.summary(),
        worst_snr_db=worst_snr(vs_qdq.summary()),
        worst_snr_vs_float_db=worst_snr(vs_float.summary()),
        samples=vs_qdq.samples,
        samples_source="heldout",
        passed=True,
        gate="no SNR gate",
    )
    return coverage, validation


def unmeasured():
    """(Coverage, Validation) for a variant not run here (another toolchain's binary)."""
    from pipeline.core.records import Coverage, Validation

    coverage = Coverage(1, 1, [], {}, [], 0, True, "measured in its own environment", [])
    validation = Validation({}, {}, {}, float("inf"), None, 0, "heldout", True, "not run here")
    return coverage, validation


def write_variant(
    build: Build,
    target: str,
    files: list[str],
    toolchain: str = TOOLCHAIN,
    onnxruntime: str = ONNXRUNTIME,
    measured: bool = True,
) -> None:
    """variant.json as the compile stage writes it: SDK facts read from the compiled file,
    ``built_from`` from the current quantize record and QDQ model."""
    from pipeline.compile.build import model_inputs, variant_digest
    from pipeline.core.config import load_config
    from pipeline.core.layout import VariantPaths
    from pipeline.core.records import (
        BucketOutcome,
        CtxFacts,
        CtxSet,
        LoadTimes,
        TensorSpec,
        VariantRecord,
        write_record,
    )
    from qnn_ctx_runtime.targets import get_target
    from qnn_ctx_runtime.toolchains import load_toolchains

    chip = get_target(target)
    pin = load_toolchains().get(toolchain)
    inputs = model_inputs(load_config(build.config), build.artifacts)
    folder = VariantPaths(build.variant_folder(target, toolchain))
    ctx = folder.root / files[0]
    facts = ctx_facts_onnx(ctx)
    sizes = {f: (folder.root / f).stat().st_size for f in files}
    ctx_set = CtxSet(
        kind="single",
        ctx_files={BUCKET: files[0]},
        bins=list(files[1:]),
        facts={
            BUCKET: CtxFacts(
                ep_context_nodes=1,
                ep_sdk_version=facts["ep_sdk_version"],
                qnn_sdk_version=facts["qnn_sdk_version"],
                ep_compatibility_info=facts["ep_compatibility_info"],
                htp_archs=[chip.htp_arch],
                soc_models=[chip.soc_model],
                embed_mode=facts["embed_mode"],
                files=list(files),
                sizes=sizes,
            )
        },
        total_bytes=sum(sizes.values()),
        bucket_bytes={BUCKET: sum(sizes.values())},
    )
    coverage, validation = measure(ctx, build) if measured else unmeasured()
    tensors_in = [TensorSpec("x", list(INPUT_SHAPE), "float32")]
    tensors_out = [TensorSpec("y", list(OUTPUT_SHAPE), "float32")]
    record = VariantRecord(
        model=MODEL,
        toolchain=toolchain,
        onnxruntime=onnxruntime,
        qnn_sdk=pin.qnn_sdk,
        target=target,
        soc_model=chip.soc_model,
        htp_arch=chip.htp_arch,
        backend="htp",
        status="ok",
        inputs_digest=variant_digest(inputs, pin, onnxruntime, chip),
        built_from=inputs.built_from,
        sets=[ctx_set],
        validated_with="single",
        shared_load_probe="",
        inputs=tensors_in,
        outputs=tensors_out,
        coverage=coverage,
        validation=validation,
        buckets={BUCKET: BucketOutcome(coverage, tensors_in, tensors_out, validation)},
        load=LoadTimes(
            runs=3, ctx_s=0.01, all_s=0.01, buckets={BUCKET: 0.01}, qdq_s=0.1, ratio=10.0
        ),
        memory=None,
        compile_time_s=0.5,
        error=None,
    )
    write_record(folder.record, record)


def compile_variant(
    build: Build, target: str, embed: bool, toolchain: str = TOOLCHAIN
) -> list[str]:
    """Compile the current QDQ model for ``target`` into its (fresh) variant folder and record
    it; returns the files, the ctx first."""
    from pipeline.compile.build import ctx_file_name
    from qnn_ctx_runtime.targets import get_target
    from qnn_ctx_runtime.toolchains import load_toolchains

    chip = get_target(target)
    folder = build.variant_folder(target, toolchain)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    name = ctx_file_name(MODEL, None, chip, load_toolchains().get(toolchain))
    files = compile_ctx(build.qdq, folder / name, chip.soc_model, chip.htp_arch, embed)
    write_variant(build, target, files, toolchain)
    return files


def write_config(
    root: Path, targets: list[str], toolchains: list[str], version: str, extra: str = ""
) -> Path:
    """The model config; ``extra`` is more TOML (e.g. a [quantization] table)."""
    import json

    config = root / "configs" / f"{MODEL}.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(
        f"""[model]
name = "{MODEL}"
version = "{version}"
source = "../models/{MODEL}.onnx"

[calibration]
kind = "random"
samples = 4

[compile]
targets = {json.dumps(targets)}
toolchains = {json.dumps(toolchains)}
{extra}""",
        "utf-8",
    )
    return config


def quantize(build: Build):
    """The real quantize stage on the build's config; returns its QuantizeResult."""
    from pipeline.core.config import load_config
    from pipeline.quantize.build import quantize_model

    return quantize_model(load_config(build.config), build.artifacts)


def make_build(root: Path, seed: int = 0, version: str = VERSION) -> Build:
    """Float -> quantize stage -> two ctx variants (embedded x-elite, .bin 8-gen-3)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "models").mkdir(exist_ok=True)
    float_model(root / "models" / f"{MODEL}.onnx", seed)
    config = write_config(root, [t for t, _ in TARGETS], [TOOLCHAIN], version)
    build = Build(root, config, root / "artifacts")
    quantize(build)
    for target, embed in TARGETS:
        compile_variant(build, target, embed)
    return build


def cached_build(
    tmp_path_factory: pytest.TempPathFactory, name: str = "base", seed: int = 0
) -> Build:
    """One build per session and seed, shared by every test module; tests copy it to mutate."""
    pytest.importorskip("onnxruntime_qnn")
    pytest.importorskip("onnx")
    root = tmp_path_factory.getbasetemp() / f"release-build-{name}-{seed}"
    done = root / ".done"
    if not done.is_file():
        if root.exists():
            shutil.rmtree(root)
        make_build(root, seed)
        done.write_text("ok")
    return Build(root, root / "configs" / f"{MODEL}.toml", root / "artifacts")


def python_path() -> str:
    """PYTHONPATH for a child interpreter: this checkout's pipeline and qnn_ctx_runtime."""
    from venvs import REPO_ROOT

    return os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "runtime")])


def run_python(code: str, *args: str, timeout: float = 300):
    """Run ``code`` in a fresh interpreter of this environment, with the repo importable."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=python_path())
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
