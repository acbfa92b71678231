"""Quantize once for every shape bucket: one calibration, one set of quantization parameters.

QNN can share weights between the graphs of one context only if they are byte-identical, so every
bucket's QDQ model must come from the same float weights *and* the same quantization parameters.
Steps, for a config with ``[buckets]``:

1. prepare the float model once per bucket (pipeline.prepare: every shape static; the weights come
   out the same, shape-dependent folding may differ);
2. stream the calibration samples at their natural size, put each in the smallest bucket that holds
   it and pad it there (per-dim value and side from the config);
3. calibrate each bucket's float model on its own samples (onnxruntime's calibrator, cached ranges),
   then merge the ranges tensor by tensor (union), so that a tensor has one range in all buckets;
4. quantize every bucket from the merged ranges (and the same mixed-precision choices), and check
   that every initializer with the same name is byte-identical across the buckets.

Outputs in ``<artifacts>/build/<model>/``: ``buckets/<bucket>/{float,qdq}.onnx`` and
``buckets/<bucket>/heldout/`` (padded held-out samples for the compile stage), ``heldout_true/``
(the held-out samples at their true size), ``ranges.json``, ``report.md|json`` and
``record.json`` (written last).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from . import buckets as bk
from .config import InputsSection, ModelConfig
from .errors import CalibrationError, GateError, ModelError, PipelineError
from .fileio import atomic_dir, atomic_path, sha256_file
from .metrics import OutputComparison, worst_snr
from .records import RECORD_FILE, pipeline_code_digest, read_record, update_record
from .report import fmt, table, write_report

BUCKETS_DIR = "buckets"
TRUE_HELDOUT = "heldout_true"
RANGES_FILE = "ranges.json"
CODE = ("buckets", "bucket_quantize")
Feeds = dict[str, np.ndarray]


# -- the model's signature -----------------------------------------------------------------------


def signatures(model: Any, constants: dict[str, Any]) -> tuple[bk.Signature, dict[str, Any]]:
    """Declared dims of the real inputs (baked constants excluded) and of the outputs."""
    initializers = {i.name for i in model.graph.initializer}

    def dims(value: Any) -> list[int | str | None] | None:
        tensor = value.type.tensor_type
        if not tensor.HasField("shape"):
            return None
        out: list[int | str | None] = []
        for d in tensor.shape.dim:
            if d.HasField("dim_value") and d.dim_value > 0:
                out.append(int(d.dim_value))
            elif d.HasField("dim_param") and d.dim_param:
                out.append(d.dim_param)
            else:
                out.append(None)
        return out

    inputs = {}
    for value in model.graph.input:
        if value.name in initializers or value.name in constants:
            continue
        declared = dims(value)
        if declared is None:
            raise ModelError(
                f"Input {value.name!r} has unknown rank; [buckets] needs the rank of every input."
            )
        inputs[value.name] = declared
    outputs = {o.name: dims(o) for o in model.graph.output}
    return inputs, outputs


# -- samples at their natural size ----------------------------------------------------------------


@dataclasses.dataclass
class RawSource:
    """Where the calibration and held-out samples come from, unpadded and unrouted."""

    calib: list[Any]
    held: list[Any]
    load: Callable[[Any], Feeds]
    describe: Callable[[Any], str]
    stream: Callable[[list[Any]], Iterator[tuple[Any, Feeds]]] | None = None

    def iterate(self, refs: list[Any]) -> Iterator[tuple[Any, Feeds]]:
        if self.stream is not None:
            yield from self.stream(refs)
            return
        for ref in refs:
            yield ref, self.load(ref)


def raw_source(config: ModelConfig, specs: list[Any]) -> RawSource:
    """Samples for bucket calibration: tensors, a python reader, or seeded random sizes."""
    from . import calibration as cal_mod

    cal = config.calibration
    folder = config.resolve(cal.path) if cal.path else None
    names = [s.name for s in specs]
    default_input = cal.input or (names[0] if len(names) == 1 else "")
    if default_input and default_input not in names:
        raise CalibrationError(
            f"{config.path}: calibration.input = {default_input!r} is not a model input.",
            tip=f"Model inputs: {', '.join(names)}.",
        )
    if cal.kind == "tensors":
        if folder is None:  # config validation requires calibration.path
            raise CalibrationError(f"{config.path}: calibration.kind = 'tensors' needs a path.")
        refs = [
            cal_mod.SampleRef(p)
            for p in cal_mod._list_files(folder, cal_mod.TENSOR_SUFFIXES, "tensor")
        ]
        chosen = [refs[i] for i in cal_mod._pick(len(refs), cal.samples)]
        rng = np.random.default_rng(cal.seed)
        chosen = [chosen[i] for i in rng.permutation(len(chosen))]
        calib, held = cal_mod._split(chosen, cal.held_out)
        return RawSource(
            calib,
            held,
            lambda ref: cal_mod._load_tensor_file(ref, default_input),
            lambda ref: str(ref.path),
        )
    if cal.kind == "python":
        reader = cal_mod._import_reader(cal.reader, config.base_dir)
        total = cal.samples
        n_held = round(total * cal.held_out) if total > 1 else 0
        held_idx = set(cal_mod._pick(total, n_held)) if n_held else set()

        def stream(wanted: list[Any]) -> Iterator[tuple[Any, Feeds]]:
            keep = set(wanted)
            produced = 0
            for index, sample in enumerate(reader(folder, specs)):
                if index >= total:
                    break
                produced += 1
                if index in keep:
                    yield index, dict(sample)
            if produced == 0:
                raise CalibrationError(f"calibration.reader {cal.reader!r} produced no samples.")

        return RawSource(
            [i for i in range(total) if i not in held_idx],
            sorted(held_idx),
            lambda ref: next(v for _, v in stream([ref])),
            lambda ref: f"reader sample #{ref}",
            stream,
        )
    if cal.kind == "random":
        total = cal.samples
        n_held = round(total * cal.held_out) if total > 1 else 0
        held_idx = set(cal_mod._pick(total, n_held)) if n_held else set()
        return RawSource(
            [i for i in range(total) if i not in held_idx],
            sorted(held_idx),
            lambda ref: {},  # filled at a random size by BucketRouter
            lambda ref: f"random sample #{ref}",
        )
    raise CalibrationError(  # config validation refuses images/audio with [buckets]
        f"{config.path}: calibration.kind = {cal.kind!r} cannot feed [buckets]."
    )


class BucketRouter:
    """Checks a raw sample, picks its bucket and pads it there (missing inputs are filled)."""

    def __init__(self, config: ModelConfig, plan: bk.BucketPlan, dtypes: dict[str, Any]) -> None:
        self.config = config
        self.plan = plan
        self.dtypes = dtypes
        self.rules: dict[str, list[bk.PadRule]] = {}
        for rule in plan.pads:
            self.rules.setdefault(rule.input, []).append(rule)

    def _random(self, index: int) -> Feeds:
        """Seeded random inputs whose bucket dims are drawn across the whole bucket range."""
        rng = np.random.default_rng(self.config.calibration.seed + int(index))
        largest = self.plan.largest.shapes
        sizes = {rule.dim: 0 for rule in self.plan.pads}
        for dim in sizes:
            top = max(largest[r.input][r.axis] for r in self.plan.pads if r.dim == dim)
            sizes[dim] = int(rng.integers(1, top + 1))
        feeds = {}
        for name, shape in largest.items():
            dims = list(shape)
            for rule in self.rules.get(name, []):
                dims[rule.axis] = sizes[rule.dim]
            dtype = np.dtype(self.dtypes[name])
            value = rng.standard_normal(dims) if dtype.kind == "f" else rng.integers(0, 256, dims)
            feeds[name] = value.astype(dtype)
        return feeds

    def route(self, sample: Feeds, where: str, index: int = 0) -> tuple[bk.Bucket, Feeds, Feeds]:
        """(bucket, padded feeds, the sample's own arrays) for one raw sample."""
        if self.config.calibration.kind == "random":
            sample = self._random(index)
        unknown = sorted(set(sample) - set(self.dtypes))
        if unknown:
            raise CalibrationError(
                f"Calibration sample {where} has tensor(s) {unknown} that are not model inputs.",
                tip=f"Name the tensors after the model inputs: {', '.join(sorted(self.dtypes))}.",
            )
        largest = self.plan.largest.shapes
        own: Feeds = {}
        for name, raw in sample.items():
            array = np.asarray(raw)
            if array.ndim == len(largest[name]) - 1 and largest[name][0] == 1:
                array = array[np.newaxis]  # one sample without its batch axis
            dtype = np.dtype(self.dtypes[name])
            if array.dtype != dtype:
                raise CalibrationError(
                    f"Calibration sample {where}: tensor {name!r} has dtype {array.dtype}, the "
                    f"model input needs {dtype}.",
                    tip=f"Save it with .astype(np.{dtype.name}).",
                )
            own[name] = array
        try:
            bucket = bk.choose_bucket(
                self.plan.buckets, self.plan.pads, {n: a.shape for n, a in own.items()}
            )
        except PipelineError as exc:
            raise CalibrationError(
                f"Calibration sample {where}: {exc.message}", tip=exc.tip
            ) from None
        feeds: Feeds = {}
        rng = np.random.default_rng(self.config.calibration.seed + int(index))
        for name, shape in bucket.shapes.items():
            if name in own:
                feeds[name], _ = bk.pad_input(own[name], shape, self.rules.get(name, []))
            elif (
                self.config.calibration.fill_others == "random"
                and np.dtype(self.dtypes[name]).kind == "f"
            ):
                feeds[name] = rng.standard_normal(shape).astype(self.dtypes[name])
            else:
                feeds[name] = np.zeros(shape, dtype=self.dtypes[name])
        return bucket, feeds, own


class BucketSamples:
    """The calibration samples of one bucket, padded, loaded one at a time (len() is known)."""

    def __init__(self, source: RawSource, router: BucketRouter, refs: list[Any]) -> None:
        self.source = source
        self.router = router
        self.refs = refs

    def __len__(self) -> int:
        return len(self.refs)

    def __iter__(self) -> Iterator[Feeds]:
        for ref, sample in self.source.iterate(self.refs):
            _, feeds, _ = self.router.route(sample, self.source.describe(ref), _index(ref))
            yield feeds


def _index(ref: Any) -> int:
    return ref if isinstance(ref, int) else getattr(ref, "index", 0)


# -- ranges ---------------------------------------------------------------------------------------


def merge_ranges(paths: list[Path], target: Path) -> int:
    """Union of the calibrated range of every tensor over the buckets' caches; tensors merged."""
    from onnxruntime.quantization.calibrate import (
        TensorData,
        TensorsData,
        load_tensors_data,
        save_tensors_data,
    )

    merged: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    method = None
    for path in paths:
        data = load_tensors_data(path)
        if method is not None and data.calibration_method != method:
            raise CalibrationError(f"Calibration caches disagree on the method ({path}).")
        method = data.calibration_method
        for name, value in data.items():
            low, high = value.range_value
            if name in merged:
                old_low, old_high = merged[name]
                low, high = np.minimum(old_low, low), np.maximum(old_high, high)
            merged[name] = (np.asarray(low), np.asarray(high))
    tensors = {
        name: TensorData(lowest=low.astype(np.float32), highest=high.astype(np.float32))
        for name, (low, high) in merged.items()
    }
    save_tensors_data(TensorsData(method, tensors), target)
    return len(tensors)


# -- weights --------------------------------------------------------------------------------------


def weight_identity(qdq_paths: dict[str, Path]) -> dict[str, Any]:
    """Initializers of the buckets' QDQ models: same name must mean the same bytes.

    QNN shares a static tensor between the graphs of one context by name; two different values
    under one name would be a wrong model, so that is a ModelError naming the tensors.
    """
    import onnx

    digests: dict[str, dict[str, tuple[str, int]]] = {}
    for bucket, path in qdq_paths.items():
        model = onnx.load(str(path))
        digests[bucket] = {
            t.name: (hashlib.sha256(t.SerializeToString()).hexdigest(), _tensor_bytes(t))
            for t in model.graph.initializer
        }
    names = set().union(*(d.keys() for d in digests.values()))
    shared, specific, clash = [], [], []
    for name in sorted(names):
        values = {d[name] for d in digests.values() if name in d}
        present = sum(name in d for d in digests.values())
        if len(values) > 1:
            clash.append(name)
        elif present == len(digests):
            shared.append(name)
        else:
            specific.append(name)
    if clash:
        raise ModelError(
            f"Initializer(s) {clash[:8]} have the same name but different values in different "
            "buckets; QNN would share one of them between the buckets' graphs.",
            tip="The preparation folded something shape-dependent into a weight; report the model.",
        )
    first = next(iter(digests.values()))
    return {
        "shared_initializers": len(shared),
        "shared_bytes": sum(first[n][1] for n in shared),
        "bucket_specific_initializers": specific,
        "bucket_specific_bytes": sum(d[n][1] for d in digests.values() for n in specific if n in d),
        "identical": True,
    }


def _tensor_bytes(tensor: Any) -> int:
    from onnx import numpy_helper

    return int(numpy_helper.to_array(tensor).nbytes)


# -- the stage ------------------------------------------------------------------------------------


def build_inputs(config: ModelConfig) -> dict[str, Any]:
    from .quantize import build_inputs as plain_inputs

    inputs = plain_inputs(config)
    inputs["bucket_code"] = pipeline_code_digest(CODE)
    return inputs


def bucket_folder(folder: Path, name: str) -> Path:
    return folder / BUCKETS_DIR / name


def quantize_bucketed(config: ModelConfig, artifacts: Path, force: bool = False) -> Any:
    """Build (or reuse) every bucket's QDQ model for one config; returns a QuantizeResult."""
    from .quantize import QuantizeResult, _summary, apply_gate, record_head

    folder = Path(artifacts) / "build" / config.model.name
    inputs = build_inputs(config)
    record = read_record(folder).get("quantize", {})
    expected = [bucket_folder(folder, b["name"]) / "qdq.onnx" for b in record.get("buckets", [])]
    if (
        not force
        and record.get("inputs") == inputs
        and record.get("status") == "ok"
        and expected
        and all(p.is_file() for p in expected)
        and (folder / "report.json").is_file()
    ):
        report = json.loads((folder / "report.json").read_text("utf-8"))
        return QuantizeResult(config.model.name, folder, True, report)

    (folder / RECORD_FILE).unlink(missing_ok=True)  # no record claims success from here on
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report, plan, qdq_paths = _build(config, folder, inputs)
    report["timings_s"]["total"] = time.perf_counter() - started
    passed = apply_gate(config, report)
    write_bucket_report(folder, report)
    update_record(
        folder,
        "quantize",
        {
            **record_head(config, inputs, passed),
            "summary": {**_summary(report), "buckets": report["buckets"]["names"]},
            "buckets": [
                {
                    "name": b.name,
                    "shapes": {k: list(v) for k, v in b.shapes.items()},
                    "qdq_sha256": sha256_file(qdq_paths[b.name]),
                    "float_sha256": sha256_file(bucket_folder(folder, b.name) / "float.onnx"),
                }
                for b in plan.buckets
            ],
            "plan": plan_to_dict(plan),
        },
    )
    if not passed:
        worst, gate = report["accuracy"]["worst_snr_db"], config.quantization.min_snr_db
        raise GateError(
            f"{config.model.name}: worst bucket QDQ vs float SNR {fmt(worst)} dB is below "
            f"quantization.min_snr_db = {gate} ({folder / 'report.md'}).",
            tip="Use 16-bit types or overrides for the worst tensors, or more calibration data.",
        )
    return QuantizeResult(config.model.name, folder, False, report)


def plan_to_dict(plan: bk.BucketPlan) -> dict[str, Any]:
    return {
        "buckets": [
            {"name": b.name, "shapes": {k: list(v) for k, v in b.shapes.items()}}
            for b in plan.buckets
        ],
        "pads": [dataclasses.asdict(p) for p in plan.pads],
        "crops": [dataclasses.asdict(c) for c in plan.crops],
    }


def plan_from_dict(data: dict[str, Any]) -> bk.BucketPlan:
    return bk.BucketPlan(
        [
            bk.Bucket(b["name"], {k: tuple(v) for k, v in b["shapes"].items()})
            for b in data["buckets"]
        ],
        [bk.PadRule(**p) for p in data["pads"]],
        [bk.CropRule(**c) for c in data["crops"]],
    )


def _build(
    config: ModelConfig, folder: Path, inputs: dict[str, Any]
) -> tuple[dict[str, Any], bk.BucketPlan, dict[str, Path]]:
    import onnx

    from .calibration import input_specs
    from .prepare import prepare_model
    from .quantize import _quantize_once, load_source_model

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    source = load_source_model(config.source_path)
    in_sigs, out_sigs = signatures(source, config.inputs.constants)
    plan = bk.plan_buckets(
        config.buckets, in_sigs, out_sigs, config.inputs.dims, config.inputs.shapes, config.path
    )
    plan = fit_crops(config, source, plan)
    floats: dict[str, Path] = {}
    changes: dict[str, list[Any]] = {}
    specs: dict[str, list[Any]] = {}
    for bucket in plan.buckets:
        section = InputsSection(
            dims=dict(config.inputs.dims),
            shapes={k: list(v) for k, v in bucket.shapes.items()},
            constants=dict(config.inputs.constants),
        )
        try:
            prepared, steps = prepare_model(source, section)
        except PipelineError as exc:
            raise type(exc)(f"bucket {bucket.describe()}: {exc.message}", exc.tip) from None
        path = bucket_folder(folder, bucket.name) / "float.onnx"
        with atomic_path(path) as tmp:
            onnx.save(prepared, str(tmp))
        floats[bucket.name] = path
        changes[bucket.name] = steps
        specs[bucket.name] = input_specs(prepared)
    timings["prepare"] = time.perf_counter() - t0

    largest_specs = specs[plan.largest.name]
    dtypes = {s.name: s.dtype for s in largest_specs}
    source_samples = raw_source(config, largest_specs)
    router = BucketRouter(config, plan, dtypes)

    # Route once: which bucket each sample falls in (held-out samples are written to disk).
    t0 = time.perf_counter()
    own: dict[str, list[Any]] = {b.name: [] for b in plan.buckets}
    for ref, sample in source_samples.iterate(source_samples.calib):
        bucket, _, _ = router.route(sample, source_samples.describe(ref), _index(ref))
        own[bucket.name].append(ref)
    held_counts, borrowed = _write_heldout(folder, plan, source_samples, router, own)
    timings["route"] = time.perf_counter() - t0
    order = [b.name for b in plan.buckets]
    calib_refs: dict[str, list[Any]] = {}
    fallback: dict[str, bool] = {}
    for index, name in enumerate(order):
        refs = own[name]
        fallback[name] = not refs
        if not refs:  # no sample of its own: every sample that fits, padded into it
            refs = [r for smaller in order[: index + 1] for r in own[smaller]]
        if not refs:
            sizes = ", ".join(f"{b}: {len(own[b])}" for b in order)
            raise CalibrationError(
                f"{config.model.name}: no calibration sample fits bucket "
                f"{plan.bucket(name).describe()} (samples per bucket: {sizes}).",
                tip="Add calibration samples as small as that bucket, or drop the bucket size.",
            )
        calib_refs[name] = refs

    q = config.quantization
    overrides = dict(q.overrides.tensors)
    qdq_paths = {name: bucket_folder(folder, name) / "qdq.onnx" for name in order}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="buckets-", dir=folder) as tmp_text:
        tmp = Path(tmp_text)
        caches = []
        for name in order:
            cache = tmp / f"ranges_{name}.json"
            samples = BucketSamples(source_samples, router, calib_refs[name])
            _quantize_once(
                config,
                floats[name],
                tmp / f"calibrated_{name}.onnx",
                samples,
                cache,
                overrides,
                q.overrides.op_types,
            )
            caches.append(cache)
        merged = folder / RANGES_FILE
        with atomic_path(merged) as merged_tmp:
            merged_tmp.unlink()
            tensors = merge_ranges(caches, merged_tmp)
        timings["calibrate"] = time.perf_counter() - t0

        t0 = time.perf_counter()

        def quantize(name: str, extra: dict[str, str]) -> None:
            _quantize_once(
                config, floats[name], qdq_paths[name], [], merged, extra, q.overrides.op_types
            )

        for name in order:
            quantize(name, overrides)
        mixed: dict[str, Any] = {}
        heldout_dirs = {n: bucket_folder(folder, n) / "heldout" for n in order}
        probe = max(order, key=lambda n: (held_counts[n], order.index(n)))
        if q.auto_mixed_precision and held_counts[probe]:
            import inspect

            from .mixed_precision import raise_precision

            arguments: dict[str, Any] = {
                "config": config,
                "float_path": floats[probe],
                "qdq_path": qdq_paths[probe],
                "heldout": heldout_dirs[probe],
                "base_overrides": overrides,
                "requantize": lambda extra: quantize(probe, extra),
            }
            # Newer versions also take the calibration samples (under one of these names).
            for key in ("calibration", "calib"):
                if key in inspect.signature(raise_precision).parameters:
                    arguments[key] = BucketSamples(source_samples, router, calib_refs[probe])
            mixed = raise_precision(**arguments)
            raised = {
                t["name"]: "int16" if t["kind"] == "weight" else "uint16"
                for t in mixed.get("tensors", [])
            }
            if raised:  # the same choices in every bucket, so the weights stay identical
                mixed["bucket"] = probe
                for name in order:
                    if name != probe:
                        quantize(name, {**overrides, **raised})
    timings["quantize"] = time.perf_counter() - t0

    identity = weight_identity(qdq_paths)
    t0 = time.perf_counter()
    from .quantize import evaluate

    per_bucket = {
        name: evaluate(floats[name], qdq_paths[name], heldout_dirs[name])
        if held_counts[name]
        else {}
        for name in order
    }
    end_to_end = evaluate_end_to_end(config, source, plan, floats, qdq_paths, folder)
    timings["evaluate"] = time.perf_counter() - t0
    worst_each = [worst_snr(v) for v in per_bucket.values() if v]
    worst = min(worst_each) if worst_each else float("nan")
    largest_eval = per_bucket[plan.largest.name] or next((v for v in per_bucket.values() if v), {})
    report = {
        "model": dataclasses.asdict(config.model),
        "config": str(config.path),
        "inputs": inputs,
        "prepare": [
            {"step": c.step, "details": list(c.details)} for c in changes[plan.largest.name]
        ],
        "graph": {
            "inputs": [s.describe() for s in largest_specs],
            "source_bytes": config.source_path.stat().st_size,
            "qdq_bytes": {n: qdq_paths[n].stat().st_size for n in order},
        },
        "calibration": {
            "kind": config.calibration.kind,
            "samples": len(source_samples.calib),
            "heldout": len(source_samples.held),
            "per_bucket": {n: len(own[n]) for n in order},
            "fallback_buckets": [n for n in order if fallback[n]],
            "merged_tensors": tensors,
        },
        "quantization": {
            "activation_type": q.activation_type,
            "weight_type": q.weight_type,
            "per_channel": q.per_channel,
            "method": q.method,
            "overrides": dataclasses.asdict(q.overrides),
            "mixed_precision": mixed,
        },
        "buckets": {
            "names": order,
            "shapes": {b.name: {k: list(v) for k, v in b.shapes.items()} for b in plan.buckets},
            "heldout": held_counts,
            "heldout_from_calibration": borrowed,
            "pads": [dataclasses.asdict(p) for p in plan.pads],
            "crops": [dataclasses.asdict(c) for c in plan.crops],
            "weights": identity,
        },
        "accuracy": {
            "qdq_vs_float": largest_eval,
            "per_bucket": per_bucket,
            "worst_snr_db": worst,
            "end_to_end": end_to_end,
        },
        "timings_s": timings,
    }
    return report, plan, qdq_paths


