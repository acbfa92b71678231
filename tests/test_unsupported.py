"""pipeline.graph.unsupported: ops the QNN EP has no kernel for, as ops it has."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

from pipeline.graph.unsupported import ops_without_qnn_kernels

RNG = np.random.default_rng(5)
SHAPE = [1, 8, 6, 6]


def single_op(
    nodes: list[onnx.NodeProto],
    constants: dict[str, np.ndarray],
    out_shape: list[int],
    out_type: int = TensorProto.FLOAT,
    in_type: int = TensorProto.FLOAT,
) -> onnx.ModelProto:
    """x -> ``nodes`` -> y, constants as initializers, opset 21."""
    graph = oh.make_graph(
        nodes,
        "single_op",
        [oh.make_tensor_value_info("x", in_type, SHAPE)],
        [oh.make_tensor_value_info("y", out_type, out_shape)],
        [numpy_helper.from_array(value, name) for name, value in constants.items()],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


CASES = {
    "GlobalLpPool p=2": (
        [oh.make_node("GlobalLpPool", ["x"], ["y"], p=2)],
        {},
        [1, 8, 1, 1],
    ),
    "GlobalLpPool p=1": (
        [oh.make_node("GlobalLpPool", ["x"], ["y"], p=1)],
        {},
        [1, 8, 1, 1],
    ),
    "Hardmax": ([oh.make_node("Hardmax", ["x"], ["y"], axis=1)], {}, SHAPE),
    "OneHot": (
        [
            oh.make_node("ArgMax", ["x"], ["index"], axis=1, keepdims=0),
            oh.make_node("Sub", ["index", "two"], ["signed"]),  # negative ones count from the end
            oh.make_node("OneHot", ["signed", "depth", "values"], ["y"], axis=1),
        ],
        {
            "two": np.array(2, np.int64),
            "depth": np.array(8, np.int64),
            "values": np.array([-0.5, 3.0], np.float32),
        },
        SHAPE,
    ),
    "Trilu": (
        [oh.make_node("Trilu", ["x", "k"], ["y"], upper=0)],
        {"k": np.array(1, np.int64)},
        SHAPE,
    ),
    "Mod": (
        [oh.make_node("Mod", ["x", "divisor"], ["y"], fmod=1)],
        {"divisor": np.array(0.7, np.float32)},
        SHAPE,
    ),
    "Erf": ([oh.make_node("Erf", ["x"], ["y"])], {}, SHAPE),
    "CumSum reversed, exclusive": (
        [oh.make_node("CumSum", ["x", "axis"], ["y"], reverse=1, exclusive=1)],
        {"axis": np.array(-1, np.int64)},
        SHAPE,
    ),
    "CumSum exclusive": (
        [oh.make_node("CumSum", ["x", "axis"], ["y"], exclusive=1)],
        {"axis": np.array(1, np.int64)},
        SHAPE,
    ),
    "Pad wrap": (
        [oh.make_node("Pad", ["x", "pads", "", "axes"], ["y"], mode="wrap")],
        {"pads": np.array([2, 0, 1, 3], np.int64), "axes": np.array([2, 3], np.int64)},
        [1, 8, 9, 9],
    ),
    "LpPool p=2": (
        [oh.make_node("LpPool", ["x"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], p=2)],
        {},
        SHAPE,
    ),
    "LpPool p=1": (
        [oh.make_node("LpPool", ["x"], ["y"], kernel_shape=[2, 2], strides=[2, 2], p=1)],
        {},
        [1, 8, 3, 3],
    ),
    "Sinh": ([oh.make_node("Sinh", ["x"], ["y"])], {}, SHAPE),
    "Cosh": ([oh.make_node("Cosh", ["x"], ["y"])], {}, SHAPE),
    "Asinh": ([oh.make_node("Asinh", ["x"], ["y"])], {}, SHAPE),
    "Acosh": (
        [
            oh.make_node("Abs", ["x"], ["size"]),
            oh.make_node("Add", ["size", "one"], ["above_one"]),
            oh.make_node("Acosh", ["above_one"], ["y"]),
        ],
        {"one": np.array(1.0, np.float32)},
        SHAPE,
    ),
    "Atanh": (
        [
            oh.make_node("Tanh", ["x"], ["t"]),
            oh.make_node("Mul", ["t", "shrink"], ["inside"]),
            oh.make_node("Atanh", ["inside"], ["y"]),
        ],
        {"shrink": np.array(0.9, np.float32)},
        SHAPE,
    ),
    "Acos": (
        [
            oh.make_node("Tanh", ["x"], ["t"]),
            oh.make_node("Acos", ["t"], ["y"]),
        ],
        {},
        SHAPE,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_op_becomes_ops_the_qnn_ep_runs_and_computes_the_same(case: str) -> None:
    nodes, constants, out_shape = CASES[case]
    op = nodes[-1].op_type
    model = single_op(nodes, constants, out_shape)
    rewritten, change = ops_without_qnn_kernels(model)
    assert change.changed and len(change.details) == 1, change.details
    left = [n for n in rewritten.graph.node if n.op_type == op]
    assert not left or all(  # CumSum and Pad stay, in the forms the QNN EP runs
        not {a.name for a in n.attribute} & {"reverse", "exclusive", "mode"} for n in left
    )
    for seed in range(3):
        x = (np.random.default_rng(seed).standard_normal(SHAPE) * 2).astype(np.float32)
        x[0, :, 0, 0] = [-3.0, -1.3, -0.2, 0.0, 0.3, 1.0, 2.2, 5.0]  # signs, Erf's tails
        want, got = run(model, x), run(rewritten, x)
        if op == "Erf":
            np.testing.assert_allclose(got, want, atol=5e-7)
        else:  # the same function in float32 (Acosh and Atanh near their edges: a few ulps)
            np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


def test_a_3d_max_pool_is_two_2d_ones() -> None:
    """Kernel 3x3x3, strides 2, pads 1 (a 3D CNN's pooling): the same maxima, ceil mode too."""
    for ceil in (0, 1):
        graph = oh.make_graph(
            [
                oh.make_node(
                    "MaxPool",
                    ["x"],
                    ["y"],
                    kernel_shape=[3, 3, 3],
                    strides=[2, 2, 2],
                    pads=[1, 1, 0, 1, 0, 1],
                    ceil_mode=ceil,
                )
            ],
            "pool3d",
            [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 7, 10, 9])],
            [oh.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        )
        model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)
        model = onnx.shape_inference.infer_shapes(model)
        rewritten, change = ops_without_qnn_kernels(model)
        assert change.changed and "3D" in change.details[0]
        assert [n.op_type for n in rewritten.graph.node].count("MaxPool") == 2
        x = np.random.default_rng(ceil).standard_normal((1, 4, 7, 10, 9)).astype(np.float32)
        np.testing.assert_array_equal(run(rewritten, x), run(model, x))


