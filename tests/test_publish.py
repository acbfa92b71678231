"""publish: real compiled variants -> immutable, atomic, verifiable releases."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
from release_fixtures import (
    MODEL,
    VERSION,
    Build,
    cached_build,
    compile_variant,
    ctx_facts_onnx,
    python_path,
    quantize,
    write_config,
)

import qnn_ctx_runtime
from pipeline.__main__ import main
from pipeline.core.config import load_config
from pipeline.core.errors import PublishError
from pipeline.core.fileio import sha256_file
from pipeline.core.records import QuantizeRecord, read_record
from pipeline.publish.collect import read_ctx_facts
from pipeline.publish.release import publish_model
from qnn_ctx_runtime.manifest import MANIFEST_FILE, SINGLE_BUCKET, Manifest, SchemaVersion

pytestmark = pytest.mark.qnn
X_ELITE, GEN3 = "snapdragon-x-elite", "snapdragon-8-gen-3"


@pytest.fixture(scope="session")
def base_build(tmp_path_factory) -> Build:
    return cached_build(tmp_path_factory)


@pytest.fixture
def build(base_build: Build, tmp_path: Path) -> Build:
    return base_build.copy(tmp_path / "project")


def publish(build: Build, **kwargs):
    return publish_model(load_config(build.config), build.artifacts, **kwargs)


def _merge(data: dict, changes: dict) -> None:
    """Nested dicts are merged into the record's sections; anything else replaces."""
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            _merge(data[key], value)
        else:
            data[key] = value


def edit_variant(build: Build, target: str, **changes) -> None:
    """Edit variant.json (a VariantRecord) the way a stale or tampered build would differ."""
    path = build.variant_folder(target) / "variant.json"
    data = json.loads(path.read_text("utf-8"))
    _merge(data, changes)
    path.write_text(json.dumps(data), "utf-8")


def edit_set(build: Build, target: str, **changes) -> None:
    """Edit the variant's one ctx set (kind "single") in its variant.json."""
    path = build.variant_folder(target) / "variant.json"
    data = json.loads(path.read_text("utf-8"))
    (ctx_set,) = data["sets"]
    ctx_set.update(changes)
    path.write_text(json.dumps(data), "utf-8")


def ctx_name(target: str) -> str:
    return f"{MODEL}_{target}_qnn2.51.0_ctx.onnx"


def bin_name(target: str) -> str:
    return f"{MODEL}_{target}_qnn2.51.0_ctx_qnn.bin"


def quantize_record(build: Build) -> QuantizeRecord:
    record, why = read_record(QuantizeRecord, build.paths.record)
    assert record is not None, why
    return record


def test_ctx_facts_without_onnx_match_onnx(base_build: Build):
    for target in (X_ELITE, GEN3):
        ctx = base_build.variant_folder(target) / ctx_name(target)
        facts, reference = read_ctx_facts(ctx), ctx_facts_onnx(ctx)
        assert facts.ep_sdk_versions == [reference["ep_sdk_version"]]
        assert facts.qnn_sdk_version == reference["qnn_sdk_version"] == "2.51.0"
        assert facts.embed_modes == [reference["embed_mode"]]
        assert facts.ep_compatibility_info == reference["ep_compatibility_info"]
    gen3 = base_build.variant_folder(GEN3) / ctx_name(GEN3)
    assert read_ctx_facts(gen3).bin_files == [bin_name(GEN3)]


