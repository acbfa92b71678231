"""Load a published release on a device and run it on the NPU, or refuse clearly.

``load(release_dir_or_archive, target=None)`` verifies every file against the manifest, extracts
archives safely, reads the QNN SDK the installed ``onnxruntime-qnn`` bundles, and picks the best
variant this runtime and device can run. A context binary built with a newer QNN SDK than the
runtime's, or for a newer HTP arch than the device's, fails inside QNN with an error that names
no version (FACTS §3); here it is refused *before* any QNN call, with the fix.

Imports only the standard library, numpy and onnxruntime (Windows ARM64 has little else);
onnxruntime and onnxruntime_qnn are imported when first needed. Attaching the EP is left to
``pipeline.qnn``, which knows both the 2.x plugin API and the 1.x ``provider_options`` style.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import sys
import tarfile
import tempfile
import warnings
import weakref
import zipfile
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from . import qnn
from .errors import ConfigError, PipelineError, ReleaseError
from .fileio import sha256_file
from .manifest import MANIFEST_FILE, Manifest, TensorInfo, Variant, safe_relative_path
from .targets import TARGETS, get_target

QNN_EP = qnn.EP_NAME
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".zip")
_CHUNK = 1 << 20

# onnxruntime-qnn release -> (bundled QNN SDK, onnxruntime verified beside it or ""), FACTS §1-2.
# Used for fix suggestions when configs/toolchains.toml (the pins) is not at hand, e.g. on a device.
BUILTIN_TOOLCHAINS: dict[str, tuple[str, str]] = {
    "2.3.0": ("2.47.0", "1.26.0"),
    "2.4.0": ("2.48.40", ""),
    "2.5.0": ("2.49.40", "1.31.1"),
    "2.6.0": ("2.50.40", ""),
    "2.7.0": ("2.51.0", "1.31.1"),
}


def parse_version(text: str) -> tuple[int, ...]:
    """'v2.51.0.260929181845' or '2.51.0' -> (2, 51, 0): SDKs compare on their first 3 parts."""
    return tuple(int(part) for part in qnn.sdk_version(text).split(".") if part)


def known_toolchains() -> dict[str, tuple[str, str]]:
    """onnxruntime-qnn version -> (QNN SDK, onnxruntime): the project's pins over the table."""
    table = dict(BUILTIN_TOOLCHAINS)
    try:
        from .toolchains import load_pins  # stdlib-only; absent configs/ raises ConfigError

        for version, pin in load_pins().toolchains.items():
            table[version] = (pin.qnn_sdk, pin.onnxruntime)
    except (ImportError, PipelineError):
        pass
    return table


def toolchain_for_sdk(qnn_sdk: str) -> str | None:
    """The onnxruntime-qnn release that bundles exactly this QNN SDK, if known."""
    wanted = parse_version(qnn_sdk)
    return next(
        (v for v, (sdk, _) in known_toolchains().items() if parse_version(sdk) == wanted), None
    )


def _cpu_session_options() -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only
    return options


# -- the device ---------------------------------------------------------------------------------


def native_machine() -> str:
    """The hardware's architecture, even from an emulated process ('arm64', 'x86_64', ...)."""
    if sys.platform == "win32":
        with contextlib.suppress(Exception):
            import ctypes

            process, native = ctypes.c_ushort(), ctypes.c_ushort()
            kernel32 = ctypes.windll.kernel32  # type: ignore[attr-defined]
            if kernel32.IsWow64Process2(
                kernel32.GetCurrentProcess(), ctypes.byref(process), ctypes.byref(native)
            ):
                machines = {0xAA64: "arm64", 0x8664: "x86_64", 0x14C: "x86"}
                return machines.get(native.value, hex(native.value))
    return _normalize_machine(platform.machine())


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
    except ConfigError as exc:
        raise ReleaseError(exc.message, tip="Pass target= as one of the names listed.") from None
    return Device(chip.name, chip.soc_model, chip.htp_arch, simulator)


