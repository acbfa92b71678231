"""Recurrent ops and streaming-model patterns (pipeline/graph/recurrent.py): every rewrite is
checked against what onnxruntime's CPU kernels compute for the original model."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

from pipeline.core.config import InputsSection
from pipeline.graph import edit
from pipeline.graph import recurrent as rc
from pipeline.graph import transforms as t
from pipeline.graph.prepare import prepare_model

ATOL = 2e-5


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))


def random_feeds(
    model: onnx.ModelProto, seed: int = 0, scale: float = 1.5
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        i.name: (
            scale * rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim])
        ).astype(np.float32)
        for i in model.graph.input
    }


def rnn_model(
    op: str,
    *,
    steps: int = 3,
    batch: int = 2,
    size: int = 5,
    hidden: int = 4,
    direction: str = "forward",
    layout: int = 0,
    states: bool = True,
    peepholes: bool = False,
    bias: bool = True,
    outputs: tuple[bool, ...] = (True, True, True),
    seed: int = 0,
    **attrs: object,
) -> onnx.ModelProto:
    """One LSTM/GRU/RNN node with seeded weights and its states as graph inputs."""
    rng = np.random.default_rng(seed)
    dirs = 2 if direction == "bidirectional" else 1
    gates = rc.GATES[op]

    def weight(name: str, shape: tuple[int, ...]) -> TensorProto:
        return numpy_helper.from_array((0.6 * rng.standard_normal(shape)).astype(np.float32), name)

    inits = [weight("W", (dirs, gates * hidden, size)), weight("R", (dirs, gates * hidden, hidden))]
    ins = ["x", "W", "R", "", "", "", "", ""]
    if bias:
        inits.append(weight("B", (dirs, 2 * gates * hidden)))
        ins[3] = "B"
    x_shape = [steps, batch, size] if layout == 0 else [batch, steps, size]
    s_shape = [dirs, batch, hidden] if layout == 0 else [batch, dirs, hidden]
    inputs = [oh.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)]
    if states:
        inputs.append(oh.make_tensor_value_info("h0", TensorProto.FLOAT, s_shape))
        ins[5] = "h0"
        if op == "LSTM":
            inputs.append(oh.make_tensor_value_info("c0", TensorProto.FLOAT, s_shape))
            ins[6] = "c0"
    if op == "LSTM" and peepholes:
        inits.append(weight("P", (dirs, 3 * hidden)))
        ins[7] = "P"
    while ins[-1] == "":
        ins.pop()
    y_shape = [steps, dirs, batch, hidden] if layout == 0 else [batch, steps, dirs, hidden]
    names = ["y", "y_h", "y_c"][: 3 if op == "LSTM" else 2]
    outs = [n if keep else "" for n, keep in zip(names, outputs, strict=False)]
    while outs and not outs[-1]:
        outs.pop()
    shapes = {"y": y_shape, "y_h": s_shape, "y_c": s_shape}
    node = oh.make_node(
        op, ins, outs, hidden_size=hidden, direction=direction, layout=layout, **attrs
    )
    graph = oh.make_graph(
        [node],
        "rnn",
        inputs,
        [oh.make_tensor_value_info(n, TensorProto.FLOAT, shapes[n]) for n in outs if n],
        inits,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def assert_unrolled_exactly(model: onnx.ModelProto) -> onnx.ModelProto:
    unrolled, change = rc.unroll_recurrent_ops(model, everything=True)
    assert change.changed and "unrolled" in change.details[0]
    assert not any(n.op_type in rc.RECURRENT_OPS for n in unrolled.graph.node)
    for seed in range(2):
        feeds = random_feeds(model, seed)
        expected, got = run(model, feeds), run(unrolled, feeds)
        for name, value in expected.items():
            np.testing.assert_allclose(got[name], value, atol=ATOL, rtol=1e-5, err_msg=name)
    return unrolled


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize(
    "form",
    [{}, {"clip": 0.7}, {"states": False}, {"peepholes": True}, {"input_forget": 1}],
    ids=["plain", "clip", "zero-state", "peepholes", "input-forget"],
)
def test_lstm_unrolls_exactly(direction: str, steps: int, form: dict) -> None:
    assert_unrolled_exactly(rnn_model("LSTM", direction=direction, steps=steps, **form))


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("linear_before_reset", [0, 1])
@pytest.mark.parametrize(
    "form", [{}, {"clip": 0.7}, {"states": False}], ids=["plain", "clip", "zero-state"]
)
def test_gru_unrolls_exactly(direction: str, linear_before_reset: int, form: dict) -> None:
    model = rnn_model("GRU", direction=direction, linear_before_reset=linear_before_reset, **form)
    assert_unrolled_exactly(model)


@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
@pytest.mark.parametrize("form", [{}, {"clip": 0.7}, {"states": False}])
def test_rnn_unrolls_exactly(direction: str, form: dict) -> None:
    assert_unrolled_exactly(rnn_model("RNN", direction=direction, **form))


@pytest.mark.parametrize(
    ("op", "attrs"),
    [
        (
            "LSTM",
            {
                "activations": ["HardSigmoid", "LeakyRelu", "Relu"],
                "activation_alpha": [0.3, 0.05],
                "activation_beta": [0.4],
            },
        ),
        (
            "LSTM",
            {
                "direction": "bidirectional",
                "activations": ["Sigmoid", "Tanh", "Tanh", "HardSigmoid", "ScaledTanh", "Affine"],
                "activation_alpha": [0.3, 1.5, 0.7],
                "activation_beta": [0.45, 0.8, 0.1],
            },
        ),
        ("GRU", {"activations": ["Sigmoid", "Softsign"], "linear_before_reset": 1}),
        ("GRU", {"activations": ["HardSigmoid", "Elu"]}),
        ("RNN", {"activations": ["Relu"]}),
        ("RNN", {"activations": ["Softplus"]}),
        ("RNN", {"activations": ["ThresholdedRelu"], "activation_alpha": [0.2]}),
        ("RNN", {"direction": "bidirectional", "activations": ["Tanh", "LeakyRelu"]}),
    ],
)
def test_activation_functions_follow_onnxruntime(op: str, attrs: dict) -> None:
    """alpha/beta are consumed along the list by the functions that take them (rnn_helpers)."""
    assert_unrolled_exactly(rnn_model(op, **attrs))


@pytest.mark.parametrize(
    ("op", "form"),
    [
        ("LSTM", {"bias": False}),
        ("GRU", {"bias": False, "outputs": (False, True)}),
        ("LSTM", {"outputs": (False, False, True)}),
        ("LSTM", {"outputs": (True,)}),
    ],
)
def test_optional_inputs_and_outputs(op: str, form: dict) -> None:
    assert_unrolled_exactly(rnn_model(op, **form))


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
def test_layout_1_matches_the_time_major_op(op: str, direction: str) -> None:
    """onnxruntime refuses layout 1 ("Batchwise recurrent operations ... not supported"), so the
    unrolled batch-major model is compared with the time-major op on transposed data."""
    time_major = rnn_model(op, direction=direction, layout=0, seed=3)
    batch_major = rnn_model(op, direction=direction, layout=1, seed=3)
    assert "layout 1" in rc.qnn_refuses(batch_major.graph.node[0])
    unrolled, _ = rc.unroll_recurrent_ops(batch_major)
    assert not any(n.op_type == op for n in unrolled.graph.node)
    feeds = random_feeds(time_major)
    expected = run(time_major, feeds)
    got = run(unrolled, {k: np.ascontiguousarray(v.transpose(1, 0, 2)) for k, v in feeds.items()})
    np.testing.assert_allclose(got["y"], expected["y"].transpose(2, 0, 1, 3), atol=ATOL)
    np.testing.assert_allclose(got["y_h"], expected["y_h"].transpose(1, 0, 2), atol=ATOL)


def test_forms_qnn_runs_well_are_kept() -> None:
    """The QNN EP runs default GRUs whole, and as accurately as the unrolled cell or more on
    the simulator (a 3-layer stack: 62.7 vs 42.6 dB)."""
    for model in (
        rnn_model("GRU", linear_before_reset=1),
        rnn_model("GRU", direction="bidirectional", steps=5),
        rnn_model("GRU", steps=1, states=False),
    ):
        kept, change = rc.unroll_recurrent_ops(model)
        assert not change.changed
        assert [n.op_type for n in kept.graph.node] == [model.graph.node[0].op_type]


def test_an_lstm_over_a_sequence_is_unrolled_within_the_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An LSTM QNN takes is unrolled for accuracy (see the HTP test below), a streaming model's
    one-step cell too, all of a model's such LSTMs or none: past the node budget every one keeps
    the HTP's LSTM."""
    cell = rnn_model("LSTM", steps=1, batch=1)
    assert not any(n.op_type == "LSTM" for n in rc.unroll_recurrent_ops(cell)[0].graph.node)
    model = rnn_model("LSTM", direction="bidirectional", steps=3, peepholes=True)
    unrolled, change = rc.unroll_recurrent_ops(model)
    assert change.changed and "accuracy" in change.details[0]
    assert not any(n.op_type in rc.RECURRENT_OPS for n in unrolled.graph.node)
    feeds = random_feeds(model)
    for name, value in run(model, feeds).items():
        np.testing.assert_allclose(run(unrolled, feeds)[name], value, atol=ATOL, rtol=1e-5)
    # The buckets of one context keep the HTP's LSTM (their quantization must agree).
    kept, change = rc.unroll_recurrent_ops(model, budget=0)
    assert [n.op_type for n in kept.graph.node] == ["LSTM"] and not change.changed
    monkeypatch.setattr(rc, "LSTM_UNROLL_NODES", 50)
    kept, change = rc.unroll_recurrent_ops(model)
    assert [n.op_type for n in kept.graph.node] == ["LSTM"]
    assert change.details[-1].startswith(rc.LSTMS_KEPT_WHOLE)
    assert not any("accuracy" in d for d in change.details)
    # A budget given (the HTP found its own LSTM short: pipeline.quantize.build) overrides it.
    unrolled, change = rc.unroll_recurrent_ops(model, budget=rc.LSTM_UNROLL_CAP)
    assert not any(n.op_type == "LSTM" for n in unrolled.graph.node)
    refused = rnn_model("LSTM", steps=3, clip=0.7)  # unrolled whatever the budget
    assert not any(n.op_type == "LSTM" for n in rc.unroll_recurrent_ops(refused)[0].graph.node)


