"""Pinned QNN toolchains (configs/toolchains.toml): onnxruntime-qnn, its SDK, its onnxruntime."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from .config import load_toml
from .errors import ConfigError, ToolchainError

PINS_FILE = Path(__file__).resolve().parent.parent / "configs" / "toolchains.toml"


@dataclass(frozen=True)
class Toolchain:
    """One known-good pair: ``onnxruntime_qnn`` bundles QNN SDK ``qnn_sdk``."""

    onnxruntime_qnn: str
    qnn_sdk: str
    onnxruntime: str

    @property
    def requirements(self) -> list[str]:
        return [f"onnxruntime-qnn=={self.onnxruntime_qnn}", f"onnxruntime=={self.onnxruntime}"]


@dataclass(frozen=True)
class Pins:
    default: str
    toolchains: dict[str, Toolchain]

    def get(self, version: str) -> Toolchain:
        try:
            return self.toolchains[version]
        except KeyError:
            hint = difflib.get_close_matches(version, list(self.toolchains), n=1)
            raise ToolchainError(
                f"Toolchain onnxruntime-qnn {version!r} is not pinned in {PINS_FILE}."
                + (f" Did you mean {hint[0]!r}?" if hint else "")
                + f" Pinned: {', '.join(self.toolchains)}.",
                tip='Add a [toolchain."X"] row with its qnn_sdk and a verified onnxruntime.',
            ) from None

    def for_sdk(self, qnn_sdk: str) -> Toolchain | None:
        return next((t for t in self.toolchains.values() if t.qnn_sdk == qnn_sdk), None)

    def selected(self, requested: list[str]) -> list[Toolchain]:
        """The toolchains a model config asks for; none named means the default one."""
        return [self.get(v) for v in (requested or [self.default])]


def load_pins(path: Path = PINS_FILE) -> Pins:
    table = load_toml(path)
    unknown = set(table) - {"default", "toolchain"}
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {sorted(unknown)}; use 'default', 'toolchain'.")
    rows = table.get("toolchain", {})
    toolchains = {}
    for version, row in rows.items():
        extra = set(row) - {"qnn_sdk", "onnxruntime"}
        missing = {"qnn_sdk", "onnxruntime"} - set(row)
        if extra or missing:
            raise ConfigError(
                f"{path}: [toolchain.{version!r}] needs exactly qnn_sdk and onnxruntime"
                f" (unknown: {sorted(extra)}, missing: {sorted(missing)})."
            )
        toolchains[version] = Toolchain(version, str(row["qnn_sdk"]), str(row["onnxruntime"]))
    default = table.get("default", "")
    if default not in toolchains:
        raise ConfigError(f"{path}: default = {default!r} is not one of the pinned toolchains.")
    return Pins(default=default, toolchains=toolchains)
