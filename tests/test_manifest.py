"""The manifest parser: strict, all issues at once, format 1 upgraded, newer formats refused,
and in sync with its JSON Schema file."""

from __future__ import annotations

import copy
import json

import pytest

from qnn_ctx_runtime.errors import ReleaseError
from qnn_ctx_runtime.manifest import (
    CURRENT_SCHEMA,
    SCHEMA_FILE,
    SINGLE_BUCKET,
    BucketEntry,
    Buckets,
    CpuModel,
    FileEntry,
    Manifest,
    SchemaVersion,
    TensorInfo,
    Variant,
    json_schema,
    safe_relative_path,
    schema_text,
)

SHA = "ab" * 32


def variant(vid: str = "snapdragon-x-elite_qnn-2.51.0", sdk: str = "2.51.0", arch: int = 73):
    inputs = [TensorInfo("x", [1, 3, 16, 16], "float32")]
    outputs = [TensorInfo("y", [1, 4], "float32")]
    return Variant(
        id=vid,
        target="snapdragon-x-elite",
        soc_model=60,
        htp_arch=arch,
        backend="htp",
        qnn_sdk_version=sdk,
        ep_sdk_version=f"v{sdk}.260929181845",
        onnxruntime_qnn="2.7.0",
        onnxruntime="1.31.1",
        ep_compatibility_info=f"v2:6:{sdk}:5.51.0:{arch}:60:0:0",
        embed_mode=1,
        model=f"{vid}/m_ctx.onnx",
        files=[FileEntry(f"{vid}/m_ctx.onnx", SHA, 10)],
        inputs=inputs,
        outputs=outputs,
        coverage={"qnn_partitions": 1, "passed": True},
        accuracy={"ctx_vs_qdq": {"y": {"snr_db": 40.0}}, "passed": True},
        load={"ctx_s": 0.01},
        passed=True,
        failed_gates=[],
        buckets=Buckets(
            shared_binary=None,
            axes=[],
            crops=[],
            entries=[BucketEntry(SINGLE_BUCKET, f"{vid}/m_ctx.onnx", inputs, outputs, SHA)],
        ),
    )


def manifest(**changes) -> Manifest:
    base = Manifest(
        schema_version=CURRENT_SCHEMA,
        model="m",
        version="1.0.0",
        created="2026-11-21T16:00:00+00:00",
        generator="qnn-ctx-pipeline 0.1.0",
        source_sha256=SHA,
        config_digest="c" * 64,
        quantization={"activation_type": "uint16"},
        variants=[variant()],
        cpu_fallback=CpuModel("qdq", "cpu/m_qdq.onnx", [FileEntry("cpu/m_qdq.onnx", SHA, 5)]),
        excluded=[],
    )
    data = base.to_dict()
    data.update(changes)
    return data


def parse_error(data) -> str:
    with pytest.raises(ReleaseError) as info:
        Manifest.from_dict(data, "test-manifest.json")
    return str(info.value)


def test_round_trip_is_lossless():
    original = Manifest.from_dict(manifest())
    again = Manifest.from_json(original.to_json())
    assert again == original
    assert again.schema_version is SchemaVersion.V2
    assert [f.path for f in again.files()] == [
        "snapdragon-x-elite_qnn-2.51.0/m_ctx.onnx",
        "cpu/m_qdq.onnx",
    ]


def test_schema_file_is_generated_from_the_dataclasses():
    regenerate = (
        "regenerate: python -c 'from qnn_ctx_runtime.manifest import SCHEMA_FILE, schema_text; "
        "SCHEMA_FILE.write_text(schema_text())'"
    )
    committed = json.loads(SCHEMA_FILE.read_text("utf-8"))
    assert committed == json_schema(), regenerate
    assert SCHEMA_FILE.read_text("utf-8") == schema_text(), regenerate
    variant_schema = committed["$defs"]["Variant"]
    assert variant_schema["additionalProperties"] is False
    assert "qnn_sdk_version" in variant_schema["required"]
    assert "buckets" in variant_schema["required"]  # format 2: every variant has its buckets
    entry_schema = committed["$defs"]["BucketEntry"]
    assert "qdq_sha256" in entry_schema["properties"]
    assert "qdq_sha256" not in entry_schema["required"]  # absent in format 1
    assert committed["properties"]["schema_version"] == {
        "enum": ["1", "2"],
        "description": "Manifest format version.",
    }


