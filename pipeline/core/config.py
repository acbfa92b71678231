"""Model configs: one TOML file per model, parsed into frozen dataclasses.

Every key is checked: an unknown key gets a "did you mean" hint, a wrong type names the file,
the key and the expected type, and a missing file names the path it looked for. Paths in a config
are relative to the config file's folder.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import re
import tomllib
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from qnn_ctx_runtime.errors import ActionableError
from qnn_ctx_runtime.targets import TARGETS, get_target
from qnn_ctx_runtime.toolchains import load_toolchains

from .errors import ConfigError

# What every stage builds when it is given no config: the bundled examples, generated from a
# seed by ``python -m pipeline example`` (the quantize stage does that itself).
EXAMPLE_CONFIGS = (Path("configs/example.toml"), Path("configs/example_buckets.toml"))

QuantType = Literal["uint8", "uint16", "int8", "int16", "uint4", "int4"]
# What one tensor may be given by hand or by mixed precision: a quantization type, a weight type
# per output channel (symmetric; the HTP's best-agreeing weight format), or float16 (left
# unquantized: the HTP computes that op in fp16).
Precision = Literal[
    "uint8",
    "uint16",
    "int8",
    "int16",
    "uint4",
    "int4",
    "int8_per_channel",
    "int16_per_channel",
    "float16",
]
CalibrationMethod = Literal["MinMax", "Entropy", "Percentile", "Distribution"]


@dataclass(frozen=True)
class ModelSection:
    """Which float model to build, and under what name and version it is released."""

    name: str
    source: str
    version: str = "0.1.0"
    description: str = ""
    # Tensors that become the model's outputs: the part of the source that computes them is
    # built, the rest (a detector's NMS, data-sized post-processing) is left to the app.
    outputs: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class InputsSection:
    """How to make the model static: dim values, whole input shapes and baked constants."""

    # dim_param name -> value, e.g. {batch = 1}
    dims: dict[str, int] = field(default_factory=dict)
    # input name -> full shape, e.g. {x = [1, 3, 48, 192]}
    shapes: dict[str, list[int]] = field(default_factory=dict)
    # input name -> constant value baked into the graph, e.g. {sr = 16000}
    constants: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ImageOptions:
    """The usual image preprocessing of a vision model's input."""

    size: list[int] = field(default_factory=list)  # [height, width]; empty = the input's
    # pad: fit inside keeping the aspect ratio; height: the full height, the width by the aspect
    # ratio up to the size's width (OCR text lines); both fill the rest (right/bottom) with
    # pad_value, in the units the model is fed (after scale/mean/std: YOLOX letterboxes with 114
    # at scale 1, PaddleOCR pads normalized zeros).
    resize: Literal["stretch", "shorter-crop", "pad", "height"] = "stretch"
    channel_order: Literal["RGB", "BGR", "GRAY"] = "RGB"
    layout: Literal["NCHW", "NHWC"] = "NCHW"
    scale: float = 1.0 / 255.0
    # One value serves every channel (so the defaults fit GRAY as well as RGB/BGR).
    mean: list[float] = field(default_factory=lambda: [0.0])
    std: list[float] = field(default_factory=lambda: [1.0])
    dtype: Literal["float32", "float16", "uint8"] = "float32"
    pad_value: float = 0.0


@dataclass(frozen=True)
class AudioOptions:
    """16-bit PCM wav files cut into fixed windows, fed as samples or as one STFT frame.

    ``features``: ``waveform`` feeds the window's samples; ``stft_magnitude`` feeds
    ``|rfft(window * window_fn)|`` (window // 2 + 1 bins); ``stft_complex`` feeds its real and
    imaginary parts as the last axis ([bins, 2]). Streaming speech models (denoisers, VADs on
    spectra) take one such frame per call, with their state carried across frames.
    """

    window: int = 512  # samples per window (the FFT size for STFT features)
    hop: int = 0  # 0 = same as window
    sample_rate: int = 16000
    scale: float = 1.0 / 32768.0
    features: Literal["waveform", "stft_magnitude", "stft_complex"] = "waveform"
    window_fn: Literal["none", "hann", "sqrt_hann"] = "none"  # applied before the FFT


