"""Recurrent ops (LSTM, GRU, RNN) and the streaming-model patterns around them, for the HTP.

What the QNN EP (onnxruntime-qnn 2.7.0, QNN 2.51, HTP) does with ONNX recurrent ops, measured on
small QDQ models (tests/test_recurrent.py builds the same kinds):

- LSTM and GRU with the default gate functions are taken whole (QNN ``Lstm``/``Gru`` ops, run
  in float inside the graph) in every direction, with or without initial states, peepholes and
  batch > 1, and accurately.
- Any ``activations`` attribute is refused ("QNN EP doesn't support non-default activations"),
  even one that spells out the defaults: the EP compares against lower-case names while ONNX
  exporters write "Sigmoid", "Tanh". Keras/tf2onnx/onnxmltools models always write it; DTLN's
  two LSTMs stayed on the CPU for that alone and split the graph into 3 partitions.
- ``clip`` is refused (LSTM and GRU); ``layout = 1`` fails in the builder (and onnxruntime's
  CPU kernels refuse it too, so such a model cannot even be calibrated); ``RNN`` has no builder.
- LSTM ``input_forget = 1`` is *taken* but ignored: the HTP computes a plain LSTM (6.7 dB
  against onnxruntime on a random cell, where the CPU QDQ model gets 17.5 dB).
- ``enable_htp_monolithic_lstm = 1`` crashed the simulator (SIGSEGV) on small LSTMs: not a default.

So: ``normalize_recurrent_ops`` removes what changes nothing (an ``activations`` list equal to
the defaults, a constant ``sequence_lens`` equal to the sequence length), and
``unroll_recurrent_ops`` rewrites every remaining form QNN refuses or gets wrong into elementary
ops (Gemm, Add, Mul, Sigmoid, Tanh, Split, Concat, Reshape) when the shapes are static. The
unrolled form computes exactly what onnxruntime's CPU kernel computes (same gate equations, same
order of clip/peephole/bias, onnxruntime's activation defaults), to float rounding.

An LSTM that QNN takes is unrolled too, while the model stays under ``LSTM_UNROLL_NODES``: the
HTP's own LSTM loses accuracy the elementary form mostly keeps. ctx vs float on the simulator,
native -> unrolled, through the whole pipeline on real models: a Keras G2P encoder over 24 steps
33.6 -> 43.4 dB; a 3-layer d-vector embedder over 80 steps 23.0 -> 28.2; VoiceFilter-Lite's mask
net, 3 layers of 512, one frame a call with its state as graph inputs, 42.1 -> 63.5; DTLN's two
one-step cells the other way, 55.7 -> 45.4 (their gates' quantization costs more there, on the
CPU too); a bidirectional OCR LSTM over 80 steps 28.3 -> 28.8. Native, the worst was 23 dB,
unrolled 45: the unrolled form is the default. Small stacks with onnxruntime's QNN recipe agree
(2 layers of 64 over 20 steps 30.5 -> 45.1 dB, one step 23.5 -> 53.3). The HTP's GRU is
accurate (a 3-layer stack of 128 over 40 steps: 62.7 dB native, 42.6 unrolled): kept.

Two more patterns split streaming models into partitions, both rewritten exactly here:

- ``lower_high_rank``: tensors of rank > 5 (an ``nn.Unfold`` exported as Gather with a 2-D index
  table, giving [1, 3, 1, 1, 3, 129], then Transpose and Reshape). The HTP refuses them (Gather
  error 3110), so the Gather gets a flat index and the Transpose works on the tensor with its
  unit axes dropped and neighbouring axes merged.
- ``dilate_conv_transpose``: a ConvTranspose with dilations > 1 ("QNN's TransposeConv2d operator
  only supports default dilation values of 1") gets the equivalent dilated kernel (zeros between
  the taps) and dilation 1.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from . import edit
from .edit import Change

RECURRENT_OPS = ("LSTM", "GRU", "RNN")
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
DEFAULT_ACTIVATIONS = {
    "LSTM": ("sigmoid", "tanh", "tanh"),
    "GRU": ("sigmoid", "tanh"),
    "RNN": ("tanh",),
}
# onnxruntime's CPU kernels (rnn_helpers.cc): which activations read alpha/beta from the lists,
# and the values they take when the lists run out (0 for those not listed).
_ACTIVATION_PARAMS = {
    "affine": (True, True),
    "relu": (False, False),
    "leakyrelu": (True, False),
    "thresholdedrelu": (True, False),
    "tanh": (False, False),
    "scaledtanh": (True, True),
    "sigmoid": (False, False),
    "hardsigmoid": (True, True),
    "elu": (True, False),
    "softsign": (False, False),
    "softplus": (False, False),
}
_ACTIVATION_DEFAULTS = {"leakyrelu": (0.01, 0.0), "hardsigmoid": (0.2, 0.5), "elu": (1.0, 0.0)}
# HTP tensors have at most this many dimensions.
MAX_RANK = 5
# Accepted LSTMs are unrolled (for accuracy, see above) while the nodes they add together stay
# under this, for the build's time: 3 layers x 80 steps add 4,600 nodes and quantize in ~2.5
# min; a bidirectional 2-layer LSTM over 80 steps adds 6,100 and took 10x its whole build's
# time (191 s) for 0.5 dB: such models keep the HTP's LSTM.
LSTM_UNROLL_NODES = 5_000
# ... unless the HTP's own LSTM, run whole in fp16 on held-out samples, already misses the
# target (pipeline.quantize.build: a Resemblyzer speaker encoder, 3 layers of 256 over 160
# steps, 12.6 dB native, 39.6 dB unrolled into 9,162 nodes): then up to this many.
LSTM_UNROLL_CAP = 20_000
# The LSTMs kept whole for the budget say so in the step's details with this phrase.
LSTMS_KEPT_WHOLE = "LSTMs QNN takes kept whole"

_ATTR = onnx.helper.get_attribute_value


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: _ATTR(a) for a in node.attribute}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _directions(attrs: dict[str, Any]) -> list[str]:
    direction = _text(attrs.get("direction", b"forward"))
    return ["forward", "reverse"] if direction == "bidirectional" else [direction]


def _activation_names(op: str, attrs: dict[str, Any], directions: int) -> list[str]:
    names = attrs.get("activations")
    if names is None:
        return list(DEFAULT_ACTIVATIONS[op]) * directions
    return [_text(n).lower() for n in names]


# --------------------------------------------------------------------------------------------
# normalize: drop what changes nothing


def normalize_recurrent_ops(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Remove attributes and inputs of LSTM/GRU/RNN that only restate the defaults.

    Why: the QNN EP refuses any ``activations`` attribute, even ["Sigmoid", "Tanh", "Tanh"]
    (it compares with lower-case names), and Keras/TF exporters always write one; a constant
    ``sequence_lens`` equal to the sequence length is the same as none. Same function.
    """
    model = edit.writable(model)
    graph = model.graph
    inits = edit.initializers_by_name(graph)
    values: dict[str, onnx.ValueInfoProto] | None = None
    details = []
    for node in graph.node:
        if node.op_type not in RECURRENT_OPS or node.domain not in edit.DEFAULT_DOMAINS:
            continue
        attrs = _attrs(node)
        dirs = len(_directions(attrs))
        names = attrs.get("activations")
        if (
            names is not None
            and [_text(n).lower() for n in names] == list(DEFAULT_ACTIVATIONS[node.op_type]) * dirs
            and not attrs.get("activation_alpha")
            and not attrs.get("activation_beta")
        ):
            drop = {"activations", "activation_alpha", "activation_beta"}
            kept = [a for a in node.attribute if a.name not in drop]
            del node.attribute[:]
            node.attribute.extend(kept)
            details.append(f"{edit.node_label(node)}: dropped activations = default")
        if node.op_type == "LSTM" and "input_forget" in attrs and attrs["input_forget"] == 0:
            kept = [a for a in node.attribute if a.name != "input_forget"]
            del node.attribute[:]
            node.attribute.extend(kept)
        if len(node.input) > 4 and node.input[4] in inits:
            lengths = numpy_helper.to_array(inits[node.input[4]])
            values = values if values is not None else edit.inferred_values(model)
            x = values.get(node.input[0])
            shape = edit.value_shape(x) if x is not None else None
            if shape is not None and len(shape) == 3:
                steps = shape[1] if attrs.get("layout", 0) == 1 else shape[0]
                if lengths.size and bool(np.all(lengths == steps)):
                    node.input[4] = ""
                    details.append(
                        f"{edit.node_label(node)}: dropped sequence_lens (all {steps} = length)"
                    )
    return edit.checked_change(model, "normalize_recurrent_ops", details)


