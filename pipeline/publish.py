"""Stage 3: variants that passed their gates -> an immutable, versioned, verifiable release.

``<artifacts>/releases/<model>/<version>/`` holds ``manifest.json``, one folder per variant named
``<target>_qnn-<QNN SDK>`` with its ctx ``.onnx`` (and ``.bin``), ``cpu/`` with the QDQ model for
an explicit CPU fallback, and ``<model>-<version>.tar.gz`` with its ``.sha256``.

A release is never changed once visible: it is assembled in a hidden temporary folder beside its
final place and renamed into place in one step, so a kill at any moment leaves the previous state
or the complete release. Publishing the same content again is a no-op; different content under
an existing version is refused, naming what differs.

The QNN SDK version is read from the EPContext node itself (pipeline.qnn's protobuf reader), so
the publish environment needs no onnx.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gzip
import json
import math
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import __version__, qnn
from .config import EXAMPLE_CONFIGS, ModelConfig, load_config
from .errors import PipelineError, PublishError
from .fileio import sha256_file
from .manifest import (
    MANIFEST_FILE,
    CpuModel,
    Excluded,
    FileEntry,
    Manifest,
    SchemaVersion,
    TensorInfo,
    Variant,
)
from .toolchains import load_pins
from .variant import VARIANT_FILE, VariantRecord

HELP = """\
Publish the variants that passed their gates as an immutable, versioned release.

For each config, collects <artifacts>/build/<model>/ctx/<toolchain>/<target>/ for every
configured target and toolchain, and writes <artifacts>/releases/<model>/<version>/ with
manifest.json, one folder per variant (named after target and QNN SDK), the QDQ model for
explicit CPU fallback, and <model>-<version>.tar.gz with its .sha256. Publishing the same
content again does nothing; different content under an existing version is refused: bump
model.version. With no config, publishes the bundled examples.

examples:
  python -m pipeline publish
  python -m pipeline publish configs/example.toml --allow-partial
"""

CPU_FOLDER = "cpu"
_TEMP_MARK = ".publish-"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("configs", nargs="*", type=Path, help="model configs (TOML)")
    parser.add_argument("--artifacts", type=Path, default=Path("artifacts"), help="artifacts root")
    parser.add_argument(
        "--allow-partial",
        action="store_true",
        help="also publish variants that failed a gate, marked passed=false in the manifest",
    )
    parser.add_argument(
        "--no-cpu-fallback",
        action="store_true",
        help="leave the QDQ model (the CPU fallback) out of the release",
    )


def run(args: argparse.Namespace) -> int:
    for path in list(args.configs) or EXAMPLE_CONFIGS:
        config = load_config(path, check_files=False)
        result = publish_model(
            config,
            args.artifacts,
            allow_partial=args.allow_partial,
            cpu_fallback=not args.no_cpu_fallback,
        )
        print(result.summary_line())
    return 0


@dataclass
class PublishResult:
    folder: Path
    manifest: Manifest
    unchanged: bool

    def summary_line(self) -> str:
        m = self.manifest
        if self.unchanged:
            return f"{m.model} {m.version}: already published with the same content ({self.folder})"
        passed = sum(v.passed for v in m.variants)
        text = f"{m.model} {m.version}: published {passed} variant(s)"
        if len(m.variants) > passed:
            text += f" and {len(m.variants) - passed} marked failed"
        if m.excluded:
            text += f", left out {len(m.excluded)} ({'; '.join(e.id for e in m.excluded)})"
        return f"{text} -> {self.folder}"


# -- what the compiled file itself says ---------------------------------------------------------


@dataclass(frozen=True)
class CtxFacts:
    """ModelProto metadata and EPContext attributes, read from the ctx file (not the config)."""

    ep_sdk_versions: list[str]
    embed_modes: list[int]
    bin_files: list[str]
    ep_compatibility_info: str

    @property
    def qnn_sdk_version(self) -> str:
        """'v2.51.0.260929181845' -> '2.51.0'."""
        return qnn.sdk_version(self.ep_sdk_versions[0]) if self.ep_sdk_versions else ""


def read_ctx_facts(path: Path) -> CtxFacts:
    """EPContext facts of an .onnx file, via pipeline.qnn's protobuf reader (no onnx needed)."""
    summary = qnn.read_model_summary(path)
    nodes = summary.nodes_of("EPContext")
    modes = [int(n.attributes.get("embed_mode", 1)) for n in nodes]
    return CtxFacts(
        ep_sdk_versions=[str(n.attributes.get("ep_sdk_version", "")) for n in nodes],
        embed_modes=modes,
        bin_files=[
            str(n.attributes.get("ep_cache_context", ""))
            for n, mode in zip(nodes, modes, strict=True)
            if mode == 0
        ],
        ep_compatibility_info=summary.metadata.get(qnn.COMPATIBILITY_KEY, ""),
    )