@dataclass(frozen=True)
class CalibrationSection:
    """Where calibration samples come from and how many to use."""

    kind: Literal["tensors", "images", "audio", "python", "random"] = "tensors"
    path: str = ""
    # tensors: .npy files are fed to ``input``; .npz files map input names to arrays.
    # images/audio: ``input`` names the graph input the sample feeds.
    input: str = ""
    reader: str = ""  # python: "module:function" or "path/to/file.py:function"
    samples: int = 64
    held_out: float = 0.25
    seed: int = 0
    # Inputs not produced by the reader: "zeros" or "random" filling.
    fill_others: Literal["zeros", "random"] = "zeros"
    # Recurrent models: graph input -> graph output fed back across consecutive samples.
    recurrent: dict[str, str] = field(default_factory=dict)
    image: ImageOptions = field(default_factory=ImageOptions)
    audio: AudioOptions = field(default_factory=AudioOptions)


@dataclass(frozen=True)
class OverridesSection:
    """Mixed precision: per-tensor or per-op-type quantization types."""

    tensors: dict[str, Precision] = field(default_factory=dict)
    op_types: dict[str, Precision] = field(default_factory=dict)


@dataclass(frozen=True)
class QuantizationSection:
    """onnxruntime static QDQ quantization settings, in QNN-friendly defaults."""

    activation_type: QuantType = "uint16"
    weight_type: QuantType = "uint8"  # weights per tensor (MatMul, Gather, norms, ...)
    # Conv, ConvTranspose and Gemm weights in int8, symmetric, one scale per output channel, the
    # biases corrected for the rounding (bias_correction). BN-folded CNNs give the channels of
    # one weight scales 10-1000x apart, which one scale per tensor cannot serve: per channel +
    # correction measured 25-45 dB where per tensor gave 11-26 dB (weights alone, 5 real
    # models); the HTP computes 8-bit per-channel weights as the CPU does (55-80 dB apart).
    # Other weights keep weight_type per tensor: QNN refuses per-channel (and signed) LayerNorm
    # scales and takes MatMul weights per tensor only.
    per_channel: bool = True
    method: CalibrationMethod = "MinMax"
    min_snr_db: float = 0.0  # gate on fp32 vs QDQ per output; 0 disables
    auto_mixed_precision: bool = True  # raise the worst tensors to 16 bit when SNR is low
    target_snr_db: float = 25.0
    overrides: OverridesSection = field(default_factory=OverridesSection)
    # A pre-quantized model (its own Q/DQ or QLinear ops) keeps its quantization; true removes
    # it and calibrates and quantizes the float model behind it with the settings above.
    requantize: bool = False
    # Who judges precision and range choices: "htp" compiles candidates for the first target and
    # runs them on the QNN HTP (the simulator on a build machine) when onnxruntime-qnn is
    # installed, else falls back to "cpu" and says so; "cpu" judges the QDQ model on the CPU EP.
    judge: Literal["htp", "cpu"] = "htp"
    # Remove through each Conv/Gemm bias the mean error its weight's quantization adds
    # (pipeline/quantize/bias_correction.py); input means come from the calibration samples.
    bias_correction: bool = True
    # Rescale the output channels of a Conv whose peaks span 16x or more ahead of depthwise
    # Convs (through a Relu, SiLU, Mish or HardSwish), so one per-tensor grid holds them; the
    # depthwise kernels compensate, exact in float (pipeline/graph/balance.py). Per-channel
    # weights only: per tensor, the rescaled kernels would share one scale.
    balance_channels: bool = True


# QNN builds a recurrent op it takes whole one cell per step and direction, and its compile
# time grows with them faster than linearly (float, compile and load on this x86 machine, alone:
# one bidirectional LSTM layer of 128 over 300 steps 32 s, over 589 steps 73 s, four such layers
# 783 s, where a 900 s limit cut a pyannote-like VAD twice). The compile time limit grows by
# this much per cell QNN builds (``CompileSection.timeout_for``): 4 x 2 x 589 cells, 2356 s.
QNN_SECONDS_PER_RECURRENT_STEP = 0.5

