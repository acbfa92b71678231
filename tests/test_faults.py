"""Bad input and faults on the build side: every one is a clear error, never a traceback,
a silently wrong result, or data lost.

Config fuzz over every key's type and range (the key list is read from the config dataclasses, so
a new key is fuzzed too), calibration images of every Pillow mode, an artifacts folder that is
read-only, full or a file, two builds of one model at once, and temp litter after a kill -9.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import typing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from release_fixtures import cached_build, python_path

from pipeline.core import config as config_mod
from pipeline.core.config import LIMITS, ModelConfig, load_config, numeric_key_patterns
from pipeline.core.errors import CalibrationError, ConfigError

BASE = {"model": {"name": "m", "source": "m.onnx"}, "calibration": {"kind": "random"}}


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


def toml_text(tables: dict[str, dict[str, Any]]) -> str:
    lines = []
    for section, table in tables.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {toml_value(value)}" for key, value in table.items()]
    return "\n".join(lines) + "\n"


def load_text(tmp_path: Path, text: str) -> ModelConfig:
    (tmp_path / "m.onnx").write_bytes(b"x")
    path = tmp_path / "cfg.toml"
    path.write_text(text, encoding="utf-8")
    return load_config(path, check_files=False)


# -- config fuzz: types --------------------------------------------------------------------------


def leaf_keys(cls: type = ModelConfig, prefix: tuple[str, ...] = ()) -> list[tuple[tuple, Any]]:
    """Every TOML key of the config (path, annotation), read from the dataclasses."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.metadata.get("toml", True):
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += leaf_keys(tp, (*prefix, f.name))
        else:
            out.append(((*prefix, f.name), tp))
    return out


