"""The device side's choice: which chip this is (targets, aliases, part numbers, what the OS and
onnxruntime say), which variants it may run and in which order (HTP ctx -> GPU -> CPU), and
that a variant which still fails to open is reported and the next one is tried."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from release_fixtures import MODEL, cached_build, run_python
from test_manifest import manifest as manifest_data
from test_manifest import variant as make_variant
from test_runtime import python_250, two_sdk_release  # noqa: F401 (fixtures)
from venvs import run_in

import qnn_ctx_runtime
from pipeline.core.config import load_config
from pipeline.core.errors import ConfigError
from pipeline.publish.release import publish_model
from qnn_ctx_runtime import qnn
from qnn_ctx_runtime.device import (
    ChipFact,
    Compatibility,
    Device,
    detect_device,
    ep_device_facts,
    os_chip_facts,
    with_ep_devices,
)
from qnn_ctx_runtime.errors import ReleaseError, UsageError
from qnn_ctx_runtime.manifest import MANIFEST_FILE, FileEntry, Manifest
from qnn_ctx_runtime.release import sha256_file
from qnn_ctx_runtime.select import GPU_NEEDS, choose_variant, plan_variants
from qnn_ctx_runtime.sessions import SessionSpec, VariantSessions
from qnn_ctx_runtime.targets import TARGETS, get_target, identify

X_ELITE, GEN3, ELITE = "snapdragon-x-elite", "snapdragon-8-gen-3", "snapdragon-8-elite"
FEED = {"x": np.random.default_rng(3).standard_normal((1, 3, 16, 16)).astype(np.float32)}


# -- chip names ---------------------------------------------------------------------------------

ALIASES = [(alias, t.name) for t in TARGETS.values() for alias in (t.name, *t.aliases)]


@pytest.mark.parametrize(("alias", "expected"), ALIASES, ids=[a for a, _ in ALIASES])
def test_every_alias_names_its_chip(alias, expected):
    assert get_target(alias).name == expected
    assert get_target(alias.upper().replace("-", " ")).name == expected  # "SNAPDRAGON X PLUS"


PART_NUMBERS = [
    ("X1E-00-1DE", X_ELITE),  # the Dev Kit's
    ("X1E-84-100", X_ELITE),
    ("X1E-80-100", X_ELITE),
    ("X1E-78-100", X_ELITE),
    ("X1P-66-100", X_ELITE),  # X Plus 10-core
    ("X1P-64-100", X_ELITE),
    ("X1P-42-100", X_ELITE),  # X Plus 8-core
    ("X1-26-100", X_ELITE),  # Snapdragon X, the field report's chip (HTP v73)
    ("X2E-96-100", "snapdragon-x2-elite"),
    ("X2E-88-100", "snapdragon-x2-elite"),
    ("SM8750", ELITE),
    ("SM8750-AC", ELITE),  # 8 Elite for Galaxy
    ("SM8850", "snapdragon-8-elite-gen-5"),
    ("SM8650", GEN3),
    ("SM8550", "snapdragon-8-gen-2"),
    ("SM8475", "snapdragon-8-plus-gen-1"),
    ("SM8450", "snapdragon-8-gen-1"),
    ("SM8350", "snapdragon-888"),
    ("SC8380XP", X_ELITE),
    ("SC8480XP", "snapdragon-x2-elite"),
]


@pytest.mark.parametrize(("part", "expected"), PART_NUMBERS, ids=[p for p, _ in PART_NUMBERS])
def test_every_part_number_names_its_chip(part, expected):
    if expected is None:
        with pytest.raises(UsageError, match="Unknown target"):
            get_target(part)
        return
    assert get_target(part).name == expected
    assert get_target(part.replace("-", "")).name == expected  # as Windows writes it


# What devices really report, and what must not be read as a chip.
DESCRIPTIONS = [
    ("Snapdragon(R) X Elite - X1E78100 - Qualcomm(R) Oryon(TM) CPU", X_ELITE, "X1E78100"),
    ("Snapdragon(R) X 12-core X1E80100 @ 3.40 GHz", X_ELITE, "X1E80100"),
    ("Snapdragon(R) X Plus - X1P64100 - Qualcomm(R) Oryon(TM) CPU", X_ELITE, "X1P64100"),
    ("Snapdragon(R) X 8-core X1P42100 @ 3.24 GHz", X_ELITE, "X1P42100"),
    ("Snapdragon X - X1 26-100", X_ELITE, "X126100"),  # the field report's chipset line
    ("Snapdragon(R) X Elite - X1E78100 - Qualcomm(R) Hexagon(TM) NPU", X_ELITE, "X1E78100"),
    ("Snapdragon(R) X2 Elite Extreme - X2E96100", "snapdragon-x2-elite", "X2E96100"),
    ("Qualcomm Technologies, Inc SM8750", ELITE, "SM8750"),  # /proc/cpuinfo Hardware
    ("qcom,x1e80100-crd qcom,x1e80100", X_ELITE, "X1E80100"),  # device-tree compatible
    ("Snapdragon 8 Elite Gen 5", "snapdragon-8-elite-gen-5", "snapdragon-8-elite-gen-5"),
    ("Snapdragon 8 Elite for Galaxy", ELITE, "snapdragon-8-elite-for-galaxy"),
    ("Snapdragon(TM) 8 Gen 3", GEN3, "snapdragon-8-gen-3"),
    ("Snapdragon X Plus", X_ELITE, "snapdragon-x-plus"),
    ("Intel(R) Xeon(R) Platinum 8370C CPU @ 2.80GHz", None, None),
    ("AMD EPYC 7763 64-Core Processor", None, None),
    ("Snapdragon (TM) 8cx Gen 3 @ 3.0 GHz", None, None),  # SC8280XP: not in the table
    ("Snapdragon 8s Gen 3", None, None),  # not an 8 Gen 3
    ("Snapdragon X2 Plus", None, None),  # an X2 is not an X
]


@pytest.mark.parametrize(
    ("text", "expected", "token"), DESCRIPTIONS, ids=[d for d, *_ in DESCRIPTIONS]
)
def test_identify_reads_chip_descriptions(text, expected, token):
    found = identify(text)
    assert (found[0].name, found[1]) == (expected, token) if expected else found is None


def test_unknown_target_lists_names_and_aliases():
    with pytest.raises(UsageError) as info:
        get_target("snapdragon-x-pluss")
    message = info.value.message
    assert "Did you mean 'snapdragon-x-plus'?" in message
    assert "Known targets: snapdragon-888, " in message and "snapdragon-x-plus" in message


def test_a_config_target_written_as_an_alias_names_the_row(tmp_path):
    """compile.targets builds one binary per row; an alias is refused with the row's name."""
    config = tmp_path / "m.toml"
    config.write_text(
        '[model]\nname = "m"\nversion = "1"\nsource = "m.onnx"\n'
        '[compile]\ntargets = ["snapdragon-x-plus"]\n',
        "utf-8",
    )
    with pytest.raises(ConfigError) as info:
        load_config(config, check_files=False)
    assert "another name of 'snapdragon-x-elite'" in str(info.value)