def test_a_scaled_gemm_and_a_constant_compress_compute_the_same() -> None:
    """Gemm with alpha 0.5 and beta 2 -> the plain Gemm of alpha B and beta C; Compress with a
    constant condition (along an axis, and over the flattened input) -> a Gather."""
    gemm = oh.make_graph(
        [oh.make_node("Gemm", ["x", "b", "c"], ["y"], alpha=0.5, beta=2.0, transB=1)],
        "gemm",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [4, 5])],
        [
            numpy_helper.from_array(RNG.standard_normal((5, 6)).astype(np.float32), "b"),
            numpy_helper.from_array(RNG.standard_normal(5).astype(np.float32), "c"),
        ],
    )
    models = [(oh.make_model(gemm, opset_imports=[oh.make_opsetid("", 21)], ir_version=10), (4, 6))]
    for axis in (1, None):
        attrs = {"axis": axis} if axis is not None else {}
        condition = np.array([1, 0, 1, 1, 0, 0, 1, 0] if axis else [1, 0] * 144, bool)
        out = [1, 4, 6, 6] if axis else [int(condition.sum())]
        models.append(
            (
                single_op(
                    [oh.make_node("Compress", ["x", "keep"], ["y"], **attrs)],
                    {"keep": condition},
                    out,
                ),
                tuple(SHAPE),
            )
        )
    for model, shape in models:
        rewritten, change = ops_without_qnn_kernels(model)
        assert change.changed, model.graph.node[0].op_type
        assert all(
            not (n.op_type == "Compress" or (n.op_type == "Gemm" and len(n.attribute) > 1))
            for n in rewritten.graph.node
        )
        x = RNG.standard_normal(shape).astype(np.float32)
        np.testing.assert_allclose(run(rewritten, x), run(model, x), rtol=1e-6, atol=1e-6)