# -- collecting variants ------------------------------------------------------------------------


def _finite(value: Any) -> Any:
    """NaN/inf -> None, recursively: the manifest must be strict JSON and compare equal."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def variant_id(target: str, qnn_sdk_version: str) -> str:
    return f"{target}_qnn-{qnn_sdk_version}"


def _failed_gates(record: VariantRecord) -> list[str]:
    reasons = []
    if record.status != "ok":
        error = record.error or {}
        reasons.append(
            f"{error.get('stage', 'compile')}: {error.get('message', 'status ' + record.status)}"
        )
    for name, section in (("coverage", record.coverage), ("validation", record.validation)):
        if not section.get("passed"):
            reasons.append(f"{name}: {section.get('gate') or 'gate not passed'}")
    return reasons


@dataclass
class _Source:
    """A file to publish: where it is now, and its place and entry in the release."""

    source: Path
    entry: FileEntry


def _entry(source: Path, release_path: str) -> _Source:
    return _Source(source, FileEntry(release_path, sha256_file(source), source.stat().st_size))


def _collect_variant(
    config: ModelConfig, folder: Path, record: VariantRecord, toolchain: str
) -> tuple[Variant, list[_Source]]:
    """Check one compiled variant against its own files, and describe it for the manifest."""
    name = f"{record.target} / onnxruntime-qnn {toolchain}"
    if (record.model, record.model_version) != (config.model.name, config.model.version):
        raise PublishError(
            f"{folder / VARIANT_FILE} was built for {record.model} {record.model_version}, but the "
            f"config says {config.model.name} {config.model.version}.",
            tip="Run `nox -s compile_ctx` again for this config.",
        )
    missing = [f for f in record.files if not (folder / f).is_file()]
    if not record.files or missing:
        raise PublishError(
            f"Variant {name}: files {missing or '(none listed)'} are missing from {folder}.",
            tip="Run `nox -s compile_ctx` again for this config.",
        )
    model_file = record.files[0]
    try:
        facts = read_ctx_facts(folder / model_file)
    except (OSError, ValueError, IndexError) as exc:
        raise PublishError(
            f"Variant {name}: {folder / model_file} is not a readable ONNX file ({exc}).",
            tip="Run `nox -s compile_ctx` again for this config.",
        ) from None
    if not facts.ep_sdk_versions:
        raise PublishError(
            f"Variant {name}: {folder / model_file} has no EPContext node; it is not a ctx model.",
            tip="Run `nox -s compile_ctx` again for this config.",
        )
    problems = []
    if len(set(facts.ep_sdk_versions)) > 1:
        problems.append(f"EPContext nodes disagree on ep_sdk_version: {facts.ep_sdk_versions}")
    if record.qnn_sdk_version and record.qnn_sdk_version != facts.qnn_sdk_version:
        problems.append(
            f"variant.json says QNN SDK {record.qnn_sdk_version}, the EPContext node says "
            f"{facts.qnn_sdk_version}"
        )
    if record.ep_compatibility_info and record.ep_compatibility_info != facts.ep_compatibility_info:
        problems.append(
            f"variant.json says ep_compatibility_info {record.ep_compatibility_info!r}, the model "
            f"says {facts.ep_compatibility_info!r}"
        )
    for bin_file in facts.bin_files:
        if bin_file not in record.files:
            problems.append(
                f"the EPContext node needs {bin_file}, which variant.json does not list"
            )
    if problems:
        raise PublishError(
            f"Variant {name} in {folder} is inconsistent: " + "; ".join(problems) + ".",
            tip="The ctx files changed after compiling; run `nox -s compile_ctx` again.",
        )
    vid = variant_id(record.target, facts.qnn_sdk_version)
    sources = [_entry(folder / f, f"{vid}/{f}") for f in record.files]
    failed = _failed_gates(record)
    variant = Variant(
        id=vid,
        target=record.target,
        soc_model=record.soc_model,
        htp_arch=record.htp_arch,
        backend=record.backend,
        qnn_sdk_version=facts.qnn_sdk_version,
        ep_sdk_version=facts.ep_sdk_versions[0],
        onnxruntime_qnn=record.toolchain,
        onnxruntime=record.onnxruntime,
        ep_compatibility_info=facts.ep_compatibility_info,
        embed_mode=facts.embed_modes[0],
        model=f"{vid}/{model_file}",
        files=[s.entry for s in sources],
        inputs=[TensorInfo(t.name, list(t.shape), t.dtype) for t in record.inputs],
        outputs=[TensorInfo(t.name, list(t.shape), t.dtype) for t in record.outputs],
        coverage=_finite(record.coverage),
        accuracy=_finite(record.validation),
        load=_finite(record.load),
        passed=not failed,
        failed_gates=failed,
    )
    return variant, sources


def build_manifest(
    config: ModelConfig, artifacts: Path, allow_partial: bool = False, cpu_fallback: bool = True
) -> tuple[Manifest, list[_Source]]:
    """The manifest of the release this config's build would make, and the files to copy."""
    if config.buckets.enabled:  # variants made of shape buckets over one shared context
        from .bucket_publish import build_bucket_manifest

        return build_bucket_manifest(config, artifacts, allow_partial, cpu_fallback)
    name = config.model.name
    build = Path(artifacts) / "build" / name
    quantize = _quantize_record(build)
    inputs = quantize.get("inputs") or {}
    source_sha256 = str(inputs.get("source_sha256", ""))
    if config.source_path.is_file():
        current = sha256_file(config.source_path)
        if source_sha256 and current != source_sha256:
            raise PublishError(
                f"{config.source_path} changed since {name} was built (sha256 {current[:16]}… "
                f"!= {source_sha256[:16]}… in {build / 'record.json'}).",
                tip="Run `nox -s quantize compile_ctx` again, then publish.",
            )
        source_sha256 = current
    if not source_sha256:
        raise PublishError(
            f"No sha256 of the source model of {name}: {config.source_path} is missing and "
            f"{build / 'record.json'} does not record it.",
            tip="Run `nox -s quantize` for this config.",
        )
    check_config_digest(config, build, inputs)

    pins = load_pins()
    variants: list[Variant] = []
    sources: list[_Source] = []
    excluded: list[Excluded] = []
    for toolchain in pins.selected(config.compile.toolchains):
        for target in config.compile.targets:
            folder = build / "ctx" / toolchain.onnxruntime_qnn / target
            planned = variant_id(target, toolchain.qnn_sdk)
            if not (folder / VARIANT_FILE).is_file():
                excluded.append(Excluded(planned, f"not built: no {folder / VARIANT_FILE}"))
                continue
            record = _read_variant(folder)
            failed = _failed_gates(record)
            if failed and (not allow_partial or record.status != "ok"):
                excluded.append(Excluded(planned, "; ".join(failed)))
                continue
            variant, files = _collect_variant(config, folder, record, toolchain.onnxruntime_qnn)
            clash = next((v for v in variants if v.id == variant.id), None)
            if clash is not None:
                raise PublishError(
                    f"Toolchains {clash.onnxruntime_qnn} and {variant.onnxruntime_qnn} both built "
                    f"{variant.id} (same target and QNN SDK).",
                    tip="Keep only one of them in compile.toolchains.",
                )
            variants.append(variant)
            sources.extend(files)
    require_variants(config, variants, excluded, allow_partial)

    cpu = None
    qdq = build / "qdq.onnx"
    if cpu_fallback and qdq.is_file():
        expected = quantize.get("qdq_sha256")
        src = _entry(qdq, f"{CPU_FOLDER}/{name}_qdq.onnx")
        if expected and src.entry.sha256 != expected:
            raise PublishError(
                f"{qdq} changed since quantize recorded it in {build / 'record.json'}.",
                tip="Run `nox -s quantize compile_ctx` again, then publish.",
            )
        cpu = CpuModel(kind="qdq", model=src.entry.path, files=[src.entry])
        sources.append(src)
    manifest = release_manifest(config, quantize, source_sha256, variants, excluded, cpu)
    return manifest, sources