def test_release_layout_and_manifest(build: Build):
    result = publish(build)
    release = build.release()
    assert result.folder == release and not result.unchanged
    manifest = Manifest.read(release / MANIFEST_FILE)
    assert manifest.schema_version is SchemaVersion.V2
    assert json.loads((release / MANIFEST_FILE).read_text("utf-8"))["schema_version"] == "2"
    assert (manifest.model, manifest.version) == (MODEL, VERSION)
    by_target = {v.target: v for v in manifest.variants}
    assert set(by_target) == {X_ELITE, GEN3}
    elite, gen3 = by_target[X_ELITE], by_target[GEN3]
    # The SDK comes from the compiled node and is in the folder name.
    assert elite.id == f"{X_ELITE}_qnn-2.51.0" and elite.ep_sdk_version.startswith("v2.51.0.")
    assert (elite.soc_model, elite.htp_arch, elite.embed_mode) == (60, 73, 1)
    assert (gen3.soc_model, gen3.htp_arch, gen3.embed_mode) == (57, 75, 0)
    assert elite.ep_compatibility_info == "v2:6:2.51.0:5.51.0:73:60:0:0"
    assert [f.path for f in elite.files] == [f"{elite.id}/{ctx_name(X_ELITE)}"]
    assert [f.path for f in gen3.files] == [
        f"{gen3.id}/{ctx_name(GEN3)}",
        f"{gen3.id}/{bin_name(GEN3)}",
    ]
    assert (elite.onnxruntime_qnn, elite.onnxruntime) == ("2.7.0", "1.31.1")
    assert elite.inputs[0].shape == [1, 3, 16, 16] and elite.outputs[0].name == "y"
    assert elite.accuracy["ctx_vs_qdq"]["y"]["snr_db"] > 20
    # A single static shape is one bucket, compiled from the QDQ model quantize recorded.
    record = quantize_record(build)
    qdq_sha256 = sha256_file(build.qdq)
    assert [b.qdq_sha256 for b in record.buckets] == [qdq_sha256]
    for variant in (elite, gen3):
        buckets = variant.buckets
        assert (buckets.shared_binary, buckets.axes, buckets.crops) == (None, [], [])
        (entry,) = buckets.entries
        assert (entry.name, entry.model, entry.qdq_sha256) == (
            SINGLE_BUCKET,
            variant.model,
            qdq_sha256,
        )
        assert (entry.inputs, entry.outputs) == (variant.inputs, variant.outputs)
    assert manifest.source_sha256 == sha256_file(build.root / "models" / f"{MODEL}.onnx")
    assert manifest.config_digest == load_config(build.config).digest()
    assert manifest.quantization["worst_snr_db"] == record.summary.worst_snr_db > 20
    assert manifest.quantization["activation_type"] == "uint16"
    assert manifest.cpu_fallback is not None and manifest.excluded == []
    assert sha256_file(release / manifest.cpu_fallback.model) == qdq_sha256
    for entry in manifest.files():
        assert sha256_file(release / entry.path) == entry.sha256
    # One archive with its checksum, holding exactly the manifest and the listed files.
    archive = release / f"{MODEL}-{VERSION}.tar.gz"
    assert (release / f"{archive.name}.sha256").read_text().split() == [
        sha256_file(archive),
        archive.name,
    ]
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == sorted(
            [MANIFEST_FILE, *(e.path for e in manifest.files())]
        )
    assert qnn_ctx_runtime.verify(archive) == manifest
    assert not [p for p in release.parent.iterdir() if p.name != VERSION]


def test_same_content_again_is_a_no_op(build: Build):
    publish(build)
    release = build.release()
    before = {p: (p.stat().st_mtime_ns, sha256_file(p)) for p in release.rglob("*") if p.is_file()}
    result = publish(build)
    assert result.unchanged
    after = {p: (p.stat().st_mtime_ns, sha256_file(p)) for p in release.rglob("*") if p.is_file()}
    assert after == before


def test_changed_content_is_refused_naming_what_differs(build: Build):
    publish(build)
    manifest_before = (build.release() / MANIFEST_FILE).read_bytes()
    # A different ctx binary under the same version.
    ctx = build.variant_folder(X_ELITE) / ctx_name(X_ELITE)
    data = bytearray(ctx.read_bytes())
    # Change the partition name's last byte: still a valid model, different content.
    marker = data.rfind(b"QNNExecutionProvider_QNNExecutionProvider_")
    assert marker > 0
    data[marker + 42] = ord("9") if data[marker + 42] != ord("9") else ord("8")
    ctx.write_bytes(bytes(data))
    edit_variant(build, X_ELITE, load={"ctx_s": 0.5, "qdq_s": 1.0, "ratio": 2.0, "runs": 3})
    with pytest.raises(PublishError) as info:
        publish(build)
    message = str(info.value)
    assert "already exists" in message and "different content" in message
    assert f"files[{X_ELITE}_qnn-2.51.0/{ctx.name}].sha256" in message
    assert "load.ctx_s: 0.01 (existing) != 0.5 (new)" in message
    assert "bump model.version" in message
    assert (build.release() / MANIFEST_FILE).read_bytes() == manifest_before


