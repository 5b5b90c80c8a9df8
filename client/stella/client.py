"""``stella.Client``: the connection a training script uses to talk to ``stella-ps``.

A client owns one ZeroMQ DEALER socket. Requests carry an id and replies are
matched by it, so several requests can be in flight: ``push(..., wait=False)`` and
``pull(..., wait=False)`` return a :class:`Pending` whose ``result()`` waits for the
reply, which the pipelined optimizer uses to overlap a push and the following pull.
Every message is built and checked by :mod:`stella.protocol`. A client is not
thread-safe: use it from one thread (the pipeline gives its background thread its
own client).

Liveness and reconnect. Once joined, a client sends a heartbeat every
``heartbeat_s`` (the server says how often in its ``joined`` reply) from a thread
and a socket of its own, so a long forward/backward never looks like a dead
worker; the replies are the server's heartbeat. When the server stops answering
(no heartbeat reply within the server's liveness timeout, or no reply to a request
within ``timeout``), or answers that it does not know this worker (it restarted),
the client reconnects by itself: exponential backoff with full jitter, within the
overall ``reconnect`` deadline (``STELLA_RECONNECT_S``, 300 s by default; 0 turns
it off). It joins again, keeping its worker id where the server allows (its
session token takes the id to the new connection; a restarted server gives it
back), registers again (sending the values of the tensors it registered if the
server lost the model), and re-sends every request still waiting for its reply,
rebased on the server's version: a push computed on a version the server no
longer has is tagged with the server's version, a pull since such a version
becomes a full snapshot, and a pull that waited for a step is answered at once
(the push that step would take may have been lost with a restarted server). A
push that reached the server before the link broke is not queued twice (the
server remembers each worker's newest push). So a training
loop, and :class:`~stella.StellaOptimizer` on top of it, goes on through a server
restart and resumes from the server's version.
"""
from __future__ import annotations

import functools
import itertools
import logging
import os
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import msgspec
import numpy as np
import zmq
import zmq.auth

from .errors import ErrorCode, NotRegistered, ProtocolError, ServerError, ServerUnavailable, from_reply
from .protocol import (
    Delta,
    Error,
    Heartbeat,
    HeartbeatOk,
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
    SparseTensor,
    Status,
    StatusReply,
    TensorSpec,
    TrainingMode,
    ValueDtype,
    WorkerReport,
    decode_reply,
    decode_tensors,
    encode,
    encode_tensors,
)

__all__ = ["Client", "Pending", "PullResult", "ENV_TIMEOUT", "ENV_SERVER_KEY", "ENV_CLIENT_KEY", "ENV_RECONNECT",
           "default_timeout", "default_reconnect"]

log = logging.getLogger("stella.client")

ENV_TIMEOUT = "STELLA_TIMEOUT"
"""Environment variable: default timeout of every blocking call, in seconds (60 if unset)."""

ENV_SERVER_KEY = "STELLA_SERVER_KEY"
"""Environment variable: the server's public key (its ``.key`` certificate file, or the Z85 key)."""
ENV_CLIENT_KEY = "STELLA_CLIENT_KEY"
"""Environment variable: this client's key pair (the ``.key_secret`` certificate file)."""

ENV_RECONNECT = "STELLA_RECONNECT_S"
"""Environment variable: overall deadline of a reconnect, in seconds (300 if unset; 0: never reconnect)."""

BACKOFF_FIRST_S = 0.1  # first reconnect delay; doubled after each failed attempt (full jitter)
BACKOFF_MAX_S = 5.0
ATTEMPT_TIMEOUT_S = 5.0  # one reconnect attempt's join and registration wait at most this (or `timeout`)

_TORCH_DTYPES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16"}
T = TypeVar("T")


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None


def default_timeout() -> float:
    """``STELLA_TIMEOUT`` (seconds), read at call time; 60 when unset."""
    return _env_seconds(ENV_TIMEOUT, 60.0)


