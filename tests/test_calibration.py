"""Calibration sources: tensors, images, wav windows, user readers; bad data gets clear errors."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
import pytest

from pipeline.calibration.samples import (
    BucketSamples,
    InputSpec,
    Router,
    SampleRef,
    SampleSource,
    sample_source,
)
from pipeline.core.config import ModelConfig, load_config
from pipeline.core.errors import CalibrationError
from pipeline.graph import buckets as bk
from pipeline.graph.buckets import single_bucket

SPEC = [InputSpec("x", (1, 3, 8, 8), np.dtype("float32"))]


def build_samples(
    config: ModelConfig, specs: list[InputSpec]
) -> tuple[BucketSamples, BucketSamples]:
    """The calibration and held-out samples of a model with one static shape (one bucket), the
    way the quantize stage makes them: a sample source, routed into the plan's only bucket."""
    plan = single_bucket({s.name: s.shape for s in specs})
    router = Router(config, plan, {s.name: s.dtype for s in specs})
    source = sample_source(config, specs)
    (bucket,) = plan.buckets
    return (
        BucketSamples(source, router, bucket, source.calib),
        BucketSamples(source, router, bucket, source.held),
    )


def make_config(tmp_path: Path, calibration: str) -> ModelConfig:
    (tmp_path / "m.onnx").write_bytes(b"x")
    path = tmp_path / "cfg.toml"
    path.write_text(f'[model]\nname = "m"\nsource = "m.onnx"\n[calibration]\n{calibration}\n')
    return load_config(path)


def tensor_folder(tmp_path: Path, count: int, **kwargs: object) -> Path:
    folder = tmp_path / "data"
    folder.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    shape = kwargs.get("shape", (1, 3, 8, 8))
    dtype = kwargs.get("dtype", np.float32)
    for i in range(count):
        np.save(folder / f"s{i:02d}.npy", rng.standard_normal(shape).astype(dtype))
    return folder


def test_tensors_split_is_deterministic_and_disjoint(tmp_path: Path) -> None:
    tensor_folder(tmp_path, 20)
    config = make_config(tmp_path, 'kind = "tensors"\npath = "data"\nsamples = 20\nheld_out = 0.25')
    calib, held = build_samples(config, SPEC)
    assert (len(calib), len(held)) == (15, 5)
    assert not {r.path for r in calib.refs} & {r.path for r in held.refs}
    again, _ = build_samples(config, SPEC)
    assert [r.path for r in again.refs] == [r.path for r in calib.refs]
    first = next(iter(calib))
    assert first["x"].shape == (1, 3, 8, 8) and first["x"].dtype == np.float32


def test_sample_count_caps_selection(tmp_path: Path) -> None:
    tensor_folder(tmp_path, 20)
    config = make_config(tmp_path, 'kind = "tensors"\npath = "data"\nsamples = 8\nheld_out = 0.25')
    calib, held = build_samples(config, SPEC)
    assert len(calib) + len(held) == 8


def test_missing_batch_axis_is_added(tmp_path: Path) -> None:
    tensor_folder(tmp_path, 2, shape=(3, 8, 8))
    config = make_config(tmp_path, 'kind = "tensors"\npath = "data"\nheld_out = 0.0')
    calib, _ = build_samples(config, SPEC)
    assert next(iter(calib))["x"].shape == (1, 3, 8, 8)


@pytest.mark.parametrize("shape", [(1, 3, 8, 8), (3, 8, 8)])
def test_one_sample_is_repeated_to_a_fixed_batch(tmp_path: Path, shape: tuple[int, ...]) -> None:
    """A model exported with a fixed batch of 4 takes 4 copies of each batch-1 sample."""
    tensor_folder(tmp_path, 2, shape=shape)
    config = make_config(tmp_path, 'kind = "tensors"\npath = "data"\nheld_out = 0.0')
    calib, _ = build_samples(config, [InputSpec("x", (4, 3, 8, 8), np.dtype("float32"))])
    first = next(iter(calib))["x"]
    assert first.shape == (4, 3, 8, 8)
    assert all(np.array_equal(first[0], first[k]) for k in range(1, 4))


def test_a_sample_of_another_batch_is_refused_not_repeated(tmp_path: Path) -> None:
    tensor_folder(tmp_path, 2, shape=(2, 3, 8, 8))
    config = make_config(tmp_path, 'kind = "tensors"\npath = "data"')
    calib, _ = build_samples(config, [InputSpec("x", (4, 3, 8, 8), np.dtype("float32"))])
    with pytest.raises(CalibrationError, match=r"shape \[2, 3, 8, 8\]; the model takes exactly"):
        list(calib)


