"""pipeline.graph.contrib: onnxruntime's fused transformer ops as the standard ops they fuse.

onnxruntime's CPU kernels of the com.microsoft ops are the reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

from pipeline.core.errors import ModelError
from pipeline.graph.contrib import fused_cpu_ops, fused_transformer_ops, refuse_nchwc_layout

RNG = np.random.default_rng(8)
BATCH, SEQ, HIDDEN, HEADS, VOCAB = 2, 6, 8, 2, 20
MS = "com.microsoft"


def weight(name: str, *shape: int, scale: float = 0.3) -> onnx.TensorProto:
    return numpy_helper.from_array((RNG.standard_normal(shape) * scale).astype(np.float32), name)


def model(nodes: list[onnx.NodeProto], inputs: list, outputs: list, inits: list) -> onnx.ModelProto:
    graph = oh.make_graph(nodes, "fused", inputs, outputs, inits)
    imports = [oh.make_opsetid("", 21), oh.make_opsetid(MS, 1)]
    return oh.make_model(graph, opset_imports=imports, ir_version=10)


def encoder_layer(mask_form: str) -> onnx.ModelProto:
    """Token ids -> EmbedLayerNormalization -> Attention -> SkipLayerNormalization -> BiasGelu
    -> FastGelu -> QuickGelu -> y, as onnxruntime's optimizer writes a BERT layer.
    ``mask_form``: "embed" (the mask_index EmbedLayerNormalization computes from the 0/1 mask),
    "raw" (the [batch, seq] mask itself), "lengths" (valid tokens per row, a graph input),
    "summed" (those lengths summed from the mask, as the optimizer writes without an embedding
    layer norm: the mask itself is used)."""
    ints = TensorProto.INT32
    inputs = [
        oh.make_tensor_value_info("ids", ints, [BATCH, SEQ]),
        oh.make_tensor_value_info("segments", ints, [BATCH, SEQ]),
    ]
    mask_input = {"embed": "mask", "raw": "mask", "lengths": "lengths", "summed": "mask"}[mask_form]
    shape = [BATCH] if mask_form == "lengths" else [BATCH, SEQ]
    inputs.append(oh.make_tensor_value_info(mask_input, ints, shape))
    attention_mask = {"embed": "mask_index", "raw": "mask", "lengths": "lengths"}.get(
        mask_form, "summed_lengths"
    )
    summed = oh.make_node("ReduceSum", ["mask", "seq_axis"], ["summed_lengths"], keepdims=0)
    nodes = [summed] if mask_form == "summed" else []
    nodes += [
        oh.make_node(
            "EmbedLayerNormalization",
            ["ids", "segments", "words", "positions", "segment_table", "g0", "b0", "mask"]
            if mask_form == "embed"
            else ["ids", "segments", "words", "positions", "segment_table", "g0", "b0"],
            ["embedded", "mask_index"],
            domain=MS,
            epsilon=1e-12,
        ),
        oh.make_node(
            "Attention",
            ["embedded", "qkv_w", "qkv_b", attention_mask],
            ["attended"],
            domain=MS,
            num_heads=HEADS,
            mask_filter_value=-10000.0,
        ),
        oh.make_node(
            "SkipLayerNormalization",
            ["attended", "embedded", "g1", "b1", "skip_bias"],
            ["normed", "", "", "summed"],
            domain=MS,
            epsilon=1e-12,
        ),
        oh.make_node("BiasGelu", ["normed", "gelu_bias"], ["gelu"], domain=MS),
        oh.make_node("FastGelu", ["gelu", "gelu_bias"], ["fast"], domain=MS),
        oh.make_node("QuickGelu", ["fast"], ["quick"], domain=MS, alpha=1.702),
        oh.make_node("Add", ["quick", "summed"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(np.array([1], np.int64), "seq_axis"),
        weight("words", VOCAB, HIDDEN),
        weight("positions", 16, HIDDEN),
        weight("segment_table", 2, HIDDEN),
        weight("g0", HIDDEN, scale=1.0),
        weight("b0", HIDDEN),
        weight("qkv_w", HIDDEN, 3 * HIDDEN),
        weight("qkv_b", 3 * HIDDEN),
        weight("g1", HIDDEN, scale=1.0),
        weight("b1", HIDDEN),
        weight("skip_bias", HIDDEN),
        weight("gelu_bias", HIDDEN),
    ]
    out = [oh.make_tensor_value_info("y", TensorProto.FLOAT, [BATCH, SEQ, HIDDEN])]
    return model(nodes, inputs, out, inits)


def run(m: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        m.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    wanted = {i.name for i in session.get_inputs()}
    return session.run(None, {k: v for k, v in feeds.items() if k in wanted})[0]


@pytest.mark.parametrize("mask_form", ["embed", "raw", "lengths", "summed"])
def test_a_fused_encoder_layer_computes_the_same_in_standard_ops(mask_form: str) -> None:
    source = encoder_layer(mask_form)
    rewritten, change = fused_transformer_ops(source)
    assert change.changed and len(change.details) == 6, change.details
    assert all(n.domain in ("", "ai.onnx") for n in rewritten.graph.node)
    ops = {n.op_type for n in rewritten.graph.node}
    assert ("Range" in ops) == (mask_form == "lengths")  # else the 0/1 mask is used as it is
    onnx.checker.check_model(rewritten)
    lengths = np.array([SEQ, 3], np.int32)  # the second row padded on the right
    mask = (np.arange(SEQ)[None, :] < lengths[:, None]).astype(np.int32)
    feeds = {
        "ids": RNG.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32),
        "segments": RNG.integers(0, 2, (BATCH, SEQ)).astype(np.int32),
        "mask": mask,
        "lengths": lengths,
    }
    want, got = run(source, feeds), run(rewritten, feeds)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_bias_add_is_two_adds() -> None:
    """BiasAdd has no CPU kernel in onnxruntime (CUDA only): numpy is the reference."""
    x = oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, SEQ, HIDDEN])
    skip = oh.make_tensor_value_info("skip", TensorProto.FLOAT, [1, SEQ, HIDDEN])
    y = oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, SEQ, HIDDEN])
    node = oh.make_node("BiasAdd", ["x", "bias", "skip"], ["y"], domain=MS)
    bias = weight("bias", HIDDEN)
    rewritten, change = fused_transformer_ops(model([node], [x, skip], [y], [bias]))
    assert change.changed and {n.op_type for n in rewritten.graph.node} == {"Add"}
    feeds = {n: RNG.standard_normal((1, SEQ, HIDDEN)).astype(np.float32) for n in ("x", "skip")}
    want = feeds["x"] + numpy_helper.to_array(bias) + feeds["skip"]
    np.testing.assert_allclose(run(rewritten, feeds), want, rtol=1e-6)


def test_forms_not_written_here_are_left_alone() -> None:
    """Past state, a causal Attention: unchanged (the build then says what is unsupported)."""
    x = oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, SEQ, HIDDEN])
    y = oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, SEQ, HIDDEN])
    inits = [weight("qkv_w", HIDDEN, 3 * HIDDEN), weight("qkv_b", 3 * HIDDEN)]
    causal = oh.make_node(
        "Attention", ["x", "qkv_w", "qkv_b"], ["y"], domain=MS, num_heads=HEADS, unidirectional=1
    )
    same, change = fused_transformer_ops(model([causal], [x], [y], inits))
    assert not change.changed and same.graph.node[0].op_type == "Attention"


@pytest.mark.qnn
def test_the_htp_runs_the_written_ops_whole_quantized(tmp_path: Path) -> None:
    """Attention, SkipLayerNormalization and BiasGelu over float activations, quantized and
    compiled by the real stages: whole on the HTP (the fused ops have no QNN kernel, and no
    static shape for the build before)."""
    from compile_fixtures import build_whole_on_htp

    x = oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, SEQ, HIDDEN])
    y = oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, SEQ, HIDDEN])
    nodes = [
        oh.make_node("Attention", ["x", "qkv_w", "qkv_b"], ["a"], domain=MS, num_heads=HEADS),
        oh.make_node(
            "SkipLayerNormalization", ["a", "x", "g", "b", "bias"], ["n"], domain=MS, epsilon=1e-6
        ),
        oh.make_node("BiasGelu", ["n", "bias"], ["y"], domain=MS),
    ]
    inits = [
        weight("qkv_w", HIDDEN, 3 * HIDDEN),
        weight("qkv_b", 3 * HIDDEN),
        weight("g", HIDDEN, scale=1.0),
        weight("b", HIDDEN),
        weight("bias", HIDDEN),
    ]
    build_whole_on_htp(tmp_path, "fused", model(nodes, [x], [y], inits))


def test_a_residual_rms_norm_computes_the_same() -> None:
    """SkipSimplifiedLayerNormalization (T5's residual RMSNorm as onnxruntime's optimizer writes
    it), its sum output used too, against onnxruntime's kernel."""
    x = oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, SEQ, HIDDEN])
    skip = oh.make_tensor_value_info("skip", TensorProto.FLOAT, [1, SEQ, HIDDEN])
    y = oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, SEQ, HIDDEN])
    nodes = [
        oh.make_node(
            "SkipSimplifiedLayerNormalization",
            ["x", "skip", "g", "bias"],
            ["n", "", "", "s"],
            domain=MS,
            epsilon=1e-6,
        ),
        oh.make_node("Add", ["n", "s"], ["y"]),
    ]
    inits = [weight("g", HIDDEN, scale=1.0), weight("bias", HIDDEN)]
    source = model(nodes, [x, skip], [y], inits)
    rewritten, change = fused_transformer_ops(source)
    assert len(change.details) == 1 and all(n.domain == "" for n in rewritten.graph.node)
    feeds = {n: RNG.standard_normal((1, SEQ, HIDDEN)).astype(np.float32) for n in ("x", "skip")}
    np.testing.assert_allclose(run(rewritten, feeds), run(source, feeds), rtol=1e-5, atol=1e-5)


