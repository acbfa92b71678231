"""ONNX ``Attention`` (opset 23) written as MatMul / Softmax (``attention.attention_op_to_matmuls``):
the values of onnxruntime's own Attention kernel, in the forms exporters write (PyTorch's
scaled_dot_product_attention with a bool mask, 3-D inputs with head counts, grouped-query
attention, a causal mask, an additive mask, past keys and values)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.graph.attention import attention_op_to_matmuls

B, S, D = 1, 6, 8


def attention_model(
    q_shape: list[int],
    kv_shape: list[int],
    mask: str = "",
    past: int = 0,
    **attrs: object,
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """An Attention node on graph inputs q, k, v (and mask, past_key, past_value), with
    seeded feeds; outputs Y (and the present key and value where there is past state)."""
    rng = np.random.default_rng(11)
    feeds = {
        "q": rng.normal(0, 1, q_shape).astype(np.float32),
        "k": rng.normal(0, 1, kv_shape).astype(np.float32),
        "v": rng.normal(0, 1, kv_shape).astype(np.float32),
    }
    inputs = ["q", "k", "v"]
    q_len = q_shape[-2] if len(q_shape) == 4 else q_shape[1]
    kv_len = kv_shape[-2] if len(kv_shape) == 4 else kv_shape[1]
    if mask == "bool":
        feeds["mask"] = rng.random((1, 1, q_len, kv_len + past)) > 0.3
        feeds["mask"][..., 0] = True  # no row masked everywhere
    elif mask == "float":
        feeds["mask"] = rng.normal(0, 2, (q_len, kv_len + past)).astype(np.float32)
    inputs.append("mask" if mask else "")
    outputs = ["y"]
    if past:
        heads = kv_shape[1] if len(kv_shape) == 4 else int(attrs["kv_num_heads"])  # type: ignore[arg-type]
        width = D
        for name in ("past_key", "past_value"):
            feeds[name] = rng.normal(0, 1, (B, heads, past, width)).astype(np.float32)
        inputs += ["past_key", "past_value"]
        outputs += ["present_key", "present_value"]
    while inputs and not inputs[-1]:
        inputs.pop()
    node = helper.make_node("Attention", inputs, outputs, **attrs)
    elem = {np.dtype(bool): TensorProto.BOOL, np.dtype(np.float32): TensorProto.FLOAT}
    graph = helper.make_graph(
        [node],
        "attention",
        [helper.make_tensor_value_info(n, elem[a.dtype], list(a.shape)) for n, a in feeds.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    return model, feeds


FORMS = {
    "sdpa_bool_mask": (([B, 4, S, D], [B, 4, S, D]), {"mask": "bool", "scale": 0.125}),
    "three_d_heads": (([B, S, 4 * D], [B, S, 4 * D]), {"q_num_heads": 4, "kv_num_heads": 4}),
    "grouped_query": (([B, 4, S, D], [B, 2, S, D]), {"mask": "bool"}),
    "grouped_3d_causal": (
        ([B, S, 4 * D], [B, S, 2 * D]),
        {"q_num_heads": 4, "kv_num_heads": 2, "is_causal": 1},
    ),
    "causal_and_mask": (([B, 2, S, D], [B, 2, S, D]), {"mask": "bool", "is_causal": 1}),
    "additive_mask": (([B, 2, S, D], [B, 2, S, D]), {"mask": "float"}),
    "past_state": (([B, 2, S, D], [B, 2, S, D]), {"past": 3}),
}


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_attention_is_written_as_the_ops_it_computes(form: str) -> None:
    (q_shape, kv_shape), attrs = FORMS[form]
    model, feeds = attention_model(q_shape, kv_shape, **attrs)  # type: ignore[arg-type]
    model = onnx.shape_inference.infer_shapes(model)
    written, change = attention_op_to_matmuls(model)
    assert change.changed, form
    assert "Attention" not in {n.op_type for n in written.graph.node}
    for want, got in zip(_run(model, feeds), _run(written, feeds), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_softcapped_attention_is_left() -> None:
    model, _ = attention_model([B, 2, S, D], [B, 2, S, D], softcap=30.0)
    _, change = attention_op_to_matmuls(onnx.shape_inference.infer_shapes(model))
    assert not change.changed


def bert_block() -> onnx.ModelProto:
    """A BERT layer's attention as torch.onnx (dynamo, opset 23) writes it: Q/K/V projections,
    heads by Reshape/Transpose, Attention with a bool mask from the token mask, the output
    projection."""
    rng = np.random.default_rng(5)
    hidden, heads = 32, 4
    c = numpy_helper.from_array
    inits = [c(rng.normal(0, 0.2, (hidden, hidden)).astype(np.float32), f"w{n}") for n in "qkvo"]
    inits += [
        c(np.array([1, S, heads, hidden // heads], np.int64), "split"),
        c(np.array([1, S, hidden], np.int64), "merge"),
        c(np.ones((1, 1, S, S), dtype=bool), "mask"),
    ]
    nodes = []
    for n in "qkv":
        nodes += [
            helper.make_node("MatMul", ["x", f"w{n}"], [f"{n}_flat"]),
            helper.make_node("Reshape", [f"{n}_flat", "split"], [f"{n}_split"]),
            helper.make_node("Transpose", [f"{n}_split"], [n], perm=[0, 2, 1, 3]),
        ]
    nodes += [
        helper.make_node("Attention", ["q", "k", "v", "mask"], ["a"], scale=0.35),
        helper.make_node("Transpose", ["a"], ["a_t"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["a_t", "merge"], ["a_flat"]),
        helper.make_node("MatMul", ["a_flat", "wo"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "bert_block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, S, hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, S, hidden])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    return model


def test_the_htp_runs_an_opset_23_attention_block_whole(tmp_path: Path) -> None:
    """Quantized and compiled by the real stages: whole on the HTP (a BERT encoder exported
    at opset 23: its Attention ops on the CPU, 3 partitions, 2 CPU nodes)."""
    from compile_fixtures import build_whole_on_htp

    build_whole_on_htp(tmp_path, "bert_block", bert_block())


def test_a_key_padding_mask_onnxruntime_refuses_gets_its_fix() -> None:
    """A mask [B, 1, 1, S] (valid in the spec) makes onnxruntime's own CPU Attention kernel fail
    ("inconsistent q_sequence_length"): the source does not run at all. The error says so and
    how to export around it, not that it may be a pipeline bug."""
    from pipeline.core.cpu import cpu_session
    from pipeline.core.errors import ModelError

    model, feeds = attention_model([B, 2, S, D], [B, 2, S, D], mask="bool")
    feeds["mask"] = feeds["mask"][:, :, :1, :]
    model.graph.input[3].CopyFrom(
        helper.make_tensor_value_info("mask", TensorProto.BOOL, [1, 1, 1, S])
    )
    with pytest.raises(ModelError) as info:
        cpu_session(model).run(None, feeds)
    assert "[B, 1, S_q, S_kv]" in (info.value.tip or "")
    # written out, it runs (and broadcasts the mask as the spec says)
    written, _ = attention_op_to_matmuls(onnx.shape_inference.infer_shapes(model))
    (y,) = _run(written, feeds)
    full = dict(feeds, mask=np.broadcast_to(feeds["mask"], (1, 1, S, S)).copy())
    full_model, _ = attention_model([B, 2, S, D], [B, 2, S, D], mask="bool")
    np.testing.assert_allclose(y, _run(full_model, full)[0], rtol=1e-5, atol=1e-5)