# From this many recurrent cells on, "auto" finalizes the HTP graph at QNN's level 1 (faster
# preparation) instead of QNN's default: the default level's preparation grows with the cells
# *and* the size of the rest of the graph. A pyannote-like VAD (SincNet front end on 160,000
# samples + one BiLSTM of 128 over 589 frames, 1178 cells) compiled in 184 s at the default and
# 26 s at level 1 (the BiLSTM alone: 30 vs 25 s); with four such layers the default ran past
# 1763 s. The simulator counted fewer cycles at level 1 for it (3.8e9 vs 4.5e9), but QNN calls
# level 1 "less optimal", so models with few cells keep the default (every dev model).
FAST_FINALIZE_RECURRENT_STEPS = 512
FINALIZATION_OPTION = "htp_graph_finalization_optimization_mode"


@dataclass(frozen=True)
class CompileSection:
    """Which targets and toolchains to compile for, and the gates a variant must pass."""

    targets: list[str] = field(default_factory=lambda: ["snapdragon-x-elite"])
    toolchains: list[str] = field(default_factory=list)  # empty = newest pinned toolchain
    embed: bool = True
    max_partitions: int = 1
    allowed_cpu_ops: list[str] = field(default_factory=list)
    min_snr_db: float = 0.0  # gate on ctx vs QDQ; 0 disables
    timeout_s: float = 900.0  # per bucket; more for recurrent ops (timeout_for)
    load_runs: int = 3
    # A published fallback for devices whose NPU cannot run the release: the prepared float
    # model ("float32") or its fp16 copy ("float16") for QNN's GPU backend (pipeline.compile.gpu).
    gpu: Literal["off", "float32", "float16"] = "off"
    # QNN's HTP graph finalization level: "default" (QNN's), "1" (fastest to prepare) to "3"
    # (slowest, most optimized), or "auto": "1" for graphs with many recurrent cells (see
    # FAST_FINALIZE_RECURRENT_STEPS), else QNN's default. The judge compiles with the same.
    htp_finalization: Literal["auto", "default", "1", "2", "3"] = "auto"

    def qnn_options_for(self, recurrent_steps: int) -> dict[str, str]:
        """The QNN EP options this section sets for a graph with ``recurrent_steps`` cells
        (``graph.recurrent.qnn_recurrent_steps``); {} leaves every option at QNN's default."""
        level = self.htp_finalization
        if level == "auto":
            level = "1" if recurrent_steps >= FAST_FINALIZE_RECURRENT_STEPS else "default"
        return {} if level == "default" else {FINALIZATION_OPTION: level}

    def timeout_for(self, recurrent_steps: int) -> float:
        """``timeout_s`` plus ``QNN_SECONDS_PER_RECURRENT_STEP`` per LSTM/GRU/RNN cell QNN builds
        (``graph.recurrent.qnn_recurrent_steps``): a long BiLSTM compiles for minutes, not hangs."""
        return self.timeout_s + QNN_SECONDS_PER_RECURRENT_STEP * recurrent_steps


@dataclass(frozen=True)
class BucketPad:
    """How an input is padded along one bucket dim: the value, and on which side."""

    value: float = 0.0
    side: Literal["end", "start"] = "end"  # end = right/bottom, start = left/top


@dataclass(frozen=True)
class BucketOutput:
    """An output axis whose length follows a bucket dim, so the runtime crops it back."""

    axis: int
    follows: str  # a key of [buckets] dims (or "input:axis" with explicit shapes)


@dataclass(frozen=True)
class BucketsSection:
    """Dynamic dims served by several static shapes ("buckets") sharing one set of weights.

    A dim key is a dim_param of the source model (e.g. ``frames``) or ``"input:axis"``
    (e.g. ``"x:3"``) for a dim without a usable name. See pipeline/buckets.py.
    """

    # dim -> sizes; the buckets are the product of the lists, e.g. { width = [160, 320, 640] }
    dims: dict[str, list[int]] = field(default_factory=dict)
    # or explicit buckets, each a table of whole input shapes, e.g. [{ x = [1, 3, 32, 160] }]
    shapes: list[dict[str, list[int]]] = field(default_factory=list)
    pad: dict[str, BucketPad] = field(default_factory=dict)  # dim -> pad value and side
    outputs: dict[str, BucketOutput] = field(default_factory=dict)  # output -> followed dim
    # shared: one weight-shared context binary for all buckets (the device release);
    # standalone: one context binary per bucket (what the x86_64 HTP simulator can load).
    packaging: list[Literal["shared", "standalone"]] = field(default_factory=lambda: ["shared"])
    qnn_options: dict[str, str] = field(default_factory=dict)  # extra QNN EP options

    @property
    def enabled(self) -> bool:
        return bool(self.dims or self.shapes)


