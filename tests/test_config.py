"""Config parsing: every bad key, type and path gets a message naming the file, key and fix."""

from __future__ import annotations

import dataclasses
import re
import tomllib
import typing
from pathlib import Path

import pytest
from venvs import REPO_ROOT

from pipeline.core.config import ModelConfig, load_config
from pipeline.core.errors import ConfigError, ToolchainError
from qnn_ctx_runtime.errors import UsageError
from qnn_ctx_runtime.targets import get_target
from qnn_ctx_runtime.toolchains import load_toolchains

MINIMAL = """
[model]
name = "m"
source = "m.onnx"
[calibration]
kind = "random"
"""


def write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "m.onnx").write_bytes(b"x")
    path = tmp_path / "cfg.toml"
    path.write_text(text)
    return path


def test_minimal_config_gets_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, MINIMAL))
    assert config.model.name == "m"
    assert config.source_path == tmp_path / "m.onnx"
    assert config.quantization.activation_type == "uint16"
    assert config.compile.targets == ["snapdragon-x-elite"]


def test_digest_changes_with_any_setting(tmp_path: Path) -> None:
    a = load_config(write(tmp_path, MINIMAL))
    b = load_config(write(tmp_path, MINIMAL + "samples = 3\n"))
    assert a.digest() != b.digest()
    assert a.digest() == load_config(write(tmp_path, MINIMAL)).digest()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("[quantization]\nactivaton_type = 'uint8'\n", "did you mean 'activation_type'"),
        ("[quantization]\nactivation_type = 'uint9'\n", "quantization.activation_type = 'uint9'"),
        ("[quantization]\nper_channel = 'yes'\n", "must be true or false"),
        ("[compile]\nmax_partitions = 1.5\n", "compile.max_partitions must be an integer"),
        ("[inputs]\ndims = { batch = 0 }\n", "inputs.dims.batch = 0 must be in [1, 2147483647]"),
        ("[compile]\ntargets = []\n", "compile.targets is empty"),
        ("[calibrations]\nkind = 'random'\n", "did you mean 'calibration'"),
    ],
)
def test_bad_values_name_key_and_file(tmp_path: Path, extra: str, message: str) -> None:
    path = write(tmp_path, MINIMAL + extra)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_held_out_range(tmp_path: Path) -> None:
    text = MINIMAL.replace('kind = "random"', 'kind = "random"\nheld_out = 1.0')
    with pytest.raises(ConfigError, match=r"held_out = 1.0 must be in \[0, 1\)"):
        load_config(write(tmp_path, text))


def test_missing_model_file_names_path(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL.replace("m.onnx", "absent.onnx"))
    with pytest.raises(ConfigError, match=r"absent\.onnx does not exist"):
        load_config(path)


def test_missing_calibration_folder(tmp_path: Path) -> None:
    text = MINIMAL.replace('kind = "random"', 'kind = "tensors"\npath = "nowhere"')
    with pytest.raises(ConfigError, match=r"calibration\.path .*nowhere does not exist"):
        load_config(write(tmp_path, text))


def test_invalid_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(write(tmp_path, "[model\n"))


def test_unknown_target_lists_known_ones() -> None:
    with pytest.raises(UsageError) as info:
        get_target("snapdragon-x-elit")
    assert "did you mean 'snapdragon-x-elite'" in str(info.value).lower()
    assert "snapdragon-8-gen-3" in str(info.value)


def test_pins_are_consistent() -> None:
    pins = load_toolchains()
    assert pins.default in pins.pinned
    assert pins.get("2.7.0").qnn_sdk == "2.51.0"
    # FACTS §2: 2.3.0 falls back to CPU with onnxruntime >= 1.28; the pin must avoid that.
    ort_230 = tuple(int(x) for x in pins.get("2.3.0").onnxruntime.split(".")[:2])
    assert ort_230 < (1, 28)
    with pytest.raises(ToolchainError, match="not pinned"):
        pins.get("9.9.9")
    # Known releases without a verified onnxruntime are not pins either.
    assert "2.6.0" in pins.known and "2.6.0" not in pins.pinned
    with pytest.raises(ToolchainError, match="not pinned"):
        pins.get("2.6.0")


# -- every problem of a file in one error ---------------------------------------------------------

SEVERAL = """
[model]
name = "m"
source = "m.onnx"
[calibration]
kind = "random"
held_out = 1.5
seed = -1
[calibration.image]
size = [0, 0]
[calibration.audio]
window = 0
[quantization]
activaton_type = "uint8"
"""

SEVERAL_MESSAGES = [
    "unknown key [quantization] 'activaton_type'; did you mean 'activation_type'?",
    "calibration.held_out = 1.5 must be in [0, 1)",
    "calibration.seed = -1 must be >= 0",
    "calibration.image.size = [0, 0] must hold values in [1, 16384]",
    "calibration.audio.window = 0 must be in [1, 16777216]",
]


def test_every_problem_of_a_file_is_in_one_error(tmp_path: Path) -> None:
    path = write(tmp_path, SEVERAL)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert f"{path} has {len(SEVERAL_MESSAGES)} problems" in message
    for expected in SEVERAL_MESSAGES:
        assert expected in message


