"""Automatic mixed precision: raise to 16 bit the 8-bit tensors that cost the output most.

Why by output effect and not by each tensor's own error: in ppocr_rec every 8-bit weight
keeps 28-45 dB of its own signal, yet together they pull the output to 13 dB, and the
locally worst weights are not the ones that matter (cancellation in BN-folded 1x1 convs
amplifies some layers' error many times). So each 8-bit tensor is measured where it counts:
the float model is run with only that tensor quantized (a weight dequantized from the QDQ
model, an activation through a Q/DQ pair with the QDQ model's scale) on a few calibration
samples, and the output noise it adds is recorded. Noise from different tensors adds up
(to first order), so tensors are raised greedily, largest contribution first, until the
predicted output SNR clears the target with a safety margin. A re-quantization then checks
the real SNR on the held-out samples; later rounds raise more while it stays below the target
plus that margin (the HTP adds error of its own). Cost: one float session per candidate plus
at most ``MAX_ROUNDS`` re-quantizations.

Weights go to int16 (symmetric, as QNN HTP wants 16-bit weights), activations to uint16.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..core.accuracy import LABELS, worst_snr
from ..core.config import ModelConfig
from ..core.cpu import cpu_session
from ..core.errors import ModelError
from ..core.fileio import restored_after
from ..core.metrics import comparable, label_outputs, picked_outputs
from ..core.progress import Progress
from ..graph.qdq_htp import REST
from .bias_correction import corrected_float_bias, layers
from .evaluate import evaluate

ANALYSIS_SAMPLES = 8  # calibration samples the per-tensor noise is measured on
ANALYSIS_BYTES = 256 << 20  # ... fewer when their float64 reference outputs would pass this
# ... and no more than it takes for the outputs to hold this many values over them (two samples
# at least): a tensor's output noise over a million values is a steady figure, and each sample
# is a float run per candidate. A face detector at 736x1280 (883k output values a sample) ran 8
# a candidate, ~10 s each: the time budget was spent after 4 of its 63 tensors.
ANALYSIS_VALUES = 1 << 20
ANALYSIS_BUDGET_S = 60.0  # stop measuring candidates after this; the rest rank last
# Candidates measured side by side, a thread and a one-thread session each (gtcrn's 416
# activations: 16.5 s one at a time with onnxruntime's thread pool, see measuring_threads):
MAX_MEASURING_THREADS = 4
# ... when the weights and every activation of one float run fit in this together (shapes as
# inferred): a second session running at once then adds this much at most to the stage's peak.
PARALLEL_RUN_BYTES = 128 << 20
# Activations this small on average are measured in one session that switches each one's Q/DQ
# pair on in turn (small_activations), not a session each.
SWITCH_MAX_ELEMENTS = 4096
MAX_ROUNDS = 4  # re-quantizations after the first choice
SAFETY_DB = 3.0  # aim above the target: the noise model is approximate and the HTP adds its own
# Every 8-bit tensor at 16 bits is the most mixed precision can reach; when that ceiling is short
# of the target and this little above the 8-bit model, the per-tensor analysis (up to
# ANALYSIS_BUDGET_S) is skipped: what is short is not 8-bit rounding (PP-PicoDet: 0.7 dB at 8
# bits, raising tensors for 40 s gained 1 dB; the HTP judge's fp16 then reached 30 dB).
CEILING_GAIN_DB = 3.0
# A quantized model this far below the target on the CPU goes straight to fp16 on the HTP
# (pipeline.quantize.judge); a ceiling this far below it is skipped likewise, however much it
# gains: raising tensors one round at a time cannot reach the target (a Resemblyzer speaker
# encoder unrolled into 9,162 nodes: 3.8 dB at 8 bits, a ceiling of 7.7 dB, 4 rounds up to 16 tensors
# for 7.7 dB, ~20 min, before the judge's fp16 reached 39.6 dB).
HOPELESS_DB = 10.0
EIGHT_BIT = {2: "uint8", 3: "int8"}  # onnx TensorProto elem types
SIXTEEN_BIT = {4: "uint16", 5: "int16"}
# Weights the QNN HTP takes at 8 bits only, as (op type, input index): raised to int16, the QNN
# EP's layout pass rewrites the op to NHWC and then refuses it, so the whole candidate fails to
# build ("InstanceNormalization with domain com.ms.internal.nhwc was inserted ... but was not
# selected by that EP"; onnxruntime-qnn 2.7.0). Torchvision's FCOS head (GroupNorm exported as
# InstanceNormalization, its scale a vector of ones) had 40 such scales raised, its quantized
# model failed on the HTP and the judge fell back to fp16 at 23.3 dB. A LayerNormalization's
# scale at int16 is taken. Never candidates: 8-bit rounding of them stays.
EIGHT_BIT_ONLY_WEIGHTS = frozenset({("InstanceNormalization", 1)})


def raised_type(candidate: Candidate) -> str:
    """What a tensor is raised to: an activation to uint16, a weight to int16 (symmetric, as QNN
    HTP wants 16-bit weights) in its own layout, per channel when it is per channel now. The HTP
    computes some 16-bit weights differently from the CPU (dilated convolutions: FACTS §10);
    pipeline.quantize.judge checks the result there and moves the weights back to 8 bits per
    channel where it diverges."""
    if candidate.kind == "activation":
        return "uint16"
    return "int16_per_channel" if candidate.scale.size > 1 else "int16"


@dataclass(frozen=True)
class RaisedTensor:
    """A tensor raised to 16 bit, and the output SNR with only it at 8 bit (its share)."""

    name: str
    kind: str  # "weight" | "activation"
    to: str
    alone_snr_db: float


@dataclass(frozen=True)
class OutlierChannel:
    """An activation whose one channel peaks far above the others: with one scale per tensor,
    the others keep few steps, whatever the bit width (PP-PicoDet's LCNet backbone)."""

    tensor: str
    op: str
    channel: int
    peak: float  # the channel's largest |value| on the samples looked at
    median_peak: float  # the median channel's


@dataclass(frozen=True)
class OutputGrid:
    """An output whose own 16-bit grid is already short of the target: rounding the float
    outputs to it (its QuantizeLinear's scale) is that far from them, whatever the model
    computes inside (a wake-word score near 1e-6 on QNN's fixed 1/65536 Sigmoid scale)."""

    output: str
    scale: float
    snr_db: float  # the float outputs vs themselves rounded to the grid, pooled
    rms: float  # the float outputs' root mean square


@dataclass(frozen=True)
class PhaseLimit:
    """A Sin or Cos whose argument no precision of the NPU holds: a 16-bit grid over its
    input's range and fp16 at its peak both step a sizeable part of a radian, so its output is
    short of the target from the rounding of its phase alone (Fourier features of a [0, 1]
    coordinate at up to 2^14 pi: 0.74 and 32 rad)."""

    op: str
    node: str
    peak: float  # the largest |argument| its input's grid holds
    grid_step: float  # radians per step of a 16-bit grid over its input's range
    float16_step: float  # fp16's spacing at that peak (inf past fp16's largest value)
    snr_db: float  # its output from the finer of the two alone: 12 / step^2


@dataclass(frozen=True)
class Round:
    tensors: int
    snr_db: float


@dataclass(frozen=True)
class MixedPrecision:
    """What automatic mixed precision did, for the report."""

    target_snr_db: float
    before_snr_db: float
    after_snr_db: float
    tensors: list[RaisedTensor] = field(default_factory=list)
    rounds: list[Round] = field(default_factory=list)
    candidates: int = 0
    measured: int = 0
    analysis_samples: int = 0
    analysis_s: float = 0.0
    bucket: str = ""  # the bucket it was measured on (applied to all)
    ceiling_snr_db: float | None = None  # every 8-bit tensor at 16 bits (when it was measured)
    # Why 16 bits did not help, where it is outlier channels (the ceiling's diagnosis) ...
    outlier_channels: list[OutlierChannel] = field(default_factory=list)
    # ... or outputs whose own grid cannot hold them to the target
    output_grids: list[OutputGrid] = field(default_factory=list)
    # ... or periodic ops whose phase no precision holds
    phase_limits: list[PhaseLimit] = field(default_factory=list)

    @property
    def overrides(self) -> dict[str, str]:
        """The raised tensors as quantization overrides."""
        return {t.name: t.to for t in self.tensors}


@dataclass
class Candidate:
    """One 8-bit tensor of the QDQ model and what quantizing it alone does to the output."""

    name: str
    kind: str  # "weight" | "activation"
    scale: np.ndarray
    zero_point: np.ndarray
    elem: int
    quantized: np.ndarray | None = None  # weights: the stored integers
    axis: int = 1
    noise: dict[str, float] = field(default_factory=dict)  # output -> added noise power

    def dequantized(self) -> np.ndarray:
        """The weight as the QDQ model sees it."""
        q = np.asarray(self.quantized, dtype=np.float64)
        shape = [1] * q.ndim
        if self.scale.ndim == 1 and self.scale.size > 1 and q.ndim:
            shape[self.axis] = -1
        zero = self.zero_point.astype(np.float64).reshape(shape)
        return ((q - zero) * self.scale.astype(np.float64).reshape(shape)).astype(np.float32)


def candidates(qdq: Any, elems: dict[int, str] = EIGHT_BIT) -> list[Candidate]:
    """Every 8-bit weight (but those the HTP takes at 8 bits only: ``EIGHT_BIT_ONLY_WEIGHTS``)
    and activation of a QDQ model, with its scale and zero point."""
    from onnx import numpy_helper

    inits = {i.name: i for i in qdq.graph.initializer}

    def value(name: str) -> np.ndarray | None:
        return numpy_helper.to_array(inits[name]) if name in inits else None

    found: dict[str, Candidate] = {}
    # A QuantizeLinear of a DequantizeLinear's output requantizes (pipeline.graph.qdq_htp): not
    # a float tensor of its own. Nor is an int16 weight split into two int8 ones an 8-bit one.
    requantized = {o for n in qdq.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    eight_bit_only = {
        node.input[index]
        for node in qdq.graph.node
        for op, index in EIGHT_BIT_ONLY_WEIGHTS
        if node.op_type == op and len(node.input) > index
    }
    split = {name.removesuffix(REST) for name in inits if name.endswith(REST)}
    split |= {name + REST for name in split}
    for node in qdq.graph.node:
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear") or len(node.input) < 3:
            continue
        scale, zero = value(node.input[1]), value(node.input[2])
        if scale is None or zero is None or inits[node.input[2]].data_type not in elems:
            continue
        elem = inits[node.input[2]].data_type
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        source = node.input[0]
        if node.op_type == "QuantizeLinear" and source not in inits and source not in requantized:
            # onnxruntime renames a quantized graph output's producer to "<name>_QuantizeLinear_Input".
            name = node.input[0].removesuffix("_QuantizeLinear_Input")
            found.setdefault(name, Candidate(name, "activation", scale, zero, elem))
        elif (
            node.op_type == "DequantizeLinear"
            and node.input[0] in inits.keys() - split
            and node.output[0] not in eight_bit_only
        ):
            name = node.input[0].removesuffix("_quantized")
            quantized = value(node.input[0])
            found.setdefault(name, Candidate(name, "weight", scale, zero, elem, quantized, axis))
    return list(found.values())


def _with_fake_quant(
    model: Any, cand: Candidate, means: dict[str, np.ndarray] | None = None
) -> Any:
    """A copy of the float model where only ``cand`` is quantized as in the QDQ model (a weight
    with its layer's bias corrected as the QDQ model's is, when ``means`` are given)."""
    import onnx
    from onnx import helper, numpy_helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    if cand.kind == "weight":
        quantized = cand.dequantized()
        bias = corrected_float_bias(model, cand.name, quantized, means) if means else None
        for init in graph.initializer:
            if init.name == cand.name:
                init.CopyFrom(numpy_helper.from_array(quantized, cand.name))
            elif bias is not None and init.name == bias[0]:
                init.CopyFrom(numpy_helper.from_array(bias[1], bias[0]))
        return out
    scale = numpy_helper.from_array(cand.scale.astype(np.float32), f"{cand.name}__fq_scale")
    zero = numpy_helper.from_array(cand.zero_point, f"{cand.name}__fq_zero")
    graph.initializer.extend([scale, zero])
    outputs = {o.name for o in graph.output}
    if cand.name in outputs:  # keep the output's name: the producer writes a new one
        source, target = f"{cand.name}__fq_in", cand.name
        for node in graph.node:
            for i, name in enumerate(node.output):
                if name == cand.name:
                    node.output[i] = source
    else:
        source, target = cand.name, f"{cand.name}__fq_out"
        for node in graph.node:
            for i, name in enumerate(node.input):
                if name == cand.name:
                    node.input[i] = target
    kwargs = {"axis": cand.axis} if cand.scale.ndim else {}
    pair = [
        helper.make_node(
            "QuantizeLinear", [source, scale.name, zero.name], [f"{cand.name}__fq_q"], **kwargs
        ),
        helper.make_node(
            "DequantizeLinear", [f"{cand.name}__fq_q", scale.name, zero.name], [target], **kwargs
        ),
    ]
    # Right after the producer (or first, for a graph input): the order stays topological.
    position = next((i + 1 for i, node in enumerate(graph.node) if source in node.output), 0)
    nodes = list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes[:position] + pair + nodes[position:])
    return out


SWITCH = "__fq_which"  # the switchable model's input: which activation is quantized (-1: none)


def _switchable(model: Any, cands: list[Candidate]) -> Any:
    """A copy of the float model where each activation of ``cands`` passes through a Q/DQ pair
    with the QDQ model's scale only when ``SWITCH`` (an overridable initializer, -1 by
    default) holds its index in ``cands``: ``Where`` picks the float tensor itself otherwise,
    bit for bit. One session then measures every activation: no model copied, serialized and
    built per activation (``small_activations`` says where that pays)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    outputs = {o.name for o in graph.output}
    inputs = {i.name for i in graph.input}
    which = numpy_helper.from_array(np.array(-1, dtype=np.int64), SWITCH)
    graph.initializer.append(which)
    graph.input.append(helper.make_tensor_value_info(SWITCH, TensorProto.INT64, []))
    after: dict[str, list[Any]] = {}  # tensor -> its switch's nodes, placed after its producer
    renamed_outputs: dict[str, str] = {}
    renamed_inputs: dict[str, str] = {}
    for index, cand in enumerate(cands):
        name = cand.name
        scale = numpy_helper.from_array(cand.scale.astype(np.float32), f"{name}__fq_scale")
        zero = numpy_helper.from_array(cand.zero_point, f"{name}__fq_zero")
        number = numpy_helper.from_array(np.array(index, dtype=np.int64), f"{name}__fq_index")
        graph.initializer.extend([scale, zero, number])
        if name in outputs:  # keep the output's name: the producer writes a new one
            source, target = f"{name}__fq_in", name
            renamed_outputs[name] = source
        else:
            source, target = name, f"{name}__fq_out"
            renamed_inputs[name] = target
        kwargs = {"axis": cand.axis} if cand.scale.ndim else {}
        after[name] = [
            helper.make_node("Equal", [SWITCH, number.name], [f"{name}__fq_on"]),
            helper.make_node(
                "QuantizeLinear", [source, scale.name, zero.name], [f"{name}__fq_q"], **kwargs
            ),
            helper.make_node(
                "DequantizeLinear",
                [f"{name}__fq_q", scale.name, zero.name],
                [f"{name}__fq_dq"],
                **kwargs,
            ),
            helper.make_node("Where", [f"{name}__fq_on", f"{name}__fq_dq", source], [target]),
        ]
    nodes = [n for name in after if name in inputs for n in after[name]]
    for node in graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = renamed_inputs.get(name, name)
        produced = list(node.output)
        for i, name in enumerate(produced):
            node.output[i] = renamed_outputs.get(name, name)
        nodes.append(node)
        nodes.extend(n for name in produced if name not in inputs for n in after.get(name, []))
    copies = [onnx.NodeProto() for _ in nodes]
    for copy, node in zip(copies, nodes, strict=True):
        copy.CopyFrom(node)
    del graph.node[:]
    graph.node.extend(copies)
    return out


def _overridable(model: Any, names: set[str]) -> Any:
    """A copy of ``model`` whose initializers in ``names`` are also graph inputs: a run may
    feed other values for them (onnxruntime's overridable initializers), so one session
    measures every weight candidate. Building a session per candidate cost ~1.6 s of the
    ~1.8 s each one took on a 90 MB encoder (the model copied, serialized and optimized)."""
    import onnx
    from onnx import helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    listed = {i.name for i in out.graph.input}
    for init in out.graph.initializer:
        if init.name in names and init.name not in listed:
            out.graph.input.append(
                helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
            )
    return out


def _weight_feeds(
    model: Any, cand: Candidate, means: dict[str, np.ndarray] | None
) -> dict[str, np.ndarray]:
    """The values that quantize the weight ``cand`` alone: the weight as the QDQ model
    rounds it, and its layer's bias corrected as the QDQ model's is (``means`` given)."""
    quantized = cand.dequantized()
    feeds = {cand.name: quantized}
    bias = corrected_float_bias(model, cand.name, quantized, means) if means else None
    if bias is not None:
        feeds[bias[0]] = bias[1]
    return feeds


def _session(model: Any, threads: int = 0) -> Any:
    # Basic optimizations only: sessions are built per candidate, and their build time counts.
    return cpu_session(model, optimize=False, threads=threads)


def measuring_threads(model: Any) -> int:
    """How many candidates are measured side by side: one a core (a session of one thread
    each; onnxruntime runs without the GIL) when ``model``'s weights and activations take
    ``PARALLEL_RUN_BYTES`` at most, else one (two float runs of a 1024x2048 segmenter, or two
    sessions of a 400 MB encoder, at once would double the stage's peak memory; so would a model
    whose shapes are not known)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    size = activation_bytes(model)
    if size is None:
        return 1
    size += sum(i.ByteSize() for i in model.graph.initializer)
    if size > PARALLEL_RUN_BYTES:
        return 1
    return max(1, min(cores or 1, MAX_MEASURING_THREADS))


def small_activations(model: Any, cands: list[Candidate]) -> bool:
    """Whether ``cands`` (activations) hold ``SWITCH_MAX_ELEMENTS`` values or fewer on average
    (inferred shapes; unknown ones: not small): where they do, one switchable session
    (``_switchable``) measures them all, since a run computing every Q/DQ pair costs less than
    a model and a session per activation. Measured (seconds, a model each -> switched, 2
    threads): gtcrn's 411 activations of 744 values 6.0 -> 3.3, a DTLN's 75 0.31 -> 0.17, a
    tiny DistilBERT's 70 0.20 -> 0.14; but a detector's 171 of 45,000 values 4.2 -> 8.6 and
    SqueezeNet's 42 of 108,000 0.9 -> 1.9: there the pairs computed on every run cost more."""
    from ..graph.edit import value_shape

    graph = model.graph
    shapes = {v.name: value_shape(v) for v in [*graph.value_info, *graph.input, *graph.output]}
    total = 0
    for cand in cands:
        shape = shapes.get(cand.name)
        if shape is None:
            return False
        total += math.prod(shape)
    return total <= SWITCH_MAX_ELEMENTS * len(cands)


def activation_bytes(model: Any) -> int | None:
    """The bytes of every tensor a run of ``model`` computes, from its inferred shapes (None
    when one of them is missing or not static)."""
    from onnx import helper

    from ..graph.edit import value_shape

    known = {v.name: v for v in (*model.graph.value_info, *model.graph.output)}
    total = 0
    for name in (o for n in model.graph.node for o in n.output if o):
        shape = value_shape(known[name]) if name in known else None
        if shape is None:
            return None
        elem = known[name].type.tensor_type.elem_type
        total += math.prod(shape) * np.dtype(helper.tensor_dtype_to_np_dtype(elem)).itemsize
    return total


def _values(value: Any) -> np.ndarray:
    """An output as float64 values (a sequence of score maps: its values in key order)."""
    return np.asarray(comparable(value)[1], np.float64)


def _noise(
    session: Any,
    feeds: list[dict[str, np.ndarray]],
    refs: list[dict[str, np.ndarray]],
    overrides: dict[str, np.ndarray] | None = None,
):
    names = list(refs[0])
    noise = dict.fromkeys(names, 0.0)
    for sample, ref in zip(feeds, refs, strict=True):
        run_feeds = {**sample, **overrides} if overrides else sample
        for name, got in zip(names, session.run(names, run_feeds), strict=True):
            expected, values = ref[name].reshape(-1), np.asarray(comparable(got)[1]).reshape(-1)
            for start in range(0, values.size, _CHUNK):  # no float64 copy of a whole map
                err = expected[start : start + _CHUNK] - values[start : start + _CHUNK]
                # (einsum, not np.dot: OpenBLAS's own threads in dot, called from two
                # measuring threads at once, took gtcrn's analysis from 6.0 to 11.7 s)
                noise[name] += float(np.einsum("i,i->", err, err))
    return noise


def measure(
    float_path: Path,
    qdq_path: Path,
    samples: Iterable[dict[str, np.ndarray]],
    elems: dict[int, str] = EIGHT_BIT,
    kinds: tuple[str, ...] = ("weight", "activation"),
    means: dict[str, np.ndarray] | None = None,
) -> tuple[list[Candidate], dict[str, float], dict[str, float], dict[str, Any]]:
    """Per quantized tensor of the ``elems`` types (8-bit by default), the output noise it adds
    alone; plus the outputs' signal and the QDQ model's noise. ``means`` (layer inputs' channel
    means) apply the bias correction the QDQ model has to each weight measured alone."""
    import onnx

    started = time.perf_counter()
    feeds = [dict(s) for _, s in zip(range(ANALYSIS_SAMPLES), samples, strict=False)]
    float_model = onnx.load(str(float_path))
    reference = _session(float_model)
    names = [o.name for o in reference.get_outputs()]
    first = dict(zip(names, reference.run(names, feeds[0]), strict=True)) if feeds else {}
    # Labels (strings, class ids, also cast to float) have no noise power; the scores they
    # come from do.
    labels = label_outputs(float_path) | picked_outputs(float_path)  # rows picked by rank: ties
    names = (
        [n for n in names if comparable(first[n])[0] != LABELS and n not in labels]
        if first
        else names
    )
    # Each sample's reference outputs stay in memory (float64) for every candidate: a 21-class
    # 1024x2048 map is 352 MB a sample, and 8 of them took the process to 4.3 GiB. As many
    # samples as ANALYSIS_BYTES holds, one at least (2M pixels of a segmenter's map), and as
    # ANALYSIS_VALUES needs, two at least.
    values = sum(int(np.asarray(first[n]).size) for n in names) if first else 0
    if values:
        wanted = max(2, -(-ANALYSIS_VALUES // values))
        feeds = feeds[: max(1, min(ANALYSIS_BYTES // (8 * values), wanted))]
    refs = [
        {n: _values(v) for n, v in zip(names, reference.run(names, f), strict=True)} for f in feeds
    ]
    signal = dict.fromkeys(names, 0.0)
    for ref in refs:
        for name in names:
            signal[name] += float(np.sum(ref[name] ** 2))
    qdq_noise = _noise(_session(str(qdq_path)), feeds, refs)
    known = {o for n in float_model.graph.node for o in n.output}
    known |= {i.name for i in float_model.graph.input} | {
        i.name for i in float_model.graph.initializer
    }
    found = [
        c
        for c in candidates(onnx.load(str(qdq_path)), elems)
        if c.name in known and c.kind in kinds
    ]
    measured = 0
    initializers = {i.name for i in float_model.graph.initializer}
    weights = {c.name for c in found if c.kind == "weight" and c.name in initializers}
    if weights and means:
        weights |= {layer.bias for layer in layers(float_model) if layer.weight in weights}
    threads = measuring_threads(float_model)
    one = 1 if threads > 1 else 0  # each session's own pool: one thread when they run side by side
    shared = _session(_overridable(float_model, weights), one) if weights else None

    activations = [c for c in found if c.kind == "activation"]
    switch = {c.name: k for k, c in enumerate(activations)}
    switched = None
    if activations and small_activations(float_model, activations):
        try:
            switched = _session(_switchable(float_model, activations), one)
        except ModelError:  # onnxruntime refused the switched model: a model each, as before
            switched = None

    def noise_of(cand: Candidate) -> dict[str, float]:
        if cand.name in weights:
            return _noise(shared, feeds, refs, _weight_feeds(float_model, cand, means))
        if switched is not None and cand.name in switch:
            on = {SWITCH: np.array(switch[cand.name], dtype=np.int64)}
            return _noise(switched, feeds, refs, on)
        return _noise(_session(_with_fake_quant(float_model, cand, means), one), feeds, refs)

    with (
        Progress(len(found), "mixed precision: output noise per tensor", "tensor") as progress,
        ThreadPoolExecutor(threads, thread_name_prefix="measure") as pool,
    ):
        waiting = iter(found)
        running: dict[Future, Candidate] = {}
        over_budget = False
        while True:
            while not over_budget and len(running) < 2 * threads:
                cand = next(waiting, None)
                if cand is None:
                    break
                if time.perf_counter() - started > ANALYSIS_BUDGET_S:
                    over_budget = True
                    progress.status(f"time budget spent after {measured} of {len(found)}")
                    break
                running[pool.submit(noise_of, cand)] = cand
            if not running:
                break
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                running.pop(future).noise = future.result()
                measured += 1
                progress.update(1)
                if measured % 10 == 0 or measured == len(found):
                    progress.status(f"tensor {measured} of {len(found)}")
    stats = {
        "threads": threads,
        "samples": len(feeds),
        "candidates": len(found),
        "measured": measured,
        "seconds": time.perf_counter() - started,
    }
    return found, signal, qdq_noise, stats


def _db(signal: float, noise: float) -> float:
    if noise <= 0.0:
        return float("inf")
    return float(10.0 * np.log10(max(signal, 1e-30) / noise))


def choose(
    found: list[Candidate], signal: dict[str, float], target_db: float
) -> tuple[list[Candidate], int]:
    """The shortest prefix, largest contribution first, predicted to reach ``target_db``.

    Returns the ranked candidates (measured ones with a contribution, biggest first) and how
    many of them to raise. The prediction is additive: the noise left after raising a set is
    the sum of the others' contributions. Interactions and the 16-bit tensors' own noise are
    not modelled (a residual from subtracting one huge contribution from the QDQ model's noise
    would be mostly measurement error); the held-out check after re-quantizing covers them.
    """
    goal = {o: signal[o] * 10.0 ** (-target_db / 10.0) for o in signal}
    ranked = sorted(
        (c for c in found if any(v > 0 for v in c.noise.values())),
        key=lambda c: max(c.noise.get(o, 0.0) / max(goal[o], 1e-30) for o in goal),
        reverse=True,
    )
    remaining = {o: sum(c.noise.get(o, 0.0) for c in ranked) for o in signal}
    for count, cand in enumerate(ranked, start=1):
        for o in signal:
            remaining[o] -= cand.noise.get(o, 0.0)
        if all(max(remaining[o], 0.0) <= goal[o] for o in signal):
            return ranked, count
    return ranked, len(ranked)


def keep_raising(rounds: list[Round], before_db: float) -> bool:
    """Whether a larger round is worth its re-quantization: not after two rounds in a row
    below the 8-bit model, when raising what the analysis ranked first costs instead of gains
    (the ranking does not predict it: a PP-OCRv5 detector lost 0.3-0.5 dB at 1, 2, 4 and 8
    tensors, its rounds ~13 s each at 960x960; the HTP judge's fp16 candidate came next)."""
    return len(rounds) < 2 or any(r.snr_db >= before_db for r in rounds[-2:])


def ceiling_rules_out(before_db: float, ceiling_db: float, target_db: float) -> bool:
    """Whether raising tensors is not worth a per-tensor analysis: every 8-bit tensor at 16 bits
    (``ceiling_db``) is short of ``target_db`` and gains under ``CEILING_GAIN_DB`` over the model
    as it is (``before_db``), or is ``HOPELESS_DB`` short."""
    return ceiling_db < target_db and (
        ceiling_db < before_db + CEILING_GAIN_DB or ceiling_db < target_db - HOPELESS_DB
    )


def raise_precision(
    config: ModelConfig,
    float_path: Path,
    qdq_path: Path,
    heldout: Path,
    calibration: Iterable[dict[str, np.ndarray]],
    base_overrides: dict[str, str],
    requantize: Callable[[dict[str, str]], Any],
    means: dict[str, np.ndarray] | None = None,
) -> MixedPrecision:
    """Re-quantize with the costliest 8-bit tensors raised while the worst SNR is short."""
    target = config.quantization.target_snr_db
    before = worst_snr(evaluate(float_path, qdq_path, heldout))
    summary = MixedPrecision(target, before, before)
    if before >= target:
        return summary
    import onnx

    base = onnx.load(str(qdq_path))
    eight_bit = candidates(base)
    every = {c.name: raised_type(c) for c in eight_bit}
    ceiling = float("nan")
    if every:
        # The base back as it was: a copy where re-quantizing the same choices (deterministic)
        # did the same (a 416x416 detector's quantize phase, side by side: 4.13 and 4.51 s
        # re-quantizing, 3.95 and 4.02 s copying).
        with restored_after(qdq_path):
            requantize({**every, **base_overrides})
            ceiling = worst_snr(evaluate(float_path, qdq_path, heldout))
        summary = dataclasses.replace(summary, ceiling_snr_db=ceiling)
        if ceiling_rules_out(before, ceiling, target):
            outliers = outlier_channels(float_path, calibration)
            grids = output_grids(float_path, qdq_path, heldout, target)
            return dataclasses.replace(
                summary,
                outlier_channels=outliers,
                output_grids=grids,
                phase_limits=phase_limits(base, target),
            )
    found, signal, _, stats = measure(float_path, qdq_path, calibration, means=means)
    summary = dataclasses.replace(
        summary,
        candidates=stats["candidates"],
        measured=stats["measured"],
        analysis_samples=stats["samples"],
        analysis_s=stats["seconds"],
    )
    ranked, count = choose(found, signal, target + SAFETY_DB)
    # Candidates the time budget left unmeasured come last, in graph order.
    ranked += [c for c in found if not c.noise]
    if not ranked:
        return summary

    def overrides_for(group: list[Candidate]) -> dict[str, str]:
        extra = dict(base_overrides)
        for cand in group:
            extra.setdefault(cand.name, raised_type(cand))
        return extra

    best: tuple[float, int] = (before, 0)
    rounds = []
    count = max(count, 1)
    with Progress(MAX_ROUNDS, "mixed precision: re-quantize", "round") as progress:
        progress.status(f"{before:.1f} dB at 8 bits, target {target:g} dB")
        for number in range(1, MAX_ROUNDS + 1):
            progress.status(f"round {number}: {count} tensor(s) at 16 bits")
            requantize(overrides_for(ranked[:count]))
            after = worst_snr(evaluate(float_path, qdq_path, heldout))
            rounds.append(Round(count, after))
            progress.update(1)
            progress.status(f"round {number}: {count} tensor(s) at 16 bits -> {after:.1f} dB")
            if after > best[0]:
                best = (after, count)
            if after >= target + SAFETY_DB or count >= len(ranked):
                break
            if not keep_raising(rounds, before):
                progress.status(f"{len(rounds)} rounds below the 8-bit model: stopped")
                break
            count = min(len(ranked), count * 2)
        raised = ranked[: best[1]]
        if best[0] < target <= ceiling:
            # The rounds ended short where every 8-bit tensor at 16 bits (measured above) is
            # not: that model, then. The noise was spread over more tensors than the rounds
            # could raise (a 736x1280 face detector: 24 of 63 weights, 23.7 dB; all, 37.6 dB).
            progress.status(f"every 8-bit tensor at 16 bits: {ceiling:.1f} dB, kept")
            requantize({**every, **base_overrides})
            rounds.append(Round(len(every), ceiling))
            best = (ceiling, len(every))
            measured_as = {c.name: c for c in found}
            raised = [measured_as.get(c.name, c) for c in eight_bit]
        elif best[1] != count:  # leave the best variant on disk
            requantize(overrides_for(raised))
    total = {o: max(signal[o], 1e-30) for o in signal}
    return dataclasses.replace(
        summary,
        after_snr_db=best[0],
        tensors=[
            RaisedTensor(
                c.name,
                c.kind,
                raised_type(c),
                min((_db(total[o], c.noise[o]) for o in c.noise), default=float("nan")),
            )
            for c in raised
        ],
        rounds=rounds,
    )


OUTLIER_RATIO = 32.0  # a channel peaking this many times the median channel is an outlier
OUTLIER_SAMPLES = 2
_CHUNK = 1 << 20  # output values compared or rounded to their grid at a time


def output_grids(
    float_path: Path, qdq_path: Path, heldout: Path, target_db: float
) -> list[OutputGrid]:
    """The outputs of the QDQ model whose per-tensor grid alone (the float outputs on the
    held-out samples rounded to it) is below ``target_db``: no precision inside can help."""
    import onnx
    from onnx import numpy_helper

    from ..core.metrics import power_snr_db
    from .evaluate import KeptRuns, iter_samples

    model = onnx.load(str(qdq_path), load_external_data=False)
    inits = {i.name: i for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    grids: dict[str, tuple[float, int, np.dtype]] = {}
    for output in model.graph.output:
        dq = producer.get(output.name)
        if dq is None or dq.op_type != "DequantizeLinear" or len(dq.input) < 3:
            continue
        scale, zero = inits.get(dq.input[1]), inits.get(dq.input[2])
        if scale is None or zero is None:
            continue
        scale_value, zero_value = numpy_helper.to_array(scale), numpy_helper.to_array(zero)
        if scale_value.size == 1:
            grids[output.name] = (float(scale_value), int(zero_value), zero_value.dtype)
    if not grids:
        return []
    runs = KeptRuns(float_path)
    names = [n for n in runs.output_names() if n in grids]
    powers = {n: [0.0, 0.0, 0] for n in names}
    for feeds in iter_samples(heldout):
        for name, value in runs.run_named(names, feeds).items():
            scale, zero, dtype = grids[name]
            info = np.iinfo(dtype)
            flat = np.asarray(value).reshape(-1)
            total = powers[name]
            # a chunk at a time: a 21-class 1024x2048 map is 44M values, and each float64
            # temporary of it 352 MB (1.4 GB at once before)
            for start in range(0, flat.size, _CHUNK):
                exact = flat[start : start + _CHUNK].astype(np.float64)
                steps = np.clip(np.round(exact / scale) + zero, info.min, info.max)
                total[0] += float(np.sum(exact**2))
                total[1] += float(np.sum(((steps - zero) * scale - exact) ** 2))
            total[2] += flat.size
    found = []
    for name, (signal, noise, count) in powers.items():
        db = power_snr_db(signal, noise)
        if count and db < target_db:
            found.append(OutputGrid(name, grids[name][0], db, float(np.sqrt(signal / count))))
    return found


PERIODIC_OPS = ("Sin", "Cos")
FLOAT16_MAX = 65504.0


def phase_limits(qdq: Any, target_db: float, limit: int = 3) -> list[PhaseLimit]:
    """The Sin and Cos ops of a QDQ model whose phase rounding alone keeps their output under
    ``target_db`` at the finer of a 16-bit grid over their input's range and fp16 at its peak,
    worst first. A phase error e moves sin by cos(phase) e: noise power step^2 / 24 against a
    signal power of 1/2, so 12 / step^2."""
    from onnx import numpy_helper

    inits = {i.name: i for i in qdq.graph.initializer}
    producers = {o: n for n in qdq.graph.node for o in n.output}
    found = []
    for node in qdq.graph.node:
        source = producers.get(node.input[0]) if node.op_type in PERIODIC_OPS else None
        if source is None or source.op_type != "DequantizeLinear" or len(source.input) < 3:
            continue
        if source.input[1] not in inits or source.input[2] not in inits:
            continue
        scale = numpy_helper.to_array(inits[source.input[1]]).astype(np.float64)
        zero = numpy_helper.to_array(inits[source.input[2]])
        if scale.size != 1 or not np.issubdtype(zero.dtype, np.integer):
            continue
        info = np.iinfo(zero.dtype)
        offset = int(zero.reshape(-1)[0])
        low, high = (float(scale.item()) * (v - offset) for v in (int(info.min), int(info.max)))
        peak = max(abs(low), abs(high))
        grid_step = (high - low) / 65535
        if peak > FLOAT16_MAX:
            float16_step = float("inf")  # past fp16's largest value
        else:
            float16_step = 2.0 ** (np.floor(np.log2(peak)) - 10) if peak >= 2.0**-14 else 2.0**-24
        step = min(grid_step, float16_step)
        db = 10 * np.log10(12 / step**2) if step > 0 else float("inf")
        if db < target_db:
            found.append(
                PhaseLimit(
                    node.op_type,
                    node.name or node.output[0],
                    peak,
                    grid_step,
                    float16_step,
                    float(db),
                )
            )
    found.sort(key=lambda p: p.snr_db)
    return found[:limit]


def outlier_channels(
    float_path: Path, samples: Iterable[dict[str, np.ndarray]], limit: int = 3
) -> list[OutlierChannel]:
    """The activations (rank >= 3, 8 channels or more on axis 1) whose largest channel peak
    is ``OUTLIER_RATIO`` times the median channel's or more, worst first, on the first
    ``OUTLIER_SAMPLES`` samples. The per-channel peaks are reduced in the graph.

    PP-PicoDet-XS: its first Conv's channel 5 peaks at 1539 where the median channel peaks at
    11, and nearly every pointwise Conv of its backbone has such a channel ahead of a
    HardSwish (not scale-equivariant, so no channel rescaling moves it): a uint16 scale for
    1539 leaves the median channel ~500 steps, and the error compounds layer by layer (0.7 dB
    with every tensor at 16 bits). Such a model runs in fp16 on the HTP.
    """
    import onnx

    from ..calibration.ranges import channel_peaks

    model = onnx.load(str(float_path))
    graph = model.graph
    producers = {o: n for n in graph.node for o in n.output}
    shapes = {
        v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in [*graph.value_info, *graph.output]
        if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    }
    watched = [n for n, s in shapes.items() if len(s) >= 3 and s[1] >= 8 and n in producers]
    if not watched:
        return []
    ranks = {name: len(shapes[name]) for name in watched}
    measured = channel_peaks(model, ranks, samples, OUTLIER_SAMPLES)
    peaks = [measured[name] for name in watched if name in measured]
    found = []
    for name, per_channel in zip(watched, peaks, strict=False):
        median = float(np.median(per_channel))
        channel = int(np.argmax(per_channel))
        top = float(per_channel[channel])
        if median > 0 and top >= OUTLIER_RATIO * median:
            found.append(OutlierChannel(name, producers[name].op_type, channel, top, median))
    found.sort(key=lambda o: o.peak / o.median_peak, reverse=True)
    return found[:limit]
