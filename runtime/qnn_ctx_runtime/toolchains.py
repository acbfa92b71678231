"""QNN toolchains: which onnxruntime-qnn bundles which QNN SDK, and which pairs are pinned.

One table (``toolchains.toml``, package data of this distribution) serves the builder (the pins
it compiles with), the loader (fixes that name the release to install) and ``doctor``. A broken
table is an error naming the file, never silently replaced by something else.

Standard library only: this module runs on the device.
"""

from __future__ import annotations

import difflib
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .errors import ToolchainError

TABLE_NAME = "toolchains.toml"


@dataclass(frozen=True)
class Toolchain:
    """One onnxruntime-qnn release; ``onnxruntime`` is the verified partner ("" when none is)."""

    onnxruntime_qnn: str
    qnn_sdk: str
    onnxruntime: str = ""

    @property
    def pinned(self) -> bool:
        return bool(self.onnxruntime)

    @property
    def requirements(self) -> list[str]:
        return [f"onnxruntime-qnn=={self.onnxruntime_qnn}", f"onnxruntime=={self.onnxruntime}"]


def version_key(text: str) -> tuple[int, ...]:
    """'2.51.0' -> (2, 51, 0); non-numeric parts end the key."""
    parts = []
    for piece in text.strip().lstrip("vV").split("."):
        if not piece.isdigit():
            break
        parts.append(int(piece))
    return tuple(parts)


@dataclass(frozen=True)
class Toolchains:
    """The table: every known release, the pinned ones, and the default pin."""

    default: str
    known: dict[str, Toolchain]
    source: str

    @property
    def pinned(self) -> dict[str, Toolchain]:
        return {v: t for v, t in self.known.items() if t.pinned}

    def get(self, version: str) -> Toolchain:
        """A pinned toolchain; an unknown or unpinned version lists the pins."""
        pin = self.pinned.get(version)
        if pin is not None:
            return pin
        pins = ", ".join(self.pinned)
        if version in self.known:
            raise ToolchainError(
                f"onnxruntime-qnn {version} (QNN SDK {self.known[version].qnn_sdk}) is known but "
                f"not pinned in {self.source}: no onnxruntime was verified beside it. "
                f"Pinned: {pins}.",
                tip=f'Verify a pair and add onnxruntime = "..." to [toolchain."{version}"].',
            )
        hint = difflib.get_close_matches(version, list(self.pinned), n=1)
        raise ToolchainError(
            f"Toolchain onnxruntime-qnn {version!r} is not pinned in {self.source}."
            + (f" Did you mean {hint[0]!r}?" if hint else "")
            + f" Pinned: {pins}.",
            tip='Add a [toolchain."X"] row with its qnn_sdk and a verified onnxruntime.',
        )

    def for_sdk(self, qnn_sdk: str) -> Toolchain | None:
        """The release that bundles exactly this SDK (compared on its first three parts)."""
        wanted = version_key(qnn_sdk)[:3]
        return next((t for t in self.known.values() if version_key(t.qnn_sdk)[:3] == wanted), None)

    def selected(self, requested: list[str]) -> list[Toolchain]:
        """The pins a model config asks for; none named means the default one."""
        return [self.get(v) for v in (requested or [self.default])]

    @property
    def newest_pin(self) -> Toolchain:
        return max(self.pinned.values(), key=lambda t: version_key(t.onnxruntime_qnn))


def load_toolchains(path: str | Path | None = None) -> Toolchains:
    """Read the table (default: this package's ``toolchains.toml``); every problem is listed."""
    if path is None:
        resource = resources.files(__package__).joinpath(TABLE_NAME)
        source = str(resource)
        try:
            text = resource.read_text(encoding="utf-8")
        except OSError as exc:
            raise ToolchainError(
                f"The toolchain table {source} cannot be read: {exc}.",
                tip="Reinstall qnn-ctx-runtime; the table is part of the package.",
            ) from None
    else:
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ToolchainError(f"The toolchain table {source} cannot be read: {exc}.") from None
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ToolchainError(f"{source}: invalid TOML: {exc}.", tip="Fix the file.") from None
    problems = []
    unknown = set(table) - {"default", "toolchain"}
    if unknown:
        problems.append(f"unknown key(s) {sorted(unknown)}; use 'default' and [toolchain.\"X\"]")
    rows = table.get("toolchain", {})
    known: dict[str, Toolchain] = {}
    if not isinstance(rows, dict):
        problems.append("[toolchain] must be a table of releases")
        rows = {}
    for version, row in rows.items():
        where = f'[toolchain."{version}"]'
        if not isinstance(row, dict):
            problems.append(f"{where} must be a table")
            continue
        extra = sorted(set(row) - {"qnn_sdk", "onnxruntime"})
        if extra:
            problems.append(f"{where} has unknown key(s) {extra}; use qnn_sdk and onnxruntime")
        sdk, ort = row.get("qnn_sdk"), row.get("onnxruntime", "")
        if not isinstance(sdk, str) or not version_key(sdk):
            problems.append(f'{where} needs qnn_sdk = "X.Y.Z", got {sdk!r}')
            continue
        if not isinstance(ort, str) or (ort and not version_key(ort)):
            problems.append(f'{where}: onnxruntime must be "X.Y.Z" or absent, got {ort!r}')
            continue
        known[str(version)] = Toolchain(str(version), sdk, ort)
    default = table.get("default", "")
    if default not in known or not known[default].pinned:
        problems.append(f"default = {default!r} is not one of the pinned toolchains")
    if problems:
        raise ToolchainError(
            f"{source} is not a valid toolchain table:\n  - " + "\n  - ".join(problems),
            tip="Fix the file; see the comments at its top.",
        )
    return Toolchains(default=default, known=known, source=source)
