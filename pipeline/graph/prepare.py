"""Make a float ONNX model ready for calibration and the QNN HTP backend.

``prepare_model`` chains the transforms of ``pipeline.transforms`` in an order where each one
sees what it needs (initializers before folding, float32 before the opset upgrade, static
shapes before batch-norm folding) and fails loudly, naming tensor and op, if any tensor is
still dynamic at the end: the QNN EP refuses dynamic shapes and says little about why.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..core.errors import ModelError
from . import edit
from .tails import STRING_TYPE, TAIL_DOMAINS, model_tail

if TYPE_CHECKING:
    import onnx

    from ..core.config import InputsSection
    from .edit import Change


def dynamic_tensors(model: onnx.ModelProto) -> list[str]:
    """Tensors whose static shape ONNX schema inference alone cannot give; [] = fully static.

    Stored value_info is ignored (shapes that only data propagation justifies do not count).
    """
    from .edit import dynamic_outputs

    return [name for name, _ in dynamic_outputs(model)]


Step = Callable[["onnx.ModelProto"], tuple["onnx.ModelProto", "Change"]]


def preparation_steps(inputs: InputsSection, lstm_nodes: int | None = None) -> list[Step]:
    """The ordered steps of ``prepare_model`` (also run one by one to find the step that
    changed what a model computes, pipeline.quantize.lossless). ``lstm_nodes``: how many nodes
    unrolling the LSTMs QNN takes may add, for accuracy (``recurrent.unroll_recurrent_ops``;
    None: its default budget, 0: none)."""
    from . import (
        atrous,
        attention,
        concat,
        contrib,
        deform,
        legacy,
        merged_axes,
        ml,
        numerics,
        prequantized,
        rank,
        recurrent,
        resize,
        spectral,
        tails,
        unsupported,
    )
    from . import transforms as t

    return [
        t.set_ir_version,  # IR >= 4 first: initializers may then leave the input list
        t.raw_initializer_data,  # before the copies every later step makes
        t.drop_initializer_inputs,
        contrib.refuse_nchwc_layout,  # onnxruntime's 'all' level: a layout for one CPU
        lambda m: t.bake_constant_inputs(m, inputs.constants, inputs.shapes, inputs.dims),
        t.drop_unread_inputs,  # after the constants: one may name an input no node reads
        refuse_string_inputs,  # the NPU computes on numbers: the app encodes strings
        refuse_passthrough_outputs,  # an input as an output: no context writes it
        lambda m: t.fix_input_shapes(m, inputs.dims, inputs.shapes),
        t.float16_to_float32,  # the version converter fails on fp16 graphs
        t.float64_to_float32,  # the HTP has no float64, the quantizer quantizes none
        t.bfloat16_to_float32,  # onnxruntime's CPU EP runs no bfloat16 Conv, numpy has none
        legacy.explicit_legacy_broadcasts,  # opset <= 6 broadcast/axis: the adapter errs
        legacy.coerced_hardmax,  # opset < 13 Hardmax: the converter changes its meaning
        t.replace_legacy_ops,  # ... and on ops without an adapter
        legacy.pin_legacy_semantics,  # Upsample/Resize-10/Crop: the converter loses their meaning
        prequantized.qoperator_to_qdq,  # QLinear* ops -> DQ, float op, Q (what QNN groups)
        prequantized.upgrade_opset,  # t.upgrade_opset; a pre-quantized model keeps its opset
        prequantized.standard_qdq_ops,  # onnxruntime's com.microsoft 16-bit Q/DQ: no schema
        contrib.fused_transformer_ops,  # onnxruntime's fused Attention, SkipLayerNorm...
        attention.attention_op_to_matmuls,  # ONNX Attention (opset 23): the QNN EP runs none
        contrib.fused_cpu_ops,  # onnxruntime's FusedConv, FusedGemm, FusedMatMul
        legacy.restore_pinned_ops,
        ml.standard_ml_ops,  # a scikit-learn Scaler, Imputer...: arithmetic the NPU runs
        refuse_cpu_only,  # nothing left for the NPU: say so now, not after 90 steps' copies
        t.expand_function_ops,  # Mish, GroupNormalization, 3 Reduce ops: the QNN EP takes none
        numerics.shifted_log_sum_exps,  # none quantized; log(sum(exp(x))) overflows
        t.constants_to_initializers,  # the converter may add Constant nodes
        t.fold_constants,
        t.drop_identities,  # before the folds: an Identity hides a BatchNorm's Add from them
        t.pads_over_every_axis,  # a Pad with axes (CenterCropPad's body): no context builds
        unsupported.positions_written_as_where,  # x[torch.where(c)] = v: no data-sized chain
        t.plain_tensor_names,  # a ';' in a context's output name aborts its load
        recurrent.unroll_static_loops,  # a while loop's count is constant once shapes are fixed
        t.refuse_training_mode,  # a Dropout or BatchNorm still in training mode: random outputs
        t.lower_data_dependent_ifs,  # the QNN EP runs no control flow
        prequantized.fold_quantized_constants,  # Q(float weight) -> its integers (own Q/DQ kept)
        prequantized.drop_noop_casts,  # Q -> Cast(same type) -> DQ; an fp16 model's float Casts
        atrous.space_to_batch_convs,  # TF's atrous Conv as data moves -> a dilated Conv
        rank.input_unit_axis_transposes,  # a gray NHWC input's Transpose: a Reshape
        legacy.explicit_auto_pads,  # Keras' "same" layers: the pad rules read pads
        legacy.fold_pad_into_pool,  # Pad(-FLT_MAX) -> MaxPool: the pad value blows the range
        legacy.fold_pad_into_conv,  # Pad(0) -> Conv: the HTP fills end-only pads wrongly
        attention.finite_mask_fills,  # -inf / finfo.min mask fills: an infinite scale
        numerics.finite_scatter_fills,  # a max-scatter into -inf (PyG's max pooling): likewise
        attention.fuse_erf_gelu,  # PyTorch's Erf-GELU: the HTP takes no quantized Erf
        t.fold_batchnorm,
        t.fold_conv_affine,  # ConvTranspose -> Add(bias): the HTP drops the Add's zero point
        legacy.batchnorm_to_affine,  # a BatchNormalization with no Conv before it
        legacy.batchnorm_of_computed_statistics,  # tf2onnx's Keras LayerNormalization
        atrous.split_wide_dilations,  # a TCN's dilation 4096: the HTP fails to finalize
        recurrent.normalize_recurrent_ops,  # QNN refuses even default activations spelled out
        # LSTM/GRU/RNN forms QNN refuses -> elementary ops (and LSTMs over a sequence)
        lambda m: recurrent.unroll_recurrent_ops(m, budget=lstm_nodes),
        recurrent.lower_high_rank,  # rank > 5 (an unfold as Gather) -> rank <= 5
        rank.drop_leading_unit_axis,  # rank 6 with batch 1 (deformable attention)
        merged_axes.high_rank_ops_at_rank_5,  # Hiera's rank-6 windows: neighbour axes merged
        rank.collapse_high_rank_reshapes,  # tf2onnx's Unsqueeze, rank-6 Reshape, Squeeze
        rank.rank5_elementwise_at_rank_4,  # a Tanh of Conv3d-shaped frames: CPU at rank 5
        t.col2im_to_conv_transpose,  # the QNN EP has no Col2Im (F.fold: VOLO's outlooker)
        deform.deform_conv_to_grid_samples,  # nor DeformConv (DCNv2: DBNet++, CenterNet)
        recurrent.dilate_conv_transpose,  # QNN's TransposeConv2d takes dilation 1 only
        recurrent.output_padding_to_pads,  # the HTP's depthwise ConvTranspose drops it
        t.split_computed_clips,  # the QNN EP takes Clip with constant bounds only
        t.einsum_to_matmul,  # the QNN EP takes no Einsum (TF/Keras attention)
        spectral.stft_to_conv,  # its quantized STFT fails to compile (fp16 only)
        spectral.dft_to_matmul,  # and it takes no DFT
        concat.split_of_concat,  # boxes and scores joined, laid out, split: one grid each
        t.rewrite_for_htp,
        t.gathernd_to_gather,  # the QNN EP takes no GatherND (transformers' mask lookups)
        t.flat_gather_indices,  # and aborts on some Gathers of rank-4 indices (as_strided)
        t.pad_short_row_gathers,  # the HTP zeroes a read of the last of many short rows
        t.sequence_at_to_slices,  # nor sequences (the dynamo exporter's unbind / split)
        t.drop_empty_concat_inputs,  # nor empty tensors (a streaming cache of length 0)
        t.reverse_sequence_to_gather,  # nor ReverseSequence (tf2onnx's reverse)
        t.argmax_without_keepdims,  # its keepdims form's context is refused at load
        resize.antialiased_resizes_as_matmuls,  # the QNN EP takes no antialias (torchvision)
        resize.resize_for_htp,  # the HTP resizes by out/in, not by the scale given
        legacy.whole_input_pools,  # EfficientNet's AvgPool(1280) of a 7x7 map: global
        legacy.avg_pool_ceil_mode,  # the HTP's ceil-mode AveragePool is wrong
        numerics.split_wide_means,  # the HTP's quantized mean of over 2^15 values overflows
        t.rewrite_hypot,  # after Pow(x, 2) -> Mul(x, x)
        numerics.bounded_atan_ratios,  # atan2 as Atan(y / x): a quotient of millions near x = 0
        t.rewrite_reciprocal,
        numerics.rewrite_sqrt_of_sigmoids,  # sqrt(p * q) of probabilities: 1e-10 survives neither
        numerics.thresholds_on_logits,  # sigmoid(x) > c decided near c by an HTP step: x > logit(c)
        numerics.log_of_large_gain,  # log(1 + 2^20 * magnitude): the product overflows fp16
        t.scalar_shaped_constants,  # qnn_preprocess reads a LayerNorm's eps as a scalar
        t.max_pool_pads_as_concat,  # onnxruntime's PadFusion folds them wrongly
        t.qnn_preprocess,
        t.gemm_computed_bias_as_add,  # its MatMul + Add fusion: the QNN EP leaves a DQ on the CPU
        t.fuse_hardswish,  # qnn_preprocess splits HardSwish; the QNN EP's fp16 fusion is wrong
        t.hardswish_from_clip,  # x * Clip(x + 3, 0, 6) / 6: four ops for the HTP's one
        rank.rank5_elementwise_at_rank_4,  # again: those fusions write rank-5 HardSwishes too
        attention.layernorm_over_last_axis,  # the QNN EP takes LayerNorm over the last axis only
        legacy.explicit_pool_pads,  # the HTP pools non-overlapping windows over start pads wrongly
        t.widen_9x9_stride_2,  # the HTP's 9x9 Conv at stride 2 is wrong (32+ channels)
        t.explicit_conv_pads,  # the HTP pads a 9x9 Conv of 3 channels wrongly (after
        # qnn_preprocess, whose optimizer folds a Pad of zeros back into the Conv)
        t.pads_as_concat,  # the HTP pads a last axis's end, or a shared Transpose's slice, wrongly
        t.unshare_biases,  # onnxruntime's quantizer names its copies into other tensors
        t.flatten_gemm_biases,  # ... and reads a Gemm's bias as one value per column
        attention.standard_gelu,  # qnn_preprocess fuses TF/Keras GELU into com.microsoft Gelu
        unsupported.ops_without_qnn_kernels,  # after every GELU fusion: a lone Erf, OneHot...
        numerics.integer_casts_with_margin,  # Cast(Floor(..)) of 2.99998 quantized: 2
        t.drop_neutral_arithmetic,  # x + 0: the HTP drops the Add's requantization with it
        t.drop_noop_moves,  # a whole-tensor Slice: the HTP drops it and its requantization
        t.fold_constants,  # fusions can leave constant subexpressions behind
        t.filled_constants_as_expand,  # fills too large to fold: no ConstantOfShape on QNN
        t.quantizer_free_names,  # T and T_scale: the quantizer takes the model's for its own
        t.topological_sort,
        t.store_inferred_shapes,
        tails.static_tail_outputs,  # a label lookup's output: shape inference leaves it open
        tails.expose_label_scores,  # labels alone have no SNR: judge what they are computed from
        tails.expose_selection_sources,  # rows picked by rank: judge what they pick from
        t.set_ir_version,
    ]


def prepare_model(
    model: onnx.ModelProto,
    inputs: InputsSection,
    on_step: Callable[[str], None] | None = None,
    lstm_nodes: int | None = None,
) -> tuple[onnx.ModelProto, list[Change]]:
    """Return a float32, fully static, NPU-friendly model and what each step changed.

    The steps' models are checked once, at the end; on any failure the steps run again, each
    checked, so that the error names the step that made the model invalid. ``on_step`` hears
    each step's name as it starts (progress). ``lstm_nodes`` is 0 for the buckets of one
    context: their quantization must agree tensor by tensor, and the node budget that decides
    an unroll depends on the bucket's length."""
    try:
        with edit.checks_deferred():
            prepared, changes = _run_steps(model, inputs, on_step, lstm_nodes)
        edit.check(prepared, "preparation (the steps together)")
    except NothingForTheNpu:
        raise  # a refusal, not a broken model: no step to find
    except Exception:
        _run_steps(model, inputs, lstm_nodes=lstm_nodes)  # raises at the step at fault
        raise
    _require_static(prepared)
    _require_npu_part(prepared)
    return prepared, changes


