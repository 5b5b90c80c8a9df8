"""Exceptions of the parameter server, under one root.

:class:`StellaPSError` is the root of the exceptions ``stella_ps`` defines; it is
never raised itself. (Errors sent back to workers are the client package's
``stella.errors`` classes, which the wire protocol names.)
"""
from __future__ import annotations

__all__ = ["StellaPSError", "KernelInputError", "KernelError"]


class StellaPSError(Exception):
    """Root of the exceptions defined by stella_ps; never raised itself."""


class KernelInputError(StellaPSError, ValueError):
    """An array handed to the C kernel has the wrong dtype, shape, order or range."""


class KernelError(StellaPSError, RuntimeError):
    """The C kernel returned an error code for input that passed the wrapper's checks."""
