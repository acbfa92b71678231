"""Calibration samples: tensors, images, audio windows or a user reader, streamed one at a time.

A ``SampleSource`` lists *where* samples come from (cheap: file names and offsets), split once,
deterministically, into calibration and held-out samples, and loads each sample only when it is
iterated, at its natural size. A ``Router`` checks a sample against the model's inputs, puts it
into the smallest bucket that holds it and pads it there; ``BucketSamples`` are the routed samples
of one bucket, so memory does not grow with the number of samples. A model with one static shape
is one bucket with nothing to pad: every sample must then have exactly its shape.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
import wave
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qnn_ctx_runtime import buckets as bk
from qnn_ctx_runtime.errors import FeedError

from ..core.config import ModelConfig
from ..core.errors import CalibrationError
from ..graph.buckets import BucketPlan

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".gif"}
TENSOR_SUFFIXES = {".npy", ".npz"}
AUDIO_SUFFIXES = {".wav"}


@dataclass(frozen=True)
class InputSpec:
    """A graph input as calibration sees it: static shape and numpy dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    def describe(self) -> str:
        return f"{self.name} {list(self.shape)} {self.dtype}"


def input_specs(model: Any) -> list[InputSpec]:
    """The real (non-initializer) inputs of a static ``onnx.ModelProto``."""
    from onnx import helper

    initializers = {i.name for i in model.graph.initializer}
    specs = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor_type = value.type.tensor_type
        dims = tuple(d.dim_value for d in tensor_type.shape.dim)
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))
        specs.append(InputSpec(value.name, dims, dtype))
    return specs


@dataclass(frozen=True)
class SampleRef:
    """Where one sample comes from: a file, and for audio the window offset in it."""

    path: Path | None
    offset: int = 0
    index: int = 0  # position in a user reader's stream


# --- loaders -------------------------------------------------------------------------------------


def _list_files(folder: Path, suffixes: set[str], kind: str) -> list[Path]:
    if folder.is_file():
        files = [folder]
    else:
        files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in suffixes)
    if not files:
        raise CalibrationError(
            f"Calibration folder {folder} holds no {kind} files ({', '.join(sorted(suffixes))}).",
            tip="Put calibration files there, or fix calibration.path / calibration.kind.",
        )
    return files


def _load_tensor_file(ref: SampleRef, default_input: str) -> dict[str, np.ndarray]:
    path = ref.path
    if path is None:  # pragma: no cover - tensors always have a path
        raise CalibrationError("Tensor sample without a file.")
    try:
        if path.suffix.lower() == ".npz":
            with np.load(path, allow_pickle=False) as data:
                return {k: data[k] for k in data.files}
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise CalibrationError(f"Cannot read calibration tensor {path}: {exc}") from None
    if not default_input:
        raise CalibrationError(
            f"{path} is a .npy file but the model has several inputs.",
            tip="Set calibration.input to the input it feeds, or save .npz files keyed by input.",
        )
    return {default_input: array}


def _check_image_input(spec: InputSpec, options: Any) -> None:
    """A CalibrationError naming the [calibration.image] setting that contradicts the input:
    a channel axis where the layout puts none, or another dtype (a TFLite-converted model takes
    uint8 NHWC images), instead of a shape or dtype mismatch on every sample."""
    shape = tuple(spec.shape)
    if len(shape) == 4:
        channels = 1 if options.channel_order == "GRAY" else 3
        at = 3 if options.layout == "NHWC" else 1
        other, layout = (1, "NCHW") if at == 3 else (3, "NHWC")
        if shape[at] != channels and shape[other] == channels:
            raise CalibrationError(
                f"Input {spec.describe()} has its {channels} channel(s) on axis {other}, but "
                f"calibration.image.layout is {options.layout!r}.",
                tip=f'Set layout = "{layout}" under [calibration.image].',
            )
    if options.dtype == "float16" and spec.dtype == np.float32:
        return  # a float16 source's input, float32 once prepared: its images in fp16's values
    if np.dtype(options.dtype) != spec.dtype:
        raise CalibrationError(
            f"Input {spec.describe()} takes {spec.dtype} images, but calibration.image.dtype is "
            f"{options.dtype!r}.",
            tip=f'Set dtype = "{spec.dtype}" under [calibration.image]'
            + (
                " (uint8 pixels are fed as they are: scale, mean and std do not apply)."
                if spec.dtype == np.uint8
                else "."
            ),
        )