def wrong_values(tp: Any) -> list[Any]:
    """Values of the wrong type for the annotation ``tp``."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return []
    if origin is typing.Literal:
        return ["no-such-choice", 3, []]
    if origin is list:
        item = typing.get_args(tp)[0]
        return ["x", 1, {"a": 1}, [{"a": []}] if item in (int, float, str) else [[[]]]]
    if origin is dict:
        nested = [] if typing.get_args(tp)[1] is Any else [{"k": {"nested": {"too": "deep"}}}]
        return ["x", [1], *nested]
    if tp is bool:
        return ["yes", 1, [True]]
    if tp is int:
        return ["1", 1.5, True, [1], {"a": 1}]
    if tp is float:
        return ["1.0", True, [1.0], {"a": 1.0}]
    if tp is str:
        return [5, 1.5, True, ["x"], {"a": "x"}]
    raise AssertionError(f"no wrong values for {tp}: add them here")


TYPE_CASES = [
    pytest.param(path, value, id=f"{'.'.join(path)}={value!r}")
    for path, tp in leaf_keys()
    for value in wrong_values(tp)
]


def test_type_fuzz_covers_every_key() -> None:
    keys = {".".join(p) for p, tp in leaf_keys() if tp is not Any}
    fuzzed = {".".join(case.values[0]) for case in TYPE_CASES}
    assert keys == fuzzed and len(keys) > 40


@pytest.mark.parametrize(("path", "value"), TYPE_CASES)
def test_wrong_type_is_a_config_error_naming_the_key(
    tmp_path: Path, path: tuple, value: Any
) -> None:
    tables = json.loads(json.dumps(BASE))
    table = tables.setdefault(path[0], {})
    for part in path[1:-1]:
        table = table.setdefault(part, {})
    table[path[-1]] = value
    with pytest.raises(ConfigError) as info:
        load_text(tmp_path, toml_text(tables))
    assert ".".join(path) in info.value.message or f"'{path[-1]}'" in info.value.message


# -- config fuzz: ranges -------------------------------------------------------------------------

# LIMITS pattern -> (the key as messages name it, TOML that puts {v} there in a valid config).
BUCKETS = "[compile]\nembed = false\n[buckets]\ndims = {{ w = [4] }}\n"
PLACES = {
    "inputs.dims.*": ("inputs.dims.batch", "[inputs]\ndims = {{ batch = {v} }}\n"),
    "inputs.shapes.*[*]": ("inputs.shapes.x", "[inputs]\nshapes = {{ x = [1, {v}] }}\n"),
    "calibration.samples": ("calibration.samples", "samples = {v}\n"),
    "calibration.held_out": ("calibration.held_out", "held_out = {v}\n"),
    "calibration.seed": ("calibration.seed", "seed = {v}\n"),
    "calibration.image.size[*]": (
        "calibration.image.size",
        "[calibration.image]\nsize = [{v}, 8]\n",
    ),
    "calibration.image.scale": ("calibration.image.scale", "[calibration.image]\nscale = {v}\n"),
    "calibration.image.mean[*]": ("calibration.image.mean", "[calibration.image]\nmean = [{v}]\n"),
    "calibration.image.std[*]": ("calibration.image.std", "[calibration.image]\nstd = [{v}]\n"),
    "calibration.image.pad_value": (
        "calibration.image.pad_value",
        "[calibration.image]\npad_value = {v}\n",
    ),
    "calibration.audio.window": ("calibration.audio.window", "[calibration.audio]\nwindow = {v}\n"),
    "calibration.audio.hop": ("calibration.audio.hop", "[calibration.audio]\nhop = {v}\n"),
    "calibration.audio.sample_rate": (
        "calibration.audio.sample_rate",
        "[calibration.audio]\nsample_rate = {v}\n",
    ),
    "calibration.audio.scale": ("calibration.audio.scale", "[calibration.audio]\nscale = {v}\n"),
    "quantization.min_snr_db": ("quantization.min_snr_db", "[quantization]\nmin_snr_db = {v}\n"),
    "quantization.target_snr_db": (
        "quantization.target_snr_db",
        "[quantization]\ntarget_snr_db = {v}\n",
    ),
    "compile.max_partitions": ("compile.max_partitions", "[compile]\nmax_partitions = {v}\n"),
    "compile.min_snr_db": ("compile.min_snr_db", "[compile]\nmin_snr_db = {v}\n"),
    "compile.timeout_s": ("compile.timeout_s", "[compile]\ntimeout_s = {v}\n"),
    "compile.load_runs": ("compile.load_runs", "[compile]\nload_runs = {v}\n"),
    "buckets.dims.*[*]": (
        "buckets.dims.w",
        "[compile]\nembed = false\n[buckets]\ndims = {{ w = [{v}] }}\n",
    ),
    "buckets.shapes[*].*[*]": (
        "buckets.shapes[0].x",
        "[compile]\nembed = false\n[buckets]\nshapes = [{{ x = [1, {v}] }}]\n",
    ),
    "buckets.pad.*.value": ("buckets.pad.w.value", BUCKETS + "pad = {{ w = {{ value = {v} }} }}\n"),
    "buckets.outputs.*.axis": (
        "buckets.outputs.y.axis",
        BUCKETS + 'outputs = {{ y = {{ axis = {v}, follows = "w" }} }}\n',
    ),
}


def place(pattern: str, value: Any) -> str:
    text = PLACES[pattern][1].format(v=toml_value(value))
    head = '[model]\nname = "m"\nsource = "m.onnx"\n[calibration]\nkind = "random"\n'
    return head + text


def numeric_type(pattern: str) -> type:
    """int or float: the annotation behind a LIMITS pattern."""
    tp: Any = ModelConfig
    for part in pattern.replace("[*]", ".[*]").split("."):
        while True:
            origin = typing.get_origin(tp)
            if part == "[*]" and origin is list:
                tp = typing.get_args(tp)[0]
                break
            if part == "*" and origin is dict:
                tp = typing.get_args(tp)[1]
                break
            if dataclasses.is_dataclass(tp):
                tp = typing.get_type_hints(tp)[part]
                break
            raise AssertionError(f"cannot follow {part} in {pattern}")
    return tp


def range_cases() -> list[Any]:
    cases = []
    for pattern, limit in LIMITS.items():
        tp = numeric_type(pattern)
        bad: list[Any] = []
        good: list[Any] = []
        step = 1 if tp is int else 0.5
        if limit.low is not None:
            (bad if limit.low_open else good).append(tp(limit.low))
            bad.append(tp(limit.low - step))
            if limit.low_open:
                good.append(tp(limit.low + (1 if tp is int else 1e-3)))
        if limit.high is not None:
            (bad if limit.high_open else good).append(tp(limit.high))
            bad.append(tp(limit.high + step))
        if limit.low is None and limit.high is None:
            good.append(tp(-1.5 if tp is float else -1))
        if tp is float:
            bad += [float("nan"), float("inf"), float("-inf")]
        cases += [pytest.param(pattern, v, False, id=f"{pattern}={v!r}") for v in bad]
        cases += [pytest.param(pattern, v, True, id=f"{pattern}={v!r}-ok") for v in good]
    return cases


def test_every_numeric_key_has_a_range_and_a_fuzz_place() -> None:
    """A new numeric key must declare its Limit (config.LIMITS) and be fuzzed here."""
    assert set(numeric_key_patterns()) == set(LIMITS) == set(PLACES)


@pytest.mark.parametrize(("pattern", "value", "ok"), range_cases())
def test_out_of_range_is_a_config_error_naming_key_and_range(
    tmp_path: Path, pattern: str, value: Any, ok: bool
) -> None:
    text = place(pattern, value)
    if ok:
        load_text(tmp_path, text)
        return
    with pytest.raises(ConfigError) as info:
        load_text(tmp_path, text)
    key = PLACES[pattern][0]
    message = info.value.message
    assert f"{key} = " in message and "must" in message, message
    assert LIMITS[pattern].rule() in message, message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "[calibration.image]\nsize = [0, 0]\n",
            "calibration.image.size = [0, 0] must hold values",
        ),
        ("seed = -1\n", "calibration.seed = -1 must be >= 0"),
        ("[calibration.audio]\nwindow = 0\n", "calibration.audio.window = 0 must be in [1,"),
        ("[compile]\ntimeout_s = inf\n", "compile.timeout_s = inf must be in (0, 604800]"),
        ("[quantization]\nmin_snr_db = nan\n", "quantization.min_snr_db = nan must be >= 0"),
    ],
)
def test_the_issue_examples(tmp_path: Path, text: str, message: str) -> None:
    head = '[model]\nname = "m"\nsource = "m.onnx"\n[calibration]\nkind = "random"\n'
    with pytest.raises(ConfigError, match=None) as info:
        load_text(tmp_path, head + text)
    assert message in info.value.message


def test_limit_rules_read_well() -> None:
    assert config_mod.Limit(0, 1, high_open=True).rule() == "in [0, 1)"
    assert config_mod.Limit(0, low_open=True).rule() == "> 0"
    assert config_mod.Limit().rule() == "a finite number"


# -- calibration images of every Pillow mode -----------------------------------------------------


def image_config(tmp_path: Path, folder: str, extra: str = "") -> ModelConfig:
    text = (
        '[model]\nname = "m"\nsource = "m.onnx"\n[calibration]\nkind = "images"\n'
        f'path = "{folder}"\nheld_out = 0.0\nsamples = 1\n[calibration.image]\n{extra}'
    )
    return load_text(tmp_path, text)


def gradient() -> np.ndarray:
    """8-bit RGB content that every mode can hold: gray ramp in all three channels."""
    ramp = np.linspace(0, 255, 16 * 16).reshape(16, 16).round().astype(np.uint8)
    return np.repeat(ramp[:, :, None], 3, axis=2)


def save_mode(folder: Path, mode: str) -> Path:
    """The gradient saved in Pillow ``mode`` (16-bit: the same values times 257)."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rgb = gradient()
    gray = rgb[:, :, 0]
    if mode == "I;16":
        image = Image.fromarray(gray.astype(np.uint16) * 257)
        path = folder / "img.png"
    elif mode == "I;16B":
        image = Image.fromarray(gray.astype(np.uint16) * 257).convert("I").convert("I;16B")
        path = folder / "img.tiff"
    elif mode in ("I", "F"):
        array = gray.astype(np.int32 if mode == "I" else np.float32)
        image = Image.fromarray(array)
        path = folder / "img.tiff"
    elif mode == "RGBA":
        alpha = np.full(gray.shape, 7, np.uint8)  # nearly transparent: alpha must not leak in
        image = Image.fromarray(np.dstack([rgb, alpha]))
        path = folder / "img.png"
    elif mode == "LA":
        image = Image.fromarray(np.dstack([gray, np.full(gray.shape, 7, np.uint8)]))
        path = folder / "img.png"
    elif mode == "P":
        image = Image.fromarray(rgb).quantize(256)
        path = folder / "img.png"
    elif mode == "CMYK":
        image = Image.fromarray(rgb).convert("CMYK")
        path = folder / "img.tiff"
    elif mode == "1":
        image = Image.fromarray(np.where(gray >= 128, 255, 0).astype(np.uint8)).convert("1")
        path = folder / "img.png"
    else:  # "L", "RGB"
        image = Image.fromarray(gray if mode == "L" else rgb)
        path = folder / "img.png"
    image.save(path)
    with Image.open(path) as check:
        assert check.mode == mode, (mode, check.mode)
    return path


