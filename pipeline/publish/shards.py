"""Publishing from shards: the outputs of separate CI jobs, proven to fit, then published.

A matrix build (``python -m pipeline plan``) runs each quantize and compile job on its own runner.
Each leaves a *shard*: a folder in the artifacts layout (``pipeline.core.layout``) with only what
that job made: ``build/<model>/`` from a quantize job, ``build/<model>/ctx/<toolchain>/`` from a
compile job. Shards describe themselves: the quantize record names the source, config and QDQ
digests, and every ``variant.json`` the digests it was compiled from (``BuiltFrom``).

``publish_shards`` finds one model's shards among the ``--from`` folders, refuses any that do
not fit the current config or each other (naming the folder and the digest that differs), and
gathers them into ``<artifacts>/build/<model>/``, the tree a single machine would have built.
The release then comes from the ordinary ``publish_model``, so it is the release a single
machine makes. Files are hard-linked where the file system allows (``link_or_copy``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from qnn_ctx_runtime.toolchains import load_toolchains

from ..core.config import ModelConfig
from ..core.errors import PublishError
from ..core.fileio import link_or_copy, sha256_file
from ..core.layout import BUILD_DIR, VARIANT_FILE, ModelPaths
from ..core.lock import model_lock
from ..core.records import QuantizeRecord, VariantRecord, folder_digest, read_record
from .collect import source_changes
from .release import PublishResult, publish_model

REQUANTIZE = "Run the model's quantize job again and the compile jobs after it (same commit)."
RECOMPILE = "Run that compile job again from the current quantize shard (same commit)."


@dataclass(frozen=True)
class QuantizeShard:
    """A quantize job's ``build/<model>/`` in one ``--from`` folder."""

    folder: Path  # the --from folder
    paths: ModelPaths
    record: QuantizeRecord


@dataclass(frozen=True)
class VariantShard:
    """One compiled variant (``ctx/<toolchain>/<target>/``) in one ``--from`` folder."""

    folder: Path
    toolchain: str
    target: str
    root: Path
    record: VariantRecord


def _short(digest: str | None) -> str:
    return f"{digest[:12]}…" if digest else "none recorded"


def _quantize_shards(model: str, folders: Sequence[Path]) -> list[QuantizeShard]:
    found = []
    for folder in folders:
        paths = ModelPaths.of(folder, model)
        if not paths.record.is_file():
            continue
        record, why = read_record(QuantizeRecord, paths.record)
        if record is None:
            raise PublishError(
                f"Shard {folder}: the quantize record of {model} cannot be used: {'; '.join(why)}.",
                tip=REQUANTIZE,
            )
        found.append(QuantizeShard(folder, paths, record))
    return found


def _variant_shards(model: str, folders: Sequence[Path]) -> list[VariantShard]:
    found = []
    for folder in folders:
        ctx = ModelPaths.of(folder, model).ctx
        for record_path in sorted(ctx.glob(f"*/*/{VARIANT_FILE}")):
            root = record_path.parent
            toolchain, target = root.parent.name, root.name
            if toolchain.startswith(".") or target.startswith("."):
                continue  # a temporary folder of a killed run, not an artifact
            record, why = read_record(VariantRecord, record_path)
            if record is None:
                raise PublishError(
                    f"Shard {folder}: {record_path} cannot be used: {'; '.join(why)}.",
                    tip=RECOMPILE,
                )
            said = (record.model, record.toolchain, record.target)
            if said != (model, toolchain, target):
                raise PublishError(
                    f"Shard {folder}: {record_path} describes {said[0]} / onnxruntime-qnn "
                    f"{said[1]} / {said[2]}, but lies in the folder of {model} / {toolchain} / "
                    f"{target}.",
                    tip="Shards are compile outputs as they are; do not move their folders.",
                )
            found.append(VariantShard(folder, toolchain, target, root, record))
    return found


def _same_quantize(a: QuantizeShard, b: QuantizeShard) -> list[str]:
    """What differs between two quantize shards of one model (empty: they are the same build)."""
    ra, rb = a.record, b.record
    differences = []
    if ra.inputs.source_sha256 != rb.inputs.source_sha256:
        differences.append(
            f"source {_short(ra.inputs.source_sha256)} vs {_short(rb.inputs.source_sha256)}"
        )
    if ra.inputs.config_digest != rb.inputs.config_digest:
        differences.append(
            f"config digest {_short(ra.inputs.config_digest)} vs {_short(rb.inputs.config_digest)}"
        )
    buckets_a = {x.name: x for x in ra.buckets}
    buckets_b = {x.name: x for x in rb.buckets}
    if sorted(buckets_a) != sorted(buckets_b):
        differences.append(f"buckets {sorted(buckets_a)} vs {sorted(buckets_b)}")
    for name in sorted(set(buckets_a) & set(buckets_b)):
        x, y = buckets_a[name], buckets_b[name]
        for what, left, right in (
            ("QDQ", x.qdq_sha256, y.qdq_sha256),
            ("float model", x.float_sha256, y.float_sha256),
            ("held-out samples", x.heldout_digest, y.heldout_digest),
        ):
            if left != right:
                differences.append(f"bucket {name} {what} {_short(left)} vs {_short(right)}")
    return differences