def check_config_digest(config: ModelConfig, build: Path, inputs: dict[str, Any]) -> None:
    """The config must be the one the build was made from (its digest in the quantize record)."""
    recorded = inputs.get("config_digest")
    if recorded and recorded != config.digest():
        raise PublishError(
            f"{config.path} changed since {config.model.name} was built (config digest differs "
            f"from {build / 'record.json'}).",
            tip="Run `nox -s quantize compile_ctx` again, then publish.",
        )


def require_variants(
    config: ModelConfig, variants: list[Variant], excluded: list[Excluded], allow_partial: bool
) -> None:
    """A release needs a variant that passed its gates (any variant, with --allow-partial)."""
    if not any(v.passed for v in variants) and not (allow_partial and variants):
        reasons = "\n".join(f"  - {e.id}: {e.reason}" for e in excluded)
        raise PublishError(
            f"{config.model.name} {config.model.version}: no variant passed its gates, nothing "
            f"to publish:\n{reasons}",
            tip="Run `nox -s compile_ctx` and fix the failures (or use --allow-partial).",
        )


def release_manifest(
    config: ModelConfig,
    quantize: dict[str, Any],
    source_sha256: str,
    variants: list[Variant],
    excluded: list[Excluded],
    cpu: CpuModel | None,
) -> Manifest:
    """The release's manifest, checked by the strict parser the runtime uses."""
    name = config.model.name
    manifest = Manifest(
        schema_version=SchemaVersion.V1,
        model=name,
        version=config.model.version,
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        generator=f"qnn-ctx-pipeline {__version__}",
        source_sha256=source_sha256,
        config_digest=config.digest(),
        quantization=_finite(quantize.get("summary") or {}),
        variants=variants,
        cpu_fallback=cpu,
        excluded=excluded,
    )
    # Round-trip through the strict parser: publish never writes what runtime would refuse.
    Manifest.from_json(manifest.to_json(), f"manifest of {name} {config.model.version}")
    return manifest