def calibration_tensor(config: ModelConfig, shape=(1, 3, 8, 8)) -> np.ndarray:
    from test_calibration import build_samples

    from pipeline.calibration.samples import InputSpec

    calib, _ = build_samples(
        config, [InputSpec("x", shape, np.dtype(config.calibration.image.dtype))]
    )
    return next(iter(calib))["x"]


@pytest.mark.parametrize("mode", ["L", "RGB", "P", "RGBA", "LA", "CMYK", "I;16", "I;16B"])
@pytest.mark.parametrize("channels", ["RGB", "GRAY"])
def test_every_image_mode_lands_on_the_configured_range(
    tmp_path: Path, mode: str, channels: str
) -> None:
    """The same picture in any mode gives the same calibration tensor, within 8-bit rounding."""
    save_mode(tmp_path / "ref", "RGB")
    save_mode(tmp_path / "img", mode)
    extra = f'channel_order = "{channels}"\nmean = [0.5]\nstd = [0.25]\n'
    shape = (1, 1 if channels == "GRAY" else 3, 8, 8)
    ref_config = image_config(tmp_path, "ref", extra)
    expected = calibration_tensor(ref_config, shape)
    got = calibration_tensor(image_config(tmp_path, "img", extra), shape)
    assert got.shape == expected.shape and got.dtype == np.float32
    # (x / 255 - 0.5) / 0.25 spans [-2, 2]; one 8-bit step is 4 / 255.
    assert np.abs(got - expected).max() <= 4.5 / 255, (mode, np.abs(got - expected).max())
    assert got.min() < -1.5 and got.max() > 1.5  # the full range, not saturated


def test_sixteen_bit_png_keeps_its_precision(tmp_path: Path) -> None:
    """A 16-bit gray PNG with values between 8-bit steps: kept, not saturated or truncated."""
    from PIL import Image

    folder = tmp_path / "img"
    folder.mkdir()
    values = np.linspace(0, 65535, 64).reshape(8, 8).astype(np.uint16)
    Image.fromarray(values).save(folder / "deep.png")
    config = image_config(tmp_path, "img", 'channel_order = "GRAY"\nmean = [0.0]\nstd = [1.0]\n')
    got = calibration_tensor(config, (1, 1, 8, 8))[0, 0]
    assert np.allclose(got, values / 65535.0, atol=1e-6)
    assert (got >= 0.999).mean() < 0.05  # today's bug: 99.6 % saturated at 1.0


def test_binary_image(tmp_path: Path) -> None:
    save_mode(tmp_path / "img", "1")
    config = image_config(tmp_path, "img", 'channel_order = "GRAY"\nmean = [0.0]\nstd = [1.0]\n')
    got = calibration_tensor(config, (1, 1, 8, 8))
    assert got.min() == 0.0 and got.max() == 1.0 and 0.3 < (got > 0.5).mean() < 0.7


def test_uint8_dtype_from_a_sixteen_bit_image(tmp_path: Path) -> None:
    save_mode(tmp_path / "ref", "RGB")
    save_mode(tmp_path / "img", "I;16")
    got = calibration_tensor(image_config(tmp_path, "img", 'dtype = "uint8"\n'))
    ref = calibration_tensor(image_config(tmp_path, "ref", 'dtype = "uint8"\n'))
    assert got.dtype == np.uint8 and got.max() >= 240
    assert np.abs(got.astype(int) - ref.astype(int)).max() <= 1


