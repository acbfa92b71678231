"""The machine the loader runs on: its architecture, emulation, and which Snapdragon it is.

A release holds variants for several HTP architectures; a binary built for a newer arch than
the device's does not run (FACTS §3), so the loader must know the device's chip before it
chooses. ``detect_device`` asks, in this order:

1. ``target=`` when the caller names the chip (any name, alias or part number of
   ``qnn_ctx_runtime.targets``);
2. onnxruntime's EP-device metadata: the QNN EP's ``OrtEpDevice`` entries and the
   ``OrtHardwareDevice`` behind them (type NPU / GPU / CPU, vendor, the OS's description of the
   device; on Windows DXCore's, e.g. "Snapdragon(R) X Elite - X1E78100 - Qualcomm(R) Hexagon(TM)
   NPU"). The loader adds these once the EP is registered (``with_ep_devices``);
3. the operating system: the Windows registry's ``ProcessorNameString``, Linux's
   ``/sys/devices/soc0/machine`` and device-tree ``compatible``, ``/proc/cpuinfo``'s Hardware
   line, Android's ``getprop ro.soc.model``.

A device none of these identifies (an x86_64 build machine, where the QNN HTP library is a
simulator) stays unidentified, and ``Device.describe()`` says so; the variant choice is then
conservative (``qnn_ctx_runtime.select``). ``check_compiled_model`` runs ONNX Runtime's own
compiled-model compatibility check (``get_model_compatibility_for_ep_devices``) where it exists
and applies (an NPU device); otherwise it says why not.

Standard library only at import time (onnxruntime is imported inside the functions that need
it): this module runs on the device.
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from . import qnn
from .errors import UsageError
from .targets import Target, get_target, identify

QNN_EP = "QNNExecutionProvider"
COMPATIBILITY_FUNCTION = "get_model_compatibility_for_ep_devices"


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


# -- facts about the chip ----------------------------------------------------------------------


@dataclass(frozen=True)
class ChipFact:
    """One description of the chip the machine gives, and where it was read."""

    source: str  # e.g. "Windows registry ProcessorNameString"
    text: str

    def __str__(self) -> str:
        return f"{self.source}: {self.text!r}"


_WINDOWS_CPU_KEY = r"HARDWARE\DESCRIPTION\System\CentralProcessor\0"
_ANDROID_PROPS = ("ro.soc.model", "ro.soc.manufacturer", "ro.board.platform")
_CHIP_WORDS = ("qualcomm", "snapdragon", "qcom", "qti")


def os_chip_facts(root: Path | None = None, platform_name: str | None = None) -> list[ChipFact]:
    """What the operating system says about the chip, most specific first.

    ``root`` is the filesystem root the Linux/Android files are read under (``/``), so the
    reading can be exercised on a copy of a device's ``/sys`` and ``/proc``.
    """
    platform_name = platform_name or sys.platform
    if platform_name == "win32":
        return _windows_facts()
    base = Path(root) if root is not None else Path("/")
    facts: list[ChipFact] = []
    machine = _read_text(base / "sys/devices/soc0/machine")
    if machine:
        facts.append(ChipFact("/sys/devices/soc0/machine", machine))
    compatible = _read_text(base / "proc/device-tree/compatible")
    if compatible:
        names = [n for n in compatible.split("\0") if n.strip()]
        facts.append(ChipFact("/proc/device-tree/compatible", " ".join(names)))
    for line in (_read_text(base / "proc/cpuinfo") or "").splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip().lower(), value.strip()
        if key in ("hardware", "model name", "processor") and any(
            word in value.lower() for word in _CHIP_WORDS
        ):
            facts.append(ChipFact(f"/proc/cpuinfo {key.title()}", value))
            break
    if root is None and shutil.which("getprop"):  # Android
        for prop in _ANDROID_PROPS:
            value = _getprop(prop)
            if value:
                facts.append(ChipFact(f"Android getprop {prop}", value))
    return facts


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8", errors="replace").strip()
    except OSError:
        return ""


def _getprop(name: str) -> str:
    try:
        done = subprocess.run(
            ["getprop", name], capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def _windows_facts() -> list[ChipFact]:
    facts = []
    try:
        import winreg

        with winreg.OpenKey(winreg.HKEY_LOCAL_MACHINE, _WINDOWS_CPU_KEY) as key:  # type: ignore[attr-defined]
            value, _ = winreg.QueryValueEx(key, "ProcessorNameString")  # type: ignore[attr-defined]
        if str(value).strip():
            facts.append(ChipFact("Windows registry ProcessorNameString", str(value).strip()))
    except (ImportError, OSError):
        pass
    identifier = os.environ.get("PROCESSOR_IDENTIFIER", "").strip()
    if identifier:
        facts.append(ChipFact("PROCESSOR_IDENTIFIER", identifier))
    return facts


@dataclass(frozen=True)
class EpDeviceFacts:
    """What onnxruntime says about the devices the QNN EP is offered on."""

    types: tuple[str, ...]  # hardware types of the QNN EP's devices: "NPU", "GPU", "CPU"
    chip_facts: tuple[ChipFact, ...]  # the OS's descriptions of those devices
    evidence: tuple[str, ...]

    @property
    def npu(self) -> bool:
        return "NPU" in self.types

    def to_json(self) -> dict[str, Any]:
        return {
            "types": list(self.types),
            "chip_facts": [[f.source, f.text] for f in self.chip_facts],
            "evidence": list(self.evidence),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EpDeviceFacts:
        """The facts another process read (doctor asks onnxruntime in a child process)."""
        return cls(
            tuple(data["types"]),
            tuple(ChipFact(source, text) for source, text in data["chip_facts"]),
            tuple(data["evidence"]),
        )

    @property
    def gpu(self) -> bool:
        return "GPU" in self.types


def ep_device_facts(devices: Iterable[Any]) -> EpDeviceFacts:
    """Facts from onnxruntime's ``OrtEpDevice`` list (``get_ep_devices()``), QNN entries only."""
    types, facts, evidence = [], [], []
    for device in devices:
        if getattr(device, "ep_name", QNN_EP) != QNN_EP:
            continue
        hardware = device.device
        kind = getattr(hardware.type, "name", str(hardware.type)).split(".")[-1]
        types.append(kind)
        metadata = dict(hardware.metadata)
        evidence.append(
            f"onnxruntime offers {QNN_EP} on a {kind} device (vendor {hardware.vendor!r}, "
            f"id 0x{hardware.vendor_id:04x}:0x{hardware.device_id:04x}"
            + (f", metadata {metadata}" if metadata else ", no metadata")
            + ")"
        )
        for key, value in metadata.items():
            if str(value).strip():
                facts.append(ChipFact(f"onnxruntime {kind} device metadata {key}", str(value)))
    return EpDeviceFacts(tuple(types), tuple(facts), tuple(evidence))