# --------------------------------------------------------------------------------------------
# unroll: elementary ops for the forms QNN refuses


def qnn_recurrent_steps(model: onnx.ModelProto) -> int:
    """The cells QNN builds for the LSTM, GRU and RNN nodes left in ``model``: each node's
    sequence length times its directions, summed (0 without such nodes, or where a length is
    not static). Why: they, not the node count, set how long QNN compiles such a model
    (``CompileSection.timeout_for``)."""
    nodes = [
        n
        for n in model.graph.node
        if n.op_type in RECURRENT_OPS and n.domain in edit.DEFAULT_DOMAINS and n.input
    ]
    if not nodes:
        return 0
    values = edit.inferred_values(model)
    steps = 0
    for node in nodes:
        value = values.get(node.input[0])
        shape = edit.value_shape(value) if value is not None else None
        if shape is None or len(shape) != 3:
            continue
        attrs = _attrs(node)
        steps += shape[int(attrs.get("layout", 0))] * len(_directions(attrs))
    return steps


def qnn_refuses(node: onnx.NodeProto) -> list[str]:
    """Why the QNN EP would not run ``node`` (an LSTM/GRU/RNN) right; [] = it does."""
    attrs = _attrs(node)
    reasons = []
    if node.op_type == "RNN":
        reasons.append("no QNN RNN op")
    if "activations" in attrs:
        reasons.append("activations " + "/".join(_text(a) for a in attrs["activations"]))
    if attrs.get("clip") is not None:
        reasons.append(f"clip {attrs['clip']:g}")
    if attrs.get("layout", 0) == 1:
        reasons.append("layout 1")
    if node.op_type == "LSTM" and attrs.get("input_forget", 0):
        reasons.append("input_forget 1 (QNN ignores it)")
    return reasons


@dataclass
class _Emitter:
    """Collects the nodes and constants of one rewrite, with fresh names."""

    fresh: Callable[[str], str]
    base: str
    # Opset >= 18: an even Split by ``num_outputs``, no sizes constant. onnxruntime's
    # qnn_preprocess_model stores constants of 1 KiB and more as external data, which ONNX
    # shape inference cannot read for a Split's sizes (an LSTM of over 128 steps failed there).
    split_by_count: bool = False
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    inits: list[onnx.TensorProto] = field(default_factory=list)

    def const(self, value: np.ndarray, tag: str) -> str:
        name = self.fresh(f"{self.base}_{tag}")
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def op(self, op_type: str, inputs: list[str], tag: str, outputs: int = 1, **attrs: Any):
        names = [
            self.fresh(f"{self.base}_{tag}" + (f"_{i}" if outputs > 1 else ""))
            for i in range(outputs)
        ]
        self.nodes.append(
            onnx.helper.make_node(
                op_type, inputs, names, name=self.fresh(f"{self.base}_{tag}_node"), **attrs
            )
        )
        return names if outputs > 1 else names[0]

    def split(self, x: str, sizes: list[int], axis: int, tag: str) -> list[str]:
        if len(sizes) == 1:
            return [x]
        if self.split_by_count and len(set(sizes)) == 1:
            return self.op("Split", [x], tag, outputs=len(sizes), axis=axis, num_outputs=len(sizes))
        sizes_name = self.const(np.array(sizes, np.int64), f"{tag}_sizes")
        return self.op("Split", [x, sizes_name], tag, outputs=len(sizes), axis=axis)

    def reshape(self, x: str, shape: list[int], tag: str) -> str:
        return self.op("Reshape", [x, self.const(np.array(shape, np.int64), f"{tag}_shape")], tag)


class _Activation:
    """One gate function as onnxruntime's RNN kernels define it (name, alpha, beta)."""

    def __init__(self, name: str, alpha: float, beta: float) -> None:
        self.name, self.alpha, self.beta = name, alpha, beta

    def __call__(self, e: _Emitter, x: str, tag: str) -> str:
        f32 = np.float32
        if self.name == "sigmoid":
            return e.op("Sigmoid", [x], tag)
        if self.name == "tanh":
            return e.op("Tanh", [x], tag)
        if self.name == "relu":
            return e.op("Relu", [x], tag)
        if self.name == "leakyrelu":
            return e.op("LeakyRelu", [x], tag, alpha=self.alpha)
        if self.name == "thresholdedrelu":
            return e.op("ThresholdedRelu", [x], tag, alpha=self.alpha)
        if self.name == "hardsigmoid":
            return e.op("HardSigmoid", [x], tag, alpha=self.alpha, beta=self.beta)
        if self.name == "elu":
            return e.op("Elu", [x], tag, alpha=self.alpha)
        if self.name == "softsign":
            return e.op("Softsign", [x], tag)
        if self.name == "softplus":
            return e.op("Softplus", [x], tag)
        if self.name == "affine":
            scaled = e.op("Mul", [x, e.const(np.array(self.alpha, f32), f"{tag}_a")], f"{tag}_ax")
            return e.op("Add", [scaled, e.const(np.array(self.beta, f32), f"{tag}_b")], tag)
        if self.name == "scaledtanh":
            inner = e.op("Mul", [x, e.const(np.array(self.beta, f32), f"{tag}_b")], f"{tag}_bx")
            tanh = e.op("Tanh", [inner], f"{tag}_tanh")
            return e.op("Mul", [tanh, e.const(np.array(self.alpha, f32), f"{tag}_a")], tag)
        raise ValueError(self.name)


