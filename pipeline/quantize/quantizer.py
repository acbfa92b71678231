"""onnxruntime's static QDQ quantizer, driven the way QNN HTP wants it.

Three steps, each one call: ``calibrate`` one bucket's float model on its samples (MinMax: one
pass of in-graph reductions, one sample at a time, written as onnxruntime's calibration cache;
other methods: onnxruntime's calibrator, streamed in chunks), ``merge_ranges`` over the buckets (one
range per tensor in every bucket, so their weights and scales stay byte-identical), and
``quantize`` a bucket from the merged ranges after the range rules of
``pipeline.calibration.ranges`` (cut to the values that matter, margins, int32-bias floor).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..calibration import ranges as range_rules
from ..core.config import ModelConfig
from ..core.errors import CalibrationError, ModelError, PipelineError
from ..core.fileio import atomic_path
from ..core.progress import Progress
from ..graph import qdq_htp
from . import bias_correction

CALIBRATION_CHUNK = 16  # samples whose intermediate outputs are held at once
ORT_QUANT_TYPES = {
    "uint8": "QUInt8",
    "int8": "QInt8",
    "uint16": "QUInt16",
    "int16": "QInt16",
    "uint4": "QUInt4",
    "int4": "QInt4",
}
RMS_SAMPLES = 8  # calibration samples each activation's RMS (for range margins) is measured on


@dataclass(frozen=True)
class Calibrated:
    """What calibrating one bucket produced: the raw ranges file and activation RMS values."""

    cache: Path
    rms: dict[str, float]
    rms_samples: int
    means: dict[str, np.ndarray] = field(default_factory=dict)  # layer inputs, per channel
    mean_samples: int = 0


class StreamingReader:
    """An onnxruntime CalibrationDataReader over samples that never holds more than a chunk.

    onnxruntime's ``CalibStridedMinMax`` calls ``set_range`` and ``collect_data`` once per
    chunk and merges the ranges, so only one chunk of intermediate outputs is alive at a time.
    (Its ``CalibMaxIntermediateOutputs`` option drops collected data instead; not used.)
    """

    def __init__(self, samples: Any, chunk: int, progress: Progress | None = None) -> None:
        self._samples = samples
        self._chunk = chunk
        self._iter: Iterator[dict[str, np.ndarray]] = iter(samples)
        self._left = 0
        self._progress = progress

    def __len__(self) -> int:  # rounded up to whole chunks; the last chunk is shorter
        return -(-len(self._samples) // self._chunk) * self._chunk

    def set_range(self, start_index: int, end_index: int) -> None:
        self._left = end_index - start_index

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._left <= 0:
            return None
        self._left -= 1
        sample = next(self._iter, None)
        if sample is not None and self._progress is not None:
            self._progress.update(1)
        return sample

    def rewind(self) -> None:
        self._iter = iter(self._samples)


def calibrate(
    config: ModelConfig, float_path: Path, samples: Any, cache: Path, scratch: Path, label: str
) -> Calibrated:
    """Calibrate ``float_path`` on ``samples`` (ranges to ``cache``) and measure the RMS of every
    calibrated activation on the first samples (the range margins need it).

    MinMax, the default, is one pass of our own: the tensors onnxruntime's calibrator would
    pick, reduced to their min and max in the graph next to the RMS and means, written as
    onnxruntime's calibration cache (same values: tests/test_quantizer.py). onnxruntime's own
    run also writes a throwaway QDQ model and needs a second pass for the statistics, which
    cost a third of the calibration time. Other methods (histograms) stay onnxruntime's."""
    import onnx

    axes_of = bias_correction.mean_axes if config.quantization.bias_correction else None
    if config.quantization.method == "MinMax":
        model, names = _calibration_tensors(config, float_path)
        with Progress(len(samples), f"calibrate {label}", unit="sample") as progress:
            stats = range_rules.activation_statistics(
                model,
                samples,
                names,
                axes_of(model) if axes_of else {},
                RMS_SAMPLES,
                range_names=names,
                on_sample=lambda: progress.update(1),
                in_place=True,  # the shape-inferred copy is only for this
            )
        if not stats.range_samples:
            raise CalibrationError(f"{label}: no calibration sample reached the model.")
        marked = range_rules.sentinel_tensors(stats.ranges)
        if marked:  # rare: a second pass over the samples for those tensors only
            model, _ = _calibration_tensors(config, float_path)
            marked = range_rules.sentinel_tensors(stats.ranges, model)
        if marked:
            with Progress(len(samples), f"calibrate {label} without marks", unit="sample") as bar:
                again = range_rules.activation_statistics(
                    model,
                    samples,
                    marked,
                    max_samples=RMS_SAMPLES,
                    range_names=marked,
                    on_sample=lambda: bar.update(1),
                    in_place=True,
                    without_sentinels=True,
                )
            stats.ranges.update(again.ranges)
            stats.rms.update(again.rms)
        _save_ranges(stats.ranges, cache)
        return Calibrated(cache, stats.rms, stats.samples, stats.means, stats.samples)
    with Progress(len(samples), f"calibrate {label}", unit="sample") as progress:
        _run_quantizer(config, float_path, scratch, samples, cache, {}, progress=progress)
    _, calibrated = range_rules.read_cache(cache)
    model = onnx.load(str(float_path))
    # One pass for both: the RMS of every activation, the channel means of every layer input.
    axes = axes_of(model) if axes_of else {}
    stats = range_rules.activation_statistics(model, samples, sorted(calibrated), axes, RMS_SAMPLES)
    return Calibrated(cache, stats.rms, stats.samples, stats.means, stats.samples)