# -- the device ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    """What is known of the NPU, how it was found, and what was looked at."""

    target: str | None
    soc_model: int | None
    htp_arch: int | None
    simulator: bool  # an x86 machine: QNN's HTP library there is a simulator
    source: str = ""  # how the chip was identified ("" = not identified)
    by: str = ""  # "target", "onnxruntime" or "os": which of the three ways identified it
    evidence: tuple[str, ...] = ()  # every fact looked at, for facts() and doctor
    npu: bool | None = None  # the QNN EP is offered on an NPU device (None: not asked yet)
    gpu: bool | None = None  # ... on a GPU device
    ep_types: tuple[str, ...] = ()
    detected: str | None = None  # the chip the machine reports, when target= named one

    @property
    def identified(self) -> bool:
        return self.htp_arch is not None

    def where(self) -> str:
        machine = native_machine()
        return f"the QNN HTP simulator on {machine}" if self.simulator else f"a {machine} device"

    def describe(self) -> str:
        if not self.identified:
            why = (
                "an x86 machine has no Snapdragon to read; QNN's HTP library here is the simulator"
                if self.simulator
                else "no chip name in " + (", ".join(self.evidence) or "anything read")
            )
            return f"not identified ({why})"
        return (
            f"{self.target} (soc {self.soc_model}, HTP v{self.htp_arch}) from {self.source}, "
            f"on {self.where()}"
        )

    def to_facts(self) -> dict[str, Any]:
        """A JSON-ready summary for ``LoadedModel.facts()`` and doctor."""
        return {
            "description": self.describe(),
            "identified": self.identified,
            "target": self.target,
            "soc_model": self.soc_model,
            "htp_arch": self.htp_arch,
            "simulator": self.simulator,
            "source": self.source or None,
            "identified_by": self.by or None,
            "detected": self.detected,
            "qnn_ep_devices": list(self.ep_types) if self.npu is not None else None,
            "evidence": list(self.evidence),
        }