@dataclass(frozen=True)
class ModelConfig:
    model: ModelSection
    inputs: InputsSection = field(default_factory=InputsSection)
    calibration: CalibrationSection = field(default_factory=CalibrationSection)
    quantization: QuantizationSection = field(default_factory=QuantizationSection)
    compile: CompileSection = field(default_factory=CompileSection)
    buckets: BucketsSection = field(default_factory=BucketsSection)
    # Where the file came from; not a TOML key.
    path: Path = field(default=Path("."), compare=False, metadata={"toml": False})

    @property
    def base_dir(self) -> Path:
        return self.path.parent

    def resolve(self, relative: str) -> Path:
        """A path from the config, relative to the config file's folder."""
        candidate = Path(relative).expanduser()
        return candidate if candidate.is_absolute() else (self.base_dir / candidate).resolve()

    @property
    def source_path(self) -> Path:
        return self.resolve(self.model.source)

    def digest(self) -> str:
        """A stable hash of every setting (not the file's bytes): the release's config digest."""
        data = dataclasses.asdict(self)
        data.pop("path", None)
        return _hash(data)

    def quantize_digest(self) -> str:
        """A hash of the settings the quantize stage reads: the source and where it is cut
        (``model.outputs``), not the release's name, version or description, not [compile] (but its first target, the chip the HTP judge decides on),
        not the buckets' packaging or compile options."""
        data = dataclasses.asdict(self)
        for key in ("path", "compile"):
            data.pop(key, None)
        data["model"] = {"source": self.model.source}
        if self.model.outputs:  # where the source is cut (left out when unset: same digests)
            data["model"]["outputs"] = list(self.model.outputs)
        for key in ("packaging", "qnn_options"):
            data["buckets"].pop(key, None)
        if self.quantization.judge == "htp":  # the judge decides on the first target's chip
            data["judge_target"] = self.compile.targets[0] if self.compile.targets else ""
        return _hash(data)

    def compile_digest(self) -> str:
        """A hash of the settings one compiled variant depends on besides its QDQ models:
        [compile] without the lists of targets and toolchains (a variant is one of each), and
        the buckets' packaging and QNN options. Publishing from shards compares it."""
        data: dict[str, Any] = dataclasses.asdict(self.compile)
        for key in ("targets", "toolchains", "gpu"):  # gpu: its own variant, not the ctx ones
            data.pop(key)
        data["packaging"] = list(self.buckets.packaging)
        data["qnn_options"] = dict(self.buckets.qnn_options)
        return _hash(data)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["path"] = str(self.path)
        return data