# -- what the machine says ----------------------------------------------------------------------


def device_tree(root: Path, machine: str = "", compatible: str = "", cpuinfo: str = "") -> Path:
    """A copy of the files a Linux/Android device describes its SoC in, under ``root``."""
    if machine:
        (root / "sys/devices/soc0").mkdir(parents=True, exist_ok=True)
        (root / "sys/devices/soc0/machine").write_text(machine + "\n")
    if compatible:
        (root / "proc/device-tree").mkdir(parents=True, exist_ok=True)
        (root / "proc/device-tree/compatible").write_bytes(compatible.encode())
    if cpuinfo:
        (root / "proc").mkdir(parents=True, exist_ok=True)
        (root / "proc/cpuinfo").write_text(cpuinfo)
    return root


def test_linux_soc_files_identify_the_chip(tmp_path: Path):
    root = device_tree(
        tmp_path,
        machine="SM8750",
        compatible="qcom,sun-mtp\0qcom,sun\0",
        cpuinfo="processor\t: 0\nBogoMIPS\t: 38.40\nHardware\t: Qualcomm Technologies, Inc SM8750\n",
    )
    facts = os_chip_facts(root, "linux")
    assert [f.source for f in facts] == [
        "/sys/devices/soc0/machine",
        "/proc/device-tree/compatible",
        "/proc/cpuinfo Hardware",
    ]
    device = detect_device(facts=facts, machine="arm64")
    assert (device.target, device.soc_model, device.htp_arch) == (ELITE, 69, 79)
    assert device.source == "/sys/devices/soc0/machine 'SM8750' (SM8750)"
    assert not device.simulator and device.identified
    assert (
        "snapdragon-8-elite (soc 69, HTP v79) from /sys/devices/soc0/machine" in device.describe()
    )


