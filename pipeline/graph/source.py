"""What the source model needs before anything judges it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import edit


def sort_nodes(model: Any) -> Any:
    """A copy of ``model`` whose (sub)graph nodes are in topological order.

    Used on a source model before ``onnx.checker`` sees it: exporters such as PyTorch 1.1 wrote
    valid graphs out of order, which onnxruntime runs but the checker refuses. A cycle or a
    name nothing defines is still a ModelError naming the node.
    """

    result = edit.copy_model(model)
    for graph in edit.all_graphs(result.graph):
        edit.sort_graph(graph)
    return result


def readable(model: Any) -> Any:
    """``model`` as the checker and the preparation read it: nodes in topological order
    (``sort_nodes``), onnxruntime's own norms in the ONNX domain written out
    (``contrib.onnx_domain_norms``). onnxruntime runs the file as it is."""
    from .contrib import onnx_domain_norms

    return onnx_domain_norms(
        sort_nodes(_one_import_per_domain(_constants_at_ir_4(_imports_at_ir_3(model))))
    )


def _imports_at_ir_3(model: Any) -> Any:
    """An IR 1-2 model that lists opset imports, read as IR 3, the first IR with them.

    PyTorch 0.2-0.3 wrote ``ir_version`` 1 beside an ``opset_import`` (a fast-neural-style
    export from WinML's test collateral: ai.onnx 7); onnxruntime loads such files, but the
    checker refused them ("model with IR version < 3 cannot have opset_import specified")
    before anything else was looked at. Preparation raises the IR version anyway."""
    if model.ir_version >= 3 or not model.opset_import:
        return model
    model = edit.copy_model(model)
    model.ir_version = 3
    return model


def _one_import_per_domain(model: Any) -> Any:
    """One opset_import entry per domain, the version onnxruntime runs the model at: the last.

    ``onnx.compose.merge_models`` lists every domain once per merged model; the version
    converter then raised only the first ("" 17 -> 21), onnxruntime read the default domain
    from the last (still 17), and the opset-18 ReduceMean that calibration adds was refused
    ("has input size 2 not in range [min=1, max=1]": an Arabic diacritizer ensemble from
    PyPI)."""
    domains = [o.domain or "ai.onnx" for o in model.opset_import]
    if len(set(domains)) == len(domains):
        return model
    last = {d: o.version for d, o in zip(domains, model.opset_import, strict=True)}
    model = edit.copy_model(model)
    kept = []
    for domain, entry in zip(domains, list(model.opset_import), strict=True):
        if domain in last:
            entry.version = last.pop(domain)
            kept.append(entry)
    del model.opset_import[:]
    model.opset_import.extend(kept)
    return model


def _constants_at_ir_4(model: Any) -> Any:
    """An IR < 4 model with initializers that are not graph inputs, read as IR 4 reads it.

    Before IR 4 every initializer had to be a graph input (its default value); old WinML and
    onnxmltools exports of waifu2x-style upscalers keep their weights out of the inputs and
    onnxruntime runs them, taking those initializers as constants, as IR 4 means. The checker
    refused them ("convolution_W in initializer but not in graph input"); preparation raises
    the IR version anyway (``transforms.set_ir_version``)."""
    if model.ir_version >= 4:
        return model
    inputs = {i.name for i in model.graph.input}
    if all(init.name in inputs for init in model.graph.initializer):
        return model
    model = edit.copy_model(model)
    model.ir_version = 4
    return model


def onnxruntime_load_error(model: Any) -> str | None:
    """Why onnxruntime's CPU EP refuses to load ``model`` (first line), or None when it loads.

    Asked only after a preparation step failed: a source that onnxruntime cannot load (an Add
    of incompatible shapes a hand-built export left) fails some step with an error about that
    step (qnn_preprocess_model's "Incompatible dimensions"), when the fix is in the export.
    """
    from ..core.cpu import cpu_session

    if model.ByteSize() >= 2**31:  # over protobuf's 2 GiB: it cannot be handed over
        return None
    try:
        cpu_session(model, optimize=False)
    except Exception as exc:  # a ModelError around onnxruntime's own (not public) error
        text = str(exc.__cause__ or exc).strip()
        return text.splitlines()[0] if text else type(exc).__name__
    return None


@dataclass
class SourceModel:
    """The user's model, for the checks that compare with it after calibration.

    A model read from a file is read again when needed (``load``) and run from the file
    (``runnable``), so its weights are not held through calibration and quantization (a
    1024x1024 U-Net's 176 MB, three times over in protobuf). onnxruntime runs a file whose
    nodes are out of order; ``load`` sorts them as ``load_source_model`` did. One that only
    exists in memory (the float model behind a pre-quantized one) is kept.
    """

    path: Path | None
    model: Any = None
    float16: bool = False
    # Inputs the config gives a size the model fixes (``transforms.resized_inputs``): the
    # source runs with their dims free (``edit.free_input_dims``), as its app runs it.
    free_inputs: tuple[str, ...] = ()

    @classmethod
    def of(
        cls, model: Any, path: Path | None = None, free_inputs: Sequence[str] = ()
    ) -> SourceModel:
        """``model``, read from the file at ``path`` (None: kept in memory)."""
        kept = None if path else model
        float16 = computes_in_float16(model.graph)
        return cls(None if path is None else Path(path), kept, float16, tuple(free_inputs))

    @property
    def optimize(self) -> bool:
        """Whether onnxruntime may apply all its graph optimizations when running it: not to a
        float16 model, whose full level crashed onnxruntime 1.31 at session creation (SIGSEGV,
        the whole stage down) on a PP-OCR recogniser converted to float16 with float32 I/O;
        the basic level runs it (``core.cpu.cpu_session``)."""
        return not self.float16

    def load(self) -> Any:
        """The model (nodes in topological order; ``free_inputs`` freed)."""
        import onnx

        model = self.model if self.model is not None else readable(onnx.load(str(self.path)))
        return edit.free_input_dims(model, self.free_inputs) if self.free_inputs else model

    def runnable(self) -> Any:
        """What ``cpu_session`` takes: the file's path, or the model."""
        if self.model is None and not self.free_inputs:
            return str(self.path)
        return self.load()


def computes_in_float16(graph: Any) -> bool:
    """Whether the model computes in float16 anywhere: float16 weights (initializers or
    Constant nodes), graph inputs or outputs, or a Cast to float16. A model converted with float32
    I/O kept (onnxconverter-common's ``keep_io_types``, as fp16 exports are usually shipped) casts
    its inputs to float16 and holds its weights in Constants: taken for a float32 model, its
    preparation (computed in float32) read 49 dB from it and failed the lossless check."""
    import onnx

    f16 = onnx.TensorProto.FLOAT16
    if any(v.type.tensor_type.elem_type == f16 for v in (*graph.input, *graph.output)):
        return True
    for sub in edit.all_graphs(graph):
        if any(t.data_type == f16 for t in sub.initializer):
            return True
        for node in sub.node:
            for attribute in node.attribute:
                if node.op_type == "Cast" and attribute.name == "to" and attribute.i == f16:
                    return True
                if attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_type == f16:
                    return True
    return False


def as_source(source: Any) -> SourceModel:
    """A ``SourceModel`` as it is, or one holding a ``ModelProto``."""
    return source if isinstance(source, SourceModel) else SourceModel.of(source)
