"""Calibration readers for PP-OCR text-line models (direction classifier and recogniser).

PaddleOCR feeds these models detected text-line crops prepared by ``resize_norm_img``
(``tools/infer/predict_cls.py`` / ``predict_rec.py`` in PaddleOCR and in
Kazuhito00/PaddleOCR-ONNX-Sample, which the models come from):

- the crop is used as OpenCV reads it: BGR channel order;
- it is resized to the model's full height; the width follows the aspect ratio,
  ``ceil(height * w / h)``, but is capped at the model's width (a very long line is squeezed,
  not shrunk in height);
- values become ``(x / 255 - 0.5) / 0.5`` in [-1, 1], and the width is padded on the right
  with zeros up to the model's width.

The built-in ``images`` kind cannot express "fit the height, cap the width" (its ``pad`` mode
keeps the aspect ratio on both axes, which turns a 23:1 line into a few pixel rows), hence
this reader. The classifier exists to catch upside-down lines, so ``read_cls`` also yields each
crop rotated by 180 degrees. The recogniser is dynamic in width upstream (PaddleOCR widens the
batch to its widest line instead of squeezing it); at a fixed width the faithful equivalent is
to cut a long line, resized to the model's height, into consecutive width-wide tiles, which is
what ``read_rec`` does (the last tile is zero-padded like any short line).

Reader contract (see ``pipeline/calibration/samples.py``): ``fn(calibration_path, specs)`` yields
``{input name: array}`` at the model's static shape and dtype.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff"}


def resize_norm(image: Any, height: int, width: int) -> np.ndarray:
    """PaddleOCR's ``resize_norm_img`` for a PIL RGB image: a float32 [3, height, width] array."""
    from PIL import Image

    ratio = image.width / image.height
    resized_w = min(width, max(1, math.ceil(height * ratio)))
    resized = image.resize((resized_w, height), Image.BILINEAR)
    array = np.asarray(resized, dtype=np.float32)[:, :, ::-1]  # RGB -> BGR, as cv2 reads it
    array = (array / 255.0 - 0.5) / 0.5
    padded = np.zeros((3, height, width), dtype=np.float32)
    padded[:, :, :resized_w] = array.transpose(2, 0, 1)
    return padded


def line_tiles(image: Any, height: int, width: int) -> list[np.ndarray]:
    """The line resized to ``height`` at its own aspect ratio, cut into [3, height, width] tiles."""
    from PIL import Image

    resized_w = max(1, math.ceil(height * image.width / image.height))
    resized = image.resize((resized_w, height), Image.BILINEAR)
    array = np.asarray(resized, dtype=np.float32)[:, :, ::-1].transpose(2, 0, 1)
    array = (array / 255.0 - 0.5) / 0.5
    tiles = []
    for left in range(0, resized_w, width):
        tile = np.zeros((3, height, width), dtype=np.float32)
        chunk = array[:, :, left : left + width]
        tile[:, :, : chunk.shape[2]] = chunk
        tiles.append(tile)
    return tiles


def _image_input(specs: list[Any]) -> Any:
    """The one float NCHW input with 3 channels."""
    for spec in specs:
        if np.dtype(spec.dtype).kind == "f" and len(spec.shape) == 4 and spec.shape[1] == 3:
            return spec
    from pipeline.core.errors import CalibrationError

    described = ", ".join(f"{s.name} {list(s.shape)} {np.dtype(s.dtype)}" for s in specs)
    raise CalibrationError(
        f"ppocr_text: no float [N, 3, H, W] image input among the model inputs ({described}).",
        tip="Fix the input shape in [inputs] (e.g. shapes = { x = [1, 3, 48, 192] }).",
    )


def _images(calibration_path: Path | None) -> list[Path]:
    from pipeline.core.errors import CalibrationError

    root = Path(calibration_path) if calibration_path is not None else None
    if root is None or not root.exists():
        raise CalibrationError(
            f"ppocr_text needs calibration.path to point at text-line images (got {root}).",
            tip="Set calibration.path to a folder of cropped text lines.",
        )
    files = (
        [root]
        if root.is_file()
        else sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    )
    if not files:
        raise CalibrationError(f"ppocr_text: {root} holds no images.")
    return files


def read_lines(
    calibration_path: Path | None,
    specs: list[Any],
    rotations: tuple[int, ...] = (0,),
    tile: bool = False,
) -> Iterator[dict[str, np.ndarray]]:
    """Samples per image and rotation (degrees): one squeezed line, or its tiles with ``tile``."""
    from PIL import Image

    spec = _image_input(specs)
    batch, _, height, width = spec.shape
    rows: list[np.ndarray] = []
    for path in _images(calibration_path):
        with Image.open(path) as raw:
            image = raw.convert("RGB")
        for angle in rotations:
            turned = image.rotate(angle) if angle else image
            arrays = (
                line_tiles(turned, height, width) if tile else [resize_norm(turned, height, width)]
            )
            for array in arrays:
                rows.append(array)
                if len(rows) == batch:
                    yield {spec.name: np.stack(rows).astype(spec.dtype)}
                    rows = []


def read_rec(calibration_path: Path | None, specs: list[Any]) -> Iterator[dict[str, np.ndarray]]:
    """Recogniser: each text image once, long lines as several full-height tiles."""
    return read_lines(calibration_path, specs, tile=True)


def read_cls(calibration_path: Path | None, specs: list[Any]) -> Iterator[dict[str, np.ndarray]]:
    """Direction classifier: each text image upright and upside down."""
    return read_lines(calibration_path, specs, rotations=(0, 180))
