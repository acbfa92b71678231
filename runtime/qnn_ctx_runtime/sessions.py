"""Sessions over a variant's buckets: pick the smallest bucket that holds the input, pad, run, crop.

Every variant is a set of one or more static shapes ("buckets"); a model with one static shape is
one bucket with nothing to pad. All buckets' sessions are opened at load time; for a weight-shared
variant they are created with ``ep.share_ep_contexts=1`` (the last with
``ep.stop_share_ep_contexts=1``), so QNN loads the one context binary once and all buckets run over
it. ``run(feeds)`` checks names, dtypes and ranks, picks the bucket (``qnn_ctx_runtime.buckets``),
pads with the release's per-dim value and side, runs, and crops the outputs the release declares
as following an input dim; ``last`` tells what padding was applied.

The same class runs the release's CPU model (``provider="cpu"``) for an explicit CPU fallback.
Standard library, numpy and onnxruntime only.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import buckets as bk
from . import qnn
from .errors import ActionableError, FeedError, ReleaseError
from .manifest import Buckets, TensorInfo


@dataclass(frozen=True)
class SessionSpec:
    """What to open: the buckets (ctx files) of a variant, or the CPU model as one bucket."""

    label: str  # the variant id, or "cpu-fallback"
    buckets: Buckets
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    backend: str = "htp"
    provider: str = "qnn"  # "qnn" | "cpu"


# Per QNN backend. HTP: never compile online, a ctx model QNN cannot take as-is must fail, not
# recompile. GPU: a float model QNN compiles at load; a graph the GPU runs only in part must
# fail, not run half on the CPU (without this a GPU backend that cannot even initialise gives a
# session that silently runs everything on the CPU, as measured on x86_64).
BACKEND_SESSION_CONFIG = {
    "htp": {"session.disable_model_compile": "1"},
    "gpu": {"session.disable_cpu_ep_fallback": "1"},
}


class VariantSessions:
    """Sessions over every bucket of one variant, and the pad / run / crop around them."""

    def __init__(self, root: Path, spec: SessionSpec, log_severity: int = 3) -> None:
        self.spec = spec
        self.root = Path(root)
        self.log_severity = log_severity
        buckets = spec.buckets
        self.shared = buckets.shared_binary is not None
        self.entries = list(buckets.entries)
        self.buckets = [
            bk.Bucket(e.name, {t.name: tuple(t.shape) for t in e.inputs}) for e in self.entries
        ]
        self.pads = [
            bk.PadRule(a.input, a.axis, a.dim, float(a.pad_value), a.pad_side) for a in buckets.axes
        ]
        self.crops = [
            bk.CropRule(c.output, c.axis, c.input, c.input_axis, "", c.num, c.den, c.add, c.shift)
            for c in buckets.crops
        ]
        self.dtypes = {t.name: np.dtype(t.dtype) for t in spec.inputs}
        self.outputs = [t.name for t in spec.outputs]
        self.restarts = 0
        self.last: bk.Padding | None = None
        self.sessions = self._open()

    def _open(self) -> list[Any]:
        import onnxruntime as ort

        if self.spec.provider == "cpu":
            options = ort.SessionOptions()
            options.log_severity_level = self.log_severity
            return [
                ort.InferenceSession(
                    str(self.root / e.model), options, providers=["CPUExecutionProvider"]
                )
                for e in self.entries
            ]
        ep = qnn.find_qnn_ep()
        sessions = []
        last = len(self.entries) - 1
        for index, entry in enumerate(self.entries):
            config = dict(BACKEND_SESSION_CONFIG.get(self.spec.backend, {}))
            if self.shared:  # one QNN context, loaded once, for every bucket's graph
                config["ep.share_ep_contexts"] = "1"
                if index == last:
                    config["ep.stop_share_ep_contexts"] = "1"
            options = ep.session_options(
                qnn.QnnOptions(backend_type=self.spec.backend), config, self.log_severity
            )
            session = ort.InferenceSession(str(self.root / entry.model), sess_options=options)
            session.disable_fallback()  # a failed NPU run must say so, not retry on the CPU
            if qnn.EP_NAME not in session.get_providers():
                raise ReleaseError(
                    f"The QNN EP did not attach to {entry.model} (bucket {entry.name}); "
                    f"onnxruntime fell back to CPU (providers: {session.get_providers()}).",
                    tip="Run `python -m pipeline doctor` to check the onnxruntime pair.",
                )
            sessions.append(session)
        return sessions

    def close(self) -> None:
        self.sessions = []

    def choose(self, feeds: Mapping[str, Any]) -> tuple[int, dict[str, np.ndarray]]:
        """(bucket index, checked arrays) for ``feeds``; one FeedError names every problem
        (unknown and missing names, dtypes, ranks and sizes)."""
        issues = []
        for name in feeds:
            if name not in self.dtypes:
                issues.append(f"{name!r} is not an input (inputs: {', '.join(self.dtypes)})")
        arrays = {}
        for name, dtype in self.dtypes.items():
            if name not in feeds:
                issues.append(f"input {name!r} is missing")
                continue
            array = np.asarray(feeds[name])
            if array.dtype != dtype:
                issues.append(
                    f"input {name!r} has dtype {array.dtype}, expected {dtype} "
                    f"(convert with .astype(np.{dtype.name}))"
                )
            arrays[name] = array
        shapes = {k: v.shape for k, v in arrays.items()}
        issues += [m.rstrip(".") for m, _ in bk.shape_problems(self.buckets, self.pads, shapes)]
        if issues:
            vary = (
                " Dims shown as -1 may take any size up to the largest bucket." if self.pads else ""
            )
            raise FeedError(
                f"Bad feeds for {self.spec.label}: " + "; ".join(issues) + ".",
                tip="Feed numpy arrays with the names, dtypes and shapes listed in model.inputs."
                + vary,
            )
        bucket = bk.choose_bucket(self.buckets, self.pads, shapes)
        return self.buckets.index(bucket), arrays

    def run_detailed(
        self, feeds: Mapping[str, Any], output_names: list[str] | None = None
    ) -> tuple[dict[str, np.ndarray], bk.Padding]:
        """Outputs (cropped where the release says so) and the padding that was applied."""
        index, arrays = self.choose(feeds)
        bucket = self.buckets[index]
        padded, applied = {}, {}
        for name, array in arrays.items():
            rules = [r for r in self.pads if r.input == name]
            padded[name], applied[name] = bk.pad_input(array, bucket.shapes[name], rules)
        names = output_names or self.outputs
        unknown = [n for n in names if n not in self.outputs]
        if unknown:
            raise FeedError(
                f"Output(s) {unknown} of {self.spec.label} do not exist.",
                tip=f"Outputs: {', '.join(self.outputs)}.",
            )
        values = dict(zip(names, self._run(index, names, padded), strict=True))
        values = bk.crop_outputs(self.pads, self.crops, bucket, arrays, values)
        self.last = bk.Padding(bucket.name, {k: v for k, v in applied.items() if v})
        return values, self.last

    def run(
        self, feeds: Mapping[str, Any], output_names: list[str] | None = None
    ) -> dict[str, np.ndarray]:
        return self.run_detailed(feeds, output_names)[0]

    def _run(self, index: int, names: list[str], feeds: dict[str, np.ndarray]) -> list[Any]:
        """Run one bucket; on an HTP subsystem restart (ENGINE_ERROR) reopen all and retry once."""
        from onnxruntime.capi.onnxruntime_pybind11_state import EngineError

        try:
            return self.sessions[index].run(names, feeds)
        except EngineError as first:
            warnings.warn(
                f"QNN reported ENGINE_ERROR ({first}); reopening the sessions of "
                f"{self.spec.label} once, as after an HTP subsystem restart.",
                RuntimeWarning,
                stacklevel=4,
            )
            self.restarts += 1
            self.sessions = []
            try:
                self.sessions = self._open()
                return self.sessions[index].run(names, feeds)
            except ActionableError:
                raise
            except Exception as second:
                raise ReleaseError(
                    f"QNN failed again after ENGINE_ERROR and reopening the sessions: {second}",
                    tip="The NPU is not recovering; restart the device or use allow_cpu_fallback.",
                ) from second
