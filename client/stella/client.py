"""``stella.Client``: the connection a training script uses to talk to ``stella-ps``.

A client owns one ZeroMQ DEALER socket. Requests carry an id and replies are
matched by it, so several requests can be in flight: ``push(..., wait=False)`` and
``pull(..., wait=False)`` return a :class:`Pending` whose ``result()`` waits for the
reply, which the pipelined optimizer uses to overlap a push and the following pull.
Every message is built and checked by :mod:`stella.protocol`. A client is not
thread-safe: use it from one thread (the pipeline gives its background thread its
own client).
"""
from __future__ import annotations

import itertools
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import msgspec
import numpy as np
import zmq
import zmq.auth

from .errors import ProtocolError, ServerUnavailable, from_reply
from .protocol import (
    Delta,
    Error,
    IndexCoding,
    Join,
    Joined,
    Leave,
    Left,
    ModelDtype,
    OptimizerSet,
    Pull,
    PullCoding,
    Push,
    PushOk,
    Received,
    Register,
    Registered,
    SetOptimizer,
    Status,
    StatusReply,
    TensorSpec,
    ValueDtype,
    WorkerReport,
    decode_reply,
    decode_tensors,
    encode,
    encode_tensors,
)

__all__ = ["Client", "Pending", "PullResult", "ENV_TIMEOUT", "ENV_SERVER_KEY", "ENV_CLIENT_KEY", "default_timeout"]

log = logging.getLogger("stella.client")

ENV_TIMEOUT = "STELLA_TIMEOUT"
"""Environment variable: default timeout of every blocking call, in seconds (60 if unset)."""

ENV_SERVER_KEY = "STELLA_SERVER_KEY"
"""Environment variable: the server's public key (its ``.key`` certificate file, or the Z85 key)."""
ENV_CLIENT_KEY = "STELLA_CLIENT_KEY"
"""Environment variable: this client's key pair (the ``.key_secret`` certificate file)."""

_TORCH_DTYPES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16"}
T = TypeVar("T")


def default_timeout() -> float:
    """``STELLA_TIMEOUT`` (seconds), read at call time; 60 when unset."""
    raw = os.environ.get(ENV_TIMEOUT, "60")
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{ENV_TIMEOUT}={raw!r} is not a number of seconds") from None


def _public_key(spec: str) -> bytes:
    """A Z85 public key from a certificate file's path or from the key itself."""
    if os.path.exists(spec):
        public, _ = zmq.auth.load_certificate(spec)
        return bytes(public)
    if len(spec) == 40:
        return spec.encode()
    raise ValueError(f"server key {spec!r} is neither a certificate file nor a 40-character Z85 key")


def curve_keys(server_key: str | None = None, client_key: str | None = None) -> tuple[bytes, bytes, bytes] | None:
    """``(server public, client public, client secret)`` for CurveZMQ, from the arguments
    or ``STELLA_SERVER_KEY`` / ``STELLA_CLIENT_KEY``; None when neither is set (plaintext,
    for a server started with ``--insecure``)."""
    server_key = server_key or os.environ.get(ENV_SERVER_KEY) or None
    client_key = client_key or os.environ.get(ENV_CLIENT_KEY) or None
    if server_key is None and client_key is None:
        return None
    if server_key is None or client_key is None:
        raise ValueError(f"CurveZMQ needs both the server's public key ({ENV_SERVER_KEY}) and this client's key "
                         f"pair ({ENV_CLIENT_KEY}); got only one")
    try:
        public, secret = zmq.auth.load_certificate(client_key)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the client's key pair from {client_key!r}: {e}") from None
    if not secret:
        raise ValueError(f"{client_key!r} holds no secret key: use the '.key_secret' file `stella keygen` wrote")
    return _public_key(server_key), bytes(public), bytes(secret)


def _to_numpy_f32(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor, without importing torch here
        x = x.detach().to("cpu")
        if str(x.dtype) != "torch.float32":
            x = x.float()
        return x.contiguous().numpy().reshape(-1)
    return np.ascontiguousarray(x, dtype=np.float32).reshape(-1)


def _dtype_name(x: Any) -> ModelDtype:
    if hasattr(x, "detach"):
        name = _TORCH_DTYPES.get(str(x.dtype))
    else:
        name = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}.get(np.asarray(x).dtype)
    if name is None:
        raise TypeError(f"unsupported tensor dtype {x.dtype}; use float32, float16 or bfloat16")
    return cast(ModelDtype, name)


