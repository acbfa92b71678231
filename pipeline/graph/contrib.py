"""onnxruntime's fused transformer ops (com.microsoft) written as the standard ops they fuse.

onnxruntime's transformer optimizer (``onnxruntime.transformers.optimizer``, and Optimum's
ORTOptimizer) rewrites a BERT-style encoder into EmbedLayerNormalization, Attention,
SkipLayerNormalization and BiasGelu/FastGelu (and a T5-style one's residual RMSNorms into
SkipSimplifiedLayerNormalization): models published "optimized for onnxruntime". ONNX
shape inference knows none of them (the build stopped at "no static shape"), and the QNN EP runs
none. Each is written back as the ops an exporter writes, in the forms the rest of preparation
and the attention rules know (a Hugging Face mask bias, scores divided by sqrt(d)), with the
same function (onnxruntime's CPU kernels are the reference in the tests). A form outside what
is written here (past state, a causal or 3D/4D mask, rotary embeddings) is left as it is.

A model saved by onnxruntime after its CPU graph optimizations (``optimized_model_filepath``,
``onnxruntime.tools.optimize_onnx_model``) holds its CPU EP's fused ops instead: FusedConv (a
Conv, a residual sum and an activation), FusedGemm, FusedMatMul (transposes and a scale). They
are written back likewise (``fused_cpu_ops``). At the 'all' level it also holds the
com.microsoft.nchwc ops, a blocked layout for the CPU it was saved on, which is refused with the
fix (``refuse_nchwc_layout``).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper

from ..core.errors import ModelError
from .edit import (
    Change,
    FreshNames,
    NodeRewrite,
    NodeRule,
    all_graphs,
    attribute,
    copy_model,
    node_label,
    passed_on,
    replace_by_op,
    set_nodes,
    subgraphs,
)

Rewrite = tuple[list[onnx.NodeProto], str]
MS = "com.microsoft"


def _given(node: onnx.NodeProto, index: int) -> str:
    """Input ``index`` of ``node``, "" when absent."""
    return node.input[index] if len(node.input) > index else ""


def _used_outputs(node: onnx.NodeProto) -> list[int]:
    return [i for i, name in enumerate(node.output) if name]


def _skip_layer_norm(node: onnx.NodeProto, context: NodeRewrite) -> Rewrite | None:
    """SkipLayerNormalization(x, skip, gamma, beta, bias) -> LayerNormalization(x + skip +
    bias); its fourth output is that sum (the mean and inverse std outputs are not written)."""
    if any(i in (1, 2) for i in _used_outputs(node)):
        return None
    fresh = context.fresh
    out = node.output[0]
    total = fresh(f"{out}_sum")
    nodes = [helper.make_node("Add", [node.input[0], node.input[1]], [total])]
    bias = _given(node, 4)
    if bias:
        biased = fresh(f"{out}_biased")
        nodes.append(helper.make_node("Add", [total, bias], [biased]))
        total = biased
    if len(node.output) > 3 and node.output[3]:
        nodes.append(helper.make_node("Identity", [total], [node.output[3]]))
    beta = _given(node, 3)
    epsilon = float(attribute(node, "epsilon", 1e-12))
    norm_inputs = [total, node.input[2]] + ([beta] if beta else [])
    nodes.append(
        helper.make_node("LayerNormalization", norm_inputs, [out], axis=-1, epsilon=epsilon)
    )
    return nodes, f"{node_label(node)} -> Add + LayerNormalization"


def _simplified_layer_norm(node: onnx.NodeProto, context: NodeRewrite) -> Rewrite | None:
    """SkipSimplifiedLayerNormalization (RMSNorm after a residual: T5) over the last axis ->
    s / sqrt(mean(s^2) + eps) * gamma, s = input + skip (+ bias), its fourth output. (The
    plain SimplifiedLayerNormalization lives in the ONNX domain, where ONNX has no schema for
    it: ``onnx_domain_norms`` writes it out before the checker reads the model.)"""
    skip = node.op_type.startswith("Skip")
    if int(attribute(node, "axis", -1)) != -1 or any(
        i in ((1, 2) if skip else (1,)) for i in _used_outputs(node)
    ):
        return None
    fresh = context.fresh
    out = node.output[0]
    source = node.input[0]
    nodes: list[onnx.NodeProto] = []
    if skip:
        total = fresh(f"{out}_sum")
        nodes.append(helper.make_node("Add", [node.input[0], node.input[1]], [total]))
        if _given(node, 3):
            biased = fresh(f"{out}_biased")
            nodes.append(helper.make_node("Add", [total, node.input[3]], [biased]))
            total = biased
        if len(node.output) > 3 and node.output[3]:
            nodes.append(helper.make_node("Identity", [total], [node.output[3]]))
        source = total
    gamma = node.input[2] if skip else node.input[1]
    epsilon = float(attribute(node, "epsilon", 1e-6))
    square, mean, shifted, root, normed = (
        fresh(f"{out}_{s}") for s in ("square", "mean", "shifted", "rms", "normed")
    )
    axes = context.constant(np.array([-1], np.int64), f"{out}_axis")
    nodes += [
        helper.make_node("Mul", [source, source], [square]),
        helper.make_node("ReduceMean", [square, axes], [mean], keepdims=1),
        helper.make_node(
            "Add", [mean, context.constant(np.array(epsilon, np.float32), f"{out}_eps")], [shifted]
        ),
        helper.make_node("Sqrt", [shifted], [root]),
        helper.make_node("Div", [source, root], [normed]),
        helper.make_node("Mul", [normed, gamma], [out]),
    ]
    return nodes, f"{node_label(node)} -> x / sqrt(mean(x^2) + eps) * gamma"


def _bias_and_gelus(node: onnx.NodeProto, context: NodeRewrite) -> Rewrite | None:
    """BiasGelu(x, b) -> Gelu(x + b); FastGelu(x, b) -> Gelu(x + b, tanh); Gelu -> Gelu;
    QuickGelu(x) -> x * Sigmoid(alpha x); BiasAdd(x, b, skip) -> x + b + skip."""
    fresh = context.fresh
    out = node.output[0]
    op = node.op_type
    source = node.input[0]
    nodes: list[onnx.NodeProto] = []
    bias = _given(node, 1)
    if op in ("BiasGelu", "FastGelu", "BiasAdd") and bias:
        source, x = fresh(f"{out}_biased"), source
        nodes.append(helper.make_node("Add", [x, bias], [source]))
    if op == "BiasAdd":
        nodes.append(helper.make_node("Add", [source, node.input[2]], [out]))
        return nodes, f"{node_label(node)} -> Add + Add"
    if op == "QuickGelu":
        alpha = float(attribute(node, "alpha", 1.702))
        factor = context.constant(np.array(alpha, np.float32), f"{out}_alpha")
        scaled, gate = fresh(f"{out}_scaled"), fresh(f"{out}_gate")
        nodes += [
            helper.make_node("Mul", [source, factor], [scaled]),
            helper.make_node("Sigmoid", [scaled], [gate]),
            helper.make_node("Mul", [source, gate], [out]),
        ]
        return nodes, f"{node_label(node)} -> x * Sigmoid({alpha:g} x)"
    approximate = "tanh" if op == "FastGelu" else "none"
    nodes.append(helper.make_node("Gelu", [source], [out], approximate=approximate))
    return nodes, f"{node_label(node)} -> Gelu ({approximate})"


def _embed_layer_norm(node: onnx.NodeProto, context: NodeRewrite) -> Rewrite | None:
    """EmbedLayerNormalization -> Gathers of the word, position and segment embeddings, their
    sum, LayerNormalization; its mask_index output (valid tokens per row) from the mask."""
    if _given(node, 8) or (len(node.output) > 2 and node.output[2]):
        return None  # explicit position ids, the embedding sum: not written here
    fresh = context.fresh
    out = node.output[0]
    ids, segments = node.input[0], _given(node, 1)
    words, positions, segment_table = node.input[2], node.input[3], _given(node, 4)
    gamma, beta, mask = node.input[5], node.input[6], _given(node, 7)

    def ints(values: list[int], base: str) -> str:
        return context.constant(np.array(values, np.int64), f"{out}_{base}")

    word, shape, length, ends, position, summed = (
        fresh(f"{out}_{s}") for s in ("word", "shape", "length", "ends", "position", "sum")
    )
    nodes = [
        helper.make_node("Gather", [words, ids], [word], axis=0),
        helper.make_node("Shape", [ids], [shape]),
        helper.make_node("Gather", [shape, ints([1], "seq_axis")], [length], axis=0),
        helper.make_node(
            "Slice", [positions, ints([0], "start"), length, ints([0], "axis")], [ends]
        ),
        helper.make_node("Unsqueeze", [ends, ints([0], "batch_axis")], [position]),
        helper.make_node("Add", [word, position], [summed]),
    ]
    if segments and segment_table:
        segment, with_segment = fresh(f"{out}_segment"), fresh(f"{out}_with_segment")
        nodes += [
            helper.make_node("Gather", [segment_table, segments], [segment], axis=0),
            helper.make_node("Add", [summed, segment], [with_segment]),
        ]
        summed = with_segment
    epsilon = float(attribute(node, "epsilon", 1e-12))
    nodes.append(
        helper.make_node(
            "LayerNormalization", [summed, gamma, beta], [out], axis=-1, epsilon=epsilon
        )
    )
    if len(node.output) > 1 and node.output[1]:
        if mask:
            as_int = fresh(f"{out}_mask_int")
            nodes += [
                helper.make_node("Cast", [mask], [as_int], to=onnx.TensorProto.INT32),
                helper.make_node(
                    "ReduceSum", [as_int, ints([1], "mask_axis")], [node.output[1]], keepdims=0
                ),
            ]
        else:  # no mask: every token valid
            rows = fresh(f"{out}_rows")
            nodes += [
                helper.make_node("Gather", [shape, ints([0], "batch_dim")], [rows], axis=0),
                helper.make_node(
                    "Expand",
                    [context.constant(np.array(0, np.int32), f"{out}_zero"), rows],
                    [node.output[1]],
                ),
            ]
    return nodes, f"{node_label(node)} -> Gather x {3 if segments else 2} + LayerNormalization"


def _raw_mask_of(mask_index: str, context: NodeRewrite) -> str | None:
    """The [batch, sequence] 0/1 mask behind a 1D mask_index (the lengths of right-padded
    rows) computed from it: by an EmbedLayerNormalization, or by the ReduceSum over the
    sequence that onnxruntime's optimizer writes when there is none. Else None."""
    producer = context.producers.get(mask_index)
    if producer is None:
        return None
    if (
        producer.op_type == "EmbedLayerNormalization"
        and producer.domain == MS
        and len(producer.output) > 1
        and producer.output[1] == mask_index
        and _given(producer, 7)
    ):
        return producer.input[7]
    if producer.op_type == "ReduceSum" and producer.domain in ("", "ai.onnx"):
        axes = context.inits.get(_given(producer, 1))
        summed = [int(a) for a in onnx.numpy_helper.to_array(axes).reshape(-1)] if axes else []
        shape = context.shape(producer.input[0])
        if (
            shape is not None
            and len(shape) == 2
            and summed in ([1], [-1])
            and not attribute(producer, "keepdims", 1)
        ):
            return producer.input[0]
    return None


