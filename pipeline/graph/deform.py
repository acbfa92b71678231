"""Deformable convolution (ONNX DeformConv, opset 19) -> bilinear samples and one 1x1 Conv.

A deformable Conv (DCNv1/v2: torchvision's ``deform_conv2d``, mmcv's ``ModulatedDeformConv2d``,
in DBNet++ text detectors, CenterNet-DCN, PP-YOLO) reads each kernel tap at its own learned,
fractional place, bilinearly, and DCNv2 weighs each tap by a mask. The QNN EP takes no DeformConv:
the op stays on the CPU and cuts the graph in two. Each tap is a GridSample of the input at the
tap's places (the output grid, moved by the tap's offsets, in align_corners coordinates whose
zero padding is the op's own: a corner outside the image adds nothing), weighed by its mask; the
taps side by side along the channels, one 1x1 Conv with the kernel's weights computes the sums.
The same function up to float rounding, with ops the HTP runs quantized.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from . import edit
from .edit import DEFAULT_DOMAINS, Change


def deform_conv_to_grid_samples(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Each DeformConv with a constant weight, one group (any offset groups), static shapes
    and an input larger than 1x1 -> per tap and offset group a GridSample (times its mask), a
    Concat and a 1x1 Conv. Others are left as they are."""
    return edit.replace_by_op(
        edit.passed_on(model),
        "deform_conv_to_grid_samples",
        {"DeformConv": _as_grid_samples},
        DEFAULT_DOMAINS,
    )


def _as_grid_samples(
    node: onnx.NodeProto, context: edit.NodeRewrite
) -> tuple[list[onnx.NodeProto], str] | None:
    weight = context.inits.get(node.input[1])
    x_shape, offset_shape = context.shape(node.input[0]), context.shape(node.input[2])
    if weight is None or x_shape is None or offset_shape is None or len(x_shape) != 4:
        return None
    if int(edit.attribute(node, "group", 1)) != 1:
        return None
    groups = int(edit.attribute(node, "offset_group", 1))
    w = numpy_helper.to_array(weight)
    kernel_h, kernel_w = (int(k) for k in w.shape[2:])
    taps = kernel_h * kernel_w
    _, channels, height, width = x_shape
    _, offsets, out_h, out_w = offset_shape
    if offsets != 2 * taps * groups or channels % groups or height < 2 or width < 2:
        return None
    stride_h, stride_w = (int(s) for s in edit.attribute(node, "strides", [1, 1]))
    dil_h, dil_w = (int(d) for d in edit.attribute(node, "dilations", [1, 1]))
    pad_top, pad_left = (int(p) for p in edit.attribute(node, "pads", [0, 0, 0, 0])[:2])
    base = node.name or node.output[0]
    fresh, nodes = context.fresh, []
    mask = node.input[4] if len(node.input) > 4 and node.input[4] else ""

    def constant(array: np.ndarray, tag: str) -> str:
        return context.constant(array, f"{base}/{tag}")

    def channels_of(source: str, start: int, stop: int, tag: str) -> str:
        out = fresh(f"{base}/{tag}")
        bounds = [constant(np.array([v], np.int64), f"{tag}_{end}") for v, end in
                  ((start, "from"), (stop, "to"))]  # fmt: skip
        nodes.append(helper.make_node("Slice", [source, *bounds, axis], [out], out))
        return out

    axis = constant(np.array([1], np.int64), "channel_axis")
    mode = "linear" if edit.opset_version(context.model) >= 20 else "bilinear"  # renamed in 20
    # normalized = (place + offset) * 2 / (size - 1) - 1, offsets laid out (dy, dx) per tap
    to_norm = np.array([2.0 / (height - 1), 2.0 / (width - 1)], np.float32).reshape(1, 2, 1, 1)
    scale = constant(to_norm, "offset_scale")
    rows = np.arange(out_h, dtype=np.float64) * stride_h - pad_top
    cols = np.arange(out_w, dtype=np.float64) * stride_w - pad_left
    width_of_group = channels // groups
    inputs = [node.input[0]] if groups == 1 else [
        channels_of(node.input[0], g * width_of_group, (g + 1) * width_of_group, f"group{g}")
        for g in range(groups)
    ]  # fmt: skip
    sampled = []
    for tap in range(taps):
        i, j = divmod(tap, kernel_w)
        place = np.zeros((1, 2, out_h, out_w), np.float64)
        place[0, 0] = (rows + i * dil_h)[:, None]
        place[0, 1] = (cols + j * dil_w)[None, :]
        norm = constant((place * to_norm.astype(np.float64) - 1.0).astype(np.float32),
                        f"tap{i}_{j}_place")  # fmt: skip
        for g, source in enumerate(inputs):
            tag = f"tap{i}_{j}" + (f"_group{g}" if groups > 1 else "")
            first = 2 * (g * taps + tap)
            offset = channels_of(node.input[2], first, first + 2, f"{tag}_offset")
            names = {p: fresh(f"{base}/{tag}_{p}") for p in ("moved", "at", "xy", "grid")}
            nodes += [
                helper.make_node("Mul", [offset, scale], [names["moved"]], names["moved"]),
                helper.make_node("Add", [names["moved"], norm], [names["at"]], names["at"]),
                # (y, x) channels -> GridSample's [N, H, W, (x, y)]
                helper.make_node(
                    "Gather", [names["at"], constant(np.array([1, 0], np.int64), f"{tag}_xy")],
                    [names["xy"]], names["xy"], axis=1,
                ),
                helper.make_node(
                    "Transpose", [names["xy"]], [names["grid"]], names["grid"], perm=[0, 2, 3, 1]
                ),
            ]  # fmt: skip
            value = fresh(f"{base}/{tag}_sampled")
            nodes.append(
                helper.make_node(
                    "GridSample", [source, names["grid"]], [value], value,
                    mode=mode, padding_mode="zeros", align_corners=1,
                )
            )  # fmt: skip
            if mask:
                index = g * taps + tap
                weight_of_tap = channels_of(mask, index, index + 1, f"{tag}_mask")
                weighed = fresh(f"{base}/{tag}_weighed")
                nodes.append(helper.make_node("Mul", [value, weight_of_tap], [weighed], weighed))
                value = weighed
            sampled.append(value)
    stacked = fresh(f"{base}/taps")
    nodes.append(helper.make_node("Concat", sampled, [stacked], stacked, axis=1))
    # tap-major channels (its offset groups in order within a tap): tap t's C at t * C
    pointwise = w.reshape(w.shape[0], channels, taps).transpose(0, 2, 1)
    pointwise = pointwise.reshape(w.shape[0], taps * channels, 1, 1).astype(w.dtype)
    inputs = [stacked, constant(pointwise, "pointwise")]
    if len(node.input) > 3 and node.input[3]:
        inputs.append(node.input[3])
    nodes.append(helper.make_node("Conv", inputs, list(node.output), base, kernel_shape=[1, 1]))
    kind = "modulated " if mask else ""
    grouped = f", {groups} offset groups" if groups > 1 else ""
    return nodes, (
        f"{edit.node_label(node)}: {kernel_h}x{kernel_w} {kind}deformable Conv{grouped} -> "
        f"{taps * groups} GridSamples and a 1x1 Conv"
    )
