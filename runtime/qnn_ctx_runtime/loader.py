"""Load a published release on a device and run it on the NPU, or refuse clearly.

``load(release_dir_or_archive, target=None)`` verifies every file against the manifest, extracts
archives safely, reads the QNN SDK the installed ``onnxruntime-qnn`` bundles, identifies the
device (``qnn_ctx_runtime.device``: ``target=``, onnxruntime's EP-device metadata, the OS), and
tries the variants this runtime and device can run, best first (``qnn_ctx_runtime.select``):
HTP context binaries, then GPU variants, then, only when ``allow_cpu_fallback``, the CPU model.
A context binary built with a newer QNN SDK than the runtime's, or for a newer HTP arch than the
device's, fails inside QNN with an error that names no version (FACTS §3); here it is refused
*before* any QNN call, with the fix. A variant that is eligible but still fails to open is
reported and the next one is tried; ``facts()`` lists every variant's verdict and every attempt.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import qnn
from .device import (
    Device,
    check_compiled_model,
    detect_device,
    emulated_on_arm64,
    process_machine,
    with_ep_devices,
)
from .errors import ActionableError, ReleaseError, UsageError
from .finite import NonFinite, check_feeds, check_mode
from .manifest import SINGLE_BUCKET, BucketEntry, Buckets, Manifest, TensorInfo, Variant
from .release import ARCHIVE_SUFFIXES, is_archive, open_archive, open_folder
from .select import Plan, plan_variants
from .sessions import SessionSpec, VariantSessions
from .targets import TARGETS
from .trust import PublicKey, TrustPolicy, TrustReport

QNN_EP = qnn.EP_NAME
CPU_FALLBACK = "cpu-fallback"


@dataclass(frozen=True)
class Attempt:
    """One try to open a variant (or the CPU model), in the order they were made."""

    option: str  # variant id, or "cpu-fallback"
    backend: str  # htp | gpu | cpu
    result: str  # loaded | failed
    error: str = ""

    def to_facts(self) -> dict[str, str]:
        facts = {"option": self.option, "backend": self.backend, "result": self.result}
        return facts | ({"error": self.error} if self.error else {})


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
        plan: Plan | None = None,
        attempts: tuple[Attempt, ...] = (),
    ) -> None:
        self.root = root
        self.manifest = manifest
        self.variant = variant
        self.runtime = runtime
        self.device = device
        self.fallback_reason = fallback_reason
        self.plan = plan
        self.attempts = attempts
        self._finalizer: weakref.finalize | None = None
        self.trust: TrustReport | None = None  # what was checked about the manifest (load())
        self.nonfinite: NonFinite = "warn"  # NaN/inf inputs: warn | error | ignore (finite.py)
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
    def backend(self) -> str:
        """htp (the NPU), gpu (QNN's GPU backend) or cpu (the release's CPU model)."""
        return self.variant.backend if self.variant is not None else "cpu"

    @property
    def restarts(self) -> int:
        """How often an HTP subsystem restart made the sessions reopen."""
        return self._sessions.restarts if self._sessions is not None else 0

    def facts(self) -> dict[str, Any]:
        """What runs, where, and why: the device and how it was identified, the runtime's QNN
        SDK against each variant's, why each variant was or was not eligible, and every
        attempt to open one. For logs and bug reports."""
        v = self.variant
        return {
            "model": self.manifest.model,
            "version": self.manifest.version,
            "variant": v.id if v else CPU_FALLBACK,
            "backend": self.backend,
            "provider": self.provider,
            "target": v.target if v else None,
            "soc_model": v.soc_model if v else None,
            "htp_arch": v.htp_arch if v else None,
            "qnn_sdk_version": v.qnn_sdk_version if v else None,
            "runtime": self.runtime.describe() if self.runtime else None,
            "runtime_qnn_sdk": self.runtime.qnn_sdk if self.runtime else None,
            "device": self.device.describe(),
            "detection": self.device.to_facts(),
            "choice": self.plan.rule if self.plan else None,
            "variants": self.plan.to_facts() if self.plan else None,
            "attempts": [a.to_facts() for a in self.attempts],
            "fallback_reason": self.fallback_reason or None,
            "trust": self.trust.facts() if self.trust else None,
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
        check_feeds(feeds, self.nonfinite, f"{self.manifest.model} {self.manifest.version}")
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
    expect_manifest_sha256: str | None = None,
    public_key: PublicKey | None = None,
    nonfinite: NonFinite = "warn",
) -> LoadedModel:
    """Open a release folder or archive and return a model bound to its best variant here.

    ``target`` names the device's chip (any name, alias or part number in
    qnn_ctx_runtime.targets); without it the chip is detected (onnxruntime's EP devices, the
    registry, /sys, getprop), and a device that cannot be identified (the x86 simulator) gets the
    lowest HTP arch, the binary the most devices run. A variant that fails to open is reported and
    the next one is tried: HTP, then GPU. ``allow_cpu_fallback`` runs the release's CPU model,
    with a RuntimeWarning, when no variant can run or open; otherwise that is a ReleaseError.
    ``extract_to`` is an empty folder to extract an archive into (kept); by default a temporary
    folder is used and removed by ``close()``.

    The manifest itself (qnn_ctx_runtime.trust): ``expect_manifest_sha256`` pins its digest
    (``python -m pipeline publish`` prints it); ``public_key`` (Ed25519: PEM path or text, or 32
    raw bytes) demands a valid signature by that key, and needs the ``cryptography`` package.
    ``facts()["trust"]`` says what was checked. ``nonfinite`` is what ``run`` does with NaN or
    infinite inputs: "warn" (default), "error" (FeedError) or "ignore" (qnn_ctx_runtime.finite).
    """
    path = Path(release)
    policy = TrustPolicy(expect_manifest_sha256, public_key)
    nonfinite = check_mode(nonfinite)
    device = detect_device(target)
    cleanup: Path | None = None
    if path.is_dir():
        root = path
        manifest, trust = open_folder(path, policy)
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
            manifest, trust = open_archive(path, root, policy)
        except BaseException:
            # Nothing of a refused archive is left to be used later (extract_to was empty).
            for item in list(root.iterdir()) if root.is_dir() else []:
                shutil.rmtree(item) if item.is_dir() else item.unlink()
            if cleanup is not None:
                shutil.rmtree(cleanup, ignore_errors=True)
            raise
        _warn_if_unchecked(path, trust)
    else:
        raise ReleaseError(
            f"{path} is neither a release folder nor a release archive "
            f"({', '.join(ARCHIVE_SUFFIXES)}).",
            tip="Pass artifacts/releases/<model>/<version> or the archive inside it.",
        )
    try:
        model = _bind(root, manifest, device, allow_cpu_fallback, cleanup)
        model.trust, model.nonfinite = trust, nonfinite
        return model
    except BaseException:
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)
        raise


def _warn_if_unchecked(archive: Path, trust: TrustReport) -> None:
    """An archive without its .sha256 and neither pinned nor signature-checked: say so."""
    if trust.archive_checksum.startswith("missing") and not (
        trust.pinned or trust.signature.startswith("verified")
    ):
        warnings.warn(
            f"{archive}: {trust.archive_checksum}; its files were checked against its own "
            "manifest only. Pin the manifest (expect_manifest_sha256=) or check its signature "
            "(public_key=) to know it is the release that was published.",
            RuntimeWarning,
            stacklevel=3,
        )


def _bind(
    root: Path, manifest: Manifest, device: Device, allow_cpu: bool, cleanup: Path | None
) -> LoadedModel:
    """Try the eligible variants best first; the CPU model when (and only when) allowed."""
    installed = qnn.installed_qnn()
    runtime = installed if installed.present else None
    attempts: list[Attempt] = []
    plan: Plan | None = None
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
        plan = plan_variants(manifest, runtime, device)
        if not plan.order:  # refused from the versions alone, before any QNN call
            raise plan.error()
        plan, device = _plan_with_ep(manifest, runtime, device)
        if not plan.order:
            raise plan.error()
        for variant in plan.order:
            loaded = Attempt(variant.id, variant.backend, "loaded")
            try:
                model = LoadedModel(
                    root,
                    manifest,
                    variant,
                    runtime,
                    device,
                    cleanup=cleanup,
                    plan=plan,
                    attempts=(*attempts, loaded),
                )
            except Exception as exc:  # QNN's errors, or ReleaseError when the EP did not attach
                message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
                attempts.append(Attempt(variant.id, variant.backend, "failed", message.strip()))
                continue
            _warn_about_choice(model)
            return model
        raise ReleaseError(
            f"No variant of {manifest.model} {manifest.version} opened with "
            f"{runtime.describe()}; tried, in order:\n"
            + "\n".join(f"  - {a.option} ({a.backend}): {a.error}" for a in attempts),
            tip="Run `python -m pipeline doctor`; rebuild the release with this toolchain.",
        )
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
        attempts.append(Attempt(CPU_FALLBACK, "cpu", "loaded"))
        return LoadedModel(
            root, manifest, None, runtime, device, exc.message, cleanup, plan, tuple(attempts)
        )


def _plan_with_ep(
    manifest: Manifest, runtime: qnn.InstalledQnn, device: Device
) -> tuple[Plan, Device]:
    """Register the QNN EP, complete the device from onnxruntime's EP devices, ask ONNX
    Runtime's compatibility check about each HTP variant, and plan again with that."""
    ep = qnn.find_qnn_ep()
    if ep.installed.api == "plugin":  # 1.x lists no EP devices: availability stays unknown
        device = with_ep_devices(device, ep.devices)
    compatibility = {
        v.id: check_compiled_model(ep.devices, v.ep_compatibility_info)
        for v in manifest.variants
        if v.backend == "htp"
    }
    return plan_variants(manifest, runtime, device, compatibility), device