@pytest.mark.parametrize("mode", ["I", "F"])
def test_images_without_a_known_range_are_refused(tmp_path: Path, mode: str) -> None:
    path = save_mode(tmp_path / "img", mode)
    with pytest.raises(CalibrationError) as info:
        calibration_tensor(image_config(tmp_path, "img"))
    assert str(path) in info.value.message and f"mode {mode!r}" in info.value.message
    assert "16-bit" in (info.value.tip or "")


@pytest.mark.parametrize("content", [b"", b"\x89PNG\r\n\x1a\n" + b"\0" * 40, b"not an image"])
def test_broken_image_names_the_file(tmp_path: Path, content: bytes) -> None:
    folder = tmp_path / "img"
    folder.mkdir()
    (folder / "broken.png").write_bytes(content)
    with pytest.raises(CalibrationError, match=r"broken\.png"):
        calibration_tensor(image_config(tmp_path, "img"))


# -- the artifacts folder: a file, read-only, full -----------------------------------------------


def drop_root_override() -> None:
    """In a child: as root, give up CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH, so file modes apply
    (root ignores them otherwise); a non-root user needs nothing."""
    if os.geteuid() != 0:
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_capbset_drop = 24
    for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(pr_capbset_drop, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def file_size_limit(limit: int):
    """preexec_fn: files may grow to ``limit`` bytes; past it a write fails with EFBIG, as on
    a full disk (SIGXFSZ ignored, so the write returns the error instead of killing)."""

    def apply() -> None:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def stage_child(*args: str, preexec=None, env: dict | None = None, timeout: float = 300):
    """``python -m pipeline ARGS`` in a child of this environment."""
    full_env = dict(os.environ, PYTHONPATH=python_path(), **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        preexec_fn=preexec,
    )


def clean_failure(result: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 1, an ERROR line and a TIP, the needles in the message, and no traceback."""
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert "ERROR:" in result.stderr and "TIP:" in result.stderr, result.stderr
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)


def dot_names(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob(".*")) if folder.exists() else []


@pytest.fixture(scope="module")
def base_build(tmp_path_factory: pytest.TempPathFactory):
    return cached_build(tmp_path_factory)


@pytest.fixture
def build(base_build, tmp_path: Path):
    return base_build.copy(tmp_path / "project")


def test_artifacts_that_is_a_file(build, capsys: pytest.CaptureFixture) -> None:
    from pipeline.__main__ import main

    target = build.root / "artifacts.txt"
    target.write_text("my notes")
    for stage in ("quantize", "publish"):
        assert main([stage, str(build.config), "--artifacts", str(target)]) == 1
        err = capsys.readouterr().err
        assert f"--artifacts {target} is a file, not a folder" in err and "TIP:" in err
    assert target.read_text() == "my notes"


def test_read_only_artifacts(build) -> None:
    """Read-only at the root: refused before any work. Read-only below it (releases/<model>):
    the stage's own write fails, and the message names the folder, not a traceback."""
    root = build.root / "ro-artifacts"
    root.mkdir()
    root.chmod(0o555)
    try:
        result = stage_child(
            "publish", str(build.config), "--artifacts", str(root), preexec=drop_root_override
        )
        clean_failure(result, f"--artifacts {root} cannot be written", "permission denied")
    finally:
        root.chmod(0o755)
    releases = build.artifacts / "releases" / "tiny"
    releases.mkdir(parents=True)
    releases.chmod(0o555)
    try:
        result = stage_child(
            "publish",
            str(build.config),
            "--artifacts",
            str(build.artifacts),
            preexec=drop_root_override,
        )
        clean_failure(result, str(releases), "permission denied")
    finally:
        releases.chmod(0o755)
    assert list(releases.iterdir()) == []


def test_full_disk_during_publish_leaves_nothing_half_written(build) -> None:
    limit = 16 * 1024  # the ctx files are larger: the copy into the release fails
    sizes = [p.stat().st_size for p in build.build.rglob("*_ctx.onnx")]
    assert max(sizes) > limit
    result = stage_child(
        "publish",
        str(build.config),
        "--artifacts",
        str(build.artifacts),
        preexec=file_size_limit(limit),
    )
    clean_failure(result, "Nothing half-written was kept")
    releases = build.artifacts / "releases" / "tiny"
    assert not (releases / "1.0.0").exists()
    assert dot_names(releases) == []  # the temp folder of the failed publish is gone too
    # With room again, the same command publishes.
    result = stage_child("publish", str(build.config), "--artifacts", str(build.artifacts))
    assert result.returncode == 0, result.stderr
    assert (releases / "1.0.0" / "manifest.json").is_file()


# -- two builds of one model at once; kill -9 ------------------------------------------------------


def wait_for(condition, what: str, seconds: float = 180.0) -> None:
    """Poll ``condition`` until true; the deadline only catches a test that is broken, the
    events themselves (a file written, a process gone) do not depend on the machine's speed."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {seconds:g} s for {what}")
        time.sleep(0.1)


@pytest.mark.qnn
def test_second_run_is_busy_and_kill_9_leaves_no_orphan_or_litter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A compile hangs for real (its worker is stuck in compile_to_file): a second compile, a
    quantize and a publish of the same model are refused as busy and touch nothing. Then the
    first compile gets kill -9: its worker dies with it (no orphan), nothing it left is taken
    for a good variant, and the next compile sweeps its temp litter and builds."""
    pytest.importorskip("onnxruntime_qnn")
    from compile_fixtures import build_inputs, model_paths, small_cnn
    from test_compile import hook_worker, is_alive

    from pipeline.__main__ import main

    # The time limit only bounds a broken run (a second compile that is not refused hangs in the
    # same hook): the first one is killed long before, as soon as its worker is in the hook.
    config = build_inputs(tmp_path, "contested", small_cnn, "timeout_s = 120")
    paths = model_paths(tmp_path, "contested")
    marker = hook_worker(monkeypatch, tmp_path, "hang")
    artifacts = str(tmp_path / "artifacts")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.environ["PYTHONPATH"], python_path()]))
    first = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "compile", "--artifacts", artifacts, str(config)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(marker.is_file, "the first compile's worker to reach compile_to_file")
        worker = int(marker.read_text())
        work = [p for p in paths.ctx.iterdir() if p.name.startswith(".work-")]
        assert len(work) == 1 and work[0].is_dir()
        before = {p: p.stat().st_mtime_ns for p in paths.root.rglob("*") if p.is_file()}

        for stage in ("compile", "quantize", "publish"):
            assert main([stage, "--artifacts", artifacts, str(config)]) == 1
            err = capsys.readouterr().err
            assert f"contested is busy: `compile` (pid {first.pid}" in err, err
            assert "TIP: Wait until it ends" in err
        assert work[0].is_dir(), "the second run deleted the first one's temp folder"
        after = {p: p.stat().st_mtime_ns for p in paths.root.rglob("*") if p.is_file()}
        assert after == before, "a refused run changed files"

        first.send_signal(signal.SIGKILL)
        first.wait()
        wait_for(lambda: not is_alive(worker), "the orphaned worker to die", 30)
    finally:
        if first.poll() is None:
            first.kill()
    litter = dot_names(paths.root)
    assert litter, "the killed run left no temp files: this test would prove nothing"
    assert not paths.variant(installed_version(), "snapdragon-x-elite").record.exists()

    monkeypatch.undo()  # the next run hangs no more
    assert main(["compile", "--artifacts", artifacts, str(config)]) == 0
    assert dot_names(paths.root) == [], "the rerun left the killed run's litter"


