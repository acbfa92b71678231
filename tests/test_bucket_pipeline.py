"""Shape buckets end to end on the real QNN EP and its HTP simulator: quantize once, compile into
one weight-shared context, publish, and run through the runtime at several input sizes."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import qnn_ctx_runtime
from pipeline.__main__ import main
from pipeline.core.layout import ModelPaths, VariantPaths, release_dir
from pipeline.core.metrics import snr_db
from pipeline.core.records import VariantRecord, read_record
from pipeline.example_models import build_sequence_model, synthetic_latent
from qnn_ctx_runtime import qnn
from qnn_ctx_runtime.device import Device, device_for
from qnn_ctx_runtime.errors import FeedError, ReleaseError
from qnn_ctx_runtime.manifest import MANIFEST_FILE, Manifest
from qnn_ctx_runtime.select import SIMULATOR_REFUSES_SHARED, choose_variant

MODEL = "seq_buckets"
SIZES = (16, 32, 64)
CONFIG = f"""
[model]
name = "{MODEL}"
version = "1.0.0"
source = "seq.onnx"

[calibration]
kind = "tensors"
path = "latents"
samples = 24
held_out = 0.25

[quantization]
min_snr_db = 20.0

[compile]
targets = ["snapdragon-x-elite"]
embed = false
min_snr_db = 20.0
load_runs = 1

[buckets]
dims = {{ frames = [{", ".join(str(s) for s in SIZES)}] }}
pad = {{ frames = {{ value = 0.0, side = "end" }} }}
outputs = {{ denoised = {{ axis = 2, follows = "frames" }} }}
packaging = ["shared", "standalone"]
"""


def stage(root: Path, *args: str) -> int:
    return main([args[0], "--artifacts", str(root / "artifacts"), *args[1:]])


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seeded causal sequence model, latents of varied length, quantized/compiled/published."""
    pytest.importorskip("onnxruntime_qnn")
    root = tmp_path_factory.mktemp("buckets")
    onnx.save(build_sequence_model(), str(root / "seq.onnx"))
    rng = np.random.default_rng(7)
    (root / "latents").mkdir()
    for index in range(24):
        frames = int(rng.integers(4, SIZES[-1] + 1))
        np.save(root / "latents" / f"l{index:02d}.npy", synthetic_latent(rng, frames))
    (root / "seq.toml").write_text(CONFIG, encoding="utf-8")
    config = str(root / "seq.toml")
    for name in ("quantize", "compile", "publish"):
        assert stage(root, name, config) == 0, name
    return root


def paths(root: Path) -> ModelPaths:
    return ModelPaths.of(root / "artifacts", MODEL)


def build_dir(root: Path) -> Path:
    return paths(root).root


def variant_paths(root: Path) -> VariantPaths:
    pin = qnn.installed_qnn().package_version
    return paths(root).variant(pin, "snapdragon-x-elite")


def release(root: Path) -> Path:
    return release_dir(root / "artifacts", MODEL, "1.0.0")


