"""qnn-ctx-runtime: load a published QNN EP-context release on a Snapdragon device and run it.

    import qnn_ctx_runtime
    model = qnn_ctx_runtime.load("path/to/release", target="snapdragon-x-elite")
    outputs = model.run({"x": array})

Needs only the standard library, numpy and onnxruntime (with onnxruntime-qnn for the NPU), which
is what installs reliably on Windows ARM64. Heavy imports happen on first use.
"""

from __future__ import annotations

from .client import WorkerError, WorkerModel, WorkerTimeout, connect
from .errors import ActionableError, FeedError, ReleaseError, ToolchainError, UsageError
from .loader import LoadedModel, load
from .release import verify

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