class NothingForTheNpu(ModelError):
    """Every node of the model is declared CPU post-processing (``_require_npu_part``)."""


def refuse_cpu_only(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """``_require_npu_part`` as a step, once the ai.onnx.ml ops that become standard ops have:
    a LightGBM classifier's 30 MB of trees took every later step's copy (2 minutes) before the
    end's check said the NPU runs none of it. Identities and Casts (which later steps drop,
    or leave as all the NPU would run) count as nothing here."""
    _require_npu_part(model, moves=EARLY_MOVES)
    return model, edit.Change("refuse_cpu_only", ())


EARLY_MOVES = frozenset({"Identity", "Cast"})


def _require_npu_part(model: onnx.ModelProto, moves: frozenset[str] = frozenset()) -> None:
    """A ModelError when every node is declared CPU post-processing (a tree ensemble, a
    linear classifier of ai.onnx.ml ops), but for ``moves``: the QNN HTP backend runs none of
    them, so a build would end at compile with an empty context, minutes later."""
    tail = model_tail(model)
    nodes = model.graph.node
    rest = [n for i, n in enumerate(nodes) if i not in tail.nodes]
    if tail and all(n.op_type in moves and n.domain in ("", "ai.onnx") for n in rest):
        ops = sorted({_op_of(n) for i, n in enumerate(nodes) if i in tail.nodes})
        raise NothingForTheNpu(
            f"Nothing in this model can run on the NPU: all its {len(tail.nodes)} node(s) "
            f"({', '.join(ops)}) are ai.onnx.ml or label post-processing, which the QNN HTP "
            "backend does not run.",
            tip="Run this model with plain onnxruntime on the CPU (it is what onnxruntime's CPU "
            "provider is for), or build the neural part that feeds it, if it has one.",
        )


def _run_steps(
    model: onnx.ModelProto,
    inputs: InputsSection,
    on_step: Callable[[str], None] | None = None,
    lstm_nodes: int | None = None,
) -> tuple[onnx.ModelProto, list[Change]]:
    from ..core.memory import release_freed_memory

    changes: list[Change] = []
    source = model
    for step in preparation_steps(inputs, lstm_nodes):
        if on_step is not None:
            on_step(getattr(step, "__name__", "step").replace("<lambda>", "inputs"))
        # A model a step made is this loop's alone: the next step may edit it in place
        # (``edit.writable``). The caller's model never is (a failure reruns from it).
        with edit.handed_over(None if model is source else model, step):
            model, change = step(model)
        changes.append(change)
        release_freed_memory()  # a step's copy replaced the model: do not let copies pile up
    return model, changes


# Ops whose output size the data decides (not the input shapes): NMS's kept boxes, NonZero's
# positions, Unique's values. Nothing after them has a static shape.
DATA_SIZED_OPS = frozenset({"NonMaxSuppression", "NonZero", "Unique", "Compress"})


def _require_static(model: onnx.ModelProto) -> None:
    """A ModelError naming the tensors preparation left without a static shape."""
    dynamic = edit.dynamic_outputs(model)
    if dynamic:  # a declared CPU tail (labels, score maps) needs no static shape
        tail = model_tail(model)
        in_tail = {o for i in tail.nodes for o in model.graph.node[i].output}
        dynamic = [(name, node) for name, node in dynamic if name not in in_tail]
    if dynamic:
        opaque = _opaque_sources(model, dynamic)
        if opaque:
            raise opaque
        shown = [
            f"{name!r} (graph input)" if node is None else f"{name!r} from {edit.node_label(node)}"
            for name, node in dynamic[:10]
        ]
        more = f" and {len(dynamic) - 10} more" if len(dynamic) > 10 else ""
        tip = (
            "The QNN HTP backend needs every shape static. Fix more dims in [inputs] "
            "(dims/shapes/constants), or re-export the model without data-dependent shapes."
        )
        loops = [n for _, n in dynamic if n is not None and n.op_type in ("Loop", "Scan")]
        sized = [n for _, n in dynamic if n is not None and n.op_type in DATA_SIZED_OPS]
        if sized:  # no dims fix how many boxes NMS keeps (a detector exported "with post")
            read = post_processing_inputs(model, {name for name, _ in dynamic})
            cut = "Set [model] outputs to the tensors the data-sized part reads"
            if 0 < len(read) <= 8:
                cut = f"Set [model] outputs = {json.dumps(read)}, the tensors it reads"
            elif read:
                cut += f" ({len(read)}, the first {', '.join(map(repr, read[:8]))})"
            cut += " (a detector's boxes and scores before its NMS)"
            tip = (
                f"{edit.node_label(sized[0])} returns as many values as the data decides, so "
                "what it and everything after it produce has no static shape, whatever the "
                f"dims: the HTP holds no such tensor. {cut}: the part computing them is built, "
                "and the app runs the rest on the CPU; or export the model without that "
                "post-processing."
            )
        elif loops:  # no dims fix a trip count the data decides (an autoregressive decoder)
            tip = (
                f"{edit.node_label(loops[0])} runs a data-dependent number of iterations, so "
                "what it and everything after it produce has no static shape, whatever the "
                "dims: the HTP runs no such loop. Cut the model before it (for instance with "
                "onnx.utils.extract_model, ending at the loop's inputs), build that part, and "
                "run the loop on the CPU."
            )
        raise ModelError(
            "After preparation these tensors still have no static shape: "
            + ", ".join(shown)
            + more
            + ".",
            tip=tip,
        )


# Ops that pass a tensor on reshaped or retyped, and ops that select part of it with constant
# indices: ``post_processing_inputs`` looks through them for the tensor a cut should expose.
_VIEW_OPS = frozenset(
    {"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Transpose", "Identity", "Cast"}
)
_SELECT_OPS = frozenset({"Gather", "Slice"})
# onnx.TensorProto's FLOAT, FLOAT16, DOUBLE, BFLOAT16 (onnx is not imported at module level)
_FLOAT_TYPES = frozenset({1, 10, 11, 16})


def post_processing_inputs(model: onnx.ModelProto, dynamic: set[str]) -> list[str]:
    """The tensors of the network a data-sized post-processing reads: where to cut.

    Why: a detector exported with its NMS has hundreds of shapeless tensors (SSDlite: 751,
    behind a NonZero per class), and the data-sized op's own inputs are a per-class slice of
    the scores after a threshold: no one would cut there. The part that writes a shapeless
    tensor, with the static index work only it reads (comparisons, counts: not float), is the
    post-processing; the float tensors it reads from the rest, each traced back through
    reshapes to another of them, or through constant-index selections (one class's column of
    the scores) to the tensor selected from, are the network's outputs a cut keeps."""
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    constant = {i.name for i in graph.initializer}
    for node in graph.node:  # graph order: a node's inputs are decided before it
        if all(not i or i in constant for i in node.input):
            constant.update(node.output)
    values = edit.inferred_values(model)
    outputs = {o.name for o in graph.output}

    def floating(name: str) -> bool:
        value = values.get(name)
        if value is None or not value.type.HasField("tensor_type"):
            return True
        return value.type.tensor_type.elem_type in _FLOAT_TYPES

    post = {id(n) for n in graph.node if any(o in dynamic for o in n.output)}
    for node in reversed(graph.node):  # consumers come after: one pass absorbs chains
        if id(node) in post or any(o in outputs or floating(o) for o in node.output):
            continue
        readers = [c for o in node.output for c in consumers.get(o, [])]
        if readers and all(id(c) in post for c in readers):
            post.add(id(node))
    frontier = [
        i
        for n in graph.node
        if id(n) in post
        for i in n.input
        if i
        and i not in dynamic
        and i not in constant
        and (i not in producer or id(producer[i]) not in post)
        and floating(i)
    ]
    wanted = set(frontier)

    def source(name: str) -> str:
        """``name`` traced back to another frontier tensor or through a selection."""
        chosen, current = name, name
        while current in producer:
            node = producer[current]
            if node.op_type not in _VIEW_OPS | _SELECT_OPS or not node.input:
                break
            if any(i and i not in constant for i in node.input[1:]):
                break
            current = node.input[0]
            if current in wanted or node.op_type in _SELECT_OPS:
                chosen = current
            if current in wanted:
                break
        return chosen

    return list(dict.fromkeys(source(t) for t in frontier))


def _opaque_sources(
    model: onnx.ModelProto, dynamic: list[tuple[str, onnx.NodeProto | None]]
) -> ModelError | None:
    """The refusal when what stays shapeless is computed from an ai.onnx.ml op standing in
    *front* of the network, or None.

    Why: onnx infers no shape for what some ai.onnx.ml ops write (a Normalizer over rank 3, an
    old LabelEncoder), so every tensor of the network after one was listed as dynamic with a tip
    to fix [inputs] dims, which cannot help. Such ops stay on the CPU only as a tail, after the
    NPU part; in front of it they must leave the model."""
    writer = {o: n for n in model.graph.node for o in n.output}
    unshaped = {name for name, _ in dynamic}
    for name, node in dynamic:
        read = next(
            (
                i
                for i in (node.input if node is not None else ())
                if i in unshaped and i in writer and writer[i].domain in TAIL_DOMAINS
            ),
            None,
        )
        if read is None:
            continue
        source = writer[read]
        op = _op_of(source)
        after = f" (and {len(dynamic) - 1} more tensor(s) after it)" if len(dynamic) > 1 else ""
        return ModelError(
            f"{name!r} from {edit.node_label(node)}{after} has no static shape: it is computed "
            f"from {read!r}, which {op} writes in front of the network. The QNN HTP backend "
            "does not run that op, onnx's shape inference gives its output no shape, and such "
            "ops stay on the CPU only after the NPU part (post-processing), not before it.",
            tip=f"Run {op} in the app and build the model from {read!r} on "
            f"({_cut_at(read)}), or re-export the model without it.",
        )
    return None


def _op_of(node: onnx.NodeProto) -> str:
    """The op type, with its domain where it has one (``ai.onnx.ml:LabelEncoder``)."""
    return f"{node.domain}:{node.op_type}" if node.domain else node.op_type


def _cut_at(tensor: str) -> str:
    return f"onnx.utils.extract_model(source, out, input_names=[{tensor!r}], output_names=...)"


def refuse_passthrough_outputs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, edit.Change]:
    """A ModelError for a graph output that is a graph input passed through unchanged, naming
    it and the ``[model] outputs`` that build the rest.

    Why: a context cannot output one of its inputs (no op writes it: onnxruntime's quantizer
    stopped with "Graph is not a DAG"), and with that output in the graph onnx's shape
    inference gave every tensor up as dynamic, the error then blaming the first Conv's shape.
    The app has the input already."""
    graph = model.graph
    inputs = {i.name for i in graph.input} - {t.name for t in graph.initializer}
    through = [o.name for o in graph.output if o.name in inputs]
    if not through:
        return model, edit.Change("refuse_passthrough_outputs", ())
    rest = [o.name for o in graph.output if o.name not in inputs]
    fix = (
        f"Set [model] outputs = {json.dumps(rest)} in the config: the app already holds "
        f"{' and '.join(map(repr, through))}."
        if rest
        else "The model computes nothing: every output is an input."
    )
    raise ModelError(
        f"Output(s) {', '.join(map(repr, through))} are graph inputs passed through unchanged: "
        "a context cannot output its own input.",
        tip=fix,
    )


