"""Whether a quantize build can be reused: its inputs, and the check, without numpy or onnx.

Why a module of its own: a rebuild with nothing changed is the build people run most, and
importing numpy and onnx takes longer (0.25 s) than the whole check. The stage's CLI asks here
first and imports the builder (``pipeline.quantize.build``) only for a model that changed; the
builder asks the same functions again under its lock, so the rule lives in one place.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..core.config import ModelConfig
from ..core.fileio import sha256_file
from ..core.layout import ModelPaths
from ..core.records import (
    BuildInputs,
    QuantizeRecord,
    code_digest,
    folder_digest,
    read_record,
    tool_versions,
)
from ..core.report import fmt
from ..report_html import write_html_reports

TOOLS = ("onnx", "onnxruntime", "numpy", "pillow")
# The builder's code that shapes the QDQ models: editing it rebuilds.
CODE = ("core", "graph", "calibration", "quantize", "htp")


@dataclasses.dataclass
class QuantizeResult:
    name: str
    folder: Path
    skipped: bool
    record: QuantizeRecord

    def summary_line(self, target_snr_db: float | None = None) -> str:
        """The stage's line for this model; ``target_snr_db``: said when the build is under
        it (it passed the gate, not the aim)."""
        report = self.folder / "report.md"
        if self.skipped:
            return f"{self.name}: up to date, nothing to do ({report})"
        snr = self.record.summary.worst_snr_db
        short = ""
        if target_snr_db is not None and snr < target_snr_db:
            short = f" (under the target of {fmt(target_snr_db)} dB)"
        line = f"{self.name}: QDQ written, worst SNR {fmt(snr)} dB{short} -> {report}"
        if self.record.summary.htp_failure:  # said here, not only in the report
            line += (
                f"\nWARNING: {self.name} did not run on the HTP, so its precision was judged on "
                f"the CPU: {self.record.summary.htp_failure}; compile will meet the same."
            )
        return line


def build_inputs(config: ModelConfig) -> BuildInputs:
    """Everything that determines the build; equal inputs mean the outputs can be reused."""
    source = config.source_path
    calibration = config.resolve(config.calibration.path) if config.calibration.path else None
    reader_file = config.calibration.reader.rpartition(":")[0]
    reader_digest = ""
    if reader_file.endswith(".py") and config.resolve(reader_file).is_file():
        reader_digest = sha256_file(config.resolve(reader_file))
    return BuildInputs(
        source=str(source),
        source_sha256=sha256_file(source),
        config_digest=config.quantize_digest(),
        calibration_digest=folder_digest(calibration) if calibration else "",
        reader_digest=reader_digest,
        code=code_digest(*CODE),
        tools=tool_versions(*TOOLS),
        source_data=external_data_digests(source) if source.is_file() else {},
    )


def external_data_digests(path: Path) -> dict[str, str]:
    """SHA-256 of each external data file the model at ``path`` names (location -> digest).

    Why: the weights of a model saved with external data are not in the .onnx file, so its
    digest alone would call a build with new weights up to date and a release built from them
    would not record them. A file that is missing is left to the model load's own error. onnx
    is imported only for a model that names external data at all.
    """
    try:
        if b"location" not in Path(path).read_bytes():  # no external data: skip the parse
            return {}
        import onnx

        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # not ONNX: the model load names the file and the fix
        return {}
    from ..graph.edit import all_graphs

    locations: set[str] = set()
    for graph in all_graphs(model.graph):
        tensors = [*graph.initializer, *(s.values for s in graph.sparse_initializer)]
        for node in graph.node:
            tensors += [a.t for a in node.attribute if a.HasField("t")]
        for tensor in tensors:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                entries = {e.key: e.value for e in tensor.external_data}
                if "location" in entries:
                    locations.add(entries["location"])
    folder = Path(path).parent
    return {
        location: sha256_file(folder / location)
        for location in sorted(locations)
        if (folder / location).is_file()
    }


def reusable(paths: ModelPaths, record: QuantizeRecord | None, inputs: BuildInputs) -> bool:
    """The record is a finished build from these very inputs, and its models are all there."""
    return (
        record is not None
        and record.status == "ok"
        and record.inputs == inputs
        and paths.report.is_file()
        and all(
            paths.bucket(b.name).qdq.is_file() and paths.bucket(b.name).float_model.is_file()
            for b in record.buckets
        )
    )


def reused(config: ModelConfig, artifacts: Path) -> QuantizeResult | None:
    """The earlier build of ``config`` when nothing it reads changed (its HTML report
    re-rendered only if missing or out of date), else None: the builder must run."""
    paths = ModelPaths.of(artifacts, config.model.name)
    record, _ = read_record(QuantizeRecord, paths.record)
    if not reusable(paths, record, build_inputs(config)):
        return None
    assert record is not None
    write_html_reports(paths.root)
    return QuantizeResult(config.model.name, paths.root, True, record)
