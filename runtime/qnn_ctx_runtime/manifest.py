"""The release manifest: one definition, written by ``pipeline publish`` and read by the loader.

A manifest is parsed strictly (``qnn_ctx_runtime.typed``): ``Manifest.from_json`` collects *every*
unknown field, missing field, wrong type and bad value, then raises one ``ReleaseError`` listing
them, so that a manifest object that exists is a valid one. The format version is a closed enum;
a newer manifest is refused instead of half-understood. ``manifest.schema.json`` is generated from
these dataclasses (``json_schema()``) for consumers in other languages; a test keeps it in sync.

Format 2 describes every variant the same way: a set of one or more static shapes ("buckets"),
each with its own ctx model; a model with one static shape is a variant with one bucket. Format 1
releases (where only multi-shape variants had ``buckets``) are read by upgrading them to that form.

A variant's ``backend`` is ``htp`` (an EP-context model for one chip's NPU) or ``gpu`` (the
float or fp16 model, which QNN's GPU backend compiles on the device: no chip, no context binary,
so ``soc_model`` and ``htp_arch`` are 0 and the EPContext fields empty). A gpu variant needs no
new field, so it is format 2: a qnn-ctx-runtime that predates it reads the release and skips the
variant (its rule was "backend must be htp").

Standard library only: this module runs on the device.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path, PurePosixPath
from typing import Any

from .errors import ReleaseError
from .typed import object_schema, parse, to_json_value

MANIFEST_FILE = "manifest.json"
SCHEMA_FILE = Path(__file__).resolve().with_name("manifest.schema.json")
SCHEMA_ID = "https://qnn-ctx-pipeline.invalid/manifest.schema.json"

_SHA256 = r"^[0-9a-f]{64}$"
_VERSION = r"^[0-9]+(\.[0-9]+)+$"
_MAX_ISSUES = 25


class SchemaVersion(StrEnum):
    """Manifest format versions this code can read; add a member when the format changes."""

    V1 = "1"  # buckets only on multi-shape variants; read by upgrading (``_upgrade_v1``)
    V2 = "2"  # every variant is a set of one or more buckets


CURRENT_SCHEMA = SchemaVersion.V2
# The name of the one bucket of a model with a single static shape.
SINGLE_BUCKET = "static"


def _doc(text: str, **extra: Any) -> dict[str, Any]:
    """Field metadata: a description and optional JSON Schema keywords, for the schema file."""
    return {"description": text, **extra}


@dataclass(frozen=True)
class FileEntry:
    """One published file; the runtime refuses the release if any byte differs."""

    path: str = field(
        metadata=_doc("POSIX path relative to the release folder; no '..', not absolute.")
    )
    sha256: str = field(metadata=_doc("Hex SHA-256 of the file's bytes.", pattern=_SHA256))
    size: int = field(metadata=_doc("Size in bytes.", minimum=0))


@dataclass(frozen=True)
class TensorInfo:
    name: str = field(metadata=_doc("Graph input or output name."))
    shape: list[int] = field(
        metadata=_doc(
            "Static shape; -1 marks a dim that shape buckets serve (see buckets), or one that "
            "only the run sets in an output of a CPU tail (ai.onnx.ml labels)."
        )
    )
    dtype: str = field(
        metadata=_doc(
            "numpy dtype name, e.g. float32; str for a string tensor; onnxruntime's type name "
            "for a non-tensor output of a CPU tail, e.g. seq(map(string,tensor(float)))."
        )
    )


@dataclass(frozen=True)
class BucketAxis:
    """An input axis whose size varies between buckets, and how the runtime pads it."""

    input: str = field(metadata=_doc("Graph input name."))
    axis: int = field(metadata=_doc("Axis of that input.", minimum=0))
    dim: str = field(metadata=_doc("The config's name of the dim ([buckets] dims key)."))
    pad_value: float = field(metadata=_doc("Value the runtime pads with."))
    pad_side: str = field(
        metadata=_doc("Where the padding goes: end (right/bottom) or start (left/top).")
    )


@dataclass(frozen=True)
class BucketCrop:
    """An output axis that follows an input axis: the runtime crops it back to the true size.

    For an input of true size n the output keeps ``max(1, (n * num + add) // den + shift)``
    values, a rule measured on the source model when the release was built.
    """

    output: str = field(metadata=_doc("Graph output name."))
    axis: int = field(metadata=_doc("Axis of that output.", minimum=0))
    input: str = field(metadata=_doc("The input it follows."))
    input_axis: int = field(metadata=_doc("The input axis it follows.", minimum=0))
    num: int = field(
        metadata=_doc("Length rule: max(1, (n * num + add) // den + shift).", minimum=1)
    )
    den: int = field(metadata=_doc("Length rule denominator.", minimum=1))
    add: int = field(metadata=_doc("Length rule offset before the division."))
    shift: int = field(metadata=_doc("Length rule offset after the division."))


@dataclass(frozen=True)
class BucketEntry:
    """One static shape of the model: its own ctx .onnx (over the shared binary, if any)."""

    name: str = field(metadata=_doc("Bucket name, e.g. width160; 'static' for a single shape."))
    model: str = field(metadata=_doc("Path of the bucket's ctx .onnx; one of the variant's files."))
    inputs: list[TensorInfo] = field(metadata=_doc("The bucket's static input shapes."))
    outputs: list[TensorInfo] = field(metadata=_doc("The bucket's static output shapes."))
    qdq_sha256: str | None = field(
        default=None,
        metadata=_doc(
            "SHA-256 of the QDQ model the bucket's context was compiled from (absent in format 1).",
            pattern=_SHA256,
        ),
    )


@dataclass(frozen=True)
class Buckets:
    """Static shape buckets of a model with a dynamic dim; which files belong together."""

    shared_binary: str | None = field(
        metadata=_doc(
            "The one context binary all buckets' ctx models reference (weight-shared); null when "
            "each bucket has its own."
        )
    )
    axes: list[BucketAxis] = field(metadata=_doc("Input axes the buckets vary, with padding."))
    crops: list[BucketCrop] = field(metadata=_doc("Outputs cropped back to the true size."))
    entries: list[BucketEntry] = field(metadata=_doc("The buckets, smallest first."))


@dataclass(frozen=True)
class Variant:
    """One compiled EP-context model: a (target chip, QNN toolchain) pair."""

    id: str = field(
        metadata=_doc("Folder of the variant in the release; carries target and QNN SDK version.")
    )
    target: str = field(
        metadata=_doc(
            "Chip name from qnn_ctx_runtime.targets, e.g. snapdragon-x-elite; 'gpu' for a gpu "
            "variant, which is not built for one chip."
        )
    )
    soc_model: int = field(
        metadata=_doc("QNN soc_model the binary was built for; 0 for a gpu variant.", minimum=0)
    )
    htp_arch: int = field(
        metadata=_doc(
            "QNN htp_arch the binary was built for (e.g. 73 for v73); 0 for a gpu variant.",
            minimum=0,
        )
    )
    backend: str = field(
        metadata=_doc(
            "QNN backend: htp (an EP-context model for the NPU) or gpu (a float or fp16 model "
            "QNN's GPU backend compiles at load, with session.disable_cpu_ep_fallback=1 so that "
            "a graph the GPU runs only in part fails instead of running on the CPU). The runtime "
            "tries htp variants, then gpu ones, then (when allowed) the CPU model."
        )
    )
    qnn_sdk_version: str = field(
        metadata=_doc(
            "QNN SDK that built the binary, read from the EPContext node.", pattern=_VERSION
        )
    )
    ep_sdk_version: str = field(
        metadata=_doc("Raw ep_sdk_version attribute of the EPContext node; empty for gpu.")
    )
    onnxruntime_qnn: str = field(
        metadata=_doc("onnxruntime-qnn version that compiled the variant.")
    )
    onnxruntime: str = field(metadata=_doc("onnxruntime version that compiled the variant."))
    ep_compatibility_info: str = field(
        metadata=_doc("Model metadata ep_compatibility_info.QNNExecutionProvider; empty for gpu.")
    )
    embed_mode: int = field(
        metadata=_doc(
            "1: context binary inside the .onnx; 0: beside it in a .bin file (0 for gpu: no "
            "context binary)."
        )
    )
    model: str = field(metadata=_doc("Path of the ctx .onnx file to load; one of files."))
    files: list[FileEntry] = field(metadata=_doc("Every file of the variant, the ctx .onnx first."))
    inputs: list[TensorInfo] = field(metadata=_doc("Graph inputs."))
    outputs: list[TensorInfo] = field(metadata=_doc("Graph outputs."))
    coverage: dict[str, Any] = field(
        metadata=_doc(
            "QNN partitions and nodes left on CPU, with the gate result. For a gpu variant that "
            "could not be run where it was built, verified_on_hardware is false and the gate "
            "runs at load on the device (session.disable_cpu_ep_fallback=1)."
        )
    )
    accuracy: dict[str, Any] = field(
        metadata=_doc("ctx vs QDQ and vs float: SNR, max abs error, cosine.")
    )
    load: dict[str, Any] = field(
        metadata=_doc("Session creation time from the QDQ model vs the ctx model.")
    )
    passed: bool = field(
        metadata=_doc("True when every gate passed; false only in --allow-partial releases.")
    )
    failed_gates: list[str] = field(
        metadata=_doc("Why a variant failed its gates; empty when passed.")
    )
    buckets: Buckets = field(
        metadata=_doc(
            "The variant's static shapes, one ctx model each (one bucket for a model with a "
            "single shape). The runtime pads an input into the smallest bucket that holds it."
        ),
    )


@dataclass(frozen=True)
class CpuModel:
    """A model the CPU EP can run, for consumers that explicitly accept CPU fallback."""

    kind: str = field(
        metadata=_doc("What the model is, e.g. qdq (the quantized model the ctx was built from).")
    )
    model: str = field(metadata=_doc("Path of the .onnx file; one of files."))
    files: list[FileEntry] = field(metadata=_doc("Every file of the CPU model."))


@dataclass(frozen=True)
class Excluded:
    """A configured variant that is not in the release, and why."""

    id: str = field(metadata=_doc("Variant id, as it would have been named."))
    reason: str = field(metadata=_doc("Why it was left out."))


@dataclass(frozen=True)
class Manifest:
    """What a release holds and how each variant was built."""

    schema_version: SchemaVersion = field(metadata=_doc("Manifest format version."))
    model: str = field(metadata=_doc("Model name."))
    version: str = field(metadata=_doc("Release version of the model."))
    created: str = field(
        metadata=_doc("Creation time, ISO 8601 UTC. Not part of the release's identity.")
    )
    generator: str = field(metadata=_doc("Tool and version that wrote the release."))
    source_sha256: str = field(metadata=_doc("SHA-256 of the float source model.", pattern=_SHA256))
    config_digest: str = field(metadata=_doc("Hash of every setting of the model config."))
    quantization: dict[str, Any] = field(
        metadata=_doc("Quantization settings and accuracy summary.")
    )
    variants: list[Variant] = field(metadata=_doc("Compiled variants, best first is not implied."))
    cpu_fallback: CpuModel | None = field(metadata=_doc("CPU-runnable model, or null."))
    excluded: list[Excluded] = field(metadata=_doc("Configured variants left out of the release."))
    source_data_sha256: dict[str, str] | None = field(
        default=None,
        metadata=_doc(
            "SHA-256 of each external data file of the float source model (its location, "
            "relative to the model, -> digest): a model saved with external data keeps its "
            "weights there, not in the file source_sha256 covers. Absent when it has none."
        ),
    )

    # -- reading --------------------------------------------------------------------------------

    @classmethod
    def from_json(cls, text: str | bytes, source: str = MANIFEST_FILE) -> Manifest:
        """Parse and validate; every problem is reported at once in one ReleaseError."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ReleaseError(
                f"{source} is not valid JSON: {exc}.",
                tip="The release is damaged; download or publish it again.",
            ) from None
        return cls.from_dict(data, source)

    @classmethod
    def from_dict(cls, data: Any, source: str = MANIFEST_FILE) -> Manifest:
        issues: list[str] = []
        version = data.get("schema_version") if isinstance(data, dict) else None
        if version is not None and version not in {v.value for v in SchemaVersion}:
            known = ", ".join(repr(v.value) for v in SchemaVersion)
            raise ReleaseError(
                f"{source}: schema_version {version!r} is not a format this qnn-ctx-runtime "
                f"reads ({known}).",
                tip="A newer release needs a newer qnn-ctx-runtime: upgrade it, or publish the "
                "release again with the builder version you run here.",
            )
        if version == SchemaVersion.V1.value:
            data = _upgrade_v1(data)
        manifest = parse(cls, data, "", issues)
        if manifest is not None:
            _check_semantics(manifest, issues)
        if issues or manifest is None:
            shown = issues[:_MAX_ISSUES]
            more = len(issues) - len(shown)
            raise ReleaseError(
                f"{source} is not a valid release manifest ({len(issues)} issue"
                f"{'s' if len(issues) != 1 else ''}):\n  - "
                + "\n  - ".join(shown)
                + (f"\n  - … and {more} more" if more else ""),
                tip="The manifest was edited or written by another tool; publish the release "
                "again with `python -m pipeline publish`.",
            )
        return manifest

    @classmethod
    def read(cls, path: str | Path) -> Manifest:
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise ReleaseError(
                f"Cannot read the release manifest {path}: {exc.strerror or exc}.",
                tip="Pass a release folder that holds manifest.json, or its archive.",
            ) from None
        return cls.from_json(raw, str(path))

    # -- writing --------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return to_json_value(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"

    # -- queries --------------------------------------------------------------------------------

    def files(self) -> list[FileEntry]:
        """Every file the release must hold besides manifest.json."""
        entries = [f for v in self.variants for f in v.files]
        if self.cpu_fallback is not None:
            entries.extend(self.cpu_fallback.files)
        return entries

    def identity(self) -> dict[str, Any]:
        """The content that makes a release what it is: all but when and by what it was written."""
        data = self.to_dict()
        data.pop("created", None)
        data.pop("generator", None)
        return data

    def differences(self, other: Manifest, limit: int = 12) -> list[str]:
        """Readable differences between two releases' content, file hashes first."""
        mine, theirs = _flatten(self.identity()), _flatten(other.identity())
        lines = []
        for key in sorted(mine.keys() | theirs.keys(), key=lambda k: (".sha256" not in k, k)):
            if key not in theirs:
                lines.append(f"{key}: only in the new release ({mine[key]!r})")
            elif key not in mine:
                lines.append(f"{key}: only in the existing release ({theirs[key]!r})")
            elif mine[key] != theirs[key]:
                lines.append(f"{key}: {theirs[key]!r} (existing) != {mine[key]!r} (new)")
        if len(lines) > limit:
            lines = [*lines[:limit], f"… and {len(lines) - limit} more"]
        return lines


