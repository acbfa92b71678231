"""Rules applied to calibrated activation ranges before quantizing (``tune``).

MinMax calibration records the extremes of a few samples. Three things go wrong with that on
real models; each is fixed here, on the ranges, before onnxruntime picks scales:

- **Ranges wider than anything a reader can tell apart** (``live_ranges``). A tensor read only
  by ops that saturate (Clip, Relu, HardSigmoid, Sigmoid, Tanh, also through x*c, x+c, x+y
  on the way to one) needs no range past the saturation point. tanh-GELU's argument
  x + 0.044715 x**3 spans +-1e6 on magika's inputs while tanh distinguishes about +-6: over
  +-1e6 a 16-bit step is ~30 and every non-saturated value was lost.
- **Unseen extremes** (``margins``). With 16-bit activations resolution is plentiful, so the
  error that dominates is clipping: a held-out input that drives a tensor past the largest
  calibrated value is cut off, and the cut propagates (ppocr_rec with int16 weights: 20 dB
  without, 48 dB with). A range is widened by up to ``MAX_MARGIN`` of its span per side, as
  far as its own quantization SNR (from the tensor's RMS on calibration samples) can pay while
  staying above ``MARGIN_FLOOR_DB``; never past the bounds the producing op guarantees
  (onnxruntime removes Relu/Clip and lets QuantizeLinear clamp, so those must stay exact).
- **A saturating reader's input seen on one side only** (``fill_live``). A detector's score
  map is negative almost everywhere; calibration images with no object in them (no text for
  a DBNet text detector) leave its Sigmoid input calibrated to [-11.8, 0], and every held-out
  object is clipped to probability 0.5 (PP-OCRv4's detector: 5.6 dB). At 16 bits the whole
  live range of such an input costs a few dB of a ~90 dB tensor, so it gets all of it
  (at most ``FILL_MAX_RATIO`` times its calibrated span).
- **Bias overflow** (``bias_floor``). A Conv/Gemm bias is stored as int32 with scale
  input_scale x weight_scale. When the input is constant (a ReLU branch that is always 0, in
  ppocr_rec's first SE block) its range collapses to onnxruntime's minimum (1e-4), the bias
  scale becomes ~1e-12 and every bias value saturates at +-2^31. The dead side is widened:
  the input's range, or a dead weight's range (onnxruntime does that itself, but only for
  symmetric signed weights).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.metrics import SENTINEL  # a value this large is a mark (finfo.max, inf)

INF = float("inf")
_FLOAT_TYPE = 1  # onnx TensorProto.FLOAT
Interval = tuple[float, float]
MAX_MARGIN = 0.5  # widen a range by at most this x its span, on each side
MARGIN_FLOOR_DB = 60.0  # ... and only while its own quantization SNR stays above this
FILL_MAX_RATIO = 16.0  # a 16-bit tensor pays at most 24 dB of its ~90 dB to cover its live range
MIN_REAL_RANGE = 1e-4  # onnxruntime's default for QNN (get_qnn_qdq_config)
BIAS_HEADROOM = 1.05  # keep the largest bias a little inside the int32 range
INT32_SPAN = float(2**32 - 2)  # onnxruntime: int32 max - (int32 min + 1)
QRANGE = {
    "uint8": 255,
    "int8": 255,
    "uint16": 65535,
    "int16": 65535,
    "uint4": 15,
    "int4": 15,
}
# Output bounds ops guarantee (output index -> (low, high)); None = unbounded on that side.
_UNIT = (0.0, 1.0)
_TANH = (-1.0, 1.0)
BOUNDED_OPS: dict[str, dict[int, tuple[float | None, float | None]]] = {
    "Relu": {0: (0.0, None)},
    "Sigmoid": {0: _UNIT},
    "HardSigmoid": {0: _UNIT},
    "Softmax": {0: _UNIT},
    "Tanh": {0: _TANH},
    "HardSwish": {0: (-0.375, None)},
    "Abs": {0: (0.0, None)},
    "Sqrt": {0: (0.0, None)},
    "Exp": {0: (0.0, None)},
    # Default activations (sigmoid gates, tanh cell): hidden outputs lie in [-1, 1].
    "LSTM": {0: _TANH, 1: _TANH},
    "GRU": {0: _TANH, 1: _TANH},
    "RNN": {0: _TANH, 1: _TANH},
}


@dataclass(frozen=True)
class BiasFloor:
    """A range widened so that a Conv/Gemm's int32 bias fits (``tensor`` is the input or weight)."""

    node: str
    tensor: str
    span_from: float
    span_to: float


@dataclass
class RangeChanges:
    """What was changed, for the report."""

    clamped: int = 0
    widened: int = 0
    bias_floor: list[BiasFloor] = field(default_factory=list)
    mask_fills: list[str] = field(default_factory=list)  # tensors cut to their unmasked range
    bias_corrections: int = 0  # layers whose bias absorbed their weight's mean rounding error
    filled: int = 0  # 16-bit inputs of saturating ops given their whole live range
    swish_splits: list[str] = field(default_factory=list)  # pipeline.graph.qdq_htp edits
    signed_products: list[str] = field(default_factory=list)  # likewise
    coarse_sums: list[str] = field(default_factory=list)  # likewise
    raised_weight_scales: list[str] = field(default_factory=list)  # likewise
    requantized_moves: list[str] = field(default_factory=list)  # likewise
    split_weights: list[str] = field(default_factory=list)  # likewise
    dequantized_inputs: list[str] = field(default_factory=list)  # likewise
    scatter_sums: list[str] = field(default_factory=list)  # likewise
    integer_inputs: list[str] = field(default_factory=list)  # ids on an integer grid
    unseen_ranges: list[str] = field(default_factory=list)  # flat ranges from inputs'
    loop_shared: int = 0  # tensors of unrolled loop iterations given one range
    selections: list[str] = field(default_factory=list)  # Where outputs given both inputs' grids
    log_outputs: list[str] = field(default_factory=list)  # Log outputs widened for the HTP
    hard_sigmoids: list[str] = field(default_factory=list)  # outputs on the HTP's fixed grid
    packed_outputs: list[str] = field(default_factory=list)  # kept in float (``packed_outputs``)
    sentinel_constants: list[str] = field(default_factory=list)  # marks saturate (``SENTINEL``)
    # Weight -> (rmin, rmax) for onnxruntime's TensorQuantOverrides (not in the report).
    weight_ranges: dict[str, Interval] = field(default_factory=dict)


def _bounds(model: Any) -> dict[str, tuple[float | None, float | None]]:
    """Tensor -> the output bounds its producer guarantees."""
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    bounds: dict[str, tuple[float | None, float | None]] = {}
    for node in model.graph.node:
        if node.op_type == "Clip":
            limits: list[float | None] = [None, None]
            for slot, index in ((0, 1), (1, 2)):
                if len(node.input) > index and node.input[index] in inits:
                    # a scalar, or one value as [1] (onnxruntime runs that too: an OpenCV-style
                    # colour-space graph's Clip(x, [0.0], [1.0]) crashed this read)
                    value = numpy_helper.to_array(inits[node.input[index]]).reshape(-1)
                    limits[slot] = float(value[0]) if value.size == 1 else None
            for attr in node.attribute:  # opset < 11
                if attr.name == "min":
                    limits[0] = attr.f
                elif attr.name == "max":
                    limits[1] = attr.f
            bounds[node.output[0]] = (limits[0], limits[1])
            continue
        table = BOUNDED_OPS.get(node.op_type)
        if not table:
            continue
        if node.op_type in ("LSTM", "GRU", "RNN") and any(
            a.name == "activations" for a in node.attribute
        ):
            continue
        for index, bound in table.items():
            if index < len(node.output) and node.output[index]:
                bounds[node.output[index]] = bound
    return bounds


AFFINE_OPS = ("Mul", "Div", "Add", "Sub")


def _attr(node: Any, name: str, default: float) -> float:
    return next((a.f for a in node.attribute if a.name == name), default)


def _live_input_range(node: Any, bits: int, consts: dict[str, float]) -> Interval | None:
    """The input values that ``node`` (one input, elementwise) does not map to a constant.

    Beyond this range the op saturates: for Sigmoid/Tanh, to within half an output step at
    ``bits`` bits. None when the op does not saturate (every input value matters).
    """
    levels = 2.0**bits - 1.0
    if node.op_type == "Relu":
        return (0.0, INF)
    if node.op_type == "Clip":
        low = consts.get(node.input[1], -INF) if len(node.input) > 1 and node.input[1] else -INF
        high = consts.get(node.input[2], INF) if len(node.input) > 2 and node.input[2] else INF
        return (_attr(node, "min", low), _attr(node, "max", high))
    if node.op_type == "HardSigmoid":
        alpha, beta = _attr(node, "alpha", 0.2), _attr(node, "beta", 0.5)
        if alpha == 0:
            return None
        ends = sorted(((0.0 - beta) / alpha, (1.0 - beta) / alpha))
        return (ends[0], ends[1])
    if node.op_type == "HardSwish":
        return (-3.0, INF)
    if node.op_type == "Sigmoid":  # 1 - sigmoid(s) ~ exp(-s) <= 1 / (2 levels)
        edge = float(np.log(2.0 * levels))
        return (-edge, edge)
    if node.op_type == "Tanh":  # 1 - tanh(t) ~ 2 exp(-2t) <= 1 / levels
        edge = float(np.log(2.0 * levels) / 2.0)
        return (-edge, edge)
    return None