def _from_target(chip: Target, source: str, **rest: Any) -> Device:
    return Device(chip.name, chip.soc_model, chip.htp_arch, source=source, **rest)


def detect_device(
    target: str | None = None,
    facts: list[ChipFact] | None = None,
    machine: str | None = None,
) -> Device:
    """The device from ``target=``, else from what the machine says (``os_chip_facts``).

    ``facts`` and ``machine`` default to this machine's; tests pass others.
    """
    machine = machine or native_machine()
    simulator = machine in ("x86_64", "x86")
    facts = _this_machine() if facts is None else facts
    evidence = tuple(str(f) for f in facts)
    found = _identify_facts(facts)
    if target is not None:
        try:
            chip = get_target(target)
        except UsageError as exc:
            raise UsageError(exc.message, tip="Pass target= as one of the names listed.") from None
        named = f"target={target!r}" + (f" ({chip.chip})" if target != chip.name else "")
        detected = f"{found[0].name} from {found[1]}" if found else None
        if found is not None and found[0].htp_arch != chip.htp_arch:
            warnings.warn(
                f"target={target!r} is HTP v{chip.htp_arch}, but this machine reports "
                f"{detected} (HTP v{found[0].htp_arch}); using target= as given.",
                RuntimeWarning,
                stacklevel=3,
            )
        return _from_target(
            chip, named, simulator=simulator, evidence=evidence, detected=detected, by="target"
        )
    if found is not None:
        chip, source = found
        return _from_target(chip, source, simulator=simulator, evidence=evidence, by="os")
    return Device(None, None, None, simulator, evidence=evidence)


@functools.lru_cache(maxsize=1)
def _this_machine() -> list[ChipFact]:
    """This machine's chip facts, read once per process (the chip does not change)."""
    return os_chip_facts()


def _identify_facts(facts: Iterable[ChipFact]) -> tuple[Target, str] | None:
    """The first fact that names a known chip, and a description of how."""
    for fact in facts:
        match = identify(fact.text)
        if match is not None:
            return match[0], f"{fact.source} {fact.text!r} ({match[1]})"
    return None


def with_ep_devices(device: Device, devices: Iterable[Any]) -> Device:
    """``device`` completed with onnxruntime's EP-device facts (needs the EP registered)."""
    return with_ep_facts(device, ep_device_facts(devices))


def with_ep_facts(device: Device, ep: EpDeviceFacts) -> Device:
    """``device`` with what onnxruntime says about the QNN EP's devices: which hardware the EP
    is offered on (an NPU, a GPU, or only the CPU as on the x86 simulator) and the OS's
    description of that hardware, which identifies the chip ahead of the OS's CPU facts (only
    ``target=`` comes first)."""
    evidence = (*device.evidence, *ep.evidence)
    updated = replace(device, npu=ep.npu, gpu=ep.gpu, ep_types=ep.types, evidence=evidence)
    found = _identify_facts(ep.chip_facts)
    if device.by == "target" or found is None:
        return updated
    chip, source = found
    detected = None
    if device.identified and device.target != chip.name:
        detected = f"{device.target} from {device.source}"
    return replace(
        updated,
        target=chip.name,
        soc_model=chip.soc_model,
        htp_arch=chip.htp_arch,
        source=source,
        by="onnxruntime",
        detected=detected,
    )