def test_the_cells_qnn_builds_lengthen_the_compile_time_limit() -> None:
    """QNN builds an LSTM/GRU it takes one cell per step and direction, and compiles them for
    minutes (4 bidirectional layers over 589 steps: 783 s): the time limit grows with them."""
    from pipeline.core.config import QNN_SECONDS_PER_RECURRENT_STEP, CompileSection

    assert rc.qnn_recurrent_steps(rnn_model("LSTM", direction="bidirectional", steps=7)) == 14
    assert rc.qnn_recurrent_steps(rnn_model("GRU", steps=5, batch=2, layout=1)) == 5
    # X's shape from inference, behind another op; two nodes add up
    model = rnn_model("GRU", steps=6, direction="reverse")
    model.graph.node.insert(0, oh.make_node("Relu", ["x_in"], ["x"]))
    model.graph.input[0].name = "x_in"
    second = onnx.helper.make_node("GRU", ["x", "W", "R", "B"], ["y2"], hidden_size=4)
    model.graph.node.append(second)
    assert rc.qnn_recurrent_steps(model) == 12
    assert rc.qnn_recurrent_steps(leaky_integrator(0.1)) == 0
    section = CompileSection(timeout_s=100.0)
    assert section.timeout_for(0) == 100.0
    assert section.timeout_for(14) == 100.0 + 14 * QNN_SECONDS_PER_RECURRENT_STEP > 100.0


