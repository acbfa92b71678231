"""Stage 3, ``python -m pipeline publish``: passing variants -> an immutable, verifiable release.

The entry function is ``publish_model`` (pipeline.publish.release); this module is its CLI.
"""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = """\
Publish the variants that passed their gates as an immutable, versioned release.

For each config, collects <artifacts>/build/<model>/ctx/<toolchain>/<target>/ for every
configured target and toolchain, proves each was compiled from the current QDQ models (and
those from the current source model and config), and writes
<artifacts>/releases/<model>/<version>/ with manifest.json, one folder per variant (named after
target and QNN SDK), the QDQ model for explicit CPU fallback, and <model>-<version>.tar.gz with
its .sha256. Publishing the same content again does nothing; different content under an existing
version is refused: bump model.version. With no config, publishes the bundled examples.

examples:
  python -m pipeline publish
  python -m pipeline publish configs/example.toml --allow-partial
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("configs", nargs="*", type=Path, help="model configs (TOML)")
    parser.add_argument("--artifacts", type=Path, default=Path("artifacts"), help="artifacts root")
    parser.add_argument(
        "--allow-partial",
        action="store_true",
        help="also publish variants that failed a gate, marked passed=false in the manifest",
    )
    parser.add_argument(
        "--no-cpu-fallback",
        action="store_true",
        help="leave the QDQ model (the CPU fallback) out of the release",
    )


def run(args: argparse.Namespace) -> int:
    from ..core.config import EXAMPLE_CONFIGS, load_config
    from .release import publish_model

    configs = [load_config(path, check_files=False) for path in args.configs or EXAMPLE_CONFIGS]
    for config in configs:
        result = publish_model(
            config,
            args.artifacts,
            allow_partial=args.allow_partial,
            cpu_fallback=not args.no_cpu_fallback,
        )
        print(result.summary_line())
    return 0
