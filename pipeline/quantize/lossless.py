"""Preparation must not change what the model computes: check it, and name the step that did.

The prepared float model (one bucket's) is run beside the source model on the same held-out
feeds. Below ``MIN_PREPARED_SNR_DB`` the build fails: a model that is not the user's model
must not ship, however well it then quantizes (an upsampling segmenter's opset upgrade once
gave 13.6 dB and passed every other gate). To name the culprit, the preparation steps
(``pipeline.graph.prepare.preparation_steps``) are run again one at a time from the source,
and every prefix that changed the model is compared with the source on a few of those feeds:
the first step whose prefix falls below the floor is the one that changed the function, and
the report lists every step's figure. A prefix that onnxruntime cannot run (ops parked in a
private domain across the opset upgrade) is skipped; the next runnable one is measured.

Where the two part by more than the floor and the models hold Sigmoids, they are compared again
with every Sigmoid computed from exp on both sides (``graph.fp16_scale.sigmoids_from_exp``):
onnxruntime's CPU Sigmoid is only absolutely accurate, and a step that computes tiny
probabilities exactly (a geometric mean of scores, in log space) must not be blamed for the
source's own error; the report's reference says so.

A float16 source is compared in float32 (its own float16 rounding is not a change of function:
the preparation computes the same function at higher precision); the report gives the figure
against the float16 run too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qnn_ctx_runtime.qnn import read_model_summary

from ..core.accuracy import worst_snr
from ..core.config import InputsSection
from ..core.cpu import cpu_session
from ..core.dtypes import constant_feed, np_dtype, unread_input_feed
from ..core.memory import release_freed_memory
from ..core.metrics import PLAIN, OutputKinds
from ..graph.prequantized import is_prequantized
from ..graph.tails import judged_outputs
from .evaluate import iter_samples, run_named

MIN_PREPARED_SNR_DB = 60.0
CHECK_SAMPLES = 8  # held-out feeds the prepared model is compared on
OWN_ROUNDING_MARGIN_DB = 3.0  # how far below a pre-quantized source's own floor still passes
STEP_SAMPLES = 4  # ... and each step's prefix, when looking for the culprit

Feeds = dict[str, np.ndarray]


@dataclass(frozen=True)
class StepFigure:
    """The model after a preparation step vs the source: worst output SNR, or why not."""

    step: str
    snr_db: float | None
    note: str = ""


@dataclass(frozen=True)
class PreparationCheck:
    """Prepared float vs source float on held-out feeds, and (when it fails) per step."""

    min_snr_db: float
    snr_db: float | None  # worst output; None when it could not be measured
    samples: int
    passed: bool
    reference: str  # "source" | "source in float32"
    culprit: str = ""  # the first step below the floor
    steps: list[StepFigure] = field(default_factory=list)
    float16_snr_db: float | None = None  # vs the float16 source run, for a float16 source
    error: str = ""
    # A pre-quantized source's own rounding floor (input_jitter): below 60 dB the check passes
    # within OWN_ROUNDING_MARGIN_DB of it, where any float rounding a step changes flips its Qs.
    rounding_floor_db: float | None = None
    # The source against itself, run by onnxruntime with its graph optimizations and without
    # (``float_floor``), measured where the check fell below 60 dB: an ill-conditioned model
    # moves that far with its float32 arithmetic merely reordered.
    float_floor_db: float | None = None

    def message(self, model: str) -> str:
        where = f"step {self.culprit!r}" if self.culprit else "an unidentified step"
        figure = "-" if self.snr_db is None else f"{self.snr_db:.2f}"
        return (
            f"{model}: the prepared float model is {figure} dB from the {self.reference} "
            f"(floor {self.min_snr_db:g} dB): preparation {where} changed what the model "
            "computes."
        )


def _feeds_for(session: Any, feeds: Feeds, inputs: InputsSection) -> Feeds:
    """``feeds`` (+ baked constants) as ``session``'s inputs want them: names and dtypes. An
    input neither gives is one the preparation dropped as read by no node: zeros."""
    result = {}
    for arg in session.get_inputs():
        if arg.name in feeds:
            result[arg.name] = feeds[arg.name].astype(np_dtype(arg.type), copy=False)
        elif arg.name in inputs.constants:
            shape = inputs.shapes.get(arg.name, arg.shape)
            result[arg.name] = constant_feed(inputs.constants[arg.name], np_dtype(arg.type), shape)
        else:
            result[arg.name] = unread_input_feed(np_dtype(arg.type), arg.shape)
    return result


def compare(
    reference: Any,
    test: Any,
    samples: list[Feeds],
    inputs: InputsSection,
    optimize: bool = True,
    kinds: OutputKinds = PLAIN,
    spill_in: Path | None = None,
) -> tuple[float, int]:
    """(worst output SNR, samples) of ``test`` against ``reference`` (models or sessions);
    ``kinds``: outputs compared as labels or angles whatever their type (``metrics.OutputKinds``).
    With ``spill_in``, a reference model runs first and alone (``_reference_outputs``)."""
    return compare_each([(reference, optimize)], test, samples, inputs, optimize, kinds, spill_in)[
        0
    ]


def compare_each(
    references: Sequence[tuple[Any, bool]],
    test: Any,
    samples: list[Feeds],
    inputs: InputsSection,
    optimize: bool = True,
    kinds: OutputKinds = PLAIN,
    spill_in: Path | None = None,
) -> list[tuple[float, int]]:
    """``compare`` against each of ``references`` (a model or session, and whether
    onnxruntime optimizes it), with the test model run once per sample for all of them: a
    float16 source is compared both computed in float32 and as it is, and a 1024x1024
    segmenter's prepared model took 4 s a run on the CPU."""
    import contextlib
    import tempfile

    folder = (
        tempfile.TemporaryDirectory(prefix=".lossless-", dir=spill_in)
        if spill_in is not None
        else contextlib.nullcontext(None)
    )
    with folder as spill:
        expected = [
            _reference_outputs(model, samples, inputs, own, spill, len(references), index)
            for index, (model, own) in enumerate(references)
        ]
        got = test if hasattr(test, "run") else cpu_session(test, optimize)
        comparisons = [kinds.comparison() for _ in references]
        for feeds, *outputs in zip(samples, *expected, strict=True):
            names = list(
                dict.fromkeys(n for reference_outputs in outputs for n in reference_outputs)
            )
            ran = run_named(got, names, _feeds_for(got, feeds, inputs))
            for comparison, reference_outputs in zip(comparisons, outputs, strict=True):
                comparison.add(reference_outputs, {n: ran[n] for n in reference_outputs})
    return [(worst_snr(c.summary()), c.samples) for c in comparisons]


