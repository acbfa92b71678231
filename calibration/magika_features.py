"""Calibration reader for Magika (google/magika) file-type models: files -> int32 byte features.

Magika's model does not see a file but a fixed feature vector built from its first and last
bytes. Calibrating on anything else (random ints, raw file prefixes) gives activation ranges the
model never meets in use, so this reader re-implements the extraction of the upstream Python
package (``Magika._extract_features_from_seekable`` in ``python/src/magika/magika.py``, feature
extraction v2) with the values of ``assets/models/standard_v3_3/config.min.json``:

- read at most ``block_size`` bytes from the start and from the end of the file;
- ``lstrip()`` the start block and ``rstrip()`` the end block (ASCII whitespace: space, \\t,
  \\n, \\r, \\x0b, \\x0c), so leading/trailing blank lines do not shift the content;
- keep the first ``beg_size`` bytes of the start block, padded *after* with ``padding_token``,
  and the last ``end_size`` bytes of the end block, padded *before* with ``padding_token``;
- the model input is ``beg + end`` as int32, ``[batch, beg_size + end_size]``.

Magika never runs the model on files shorter than ``min_file_size_for_dl`` bytes, nor on files
whose stripped start block is shorter than that (it answers txt/unknown from the bytes instead),
so such files are skipped here as well: they are not inputs the model gets in production.

Reader contract (see ``pipeline/calibration/samples.py``): ``read_samples(calibration_path, specs)``
yields ``{input name: array}`` at the model's static shape and dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# bytes.strip() with no argument removes exactly these (ASCII whitespace).
WHITESPACE = b" \t\n\r\x0b\x0c"


@dataclass(frozen=True)
class FeatureConfig:
    """The feature-extraction settings of one Magika model (its ``config.min.json``)."""

    beg_size: int = 1024
    end_size: int = 1024
    block_size: int = 4096
    padding_token: int = 256
    min_file_size_for_dl: int = 8

    @property
    def size(self) -> int:
        return self.beg_size + self.end_size


# google/magika assets/models/standard_v3_3/config.min.json (mid_size 0, no offset features).
STANDARD_V3_3 = FeatureConfig()


def features_from_blocks(
    head: bytes, tail: bytes, config: FeatureConfig = STANDARD_V3_3
) -> np.ndarray:
    """Features from the first and last ``block_size`` bytes of a file (the same block if short)."""
    beg = head.lstrip(WHITESPACE)[: config.beg_size]
    end = tail.rstrip(WHITESPACE)
    end = end[max(0, len(end) - config.end_size) :]
    features = np.full(config.size, config.padding_token, dtype=np.int32)
    features[: len(beg)] = np.frombuffer(beg, dtype=np.uint8)
    features[config.size - len(end) :] = np.frombuffer(end, dtype=np.uint8)
    return features


def features_from_bytes(content: bytes, config: FeatureConfig = STANDARD_V3_3) -> np.ndarray:
    """Features of an in-memory file."""
    block = min(config.block_size, len(content))
    return features_from_blocks(content[:block], content[len(content) - block :], config)


def features_from_file(path: Path, config: FeatureConfig = STANDARD_V3_3) -> np.ndarray | None:
    """Features of a file, reading only its two end blocks; None when Magika skips the model."""
    with open(path, "rb") as handle:
        size = handle.seek(0, 2)
        if size < config.min_file_size_for_dl:
            return None
        block = min(config.block_size, size)
        handle.seek(0)
        head = handle.read(block)
        handle.seek(size - block)
        tail = handle.read(block)
    features = features_from_blocks(head, tail, config)
    if not uses_model(features, config):
        return None
    return features


def uses_model(features: np.ndarray, config: FeatureConfig = STANDARD_V3_3) -> bool:
    """Magika's rule: padding already at byte ``min_file_size_for_dl`` means too few real bytes."""
    return int(features[config.min_file_size_for_dl - 1]) != config.padding_token


def list_files(root: Path) -> list[Path]:
    """Every regular file under ``root`` (recursively), in a stable order."""
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file())


def _feature_input(specs: list[Any], config: FeatureConfig) -> Any:
    """The model input that takes the byte features: integer, last dim = beg + end."""
    for spec in specs:
        if np.dtype(spec.dtype).kind in "iu" and spec.shape and spec.shape[-1] == config.size:
            return spec
    from pipeline.core.errors import CalibrationError

    described = ", ".join(f"{s.name} {list(s.shape)} {np.dtype(s.dtype)}" for s in specs)
    raise CalibrationError(
        f"magika_features: no model input takes {config.size} integer byte features "
        f"(inputs: {described}).",
        tip="This reader is for Magika standard_v3_3-style models ([batch, 2048] int32).",
    )


def read_samples(
    calibration_path: Path | None,
    specs: list[Any],
    config: FeatureConfig = STANDARD_V3_3,
) -> Iterator[dict[str, np.ndarray]]:
    """Calibration reader: one sample per ``batch`` files that Magika would run the model on."""
    from pipeline.core.errors import CalibrationError

    if calibration_path is None or not Path(calibration_path).exists():
        raise CalibrationError(
            f"magika_features needs calibration.path to point at a folder of files "
            f"(got {calibration_path}).",
            tip="Set calibration.path to a folder of sample files of the types to recognise.",
        )
    spec = _feature_input(specs, config)
    batch = spec.shape[0] if len(spec.shape) == 2 else 1
    rows: list[np.ndarray] = []
    for path in list_files(Path(calibration_path)):
        features = features_from_file(path, config)
        if features is None:
            continue
        rows.append(features)
        if len(rows) == batch:
            array = np.stack(rows).reshape(spec.shape).astype(spec.dtype)
            rows = []
            yield {spec.name: array}
