"""numpy dtypes of onnxruntime's type strings (``NodeArg.type``, e.g. ``tensor(float)``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

NP_TYPES: dict[str, Any] = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int16)": np.int16,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(uint16)": np.uint16,
    "tensor(bool)": np.bool_,
}


def np_dtype(onnx_type: str) -> Any:
    """numpy dtype of an onnxruntime type string; float32 for anything else."""
    return NP_TYPES.get(onnx_type, np.float32)


def constant_feed(value: Any, dtype: Any, shape: Sequence[object] | None) -> np.ndarray:
    """An ``[inputs] constants`` value as the input takes it: one number given for an input of
    more values fills its shape (a padding mask of zeros, an attention mask of ones: no one
    writes those out in TOML); ``shape`` holds the input's sizes, a name or None where dynamic."""
    array = np.asarray(value, dtype=dtype)
    sizes = list(shape or ())
    if array.ndim == 0 and sizes and all(isinstance(s, int) and s >= 0 for s in sizes):
        return np.full(sizes, array, dtype=array.dtype)
    return array


def unread_input_feed(dtype: Any, shape: Sequence[object] | None) -> np.ndarray:
    """Zeros for a source input that no node reads (``transforms.drop_unread_inputs`` drops it
    from the prepared model, so no sample holds it) and that onnxruntime requires all the same;
    a dynamic size is 1."""
    return np.zeros([s if isinstance(s, int) and s > 0 else 1 for s in shape or ()], dtype)


def value_type_name(onnx_type: str) -> str:
    """How a graph input/output's type is recorded: the numpy dtype name of a numeric tensor,
    ``str`` for a string tensor, onnxruntime's own name for anything else (a non-tensor output
    of a CPU tail, e.g. ``seq(map(string,tensor(float)))``)."""
    if onnx_type in NP_TYPES:
        return np.dtype(NP_TYPES[onnx_type]).name
    if onnx_type == "tensor(string)":
        return "str"
    return onnx_type