def test_an_audio_window_is_repeated_to_a_fixed_batch(tmp_path: Path) -> None:
    folder = tmp_path / "wav"
    folder.mkdir()
    write_wav(folder / "a.wav", np.arange(64 * 4) % 1000)
    config = make_config(
        tmp_path, 'kind = "audio"\npath = "wav"\nheld_out = 0.0\n[calibration.audio]\nwindow = 64'
    )
    calib, _ = build_samples(config, [InputSpec("audio", (3, 64), np.dtype("float32"))])
    first = next(iter(calib))["audio"]
    assert first.shape == (3, 64) and np.allclose(first * 32768, np.arange(64))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"shape": (1, 3, 9, 9)},
            r"Input 'x' has shape \[1, 3, 9, 9\]; the model takes exactly \[1, 3, 8, 8\]",
        ),
        ({"dtype": np.float64}, "has dtype float64, the model input needs float32"),
    ],
)
def test_wrong_shape_or_dtype(tmp_path: Path, kwargs: dict, message: str) -> None:
    tensor_folder(tmp_path, 2, **kwargs)
    config = make_config(tmp_path, 'kind = "tensors"\npath = "data"')
    calib, _ = build_samples(config, SPEC)
    with pytest.raises(CalibrationError, match=message) as info:
        list(calib)
    assert "s0" in str(info.value)  # names the file


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((1, 3, 9, 9), "has shape [1, 3, 9, 9]; the model takes exactly [1, 3, 8, 8]"),
        ((1, 3, 4, 8), "has shape [1, 3, 4, 8]; the model takes exactly [1, 3, 8, 8]"),
        ((3, 8, 9), "has shape [1, 3, 8, 9]; the model takes exactly [1, 3, 8, 8]"),
        ((2, 1, 3, 8, 8), "has rank 5 (shape [2, 1, 3, 8, 8]); the model takes rank 4"),
    ],
)
def test_single_bucket_refuses_a_sample_of_another_shape(
    tmp_path: Path, shape: tuple[int, ...], message: str
) -> None:
    """One static shape is a bucket with nothing to pad: a sample must have exactly its shape,
    smaller ones too. The error names the file and the shape the model needs, for calibration
    and held-out samples alike."""
    folder = tensor_folder(tmp_path, 4, shape=shape)
    config = make_config(tmp_path, 'kind = "tensors"\npath = "data"\nheld_out = 0.5')
    calib, held = build_samples(config, SPEC)
    for part in (calib, held):
        with pytest.raises(CalibrationError) as info:
            list(part)
        text = str(info.value)
        assert message in text
        assert str(folder / part.refs[0].path.name) in text  # the first file of that part
        assert "[inputs]" in (info.value.tip or "")  # the fix of a single shape, not [buckets]
    # The router says the same for one sample, as the quantize stage calls it.
    router = calib.router
    ref = SampleRef(folder / "s00.npy")
    own = router.own({"x": np.zeros(shape, np.float32)}, ref)
    with pytest.raises(CalibrationError, match=r"s00\.npy: Input 'x'") as info:
        router.bucket_of(own, ref)
    assert message in str(info.value)


def test_single_bucket_takes_a_sample_of_its_shape_as_it_is(tmp_path: Path) -> None:
    tensor_folder(tmp_path, 2)
    config = make_config(tmp_path, 'kind = "tensors"\npath = "data"\nheld_out = 0.0')
    calib, _ = build_samples(config, SPEC)
    ref, sample = next(calib.source.iterate(calib.refs))
    (feeds,) = [f for r, f in calib.items() if r == ref]
    assert np.array_equal(feeds["x"], sample["x"])  # nothing padded, nothing changed
    assert calib.router.bucket_of(feeds, ref).name == "static"


