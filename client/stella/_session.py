"""The connection under :class:`stella.Client`: one ZeroMQ DEALER socket and what keeps it
working through failures.

A :class:`Session` numbers requests and matches replies by id (several may be in
flight), sends a heartbeat every ``heartbeat_s`` from a thread and a socket of its own
(so a long forward/backward never looks like a dead worker), and reconnects by itself
when the server stops answering (no heartbeat reply within the server's liveness
timeout, or no reply to a request within ``timeout``) or answers that it does not
know this worker (it restarted): exponential backoff with full jitter, within
``reconnect_s`` seconds (``STELLA_RECONNECT_S``, 300 by default; 0 turns it off).
It joins again, keeping its worker id where the server allows (the session token takes
the id to the new connection; a restarted server gives it back), registers again
(sending the tensors' values if the server lost the model), and re-sends every request
still waiting for its reply, rebased on the server's version by :func:`rebase`, the
one home of those rules. A push that reached the server before the link broke is not
queued twice (the server remembers each worker's newest push).

It also holds the CurveZMQ keys, watches each socket's handshakes through ZeroMQ's
socket monitor (:class:`_Handshakes`: a server that refuses this client's key says so
at once, and :class:`~stella.errors.Unauthorised` is raised then, naming the key's
fingerprint, instead of a timeout), and the finalizer that closes the sockets and
stops the heartbeat thread of a client dropped without ``close()``. The API on top, and the
conversion of tensors, is :mod:`stella.client`'s.
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
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import numpy as np
import zmq
import zmq.auth
from zmq.utils.monitor import parse_monitor_message

from ._wire import receive_message, send_message, writable
from .errors import (
    ErrorCode,
    NotRegistered,
    ProtocolError,
    ServerError,
    ServerUnavailable,
    Stopped,
    TransferLost,
    Unauthorised,
    from_reply,
    unreadable,
)
from .payload import model_digest
from .protocol import (
    Chunk,
    Chunked,
    Error,
    Fetch,
    Heartbeat,
    HeartbeatOk,
    Join,
    Joined,
    Leave,
    Pull,
    Push,
    Received,
    Register,
    Registered,
    SetOptimizer,
    TensorSpec,
    TrainingMode,
    Upload,
    Uploaded,
    decode_reply,
    encode,
    encode_header,
    key_fingerprint,
)

__all__ = ["Session", "rebase", "curve_keys", "default_timeout", "default_reconnect", "ENV_TIMEOUT",
           "ENV_SERVER_KEY", "ENV_CLIENT_KEY", "ENV_RECONNECT"]

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
STOP_GRACE_S = 1.0  # after a stop() that ended a wait: each request's timeout (a closing worker's push and leave)
# Large messages over slow links (issue 45): an answer larger than CHUNK_ABOVE bytes comes as a transfer,
# fetched in pieces with FETCH_WINDOW of them in flight (one on the link, one queued behind it); a model's
# values larger than that go up in pieces too. Each piece is sized to take about PIECE_S on the link as
# measured so far (between PIECE_MIN and PIECE_MAX bytes), so that no request outlasts its timeout and a
# reconnect costs at most the pieces in flight, whatever the link's rate.
CHUNK_ABOVE = 4 << 20
FETCH_WINDOW = 2
PIECE_S = 0.5
PIECE_FIRST, PIECE_MIN, PIECE_MAX = 1 << 20, 256 << 10, 16 << 20
TRANSFER_RETRIES = 3  # a request whose transfer the server lost is sent again at most this often
# handshakes the server closes without a word, in a row, before the client concludes that it holds the
# wrong server key (one alone can be a server going down mid-handshake)
SILENT_HANDSHAKE_FAILURES = 3

T = TypeVar("T")
M = TypeVar("M")


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


def rebase(msg: M, server_version: int, need_snapshot: bool, worker: int, same_server: bool = False) -> M:
    """A request made before a reconnect, as it is sent after it: the server may have
    restarted, from a checkpoint older than what this worker saw. Pure; the rules:

    - a push is tagged with at most ``server_version``: it was computed on a version this
      server may never have had, and a push from the future would be refused;
    - a pull since a version the server does not have (``since > server_version``), or
      any incremental pull when ``need_snapshot`` (the server went back, so the replica
      holds a history the server lost), becomes a full snapshot, answered at once;
    - a pull that waited for a step (``wait_for``) is answered at once: the push that
      step would take may have been lost with the server (acknowledged, then the server
      restarted), and the step would wait for this worker while it waits for the step.
      Unless ``same_server``: the join found this worker's session, so the server did not
      restart and holds every push it acknowledged (a re-sent one is not queued twice);
      answered at once, the pull would end the round and the worker push again into the
      queue of a step that cannot close yet;
    - every request that names a worker names ``worker``, the id the new connection has.

    Anything else (status; join, register and heartbeats, which a reconnect redoes
    rather than re-sends) is returned as it is.
    """
    replace = msgspec.structs.replace
    if isinstance(msg, Push):
        return replace(msg, worker=worker, version=min(msg.version, server_version))
    if isinstance(msg, Pull):
        if msg.since > server_version or (need_snapshot and msg.since >= 0):
            return replace(msg, worker=worker, since=-1, wait_for=None)
        return replace(msg, worker=worker, wait_for=msg.wait_for if same_server else None)
    if isinstance(msg, (SetOptimizer, Leave, Fetch)):
        return replace(msg, worker=worker)
    return msg


def _byte_views(frames: Iterable[Any]) -> list[memoryview]:
    """Each frame's bytes, as a flat byte view (no copy of a contiguous array)."""
    out = []
    for f in frames:
        m = memoryview(f) if not isinstance(f, np.ndarray) else np.ascontiguousarray(f).reshape(-1).view(np.uint8).data
        out.append(m if m.format == "B" and m.ndim == 1 else m.cast("B"))
    return out


