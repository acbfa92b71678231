"""Exact rewrites of legacy ops (opset <= 10) whose meaning the onnx version converter loses.

The converter maps Upsample (opset 7/9) and Resize (opset 10) to an opset-11+ Resize with the
*default* coordinate transformation (half_pixel) and nearest rounding (round_prefer_floor),
while onnxruntime runs the legacy ops with asymmetric coordinates, floor for upsampling and ceil
for downsampling (measured against onnxruntime 1.31, see tests/test_legacy.py). A bilinear
upsampling segmenter's prepared model was 28 dB from its source for that alone. It has no
adapter at all for the experimental ``Crop``.

So these ops are rewritten *before* the opset upgrade into the opset-21 ops that compute the
same thing, parked in a private domain (``PINNED_DOMAIN``) that the converter passes through
untouched, and put back into the default domain right after it (``restore_pinned_ops``).

Also here: ``fold_pad_into_pool``, for the ``Pad(value=-FLT_MAX) -> MaxPool(VALID)`` pairs that
old converters emit for TF/Keras "SAME" pooling. The pad value is never the maximum of a window
(each window holds a real value), but as a quantized activation it stretches the range to 3e38
and every real value rounds to one step; MaxPool's own pads mean exactly the same thing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from . import edit
from . import transforms as t
from .edit import Change

PINNED_DOMAIN = "pipeline.pinned"
_DEFAULT = ("", "ai.onnx")
_ATTR = onnx.helper.get_attribute_value


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: _ATTR(a) for a in node.attribute}


def text_attribute(value: Any, default: str) -> str:
    """A string attribute as text (onnx gives bytes); ``default`` when it is unset."""
    if value is None:
        return default
    return value.decode() if isinstance(value, bytes) else str(value)


def _constant(model: onnx.ModelProto, name: str) -> np.ndarray | None:
    inits = edit.initializers_by_name(model.graph)
    if name in inits:
        return numpy_helper.to_array(inits[name])
    for node in model.graph.node:
        if node.op_type == "Constant" and name in node.output:
            return t.constant_value(node)
    return None


def _shrink_indices(size: int, scale: float) -> np.ndarray:
    """The input rows onnxruntime's legacy nearest picks when an axis of ``size`` shrinks by
    ``scale``: ceil(i / scale) in float32, clamped to the axis (``is_down_sampling``)."""
    out = int(np.float32(size) * np.float32(scale))
    picked = np.ceil(np.arange(out, dtype=np.float32) / np.float32(scale)).astype(np.int64)
    return np.minimum(picked, size - 1)


def _resize_nodes(
    x: str,
    y: str,
    mode: str,
    scales: np.ndarray | None,
    scales_name: str,
    shape: tuple[int, ...] | None,
    base: str,
    new_init: Callable[[np.ndarray, str], str],
    fresh: Callable[[str], str],
) -> tuple[list[onnx.NodeProto], str]:
    """Opset-21 node(s) computing what onnxruntime computes for the legacy op.

    Linear: Resize with asymmetric coordinates. Nearest: onnxruntime rounds per axis, floor
    where it grows and ceil where it shrinks; the QNN HTP backend takes nearest/floor but
    refuses nearest/ceil (it would fall back to the CPU), so shrunk axes become a Gather of
    the rows onnxruntime picks (static shapes), grown axes a Resize with floor. Nearest
    sampling is separable, so the two in sequence are exact.
    """
    make = onnx.helper.make_node
    if mode in ("linear", "bilinear"):
        node = make(
            "Resize",
            [x, "", scales_name],
            [y],
            name=base,
            domain=PINNED_DOMAIN,
            mode="linear",
            coordinate_transformation_mode="asymmetric",
        )
        return [node], "linear, asymmetric"

    def nearest(src: str, dst: str, scales_in: str, rounding: str, name: str) -> onnx.NodeProto:
        return make(
            "Resize",
            [src, "", scales_in],
            [dst],
            name=name,
            domain=PINNED_DOMAIN,
            mode="nearest",
            coordinate_transformation_mode="asymmetric",
            nearest_mode=rounding,
        )

    if scales is None or np.all(scales >= 1.0):
        why = "" if scales is not None else " (scales not constant: upsampling assumed)"
        return [nearest(x, y, scales_name, "floor", base)], "nearest, asymmetric, floor" + why
    grows = bool(np.any(scales > 1.0))
    if shape is None or len(shape) != scales.size:  # no static shape: Resize with ceil
        down = np.where(scales < 1.0, scales, 1.0).astype(np.float32)
        up = np.where(scales > 1.0, scales, 1.0).astype(np.float32)
        if not grows:
            return [nearest(x, y, scales_name, "ceil", base)], "nearest, asymmetric, ceil"
        mid = fresh(f"{y}_shrunk")
        nodes = [
            nearest(x, mid, new_init(down, f"{base}_down_scales"), "ceil", fresh(f"{base}_down")),
            nearest(mid, y, new_init(up, f"{base}_up_scales"), "floor", base),
        ]
        return nodes, "nearest, asymmetric: ceil on shrunk axes, then floor on grown axes"
    nodes = []
    current = x
    shrunk = [axis for axis in range(scales.size) if scales[axis] < 1.0]
    for count, axis in enumerate(shrunk):
        last = count == len(shrunk) - 1 and not grows
        target = y if last else fresh(f"{y}_rows{axis}")
        rows = new_init(_shrink_indices(shape[axis], float(scales[axis])), f"{base}_rows{axis}")
        name = base if last else fresh(f"{base}_gather{axis}")
        nodes.append(make("Gather", [current, rows], [target], name=name, axis=axis))
        current = target
    if grows:
        up = np.where(scales > 1.0, scales, 1.0).astype(np.float32)
        nodes.append(nearest(current, y, new_init(up, f"{base}_up_scales"), "floor", base))
    what = f"nearest: Gather of the rows onnxruntime picks on shrunk axes {shrunk}"
    return nodes, what + (", then Resize asymmetric/floor on grown axes" if grows else "")


def _crop_nodes(
    node: onnx.NodeProto, new_init: Callable[[np.ndarray, str], str], base: str
) -> tuple[list[onnx.NodeProto], str]:
    """Crop (opset 1, NCHW): border = [left, top, right, bottom], optional scale = [h, w].

    onnxruntime: rows top .. (top + h if scale else H - bottom), columns likewise.
    """
    attrs = _attrs(node)
    border = [int(v) for v in attrs.get("border", [0, 0, 0, 0])]
    if len(border) != 4:
        raise ValueError(f"Crop border must have 4 values, got {border}")
    left, top, right, bottom = border
    big = np.iinfo(np.int64).max
    if "scale" in attrs and list(attrs["scale"]):
        height, width = (int(v) for v in attrs["scale"])
        ends = [top + height, left + width]
        what = f"rows {top}:{top + height}, columns {left}:{left + width}"
    else:
        ends = [-bottom if bottom else big, -right if right else big]
        what = f"border top {top}, left {left}, bottom {bottom}, right {right}"
    inputs = [
        node.input[0],
        new_init(np.array([top, left], np.int64), f"{base}_starts"),
        new_init(np.array(ends, np.int64), f"{base}_ends"),
        new_init(np.array([2, 3], np.int64), f"{base}_axes"),
    ]
    make = onnx.helper.make_node
    return [make("Slice", inputs, [node.output[0]], name=base, domain=PINNED_DOMAIN)], what


def pin_legacy_semantics(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Upsample (opset 7/9), Resize (opset 10) and Crop -> the opset-21 Resize/Slice computing
    the same, in ``PINNED_DOMAIN`` until ``restore_pinned_ops`` (after ``upgrade_opset``)."""
    model = edit.writable(model)
    opset = edit.opset_version(model)
    graph = model.graph
    namer = edit.FreshNames(model)
    details: list[str] = []
    new_nodes: list[onnx.NodeProto] = []
    values: dict[str, onnx.ValueInfoProto] | None = None

    def new_init(array: np.ndarray, base: str) -> str:
        name = namer(base)
        graph.initializer.append(numpy_helper.from_array(array, name))
        return name

    for node in graph.node:
        legacy_resize = (node.op_type == "Upsample" and opset <= 9) or (
            node.op_type == "Resize" and opset == 10
        )
        if node.domain not in _DEFAULT or not (legacy_resize or node.op_type == "Crop"):
            new_nodes.append(node)
            continue
        base = node.name or namer(f"{node.output[0]}_{node.op_type.lower()}")
        if node.op_type == "Crop":
            replacement, what = _crop_nodes(node, new_init, base)
            details.append(f"{edit.node_label(node)} -> Slice ({what})")
            new_nodes.extend(replacement)
            continue
        attrs = _attrs(node)
        mode = text_attribute(attrs.get("mode"), "nearest")
        if len(node.input) > 1 and node.input[1]:
            scales_name = node.input[1]
            scales = _constant(model, scales_name)
        elif "scales" in attrs:
            scales = np.asarray(attrs["scales"], np.float32)
            scales_name = new_init(scales, f"{base}_scales")
        else:  # Upsample-1 style height_scale/width_scale: no onnxruntime kernel to match
            new_nodes.append(node)
            continue
        if scales is not None:
            scales = np.asarray(scales, np.float32).reshape(-1)
        if values is None:
            values = edit.inferred_values(model)
        value = values.get(node.input[0])
        shape = edit.value_shape(value) if value is not None else None
        replacement, what = _resize_nodes(
            node.input[0], node.output[0], mode, scales, scales_name, shape, base, new_init, namer
        )
        details.append(f"{edit.node_label(node)} (opset {opset}) -> Resize ({what})")
        new_nodes.extend(replacement)
    if details:
        edit.set_nodes(graph, new_nodes)
        if not any(o.domain == PINNED_DOMAIN for o in model.opset_import):
            model.opset_import.append(onnx.helper.make_opsetid(PINNED_DOMAIN, 1))
    return edit.checked_change(model, "pin_legacy_semantics", details)


