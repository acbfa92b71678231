"""Conv channels rescaled ahead of depthwise Convs (pipeline/graph/balance.py): exact in float,
found only where every reader allows it, and what it buys on the CPU and on the HTP."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.graph.balance import (
    BALANCE_RATIO,
    MAX_GAIN,
    balance_scales,
    balance_sites,
    balanced_depthwise_inputs,
)

CHANNELS = 8


def _chain(gate: str, seed: int = 0, reader: str = "depthwise") -> onnx.ModelProto:
    """x -> Conv (channel 0 peaking ~1000x the others, as a BN fold leaves them) -> ``gate`` ->
    a depthwise Conv that scales each channel back to one size -> a 1x1 Conv mixing them."""
    rng = np.random.default_rng(seed)
    size = np.full((CHANNELS, 1, 1, 1), 0.1, np.float32)
    size[0] = 100.0
    w1 = rng.normal(0, 0.5, (CHANNELS, 4, 3, 3)).astype(np.float32) * size
    b1 = rng.normal(0, 0.05, CHANNELS).astype(np.float32) * size.reshape(-1)
    if reader == "depthwise":
        w2 = rng.normal(0, 0.5, (CHANNELS, 1, 3, 3)).astype(np.float32) / size
        group = CHANNELS
    else:  # a dense Conv reads it
        w2 = rng.normal(0, 0.5, (CHANNELS, CHANNELS, 3, 3)).astype(np.float32)
        w2 /= size.reshape(1, -1, 1, 1)
        group = 1
    w3 = rng.normal(0, 0.5, (4, CHANNELS, 1, 1)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["t"], pads=[1, 1, 1, 1])]
    gated = "t"
    if gate == "relu":
        nodes.append(helper.make_node("Relu", ["t"], ["u"]))
        gated = "u"
    elif gate == "hardswish":
        nodes.append(helper.make_node("HardSwish", ["t"], ["u"]))
        gated = "u"
    elif gate == "leaky":
        nodes.append(helper.make_node("LeakyRelu", ["t"], ["u"], alpha=0.1))
        gated = "u"
    elif gate == "prelu":
        nodes.append(helper.make_node("PRelu", ["t", "slope"], ["u"]))
        gated = "u"
    elif gate == "mish":  # x * tanh(softplus(x))
        nodes.append(helper.make_node("Softplus", ["t"], ["sp"]))
        nodes.append(helper.make_node("Tanh", ["sp"], ["g"]))
        nodes.append(helper.make_node("Mul", ["t", "g"], ["u"]))
        gated = "u"
    elif gate == "gelu_sigmoid":  # x * sigmoid(1.702 x)
        nodes.append(helper.make_node("Mul", ["t", "k"], ["kt"]))
        nodes.append(helper.make_node("Sigmoid", ["kt"], ["g"]))
        nodes.append(helper.make_node("Mul", ["t", "g"], ["u"]))
        gated = "u"
    elif gate == "hardswish_parts":  # x * clip(x + 3, 0, 6) / 6, as exporters write it
        nodes.append(helper.make_node("Add", ["t", "three"], ["a"]))
        nodes.append(helper.make_node("Clip", ["a", "lo", "hi"], ["c"]))
        nodes.append(helper.make_node("Div", ["c", "hi"], ["g"]))
        nodes.append(helper.make_node("Mul", ["g", "t"], ["u"]))
        gated = "u"
    elif gate in ("silu", "x_hardsigmoid", "clip"):
        if gate == "clip":
            nodes.append(helper.make_node("Clip", ["t", "lo", "hi"], ["u"]))
        else:
            op = "Sigmoid" if gate == "silu" else "HardSigmoid"
            nodes.append(helper.make_node(op, ["t"], ["g"]))
            nodes.append(helper.make_node("Mul", ["g", "t"], ["u"]))  # either operand order
        gated = "u"
    nodes.append(helper.make_node("Conv", [gated, "w2"], ["d"], pads=[1, 1, 1, 1], group=group))
    nodes.append(helper.make_node("Conv", ["d", "w3"], ["y"]))
    inits = [
        numpy_helper.from_array(w1, "w1"),
        numpy_helper.from_array(b1, "b1"),
        numpy_helper.from_array(w2, "w2"),
        numpy_helper.from_array(w3, "w3"),
        numpy_helper.from_array(np.array(0.0, np.float32), "lo"),
        numpy_helper.from_array(np.array(6.0, np.float32), "hi"),
        numpy_helper.from_array(np.array(3.0, np.float32), "three"),
        numpy_helper.from_array(np.array(1.702, np.float32), "k"),
        numpy_helper.from_array(
            np.linspace(0.05, 0.4, CHANNELS, dtype=np.float32).reshape(CHANNELS, 1, 1), "slope"
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, 16])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model


def _run(model: onnx.ModelProto, x: np.ndarray, outputs: list[str] | None = None) -> list:
    if outputs:
        model = onnx.ModelProto.FromString(model.SerializeToString())
        model.graph.output.extend(helper.make_empty_tensor_value_info(o) for o in outputs)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


def _peaks(model: onnx.ModelProto, x: np.ndarray, tensor: str) -> np.ndarray:
    values = _run(model, x, [tensor])[-1]
    return np.abs(values).max(axis=(0, 2, 3))


@pytest.mark.parametrize(
    "gate",
    [
        "none",
        "relu",
        "leaky",
        "prelu",
        "silu",
        "x_hardsigmoid",
        "hardswish",
        "mish",
        "hardswish_parts",
        "gelu_sigmoid",
    ],
)
def test_the_rewrite_is_exact_and_leaves_the_channels_level(gate: str) -> None:
    model = _chain(gate)
    x = np.random.default_rng(1).normal(0, 1, (1, 4, 16, 16)).astype(np.float32)
    assert balance_sites(model) == {"t": 4}
    peaks = _peaks(model, x, "t")
    assert peaks.max() / peaks.min() > 300  # the imbalance the rewrite is for
    scales = balance_scales({"t": peaks})
    balanced, change = balanced_depthwise_inputs(model, scales)
    assert change.changed and "t (Conv)" in change.details[0], change
    onnx.checker.check_model(balanced)
    (before,), after = _run(model, x), _run(balanced, x)[0]
    noise = float(((after - before) ** 2).sum())
    assert 10 * np.log10(float((before**2).sum()) / max(noise, 1e-30)) > 100  # exact in float
    # The tensor the depthwise Conv reads now holds every channel at one size.
    gated = "t" if gate == "none" else "u"
    level = _peaks(balanced, x, gated)
    assert level.max() / level.min() < 4, level
    # The source is left as it was (a pure function).
    assert _run(model, x)[0].tobytes() == before.tobytes()


@pytest.mark.parametrize(
    ("gate", "reader"), [("clip", "depthwise"), ("silu", "dense"), ("none", "dense")]
)
def test_no_site_where_a_reader_or_the_gate_would_see_scaled_values(gate: str, reader: str):
    """A ReLU6-like Clip's bound would differ per channel; a dense Conv's int8 weights would
    lose the columns scaled down: left alone."""
    model = _chain(gate, reader=reader)
    assert balance_sites(model) == {}
    balanced, change = balanced_depthwise_inputs(model, {"t": np.full(CHANNELS, 0.5, np.float32)})
    assert not change.changed and balanced is model


def test_no_site_for_a_graph_output_or_a_second_reader() -> None:
    model = _chain("silu")
    model.graph.output.append(helper.make_empty_tensor_value_info("u"))
    assert balance_sites(model) == {}
    model = _chain("none")
    model.graph.node.append(helper.make_node("Relu", ["t"], ["r"]))
    model.graph.output.append(helper.make_empty_tensor_value_info("r"))
    assert balance_sites(model) == {}


def test_scales_only_where_the_live_channels_span_the_ratio() -> None:
    even = np.array([1.0, 2.0, BALANCE_RATIO * 0.99])
    wide = np.array([4.0, 0.0, 1.0, 4e-8 * 1e-3, 4.0 / (MAX_GAIN * 8)])
    scales = balance_scales({"even": even, "wide": wide, "dead": np.zeros(3)})
    assert set(scales) == {"wide"}
    factor = scales["wide"]
    assert factor[0] == 1.0 and factor[2] == pytest.approx(0.25)
    assert factor[1] == 1.0 and factor[3] == 1.0  # dead channels stay as they are
    assert factor[4] == pytest.approx(1.0 / MAX_GAIN)  # no channel is raised past MAX_GAIN


def _quantize(root: Path, model: onnx.ModelProto, settings: str) -> dict:
    from pipeline.core.config import load_config
    from pipeline.quantize.build import quantize_model

    root.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(root / "m.onnx"))
    rng = np.random.default_rng(5)
    data = root / "data"
    data.mkdir(exist_ok=True)
    for i in range(16):
        np.save(data / f"s{i:02d}.npy", rng.normal(0, 1, (1, 4, 16, 16)).astype(np.float32))
    (root / "m.toml").write_text(
        '[model]\nname = "m"\nversion = "1.0.0"\nsource = "m.onnx"\n'
        '[calibration]\nkind = "tensors"\npath = "data"\nsamples = 16\n'
        f"[quantization]\nauto_mixed_precision = false\n{settings}"
        '[compile]\ntargets = ["snapdragon-x-elite"]\n',
        encoding="utf-8",
    )
    quantize_model(load_config(root / "m.toml"), root / "artifacts", force=True)
    return json.loads((root / "artifacts/build/m/report.json").read_text("utf-8"))


def test_balanced_channels_quantize_far_closer_to_float_on_the_cpu(tmp_path: Path) -> None:
    model = _chain("silu")
    off = _quantize(tmp_path / "off", model, 'judge = "cpu"\nbalance_channels = false\n')
    on = _quantize(tmp_path / "on", model, 'judge = "cpu"\n')
    assert not any(p["step"] == "balanced_depthwise_inputs" for p in off["prepare"])
    step = next(p for p in on["prepare"] if p["step"] == "balanced_depthwise_inputs")
    assert "x * g(x), g: Sigmoid" in step["details"][0]
    assert on["preparation_check"]["snr_db"] is None or on["preparation_check"]["snr_db"] > 60
    assert float(on["worst_snr_db"]) > float(off["worst_snr_db"]) + 10, (
        on["worst_snr_db"],
        off["worst_snr_db"],
    )


def test_balanced_channels_hold_on_the_htp(tmp_path: Path) -> None:
    """What the NPU computes: the HTP judge's context of the HardSwish chain, balanced, is whole
    and as close to float as the CPU QDQ model; unbalanced it is far below."""
    model = _chain("hardswish")
    off = _quantize(tmp_path / "off", model, "balance_channels = false\n")
    on = _quantize(tmp_path / "on", model, "")
    first_off, first_on = off["htp"]["rounds"][0], on["htp"]["rounds"][0]
    assert on["htp"]["judge"] == "htp", on["htp"]["reason"]
    assert first_on["label"] == "as quantized" and on["htp"]["chosen"] == "as quantized"
    assert first_on["partitions"] == 1 and first_on["cpu_nodes"] == 0
    assert first_on["ctx_vs_float_db"] > 30.0
    assert first_on["ctx_vs_float_db"] > first_off["ctx_vs_float_db"] + 10


def test_the_whole_model_in_fp16_is_built_from_the_model_before_balancing(tmp_path: Path):
    """Balancing is for integer grids: fp16 keeps each value's own precision, and a kernel
    scaled down by it can fall into fp16's subnormals (a person detector's whole-fp16 context
    25.6 -> 22.7 dB built from the balanced model). A target no quantization meets keeps the
    whole model in fp16: its graph is the unbalanced one."""
    report = _quantize(tmp_path, _chain("silu"), "target_snr_db = 150.0\n")
    assert any(p["step"] == "balanced_depthwise_inputs" for p in report["prepare"])
    assert report["htp"]["whole_float16"], report["htp"]["chosen"]
    bucket = tmp_path / "artifacts/build/m/buckets/static"
    fp16 = onnx.load(str(bucket / "qdq.onnx"))
    unbalanced = onnx.load(str(bucket / "float_unbalanced.onnx"))
    balanced = onnx.load(str(bucket / "float.onnx"))
    assert [n.op_type for n in unbalanced.graph.node] != [n.op_type for n in balanced.graph.node]
    assert not any("balance" in i for n in fp16.graph.node for i in n.input)

    def depthwise(model: onnx.ModelProto) -> np.ndarray:
        (kernel,) = [i for i in model.graph.initializer if list(i.dims[:2]) == [CHANNELS, 1]]
        return numpy_helper.to_array(kernel).astype(np.float32)

    assert np.allclose(depthwise(fp16), depthwise(unbalanced), rtol=1e-3)
    assert not np.allclose(depthwise(fp16), depthwise(balanced), rtol=1e-3)


def test_every_bucket_gets_the_same_factors_so_their_weights_stay_identical(tmp_path: Path):
    """Shape buckets share one set of weights (packaging "shared"): each bucket's float model
    is balanced with the factors of the largest's calibration samples, so the rescaled weights
    are the same bytes in every bucket."""
    from pipeline.core.config import load_config
    from pipeline.quantize.build import quantize_model

    model = _chain("silu")
    for value in (model.graph.input[0], model.graph.output[0]):
        value.type.tensor_type.shape.dim[3].dim_param = "w"
    onnx.save(model, str(tmp_path / "m.onnx"))
    rng = np.random.default_rng(5)
    (tmp_path / "data").mkdir()
    for i in range(16):
        width = int(rng.choice([8, 16]))
        np.save(tmp_path / f"data/s{i:02d}.npy", rng.normal(0, 1, (1, 4, 16, width)).astype("f4"))
    (tmp_path / "m.toml").write_text(
        '[model]\nname = "m"\nversion = "1.0.0"\nsource = "m.onnx"\n'
        '[calibration]\nkind = "tensors"\npath = "data"\nsamples = 16\n'
        '[quantization]\njudge = "cpu"\nauto_mixed_precision = false\n'
        '[compile]\ntargets = ["snapdragon-x-elite"]\nembed = false\n'
        "[buckets]\ndims = { w = [8, 16] }\npad = { w = { value = 0.0 } }\n",
        encoding="utf-8",
    )
    quantize_model(load_config(tmp_path / "m.toml"), tmp_path / "artifacts", force=True)
    floats = sorted((tmp_path / "artifacts/build/m/buckets").glob("*/float.onnx"))
    assert len(floats) == 2
    balanced = []
    for path in floats:
        float_model = onnx.load(str(path))
        assert any(n.op_type == "Mul" and "_balance" in n.input[1] for n in float_model.graph.node)
        balanced.append(
            {i.name: i.raw_data or i.SerializeToString() for i in float_model.graph.initializer}
        )
    shared = set(balanced[0]) & set(balanced[1])
    assert any(name.endswith("_balanced") for name in shared)
    assert all(balanced[0][name] == balanced[1][name] for name in shared if "balance" in name)


def test_a_build_without_balancing_leaves_no_unbalanced_model_behind(tmp_path: Path) -> None:
    """The model before balancing is kept for the fp16 candidate of the build that balanced;
    a later build that does not balance removes it, so no stale model lies in the build."""
    unbalanced = tmp_path / "artifacts/build/m/buckets/static/float_unbalanced.onnx"
    _quantize(tmp_path, _chain("silu"), 'judge = "cpu"\n')
    assert unbalanced.is_file()
    _quantize(tmp_path, _chain("silu"), 'judge = "cpu"\nbalance_channels = false\n')
    assert not unbalanced.exists()