def _hash(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


# -- parsing: every problem of a file is collected, then reported at once ------------------------


def _is_key(f: dataclasses.Field) -> bool:
    return f.metadata.get("toml", True)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (list, dict):
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", str(tp))


class _Problems:
    """Problems found in one config file, each naming the key; raised together at the end."""

    def __init__(self, file: Path) -> None:
        self.file = file
        self.items: list[tuple[str, str | None]] = []
        self.bad_keys: set[str] = set()  # keys whose value was refused (their default stands in)

    def add(self, message: str, tip: str | None = None) -> None:
        # A key already refused for its type is not reported again through its stand-in default.
        if any(message.startswith(f"{key} ") for key in self.bad_keys):
            return
        self.items.append((f"{self.file}: {message}", tip))

    def raise_if_any(self) -> None:
        if not self.items:
            return
        if len(self.items) == 1:
            message, tip = self.items[0]
            raise ConfigError(message, tip=tip)
        lines = [m + (f" ({t})" if t else "") for m, t in self.items]
        raise ConfigError(
            f"{self.file} has {len(lines)} problems:\n  - " + "\n  - ".join(lines),
            tip="Fix each key named above; paths are relative to the config file's folder.",
        )


_MISSING = object()


def _convert(value: Any, tp: Any, where: str, problems: _Problems) -> Any:
    """``value`` checked against the annotation ``tp`` (nested dataclasses recursively);
    returns _MISSING, after recording why, when it does not fit."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            problems.add(f"[{where}] must be a table, got {type(value).__name__}.")
            return _MISSING
        return _build(tp, value, where, problems)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            hint = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            tip = f"did you mean {hint[0]!r}?" if hint else f"use one of {list(allowed)}."
            problems.add(f"{where} = {value!r} is not allowed; {tip}")
            return _MISSING
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            problems.add(f"{where} must be a list, got {value!r}.")
            return _MISSING
        items = [_convert(v, item_tp, f"{where}[{i}]", problems) for i, v in enumerate(value)]
        return _MISSING if any(i is _MISSING for i in items) else items
    if origin is dict:
        _, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            problems.add(f"{where} must be a table, got {value!r}.")
            return _MISSING
        table = {str(k): _convert(v, val_tp, f"{where}.{k}", problems) for k, v in value.items()}
        return _MISSING if any(v is _MISSING for v in table.values()) else table
    if origin in (typing.Union, types.UnionType) or tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is bool and not isinstance(value, bool):
        problems.add(f"{where} must be true or false, got {value!r}.")
        return _MISSING
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        problems.add(f"{where} must be an integer, got {value!r}.")
        return _MISSING
    if not isinstance(value, tp):
        problems.add(f"{where} must be {_type_name(tp)}, got {value!r}.")
        return _MISSING
    return value


def _build(cls: type, table: dict[str, Any], where: str, problems: _Problems) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if _is_key(f)]
    prefix = f"[{where}] " if where else ""
    for key in table:
        if key in names:
            continue
        hint = difflib.get_close_matches(key, names, n=1)
        problems.add(
            f"unknown key {prefix}{key!r}"
            + (f"; did you mean {hint[0]!r}?" if hint else f"; known keys: {', '.join(names)}.")
        )
    kwargs = {}
    ok = True
    for f in dataclasses.fields(cls):
        if not _is_key(f):
            continue
        key_where = f"{where}.{f.name}" if where else f.name
        if f.name in table:
            value = _convert(table[f.name], hints[f.name], key_where, problems)
            if value is not _MISSING:
                kwargs[f.name] = value
                continue
            # Refused (and reported): the default stands in, so the other keys are still checked.
            problems.bad_keys.add(key_where)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                ok = False
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            problems.add(f"missing required key {key_where!r}.")
            ok = False
    return cls(**kwargs) if ok else _MISSING


def load_toml(path: Path) -> dict[str, Any]:
    """Read a TOML file, turning I/O and syntax errors into ConfigError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Config file {path} does not exist.", tip="Check the path you passed.")
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"Config file {path} cannot be read: {exc.strerror or exc}.") from None


def load_config(path: str | Path, check_files: bool = True) -> ModelConfig:
    """Parse and validate a model config; with ``check_files`` every referenced path must exist.

    Every problem of the file is reported in one ConfigError (types, unknown keys, values)."""
    path = Path(path).resolve()
    table = load_toml(path)
    problems = _Problems(path)
    config = _build(ModelConfig, table, "", problems)
    if config is _MISSING:
        problems.raise_if_any()
    config = dataclasses.replace(config, path=path)
    compile_table = table.get("compile")
    said_embed = isinstance(compile_table, dict) and "embed" in compile_table
    if config.buckets.enabled and "shared" in config.buckets.packaging and not said_embed:
        # One weight-shared context for the buckets is one external _qnn.bin: the default then.
        config = dataclasses.replace(
            config, compile=dataclasses.replace(config.compile, embed=False)
        )
    _validate(config, check_files, problems)
    problems.raise_if_any()
    return config


# A model name, version or bucket name becomes a folder: one safe path component.
SAFE_COMPONENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
SAFE_COMPONENT_RULE = (
    "1-128 characters of ASCII letters, digits, '.', '_', '+' or '-', starting with a letter or "
    "digit (it names files on the device, where non-ASCII paths crash the QNN stack)"
)


def unsafe_component(value: str) -> bool:
    """True when ``value`` cannot be used as one folder name inside the artifacts folder."""
    return not SAFE_COMPONENT.fullmatch(value) or value in (".", "..")