def default_reconnect() -> float:
    """``STELLA_RECONNECT_S`` (seconds), read at call time; 300 when unset."""
    return _env_seconds(ENV_RECONNECT, 300.0)


class _Lost(Exception):
    """The connection to the server is lost (internal: it starts a reconnect)."""


class _Liveness:
    """What the heartbeat thread and the client share: plain attributes, each written
    by one side only (the client: worker, session, interval; the thread: the rest)."""

    def __init__(self) -> None:
        self.worker = 0
        self.session = 0
        self.interval = 0.0
        self.last_ok = time.monotonic()  # the last heartbeat reply
        self.refused = -1  # a session the server said it does not know
        self.stop = threading.Event()


def _heartbeats(state: _Liveness, make_socket: Callable[[], zmq.Socket]) -> None:
    """The heartbeat thread: a ``heartbeat`` every ``interval`` on its own socket; the
    replies tell the client the server is alive (or has forgotten this worker)."""
    sock = make_socket()
    req = itertools.count(1)
    sessions: dict[int, int] = {}
    try:
        while not state.stop.is_set():
            interval = state.interval
            if sock.poll(0, zmq.POLLOUT):
                r = next(req)
                sessions[r] = state.session
                if len(sessions) > 64:
                    sessions.pop(next(iter(sessions)))
                sock.send_multipart(encode(Heartbeat(req=r, worker=state.worker, session=state.session)))
            until = time.monotonic() + interval
            while not state.stop.is_set():
                left = until - time.monotonic()
                if left <= 0:
                    break
                if not sock.poll(int(min(left, 0.1) * 1000) + 1, zmq.POLLIN):
                    continue
                try:
                    rx = decode_reply([p.buffer for p in sock.recv_multipart(copy=False)])
                except Exception:  # a garbled reply is no sign of life
                    continue
                if isinstance(rx.msg, HeartbeatOk):
                    state.last_ok = time.monotonic()
                elif isinstance(rx.msg, Error) and rx.msg.code == ErrorCode.NOT_REGISTERED.value:
                    state.refused = sessions.get(rx.msg.req, -1)
    finally:
        sock.close(linger=0)


