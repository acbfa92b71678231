"""From build records to a release manifest: which variants go in, and the proof they fit.

Each compiled variant folder holds one or two sets of ctx files (``pipeline.core.records.CtxSet``):
a model with one static shape has one ("single"); a model with several buckets has the weight-shared
set and/or the standalone set, as ``[buckets] packaging`` asks, and each becomes a variant of the
release (``<target>_qnn-<SDK>`` and ``<target>_qnn-<SDK>_standalone``).

Nothing stale gets in: the source model, the config and every bucket's QDQ model must be the ones
the quantize record names, and every variant must have been compiled from exactly those QDQ
models (its ``built_from`` digests); otherwise publishing is refused, naming the variant and the
fix. What the published files say (QNN SDK, compatibility info, binaries) is read from the files
themselves (EPContext nodes, via qnn_ctx_runtime.qnn), so the publish environment needs no onnx.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from qnn_ctx_runtime import qnn
from qnn_ctx_runtime.manifest import (
    CURRENT_SCHEMA,
    BucketAxis,
    BucketCrop,
    BucketEntry,
    Buckets,
    CpuModel,
    Excluded,
    FileEntry,
    Manifest,
    TensorInfo,
    Variant,
)
from qnn_ctx_runtime.toolchains import load_toolchains
from qnn_ctx_runtime.toolchains import version_key as qnn_version_key
from qnn_ctx_runtime.typed import to_json_value

from .. import __version__
from ..core.config import ModelConfig
from ..core.errors import PublishError
from ..core.fileio import sha256_file
from ..core.layout import GPU_TARGET, ModelPaths, VariantPaths
from ..core.records import CtxSet, QuantizeRecord, TensorSpec, VariantRecord, read_record

CPU_FOLDER = "cpu"
STANDALONE_SUFFIX = "_standalone"
RECOMPILE = "Run `nox -s compile_ctx` again for this config."
REBUILD = "Run `nox -s quantize compile_ctx` again, then publish."


@dataclass
class Source:
    """A file to publish: where it is now, and its place and entry in the release."""

    source: Path
    entry: FileEntry


def _source(path: Path, release_path: str) -> Source:
    return Source(path, FileEntry(release_path, sha256_file(path), path.stat().st_size))


def finite(value: Any) -> Any:
    """NaN/inf -> None, recursively (records first become JSON values): the manifest must be
    strict JSON and compare equal to itself."""
    value = to_json_value(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def variant_id(target: str, qnn_sdk_version: str) -> str:
    return f"{target}_qnn-{qnn_sdk_version}"


@dataclass(frozen=True)
class CtxFileFacts:
    """ModelProto metadata and EPContext attributes, read from the ctx file (not the config)."""

    ep_sdk_versions: list[str]
    embed_modes: list[int]
    bin_files: list[str]
    ep_compatibility_info: str

    @property
    def qnn_sdk_version(self) -> str:
        """'v2.51.0.260929181845' -> '2.51.0'."""
        return qnn.sdk_version(self.ep_sdk_versions[0]) if self.ep_sdk_versions else ""


def read_ctx_facts(path: Path) -> CtxFileFacts:
    """EPContext facts of an .onnx file, via the protobuf reader of qnn_ctx_runtime.qnn."""
    summary = qnn.read_model_summary(path)
    nodes = summary.nodes_of("EPContext")
    modes = [int(n.attributes.get("embed_mode", 1)) for n in nodes]
    return CtxFileFacts(
        ep_sdk_versions=[str(n.attributes.get("ep_sdk_version", "")) for n in nodes],
        embed_modes=modes,
        bin_files=[
            str(n.attributes.get("ep_cache_context", ""))
            for n, mode in zip(nodes, modes, strict=True)
            if mode == 0
        ],
        ep_compatibility_info=summary.metadata.get(qnn.COMPATIBILITY_KEY, ""),
    )


# -- the chain: source -> config -> QDQ -> ctx --------------------------------------------------


def source_changes(source: Path, record: QuantizeRecord) -> str | None:
    """The source file that differs from the one ``record`` was built from, with its digests.

    Why: a release records the digests of what it was built from, the source's external data
    files (its weights) included; publishing after either changed would stamp a release with
    digests of files it was not built from. A source that is not on this machine (a release
    assembled from shards) is taken as recorded.
    """
    if not source.is_file():
        return None
    current = sha256_file(source)
    if current != record.inputs.source_sha256:
        return f"{source} (sha256 {current[:16]}…, recorded {record.inputs.source_sha256[:16]}…)"
    for location, digest in sorted(record.inputs.source_data.items()):
        data = source.parent / location
        now = sha256_file(data) if data.is_file() else None
        if now != digest:
            state = "missing" if now is None else f"sha256 {now[:16]}…"
            return f"{data}, the external data of {source.name} ({state}, recorded {digest[:16]}…)"
    return None


def check_quantize_chain(config: ModelConfig, paths: ModelPaths) -> QuantizeRecord:
    """The quantize record, proven to match the source model, the config and the QDQ files."""
    record, why = read_record(QuantizeRecord, paths.record)
    if record is None or record.status != "ok":
        reason = (
            "; ".join(why) if record is None else "its QDQ model failed quantization.min_snr_db"
        )
        raise PublishError(
            f"No successful quantize build of {config.model.name} is recorded ({reason}).",
            tip="Run `nox -s quantize compile_ctx` for this config first.",
        )
    changed = source_changes(config.source_path, record)
    if changed:
        raise PublishError(
            f"{changed} changed since {config.model.name} was built (as {paths.record} says).",
            tip=REBUILD,
        )
    if record.inputs.config_digest != config.quantize_digest():
        raise PublishError(
            f"{config.path} changed since {config.model.name} was quantized (the settings "
            f"quantize reads differ from {paths.record}).",
            tip=REBUILD,
        )
    for bucket in record.buckets:
        qdq = paths.bucket(bucket.name).qdq
        if not qdq.is_file() or sha256_file(qdq) != bucket.qdq_sha256:
            raise PublishError(
                f"{qdq} is missing or changed since quantize recorded it in {paths.record}.",
                tip=REBUILD,
            )
    return record


def _check_built_from(
    name: str,
    folder: Path,
    variant: VariantRecord,
    quantize: QuantizeRecord,
    compile_digest: str | None = None,
) -> None:
    """A variant must have been compiled from what the quantize record names now, the whole
    chain: source model, quantize settings, and every bucket's float model, QDQ model and
    held-out samples; and with the current ``[compile]`` settings (when both record them)."""
    built = variant.built_from
    stale = [
        f"bucket {b.name}: compiled from QDQ {built.qdq_sha256.get(b.name, 'none')[:16]}…, the "
        f"current one is {b.qdq_sha256[:16]}…"
        for b in quantize.buckets
        if built.qdq_sha256.get(b.name) != b.qdq_sha256
    ]
    stale += [
        f"bucket {b.name}: compiled against another prepared float model"
        for b in quantize.buckets
        if b.name in built.float_sha256 and built.float_sha256[b.name] != b.float_sha256
    ]
    stale += [
        f"bucket {b.name}: validated on other held-out samples"
        for b in quantize.buckets
        if b.name in built.heldout_digest and built.heldout_digest[b.name] != b.heldout_digest
    ]
    if built.config_digest != quantize.inputs.config_digest:
        stale.append("it was built from other quantize settings")
    if compile_digest and built.compile_digest and built.compile_digest != compile_digest:
        stale.append("it was compiled with other [compile] settings")
    extra = sorted(set(built.qdq_sha256) - {b.name for b in quantize.buckets})
    if extra:
        stale.append(f"it has buckets {extra} the current build does not")
    if built.source_sha256 != quantize.inputs.source_sha256:
        stale.append("it was built from another source model")
    if stale:
        raise PublishError(
            f"Variant {name} in {folder} was compiled from another build than the current one: "
            + "; ".join(stale)
            + ".",
            tip=RECOMPILE + " (a stale variant is never published).",
        )


# -- one set of ctx files -> one manifest variant ----------------------------------------------


def _tensor_infos(specs: list[TensorSpec]) -> list[TensorInfo]:
    return [TensorInfo(t.name, list(t.shape), t.dtype) for t in specs]


def _checked_facts(
    name: str, folder: Path, record: VariantRecord, ctx_set: CtxSet, order: list[str]
) -> dict[str, CtxFileFacts]:
    """What each bucket's ctx file says about itself, checked against the variant's record."""
    problems = []
    facts_by_bucket = {}
    for bucket in order:
        try:
            facts = read_ctx_facts(folder / ctx_set.ctx_files[bucket])
        except (OSError, ValueError, IndexError) as exc:
            raise PublishError(
                f"Variant {name}: {ctx_set.ctx_files[bucket]} is not a readable ONNX file ({exc}).",
                tip=RECOMPILE,
            ) from None
        if not facts.ep_sdk_versions:
            problems.append(f"{ctx_set.ctx_files[bucket]} has no EPContext node")
            continue
        facts_by_bucket[bucket] = facts
        if len(set(facts.ep_sdk_versions)) > 1:
            problems.append(f"bucket {bucket}: EPContext nodes disagree: {facts.ep_sdk_versions}")
        if facts.qnn_sdk_version != record.qnn_sdk:
            problems.append(
                f"{VariantPaths(folder).record.name} says QNN SDK {record.qnn_sdk}, bucket "
                f"{bucket}'s EPContext node says {facts.qnn_sdk_version}"
            )
        recorded = ctx_set.facts.get(bucket)
        if recorded and recorded.ep_compatibility_info != facts.ep_compatibility_info:
            problems.append(
                f"bucket {bucket}: the record says ep_compatibility_info "
                f"{recorded.ep_compatibility_info!r}, the model says {facts.ep_compatibility_info!r}"
            )
        wanted = {PurePosixPath(b).name for b in ctx_set.bins}
        for binary in facts.bin_files:
            if binary not in wanted:
                problems.append(f"bucket {bucket} needs {binary}, which the record does not list")
    if problems:
        raise PublishError(
            f"Variant {name} in {folder} is inconsistent: " + "; ".join(problems) + ".",
            tip="The ctx files changed after compiling; " + RECOMPILE,
        )
    return facts_by_bucket


def _release_buckets(
    record: VariantRecord,
    ctx_set: CtxSet,
    quantize: QuantizeRecord,
    order: list[str],
    release_path: Callable[[str], str],
) -> Buckets:
    """The manifest's buckets of one set: ctx file, static shapes, QDQ digest, pad and crop."""
    entries = [
        BucketEntry(
            name=bucket,
            model=release_path(ctx_set.ctx_files[bucket]),
            inputs=_tensor_infos(record.buckets[bucket].inputs),
            outputs=_tensor_infos(record.buckets[bucket].outputs),
            qdq_sha256=record.built_from.qdq_sha256[bucket],
        )
        for bucket in order
    ]
    return Buckets(
        shared_binary=release_path(ctx_set.bins[0]) if ctx_set.kind == "shared" else None,
        axes=[BucketAxis(p.input, p.axis, p.dim, float(p.value), p.side) for p in quantize.pads],
        crops=[
            BucketCrop(c.output, c.axis, c.input, c.input_axis, c.num, c.den, c.add, c.shift)
            for c in quantize.crops
        ],
        entries=entries,
    )


