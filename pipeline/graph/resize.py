"""Resize by a scale the HTP cannot follow: rewritten so the NPU computes what the model means.

onnxruntime computes a Resize with ``scales`` from the scale given (asymmetric: source
coordinate = i / s) and an output of floor(in * s). The QNN HTP backend (QNN 2.51, measured
on the simulator) recomputes the scale as out / in: when in * s is not an integer (8 x 1.7 ->
13, not 13.6) every row lands elsewhere and the context disagrees with the model (5-12 dB
against the CPU QDQ model, nearest and linear alike; exact scale ratios are fine). Rewrites,
for a static input and constant scales:

- nearest: each such axis becomes a Gather of the rows onnxruntime picks (taken from
  onnxruntime itself on an index ramp, so every coordinate and rounding mode is matched); so
  does every axis a nearest Resize changes by a ratio that is not whole, or by any ratio when
  the model gives output sizes (PyTorch's interpolate(size=...)): the HTP gets those wrong
  even where out / in is exact (0 dB), or leaves them to the CPU;
- linear with asymmetric or half_pixel coordinates (the source coordinate does not depend on
  the input length): the axis is padded at its end by repeating the last row until
  (in + k) * s is an integer, resized, and sliced back to floor(in * s). Every output row
  reads the same input rows as before, and where onnxruntime clamps to the last row the pad
  holds that row's values: exact.
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

DRIFT = 1e-3  # input pixels the HTP's source coordinates may be off by (33 x 7.787879: 1e-6)
MAX_PAD = 64  # longest end padding tried for a linear axis
_DEFAULT = ("", "ai.onnx")
_PAD_FREE_MODES = ("asymmetric", "half_pixel")


def _text(value: Any, default: str) -> str:
    if value is None:
        return default
    return value.decode() if isinstance(value, bytes) else str(value)


def _out(size: int, scale: float) -> int:
    """onnxruntime's output length: the float32 product, truncated."""
    return int(np.floor(np.float32(size) * np.float32(scale)))


def _followed(size: int, scale: float) -> bool:
    """The HTP (source coordinate = i * size / out) reads within ``DRIFT`` of where
    onnxruntime reads (i / scale) on every output row of this axis."""
    out = _out(size, scale)
    return out >= 1 and (out - 1) * abs(1.0 / float(scale) - size / out) <= DRIFT


def _off_axes(shape: tuple[int, ...], scales: np.ndarray) -> list[int]:
    """Axes where the HTP's out / in differs from the scale onnxruntime resizes by."""
    return [
        axis
        for axis, (size, scale) in enumerate(zip(shape, scales, strict=True))
        if scale != 1.0 and not _followed(size, float(scale))
    ]


def _nearest(node: onnx.NodeProto) -> bool:
    mode = next((a.s for a in node.attribute if a.name == "mode"), b"nearest")
    return _text(mode, "nearest") == "nearest"


def _gathered_axes(
    shape: tuple[int, ...], scales: np.ndarray, sizes: np.ndarray | None
) -> list[int]:
    """Axes of a nearest Resize to take as a Gather: all it changes, except growth by a whole
    factor given as a scale (the 2x upsampling the HTP is right on). Measured on the
    simulator against the CPU: a ratio that is not whole, either way (16 -> 24, 16 -> 12),
    0 dB even where out / in is the scale; given as sizes, even 16 -> 8 is wrong and 16 -> 32
    asymmetric stays on the CPU."""
    axes = []
    for axis, size in enumerate(shape):
        out = int(sizes[axis]) if sizes is not None else _out(size, float(scales[axis]))
        if out == size:
            continue
        if sizes is not None or out < size or out % size:
            axes.append(axis)
    return axes


def _picks(size: int, scale: float, attrs: dict[str, Any], length: int | None = None) -> np.ndarray:
    """The input rows onnxruntime's nearest Resize reads along one axis of ``size`` (resized
    by ``scale``, or to ``length`` rows when the model gives sizes)."""
    ramp = np.arange(size, dtype=np.float32).reshape(1, size)
    kwargs = {
        k: v for k, v in attrs.items() if k in ("coordinate_transformation_mode", "nearest_mode")
    }
    resized = _onnxruntime_resize(ramp, scale, length, mode="nearest", **kwargs)
    return resized.reshape(-1).astype(np.int64)