def _warn_about_choice(model: LoadedModel) -> None:
    """Say what is not the obvious choice: a fallback after a failed variant, a variant of
    another HTP arch than the device's, the GPU instead of the NPU, an unknown device."""
    variant, device, plan = model.variant, model.device, model.plan
    if variant is None or plan is None:
        return
    failed = [a for a in model.attempts if a.result == "failed"]
    if failed:
        tried = "; ".join(f"{a.option}: {a.error.splitlines()[0][:200]}" for a in failed)
        warnings.warn(
            f"{len(failed)} variant(s) of {model.manifest.model} did not open ({tried}); "
            f"running {variant.id} instead.",
            RuntimeWarning,
            stacklevel=4,
        )
    if variant.backend == "gpu":
        warnings.warn(
            f"Running {model.manifest.model} {model.manifest.version} on QNN's GPU backend "
            f"({variant.id}), not the NPU: no HTP variant can run or open here. The GPU path was "
            "not verified on hardware when the release was built.",
            RuntimeWarning,
            stacklevel=4,
        )
    elif device.htp_arch is not None and variant.htp_arch != device.htp_arch:
        warnings.warn(
            f"{model.manifest.model} {model.manifest.version} has no variant for the device's "
            f"HTP v{device.htp_arch} ({device.target}) that can run here; running {variant.id}, "
            f"built for HTP v{variant.htp_arch} ({variant.target}). Add {device.target!r} to "
            "compile.targets for a binary built for this chip.",
            RuntimeWarning,
            stacklevel=4,
        )
    elif device.htp_arch is None and not device.simulator:
        archs = sorted({v.htp_arch for v in model.manifest.variants if v.backend == "htp"})
        if len(archs) > 1:
            warnings.warn(
                f"The device was not identified ({device.describe()}) and the release has "
                f"variants for HTP {archs}; running the lowest, v{variant.htp_arch}. Pass "
                f"target= (one of {', '.join(TARGETS)}) to choose for this chip.",
                RuntimeWarning,
                stacklevel=4,
            )
