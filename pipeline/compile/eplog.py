"""What onnxruntime and QNN print when a compile or load goes wrong, turned into facts.

The compile worker's log is all that is left when QNN aborts the process from native code; these
parsers pick out the failing nodes, their QNN op types, the QNN error codes and the ``what()`` of
an abort, and tell a node QNN merely declined (left to the CPU) from the one that broke.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

_ADD_NODE = re.compile(
    r"failed for node [`'\"]?(?P<node>[^`'\"\s]+)[`'\"]? of type [`'\"]?(?P<op>[^`'\"\s]+)[`'\"]?"
    r".*?error code (?P<code>\d+)"
)
_ERROR_CODE = re.compile(r"(?:error code|Error code|Error:)\s*:?\s*(?P<code>\d{3,}|QNN_[A-Z_]+)")
_QNN_ENUM = re.compile(r"\bQNN_[A-Z]+_ERROR_[A-Z_]+\b")
_WHAT = re.compile(r"what\(\):\s*(?P<what>.+)")


@dataclass
class LogFacts:
    """What an EP log says went wrong: nodes, their QNN op types and QNN error codes.

    ``nodes``/``op_types``/``error_codes`` come from error-level lines (what broke).
    ``rejected`` lists nodes QNN declined at warning level while partitioning; those were left
    to the CPU, which is context for a failure but not its cause.
    """

    nodes: list[str] = field(default_factory=list)
    op_types: list[str] = field(default_factory=list)
    error_codes: list[str] = field(default_factory=list)
    error_lines: list[str] = field(default_factory=list)
    abort: str = ""  # the what() of a "terminate called ..." abort
    rejected: list[dict[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": self.nodes,
            "op_types": self.op_types,
            "qnn_error_codes": self.error_codes,
            "log_errors": self.error_lines,
            "abort": self.abort,
        }


def _add(items: list[str], value: str) -> None:
    if value and value not in items:
        items.append(value)


def parse_ep_log(text: str, max_lines: int = 20) -> LogFacts:
    """Pick the failure facts out of onnxruntime/QNN output (ANSI colours are ignored)."""
    facts = LogFacts()
    for raw_line in text.splitlines():
        line = re.sub(r"\x1b\[[0-9;]*m", "", raw_line).strip()
        if not line:
            continue
        warning = "[W:" in line or "[I:" in line or "[V:" in line
        match = _ADD_NODE.search(line)
        if match and warning:
            entry = {"node": match["node"], "op_type": match["op"], "code": match["code"]}
            if entry not in facts.rejected:
                facts.rejected.append(entry)
            continue
        if warning:
            continue
        if match:
            _add(facts.nodes, match["node"])
            _add(facts.op_types, match["op"])
            _add(facts.error_codes, match["code"])
        for code in _ERROR_CODE.finditer(line):
            _add(facts.error_codes, code["code"])
        for enum in _QNN_ENUM.finditer(line):
            _add(facts.error_codes, enum.group())
        what = _WHAT.search(line)
        if what:
            facts.abort = what["what"].strip()
        is_error = (
            "[E:" in line
            or "[F:" in line
            or "terminate called" in line
            or "what():" in line
            or "Failed to compose" in line
        )
        if is_error and len(facts.error_lines) < max_lines:
            facts.error_lines.append(line[:500])
    return facts
