"""Which nodes QNN runs and which it leaves on the CPU, and the gate on that.

Input is onnxruntime's own account of the session (``session.record_ep_graph_assignment_info``),
turned into plain ``(ep_name, [(node name, op type), ...])`` tuples so this module needs no
onnxruntime and is easy to test. The graph (``pipeline.qnn.ModelSummary``) is used to recognise
the graph-I/O QuantizeLinear/DequantizeLinear that ``offload_graph_io_quantization`` (on by
default) keeps on the CPU by design: they are reported but never fail the gate.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from qnn_ctx_runtime.qnn import EP_NAME, ModelSummary

from ..core.records import Coverage, EpNodes, NodeRef, TensorSpec
from ..graph.tails import summary_tail

QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})
EP_CONTEXT = "EPContext"

Assignment = Sequence[tuple[str, Sequence[tuple[str, str]]]]


def assignment_from_session(session: Any) -> list[tuple[str, list[tuple[str, str]]]]:
    """Plain tuples from ``InferenceSession.get_provider_graph_assignment_info()``."""
    return [
        (subgraph.ep_name, [(node.name, node.op_type) for node in subgraph.get_nodes()])
        for subgraph in session.get_provider_graph_assignment_info()
    ]


def tensor_specs(args: list[Any]) -> list[TensorSpec]:
    """A session's ``get_inputs()`` or ``get_outputs()`` as records (-1 for a symbolic dim)."""
    from ..core.dtypes import value_type_name  # numpy: not for a rerun's records-only check

    return [
        TensorSpec(
            a.name,
            [d if isinstance(d, int) else -1 for d in a.shape or []],
            value_type_name(a.type),
        )
        for a in args
    ]


def recorded_assignment(parts: list[EpNodes]) -> Assignment:
    """The assignment as ``assignment_from_session`` gives it, from its record (HtpLoad)."""
    return [(part.ep, [(n.name, n.op_type) for n in part.nodes]) for part in parts]


def _io_qdq_names(graph: ModelSummary) -> set[str]:
    """Q nodes that read a graph input and DQ nodes that write a graph output."""
    inputs = {v.name for v in graph.inputs}
    outputs = {v.name for v in graph.outputs}
    names = set()
    for node in graph.nodes:
        if node.op_type == "QuantizeLinear" and node.inputs and node.inputs[0] in inputs:
            names.add(node.name)
        if node.op_type == "DequantizeLinear" and node.outputs and node.outputs[0] in outputs:
            names.add(node.name)
    return names


def _attached_to(graph: ModelSummary, names: set[str]) -> set[str]:
    """Q/DQ nodes that only feed, or are only fed by, the nodes ``names``.

    When an op is allowed on the CPU, the DQ in front of it and the Q behind it necessarily stay
    there too; they are part of that allowance, not separate failures.
    """
    producer = {out: n for n in graph.nodes for out in n.outputs}
    consumers: dict[str, list[str]] = {}
    for node in graph.nodes:
        for tensor in node.inputs:
            consumers.setdefault(tensor, []).append(node.name)
    attached = set()
    for node in graph.nodes:
        if node.op_type not in QDQ_OPS:
            continue
        feeds = [c for out in node.outputs for c in consumers.get(out, [])]
        fed_by = [producer[t].name for t in node.inputs[:1] if t in producer]
        if (feeds and all(c in names for c in feeds)) or (fed_by and fed_by[0] in names):
            attached.add(node.name)
    return attached