def test_many_recurrent_cells_choose_the_fast_graph_finalization() -> None:
    """QNN's default HTP finalization took 184 s on a VAD with one BiLSTM over 589 frames
    behind a SincNet front end, level 1 took 26 s: "auto" picks level 1 from
    FAST_FINALIZE_RECURRENT_STEPS cells on, leaves QNN's default below, and a level set in the
    config is used as it is (the judge and compile ask the same section, so they agree)."""
    from pipeline.core.config import FAST_FINALIZE_RECURRENT_STEPS as many
    from pipeline.core.config import FINALIZATION_OPTION, CompileSection

    auto = CompileSection()
    assert auto.htp_finalization == "auto"
    assert auto.qnn_options_for(0) == {} == auto.qnn_options_for(many - 1)
    assert auto.qnn_options_for(many) == {FINALIZATION_OPTION: "1"}
    assert CompileSection(htp_finalization="default").qnn_options_for(10 * many) == {}
    assert CompileSection(htp_finalization="3").qnn_options_for(0) == {FINALIZATION_OPTION: "3"}


def test_a_long_unrolled_sequence_splits_by_count() -> None:
    """Past 128 steps a Split's sizes constant is 1 KiB, which onnxruntime's qnn_preprocess_model
    stores as external data that ONNX shape inference cannot read ("Cannot parse data from
    external tensors"); an even Split by num_outputs has no such constant."""
    model = rnn_model("LSTM", steps=130, batch=1, size=3, hidden=2, clip=5.0)
    unrolled, _ = rc.unroll_recurrent_ops(model)
    splits = [n for n in unrolled.graph.node if n.op_type == "Split"]
    assert splits and all(len(n.input) == 1 for n in splits)
    prepared, _ = t.qnn_preprocess(unrolled)
    feeds = random_feeds(model)
    for name, value in run(model, feeds).items():
        np.testing.assert_allclose(run(prepared, feeds)[name], value, atol=ATOL, rtol=1e-5)


def lstm_stack(layers: int, hidden: int, steps: int, size: int, seed: int = 1) -> onnx.ModelProto:
    """Stacked LSTMs QNN takes (PyTorch init: uniform +-1/sqrt(hidden)), each layer's output
    reshaped to the next one's input, as a d-vector speaker embedder is built."""
    rng = np.random.default_rng(seed)
    bound = 1 / np.sqrt(hidden)
    inits, nodes, x = [], [], "x"
    for layer in range(layers):
        width = size if layer == 0 else hidden
        for name, shape in (("W", (1, 4 * hidden, width)), ("R", (1, 4 * hidden, hidden))):
            values = rng.uniform(-bound, bound, shape).astype(np.float32)
            inits.append(numpy_helper.from_array(values, f"{name}{layer}"))
        bias = rng.uniform(-bound, bound, (1, 8 * hidden)).astype(np.float32)
        inits.append(numpy_helper.from_array(bias, f"B{layer}"))
        inits.append(numpy_helper.from_array(np.array([steps, 1, hidden], np.int64), f"s{layer}"))
        nodes.append(
            oh.make_node(
                "LSTM",
                [x, f"W{layer}", f"R{layer}", f"B{layer}"],
                [f"y{layer}"],
                hidden_size=hidden,
            )
        )
        nodes.append(oh.make_node("Reshape", [f"y{layer}", f"s{layer}"], [f"h{layer}"]))
        x = f"h{layer}"
    graph = oh.make_graph(
        nodes,
        "stack",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [steps, 1, size])],
        [oh.make_tensor_value_info(x, TensorProto.FLOAT, [steps, 1, hidden])],
        inits,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def test_the_htp_runs_an_unrolled_lstm_stack_more_accurately(tmp_path) -> None:
    """Over a sequence the HTP's own LSTM is less accurate than the unrolled cell, both with
    onnxruntime's QNN recipe (uint16 activations, uint8 weights), against float on the
    simulator: 2 layers of 64 over 20 steps of a random walk, ~30 vs ~45 dB."""
    from compile_fixtures import _quantize_qnn

    from pipeline.htp.probe import probe

    model = lstm_stack(layers=2, hidden=64, steps=20, size=16)
    unrolled, change = rc.unroll_recurrent_ops(model)
    assert change.changed and "accuracy" in change.details[0]
    rng = np.random.default_rng(3)

    def walk() -> dict[str, np.ndarray]:
        start = rng.standard_normal((1, 16))
        steps = np.cumsum(0.3 * rng.standard_normal((20, 16)), axis=0)
        return {"x": (start + steps).reshape(20, 1, 16).astype(np.float32)}

    calibration = [walk() for _ in range(16)]
    np.savez(tmp_path / "sample.npz", **walk())
    onnx.save(model, str(tmp_path / "float.onnx"))
    results = {}
    for name, candidate in (("native", model), ("unrolled", unrolled)):
        onnx.save(candidate, str(tmp_path / f"{name}_float.onnx"))
        qdq = tmp_path / f"{name}_qdq.onnx"
        _quantize_qnn(tmp_path / f"{name}_float.onnx", qdq, calibration)
        result = probe(
            qdq, tmp_path / "float.onnx", [tmp_path / "sample.npz"], tmp_path / name, 60, 73
        )
        assert result.ok, result.error
        assert result.partitions == 1 and result.cpu_nodes == 0
        results[name] = result.worst_ctx_vs_float
    # If a new QNN SDK's LSTM is as accurate, the gap closes: keep the HTP's LSTM then.
    assert results["unrolled"] > results["native"] + 8.0, results


def test_forms_qnn_refuses_are_unrolled() -> None:
    for model, reason in (
        (rnn_model("RNN"), "no QNN RNN op"),
        (rnn_model("GRU", clip=2.0), "clip"),
        (rnn_model("LSTM", input_forget=1), "input_forget"),
        (rnn_model("LSTM", activations=["Sigmoid", "Relu", "Relu"]), "activations"),
    ):
        assert any(reason in r for r in rc.qnn_refuses(model.graph.node[0]))
        unrolled, change = rc.unroll_recurrent_ops(model)
        assert change.changed and not any(
            n.op_type in rc.RECURRENT_OPS for n in unrolled.graph.node
        )