@dataclass(frozen=True)
class Limit:
    """The range of one numeric key; every numeric key has one (tests/test_faults.py checks),
    and NaN or infinity is never in range."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False  # True: the value must be > low, not >= low
    high_open: bool = False
    why: str = ""

    def allows(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def rule(self) -> str:
        def num(x: float) -> str:
            return str(int(x)) if float(x).is_integer() else f"{x:g}"

        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"in {left}{num(self.low)}, {num(self.high)}{right}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {num(self.low)}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {num(self.high)}"
        return "a finite number"


INT32_MAX = 2**31 - 1
_DIM = Limit(1, INT32_MAX, why="a tensor dim, 1 to 2**31 - 1")
_FINITE = Limit(why="NaN and infinity are not values")
# key pattern ("*" = any table key, "[*]" = any list item) -> its range.
LIMITS: dict[str, Limit] = {
    "inputs.dims.*": _DIM,
    "inputs.shapes.*[*]": _DIM,
    "calibration.samples": Limit(1, 1_000_000, why="samples used in all, held-out included"),
    "calibration.held_out": Limit(0, 1, high_open=True, why="the share kept apart; 0 = none"),
    "calibration.seed": Limit(0, why="a non-negative seed"),
    "calibration.image.size[*]": Limit(1, 16384, why="[height, width] in pixels"),
    "calibration.image.scale": Limit(0, low_open=True, why="pixels are multiplied by it"),
    "calibration.image.mean[*]": _FINITE,
    "calibration.image.pad_value": _FINITE,
    "calibration.image.std[*]": Limit(0, low_open=True, why="it divides"),
    "calibration.audio.window": Limit(1, 2**24, why="samples per window"),
    "calibration.audio.hop": Limit(0, 2**24, why="samples between windows; 0 = the window"),
    "calibration.audio.sample_rate": Limit(1, 1_000_000, why="samples per second of the wav files"),
    "calibration.audio.scale": Limit(0, low_open=True, why="samples are multiplied by it"),
    "quantization.min_snr_db": Limit(0, why="a gate in dB; 0 = off"),
    "quantization.target_snr_db": Limit(0, low_open=True, why="the SNR mixed precision aims at"),
    "compile.max_partitions": Limit(1, why="QNN partitions allowed"),
    "compile.min_snr_db": Limit(0, why="a gate in dB; 0 = off"),
    "compile.timeout_s": Limit(
        0, 7 * 86400, low_open=True, why="a hang must be cut: seconds per bucket, up to a week"
    ),
    "compile.load_runs": Limit(1, 1000, why="session creations timed"),
    "buckets.dims.*[*]": _DIM,
    "buckets.shapes[*].*[*]": _DIM,
    "buckets.pad.*.value": _FINITE,
    "buckets.outputs.*.axis": Limit(0, 63, why="an output axis"),
}
# Keys whose values are not settings with a range (constants baked into the graph).
_NO_LIMIT = ("inputs.constants",)


def numeric_key_patterns(cls: type | None = None, prefix: str = "") -> list[str]:
    """Every numeric key of the config, as a LIMITS pattern, read from the dataclasses' types."""
    cls = cls or ModelConfig
    out: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if _is_key(f):
            out += _type_patterns(hints[f.name], f"{prefix}.{f.name}" if prefix else f.name)
    return out


def _type_patterns(tp: Any, pattern: str) -> list[str]:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return numeric_key_patterns(tp, pattern)
    if origin is list:
        return _type_patterns(typing.get_args(tp)[0], f"{pattern}[*]")
    if origin is dict:
        return _type_patterns(typing.get_args(tp)[1], f"{pattern}.*")
    return [pattern] if tp in (int, float) else []


def _validate_limits(config: ModelConfig, problems: _Problems) -> None:
    """Every number against its key's Limit: one message per key, naming it and its range."""
    for path, pattern, value in _numbers_of(config):
        if pattern.startswith(_NO_LIMIT):
            continue
        limit = LIMITS.get(pattern, _FINITE)
        why = f" ({limit.why})" if limit.why else ""
        if isinstance(value, list):
            if not all(limit.allows(v) for v in value):
                problems.add(f"{path} = {value!r} must hold values {limit.rule()}{why}.")
        elif not limit.allows(value):
            problems.add(f"{path} = {value!r} must be {limit.rule()}{why}.")