def load_image(path: Path, spec: InputSpec, config: ModelConfig) -> np.ndarray:
    """Read one image and preprocess it into the layout and dtype of ``spec``."""
    from PIL import Image

    options = config.calibration.image
    nhwc = options.layout == "NHWC"
    _check_image_input(spec, options)
    if options.size:
        height, width = options.size
    elif len(spec.shape) == 4:
        height, width = spec.shape[1:3] if nhwc else spec.shape[2:4]
    else:
        raise CalibrationError(
            f"Input {spec.describe()} is not an image tensor; set calibration.image.size."
        )
    image = open_image(path, gray=options.channel_order == "GRAY", at_least=(width, height))

    pad_box: tuple[int, int] | None = None
    if options.resize == "stretch":
        image = image.resize((width, height), Image.BILINEAR)
    elif options.resize == "shorter-crop":
        ratio = max(width / image.width, height / image.height)
        resized = (max(width, round(image.width * ratio)), max(height, round(image.height * ratio)))
        image = image.resize(resized, Image.BILINEAR)
        left, top = (image.width - width) // 2, (image.height - height) // 2
        image = image.crop((left, top, left + width, top + height))
    elif options.resize == "height":  # a text line: full height, width by its aspect ratio
        ratio = height / image.height
        fitted = (min(width, max(1, round(image.width * ratio))), height)
        image = image.resize(fitted, Image.BILINEAR)
        pad_box = (fitted[1], fitted[0])
    else:  # pad: fit inside keeping the aspect ratio, pad right/bottom after normalisation
        ratio = min(width / image.width, height / image.height)
        fitted = (max(1, round(image.width * ratio)), max(1, round(image.height * ratio)))
        image = image.resize(fitted, Image.BILINEAR)
        pad_box = (fitted[1], fitted[0])

    array = np.asarray(image, dtype=np.float32)
    if array.ndim == 2:
        array = array[:, :, np.newaxis]
    if array.shape[2] == 1 and options.channel_order != "GRAY":  # 16-bit gray: same in R, G, B
        array = np.repeat(array, 3, axis=2)
    if options.channel_order == "BGR":
        array = array[:, :, ::-1]
    if options.dtype != "uint8":
        mean = np.asarray(options.mean, np.float32)
        std = np.asarray(options.std, np.float32)
        array = (array * options.scale - mean) / std
    if pad_box is not None:
        canvas = np.full((height, width, array.shape[2]), options.pad_value, np.float32)
        canvas[: pad_box[0], : pad_box[1]] = array
        array = canvas
    if not nhwc:
        array = array.transpose(2, 0, 1)
    if options.dtype == "uint8":  # 16-bit sources scale to fractions of 0..255
        array = np.clip(np.rint(array), 0, 255)
    # float16 images for a float16 source are fed to the prepared (float32) model as the
    # float32 numbers the user's float16 pixels are
    return array[np.newaxis].astype(options.dtype).astype(spec.dtype)


# Pillow modes of 16-bit samples (a 16-bit grayscale PNG opens as "I;16"; older Pillow gave "I").
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")


def open_image(path: Path, gray: bool, at_least: tuple[int, int] | None = None) -> Any:
    """Any image Pillow opens, on the 0..255 scale of 8-bit pixels, or a CalibrationError.

    ``at_least`` (width, height): the size the caller resizes to. A JPEG is then decoded at
    the smallest DCT scale (1/2, 1/4, 1/8) that keeps twice that size after any of the resize
    modes' fits (Pillow's ``draft``, as its ``thumbnail`` does with ``reducing_gap=2``): a
    1024x768 photo for a 96x96 input decodes at 256x192, 2.6x faster for the same resized
    pixels to within the filter's noise.

    8-bit modes ("1", "L", "P", "RGB", "CMYK", "YCbCr", ...) are converted by Pillow to "L" or
    "RGB"; an alpha channel ("RGBA", "LA", "PA") is dropped, as torchvision's loader does.
    16-bit grayscale is scaled by 255/65535 into a float ("F") image, so it keeps its precision
    instead of saturating at 255 (Pillow's own "I;16" -> "L" clips). 32-bit integer and float
    images have no known range and are refused, naming the file and the fix.
    """
    from PIL import Image

    try:
        with Image.open(path) as raw:
            if at_least and raw.format == "JPEG":
                raw.draft(raw.mode, _draft_size(raw.size, at_least))
            raw.load()
            mode = raw.mode
            if mode in _SIXTEEN_BIT or (mode == "I" and raw.format == "PNG"):
                pixels = np.asarray(raw).astype(np.float32) * np.float32(255.0 / 65535.0)
                return Image.fromarray(pixels)  # float32, one channel: mode "F"
            if mode not in ("I", "F"):
                return raw.convert("L" if gray else "RGB")
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as exc:
        raise CalibrationError(
            f"Cannot read calibration image {path}: {type(exc).__name__}: {exc}",
            tip="Re-save it as an 8- or 16-bit PNG or JPEG, or remove it from calibration.path.",
        ) from None
    kind = "32-bit integer" if mode == "I" else "32-bit float"
    raise CalibrationError(
        f"Calibration image {path} has {kind} pixels (Pillow mode {mode!r}), whose range is not "
        "known, so it cannot be put on the 0..255 scale that calibration.image.scale expects.",
        tip="Save calibration images as 8- or 16-bit PNG or JPEG, or give the arrays as "
        'calibration.kind = "tensors".',
    )