@pytest.mark.qnn
def test_quantized_once_every_bucket_has_the_same_weights_and_parameters(built: Path) -> None:
    report = json.loads((build_dir(built) / "report.json").read_text())
    buckets = report["buckets"]
    assert [b["name"] for b in buckets] == [f"frames{s}" for s in SIZES]
    assert [b["shapes"] for b in buckets] == [{"latent": [1, 16, s]} for s in SIZES]
    # Every calibration sample went to exactly one bucket (its smallest that holds it), and each
    # bucket had samples of its own.
    assert not any(b["calibrated_with_smaller"] for b in buckets)
    assert sum(b["calibration_samples"] for b in buckets) == report["calibration_samples"]
    # Held-out samples each have one bucket of their own and are run in every bucket that holds
    # them (padded): the report's column is that running count, and says so.
    index = json.loads((paths(built).heldout / "index.json").read_text())
    own = [sum(row["bucket"] == b["name"] for row in index) for b in buckets]
    assert not any(b["heldout_from_calibration"] for b in buckets)
    assert [b["heldout_samples"] for b in buckets] == list(itertools.accumulate(own))
    markdown = (build_dir(built) / "report.md").read_text()
    assert f"each of the {len(index)} held-out samples counts in its own bucket" in markdown
    assert build_dir(built) / "buckets" / "frames16" == paths(built).bucket("frames16").root
    models = {s: onnx.load(str(paths(built).bucket(f"frames{s}").qdq)) for s in SIZES}
    tensors = {
        s: {t.name: numpy_helper.to_array(t).tobytes() for t in m.graph.initializer}
        for s, m in models.items()
    }
    # Same initializers (quantized weights, scales, zero points) byte for byte in every bucket.
    assert tensors[16] == tensors[32] == tensors[64]
    quantized = [n for n in tensors[16] if n.endswith("_quantized")]
    assert len(quantized) >= 3
    assert report["weights"]["shared_initializers"] == len(tensors[16])
    assert report["weights"]["bucket_specific"] == []
    # Causal model: padding the end changes nothing, so the bucketed result is the float model's
    # at the true size up to quantization.
    e2e = report["end_to_end"]
    assert e2e["samples"] > 0 and e2e["shape_mismatches"] == 0
    assert e2e["source_failures"] == 0 and e2e["error"] == ""
    assert float(e2e["float_vs_source"]["denoised"]["snr_db"]) > 100  # "inf" when exact
    assert float(e2e["qdq_vs_source"]["denoised"]["snr_db"]) > 30


@pytest.mark.qnn
def test_all_buckets_share_one_context_binary(built: Path) -> None:
    folder = variant_paths(built).root
    bins = sorted(p.name for p in folder.glob("*.bin"))
    assert len(bins) == 1
    partitions = set()
    ctxs = sorted(folder.glob("*_ctx.onnx"))
    assert len(ctxs) == len(SIZES)
    for ctx in ctxs:
        nodes = qnn.read_model_summary(ctx).nodes_of("EPContext")
        assert nodes and all(n.attributes["embed_mode"] == 0 for n in nodes)
        assert {n.attributes["ep_cache_context"] for n in nodes} == {bins[0]}
        partitions |= {n.attributes["partition_name"] for n in nodes}
    assert len(partitions) == len(SIZES)  # one graph per bucket inside the shared binary
    standalone = sorted(p.name for p in variant_paths(built).standalone.glob("*.bin"))
    assert len(standalone) == len(SIZES)
    record, problems = read_record(VariantRecord, variant_paths(built).record)
    assert record is not None, problems
    shared_set, standalone_set = record.set_of("shared"), record.set_of("standalone")
    assert shared_set is not None and standalone_set is not None
    assert [s.kind for s in record.sets] == ["shared", "standalone"]  # the primary set first
    assert shared_set.bins == [bins[0]] and len(standalone_set.bins) == len(SIZES)
    assert list(shared_set.ctx_files) == [f"frames{s}" for s in SIZES]
    assert shared_set.total_bytes < standalone_set.total_bytes
    assert record.validated_with in ("shared", "standalone")
    if device_for(None).simulator:
        assert record.validated_with == "standalone"
        assert "do not load on this machine" in record.shared_load_probe
    assert list(record.buckets) == [f"frames{s}" for s in SIZES]
    for name in (f"frames{s}" for s in SIZES):
        bucket = record.buckets[name]
        assert bucket.coverage.passed, bucket.coverage
        assert bucket.validation is not None
        assert bucket.validation.passed and bucket.validation.worst_snr_db > 30
    assert record.status == "ok" and record.passed and record.inputs[0].shape == [1, 16, -1]
    # The variant names the QDQ models it was compiled from (publish checks them).
    assert set(record.built_from.qdq_sha256) == set(record.buckets)


