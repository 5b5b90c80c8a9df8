"""Stella: train one model across sites joined by slow links.

Training scripts use :class:`StellaOptimizer` (a drop-in, one-step-stale optimizer,
its compression settings a :class:`Compression`) or :class:`Client` (push / pull
against a ``stella-ps``) directly.

Where each concern lives: ``client.py`` the :class:`Client` API and ``_session.py`` its
connection (socket, reply matching, heartbeats, reconnect and its rebase rules);
``pipeline.py`` :class:`StellaOptimizer`, :class:`Compression` and the density budget,
``_exchange.py`` each training mode's half of the optimizer, ``modes.py`` the modes and
outer presets (no torch); ``compress.py`` top-k with error feedback, one selector per
method and backend; ``protocol.py`` every message; ``codec.py`` the codings;
``status.py`` ``stella status``; ``errors.py`` the exceptions; ``planning/`` ``stella plan``
and ``stella profile`` (``catalog``, ``profile_file``, ``model``, ``search``, ``report``,
``measure``: a tool beside the library, which never imports it).
"""
from ._codec_native import native_isa
from .client import Client, Pending, PullResult
from .errors import (
    BadRequest,
    BadValue,
    CodecError,
    ErrorCode,
    LayoutConflict,
    NotRegistered,
    OversizedMessage,
    PipelineError,
    ProtocolError,
    ServerError,
    ServerUnavailable,
    StellaError,
    Unauthorised,
    VersionError,
)

__all__ = [
    "Client",
    "PullResult",
    "Pending",
    "StellaOptimizer",
    "Compression",
    "Sync",
    "Connection",
    "PipelineError",
    "ErrorFeedbackCompressor",
    "SparseGrad",
    "StellaError",
    "ErrorCode",
    "BadValue",
    "ProtocolError",
    "CodecError",
    "OversizedMessage",
    "ServerError",
    "BadRequest",
    "ServerUnavailable",
    "LayoutConflict",
    "NotRegistered",
    "VersionError",
    "Unauthorised",
    "native_isa",
]
__version__ = "0.1.0"

# torch-dependent parts load on first use, so that importing the wire schema (as
# stella-ps does) never imports torch.
_LAZY = {
    "StellaOptimizer": "pipeline",
    "Compression": "options",
    "Sync": "options",
    "Connection": "options",
    "ErrorFeedbackCompressor": "compress",
    "SparseGrad": "compress",
}


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'stella' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{mod}", __name__), name)