def _calibration_tensors(config: ModelConfig, float_path: Path) -> tuple[Any, list[str]]:
    """The model as onnxruntime's ``quantize_static`` calibrates it (shape-inferred) and the
    tensors its calibrator selects there, by onnxruntime's own rule and op types."""
    import onnx
    from onnxruntime.quantization.calibrate import CalibraterBase
    from onnxruntime.quantization.quant_utils import load_model_with_shape_infer

    plain = onnx.load(str(float_path), load_external_data=False)
    qconfig = _qnn_config(config, float_path, plain, None, {})
    model = load_model_with_shape_infer(Path(float_path))
    selector = CalibraterBase.__new__(CalibraterBase)  # only its selection rule is used
    selector.op_types_to_calibrate = qconfig.op_types_to_quantize
    tensors, _ = selector.select_tensors_to_calibrate(model)
    return model, sorted(tensors)


def _save_ranges(ranges: dict[str, tuple[np.ndarray, np.ndarray]], cache: Path) -> None:
    from onnxruntime.quantization.calibrate import (
        CalibrationMethod,
        TensorsData,
        save_tensors_data,
    )

    with atomic_path(cache) as tmp:
        tmp.unlink()
        save_tensors_data(TensorsData(CalibrationMethod.MinMax, dict(ranges)), tmp)


@dataclass(frozen=True)
class Statistics:
    """What every bucket's quantization reads besides the ranges, pooled over the buckets."""

    rms: dict[str, float]  # activation -> root mean square (range margins)
    means: dict[str, np.ndarray]  # layer input -> per-channel mean (bias correction)


