"""The static shapes a build makes: one bucket per shape, each prepared from the source model.

A config without ``[buckets]`` is one bucket whose shape is what ``[inputs]`` fixes (the
preparation names every dim left dynamic). With ``[buckets]``, the plan comes from the source
model's declared dims (``pipeline.graph.buckets``), and the length of every output the runtime
crops back is measured on the source model and fitted to an exact rule.
"""

from __future__ import annotations

import dataclasses
import fractions
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from qnn_ctx_runtime.buckets import Bucket, CropRule, PadRule

from ..calibration.samples import InputSpec, input_specs
from ..core.config import InputsSection, ModelConfig
from ..core.cpu import cpu_session
from ..core.dtypes import np_dtype
from ..core.errors import ModelError, PipelineError
from ..core.fileio import atomic_path
from ..core.progress import Progress
from ..graph import buckets as plans
from ..graph.prepare import prepare_model
from ..graph.recurrent import qnn_recurrent_steps
from ..graph.source import onnxruntime_load_error
from ..graph.transforms import Change


@dataclasses.dataclass(frozen=True)
class PreparedBucket:
    """A bucket's prepared float model on disk, its inputs, and what preparation changed."""

    bucket: Bucket
    float_path: Path
    specs: list[InputSpec]
    changes: list[Change]
    nodes: int
    # LSTM/GRU/RNN cells QNN builds (``recurrent.qnn_recurrent_steps``): its compile time limit
    recurrent_steps: int = 0
    # the float model before its channels were balanced (None: not balanced), for fp16
    unbalanced_path: Path | None = None


def signatures(model: Any, constants: dict[str, Any]) -> tuple[plans.Signature, dict[str, Any]]:
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


def _prepare(
    source: Any, inputs: InputsSection, what: str, lstm_nodes: int | None = None
) -> tuple[Any, list[Change]]:
    from ..graph.prepare import preparation_steps

    steps = len(preparation_steps(inputs, lstm_nodes))
    try:
        with Progress(steps, f"prepare {what}", "step") as progress:

            def on_step(name: str) -> None:  # counts the steps started
                progress.update()
                progress.note(name)

            return prepare_model(source, inputs, on_step, lstm_nodes)
    except PipelineError as exc:
        refused = onnxruntime_load_error(source)
        if refused is not None:
            raise _unloadable(what, exc.message, refused) from None
        raise type(exc)(f"{what}: {exc.message}", exc.tip) from None
    except Exception as exc:  # a transform hit a graph it does not know; name the model
        message = f"preparing the model failed: {type(exc).__name__}: {exc}"
        refused = onnxruntime_load_error(source)
        if refused is not None:
            raise _unloadable(what, message, refused) from exc
        raise ModelError(
            f"{what}: {message}",
            tip="Report this model with the traceback of `python -X dev -m pipeline quantize`.",
        ) from exc


def _unloadable(what: str, message: str, refused: str) -> ModelError:
    """A failed preparation of a source that onnxruntime does not load either: the export is
    at fault, not the step that met it, and the error says so first."""
    return ModelError(
        f"{what}: the source model does not load in onnxruntime (CPU EP): {refused}; "
        f"preparing it then failed: {message}",
        tip="Fix the export so that onnxruntime runs the model on the CPU (check it with "
        "onnxruntime.InferenceSession(path)), then build again.",
    )


def lstm_budget(plan: plans.BucketPlan, lstm_nodes: int | None = None) -> int | None:
    """How many nodes the plan's models may add unrolling the LSTMs QNN takes (None: the
    default budget, ``lstm_nodes`` when given): none when several buckets share one context
    (their quantization must agree tensor by tensor, recurrent.py)."""
    return lstm_nodes if len(plan.buckets) == 1 else 0


