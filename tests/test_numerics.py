"""Exact rewrites of numerically fragile patterns (pipeline/graph/numerics.py), checked in float."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from pipeline.graph.numerics import rewrite_sqrt_of_sigmoids

RNG = np.random.default_rng(20261122)


def _score_model(extra_use: bool = False, factors: int = 2) -> onnx.ModelProto:
    """sqrt(sigmoid(a) * sigmoid(b) [* sigmoid(c)]): a detection head's geometric-mean score."""
    names = "abc"[:factors]
    nodes = [helper.make_node("Sigmoid", [n], [f"p_{n}"], name=f"sig_{n}") for n in names]
    product = "p_a"
    for n in names[1:]:
        nodes.append(helper.make_node("Mul", [product, f"p_{n}"], [f"prod_{n}"], name=f"mul_{n}"))
        product = f"prod_{n}"
    nodes.append(helper.make_node("Sqrt", [product], ["score"], name="sqrt"))
    outputs = [helper.make_tensor_value_info("score", TensorProto.FLOAT, [1, 64])]
    if extra_use:  # a factor used elsewhere too: the rewrite must leave the graph alone
        outputs.append(helper.make_tensor_value_info("p_a", TensorProto.FLOAT, [1, 64]))
    graph = helper.make_graph(
        nodes,
        "score",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 64]) for n in names],
        outputs,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["score"], feeds)[0]


def test_sqrt_of_sigmoid_product_becomes_exp_of_softplus_sum_exactly():
    for factors in (2, 3):
        model = _score_model(factors=factors)
        rewritten, change = rewrite_sqrt_of_sigmoids(model)
        assert len(change.details) == 1 and f"product of {factors} sigmoids" in change.details[0]
        ops = [n.op_type for n in rewritten.graph.node]
        assert "Sqrt" not in ops and "Sigmoid" not in ops
        assert ops.count("Softplus") == factors and ops.count("Exp") == 1
        # Logits from confident background (-20) to confident object (+8): the tiny products
        # are where the original form loses everything in fp16.
        feeds = {n: RNG.uniform(-20, 8, (1, 64)).astype(np.float32) for n in "abc"[:factors]}
        original, got = _run(model, feeds), _run(rewritten, feeds)
        logits = np.stack([feeds[n].astype(np.float64) for n in feeds])
        truth = np.sqrt(np.prod(1.0 / (1.0 + np.exp(-logits)), axis=0))
        assert float(truth.min()) < 1e-6  # the range the rewrite is for
        # Same function: the rewrite matches float64 to float32 rounding, everywhere ...
        np.testing.assert_allclose(got, truth, rtol=1e-5, atol=1e-30)
        # ... and the original float32 graph within the lossless bound (onnxruntime's own
        # Sigmoid is an approximation that flushes large negative logits to 0).
        error = float(np.sum((original - got) ** 2))
        assert 10 * np.log10(float(np.sum(original.astype(np.float64) ** 2)) / error) > 60


def test_sqrt_rewrite_leaves_shared_factors_and_other_sqrts_alone():
    _, change = rewrite_sqrt_of_sigmoids(_score_model(extra_use=True))
    assert not change.details
    plain = helper.make_graph(
        [helper.make_node("Sqrt", ["x"], ["y"])],
        "plain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
    )
    model = helper.make_model(plain, opset_imports=[helper.make_opsetid("", 21)])
    _, change = rewrite_sqrt_of_sigmoids(model)
    assert not change.details