def _set_variant(
    folder: Path,
    record: VariantRecord,
    ctx_set: CtxSet,
    quantize: QuantizeRecord,
    multi: bool,
    failed: list[str],
) -> tuple[Variant, list[Source]]:
    """One variant of the release from one set of a compiled variant folder."""
    name = f"{record.target} / onnxruntime-qnn {record.toolchain} ({ctx_set.kind})"
    order = [b.name for b in quantize.buckets]
    if sorted(ctx_set.ctx_files) != sorted(order):
        raise PublishError(
            f"Variant {name}: its buckets ({sorted(ctx_set.ctx_files)}) are not the built ones "
            f"({order}).",
            tip=RECOMPILE,
        )
    local = [ctx_set.ctx_files[n] for n in order] + list(ctx_set.bins)
    missing = [f for f in local if not (folder / f).is_file()]
    if missing:
        raise PublishError(f"Variant {name}: {missing} missing from {folder}.", tip=RECOMPILE)
    facts_by_bucket = _checked_facts(name, folder, record, ctx_set, order)
    first = facts_by_bucket[order[0]]
    vid = variant_id(record.target, first.qnn_sdk_version)
    if ctx_set.kind == "standalone" and multi:
        vid += STANDALONE_SUFFIX

    def release_path(local_path: str) -> str:
        return f"{vid}/{PurePosixPath(local_path).name}"

    sources = [_source(folder / f, release_path(f)) for f in local]
    buckets = _release_buckets(record, ctx_set, quantize, order, release_path)
    accuracy = finite(record.validation) or {}
    if multi:
        accuracy.update(validated_with=record.validated_with)
        if record.shared_load_probe:
            accuracy.update(shared_load_probe=record.shared_load_probe)
    load = finite(record.load) or {}
    load.update(
        sizes={release_path(f): (folder / f).stat().st_size for f in local},
        total_bytes=ctx_set.total_bytes,
    )
    if record.memory is not None:
        load.update(memory=finite(record.memory))
    variant = Variant(
        id=vid,
        target=record.target,
        soc_model=record.soc_model,
        htp_arch=record.htp_arch,
        backend=record.backend,
        qnn_sdk_version=first.qnn_sdk_version,
        ep_sdk_version=first.ep_sdk_versions[0],
        onnxruntime_qnn=record.toolchain,
        onnxruntime=record.onnxruntime,
        ep_compatibility_info=first.ep_compatibility_info,
        embed_mode=first.embed_modes[0],
        model=buckets.entries[-1].model,
        files=[s.entry for s in sources],
        inputs=_tensor_infos(record.inputs),
        outputs=_tensor_infos(record.outputs),
        coverage=finite(record.coverage) or {},
        accuracy=accuracy,
        load=load,
        passed=not failed,
        failed_gates=failed,
        buckets=buckets,
    )
    return variant, sources