def prepare_buckets(
    config: ModelConfig, source: Any, float_path_of: Any, lstm_nodes: int | None = None
) -> Iterator[plans.BucketPlan | PreparedBucket]:
    """The plan first, then each bucket prepared and saved to ``float_path_of(bucket name)``;
    ``lstm_nodes``: the LSTM unroll budget of a single-bucket model (``lstm_budget``).

    A generator, so only one prepared model is in memory at a time.
    """
    name = config.model.name
    if not config.buckets.enabled:
        prepared, changes = _prepare(source, config.inputs, name, lstm_nodes)
        specs = input_specs(prepared)
        plan = plans.single_bucket({s.name: s.shape for s in specs})
        yield plan
        yield _save(plan.buckets[0], prepared, changes, specs, float_path_of)
        return
    in_sigs, out_sigs = signatures(source, config.inputs.constants)
    plan = plans.plan_buckets(
        config.buckets, in_sigs, out_sigs, config.inputs.dims, config.inputs.shapes, config.path
    )
    plan = fit_crops(config, source, plan)
    yield plan
    saved = []
    for bucket in plan.buckets:
        section = InputsSection(
            dims=dict(config.inputs.dims),
            shapes={k: list(v) for k, v in bucket.shapes.items()},
            constants=dict(config.inputs.constants),
        )
        what = f"{name} bucket {bucket.describe()}"
        prepared, changes = _prepare(source, section, what, lstm_budget(plan, lstm_nodes))
        saved.append(_save(bucket, prepared, changes, input_specs(prepared), float_path_of))
        del prepared
    renamed = distinct_bucket_constants({b.bucket.name: b.float_path for b in saved})
    for item in saved:
        if renamed.get(item.bucket.name):
            item.changes.append(
                Change("distinct_bucket_constants", (f"{renamed[item.bucket.name]} renamed",))
            )
        yield item


def initializer_digests(model: Any) -> dict[str, str]:
    """Initializer name -> sha256 of the tensor (name, type, shape and bytes)."""
    import hashlib

    return {
        t.name: hashlib.sha256(t.SerializeToString()).hexdigest() for t in model.graph.initializer
    }


def differing(digests: dict[str, dict[str, str]]) -> list[str]:
    """Initializer names with more than one value across the buckets' digests."""
    names = set().union(*(d.keys() for d in digests.values()))
    return sorted(n for n in names if len({d[n] for d in digests.values() if n in d}) > 1)


def distinct_bucket_constants(float_paths: dict[str, Path]) -> dict[str, str]:
    """Give each bucket its own name for a constant whose value depends on the bucket's shape.

    Folding a shape computation (PyTorch exports ``x.view(T, B, -1)`` as Shape -> Gather ->
    Concat -> Reshape) leaves a constant with the same name and a different value in each
    bucket; QNN shares a static tensor between the graphs of one context by name, so such a
    constant becomes ``<name>__<bucket>`` in every bucket (the models on disk are rewritten).
    Returns bucket -> what was renamed, for the report."""
    import onnx

    from ..graph import edit

    if len(float_paths) < 2:
        return {}
    digests = {
        bucket: initializer_digests(onnx.load(str(path))) for bucket, path in float_paths.items()
    }
    clash = differing(digests)
    if not clash:
        return {}
    renamed = {}
    for bucket, path in float_paths.items():
        mine = [n for n in clash if n in digests[bucket]]
        if not mine:
            continue
        model = onnx.load(str(path))
        taken = edit.all_names(model)
        mapping = {}
        for old in mine:
            new, count = f"{old}__{bucket}", 0
            while new in taken:
                count += 1
                new = f"{old}__{bucket}_{count}"
            taken.add(new)
            mapping[old] = new
        edit.rename_tensors(model.graph, mapping)
        with atomic_path(path) as tmp:
            onnx.save(model, str(tmp))
        shown = ", ".join(mine[:6]) + (" …" if len(mine) > 6 else "")
        renamed[bucket] = f"{len(mine)} shape-dependent constant(s) ({shown})"
    return renamed


