"""The server package's exception root and its subclasses.

Refusals of a request are the client package's classes (``stella.errors``), which
carry the :class:`~stella.errors.ErrorCode` the reply names; the classes here are
for the server's own layers (configuration, the kernel wrapper) and are turned into
refusals by the service where a request caused them.
"""
from __future__ import annotations

__all__ = ["StellaPSError", "ConfigError", "KernelInputError", "KernelError", "NonFiniteStep", "StepFailed",
           "CopyAbandoned"]


class StellaPSError(Exception):
    """Root of every exception the server package raises of its own; never raised itself."""


class ConfigError(StellaPSError, ValueError):
    """An optimizer name or hyper-parameter, or a server setting, is unknown or out of range."""


class KernelInputError(StellaPSError, ValueError):
    """An array handed to the kernel has the wrong dtype, shape, order or range."""


class KernelError(StellaPSError, RuntimeError):
    """The C kernel returned an error code for input that passed the wrapper's checks."""


class NonFiniteStep(StellaPSError, ArithmeticError):
    """A step would have written NaN or Inf into the model or its optimizer state; it
    changed nothing (the kernel's finite-step guard undid it)."""


class StepFailed(StellaPSError, RuntimeError):
    """Applying a step failed after the kernel had applied it (in the compressed
    broadcast's part of the step): the kernel's part was undone, the broadcast made
    whole again (its residual recomputed; every replica's next pull is a snapshot), and
    the version did not move."""


class CopyAbandoned(StellaPSError, RuntimeError):
    """A checkpoint's copy overlapped a step that failed (:class:`StepFailed`): its
    slices cannot be rolled forward to one version; the next checkpoint starts afresh."""