def _numbers_of(config: ModelConfig) -> Iterator[tuple[str, str, Any]]:
    """Numbers (and lists of numbers) of the config, with their key path and LIMITS pattern."""
    for f in dataclasses.fields(config):
        if _is_key(f):
            yield from _walk_numbers(getattr(config, f.name), f.name, f.name)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _walk_numbers(value: Any, path: str, pattern: str) -> Iterator[tuple[str, str, Any]]:
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            if _is_key(f):
                yield from _walk_numbers(
                    getattr(value, f.name), f"{path}.{f.name}", f"{pattern}.{f.name}"
                )
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _walk_numbers(item, f"{path}.{key}", f"{pattern}.*")
    elif isinstance(value, list) and value and all(_is_number(v) for v in value):
        yield path, f"{pattern}[*]", value  # one message for the whole list
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _walk_numbers(item, f"{path}[{index}]", f"{pattern}[*]")
    elif _is_number(value):
        yield path, pattern, value


def _validate(config: ModelConfig, check_files: bool, problems: _Problems) -> None:
    """Cross-field rules and value ranges, each with a message that names the key and the fix."""
    add = problems.add
    for key, value in (("model.name", config.model.name), ("model.version", config.model.version)):
        if unsafe_component(value):
            add(
                f"{key} = {value!r} must be a safe folder name: {SAFE_COMPONENT_RULE}.",
                tip="It names folders under --artifacts; nothing may be written outside it.",
            )
    _validate_limits(config, problems)
    for name, shape in config.inputs.shapes.items():
        if not shape:
            add(f"inputs.shapes.{name} = {shape} needs positive dims.")
    _validate_calibration(config.calibration, problems)
    _validate_compile(config.compile, problems)
    if config.buckets.enabled or config.buckets != BucketsSection():
        _validate_buckets(config, problems)
    if check_files:
        if not config.source_path.is_file():
            add(
                f"model.source {config.source_path} does not exist.",
                tip="Fix model.source (relative to the config file's folder).",
            )
        path = config.calibration.path
        if path and not config.resolve(path).exists():
            add(
                f"calibration.path {config.resolve(path)} does not exist.",
                tip="Fix calibration.path (relative to the config file's folder).",
            )


def _validate_calibration(cal: CalibrationSection, problems: _Problems) -> None:
    add = problems.add
    if cal.kind in ("images", "audio", "tensors") and not cal.path:
        add(
            f"calibration.kind = {cal.kind!r} needs calibration.path.",
            tip="Point calibration.path at a folder of calibration files.",
        )
    if cal.kind == "python" and ":" not in cal.reader:
        add("calibration.kind = 'python' needs calibration.reader = 'module:function'.")
    image = cal.image
    if image.size and len(image.size) != 2:
        add(f"calibration.image.size = {image.size} must be [height, width], both > 0.")
    channels = 1 if image.channel_order == "GRAY" else 3
    for key in ("mean", "std"):
        if len(getattr(image, key)) not in (1, channels):
            add(
                f"calibration.image.{key} has {len(getattr(image, key))} values; channel_order "
                f"= {image.channel_order!r} takes "
                + ("1." if channels == 1 else f"1 (every channel) or {channels}.")
            )


def _target_named(name: str) -> str | None:
    """The target row an alias or part number belongs to, or None."""
    try:
        return get_target(name).name
    except ActionableError:
        return None


def _validate_compile(section: CompileSection, problems: _Problems) -> None:
    add = problems.add
    if not section.targets:
        add("compile.targets is empty; name at least one target chip.")
    for name in section.targets:
        if name not in TARGETS:
            same = _target_named(name)
            if same is not None:  # one binary per row serves all its names: build the row once
                add(
                    f"compile.targets names {name!r}, another name of {same!r} (same soc_model "
                    "and HTP arch, so the same binary).",
                    tip=f"Write {same!r}; devices that call themselves {name!r} load it.",
                )
                continue
            hint = difflib.get_close_matches(name, list(TARGETS), n=1)
            add(
                f"compile.targets names {name!r}, not a known chip"
                + (f"; did you mean {hint[0]!r}?" if hint else "."),
                tip=f"Known targets: {', '.join(TARGETS)}.",
            )
    if section.toolchains:
        table = load_toolchains()
        for version in section.toolchains:
            if version not in table.pinned:
                add(
                    f"compile.toolchains names {version!r}, which is not pinned "
                    f"({table.source}); pinned: {', '.join(table.pinned)}.",
                    tip="Use a pinned onnxruntime-qnn version, or verify and pin it.",
                )


