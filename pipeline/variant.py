"""The record a compiled variant leaves beside its files (``variant.json``).

``compile`` writes it, ``publish`` reads it into the manifest. Standard library only.
A variant is one (model, toolchain, target) triple.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VARIANT_FILE = "variant.json"


@dataclass
class TensorSpec:
    name: str
    shape: list[int]
    dtype: str  # numpy dtype name, e.g. "float32"


@dataclass
class VariantRecord:
    """Everything known about one compiled variant; ``status`` is "ok" or "failed"."""

    model: str
    model_version: str
    toolchain: str  # onnxruntime-qnn version, e.g. "2.7.0"
    onnxruntime: str  # onnxruntime version it was built with
    target: str  # chip name from pipeline.targets
    soc_model: int
    htp_arch: int
    backend: str = "htp"
    status: str = "failed"
    # Read from the compiled EPContext node / model metadata, never from the config:
    qnn_sdk_version: str = ""  # e.g. "2.51.0"
    ep_sdk_version: str = ""  # raw attribute, e.g. "v2.51.0.260929181845"
    ep_compatibility_info: str = ""
    embed_mode: int = 1
    files: list[str] = field(default_factory=list)  # relative to the variant folder; ctx first
    inputs: list[TensorSpec] = field(default_factory=list)
    outputs: list[TensorSpec] = field(default_factory=list)
    # {"qnn_partitions": int, "qnn_nodes": int, "cpu_compute_nodes": [{"name","op_type"}],
    #  "cpu_io_qdq_nodes": int, "passed": bool, "gate": str}
    coverage: dict[str, Any] = field(default_factory=dict)
    # {"ctx_vs_qdq": {output: {"snr_db","max_abs","cosine"}}, "ctx_vs_float": {...},
    #  "samples": int, "passed": bool, "gate": str}
    validation: dict[str, Any] = field(default_factory=dict)
    # {"qdq_s": float, "ctx_s": float, "ratio": float, "runs": int}
    load: dict[str, Any] = field(default_factory=dict)
    compile_time_s: float = 0.0
    # On failure: {"stage": "compile|load|validate", "kind": "abort|timeout|compose|error",
    #              "message": str, "nodes": [...], "op_types": [...], "qnn_error_codes": [...]}
    error: dict[str, Any] = field(default_factory=dict)
    inputs_digest: str = ""  # hash of everything that went into this build (cache key)

    @property
    def passed(self) -> bool:
        return (
            self.status == "ok"
            and bool(self.coverage.get("passed"))
            and bool(self.validation.get("passed"))
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VariantRecord:
        data = dict(data)
        data["inputs"] = [TensorSpec(**t) for t in data.get("inputs", [])]
        data["outputs"] = [TensorSpec(**t) for t in data.get("outputs", [])]
        return cls(**data)

    @classmethod
    def read(cls, folder: Path) -> VariantRecord:
        return cls.from_dict(json.loads((Path(folder) / VARIANT_FILE).read_text("utf-8")))
