"""Which variant of a release this runtime and device can run, decided before any QNN call.

Rule (FACTS §3, from the EP's source): a context binary's QNN SDK must be <= the runtime's, and
its HTP arch <= the device's. A binary that breaks the rule fails inside QNN with an error that
names no version; here it is refused first, with the fix (which onnxruntime-qnn to install, or
which toolchain or target to rebuild with).

Standard library only: this module runs on the device.
"""

from __future__ import annotations

from . import qnn
from .device import Device
from .errors import ReleaseError
from .manifest import Manifest, Variant
from .toolchains import load_toolchains, version_key

SIMULATOR_REFUSES_SHARED = (
    "weight-shared bucket contexts do not load on the x86_64 HTP simulator (QNN refuses the "
    "binary, or crashes); the release's _standalone variant, one context per bucket, does"
)


def parse_version(text: str) -> tuple[int, ...]:
    """'v2.51.0.260929181845' or '2.51.0' -> (2, 51, 0): SDKs compare on their first 3 parts."""
    return version_key(qnn.sdk_version(text))


def _fits(variant: Variant, runtime_sdk: str, device: Device) -> list[str]:
    """Why ``variant`` cannot run here (empty: it can)."""
    reasons = []
    if runtime_sdk and parse_version(variant.qnn_sdk_version) > parse_version(runtime_sdk):
        reasons.append(f"built with QNN SDK {variant.qnn_sdk_version} > runtime's {runtime_sdk}")
    if device.htp_arch is not None and variant.htp_arch > device.htp_arch:
        reasons.append(f"built for HTP v{variant.htp_arch} > device's v{device.htp_arch}")
    if variant.backend != "htp":
        reasons.append(f"backend {variant.backend!r}, not htp")
    if variant.buckets.shared_binary is not None and device.simulator:
        reasons.append(SIMULATOR_REFUSES_SHARED)
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
                len(v.buckets.entries) == 1 or v.buckets.shared_binary is not None,  # shared first
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
        table = load_toolchains()
        known = table.known.get(oldest.onnxruntime_qnn)
        ort_version = oldest.onnxruntime or (known.onnxruntime if known else "")
        fixes.append(
            f"install onnxruntime-qnn {oldest.onnxruntime_qnn} (QNN SDK {oldest.qnn_sdk_version})"
            + (f" with onnxruntime {ort_version}" if ort_version else "")
        )
        found = table.for_sdk(runtime.qnn_sdk)
        toolchain = found.onnxruntime_qnn if found else None
        fixes.append(
            f"rebuild with toolchain {toolchain} (QNN SDK {runtime.qnn_sdk}) in compile.toolchains"
            if toolchain
            else f"rebuild with a toolchain whose QNN SDK is <= {runtime.qnn_sdk}"
        )
    if not arch_ok:
        fixes.append(
            f"add target {device.target!r} (HTP v{device.htp_arch}) to compile.targets and rebuild"
        )
    if device.simulator and any(v.buckets.shared_binary for v in passing):
        fixes.append(
            'run it on the device, or publish with [buckets] packaging = ["shared", '
            '"standalone"] for a variant the simulator loads'
        )
    tip = "; or ".join(fixes)
    return ReleaseError(message, tip=tip[:1].upper() + tip[1:] + ".")