def _activations(op: str, attrs: dict[str, Any], directions: int) -> list[_Activation] | None:
    """The gate functions in onnxruntime's order (alpha/beta consumed along the list)."""
    names = _activation_names(op, attrs, directions)
    if len(names) != len(DEFAULT_ACTIVATIONS[op]) * directions:
        return None
    alphas = list(attrs.get("activation_alpha") or [])
    betas = list(attrs.get("activation_beta") or [])
    result = []
    for name in names:
        if name not in _ACTIVATION_PARAMS:
            return None
        needs_alpha, needs_beta = _ACTIVATION_PARAMS[name]
        default_alpha, default_beta = _ACTIVATION_DEFAULTS.get(name, (0.0, 0.0))
        alpha = (alphas.pop(0) if alphas else default_alpha) if needs_alpha else 0.0
        beta = (betas.pop(0) if betas else default_beta) if needs_beta else 0.0
        result.append(_Activation(name, float(alpha), float(beta)))
    return result


@dataclass(frozen=True)
class _Cell:
    """One LSTM/GRU/RNN node's static facts."""

    op: str
    steps: int
    batch: int
    hidden: int
    layout: int
    directions: list[str]
    clip: float | None
    input_forget: bool
    linear_before_reset: bool
    functions: list[_Activation]


def _constant(inits: dict[str, onnx.TensorProto], name: str) -> np.ndarray | None:
    if not name:
        return None
    return numpy_helper.to_array(inits[name]).astype(np.float32) if name in inits else None


@dataclass
class _Direction:
    """One direction's per-step inputs (input projections) and its constants."""

    steps: list[list[str]]  # gate -> step -> [batch, hidden] input projection (with biases)
    recurrence: list[str]  # gate -> R rows [hidden, hidden] (Gemm with transB)
    functions: list[_Activation]
    rbh: str = ""  # GRU: recurrent bias of the candidate gate (linear_before_reset)
    peepholes: list[str] | None = None  # LSTM: P_i, P_o, P_f
    clip: tuple[str, str] | None = None


def _direction(
    e: _Emitter, cell: _Cell, d: int, x2d: str, consts: dict[str, np.ndarray | None]
) -> _Direction:
    """Constants of direction ``d`` and its input projections for every step at once, one
    Gemm per gate (so each gate's pre-activation gets its own quantization range)."""
    gates, hidden, tag = GATES[cell.op], cell.hidden, f"d{d}"
    w, r, bias = consts["W"], consts["R"], consts["B"]
    assert w is not None and r is not None and bias is not None
    wb, rb = bias[d][: gates * hidden], bias[d][gates * hidden :]

    def rows(block: np.ndarray, g: int) -> np.ndarray:
        return block[g * hidden : (g + 1) * hidden]

    steps = []
    for g in range(gates):
        b = rows(wb, g)
        if not (cell.op == "GRU" and cell.linear_before_reset and g == 2):
            b = b + rows(rb, g)  # recurrent bias outside the reset gate: fold it in
        weight, b_name = e.const(rows(w[d], g), f"{tag}_W{g}"), e.const(b, f"{tag}_b{g}")
        proj = e.op("Gemm", [x2d, weight, b_name], f"{tag}_x{g}", transB=1)
        steps.append(e.split(proj, [cell.batch] * cell.steps, 0, f"{tag}_x{g}_steps"))
    per = len(DEFAULT_ACTIVATIONS[cell.op])
    result = _Direction(
        steps,
        [e.const(rows(r[d], g), f"{tag}_R{g}") for g in range(gates)],
        cell.functions[d * per : (d + 1) * per],
    )
    if cell.op == "GRU" and cell.linear_before_reset:
        result.rbh = e.const(rows(rb, 2), f"{tag}_Rbh")
    peepholes = consts["P"]
    if cell.op == "LSTM" and peepholes is not None:
        result.peepholes = [
            e.const(peepholes[d][k * hidden : (k + 1) * hidden], f"{tag}_P{k}") for k in range(3)
        ]
    if cell.clip is not None:
        result.clip = (
            e.const(np.array(-cell.clip, np.float32), f"{tag}_clip_lo"),
            e.const(np.array(cell.clip, np.float32), f"{tag}_clip_hi"),
        )
    return result


def _pre(e: _Emitter, p: _Direction, value: str, tag: str) -> str:
    """A gate's pre-activation, clipped as onnxruntime does (after bias and peephole)."""
    return e.op("Clip", [value, *p.clip], f"{tag}_clip") if p.clip else value


def _sum(e: _Emitter, p: _Direction, x: str, h: str | None, g: int, tag: str) -> str:
    """x_t W_g^T + b_g (+ h_{t-1} R_g^T when there is a previous state)."""
    if h is None:
        return x
    return e.op("Add", [x, e.op("Gemm", [h, p.recurrence[g]], f"{tag}_h{g}", transB=1)], tag)


def _lstm_step(
    e: _Emitter, cell: _Cell, p: _Direction, xs: list[str], h: str | None, c: str | None, s: str
) -> tuple[str, str]:
    """gates i, o, f, c (ONNX order); C = f*C + i*g(c); H = o*h(C); peepholes read C."""
    f, g, hf = p.functions
    i_pre, o_pre = _sum(e, p, xs[0], h, 0, f"{s}_i_sum"), _sum(e, p, xs[1], h, 1, f"{s}_o_sum")
    f_pre, c_pre = _sum(e, p, xs[2], h, 2, f"{s}_f_sum"), _sum(e, p, xs[3], h, 3, f"{s}_c_sum")
    if p.peepholes is not None and c is not None:
        i_pre = e.op("Add", [i_pre, e.op("Mul", [c, p.peepholes[0]], f"{s}_pi")], f"{s}_i_peep")
        f_pre = e.op("Add", [f_pre, e.op("Mul", [c, p.peepholes[2]], f"{s}_pf")], f"{s}_f_peep")
    gate_i = f(e, _pre(e, p, i_pre, f"{s}_i"), f"{s}_i")
    if cell.input_forget:  # coupled gates: f = 1 - i
        one = e.const(np.array(1.0, np.float32), f"{s}_one")
        gate_f = e.op("Sub", [one, gate_i], f"{s}_f")
    else:
        gate_f = f(e, _pre(e, p, f_pre, f"{s}_f"), f"{s}_f")
    new_c = e.op("Mul", [gate_i, g(e, _pre(e, p, c_pre, f"{s}_c"), f"{s}_g")], f"{s}_ig")
    if c is not None:
        new_c = e.op("Add", [e.op("Mul", [gate_f, c], f"{s}_fc"), new_c], f"{s}_C")
    if p.peepholes is not None:
        o_pre = e.op("Add", [o_pre, e.op("Mul", [new_c, p.peepholes[1]], f"{s}_po")], f"{s}_o_peep")
    gate_o = f(e, _pre(e, p, o_pre, f"{s}_o"), f"{s}_o")
    return e.op("Mul", [gate_o, hf(e, new_c, f"{s}_hC")], f"{s}_H"), new_c