def test_device_tree_alone_identifies_a_snapdragon_x_laptop(tmp_path: Path):
    root = device_tree(tmp_path, compatible="lenovo,yoga-slim7x\0qcom,x1e80100\0")
    device = detect_device(facts=os_chip_facts(root, "linux"), machine="arm64")
    assert (device.target, device.htp_arch) == (X_ELITE, 73)
    assert "qcom,x1e80100" in device.source


def test_x86_cpuinfo_is_evidence_but_no_chip(tmp_path: Path):
    cpuinfo = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8370C CPU @ 2.80GHz\n"
    root = device_tree(tmp_path, cpuinfo=cpuinfo)
    assert os_chip_facts(root, "linux") == []  # only lines that mention Qualcomm are read
    device = detect_device(facts=[], machine="x86_64")
    assert not device.identified and device.simulator
    assert device.describe().startswith("not identified (an x86 machine has no Snapdragon")


def test_windows_registry_string_identifies_the_chip():
    fact = ChipFact(
        "Windows registry ProcessorNameString",
        "Snapdragon(R) X Plus - X1P64100 - Qualcomm(R) Oryon(TM) CPU",
    )
    device = detect_device(facts=[fact], machine="arm64")
    assert (device.target, device.htp_arch) == (X_ELITE, 73)
    assert device.source.startswith("Windows registry ProcessorNameString 'Snapdragon(R) X Plus")


def test_a_named_target_wins_and_what_the_machine_says_is_kept():
    fact = ChipFact("Android getprop ro.soc.model", "SM8650")
    with pytest.warns(RuntimeWarning, match="this machine reports snapdragon-8-gen-3 from"):
        device = detect_device("snapdragon-x-plus", facts=[fact], machine="arm64")
    assert (device.target, device.htp_arch) == (X_ELITE, 73)
    assert device.source == "target='snapdragon-x-plus' (SC8380XP Snapdragon X Elite / X Plus / X)"
    assert (
        device.detected == "snapdragon-8-gen-3 from Android getprop ro.soc.model 'SM8650' (SM8650)"
    )


def test_unknown_target_is_a_usage_error_with_the_list():
    with pytest.raises(UsageError, match="Known targets") as info:
        detect_device("snapdragon-9-gen-9", facts=[])
    assert info.value.tip == "Pass target= as one of the names listed."


class HardwareDevice:
    """The shape of onnxruntime's OrtHardwareDevice, for EP-device facts of a machine that is
    not this one (a Snapdragon's NPU and GPU); this machine's real ones are tested below."""

    def __init__(self, kind: str, metadata: dict[str, str]) -> None:
        import onnxruntime as ort

        self.type = getattr(ort.OrtHardwareDeviceType, kind)
        self.vendor, self.vendor_id, self.device_id = "Qualcomm", 0x4D4F4351, 0
        self.metadata = metadata


@dataclasses.dataclass
class EpDevice:
    device: HardwareDevice
    ep_name: str = "QNNExecutionProvider"


def test_ep_device_metadata_identifies_a_device_nothing_else_did():
    npu = HardwareDevice(
        "NPU", {"Description": "Snapdragon(R) X Elite - X1E78100 - Qualcomm(R) Hexagon(TM) NPU"}
    )
    gpu = HardwareDevice("GPU", {"Description": "Qualcomm(R) Adreno(TM) X1-85 GPU"})
    device = with_ep_devices(
        detect_device(facts=[], machine="arm64"), [EpDevice(npu), EpDevice(gpu)]
    )
    assert (device.target, device.htp_arch, device.npu, device.gpu) == (X_ELITE, 73, True, True)
    assert device.source.startswith("onnxruntime NPU device metadata Description")
    assert device.ep_types == ("NPU", "GPU")