# -- onnxruntime's CPU fusions, saved into a model ------------------------------------------------


def small_cnn() -> onnx.ModelProto:
    """Conv+Relu, Conv + residual Add + Relu, Conv + LeakyRelu, Conv + Clip, Conv +
    HardSigmoid, Conv + Sigmoid, then Gemm + Relu and a MatMul of a transposed operand scaled:
    what onnxruntime's CPU fusions write as FusedConv, FusedGemm and FusedMatMul."""
    c = 8
    nodes = [oh.make_node("Conv", ["x", "w0", "b0"], ["c0"], pads=[1] * 4)]
    nodes.append(oh.make_node("Relu", ["c0"], ["r0"]))
    nodes.append(oh.make_node("Conv", ["r0", "w1", "b1"], ["c1"], pads=[1] * 4))
    nodes.append(oh.make_node("Add", ["c1", "r0"], ["s1"]))
    nodes.append(oh.make_node("Relu", ["s1"], ["r1"]))
    last = "r1"
    for k, (op, attrs) in enumerate(
        [("LeakyRelu", {"alpha": 0.2}), ("Clip", {}), ("HardSigmoid", {"alpha": 0.25, "beta": 0.4}),
         ("Sigmoid", {})],
        start=2,
    ):  # fmt: skip
        nodes.append(oh.make_node("Conv", [last, f"w{k}", f"b{k}"], [f"c{k}"], pads=[1] * 4))
        extra = ["lo", "hi"] if op == "Clip" else []
        nodes.append(oh.make_node(op, [f"c{k}", *extra], [f"a{k}"], **attrs))
        last = f"a{k}"
    nodes += [
        oh.make_node("GlobalAveragePool", [last], ["g"]),
        oh.make_node("Flatten", ["g"], ["f"]),
        oh.make_node("Gemm", ["f", "gw", "gb"], ["h"], transB=1),
        oh.make_node("Relu", ["h"], ["hr"]),
        oh.make_node("Transpose", ["hr"], ["ht"], perm=[1, 0]),
        oh.make_node("MatMul", ["mw", "ht"], ["m"]),
        oh.make_node("Mul", ["m", "scale"], ["y"]),
    ]
    inits = [weight("w0", c, 3, 3, 3), weight("b0", c)]
    inits += [t for k in range(1, 6) for t in (weight(f"w{k}", c, c, 3, 3), weight(f"b{k}", c))]
    inits += [weight("gw", 6, c), weight("gb", 6), weight("mw", 4, 6)]
    inits += [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in
              (("lo", -0.5), ("hi", 0.8), ("scale", 0.5))]  # fmt: skip
    x = oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    y = oh.make_tensor_value_info("y", TensorProto.FLOAT, [4, 1])
    graph = oh.make_graph(nodes, "cnn", [x], [y], inits)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 13)], ir_version=8)


