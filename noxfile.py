"""Sessions pick an environment and call ``python -m pipeline <stage>``; nothing else lives here.

nox -s quantize [-- configs/x.toml ... --force]   float -> QDQ (plain onnxruntime, no QNN)
nox -s compile_ctx [-- configs/x.toml ...]         QDQ -> EP-context, one venv per pinned toolchain
nox -s "compile_ctx(qnn='2.5.0')"                  one toolchain only
nox -s publish [-- configs/x.toml ...]             passing variants -> versioned release
nox -s doctor                                      environment check in the newest toolchain's venv
nox -s tests / nox -s lint

Arguments after ``--`` go to the stage: config paths and its flags (``--force``, ...).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).parent / "runtime"))
sys.path.insert(0, str(Path(__file__).parent))
from pipeline.core.config import EXAMPLE_CONFIGS, load_config
from qnn_ctx_runtime.toolchains import load_toolchains

PYPROJECT = nox.project.load_toml("pyproject.toml")
# One build runs six or so Python processes (a stage, the HTP probe and its helper, compile's
# worker), each importing ~400 modules. Without bytecode every one of them compiles those from
# source each time: 0.3 s a process where PYTHONDONTWRITEBYTECODE is set, 1.4 s of a 7.5 s
# cold build. uv compiles what it installs with this (pip always does); the checkout's own
# editable packages are compiled by ``_install``. UV_COMPILE_BYTECODE=0 opts out.
os.environ.setdefault("UV_COMPILE_BYTECODE", "1")
EDITABLE_SOURCES = ["pipeline", "runtime/qnn_ctx_runtime"]
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["quantize", "tests", "lint"]
nox.options.reuse_existing_virtualenvs = True

TOOLCHAINS = load_toolchains()
NEWEST = TOOLCHAINS.pinned[TOOLCHAINS.default]
# The device-side package: every environment that runs the builder needs it (the builder's
# manifest type, chip and toolchain tables and QNN helpers live there).
RUNTIME = ["-e", "./runtime"]
# The quantize side quantizes with plain onnxruntime (newest pin: one version to bump) and judges
# precision choices on the HTP simulator, so it also gets the newest pin's onnxruntime-qnn (a
# plugin EP beside onnxruntime since 2.x). Without it, quantization.judge = "cpu" still works.
QUANTIZE_DEPS = [*NEWEST.requirements, *RUNTIME, "-e", ".[build]"]
# Compile/doctor need the pinned pair, the runtime package and tqdm for progress (EPContext nodes
# are read with the runtime's small protobuf reader), and onnx for compile.gpu = "float16" only:
# its fp16 copy of the float model is made by onnxruntime's own converter, which needs onnx.
BUILD_EXTRAS = PYPROJECT["project"]["optional-dependencies"]["build"]
ONNX = next(d for d in BUILD_EXTRAS if d.startswith("onnx"))
# onnx's ml_dtypes, capped as in pyproject.toml (a 1 s import in 0.7.0).
ML_DTYPES = next(d for d in BUILD_EXTRAS if d.startswith("ml_dtypes"))
# matplotlib draws the compile plots of report.html (accuracy per output, load times).
MATPLOTLIB = next(d for d in BUILD_EXTRAS if d.startswith("matplotlib"))
COMPILE_EXTRAS = [*RUNTIME, "numpy", "tqdm>=4.66", ONNX, ML_DTYPES, MATPLOTLIB]
# Ed25519 signing of manifests (publish --sign-key) and its checks in the tests.
SIGN_DEPS = PYPROJECT["project"]["optional-dependencies"]["sign"]


def _install(session: nox.Session, *requirements: str) -> None:
    """Install, then compile the checkout's editable sources to bytecode (only files that
    changed; a read-only checkout just runs from source)."""
    session.install(*requirements)
    session.run(
        "python", "-m", "compileall", "-q", *EDITABLE_SOURCES, silent=True, success_codes=[0, 1]
    )


def _configs(session: nox.Session, stage: str) -> list[str]:
    """The config paths among the arguments after ``--``, read by the stage's own parser (so a
    flag with a value, ``--artifacts out`` or ``--sign-key key.pem``, is not taken for one)."""
    from pipeline.__main__ import build_parser

    try:
        args = build_parser().parse_args([stage, *session.posargs])
    except SystemExit:  # argparse printed the problem
        session.error(f"bad arguments for `python -m pipeline {stage}`: {session.posargs}")
    return [str(p) for p in args.configs] or [str(p) for p in EXAMPLE_CONFIGS]


@nox.session
def quantize(session: nox.Session) -> None:
    """Prepare and quantize float models (default: the bundled examples)."""
    _install(session, *QUANTIZE_DEPS)
    session.run("python", "-m", "pipeline", "quantize", *session.posargs)


@nox.session
@nox.parametrize("qnn", list(TOOLCHAINS.pinned))
def compile_ctx(session: nox.Session, qnn: str) -> None:
    """Compile QDQ models to EP-context models with one pinned QNN toolchain."""
    if "--toolchain" in session.posargs:
        session.error(
            "Choose the toolchain with the session, e.g. "
            f"nox -s \"compile_ctx(qnn='{TOOLCHAINS.default}')\"; pinned: "
            f"{', '.join(TOOLCHAINS.pinned)}."
        )
    configs = _configs(session, "compile")
    wanted = {
        v
        for c in configs
        for v in (load_config(c, check_files=False).compile.toolchains or [TOOLCHAINS.default])
    }
    if qnn not in wanted:
        session.skip(f"no config asks for toolchain {qnn} (compile.toolchains)")
    _install(session, *TOOLCHAINS.get(qnn).requirements, *COMPILE_EXTRAS)
    session.run("python", "-m", "pipeline", "compile", "--toolchain", qnn, *session.posargs)


@nox.session
def publish(session: nox.Session) -> None:
    """Assemble immutable, versioned releases from the variants that passed their gates."""
    _install(session, f"onnxruntime=={NEWEST.onnxruntime}", "numpy", *RUNTIME)
    if any(a.startswith("--sign-key") for a in session.posargs) or "QNN_CTX_SIGN_KEY" in os.environ:
        session.install(*SIGN_DEPS)
    _configs(session, "publish")  # refuse bad arguments before installing anything else
    session.run("python", "-m", "pipeline", "publish", *session.posargs)


@nox.session
def doctor(session: nox.Session) -> None:
    """Check this machine for the known barriers, in the newest toolchain's environment."""
    _install(session, *NEWEST.requirements, *COMPILE_EXTRAS)
    session.run("python", "-m", "pipeline", "doctor", *session.posargs)


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite against real ONNX Runtime, the QNN EP and its HTP simulator."""
    _install(session, *QUANTIZE_DEPS, *SIGN_DEPS, "pytest>=8")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and format check."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