def test_ep_device_metadata_comes_before_the_os_and_after_target():
    npu = HardwareDevice("NPU", {"Description": "Snapdragon(R) X Plus - X1P42100 - Hexagon NPU"})
    registry = ChipFact("Windows registry ProcessorNameString", "Snapdragon 8 Gen 3")
    device = with_ep_devices(detect_device(facts=[registry], machine="arm64"), [EpDevice(npu)])
    assert (device.target, device.by) == (X_ELITE, "onnxruntime")
    assert device.detected.startswith("snapdragon-8-gen-3 from Windows registry")
    named = with_ep_devices(detect_device(ELITE, facts=[], machine="arm64"), [EpDevice(npu)])
    assert (named.target, named.by, named.npu) == (ELITE, "target", True)


@pytest.mark.qnn
def test_this_machine_offers_the_qnn_ep_on_the_cpu_only():
    """FACTS §10: here the QNN EP's device is the CPU (simulator): no NPU, no GPU."""
    ep = qnn.find_qnn_ep()
    facts = ep_device_facts(ep.devices)
    assert facts.types == ("CPU",) and not facts.npu and not facts.gpu
    device = with_ep_devices(detect_device(facts=[], machine="x86_64"), ep.devices)
    assert (device.npu, device.gpu, device.identified) == (False, False, False)
    assert "onnxruntime offers QNNExecutionProvider on a CPU device" in device.evidence[-1]


COMPATIBILITY_CHECK = """
import json, sys
import onnxruntime as ort
from qnn_ctx_runtime import qnn
from qnn_ctx_runtime.device import check_compiled_model, compatibility_function
function, where = compatibility_function()
ep = qnn.find_qnn_ep()  # registers the EP; no EP instance yet in this fresh process
try:
    function(ep.devices, sys.argv[1])
    raw = "answered"
except RuntimeError as exc:
    raw = str(exc)
verdict = check_compiled_model(ep.devices, sys.argv[1])
print(json.dumps({"where": where, "top_level": hasattr(ort, "get_model_compatibility_for_ep_devices"),
                  "raw": raw, "verdict": verdict.verdict, "detail": verdict.detail}))
"""


@pytest.mark.qnn
def test_onnxruntimes_compatibility_check_is_found_and_says_why_it_does_not_apply_here(release):
    """onnxruntime 1.31.1 has get_model_compatibility_for_ep_devices in its native module only;
    the QNN EP answers it for an NPU device and raises for the CPU device it has here. Asked in
    a fresh process: after a QNN EP instance existed, the check can read freed memory."""
    info = Manifest.read(release / MANIFEST_FILE).variants[0].ep_compatibility_info
    done = run_python(COMPATIBILITY_CHECK, info)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["where"] == (
        "onnxruntime.get_model_compatibility_for_ep_devices"
        if result["top_level"]
        else "onnxruntime.capi.onnxruntime_pybind11_state.get_model_compatibility_for_ep_devices"
    )
    assert "only supports OrtHardwareDeviceType_NPU" in result["raw"]
    assert result["verdict"] == "unavailable"
    assert result["detail"].startswith("onnxruntime offers QNNExecutionProvider on CPU only")


# -- choosing -------------------------------------------------------------------------------------


def runtime(sdk: str = "2.51.0") -> qnn.InstalledQnn:
    return qnn.InstalledQnn("2.7.0", sdk, "1.31.1", "plugin")


def htp(target: str, sdk: str = "2.51.0") -> dict:
    chip = get_target(target)
    vid = f"{target}_qnn-{sdk}"
    data = dataclasses.asdict(make_variant(vid, sdk, chip.htp_arch))
    return data | {"target": target, "soc_model": chip.soc_model}