def _preimage(
    node: Any,
    index: int,
    out: Interval,
    consts: dict[str, float],
    known: dict[str, Interval],
) -> Interval | None:
    """Input ``index`` range that maps into ``out`` through x*c, x/c, x+c, x-c, c-x, or
    through x+y, x-y, y-x when ``known`` bounds the other operand y.

    For x+y: a value of x below ``out.low - y.high`` gives a result below ``out.low`` whatever
    y is (and likewise above), so it saturates the reader exactly as the edge value would.
    """
    other = node.input[1 - index]
    low, high = out
    if other in consts:
        c = consts[other]
        if node.op_type == "Add":
            return (low - c, high - c)
        if node.op_type == "Sub":
            return (low + c, high + c) if index == 0 else (c - high, c - low)
        if node.op_type == "Mul" and c != 0:
            ends = (low / c, high / c)
        elif node.op_type == "Div" and index == 0 and c != 0:
            ends = (low * c, high * c)
        else:
            return None
        return (min(ends), max(ends))
    if other not in known:
        return None
    y_low, y_high = known[other]
    if node.op_type == "Add":
        return (low - y_high, high - y_low)
    if node.op_type == "Sub":
        return (low + y_low, high + y_high) if index == 0 else (y_low - high, y_high - low)
    return None


def live_ranges(
    model: Any,
    bits: dict[str, int],
    default_bits: int,
    known: dict[str, Interval] | None = None,
) -> dict[str, Interval]:
    """Tensor -> the only values that can still change the model's outputs.

    A tensor read only by ops that saturate beyond some range (Clip, Relu, HardSigmoid,
    Sigmoid, Tanh; also through x*c, x+c, ... on the way to one) needs no quantization range
    past that point: a value beyond it gives the same output as the edge value. Example: the
    argument of tanh-GELU, x + 0.044715 x**3, spans +-1e6 on real inputs while tanh only
    distinguishes about +-6; quantized over +-1e6, a 16-bit step is ~30 and every non-saturated
    value is lost. ``known`` (the ranges tensors will be quantized to) lets the rule pass
    through x+y and x-y as well: then the x**3 term itself only needs +-(range of x + 6).
    """
    from onnx import numpy_helper

    known = known or {}
    consts: dict[str, float] = {}
    for init in model.graph.initializer:
        if int(np.prod(init.dims)) == 1:
            consts[init.name] = float(numpy_helper.to_array(init).reshape(-1)[0])
    consumers: dict[str, list[tuple[Any, int]]] = {}
    for node in model.graph.node:
        for index, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node, index))
    outputs = {o.name for o in model.graph.output}
    order = [name for node in reversed(model.graph.node) for name in node.output]
    order += [i.name for i in model.graph.input]
    live: dict[str, Interval | None] = {}
    for name in order:
        if not name or name in live:
            continue
        if name in outputs or name not in consumers:
            live[name] = None
            continue
        union: Interval | None = None
        for consumer, index in consumers[name]:
            need: Interval | None = None
            if consumer.op_type in AFFINE_OPS and len(consumer.input) == 2:
                out_range = live.get(consumer.output[0])
                if out_range is not None and consumer.input[0] != consumer.input[1]:
                    need = _preimage(consumer, index, out_range, consts, known)
            elif index == 0:
                out_bits = bits.get(consumer.output[0], default_bits)
                need = _live_input_range(consumer, out_bits, consts)
            if need is None:
                union = None
                break
            union = need if union is None else (min(union[0], need[0]), max(union[1], need[1]))
        live[name] = union
    return {
        name: interval
        for name, interval in live.items()
        if interval is not None and (interval[0] > -INF or interval[1] < INF)
    }


def clamp_to_live(
    ranges: dict[str, Interval], live: dict[str, Interval]
) -> tuple[dict[str, Interval], int]:
    """Ranges cut to their live part; returns them and how many changed."""
    result = dict(ranges)
    changed = 0
    for name, (low, high) in ranges.items():
        if name not in live:
            continue
        floor, ceiling = live[name]
        new_low, new_high = max(low, floor), min(high, ceiling)
        if new_low > new_high:  # every value saturates to one side
            new_low = new_high = floor if high < floor else ceiling
        if (new_low, new_high) != (low, high):
            result[name] = (new_low, new_high)
            changed += 1
    return result, changed


def fill_live(
    ranges: dict[str, Interval], live: dict[str, Interval], bits: dict[str, int]
) -> tuple[dict[str, Interval], int]:
    """16-bit tensors whose live range is finite on both sides, widened to all of it (when it
    is at most ``FILL_MAX_RATIO`` times their calibrated span); returns them and how many."""
    result = dict(ranges)
    changed = 0
    for name, (low, high) in ranges.items():
        if bits.get(name, 8) < 16 or name not in live:
            continue
        floor, ceiling = live[name]
        if not (np.isfinite(floor) and np.isfinite(ceiling)):
            continue
        if high > low and ceiling - floor > FILL_MAX_RATIO * (high - low):
            continue  # (a collapsed range saw only saturated values: it gets the live range)
        filled = (min(low, floor), max(high, ceiling))
        if filled != (low, high):
            result[name] = filled
            changed += 1
    return result, changed


def widen_selections(
    model: Any, ranges: dict[str, Interval]
) -> tuple[dict[str, Interval], list[str]]:
    """A Where's output range, widened to cover what its data inputs' producers bound them to.

    Calibration only sees the branch its condition picked on the calibration samples: a lowered
    data-dependent If (a wake-word head's "verify when the score passes 0.5") never passes on
    speech without the word, and its output range was the first score's calibrated values,
    up to 4.8e-4, where held-out scores reached 5e-3 (0.9 dB). Only bounded inputs widen it
    (Sigmoid [0, 1], on QNN's fixed 1/65536 grid at 16 bits; Tanh; Clip with constant
    bounds...): an unbounded branch that is never picked (a guarded 1 / x) would otherwise
    spread the output's range over values it never takes."""
    bounds = _bounds(model)

    def grid(name: str) -> Interval | None:
        low, high = bounds.get(name, (None, None))
        return None if low is None or high is None else (float(low), float(high))

    result = dict(ranges)
    widened = []
    for node in model.graph.node:  # in graph order: a Where of Wheres sees its inputs' unions
        if node.op_type != "Where" or node.output[0] not in result:
            continue
        sides = [side for side in (grid(n) for n in node.input[1:3]) if side is not None]
        if not sides:
            continue
        low, high = result[node.output[0]]
        union = (min(low, *(s[0] for s in sides)), max(high, *(s[1] for s in sides)))
        if union != (low, high):
            result[node.output[0]] = union
            widened.append(node.output[0])
    return result, widened


# The QNN HTP's 16-bit Log computes nothing at an output scale of 2^-14 or below: every output
# is the range's minimum (measured on the simulator: 5.95e-05 and exactly 2^-14 wrong,
# 6.1036e-05 right, on three input ranges, widening either side). Log outputs get at least
# this scale, 2% above it.
HTP_LOG_MIN_SCALE = 2.0**-14 * 1.02


def _calibrated_16_bit_outputs(
    model: Any, op_type: str, ranges: dict[str, Interval], bits: dict[str, int]
) -> list[str]:
    """The outputs of ``op_type`` nodes (standard domain) that have a range and 16 bits."""
    return [
        node.output[0]
        for node in model.graph.node
        if node.op_type == op_type
        and node.domain in ("", "ai.onnx")
        and node.output[0] in ranges
        and bits.get(node.output[0], 8) >= 16
    ]


def widen_log_outputs(
    model: Any, ranges: dict[str, Interval], bits: dict[str, int]
) -> tuple[dict[str, Interval], list[str]]:
    """16-bit Log outputs whose span gives a scale under ``HTP_LOG_MIN_SCALE``, widened to it
    downward (where a log goes when its input nears 0); returns them and their names.

    Why: log(x + 1) of small positive features spans [0, 2.3]; quantized at that scale the
    HTP returned 0 for every element (ctx vs QDQ 0 dB), just above 2^-14 it agrees at 51-55 dB.
    """
    result = dict(ranges)
    changed = []
    span = HTP_LOG_MIN_SCALE * QRANGE["uint16"]
    for name in _calibrated_16_bit_outputs(model, "Log", result, bits):
        low, high = result[name]
        if high - low < span:
            result[name] = (high - span, high)
            changed.append(name)
    return result, changed


