"""``python -m pipeline doctor``: check this machine for every known barrier, one fix per row.

The barriers come from FACTS and from users' field reports: a module clash between onnxruntime
and onnxruntime-qnn 1.x, x86 Python emulated on ARM64 Windows (QNN kills the process), an
onnxruntime / onnxruntime-qnn pair that silently falls back to CPU, non-ASCII paths, and releases
built with a QNN SDK newer than the runtime's. It also says which device this is and how that
was found (qnn_ctx_runtime.device), whether QNN's GPU backend starts here, and for every
variant of every release whether it is eligible and why (its SDK against the runtime's, its HTP
arch against the device's, ONNX Runtime's compatibility check where it applies). The QNN probe
runs in a child process, because a native abort would otherwise take the doctor down with it;
the same fresh process asks onnxruntime about its EP devices and the compatibility check.

Imports only what the runtime does (standard library, numpy, onnxruntime), so it runs on devices.
"""

from __future__ import annotations

import argparse
import base64
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qnn_ctx_runtime import qnn
from qnn_ctx_runtime.device import (
    Compatibility,
    Device,
    EpDeviceFacts,
    detect_device,
    native_machine_detail,
    process_machine,
    with_ep_facts,
)
from qnn_ctx_runtime.manifest import MANIFEST_FILE, Manifest
from qnn_ctx_runtime.select import Plan, parse_version, plan_variants
from qnn_ctx_runtime.toolchains import Toolchains, load_toolchains

from .core.errors import PipelineError

HELP = """\
Check this machine for the known barriers to running QNN EP-context models.

Prints one row per check with its status (OK, WARN, FAIL, SKIP) and the fix: the
onnxruntime / onnxruntime-qnn packages (module clash, pinned pair), x86 Python emulated on
ARM64 Windows, a QNN probe model that must really run on the QNN EP (not fall back to CPU),
non-ASCII paths, and every release under <artifacts>/releases against this runtime's QNN SDK.
Exits 1 when a check fails.

examples:
  python -m pipeline doctor
  python -m pipeline doctor --target snapdragon-8-gen-3 --release path/to/release.tar.gz
"""

# Add(x, x) -> Relu on a float [1, 8] tensor, opset 13, IR 7: every node runs on QNN HTP.
# Embedded so that the doctor needs no onnx; tests/test_doctor.py rebuilds it with onnx.helper.
PROBE_MODEL = base64.b64decode(
    "CAcSF3Fubi1jdHgtcGlwZWxpbmUgZG9jdG9yOk8KDgoBeAoBeBIBcyIDQWRkCgwKAXMSAXkiBFJlbHUSBXByb2Jl"
    "WhMKAXgSDgoMCAESCAoCCAEKAggIYhMKAXkSDgoMCAESCAoCCAEKAggIQgQKABAN"
)
PROBE_INPUT = [[-1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 0.75, 1.0]]

OK, WARN, FAIL, SKIP = "OK", "WARN", "FAIL", "SKIP"


@dataclass(frozen=True)
class Row:
    check: str
    status: str
    detail: str
    fix: str = ""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--artifacts", type=Path, default=Path("artifacts"), help="where releases/ is looked for"
    )
    parser.add_argument(
        "--release",
        type=Path,
        action="append",
        default=[],
        help="a release folder or archive to check as well (repeatable)",
    )
    parser.add_argument("--target", help="this device's chip (see pipeline.targets), if known")
    parser.add_argument("--no-probe", action="store_true", help="skip the QNN probe model")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")


def run(args: argparse.Namespace) -> int:
    rows = diagnose(args.artifacts, args.release, args.target, probe=not args.no_probe)
    if args.json:
        print(json.dumps([row.__dict__ for row in rows], indent=2))
    else:
        from .core.report import table

        print(
            table(["check", "status", "detail", "fix"], [list(r.__dict__.values()) for r in rows])
        )
        failed = sum(r.status == FAIL for r in rows)
        print(f"\n{failed} check(s) failed." if failed else "\nNo barrier found.")
    return 1 if any(r.status == FAIL for r in rows) else 0