def merge_ranges(parts: list[Calibrated], target: Path) -> tuple[int, Statistics]:
    """Union of every tensor's calibrated range over the buckets, written to ``target``; and the
    RMS of each activation and the channel means of each layer input pooled over the buckets'
    samples. Returns (tensors, statistics)."""
    from onnxruntime.quantization.calibrate import (
        TensorData,
        TensorsData,
        load_tensors_data,
        save_tensors_data,
    )

    merged: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    method = None
    for part in parts:
        data = load_tensors_data(part.cache)
        if method is not None and data.calibration_method != method:
            raise CalibrationError(f"Calibration caches disagree on the method ({part.cache}).")
        method = data.calibration_method
        for name, value in data.items():
            low, high = value.range_value
            if name in merged:
                old_low, old_high = merged[name]
                low, high = np.minimum(old_low, low), np.maximum(old_high, high)
            merged[name] = (np.asarray(low), np.asarray(high))
    tensors = {
        name: TensorData(lowest=low.astype(np.float32), highest=high.astype(np.float32))
        for name, (low, high) in merged.items()
    }
    with atomic_path(target) as tmp:
        tmp.unlink()
        save_tensors_data(TensorsData(method, tensors), tmp)
    power: dict[str, float] = {}
    weight: dict[str, int] = {}
    for part in parts:
        for name, value in part.rms.items():
            power[name] = power.get(name, 0.0) + part.rms_samples * value * value
            weight[name] = weight.get(name, 0) + part.rms_samples
    rms = {n: float(np.sqrt(power[n] / weight[n])) for n in power if weight[n]}
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, int] = {}
    for part in parts:
        for name, value in part.means.items():
            if name in sums and sums[name].shape != value.shape:
                continue  # a channel count that differs between buckets: no common mean
            sums[name] = sums.get(name, 0.0) + part.mean_samples * value
            counts[name] = counts.get(name, 0) + part.mean_samples
    means = {n: sums[n] / counts[n] for n in sums if counts[n]}
    return len(tensors), Statistics(rms, means)


def quantize(
    config: ModelConfig,
    float_path: Path,
    qdq_path: Path,
    ranges_file: Path,
    statistics: Statistics,
    tensor_overrides: dict[str, str],
) -> range_rules.RangeChanges:
    """Write ``qdq_path`` from the calibrated ranges after the range rules, then correct the
    biases for the weights' rounding (``bias_correction``); what they changed."""
    import onnx

    q = config.quantization
    model = onnx.load(str(float_path))
    op_types = q.overrides.op_types
    _, calibrated = range_rules.read_cache(ranges_file)
    packed = {
        t: why
        for t, why in range_rules.packed_outputs(model, calibrated).items()
        if t not in tensor_overrides
    }
    tensor_overrides = {
        **per_channel_weights(model, q.per_channel),
        **dict.fromkeys(packed, "float16"),
        **tensor_overrides,
    }
    tensor_types = dict(tensor_overrides)
    for node in model.graph.node:
        if node.op_type in op_types:
            for output in node.output:
                tensor_types.setdefault(output, op_types[node.op_type])
    # The range rules need the integer type; a float16 tensor is not quantized at all.
    tensor_types = {
        name: precision.partition("_per_")[0]
        for name, precision in tensor_types.items()
        if precision != "float16"
    }
    tuned = qdq_path.with_name(f".{qdq_path.name}.tuned-ranges.json")
    try:
        try:
            changes = range_rules.tune(
                model,
                ranges_file,
                tuned,
                q.activation_type,
                q.weight_type,
                False,  # per-channel weights are explicit in tensor_types
                tensor_types,
                statistics.rms,
            )
        except PipelineError:
            raise
        except (ValueError, KeyError, FloatingPointError, OSError) as exc:
            raise ModelError(
                f"{config.model.name}: tuning the calibrated ranges failed: "
                f"{type(exc).__name__}: {exc}",
                tip=f"Report this model; see the prepared model {float_path}.",
            ) from exc
        _run_quantizer(
            config, float_path, qdq_path, [], tuned, tensor_overrides, changes.weight_ranges
        )
    finally:
        tuned.unlink(missing_ok=True)
    reasons = sorted(set(packed.values()))
    changes = dataclasses.replace(changes, packed_outputs=reasons)
    # Edits of the quantized model: one load, one write for both.
    qdq = onnx.load(str(qdq_path))
    edited = False
    if q.bias_correction and statistics.means:
        qdq, change = bias_correction.correct_biases(qdq, model, statistics.means)
        edited |= change.changed
        changes = dataclasses.replace(changes, bias_corrections=len(change.details))
    qdq, change = qdq_htp.split_swish_input(qdq)
    edited |= change.changed
    changes = dataclasses.replace(changes, swish_splits=list(change.details))
    qdq, change = qdq_htp.signed_activation_products(qdq)
    edited |= change.changed
    changes = dataclasses.replace(changes, signed_products=list(change.details))
    qdq, change = qdq_htp.sums_no_finer_than_inputs(qdq, qdq_htp.clipped_outputs(model))
    edited |= change.changed
    changes = dataclasses.replace(changes, coarse_sums=list(change.details))
    qdq, change = qdq_htp.split_sixteen_bit_weights(qdq)  # before: its int8 scales may be tiny
    edited |= change.changed
    changes = dataclasses.replace(changes, split_weights=list(change.details))
    qdq, change = qdq_htp.weight_scales_for_htp(qdq)
    edited |= change.changed
    changes = dataclasses.replace(changes, raised_weight_scales=list(change.details))
    qdq, change = qdq_htp.requantize_after_moves(qdq)
    edited |= change.changed
    changes = dataclasses.replace(changes, requantized_moves=list(change.details))
    qdq, change = qdq_htp.dequantized_integer_inputs(qdq)
    edited |= change.changed
    changes = dataclasses.replace(changes, dequantized_inputs=list(change.details))
    qdq, change = qdq_htp.scatter_sums_on_output_grid(qdq)
    edited |= change.changed
    changes = dataclasses.replace(changes, scatter_sums=list(change.details))
    if edited:
        with atomic_path(qdq_path) as tmp:
            onnx.save(qdq, str(tmp))
    return changes