def test_what_cannot_be_written_statically_is_left_alone() -> None:
    """GlobalLpPool with p = 3 (a Pow, refused quantized), Trilu with a computed k:
    unchanged, said by no detail."""
    cases = [
        single_op([oh.make_node("GlobalLpPool", ["x"], ["y"], p=3)], {}, [1, 8, 1, 1]),
        single_op(
            [
                oh.make_node("ReduceMax", ["x"], ["top"], keepdims=0),
                oh.make_node("Cast", ["top"], ["k"], to=TensorProto.INT64),
                oh.make_node("Trilu", ["x", "k"], ["y"]),
            ],
            {},
            SHAPE,
        ),
    ]
    for model in cases:
        same, change = ops_without_qnn_kernels(model)
        assert not change.changed and same.graph.node[-1].op_type == model.graph.node[-1].op_type


@pytest.mark.parametrize("fmod", [0, 1])
@pytest.mark.parametrize("divisor", [16384, 7, -7])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_an_integer_mod_becomes_integer_division_exactly(
    fmod: int, divisor: int, dtype: type
) -> None:
    """Python's mod (fmod = 0, the divisor's sign) and C's (fmod = 1, the dividend's), over
    dividends of both signs and past fp16's range."""
    elem = TensorProto.INT32 if dtype == np.int32 else TensorProto.INT64
    model = single_op(
        [oh.make_node("Mod", ["x", "b"], ["y"], fmod=fmod)],
        {"b": np.array(divisor, dtype)},
        SHAPE,
        elem,
        elem,
    )
    rewritten, change = ops_without_qnn_kernels(model)
    assert change.changed and "Mod" not in [n.op_type for n in rewritten.graph.node]
    x = RNG.integers(-300000, 300000, SHAPE).astype(dtype)
    np.testing.assert_array_equal(run(rewritten, x), run(model, x))


def hashed_lookup(rewrite: bool) -> onnx.ModelProto:
    """ids -> (id + 1) * prime mod 16384 -> rows of a float table: CANINE's hash embedding."""
    table = np.random.default_rng(3).standard_normal((16384, 4)).astype(np.float32)
    nodes = [
        oh.make_node("Add", ["x", "one"], ["shifted"]),
        oh.make_node("Mul", ["shifted", "prime"], ["hashed"]),
        oh.make_node("Mod", ["hashed", "buckets"], ["row"]),
        oh.make_node("Gather", ["table", "row"], ["y"]),
    ]
    constants = {
        "one": np.array(1, np.int32),
        "prime": np.array(31, np.int32),
        "buckets": np.array(16384, np.int32),
        "table": table,
    }
    graph = oh.make_graph(
        nodes,
        "hashed",
        [oh.make_tensor_value_info("x", TensorProto.INT32, [1, 64])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, 4])],
        [numpy_helper.from_array(value, name) for name, value in constants.items()],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)
    return ops_without_qnn_kernels(model)[0] if rewrite else model


@pytest.mark.qnn
def test_the_htp_computes_an_integer_mod_in_fp16_and_its_rewrite_exactly(tmp_path: Path) -> None:
    """Measured on the simulator: the hashed rows past 2048 come out wrong (the lookups read
    other rows), rewritten as integer division every row is right."""
    from compile_fixtures import whole_ctx_vs_float

    from pipeline.htp.probe import qnn_available

    if qnn_available():
        pytest.skip(qnn_available())
    models = {"float": hashed_lookup(False), "rewritten": hashed_lookup(True)}
    ids = np.random.default_rng(0).integers(0, 2000, (1, 64)).astype(np.int32)
    snr = whole_ctx_vs_float(tmp_path, models, [{"x": ids}])
    assert snr["float"] < 10.0 and snr["rewritten"] > 60.0, snr


BRANCHES = [
    *("a", "hard", "hot", "tri", "erf", "small_mod", "pool", "small_cum", "smooth"),
    *("atanh", "acos", "sinh", "cosh", "asinh", "acosh", "compressed", "gemm"),
]


