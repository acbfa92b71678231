"""ONNX Runtime on the CPU, as every stage uses it to measure: quiet, and lean on memory.

The arena is off: an arena keeps each session's peak allocation for the session's lifetime, and
the stages keep several sessions open side by side (source, float and QDQ models of a 1024x2048
segmenter held 4 GiB that way); without it each run returns its memory when it ends.

Q/DQ patterns are never fused into onnxruntime's integer kernels: a QDQ model is measured as
ONNX defines it (each DequantizeLinear, float op and QuantizeLinear), the same on every CPU. The
fused uint8 x int8 kernels saturate on x86 CPUs with AVX2 but no VNNI (onnxruntime's own
quantization docs say so): a pre-quantized MobileNetV2's fused and unfused runs were 22 dB apart
on an AMD EPYC without VNNI, so its figures depended on the machine that built it. Some fused
kernels also refuse at run time a pattern the model as written computes (PPQ's OpenVINO export
quantizes a MatMul's weights along K: "QLinearMatmul : weight zero point must be a scalar").
A model that holds integer ops itself runs them in onnxruntime's exact uint8 x uint8 form
(``session.x64quantprecision``), for the same reason.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

# onnxruntime rewrites that change what a model computes, disabled in every CPU session the
# pipeline measures with: PadFusion folds a Pad of zeros into a MaxPool, whose pads never win a
# max (a window of negative values then reads its max instead of 0).
ONNX_EXACT = ["Pad_Fusion"]


def cpu_session(
    model: Any, optimize: bool = True, in_node_order: bool = False, threads: int = 0
) -> Any:
    """A CPU EP session on a model file or ``ModelProto``; errors only in the log.

    ``in_node_order`` runs ready nodes in the order the graph lists them (onnxruntime's
    priority-based order), so a graph can say when side computations run. ``threads``: its
    intra-op thread pool (0: onnxruntime's, a thread a core); 1 for sessions run side by side,
    one a core (creating the pool took 9 of a small model's 29 ms a session)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.enable_cpu_mem_arena = False
    # Without the arena, the memory pattern allocates one block a run for the whole plan: a
    # 1x3x1024x2048 U-Net's float run peaked at 1280 MiB with it, 952 MiB without (measured;
    # no slower on fastestdet).
    options.enable_mem_pattern = False
    options.add_session_config_entry("session.disable_quant_qdq", "1")
    # A model written with integer ops (QLinearConv, MatMulInteger: onnxruntime's QOperator
    # format) runs those kernels whatever the fusion: uint8 x int8 in the exact uint8 x uint8
    # form instead, so that they saturate on no CPU (a QLinearConv of full-range int8 weights:
    # 88% of its outputs off by up to 20 steps on an EPYC without VNNI).
    options.add_session_config_entry("session.x64quantprecision", "1")
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    if threads:
        options.intra_op_num_threads = threads
    if in_node_order:
        options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    if not optimize:  # onnxruntime's own exact form is a transformer the basic level skips
        model = _uint8_weights(model) or model
    payload = model.SerializeToString() if hasattr(model, "SerializeToString") else str(model)
    what = str(model) if isinstance(payload, str) else f"model {model.graph.name!r}"
    try:
        session = ort.InferenceSession(
            payload, options, providers=["CPUExecutionProvider"], disabled_optimizers=ONNX_EXACT
        )
    except Exception as exc:  # onnxruntime's error types are not public
        from .errors import ModelError

        raise ModelError(
            f"{what} does not load in onnxruntime on the CPU: {exc}",
            tip="A source model must load in onnxruntime as it is; a model the pipeline wrote "
            "(under the artifacts folder) that does not load is a pipeline bug: report it "
            "with the source model and config.",
        ) from exc
    del payload  # a proto's serialized copy (a 1024x1024 U-Net's 176 MB): re-made if needed
    return _CpuSession(session, model, what)


# Integer ops onnxruntime multiplies as uint8 x int8 (ONNX's, and its own QGemm): the input
# positions of the activation's zero point, the weight and the weight's zero point.
_INTEGER_OPS = {
    "QLinearConv": (2, 3, 5),
    "QLinearMatMul": (2, 3, 5),
    "ConvInteger": (2, 1, 3),
    "MatMulInteger": (2, 1, 3),
    "QGemm": (2, 3, 5),
}


def _uint8_weights(model: Any) -> Any:
    """A copy of ``model`` whose int8 weights read beside uint8 activations by an integer op
    are uint8 (each value and the zero point + 128: the same products), or None if it has
    none. onnxruntime's uint8 x int8 kernels saturate paired products to 16 bits on x86 CPUs
    without VNNI; its uint8 x uint8 ones are exact, and ``session.x64quantprecision`` makes
    this rewrite itself only at the extended optimization level, which a model measured as
    written (``optimize = False``) does not get."""
    import onnx
    from onnx import numpy_helper

    proto = model if hasattr(model, "graph") else onnx.load(str(model), load_external_data=False)
    if not any(n.op_type in _INTEGER_OPS for n in proto.graph.node):
        return None
    if not hasattr(model, "graph"):
        proto = onnx.load(str(model))
    proto = proto.__class__.FromString(proto.SerializeToString())  # a copy: the caller's stays
    inits = {i.name: i for i in proto.graph.initializer}
    quantized_at_run_time = {
        n.output[2] for n in proto.graph.node if n.op_type == "DynamicQuantizeLinear"
    }
    changed = False
    for node in proto.graph.node:
        positions = _INTEGER_OPS.get(node.op_type)
        if positions is None or node.domain not in ("", "ai.onnx", "com.microsoft"):
            continue
        act_zero, weight, weight_zero = positions
        names = list(node.input) + [""] * (weight_zero + 1 - len(node.input))
        zero = inits.get(names[act_zero])
        held = inits.get(names[weight])
        dynamic = names[act_zero] in quantized_at_run_time  # always uint8
        if held is None or not (dynamic or (zero and zero.data_type == onnx.TensorProto.UINT8)):
            continue
        if held.data_type != onnx.TensorProto.INT8:
            continue
        values = numpy_helper.to_array(held).astype(np.int16) + 128
        if names[weight_zero]:
            if names[weight_zero] not in inits:
                continue  # a computed zero point: left as it is
            offset = numpy_helper.to_array(inits[names[weight_zero]]).astype(np.int16) + 128
        else:
            offset = np.array(128, np.int16)
        for position, array in ((weight, values), (weight_zero, offset)):
            name = f"{node.name or node.output[0]}_uint8_{position}"
            proto.graph.initializer.append(numpy_helper.from_array(array.astype(np.uint8), name))
            names[position] = name
        del node.input[:]
        node.input.extend(names)
        changed = True
    return proto if changed else None


# onnxruntime's words for an index past its table: the data fed is wrong, not the model.
_OUT_OF_TABLE = "out of data bounds"
_OUT_OF_TABLE_TIP = (
    "An input fed an index past the table it looks up (a token or character id beyond the "
    "model's vocabulary): the calibration data does, not the model. Feed the ids the model's "
    'own tokenizer makes (calibration.kind = "python" with a reader), or check the input\'s '
    "dims and dtype in [inputs]."
)


# onnxruntime's CPU kernel for the ONNX Attention op (opset 23) refuses a mask that broadcasts
# along the query axis ([B, 1, 1, S], a key-padding mask), valid as the spec writes it.
_ATTENTION_MASK = "inconsistent q_sequence_length (between attn_mask and Q)"
_ATTENTION_MASK_TIP = (
    "onnxruntime's own CPU kernel for the ONNX Attention op takes no attn_mask broadcast along "
    "the query axis (a key-padding mask of shape [B, 1, 1, S]), so the model does not run in "
    "onnxruntime at all. Expand the mask to [B, 1, S_q, S_kv] before scaled_dot_product_attention "
    "in the model's code, or export at opset 22 or lower (the exporter then writes MatMul and "
    "Softmax); the pipeline writes the Attention op out for the NPU either way."
)


_CONSTANT_INDEX_TIP = (
    "The index is a constant of the graph, not data: the model was exported for a fixed size "
    "(a loop's trip count, an unrolled sequence) that the shapes set in [inputs] changed. Set "
    "that input back to the size the model was exported with."
)


def _out_of_table_tip(model: Any, message: str) -> str:
    """The index-past-its-table tip: the data's fault, unless the failing node's indices are
    a constant of the graph (a tf2onnx BiLSTM unrolled over 300 steps, run at 64 tokens: its
    Gather of step 299 failed, and the tip blamed the calibration's token ids)."""
    found = re.search(r"Name:'([^']+)'", message)
    if found is None:
        return _OUT_OF_TABLE_TIP
    try:
        import onnx

        proto = (
            model if hasattr(model, "graph") else onnx.load(str(model), load_external_data=False)
        )
    except Exception:  # unreadable here: the general tip
        return _OUT_OF_TABLE_TIP
    constants = {i.name for i in proto.graph.initializer}
    constants |= {o for n in proto.graph.node if n.op_type == "Constant" for o in n.output}
    node = next((n for n in proto.graph.node if n.name == found.group(1)), None)
    if node is not None and len(node.input) > 1 and node.input[1] in constants:
        return _CONSTANT_INDEX_TIP
    return _OUT_OF_TABLE_TIP


class _CpuSession:
    """An onnxruntime session whose run errors name the model in a ModelError (with a tip)
    instead of a raw traceback."""

    def __init__(self, session: Any, model: Any, what: str) -> None:
        self._session, self._model, self._what = session, model, what

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._session.run(*args, **kwargs)
        except Exception as exc:  # onnxruntime's error types are not public
            from .errors import ModelError

            raise ModelError(
                f"{self._what} does not run in onnxruntime on the CPU: {exc}",
                tip=_out_of_table_tip(self._model, str(exc))
                if _OUT_OF_TABLE in str(exc)
                else _ATTENTION_MASK_TIP
                if _ATTENTION_MASK in str(exc)
                else "Check the model with onnxruntime alone; a model the pipeline wrote "
                "that does not run is a pipeline bug: report it with the source model.",
            ) from exc
