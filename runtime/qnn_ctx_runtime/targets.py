"""Target chips by name -> QNN ``soc_model`` and ``htp_arch`` (from the QNN EP's source).

Standard library only: the loader uses this table on the device, the build side to compile.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from .errors import UsageError


@dataclass(frozen=True)
class Target:
    name: str
    chip: str
    soc_model: int
    htp_arch: int


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("snapdragon-888", "SM8350 Snapdragon 888", 30, 68),
        Target("snapdragon-8-gen-1", "SM8450 Snapdragon 8 Gen 1", 36, 69),
        Target("snapdragon-8-plus-gen-1", "SM8475 Snapdragon 8+ Gen 1", 42, 69),
        Target("snapdragon-8-gen-2", "SM8550 Snapdragon 8 Gen 2", 43, 73),
        Target("snapdragon-8-gen-3", "SM8650 Snapdragon 8 Gen 3", 57, 75),
        Target("snapdragon-x-elite", "SC8380XP Snapdragon X Elite / X Plus", 60, 73),
        Target("snapdragon-8-elite", "SM8750 Snapdragon 8 Elite", 69, 79),
        Target("snapdragon-8-elite-gen-5", "SM8850 Snapdragon 8 Elite Gen 5", 87, 81),
        Target("snapdragon-x2-elite", "SC8480XP Snapdragon X2 Elite", 88, 81),
    )
}


def get_target(name: str) -> Target:
    """Look a chip up by name; an unknown name lists the known ones."""
    try:
        return TARGETS[name]
    except KeyError:
        hint = difflib.get_close_matches(name, list(TARGETS), n=1)
        raise UsageError(
            f"Unknown target {name!r}."
            + (f" Did you mean {hint[0]!r}?" if hint else "")
            + f" Known targets: {', '.join(TARGETS)}.",
            tip="Use one of the chip names listed.",
        ) from None


def target_for_soc(soc_model: int) -> Target | None:
    return next((t for t in TARGETS.values() if t.soc_model == soc_model), None)
