"""Make a float ONNX model ready for calibration and the QNN HTP backend.

``prepare_model`` chains the transforms of ``pipeline.transforms`` in an order where each one
sees what it needs (initializers before folding, float32 before the opset upgrade, static
shapes before batch-norm folding) and fails loudly, naming tensor and op, if any tensor is
still dynamic at the end: the QNN EP refuses dynamic shapes and says little about why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .errors import ModelError

if TYPE_CHECKING:
    import onnx

    from .config import InputsSection
    from .transforms import Change


def dynamic_tensors(model: onnx.ModelProto) -> list[str]:
    """Tensors whose static shape ONNX schema inference alone cannot give; [] = fully static.

    Stored value_info is ignored (shapes that only data propagation justifies do not count).
    """
    from .transforms import dynamic_outputs

    return [name for name, _ in dynamic_outputs(model)]


def prepare_model(
    model: onnx.ModelProto, inputs: InputsSection
) -> tuple[onnx.ModelProto, list[Change]]:
    """Return a float32, fully static, NPU-friendly model and what each step changed."""
    from . import transforms as t

    steps: list[Callable[[onnx.ModelProto], tuple[onnx.ModelProto, Change]]] = [
        t.set_ir_version,  # IR >= 4 first: initializers may then leave the input list
        t.drop_initializer_inputs,
        lambda m: t.bake_constant_inputs(m, inputs.constants),
        lambda m: t.fix_input_shapes(m, inputs.dims, inputs.shapes),
        t.float16_to_float32,  # the version converter fails on fp16 graphs
        t.replace_legacy_ops,  # ... and on ops without an adapter
        t.upgrade_opset,
        t.constants_to_initializers,  # the converter may add Constant nodes
        t.fold_constants,
        t.fold_batchnorm,
        t.rewrite_for_htp,
        t.qnn_preprocess,
        t.fold_constants,  # fusions can leave constant subexpressions behind
        t.topological_sort,
        t.store_inferred_shapes,
        t.set_ir_version,
    ]
    changes: list[Change] = []
    for step in steps:
        model, change = step(model)
        changes.append(change)
    dynamic = t.dynamic_outputs(model)
    if dynamic:
        shown = [
            f"{name!r} (graph input)" if node is None else f"{name!r} from {t.node_label(node)}"
            for name, node in dynamic[:10]
        ]
        more = f" and {len(dynamic) - 10} more" if len(dynamic) > 10 else ""
        raise ModelError(
            "After preparation these tensors still have no static shape: "
            + ", ".join(shown)
            + more
            + ".",
            tip="The QNN HTP backend needs every shape static. Fix more dims in [inputs] "
            "(dims/shapes/constants), or re-export the model without data-dependent shapes.",
        )
    return model, changes
