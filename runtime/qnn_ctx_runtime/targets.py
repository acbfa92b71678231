"""Target chips by name -> QNN ``soc_model`` and ``htp_arch`` (from the QNN EP's source).

Standard library only: the loader uses this table on the device, the build side to compile.

A chip is known by many names: its marketing name (``snapdragon-x-plus``), its SoC part number
(``SM8750``, ``SC8380XP``) and, for the laptop chips, the part number the processor reports
(``X1E-78-100``, which Windows writes ``X1E78100``). ``get_target`` accepts any of them;
``identify`` finds one inside free text (a registry value, ``/proc/cpuinfo``, onnxruntime's
device metadata). One row per distinct (soc_model, htp_arch): a binary built for a row runs on
every chip that is an alias of it.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from .errors import UsageError


@dataclass(frozen=True)
class Target:
    name: str
    chip: str
    soc_model: int
    htp_arch: int
    aliases: tuple[str, ...] = ()  # other names of chips that run this row's binaries
    # Part-number patterns (regular expressions over the normalised text, see ``_compact``).
    part_numbers: tuple[str, ...] = ()


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target(
            "snapdragon-888",
            "SM8350 Snapdragon 888 / 888+",
            30,
            68,
            ("snapdragon-888-plus", "sm8350"),
            (r"SM8350",),
        ),
        Target(
            "snapdragon-8-gen-1", "SM8450 Snapdragon 8 Gen 1", 36, 69, ("sm8450",), (r"SM8450",)
        ),
        Target(
            "snapdragon-8-plus-gen-1",
            "SM8475 Snapdragon 8+ Gen 1",
            42,
            69,
            ("sm8475",),
            (r"SM8475",),
        ),
        Target(
            "snapdragon-8-gen-2",
            "SM8550 Snapdragon 8 Gen 2",
            43,
            73,
            ("snapdragon-8-gen-2-for-galaxy", "sm8550"),
            (r"SM8550",),
        ),
        Target(
            "snapdragon-8-gen-3",
            "SM8650 Snapdragon 8 Gen 3",
            57,
            75,
            ("snapdragon-8-gen-3-for-galaxy", "sm8650"),
            (r"SM8650",),
        ),
        # The first Snapdragon X generation shares one Hexagon NPU (v73): X Elite (X1E-*), X Plus
        # (X1P-*) and Snapdragon X (X1-26-100, the field report's chip, where QNN 2.34 said
        # "HTP V73 hardware unsupported"). Binaries for soc 60 are what onnxruntime-qnn builds
        # for "Snapdragon X"; the 8-core parts (X1P-42-100, X1-26-100) are another die whose own
        # soc_model is not verified here, so their variants are chosen on the arch (v73).
        Target(
            "snapdragon-x-elite",
            "SC8380XP Snapdragon X Elite / X Plus / X",
            60,
            73,
            ("snapdragon-x-plus", "snapdragon-x", "sc8380xp", "sc8380", "x-elite", "x-plus"),
            (r"X1E\d{2}[0-9A-Z]{3}", r"X1P\d{2}[0-9A-Z]{3}", r"X1\d{5}", r"SC8380"),
        ),
        Target(
            "snapdragon-8-elite",
            "SM8750 Snapdragon 8 Elite",
            69,
            79,
            ("snapdragon-8-elite-for-galaxy", "sm8750"),
            (r"SM8750",),
        ),
        Target(
            "snapdragon-8-elite-gen-5",
            "SM8850 Snapdragon 8 Elite Gen 5",
            87,
            81,
            ("snapdragon-8-elite-gen-5-for-galaxy", "sm8850"),
            (r"SM8850",),
        ),
        Target(
            "snapdragon-x2-elite",
            "SC8480XP Snapdragon X2 Elite / X2 Elite Extreme",
            88,
            81,
            ("snapdragon-x2-elite-extreme", "sc8480xp", "sc8480", "x2-elite"),
            (r"X2E\d{2}[0-9A-Z]{3}", r"SC8480"),
        ),
    )
}


def _slug(text: str) -> str:
    """'Snapdragon(R) X Plus' -> 'snapdragon-x-plus': lower case, marks dropped, '-' between."""
    text = re.sub(r"\((r|tm|c)\)|[®™]", " ", text.lower())
    return "-".join(re.findall(r"[a-z0-9]+", text))


def _compact(text: str) -> str:
    """'X1E-78-100' and 'x1e78100' -> 'X1E78100': upper case without separators, so that a part
    number matches however a vendor spaced it."""
    return re.sub(r"[^A-Z0-9]", "", text.upper())


_BY_NAME: dict[str, Target] = {}
for _target in TARGETS.values():
    for _name in (_target.name, *_target.aliases):
        _BY_NAME[_slug(_name)] = _target


def all_names() -> list[str]:
    """Every name ``get_target`` accepts (canonical names first), for messages."""
    return [*TARGETS, *(a for t in TARGETS.values() for a in t.aliases)]


def get_target(name: str) -> Target:
    """Look a chip up by name, alias or part number; an unknown name lists the known ones."""
    found = TARGETS.get(name) or _BY_NAME.get(_slug(name))
    if found is None:
        match = _match_part_number(_compact(name))
        found = match[0] if match else None
    if found is not None:
        return found
    hint = difflib.get_close_matches(_slug(name), list(_BY_NAME), n=1)
    raise UsageError(
        f"Unknown target {name!r}."
        + (f" Did you mean {hint[0]!r}?" if hint else "")
        + f" Known targets: {', '.join(TARGETS)}"
        + f" (also accepted: {', '.join(a for t in TARGETS.values() for a in t.aliases)}, and"
        " part numbers such as X1E-78-100 or SM8750).",
        tip="Use one of the chip names listed.",
    ) from None


def _match_part_number(compact: str) -> tuple[Target, str] | None:
    """The row whose part-number pattern occurs in ``compact`` (the longest match wins, so
    X1E78100 is not read as X1 + digits)."""
    best: tuple[Target, str] | None = None
    for target in TARGETS.values():
        for pattern in target.part_numbers:
            for match in re.finditer(pattern, compact):
                if best is None or len(match.group()) > len(best[1]):
                    best = (target, match.group())
    return best


# Marketing names inside free text, longest first ("x2-elite" before "x-elite").
_NAMES_IN_TEXT = sorted(
    ((n, t) for n, t in _BY_NAME.items() if n.startswith("snapdragon-")),
    key=lambda item: -len(item[0]),
)


def identify(text: str) -> tuple[Target, str] | None:
    """(target, the words that named it) for a free-form chip description, or None.

    Part numbers are the most specific and win ('Snapdragon(R) X Elite - X1E78100 - Qualcomm(R)
    Oryon(TM) CPU' -> X1E78100); then marketing names, longest first ('Snapdragon 8 Elite Gen 5'
    is not 'Snapdragon 8 Elite')."""
    found = _match_part_number(_compact(text))
    if found is not None:
        return found
    slug = f"-{_slug(text)}-"
    for name, target in _NAMES_IN_TEXT:
        if f"-{name}-" in slug:
            return target, name
    return None


def target_for_soc(soc_model: int) -> Target | None:
    return next((t for t in TARGETS.values() if t.soc_model == soc_model), None)
