"""The QNN execution provider: finding and registering it, and reading what it compiled.

Shared by the device-side loader and the builder's compile stage, so the module imports only the
standard library at load time; ``numpy``, ``onnxruntime`` and ``onnxruntime_qnn`` are imported inside the
functions that need them. Nothing here needs ``onnx``: EP-context models are read with a small
protobuf reader over ``mmap``, so a multi-GB embedded context is never copied into memory.

Two generations of the EP exist. onnxruntime-qnn 2.x is a *plugin* library registered with the
regular ``onnxruntime`` and attached with ``add_provider_for_devices``; 1.x was a replacement
``onnxruntime`` wheel with the EP built in, attached with ``provider_options``. ``find_qnn_ep``
returns a ``QnnEp`` for either, and callers only use ``QnnEp.session_options``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import mmap
import re
import struct
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .errors import ToolchainError

EP_NAME = "QNNExecutionProvider"
COMPATIBILITY_KEY = f"ep_compatibility_info.{EP_NAME}"
# Log severities of onnxruntime: 0 verbose, 1 info, 2 warning, 3 error, 4 fatal.
LOG_WARNING = 2


# -- what is installed ----------------------------------------------------------------------------


@dataclass(frozen=True)
class InstalledQnn:
    """The onnxruntime-qnn this interpreter has, read without loading any QNN library."""

    package_version: str  # onnxruntime-qnn version, "" when not installed
    qnn_sdk: str  # bundled QNN SDK, e.g. "2.51.0"; "" when the package does not say
    onnxruntime: str  # the onnxruntime distribution beside it, "" when absent
    api: Literal["plugin", "provider-options", "none"]

    @property
    def present(self) -> bool:
        return self.api != "none"

    def describe(self) -> str:
        if not self.present:
            return f"no onnxruntime-qnn (onnxruntime {self.onnxruntime or 'absent'})"
        return (
            f"onnxruntime-qnn {self.package_version} (QNN SDK {self.qnn_sdk or '?'}) with "
            f"onnxruntime {self.onnxruntime or 'absent'}"
        )


def _distribution_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


def installed_qnn() -> InstalledQnn:
    """Versions of the installed QNN EP package; importing it loads no native library."""
    onnxruntime = _distribution_version("onnxruntime")
    try:
        info = importlib.import_module("onnxruntime_qnn.build_and_package_info")
    except ImportError:
        info = None
    if info is not None:
        version = str(getattr(info, "__version__", "")) or _distribution_version("onnxruntime-qnn")
        return InstalledQnn(version, str(getattr(info, "qnn_version", "")), onnxruntime, "plugin")
    # 1.x replaced the onnxruntime module itself; its build info names the package.
    legacy_version = _distribution_version("onnxruntime-qnn")
    if legacy_version:
        try:
            legacy = importlib.import_module("onnxruntime.capi.build_and_package_info")
            sdk = str(getattr(legacy, "qnn_version", ""))
        except ImportError:
            sdk = ""
        return InstalledQnn(legacy_version, sdk, legacy_version, "provider-options")
    return InstalledQnn("", "", onnxruntime, "none")


# -- attaching the EP to a session ---------------------------------------------------------------


@dataclass(frozen=True)
class QnnOptions:
    """The QNN EP options of one target: a typed view over the EP's string options."""

    backend_type: str = "htp"
    soc_model: int | None = None
    htp_arch: int | None = None
    extra: tuple[tuple[str, str], ...] = ()

    def provider_options(self) -> dict[str, str]:
        options = {"backend_type": self.backend_type}
        if self.soc_model is not None:
            options["soc_model"] = str(self.soc_model)
        if self.htp_arch is not None:
            options["htp_arch"] = str(self.htp_arch)
        options.update(dict(self.extra))
        return options


# How many SessionOptions with the QNN EP this process made (each becomes an EP instance when a
# session or compile uses it). ONNX Runtime's compiled-model compatibility check is only safe
# before the first: onnxruntime-qnn's factory keeps a pointer to the last EP instance after it is
# released and the check then reads freed memory (seen here as a segfault; see
# qnn_ctx_runtime.device.check_compiled_model).
_EP_OPTIONS_MADE = 0


def ep_instances_possible() -> bool:
    """True once this process may have created a QNN EP instance."""
    return _EP_OPTIONS_MADE > 0