def refuse_string_inputs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Change]:
    """A ModelError for a graph input that holds strings (or a sequence or a map), naming the
    op that reads it and how to build the numeric part instead.

    Why: a grapheme-to-phoneme classifier reads letters through an ai.onnx.ml LabelEncoder; its
    build stopped with every tensor of the network "dynamic" and a tip to fix [inputs] dims (an
    old LabelEncoder's output has no inferred shape), or, with a newer one, in calibration with
    a numpy error (string samples are object arrays, which the sample files cannot hold). The
    NPU computes on numbers: the strings are encoded in the app, as a tokenizer's are."""
    graph = model.graph
    inits = {i.name for i in graph.initializer}
    for value in graph.input:
        kind = value.type.WhichOneof("value")
        if value.name in inits or (
            kind == "tensor_type" and value.type.tensor_type.elem_type != STRING_TYPE
        ):
            continue
        held = "strings" if kind == "tensor_type" else f"a {kind.removesuffix('_type')}"
        reader = next((n for n in graph.node if value.name in n.input), None)
        if reader is None:
            continue  # an unread input is dropped before this step
        op = _op_of(reader)
        out = reader.output[0]
        raise ModelError(
            f"Input {value.name!r} holds {held}, read by {op} "
            + (repr(reader.name) if reader.name else f"(which writes {out!r})")
            + ": the NPU "
            "computes on numbers only, and this pipeline builds models whose inputs are "
            "numeric tensors.",
            tip=f"Encode the input in the app (what {op} computes) and build the model from "
            f"{out!r} on, that encoding as its input: {_cut_at(out)}.",
        )
    return model, edit.Change("refuse_string_inputs", ())