def every_op_between_convs() -> onnx.ModelProto:
    """x -> Conv -> a; y = Conv(a + Hardmax(a) + OneHot(ArgMax a) + Trilu(a) + Erf(a) + ...):
    each rewritten op (but the 3D MaxPool) on its own branch, one output."""
    weight = (RNG.standard_normal((8, 8, 3, 3)) / 8).astype(np.float32)
    nodes = [
        oh.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1]),
        oh.make_node("Hardmax", ["a"], ["hard"], axis=1),
        oh.make_node("ArgMax", ["a"], ["index"], axis=1, keepdims=0),
        oh.make_node("OneHot", ["index", "depth", "values"], ["hot"], axis=1),
        oh.make_node("Trilu", ["a"], ["tri"]),
        oh.make_node("Erf", ["a"], ["erf"]),
        oh.make_node("Mod", ["a", "half"], ["mod"], fmod=1),
        oh.make_node("Mul", ["mod", "tenth"], ["small_mod"]),
        oh.make_node("GlobalLpPool", ["a"], ["pool"], p=2),
        oh.make_node("CumSum", ["a", "last"], ["cum"], reverse=1, exclusive=1),
        oh.make_node("Mul", ["cum", "tenth"], ["small_cum"]),
        oh.make_node("Pad", ["a", "wrap_pads"], ["wrapped"], mode="wrap"),
        oh.make_node("AveragePool", ["wrapped"], ["smooth"], kernel_shape=[3, 3]),
        oh.make_node("Tanh", ["a"], ["t"]),
        oh.make_node("Mul", ["t", "shrink"], ["inside"]),
        oh.make_node("Atanh", ["inside"], ["atanh"]),
        oh.make_node("Acos", ["t"], ["acos"]),
        oh.make_node("Sinh", ["t"], ["sinh"]),
        oh.make_node("Cosh", ["t"], ["cosh"]),
        oh.make_node("Asinh", ["a"], ["asinh"]),
        oh.make_node("Abs", ["a"], ["size"]),
        oh.make_node("Add", ["size", "one"], ["above_one"]),
        oh.make_node("Acosh", ["above_one"], ["acosh"]),
        oh.make_node("Compress", ["a", "half_channels"], ["kept"], axis=1),
        oh.make_node("Concat", ["kept", "kept"], ["compressed"], axis=1),
        oh.make_node("Reshape", ["a", "rows"], ["flat"]),
        oh.make_node("Gemm", ["flat", "gemm_b", "gemm_c"], ["scaled"], alpha=0.5, beta=2.0),
        oh.make_node("Reshape", ["scaled", "back"], ["gemm"]),
        oh.make_node(
            "Sum",
            BRANCHES,
            ["total"],
        ),
        oh.make_node("Conv", ["total", "w2"], ["y"], pads=[1, 1, 1, 1]),
    ]
    constants = {
        "w1": weight,
        "w2": weight[::-1].copy(),
        "depth": np.array(8, np.int64),
        "values": np.array([0.0, 1.0], np.float32),
        "half": np.array(0.5, np.float32),
        "tenth": np.array(0.1, np.float32),
        "last": np.array(3, np.int64),
        "wrap_pads": np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64),
        "shrink": np.array(0.9, np.float32),
        "one": np.array(1.0, np.float32),
        "half_channels": np.array([1, 0, 0, 1, 1, 0, 1, 0], bool),
        "rows": np.array([48, 6], np.int64),
        "gemm_b": (RNG.standard_normal((6, 6)) / 3).astype(np.float32),
        "gemm_c": (RNG.standard_normal(6) / 3).astype(np.float32),
        "back": np.array(SHAPE, np.int64),
    }
    return single_op(nodes, constants, SHAPE)


@pytest.mark.qnn
def test_the_htp_runs_them_whole_quantized(tmp_path: Path) -> None:
    """Quantized and compiled by the real stages: one partition, no CPU node, ctx vs QDQ
    above 30 dB (without the rewrites each op stays on the CPU and compile's gate fails)."""
    from compile_fixtures import build_whole_on_htp

    build_whole_on_htp(tmp_path, "every_op", every_op_between_convs())


