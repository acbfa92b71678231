"""Real build trees for publish/runtime tests: a seeded CNN, quantized and compiled for QNN.

The tests make their inputs the way the compile stage does, without its gates, child processes
and benchmarks (faster, and independent of compile's own behaviour): a float model from
onnx.helper, QDQ from onnxruntime.quantization, ctx from ort.ModelCompiler (HTP, on the simulator
here), and a ``variant.json`` whose SDK facts are read from the compiled file with onnx.
Everything is built once per test session and cached under pytest's base temp folder.
"""

from __future__ import annotations

import json
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
# (target, embedded): one embedded ctx and one with its context binary in a .bin
TARGETS = (("snapdragon-x-elite", True), ("snapdragon-8-gen-3", False))


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


def quantize(float_path: Path, qdq_path: Path, seed: int = 0) -> Path:
    from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    rng = np.random.default_rng(seed + 1000)
    samples = [{"x": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)} for _ in range(4)]

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(samples)

        def get_next(self):  # type: ignore[override]
            return next(self.it, None)

    config = get_qnn_qdq_config(str(float_path), Reader(), activation_type=QuantType.QUInt16)
    quantize(str(float_path), str(qdq_path), config)
    return qdq_path


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


def validate(ctx: Path, qdq: Path, seed: int = 7) -> dict:
    """ctx on the HTP simulator vs QDQ on CPU: the figures compile's validation would record."""
    import onnxruntime as ort

    x = np.random.default_rng(seed).standard_normal((1, 3, 16, 16)).astype(np.float32)
    ref = ort.InferenceSession(str(qdq), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_provider_for_devices(qnn_devices(), {"backend_type": "htp"})
    got = ort.InferenceSession(str(ctx), sess_options=options).run(None, {"x": x})[0]
    noise = float(np.sum((got - ref) ** 2)) or 1e-30
    snr = 10 * np.log10(float(np.sum(ref**2)) / noise)
    return {
        "ctx_vs_qdq": {"y": {"snr_db": snr, "max_abs": float(np.abs(got - ref).max())}},
        "samples": 1,
        "passed": True,
        "gate": "snr >= 20 dB",
    }


def write_variant(
    folder: Path,
    files: list[str],
    target: str,
    toolchain: str = TOOLCHAIN,
    onnxruntime: str = ONNXRUNTIME,
    validation: dict | None = None,
    model: str = MODEL,
    version: str = VERSION,
) -> None:
    """variant.json as the compile stage writes it, SDK facts read from the compiled file."""
    from pipeline.targets import get_target
    from pipeline.variant import TensorSpec, VariantRecord

    chip = get_target(target)
    facts = ctx_facts_onnx(folder / files[0])
    record = VariantRecord(
        model=model,
        model_version=version,
        toolchain=toolchain,
        onnxruntime=onnxruntime,
        target=target,
        soc_model=chip.soc_model,
        htp_arch=chip.htp_arch,
        status="ok",
        qnn_sdk_version=facts["qnn_sdk_version"],
        ep_sdk_version=facts["ep_sdk_version"],
        ep_compatibility_info=facts["ep_compatibility_info"],
        embed_mode=facts["embed_mode"],
        files=files,
        inputs=[TensorSpec("x", [1, 3, 16, 16], "float32")],
        outputs=[TensorSpec("y", [1, 4, 16, 16], "float32")],
        coverage={"qnn_partitions": 1, "cpu_compute_nodes": [], "passed": True, "gate": "1"},
        validation=validation or {"passed": True, "gate": "snr"},
        load={"qdq_s": 0.1, "ctx_s": 0.01, "ratio": 10.0, "runs": 3},
    )
    (folder / "variant.json").write_text(json.dumps(record.to_dict(), indent=2), "utf-8")


@dataclass
class Build:
    """A project-like tree: ``config`` (TOML) and ``artifacts`` with build/<model>/..."""

    root: Path
    config: Path
    artifacts: Path

    @property
    def build(self) -> Path:
        return self.artifacts / "build" / MODEL

    def variant_folder(self, target: str, toolchain: str = TOOLCHAIN) -> Path:
        return self.build / "ctx" / toolchain / target

    def release(self, version: str = VERSION) -> Path:
        return self.artifacts / "releases" / MODEL / version

    def copy(self, dest: Path) -> Build:
        shutil.copytree(self.root, dest, symlinks=True)
        return Build(dest, dest / self.config.relative_to(self.root), dest / "artifacts")


def write_config(root: Path, targets: list[str], toolchains: list[str], version: str) -> Path:
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
""",
        "utf-8",
    )
    return config


def write_quantize_record(build: Build) -> None:
    from pipeline.config import load_config
    from pipeline.fileio import sha256_file

    config = load_config(build.config)
    record = {
        "quantize": {
            "status": "ok",
            "inputs": {
                "source_sha256": sha256_file(config.source_path),
                "config_digest": config.digest(),
            },
            "qdq_sha256": sha256_file(build.build / "qdq.onnx"),
            "summary": {
                "activation_type": "uint16",
                "weight_type": "uint8",
                "worst_snr_db": 31.5,
                "outputs": {"y": {"snr_db": 31.5, "max_abs": 0.01, "cosine": 0.9996}},
            },
        }
    }
    (build.build / "record.json").write_text(json.dumps(record, indent=2), "utf-8")


def make_build(root: Path, seed: int = 0, version: str = VERSION) -> Build:
    """Float -> QDQ -> two ctx variants (embedded x-elite, .bin 8-gen-3), as compile leaves them."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "models").mkdir(exist_ok=True)
    float_path = float_model(root / "models" / f"{MODEL}.onnx", seed)
    config = write_config(root, [t for t, _ in TARGETS], [TOOLCHAIN], version)
    build = Build(root, config, root / "artifacts")
    build.build.mkdir(parents=True, exist_ok=True)
    qdq = quantize(float_path, build.build / "qdq.onnx", seed)
    from pipeline.targets import get_target

    for target, embed in TARGETS:
        folder = build.variant_folder(target)
        folder.mkdir(parents=True, exist_ok=True)
        chip = get_target(target)
        files = compile_ctx(
            qdq, folder / f"{MODEL}_{target}_ctx.onnx", chip.soc_model, chip.htp_arch, embed
        )
        write_variant(folder, files, target, validation=validate(folder / files[0], qdq))
    write_quantize_record(build)
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
    build = Build(root, root / "configs" / f"{MODEL}.toml", root / "artifacts")
    return build


def run_python(code: str, *args: str, timeout: float = 300):
    """Run ``code`` in a fresh interpreter of this environment, with the repo importable."""
    import os
    import subprocess

    from venvs import REPO_ROOT

    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
