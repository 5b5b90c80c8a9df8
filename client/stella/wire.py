"""The wire schema: every message type, its header fields, and their validation.

A message is a ZeroMQ multipart message. Frame 0 is a MessagePack map (the
header); array payloads follow as raw frames, in the order the header lists them.
This module is the single place that declares message types and header fields;
the server imports it (never the other way round). See docs/protocol.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from .errors import OversizedMessage, ProtocolError

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_HEADER_BYTES",
    "REQUESTS",
    "REPLIES",
    "DTYPES",
    "pack_header",
    "unpack_header",
    "TensorSpec",
]

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 1 << 20  # headers are small maps; anything bigger is refused
MAX_TENSORS = 65536

# Model dtypes a worker may register; the server keeps float32 masters for all.
DTYPES = ("float32", "float16", "bfloat16")

# Field schema per request type: name -> (python type(s), required).
_INT = int
REQUESTS: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    # Join the job; the server assigns a worker id or confirms the one asked for.
    "join": {"worker": ((_INT,), False), "name": ((str,), False)},
    # Leave cleanly; pushes already sent still count.
    "leave": {"worker": ((_INT,), True)},
    # Register the model layout (and, to initialise the store, its values).
    "register": {
        "worker": ((_INT,), True),
        "tensors": ((list,), True),
        "optimizer": ((dict,), True),
        "values": ((bool,), True),
    },
    # One step's gradient: per tensor sparse (index + value frames) or dense (value frame).
    "push": {"worker": ((_INT,), True), "version": ((_INT,), True), "tensors": ((list,), True)},
    # What changed since `since` (-1: full snapshot); optionally wait until version >= wait_for.
    "pull": {
        "worker": ((_INT,), True),
        "since": ((_INT,), True),
        "wait_for": ((_INT,), False),
        "timeout_ms": ((_INT,), False),
        "ic": ((str,), False),
    },
    # Server counters.
    "status": {},
    # Change optimizer hyper-parameters from the next step on (learning-rate schedules).
    "set_optimizer": {"worker": ((_INT,), True), "hparams": ((dict,), True)},
}

# Reply types; every reply echoes the request's "req" id.
REPLIES = ("joined", "left", "registered", "push_ok", "delta", "status", "optimizer_set", "error")


def pack_header(msg_type: str, req: int, **fields: Any) -> bytes:
    """Encode a header map with the protocol version and request id."""
    return msgpack.packb({"type": msg_type, "proto": PROTOCOL_VERSION, "req": req, **fields}, use_bin_type=True)


def unpack_header(frame: bytes | memoryview, *, expect: str = "request") -> dict[str, Any]:
    """Decode and validate a header frame.

    ``expect="request"`` checks the type against :data:`REQUESTS` and each field's
    type; ``expect="reply"`` checks only the envelope. Raises :class:`ProtocolError`
    with a message naming the problem.
    """
    if len(frame) > MAX_HEADER_BYTES:
        raise OversizedMessage(f"oversized header: {len(frame)} bytes > {MAX_HEADER_BYTES}")
    try:
        hdr = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_HEADER_BYTES,
            max_bin_len=0,
            max_array_len=MAX_TENSORS,
            max_map_len=MAX_TENSORS,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"malformed MessagePack header: {type(e).__name__}: {e}") from None
    if not isinstance(hdr, dict):
        raise ProtocolError(f"header must be a map, got {type(hdr).__name__}")
    if hdr.get("proto") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {hdr.get('proto')!r} not supported (server speaks {PROTOCOL_VERSION})")
    req = hdr.get("req")
    if not isinstance(req, int) or isinstance(req, bool):
        raise ProtocolError("header field 'req' must be an integer request id")
    msg_type = hdr.get("type")
    if expect == "reply":
        if msg_type not in REPLIES:
            raise ProtocolError(f"unknown reply type {msg_type!r}")
        return hdr
    if msg_type not in REQUESTS:
        raise ProtocolError(f"unknown message type {msg_type!r}; known: {sorted(REQUESTS)}")
    for name, (types, required) in REQUESTS[msg_type].items():
        if name not in hdr:
            if required:
                raise ProtocolError(f"{msg_type}: missing field {name!r}")
            continue
        v = hdr[name]
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            want = "/".join(t.__name__ for t in types)
            raise ProtocolError(f"{msg_type}: field {name!r} must be {want}, got {type(v).__name__}")
    return hdr


@dataclass(frozen=True)
class TensorSpec:
    """One registered tensor: its name, shape and dtype (the model's layout)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_wire(cls, obj: Any, max_numel: int = 2**31 - 1) -> "TensorSpec":
        if not isinstance(obj, dict):
            raise ProtocolError("tensor spec must be a map")
        name, shape, dtype = obj.get("name"), obj.get("shape"), obj.get("dtype")
        if not isinstance(name, str) or not name:
            raise ProtocolError("tensor spec: 'name' must be a non-empty string")
        if not isinstance(shape, list) or len(shape) > 8 or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
        ):
            raise ProtocolError(f"tensor {name!r}: 'shape' must be a list of at most 8 non-negative ints")
        if dtype not in DTYPES:
            raise ProtocolError(f"tensor {name!r}: dtype {dtype!r} not supported; known: {list(DTYPES)}")
        spec = cls(name, tuple(shape), dtype)
        if spec.numel > max_numel:
            raise ProtocolError(f"tensor {name!r}: {spec.numel} elements > limit {max_numel} (int32 indices)")
        return spec
