"""Which variants of a release this runtime and device can run, and in which order to try them.

Rules (FACTS §3, from the EP's source): a context binary's QNN SDK must be <= the runtime's, and
its HTP arch <= the device's (a lower arch still runs; ONNX Runtime calls it "prefer
recompilation"). A binary that breaks a rule fails inside QNN with an error that names no
version; here it is refused first, with the fix. Where ONNX Runtime's own compatibility check
answers (an NPU device, ``qnn_ctx_runtime.device.check_compiled_model``), its "unsupported" is a
refusal too.

The order is by backend, then by fit: HTP context binaries first, then the ``gpu`` variants (a
float or fp16 model that QNN's GPU backend compiles on the device), each only where it can run;
the explicit CPU fallback is the loader's last step. Among HTP variants the device's own arch
comes first, then the closest lower one, then the newest SDK the runtime takes. A device that was
not identified gets the lowest arch first: the binary the most devices run (v73 runs on v73,
v75, v79, ...), where the highest would fail on all the older ones.

``plan_variants`` returns every variant's verdict (why it is or is not eligible) for
``facts()`` and ``doctor``; ``choose_variant`` is its first choice. Standard library only: this
module runs on the device, before any QNN call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import qnn
from .device import Compatibility, Device
from .errors import ReleaseError
from .manifest import Manifest, Variant
from .toolchains import load_toolchains, version_key

BACKENDS = ("htp", "gpu")  # in the order they are tried
SIMULATOR_REFUSES_SHARED = (
    "weight-shared bucket contexts do not load on the x86_64 HTP simulator (QNN refuses the "
    "binary, or crashes); the release's _standalone variant, one context per bucket, does"
)
GPU_NEEDS = "the QNN GPU backend needs an Adreno GPU and its OpenCL driver"


def parse_version(text: str) -> tuple[int, ...]:
    """'v2.51.0.260929181845' or '2.51.0' -> (2, 51, 0): SDKs compare on their first 3 parts."""
    return version_key(qnn.sdk_version(text))


@dataclass(frozen=True)
class Verdict:
    """One variant on this runtime and device: why it cannot run (``reasons``), or what was
    checked and found fine (``notes``)."""

    variant: Variant
    reasons: tuple[str, ...]
    notes: tuple[str, ...]
    compatibility: Compatibility | None = None

    @property
    def eligible(self) -> bool:
        return not self.reasons

    def to_facts(self) -> dict[str, Any]:
        v = self.variant
        return {
            "variant": v.id,
            "backend": v.backend,
            "target": v.target,
            "htp_arch": v.htp_arch if v.backend == "htp" else None,
            "qnn_sdk_version": v.qnn_sdk_version,
            "eligible": self.eligible,
            "why": list(self.reasons or self.notes),
            **(
                {
                    "onnxruntime_compatibility": {
                        "verdict": self.compatibility.verdict,
                        "detail": self.compatibility.detail,
                    }
                }
                if self.compatibility is not None
                else {}
            ),
        }


@dataclass(frozen=True)
class Plan:
    """Every variant's verdict, and the eligible ones in the order the loader tries them."""

    manifest: Manifest
    runtime: qnn.InstalledQnn
    device: Device
    verdicts: tuple[Verdict, ...]  # manifest order
    order: tuple[Variant, ...]
    rule: str  # how ``order`` was made, in words

    def verdict(self, variant_id: str) -> Verdict:
        return next(v for v in self.verdicts if v.variant.id == variant_id)

    def to_facts(self) -> list[dict[str, Any]]:
        return [v.to_facts() for v in self.verdicts]

    def error(self) -> ReleaseError:
        """The refusal when nothing is eligible, naming every variant's reasons and the fixes."""
        return _no_fit_error(self)


def _htp_check(
    variant: Variant, runtime_sdk: str, device: Device, compatibility: Compatibility | None
) -> tuple[list[str], list[str]]:
    reasons, notes = [], []
    if not runtime_sdk:
        notes.append("the runtime's QNN SDK is unknown: the oldest SDK is tried first")
    elif parse_version(variant.qnn_sdk_version) > parse_version(runtime_sdk):
        reasons.append(f"built with QNN SDK {variant.qnn_sdk_version} > runtime's {runtime_sdk}")
    else:
        notes.append(f"QNN SDK {variant.qnn_sdk_version} <= runtime's {runtime_sdk}")
    if device.htp_arch is None:
        notes.append(f"HTP v{variant.htp_arch}; the device's arch is unknown")
    elif variant.htp_arch > device.htp_arch:
        reasons.append(f"built for HTP v{variant.htp_arch} > device's v{device.htp_arch}")
    elif variant.htp_arch < device.htp_arch:
        notes.append(
            f"built for HTP v{variant.htp_arch} < device's v{device.htp_arch}: runs, but a "
            f"v{device.htp_arch} build would be faster (ONNX Runtime: prefer recompilation)"
        )
    else:
        notes.append(f"built for the device's HTP v{device.htp_arch}")
    if compatibility is not None:
        if compatibility.refuses:
            reasons.append(f"ONNX Runtime's compatibility check: {compatibility.detail}")
        elif compatibility.verdict != "unavailable":
            notes.append(f"ONNX Runtime's compatibility check: {compatibility.detail}")
    if variant.buckets.shared_binary is not None and device.simulator:
        reasons.append(SIMULATOR_REFUSES_SHARED)
    return reasons, notes