def _gru_step(e: _Emitter, cell: _Cell, p: _Direction, xs: list[str], h: str | None, s: str) -> str:
    """gates z, r, h (ONNX order); H = (1 - z) * h~ + z * H, written as h~ + z * (H - h~)."""
    f, g = p.functions
    gate_z = f(e, _pre(e, p, _sum(e, p, xs[0], h, 0, f"{s}_z_sum"), f"{s}_z"), f"{s}_z")
    gate_r = f(e, _pre(e, p, _sum(e, p, xs[1], h, 1, f"{s}_r_sum"), f"{s}_r"), f"{s}_r")
    if cell.linear_before_reset:  # h~ = g(x Wh + Wbh + r * (H Rh + Rbh))
        rec = p.rbh  # H = 0: H Rh = 0
        if h is not None:
            rec = e.op("Gemm", [h, p.recurrence[2], p.rbh], f"{s}_h2", transB=1)
        h_pre = e.op("Add", [xs[2], e.op("Mul", [gate_r, rec], f"{s}_rh")], f"{s}_h_sum")
    elif h is None:  # (r * 0) Rh = 0
        h_pre = xs[2]
    else:  # h~ = g(x Wh + (r * H) Rh + Wbh + Rbh)
        reset = e.op("Mul", [gate_r, h], f"{s}_rH")
        rec = e.op("Gemm", [reset, p.recurrence[2]], f"{s}_h2", transB=1)
        h_pre = e.op("Add", [xs[2], rec], f"{s}_h_sum")
    cand = g(e, _pre(e, p, h_pre, f"{s}_h"), f"{s}_g")
    if h is None:
        one = e.const(np.array(1.0, np.float32), f"{s}_one")
        return e.op("Mul", [e.op("Sub", [one, gate_z], f"{s}_1mz"), cand], f"{s}_H")
    delta = e.op("Sub", [h, cand], f"{s}_dh")
    return e.op("Add", [cand, e.op("Mul", [gate_z, delta], f"{s}_zdh")], f"{s}_H")