def _reference_outputs(
    reference: Any,
    samples: list[Feeds],
    inputs: InputsSection,
    optimize: bool,
    spill: Any,
    sharing: int = 1,
    index: int = 0,
) -> Iterator[Feeds]:
    """The reference's outputs, sample by sample: run beside the test model's, or, given a
    ``spill`` folder and a model (not a session), all of them first, kept up to evaluate's
    budget (split between the ``sharing`` references of one comparison) and the rest written
    there, its session closed before the next opens. A CPU session of a 1024x1024 IS-Net holds
    ~500 MB (weights and their pre-packed copies) beside a run's ~600 MB of activations: two
    open at once took the quantize stage to 1.6-1.7 GiB in this check."""
    from .evaluate import SampleOutputs

    ref = reference if hasattr(reference, "run") else cpu_session(reference, optimize)
    if spill is None or hasattr(reference, "run"):
        return (_outputs(ref, feeds, inputs) for feeds in samples)
    folder = Path(spill) / f"reference{index}"
    folder.mkdir()
    kept = SampleOutputs(folder)
    kept.budget //= sharing
    for position, feeds in enumerate(samples):
        kept.put(position, _outputs(ref, feeds, inputs))
    del ref
    release_freed_memory()
    return (kept.get(position) for position in range(len(samples)))


def _outputs(session: Any, feeds: Feeds, inputs: InputsSection) -> Feeds:
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, _feeds_for(session, feeds, inputs)), strict=True))


def _limited(folder: Path, count: int) -> list[Feeds]:
    return [feeds for _, feeds in zip(range(count), iter_samples(folder), strict=False)]


def per_step(
    source: Any,
    inputs: InputsSection,
    reference: Any,
    samples: list[Feeds],
    optimize: bool = True,
    lstm_nodes: int | None = None,
    transform: Callable[[Any], Any] | None = None,
    kinds: OutputKinds = PLAIN,
) -> Iterator[StepFigure]:
    """Each preparation step's prefix vs ``reference`` (a session), in order: the steps the
    prepared model went through (``lstm_nodes`` as ``prepare_model`` had it); ``transform``
    is applied to each prefix before it runs, as it was to the reference."""
    from ..graph.prepare import preparation_steps

    model = source
    last: float | None = None
    for step in preparation_steps(inputs, lstm_nodes):
        try:
            model, change = step(model)
        except Exception as exc:  # the full preparation ran before; report, do not crash
            yield StepFigure("?", None, f"step failed: {type(exc).__name__}: {exc}"[:200])
            return
        if not change.changed:
            continue
        try:
            measured = model if transform is None else transform(model)
            last, _ = compare(reference, measured, samples, inputs, optimize, kinds)
        except Exception as exc:  # onnxruntime cannot run this intermediate model
            yield StepFigure(change.step, None, f"not runnable: {type(exc).__name__}"[:120])
            continue
        yield StepFigure(change.step, last)