def gpu(precision: str = "float16", sdk: str = "2.51.0") -> dict:
    """A gpu variant as publish writes it: no chip, no context binary."""
    vid = f"gpu-{precision}_qnn-{sdk}"
    data = dataclasses.asdict(make_variant(vid, sdk))
    return data | {
        "target": "gpu",
        "soc_model": 0,
        "htp_arch": 0,
        "backend": "gpu",
        "ep_sdk_version": "",
        "ep_compatibility_info": "",
        "embed_mode": 0,
        "coverage": {"verified_on_hardware": False},
    }


def release_of(*variants: dict) -> Manifest:
    data = manifest_data(cpu_fallback=None)
    data["variants"] = list(variants)
    return Manifest.from_dict(data)


def on(target: str | None, **facts) -> Device:
    """A device that is (or is not) identified, as on hardware (not this machine)."""
    device = detect_device(target, facts=[], machine="arm64")
    return dataclasses.replace(device, **facts)


SIMULATOR = detect_device(facts=[], machine="x86_64")
EVERY_ARCH = release_of(htp(X_ELITE), htp(GEN3), htp(ELITE), htp("snapdragon-x2-elite"))


def test_an_x_elite_without_target_never_gets_a_newer_arch():
    """The issue's case: load() without target on an X Elite (v73) laptop picked v75."""
    fact = ChipFact(
        "Windows registry ProcessorNameString",
        "Snapdragon(R) X Elite - X1E78100 - Qualcomm(R) Oryon(TM) CPU",
    )
    plan = plan_variants(EVERY_ARCH, runtime(), detect_device(facts=[fact], machine="arm64"))
    assert [v.id for v in plan.order] == [f"{X_ELITE}_qnn-2.51.0"]
    assert plan.verdict(f"{GEN3}_qnn-2.51.0").reasons == ("built for HTP v75 > device's v73",)
    assert plan.verdict(f"{ELITE}_qnn-2.51.0").reasons == ("built for HTP v79 > device's v73",)


def test_the_8_elite_gets_its_own_arch_and_never_silently_another():
    plan = plan_variants(EVERY_ARCH, runtime(), on(ELITE))
    assert [v.id for v in plan.order] == [
        f"{ELITE}_qnn-2.51.0",  # its own v79 first
        f"{GEN3}_qnn-2.51.0",  # then the closest lower arch
        f"{X_ELITE}_qnn-2.51.0",
    ]
    assert plan.verdict("snapdragon-x2-elite_qnn-2.51.0").reasons == (
        "built for HTP v81 > device's v79",
    )
    without_own = release_of(htp(X_ELITE), htp(GEN3))
    plan = plan_variants(without_own, runtime(), on(ELITE))
    first = plan.verdict(plan.order[0].id)
    assert plan.order[0].id == f"{GEN3}_qnn-2.51.0"
    assert (
        "built for HTP v75 < device's v79: runs, but a v79 build would be faster" in first.notes[1]
    )


def test_an_unidentified_device_gets_the_lowest_arch_and_is_told_why():
    for device in (SIMULATOR, on(None)):
        plan = plan_variants(EVERY_ARCH, runtime(), device)
        assert [v.htp_arch for v in plan.order] == [73, 75, 79, 81]
        assert plan.rule.startswith("device not identified: the lowest HTP arch first")


def test_order_is_htp_then_gpu_and_gpu_has_no_sdk_rule():
    release = release_of(gpu("float16", "2.52.0"), htp(X_ELITE))
    device = on(X_ELITE, gpu=True, npu=True, ep_types=("NPU", "GPU"))
    plan = plan_variants(release, runtime("2.51.0"), device)
    assert [v.id for v in plan.order] == [f"{X_ELITE}_qnn-2.51.0", "gpu-float16_qnn-2.52.0"]
    assert "no context-binary SDK rule" in plan.verdict("gpu-float16_qnn-2.52.0").notes[0]


def test_gpu_is_the_fallback_when_no_htp_variant_can_run():
    release = release_of(htp(ELITE), gpu("float32"))
    device = on(X_ELITE, gpu=True, npu=True, ep_types=("NPU", "GPU"))
    assert choose_variant(release, runtime(), device).id == "gpu-float32_qnn-2.51.0"


