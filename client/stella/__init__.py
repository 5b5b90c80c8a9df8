"""Stella: train one model across sites joined by slow links.

Training scripts use :class:`StellaOptimizer` (a drop-in, one-step-stale optimizer; its
settings in :class:`Sync`, :class:`Compression` and :class:`Connection`) or
:class:`Client` (push / pull against a ``stella-ps``) directly.

Where each concern lives:

- the optimizer: ``pipeline.py`` :class:`StellaOptimizer`, the composition of three
  parts: ``_exchange.py`` each training mode's half (what a step does, what a round
  pushes and installs, its settings' checks), ``_rounds.py`` the background thread, one
  round's push and pull and what it measures, and ``site.py`` a site's ranks and their
  leader; ``options.py`` its settings (:class:`Sync`, :class:`Compression`,
  :class:`Connection`); ``adapt.py`` the per-worker controller (density, coding);
  ``progress.py`` the timings pushes carry and the progress line; ``modes.py`` the modes
  and outer presets (no torch); ``batch_noise.py`` :class:`BatchNoise`, the workers' Adam
  steps taken with the whole job's second moment;
- compression: ``compress.py`` top-k with error feedback, one selector per method and
  backend, shared by the per-tensor compressor and the flat one (its ``Engine``);
  ``native_select.py`` the checked wrapper of the C selection (the client's through
  ``_select_native.py``, the server's broadcast through ``stella_ps.topk``);
- the flat model on the worker: ``flat.py`` ``FlatParams`` (the parameters, left where
  they are, read and written as one flat float32 vector, one call an operation) and
  ``FlatCompressor`` (one residual, one selection over the sparse range, the dense
  suffix whole); ``_flat_native.py`` its C (``native/flat.c``);
- the wire: ``layout.py`` the flat model's coordinate space (workers and server
  alike); ``protocol.py`` every message (the server imports it); ``payload.py`` a
  message's tensor entries and raw frames to arrays and back; ``codec.py`` the
  codings and the wire's facts (bits per value, the dense cut); ``_codec_native.py`` its
  C; ``native_errors.py`` the checked-call boundary to C; ``protocol_docs.py`` the
  generated tables of docs/protocol.md;
- the connection: ``client.py`` the :class:`Client` API, ``_session.py`` its socket,
  reply matching, heartbeats and reconnect, ``_wire.py`` a message's frames onto the
  socket and off it; ``shards.py`` the same API over a sharded
  job; ``errors.py`` the exceptions;
- tools: ``cli.py`` the ``stella`` command; ``status.py`` ``stella status``'s table;
  ``checkpoint_file.py`` the checkpoint format (the server writes it); ``demo.py`` the
  demo and the benchmarks' data; ``planning/`` ``stella plan`` and ``stella profile``
  (a tool beside the library, which never imports it).
"""
import sys

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
    Stopped,
    Unauthorised,
    VersionError,
)

__all__ = [
    "BatchNoise",
    "Client",
    "PullResult",
    "Pending",
    "StellaOptimizer",
    "Compression",
    "Sync",
    "Connection",
    "PipelineError",
    "Stopped",
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
    "BatchNoise": "batch_noise",
    "StellaOptimizer": "pipeline",
    "Compression": "options",
    "Sync": "options",
    "Connection": "options",
    "ErrorFeedbackCompressor": "compress",
    "SparseGrad": "compress",
}

if "torch" in sys.modules:  # a training script, which imported torch first: torch costs nothing more here
    # and the site's module is loaded before the script's init_process_group can run (site.py says why that matters)
    from . import site as _site  # noqa: F401


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'stella' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{mod}", __name__), name)