def test_a_wrong_type_does_not_hide_the_other_problems(tmp_path: Path) -> None:
    """A wrongly typed key is one more problem; the value rules of the other keys still run."""
    path = write(tmp_path, SEVERAL + "per_channel = 'yes'\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "quantization.per_channel must be true or false, got 'yes'" in message
    for expected in SEVERAL_MESSAGES:
        assert expected in message


def test_several_wrong_types_are_all_reported(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        MINIMAL + "samples = 'many'\n[quantization]\nper_channel = 'yes'\n"
        "[compile]\nmax_partitions = 1.5\n",
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert f"{path} has 3 problems" in message
    assert "calibration.samples must be an integer, got 'many'" in message
    assert "quantization.per_channel must be true or false" in message
    assert "compile.max_partitions must be an integer" in message


# -- rules the restructure added ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../x", "/abs/dir", "a/b", "..", ".hidden", ""])
def test_model_name_must_be_a_safe_folder_name(tmp_path: Path, name: str) -> None:
    path = write(tmp_path, MINIMAL.replace('name = "m"', f"name = {name!r}"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert f"model.name = {name!r} must be a safe folder name" in message
    assert str(path) in message
    assert "--artifacts" in (info.value.tip or "")


def test_model_version_must_be_a_safe_folder_name(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL.replace('name = "m"', 'name = "m"\nversion = "../1.0"'))
    with pytest.raises(ConfigError, match=r"model\.version = '\.\./1\.0' must be a safe folder"):
        load_config(path)


def test_safe_names_are_accepted(tmp_path: Path) -> None:
    text = MINIMAL.replace('name = "m"', 'name = "ppocr_rec-v2.1+x"\nversion = "1.0.0-rc1"')
    assert load_config(write(tmp_path, text)).model.name == "ppocr_rec-v2.1+x"


def test_unknown_compile_target_is_a_config_error(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + '[compile]\ntargets = ["snapdragon-x-elit"]\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "compile.targets names 'snapdragon-x-elit', not a known chip" in message
    assert "did you mean 'snapdragon-x-elite'?" in message
    assert str(path) in message
    assert "snapdragon-8-gen-3" in (info.value.tip or "")


@pytest.mark.parametrize("version", ["2.6.0", "9.9.9"])
def test_unpinned_compile_toolchain_is_a_config_error(tmp_path: Path, version: str) -> None:
    path = write(tmp_path, MINIMAL + f'[compile]\ntoolchains = ["2.7.0", "{version}"]\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert f"compile.toolchains names {version!r}, which is not pinned" in message
    assert "2.7.0" in message.split("pinned:")[-1]
    assert str(path) in message
    assert "'2.7.0'" not in message  # the pinned one is fine


def test_pinned_toolchains_and_known_targets_load(tmp_path: Path) -> None:
    pins = load_toolchains()
    text = MINIMAL + (
        '[compile]\ntargets = ["snapdragon-x-elite", "snapdragon-8-gen-3"]\n'
        f"toolchains = {list(pins.pinned)!r}\n"
    )
    config = load_config(write(tmp_path, text))
    assert config.compile.toolchains == list(pins.pinned)


def test_quantize_digest_follows_only_what_quantize_reads(tmp_path: Path) -> None:
    base = load_config(write(tmp_path, MINIMAL))
    renamed = load_config(
        write(tmp_path, MINIMAL.replace('name = "m"', 'name = "m"\nversion = "2.0.0"'))
    )
    compiled = load_config(write(tmp_path, MINIMAL + "[compile]\nmax_partitions = 2\n"))
    recalibrated = load_config(write(tmp_path, MINIMAL + "samples = 3\n"))
    assert renamed.quantize_digest() == compiled.quantize_digest() == base.quantize_digest()
    assert renamed.digest() != base.digest() and compiled.digest() != base.digest()
    assert recalibrated.quantize_digest() != base.quantize_digest()


def test_gray_images_take_the_default_mean_and_std(tmp_path: Path) -> None:
    """The defaults are one value for every channel, so a GRAY config needs none of its own;
    a wrong count says what was given and what the channel order takes."""
    gray = "[calibration.image]\nchannel_order = 'GRAY'\n"
    config = load_config(write(tmp_path, MINIMAL.replace("[calibration]", gray + "[calibration]")))
    assert config.calibration.image.mean == [0.0] and config.calibration.image.std == [1.0]
    two = "[calibration.image]\nchannel_order = 'GRAY'\nmean = [0.5, 0.5]\n"
    with pytest.raises(ConfigError, match=r"mean has 2 values; channel_order = 'GRAY' takes 1\."):
        load_config(write(tmp_path, MINIMAL.replace("[calibration]", two + "[calibration]")))


def _keys(cls: type, prefix: str = "") -> list[str]:
    """Every leaf key of a config section, dotted (``calibration.audio.window_fn``)."""
    hints = typing.get_type_hints(cls)
    found: list[str] = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("toml", True) is False:  # the config file's own path
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            found += _keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            found.append(prefix + f.name)
    return found


def test_readme_example_names_every_key() -> None:
    """The README's config example promises every key with its default: a key added to the
    config without a line there fails here, so users writing a config from the README see it."""
    readme = (REPO_ROOT / "README.md").read_text("utf-8")
    start = readme.index("## Model configs")
    block = readme[start : readme.index("\n## ", start + 1)]
    example = re.search(r"```toml\n(.*?)```", block, re.DOTALL)
    assert example, "README.md's Model configs section has no ```toml example"
    parsed = tomllib.loads(example.group(1))

    def present(key: str) -> bool:
        table: object = parsed
        for part in key.split("."):
            if not isinstance(table, dict) or part not in table:
                return False
            table = table[part]
        return True

    keys = _keys(ModelConfig)
    assert len(keys) > 40, keys  # the walk found the sections' keys, not nothing
    missing = [k for k in keys if not present(k)]
    assert not missing, f"README.md's config example lacks {missing}"