@pytest.mark.parametrize(
    ("device", "reason"),
    [
        (SIMULATOR, f"an x86 machine has no Adreno GPU; {GPU_NEEDS}"),
        (
            on(X_ELITE, gpu=False, npu=False, ep_types=("CPU",)),
            f"onnxruntime offers the QNN EP on CPU only, no GPU; {GPU_NEEDS}",
        ),
    ],
    ids=["simulator", "no-gpu-device"],
)
def test_gpu_variant_is_not_eligible_without_a_gpu(device, reason):
    plan = plan_variants(release_of(gpu()), runtime(), device)
    assert plan.order == () and plan.verdict("gpu-float16_qnn-2.51.0").reasons == (reason,)
    with pytest.raises(ReleaseError, match=r"no GPU|no Adreno GPU") as info:
        raise plan.error()
    assert "allow_cpu_fallback=True" in info.value.tip


def test_gpu_availability_unknown_is_tried():
    plan = plan_variants(release_of(gpu()), runtime(), on(X_ELITE))  # 1.x API: no EP devices
    assert [v.id for v in plan.order] == ["gpu-float16_qnn-2.51.0"]
    assert "GPU availability not known" in plan.verdict("gpu-float16_qnn-2.51.0").notes[-1]


def test_unknown_backend_is_named():
    other = htp(X_ELITE) | {"id": "dsp", "backend": "dsp"}
    plan = plan_variants(release_of(other), runtime(), on(X_ELITE))
    assert plan.verdict("dsp").reasons == ("backend 'dsp' is not one this runtime runs (htp, gpu)",)


def test_onnxruntimes_verdict_refuses_and_ranks():
    """Where ONNX Runtime's check answers (an NPU), 'unsupported' refuses and 'optimal' leads."""
    x_elite, gen2 = htp(X_ELITE), htp("snapdragon-8-gen-2")  # both v73
    release = release_of(x_elite, gen2)
    device = on(X_ELITE, npu=True)
    check = {
        x_elite["id"]: Compatibility("unsupported", "EP_UNSUPPORTED"),
        gen2["id"]: Compatibility("optimal", "EP_SUPPORTED_OPTIMAL"),
    }
    plan = plan_variants(release, runtime(), device, check)
    assert [v.id for v in plan.order] == [gen2["id"]]
    assert plan.verdict(x_elite["id"]).reasons == (
        "ONNX Runtime's compatibility check: EP_UNSUPPORTED",
    )
    facts = plan.verdict(gen2["id"]).to_facts()
    assert facts["onnxruntime_compatibility"] == {
        "verdict": "optimal",
        "detail": "EP_SUPPORTED_OPTIMAL",
    }


# -- loading, with the QNN EP and its HTP simulator ---------------------------------------------


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    build = cached_build(tmp_path_factory).copy(tmp_path_factory.mktemp("device-release") / "p")
    return publish_model(load_config(build.config), build.artifacts).folder


def add_variant(release: Path, dest: Path, variant: dict, files: dict[str, Path], first: bool):
    """A copy of ``release`` with one more variant whose files are copies of ``files``."""
    shutil.copytree(release, dest)
    for path, source in files.items():
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, dest / path)
    variant["files"] = [
        dataclasses.asdict(FileEntry(p, sha256_file(dest / p), (dest / p).stat().st_size))
        for p in files
    ]
    data = json.loads((dest / MANIFEST_FILE).read_text("utf-8"))
    data["variants"] = [variant, *data["variants"]] if first else [*data["variants"], variant]
    (dest / MANIFEST_FILE).write_text(json.dumps(data, indent=2), "utf-8")
    return dest


def relabelled(ctx: Path, dest: Path, like: dict) -> Path:
    """``ctx`` (a real context binary) labelled with another variant's SDK facts: its EPContext
    ep_sdk_version and compatibility string. The manifest and the file then agree (publish's
    claims hold), but the binary inside is still what it was: the case of a binary whose label
    promises an SDK it was not built with."""
    import onnx

    model = onnx.load(str(ctx))
    for node in model.graph.node:
        for attribute in node.attribute:
            if node.op_type == "EPContext" and attribute.name == "ep_sdk_version":
                attribute.s = like["ep_sdk_version"].encode()
    for prop in model.metadata_props:
        if prop.key == qnn.COMPATIBILITY_KEY:
            prop.value = like["ep_compatibility_info"]
    dest.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(dest))
    return dest