@dataclass
class QnnEp:
    """A usable QNN EP in this process, and how to attach it to ``SessionOptions``."""

    installed: InstalledQnn
    library_path: str = ""
    devices: list[Any] = field(default_factory=list)  # OrtEpDevice, plugin only

    def session_options(
        self,
        options: QnnOptions,
        config: Mapping[str, str] | None = None,
        log_severity: int = LOG_WARNING,
    ) -> Any:
        """Fresh ``SessionOptions`` with the QNN EP attached; one per session or compile."""
        import onnxruntime as ort

        global _EP_OPTIONS_MADE
        _EP_OPTIONS_MADE += 1
        so = ort.SessionOptions()
        so.log_severity_level = log_severity
        for key, value in (config or {}).items():
            so.add_session_config_entry(key, value)
        provider = options.provider_options()
        if self.installed.api == "plugin":
            so.add_provider_for_devices(self.devices, provider)
        else:
            # 1.x: built-in EP with provider options. FACTS §9: never set backend_type beside a
            # backend_path, the EP then refuses to start and ORT silently runs on CPU.
            if "backend_path" in provider:
                provider.pop("backend_type", None)
            so.add_provider(EP_NAME, provider)
        return so


_REGISTERED: dict[str, QnnEp] = {}


def find_qnn_ep() -> QnnEp:
    """Register the installed QNN EP once per process and return it.

    Raises ToolchainError when there is none, or when the plugin registers but offers no device,
    which is what a wrong onnxruntime beside it looks like.
    """
    installed = installed_qnn()
    if not installed.present:
        raise ToolchainError(
            f"No QNN execution provider in {sys.executable}: onnxruntime-qnn is not installed.",
            tip="Run the compile stage through `nox -s compile_ctx`, which installs a pinned "
            "onnxruntime-qnn and onnxruntime pair.",
        )
    cached = _REGISTERED.get(installed.api)
    if cached is not None:
        return cached
    import onnxruntime as ort

    if installed.api == "provider-options":
        if EP_NAME not in ort.get_available_providers():
            raise ToolchainError(
                f"{installed.describe()} is installed but onnxruntime lists no {EP_NAME}.",
                tip="Reinstall onnxruntime-qnn alone; a plain onnxruntime wheel overwrote it.",
            )
        ep = QnnEp(installed)
    else:
        oq = importlib.import_module("onnxruntime_qnn")
        library = str(oq.get_library_path())
        devices = [d for d in ort.get_ep_devices() if d.ep_name == EP_NAME]
        if not devices:
            try:
                ort.register_execution_provider_library(EP_NAME, library)
            except Exception as exc:  # onnxruntime raises its own Fail/RuntimeError types
                raise ToolchainError(
                    f"onnxruntime {installed.onnxruntime} could not register the QNN EP library "
                    f"{library}: {exc}",
                    tip=pairing_tip(installed),
                ) from exc
            devices = [d for d in ort.get_ep_devices() if d.ep_name == EP_NAME]
        if not devices:
            raise ToolchainError(
                f"The QNN EP library registered but offers no device ({installed.describe()}).",
                tip=pairing_tip(installed),
            )
        ep = QnnEp(installed, library, devices)
    _REGISTERED[installed.api] = ep
    return ep


def pairing_tip(installed: InstalledQnn) -> str:
    return (
        f"onnxruntime-qnn {installed.package_version or '?'} needs the onnxruntime version it was "
        "verified with (qnn_ctx_runtime/toolchains.toml); a wrong pair makes ORT fall back to CPU."
    )


# Messages onnxruntime gives when the plugin was built for another EP API version (FACTS §2).
_PAIRING_SYMPTOMS = (
    "ort_version_supported",
    "SanityCheckOrtEp",
    "Error creating execution provider",
)


def looks_like_wrong_pair(message: str) -> bool:
    return any(s in message for s in _PAIRING_SYMPTOMS)


# -- versions and compatibility strings -----------------------------------------------------------


def sdk_version(text: str) -> str:
    """'v2.51.0.260929181845' or '2.51.0' -> '2.51.0': the first three numeric parts."""
    parts = []
    for piece in text.strip().lstrip("vV").split(".")[:3]:
        digits = re.match(r"\d+", piece)
        if not digits:
            break
        parts.append(str(int(digits.group())))
    return ".".join(parts)


