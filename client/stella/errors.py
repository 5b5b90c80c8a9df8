"""The package's exception hierarchy and the error codes of the wire protocol.

One root, :class:`StellaError`, never raised itself; one subclass per thing that
went wrong, each carrying its :class:`ErrorCode`. The server raises these same
classes when it refuses a request and sends ``code`` and the message back in an
``error`` reply; :func:`from_reply` turns that reply into the matching class on the
client, so the caller sees the server's own words.
"""
from __future__ import annotations

import os
from enum import Enum

__all__ = [
    "ErrorCode",
    "StellaError",
    "ProtocolError",
    "CodecError",
    "OversizedMessage",
    "BadValue",
    "ServerError",
    "ServerUnavailable",
    "Stopped",
    "LayoutConflict",
    "NotRegistered",
    "VersionError",
    "TransferLost",
    "Unauthorised",
    "BadRequest",
    "PipelineError",
    "from_reply",
    "unreadable",
    "IMAGE_UID",
]


class ErrorCode(str, Enum):
    """Why a request was refused: the ``code`` field of an ``error`` reply."""

    PROTOCOL = "protocol"  # malformed message: header, field types, frames
    CODEC = "codec"  # coded index or value bytes are corrupt, truncated or out of range
    OVERSIZED = "oversized"  # a message, frame or count is larger than allowed
    BAD_VALUE = "bad_value"  # NaN or Inf where finite values are required
    UNKNOWN_TENSOR = "unknown_tensor"  # a tensor number that is not in the model
    OPTIMIZER = "optimizer"  # unknown optimizer or hyper-parameter, or one out of range
    WORKER_ID = "worker_id"  # a worker id that cannot be given to this connection
    NOT_REGISTERED = "not_registered"  # not joined, or the model is not registered yet
    LAYOUT_CONFLICT = "layout_conflict"  # registration differs from the server's model
    VERSION = "version"  # an impossible version (from the future, too far ahead)
    UNAUTHORISED = "unauthorised"  # the sender's key is not (or no longer) on the server's allowlist
    LIMIT = "limit"  # a resource bound of the server (workers, waiting pulls, queued pushes, model bytes)
    TRANSFER = "transfer"  # a transfer (a chunked answer, an upload) the server no longer holds: start again
    INTERNAL = "internal"  # a bug in the server; the request changed nothing it could undo
    UNAVAILABLE = "unavailable"  # client side only: no answer in time


class StellaError(Exception):
    """Root of every exception raised by Stella; never raised itself.

    ``req``: the request id a refusal answers, where the message's header could be read
    far enough to know it (set by the decoder); -1 otherwise."""

    code: ErrorCode = ErrorCode.INTERNAL
    req: int = -1


class ProtocolError(StellaError):
    """A message broke the wire protocol (malformed, wrong frames, bad field)."""

    code = ErrorCode.PROTOCOL


class CodecError(ProtocolError):
    """Coded index or value bytes are corrupt, truncated or out of range."""

    code = ErrorCode.CODEC


class OversizedMessage(ProtocolError):
    """A message or one of its parts is larger than the protocol or the server allows."""

    code = ErrorCode.OVERSIZED


class BadValue(ProtocolError, ValueError):
    """Values that must be finite contain NaN or Inf."""

    code = ErrorCode.BAD_VALUE


class ServerError(StellaError):
    """The server refused a request; ``code`` names the reason, the text is the server's.

    The server raises the subclasses (or this class with an explicit ``code``) to
    refuse a request; the client gets the same class back from :func:`from_reply`.
    """

    code = ErrorCode.INTERNAL

    def __init__(self, message: str, code: ErrorCode | None = None):
        super().__init__(message)
        if code is not None:
            self.code = ErrorCode(code)


class ServerUnavailable(StellaError, TimeoutError):
    """No answer from the server within the call's timeout (down, unreachable, or busy)."""

    code = ErrorCode.UNAVAILABLE


class LayoutConflict(ServerError):
    """A registration's tensor names, shapes or dtypes differ from the server's model."""

    code = ErrorCode.LAYOUT_CONFLICT


class NotRegistered(ServerError):
    """The worker has not joined, or the model has not been registered yet."""

    code = ErrorCode.NOT_REGISTERED


class VersionError(ServerError):
    """A version field is impossible (for example, from the future)."""

    code = ErrorCode.VERSION


class Unauthorised(ServerError):
    """The server does not admit this client: its key is not (or no longer) on the
    server's allowlist, or is banned for a while; or the CurveZMQ handshake failed (the
    wrong server key, or keys on one side only). Raised as soon as the server says so,
    at the handshake or in reply to a request: no retry would help, the message says
    what to fix (a refused key is named by its fingerprint)."""

    code = ErrorCode.UNAUTHORISED


class TransferLost(ServerError):
    """The server no longer holds a transfer this worker was fetching or uploading (it
    expired, was replaced by a newer one, or the server restarted): the request that
    made it is sent again."""

    code = ErrorCode.TRANSFER


class PipelineError(StellaError):
    """:class:`~stella.StellaOptimizer`'s background exchange failed (the cause is
    chained), or on a site's other ranks, the leader's did (its words are in the
    message). Raised from the next ``step()``, ``synchronize()`` or ``close()``."""


class Stopped(PipelineError):
    """``stop()`` was called (a signal handler's way to end training): a wait for the
    server that was in progress then ended at once, and ``step()`` raises it from then on."""


class BadRequest(ServerError, ProtocolError):
    """The server refused a malformed or invalid request (bad frames, indices, values,
    unknown tensor, oversized message, bad optimizer setting) or one beyond a resource
    limit of the server (code ``limit``); ``code`` says which."""

    code = ErrorCode.PROTOCOL


_BY_CODE: dict[ErrorCode, type[ServerError]] = {
    ErrorCode.LAYOUT_CONFLICT: LayoutConflict,
    ErrorCode.NOT_REGISTERED: NotRegistered,
    ErrorCode.VERSION: VersionError,
    ErrorCode.UNAUTHORISED: Unauthorised,
    ErrorCode.TRANSFER: TransferLost,
    ErrorCode.INTERNAL: ServerError,
}


def from_reply(code: str, message: str) -> ServerError:
    """Build the exception for an ``error`` reply: the class its code maps to (codes of
    malformed or invalid requests give :class:`BadRequest`), with the server's message."""
    try:
        ec = ErrorCode(code)
    except ValueError:
        ec = ErrorCode.INTERNAL
    cls = _BY_CODE.get(ec, BadRequest)
    return cls(f"[{ec.value}] {message}", code=ec)


IMAGE_UID = 10001  # the user the Stella images run as (docker/)


def unreadable(path: str, e: OSError) -> str:
    """``e`` (reading ``path``) in words; a permission error names the uid this process
    runs as, and what to do where that is the Stella images' user (uid 10001)."""
    if not isinstance(e, PermissionError):
        return str(e)
    uid = os.geteuid()
    if uid == IMAGE_UID:
        return (f"permission denied: this container runs as uid {IMAGE_UID} (the Stella images' user), which cannot "
                f"read {path!r}; on the host, make the file readable by uid {IMAGE_UID} (`sudo chown {IMAGE_UID} "
                "FILE`: `stella keygen` writes secrets with mode 0600)")
    return (f"permission denied: this process runs as uid {uid}, which cannot read {path!r} (in the Stella images "
            f"the user is uid {IMAGE_UID})")
