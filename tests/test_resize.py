"""Resize by a scale whose in x scale is not an integer: the HTP resizes by out/in instead, so
such Resizes are rewritten (Gather for nearest, edge pad + Resize + Slice for linear) into
forms that compute exactly what onnxruntime computes, checked on the CPU and on the HTP."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest
from compile_fixtures import build_whole_on_htp
from onnx import TensorProto, numpy_helper

from pipeline.graph.resize import antialiased_resizes_as_matmuls, resize_for_htp

RNG = np.random.default_rng(17)


def resize_model(
    shape: list[int], scales: list[float], mode: str, coords: str, **attrs: object
) -> onnx.ModelProto:
    node = oh.make_node(
        "Resize",
        ["x", "", "s"],
        ["y"],
        name="resize",
        mode=mode,
        coordinate_transformation_mode=coords,
        **attrs,
    )
    out = [int(np.float32(n) * np.float32(s)) for n, s in zip(shape, scales, strict=True)]
    graph = oh.make_graph(
        [node],
        "resize",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, out)],
        [numpy_helper.from_array(np.array(scales, np.float32), "s")],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return session.run(None, {"x": x})[0]


CASES = [
    ([1, 2, 8, 8], [1, 1, 1.7, 1.7], "nearest", "asymmetric", {"nearest_mode": "floor"}),
    ([1, 2, 7, 9], [1, 1, 1.5, 1.3], "nearest", "half_pixel", {}),
    ([1, 2, 9, 7], [1, 1, 0.6, 2.5], "nearest", "asymmetric", {"nearest_mode": "floor"}),
    ([1, 2, 8, 8], [1, 1, 1.7, 1.7], "linear", "asymmetric", {}),
    ([1, 2, 11, 8], [1, 1, 1.3, 2.0], "linear", "half_pixel", {}),
    ([1, 2, 10, 9], [1, 1, 0.7, 0.45], "linear", "asymmetric", {}),
]


@pytest.mark.parametrize(("shape", "scales", "mode", "coords", "attrs"), CASES)
def test_off_scale_resize_is_rewritten_exactly(
    shape: list[int], scales: list[float], mode: str, coords: str, attrs: dict
) -> None:
    model = resize_model(shape, scales, mode, coords, **attrs)
    rewritten, change = resize_for_htp(model)
    assert change.changed
    ops = [n.op_type for n in rewritten.graph.node]
    assert ("Gather" in ops) if mode == "nearest" else (ops == ["Pad", "Resize", "Slice"])
    for _ in range(3):
        x = RNG.standard_normal(shape).astype(np.float32)
        want, got = run(model, x), run(rewritten, x)
        assert want.shape == got.shape
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("scales", "coords"),
    [([1, 1, 2.0, 3.0], "asymmetric"), ([1, 1, 1.7, 1.7], "align_corners")],
    ids=["integral", "align-corners-depends-on-length"],
)
def test_resize_the_htp_follows_or_that_cannot_be_padded_stays(
    scales: list[float], coords: str
) -> None:
    _, change = resize_for_htp(resize_model([1, 2, 8, 8], scales, "linear", coords))
    assert not change.changed


@pytest.mark.qnn
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_off_scale_resize_agrees_on_the_htp(tmp_path: Path, mode: str) -> None:
    """Left alone, the ctx was 5-12 dB from the CPU QDQ model; rewritten it agrees."""
    model = resize_model([1, 2, 11, 8], [1, 1, 1.7, 1.7], mode, "asymmetric")
    w = numpy_helper.from_array((RNG.standard_normal((2, 2, 1, 1)) * 0.5).astype("f4"), "w")
    model.graph.initializer.append(w)
    model.graph.node.insert(0, oh.make_node("Conv", ["x", "w"], ["c"]))
    model.graph.node[1].input[0] = "c"
    build_whole_on_htp(tmp_path, "resize", model)


def sized_resize(shape: list[int], out: list[int], mode: str, coords: str) -> onnx.ModelProto:
    """A Resize given its output sizes (PyTorch's interpolate(size=...))."""
    model = resize_model(shape, [1.0] * len(shape), mode, coords)
    resize = model.graph.node[0]
    resize.input[:] = ["x", "", "", "sizes"]
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.array(out, np.int64), "sizes"))
    model.graph.output[0].CopyFrom(oh.make_tensor_value_info("y", TensorProto.FLOAT, out))
    return model