# A float32 activation range this wide only comes from overflow (inf/NaN) during calibration.
_ABSURD_SCALE = 1e30


def quantization_issues(model: onnx.ModelProto) -> list[str]:
    """Q/DQ scales that QNN cannot take: non-finite, <= 0, or from an overflowed range.

    Why: when calibration overflows (e.g. a reader that fed random data into weights listed as
    graph inputs), scales become inf and the HTP backend rejects the ops with bare error codes
    ("graphAddNode() failed ... Conv2d ... 6007", "ElementWiseMultiply ... 3110",
    "Failed to compose Qnn graph"). This names the tensors before compiling.
    """
    import numpy as np
    from onnx import numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    issues = []
    seen: set[str] = set()
    for node in model.graph.node:
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear") or len(node.input) < 2:
            continue
        scale_name = node.input[1]
        if scale_name in seen or scale_name not in inits:
            continue
        seen.add(scale_name)
        scale = numpy_helper.to_array(inits[scale_name]).astype(np.float64)
        bad = ~np.isfinite(scale) | (scale <= 0) | (scale >= _ABSURD_SCALE)
        if bad.any():
            tensor = node.input[0] if node.op_type == "QuantizeLinear" else node.output[0]
            issues.append(
                f"{tensor!r} ({node.op_type} {node.name!r}): scale {scale[bad].flat[0]:g}"
            )
    return issues