def test_wrong_tensor_name_in_npz(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    np.savez(folder / "a.npz", y=np.zeros((1, 3, 8, 8), np.float32))
    config = make_config(tmp_path, 'kind = "tensors"\npath = "data"\nheld_out = 0.0')
    calib, _ = build_samples(config, SPEC)
    with pytest.raises(CalibrationError, match=r"a.npz has tensor\(s\) \['y'\] that are not"):
        list(calib)


def test_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    config = make_config(tmp_path, 'kind = "tensors"\npath = "data"')
    with pytest.raises(CalibrationError, match="holds no tensor files"):
        build_samples(config, SPEC)


def test_images_preprocessing(tmp_path: Path) -> None:
    from PIL import Image

    folder = tmp_path / "img"
    folder.mkdir()
    pixels = np.zeros((20, 40, 3), np.uint8)
    pixels[:, :, 0] = 255  # pure red
    Image.fromarray(pixels).save(folder / "red.png")
    Image.fromarray(pixels).save(folder / "red2.png")
    config = make_config(
        tmp_path,
        'kind = "images"\npath = "img"\nheld_out = 0.0\n[calibration.image]\n'
        'channel_order = "BGR"\nresize = "pad"\nmean = [0.5]\nstd = [0.5]',
    )
    calib, _ = build_samples(config, SPEC)
    x = next(iter(calib))["x"]
    assert x.shape == (1, 3, 8, 8)
    # BGR: red is the last channel; (1 - 0.5) / 0.5 = 1 inside the image, 0 in the padding.
    assert np.allclose(x[0, 2, :4, :], 1.0) and np.allclose(x[0, 0, :4, :], -1.0)
    assert np.allclose(x[0, :, 4:, :], 0.0)


@pytest.mark.parametrize("resize", ["stretch", "shorter-crop", "pad", "height"])
def test_a_large_jpeg_decodes_at_a_reduced_scale_to_the_same_pixels(
    tmp_path: Path, resize: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A JPEG far larger than the input is decoded at a DCT scale that keeps twice the resized
    size (Pillow's draft): the same preprocessed tensor to within the resize filter's noise,
    for every resize mode, and the decode really is reduced."""
    from PIL import Image

    from pipeline.calibration import samples

    rng = np.random.default_rng(0)
    rows, cols = np.mgrid[0:500, 0:900].astype(np.float32)
    photo = np.stack(
        [128 + 100 * np.sin(rows / 40), 128 + 100 * np.cos(cols / 55), (rows + cols) / 6], -1
    ) + rng.normal(0, 8, (500, 900, 3))
    folder = tmp_path / "img"
    folder.mkdir()
    Image.fromarray(np.clip(photo, 0, 255).astype(np.uint8)).save(folder / "p.jpg", quality=92)
    config = make_config(
        tmp_path, f'kind = "images"\npath = "img"\n[calibration.image]\nresize = "{resize}"'
    )
    spec = InputSpec("x", (1, 3, 48, 64), np.dtype("float32"))

    decoded: list[tuple[int, int]] = []
    real_load = Image.Image.load

    def spy_load(image: Image.Image) -> object:
        result = real_load(image)
        decoded.append(image.size)
        return result

    monkeypatch.setattr(Image.Image, "load", spy_load)
    drafted = samples.load_image(folder / "p.jpg", spec, config)
    assert decoded and max(decoded) == (225, 125)  # 1/4 scale: still twice any fit of 64x48

    decoded.clear()
    from PIL import JpegImagePlugin

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", lambda self, mode, size: None)
    full = samples.load_image(folder / "p.jpg", spec, config)
    assert max(decoded) == (900, 500)
    assert drafted.shape == full.shape == (1, 3, 48, 64)
    noise = float(np.mean((drafted - full) ** 2))
    assert 10 * np.log10(float(np.mean(full**2)) / noise) > 40.0


@pytest.mark.parametrize(
    ("image", "spec", "message", "tip"),
    [
        ("", ((1, 32, 32, 3), "float32"), r"channel\(s\) on axis 3", 'layout = "NHWC"'),
        ('layout = "NHWC"', ((1, 3, 32, 32), "float32"), "on axis 1", 'layout = "NCHW"'),
        ('layout = "NHWC"', ((1, 32, 32, 3), "uint8"), "takes uint8 images", 'dtype = "uint8"'),
    ],
)
def test_an_image_setting_the_input_contradicts_is_named(
    tmp_path: Path, image: str, spec: tuple, message: str, tip: str
) -> None:
    """A TFLite-converted model takes uint8 NHWC images: the error names the setting to change
    (before, every sample failed the shape or dtype check with a tip to re-save it)."""
    from PIL import Image

    folder = tmp_path / "img"
    folder.mkdir()
    Image.fromarray(np.zeros((20, 40, 3), np.uint8)).save(folder / "black.png")
    config = make_config(
        tmp_path, f'kind = "images"\npath = "img"\nheld_out = 0.0\n[calibration.image]\n{image}'
    )
    calib, _ = build_samples(config, [InputSpec("x", spec[0], np.dtype(spec[1]))])
    with pytest.raises(CalibrationError, match=message) as info:
        list(calib)
    assert tip in (info.value.tip or "")


def test_float16_images_feed_a_float16_source_prepared_in_float32(tmp_path: Path) -> None:
    """A model exported with .half() takes float16 pixels; prepared, its input is float32. Its
    config's dtype = "float16" was refused ("Input ... float32 takes float32 images"): now
    accepted, each value the float16 number the user's app feeds, as float32."""
    from PIL import Image

    folder = tmp_path / "img"
    folder.mkdir()
    pixels = np.random.default_rng(2).integers(0, 256, (20, 40, 3)).astype(np.uint8)
    Image.fromarray(pixels).save(folder / "noise.png")
    config = make_config(
        tmp_path,
        'kind = "images"\npath = "img"\nheld_out = 0.0\n[calibration.image]\n'
        'dtype = "float16"\nmean = [0.485, 0.456, 0.406]\nstd = [0.229, 0.224, 0.225]',
    )
    x = next(iter(build_samples(config, SPEC)[0]))["x"]
    assert x.dtype == np.float32
    np.testing.assert_array_equal(x, x.astype(np.float16).astype(np.float32))
    assert not np.array_equal(x, np.round(x))  # normalised values, not pixels


def test_text_lines_keep_their_aspect_and_letterboxes_their_fill(tmp_path: Path) -> None:
    """resize = "height" (OCR recognizers): the full height, the width by the aspect ratio, the
    rest of the width filled; pad_value is the fill in the units the model is fed (YOLOX
    letterboxes with 114 at scale 1)."""
    from PIL import Image

    folder = tmp_path / "img"
    folder.mkdir()
    Image.fromarray(np.full((16, 40, 3), 200, np.uint8)).save(folder / "line.png")  # 1:2.5
    spec = [InputSpec("x", (1, 3, 8, 32), np.dtype("float32"))]
    base = 'kind = "images"\npath = "img"\nheld_out = 0.0\n[calibration.image]\nscale = 1.0\n'
    config = make_config(tmp_path, base + 'resize = "height"\npad_value = 114.0')
    x = next(iter(build_samples(config, spec)[0]))["x"]
    assert x.shape == (1, 3, 8, 32)
    assert np.allclose(x[0, :, :, :20], 200.0) and np.allclose(x[0, :, :, 20:], 114.0)
    config = make_config(tmp_path, base + 'resize = "pad"\npad_value = 114.0')
    x = next(iter(build_samples(config, spec)[0]))["x"]  # fits by height too: 8 x 20
    assert np.allclose(x[0, :, :, :20], 200.0) and np.allclose(x[0, :, :, 20:], 114.0)
    config = make_config(tmp_path, base + 'resize = "pad"')
    x = next(iter(build_samples(config, spec)[0]))["x"]
    assert np.allclose(x[0, :, :, 20:], 0.0)  # the default fill: zeros, as before


def write_wav(path: Path, samples: np.ndarray, rate: int = 16000) -> None:
    with wave.open(str(path), "wb") as handle:
        handle.setnchannels(1)
        handle.setsampwidth(2)
        handle.setframerate(rate)
        handle.writeframes(samples.astype("<i2").tobytes())


def test_audio_windows_and_tail_held_out(tmp_path: Path) -> None:
    folder = tmp_path / "wav"
    folder.mkdir()
    write_wav(folder / "a.wav", np.arange(64 * 10) % 1000)
    config = make_config(
        tmp_path,
        'kind = "audio"\npath = "wav"\nheld_out = 0.2\nsamples = 100\n[calibration.audio]\nwindow = 64',
    )
    spec = [InputSpec("audio", (1, 64), np.dtype("float32"))]
    calib, held = build_samples(config, spec)
    assert (len(calib), len(held)) == (8, 2)
    first = next(iter(calib))["audio"]
    assert np.allclose(first[0, :3] * 32768, [0, 1, 2])
    assert held.refs[0].offset == 8 * 64  # the tail of the file


def test_audio_file_shorter_than_a_window_gives_none(tmp_path: Path) -> None:
    """A short file is skipped, not read as a short window that fails to fill the input."""
    folder = tmp_path / "wav"
    folder.mkdir()
    write_wav(folder / "long.wav", np.arange(64 * 4) % 1000)
    write_wav(folder / "short.wav", np.arange(40))
    config = make_config(
        tmp_path, 'kind = "audio"\npath = "wav"\nheld_out = 0.25\n[calibration.audio]\nwindow = 64'
    )
    spec = [InputSpec("audio", (1, 64), np.dtype("float32"))]
    calib, held = build_samples(config, spec)
    refs = [*calib.refs, *held.refs]
    assert {ref.path.name for ref in refs} == {"long.wav"}
    assert len(refs) == 4
    (folder / "long.wav").unlink()
    with pytest.raises(CalibrationError, match=r"longest has 40 samples.*window is 64"):
        build_samples(config, spec)


def test_audio_wrong_rate(tmp_path: Path) -> None:
    folder = tmp_path / "wav"
    folder.mkdir()
    write_wav(folder / "a.wav", np.zeros(1000), rate=8000)
    config = make_config(tmp_path, 'kind = "audio"\npath = "wav"')
    with pytest.raises(CalibrationError, match="sampled at 8000 Hz"):
        build_samples(config, [InputSpec("a", (1, 64), np.dtype("float32"))])


def test_python_reader_and_fill_others(tmp_path: Path) -> None:
    (tmp_path / "reader.py").write_text(
        "import numpy as np\n"
        "def read(path, specs):\n"
        "    for i in range(10):\n"
        "        yield {'x': np.full((1, 3, 8, 8), i, np.float32)}\n"
    )
    config = make_config(tmp_path, 'kind = "python"\nreader = "reader.py:read"\nsamples = 10')
    specs = [*SPEC, InputSpec("state", (2, 4), np.dtype("float32"))]
    calib, held = build_samples(config, specs)
    values = [float(s["x"][0, 0, 0, 0]) for s in calib]
    held_values = [float(s["x"][0, 0, 0, 0]) for s in held]
    assert sorted(values + held_values) == list(range(10))
    assert not set(values) & set(held_values)
    assert np.all(next(iter(calib))["state"] == 0)


def test_recurrent_python_reader_holds_out_a_run_of_the_stream(tmp_path: Path) -> None:
    """A streaming reader's held-out windows stay neighbours (``_split_runs``)."""
    (tmp_path / "reader.py").write_text(
        "import numpy as np\n"
        "def read(path, specs):\n"
        "    for i in range(12):\n"
        "        yield {'x': np.full((1, 3, 8, 8), i, np.float32)}\n"
    )
    config = make_config(
        tmp_path,
        'kind = "python"\nreader = "reader.py:read"\nsamples = 12\nheld_out = 0.25\n'
        'recurrent = { state = "state_out" }',
    )
    specs = [*SPEC, InputSpec("state", (2, 4), np.dtype("float32"))]
    calib, held = build_samples(config, specs)
    assert [ref.index for ref in calib.refs] == [0, 1, 2, 3, 7, 8, 9, 10, 11]
    assert [ref.index for ref in held.refs] == [4, 5, 6]


def test_python_reader_import_error(tmp_path: Path) -> None:
    config = make_config(tmp_path, 'kind = "python"\nreader = "no_such_module_xyz:read"')
    with pytest.raises(CalibrationError, match="cannot be imported"):
        build_samples(config, SPEC)


def test_recurrent_picks_contiguous_runs_per_file(tmp_path: Path) -> None:
    folder = tmp_path / "wav"
    folder.mkdir()
    for name in ("a", "b"):
        write_wav(folder / f"{name}.wav", np.zeros(64 * 20))
    config = make_config(
        tmp_path,
        'kind = "audio"\npath = "wav"\nheld_out = 0.25\nsamples = 8\n'
        'recurrent = { s = "s_out" }\n[calibration.audio]\nwindow = 64',
    )
    calib, held = build_samples(config, [InputSpec("a", (1, 64), np.dtype("float32"))])
    for part in (calib, held):
        for path in {r.path for r in part.refs}:
            offsets = [r.offset for r in part.refs if r.path == path]
            assert offsets == list(range(offsets[0], offsets[0] + 64 * len(offsets), 64))
    assert len(calib) + len(held) == 8


def test_short_python_reader_split_is_exact(tmp_path: Path) -> None:
    (tmp_path / "reader.py").write_text(
        "import numpy as np\n"
        "def read(path, specs):\n"
        "    for i in range(5):\n"
        "        yield {'x': np.full((1, 3, 8, 8), i, np.float32)}\n"
    )
    config = make_config(
        tmp_path, 'kind = "python"\nreader = "reader.py:read"\nsamples = 64\nheld_out = 0.4'
    )
    calib, held = build_samples(config, SPEC)
    assert (len(list(calib)), len(list(held))) == (3, 2)


def streaming_rnn() -> object:
    """A window of 64 samples drives an 8-wide state through a decay and a Tanh: state s in,
    s_out out (``calibration.recurrent``), y its sum."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.standard_normal((64, 8)).astype(np.float32) * 0.05, "w")
    half = numpy_helper.from_array(np.array(0.9, np.float32), "half")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["a", "w"], ["drive"]),
            helper.make_node("Mul", ["s", "half"], ["kept"]),
            helper.make_node("Add", ["drive", "kept"], ["pre"]),
            helper.make_node("Tanh", ["pre"], ["s_out"]),
            helper.make_node("ReduceSum", ["s_out"], ["y"], keepdims=0),
        ],
        "rnn",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, 64]),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, [1, 8]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("s_out", TensorProto.FLOAT, [1, 8]),
        ],
        [w, half],
    )
    return onnx.shape_inference.infer_shapes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    )


def rnn_samples(config: ModelConfig) -> tuple[SampleSource, Router, bk.Bucket]:
    """The sample source, router and only bucket of ``streaming_rnn`` under ``config``."""
    specs = [InputSpec("a", (1, 64), np.dtype("float32")), InputSpec("s", (1, 8), "float32")]
    plan = single_bucket({s.name: s.shape for s in specs})
    router = Router(config, plan, {s.name: np.dtype("float32") for s in specs})
    (bucket,) = plan.buckets
    return sample_source(config, specs), router, bucket


def test_recurrent_state_is_fed_back_by_the_calibration_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The calibration pass runs the float model anyway: its state outputs carry the next
    window, so the reader does not run the model a second time, and the states (and ranges)
    are those of the reader running it itself."""
    import onnx
    import onnxruntime as ort

    from pipeline.calibration.ranges import activation_statistics

    model = streaming_rnn()
    model_path = tmp_path / "rnn.onnx"
    onnx.save(model, str(model_path))
    folder = tmp_path / "wav"
    folder.mkdir()
    for name, freq in (("a", 3), ("b", 7)):
        write_wav(folder / f"{name}.wav", 8000 * np.sin(np.arange(64 * 12) * freq / 64))
    config = make_config(
        tmp_path,
        'kind = "audio"\npath = "wav"\nheld_out = 0.25\nsamples = 16\ninput = "a"\n'
        'recurrent = { s = "s_out" }\n[calibration.audio]\nwindow = 64',
    )
    source, router, bucket = rnn_samples(config)

    runs = [0]

    class Counted(ort.InferenceSession):  # the real session, its runs counted
        def run(self, *args: object, **kwargs: object) -> list:
            runs[0] += 1
            return super().run(*args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", Counted)
    reader_states = [
        feeds["s"].copy()
        for feeds in BucketSamples(source, router, bucket, source.calib, model_path)
    ]
    assert runs[0] == len(reader_states) == 12
    assert any(np.abs(s).max() > 0.1 for s in reader_states)  # the state moves

    runs[0] = 0
    seen: list[np.ndarray] = []
    samples = BucketSamples(source, router, bucket, source.calib, model_path)

    class Watched:  # the same samples, each state noted as the calibration pass gets it
        recurrent = samples.recurrent
        feed_back = samples.feed_back

        def __iter__(self):  # type: ignore[no-untyped-def]
            for feeds in samples:
                seen.append(feeds["s"].copy())
                yield feeds

    stats = activation_statistics(model, Watched(), ["pre"], None, 8, range_names=["s", "pre"])
    assert runs[0] == len(seen)  # the calibration pass's own runs only: nothing run twice
    assert len(seen) == len(reader_states)
    for mine, theirs in zip(seen, reader_states, strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)
    low, high = stats.ranges["s"]
    assert low[0] == pytest.approx(min(s.min() for s in reader_states), abs=1e-6)
    assert high[0] == pytest.approx(max(s.max() for s in reader_states), abs=1e-6)


_CHAIN_PEAK = """
import resource, sys
import numpy as np
from onnx import TensorProto, helper, numpy_helper
from pipeline.calibration.ranges import activation_statistics
from pipeline.core.cpu import cpu_session

layers, shape = 24, [1, 16, 512, 512]  # 16 MiB a tensor, 384 MiB for the whole chain
nodes = [helper.make_node("Sigmoid", ["x"], ["t0"])]
nodes += [helper.make_node("Sigmoid", [f"t{i}"], [f"t{i + 1}"]) for i in range(layers - 1)]
graph = helper.make_graph(
    nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
    [helper.make_tensor_value_info(f"t{layers - 1}", TensorProto.FLOAT, shape)],
    value_info=[helper.make_tensor_value_info(f"t{i}", TensorProto.FLOAT, shape) for i in range(layers)],
)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
feeds = [{"x": np.random.default_rng(0).standard_normal(shape).astype(np.float32)}]
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
if sys.argv[1] == "plain":
    session = cpu_session(model, optimize=False)
    start = peak()
    session.run(None, feeds[0])
else:
    start = peak()
    activation_statistics(model, feeds, [f"t{i}" for i in range(layers)], range_names=[f"t{i}" for i in range(layers)])
print(peak() - start)
"""


def test_statistics_free_each_tensor_as_plain_inference_does() -> None:
    """The in-graph reductions must not keep every activation of a sample alive until the end:
    on a chain of 24 16-MiB tensors, calibration's peak stays near one plain inference's
    (appended at the end of the graph, the reductions held all 384 MiB at once)."""
    import subprocess
    import sys

    def grown(mode: str) -> float:
        done = subprocess.run(
            [sys.executable, "-c", _CHAIN_PEAK, mode], capture_output=True, text=True, check=True
        )
        return float(done.stdout.split()[-1])

    plain, stats = grown("plain"), grown("stats")
    assert stats < plain + 100, (plain, stats)


def token_model(rows: int, through_select: bool) -> object:
    """ids [1, 2, 16] -> (optionally a Gather picking one row of ids) -> an embedding of
    ``rows`` rows: a character tagger's lookup."""
    from onnx import TensorProto, helper, numpy_helper

    table = numpy_helper.from_array(np.ones((rows, 4), np.float32), "table")
    pick = numpy_helper.from_array(np.array(0, np.int64), "pick")
    nodes = []
    ids = "ids"
    if through_select:
        nodes.append(helper.make_node("Gather", ["ids", "pick"], ["chars"], axis=1))
        ids = "chars"
    nodes.append(helper.make_node("Gather", ["table", ids], ["y"]))
    graph = helper.make_graph(
        nodes,
        "tokens",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 2, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [table, pick],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize("through_select", [False, True])
def test_random_ids_stay_inside_the_table_they_index(tmp_path: Path, through_select: bool) -> None:
    """kind = "random" drew integer inputs in 0..255: a 126-row character embedding failed
    ("indices element out of data bounds") before anything was measured."""
    from pipeline.calibration.samples import index_bounds
    from pipeline.core.cpu import cpu_session

    model = token_model(126, through_select)
    assert index_bounds(model) == {"ids": 126}
    config = make_config(tmp_path, 'kind = "random"\nsamples = 8')
    specs = [InputSpec("ids", (1, 2, 16), np.dtype("int64"))]
    plan = single_bucket({"ids": (1, 2, 16)})
    router = Router(config, plan, {"ids": np.dtype("int64")}, index_bounds(model))
    source = sample_source(config, specs)
    (bucket,) = plan.buckets
    session = cpu_session(model)
    drawn = [f["ids"] for f in BucketSamples(source, router, bucket, source.calib)]
    assert drawn and max(int(ids.max()) for ids in drawn) < 126
    assert max(int(ids.max()) for ids in drawn) > 100  # the whole table, not a corner of it
    for ids in drawn:
        session.run(None, {"ids": ids})


def test_random_float_ids_cast_to_integers_are_ids_of_the_table(tmp_path: Path) -> None:
    """Keras' default float Input ahead of an Embedding (tf2onnx: float input -> Cast -> Gather)
    drew normal values, ids -2..1 once cast, which the HTP gathers wrongly (negative ids count
    from the end in ONNX): such an input gets whole ids inside the table, as floats. A float
    input cast to another float type and one read by no Gather stay normal."""
    from onnx import TensorProto, helper, numpy_helper

    from pipeline.calibration.samples import index_bounds

    table = numpy_helper.from_array(np.ones((40, 4), np.float32), "table")
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["chars"], ["as_int"], to=TensorProto.INT32),
            helper.make_node("Gather", ["table", "as_int"], ["y"]),
            helper.make_node("Cast", ["scale"], ["as_half"], to=TensorProto.FLOAT16),
            helper.make_node("Cast", ["as_half"], ["z"], to=TensorProto.FLOAT),
        ],
        "keras_ids",
        [
            helper.make_tensor_value_info("chars", TensorProto.FLOAT, [1, 21]),
            helper.make_tensor_value_info("scale", TensorProto.FLOAT, [1, 3]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, None),
        ],
        [table],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    assert index_bounds(model) == {"chars": 40}
    config = make_config(tmp_path, 'kind = "random"\nsamples = 8')
    shapes = {"chars": (1, 21), "scale": (1, 3)}
    specs = [InputSpec(n, shape, np.dtype("float32")) for n, shape in shapes.items()]
    plan = single_bucket(shapes)
    router = Router(config, plan, dict.fromkeys(shapes, np.dtype("float32")), index_bounds(model))
    source = sample_source(config, specs)
    (bucket,) = plan.buckets
    drawn = list(BucketSamples(source, router, bucket, source.calib))
    chars = np.concatenate([f["chars"] for f in drawn])
    assert chars.dtype == np.float32 and np.array_equal(chars, np.round(chars))
    assert chars.min() >= 0 and 30 < chars.max() < 40
    scale = np.concatenate([f["scale"] for f in drawn])
    assert scale.min() < 0 and not np.array_equal(scale, np.round(scale))  # still normal


def test_ids_past_the_table_blame_the_data_not_the_model() -> None:
    from pipeline.core.cpu import cpu_session
    from pipeline.core.errors import ModelError

    session = cpu_session(token_model(126, through_select=False))
    with pytest.raises(ModelError) as caught:
        session.run(None, {"ids": np.full((1, 2, 16), 200, np.int64)})
    assert "calibration data does, not the model" in (caught.value.tip or "")


def test_a_python_reader_runs_once_per_quantize_run(tmp_path: Path) -> None:
    """Its samples are kept while the stage runs: counting them, routing the calibration
    samples and writing the held-out ones each ran the reader again (a refiner's reader that
    runs the detector feeding it: three times over). Nothing of the cache is left after."""
    import onnx
    import onnx.helper as oh
    from onnx import TensorProto, numpy_helper

    from pipeline.__main__ import main

    (tmp_path / "reader.py").write_text(
        "import numpy as np\n"
        "from pathlib import Path\n"
        "def read(path, specs):\n"
        "    with open(Path(__file__).with_name('passes.txt'), 'a') as f:\n"
        "        f.write('pass\\n')\n"
        "    rng = np.random.default_rng(0)\n"
        "    for i in range(12):\n"
        "        yield {'x': rng.normal(0, 1, (1, 3, 8, 8)).astype(np.float32)}\n"
    )
    weight = np.random.default_rng(1).normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32)
    graph = oh.make_graph(
        [oh.make_node("Conv", ["x", "w"], ["c"]), oh.make_node("Relu", ["c"], ["y"])],
        "g",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 6])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "m.onnx"))
    (tmp_path / "m.toml").write_text(
        '[model]\nname = "m"\nversion = "1.0.0"\nsource = "m.onnx"\n'
        '[calibration]\nkind = "python"\nreader = "reader.py:read"\nsamples = 12\n'
        'held_out = 0.25\n[quantization]\njudge = "cpu"\n',
        encoding="utf-8",
    )
    artifacts = tmp_path / "artifacts"
    assert main(["quantize", "--artifacts", str(artifacts), str(tmp_path / "m.toml")]) == 0
    assert (tmp_path / "passes.txt").read_text().splitlines() == ["pass"]
    assert not list(artifacts.rglob(".reader-samples"))
    heldout = artifacts / "build" / "m" / "heldout"
    assert len(list(heldout.glob("*.npz"))) == 3