def _qnn_config(
    config: ModelConfig,
    float_path: Path,
    model: Any,
    reader: Any,
    tensor_overrides: dict[str, str],
    weight_ranges: dict[str, tuple[float, float]] | None = None,
) -> Any:
    """onnxruntime's QNN quantization config for this model (op types, overrides, symmetry)."""
    from onnxruntime.quantization import CalibrationMethod, QuantType
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    q = config.quantization
    overrides = _tensor_overrides(model, tensor_overrides, q.overrides.op_types)
    init_overrides = overrides.tensors
    for name, (low, high) in (weight_ranges or {}).items():
        entry = init_overrides.setdefault(name, [{}])[0]
        entry.update(rmin=np.array(low, np.float32), rmax=np.array(high, np.float32))
    return get_qnn_qdq_config(
        str(float_path),
        reader,
        calibrate_method=getattr(CalibrationMethod, q.method),
        activation_type=getattr(QuantType, ORT_QUANT_TYPES[q.activation_type]),
        weight_type=getattr(QuantType, ORT_QUANT_TYPES[q.weight_type]),
        per_channel=False,  # per channel only where per_channel_weights says, explicitly
        init_overrides=init_overrides or None,
        nodes_to_exclude=overrides.float_nodes or None,
    )


def _run_quantizer(
    config: ModelConfig,
    float_path: Path,
    qdq_path: Path,
    samples: Iterable[dict[str, np.ndarray]],
    cache: Path,
    tensor_overrides: dict[str, str],
    weight_ranges: dict[str, tuple[float, float]] | None = None,
    progress: Progress | None = None,
) -> None:
    """One onnxruntime ``quantize_static`` run; it calibrates only when ``cache`` is absent.

    ``weight_ranges`` overrides the float range onnxruntime quantizes a weight over.
    """
    import onnx
    from onnxruntime.quantization import quantize_static

    model = onnx.load(str(float_path), load_external_data=False)
    reader = StreamingReader(samples, CALIBRATION_CHUNK, progress)
    # onnxruntime's quantizer logs advice ("consider pre-processing", opset upgrades) on the
    # root logger; our own preparation already did that work, so keep the console readable.
    root_logger = logging.getLogger()
    previous_level = root_logger.level
    root_logger.setLevel(logging.ERROR)
    try:
        qconfig = _qnn_config(config, float_path, model, reader, tensor_overrides, weight_ranges)
        extra = dict(qconfig.extra_options)
        extra["CalibStridedMinMax"] = CALIBRATION_CHUNK
        with atomic_path(qdq_path) as tmp, _indexed_renames():
            quantize_static(
                str(float_path),
                str(tmp),
                calibration_data_reader=reader,
                quant_format=qconfig.quant_format,
                op_types_to_quantize=qconfig.op_types_to_quantize,
                per_channel=qconfig.per_channel,
                activation_type=qconfig.activation_type,
                weight_type=qconfig.weight_type,
                nodes_to_exclude=qconfig.nodes_to_exclude,
                calibrate_method=qconfig.calibrate_method,
                calibration_providers=["CPUExecutionProvider"],
                extra_options=extra,
                calibration_cache_path=str(cache),
            )
            _fix_ir_version(tmp)
    except PipelineError:
        raise
    except Exception as exc:  # onnxruntime raises plain Exceptions of many kinds here
        raise ModelError(
            f"{config.model.name}: onnxruntime quantization failed: {type(exc).__name__}: {exc}",
            tip=f"See the prepared model {float_path}; report this model.",
        ) from exc
    finally:
        root_logger.setLevel(previous_level)


