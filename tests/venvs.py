"""Real second environments with another QNN toolchain, for cross-version tests.

A test that must prove behaviour against *another* onnxruntime-qnn (not a patched version string)
runs a small script with ``toolchain_python(...)``. The environments are created once with uv and
cached under ``~/.cache/qnn-pipeline/envs/<versions>/`` (override with ``QNN_PIPELINE_ENVS``), so
reruns cost nothing. Creation is serialized with a file lock: several test sessions may ask for
the same environment at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
READY_FILE = ".qnn-pipeline-ready"


def envs_root() -> Path:
    default = Path.home() / ".cache" / "qnn-pipeline" / "envs"
    return Path(os.environ.get("QNN_PIPELINE_ENVS", default))


def env_name(onnxruntime_qnn: str, onnxruntime: str) -> str:
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return f"ortqnn-{onnxruntime_qnn}_ort-{onnxruntime}_{py}"


def uv_command() -> list[str]:
    """uv from PATH, else the one installed beside this interpreter, else ``python -m uv``."""
    found = shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))
    return [found] if found else [sys.executable, "-m", "uv"]


@contextlib.contextmanager
def env_lock(path: Path) -> Iterator[None]:
    """One creator of a cached env at a time (tests and benchmarks may build beside each other)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        if sys.platform != "win32":
            import fcntl

            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if sys.platform != "win32":
                fcntl.flock(handle, fcntl.LOCK_UN)


def _python_in(env: Path) -> Path:
    return env / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")


def _installed(python: Path) -> dict[str, str]:
    """Versions of the two packages in that environment ({} when it is broken or incomplete)."""
    script = (
        "import importlib.metadata as m, json\n"
        "out = {}\n"
        "for n in ('onnxruntime-qnn', 'onnxruntime', 'numpy'):\n"
        "    try: out[n] = m.version(n)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(out))\n"
    )
    try:
        done = subprocess.run(
            [str(python), "-c", script], capture_output=True, text=True, timeout=60, check=True
        )
        return json.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError):
        return {}


def toolchain_python(onnxruntime_qnn: str, onnxruntime: str) -> Path:
    """The python of a cached venv with exactly these two versions (plus numpy).

    Skips the calling test (with the reason) when the environment cannot be created, e.g. offline.
    """
    env = envs_root() / env_name(onnxruntime_qnn, onnxruntime)
    python = _python_in(env)
    wanted = {"onnxruntime-qnn": onnxruntime_qnn, "onnxruntime": onnxruntime}
    with env_lock(env.with_name(env.name + ".lock")):
        if (env / READY_FILE).is_file() and python.exists():
            return python
        have = _installed(python) if python.exists() else {}
        if not all(have.get(k) == v for k, v in wanted.items()) or "numpy" not in have:
            if not python.exists():
                _run([*uv_command(), "venv", "--quiet", "--python", sys.executable, str(env)], env)
            _run(
                [
                    *uv_command(),
                    "pip",
                    "install",
                    "--quiet",
                    "--python",
                    str(python),
                    f"onnxruntime-qnn=={onnxruntime_qnn}",
                    f"onnxruntime=={onnxruntime}",
                    "numpy",
                ],
                env,
            )
            have = _installed(python)
            if not all(have.get(k) == v for k, v in wanted.items()):
                pytest.skip(f"{env} does not hold {wanted} after installing (found {have})")
        (env / READY_FILE).write_text(json.dumps(wanted) + "\n", encoding="utf-8")
    return python


def _run(cmd: list[str], env: Path) -> None:
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        pytest.skip(f"cannot create the toolchain environment {env}: {detail.strip()[-500:]}")


def run_in(
    python: Path, script: str, *args: str, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run ``script`` with that python, this checkout's ``pipeline`` and ``qnn_ctx_runtime``
    importable (as after installing both), and output captured."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "runtime")])
    env.pop("PYTHONHOME", None)
    return subprocess.run(
        [str(python), "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=str(REPO_ROOT),
    )
