"""The README's runtime snippet runs as written, on a release of the bundled example.

The snippet is the ```python block between two ``<!-- runtime-snippet -->`` markers in
README.md, whatever it says. The test builds the example in a scratch project (quantize, compile,
publish: what ``nox -s quantize compile_ctx publish`` does from a fresh clone) and runs the
snippet there. A README without the markers or the block fails: the snippet must not silently
stop being tested.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from venvs import REPO_ROOT

MARKER = "<!-- runtime-snippet -->"


def readme_snippet() -> str:
    """The python block between the two markers; the test fails when there is none."""
    readme = REPO_ROOT / "README.md"
    assert readme.is_file(), f"{readme} is missing"
    parts = readme.read_text("utf-8").split(MARKER)
    assert len(parts) >= 3, f"README.md needs a python block between two {MARKER} markers"
    block = re.search(r"```python\n(.*?)```", parts[1], re.DOTALL)
    assert block, f"README.md has no ```python block between the {MARKER} markers"
    assert block.group(1).strip(), "the README's runtime snippet is empty"
    return block.group(1)


def child_env() -> dict[str, str]:
    """This checkout's pipeline and qnn_ctx_runtime importable, as after installing both."""
    path = os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "runtime")])
    return dict(os.environ, PYTHONPATH=path)


def pipeline_cli(project: Path, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", *args],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=1800,
        env=child_env(),
    )
    assert done.returncode == 0, f"pipeline {' '.join(args)} failed:\n{done.stderr[-3000:]}"
    return done


def test_readme_has_a_runtime_snippet():
    """Checked without QNN too: a README that loses its markers fails everywhere."""
    readme_snippet()


@pytest.mark.qnn
def test_readme_runtime_snippet_runs(tmp_path: Path):
    snippet = readme_snippet()
    pytest.importorskip("onnxruntime_qnn")
    import onnxruntime_qnn

    project = tmp_path / "project"
    shutil.copytree(REPO_ROOT / "configs", project / "configs")
    config = project / "configs" / "example.toml"
    pipeline_cli(project, "quantize")
    # The toolchain installed here; the example's other pins are left out of the release.
    pipeline_cli(project, "compile", "--toolchain", onnxruntime_qnn.__version__, str(config))
    pipeline_cli(project, "publish", str(config))
    (project / "snippet.py").write_text(snippet, "utf-8")
    done = subprocess.run(
        [sys.executable, "snippet.py"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "QNNExecutionProvider" in done.stdout
