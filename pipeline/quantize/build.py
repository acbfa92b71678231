"""Stage 1: float ONNX -> one prepared static float model per bucket -> calibrated QDQ models.

A build is a set of one or more static shapes ("buckets"); a config without ``[buckets]`` is one
bucket. The steps, each a function below:

1. ``prepare``: every bucket's static float model (pipeline.graph.prepare), the plan of buckets;
2. ``route``: each calibration sample at its natural size goes to the smallest bucket that holds
   it; held-out samples are saved at their true size and padded into every bucket they fit;
3. ``calibrate``: each bucket's float model on its samples, ranges merged over the buckets, so
   every bucket gets the same quantization parameters (QNN shares weights by name and bytes);
4. ``quantize``: every bucket from the merged ranges, then automatic mixed precision (chosen on
   one bucket, applied to all); the buckets' initializers are checked to be byte-identical;
5. ``evaluate``: QDQ vs float per bucket, and end to end (pad, run, crop) vs the source model.

Outputs: see pipeline.core.layout. The record is written last: no record, no valid build.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from qnn_ctx_runtime import buckets as bk
from qnn_ctx_runtime.qnn import read_model_summary

from ..calibration.samples import (
    BucketSamples,
    Router,
    SampleRef,
    SampleSource,
    index_bounds,
    sample_source,
)
from ..core.accuracy import PART, Accuracy, worst_snr
from ..core.config import ModelConfig
from ..core.errors import CalibrationError, ConfigError, GateError, ModelError, PipelineError
from ..core.fileio import atomic_dir, atomic_path, link_or_copy, sha256_file
from ..core.layout import (
    ENOUGH_MARGIN_DB,
    HTP_BUDGET_S,
    UNBALANCED_FLOAT,
    BucketPaths,
    ModelPaths,
    sample_name,
    samples_in,
    spread,
)
from ..core.lock import locked
from ..core.memory import adapt_heap_to, release_freed_memory
from ..core.metrics import output_steps, quantized_output_grids
from ..core.progress import Progress
from ..core.records import (
    BucketArtifacts,
    BuildInputs,
    HtpProbeRecord,
    QuantizeRecord,
    QuantizeSummary,
    folder_digest,
    read_record,
    write_record,
)
from ..core.report import fmt
from ..graph import prequantized, transforms
from ..graph.buckets import BucketPlan
from ..graph.prepare import NothingForTheNpu
from ..graph.source import SourceModel, readable
from ..graph.tails import drop_judged_outputs, judged_outputs, part_name
from ..graph.transforms import Change
from ..htp.probe import spare_probes
from ..report_html import preload_plotting, write_html_reports
from . import quantizer
from . import report as report_mod
from .evaluate import (
    carried_states,
    closed_loop,
    end_to_end,
    evaluate,
    input_jitter,
    state_like_inputs,
    unfed_states,
)
from .judge import HTP_PROBE_FAILED, Builder, HtpJudgement, judge_on_htp
from .lossless import OWN_ROUNDING_MARGIN_DB, PreparationCheck, bucket_inputs, check_preparation
from .mixed_precision import MixedPrecision, ceiling_rules_out, raise_precision
from .reuse import QuantizeResult, build_inputs, reusable
from .shapes import PreparedBucket, differing, initializer_digests, lstm_budget, prepare_buckets

READER_SAMPLES = ".reader-samples"  # a python reader's samples, kept while quantize runs
HELDOUT_FROM_CALIBRATION = 8  # samples that validate a bucket no held-out sample fits
Feeds = dict[str, np.ndarray]


def _htp_failure(judgement: HtpJudgement | None) -> str:
    """The HTP probe's failure when the judge fell back to the CPU for it, else ""."""
    if judgement is None or judgement.judge != "cpu" or HTP_PROBE_FAILED not in judgement.reason:
        return ""
    return judgement.reason.removeprefix("judged on the CPU: ")[:400]


def _missing_external_data(path: Path) -> list[str]:
    """The external-data files ``path``'s initializers name that are not beside it (none when
    the file does not parse: its own error says more)."""
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # the full load below reports it
        return []
    names = {
        entry.value
        for tensor in model.graph.initializer
        if tensor.data_location == onnx.TensorProto.EXTERNAL
        for entry in tensor.external_data
        if entry.key == "location"
    }
    return sorted(name for name in names if not (path.parent / name).is_file())


def load_source_model(path: Path) -> Any:
    """Load and sanity-check the float model; a truncated file gets a clear error."""
    import onnx

    if not path.is_file():
        raise ModelError(
            f"Model file {path} does not exist.", tip="Fix model.source in the config."
        )
    missing = _missing_external_data(path)
    if missing:
        raise ModelError(
            f"Model file {path} keeps its weights in external data that is not beside it: "
            f"{', '.join(missing)} (exporters write it next to the .onnx, e.g. torch.onnx's "
            "<model>.onnx.data).",
            tip=f"Copy {missing[0]} into {path.parent}, or point model.source at the folder the "
            "model was exported to.",
        )
    try:
        model = onnx.load(str(path))
    except Exception as exc:  # protobuf DecodeError, OSError, external-data errors
        raise ModelError(
            f"Model file {path} cannot be read as ONNX ({type(exc).__name__}: {exc}). "
            "It may be truncated or not an ONNX file.",
            tip="Re-download or re-export the model and check its sha256.",
        ) from None
    if not model.graph.node:
        raise ModelError(f"Model file {path} has an empty graph; it may be truncated.")
    # ONNX wants nodes in topological order; some exporters (PyTorch 1.1) do not keep it and
    # onnxruntime runs such models anyway, so order them before the checker judges the rest.
    model = readable(model)  # nodes in order, onnxruntime's own ONNX-domain norms written out
    model = _typed_io_shapes(model)
    try:
        onnx.checker.check_model(_shapes_for_the_checker(model))
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        tip = ""
        said = first.lower()
        if "unrecognized attribute: axis for operator" in said and "quantizelinear" in said:
            # onnxruntime's quantize_static writes per-channel Q/DQ into an opset-11/12 float
            # model with a warning only; onnxruntime refuses the result too.
            tip = (
                "Per-channel QuantizeLinear/DequantizeLinear (an axis) needs opset >= 13: "
                "onnxruntime cannot load this model either. Quantize the float model again "
                "after onnx.version_converter.convert_version(model, 13), or give the float "
                "model itself as model.source."
            )
        elif re.search(r"no op registered for (quant|bipolarquant|trunc|multithreshold)\b", said):
            # Brevitas / FINN / hls4ml write QONNX's arbitrary-precision quantizers as ops of
            # their own; no runtime but theirs executes them.
            tip = (
                "This is a QONNX model (Brevitas, FINN, hls4ml): its Quant ops run nowhere but in "
                "qonnx. Export it as QDQ instead (brevitas.export.export_onnx_qcdq, or qonnx's "
                "QuantToQCDQ transformation), which this pipeline builds with its own "
                "quantization kept, or give the float model as model.source."
            )
        elif early := _op_before_its_opset(first):
            op_type, since, declared = early
            tip = (
                f"{op_type} is an ONNX op from opset {since}, but the model declares opset "
                f"{declared}: its exporter wrote it early (tf2onnx's TFLite path does so for "
                f"HardSwish), and onnxruntime cannot load it either. Export it again at opset "
                f"{since} or newer (tf2onnx: --opset {max(since, 13)})."
            )
        if not tip:
            tip = _runtime_verdict(path)
        raise ModelError(f"Model file {path} is not a valid ONNX model: {first}", tip=tip) from None
    return model


def _op_before_its_opset(message: str) -> tuple[str, int, int] | None:
    """(op type, the opset it first exists in, the opset declared) where the checker says a
    standard op is not registered at the model's opset but exists at a later one."""
    import onnx

    found = re.search(r"no op registered for (\w+) with domain_version of (\d+)", message, re.I)
    if not found:
        return None
    op_type, declared = found.group(1), int(found.group(2))
    since = [
        schema.since_version
        for schema in onnx.defs.get_all_schemas_with_history()
        if schema.name == op_type and schema.domain == ""
    ]
    if not since or min(since) <= declared:
        return None
    return op_type, min(since), declared