class _TensorIndex:
    """Which nodes read and write each tensor of the graph onnxruntime's quantizer is editing.

    Kept in step through the ONNXModel methods the QDQ quantizer edits the graph with (add a
    node, rename a node's input or output); any other change to the node list (a removal, a
    topological sort that rebuilds it) changes its length or its end nodes, and the index is
    rebuilt. Entries are candidates: each is checked against the node before it is renamed.
    """

    def __init__(self) -> None:
        self.model: Any = None
        self.mark: tuple[int, Any, Any] | None = None
        self.readers: dict[str, list[Any]] = {}
        self.writers: dict[str, list[Any]] = {}

    @staticmethod
    def _mark(model: Any) -> tuple[int, Any, Any]:
        nodes = model.graph.node
        return (len(nodes), nodes[0], nodes[-1]) if len(nodes) else (0, None, None)

    def _current(self, model: Any) -> bool:
        mark = self._mark(model)
        return (
            model is self.model
            and self.mark is not None
            and mark[0] == self.mark[0]
            and mark[1] is self.mark[1]
            and mark[2] is self.mark[2]
        )

    def sync(self, model: Any) -> None:
        if self._current(model):
            return
        self.model, self.readers, self.writers = model, {}, {}
        for node in model.graph.node:
            self._add(node)
        self.mark = self._mark(model)

    def _add(self, node: Any) -> None:
        for name in node.input:
            self.readers.setdefault(name, []).append(node)
        for name in node.output:
            self.writers.setdefault(name, []).append(node)

    def appended(self, model: Any, was_current: bool) -> None:
        """After a node was appended: index it, if the index held the graph before."""
        if was_current:
            self._add(model.graph.node[-1])
            self.mark = self._mark(model)


class _InitializerIndex:
    """Initializers by name, extended as the list grows at its end (what onnxruntime's
    quantizer does: it appends scales and zero points), rebuilt if the list changed otherwise.
    A hit is checked against the tensor's name; a miss falls back to onnxruntime's own scan."""

    def __init__(self) -> None:
        self.model: Any = None
        self.count = 0
        self.last: Any = None
        self.by_name: dict[str, Any] = {}

    def get(self, model: Any, name: str) -> Any:
        inits = model.graph.initializer
        unchanged = (
            model is self.model
            and len(inits) >= self.count
            and (self.count == 0 or inits[self.count - 1] is self.last)
        )
        if not unchanged:
            self.model, self.count, self.by_name = model, 0, {}
        for tensor in inits[self.count :]:
            self.by_name.setdefault(tensor.name, tensor)
        self.count = len(inits)
        self.last = inits[-1] if len(inits) else None
        tensor = self.by_name.get(name)
        if tensor is not None and tensor.name == name:
            return tensor
        return next((t for t in inits if t.name == name), None)