def _gpu_check(device: Device) -> tuple[list[str], list[str]]:
    notes = ["a float model QNN's GPU backend compiles at load (no context-binary SDK rule)"]
    if device.gpu:
        return [], [*notes, "onnxruntime offers the QNN EP on a GPU device"]
    if device.gpu is False:
        offered = "/".join(device.ep_types) or "no device"
        return [f"onnxruntime offers the QNN EP on {offered} only, no GPU; {GPU_NEEDS}"], notes
    if device.simulator:
        return [f"an x86 machine has no Adreno GPU; {GPU_NEEDS}"], notes
    return [], [*notes, "GPU availability not known: tried, and a failure falls through"]


def _verdict(
    variant: Variant, runtime_sdk: str, device: Device, compatibility: Compatibility | None
) -> Verdict:
    if not variant.passed:
        gates = "; ".join(variant.failed_gates) or "its gates"
        return Verdict(variant, (f"failed at build time: {gates}",), ())
    if variant.backend == "htp":
        reasons, notes = _htp_check(variant, runtime_sdk, device, compatibility)
    elif variant.backend == "gpu":
        reasons, notes = _gpu_check(device)
    else:
        reasons = [
            f"backend {variant.backend!r} is not one this runtime runs ({', '.join(BACKENDS)})"
        ]
        notes = []
    return Verdict(variant, tuple(reasons), tuple(notes), compatibility)


def plan_variants(
    manifest: Manifest,
    runtime: qnn.InstalledQnn,
    device: Device,
    compatibility: Mapping[str, Compatibility] | None = None,
) -> Plan:
    """Every variant's verdict and the order to try the eligible ones. No QNN code runs here;
    ``compatibility`` (variant id -> ONNX Runtime's verdict) is what the loader asked QNN."""
    sdk = runtime.qnn_sdk
    verdicts = tuple(
        _verdict(v, sdk, device, (compatibility or {}).get(v.id)) for v in manifest.variants
    )
    eligible = [v for v in verdicts if v.eligible]

    def key(verdict: Verdict) -> tuple[Any, ...]:
        v = verdict.variant
        version = parse_version(v.qnn_sdk_version)
        newest_first = tuple(-x for x in version) if sdk else version  # unknown: oldest first
        shared_first = not (len(v.buckets.entries) == 1 or v.buckets.shared_binary is not None)
        if v.backend != "htp":
            return (BACKENDS.index(v.backend), newest_first)
        if device.htp_arch is None:  # not identified: the arch the most devices run
            return (0, v.htp_arch, newest_first, shared_first)
        optimal = verdict.compatibility is not None and verdict.compatibility.verdict == "optimal"
        return (
            0,
            not optimal,
            v.htp_arch != device.htp_arch,
            v.soc_model != device.soc_model,
            -v.htp_arch,  # then the closest lower arch
            newest_first,
            shared_first,
        )

    order = tuple(v.variant for v in sorted(eligible, key=key))
    if device.htp_arch is None:
        rule = (
            "device not identified: the lowest HTP arch first, the binary the most devices run; "
            "pass target= (see qnn_ctx_runtime.targets) to choose for one chip"
        )
    else:
        rule = (
            f"device HTP v{device.htp_arch}: its own arch first, then the closest lower one; "
            "newest QNN SDK the runtime takes"
        )
    rule += "; HTP context binaries, then GPU, then (when allowed) the CPU model"
    return Plan(manifest, runtime, device, verdicts, order, rule)


def choose_variant(manifest: Manifest, runtime: qnn.InstalledQnn, device: Device) -> Variant:
    """The first variant to try here, or a ReleaseError that says how to fix it."""
    plan = plan_variants(manifest, runtime, device)
    if not plan.order:
        raise plan.error()
    return plan.order[0]


def _no_fit_error(plan: Plan) -> ReleaseError:
    manifest, runtime, device = plan.manifest, plan.runtime, plan.device
    passing = [v for v in plan.verdicts if v.variant.passed]
    if not passing:
        return ReleaseError(
            f"Release {manifest.model} {manifest.version} has no variant that passed its gates"
            f" (variants: {', '.join(v.id for v in manifest.variants) or 'none'}).",
            tip="Fix the build and publish without --allow-partial.",
        )
    sdks = sorted({v.variant.qnn_sdk_version for v in passing}, key=parse_version)
    lines = [f"  - {v.variant.id}: {'; '.join(v.reasons)}" for v in passing]
    message = (
        f"No variant of release {manifest.model} {manifest.version} can run here: the runtime is "
        f"{runtime.describe()} and the device is {device.describe()}; the release has QNN SDK "
        f"{', '.join(sdks)}.\n" + "\n".join(lines)
    )
    htp = [v.variant for v in passing if v.variant.backend == "htp"]
    fixes = []
    arch_ok = [v for v in htp if device.htp_arch is None or v.htp_arch <= device.htp_arch]
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
    if htp and not arch_ok:
        fixes.append(
            f"add target {device.target!r} (HTP v{device.htp_arch}) to compile.targets and rebuild"
        )
    if device.simulator and any(v.buckets.shared_binary for v in htp):
        fixes.append(
            'run it on the device, or publish with [buckets] packaging = ["shared", '
            '"standalone"] for a variant the simulator loads'
        )
    if not fixes:
        fixes.append(
            "run it on a device where one of the listed variants can run, or pass "
            "allow_cpu_fallback=True for the release's CPU model"
        )
    tip = "; or ".join(fixes)
    return ReleaseError(message, tip=tip[:1].upper() + tip[1:] + ".")
