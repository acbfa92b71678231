"""What the NPU computes for a QDQ model, measured on the HTP, in a child process.

``probe(...)`` compiles the QDQ model for one chip (QNN EP, in memory of a temp folder), runs it
on the HTP (the x86_64 simulator here) over held-out samples, and compares its outputs with the
prepared float model and with the same QDQ model on the CPU EP. With ``locate = True`` every
activation of the QDQ model is also made a graph output, so the comparison is tensor by tensor:
the first tensor (in graph order) where the HTP and the CPU QDQ model part ways names the op that
the HTP computes differently (e.g. 16-bit weights in a dilated convolution).

``python -m pipeline.htp.probe JOB.json`` is the child; the parent never loads QNN itself.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qnn_ctx_runtime.typed import parse, to_json_value

from ..core.cpu import cpu_session
from ..core.fileio import sha256_file
from ..core.metrics import Accuracy, OutputComparison, worst_snr
from .isolation import die_with_parent, run_module

MODULE = "pipeline.htp.probe"
DIVERGENCE_DB = 30.0  # HTP vs CPU QDQ below this at one tensor: they compute it differently


@dataclass(frozen=True)
class ProbeJob:
    qdq: str
    float_model: str
    samples: list[str]  # .npz feeds
    work: str  # a folder the child may write to
    result: str
    soc_model: int
    htp_arch: int
    qnn_options: dict[str, str] = field(default_factory=dict)
    locate: bool = False


@dataclass(frozen=True)
class TensorAgreement:
    """One activation: how closely the HTP reproduces the CPU QDQ model there."""

    name: str
    op_type: str  # the op that produced it
    node: str
    snr_db: float


@dataclass
class ProbeResult:
    status: str = "running"  # running | ok | failed
    stage: str = "start"
    error: str = ""
    qnn_sdk: str = ""
    onnxruntime_qnn: str = ""
    ctx_sha256: str = ""
    sample_sha256: list[str] = field(default_factory=list)
    partitions: int = 0
    cpu_nodes: int = 0
    samples: int = 0
    ctx_vs_float: dict[str, Accuracy] = field(default_factory=dict)
    ctx_vs_qdq: dict[str, Accuracy] = field(default_factory=dict)
    qdq_vs_float: dict[str, Accuracy] = field(default_factory=dict)
    tensors: list[TensorAgreement] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def worst_ctx_vs_float(self) -> float:
        return worst_snr(self.ctx_vs_float)

    @property
    def worst_ctx_vs_qdq(self) -> float:
        return worst_snr(self.ctx_vs_qdq)

    def first_divergence(self, threshold: float = DIVERGENCE_DB) -> TensorAgreement | None:
        """The first tensor, in graph order, where the HTP and the CPU QDQ model part ways."""
        return next((t for t in self.tensors if t.snr_db < threshold), None)


def _save(path: Path, result: ProbeResult) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(to_json_value(result)), encoding="utf-8")
    tmp.replace(path)


def _load(cls: type, path: Path) -> Any:
    issues: list[str] = []
    value = parse(cls, json.loads(Path(path).read_text("utf-8")), "", issues)
    if issues or value is None:
        raise ValueError(f"{path}: " + "; ".join(issues[:5]))
    return value


# -- the parent -----------------------------------------------------------------------------------


def qnn_available() -> str:
    """'' when this interpreter can run the QNN EP, else why not (checked without loading it)."""
    from qnn_ctx_runtime import qnn

    installed = qnn.installed_qnn()
    if not installed.present:
        return "onnxruntime-qnn is not installed in this environment"
    return ""


def probe(
    qdq: Path,
    float_model: Path,
    samples: list[Path],
    work: Path,
    soc_model: int,
    htp_arch: int,
    qnn_options: dict[str, str] | None = None,
    locate: bool = False,
    timeout_s: float = 900.0,
) -> ProbeResult:
    """Compile ``qdq`` for the HTP, run it there and compare; a dead child is a failed result."""
    work.mkdir(parents=True, exist_ok=True)
    job = ProbeJob(
        qdq=str(qdq.resolve()),
        float_model=str(float_model.resolve()),
        samples=[str(p.resolve()) for p in samples],
        work=str(work.resolve()),
        result=str((work / "probe_result.json").resolve()),
        soc_model=soc_model,
        htp_arch=htp_arch,
        qnn_options=dict(qnn_options or {}),
        locate=locate,
    )
    job_path = work / "probe_job.json"
    job_path.write_text(json.dumps(to_json_value(job)), encoding="utf-8")
    done = run_module(MODULE, job_path, work / "probe.log", timeout_s)
    try:
        result: ProbeResult = _load(ProbeResult, Path(job.result))
    except (OSError, ValueError):
        result = ProbeResult()
    if done.timed_out:
        result.status, result.error = "failed", f"timed out after {timeout_s:g} s in {result.stage}"
    elif result.status != "ok" and not result.error:
        tail = [line for line in done.log.splitlines() if line.strip()][-2:]
        result.status = "failed"
        result.error = (
            f"the HTP child died in {result.stage} ({done.signal_name()}): " + " / ".join(tail)
        )
    result.seconds = done.seconds
    return result


# -- the child ------------------------------------------------------------------------------------


def _exposed(qdq_path: str, out: Path) -> tuple[Path, list[tuple[str, str, str]]]:
    """The QDQ model with every dequantized activation as a graph output, and their producers."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(qdq_path)
    inits = {i.name for i in model.graph.initializer}
    outputs = {o.name for o in model.graph.output}
    producer = {o: n for n in model.graph.node for o in n.output}
    exposed = []
    for node in model.graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] in inits:
            continue
        tensor = node.output[0]
        quantize = producer.get(node.input[0])
        source = producer.get(quantize.input[0]) if quantize is not None else None
        op, name = (source.op_type, source.name) if source is not None else ("input", "")
        if tensor not in outputs:  # graph outputs are compared already, in their place
            model.graph.output.append(
                helper.make_tensor_value_info(tensor, TensorProto.FLOAT, None)
            )
        exposed.append((tensor, op, name))
    path = out / "probe_qdq.onnx"
    onnx.save(model, str(path))
    return path, exposed