def diagnose(
    artifacts: Path, releases: list[Path], target: str | None, probe: bool = True
) -> list[Row]:
    distributions = installed_distributions()
    native, how = native_machine_detail()
    rows = [
        Row(
            "python",
            OK,
            f"Python {platform.python_version()} {process_machine()} on "
            f"{platform.system()} ({native} hardware, from {how})",
        ),
        check_emulation(native, process_machine(), sys.platform),
        check_packages(distributions),
    ]
    try:
        rows.append(check_pinned_pair(distributions, load_toolchains()))
    except PipelineError as exc:  # a damaged table is named, never replaced silently
        rows.append(Row("pinned pair", FAIL, exc.message, exc.tip or ""))
    installed = qnn.installed_qnn()
    ep = installed if installed.present else None
    if ep is None:
        rows.append(
            Row("QNN SDK", FAIL, "onnxruntime-qnn is not importable", "pip install onnxruntime-qnn")
        )
    else:
        rows.append(
            Row(
                "QNN SDK",
                OK if ep.qnn_sdk else WARN,
                ep.describe() + f", {ep.api} API",
                "" if ep.qnn_sdk else "use an onnxruntime-qnn that reports qnn_version",
            )
        )
    paths = _release_paths(artifacts, releases)
    probed = run_probe(_compatibility_strings(paths)) if probe and ep else None
    if probe:
        rows.append(
            check_probe(probed=probed) if ep else Row("QNN probe", SKIP, "no QNN EP to probe")
        )
    device = detect_device(target)
    if probed is not None and probed.result is not None and "ep_devices" in probed.result:
        device = with_ep_facts(device, EpDeviceFacts.from_json(probed.result["ep_devices"]))
    rows.append(
        check_device(
            device, ((probed.result or {}) if probed else {}).get("compatibility_function", "")
        )
    )
    rows.append(check_gpu(probed, device))
    rows.append(check_paths(_paths_to_check(artifacts), sys.platform == "win32"))
    compatibility = {
        info: Compatibility(**verdict)
        for info, verdict in (
            (probed.result or {}).get("compatibility", {}) if probed else {}
        ).items()
    }
    rows.extend(check_releases(paths, ep, target, device, compatibility))
    return rows


# -- packages -----------------------------------------------------------------------------------

ORT_FLAVOURS = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "onnxruntime-openvino")


def installed_distributions() -> dict[str, str]:
    """Installed onnxruntime* distributions: name -> version."""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith("onnxruntime"):
            found[name] = dist.version
    return found


def check_packages(distributions: dict[str, str]) -> Row:
    """Module clash: onnxruntime-qnn 1.x *is* an ``onnxruntime`` module, so another flavour hides
    it (field report: QNNExecutionProvider missing). 2.x needs the plain onnxruntime beside it."""
    qnn = distributions.get("onnxruntime-qnn")
    others = {n: v for n, v in distributions.items() if n in ORT_FLAVOURS}
    listing = ", ".join(f"{n} {v}" for n, v in sorted(distributions.items())) or "none"
    if qnn is None:
        return Row(
            "packages",
            FAIL,
            f"onnxruntime-qnn is not installed ({listing})",
            "pip install onnxruntime-qnn and its pinned onnxruntime",
        )
    if qnn.startswith("1."):
        if others:
            return Row(
                "packages",
                FAIL,
                f"module clash: onnxruntime-qnn {qnn} and "
                f"{', '.join(others)} both install the 'onnxruntime' module",
                f"pip uninstall {' '.join(others)} (then reinstall onnxruntime-qnn {qnn})",
            )
        return Row("packages", OK, listing)
    if "onnxruntime" not in others:
        return Row(
            "packages",
            FAIL,
            f"onnxruntime-qnn {qnn} is a plugin and needs the onnxruntime "
            f"package, which is missing ({listing})",
            "pip install onnxruntime (pinned pair)",
        )
    if len(others) > 1:
        return Row(
            "packages",
            WARN,
            f"several onnxruntime flavours share one module: {listing}",
            f"keep only onnxruntime: pip uninstall {' '.join(n for n in others if n != 'onnxruntime')}",
        )
    return Row("packages", OK, listing)