def installed_version() -> str:
    from qnn_ctx_runtime import qnn

    return qnn.installed_qnn().package_version


# -- calibration data with NaN or infinity -------------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_calibration_tensors_are_refused(tmp_path: Path, bad: float) -> None:
    """Calibrating on them gave a QDQ model and a report with a figure, and no word."""
    from test_calibration import build_samples, make_config, tensor_folder

    from pipeline.calibration.samples import InputSpec

    folder = tensor_folder(tmp_path, 4)
    poisoned = np.load(folder / "s02.npy")
    poisoned[0, 1, 2, 3] = bad
    np.save(folder / "s02.npy", poisoned)
    config = make_config(tmp_path, 'kind = "tensors"\npath = "data"\nheld_out = 0.0')
    calib, _ = build_samples(config, [InputSpec("x", (1, 3, 8, 8), np.dtype("float32"))])
    with pytest.raises(CalibrationError) as info:
        list(calib)
    assert "s02.npy" in info.value.message and "1 NaN or infinite value(s)" in info.value.message


def test_litter_of_killed_runs_is_swept_by_the_next_run(build) -> None:
    """Temp names (a leading '.') in a model's build folder are a killed run's: the next stage
    that holds the model's lock removes them, and nothing else."""
    from pipeline.__main__ import main

    litter = [
        build.build / "buckets" / "static" / ".qdq.onnx.k1ll3d.tmp",
        build.build / ".calibrate-k1ll3d" / "ranges_static.json",
        build.build / "ctx" / ".work-k1ll3d" / "result.json",
    ]
    for path in litter:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("half")
    kept = {p: p.read_bytes() for p in build.build.rglob("*") if p.is_file() and p not in litter}
    assert main(["publish", str(build.config), "--artifacts", str(build.artifacts)]) == 0
    assert dot_names(build.build) == []
    assert {p: p.read_bytes() for p in kept} == kept


def test_system_temp_litter_of_a_dead_process_is_swept() -> None:
    """Scratch folders in the system temp folder carry their process id; a later run removes
    those whose process is gone, and keeps a live one's."""
    from pipeline.core.fileio import pid_scratch

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    prefix = "pipeline-faulttest-"
    stale = Path(tempfile.gettempdir()) / f"{prefix}{dead.pid}-x"
    live = Path(tempfile.gettempdir()) / f"{prefix}{os.getpid()}-y"
    for folder in (stale, live):
        folder.mkdir(exist_ok=True)
        (folder / "preprocessed.onnx").write_bytes(b"half")
    try:
        with pid_scratch(prefix) as scratch:
            assert Path(scratch).name.startswith(f"{prefix}{os.getpid()}-")
        assert not stale.exists() and live.is_dir()
    finally:
        shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(live, ignore_errors=True)


def test_windows_job_object_limits_have_the_winnt_layout() -> None:
    """The child-kill-on-parent-death of Windows rests on a struct passed to
    SetInformationJobObject: a wrong layout is refused there (or sets the wrong flag), so its
    size and the flag's offset must be winnt.h's (144 and 16 bytes on 64-bit, 112 and 16 on
    32-bit)."""
    import ctypes
    import struct

    from pipeline.htp.isolation import JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE, kill_on_close_limits

    limits = kill_on_close_limits()
    assert ctypes.sizeof(limits) == (144 if struct.calcsize("P") == 8 else 112)
    raw = bytes(limits)
    assert int.from_bytes(raw[16:20], "little") == JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE == 0x2000
    assert raw[:16] == bytes(16) and raw[20:] == bytes(len(raw) - 20)


def test_kill_without_process_groups_still_kills_the_child(monkeypatch) -> None:
    """Where ``os.killpg`` does not exist (Windows without a job object) the child is killed
    directly, not left running behind an AttributeError."""
    from pipeline.htp import isolation

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    monkeypatch.delattr(isolation.os, "killpg")
    isolation.kill_group(child)
    assert child.returncode is not None and child.returncode != 0