# -- the gpu variant --------------------------------------------------------------------------


def _gpu_variants(
    config: ModelConfig, paths: ModelPaths, quantize: QuantizeRecord, allow_partial: bool
) -> tuple[list[Variant], list[Source], list[Excluded]]:
    """The gpu variant (pipeline.compile.gpu) of the newest toolchain that built one; it is
    the same model whichever toolchain wrote it, so one is published."""
    precision = config.compile.gpu
    chosen: Variant | None = None
    sources: list[Source] = []
    excluded: list[Excluded] = []
    toolchains = sorted(
        load_toolchains().selected(config.compile.toolchains),
        key=lambda t: qnn_version_key(t.qnn_sdk),
        reverse=True,
    )
    for toolchain in toolchains:
        vid = f"{GPU_TARGET}-{precision}_qnn-{toolchain.qnn_sdk}"
        folder = paths.variant(toolchain.onnxruntime_qnn, GPU_TARGET)
        record, why = read_record(VariantRecord, folder.record)
        if record is None:
            reason = "not built" if not folder.record.is_file() else "; ".join(why)
            excluded.append(Excluded(vid, reason))
            continue
        _check_built_from(
            f"gpu / onnxruntime-qnn {toolchain.onnxruntime_qnn}", folder.root, record, quantize
        )
        files = record.sets[0].ctx_files if record.sets else {}
        if any(f"_gpu-{precision}_" not in name for name in files.values()):
            excluded.append(
                Excluded(vid, f"built for another precision than {precision}; {RECOMPILE}")
            )
            continue
        failed = record.failed_gates()
        if failed and (not allow_partial or record.status != "ok"):
            excluded.append(Excluded(vid, "; ".join(failed)))
        elif chosen is not None:
            excluded.append(Excluded(vid, f"the same {precision} model as {chosen.id}"))
        else:
            chosen, sources = _gpu_variant(vid, folder.root, record, quantize, precision, failed)
    return ([chosen] if chosen else []), sources, excluded