def restore_pinned_ops(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Move the ops ``pin_legacy_semantics`` parked back into the default domain (opset 21)."""
    model = edit.writable(model)
    details = []
    for graph in edit.all_graphs(model.graph):
        for node in graph.node:
            if node.domain == PINNED_DOMAIN:
                node.domain = ""
                details.append(
                    f"{edit.node_label(node)}: restored as opset-{edit.opset_version(model)} op"
                )
    imports = [o for o in model.opset_import if o.domain != PINNED_DOMAIN]
    if len(imports) != len(model.opset_import):
        kept = [onnx.helper.make_opsetid(o.domain, o.version) for o in imports]
        del model.opset_import[:]
        model.opset_import.extend(kept)
    return edit.checked_change(model, "restore_pinned_ops", details)


# A pad value at or below this is "minus infinity" for a max.
_NEG_LIMIT = -float(np.finfo(np.float32).max)


def constant_pad_spec(
    model: onnx.ModelProto, pad: onnx.NodeProto, rank: int
) -> tuple[list[int], float] | None:
    """(pads over all axes [begin..., end...], constant value) of a constant-mode Pad."""
    attrs = _attrs(pad)
    if text_attribute(attrs.get("mode"), "constant") != "constant":
        return None
    if "pads" in attrs:  # opset < 11
        pads = [int(v) for v in attrs["pads"]]
        value = float(attrs.get("value", 0.0))
    else:
        raw = _constant(model, pad.input[1]) if len(pad.input) > 1 else None
        if raw is None:
            return None
        pads = [int(v) for v in raw.reshape(-1)]
        value = 0.0
        if len(pad.input) > 2 and pad.input[2]:
            const = _constant(model, pad.input[2])
            if const is None or const.size != 1:
                return None
            value = float(const.reshape(-1)[0])
        if len(pad.input) > 3 and pad.input[3]:  # axes (opset 18): spread over all axes
            axes = _constant(model, pad.input[3])
            if axes is None:
                return None
            full = [0] * (2 * rank)
            count = axes.size
            for i, axis in enumerate(int(a) % rank for a in axes.reshape(-1)):
                full[axis], full[axis + rank] = pads[i], pads[i + count]
            pads = full
    if len(pads) != 2 * rank:
        return None
    return pads, value


def fold_pad_into_pool(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Pad(constant) -> MaxPool / AveragePool becomes the pool with those pads, when exact.

    Exact when the Pad only pads spatial axes, by less than the kernel on every side (each
    window keeps a real value), and the pad value is what the pool's own padding means: at or
    below -FLT_MAX for MaxPool (its padding never wins a max), or 0 over a tensor a Relu made
    non-negative (nor does that zero: timm's MaxPool2dSame after a ReLU, the end-only padding
    the HTP fills wrongly, see ``fold_pad_into_conv``); 0 for an AveragePool that counts
    padding (count_include_pad = 1) or has no pads of its own, which then counts the folded
    ones (the Pad's zeros were in every window's count: timm's AvgPool2dSame; the HTP's
    AveragePool after an end-only Pad read 15.6-18.2 dB against the CPU at 8 and 16 bits). The
    pool must use explicit or VALID padding, and nothing else may read the padded tensor.
    """

    def neutral(node: onnx.NodeProto, attrs: dict[str, Any], value: float, rectified: bool) -> bool:
        if node.op_type == "MaxPool":
            indices = len(node.output) > 1 and node.output[1]
            return (value <= _NEG_LIMIT or (value == 0.0 and rectified)) and not indices
        counted = int(attrs.get("count_include_pad", 0)) == 1
        return value == 0.0 and (counted or not any(int(p) for p in attrs.get("pads", [])))

    return _fold_pads(
        edit.passed_on(model), "fold_pad_into_pool", ("MaxPool", "AveragePool"), neutral
    )


def fold_pad_into_conv(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Pad(0) -> Conv becomes the Conv with those pads: the same sums over the same zeros.

    Why: a Pad of zeros at the end of the spatial axes only (begin 0, end 1 on H and W: the
    dynamic "same" padding of TF ports, timm's Conv2dSame and MaxPool2dSame, BiT's stem) comes
    out of the HTP with the padded column filled from its neighbours, in fp16 and quantized
    alike (8x16x16: 12.4 dB against the CPU). onnxruntime folds such a Pad into the Conv at
    session creation (PadFusion), so a QDQ model looked right online; the offline compile of
    the context does not (a DPT-hybrid: 51 dB online, 17.7 dB compiled; folded, 32.2 dB).
    """

    def zeros(node: onnx.NodeProto, attrs: dict[str, Any], value: float, rectified: bool) -> bool:
        return value == 0.0

    return _fold_pads(edit.passed_on(model), "fold_pad_into_conv", ("Conv",), zeros)


def _fold_pads(
    model: onnx.ModelProto,
    step: str,
    ops: tuple[str, ...],
    neutral: Callable[[onnx.NodeProto, dict[str, Any], float, bool], bool],
) -> tuple[onnx.ModelProto, Change]:
    """The constant Pads read only by one of ``ops`` whose own padding means the same (its pad
    value ``neutral`` there, told whether a Relu made the padded tensor non-negative) become
    that op's pads; pools only by less than their kernel."""
    model = edit.writable(model)
    graph = model.graph
    used = edit.used_names(graph)
    producers = {o: i for i, n in enumerate(graph.node) for o in n.output if o}
    outputs = {o.name for o in graph.output}
    inits = edit.initializers_by_name(graph)
    drop: set[int] = set()
    details = []
    for node in graph.node:
        if node.op_type not in ops or node.domain not in _DEFAULT:
            continue
        at = producers.get(node.input[0])
        pad = graph.node[at] if at is not None else None
        if pad is None or pad.op_type != "Pad" or pad.domain not in _DEFAULT:
            continue
        if used[pad.output[0]] != 1 or pad.output[0] in outputs:
            continue
        attrs = _attrs(node)
        kernel = [int(k) for k in attrs.get("kernel_shape", [])]
        if not kernel and node.op_type == "Conv" and len(node.input) > 1:
            weight = inits.get(node.input[1])
            kernel = [int(d) for d in weight.dims[2:]] if weight is not None else []
        auto_pad = text_attribute(attrs.get("auto_pad"), "NOTSET")
        if not kernel or auto_pad not in ("NOTSET", "VALID"):
            continue
        rank = len(kernel) + 2
        spec = constant_pad_spec(model, pad, rank)
        if spec is None:
            continue
        pads, value = spec
        spatial = len(kernel)
        new = pads_added(attrs, pads, rank)
        if new is None:
            continue
        before = producers.get(pad.input[0])
        rectified = before is not None and graph.node[before].op_type == "Relu"
        if not neutral(node, attrs, value, rectified):
            continue
        pool = node.op_type != "Conv"
        if pool and any(new[i] >= kernel[i % spatial] for i in range(2 * spatial)):
            continue
        if node.op_type == "AveragePool":  # the Pad's zeros were counted: its pads are
            set_pads(node, new, count_include_pad=1)
        else:
            set_pads(node, new)
        node.input[0] = pad.input[0]
        drop.add(at)
        details.append(f"{edit.node_label(pad)} folded into {edit.node_label(node)}: pads {new}")
    if drop:
        edit.drop_nodes(graph, drop)
        edit.remove_dead_nodes(graph)
    return edit.checked_change(model, step, details)


def pads_added(attrs: dict[str, Any], pads: list[int], rank: int) -> list[int] | None:
    """An op's own spatial pads plus a Pad's (``constant_pad_spec``'s, over all ``rank`` axes):
    None where the Pad pads the batch or channel axis, or crops."""
    if any(pads[i] != 0 for i in (0, 1, rank, rank + 1)) or any(p < 0 for p in pads):
        return None
    own = [int(p) for p in attrs.get("pads", [0] * 2 * (rank - 2))]
    extra = pads[2:rank] + pads[rank + 2 :]
    return [a + b for a, b in zip(own, extra, strict=True)]


def set_pads(node: onnx.NodeProto, pads: list[int], **also: Any) -> None:
    """``node``'s explicit ``pads`` (no auto_pad), and the attributes ``also`` sets."""
    replaced = ("pads", "auto_pad", *also)
    for attribute in [a for a in node.attribute if a.name in replaced]:
        node.attribute.remove(attribute)
    node.attribute.append(onnx.helper.make_attribute("pads", pads))
    for name, value in also.items():
        node.attribute.append(onnx.helper.make_attribute(name, value))


def batchnorm_to_affine(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """An inference-mode BatchNormalization that nothing could absorb -> Mul + Add per channel.

    Old converters (OnnxMLTools, WinMLTools) normalise the input image with a BatchNormalization
    right after the graph input, where ``fold_batchnorm`` has no Conv to fold it into. As Mul
    and Add it is the same affine map (computed in float64, rounded once), and the ops around
    it can fold or fuse with it; the HTP also quantizes the two ops like any other.
    """
    model = edit.writable(model)
    graph = model.graph
    inits = edit.initializers_by_name(graph)
    used = edit.used_names(graph)
    namer = edit.FreshNames(model)
    values: dict[str, onnx.ValueInfoProto] | None = None
    nodes: list[onnx.NodeProto] = []
    details = []
    for node in graph.node:
        params = (
            t.bn_params(node, inits, used)
            if node.op_type == "BatchNormalization" and node.domain in _DEFAULT
            else None
        )
        if params is None:
            nodes.append(node)
            continue
        if values is None:
            values = edit.inferred_values(model)
        value = values.get(node.input[0])
        shape = edit.value_shape(value) if value is not None else None
        scale, shift = params
        if shape is None or len(shape) < 2 or shape[1] != scale.shape[0]:
            nodes.append(node)
            continue
        dtype = edit.numpy_dtype(value.type.tensor_type.elem_type)
        per_channel = (scale.shape[0],) + (1,) * (len(shape) - 2)
        base = node.name or node.output[0]
        s_name, b_name = namer(f"{base}_scale"), namer(f"{base}_shift")
        graph.initializer.extend(
            [
                numpy_helper.from_array(scale.reshape(per_channel).astype(dtype), s_name),
                numpy_helper.from_array(shift.reshape(per_channel).astype(dtype), b_name),
            ]
        )
        mid = namer(f"{base}_scaled")
        make = onnx.helper.make_node
        nodes += [
            make("Mul", [node.input[0], s_name], [mid], name=namer(f"{base}_mul")),
            make("Add", [mid, b_name], [node.output[0]], name=namer(f"{base}_add")),
        ]
        details.append(f"{edit.node_label(node)} (nothing to fold into) -> Mul + Add")
    if details:
        edit.set_nodes(graph, nodes)
        edit.remove_dead_nodes(graph)
    return edit.checked_change(model, "batchnorm_to_affine", details)


def batchnorm_of_computed_statistics(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """An inference-mode BatchNormalization whose scale, bias, mean or variance is computed in
    the graph -> (x - mean) / Sqrt(var + eps) * scale + bias, each [C] operand unsqueezed to
    [C, 1, ...] so that it broadcasts along axis 1 as in the BatchNormalization.

    tf2onnx writes Keras' LayerNormalization as its fused-batch-norm trick: the input reshaped
    to [1, N, ...], its mean and variance computed by ReduceMean and ReduceSumSquare, and a
    BatchNormalization reading them as its statistics. The QNN EP takes only constant
    statistics, so that BatchNormalization stayed on the CPU with its Q/DQ and cut the graph in
    two (a Magika file-type classifier: 2 partitions, 7 CPU nodes). The same arithmetic in
    elementary ops, which the HTP runs (exact up to float rounding).
    """
    model = edit.writable(model)
    graph = model.graph
    inits = edit.initializers_by_name(graph)
    used = edit.used_names(graph)
    namer = edit.FreshNames(model)
    values: dict[str, onnx.ValueInfoProto] | None = None
    nodes: list[onnx.NodeProto] = []
    constants: list[onnx.TensorProto] = []
    details = []
    make = onnx.helper.make_node
    for node in graph.node:
        attrs = _attrs(node)
        if (
            node.op_type != "BatchNormalization"
            or node.domain not in _DEFAULT
            or len(node.input) < 5
            or all(name in inits for name in node.input[1:5])  # batchnorm_to_affine's case
            or attrs.get("training_mode", 0)
            or attrs.get("spatial", 1) == 0
            or any(o and used[o] for o in node.output[1:])
        ):
            nodes.append(node)
            continue
        if values is None:
            values = edit.inferred_values(model)
        value = values.get(node.input[0])
        shape = edit.value_shape(value) if value is not None else None
        if shape is None or len(shape) < 2:
            nodes.append(node)
            continue
        dtype = edit.numpy_dtype(value.type.tensor_type.elem_type)
        base = node.name or node.output[0]
        spread = {}  # operand -> its [C, 1, ...] form
        if len(shape) > 2:
            axes = namer(f"{base}_channel_axes")
            constants.append(
                numpy_helper.from_array(np.arange(1, len(shape) - 1, dtype=np.int64), axes)
            )
        for name in node.input[1:5]:
            if name in spread:
                continue
            if len(shape) == 2:  # [N, C]: a [C] operand broadcasts along axis 1 as it is
                spread[name] = name
                continue
            spread[name] = namer(f"{name}_per_channel")
            nodes.append(make("Unsqueeze", [name, axes], [spread[name]], name=spread[name]))
        scale, bias, mean, var = (spread[name] for name in node.input[1:5])
        eps = namer(f"{base}_epsilon")
        constants.append(
            numpy_helper.from_array(np.array(attrs.get("epsilon", 1e-5), dtype=dtype), eps)
        )
        t = {k: namer(f"{base}_{k}") for k in ("centred", "var_eps", "root", "normed", "scaled")}
        nodes += [
            make("Sub", [node.input[0], mean], [t["centred"]], name=t["centred"]),
            make("Add", [var, eps], [t["var_eps"]], name=t["var_eps"]),
            make("Sqrt", [t["var_eps"]], [t["root"]], name=t["root"]),
            make("Div", [t["centred"], t["root"]], [t["normed"]], name=t["normed"]),
            make("Mul", [t["normed"], scale], [t["scaled"]], name=t["scaled"]),
            make("Add", [t["scaled"], bias], [node.output[0]], name=base),
        ]
        details.append(
            f"{edit.node_label(node)} (statistics computed in the graph) -> elementary ops"
        )
    if details:
        graph.initializer.extend(constants)
        edit.set_nodes(graph, nodes)
        edit.remove_dead_nodes(graph)
    return edit.checked_change(model, "batchnorm_of_computed_statistics", details)


def _pool_geometry(attrs: dict[str, Any]) -> tuple[list[int], list[int], list[int], list[int]]:
    """A pool's kernel, strides, pads and dilations with ONNX's defaults."""
    kernel = [int(k) for k in attrs.get("kernel_shape", [])]
    spatial = len(kernel)
    return (
        kernel,
        [int(v) for v in attrs.get("strides", [1] * spatial)],
        [int(v) for v in attrs.get("pads", [0] * 2 * spatial)],
        [int(v) for v in attrs.get("dilations", [1] * spatial)],
    )


_AUTO_PADDED = ("Conv", "MaxPool", "AveragePool", "LpPool")


def explicit_auto_pads(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """``auto_pad`` SAME_UPPER / SAME_LOWER / VALID on a Conv or pool of a static input ->
    the explicit ``pads`` that ONNX defines it as (output ceil(in / stride); the padding that
    needs split evenly, its odd cell at the end for SAME_UPPER, at the start for SAME_LOWER).

    The same op. Keras converters (keras2onnx, onnxmltools, WinMLTools) write every "same"
    layer so, and the rules that mend what the HTP computes wrongly read explicit pads only:
    a fingerprint-minutiae network's nine SAME_UPPER AveragePools were never rewritten, though
    the HTP computes padded AveragePools wrongly (``explicit_pool_pads``).
    """
    model = edit.writable(model)
    values: dict[str, onnx.ValueInfoProto] | None = None
    details = []
    for node in model.graph.node:
        if node.op_type not in _AUTO_PADDED or node.domain not in _DEFAULT:
            continue
        attrs = _attrs(node)
        mode = text_attribute(attrs.get("auto_pad"), "NOTSET")
        if mode == "NOTSET" or int(attrs.get("ceil_mode", 0)):
            continue
        if values is None:
            values = edit.inferred_values(model)
        value = values.get(node.input[0])
        shape = edit.value_shape(value) if value is not None else None
        kernel = [int(k) for k in attrs.get("kernel_shape", [])]
        if not kernel and node.op_type == "Conv" and node.input[1] in values:
            weight = edit.value_shape(values[node.input[1]])
            kernel = list(weight[2:]) if weight is not None else []
        if shape is None or not kernel or len(shape) != len(kernel) + 2:
            continue
        spatial = len(kernel)
        strides = [int(v) for v in attrs.get("strides", [1] * spatial)]
        dilations = [int(v) for v in attrs.get("dilations", [1] * spatial)]
        begin, end = [0] * spatial, [0] * spatial
        if mode.startswith("SAME") and any(d != 1 for d in dilations):
            continue  # onnxruntime refuses it ("Dilation not supported for SAME"): left so
        if mode in ("SAME_UPPER", "SAME_LOWER"):
            for i in range(spatial):
                size = int(shape[2 + i])
                out = -(-size // strides[i])
                total = max(0, (out - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - size)
                small, large = total // 2, total - total // 2
                begin[i], end[i] = (small, large) if mode == "SAME_UPPER" else (large, small)
        elif mode != "VALID":
            continue
        edit.replace_attributes(node, ("auto_pad",), pads=begin + end)
        details.append(f"{edit.node_label(node)}: auto_pad {mode} -> pads {begin + end}")
    return edit.checked_change(model, "explicit_auto_pads", details)


def explicit_pool_pads(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A MaxPool whose windows do not overlap (stride >= kernel) with padding at the start of
    an axis, and any AveragePool with padding -> the same windows over the same values without
    the pool's own pads: a MaxPool after an edge Pad (a window that reaches into the padding
    holds the border value it copies), an AveragePool as a depthwise Conv of constant 1 / window
    size with those pads (zeros, which count), scaled back by each window's size over the cells
    it covers where the pads did not count (count_include_pad = 0).

    Why: the QNN HTP computes such a pool wrongly, quantized and in fp16 (an AveragePool 4x4/4
    with a pad of 1: 1.2 dB, 2x2/2: -2.3 dB, 3x3/3: 0.1 dB on some sizes) and dies compiling
    some (a native crash on a 4x4/4 MaxPool or AveragePool). A padded AveragePool with
    overlapping windows is no safer, in a way that depends on the kernel, the stride, the pads,
    count_include_pad and the map's size (fp16, one 3x3/1 pool: 61.8 dB at 24x32 and 8.0 at
    48x64 with pads of 1 that do not count; 2x2/1 with pads that count: 3.4 dB; end pads that
    do not count: the simulator dies running it, SIGSEGV, as an OpenCV-style Kuwahara filter's
    four quadrant means did), so every one is rewritten. Padded MaxPools with overlapping
    windows were right in every case measured. An explicit zero Pad does not help an
    AveragePool: the HTP fuses it back (-78 dB); the Conv is right (68 dB in fp16, 46-49 dB
    quantized, as any depthwise Conv).
    A pre-quantized model keeps its pools: between its own DQ and Q the CPU computes them in
    integers, and a float Conv in their place is another rounding (35 dB apart on uint8).
    """
    from .prequantized import is_prequantized

    model = edit.writable(model)
    if is_prequantized(model):
        return edit.checked_change(model, "explicit_pool_pads", [])
    graph = model.graph
    namer = edit.FreshNames(model)
    values: dict[str, onnx.ValueInfoProto] | None = None
    nodes: list[onnx.NodeProto] = []
    details = []
    for node in graph.node:
        nodes.append(node)
        if node.op_type not in ("AveragePool", "MaxPool") or node.domain not in _DEFAULT:
            continue
        attrs = _attrs(node)
        kernel, strides, pads, dilations = _pool_geometry(attrs)
        spatial = len(kernel)
        if (
            not kernel
            or int(attrs.get("ceil_mode", 0))
            or text_attribute(attrs.get("auto_pad"), "NOTSET") != "NOTSET"
            or any(d != 1 for d in dilations)
            or len([o for o in node.output if o]) != 1
        ):
            continue
        if node.op_type == "MaxPool" and not any(
            pads[i] and strides[i] >= kernel[i] for i in range(spatial)
        ):
            continue  # overlapping windows: the HTP's padded MaxPool is right
        if node.op_type == "AveragePool" and not any(pads):
            continue
        base = node.name or node.output[0]
        if node.op_type == "MaxPool":
            edit.pad_first_input(graph, nodes, node, pads, namer, mode="edge")
            edit.replace_attributes(node, ("pads",))
            details.append(f"{edit.node_label(node)}: pads {pads} -> an edge Pad before it")
            continue
        values = values if values is not None else edit.inferred_values(model)
        dims = [
            edit.value_shape(values[name]) if name in values else None
            for name in (node.input[0], node.output[0])
        ]
        if any(d is None or len(d) != spatial + 2 or not all(d) for d in dims):
            continue  # no static shape: no channel count for the Conv
        (size_in, size_out) = dims  # type: ignore[misc]
        channels = int(size_in[1])
        window = np.full([channels, 1, *kernel], 1.0 / float(np.prod(kernel)), np.float32)
        weight = namer(f"{base}_window")
        graph.initializer.append(numpy_helper.from_array(window, weight))
        conv = onnx.helper.make_node(
            "Conv",
            [node.input[0], weight],
            [node.output[0]],
            name=node.name,
            kernel_shape=kernel,
            strides=strides,
            pads=pads,
            group=channels,
        )
        nodes[-1] = conv
        how = "a depthwise Conv of 1 / window size"
        if int(attrs.get("count_include_pad", 0)) != 1:
            scale = _window_scale(kernel, strides, pads, list(size_in[2:]), list(size_out[2:]))
            out, summed = conv.output[0], namer(f"{base}_over_window")
            conv.output[0] = summed
            # not "<weight>_scale": onnxruntime's quantizer names the window's own scale that
            factor = namer(f"{base}_cover_ratio")
            graph.initializer.append(numpy_helper.from_array(scale, factor))
            nodes.append(
                onnx.helper.make_node("Mul", [summed, factor], [out], name=namer(f"{base}_scale"))
            )
            how += ", scaled by each window's size over the cells it covers"
        details.append(f"{edit.node_label(node)}: pads {pads} -> {how}")
    if details:
        edit.set_nodes(graph, nodes)
    return edit.checked_change(model, "explicit_pool_pads", details)


def _window_scale(
    kernel: list[int], strides: list[int], pads: list[int], size_in: list[int], size_out: list[int]
) -> np.ndarray:
    """[1, 1, *size_out]: kernel volume / the input cells each window covers (pads excluded)."""
    spatial = len(kernel)
    counts = np.ones([1, 1, *size_out], np.float64)
    for axis in range(spatial):
        starts = np.arange(size_out[axis]) * strides[axis] - pads[axis]
        covered = np.minimum(starts + kernel[axis], size_in[axis]) - np.maximum(starts, 0)
        shape = [1] * (spatial + 2)
        shape[2 + axis] = size_out[axis]
        counts = counts * covered.reshape(shape)
    return (float(np.prod(kernel)) / counts).astype(np.float32)


def whole_input_pools(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """An AveragePool or MaxPool whose one window covers its whole input -> GlobalAveragePool
    or GlobalMaxPool: the same numbers (pads that do not count, an overhang never does).

    Why: Hugging Face's EfficientNet pools its last 7x7 map with AvgPool2d(1280, ceil_mode)
    (the kernel set to the channel count); made floor-mode over end pads and then a depthwise
    Conv (``avg_pool_ceil_mode``, ``explicit_pool_pads``), its window was a [1280, 1, 1280,
    1280] weight, 7.8 GiB: the build died, killed for memory at 23 GB."""
    values = None
    details = []
    result = edit.copy_model(model)
    for node in result.graph.node:
        if node.op_type not in ("AveragePool", "MaxPool") or node.domain not in _DEFAULT:
            continue
        attrs = _attrs(node)
        kernel, _, pads, dilations = _pool_geometry(attrs)
        spatial = len(kernel)
        if not kernel or text_attribute(attrs.get("auto_pad"), "NOTSET") != "NOTSET":
            continue
        if any(d != 1 for d in dilations) or len([o for o in node.output if o]) != 1:
            continue
        counted = node.op_type == "AveragePool" and int(attrs.get("count_include_pad", 0))
        if counted and any(pads):
            continue  # its divisor counts pads: not the input's mean
        values = values if values is not None else edit.inferred_values(result)
        dims = [
            edit.value_shape(values[name]) if name in values else None
            for name in (node.input[0], node.output[0])
        ]
        if any(d is None or len(d) != spatial + 2 for d in dims):
            continue
        size_in, size_out = dims[0][2:], dims[1][2:]  # type: ignore[index]
        if any(o != 1 for o in size_out) or any(
            kernel[i] - pads[i] < size_in[i] for i in range(spatial)
        ):
            continue  # more than one window, or one that leaves input cells out
        old = f"{node.op_type} {kernel}"
        node.op_type = f"Global{node.op_type}"
        del node.attribute[:]
        details.append(f"{edit.node_label(node)}: {old} over {list(size_in)} -> {node.op_type}")
    if not details:
        return model, Change("whole_input_pools")
    return edit.checked_change(result, "whole_input_pools", details)


def avg_pool_ceil_mode(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """AveragePool(ceil_mode = 1) -> the same pool in floor mode over explicit end padding.

    onnxruntime's ceil mode adds windows that overhang the end and averages them over what
    they cover (the overhang never counts, explicit pads count when count_include_pad = 1).
    The same numbers come from floor mode with the overhang as end pads that do not count
    (count_include_pad = 0); explicit pads that must count become a Pad of zeros before the
    pool. Why: the QNN HTP computes the ceil-mode AveragePool wrongly (8.5 dB in 16 bit,
    11.8 dB in fp16 on a 3x3/2 pool), and ResNet-D / ResNet_vd shortcuts (timm, PaddleClas:
    AvgPool 2x2/2, ceil_mode) and Caffe exports use it.
    """
    model = edit.writable(model)
    graph = model.graph
    namer = edit.FreshNames(model)
    values: dict[str, onnx.ValueInfoProto] | None = None
    nodes: list[onnx.NodeProto] = []
    details = []
    for node in graph.node:
        nodes.append(node)
        if node.op_type != "AveragePool" or node.domain not in _DEFAULT:
            continue
        attrs = _attrs(node)
        kernel, strides, pads, dilations = _pool_geometry(attrs)
        if not int(attrs.get("ceil_mode", 0)) or not kernel:
            continue
        spatial = len(kernel)
        if text_attribute(attrs.get("auto_pad"), "NOTSET") != "NOTSET" or any(
            d != 1 for d in dilations
        ):
            continue
        if values is None:
            values = edit.inferred_values(model)
        shapes = [values.get(node.input[0]), values.get(node.output[0])]
        dims = [edit.value_shape(v) if v is not None else None for v in shapes]
        if any(d is None or len(d) != spatial + 2 or not all(d) for d in dims):
            continue
        (size_in, size_out) = ([d[2 + i] for i in range(spatial)] for d in dims)  # type: ignore[index]
        overhang = [
            max(
                0,
                (size_out[i] - 1) * strides[i]
                + kernel[i]
                - size_in[i]
                - pads[i]
                - pads[spatial + i],
            )
            for i in range(spatial)
        ]
        counts_pads = int(attrs.get("count_include_pad", 0)) == 1 and any(pads)
        ends = [pads[spatial + i] + overhang[i] for i in range(spatial)]
        if any(any(overhang) and e >= k for e, k in zip(ends, kernel, strict=True)):
            continue
        if not any(overhang):  # ceil and floor agree here
            edit.replace_attributes(
                node, ("ceil_mode",), pads=pads, count_include_pad=int(counts_pads)
            )
            details.append(f"{edit.node_label(node)}: ceil_mode 1 -> 0 (no window overhangs)")
            continue
        if counts_pads:  # the explicit pads count: make them zeros the pool averages over
            edit.pad_first_input(graph, nodes, node, pads, namer)
            new_pads = [0] * spatial + overhang
        else:
            new_pads = pads[:spatial] + ends
        edit.replace_attributes(node, ("ceil_mode",), pads=new_pads, count_include_pad=0)
        details.append(
            f"{edit.node_label(node)}: ceil_mode 1 -> 0, pads {pads} -> {new_pads} that do not "
            "count" + (f", after a Pad of zeros {pads} that does" if counts_pads else "")
        )
    if details:
        edit.set_nodes(graph, nodes)
    return edit.checked_change(model, "avg_pool_ceil_mode", details)


# Ops whose opset-1..6 forms broadcast only with ``broadcast = 1``, B aligned to A at ``axis``
# (default: A's trailing dims); opset 7 broadcasts numpy-style (Gemm's C: unidirectionally).
_LEGACY_BROADCAST_OPS = frozenset(
    {"Add", "Sub", "Mul", "Div", "Pow", "And", "Or", "Xor", "Equal", "Greater", "Less", "Gemm"}
)  # and PRelu, whose slope [C] meant per channel (``_per_channel_slope``)


def explicit_legacy_broadcasts(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Opset <= 6 ``broadcast``/``axis`` attributes -> B reshaped to broadcast numpy-style (an
    initializer's copy reshaped, else an Unsqueeze), the attributes dropped. Why: the onnx
    version converter's adapter unsqueezes B to the wrong rank (a bias [16] added at axis 1 of
    [1, 16, 32, 32] became [16, 1, 1, 1]: the batch grew to 16) and fails on a model without
    stored shapes ("Shape of input 0 is not available"), which a Caffe2-era model is. A
    PRelu's per-channel slope [C] is reshaped too (``_per_channel_slope``)."""
    if edit.opset_version(model) >= 7:
        return edit.checked_change(edit.writable(model), "explicit_legacy_broadcasts", [])
    model = edit.copy_model(model)
    graph = model.graph
    namer = edit.FreshNames(model)
    inits = {i.name: i for i in graph.initializer}
    values: dict[str, onnx.ValueInfoProto] | None = None
    details: list[str] = []
    new_nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        attrs = _attrs(node)
        if node.op_type == "PRelu" and node.domain in _DEFAULT and len(node.input) > 1:
            if values is None:
                values = edit.inferred_values(model)
            aligned = _per_channel_slope(node, values, inits, graph, namer)
            if aligned:
                details.append(aligned)
            new_nodes.append(node)
            continue
        if (
            node.op_type not in _LEGACY_BROADCAST_OPS
            or node.domain not in _DEFAULT
            or "broadcast" not in attrs
        ):
            new_nodes.append(node)
            continue
        b_index = 2 if node.op_type == "Gemm" else 1
        axis = attrs.get("axis") if node.op_type != "Gemm" else None
        if attrs["broadcast"] and axis is not None and len(node.input) > b_index:
            if values is None:
                values = edit.inferred_values(model)
            a_shape = edit.shape_in(values, node.input[0])
            b_shape = edit.shape_in(values, node.input[b_index])
            if a_shape is None or b_shape is None:
                new_nodes.append(node)  # left to the converter, which needs the same shapes
                continue
            axis = axis + len(a_shape) if axis < 0 else axis
            trailing = len(a_shape) - axis - len(b_shape)
            if trailing > 0:
                b = node.input[b_index]
                aligned = namer(f"{b}_aligned")
                if b in inits:
                    array = numpy_helper.to_array(inits[b])
                    array = array.reshape(*array.shape, *([1] * trailing))
                    graph.initializer.append(numpy_helper.from_array(array, aligned))
                else:
                    axes = list(range(len(b_shape), len(b_shape) + trailing))
                    new_nodes.append(
                        onnx.helper.make_node(
                            "Unsqueeze", [b], [aligned], axes=axes, name=namer(f"{b}_unsqueeze")
                        )
                    )
                node.input[b_index] = aligned
                details.append(
                    f"{edit.node_label(node)}: B {list(b_shape)} at axis {axis} of "
                    f"{list(a_shape)} -> {list(b_shape) + [1] * trailing}"
                )
        kept = [a for a in node.attribute if a.name not in ("broadcast", "axis")]
        del node.attribute[:]
        node.attribute.extend(kept)
        new_nodes.append(node)
    if len(new_nodes) != len(graph.node):
        edit.set_nodes(graph, new_nodes)
    return edit.checked_change(model, "explicit_legacy_broadcasts", details)


def _per_channel_slope(
    node: onnx.NodeProto,
    values: dict[str, onnx.ValueInfoProto],
    inits: dict[str, onnx.TensorProto],
    graph: onnx.GraphProto,
    namer: edit.FreshNames,
) -> str:
    """An opset <= 6 PRelu's slope [C] over X [N, C, ...] is per channel (Caffe2's meaning; opset
    7 would broadcast it over X's last axis and fail or mix the channels): its initializer is
    reshaped to [C, 1, ...]. What was done, or "" when nothing was."""
    slope = inits.get(node.input[1])
    x_shape = edit.shape_in(values, node.input[0])
    if slope is None or x_shape is None or len(x_shape) < 3 or len(slope.dims) != 1:
        return ""
    channels = slope.dims[0]
    if channels == 1 or channels != x_shape[1]:
        return ""
    array = numpy_helper.to_array(slope).reshape(channels, *([1] * (len(x_shape) - 2)))
    aligned = namer(f"{node.input[1]}_per_channel")
    graph.initializer.append(numpy_helper.from_array(array, aligned))
    node.input[1] = aligned
    return f"{edit.node_label(node)}: slope [{channels}] per channel of {list(x_shape)}"


def coerced_hardmax(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Opset < 13 Hardmax over an inner axis -> Flatten, Hardmax over axis 1, Reshape back.
    Why: below opset 13 Hardmax takes the maximum over all dims from ``axis`` on (the input
    coerced to 2-D), from 13 over ``axis`` alone, and the onnx version converter, which
    rewrites Softmax and LogSoftmax so, keeps a Hardmax as it is: a [1, 3, 4, 5] Hardmax over
    axis 1 then marked one of 3 values instead of one of 60."""
    if edit.opset_version(model) >= 13:
        return edit.checked_change(edit.writable(model), "coerced_hardmax", [])
    model = edit.copy_model(model)
    namer = edit.FreshNames(model)
    values: dict[str, onnx.ValueInfoProto] | None = None
    details: list[str] = []
    new_nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        if node.op_type != "Hardmax" or node.domain not in _DEFAULT:
            new_nodes.append(node)
            continue
        if values is None:
            values = edit.inferred_values(model)
        shape = edit.shape_in(values, node.input[0])
        axis = int(_attrs(node).get("axis", 1))
        rank = len(shape) if shape is not None else None
        if rank is None or (axis + rank if axis < 0 else axis) >= rank - 1:
            new_nodes.append(node)  # one axis from there on: both meanings agree
            continue
        base = node.name or namer(f"{node.output[0]}_hardmax")
        flat, picked, dims = namer(f"{base}_flat"), namer(f"{base}_2d"), namer(f"{base}_shape")
        new_nodes += [
            onnx.helper.make_node("Flatten", [node.input[0]], [flat], axis=axis),
            onnx.helper.make_node("Hardmax", [flat], [picked], axis=1, name=base),
            onnx.helper.make_node("Shape", [node.input[0]], [dims]),
            onnx.helper.make_node("Reshape", [picked, dims], [node.output[0]]),
        ]
        details.append(f"{edit.node_label(node)}: over dims {axis}.. of {list(shape)} (2-D)")
    if details:
        edit.set_nodes(model.graph, new_nodes)
    return edit.checked_change(model, "coerced_hardmax", details)