def test_failed_gate_left_out_unless_allow_partial(build: Build):
    edit_variant(build, GEN3, validation={"passed": False, "gate": "ctx vs QDQ SNR 12.0 < 20 dB"})
    manifest = publish(build).manifest
    assert [v.target for v in manifest.variants] == [X_ELITE]
    assert [(e.id, e.reason) for e in manifest.excluded] == [
        (f"{GEN3}_qnn-2.51.0", "validation: ctx vs QDQ SNR 12.0 < 20 dB")
    ]
    assert not (build.release() / f"{GEN3}_qnn-2.51.0").exists()

    partial = build.copy(build.root.parent / "partial")
    shutil.rmtree(partial.artifacts / "releases")
    manifest = publish(partial, allow_partial=True).manifest
    gen3 = next(v for v in manifest.variants if v.target == GEN3)
    assert gen3.passed is False
    assert gen3.failed_gates == ["validation: ctx vs QDQ SNR 12.0 < 20 dB"]
    # The loader never picks a failed variant: on an 8 Gen 3 it takes the v73 one instead.
    with qnn_ctx_runtime.load(partial.release(), target=GEN3) as model:
        assert model.variant.target == X_ELITE


def test_nothing_passed_is_an_error(build: Build):
    for target in (X_ELITE, GEN3):
        edit_variant(build, target, coverage={"passed": False, "gate": "3 partitions > 1"})
    with pytest.raises(PublishError, match="no variant passed its gates") as info:
        publish(build)
    assert "coverage: 3 partitions > 1" in str(info.value)
    assert not (build.artifacts / "releases" / MODEL / VERSION).exists()


def test_missing_variant_is_listed_as_excluded(build: Build):
    shutil.rmtree(build.variant_folder(GEN3))
    manifest = publish(build).manifest
    assert [e.id for e in manifest.excluded] == [f"{GEN3}_qnn-2.51.0"]
    assert "not built" in manifest.excluded[0].reason


def test_variant_json_that_disagrees_with_the_ctx_is_refused(build: Build):
    edit_variant(build, X_ELITE, qnn_sdk="2.49.40")
    with pytest.raises(PublishError, match=r"EPContext node says 2\.51\.0") as info:
        publish(build)
    assert "variant.json says QNN SDK 2.49.40" in str(info.value)
    assert not build.release().exists()


def test_missing_bin_is_refused(build: Build):
    folder = build.variant_folder(GEN3)
    edit_set(build, GEN3, bins=[])
    with pytest.raises(PublishError, match=rf"needs {bin_name(GEN3)}, which the record does not"):
        publish(build)
    (folder / bin_name(GEN3)).unlink()
    edit_set(build, GEN3, bins=[bin_name(GEN3)])
    with pytest.raises(PublishError, match=rf"\['{bin_name(GEN3)}'\] missing from"):
        publish(build)
    assert not build.release().exists()


def test_source_changed_since_build_is_refused(build: Build):
    source = build.root / "models" / f"{MODEL}.onnx"
    source.write_bytes(source.read_bytes() + b"\0")
    with pytest.raises(PublishError, match="changed since tiny was built"):
        publish(build)


def test_external_data_of_the_source_is_recorded_and_checked(build: Build):
    """A source saved with external data keeps its weights outside the .onnx: the manifest
    records their digest beside the model's, and new weights behind the same .onnx are refused
    like a changed model."""
    import onnx

    source = build.root / "models" / f"{MODEL}.onnx"
    onnx.save(
        onnx.load(str(source)),
        str(source),
        save_as_external_data=True,
        location="tiny.weights",
        size_threshold=0,
    )
    weights = source.with_name("tiny.weights")
    recorded = {"tiny.weights": sha256_file(weights)}
    # What quantize records for such a source (test_quantize proves it does); the variants name
    # the source they were compiled from.
    path = build.paths.record
    data = json.loads(path.read_text("utf-8"))
    _merge(data, {"inputs": {"source_sha256": sha256_file(source), "source_data": recorded}})
    path.write_text(json.dumps(data), "utf-8")
    for target in (X_ELITE, GEN3):
        edit_variant(build, target, built_from={"source_sha256": sha256_file(source)})

    publish(build)
    manifest = Manifest.read(build.release() / MANIFEST_FILE)
    assert manifest.source_sha256 == sha256_file(source)
    assert manifest.source_data_sha256 == recorded
    # New weights, the same .onnx: refused, naming the data file; no second release written.
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(PublishError, match=r"tiny\.weights, the external data of tiny\.onnx"):
        publish(build)