def test_default_activations_spelled_out_are_dropped() -> None:
    """Keras exports write activations = ["Sigmoid", "Tanh", "Tanh"], which the QNN EP refuses."""
    model = rnn_model(
        "LSTM", direction="bidirectional", activations=["Sigmoid", "Tanh", "Tanh"] * 2
    )
    assert rc.qnn_refuses(model.graph.node[0])
    normalized, change = rc.normalize_recurrent_ops(model)
    assert "dropped activations" in change.details[0]
    assert rc.qnn_refuses(normalized.graph.node[0]) == []
    feeds = random_feeds(model)
    for name, value in run(model, feeds).items():
        np.testing.assert_array_equal(run(normalized, feeds)[name], value)
    custom = rnn_model("GRU", activations=["Sigmoid", "Relu"])
    assert not rc.normalize_recurrent_ops(custom)[1].changed


def test_full_length_sequence_lens_is_dropped() -> None:
    model = rnn_model("GRU", steps=3, batch=2)
    model.graph.initializer.append(numpy_helper.from_array(np.array([3, 3], np.int32), "lens"))
    model.graph.node[0].input[4] = "lens"
    normalized, change = rc.normalize_recurrent_ops(model)
    assert change.changed and normalized.graph.node[0].input[4] == ""
    feeds = random_feeds(model)
    for name, value in run(model, feeds).items():
        np.testing.assert_allclose(run(normalized, feeds)[name], value, atol=1e-6)
    shorter = rnn_model("GRU", steps=3, batch=2)
    shorter.graph.initializer.append(numpy_helper.from_array(np.array([3, 2], np.int32), "lens"))
    shorter.graph.node[0].input[4] = "lens"
    assert not rc.normalize_recurrent_ops(shorter)[1].changed


def test_prepare_model_makes_a_keras_lstm_qnn_ready() -> None:
    """Through the whole preparation: same function, and no LSTM left that QNN would refuse."""
    model = rnn_model("LSTM", steps=1, batch=1, activations=["Sigmoid", "Tanh", "Tanh"])
    ready, _ = prepare_model(model, InputsSection(dims={}, shapes={}, constants={}))
    assert all(not rc.qnn_refuses(n) for n in ready.graph.node if n.op_type in rc.RECURRENT_OPS)
    feeds = random_feeds(model)
    for name, value in run(model, feeds).items():
        np.testing.assert_allclose(run(ready, feeds)[name], value, atol=1e-6)


# -- rank > 5 -------------------------------------------------------------------------------------


