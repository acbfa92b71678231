"""qnn-ctx-runtime: load a published QNN EP-context release on a Snapdragon device and run it.

    import qnn_ctx_runtime
    model = qnn_ctx_runtime.load("path/to/release", target="snapdragon-x-elite")
    outputs = model.run({"x": array})

Needs only the standard library, numpy and onnxruntime (with onnxruntime-qnn for the NPU), which
is what installs reliably on Windows ARM64. Heavy imports happen on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .errors import ActionableError, FeedError, ReleaseError, ToolchainError, UsageError

if TYPE_CHECKING:
    from .client import WorkerError, WorkerModel, WorkerTimeout, connect
    from .loader import LoadedModel, load
    from .release import verify

# name -> its module, imported on first use (PEP 562): the builder's processes import this
# package for its errors and records, and loading the client and loader (subprocess, secrets,
# importlib.metadata) cost each of them 0.1 s.
_LAZY = {
    "WorkerError": "client",
    "WorkerModel": "client",
    "WorkerTimeout": "client",
    "connect": "client",
    "LoadedModel": "loader",
    "load": "loader",
    "verify": "release",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


__version__ = "0.2.0"
__all__ = [
    "ActionableError",
    "FeedError",
    "LoadedModel",
    "ReleaseError",
    "ToolchainError",
    "UsageError",
    "WorkerError",
    "WorkerModel",
    "WorkerTimeout",
    "connect",
    "load",
    "verify",
]
