"""The bundled examples' models and calibration data, generated from a seed (``python -m
pipeline example`` is their CLI).

Nothing is downloaded: the model (with a dynamic batch dim and BatchNorms, like many exported
models) and calibration images (smooth synthetic scenes) are rebuilt identically on any machine.
numpy and onnx are imported where something is generated, so a rerun that finds the example in
place imports neither.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

from .core.fileio import atomic_dir, atomic_path

SEED = 20261121
INPUT_SHAPE = (3, 32, 32)
CALIBRATION_SAMPLES = 48
IR_VERSION = 10
OPSET = 17


def build_example_model(seed: int = SEED) -> Any:
    """Conv-BN-ReLU x3 -> global pool -> Gemm -> Softmax, dynamic batch, seeded weights."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits = [], []

    def init(name: str, array: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(array.astype(np.float32), name))
        return name

    channels = [INPUT_SHAPE[0], 16, 32, 32]
    current = "input"
    for i in range(3):
        cin, cout = channels[i], channels[i + 1]
        fan_in = cin * 9
        w = init(f"conv{i}.weight", rng.normal(0, np.sqrt(2 / fan_in), (cout, cin, 3, 3)))
        b = init(f"conv{i}.bias", rng.normal(0, 0.05, cout))
        stride = 1 if i == 0 else 2
        nodes.append(
            helper.make_node(
                "Conv",
                [current, w, b],
                [f"conv{i}"],
                name=f"conv{i}",
                kernel_shape=[3, 3],
                pads=[1, 1, 1, 1],
                strides=[stride, stride],
            )
        )
        bn = [
            init(f"bn{i}.scale", rng.uniform(0.5, 1.5, cout)),
            init(f"bn{i}.bias", rng.normal(0, 0.1, cout)),
            init(f"bn{i}.mean", rng.normal(0, 0.1, cout)),
            init(f"bn{i}.var", rng.uniform(0.5, 1.5, cout)),
        ]
        nodes.append(
            helper.make_node(
                "BatchNormalization", [f"conv{i}", *bn], [f"bn{i}"], name=f"bn{i}", epsilon=1e-5
            )
        )
        nodes.append(helper.make_node("Relu", [f"bn{i}"], [f"relu{i}"], name=f"relu{i}"))
        current = f"relu{i}"
    nodes.append(helper.make_node("GlobalAveragePool", [current], ["pool"], name="pool"))
    nodes.append(helper.make_node("Flatten", ["pool"], ["flat"], name="flatten", axis=1))
    fc_w = init("fc.weight", rng.normal(0, np.sqrt(1 / channels[-1]), (10, channels[-1])))
    fc_b = init("fc.bias", rng.normal(0, 0.05, 10))
    nodes.append(helper.make_node("Gemm", ["flat", fc_w, fc_b], ["logits"], name="fc", transB=1))
    nodes.append(helper.make_node("Softmax", ["logits"], ["probabilities"], name="softmax", axis=1))

    graph = helper.make_graph(
        nodes,
        "example_cnn",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", *INPUT_SHAPE])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", 10])],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="pipeline.example"
    )
    model.ir_version = IR_VERSION
    return model


def synthetic_image(rng: np.random.Generator) -> np.ndarray:
    """A smooth scene (gradients, blobs, stripes) in [0, 1], NCHW, batch 1."""
    import numpy as np

    _, height, width = INPUT_SHAPE
    y, x = np.mgrid[0:height, 0:width] / np.array([height, width])[:, None, None]
    channels = []
    for _ in range(INPUT_SHAPE[0]):
        fx, fy = rng.uniform(0.5, 4, 2).tolist()
        phase = rng.uniform(0, np.pi)
        cx, cy, r = rng.uniform(0.2, 0.8), rng.uniform(0.2, 0.8), rng.uniform(0.1, 0.4)
        stripes = 0.5 + 0.5 * np.sin(2 * np.pi * (fx * x + fy * y) + phase)
        blob = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r))
        value = 0.5 * stripes + 0.5 * blob + rng.normal(0, 0.03, (height, width))
        channels.append(value)
    image = np.clip(np.stack(channels), 0.0, 1.0)
    return image[np.newaxis].astype(np.float32)


def _ensure(
    root: Path,
    model_file: str,
    build: Callable[[], Any],
    calibration: str,
    samples: Callable[[np.random.Generator], Iterator[np.ndarray]],
    count: int,
    seed: int,
    force: bool,
) -> Path:
    """Write a seeded model and ``count`` calibration arrays under ``root/artifacts/example``,
    unless they are already there."""
    import numpy as np
    import onnx

    folder = Path(root) / "artifacts" / "example"
    model_path = folder / model_file
    calib = folder / calibration
    if not force and model_path.is_file() and len(list(calib.glob("*.npy"))) == count:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(model_path) as tmp:
        onnx.save(build(), str(tmp))
    with atomic_dir(calib) as tmp_dir:
        for index, array in enumerate(samples(np.random.default_rng(seed))):
            np.save(tmp_dir / f"sample_{index:03d}.npy", array)
    return folder