def saved_by_onnxruntime(source: onnx.ModelProto, level: object, path: Path) -> onnx.ModelProto:
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    options.optimized_model_filepath = str(path)
    ort.InferenceSession(source.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return onnx.load(str(path))


def test_a_model_saved_with_onnxruntimes_cpu_fusions_is_written_back(tmp_path: Path) -> None:
    """onnxruntime at its 'extended' level writes FusedConv (with a residual sum and each
    activation), FusedGemm and FusedMatMul, which ONNX shape inference knows nothing of: each
    is written back as the standard ops, computing what onnxruntime's fused kernels compute."""
    source = small_cnn()
    fused = saved_by_onnxruntime(
        source, ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED, tmp_path / "ext.onnx"
    )
    kinds = {n.op_type for n in fused.graph.node if n.domain == MS}
    assert {"FusedConv", "FusedGemm", "FusedMatMul"} <= kinds, kinds
    rewritten, change = fused_cpu_ops(fused)
    assert change.changed and all(n.domain in ("", "ai.onnx") for n in rewritten.graph.node)
    onnx.checker.check_model(rewritten)
    feeds = {"x": RNG.standard_normal((1, 3, 8, 8)).astype(np.float32)}
    np.testing.assert_allclose(run(rewritten, feeds), run(fused, feeds), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(run(rewritten, feeds), run(source, feeds), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("activation", "attrs"),
    [("LeakyRelu", {"activation_alpha": 0.3}),
     ("HardSigmoid", {"activation_alpha": 0.25, "activation_beta": 0.6}), ("Sigmoid", {})],
)  # fmt: skip
def test_a_fused_gemm_keeps_its_activations_own_attributes(
    activation: str, attrs: dict[str, float]
) -> None:
    """FusedGemm carries the activation's attributes as activation_<name> (onnxruntime's
    kernel requires them all; the rule reads them, not the op's defaults)."""
    x = oh.make_tensor_value_info("x", TensorProto.FLOAT, [2, HIDDEN])
    y = oh.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    fused = oh.make_node(
        "FusedGemm", ["x", "gw", "gb"], ["y"], domain=MS, transB=1, activation=activation,
        **attrs,
    )  # fmt: skip
    source = model([fused], [x], [y], [weight("gw", 4, HIDDEN, scale=3.0), weight("gb", 4)])
    rewritten, change = fused_cpu_ops(source)
    assert change.changed and all(n.domain == "" for n in rewritten.graph.node)
    feeds = {"x": RNG.standard_normal((2, HIDDEN)).astype(np.float32)}
    np.testing.assert_allclose(run(rewritten, feeds), run(source, feeds), rtol=1e-6, atol=1e-7)


def test_a_model_saved_in_onnxruntimes_nchwc_layout_is_refused(tmp_path: Path) -> None:
    """At the 'all' level onnxruntime writes its channel-blocked x86 layout (where the CPU has
    it): refused with the fix, not left to fail at "no static shape"."""
    saved = saved_by_onnxruntime(
        small_cnn(), ort.GraphOptimizationLevel.ORT_ENABLE_ALL, tmp_path / "all.onnx"
    )
    if not any(n.domain == "com.microsoft.nchwc" for n in saved.graph.node):
        pytest.skip("onnxruntime writes no NCHWc layout on this CPU")
    with pytest.raises(ModelError, match=r"com\.microsoft\.nchwc") as error:
        refuse_nchwc_layout(saved)
    assert "ORT_ENABLE_EXTENDED" in error.value.tip
    assert not refuse_nchwc_layout(small_cnn())[1].changed


@pytest.mark.parametrize(
    ("op", "opset"),
    [("LayerNormalization", 11), ("SimplifiedLayerNormalization", 11),
     ("SimplifiedLayerNormalization", 18)],
)  # fmt: skip
def test_onnxruntimes_own_norms_in_the_onnx_domain_load_and_compute_the_same(
    op: str, opset: int, tmp_path: Path
) -> None:
    """onnxruntime saves its LayerNormalization fusion at the model's opset (11 here, where ONNX
    has no LayerNormalization) and its RMSNorm as SimplifiedLayerNormalization, both in the ONNX
    domain: the checker refused such a model at load. Written out, it loads and computes what
    onnxruntime's kernels compute on the file as it is."""
    from pipeline.quantize.build import load_source_model

    inputs = ["x", "gamma"] + (["beta"] if op == "LayerNormalization" else [])
    nodes = [
        oh.make_node("MatMul", ["x0", "w"], ["x"]),
        oh.make_node(op, inputs, ["n"], axis=-1, epsilon=1e-5),
        oh.make_node("MatMul", ["n", "w2"], ["y"]),
    ]
    inits = [weight("w", HIDDEN, HIDDEN), weight("gamma", HIDDEN), weight("beta", HIDDEN)]
    inits.append(weight("w2", HIDDEN, 4))
    graph = oh.make_graph(
        nodes,
        "norm",
        [oh.make_tensor_value_info("x0", TensorProto.FLOAT, [1, SEQ, HIDDEN])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, SEQ, 4])],
        inits,
    )
    saved = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)], ir_version=8)
    path = tmp_path / "norm.onnx"
    onnx.save(saved, str(path))
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(saved)
    loaded = load_source_model(path)
    assert op not in {n.op_type for n in loaded.graph.node}
    feeds = {"x0": (RNG.standard_normal((1, SEQ, HIDDEN)) * 3 + 1).astype(np.float32)}
    np.testing.assert_allclose(run(loaded, feeds), run(saved, feeds), rtol=1e-4, atol=1e-5)