def rnn_and_reader(tmp_path: Path, reader: str) -> None:
    """``streaming_rnn`` as rnn.onnx and ``reader`` (numpy imported) as reader.py."""
    import onnx

    onnx.save(streaming_rnn(), str(tmp_path / "rnn.onnx"))  # type: ignore[arg-type]
    (tmp_path / "reader.py").write_text("import numpy as np\n" + reader)


def state_carrying_reader(freqs: tuple[int, ...], windows: int) -> str:
    """A reader's source: a sine per frequency in ``windows`` windows of 64, the state of
    ``streaming_rnn`` carried from window to window by the float model, as an app does."""
    return (
        "import onnxruntime as ort\n"
        "from pathlib import Path\n"
        "def read(path, specs):\n"
        "    model = str(Path(__file__).with_name('rnn.onnx'))\n"
        "    session = ort.InferenceSession(model, providers=['CPUExecutionProvider'])\n"
        f"    for freq in {freqs!r}:\n"
        f"        wave = 0.25 * np.sin(np.arange(64 * {windows}) * freq / 64).astype(np.float32)\n"
        "        s = np.zeros((1, 8), np.float32)\n"
        f"        for k in range({windows}):\n"
        "            feeds = {'a': wave[None, 64 * k : 64 * (k + 1)], 's': s}\n"
        "            yield feeds\n"
        "            s = session.run(['s_out'], feeds)[0]\n"
    )