def _onnxruntime_resize(
    x: np.ndarray, scale: float | None, length: int | None, **attrs: Any
) -> np.ndarray:
    """onnxruntime's Resize (``attrs``) of the last axis of a 2-D ``x`` by ``scale``, or to
    ``length`` when the model gives sizes: the reference the rewrites read their rows or
    weights off."""
    import onnxruntime as ort

    if length is None:
        inputs, target = ["x", "", "s"], np.array([1.0, scale], np.float32)
    else:
        inputs, target = ["x", "", "", "s"], np.array([x.shape[0], length], np.int64)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Resize", inputs, ["y"], **attrs)],
        "reference",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, list(x.shape))],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(target, "s")],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)])
    model.ir_version = t.DEFAULT_IR_VERSION
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return session.run(None, {"x": x})[0]


_FLOOR_FORM = {"coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}


def _floor_form(
    node: onnx.NodeProto, shape: tuple[int, ...], scales: np.ndarray, gathered: list[int]
) -> tuple[list[int], str]:
    """(axes to gather as well, what was recast) for a nearest Resize's whole-factor growth.

    The HTP takes nearest growth by a whole factor s in one form, asymmetric coordinates and
    floor rounding (row i reads i // s); the ONNX default rounding, round_prefer_floor, it
    refuses (measured at 2x and 4x: left on the CPU; old paddle2onnx exports write it, a
    PP-OCRv2 detector's six FPN upsamplings: 4 partitions). Where onnxruntime's rows are
    i // s on every such axis, the node is recast to that form (the same rows); an axis
    whose rows differ (4x with round_prefer_floor reads row j + 1 from i = 4j + 3) is taken
    as a Gather of those rows."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    coords = _text(attrs.get("coordinate_transformation_mode"), "half_pixel")
    rounding = _text(attrs.get("nearest_mode"), "round_prefer_floor")
    if (coords, rounding) == tuple(_FLOOR_FORM.values()) or coords == "tf_crop_and_resize":
        return [], ""
    grown = [
        axis
        for axis, (size, scale) in enumerate(zip(shape, scales, strict=True))
        if axis not in gathered and _out(size, float(scale)) != size
    ]
    uneven = []
    for axis in grown:
        scale = float(scales[axis])
        floor_rows = np.arange(_out(shape[axis], scale)) // round(scale)
        if not np.array_equal(_picks(shape[axis], scale, attrs), floor_rows):
            uneven.append(axis)
    if len(uneven) == len(grown):
        return uneven, ""
    # What stays a Resize (the even axes; a gathered one has scale 1 there) takes the form.
    edit.replace_attributes(node, tuple(_FLOOR_FORM), **_FLOOR_FORM)
    return uneven, f"nearest ({coords}, {rounding}) recast as asymmetric, floor: the same rows"


def _end_pad(size: int, scale: float) -> int | None:
    """Smallest k <= MAX_PAD for which the HTP follows the scale on size + k rows."""
    for k in range(MAX_PAD + 1):
        if _followed(size + k, scale):
            return k
    return None


def _rewrite(
    node: onnx.NodeProto,
    shape: tuple[int, ...],
    scales: np.ndarray,
    off: list[int],
    new_init: Callable[[np.ndarray, str], str],
    fresh: Callable[[str], str],
    sizes: np.ndarray | None = None,
) -> tuple[list[onnx.NodeProto], str] | None:
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    mode = _text(attrs.get("mode"), "nearest")
    coords = _text(attrs.get("coordinate_transformation_mode"), "half_pixel")
    make = onnx.helper.make_node
    base = node.name or node.output[0]
    x, y = node.input[0], node.output[0]
    if mode == "nearest":
        nodes = []
        current = x
        rest = scales.copy()
        rest[off] = 1.0
        keep_resize = bool(np.any(rest != 1.0))
        for count, axis in enumerate(off):
            last = count == len(off) - 1 and not keep_resize
            target = y if last else fresh(f"{y}_rows{axis}")
            length = None if sizes is None else int(sizes[axis])
            picks = _picks(shape[axis], float(scales[axis]), attrs, length)
            rows = new_init(picks, f"{base}_rows{axis}")
            name = base if last else fresh(f"{base}_gather{axis}")
            nodes.append(make("Gather", [current, rows], [target], name=name, axis=axis))
            current = target
        if keep_resize:
            resize = onnx.NodeProto()
            resize.CopyFrom(node)
            resize.input[0] = current
            if sizes is None:  # (sizes stay: the gathered axes already have their length)
                resize.input[2] = new_init(rest.astype(np.float32), f"{base}_rest_scales")
            nodes.append(resize)
        return nodes, f"nearest: Gather of onnxruntime's rows on axes {off}"
    if mode != "linear" or coords not in _PAD_FREE_MODES or sizes is not None:
        return None
    pads = [0] * (2 * len(shape))
    for axis in off:
        k = _end_pad(shape[axis], float(scales[axis]))
        if k is None:
            return None
        pads[len(shape) + axis] = k
    out = [_out(n, float(s)) for n, s in zip(shape, scales, strict=True)]
    padded, resized = fresh(f"{x}_edge_padded"), fresh(f"{y}_padded")
    resize = onnx.NodeProto()
    resize.CopyFrom(node)
    resize.input[0], resize.output[0] = padded, resized
    axes = list(range(len(shape)))
    nodes = [
        make(
            "Pad",
            [x, new_init(np.array(pads, np.int64), f"{base}_pads")],
            [padded],
            name=fresh(f"{base}_edge_pad"),
            mode="edge",
        ),
        resize,
        make(
            "Slice",
            [
                resized,
                new_init(np.zeros(len(shape), np.int64), f"{base}_starts"),
                new_init(np.array(out, np.int64), f"{base}_ends"),
                new_init(np.array(axes, np.int64), f"{base}_axes"),
            ],
            [y],
            name=fresh(f"{base}_crop"),
        ),
    ]
    return nodes, f"linear: axes {off} padded at the end by {[pads[len(shape) + a] for a in off]}"


def resize_for_htp(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Resize nodes the HTP computes wrongly (in * scale not an integer; nearest by a ratio
    that is not whole, or by output sizes) -> forms it computes exactly."""
    model = edit.writable(model)
    graph = model.graph
    inits = edit.initializers_by_name(graph)
    namer = edit.FreshNames(model)
    values: dict[str, onnx.ValueInfoProto] | None = None
    nodes: list[onnx.NodeProto] = []
    details = []

    def new_init(array: np.ndarray, base: str) -> str:
        name = namer(base)
        graph.initializer.append(numpy_helper.from_array(array, name))
        return name

    for node in graph.node:
        rewritten = None
        by_scales = len(node.input) >= 3 and node.input[2] in inits
        by_sizes = len(node.input) >= 4 and node.input[3] in inits
        usable = (
            node.op_type == "Resize"
            and node.domain in _DEFAULT
            and by_scales != by_sizes
            and not any(a.name in ("axes", "antialias") and a.i for a in node.attribute)
        )
        if usable:
            if values is None:
                values = edit.inferred_values(model)
            value = values.get(node.input[0])
            shape = edit.value_shape(value) if value is not None else None
            sizes = None
            if by_sizes:
                sizes = numpy_helper.to_array(inits[node.input[3]]).astype(np.int64).reshape(-1)
                scales = np.ones(sizes.size, np.float32)
                if shape is not None and len(shape) == sizes.size:
                    scales = (sizes / np.array(shape, np.float64)).astype(np.float32)
            else:
                scales = numpy_helper.to_array(inits[node.input[2]]).astype(np.float32).reshape(-1)
            if shape is not None and len(shape) == scales.size:
                off = [] if sizes is not None else _off_axes(shape, scales)
                if _nearest(node):
                    off = sorted({*off, *_gathered_axes(shape, scales, sizes)})
                    if sizes is None:
                        uneven, recast = _floor_form(node, shape, scales, off)
                        off = sorted({*off, *uneven})
                        if recast:
                            details.append(f"{edit.node_label(node)}: {recast}")
                if off:
                    rewritten = _rewrite(node, shape, scales, off, new_init, namer, sizes)
        if rewritten is None:
            nodes.append(node)
            continue
        replacement, what = rewritten
        nodes.extend(replacement)
        details.append(f"{edit.node_label(node)}: a length the HTP gets wrong; {what}")
    if details:
        edit.set_nodes(graph, nodes)
    return edit.checked_change(model, "resize_for_htp", details)


def _axis_matrix(
    node: onnx.NodeProto, size: int, scale: float | None, length: int | None
) -> np.ndarray:
    """[out, in]: the weights onnxruntime's own Resize (``node``'s attributes) gives each input
    row of one axis of ``size`` in each output row, read off by resizing the identity (its
    rows are the batch, its columns the resized axis)."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    attrs.pop("axes", None)
    identity = np.eye(size, dtype=np.float32)
    return np.ascontiguousarray(_onnxruntime_resize(identity, scale, length, **attrs).T)


def antialiased_resizes_as_matmuls(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """An antialiased Resize (opset 18; torchvision's ``Resize(antialias=True)`` and
    ``interpolate(..., antialias=True)`` baked into a graph) -> one MatMul by a constant per
    axis it changes: the QNN EP takes no antialias and leaves the op, with its Q/DQ, on the
    CPU in a partition of its own. Antialiasing widens the filter by the scale, so each output
    row is a fixed weighted sum of input rows along each axis, separably: the weights are read
    off onnxruntime's own Resize with the node's attributes, so every mode and coordinate
    transformation is matched. The last axis: x @ A^T; the one before: A @ x (a leading
    constant broadcast over the batch axes). Static input shape, constant scales or sizes, and
    only the last two axes changed; anything else is left. One that only enlarges loses the
    attribute instead (antialiasing filters only when downscaling: the same values)."""
    inits = edit.initializers_by_name(model.graph)
    values: dict[str, onnx.ValueInfoProto] | None = None
    plans: dict[int, tuple[int, list[tuple[int, np.ndarray]]]] = {}
    growing: set[int] = set()
    for index, node in enumerate(model.graph.node):
        antialias = any(a.name == "antialias" and a.i for a in node.attribute)
        if node.op_type != "Resize" or node.domain not in _DEFAULT or not antialias:
            continue
        if any(a.name == "axes" for a in node.attribute) or _nearest(node):
            continue  # antialias applies to linear and cubic only
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if _text(attrs.get("coordinate_transformation_mode"), "half_pixel") == "tf_crop_and_resize":
            continue  # its roi input moves the coordinates: not read off here
        if _text(attrs.get("keep_aspect_ratio_policy"), "stretch") != "stretch":
            continue  # the sizes are fitted over the axes together
        by_scales = len(node.input) >= 3 and node.input[2] in inits
        by_sizes = len(node.input) >= 4 and node.input[3] in inits
        if by_scales == by_sizes:
            continue
        if values is None:
            values = edit.inferred_values(model)
        value = values.get(node.input[0])
        shape = edit.value_shape(value) if value is not None else None
        target = numpy_helper.to_array(inits[node.input[3 if by_sizes else 2]]).reshape(-1)
        if shape is None or len(shape) < 2 or len(shape) != target.size:
            continue
        if by_sizes:
            changed = [a for a in range(len(shape)) if int(target[a]) != shape[a]]
        else:
            changed = [a for a in range(len(shape)) if float(target[a]) != 1.0]
        if not changed:
            continue
        outs = [int(target[a]) if by_sizes else _out(shape[a], float(target[a])) for a in changed]
        if all(out >= shape[a] for a, out in zip(changed, outs, strict=True)):
            growing.add(index)  # antialiasing filters only what shrinks: a plain Resize
            continue
        if min(changed) < len(shape) - 2:
            continue
        plans[index] = (
            len(shape),
            [
                (
                    axis,
                    _axis_matrix(
                        node,
                        shape[axis],
                        None if by_sizes else float(target[axis]),
                        int(target[axis]) if by_sizes else None,
                    ),
                )
                for axis in changed
            ],
        )
    if not plans and not growing:
        return model, Change("antialiased_resizes_as_matmuls")
    result = edit.copy_model(model)
    rewrite = edit.NodeRewrite(result)
    nodes: list[onnx.NodeProto] = []
    details = []
    for index, node in enumerate(result.graph.node):
        if index in growing:
            kept = [a for a in node.attribute if a.name != "antialias"]
            del node.attribute[:]
            node.attribute.extend(kept)
            details.append(f"{edit.node_label(node)}: enlarges only, antialias dropped (no effect)")
        if index not in plans:
            nodes.append(node)
            continue
        current = node.input[0]
        rank, axes = plans[index]
        steps = sorted(axes, key=lambda p: -p[0])  # the last axis first
        base = node.name or node.output[0]
        for number, (axis, weights) in enumerate(steps):
            out = node.output[0] if number == len(steps) - 1 else rewrite.fresh(f"{base}_rows")
            if axis == rank - 1:
                matrix = rewrite.constant(weights.T.copy(), f"{base}_columns_weights")
                nodes.append(onnx.helper.make_node("MatMul", [current, matrix], [out]))
            else:
                matrix = rewrite.constant(weights, f"{base}_rows_weights")
                nodes.append(onnx.helper.make_node("MatMul", [matrix, current], [out]))
            current = out
        sizes = " x ".join(f"{w.shape[1]} -> {w.shape[0]}" for _, w in reversed(steps))
        details.append(f"{edit.node_label(node)}: antialiased {sizes}, as MatMuls by its weights")
    edit.set_nodes(result.graph, nodes)
    edit.remove_dead_nodes(result.graph)
    return edit.checked_change(result, "antialiased_resizes_as_matmuls", details)
