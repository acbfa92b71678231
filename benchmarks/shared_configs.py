"""Which real-model configs a benchmark runs: those whose model file is here."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.core.config import ModelConfig, load_config  # noqa: E402


def runnable_configs(
    paths: list[Path], bucketed_note: str | None = None
) -> tuple[list[tuple[Path, ModelConfig]], list[str]]:
    """Configs to run (default: configs/shared/*.toml) and a note for each one left out."""
    chosen, notes = [], []
    for path in paths or sorted((ROOT / "configs" / "shared").glob("*.toml")):
        config = load_config(path, check_files=False)
        name = config.model.name
        if config.buckets.enabled and bucketed_note is not None:
            notes.append(f"{name}: bucketed config, {bucketed_note}")
        elif not config.source_path.is_file():
            notes.append(f"{name}: skipped, {config.source_path} is absent")
        else:
            chosen.append((path, config))
    return chosen, notes


def compile_bytecode(note: str = "this checkout runs from bytecode") -> str:
    """Compile this checkout's packages and this interpreter's site-packages to bytecode
    (untimed, before any run), as nox's environments are (UV_COMPILE_BYTECODE) and Olive's venv
    is (uv --compile-bytecode): where PYTHONDONTWRITEBYTECODE is set, a side without bytecode
    would compile ~400 modules from source in every process it starts. Returns the note."""
    import subprocess
    import sysconfig

    paths = [ROOT / "pipeline", ROOT / "runtime" / "qnn_ctx_runtime", sysconfig.get_path("purelib")]
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "-j", "0", *map(str, paths)],
        capture_output=True,
        check=False,  # a file that does not compile is imported from source, as before
    )
    return f"{note} (compiled before the runs, untimed)"