def _runtime_verdict(path: Path) -> str:
    """What onnxruntime makes of a file the checker refused: it fails too (the fix is in the
    export), or it runs it (the refusal is this pipeline's to mend: report it)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime's own error types
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return (
            f"onnxruntime cannot load it either ({said[:300]}). Re-export it with a current "
            "converter (opset 7 or newer: onnxruntime guarantees nothing older)."
        )
    return (
        "onnxruntime loads this file: the pipeline is stricter than it here, which is a bug; "
        "please report it with the model."
    )


def _bare_tensor_values(model: Any) -> list[Any]:
    """Graph inputs, outputs and value infos typed as tensors without a shape field."""
    graph = model.graph
    return [
        value
        for value in (*graph.input, *graph.output, *graph.value_info)
        if value.type.HasField("tensor_type") and not value.type.tensor_type.HasField("shape")
    ]


def _typed_io_shapes(model: Any) -> Any:
    """Tensors typed without a shape get the shape inference gives them, where it does.

    Why: the checker requires the field ("Field 'shape' of 'type' is required but missing"),
    onnxruntime does not and runs such a model (an exporter that writes an output's element
    type only, or a value info of a function op's output); it was refused before preparation,
    whose own inference and static shapes are what the build needs."""

    bare = _bare_tensor_values(model)
    if not bare:
        return model
    from ..graph.edit import inferred_graph

    try:
        inferred = inferred_graph(model)
    except Exception:  # the checker then names what is wrong
        return model
    known = {v.name: v for v in (*inferred.input, *inferred.output, *inferred.value_info)}
    for value in bare:
        found = known.get(value.name)
        if found is not None and found.type.tensor_type.HasField("shape"):
            value.type.tensor_type.shape.CopyFrom(found.type.tensor_type.shape)
    return model


def _shapes_for_the_checker(model: Any) -> Any:
    """A copy whose remaining shapeless tensors have an empty shape, for the checker only:
    it judges everything else; preparation infers the real shapes (and names a tensor left
    without a static one)."""
    bare = _bare_tensor_values(model)
    if not bare:
        return model
    import onnx

    checked = onnx.ModelProto()
    checked.CopyFrom(model)
    for value in _bare_tensor_values(checked):
        value.type.tensor_type.shape.SetInParent()
    return checked


@locked("quantize")
def quantize_model(config: ModelConfig, artifacts: Path, force: bool = False) -> QuantizeResult:
    """Build (or reuse) the QDQ models of every bucket of one config."""
    paths = ModelPaths.of(artifacts, config.model.name)
    inputs = build_inputs(config)
    record, _ = read_record(QuantizeRecord, paths.record)
    if not force and reusable(paths, record, inputs):
        assert record is not None
        write_html_reports(paths.root)  # only re-rendered if missing or out of date
        return QuantizeResult(config.model.name, paths.root, True, record)
    # Invalidate first: a build killed from here on leaves no record that claims success.
    paths.record.unlink(missing_ok=True)
    paths.root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    timings: dict[str, float] = {}
    try:
        report, record = _build(config, paths, inputs, timings)
    except Exception as exc:  # the console says why; the report says it too, with the context
        _write_failure(config, paths, exc, timings)
        raise
    report.timings_s["total"] = time.perf_counter() - started
    report_mod.write(paths.root, report)
    write_record(paths.record, record)
    write_html_reports(paths.root)  # never raises: a failure to render is a warning line
    check = report.preparation_check
    if check is not None and not check.passed:
        raise GateError(
            check.message(config.model.name) + f" ({paths.report})",
            tip="The report lists each preparation step's figure; the step named changed the "
            "model's function: report the model with that step, or re-export it with a "
            "current opset.",
        )
    judged = judged_ctx_db(report.htp)
    gate = f"quantization.min_snr_db = {config.quantization.min_snr_db}" + (
        f" (lowered to {fmt(report.min_snr_db)} dB: the pre-quantized model's own rounding "
        "floor, less a margin)"
        if report.min_snr_db < config.quantization.min_snr_db
        else ""
    )
    if not report.passed and report.worst_snr_db >= report.min_snr_db > judged:
        kept = report.prequantized is not None and report.prequantized.kept
        raise GateError(
            f"{config.model.name}: the HTP judge measured its context at {fmt(judged)} dB vs "
            f"float, below {gate}, although its QDQ model on the CPU is at "
            f"{fmt(report.worst_snr_db)} dB ({paths.report}).",
            tip="requantize = true in [quantization] calibrates and quantizes the float model "
            "behind its own quantization instead."
            if kept
            else "The report's judge rounds and divergence name the tensor where the HTP and "
            "the CPU part ways; the NPU would run this model that far from the float one.",
        )
    if not report.passed:
        fp16 = report.htp is not None and report.htp.whole_float16
        raise GateError(
            f"{config.model.name}: worst {report_mod.gated_figure(report)} SNR "
            f"{fmt(report.worst_snr_db)} dB is below {gate} ({paths.report}).",
            tip="Use 16-bit types or overrides for the worst tensors, or more calibration data."
            if not fp16
            else "No precision the judge tried reaches the gate on the HTP; the report's judge "
            "rounds and divergence show where it is lost (fp16 overflows beyond 65504).",
        )
    return QuantizeResult(config.model.name, paths.root, False, record)


def _write_failure(
    config: ModelConfig, paths: ModelPaths, exc: Exception, timings: dict[str, float]
) -> None:
    """report.md/json of a run that stopped on ``exc``, and its path in the error's tip. A
    fault that is not one of the pipeline's own errors keeps its traceback in the report."""
    own = isinstance(exc, PipelineError)
    failure = report_mod.QuantizeFailure(
        model=config.model.name,
        status="failed",
        error=exc.message if own else f"{type(exc).__name__}: {exc}",
        tip=(exc.tip or "") if own else "",
        error_type=type(exc).__name__,
        steps_done=dict(timings),
        source=report_mod.describe_source(config.source_path),
        traceback="" if own else "".join(traceback.format_exception(exc)),
    )
    try:
        report_mod.write_failure(paths.root, failure)
    except OSError:
        return  # the error that stopped the run is the one to show (a full disk, say)
    write_html_reports(paths.root, out=lambda _line: None)
    if own:
        exc.tip = (exc.tip + " " if exc.tip else "") + f"The failure report: {paths.report}."


# -- the steps --------------------------------------------------------------------------------


@dataclasses.dataclass
class _Routed:
    """Which calibration samples each bucket calibrates on, and how it got them."""

    own: dict[str, list[SampleRef]]  # the samples whose smallest bucket it is
    refs: dict[str, list[SampleRef]]  # what it calibrates on (own, or every sample that fits)
    fallback: list[str]  # buckets without samples of their own


def _route(config: ModelConfig, plan: BucketPlan, source: SampleSource, router: Router) -> _Routed:
    names = plan.names
    if len(names) == 1:  # one static shape: every sample is its own (checked as it is read)
        return _Routed({names[0]: source.calib}, {names[0]: source.calib}, [])
    own: dict[str, list[SampleRef]] = {n: [] for n in names}
    for ref, sample in source.iterate(source.calib):
        bucket, _, _ = router.route(sample, ref)
        own[bucket.name].append(ref)
    refs, fallback = {}, []
    for index, name in enumerate(names):
        chosen = own[name]
        if not chosen:  # no sample of its own: every sample that fits, padded into it
            fallback.append(name)
            chosen = [r for smaller in names[: index + 1] for r in own[smaller]]
        if not chosen:
            sizes = ", ".join(f"{b}: {len(own[b])}" for b in names)
            raise CalibrationError(
                f"{config.model.name}: no calibration sample fits bucket "
                f"{plan.bucket(name).describe()} (samples per bucket: {sizes}).",
                tip="Add calibration samples as small as that bucket, or drop the bucket size.",
            )
        refs[name] = chosen
    return _Routed(own, refs, fallback)


def _held_samples(
    source: SampleSource, router: Router, plan: BucketPlan, float_model: Path
) -> Iterator[tuple[SampleRef, Feeds]]:
    """Held-out samples at their true size (recurrent models: with the state carried in)."""
    if router.config.calibration.recurrent:  # one bucket only (config validation)
        samples = BucketSamples(source, router, plan.buckets[0], source.held, float_model)
        yield from samples.items()
        return
    for ref, sample in source.iterate(source.held):
        yield ref, router.own(sample, ref)


def _write_heldout(
    paths: ModelPaths,
    plan: BucketPlan,
    source: SampleSource,
    router: Router,
    routed: _Routed,
    float_model: Path,
) -> tuple[dict[str, int], list[str]]:
    """Held-out samples at their true size, and padded into every bucket that holds them.

    A bucket's graph must be right for any input padded into it, so it is validated (compile
    stage) on every held-out sample that fits, not only on those it is the smallest bucket for.
    A bucket that no held-out sample fits is validated on calibration samples that fit, and the
    report says so. A sample that needs no padding is linked, not written twice. Returns the
    count per bucket and the buckets that borrowed calibration samples.
    """
    order = plan.names
    counts = dict.fromkeys(order, 0)
    borrowed: list[str] = []
    staged: dict[str, Path] = {}
    with atomic_dir(paths.heldout) as true_dir:
        try:
            for name in order:
                folder = paths.bucket(name).root
                folder.mkdir(parents=True, exist_ok=True)
                staged[name] = Path(tempfile.mkdtemp(prefix=".heldout-", dir=folder))

            def stage(
                own: Feeds, ref: SampleRef, original: Path | None, into: list[bk.Bucket]
            ) -> None:
                for bucket in into:
                    feeds = router.pad(own, bucket, ref)
                    target = staged[bucket.name] / sample_name(counts[bucket.name])
                    unchanged = original is not None and feeds.keys() == own.keys()
                    if unchanged and all(feeds[k] is own[k] for k in own):
                        link_or_copy(original, target)
                    else:
                        np.savez(target, **feeds)
                    counts[bucket.name] += 1

            index_rows = []
            # A streaming model's held-out windows (the float model carrying its state through
            # them): 6 s under load for a GRU's 300, between the start and calibration's line.
            with Progress(len(source.held), "write the held-out samples", "sample") as progress:
                held = _held_samples(source, router, plan, float_model)
                for number, (ref, own) in enumerate(held):
                    bucket = router.bucket_of(own, ref)
                    true_path = true_dir / sample_name(number)
                    np.savez(true_path, **own)
                    index_rows.append({"sample": number, "bucket": bucket.name})
                    stage(own, ref, true_path, plan.buckets[order.index(bucket.name) :])
                    progress.update()
            for index, name in enumerate(order):
                if counts[name]:
                    continue
                borrowed.append(name)
                refs = [r for smaller in order[: index + 1] for r in routed.own[smaller]]
                for ref, sample in source.iterate(refs[:HELDOUT_FROM_CALIBRATION]):
                    own = router.own(sample, ref)
                    stage(own, ref, None, [plan.buckets[index]])
            (true_dir / "index.json").write_text(json.dumps(index_rows, indent=1), "utf-8")
            for name, staged_dir in staged.items():
                with atomic_dir(paths.bucket(name).heldout) as tmp_dir:
                    for path in samples_in(staged_dir):
                        path.rename(tmp_dir / path.name)
        finally:
            for staged_dir in staged.values():
                shutil.rmtree(staged_dir, ignore_errors=True)
    return counts, borrowed


def _weight_sharing(qdq_paths: dict[str, Path]) -> report_mod.WeightSharing:
    """Initializers of the buckets' QDQ models: same name must mean the same bytes.

    QNN shares a static tensor between the graphs of one context by name; two different values
    under one name would be a wrong model, so that is a ModelError naming the tensors.
    """
    import onnx
    from onnx import numpy_helper

    digests: dict[str, dict[str, str]] = {}
    sizes: dict[str, dict[str, int]] = {}
    for bucket, path in qdq_paths.items():
        model = onnx.load(str(path))
        digests[bucket] = initializer_digests(model)
        sizes[bucket] = {
            t.name: int(numpy_helper.to_array(t).nbytes) for t in model.graph.initializer
        }
    clash = differing(digests)
    names = set().union(*(d.keys() for d in digests.values())) - set(clash)
    shared = sorted(n for n in names if all(n in d for d in digests.values()))
    specific = sorted(names - set(shared))
    if clash:
        raise ModelError(
            f"Initializer(s) {clash[:8]} have the same name but different values in different "
            "buckets; QNN would share one of them between the buckets' graphs.",
            tip="The preparation folded something shape-dependent into a weight; report the model.",
        )
    first = next(iter(sizes.values()))
    return report_mod.WeightSharing(
        shared_initializers=len(shared),
        shared_bytes=sum(first[n] for n in shared),
        bucket_specific=specific,
        bucket_specific_bytes=sum(d[n] for d in sizes.values() for n in specific if n in d),
    )


def _integer_comparisons(bucket: PreparedBucket, calibration: BucketSamples, heldout: Path) -> None:
    """Comparisons of float inputs that hold integers on every sample (labels, flags) get a
    margin of one half (``numerics.integer_comparisons``), rewritten in the prepared float
    model before it is calibrated: exact on such data, and robust to the rounding of their
    quantization, which breaks an Equal."""
    import onnx

    from ..graph.numerics import compared_float_inputs, integer_comparisons

    model = onnx.load(str(bucket.float_path), load_external_data=False)
    integral = compared_float_inputs(model)
    if not integral or calibration.recurrent:  # a recurrent reader's samples cost a model run
        return

    def everything() -> Iterator[Feeds]:
        yield from calibration
        for path in samples_in(heldout):
            with np.load(path) as kept:
                yield {name: kept[name] for name in kept.files}

    for sample in everything():
        for name in list(integral):
            value = sample.get(name)
            if (
                value is None
                or value.dtype.kind != "f"
                or not np.array_equal(value, np.round(value))
            ):
                integral.discard(name)
        if not integral:
            return
    model = onnx.load(str(bucket.float_path))
    rewritten, change = integer_comparisons(model, integral)
    if change.changed:
        with atomic_path(bucket.float_path) as tmp:
            onnx.save(rewritten, str(tmp))
        bucket.changes.append(change)


def _quantize_all(
    config: ModelConfig,
    paths: ModelPaths,
    plan: BucketPlan,
    prepared: dict[str, PreparedBucket],
    samples: dict[str, BucketSamples],
    held_counts: dict[str, int],
    timings: dict[str, float],
    on_short: Callable[[], None] | None = None,
) -> tuple[int, quantizer.range_rules.RangeChanges, MixedPrecision | None, HtpJudgement]:
    """Calibrate every bucket, merge the ranges, quantize every bucket, raise precision where
    the CPU says it is short, then let the HTP judge (pipeline.quantize.judge; ``on_short``
    is its hook for a first round short of the target)."""
    q = config.quantization
    order = plan.names
    t0 = time.perf_counter()
    for name in order:
        _integer_comparisons(prepared[name], samples[name], paths.bucket(name).heldout)
    with tempfile.TemporaryDirectory(prefix=".calibrate-", dir=paths.root) as tmp_text:
        tmp = Path(tmp_text)
        parts = [
            quantizer.calibrate(
                config,
                prepared[name].float_path,
                samples[name],
                tmp / f"ranges_{name}.json",
                tmp / f"calibrated_{name}.onnx",
                f"{config.model.name} {name}" if len(order) > 1 else config.model.name,
            )
            for name in order
        ]
        merged, statistics = quantizer.merge_ranges(parts, paths.ranges)
    timings["calibrate"] = time.perf_counter() - t0
    release_freed_memory()  # calibration's probe model and session

    t0 = time.perf_counter()
    overrides = dict(q.overrides.tensors)

    def quantize(name: str, extra: dict[str, str]) -> quantizer.range_rules.RangeChanges:
        bucket = paths.bucket(name)
        return quantizer.quantize(
            config, prepared[name].float_path, bucket.qdq, paths.ranges, statistics, extra
        )

    changes = {name: quantize(name, overrides) for name in order}
    mixed: MixedPrecision | None = None
    probe = max(order, key=lambda n: (held_counts[n], order.index(n)))

    def raise_on_probe(target_db: float, base: dict[str, str]) -> MixedPrecision:
        """Mixed precision on the probe bucket, aimed at ``target_db`` on the CPU."""
        aimed = dataclasses.replace(
            config, quantization=dataclasses.replace(q, target_snr_db=target_db)
        )
        return raise_precision(
            aimed,
            prepared[probe].float_path,
            paths.bucket(probe).qdq,
            paths.bucket(probe).heldout,
            samples[probe],
            base,
            lambda extra: quantize(probe, extra),
            statistics.means if q.bias_correction else None,
        )

    if q.auto_mixed_precision and held_counts[probe]:
        mixed = dataclasses.replace(raise_on_probe(q.target_snr_db, overrides), bucket=probe)
        if mixed.tensors:  # report.html plots them: the import overlaps the judge's run
            preload_plotting()
    chosen = {**overrides, **(mixed.overrides if mixed else {})}
    timings["quantize"] = time.perf_counter() - t0

    t0 = time.perf_counter()

    @functools.cache
    def calibrated_peaks() -> dict[str, float]:
        from ..calibration.ranges import read_cache

        _, ranges = read_cache(paths.ranges)
        return {t: max(abs(low), abs(high)) for t, (low, high) in ranges.items()}

    def use_float(name: str) -> None:  # the whole model in fp16 on the HTP: no quantization
        import onnx

        from ..graph.fp16_scale import (
            exact_float16_forms,
            fit_float16,
            float16_large_divisors,
            float16_residual_streams,
            float16_safe_norms,
            float16_scaled_l2_norms,
            normal_float16_weights,
        )
        from ..graph.qdq_htp import dequantized_integer_inputs

        # before balancing (graph.balance): its scaled-down kernels may be fp16 subnormals
        source = onnx.load(str(prepared[name].unbalanced_path or prepared[name].float_path))
        model, change = fit_float16(source, calibrated_peaks())
        model, exact = exact_float16_forms(source if model is None else model)
        model, streams, factors = float16_residual_streams(model, calibrated_peaks())
        peaks = {t: p * factors.get(t, 1.0) for t, p in calibrated_peaks().items()}
        model, weights = normal_float16_weights(model, peaks)
        model, norms = float16_safe_norms(model, peaks)
        model, l2_norms = float16_scaled_l2_norms(model, peaks)
        model, divisors = float16_large_divisors(model, peaks)
        model, inputs = dequantized_integer_inputs(model)
        for step in (change, *exact, streams, weights, norms, l2_norms, divisors, inputs):
            if step.changed:  # reported with the preparation steps (once: a rebuild replaces it)
                prepared[name].changes[:] = [
                    c for c in prepared[name].changes if c.step != step.step
                ] + [step]
        with atomic_path(paths.bucket(name).qdq) as tmp:
            if model is source:
                shutil.copyfile(prepared[name].float_path, tmp)
            else:
                onnx.save(model, str(tmp))

    def raise_to(goal_db: float, base: dict[str, str]) -> dict[str, str] | None:
        """The judge's raise: mixed precision again, aimed at ``goal_db`` on the CPU. From the
        model mixed precision left, whose ceiling it measured (every 8-bit tensor at 16 bits: the
        same model from either base), a ceiling that rules the search out at ``goal_db`` ends it
        before it re-quantizes and re-measures what it measured then (a YOLOX-nano: 15 s)."""
        if (
            mixed is not None
            and mixed.ceiling_snr_db is not None
            and base == chosen
            and ceiling_rules_out(mixed.after_snr_db, mixed.ceiling_snr_db, goal_db)
        ):
            return None
        more = raise_on_probe(goal_db, base)
        return {**more.overrides, **base} if more.tensors else None

    judgement, candidate = judge_on_htp(
        config,
        prepared[probe].float_path,
        paths.bucket(probe).qdq,
        samples_in(paths.bucket(probe).heldout),
        samples[probe],
        chosen,
        Builder(
            lambda extra: quantize(probe, extra),
            lambda: use_float(probe),
            raise_to if held_counts[probe] and q.auto_mixed_precision else None,
        ),
        paths.root,
        paths.bucket(probe).htp_probe if len(order) == 1 else None,
        mixed.after_snr_db if mixed else None,
        on_short=on_short,
        recurrent_steps=prepared[probe].recurrent_steps,
    )
    timings["judge"] = time.perf_counter() - t0
    # The same choices in every bucket, so the weights stay identical.
    for name in order:
        if name == probe or (not candidate.whole_float16 and candidate.overrides == overrides):
            continue
        if candidate.whole_float16:
            use_float(name)
        else:
            quantize(name, candidate.overrides)
    return merged, changes[plan.largest.name], mixed, judgement


def _measure_own(config: ModelConfig, paths: ModelPaths, state: _State) -> HtpJudgement:
    """A model keeping its own quantization has nothing to decide, but what the NPU computes
    is still measured, and that run on the validation samples is what compile adopts (in
    parallel processes; compile's own validation runs one sample after another)."""
    names = state.plan.names
    nothing = HtpJudgement("cpu", "the model's own quantization is kept: nothing to decide")
    if len(names) != 1 or not state.held_counts[names[0]]:
        return nothing
    started = time.perf_counter()
    bucket = paths.bucket(names[0])
    jitter = state.own.input_jitter.values() if state.own else ()
    floors = [a.snr_db for a in jitter if a.snr_db == a.snr_db]  # NaN: no figure
    gate = min([config.compile.min_snr_db, *(f - OWN_ROUNDING_MARGIN_DB for f in floors)])
    judgement, _ = judge_on_htp(
        config,
        state.prepared[names[0]].float_path,
        bucket.qdq,
        samples_in(bucket.heldout),
        [],
        {},
        Builder(_never_rebuilt, _never_rebuilt),
        paths.root,
        bucket.htp_probe,
        decide=False,
        # compile's gate, which gates nothing at 0: below it, the locator says where
        diagnose_below_db=gate if config.compile.min_snr_db > 0 else float("-inf"),
        recurrent_steps=state.prepared[names[0]].recurrent_steps,
    )
    state.timings["judge"] = time.perf_counter() - started
    if judgement.judge == "htp":
        kept = judgement.rounds[0] if judgement.rounds else None  # a locate may follow it
        problem = ""
        if kept is not None and (kept.partitions != 1 or kept.cpu_nodes):
            problem = (
                f"not whole on the NPU ({kept.partitions} QNN partition(s), {kept.cpu_nodes} "
                "CPU node(s)): its own quantization has ops the HTP does not take quantized"
            )
        elif (
            kept is not None
            and kept.ctx_vs_qdq_db is not None
            and config.compile.min_snr_db > 0  # 0: compile gates nothing
            and kept.ctx_vs_qdq_db < gate
            # compile passes it on either: the model as rewritten for the HTP, or as it came
            and (kept.ctx_vs_float_db is None or kept.ctx_vs_float_db < gate)
        ):
            itself = (
                f" ({kept.ctx_vs_float_db:.1f} dB from the model as it came)"
                if kept.ctx_vs_float_db is not None
                else ""
            )
            problem = (
                f"the HTP computes its own quantization {kept.ctx_vs_qdq_db:.1f} dB from the "
                f"model on the CPU{itself}, below compile's gate of {gate:.1f} dB"
            )
            where = judgement.divergence
            if where is not None:
                problem += (
                    f" (the two part first at {where.tensor}, {where.op_type} "
                    f"{where.node!r}: {where.snr_db:.1f} dB)"
                )
        if problem:  # the compile gate refuses it; say here what would build it
            _advise_requantize(config, judgement, problem)
        elif (
            kept is not None
            and kept.ctx_vs_qdq_db is not None
            and kept.ctx_vs_qdq_db < config.quantization.target_snr_db
        ):  # it builds, short of the target: say what else there is
            _advise_requantize(
                config,
                judgement,
                f"the HTP computes its own quantization {kept.ctx_vs_qdq_db:.1f} dB from the "
                f"model on the CPU, under the target of {config.quantization.target_snr_db:g} "
                "dB (it builds)",
            )
        return judgement
    why = judgement.reason.removeprefix("judged on the CPU: ")
    failed = judgement.rounds[-1].error if judgement.rounds else ""
    if failed:  # QNN could not build or run it: compile will fail the same way
        problem = f"QNN fails on its own quantization ({failed.splitlines()[0][:200]})"
        _advise_requantize(config, judgement, problem)
    return dataclasses.replace(judgement, reason=f"{nothing.reason} ({why})")


def _advise_requantize(config: ModelConfig, judgement: HtpJudgement, problem: str) -> None:
    """Say, in the report's remedies and on the console, that the model does not build as it
    is (or builds under the target) and what else there is: requantizing the float model
    behind its own quantization (a keyword embedder kept at 24.3 dB reached 46.6 dB so, and a
    turn detector 12.6 -> 46.0 dB, each against its float model)."""
    advice = (
        f"as it is, {problem}; requantize = true in [quantization] calibrates and "
        "quantizes the float model behind it instead"
    )
    judgement.remedies.append(advice)
    print(f"NOTE {config.model.name}: {advice}.")


FED_CHECK_SAMPLES = 8  # the first calibration samples read for the inputs the data feeds


def _fed_inputs(source: SampleSource) -> set[str]:
    """The inputs the first calibration samples hold, but one that is zeros in each of them: a
    reader that yields a state input as zeros window after window does not feed it (a reader
    that carries it gives zeros on a stream's first window only)."""
    held: set[str] | None = None
    moving: set[str] = set()
    for _, sample in source.iterate(source.calib[:FED_CHECK_SAMPLES]):
        held = set(sample) if held is None else held & set(sample)
        moving |= {name for name, value in sample.items() if np.any(np.asarray(value))}
    return (held or set()) & moving


def _inferred_recurrent(
    config: ModelConfig, state: _State, fed: set[str]
) -> tuple[ModelConfig, dict[str, str]]:
    """A streaming model with no ``calibration.recurrent`` whose data does not feed its state
    inputs (``fed``: what a sample holds): those carried from the outputs that feed them
    (``evaluate.unfed_states``) instead of zeros. Zeros calibrate a state input to [0, 0], an
    app's real states then clip, and held-out windows with zero states cannot show it (Silero
    without its ``recurrent`` line, quantized: 3.4 dB from float on real streaming windows).
    Said on the console; a declared ``recurrent`` is never changed."""
    cal = config.calibration
    pairs, unpaired = unfed_states(state.largest.float_path, fed)
    name = config.model.name
    if unpaired:
        print(
            f"NOTE {name}: state input(s) {', '.join(unpaired)} are shaped like several outputs, "
            "none named after them: calibrated at zeros. Set calibration.recurrent = "
            '{ state_in = "state_out" } to carry each from the output that feeds it.'
        )
    if not pairs:
        return config, {}
    shown = ", ".join(f"{inp} = {out!r}" for inp, out in pairs.items())
    print(
        f"NOTE {name}: calibration.recurrent inferred: {{ {shown} }} (state inputs the "
        "calibration data does not feed, each shaped like the output that feeds it): carried "
        "window to window, not zeros. Declare calibration.recurrent to choose otherwise."
    )
    return dataclasses.replace(config, calibration=dataclasses.replace(cal, recurrent=pairs)), pairs


def _stream_states(config: ModelConfig, state: _State, paths: ModelPaths) -> dict[str, str]:
    """A streaming model's state input -> the output that feeds it: ``calibration.recurrent``,
    or found in its held-out windows (``evaluate.carried_states``); {} for other models."""
    name = state.plan.names[0]
    if len(state.plan.names) != 1 or not state.held_counts[name]:
        return {}
    declared = dict(config.calibration.recurrent or {})
    return declared or carried_states(state.prepared[name].float_path, paths.bucket(name).heldout)


def _closed_loop(
    config: ModelConfig,
    state: _State,
    paths: ModelPaths,
    states: dict[str, str],
    judgement: HtpJudgement | None,
) -> dict[str, Accuracy]:
    """The QDQ model fed its own ``states`` (``evaluate.closed_loop``), named on the console
    under the target; {} without states, and for a model kept whole in fp16 (float32 on the
    CPU: only the HTP has its fp16 state)."""
    if not states or (judgement is not None and judgement.whole_float16):
        return {}
    name = state.plan.names[0]
    bucket = paths.bucket(name)
    loop = closed_loop(state.prepared[name].float_path, bucket.qdq, bucket.heldout, states)
    target = config.quantization.target_snr_db
    if loop and worst_snr(loop) < target:
        print(
            f"NOTE {config.model.name}: fed its own state window after window (as a streaming "
            f"app runs it) the QDQ model is {worst_snr(loop):.1f} dB from float on the CPU, under "
            f"the target of {target:g} dB (not gated; every other figure feeds it the float "
            "model's state)."
        )
    return loop


def _note_not_whole(config: ModelConfig, judgement: HtpJudgement | None) -> None:
    """Say on the console when the candidate kept ran on the HTP in more than one partition or
    with CPU nodes: no candidate met compile's coverage gate, which will fail, and quantize is
    where that was seen first (a watermark encoder's rank-5 Tanhs: 5 partitions, 12 CPU nodes,
    its fp16 candidate failing to finalize; said only at compile, minutes later)."""
    if judgement is None or judgement.judge != "htp":
        return
    kept = next((r for r in judgement.rounds if r.label == judgement.chosen), None)
    if kept is None or kept.error:
        return
    allowed = bool(config.compile.allowed_cpu_ops)  # the probe counts every CPU node alike
    if kept.partitions <= config.compile.max_partitions and (not kept.cpu_nodes or allowed):
        return
    print(
        f"NOTE {config.model.name}: no candidate ran whole on the NPU; the one kept ("
        f"{kept.label}) ran in {kept.partitions} QNN partition(s) with {kept.cpu_nodes} CPU "
        "node(s) on the HTP, so compile's coverage gate will fail unless [compile] "
        "max_partitions and allowed_cpu_ops allow them. The report's judge table has every "
        "candidate; compile's report will name the ops."
    )


def _note_short_parts(
    config: ModelConfig, per_bucket: dict[str, dict[str, Accuracy]], states: Iterable[str]
) -> None:
    """Name on the console the parts of packed outputs (``accuracy.PART``) below the target on
    the CPU: the report shows them, but the output's one figure, mostly its largest part's,
    hides them (FastestDet's 80 class probabilities at 19.9 dB inside an output at 32.0). A
    streaming model's state outputs (``states``: h beside c) are left to the closed loop."""
    target = config.quantization.target_snr_db
    of_states = tuple(part_name(out, "") for out in states)
    short = {
        name: a.snr_db
        for summary in per_bucket.values()
        for name, a in summary.items()
        if a.compared_as == PART and a.snr_db < target and not name.startswith(of_states)
    }
    if short:
        shown = ", ".join(f"'{n}' {v:.1f} dB" for n, v in sorted(short.items()))
        print(
            f"NOTE {config.model.name}: part(s) of packed outputs below the target of {target:g} "
            f"dB on the CPU (not gated; the output's figure is mostly its largest part's): "
            f"{shown}."
        )


def _never_rebuilt(*_: object) -> None:
    raise AssertionError("a pre-quantized model's own quantization is measured, never rebuilt")


def _keep_own_quantization(
    config: ModelConfig, paths: ModelPaths, state: _State
) -> report_mod.OwnQuantization | None:
    """A pre-quantized model keeps its own quantization (pipeline.graph.prequantized): each
    bucket's QDQ model is its prepared model with the exact rewrites the QNN HTP needs. None for
    a model that the pipeline quantizes (a float model, or requantize = true)."""
    import onnx

    plan = state.plan
    names = plan.names
    first = onnx.load(str(state.prepared[names[0]].float_path))
    if not prequantized.is_prequantized(first):
        return None
    q = config.quantization
    if q.overrides.tensors or q.overrides.op_types:
        raise ConfigError(
            f"{config.path}: [quantization.overrides] apply to the pipeline's own quantization, "
            f"but {config.model.name} is pre-quantized and keeps the quantization it brought.",
            tip="Remove the overrides, or set requantize = true to recalibrate the float model.",
        )
    started = time.perf_counter()
    changes: list[Any] = []
    for name in names:
        model = first if name == names[0] else onnx.load(str(state.prepared[name].float_path))
        model, changes = prequantized.for_htp(model)
        with atomic_path(paths.bucket(name).qdq) as tmp:
            onnx.save(model, str(tmp))
    largest = paths.bucket(plan.largest.name)
    jitter = {}
    if state.held_counts.get(plan.largest.name):
        jitter = input_jitter(
            state.prepared[plan.largest.name].float_path,
            largest.heldout,
            prequantized.input_steps(first),
            config.calibration.seed,
        )
    state.timings["quantize"] = time.perf_counter() - started
    return report_mod.OwnQuantization(
        kept=True,
        summary=prequantized.summarize(first).describe(),
        conversions=[report_mod.PrepareStep(c.step, list(c.details)) for c in changes],
        float_edges=prequantized.float_edges(onnx.load(str(largest.qdq))),
        removed=[],
        input_jitter=jitter,
    )


@dataclasses.dataclass
class _State:
    """What the steps of one build have made so far."""

    source: SourceModel
    plan: BucketPlan
    prepared: dict[str, PreparedBucket]
    timings: dict[str, float]
    samples: SampleSource | None = None
    routed: _Routed | None = None
    held_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    borrowed: list[str] = dataclasses.field(default_factory=list)
    own: report_mod.OwnQuantization | None = None  # the source brought its own quantization
    lstm_nodes: int | None = None  # the LSTM unroll budget preparation had (None: default)
    recurrent_inferred: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def largest(self) -> PreparedBucket:
        return self.prepared[self.plan.largest.name]


def _prepare_all(
    config: ModelConfig,
    paths: ModelPaths,
    timings: dict[str, float],
    lstm_nodes: int | None = None,
    float_path_of: Any = None,
) -> _State:
    """Load the source, plan the buckets and prepare each one's static float model, saved to
    ``float_path_of(bucket name)`` (default: the bucket's float model in the artifacts;
    ``lstm_nodes``: the LSTM unroll budget, ``prepare_buckets``)."""
    started = time.perf_counter()
    source = load_source_model(config.source_path)
    if config.model.outputs:  # the part the user builds becomes the source every figure refers to
        source = transforms.cut_at_outputs(source, config.model.outputs)
    own = None
    resized = transforms.resized_inputs(source, config.inputs.shapes)
    # A dynamically quantized model (onnxruntime's quantize_dynamic) has no activation scales
    # to keep: its activations are quantized at run time. It is built from the float model
    # behind it, whatever requantize says.
    dynamic = prequantized.is_dynamically_quantized(source)
    if (config.quantization.requantize or dynamic) and prequantized.is_prequantized(source):
        # The float model behind the quantized one becomes the source every figure refers to.
        summary = prequantized.summarize(source).describe()
        if dynamic:
            summary += " (dynamic: activations quantized at run time, so requantized)"
        source, removed = prequantized.dequantize(source)
        own = report_mod.OwnQuantization(False, summary, [], [], list(removed.details), {})
        kept = SourceModel.of(source, free_inputs=resized)
    else:
        path = None if config.model.outputs else config.source_path
        kept = SourceModel.of(source, path, resized)
    float_path_of = float_path_of or (lambda name: paths.bucket(name).float_model)
    steps = prepare_buckets(config, source, float_path_of, lstm_nodes)
    del source  # only ``kept`` from here on (see SourceModel)
    prepared: dict[str, PreparedBucket] = {}
    try:
        plan = next(steps)
        assert isinstance(plan, BucketPlan)
        for item in steps:
            assert isinstance(item, PreparedBucket)
            prepared[item.bucket.name] = item
    except ModelError as exc:
        if not resized or isinstance(exc, NothingForTheNpu):  # a refusal, not a size's fault
            raise
        # Strict shape inference cannot see past an op it has no schema for (a legacy
        # ImageScaler): a graph that bakes its size may fail only later, in a step's own terms.
        names = ", ".join(repr(name) for name in resized)
        raise ModelError(
            f"{exc.message} ([inputs] shapes gives {names} a size the model fixes: a graph "
            "exported for one size may not take another)",
            tip="Give the input the size the model was exported for, or re-export it with "
            "dynamic axes." + (f" {exc.tip}" if exc.tip else ""),
        ) from None
    _remove_stale_buckets(paths, plan)
    timings["prepare"] = timings.get("prepare", 0.0) + time.perf_counter() - started
    return _State(kept, plan, prepared, timings, own=own, lstm_nodes=lstm_nodes)


# Held-out samples the HTP's own LSTMs run on before the budget's verdict stands: two, spread
# over the set (a float model of 3 x 160 LSTM steps takes ~13 s a sample on the simulator).
HTP_LSTM_SAMPLES = 2
# The unrolled form replaces the HTP's LSTMs past the budget only when this much better.
LSTM_UNROLL_GAIN_DB = 3.0


class _Unrolled(Exception):
    """The judge's first round fell short and the unrolled LSTMs do better: build again on it."""

    def __init__(self, state: _State) -> None:
        super().__init__("LSTMs unrolled")
        self.state = state


def _kept_lstms(config: ModelConfig, paths: ModelPaths, state: _State) -> list[str]:
    """The unroll step's "kept whole" details when the HTP may overrule the node budget: one
    bucket, a model quantized here, the HTP judge on and held-out samples to run."""
    from ..graph.recurrent import LSTMS_KEPT_WHOLE
    from ..htp.probe import qnn_available

    if len(state.plan.buckets) != 1 or state.own is not None or config.quantization.judge == "cpu":
        return []
    largest = state.largest
    kept = [
        d
        for c in largest.changes
        if c.step == "unroll_recurrent_ops"
        for d in c.details
        if d.startswith(LSTMS_KEPT_WHOLE)
    ]
    if not kept or not samples_in(paths.bucket(largest.bucket.name).heldout) or qnn_available():
        return []
    return kept


def _note_on_unroll_step(state: _State, note: str) -> None:
    """Append ``note`` to the unroll step's details of every bucket (the report shows them)."""
    for name, item in list(state.prepared.items()):
        changes = [
            Change(c.step, (*c.details, note)) if c.step == "unroll_recurrent_ops" else c
            for c in item.changes
        ]
        state.prepared[name] = dataclasses.replace(item, changes=changes)


def _unroll_lstms_the_htp_computes_short(
    config: ModelConfig, paths: ModelPaths, state: _State
) -> _State | None:
    """The model prepared again with its LSTMs unrolled (up to ``LSTM_UNROLL_CAP`` nodes)
    when preparation kept them whole for the node budget, the HTP's own LSTMs (the float
    model run whole in fp16 on the simulator) miss the target on held-out samples, and the
    unrolled form, run the same way, does better by ``LSTM_UNROLL_GAIN_DB``; None otherwise
    (what was measured goes to the unroll step's details). Why: the budget keeps builds short
    where the HTP's LSTM is good enough (a bidirectional OCR LSTM: 0.5 dB for 10x the build),
    but a Resemblyzer speaker encoder (3 layers of 256 over 160 frames) read 12.6 dB native in
    fp16 and 39.6 dB unrolled (2 random layers of 32 over 20 steps: 32 vs 50 dB). The HTP's
    LSTM op computes its gates with its coarse fp16 Sigmoid and Tanh; unrolled, they take the
    exact fp16 forms (without them both forms read the same). Asked only when the HTP judge's
    first round, LSTMs native, falls short of the target: a quantized model that meets it
    needs no verdict on the fp16 form (ppocr_rec: 3.8 s of a 12 s build)."""
    from ..graph.recurrent import LSTM_UNROLL_CAP
    from ..htp.probe import probe
    from .judge import get_target

    if not _kept_lstms(config, paths, state):
        return None
    largest = state.largest
    heldout = samples_in(paths.bucket(largest.bucket.name).heldout)
    chip = get_target(config.compile.targets[0])
    target = config.quantization.target_snr_db
    samples = spread(heldout, HTP_LSTM_SAMPLES)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=".htp-lstm-", dir=paths.root) as work_text:
        work = Path(work_text)

        def in_fp16(float_path: Path, label: str, steps: int = 0) -> float | None:
            """The form's worst ctx vs float, whole in fp16 (its exact fp16 forms) on the HTP;
            ``steps``: the LSTM cells QNN builds for it (they lengthen the time limit)."""
            import onnx

            from ..graph.fp16_scale import exact_float16_forms

            exact, _ = exact_float16_forms(onnx.load(str(float_path)))
            onnx.save(exact, str(work / f"{label}_fp16.onnx"))
            result = probe(
                work / f"{label}_fp16.onnx",
                largest.float_path,
                samples,
                work / label,
                chip.soc_model,
                chip.htp_arch,
                qnn_options=config.compile.qnn_options_for(steps),
                timeout_s=config.compile.timeout_for(steps),
                budget_s=HTP_BUDGET_S,
            )
            return result.worst_ctx_vs_float if result.ok else None

        native = in_fp16(largest.float_path, "native", largest.recurrent_steps)
        unrolled, measured = None, ""
        if native is not None:
            measured = (
                f"the HTP's own LSTMs, whole in fp16, {native:.1f} dB vs float on "
                f"{len(samples)} held-out sample(s) (target {target:g})"
            )
        if native is not None and native < target + ENOUGH_MARGIN_DB:
            unrolled = _prepare_all(
                config, paths, state.timings, LSTM_UNROLL_CAP, lambda name: work / f"{name}.onnx"
            )
            better = in_fp16(unrolled.largest.float_path, "unrolled")
            measured += "; unrolled " + ("failed" if better is None else f"{better:.1f} dB")
            if better is None or better < native + LSTM_UNROLL_GAIN_DB:
                unrolled = None
            else:
                for name, item in list(unrolled.prepared.items()):
                    os.replace(item.float_path, paths.bucket(name).float_model)
                    unrolled.prepared[name] = dataclasses.replace(
                        item, float_path=paths.bucket(name).float_model
                    )
    state.timings["htp_lstm_check"] = time.perf_counter() - started
    if measured:  # the unroll step of the form kept says what was measured
        verdict = f"unrolled up to {LSTM_UNROLL_CAP} nodes" if unrolled else "kept whole"
        _note_on_unroll_step(unrolled or state, f"{measured}: {verdict}")
    return unrolled