@dataclass(frozen=True)
class CompatibilityInfo:
    """The QNN EP's ``ep_compatibility_info`` model metadata, parsed.

    v2 (onnxruntime-qnn >= 2.5): ``v2:<backend>:<sdk>:<backend api>:<htp archs>:<soc models>:..``
    v1 (2.3.0):                  ``<backend>:<sdk>:<backend api>:<blob version>:<htp arch>:<usr drv>``
    v1 has no soc model: only the arch can be checked.
    """

    raw: str
    format: Literal["v1", "v2"]
    backend_id: int
    sdk: str
    backend_api: str
    htp_archs: tuple[int, ...]
    soc_models: tuple[int, ...]


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.split(r"[,;|/ ]+", text.strip()) if x.isdigit())


def parse_compatibility_info(raw: str) -> CompatibilityInfo:
    """Parse either format; a string in neither raises ValueError naming it."""
    fields = raw.strip().split(":")
    try:
        if fields[0] == "v2" and len(fields) >= 6:
            return CompatibilityInfo(
                raw=raw,
                format="v2",
                backend_id=int(fields[1]),
                sdk=fields[2],
                backend_api=fields[3],
                htp_archs=_int_list(fields[4]),
                soc_models=_int_list(fields[5]),
            )
        if len(fields) == 6 and fields[0].isdigit():
            return CompatibilityInfo(
                raw=raw,
                format="v1",
                backend_id=int(fields[0]),
                sdk=fields[1],
                backend_api=fields[2],
                htp_archs=_int_list(fields[4]),
                soc_models=(),
            )
    except ValueError:
        pass
    raise ValueError(f"unknown {COMPATIBILITY_KEY} format: {raw!r}")


def compatibility_problems(info: CompatibilityInfo, soc_model: int, htp_arch: int) -> list[str]:
    """Why a compiled model is not what was asked for (empty when it is)."""
    problems = []
    if htp_arch not in info.htp_archs:
        problems.append(f"built for HTP arch {list(info.htp_archs)}, not the requested {htp_arch}")
    if info.format == "v2" and soc_model not in info.soc_models:
        problems.append(f"built for soc_model {list(info.soc_models)}, not {soc_model}")
    return problems


# -- reading models without onnx --------------------------------------------------------------------
#
# Only the fields below are decoded; everything else (initializer data, the context binary) is
# skipped by length. Field numbers are those of onnx/onnx.proto3.