# -- choosing a variant -------------------------------------------------------------------------


def _fits(variant: Variant, runtime_sdk: str, device: Device) -> list[str]:
    """Why ``variant`` cannot run here (empty: it can)."""
    reasons = []
    if runtime_sdk and parse_version(variant.qnn_sdk_version) > parse_version(runtime_sdk):
        reasons.append(f"built with QNN SDK {variant.qnn_sdk_version} > runtime's {runtime_sdk}")
    if device.htp_arch is not None and variant.htp_arch > device.htp_arch:
        reasons.append(f"built for HTP v{variant.htp_arch} > device's v{device.htp_arch}")
    if variant.backend != "htp":
        reasons.append(f"backend {variant.backend!r}, not htp")
    if variant.buckets is not None:
        from .bucket_runtime import fit_problems

        reasons += fit_problems(variant, device.simulator)
    return reasons


def choose_variant(manifest: Manifest, runtime: qnn.InstalledQnn, device: Device) -> Variant:
    """The best variant for this runtime and device, or a ReleaseError that says how to fix it.

    Rule: binary SDK <= runtime SDK and binary arch <= device arch; prefer the device's exact
    arch and chip, then the newest SDK. No QNN code runs here.
    """
    passing = [v for v in manifest.variants if v.passed]
    if not passing:
        raise ReleaseError(
            f"Release {manifest.model} {manifest.version} has no variant that passed its gates"
            f" (variants: {', '.join(v.id for v in manifest.variants) or 'none'}).",
            tip="Fix the build and publish without --allow-partial.",
        )
    runtime_sdk = runtime.qnn_sdk
    fitting = [v for v in passing if not _fits(v, runtime_sdk, device)]
    if fitting:

        def rank(v: Variant) -> tuple[bool, bool, tuple[int, ...], int, bool]:
            return (
                v.htp_arch == device.htp_arch,
                v.soc_model == device.soc_model,
                parse_version(v.qnn_sdk_version),
                v.htp_arch,
                v.buckets is None or v.buckets.shared_binary is not None,  # weight-shared first
            )

        if not runtime_sdk:  # cannot compare: the oldest SDK is the likeliest to load
            return min(fitting, key=lambda v: parse_version(v.qnn_sdk_version))
        return max(fitting, key=rank)
    raise _no_fit_error(manifest, passing, runtime, device)


def _no_fit_error(
    manifest: Manifest, passing: list[Variant], runtime: qnn.InstalledQnn, device: Device
) -> ReleaseError:
    sdks = sorted({v.qnn_sdk_version for v in passing}, key=parse_version)
    lines = [f"  - {v.id}: {'; '.join(_fits(v, runtime.qnn_sdk, device))}" for v in passing]
    message = (
        f"No variant of release {manifest.model} {manifest.version} can run here: the runtime is "
        f"{runtime.describe()} and the {device.describe()}; the release has QNN SDK "
        f"{', '.join(sdks)}.\n" + "\n".join(lines)
    )
    fixes = []
    arch_ok = [v for v in passing if device.htp_arch is None or v.htp_arch <= device.htp_arch]
    newer = [
        v for v in arch_ok if parse_version(v.qnn_sdk_version) > parse_version(runtime.qnn_sdk)
    ]
    if newer:
        oldest = min(newer, key=lambda v: parse_version(v.qnn_sdk_version))
        known = known_toolchains().get(oldest.onnxruntime_qnn, ("", ""))
        ort_version = oldest.onnxruntime or known[1]
        fixes.append(
            f"install onnxruntime-qnn {oldest.onnxruntime_qnn} (QNN SDK {oldest.qnn_sdk_version})"
            + (f" with onnxruntime {ort_version}" if ort_version else "")
        )
        toolchain = toolchain_for_sdk(runtime.qnn_sdk)
        fixes.append(
            f"rebuild with toolchain {toolchain} (QNN SDK {runtime.qnn_sdk}) in compile.toolchains"
            if toolchain
            else f"rebuild with a toolchain whose QNN SDK is <= {runtime.qnn_sdk}"
        )
    if not arch_ok:
        fixes.append(
            f"add target {device.target!r} (HTP v{device.htp_arch}) to compile.targets and rebuild"
        )
    if device.simulator and any(v.buckets and v.buckets.shared_binary for v in passing):
        fixes.append(
            'run it on the device, or publish with [buckets] packaging = ["shared", '
            '"standalone"] for a variant the simulator loads'
        )
    tip = "; or ".join(fixes)
    return ReleaseError(message, tip=tip[:1].upper() + tip[1:] + ".")