def _sample_all(
    config: ModelConfig, paths: ModelPaths, state: _State
) -> tuple[ModelConfig, dict[str, BucketSamples]]:
    """Route the calibration samples into buckets, write the held-out samples; each bucket's
    calibration samples, and the config with the state pairs it inferred
    (``_inferred_recurrent``)."""
    started = time.perf_counter()
    plan, largest = state.plan, state.largest
    bounds = {}
    if config.calibration.kind == "random":  # ids drawn within the tables they index
        import onnx

        bounds = index_bounds(onnx.load(str(largest.float_path), load_external_data=False))
    # The input audio windows or images feed (a model with one input: that one) is no state.
    specs = largest.specs
    fed = {config.calibration.input or (specs[0].name if len(specs) == 1 else "")}
    if config.calibration.kind not in ("audio", "images"):
        fed = set()
    stream = len(plan.names) == 1 and bool(state_like_inputs(largest.float_path) - fed)
    state.samples = sample_source(config, largest.specs, paths.root / READER_SAMPLES, stream)
    if not state.samples.calib:
        raise CalibrationError(f"{config.model.name}: no calibration samples were selected.")
    if stream and not config.calibration.recurrent and config.calibration.kind != "random":
        config, state.recurrent_inferred = _inferred_recurrent(
            config,
            state,
            _fed_inputs(state.samples) | fed,  # silence is still the audio's
        )
    router = Router(config, plan, {s.name: s.dtype for s in largest.specs}, bounds)
    state.routed = _route(config, plan, state.samples, router)
    state.held_counts, state.borrowed = _write_heldout(
        paths, plan, state.samples, router, state.routed, largest.float_path
    )
    state.timings["route"] = time.perf_counter() - started
    return config, {
        name: BucketSamples(
            state.samples,
            router,
            plan.bucket(name),
            state.routed.refs[name],
            state.prepared[name].float_path,
        )
        for name in plan.names
    }