def safe_relative_path(path: str) -> str | None:
    """Why ``path`` cannot name a file inside a release folder, or None when it can."""
    if not path:
        return "is empty"
    if "\\" in path or ":" in path:
        return "must be a POSIX path without drive letters or backslashes"
    pure = PurePosixPath(path)
    if pure.is_absolute():
        return "is absolute"
    if any(part in ("..", ".", "") for part in path.split("/")):
        return "has '..', '.' or empty parts"
    return None


def _check_buckets(where: str, variant: Variant, buckets: Buckets, issues: list[str]) -> None:
    """A bucket set must name files of its variant and the variant's own inputs and outputs."""
    paths = {f.path for f in variant.files}
    inputs = {t.name: t for t in variant.inputs}
    outputs = {t.name: t for t in variant.outputs}
    if not buckets.entries:
        issues.append(f"{where}.entries is empty")
    names = [e.name for e in buckets.entries]
    for name in sorted({n for n in names if names.count(n) > 1}):
        issues.append(f"{where}: bucket {name!r} appears more than once")
    models = [e.model for e in buckets.entries]
    for i, entry in enumerate(buckets.entries):
        if entry.model not in paths:
            issues.append(f"{where}.entries[{i}].model {entry.model!r} is not one of the files")
        elif models.count(entry.model) > 1:
            issues.append(f"{where}.entries[{i}].model {entry.model!r} is used by two buckets")
        if sorted(t.name for t in entry.inputs) != sorted(inputs):
            issues.append(f"{where}.entries[{i}].inputs do not name the variant's inputs")
    if buckets.shared_binary is not None and buckets.shared_binary not in paths:
        issues.append(f"{where}.shared_binary {buckets.shared_binary!r} is not one of the files")
    if models and variant.model not in models:
        issues.append(f"{where}: the variant's model {variant.model!r} is not a bucket's model")
    for i, axis in enumerate(buckets.axes):
        if axis.input not in inputs or axis.axis >= len(inputs[axis.input].shape):
            issues.append(f"{where}.axes[{i}] names {axis.input}[{axis.axis}], not an input axis")
        if axis.pad_side not in ("start", "end"):
            issues.append(f"{where}.axes[{i}].pad_side must be start or end")
    for i, crop in enumerate(buckets.crops):
        if crop.output not in outputs or crop.axis >= len(outputs[crop.output].shape):
            issues.append(
                f"{where}.crops[{i}] names {crop.output}[{crop.axis}], not an output axis"
            )
        if crop.input not in inputs:
            issues.append(f"{where}.crops[{i}] follows {crop.input!r}, not an input")


