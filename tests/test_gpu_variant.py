"""The gpu variant: asked for in [compile], built by compile (the float or fp16 model, checked
against the float model, its QNN GPU session tried for real), published in the manifest, and
skipped by the runtime where there is no GPU. QNN's GPU backend cannot initialise on this x86_64
machine: what runs on a GPU is unverified here, and these tests say where that shows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from release_fixtures import MODEL, TARGETS, TOOLCHAIN, VERSION, cached_build, write_config

import qnn_ctx_runtime
from pipeline.compile.build import compile_model, resolve_toolchain
from pipeline.core.config import load_config
from pipeline.core.errors import ConfigError
from pipeline.core.layout import VariantPaths
from pipeline.publish.release import publish_model
from qnn_ctx_runtime import qnn
from qnn_ctx_runtime.manifest import MANIFEST_FILE, Manifest
from qnn_ctx_runtime.toolchains import load_toolchains

GPU16 = "gpu-float16_qnn-2.51.0"
FEED = {"x": np.random.default_rng(5).standard_normal((1, 3, 16, 16)).astype(np.float32)}


def configure(build, gpu: str) -> Path:
    return write_config(build.root, [t for t, _ in TARGETS], [TOOLCHAIN], VERSION, f'gpu = "{gpu}"')


def compile_here(config: Path, artifacts: Path):
    installed = qnn.installed_qnn()
    table = load_toolchains()
    pin = resolve_toolchain(table, TOOLCHAIN, installed)
    return compile_model(load_config(config), artifacts, table, pin, installed, out=lambda _: None)


@pytest.fixture(scope="module")
def gpu_build(tmp_path_factory):
    """The cached two-target build, asked for a float16 gpu variant and compiled again."""
    build = cached_build(tmp_path_factory).copy(tmp_path_factory.mktemp("gpu") / "p")
    config = configure(build, "float16")
    return build, config, compile_here(config, build.artifacts)


@pytest.mark.qnn
def test_asking_for_a_gpu_variant_builds_only_that(gpu_build):
    _, _, built = gpu_build
    by_target = {b.record.target: b for b in built}
    assert set(by_target) == {"snapdragon-x-elite", "snapdragon-8-gen-3", "gpu"}
    # the ctx variants did not change: [compile] gpu is not one of their settings
    assert by_target["snapdragon-x-elite"].skipped and by_target["snapdragon-8-gen-3"].skipped
    assert not by_target["gpu"].skipped


@pytest.mark.qnn
def test_the_gpu_model_is_fp16_inside_float32_outside_and_close_to_float(gpu_build):
    import onnx

    _, _, built = gpu_build
    gpu = next(b for b in built if b.record.target == "gpu")
    record = gpu.record
    (name,) = record.sets[0].ctx_files.values()
    model = onnx.load(str(gpu.folder / name))
    types = {i.data_type for i in model.graph.initializer}
    assert onnx.TensorProto.FLOAT16 in types and onnx.TensorProto.FLOAT not in types
    io = [v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.output]]
    assert io == [onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT]  # callers feed float32
    assert not [n for n in model.graph.node if n.op_type == "EPContext"]
    validation = record.validation
    assert validation.samples > 0 and 40.0 < validation.worst_snr_db < float("inf")
    assert validation.gate.startswith("the float16 model on the CPU EP (GPU unverified)")


@pytest.mark.qnn
def test_the_gpu_session_really_ran_and_the_gate_is_deferred_to_the_device(gpu_build):
    _, _, built = gpu_build
    record = next(b for b in built if b.record.target == "gpu").record
    assert (record.backend, record.soc_model, record.htp_arch) == ("gpu", 0, 0)
    assert record.status == "ok" and record.deferred_to_device and record.passed
    assert record.coverage is None  # nothing ran on a GPU here
    assert record.error.kind == "unavailable"
    assert "QNN_BACKEND_ERROR_CANNOT_INITIALIZE" in record.error.message
    assert record.failed_gates() == []
    log = VariantPaths(next(b for b in built if b.record.target == "gpu").folder).log
    assert "QNN_BACKEND_ERROR_CANNOT_INITIALIZE" in log.read_text("utf-8")


@pytest.mark.qnn
def test_a_second_compile_reuses_it_and_another_precision_rebuilds_only_it(gpu_build, tmp_path):
    build, config, _ = gpu_build
    again = compile_here(config, build.artifacts)
    assert all(b.skipped for b in again)
    copy = build.copy(tmp_path / "p")
    rebuilt = compile_here(configure(copy, "float32"), copy.artifacts)
    by_target = {b.record.target: b for b in rebuilt}
    assert not by_target["gpu"].skipped
    assert by_target["snapdragon-x-elite"].skipped and by_target["snapdragon-8-gen-3"].skipped
    assert by_target["gpu"].record.validation.worst_snr_db == float("inf")  # the float model
    # publishing with the config back at float16 refuses the float32 build, naming the fix
    configure(copy, "float16")
    folder = publish_model(load_config(copy.config), copy.artifacts).folder
    manifest = Manifest.read(folder / MANIFEST_FILE)
    assert [v.backend for v in manifest.variants] == ["htp", "htp"]
    excluded = {e.id: e.reason for e in manifest.excluded}
    assert excluded[GPU16].startswith("built for another precision than float16")
    assert "Run `nox -s compile_ctx` again" in excluded[GPU16]


@pytest.fixture(scope="module")
def gpu_release(gpu_build) -> Path:
    build, config, _ = gpu_build
    return publish_model(load_config(config), build.artifacts).folder


@pytest.mark.qnn
def test_the_manifest_carries_it_unverified(gpu_release):
    manifest = Manifest.read(gpu_release / MANIFEST_FILE)
    gpu = next(v for v in manifest.variants if v.backend == "gpu")
    assert gpu.id == GPU16 and gpu.target == "gpu" and gpu.passed
    assert (gpu.soc_model, gpu.htp_arch, gpu.ep_compatibility_info, gpu.embed_mode) == (0, 0, "", 0)
    assert gpu.coverage["verified_on_hardware"] is False
    assert "session.disable_cpu_ep_fallback=1" in gpu.coverage["gate"]
    assert gpu.accuracy["precision"] == "float16"
    assert gpu.buckets.entries[0].qdq_sha256 is None  # not compiled from the QDQ model
    assert manifest.schema_version.value == "2"  # no new field: an older runtime skips it
    data = json.loads((gpu_release / MANIFEST_FILE).read_text("utf-8"))
    assert [v["backend"] for v in data["variants"]] == ["htp", "htp", "gpu"]


@pytest.mark.qnn
def test_the_runtime_lists_it_and_runs_the_npu_or_the_cpu_here(gpu_release):
    with qnn_ctx_runtime.load(gpu_release, target="snapdragon-x-elite") as model:
        assert model.backend == "htp"
        verdict = next(v for v in model.facts()["variants"] if v["variant"] == GPU16)
        assert verdict["eligible"] is False and "no GPU" in verdict["why"][0]
    with pytest.warns(RuntimeWarning, match="on the CPU, not the NPU"):
        model = qnn_ctx_runtime.load(gpu_release, target="snapdragon-888", allow_cpu_fallback=True)
    with model:
        assert model.backend == "cpu" and model.run(FEED)["y"].shape == (1, 4, 16, 16)


def test_a_config_names_the_gpu_choices(tmp_path):
    config = tmp_path / "m.toml"
    config.write_text(
        f'[model]\nname = "{MODEL}"\nversion = "1"\nsource = "m.onnx"\n[compile]\ngpu = "fp16"\n',
        "utf-8",
    )
    with pytest.raises(ConfigError) as info:
        load_config(config, check_files=False)
    assert "compile.gpu" in str(info.value) and "float16" in str(info.value)


NO_ONNX = """
import sys
from pathlib import Path
sys.modules["onnx"] = None  # a compile environment without onnx
from pipeline.compile.gpu import write_model
from qnn_ctx_runtime.errors import ActionableError
try:
    write_model(Path(sys.argv[1]), Path(sys.argv[2]), "float16")
except ActionableError as exc:
    print(str(exc))
write_model(Path(sys.argv[1]), Path(sys.argv[2]), "float32")  # a copy: needs nothing
print("float32", Path(sys.argv[2]).stat().st_size == Path(sys.argv[1]).stat().st_size)
"""


@pytest.mark.qnn
def test_float16_without_onnx_says_what_to_install(gpu_build, tmp_path):
    from release_fixtures import run_python

    build, _, _ = gpu_build
    float_model = build.paths.bucket("static").float_model
    done = run_python(NO_ONNX, str(float_model), str(tmp_path / "m.onnx"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "compile.gpu = 'float16' converts the float model with onnx" in done.stdout
    assert (
        "TIP: pip install onnx==1.23.2 beside onnxruntime, or use compile.gpu = 'float32'."
        in done.stdout
    )
    assert done.stdout.strip().endswith("float32 True")
