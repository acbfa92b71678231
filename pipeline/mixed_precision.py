"""Automatic mixed precision: raise the worst-quantized tensors to 16 bit until SNR is met.

The error each Q/DQ pair adds on its own ("local SNR") is measured on held-out samples: for
activations by quantizing the float model's tensor with the scale and zero point the QDQ model
chose, for weights by comparing the dequantized initializer with the float one. The worst 8-bit
tensors are raised in growing groups (1, 2, 4, ...), re-quantizing from cached calibration
ranges, and the smallest group that reaches the target (or the best one tried) is kept.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .config import ModelConfig
from .metrics import snr_db, worst_snr

MAX_ROUNDS = 6
ANALYSIS_SAMPLES = 4
EIGHT_BIT = {2: "uint8", 3: "int8"}  # onnx TensorProto elem types


def _qdq_params(qdq: Any) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """Activation tensors and weights with their (scale, zero point, elem type)."""
    from onnx import numpy_helper

    inits = {i.name: i for i in qdq.graph.initializer}

    def value(name: str) -> np.ndarray | None:
        return numpy_helper.to_array(inits[name]) if name in inits else None

    activations: dict[str, tuple] = {}
    weights: dict[str, tuple] = {}
    for node in qdq.graph.node:
        if len(node.input) < 3:
            continue
        scale, zero = value(node.input[1]), value(node.input[2])
        if scale is None or zero is None:
            continue
        elem = inits[node.input[2]].data_type
        if node.op_type == "QuantizeLinear" and node.input[0] not in inits:
            activations[node.input[0]] = (scale, zero, elem)
        elif node.op_type == "DequantizeLinear" and node.input[0] in inits:
            quantized = value(node.input[0])
            axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
            name = node.input[0].removesuffix("_quantized")
            weights[name] = (scale, zero, elem, quantized, axis)
    return activations, weights


def local_snrs(float_path: Path, qdq_path: Path, heldout: Path) -> dict[str, tuple[float, str]]:
    """tensor name -> (local SNR dB, "activation"|"weight") for every 8-bit Q/DQ pair."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    from .quantize import iter_heldout

    qdq = onnx.load(str(qdq_path))
    activations, weights = _qdq_params(qdq)
    result: dict[str, tuple[float, str]] = {}

    float_model = onnx.load(str(float_path))
    float_inits = {i.name: numpy_helper.to_array(i) for i in float_model.graph.initializer}
    for name, (scale, zero, elem, quantized, axis) in weights.items():
        if elem not in EIGHT_BIT or name not in float_inits:
            continue
        shape = [1] * quantized.ndim
        if scale.ndim == 1 and quantized.ndim:
            shape[axis] = -1
        deq = (quantized.astype(np.float64) - zero.reshape(shape)) * scale.reshape(shape)
        result[name] = (snr_db(float_inits[name], deq), "weight")

    wanted = [n for n, (_, _, e) in activations.items() if e in EIGHT_BIT]
    if not wanted:
        return result
    existing = {o.name for o in float_model.graph.output}
    produced = {o for n in float_model.graph.node for o in n.output}
    for name in wanted:
        if name in produced and name not in existing:
            float_model.graph.output.append(onnx.ValueInfoProto(name=name))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(
        float_model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in session.get_outputs()]
    signal: dict[str, float] = {}
    noise: dict[str, float] = {}
    for index, feeds in enumerate(iter_heldout(heldout)):
        if index >= ANALYSIS_SAMPLES:
            break
        values = dict(zip(names, session.run(None, feeds), strict=True)) | feeds
        for name in wanted:
            if name not in values:
                continue
            scale, zero, elem = activations[name]
            info = np.iinfo(np.uint8 if elem == 2 else np.int8)
            x = values[name].astype(np.float64)
            q = np.clip(np.round(x / scale) + zero, info.min, info.max)
            err = x - (q - zero) * scale
            signal[name] = signal.get(name, 0.0) + float(np.sum(x * x))
            noise[name] = noise.get(name, 0.0) + float(np.sum(err * err))
    for name in signal:
        snr = (
            float("inf")
            if noise[name] == 0
            else 10 * np.log10(max(signal[name], 1e-20) / noise[name])
        )
        result[name] = (float(snr), "activation")
    return result


def raise_precision(
    config: ModelConfig,
    float_path: Path,
    qdq_path: Path,
    heldout: Path,
    base_overrides: dict[str, str],
    requantize: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """Re-quantize with the worst tensors at 16 bit while the worst output SNR is below target."""
    from .quantize import evaluate

    target = config.quantization.target_snr_db
    before = worst_snr(evaluate(float_path, qdq_path, heldout))
    summary: dict[str, Any] = {
        "target_snr_db": target,
        "before_snr_db": before,
        "after_snr_db": before,
        "tensors": [],
    }
    if before >= target:
        return summary
    ranked = sorted(local_snrs(float_path, qdq_path, heldout).items(), key=lambda kv: kv[1][0])
    if not ranked:
        return summary
    best = (before, [])
    tried = []
    count = 1
    for _ in range(MAX_ROUNDS):
        group = ranked[: min(count, len(ranked))]
        overrides: dict[str, Any] = dict(base_overrides)
        for name, (_, kind) in group:
            overrides[name] = "int16" if kind == "weight" else "uint16"
        requantize(overrides)
        after = worst_snr(evaluate(float_path, qdq_path, heldout))
        tried.append({"tensors": len(group), "snr_db": after})
        if after > best[0]:
            best = (after, group)
        if after >= target or count >= len(ranked):
            break
        count *= 2
    # Leave the best variant on disk.
    overrides = dict(base_overrides)
    for name, (_, kind) in best[1]:
        overrides[name] = "int16" if kind == "weight" else "uint16"
    if best[1] != group:
        requantize(overrides)
    summary.update(
        after_snr_db=best[0],
        tensors=[{"name": n, "kind": k, "local_snr_db": s} for n, (s, k) in best[1]],
        rounds=tried,
    )
    return summary