class _Lost(Exception):
    """The connection to the server is lost (internal: it starts a reconnect)."""


class _Pieces:
    """The pace of a transfer's pieces: each sized to take about ``PIECE_S`` at the rate
    measured on the ones before (a piece's time is from the end of the one before it: the
    window keeps the link busy, so that is the link's time for it)."""

    def __init__(self) -> None:
        self.size = PIECE_FIRST
        self.last = time.monotonic()

    def done(self, n: int) -> None:
        now = time.monotonic()
        rate = n / max(now - self.last, 1e-3)
        self.last = now
        self.size = int(min(PIECE_MAX, max(PIECE_MIN, rate * PIECE_S)))


@dataclass(eq=False)
class _Assembly:
    """A ``chunked`` answer being fetched: the bytes so far, the fetches in flight (re-sent
    by a reconnect, as every request waiting for its reply is) and the request that made
    it (sent again if the server loses the transfer; None when it is not re-sendable)."""

    transfer: int
    sizes: list[int]
    entry: tuple[Any, list[Any], float | None] | None
    buffer: bytearray = field(init=False)
    have: int = 0  # bytes in, from the start
    next: int = 0  # the next piece's first byte
    inflight: deque[tuple[int, int, int]] = field(default_factory=deque)  # (fetch request, offset, bytes)
    pace: _Pieces = field(default_factory=_Pieces)

    def __post_init__(self) -> None:
        self.buffer = bytearray(sum(self.sizes))

    @property
    def total(self) -> int:
        return len(self.buffer)


class _Liveness:
    """What the heartbeat thread and the session share: plain attributes, each written
    by one side only (the session: worker, session, interval; the thread: the rest)."""

    def __init__(self) -> None:
        self.worker = 0
        self.session = 0
        self.interval = 0.0
        self.lost_after = 1.0  # seconds without a heartbeat reply after which the connection is lost
        self.last_ok = time.monotonic()  # the last heartbeat reply
        self.refused = -1  # a session the server said it does not know ...
        self.refused_sent = 0.0  # ... in reply to a heartbeat sent then (monotonic)
        self.stop = threading.Event()


def _heartbeats(state: _Liveness, make_socket: Callable[[], zmq.Socket]) -> None:
    """The heartbeat thread: a ``heartbeat`` every ``interval`` on its own socket; the
    replies tell the client the server is alive (or has forgotten this worker)."""
    sock = make_socket()
    req = itertools.count(1)
    sessions: dict[int, tuple[int, float]] = {}  # request -> (session, when sent)
    try:
        while not state.stop.is_set():
            interval = state.interval
            if sock.poll(0, zmq.POLLOUT):
                r = next(req)
                sessions[r] = (state.session, time.monotonic())
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
                    session, sent = sessions.get(rx.msg.req, (-1, 0.0))
                    state.refused_sent = sent
                    state.refused = session
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
    return sock


_MONITORS = itertools.count()


class _Handshakes:
    """The monitor of one DEALER socket, told only about its handshakes: it tells a
    server that refuses this client (the ZAP handler's 400 for a key not on the
    allowlist, a mechanism mismatch: one side without keys, or handshakes the server
    closes unread: the wrong server key) from one that is merely slow or down."""

    EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
              | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_DISCONNECTED)

    def __init__(self, sock: zmq.Socket, address: str, keys: tuple[bytes, bytes, bytes] | None):
        # before connect(): no handshake goes unseen. pyzmq's default endpoint is named after the
        # socket's fd, which a new socket may reuse before libzmq's reaper released the old
        # endpoint (EADDRINUSE): each monitor gets a name of its own
        inproc = f"inproc://stella-handshakes-{next(_MONITORS)}"
        sock.monitor(inproc, self.EVENTS)
        self._watched = sock
        self.socket = sock.context.socket(zmq.PAIR)
        # no high-water mark: libzmq's IO thread sends the events blocking, so a reader that fell 1,000
        # events behind (a client idle while its connection flaps) would stop every socket of the context
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.connect(inproc)
        self.address, self.keys = address, keys
        self._silent = 0  # handshakes closed without a word, in a row
        # the connection dropped under the socket (libzmq connects again by itself, but what was in
        # flight on it is lost, and the server knows the new connection by another routing id)
        self.dropped = False
        # why the server refused: for good, since libzmq does not reconnect after a refused
        # (ZAP) or mismatched handshake, so every later call on this socket says it again
        self.refused: str | None = None

    def check(self) -> None:
        """Read the events so far; raises :class:`Unauthorised` if the server refused."""
        while self.refused is None and self.socket.poll(0):
            ev = parse_monitor_message(self.socket.recv_multipart())
            kind, value = ev["event"], int(ev["value"])
            if kind == zmq.EVENT_DISCONNECTED:
                self.dropped = True
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._silent = 0
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.refused = self._refused(value)
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                self.refused = self._protocol(value)
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                self._silent += 1
                if self._silent >= SILENT_HANDSHAKE_FAILURES:
                    self.refused = self._silent_server()
        if self.refused is not None:
            raise Unauthorised(self.refused)

    def _refused(self, status: int) -> str:
        if self.keys is None:  # pragma: no cover - a plaintext client meets no ZAP handler of ours
            return f"stella-ps at {self.address} refused this client (ZAP status {status})"
        public = self.keys[1].decode()
        return (f"stella-ps at {self.address} refused this client's key (fingerprint {key_fingerprint(public)}, "
                f"ZAP status {status}): it is not on the server's allowlist (or is banned for a while after an "
                f"oversized message). Add its line to the server's allowlist, as `stella keygen` printed it: "
                f"'{public} <name>'")

    def _protocol(self, error: int) -> str:
        if error != zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return f"the CurveZMQ handshake with stella-ps at {self.address} failed (protocol error {error:#x})"
        if self.keys is None:
            return self._needs_keys()
        return (f"stella-ps at {self.address} runs without keys (--insecure), and this client has CurveZMQ keys "
                f"({ENV_SERVER_KEY}/{ENV_CLIENT_KEY}): unset them to talk to it")

    def _needs_keys(self) -> str:
        return (f"stella-ps at {self.address} requires CurveZMQ keys, and this client has none: set "
                f"{ENV_SERVER_KEY} (the server's public key file) and {ENV_CLIENT_KEY} (this client's "
                "'.key_secret', whose public key is on the server's allowlist)")

    def _silent_server(self) -> str:
        if self.keys is None:  # a mismatch; the server may close before its error reaches a plaintext client
            return self._needs_keys()
        return (f"stella-ps at {self.address} closed {self._silent} CurveZMQ handshakes in a row before it could "
                f"check this client's key: {ENV_SERVER_KEY} is most likely not that server's public key (the one "
                f"used has the fingerprint {key_fingerprint(self.keys[0].decode())}; a server logs its own at start, "
                "`server_key_fingerprint`)")

    def close(self) -> None:
        """Stop the monitor, then close its reader; before the watched socket is closed.
        libzmq keeps a closed socket's monitor until the reaper destroys it, and the
        teardown's events (a connection dropped) are sent from the context's IO thread,
        blocking: to a reader already gone, that send never returns, and every socket of
        the context (every client of the process) stops connecting."""
        if not self._watched.closed:
            self._watched.disable_monitor()
        self.socket.close(linger=0)