# The QNN HTP's 16-bit HardSigmoid writes its output on a fixed grid, [0, 1) in steps of 2^-16
# (as QNN fixes a 16-bit Sigmoid's), whatever scale and zero point the model gives it.
HTP_HARD_SIGMOID_RANGE: Interval = (0.0, 65535.0 / 65536.0)


def fixed_hard_sigmoid_outputs(
    model: Any, ranges: dict[str, Interval], bits: dict[str, int]
) -> tuple[dict[str, Interval], list[str]]:
    """16-bit HardSigmoid outputs get the HTP's own grid, [0, 1) in steps of 2^-16; returns the
    ranges and the tensors changed.

    Why: on any other output range the HTP's HardSigmoid is off by a share of it (measured on
    the simulator, ctx vs CPU QDQ: [0, 0.946], a PP-LCNet squeeze-excitation gate that never
    saturated high, 25.9 dB alone; [0, 0.5] 8.1 dB, [0, 1.2] 14.0 dB; [0, 65535/65536] exact;
    a Conv -> c * HardSigmoid(c) block with the gate at [0, 0.86]: 17.4 -> 52.6 dB). A range
    the margins already take to [0, 1] is within a step of it. 8-bit HardSigmoid honours its
    scale (exact on each).
    """
    result = dict(ranges)
    changed = []
    for name in _calibrated_16_bit_outputs(model, "HardSigmoid", result, bits):
        if result[name] != HTP_HARD_SIGMOID_RANGE:
            result[name] = HTP_HARD_SIGMOID_RANGE
            changed.append(name)
    return result, changed


# ONNX integer tensor types a Cast may convert to (its "to" attribute).
_INTEGER_TYPES = frozenset({2, 3, 4, 5, 6, 7, 12, 13})  # UINT8 .. INT64, UINT32, UINT64
_BOOL = 9
_FLOAT_TYPES = frozenset({1, 10, 11, 16})  # FLOAT, FLOAT16, DOUBLE, BFLOAT16
# Ops whose output is an exact integer when every data input is one (small magnitudes).
_EXACT_INTEGER_OPS = frozenset(
    {"Add", "Sub", "Mul", "Neg", "Abs", "Max", "Min", "Relu", "Floor", "Ceil", "Round", "Sign"}
)
# Ops that move or select values without changing them: their first input carries it.
_CARRIERS = frozenset(
    {
        "Unsqueeze",
        "Squeeze",
        "Reshape",
        "Expand",
        "Transpose",
        "Flatten",
        "Identity",
        "Slice",
        "Tile",
        "Gather",
        "MaxPool",  # picks values (CANINE pools its character mask down to its molecules)
        "ReduceMax",
        "ReduceMin",
    }
)


INTEGRAL_SIZE = 4096  # a constant read for integer values: a sequence's length, not a weight


def _integral_constants(model: Any) -> set[str]:
    """Small float initializers whose every value is an integer (a 1 in ``1 - mask``; the
    row of ones Hugging Face multiplies a mask by to make it 3D: up to ``INTEGRAL_SIZE``)."""
    from onnx import numpy_helper

    names = set()
    for init in model.graph.initializer:
        if init.data_type in _FLOAT_TYPES and int(np.prod(init.dims)) <= INTEGRAL_SIZE:
            value = numpy_helper.to_array(init)
            if np.array_equal(value, np.round(value)):
                names.add(init.name)
    return names


def integer_valued(model: Any) -> set[str]:
    """Float tensors whose every value is an integer by construction: a Cast from an integer or
    bool tensor, and what exact integer arithmetic (Add, Sub, Mul, ...), Where and shape ops
    make of those and of integral constants. A 0/1 attention mask turned to float and flipped,
    ``1 - mask``, is one."""

    types: dict[str, int] = {}
    for info in (*model.graph.input, *model.graph.value_info, *model.graph.output):
        types[info.name] = info.type.tensor_type.elem_type
    for init in model.graph.initializer:
        types[init.name] = init.data_type  # integer types count below
    integral = _integral_constants(model)  # integer/bool typed, or float holding integers
    integral |= {n for n, t in types.items() if t in _INTEGER_TYPES or t == _BOOL}
    valued: set[str] = set()
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx") or not node.output:
            continue
        data = [i for i in node.input if i]
        if node.op_type == "Cast":
            exact = bool(data) and data[0] in integral
        elif node.op_type in _EXACT_INTEGER_OPS:
            exact = bool(data) and all(i in integral for i in data)
        elif node.op_type == "Where":
            exact = len(data) == 3 and all(i in integral for i in data[1:])
        elif node.op_type == "Concat":
            exact = bool(data) and all(i in integral for i in data)
        elif node.op_type in _CARRIERS:
            exact = bool(data) and data[0] in integral
        else:
            exact = False
        if node.op_type == "Cast":  # types shape inference did not store: what the op gives
            to = next((a.i for a in node.attribute if a.name == "to"), None)
            types.setdefault(node.output[0], to or 0)
        elif data:  # a Where's values are its second and third inputs
            carried = data[1] if node.op_type == "Where" and len(data) == 3 else data[0]
            types.setdefault(node.output[0], types.get(carried, 0))
        if exact:
            integral.update(node.output)
            valued.update(o for o in node.output if types.get(o) in _FLOAT_TYPES)
    return valued


