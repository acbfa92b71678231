"""Small real inputs for the compile stage, laid out exactly as the quantize stage leaves them.

Each graph is built with onnx.helper from a seed, quantized with onnxruntime's own QNN QDQ
recipe (get_qnn_qdq_config + quantize, u16 activations / u8 weights) and written with
``float.onnx``, ``qdq.onnx``, ``heldout/sample_NNNN.npz`` and ``record.json`` under
``<artifacts>/build/<name>/``, plus a model config under ``<root>/configs/``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from pipeline.fileio import sha256_file

IR_VERSION = 9  # onnxruntime 1.26 (the 2.3.0 pin) reads up to IR 10; 1.31 up to 13
Graph = Callable[[np.random.Generator], onnx.GraphProto]


def _weight(rng: np.random.Generator, name: str, shape: list[int]) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)


def small_cnn(rng: np.random.Generator) -> onnx.GraphProto:
    """Conv-Relu-Conv-GAP-Flatten-Gemm: everything the HTP supports, one partition."""
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
        helper.make_node("GlobalAveragePool", ["c2"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "w3", "b3"], ["y"], transB=1, name="fc"),
    ]
    inits = [
        _weight(rng, "w1", [8, 3, 3, 3]),
        _weight(rng, "b1", [8]),
        _weight(rng, "w2", [16, 8, 3, 3]),
        _weight(rng, "b2", [16]),
        _weight(rng, "w3", [10, 16]),
        _weight(rng, "b3", [10]),
    ]
    return helper.make_graph(
        nodes,
        "small_cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])],
        inits,
    )


def cnn_with_op(op_type: str) -> Graph:
    """Conv -> ``op_type`` -> Conv; with an op the HTP EP lacks, QNN splits around it."""

    def build(rng: np.random.Generator) -> onnx.GraphProto:
        nodes = [
            helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
            helper.make_node(op_type, ["c1"], ["u"], name="odd_op"),
            helper.make_node("Conv", ["u", "w2"], ["y"], pads=[1, 1, 1, 1], name="conv2"),
        ]
        return helper.make_graph(
            nodes,
            f"cnn_{op_type.lower()}",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
            [_weight(rng, "w1", [4, 3, 3, 3]), _weight(rng, "w2", [4, 4, 3, 3])],
        )

    return build


def shape_tail(rng: np.random.Generator) -> onnx.GraphProto:
    """Conv -> GAP, then the exporter idiom ``Reshape(g, Concat(Shape(g)[0:1], [C]))`` -> MatMul.

    The int64 shape arithmetic becomes its own QNN partition; loading the compiled context then
    kills the process from native code ("terminate called ... what(): Tensor name not found.")
    with onnxruntime-qnn 2.7.0 (found bisecting ppocr_cls_mobilenetv3_dyn, FACTS §4).
    """
    channels = 8

    def const(name: str, value: np.ndarray) -> onnx.NodeProto:
        return helper.make_node(
            "Constant", [], [name], value=numpy_helper.from_array(value, name), name=name
        )

    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("GlobalAveragePool", ["c"], ["g"], name="gap"),
        helper.make_node("Shape", ["g"], ["s"], name="shape"),
        helper.make_node("Cast", ["s"], ["s32"], to=TensorProto.INT32, name="cast_shape"),
        const("starts", np.array([0], np.int64)),
        const("ends", np.array([1], np.int64)),
        const("axes", np.array([0], np.int64)),
        const("steps", np.array([1], np.int64)),
        helper.make_node("Slice", ["s32", "starts", "ends", "axes", "steps"], ["n"], name="slice"),
        helper.make_node("Cast", ["n"], ["n64"], to=TensorProto.INT64, name="cast_n"),
        const("features", np.array([channels], np.int32)),
        helper.make_node("Cast", ["features"], ["f64"], to=TensorProto.INT64, name="cast_f"),
        helper.make_node("Concat", ["n64", "f64"], ["new_shape"], axis=0, name="concat"),
        helper.make_node("Reshape", ["g", "new_shape"], ["r"], name="reshape"),
        helper.make_node("MatMul", ["r", "wm"], ["m"], name="matmul"),
        helper.make_node("Add", ["m", "bm"], ["y"], name="add"),
    ]
    inits = [
        _weight(rng, "w", [channels, 3, 3, 3]),
        numpy_helper.from_array(np.zeros(channels, np.float32), "b"),
        _weight(rng, "wm", [channels, 4]),
        numpy_helper.from_array(np.zeros(4, np.float32), "bm"),
    ]
    return helper.make_graph(
        nodes,
        "shape_tail",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        inits,
    )


def write_config(root: Path, name: str, compile_section: str) -> Path:
    configs = root / "configs"
    configs.mkdir(parents=True, exist_ok=True)
    path = configs / f"{name}.toml"
    path.write_text(
        f'[model]\nname = "{name}"\nversion = "1.0.0"\nsource = "{name}.onnx"\n'
        f'[calibration]\nkind = "random"\n[compile]\n{compile_section}\n',
        encoding="utf-8",
    )
    return path


def build_inputs(
    root: Path,
    name: str,
    graph: Graph,
    compile_section: str = "",
    samples: int = 4,
    seed: int = 0,
    opset: int = 17,
) -> Path:
    """Float + QDQ + held-out feeds + record for ``graph``; returns the config path.

    Calibration uses 8 seeded samples, the held-out set ``samples`` more.
    """
    from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    rng = np.random.default_rng(seed)
    model = helper.make_model(graph(rng), opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    folder = root / "artifacts" / "build" / name
    (folder / "heldout").mkdir(parents=True, exist_ok=True)
    float_path = folder / "float.onnx"
    onnx.save(model, str(float_path))
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    input_name = model.graph.input[0].name

    def feeds(count: int) -> list[dict[str, np.ndarray]]:
        return [{input_name: rng.standard_normal(shape).astype(np.float32)} for _ in range(count)]

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.samples = iter(feeds(8))

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.samples, None)

    config = get_qnn_qdq_config(
        str(float_path),
        Reader(),
        activation_type=QuantType.QUInt16,
        weight_type=QuantType.QUInt8,
    )
    quantize(str(float_path), str(folder / "qdq.onnx"), config)
    qdq = onnx.load(str(folder / "qdq.onnx"))
    qdq.ir_version = IR_VERSION
    onnx.save(qdq, str(folder / "qdq.onnx"))
    for index, sample in enumerate(feeds(samples)):
        np.savez(folder / "heldout" / f"sample_{index:04d}.npz", **sample)
    record = {"quantize": {"status": "ok", "qdq_sha256": sha256_file(folder / "qdq.onnx")}}
    (folder / "record.json").write_text(json.dumps(record), encoding="utf-8")
    return write_config(root, name, compile_section)


def stock_chain(root: Path, name: str, source: Path) -> Path:
    """FACTS §4's stock chain on a real model: fix shapes, quantize u16/u8 on 4 seeded uniform
    samples, nothing else; laid out like the quantize stage's output.

    Like a naive calibration reader, it feeds *every* graph input, including the initializers
    that old exporters also list as inputs (ultraface does). Calibrating with those overridden
    gives the wild activation ranges behind ultraface's "Failed to compose Qnn graph".
    """
    from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config
    from onnxruntime.tools.onnx_model_utils import fix_output_shapes, make_input_shape_fixed

    model = onnx.load(str(source))
    del model.metadata_props[:]
    feeds_shape = {}
    for graph_input in model.graph.input:
        dims = [d.dim_value or 1 for d in graph_input.type.tensor_type.shape.dim]
        make_input_shape_fixed(model.graph, graph_input.name, dims)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(graph_input.type.tensor_type.elem_type)
        feeds_shape[graph_input.name] = (dims, dtype)
    fix_output_shapes(model)
    model = onnx.shape_inference.infer_shapes(model)
    folder = root / "artifacts" / "build" / name
    (folder / "heldout").mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(folder / "float.onnx"))
    rng = np.random.default_rng(0)

    def feeds() -> dict[str, np.ndarray]:
        return {
            k: rng.random(shape).astype(dtype) if dtype.kind == "f" else np.ones(shape, dtype)
            for k, (shape, dtype) in feeds_shape.items()
        }

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.samples = iter([feeds() for _ in range(4)])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.samples, None)

    recipe = get_qnn_qdq_config(
        str(folder / "float.onnx"),
        Reader(),
        activation_type=QuantType.QUInt16,
        weight_type=QuantType.QUInt8,
    )
    quantize(str(folder / "float.onnx"), str(folder / "qdq.onnx"), recipe)
    np.savez(folder / "heldout" / "sample_0000.npz", **feeds())
    record = {"quantize": {"status": "ok", "qdq_sha256": sha256_file(folder / "qdq.onnx")}}
    (folder / "record.json").write_text(json.dumps(record), encoding="utf-8")
    return write_config(root, name, "")
