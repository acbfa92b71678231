"""Readable reports: every run leaves ``report.md`` for people and ``report.json`` for tools."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qnn_ctx_runtime.typed import to_json_value

from .fileio import write_json, write_text


def fmt(value: Any, digits: int = 2) -> str:
    """Numbers for tables: fixed digits, ``inf`` for exact matches, ``-`` for missing."""
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if math.isnan(value):
            return "nan"
        return f"{value:.{digits}f}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; pipes inside cells are escaped."""

    def cell(v: Any) -> str:
        return fmt(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def json_safe(value: Any) -> Any:
    """JSON has no inf/nan: write them as strings so the file stays standard JSON; records
    (dataclasses) become their JSON form first."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = to_json_value(value)
    if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_report(folder: Path, markdown: str, data: Any) -> Path:
    """Write both files atomically (``data``: a record or JSON-like); returns the Markdown path."""
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "report.json", json_safe(data))
    write_text(folder / "report.md", markdown.rstrip() + "\n")
    return folder / "report.md"