FALLTHROUGH = """
import json, sys, warnings
sys.modules["pipeline"] = None  # the device side alone
import qnn_ctx_runtime
from qnn_ctx_runtime import ReleaseError
out = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model = qnn_ctx_runtime.load(sys.argv[1], target="snapdragon-x-elite")
    out["variant"] = model.variant.id
    out["attempts"] = model.facts()["attempts"]
    out["warnings"] = [str(w.message) for w in caught if w.category is RuntimeWarning]
try:
    qnn_ctx_runtime.load(sys.argv[2], target="snapdragon-x-elite")
except ReleaseError as exc:
    out["error"] = exc.message
with warnings.catch_warnings(record=True):
    warnings.simplefilter("always")
    model = qnn_ctx_runtime.load(sys.argv[2], target="snapdragon-x-elite", allow_cpu_fallback=True)
    out["cpu_attempts"] = model.facts()["attempts"]
print(json.dumps(out))
"""


@pytest.mark.qnn
def test_a_variant_that_fails_to_open_is_reported_and_the_next_one_runs(
    two_sdk_release,  # noqa: F811 (the fixture of test_runtime)
    python_250,  # noqa: F811
    tmp_path,
):
    """In a real onnxruntime-qnn 2.5.0 environment (QNN SDK 2.49.40): a 2.51.0 binary labelled
    2.49.40 passes every rule and fails inside QNN (QNN_CONTEXT_ERROR_INVALID_ARGUMENT, FACTS
    §3); the loader reports it and opens the next variant. When no variant opens, that is a
    ReleaseError listing the attempts, and the CPU model runs only when allowed."""
    data = json.loads((two_sdk_release / MANIFEST_FILE).read_text("utf-8"))
    old = next(v for v in data["variants"] if v["id"] == f"{X_ELITE}_qnn-2.49.40")
    new = next(v for v in data["variants"] if v["id"] == f"{X_ELITE}_qnn-2.51.0")
    bad = json.loads(json.dumps(old)) | {"id": f"{X_ELITE}_qnn-2.49.40_relabelled"}
    path = f"{bad['id']}/{MODEL}_ctx.onnx"
    source = relabelled(two_sdk_release / new["model"], tmp_path / "relabelled.onnx", old)
    bad["model"] = path
    bad["buckets"]["entries"][0]["model"] = path
    both = add_variant(two_sdk_release, tmp_path / "both", bad, {path: source}, first=True)
    only_bad = tmp_path / "only-bad"
    shutil.copytree(both, only_bad)
    manifest = json.loads((only_bad / MANIFEST_FILE).read_text("utf-8"))
    manifest["variants"] = [v for v in manifest["variants"] if v["id"] != old["id"]]
    (only_bad / MANIFEST_FILE).write_text(json.dumps(manifest), "utf-8")
    shutil.rmtree(only_bad / old["id"])

    done = run_in(python_250, FALLTHROUGH, str(both), str(only_bad))
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["variant"] == old["id"]
    assert [(a["option"], a["result"]) for a in out["attempts"]] == [
        (bad["id"], "failed"),
        (old["id"], "loaded"),
    ]
    assert "QNN_CONTEXT_ERROR_INVALID_ARGUMENT" in out["attempts"][0]["error"]
    assert len(out["warnings"]) == 1 and f"running {old['id']} instead" in out["warnings"][0]
    assert out["error"].startswith(f"No variant of {MODEL} 1.0.0 opened with onnxruntime-qnn 2.5.0")
    assert f"{bad['id']} (htp): " in out["error"]
    assert [(a["option"], a["result"]) for a in out["cpu_attempts"]] == [
        (bad["id"], "failed"),
        ("cpu-fallback", "loaded"),
    ]