def check_pinned_pair(distributions: dict[str, str], table: Toolchains) -> Row:
    """A wrong pair does not fail: ORT prints a warning and runs on CPU (FACTS §2)."""
    qnn, ort = distributions.get("onnxruntime-qnn"), distributions.get("onnxruntime")
    source = table.source
    if qnn is None or qnn.startswith("1."):
        return Row("pinned pair", SKIP, "no onnxruntime-qnn 2.x installed")
    if qnn not in table.known:
        newest = table.newest_pin
        return Row(
            "pinned pair",
            WARN,
            f"onnxruntime-qnn {qnn} is not pinned in {source}",
            f"install a pinned pair, e.g. onnxruntime-qnn=={newest.onnxruntime_qnn} "
            f"onnxruntime=={newest.onnxruntime}, or verify {qnn} and add a pin",
        )
    pinned_ort = table.known[qnn].onnxruntime
    if not pinned_ort:
        return Row(
            "pinned pair",
            WARN,
            f"no verified onnxruntime for onnxruntime-qnn {qnn} in {source}",
            "verify the pair (see the QNN probe row) and pin it",
        )
    if ort != pinned_ort:
        return Row(
            "pinned pair",
            FAIL,
            f"onnxruntime-qnn {qnn} with onnxruntime {ort}; {source} pins "
            f"{pinned_ort} (a wrong pair can fall back to CPU silently)",
            f"pip install onnxruntime=={pinned_ort}",
        )
    return Row(
        "pinned pair", OK, f"onnxruntime-qnn {qnn} + onnxruntime {ort}, as pinned in {source}"
    )


# -- platform -----------------------------------------------------------------------------------


def check_emulation(native: str, process: str, platform_name: str) -> Row:
    """Field report: x86 Python on Snapdragon X lists the QNN EP, then dies with exit 127."""
    if native == "arm64" and process != "arm64":
        return Row(
            "emulation",
            FAIL,
            f"{process} Python emulated on an ARM64 machine: QNN's ARM64 "
            "drivers kill the process at the first session",
            "install native ARM64 Python",
        )
    where = "Windows" if platform_name == "win32" else platform_name
    return Row("emulation", OK, f"native {process} process on {native} {where}")


def check_paths(paths: dict[str, str], windows: bool) -> Row:
    """Field report: QNN on Windows fails on non-ASCII paths ('No mapping for the Unicode
    character'). Elsewhere it is only a warning."""
    bad = {label: path for label, path in paths.items() if not path.isascii()}
    if not bad:
        return Row("ASCII paths", OK, f"{len(paths)} paths checked ({', '.join(paths)})")
    listing = "; ".join(f"{label}: {path}" for label, path in bad.items())
    return Row(
        "ASCII paths",
        FAIL if windows else WARN,
        f"non-ASCII characters in {listing}",
        "move these to ASCII-only paths (for archives, pass extract_to= to runtime.load)",
    )


def _paths_to_check(artifacts: Path) -> dict[str, str]:
    paths = {
        "python": sys.executable,
        "prefix": sys.prefix,
        "working folder": os.getcwd(),
        "temp folder": tempfile.gettempdir(),
        "artifacts": str(artifacts.resolve()),
    }
    for module in ("onnxruntime", "onnxruntime_qnn"):
        spec = importlib.util.find_spec(module)
        if spec and spec.origin:
            paths[module] = str(Path(spec.origin).parent)
    return paths


# -- QNN probe ----------------------------------------------------------------------------------

