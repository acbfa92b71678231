"""Audio front ends written as ONNX's spectral ops -> the convolutions and products they are.

A model that computes its own spectrogram (``torch.stft`` exports ``STFT``, ``torch.fft.rfft``
``DFT``, both from opset 17) hands the QNN EP ops it either leaves on the CPU (``DFT``: the graph
is cut in two) or compiles only in fp16 (``STFT`` quantized: "Failed to finalize QNN graph",
a memory allocation error, measured on the simulator). With a constant frame step, window and
length, both are linear maps of the signal: a short-time Fourier transform is a strided Conv
whose kernels are the windowed cosines and sines, a DFT along an axis is a MatMul with them. The
rewrites here compute the same values (up to the order of float sums) with ops the HTP runs
quantized or in fp16. A DFT of a complex signal or an inverse DFT is one MatMul with a block
basis over the real and imaginary parts.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .edit import (
    DEFAULT_DOMAINS,
    Change,
    FreshNames,
    checked_change,
    inferred_values,
    initializers_by_name,
    int_constant,
    node_label,
    passed_on,
    set_nodes,
    value_shape,
    writable,
)


def fourier_basis(length: int, size: int, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """[size, bins] real and imaginary parts of a ``length``-point DFT of a real signal of
    ``size`` samples (zero-padded to, or cut at, ``length``): X[k] = sum_n x[n] e^(-2 pi i k n / L).
    Angles reduced modulo the length in integers, so large k n lose no precision."""
    n = np.arange(size, dtype=np.int64)[:, None]
    k = np.arange(bins, dtype=np.int64)[None, :]
    angle = 2.0 * np.pi * ((n * k) % length) / length
    keep = (n < length).astype(np.float64)
    return np.cos(angle) * keep, -np.sin(angle) * keep


class _Site:
    """What a rewrite of one node reads: the graph, its initializers, fresh names, and the
    model's inferred value infos (computed once, on first use)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.graph = model.graph
        self.inits = initializers_by_name(model.graph)
        self.fresh = FreshNames(model)
        self._values: dict[str, onnx.ValueInfoProto] | None = None

    @property
    def values(self) -> dict[str, onnx.ValueInfoProto]:
        if self._values is None:
            self._values = inferred_values(self.model)
        return self._values


def _replace_each(
    model: onnx.ModelProto,
    op_type: str,
    step: str,
    rewrite: Callable[[onnx.NodeProto, _Site], tuple[list[onnx.NodeProto], str] | None],
) -> tuple[onnx.ModelProto, Change]:
    """Each ``op_type`` node (standard domain) replaced by what ``rewrite`` returns for it."""
    model = writable(model)
    site = _Site(model)
    nodes: list[onnx.NodeProto] = []
    details = []
    for node in model.graph.node:
        done = None
        if node.op_type == op_type and node.domain in DEFAULT_DOMAINS:
            done = rewrite(node, site)
        if done is None:
            nodes.append(node)
            continue
        nodes += done[0]
        details.append(done[1])
    if not details:
        return model, Change(step)
    set_nodes(model.graph, nodes)
    # Shapes stored before are inference's over the old op, which may be wrong (an STFT of a
    # [B, L] signal: its bins, and all after them): the next inference starts afresh.
    del model.graph.value_info[:]
    return checked_change(model, step, details)


