"""Handwriting-like digit images for MNIST-style classifiers (28x28, white digit on black).

SYNTHETIC DATA: ../shared/calibration holds no digit images, and the nearest real data (text
crops) are dark glyphs on light paper, the negative of what an MNIST model saw in training: every
crop lands on one class with probability 1.0, so accuracy measured on them says nothing. These
images are rendered instead, the way MNIST was made: one digit, centred by its mass in a 20x20
box inside 28x28, in a stroke font (Pillow's bundled one, so nothing is downloaded), with random
size, slant, rotation, stroke width and blur, so every class and a spread of confidences occur.

Reader contract (``pipeline/calibration/samples.py``): ``fn(calibration_path, specs)`` yields
``{input name: array}``; the path is not read.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

SAMPLES = 40
SEED = 20261122


def _digit(rng: np.random.Generator, digit: int) -> np.ndarray:
    """One 28x28 image, values 0..255 (0 = background), MNIST's geometry."""
    canvas = Image.new("L", (64, 64), 0)
    draw = ImageDraw.Draw(canvas)
    font = ImageFont.load_default(int(rng.integers(34, 46)))
    draw.text(
        (32, 32),
        str(digit),
        fill=255,
        font=font,
        anchor="mm",
        stroke_width=int(rng.integers(1, 4)),
        stroke_fill=255,
    )
    shear = float(rng.uniform(-0.3, 0.3))
    canvas = canvas.transform(
        canvas.size, Image.Transform.AFFINE, (1, shear, -shear * 32, 0, 1, 0), Image.BILINEAR
    )
    canvas = canvas.rotate(float(rng.uniform(-15, 15)), Image.BILINEAR)
    canvas = canvas.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.3, 1.2))))
    box = canvas.getbbox()
    if box is None:
        return np.zeros((28, 28), np.float32)
    glyph = canvas.crop(box)
    scale = 20.0 / max(glyph.size)
    glyph = glyph.resize(
        (max(1, round(glyph.width * scale)), max(1, round(glyph.height * scale))), Image.LANCZOS
    )
    pixels = np.asarray(glyph, np.float32)
    total = pixels.sum() or 1.0
    rows, cols = np.indices(pixels.shape)
    centre_row = (rows * pixels).sum() / total
    centre_col = (cols * pixels).sum() / total
    image = np.zeros((28, 28), np.float32)
    top = round(14 - centre_row)
    left = round(14 - centre_col)
    top = min(max(top, 0), 28 - pixels.shape[0])
    left = min(max(left, 0), 28 - pixels.shape[1])
    image[top : top + pixels.shape[0], left : left + pixels.shape[1]] = pixels
    return image


def read_digits(calibration_path: Path | None, specs: list[Any]) -> Iterator[dict[str, Any]]:
    """``SAMPLES`` digit images, every class in turn, shaped and typed as the model's input."""
    del calibration_path  # synthetic: nothing is read
    spec = specs[0]
    rng = np.random.default_rng(SEED)
    for index in range(SAMPLES):
        image = _digit(rng, index % 10)
        yield {spec.name: image.reshape(spec.shape).astype(spec.dtype)}