def _validate_buckets(config: ModelConfig, problems: _Problems) -> None:
    """Rules of [buckets] that need no model; the model-dependent ones are in
    pipeline.graph.buckets."""
    add = problems.add
    b = config.buckets
    if not b.enabled:
        add(
            "[buckets] needs buckets.dims (sizes per dynamic dim) or buckets.shapes "
            "(explicit input shapes).",
            tip="e.g. [buckets] dims = { width = [160, 320, 640] }",
        )
        return
    if b.dims and b.shapes:
        add(
            "set buckets.dims or buckets.shapes, not both.",
            tip="dims gives the buckets as a product of sizes; shapes lists them one by one.",
        )
    for dim, sizes in b.dims.items():
        if not sizes:
            add(f"buckets.dims.{dim} is empty; list at least one size.")
        if len(set(sizes)) != len(sizes):
            add(f"buckets.dims.{dim} = {sizes} repeats a size.")
    _validate_bucket_shapes(b, problems)
    _validate_bucket_keys(b, problems)
    if not b.packaging:
        add('buckets.packaging is empty; use ["shared"], ["standalone"] or both.')
    if len(set(b.packaging)) != len(b.packaging):
        add(f"buckets.packaging = {b.packaging} repeats a value.")
    if "shared" in b.packaging and config.compile.embed:
        add(
            'buckets.packaging includes "shared", which needs compile.embed = false: '
            "every bucket's _ctx.onnx points at one external _qnn.bin.",
            tip="Set compile.embed = false in the config.",
        )
    kind = config.calibration.kind
    if kind in ("images", "audio"):
        add(
            f"calibration.kind = {kind!r} makes every sample the same size, which "
            "calibrates only one bucket.",
            tip='Use kind = "tensors" (arrays at their natural size) or a python reader that '
            "yields inputs at their natural size; each sample is padded into its bucket.",
        )
    if config.calibration.recurrent:
        add("calibration.recurrent is not supported with [buckets].")


def _validate_bucket_shapes(b: BucketsSection, problems: _Problems) -> None:
    """Explicit bucket shapes: the same inputs in every bucket, positive dims, one rank each."""
    if not b.shapes:
        return
    add = problems.add
    names = set(b.shapes[0])
    for index, bucket in enumerate(b.shapes):
        if not bucket:
            add(f"buckets.shapes[{index}] is empty; give input shapes.")
        if set(bucket) != names:
            add(
                f"buckets.shapes[{index}] names inputs {sorted(bucket)}, but "
                f"buckets.shapes[0] names {sorted(names)}; every bucket gives the same inputs."
            )
        for name, shape in bucket.items():
            if not shape:
                add(f"buckets.shapes[{index}].{name} = {shape} needs positive dims.")
            elif name in b.shapes[0] and len(shape) != len(b.shapes[0][name]):
                add(
                    f"buckets.shapes[{index}].{name} = {shape} has another rank "
                    f"than buckets.shapes[0].{name} = {b.shapes[0][name]}."
                )
    if len({tuple(tuple(s[n]) for n in sorted(s)) for s in b.shapes}) != len(b.shapes):
        add("buckets.shapes lists the same bucket twice.")


def _validate_bucket_keys(b: BucketsSection, problems: _Problems) -> None:
    """Dims named by buckets.pad and buckets.outputs must be dims the buckets vary."""
    add = problems.add
    keys = set(b.dims)

    def check_key(where: str, key: str) -> None:
        if b.shapes:
            if not is_axis_key(key):
                add(
                    f'{where} = {key!r}: with buckets.shapes, name a dim as "input:axis" (e.g. "x:3").'
                )
        elif key not in keys:
            hint = difflib.get_close_matches(key, sorted(keys), n=1)
            tip = f"did you mean {hint[0]!r}?" if hint else f"known: {', '.join(sorted(keys))}."
            add(f"{where} = {key!r} is not a key of buckets.dims; {tip}")

    for key in b.pad:
        check_key("buckets.pad key", key)
    for name, follow in b.outputs.items():
        check_key(f"buckets.outputs.{name}.follows", follow.follows)


def is_axis_key(key: str) -> bool:
    """``"input:axis"``: an input name, a colon, and a non-negative axis number."""
    name, sep, axis = key.rpartition(":")
    return bool(sep and name and axis.isdigit())