def _dealer(ctx: zmq.Context, address: str, keys: tuple[bytes, bytes, bytes] | None) -> zmq.Socket:
    """A connected DEALER socket as every client socket is set up."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue a request for a peer that is not connected
    sock.setsockopt(zmq.HEARTBEAT_IVL, 5000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 30000)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
    if keys is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys
    sock.connect(address)
    return sock


def _stop_heartbeats(state: _Liveness, thread: threading.Thread | None) -> None:
    state.stop.set()
    if thread is not None and thread is not threading.current_thread():
        thread.join(5.0)


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
        rx = self._client._wait_resilient(self.req, timeout=self._timeout if timeout is None else timeout)
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

    ``reconnect`` (seconds; default ``STELLA_RECONNECT_S`` or 300, 0: never) bounds
    the automatic reconnect (see the module's doc); ``heartbeat`` False sends no
    heartbeats (the server then declares the worker gone when it is silent for its
    liveness timeout). :attr:`reconnects` counts the reconnects made.
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
        reconnect: float | None = None,
        heartbeat: bool = True,
    ):
        self.address = address
        self.reconnect = default_reconnect() if reconnect is None else float(reconnect)
        self.reconnects = 0
        self.server_version = 0  # the server's version in its last join/register reply
        self._seen_version = 0  # the newest version any reply showed
        # after a reconnect: the newest version this server has shown since (a push computed
        # on a newer one, which a server restarted from an older checkpoint never had, is tagged with it)
        self._seen_since_reconnect: int | None = None
        self._need_snapshot = False  # the server went back: the next pull is a full snapshot
        self._heartbeat_on = heartbeat
        self._joined = False  # a join succeeded: from then on a lost connection is reconnected
        self._live = _Liveness()
        self._hb_thread: threading.Thread | None = None
        self._sent: dict[int, tuple[Any, list[Any], float | None]] = {}  # requests waiting for replies
        self._registration: tuple[list[tuple[str, Any]], dict[str, Any]] | None = None
        self._mode: TrainingMode | None = None  # sent with every registration, a reconnect's too
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
        self._ctx = ctx or zmq.Context.instance()
        self._keys = curve_keys(server_key, client_key)
        self.secure = self._keys is not None
        self._sock = self._new_socket()
        self._finalizer = weakref.finalize(self, self._release, self._sock, self._live, None)
        if join:
            self.join(worker_id)

    def _new_socket(self) -> zmq.Socket:
        return _dealer(self._ctx, self.address, self._keys)

    @staticmethod
    def _release(sock: zmq.Socket, live: _Liveness, thread: threading.Thread | None) -> None:
        _stop_heartbeats(live, thread)
        sock.close(0)

    def _arm_finalizer(self) -> None:
        """Point the finalizer at the current socket and heartbeat thread."""
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, self._release, self._sock, self._live, self._hb_thread)

    def _start_heartbeats(self, reply: Joined) -> None:
        self._live.worker, self._live.session = reply.worker, reply.session
        self._live.interval = reply.heartbeat_s
        if not self._heartbeat_on or reply.heartbeat_s <= 0 or self._hb_thread is not None:
            return
        self._live.last_ok = time.monotonic()
        # the thread holds no reference to the client: a client dropped without close() is still finalized
        make = functools.partial(_dealer, self._ctx, self.address, self._keys)
        self._hb_thread = threading.Thread(target=_heartbeats, args=(self._live, make),
                                           name="stella-heartbeat", daemon=True)
        self._hb_thread.start()
        self._arm_finalizer()

    def _lost(self) -> str | None:
        """Why the connection counts as lost now (heartbeats), or None."""
        live = self._live
        if self._hb_thread is None or self.reconnect <= 0:
            return None
        if live.refused == live.session:
            return "the server does not know this worker (restarted, or declared it gone and gave its id away)"
        silent = time.monotonic() - live.last_ok
        if silent > max(4 * live.interval, 1.0):
            return f"no heartbeat reply for {silent:.1f}s"
        return None

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
            if self.reconnect > 0 and self._joined and not isinstance(msg, (Join, Register)):
                self._reconnect(f"cannot reach the server within {t:.1f}s")
            else:
                raise self._unavailable("cannot reach", t)
        req = next(self._req)
        frames = list(frames)
        self._transmit(msgspec.structs.replace(msg, req=req), frames)
        self._outstanding.add(req)
        # kept for re-sending after a reconnect (which redoes a join and a registration itself)
        if self.reconnect > 0 and self._joined and not isinstance(msg, (Join, Register)):
            self._sent[req] = (msg, frames, timeout)
        return req

    def _transmit(self, msg: Any, frames: list[Any]) -> None:
        parts = encode(msg, frames)
        self._sock.send_multipart(parts, copy=False)
        self.bytes_pushed += sum(memoryview(p).nbytes for p in parts)

    def _wait(self, req: int, timeout: float | None = None) -> Received:
        """Wait for the reply to request ``req``; raises the server's error if it sent one."""
        t = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + t
        while req not in self._replies:
            left = deadline - time.monotonic()
            if left <= 0:
                if req in self._sent:
                    raise _Lost(f"no reply within {t:.1f}s")
                self._outstanding.discard(req)
                raise self._unavailable("no reply from", t)
            if not self._sock.poll(int(min(left, 0.2) * 1000) + 1, zmq.POLLIN):
                why = self._lost() if req in self._sent else None
                if why:
                    raise _Lost(why)
                continue
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
            if (rx.msg.code == ErrorCode.NOT_REGISTERED.value and req in self._sent
                    and self._registration is not None):
                raise _Lost(f"the server does not know this worker: {rx.msg.message}")
            self._sent.pop(req, None)
            raise from_reply(rx.msg.code, rx.msg.message)
        self._sent.pop(req, None)
        return rx

    def _wait_resilient(self, req: int, timeout: float | None = None) -> Received:
        """:meth:`_wait`, reconnecting (and re-sending ``req``) when the connection is lost."""
        while True:
            try:
                return self._wait(req, timeout)
            except _Lost as e:
                self._reconnect(str(e))

    def _request(self, msg: Any, expect: type[T], frames: Iterable[Any] = (), timeout: float | None = None) -> T:
        rx = self._wait_resilient(self._send(msg, frames, timeout), timeout)
        return _expect(rx, expect)

    # ------------------------------------------------------------------ reconnect
    def _reconnect(self, why: str) -> None:
        """Connect again (backoff with full jitter, within ``reconnect`` seconds): join,
        register, re-send the requests waiting for replies; raises
        :class:`ServerUnavailable` when the deadline passes."""
        t0 = time.monotonic()
        deadline = t0 + self.reconnect
        log.warning("connection to stella-ps lost; reconnecting",
                    extra={"address": self.address, "reason": why, "worker": self.worker_id})
        delay, attempts, last = BACKOFF_FIRST_S, 0, why
        while True:
            attempts += 1
            try:
                self._reconnect_once(min(self.timeout, ATTEMPT_TIMEOUT_S))
                self.reconnects += 1
                log.warning("reconnected", extra={"address": self.address, "worker": self.worker_id,
                                                  "version": self.server_version, "attempts": attempts,
                                                  "seconds": round(time.monotonic() - t0, 3)})
                return
            except (ServerUnavailable, _Lost, NotRegistered) as e:
                last = str(e)
            pause = random.uniform(0, delay)
            if time.monotonic() + pause >= deadline:
                raise ServerUnavailable(f"gave up reconnecting to stella-ps at {self.address} after "
                                        f"{time.monotonic() - t0:.1f}s and {attempts} attempts (the reconnect "
                                        f"deadline, {ENV_RECONNECT}): {last}")
            time.sleep(pause)
            delay = min(2 * delay, BACKOFF_MAX_S)

    def _reconnect_once(self, t: float) -> None:
        self._sock.close(0)
        self._replies.clear()
        self._sock = self._new_socket()
        self._arm_finalizer()
        self._live.last_ok = time.monotonic()
        join = Join(worker=self.worker_id, name=self.name, session=self._live.session or None)
        try:
            joined = _expect(self._wait(self._send(join, (), t), t), Joined)
        except ServerError as e:
            if e.code != ErrorCode.WORKER_ID:
                raise
            # the old id is still held by a connection the server has not yet declared
            # gone, and this session is not known there: take a new id
            joined = _expect(self._wait(self._send(Join(name=self.name), (), t), t), Joined)
        self.worker_id = joined.worker
        self._start_heartbeats(joined)
        self.server_version = joined.version
        if self._registration is not None:
            items, optimizer = self._registration
            self.server_version = self._register(items, optimizer, t).version
        v = self.server_version
        if v < self._seen_version:
            log.warning("the server went back to an older version (restarted from a checkpoint); the next pull "
                        "is a full snapshot", extra={"version": v, "had": self._seen_version})
            self._need_snapshot = True
        self._seen_since_reconnect = v
        for req in sorted(self._sent):
            msg, frames, _ = self._sent[req]
            if isinstance(msg, Push):
                msg = msgspec.structs.replace(msg, version=min(msg.version, v))
            elif isinstance(msg, Pull) and (msg.since > v or (self._need_snapshot and msg.since >= 0)):
                msg = msgspec.structs.replace(msg, since=-1, wait_for=None)  # a snapshot, at once
            elif isinstance(msg, Pull) and msg.wait_for is not None:
                # answered at once, not when a step comes: the push that step would take may have
                # been lost with the server (acknowledged, then the server restarted) and then the
                # step waits for this worker while it waits for the step
                msg = msgspec.structs.replace(msg, wait_for=None)
            if hasattr(msg, "worker"):
                msg = msgspec.structs.replace(msg, worker=self.worker_id)
            self._sent[req] = (msg, frames, self._sent[req][2])
            self._transmit(msgspec.structs.replace(msg, req=req), frames)
            self._outstanding.add(req)

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
        self.server_version = self._seen_version = reply.version
        self._joined = True
        self._start_heartbeats(reply)
        return reply.worker

    def register(
        self,
        tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
        optimizer: Mapping[str, Any] | None = None,
        *,
        mode: TrainingMode | None = None,
        timeout: float | None = None,
    ) -> Registered:
        """Declare the model layout; the first registration also sends the initial values.

        ``mode`` ("gradient" or "update", as :class:`~stella.StellaOptimizer` sends it)
        makes the server refuse workers of the other mode in the same job.

        ``optimizer`` is the server-side optimizer (``{"name": "adamw", "lr": ...}``);
        None takes the server's default (``stella-ps --optimizer``). Later workers with
        the same layout join the existing model (pull a full snapshot afterwards); a
        different layout raises :class:`LayoutConflict`.
        """
        items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
        self._mode = mode
        reply = self._register(items, dict(optimizer or {}), timeout)
        # kept for a reconnect: a server that lost the model gets these tensors' values then
        self._registration = (items, dict(optimizer or {}))
        self.server_version = reply.version
        return reply

    def _register(self, items: list[tuple[str, Any]], optimizer: dict[str, Any], timeout: float | None) -> Registered:
        layout = [TensorSpec(n, tuple(int(s) for s in t.shape), _dtype_name(t)) for n, t in items]
        msg = Register(worker=self._worker(), tensors=layout, optimizer=optimizer, values=False, mode=self._mode)
        # joining a model sends no values; Register is not re-sent by a reconnect, which redoes it
        reply = _expect(self._wait(self._send(msg, (), timeout), timeout), Registered)
        if reply.needs_values:  # this registration initialises the model
            frames = [_to_numpy_f32(t) for _, t in items]
            reply = _expect(self._wait(self._send(msgspec.structs.replace(msg, values=True), frames, timeout),
                                       timeout), Registered)
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
            items.append(SparseTensor(self._tensor(name), None if idx is None else np.asarray(idx),
                                      _to_numpy_f32(vals)))
        entries, frames = encode_tensors(items, self.layout, index_coding, value_dtype)
        if self._seen_since_reconnect is not None:  # computed on a version this server never had
            version = min(int(version), self._seen_since_reconnect)
        msg = Push(worker=self._worker(), version=int(version), tensors=entries,
                   hparams=dict(hparams) if hparams else None, report=report)
        pending = Pending(self, self._send(msg, frames, timeout), self._push_ok, timeout)
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
        if self._need_snapshot and since is not None:
            since, wait_for = None, None  # the replica is of a history the server lost: its snapshot
        msg = Pull(worker=self._worker(), since=-1 if since is None else int(since), coding=index_coding,
                   wait_for=None if wait_for is None else int(wait_for),
                   timeout_ms=int(t * 1000 * 0.9))  # the server answers before we give up
        pending = Pending(self, self._send(msg, (), timeout), self._pull_result, timeout)
        return pending if not wait else pending.result()

    def _push_ok(self, rx: Received) -> PushOk:
        ok = _expect(rx, PushOk)
        self._saw(ok.version)
        return ok

    def _saw(self, version: int) -> None:
        self._seen_version = max(self._seen_version, version)
        if self._seen_since_reconnect is not None:
            self._seen_since_reconnect = max(self._seen_since_reconnect, version)

    def _pull_result(self, rx: Received) -> PullResult:
        _expect(rx, Delta)
        self._saw(rx.msg.version)
        if rx.msg.full:
            self._need_snapshot = False
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
        self.reconnect = 0.0  # a client on its way out does not reconnect
        self._sent.clear()
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