def rnn_and_wavs(tmp_path: Path) -> None:
    """``streaming_rnn`` as rnn.onnx, and two wav files of sines, 24 windows of 64, in wav/."""
    import onnx

    onnx.save(streaming_rnn(), str(tmp_path / "rnn.onnx"))  # type: ignore[arg-type]
    folder = tmp_path / "wav"
    folder.mkdir()
    for name, freq in (("a", 3), ("b", 7)):
        write_wav(folder / f"{name}.wav", 8000 * np.sin(np.arange(64 * 24) * freq / 64))


def closed_loop_of_rnn(
    tmp_path: Path, calibration: str, quantization: str = ""
) -> tuple[dict, Path]:
    """Quantize ``rnn.onnx`` (judge on the CPU) with this [calibration] table (and these
    [quantization] lines): the report's closed-loop figures and the build folder."""
    import json

    from pipeline.__main__ import main

    config = tmp_path / "rnn.toml"
    config.write_text(
        '[model]\nname = "rnn"\nversion = "1.0.0"\nsource = "rnn.onnx"\n'
        f'[calibration]\n{calibration}\n[quantization]\njudge = "cpu"\n{quantization}\n',
        encoding="utf-8",
    )
    assert main(["quantize", "--artifacts", str(tmp_path / "artifacts"), str(config)]) == 0
    build = tmp_path / "artifacts" / "build" / "rnn"
    return json.loads((build / "report.json").read_text())["closed_loop"], build


