"""The README's runtime snippet runs as written, on a release of the bundled example.

The snippet is the ```python block between two ``<!-- runtime-snippet -->`` markers in
README.md. The test builds the example in a scratch project (quantize, compile, publish: what
``nox -s quantize compile_ctx publish`` does from a fresh clone) and runs the snippet there.
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


def readme_snippet() -> str | None:
    readme = REPO_ROOT / "README.md"
    if not readme.is_file():
        return None
    parts = readme.read_text("utf-8").split(MARKER)
    if len(parts) < 3:
        return None
    block = re.search(r"```python\n(.*?)```", parts[1], re.DOTALL)
    return block.group(1) if block else None


def pipeline_cli(project: Path, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", *args],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=1800,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    )
    assert done.returncode == 0, f"pipeline {' '.join(args)} failed:\n{done.stderr[-3000:]}"
    return done


@pytest.mark.qnn
def test_readme_runtime_snippet_runs(tmp_path: Path):
    snippet = readme_snippet()
    if snippet is None:
        pytest.skip(f"README.md has no python block between {MARKER} markers yet")
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
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "QNNExecutionProvider" in done.stdout