PROBE_SCRIPT = """
import json, os, sys, tempfile
import numpy as np
import onnxruntime as ort
from qnn_ctx_runtime import qnn
from qnn_ctx_runtime.device import check_compiled_model, compatibility_function, ep_device_facts
from pipeline.doctor import PROBE_INPUT, PROBE_MODEL
out = {}
ep = qnn.find_qnn_ep()
if ep.installed.api == "plugin":  # 1.x lists no EP devices: leave availability unknown
    out["ep_devices"] = ep_device_facts(ep.devices).to_json()
out["compatibility_function"] = compatibility_function()[1]
# Before any session: after a QNN EP instance existed, the check can read freed memory.
out["compatibility"] = {
    info: vars(check_compiled_model(ep.devices, info)) for info in json.loads(sys.argv[1])
}
print("PROBE_FACTS " + json.dumps(out), flush=True)
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "probe.onnx")
    with open(path, "wb") as handle:
        handle.write(PROBE_MODEL)
    try:  # QNN's GPU backend, as a gpu variant is opened: no CPU fallback allowed
        options = ep.session_options(
            qnn.QnnOptions("gpu"), {"session.disable_cpu_ep_fallback": "1"}, log_severity=3
        )
        ort.InferenceSession(path, sess_options=options)
        out["gpu"] = "ok"
    except Exception as exc:
        out["gpu"] = str(exc)
    print("PROBE_GPU " + json.dumps(out["gpu"]), flush=True)
    config = {"session.record_ep_graph_assignment_info": "1"}
    options = qnn.find_qnn_ep().session_options(qnn.QnnOptions(), config, log_severity=3)
    session = ort.InferenceSession(path, sess_options=options)
    out["providers"] = session.get_providers()
    try:
        info = session.get_provider_graph_assignment_info()
        out["nodes"] = {s.ep_name: [n.op_type for n in s.get_nodes()] for s in info}
    except Exception:
        out["nodes"] = None
    x = np.array(PROBE_INPUT, dtype=np.float32)
    y = session.run(None, {"x": x})[0]
    out["max_error"] = float(np.abs(y - np.maximum(x + x, 0)).max())
print("PROBE " + json.dumps(out))
"""


@dataclass
class Probed:
    """What the probe process printed; ``result`` holds its facts even when it died later."""

    returncode: int | None
    stdout: str
    stderr: str
    timeout: float
    result: dict[str, Any] | None


def run_probe(compatibility: list[str], python: str | None = None, timeout: float = 180) -> Probed:
    """The probe in a child process: EP devices, ONNX Runtime's compatibility check of each
    string in ``compatibility``, a QNN GPU session, and the probe model on the QNN EP."""
    env = dict(os.environ)
    roots = [str(Path(__file__).resolve().parent.parent), str(Path(qnn.__file__).parents[1])]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*roots, env.get("PYTHONPATH")) if p)
    try:
        done = subprocess.run(
            [python or sys.executable, "-c", PROBE_SCRIPT, json.dumps(compatibility)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return Probed(None, stdout, "", timeout, _probe_facts(stdout))
    return Probed(done.returncode, done.stdout, done.stderr, timeout, _probe_facts(done.stdout))


def _probe_facts(stdout: str) -> dict[str, Any] | None:
    facts: dict[str, Any] = {}
    for line in stdout.splitlines():
        if line.startswith("PROBE_FACTS "):
            facts.update(json.loads(line[len("PROBE_FACTS ") :]))
        elif line.startswith("PROBE_GPU "):
            facts["gpu"] = json.loads(line[len("PROBE_GPU ") :])
    return facts or None


def check_probe(
    python: str | None = None, timeout: float = 180, probed: Probed | None = None
) -> Row:
    """Run the probe model on the QNN EP in a child process; CPU fallback or a crash fails."""
    probed = probed or run_probe([], python, timeout)
    if probed.returncode is None:
        return Row(
            "QNN probe",
            FAIL,
            f"the probe model hung for {probed.timeout:.0f} s",
            "check the NPU driver; run the probe again with a longer timeout",
        )
    done = probed
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("PROBE ")), None)
    if done.returncode != 0 or line is None:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
        how = (
            f"killed by signal {-done.returncode}"
            if done.returncode < 0
            else f"exit {done.returncode}"
        )
        return Row(
            "QNN probe",
            FAIL,
            f"the probe process failed ({how}): {tail}",
            "exit 127 on Windows means emulated x86 Python; otherwise check the pinned pair",
        )
    result = json.loads(line[len("PROBE ") :])
    nodes = result.get("nodes") or {}
    on_qnn = nodes.get("QNNExecutionProvider", [])
    on_cpu = nodes.get("CPUExecutionProvider", [])
    if "QNNExecutionProvider" not in result["providers"] or (
        result.get("nodes") is not None and not on_qnn
    ):
        return Row(
            "QNN probe",
            FAIL,
            f"the QNN EP is registered but the probe ran on CPU (providers {result['providers']})",
            "install a pinned onnxruntime / onnxruntime-qnn pair (see the pinned pair row)",
        )
    if on_cpu:
        return Row("QNN probe", WARN, f"probe nodes {on_cpu} stayed on CPU", "check the QNN EP log")
    if result["max_error"] > 0.01:
        return Row(
            "QNN probe",
            FAIL,
            f"the probe ran on QNN but is wrong by {result['max_error']}",
            "report this onnxruntime-qnn version",
        )
    placed = f"{len(on_qnn)} of {len(on_qnn)} nodes on QNN" if on_qnn else "QNN session created"
    return Row("QNN probe", OK, f"{placed}, max error {result['max_error']:.3g}")