# -- opening and verifying a release ------------------------------------------------------------


def _is_archive(path: Path) -> bool:
    return path.is_file() and path.name.lower().endswith(ARCHIVE_SUFFIXES)


def _copy_hashing(source: IO[bytes], target: IO[bytes]) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    while chunk := source.read(_CHUNK):
        digest.update(chunk)
        target.write(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


def _raise_issues(what: str, issues: list[str], tip: str) -> None:
    if issues:
        shown = issues[:25] + ([f"… and {len(issues) - 25} more"] if len(issues) > 25 else [])
        raise ReleaseError(f"{what}:\n  - " + "\n  - ".join(shown), tip=tip)


_TAMPERED_TIP = "Do not use this copy: download or publish the release again."


def verify_folder(root: Path) -> Manifest:
    """Check a release folder: a valid manifest, and every listed file with its exact bytes."""
    root = Path(root)
    manifest = Manifest.read(root / MANIFEST_FILE)
    issues = []
    base = root.resolve()
    for entry in manifest.files():
        path = root / entry.path
        if path.is_symlink():
            issues.append(f"{entry.path} is a symbolic link")
        elif not path.resolve().is_relative_to(base):
            issues.append(f"{entry.path} points outside the release folder")
        elif not path.is_file():
            issues.append(f"{entry.path} is listed in the manifest but missing")
        else:
            sha256, size = sha256_file(path), path.stat().st_size
            if sha256 != entry.sha256 or size != entry.size:
                issues.append(
                    f"{entry.path}: sha256 {sha256[:16]}… ({size} bytes) does not match the "
                    f"manifest's {entry.sha256[:16]}… ({entry.size} bytes); it was modified"
                )
    _raise_issues(f"Release {root} failed verification", issues, _TAMPERED_TIP)
    return manifest


def _check_archive_checksum(archive: Path) -> None:
    """If ``<archive>.sha256`` is beside it, the archive's bytes must match."""
    sidecar = archive.with_name(archive.name + ".sha256")
    if not sidecar.is_file():
        return
    words = sidecar.read_text("utf-8", errors="replace").split()
    expected = words[0].lower() if words else ""
    actual = sha256_file(archive)
    if actual != expected:
        raise ReleaseError(
            f"{archive}: sha256 {actual} does not match {sidecar.name} ({expected or 'empty'}).",
            tip=_TAMPERED_TIP,
        )


@dataclass
class _Member:
    name: str
    kind: str  # "file", "dir", "link", "other"
    handle: Any


def _members(archive: Path, opened: Any) -> list[_Member]:
    out = []
    if isinstance(opened, zipfile.ZipFile):
        for info in opened.infolist():
            mode = (info.external_attr >> 16) & 0o170000
            kind = (
                "link"
                if mode == 0o120000
                else "dir"
                if info.is_dir()
                else "file"
                if mode in (0, 0o100000)
                else "other"
            )
            out.append(_Member(info.filename.rstrip("/"), kind, info))
    else:
        for info in opened.getmembers():
            kind = (
                "link"
                if info.issym() or info.islnk()
                else "dir"
                if info.isdir()
                else "file"
                if info.isfile()
                else "other"
            )
            out.append(_Member(info.name.rstrip("/"), kind, info))
    return out


def _open_member(opened: Any, member: _Member) -> IO[bytes]:
    if isinstance(opened, zipfile.ZipFile):
        return opened.open(member.handle)
    handle = opened.extractfile(member.handle)
    if handle is None:
        raise ReleaseError(f"Cannot read {member.name} from the archive.", tip=_TAMPERED_TIP)
    return handle


def _open_archive(archive: Path) -> Any:
    try:
        if archive.name.lower().endswith(".zip"):
            return zipfile.ZipFile(archive)
        return tarfile.open(archive, "r:*")
    except (tarfile.TarError, zipfile.BadZipFile, OSError, EOFError) as exc:
        raise ReleaseError(
            f"{archive} is not a readable archive: {exc}.", tip=_TAMPERED_TIP
        ) from None


def extract_archive(archive: Path, dest: Path) -> Manifest:
    """Safely extract a release archive into the empty folder ``dest`` and verify it.

    Refused, listing every offender: absolute paths, '..', links and special files, files not in
    the manifest, manifest files missing from the archive, and any byte that differs.
    """
    archive = Path(archive)
    _check_archive_checksum(archive)
    try:
        return _extract(archive, Path(dest))
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, OSError) as exc:
        raise ReleaseError(
            f"{archive} is damaged or truncated: {type(exc).__name__}: {exc}.", tip=_TAMPERED_TIP
        ) from None


