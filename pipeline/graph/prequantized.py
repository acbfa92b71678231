"""Pre-quantized models: graphs that already hold their own quantization.

TFLite int8 exports, PPQ, PyTorch FX/eager and Vitis-AI QDQ models carry QuantizeLinear /
DequantizeLinear nodes (or QOperator ``QLinear*`` ops) that *are* the model: its scales and zero
points were chosen, often trained, by its authors, and there is no float original to calibrate
from. Quantizing such a graph a second time fails (onnxruntime's quantizer puts a float Q/DQ in
front of a DequantizeLinear) or stacks a second layer of Q/DQ that the QNN EP cannot group.

So a pre-quantized model is built with its own quantization kept. Preparation cleans it like any
model (Identity/Cast chains, Constant nodes, static shapes, If folding) but never folds its Q/DQ
and keeps its opset: nothing needs opset 21 (no 16-bit types come from our quantizer), and the
converter plus onnxruntime's optimizer have made such models unloadable. The quantize stage then
only rewrites what the QNN HTP does not take, each rewrite exact (``for_htp``) but two: int16
weights on a 16-bit input, which the HTP computes with its accumulator floored, reach it as
two int8 layers summed (``qdq_htp.split_sixteen_bit_weights``: 15 bits of weight; an
onnxruntime-quantized a16w16 segmenter ran 6.6 dB on the HTP from itself on the CPU, split
25.3 dB, itself on the CPU 41.6 dB from the unsplit model, where its rounding floor is 51 dB),
and a 16-bit ``x * Sigmoid(x)``, whose direct factor reads a requantized copy
(``qdq_htp.split_swish_input``, half a 16-bit step: the HTP fuses the pattern wrongly).
Measured on the QNN 2.51 HTP simulator (onnxruntime-qnn 2.7.0), see tests/test_prequantized.py:

- int8 *and* uint8 activations both compile and give identical results for Conv, Gemm and
  most ops (the EP maps int8 to uint8 + 128 itself), but a quantized BatchNormalization or
  HardSigmoid with int8 activations is declined: ``unsigned_activations`` moves them to uint8
  (zero point + 128, exact). int8 weights with or without zero point, uint8 weights, per-tensor
  and per-channel (axis 0) weights, int32 biases via DequantizeLinear: taken as they are.
- A quantized BatchNormalization is computed wrongly (its float mean, variance and beta read
  as quantized): ``batchnorm_as_depthwise_conv``; a quantized Clip clips only through its
  output grid's saturation: ``clip_bounds_on_the_grid``.
- An op is only run quantized when it is a complete QDQ unit (onnxruntime's selectors: DQ on
  every input, Q on the output, same activation type in and out, int32 bias, signed weights
  for signed activations). Anything else runs as a *float* op on the HTP, and float Convs there
  are far off (a uint8 Conv with a float bias: -14.9 dB against the CPU). Hence:
  ``int32_biases`` (int8 / float biases -> int32 at input scale x weight scale),
  ``signed_weights`` (uint8 weights beside int8/int16 activations -> int8, zero point - 128),
  ``symmetric_sixteen_bit_weights`` (uint16 weights whose q - z fits int16 -> int16, zero
  point 0: 8-bit weights stored as uint16 are computed otherwise on the HTP),
  ``unsigned_norm_scales`` (an int8 LayerNormalization gamma -> uint8, zero point + 128),
  ``propagate_qdq`` (a Q behind Transpose/Reshape/Concat/Relu/... copied in front of them, and
  after them when they read a DQ: Q(f(x)) == f(Q(x)) for these ops) and
  ``split_leaky_relu`` (Conv -> LeakyRelu -> Q as two 8-bit Conv branches, see there).
- A Cast between Q and DQ (PyTorch exports) makes the compile fail outright ("Node ... was
  inserted using the NHWC format ... but was not selected"); ``drop_noop_casts`` removes it.
- A standalone per-channel DequantizeLinear stays on the CPU ("QNN EP does not support a
  standalone DQ op with per-channel quantization").

``config [quantization] requantize = true`` takes the other road: ``dequantize`` removes the
model's own quantization and the float model behind it is calibrated and quantized as usual.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from ..core.errors import ModelError
from . import edit, legacy, qdq_htp
from . import transforms as t
from .edit import Change

QUANTIZE = "QuantizeLinear"
DEQUANTIZE = "DequantizeLinear"
QDQ_OPS = frozenset({QUANTIZE, DEQUANTIZE})
_QDQ_DOMAINS = ("", "ai.onnx", "com.microsoft")
_DEFAULT = ("", "ai.onnx")
_MS = "com.microsoft"
# QOperator-format ops: integer in, integer out, scales and zero points as inputs.
QOPERATOR_OPS = frozenset(
    {
        "QLinearConv",
        "QLinearMatMul",
        "QLinearAdd",
        "QLinearMul",
        "QLinearSigmoid",
        "QLinearLeakyRelu",
        "QLinearGlobalAveragePool",
        "QLinearAveragePool",
        "QLinearConcat",
        "QLinearSoftmax",
        "QLinearReduceMean",
        "QLinearWhere",
        "QGemm",
        "ConvInteger",
        "MatMulInteger",
    }
)
_INT_RANGES = {
    onnx.TensorProto.UINT8: (0, 255),
    onnx.TensorProto.INT8: (-128, 127),
    onnx.TensorProto.UINT16: (0, 65535),
    onnx.TensorProto.INT16: (-32768, 32767),
}
_SIGNED = (onnx.TensorProto.INT8, onnx.TensorProto.INT16)
# Ops whose result Q(f(x)) equals f(Q(x)) for a per-tensor Q: they only move, pick, pad with
# zero or compare values, so values on a quantization grid stay on it. Value: data inputs.
_COMMUTING: dict[str, tuple[int, ...] | None] = {
    "Transpose": (0,),
    "Reshape": (0,),
    "Flatten": (0,),
    "Squeeze": (0,),
    "Unsqueeze": (0,),
    "Identity": (0,),
    "Relu": (0,),
    "MaxPool": (0,),
    "Slice": (0,),
    "Gather": (0,),
    "DepthToSpace": (0,),
    "SpaceToDepth": (0,),
    "Expand": (0,),
    "Tile": (0,),
    "Resize": (0,),  # nearest only (checked)
    "Pad": (0,),  # constant zero padding only (checked)
    "Concat": None,  # every input
}
# Ops that only move values, never look at them: an input reaches its first Q or DQ through
# them unchanged, and they do the same on integers as on the values they stand for.
_VALUE_MOVES = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity"})
# Ops whose outputs hold some of their data input's values unchanged (picked, joined, repeated):
# an input reaches its first Q through them with its values as they were. Concat: any input.
_VALUE_PICKS = _VALUE_MOVES | {
    "Slice",
    "Split",
    "Concat",
    "Gather",
    "Tile",
    "Expand",
    "DepthToSpace",
    "SpaceToDepth",
}
# Ops that take a weight and a bias: the QNN EP groups them only with an int32 bias.
_BIASED = ("Conv", "ConvTranspose", "Gemm")
_WEIGHTED = (*_BIASED, "MatMul")


# --------------------------------------------------------------------------------------------
# detection


def _is_quant_node(node: onnx.NodeProto) -> bool:
    if node.domain not in _QDQ_DOMAINS:
        return False
    return node.op_type in QDQ_OPS or node.op_type in QOPERATOR_OPS or node.op_type in DYNAMIC_OPS


def quantization_ops(model: onnx.ModelProto) -> Counter[str]:
    """Quantization nodes of the model (every graph, If/Loop bodies included), by op type."""
    return Counter(
        node.op_type
        for graph in edit.all_graphs(model.graph)
        for node in graph.node
        if _is_quant_node(node)
    )


def is_prequantized(model: onnx.ModelProto) -> bool:
    """True when the model holds quantization of its own: Q/DQ nodes or QLinear* ops.

    A float model has none of them (onnxruntime's quantizer is what adds them), so this is
    False for every float model, fp16 ones included.
    """
    return any(
        _is_quant_node(node) for graph in edit.all_graphs(model.graph) for node in graph.node
    )


@dataclass(frozen=True)
class PrequantizedSummary:
    """What quantization a model brings: counts and types, for the report."""

    quantize_nodes: int
    dequantize_nodes: int
    weights: int  # DequantizeLinear of a constant integer tensor
    qoperator: dict[str, int]
    activation_types: list[str]
    weight_types: list[str]
    per_channel_weights: int

    @property
    def activations_quantized(self) -> bool:
        return bool(self.activation_types)

    def describe(self) -> str:
        parts = [
            f"{self.quantize_nodes} QuantizeLinear",
            f"{self.dequantize_nodes} DequantizeLinear",
        ]
        if self.qoperator:
            parts.append(", ".join(f"{n} {op}" for op, n in sorted(self.qoperator.items())))
        acts = "/".join(self.activation_types) or "none"
        weights = "/".join(self.weight_types) or "none"
        channel = f", {self.per_channel_weights} per-channel" if self.per_channel_weights else ""
        return (
            f"{', '.join(parts)}; activations {acts}; {self.weights} quantized weights "
            f"({weights}{channel})"
        )


def _type_name(elem_type: int) -> str:
    return onnx.TensorProto.DataType.Name(elem_type).lower()


def summarize(model: onnx.ModelProto) -> PrequantizedSummary:
    """Counts and integer types of a pre-quantized model's own quantization."""
    graph = model.graph
    inits = edit.initializers_by_name(graph)
    counts = quantization_ops(model)
    acts: set[str] = set()
    weights: set[str] = set()
    n_weights = per_channel = 0
    for node in graph.node:
        if node.op_type not in QDQ_OPS or node.domain not in _QDQ_DOMAINS:
            continue
        zp = inits.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        kind = _type_name(zp.data_type) if zp is not None else "uint8"
        if node.op_type == DEQUANTIZE and node.input[0] in inits:
            n_weights += 1
            weights.add(_type_name(inits[node.input[0]].data_type))
            scale = inits.get(node.input[1])
            per_channel += int(scale is not None and numpy_helper.to_array(scale).size > 1)
        elif node.op_type == QUANTIZE:
            acts.add(kind)
    return PrequantizedSummary(
        quantize_nodes=counts[QUANTIZE],
        dequantize_nodes=counts[DEQUANTIZE],
        weights=n_weights,
        qoperator={op: n for op, n in counts.items() if op in QOPERATOR_OPS},
        activation_types=sorted(acts),
        weight_types=sorted(weights),
        per_channel_weights=per_channel,
    )


# --------------------------------------------------------------------------------------------
# small helpers


def _array(inits: dict[str, onnx.TensorProto], name: str) -> np.ndarray | None:
    return numpy_helper.to_array(inits[name]) if name in inits else None


@dataclass(frozen=True)
class _Params:
    """Per-tensor quantization parameters of one Q or DQ node (constant scale and zero point)."""

    scale: float
    zero_point: int
    elem_type: int
    scale_name: str
    zp_name: str

    def same(self, other: _Params | None) -> bool:
        return (
            other is not None
            and np.float32(self.scale) == np.float32(other.scale)
            and self.zero_point == other.zero_point
            and self.elem_type == other.elem_type
        )


def _params(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> _Params | None:
    """The per-tensor parameters of a Q/DQ node, or None (per-channel, non-constant, odd type)."""
    if node.op_type not in QDQ_OPS or node.domain not in _QDQ_DOMAINS or len(node.input) < 2:
        return None
    scale = _array(inits, node.input[1])
    zp_name = node.input[2] if len(node.input) > 2 else ""
    if scale is None or scale.size != 1 or (zp_name and zp_name not in inits):
        return None
    if zp_name:
        zp, elem_type = int(_array(inits, zp_name).reshape(())), inits[zp_name].data_type
    else:
        zp, elem_type = 0, onnx.TensorProto.UINT8
    if elem_type not in _INT_RANGES:
        return None
    return _Params(float(scale.reshape(())), zp, elem_type, node.input[1], zp_name)


class _Graph:
    """Producer/consumer maps of a graph, rebuilt on demand after edits."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.refresh()

    def refresh(self) -> None:
        graph = self.graph
        self.inits = edit.initializers_by_name(graph)
        self.producer = {o: n for n in graph.node for o in n.output if o}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            for name in node.input:
                if name:
                    self.consumers.setdefault(name, []).append(node)
        self.outputs = {o.name for o in graph.output}

    def dq_of(self, name: str) -> onnx.NodeProto | None:
        node = self.producer.get(name)
        return node if node is not None and node.op_type == DEQUANTIZE else None

    def constant_dq(self, name: str) -> onnx.NodeProto | None:
        """The DequantizeLinear of a constant tensor (a quantized weight) producing ``name``."""
        node = self.dq_of(name)
        if node is None or node.input[0] not in self.inits:
            return None
        if any(i and i not in self.inits for i in node.input[1:]):
            return None
        return node

    def weight_dq(self, node: onnx.NodeProto) -> onnx.NodeProto | None:
        """The DequantizeLinear of a Conv/Gemm/MatMul's constant weight (input 1) when its
        activation (input 0) comes through a DequantizeLinear too: a quantized op's operands."""
        if len(node.input) < 2 or self.activation_dq(node.input[0]) is None:
            return None
        return self.constant_dq(node.input[1])

    def activation_dq(self, name: str) -> onnx.NodeProto | None:
        node = self.dq_of(name)
        if node is None or node.input[0] in self.inits:
            return None
        return node


def _dq_value(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> np.ndarray:
    """What a DequantizeLinear of constants computes, in float64 (exact for int8/int32)."""
    q = _array(inits, node.input[0]).astype(np.float64)
    scale = _array(inits, node.input[1]).astype(np.float64)
    zp_name = node.input[2] if len(node.input) > 2 else ""
    zp = _array(inits, zp_name).astype(np.float64) if zp_name else np.zeros_like(scale)
    axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
    block = next((a.i for a in node.attribute if a.name == "block_size"), 0)
    if block and scale.ndim == q.ndim:  # blocked (opset 21: an int4 LLM's weights)
        axis %= q.ndim
        scale = np.repeat(scale, block, axis=axis).take(range(q.shape[axis]), axis=axis)
        zp = np.repeat(zp, block, axis=axis).take(range(q.shape[axis]), axis=axis)
        return (q - zp) * scale
    if scale.size > 1:
        shape = [1] * q.ndim
        shape[axis % q.ndim] = scale.size
        scale, zp = scale.reshape(shape), zp.reshape(shape)
    return (q - zp) * scale


def _qdq_pair(
    source: str, params: _Params, namer: edit.FreshNames, label: str
) -> tuple[list[onnx.NodeProto], str]:
    """Q then DQ of ``source`` with ``params`` (their initializers reused); the DQ's output."""
    inputs = [params.scale_name, params.zp_name] if params.zp_name else [params.scale_name]
    q_out, dq_out = namer(f"{source}_{label}_q"), namer(f"{source}_{label}_dq")
    nodes = [
        onnx.helper.make_node(QUANTIZE, [source, *inputs], [q_out], name=namer(f"{q_out}_node")),
        onnx.helper.make_node(DEQUANTIZE, [q_out, *inputs], [dq_out], name=namer(f"{dq_out}_node")),
    ]
    return nodes, dq_out


def _finish(
    model: onnx.ModelProto, step: str, details: Sequence[str]
) -> tuple[onnx.ModelProto, Change]:
    if details:
        edit.sort_graph(model.graph)
        edit.remove_dead_nodes(model.graph)
    return edit.checked_change(model, step, details)


def _initializer(
    graph: onnx.GraphProto, namer: edit.FreshNames, base: str, value: np.ndarray
) -> str:
    name = namer(base)
    graph.initializer.append(numpy_helper.from_array(value, name))
    return name


# --------------------------------------------------------------------------------------------
# preparation steps (each a no-op on float models)


def _qoperator_nodes(
    node: onnx.NodeProto, namer: edit.FreshNames, graph: onnx.GraphProto, opset: int
) -> list[onnx.NodeProto] | None:
    """DQ -> float op -> Q nodes computing what one QLinear* node computes, or None."""
    make = onnx.helper.make_node
    ins = list(node.input) + [""] * 9
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    out = node.output[0]
    base = node.name or out
    nodes: list[onnx.NodeProto] = []

    def dq(x: str, scale: str, zp: str, axis: int | None = None) -> str:
        name = namer(f"{x}_dq")
        kwargs = {"axis": axis} if axis is not None else {}
        nodes.append(
            make(
                DEQUANTIZE,
                [x, scale, zp] if zp else [x, scale],
                [name],
                name=namer(f"{base}_dq"),
                **kwargs,
            )
        )
        return name

    def q_out(y: str, scale: str, zp: str) -> None:
        nodes.append(
            make(QUANTIZE, [y, scale, zp] if zp else [y, scale], [out], name=namer(f"{base}_q"))
        )

    op = node.op_type
    y = namer(f"{base}_float")
    if op == "QLinearConv" and node.domain in _DEFAULT:
        inits = edit.initializers_by_name(graph)
        w_scale = _array(inits, ins[4])
        per_channel = w_scale is not None and w_scale.size > 1
        x = dq(ins[0], ins[1], ins[2])
        w = dq(ins[3], ins[4], ins[5], 0 if per_channel else None)
        conv_in = [x, w]
        if ins[8]:
            x_scale = _array(inits, ins[1])
            if x_scale is None or w_scale is None:
                return None
            b_scale = (x_scale.astype(np.float32) * w_scale.astype(np.float32)).astype(np.float32)
            b_scale_name = _initializer(
                graph,
                namer,
                f"{base}_bias_scale",
                b_scale.reshape(-1) if per_channel else b_scale.reshape(()),
            )
            zeros = np.zeros(b_scale.size if per_channel else (), np.int32)
            b_zp = _initializer(graph, namer, f"{base}_bias_zp", zeros)
            conv_in.append(dq(ins[8], b_scale_name, b_zp, 0 if per_channel else None))
        nodes.append(make("Conv", conv_in, [y], name=namer(base), **attrs))
        q_out(y, ins[6], ins[7])
    elif op == "QLinearMatMul" and node.domain in _DEFAULT:
        inits = edit.initializers_by_name(graph)
        b_scale = _array(inits, ins[4])
        if b_scale is None or b_scale.size > 1:  # per-column scales: not mapped here
            return None
        a, b = dq(ins[0], ins[1], ins[2]), dq(ins[3], ins[4], ins[5])
        nodes.append(make("MatMul", [a, b], [y], name=namer(base)))
        q_out(y, ins[6], ins[7])
    elif op in ("QLinearAdd", "QLinearMul") and node.domain == _MS:
        a, b = dq(ins[0], ins[1], ins[2]), dq(ins[3], ins[4], ins[5])
        nodes.append(make(op[len("QLinear") :], [a, b], [y], name=namer(base)))
        q_out(y, ins[6], ins[7])
    elif op in ("QLinearSigmoid", "QLinearLeakyRelu") and node.domain == _MS:
        x = dq(ins[0], ins[1], ins[2])
        kwargs = {"alpha": attrs.get("alpha", 0.01)} if op == "QLinearLeakyRelu" else {}
        nodes.append(make(op[len("QLinear") :], [x], [y], name=namer(base), **kwargs))
        q_out(y, ins[3], ins[4])
    elif op in ("QLinearGlobalAveragePool", "QLinearAveragePool") and node.domain == _MS:
        if attrs.pop("channels_last", 0):
            return None
        x = dq(ins[0], ins[1], ins[2])
        nodes.append(make(op[len("QLinear") :], [x], [y], name=namer(base), **attrs))
        q_out(y, ins[3], ins[4])
    elif op == "QLinearConcat" and node.domain == _MS:
        groups = list(node.input[2:])
        if len(groups) % 3:
            return None
        parts = [dq(*groups[i : i + 3]) for i in range(0, len(groups), 3)]
        nodes.append(make("Concat", parts, [y], name=namer(base), axis=attrs.get("axis", 0)))
        q_out(y, ins[0], ins[1])
    elif op == "QLinearSoftmax" and node.domain == _MS:
        # Softmax-1/11 (flatten from axis, default 1) and -13 (one axis, default -1) differ.
        new_style = attrs.get("opset", 13) >= 13
        axis = attrs.get("axis", -1 if new_style else 1)
        x = dq(ins[0], ins[1], ins[2])
        # Over the last axis the two agree: flattening from it leaves that axis alone.
        if new_style == (opset >= 13) or axis == -1:
            nodes.append(make("Softmax", [x], [y], name=namer(base), axis=axis))
        elif not new_style:
            # The node's opset-11 meaning in a model upgraded to 13 (qoperator_to_qdq does so
            # for per-axis weights; onnxruntime's quantizer wrote opset=11 and axis=2 on a face
            # detector's [1, boxes, 2] scores): flatten from the axis, softmax the flat tail,
            # reshape back; Shape folds once the shapes are static.
            flat, soft, shape = namer(f"{base}_flat"), namer(f"{base}_soft"), namer(f"{x}_shape")
            nodes.append(make("Flatten", [x], [flat], name=namer(f"{base}_flatten"), axis=axis))
            nodes.append(make("Softmax", [flat], [soft], name=namer(base), axis=-1))
            nodes.append(make("Shape", [x], [shape], name=namer(f"{base}_shape")))
            nodes.append(make("Reshape", [soft, shape], [y], name=namer(f"{base}_unflatten")))
        else:
            return None  # opset-13 meaning in an older model: qoperator_to_qdq upgrades first
        q_out(y, ins[3], ins[4])
    elif op == "QGemm" and node.domain == _MS:
        inits = edit.initializers_by_name(graph)
        a_scale, b_scale = _array(inits, ins[1]), _array(inits, ins[4])
        if a_scale is None or b_scale is None or a_scale.size != 1:
            return None
        per_column = b_scale.size > 1
        trans_b = attrs.get("transB", 0)
        a = dq(ins[0], ins[1], ins[2])
        b = dq(ins[3], ins[4], ins[5], (0 if trans_b else 1) if per_column else None)
        gemm_in = [a, b]
        if ins[6]:
            scale = (a_scale.astype(np.float32) * b_scale.astype(np.float32)).astype(np.float32)
            scale_name = _initializer(
                graph,
                namer,
                f"{base}_bias_scale",
                scale.reshape(-1) if per_column else scale.reshape(()),
            )
            zeros = np.zeros(scale.size if per_column else (), np.int32)
            zp_name = _initializer(graph, namer, f"{base}_bias_zp", zeros)
            gemm_in.append(dq(ins[6], scale_name, zp_name, 0 if per_column else None))
        gemm_attrs = {k: v for k, v in attrs.items() if k in ("alpha", "transA", "transB")}
        if not ins[7]:  # no output scale: a float result
            nodes.append(make("Gemm", gemm_in, [out], name=namer(base), **gemm_attrs))
            return nodes
        nodes.append(make("Gemm", gemm_in, [y], name=namer(base), **gemm_attrs))
        q_out(y, ins[7], ins[8])
    else:
        return None
    return nodes


PER_AXIS_OPSET = 13  # DequantizeLinear's axis (per-channel scales) is an opset-13 attribute


def qoperator_to_qdq(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """QLinear* ops (QOperator format) -> DequantizeLinear, the float op, QuantizeLinear; and
    data-moving ops on integer tensors likewise (``_integer_moves_to_qdq``).

    The QNN EP takes the QDQ format: it groups DQ -> op -> Q into one quantized HTP op, while
    QLinear* ops have no QNN kernel and stay on the CPU. The float op between the same Q/DQ
    parameters computes the same thing up to the rounding of the integer kernels (<= 1 step).
    """
    details = []
    current = edit.opset_version(model)
    if (
        current
        and current < PER_AXIS_OPSET
        and any(n.op_type in QOPERATOR_OPS for g in edit.all_graphs(model.graph) for n in g.node)
    ):
        # A per-channel weight becomes a DequantizeLinear with an axis, which opset 13 added
        # (onnxruntime's QOperator export keeps the float model's opset, often 11).
        model, _ = t.upgrade_opset(model, PER_AXIS_OPSET)
        details.append(f"opset {current} -> {PER_AXIS_OPSET}: per-axis DequantizeLinear")
    model = edit.copy_model(model)
    graph = model.graph
    namer = edit.FreshNames(model)
    opset = edit.opset_version(model) or PER_AXIS_OPSET
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        replacement = (
            _qoperator_nodes(node, namer, graph, opset) if node.op_type in QOPERATOR_OPS else None
        )
        if replacement is None:
            nodes.append(node)
            continue
        nodes.extend(replacement)
        float_op = next(n.op_type for n in replacement if n.op_type not in QDQ_OPS)
        details.append(f"{edit.node_label(node)} -> DQ + {float_op} + Q")
    if details:
        edit.set_nodes(graph, nodes)
        if not any(o.domain in ("", "ai.onnx") for o in model.opset_import):
            model.opset_import.append(onnx.helper.make_opsetid("", 13))
    if is_prequantized(model):
        edit.sort_graph(graph)
        _integer_moves_to_qdq(model, details)
    return _finish(model, "qoperator_to_qdq", details)


def _integer_moves_to_qdq(model: onnx.ModelProto, details: list[str]) -> None:
    """Data-moving ops on integer tensors (QOperator models transpose and reshape the uint8
    output of a QuantizeLinear directly) -> DQ, the op in float, Q with the same parameters.

    The QNN EP adds no integer Reshape/Transpose outside a QDQ unit ("Failed to add node"),
    and the op after them then falls to the CPU too. Q(op(DQ(q))) == op(q): exact.
    """
    graph = model.graph
    namer = edit.FreshNames(model)
    view = _Graph(graph)
    # integer tensor -> [scale, zero point] of its Q; an integer graph input (a TFLite model
    # exported with int8 I/O reshapes or transposes its input before the first DQ) gets the
    # grid of the DQ it reaches through such moves.
    grid: dict[str, list[str]] = _integer_input_grids(graph, view)
    for node in list(graph.node):
        if node.op_type == QUANTIZE and node.domain in _QDQ_DOMAINS:
            grid[node.output[0]] = list(node.input[1:3])
            continue
        splits = _splits(node)
        if not (splits or _commutes(node, view) or _interpolates(node)):
            continue
        indices = [0] if splits else _data_inputs(node)
        params = [grid.get(node.input[i]) for i in indices]
        if not params or any(p is None or p != params[0] for p in params):
            continue
        if not _integer_zero_is_float_zero(node, params[0], view):
            continue
        qparams = [name for name in params[0] if name]
        for index in indices:
            source = node.input[index]
            floated = namer(f"{source}_dq")
            graph.node.append(
                onnx.helper.make_node(
                    DEQUANTIZE, [source, *qparams], [floated], name=namer(f"{floated}_node")
                )
            )
            node.input[index] = floated
        for position, out in enumerate(node.output):
            if not out:
                continue
            node.output[position] = namer(f"{out}_float")
            graph.node.append(
                onnx.helper.make_node(
                    QUANTIZE, [node.output[position], *qparams], [out], name=namer(f"{out}_q")
                )
            )
            grid[out] = params[0]
        details.append(f"{edit.node_label(node)} on integers -> DQ + {node.op_type} + Q")


def _integer_input_grids(graph: onnx.GraphProto, view: _Graph) -> dict[str, list[str]]:
    """Integer graph input -> [scale, zero point] of the per-tensor DequantizeLinear it reaches
    through ops that only move values (each the tensor's one reader)."""
    grids = {}
    for value in graph.input:
        if value.type.tensor_type.elem_type not in _INT_RANGES or value.name in view.inits:
            continue
        tensor = value.name
        while len(readers := view.consumers.get(tensor, [])) == 1:
            reader = readers[0]
            if reader.op_type == DEQUANTIZE and reader.domain in _QDQ_DOMAINS:
                if _params(reader, view.inits) is not None:  # per tensor
                    grids[value.name] = list(reader.input[1:3])
                break
            if reader.op_type not in _VALUE_MOVES or reader.input[0] != tensor:
                break
            tensor = reader.output[0]
    return grids


def _splits(node: onnx.NodeProto) -> bool:
    """A Split: each output is a slice of its input, so Q(split(x)) == split(Q(x)) output by
    output (onnxruntime's QOperator export splits the uint8 tensor of a QLinear op directly,
    as YOLOv8's C2f blocks do), with one Q per output."""
    return node.op_type == "Split" and node.domain in _DEFAULT


def _interpolates(node: onnx.NodeProto) -> bool:
    """A Resize that interpolates (linear), which onnxruntime computes on integers when a
    QOperator model gives it one (a segmenter's uint8 logits, upsampled): between a DQ and a Q
    with the tensor's own grid it is the same interpolation up to rounding (its weights sum to
    1, so the zero point passes through), as the QLinear ops' float forms are. Not exact, so
    it is not one of the moves ``_propagate_backward`` copies a Q across."""
    return node.op_type == "Resize" and node.domain in _DEFAULT and len(node.output) == 1


def _integer_zero_is_float_zero(node: onnx.NodeProto, params: list[str], view: _Graph) -> bool:
    """Relu and zero padding on integers compare with or write integer 0, which means 0.0 only
    at a zero point of 0: elsewhere they are not the float op between a DQ and a Q."""
    if node.op_type not in ("Relu", "Pad"):
        return True
    zero_point = _array(view.inits, params[1]) if len(params) > 1 and params[1] else None
    return zero_point is None or not np.any(zero_point)


def upgrade_opset(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """``transforms.upgrade_opset``, except that a pre-quantized model keeps its opset.

    It needs no opset-21 type (the pipeline adds no 16-bit Q/DQ to it) and the QNN EP takes
    QDQ from opset 10 on; the upgrade itself has made such models unloadable. A model whose
    legacy Resize/Upsample were pinned for the upgrade (``legacy.pin_legacy_semantics``) is
    upgraded all the same: the pinned ops are opset-21 ops.
    """
    from .legacy import PINNED_DOMAIN

    pinned = any(n.domain == PINNED_DOMAIN for g in edit.all_graphs(model.graph) for n in g.node)
    if not is_prequantized(model) or pinned:
        return t.upgrade_opset(model)
    return edit.checked_change(edit.writable(model), "upgrade_opset", [])


# onnxruntime's quantizer writes its Q/DQ in com.microsoft below opset 21 when a type needs it
# (16-bit, 4-bit): the same ops, with the types ai.onnx takes from opset 21 on.
_QDQ_21_OPSET = 21


def standard_qdq_ops(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """com.microsoft QuantizeLinear/DequantizeLinear -> the ai.onnx ops, at opset 21.

    onnxruntime's 16-bit QDQ models (its quantizer below opset 21; Olive's and AI Toolkit's
    QNN models) carry them. ONNX shape inference has no schema for them: every tensor after
    one stays shapeless, and the build stopped with "no static shape" on 381 tensors of a
    uint16 face detector. The rest of the graph is upgraded first (the converter leaves the
    contrib nodes alone), then they move to the default domain, where opset 21 takes their
    types; the values are the same.
    """
    if not any(
        n.domain == "com.microsoft" and n.op_type in QDQ_OPS
        for g in edit.all_graphs(model.graph)
        for n in g.node
    ):
        return edit.checked_change(edit.writable(model), "standard_qdq_ops", [])
    details = []
    if edit.opset_version(model) < _QDQ_21_OPSET:
        model, upgraded = t.upgrade_opset(model, _QDQ_21_OPSET)
        details += list(upgraded.details)
    else:
        model = edit.copy_model(model)
    moved = 0
    for graph in edit.all_graphs(model.graph):
        for node in graph.node:
            if node.domain == "com.microsoft" and node.op_type in QDQ_OPS:
                node.domain = ""
                moved += 1
    details.append(f"{moved} com.microsoft QuantizeLinear/DequantizeLinear -> ai.onnx (opset 21)")
    return edit.checked_change(model, "standard_qdq_ops", details)


# Operands whose *value* sets the shape of the result. A DequantizeLinear of a constant there
# is an exporter's artifact, not a weight (onnxruntime's QNN config quantizes YOLOv8's anchor
# Range operands): until it is folded, no shape after it is static.
_SHAPE_OPERANDS: dict[str, tuple[int, ...]] = {
    "Range": (0, 1, 2),
    "Reshape": (1,),
    "Expand": (1,),
    "Tile": (1,),
    "ConstantOfShape": (0,),
    "Slice": (1, 2, 3, 4),
    "Resize": (1, 2, 3),
    "Upsample": (1,),
    "Pad": (1, 3),
    "TopK": (1,),
    "Squeeze": (1,),
    "Unsqueeze": (1,),
    "Split": (1,),
    "OneHot": (1,),
}


def _sets_shapes_only(tensor: str, readers: list[onnx.NodeProto]) -> bool:
    """Whether every reader takes ``tensor`` as an operand that sets its result's shape."""
    return bool(readers) and all(
        r.domain in _DEFAULT
        and all(
            i in _SHAPE_OPERANDS.get(r.op_type, ()) for i, x in enumerate(r.input) if x == tensor
        )
        for r in readers
    )


def fold_quantized_constants(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """QuantizeLinear of a constant (a weight quantized at run time) -> the integer constant;
    and a DequantizeLinear of a constant read only as a shape operand (``_SHAPE_OPERANDS``)
    -> its float value, then what that makes constant is folded too, until nothing changes.

    Computed by onnxruntime's own kernels, so each result is what the model computed on every
    run; the DequantizeLinear after a folded Q stays, and the QNN EP sees a quantized weight.
    (``fold_constants`` never folds Q/DQ: that would lose the model's quantization.)
    """
    model = edit.writable(model)
    if not is_prequantized(model):
        return edit.checked_change(model, "fold_quantized_constants", [])
    details: list[str] = []
    while _fold_constant_qdq(model, details):
        model, after = t.fold_constants(model)
        details.extend(f"then {d}" for d in after.details)
    return _finish(model, "fold_quantized_constants", details)


def _fold_constant_qdq(model: onnx.ModelProto, details: list[str]) -> bool:
    """One pass of ``fold_quantized_constants`` over ``model``, in place: whether it folded."""
    graph = model.graph
    inits = edit.initializers_by_name(graph)
    outputs = {o.name for o in graph.output}
    readers = edit.readers_by_tensor(graph)
    folded: set[int] = set()
    new_inits = []
    for index, node in enumerate(graph.node):
        if node.op_type not in (QUANTIZE, DEQUANTIZE) or node.domain not in _QDQ_DOMAINS:
            continue
        if node.input[0] not in inits or any(i and i not in inits for i in node.input):
            continue
        if node.output[0] in outputs:
            continue
        if node.op_type == DEQUANTIZE and not _sets_shapes_only(
            node.output[0], readers.get(node.output[0], [])
        ):
            continue  # a weight: it stays quantized
        values = {i: numpy_helper.to_array(inits[i]) for i in node.input if i}
        result = t.run_nodes([node], values, model)[node.output[0]]
        new_inits.append(numpy_helper.from_array(result, node.output[0]))
        folded.add(index)
        role = "" if node.op_type == QUANTIZE else ", a shape operand,"
        details.append(
            f"{edit.node_label(node)} of constant {node.input[0]!r}{role} -> {result.dtype} "
            f"{list(result.shape)}"
        )
    if folded:
        edit.drop_nodes(graph, folded)
        graph.initializer.extend(new_inits)
    return bool(folded)


def drop_noop_casts(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Remove Cast nodes that cast to the type their input already has.

    PyTorch exports put ``Cast(to=uint8)`` between a uint8 QuantizeLinear and its
    DequantizeLinear. The QNN EP then cannot group the pair and the compile fails
    ("Node ... was inserted using the NHWC format as requested by QNNExecutionProvider, but was
    not selected by that EP"). An fp16 model with fp32 inputs and outputs keeps its Casts
    after ``float16_to_float32``, now float -> float: quantized, each is a DQ -> Cast -> Q
    the HTP runs as its own requantization (39 around an IS-Net's Resizes: its ctx 2.2x
    slower on the simulator). The cast changes nothing.
    """
    model = edit.writable(model)
    if not any(n.op_type == "Cast" for n in model.graph.node):
        return edit.checked_change(model, "drop_noop_casts", [])
    graph = model.graph
    types = {name: v.type.tensor_type.elem_type for name, v in edit.inferred_values(model).items()}
    types.update({name: init.data_type for name, init in edit.initializers_by_name(graph).items()})
    details = []
    for node in graph.node:
        if node.op_type != "Cast" or node.domain not in _DEFAULT:
            continue
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        if to is None or types.get(node.input[0]) != to:
            continue
        details.append(f"{edit.node_label(node)}: input is already {_type_name(to)}")
        node.op_type = "Identity"
        del node.attribute[:]
    if details:
        removed = t.bypass_identities(graph)
        details.append(f"removed {removed} Identity node(s)")
    return _finish(model, "drop_noop_casts", details)


# --------------------------------------------------------------------------------------------
# rewrites for the QNN HTP (quantize stage, exact)


def matmul_bias_to_gemm(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """MatMul(x, DQ(weight [K, N])) + a constant bias [N] -> Gemm(x, DQ(weight), bias), for a
    2-D quantized x: the same sums.

    tf2onnx writes an int8 TFLite Dense layer so, with the bias an int32 DequantizeLinear
    beside the Add. The QNN EP takes no such DQ outside a Conv/Gemm unit: it stayed on the CPU
    (MLPerf Tiny's int8 streaming wake-word model: 1 CPU node, the build failed its coverage
    gate). As a Gemm's bias it is part of the quantized unit (``int32_biases`` then checks its
    scale).
    """
    model = edit.copy_model(model)
    graph = model.graph
    view = _Graph(graph)
    values: dict[str, onnx.ValueInfoProto] | None = None
    details = []
    for node in list(graph.node):
        if node.op_type != "MatMul" or node.domain not in _DEFAULT:
            continue
        add = _only_consumer(view, node.output[0], "Add")
        w_dq = view.weight_dq(node)
        if add is None or w_dq is None:
            continue
        bias = add.input[1] if add.input[0] == node.output[0] else add.input[0]
        weight = view.inits.get(w_dq.input[0])
        b_dq = view.constant_dq(bias)
        b_value = _dq_value(b_dq, view.inits) if b_dq is not None else _array(view.inits, bias)
        if weight is None or len(weight.dims) != 2 or b_value is None:
            continue
        if b_value.shape != (weight.dims[1],):  # a Gemm's bias: one value per column
            continue
        values = values if values is not None else edit.inferred_values(model)
        shape = edit.value_shape(values[node.input[0]]) if node.input[0] in values else None
        if shape is None or len(shape) != 2:
            continue
        node.op_type = "Gemm"
        node.input.append(bias)
        node.output[0] = add.output[0]
        graph.node.remove(add)
        view.refresh()
        details.append(f"{edit.node_label(node)} + bias Add -> Gemm")
    return _finish(model, "matmul_bias_to_gemm", details)


def int32_biases(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Biases of quantized Conv/ConvTranspose/Gemm -> int32 DequantizeLinear at scale
    input scale x weight scale, zero point 0.

    The QNN EP groups such an op into one quantized HTP op only with an int32 bias; an int8
    bias (Vitis-AI) or a float bias leaves the op as a float op on the HTP, where it is far off.
    Exact whenever the bias values are multiples of the new scale (power-of-two scales, and
    any int32 bias already at that scale); otherwise each bias moves by at most half of
    input scale x weight scale, which the detail line reports.
    """
    model = edit.copy_model(model)
    graph = model.graph
    view = _Graph(graph)
    namer = edit.FreshNames(model)
    details = []
    for node in graph.node:
        if node.op_type not in _BIASED or node.domain not in _DEFAULT or len(node.input) < 3:
            continue
        x_dq = view.activation_dq(node.input[0])
        w_dq = view.constant_dq(node.input[1])
        bias = node.input[2]
        if x_dq is None or w_dq is None or not bias:
            continue
        x_params = _params(x_dq, view.inits)
        w_scale = _array(view.inits, w_dq.input[1])
        if x_params is None or w_scale is None:
            continue
        b_dq = view.constant_dq(bias)
        if b_dq is not None:
            value = _dq_value(b_dq, view.inits)
            b_type = view.inits[b_dq.input[0]].data_type
        elif bias in view.inits:
            value = numpy_helper.to_array(view.inits[bias]).astype(np.float64)
            b_type = view.inits[bias].data_type
        else:
            continue
        if value.ndim != 1:
            continue
        scale = (np.float32(x_params.scale) * w_scale.astype(np.float32).reshape(-1)).astype(
            np.float32
        )
        if scale.size not in (1, value.size):
            continue
        current = _array(view.inits, b_dq.input[1]) if b_dq is not None else None
        if (
            b_type == onnx.TensorProto.INT32
            and current is not None
            and current.size == scale.size
            and np.array_equal(current.astype(np.float32).reshape(-1), scale)
        ):
            continue  # already what QNN wants
        steps = value / scale.astype(np.float64)
        if np.any(np.abs(steps) > np.iinfo(np.int32).max):
            continue
        quantized = np.round(steps)
        error = float(np.max(np.abs(steps - quantized))) if value.size else 0.0
        per_channel = scale.size > 1
        base = node.name or node.output[0]
        q_name = _initializer(graph, namer, f"{base}_bias_int32", quantized.astype(np.int32))
        s_name = _initializer(
            graph, namer, f"{base}_bias_scale", scale if per_channel else scale.reshape(())
        )
        z_name = _initializer(
            graph, namer, f"{base}_bias_zp", np.zeros(scale.size if per_channel else (), np.int32)
        )
        out = namer(f"{base}_bias")
        kwargs = {"axis": 0} if per_channel else {}
        dq = onnx.helper.make_node(
            DEQUANTIZE, [q_name, s_name, z_name], [out], name=namer(f"{out}_dq"), **kwargs
        )
        graph.node.append(dq)
        node.input[2] = out
        was = _type_name(b_type)
        exact = "exact" if error == 0 else f"moved by <= {error:.3g} of its step"
        details.append(
            f"{edit.node_label(node)}: {was} bias -> int32 at input x weight scale ({exact})"
        )
    return _finish(model, "int32_biases", details)


def _per_channel_grid(
    node: onnx.NodeProto, inits: dict[str, onnx.TensorProto]
) -> tuple[np.ndarray, np.ndarray, int] | None:
    """(scales, zero points, type) of a Q/DQ with constant per-channel parameters, or None."""
    scale = _array(inits, node.input[1]) if len(node.input) > 1 else None
    if scale is None or scale.size < 2:
        return None
    zp_name = node.input[2] if len(node.input) > 2 else ""
    if zp_name and zp_name not in inits:
        return None
    elem_type = inits[zp_name].data_type if zp_name else onnx.TensorProto.UINT8
    zp = _array(inits, zp_name) if zp_name else np.zeros(scale.shape, np.int64)
    if elem_type not in _INT_RANGES or zp.shape != scale.shape:
        return None
    return scale.astype(np.float64).reshape(-1), zp.astype(np.int64).reshape(-1), elem_type


def _same_grid(a: onnx.NodeProto, b: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> bool:
    grid_a, grid_b = _per_channel_grid(a, inits), _per_channel_grid(b, inits)
    axis = [next((x.i for x in n.attribute if x.name == "axis"), 1) for n in (a, b)]
    return (
        grid_a is not None
        and grid_b is not None
        and axis[0] == axis[1]
        and grid_a[2] == grid_b[2]
        and np.array_equal(grid_a[0], grid_b[0])
        and np.array_equal(grid_a[1], grid_b[1])
    )


def _one_grid(inits: dict[str, onnx.TensorProto], *nodes: onnx.NodeProto) -> bool:
    """Whether Q/DQ ``nodes`` all have the same per-tensor scale, zero point and type."""
    grids = {
        (p.scale, p.zero_point, p.elem_type) if p else None
        for p in (_params(n, inits) for n in nodes)
    }
    return len(grids) == 1 and None not in grids


def per_tensor_activations(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Activations quantized per channel (a Q/DQ pair with one scale per channel) -> one grid
    of the same width (unsigned) over the union of the channels' ranges.

    The HTP quantizes only constant tensors (weights) per channel. NNCF (OpenVINO) quantizes
    the input of a depthwise Conv per channel; the QNN EP then declines the Conv ("inserted
    using the NHWC format ... but was not selected") and the compile fails. A wider type would
    keep each channel's step, but the QNN EP groups a Conv only with its input and output of
    one type, so the grid keeps the width. Not exact: the step is the coarsest channel's, and a
    channel is clipped at the union's bounds instead of its own.
    """
    model = edit.copy_model(model)
    graph = model.graph
    view = _Graph(graph)
    namer = edit.FreshNames(model)
    details: list[str] = []
    retyped: dict[str, int] = {}
    for q in list(graph.node):
        if q.op_type != QUANTIZE or q.domain not in _QDQ_DOMAINS or q.input[0] in view.inits:
            continue
        grid = _per_channel_grid(q, view.inits)
        readers = view.consumers.get(q.output[0], [])
        if grid is None or not readers or q.output[0] in view.outputs:
            continue
        if not all(r.op_type == DEQUANTIZE and _same_grid(q, r, view.inits) for r in readers):
            continue
        scales, zps, elem_type = grid
        low, high = _INT_RANGES[elem_type]
        lowest = float(min(0.0, np.min((low - zps) * scales)))
        highest = float(max(0.0, np.max((high - zps) * scales)))
        if not highest > lowest:
            continue
        twin = _UNSIGNED_TWIN.get(elem_type, (elem_type, 0, None))[0]
        type_low, type_high = _INT_RANGES[twin]
        scale = np.float32((highest - lowest) / (type_high - type_low))
        zero_point = np.clip(np.round(type_low - lowest / float(scale)), type_low, type_high)
        unsigned = np.uint8 if twin == onnx.TensorProto.UINT8 else np.uint16
        base = q.input[0]
        s_name = _initializer(graph, namer, f"{base}_pt_scale", np.array(scale, np.float32))
        z_name = _initializer(graph, namer, f"{base}_pt_zp", np.array(zero_point, unsigned))
        for node in [q, *readers]:
            node.input[1], node.input[2:] = s_name, [z_name]
            kept = [a for a in node.attribute if a.name not in ("axis", "output_dtype")]
            del node.attribute[:]
            node.attribute.extend(kept)
        retyped[q.output[0]] = twin
        details.append(
            f"{edit.node_label(q)}: {_type_name(elem_type)} per channel ({scales.size} scales, "
            f"{scales.min():.3g}..{scales.max():.3g}) -> {_type_name(twin)} per tensor over "
            f"[{lowest:.4g}, {highest:.4g}]"
        )
    for value in graph.value_info:
        if value.name in retyped and value.type.HasField("tensor_type"):
            value.type.tensor_type.elem_type = retyped[value.name]
    return _finish(model, "per_tensor_activations", details)


def _channel_constant(
    view: _Graph, node: onnx.NodeProto, operand: str, channels: int
) -> np.ndarray | None:
    """The other operand of a Mul/Add beside ``operand``: a constant of one value per channel
    of an NCHW result ([C, 1, 1], [1, C, 1, 1] or one value), as [C] float64; else None."""
    if node.domain not in _DEFAULT or len(node.input) != 2 or operand not in node.input:
        return None
    other = node.input[1] if node.input[0] == operand else node.input[0]
    value = _array(view.inits, other)
    if value is None or value.dtype.kind != "f":
        return None
    if value.size == 1:
        return np.full(channels, float(value.reshape(())), np.float64)
    squeezed = [d for d in value.shape if d != 1]
    if value.size != channels or squeezed != [channels] or len(value.shape) > 4:
        return None
    if value.shape[-3 if len(value.shape) >= 3 else 0] != channels or value.ndim not in (3, 4):
        return None
    return value.astype(np.float64).reshape(-1)


def _again_at_opset_13(
    model: onnx.ModelProto, step: Callable[[onnx.ModelProto], tuple[onnx.ModelProto, Change]]
) -> tuple[onnx.ModelProto, Change]:
    """``step`` on the model upgraded to opset 13, where DequantizeLinear takes an axis (per-
    channel weights); Q/DQ keep their meaning from opset 10 to 13."""
    upgraded, _ = t.upgrade_opset(model, 13)
    result, change = step(upgraded)
    details = [*change.details, "opset upgraded to 13 for per-channel weights"]
    return edit.checked_change(result, change.step, details)


def _bias_on_grid(conv: onnx.NodeProto, view: _Graph, weight_scale: np.ndarray) -> bool:
    """Whether a Conv's bias values are whole multiples of input x weight scale already, the
    grid int32_biases puts them on (a Vitis-AI model's power-of-two scales): no step moves."""
    x_params = _params(view.activation_dq(conv.input[0]), view.inits)
    b_dq = view.constant_dq(conv.input[2])
    bias = _dq_value(b_dq, view.inits) if b_dq is not None else _array(view.inits, conv.input[2])
    if x_params is None or bias is None or bias.size != weight_scale.size:
        return False
    grid = (np.float32(x_params.scale) * weight_scale.astype(np.float32)).astype(np.float64)
    steps = bias.astype(np.float64).reshape(-1) / grid
    return bool(np.all(steps == np.round(steps)))


def finer_weight_steps(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Symmetric int8 weights of a Conv whose output channel uses a fraction of the int8 range
    (per-tensor weights: a depthwise channel at |q| <= 18 where another reaches 127) -> that
    channel's integers times a power of two, its scale divided by it: the same values, exactly.

    Why: the QNN EP takes a quantized Conv's bias only as int32 at input scale x weight scale,
    and a coarse weight step makes that grid coarse too: NNCF's per-tensor weights (below opset
    13) put PP-PicoDet's first biases 3 steps from zero (the bias moved by up to 1.1 where the
    output's step is 0.2; the model 2.3 dB from itself on the CPU). A finer weight step makes the
    bias grid finer by the same factor. Per-channel weights: opset 13 at least. A bias already
    on its grid is left as it is: onnxruntime's integer kernels round other weights differently
    (a Vitis-AI RetinaFace: inf -> 26.2 dB from itself on the CPU, for nothing).
    """
    model = edit.copy_model(model)
    graph = model.graph
    view = _Graph(graph)
    namer = edit.FreshNames(model)
    details = []
    for conv in graph.node:
        if conv.op_type != "Conv" or conv.domain not in _DEFAULT or len(conv.input) < 3:
            continue
        w_dq, bias = view.weight_dq(conv), conv.input[2]
        if w_dq is None or not bias:
            continue
        b_dq = view.constant_dq(bias)
        if b_dq is not None and view.inits[b_dq.input[0]].data_type == onnx.TensorProto.INT32:
            continue  # an int32 bias is the model's own: its grid is already what it is
        weights = _array(view.inits, w_dq.input[0])
        zp_name = w_dq.input[2] if len(w_dq.input) > 2 else ""
        zero = _array(view.inits, zp_name) if zp_name else np.zeros(1, np.int8)
        if weights is None or weights.dtype != np.int8 or weights.ndim != 4 or np.any(zero):
            continue
        channels = weights.shape[0]
        given = _array(view.inits, w_dq.input[1])
        axis = next((a.i for a in w_dq.attribute if a.name == "axis"), 1)
        if given is None or given.size not in (1, channels) or (given.size > 1 and axis != 0):
            continue  # per tensor, or per output channel: the only scales this step refines
        peak = np.abs(weights.reshape(channels, -1).astype(np.int64)).max(axis=1)
        # a channel of zeros takes any step: one 2^16 finer leaves its bias nearly as it was
        factor = np.where(peak > 0, 2.0 ** np.floor(np.log2(127 / np.maximum(peak, 1))), 2.0**16)
        scale = np.broadcast_to(given.astype(np.float32).reshape(-1), (channels,))
        if not np.any(factor > 1) or _bias_on_grid(conv, view, scale):
            continue  # nothing to refine, or nothing to gain: the bias is on its grid already
        if edit.opset_version(model) < 13:  # per-channel weights need DequantizeLinear's axis
            return _again_at_opset_13(model, finer_weight_steps)
        shape = (channels,) + (1,) * (weights.ndim - 1)
        base = conv.name or conv.output[0]
        q_name = _initializer(
            graph, namer, f"{base}_w_finer", (weights * factor.reshape(shape)).astype(np.int8)
        )
        s_name = _initializer(
            graph, namer, f"{base}_w_scale_finer", (scale / factor).astype(np.float32)
        )
        z_name = _initializer(graph, namer, f"{base}_w_zp_finer", np.zeros(channels, np.int8))
        out = namer(f"{base}_w_finer_dq")
        graph.node.append(
            onnx.helper.make_node(
                DEQUANTIZE, [q_name, s_name, z_name], [out], name=namer(out), axis=0
            )
        )
        conv.input[1] = out
        details.append(
            f"{edit.node_label(conv)}: {int(np.sum(factor > 1))} of {channels} output channels' "
            f"weight steps made up to {int(factor.max())}x finer (their bias grid too)"
        )
    return _finish(model, "finer_weight_steps", details)


def affine_into_quantized_conv(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A per-channel Mul (and Add) after a quantized Conv -> the Conv's weight scales (and bias).

    An unfolded BatchNormalization (paddle2onnx leaves them; preparation writes them as a
    Mul and an Add) after a Conv whose weights a tool quantized (NNCF) leaves the Conv without a
    quantized result: the QNN EP runs it and the affine in float, and onnxruntime's CPU fuses
    them and re-quantizes the weights per tensor (a CIFAR classifier: 16.4 dB from itself on
    the CPU). The factor of each output channel goes into its weight scale (its integers kept,
    negated where the factor is negative and the zero point 0), the shift into the bias: exact
    but for float32 rounding. Needs per-channel weights: a model below opset 13 is upgraded to
    it unless one factor serves all.
    """
    model = edit.copy_model(model)
    graph = model.graph
    view = _Graph(graph)
    namer = edit.FreshNames(model)
    per_channel_ok = edit.opset_version(model) >= 13
    details = []
    for conv in list(graph.node):
        if conv.op_type != "Conv" or conv.domain not in _DEFAULT:
            continue
        w_dq = view.weight_dq(conv)
        if w_dq is None:
            continue
        weights = _array(view.inits, w_dq.input[0])
        readers = view.consumers.get(conv.output[0], [])
        if weights is None or weights.ndim != 4 or len(readers) != 1:
            continue
        channels = weights.shape[0]
        mul = readers[0]
        if mul.op_type != "Mul" or conv.output[0] in view.outputs:
            continue
        factor = _channel_constant(view, mul, conv.output[0], channels)
        if factor is None or not np.all(factor != 0):
            continue
        last, shift = mul, np.zeros(channels)
        after = view.consumers.get(mul.output[0], [])
        if len(after) == 1 and mul.output[0] not in view.outputs and after[0].op_type == "Add":
            added = _channel_constant(view, after[0], mul.output[0], channels)
            if added is not None:
                last, shift = after[0], added
        scale = _array(view.inits, w_dq.input[1]).astype(np.float64).reshape(-1)
        zp_name = w_dq.input[2] if len(w_dq.input) > 2 else ""
        zero = _array(view.inits, zp_name) if zp_name else np.zeros(1, weights.dtype)
        zero = np.broadcast_to(zero.reshape(-1), (channels,)).astype(np.int64)
        negative = factor < 0
        info = np.iinfo(weights.dtype)
        flipped = -weights[negative].astype(np.int64)
        if np.any(negative) and (
            np.any(zero[negative]) or (flipped.size and flipped.max() > info.max)
        ):
            continue
        new_scale = np.broadcast_to(scale, (channels,)) * np.abs(factor)
        uniform = bool(np.all(new_scale == new_scale[0]))
        if not uniform and not per_channel_ok:
            return _again_at_opset_13(model, affine_into_quantized_conv)
        new_weights = weights.copy()
        new_weights[negative] = flipped.astype(weights.dtype)
        bias_name = conv.input[2] if len(conv.input) > 2 else ""
        if bias_name:
            b_dq = view.constant_dq(bias_name)
            bias = (
                _dq_value(b_dq, view.inits) if b_dq is not None else _array(view.inits, bias_name)
            )
            if bias is None:
                continue
            bias = bias.astype(np.float64).reshape(-1)
        else:
            bias = np.zeros(channels)
        base = conv.name or conv.output[0]
        w_name = _initializer(graph, namer, f"{base}_w_folded", new_weights)
        s_name = _initializer(
            graph,
            namer,
            f"{base}_w_scale_folded",
            new_scale.astype(np.float32)[:1].reshape(())
            if uniform
            else new_scale.astype(np.float32),
        )
        z_value = zero.astype(weights.dtype)
        z_name = _initializer(
            graph, namer, f"{base}_w_zp_folded", z_value[:1].reshape(()) if uniform else z_value
        )
        w_out = namer(f"{base}_w_folded_dq")
        attributes = {} if uniform else {"axis": 0}
        graph.node.append(
            onnx.helper.make_node(
                DEQUANTIZE, [w_name, s_name, z_name], [w_out], name=namer(w_out), **attributes
            )
        )
        b_name = _initializer(
            graph, namer, f"{base}_bias_folded", (bias * factor + shift).astype(np.float32)
        )
        conv.input[1:] = [w_out, b_name]
        conv.output[0] = last.output[0]
        removed = [mul] if last is mul else [mul, last]
        for node in removed:
            graph.node.remove(node)
        view.refresh()
        details.append(
            f"{edit.node_label(conv)}: {' and '.join(edit.node_label(n) for n in removed)} "
            f"folded into its weight scales and bias"
        )
    return _finish(model, "affine_into_quantized_conv", details)


def _fuses_into_conv(clip: onnx.NodeProto, view: _Graph) -> bool:
    """A Clip read after a Conv/ConvTranspose whose input and weights are quantized and whose
    result only it reads: what the QNN EP fuses into the Conv when the Clip is redundant."""
    conv = view.producer.get(clip.input[0])
    return (
        conv is not None
        and conv.op_type in ("Conv", "ConvTranspose")
        and conv.domain in _DEFAULT
        and view.weight_dq(conv) is not None
        and len(view.consumers.get(conv.output[0], [])) == 1
        and conv.output[0] not in view.outputs
    )


def _redundant_before(activation: onnx.NodeProto, q: onnx.NodeProto, view: _Graph) -> bool:
    """Whether a Relu or Clip changes nothing that the Q after it keeps (the QNN EP's test for
    fusing it into the Conv before it): the Q's range starts at zero for a Relu, lies within
    the bounds for a Clip."""
    params = _params(q, view.inits)
    if params is None:
        return False
    low, high = _INT_RANGES[params.elem_type]
    bottom = (low - params.zero_point) * params.scale
    top = (high - params.zero_point) * params.scale
    if activation.op_type == "Relu":
        return bottom >= 0
    bounds = _clip_bounds(activation, view.inits)
    epsilon = float(np.finfo(np.float32).eps)
    return bounds is not None and bounds[0] - bottom <= epsilon and top - bounds[1] <= epsilon


def _output_quantized(node: onnx.NodeProto, view: _Graph) -> bool:
    """Whether the op's result reaches a QuantizeLinear as the QNN EP groups it: read only by
    such (a float reader beside one leaves the op ungrouped: a detector head's Conv read by its
    box decoding and its Q), or (Conv, ConvTranspose) through the Relu or Clip that it fuses."""
    readers = view.consumers.get(node.output[0], [])
    if readers and all(r.op_type == QUANTIZE for r in readers):
        return node.output[0] not in view.outputs
    if node.op_type in ("Conv", "ConvTranspose") and len(readers) == 1:
        activation = readers[0]
        if activation.op_type in ("Relu", "Clip"):
            after = view.consumers.get(activation.output[0], [])
            return (
                len(after) == 1
                and after[0].op_type == QUANTIZE
                and _redundant_before(activation, after[0], view)
            )
    return False


def _inputs_quantized(node: onnx.NodeProto, view: _Graph) -> bool:
    """Whether every data input of a Conv/Gemm/MatMul comes from a DequantizeLinear (the
    activation for Conv, ConvTranspose and Gemm, whose weight and bias may be constants)."""
    data = node.input[:2] if node.op_type == "MatMul" else node.input[:1]
    return all(view.dq_of(name) is not None for name in data)


def float_op_weights(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Quantized weights and biases of a Conv/Gemm/MatMul whose result is left in float, or
    whose activation input is -> their float values (what the DequantizeLinear computes).

    NNCF and TensorRT-style exports leave a model's last layers (before a Sigmoid, Softmax or
    box decoding) unquantized at the output, and PPQ's exports can leave a Conv's input in
    float after an unfolded BatchNorm: such an op is no quantized unit for the QNN EP, which
    then runs it in float on the HTP but leaves the DequantizeLinear of its constants on the
    CPU (an int32 bias: code 3110; a per-channel weight) and the model is cut in two. Exact:
    the constants hold the values the DequantizeLinear gave.
    """
    model = edit.copy_model(model)
    graph = model.graph
    view = _Graph(graph)
    namer = edit.FreshNames(model)
    details = []
    for node in graph.node:
        if node.op_type not in _WEIGHTED or node.domain not in _DEFAULT:
            continue
        if _inputs_quantized(node, view) and _output_quantized(node, view):
            continue
        folded = []
        for index, name in enumerate(node.input):
            dq = view.constant_dq(name) if name else None
            if dq is None:
                continue
            value = _dq_value(dq, view.inits).astype(np.float32)
            node.input[index] = _initializer(graph, namer, f"{name}_float", value)
            folded.append(name)
        if folded:
            details.append(
                f"{edit.node_label(node)} (no quantized unit: an input or its result in "
                "float): "
                f"{', '.join(repr(f) for f in folded)} dequantized into constants"
            )
    return _finish(model, "float_op_weights", details)


def signed_weights(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """uint8 weights of an op whose activation input is int8/int16 -> int8, zero point - 128.

    onnxruntime's selectors group a signed-activation Conv/MatMul/Gemm only with signed
    weights (an int16-activation Conv with uint8 weights fails to compile on the HTP).
    (w - 128) with zero point (z - 128) dequantizes to the same values: exact.
    """
    return _shifted_weights(
        model, "signed_weights", _WEIGHTED, onnx.TensorProto.UINT8, -128, np.int8, "weight", _SIGNED
    )


def symmetric_sixteen_bit_weights(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """uint16 weights whose values less their zero point fit int16 -> int16 with zero point 0
    (q - z on the same scale: exact), the 16-bit weights QNN's HTP takes.

    8-bit weights stored in uint16 (zero points 108-139: onnxruntime's own A16W16 MobileNet-
    EdgeTPU test model, an 8-bit one retyped) are computed as something else on the HTP: kept
    as quantized, 0.3 dB from itself there, its first Conv at 0.0 dB against the CPU QDQ
    model; as int16, that Conv is right. Full-range uint16 weights (onnxruntime's QUInt16,
    zero points near 32768), which do not fit, the HTP computes right (80 dB): left alone."""
    model = edit.copy_model(model)
    graph = model.graph
    view = _Graph(graph)
    namer = edit.FreshNames(model)
    details = []
    converted: dict[tuple[str, str, str], str] = {}
    for node, _, w_dq in _weight_readers(graph, view, _WEIGHTED):
        weight, zp = view.inits[w_dq.input[0]], view.inits.get(w_dq.input[2])
        if weight.data_type != onnx.TensorProto.UINT16 or zp is None:
            continue
        key = (w_dq.input[0], w_dq.input[1], w_dq.input[2])
        if key not in converted:
            q = numpy_helper.to_array(weight).astype(np.int64)
            z = numpy_helper.to_array(zp).astype(np.int64)
            axis = edit.attribute(w_dq, "axis", 1) % max(q.ndim, 1)
            shape = [1] * q.ndim
            if z.size > 1:
                shape[axis] = -1
            centred = q - z.reshape(shape)
            if centred.size and (centred.min() < -32768 or centred.max() > 32767):
                continue
            stored = centred.astype(np.int16)
            w_name = _initializer(graph, namer, f"{w_dq.input[0]}_int16", stored)
            s_name = w_dq.input[1]  # the same scale
            z_name = _initializer(
                graph, namer, f"{w_dq.input[2]}_int16", np.zeros(z.shape, np.int16)
            )
            out = namer(f"{w_dq.output[0]}_int16")
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in w_dq.attribute}
            graph.node.append(
                onnx.helper.make_node(
                    DEQUANTIZE, [w_name, s_name, z_name], [out], name=namer(f"{out}_dq"), **attrs
                )
            )
            converted[key] = out
        node.input[1] = converted[key]
        details.append(
            f"{edit.node_label(node)}: uint16 weight {w_dq.input[0]!r} with its zero point -> "
            "int16, zero point 0 (exact)"
        )
    return _finish(model, "symmetric_sixteen_bit_weights", details)


# Signed activation type -> (its unsigned twin, the zero-point shift, numpy type).
_UNSIGNED_TWIN = {
    onnx.TensorProto.INT8: (onnx.TensorProto.UINT8, 128, np.uint8),
    onnx.TensorProto.INT16: (onnx.TensorProto.UINT16, 32768, np.uint16),
}


def unsigned_activations(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """int8/int16 activations (a QuantizeLinear of a computed tensor and the DequantizeLinears
    that read it) -> uint8/uint16, zero point + 128/32768: the same grid, exactly.

    The QNN EP maps int8 activations onto the HTP's unsigned ones itself for Conv and most
    ops, but not for all: in models that onnxruntime quantized with signed activations
    (``ActivationSymmetric``, as for CPU int8 kernels) it declined every quantized
    BatchNormalization and HardSigmoid (a face detector in 29 partitions, a text-direction
    classifier in 45), and a segmenter compiled whole ran at -3 dB against its CPU self; with
    int16 ones it declined an Exp and a depthwise Conv and the compile failed. The same
    models with their activations moved to unsigned ran whole and agreed. All or none: a
    model with integer graph inputs or outputs (a TFLite int8 export) keeps its types, since
    the EP groups an op with its DQs and Q only when their types agree (a Reshape of the int8
    input, moved between a DQ and a Q, was left on the CPU with a uint8 Q after it).
    """
    model = edit.copy_model(model)
    graph = model.graph
    view = _Graph(graph)
    if any(
        v.type.tensor_type.elem_type in _INT_RANGES and v.name not in view.inits
        for v in (*graph.input, *graph.output)
    ):  # integer graph I/O
        return edit.checked_change(model, "unsigned_activations", [])
    namer = edit.FreshNames(model)
    shifted: dict[str, str] = {}  # a signed zero point -> its unsigned twin
    # The HTP computes a 16-bit MatMul of two activations right with int16, not with uint16
    # (qdq_htp.signed_activation_products re-encodes ours so): an attention model keeps its
    # int16 activations, all of them, so that no unit mixes the two.
    types = dict(_UNSIGNED_TWIN)
    if any(
        n.op_type == "MatMul" and all(view.activation_dq(i) is not None for i in n.input[:2])
        for n in graph.node
    ):
        types.pop(onnx.TensorProto.INT16)
    outputs = {o.name for o in graph.output}

    def unsigned_zero_point(name: str) -> str:
        if name not in shifted:
            _, shift, dtype = _UNSIGNED_TWIN[view.inits[name].data_type]
            zero = numpy_helper.to_array(view.inits[name]).astype(np.int32) + shift
            suffix = np.dtype(dtype).name
            shifted[name] = _initializer(graph, namer, f"{name}_{suffix}", zero.astype(dtype))
        return shifted[name]

    details = []
    retyped: dict[str, int] = {}
    for q in list(graph.node):
        if q.op_type != QUANTIZE or q.domain not in _QDQ_DOMAINS or len(q.input) < 3:
            continue
        if q.input[0] in view.inits or q.output[0] in outputs:
            continue
        zero = view.inits.get(q.input[2])
        if zero is None or zero.data_type not in types:
            continue
        readers = view.consumers.get(q.output[0], [])
        if not readers or any(
            r.op_type != DEQUANTIZE
            or len(r.input) < 3
            or view.inits.get(r.input[2]) is None
            or view.inits[r.input[2]].data_type != zero.data_type
            for r in readers
        ):
            continue
        twin, shift, _ = _UNSIGNED_TWIN[zero.data_type]
        q.input[2] = unsigned_zero_point(q.input[2])
        for attribute in q.attribute:
            if attribute.name == "output_dtype":
                attribute.i = twin
        for reader in readers:
            reader.input[2] = unsigned_zero_point(reader.input[2])
        retyped[q.output[0]] = twin
        before = onnx.TensorProto.DataType.Name(zero.data_type).lower()
        after = onnx.TensorProto.DataType.Name(twin).lower()
        details.append(
            f"{edit.node_label(q)}: {before} activation -> {after}, zero point + {shift}"
        )
    for value in graph.value_info:
        if value.name in retyped and value.type.HasField("tensor_type"):
            value.type.tensor_type.elem_type = retyped[value.name]
    return _finish(model, "unsigned_activations", details)


def pads_into_quantized_convs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A quantized Pad of zeros before a Conv (DQ -> Pad -> Q -> DQ -> Conv, the Pad's Q/DQ on
    the grid of the DQ before it, as TFLite requires) -> the Conv with those pads, reading that
    first DQ: the same sums over the same zeros (0.0 is on every grid, at its zero point).

    Why: the HTP fills an explicit Pad wrongly at the end of larger tensors (the "same" padding
    TFLite and tf2onnx write before a stride-2 Conv: ZeroPadding2D ((0, 1), (0, 1))), at every
    type (a depthwise 3x3 at stride 2 over 8x16x16: uint16 at zero point 0 16.4 dB against
    the CPU, uint8 at 128 12.4 dB; as the Conv's own pads 92.7 dB and exact), and an int8 Pad
    without a constant_value (tf2onnx writes none) on any side (``explicit_pad_values``).
    ``legacy.fold_pad_into_conv`` does this for float models before quantization; a
    pre-quantized model keeps its Pad between its own Q/DQ, where that fold does not look (a
    TFLite int8 MobileNetV2: 7.8 dB from itself on the HTP, diverging at its first Pad)."""
    model = edit.copy_model(model)
    graph = model.graph
    view = _Graph(graph)
    details = []
    for conv in graph.node:
        if conv.op_type != "Conv" or conv.domain not in _DEFAULT or len(conv.input) < 2:
            continue
        dq = view.activation_dq(conv.input[0])
        q = view.producer.get(dq.input[0]) if dq is not None else None
        pad = view.producer.get(q.input[0]) if q is not None and q.op_type == QUANTIZE else None
        if pad is None or pad.op_type != "Pad" or pad.domain not in _DEFAULT:
            continue
        before = view.activation_dq(pad.input[0])
        if before is None or not _one_grid(view.inits, before, q, dq):
            continue  # a Pad of a float tensor, or one that requantizes: the HTP needs an op
        if any(len(view.consumers.get(n, [])) != 1 for n in (pad.output[0], q.output[0])):
            continue
        if len(view.consumers.get(dq.output[0], [])) != 1 or view.outputs & {
            pad.output[0],
            q.output[0],
            dq.output[0],
        }:
            continue
        weight = view.inits.get(conv.input[1])
        weight_dq = view.constant_dq(conv.input[1]) if weight is None else None
        dims = weight.dims if weight is not None else None
        if dims is None and weight_dq is not None:
            dims = view.inits[weight_dq.input[0]].dims
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in conv.attribute}
        if dims is None or len(dims) < 3:
            continue
        if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET", b"VALID", "VALID"):
            continue
        rank = len(dims)
        spec = legacy.constant_pad_spec(model, pad, rank)
        if spec is None or spec[1] != 0.0:
            continue
        new = legacy.pads_added(attrs, spec[0], rank)
        if new is None:
            continue
        legacy.set_pads(conv, new)
        conv.input[0] = pad.input[0]  # the DQ before the Pad; the Pad's Q/DQ end unread
        details.append(f"{edit.node_label(pad)} folded into {edit.node_label(conv)}: pads {new}")
    return _finish(model, "pads_into_quantized_convs", details)


def explicit_pad_values(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A constant-mode Pad of a dequantized tensor without a constant_value -> the same Pad
    with an explicit 0.0 (the default it stands for): the same tensor.

    Why: the HTP pads such an int8 tensor with the wrong value (an int8 Pad at zero point -128,
    both sides: 1.0 dB against the CPU; end only: 7.0 dB), and right with the 0.0 written out
    (exact), measured on the simulator (QNN 2.51). tf2onnx writes TFLite's Pads without one;
    those before a Conv fold into it first (``pads_into_quantized_convs``)."""
    model = edit.copy_model(model)
    graph = model.graph
    view = _Graph(graph)
    namer = edit.FreshNames(model)
    zero: dict[int, str] = {}
    details = []
    for pad in graph.node:
        if pad.op_type != "Pad" or pad.domain not in _DEFAULT or len(pad.input) < 2:
            continue
        if any(a.name in ("pads", "value") for a in pad.attribute):
            continue  # opset < 11, where the value is an attribute (0.0 by default, written)
        mode = next((a.s for a in pad.attribute if a.name == "mode"), b"constant")
        if mode not in (b"constant", "constant") or (len(pad.input) > 2 and pad.input[2]):
            continue
        dq = view.activation_dq(pad.input[0])
        scale = _array(view.inits, dq.input[1]) if dq is not None else None
        if scale is None:
            continue
        dtype = np.dtype(scale.dtype)
        if dtype.num not in zero:
            zero[dtype.num] = _initializer(graph, namer, "pad_zero", np.zeros((), dtype))
        if len(pad.input) == 2:
            pad.input.append(zero[dtype.num])
        else:
            pad.input[2] = zero[dtype.num]
        details.append(f"{edit.node_label(pad)}: constant_value 0 written out")
    return _finish(model, "explicit_pad_values", details)


def batchnorm_as_depthwise_conv(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A quantized BatchNormalization (DQ -> BN -> Q) -> a 1x1 depthwise Conv doing the same
    per-channel scale and shift, its weights int8 per channel and its bias int32.

    Why: the QNN EP builds a quantized BatchNormalization by folding mean and variance into a
    new scale and bias, reading every parameter through quantization parameters, which the
    float beta, mean and variance that onnxruntime's quantizer leaves have none of: a text-
    direction classifier quantized by onnxruntime, its BNs left unfolded by paddle2onnx, came
    out at -2.4 dB on the HTP at its first BN (5.9 dB for the model), and moving that BN's mean
    by 1e-5 gave 44 dB: what the EP computes there is not the model. With int8 activations it
    declines the BN altogether. One int8 weight per channel at its own scale holds each
    channel's factor to float32 precision, and the int32 bias at input x weight scale holds
    the shift within 1/254 of an input step times the factor (the classifier: 21.2 dB, at its
    own rounding floor; its first BN 46.8 dB).
    """
    model = edit.copy_model(model)
    graph = model.graph
    view = _Graph(graph)
    namer = edit.FreshNames(model)
    if not any(n.op_type == "BatchNormalization" for n in graph.node):
        return edit.checked_change(model, "batchnorm_as_depthwise_conv", [])
    shapes = {name: edit.value_shape(v) for name, v in edit.inferred_values(model).items()}
    details = []
    for node in list(graph.node):
        if node.op_type != "BatchNormalization" or node.domain not in _DEFAULT:
            continue
        x_dq = view.activation_dq(node.input[0])
        x_params = _params(x_dq, view.inits) if x_dq is not None else None
        readers = view.consumers.get(node.output[0], [])
        if x_params is None or not readers or any(r.op_type != QUANTIZE for r in readers):
            continue
        if any(o for o in node.output[1:]) or len(node.input) < 5:
            continue
        shape = shapes.get(node.input[0])
        if shape is None or len(shape) not in (3, 4):
            continue
        values = []
        for name in node.input[1:5]:
            dq = view.constant_dq(name)
            value = _dq_value(dq, view.inits) if dq is not None else _array(view.inits, name)
            values.append(None if value is None else np.asarray(value, np.float64).reshape(-1))
        if any(v is None or v.size != shape[1] for v in values):
            continue
        gamma, beta, mean, var = values
        epsilon = edit.attribute(node, "epsilon", 1e-5)
        factor = gamma / np.sqrt(var + epsilon)
        shift = beta - mean * factor
        # One int8 step of each channel's weight is |factor| / 127 (127 itself then), raised
        # where the bias would not fit int32 at input x weight scale.
        bias_room = np.abs(shift) / (x_params.scale * (2**31 - 1))
        step = np.maximum(np.abs(factor) / 127, bias_room)
        step = np.where(step > 0, step, 1.0).astype(np.float32)
        weight = np.clip(np.round(factor / step), -127, 127).astype(np.int8)
        bias_scale = (np.float32(x_params.scale) * step).astype(np.float32)
        bias = np.round(shift / bias_scale.astype(np.float64))
        bias = np.clip(bias, -(2**31) + 1, 2**31 - 1).astype(np.int32)
        channels = shape[1]
        kernel = [1] * (len(shape) - 2)
        base = node.name or node.output[0]
        w_name = _initializer(
            graph, namer, f"{base}_dw_weight", weight.reshape(channels, 1, *kernel)
        )
        w_scale = _initializer(graph, namer, f"{base}_dw_weight_scale", step)
        w_zero = _initializer(graph, namer, f"{base}_dw_weight_zp", np.zeros(channels, np.int8))
        b_name = _initializer(graph, namer, f"{base}_dw_bias", bias)
        b_scale = _initializer(graph, namer, f"{base}_dw_bias_scale", bias_scale)
        b_zero = _initializer(graph, namer, f"{base}_dw_bias_zp", np.zeros(channels, np.int32))
        w_out, b_out = namer(f"{base}_dw_weight_dq"), namer(f"{base}_dw_bias_dq")
        graph.node.extend(
            [
                onnx.helper.make_node(
                    DEQUANTIZE, [w_name, w_scale, w_zero], [w_out], name=namer(w_out), axis=0
                ),
                onnx.helper.make_node(
                    DEQUANTIZE, [b_name, b_scale, b_zero], [b_out], name=namer(b_out), axis=0
                ),
            ]
        )
        conv = onnx.helper.make_node(
            "Conv",
            [node.input[0], w_out, b_out],
            [node.output[0]],
            name=namer(f"{base}_as_depthwise_conv"),
            group=channels,
            kernel_shape=kernel,
        )
        graph.node.remove(node)
        graph.node.append(conv)
        details.append(
            f"{edit.node_label(node)} -> 1x1 depthwise Conv, int8 weight per channel, int32 bias"
        )
    return _finish(model, "batchnorm_as_depthwise_conv", details)


def clip_bounds_on_the_grid(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A quantized Clip whose output grid reaches past its bounds -> the same number of levels
    spread over the bounds (where the grid holds zero), its Q and the DQs after it alike.

    Why: the HTP does not clip in a quantized Clip; it leaves that to the saturation of the
    output's grid. A grid wider than the bounds (an int8 symmetric grid on a ReLU6, as
    onnxruntime writes with ActivationSymmetric; a uint8 grid from 0 to 12 on one) then passes
    values the model clips: a ReLU6 between two Convs read 0.1 dB against the CPU, a DeepLab
    segmenter -3 dB. On the bounds' grid the HTP's saturation is the clip; its values move by
    less than half a step of the old grid (finer steps, never coarser). So for a Clip right
    after a quantized Conv: the QNN EP fuses the two only when the Clip is redundant beside the
    output's grid, and a wider grid left the Conv ungrouped, its int32 bias DQ on the CPU (AMD
    Quark's XINT8 DeepLab: 68 DQs on the CPU).
    """
    model = edit.copy_model(model)
    graph = model.graph
    view = _Graph(graph)
    namer = edit.FreshNames(model)
    details = []
    for clip in list(graph.node):
        if clip.op_type != "Clip" or clip.domain not in _DEFAULT:
            continue
        bounds = _clip_bounds(clip, view.inits)
        if bounds is None or not (
            view.activation_dq(clip.input[0]) is not None or _fuses_into_conv(clip, view)
        ):
            continue
        readers = view.consumers.get(clip.output[0], [])
        params = [_params(r, view.inits) if r.op_type == QUANTIZE else None for r in readers]
        if not params or clip.output[0] in view.outputs:
            continue
        first = params[0]
        if first is None or any(not first.same(p) for p in params[1:]):
            continue
        low, high = _INT_RANGES[first.elem_type]
        grid = ((low - first.zero_point) * first.scale, (high - first.zero_point) * first.scale)
        bottom, top = max(bounds[0], grid[0]), min(bounds[1], grid[1])
        slack = first.scale / 2
        if not (grid[0] < bottom - slack or grid[1] > top + slack) or not bottom <= 0 <= top:
            continue
        scale = np.float32((top - bottom) / (high - low))
        zero = int(np.clip(low + round(-bottom / float(scale)), low, high))
        dequantized = [d for q in readers for d in view.consumers.get(q.output[0], [])]
        if any(len(q.input) < 3 or q.output[0] in view.outputs for q in readers) or any(
            d.op_type != DEQUANTIZE or len(d.input) < 3 or not first.same(_params(d, view.inits))
            for d in dequantized
        ):
            continue  # the grid is read by something else too: left as it is
        dtype = edit.numpy_dtype(first.elem_type)
        scale_name = _initializer(graph, namer, f"{clip.output[0]}_clip_scale", scale)
        zero_name = _initializer(
            graph, namer, f"{clip.output[0]}_clip_zero_point", np.array(zero, dtype)
        )
        for node in [*readers, *dequantized]:
            node.input[1], node.input[2] = scale_name, zero_name
        details.append(
            f"{edit.node_label(clip)}: output grid [{grid[0]:.4g}, {grid[1]:.4g}] -> its bounds "
            f"[{bottom:.4g}, {top:.4g}] (the HTP saturates, it does not clip)"
        )
    return _finish(model, "clip_bounds_on_the_grid", details)


def zero_adds_as_subs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """x + DQ(a constant that dequantizes to 0 everywhere) -> x - that constant (exact).

    Why: the HTP computes a quantized x + 0 as x on x's own grid and loses the requantization
    to the Add's output grid (a ReLU folded into its zero point, another scale): -0.1 dB
    (uint8) and -15 dB (uint16) against the CPU QDQ model; 0 + x and x - 0 are right.
    ``transforms.drop_neutral_arithmetic`` drops a float model's own x + 0 before it is
    quantized; this is for a model quantized elsewhere.
    """
    model = edit.copy_model(model)
    graph = model.graph
    view = _Graph(graph)
    details = []
    for node in graph.node:
        if node.op_type != "Add" or node.domain not in _DEFAULT or len(node.input) != 2:
            continue
        for position in (1, 0):
            constant = view.constant_dq(node.input[position])
            if constant is None or view.constant_dq(node.input[1 - position]) is not None:
                continue
            if np.any(_dq_value(constant, view.inits) != 0):
                continue
            node.op_type = "Sub"
            if position == 0:
                node.input[0], node.input[1] = node.input[1], node.input[0]
            details.append(f"{edit.node_label(node)}: x + 0 -> x - 0 (the HTP drops x + 0's grid)")
            break
    return _finish(model, "zero_adds_as_subs", details)


def _clip_bounds(
    clip: onnx.NodeProto, inits: dict[str, onnx.TensorProto]
) -> tuple[float, float] | None:
    """(min, max) of a Clip with constant bounds (inputs from opset 11, attributes before)."""
    if any(a.name in ("min", "max") for a in clip.attribute):
        return (
            float(edit.attribute(clip, "min", -np.inf)),
            float(edit.attribute(clip, "max", np.inf)),
        )
    bounds = []
    for index, default in ((1, -np.inf), (2, np.inf)):
        name = clip.input[index] if len(clip.input) > index else ""
        if not name:
            bounds.append(default)
            continue
        value = _array(inits, name)
        if value is None or value.size != 1:
            return None
        bounds.append(float(value.reshape(())))
    return bounds[0], bounds[1]


# Normalizations whose scale (gamma) the QNN EP takes quantized only unsigned.
_NORMS = frozenset({"LayerNormalization", "InstanceNormalization"})


def unsigned_norm_scales(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """An int8 scale (gamma) of a quantized LayerNormalization -> uint8, zero point + 128.

    The QNN EP declines a LayerNormalization whose gamma is int8 (onnxruntime's quantizer writes
    int8 weights by default): it and its Q/DQ ran on the CPU, 13 times in an onnxruntime-
    quantized MiniLM (20 partitions). The same gamma as uint8 compiles (measured, uint8 and
    uint16 activations). (q + 128) with zero point (z + 128) dequantizes to the same values.
    """
    return _shifted_weights(
        model, "unsigned_norm_scales", _NORMS, onnx.TensorProto.INT8, 128, np.uint8, "scale"
    )


def _weight_readers(
    graph: onnx.GraphProto, view: _Graph, ops: Sequence[str] | frozenset[str]
) -> Iterator[tuple[onnx.NodeProto, onnx.NodeProto, onnx.NodeProto]]:
    """Each ``ops`` node reading a quantized activation (input 0) and a dequantized constant
    weight (input 1): the node, its activation's DequantizeLinear and its weight's."""
    for node in graph.node:
        if node.op_type not in ops or node.domain not in _DEFAULT or len(node.input) < 2:
            continue
        x_dq, w_dq = view.activation_dq(node.input[0]), view.constant_dq(node.input[1])
        if x_dq is not None and w_dq is not None and len(w_dq.input) >= 3:
            yield node, x_dq, w_dq


def _shifted_weights(
    model: onnx.ModelProto,
    step: str,
    ops: frozenset[str],
    from_type: int,
    shift: int,
    dtype: type,
    what: str,
    activation_types: Sequence[int] | None = None,
) -> tuple[onnx.ModelProto, Change]:
    """Every ``ops`` node with a quantized activation (of ``activation_types``, if given) and a
    ``from_type`` weight in input 1 reads that weight moved by ``shift`` into ``dtype``."""
    model = edit.copy_model(model)
    graph = model.graph
    view = _Graph(graph)
    namer = edit.FreshNames(model)
    details = []
    converted: dict[tuple[str, str], tuple[str, str]] = {}
    before, after = onnx.TensorProto.DataType.Name(from_type).lower(), np.dtype(dtype).name
    for node, x_dq, w_dq in _weight_readers(graph, view, ops):
        if activation_types is not None:
            x_params = _params(x_dq, view.inits)
            if x_params is None or x_params.elem_type not in activation_types:
                continue
        weight, zp = view.inits[w_dq.input[0]], view.inits[w_dq.input[2]]
        if weight.data_type != from_type or zp.data_type != from_type:
            continue
        node.input[1] = _shifted_weight(graph, view.inits, namer, converted, w_dq, shift, dtype)
        details.append(
            f"{edit.node_label(node)}: {before} {what} {w_dq.input[0]!r} -> {after} (exact)"
        )
    return _finish(model, step, details)


def _shifted_weight(
    graph: onnx.GraphProto,
    inits: dict[str, onnx.TensorProto],
    namer: edit.FreshNames,
    converted: dict[tuple[str, str], tuple[str, str]],
    w_dq: onnx.NodeProto,
    shift: int,
    dtype: type,
) -> str:
    """The output of a new DequantizeLinear of ``w_dq``'s integers and zero point moved by
    ``shift`` into ``dtype`` (the same values: (q + s) - (z + s)); each weight converted once."""
    suffix = np.dtype(dtype).name
    key = (w_dq.input[0], w_dq.input[2])
    if key not in converted:
        w = numpy_helper.to_array(inits[w_dq.input[0]]).astype(np.int16) + shift
        z = numpy_helper.to_array(inits[w_dq.input[2]]).astype(np.int16) + shift
        converted[key] = (
            _initializer(graph, namer, f"{w_dq.input[0]}_{suffix}", w.astype(dtype)),
            _initializer(graph, namer, f"{w_dq.input[2]}_{suffix}", z.astype(dtype)),
        )
    w_name, z_name = converted[key]
    out = namer(f"{w_dq.output[0]}_{suffix}")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in w_dq.attribute}
    graph.node.append(
        onnx.helper.make_node(
            DEQUANTIZE, [w_name, w_dq.input[1], z_name], [out], name=namer(f"{out}_dq"), **attrs
        )
    )
    return out


def _commutes(node: onnx.NodeProto, view: _Graph) -> bool:
    """Whether Q(node(x)) == node(Q(x)) for a per-tensor Q (see ``_COMMUTING``)."""
    if node.domain not in _DEFAULT or node.op_type not in _COMMUTING:
        return False
    if len([o for o in node.output if o]) != 1:
        return False
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Resize":
        mode = attrs.get("mode", b"nearest")
        return (mode.decode() if isinstance(mode, bytes) else mode) == "nearest"
    if node.op_type == "Pad":
        mode = attrs.get("mode", b"constant")
        if (mode.decode() if isinstance(mode, bytes) else mode) != "constant":
            return False
        value = node.input[2] if len(node.input) > 2 else ""
        if value:
            array = _array(view.inits, value)
            return array is not None and not np.any(array)
        return not attrs.get("value", 0.0)
    return True


def _data_inputs(node: onnx.NodeProto) -> list[int]:
    indices = _COMMUTING[node.op_type]
    if indices is None:
        return [i for i, name in enumerate(node.input) if name]
    return [i for i in indices if i < len(node.input) and node.input[i]]


def _propagate_backward(model: onnx.ModelProto, details: list[str]) -> None:
    """Copy a Q (with its DQ) in front of the data-moving ops before it, up to the op that
    computes the value: that op then has a Q on its output and becomes a quantized unit."""
    graph = model.graph
    view = _Graph(graph)
    namer = edit.FreshNames(model)
    work = [n for n in graph.node if n.op_type == QUANTIZE and n.input[0] not in view.inits]
    while work:
        q = work.pop()
        params = _params(q, view.inits)
        tensor = q.input[0]
        node = view.producer.get(tensor)
        if params is None or node is None or not _commutes(node, view) or tensor in view.outputs:
            continue
        if node.op_type == "Relu" and _clipped_by_q(node, view):
            continue  # the Q clips at zero itself: the QNN EP drops this Relu into its producer
        readers = view.consumers.get(tensor, [])
        if not all(r.op_type == QUANTIZE and params.same(_params(r, view.inits)) for r in readers):
            continue
        added = []
        for index in _data_inputs(node):
            source = node.input[index]
            dq = view.dq_of(source)
            if dq is not None and params.same(_params(dq, view.inits)):
                continue  # already on this grid
            pair, out = _qdq_pair(source, params, namer, "pq")
            graph.node.extend(pair)
            node.input[index] = out
            added.append(pair[0])
        if added:
            details.append(f"Q of {tensor!r} copied in front of {edit.node_label(node)}")
            view.refresh()
            work.extend(added)


def _propagate_forward(model: onnx.ModelProto, details: list[str]) -> None:
    """After a data-moving op whose inputs all come from DQs on one grid, put a Q/DQ on that
    grid: its result is on the grid already, and the op becomes a quantized unit."""
    graph = model.graph
    edit.sort_graph(graph)
    view = _Graph(graph)
    namer = edit.FreshNames(model)
    for node in list(graph.node):
        if node.op_type == "Identity" or not _commutes(node, view):
            continue  # an Identity moves nothing: the DQ before it is as good
        sources = [view.activation_dq(node.input[i]) for i in _data_inputs(node)]
        if not sources or any(s is None for s in sources):
            continue
        params = _params(sources[0], view.inits)
        if params is None or not all(params.same(_params(s, view.inits)) for s in sources):
            continue
        out = node.output[0]
        readers = view.consumers.get(out, [])
        if out not in view.outputs and all(
            r.op_type == QUANTIZE and params.same(_params(r, view.inits)) for r in readers
        ):
            continue
        details.append(f"Q/DQ of its input's grid put after {edit.node_label(node)}")
        inner = namer(f"{out}_pre_q")
        node.output[0] = inner
        pair, _ = _qdq_pair(inner, params, namer, "fq")
        pair[1].output[0] = out
        graph.node.extend(pair)
        view.refresh()


def propagate_qdq(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Quantize the float tensors around data-moving ops (Transpose, Reshape, Concat, Relu,
    MaxPool, nearest Resize, ...) with the grid of the Q/DQ next to them.

    Exporters put one Q after a chain like Conv -> Transpose -> Reshape -> Concat, or feed a
    DQ through Flatten into Softmax: the ops in between, and the Conv, have no Q of their own,
    so the QNN EP runs them as float ops on the HTP. These ops commute with a per-tensor Q
    (they only move, pick, compare or zero-pad values), so the copies change nothing.
    """
    model = edit.copy_model(model)
    details: list[str] = []
    _propagate_backward(model, details)
    _propagate_forward(model, details)
    return _finish(model, "propagate_qdq", details)


def _leaky_alpha(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> float | None:
    if node.op_type == "LeakyRelu":
        return next((a.f for a in node.attribute if a.name == "alpha"), 0.01)
    if node.op_type == "PRelu" and len(node.input) > 1:
        slope = _array(inits, node.input[1])
        if slope is not None and slope.size and np.all(slope == slope.flat[0]):
            return float(slope.flat[0])
    return None


def _scaled_dq(
    graph: onnx.GraphProto, view: _Graph, namer: edit.FreshNames, dq: onnx.NodeProto, factor: float
) -> str:
    """A new DequantizeLinear of a copy of ``dq``'s integers with its scale times ``factor``.

    A copy, not the same initializer: the QNN EP makes one static tensor per initializer name,
    with the quantization parameters of the first DQ that reads it (measured: a second DQ of the
    same integers at another scale computed with the first one's scale).
    """
    scale = _array(view.inits, dq.input[1]).astype(np.float32)
    new_scale = (scale * np.float32(factor)).astype(np.float32)
    s_name = _initializer(graph, namer, f"{dq.input[1]}_x{factor:g}", new_scale)
    q_name = _initializer(
        graph, namer, f"{dq.input[0]}_x{factor:g}", _array(view.inits, dq.input[0])
    )
    out = namer(f"{dq.output[0]}_x{factor:g}")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in dq.attribute}
    inputs = [q_name, s_name, *dq.input[2:]]
    graph.node.append(
        onnx.helper.make_node(DEQUANTIZE, inputs, [out], name=namer(f"{out}_dq"), **attrs)
    )
    return out


def split_leaky_relu(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """op -> LeakyRelu(alpha) -> Q as two 8-bit branches: Q+(op(x)) + Q-(op_alpha(x)).

    Vitis-AI and other exporters quantize only after the activation, so the op (a Conv, say)
    has no Q of its own and runs as a float op on the HTP; quantizing its output on the Q's
    grid would clip the negative side, which LeakyRelu shrinks by alpha. Instead:
    ``op`` keeps its weights and gets a Q on the output grid whose range is [0, 255 steps]
    (zero point at the type's minimum: the Q itself is the Relu), and a copy of ``op`` with
    weight and bias scales multiplied by alpha computes alpha * op(x) into a Q of range
    [-255 steps, 0]. Their sum is LeakyRelu(op(x)) rounded to the grid, the same integer the
    model's Q produced; every op involved is a plain 8-bit QDQ unit. Needs 0 < alpha and an
    op with quantized input, weight and (int32, see ``int32_biases``) bias.
    """
    model = edit.copy_model(model)
    graph = model.graph
    view = _Graph(graph)
    namer = edit.FreshNames(model)
    details = []
    replace: dict[int, list[onnx.NodeProto]] = {}
    for index, act in enumerate(graph.node):
        alpha = _leaky_alpha(act, view.inits) if act.domain in _DEFAULT else None
        if alpha is None or not alpha > 0:
            continue
        op = view.producer.get(act.input[0])
        readers = view.consumers.get(act.output[0], [])
        if op is None or op.op_type not in _WEIGHTED or op.domain not in _DEFAULT:
            continue
        if len(view.consumers.get(op.output[0], [])) != 1 or op.output[0] in view.outputs:
            continue
        if act.output[0] in view.outputs or len(readers) != 1 or readers[0].op_type != QUANTIZE:
            continue
        params = _params(readers[0], view.inits)
        w_dq = view.constant_dq(op.input[1]) if len(op.input) > 1 else None
        if params is None or view.activation_dq(op.input[0]) is None or w_dq is None:
            continue
        b_dq = view.constant_dq(op.input[2]) if len(op.input) > 2 and op.input[2] else None
        if len(op.input) > 2 and op.input[2] and b_dq is None:
            continue
        low, high = _INT_RANGES[params.elem_type]
        np_type = onnx.helper.tensor_dtype_to_np_dtype(params.elem_type)
        base = op.name or op.output[0]
        pos_zp = _initializer(graph, namer, f"{base}_pos_zp", np.array(low, np_type))
        neg_zp = _initializer(graph, namer, f"{base}_neg_zp", np.array(high, np_type))
        pos = _Params(params.scale, low, params.elem_type, params.scale_name, pos_zp)
        neg = _Params(params.scale, high, params.elem_type, params.scale_name, neg_zp)

        twin_inputs = [op.input[0], _scaled_dq(graph, view, namer, w_dq, alpha)]
        if b_dq is not None:
            twin_inputs.append(_scaled_dq(graph, view, namer, b_dq, alpha))
        twin_out = namer(f"{op.output[0]}_alpha")
        twin = onnx.helper.make_node(
            op.op_type, twin_inputs, [twin_out], name=namer(f"{base}_alpha")
        )
        twin.attribute.extend(op.attribute)
        pos_nodes, pos_out = _qdq_pair(op.output[0], pos, namer, "pos")
        neg_nodes, neg_out = _qdq_pair(twin_out, neg, namer, "neg")
        add = onnx.helper.make_node(
            "Add", [pos_out, neg_out], [act.output[0]], name=act.name or namer(f"{base}_leaky")
        )
        replace[index] = [twin, *pos_nodes, *neg_nodes, add]
        details.append(
            f"{edit.node_label(op)} -> {act.op_type}(alpha={alpha:g}): two 8-bit branches summed"
        )
    if replace:
        nodes: list[onnx.NodeProto] = []
        for index, node in enumerate(graph.node):
            nodes.extend(replace.get(index, [node]))
        edit.set_nodes(graph, nodes)
    return _finish(model, "split_leaky_relu", details)


def float_edges(model: onnx.ModelProto) -> list[str]:
    """Tensors between two ops with no Q/DQ in between (graph inputs/outputs aside): where the
    QNN EP will run float ops on the HTP. For the report."""
    view = _Graph(model.graph)
    found = []
    for node in model.graph.node:
        if node.op_type in QDQ_OPS:
            continue
        for name in node.input:
            producer = view.producer.get(name)
            if producer is None or producer.op_type in QDQ_OPS or name in view.inits:
                continue
            if node.op_type == "Relu" and _clipped_by_q(node, view):
                continue  # the EP folds this Relu into its producer's quantized op
            found.append(f"{name!r}: {producer.op_type} -> {node.op_type}")
    return found


def _clipped_by_q(relu: onnx.NodeProto, view: _Graph) -> bool:
    """A Relu read only by Q nodes whose range starts at zero (zero point = type minimum)."""
    readers = view.consumers.get(relu.output[0], [])
    for reader in readers:
        params = _params(reader, view.inits) if reader.op_type == QUANTIZE else None
        if params is None or params.zero_point != _INT_RANGES[params.elem_type][0]:
            return False
    return bool(readers) and relu.output[0] not in view.outputs


def input_steps(model: onnx.ModelProto) -> dict[str, float]:
    """Graph input -> the quantization step of the QuantizeLinear that reads it (per-tensor),
    also through ops that only move, pick or join its values (TFLite int8 exports reshape or
    transpose the input before its first Q, YOLOX's Focus slices it four ways and concatenates:
    without them the jitter moved nothing and the floor read inf). An integer input (a model
    with int8 I/O) is already quantized: its step is 1."""
    view = _Graph(model.graph)
    steps: dict[str, float] = dict.fromkeys(_integer_input_grids(model.graph, view), 1.0)
    for value in model.graph.input:
        if value.name in steps:
            continue
        tensors = [value.name]
        while tensors:
            tensor = tensors.pop()
            for reader in view.consumers.get(tensor, []):
                picks = reader.op_type in _VALUE_PICKS and reader.domain in _DEFAULT
                if picks and (reader.op_type == "Concat" or reader.input[0] == tensor):
                    tensors.extend(o for o in reader.output if o)
                    continue
                params = _params(reader, view.inits) if reader.op_type == QUANTIZE else None
                if params is not None:
                    steps[value.name] = min(params.scale, steps.get(value.name, params.scale))
    return steps


HTP_STEPS = (
    per_tensor_activations,  # not exact; first: int32_biases needs an input grid per tensor
    pads_into_quantized_convs,
    explicit_pad_values,  # after the fold: the Pads it left
    affine_into_quantized_conv,
    finer_weight_steps,  # after the fold, which may move a channel's weight scale
    matmul_bias_to_gemm,
    int32_biases,
    unsigned_activations,
    clip_bounds_on_the_grid,
    batchnorm_as_depthwise_conv,
    signed_weights,
    symmetric_sixteen_bit_weights,  # before the int16 weights are split
    unsigned_norm_scales,
    propagate_qdq,
    split_leaky_relu,
    zero_adds_as_subs,
    qdq_htp.requantize_after_moves,  # after propagate_qdq: the moves between two grids
    qdq_htp.split_sixteen_bit_weights,  # not exact: 15 bits of weight where the HTP floors 16
    # Not exact either (half a 16-bit step, ~90 dB down): a 16-bit SiLU the HTP fuses wrongly
    # (an A16W8 YOLOv8n kept as quantized: 18.8 dB from itself on the HTP, 70.8 split).
    qdq_htp.split_swish_input,
    # Exact: a uint16 product of two activations re-encoded as int16 (an A16 attention kept as
    # quantized: 42.8 dB from itself on the HTP, 67.8 re-encoded).
    qdq_htp.signed_activation_products,
    qdq_htp.dequantized_integer_inputs,  # exact: the HTP takes no Cast from int16 (uint8: wrong)
    # Not exact (a rounding onto the output's grid): the HTP adds a scatter's integers as if
    # its data and updates were on its output's grid.
    qdq_htp.scatter_sums_on_output_grid,
    float_op_weights,  # last: the steps before it give some ops a quantized result
)


def for_htp(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[Change]]:
    """The model with its own quantization, rewritten (exactly, but for int16 weights split into
    two int8 layers, a 16-bit SiLU's requantized copy and activations quantized per channel
    put on one grid) into what the QNN HTP takes;
    and what each step changed. A ModelError when the model quantizes no activation at all
    (weight-only quantization): the HTP would run it in float; requantize it instead."""
    summary = summarize(model)
    if not summary.activations_quantized:
        raise ModelError(
            f"The model is pre-quantized ({summary.describe()}) but quantizes no activation: "
            "the NPU would run every op in float.",
            tip="Set requantize = true in [quantization]: its float model is then calibrated "
            "and quantized by the pipeline.",
        )
    broken = unusable_scales(model)
    if broken:
        raise ModelError(
            f"The model's own quantization has {len(broken)} scale(s) that are not finite and "
            f"positive: {'; '.join(broken[:3])}. Its values there are lost even on the CPU (a "
            "range calibrated over an attention mask filled with -inf is the usual cause), and "
            "QNN cannot compose such a graph.",
            tip="Set requantize = true in [quantization] (its float model is calibrated anew, "
            "the mask fill made finite), or quantize it again with that tensor excluded.",
        )
    changes = []
    for step in HTP_STEPS:
        model, change = step(model)
        changes.append(change)
    return model, changes


def unusable_scales(model: onnx.ModelProto) -> list[str]:
    """Q/DQ nodes whose constant scale is infinite, NaN, zero or negative: what each reads."""
    inits = edit.initializers_by_name(model.graph)
    found = []
    for node in model.graph.node:
        if node.op_type not in QDQ_OPS or node.domain not in _QDQ_DOMAINS:
            continue
        scale = inits.get(node.input[1]) if len(node.input) > 1 else None
        if scale is None:
            continue
        values = numpy_helper.to_array(scale).astype(np.float64)
        if values.size and not np.all(np.isfinite(values) & (values > 0)):
            bad = values[~(np.isfinite(values) & (values > 0))].ravel()[0]
            found.append(f"{edit.node_label(node)} of {node.input[0]!r} (scale {bad})")
    return found


# --------------------------------------------------------------------------------------------
# requantize = true: back to the float model


# onnxruntime's dynamic quantization (``quantize_dynamic``): activations are quantized at run
# time from their own min/max, so there is no activation scale a static NPU graph could keep.
DYNAMIC_OPS = frozenset({"DynamicQuantizeLinear", "DynamicQuantizeLSTM"})
_INTEGER_OPS = {"ConvInteger": "Conv", "MatMulInteger": "MatMul"}


def is_dynamically_quantized(model: onnx.ModelProto) -> bool:
    """True when activations are quantized at run time (DynamicQuantizeLinear and kin)."""
    return any(
        node.op_type in DYNAMIC_OPS for graph in edit.all_graphs(model.graph) for node in graph.node
    )


def _only_consumer(view: _Graph, name: str, op_type: str) -> onnx.NodeProto | None:
    users = view.consumers.get(name, [])
    if len(users) != 1 or users[0].op_type != op_type or name in view.outputs:
        return None
    return users[0]


def _integer_operand(
    view: _Graph, node: onnx.NodeProto, position: int
) -> tuple[str, str, np.ndarray | None] | None:
    """Operand ``position`` (0 or 1) of a ConvInteger/MatMulInteger as (float source, its scale
    tensor, its dequantized value): a DynamicQuantizeLinear output gives its float input and
    its run-time scale; a constant gives ``(q - zero point)`` (scaled later). None otherwise."""
    name = node.input[position]
    zp_name = node.input[position + 2] if len(node.input) > position + 2 else ""
    quantizer = view.producer.get(name)
    if quantizer is not None and quantizer.op_type == "DynamicQuantizeLinear":
        if zp_name and zp_name != quantizer.output[2]:
            return None
        return quantizer.input[0], quantizer.output[1], None
    value = _array(view.inits, name)
    zero = _array(view.inits, zp_name) if zp_name else np.zeros((), np.float64)
    if zero is None:
        return None
    if value is None:  # integers moved out of a constant table (a quantized embedding's rows)
        moved = _moved_table(view, name)
        if moved is None or zero.size != 1:
            return None
        return name, _TABLE, None
    zero = zero.astype(np.float64)
    if node.op_type == "ConvInteger" and zero.size > 1:  # per output channel
        zero = zero.reshape([-1] + [1] * (value.ndim - 1))
    return "", "", value.astype(np.float64) - zero


_TABLE = "table"  # ``_integer_operand``'s mark for an operand moved out of an integer table


def _moved_table(view: _Graph, name: str) -> tuple[str, list[onnx.NodeProto]] | None:
    """(integer constant, the moves from it to ``name`` in order) when ``name`` is only
    ``_TABLE_MOVES`` of an integer constant (their data input), else None."""
    chain: list[onnx.NodeProto] = []
    while name not in view.inits:
        node = view.producer.get(name)
        if node is None or node.op_type not in _TABLE_MOVES or node.domain not in _DEFAULT:
            return None
        chain.append(node)
        name = node.input[0]
    if numpy_helper.to_array(view.inits[name]).dtype.kind not in "iu":
        return None
    return name, chain[::-1]


def _float_moves(
    view: _Graph, node: onnx.NodeProto, position: int, namer: edit.FreshNames
) -> tuple[str, list[onnx.NodeProto], onnx.TensorProto] | None:
    """Operand ``position`` of ``node``, integers moved out of a constant table: the same moves
    of the table less its zero point, in float (unscaled: the operand's scale is one of the
    scale product's factors, all of which the other operand takes). (the float operand, the
    moves that make it, the float table)."""
    name = node.input[position]
    moved = _moved_table(view, name)
    zp_name = node.input[position + 2] if len(node.input) > position + 2 else ""
    zero = _array(view.inits, zp_name) if zp_name else np.zeros((), np.float64)
    if moved is None or zero is None:
        return None
    table, chain = moved
    values = numpy_helper.to_array(view.inits[table]).astype(np.float64) - float(zero.reshape(()))
    floated = numpy_helper.from_array(values.astype(np.float32), namer(f"{table}_float"))
    source, nodes = floated.name, []
    for move in chain:
        out = namer(f"{move.output[0]}_float")
        copy = onnx.NodeProto()
        copy.CopyFrom(move)
        copy.name = namer(f"{move.name or move.output[0]}_float")
        copy.input[0] = source
        del copy.output[:]
        copy.output.append(out)
        nodes.append(copy)
        source = out
    return source, nodes, floated


def _integer_to_float(
    view: _Graph, node: onnx.NodeProto, namer: edit.FreshNames
) -> (
    tuple[onnx.NodeProto, list[onnx.NodeProto], list[onnx.TensorProto], list[onnx.NodeProto]] | None
):
    """ConvInteger/MatMulInteger -> Cast -> Mul(scale_a * scale_b), as onnxruntime's dynamic
    quantizer writes it, as one float Conv/MatMul on the float operands; (new node, nodes it
    replaces, new initializers, new nodes before it). An operand moved out of an integer table
    (quantize_dynamic feeds a quantized embedding's rows straight into the first MatMulInteger)
    is the same moves of the float table, and the scale product goes to the other operand."""
    operands = [_integer_operand(view, node, i) for i in (0, 1)]
    tables = [i for i, o in enumerate(operands) if o is not None and o[1] == _TABLE]
    after, bias, add = node.output[0], "", _only_consumer(view, node.output[0], "Add")
    if add is not None and node.op_type == "ConvInteger":
        bias = _integer_bias(view, add, after)
        after = add.output[0]
    cast = _only_consumer(view, after, "Cast")
    if any(o is None for o in operands) or cast is None or bias is None:
        return None
    if next((a.i for a in cast.attribute if a.name == "to"), 0) != onnx.TensorProto.FLOAT:
        return None
    mul = _only_consumer(view, cast.output[0], "Mul")
    if mul is None:
        return None
    scales = [i for i in mul.input if i != cast.output[0]]
    product = view.producer.get(scales[0]) if len(scales) == 1 else None
    if product is None or product.op_type != "Mul":
        return None
    factors = list(product.input)
    inputs, initializers, moves = [], [], []
    if tables and (node.op_type != "MatMulInteger" or len(tables) != 1):
        return None
    for position, (source, scale, value) in enumerate(operands):
        if position in tables:  # its scale stays among the factors, for the other operand
            floated = _float_moves(view, node, position, namer)
            if floated is None:
                return None
            source, made, table = floated
            moves += made
            initializers.append(table)
            inputs.append(source)
        elif value is None:  # dynamically quantized: its run-time scale is one of the factors
            if scale not in factors:
                return None
            factors.remove(scale)
            inputs.append(source)
    for position, (_, _, value) in enumerate(operands):
        if value is None:
            continue
        constants = [_array(view.inits, f) for f in factors]
        if len(constants) != (2 if tables else 1) or any(c is None for c in constants):
            return None
        weight_scale = np.ones((), np.float64)  # this operand's scale, and the table's
        for constant in constants:
            if constant.size > 1 and weight_scale.size > 1:
                return None
            weight_scale = weight_scale * constant.astype(np.float64)
        if node.op_type == "ConvInteger" and weight_scale.size > 1:
            weight_scale = weight_scale.reshape([-1] + [1] * (value.ndim - 1))
        name = namer(f"{node.input[position]}_float")
        initializers.append(
            numpy_helper.from_array((value * weight_scale).astype(np.float32), name)
        )
        inputs.insert(position, name)
        factors.clear()
    if factors:
        return None
    float_node = onnx.helper.make_node(
        _INTEGER_OPS[node.op_type],
        inputs + ([bias] if bias else []),
        [mul.output[0]],
        name=namer(f"{node.name}_float"),
    )
    if node.op_type == "ConvInteger":
        float_node.attribute.extend(node.attribute)
    return float_node, [node, *([add] if bias else []), cast, mul], initializers, moves


def _integer_bias(view: _Graph, add: onnx.NodeProto, accumulator: str) -> str | None:
    """The float bias behind an integer one added to a ConvInteger's accumulator, as older
    onnxruntime quantizers wrote it: Reshape(Cast(Floor(Div(bias, scale_a * scale_b)))). Its
    name (a 1-D float constant, what Conv takes as bias), or None."""
    other = [i for i in add.input if i != accumulator]
    node = view.producer.get(other[0]) if len(other) == 1 else None
    if node is not None and node.op_type == "Reshape":
        node = view.producer.get(node.input[0])
    if node is None or node.op_type != "Cast":
        return None
    node = view.producer.get(node.input[0])
    if node is None or node.op_type not in ("Floor", "Round"):
        return None
    node = view.producer.get(node.input[0])
    if node is None or node.op_type != "Div":
        return None
    value = _array(view.inits, node.input[0])
    if value is None or value.ndim != 1 or value.dtype != np.float32:
        return None
    return node.input[0]


def _lstm_to_float(
    view: _Graph, node: onnx.NodeProto, namer: edit.FreshNames
) -> tuple[onnx.NodeProto, list[onnx.TensorProto]] | None:
    """com.microsoft DynamicQuantizeLSTM -> LSTM: its int8 weights (stored [directions, input,
    4 x hidden], one scale per direction or per gate row) dequantized and transposed back."""
    inputs = list(node.input) + [""] * (12 - len(node.input))
    weights = []
    for weight, scale, zero in ((1, 8, 9), (2, 10, 11)):
        q = _array(view.inits, inputs[weight])
        s = _array(view.inits, inputs[scale])
        z = _array(view.inits, inputs[zero]) if inputs[zero] else np.zeros_like(s)
        if q is None or s is None or z is None or q.ndim != 3:
            return None
        shape = [q.shape[0], 1, q.shape[2] if s.size > q.shape[0] else 1]
        s64, z64 = s.astype(np.float64).reshape(shape), z.astype(np.float64).reshape(shape)
        value = ((q.astype(np.float64) - z64) * s64).transpose(0, 2, 1).astype(np.float32)
        weights.append(numpy_helper.from_array(value, namer(f"{inputs[weight]}_float")))
    lstm_inputs = [inputs[0], weights[0].name, weights[1].name, *inputs[3:8]]
    while lstm_inputs and not lstm_inputs[-1]:
        lstm_inputs.pop()
    lstm = onnx.helper.make_node(
        "LSTM", lstm_inputs, list(node.output), name=namer(f"{node.name or 'lstm'}_float")
    )
    lstm.attribute.extend(node.attribute)
    return lstm, weights


def dynamic_to_float(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """The float model behind onnxruntime's dynamic quantization: each ConvInteger/MatMulInteger
    with its Cast and scale Mul becomes the float Conv/MatMul of the float operands (weights
    dequantized), each DynamicQuantizeLSTM an LSTM; the run-time DynamicQuantizeLinear nodes go
    with them. A no-op on other models."""
    if not is_dynamically_quantized(model) and not any(
        n.op_type in _INTEGER_OPS for n in model.graph.node
    ):
        return model, Change("dynamic_to_float")
    graph = model.graph
    namer = edit.FreshNames(model)
    view = _Graph(graph)
    replaced: dict[int, onnx.NodeProto] = {}
    before: dict[int, list[onnx.NodeProto]] = {}  # nodes that make a replacement's operand
    drop: set[int] = set()
    index_of = {id(n): i for i, n in enumerate(graph.node)}
    counts: Counter[str] = Counter()
    for index, node in enumerate(graph.node):
        if node.op_type in _INTEGER_OPS and node.domain in _DEFAULT:
            found = _integer_to_float(view, node, namer)
            if found is None:
                continue
            float_node, gone, initializers, moves = found
            replaced[index] = float_node
            before[index] = moves
            drop.update(index_of[id(n)] for n in gone[1:])
            graph.initializer.extend(initializers)
            counts[node.op_type] += 1
        elif node.op_type == "DynamicQuantizeLSTM" and node.domain == _MS:
            found_lstm = _lstm_to_float(view, node, namer)
            if found_lstm is None:
                continue
            replaced[index], new_weights = found_lstm
            graph.initializer.extend(new_weights)
            counts[node.op_type] += 1
    if not counts:
        return model, Change("dynamic_to_float")
    for index, new in replaced.items():
        graph.node[index].CopyFrom(new)
    nodes = []
    for index, node in enumerate(graph.node):
        if index not in drop:
            nodes.extend([*before.get(index, []), node])
    edit.set_nodes(graph, nodes)
    edit.remove_dead_nodes(graph)
    details = [
        f"{count} {op} -> float {_INTEGER_OPS.get(op, 'LSTM')} (weights dequantized)"
        for op, count in sorted(counts.items())
    ]
    return _finish(model, "dynamic_to_float", details)


# Ops that only move or pick elements of their first input: a per-tensor DequantizeLinear
# after them gives what it gives before them.
_TABLE_MOVES = {"Gather", "Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"}


def _dequantize_tables(graph: onnx.GraphProto) -> list[str]:
    """Per-tensor DequantizeLinears after ops that pick or move elements of an integer
    constant (onnxruntime's quantize_dynamic leaves ``DQ(Gather(table_int8, ids))`` for word
    embeddings, ``DQ(Transpose(Gather(bias_table, ...)))`` for T5's relative-position bias,
    and both from one Gather in a BiLSTM diacritizer) -> those ops on the dequantized
    constant, and the DQs Identities: exact when every use of the table's integers, through
    such moves, ends in a DequantizeLinear of one scale and zero point."""
    view = _Graph(graph)
    details = []
    for name in list(view.inits):
        table = numpy_helper.to_array(view.inits[name])
        region = _table_region(view, name) if table.dtype.kind in "iu" else None
        if region is None:
            continue
        moves, dequantizers = region
        first = dequantizers[0]
        probe = onnx.helper.make_node(DEQUANTIZE, [name, *first.input[1:]], ["_"])
        floated = numpy_helper.from_array(_dq_value(probe, view.inits).astype(np.float32), name)
        graph.initializer.remove(view.inits[name])
        graph.initializer.append(floated)
        for node in dequantizers:
            node.op_type, node.domain = "Identity", ""
            node.input[:] = [node.input[0]]
            del node.attribute[:]
        shown = " <- ".join(m.op_type for m in reversed(moves))
        details.append(
            f"{len(dequantizers)} DequantizeLinear(s) moved onto {name!r} before {shown}"
        )
        view.refresh()
    return details


def _table_region(
    view: _Graph, table: str
) -> tuple[list[onnx.NodeProto], list[onnx.NodeProto]] | None:
    """The moves (``_TABLE_MOVES``, data input only) that carry ``table``'s integers and the
    DequantizeLinears that end them, or None unless every use ends in a DQ of one constant
    per-tensor scale and zero point (a second scale, a MatMulInteger, a graph output)."""
    moves: list[onnx.NodeProto] = []
    dequantizers: list[onnx.NodeProto] = []
    params: list[np.ndarray] | None = None
    pending = [table]
    while pending:
        name = pending.pop()
        if name in view.outputs or not view.consumers.get(name):
            return None
        for node in view.consumers[name]:
            if list(node.input).count(name) != 1 or node.input[0] != name:
                return None
            if node.op_type == DEQUANTIZE and node.domain in _QDQ_DOMAINS:
                given = [i for i in node.input[1:] if i]
                if any(i not in view.inits or _array(view.inits, i).size != 1 for i in given):
                    return None
                values = [_array(view.inits, i).reshape(-1) for i in given]
                if params is None:
                    params = values
                elif len(values) != len(params) or not all(
                    np.array_equal(a, b) for a, b in zip(values, params, strict=True)
                ):
                    return None
                dequantizers.append(node)
            elif node.op_type in _TABLE_MOVES and node.domain in _DEFAULT:
                moves.append(node)
                pending.append(node.output[0])
            else:
                return None
    return (moves, dequantizers) if moves and dequantizers else None


_PARAMETER_OPS = frozenset(
    {"Cast", "ConstantOfShape", "Reshape", "Unsqueeze", "Squeeze", "Identity", "Expand", "Concat"}
)


def _fold_qdq_parameters(model: onnx.ModelProto) -> onnx.ModelProto:
    """A Q/DQ's scale or zero point computed from constants (PyTorch: Cast(ConstantOfShape))
    as an initializer: the weight rules below read parameters from initializers only."""
    from onnx.reference import ReferenceEvaluator

    model = edit.copy_model(model)
    graph = model.graph
    for _ in range(8):  # chains are short: ConstantOfShape -> Cast
        inits = edit.initializers_by_name(graph)
        producer = {o: n for n in graph.node for o in n.output if o}
        stack = [
            name
            for node in graph.node
            if node.op_type in (QUANTIZE, DEQUANTIZE)
            for name in node.input[1:]
            if name and name not in inits
        ]
        wanted: set[str] = set()
        while stack:  # and what computes them
            name = stack.pop()
            node = producer.get(name)
            if name in wanted or node is None or node.op_type not in _PARAMETER_OPS:
                continue
            if node.domain not in ("", "ai.onnx") or len(node.output) != 1:
                continue
            wanted.add(name)
            stack += [i for i in node.input if i and i not in inits]
        folded = False
        for name in wanted:
            node = producer[name]
            if not all(i in inits for i in node.input if i):
                continue  # an input still computed: the next round
            feeds = {i: numpy_helper.to_array(inits[i]) for i in node.input if i}
            (value,) = ReferenceEvaluator(node).run(None, feeds)
            graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
            graph.node.remove(node)
            folded = True
        if not folded:
            break
    edit.remove_dead_nodes(graph)
    return model


def dequantize(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Remove a pre-quantized model's own quantization: the float model behind it.

    Quantized weights (DQ of constants, also Q of float constants) become float initializers,
    activation Q -> DQ pairs are bypassed, QLinear* ops become float ops first. What is left
    computes in float what the model computed on its quantization grid; the pipeline then
    calibrates and quantizes it like any float model (config: requantize = true).
    """
    # PyTorch's export of a quantized model gives weights, scales and zero points as Constant
    # nodes, and a bias's zero point computed (Cast of ConstantOfShape): initializers first, as
    # the other exporters write them.
    model, _ = t.constants_to_initializers(model)
    model = _fold_qdq_parameters(model)
    model, dynamic = dynamic_to_float(model)
    model, first = qoperator_to_qdq(model)
    model, folded = fold_quantized_constants(model)
    model, casts = drop_noop_casts(model)
    graph = model.graph
    moved = _dequantize_tables(graph)
    view = _Graph(graph)
    details = [
        f"{step}: {len(change.details)} edit(s)"
        for step, change in (("QLinear -> QDQ", first), ("Q of constants folded", folded))
        if change.details
    ] + moved
    details = list(dynamic.details) + details
    if casts.details:
        details.append(f"{len(casts.details) - 1} no-op Cast(s) removed")
    weights = pairs = 0
    drop: set[int] = set()
    mapping: dict[str, str] = {}
    new_inits = []
    for index, node in enumerate(graph.node):
        if node.op_type != DEQUANTIZE or node.domain not in _QDQ_DOMAINS:
            continue
        if node.input[0] in view.inits and all(i in view.inits for i in node.input[1:] if i):
            new_inits.append(
                numpy_helper.from_array(
                    _dq_value(node, view.inits).astype(np.float32), node.output[0]
                )
            )
            drop.add(index)
            weights += 1
            continue
        q = view.producer.get(node.input[0])
        if q is None or q.op_type != QUANTIZE:
            continue
        pairs += 1
        if node.output[0] in view.outputs:  # the graph output keeps its name
            node.op_type, node.domain = "Identity", ""
            node.input[:] = [q.input[0]]
            del node.attribute[:]
            continue
        mapping[node.output[0]] = q.input[0]
        drop.add(index)
    if drop or pairs:
        edit.drop_nodes(graph, drop)
        graph.initializer.extend(new_inits)
        for node in graph.node:
            for i, name in enumerate(node.input):
                while name in mapping:
                    name = mapping[name]
                node.input[i] = name
        edit.remove_dead_nodes(graph)
        details.append(
            f"{weights} quantized weight(s) -> float, {pairs} activation Q/DQ pair(s) removed"
        )
    left = quantization_ops(model)
    if left:
        shown = ", ".join(f"{op} x{n}" for op, n in sorted(left.items()))
        where = sorted(edit.node_label(n) for n in model.graph.node if n.op_type in left)[:3]
        raise ModelError(
            f"requantize: the model's own quantization cannot be removed completely ({shown} "
            f"left, e.g. {', '.join(where)}: integer graph inputs/outputs, QLinear ops without "
            "a float form, or a DequantizeLinear after computed integers).",
            tip="Set requantize = false to build the model with its own quantization."
            if not dynamic.details
            else "A dynamically quantized model (quantize_dynamic) is always rebuilt from the "
            "float model behind it, so requantize = false does not apply: export the float "
            "model instead, or report the model with the nodes named above.",
        )
    return _finish(model, "dequantize", details)


def kept_steps(changes: Iterable[Change]) -> list[Change]:
    """The steps of ``for_htp`` that changed something."""
    return [c for c in changes if c.details]
