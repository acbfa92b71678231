"""How far the built models are from the user's model, on held-out samples (CPU EP).

``evaluate`` compares two models of one bucket sample by sample (QDQ vs prepared float).
``end_to_end`` does what the runtime will do, on the held-out samples at their true size: pick
the bucket, pad, run, crop; and compares that with the *source* model run at the true size. Its
``float_vs_source`` is what preparation (and padding) changed, ``qdq_vs_source`` adds
quantization. A figure that cannot be measured says why instead of vanishing.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qnn_ctx_runtime import buckets as bk

from ..core.config import ModelConfig
from ..core.cpu import cpu_session
from ..core.dtypes import np_dtype
from ..core.fileio import sha256_file
from ..core.layout import samples_in
from ..core.metrics import Accuracy, OutputComparison
from ..core.records import folder_digest
from ..graph.buckets import BucketPlan

Feeds = dict[str, np.ndarray]


def iter_samples(folder: Path) -> Iterator[Feeds]:
    """The feeds saved in a held-out folder, one at a time."""
    for path in samples_in(folder):
        with np.load(path, allow_pickle=False) as data:
            yield {k: data[k] for k in data.files}


def run_named(session: Any, names: list[str], feeds: Feeds) -> Feeds:
    """``names`` of ``session``'s outputs; paired by position where the model renamed them."""
    outputs = [o.name for o in session.get_outputs()]
    values = session.run(None, feeds)
    by_name = dict(zip(outputs, values, strict=True))
    if all(n in by_name for n in names):
        return {n: by_name[n] for n in names}
    return dict(zip(names, values, strict=False))


# (reference digest, test digest, held-out folder digest) -> what ``evaluate`` measured on them
_MEASURED: dict[tuple[str, str, str], dict[str, Accuracy]] = {}


def evaluate(reference_model: Path, test_model: Path, heldout: Path) -> dict[str, Accuracy]:
    """Per output SNR / max abs / cosine of ``test_model`` against ``reference_model``.

    The same two files on the same samples are measured once per process (the digests are the
    key): mixed precision measures the QDQ model it starts from, which is usually the one the
    quantize stage reports (fastestdet: 0.4 s, retinaface: 2.2 s of CPU runs)."""
    key = (sha256_file(reference_model), sha256_file(test_model), folder_digest(heldout))
    if key not in _MEASURED:
        _MEASURED[key] = _evaluate(reference_model, test_model, heldout)
    return dict(_MEASURED[key])


def _evaluate(reference_model: Path, test_model: Path, heldout: Path) -> dict[str, Accuracy]:
    ref = cpu_session(reference_model)
    test = cpu_session(test_model)
    names = [o.name for o in ref.get_outputs()]
    comparison = OutputComparison()
    for feeds in iter_samples(heldout):
        expected = dict(zip(names, ref.run(names, feeds), strict=True))
        comparison.add(expected, run_named(test, names, feeds))
    return comparison.summary()


@dataclass(frozen=True)
class EndToEnd:
    """The runtime's path (pad into the bucket, run, crop) vs the source model at true size."""

    samples: int
    qdq_vs_source: dict[str, Accuracy] = field(default_factory=dict)
    float_vs_source: dict[str, Accuracy] = field(default_factory=dict)
    source_failures: int = 0  # samples the source model itself could not run
    shape_mismatches: int = 0  # outputs whose cropped shape differs from the true-size run
    error: str = ""  # why nothing could be measured


def end_to_end(
    config: ModelConfig,
    source: Any,
    plan: BucketPlan,
    floats: dict[str, Path],
    qdqs: dict[str, Path],
    heldout: Path,
) -> EndToEnd:
    """Held-out samples at their true size through the buckets, vs the source model."""
    try:
        reference = cpu_session(source)
    except Exception as exc:  # onnxruntime's own error types; the reason goes to the report
        return EndToEnd(0, error=f"the source model does not load on the CPU EP: {exc}"[:400])
    source_types = {i.name: i.type for i in reference.get_inputs()}
    constants = {
        name: np.asarray(value, dtype=np_dtype(source_types[name]))
        for name, value in config.inputs.constants.items()
        if name in source_types
    }
    qdq = {n: cpu_session(p) for n, p in qdqs.items()}
    flt = {n: cpu_session(p) for n, p in floats.items()}
    rules: dict[str, list[bk.PadRule]] = {}
    for rule in plan.pads:
        rules.setdefault(rule.input, []).append(rule)
    names = [o.name for o in reference.get_outputs()]
    vs_qdq, vs_float = OutputComparison(), OutputComparison()
    failures = mismatched = 0
    first_failure = ""
    for own in iter_samples(heldout):
        bucket = bk.choose_bucket(plan.buckets, plan.pads, {k: v.shape for k, v in own.items()})
        types = {i.name: np_dtype(i.type) for i in qdq[bucket.name].get_inputs()}
        feeds = {
            name: bk.pad_input(own[name], shape, rules.get(name, []))[0]
            if name in own
            else np.zeros(shape, types.get(name, np.float32))
            for name, shape in bucket.shapes.items()
        }
        source_feeds = {
            name: value.astype(np_dtype(source_types[name]))
            for name, value in own.items()
            if name in source_types
        }
        try:
            expected = dict(
                zip(names, reference.run(names, {**source_feeds, **constants}), strict=True)
            )
        except Exception as exc:  # e.g. the source needs an input the sample does not give
            failures += 1
            first_failure = first_failure or f"{type(exc).__name__}: {exc}"[:300]
            continue
        got_q = bk.crop_outputs(
            plan.pads, plan.crops, bucket, own, run_named(qdq[bucket.name], names, feeds)
        )
        got_f = bk.crop_outputs(
            plan.pads, plan.crops, bucket, own, run_named(flt[bucket.name], names, feeds)
        )
        same = {n for n in names if np.shape(expected[n]) == np.shape(got_q[n])}
        mismatched += len(names) - len(same)
        vs_qdq.add({n: expected[n] for n in same}, {n: got_q[n] for n in same})
        vs_float.add({n: expected[n] for n in same}, {n: got_f[n] for n in same})
    return EndToEnd(
        samples=vs_qdq.samples,
        qdq_vs_source=vs_qdq.summary(),
        float_vs_source=vs_float.summary(),
        source_failures=failures,
        shape_mismatches=mismatched,
        error="" if vs_qdq.samples else (first_failure or "no held-out samples"),
    )


def input_jitter(
    model: Path, heldout: Path, steps: dict[str, float], seed: int = 0
) -> dict[str, Accuracy]:
    """``model`` against itself with each input in ``steps`` moved by up to half its step.

    For a pre-quantized model ``steps`` are its own input quantization steps: the jitter only
    moves values across its own rounding boundaries, so the figure is how reproducible the
    model's integer arithmetic is, the floor for any implementation that rounds differently.
    """
    session = cpu_session(model)
    names = [o.name for o in session.get_outputs()]
    rng = np.random.default_rng(seed)
    comparison = OutputComparison()
    for feeds in iter_samples(heldout):
        moved = dict(feeds)
        for name, step in steps.items():
            if name in moved and np.issubdtype(moved[name].dtype, np.floating):
                noise = rng.uniform(-0.5 * step, 0.5 * step, moved[name].shape)
                moved[name] = (moved[name] + noise).astype(moved[name].dtype)
        expected = dict(zip(names, session.run(names, feeds), strict=True))
        comparison.add(expected, dict(zip(names, session.run(names, moved), strict=True)))
    return comparison.summary()