def _extract(archive: Path, dest: Path) -> Manifest:
    with _open_archive(archive) as opened:
        members = _members(archive, opened)
        issues = []
        files: dict[str, _Member] = {}
        for member in members:
            problem = safe_relative_path(member.name)
            if problem:
                issues.append(f"{member.name!r} {problem}")
            elif member.kind == "link":
                issues.append(f"{member.name} is a link")
            elif member.kind == "other":
                issues.append(f"{member.name} is not a regular file or folder")
            elif member.kind == "file":
                if member.name in files:
                    issues.append(f"{member.name} appears twice")
                files[member.name] = member
        _raise_issues(f"In {archive}, unsafe members", issues, _TAMPERED_TIP)
        if MANIFEST_FILE not in files:
            raise ReleaseError(f"{archive} has no {MANIFEST_FILE}.", tip=_TAMPERED_TIP)
        with _open_member(opened, files[MANIFEST_FILE]) as handle:
            manifest = Manifest.from_json(handle.read(), f"{archive}!{MANIFEST_FILE}")
        listed = {entry.path: entry for entry in manifest.files()}
        for name in sorted(files.keys() - listed.keys() - {MANIFEST_FILE}):
            issues.append(f"{name} is in the archive but not in the manifest")
        for name in sorted(listed.keys() - files.keys()):
            issues.append(f"{name} is in the manifest but not in the archive")
        _raise_issues(f"In {archive}, archive and manifest disagree", issues, _TAMPERED_TIP)

        base = Path(dest).resolve()
        base.mkdir(parents=True, exist_ok=True)
        for name, member in files.items():
            target = (base / name).resolve()
            if not target.is_relative_to(base):  # defence in depth after safe_relative_path
                raise ReleaseError(f"In {archive}, {name} escapes the extraction folder.")
            target.parent.mkdir(parents=True, exist_ok=True)
            with _open_member(opened, member) as source, open(target, "xb") as out:
                sha256, size = _copy_hashing(source, out)
            entry = listed.get(name)
            if entry is not None and (sha256 != entry.sha256 or size != entry.size):
                issues.append(
                    f"{name}: sha256 {sha256[:16]}… ({size} bytes) does not match the "
                    f"manifest's {entry.sha256[:16]}… ({entry.size} bytes)"
                )
        _raise_issues(f"In {archive}, files were modified", issues, _TAMPERED_TIP)
    return manifest