@pytest.mark.qnn
def test_release_lists_the_buckets_and_which_files_belong_together(built: Path) -> None:
    manifest = Manifest.read(release(built) / MANIFEST_FILE)
    ids = [v.id for v in manifest.variants]
    assert ids == ["snapdragon-x-elite_qnn-2.51.0", "snapdragon-x-elite_qnn-2.51.0_standalone"]
    shared, standalone = manifest.variants
    assert [e.name for e in shared.buckets.entries] == [f"frames{s}" for s in SIZES]
    assert [e.name for e in standalone.buckets.entries] == [f"frames{s}" for s in SIZES]
    assert [e.inputs[0].shape for e in shared.buckets.entries] == [[1, 16, s] for s in SIZES]
    assert shared.buckets.shared_binary in {f.path for f in shared.files}
    assert len(shared.files) == len(SIZES) + 1  # k ctx models + 1 binary
    assert standalone.buckets.shared_binary is None and len(standalone.files) == 2 * len(SIZES)
    assert [(c.num, c.den, c.add, c.shift) for c in shared.buckets.crops] == [(1, 1, 0, 0)]
    assert manifest.cpu_fallback is None


@pytest.mark.qnn
@pytest.mark.parametrize("frames", [1, 9, 16, 17, 40, 64])
def test_runtime_matches_the_float_model_at_the_true_size(built: Path, frames: int) -> None:
    import onnxruntime as ort

    model = qnn_ctx_runtime.load(release(built), target="snapdragon-x-elite")
    assert model.facts()["buckets"] == [f"frames{s}" for s in SIZES]
    x = synthetic_latent(np.random.default_rng(100 + frames), frames)  # like the calibration data
    got = model.run({"latent": x})["denoised"]
    source = ort.InferenceSession(str(built / "seq.onnx"), providers=["CPUExecutionProvider"])
    expected = source.run(None, {"latent": x})[0]
    assert got.shape == expected.shape == (1, 16, frames)
    assert snr_db(expected, got) > 30  # u16 activations, u8 weights, on the HTP
    bucket = next(s for s in SIZES if s >= frames)
    assert model.buckets is not None and model.buckets.last is not None
    assert model.buckets.last.bucket == f"frames{bucket}"
    padding = model.buckets.last.inputs.get("latent", [])
    assert padding == ([(2, 0, bucket - frames)] if bucket > frames else [])
    model.close()


@pytest.mark.qnn
def test_bad_inputs_get_clear_errors(built: Path) -> None:
    model = qnn_ctx_runtime.load(release(built), target="snapdragon-x-elite")
    with pytest.raises(FeedError) as info:
        model.run({"latent": np.zeros((1, 16, 65), np.float32)})
    assert "larger than every bucket" in str(info.value) and "frames64" in str(info.value)
    with pytest.raises(FeedError, match="rank 2"):
        model.run({"latent": np.zeros((16, 8), np.float32)})
    with pytest.raises(FeedError, match="dtype float64, expected float32"):
        model.run({"latent": np.zeros((1, 16, 8), np.float64)})
    with pytest.raises(FeedError, match="input 'latent' is missing"):
        model.run({"noise": np.zeros((1, 16, 8), np.float32)})
    model.close()


@pytest.mark.qnn
def test_shared_set_is_preferred_on_a_device_and_refused_on_the_simulator(
    built: Path, tmp_path: Path
) -> None:
    manifest = Manifest.read(release(built) / MANIFEST_FILE)
    installed = qnn.installed_qnn()
    device = Device("snapdragon-x-elite", 60, 73, simulator=False)
    assert choose_variant(manifest, installed, device).id.endswith("2.51.0")
    # A release with only the weight-shared set, opened on the x86 simulator: refused before
    # any QNN call (QNN would crash the process), naming why.
    only_shared = tmp_path / "release"
    shutil.copytree(release(built), only_shared)
    data = json.loads((only_shared / MANIFEST_FILE).read_text())
    data["variants"] = data["variants"][:1]
    (only_shared / MANIFEST_FILE).write_text(json.dumps(data))
    simulator = Device("snapdragon-x-elite", 60, 73, simulator=True)
    assert choose_variant(manifest, installed, simulator).id.endswith("_standalone")
    with pytest.raises(ReleaseError) as info:
        choose_variant(Manifest.read(only_shared / MANIFEST_FILE), installed, simulator)
    assert SIMULATOR_REFUSES_SHARED in str(info.value)
    assert 'packaging = ["shared", "standalone"]' in (info.value.tip or "")