def stft_to_conv(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """STFT of a real signal [B, L, 1] (or [B, L], which onnxruntime takes as real and ONNX shape
    inference gets wrong: 400 bins for a 400-sample window's 201) with constant frame step,
    window and frame length ->
    Conv over [B, 1, L] with one kernel per (bin, real/imaginary) part, stride the frame step,
    then Reshape/Transpose to STFT's [B, frames, bins, 2]."""
    return _replace_each(passed_on(model), "STFT", "stft_to_conv", _stft_to_conv_at)


def _stft_to_conv_at(node: onnx.NodeProto, site: _Site) -> tuple[list[onnx.NodeProto], str] | None:
    """The nodes that replace ``node`` and what they do, or None to keep it."""
    graph, inits, values, fresh = site.graph, site.inits, site.values, site.fresh
    shape = value_shape(values[node.input[0]]) if node.input[0] in values else None
    step = int_constant(inits, node.input[1] if len(node.input) > 1 else "")
    window_name = node.input[2] if len(node.input) > 2 else ""
    window = numpy_helper.to_array(inits[window_name]) if window_name in inits else None
    length = int_constant(inits, node.input[3] if len(node.input) > 3 else "")
    if length is None and window is not None:
        length = int(window.size)
    onesided = next((a.i for a in node.attribute if a.name == "onesided"), 1)
    if (
        shape is None
        or not (len(shape) == 2 or (len(shape) == 3 and shape[2] == 1))
        or step is None
        or length is None
        or (window_name and window is None)
        or (window is not None and window.size != length)
        or shape[1] < length
    ):
        return None
    batch, signal = shape[0], shape[1]
    bins = length // 2 + 1 if onesided else length
    frames = 1 + (signal - length) // step
    real, imaginary = fourier_basis(length, length, bins)
    taper = np.ones(length) if window is None else window.astype(np.float64)
    kernels = np.concatenate([(real * taper[:, None]).T, (imaginary * taper[:, None]).T])
    y = node.output[0]
    names = {p: fresh(f"{y}_{p}") for p in ("kernels", "signal", "conv", "parts")}
    graph.initializer.append(
        numpy_helper.from_array(kernels[:, None, :].astype(np.float32), names["kernels"])
    )
    parts_shape = fresh(f"{y}_parts_shape")
    graph.initializer.append(
        numpy_helper.from_array(np.array([batch, 2, bins, frames], np.int64), parts_shape)
    )
    base = node.name or y
    if len(shape) == 2:  # [B, L]: onnxruntime takes it as a real signal, as [B, L, 1]
        axis = fresh(f"{y}_channel_axis")
        graph.initializer.append(numpy_helper.from_array(np.array([1], np.int64), axis))
        to_signal = helper.make_node(
            "Unsqueeze", [node.input[0], axis], [names["signal"]], name=fresh(f"{base}_signal")
        )
    else:
        to_signal = helper.make_node(
            "Transpose", [node.input[0]], [names["signal"]], perm=[0, 2, 1],
            name=fresh(f"{base}_signal"),
        )  # fmt: skip
    nodes = [
        to_signal,
        helper.make_node(
            "Conv", [names["signal"], names["kernels"]], [names["conv"]],
            strides=[step], name=fresh(f"{base}_conv"),
        ),
        helper.make_node(
            "Reshape", [names["conv"], parts_shape], [names["parts"]],
            name=fresh(f"{base}_parts"),
        ),
        helper.make_node(
            "Transpose", [names["parts"]], [y], perm=[0, 3, 2, 1], name=fresh(f"{base}_layout")
        ),
    ]  # fmt: skip
    return nodes, (
        f"{node_label(node)}: {frames} frames of {length} every {step} -> Conv with "
        f"{2 * bins} windowed Fourier kernels"
    )


def dft_to_matmul(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """DFT along a constant axis with a constant length -> MatMuls with its bases.

    A forward DFT of a real signal [..., 1]: Transpose the axis last, MatMul with the cosine
    and sine bases, stack them as DFT's last dimension and Transpose back. A complex signal
    [..., 2] or an inverse DFT (a streaming enhancer's iSTFT, written by the dynamo exporter
    as DFT(inverse=1) of the full spectrum): one MatMul over both parts. An inverse of a half
    spectrum (``onesided``, an irfft: a Fourier convolution's way back) likewise, its conjugate
    half counted twice, to a real signal."""
    return _replace_each(passed_on(model), "DFT", "dft_to_matmul", _dft_to_matmul_at)


def _dft_to_matmul_at(node: onnx.NodeProto, site: _Site) -> tuple[list[onnx.NodeProto], str] | None:
    """The nodes that replace ``node`` and what they do, or None to keep it."""
    graph, inits, values, fresh = site.graph, site.inits, site.values, site.fresh
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    shape = value_shape(values[node.input[0]]) if node.input[0] in values else None
    if "axis" in attrs:  # opset 17-19: an attribute
        axis: int | None = int(attrs["axis"])
    elif len(node.input) > 2 and node.input[2]:  # opset 20: an input
        axis = int_constant(inits, node.input[2])
    else:  # opset 20's default (opset 17's default 1 is spelled out by the converter)
        axis = -2
    given_length = node.input[1] if len(node.input) > 1 else ""
    length = int_constant(inits, given_length) if given_length else None
    if shape is None or axis is None or (given_length and length is None):
        return None
    rank = len(shape)
    axis = axis % rank
    if axis == rank - 1:
        return None
    if shape[-1] == 2 or attrs.get("inverse", 0):
        return _general_dft_at(node, site, shape, axis, length or shape[axis], attrs)
    if shape[-1] != 1:
        return None
    size = shape[axis]
    length = length or size
    bins = length // 2 + 1 if attrs.get("onesided", 0) else length
    real, imaginary = fourier_basis(length, size, bins)
    y = node.output[0]
    # [..., N, ..., 1] -> drop the last dim -> the axis last -> [..., N] @ [N, bins]
    order = [d for d in range(rank - 1) if d != axis] + [axis]
    back = [*(int(p) for p in np.argsort(order)), rank - 1]
    names = {
        p: fresh(f"{y}_{p}")
        for p in ("squeezed", "moved", "real", "imaginary", "re", "im", "stacked")
    }
    last, real_basis, imaginary_basis = (
        fresh(f"{y}_last_axis"),
        fresh(f"{y}_cos"),
        fresh(f"{y}_sin"),
    )
    graph.initializer.extend(
        [
            numpy_helper.from_array(np.array([-1], np.int64), last),
            numpy_helper.from_array(real.astype(np.float32), real_basis),
            numpy_helper.from_array(imaginary.astype(np.float32), imaginary_basis),
        ]
    )
    base = node.name or y
    nodes = [
        helper.make_node(
            "Squeeze", [node.input[0], last], [names["squeezed"]], name=fresh(f"{base}_real")
        ),
        helper.make_node(
            "Transpose", [names["squeezed"]], [names["moved"]], perm=order,
            name=fresh(f"{base}_axis_last"),
        ),
        helper.make_node(
            "MatMul", [names["moved"], real_basis], [names["real"]], name=fresh(f"{base}_cos")
        ),
        helper.make_node(
            "MatMul", [names["moved"], imaginary_basis], [names["imaginary"]],
            name=fresh(f"{base}_sin"),
        ),
        helper.make_node(
            "Unsqueeze", [names["real"], last], [names["re"]], name=fresh(f"{base}_re")
        ),
        helper.make_node(
            "Unsqueeze", [names["imaginary"], last], [names["im"]], name=fresh(f"{base}_im")
        ),
        helper.make_node(
            "Concat", [names["re"], names["im"]], [names["stacked"]], axis=-1,
            name=fresh(f"{base}_stack"),
        ),
        helper.make_node(
            "Transpose", [names["stacked"]], [y], perm=back,
            name=fresh(f"{base}_axis_back"),
        ),
    ]  # fmt: skip
    return nodes, (
        f"{node_label(node)}: {length}-point DFT along axis {axis} ({bins} bins) -> MatMul "
        "with the cosine and sine bases"
    )


def general_dft_basis(length: int, size: int, parts: int, inverse: bool) -> np.ndarray:
    """[parts * size, 2 * length]: the DFT of a signal of ``size`` samples, each ``parts``
    values (1: real; 2: real, imaginary), as one matrix over the parts laid out one after the
    other (planar).

    Row c * size + n holds the weight of x[n] part c, column c' * length + k that of y[k] part
    c': forward y = sum x e^(-2 pi i k n / L), inverse y = (1 / L) sum x e^(+2 pi i k n / L)."""
    cos, minus_sin = fourier_basis(length, size, length)
    sin = -minus_sin
    sign = 1.0 if inverse else -1.0  # e^(sign i angle) = cos + sign i sin
    basis = np.zeros((parts, size, 2, length))
    basis[0, :, 0], basis[0, :, 1] = cos, sign * sin  # (a) (cos + s i sin)
    if parts == 2:  # (i b) (cos + s i sin) = -s b sin + i b cos
        basis[1, :, 0], basis[1, :, 1] = -sign * sin, cos
    if inverse:
        basis /= length
    return basis.reshape(parts * size, 2 * length)


def half_spectrum_inverse_basis(length: int, bins: int) -> np.ndarray:
    """[2 * bins, length]: the inverse DFT of a half spectrum (an irfft; bins = length // 2 + 1,
    real parts then imaginary parts) to a real signal. The bins other than 0 and length / 2
    stand for their conjugates too, so they count twice: y[n] = (1 / L) sum_k w_k (re_k cos -
    im_k sin)(2 pi k n / L)."""
    cos, minus_sin = fourier_basis(length, bins, length)  # [bins, length], angle k n
    weights = np.full((bins, 1), 2.0)
    weights[0] = 1.0
    if length % 2 == 0:
        weights[length // 2] = 1.0
    return np.concatenate([weights * cos, weights * minus_sin]) / length


def _general_dft_at(
    node: onnx.NodeProto,
    site: _Site,
    shape: tuple[int, ...],
    axis: int,
    length: int,
    attrs: dict,
) -> tuple[list[onnx.NodeProto], str] | None:
    """A complex or inverse DFT: the parts moved before the axis, the axis last, the two
    flattened together (planar), one MatMul with ``general_dft_basis``, unflattened and moved
    back. (Interleaved, [..., N, 2] flattened as it lies, the HTP fails to finalize the graph
    in fp16: "QNN_COMMON_ERROR_MEM_ALLOC", measured on the simulator.)"""
    graph, fresh = site.graph, site.fresh
    rank, parts, size = len(shape), shape[-1], shape[axis]
    inverse = bool(attrs.get("inverse", 0))
    half = bool(attrs.get("onesided", 0))  # an irfft: complex half spectrum -> real signal
    if half and not (inverse and parts == 2 and size == length // 2 + 1):
        return None
    out_parts = 1 if half else 2
    y = node.output[0]
    order = [d for d in range(rank - 1) if d != axis] + [rank - 1, axis]
    back = [int(p) for p in np.argsort(order)]
    outer = [shape[d] for d in order[:-2]]
    names = {p: fresh(f"{y}_{p}") for p in ("moved", "flat", "product", "unflat")}
    consts = {p: fresh(f"{y}_{p}_shape") for p in ("flat", "unflat")}
    basis = fresh(f"{y}_dft_basis")
    matrix = (
        half_spectrum_inverse_basis(length, size)
        if half
        else general_dft_basis(length, size, parts, inverse)
    )
    graph.initializer.extend(
        [
            numpy_helper.from_array(np.array([*outer, parts * size], np.int64), consts["flat"]),
            numpy_helper.from_array(
                np.array([*outer, out_parts, length], np.int64), consts["unflat"]
            ),
            numpy_helper.from_array(matrix.astype(np.float32), basis),
        ]
    )
    base = node.name or y
    nodes = [
        helper.make_node(
            "Transpose", [node.input[0]], [names["moved"]], perm=order,
            name=fresh(f"{base}_axis_last"),
        ),
        helper.make_node(
            "Reshape", [names["moved"], consts["flat"]], [names["flat"]],
            name=fresh(f"{base}_planar"),
        ),
        helper.make_node(
            "MatMul", [names["flat"], basis], [names["product"]], name=fresh(f"{base}_basis")
        ),
        helper.make_node(
            "Reshape", [names["product"], consts["unflat"]], [names["unflat"]],
            name=fresh(f"{base}_parts"),
        ),
        helper.make_node(
            "Transpose", [names["unflat"]], [y], perm=back, name=fresh(f"{base}_axis_back")
        ),
    ]  # fmt: skip
    kind = (
        "half-spectrum inverse"
        if half
        else (("inverse " if inverse else "") + ("complex" if parts == 2 else "real"))
    )
    return nodes, (
        f"{node_label(node)}: {length}-point {kind} DFT along axis {axis} -> MatMul with its "
        "basis over the real and imaginary parts"
    )
