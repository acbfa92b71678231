"""``python -m pipeline example``: (re)generate the bundled examples (pipeline.example_models).

numpy is imported in ``run()`` only: every command builds this stage's parser.
"""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = """\
Generate the bundled example model and its calibration data (deterministic, seeded).

Writes artifacts/example/example_cnn.onnx and artifacts/example/calibration/*.npy, which
configs/example.toml points at. `python -m pipeline quantize` with no config does this itself.
Also writes the bucketed example of configs/example_buckets.toml: a causal sequence model with a
dynamic length, artifacts/example/example_seq.onnx, and latents of varied length in
artifacts/example/seq_calibration/.
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", type=Path, default=Path("."), help="project root")
    parser.add_argument("--force", action="store_true", help="regenerate even if present")


def run(args: argparse.Namespace) -> int:
    from .example_models import ensure_bucket_example, ensure_example

    folder = ensure_example(args.root, force=args.force)
    ensure_bucket_example(args.root, force=args.force)
    print(f"example written to {folder}")
    return 0
