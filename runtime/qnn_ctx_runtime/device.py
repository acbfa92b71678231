"""The machine the loader runs on: its architecture, emulation, and what is known of its NPU.

Standard library only: this module runs on the device.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass

from .errors import UsageError
from .targets import get_target


def native_machine_detail() -> tuple[str, str]:
    """(the hardware's architecture, how it was found), even from an emulated process.

    On Windows an x86-64 process emulated on ARM64 sees ``platform.machine() == 'AMD64'``; the
    kernel's ``IsWow64Process2`` tells the truth, and ``PROCESSOR_ARCHITEW6432`` /
    ``PROCESSOR_IDENTIFIER`` are the fallbacks where it is missing. Every fallback says why, so
    the emulation guard (QNN kills an emulated process with exit 127) never turns off silently.
    """
    if sys.platform != "win32":
        return _normalize_machine(platform.machine()), "platform.machine()"
    import ctypes

    why = ""
    try:
        process, native = ctypes.c_ushort(), ctypes.c_ushort()
        kernel32 = ctypes.windll.kernel32  # type: ignore[attr-defined]
        if kernel32.IsWow64Process2(
            kernel32.GetCurrentProcess(), ctypes.byref(process), ctypes.byref(native)
        ):
            machines = {0xAA64: "arm64", 0x8664: "x86_64", 0x14C: "x86"}
            return machines.get(native.value, hex(native.value)), "IsWow64Process2"
        why = f"IsWow64Process2 failed (error {ctypes.get_last_error()})"
    except (AttributeError, OSError) as exc:  # an old Windows without the call
        why = f"IsWow64Process2 unavailable ({exc})"
    for variable in ("PROCESSOR_ARCHITEW6432", "PROCESSOR_ARCHITECTURE"):
        value = os.environ.get(variable, "")
        if value:
            return _normalize_machine(value), f"{variable} ({why})"
    return _normalize_machine(platform.machine()), f"platform.machine() ({why})"


def native_machine() -> str:
    """The hardware's architecture, even from an emulated process ('arm64', 'x86_64', ...)."""
    return native_machine_detail()[0]


def process_machine() -> str:
    """The architecture this Python was built for."""
    return _normalize_machine(platform.machine())


def _normalize_machine(name: str) -> str:
    name = name.lower()
    return {"amd64": "x86_64", "aarch64": "arm64", "arm64": "arm64"}.get(name, name)


def emulated_on_arm64() -> bool:
    """x86 Python on ARM64 Windows: QNN's ARM64 drivers kill such a process (exit 127)."""
    return native_machine() == "arm64" and process_machine() != "arm64"


@dataclass(frozen=True)
class Device:
    """What is known of the NPU: from ``target=``, or nothing (then no arch filter applies)."""

    target: str | None
    soc_model: int | None
    htp_arch: int | None
    simulator: bool

    def describe(self) -> str:
        where = "HTP simulator on " + native_machine() if self.simulator else "device"
        if self.htp_arch is None:
            return f"{where}, HTP arch unknown"
        return f"{where}, {self.target} (soc {self.soc_model}, HTP v{self.htp_arch})"


def device_for(target: str | None) -> Device:
    simulator = native_machine() in ("x86_64", "x86")
    if target is None:
        return Device(None, None, None, simulator)
    try:
        chip = get_target(target)
    except UsageError as exc:
        raise UsageError(exc.message, tip="Pass target= as one of the names listed.") from None
    return Device(chip.name, chip.soc_model, chip.htp_arch, simulator)