def _attention(node: onnx.NodeProto, context: NodeRewrite) -> Rewrite | None:
    """Attention(x, W, b, mask) -> MatMul + Add, the Q/K/V split, per-head scores / sqrt(d)
    plus a mask bias (1 - mask) * fill, Softmax, the weighted values, heads merged. Row lengths
    come back to the 0/1 mask they were summed from where they were: a RoBERTa optimized so ran
    at 32.7 dB vs float on the HTP with a mask rebuilt from its lengths, 63.2 dB with its own
    (the attention rules know that form)."""
    if any(_given(node, i) for i in (4, 5, 6)) or len(_used_outputs(node)) > 1:
        return None  # past state, attention bias
    if int(attribute(node, "unidirectional", 0)) or int(attribute(node, "do_rotary", 0)):
        return None
    weights = context.inits.get(node.input[1])
    if weights is None:
        return None
    heads = int(attribute(node, "num_heads", 0))
    total = int(weights.dims[1])
    sizes = list(attribute(node, "qkv_hidden_sizes", []) or [total // 3] * 3)
    if heads <= 0 or sum(sizes) != total or sizes[0] != sizes[1] or any(s % heads for s in sizes):
        return None
    mask_index = _given(node, 3)
    mask: str | None = None
    lengths: str | None = None
    if mask_index:
        mask = _raw_mask_of(mask_index, context)
        if mask is None:
            shape = context.shape(mask_index)
            rows = (context.shape(node.input[0]) or (None,))[0]
            if shape is None or len(shape) not in (1, 2) or rows not in (None, shape[0]):
                return None  # 3D/4D masks, and [2 * batch] (ends and starts): not written
            if len(shape) == 2:
                mask = mask_index
            else:
                lengths = mask_index
    head = sizes[0] // heads
    fill = float(attribute(node, "mask_filter_value", -10000.0))
    scale = float(attribute(node, "scale", 0.0)) or 1.0 / math.sqrt(head)
    out = node.output[0]
    fresh = context.fresh

    def const(value: object, dtype: type, base: str) -> str:
        return context.constant(np.array(value, dtype), f"{out}_{base}")

    projected = fresh(f"{out}_qkv")
    nodes = [helper.make_node("MatMul", [node.input[0], node.input[1]], [projected])]
    if _given(node, 2):
        biased = fresh(f"{out}_qkv_biased")
        nodes.append(helper.make_node("Add", [projected, node.input[2]], [biased]))
        projected = biased
    q, k, v = (fresh(f"{out}_{s}") for s in ("q", "k", "v"))
    nodes.append(
        helper.make_node("Split", [projected, const(sizes, np.int64, "sizes")], [q, k, v], axis=-1)
    )
    split_heads = {}
    for name, tensor, perm, size in (
        ("q", q, [0, 2, 1, 3], sizes[0]),
        ("k", k, [0, 2, 3, 1], sizes[1]),
        ("v", v, [0, 2, 1, 3], sizes[2]),
    ):
        shaped, moved = fresh(f"{out}_{name}_heads"), fresh(f"{out}_{name}_moved")
        nodes += [
            helper.make_node(
                "Reshape",
                [tensor, const([0, 0, heads, size // heads], np.int64, f"{name}_shape")],
                [shaped],
            ),
            helper.make_node("Transpose", [shaped], [moved], perm=perm),
        ]
        split_heads[name] = moved
    scores, scaled = fresh(f"{out}_scores"), fresh(f"{out}_scaled")
    nodes += [
        helper.make_node("MatMul", [split_heads["q"], split_heads["k"]], [scores]),
        helper.make_node("Div", [scores, const(1.0 / scale, np.float32, "sqrt_d")], [scaled]),
    ]
    logits = scaled
    if mask is not None or lengths is not None:
        keep = fresh(f"{out}_keep")
        if mask is not None:
            nodes.append(helper.make_node("Cast", [mask], [keep], to=onnx.TensorProto.FLOAT))
        else:  # lengths of right-padded rows: key j is kept where j < length
            shape, seq, positions, wide, column, kept = (
                fresh(f"{out}_{s}") for s in ("shape", "seq", "positions", "lengths", "col", "kept")
            )
            nodes += [
                helper.make_node("Shape", [node.input[0]], [shape]),
                helper.make_node("Gather", [shape, const(1, np.int64, "seq_axis")], [seq], axis=0),
                helper.make_node(
                    "Range",
                    [const(0, np.int64, "start"), seq, const(1, np.int64, "step")],
                    [positions],
                ),
                helper.make_node("Cast", [lengths], [wide], to=onnx.TensorProto.INT64),
                helper.make_node("Unsqueeze", [wide, const([1], np.int64, "row_axis")], [column]),
                helper.make_node("Less", [positions, column], [kept]),
                helper.make_node("Cast", [kept], [keep], to=onnx.TensorProto.FLOAT),
            ]
        dropped, bias, bias_4d, masked = (
            fresh(f"{out}_{s}") for s in ("dropped", "mask_bias", "mask_bias_4d", "masked")
        )
        nodes += [
            helper.make_node("Sub", [const(1.0, np.float32, "one"), keep], [dropped]),
            helper.make_node("Mul", [dropped, const(fill, np.float32, "fill")], [bias]),
            helper.make_node("Unsqueeze", [bias, const([1, 2], np.int64, "mask_axes")], [bias_4d]),
            helper.make_node("Add", [scaled, bias_4d], [masked]),
        ]
        logits = masked
    probs, mixed, merged = (fresh(f"{out}_{s}") for s in ("probs", "mixed", "merged"))
    nodes += [
        helper.make_node("Softmax", [logits], [probs], axis=-1),
        helper.make_node("MatMul", [probs, split_heads["v"]], [mixed]),
        helper.make_node("Transpose", [mixed], [merged], perm=[0, 2, 1, 3]),
        helper.make_node(
            "Reshape", [merged, const([0, 0, sizes[2]], np.int64, "merged_shape")], [out]
        ),
    ]
    return nodes, f"{node_label(node)} -> {heads} heads of MatMul / Softmax" + (
        " with its mask" if mask or lengths else ""
    )


_REWRITES: dict[str, NodeRule] = {
    "SkipLayerNormalization": _skip_layer_norm,
    "EmbedLayerNormalization": _embed_layer_norm,
    "Attention": _attention,
    "BiasGelu": _bias_and_gelus,
    "FastGelu": _bias_and_gelus,
    "Gelu": _bias_and_gelus,
    "QuickGelu": _bias_and_gelus,
    "BiasAdd": _bias_and_gelus,
    "SkipSimplifiedLayerNormalization": _simplified_layer_norm,
}


def fused_transformer_ops(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """onnxruntime's fused encoder ops -> the standard ops they fuse (module doc)."""
    return replace_by_op(passed_on(model), "fused_transformer_ops", _REWRITES, (MS,))


# -- onnxruntime's CPU fusions -----------------------------------------------------------------

NCHWC = "com.microsoft.nchwc"
_CONV_ATTRIBUTES = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")


def _activation_kind(node: onnx.NodeProto) -> str:
    """A fused op's ``activation`` attribute as text ("" when it has none)."""
    kind = attribute(node, "activation", b"")
    return kind.decode() if isinstance(kind, bytes) else str(kind)


def _activation(
    node: onnx.NodeProto, source: str, out: str, context: NodeRewrite, params: list[float]
) -> list[onnx.NodeProto] | None:
    """The standard op for a fused op's ``activation`` attribute (onnxruntime's names and
    ``activation_params``), reading ``source`` and writing ``out``; None for one not known."""
    kind = _activation_kind(node)
    if kind in ("Relu", "Sigmoid", "Tanh"):
        return [helper.make_node(kind, [source], [out])]
    if kind == "LeakyRelu":
        return [helper.make_node("LeakyRelu", [source], [out], alpha=params[0] if params else 0.01)]
    if kind == "HardSigmoid" and len(params) >= 2:
        return [helper.make_node("HardSigmoid", [source], [out], alpha=params[0], beta=params[1])]
    if kind == "Clip" and len(params) >= 2:
        low = context.constant(np.array(params[0], np.float32), f"{out}_min")
        high = context.constant(np.array(params[1], np.float32), f"{out}_max")
        return [helper.make_node("Clip", [source, low, high], [out])]
    if not kind:
        return [helper.make_node("Identity", [source], [out])]
    return None


def _fused_conv(node: onnx.NodeProto, context: NodeRewrite) -> Rewrite | None:
    """FusedConv(X, W, B, Z) -> activation(Conv(X, W, B) + Z)."""
    out = node.output[0]
    params = [float(v) for v in attribute(node, "activation_params", [])]
    conv = context.fresh(f"{out}_conv")
    kept = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    options = {k: v for k, v in kept.items() if k in _CONV_ATTRIBUTES}
    nodes = [helper.make_node("Conv", [i for i in node.input[:3] if i], [conv], **options)]
    summed = _given(node, 3)
    if summed:
        total = context.fresh(f"{out}_sum")
        nodes.append(helper.make_node("Add", [conv, summed], [total]))
        conv = total
    tail = _activation(node, conv, out, context, params)
    if tail is None:
        return None
    what = _activation_kind(node)
    return nodes + tail, f"{node_label(node)} -> Conv{' + Add' if summed else ''}" + (
        f" + {what}" if what else ""
    )


def _fused_gemm(node: onnx.NodeProto, context: NodeRewrite) -> Rewrite | None:
    """FusedGemm(A, B, C) -> activation(Gemm(A, B, C))."""
    out = node.output[0]
    gemm = context.fresh(f"{out}_gemm")
    options = {
        a.name: helper.get_attribute_value(a)
        for a in node.attribute
        if a.name in ("alpha", "beta", "transA", "transB")
    }
    # onnxruntime keeps the activation's own attributes as activation_<name>, where it had them
    kind = _activation_kind(node)
    defaults = {"LeakyRelu": (("alpha", 0.01),), "HardSigmoid": (("alpha", 0.2), ("beta", 0.5))}
    if kind not in ("", "Relu", "Sigmoid", "Tanh", *defaults):
        return None
    params = [
        float(attribute(node, f"activation_{name}", default))
        for name, default in defaults.get(kind, ())
    ]
    tail = _activation(node, gemm, out, context, params)
    if tail is None:
        return None
    nodes = [helper.make_node("Gemm", list(node.input), [gemm], **options)]
    return nodes + tail, f"{node_label(node)} -> Gemm + activation"


def _fused_matmul(node: onnx.NodeProto, context: NodeRewrite) -> Rewrite | None:
    """FusedMatMul(A, B) -> alpha * MatMul(A', B'), A' and B' transposed in their last two
    axes where transA / transB say so (the batch transposes are left as they are)."""
    if attribute(node, "transBatchA", 0) or attribute(node, "transBatchB", 0):
        return None
    out = node.output[0]
    operands = []
    nodes: list[onnx.NodeProto] = []
    for index, flag in ((0, "transA"), (1, "transB")):
        name = node.input[index]
        if attribute(node, flag, 0):
            shape = context.shape(name)
            if shape is None or len(shape) < 2:
                return None
            perm = [*range(len(shape) - 2), len(shape) - 1, len(shape) - 2]
            turned = context.fresh(f"{name}_t")
            nodes.append(helper.make_node("Transpose", [name], [turned], perm=perm))
            name = turned
        operands.append(name)
    alpha = float(attribute(node, "alpha", 1.0))
    if alpha == 1.0:
        nodes.append(helper.make_node("MatMul", operands, [out]))
    else:
        product = context.fresh(f"{out}_product")
        scale = context.constant(np.array(alpha, np.float32), f"{out}_alpha")
        nodes += [
            helper.make_node("MatMul", operands, [product]),
            helper.make_node("Mul", [product, scale], [out]),
        ]
    return nodes, f"{node_label(node)} -> MatMul" + (f" x {alpha:g}" if alpha != 1.0 else "")


_CPU_REWRITES: dict[str, NodeRule] = {
    "FusedConv": _fused_conv,
    "FusedGemm": _fused_gemm,
    "FusedMatMul": _fused_matmul,
}


def fused_cpu_ops(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """onnxruntime's CPU EP fusions saved into a model -> the standard ops they fuse (module
    doc): ONNX shape inference knows none of them (the build stopped at "no static shape").
    Again while that helps: a FusedMatMul's transposes need its operand's rank, which shape
    inference gives only once the fused op before it is written back."""
    details: list[str] = []
    for _ in range(3):
        model, change = replace_by_op(model, "fused_cpu_ops", _CPU_REWRITES, (MS,))
        details += change.details
        if not change.changed:
            break
    model, inner = _fused_in_subgraphs(model)
    return model, Change("fused_cpu_ops", tuple(details + inner))


def _fused_in_subgraphs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """The same rules inside If/Loop/Scan bodies, which later steps lift into the main graph
    (an If-branch VAD saved by onnxruntime); new constants go to the main graph, which every
    body may read. Shapes are not known there: a FusedMatMul that transposes stays."""
    bodies = [body for node in model.graph.node for body in subgraphs(node)]
    if not any(
        n.domain == MS and n.op_type in _CPU_REWRITES
        for body in bodies
        for graph in all_graphs(body)
        for n in graph.node
    ):
        return model, []
    out = copy_model(model)
    context = NodeRewrite(out)
    details: list[str] = []

    def visit(graph: onnx.GraphProto) -> None:
        nodes: list[onnx.NodeProto] = []
        for node in graph.node:
            for body in subgraphs(node):
                visit(body)  # in place, before the node is copied into its graph's new list
            rule = _CPU_REWRITES.get(node.op_type) if node.domain == MS else None
            result = rule(node, context) if rule is not None else None
            if result is None:
                nodes.append(node)
                continue
            nodes.extend(result[0])
            details.append(f"{result[1]} (in {graph.name or 'a subgraph'})")
        set_nodes(graph, nodes)

    for node in out.graph.node:
        for body in subgraphs(node):
            visit(body)
    return out, details


def refuse_nchwc_layout(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A ModelError for a model onnxruntime saved at its 'all' optimization level: its
    com.microsoft.nchwc ops (Conv, ReorderInput, ReorderOutput, pools) hold the weights in a
    channel-blocked layout for the x86 CPU it ran on, which onnxruntime itself warns is not
    portable; without the check the build stopped at "no static shape" with a tip about dims."""
    found = [n for n in model.graph.node if n.domain == NCHWC]
    if found:
        ops = sorted({n.op_type for n in found})
        raise ModelError(
            f"The model holds {len(found)} {NCHWC} op(s) ({', '.join(ops)}): onnxruntime saved "
            "it after its 'all' graph optimizations, in a channel-blocked layout for the CPU it "
            "ran on.",
            tip="Give the model as exported (before onnxruntime optimized it), or save it at "
            "the 'extended' level or below (SessionOptions.graph_optimization_level = "
            "ORT_ENABLE_EXTENDED), whose fused ops the preparation writes back.",
        )
    return model, Change("refuse_nchwc_layout")


# -- onnxruntime's own norms in the ONNX domain ------------------------------------------------

_ORT_NORMS = ("LayerNormalization", "SimplifiedLayerNormalization")


def onnx_domain_norms(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxruntime's LayerNormalization below opset 17 and SimplifiedLayerNormalization (RMSNorm)
    in the ONNX domain, written out over the last axis in ops of any opset.

    onnxruntime registers both there as its own kernels and writes them so when it saves a
    model after its graph optimizations (a DistilBERT at opset 11: 5 LayerNormalizations),
    where ONNX has no schema for them: the checker refused the model at load ("No Op registered
    for LayerNormalization with domain_version of 11"). The form written is the one exporters
    write (and onnxruntime's own fusion and ``qnn_preprocess_model`` fuse back): mean, centred
    square through Pow(d, 2), Sqrt(var + eps), Div, scale and bias. Run before the checker;
    a norm over other axes, or whose mean or inverse-deviation outputs are read, is left as it
    is (the checker then says why)."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)

    def written_out(node: onnx.NodeProto) -> bool:
        return (
            node.op_type in _ORT_NORMS
            and node.domain in ("", "ai.onnx")
            and (node.op_type != "LayerNormalization" or opset < 17)
            and int(attribute(node, "axis", -1)) == -1
            and not any(node.output[1:])
        )

    if not any(written_out(n) for n in model.graph.node):
        return model
    out = copy_model(model)
    graph = out.graph
    fresh = FreshNames(out)
    nodes: list[onnx.NodeProto] = []

    def constant(value: float, base: str) -> str:
        name = fresh(base)
        graph.initializer.append(onnx.numpy_helper.from_array(np.array(value, np.float32), name))
        return name

    def mean(source: str, target: str) -> onnx.NodeProto:
        """ReduceMean over the last axis: its axes an attribute below opset 18, an input from 18
        on (a SimplifiedLayerNormalization is written out at any opset)."""
        if opset < 18:
            return helper.make_node("ReduceMean", [source], [target], axes=[-1], keepdims=1)
        axes = fresh(f"{target}_axes")
        graph.initializer.append(onnx.numpy_helper.from_array(np.array([-1], np.int64), axes))
        return helper.make_node("ReduceMean", [source, axes], [target], keepdims=1)

    for node in graph.node:
        if not written_out(node):
            nodes.append(node)
            continue
        simplified = node.op_type == "SimplifiedLayerNormalization"
        y = node.output[0]
        epsilon = float(attribute(node, "epsilon", 1e-5))

        x = node.input[0]
        name = {k: fresh(f"{y}_{k}") for k in ("mean", "centred", "square", "var", "shifted",
                                               "std", "normed", "scaled")}  # fmt: skip
        if simplified:  # y = x / sqrt(mean(x^2) + eps) * scale
            centred = x
            written = [helper.make_node("Mul", [x, x], [name["square"]])]
        else:
            centred = name["centred"]
            written = [
                mean(x, name["mean"]),
                helper.make_node("Sub", [x, name["mean"]], [centred]),
                helper.make_node("Pow", [centred, constant(2.0, f"{y}_two")], [name["square"]]),
            ]
        bias = _given(node, 2)
        written += [
            mean(name["square"], name["var"]),
            helper.make_node(
                "Add", [name["var"], constant(epsilon, f"{y}_eps")], [name["shifted"]]
            ),
            helper.make_node("Sqrt", [name["shifted"]], [name["std"]]),
            helper.make_node("Div", [centred, name["std"]], [name["normed"]]),
            helper.make_node(
                "Mul", [name["normed"], node.input[1]], [name["scaled"] if bias else y]
            ),
        ]
        if bias:
            written.append(helper.make_node("Add", [name["scaled"], bias], [y]))
        nodes += written
    set_nodes(graph, nodes)
    return out