def test_missing_field_is_named():
    data = manifest()
    del data["source_sha256"]
    del data["variants"][0]["qnn_sdk_version"]
    message = parse_error(data)
    assert "source_sha256: missing field" in message
    assert "variants[0].qnn_sdk_version: missing field" in message


def test_extra_field_is_named():
    data = manifest()
    data["signature"] = "x"
    data["variants"][0]["files"][0]["mode"] = 420
    message = parse_error(data)
    assert "signature: unknown field" in message
    assert "variants[0].files[0].mode: unknown field" in message


@pytest.mark.parametrize("version", ["3", "1.0", 1, None])
def test_bad_schema_version_is_refused(version):
    message = parse_error(manifest(schema_version=version))
    assert "schema_version" in message
    assert "'1', '2'" in message  # the formats this runtime reads


@pytest.mark.parametrize("version", ["3", "99"])
def test_unknown_schema_version_is_refused_before_parsing(version):
    """A newer format is refused as such, not as a pile of field errors it may not even have."""
    data = manifest(schema_version=version, signature="new in a later format")
    del data["variants"][0]["qnn_sdk_version"]
    with pytest.raises(ReleaseError) as info:
        Manifest.from_dict(data, "test-manifest.json")
    error = info.value
    assert error.message == (
        f"test-manifest.json: schema_version '{version}' is not a format this qnn-ctx-runtime "
        "reads ('1', '2')."
    )
    assert "newer qnn-ctx-runtime" in error.tip
    with pytest.raises(ReleaseError, match=f"schema_version '{version}' is not a format"):
        Manifest.from_json(json.dumps({"schema_version": version}), "m.json")


def format_1(data: dict) -> dict:
    """The same release as format 1 wrote it: single-shape variants had no ``buckets``, and
    bucket entries had no ``qdq_sha256`` (the old pipeline/manifest.py)."""
    old = copy.deepcopy(data)
    old["schema_version"] = "1"
    for variant in old["variants"]:
        if len(variant["buckets"]["entries"]) == 1:
            del variant["buckets"]
        else:
            for entry in variant["buckets"]["entries"]:
                entry.pop("qdq_sha256", None)
    return old


def test_format_1_is_upgraded_to_one_bucket_per_single_shape_variant():
    data = format_1(manifest())
    assert "buckets" not in data["variants"][0]
    parsed = Manifest.from_json(json.dumps(data), "old-manifest.json")
    assert parsed.schema_version is SchemaVersion.V1
    (variant,) = parsed.variants
    assert variant.buckets == Buckets(
        shared_binary=None,
        axes=[],
        crops=[],
        entries=[BucketEntry(SINGLE_BUCKET, variant.model, variant.inputs, variant.outputs)],
    )
    assert variant.buckets.entries[0].qdq_sha256 is None
    # Upgrading changes nothing else: the same release as format 2, minus the unknown QDQ hash.
    bare = manifest()
    bare["variants"][0]["buckets"]["entries"][0].pop("qdq_sha256")
    assert parsed.identity() | {"schema_version": "2"} == Manifest.from_dict(bare).identity()
    # The input is not modified (the upgrade works on a copy).
    assert "buckets" not in data["variants"][0]


def test_format_1_multi_bucket_variant_keeps_its_buckets():
    data = manifest()
    entry = data["variants"][0]["buckets"]["entries"][0]
    data["variants"][0]["files"].append(
        {"path": "snapdragon-x-elite_qnn-2.51.0/m_big_ctx.onnx", "sha256": SHA, "size": 11}
    )
    data["variants"][0]["buckets"]["entries"] = [
        entry | {"name": "small"},
        entry | {"name": "big", "model": "snapdragon-x-elite_qnn-2.51.0/m_big_ctx.onnx"},
    ]
    data["variants"][0]["model"] = "snapdragon-x-elite_qnn-2.51.0/m_big_ctx.onnx"
    parsed = Manifest.from_dict(format_1(data))
    assert [e.name for e in parsed.variants[0].buckets.entries] == ["small", "big"]
    assert all(e.qdq_sha256 is None for e in parsed.variants[0].buckets.entries)


