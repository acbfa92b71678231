"""Stage 1: float ONNX -> prepared static float model -> calibrated QDQ model + accuracy report.

Outputs per model, in ``<artifacts>/build/<name>/``: ``float.onnx`` (prepared), ``qdq.onnx``,
``heldout/sample_NNNN.npz`` (held-out feeds for the compile stage's validation), ``report.md``,
``report.json`` and ``record.json`` (written last: no record, no valid build).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .config import EXAMPLE_CONFIGS, ModelConfig, load_config
from .errors import CalibrationError, GateError, ModelError, PipelineError
from .fileio import atomic_dir, atomic_path, sha256_file
from .metrics import OutputComparison, worst_snr
from .records import RECORD_FILE, folder_digest, read_record, tool_versions, update_record
from .report import fmt, table, write_report

HELP = """\
Prepare float ONNX models for the NPU and quantize them to QDQ.

For each config: fix every shape, fold constants and `If`s on baked inputs, fold BatchNorm,
upcast float16, apply exact HTP-friendly rewrites, run onnxruntime's QNN preprocessing,
calibrate on real data (streamed, bounded memory), write the QDQ model and a report comparing
it with the float model on held-out samples. With no config, builds the bundled examples
(generated from a seed first if needed).

examples:
  python -m pipeline quantize
  python -m pipeline quantize configs/shared/*.toml
  python -m pipeline quantize configs/example.toml --force
"""

CALIBRATION_CHUNK = 16  # samples whose intermediate outputs are held at once
ORT_QUANT_TYPES = {
    "uint8": "QUInt8",
    "int8": "QInt8",
    "uint16": "QUInt16",
    "int16": "QInt16",
    "uint4": "QUInt4",
    "int4": "QInt4",
}
TOOLS = ("onnx", "onnxruntime", "numpy", "pillow")
# Our modules whose code shapes the QDQ model: editing one of them rebuilds.
CODE = (
    "calibration",
    "config",
    "mixed_precision",
    "prepare",
    "quantize",
    "ranges",
    "transforms",
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("configs", nargs="*", type=Path, help="model configs (TOML)")
    parser.add_argument("--artifacts", type=Path, default=Path("artifacts"), help="output root")
    parser.add_argument("--force", action="store_true", help="rebuild even if nothing changed")


def run(args: argparse.Namespace) -> int:
    configs = list(args.configs)
    if not configs:
        from .example import ensure_bucket_example, ensure_example

        ensure_example(Path("."))
        ensure_bucket_example(Path("."))
        configs = list(EXAMPLE_CONFIGS)
    failures: list[str] = []
    for path in configs:
        config = load_config(path)
        try:
            result = quantize_model(config, args.artifacts, force=args.force)
        except GateError as exc:
            print(f"FAILED {config.model.name}: {exc}")
            failures.append(config.model.name)
            continue
        print(result.summary_line())
    if failures:
        raise GateError(f"{len(failures)} model(s) failed their gate: {', '.join(failures)}.")
    return 0


@dataclasses.dataclass
class QuantizeResult:
    name: str
    folder: Path
    skipped: bool
    report: dict[str, Any]

    def summary_line(self) -> str:
        if self.skipped:
            return f"{self.name}: up to date, nothing to do ({self.folder / 'report.md'})"
        snr = self.report["accuracy"]["worst_snr_db"]
        return f"{self.name}: QDQ written, worst SNR {fmt(snr)} dB -> {self.folder / 'report.md'}"


def build_inputs(config: ModelConfig) -> dict[str, Any]:
    """Everything that determines the build; equal inputs mean the outputs can be reused."""
    source = config.source_path
    calibration = config.resolve(config.calibration.path) if config.calibration.path else None
    reader_file = config.calibration.reader.rpartition(":")[0]
    reader_digest = ""
    if reader_file.endswith(".py") and config.resolve(reader_file).is_file():
        reader_digest = sha256_file(config.resolve(reader_file))
    return {
        "source": str(source),
        "source_sha256": sha256_file(source),
        "config_digest": config.digest(),
        "calibration_digest": folder_digest(calibration) if calibration else "",
        "reader_digest": reader_digest,
        "tools": tool_versions(*TOOLS, code=CODE),
    }


def load_source_model(path: Path) -> Any:
    """Load and sanity-check the float model; a truncated file gets a clear error."""
    import onnx

    if not path.is_file():
        raise ModelError(
            f"Model file {path} does not exist.", tip="Fix model.source in the config."
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
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"Model file {path} is not a valid ONNX model: {first}") from None
    return model


def quantize_model(config: ModelConfig, artifacts: Path, force: bool = False) -> QuantizeResult:
    """Build (or reuse) the QDQ model for one config."""
    if config.buckets.enabled:  # one QDQ model per shape bucket, quantized once
        from .bucket_quantize import quantize_bucketed

        return quantize_bucketed(config, artifacts, force=force)
    folder = artifacts / "build" / config.model.name
    inputs = build_inputs(config)
    record = read_record(folder)
    outputs_present = all((folder / f).is_file() for f in ("qdq.onnx", "float.onnx", "report.json"))
    quantize_record = record.get("quantize", {})
    if (
        not force
        and outputs_present
        and quantize_record.get("inputs") == inputs
        and quantize_record.get("status") == "ok"
    ):
        import json

        report = json.loads((folder / "report.json").read_text("utf-8"))
        return QuantizeResult(config.model.name, folder, True, report)

    # Invalidate first: a build killed from here on leaves no record that claims success.
    (folder / RECORD_FILE).unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report = _build(config, folder, inputs)
    report["timings_s"]["total"] = time.perf_counter() - started
    _write_quantize_report(folder, report)
    passed = apply_gate(config, report)
    update_record(
        folder,
        "quantize",
        {
            **record_head(config, inputs, passed),
            "qdq_sha256": sha256_file(folder / "qdq.onnx"),
            "float_sha256": sha256_file(folder / "float.onnx"),
            "summary": _summary(report),
        },
    )
    _write_quantize_report(folder, report)
    if not passed:
        gate = config.quantization.min_snr_db
        raise GateError(
            f"{config.model.name}: worst QDQ vs float SNR {fmt(report['accuracy']['worst_snr_db'])} "
            f"dB is below quantization.min_snr_db = {gate} ({folder / 'report.md'}).",
            tip="Use 16-bit types or overrides for the worst tensors, or more calibration data.",
        )
    return QuantizeResult(config.model.name, folder, False, report)


def apply_gate(config: ModelConfig, report: dict[str, Any]) -> bool:
    """Whether the worst QDQ vs float SNR clears quantization.min_snr_db; the report says it."""
    gate = config.quantization.min_snr_db
    passed = gate <= 0 or report["accuracy"]["worst_snr_db"] >= gate
    report["gate"] = {"min_snr_db": gate, "passed": passed}
    return passed


def record_head(config: ModelConfig, inputs: dict[str, Any], passed: bool) -> dict[str, Any]:
    """What every quantize record starts with: the outcome, what it was built from, the model."""
    return {
        "status": "ok" if passed else "failed",
        "inputs": inputs,
        "model": dataclasses.asdict(config.model),
    }


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    """The short quantization summary that the release manifest carries."""
    return {
        "activation_type": report["quantization"]["activation_type"],
        "weight_type": report["quantization"]["weight_type"],
        "method": report["quantization"]["method"],
        "calibration_samples": report["calibration"]["samples"],
        "heldout_samples": report["calibration"]["heldout"],
        "worst_snr_db": report["accuracy"]["worst_snr_db"],
        "outputs": report["accuracy"]["qdq_vs_float"],
        "prepare_steps": [c["step"] for c in report["prepare"] if c["details"]],
        "mixed_precision": report["quantization"].get("mixed_precision", {}),
    }


def _build(config: ModelConfig, folder: Path, inputs: dict[str, Any]) -> dict[str, Any]:
    import onnx

    from .calibration import build_samples, input_specs
    from .prepare import prepare_model

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    source = load_source_model(config.source_path)
    try:
        prepared, changes = prepare_model(source, config.inputs)
    except PipelineError:
        raise
    except Exception as exc:
        raise ModelError(
            f"{config.model.name}: preparing {config.source_path} failed: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    timings["prepare"] = time.perf_counter() - t0
    with atomic_path(folder / "float.onnx") as tmp:
        onnx.save(prepared, str(tmp))
    float_path = folder / "float.onnx"

    specs = input_specs(prepared)
    calib, held = build_samples(config, specs, float_model_path=float_path)
    if len(calib) == 0:
        raise CalibrationError(f"{config.model.name}: no calibration samples were selected.")

    # Held-out feeds go to disk for the compile stage (validation against float and QDQ).
    with atomic_dir(folder / "heldout") as tmp_dir:
        for index, feeds in enumerate(held):
            np.savez(tmp_dir / f"sample_{index:04d}.npz", **feeds)

    t0 = time.perf_counter()
    mixed, range_changes = _quantize(config, float_path, folder / "qdq.onnx", calib, folder, held)
    timings["quantize"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    accuracy = evaluate(float_path, folder / "qdq.onnx", folder / "heldout")
    fidelity = _prepare_fidelity(config, source, float_path, folder / "heldout")
    timings["evaluate"] = time.perf_counter() - t0
    q = config.quantization
    return {
        "model": dataclasses.asdict(config.model),
        "config": str(config.path),
        "inputs": inputs,
        "prepare": [{"step": c.step, "details": list(c.details)} for c in changes],
        "graph": {
            "inputs": [s.describe() for s in specs],
            "float_nodes": len(prepared.graph.node),
            "float_bytes": float_path.stat().st_size,
            "qdq_bytes": (folder / "qdq.onnx").stat().st_size,
            "source_bytes": config.source_path.stat().st_size,
        },
        "calibration": {
            "kind": config.calibration.kind,
            "samples": len(calib),
            "heldout": len(held),
            "chunk": CALIBRATION_CHUNK,
        },
        "quantization": {
            "activation_type": q.activation_type,
            "weight_type": q.weight_type,
            "per_channel": q.per_channel,
            "method": q.method,
            "overrides": dataclasses.asdict(q.overrides),
            "mixed_precision": mixed,
            "range_rules": range_changes,
        },
        "accuracy": {
            "qdq_vs_float": accuracy,
            "worst_snr_db": worst_snr(accuracy) if accuracy else float("nan"),
            "prepared_vs_source": fidelity,
        },
        "timings_s": timings,
    }


class _StreamingReader:
    """An onnxruntime CalibrationDataReader over a SampleSet that never holds more than a chunk.

    onnxruntime's ``CalibStridedMinMax`` calls ``set_range`` and ``collect_data`` once per
    chunk and merges the ranges, so only one chunk of intermediate outputs is alive at a time.
    (Its ``CalibMaxIntermediateOutputs`` option drops collected data instead; not used.)
    """

    def __init__(self, samples: Any, chunk: int, progress: Any = None) -> None:
        self._samples = samples
        self._chunk = chunk
        self._iter: Iterator[dict[str, np.ndarray]] = iter(samples)
        self._left = 0
        self._progress = progress

    def __len__(self) -> int:  # rounded up to whole chunks; the last chunk is shorter
        return -(-len(self._samples) // self._chunk) * self._chunk

    def set_range(self, start_index: int, end_index: int) -> None:
        self._left = end_index - start_index

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._left <= 0:
            return None
        self._left -= 1
        sample = next(self._iter, None)
        if sample is not None and self._progress is not None:
            self._progress.update(1)
        return sample

    def rewind(self) -> None:
        self._iter = iter(self._samples)


def _progress(total: int, desc: str) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a build dependency
        return None
    return tqdm(total=total, desc=desc, unit="sample", leave=False)


def _quantize(
    config: ModelConfig, float_path: Path, qdq_path: Path, calib: Any, folder: Path, held: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Calibrate once (ranges cached), quantize, and raise precision where SNR is too low.

    Returns the mixed-precision summary and what the range rules (pipeline.ranges) changed.
    """
    import tempfile

    q = config.quantization
    with tempfile.TemporaryDirectory(prefix="qdq-", dir=folder) as tmp:
        cache = Path(tmp) / "ranges.json"
        overrides = dict(q.overrides.tensors)
        range_changes = _quantize_once(
            config, float_path, qdq_path, calib, cache, overrides, q.overrides.op_types
        )
        mixed: dict[str, Any] = {}
        if q.auto_mixed_precision and len(held):
            from .mixed_precision import raise_precision

            mixed = raise_precision(
                config,
                float_path,
                qdq_path,
                folder / "heldout",
                calib,
                overrides,
                lambda extra: _quantize_once(
                    config, float_path, qdq_path, calib, cache, extra, q.overrides.op_types
                ),
            )
    return mixed, range_changes


def _quantize_once(
    config: ModelConfig,
    float_path: Path,
    qdq_path: Path,
    calib: Any,
    cache: Path,
    tensor_overrides: dict[str, str],
    op_type_overrides: dict[str, str],
) -> dict[str, Any]:
    """Quantize with the calibrated ranges of ``cache`` (calibrating first if it is absent).

    The raw MinMax ranges are tuned by ``pipeline.ranges`` (cut to the values that matter,
    a margin where resolution allows, int32-bias floor) into a second cache that the quantizer
    reads; returns what changed.
    """
    import json

    import onnx

    from . import ranges

    q = config.quantization
    model = onnx.load(str(float_path))
    stats = cache.with_name("rms_" + cache.name)
    if not cache.is_file():
        _run_quantizer(
            config, float_path, qdq_path, calib, cache, model, tensor_overrides, op_type_overrides
        )
    if stats.is_file():
        rms = json.loads(stats.read_text("utf-8"))
    else:  # no samples (a cache from elsewhere): no statistics, so no margins
        _, calibrated = ranges.read_cache(cache)
        rms = ranges.activation_rms(model, calib, sorted(calibrated))
        if rms:
            stats.write_text(json.dumps(rms), "utf-8")
    tensor_types = dict(tensor_overrides)
    for node in model.graph.node:
        if node.op_type in op_type_overrides:
            for output in node.output:
                tensor_types.setdefault(output, op_type_overrides[node.op_type])
    tuned = cache.with_name("tuned_" + cache.name)
    try:
        changes = ranges.tune(
            model,
            cache,
            tuned,
            q.activation_type,
            q.weight_type,
            q.per_channel,
            tensor_types,
            rms,
        )
    except Exception as exc:
        raise ModelError(
            f"{config.model.name}: tuning the calibrated ranges failed: "
            f"{type(exc).__name__}: {exc}",
            tip="Report this model; see artifacts/build/<model>/float.onnx.",
        ) from exc
    _run_quantizer(
        config,
        float_path,
        qdq_path,
        calib,
        tuned,
        model,
        tensor_overrides,
        op_type_overrides,
        changes.weight_ranges,
    )
    return changes.to_dict()


def _run_quantizer(
    config: ModelConfig,
    float_path: Path,
    qdq_path: Path,
    calib: Any,
    cache: Path,
    model: Any,
    tensor_overrides: dict[str, str],
    op_type_overrides: dict[str, str],
    weight_ranges: dict[str, tuple[float, float]] | None = None,
) -> None:
    """One onnxruntime ``quantize_static`` run; it calibrates only when ``cache`` is absent.

    ``weight_ranges`` overrides the float range onnxruntime quantizes a weight over.
    """
    from onnxruntime.quantization import CalibrationMethod, QuantType, quantize_static
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    q = config.quantization
    init_overrides = _tensor_overrides(model, tensor_overrides, op_type_overrides)
    for name, (low, high) in (weight_ranges or {}).items():
        entry = init_overrides.setdefault(name, [{}])[0]
        entry.update(rmin=np.array(low, np.float32), rmax=np.array(high, np.float32))
    progress = None if cache.is_file() else _progress(len(calib), f"calibrate {config.model.name}")
    reader = _StreamingReader(calib, CALIBRATION_CHUNK, progress)
    # onnxruntime's quantizer logs advice ("consider pre-processing", opset upgrades) on the
    # root logger; our own preparation already did that work, so keep the console readable.
    root_logger = logging.getLogger()
    previous_level = root_logger.level
    root_logger.setLevel(logging.ERROR)
    try:
        qconfig = get_qnn_qdq_config(
            str(float_path),
            reader,
            calibrate_method=getattr(CalibrationMethod, q.method),
            activation_type=getattr(QuantType, ORT_QUANT_TYPES[q.activation_type]),
            weight_type=getattr(QuantType, ORT_QUANT_TYPES[q.weight_type]),
            per_channel=q.per_channel,
            init_overrides=init_overrides or None,
        )
        extra = dict(qconfig.extra_options)
        extra["CalibStridedMinMax"] = CALIBRATION_CHUNK
        with atomic_path(qdq_path) as tmp:
            quantize_static(
                str(float_path),
                str(tmp),
                calibration_data_reader=reader,
                quant_format=qconfig.quant_format,
                op_types_to_quantize=qconfig.op_types_to_quantize,
                per_channel=qconfig.per_channel,
                activation_type=qconfig.activation_type,
                weight_type=qconfig.weight_type,
                nodes_to_exclude=qconfig.nodes_to_exclude,
                calibrate_method=qconfig.calibrate_method,
                calibration_providers=["CPUExecutionProvider"],
                extra_options=extra,
                calibration_cache_path=str(cache),
            )
            _fix_ir_version(tmp)
    except PipelineError:
        raise
    except Exception as exc:
        raise ModelError(
            f"{config.model.name}: onnxruntime quantization failed: {type(exc).__name__}: {exc}",
            tip="See the prepared model artifacts/build/<model>/float.onnx; report this model.",
        ) from exc
    finally:
        root_logger.setLevel(previous_level)
        if progress is not None:
            progress.close()


def _tensor_overrides(
    model: Any, tensors: dict[str, str], op_types: dict[str, str]
) -> dict[str, list[dict[str, Any]]]:
    """Config overrides -> onnxruntime ``TensorQuantOverrides`` (activation outputs of nodes)."""
    from onnxruntime.quantization import QuantType

    weights = {i.name for i in model.graph.initializer}
    known = {o for n in model.graph.node for o in n.output} | {i.name for i in model.graph.input}
    known |= weights
    unknown = sorted(set(tensors) - known)
    if unknown:
        raise ModelError(
            f"quantization.overrides.tensors names tensor(s) {unknown[:5]} that the prepared "
            "model does not have.",
            tip="Use tensor names from artifacts/build/<model>/float.onnx.",
        )
    result: dict[str, list[dict[str, Any]]] = {}
    for name, qtype in tensors.items():
        entry: dict[str, Any] = {"quant_type": getattr(QuantType, ORT_QUANT_TYPES[qtype])}
        if name in weights and qtype.startswith("int"):
            entry["symmetric"] = True  # QNN HTP wants signed weights symmetric
        result[name] = [entry]
    for node in model.graph.node:
        if node.op_type in op_types:
            for output in node.output:
                result.setdefault(
                    output,
                    [{"quant_type": getattr(QuantType, ORT_QUANT_TYPES[op_types[node.op_type]])}],
                )
    return result


def _fix_ir_version(path: Path) -> None:
    """onnx writes the newest IR version; keep one that the installed onnxruntime accepts."""
    import onnx

    model = onnx.load(str(path))
    if model.ir_version > 10:
        model.ir_version = 10
        onnx.save(model, str(path))


def iter_heldout(folder: Path) -> Iterator[dict[str, np.ndarray]]:
    for path in sorted(folder.glob("sample_*.npz")):
        with np.load(path, allow_pickle=False) as data:
            yield {k: data[k] for k in data.files}


def evaluate(reference_model: Path, test_model: Path, heldout: Path) -> dict[str, dict[str, float]]:
    """Per output SNR / max abs / cosine of ``test_model`` against ``reference_model`` (CPU EP)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    ref = ort.InferenceSession(str(reference_model), options, providers=["CPUExecutionProvider"])
    test = ort.InferenceSession(str(test_model), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in ref.get_outputs()]
    comparison = OutputComparison()
    for feeds in iter_heldout(heldout):
        expected = dict(zip(names, ref.run(names, feeds), strict=True))
        got = dict(zip(names, test.run(names, feeds), strict=True))
        comparison.add(expected, got)
    return comparison.summary()


def _prepare_fidelity(
    config: ModelConfig, source: Any, float_path: Path, heldout: Path
) -> dict[str, dict[str, float]]:
    """Prepared float model vs the source model: preparation must not change the results."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        src = ort.InferenceSession(
            source.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
    except Exception:  # a source ORT cannot load at all is still preparable; no figure then
        return {}
    prep = ort.InferenceSession(str(float_path), options, providers=["CPUExecutionProvider"])
    src_inputs = {i.name: i.type for i in src.get_inputs()}
    prep_names = [o.name for o in prep.get_outputs()]
    comparison = OutputComparison()
    for feeds in iter_heldout(heldout):
        src_feeds = {}
        for name, kind in src_inputs.items():
            if name in feeds:
                value = feeds[name]
                src_feeds[name] = value.astype(np.float16) if kind == "tensor(float16)" else value
            elif name in config.inputs.constants:
                dtype = {"tensor(int64)": np.int64, "tensor(int32)": np.int32}.get(kind, np.float32)
                src_feeds[name] = np.array(config.inputs.constants[name], dtype=dtype)
            else:
                return {}
        try:
            src_out = src.run(None, src_feeds)
        except Exception:
            return {}
        expected = {
            o.name: v
            for o, v in zip(src.get_outputs(), src_out, strict=True)
            if o.name in prep_names
        }
        got = dict(zip(prep_names, prep.run(prep_names, feeds), strict=True))
        comparison.add(expected, {k: got[k] for k in expected})
    return comparison.summary()


def _write_quantize_report(folder: Path, report: dict[str, Any]) -> None:
    name = report["model"]["name"]
    acc = report["accuracy"]
    lines = [
        f"# Quantization report: {name} {report['model']['version']}",
        "",
        f"Source: `{report['inputs']['source']}` (sha256 `{report['inputs']['source_sha256'][:16]}…`)",
        f"Config: `{report['config']}`",
        "",
        "## Graph preparation",
        "",
        table(
            ["step", "changes", "what"],
            [
                [
                    c["step"],
                    len(c["details"]),
                    "; ".join(c["details"][:3]) + (" …" if len(c["details"]) > 3 else ""),
                ]
                for c in report["prepare"]
            ],
        ),
        "",
        "## Quantization",
        "",
        table(
            ["activations", "weights", "per-channel", "method", "calibration", "held-out"],
            [
                [
                    report["quantization"]["activation_type"],
                    report["quantization"]["weight_type"],
                    report["quantization"]["per_channel"],
                    report["quantization"]["method"],
                    f"{report['calibration']['samples']} {report['calibration']['kind']}",
                    report["calibration"]["heldout"],
                ]
            ],
        ),
    ]
    rules = report["quantization"].get("range_rules") or {}
    if rules:
        floors = ", ".join(f"`{f['tensor']}`" for f in rules.get("bias_floor", [])) or "none"
        lines += [
            "",
            f"Calibrated ranges (pipeline/ranges.py): {rules.get('clamped', 0)} cut to what "
            f"their saturating readers can tell apart, {rules.get('widened', 0)} widened for "
            f"unseen values; widened so the int32 biases fit: {floors}.",
        ]
    mixed = report["quantization"].get("mixed_precision") or {}
    if mixed.get("tensors"):
        lines += [
            "",
            f"Mixed precision: raised {len(mixed['tensors'])} tensor(s) to 16 bit; worst SNR "
            f"{fmt(mixed.get('before_snr_db'))} dB -> {fmt(mixed.get('after_snr_db'))} dB. "
            "Chosen by each 8-bit tensor's measured effect on the output (pipeline/"
            "mixed_precision.py); the last column is the output SNR with only that tensor at "
            "8 bit.",
            "",
            table(
                ["tensor", "kind", "to", "output SNR alone (dB)"],
                [
                    [t["name"], t["kind"], t.get("to", ""), t.get("alone_snr_db")]
                    for t in mixed["tensors"][:12]
                ]
                + (
                    [[f"… {len(mixed['tensors']) - 12} more", "", "", ""]]
                    if len(mixed["tensors"]) > 12
                    else []
                ),
            ),
        ]
    lines += [
        "",
        "## Accuracy on held-out samples (CPU EP)",
        "",
        table(
            ["output", "SNR QDQ vs float (dB)", "max abs", "cosine", "prepared vs source SNR (dB)"],
            [
                [
                    out,
                    v["snr_db"],
                    fmt(v["max_abs"], 5),
                    fmt(v["cosine"], 5),
                    acc["prepared_vs_source"].get(out, {}).get("snr_db"),
                ]
                for out, v in acc["qdq_vs_float"].items()
            ],
        ),
    ]
    gate = report.get("gate")
    if gate:
        verdict = "passed" if gate["passed"] else "FAILED"
        lines += ["", f"Gate: min SNR {gate['min_snr_db']} dB — {verdict}."]
    sizes = report["graph"]
    timings = report["timings_s"]
    lines += [
        "",
        f"Sizes: source {sizes['source_bytes']:,} B, prepared float {sizes['float_bytes']:,} B, "
        f"QDQ {sizes['qdq_bytes']:,} B.",
        "Timings: " + ", ".join(f"{k} {v:.2f} s" for k, v in timings.items()),
    ]
    write_report(folder, "\n".join(lines), report)