def test_a_manifest_without_external_data_leaves_the_field_out(build: Build):
    publish(build)
    data = json.loads((build.release() / MANIFEST_FILE).read_text("utf-8"))
    assert "source_data_sha256" not in data


def test_no_quantize_record_is_refused(build: Build):
    build.paths.record.unlink()
    with pytest.raises(PublishError, match="No successful quantize build"):
        publish(build)


def test_variant_compiled_from_another_qdq_is_refused(build: Build):
    """Re-quantizing after compiling makes every variant stale: publishing them would ship ctx
    binaries of the old QDQ model under the new record (a silently wrong release before)."""
    old_qdq = sha256_file(build.qdq)
    targets = [X_ELITE, GEN3]
    write_config(
        build.root,
        targets,
        ["2.7.0"],
        VERSION,
        extra='\n[quantization]\nactivation_type = "uint8"\n',
    )
    # Changed settings without quantizing again: the record does not match the config.
    with pytest.raises(PublishError, match="changed since tiny was quantized"):
        publish(build)
    result = quantize(build)  # the real quantize stage, with the new setting
    assert not result.skipped and result.record.summary.activation_type == "uint8"
    new_qdq = sha256_file(build.qdq)
    assert new_qdq != old_qdq and [b.qdq_sha256 for b in result.record.buckets] == [new_qdq]
    with pytest.raises(PublishError) as info:
        publish(build)
    message = str(info.value)
    assert (
        f"Variant {X_ELITE} / onnxruntime-qnn 2.7.0 in {build.variant_folder(X_ELITE)}" in message
    )
    assert "was compiled from another build than the current one" in message
    assert (
        f"bucket static: compiled from QDQ {old_qdq[:16]}…, the current one is {new_qdq[:16]}…"
        in message
    )
    assert "compile_ctx" in message  # the fix
    assert not build.release().exists()
    # Recompiling one target is not enough: the other one is still named as stale.
    compile_variant(build, X_ELITE, embed=True)
    with pytest.raises(PublishError) as info:
        publish(build)
    message = str(info.value)
    assert f"Variant {GEN3} / onnxruntime-qnn 2.7.0" in message and X_ELITE not in message
    assert not build.release().exists()
    # Both compiled from the current QDQ model: published, and the manifest says from which.
    compile_variant(build, GEN3, embed=False)
    manifest = publish(build).manifest
    assert {e.qdq_sha256 for v in manifest.variants for e in v.buckets.entries} == {new_qdq}
    assert manifest.quantization["activation_type"] == "uint8"
    with qnn_ctx_runtime.load(build.release(), target=GEN3) as model:
        assert model.variant.target == GEN3
        assert model.run({"x": np.zeros((1, 3, 16, 16), np.float32)})["y"].shape == (1, 4, 16, 16)


def test_cli(build: Build, capsys):
    assert main(["publish", str(build.config), "--artifacts", str(build.artifacts)]) == 0
    assert "published 2 variant(s)" in capsys.readouterr().out
    assert main(["publish", str(build.config), "--artifacts", str(build.artifacts)]) == 0
    assert "already published with the same content" in capsys.readouterr().out
    edit_variant(build, X_ELITE, load={"ctx_s": 9.0})
    assert main(["publish", str(build.config), "--artifacts", str(build.artifacts)]) == 1
    assert "different content" in capsys.readouterr().err


KILL_SCRIPT = """
import sys, time
from pathlib import Path
from pipeline.core.config import load_config
from pipeline.publish.release import publish_model
config = load_config(sys.argv[1], check_files=False)
print("ready", flush=True)
sys.stdin.readline()
started = time.perf_counter()
publish_model(config, Path(sys.argv[2]))
print(f"done {time.perf_counter() - started:.6f}", flush=True)
"""