@pytest.mark.qnn
def test_the_htp_runs_a_3d_max_pool_whole_quantized(tmp_path: Path) -> None:
    """Conv3d -> MaxPool 3x3x3 / 2 -> Conv3d (a video or volume CNN's block): the QNN EP has
    no 3D MaxPool (two partitions before)."""
    from compile_fixtures import build_whole_on_htp

    weights = [(RNG.standard_normal((4, 4, 3, 3, 3)) / 10).astype(np.float32) for _ in range(2)]
    graph = oh.make_graph(
        [
            oh.make_node("Conv", ["x", "w1"], ["a"], pads=[1] * 6),
            oh.make_node("MaxPool", ["a"], ["p"], kernel_shape=[3, 3, 3], strides=[2, 2, 2]),
            oh.make_node("Conv", ["p", "w2"], ["y"], pads=[1] * 6),
        ],
        "pool3d",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 9, 12, 12])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 4, 5, 5])],
        [numpy_helper.from_array(w, f"w{i + 1}") for i, w in enumerate(weights)],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)
    build_whole_on_htp(tmp_path, "pool3d", model)


def masked_rows(
    value: float | bool = -5.0,
    swap_columns: bool = False,
    reduction: str = "none",
    updates: str = "fill",
) -> onnx.ModelProto:
    """TorchScript's ``x[torch.where(x.sum(-1) > 0)] = value`` over x [2, 3, 4] (the chain
    Mask2Former/OneFormer's masked attention exports): NonZero -> Transpose -> Split -> Squeeze
    -> Unsqueeze -> Concat -> ScatterND, the updates a fill Expanded to the positions' count.
    ``swap_columns`` writes at (j, i) instead of (i, j); ``updates="gathered"`` writes twice the
    values read there (not one value). A bool ``value`` writes into a mask (x > 0.5), as
    OneFormer does."""
    boolean = isinstance(value, bool)
    data = "mask" if boolean else "x"
    nodes = [
        oh.make_node("Greater", ["x", "half"], ["mask"]),
        oh.make_node("ReduceSum", ["x", "last"], ["sum"], keepdims=0),
        oh.make_node("Greater", ["sum", "zero"], ["c"]),
        oh.make_node("NonZero", ["c"], ["nz"]),
        oh.make_node("Transpose", ["nz"], ["rows"], perm=[1, 0]),
        oh.make_node("Split", ["rows", "ones"], ["i2", "j2"], axis=1),
        oh.make_node("Squeeze", ["i2", "one_axis"], ["i"]),
        oh.make_node("Squeeze", ["j2", "one_axis"], ["j"]),
        oh.make_node("Unsqueeze", ["j" if swap_columns else "i", "one_axis"], ["first"]),
        oh.make_node("Unsqueeze", ["i" if swap_columns else "j", "one_axis"], ["second"]),
        oh.make_node("Concat", ["first", "second"], ["indices"], axis=1),
        oh.make_node("Shape", ["i"], ["count"]),
        oh.make_node("Concat", ["count", "width"], ["updates_shape"], axis=0),
    ]
    if updates == "fill":
        nodes.append(oh.make_node("Expand", ["value", "updates_shape"], ["updates"]))
    else:
        nodes += [
            oh.make_node("GatherND", [data, "indices"], ["read"]),
            oh.make_node("Mul", ["read", "two"], ["updates"]),
        ]
    scatter = {} if reduction == "none" else {"reduction": reduction}
    nodes.append(oh.make_node("ScatterND", [data, "indices", "updates"], ["y"], **scatter))
    constants = {
        "last": np.array([-1], np.int64),
        "zero": np.array(0.0, np.float32),
        "ones": np.array([1, 1], np.int64),
        "one_axis": np.array([1], np.int64),
        "width": np.array([4], np.int64),
        "value": np.array(value, bool if boolean else np.float32),
        "two": np.array(2.0, np.float32),
        "half": np.array(0.5, np.float32),
    }
    graph = oh.make_graph(
        nodes,
        "masked_rows",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [
            oh.make_tensor_value_info(
                "y", TensorProto.BOOL if boolean else TensorProto.FLOAT, [2, 3, 4]
            )
        ],
        [numpy_helper.from_array(v, name) for name, v in constants.items()],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=9)