@dataclass
class PullResult:
    """What changed on the server: per tensor name ``(indices or None if dense, float32 values)``."""

    version: int
    full: bool
    tensors: dict[str, tuple[np.ndarray | None, np.ndarray]]

    @property
    def count(self) -> int:
        return sum(v.size for _, v in self.tensors.values())

    def apply_to(self, params: Mapping[str, Any]) -> None:
        """Install the values into local tensors (NumPy arrays or torch tensors, any device)."""
        for name, (idx, vals) in self.tensors.items():
            dst = params[name]
            if hasattr(dst, "detach"):
                import torch

                flat = dst.detach().view(-1)
                # frames are read-only buffers; torch wants writable memory
                src = torch.from_numpy(vals if vals.flags.writeable else vals.copy()).to(flat.device, flat.dtype)
                if idx is None:
                    flat.copy_(src)
                else:
                    flat[torch.from_numpy(idx.astype(np.int64)).to(flat.device)] = src
            else:
                flat = dst.reshape(-1)
                if idx is None:
                    flat[:] = vals
                else:
                    flat[idx] = vals


class Pending(Generic[T]):
    """A request in flight; :meth:`result` waits for its reply (once)."""

    def __init__(self, client: Client, req: int, parse: Callable[[Received], T], timeout: float | None):
        self._client, self.req, self._parse, self._timeout = client, req, parse, timeout

    def result(self, timeout: float | None = None) -> T:
        """The parsed reply; raises the server's error, or :class:`ServerUnavailable`."""
        rx = self._client._wait(self.req, timeout=self._timeout if timeout is None else timeout)
        return self._parse(rx)


