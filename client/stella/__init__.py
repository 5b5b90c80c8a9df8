"""Stella: train one model across sites joined by slow links.

Training scripts use :class:`Client` (push / pull against a ``stella-ps``).
"""
from .client import Client, PullResult
from .errors import (
    BadRequest,
    CodecError,
    LayoutConflict,
    NotRegistered,
    OversizedMessage,
    ProtocolError,
    ServerError,
    ServerUnavailable,
    StaleVersionError,
    StellaError,
    VersionError,
)

__all__ = [
    "Client",
    "PullResult",
    "StellaError",
    "ProtocolError",
    "CodecError",
    "OversizedMessage",
    "ServerError",
    "BadRequest",
    "ServerUnavailable",
    "LayoutConflict",
    "NotRegistered",
    "VersionError",
    "StaleVersionError",
]
__version__ = "0.1.0"
