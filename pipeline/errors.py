"""One error tree for the whole pipeline; only ``__main__`` turns it into an exit code."""

from __future__ import annotations


class PipelineError(Exception):
    """A failure the user can act on: ``message`` says what broke, ``tip`` how to fix it."""

    def __init__(self, message: str, tip: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.tip = tip

    def __str__(self) -> str:
        return self.message if not self.tip else f"{self.message}\nTIP: {self.tip}"


class ConfigError(PipelineError):
    """A config file is unreadable, has an unknown key, a wrong type or a bad value."""


class ModelError(PipelineError):
    """A model file is missing, truncated, or has a graph the pipeline cannot prepare."""


class CalibrationError(PipelineError):
    """Calibration data is missing, empty, or does not match the model's inputs."""


class GateError(PipelineError):
    """A quality gate (accuracy, coverage, partitions) failed."""


class ToolchainError(PipelineError):
    """The QNN toolchain is missing, unpinned, or not the one that really compiled."""


class CompileError(PipelineError):
    """QNN could not compile or load a variant."""


class PublishError(PipelineError):
    """A release cannot be assembled, or would overwrite a different one."""


class ReleaseError(PipelineError):
    """A release is corrupt, tampered with, or has no variant this device can run."""