@pytest.mark.parametrize(
    ("model", "gathered"),
    [
        (resize_model([1, 2, 16, 16], [1, 1, 1.5, 1.5], "nearest", "half_pixel"), True),
        (resize_model([1, 2, 16, 16], [1, 1, 0.5, 0.5], "nearest", "half_pixel"), True),
        (
            resize_model(
                [1, 2, 16, 16], [1, 1, 2.0, 2.0], "nearest", "asymmetric", nearest_mode="floor"
            ),
            False,
        ),
        (sized_resize([1, 2, 16, 16], [1, 2, 12, 12], "nearest", "half_pixel"), True),
        (sized_resize([1, 2, 16, 16], [1, 2, 32, 32], "nearest", "asymmetric"), True),
        (sized_resize([1, 2, 16, 16], [1, 2, 24, 24], "linear", "half_pixel"), False),
    ],
    ids=["x1.5", "x0.5", "x2-kept", "sizes-12", "sizes-32", "sizes-linear-kept"],
)
def test_nearest_resize_the_htp_gets_wrong_becomes_a_gather(
    model: onnx.ModelProto, gathered: bool
) -> None:
    rewritten, change = resize_for_htp(model)
    assert change.changed == gathered
    if gathered:
        assert "Resize" not in [n.op_type for n in rewritten.graph.node]
    x = RNG.standard_normal([1, 2, 16, 16]).astype(np.float32)
    np.testing.assert_array_equal(run(rewritten, x), run(model, x))


@pytest.mark.qnn
@pytest.mark.parametrize(
    ("out", "coords"), [([1, 2, 24, 24], "half_pixel"), ([1, 2, 32, 32], "asymmetric")]
)
def test_sized_nearest_resize_builds_whole_and_right(
    tmp_path: Path, out: list[int], coords: str
) -> None:
    """Left alone: 0 dB on the HTP (16 -> 24, half_pixel), on the CPU (16 -> 32, asymmetric)."""
    model = sized_resize([1, 2, 16, 16], out, "nearest", coords)
    w = numpy_helper.from_array((RNG.standard_normal((2, 2, 1, 1)) * 0.5).astype("f4"), "w")
    model.graph.initializer.append(w)
    model.graph.node.insert(0, oh.make_node("Conv", ["x", "w"], ["c"]))
    model.graph.node[1].input[0] = "c"
    build_whole_on_htp(tmp_path, "resize", model)


@pytest.mark.parametrize(
    ("scale", "coords", "rounding", "recast"),
    [
        (2.0, "asymmetric", "round_prefer_floor", True),  # i/2: ties only, rounded down
        (2.0, "half_pixel", "round_prefer_floor", True),
        (4.0, "asymmetric", "round_prefer_floor", False),  # i = 4j + 3 reads row j + 1
        (2.0, "asymmetric", "round_prefer_ceil", False),
    ],
)
def test_whole_factor_nearest_takes_the_floor_form_or_a_gather(
    scale: float, coords: str, rounding: str, recast: bool
) -> None:
    """The HTP takes nearest growth by a whole factor as asymmetric/floor only (the ONNX
    default rounding, round_prefer_floor, stays on the CPU): recast where the rows are the
    same, else a Gather of onnxruntime's rows; the same output either way."""
    model = resize_model(
        [1, 2, 8, 8], [1, 1, scale, scale], "nearest", coords, nearest_mode=rounding
    )
    rewritten, change = resize_for_htp(model)
    assert change.changed
    ops = [n.op_type for n in rewritten.graph.node]
    if recast:
        assert ops == ["Resize"] and "recast as asymmetric, floor" in change.details[0]
        attrs = {a.name: a.s for a in rewritten.graph.node[0].attribute if a.type == a.STRING}
        assert attrs["nearest_mode"] == b"floor"
        assert attrs["coordinate_transformation_mode"] == b"asymmetric"
    else:
        assert "Resize" not in ops
    x = RNG.standard_normal([1, 2, 8, 8]).astype(np.float32)
    np.testing.assert_array_equal(run(rewritten, x), run(model, x))
    assert not resize_for_htp(rewritten)[1].changed


def fpn_with_default_rounding() -> onnx.ModelProto:
    """An old paddle2onnx FPN in small: Conv, then nearest 2x and 4x with the default
    rounding (round_prefer_floor), each into a Conv."""
    w = numpy_helper.from_array((RNG.standard_normal((2, 2, 1, 1)) * 0.5).astype("f4"), "w")
    s2 = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "s2")
    s4 = numpy_helper.from_array(np.array([1, 1, 4, 4], np.float32), "s4")
    nodes = [
        oh.make_node("Conv", ["x", "w"], ["c"]),
        *(
            oh.make_node(
                "Resize",
                ["c", "", f"s{k}"],
                [f"up{k}"],
                mode="nearest",
                coordinate_transformation_mode="asymmetric",
            )
            for k in (2, 4)
        ),
        oh.make_node("Conv", ["up2", "w"], ["y2"]),
        oh.make_node("Conv", ["up4", "w"], ["y4"]),
    ]
    graph = oh.make_graph(
        nodes,
        "fpn",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 8, 8])],
        [
            oh.make_tensor_value_info("y2", TensorProto.FLOAT, [1, 2, 16, 16]),
            oh.make_tensor_value_info("y4", TensorProto.FLOAT, [1, 2, 32, 32]),
        ],
        [w, s2, s4],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 13)])
    model.ir_version = 7
    return model