@pytest.mark.qnn
def test_facts_say_the_device_the_sdks_and_why_each_variant_was_or_was_not_eligible(release):
    with qnn_ctx_runtime.load(release, target="snapdragon-8-gen-2") as model:  # v73
        facts = model.facts()
    assert facts["variant"] == f"{X_ELITE}_qnn-2.51.0" and facts["runtime_qnn_sdk"] == "2.51.0"
    detection = facts["detection"]
    assert detection["target"] == "snapdragon-8-gen-2" and detection["simulator"]
    assert detection["qnn_ep_devices"] == ["CPU"]  # what onnxruntime offers the QNN EP on here
    by_id = {v["variant"]: v for v in facts["variants"]}
    assert by_id[f"{GEN3}_qnn-2.51.0"]["eligible"] is False
    assert by_id[f"{GEN3}_qnn-2.51.0"]["why"] == ["built for HTP v75 > device's v73"]
    eligible = by_id[f"{X_ELITE}_qnn-2.51.0"]
    assert eligible["eligible"] and "QNN SDK 2.51.0 <= runtime's 2.51.0" in eligible["why"]
    assert eligible["onnxruntime_compatibility"]["verdict"] == "unavailable"
    assert facts["choice"].startswith("device HTP v73: its own arch first")
    json.dumps(facts)  # ready for a log line or a worker's handshake


@pytest.mark.qnn
def test_a_gpu_variant_is_listed_and_skipped_here_with_its_reason(release, tmp_path):
    """On this machine the GPU variant is never eligible (no Adreno GPU): HTP runs, and with
    no HTP variant for the chip the CPU model is the fallback, not the GPU."""
    float_model = release.parents[2] / "build" / MODEL / "buckets/static/float.onnx"
    variant = gpu("float32")
    path = f"{variant['id']}/{MODEL}_float32.onnx"
    variant["model"] = path
    variant["buckets"]["entries"][0]["model"] = path
    copy = add_variant(release, tmp_path / "r", variant, {path: float_model}, first=True)
    with qnn_ctx_runtime.load(copy) as model:
        assert model.backend == "htp" and model.variant.id == f"{X_ELITE}_qnn-2.51.0"
        by_id = {v["variant"]: v for v in model.facts()["variants"]}
    assert by_id[variant["id"]]["eligible"] is False
    assert by_id[variant["id"]]["why"] == [
        f"onnxruntime offers the QNN EP on CPU only, no GPU; {GPU_NEEDS}"
    ]
    with pytest.warns(RuntimeWarning, match="on the CPU, not the NPU"):
        model = qnn_ctx_runtime.load(copy, target="snapdragon-888", allow_cpu_fallback=True)
    with model:
        assert model.backend == "cpu"


@pytest.mark.qnn
def test_the_gpu_session_refuses_a_graph_the_gpu_does_not_run(release):
    """What makes a gpu variant fall through on a device whose GPU cannot run it: with
    session.disable_cpu_ep_fallback=1 the session fails instead of running on the CPU. Here
    QNN's GPU backend cannot even initialise (no OpenCL GPU), which is the same failure."""
    import onnxruntime as ort

    float_model = release.parents[2] / "build" / MODEL / "buckets/static/float.onnx"
    manifest = Manifest.read(release / MANIFEST_FILE)
    spec_variant = manifest.variants[0]
    buckets = dataclasses.replace(
        spec_variant.buckets,
        entries=[dataclasses.replace(spec_variant.buckets.entries[0], model=float_model.name)],
    )
    spec = SessionSpec("gpu", buckets, spec_variant.inputs, spec_variant.outputs, backend="gpu")
    with pytest.raises(
        ort.capi.onnxruntime_pybind11_state.Fail,
        match="fallback to CPU EP has been explicitly disabled",
    ):
        VariantSessions(float_model.parent, spec)
    # Without the setting the same session "works", on the CPU: the silent failure it prevents.
    options = qnn.find_qnn_ep().session_options(qnn.QnnOptions("gpu"), {}, 3)
    options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    session = ort.InferenceSession(str(float_model), options)
    placed: dict[str, int] = {}
    for subgraph in session.get_provider_graph_assignment_info():
        placed[subgraph.ep_name] = placed.get(subgraph.ep_name, 0) + len(subgraph.get_nodes())
    assert placed.get("QNNExecutionProvider", 0) == 0 and placed["CPUExecutionProvider"] >= 3