def test_format_1_is_still_parsed_strictly():
    data = format_1(manifest())
    data["variants"][0]["surprise"] = 1
    del data["variants"][0]["qnn_sdk_version"]
    message = parse_error(data)
    assert "variants[0].surprise: unknown field" in message
    assert "variants[0].qnn_sdk_version: missing field" in message


def test_format_2_needs_buckets():
    data = manifest()
    del data["variants"][0]["buckets"]
    assert "variants[0].buckets: missing field" in parse_error(data)


def test_all_issues_are_reported_at_once():
    data = manifest(surprise=True)
    del data["model"]
    data["variants"][0]["htp_arch"] = "73"
    data["variants"][0]["files"][0]["sha256"] = "not-a-hash"
    data["variants"][0]["files"][0]["size"] = -1
    data["variants"][0]["buckets"]["entries"][0]["qdq_sha256"] = "not-a-hash-either"
    message = parse_error(data)
    assert "(6 issues)" in message
    for expected in (
        "surprise: unknown field",
        "model: missing field",
        "variants[0].htp_arch: expected integer, got string '73'",
        "variants[0].files[0].sha256: 'not-a-hash' does not match",
        "variants[0].files[0].size: -1 is below the minimum 0",
        "variants[0].buckets.entries[0].qdq_sha256: 'not-a-hash-either' does not match",
    ):
        assert expected in message


def test_wrong_container_types():
    message = parse_error(manifest(variants={"a": 1}, quantization=[1]))
    assert "variants: expected an array, got object" in message
    assert "quantization: expected an object, got array" in message
    assert "expected an object, got array" in parse_error([1, 2])


@pytest.mark.parametrize(
    "path",
    ["../escape.onnx", "/abs/m.onnx", "a/../../b.onnx", "C:/m.onnx", "a\\b.onnx", "./m.onnx", ""],
)
def test_unsafe_paths_are_refused(path):
    data = manifest()
    data["variants"][0]["files"][0]["path"] = path
    data["variants"][0]["model"] = path
    assert "files[0].path" in parse_error(data)
    assert safe_relative_path(path) is not None


def test_cross_field_rules():
    data = manifest()
    second = copy.deepcopy(data["variants"][0])
    data["variants"].append(second)  # same id, same file
    data["variants"][0]["model"] = "elsewhere.onnx"
    data["variants"][0]["embed_mode"] = 3
    data["variants"][0]["failed_gates"] = ["coverage: 2 partitions"]
    message = parse_error(data)
    assert "appears more than once" in message
    assert "is also listed by variants[0]" in message
    assert "variants[0].model 'elsewhere.onnx' is not one of its files" in message
    assert "embed_mode must be 0 or 1" in message
    assert "passed is true but failed_gates is not empty" in message


def test_empty_release_is_refused():
    assert "holds no model at all" in parse_error(manifest(variants=[], cpu_fallback=None))


def test_not_json():
    with pytest.raises(ReleaseError, match="is not valid JSON"):
        Manifest.from_json(b"{not json", "m.json")


def test_identity_ignores_creation_time_and_differences_name_the_file():
    a = Manifest.from_dict(manifest())
    b_data = manifest(created="2030-01-01T00:00:00+00:00", generator="other 9")
    assert Manifest.from_dict(b_data).identity() == a.identity()
    b_data["variants"][0]["files"][0]["sha256"] = "cd" * 32
    b_data["variants"][0]["load"]["ctx_s"] = 0.02
    diff = Manifest.from_dict(b_data).differences(a)
    assert diff[0].startswith(
        "variants[snapdragon-x-elite_qnn-2.51.0].files[snapdragon-x-elite_qnn-2.51.0/m_ctx.onnx]"
        ".sha256: 'abab"
    )
    assert any(d.startswith("variants[snapdragon-x-elite_qnn-2.51.0].load.ctx_s") for d in diff)