def _connected(ctx: zmq.Context, address: str, keys: tuple[bytes, bytes, bytes] | None) -> zmq.Socket:
    """A DEALER connected to ``address`` (the heartbeat thread's: the session's own
    socket watches the handshakes)."""
    sock = _dealer(ctx, address, keys)
    sock.connect(address)
    return sock


def _release(sock: zmq.Socket, handshakes: _Handshakes, live: _Liveness, thread: threading.Thread | None) -> None:
    """The finalizer: stop the heartbeat thread, close the sockets. It holds no reference
    to the session, so a client dropped without ``close()`` is still finalized."""
    live.stop.set()
    if thread is not None and thread is not threading.current_thread():
        thread.join(5.0)
    handshakes.close()  # first: see _Handshakes.close
    sock.close(0)


def _public_key(spec: str) -> bytes:
    """A Z85 public key from a certificate file's path or from the key itself."""
    if os.path.exists(spec):
        try:
            public, _ = zmq.auth.load_certificate(spec)
        except OSError as e:
            raise ValueError(f"cannot read the server's public key from {spec!r}: {unreadable(spec, e)}") from None
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
    except OSError as e:
        raise ValueError(f"cannot read the client's key pair from {client_key!r}: {unreadable(client_key, e)}") \
            from None
    except ValueError as e:
        raise ValueError(f"cannot read the client's key pair from {client_key!r}: {e}") from None
    if not secret:
        raise ValueError(f"{client_key!r} holds no secret key: use the '.key_secret' file `stella keygen` wrote")
    return _public_key(server_key), bytes(public), bytes(secret)


def expect(rx: Received, cls: type[T]) -> T:
    """The reply's message if it is a ``cls``."""
    if not isinstance(rx.msg, cls):
        raise ProtocolError(f"expected a {cls.__name__} reply, got {type(rx.msg).__name__}")
    return rx.msg


@dataclass
class _Registration:
    """What a reconnect registers again: the layout, the range of the flat model and the
    dense cut it was laid out with, the optimizer and mode asked for, and how to read the
    range's current values, a frame per part (for a server that lost the model)."""

    layout: list[TensorSpec]
    start: int
    stop: int
    dense_below: int
    optimizer: dict[str, Any]
    mode: TrainingMode | None
    values: Callable[[], list[np.ndarray]]
    version: int = 0  # of the job's model the values are (a resuming worker's)
    # the id of this registration's upload in pieces (a reconnect's upload goes on where the server stands)
    upload: int = field(default_factory=lambda: random.getrandbits(63) or 1)