def check_preparation(
    name: str,
    source: Any,
    inputs: InputsSection,
    prepared: Path,
    heldout: Path,
    rounding_floor_db: float | None = None,
    lstm_nodes: int | None = None,
) -> PreparationCheck:
    """Prepared float vs source on ``heldout`` feeds (the bucket's own, padded as the prepared
    model takes them); per step when below the floor.

    ``rounding_floor_db``: a pre-quantized source's own rounding floor. Its Q/DQ round what the
    float ops compute, so a rewrite that is exact in real numbers but rounds differently in
    float32 (a GELU fused into one op) flips some of its quantized values, and the flips grow
    layer by layer: a Whisper encoder quantized by onnxruntime sits at 17.8 dB from itself with
    its inputs moved by less than their own rounding, and at 17.1 dB from its prepared model
    with one GELU fused. Within ``OWN_ROUNDING_MARGIN_DB`` of that floor the check passes."""
    from ..graph.source import as_source

    source = as_source(source)
    samples = _limited(heldout, CHECK_SAMPLES)
    reference, label, float16 = source.runnable(), "source model", None
    # A model with its own Q/DQ runs as its graph says (dequantize, float op, quantize):
    # onnxruntime's full optimization swaps Q/DQ groups for int8 kernels where the graph's
    # shape allows, so two equal graphs of different structure differ by its rounding (a
    # pre-quantized Whisper encoder: 19 dB between the source and itself with one GELU fused).
    optimize = not is_prequantized(source.load()) and source.optimize
    summary = read_model_summary(prepared)
    shapes = {o.name: list(o.shape) for o in summary.outputs}
    scores = [(n, shapes.get(n, [])) for n in judged_outputs(summary.metadata)]
    kinds = OutputKinds.of(prepared)  # class maps cast to float: ties flip, labels agree
    try:
        if source.float16:
            from ..graph.transforms import float16_to_float32

            reference, _ = float16_to_float32(source.load())
            label = "source model computed in float32"
        if scores:  # a label-only model: its labels alone would pass any preparation
            reference = _exposing(reference if source.float16 else source.load(), scores)
        spill = prepared.parent
        references = [(reference, optimize)]
        if source.float16:  # the float16 run, for the report: the prepared model runs once
            references.append((source.runnable(), False))
        figures = compare_each(references, prepared, samples, inputs, optimize, kinds, spill)
        snr, count = figures[0]
        float16 = figures[1][0] if source.float16 else None
    except Exception as exc:  # onnxruntime's own error types: say why, do not fail the build
        return PreparationCheck(
            MIN_PREPARED_SNR_DB, None, 0, True, label, error=f"{type(exc).__name__}: {exc}"[:300]
        )
    if not count:
        return PreparationCheck(MIN_PREPARED_SNR_DB, None, 0, True, label, error="no samples")
    floor = MIN_PREPARED_SNR_DB
    if rounding_floor_db is not None:
        floor = min(floor, rounding_floor_db - OWN_ROUNDING_MARGIN_DB)
    float_floor_db = None
    if snr < floor and optimize:
        float_floor_db = float_floor(reference, samples, inputs, kinds)
        if float_floor_db is not None:
            floor = min(floor, float_floor_db - OWN_ROUNDING_MARGIN_DB)
    if snr >= floor:
        return PreparationCheck(
            floor, snr, count, True, label, float16_snr_db=float16,
            rounding_floor_db=rounding_floor_db, float_floor_db=float_floor_db,
        )  # fmt: skip

    def exposed(model: Any) -> Any:  # a prefix outputs the scores too, as the reference does
        return _exposing(model, scores) if scores else model

    def expanded(model: Any) -> Any:
        return _expand_sigmoids(exposed(model))

    transform: Callable[[Any], Any] | None = exposed if scores else None
    ref_session = cpu_session(reference, optimize)  # kept open for the steps' bisection
    exact = _sigmoids_from_exp(reference, prepared)
    if exact is not None:
        try:
            exact_session = cpu_session(exact[0], optimize)
            exact_snr, _ = compare(exact_session, exact[1], samples, inputs, optimize, kinds)
        except Exception:  # onnxruntime cannot run the expanded forms: the plain figure stands
            pass
        else:
            snr, ref_session = exact_snr, exact_session
            transform = expanded
            label += f" ({SIGMOIDS_FROM_EXP})"
            if snr >= floor:
                return PreparationCheck(
                    floor, snr, count, True, label, float16_snr_db=float16,
                    rounding_floor_db=rounding_floor_db, float_floor_db=float_floor_db,
                )  # fmt: skip
    steps = list(
        per_step(
            source.load(), inputs, ref_session, samples[:STEP_SAMPLES], optimize, lstm_nodes,
            transform, kinds,
        )
    )  # fmt: skip
    return PreparationCheck(
        floor, snr, count, False, label, culprit(steps, floor), steps, float16,
        rounding_floor_db=rounding_floor_db, float_floor_db=float_floor_db,
    )  # fmt: skip