def fit_crops(config: ModelConfig, source: Any, plan: bk.BucketPlan) -> bk.BucketPlan:
    """Measure how long each cropped output is for inputs of many sizes (the source model on the
    CPU EP), and fit the length rule the runtime crops with; a ModelError when none fits."""
    if not plan.crops:
        return plan
    import fractions

    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(
            source.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
    except Exception as exc:
        raise ModelError(
            f"{config.model.name}: the source model does not load on the CPU EP ({exc}), so the "
            "lengths of the outputs in [buckets] outputs cannot be measured.",
            tip="Remove [buckets] outputs: the runtime then returns the padded outputs as they are.",
        ) from None
    types = {i.name: _np(i.type) for i in session.get_inputs()}
    constants = {
        name: np.asarray(value, dtype=types.get(name, np.float32))
        for name, value in config.inputs.constants.items()
        if name in types
    }
    outputs = [o.name for o in session.get_outputs()]
    smallest, largest = plan.buckets[0], plan.largest
    rng = np.random.default_rng(config.calibration.seed)
    fitted = []
    for crop in plan.crops:
        axes = [r for r in plan.pads if r.dim == crop.dim]
        top = max(largest.shapes[r.input][r.axis] for r in axes)
        sizes = {b.shapes[crop.input][crop.input_axis] for b in plan.buckets}
        ratio = fractions.Fraction(1)
        measured: dict[int, int] = {}

        def length(size: int, crop: bk.CropRule = crop, axes: list = axes) -> int | None:
            return _output_length(session, smallest, axes, crop, size, types, constants)

        top_length = length(top)
        if top_length is None or crop.output not in outputs:
            raise ModelError(
                f"{config.model.name}: the source model does not run at the largest bucket's "
                f"size ({crop.dim} = {top}), so the length of {crop.output!r} cannot be measured.",
                tip="Remove it from [buckets] outputs.",
            )
        ratio = fractions.Fraction(top_length, top)
        probes = set(range(1, min(top, 2 * ratio.denominator + 2) + 1))
        probes |= {n + d for n in sizes for d in (-1, 0, 1) if 1 <= n + d <= top}
        probes |= {int(n) for n in rng.integers(1, top + 1, 8)}
        for size in sorted(probes):
            got = length(size)
            if got is not None:
                measured[size] = got
        rule = bk.fit_length_rule(measured, ratio.numerator, ratio.denominator)
        if rule is None:
            shown = ", ".join(f"{n}->{m}" for n, m in list(measured.items())[:12])
            raise ModelError(
                f"{config.model.name}: the length of output {crop.output!r} axis {crop.axis} does "
                f"not follow {crop.dim} by a stride rule (measured {crop.dim} -> length: {shown}).",
                tip="Remove it from [buckets] outputs: the runtime then returns it uncropped.",
            )
        fitted.append(
            dataclasses.replace(
                crop, num=ratio.numerator, den=ratio.denominator, add=rule[0], shift=rule[1]
            )
        )
    return dataclasses.replace(plan, crops=fitted)


def _output_length(
    session: Any,
    smallest: bk.Bucket,
    axes: list[bk.PadRule],
    crop: bk.CropRule,
    size: int,
    types: dict[str, Any],
    constants: Feeds,
) -> int | None:
    """Length of ``crop.output`` along its axis when the followed dim is ``size`` (zeros fed)."""
    feeds = {}
    for name, shape in smallest.shapes.items():
        dims = list(shape)
        for rule in axes:
            if rule.input == name:
                dims[rule.axis] = size
        feeds[name] = np.zeros(dims, dtype=types.get(name, np.float32))
    try:
        values = session.run([crop.output], {**feeds, **constants})
    except Exception:  # too small for the model, say: that size is then not probed
        return None
    return int(np.asarray(values[0]).shape[crop.axis])


HELDOUT_FROM_CALIBRATION = 8  # samples that validate a bucket no held-out sample fits


def _write_heldout(
    folder: Path,
    plan: bk.BucketPlan,
    source: RawSource,
    router: BucketRouter,
    calib_by_bucket: dict[str, list[Any]],
) -> tuple[dict[str, int], list[str]]:
    """Held-out samples at their true size, and padded into every bucket that holds them.

    A bucket's graph must be right for any input padded into it, so it is validated (compile
    stage) on every held-out sample that fits, not only on those it is the smallest bucket for.
    A bucket that no held-out sample fits is validated on calibration samples that fit, and the
    report says so. Returns the count per bucket and those buckets.
    """
    order = [b.name for b in plan.buckets]
    counts = {name: 0 for name in order}
    borrowed: list[str] = []
    with atomic_dir(folder / TRUE_HELDOUT) as true_dir:
        index_rows = []
        staged: dict[str, Path] = {}
        try:
            for name in order:
                staged[name] = Path(
                    tempfile.mkdtemp(prefix=".heldout-", dir=bucket_folder(folder, name))
                )

            def stage(own: Feeds, first: int, only: str | None = None) -> None:
                for bucket in plan.buckets[first:]:
                    if only is not None and bucket.name != only:
                        continue
                    feeds = {
                        name: bk.pad_input(array, bucket.shapes[name], router.rules.get(name, []))[
                            0
                        ]
                        for name, array in own.items()
                    }
                    feeds = _complete(feeds, bucket, router)
                    target = staged[bucket.name] / f"sample_{counts[bucket.name]:04d}.npz"
                    np.savez(target, **feeds)
                    counts[bucket.name] += 1

            for number, (ref, sample) in enumerate(source.iterate(source.held)):
                bucket, _, own = router.route(sample, source.describe(ref), _index(ref))
                np.savez(true_dir / f"sample_{number:04d}.npz", **own)
                index_rows.append({"sample": number, "bucket": bucket.name})
                stage(own, order.index(bucket.name))
            for index, name in enumerate(order):
                if counts[name]:
                    continue
                borrowed.append(name)
                refs = [r for smaller in order[: index + 1] for r in calib_by_bucket[smaller]]
                refs = refs[:HELDOUT_FROM_CALIBRATION]
                for ref, sample in source.iterate(refs):
                    _, _, own = router.route(sample, source.describe(ref), _index(ref))
                    stage(own, index, only=name)
            (true_dir / "index.json").write_text(json.dumps(index_rows, indent=1), "utf-8")
            for name, staged_dir in staged.items():
                target = bucket_folder(folder, name) / "heldout"
                with atomic_dir(target) as tmp_dir:
                    for path in sorted(staged_dir.glob("*.npz")):
                        path.rename(tmp_dir / path.name)
        finally:
            import shutil

            for staged_dir in staged.values():
                shutil.rmtree(staged_dir, ignore_errors=True)
    return counts, borrowed


def _complete(feeds: Feeds, bucket: bk.Bucket, router: BucketRouter) -> Feeds:
    """Inputs a sample does not give, filled at the bucket's shape (zeros)."""
    for name, shape in bucket.shapes.items():
        if name not in feeds:
            feeds[name] = np.zeros(shape, dtype=router.dtypes[name])
    return feeds


def evaluate_end_to_end(
    config: ModelConfig,
    source: Any,
    plan: bk.BucketPlan,
    floats: dict[str, Path],
    qdq_paths: dict[str, Path],
    folder: Path,
) -> dict[str, Any]:
    """What the runtime will deliver: pad into the bucket, run, crop; vs the source at true size.

    ``bucketed_float`` isolates what padding alone changes (a property of the model: a causal
    model is unaffected, a bidirectional one sees the padding); ``bucketed_qdq`` adds quantization.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    cpu = ["CPUExecutionProvider"]
    try:
        reference = ort.InferenceSession(source.SerializeToString(), options, providers=cpu)
    except Exception as exc:  # a source ORT cannot run at dynamic size: no figure, say why
        return {"error": f"the source model does not run on the CPU EP: {exc}"[:300]}
    qdq = {n: ort.InferenceSession(str(p), options, providers=cpu) for n, p in qdq_paths.items()}
    flt = {n: ort.InferenceSession(str(p), options, providers=cpu) for n, p in floats.items()}
    rules: dict[str, list[bk.PadRule]] = {}
    for rule in plan.pads:
        rules.setdefault(rule.input, []).append(rule)
    constants = {
        i.name: np.asarray(config.inputs.constants[i.name], dtype=_np(i.type))
        for i in reference.get_inputs()
        if i.name in config.inputs.constants
    }
    names = [o.name for o in reference.get_outputs()]
    vs_qdq, vs_float = OutputComparison(), OutputComparison()
    failures = mismatched = 0
    for path in sorted((folder / TRUE_HELDOUT).glob("sample_*.npz")):
        with np.load(path, allow_pickle=False) as data:
            own = {k: data[k] for k in data.files}
        bucket = bk.choose_bucket(plan.buckets, plan.pads, {k: v.shape for k, v in own.items()})
        types = {i.name: _np(i.type) for i in qdq[bucket.name].get_inputs()}
        feeds = {
            name: bk.pad_input(own[name], shape, rules.get(name, []))[0]
            if name in own
            else np.zeros(shape, types.get(name, np.float32))
            for name, shape in bucket.shapes.items()
        }
        try:
            expected = dict(zip(names, reference.run(names, {**own, **constants}), strict=True))
        except Exception:
            failures += 1
            continue
        got_q = bk.crop_outputs(
            plan.pads, plan.crops, bucket, own, _run(qdq[bucket.name], names, feeds)
        )
        got_f = bk.crop_outputs(
            plan.pads, plan.crops, bucket, own, _run(flt[bucket.name], names, feeds)
        )
        same = {n for n in names if expected[n].shape == got_q[n].shape}
        mismatched += len(names) - len(same)
        vs_qdq.add({n: expected[n] for n in same}, {n: got_q[n] for n in same})
        vs_float.add({n: expected[n] for n in same}, {n: got_f[n] for n in same})
    result: dict[str, Any] = {
        "samples": vs_qdq.samples,
        "bucketed_qdq_vs_source_float": vs_qdq.summary(),
        "bucketed_float_vs_source_float": vs_float.summary(),
    }
    if failures:
        result["source_failures"] = failures
    if mismatched:  # a cropped output whose length differs from the true-size run
        result["shape_mismatches"] = mismatched
    return result


def _np(onnx_type: str) -> Any:
    return {"tensor(int64)": np.int64, "tensor(int32)": np.int32}.get(onnx_type, np.float32)


def _run(session: Any, names: list[str], feeds: Feeds) -> Feeds:
    outputs = [o.name for o in session.get_outputs()]
    values = session.run(None, feeds)
    by_name = dict(zip(outputs, values, strict=True))
    if all(n in by_name for n in names):
        return {n: by_name[n] for n in names}
    return dict(zip(names, values, strict=False))  # renamed outputs: pair by position


def write_bucket_report(folder: Path, report: dict[str, Any]) -> Path:
    name = report["model"]["name"]
    b = report["buckets"]
    acc = report["accuracy"]
    weights = b["weights"]
    rows = []
    for bucket in b["names"]:
        per = acc["per_bucket"].get(bucket) or {}
        rows.append(
            [
                bucket,
                "; ".join(f"{k} {v}" for k, v in b["shapes"][bucket].items()),
                report["calibration"]["per_bucket"][bucket],
                "yes" if bucket in report["calibration"]["fallback_buckets"] else "no",
                f"{b['heldout'][bucket]}"
                + (" (calibration)" if bucket in b.get("heldout_from_calibration", []) else ""),
                worst_snr(per) if per else None,
                report["graph"]["qdq_bytes"][bucket],
            ]
        )
    e2e = acc.get("end_to_end") or {}
    e2e_rows = [
        [out, v.get("snr_db"), fmt(v.get("max_abs"), 5), fmt(v.get("cosine"), 5)]
        for out, v in (e2e.get("bucketed_qdq_vs_source_float") or {}).items()
    ]
    pad_rows = [[p["dim"], f"{p['input']}[{p['axis']}]", p["value"], p["side"]] for p in b["pads"]]
    crop_rows = [
        [c["output"], c["axis"], f"{c['input']}[{c['input_axis']}] ({c['dim']})"]
        for c in b["crops"]
    ]
    lines = [
        f"# Quantization report: {name} {report['model']['version']} ({len(b['names'])} buckets)",
        "",
        f"Source: `{report['inputs']['source']}` "
        f"(sha256 `{report['inputs']['source_sha256'][:16]}…`)",
        f"Config: `{report['config']}`",
        "",
        "One calibration over samples of varied size, each padded into the smallest bucket that "
        "holds it; the ranges of all buckets are merged, so every bucket is quantized with the "
        "same parameters. Held-out: every held-out sample that fits a bucket, padded into it.",
        "",
        "## Buckets",
        "",
        table(
            [
                "bucket",
                "shapes",
                "calibration samples",
                "fallback",
                "held-out",
                "SNR QDQ vs float dB",
                "QDQ bytes",
            ],
            rows,
        ),
        "",
        "Padding (into the bucket):",
        "",
        table(["dim", "axis", "value", "side"], pad_rows) if pad_rows else "none",
        "",
        "Outputs cropped back to the true size:",
        "",
        table(["output", "axis", "follows"], crop_rows) if crop_rows else "none",
        "",
        f"Weights: {weights['shared_initializers']} initializers "
        f"({weights['shared_bytes']:,} bytes) byte-identical in every bucket; "
        f"{len(weights['bucket_specific_initializers'])} bucket-specific "
        f"({weights['bucket_specific_bytes']:,} bytes).",
        "",
        "## End to end: pad, run the bucket's QDQ model (CPU EP), crop; vs the source model at "
        f"the true size ({e2e.get('samples', 0)} held-out samples)",
        "",
        table(["output", "SNR dB", "max abs", "cosine"], e2e_rows) if e2e_rows else "-",
    ]
    if e2e.get("bucketed_float_vs_source_float"):
        pad_only = worst_snr(e2e["bucketed_float_vs_source_float"])
        lines += ["", f"Padding alone (float model): worst SNR {fmt(pad_only)} dB vs true size."]
    mixed = report["quantization"].get("mixed_precision") or {}
    if mixed.get("tensors"):
        lines += [
            "",
            f"Mixed precision (chosen on bucket {mixed.get('bucket')}, applied to all): "
            f"{len(mixed['tensors'])} tensor(s) at 16 bit.",
        ]
    gate = report.get("gate")
    if gate:
        verdict = "passed" if gate["passed"] else "FAILED"
        lines += ["", f"Gate: min SNR {gate['min_snr_db']} dB (worst bucket) — {verdict}."]
    timings = report["timings_s"]
    lines += ["", "Timings: " + ", ".join(f"{k} {v:.2f} s" for k, v in timings.items())]
    return write_report(folder, "\n".join(lines), report)