def _build(
    config: ModelConfig, paths: ModelPaths, inputs: BuildInputs, timings: dict[str, float]
) -> tuple[report_mod.QuantizeReport, QuantizeRecord]:
    """Every step of a quantize run; ``timings`` gets each step's seconds as it finishes. The
    HTP judge's processes start now, warming up beside preparation and calibration."""
    judged = config.quantization.judge != "cpu"
    cache = paths.root / READER_SAMPLES  # a python reader's samples, for this run only
    shutil.rmtree(cache, ignore_errors=True)
    try:
        with spare_probes(paths.root) if judged else contextlib.nullcontext():
            return _steps(config, paths, inputs, timings)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _own_floor(state: _State) -> list[float]:
    """A kept pre-quantized model's own rounding floors (dB), one per input jitter measured."""
    jitter = state.own.input_jitter.values() if state.own else []
    return [a.snr_db for a in jitter if a.snr_db == a.snr_db]


# Calibration samples whose per-channel peaks set the balancing factors: the factors need only
# be near (a channel within 2x of the others is balanced), and each sample is one float run:
# up to 4, while their inputs hold BALANCE_VALUES values (4 images at 416x416), 2 at least (a
# 1024x2048 segmenter: 2 runs of ~1.5 s each). The calibration after it sees every sample.
BALANCE_SAMPLES = 4
BALANCE_VALUES = 4 * 3 * 416 * 416