def test_a_streaming_model_is_also_measured_fed_its_own_state(tmp_path: Path) -> None:
    """The quantize stage, on a streaming model with calibration.recurrent: its held-out
    windows follow one another, so the report also gives the QDQ model fed its own state."""

    rnn_and_wavs(tmp_path)
    loop, build = closed_loop_of_rnn(
        tmp_path,
        'kind = "audio"\npath = "wav"\nheld_out = 0.25\nsamples = 48\ninput = "a"\n'
        'recurrent = { s = "s_out" }\n[calibration.audio]\nwindow = 64',
    )
    assert set(loop) == {"y"} and loop["y"]["snr_db"] > 0, loop
    assert (
        "- Closed loop (each held-out window fed the QDQ model's own state"
        in (build / "report.md").read_text()
    )


def test_a_streams_held_out_windows_are_runs_spread_over_it() -> None:
    """Runs of consecutive windows (each of 2 at least), the calibration windows shared out
    before, between and after them; a short stream falls back to every k-th window."""
    from pipeline.calibration.samples import HELDOUT_RUNS, SampleRef, _split_runs

    refs = [SampleRef(None, index=i) for i in range(100)]
    calib, held = _split_runs(refs, 0.25)
    indices = [r.index for r in held]
    assert len(held) == 25 and len(calib) == 75
    starts = [i for i, index in enumerate(indices) if i == 0 or index != indices[i - 1] + 1]
    lengths = np.diff([*starts, len(indices)])
    assert len(starts) == HELDOUT_RUNS and lengths.min() >= 2, indices
    assert indices[0] > 0 and indices[-1] < 99  # calibration windows at both ends
    assert sorted(r.index for r in calib + held) == list(range(100))
    short_calib, short_held = _split_runs(refs[:3], 0.25)
    assert len(short_held) == 1 and len(short_calib) == 2


