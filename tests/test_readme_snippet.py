"""The README's runtime snippet runs as written, on a release of the bundled example.

The snippet is the ```python block between two ``<!-- runtime-snippet -->`` markers in
README.md. The test builds the example in a scratch project (quantize, compile, publish: what
``nox -s quantize compile_ctx publish`` does from a fresh clone) and runs the snippet there.
"""

from __future__ import annotations

import importlib.util
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


def compile_with_test_helpers(project: Path, config_path: Path) -> None:
    """Stand-in for the compile stage until it lands: same folders and variant.json."""
    import onnxruntime as ort
    import onnxruntime_qnn
    from release_fixtures import compile_ctx, write_variant

    from pipeline.config import load_config
    from pipeline.targets import get_target
    from pipeline.variant import TensorSpec

    config = load_config(config_path)
    build = project / "artifacts" / "build" / config.model.name
    qdq = build / "qdq.onnx"
    session = ort.InferenceSession(str(qdq), providers=["CPUExecutionProvider"])
    dtype = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(uint8)": "uint8"}
    specs = tuple(
        [TensorSpec(t.name, list(t.shape), dtype[t.type]) for t in tensors]
        for tensors in (session.get_inputs(), session.get_outputs())
    )
    toolchain = onnxruntime_qnn.__version__
    for target in config.compile.targets:
        chip = get_target(target)
        folder = build / "ctx" / toolchain / target
        folder.mkdir(parents=True)
        ctx = folder / f"{config.model.name}_{target}_ctx.onnx"
        files = compile_ctx(qdq, ctx, chip.soc_model, chip.htp_arch, config.compile.embed)
        write_variant(
            folder,
            files,
            target,
            toolchain=toolchain,
            onnxruntime=ort.__version__,
            validation={"passed": True, "gate": "not measured (test stand-in)"},
            model=config.model.name,
            version=config.model.version,
            tensors=specs,
        )


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
    if importlib.util.find_spec("pipeline.compile") is not None:
        pipeline_cli(project, "compile", "--toolchain", onnxruntime_qnn.__version__, str(config))
    else:
        compile_with_test_helpers(project, config)
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
