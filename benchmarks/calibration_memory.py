"""Peak RSS of the quantize stage: 16 vs 256 calibration samples, and a 1024x2048 segmenter.

MinMax calibration and the per-tensor statistics are reduced inside the graph, one sample at a
time (pipeline.calibration.ranges.activation_statistics), so peak memory must neither grow with
the number of samples nor hold a sample's activations all at once. For contrast the same model is calibrated with onnxruntime's stock ``quantize_static``
reading every sample before computing ranges.

    python benchmarks/calibration_memory.py [--model PATH] [--no-segmenter]

Default model for the sample-count comparison: ../shared/models/ultraface_rfb320.onnx when
present (large activations), else a generated CNN with 3x256x256 input. The segmenter row is a
generated encoder / bilinear-decoder net at 1x3x1024x2048 (the largest input class seen), built
whole by the quantize stage (mixed precision and the HTP judge on); its peak must stay <= 1.5 GiB.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED_MODEL = ROOT.parent / "shared" / "models" / "ultraface_rfb320.onnx"


def generated_model(folder: Path) -> Path:
    """A CNN whose activations are large enough to show memory growth (3x256x256 input)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper, save

    rng = np.random.default_rng(0)
    nodes, inits, current = [], [], "input"
    for i, (cin, cout) in enumerate([(3, 32), (32, 32), (32, 32)]):
        w = numpy_helper.from_array(
            rng.normal(0, 0.2, (cout, cin, 3, 3)).astype(np.float32), f"w{i}"
        )
        inits.append(w)
        nodes.append(helper.make_node("Conv", [current, f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1]))
        nodes.append(helper.make_node("Relu", [f"c{i}"], [f"r{i}"]))
        current = f"r{i}"
    graph = helper.make_graph(
        nodes,
        "big",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 256, 256])],
        [helper.make_tensor_value_info(current, TensorProto.FLOAT, [1, 32, 256, 256])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    path = folder / "big_cnn.onnx"
    save(model, str(path))
    return path


def segmenter_model(folder: Path) -> Path:
    """An encoder (3 stride-2 convs) / bilinear decoder (x8 Resize) at 1x3x1024x2048, 19 classes:
    the activation sizes of a Cityscapes segmenter."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper, save

    rng = np.random.default_rng(0)
    nodes, inits, current = [], [], "image"
    layers = [(3, 32, 2), (32, 64, 2), (64, 96, 2), (96, 96, 1), (96, 96, 1)]
    for i, (cin, cout, stride) in enumerate(layers):
        w = rng.normal(0, (2.0 / (cin * 9)) ** 0.5, (cout, cin, 3, 3)).astype(np.float32)
        inits += [
            numpy_helper.from_array(w, f"w{i}"),
            numpy_helper.from_array(rng.normal(0, 0.1, cout).astype(np.float32), f"b{i}"),
        ]
        nodes += [
            helper.make_node(
                "Conv",
                [current, f"w{i}", f"b{i}"],
                [f"c{i}"],
                pads=[1, 1, 1, 1],
                strides=[stride, stride],
            ),
            helper.make_node("Relu", [f"c{i}"], [f"r{i}"]),
        ]
        current = f"r{i}"
    w = rng.normal(0, 0.1, (19, 96, 1, 1)).astype(np.float32)
    inits += [
        numpy_helper.from_array(w, "wcls"),
        numpy_helper.from_array(np.array([1, 1, 8, 8], np.float32), "scales"),
    ]
    nodes += [
        helper.make_node("Conv", [current, "wcls"], ["logits"]),
        helper.make_node(
            "Resize",
            ["logits", "", "scales"],
            ["segmentation"],
            mode="linear",
            coordinate_transformation_mode="half_pixel",
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "segmenter",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, 1024, 2048])],
        [helper.make_tensor_value_info("segmentation", TensorProto.FLOAT, [1, 19, 1024, 2048])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    path = folder / "segmenter_1024x2048.onnx"
    save(model, str(path))
    return path


def run_child(argv: list[str]) -> tuple[float, float]:
    """Run a child process; return (peak RSS MiB, wall seconds) from its own rusage."""
    with tempfile.TemporaryFile() as log:  # a file, not a pipe: a chatty child never blocks
        start = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        elapsed = time.perf_counter() - start
        if os.waitstatus_to_exitcode(status) != 0:
            log.seek(0)
            sys.exit(f"child failed: {' '.join(argv)}\n{log.read().decode()[-2000:]}")
    return usage.ru_maxrss / 1024, elapsed


STOCK = textwrap.dedent(
    """
    import sys, numpy as np, onnx
    from onnxruntime.quantization import quantize_static, CalibrationDataReader, QuantType
    model, count, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    m = onnx.load(model)
    shape = [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim]
    class R(CalibrationDataReader):
        def __init__(self): self.i = 0
        def get_next(self):
            if self.i >= count: return None
            self.i += 1
            rng = np.random.default_rng(self.i)
            return {m.graph.input[0].name: rng.standard_normal(shape).astype(np.float32)}
    quantize_static(model, out, R(), activation_type=QuantType.QUInt16,
                    weight_type=QuantType.QUInt8)
    """
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="float ONNX model (static input shape)")
    parser.add_argument("--no-segmenter", action="store_true", help="skip the 1024x2048 row")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = args.model or (SHARED_MODEL if SHARED_MODEL.is_file() else generated_model(tmp))
        rows = []
        for count in (16, 256):
            config = tmp / f"c{count}.toml"
            config.write_text(
                f'[model]\nname = "bench{count}"\nsource = "{model}"\n'
                f'[calibration]\nkind = "random"\nsamples = {count + count // 4}\n'
                "held_out = 0.2\n[quantization]\nauto_mixed_precision = false\n"
            )
            ours = run_child(
                [
                    sys.executable,
                    "-m",
                    "pipeline",
                    "quantize",
                    str(config),
                    "--artifacts",
                    str(tmp / "art"),
                    "--force",
                ]
            )
            stock = run_child(
                [
                    sys.executable,
                    "-c",
                    STOCK,
                    str(model),
                    str(count),
                    str(tmp / f"stock{count}.onnx"),
                ]
            )
            rows.append((count, ours, stock))
        segmenter = None
        if not args.no_segmenter:
            big = segmenter_model(tmp)
            config = tmp / "segmenter.toml"
            config.write_text(
                f'[model]\nname = "segmenter"\nsource = "{big}"\n'
                '[calibration]\nkind = "random"\nsamples = 20\nheld_out = 0.2\n'
                "[quantization]\ntarget_snr_db = 25.0\n"
            )
            segmenter = run_child(
                [
                    sys.executable,
                    "-m",
                    "pipeline",
                    "quantize",
                    str(config),
                    "--artifacts",
                    str(tmp / "art"),
                    "--force",
                ]
            )
    print(f"model: {model.name}")
    print(
        "| calibration samples | pipeline peak RSS (MiB) | time (s) | stock quantize_static peak RSS (MiB) | time (s) |"
    )
    print("|---|---|---|---|---|")
    for count, (rss, wall), (srss, swall) in rows:
        print(f"| {count} | {rss:.0f} | {wall:.1f} | {srss:.0f} | {swall:.1f} |")
    ratio = rows[1][1][0] / rows[0][1][0]
    stock_ratio = rows[1][2][0] / rows[0][2][0]
    print(
        f"\npeak RSS ratio 256/16: pipeline {ratio:.2f} (must stay <= 1.3), stock {stock_ratio:.2f}"
    )
    ok = ratio <= 1.3
    if segmenter is not None:
        rss, wall = segmenter
        print(
            f"\n1x3x1024x2048 segmenter (16 calibration + 4 held-out samples, the whole quantize "
            f"stage): peak RSS {rss:.0f} MiB ({rss / 1024:.2f} GiB, must stay <= 1.5), {wall:.1f} s"
        )
        ok &= rss <= 1.5 * 1024
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
