"""What a build process pays before it does any work: import times in fresh interpreters.

A cold build starts several Python processes (the stage, the HTP judge's worker, compile's
worker, publish), and each one that touches graphs imports onnx, which imports ml_dtypes. This
prints, for this interpreter's environment, the median wall time of importing each heavy module
in a fresh process (``python -c "import m"``, interleaved round by round), and with
``--ml-dtypes A,B`` the same for ``import numpy, ml_dtypes`` in scratch uv venvs holding those
ml_dtypes versions side by side (the reason pyproject.toml caps ml_dtypes below 0.7).

    python benchmarks/imports.py [--rounds N] [--ml-dtypes 0.6.0,0.7.0]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from venvs import uv_command  # noqa: E402

MODULES = [
    "numpy",
    "ml_dtypes",
    "onnx",
    "onnxruntime",
    "onnxruntime.quantization",
    "matplotlib.backends.backend_svg",
    "pipeline.quantize.build",
]


def import_seconds(python: str, module: str) -> float:
    """Seconds a fresh interpreter spends importing ``module`` after numpy (so each row is that
    module's own cost on top of numpy's, with nothing cached in the process)."""
    first = "" if module == "numpy" else "import numpy; "
    script = f"import time; {first}t = time.perf_counter(); import {module}; "
    script += "print(time.perf_counter() - t)"
    done = subprocess.run(
        [python, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return float(done.stdout.strip())


def _installed(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "-"


def scratch_pythons(versions: list[str], where: Path) -> dict[str, str]:
    """One uv venv per ml_dtypes version, with this environment's numpy."""
    pythons = {}
    for wanted in versions:
        venv = where / f"ml_dtypes-{wanted}"
        subprocess.run([*uv_command(), "venv", "-q", "-p", sys.executable, str(venv)], check=True)
        python = str(venv / "bin" / "python")
        numpy = f"numpy=={version('numpy')}"
        subprocess.run(
            [*uv_command(), "pip", "install", "-q", "-p", python, f"ml_dtypes=={wanted}", numpy],
            check=True,
        )
        pythons[wanted] = python
    return pythons


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="fresh processes per module")
    parser.add_argument(
        "--ml-dtypes",
        default="",
        help="comma-separated ml_dtypes versions to time side by side in scratch venvs",
    )
    args = parser.parse_args()

    times: dict[str, list[float]] = {m: [] for m in MODULES}
    for _ in range(args.rounds):
        for module in MODULES:
            times[module].append(import_seconds(sys.executable, module))
    print(f"Imports in fresh processes, median of {args.rounds} (this environment)\n")
    print("| module | installed | median s | min s |\n|---|---|---|---|")
    for module, values in times.items():
        dist = module.split(".")[0].replace("pipeline", "qnn-ctx-pipeline")
        print(
            f"| {module} | {_installed(dist)} | {statistics.median(values):.3f} | {min(values):.3f} |"
        )

    wanted = [v for v in args.ml_dtypes.split(",") if v]
    if wanted:
        with tempfile.TemporaryDirectory() as scratch:
            pythons = scratch_pythons(wanted, Path(scratch))
            side: dict[str, list[float]] = {v: [] for v in wanted}
            for _ in range(args.rounds):
                for v, python in pythons.items():
                    side[v].append(import_seconds(python, "ml_dtypes"))
        print(f"\n`import ml_dtypes` (numpy {version('numpy')} already imported), side by side\n")
        print("| ml_dtypes | median s | min s |\n|---|---|---|")
        for v, values in side.items():
            print(f"| {v} | {statistics.median(values):.3f} | {min(values):.3f} |")
    return 0


if __name__ == "__main__":
    started = time.perf_counter()
    code = main()
    print(f"\n({time.perf_counter() - started:.0f} s)")
    sys.exit(code)