class Client:
    """Connection to one stella-ps.

    ``Client(address)`` connects and joins; ``register`` declares the model (the first
    registration initialises the server's store); then ``push`` and ``pull`` each step.
    Every blocking call takes ``timeout`` (seconds; default ``STELLA_TIMEOUT`` or 60) and
    raises :class:`ServerUnavailable` when it passes.

    ``server_key`` (the server's public certificate file or Z85 key) and ``client_key``
    (this client's ``.key_secret`` certificate file), or ``STELLA_SERVER_KEY`` and
    ``STELLA_CLIENT_KEY``, turn on CurveZMQ: encryption, and authentication on both
    sides. Without them the client speaks plaintext, which only a server started with
    ``--insecure`` accepts.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = None,
        name: str = "",
        worker_id: int | None = None,
        join: bool = True,
        server_key: str | None = None,
        client_key: str | None = None,
        ctx: zmq.Context | None = None,
    ):
        self.address = address
        self.timeout = default_timeout() if timeout is None else float(timeout)
        self.name = name or f"pid{os.getpid()}"
        self.worker_id: int | None = worker_id
        self.layout: list[TensorSpec] = []
        self._index: dict[str, int] = {}
        self.bytes_pushed = 0
        self.bytes_pulled = 0
        self._req = itertools.count(1)
        self._replies: dict[int, Received] = {}
        self._outstanding: set[int] = set()
        ctx = ctx or zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue a request for a peer that is not connected
        sock.setsockopt(zmq.HEARTBEAT_IVL, 5000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 30000)
        keys = curve_keys(server_key, client_key)
        self.secure = keys is not None
        if keys is not None:
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys
        sock.connect(address)
        self._sock = sock
        self._finalizer = weakref.finalize(self, sock.close, 0)
        if join:
            self.join(worker_id)

    # ------------------------------------------------------------------ plumbing
    def _unavailable(self, what: str, t: float) -> ServerUnavailable:
        hint = ("; is this client's key on the server's allowlist, and the server's key the right one?"
                if self.secure else f"; a server that runs with keys needs {ENV_SERVER_KEY} and {ENV_CLIENT_KEY}")
        return ServerUnavailable(f"{what} stella-ps at {self.address} within {t:.1f}s "
                                 f"(the timeout argument, or {ENV_TIMEOUT} for the default){hint}")

    def _send(self, msg: Any, frames: Iterable[Any] = (), timeout: float | None = None) -> int:
        """Send a request built without its id; returns the id for :meth:`_wait`."""
        if self._sock.closed:
            raise ServerUnavailable("client is closed")
        t = self.timeout if timeout is None else timeout
        if not self._sock.poll(int(t * 1000), zmq.POLLOUT):
            raise self._unavailable("cannot reach", t)
        req = next(self._req)
        parts = encode(msgspec.structs.replace(msg, req=req), list(frames))
        self._sock.send_multipart(parts, copy=False)
        self.bytes_pushed += sum(memoryview(p).nbytes for p in parts)
        self._outstanding.add(req)
        return req

    def _wait(self, req: int, timeout: float | None = None) -> Received:
        """Wait for the reply to request ``req``; raises the server's error if it sent one."""
        t = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + t
        while req not in self._replies:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(max(left, 0) * 1000) + 1, zmq.POLLIN):
                self._outstanding.discard(req)
                raise self._unavailable("no reply from", t)
            parts = self._sock.recv_multipart(copy=False)
            self.bytes_pulled += sum(len(p) for p in parts)
            rx = decode_reply([p.buffer for p in parts])
            if rx.msg.req in self._outstanding:
                self._replies[rx.msg.req] = rx
            else:  # a reply to a request given up on (timed out) is dropped
                log.debug("dropped a reply to an abandoned request", extra={"req": rx.msg.req})
        self._outstanding.discard(req)
        rx = self._replies.pop(req)
        if isinstance(rx.msg, Error):
            raise from_reply(rx.msg.code, rx.msg.message)
        return rx

    def _request(self, msg: Any, expect: type[T], frames: Iterable[Any] = (), timeout: float | None = None) -> T:
        rx = self._wait(self._send(msg, frames, timeout), timeout)
        return _expect(rx, expect)

    def _tensor(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in the registered model") from None

    def _worker(self) -> int:
        if self.worker_id is None:
            raise ProtocolError("this client has not joined (Client(..., join=False)); call join() first")
        return self.worker_id

    # ------------------------------------------------------------------ API
    def join(self, worker_id: int | None = None, *, timeout: float | None = None) -> int:
        """Join the job (as ``worker_id`` if given: a restarted worker); returns the id."""
        reply = self._request(Join(worker=worker_id, name=self.name), Joined, timeout=timeout)
        self.worker_id = reply.worker
        return reply.worker

    def register(
        self,
        tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
        optimizer: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
    ) -> Registered:
        """Declare the model layout; the first registration also sends the initial values.

        ``optimizer`` is the server-side optimizer (``{"name": "adamw", "lr": ...}``);
        None takes the server's default (``stella-ps --optimizer``). Later workers with
        the same layout join the existing model (pull a full snapshot afterwards); a
        different layout raises :class:`LayoutConflict`.
        """
        items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
        layout = [TensorSpec(n, tuple(int(s) for s in t.shape), _dtype_name(t)) for n, t in items]
        msg = Register(worker=self._worker(), tensors=layout, optimizer=dict(optimizer or {}), values=False)
        reply = self._request(msg, Registered, timeout=timeout)  # joining a model sends no values
        if reply.needs_values:  # this registration initialises the model
            frames = [_to_numpy_f32(t) for _, t in items]
            reply = self._request(msgspec.structs.replace(msg, values=True), Registered, frames, timeout)
        self.layout = layout
        self._index = {s.name: i for i, s in enumerate(layout)}
        return reply

    def push(
        self,
        grads: Mapping[str, Any],
        version: int,
        *,
        value_dtype: ValueDtype = "f32",
        index_coding: IndexCoding = "rice",
        hparams: Mapping[str, Any] | None = None,
        report: WorkerReport | None = None,
        timeout: float | None = None,
        wait: bool = True,
    ) -> Any:
        """Push one step's update, computed on model ``version``.

        ``grads`` maps tensor names to a sparse update (an object with ``indices``
        and ``values``, e.g. :class:`stella.compress.SparseGrad`, or a pair
        ``(indices, values)`` with sorted unique indices; ``indices`` None means dense)
        or to a dense array. Values travel as ``value_dtype``: "f32" by default, exact;
        "f16"/"bf16" round them and "q4"/"q2" quantise them to 4 or 2 bits with a
        scale per 64 values, dense entries included (the compressor keeps that error
        in its residual when it is told the dtype; docs/compression.md). ``hparams`` change optimizer
        hyper-parameters from the step this push joins on (no extra round trip).
        ``report``: this worker's timings, shown by ``stella status`` and the metrics.
        Returns :class:`~stella.protocol.PushOk` (``step`` the push joined), or a
        :class:`Pending` of it with ``wait=False``.
        """
        items = []
        for name, g in grads.items():
            if hasattr(g, "indices") and hasattr(g, "values"):
                idx, vals = g.indices, g.values
            elif isinstance(g, tuple):
                idx, vals = g
            else:
                idx, vals = None, g
            items.append((self._tensor(name), None if idx is None else np.asarray(idx), _to_numpy_f32(vals)))
        entries, frames = encode_tensors(items, self.layout, index_coding, value_dtype)
        msg = Push(worker=self._worker(), version=int(version), tensors=entries,
                   hparams=dict(hparams) if hparams else None, report=report)
        pending = Pending(self, self._send(msg, frames, timeout), lambda rx: _expect(rx, PushOk), timeout)
        return pending if not wait else pending.result()

    def pull(
        self,
        since: int | None = None,
        *,
        wait_for: int | None = None,
        index_coding: PullCoding = "rice",
        timeout: float | None = None,
        wait: bool = True,
    ) -> Any:
        """What changed after version ``since`` (None: a full snapshot), a :class:`PullResult`
        (or a :class:`Pending` of it with ``wait=False``).

        With ``wait_for``, the server holds the reply until its version reaches it
        (or ``timeout`` passes, then it answers with what it has).
        """
        t = self.timeout if timeout is None else timeout
        msg = Pull(worker=self._worker(), since=-1 if since is None else int(since), coding=index_coding,
                   wait_for=None if wait_for is None else int(wait_for),
                   timeout_ms=int(t * 1000 * 0.9))  # the server answers before we give up
        pending = Pending(self, self._send(msg, (), timeout), self._pull_result, timeout)
        return pending if not wait else pending.result()

    def _pull_result(self, rx: Received) -> PullResult:
        _expect(rx, Delta)
        out: dict[str, tuple[np.ndarray | None, np.ndarray]] = {}
        for s in decode_tensors(rx, self.layout):
            if s.values.dtype != np.float32:  # exact values, so that replicas never drift
                raise ProtocolError(f"delta values must be f32, got {s.values.dtype}")
            out[self.layout[s.tensor].name] = (s.indices, s.values)
        return PullResult(rx.msg.version, rx.msg.full, out)

    def status(self, *, timeout: float | None = None) -> dict[str, Any]:
        """The server's counters (see docs/protocol.md, ``status``)."""
        reply = self._request(Status(), StatusReply, timeout=timeout)
        out = msgspec.to_builtins(reply)  # nested structs (the live workers) as plain dicts too
        return {k: v for k, v in out.items() if k not in ("proto", "req", "type")}

    def set_optimizer(self, *, timeout: float | None = None, **hparams: Any) -> dict[str, Any]:
        """Change optimizer hyper-parameters (e.g. ``lr``) from the next step on."""
        return self._request(SetOptimizer(worker=self._worker(), hparams=hparams), OptimizerSet,
                             timeout=timeout).optimizer

    def leave(self, *, timeout: float | None = None) -> None:
        if self.worker_id is not None:
            self._request(Leave(worker=self.worker_id), Left, timeout=timeout)

    def close(self, *, leave: bool = True, timeout: float = 5.0) -> None:
        """Leave the job (best effort) and close the socket; safe to call twice."""
        if self._sock.closed:
            return
        if leave and self.worker_id is not None:
            try:
                self.leave(timeout=timeout)
            except Exception:
                pass
        self._finalizer()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _expect(rx: Received, cls: type[T]) -> T:
    """The reply's message if it is a ``cls``."""
    if not isinstance(rx.msg, cls):
        raise ProtocolError(f"expected a {cls.__name__} reply, got {type(rx.msg).__name__}")
    return rx.msg