@pytest.mark.parametrize(
    ("value", "reduction", "op"),
    [(-5.0, "none", "Where"), (-5.0, "add", "Where"), (False, "none", "And"), (True, "none", "Or")],
)
def test_a_fill_written_at_nonzero_positions_becomes_a_select(
    value: float | bool, reduction: str, op: str
) -> None:
    """Every data-sized tensor goes (the NonZero, its chain, the ScatterND); the result is the
    scatter's, exactly, for conditions true nowhere, somewhere and everywhere. Into a mask, a
    fill is logic (onnxruntime's CPU has no boolean Where)."""
    from pipeline.graph.prepare import dynamic_tensors
    from pipeline.graph.unsupported import positions_written_as_where

    model = masked_rows(value=value, reduction=reduction)
    assert dynamic_tensors(model)
    rewritten, change = positions_written_as_where(model)
    ops = [n.op_type for n in rewritten.graph.node]
    assert change.changed and op in ops, change.details
    assert not {"NonZero", "ScatterND", "Transpose", "Split"} & set(ops), ops
    assert dynamic_tensors(rewritten) == []
    rng = np.random.default_rng(1)
    for sign in (rng.choice([-1.0, 1.0], (2, 3, 1)), -np.ones((2, 3, 1)), np.ones((2, 3, 1))):
        x = (np.abs(rng.standard_normal((2, 3, 4))) * sign).astype(np.float32)
        np.testing.assert_array_equal(run(rewritten, x), run(model, x))


@pytest.mark.parametrize(
    "variant", [{"swap_columns": True}, {"updates": "gathered"}, {"reduction": "mul"}]
)
def test_other_writes_at_nonzero_positions_stay(variant: dict) -> None:
    """Positions read in another order, updates that are not one value, a reduction other than
    add: no select computes those, so the scatter stays (and preparation names it later)."""
    from pipeline.graph.unsupported import positions_written_as_where

    same, change = positions_written_as_where(masked_rows(**variant))
    assert not change.changed
    assert "ScatterND" in [n.op_type for n in same.graph.node]


def test_preparation_leaves_a_masked_fill_static() -> None:
    """Through the whole preparation (its step comes before the check for static shapes)."""
    from pipeline.core.config import InputsSection
    from pipeline.graph.prepare import prepare_model

    model = masked_rows(value=3.0)
    prepared, _ = prepare_model(model, InputsSection())
    x = np.random.default_rng(2).standard_normal((2, 3, 4)).astype(np.float32)
    np.testing.assert_array_equal(run(prepared, x), run(model, x))


@pytest.mark.qnn
def test_a_fill_at_nonzero_positions_runs_whole_on_the_htp(tmp_path: Path) -> None:
    """Rewritten, the masked fill runs whole on the HTP simulator (fp16) and agrees with the
    CPU; the NonZero it replaces has no QNN kernel (a data-sized output)."""
    from compile_fixtures import whole_ctx_vs_float

    from pipeline.graph.unsupported import positions_written_as_where
    from pipeline.htp.probe import qnn_available

    if qnn_available():
        pytest.skip(qnn_available())
    rewritten, _ = positions_written_as_where(masked_rows())
    rng = np.random.default_rng(3)
    samples = [{"x": rng.standard_normal((2, 3, 4)).astype(np.float32)} for _ in range(3)]
    snr = whole_ctx_vs_float(tmp_path, {"float": rewritten}, samples)
    assert snr["float"] > 50.0, snr


def image_model(
    between: list[onnx.NodeProto], constants: dict[str, np.ndarray], channels: int = 16
) -> onnx.ModelProto:
    """x [1, 3, 16, 16] -> Conv to ``channels`` -> a; ``between`` reads a and writes b; b ->
    Conv -> y (the ops of a CNN's block, seeded weights)."""
    rng = np.random.default_rng(11)
    inits = {
        "w1": (rng.standard_normal((channels, 3, 3, 3)) / 3).astype(np.float32),
        "w2": (rng.standard_normal((channels, channels, 3, 3)) / channels).astype(np.float32),
        **constants,
    }
    graph = oh.make_graph(
        [
            oh.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1]),
            *between,
            oh.make_node("Conv", ["b", "w2"], ["y"], pads=[1, 1, 1, 1]),
        ],
        "image",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, channels, "h", "w"])],
        [numpy_helper.from_array(value, name) for name, value in inits.items()],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


@pytest.mark.qnn
def test_an_lp_pool_is_right_on_the_htp(tmp_path: Path) -> None:
    """The HTP takes LpPool whole but computes it wrongly (16 channels of 16x16: ctx vs QDQ
    3.9 dB); as an AveragePool of squares it is right there."""
    from compile_fixtures import build_whole_on_htp

    for p, attrs in ((2, {"pads": [1, 1, 1, 1]}), (1, {"strides": [2, 2]})):
        pool = oh.make_node("LpPool", ["a"], ["b"], kernel_shape=[3, 3], p=p, **attrs)
        (tmp_path / f"p{p}").mkdir()
        build_whole_on_htp(tmp_path / f"p{p}", f"lp_pool_{p}", image_model([pool], {}))