# -- the device -----------------------------------------------------------------------------------


def check_device(device: Device, compatibility_check: str = "") -> Row:
    """Which chip this is and how that was found; an unidentified device is a WARN only on a
    device (the x86 simulator has no chip to find), because the loader then chooses blind."""
    where = (
        f"; onnxruntime offers the QNN EP on {'/'.join(device.ep_types) or 'no device'}"
        if device.npu is not None
        else ""
    )
    if compatibility_check:
        applies = "applies" if device.npu else "does not apply (no NPU device)"
        where += f"; ONNX Runtime's compatibility check ({compatibility_check}) {applies}"
    if not device.identified:
        where += "; the loader tries the lowest HTP arch first"
    if device.identified:
        return Row("device", OK, device.describe() + where)
    status = OK if device.simulator else WARN
    fix = "" if device.simulator else "pass --target (and target= to load()) to name the chip"
    read = (
        f"; read: {'; '.join(device.evidence)}" if device.evidence and not device.simulator else ""
    )
    return Row("device", status, device.describe() + where + read, fix)


def check_gpu(probed: Probed | None, device: Device) -> Row:
    """Whether QNN's GPU backend starts here, which gpu variants need. The GPU path was never
    run on hardware by this project; the row says so."""
    unverified = "the GPU path is unverified on hardware"
    if probed is None or probed.result is None or "gpu" not in probed.result:
        return Row("QNN GPU backend", SKIP, f"not probed; {unverified}")
    answer = probed.result["gpu"]
    if answer == "ok":
        return Row(
            "QNN GPU backend",
            OK,
            "a QNN GPU session opened with session.disable_cpu_ep_fallback=1 (gpu variants can "
            f"run here); {unverified} by this project",
        )
    log = probed.stderr
    cannot = next(
        (
            m
            for m in ("QNN_BACKEND_ERROR_CANNOT_INITIALIZE", "Failed to initialize backend")
            if m in log + answer
        ),
        None,
    )
    why = (
        f"QNN's GPU backend cannot initialise ({cannot})"
        if cannot
        else f"the QNN GPU session failed: {answer[:200]}"
    )
    if device.simulator:
        return Row(
            "QNN GPU backend",
            SKIP,
            f"{why}: an x86 machine has no Adreno GPU, so gpu variants are skipped here; "
            f"{unverified}",
        )
    return Row(
        "QNN GPU backend",
        WARN,
        f"{why}; gpu variants will be skipped and the CPU model is the last fallback; {unverified}",
        "update the Adreno GPU (OpenCL) driver; QNN SDK 2.33+ needs a recent one",
    )


# -- releases -----------------------------------------------------------------------------------


def _release_paths(artifacts: Path, extra: list[Path]) -> list[Path]:
    found = sorted(p.parent for p in (artifacts / "releases").glob(f"*/*/{MANIFEST_FILE}"))
    return [*found, *extra]


def _read_manifest(path: Path) -> Manifest:
    """The manifest only (no hashing): enough to compare SDKs, cheap for big releases."""
    if path.is_dir():
        return Manifest.read(path / MANIFEST_FILE)
    import tarfile
    import zipfile

    if path.name.endswith(".zip"):
        with zipfile.ZipFile(path) as zf:
            return Manifest.from_json(zf.read(MANIFEST_FILE), f"{path}!{MANIFEST_FILE}")
    with tarfile.open(path) as tar:
        member = tar.extractfile(MANIFEST_FILE)
        if member is None:
            raise KeyError(MANIFEST_FILE)
        return Manifest.from_json(member.read(), f"{path}!{MANIFEST_FILE}")