def _balance_channels(
    config: ModelConfig, state: _State, samples: Mapping[str, BucketSamples]
) -> None:
    """Conv output channels rescaled ahead of depthwise Convs (``graph.balance``), with the
    same factors in every bucket (from the largest's calibration samples), so the buckets keep
    identical weights; nothing where the buckets' graphs differ there, for a model keeping its
    own quantization, or without per-channel weights."""
    q = config.quantization
    for bucket in state.prepared.values():  # an earlier build's, which nothing reads now
        bucket.float_path.with_name(UNBALANCED_FLOAT).unlink(missing_ok=True)
    if not (q.balance_channels and q.per_channel) or (state.own is not None and state.own.kept):
        return
    import onnx

    from ..calibration.ranges import channel_peaks
    from ..graph.balance import balance_scales, balance_sites, balanced_depthwise_inputs

    started = time.perf_counter()
    largest = state.plan.largest.name
    models = {name: onnx.load(str(b.float_path)) for name, b in state.prepared.items()}
    sites = {name: balance_sites(model) for name, model in models.items()}
    if not sites[largest] or any(found != sites[largest] for found in sites.values()):
        return
    values = sum(int(np.prod(spec.shape)) for spec in state.largest.specs) or 1
    count = max(2, min(BALANCE_SAMPLES, BALANCE_VALUES // values))
    peaks = channel_peaks(models[largest], sites[largest], samples[largest], count)
    scales = balance_scales(peaks)
    for name, model in models.items():
        balanced, change = balanced_depthwise_inputs(model, scales)
        if not change.changed:
            continue
        bucket = state.prepared[name]
        unbalanced = bucket.float_path.with_name(UNBALANCED_FLOAT)
        with atomic_path(unbalanced) as tmp:
            onnx.save(model, str(tmp))
        with atomic_path(bucket.float_path) as tmp:
            onnx.save(balanced, str(tmp))
        state.prepared[name] = dataclasses.replace(
            bucket,
            changes=[*bucket.changes, change],
            nodes=len(balanced.graph.node),
            unbalanced_path=unbalanced,
        )
    state.timings["prepare"] = state.timings.get("prepare", 0.0) + time.perf_counter() - started


def _check_preparation(config: ModelConfig, paths: ModelPaths, state: _State) -> PreparationCheck:
    """Prepared float vs source on the largest bucket's held-out samples (``lossless``)."""
    started = time.perf_counter()
    plan = state.plan
    largest = plan.largest
    own_floor = _own_floor(state)
    check = check_preparation(
        config.model.name,
        state.source,
        bucket_inputs(config.inputs, largest.shapes if config.buckets.enabled else None),
        state.prepared[largest.name].float_path,
        paths.bucket(largest.name).heldout,
        min(own_floor) if own_floor else None,
        lstm_budget(plan, state.lstm_nodes),
    )
    state.timings["check_preparation"] = time.perf_counter() - started
    return check


def _steps(
    config: ModelConfig, paths: ModelPaths, inputs: BuildInputs, timings: dict[str, float]
) -> tuple[report_mod.QuantizeReport, QuantizeRecord]:
    state = _prepare_all(config, paths, timings)
    release_freed_memory()  # the source and preparation's copies (see pipeline.core.memory)
    config, samples = _sample_all(config, paths, state)
    adapt_heap_to(sum(int(np.prod(s.shape)) * s.dtype.itemsize for s in state.largest.specs))
    state.own = _keep_own_quantization(config, paths, state) or state.own
    _balance_channels(config, state, samples)  # before the check, which covers it too
    # Before calibration holds its data and the judge its models: the check's two CPU sessions
    # and their activations came on top of those (a DeepLab at 257x257: 228 -> 281 MiB).
    preparation = _check_preparation(config, paths, state)
    if state.own is not None and state.own.kept:  # no calibration, no second quantization
        merged, changes, mixed = 0, quantizer.range_rules.RangeChanges(), None
        judgement = _measure_own(config, paths, state)
    else:
        kept_lstms = bool(_kept_lstms(config, paths, state))
        asked: list[bool] = []

        def lstms_on_short() -> None:
            """The judge's first round is short: do the HTP's own LSTMs cost it?"""
            asked.append(True)
            unrolled = _unroll_lstms_the_htp_computes_short(config, paths, state)
            if unrolled is not None:
                raise _Unrolled(unrolled)

        try:
            merged, changes, mixed, judgement = _quantize_all(
                config,
                paths,
                state.plan,
                state.prepared,
                samples,
                state.held_counts,
                state.timings,
                lstms_on_short if kept_lstms else None,
            )
            if kept_lstms and not asked:
                _note_on_unroll_step(
                    state, "the quantized model met the target on the HTP with them: kept whole"
                )
        except _Unrolled as restart:  # quantize again on the unrolled form, judged as usual
            restart.state.own = state.own
            restart.state.recurrent_inferred = state.recurrent_inferred  # config carries them
            state = restart.state
            release_freed_memory()
            config, samples = _sample_all(config, paths, state)
            _balance_channels(config, state, samples)
            preparation = _check_preparation(config, paths, state)  # of the unrolled form
            merged, changes, mixed, judgement = _quantize_all(
                config, paths, state.plan, state.prepared, samples, state.held_counts, state.timings
            )
    plan = state.plan
    release_freed_memory()
    qdqs = {n: paths.bucket(n).qdq for n in plan.names}
    floats = {n: state.prepared[n].float_path for n in plan.names}
    weights = _weight_sharing(qdqs)
    started = time.perf_counter()
    per_bucket = {
        n: _judged_accuracy(paths.bucket(n), qdqs[n])
        or (evaluate(floats[n], qdqs[n], paths.bucket(n).heldout) if state.held_counts[n] else {})
        for n in plan.names
    }
    requantized = state.own is not None and not state.own.kept
    shipped = config.source_path if requantized else None  # its figures are vs the float behind
    e2e = end_to_end(config, state.source, plan, floats, qdqs, paths.heldout, shipped)
    states = _stream_states(config, state, paths)
    loop = _closed_loop(config, state, paths, states, judgement)
    state.timings["evaluate"] = time.perf_counter() - started
    own_floor = _own_floor(state)
    for name in plan.names:  # every comparison above ran on them; the artifact does not
        _drop_judged_outputs(floats[name], qdqs[name])
    worst_each = [worst_snr(v) for v in per_bucket.values() if v]
    worst = min(worst_each) if worst_each else float("nan")
    _note_short_parts(config, per_bucket, states.values())
    _note_not_whole(config, judgement)
    if judgement is not None and judgement.whole_float16:
        # No quantization: "QDQ vs float" compares the float model with itself (inf). What
        # the gate must judge is what the HTP computes in fp16 (an fp16 overflow: -51.6 dB).
        measured = judgement.ctx_vs_float_db
        worst = float("nan") if measured is None else min(measured, worst)
    q = config.quantization
    kept = state.own is not None and state.own.kept
    gate = kept_model_gate(q.min_snr_db, own_floor if kept else [])
    judged = judged_ctx_db(judgement)
    own_types = prequantized.summarize(state.source.load()) if kept else None
    report = report_mod.QuantizeReport(
        model=config.model.name,
        version=config.model.version,
        config=str(config.path),
        inputs=inputs,
        graph_inputs=[s.describe() for s in state.largest.specs],
        prepare=[report_mod.PrepareStep(c.step, list(c.details)) for c in state.largest.changes],
        calibration_kind=config.calibration.kind,
        calibration_samples=len(state.samples.calib) if state.samples else 0,
        heldout_samples=len(state.samples.held) if state.samples else 0,
        calibration_chunk=quantizer.CALIBRATION_CHUNK,
        merged_tensors=merged,
        activation_type="/".join(own_types.activation_types) if own_types else q.activation_type,
        weight_type="/".join(own_types.weight_types) if own_types else q.weight_type,
        per_channel=bool(own_types.per_channel_weights) if own_types else q.per_channel,
        method="own (pre-quantized)" if kept else q.method,
        tensor_overrides=dict(q.overrides.tensors),
        op_type_overrides=dict(q.overrides.op_types),
        range_rules=report_mod.RangeRules(
            changes.clamped,
            changes.widened,
            changes.bias_floor,
            changes.mask_fills or None,
            changes.bias_corrections,
            changes.filled,
            changes.swish_splits or None,
            changes.log_outputs or None,
            changes.signed_products or None,
            changes.selections or None,
            changes.coarse_sums or None,
            changes.integer_inputs or None,
            changes.unseen_ranges or None,
            changes.loop_shared,
            changes.hard_sigmoids or None,
            changes.raised_weight_scales or None,
            changes.requantized_moves or None,
            changes.split_weights or None,
            changes.dequantized_inputs or None,
            changes.scatter_sums or None,
            changes.packed_outputs or None,
            changes.sentinel_constants or None,
        ),
        mixed_precision=mixed,
        htp=judgement,
        buckets=[_bucket_report(state, paths, n, per_bucket[n]) for n in plan.names],
        pads=list(plan.pads),
        crops=list(plan.crops),
        weights=weights,
        end_to_end=e2e,
        closed_loop=loop,
        stream_states=states,
        recurrent_inferred=state.recurrent_inferred,
        worst_snr_db=worst,
        min_snr_db=gate,
        passed=(gate <= 0 or min(worst, judged) >= gate) and preparation.passed,
        preparation_check=preparation,
        prequantized=state.own,
        source_bytes=config.source_path.stat().st_size,
        timings_s=state.timings,
    )
    return report, _record(config, inputs, state, paths, report)


def _drop_judged_outputs(float_path: Path, qdq_path: Path) -> None:
    """The QDQ model that ships outputs what the user's model does: the scores a label-only
    model was judged by (``tails.expose_label_scores``, listed in the prepared model's
    metadata) go once every comparison has run on them."""
    names = judged_outputs(read_model_summary(float_path).metadata)
    if not names:
        return
    import onnx

    model = onnx.load(str(qdq_path), load_external_data=False)  # its weights stay where they are
    if any(o.name in names for o in model.graph.output):
        with atomic_path(qdq_path) as tmp:
            onnx.save(drop_judged_outputs(model, names), str(tmp))


def judged_ctx_db(judgement: HtpJudgement | None) -> float:
    """The HTP judge's ctx vs float for the precision it kept, which the quantize gate holds
    too (inf when the judge did not run on the HTP): the CPU QDQ model is not what ships, and
    a model whose lookups the HTP computed wrongly passed quantize at 5.6 dB there (its CPU QDQ
    model at 56.5), failing only at compile. Left whole in fp16, this figure is the one the
    gate reads anyway (worst)."""
    if judgement is None or judgement.judge != "htp" or judgement.ctx_vs_float_db is None:
        return float("inf")
    return judgement.ctx_vs_float_db


def kept_model_gate(min_snr_db: float, own_floor_db: list[float]) -> float:
    """The QDQ-vs-float gate of a model whose own quantization is kept: ``min_snr_db``, or its
    rounding floor (how far it moves when its input moves within its own rounding) less a
    margin, where that is lower, as compile's gate is. Its QDQ is that quantization rewritten
    for the HTP, exact in real numbers but not in float32, and flipped roundings move it like
    the floor does (a classifier with unfolded BatchNorms at 8 bits: 17.2 dB, floor 18.0)."""
    if min_snr_db <= 0 or not own_floor_db:
        return min_snr_db
    return min(min_snr_db, min(own_floor_db) - OWN_ROUNDING_MARGIN_DB)


def _judged_accuracy(bucket: BucketPaths, qdq: Path) -> dict[str, Any] | None:
    """QDQ vs float as the HTP judge's probe measured it on the CPU, when it ran this very QDQ
    model on every held-out sample of the bucket (digests prove both): evaluating again would
    run the same two CPU models on the same samples (magika 1.2 s, retinaface 2.2 s)."""
    record, _ = read_record(HtpProbeRecord, bucket.htp_probe)
    if record is None or not record.qdq_vs_float or record.qdq_sha256 != sha256_file(qdq):
        return None
    held = [sha256_file(p) for p in samples_in(bucket.heldout)]
    if not held or sorted(held) != sorted(record.sample_sha256):
        return None
    return dict(record.qdq_vs_float)


def _bucket_report(
    state: _State, paths: ModelPaths, name: str, accuracy: dict[str, Any]
) -> report_mod.BucketReport:
    assert state.routed is not None
    where = paths.bucket(name)
    return report_mod.BucketReport(
        name=name,
        shapes={k: list(v) for k, v in state.plan.bucket(name).shapes.items()},
        calibration_samples=len(state.routed.refs[name]),
        calibrated_with_smaller=name in state.routed.fallback,
        heldout_samples=state.held_counts[name],
        heldout_from_calibration=name in state.borrowed,
        float_nodes=state.prepared[name].nodes,
        float_bytes=where.float_model.stat().st_size,
        qdq_bytes=where.qdq.stat().st_size,
        qdq_vs_float=accuracy,
    )


def _record(
    config: ModelConfig,
    inputs: BuildInputs,
    state: _State,
    paths: ModelPaths,
    report: report_mod.QuantizeReport,
) -> QuantizeRecord:
    """The record the later stages trust: every bucket's digests, the plan, the summary."""
    artifacts = [
        BucketArtifacts(
            name=b.name,
            shapes=b.shapes,
            float_sha256=sha256_file(paths.bucket(b.name).float_model),
            qdq_sha256=sha256_file(paths.bucket(b.name).qdq),
            heldout_digest=folder_digest(paths.bucket(b.name).heldout, "sample_*.npz"),
            heldout_samples=b.heldout_samples,
            recurrent_steps=state.prepared[b.name].recurrent_steps,
        )
        for b in report.buckets
    ]
    mixed = report.mixed_precision
    return QuantizeRecord(
        status="ok" if report.passed else "failed",
        model=config.model.name,
        inputs=inputs,
        buckets=artifacts,
        pads=list(state.plan.pads),
        crops=list(state.plan.crops),
        summary=QuantizeSummary(
            activation_type=report.activation_type,
            weight_type=report.weight_type,
            method=report.method,
            calibration_samples=report.calibration_samples,
            heldout_samples=report.heldout_samples,
            worst_snr_db=report.worst_snr_db,
            outputs=report.buckets[-1].qdq_vs_float,
            prepare_steps=[c.step for c in state.largest.changes if c.details],
            mixed_precision=[t.name for t in mixed.tensors] if mixed else [],
            output_grids={
                name: [scale, zero_point]
                for name, (scale, zero_point) in quantized_output_grids(
                    paths.bucket(state.plan.largest.name).qdq
                ).items()
            },
            output_steps=output_steps(paths.bucket(state.plan.largest.name).qdq),
            rounding_floor_db={
                name: accuracy.snr_db
                for name, accuracy in (
                    report.prequantized.input_jitter if report.prequantized else {}
                ).items()
                if accuracy.snr_db is not None and math.isfinite(accuracy.snr_db)
            },
            htp_failure=_htp_failure(report.htp),
            stream_states=dict(report.stream_states),
            float16_on_htp=_float16_on_htp(report.htp),
        ),
    )


def _float16_on_htp(judgement: HtpJudgement | None) -> str:
    if judgement is None:
        return ""
    return "whole" if judgement.whole_float16 else "partial" if judgement.float16 else ""


def _remove_stale_buckets(paths: ModelPaths, plan: BucketPlan) -> None:
    """Bucket folders of an earlier plan must not linger beside the current ones."""
    if not paths.buckets.is_dir():
        return
    wanted = set(plan.names)
    for folder in paths.buckets.iterdir():
        if folder.is_dir() and not folder.name.startswith(".") and folder.name not in wanted:
            shutil.rmtree(folder, ignore_errors=True)