@pytest.mark.qnn
def test_rerun_with_nothing_changed_does_no_work(
    built: Path, capsys: pytest.CaptureFixture
) -> None:
    config = str(built / "seq.toml")
    capsys.readouterr()
    assert stage(built, "quantize", config) == 0
    assert "up to date, nothing to do" in capsys.readouterr().out
    assert stage(built, "compile", config) == 0
    assert "(unchanged, skipped)" in capsys.readouterr().out
    assert stage(built, "publish", config) == 0
    assert "already published with the same content" in capsys.readouterr().out


def _view_model() -> onnx.ModelProto:
    """Conv over a dynamic width, then ``x.view(W, 1, -1)`` as torch.onnx exports it: the
    Reshape target computed by Shape -> Gather -> Unsqueeze -> Concat (folded, per bucket, into
    a constant of the same name and another value)."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(12)
    init = [
        numpy_helper.from_array(rng.standard_normal((4, 1, 3, 3)).astype(np.float32), "cw"),
        numpy_helper.from_array(np.array(3, np.int64), "i3"),
        numpy_helper.from_array(np.array([-1], np.int64), "m1"),
        numpy_helper.from_array(np.array([1], np.int64), "one"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "cw"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Transpose", ["c"], ["t"], perm=[3, 0, 1, 2]),
        helper.make_node("Shape", ["c"], ["s"]),
        helper.make_node("Gather", ["s", "i3"], ["w"], axis=0),
        helper.make_node("Unsqueeze", ["w"], ["wu"], axes=[0]),
        helper.make_node("Concat", ["wu", "one", "m1"], ["shp"], axis=0),
        helper.make_node("Reshape", ["t", "shp"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "view",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 8, "width"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["w", 1, 32])],
        init,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)], ir_version=7)


@pytest.mark.qnn
def test_a_shape_computed_reshape_target_gets_a_name_per_bucket(tmp_path: Path) -> None:
    """QNN shares a static tensor between the graphs of one context by name: the folded Reshape
    target ([16, 1, -1] in one bucket, [32, 1, -1] in the other) must not share one."""
    onnx.save(_view_model(), str(tmp_path / "view.onnx"))
    samples = tmp_path / "t"
    samples.mkdir()
    rng = np.random.default_rng(1)
    for i, width in enumerate([12, 16, 24, 32, 10, 30, 14, 28]):
        np.save(samples / f"s{i}.npy", rng.random((1, 1, 8, width)).astype(np.float32))
    config = tmp_path / "view.toml"
    config.write_text(
        '[model]\nname = "view"\nversion = "0.1"\nsource = "view.onnx"\n'
        '[calibration]\nkind = "tensors"\npath = "t"\nsamples = 8\nheld_out = 0.25\n'
        '[compile]\ntargets = ["snapdragon-x-elite"]\nembed = false\n'
        '[buckets]\ndims = { width = [16, 32] }\noutputs = { y = { axis = 0, follows = "width" } }\n',
        encoding="utf-8",
    )
    assert stage(tmp_path, "quantize", str(config)) == 0
    paths = ModelPaths.of(tmp_path / "artifacts", "view")
    targets = {}
    for bucket in ("width16", "width32"):
        qdq = onnx.load(str(paths.bucket(bucket).qdq))
        reshape = next(n for n in qdq.graph.node if n.op_type == "Reshape")
        value = next(i for i in qdq.graph.initializer if i.name == reshape.input[1])
        targets[bucket] = (value.name, numpy_helper.to_array(value).tolist())
    assert targets["width16"][1][0] == 16 and targets["width32"][1][0] == 32
    assert targets["width16"][0] != targets["width32"][0], targets
    report = json.loads((paths.root / "report.json").read_text(encoding="utf-8"))
    assert any(p["step"] == "distinct_bucket_constants" for p in report["prepare"]), report[
        "prepare"
    ]
    assert stage(tmp_path, "compile", str(config)) == 0