def device_for(target: str | None) -> Device:
    """This machine as ``detect_device`` sees it (without onnxruntime's EP devices)."""
    return detect_device(target)


# -- ONNX Runtime's compiled-model compatibility check ----------------------------------------------


@dataclass(frozen=True)
class Compatibility:
    """ONNX Runtime's verdict on one compiled model for this device, or why there is none."""

    verdict: str  # optimal | prefer_recompilation | unsupported | not_applicable | unavailable
    detail: str = ""

    @property
    def refuses(self) -> bool:
        return self.verdict == "unsupported"


_VERDICTS = {
    "EP_SUPPORTED_OPTIMAL": "optimal",
    "EP_SUPPORTED_PREFER_RECOMPILATION": "prefer_recompilation",
    "EP_UNSUPPORTED": "unsupported",
    "EP_NOT_APPLICABLE": "not_applicable",
}


def compatibility_function() -> tuple[Any, str]:
    """(``get_model_compatibility_for_ep_devices`` or None, where it was found or why not).

    onnxruntime 1.31.1 has it in ``onnxruntime.capi.onnxruntime_pybind11_state`` only (not at
    the package's top level); older releases do not have it."""
    import onnxruntime as ort

    function = getattr(ort, COMPATIBILITY_FUNCTION, None)
    if function is not None:
        return function, f"onnxruntime.{COMPATIBILITY_FUNCTION}"
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as native
    except ImportError:
        native = None
    function = getattr(native, COMPATIBILITY_FUNCTION, None)
    if function is not None:
        return function, f"onnxruntime.capi.onnxruntime_pybind11_state.{COMPATIBILITY_FUNCTION}"
    return None, f"onnxruntime {ort.__version__} has no {COMPATIBILITY_FUNCTION}"


_CHECKED: dict[str, Compatibility] = {}  # compatibility string -> verdict, in this process


def check_compiled_model(devices: list[Any], compatibility_info: str) -> Compatibility:
    """ONNX Runtime's check of a compiled model's ``ep_compatibility_info`` on this device.

    The QNN EP only answers for an NPU device; on the x86 simulator its device is the CPU, and
    the check is reported unavailable with that reason instead of raising. It is asked only
    before this process made a QNN EP instance: onnxruntime-qnn (2.7.0, and its source today)
    keeps a pointer to the last EP instance after releasing it and answers through it, which
    read freed memory and crashed the process here. Verdicts are kept for later loads.
    """
    if not compatibility_info:
        return Compatibility("unavailable", "the variant records no ep_compatibility_info")
    if compatibility_info in _CHECKED:
        return _CHECKED[compatibility_info]
    function, where = compatibility_function()
    if function is None:
        return Compatibility("unavailable", where)
    npu = [d for d in devices if _hardware_type(d) == "NPU" and d.ep_name == QNN_EP]
    if not npu:
        kinds = sorted({_hardware_type(d) for d in devices if d.ep_name == QNN_EP}) or ["none"]
        return Compatibility(
            "unavailable",
            f"onnxruntime offers {QNN_EP} on {'/'.join(kinds)} only; the QNN EP checks compiled "
            "models for an NPU device",
        )
    if qnn.ep_instances_possible():
        return Compatibility(
            "unavailable",
            "not asked: this process already made a QNN EP instance, after which onnxruntime-"
            "qnn's check can read freed memory (load the release first, or run doctor)",
        )
    try:
        result = function(npu, compatibility_info)
    except Exception as exc:  # onnxruntime's error types are not importable by name
        return Compatibility("unavailable", f"{where} failed: {exc}")
    name = getattr(result, "name", str(result)).split(".")[-1]
    verdict = Compatibility(_VERDICTS.get(name, name.lower()), f"{where}: {name}")
    _CHECKED[compatibility_info] = verdict
    return verdict


def _hardware_type(device: Any) -> str:
    kind = device.device.type
    return getattr(kind, "name", str(kind)).split(".")[-1]
