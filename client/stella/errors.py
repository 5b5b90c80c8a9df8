"""The package's exception hierarchy: one root, one subclass per thing that went wrong.

Errors the server reports travel as ``{"type": "error", "code": CODE, "message": ...}``;
:func:`from_reply` maps the code to the matching class so the caller sees the
server's own words.
"""
from __future__ import annotations

__all__ = [
    "StellaError",
    "ProtocolError",
    "CodecError",
    "OversizedMessage",
    "ServerError",
    "ServerUnavailable",
    "LayoutConflict",
    "NotRegistered",
    "VersionError",
    "StaleVersionError",
    "BadRequest",
    "from_reply",
]


class StellaError(Exception):
    """Root of every exception raised by Stella."""


class ProtocolError(StellaError):
    """A message broke the wire protocol (malformed, wrong frames, bad field)."""

    code = "protocol"


class CodecError(ProtocolError):
    """Coded index or value bytes are corrupt, truncated or out of range."""

    code = "codec"


class OversizedMessage(ProtocolError):
    """A message or one of its parts is larger than the protocol or the server allows."""

    code = "oversized"


class ServerError(StellaError):
    """The server refused a request; ``code`` names the reason, the text is the server's."""

    code = "server"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class ServerUnavailable(StellaError, TimeoutError):
    """No answer from the server within the call's timeout (down, unreachable, or busy)."""

    code = "unavailable"


class LayoutConflict(ServerError):
    """A registration's tensor names, shapes or dtypes differ from the server's model."""

    code = "layout_conflict"


class NotRegistered(ServerError):
    """The worker has not joined, or the model has not been registered yet."""

    code = "not_registered"


class VersionError(ServerError):
    """A version field is impossible (for example, from the future)."""

    code = "version"


class StaleVersionError(VersionError):
    """A push was computed on a version older than the server accepts."""

    code = "stale_version"


class BadRequest(ServerError, ProtocolError):
    """The server refused a malformed or invalid request (bad frames, indices, values,
    unknown tensor, oversized message, bad optimizer setting); ``code`` says which."""

    code = "bad_request"


_BY_CODE: dict[str, type[ServerError]] = {
    cls.code: cls for cls in (LayoutConflict, NotRegistered, VersionError, StaleVersionError)
}
_BY_CODE.update(dict.fromkeys(
    ("protocol", "codec", "oversized", "bad_value", "unknown_tensor", "optimizer", "worker_id"), BadRequest))


def from_reply(code: str, message: str) -> ServerError:
    """Build the exception for an error reply from the server."""
    cls = _BY_CODE.get(code, ServerError)
    return cls(f"[{code}] {message}", code=code)