def _check_quantize(config: ModelConfig, shard: QuantizeShard) -> None:
    """The quantize shard: a successful build of this config and source, its files intact."""
    record, model = shard.record, config.model.name
    where = f"Shard {shard.folder} (quantize build of {model})"
    if record.status != "ok":
        raise PublishError(
            f"{where} failed quantization.min_snr_db; there is nothing to publish.",
            tip="Fix the quantization (see its report.md), then run the matrix again.",
        )
    if record.inputs.config_digest != config.quantize_digest():
        raise PublishError(
            f"{where} was quantized with other settings than {config.path} has now (config "
            f"digest {_short(record.inputs.config_digest)}, the config's is "
            f"{_short(config.quantize_digest())}).",
            tip="Publish from the commit the shards were built from, or " + REQUANTIZE.lower(),
        )
    changed = source_changes(config.source_path, record)
    if changed:
        raise PublishError(
            f"{where} was built from another source model: {changed} differs.", tip=REQUANTIZE
        )
    for bucket in record.buckets:
        qdq = shard.paths.bucket(bucket.name).qdq
        if not qdq.is_file() or sha256_file(qdq) != bucket.qdq_sha256:
            raise PublishError(
                f"{where}: {qdq} is missing or not the QDQ model its record names.",
                tip="The shard is incomplete or was changed; " + REQUANTIZE.lower(),
            )


def fit_problems(
    variant: VariantRecord, quantize: QuantizeRecord, compile_digest: str
) -> list[str]:
    """Why a compiled variant does not belong to this quantize build and config (empty: fits)."""
    built = variant.built_from
    problems = []
    if built.source_sha256 != quantize.inputs.source_sha256:
        problems.append(
            f"different source: compiled from source {_short(built.source_sha256)}, the quantize "
            f"shard's is {_short(quantize.inputs.source_sha256)}"
        )
    if built.config_digest != quantize.inputs.config_digest:
        problems.append(
            f"different config digest: quantized with settings {_short(built.config_digest)}, "
            f"the quantize shard's are {_short(quantize.inputs.config_digest)}"
        )
    if built.compile_digest != compile_digest:
        problems.append(
            f"different config digest: compiled with [compile] settings "
            f"{_short(built.compile_digest)}, the config's are {_short(compile_digest)}"
        )
    names = [b.name for b in quantize.buckets]
    if sorted(built.qdq_sha256) != sorted(names):
        problems.append(f"different buckets: {sorted(built.qdq_sha256)} vs {sorted(names)}")
    for bucket in quantize.buckets:
        for what, used, current in (
            ("QDQ", built.qdq_sha256.get(bucket.name), bucket.qdq_sha256),
            ("float model", built.float_sha256.get(bucket.name), bucket.float_sha256),
            ("held-out samples", built.heldout_digest.get(bucket.name), bucket.heldout_digest),
        ):
            if used != current:
                problems.append(
                    f"different {what} digest: bucket {bucket.name} was compiled from "
                    f"{_short(used)}, the quantize shard has {_short(current)}"
                )
    return problems


def _choose_quantize(config: ModelConfig, shards: list[QuantizeShard]) -> QuantizeShard:
    model = config.model.name
    if not shards:
        raise PublishError(
            f"No --from folder holds the quantize build of {model} "
            f"({BUILD_DIR}/{model}/record.json).",
            tip=f"Pass the shard of job {model}@quantize with --from (see `python -m pipeline "
            "plan`).",
        )
    first = shards[0]
    for other in shards[1:]:
        differences = _same_quantize(first, other)
        if differences:
            raise PublishError(
                f"Shards {first.folder} and {other.folder} hold different quantize builds of "
                f"{model}: " + "; ".join(differences) + ".",
                tip="Pass the shards of one matrix run only.",
            )
    _check_quantize(config, first)
    return first