def _save(
    bucket: Bucket, prepared: Any, changes: list[Change], specs: list[InputSpec], path_of: Any
) -> PreparedBucket:
    import onnx

    path = Path(path_of(bucket.name))
    with atomic_path(path) as tmp:
        onnx.save(prepared, str(tmp))
    return PreparedBucket(
        bucket, path, specs, changes, len(prepared.graph.node), qnn_recurrent_steps(prepared)
    )


def fit_crops(config: ModelConfig, source: Any, plan: plans.BucketPlan) -> plans.BucketPlan:
    """Measure how long each cropped output is for inputs of many sizes (the source model on the
    CPU EP), and fit the length rule the runtime crops with; a ModelError when none fits."""
    if not plan.crops:
        return plan
    from ..graph.source import computes_in_float16

    try:  # a float16 source at the basic level, as graph.source.SourceModel.optimize says
        session = cpu_session(source, optimize=not computes_in_float16(source.graph))
    except Exception as exc:  # onnxruntime's own error types
        raise ModelError(
            f"{config.model.name}: the source model does not load on the CPU EP ({exc}), so the "
            "lengths of the outputs in [buckets] outputs cannot be measured.",
            tip="Remove [buckets] outputs: the runtime then returns the padded outputs as they are.",
        ) from None
    types = {i.name: np_dtype(i.type) for i in session.get_inputs()}
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

        def length(size: int, crop: CropRule = crop, axes: list[PadRule] = axes) -> int | None:
            return _output_length(session, smallest, axes, crop, size, types, constants)

        top_length = length(top)
        if top_length is None or crop.output not in outputs:
            raise ModelError(
                f"{config.model.name}: the source model does not run at the largest bucket's "
                f"size ({crop.dim} = {top}), so the length of {crop.output!r} cannot be measured.",
                tip="Remove it from [buckets] outputs.",
            )
        # The stride is the slope of length against size: top_length / top only when the
        # length has no offset. Unpadded (VALID) convolutions take a few cells off at every
        # size (MTCNN's P-Net: ceil((n - 2) / 2) - 4, 187 at 384): the slope between the largest
        # size and half of it is then the stride, and the offset goes into the rule.
        candidates = [fractions.Fraction(top_length, top)]
        half = top // 2
        half_length = length(half) if half >= 1 else None
        if half_length is not None and top_length > half_length:
            slope = fractions.Fraction(top_length - half_length, top - half).limit_denominator(64)
            if slope not in candidates:
                candidates.append(slope)
        candidates.sort(key=lambda c: c.denominator)
        measured: dict[int, int] = {}
        rule = None
        for ratio in candidates:
            probes = set(range(1, min(top, 2 * ratio.denominator + 2) + 1))
            probes |= {n + d for n in sizes for d in (-1, 0, 1) if 1 <= n + d <= top}
            probes |= {int(n) for n in rng.integers(1, top + 1, 8)}
            for size in sorted(probes - measured.keys()):
                got = length(size)
                if got is not None:
                    measured[size] = got
            rule = plans.fit_length_rule(measured, ratio.numerator, ratio.denominator)
            if rule is not None:
                break
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
    smallest: Bucket,
    axes: list[PadRule],
    crop: CropRule,
    size: int,
    types: dict[str, Any],
    constants: dict[str, np.ndarray],
) -> int | None:
    """Length of ``crop.output`` along its axis when the followed dim is ``size`` (zeros fed)."""
    feeds = {}
    for name, shape in smallest.shapes.items():
        dims = list(shape)
        for rule in axes:
            if rule.input == name:
                dims[rule.axis] = size
        feeds[name] = np.zeros(dims, dtype=types.get(name, np.float32))
    import onnxruntime as ort

    quiet = ort.RunOptions()
    quiet.log_severity_level = 4  # a size too small for the model is expected: not an error
    try:
        values = session.run([crop.output], {**feeds, **constants}, quiet)
    except Exception:  # too small for the model, say: that size is then not probed
        return None
    return int(np.asarray(values[0]).shape[crop.axis])
