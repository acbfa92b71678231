"""One error tree for the builder and the loader; only ``__main__`` turns it into an exit code.

Every error says what broke (``message``) and how to fix it (``tip``). The base class lives in
``qnn_ctx_runtime`` (the device side, which the builder depends on), so a ``ReleaseError`` raised
while publishing or a ``ToolchainError`` from registering the QNN EP is caught like any other.
"""

from __future__ import annotations

from qnn_ctx_runtime.errors import ActionableError, FeedError, ReleaseError, ToolchainError

# The builder's name for the common base: a failure the user can act on.
PipelineError = ActionableError

__all__ = [
    "ArtifactsError",
    "BusyError",
    "CalibrationError",
    "CompileError",
    "ConfigError",
    "FeedError",
    "GateError",
    "ModelError",
    "PipelineError",
    "PublishError",
    "ReleaseError",
    "ToolchainError",
]


class ConfigError(PipelineError):
    """A config file is unreadable, has an unknown key, a wrong type or a bad value."""


class ModelError(PipelineError):
    """A model file is missing, truncated, or has a graph the pipeline cannot prepare."""


class CalibrationError(PipelineError):
    """Calibration data is missing, empty, or does not match the model's inputs."""


class GateError(PipelineError):
    """A quality gate (accuracy, coverage, partitions) failed."""


class CompileError(PipelineError):
    """QNN could not compile or load a variant."""


class PublishError(PipelineError):
    """A release cannot be assembled, or would overwrite a different one."""


class BusyError(PipelineError):
    """Another run is building the same model in the same artifacts folder right now."""


class ArtifactsError(PipelineError):
    """The artifacts folder (or a file in it) cannot be written: read-only, full, or a file."""