def ensure_example(root: Path, force: bool = False) -> Path:
    """Write the example model and calibration tensors under ``root/artifacts/example``."""

    def images(rng: np.random.Generator) -> Iterator[np.ndarray]:
        for _ in range(CALIBRATION_SAMPLES):
            yield synthetic_image(rng)

    return _ensure(
        root,
        "example_cnn.onnx",
        build_example_model,
        "calibration",
        images,
        CALIBRATION_SAMPLES,
        SEED + 1,
        force,
    )


# -- the bucketed example: a sequence model with a dynamic length --------------------------------

SEQ_CHANNELS = 16
SEQ_HIDDEN = 48
SEQ_SAMPLES = 48
SEQ_MAX_FRAMES = 256


def build_sequence_model(seed: int = SEED) -> Any:
    """A causal 1-D conv denoiser over ``latent [1, 16, frames]`` with a dynamic ``frames`` dim.

    Causal convolutions (left padding only) make frame t depend on frames <= t alone, so padding
    the end of a sequence into a longer bucket leaves the real frames' outputs unchanged: the
    runtime's cropped output then equals the float model at the true length up to quantization.
    """
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed + 2)
    inits = []

    def init(name: str, shape: tuple[int, ...], scale: float) -> str:
        inits.append(numpy_helper.from_array(rng.normal(0, scale, shape).astype(np.float32), name))
        return name

    c, h = SEQ_CHANNELS, SEQ_HIDDEN
    nodes = [
        helper.make_node(
            "Conv",
            [
                "latent",
                init("conv0.weight", (h, c, 5), np.sqrt(2 / (c * 5))),
                init("conv0.bias", (h,), 0.05),
            ],
            ["conv0"],
            name="conv0",
            kernel_shape=[5],
            pads=[4, 0],  # causal: 4 frames of history, none of the future
        ),
        helper.make_node("Relu", ["conv0"], ["relu0"], name="relu0"),
        helper.make_node(
            "Conv",
            [
                "relu0",
                init("conv1.weight", (h, h, 3), np.sqrt(2 / (h * 3))),
                init("conv1.bias", (h,), 0.05),
            ],
            ["conv1"],
            name="conv1",
            kernel_shape=[3],
            dilations=[2],
            pads=[4, 0],
        ),
        helper.make_node("Relu", ["conv1"], ["relu1"], name="relu1"),
        helper.make_node(
            "Conv",
            [
                "relu1",
                init("proj.weight", (c, h, 1), np.sqrt(1 / h)),
                init("proj.bias", (c,), 0.02),
            ],
            ["residual"],
            name="proj",
            kernel_shape=[1],
        ),
        helper.make_node("Add", ["latent", "residual"], ["denoised"], name="add"),
    ]
    graph = helper.make_graph(
        nodes,
        "example_seq",
        [helper.make_tensor_value_info("latent", TensorProto.FLOAT, [1, c, "frames"])],
        [helper.make_tensor_value_info("denoised", TensorProto.FLOAT, [1, c, "frames"])],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="pipeline.example"
    )
    model.ir_version = IR_VERSION
    return model


def synthetic_latent(rng: np.random.Generator, frames: int) -> np.ndarray:
    """A noisy mix of slow sinusoids, ``[1, 16, frames]``: something a denoiser would see."""
    import numpy as np

    t = np.arange(frames, dtype=np.float64)[np.newaxis, :]
    freqs = rng.uniform(0.01, 0.2, (SEQ_CHANNELS, 1))
    phases = rng.uniform(0, 2 * np.pi, (SEQ_CHANNELS, 1))
    clean = np.sin(2 * np.pi * freqs * t + phases) * rng.uniform(0.5, 1.5, (SEQ_CHANNELS, 1))
    noisy = clean + rng.normal(0, 0.2, clean.shape)
    return noisy[np.newaxis].astype(np.float32)


def ensure_bucket_example(root: Path, force: bool = False) -> Path:
    """Write the sequence model and calibration latents of varied length (configs/example_buckets.toml)."""

    def latents(rng: np.random.Generator) -> Iterator[np.ndarray]:
        for _ in range(SEQ_SAMPLES):
            yield synthetic_latent(rng, int(rng.integers(16, SEQ_MAX_FRAMES + 1)))

    return _ensure(
        root,
        "example_seq.onnx",
        build_sequence_model,
        "seq_calibration",
        latents,
        SEQ_SAMPLES,
        SEED + 3,
        force,
    )