def pooled_with_indices(
    kernel: int, stride: int, shape: tuple[int, ...] = (2, 3, 7, 8), unpool: bool = False
) -> onnx.ModelProto:
    """MaxPool(x) -> (y, indices), both outputs; ``unpool``: y -> Relu -> MaxUnpool at the
    indices instead (SegNet's decoder)."""
    nodes = [
        oh.make_node("MaxPool", ["x"], ["y", "i"], kernel_shape=[kernel] * 2, strides=[stride] * 2)
    ]
    outputs = [
        oh.make_tensor_value_info("y", TensorProto.FLOAT, None),
        oh.make_tensor_value_info("i", TensorProto.INT64, None),
    ]
    if unpool:
        nodes += [
            oh.make_node("Relu", ["y"], ["r"]),
            oh.make_node(
                "MaxUnpool", ["r", "i"], ["u"], kernel_shape=[kernel] * 2, strides=[stride] * 2
            ),
        ]
        outputs = [oh.make_tensor_value_info("u", TensorProto.FLOAT, None)]
    graph = oh.make_graph(
        nodes, "pool", [oh.make_tensor_value_info("x", TensorProto.FLOAT, shape)], outputs
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)
    return onnx.shape_inference.infer_shapes(model)


def run_all(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


@pytest.mark.parametrize(("kernel", "unpool"), [(2, False), (3, False), (1, False), (2, True)])
def test_max_pool_indices_and_unpooling_are_computed_the_same(kernel: int, unpool: bool) -> None:
    """Indices as ONNX counts them (over the whole tensor, batch and channel included), the
    first maximum of a window on ties (x rounded to few levels: many ties, as quantized)."""
    shape = (2, 3, 6, 8) if unpool else (2, 3, 7, 8)  # unpooled: sizes the windows tile
    model = pooled_with_indices(kernel, kernel, shape, unpool=unpool)
    rewritten, change = ops_without_qnn_kernels(model)
    assert change.changed and len(change.details) == 1 + unpool, change.details
    kinds = [n.op_type for n in rewritten.graph.node]
    assert "MaxUnpool" not in kinds
    assert all(len(n.output) == 1 for n in rewritten.graph.node if n.op_type == "MaxPool")
    for seed in range(3):
        x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
        if seed:
            x = np.round(x * seed).astype(np.float32)  # ties
        for want, got in zip(run_all(model, x), run_all(rewritten, x), strict=True):
            np.testing.assert_array_equal(got, want)


def test_max_pool_indices_of_overlapping_windows_stay() -> None:
    """Stride 1 under a 3x3 kernel (windows overlap) and a 4x4 kernel: left as they are."""
    for kernel, stride in ((3, 1), (4, 4)):
        same, change = ops_without_qnn_kernels(pooled_with_indices(kernel, stride, (1, 2, 8, 8)))
        assert not change.changed and same.graph.node[0].op_type == "MaxPool"


@pytest.mark.qnn
def test_segnet_style_unpooling_is_whole_on_the_htp(tmp_path: Path) -> None:
    """Conv -> MaxPool 2x2 with indices -> Conv -> MaxUnpool at those indices -> Conv (SegNet's
    encoder-decoder): MaxPool's indices and MaxUnpool stayed on the CPU, three partitions."""
    from compile_fixtures import build_whole_on_htp

    rng = np.random.default_rng(12)
    between = [
        oh.make_node("MaxPool", ["a"], ["p", "i"], kernel_shape=[2, 2], strides=[2, 2]),
        oh.make_node("Conv", ["p", "w_mid"], ["m"], pads=[1, 1, 1, 1]),
        oh.make_node("Relu", ["m"], ["r"]),
        oh.make_node("MaxUnpool", ["r", "i"], ["b"], kernel_shape=[2, 2], strides=[2, 2]),
    ]
    mid = {"w_mid": (rng.standard_normal((16, 16, 3, 3)) / 8).astype(np.float32)}
    build_whole_on_htp(tmp_path, "unpool", image_model(between, mid))