MEMORY_HOG = """\
import threading

import numpy as np

held = np.ones({size}, np.uint8)  # every page written: resident
threading.Event().wait()  # never set: only the guard ends this child
"""


@pytest.mark.skipif(not Path("/proc/meminfo").is_file(), reason="the guard reads Linux's /proc")
def test_a_child_past_its_memory_is_stopped_and_says_what_it_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child that holds more than the guard allows is killed with its group and its end says
    what it held: not a bare SIGKILL, not "killed from outside" (a hang forever otherwise)."""
    from pipeline.htp import isolation
    from pipeline.htp.probe import ProbeJob, _outcome

    (tmp_path / "hog_module.py").write_text(MEMORY_HOG.format(size=400 << 20))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    job = tmp_path / "job.json"
    child = isolation.start_module("hog_module", job, tmp_path / "hog.log")
    guard = isolation.MemoryGuard(reserve_bytes=0, limit_bytes=300 << 20)
    done = isolation.wait_for(child, 3600, memory=guard)
    assert not done.timed_out and done.returncode == -signal.SIGKILL, done
    held = float(done.out_of_memory.split()[2])  # "it held 0.41 GiB resident, over the ..."
    # Stopped anywhere past its 300 MiB (0.293 GiB, shown as 0.29) and before its 400: how far
    # past depends on how fast it grew between two looks, which the machine's load decides.
    assert 0.29 <= held < 1.0 and "over the 0.29 GiB allowed" in done.out_of_memory, done
    assert not done.killed_from_outside()
    assert isolation.group_resident_bytes(child.proc.pid) == 0, "its group outlived the stop"
    # The HTP judge's probe reports it so.
    probe_job = ProbeJob("q.onnx", "f.onnx", [], str(tmp_path), str(tmp_path / "none.json"), 60, 73)
    result = _outcome(probe_job, done, 3600)
    assert result.status == "failed"
    assert result.error.startswith("the HTP child ran out of memory in ") and "GiB" in result.error


IDLE_HANG = "import threading\nthreading.Event().wait()  # never set: no CPU, no end\n"
SPIN_HANG = "while True:\n    pass\n"


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="CPU time is read from Linux's /proc")
def test_a_child_is_cut_after_its_time_of_work_and_a_hang_that_does_no_work_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The time limit counts work: a child is cut once it has run ``timeout_s`` and used as much
    CPU time, so a compile slowed by other builds on the machine is not taken for a hang (a
    pyannote-like VAD's QNN compile ran past its limit beside two other builds). A child that
    does nothing is still cut, after ``HANG_WALL_FACTOR`` times the limit."""
    from pipeline.htp import isolation

    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    (tmp_path / "idle_module.py").write_text(IDLE_HANG)
    (tmp_path / "spin_module.py").write_text(SPIN_HANG)
    job = tmp_path / "job.json"
    started = time.monotonic()
    idle = isolation.wait_for(isolation.start_module("idle_module", job, tmp_path / "i.log"), 1.0)
    assert idle.timed_out and idle.returncode is not None and idle.returncode < 0, idle
    # it used no CPU, so only the wall-time cap ended it, never before it
    assert time.monotonic() - started >= isolation.HANG_WALL_FACTOR * 1.0
    spinning = isolation.start_module("spin_module", job, tmp_path / "s.log")
    done = isolation.wait_for(spinning, 1.0)
    assert done.timed_out, done
    assert isolation.group_cpu_seconds(spinning.proc.pid) == 0.0  # its group is gone
    assert isolation.group_cpu_seconds(os.getpgrp()) > 0.0  # this process's own work counts