_TENSOR_TYPES = {
    1: "float32",
    2: "uint8",
    3: "int8",
    4: "uint16",
    5: "int16",
    6: "int32",
    7: "int64",
    9: "bool",
    10: "float16",
    11: "float64",
    12: "uint32",
    13: "uint64",
    16: "bfloat16",
}


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(buf: memoryview) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, int or memoryview) for each field of one message."""
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = int.from_bytes(buf[pos : pos + 8], "little"), pos + 8
        elif wire == 2:
            length, pos = _varint(buf, pos)
            value, pos = buf[pos : pos + length], pos + length
        elif wire == 5:
            value, pos = int.from_bytes(buf[pos : pos + 4], "little"), pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield number, wire, value


def _text(value: memoryview) -> str:
    return bytes(value).decode("utf-8", errors="replace")


@dataclass
class NodeInfo:
    name: str
    op_type: str
    domain: str
    inputs: list[str]
    outputs: list[str]
    # int and string attributes; a string attribute longer than 4 KiB (the embedded context
    # binary) is replaced by its size as "<N bytes>".
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass
class ValueInfo:
    name: str
    dtype: str
    shape: list[int | str]


@dataclass
class ModelSummary:
    ir_version: int
    opsets: dict[str, int]
    metadata: dict[str, str]
    inputs: list[ValueInfo]
    outputs: list[ValueInfo]
    nodes: list[NodeInfo]
    initializers: set[str]
    # Small int64 initializers (at most SMALL_INTS elements: a TopK's K, axes, shapes) by name.
    small_ints: dict[str, list[int]] = field(default_factory=dict)

    def nodes_of(self, op_type: str) -> list[NodeInfo]:
        return [n for n in self.nodes if n.op_type == op_type]


def _attribute(buf: memoryview) -> tuple[str, Any]:
    name, value, kind = "", None, 0
    for number, _, raw in _fields(buf):
        if number == 1:
            name = _text(raw)
        elif number == 3:  # i
            value = raw - (1 << 64) if raw >= 1 << 63 else raw
        elif number == 4:  # s
            value = _text(raw) if len(raw) <= 4096 else f"<{len(raw)} bytes>"
        elif number == 2:  # f (fixed32)
            value = struct.unpack("<f", raw.to_bytes(4, "little"))[0]
        elif number == 20:
            kind = raw
    return name, value if value is not None else f"<attribute type {kind}>"


def _node(buf: memoryview) -> NodeInfo:
    node = NodeInfo("", "", "", [], [])
    for number, _, raw in _fields(buf):
        if number == 1:
            node.inputs.append(_text(raw))
        elif number == 2:
            node.outputs.append(_text(raw))
        elif number == 3:
            node.name = _text(raw)
        elif number == 4:
            node.op_type = _text(raw)
        elif number == 7:
            node.domain = _text(raw)
        elif number == 5:
            key, value = _attribute(raw)
            node.attributes[key] = value
    return node


def _value_info(buf: memoryview) -> ValueInfo:
    info = ValueInfo("", "", [])
    for number, _, raw in _fields(buf):
        if number == 1:
            info.name = _text(raw)
        elif number == 2:  # TypeProto
            for tnum, _, traw in _fields(raw):
                if tnum != 1:  # tensor_type only
                    continue
                for knum, _, kraw in _fields(traw):
                    if knum == 1:
                        info.dtype = _TENSOR_TYPES.get(kraw, f"type{kraw}")
                    elif knum == 2:
                        for _, _, draw in _fields(kraw):
                            dim: int | str = "?"
                            for dnum, _, dval in _fields(draw):
                                dim = dval if dnum == 1 else _text(dval) if dnum == 2 else dim
                            info.shape.append(dim)
    return info


SMALL_INTS = 8  # elements of an int64 initializer the summary keeps the values of
_INT64 = 7  # TensorProto.INT64


def _initializer(buf: memoryview) -> tuple[str, list[int] | None]:
    """An initializer's name, and its values when it is a small int64 tensor (else None)."""
    name, kind, count, values, raw_data = "", 0, 1, [], None
    for number, wire, raw in _fields(buf):
        if number == 8:
            name = _text(raw)
        elif number == 2:
            kind = raw
        elif number == 1:  # dims: one varint each, or packed
            for dim in [raw] if wire == 0 else _packed_varints(raw):
                count *= dim
        elif number == 7:  # int64_data: one varint each, or packed
            values.extend([raw] if wire == 0 else _packed_varints(raw))
        elif number == 9:
            raw_data = raw
    if kind != _INT64 or count > SMALL_INTS:
        return name, None
    if raw_data is not None:
        values = list(struct.unpack(f"<{len(raw_data) // 8}q", raw_data))
    else:
        values = [v - (1 << 64) if v >= 1 << 63 else v for v in values]
    return name, values if len(values) == count else None


def _packed_varints(buf: memoryview) -> Iterator[int]:
    pos = 0
    while pos < len(buf):
        value, pos = _varint(buf, pos)
        yield value


def read_model_summary(path: str | Path) -> ModelSummary:
    """Graph I/O, nodes, metadata and opsets of an ONNX file, without loading tensor data."""
    path = Path(path)
    with open(path, "rb") as handle:
        if path.stat().st_size == 0:
            raise ValueError(f"{path} is empty")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                return _summary(view)
            finally:
                view.release()


def _summary(view: memoryview) -> ModelSummary:
    summary = ModelSummary(0, {}, {}, [], [], [], set())
    for number, _, raw in _fields(view):
        if number == 1:
            summary.ir_version = raw
        elif number == 8:
            domain, version = "", 0
            for onum, _, oraw in _fields(raw):
                domain = _text(oraw) if onum == 1 else domain
                version = oraw if onum == 2 else version
            summary.opsets[domain or "ai.onnx"] = version
        elif number == 14:
            key = value = ""
            for mnum, _, mraw in _fields(raw):
                key = _text(mraw) if mnum == 1 else key
                value = _text(mraw) if mnum == 2 else value
            summary.metadata[key] = value
        elif number == 7:
            for gnum, _, graw in _fields(raw):
                if gnum == 1:
                    summary.nodes.append(_node(graw))
                elif gnum == 11:
                    summary.inputs.append(_value_info(graw))
                elif gnum == 12:
                    summary.outputs.append(_value_info(graw))
                elif gnum == 5:
                    name, values = _initializer(graw)
                    summary.initializers.add(name)
                    if values is not None:
                        summary.small_ints[name] = values
    # Graph inputs that are initializers (old exporters) are not real inputs.
    summary.inputs = [i for i in summary.inputs if i.name not in summary.initializers]
    return summary
