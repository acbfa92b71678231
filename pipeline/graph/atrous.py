"""Atrous convolutions spelled as space-to-batch, Conv, batch-to-space -> one dilated Conv.

TensorFlow computes a dilated convolution as SpaceToBatchND (pad, then deal every b-th pixel
into b*b images stacked along the batch), a plain Conv over that batch, and BatchToSpaceND
(interleave them back, crop). tf2onnx fuses the three into a Conv with dilations only when the
paddings are constants; with a dynamic input size (TF DeepLab's frozen graphs, Keras models
exported without a fixed size) it writes them out as data movement: Pad, Transpose, SpaceToDepth,
6-D Reshape/Squeeze chains, DepthToSpace, Slice. Once the input shapes are fixed every shape in
those chains is constant, but the HTP holds no 6-D tensor: a fingerprint network's atrous stem
left its rank-6 Reshape, Squeeze and their Q/DQ on the CPU (among 30 CPU nodes, 6 partitions;
``rank.collapse_high_rank_reshapes`` now lowers such chains too). Even whole on the NPU, the
moves copy the full-resolution tensor several times around one convolution the HTP computes
natively with its dilations.

A chain of pure data movement maps each output element to one input element (or to a pad zero),
so it is identified by running it on the input's element numbers (``onnx.reference``, float64:
exact), not by the ops it is spelled with. A Conv whose batch is b*b times its chain's source
batch, fed by a chain that is exactly space-to-batch of that source (any layout, any pads) and
feeding a chain that is exactly batch-to-space (any layout, any crop), is the source convolved
with dilation b: the pads become the Conv's pads (less the crop), the layouts one Transpose
each. Anything else (a chain that reorders differently, negative pads, strides) is left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import permutations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from . import edit
from .edit import Change
from .legacy import text_attribute
from .rank import moves_only_unit_axes

STEP = "space_to_batch_convs"
# Ops that only move, copy or zero-pad elements; their other inputs must be constants.
_MOVES = frozenset(
    {"Pad", "Transpose", "SpaceToDepth", "DepthToSpace", "Reshape", "Squeeze", "Unsqueeze"}
    | {"Flatten", "Slice", "Identity"}
)
# Element numbers of a chain's source, float64: exact to 2**53, 8 bytes each.
MAX_ELEMENTS = 1 << 22  # 32 MiB an array; a few are alive at once
_DEFAULT = ("", "ai.onnx")


@dataclass(frozen=True)
class _Chain:
    nodes: list[onnx.NodeProto]  # in data order
    source: str
    end: str


def _movement(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> bool:
    """A node that only moves elements of its first input (its other inputs constants)."""
    if node.op_type not in _MOVES or node.domain not in _DEFAULT:
        return False
    if any(name and name not in inits for name in node.input[1:]):
        return False
    if node.op_type == "Pad":
        mode = edit.attribute(node, "mode", b"constant")
        value = node.input[2] if len(node.input) > 2 else ""
        zero = not value or not np.any(numpy_helper.to_array(inits[value]))
        return mode in (b"constant", "constant") and zero
    return True


def _run_chain(
    chain: list[onnx.NodeProto],
    source: str,
    end: str,
    shape: tuple[int, ...],
    inits: dict[str, onnx.TensorProto],
) -> np.ndarray:
    """The chain run on the source's element numbers 1..n (0: a pad zero), float64."""
    from onnx.reference import ReferenceEvaluator

    constants = {n for node in chain for n in node.input[1:] if n}
    nodes = [helper.make_node(n.op_type, list(n.input), list(n.output)) for n in chain]
    for new, old in zip(nodes, chain, strict=True):
        new.attribute.extend(old.attribute)
        if old.op_type == "Pad" and len(old.input) > 2:  # zero either way; float64 here
            del new.input[2:]
    used = {n for node in nodes for n in node.input if n}
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info(source, onnx.TensorProto.DOUBLE, list(shape))],
        [helper.make_tensor_value_info(end, onnx.TensorProto.DOUBLE, None)],
        [inits[n] for n in sorted(constants & used)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    ids = np.arange(1, int(np.prod(shape)) + 1, dtype=np.float64).reshape(shape)
    return np.asarray(ReferenceEvaluator(model).run(None, {source: ids})[0])


def _space_to_batch(x: np.ndarray, pads: tuple[int, int, int, int], bh: int, bw: int) -> np.ndarray:
    """TF's SpaceToBatchND of an NCHW array: batch index (i * bw + j) * N + n."""
    top, left, bottom, right = pads
    x = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))
    n, c, h, w = x.shape
    x = x.reshape(n, c, h // bh, bh, w // bw, bw).transpose(3, 5, 0, 1, 2, 4)
    return x.reshape(bh * bw * n, c, h // bh, w // bw)


def _batch_to_space(y: np.ndarray, n: int, bh: int, bw: int) -> np.ndarray:
    """TF's BatchToSpaceND to NCHW, uncropped: the inverse of ``_space_to_batch``."""
    _, k, h, w = y.shape
    y = y.reshape(bh, bw, n, k, h, w).transpose(2, 3, 4, 0, 5, 1)
    return y.reshape(n, k, h * bh, w * bw)


@dataclass(frozen=True)
class _Into:
    """How the source becomes the Conv's input: NCHW by ``perm``, padded, dealt by ``block``."""

    perm: tuple[int, ...]
    pads: tuple[int, int, int, int]  # top, left, bottom, right
    block: tuple[int, int]


def _match_space_to_batch(
    ids: np.ndarray, source: tuple[int, ...], conv_in: tuple[int, ...]
) -> _Into | None:
    """The layout, pads and block for which ``ids`` is exactly the source dealt into a batch."""
    batch = conv_in[0]
    first = ids[0, 0][ids[0, 0] > 0]  # block (0, 0), image 0, channel 0: its first real pixel
    if first.size == 0:
        return None
    at = np.argwhere(ids[0, 0] == first[0])[0]
    origin = np.unravel_index(int(first[0]) - 1, source)
    numbered = np.arange(1, int(np.prod(source)) + 1, dtype=np.float64).reshape(source)
    for perm in permutations(range(4)):
        n, c, h, w = (source[p] for p in perm)
        if c != conv_in[1] or batch % n or batch == n:
            continue
        row, col = (int(origin[p]) for p in perm[2:])
        blocks = batch // n
        for bh in (b for b in range(1, blocks + 1) if blocks % b == 0):
            bw = blocks // bh
            top, left = int(at[0]) * bh - row, int(at[1]) * bw - col
            bottom, right = conv_in[2] * bh - h - top, conv_in[3] * bw - w - left
            pads = (top, left, bottom, right)
            if min(pads) < 0:
                continue
            if np.array_equal(_space_to_batch(numbered.transpose(perm), pads, bh, bw), ids):
                return _Into(perm, pads, (bh, bw))
    return None


@dataclass(frozen=True)
class _OutOf:
    """How the Conv's output becomes the chain's end: interleaved, cropped, then ``perm``."""

    crop: tuple[int, int, int, int]  # top, left, bottom, right
    perm: tuple[int, ...]


def _match_batch_to_space(
    ids: np.ndarray, conv_out: tuple[int, ...], n: int, block: tuple[int, int]
) -> _OutOf | None:
    bh, bw = block
    if ids.ndim != 4 or conv_out[0] != n * bh * bw:
        return None
    numbered = np.arange(1, int(np.prod(conv_out)) + 1, dtype=np.float64).reshape(conv_out)
    full = _batch_to_space(numbered, n, bh, bw)
    height, width = full.shape[2:]
    for perm in permutations(range(4)):
        nchw_shape = [0, 0, 0, 0]
        for axis, p in enumerate(perm):
            nchw_shape[p] = ids.shape[axis]
        if nchw_shape[:2] != [n, conv_out[1]]:
            continue
        out_h, out_w = nchw_shape[2:]
        if out_h > height or out_w > width:
            continue
        where = np.argwhere(full[0, 0] == ids.flat[0])  # the NCHW origin is every layout's
        if where.size == 0:
            continue
        top, left = (int(v) for v in where[0])
        if top + out_h > height or left + out_w > width:
            continue
        cropped = full[:, :, top : top + out_h, left : left + out_w]
        if np.array_equal(cropped.transpose(perm), ids):
            return _OutOf((top, left, height - top - out_h, width - left - out_w), perm)
    return None


def _upstream(name: str, nodes: list[onnx.NodeProto], producer: dict[str, int], inits) -> list[int]:
    chain: list[int] = []
    while (at := producer.get(name)) is not None and _movement(nodes[at], inits):
        chain.append(at)
        name = nodes[at].input[0]
    return chain[::-1]


def _downstream(
    name: str, nodes: list[onnx.NodeProto], readers: dict[str, list[int]], inits, outputs: set[str]
) -> list[int]:
    chain: list[int] = []
    while name not in outputs and len(readers.get(name, [])) == 1:
        at = readers[name][0]
        node = nodes[at]
        if not _movement(node, inits) or list(node.input).count(name) != 1 or node.input[0] != name:
            break
        chain.append(at)
        name = node.output[0]
    return chain


def space_to_batch_convs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """Each Conv between exact space-to-batch and batch-to-space chains -> a dilated Conv."""
    nodes = list(model.graph.node)
    inits = edit.initializers_by_name(model.graph)
    convs = [
        i
        for i, n in enumerate(nodes)
        if n.op_type == "Conv" and n.domain in _DEFAULT and len(n.input) > 1
    ]
    if not convs:
        return model, Change(STEP)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    readers: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for name in dict.fromkeys(x for x in n.input if x):
            readers.setdefault(name, []).append(i)
    if not any(
        _movement(nodes[producer[nodes[i].input[0]]], inits)
        for i in convs
        if nodes[i].input[0] in producer
    ):
        return model, Change(STEP)
    values = edit.inferred_values(model)

    def shape(name: str) -> tuple[int, ...] | None:
        return edit.value_shape(values[name]) if name in values else None

    outputs = {o.name for o in model.graph.output}
    replaced: dict[int, list[onnx.NodeProto]] = {}
    dropped: set[int] = set()
    details: list[str] = []
    layouts: dict[tuple[str, str, tuple[int, ...]], str] = {}
    shapes: list[onnx.TensorProto] = []  # the targets of layout moves written as Reshapes
    for at in convs:
        conv = nodes[at]
        into_chain = _upstream(conv.input[0], nodes, producer, inits)
        out_chain = _downstream(conv.output[0], nodes, readers, inits, outputs)
        found = _rewrite(
            conv, [nodes[i] for i in into_chain], [nodes[i] for i in out_chain], shape, inits
        )
        if found is None:
            continue
        replacement, detail = found
        for move in replacement:
            if move.op_type == "Transpose":
                _as_reshape_if_unit_axes(move, shape, shapes)
        move = replacement[0]
        if move.op_type != "Conv":  # one layout move per source, however many Convs read it
            key = (move.op_type, move.input[0], tuple(edit.attribute(move, "perm", [])))
            if key in layouts:
                replacement = replacement[1:]
                replacement[0].input[0] = layouts[key]
            else:
                layouts[key] = move.output[0]
        replaced[at] = replacement
        dropped.update(out_chain)  # read by this Conv alone; the chain before it may be shared
        details.append(detail)
    if not details:
        return model, Change(STEP)
    result = edit.copy_model(model)
    kept: list[onnx.NodeProto] = []
    for i, node in enumerate(result.graph.node):
        if i in replaced:
            kept.extend(replaced[i])
        elif i not in dropped:
            kept.append(node)
    edit.set_nodes(result.graph, kept)
    result.graph.initializer.extend(shapes)
    edit.sort_graph(result.graph)
    edit.remove_dead_nodes(result.graph)  # the chains into the Convs, unless read elsewhere
    return edit.checked_change(result, STEP, details)


def _as_reshape_if_unit_axes(
    move: onnx.NodeProto,
    shape: Callable[[str], tuple[int, ...] | None],
    shapes: list[onnx.TensorProto],
) -> None:
    """A Transpose that moves only axes of size 1 -> the Reshape it is. On a graph input the
    QNN EP may take a Transpose for a layout change of its own: a fingerprint network's context
    then failed to run ("ORT Tensor data size does not match QNN tensor data size")."""
    perm = [int(p) for p in edit.attribute(move, "perm", [])]
    before, out = shape(move.input[0]), shape(move.output[0])  # one is new: no shape yet
    if before is not None:
        out = tuple(before[p] for p in perm)
    elif out is not None:
        before = tuple(out[perm.index(axis)] for axis in range(len(perm)))
    else:
        return
    if not moves_only_unit_axes(before, perm):
        return
    target = f"{move.output[0]}/shape"
    shapes.append(numpy_helper.from_array(np.array(out, np.int64), target))
    move.op_type = "Reshape"
    del move.attribute[:]
    move.input.append(target)


def _rewrite(
    conv: onnx.NodeProto,
    into_chain: list[onnx.NodeProto],
    out_chain: list[onnx.NodeProto],
    shape: Callable[[str], tuple[int, ...] | None],
    inits: dict[str, onnx.TensorProto],
) -> tuple[list[onnx.NodeProto], str] | None:
    """The dilated Conv (and layout moves) for one Conv, or None when it is not atrous."""
    conv_in, conv_out = shape(conv.input[0]), shape(conv.output[0])
    if not into_chain or not out_chain or conv_in is None or conv_out is None:
        return None
    if len(conv_in) != 4 or len(conv_out) != 4 or conv_in[0] == 1:
        return None
    if text_attribute(edit.attribute(conv, "auto_pad", None), "NOTSET") not in ("NOTSET", "VALID"):
        return None
    strides, dilations = (edit.attribute(conv, a, [1, 1]) for a in ("strides", "dilations"))
    if any(s != 1 for s in (*strides, *dilations)):
        return None
    if max(np.prod(conv_in), np.prod(conv_out)) > MAX_ELEMENTS:
        return None
    own = [int(p) for p in edit.attribute(conv, "pads", [0, 0, 0, 0])]
    end = out_chain[-1].output[0]
    for start in range(len(into_chain)):  # the longest chain first: it may fold a layout move
        chain = into_chain[start:]
        source = chain[0].input[0]
        source_shape = shape(source)
        if source_shape is None or len(source_shape) != 4 or np.prod(source_shape) > MAX_ELEMENTS:
            continue
        ids = _run_chain(chain, source, conv.input[0], source_shape, inits)
        into = _match_space_to_batch(ids, source_shape, conv_in)
        if into is None:
            continue
        batch = source_shape[into.perm[0]]
        out_ids = _run_chain(out_chain, conv.output[0], end, conv_out, inits)
        out_of = _match_batch_to_space(out_ids, conv_out, batch, into.block)
        if out_of is None:
            return None
        return _dilated(conv, source, end, into, out_of, own, len(chain) + len(out_chain))
    return None


def _dilated(
    conv: onnx.NodeProto,
    source: str,
    end: str,
    into: _Into,
    out_of: _OutOf,
    own: list[int],
    moves: int,
) -> tuple[list[onnx.NodeProto], str] | None:
    bh, bw = into.block
    # The Conv's own pads pad each dealt image: b rows of the source each.
    padded = [p + q * b for p, q, b in zip(into.pads, own, (bh, bw, bh, bw), strict=True)]
    pads = [p - c for p, c in zip(padded, out_of.crop, strict=True)]
    if min(pads) < 0:
        return None
    name = conv.name or conv.output[0]
    nodes: list[onnx.NodeProto] = []
    x = source
    if into.perm != (0, 1, 2, 3):
        x = f"{name}/nchw"
        nodes.append(
            helper.make_node("Transpose", [source], [x], f"{name}/to_nchw", perm=list(into.perm))
        )
    y = end if out_of.perm == (0, 1, 2, 3) else f"{name}/dilated"
    attrs = {
        a.name: helper.get_attribute_value(a)
        for a in conv.attribute
        if a.name not in ("pads", "dilations", "auto_pad", "strides")
    }
    nodes.append(
        helper.make_node(
            "Conv", [x, *conv.input[1:]], [y], name, dilations=[bh, bw], pads=pads, **attrs
        )
    )
    if y != end:
        nodes.append(
            helper.make_node("Transpose", [y], [end], f"{name}/to_layout", perm=list(out_of.perm))
        )
    detail = (
        f"{edit.node_label(conv)} between space-to-batch and batch-to-space ({moves} moves) -> "
        f"Conv with dilations [{bh}, {bw}], pads {pads}"
    )
    return nodes, detail


# A dilated Conv whose kernel, spread by its dilations, covers this many input values (spans
# times input channels per group) or more: the HTP fails to finalize the graph (measured, HTP
# v73, 128 channels, kernel 3: dilation 1800 compiled, 2047 failed with QNN_COMMON_ERROR_MEM_ALLOC;
# 16 channels at dilation 2048 compiled). Half the smallest failing footprint, for margin.
WIDE_FOOTPRINT = 1 << 18


def split_wide_dilations(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A Conv with a dilated kernel too wide for the HTP -> its taps as slices and one 1x1 Conv.

    Why: a temporal convolution network (WaveNet-style, dilations doubling to 4096 over a
    1-D signal of 7,500 samples) failed to compile at all: "Failed to finalize QNN graph ...
    QNN_COMMON_ERROR_MEM_ALLOC". The Conv is the same sum over its taps: tap j reads the input
    shifted by j * dilation, so the k shifted slices stacked along the channels and one 1x1
    Conv with the taps' weights side by side compute it exactly (up to float summation order).
    Only Convs with stride 1, one group and no pads change (a TCN pads by a Concat of zeros
    before it, which stays as it is).
    """
    graph = model.graph
    inits = edit.initializers_by_name(graph)
    wide = [
        i
        for i, n in enumerate(graph.node)
        if n.op_type == "Conv"
        and n.domain in _DEFAULT
        and n.input[1] in inits
        and _footprint(n, inits[n.input[1]]) >= WIDE_FOOTPRINT
    ]
    if not wide:
        return model, Change("split_wide_dilations")
    values = edit.inferred_values(model)
    result = edit.copy_model(model)
    fresh = edit.FreshNames(result)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    details = []
    for index in wide:
        node = result.graph.node[index]
        shape = edit.value_shape(values[node.input[0]]) if node.input[0] in values else None
        found = _taps(node, numpy_helper.to_array(inits[node.input[1]]), shape, fresh, result)
        if found is not None:
            replaced[index], detail = found
            details.append(detail)
    if not details:
        return model, Change("split_wide_dilations")
    nodes = []
    for index, node in enumerate(result.graph.node):
        nodes.extend(replaced.get(index, [node]))
    edit.set_nodes(result.graph, nodes)
    edit.remove_dead_nodes(result.graph)
    return edit.checked_change(result, "split_wide_dilations", details)


def _footprint(conv: onnx.NodeProto, weight: onnx.TensorProto) -> int:
    """Input values one output reads: the dilated spans times the input channels of a group."""
    kernel = list(weight.dims[2:])
    dilations = edit.attribute(conv, "dilations", [1] * len(kernel))
    if len(dilations) != len(kernel) or max(dilations, default=1) <= 1:
        return 0
    spans = [(k - 1) * d + 1 for k, d in zip(kernel, dilations, strict=True)]
    return int(np.prod(spans)) * int(weight.dims[1])


def _taps(
    conv: onnx.NodeProto,
    weight: np.ndarray,
    shape: tuple[int, ...] | None,
    fresh: edit.FreshNames,
    model: onnx.ModelProto,
) -> tuple[list[onnx.NodeProto], str] | None:
    kernel = list(weight.shape[2:])
    rank = len(kernel)
    dilations = [int(d) for d in edit.attribute(conv, "dilations", [1] * rank)]
    if shape is None or len(shape) != rank + 2 or int(edit.attribute(conv, "group", 1)) != 1:
        return None
    if text_attribute(edit.attribute(conv, "auto_pad", None), "NOTSET") not in ("NOTSET", "VALID"):
        return None
    if any(int(p) for p in edit.attribute(conv, "pads", [0] * 2 * rank)):
        return None
    if any(int(s) != 1 for s in edit.attribute(conv, "strides", [1] * rank)):
        return None
    out = [n - (k - 1) * d for n, k, d in zip(shape[2:], kernel, dilations, strict=True)]
    if min(out) <= 0:
        return None
    base = conv.name or conv.output[0]

    def constant(values: list[int] | np.ndarray, tag: str) -> str:
        name = fresh(f"{base}/{tag}")
        array = np.asarray(values, np.int64) if isinstance(values, list) else values
        model.graph.initializer.append(numpy_helper.from_array(array, name))
        return name

    axes = constant(list(range(2, rank + 2)), "tap_axes")
    nodes, slices = [], []
    for tap in np.ndindex(*kernel):
        starts = [int(j) * d for j, d in zip(tap, dilations, strict=True)]
        ends = [s + n for s, n in zip(starts, out, strict=True)]
        sliced = fresh(f"{base}/tap{'_'.join(map(str, tap))}")
        nodes.append(
            helper.make_node(
                "Slice",
                [conv.input[0], constant(starts, "tap_starts"), constant(ends, "tap_ends"), axes],
                [sliced],
                sliced,
            )
        )
        slices.append(sliced)
    stacked = fresh(f"{base}/taps")
    nodes.append(helper.make_node("Concat", slices, [stacked], stacked, axis=1))
    # Tap-major channels: the Concat puts tap t's C channels at t * C.
    flat = weight.reshape(weight.shape[0], weight.shape[1], -1).transpose(0, 2, 1)
    pointwise = flat.reshape(weight.shape[0], -1, *([1] * rank)).astype(weight.dtype)
    inputs = [stacked, constant(pointwise, "taps_weight"), *conv.input[2:]]
    nodes.append(
        helper.make_node("Conv", inputs, list(conv.output), conv.name, kernel_shape=[1] * rank)
    )
    detail = (
        f"{edit.node_label(conv)}: kernel {kernel} at dilations {dilations} -> "
        f"{len(slices)} shifted slices and a 1x1 Conv"
    )
    return nodes, detail