def test_the_machines_guard_stops_a_child_only_when_the_machine_runs_short(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default guard keeps 5% of the machine (512 MiB at least) and has no cap of its own;
    it stops a group only when what is left available is under its reserve while that group
    holds more than the reserve (the machine's state is faked: this group's is measured)."""
    from pipeline.htp import isolation

    guard = isolation.MemoryGuard.for_machine()
    assert guard.reserve_bytes >= 512 << 20 and guard.limit_bytes == 0
    assert guard.verdict(2**22 + 7) == ""  # no such group: nothing held
    if not Path("/proc/meminfo").is_file():
        assert guard.verdict(os.getpgrp()) == ""  # nothing to read: nothing checked
        return
    held = isolation.group_resident_bytes(os.getpgrp())
    assert held > 32 << 20, held  # this test's own process (numpy, onnx imported) at least
    reserve = held // 2
    machine = {"MemTotal": 24 << 30, "MemAvailable": reserve - 1}
    monkeypatch.setattr(isolation, "_meminfo", lambda: machine)
    verdict = isolation.MemoryGuard(reserve).verdict(os.getpgrp())
    assert "left available" in verdict and "of the machine's 24.0 GiB (and its swap)" in verdict
    assert isolation.MemoryGuard(2 * held).verdict(os.getpgrp()) == ""  # holds under the reserve
    machine["SwapFree"] = 1  # free swap is room too: the kernel pages out, kills nothing yet
    assert isolation.MemoryGuard(reserve).verdict(os.getpgrp()) == ""
    machine["SwapFree"] = 0
    machine["MemAvailable"] = reserve  # not short
    assert isolation.MemoryGuard(reserve).verdict(os.getpgrp()) == ""


@pytest.mark.skipif(sys.platform != "win32", reason="job objects are Windows' own")
def test_windows_worker_dies_with_its_parent(tmp_path: Path) -> None:
    """A parent killed outright (TerminateProcess) takes its job object, and the worker, along."""
    script = tmp_path / "parent.py"
    pid_file = tmp_path / "child.pid"
    script.write_text(
        "import subprocess, sys\n"
        "from pipeline.htp.isolation import WindowsJob\n"
        "job = WindowsJob.create()\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "job.assign(child)\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "child.wait()\n"
    )
    parent = subprocess.Popen(
        [sys.executable, str(script)], env=dict(os.environ, PYTHONPATH=python_path())
    )
    while not pid_file.is_file() or not pid_file.read_text():
        assert parent.poll() is None, "the parent ended before starting its worker"
        time.sleep(0.05)
    child_pid = int(pid_file.read_text())
    parent.kill()
    parent.wait()
    import ctypes

    synchronize = 0x00100000
    kernel32 = ctypes.WinDLL("kernel32")  # type: ignore[attr-defined]
    handle = kernel32.OpenProcess(synchronize, False, child_pid)
    if handle:  # still there a moment: wait for the job's kill, not for a timer
        assert kernel32.WaitForSingleObject(handle, 60_000) == 0
        kernel32.CloseHandle(handle)


# -- corrupt source models ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "corrupt",
    [
        pytest.param(lambda data: b"", id="empty"),
        pytest.param(lambda data: data[: len(data) // 3], id="truncated"),
        pytest.param(lambda data: b"\x08\x07" + bytes(range(256)) * 4, id="garbage"),
        pytest.param(lambda data: data[:40] + b"\xff" * 64 + data[104:], id="overwritten"),
    ],
)
def test_corrupt_source_model_names_the_file(tmp_path: Path, corrupt) -> None:
    from release_fixtures import float_model

    from pipeline.core.errors import ModelError
    from pipeline.quantize.build import load_source_model

    path = float_model(tmp_path / "m.onnx")
    path.write_bytes(corrupt(path.read_bytes()))
    with pytest.raises(ModelError) as info:
        load_source_model(path)
    assert str(path) in info.value.message


def test_a_source_without_its_external_data_names_the_missing_file(tmp_path: Path) -> None:
    """torch.onnx's dynamo exporter writes the weights to <model>.onnx.data beside the model;
    a model copied without it is not "truncated": the error names the file to copy."""
    import onnx
    from release_fixtures import float_model

    from pipeline.core.errors import ModelError
    from pipeline.quantize.build import load_source_model

    exported = tmp_path / "export"
    exported.mkdir()
    model = onnx.load(str(float_model(tmp_path / "m.onnx")))
    onnx.save(model, str(exported / "m.onnx"), save_as_external_data=True,
              all_tensors_to_one_file=True, location="m.onnx.data", size_threshold=0)  # fmt: skip
    assert load_source_model(exported / "m.onnx") is not None  # beside it: loads
    copied = tmp_path / "copied"
    copied.mkdir()
    (copied / "m.onnx").write_bytes((exported / "m.onnx").read_bytes())
    with pytest.raises(ModelError) as info:
        load_source_model(copied / "m.onnx")
    assert "m.onnx.data" in info.value.message and str(copied) in info.value.tip


def test_a_source_whose_output_has_no_shape_field_is_loaded_as_onnxruntime_runs_it(
    tmp_path: Path,
) -> None:
    """An output typed by its element type only (and a value info of a function op's output
    so): onnxruntime runs it, the checker wanted the field. The shape inference gives is filled
    in; what it cannot give is left for preparation, and anything else is still checked."""
    import onnx
    import onnx.helper as oh

    from pipeline.core.errors import ModelError
    from pipeline.quantize.build import load_source_model

    def model(op: str) -> onnx.ModelProto:
        nodes = [oh.make_node("Relu", ["x"], ["r"]), oh.make_node(op, ["r"], ["y"])]
        graph = oh.make_graph(
            nodes,
            "bare",
            [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 8, 4, 4])],
            [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],  # no shape field
        )
        graph.value_info.append(oh.make_tensor_value_info("r", onnx.TensorProto.FLOAT, None))
        return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=8)

    for op, shape in (("Relu", [1, 8, 4, 4]), ("MeanVarianceNormalization", None)):
        path = tmp_path / f"{op}.onnx"
        onnx.save(model(op), str(path))
        loaded = load_source_model(path)
        out = loaded.graph.output[0].type.tensor_type
        if shape is None:  # inference gives none: left for preparation
            assert not out.HasField("shape")
        else:
            assert [d.dim_value for d in out.shape.dim] == shape
    broken = model("Relu")
    broken.graph.node[1].input[0] = "missing"
    onnx.save(broken, str(tmp_path / "broken.onnx"))
    with pytest.raises(ModelError, match="not a valid ONNX model") as info:
        load_source_model(tmp_path / "broken.onnx")
    # ... and whether onnxruntime can run it, which says where the fix is: in the export
    assert "onnxruntime cannot load it either" in info.value.tip


def test_a_qonnx_model_is_refused_naming_the_export_that_builds(tmp_path: Path) -> None:
    """Brevitas / FINN / hls4ml's QONNX writes its arbitrary-precision quantizers as Quant
    ops, which only qonnx executes (an MLPerf Tiny keyword spotter at 3 bits); the refusal
    names the QDQ export this pipeline builds."""
    import onnx
    import onnx.helper as oh
    from onnx import numpy_helper

    from pipeline.core.errors import ModelError
    from pipeline.quantize.build import load_source_model

    consts = [
        numpy_helper.from_array(np.array(v, np.float32), n)
        for n, v in (("scale", 0.25), ("zero", 0.0), ("bits", 3.0))
    ]
    quant = oh.make_node(
        "Quant", ["x", "scale", "zero", "bits"], ["y"], signed=1, narrow=0, rounding_mode="ROUND"
    )
    graph = oh.make_graph(
        [quant],
        "qonnx",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])],
        consts,
    )
    path = tmp_path / "qonnx.onnx"
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 11)], ir_version=6), path)
    with pytest.raises(ModelError, match="not a valid ONNX model") as info:
        load_source_model(path)
    assert "QONNX" in info.value.tip and "export_onnx_qcdq" in info.value.tip


def test_an_op_written_before_its_opset_names_the_opset_to_export_at(tmp_path: Path) -> None:
    """tf2onnx's TFLite path writes HardSwish (opset 14) into an opset-13 model, which
    onnxruntime refuses too: the tip names the op and the opset to export at."""
    import onnx
    import onnx.helper as oh

    from pipeline.core.errors import ModelError
    from pipeline.quantize.build import load_source_model

    graph = oh.make_graph(
        [oh.make_node("HardSwish", ["x"], ["y"])],
        "early",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])],
    )
    path = tmp_path / "early.onnx"
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 13)], ir_version=8), path)
    with pytest.raises(ModelError, match="HardSwish") as info:
        load_source_model(path)
    assert "from opset 14" in info.value.tip and "declares opset 13" in info.value.tip


def test_a_float16_source_onnxruntimes_full_optimization_crashes_on_builds(
    tmp_path: Path,
) -> None:
    """onnxruntime 1.31's CPU EP dies (SIGSEGV, at session creation) with all its graph
    optimizations on a float16 Transpose feeding a MatMul of a float16 constant, as an LSTM
    recogniser converted to float16 with float32 I/O has it: the quantize stage, which runs the
    source for the end-to-end and lossless checks, died with signal 11 and no report. A float16
    source runs at onnxruntime's basic level (``SourceModel.optimize``)."""
    import onnx
    import onnx.helper as oh
    from onnx import TensorProto, numpy_helper

    rng = np.random.default_rng(5)
    weight = numpy_helper.from_array(rng.standard_normal((96, 97)).astype(np.float16), "w")
    nodes = [
        oh.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16),
        oh.make_node("Transpose", ["h"], ["t"], perm=[1, 0, 2]),
        oh.make_node("MatMul", ["t", "w"], ["m"]),
        oh.make_node("Cast", ["m"], ["y"], to=TensorProto.FLOAT),
    ]
    graph = oh.make_graph(
        nodes,
        "fp16_tail",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [10, 1, 96])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10, 97])],
        [weight],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 13)], ir_version=7)
    onnx.save(model, str(tmp_path / "m.onnx"))
    # onnxruntime alone, fully optimized: the crash this guards against (in a child of its own)
    probe = subprocess.run(
        [sys.executable, "-c", "import onnxruntime as o, sys; o.InferenceSession(sys.argv[1])",
         str(tmp_path / "m.onnx")],
        capture_output=True,
    )  # fmt: skip
    config = tmp_path / "m.toml"
    config.write_text(
        '[model]\nname = "fp16tail"\nversion = "1"\nsource = "m.onnx"\n\n'
        '[calibration]\nkind = "random"\ninput = "x"\nsamples = 8\n'
    )
    done = stage_child("quantize", "--artifacts", str(tmp_path / "a"), str(config))
    assert done.returncode == 0, (probe.returncode, done.returncode, done.stderr[-2000:])
    report = json.loads((tmp_path / "a" / "build" / "fp16tail" / "report.json").read_text())
    assert report["preparation_check"]["passed"], report["preparation_check"]
    assert "float32" in report["preparation_check"]["reference"]
    assert report["end_to_end"]["samples"] > 0, report["end_to_end"]