def _start_publisher(build: Build) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, str(build.config), str(build.artifacts)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=python_path()),
    )
    assert process.stdout.readline().strip() == "ready"
    return process


def _visible_state(build: Build) -> str:
    """'absent' or 'complete'; anything else (a partial release) fails the test."""
    parent = build.artifacts / "releases" / MODEL
    visible = [p.name for p in parent.iterdir() if not p.name.startswith(".")]
    if not visible:
        return "absent"
    assert visible == [VERSION], f"unexpected entries {visible}"
    release = parent / VERSION
    manifest = qnn_ctx_runtime.verify(release)  # every listed file present with its exact bytes
    archive = release / f"{MODEL}-{VERSION}.tar.gz"
    assert (
        qnn_ctx_runtime.verify(archive) == manifest
    )  # the archive is complete and matches its .sha256
    extra = {p.relative_to(release).as_posix() for p in release.rglob("*") if p.is_file()}
    expected = {MANIFEST_FILE, archive.name, f"{archive.name}.sha256"}
    assert extra == expected | {e.path for e in manifest.files()}
    return "complete"


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX SIGKILL")
def test_kill_9_never_leaves_a_half_visible_release(build: Build):
    """20 publishes killed with SIGKILL at random moments: the release is absent or whole."""
    (build.artifacts / "releases" / MODEL).mkdir(parents=True)
    windows = []  # wall time from "go" to exit of complete runs: the span the kills sample
    for _ in range(3):
        shutil.rmtree(build.release(), ignore_errors=True)
        process = _start_publisher(build)
        started = time.perf_counter()
        process.stdin.write("\n")
        process.stdin.flush()
        process.communicate(timeout=120)
        windows.append(time.perf_counter() - started)
    duration = sorted(windows)[1]
    rng = random.Random(20261121)
    outcomes = []
    for trial in range(20):
        if trial % 5 != 4:  # mostly a fresh publish; every 5th runs over a complete release
            shutil.rmtree(build.release(), ignore_errors=True)
        had_release = build.release().exists()
        process = _start_publisher(build)
        process.stdin.write("\n")
        process.stdin.flush()
        time.sleep(rng.uniform(0, duration * 1.2))
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
        finished = "done" in process.stdout.read()
        process.stdout.close()
        process.stdin.close()
        state = _visible_state(build)
        if had_release:
            assert state == "complete", f"trial {trial}: a kill removed the previous release"
        if finished:
            assert state == "complete", f"trial {trial}: publish reported done, no release"
        temps = sum(".publish-" in p.name for p in build.release().parent.iterdir())
        outcomes.append((trial, finished, state, temps))
    print(
        f"publish takes {duration * 1000:.1f} ms; trials (n, finished, state, temp folders): {outcomes}"
    )
    killed_midway = [o for o in outcomes if not o[1]]
    assert killed_midway, f"no trial was killed before it finished: {outcomes}"
    # A later publish completes and sweeps the temp folders the killed runs left behind.
    shutil.rmtree(build.release(), ignore_errors=True)
    assert not publish(build).unchanged
    assert _visible_state(build) == "complete"
    leftovers = [p.name for p in (build.artifacts / "releases" / MODEL).iterdir()]
    assert leftovers == [VERSION]


def test_variant_built_from_other_settings_or_samples_is_refused(build: Build):
    """The whole chain, not only the QDQ digest: a variant compiled with other [compile]
    settings, against another float model, on other held-out samples or from other quantize
    settings is stale too, and named with the reason."""
    config = load_config(build.config)
    target = config.compile.targets[0]
    cases = {
        "compiled with other [compile] settings": {"built_from": {"compile_digest": "0" * 64}},
        "compiled against another prepared float model": {
            "built_from": {"float_sha256": {"static": "0" * 64}}
        },
        "validated on other held-out samples": {
            "built_from": {"heldout_digest": {"static": "0" * 64}}
        },
        "built from other quantize settings": {"built_from": {"config_digest": "0" * 64}},
    }
    original = (build.variant_folder(target) / "variant.json").read_text("utf-8")
    for reason, change in cases.items():
        (build.variant_folder(target) / "variant.json").write_text(original, "utf-8")
        edit_variant(build, target, **change)
        with pytest.raises(PublishError, match=re.escape(reason)):
            publish(build)
        assert not build.release().exists()