@contextlib.contextmanager
def opened_release(path: str | os.PathLike[str]) -> Iterator[tuple[Path, Manifest]]:
    """(folder, verified manifest) of a release folder or archive, for the block's duration."""
    path = Path(path)
    if path.is_dir():
        yield path, verify_folder(path)
        return
    if not _is_archive(path):
        raise ReleaseError(
            f"{path} is neither a release folder nor a release archive "
            f"({', '.join(ARCHIVE_SUFFIXES)}).",
            tip="Pass artifacts/releases/<model>/<version> or the archive inside it.",
        )
    folder = Path(tempfile.mkdtemp(prefix="qnn-release-"))
    try:
        yield folder, extract_archive(path, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def verify(path: str | os.PathLike[str]) -> Manifest:
    """Verify a release folder or archive completely; return its manifest."""
    with opened_release(path) as (_, manifest):
        return manifest


# -- the loaded model ---------------------------------------------------------------------------


class LoadedModel:
    """A session on the chosen variant, with the facts that explain the choice."""

    def __init__(
        self,
        root: Path,
        manifest: Manifest,
        variant: Variant | None,
        runtime: qnn.InstalledQnn | None,
        device: Device,
        fallback_reason: str = "",
        cleanup: Path | None = None,
    ) -> None:
        self.root = root
        self.manifest = manifest
        self.variant = variant
        self.runtime = runtime
        self.device = device
        self.fallback_reason = fallback_reason
        self.restarts = 0
        self._finalizer: weakref.finalize | None = None
        if variant is not None:
            self.model_path = root / variant.model
            self.inputs: list[TensorInfo] = variant.inputs
            self.outputs: list[TensorInfo] = variant.outputs
        else:
            cpu = manifest.cpu_fallback
            if cpu is None:  # load() checks this first
                raise ReleaseError(f"Release {manifest.model} has no CPU model.")
            self.model_path = root / cpu.model
            self.inputs = manifest.variants[0].inputs if manifest.variants else []
            self.outputs = manifest.variants[0].outputs if manifest.variants else []
        self._session = self._create_session()
        # Only a model that opened owns the extracted folder; a failed attempt must not delete
        # it under the CPU fallback that may follow.
        if cleanup is not None:
            self._finalizer = weakref.finalize(self, shutil.rmtree, str(cleanup), True)

    @property
    def on_cpu(self) -> bool:
        return self.variant is None

    @property
    def provider(self) -> str:
        return "CPUExecutionProvider" if self.on_cpu else QNN_EP

    def facts(self) -> dict[str, Any]:
        """What runs, where, and why: for logs and bug reports."""
        v = self.variant
        return {
            "model": self.manifest.model,
            "version": self.manifest.version,
            "variant": v.id if v else "cpu-fallback",
            "provider": self.provider,
            "target": v.target if v else None,
            "soc_model": v.soc_model if v else None,
            "htp_arch": v.htp_arch if v else None,
            "qnn_sdk_version": v.qnn_sdk_version if v else None,
            "runtime": self.runtime.describe() if self.runtime else None,
            "device": self.device.describe(),
            "fallback_reason": self.fallback_reason or None,
            **({"buckets": [e.name for e in v.buckets.entries]} if v and v.buckets else {}),
        }

    def _create_session(self) -> Any:
        if self.variant is None:
            import onnxruntime as ort

            return ort.InferenceSession(
                str(self.model_path),
                sess_options=_cpu_session_options(),
                providers=["CPUExecutionProvider"],
            )
        if self.runtime is None:  # load() checks this first
            raise ReleaseError("onnxruntime-qnn is not installed.")
        if self.variant.buckets is not None:  # a session per shape bucket, see bucket_runtime
            from .bucket_runtime import BucketSessions

            return BucketSessions(self.root, self.variant)
        import onnxruntime as ort

        options = qnn.find_qnn_ep().session_options(
            qnn.QnnOptions(backend_type=self.variant.backend),
            # Never compile online: a ctx model QNN cannot take as-is must fail, not recompile.
            {"session.disable_model_compile": "1"},
            log_severity=3,
        )
        session = ort.InferenceSession(str(self.model_path), sess_options=options)
        if QNN_EP not in session.get_providers():
            raise ReleaseError(
                f"The QNN EP did not attach to {self.model_path.name}; onnxruntime fell back to CPU "
                f"(providers: {session.get_providers()}).",
                tip="Run `python -m pipeline doctor` to check the onnxruntime / onnxruntime-qnn pair.",
            )
        return session

    def _check_feeds(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        issues, arrays = [], {}
        expected = {t.name: t for t in self.inputs}
        for name in feeds:
            if name not in expected:
                issues.append(f"{name!r} is not an input (inputs: {', '.join(expected)})")
        for name, spec in expected.items():
            if name not in feeds:
                issues.append(f"input {name!r} is missing")
                continue
            array = np.asarray(feeds[name])
            if array.dtype != np.dtype(spec.dtype):
                issues.append(f"input {name!r} has dtype {array.dtype}, expected {spec.dtype}")
            if list(array.shape) != list(spec.shape):
                issues.append(
                    f"input {name!r} has shape {list(array.shape)}, expected {spec.shape}"
                )
            arrays[name] = array
        if issues:
            raise PipelineError(
                f"Bad feeds for {self.manifest.model}: " + "; ".join(issues) + ".",
                tip="Feed numpy arrays with the names, shapes and dtypes listed in model.inputs.",
            )
        return arrays

    def run(
        self, feeds: Mapping[str, Any], output_names: list[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Run once; on an HTP subsystem restart (ENGINE_ERROR) recreate the session and retry once."""
        from onnxruntime.capi.onnxruntime_pybind11_state import EngineError

        if self.buckets is not None:  # pad into the smallest bucket, run, crop back
            return self.buckets.run(feeds, output_names)
        arrays = self._check_feeds(feeds)
        names = output_names or [t.name for t in self.outputs]
        try:
            values = self._session.run(names, arrays)
        except EngineError as first:
            warnings.warn(
                f"QNN reported ENGINE_ERROR ({first}); recreating the session once, as after an "
                "HTP subsystem restart.",
                RuntimeWarning,
                stacklevel=2,
            )
            self.restarts += 1
            self._session = None
            try:
                self._session = self._create_session()
                values = self._session.run(names, arrays)
            except PipelineError:
                raise
            except Exception as second:
                raise ReleaseError(
                    f"QNN failed again after ENGINE_ERROR and recreating the session: {second}",
                    tip="The NPU is not recovering; restart the device or use allow_cpu_fallback.",
                ) from second
        return dict(zip(names, values, strict=True))

    @property
    def buckets(self) -> Any:
        """The ``BucketSessions`` of a bucketed variant (``.last`` = padding applied), else None."""
        from .bucket_runtime import BucketSessions

        return self._session if isinstance(self._session, BucketSessions) else None

    def close(self) -> None:
        self._session = None
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> LoadedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        facts = self.facts()
        return f"<LoadedModel {facts['model']} {facts['version']} {facts['variant']} on {facts['provider']}>"


def load(
    release: str | os.PathLike[str],
    target: str | None = None,
    allow_cpu_fallback: bool = False,
    extract_to: str | os.PathLike[str] | None = None,
) -> LoadedModel:
    """Open a release folder or archive and return a model bound to its best variant here.

    ``target`` names the device's chip (see pipeline.targets); without it the HTP arch is not
    checked (on the x86 simulator every arch runs). ``allow_cpu_fallback`` runs the release's CPU
    model, with a RuntimeWarning, when no variant can run; otherwise that is a ReleaseError.
    ``extract_to`` is an empty folder to extract an archive into (kept); by default a temporary
    folder is used and removed by ``close()``.
    """
    path = Path(release)
    device = device_for(target)
    cleanup: Path | None = None
    if path.is_dir():
        root, manifest = path, verify_folder(path)
    elif _is_archive(path):
        if extract_to is None:
            root = cleanup = Path(tempfile.mkdtemp(prefix="qnn-release-"))
        else:
            root = Path(extract_to)
            if root.exists() and any(root.iterdir()):
                raise ReleaseError(f"extract_to={root} is not empty.", tip="Pass an empty folder.")
        try:
            manifest = extract_archive(path, root)
        except BaseException:
            if cleanup is not None:
                shutil.rmtree(cleanup, ignore_errors=True)
            raise
    else:
        raise ReleaseError(
            f"{path} is neither a release folder nor a release archive "
            f"({', '.join(ARCHIVE_SUFFIXES)}).",
            tip="Pass artifacts/releases/<model>/<version> or the archive inside it.",
        )
    try:
        return _bind(root, manifest, device, allow_cpu_fallback, cleanup)
    except BaseException:
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)
        raise


def _bind(
    root: Path, manifest: Manifest, device: Device, allow_cpu: bool, cleanup: Path | None
) -> LoadedModel:
    """Choose and open a variant, or fall back to the CPU model when (and only when) allowed."""
    installed = qnn.installed_qnn()
    runtime = installed if installed.present else None
    try:
        if emulated_on_arm64():
            raise ReleaseError(
                f"This Python is {process_machine()} emulated on an ARM64 Windows machine; QNN's "
                "ARM64 drivers kill such a process.",
                tip="Install ARM64 (native) Python and onnxruntime-qnn in it.",
            )
        if runtime is None:
            raise ReleaseError(
                "onnxruntime-qnn is not installed, so the QNN EP is not available.",
                tip="pip install onnxruntime-qnn (and the onnxruntime it is pinned with).",
            )
        if sys.platform == "win32" and not str(root.resolve()).isascii():
            raise ReleaseError(
                f"The release path {root} has non-ASCII characters, which QNN cannot open on Windows.",
                tip="Move the release to an ASCII-only path, or pass extract_to= with one.",
            )
        variant = choose_variant(manifest, runtime, device)
        _warn_if_arch_unchecked(manifest, device)
        try:
            return LoadedModel(root, manifest, variant, runtime, device, cleanup=cleanup)
        except PipelineError:
            raise
        except Exception as exc:
            raise ReleaseError(
                f"QNN could not open variant {variant.id} (QNN SDK {variant.qnn_sdk_version}, HTP "
                f"v{variant.htp_arch}) with {runtime.describe()}: {exc}",
                tip="Run `python -m pipeline doctor`; rebuild the release with this toolchain.",
            ) from exc
    except PipelineError as exc:  # ReleaseError, or ToolchainError from registering the EP
        if not allow_cpu:
            raise
        if manifest.cpu_fallback is None:
            raise ReleaseError(
                f"{exc.message}\nCPU fallback was allowed, but the release has no CPU model.",
                tip=exc.tip,
            ) from exc
        warnings.warn(
            f"Running {manifest.model} {manifest.version} on the CPU, not the NPU: {exc.message}",
            RuntimeWarning,
            stacklevel=3,
        )
        return LoadedModel(root, manifest, None, runtime, device, exc.message, cleanup)


def _warn_if_arch_unchecked(manifest: Manifest, device: Device) -> None:
    archs = {v.htp_arch for v in manifest.variants if v.passed}
    if device.htp_arch is None and not device.simulator and len(archs) > 1:
        warnings.warn(
            f"The device's HTP arch is unknown and the release has variants for "
            f"{sorted(archs)}; pass target= (one of {', '.join(TARGETS)}) to choose safely.",
            RuntimeWarning,
            stacklevel=4,
        )
