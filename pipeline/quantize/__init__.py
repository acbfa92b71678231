"""Stage 1, ``python -m pipeline quantize``: float ONNX -> static float models -> QDQ models.

The entry function is ``quantize_model`` (pipeline.quantize.build); this module is its CLI.
"""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = """\
Prepare float ONNX models for the NPU and quantize them to QDQ.

For each config: fix every shape (one static graph per [buckets] shape, or the one [inputs]
gives), fold constants and `If`s on baked inputs, fold BatchNorm, upcast float16, apply exact
HTP-friendly rewrites, run onnxruntime's QNN preprocessing, calibrate on real data (streamed,
bounded memory; one set of ranges for every bucket), write the QDQ models and a report comparing
them with the float and the source model on held-out samples. With no config, builds the
bundled examples (generated from a seed first if needed).

examples:
  python -m pipeline quantize
  python -m pipeline quantize configs/shared/*.toml
  python -m pipeline quantize configs/example.toml --force
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("configs", nargs="*", type=Path, help="model configs (TOML)")
    parser.add_argument("--artifacts", type=Path, default=Path("artifacts"), help="output root")
    parser.add_argument("--force", action="store_true", help="rebuild even if nothing changed")


def run(args: argparse.Namespace) -> int:
    from ..core.config import EXAMPLE_CONFIGS, load_config
    from ..core.errors import GateError
    from .reuse import reused

    configs = list(args.configs)
    if not configs:
        from ..example_models import ensure_bucket_example, ensure_example

        ensure_example(Path("."))
        ensure_bucket_example(Path("."))
        configs = list(EXAMPLE_CONFIGS)
    loaded = [load_config(path) for path in configs]  # every config is checked before any work
    failures: list[str] = []
    for config in loaded:
        try:
            # Asked first without the builder: numpy and onnx are imported for a changed model only.
            result = None if args.force else reused(config, args.artifacts)
            if result is None:
                from .build import quantize_model

                result = quantize_model(config, args.artifacts, force=args.force)
        except GateError as exc:
            print(f"FAILED {config.model.name}: {exc}")
            failures.append(config.model.name)
            continue
        print(result.summary_line(config.quantization.target_snr_db))
    if failures:
        raise GateError(f"{len(failures)} model(s) failed their gate: {', '.join(failures)}.")
    return 0
