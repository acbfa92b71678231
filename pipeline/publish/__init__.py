"""Stage 3, ``python -m pipeline publish``: passing variants -> an immutable, verifiable release.

The entry function is ``publish_model`` (pipeline.publish.release); this module is its CLI.
"""

from __future__ import annotations

import argparse
import os
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

With --from, the build comes from the shards of a CI matrix (`python -m pipeline plan`): folders
in the artifacts layout, one per job. Shards that do not fit together (another source, config or
QDQ model than the quantize shard's) are refused, naming the shard and the digest that differs;
the rest are gathered into <artifacts>/build/<model>/ and published like a single machine's build.

examples:
  python -m pipeline publish
  python -m pipeline publish configs/example.toml --allow-partial
  python -m pipeline publish configs/example.toml --artifacts out --from shards/*
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
        "--from",
        dest="shards",
        metavar="DIR",
        type=Path,
        nargs="+",
        action="extend",
        default=[],
        help="publish from the shards in these folders (the outputs of the plan's jobs)",
    )
    parser.add_argument(
        "--sign-key",
        metavar="KEY.pem",
        type=Path,
        help="sign the manifest with this Ed25519 private key (PEM; default: $QNN_CTX_SIGN_KEY; "
        "needs the cryptography package, pip install 'qnn-ctx-pipeline[sign]')",
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
    if args.sign_key is not None:  # publish_model reads it there, whichever way it is called
        from .sign import SIGN_KEY_ENV, load_signing_key

        load_signing_key(args.sign_key)
        os.environ[SIGN_KEY_ENV] = str(args.sign_key.resolve())
    if args.shards:
        from .shards import check_folders, publish_shards

        args.shards = check_folders([c.model.name for c in configs], args.shards)
    for config in configs:
        if args.shards:
            result = publish_shards(
                config,
                args.shards,
                args.artifacts,
                allow_partial=args.allow_partial,
                cpu_fallback=not args.no_cpu_fallback,
            )
        else:
            result = publish_model(
                config,
                args.artifacts,
                allow_partial=args.allow_partial,
                cpu_fallback=not args.no_cpu_fallback,
            )
        print(result.summary_line())
    return 0