@contextlib.contextmanager
def _indexed_renames() -> Iterator[None]:
    """onnxruntime's quantizer renaming a tensor on the nodes an index names, not on all, and
    finding an initializer by name in a dict.

    Why: the QDQ quantizer renames each tensor it quantizes by calling a Python function on
    every node of the graph, and looks up each new DequantizeLinear's zero point by scanning
    every initializer: both quadratic, 0.4 s of a 400-node detector's quantization and over
    ten minutes for an unrolled 64-step BiLSTM (6,400 nodes). Same edits, same order
    (tests/test_quantizer.py compares the bytes); onnxruntime's methods are restored after.
    """
    from onnxruntime.quantization.onnx_model import ONNXModel

    names = (
        "add_node",
        "get_initializer",
        "replace_node_input",
        "replace_node_output",
        "replace_input_of_all_nodes",
        "replace_output_of_all_nodes",
    )
    saved = {name: ONNXModel.__dict__[name] for name in names}
    add_node = saved["add_node"]
    replace_input = saved["replace_node_input"].__func__
    replace_output = saved["replace_node_output"].__func__
    index = _TensorIndex()
    initializers = _InitializerIndex()

    def get_initializer(self: Any, name: str) -> Any:
        return initializers.get(self.model, name)

    def indexed_add_node(self: Any, node: Any) -> None:
        was_current = index._current(self.model)
        add_node(self, node)
        index.appended(self.model, was_current)

    def indexed_replace_node_input(node: Any, old: str, new: str) -> None:
        replace_input(node, old, new)
        index.readers.setdefault(new, []).append(node)

    def indexed_replace_node_output(node: Any, old: str, new: str) -> None:
        replace_output(node, old, new)
        index.writers.setdefault(new, []).append(node)

    def replace_input_of_all_nodes(self: Any, old: str, new: str) -> None:
        index.sync(self.model)
        for node in _distinct(index.readers.pop(old, [])):
            if old in node.input:
                indexed_replace_node_input(node, old, new)

    def replace_output_of_all_nodes(self: Any, old: str, new: str) -> None:
        index.sync(self.model)
        for node in _distinct(index.writers.pop(old, [])):
            if old in node.output:
                indexed_replace_node_output(node, old, new)

    ONNXModel.add_node = indexed_add_node  # type: ignore[method-assign]
    ONNXModel.get_initializer = get_initializer  # type: ignore[method-assign]
    ONNXModel.replace_node_input = staticmethod(indexed_replace_node_input)  # type: ignore[method-assign,assignment]
    ONNXModel.replace_node_output = staticmethod(indexed_replace_node_output)  # type: ignore[method-assign,assignment]
    ONNXModel.replace_input_of_all_nodes = replace_input_of_all_nodes  # type: ignore[method-assign]
    ONNXModel.replace_output_of_all_nodes = replace_output_of_all_nodes  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(ONNXModel, name, method)


def _distinct(nodes: list[Any]) -> list[Any]:
    """The candidates once each (a node renamed twice is listed twice), first listed first."""
    seen: set[int] = set()
    distinct = []
    for node in nodes:
        if id(node) not in seen:
            seen.add(id(node))
            distinct.append(node)
    return distinct


@dataclass(frozen=True)
class Overrides:
    """Per-tensor choices as onnxruntime takes them: TensorQuantOverrides, nodes left in float."""

    tensors: dict[str, list[dict[str, Any]]]
    float_nodes: list[str]


def _channel_axis(node: Any, weight: str) -> int:
    """The output-channel axis of a weight for its consumer (what per-channel scales follow)."""
    if node.op_type == "ConvTranspose":
        return 1
    if node.op_type == "Gemm":
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        return 0 if trans_b else 1
    if node.op_type == "MatMul":
        return 1  # [K, N]: one scale per output column
    return 0


def _grouped_transpose(node: Any) -> bool:
    """A ConvTranspose with groups: its weight [C_in, C_out / group, ...] has fewer scales on the
    channel axis than the bias has channels, and onnxruntime's bias quantization then fails
    ("operands could not be broadcast together with shapes (16,) (8,)", GTCRN's decoder).
    Such a weight stays per tensor."""
    group = next((a.i for a in node.attribute if a.name == "group"), 1)
    return node.op_type == "ConvTranspose" and group > 1


