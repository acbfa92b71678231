"""Small real inputs for the compile stage, laid out exactly as the quantize stage leaves them.

Each graph is built with onnx.helper from a seed, quantized with onnxruntime's own QNN QDQ
recipe (get_qnn_qdq_config + quantize, u16 activations / u8 weights) and written as the one
bucket ("static") of a model without ``[buckets]`` (pipeline.core.layout):

    <root>/configs/<name>.toml and <name>.onnx     the model config and its source model
    <root>/artifacts/build/<name>/
        heldout/sample_NNNN.npz (+ index.json)     held-out samples at their true size
        buckets/static/{float,qdq}.onnx            the float model and its QDQ model
        buckets/static/heldout/sample_NNNN.npz     the held-out samples that fit the bucket
        record.json                                a QuantizeRecord, written last

The record is a real ``pipeline.core.records.QuantizeRecord`` (the compile stage reads it
strictly and checks every bucket's QDQ model against its sha256): its BuildInputs come from the
quantize stage's own ``build_inputs`` on the config, its summary from the QDQ vs float
comparison of ``pipeline.quantize.evaluate`` on the held-out samples.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from pipeline.core.accuracy import worst_snr
from pipeline.core.config import load_config
from pipeline.core.fileio import link_or_copy, sha256_file, write_json
from pipeline.core.layout import ModelPaths, sample_name
from pipeline.core.records import (
    BucketArtifacts,
    QuantizeRecord,
    QuantizeSummary,
    folder_digest,
    write_record,
)

IR_VERSION = 9  # onnxruntime 1.26 (the 2.3.0 pin) reads up to IR 10; 1.31 up to 13
BUCKET = "static"  # the one bucket of a model with one static shape
CALIBRATION_SAMPLES = 8
Graph = Callable[[np.random.Generator], onnx.GraphProto]
Feeds = dict[str, np.ndarray]


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


# -- the layout the quantize stage leaves ----------------------------------------------------------


def write_config(root: Path, name: str, compile_section: str, source: str | None = None) -> Path:
    """``<root>/configs/<name>.toml``; ``source`` defaults to ``<name>.onnx`` beside it."""
    configs = root / "configs"
    configs.mkdir(parents=True, exist_ok=True)
    path = configs / f"{name}.toml"
    path.write_text(
        f'[model]\nname = "{name}"\nversion = "1.0.0"\nsource = "{source or name + ".onnx"}"\n'
        f'[calibration]\nkind = "random"\n[compile]\n{compile_section}\n',
        encoding="utf-8",
    )
    return path


def build_whole_on_htp(
    root: Path,
    name: str,
    model: onnx.ModelProto,
    samples: int = 16,
    quantization: str = "",
    min_db: float = 30.0,
) -> None:
    """Quantize and compile ``model`` with the real stages (random calibration, one target;
    ``quantization``: lines for its [quantization] section) and assert that the ctx is whole on
    the HTP and more than ``min_db`` from the CPU QDQ model there (compile's validation)."""
    from pipeline.__main__ import main
    from pipeline.core.records import VariantRecord, read_record

    onnx.save(model, str(root / f"{name}.onnx"))
    config = root / f"{name}.toml"
    config.write_text(
        f'[model]\nname = "{name}"\nversion = "1.0.0"\nsource = "{name}.onnx"\n'
        f'[calibration]\nkind = "random"\nsamples = {samples}\n[quantization]\n{quantization}\n'
        '[compile]\ntargets = ["snapdragon-x-elite"]\nmin_snr_db = 30.0\n',
        encoding="utf-8",
    )
    artifacts = root / "artifacts"
    for stage in ("quantize", "compile"):
        assert main([stage, "--artifacts", str(artifacts), str(config)]) == 0, stage
    folder = next(ModelPaths.of(artifacts, name).ctx.glob("*/snapdragon-x-elite"))
    record, why = read_record(VariantRecord, folder / "variant.json")
    assert record is not None and record.coverage is not None, why
    assert record.coverage.qnn_partitions == 1 and record.coverage.cpu_compute_nodes == []
    assert record.validation is not None and record.validation.worst_snr_db > min_db, (
        record.validation
    )


def quantize_on_noise(root: Path, name: str, model: onnx.ModelProto, quantization: str = "") -> int:
    """Save ``model`` as ``<root>/<name>.onnx``, calibrate it on 8 seeded noise samples with the
    real quantize stage (``quantization``: lines for its [quantization] section); its exit
    code."""
    from pipeline.__main__ import main

    onnx.save(model, str(root / f"{name}.onnx"))
    config = root / f"{name}.toml"
    config.write_text(
        f'[model]\nname = "{name}"\nversion = "1.0.0"\nsource = "{name}.onnx"\n'
        f'[calibration]\nkind = "random"\nsamples = 8\n[quantization]\n{quantization}\n',
        encoding="utf-8",
    )
    return main(["quantize", "--artifacts", str(root / "artifacts"), str(config)])


def ctx_vs_qdq_on_htp(qdq: Path, float_model: Path, sample: Path, work: Path) -> float:
    """The judge's probe of ``qdq`` on one sample (Snapdragon X Elite: soc 60, HTP v73):
    asserts it runs whole on the HTP and returns its ctx vs CPU QDQ SNR in dB."""
    from pipeline.htp.probe import probe

    result = probe(qdq, float_model, [sample], work, 60, 73)
    assert result.ok, result.error
    assert result.partitions == 1 and result.cpu_nodes == 0
    return result.worst_ctx_vs_qdq


def whole_ctx_vs_float(
    work: Path, models: dict[str, onnx.ModelProto], samples: list[Feeds]
) -> dict[str, float]:
    """Each of ``models`` run unquantized on the HTP simulator (Snapdragon X Elite: soc 60,
    HTP v73) over ``samples``, against the "float" one on the CPU: asserts each runs whole on
    the HTP and returns its ctx vs float SNR in dB."""
    from pipeline.htp.probe import probe

    for name, model in models.items():
        onnx.save(model, str(work / f"{name}.onnx"))
    paths = []
    for index, sample in enumerate(samples):
        paths.append(work / f"sample_{index}.npz")
        np.savez(paths[-1], **sample)
    results = {}
    for name in models:
        result = probe(work / f"{name}.onnx", work / "float.onnx", paths, work / name, 60, 73)
        assert result.ok, result.error
        assert result.partitions == 1 and result.cpu_nodes == 0
        results[name] = result.worst_ctx_vs_float
    return results


def model_paths(root: Path, name: str) -> ModelPaths:
    return ModelPaths.of(root / "artifacts", name)


def feeds_reader(calibration: list[Feeds]) -> Any:
    """An onnxruntime CalibrationDataReader over these samples, for its quantizer in tests."""
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.samples = iter(calibration)

        def get_next(self) -> Feeds | None:
            return next(self.samples, None)

    return Reader()


def _quantize_qnn(float_path: Path, qdq_path: Path, calibration: list[Feeds]) -> None:
    """onnxruntime's QNN QDQ recipe: u16 activations, u8 weights, MinMax."""
    from onnxruntime.quantization import QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    recipe = get_qnn_qdq_config(
        str(float_path),
        feeds_reader(calibration),
        activation_type=QuantType.QUInt16,
        weight_type=QuantType.QUInt8,
    )
    quantize(str(float_path), str(qdq_path), recipe)


def _write_heldout(paths: ModelPaths, samples: list[Feeds]) -> None:
    """True-size samples under heldout/, and the same files in the one bucket (no padding)."""
    bucket = paths.bucket(BUCKET)
    paths.heldout.mkdir(parents=True, exist_ok=True)
    bucket.heldout.mkdir(parents=True, exist_ok=True)
    for index, sample in enumerate(samples):
        true_path = paths.heldout / sample_name(index)
        np.savez(true_path, **sample)
        link_or_copy(true_path, bucket.heldout / sample_name(index))
    write_json(
        paths.heldout / "index.json",
        [{"sample": i, "bucket": BUCKET} for i in range(len(samples))],
    )


def write_quantize_record(
    config_path: Path, calibration_samples: int, evaluated: bool = True
) -> QuantizeRecord:
    """The record the quantize stage writes last, for the one bucket already on disk.

    ``evaluated``: compare QDQ with float on the held-out samples for the summary (as the
    quantize stage does); without it the summary says nothing was measured (NaN, no outputs).
    """
    from pipeline.quantize.evaluate import evaluate
    from pipeline.quantize.reuse import build_inputs as quantize_inputs

    config = load_config(config_path)
    paths = model_paths(config_path.parent.parent, config.model.name)
    bucket = paths.bucket(BUCKET)
    float_model = onnx.load(str(bucket.float_model), load_external_data=False)
    shapes = {
        i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in float_model.graph.input
    }
    heldout = len(list(bucket.heldout.glob("sample_*.npz")))
    outputs = evaluate(bucket.float_model, bucket.qdq, bucket.heldout) if evaluated else {}
    q = config.quantization
    record = QuantizeRecord(
        status="ok",
        model=config.model.name,
        inputs=quantize_inputs(config),
        buckets=[
            BucketArtifacts(
                name=BUCKET,
                shapes=shapes,
                float_sha256=sha256_file(bucket.float_model),
                qdq_sha256=sha256_file(bucket.qdq),
                heldout_digest=folder_digest(bucket.heldout, "sample_*.npz"),
                heldout_samples=heldout,
            )
        ],
        pads=[],
        crops=[],
        summary=QuantizeSummary(
            activation_type=q.activation_type,
            weight_type=q.weight_type,
            method=q.method,
            calibration_samples=calibration_samples,
            heldout_samples=heldout,
            worst_snr_db=worst_snr(outputs) if outputs else float("nan"),
            outputs=outputs,
            prepare_steps=[],
            mixed_precision=[],
        ),
    )
    write_record(paths.record, record)
    return record


def build_inputs(
    root: Path,
    name: str,
    graph: Graph,
    compile_section: str = "",
    samples: int = 4,
    seed: int = 0,
    opset: int = 17,
) -> Path:
    """Source + float + QDQ + held-out feeds + record for ``graph``; returns the config path.

    Calibration uses 8 seeded samples, the held-out set ``samples`` more.
    """
    rng = np.random.default_rng(seed)
    model = helper.make_model(graph(rng), opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    config = write_config(root, name, compile_section)
    onnx.save(model, str(config.parent / f"{name}.onnx"))  # the source; nothing to prepare
    paths = model_paths(root, name)
    bucket = paths.bucket(BUCKET)
    bucket.root.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(bucket.float_model))
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    input_name = model.graph.input[0].name

    def feeds(count: int) -> list[Feeds]:
        return [{input_name: rng.standard_normal(shape).astype(np.float32)} for _ in range(count)]

    _quantize_qnn(bucket.float_model, bucket.qdq, feeds(CALIBRATION_SAMPLES))
    qdq = onnx.load(str(bucket.qdq))
    qdq.ir_version = IR_VERSION
    onnx.save(qdq, str(bucket.qdq))
    _write_heldout(paths, feeds(samples))
    write_quantize_record(config, CALIBRATION_SAMPLES)
    return config


def stock_chain(root: Path, name: str, source: Path) -> Path:
    """FACTS §4's stock chain on a real model: fix shapes, quantize u16/u8 on 4 seeded uniform
    samples, nothing else; laid out like the quantize stage's output.

    Like a naive calibration reader, it feeds *every* graph input, including the initializers
    that old exporters also list as inputs (ultraface does). Calibrating with those overridden
    gives the wild activation ranges behind ultraface's "Failed to compose Qnn graph".
    """
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
    config = write_config(root, name, "", source=Path(source).resolve().as_posix())
    paths = model_paths(root, name)
    bucket = paths.bucket(BUCKET)
    bucket.root.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(bucket.float_model))
    rng = np.random.default_rng(0)

    def feeds() -> Feeds:
        return {
            k: rng.random(shape).astype(dtype) if dtype.kind == "f" else np.ones(shape, dtype)
            for k, (shape, dtype) in feeds_shape.items()
        }

    _quantize_qnn(bucket.float_model, bucket.qdq, [feeds() for _ in range(4)])
    _write_heldout(paths, [feeds()])
    # The stock chain measures nothing: its feeds override initializers the QDQ model bakes in.
    write_quantize_record(config, 4, evaluated=False)
    return config


# A rerun with nothing changed reads records and digests only: none of these is imported.
HEAVY_MODULES = ("numpy", "onnx", "onnxruntime", "matplotlib")


def heavy_imports(*argv: str, cwd: Path) -> list[str]:
    """The heavy modules ``python -m pipeline *argv`` imports (Python's own -X importtime
    list); the command must succeed."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "pipeline", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    imported = {
        line.rpartition("|")[2].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:")
    }
    return sorted(imported & set(HEAVY_MODULES))