def integer_inputs(
    model: Any, ranges: dict[str, Interval], levels: dict[str, int]
) -> tuple[dict[str, Interval], list[str]]:
    """Float tensors that a Cast turns into integers or booleans, when they are graph inputs
    (ids, indices) or integers by construction (``integer_valued``), get an integer grid: the
    range [0, levels] (or centred on 0), scale 1, so every integer in it is exact; likewise an
    integer-valued operand of a comparison with an integer (``_read_as_integers``).

    Why: Keras feeds an Embedding float ids and tf2onnx casts them to int32 for the lookup;
    with ``mask_zero`` the ids are also compared with 0, and the quantizer quantizes the input
    for that reader, the Cast reading the same dequantized value. On the calibrated range's
    grid (0..63 over 65535 steps) an id comes back a hair under itself and the Cast truncates
    it to the id below: Nakdimon's embedding lookups were 4.5 dB from float, the whole model
    6.6 dB, every character reading its neighbour's row. A Cast to bool reads nonzero: the
    HTP computes Hugging Face's inverted attention mask ``1 - mask`` one step (2.3e-5) above 0
    on a fine grid, every position reads masked, and a MiniLM sentence encoder came out at
    -2.4 dB (CPU 28.3 dB); on the integer grid 1 - 1 is 0. Not any computed value: one cast to
    an integer may be meant to truncate.
    """
    result = dict(ranges)
    changed = []
    for name in _read_as_integers(model):
        if name not in result:
            continue
        steps = levels.get(name, 255)
        low, high = result[name]
        if low >= 0 and high <= steps:
            grid = (0.0, float(steps))
        elif low >= -(steps + 1) // 2 and high <= (steps - 1) // 2:
            grid = (float(-(steps + 1) // 2), float((steps - 1) // 2))
        else:
            continue
        if result[name] != grid:
            result[name] = grid
            changed.append(name)
    return result, changed


# Ops whose output onnxruntime's QDQ quantizer puts on its input's grid (QDQDirect8BitOp).
_SHARED_GRID_MOVES = frozenset(
    {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Slice", "AveragePool", "TopK"}
)
# Comparisons whose result flips when an integer operand comes out one step off its value.
_COMPARISONS = frozenset({"Greater", "Less", "GreaterOrEqual", "LessOrEqual", "Equal"})


def _read_as_integers(model: Any) -> list[str]:
    """The float tensors ``integer_inputs`` puts on an integer grid, in node order: the input of
    a Cast to an integer or bool that is a graph input or ``integer_valued``, and an
    ``integer_valued`` operand of a comparison whose other operand is integral too (XLNet's
    ``(1 - mask) > 0``: one step above 0 on the HTP, every key read as masked, 4.4 dB), or of
    a Mul by a mask sentinel (``(1 - mask) * -1e9``: that step times 1e9 masks every key,
    CANINE at 31 dB where its CPU QDQ model is at 58)."""
    inputs = {i.name for i in model.graph.input} - {i.name for i in model.graph.initializer}
    exact = integer_valued(model)
    integral = exact | _integral_constants(model)
    inits = {i.name: i for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}

    def with_sources(name: str) -> list[str]:
        """``name`` and the tensors it moves from: onnxruntime's quantizer gives a Reshape's,
        Unsqueeze's... output its input's grid, so the integer grid must start there."""
        chain = [name]
        node = producer.get(name)
        while node is not None and node.op_type in _SHARED_GRID_MOVES and node.input[0] in exact:
            chain.append(node.input[0])
            node = producer.get(node.input[0])
        return chain[::-1]

    names: list[str] = []
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx") or not node.input:
            continue
        if node.op_type == "Cast":
            to = next((a.i for a in node.attribute if a.name == "to"), None)
            if to in _INTEGER_TYPES | {_BOOL} and (node.input[0] in inputs | exact):
                names.extend(with_sources(node.input[0]))
        elif node.op_type in _COMPARISONS and all(i in integral for i in node.input):
            names.extend(n for i in node.input if i in exact for n in with_sources(i))
        elif node.op_type == "Mul" and len(node.input) == 2:
            for value, factor in (node.input, node.input[::-1]):
                if value in exact and _is_sentinel(inits.get(factor)):
                    names.extend(with_sources(value))
    return list(dict.fromkeys(names))


def _is_sentinel(init: Any) -> bool:
    """A float constant every value of which is a mask sentinel (-1e4, -1e9, finfo.min)."""
    from onnx import numpy_helper

    if init is None or init.data_type not in _FLOAT_TYPES or int(np.prod(init.dims)) > 16:
        return False
    value = numpy_helper.to_array(init)
    return bool(value.size) and bool(np.all(value <= MASK_SENTINEL))


def unrolled_loop_ranges(ranges: dict[str, Interval]) -> tuple[dict[str, Interval], int]:
    """The copies of one Loop body tensor, one per unrolled iteration, share one range: the
    union of theirs, as the Loop's one body tensor had.

    Why: unrolled, each time step's tensors are calibrated on what that position saw only.
    Nakdimon's backward LSTM saw padding at position 41 in every calibration text (all shorter),
    so that step's input projection was calibrated on the padding's constant vector; a longer
    held-out text at 3 dB there (its other samples at 48-53 dB).
    """
    from ..graph.recurrent import ITERATION_SUFFIX

    groups: dict[str, list[str]] = {}
    for name in ranges:
        if ITERATION_SUFFIX.search(name):
            groups.setdefault(ITERATION_SUFFIX.sub("", name), []).append(name)
    result = dict(ranges)
    shared = 0
    for names in groups.values():
        if len(names) < 2:
            continue
        low = min(ranges[n][0] for n in names)
        high = max(ranges[n][1] for n in names)
        for name in names:
            result[name] = (low, high)
        shared += len(names)
    return result, shared


def unseen_ranges(model: Any, ranges: dict[str, Interval]) -> tuple[dict[str, Interval], list[str]]:
    """Tensors calibration saw at a single value get the range their producer can reach: a
    Cast of a boolean [0, 1]; a Mul, Add or Sub the interval product, sum or difference of its
    inputs' ranges (in graph order, so a chain of them follows).

    Why: a mask the calibration data never flipped at some position leaves every tensor it
    gates there at one value (0): quantized on a range of span 0, a held-out sample that does
    flip it comes out as that value. Nakdimon unrolled over 64 characters: calibration texts all
    longer than 27, the Cast(Not(mask)) and the products it gates at positions 27 onward were
    0 in calibration, and a shorter held-out text lost its state there (0 dB on those tensors).
    """
    from onnx import numpy_helper

    from ..graph.edit import inferred_values

    result = dict(ranges)
    consts: dict[str, Interval] = {}
    for init in model.graph.initializer:
        if init.data_type in (1, 10, 11) and int(np.prod(init.dims)) <= 4096:
            value = numpy_helper.to_array(init)
            if value.size:
                consts[init.name] = (float(value.min()), float(value.max()))
    values: dict[str, Any] | None = None
    changed = []

    def known(name: str) -> Interval | None:
        return result.get(name) or consts.get(name)

    for node in model.graph.node:
        out = node.output[0] if node.output else ""
        if out not in result or result[out][0] != result[out][1]:
            continue
        reach: Interval | None = None
        if node.op_type == "Cast":
            values = values if values is not None else inferred_values(model)
            source = values.get(node.input[0])
            if source is not None and source.type.tensor_type.elem_type == 9:  # BOOL
                reach = (0.0, 1.0)
        elif node.op_type in ("Mul", "Add", "Sub") and len(node.input) == 2:
            a, b = known(node.input[0]), known(node.input[1])
            if a is not None and b is not None:
                if node.op_type == "Mul":
                    corners = [x * y for x in a for y in b]
                elif node.op_type == "Add":
                    corners = [a[0] + b[0], a[1] + b[1]]
                else:
                    corners = [a[0] - b[1], a[1] - b[0]]
                reach = (min(corners), max(corners))
        if reach is None or reach[0] == reach[1]:
            continue
        seen = result[out][0]
        result[out] = (min(reach[0], seen, 0.0), max(reach[1], seen, 0.0))
        changed.append(out)
    return result, changed


def margins(
    ranges: dict[str, Interval], rms: dict[str, float], levels: dict[str, int]
) -> dict[str, float]:
    """Tensor -> how much to widen its range per side, as a fraction of its span.

    Widening by a factor k costs 20*log10(k) dB of the tensor's own quantization SNR, so a
    tensor only gets the margin its SNR can pay for while staying above ``MARGIN_FLOOR_DB``:
    a well-spread 16-bit tensor (~90 dB) gets the full ``MAX_MARGIN``; an outlier-dominated one
    (the x**3 inside GELU, ~45 dB) or any 8-bit tensor (~45 dB) gets none, resolution being
    what limits those.
    """
    result = {}
    for name, (low, high) in ranges.items():
        span = high - low
        if name not in rms or span <= 0.0 or rms[name] <= 0.0:
            continue
        step = span / levels[name]
        snr = 20.0 * np.log10(rms[name] / step) + 10.0 * np.log10(12.0)
        factor = min(10.0 ** ((snr - MARGIN_FLOOR_DB) / 20.0), 1.0 + 2.0 * MAX_MARGIN)
        if factor > 1.0:
            result[name] = (factor - 1.0) / 2.0
    return result


def widen(
    ranges: dict[str, Interval],
    bounds: dict[str, tuple[float | None, float | None]],
    margin: dict[str, float],
) -> dict[str, Interval]:
    """Ranges grown by their margin x span per side, within bounds and sign."""
    result = dict(ranges)
    for name, fraction in margin.items():
        low, high = ranges[name]
        span = high - low
        new_low, new_high = low - fraction * span, high + fraction * span
        if low >= 0.0:
            new_low = low
        if high <= 0.0:
            new_high = high
        floor, ceiling = bounds.get(name, (None, None))
        if floor is not None:
            new_low = max(new_low, min(floor, low))
        if ceiling is not None:
            new_high = min(new_high, max(ceiling, high))
        result[name] = (new_low, new_high)
    return result


@dataclass(frozen=True)
class Statistics:
    """Per-tensor statistics of the float model: RMS and means on the first calibration samples,
    min/max on all of them."""

    rms: dict[str, float]  # root mean square (range margins)
    means: dict[str, np.ndarray]  # mean over the requested axes (bias correction)
    samples: int  # samples the RMS and means are over
    ranges: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    range_samples: int = 0


_FLOAT16_TYPE = 10  # onnx TensorProto.FLOAT16


def activation_statistics(
    model: Any,
    samples: Any,
    rms_names: list[str],
    mean_axes: dict[str, list[int]] | None = None,
    max_samples: int = 8,
    range_names: Iterable[str] = (),
    on_sample: Callable[[], None] | None = None,
    in_place: bool = False,
    without_sentinels: bool = False,
) -> Statistics:
    """RMS of each float tensor in ``rms_names`` and the mean of each tensor in ``mean_axes``
    over those axes, on the first ``max_samples`` samples; with ``range_names``, also the min and
    max of each of those tensors over every sample (a MinMax calibration); in one pass.

    The reductions run in the graph (ReduceSumSquare and Size, ReduceMean, ReduceMin/Max) and
    only their results leave it, so memory stays what one inference needs: fetching every
    activation of a 1024x2048 segmenter would hold gigabytes at once. ``in_place`` adds the
    reductions to ``model`` itself, for a caller that has no further use for it (a large
    model's weights are then not copied). ``without_sentinels`` leaves every value of
    ``SENTINEL`` or more in magnitude out of the RMS and the ranges (``sentinel_tensors``).
    """
    import onnx
    from onnx import helper, numpy_helper

    from ..core.cpu import cpu_session
    from ..core.memory import release_freed_memory

    if in_place:
        probe = model
    else:
        probe = onnx.ModelProto()
        probe.CopyFrom(model)
    graph = probe.graph
    types = {
        v.name: v.type.tensor_type.elem_type
        for v in [*graph.value_info, *graph.input, *graph.output]
        if v.type.HasField("tensor_type")
    }
    produced = {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
    wanted = [n for n in dict.fromkeys(rms_names) if n in produced and types.get(n) == _FLOAT_TYPE]
    averaged = {
        n: axes
        for n, axes in (mean_axes or {}).items()
        if n in produced and types.get(n) == _FLOAT_TYPE
    }
    ranged = [
        n
        for n in dict.fromkeys(range_names)
        if n in produced and types.get(n) in (_FLOAT_TYPE, _FLOAT16_TYPE)
    ]
    # A recurrent reader carries each window's state from the float model's outputs: keep them,
    # so the reader need not run the model a second time (``feed_back``).
    feed_back = getattr(samples, "feed_back", None) if getattr(samples, "recurrent", None) else None
    kept = [o.name for o in graph.output] if feed_back is not None else []
    if feed_back is None:
        del graph.output[:]
    # Each tensor's reductions run right after its producer (see place_after_producers).
    reductions: list[Any] = []
    read = {name: name for name in [*wanted, *ranged]}
    if without_sentinels:  # each value past SENTINEL read as 0, which every range holds
        for index, name in enumerate(read):
            dtype = np.float16 if types[name] == _FLOAT16_TYPE else np.float32
            limit, zero = f"__sentinel_{index}", f"__zero_{index}"
            graph.initializer.extend(
                [
                    numpy_helper.from_array(
                        np.array(min(SENTINEL, np.finfo(dtype).max), dtype), limit
                    ),
                    numpy_helper.from_array(np.array(0, dtype), zero),
                ]
            )
            size, keep = f"__abs_{index}", f"__keep_{index}"
            read[name] = f"__finite_{index}"
            reductions += [
                helper.make_node("Abs", [name], [size]),
                helper.make_node("Less", [size, limit], [keep]),
                helper.make_node("Where", [keep, name, zero], [read[name]]),
            ]
    for index, name in enumerate(wanted):
        squares, size = f"__rms_ss_{index}", f"__rms_n_{index}"
        reductions += [
            helper.make_node("ReduceSumSquare", [read[name]], [squares], keepdims=0),
            helper.make_node("Size", [name], [size]),
        ]
        graph.output.extend(
            [
                helper.make_tensor_value_info(squares, _FLOAT_TYPE, []),
                helper.make_tensor_value_info(size, onnx.TensorProto.INT64, []),
            ]
        )
    for index, (name, axes) in enumerate(averaged.items()):
        axes_name, mean = f"__mean_axes_{index}", f"__mean_{index}"
        graph.initializer.append(numpy_helper.from_array(np.array(axes, np.int64), axes_name))
        reductions.append(helper.make_node("ReduceMean", [name, axes_name], [mean], keepdims=0))
        graph.output.append(helper.make_tensor_value_info(mean, _FLOAT_TYPE, None))
    for index, name in enumerate(ranged):
        for op in ("ReduceMin", "ReduceMax"):
            out = f"__{op.lower()}_{index}"
            reductions.append(helper.make_node(op, [read[name]], [out], keepdims=0))
            graph.output.append(helper.make_tensor_value_info(out, types[name], []))
    place_after_producers(graph, reductions)
    if not wanted and not averaged and not ranged:
        return Statistics({}, {}, 0)
    # Ranges as onnxruntime's calibrator measures them: on the graph as written (its fusions
    # change activations in the last bits, and a calibration cache should not depend on them).
    session = cpu_session(probe, optimize=not ranged, in_node_order=True)
    del probe, graph
    release_freed_memory()  # the serialized model the session was made from
    outputs = [o.name for o in session.get_outputs()]
    total = dict.fromkeys(wanted, 0.0)
    count = dict.fromkeys(wanted, 0)
    sums: dict[str, np.ndarray] = {}
    low: dict[str, np.ndarray] = {}
    high: dict[str, np.ndarray] = {}
    used = seen = 0
    first_range = 2 * len(wanted) + len(averaged)
    for index, feeds in enumerate(samples):
        if index >= max_samples and not ranged:
            break
        values = session.run(outputs, feeds)
        if feed_back is not None:
            feed_back(dict(zip(kept, values, strict=False)))
            values = values[len(kept) :]
        if index < max_samples:
            for position, name in enumerate(wanted):
                total[name] += float(values[2 * position])
                count[name] += int(values[2 * position + 1])
            for position, name in enumerate(averaged):
                value = values[2 * len(wanted) + position].astype(np.float64)
                sums[name] = sums.get(name, 0.0) + value
            used += 1
        for position, name in enumerate(ranged):
            small, large = values[first_range + 2 * position : first_range + 2 * position + 2]
            # fmin/fmax skip a NaN as onnxruntime's calibrator (np.nanmin) does
            low[name] = small if name not in low else np.fmin(low[name], small)
            high[name] = large if name not in high else np.fmax(high[name], large)
        seen += 1
        if on_sample is not None:
            on_sample()
    return Statistics(
        {n: float(np.sqrt(total[n] / count[n])) for n in wanted if count[n]},
        {n: v / used for n, v in sums.items()} if used else {},
        used,
        {n: (np.reshape(low[n], (1,)), np.reshape(high[n], (1,))) for n in low},
        seen if ranged else 0,
    )


def sentinel_tensors(ranges: dict[str, tuple[Any, Any]], model: Any = None) -> list[str]:
    """The tensors whose calibrated range reaches ``SENTINEL``: they hold a mark such as
    finfo.max or inf (RT-DETR's invalid anchors: box logits + finfo.max), and MinMax over it
    gives a scale of 5e33 at 16 bits: every real value rounds to 0, and QNN refused to compose
    the graph. Calibrated again ``without_sentinels``, the marks saturate at the range's end.
    A negative mark on its way to a Softmax (``_masks_scores``, given ``model``) is left to
    ``mask_fill_ranges``, which finds masks by it."""
    masking = _masks_scores(model) if model is not None else set()
    found = []
    for name, (low, high) in ranges.items():
        low_mark = not np.all(np.abs(np.asarray(low, np.float64)) < SENTINEL)
        high_mark = not np.all(np.abs(np.asarray(high, np.float64)) < SENTINEL)
        if (low_mark and name not in masking) or high_mark:
            found.append(name)
    return found


# What a mask passes through on its way to the scores' Softmax (``_masks_scores``).
_MASK_PATH = frozenset({"Add", "Sub", "Where", "Mul", "Expand", "Cast", "Slice", "Concat"})


def _masks_scores(model: Any) -> set[str]:
    """Tensors from which a Softmax is reached through ``_MASK_PATH`` and shape ops only:
    walked back from each Softmax's input through the producers of those kinds."""
    from ..graph.attention import SHAPE_OPS
    from ..graph.edit import ancestors

    passes = _MASK_PATH | SHAPE_OPS
    producers = {o: n for n in model.graph.node for o in n.output if o}
    softmax_inputs = [n.input[0] for n in model.graph.node if n.op_type == "Softmax" and n.input]
    return ancestors(
        softmax_inputs, producers, lambda node: node.input if node.op_type in passes else []
    )


# Ops whose output holds their inputs' values: a mark among a constant's values is one there.
_SENTINEL_MOVES = frozenset({"Where", "Concat", "Max", "Min"})


def sentinel_constant_ranges(
    model: Any, ranges: dict[str, Interval]
) -> tuple[dict[str, Interval], list[str]]:
    """Weight ranges for float constants that hold marks (values of ``SENTINEL`` or more in
    magnitude) beside real values, read by Add or by ops that pass values on (Where, Concat,
    Max, Min), and the constants given one. A constant's own MinMax range would reach the mark
    (an infinite or 5e33 scale); its real values' range instead, stretched past them on a
    mark's side by the span of what the reader writes (``ranges``, calibrated without the
    marks), so a mark still drives that output to its range's end: RT-DETR's box logits plus
    finfo.max at an invalid anchor saturate, as in float, instead of reading a real anchor."""
    from onnx import numpy_helper

    readers: dict[str, list[Any]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    result: dict[str, Interval] = {}
    for init in model.graph.initializer:
        if init.data_type not in _FLOAT_TYPES or int(np.prod(init.dims)) > 1 << 24:
            continue
        value = numpy_helper.to_array(init).astype(np.float64)
        marked = np.abs(value) >= SENTINEL
        if not marked.any():
            continue
        nodes = readers.get(init.name, [])
        if not nodes or any(n.op_type not in _SENTINEL_MOVES | {"Add"} for n in nodes):
            continue
        real = value[~marked]
        low = float(real.min()) if real.size else 0.0
        high = float(real.max()) if real.size else 0.0
        for node in nodes:
            out = ranges.get(node.output[0])
            if out is None:
                continue
            span = out[1] - out[0] if node.op_type == "Add" else 0.0
            if (value[marked] > 0).any():
                high = max(high + span, out[1]) if node.op_type != "Add" else high + span
            if (value[marked] < 0).any():
                low = min(low - span, out[0]) if node.op_type != "Add" else low - span
        result[init.name] = (min(low, 0.0), max(high, 0.0))
    return result, sorted(result)


def channel_peaks(
    model: Any, ranks: Mapping[str, int], samples: Iterable[dict[str, np.ndarray]], count: int
) -> dict[str, np.ndarray]:
    """Each named activation's peak magnitude per channel (axis 1) over the first ``count``
    samples, reduced in the graph (a copy of ``model``; ``ranks``: each tensor's rank).
    Empty when no sample comes."""
    import onnx
    from onnx import helper, numpy_helper

    from ..core.cpu import cpu_session
    from ..graph.edit import copy_model

    model = copy_model(model)
    graph = model.graph
    names = list(ranks)
    axes_attr = any(o.domain in ("", "ai.onnx") and o.version < 18 for o in model.opset_import)
    outputs, reductions = [], []
    for index, name in enumerate(names):
        axes = [0, *range(2, ranks[name])]
        axes_name = f"__peak_axes_{index}"
        if not axes_attr:
            graph.initializer.append(numpy_helper.from_array(np.array(axes, np.int64), axes_name))
        for op in ("ReduceMax", "ReduceMin"):
            extreme = f"__peak_{op[6:].lower()}_{index}"
            reductions.append(
                helper.make_node(op, [name], [extreme], axes=axes, keepdims=0)
                if axes_attr
                else helper.make_node(op, [name, axes_name], [extreme], keepdims=0)
            )
            outputs.append(extreme)
            graph.output.append(
                helper.make_tensor_value_info(extreme, onnx.TensorProto.FLOAT, None)
            )
    # Appended at the end, the reductions kept every watched activation of a sample alive at
    # once: 2.3 GB for a 1x3x1024x2048 LR-ASPP whose calibration pass peaks at 0.4 GB.
    place_after_producers(graph, reductions)
    session = cpu_session(model, optimize=False, in_node_order=True)
    peaks: list[np.ndarray] = []
    for _, sample in zip(range(count), samples, strict=False):
        got = session.run(outputs, sample)
        highs, lows = got[::2], got[1::2]
        magnitudes = [np.maximum(h, -low) for h, low in zip(highs, lows, strict=True)]
        peaks = magnitudes if not peaks else list(map(np.maximum, peaks, magnitudes))
    return dict(zip(names, peaks, strict=False))


def place_after_producers(graph: Any, reductions: list[Any]) -> None:
    """Insert each reduction right after the node that produces its tensor.

    onnxruntime keeps a tensor alive until its last reader has run. Appended at the end of
    the graph, the reductions made every activation of a sample live at once (3.9 GB on a
    1024x1024 U-Net whose plain inference peaks at 1.3 GB); next to their producers, and run
    in node order (``cpu_session(in_node_order=True)``), each tensor is freed as in plain
    inference.
    """
    after: dict[str, list[Any]] = {}
    for node in reductions:
        after.setdefault(node.input[0], []).append(node)
    ordered: list[Any] = []

    def emit(node: Any) -> None:  # and the reductions' own chains (Abs -> Less -> Where) after it
        ordered.append(node)
        for output in node.output:
            for follower in after.pop(output, []):
                emit(follower)

    for name in [i.name for i in graph.input]:
        for node in after.pop(name, []):
            emit(node)
    for node in graph.node:
        emit(node)
    ordered.extend(n for nodes in after.values() for n in nodes)  # initializers, if any
    del graph.node[:]
    graph.node.extend(ordered)


def activation_rms(
    model: Any, samples: Any, names: list[str], max_samples: int = 8
) -> dict[str, float]:
    """Root mean square of each named float tensor over the first samples (float model)."""
    return activation_statistics(model, samples, names, None, max_samples).rms


def _weight_scales(weight: np.ndarray, qtype: str, per_channel: bool, axis: int) -> np.ndarray:
    """The scale(s) onnxruntime will give this weight (to within a few percent)."""
    symmetric = per_channel or qtype.startswith("int")
    w = weight.astype(np.float64)
    if per_channel and w.ndim > 1:
        w = np.moveaxis(w, axis, 0).reshape(w.shape[axis], -1)
    else:
        w = w.reshape(1, -1)
    low = np.minimum(w.min(axis=1), 0.0)
    high = np.maximum(w.max(axis=1), 0.0)
    high = np.maximum(high, low + MIN_REAL_RANGE)
    if symmetric:
        absmax = np.maximum(np.abs(low), np.abs(high))
        return 2.0 * absmax / (QRANGE[qtype] - 1)
    return (high - low) / QRANGE[qtype]


def bias_floor(
    model: Any,
    ranges: dict[str, Interval],
    activation_types: dict[str, str],
    weight_types: dict[str, str],
    per_channel: bool,
) -> tuple[dict[str, tuple[float, dict[str, Any]]], dict[str, tuple[Interval, dict[str, Any]]]]:
    """What keeps every Conv/Gemm int32 bias unsaturated: (activation floors, weight ranges).

    The bias scale is input_scale x weight_scale; it must reach 2*|b| / 2^32 for every output
    channel. The factor that is missing goes to the side that loses nothing by it: a dead
    input (its calibrated range collapsed to onnxruntime's minimum) gets a wider range
    (``{activation: (span, info)}``); live input but dead weights (all ~0) get a wider weight
    range (``{weight: ((rmin, rmax), info)}``, an onnxruntime range override); when both are
    live, the input, whose 16 bits have room to spare. Weights of signed types are skipped:
    onnxruntime raises the scale of symmetric signed weights itself.
    """
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    floors: dict[str, tuple[float, dict[str, Any]]] = {}
    weights: dict[str, tuple[Interval, dict[str, Any]]] = {}
    for node in model.graph.node:
        if node.op_type not in ("Conv", "Gemm", "ConvTranspose") or len(node.input) < 3:
            continue
        x, w_name, b_name = node.input[0], node.input[1], node.input[2]
        if x not in ranges or w_name not in inits or b_name not in inits:
            continue
        wtype = weight_types.get(w_name, "")
        atype = activation_types.get(x, "")
        if wtype not in QRANGE or wtype.startswith("int") or atype not in QRANGE:
            continue
        weight = numpy_helper.to_array(inits[w_name]).astype(np.float64)
        bias = np.abs(numpy_helper.to_array(inits[b_name]).astype(np.float64)).ravel()
        channelwise = per_channel and node.op_type != "Gemm"
        axis = 1 if node.op_type == "ConvTranspose" else 0
        w_scales = _weight_scales(weight, wtype, channelwise, axis)
        if w_scales.size not in (1, bias.size):
            continue
        wanted = BIAS_HEADROOM * 2.0 * bias / INT32_SPAN  # smallest bias scale per channel
        low, high = ranges[x]
        have = max(high - low, MIN_REAL_RANGE)
        x_scale = have / QRANGE[atype]
        if np.all(x_scale * w_scales >= wanted):
            continue
        w_span = max(float(weight.max()), 0.0) - min(float(weight.min()), 0.0)
        info = {"node": node.name, "tensor": x}
        if have <= MIN_REAL_RANGE or w_span > MIN_REAL_RANGE:
            span = float(np.max(wanted / w_scales)) * QRANGE[atype]
            if span > floors.get(x, (0.0, {}))[0]:
                floors[x] = (span, info | {"span_from": have, "span_to": span})
            continue
        # Dead weights: one scale (for every channel) large enough for the largest bias.
        scale = float(np.max(wanted)) / x_scale
        if channelwise or wtype.startswith("int"):
            rng: Interval = (-scale * (QRANGE[wtype] - 1) / 2, scale * (QRANGE[wtype] - 1) / 2)
        else:
            rmin = min(float(weight.min()), 0.0)
            rng = (rmin, rmin + scale * QRANGE[wtype])
        if rng[1] - rng[0] > (
            weights[w_name][0][1] - weights[w_name][0][0] if w_name in weights else 0
        ):
            weights[w_name] = (
                rng,
                info | {"tensor": w_name, "span_from": w_span, "span_to": rng[1] - rng[0]},
            )
    return floors, weights


def apply_bias_floor(
    ranges: dict[str, tuple[float, float]], floors: dict[str, tuple[float, dict[str, Any]]]
) -> dict[str, tuple[float, float]]:
    """Stretch each range to its floor span, on the side(s) the data already uses."""
    result = dict(ranges)
    for name, (span, _) in floors.items():
        low, high = ranges[name]
        grow = span - (high - low)
        if high > 0.0 and low >= 0.0:
            result[name] = (low, high + grow)
        elif high <= 0.0 and low < 0.0:
            result[name] = (low - grow, high)
        elif low == high == 0.0:
            result[name] = (0.0, span)
        else:
            result[name] = (low - grow / 2, high + grow / 2)
    return result


# A constant or bias at or below this is an attention-mask sentinel (BERT's is -1e4).
MASK_SENTINEL = -1e3
# Masked scores are kept this far below the lowest unmasked score: exp(-24) = 4e-11, far below
# a 16-bit Softmax output step (1.5e-5) even summed over thousands of masked positions.
SOFTMAX_MARGIN = 24.0


def _mask_fill(
    node: Any,
    consts: dict[str, float],
    ranges: dict[str, Interval],
    table_range: Callable[[str], Interval | None] = lambda _: None,
) -> tuple[Interval, str | None, str | None] | None:
    """(unmasked range, fill constant, mask bias) when ``node`` masks scores with a sentinel.

    Where(c, fill, x) / Where(c, x, fill) with a constant fill, or Add(x, bias) with a bias
    whose calibrated range is [sentinel, 0] (``(1 - mask) * -10000``), or whose values are
    gathered from a table holding sentinels among finite biases (``table_range``: the finite
    entries' range; a graph transformer's distance bias, "no path" at -inf); in all, every
    masked value lies more than ``SOFTMAX_MARGIN`` below every unmasked one.
    """
    if node.op_type == "Where" and len(node.input) == 3:
        fills = [i for i in (1, 2) if node.input[i] in consts]
        if len(fills) != 1 or node.input[3 - fills[0]] not in ranges:
            return None
        fill = node.input[fills[0]]
        low, high = ranges[node.input[3 - fills[0]]]
        if consts[fill] <= MASK_SENTINEL and consts[fill] < low - SOFTMAX_MARGIN:
            return (low, high), fill, None
        return None
    if node.op_type == "Add" and len(node.input) == 2:
        for i in (0, 1):
            bias, x = node.input[i], node.input[1 - i]
            if bias not in ranges or x not in ranges:
                continue
            (b_low, b_high), (low, high) = ranges[bias], ranges[x]
            if (
                b_low <= MASK_SENTINEL < low
                and b_high == 0.0
                and high + b_low < low - SOFTMAX_MARGIN
            ):
                return (low, high), None, bias
            finite = table_range(bias) if b_low <= MASK_SENTINEL < low else None
            if finite is not None and high + b_low < low + finite[0] - SOFTMAX_MARGIN:
                return (low + finite[0], high + finite[1]), None, bias
    return None


def _gathered_table(
    bias: str, producers: dict[str, Any], inits: dict[str, Any], carriers: frozenset[str]
) -> tuple[str, Interval] | None:
    """(table, the range of its finite entries) when ``bias`` is gathered, through ops that
    only move values, from a float constant holding sentinels (<= MASK_SENTINEL) among finite
    values; else None."""
    from onnx import numpy_helper

    name = bias
    while (node := producers.get(name)) is not None and node.op_type in carriers:
        if node.op_type == "Gather":
            table = inits.get(node.input[0])
            if table is None or table.data_type not in _FLOAT_TYPES:
                return None
            value = numpy_helper.to_array(table)
            finite = value[value > MASK_SENTINEL]
            if finite.size == 0 or finite.size == value.size:
                return None
            return node.input[0], (float(finite.min()), float(finite.max()))
        name = node.input[0]
    return None


def _constant_range(init: Any) -> Interval | None:
    """The [min, max] of a float constant (a position bias), or None."""
    from onnx import numpy_helper

    if init is None or init.data_type not in _FLOAT_TYPES or int(np.prod(init.dims)) > 1 << 22:
        return None
    value = numpy_helper.to_array(init)
    return (float(value.min()), float(value.max())) if value.size else None


def _summed_mask(
    node: Any,
    ranges: dict[str, Interval],
    producer: Any,
    constant_range: Any,
) -> tuple[Interval, None, str, str, Interval] | None:
    """(unmasked range, None, mask bias, the sum, the other addend's range) when ``node`` adds
    to scores a bias that is itself a sum of a bias and a sentinel mask bias: T5's
    ``position_bias + (1 - mask) * finfo.min``, added to every layer's scores. The unmasked
    scores land in the scores' range plus the other addend's."""
    if node.op_type != "Add" or len(node.input) != 2:
        return None
    for total, x in (node.input, node.input[::-1]):
        inner = producer(total)
        if total not in ranges or x not in ranges or inner is None or inner.op_type != "Add":
            continue
        for mask, other in (inner.input, inner.input[::-1]):
            other_range = ranges.get(other) or constant_range(other)
            if mask not in ranges or other_range is None:
                continue
            (m_low, m_high), (low, high) = ranges[mask], ranges[x]
            low, high = low + other_range[0], high + other_range[1]
            if m_low <= MASK_SENTINEL and m_high == 0.0 and high + m_low < low - SOFTMAX_MARGIN:
                return (low, high), None, mask, total, other_range
    return None


def mask_fill_ranges(
    model: Any, ranges: dict[str, Interval]
) -> tuple[dict[str, Interval], dict[str, Interval], list[str]]:
    """Attention scores masked with a sentinel, on their way to Softmax, keep the range of the
    unmasked scores plus ``SOFTMAX_MARGIN`` below (ranges, weight ranges, tensors changed).

    MinMax calibration records the sentinel (-1e4, -1e9) as the minimum: over [-1e4, 10] a
    16-bit step is 0.15, every real score rounds to it and the attention weights are noise.
    Cut to [lowest unmasked - margin, highest], a masked position quantizes to the low end,
    still at least the margin below every unmasked score of its row: Softmax gives it
    exp(-margin) ~ 0, as in float. Applies to every tensor from the masking op to the Softmax
    through shape-only ops (pipeline.graph.attention.softmax_chains), and to the fill constant
    itself (a weight range), so the HTP's Where sees one scale on both sides. An additive
    mask bias read only by such Adds is cut to [-(span of the scores) - margin, 0]: enough
    to push a masked score below every unmasked one by the margin, and a sane scale even
    when the sentinel is float32's lowest (a bias of (1 - mask) * -3.4e38).
    """
    from onnx import numpy_helper

    from ..graph.attention import SHAPE_OPS, softmax_chains

    carriers = SHAPE_OPS | {"Expand", "Cast", "Slice"}  # carry a mask bias to its Adds
    consts: dict[str, float] = {}
    for init in model.graph.initializer:
        if int(np.prod(init.dims)) == 1:
            value = numpy_helper.to_array(init).reshape(-1)
            if value.dtype.kind == "f":
                consts[init.name] = float(value[0])
    result = dict(ranges)
    weights: dict[str, Interval] = {}
    changed: list[str] = []
    bias_low: dict[str, float] = {}  # mask bias -> the lowest value any of its Adds needs
    bias_readers: dict[str, set[str]] = {}  # mask bias -> the Adds reading it
    summed: dict[str, tuple[float, float]] = {}  # a bias + mask sum -> its cut range
    addend_low: dict[str, float] = {}  # a mask a cut bias sums -> the lowest cut of those sums
    addend_sums: dict[str, set[str]] = {}  # ... and the sums reading it
    producers = {o: n for n in model.graph.node for o in n.output}
    inits = {i.name: i for i in model.graph.initializer}
    tables = carriers | {"Gather"}

    def table_range(bias: str) -> Interval | None:
        found = _gathered_table(bias, producers, inits, tables)
        return found[1] if found else None

    bias_high: dict[str, float] = {}  # mask bias -> its highest unmasked value (0: a 0/1 mask)
    for node in model.graph.node:
        found = _mask_fill(node, consts, ranges, table_range) or _summed_mask(
            node, ranges, producers.get, lambda name: _constant_range(inits.get(name))
        )
        if found is None:
            continue
        (low, high), fill, bias, *rest = found
        chains = softmax_chains(model, node.output[0])
        if not chains:
            continue
        cut = (low - SOFTMAX_MARGIN, high)
        for name in dict.fromkeys(n for chain in chains for n in chain):
            if name in result and result[name] != cut:
                result[name] = cut
                changed.append(name)
        if fill is not None:
            weights[fill] = cut
        if bias is not None:
            finite = table_range(bias) if not rest else None
            if finite is not None:  # the scores' own range: the table's finite part removed
                low, high = low - finite[0], high - finite[1]
                bias_high[bias] = finite[1]
            need = (finite[0] if finite else 0.0) - (high - low) - SOFTMAX_MARGIN
            bias_low[bias] = min(bias_low.get(bias, 0.0), need)
            adder = producers[rest[0]] if rest else node  # T5: the sum reads the mask bias
            bias_readers.setdefault(bias, set()).add(adder.name or adder.output[0])
        if rest:  # the sum of a bias and the mask: its unmasked range, pushed down like it
            total, (c_low, c_high) = rest
            old_low = summed.get(total, (c_low, c_high))[0]
            summed[total] = (min(old_low, c_low - (high - low) - SOFTMAX_MARGIN), c_high)
    for total, cut in summed.items():
        if total in result and result[total] != cut:
            result[total] = cut
            changed.append(total)
    readers: dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    outputs = {o.name for o in model.graph.output}
    producers = {o: n for n in model.graph.node for o in n.output}
    for bias, need in bias_low.items():
        if readers.get(bias) != len(bias_readers[bias]) or bias in outputs:
            continue
        cut = (max(need, ranges[bias][0]), bias_high.get(bias, 0.0))
        # The bias and what makes it: shape ops back to the Mul/Where that scales or fills
        # the mask with the sentinel; that constant is cut too (a weight range), so the HTP
        # never multiplies a 0/1 mask by -1e9 into a range 40 wide (ctx vs QDQ 0.8 dB).
        name, chain = bias, [bias]
        while (node := producers.get(name)) is not None and node.op_type in carriers:
            if readers.get(node.input[0]) != 1 or node.input[0] not in ranges:
                break
            name = node.input[0]
            chain.append(name)
        node = producers.get(name)
        if bias in bias_high and node is not None and node.op_type == "Gather":
            table = node.input[0]  # its sentinels saturate at the cut's low end
            if table in inits and readers.get(table) == 1:
                weights[table] = cut
        if node is not None and node.op_type in ("Mul", "Where"):
            sentinels = [i for i in node.input if i in consts and consts[i] <= MASK_SENTINEL]
            if len(sentinels) == 1 and readers.get(sentinels[0]) == 1:
                weights[sentinels[0]] = cut
        if node is not None and node.op_type == "Add":
            _note_mask_addends(node, ranges, inits, cut[0], addend_low, addend_sums)
        for name in chain:
            if name in result and result[name] != cut:
                result[name] = cut
                changed.append(name)
    # The masks a cut bias sums (a padding mask's bias plus a causal mask made whole): each of
    # them cut as the sum is, where those sums are all that read it, so the Add sees inputs on
    # grids as fine as its own (on the masks' -1e9 ones the HTP computes the cut sum wrongly).
    for addend, low in addend_low.items():
        if readers.get(addend) != len(addend_sums[addend]) or addend in outputs:
            continue
        if addend in inits:
            weights[addend] = (low, 0.0)
        elif addend in result and result[addend] != (low, 0.0):
            result[addend] = (low, 0.0)
            changed.append(addend)
    return result, weights, changed


def _note_mask_addends(
    add: Any,
    ranges: dict[str, Interval],
    inits: dict[str, Any],
    low: float,
    addend_low: dict[str, float],
    addend_sums: dict[str, set[str]],
) -> None:
    """When both inputs of ``add`` are mask biases (0 where kept, a sentinel where masked, as
    calibrated or as a constant holds them), note that each may be cut to ``low``."""
    spans = [ranges.get(i) or _constant_range(inits.get(i)) for i in add.input]
    if len(spans) != 2 or any(s is None or s[0] > MASK_SENTINEL or s[1] != 0.0 for s in spans):
        return
    for name in add.input:
        addend_low[name] = min(addend_low.get(name, 0.0), low)
        addend_sums.setdefault(name, set()).add(add.name or add.output[0])


# A graph output packing parts whose peaks differ this much or more is not given one grid.
PACKED_RATIO = 32.0
# What may lie between a packing Concat and the graph output it makes.
_PACKING_MOVES = {"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Concat"}


def packed_outputs(model: Any, ranges: dict[str, Interval]) -> dict[str, str]:
    """The tensors to keep in float (fp16 on the HTP) where a graph output packs parts of
    different scale: a Concat reaching the output through moves and Concats only whose inputs'
    calibrated peaks differ by ``PACKED_RATIO`` or more, its output and every tensor from it to
    the graph output -> why (for the report).

    Why: one grid spans every part, so the small part gets a sliver of it. A YOLOv8 layout
    detector's [1, 15, 21504] output (4 rows of box pixels up to 1020, 11 rows of class
    probabilities up to 0.47) had a uint16 step of 0.032: its probabilities on 15 steps, 18.7 dB
    on the HTP while the output's pooled figure (the boxes' energy) read 47 dB. In fp16 each part
    keeps its own relative precision (11 bits: far finer than the quantization before it)."""
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    inits = {i.name for i in graph.initializer}

    def peak(name: str) -> float | None:
        if name in ranges:
            low, high = ranges[name]
            return max(abs(low), abs(high))
        return None

    kept: dict[str, str] = {}
    for output in graph.output:
        path: dict[str, list[str]] = {output.name: [output.name]}  # tensor -> it .. the output
        todo = [output.name]
        while todo:
            name = todo.pop()
            node = producer.get(name)
            if node is None or node.op_type not in _PACKING_MOVES:
                continue
            sources = [i for i in node.input if i and i not in inits]
            if node.op_type != "Concat":
                sources = sources[:1]
            for source in sources:
                if source not in path:
                    path[source] = [source, *path[name]]
                    todo.append(source)
            if node.op_type != "Concat":
                continue
            peaks = [p for p in (peak(i) for i in node.input if i) if p is not None and p > 0]
            if len(peaks) > 1 and max(peaks) >= PACKED_RATIO * min(peaks):
                why = (
                    f"{output.name!r} packs parts peaking at {min(peaks):.3g} and {max(peaks):.3g} "
                    f"in Concat {node.name or name!r}: one grid would leave the smaller part "
                    f"{max(peaks) / min(peaks):.0f}x coarser"
                )
                for tensor in path[name]:
                    kept.setdefault(tensor, why)
    return kept


def read_cache(path: Any) -> tuple[Any, dict[str, tuple[float, float]]]:
    """onnxruntime's calibration cache -> (its TensorsData, {tensor: (low, high)})."""
    from onnxruntime.quantization.calibrate import load_tensors_data

    data = load_tensors_data(path)
    ranges = {}
    for name, entry in data.data.items():
        low = np.asarray(entry.range_value[0], dtype=np.float64).ravel()
        high = np.asarray(entry.range_value[1], dtype=np.float64).ravel()
        if low.size == 1 and high.size == 1:
            ranges[name] = (float(low[0]), float(high[0]))
    return data, ranges


def write_cache(data: Any, ranges: dict[str, tuple[float, float]], path: Any) -> None:
    """Write ``data`` with its MinMax ranges replaced by ``ranges``."""
    from onnxruntime.quantization.calibrate import TensorData, TensorsData, save_tensors_data

    entries = dict(data.data)
    for name, (low, high) in ranges.items():
        entries[name] = TensorData(
            lowest=np.array(low, dtype=np.float32), highest=np.array(high, dtype=np.float32)
        )
    save_tensors_data(TensorsData(data.calibration_method, entries), path)


def tune(
    model: Any,
    raw_cache: Any,
    tuned_cache: Any,
    activation_type: str,
    weight_type: str,
    per_channel: bool,
    tensor_types: dict[str, str],
    rms: dict[str, float],
) -> RangeChanges:
    """Write ``tuned_cache``: the calibrated ranges of ``raw_cache`` after the rules above.

    ``tensor_types`` are per-tensor type overrides (activations and weights) on top of the
    defaults ``activation_type``/``weight_type``; ``rms`` is each activation's root mean
    square on calibration samples (``activation_rms``).
    """
    data, raw = read_cache(raw_cache)
    raw, shared = unrolled_loop_ranges(raw)
    inits = {i.name for i in model.graph.initializer}
    activation_types = {name: tensor_types.get(name, activation_type) for name in raw}
    weight_types = {name: tensor_types.get(name, weight_type) for name in inits}
    levels = {n: QRANGE.get(t, 255) for n, t in activation_types.items()}
    changes = RangeChanges()
    bits = {n: 16 if q > 255 else 8 for n, q in levels.items()}
    default_bits = 16 if QRANGE.get(activation_type, 0) > 255 else 8
    live = live_ranges(model, bits, default_bits)
    ranges, _ = clamp_to_live(raw, live)
    bounds = _bounds(model)
    for name, (floor, ceiling) in live.items():
        low, high = bounds.get(name, (None, None))
        bounds[name] = (
            floor if low is None else max(low, floor),
            ceiling if high is None else min(high, ceiling),
        )
    widened = widen(ranges, bounds, margins(ranges, rms, levels))
    changes.widened = sum(1 for n in widened if widened[n] != ranges[n])
    # Second pass: with every range now known, the rule also passes through x+y and x-y.
    # Narrowing a tensor afterwards only makes the bounds it lent to others conservative.
    live = live_ranges(model, bits, default_bits, widened)
    ranges, _ = clamp_to_live(widened, live)
    changes.clamped = sum(
        1 for n, (lo, hi) in raw.items() if ranges[n][0] > lo or ranges[n][1] < hi
    )
    ranges, changes.filled = fill_live(ranges, live, bits)
    ranges, changes.selections = widen_selections(model, ranges)
    ranges, fill_ranges, changes.mask_fills = mask_fill_ranges(model, ranges)
    ranges, changes.log_outputs = widen_log_outputs(model, ranges, bits)
    ranges, changes.hard_sigmoids = fixed_hard_sigmoid_outputs(model, ranges, bits)
    ranges, changes.unseen_ranges = unseen_ranges(model, ranges)
    changes.loop_shared = shared
    ranges, changes.integer_inputs = integer_inputs(model, ranges, levels)
    floors, weight_ranges = bias_floor(model, ranges, activation_types, weight_types, per_channel)
    ranges = apply_bias_floor(ranges, floors)
    changes.bias_floor = [BiasFloor(**info) for _, info in floors.values()]
    changes.bias_floor += [BiasFloor(**info) for _, info in weight_ranges.values()]
    changes.weight_ranges = {name: interval for name, (interval, _) in weight_ranges.items()}
    changes.weight_ranges.update(fill_ranges)
    marked, _ = sentinel_constant_ranges(model, ranges)
    for name, interval in marked.items():  # a mask's own cut (mask_fill_ranges) comes first
        if name not in changes.weight_ranges:
            changes.weight_ranges[name] = interval
            changes.sentinel_constants.append(name)
    write_cache(data, ranges, tuned_cache)
    return changes