class Session:
    """One connection to a stella-ps (see the module doc). Not thread-safe, like the
    :class:`~stella.Client` that owns it; the heartbeat thread shares only
    :class:`_Liveness` with it."""

    def __init__(self, address: str, *, timeout: float, reconnect_s: float, name: str, worker_id: int | None,
                 server_key: str | None, client_key: str | None, ctx: zmq.Context | None, heartbeat: bool):
        self.address, self.timeout, self.reconnect_s, self.name = address, timeout, reconnect_s, name
        self.worker_id = worker_id
        self.reconnects = 0
        self.server_version = 0  # the server's version in its last join/register reply
        self.shard = ""  # "I/N" when the server is a shard of a sharded job (its join reply says)
        self.dense_below = 0  # the server's dense cut (its join reply says): how the model is laid out flat
        self.bytes_pushed = 0
        self.bytes_pulled = 0
        self._seen_version = 0  # the newest version any reply showed
        # after a reconnect: the newest version this server has shown since (a push computed
        # on a newer one, which a server restarted from an older checkpoint never had, is tagged with it)
        self._seen_since_reconnect: int | None = None
        self.need_snapshot = False  # the server went back: the next pull is a full snapshot
        self._same_server = False  # the latest reconnect found this session's server (rebase's same_server)
        self._heartbeat_on = heartbeat
        self._joined = False  # a join succeeded: from then on a lost connection is reconnected
        self._live = _Liveness()
        self._joined_at = 0.0  # when the last join succeeded (monotonic)
        self._hb_thread: threading.Thread | None = None
        self._sent: dict[int, tuple[Any, list[Any], float | None]] = {}  # requests waiting for replies
        self._rebased: set[int] = set()  # pulls that a reconnect rebased (rebase: wait_for dropped or a snapshot)
        self._registration: _Registration | None = None
        self._req = itertools.count(1)
        self._replies: dict[int, Received] = {}
        self._outstanding: set[int] = set()
        self._pairs: dict[int, int] = {}  # a push sent with its pull (send_pair) -> the pull's id
        self._assemblies: dict[int, _Assembly] = {}  # requests whose chunked answers are being fetched
        self._registered: Registered | None = None  # the last registration's reply
        self._transfers_lost: dict[int, int] = {}  # requests sent again because the server lost their transfer
        self._pieces: set[int] = set()  # upload pieces waiting for their replies
        # stop(): when it was called (monotonic; a float, set from a signal handler with no lock), and
        # whether it ended a wait then: requests after that get STOP_GRACE_S, not the timeout
        self._stop_at: float | None = None
        self._interrupted = False
        self._ctx = ctx or zmq.Context.instance()
        self._keys = curve_keys(server_key, client_key)
        self.secure = self._keys is not None
        self._sock, self._handshakes = self._new_socket()
        self._finalizer = weakref.finalize(self, _release, self._sock, self._handshakes, self._live, None)

    @property
    def closed(self) -> bool:
        return bool(self._sock.closed)

    def close(self) -> None:
        """Stop reconnecting and drop what is in flight, stop the heartbeats, close the socket."""
        self.stop_reconnecting()
        self._finalizer()

    def stop(self) -> None:
        """End a wait in progress (:class:`~stella.errors.Stopped`, within a poll of 0.2 s)
        and any reconnecting; safe from a signal handler and from another thread. A wait
        begun after it runs as usual, within :data:`STOP_GRACE_S` if this stop ended one
        (the server did not answer then: a closing worker's last push and leave get that
        long, not the timeout)."""
        self._stop_at = time.monotonic()

    def _stopped_since(self, started: float) -> bool:
        """Whether stop() was called after ``started`` (and so ends the wait begun then)."""
        at = self._stop_at
        if at is None or at < started:
            return False
        self._interrupted = True
        return True

    def _limit(self, t: float) -> float:
        """A wait's timeout: ``t``, or the stop's grace once a stop ended a wait."""
        return min(t, STOP_GRACE_S) if self._interrupted else t

    def stop_reconnecting(self) -> None:
        """A client on its way out (leaving) neither reconnects nor re-sends."""
        self.reconnect_s = 0.0
        self._sent.clear()

    # ------------------------------------------------------------------ join, register
    def join(self, worker_id: int | None, timeout: float | None) -> Joined:
        reply = self.request(Join(worker=worker_id, name=self.name), Joined, timeout=timeout)
        self.worker_id = reply.worker
        self.server_version = self._seen_version = reply.version
        self.shard = reply.shard
        self.dense_below = reply.dense_below
        self._joined = True
        self._start_heartbeats(reply)
        return reply

    def register(self, layout: list[TensorSpec], start: int, stop: int, dense_below: int, optimizer: dict[str, Any],
                 mode: TrainingMode | None, values: Callable[[], list[np.ndarray]],
                 timeout: float | None, version: int = 0) -> Registered:
        """Register (sending ``values()`` if the server asks for them); remembered, so
        that a reconnect registers again. The probe carries the values' digest: a worker
        whose values are those the model was created with learns so (``Registered.base``)."""
        reg = _Registration(layout, start, stop, dense_below, optimizer, mode, values, version)
        arrays = values()  # read once: hashed now, and sent if the server asks for them
        try:
            reply = self._register(reg, timeout, arrays)
        except ServerUnavailable as e:
            if self.reconnect_s <= 0 or not self._joined or self.closed:
                raise
            # the link went while registering (an upload over a slow link): the reconnect registers again,
            # and an upload in pieces goes on from the bytes the server holds
            self._registration = reg
            self._reconnect(f"registering: {e}")
            assert self._registered is not None
            reply = self._registered
        self._registration = reg
        self.server_version = reply.version
        return reply

    def _register(self, reg: _Registration, timeout: float | None,
                  arrays: list[np.ndarray] | None = None) -> Registered:
        """Register ``reg``; ``arrays``: its values as they are now, whose digest the probe
        carries (a reconnect's registration has none: it reads the values only if asked)."""
        t = self.timeout if timeout is None else timeout
        # the probe may be held while another worker uploads the model (workers starting together send it once)
        msg = Register(worker=self.worker(), tensors=reg.layout, optimizer=reg.optimizer, values=False, mode=reg.mode,
                       wait_ms=int(t * 1000 * 0.9), digest=None if arrays is None else model_digest(arrays),
                       dense_below=reg.dense_below, start=reg.start, stop=reg.stop, version=reg.version)
        # joining a model sends no values; Register is not re-sent by a reconnect, which redoes it
        reply = expect(self.wait(self.send(msg, (), timeout), timeout), Registered)
        if reply.needs_values:  # this registration initialises the model
            msg = msgspec.structs.replace(msg, values=True, wait_ms=0)
            frames = reg.values() if arrays is None else arrays
            views = _byte_views(frames)
            if sum(v.nbytes for v in views) > CHUNK_ABOVE:  # in pieces, then the registration names them
                self._upload(reg.upload, views, timeout)
                msg, frames = msgspec.structs.replace(msg, upload=reg.upload), []
            reply = expect(self.wait(self.send(msg, frames, timeout), timeout), Registered)
        self._registered = reply
        return reply

    def staged(self, msg: Push, frames: list[Any], timeout: float | None) -> Push:
        """``msg`` whose ``frames`` are uploaded in pieces first (a push larger than
        ``CHUNK_ABOVE`` over a slow link: close()'s residual), naming the upload; a link
        lost meanwhile is reconnected and the upload goes on where the server stands."""
        views, transfer = _byte_views(frames), random.getrandbits(63) or 1
        while True:
            try:
                self._upload(transfer, views, timeout)
                return msgspec.structs.replace(msg, upload=transfer)
            except ServerUnavailable as e:
                if self.reconnect_s <= 0 or not self._joined or self.closed:
                    raise
                self._reconnect(f"uploading a push: {e}")
                msg, _ = self._rebase(msg)

    def _upload(self, transfer: int, views: list[memoryview], timeout: float | None) -> None:
        """Upload the model's values (``views``, bytes) in pieces, ``FETCH_WINDOW`` in flight,
        from where the server stands (an upload of this id cut by a reconnect goes on there)."""
        sizes = [v.nbytes for v in views]
        starts = list(itertools.accumulate([0, *sizes[:-1]]))
        total, pace = sum(sizes), _Pieces()
        inflight: deque[tuple[int, int, int]] = deque()
        have = nxt = 0

        def piece(offset: int, n: int) -> list[memoryview]:
            out, end = [], offset + n
            for v, at in zip(views, starts):
                lo, hi = max(offset, at), min(end, at + v.nbytes)
                if lo < hi:
                    out.append(v[lo - at:hi - at])
            return out

        while have < total:
            # the first piece goes alone and small: the server may hold more of this upload already
            window = FETCH_WINDOW if have or nxt else 1
            while len(inflight) < window and nxt < total:
                n = min(pace.size if have else PIECE_MIN, total - nxt)
                r = self.send(Upload(worker=self.worker(), transfer=transfer, offset=nxt, sizes=sizes),
                              piece(nxt, n), timeout)
                self._pieces.add(r)
                inflight.append((r, nxt, n))
                nxt += n
            r, offset, n = inflight.popleft()
            try:
                got = expect(self.wait(r, timeout), Uploaded).have
            finally:
                self._pieces.discard(r)
            if got == offset + n:
                have = got
                pace.done(n)
            elif got <= total:  # the server stands elsewhere (an upload resumed): go on from there
                for r, _, _ in inflight:
                    try:
                        self.wait(r, timeout)  # taken or ignored, in order
                    finally:
                        self._pieces.discard(r)
                inflight.clear()
                have = nxt = got
            else:
                raise ProtocolError(f"upload {transfer:#x}: the server holds {got} of {total} bytes")

    def worker(self) -> int:
        if self.worker_id is None:
            raise ProtocolError("this client has not joined (Client(..., join=False)); call join() first")
        return self.worker_id

    # ------------------------------------------------------------------ versions seen
    def saw(self, version: int) -> None:
        """A reply showed the server at ``version``."""
        self._seen_version = max(self._seen_version, version)
        if self._seen_since_reconnect is not None:
            self._seen_since_reconnect = max(self._seen_since_reconnect, version)

    def push_version(self, version: int) -> int:
        """The version to tag a new push computed on ``version`` with: at most the newest
        this server has shown since a reconnect (it may never have had ``version``)."""
        if self._seen_since_reconnect is None:
            return version
        return min(version, self._seen_since_reconnect)

    def was_rebased(self, req: int) -> bool:
        """Whether a reconnect rebased the pull ``req`` (asked once, with its reply)."""
        if req in self._rebased:
            self._rebased.discard(req)
            return True
        return False

    # ------------------------------------------------------------------ heartbeats
    def _new_socket(self) -> tuple[zmq.Socket, _Handshakes]:
        sock = _dealer(self._ctx, self.address, self._keys)
        try:
            handshakes = _Handshakes(sock, self.address, self._keys)
        except BaseException:
            sock.close(0)
            raise
        try:
            sock.connect(self.address)
        except BaseException:
            handshakes.close()
            sock.close(0)
            raise
        return sock, handshakes

    def _arm_finalizer(self) -> None:
        """Point the finalizer at the current socket and heartbeat thread."""
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _release, self._sock, self._handshakes, self._live, self._hb_thread)

    def _start_heartbeats(self, reply: Joined) -> None:
        self._joined_at = time.monotonic()
        self._live.worker, self._live.session = reply.worker, reply.session
        self._live.interval = reply.heartbeat_s
        # silent this long: lost (the server's liveness timeout, when the server says it: it declares the worker
        # gone then; heartbeats come more often than a quarter of it since protocol 12)
        self._live.lost_after = max(reply.liveness_s or 4 * reply.heartbeat_s, 1.0)
        if not self._heartbeat_on or reply.heartbeat_s <= 0 or self._hb_thread is not None:
            return
        self._live.last_ok = time.monotonic()
        # the thread holds no reference to the session: a client dropped without close() is still finalized
        make = functools.partial(_connected, self._ctx, self.address, self._keys)
        self._hb_thread = threading.Thread(target=_heartbeats, args=(self._live, make),
                                           name="stella-heartbeat", daemon=True)
        self._hb_thread.start()
        self._arm_finalizer()

    def _lost(self) -> str | None:
        """Why the connection counts as lost now (heartbeats), or None."""
        live = self._live
        if self._hb_thread is None or self.reconnect_s <= 0:
            return None
        # a refusal of a heartbeat sent before the last join is answered already: the join (a reconnect
        # keeps the session token) made the worker known again
        if live.refused == live.session and live.refused_sent >= self._joined_at:
            return "the server does not know this worker (restarted, or declared it gone and gave its id away)"
        silent = time.monotonic() - live.last_ok
        if silent > live.lost_after:
            return f"no heartbeat reply for {silent:.1f}s"
        return None

    # ------------------------------------------------------------------ requests and replies
    def _unavailable(self, what: str, t: float) -> ServerUnavailable:
        hint = ("; is this client's key on the server's allowlist, and the server's key the right one?"
                if self.secure else f"; a server that runs with keys needs {ENV_SERVER_KEY} and {ENV_CLIENT_KEY}")
        return ServerUnavailable(f"{what} stella-ps at {self.address} within {t:.1f}s "
                                 f"(the timeout argument, or {ENV_TIMEOUT} for the default){hint}")

    def _resilient(self, msg: Any) -> bool:
        """Whether ``msg`` is re-sent after a reconnect (which redoes a join and a registration itself)."""
        return self.reconnect_s > 0 and self._joined and not isinstance(msg, (Join, Register, Upload))

    def send(self, msg: Any, frames: Iterable[Any] = (), timeout: float | None = None,
             made: int | None = None) -> int:
        """Send a request built without its id; returns the id for :meth:`wait`.
        ``made``: :attr:`reconnects` when ``msg`` was built; one built before a reconnect
        is rebased on the server it now goes to (:func:`rebase`)."""
        if self._sock.closed:
            raise ServerUnavailable("client is closed")
        t = self._limit(self.timeout if timeout is None else timeout)
        rebased = False
        if made is not None and made != self.reconnects:
            msg, rebased = self._rebase(msg, self._same_server)
        frames = list(frames)
        req = next(self._req)
        # the usual case first: the socket takes it at once (no system call to ask whether it would)
        if not self._transmit(msgspec.structs.replace(msg, req=req), frames, wait=False):
            if not self._writable(t):
                if not self._resilient(msg):
                    raise self._unavailable("cannot reach", t)
                self._reconnect(f"cannot reach the server within {t:.1f}s")
                msg, now = self._rebase(msg, self._same_server)  # made before the reconnect, sent after it
                rebased = rebased or now
                req = next(self._req)  # after the reconnect's own requests, as it is sent
            self._transmit(msgspec.structs.replace(msg, req=req), frames)
        self._outstanding.add(req)
        if rebased:
            self._rebased.add(req)
        if self._resilient(msg):
            self._sent[req] = (msg, frames, timeout)
        return req

    def send_pair(self, push: Push, frames: Iterable[Any], pull: Pull, timeout: float | None = None
                  ) -> tuple[int, int]:
        """Send a push and the round's pull as one message (the pull rides on the push,
        ``Push.pull``): two requests, each answered under its own id; returns both ids for
        :meth:`wait`. A refusal of the push fails the pull with it. When the socket does
        not take the message at once they go as two (:meth:`send_apart`: :meth:`send` waits
        for the socket and reconnects), and a reconnect re-sends them as two as well."""
        if self._sock.closed:
            raise ServerUnavailable("client is closed")
        frames = list(frames)
        a, b = next(self._req), next(self._req)
        both = msgspec.structs.replace(push, req=a, pull=msgspec.structs.replace(pull, req=b))
        if not self._transmit(both, frames, wait=False):
            return self.send_apart(push, frames, pull, timeout)
        for req, msg, parts in ((a, push, frames), (b, pull, [])):
            self._outstanding.add(req)
            if self._resilient(msg):
                self._sent[req] = (msg, parts, timeout)
        self._pairs[a] = b
        return a, b

    def send_apart(self, push: Push, frames: Iterable[Any], pull: Pull, timeout: float | None = None
                   ) -> tuple[int, int]:
        """A push and the round's pull as two messages (:meth:`send` each); returns both ids.
        The push's send may connect again (to a server restarted from an older checkpoint):
        the pull, built before, is then rebased as a re-sent one is (sent as built, it asked
        the new server for the steps after a version it never reached, and the round failed)."""
        made = self.reconnects
        return self.send(push, frames, timeout), self.send(pull, (), timeout, made)

    def _writable(self, t: float) -> bool:
        """Whether the socket can send within ``t`` seconds; a handshake the server refuses
        raises :class:`Unauthorised` as soon as it fails."""
        return writable(self._sock, t, self._handshakes.socket, self._handshakes.check)

    def _transmit(self, msg: Any, frames: list[Any], wait: bool = True) -> bool:
        """Send ``msg`` and its frames; with ``wait`` False, nothing (returns False) unless
        the socket takes it at once."""
        n = send_message(self._sock, encode_header(msg), frames, wait)
        if n is not None:
            self.bytes_pushed += n
        return n is not None

    def wait(self, req: int, timeout: float | None = None) -> Received:
        """Wait for the reply to request ``req``; raises the server's error if it sent one.
        A ``chunked`` reply is fetched in pieces (:meth:`_assemble`) and its answer returned."""
        while True:
            if req in self._assemblies:
                rx = self._assemble(req, timeout)
                if rx is not None:
                    return rx
                continue  # the server lost the transfer: the request went again
            rx = self._await(req, timeout)
            if not isinstance(rx.msg, Chunked):
                return rx

    def _await(self, req: int, timeout: float | None = None) -> Received:
        """The reply to ``req`` as it comes (a ``chunked`` one starts its assembly)."""
        started = time.monotonic()
        t = self._limit(self.timeout if timeout is None else timeout)
        deadline = started + t
        while req not in self._replies:
            if self._stopped_since(started):
                self._outstanding.discard(req)
                self._sent.pop(req, None)
                self._pairs.pop(req, None)
                raise Stopped(f"stopped while waiting for stella-ps at {self.address} to answer")
            left = deadline - time.monotonic()
            if left <= 0:
                if req in self._sent:
                    raise _Lost(f"no reply within {t:.1f}s")
                self._outstanding.discard(req)
                self._rebased.discard(req)
                self._pairs.pop(req, None)
                raise self._unavailable("no reply from", t)
            # a reply already queued is read at once: a receive that finds a message costs no system
            # call (a poll, or asking for EVENTS, would); one that finds none, then the poll
            try:
                parts, n = receive_message(self._sock)
            except zmq.Again:
                if not self._sock.poll(int(min(left, 0.2) * 1000) + 1, zmq.POLLIN):
                    self._handshakes.check()  # a reconnect of the socket (libzmq's own) may have been refused
                    why = None
                    if req in self._sent or req in self._pieces:
                        why = self._lost()
                        if not why and self._handshakes.dropped:
                            # the request (or its reply) may have been lost with the connection, and the server
                            # knows the socket's new one by another id: join again now, not after the timeout
                            # (a push of 39 MB over 5 Mbit/s once outlasted the server's transport heartbeat)
                            why = "the connection dropped under the socket"
                    if why and req in self._pieces:  # an upload's piece: its caller reconnects and goes on
                        self._outstanding.discard(req)
                        raise ServerUnavailable(f"the connection to stella-ps at {self.address} was lost: "
                                                f"{why}") from None
                    if why:
                        raise _Lost(why) from None
                continue
            self.bytes_pulled += n
            rx = decode_reply(parts)
            if rx.msg.req in self._outstanding:
                self._replies[rx.msg.req] = rx
                self._paired_reply(rx)
            else:  # a reply to a request given up on (timed out) is dropped
                log.debug("dropped a reply to an abandoned request", extra={"req": rx.msg.req})
        self._outstanding.discard(req)
        rx = self._replies.pop(req)
        if isinstance(rx.msg, Error):
            if (rx.msg.code == ErrorCode.NOT_REGISTERED.value and req in self._sent
                    and self._registration is not None):
                raise _Lost(f"the server does not know this worker: {rx.msg.message}")
            self._sent.pop(req, None)
            self._rebased.discard(req)
            raise from_reply(rx.msg.code, rx.msg.message)
        entry = self._sent.pop(req, None)
        if isinstance(rx.msg, Chunked):  # its fetches, not the request, are re-sent after a reconnect
            self._assemblies[req] = _Assembly(rx.msg.transfer, list(rx.msg.sizes), entry)
        return rx

    def _paired_reply(self, rx: Received) -> None:
        """A reply to a push that carried its pull: a refusal is the pull's too (the server
        refuses both, but one that could not read the message knows only the push's id)."""
        pull = self._pairs.pop(rx.msg.req, None)
        if pull is not None and isinstance(rx.msg, Error) and pull in self._outstanding and pull not in self._replies:
            self._replies[pull] = Received(msgspec.structs.replace(rx.msg, req=pull), ())

    def _assemble(self, req: int, timeout: float | None) -> Received | None:
        """Fetch the rest of ``req``'s chunked answer, ``FETCH_WINDOW`` pieces in flight, and
        return the answer; None when the server no longer holds the transfer and ``req`` was
        sent again (it raises :class:`TransferLost` for a request that is not re-sendable).
        A lost connection raises :class:`_Lost` with the assembly kept: the reconnect re-sends
        the fetches in flight, and the wait after it goes on from the bytes in."""
        a = self._assemblies[req]
        while a.have < a.total:
            while len(a.inflight) < FETCH_WINDOW and a.next < a.total:
                n = min(a.pace.size, a.total - a.next)
                f = self.send(Fetch(worker=self.worker(), transfer=a.transfer, offset=a.next, length=n), (), timeout)
                a.inflight.append((f, a.next, n))
                a.next += n
            f, offset, n = a.inflight[0]
            try:
                rx = self._await(f, timeout)
            except TransferLost as e:
                self._again(req, a, e)
                return None
            a.inflight.popleft()
            got = sum(b.nbytes for b in rx.frames)
            if not isinstance(rx.msg, Chunk) or (rx.msg.transfer, rx.msg.offset, got) != (a.transfer, offset, n):
                raise ProtocolError(f"fetch of transfer {a.transfer:#x} at {offset}: a wrong piece came back")
            at = offset
            for b in rx.frames:
                a.buffer[at:at + b.nbytes] = b
                at += b.nbytes
            a.have = offset + n
            a.pace.done(n)
        del self._assemblies[req]
        self._transfers_lost.pop(req, None)
        view, parts, at = memoryview(a.buffer), [], 0
        for n in a.sizes:
            parts.append(view[at:at + n])
            at += n
        rx = decode_reply(parts)
        if rx.msg.req != req or isinstance(rx.msg, (Chunked, Chunk)):
            raise ProtocolError(f"transfer {a.transfer:#x} holds no answer to request {req}")
        if isinstance(rx.msg, Error):
            raise from_reply(rx.msg.code, rx.msg.message)
        return rx

    def _again(self, req: int, a: _Assembly, lost: TransferLost) -> None:
        """The server lost ``req``'s transfer: send ``req`` again (rebased, as after a reconnect)."""
        for f, _, _ in a.inflight:
            self._outstanding.discard(f)
            self._sent.pop(f, None)
            self._replies.pop(f, None)
        del self._assemblies[req]
        tries = self._transfers_lost[req] = self._transfers_lost.get(req, 0) + 1
        if a.entry is None or tries > TRANSFER_RETRIES:
            self._transfers_lost.pop(req, None)
            raise lost
        log.warning("the server no longer holds an answer being fetched; asking for it again",
                    extra={"address": self.address, "transfer": a.transfer, "bytes_in": a.have, "reason": str(lost)})
        msg, frames, timeout = a.entry
        msg, rebased = self._rebase(msg)
        if rebased:
            self._rebased.add(req)
        self._sent[req] = (msg, frames, timeout)
        self._outstanding.add(req)
        self._transmit(msgspec.structs.replace(msg, req=req), frames)

    def wait_resilient(self, req: int, timeout: float | None = None) -> Received:
        """:meth:`wait`, reconnecting (and re-sending ``req``) when the connection is lost."""
        while True:
            try:
                return self.wait(req, timeout)
            except _Lost as e:
                self._reconnect(str(e))

    def request(self, msg: Any, reply: type[T], frames: Iterable[Any] = (), timeout: float | None = None) -> T:
        """Send ``msg`` and wait (through reconnects) for its ``reply``."""
        return expect(self.wait_resilient(self.send(msg, frames, timeout), timeout), reply)

    # ------------------------------------------------------------------ reconnect
    def _rebase(self, msg: Any, same_server: bool = False) -> tuple[Any, bool]:
        """:func:`rebase` on this session's state; whether a pull's answer is now rebased."""
        new = rebase(msg, self.server_version, self.need_snapshot, self.worker(), same_server)
        return new, isinstance(msg, Pull) and (new.since, new.wait_for) != (msg.since, msg.wait_for)

    def _reconnect(self, why: str) -> None:
        """Connect again (backoff with full jitter, within ``reconnect_s`` seconds): join,
        register, re-send the requests waiting for replies; raises
        :class:`ServerUnavailable` when the deadline passes, and :class:`Unauthorised`
        at once if the server refuses this client's key (it left the allowlist)."""
        t0 = time.monotonic()
        if self._stopped_since(0.0):
            raise Stopped(f"stopped: the connection to stella-ps at {self.address} was lost ({why}) and is not "
                          "reconnected after a stop")
        deadline = t0 + self.reconnect_s
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
            end = time.monotonic() + pause
            while time.monotonic() < end:  # in slices, so that a stop ends the pause
                if self._stopped_since(t0):
                    raise Stopped(f"stopped while reconnecting to stella-ps at {self.address} ({last})")
                time.sleep(min(0.1, max(0.0, end - time.monotonic())))
            delay = min(2 * delay, BACKOFF_MAX_S)

    def _reconnect_once(self, t: float) -> None:
        self._handshakes.close()  # first: see _Handshakes.close
        self._sock.close(0)
        self._replies.clear()
        self._pairs.clear()  # what is re-sent goes as separate messages
        self._sock, self._handshakes = self._new_socket()
        self._arm_finalizer()
        self._live.last_ok = time.monotonic()
        session = self._live.session
        join = Join(worker=self.worker_id, name=self.name, session=session or None,
                    version=self._seen_version or None)
        try:
            joined = expect(self.wait(self.send(join, (), t), t), Joined)
        except ServerError as e:
            if e.code != ErrorCode.WORKER_ID:
                raise
            # the old id is still held by a connection the server has not yet declared
            # gone, and this session is not known there: take a new id
            joined = expect(self.wait(self.send(Join(name=self.name), (), t), t), Joined)
        self.worker_id = joined.worker
        # the server gave this session back: it has not restarted since, and holds what it acknowledged
        same_server = self._same_server = bool(session) and joined.session == session
        self._start_heartbeats(joined)
        self.server_version = joined.version
        seeded = False
        if self._registration is not None:
            # the server answered the join: registering, and uploading the model if the server lost it, take the
            # session's timeout. An upload's time follows the model's size and the link, not the reachability that
            # the attempt's short timeout probes (at 100 Mbit/s a 400 MB model takes 32 s, never 5).
            reg = self._register(self._registration, self.timeout)
            self.server_version, seeded = reg.version, reg.created
        v = self.server_version
        if v < self._seen_version:
            if seeded:
                log.warning("the server had lost the model (it restarted with no checkpoint to resume from): this "
                            "worker's values initialised it again; the steps after version %d are lost here, and "
                            "the next pull is a full snapshot", v, extra={"version": v, "had": self._seen_version})
            else:
                log.warning("the server restarted from an older checkpoint (version %d, this worker had seen %d): "
                            "the steps after it are lost, and the next pull is a full snapshot", v,
                            self._seen_version, extra={"version": v, "had": self._seen_version})
            self.need_snapshot = True
        self._seen_since_reconnect = v
        for req in sorted(self._sent):
            msg, frames, timeout = self._sent[req]
            msg, rebased = self._rebase(msg, same_server)
            if rebased:
                self._rebased.add(req)
            self._sent[req] = (msg, frames, timeout)
            self._transmit(msgspec.structs.replace(msg, req=req), frames)
            self._outstanding.add(req)