def single(
    nodes: list[onnx.NodeProto], x_shape: list[int], inits: list[TensorProto], y_shape: list[int]
) -> onnx.ModelProto:
    graph = oh.make_graph(
        nodes,
        "g",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
        inits,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def max_rank(model: onnx.ModelProto) -> int:
    values = edit.inferred_values(model)
    produced = [o for n in model.graph.node for o in n.output]
    return max(len(edit.value_shape(values[name]) or ()) for name in produced)


def test_unfold_as_gather_drops_to_rank_5() -> None:
    """nn.Unfold(kernel (1, 3)) as exported by torch: Gather by a [3, W] window table gives
    rank 6, Transpose, Reshape to [1, C*3, 1, W] (GTCRN's subband feature extraction)."""
    width = 9
    table = np.array([np.arange(width) + k for k in range(3)], np.int64)
    nodes = [
        oh.make_node("Gather", ["x", "table"], ["g"], axis=4),
        oh.make_node("Transpose", ["g"], ["tr"], perm=[0, 1, 2, 4, 3, 5]),
        oh.make_node("Reshape", ["tr", "shape"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(table, "table"),
        numpy_helper.from_array(np.array([1, 9, 1, width], np.int64), "shape"),
    ]
    model = single(nodes, [1, 3, 1, 1, width + 2], inits, [1, 9, 1, width])
    assert max_rank(model) == 6
    lowered, change = rc.lower_high_rank(model)
    assert change.changed
    assert max_rank(lowered) <= rc.MAX_RANK
    feeds = random_feeds(model)
    np.testing.assert_array_equal(run(lowered, feeds)["y"], run(model, feeds)["y"])


def test_rank_6_transpose_with_a_real_permutation() -> None:
    """A pixel-shuffle style [1, C, r, r, H, W] permutation: merged/unit axes leave rank 4."""
    nodes = [
        oh.make_node("Reshape", ["x", "six"], ["r6"]),
        oh.make_node("Transpose", ["r6"], ["t6"], perm=[0, 1, 4, 2, 5, 3]),
        oh.make_node("Reshape", ["t6", "out"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(np.array([1, 3, 2, 2, 4, 5], np.int64), "six"),
        numpy_helper.from_array(np.array([1, 3, 8, 10], np.int64), "out"),
    ]
    model = single(nodes, [1, 12, 4, 5], inits, [1, 3, 8, 10])
    lowered, change = rc.lower_high_rank(model)
    assert change.changed
    assert max_rank(lowered) <= rc.MAX_RANK
    feeds = random_feeds(model)
    np.testing.assert_array_equal(run(lowered, feeds)["y"], run(model, feeds)["y"])


def correlation_volume(scale_shape: tuple[int, ...] = ()) -> onnx.ModelProto:
    """RAFT's CorrBlock (torchvision): MatMul of two feature maps, a view to rank 6
    [1, h, w, 1, h, w], a Div by sqrt(C), a view back to [h * w, 1, h, w]."""
    nodes = [
        oh.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
        oh.make_node("MatMul", ["xt", "x"], ["m"]),
        oh.make_node("Reshape", ["m", "six"], ["r6"]),
        oh.make_node("Div", ["r6", "root"], ["d"]),
        oh.make_node("Reshape", ["d", "four"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(np.array([1, 4, 4, 1, 4, 4], np.int64), "six"),
        numpy_helper.from_array(np.array([16, 1, 4, 4], np.int64), "four"),
        numpy_helper.from_array(np.full(scale_shape, np.sqrt(8), np.float32), "root"),
    ]
    return single(nodes, [1, 8, 16], inits, [16, 1, 4, 4])


def test_an_elementwise_op_on_a_rank_6_view_moves_before_it() -> None:
    model = correlation_volume()
    assert max_rank(model) == 6
    lowered, change = rc.lower_high_rank(model)
    assert change.changed and "before its rank-6+ Reshape" in change.details[0]
    assert max_rank(lowered) <= rc.MAX_RANK
    feeds = random_feeds(model)  # the same Div; onnxruntime's kernels differ by an ulp
    np.testing.assert_allclose(run(lowered, feeds)["y"], run(model, feeds)["y"], rtol=1e-6)
    # A rank-6 constant of one value would broadcast the moved op back to rank 6: kept.
    assert not rc.lower_high_rank(correlation_volume((1, 1, 1, 1, 1, 1)))[1].changed


def stacked_cells(slices: int = 5) -> onnx.ModelProto:
    """XFeat's keypoint head: [1, 1, 4, 8*slices, 8] cut into 8-wide slices along axis 3,
    each unsqueezed at 3 and stacked there into rank 6, reshaped to [1, 1, 4, slices, 64]."""
    axis = numpy_helper.from_array(np.array([3], np.int64), "axis")
    split = numpy_helper.from_array(np.full(slices, 8, np.int64), "split")
    parts = [f"p{k}" for k in range(slices)]
    nodes = [oh.make_node("Split", ["x", "split"], parts, axis=3)]
    nodes += [oh.make_node("Unsqueeze", [p, "axis"], [f"u{k}"]) for k, p in enumerate(parts)]
    nodes += [
        oh.make_node("Concat", [f"u{k}" for k in range(slices)], ["stack"], axis=3),
        oh.make_node("Reshape", ["stack", "cells"], ["y"]),
    ]
    inits = [axis, split, numpy_helper.from_array(np.array([1, 1, 4, slices, 64]), "cells")]
    return single(nodes, [1, 1, 4, 8 * slices, 8], inits, [1, 1, 4, slices, 64])


def test_a_rank_6_stack_becomes_a_concat_of_its_slices() -> None:
    model = stacked_cells()
    assert max_rank(model) == 6
    lowered, change = rc.lower_high_rank(model)
    assert change.changed and "stack of 5 at axis 3" in change.details[0]
    assert max_rank(lowered) <= rc.MAX_RANK
    assert "Unsqueeze" not in [n.op_type for n in lowered.graph.node]
    feeds = random_feeds(model)
    np.testing.assert_array_equal(run(lowered, feeds)["y"], run(model, feeds)["y"])


def test_reduced_transpose() -> None:
    assert rc._reduced_transpose((1, 3, 1, 1, 3, 129), [0, 1, 2, 4, 3, 5]) == ([1161], [0])
    assert rc._reduced_transpose((1, 3, 2, 2, 4, 5), [0, 1, 4, 2, 5, 3]) == (
        [3, 2, 2, 4, 5],
        [0, 3, 1, 4, 2],
    )
    assert rc._reduced_transpose((2, 3), [1, 0]) is None


# -- ConvTranspose dilations -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dilations", "group", "strides", "pads"),
    [
        ([5, 1], 4, [1, 1], [5, 1, 5, 1]),
        ([2, 3], 1, [2, 1], [1, 0, 2, 1]),
        ([2, 2], 2, [1, 2], [0, 0, 0, 0]),
    ],
)
def test_dilated_conv_transpose_becomes_a_dilated_kernel(
    dilations: list[int], group: int, strides: list[int], pads: list[int]
) -> None:
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((4, 6 // group if group > 1 else 3, 3, 3)).astype(np.float32)
    bias = rng.standard_normal(weight.shape[1] * group).astype(np.float32)
    node = oh.make_node(
        "ConvTranspose",
        ["x", "w", "b"],
        ["y"],
        dilations=dilations,
        group=group,
        strides=strides,
        pads=pads,
        kernel_shape=[3, 3],
    )
    inits = [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b")]
    out = [
        s * (n - 1) + (3 - 1) * d + 1 - pads[i] - pads[i + 2]
        for i, (s, n, d) in enumerate(zip(strides, (7, 6), dilations, strict=True))
    ]
    model = single([node], [1, 4, 7, 6], inits, [1, weight.shape[1] * group, *out])
    rewritten, change = rc.dilate_conv_transpose(model)
    attrs = {a.name: oh.get_attribute_value(a) for a in rewritten.graph.node[0].attribute}
    assert change.changed and "dilations" not in attrs
    feeds = random_feeds(model)
    np.testing.assert_allclose(run(rewritten, feeds)["y"], run(model, feeds)["y"], atol=1e-5)


def conv_transpose_with_output_padding(
    group: int, kernel: int, pads: list[int], extra: list[int], channels: int = 4
) -> onnx.ModelProto:
    """A stride-2 ConvTranspose with output_padding, as PyTorch exports a 2x upsampler."""
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((channels, channels // group, kernel, kernel)).astype(np.float32)
    bias = rng.standard_normal(channels).astype(np.float32)
    node = oh.make_node(
        "ConvTranspose",
        ["x", "w", "b"],
        ["y"],
        group=group,
        strides=[2, 2],
        pads=pads,
        output_padding=extra,
    )
    out = [2 * (n - 1) + kernel - pads[i] - pads[i + 2] + extra[i] for i, n in enumerate((7, 6))]
    inits = [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b")]
    return single([node], [1, channels, 7, 6], inits, [1, channels, *out])


@pytest.mark.parametrize(
    ("group", "kernel", "pads", "extra"),
    [(4, 3, [1, 1, 1, 1], [1, 1]), (1, 3, [1, 1, 1, 1], [1, 0]), (2, 5, [2, 2, 3, 1], [1, 1])],
)
def test_output_padding_becomes_a_smaller_end_pad(
    group: int, kernel: int, pads: list[int], extra: list[int]
) -> None:
    model = conv_transpose_with_output_padding(group, kernel, pads, extra)
    rewritten, change = rc.output_padding_to_pads(model)
    attrs = {a.name: oh.get_attribute_value(a) for a in rewritten.graph.node[0].attribute}
    assert change.changed and "output_padding" not in attrs
    assert attrs["pads"] == pads[:2] + [p - e for p, e in zip(pads[2:], extra, strict=True)]
    feeds = random_feeds(model)
    np.testing.assert_array_equal(run(rewritten, feeds)["y"], run(model, feeds)["y"])
    prepared = prepare_model(model, InputsSection())[0]
    assert not any(a.name == "output_padding" for n in prepared.graph.node for a in n.attribute)


def test_output_padding_past_the_full_result_is_kept() -> None:
    """With no end pad to lower, the extra row holds only the bias: no pad can say that."""
    model = conv_transpose_with_output_padding(4, 3, [0, 0, 0, 0], [1, 1])
    assert not rc.output_padding_to_pads(model)[1].changed


@pytest.mark.qnn
def test_the_htp_computes_a_depthwise_conv_transpose_without_output_padding(tmp_path) -> None:
    """The HTP's depthwise ConvTranspose with output_padding is wrong (fp16, whole model on the
    simulator: about 0 dB); with the end pads lowered instead it is right."""
    from pipeline.htp.probe import probe

    model = conv_transpose_with_output_padding(8, 3, [1, 1, 1, 1], [1, 1], channels=8)
    feeds = random_feeds(model)
    np.savez(tmp_path / "sample.npz", **feeds)
    results = {}
    for name, candidate in (("as is", model), ("lowered", rc.output_padding_to_pads(model)[0])):
        path = tmp_path / f"{name.replace(' ', '_')}.onnx"
        onnx.save(candidate, str(path))
        result = probe(path, path, [tmp_path / "sample.npz"], tmp_path / path.stem, 60, 73)
        assert result.ok, result.error
        assert result.partitions == 1 and result.cpu_nodes == 0
        results[name] = result.worst_ctx_vs_float
    assert results["lowered"] > 50.0, results
    # If a new QNN SDK gets output_padding right, this says so: the rewrite is then only exact.
    assert results["as is"] < 10.0, results


# -- hypot with a floor under the root ------------------------------------------------------------


def test_hypot_with_a_tiny_constant_under_the_root() -> None:
    """sqrt(re^2 + im^2 + 1e-12) (GTCRN's |STFT|) gets the hypot form too."""
    graph = oh.make_graph(
        [
            oh.make_node("Mul", ["a", "a"], ["a2"]),
            oh.make_node("Mul", ["b", "b"], ["b2"]),
            oh.make_node("Add", ["a2", "b2"], ["s"]),
            oh.make_node("Add", ["s", "eps"], ["se"]),
            oh.make_node("Sqrt", ["se"], ["y"]),
        ],
        "g",
        [oh.make_tensor_value_info(n, TensorProto.FLOAT, [2, 64]) for n in ("a", "b")],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])],
        [numpy_helper.from_array(np.array(1e-12, np.float32), "eps")],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)])
    model.ir_version = 10
    rewritten, change = t.rewrite_hypot(model)
    assert change.changed
    assert "Sqrt" in [n.op_type for n in rewritten.graph.node]
    feeds = random_feeds(model)
    feeds["a"][0, :8] = 0.0
    feeds["b"][0, :4] = 0.0
    np.testing.assert_allclose(run(rewritten, feeds)["y"], run(model, feeds)["y"], atol=2e-6)
    big = onnx.ModelProto()
    big.CopyFrom(model)
    big.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.array(0.01, np.float32), "eps"))
    assert not t.rewrite_hypot(big)[1].changed  # not negligible: keep the function


def test_grouped_conv_transpose_weight_stays_per_tensor(tmp_path) -> None:
    """onnxruntime cannot quantize a grouped ConvTranspose's bias against per-channel weight
    scales ([C_in, C_out / group] gives C_out / group scales for C_out biases): such a weight
    asked for int8 per channel (the HTP judge's remedy) gets one symmetric scale instead."""
    from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize_static

    from pipeline.quantize.quantizer import _tensor_overrides, per_channel_weights

    rng = np.random.default_rng(2)
    node = oh.make_node("ConvTranspose", ["x", "w", "b"], ["y"], group=2, kernel_shape=[3, 3])
    inits = [
        numpy_helper.from_array(rng.standard_normal((4, 4, 3, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b"),
    ]
    model = single([node], [1, 4, 5, 5], inits, [1, 8, 7, 7])
    overrides = _tensor_overrides(model, {"w": "int8_per_channel"}, {})
    assert overrides.tensors["w"] == [{"quant_type": QuantType.QInt8, "symmetric": True}]
    # ... and the default per-channel layout (quantization.per_channel) leaves it out.
    assert per_channel_weights(model) == {}
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.left = [random_feeds(model, seed) for seed in range(2)]

        def get_next(self) -> dict[str, np.ndarray] | None:
            return self.left.pop() if self.left else None

    quantize_static(
        str(path),
        str(tmp_path / "q.onnx"),
        Reader(),
        activation_type=QuantType.QUInt16,
        weight_type=QuantType.QInt8,
        per_channel=True,
        extra_options={"TensorQuantOverrides": overrides.tensors},
    )


# -- loops with a trip count the shapes decide ----------------------------------------------------


def while_loop_rnn(steps: int | str = "T", *, data_dependent: bool = False) -> onnx.ModelProto:
    """A TensorFlow while loop as tf2onnx writes a Keras RNN: no trip count, a condition
    ``time < length`` (the length from the input's Shape), the time as a carried counter, the
    step's input read with Gather, weights from the outer scope, the outputs as a scan output.
    ``data_dependent`` stops instead when the state's sum passes a threshold."""
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w")
    u = numpy_helper.from_array(0.5 * rng.standard_normal((3, 3)).astype(np.float32), "u")
    one = numpy_helper.from_array(np.array(1, np.int64), "one")
    axis1 = numpy_helper.from_array(np.array([1], np.int64), "axis1")
    end2 = numpy_helper.from_array(np.array([2], np.int64), "end2")
    time_major = oh.make_node("Transpose", ["x"], ["x_t"], perm=[1, 0, 2])  # [T, 1, 4]
    body_nodes = [
        oh.make_node("Gather", ["x_t", "time_in"], ["x_step"], axis=0),
        oh.make_node("MatMul", ["x_step", "w"], ["xw"]),
        oh.make_node("MatMul", ["h_in", "u"], ["hu"]),
        oh.make_node("Add", ["xw", "hu"], ["pre"]),
        oh.make_node("Tanh", ["pre"], ["h_out"]),
        oh.make_node("Add", ["time_in", "step_one"], ["time_out"]),
        oh.make_node("Identity", ["h_out"], ["h_scan"]),
    ]
    if data_dependent:
        body_nodes += [
            oh.make_node("ReduceSum", ["h_out"], ["total"], keepdims=0),
            oh.make_node("Less", ["total", "limit"], ["cond_out"]),
        ]
        limit = [numpy_helper.from_array(np.array(0.5, np.float32), "limit")]
    else:
        body_nodes += [
            oh.make_node("Cast", ["time_out"], ["time_f"], to=TensorProto.INT32),
            oh.make_node("Cast", ["length_in"], ["length_f"], to=TensorProto.INT32),
            oh.make_node("Less", ["time_f", "length_f"], ["cond_out"]),
        ]
        limit = []
    scalar = oh.make_tensor_value_info
    body = oh.make_graph(
        body_nodes,
        "body",
        [
            scalar("i", TensorProto.INT64, []),
            scalar("cond_in", TensorProto.BOOL, []),
            scalar("time_in", TensorProto.INT64, []),
            scalar("h_in", TensorProto.FLOAT, [1, 3]),
            scalar("length_in", TensorProto.INT64, []),
        ],
        [
            scalar("cond_out", TensorProto.BOOL, []),
            scalar("time_out", TensorProto.INT64, []),
            scalar("h_out", TensorProto.FLOAT, [1, 3]),
            scalar("length_in", TensorProto.INT64, []),
            scalar("h_scan", TensorProto.FLOAT, [1, 3]),
        ],
        [numpy_helper.from_array(np.array(1, np.int64), "step_one"), *limit],
    )
    nodes = [
        time_major,
        oh.make_node("Shape", ["x"], ["x_shape"]),
        oh.make_node("Slice", ["x_shape", "axis1", "end2"], ["length_1"]),
        oh.make_node("Squeeze", ["length_1"], ["length"]),
        oh.make_node("Less", ["zero_time", "length"], ["go"]),
        oh.make_node(
            "Loop",
            ["", "go", "zero_time", "h0", "length"],
            ["time_end", "h_end", "length_end", "hs"],
            body=body,
        ),
        oh.make_node("Transpose", ["hs"], ["y"], perm=[1, 0, 2]),  # [1, T, 3]
    ]
    graph = oh.make_graph(
        nodes,
        "while_rnn",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, steps, 4])],
        [
            oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, steps, 3]),
            oh.make_tensor_value_info("h_end", TensorProto.FLOAT, [1, 3]),
        ],
        [
            w,
            u,
            one,
            axis1,
            end2,
            numpy_helper.from_array(np.array(0, np.int64), "zero_time"),
            numpy_helper.from_array(np.zeros((1, 3), np.float32), "h0"),
        ],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_a_while_loop_unrolls_once_the_length_is_fixed() -> None:
    """Fixed to 6 steps, the loop's condition folds iteration by iteration: 6 copies of the
    body, no Loop left, every shape static, and the same outputs as onnxruntime's Loop."""
    model = while_loop_rnn()
    ready, changes = prepare_model(
        model, InputsSection(dims={}, shapes={"x": [1, 6, 4]}, constants={})
    )
    assert not [n for n in ready.graph.node if n.op_type == "Loop"]
    assert not edit.dynamic_outputs(ready)
    unrolled = next(c for c in changes if c.step == "unroll_static_loops")
    assert any("6 iterations" in d for d in unrolled.details), unrolled.details
    feeds = random_feeds(ready, seed=1)
    expected = run(model, feeds)
    for name, value in run(ready, feeds).items():
        np.testing.assert_allclose(value, expected[name], atol=ATOL)


def test_a_loop_with_a_trip_count_unrolls_and_stacks_its_scan_outputs() -> None:
    """A Loop given a constant trip count (as PyTorch scripts write ``for t in range(n)``)."""
    model = while_loop_rnn(5)
    loop = next(n for n in model.graph.node if n.op_type == "Loop")
    loop.input[0] = "trips"
    loop.input[1] = ""  # no condition: the trip count alone decides
    model.graph.initializer.append(numpy_helper.from_array(np.array(3, np.int64), "trips"))
    model.graph.output[0].type.tensor_type.shape.dim[1].dim_value = 3
    unrolled, change = rc.unroll_static_loops(model)
    assert any("3 iterations" in d for d in change.details), change.details
    assert not [n for n in unrolled.graph.node if n.op_type == "Loop"]
    feeds = random_feeds(unrolled, seed=2)
    expected = run(model, feeds)
    for name, value in run(unrolled, feeds).items():
        assert value.shape == expected[name].shape
        np.testing.assert_allclose(value, expected[name], atol=ATOL)


def test_a_loop_the_data_stops_is_kept_and_named() -> None:
    """When the condition reads the data, no number of copies is right: the loop stays, and the
    step says why (preparation then fails naming it, as before)."""
    model = t.fold_constants(while_loop_rnn(6, data_dependent=True))[0]
    kept, change = rc.unroll_static_loops(model)
    assert [n.op_type for n in kept.graph.node].count("Loop") == 1
    assert any("depends on the data" in d for d in change.details), change.details


def test_a_loop_too_big_to_unroll_is_kept_and_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model the unrolling would make too big to quantize and compile keeps its loop."""
    monkeypatch.setattr(rc, "MAX_UNROLLED_NODES", 30)
    model = t.fold_constants(while_loop_rnn(6))[0]
    kept, change = rc.unroll_static_loops(model)
    assert [n.op_type for n in kept.graph.node].count("Loop") == 1
    assert any("would pass 30 nodes" in d for d in change.details), change.details


@pytest.mark.qnn
def test_the_unrolled_while_loop_runs_whole_on_the_htp(tmp_path) -> None:
    """What the unrolling is for: the QNN EP takes the copies, not the Loop."""
    from pipeline.htp.probe import probe

    model = while_loop_rnn()
    ready, _ = prepare_model(model, InputsSection(dims={}, shapes={"x": [1, 6, 4]}, constants={}))
    np.savez(tmp_path / "sample.npz", **random_feeds(ready, seed=4))
    path = tmp_path / "unrolled.onnx"
    onnx.save(ready, str(path))
    result = probe(path, path, [tmp_path / "sample.npz"], tmp_path / "probe", 60, 73)
    assert result.ok, result.error
    assert result.partitions == 1 and result.cpu_nodes == 0
    assert result.worst_ctx_vs_float > 40.0


def test_the_iterations_of_an_unrolled_loop_share_one_range() -> None:
    """Each copy of a body tensor gets the union of the copies' calibrated ranges (a time step
    calibration only saw padding at is quantized as the Loop's one body tensor was); copies of
    another loop's body (FreshNames' "_1") and other tensors keep theirs."""
    from pipeline.calibration.ranges import unrolled_loop_ranges

    calibrated = {
        "h__it0": (-1.0, 0.5),
        "h__it1": (-0.2, 2.0),
        "h__it2": (0.0, 0.0),  # a step calibration only saw padding at
        "h__it0_1": (-5.0, 5.0),
        "h__it1_1": (-4.0, 6.0),
        "x": (0.0, 1.0),
    }
    ranges, shared = unrolled_loop_ranges(calibrated)
    assert shared == 5
    assert ranges["h__it0"] == ranges["h__it1"] == ranges["h__it2"] == (-1.0, 2.0)
    assert ranges["h__it0_1"] == ranges["h__it1_1"] == (-5.0, 6.0)
    assert ranges["x"] == (0.0, 1.0)


def leaky_integrator(gain: float) -> onnx.ModelProto:
    """state_out = 0.95 * state + gain * x; y = tanh(state_out): a streaming model whose error
    in its state compounds window after window when it is fed its own state."""
    nodes = [
        oh.make_node("Mul", ["state", "decay"], ["kept"]),
        oh.make_node("Mul", ["x", "gain"], ["added"]),
        oh.make_node("Add", ["kept", "added"], ["state_out"]),
        oh.make_node("Tanh", ["state_out"], ["y"]),
    ]
    graph = oh.make_graph(
        nodes,
        "integrator",
        [
            oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4]),
            oh.make_tensor_value_info("state", TensorProto.FLOAT, [1, 4]),
        ],
        [
            oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4]),
            oh.make_tensor_value_info("state_out", TensorProto.FLOAT, [1, 4]),
        ],
        [
            numpy_helper.from_array(np.array(0.95, np.float32), "decay"),
            numpy_helper.from_array(np.array(gain, np.float32), "gain"),
        ],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


def test_a_streaming_model_fed_its_own_state_is_measured_closed_loop(tmp_path) -> None:
    """Held-out windows carry the float model's state (as calibration.recurrent stores them);
    fed its own, a model 2% off in its input gain drifts: the closed loop's figure is far below
    the windows' own, and a run restarts where a stored state does not follow the window
    before (a new file's zeros, a tail's first window)."""
    from pipeline.core.layout import sample_name
    from pipeline.quantize.evaluate import carried_states, closed_loop, evaluate

    reference, test = tmp_path / "float.onnx", tmp_path / "test.onnx"
    onnx.save(leaky_integrator(0.1), str(reference))
    onnx.save(leaky_integrator(0.102), str(test))
    session = ort.InferenceSession(str(reference), providers=["CPUExecutionProvider"])
    heldout = tmp_path / "heldout"
    heldout.mkdir()
    rng = np.random.default_rng(4)
    index = 0
    for run in range(2):  # two streams, each from its own state
        state = np.full((1, 4), 0.5 * run, np.float32)
        for _ in range(40):
            x = (1.0 + rng.standard_normal((1, 4))).astype(np.float32)
            np.savez(heldout / sample_name(index), x=x, state=state)
            state = session.run(["state_out"], {"x": x, "state": state})[0]
            index += 1
    windows = evaluate(reference, test, heldout)
    loop = closed_loop(reference, test, heldout, {"state": "state_out"})
    assert set(loop) == {"y"}  # the state itself is not what an app reads
    assert loop["y"].snr_db < windows["y"].snr_db - 10.0, (loop, windows)
    # The run boundary: the second stream restarts from its stored state, not from the state
    # the test model carried to the end of the first (which gives another figure).
    tested = ort.InferenceSession(str(test), providers=["CPUExecutionProvider"])

    def by_hand(restart: bool) -> float:
        signal = noise = 0.0
        own = None
        for number in range(80):
            with np.load(heldout / sample_name(number)) as data:
                x, stored = data["x"], data["state"]
            want = session.run(["y"], {"x": x, "state": stored})[0]
            fed = stored if own is None or (restart and number == 40) else own
            got, own = tested.run(["y", "state_out"], {"x": x, "state": fed})
            signal += float(np.sum(want.astype(np.float64) ** 2))
            noise += float(np.sum((got.astype(np.float64) - want) ** 2))
        return 10 * np.log10(signal / noise)

    assert loop["y"].snr_db == pytest.approx(by_hand(restart=True), abs=1e-4)
    assert abs(by_hand(restart=False) - by_hand(restart=True)) > 0.1
    # Windows that never follow one another carry nothing: no closed-loop figure.
    assert closed_loop(reference, test, heldout, {"state": "y"}) == {}
    # Undeclared (a python reader carrying the state itself), the pair is found in the windows;
    # every other window alone (a reader yielding every k-th) follows nothing.
    assert carried_states(reference, heldout) == {"state": "state_out"}
    sparse = tmp_path / "sparse"
    sparse.mkdir()
    for k, number in enumerate(range(0, 80, 2)):
        (sparse / sample_name(k)).hardlink_to(heldout / sample_name(number))
    assert carried_states(reference, sparse) == {}
