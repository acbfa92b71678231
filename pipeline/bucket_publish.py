"""The manifest of a release whose variants are shape buckets.

A bucketed build folder (``pipeline.bucket_compile``) holds, per target and toolchain, the
weight-shared set (one ctx per bucket and the one ``_qnn.bin`` they all reference) and the
standalone set (one ctx and bin per bucket). ``[buckets] packaging`` says which sets become
variants of the release: ``<target>_qnn-<SDK>`` for the shared set and
``<target>_qnn-<SDK>_standalone`` for the standalone one. Each variant lists its files, its
buckets with their static shapes, the padding and cropping rules, and the shared binary, so the
runtime knows which files belong together.

What the published files say is read from the files themselves (EPContext nodes via
pipeline.qnn), as for single-shape variants; the publish environment needs no onnx. Bucketed
releases carry no CPU fallback model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .bucket_compile import BUCKETS_FILE, read_buckets_file
from .config import ModelConfig
from .errors import PublishError
from .fileio import sha256_file
from .manifest import (
    BucketAxis,
    BucketCrop,
    BucketEntry,
    Buckets,
    Excluded,
    Manifest,
    TensorInfo,
    Variant,
)
from .variant import VARIANT_FILE, VariantRecord

STANDALONE_SUFFIX = "_standalone"


def _rebuild_tip() -> str:
    return "Run `nox -s compile_ctx` again for this config."


def _check_sources(config: ModelConfig, build: Path, quantize: dict[str, Any]) -> str:
    """The source model and config must be what the build was made from; returns the sha256."""
    from .publish import check_config_digest

    inputs = quantize.get("inputs") or {}
    recorded = str(inputs.get("source_sha256", ""))
    if config.source_path.is_file():
        current = sha256_file(config.source_path)
        if recorded and current != recorded:
            raise PublishError(
                f"{config.source_path} changed since {config.model.name} was built.",
                tip="Run `nox -s quantize compile_ctx` again, then publish.",
            )
        recorded = current
    if not recorded:
        raise PublishError(
            f"No sha256 of the source model of {config.model.name} in {build / 'record.json'}.",
            tip="Run `nox -s quantize` for this config.",
        )
    check_config_digest(config, build, inputs)
    return recorded


def _specs(items: list[dict[str, Any]]) -> list[TensorInfo]:
    return [TensorInfo(t["name"], list(t["shape"]), t["dtype"]) for t in items]


def _variant(
    config: ModelConfig,
    folder: Path,
    record: VariantRecord,
    details: dict[str, Any],
    packaging: str,
    failed: list[str],
) -> tuple[Variant, list[Any]]:
    """One variant from one set of a bucketed build (the shared or the standalone set)."""
    from .publish import _entry, _finite, read_ctx_facts, variant_id

    name = f"{record.target} / onnxruntime-qnn {record.toolchain} ({packaging})"
    shared = packaging == "shared"
    if shared:
        if details.get("packaging") != "shared" or not details.get("shared", {}).get("binary"):
            raise PublishError(
                f"Variant {name}: {folder / BUCKETS_FILE} records no weight-shared set.",
                tip=_rebuild_tip(),
            )
        ctx_files = details["ctx_files"]
        bins = [details["shared"]["binary"]]
    else:
        per_bucket = details.get("standalone_files") or {}
        if not per_bucket:
            raise PublishError(
                f"Variant {name}: {folder / BUCKETS_FILE} records no standalone set.",
                tip=_rebuild_tip(),
            )
        ctx_files = {n: files[0] for n, files in per_bucket.items()}
        bins = sorted({f for files in per_bucket.values() for f in files[1:]})
    order = [b["name"] for b in details.get("plan", {}).get("buckets", [])]
    if sorted(order) != sorted(ctx_files):
        raise PublishError(
            f"Variant {name}: the buckets of {folder / BUCKETS_FILE} ({sorted(ctx_files)}) are "
            f"not the planned ones ({order}).",
            tip=_rebuild_tip(),
        )
    local = [ctx_files[n] for n in order] + bins
    missing = [f for f in local if not (folder / f).is_file()]
    if missing:
        raise PublishError(f"Variant {name}: {missing} missing from {folder}.", tip=_rebuild_tip())
    problems = []
    sdk, embed, compat = "", None, ""
    raw_sdk = ""
    for bucket in order:
        facts = read_ctx_facts(folder / ctx_files[bucket])
        if not facts.ep_sdk_versions:
            problems.append(f"{ctx_files[bucket]} has no EPContext node")
            continue
        sdk = sdk or facts.qnn_sdk_version
        raw_sdk = raw_sdk or facts.ep_sdk_versions[0]
        compat = compat or facts.ep_compatibility_info
        embed = facts.embed_modes[0] if embed is None else embed
        if facts.qnn_sdk_version != sdk:
            problems.append(f"bucket {bucket} was built with QNN SDK {facts.qnn_sdk_version}")
        if record.qnn_sdk_version and facts.qnn_sdk_version != record.qnn_sdk_version:
            problems.append(
                f"{VARIANT_FILE} says QNN SDK {record.qnn_sdk_version}, bucket {bucket}'s "
                f"EPContext node says {facts.qnn_sdk_version}"
            )
        wanted = {Path(f).name for f in bins}
        for binary in facts.bin_files:
            if binary not in wanted:
                problems.append(f"bucket {bucket} references {binary}, which is not published")
        if shared and set(facts.bin_files) != {Path(bins[0]).name}:
            problems.append(f"bucket {bucket} does not reference the shared binary {bins[0]}")
    if problems:
        raise PublishError(
            f"Variant {name} in {folder} is inconsistent: " + "; ".join(problems) + ".",
            tip="The ctx files changed after compiling; " + _rebuild_tip(),
        )
    vid = variant_id(record.target, sdk) + ("" if shared else STANDALONE_SUFFIX)

    def release_path(local_path: str) -> str:
        return f"{vid}/{Path(local_path).name}"

    sources = [_entry(folder / f, release_path(f)) for f in local]
    plan = details["plan"]
    bucket_info = details.get("buckets", {})
    entries = [
        BucketEntry(
            name=bucket,
            model=release_path(ctx_files[bucket]),
            inputs=_specs(bucket_info.get(bucket, {}).get("inputs", [])),
            outputs=_specs(bucket_info.get(bucket, {}).get("outputs", [])),
        )
        for bucket in order
    ]
    buckets = Buckets(
        shared_binary=release_path(bins[0]) if shared else None,
        axes=[
            BucketAxis(p["input"], p["axis"], p["dim"], float(p["value"]), p["side"])
            for p in plan["pads"]
        ],
        crops=[
            BucketCrop(
                c["output"],
                c["axis"],
                c["input"],
                c["input_axis"],
                c["num"],
                c["den"],
                c["add"],
                c["shift"],
            )
            for c in plan["crops"]
        ],
        entries=entries,
    )
    accuracy = {
        **record.validation,
        "validated_with": details.get("validated_with"),
        "shared_load_probe": details.get("shared_load_probe"),
    }
    size_key = "shared" if shared else "standalone"
    load = {
        **record.load,
        "sizes": {release_path(f): (folder / f).stat().st_size for f in local},
        "memory": details.get("memory", {}),
        "total_bytes": (details.get(size_key) or {}).get("total_bytes"),
    }
    variant = Variant(
        id=vid,
        target=record.target,
        soc_model=record.soc_model,
        htp_arch=record.htp_arch,
        backend=record.backend,
        qnn_sdk_version=sdk,
        ep_sdk_version=raw_sdk,
        onnxruntime_qnn=record.toolchain,
        onnxruntime=record.onnxruntime,
        ep_compatibility_info=compat,
        embed_mode=int(embed or 0),
        model=entries[-1].model,
        files=[s.entry for s in sources],
        inputs=[TensorInfo(t.name, list(t.shape), t.dtype) for t in record.inputs],
        outputs=[TensorInfo(t.name, list(t.shape), t.dtype) for t in record.outputs],
        coverage=_finite(record.coverage),
        accuracy=_finite(accuracy),
        load=_finite(load),
        passed=not failed,
        failed_gates=failed,
        buckets=buckets,
    )
    return variant, sources


def build_bucket_manifest(
    config: ModelConfig, artifacts: Path, allow_partial: bool = False, cpu_fallback: bool = True
) -> tuple[Manifest, list[Any]]:
    """The manifest and files of a bucketed release (``cpu_fallback`` has no effect here)."""
    from .publish import (
        _failed_gates,
        _quantize_record,
        _read_variant,
        release_manifest,
        require_variants,
        variant_id,
    )
    from .toolchains import load_pins

    name = config.model.name
    build = Path(artifacts) / "build" / name
    quantize = _quantize_record(build)
    if not quantize.get("buckets"):
        raise PublishError(
            f"{build / 'record.json'} records no bucketed quantize build for {name}.",
            tip="Run `nox -s quantize compile_ctx` for this config.",
        )
    source_sha256 = _check_sources(config, build, quantize)
    variants: list[Variant] = []
    sources: list[Any] = []
    excluded: list[Excluded] = []
    for toolchain in load_pins().selected(config.compile.toolchains):
        for target in config.compile.targets:
            folder = build / "ctx" / toolchain.onnxruntime_qnn / target
            for packaging in config.buckets.packaging:
                planned = variant_id(target, toolchain.qnn_sdk) + (
                    "" if packaging == "shared" else STANDALONE_SUFFIX
                )
                if not (folder / VARIANT_FILE).is_file() or not (folder / BUCKETS_FILE).is_file():
                    excluded.append(Excluded(planned, f"not built: no {folder / BUCKETS_FILE}"))
                    continue
                record = _read_variant(folder)
                failed = _failed_gates(record)
                if failed and (not allow_partial or record.status != "ok"):
                    excluded.append(Excluded(planned, "; ".join(failed)))
                    continue
                details = read_buckets_file(folder)
                variant, files = _variant(config, folder, record, details, packaging, failed)
                if any(v.id == variant.id for v in variants):
                    raise PublishError(
                        f"Two toolchains built {variant.id} (same target and QNN SDK).",
                        tip="Keep only one of them in compile.toolchains.",
                    )
                variants.append(variant)
                sources.extend(files)
    require_variants(config, variants, excluded, allow_partial)
    return release_manifest(config, quantize, source_sha256, variants, excluded, None), sources
