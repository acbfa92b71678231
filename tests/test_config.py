"""Config parsing: every bad key, type and path gets a message naming the file, key and fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.errors import ConfigError, ToolchainError
from pipeline.targets import get_target
from pipeline.toolchains import load_pins

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
        ("[inputs]\ndims = { batch = 0 }\n", "inputs.dims.batch = 0 must be > 0"),
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
    with pytest.raises(ConfigError) as info:
        get_target("snapdragon-x-elit")
    assert "did you mean 'snapdragon-x-elite'" in str(info.value).lower()
    assert "snapdragon-8-gen-3" in str(info.value)


def test_pins_are_consistent() -> None:
    pins = load_pins()
    assert pins.default in pins.toolchains
    assert pins.get("2.7.0").qnn_sdk == "2.51.0"
    # FACTS §2: 2.3.0 falls back to CPU with onnxruntime >= 1.28; the pin must avoid that.
    ort_230 = tuple(int(x) for x in pins.get("2.3.0").onnxruntime.split(".")[:2])
    assert ort_230 < (1, 28)
    with pytest.raises(ToolchainError, match="not pinned"):
        pins.get("9.9.9")