def _quantize_record(build: Path) -> dict[str, Any]:
    path = build / "record.json"
    try:
        record = json.loads(path.read_text("utf-8"))
    except (OSError, json.JSONDecodeError):
        record = {}
    quantize = record.get("quantize") if isinstance(record, dict) else None
    if not isinstance(quantize, dict) or quantize.get("status") != "ok":
        raise PublishError(
            f"No successful quantize build recorded in {path}.",
            tip="Run `nox -s quantize compile_ctx` for this config first.",
        )
    return quantize


def _read_variant(folder: Path) -> VariantRecord:
    try:
        return VariantRecord.read(folder)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise PublishError(
            f"{folder / VARIANT_FILE} is unreadable or malformed: {exc}.",
            tip="Run `nox -s compile_ctx` again for this config.",
        ) from None


# -- writing the release ------------------------------------------------------------------------


def archive_name(manifest: Manifest) -> str:
    return f"{manifest.model}-{manifest.version}.tar.gz"


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_archive(folder: Path, manifest: Manifest) -> Path:
    """A reproducible tar.gz of the release (sorted, fixed times and owners), with its .sha256."""
    target = folder / archive_name(manifest)
    names = [MANIFEST_FILE, *sorted(e.path for e in manifest.files())]
    with (
        open(target, "xb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for name in names:
            info = tar.gettarinfo(str(folder / name), arcname=name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            info.mode = 0o644
            with open(folder / name, "rb") as handle:
                tar.addfile(info, handle)
    (folder / f"{target.name}.sha256").write_text(
        f"{sha256_file(target)}  {target.name}\n", encoding="utf-8"
    )
    return target


def _assemble(folder: Path, manifest: Manifest, sources: list[_Source]) -> None:
    """Copy and re-hash every file into ``folder``, then write the manifest and the archive."""
    for item in sources:
        target = folder / item.entry.path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(item.source, target)
        if sha256_file(target) != item.entry.sha256:
            raise PublishError(
                f"{item.source} changed while it was being published.",
                tip="Do not rebuild while publishing; run publish again.",
            )
        _fsync_file(target)
    (folder / MANIFEST_FILE).write_text(manifest.to_json(), encoding="utf-8")
    _fsync_file(folder / MANIFEST_FILE)
    archive = _write_archive(folder, manifest)
    _fsync_file(archive)
    for sub in {folder / Path(e.path).parent for e in manifest.files()} | {folder}:
        _fsync_dir(sub)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _remove_stale_temps(parent: Path) -> None:
    """Hidden folders of publish runs that were killed (their process is gone)."""
    if not parent.is_dir() or os.name != "posix":
        return
    for path in parent.iterdir():
        if not (path.name.startswith(".") and _TEMP_MARK in path.name):
            continue
        pid_text = path.name.split(_TEMP_MARK, 1)[1].split("-", 1)[0]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            shutil.rmtree(path, ignore_errors=True)


def _same_or_refuse(final: Path, manifest: Manifest) -> Manifest:
    """An existing release: the same content is fine (it is verified), different is refused."""
    from .runtime import verify_folder

    try:
        existing = verify_folder(final)
    except PipelineError as exc:
        raise PublishError(
            f"Release {final} already exists but is damaged:\n{exc.message}",
            tip="Releases are immutable: remove that folder by hand only if nobody uses it, "
            "or bump model.version.",
        ) from None
    if manifest.identity() != existing.identity():
        differences = manifest.differences(existing)
        raise PublishError(
            f"Release {manifest.model} {manifest.version} already exists in {final} with "
            f"different content:\n  - " + "\n  - ".join(differences),
            tip="Releases are immutable: bump model.version in the config to publish this build.",
        )
    return existing


def publish_model(
    config: ModelConfig, artifacts: Path, allow_partial: bool = False, cpu_fallback: bool = True
) -> PublishResult:
    """Publish one model's release, atomically; the same content again is a no-op."""
    manifest, sources = build_manifest(config, artifacts, allow_partial, cpu_fallback)
    parent = Path(artifacts) / "releases" / manifest.model
    final = parent / manifest.version
    if final.exists():
        return PublishResult(final, _same_or_refuse(final, manifest), unchanged=True)
    parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(parent)
    temp = Path(
        tempfile.mkdtemp(prefix=f".{manifest.version}{_TEMP_MARK}{os.getpid()}-", dir=parent)
    )
    try:
        _assemble(temp, manifest, sources)
        os.chmod(temp, 0o755)  # mkdtemp makes it 0700
        try:
            os.rename(temp, final)  # atomic; fails if another publish got there first
        except OSError:
            if not final.exists():
                raise
            return PublishResult(final, _same_or_refuse(final, manifest), unchanged=True)
        _fsync_dir(parent)
    finally:
        with contextlib.suppress(OSError):
            if temp.exists():
                shutil.rmtree(temp)
    return PublishResult(final, manifest, unchanged=False)