def _gpu_variant(
    vid: str,
    folder: Path,
    record: VariantRecord,
    quantize: QuantizeRecord,
    precision: str,
    failed: list[str],
) -> tuple[Variant, list[Source]]:
    """One gpu variant of the release: a float model per bucket, no context binary."""
    order = [b.name for b in quantize.buckets]
    files = record.sets[0].ctx_files
    if sorted(files) != sorted(order):
        raise PublishError(
            f"gpu variant in {folder}: its buckets ({sorted(files)}) are not the built ones "
            f"({order}).",
            tip=RECOMPILE,
        )
    entries, sources = [], []
    for bucket in order:
        local = folder / files[bucket]
        if not local.is_file():
            raise PublishError(f"gpu variant: {local} is missing.", tip=RECOMPILE)
        summary = qnn.read_model_summary(local)
        if summary.nodes_of("EPContext"):
            raise PublishError(
                f"gpu variant: {local} holds EPContext nodes; a gpu variant is a float model.",
                tip=RECOMPILE,
            )
        source = _source(local, f"{vid}/{local.name}")
        sources.append(source)

        def infos(values: list[qnn.ValueInfo]) -> list[TensorInfo]:
            return [
                TensorInfo(v.name, [d if isinstance(d, int) else -1 for d in v.shape], v.dtype)
                for v in values
            ]

        entries.append(
            BucketEntry(bucket, source.entry.path, infos(summary.inputs), infos(summary.outputs))
        )
    buckets = Buckets(
        shared_binary=None,
        axes=[BucketAxis(p.input, p.axis, p.dim, float(p.value), p.side) for p in quantize.pads],
        crops=[
            BucketCrop(c.output, c.axis, c.input, c.input_axis, c.num, c.den, c.add, c.shift)
            for c in quantize.crops
        ],
        entries=entries,
    )
    if record.deferred_to_device:
        coverage = {
            "verified_on_hardware": False,
            "why": record.error.message if record.error else "",
            "gate": "at load on the device: session.disable_cpu_ep_fallback=1, so a graph QNN's "
            "GPU backend runs only in part fails and the runtime goes on to the CPU model",
        }
    else:
        coverage = (finite(record.coverage) or {}) | {"verified_on_hardware": True}
    variant = Variant(
        id=vid,
        target=GPU_TARGET,
        soc_model=0,
        htp_arch=0,
        backend="gpu",
        qnn_sdk_version=record.qnn_sdk,
        ep_sdk_version="",
        onnxruntime_qnn=record.toolchain,
        onnxruntime=record.onnxruntime,
        ep_compatibility_info="",
        embed_mode=0,
        model=entries[-1].model,
        files=[s.entry for s in sources],
        inputs=_tensor_infos(record.inputs),
        outputs=_tensor_infos(record.outputs),
        coverage=coverage,
        accuracy=(finite(record.validation) or {}) | {"precision": precision},
        load={
            "sizes": {s.entry.path: s.entry.size for s in sources},
            "total_bytes": sum(s.entry.size for s in sources),
        },
        passed=not failed,
        failed_gates=failed,
        buckets=buckets,
    )
    return variant, sources


