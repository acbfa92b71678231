"""``python -m pipeline <stage>``: the only place that prints errors and picks exit codes."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from .core.errors import PipelineError
from .core.fileio import check_writable_folder, describe_os_error

# stage name -> module; each module has HELP, configure(parser) and run(args) -> int, and keeps
# heavy imports inside run() so that building this parser stays cheap.
STAGES = {
    "example": "pipeline.example",
    "quantize": "pipeline.quantize",
    "compile": "pipeline.compile",
    "publish": "pipeline.publish",
    "plan": "pipeline.plan",
    "doctor": "pipeline.doctor",
}

DESCRIPTION = """\
Build QNN EP-context models for Snapdragon NPUs from float ONNX models.

The stages run in order, each in its own environment (see noxfile.py):
  quantize  float ONNX -> static, NPU-friendly graph -> calibrated QDQ model + accuracy report
  compile   QDQ -> EP-context model per target chip and pinned QNN toolchain, with coverage,
            validation on the HTP simulator and a load benchmark
  publish   passing variants -> immutable, versioned release with manifest and checksums
            (--from DIR ...: from the shards of separate CI jobs, proven to fit together)
  plan      the build as a matrix of CI jobs (quantize per model, compile per model x
            toolchain, publish per model), as a table or GitHub Actions matrix JSON
  doctor    check this machine for the known barriers (version pairs, CPU fallback, paths)
  example   (re)generate the bundled example model and its calibration data
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="stage", metavar="STAGE")
    for name, module_name in STAGES.items():
        module = importlib.import_module(module_name)
        stage = sub.add_parser(
            name,
            help=module.HELP.splitlines()[0],
            description=module.HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.configure(stage)
        stage.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        if getattr(args, "artifacts", None) is not None:
            check_writable_folder(args.artifacts)  # a file, read-only: said before any work
        return int(args.run(args) or 0)
    except PipelineError as exc:
        print(f"\nERROR: {exc.message}", file=sys.stderr)
        if exc.tip:
            print(f"TIP: {exc.tip}", file=sys.stderr)
        return 1
    except OSError as exc:  # the disk filled up, a folder turned read-only, ... mid-run
        message, tip = describe_os_error(exc)
        print(f"\nERROR: {message}\nTIP: {tip}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nInterrupted; nothing half-written was left behind.", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
