"""Calibration reader for a PP-OCR recogniser with width buckets: text lines at their own width.

Like ``ppocr_text.py`` (PaddleOCR's ``resize_norm_img``: BGR as OpenCV reads it, resized to the
model's height keeping the aspect ratio, ``(x / 255 - 0.5) / 0.5``), but nothing is padded or
squeezed: each line is yielded at its natural width, ``ceil(height * w / h)``, and the quantize
stage pads it into the smallest width bucket that holds it. A line wider than the largest bucket
is cut into consecutive tiles of that width (the last one keeps its own width), the pixels the
dynamic model would see.

Reader contract for ``[buckets]`` configs (see ``pipeline/calibration/samples.py``):
``fn(calibration_path, specs)`` yields ``{input name: array}``; ``specs`` give the largest
bucket's shapes, and the bucket dims may be any size up to those.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff"}


def natural_tiles(image: Any, height: int, max_width: int) -> list[np.ndarray]:
    """The line at ``height`` and its own width, as [1, 3, height, w <= max_width] arrays."""
    from PIL import Image

    width = max(1, math.ceil(height * image.width / image.height))
    resized = image.resize((width, height), Image.BILINEAR)
    array = np.asarray(resized, dtype=np.float32)[:, :, ::-1].transpose(2, 0, 1)  # RGB -> BGR
    array = (array / 255.0 - 0.5) / 0.5
    return [
        np.ascontiguousarray(array[np.newaxis, :, :, left : left + max_width])
        for left in range(0, width, max_width)
    ]


def read_rec_natural(
    calibration_path: Path | None, specs: list[Any]
) -> Iterator[dict[str, np.ndarray]]:
    """Each text image (sorted by name) at its natural width; long lines as several tiles."""
    from PIL import Image

    from pipeline.core.errors import CalibrationError

    spec = next(
        (
            s
            for s in specs
            if len(s.shape) == 4 and s.shape[1] == 3 and np.dtype(s.dtype).kind == "f"
        ),
        None,
    )
    if spec is None:
        raise CalibrationError("ppocr_text_buckets: no float [N, 3, H, W] image input.")
    root = Path(calibration_path) if calibration_path is not None else None
    if root is None or not root.exists():
        raise CalibrationError(f"ppocr_text_buckets: calibration.path {root} does not exist.")
    files = (
        [root]
        if root.is_file()
        else sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    )
    if not files:
        raise CalibrationError(f"ppocr_text_buckets: {root} holds no images.")
    _, _, height, max_width = spec.shape
    for path in files:
        with Image.open(path) as raw:
            image = raw.convert("RGB")
        for tile in natural_tiles(image, height, max_width):
            yield {spec.name: tile.astype(spec.dtype)}
