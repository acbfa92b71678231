"""The native abort seen on real models ("Tensor name not found.") is ours to avoid, and we do.

tests/test_compile.py shows the raw pattern (``Reshape(g, Concat(Shape(g)[0:1], [C]))``, found
by bisecting ppocr_cls) kills the process that loads its ctx model. The cause is the int64
shape arithmetic becoming its own QNN partition. Our preparation folds shape arithmetic of
static tensors into constants, so the same float model through the whole pipeline compiles,
loads and validates in one partition.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from compile_fixtures import IR_VERSION, shape_tail
from onnx import helper

from pipeline.__main__ import main
from pipeline.core.layout import ModelPaths
from pipeline.core.records import QuantizeRecord, VariantRecord, read_record


@pytest.mark.qnn
def test_pipeline_prepares_away_the_pattern_that_aborts_qnn(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime_qnn")
    model = helper.make_model(
        shape_tail(np.random.default_rng(0)), opset_imports=[helper.make_opsetid("", 17)]
    )
    model.ir_version = IR_VERSION
    onnx.save(model, str(tmp_path / "shape_tail.onnx"))
    config = tmp_path / "shape_tail.toml"
    config.write_text(
        '[model]\nname = "shape_tail"\nsource = "shape_tail.onnx"\n'
        '[calibration]\nkind = "random"\nsamples = 12\n'
        '[compile]\ntargets = ["snapdragon-x-elite"]\n'
    )
    artifacts = str(tmp_path / "artifacts")
    assert main(["quantize", str(config), "--artifacts", artifacts]) == 0
    paths = ModelPaths.of(tmp_path / "artifacts", "shape_tail")
    quantized, why = read_record(QuantizeRecord, paths.record)
    assert quantized is not None and [b.name for b in quantized.buckets] == ["static"], why
    float_model = paths.bucket("static").float_model
    prepared_ops = {n.op_type for n in onnx.load(str(float_model)).graph.node}
    assert not prepared_ops & {"Shape", "Concat", "Slice", "Cast"}, prepared_ops

    assert main(["compile", str(config), "--artifacts", artifacts]) == 0
    (variant_dir,) = paths.ctx.glob("*/snapdragon-x-elite")
    record, why = read_record(VariantRecord, variant_dir / "variant.json")
    assert record is not None, why
    assert record.status == "ok" and record.passed, record.error
    assert record.coverage is not None and record.validation is not None
    assert record.coverage.qnn_partitions == 1
    assert record.validation.worst_snr_db > 30