def test_an_index_past_its_table_names_whose_fault_it_is() -> None:
    """onnxruntime's "out of data bounds": ids fed past a table are the data's fault, but a
    constant index of the graph (a tf2onnx BiLSTM unrolled over 300 steps, run at 64 tokens:
    its Gather of step 299) is a size set in [inputs] that the export fixed."""
    import onnx.helper as oh
    from onnx import TensorProto, numpy_helper

    from pipeline.core.cpu import cpu_session
    from pipeline.core.errors import ModelError

    table = numpy_helper.from_array(np.ones((8, 4), np.float32), "table")
    step = numpy_helper.from_array(np.array(9, np.int64), "step")
    nodes = [
        oh.make_node("Gather", ["table", "ids"], ["rows"], name="lookup"),
        oh.make_node("Gather", ["x", "step"], ["at_step"], name="unrolled_step", axis=1),
    ]
    graph = oh.make_graph(
        nodes,
        "indices",
        [
            oh.make_tensor_value_info("ids", TensorProto.INT64, [3]),
            oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, "steps"]),
        ],
        [
            oh.make_tensor_value_info("rows", TensorProto.FLOAT, [3, 4]),
            oh.make_tensor_value_info("at_step", TensorProto.FLOAT, [1]),
        ],
        [table, step],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 13)], ir_version=8)
    session = cpu_session(model)
    x = np.zeros((1, 4), np.float32)  # 4 steps where the graph reads step 9
    with pytest.raises(ModelError) as data_fault:
        session.run(
            None, {"ids": np.array([1, 2, 30], np.int64), "x": np.zeros((1, 12), np.float32)}
        )
    with pytest.raises(ModelError) as size_fault:
        session.run(None, {"ids": np.array([1, 2, 3], np.int64), "x": x})
    assert "the calibration data does" in data_fault.value.tip
    assert "constant of the graph" in size_fault.value.tip