# The ops whose weights go per channel by default (int8, symmetric): the QNN HTP takes those
# per channel and computes them as the CPU does. A grouped ConvTranspose is not among them: its
# weight [C_in, C_out / group, ...] has fewer channel scales than its bias has channels. A
# MatMul's 2-D weight [K, N] goes per column (onnxruntime-qnn 2.7.0 runs it whole on the HTP;
# a MiniLM encoder at 8-bit weights: 14.9 dB per tensor, 24.5 dB per column).
PER_CHANNEL_OPS = {"Conv", "ConvTranspose", "Gemm", "MatMul"}


def per_channel_weights(model: Any, enabled: bool = True) -> dict[str, str]:
    """Weight -> "int8_per_channel" for every ``PER_CHANNEL_OPS`` weight (``per_channel``)."""
    if not enabled:
        return {}
    inits = {i.name: i for i in model.graph.initializer}
    chosen = {}
    for node in model.graph.node:
        if node.op_type not in PER_CHANNEL_OPS or len(node.input) < 2 or _grouped_transpose(node):
            continue
        weight = inits.get(node.input[1])
        if weight is None or len(weight.dims) < 2:
            continue
        if node.op_type == "MatMul" and len(weight.dims) != 2:
            continue  # a batched constant [..., K, N]: its columns are not on axis 1
        chosen[weight.name] = "int8_per_channel"
    return chosen


def _tensor_overrides(model: Any, tensors: dict[str, str], op_types: dict[str, str]) -> Overrides:
    """Config and mixed-precision choices -> onnxruntime overrides and float (fp16) nodes.

    ``*_per_channel`` gives a weight one symmetric scale per output channel (the HTP computes
    those exactly like the CPU; 16-bit weights it does not, FACTS §10). ``float16`` leaves the
    tensor unquantized: its producer and consumers stay float, and the HTP runs them in fp16.
    """
    from onnxruntime.quantization import QuantType

    weights = {i.name for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    consumers: dict[str, list[Any]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    known = set(producer) | {i.name for i in model.graph.input} | weights
    unknown = sorted(set(tensors) - known)
    if unknown:
        raise ModelError(
            f"quantization.overrides.tensors names tensor(s) {unknown[:5]} that the prepared "
            "model does not have.",
            tip="Use tensor names from the prepared model artifacts/build/<model>/buckets/*/float.onnx.",
        )
    result: dict[str, list[dict[str, Any]]] = {}
    float_nodes: list[str] = []

    def keep_float(nodes: list[Any]) -> None:
        float_nodes.extend(n.name for n in nodes if n.name and n.name not in float_nodes)

    for name, precision in tensors.items():
        if precision == "float16":
            keep_float([producer[name]] if name in producer else [])
            keep_float(consumers.get(name, []))
            continue
        qtype, _, layout = precision.partition("_per_")
        entry: dict[str, Any] = {"quant_type": getattr(QuantType, ORT_QUANT_TYPES[qtype])}
        if layout:
            users = consumers.get(name, [])
            if name not in weights or not users:
                raise ModelError(
                    f"Tensor {name!r} is given {precision}, but only weights can be quantized "
                    "per channel.",
                    tip=f"Use {qtype} for it in quantization.overrides.tensors.",
                )
            entry["symmetric"] = True
            if not _grouped_transpose(users[0]):
                entry["axis"] = _channel_axis(users[0], name)
        elif name in weights and qtype.startswith("int"):
            entry["symmetric"] = True  # QNN HTP wants signed weights symmetric
        result[name] = [entry]
    for node in model.graph.node:
        precision = op_types.get(node.op_type)
        if precision is None:
            continue
        if precision == "float16":
            keep_float([node])
            continue
        qtype = precision.partition("_per_")[0]
        for output in node.output:
            result.setdefault(output, [{"quant_type": getattr(QuantType, ORT_QUANT_TYPES[qtype])}])
    return Overrides(result, float_nodes)


def _fix_ir_version(path: Path) -> None:
    """onnx writes the newest IR version; keep one that the installed onnxruntime accepts."""
    import onnx

    model = onnx.load(str(path))
    if model.ir_version > 10:
        model.ir_version = 10
        onnx.save(model, str(path))