def _draft_size(size: tuple[int, int], target: tuple[int, int]) -> tuple[int, int]:
    """Twice the largest size any resize mode of ``load_image`` scales ``size`` to for
    ``target``: stretch and pad fit within the target, shorter-crop and height fill one side."""
    (width, height), (want_w, want_h) = size, target
    fill = max(want_w / width, want_h / height)
    return (
        max(2 * want_w, math.ceil(2 * width * fill)),
        max(2 * want_h, math.ceil(2 * height * fill)),
    )


def _wav_windows(path: Path, config: ModelConfig) -> tuple[int, list[int]]:
    audio = config.calibration.audio
    try:
        with wave.open(str(path), "rb") as handle:
            if handle.getsampwidth() != 2:
                raise CalibrationError(
                    f"{path} is {8 * handle.getsampwidth()}-bit audio; only 16-bit PCM is read.",
                    tip="Convert it, e.g. `sox in.wav -b 16 out.wav`.",
                )
            if handle.getframerate() != audio.sample_rate:
                raise CalibrationError(
                    f"{path} is sampled at {handle.getframerate()} Hz, "
                    f"calibration.audio.sample_rate is {audio.sample_rate}.",
                    tip="Resample the file or change calibration.audio.sample_rate.",
                )
            frames = handle.getnframes()
    except (wave.Error, EOFError) as exc:
        raise CalibrationError(f"Cannot read wav file {path}: {exc}") from None
    hop = audio.hop or audio.window
    # A file shorter than one window gives none: a short read would not fill the input.
    return frames, list(range(0, frames - audio.window + 1, hop))


def _load_wav_window(ref: SampleRef, spec: InputSpec, config: ModelConfig) -> dict[str, np.ndarray]:
    audio = config.calibration.audio
    if ref.path is None:  # pragma: no cover
        raise CalibrationError("Audio sample without a file.")
    with wave.open(str(ref.path), "rb") as handle:
        channels = handle.getnchannels()
        handle.setpos(ref.offset)
        raw = handle.readframes(audio.window)
    pcm = np.frombuffer(raw, dtype="<i2").reshape(-1, channels)[:, 0].astype(np.float64)
    values = audio_features(pcm * audio.scale, audio.features, audio.window_fn)
    shape = tuple(spec.shape)
    if len(shape) > 1 and shape[0] > 1 and values.size == int(np.prod(shape[1:])):
        shape = (1, *shape[1:])  # one window of a fixed batch: repeated to it by the router
    size = int(np.prod(shape))
    if values.size != size:
        what = "samples" if audio.features == "waveform" else f"{audio.features} values"
        raise CalibrationError(
            f"calibration.audio.window = {audio.window} gives {values.size} {what}, which do not "
            f"fill input {spec.describe()} ({size} values).",
            tip="Set calibration.audio.window (and .features) to what the input takes: the "
            "input's length for a waveform, 2 * (bins - 1) for an STFT frame.",
        )
    return {spec.name: values.reshape(shape).astype(spec.dtype)}


def audio_features(window: np.ndarray, features: str, window_fn: str) -> np.ndarray:
    """One window of audio as the model takes it: samples, or an STFT frame (see AudioOptions)."""
    if window_fn != "none":
        taper = np.hanning(window.size + 1)[:-1]  # periodic Hann, as torch.hann_window
        window = window * (np.sqrt(taper) if window_fn == "sqrt_hann" else taper)
    if features == "waveform":
        return window
    spectrum = np.fft.rfft(window)
    if features == "stft_magnitude":
        return np.abs(spectrum)
    return np.stack([spectrum.real, spectrum.imag], axis=-1)


def _import_reader(spec: str, base_dir: Path) -> Callable[..., Iterable[dict[str, np.ndarray]]]:
    """Import ``module:function`` or ``path/to/file.py:function`` (relative to the config)."""
    target, _, function = spec.rpartition(":")
    try:
        if target.endswith(".py"):
            path = (base_dir / target).resolve()
            module_spec = importlib.util.spec_from_file_location(f"_calib_{path.stem}", path)
            if module_spec is None or module_spec.loader is None or not path.is_file():
                raise CalibrationError(f"calibration.reader: {path} does not exist.")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_spec.name] = module
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
        return getattr(module, function)
    except (ImportError, AttributeError) as exc:
        raise CalibrationError(
            f"calibration.reader = {spec!r} cannot be imported: {exc}",
            tip="Use 'package.module:function' or 'file.py:function' next to the config.",
        ) from None