def _choose_variants(
    config: ModelConfig, quantize: QuantizeShard, shards: list[VariantShard]
) -> list[VariantShard]:
    """The variants the config asks for, one shard each, each compiled from ``quantize``."""
    model = config.model.name
    wanted = [
        (t.onnxruntime_qnn, target)
        for t in load_toolchains().selected(config.compile.toolchains)
        for target in dict.fromkeys(config.compile.targets)
    ]
    chosen: dict[tuple[str, str], VariantShard] = {}
    digest = config.compile_digest()
    for shard in shards:
        key = (shard.toolchain, shard.target)
        if key not in wanted:
            continue  # like a single machine's publish: only what the config asks for
        if key in chosen:
            raise PublishError(
                f"Shards {chosen[key].folder} and {shard.folder} both hold {model} / "
                f"onnxruntime-qnn {key[0]} / {key[1]}.",
                tip="Pass each compile job's shard once (the shards of one matrix run).",
            )
        problems = fit_problems(shard.record, quantize.record, digest)
        if problems:
            raise PublishError(
                f"Shard {shard.folder} does not fit: {model} / onnxruntime-qnn {key[0]} / "
                f"{key[1]} was not compiled from the quantize shard {quantize.folder}: "
                + "; ".join(problems)
                + ".",
                tip=RECOMPILE + " A variant from another build is never published.",
            )
        chosen[key] = shard
    missing = [k for k in wanted if k not in chosen]
    if missing:
        jobs = sorted({f"{model}@compile-{t}" for t, _ in missing})
        listed = ", ".join(f"onnxruntime-qnn {t} / {target}" for t, target in missing)
        raise PublishError(
            f"No --from folder holds {model} / {listed}.",
            tip=f"Pass the shard of {', '.join(jobs)} with --from, or take the toolchain or "
            "target out of the config's [compile].",
        )
    return [chosen[k] for k in wanted]


def _artifacts_in(folder: Path) -> list[Path]:
    """The files below ``folder``, without temporary names ('.'-names: core.layout)."""
    return [
        path
        for path in folder.rglob("*")
        if path.is_file() and not any(p.startswith(".") for p in path.relative_to(folder).parts)
    ]


def _gather(artifacts: Path, quantize: QuantizeShard, variants: list[VariantShard]) -> Path:
    """``<artifacts>/build/<model>/`` made of the shards, renamed into place at once; an
    existing one must be exactly the same (a rerun), or it is refused: never mixed."""
    model = quantize.record.model
    target = ModelPaths.of(artifacts, model).root
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{model}.", suffix=".gather", dir=target.parent))
    try:
        # The quantize job's whole folder (record, reports, QDQ and float models, held-out) ...
        files = [
            (path, tmp / path.relative_to(quantize.paths.root))
            for path in _artifacts_in(quantize.paths.root)
            if not path.is_relative_to(quantize.paths.ctx)
        ]
        # ... and each compile job's variant folders as they are.
        for shard in variants:
            into = ModelPaths(tmp).variant(shard.toolchain, shard.target).root
            files += [(p, into / p.relative_to(shard.root)) for p in _artifacts_in(shard.root)]
        for source, destination in sorted(files):
            destination.parent.mkdir(parents=True, exist_ok=True)
            link_or_copy(source, destination)
        if target.exists():
            if folder_digest(target) != folder_digest(tmp):
                raise PublishError(
                    f"{target} already holds another build of {model}; gathering the shards "
                    "there would mix two builds.",
                    tip="Publish from shards into a fresh --artifacts folder (or remove that one).",
                )
            return target  # the same shards gathered before
        os.rename(tmp, target)
        return target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_folders(models: Sequence[str], folders: Sequence[Path]) -> list[Path]:
    """The ``--from`` folders, each once; a missing one, or one holding nothing of these models
    (a wrong path, a download nested one level deeper), is an error naming it."""
    folders = list(dict.fromkeys(Path(f) for f in folders))
    missing = [str(f) for f in folders if not f.is_dir()]
    if missing:
        raise PublishError(
            f"--from {', '.join(missing)}: no such folder.",
            tip="Pass the folders the jobs' shards were downloaded to.",
        )
    unused = [str(f) for f in folders if not any(ModelPaths.of(f, m).root.is_dir() for m in models)]
    if unused:
        raise PublishError(
            f"--from {', '.join(unused)}: no {BUILD_DIR}/<model>/ of {', '.join(models)} in it.",
            tip=f"Each --from folder is one job's shard in the artifacts layout "
            f"(<folder>/{BUILD_DIR}/<model>/...).",
        )
    return folders


def publish_shards(
    config: ModelConfig,
    folders: Sequence[Path],
    artifacts: Path,
    allow_partial: bool = False,
    cpu_fallback: bool = True,
) -> PublishResult:
    """Check one model's shards, gather them under ``artifacts`` and publish the release."""
    folders = list(dict.fromkeys(Path(f) for f in folders))
    model = config.model.name
    quantize = _choose_quantize(config, _quantize_shards(model, folders))
    variants = _choose_variants(config, quantize, _variant_shards(model, folders))
    with model_lock(ModelPaths.of(artifacts, model), "publish"):
        _gather(artifacts, quantize, variants)
        return publish_model(config, artifacts, allow_partial, cpu_fallback)
