"""The server package's exception root and its subclasses.

Refusals of a request are the client package's classes (``stella.errors``), which
carry the :class:`~stella.errors.ErrorCode` the reply names; the classes here are
for the server's own layers (configuration, the kernel wrapper) and are turned into
refusals by the service where a request caused them.
"""
from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StellaPSError", "ConfigError", "KernelInputError", "KernelError", "NonFiniteStep", "StepFailed",
           "ModelDamaged", "CopyAbandoned"]


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
    """A step failed part way (a fault, MemoryError, a bug: in its aggregation, the
    kernel's apply, or the compressed broadcast's part) and changed nothing: what the
    kernel had applied was undone, the broadcast made whole again (its residual
    recomputed; every replica's next pull is a snapshot), and the version did not move.
    ``workers``: whose pushes the step had taken, when the step itself could not be
    built (an aggregation failure)."""

    def __init__(self, message: str, workers: Sequence[int] = ()):
        super().__init__(message)
        self.workers = list(workers)


class ModelDamaged(StellaPSError, RuntimeError):
    """A step failed part way and could not be undone (its rollback failed too, or the
    empty step that closes a failed one failed as well): the model may hold part of
    a step, and the version cannot move. The server stops serving and exits 1, without
    a last checkpoint, so that its supervisor restarts it from its newest checkpoint."""


class CopyAbandoned(StellaPSError, RuntimeError):
    """A checkpoint's copy overlapped a step that failed (:class:`StepFailed`): its
    slices cannot be rolled forward to one version; the next checkpoint starts afresh.
    (After :class:`ModelDamaged`, no copy ends and no checkpoint is written.)"""