def _upgrade_v1(data: dict[str, Any]) -> dict[str, Any]:
    """A format-1 manifest in format-2 form: a variant without buckets gets its one bucket.

    Format 1 wrote ``buckets`` only for multi-shape variants; its single-shape variants are one
    ctx model (``model``) with the variant's ``inputs`` and ``outputs``, which is exactly one
    bucket. Nothing else changed between the formats. Malformed input is left for the parser.
    """
    upgraded = copy.deepcopy(data)
    for variant in upgraded.get("variants") or []:
        if isinstance(variant, dict) and variant.get("buckets") is None:
            variant["buckets"] = {
                "shared_binary": None,
                "axes": [],
                "crops": [],
                "entries": [
                    {
                        "name": SINGLE_BUCKET,
                        "model": variant.get("model"),
                        "inputs": variant.get("inputs"),
                        "outputs": variant.get("outputs"),
                    }
                ],
            }
    return upgraded


def _check_backend(where: str, variant: Variant, issues: list[str]) -> None:
    """An htp variant names its chip; a gpu variant has no chip and no context binary."""
    if variant.backend == "htp" and (variant.htp_arch <= 0 or variant.soc_model <= 0):
        issues.append(f"{where}: an htp variant needs htp_arch and soc_model above 0")
    if variant.backend == "gpu":
        stray = [
            name
            for name, value in (
                ("soc_model", variant.soc_model),
                ("htp_arch", variant.htp_arch),
                ("ep_sdk_version", variant.ep_sdk_version),
                ("ep_compatibility_info", variant.ep_compatibility_info),
                ("embed_mode", variant.embed_mode),
                ("buckets.shared_binary", variant.buckets.shared_binary),
            )
            if value
        ]
        if stray:
            issues.append(
                f"{where}: a gpu variant has no chip and no context binary, but sets "
                + ", ".join(stray)
            )


