"""The errors a device-side caller can act on: each says what broke (``message``) and the fix (``tip``).

The build side (``pipeline``) derives its own errors from ``ActionableError``, so one ``except``
catches both, and ``python -m pipeline`` turns either into a message and an exit code.
"""

from __future__ import annotations


class ActionableError(Exception):
    """A failure the user can act on: ``message`` says what broke, ``tip`` how to fix it."""

    def __init__(self, message: str, tip: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.tip = tip

    def __str__(self) -> str:
        return self.message if not self.tip else f"{self.message}\nTIP: {self.tip}"


class ReleaseError(ActionableError):
    """A release is corrupt, tampered with, or has no variant this device can run."""


class ToolchainError(ActionableError):
    """The QNN toolchain is missing, unpinned, or not the one that really compiled."""


class FeedError(ActionableError):
    """Inputs given to ``run`` do not match the model (name, dtype, rank or size)."""


class UsageError(ActionableError):
    """An argument of the runtime API is wrong (an unknown chip, a bad folder)."""
