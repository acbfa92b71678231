"""Build records: what went into an artifact, so that a rebuild with nothing changed is skipped."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
from pathlib import Path
from typing import Any

from .fileio import sha256_file, write_json

RECORD_FILE = "record.json"
PACKAGE_DIR = Path(__file__).resolve().parent


def tool_versions(*distributions: str, code: tuple[str, ...] = ()) -> dict[str, str]:
    """Exact installed versions (``"absent"`` when not installed), Python, and our ``code``."""
    versions = {"python": platform.python_version(), "pipeline_code": pipeline_code_digest(code)}
    for name in distributions:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def pipeline_code_digest(modules: tuple[str, ...] = ()) -> str:
    """A hash of the pipeline modules a stage runs: a change in a transform must rebuild."""
    digest = hashlib.sha256()
    paths = [PACKAGE_DIR / f"{m}.py" for m in modules] if modules else PACKAGE_DIR.glob("*.py")
    for path in sorted(p for p in paths if p.is_file()):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def folder_digest(folder: Path) -> str:
    """Hash of every file below ``folder`` (names and bytes), or of one file."""
    digest = hashlib.sha256()
    if folder.is_file():
        digest.update(sha256_file(folder).encode())
        return digest.hexdigest()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode())
        digest.update(sha256_file(path).encode())
    return digest.hexdigest()


def read_record(folder: Path) -> dict[str, Any]:
    path = Path(folder) / RECORD_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text("utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}


def update_record(folder: Path, key: str, value: Any) -> dict[str, Any]:
    """Set one top-level section of the record, keeping the others; written atomically."""
    record = read_record(folder)
    record[key] = value
    write_json(Path(folder) / RECORD_FILE, record)
    return record