def summarize(
    assignment: Assignment,
    graph: ModelSummary,
    max_partitions: int = 1,
    allowed_cpu_ops: Iterable[str] = (),
) -> Coverage:
    """Partitions, nodes per EP, CPU nodes by op type and name, and the gate verdict.

    ``graph`` is the model the session was created from. For an EP-context model, each EPContext
    node is one compiled QNN partition.
    """
    allowed_ops = set(allowed_cpu_ops)
    qnn_subgraphs = [nodes for ep, nodes in assignment if ep == EP_NAME]
    ep_context = [n for nodes in qnn_subgraphs for n in nodes if n[1] == EP_CONTEXT]
    partitions = len(ep_context) if ep_context else len(qnn_subgraphs)
    qnn_nodes = sum(len(nodes) for nodes in qnn_subgraphs)
    other_eps = sorted({ep for ep, _ in assignment if ep not in (EP_NAME, "CPUExecutionProvider")})
    cpu = [(name, op) for ep, nodes in assignment if ep != EP_NAME for name, op in nodes]

    io_qdq = _io_qdq_names(graph)
    allowed_names = {name for name, op in cpu if op in allowed_ops}
    attached = _attached_to(graph, allowed_names)
    cpu_io = [n for n in cpu if n[0] in io_qdq]
    cpu_allowed = [
        n for n in cpu if n[0] not in io_qdq and (n[0] in allowed_names or n[0] in attached)
    ]
    tail_names = _tail_names(graph)
    cpu_tail = [n for n in cpu if n[0] in tail_names and n not in cpu_allowed]
    cpu_compute = [
        n for n in cpu if n[0] not in io_qdq and n not in cpu_allowed and n not in cpu_tail
    ]
    cpu_ep_context = [n for n in cpu if n[1] == EP_CONTEXT]

    problems = []
    if partitions == 0:
        problems.append("QNN runs no part of the graph")
    if partitions > max_partitions:
        problems.append(f"{partitions} QNN partitions (max_partitions = {max_partitions})")
    if cpu_compute:
        by_op = Counter(op for _, op in cpu_compute)
        listed = ", ".join(f"{op} x{count}" for op, count in by_op.most_common())
        names = ", ".join(f"{name} ({op})" for name, op in cpu_compute[:10])
        more = f" and {len(cpu_compute) - 10} more" if len(cpu_compute) > 10 else ""
        problems.append(f"{len(cpu_compute)} node(s) on CPU: {listed}; nodes: {names}{more}")
    if cpu_ep_context:
        problems.append(f"{len(cpu_ep_context)} EPContext node(s) not run by QNN")
    if other_eps:
        problems.append(f"nodes assigned to other EPs: {', '.join(other_eps)}")

    gate = f"all compute nodes on QNN in <= {max_partitions} partition(s)"
    if allowed_ops:
        gate += f"; allowed on CPU: {', '.join(sorted(allowed_ops))}"
    if cpu_tail:
        gate += "; declared CPU tail: ai.onnx.ml post-processing and non-tensor outputs"
    return Coverage(
        qnn_partitions=partitions,
        qnn_nodes=qnn_nodes,
        cpu_compute_nodes=[NodeRef(n, op) for n, op in cpu_compute],
        cpu_ops=dict(Counter(op for _, op in cpu_compute)),
        cpu_allowed_nodes=[NodeRef(n, op) for n, op in cpu_allowed],
        cpu_io_qdq_nodes=len(cpu_io),
        passed=not problems,
        gate=gate,
        problems=problems,
        cpu_tail_nodes=[NodeRef(n, op) for n, op in cpu_tail] if cpu_tail else None,
    )


def _tail_names(graph: ModelSummary) -> set[str]:
    """Nodes of the declared CPU tail (pipeline.graph.tails) and the Q/DQ nodes that serve it."""
    tail = summary_tail(graph.nodes, {v.name: v.dtype for v in graph.outputs})
    names = {graph.nodes[i].name for i in tail.nodes}
    return names | _attached_to(graph, names) if names else set()


def combine(per_bucket: dict[str, Coverage]) -> Coverage:
    """One verdict over a variant's buckets: every bucket must pass; nodes name their bucket."""
    many = len(per_bucket) > 1

    def tagged(nodes: list[NodeRef], bucket: str) -> list[NodeRef]:
        return [NodeRef(n.name, n.op_type, bucket) for n in nodes] if many else list(nodes)

    sections = list(per_bucket.items())
    ops: Counter[str] = Counter()
    for _, c in sections:
        ops.update(c.cpu_ops)
    return Coverage(
        qnn_partitions=max((c.qnn_partitions for _, c in sections), default=0),
        qnn_nodes=sum(c.qnn_nodes for _, c in sections),
        cpu_compute_nodes=[n for b, c in sections for n in tagged(c.cpu_compute_nodes, b)],
        cpu_ops=dict(ops),
        cpu_allowed_nodes=[n for b, c in sections for n in tagged(c.cpu_allowed_nodes, b)],
        cpu_io_qdq_nodes=sum(c.cpu_io_qdq_nodes for _, c in sections),
        cpu_tail_nodes=[n for b, c in sections for n in tagged(c.cpu_tail_nodes or [], b)] or None,
        passed=bool(sections) and all(c.passed for _, c in sections),
        gate=sections[0][1].gate if sections else "",
        problems=[f"{b}: {p}" if many else p for b, c in sections for p in c.problems],
    )