def test_a_readers_stream_is_measured_fed_its_own_state(tmp_path: Path) -> None:
    """A python reader that carries a streaming model's state itself, with no
    calibration.recurrent: its windows are held out in runs (an input shaped like an output),
    the state pairs are found in them, and the report gives the QDQ model fed its own state.
    Every k-th window held out, no window continued another and there was no such figure."""

    rnn_and_reader(tmp_path, state_carrying_reader(freqs=(3, 7), windows=24))
    loop, build = closed_loop_of_rnn(
        tmp_path, 'kind = "python"\nreader = "reader.py:read"\nsamples = 48\nheld_out = 0.25'
    )
    assert set(loop) == {"y"} and loop["y"]["snr_db"] > 0, loop
    report = (build / "report.json").read_text()
    assert '"recurrent_inferred": {}' in report  # it feeds the state itself: nothing inferred


def test_compile_runs_a_streams_ctx_fed_its_own_state_on_the_htp(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The quantize record names the stream's state pairs, and compile runs the ctx on the HTP
    simulator fed its own state over the held-out windows in order: its figure is in the
    variant's validation and the compile report; under the target, a console NOTE."""
    import json

    from pipeline.__main__ import main
    from pipeline.core.records import QuantizeRecord, VariantRecord, read_record

    rnn_and_reader(tmp_path, state_carrying_reader(freqs=(5,), windows=48))
    _, build = closed_loop_of_rnn(
        tmp_path,
        'kind = "python"\nreader = "reader.py:read"\nsamples = 48\nheld_out = 0.25',
        "target_snr_db = 200.0",  # no ctx reaches it: the NOTE shows
    )
    record, why = read_record(QuantizeRecord, build / "record.json")
    assert record is not None and record.summary.stream_states == {"s": "s_out"}, why
    capsys.readouterr()
    config = str(tmp_path / "rnn.toml")
    # Every window runs, however slow the machine: the count is the windows', not the clock's.
    monkeypatch.setattr("pipeline.compile.build.CLOSED_LOOP_BUDGET_S", 1e9)
    assert main(["compile", "--artifacts", str(tmp_path / "artifacts"), config]) == 0
    (variant_json,) = (build / "ctx").rglob("variant.json")
    variant, why = read_record(VariantRecord, variant_json)
    assert variant is not None and variant.validation is not None, why
    v = variant.validation
    assert set(v.closed_loop) == {"y"} and 20 < v.closed_loop["y"].snr_db < 200, v.closed_loop
    assert v.closed_loop_windows == 12 and v.closed_loop_carried == 6  # 6 runs of 2 windows
    # the CPU QDQ model on the same windows, beside it: the HTP adds little to its noise here
    assert set(v.closed_loop_qdq) == {"y"}
    assert abs(v.closed_loop_qdq["y"].snr_db - v.closed_loop["y"].snr_db) < 6.0
    assert (
        "fed its own state window after window on the HTP"
        in (build / "ctx" / "report.md").read_text()
    )
    assert (
        json.loads((build / "ctx" / "report.json").read_text())["variants"][0]["validation"][
            "closed_loop_windows"
        ]
        == 12
    )
    out = capsys.readouterr().out
    assert "NOTE rnn snapdragon-x-elite: fed its own state" in out and "200.0 dB" in out, out
    # The release tells the app which output to feed back into which input.
    assert main(["publish", "--artifacts", str(tmp_path / "artifacts"), config]) == 0
    (manifest,) = (tmp_path / "artifacts" / "releases").rglob("manifest.json")
    assert json.loads(manifest.read_text())["quantization"]["stream_states"] == {"s": "s_out"}


def test_a_declared_state_is_not_carried_across_the_held_out_run(tmp_path: Path) -> None:
    """With calibration.recurrent, the calibration pass carries the float model's state from
    window to window of a reader's stream, but not from the window before a held-out run to
    the one after it: that window gets the state its reader gave it."""
    rnn_and_reader(
        tmp_path,
        "def read(path, specs):\n"
        "    for i in range(12):\n"
        "        yield {'a': np.full((1, 64), 0.01 * (i + 1), np.float32),\n"
        "               's': np.full((1, 8), 100.0 + i, np.float32)}\n",
    )
    config = make_config(
        tmp_path,
        'kind = "python"\nreader = "reader.py:read"\nsamples = 12\nheld_out = 0.25\n'
        'recurrent = { s = "s_out" }',
    )
    source, router, bucket = rnn_samples(config)
    states = {
        ref.index: float(feeds["s"][0, 0])
        for ref, feeds in BucketSamples(
            source, router, bucket, source.calib, tmp_path / "rnn.onnx"
        ).items()
    }
    assert sorted(states) == [0, 1, 2, 3, 7, 8, 9, 10, 11]
    assert states[0] == 100.0 and states[7] == 107.0  # each run starts from its reader's state
    assert all(abs(states[i]) <= 1.0 for i in (1, 2, 3, 8, 9, 10, 11))  # carried: a Tanh's


def test_a_state_the_audio_does_not_feed_is_carried_not_zeros(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Audio windows feed ``a``; the state input ``s``, shaped like the output ``s_out`` alone,
    is carried from it window to window (inferred, said on the console and in the report), so
    it is calibrated on real states and the closed loop has a figure. At zeros, as before, its
    range was [0, 0]: an app's real states would clip to nothing."""
    import json

    rnn_and_wavs(tmp_path)
    loop, build = closed_loop_of_rnn(
        tmp_path,
        'kind = "audio"\npath = "wav"\nheld_out = 0.25\nsamples = 48\ninput = "a"\n'
        "[calibration.audio]\nwindow = 64",
    )
    report = json.loads((build / "report.json").read_text())
    assert report["recurrent_inferred"] == {"s": "s_out"} and set(loop) == {"y"}
    assert "calibration.recurrent inferred: { s = 's_out' }" in capsys.readouterr().out
    state_range = json.loads((build / "ranges.json").read_text())["data"]["s"]
    low, high = state_range["lowest"]["data"][0], state_range["highest"]["data"][0]
    assert high - low > 0.1, state_range


@pytest.mark.parametrize(
    ("outputs", "pairs", "unpaired"),
    [
        (["hn", "cn"], {"h": "hn", "c": "cn"}, []),  # two of a shape, told apart by name
        (["o1", "o2"], {}, ["h", "c"]),  # two of a shape, nothing to tell them apart
    ],
)
def test_unfed_states_pair_by_shape_then_by_name(
    tmp_path: Path, outputs: list[str], pairs: dict, unpaired: list
) -> None:
    import onnx
    from onnx import TensorProto, helper

    from pipeline.quantize.evaluate import unfed_states

    def value(name: str, shape: list[int]) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)

    graph = helper.make_graph(
        [
            helper.make_node("Add", ["h", "c"], [outputs[0]]),
            helper.make_node("Sub", ["h", "c"], [outputs[1]]),
            helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0),
        ],
        "g",
        [value("x", [1, 64]), value("h", [1, 8]), value("c", [1, 8])],
        [value("y", []), value(outputs[0], [1, 8]), value(outputs[1], [1, 8])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    onnx.save(model, str(tmp_path / "m.onnx"))
    assert unfed_states(tmp_path / "m.onnx", {"x"}) == (pairs, unpaired)


@pytest.mark.parametrize("stream", [False, True])
def test_a_streams_wav_windows_are_taken_in_runs(tmp_path: Path, stream: bool) -> None:
    """Fewer samples than windows: spread over each file, unless the model carries a state
    the data does not feed (``stream``), whose calibration pass goes from a window to the
    next one: then a run from each file's start."""
    folder = tmp_path / "wav"
    folder.mkdir()
    for name in ("a", "b"):
        write_wav(folder / f"{name}.wav", np.arange(64 * 20) % 1000)
    config = make_config(
        tmp_path,
        'kind = "audio"\npath = "wav"\nheld_out = 0.25\nsamples = 16\ninput = "a"\n'
        "[calibration.audio]\nwindow = 64",
    )
    specs = [InputSpec("a", (1, 64), np.dtype("float32")), InputSpec("s", (1, 8), "float32")]
    source = sample_source(config, specs, stream=stream)
    steps = {
        step
        for path in {r.path for r in source.calib}
        for step in np.diff([r.offset for r in source.calib if r.path == path]).tolist()
    }
    assert steps == {64} if stream else max(steps) > 64  # 16 of 40 windows: neighbours, or not


@pytest.mark.parametrize(
    "yielded",
    ["{'a': window}", "{'a': window, 's': np.zeros((1, 8), np.float32)}"],
    ids=["audio-alone", "state-as-zeros"],
)
def test_a_state_a_reader_does_not_feed_is_carried(tmp_path: Path, yielded: str) -> None:
    """A python reader that yields the audio windows alone, or the state input as zeros window
    after window, feeds the state nothing: it is inferred and carried as for audio files (a
    reader that carries it gives zeros on a stream's first window only, and is left alone)."""
    rnn_and_reader(
        tmp_path,
        "def read(path, specs):\n"
        "    wave = 0.25 * np.sin(np.arange(64 * 48) * 5 / 64).astype(np.float32)\n"
        "    for k in range(48):\n"
        "        window = wave[None, 64 * k : 64 * (k + 1)]\n"
        f"        yield {yielded}\n",
    )
    loop, build = closed_loop_of_rnn(
        tmp_path, 'kind = "python"\nreader = "reader.py:read"\nsamples = 48\nheld_out = 0.25'
    )
    import json

    assert json.loads((build / "report.json").read_text())["recurrent_inferred"] == {"s": "s_out"}
    assert set(loop) == {"y"}
