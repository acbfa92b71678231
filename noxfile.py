"""Sessions pick an environment and call ``python -m pipeline <stage>``; nothing else lives here.

nox -s quantize [-- configs/x.toml ...]     float -> QDQ (plain onnxruntime, no QNN)
nox -s compile_ctx [-- configs/x.toml ...]  QDQ -> EP-context, one venv per pinned toolchain
nox -s "compile_ctx(qnn='2.5.0')"           one toolchain only
nox -s publish [-- configs/x.toml ...]      passing variants -> versioned release
nox -s doctor                               environment check in the newest toolchain's venv
nox -s tests / nox -s lint
"""

from __future__ import annotations

import sys
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).parent))
from pipeline.config import EXAMPLE_CONFIGS, load_config
from pipeline.toolchains import load_pins

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["quantize", "tests", "lint"]
nox.options.reuse_existing_virtualenvs = True

PINS = load_pins()
NEWEST = PINS.toolchains[PINS.default]
DEFAULT_CONFIGS = [str(p) for p in EXAMPLE_CONFIGS]
# The quantize side uses plain onnxruntime at the newest pin's version: one version to bump.
QUANTIZE_DEPS = [f"onnxruntime=={NEWEST.onnxruntime}", "-e", ".[build]"]
# Compile/doctor need the pinned pair only (EPContext nodes are read with a small protobuf
# reader in pipeline/qnn.py), plus tqdm for progress: nothing from the quantize environment.
COMPILE_EXTRAS = ["numpy", "tqdm>=4.66"]


def _configs(session: nox.Session) -> list[str]:
    return list(session.posargs) or DEFAULT_CONFIGS


@nox.session
def quantize(session: nox.Session) -> None:
    """Prepare and quantize float models (default: the bundled example)."""
    session.install(*QUANTIZE_DEPS)
    session.run("python", "-m", "pipeline", "quantize", *session.posargs)


@nox.session
@nox.parametrize("qnn", list(PINS.toolchains))
def compile_ctx(session: nox.Session, qnn: str) -> None:
    """Compile QDQ models to EP-context models with one pinned QNN toolchain."""
    configs = _configs(session)
    wanted = {
        v
        for c in configs
        for v in (load_config(c, check_files=False).compile.toolchains or [PINS.default])
    }
    if qnn not in wanted:
        session.skip(f"no config asks for toolchain {qnn} (compile.toolchains)")
    session.install(*PINS.get(qnn).requirements, *COMPILE_EXTRAS)
    session.run("python", "-m", "pipeline", "compile", "--toolchain", qnn, *configs)


@nox.session
def publish(session: nox.Session) -> None:
    """Assemble immutable, versioned releases from the variants that passed their gates."""
    session.install(f"onnxruntime=={NEWEST.onnxruntime}", "numpy")
    session.run("python", "-m", "pipeline", "publish", *_configs(session))


@nox.session
def doctor(session: nox.Session) -> None:
    """Check this machine for the known barriers, in the newest toolchain's environment."""
    session.install(*NEWEST.requirements, *COMPILE_EXTRAS)
    session.run("python", "-m", "pipeline", "doctor", *session.posargs)


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite against real ONNX Runtime, the QNN EP and its HTP simulator."""
    session.install(*QUANTIZE_DEPS, *NEWEST.requirements, "pytest>=8")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and format check."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
