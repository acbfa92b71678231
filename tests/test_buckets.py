"""Shape buckets without QNN: the [buckets] config rules, bucket planning (pipeline.graph.buckets),
padding, choosing and cropping (qnn_ctx_runtime.buckets), and the manifest's bucket section."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.core.config import BucketOutput, BucketPad, BucketsSection, load_config
from pipeline.core.errors import ConfigError, PipelineError
from pipeline.graph import buckets as bk
from qnn_ctx_runtime import buckets as rt
from qnn_ctx_runtime.errors import FeedError, ReleaseError
from qnn_ctx_runtime.manifest import (
    CURRENT_SCHEMA,
    SINGLE_BUCKET,
    BucketAxis,
    BucketCrop,
    BucketEntry,
    Buckets,
    FileEntry,
    Manifest,
    SchemaVersion,
    TensorInfo,
    Variant,
)

BASE = """
[model]
name = "m"
source = "m.onnx"

[calibration]
kind = "random"

[compile]
embed = false
"""


def write_config(tmp_path: Path, extra: str, base: str = BASE) -> Path:
    path = tmp_path / "m.toml"
    path.write_text(base + extra, encoding="utf-8")
    return path


# -- config ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("[buckets]\npad = { w = { value = 0.0 } }\n", "needs buckets.dims"),
        (
            "[buckets]\ndims = { w = [1] }\nshapes = [{ x = [1, 2] }]\n",
            "set buckets.dims or buckets.shapes, not both",
        ),
        ("[buckets]\ndims = { w = [] }\n", "buckets.dims.w is empty"),
        ("[buckets]\ndims = { w = [0, 4] }\n", "buckets.dims.w = [0, 4] must hold values in [1,"),
        ("[buckets]\ndims = { w = [4, 4] }\n", "repeats a size"),
        (
            "[buckets]\nshapes = [{ x = [1, 2] }, { y = [1, 2] }]\n",
            "every bucket gives the same inputs",
        ),
        ("[buckets]\nshapes = [{ x = [1, 2] }, { x = [1, 2, 3] }]\n", "has another rank"),
        ("[buckets]\nshapes = [{ x = [1, 2] }, { x = [1, 2] }]\n", "the same bucket twice"),
        (
            "[buckets]\nshapes = [{ x = [1, 0] }]\n",
            "buckets.shapes[0].x = [1, 0] must hold values in [1,",
        ),
        (
            "[buckets]\ndims = { width = [4] }\npad = { widht = { value = 1.0 } }\n",
            "did you mean 'width'?",
        ),
        (
            "[buckets]\nshapes = [{ x = [1, 2] }, { x = [1, 4] }]\npad = { w = {} }\n",
            '"input:axis"',
        ),
        (
            '[buckets]\ndims = { w = [4] }\noutputs = { y = { axis = -1, follows = "w" } }\n',
            "buckets.outputs.y.axis = -1 must be in [0, 63]",
        ),
        (
            '[buckets]\ndims = { w = [4] }\noutputs = { y = { axis = 1, follows = "v" } }\n',
            "'v' is not a key of buckets.dims",
        ),
        ("[buckets]\ndims = { w = [4] }\npackaging = []\n", "buckets.packaging is empty"),
        (
            '[buckets]\ndims = { w = [4] }\npackaging = ["shared", "shared"]\n',
            "repeats a value",
        ),
        ('[buckets]\ndims = { w = [4] }\npackaging = ["both"]\n', "is not allowed"),
        ("[buckets]\ndims = { w = [4] }\nsizes = [4]\n", "unknown key [buckets] 'sizes'"),
    ],
)
def test_each_bucket_config_error_names_the_key(tmp_path: Path, extra: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, extra), check_files=False)
    assert message in str(info.value)


def test_shared_packaging_needs_external_binaries(tmp_path: Path) -> None:
    base = BASE.replace("embed = false", "embed = true")
    with pytest.raises(ConfigError, match=r"compile\.embed = false"):
        load_config(write_config(tmp_path, "[buckets]\ndims = { w = [4] }\n", base), False)
    # One context per bucket may embed its binary.
    extra = '[buckets]\ndims = { w = [4] }\npackaging = ["standalone"]\n'
    config = load_config(write_config(tmp_path, extra, base), False)
    assert config.buckets.enabled and config.compile.embed
    # Without compile.embed in the config, shared packaging (the default) makes it false.
    unsaid = BASE.replace("embed = false\n", "")
    assert "embed" not in unsaid
    config = load_config(write_config(tmp_path, "[buckets]\ndims = { w = [4] }\n", unsaid), False)
    assert config.buckets.packaging == ["shared"] and not config.compile.embed
    assert load_config(write_config(tmp_path, "", unsaid), False).compile.embed  # no buckets


@pytest.mark.parametrize("kind", ["images", "audio"])
def test_fixed_size_calibration_kinds_are_refused(tmp_path: Path, kind: str) -> None:
    base = BASE.replace('kind = "random"', f'kind = "{kind}"\npath = "."')
    with pytest.raises(ConfigError, match="calibrates only one bucket"):
        load_config(write_config(tmp_path, "[buckets]\ndims = { w = [4] }\n", base), False)


def test_recurrent_calibration_is_refused(tmp_path: Path) -> None:
    base = BASE.replace('kind = "random"', 'kind = "random"\nrecurrent = { h = "h_out" }')
    with pytest.raises(ConfigError, match="recurrent"):
        load_config(write_config(tmp_path, "[buckets]\ndims = { w = [4] }\n", base), False)


def test_config_digests_and_buckets(tmp_path: Path) -> None:
    """Build records and published releases hash the config. A config without [buckets] is one
    bucket ("static"), so its digest is that of every setting, [buckets] (empty) included, and
    stays stable; [buckets] changes what quantize builds, packaging only what compile does."""
    import dataclasses

    config = load_config(write_config(tmp_path, ""), check_files=False)
    assert config.buckets == BucketsSection() and not config.buckets.enabled
    data = dataclasses.asdict(config)
    data.pop("path")
    expected = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
    assert config.digest() == expected
    assert load_config(write_config(tmp_path, ""), check_files=False).digest() == expected
    bucketed = load_config(write_config(tmp_path, "[buckets]\ndims = { w = [4] }\n"), False)
    assert bucketed.digest() != expected
    assert bucketed.quantize_digest() != config.quantize_digest()
    standalone = load_config(
        write_config(tmp_path, '[buckets]\ndims = { w = [4] }\npackaging = ["standalone"]\n'),
        False,
    )
    assert standalone.digest() != bucketed.digest()
    assert standalone.quantize_digest() == bucketed.quantize_digest()


def test_bundled_bucket_configs_parse() -> None:
    root = Path(__file__).resolve().parent.parent
    for path in ("configs/example_buckets.toml", "configs/shared/ppocr_rec_buckets.toml"):
        config = load_config(root / path, check_files=False)
        assert config.buckets.enabled and "shared" in config.buckets.packaging


# -- planning ----------------------------------------------------------------------------------------

SIGS = {"latent": [1, 16, "frames"], "speaker": ["batch", 8]}
OUTS = {"denoised": [1, 16, "frames"]}


def section(**fields: object) -> BucketsSection:
    return BucketsSection(**fields)  # type: ignore[arg-type]


def test_product_of_dims_gives_the_buckets_smallest_first() -> None:
    plan = bk.plan_buckets(
        section(dims={"frames": [128, 64], "speaker:0": [2, 1]}),
        SIGS,
        OUTS,
        file="c.toml",
    )
    assert [b.name for b in plan.buckets] == [
        "frames64-speaker_0_1",
        "frames64-speaker_0_2",
        "frames128-speaker_0_1",
        "frames128-speaker_0_2",
    ]
    assert plan.buckets[0].shapes == {"latent": (1, 16, 64), "speaker": (1, 8)}
    assert plan.largest.shapes == {"latent": (1, 16, 128), "speaker": (2, 8)}
    assert {(p.input, p.axis, p.value, p.side) for p in plan.pads} == {
        ("latent", 2, 0.0, "end"),
        ("speaker", 0, 0.0, "end"),
    }


def test_inputs_section_fixes_the_other_dims_and_pad_and_crop_rules_resolve() -> None:
    plan = bk.plan_buckets(
        section(
            dims={"frames": [32, 16]},
            pad={"frames": BucketPad(value=-1.0, side="start")},
            outputs={"denoised": BucketOutput(axis=2, follows="frames")},
        ),
        SIGS,
        OUTS,
        fixed_dims={"batch": 1},
    )
    assert [b.shapes["speaker"] for b in plan.buckets] == [(1, 8), (1, 8)]
    assert plan.pads == [bk.PadRule("latent", 2, "frames", -1.0, "start")]
    assert plan.crops == [bk.CropRule("denoised", 2, "latent", 2, "frames")]


def test_explicit_shapes_find_the_varying_axes() -> None:
    plan = bk.plan_buckets(
        section(shapes=[{"x": [1, 3, 32, 320]}, {"x": [1, 3, 32, 160]}]),
        {"x": ["n", 3, 32, None]},
        {"y": None},
    )
    assert [b.name for b in plan.buckets] == ["s160", "s320"]
    assert plan.pads == [bk.PadRule("x", 3, "x:3")]


@pytest.mark.parametrize(
    ("dims", "message"),
    [
        ({"frame": [4]}, "did you mean 'frames'?"),
        ({"latent:1": [4]}, "static size 16 on axis 1"),
        ({"latnet:2": [4]}, "did you mean 'latent'?"),
        ({"latent:7": [4]}, "axis 7 does not exist"),
        ({"frames": [4], "latent:2": [8]}, "both name latent[2]"),
    ],
)
def test_dim_keys_that_name_nothing_dynamic_are_errors(dims: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        bk.plan_buckets(section(dims=dims), SIGS, OUTS, fixed_dims={"batch": 1})
    assert message in str(info.value)


def test_a_dynamic_dim_nobody_sizes_is_an_error() -> None:
    with pytest.raises(ConfigError, match="input 'speaker' axis 0 is dynamic"):
        bk.plan_buckets(section(dims={"frames": [4]}), SIGS, OUTS)


def test_pad_and_outputs_must_name_bucket_dims_and_real_outputs() -> None:
    with pytest.raises(ConfigError, match="did you mean 'denoised'"):
        bk.plan_buckets(
            section(dims={"frames": [4]}, outputs={"denoise": BucketOutput(2, "frames")}),
            SIGS,
            OUTS,
            fixed_dims={"batch": 1},
        )
    with pytest.raises(ConfigError, match="has rank 3"):
        bk.plan_buckets(
            section(dims={"frames": [4]}, outputs={"denoised": BucketOutput(3, "frames")}),
            SIGS,
            OUTS,
            fixed_dims={"batch": 1},
        )


def test_a_model_without_buckets_is_one_static_bucket() -> None:
    plan = bk.single_bucket({"x": [1, 3, 8, 8], "state": (2, 4)})
    assert plan.names == [SINGLE_BUCKET] == ["static"]
    assert plan.largest.shapes == {"x": (1, 3, 8, 8), "state": (2, 4)}
    assert plan.pads == [] and plan.crops == []
    # Nothing may vary: only the exact shape is taken, smaller inputs too are refused.
    assert rt.choose_bucket(plan.buckets, plan.pads, {"x": (1, 3, 8, 8)}).name == "static"
    with pytest.raises(
        FeedError, match=r"has shape \[1, 3, 4, 8\]; the model takes exactly \[1, 3, 8, 8\]"
    ):
        rt.choose_bucket(plan.buckets, plan.pads, {"x": (1, 3, 4, 8)})


# -- at run time -------------------------------------------------------------------------------------


def plan3() -> bk.BucketPlan:
    return bk.plan_buckets(
        section(dims={"frames": [64, 128, 256]}), {"latent": [1, 16, "frames"]}, OUTS
    )


def test_the_smallest_bucket_that_holds_the_input_is_chosen() -> None:
    plan = plan3()
    pick = {
        n: rt.choose_bucket(plan.buckets, plan.pads, {"latent": (1, 16, n)}).name
        for n in (1, 64, 65, 256)
    }
    assert pick == {1: "frames64", 64: "frames64", 65: "frames128", 256: "frames256"}


def test_too_large_wrong_rank_and_fixed_dims_are_clear_errors() -> None:
    plan = plan3()
    with pytest.raises(FeedError) as info:
        rt.choose_bucket(plan.buckets, plan.pads, {"latent": (1, 16, 300)})
    assert "300 on axis 2 (frames)" in str(info.value)
    assert "largest bucket is frames256 (latent [1, 16, 256])" in str(info.value)
    assert isinstance(info.value, PipelineError)  # the builder catches it like its own errors
    with pytest.raises(FeedError, match=r"rank 2 .*rank 3: \[1, 16, <=256\]"):
        rt.choose_bucket(plan.buckets, plan.pads, {"latent": (16, 64)})
    with pytest.raises(FeedError, match="size 8 on axis 1; the model needs 16"):
        rt.choose_bucket(plan.buckets, plan.pads, {"latent": (1, 8, 64)})


def test_padding_goes_where_the_rule_says() -> None:
    x = np.arange(6, dtype=np.float32).reshape(1, 2, 3)
    end, applied = rt.pad_input(x, (1, 2, 5), [rt.PadRule("x", 2, "t", 9.0, "end")])
    assert applied == [(2, 0, 2)] and end.dtype == np.float32
    assert end[0, 0].tolist() == [0, 1, 2, 9, 9]
    start, applied = rt.pad_input(x, (1, 2, 5), [rt.PadRule("x", 2, "t", -1.0, "start")])
    assert applied == [(2, 2, 0)] and start[0, 1].tolist() == [-1, -1, 3, 4, 5]
    same, applied = rt.pad_input(x, (1, 2, 3), [rt.PadRule("x", 2, "t")])
    assert same is x and applied == []


def test_cropping_keeps_the_steps_of_the_real_input() -> None:
    y = np.arange(10)[np.newaxis]
    identity = rt.CropRule("y", 1, "x", 2, "t")
    assert rt.crop_output(y, identity, 4, 10, "end").tolist() == [[0, 1, 2, 3]]
    assert rt.crop_output(y, identity, 4, 10, "start").tolist() == [[6, 7, 8, 9]]
    strided = rt.CropRule("y", 1, "x", 2, "t", num=1, den=4, add=1)
    assert [strided.length(n) for n in (1, 2, 6, 7, 40, 41)] == [1, 1, 1, 2, 10, 10]


def test_length_rules_are_fitted_exactly_or_not_at_all() -> None:
    ppocr = {n: max(1, (n + 1) // 4) for n in range(1, 700)}  # measured on the real recogniser
    assert bk.fit_length_rule(ppocr, 1, 4) == (1, 0)
    assert bk.fit_length_rule({n: n for n in range(1, 50)}, 1, 1) == (0, 0)
    assert bk.fit_length_rule({n: 256 * n for n in range(1, 20)}, 256, 1) == (0, 0)
    assert bk.fit_length_rule({n: n * n for n in range(1, 20)}, 1, 1) is None


# -- manifest ----------------------------------------------------------------------------------------

SHA = "cd" * 32
VID = "snapdragon-x-elite_qnn-2.51.0"


def bucket_variant(shared: bool = True) -> Variant:
    ctx = [f"{VID}/m_frames{n}_ctx.onnx" for n in (64, 128)]
    binary = f"{VID}/m_frames64_ctx_qnn.bin"
    return Variant(
        id=VID,
        target="snapdragon-x-elite",
        soc_model=60,
        htp_arch=73,
        backend="htp",
        qnn_sdk_version="2.51.0",
        ep_sdk_version="v2.51.0.1",
        onnxruntime_qnn="2.7.0",
        onnxruntime="1.31.1",
        ep_compatibility_info="v2:6:2.51.0:5.51.0:73:60:0:0",
        embed_mode=0,
        model=ctx[-1],
        files=[FileEntry(p, SHA, 10) for p in [*ctx, binary]],
        inputs=[TensorInfo("latent", [1, 16, -1], "float32")],
        outputs=[TensorInfo("denoised", [1, 16, -1], "float32")],
        coverage={},
        accuracy={},
        load={},
        passed=True,
        failed_gates=[],
        buckets=Buckets(
            shared_binary=binary if shared else None,
            axes=[BucketAxis("latent", 2, "frames", 0.0, "end")],
            crops=[BucketCrop("denoised", 2, "latent", 2, 1, 1, 0, 0)],
            entries=[
                BucketEntry(
                    f"frames{n}",
                    path,
                    [TensorInfo("latent", [1, 16, n], "float32")],
                    [TensorInfo("denoised", [1, 16, n], "float32")],
                )
                for n, path in zip((64, 128), ctx, strict=True)
            ],
        ),
    )


def manifest_dict(v: Variant) -> dict:
    return Manifest(
        schema_version=CURRENT_SCHEMA,
        model="m",
        version="1.0.0",
        created="2026-11-21T16:00:00+00:00",
        generator="test",
        source_sha256=SHA,
        config_digest="c",
        quantization={},
        variants=[v],
        cpu_fallback=None,
        excluded=[],
    ).to_dict()


def test_bucket_section_round_trips_and_old_releases_get_one_bucket() -> None:
    data = manifest_dict(bucket_variant())
    assert data["schema_version"] == SchemaVersion.V2.value
    parsed = Manifest.from_dict(json.loads(json.dumps(data)))
    assert parsed.variants[0].buckets == bucket_variant().buckets
    assert parsed.to_dict() == data
    # Format 1 wrote buckets only for several shapes: such a release reads as it was written.
    old = copy.deepcopy(data)
    old["schema_version"] = SchemaVersion.V1.value
    assert Manifest.from_dict(old).variants[0].buckets == bucket_variant().buckets
    # A format-1 variant without buckets is one ctx model: it is read as one "static" bucket.
    plain = copy.deepcopy(old)
    del plain["variants"][0]["buckets"]
    variant = Manifest.from_dict(plain).variants[0]
    assert variant.buckets == Buckets(
        shared_binary=None,
        axes=[],
        crops=[],
        entries=[BucketEntry(SINGLE_BUCKET, variant.model, variant.inputs, variant.outputs)],
    )
    assert "buckets" not in plain["variants"][0]  # the upgrade works on a copy
    # In format 2 every variant has its buckets.
    current = copy.deepcopy(data)
    del current["variants"][0]["buckets"]
    with pytest.raises(ReleaseError, match=r"variants\[0\]\.buckets: missing field"):
        Manifest.from_dict(current)


def test_bucket_section_must_name_the_variants_own_files_and_tensors() -> None:
    data = manifest_dict(bucket_variant())
    spec = data["variants"][0]["buckets"]
    spec["shared_binary"] = f"{VID}/other_qnn.bin"
    spec["entries"][0]["model"] = f"{VID}/missing_ctx.onnx"
    spec["crops"][0]["output"] = "logits"
    spec["axes"][0]["pad_side"] = "middle"
    with pytest.raises(ReleaseError) as info:
        Manifest.from_dict(data)
    message = str(info.value)
    assert "shared_binary" in message and "not one of the files" in message
    assert "entries[0].model" in message
    assert "crops[0] names logits[2], not an output axis" in message
    assert "pad_side must be start or end" in message


def test_an_output_shortened_by_unpadded_convolutions_is_cropped_by_its_stride(
    tmp_path: Path,
) -> None:
    """Unpadded (VALID) convolutions and a 2/2 pool: length = (n - 2) // 2 - 1 over the width,
    a stride of 2 with an offset (MTCNN's P-Net). The ratio at the largest size (31/64) is not
    the stride; the slope of length against size is, and the runtime's crop must give the
    source model's length at every size."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from pipeline.quantize.shapes import fit_crops

    rng = np.random.default_rng(4)
    weight = numpy_helper.from_array(rng.standard_normal((2, 1, 3, 3)).astype(np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["c"]),  # no padding: 2 cells off
            helper.make_node("MaxPool", ["c"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
            helper.make_node("Conv", ["p", "w2"], ["y"]),  # 2 more cells off after the pool
        ],
        "valid",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 16, "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [weight, numpy_helper.from_array(rng.standard_normal((1, 2, 3, 3)).astype("f"), "w2")],
    )
    source = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(source, str(tmp_path / "m.onnx"))
    extra = '[buckets]\ndims = { W = [32, 64] }\noutputs = { y = { axis = 3, follows = "W" } }\n'
    config = load_config(write_config(tmp_path, extra), check_files=False)
    from pipeline.quantize.shapes import signatures

    in_sigs, out_sigs = signatures(source, {})
    plan = bk.plan_buckets(config.buckets, in_sigs, out_sigs, {}, {}, config.path)
    (crop,) = fit_crops(config, source, plan).crops
    assert (crop.num, crop.den) == (1, 2), crop
    import onnxruntime as ort

    session = ort.InferenceSession(source.SerializeToString(), providers=["CPUExecutionProvider"])
    for width in (9, 10, 17, 32, 33, 47, 64):
        x = np.zeros((1, 1, 16, width), np.float32)
        want = session.run(None, {"x": x})[0].shape[3]
        rule = rt.CropRule("y", 3, "x", 3, "W", crop.num, crop.den, crop.add, crop.shift)
        assert rule.length(width) == want, (width, rule)
