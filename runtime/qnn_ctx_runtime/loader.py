"""Load a published release on a device and run it on the NPU, or refuse clearly.

``load(release_dir_or_archive, target=None)`` verifies every file against the manifest, extracts
archives safely, reads the QNN SDK the installed ``onnxruntime-qnn`` bundles, and picks the best
variant this runtime and device can run. A context binary built with a newer QNN SDK than the
runtime's, or for a newer HTP arch than the device's, fails inside QNN with an error that names
no version (FACTS §3); here it is refused *before* any QNN call, with the fix.

Imports only the standard library, numpy and onnxruntime (Windows ARM64 has little else);
onnxruntime and onnxruntime_qnn are imported when first needed. Attaching the EP is left to
``qnn_ctx_runtime.qnn``, which knows both the 2.x plugin API and the 1.x ``provider_options`` style.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import warnings
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from . import qnn
from .device import Device, device_for, emulated_on_arm64, process_machine
from .errors import ActionableError, ReleaseError, UsageError
from .manifest import SINGLE_BUCKET, BucketEntry, Buckets, Manifest, TensorInfo, Variant
from .release import ARCHIVE_SUFFIXES, extract_archive, is_archive, verify_folder
from .select import choose_variant
from .sessions import SessionSpec, VariantSessions
from .targets import TARGETS

QNN_EP = qnn.EP_NAME


def _cpu_spec(manifest: Manifest) -> SessionSpec:
    """The release's CPU model as a one-bucket session spec (inputs from the variants)."""
    cpu = manifest.cpu_fallback
    if cpu is None:  # load() checks this first
        raise ReleaseError(f"Release {manifest.model} has no CPU model.")
    reference = manifest.variants[0] if manifest.variants else None
    inputs = reference.inputs if reference else []
    outputs = reference.outputs if reference else []
    entry_inputs = inputs
    if reference is not None and len(reference.buckets.entries) == 1:
        entry_inputs = reference.buckets.entries[0].inputs
    buckets = Buckets(
        shared_binary=None,
        axes=[],
        crops=[],
        entries=[BucketEntry(SINGLE_BUCKET, cpu.model, entry_inputs, outputs)],
    )
    return SessionSpec("cpu-fallback", buckets, inputs, outputs, provider="cpu")


class LoadedModel:
    """Sessions on the chosen variant, with the facts that explain the choice."""

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
        self._finalizer: weakref.finalize | None = None
        if variant is not None:
            if runtime is None:  # load() checks this first
                raise ReleaseError("onnxruntime-qnn is not installed.")
            spec = SessionSpec(
                variant.id, variant.buckets, variant.inputs, variant.outputs, variant.backend
            )
        else:
            spec = _cpu_spec(manifest)
        self.model_path = root / (variant.model if variant else spec.buckets.entries[0].model)
        self.inputs: list[TensorInfo] = spec.inputs
        self.outputs: list[TensorInfo] = spec.outputs
        self._sessions: VariantSessions | None = VariantSessions(root, spec)
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

    @property
    def restarts(self) -> int:
        """How often an HTP subsystem restart made the sessions reopen."""
        return self._sessions.restarts if self._sessions is not None else 0

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
            **(
                {"buckets": [e.name for e in v.buckets.entries]}
                if v and len(v.buckets.entries) > 1
                else {}
            ),
        }

    def run(
        self, feeds: Mapping[str, Any], output_names: list[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Run once (padded into the smallest bucket that holds the input, outputs cropped back).

        On an HTP subsystem restart (ENGINE_ERROR) the sessions are recreated and the run is
        retried once.
        """
        if self._sessions is None:
            raise UsageError(
                f"{self.manifest.model} {self.manifest.version} was closed.",
                tip="Call load() again.",
            )
        return self._sessions.run(feeds, output_names)

    @property
    def buckets(self) -> VariantSessions | None:
        """The sessions of a variant with several shape buckets (``.last`` = the padding
        applied by the last run); None for a model with one static shape."""
        sessions = self._sessions
        return sessions if sessions is not None and len(sessions.entries) > 1 else None

    def close(self) -> None:
        self._sessions = None
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> LoadedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        facts = self.facts()
        return (
            f"<LoadedModel {facts['model']} {facts['version']} {facts['variant']} on "
            f"{facts['provider']}>"
        )


def load(
    release: str | os.PathLike[str],
    target: str | None = None,
    allow_cpu_fallback: bool = False,
    extract_to: str | os.PathLike[str] | None = None,
) -> LoadedModel:
    """Open a release folder or archive and return a model bound to its best variant here.

    ``target`` names the device's chip (see qnn_ctx_runtime.targets); without it the HTP arch is
    not checked (on the x86 simulator every arch runs). ``allow_cpu_fallback`` runs the
    release's CPU model, with a RuntimeWarning, when no variant can run; otherwise that is a
    ReleaseError. ``extract_to`` is an empty folder to extract an archive into (kept); by default
    a temporary folder is used and removed by ``close()``.
    """
    path = Path(release)
    device = device_for(target)
    cleanup: Path | None = None
    if path.is_dir():
        root, manifest = path, verify_folder(path)
    elif is_archive(path):
        if extract_to is None:
            root = cleanup = Path(tempfile.mkdtemp(prefix="qnn-release-"))
        else:
            root = Path(extract_to)
            if root.exists() and not root.is_dir():
                raise UsageError(
                    f"extract_to={root} is a file, not a folder.", tip="Pass an empty folder."
                )
            if root.exists() and any(root.iterdir()):
                raise UsageError(f"extract_to={root} is not empty.", tip="Pass an empty folder.")
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
                f"The release path {root} has non-ASCII characters, which QNN cannot open on "
                "Windows.",
                tip="Move the release to an ASCII-only path, or pass extract_to= with one.",
            )
        variant = choose_variant(manifest, runtime, device)
        _warn_if_arch_unchecked(manifest, device)
        try:
            return LoadedModel(root, manifest, variant, runtime, device, cleanup=cleanup)
        except ActionableError:
            raise
        except Exception as exc:
            raise ReleaseError(
                f"QNN could not open variant {variant.id} (QNN SDK {variant.qnn_sdk_version}, HTP "
                f"v{variant.htp_arch}) with {runtime.describe()}: {exc}",
                tip="Run `python -m pipeline doctor`; rebuild the release with this toolchain.",
            ) from exc
    except ActionableError as exc:  # ReleaseError, or ToolchainError from registering the EP
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