def _run(job: ProbeJob, result: ProbeResult, path: Path) -> None:
    import onnxruntime as ort

    from qnn_ctx_runtime import qnn

    def stage(name: str) -> None:
        result.stage = name
        _save(path, result)

    stage("register")
    ep = qnn.find_qnn_ep()
    result.qnn_sdk = ep.installed.qnn_sdk
    work = Path(job.work)
    model_path, exposed = _exposed(job.qdq, work) if job.locate else (Path(job.qdq), [])
    stage("compile")
    extra = tuple(sorted(job.qnn_options.items()))
    options = ep.session_options(qnn.QnnOptions("htp", job.soc_model, job.htp_arch, extra), {}, 3)
    ctx_path = work / "probe_ctx.onnx"
    ctx_path.unlink(missing_ok=True)
    ort.ModelCompiler(
        options, str(model_path), embed_compiled_data_into_model=True
    ).compile_to_file(str(ctx_path))
    result.ctx_sha256 = sha256_file(ctx_path)
    result.sample_sha256 = [sha256_file(Path(sample)) for sample in job.samples]
    result.onnxruntime_qnn = ep.installed.package_version
    stage("load")
    record = {"session.record_ep_graph_assignment_info": "1"}
    ctx = ort.InferenceSession(str(ctx_path), ep.session_options(qnn.QnnOptions("htp"), record, 3))
    assignment = ctx.get_provider_graph_assignment_info()
    result.partitions = sum(
        1 for s in assignment for n in s.get_nodes() if s.ep_name == qnn.EP_NAME
    )
    io_qdq = {"QuantizeLinear", "DequantizeLinear"}
    result.cpu_nodes = sum(
        1
        for s in assignment
        if s.ep_name != qnn.EP_NAME
        for n in s.get_nodes()
        if n.op_type not in io_qdq
    )
    outputs = [o.name for o in ort.InferenceSession(job.float_model).get_outputs()]
    names = outputs + [t for t, _, _ in exposed if t not in outputs]
    # The HTP's outputs go to disk first and its session is closed before the CPU models run:
    # the simulator and two CPU sessions of a 1024x2048 model side by side took 1.7 GiB.
    stage("run")
    stash = work / "htp_outputs"
    stash.mkdir(exist_ok=True)
    for index, sample in enumerate(job.samples):
        with np.load(sample, allow_pickle=False) as data:
            feeds = {k: data[k] for k in data.files}
        np.savez(stash / f"{index:04d}.npz", *ctx.run(names, feeds))
    del ctx, assignment  # the assignment info holds the session (and the simulator) alive
    stage("compare")
    qdq = cpu_session(model_path)
    flt = cpu_session(job.float_model)
    vs_float, vs_qdq, q_vs_f, tensors = (OutputComparison() for _ in range(4))
    for index, sample in enumerate(job.samples):
        with np.load(sample, allow_pickle=False) as data:
            feeds = {k: data[k] for k in data.files}
        with np.load(stash / f"{index:04d}.npz") as saved:
            got = dict(zip(names, (saved[f"arr_{i}"] for i in range(len(names))), strict=True))
        (stash / f"{index:04d}.npz").unlink()
        ref_f = dict(zip(outputs, flt.run(outputs, feeds), strict=True))
        vs_float.add(ref_f, {n: got[n] for n in outputs})
        ref_q = dict(zip(names, qdq.run(names, feeds), strict=True))
        vs_qdq.add({n: ref_q[n] for n in outputs}, {n: got[n] for n in outputs})
        q_vs_f.add(ref_f, {n: ref_q[n] for n in outputs})
        del ref_f
        if exposed:
            tensors.add({t: ref_q[t] for t, _, _ in exposed}, {t: got[t] for t, _, _ in exposed})
        del got, ref_q
    result.samples = vs_float.samples
    result.ctx_vs_float = vs_float.summary()
    result.ctx_vs_qdq = vs_qdq.summary()
    result.qdq_vs_float = q_vs_f.summary()
    per_tensor = tensors.summary()
    result.tensors = [TensorAgreement(t, op, node, per_tensor[t].snr_db) for t, op, node in exposed]
    result.status = "ok"
    stage("done")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(f"usage: python -m {MODULE} JOB.json", file=sys.stderr)
        return 2
    die_with_parent()
    job: ProbeJob = _load(ProbeJob, Path(args[0]))
    path = Path(job.result)
    result = ProbeResult()
    started = time.perf_counter()
    try:
        _run(job, result, path)
    except Exception as exc:  # reported with its step; the parent decides what it means
        result.status = "failed"
        result.error = f"{type(exc).__name__}: {exc}"[:1500]
    result.seconds = time.perf_counter() - started
    _save(path, result)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
