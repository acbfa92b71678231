"""Rules applied to calibrated activation ranges before quantizing.

MinMax calibration records the extremes of a few samples. Two things go wrong with that on
real models, and both are fixed here, on the ranges, before onnxruntime picks scales:

- **Unseen extremes.** With 16-bit activations the resolution is plentiful (a step of 1/65535
  of the range), so the error that dominates is clipping: a held-out input that drives a tensor
  past the largest calibrated value is cut off, and the cut propagates. Each 16-bit range is
  widened by ``MARGIN_16BIT`` of its span on each side (costing ~6 dB of a ~96 dB budget),
  never past the bounds the producing op guarantees (Relu >= 0, Clip's limits, Sigmoid in
  [0, 1], ...): onnxruntime removes Relu/Clip and lets the QuantizeLinear do the clamping, so
  their bounds must stay exact. A tensor seen only non-negative stays non-negative.
- **Bias overflow.** A Conv/Gemm bias is stored as int32 with scale input_scale x weight_scale.
  When the input is (nearly) constant, e.g. a ReLU branch that is always 0, its range collapses
  to onnxruntime's minimum (1e-4), the bias scale becomes ~1e-12 and every bias value saturates
  at +-2^31: the layer outputs garbage. The input's range is raised until the bias fits.
  (onnxruntime already does the equivalent by raising the weight scale, but only for symmetric
  signed weights; for unsigned weights nobody did.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

MARGIN_16BIT = 0.5  # of the calibrated span, on each side, for 16-bit activations
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


@dataclass
class RangeChanges:
    """What was changed, for the report."""

    widened: int = 0
    bias_floor: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"widened": self.widened, "bias_floor": self.bias_floor}


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
                    limits[slot] = float(numpy_helper.to_array(inits[node.input[index]]))
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


def widen(
    ranges: dict[str, tuple[float, float]],
    bounds: dict[str, tuple[float | None, float | None]],
    margin: float,
) -> dict[str, tuple[float, float]]:
    """Each range grown by ``margin`` x its span per side, within bounds and sign."""
    result = {}
    for name, (low, high) in ranges.items():
        span = high - low
        new_low, new_high = low - margin * span, high + margin * span
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
    ranges: dict[str, tuple[float, float]],
    activation_types: dict[str, str],
    weight_types: dict[str, str],
    per_channel: bool,
) -> dict[str, tuple[float, dict[str, Any]]]:
    """Activation -> the smallest range span that keeps its consumers' int32 biases unsaturated.

    ``activation_types``/``weight_types`` give each tensor's quantization type. Only weights of
    unsigned types are considered: onnxruntime itself raises the scale of symmetric signed
    weights when a bias would overflow.
    """
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    needed: dict[str, tuple[float, dict[str, Any]]] = {}
    for node in model.graph.node:
        if node.op_type not in ("Conv", "Gemm", "ConvTranspose") or len(node.input) < 3:
            continue
        x, w_name, b_name = node.input[0], node.input[1], node.input[2]
        if x not in ranges or w_name not in inits or b_name not in inits:
            continue
        wtype = weight_types.get(w_name, "")
        if wtype not in QRANGE or wtype.startswith("int"):
            continue
        atype = activation_types.get(x, "")
        if atype not in QRANGE:
            continue
        weight = numpy_helper.to_array(inits[w_name])
        bias = np.abs(numpy_helper.to_array(inits[b_name]).astype(np.float64)).ravel()
        axis = 1 if node.op_type == "ConvTranspose" else 0
        w_scales = _weight_scales(weight, wtype, per_channel and node.op_type != "Gemm", axis)
        if w_scales.size not in (1, bias.size):
            continue
        # Bias scale = x_scale * w_scale must reach 2*|b| / INT32_SPAN for every channel.
        x_scale = float(np.max(BIAS_HEADROOM * 2.0 * bias / INT32_SPAN / w_scales))
        span = x_scale * QRANGE[atype]
        low, high = ranges[x]
        have = max(high - low, MIN_REAL_RANGE)
        if span > have and span > needed.get(x, (0.0, {}))[0]:
            needed[x] = (
                span,
                {"tensor": x, "node": node.name, "span_from": have, "span_to": span},
            )
    return needed


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
) -> RangeChanges:
    """Write ``tuned_cache``: the calibrated ranges of ``raw_cache`` after the rules above.

    ``tensor_types`` are per-tensor type overrides (activations and weights) on top of the
    defaults ``activation_type``/``weight_type``.
    """
    data, raw = read_cache(raw_cache)
    inits = {i.name for i in model.graph.initializer}
    activation_types = {name: tensor_types.get(name, activation_type) for name in raw}
    weight_types = {name: tensor_types.get(name, weight_type) for name in inits}
    changes = RangeChanges()
    sixteen = {n: r for n, r in raw.items() if QRANGE.get(activation_types[n], 0) > 255}
    ranges = dict(raw)
    if sixteen:
        widened = widen(sixteen, _bounds(model), MARGIN_16BIT)
        changes.widened = sum(1 for n in widened if widened[n] != raw[n])
        ranges.update(widened)
    floors = bias_floor(model, ranges, activation_types, weight_types, per_channel)
    ranges = apply_bias_floor(ranges, floors)
    changes.bias_floor = [info for _, info in floors.values()]
    write_cache(data, ranges, tuned_cache)
    return changes