# --- selection -----------------------------------------------------------------------------------


def _pick(count: int, wanted: int) -> list[int]:
    """``wanted`` indices spread evenly over ``count``, keeping order (deterministic)."""
    if wanted >= count:
        return list(range(count))
    return sorted({round(i * (count - 1) / max(1, wanted - 1)) for i in range(wanted)})


def _pick_runs(refs: list[SampleRef], wanted: int) -> list[SampleRef]:
    """``wanted`` windows as one contiguous run from the start of each file (fair share each)."""
    by_file: dict[Path | None, list[SampleRef]] = {}
    for ref in refs:
        by_file.setdefault(ref.path, []).append(ref)
    chosen: list[SampleRef] = []
    files = list(by_file.values())
    for position, windows in enumerate(files):
        share = -(-(wanted - len(chosen)) // (len(files) - position))  # ceil of what is left
        chosen += windows[:share]
    return chosen


def _split(refs: list[SampleRef], held_out: float) -> tuple[list[SampleRef], list[SampleRef]]:
    """Every k-th sample goes to held-out, so both halves span all files and classes."""
    if held_out <= 0 or len(refs) < 2:
        return refs, []
    n_held = max(1, round(len(refs) * held_out))
    held_idx = set(_pick(len(refs), n_held))
    if len(held_idx) == len(refs):
        held_idx.pop()
    calib = [r for i, r in enumerate(refs) if i not in held_idx]
    held = [r for i, r in enumerate(refs) if i in held_idx]
    return calib, held


# A stream from a user reader is held out as this many runs of consecutive windows, spread over
# it: a state carried window to window continues inside each run (what the closed loop measures,
# pipeline.quantize.evaluate.closed_loop), and the runs still span the reader's files.
HELDOUT_RUNS = 8


def _split_runs(refs: list[SampleRef], held_out: float) -> tuple[list[SampleRef], list[SampleRef]]:
    """A stream's held-out windows as up to ``HELDOUT_RUNS`` runs of consecutive windows, evenly
    spread, each of 2 windows at least. Every k-th window (``_split``) would leave no window
    that continues the one before it: a streaming Silero VAD read 38.6 dB on such windows and
    19.8 dB on the HTP fed its own state, and no figure could say so."""
    if held_out <= 0 or len(refs) < 4:
        return _split(refs, held_out)
    n_held = min(len(refs) - 1, max(2, round(len(refs) * held_out)))
    runs = max(1, min(HELDOUT_RUNS, n_held // 2))
    calibration = len(refs) - n_held  # shared out before, between and after the runs
    held_idx: set[int] = set()
    for run in range(runs):
        first = round((run + 1) * calibration / (runs + 1)) + len(held_idx)
        length = n_held // runs + (1 if run < n_held % runs else 0)
        held_idx.update(range(first, first + length))
    calib = [r for i, r in enumerate(refs) if i not in held_idx]
    held = [r for i, r in enumerate(refs) if i in held_idx]
    return calib, held


def _split_by_file(
    refs: list[SampleRef], held_out: float
) -> tuple[list[SampleRef], list[SampleRef]]:
    """Audio: the tail of each file is held out, so recurrent state stays continuous."""
    by_file: dict[Path | None, list[SampleRef]] = {}
    for ref in refs:
        by_file.setdefault(ref.path, []).append(ref)
    calib: list[SampleRef] = []
    held: list[SampleRef] = []
    for windows in by_file.values():
        n_held = round(len(windows) * held_out) if len(windows) > 1 else 0
        cut = len(windows) - n_held
        calib += windows[:cut]
        held += windows[cut:]
    if not calib:
        raise CalibrationError("Too few audio windows to calibrate; lower calibration.held_out.")
    return calib, held


# --- the source ----------------------------------------------------------------------------------

Feeds = dict[str, np.ndarray]


@dataclass
class SampleSource:
    """The calibration and held-out samples, as refs, and how to load one at its natural size."""

    calib: list[SampleRef]
    held: list[SampleRef]
    load: Callable[[SampleRef], Feeds]
    stream: Callable[[list[SampleRef]], Iterator[tuple[SampleRef, Feeds]]] | None = None

    def iterate(self, refs: list[SampleRef]) -> Iterator[tuple[SampleRef, Feeds]]:
        """(ref, raw sample) for each of ``refs``, in order, one loaded at a time."""
        if self.stream is not None:
            yield from self.stream(refs)
            return
        for ref in refs:
            yield ref, self.load(ref)


def describe(ref: SampleRef) -> str:
    """A sample's name in messages: its file (and window), or its place in a reader's stream."""
    if ref.path is None:
        return f"sample #{ref.index}"
    return f"{ref.path}" + (f" at sample {ref.offset}" if ref.offset else "")


def sample_source(
    config: ModelConfig, specs: list[InputSpec], cache: Path | None = None, stream: bool = False
) -> SampleSource:
    """Where the samples of ``config`` come from; ``specs`` are the inputs of the largest bucket
    (images and audio windows are made at that shape, everything else comes as it is).
    ``cache``: a folder where a python reader's samples are kept as it yields them, so that
    it runs once, not once per pass. ``stream``: the model may carry a state from window to
    window (an input shaped like an output, not the one the data feeds), so a reader's windows
    are held out in runs, and a wav file's windows are taken in runs from its start (the state
    a calibration pass carries, or infers, goes from a window to the next one)."""
    cal = config.calibration
    folder = config.resolve(cal.path) if cal.path else None
    spec_by_name = {s.name: s for s in specs}
    default_input = cal.input or (specs[0].name if len(specs) == 1 else "")
    if default_input and default_input not in spec_by_name:
        raise CalibrationError(
            f"{config.path}: calibration.input = {default_input!r} is not a model input.",
            tip=f"Model inputs: {', '.join(s.describe() for s in specs)}.",
        )
    if cal.kind in ("images", "audio") and not default_input:
        raise CalibrationError(
            f"{config.path}: the model has several inputs; set calibration.input to the one "
            f"the {cal.kind} feed ({', '.join(spec_by_name)})."
        )
    if folder is not None and not folder.exists():
        raise CalibrationError(f"{config.path}: calibration.path {folder} does not exist.")

    loader: Callable[[SampleRef], Feeds]
    by_file = False
    if cal.kind == "tensors":
        if folder is None:  # config validation requires calibration.path
            raise CalibrationError(f"{config.path}: calibration.kind = 'tensors' needs a path.")
        refs = [SampleRef(p) for p in _list_files(folder, TENSOR_SUFFIXES, "tensor")]

        def loader(ref: SampleRef) -> Feeds:
            return _load_tensor_file(ref, default_input)
    elif cal.kind == "images":
        if folder is None:
            raise CalibrationError(f"{config.path}: calibration.kind = 'images' needs a path.")
        spec = spec_by_name[default_input]
        refs = [SampleRef(p) for p in _list_files(folder, IMAGE_SUFFIXES, "image")]

        def loader(ref: SampleRef) -> Feeds:
            assert ref.path is not None
            return {spec.name: load_image(ref.path, spec, config)}
    elif cal.kind == "audio":
        if folder is None:
            raise CalibrationError(f"{config.path}: calibration.kind = 'audio' needs a path.")
        spec = spec_by_name[default_input]
        refs = []
        longest = 0
        for path in _list_files(folder, AUDIO_SUFFIXES, "wav"):
            frames, offsets = _wav_windows(path, config)
            refs += [SampleRef(path, offset) for offset in offsets]
            longest = max(longest, frames)
        if not refs:
            raise CalibrationError(
                f"The wav files in {folder} are shorter than one window: the longest has "
                f"{longest} samples, calibration.audio.window is {cal.audio.window}.",
                tip="Add longer recordings, or use a calibration reader (calibration.kind = "
                '"python") that pads or repeats short clips the way the app does.',
            )
        by_file = True

        def loader(ref: SampleRef) -> Feeds:
            return _load_wav_window(ref, spec, config)
    elif cal.kind == "python":
        return _python_source(config, specs, folder, cache, stream)
    else:  # random: seeded noise made by the router at each sample's size (smoke tests only)
        refs = [SampleRef(None, index=i) for i in range(cal.samples)]

        def loader(ref: SampleRef) -> Feeds:
            return {}

    if (cal.recurrent or stream) and by_file:
        chosen = _pick_runs(refs, cal.samples)  # state is only meaningful across neighbours
    else:
        chosen = [refs[i] for i in _pick(len(refs), cal.samples)]
    if not by_file and cal.kind != "random":
        rng = np.random.default_rng(cal.seed)
        chosen = [chosen[i] for i in rng.permutation(len(chosen))]
    calib, held = (_split_by_file if by_file else _split)(chosen, cal.held_out)
    return SampleSource(calib, held, loader)


def _python_source(
    config: ModelConfig,
    specs: list[InputSpec],
    folder: Path | None,
    cache: Path | None = None,
    stream: bool = False,
) -> SampleSource:
    """A user reader ``fn(path, specs) -> iterable of feeds``, streamed: once per pass, or,
    with a ``cache`` folder, once, each sample kept there as an .npz while the reader runs
    (a refiner's reader that ran the detector feeding it ran it three times over: counting,
    routing the calibration samples, writing the held-out ones)."""
    reader = _import_reader(config.calibration.reader, config.base_dir)
    cal = config.calibration

    def produce() -> Iterator[Feeds]:
        try:
            yield from reader(folder, specs)
        except Exception as exc:
            raise CalibrationError(
                f"calibration.reader {cal.reader!r} failed: {type(exc).__name__}: {exc}",
                tip="Fix the reader; it gets (calibration.path, input specs) and yields "
                "{input name: array}.",
            ) from exc

    def checked(sample: Any) -> dict[str, np.ndarray]:
        if not isinstance(sample, dict):
            raise CalibrationError(
                f"calibration.reader {cal.reader!r} yielded a {type(sample).__name__}, "
                "not a dict of {input name: array}."
            )
        return dict(sample)

    # Count what the reader really offers (up to ``samples``) so the split is exact.
    total = 0
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
    for _, sample in zip(range(cal.samples), produce(), strict=False):
        if cache is not None:
            np.savez(cache / f"{total:06d}.npz", **checked(sample))
        total += 1
    if total == 0:
        raise CalibrationError(f"calibration.reader {cal.reader!r} produced no samples.")
    refs = [SampleRef(folder, index=i) for i in range(total)]
    # A streaming model's state is only meaningful across neighbours: hold out runs of
    # consecutive windows rather than every k-th window (which would carry each state across
    # the windows the other half took, and leave the closed loop nothing to run).
    calib, held = (_split_runs if cal.recurrent or stream else _split)(refs, cal.held_out)

    def stream(wanted: list[SampleRef]) -> Iterator[tuple[SampleRef, Feeds]]:
        keep = {r.index: r for r in wanted}
        if cache is not None:
            for index in sorted(keep):
                with np.load(cache / f"{index:06d}.npz") as kept:
                    yield keep[index], {name: kept[name] for name in kept.files}
            return
        for index, sample in zip(range(total), produce(), strict=False):
            if index in keep:
                yield keep[index], checked(sample)

    return SampleSource(calib, held, lambda ref: next(v for _, v in stream([ref])), stream)


# --- routing samples into buckets ----------------------------------------------------------------

RANDOM_INTEGERS = 256  # kind = "random": integer inputs in 0..255, or below the table they index
# Ops that pass integer ids on unchanged (into a Gather's indices).
_ID_MOVES = frozenset(
    {"Cast", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Slice", "Transpose"}
)


def index_bounds(model: Any) -> dict[str, int]:
    """Integer graph inputs that index a constant table (Gather's indices, directly or through
    a Cast or reshape): the table's length along the gathered axis, the smallest where several
    read it. Random token ids of 0..255 ran past a 126-row character embedding ("indices element
    out of data bounds"); a smoke test's ids must be ids the model has.

    A float input cast to an integer type on its way there counts too (Keras' default float
    Input ahead of an Embedding, as tf2onnx exports it): random normal values became ids -2..1,
    and the HTP gathers a negative id (ONNX counts it from the end) wrongly: a Thai word
    segmenter's embedding at -4.4 dB against the CPU, the model 4.6 dB."""
    from onnx.helper import tensor_dtype_to_np_dtype

    from ..graph.edit import attribute

    def integer(elem_type: int) -> bool:
        try:
            return np.dtype(tensor_dtype_to_np_dtype(elem_type)).kind in "iu"
        except (KeyError, TypeError, ValueError):  # undefined, or no numpy type (bfloat16)
            return False

    graph = model.graph
    dims = {i.name: list(i.dims) for i in graph.initializer}
    origin = {i.name: i.name for i in graph.input if integer(i.type.tensor_type.elem_type)}
    floats = {i.name: i.name for i in graph.input if i.name not in origin}  # ids once cast
    bounds: dict[str, int] = {}
    for node in graph.node:  # in graph order: a move's input is seen before its output
        moves = node.op_type in _ID_MOVES or node.op_type == "Gather"  # a Gather of ids: ids
        if node.op_type == "Cast" and node.input and node.input[0] in floats:
            if integer(attribute(node, "to", 0)):
                origin[node.output[0]] = floats[node.input[0]]
            else:
                floats[node.output[0]] = floats[node.input[0]]
        elif node.op_type in _ID_MOVES and node.input and node.input[0] in floats:
            floats[node.output[0]] = floats[node.input[0]]
        if moves and node.input and node.input[0] in origin:
            origin[node.output[0]] = origin[node.input[0]]
        elif node.op_type == "Gather" and len(node.input) > 1 and node.input[1] in origin:
            table = dims.get(node.input[0])
            axis = attribute(node, "axis", 0)
            if table and -len(table) <= axis < len(table) and table[axis] > 0:
                name = origin[node.input[1]]
                bounds[name] = min(bounds.get(name, table[axis]), table[axis])
    return bounds


class Router:
    """Checks a raw sample, picks its bucket and pads it there (missing inputs are filled)."""

    def __init__(
        self,
        config: ModelConfig,
        plan: BucketPlan,
        dtypes: dict[str, np.dtype],
        index_bounds: dict[str, int] | None = None,
    ) -> None:
        self.config = config
        self.plan = plan
        self.dtypes = dtypes
        self.index_bounds = dict(index_bounds or {})  # random ids stay below these (token ids)
        self.rules: dict[str, list[bk.PadRule]] = {}
        for rule in plan.pads:
            self.rules.setdefault(rule.input, []).append(rule)

    def _random(self, index: int) -> Feeds:
        """Seeded random inputs; bucket dims are drawn across the whole bucket range."""
        rng = np.random.default_rng(self.config.calibration.seed + int(index))
        largest = self.plan.largest.shapes
        sizes = {rule.dim: 0 for rule in self.plan.pads}
        for dim in sizes:
            top = max(largest[r.input][r.axis] for r in self.plan.pads if r.dim == dim)
            sizes[dim] = int(rng.integers(1, top + 1))
        feeds = {}
        for name, shape in largest.items():
            dims = list(shape)
            for rule in self.rules.get(name, []):
                dims[rule.axis] = sizes[rule.dim]
            dtype = np.dtype(self.dtypes[name])
            if dtype.kind == "f" and name not in self.index_bounds:
                value = rng.standard_normal(dims)
            else:
                value = rng.integers(0, self.index_bounds.get(name, RANDOM_INTEGERS), dims)
            feeds[name] = value.astype(dtype)
        return feeds

    def own(self, sample: Feeds, ref: SampleRef) -> Feeds:
        """The sample's own arrays, checked against the inputs (names, dtype, batch axis)."""
        where = describe(ref)
        if self.config.calibration.kind == "random":
            sample = self._random(ref.index)
        unknown = sorted(set(sample) - set(self.dtypes))
        if unknown:
            raise CalibrationError(
                f"Calibration sample {where} has tensor(s) {unknown} that are not model inputs.",
                tip=f"Name the tensors after the model inputs: {', '.join(sorted(self.dtypes))}.",
            )
        largest = self.plan.largest.shapes
        own: Feeds = {}
        for name, raw in sample.items():
            array = np.asarray(raw)
            if array.ndim == len(largest[name]) - 1 and largest[name][0] == 1:
                array = array[np.newaxis]  # one sample without its batch axis
            array = _to_fixed_batch(array, tuple(largest[name]), self.rules.get(name, []))
            dtype = np.dtype(self.dtypes[name])
            if array.dtype != dtype:
                raise CalibrationError(
                    f"Calibration sample {where}: tensor {name!r} has dtype {array.dtype}, the "
                    f"model input needs {dtype}.",
                    tip=f"Save it with .astype(np.{dtype.name}).",
                )
            if array.dtype.kind in "fc" and not np.isfinite(array).all():
                # NaN/inf would become calibration ranges (or be skipped by min/max) and the
                # report would still show a figure: refused, never calibrated on silently.
                bad = int(array.size - np.count_nonzero(np.isfinite(array)))
                raise CalibrationError(
                    f"Calibration sample {where}: tensor {name!r} holds {bad} NaN or infinite "
                    f"value(s) of {array.size}.",
                    tip="Fix the data or the reader that made it (often a division by zero), or "
                    "remove the sample from calibration.path.",
                )
            own[name] = array
        return own

    def bucket_of(self, own: Feeds, ref: SampleRef) -> bk.Bucket:
        try:
            return bk.choose_bucket(
                self.plan.buckets, self.plan.pads, {n: a.shape for n, a in own.items()}
            )
        except FeedError as exc:
            tip = exc.tip
            if not self.plan.pads:
                tip = "Save samples at the model's fixed input shape (see [inputs] in the config)."
            raise CalibrationError(
                f"Calibration sample {describe(ref)}: {exc.message}", tip=tip
            ) from None

    def pad(self, own: Feeds, bucket: bk.Bucket, ref: SampleRef) -> Feeds:
        """``own`` padded into ``bucket``; inputs the sample does not give are filled."""
        feeds: Feeds = {}
        rng = np.random.default_rng(self.config.calibration.seed + int(ref.index))
        for name, shape in bucket.shapes.items():
            if name in own:
                feeds[name], _ = bk.pad_input(own[name], shape, self.rules.get(name, []))
            elif (
                self.config.calibration.fill_others == "random"
                and np.dtype(self.dtypes[name]).kind == "f"
            ):
                feeds[name] = rng.standard_normal(shape).astype(self.dtypes[name])
            else:
                feeds[name] = np.zeros(shape, dtype=self.dtypes[name])
        return feeds

    def route(self, sample: Feeds, ref: SampleRef) -> tuple[bk.Bucket, Feeds, Feeds]:
        """(smallest bucket that holds it, padded feeds, the sample's own arrays)."""
        own = self.own(sample, ref)
        bucket = self.bucket_of(own, ref)
        return bucket, self.pad(own, bucket, ref), own


def _to_fixed_batch(array: np.ndarray, shape: tuple[int, ...], rules: list[Any]) -> np.ndarray:
    """One sample (batch 1, or no batch axis) repeated to a model's fixed batch of N > 1.

    Why: a model exported with a fixed batch (torch.onnx.export with a dummy input of 8 images
    and no dynamic axes) takes [8, 3, H, W] and nothing else, while images, audio windows and
    most readers give one sample at a time; its batch elements are computed independently, so N
    copies of one sample calibrate and measure it as that sample alone would. A sample that
    already has the batch, another shape, or a padded first axis (buckets) is left to the
    shape check."""
    if not shape or shape[0] <= 1 or any(rule.axis == 0 for rule in rules):
        return array
    if array.shape == shape[1:]:
        array = array[np.newaxis]
    if array.ndim == 0 or array.shape[0] != 1 or array.shape[1:] != shape[1:]:
        return array
    return np.repeat(array, shape[0], axis=0)


def _continues(ref: SampleRef, before: SampleRef | None) -> bool:
    """Whether window ``ref`` follows ``before`` in its stream: the next of a reader's windows
    (``index``), or a window of the same wav file (taken in runs from its start, its tail held
    out: ``_pick_runs``, ``_split_by_file``)."""
    if before is None or ref.path != before.path:
        return False
    if ref.index or before.index:  # a reader's stream (audio windows all have index 0)
        return ref.index == before.index + 1
    return True


class BucketSamples:
    """The calibration samples of one bucket, padded, loaded one at a time (len() is known).

    With ``calibration.recurrent`` (one bucket only), the state outputs of the float model are fed
    back as the state inputs of the next window of the same file; a new file starts from zeros.
    """

    def __init__(
        self,
        source: SampleSource,
        router: Router,
        bucket: bk.Bucket,
        refs: list[SampleRef],
        float_model: Path | None = None,
    ) -> None:
        self.source = source
        self.router = router
        self.bucket = bucket
        self.refs = refs
        self.float_model = float_model
        self._fed_back: Feeds | None = None

    @property
    def recurrent(self) -> dict[str, str]:
        """State input -> the float model output that feeds it (empty: not recurrent)."""
        return dict(self.router.config.calibration.recurrent or {})

    def feed_back(self, outputs: Feeds) -> None:
        """The float model's outputs on the sample just yielded, from a consumer that ran that
        very model anyway (the calibration pass): the next window's state is taken from them
        instead of running the model a second time."""
        self._fed_back = outputs

    def __len__(self) -> int:
        return len(self.refs)

    def __iter__(self) -> Iterator[Feeds]:
        for _, feeds in self.items():
            yield feeds

    def items(self) -> Iterator[tuple[SampleRef, Feeds]]:
        """(ref, padded feeds) for each sample, in order."""
        recurrent = self.router.config.calibration.recurrent
        if recurrent:
            yield from self._recurrent(recurrent)
            return
        for ref, sample in self.source.iterate(self.refs):
            yield ref, self._feeds(sample, ref)

    def _feeds(self, sample: Feeds, ref: SampleRef) -> Feeds:
        own = self.router.own(sample, ref)
        if not self.router.plan.pads:  # one static shape: the sample must be exactly it
            self.router.bucket_of(own, ref)
        return self.router.pad(own, self.bucket, ref)

    def _recurrent(self, recurrent: dict[str, str]) -> Iterator[tuple[SampleRef, Feeds]]:
        import onnxruntime as ort

        if self.float_model is None:  # pragma: no cover - wired by quantize
            raise CalibrationError("Recurrent calibration needs the float model to carry state.")
        session = ort.InferenceSession(str(self.float_model), providers=["CPUExecutionProvider"])
        outputs = [o.name for o in session.get_outputs()]
        missing = [o for o in recurrent.values() if o not in outputs]
        if missing:
            raise CalibrationError(
                f"calibration.recurrent names output(s) {missing} that the model does not have.",
                tip=f"Model outputs: {', '.join(outputs)}.",
            )
        state: Feeds = {}
        previous: SampleRef | None = None
        for ref, sample in self.source.iterate(self.refs):
            feeds = self._feeds(sample, ref)
            # A new file, or a reader's window that does not follow the one before (the other
            # half's windows lie between): its own state, not one carried across the gap.
            if not _continues(ref, previous):
                state = {}
            previous = ref
            feeds.update(state)
            self._fed_back = None
            yield ref, feeds
            values = self._fed_back
            if values is None or not all(out in values for out in recurrent.values()):
                values = dict(zip(outputs, session.run(None, feeds), strict=True))
            self._fed_back = None
            state = {inp: values[out] for inp, out in recurrent.items()}