def test_a_fused_conv_inside_an_if_branch_is_written_back() -> None:
    """onnxruntime optimizes If/Loop bodies too (a VAD whose branches later steps lift into the
    main graph): the rules apply there, their constants in the main graph."""
    x = oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 6, 6])
    y = oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 6])
    branch_out = oh.make_tensor_value_info("b", TensorProto.FLOAT, [1, 4, 6, 6])
    fused = oh.make_node(
        "FusedConv", ["x", "w", "bias"], ["b"], domain=MS, pads=[1] * 4,
        activation="Clip", activation_params=[-0.3, 0.4],
    )  # fmt: skip
    then_branch = oh.make_graph([fused], "then", [], [branch_out])
    else_branch = oh.make_graph(
        [oh.make_node("Conv", ["x", "w", "bias"], ["b"], pads=[1] * 4)], "else", [], [branch_out]
    )
    node = oh.make_node("If", ["cond"], ["y"], then_branch=then_branch, else_branch=else_branch)
    inits = [weight("w", 4, 2, 3, 3), weight("bias", 4)]
    inits.append(numpy_helper.from_array(np.array(True), "cond"))
    source = model([node], [x], [y], inits)
    rewritten, change = fused_cpu_ops(source)
    assert change.changed and "(in then)" in change.details[0], change.details
    inner = rewritten.graph.node[0].attribute
    assert all(n.domain == "" for a in inner if a.name == "then_branch" for n in a.g.node)
    feeds = {"x": RNG.standard_normal((1, 2, 6, 6)).astype(np.float32)}
    np.testing.assert_allclose(run(rewritten, feeds), run(source, feeds), rtol=1e-6, atol=1e-7)