def _check_semantics(manifest: Manifest, issues: list[str]) -> None:
    """Cross-field rules that the types alone cannot express."""
    seen: dict[str, str] = {}

    def check_files(owner: str, model: str, files: list[FileEntry]) -> None:
        paths = [f.path for f in files]
        for i, entry in enumerate(files):
            problem = safe_relative_path(entry.path)
            if problem:
                issues.append(f"{owner}.files[{i}].path {entry.path!r} {problem}")
            if entry.path == MANIFEST_FILE:
                issues.append(f"{owner}.files[{i}].path must not be {MANIFEST_FILE}")
            if entry.path in seen:
                issues.append(f"{owner}: file {entry.path!r} is also listed by {seen[entry.path]}")
            seen[entry.path] = owner
        if model not in paths:
            issues.append(f"{owner}.model {model!r} is not one of its files")
        elif not model.endswith(".onnx"):
            issues.append(f"{owner}.model {model!r} is not an .onnx file")

    ids = [v.id for v in manifest.variants]
    for variant_id in sorted({i for i in ids if ids.count(i) > 1}):
        issues.append(f"variants: id {variant_id!r} appears more than once")
    for i, variant in enumerate(manifest.variants):
        check_files(f"variants[{i}]", variant.model, variant.files)
        _check_backend(f"variants[{i}]", variant, issues)
        if variant.embed_mode not in (0, 1):
            issues.append(f"variants[{i}].embed_mode must be 0 or 1, got {variant.embed_mode}")
        if variant.passed and variant.failed_gates:
            issues.append(f"variants[{i}]: passed is true but failed_gates is not empty")
        _check_buckets(f"variants[{i}].buckets", variant, variant.buckets, issues)
    if manifest.cpu_fallback is not None:
        check_files("cpu_fallback", manifest.cpu_fallback.model, manifest.cpu_fallback.files)
    if not manifest.variants and manifest.cpu_fallback is None:
        issues.append("variants: the release holds no model at all")


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested JSON -> {dotted path: leaf}; list items with an id/path/name are keyed by it."""
    out: dict[str, Any] = {}
    if isinstance(value, dict):
        if not value and prefix:
            out[prefix] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for i, item in enumerate(value):
            label = next((item[k] for k in ("id", "path", "name") if k in item), i)
            out.update(_flatten(item, f"{prefix}[{label}]"))
    else:
        out[prefix] = value
    return out


def json_schema() -> dict[str, Any]:
    """The JSON Schema (2020-12) of a manifest, generated from the dataclasses above."""
    defs: dict[str, Any] = {}
    root = object_schema(Manifest, defs)
    root["description"] = (
        f"{root.get('description', '')} This schema describes format "
        f"{CURRENT_SCHEMA.value}, which publish writes; format-1 manifests (variants without "
        "buckets) are still read by qnn_ctx_runtime, which upgrades them first."
    ).strip()
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "QNN EP-context release manifest",
        **root,
        "$defs": dict(sorted(defs.items())),
    }


def schema_text() -> str:
    return json.dumps(json_schema(), indent=2) + "\n"