def _unroll(
    node: onnx.NodeProto,
    cell: _Cell,
    inits: dict[str, onnx.TensorProto],
    fresh: Callable[[str], str],
    split_by_count: bool = False,
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """Nodes computing ``node``'s outputs step by step (same names for its outputs)."""
    inputs = list(node.input) + [""] * (8 - len(node.input))
    consts = {k: _constant(inits, inputs[i]) for k, i in (("W", 1), ("R", 2), ("B", 3), ("P", 7))}
    if consts["B"] is None:
        consts["B"] = np.zeros((len(cell.directions), 2 * GATES[cell.op] * cell.hidden), np.float32)
    batch, hidden, steps = cell.batch, cell.hidden, cell.steps
    e = _Emitter(fresh, node.name or node.output[0], split_by_count)

    # X as [steps * batch, input] (time-major rows), once for all directions.
    x = inputs[0]
    if cell.layout == 1:
        x = e.op("Transpose", [x], "x_time_major", perm=[1, 0, 2])
    x2d = e.reshape(x, [steps * batch, -1], "x_rows")

    def states(name: str, tag: str) -> list[str | None]:
        """A state input [directions, batch, hidden] (layout 1: [batch, directions, hidden])
        as one [batch, hidden] tensor per direction; None where it is absent (zeros)."""
        if not name:
            return [None] * len(cell.directions)
        parts = e.split(name, [1] * len(cell.directions), cell.layout, f"{tag}_dirs")
        return [e.reshape(part, [batch, hidden], f"{tag}_{d}") for d, part in enumerate(parts)]

    initial_h, initial_c = states(inputs[5], "h0"), states(inputs[6], "c0")
    ys: list[list[str]] = []
    last_h: list[str] = []
    last_c: list[str] = []
    for d, direction in enumerate(cell.directions):
        p = _direction(e, cell, d, x2d, consts)
        h, c = initial_h[d], initial_c[d]
        outputs = [""] * steps
        order = range(steps) if direction == "forward" else range(steps - 1, -1, -1)
        for step in order:
            s, xs = f"d{d}_t{step}", [p.steps[g][step] for g in range(GATES[cell.op])]
            if cell.op == "LSTM":
                h, c = _lstm_step(e, cell, p, xs, h, c, s)
            elif cell.op == "GRU":
                h = _gru_step(e, cell, p, xs, h, s)
            else:  # RNN: H = f(x Wi + H Ri + b)
                h = p.functions[0](e, _pre(e, p, _sum(e, p, xs[0], h, 0, f"{s}_sum"), s), f"{s}_H")
            outputs[step] = h
        assert h is not None
        ys.append(outputs)
        last_h.append(h)
        if c is not None:
            last_c.append(c)
    _outputs(e, node, cell, ys, last_h, last_c)
    return e.nodes, e.inits


def _outputs(
    e: _Emitter,
    node: onnx.NodeProto,
    cell: _Cell,
    ys: list[list[str]],
    last_h: list[str],
    last_c: list[str],
) -> None:
    """Y [T, D, B, H] (layout 1: [B, T, D, H]); Y_h, Y_c [D, B, H] ([B, D, H]), by the names
    of ``node``'s outputs, from the per-step [B, H] states."""
    dirs, batch, hidden, steps = len(cell.directions), cell.batch, cell.hidden, cell.steps
    outs = list(node.output) + [""] * (3 - len(node.output))

    def stack(parts: list[str], shape: list[int], axis: int, tag: str, target: str = "") -> str:
        """``parts`` reshaped to ``shape`` with 1 at ``axis``, concatenated along it."""
        target = target or e.fresh(f"{e.base}_{tag}")
        if len(parts) == 1:
            shape_name = e.const(np.array(shape, np.int64), f"{tag}_shape")
            e.nodes.append(
                onnx.helper.make_node(
                    "Reshape", [parts[0], shape_name], [target], name=e.fresh(f"{e.base}_{tag}")
                )
            )
            return target
        piece = list(shape)
        piece[axis] = 1
        expanded = [e.reshape(part, piece, f"{tag}_{k}") for k, part in enumerate(parts)]
        e.nodes.append(
            onnx.helper.make_node(
                "Concat", expanded, [target], name=e.fresh(f"{e.base}_{tag}"), axis=axis
            )
        )
        return target

    if outs[0]:
        per_step = [[ys[d][step] for d in range(dirs)] for step in range(steps)]
        if cell.layout == 0:
            rows = [
                stack(parts, [1, dirs, batch, hidden], 1, f"y{k}")
                for k, parts in enumerate(per_step)
            ]
            stack(rows, [steps, dirs, batch, hidden], 0, "Y", outs[0])
        else:
            rows = [
                stack(parts, [batch, 1, dirs, hidden], 2, f"y{k}")
                for k, parts in enumerate(per_step)
            ]
            stack(rows, [batch, steps, dirs, hidden], 1, "Y", outs[0])
    state_shape = [batch, dirs, hidden] if cell.layout == 1 else [dirs, batch, hidden]
    if outs[1]:
        stack(last_h, state_shape, cell.layout, "Y_h", outs[1])
    if cell.op == "LSTM" and outs[2]:
        stack(last_c, state_shape, cell.layout, "Y_c", outs[2])


def _cell(
    node: onnx.NodeProto,
    inits: dict[str, onnx.TensorProto],
    shape: Callable[[str], tuple[int, ...] | None],
) -> tuple[_Cell | None, str]:
    """The static facts of ``node``, or (None, why it cannot be unrolled)."""
    attrs = _attrs(node)
    inputs = list(node.input) + [""] * (8 - len(node.input))
    if inputs[1] not in inits or inputs[2] not in inits:
        return None, "W or R is not a constant"
    for index in (3, 7):
        if inputs[index] and inputs[index] not in inits:
            return None, f"input {index} is not a constant"
    if inputs[4]:
        return None, "sequence_lens shorter than the sequence (or not constant)"
    x_shape = shape(inputs[0])
    if x_shape is None or len(x_shape) != 3:
        return None, "X has no static shape"
    layout = int(attrs.get("layout", 0))
    steps, batch = (x_shape[1], x_shape[0]) if layout == 1 else (x_shape[0], x_shape[1])
    directions = _directions(attrs)
    functions = _activations(node.op_type, attrs, len(directions))
    if functions is None:
        return None, "unknown activation functions"
    hidden = int(attrs.get("hidden_size", 0)) or numpy_helper.to_array(inits[inputs[2]]).shape[-1]
    clip = attrs.get("clip")
    return (
        _Cell(
            node.op_type,
            steps,
            batch,
            hidden,
            layout,
            directions,
            None if clip is None else float(clip),
            bool(attrs.get("input_forget", 0)),
            bool(attrs.get("linear_before_reset", 0)),
            functions,
        ),
        "",
    )


def unroll_recurrent_ops(
    model: onnx.ModelProto, everything: bool = False, budget: int | None = None
) -> tuple[onnx.ModelProto, Change]:
    """LSTM/GRU/RNN nodes the QNN EP refuses (``qnn_refuses``) -> elementary ops, per step.

    Why: a refused recurrent op runs on the CPU and splits the graph around it. Unrolled, the
    cell is Gemm/Add/Mul/Sigmoid/Tanh that the HTP runs, each gate with its own quantization
    range. Needs static shapes and constant weights; the same function as onnxruntime's kernel.
    Accepted LSTMs are unrolled as well, all or none, within ``budget`` added nodes (None:
    ``LSTM_UNROLL_NODES``; the HTP's own LSTM is mostly the less accurate), none with budget 0;
    ``everything`` unrolls every accepted node, with no budget (to compare both forms).
    """
    budget = LSTM_UNROLL_NODES if budget is None else budget
    model = edit.copy_model(model)
    graph = model.graph
    inits = edit.initializers_by_name(graph)
    values: dict[str, onnx.ValueInfoProto] | None = None

    def shape(name: str) -> tuple[int, ...] | None:
        nonlocal values
        values = values if values is not None else edit.inferred_values(model)
        return edit.value_shape(values[name]) if name in values else None

    fresh = edit.FreshNames(model)
    split_by_count = edit.opset_version(model) >= 18
    notes: dict[int, str] = {}  # node index -> what became of it
    # node index -> (its unrolled nodes, their constants, whether unrolled for accuracy only)
    unrolled: dict[int, tuple[list[onnx.NodeProto], list[onnx.TensorProto], bool]] = {}
    for index, node in enumerate(graph.node):
        if node.op_type not in RECURRENT_OPS or node.domain not in edit.DEFAULT_DOMAINS:
            continue
        reasons = qnn_refuses(node)
        accuracy_only = not reasons and not everything
        if accuracy_only and (node.op_type != "LSTM" or budget <= 0):
            continue
        cell, why_not = _cell(node, inits, shape)
        if cell is None:
            if reasons:
                notes[index] = (
                    f"{edit.node_label(node)}: kept ({why_not}); QNN refuses it: {reasons}"
                )
            continue
        added, constants = _unroll(node, cell, inits, fresh, split_by_count)
        unrolled[index] = (added, constants, accuracy_only)
        why = ", ".join(reasons) if reasons else ("asked" if everything else "accuracy")
        notes[index] = (
            f"{edit.node_label(node)}: unrolled into {len(added)} nodes ({cell.steps} step(s), "
            f"{'/'.join(cell.directions)}; {why})"
        )
    # Accepted LSTMs are unrolled all together or not at all (a model is one kind or the other).
    for_accuracy_nodes = sum(len(added) for added, _, only in unrolled.values() if only)
    over_budget = for_accuracy_nodes > budget
    if over_budget:
        for index in [i for i, (_, _, only) in unrolled.items() if only]:
            del unrolled[index], notes[index]
    details = [notes[i] for i in sorted(notes)]
    if over_budget:
        details.append(
            f"{LSTMS_KEPT_WHOLE}: unrolled, they would add {for_accuracy_nodes} nodes "
            f"(over {budget})"
        )
    if unrolled:
        nodes = [n for i, node in enumerate(graph.node) for n in unrolled.get(i, ([node],))[0]]
        edit.set_nodes(graph, nodes)
        graph.initializer.extend(c for _, constants, _ in unrolled.values() for c in constants)
        edit.remove_dead_nodes(graph)
        edit.sort_graph(graph)
    return edit.checked_change(model, "unroll_recurrent_ops", details)


# --------------------------------------------------------------------------------------------
# rank > 5: Gather with an index table, Transpose, Reshape chains


def _reduced_transpose(
    in_shape: tuple[int, ...], perm: list[int]
) -> tuple[list[int], list[int]] | None:
    """(input shape, perm) of the same transpose with unit axes dropped and axes that stay
    neighbours merged; None when nothing gets smaller."""
    kept_axes = [a for a in range(len(in_shape)) if in_shape[a] != 1]
    position = {a: i for i, a in enumerate(kept_axes)}
    order = [position[a] for a in perm if in_shape[a] != 1]  # kept axes, in output order
    groups: list[list[int]] = []
    for p in order:
        if groups and groups[-1][-1] + 1 == p:
            groups[-1].append(p)
        else:
            groups.append([p])
    by_input = sorted(groups, key=lambda g: g[0])
    shape = [int(np.prod([in_shape[kept_axes[p]] for p in g])) for g in by_input]
    new_perm = [by_input.index(g) for g in groups]
    if len(shape) >= len(in_shape):
        return None
    return shape, new_perm


def _stacked_inputs(
    node: onnx.NodeProto,
    graph: onnx.GraphProto,
    inits: dict[str, onnx.TensorProto],
    shape: Callable[[str], tuple[int, ...] | None],
) -> tuple[list[str], int] | None:
    """For a Concat whose every input is an Unsqueeze at the Concat's axis (``torch.stack``,
    a pixel unshuffle written as slices): the Unsqueezes' inputs and that axis, when the axis
    is not their last. Concatenating those along it lays the values out in memory exactly as
    the stack does, one rank lower."""
    producer = {o: n for n in graph.node for o in n.output}
    out_shape = shape(node.output[0])
    if out_shape is None:
        return None
    rank = len(out_shape)
    axis = _attrs(node).get("axis", 0) % rank
    raw = []
    for name in node.input:
        unsqueeze = producer.get(name)
        if unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or len(unsqueeze.input) < 2:
            return None
        if unsqueeze.input[1] not in inits:
            return None
        axes = numpy_helper.to_array(inits[unsqueeze.input[1]]).reshape(-1)
        if len(axes) != 1 or int(axes[0]) % rank != axis:
            return None
        raw.append(unsqueeze.input[0])
    if axis >= rank - 1:
        return None
    return raw, axis


def lower_high_rank(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Rank > 5 tensors -> rank <= 5, exactly: the HTP has no tensors above rank 5.

    - Gather(x, constant index table of rank >= 2) giving rank > 5 -> Gather with the flat
      index, then Reshape (``nn.Unfold`` exports: [1, 3, 1, 1, 131] by a [3, 129] table);
    - Transpose of rank > 5 -> Reshape, Transpose of the tensor without its unit axes and with
      neighbouring axes merged (often no transpose at all), Reshape;
    - Concat of Unsqueezes at its axis (a stack) giving rank > 5 -> Concat of the unsqueezed
      tensors, then Reshape (XFeat's keypoint head unshuffles 8x8 cells as 40 slices stacked
      into [1, 1, 28, 40, 8, 8]: 2 partitions and 165 CPU nodes);
    - an elementwise op on a Reshape's rank > 5 result, its other inputs single constants ->
      the op before the Reshape (RAFT's correlation: MatMul, a view to [1, h, w, 1, h, w], a
      Div by sqrt(C), a view back: 2 partitions and 10 CPU nodes);
    - Reshape of a Reshape whose result had rank > 5 -> one Reshape.

    Why: GTCRN's subband unfolds made 7 such Gather -> Transpose -> Reshape chains; the HTP
    refused each Gather (error 3110), and each chain cost a CPU round trip and a partition.
    """
    model = edit.writable(model)
    graph = model.graph
    inits = edit.initializers_by_name(graph)
    values = edit.inferred_values(model)

    def shape(name: str) -> tuple[int, ...] | None:
        if name in inits:
            return tuple(inits[name].dims)
        return edit.value_shape(values[name]) if name in values else None

    fresh = edit.FreshNames(model)
    details = []
    nodes: list[onnx.NodeProto] = []
    new_inits: list[onnx.TensorProto] = []

    def shape_const(dims: tuple[int, ...] | list[int], base: str) -> str:
        name = fresh(f"{base}_shape")
        new_inits.append(numpy_helper.from_array(np.array(dims, np.int64), name))
        return name

    make = onnx.helper.make_node

    def reshape(
        source: str, dims: Sequence[int], output: str, base: str, suffix: str = ""
    ) -> onnx.NodeProto:
        """Reshape ``source`` to ``dims``, named ``base`` or a fresh ``base_suffix``."""
        target = shape_const(tuple(dims), base)
        name = fresh(f"{base}_{suffix}") if suffix else base
        return make("Reshape", [source, target], [output], name=name)

    stacks = 0
    producers = {o: n for n in graph.node for o in n.output}
    for node in graph.node:
        out_shape = shape(node.output[0]) if node.output else None
        if (
            node.domain not in edit.DEFAULT_DOMAINS
            or out_shape is None
            or len(out_shape) <= MAX_RANK
        ):
            nodes.append(node)
            continue
        base = node.name or node.output[0]
        if node.op_type == "Gather" and node.input[1] in inits:
            index = numpy_helper.to_array(inits[node.input[1]])
            x_shape = shape(node.input[0])
            if index.ndim < 2 or x_shape is None or len(x_shape) > MAX_RANK:
                nodes.append(node)
                continue
            flat = fresh(f"{base}_flat_index")
            new_inits.append(numpy_helper.from_array(index.reshape(-1), flat))
            gathered = fresh(f"{base}_flat")
            nodes.append(
                make("Gather", [node.input[0], flat], [gathered], name=base, **_attrs(node))
            )
            nodes.append(reshape(gathered, out_shape, node.output[0], base, "unflatten"))
            details.append(f"{edit.node_label(node)}: flat index {list(index.shape)} -> Reshape")
        elif node.op_type == "Transpose":
            in_shape = shape(node.input[0])
            perm = list(_attrs(node).get("perm", range(len(out_shape)))[::1])
            reduced = _reduced_transpose(in_shape, perm) if in_shape is not None else None
            if reduced is None or len(reduced[0]) > MAX_RANK:
                nodes.append(node)
                continue
            small, small_perm = reduced
            if small_perm == sorted(small_perm):
                nodes.append(reshape(node.input[0], out_shape, node.output[0], base))
                details.append(f"{edit.node_label(node)}: moves only unit axes -> Reshape")
            else:
                flat_in, flat_out = fresh(f"{base}_in"), fresh(f"{base}_out")
                nodes += [
                    reshape(node.input[0], small, flat_in, base, "squeeze"),
                    make("Transpose", [flat_in], [flat_out], name=base, perm=small_perm),
                    reshape(flat_out, out_shape, node.output[0], base, "unsqueeze"),
                ]
                details.append(
                    f"{edit.node_label(node)}: rank {len(in_shape)} -> {len(small)} ({small})"
                )
        elif (viewed := _elementwise_on_view(node, producers, inits, shape)) is not None:
            before = fresh(f"{base}_before_view")
            nodes += [
                make(
                    node.op_type,
                    [viewed if i == node.input[0] else i for i in node.input],
                    [before],
                    name=base,
                    **_attrs(node),
                ),
                reshape(before, out_shape, node.output[0], base, "view"),
            ]
            details.append(
                f"{edit.node_label(node)}: on the rank-{len(shape(viewed) or ())} tensor "
                "before its rank-6+ Reshape"
            )
        elif node.op_type == "Concat" and (stacked := _stacked_inputs(node, graph, inits, shape)):
            raw, axis = stacked
            joined = fresh(f"{base}_joined")
            nodes += [
                make("Concat", raw, [joined], name=base, axis=axis),
                reshape(joined, out_shape, node.output[0], base, "stacked"),
            ]
            stacks += 1
            details.append(
                f"{edit.node_label(node)}: a stack of {len(raw)} at axis {axis} -> Concat of "
                "the unstacked tensors, Reshape"
            )
        else:
            nodes.append(node)
    if details:
        edit.set_nodes(graph, nodes)
        graph.initializer.extend(new_inits)
        del new_inits[:]
    if stacks:  # the Unsqueezes a rewritten stack read are read by nothing now
        edit.remove_dead_nodes(graph)
    # Reshape(Reshape(x)) -> Reshape(x) where the middle tensor has rank > 5.
    producer = {o: n for n in graph.node for o in n.output}
    outputs = {o.name for o in graph.output}
    values = edit.inferred_values(model) if details else values
    for node in graph.node:
        if node.op_type != "Reshape" or node.domain not in edit.DEFAULT_DOMAINS:
            continue
        inner = producer.get(node.input[0])
        middle = shape(node.input[0]) if inner is not None else None
        target = shape(node.output[0])
        if (
            inner is None
            or inner.op_type != "Reshape"
            or middle is None
            or len(middle) <= MAX_RANK
            or target is None
            or node.input[0] in outputs
        ):
            continue
        node.input[0] = inner.input[0]
        node.input[1] = shape_const(target, node.name or node.output[0])
        details.append(
            f"{edit.node_label(node)}: reads {inner.input[0]!r} (skips a rank-{len(middle)} Reshape)"
        )
    if details:
        graph.initializer.extend(new_inits)
        edit.remove_dead_nodes(graph)
        edit.sort_graph(graph)
    return edit.checked_change(model, "lower_high_rank", details)


# Ops that compute each output element from the same element of their inputs alone.
_ELEMENTWISE = frozenset(
    {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Relu", "Sigmoid", "Tanh", "Exp", "Log"}
    | {"Neg", "Abs", "Sqrt", "Reciprocal", "Erf", "LeakyRelu", "Elu", "Softplus", "Clip"}
)


def _elementwise_on_view(
    node: onnx.NodeProto,
    producers: dict[str, onnx.NodeProto],
    inits: dict[str, onnx.TensorProto],
    shape: Callable[[str], tuple[int, ...] | None],
) -> str | None:
    """The rank <= 5 tensor behind ``node``'s first input when ``node`` is elementwise, that
    input a Reshape's result and every other input one constant value: the op computes the
    same on it, and the Reshape can follow."""
    if node.op_type not in _ELEMENTWISE or not node.input:
        return None
    view = producers.get(node.input[0])
    if view is None or view.op_type != "Reshape" or view.domain not in edit.DEFAULT_DOMAINS:
        return None
    behind = shape(view.input[0])
    if behind is None or len(behind) > MAX_RANK:
        return None
    others = [i for i in node.input[1:] if i]
    if any(
        i not in inits or int(np.prod(inits[i].dims)) != 1 or len(inits[i].dims) > len(behind)
        for i in others
    ):  # a [1, 1, 1, 1, 1, 1] constant would broadcast the result back to rank 6
        return None
    return view.input[0]


# --------------------------------------------------------------------------------------------
# ConvTranspose with dilations


def dilate_conv_transpose(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """ConvTranspose(dilations d > 1) -> ConvTranspose(dilations 1) with the dilated kernel.

    A dilated kernel is the kernel with d - 1 zeros between its taps: same output shape
    ((k - 1) d + 1 taps either way), same sums. Why: QNN's TransposeConv2d only takes dilation 1,
    and GTCRN's decoder (dilations 2 and 5 over time) lost two ConvTranspose to the CPU.
    """
    model = edit.writable(model)
    graph = model.graph
    inits = edit.initializers_by_name(graph)
    used = edit.used_names(graph)
    details = []
    for node in graph.node:
        if node.op_type != "ConvTranspose" or node.domain not in edit.DEFAULT_DOMAINS:
            continue
        attrs = _attrs(node)
        dilations = [int(d) for d in attrs.get("dilations", [])]
        if not dilations or all(d == 1 for d in dilations) or node.input[1] not in inits:
            continue
        weight = numpy_helper.to_array(inits[node.input[1]])
        spatial = weight.shape[2:]
        grown = [(k - 1) * d + 1 for k, d in zip(spatial, dilations, strict=True)]
        dilated = np.zeros(weight.shape[:2] + tuple(grown), weight.dtype)
        dilated[(slice(None), slice(None), *(slice(None, None, d) for d in dilations))] = weight
        name = node.input[1]
        if used[name] > 1:  # shared weight: give this node its own copy
            name = edit.FreshNames(model)(f"{name}_dilated")
            node.input[1] = name
            graph.initializer.append(numpy_helper.from_array(dilated, name))
        else:
            inits[name].CopyFrom(numpy_helper.from_array(dilated, name))
        edit.replace_attributes(node, ("dilations",), kernel_shape=grown)
        details.append(
            f"{edit.node_label(node)}: dilations {dilations} -> dilated kernel {list(spatial)} -> "
            f"{grown}"
        )
    return edit.checked_change(model, "dilate_conv_transpose", details)


def output_padding_to_pads(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """ConvTranspose(output_padding p) -> ConvTranspose with each end pad lowered by p.

    Exact wherever the end pad is at least p: output_padding uncrops the end of the full
    transposed convolution by as many positions as a smaller end pad would. Why: the QNN HTP
    computes a depthwise ConvTranspose (group = channels) with output padding wrongly, in 16
    bit and in fp16 alike (-2 dB on the simulator; the same op with the pads lowered: 69 dB),
    and PyTorch's ConvTranspose2d(k=3, stride=2, padding=1, output_padding=1) is a common
    2x upsampler in decoders.
    """
    model = edit.writable(model)
    details = []
    for node in model.graph.node:
        if node.op_type != "ConvTranspose" or node.domain not in edit.DEFAULT_DOMAINS:
            continue
        attrs = _attrs(node)
        extra = [int(p) for p in attrs.get("output_padding", [])]
        pads = [int(p) for p in attrs.get("pads", [])]
        if not any(extra) or "output_shape" in attrs or len(pads) != 2 * len(extra):
            continue
        if _text(attrs.get("auto_pad", "NOTSET")) != "NOTSET":
            continue
        rank = len(extra)
        if any(pads[rank + i] < p for i, p in enumerate(extra)):
            continue  # the extra positions lie past the full result: no pad can give them
        lowered = pads[:rank] + [pads[rank + i] - p for i, p in enumerate(extra)]
        edit.replace_attributes(node, ("output_padding",), pads=lowered)
        details.append(
            f"{edit.node_label(node)}: output_padding {extra} -> pads {pads} -> {lowered}"
        )
    return edit.checked_change(model, "output_padding_to_pads", details)


# --------------------------------------------------------------------------------------------
# Loops whose trip count is known once the shapes are static

# Past this many iterations, or unrolled nodes in the whole model, a loop is kept: the graph
# would be too big to quantize and compile in reasonable time (a 64-step BiLSTM of 4 loops is
# 10,000 nodes, its build ~20 minutes; onnxruntime's quantizer is superlinear in nodes).
MAX_UNROLLED_ITERATIONS = 2048
MAX_UNROLLED_NODES = 40_000
# Only small constants (counters, lengths, shapes) are evaluated to decide a loop's condition.
_SMALL_CONSTANT = 4096
# A body tensor's copy in iteration k is named "<name>__it<k>" (FreshNames may add "_n" after
# it for a second loop with the same body names): calibration shares one range per body tensor.
ITERATION_SUFFIX = re.compile(r"__it\d+")


def iteration_name(name: str, iteration: int) -> str:
    """The name of a Loop body's tensor (or node) in unrolled iteration ``iteration``."""
    return f"{name}__it{iteration}"


def _loop_parts(node: onnx.NodeProto) -> tuple[onnx.GraphProto, str, str, list[str]]:
    """(body, trip count name, condition name, loop-carried initial values) of a Loop."""
    inputs = list(node.input) + [""] * max(0, 2 - len(node.input))
    body = next(a.g for a in node.attribute if a.name == "body")
    return body, inputs[0], inputs[1], inputs[2:]


class _KnownValues:
    """Small constant values by name: the graph's initializers and what is computed from them."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.inits = edit.initializers_by_name(model.graph)
        self.values: dict[str, np.ndarray] = {}

    def add(self, tensor: onnx.TensorProto) -> str:
        """Append ``tensor`` to the graph's initializers, known from now on; its name."""
        self.model.graph.initializer.append(tensor)
        self.inits[tensor.name] = self.model.graph.initializer[-1]
        return tensor.name

    def get(self, name: str) -> np.ndarray | None:
        if name in self.values:
            return self.values[name]
        init = self.inits.get(name)
        if init is None or np.prod(init.dims, dtype=np.int64) > _SMALL_CONSTANT:
            return None
        value = numpy_helper.to_array(init)
        self.values[name] = value
        return value

    def propagate(self, nodes: list[onnx.NodeProto]) -> None:
        """Evaluate, in order, the nodes whose inputs are all known small constants."""
        from .transforms import run_nodes

        for node in nodes:
            if any(True for _ in edit.subgraphs(node)):
                continue
            if node.domain not in edit.DEFAULT_DOMAINS or not node.input:
                continue
            feeds = {name: self.get(name) for name in node.input if name}
            if any(value is None for value in feeds.values()):
                continue
            results = run_nodes([node], feeds, self.model)  # type: ignore[arg-type]
            self.values.update((k, v) for k, v in results.items() if np.size(v) <= _SMALL_CONSTANT)


def _unroll_loop(
    model: onnx.ModelProto, index: int, namer: edit.FreshNames
) -> tuple[list[onnx.NodeProto], int] | str:
    """(Nodes computing Loop ``index`` iteration by iteration, iterations), or why not."""
    node = model.graph.node[index]
    body, trip_name, cond_name, initial = _loop_parts(node)
    if any(True for n in body.node for _ in edit.subgraphs(n)):
        return "its body holds control flow of its own"
    known = _KnownValues(model)
    trip = known.get(trip_name) if trip_name else None
    if trip_name and trip is None:
        return f"its trip count {trip_name!r} is not a constant"
    cond = known.get(cond_name) if cond_name else np.array(True)
    if cond is None:
        return f"its condition {cond_name!r} is not a constant"
    if trip is None and not cond_name:
        return "it has neither a trip count nor a condition"
    limit = int(trip.reshape(())) if trip is not None else MAX_UNROLLED_ITERATIONS + 1
    body_inputs = [i.name for i in body.input]
    body_outputs = [o.name for o in body.output]
    carried_count = len(initial)
    scan_count = len(body_outputs) - 1 - carried_count
    local = {o for n in body.node for o in n.output if o}
    hoisted = {i.name: namer(i.name) for i in body.initializer}  # constants: once for all
    for init in body.initializer:
        copy = onnx.TensorProto()
        copy.CopyFrom(init)
        copy.name = hoisted[init.name]
        known.add(copy)
    node_names = edit.FreshNames(model)
    node_names.taken = {n.name for n in model.graph.node if n.name}
    nodes: list[onnx.NodeProto] = []
    carried = list(initial)
    cond_value = cond_name or ""
    scans: list[list[str]] = [[] for _ in range(scan_count)]
    iteration = 0
    while iteration < limit and bool(np.asarray(cond).reshape(())):
        if iteration >= MAX_UNROLLED_ITERATIONS:
            return f"it runs more than {MAX_UNROLLED_ITERATIONS} iterations"
        if len(nodes) + len(model.graph.node) > MAX_UNROLLED_NODES:
            return (
                f"unrolled, the model would pass {MAX_UNROLLED_NODES} nodes "
                f"(after {iteration} of its iterations)"
            )
        counter = known.add(
            numpy_helper.from_array(
                np.array(iteration, dtype=np.int64),
                namer(f"{node.name or 'loop'}_iteration_{iteration}"),
            )
        )
        if not cond_value:  # no condition given: the body's first input reads "true"
            cond_value = known.add(
                numpy_helper.from_array(np.array(True), namer(f"{node.name or 'loop'}_true"))
            )
        mapping = dict(zip(body_inputs, [counter, cond_value, *carried], strict=True))
        mapping.update(hoisted)
        mapping.update({name: namer(iteration_name(name, iteration)) for name in local})
        step = onnx.GraphProto()
        step.node.extend(body.node)
        edit.rename_tensors(step, mapping)
        for copied in step.node:
            if copied.name:  # onnxruntime refuses two nodes of one name
                copied.name = node_names(iteration_name(copied.name, iteration))
        nodes.extend(step.node)
        resolved = [mapping.get(name, name) for name in body_outputs]
        known.propagate(list(step.node))
        cond_value, carried = resolved[0], resolved[1 : 1 + carried_count]
        for k, name in enumerate(resolved[1 + carried_count :]):
            scans[k].append(name)
        if not cond_name:  # a for loop: the body's condition is passed on, never read
            iteration += 1
            continue
        cond = known.get(cond_value)
        if cond is None:
            return (
                f"whether it goes on after iteration {iteration} depends on the data "
                f"(its condition {body_outputs[0]!r})"
            )
        iteration += 1
    if iteration == 0:
        return "it runs no iteration (its scan outputs would be empty)"
    for final, out in zip(carried, node.output[:carried_count], strict=True):
        if out:
            nodes.append(onnx.helper.make_node("Identity", [final], [out]))
    axes = namer(f"{node.name or 'loop'}_scan_axis")
    model.graph.initializer.append(numpy_helper.from_array(np.array([0], np.int64), axes))
    for names, out in zip(scans, node.output[carried_count:], strict=True):
        if not out:
            continue
        stacked = []
        for name in names:
            stacked.append(namer(f"{name}_stacked"))
            nodes.append(onnx.helper.make_node("Unsqueeze", [name, axes], [stacked[-1]]))
        nodes.append(onnx.helper.make_node("Concat", stacked, [out], axis=0))
    return nodes, iteration


def unroll_static_loops(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A Loop whose iteration count the constants decide -> its body, once per iteration.

    Why: the QNN EP runs no control flow, so a Loop stays on the CPU with everything after it,
    and its outputs have no static shape. TensorFlow while loops (Keras RNNs that tf2onnx did
    not turn into LSTM ops, bidirectional or masked ones) and scripted PyTorch loops run a
    fixed number of iterations once the input shapes are fixed: the trip count or the
    condition then folds to a constant, iteration by iteration. Unrolled, each step's nodes
    are ordinary ops (the counter a constant), and scan outputs are the steps' values stacked
    on a new first axis, as Loop defines them. A loop whose condition depends on the data (an
    autoregressive decoder's end token) is kept and named.
    """
    from .transforms import fold_constants

    model = edit.writable(model)
    details: list[str] = []
    reasons: dict[tuple[str, ...], str] = {}  # loops kept in the last round, and why
    while True:  # a loop fed by an unrolled one gets its constants only after the folding
        unrolled_any = False
        reasons = {}
        while True:
            index = next(
                (
                    i
                    for i, n in enumerate(model.graph.node)
                    if n.op_type == "Loop"
                    and n.domain in edit.DEFAULT_DOMAINS
                    and tuple(n.output) not in reasons
                ),
                None,
            )
            if index is None:
                break
            node = model.graph.node[index]
            candidate = edit.copy_model(model)
            unrolled = _unroll_loop(candidate, index, edit.FreshNames(candidate))
            if isinstance(unrolled, str):
                reasons[tuple(node.output)] = f"kept {edit.node_label(node)}: {unrolled}"
                continue
            unrolled_nodes, iterations = unrolled
            nodes = list(candidate.graph.node)
            edit.set_nodes(candidate.graph, [*nodes[:index], *unrolled_nodes, *nodes[index + 1 :]])
            details.append(
                f"unrolled {edit.node_label(node)}: {iterations} iterations, "
                f"{len(unrolled_nodes)} nodes"
            )
            model = candidate
            unrolled_any = True
        if not unrolled_any:
            break
        model, folded = fold_constants(model)  # the counters' arithmetic folds away
        details.append(f"folded constants after unrolling ({len(folded.details)} edit(s))")
    details.extend(reasons.values())
    return edit.checked_change(model, "unroll_static_loops", details)