@pytest.mark.qnn
def test_default_rounding_nearest_upsampling_builds_whole(tmp_path: Path) -> None:
    """Left alone, the QNN EP leaves both Resizes on the CPU (the compile gate fails: checked
    by the test below)."""
    build_whole_on_htp(tmp_path, "fpn", fpn_with_default_rounding())


@pytest.mark.qnn
def test_the_judge_says_when_its_context_is_not_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Without the recast, the judge's context has the Resizes on the CPU: its progress line
    says so at quantize, before compile's coverage gate refuses the model."""
    from compile_fixtures import quantize_on_noise

    from pipeline.graph import resize

    monkeypatch.setattr(resize, "_floor_form", lambda node, shape, scales, off: ([], ""))
    assert quantize_on_noise(tmp_path, "fpn", fpn_with_default_rounding()) == 0
    captured = capsys.readouterr()
    assert re.search(
        r"as quantized: [\d.]+ dB vs float, \d+ QNN partitions and [1-9]\d* CPU "
        "nodes",
        captured.out + captured.err,
    )


ANTIALIASED = [
    ([1, 3, 32, 32], [1, 1, 0.5, 0.5], "linear", "half_pixel"),
    ([1, 2, 40, 30], [1, 1, 0.37, 0.6], "cubic", "half_pixel"),
    ([1, 2, 8, 64], [1, 1, 1, 0.25], "linear", "align_corners"),
    ([1, 2, 36, 20], [1, 1, 0.5, 1.6], "linear", "pytorch_half_pixel"),
    ([2, 48], [1, 0.3], "linear", "asymmetric"),
]


@pytest.mark.parametrize(("shape", "scales", "mode", "coords"), ANTIALIASED)
def test_antialiased_resize_becomes_matmuls_with_the_same_values(
    shape: list[int], scales: list[float], mode: str, coords: str
) -> None:
    """torchvision's antialiased resize (opset 18): one MatMul by a constant per shrunk or
    resized axis, the values onnxruntime's own antialiased Resize gives."""
    model = resize_model(shape, scales, mode, coords, antialias=1)
    rewritten, change = antialiased_resizes_as_matmuls(model)
    ops = [n.op_type for n in rewritten.graph.node]
    assert "Resize" not in ops and ops.count("MatMul") == sum(s != 1 for s in scales)
    assert change.details and "antialiased" in change.details[0]
    x = RNG.standard_normal(shape).astype(np.float32)
    np.testing.assert_allclose(run(rewritten, x), run(model, x), rtol=1e-5, atol=1e-6)


def test_antialiased_resize_sized_and_enlarging() -> None:
    """Given as output sizes it is rewritten too; one that only enlarges keeps its Resize,
    without the antialias the QNN EP refuses (it filters nothing when enlarging)."""
    sized = sized_resize([1, 2, 37, 45], [1, 2, 13, 20], "linear", "half_pixel")
    sized.graph.node[0].attribute.append(oh.make_attribute("antialias", 1))
    rewritten, _ = antialiased_resizes_as_matmuls(sized)
    assert [n.op_type for n in rewritten.graph.node] == ["MatMul", "MatMul"]
    x = RNG.standard_normal((1, 2, 37, 45)).astype(np.float32)
    np.testing.assert_allclose(run(rewritten, x), run(sized, x), rtol=1e-5, atol=1e-6)

    cropped = resize_model([1, 2, 8, 8], [1, 1, 0.5, 0.5], "linear", "tf_crop_and_resize")
    cropped.graph.node[0].attribute.append(oh.make_attribute("antialias", 1))
    assert not antialiased_resizes_as_matmuls(cropped)[1].changed  # its roi moves coordinates

    larger = resize_model([1, 2, 8, 8], [1, 1, 2.0, 1.5], "linear", "half_pixel", antialias=1)
    rewritten, change = antialiased_resizes_as_matmuls(larger)
    (node,) = rewritten.graph.node
    assert node.op_type == "Resize" and "antialias" not in [a.name for a in node.attribute]
    assert "antialias dropped" in change.details[0]
    x = RNG.standard_normal((1, 2, 8, 8)).astype(np.float32)  # the same to float rounding
    np.testing.assert_allclose(run(rewritten, x), run(larger, x), rtol=1e-5, atol=1e-6)


def test_antialiased_downscale_builds_whole_on_the_htp(tmp_path: Path) -> None:
    """Conv -> antialiased half-size Resize -> Conv (PyTorch's interpolate(antialias=True),
    dynamo export): the Resize and its Q/DQ were on the CPU, 2 partitions."""
    model = resize_model([1, 4, 32, 32], [1, 1, 0.5, 0.5], "linear", "pytorch_half_pixel")
    model.graph.node[0].attribute.append(oh.make_attribute("antialias", 1))
    w = numpy_helper.from_array((RNG.standard_normal((4, 4, 3, 3)) * 0.3).astype("f4"), "w")
    model.graph.initializer.append(w)
    model.graph.node.insert(0, oh.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]))
    model.graph.node[1].input[0] = "c"
    build_whole_on_htp(tmp_path, "antialiased", model)