# -- the release ------------------------------------------------------------------------------


def build_manifest(
    config: ModelConfig, artifacts: Path, allow_partial: bool = False, cpu_fallback: bool = True
) -> tuple[Manifest, list[Source]]:
    """The manifest of the release this config's build would make, and the files to copy."""
    paths = ModelPaths.of(artifacts, config.model.name)
    quantize = check_quantize_chain(config, paths)
    multi = len(quantize.buckets) > 1
    kinds = list(config.buckets.packaging) if multi else ["single"]
    variants: list[Variant] = []
    sources: list[Source] = []
    excluded: list[Excluded] = []
    for toolchain in load_toolchains().selected(config.compile.toolchains):
        for target in config.compile.targets:
            folder = paths.variant(toolchain.onnxruntime_qnn, target)
            base = variant_id(target, toolchain.qnn_sdk)
            planned = {k: base + (STANDALONE_SUFFIX if k == "standalone" else "") for k in kinds}
            record, why = read_record(VariantRecord, folder.record)
            if record is None:
                reason = (
                    f"not built: no {folder.record}"
                    if not folder.record.is_file()
                    else f"unreadable record: {'; '.join(why)}"
                )
                excluded += [Excluded(planned[k], reason) for k in kinds]
                continue
            where = f"{target} / onnxruntime-qnn {toolchain.onnxruntime_qnn}"
            _check_built_from(where, folder.root, record, quantize, config.compile_digest())
            failed = record.failed_gates()
            if failed and (not allow_partial or record.status != "ok"):
                excluded += [Excluded(planned[k], "; ".join(failed)) for k in kinds]
                continue
            for kind in kinds:
                ctx_set = record.set_of(kind)
                if ctx_set is None:
                    excluded.append(Excluded(planned[kind], f"no {kind} context set was built"))
                    continue
                variant, files = _set_variant(folder.root, record, ctx_set, quantize, multi, failed)
                clash = next((v for v in variants if v.id == variant.id), None)
                if clash is not None:
                    raise PublishError(
                        f"Toolchains {clash.onnxruntime_qnn} and {variant.onnxruntime_qnn} both "
                        f"built {variant.id} (same target and QNN SDK).",
                        tip="Keep only one of them in compile.toolchains.",
                    )
                variants.append(variant)
                sources.extend(files)
    if config.compile.gpu != "off":
        gpu, gpu_sources, gpu_excluded = _gpu_variants(config, paths, quantize, allow_partial)
        variants += gpu
        sources += gpu_sources
        excluded += gpu_excluded
    if not any(v.passed for v in variants) and not (allow_partial and variants):
        reasons = "\n".join(f"  - {e.id}: {e.reason}" for e in excluded)
        raise PublishError(
            f"{config.model.name} {config.model.version}: no variant passed its gates, nothing "
            f"to publish:\n{reasons}",
            tip="Run `nox -s compile_ctx` and fix the failures (or use --allow-partial).",
        )
    cpu = None
    if cpu_fallback and not multi:  # a multi-bucket CPU model would need buckets of its own
        qdq = paths.bucket(quantize.buckets[0].name).qdq
        src = _source(qdq, f"{CPU_FOLDER}/{config.model.name}_qdq.onnx")
        cpu = CpuModel(kind="qdq", model=src.entry.path, files=[src.entry])
        sources.append(src)
    manifest = Manifest(
        schema_version=CURRENT_SCHEMA,
        model=config.model.name,
        version=config.model.version,
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        generator=f"qnn-ctx-pipeline {__version__}",
        source_sha256=quantize.inputs.source_sha256,
        source_data_sha256=dict(sorted(quantize.inputs.source_data.items())) or None,
        config_digest=config.digest(),
        quantization=finite(quantize.summary),
        variants=variants,
        cpu_fallback=cpu,
        excluded=excluded,
    )
    # Round-trip through the strict parser: publish never writes what the loader would refuse.
    Manifest.from_json(
        manifest.to_json(), f"manifest of {config.model.name} {config.model.version}"
    )
    return manifest, sources