def float_floor(
    reference: Any, samples: list[Feeds], inputs: InputsSection, kinds: OutputKinds = PLAIN
) -> float | None:
    """The worst output SNR of ``reference`` (a model) against itself, run by onnxruntime with
    its graph optimizations and without: the same function, its float32 arithmetic fused and
    reordered. An ill-conditioned model moves that far from itself so, and no preparation of
    it can be held nearer (a fingerprint-minutiae network of 1337 nodes: 53.19 dB, its prepared
    model 53.19 dB from it, and the build failed blaming fix_input_shapes). None when
    onnxruntime cannot run it so."""
    try:
        return compare_each([(reference, True)], reference, samples, inputs, False, kinds)[0][0]
    except Exception:  # onnxruntime's own error types: the plain floor stands
        return None


SIGMOIDS_FROM_EXP = "every Sigmoid computed from exp in both models"


def _exposing(model: Any, judged: list[tuple[str, list[int]]]) -> Any:
    """``model`` (a source, or a preparation step's prefix) also outputting the scores a
    label-only prepared model is judged by (``judged``: their names and shapes). By name
    where it computes tensors so named (preparation keeps names); else the scores its own
    labels are computed from (``tails.label_scores``), paired by position, where they are as
    many and of the same shapes (the version converter renames an upgraded op's output; an
    optimizer that moved a Transpose past the ArgMax left scores of another layout)."""
    import onnx

    from ..graph.tails import label_scores

    produced = {o for node in model.graph.node for o in node.output}
    present = {o.name for o in model.graph.output}
    by_name = all(name in produced for name, _ in judged)
    scores = [name for name, _ in judged] if by_name else label_scores(model)
    if len(scores) != len(judged) or any(name in present for name in scores):
        return model
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    for name in scores:  # a float tensor; onnxruntime infers its shape
        exposed.graph.output.append(
            onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
        )
    if by_name:
        return exposed
    try:
        inferred = onnx.shape_inference.infer_shapes(exposed, strict_mode=False).graph
    except Exception:  # no shapes to compare: not paired
        return model
    shapes = {
        value.name: [d.dim_value if d.HasField("dim_value") else -1 for d in dims.dim]
        for value in (*inferred.value_info, *inferred.output)
        if (dims := value.type.tensor_type.shape)
    }
    same = all(shapes.get(name) == shape for name, (_, shape) in zip(scores, judged, strict=True))
    return exposed if same else model


def _expand_sigmoids(model: Any) -> Any:
    from ..graph.fp16_scale import sigmoids_from_exp

    return sigmoids_from_exp(model)[0]


def _sigmoids_from_exp(reference: Any, prepared: Path) -> tuple[Any, Any] | None:
    """(reference, prepared) with every Sigmoid computed from exp, or None when the reference
    has none or cannot be so rewritten (``graph.fp16_scale.sigmoids_from_exp`` says why)."""
    import onnx

    from ..graph.fp16_scale import sigmoids_from_exp

    try:
        model = reference if isinstance(reference, onnx.ModelProto) else onnx.load(reference)
        expanded, change = sigmoids_from_exp(model)
        if not change.changed:
            return None
        return expanded, _expand_sigmoids(onnx.load(str(prepared)))
    except Exception:  # a model the checker refuses once rewritten: no second opinion
        return None


def culprit(steps: list[StepFigure], floor: float = MIN_PREPARED_SNR_DB) -> str:
    """The first step whose prefix is below the floor; with the unrunnable steps just before
    it, since any of those may have made the change ("a, b or c")."""
    unmeasured: list[str] = []
    for figure in steps:
        if figure.snr_db is None:
            unmeasured.append(figure.step)
            continue
        if figure.snr_db < floor:
            names = [*unmeasured, figure.step]
            return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
        unmeasured = []
    return ""


def bucket_inputs(inputs: InputsSection, shapes: dict[str, Any] | None) -> InputsSection:
    """The [inputs] a bucket is prepared with (pipeline.quantize.shapes does the same)."""
    if shapes is None:
        return inputs
    return InputsSection(
        dims=dict(inputs.dims),
        shapes={k: list(v) for k, v in shapes.items()},
        constants=dict(inputs.constants),
    )