def _compatibility_strings(paths: list[Path]) -> list[str]:
    """Every HTP variant's compatibility string in the releases that can be read."""
    found: set[str] = set()
    for path in paths:
        try:
            manifest = _read_manifest(path)
        except (PipelineError, OSError, KeyError, ValueError):
            continue
        found |= {v.ep_compatibility_info for v in manifest.variants if v.ep_compatibility_info}
    return sorted(found)


def check_releases(
    paths: list[Path],
    ep: qnn.InstalledQnn | None,
    target: str | None,
    device: Device | None = None,
    compatibility: dict[str, Compatibility] | None = None,
) -> list[Row]:
    """A row per release (can it run here, and which variant) and one per variant (eligible or
    not, and why: its SDK against the runtime's, its arch against the device's, ...)."""
    if not paths:
        return [Row("releases", SKIP, "no release found", "pass --artifacts or --release")]
    rows = []
    for path in paths:
        label = (
            f"release {path.parent.name}/{path.name}" if path.is_dir() else f"release {path.name}"
        )
        try:
            manifest = _read_manifest(path)
        except (PipelineError, OSError, KeyError, ValueError) as exc:
            message = exc.message if isinstance(exc, PipelineError) else str(exc)
            rows.append(
                Row(
                    label,
                    FAIL,
                    f"unreadable manifest: {message.splitlines()[0]}",
                    "publish the release again",
                )
            )
            continue
        sdks = ", ".join(sorted({v.qnn_sdk_version for v in manifest.variants}, key=parse_version))
        if ep is None:
            rows.append(Row(label, SKIP, f"needs QNN SDK {sdks}; no QNN EP installed"))
            continue
        here = device or detect_device(target)
        checks = compatibility or {}
        verdicts = {
            v.id: checks[v.ep_compatibility_info]
            for v in manifest.variants
            if v.ep_compatibility_info in checks
        }
        plan = plan_variants(manifest, ep, here, verdicts)
        if plan.order:
            chosen = plan.order[0]
            detail = f"QNN SDK {sdks} vs runtime {ep.qnn_sdk}: loads {chosen.id}"
            arch = here.htp_arch
            if chosen.backend == "htp" and arch is not None and chosen.htp_arch != arch:
                rows.append(
                    Row(
                        label,
                        WARN,
                        f"{detail}, built for HTP v{chosen.htp_arch}: the release has no variant "
                        f"for the device's v{arch} ({here.target})",
                        f"add {here.target!r} to compile.targets and publish again",
                    )
                )
            elif chosen.backend != "htp":
                rows.append(
                    Row(
                        label,
                        WARN,
                        f"{detail}: no HTP variant can run here, the {chosen.backend} variant is "
                        "the fallback",
                        "build for this chip (compile.targets) and this runtime's SDK",
                    )
                )
            else:
                rows.append(Row(label, OK, detail))
        else:
            error = plan.error()
            reasons = [line.strip(" -") for line in error.message.splitlines()[1:]]
            detail = "; ".join(reasons) or error.message.splitlines()[0]
            rows.append(
                Row(
                    label,
                    FAIL,
                    f"needs QNN SDK {sdks}, runtime has {ep.qnn_sdk}: {detail}",
                    error.tip or "",
                )
            )
        rows.extend(variant_rows(label, plan))
    return rows


def variant_rows(label: str, plan: Plan) -> list[Row]:
    """One row per variant: OK when the loader may try it (its place in the order), SKIP with
    the reasons when it may not. Never FAIL: the release row says whether anything runs."""
    rows = []
    runtime_sdk = plan.runtime.qnn_sdk or "?"
    for verdict in plan.verdicts:
        v = verdict.variant
        what = f"{v.backend}, QNN SDK {v.qnn_sdk_version} (runtime {runtime_sdk})"
        if v.backend == "htp":
            what += f", HTP v{v.htp_arch}"
        if verdict.eligible:
            place = plan.order.index(v) + 1
            why = "; ".join(verdict.notes)
            rows.append(
                Row(f"{label}: {v.id}", OK, f"{what}: tried {place} of {len(plan.order)}; {why}")
            )
        else:
            rows.append(
                Row(f"{label}: {v.id}", SKIP, f"{what}: not eligible: {'; '.join(verdict.reasons)}")
            )
    return rows
