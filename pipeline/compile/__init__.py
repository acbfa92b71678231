"""Stage 2, ``python -m pipeline compile``: QDQ models -> QNN EP-context variants.

The entry function is ``compile_model`` (pipeline.compile.build); this module is its CLI.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

HELP = """\
Compile QDQ models into QNN EP-context models for each target chip and pinned QNN toolchain.

Reads <artifacts>/build/<model>/record.json and buckets/<bucket>/{qdq,float}.onnx and heldout/
(from `nox -s quantize`). For every target in compile.targets, with the onnxruntime-qnn installed
in this interpreter: compiles every bucket with onnxruntime's ModelCompiler
(ERROR_IF_NO_NODES_COMPILED; several buckets share one weight-shared context), proves QNN compiled
it (EPContext nodes, ep_sdk_version = the pinned SDK, ep_compatibility_info = the requested
soc/arch), measures coverage (QNN partitions, nodes left on CPU), validates the ctx models on the
HTP simulator against the QDQ and float models on held-out samples, and times session creation
QDQ (online compile) vs ctx. Each variant runs in a child process with compile.timeout_s per
bucket, so a native abort or a hang is reported and the other variants still build.

Writes <artifacts>/build/<model>/ctx/<onnxruntime-qnn>/<target>/ with the ctx models (+ a .bin
when compile.embed = false or the buckets share one), variant.json and compile.log, and
<artifacts>/build/<model>/ctx/report.md + report.json over all toolchains. A variant whose
inputs did not change is skipped. Exits non-zero if any variant failed.

examples:
  python -m pipeline compile configs/example.toml
  python -m pipeline compile --toolchain 2.5.0 configs/example.toml   (in a 2.5.0 environment)
  nox -s "compile_ctx(qnn='2.5.0')"
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "configs", nargs="*", type=Path, help="model configs (default: the bundled examples)"
    )
    parser.add_argument(
        "--toolchain",
        metavar="VERSION",
        help="onnxruntime-qnn pin to build, e.g. 2.7.0; it must be the one installed here. "
        "Configs whose compile.toolchains do not include it are skipped. Default: the installed "
        "onnxruntime-qnn, which must be pinned.",
    )
    parser.add_argument("--artifacts", type=Path, default=Path("artifacts"), help="output root")
    parser.add_argument("--force", action="store_true", help="rebuild even if nothing changed")
    parser.add_argument(
        "--log-severity",
        type=int,
        default=2,
        choices=range(5),
        help="onnxruntime log level in the child (0 verbose .. 3 error); default 2",
    )


def run(args: argparse.Namespace) -> int:
    from qnn_ctx_runtime import qnn
    from qnn_ctx_runtime.toolchains import load_toolchains

    from ..core.config import EXAMPLE_CONFIGS, load_config
    from .build import resolve_toolchain, variants_to_build
    from .child import spare_workers

    table = load_toolchains()
    # Every config is checked (targets, pinned toolchains) before any work.
    configs = [load_config(p, check_files=False) for p in (args.configs or EXAMPLE_CONFIGS)]
    installed = qnn.installed_qnn()
    toolchain = resolve_toolchain(table, args.toolchain, installed)
    print(
        f"Compiling with onnxruntime-qnn {toolchain.onnxruntime_qnn} (QNN SDK "
        f"{toolchain.qnn_sdk}) and onnxruntime {installed.onnxruntime}",
        flush=True,
    )
    wanted = sum(
        variants_to_build(c, args.artifacts, table, toolchain, installed, args.force)
        for c in configs
    )
    # A worker per variant to build: the first starts now, warming up while this process goes on.
    with spare_workers(args.artifacts, wanted):
        return _compile_all(args, table, configs, toolchain, installed)


def _compile_all(
    args: argparse.Namespace, table: Any, configs: list[Any], toolchain: Any, installed: Any
) -> int:
    from ..core.errors import CompileError, GateError
    from .build import compile_model
    from .report import describe

    failed = []
    for config in configs:
        built = compile_model(
            config,
            args.artifacts,
            table,
            toolchain,
            installed,
            force=args.force,
            log_severity=args.log_severity,
        )
        failed += [b for b in built if not b.record.passed]
    if failed:
        lines = [describe(b.record, b.skipped) for b in failed]
        crashed = any(b.record.status != "ok" for b in failed)
        error = CompileError if crashed else GateError
        raise error(
            f"{len(failed)} variant(s) failed:\n  " + "\n  ".join(lines),
            tip="Details per variant are in <artifacts>/build/<model>/ctx/report.md and each "
            "variant's compile.log.",
        )
    return 0
