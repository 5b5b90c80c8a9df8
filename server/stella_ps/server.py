"""Transport and lifecycle: the ROUTER socket (CurveZMQ unless the operator chose
``--insecure``), receiving, decoding, sending, and stopping.

The event loop watches the socket's file descriptor itself (``add_reader``) and reads
and writes the plain socket without pyzmq's asyncio wrapper: a ROUTER without
ROUTER_MANDATORY never blocks a send, so a future per send or receive is pure
overhead. ZeroMQ's descriptor is edge-triggered and any send or receive may consume
its edge: the receive pump reads until a receive finds nothing queued (which re-arms
it), and a send made outside the pump schedules a pump.

Receiving is bounded before the payload is held: libzmq drops a peer whose single
frame exceeds ``--max-message-bytes`` without buffering it, and a message with more
frames than the protocol allows, or more bytes in all, is read and discarded frame by
frame and answered with an ``oversized`` error. Every message that is kept is
decoded and validated completely (:func:`stella.protocol.decode_request`) before the
service sees it; a bad one gets an ``error`` reply naming the problem and changes
nothing. What happens to a valid request is the service's business (``service.py``);
who may connect is ``security.py``'s.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import zmq
import zmq.asyncio
import zmq.backend

from stella.errors import OversizedMessage, StellaError, Unauthorised
from stella.protocol import MAX_FRAMES, decode_request, encode_header, request_id

from .config import ServerConfig
from .errors import ConfigError
from .kernel import native_isa
from .metrics import MetricsServer
from .security import ZAP_DOMAIN, Allowlist, Connections, Gatekeeper, fingerprint, load_server_keys
from .service import Peer, Service
from .stats import Stats

__all__ = ["ParameterServer"]

log = logging.getLogger("stella_ps.server")
CURVE_FRAME_OVERHEAD = 64  # bytes CurveZMQ adds to a frame on the wire (command, nonce, MAC)
DRAIN = 64  # messages read per wake-up of the receive loop, at most, before the loop's other work
HANG_UP_DELAY_S = 0.2  # from an oversized message's refusal to cutting its host's connections
# a stopping server's replies: sent within the last FLUSH_GRACE_S, it waits that long (reading no more requests)
# for the I/O threads on both ends to carry them over, then ZeroMQ has FLUSH_ON_CLOSE_MS for what it still holds
FLUSH_GRACE_S = 0.2
FLUSH_ON_CLOSE_MS = 1000
# plain ints: pyzmq's enum.Flag arithmetic costs a microsecond an operation
_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.SNDMORE) | _NOBLOCK
# the socket's own send, past pyzmq's Python layer (which only adds draft-socket options): a third
# of the cost of a frame's send
_zsend = zmq.backend.Socket.send


def batch_io_threads(ctx: zmq.Context) -> bool:
    """Run ``ctx``'s ZeroMQ I/O threads (started with its first socket) under ``SCHED_BATCH``
    where the OS allows it; returns whether it will. Each reply the event loop sends wakes the
    I/O thread, and a woken ordinary thread may preempt its waker at once when the two share a
    core: two context switches a message, before the loop reads the next one. A woken batch
    thread does not preempt; it runs when the loop waits (or on another core), and sends what
    is queued by then (bench/RESULTS.md, "ZeroMQ's I/O thread under SCHED_BATCH": 100k
    parameters, W = 8, 27-28 context switches a step fell to 10-11). The policy is tried on a
    thread of our own first: libzmq aborts the process when it cannot set what it was asked to."""
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None:
        return False
    allowed: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, policy, os.sched_param(0))  # this thread only (Linux: 0 is the caller)
            allowed.append(True)
        except OSError:
            pass

    t = threading.Thread(target=probe, name="stella-sched-probe")
    t.start()
    t.join()
    if allowed:
        ctx.set(zmq.THREAD_SCHED_POLICY, policy)
    return bool(allowed)


class ParameterServer:
    """One stella-ps instance: ``await start()`` (or ``async with``), then ``await
    serve()`` until :meth:`stop`; :meth:`close` (called by ``serve`` on its way out)
    releases everything :meth:`start` took, in reverse order."""

    def __init__(self, config: ServerConfig, ctx: zmq.asyncio.Context | None = None):
        self.config = config
        self.ctx = ctx or zmq.asyncio.Context()
        if ctx is None and config.io_batch:
            batch_io_threads(self.ctx)
        self._own_ctx = ctx is None
        self.stats = Stats()
        self.service = Service(config, self._send, self.stats)
        self.service.on_failure = self._fail
        self.failure: BaseException | None = None  # why serving stopped by itself (the daemon then exits 1)
        self.endpoint: str | None = None
        self._sock: zmq.Socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last_sent = -1e9  # time.monotonic() of the last reply sent
        self._pumping = False  # the receive pump runs: it reads until nothing is queued before it returns
        self._pump_due = False  # a run of the pump is scheduled
        self._peers: dict[str, Peer] = {}  # admitted keys seen, each one's Peer (made once)
        self._stop = asyncio.Event()
        self.allowlist: Allowlist | None = None
        self._insecure_peer = Peer("")
        self._resources: contextlib.AsyncExitStack | None = None
        self.metrics: MetricsServer | None = None
        self._connections: Connections | None = None
        self._trim = False  # an oversized message was received: give the heap back once it is dropped

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> str:
        """Take every resource, each with its release registered as it is taken: the
        context, the bound socket (CurveZMQ unless ``--insecure``) and its ZAP handler,
        the service (resumed from the newest checkpoint: the first request sees it),
        and the metrics endpoint. Returns the endpoint (port 0 becomes the port picked)."""
        assert self._resources is None, "started already"
        async with contextlib.AsyncExitStack() as stack:
            if self._own_ctx:
                stack.callback(self.ctx.term)
            self._sock = stack.enter_context(self._bound_socket())
            self._connections = Connections(self._sock, self.stats.count_refused)
            self._connections.start()
            stack.push_async_callback(self._connections.close)
            if self.allowlist is not None:
                gate = Gatekeeper(self.ctx, self.allowlist, self.stats.count_refused)
                self.service.key_name = self.allowlist.name
                gate.start()
                stack.callback(gate.stop)
            await stack.enter_async_context(self.service.running())
            if self.config.metrics:
                metrics = MetricsServer(self.service.snapshot, self.config.metrics)
                self.metrics = await stack.enter_async_context(metrics)
            self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._resources = stack.pop_all()
        log.info("listening", extra={"endpoint": self.endpoint, "workers": self.config.workers,
                                     "native_isa": native_isa().level})
        return self.endpoint

    async def __aenter__(self) -> ParameterServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Release what :meth:`start` took (the service writes its last checkpoint
        first); safe to call twice."""
        stack, self._resources = self._resources, None
        if stack is not None:
            await stack.aclose()
            self._sock = None
            log.info("stopped", extra={"version": self.service.store.version, "steps": self.stats.steps})

    @contextlib.contextmanager
    def _bound_socket(self) -> Iterator[zmq.Socket]:
        sock = zmq.Socket(self.ctx, zmq.ROUTER)  # a plain socket: serve watches its descriptor itself
        try:
            sock.setsockopt(zmq.LINGER, 0)
            # libzmq drops a peer whose single frame exceeds this without buffering it; the
            # margin covers CurveZMQ's box around a frame (a frame of exactly the limit still
            # gets an error reply, larger ones cost the peer its connection)
            sock.setsockopt(zmq.MAXMSGSIZE, self.config.limits.max_message_bytes + CURVE_FRAME_OVERHEAD)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
            if self.config.liveness.timeout > 0:
                # the server's own heartbeat, in the transport: libzmq PINGs every connected peer
                # (a few bytes each) and drops a connection whose peer has not answered for twice
                # the liveness timeout, long after its worker was declared gone. So the half-open
                # TCP connection of a host that vanished (a revoked spot machine sends no FIN)
                # does not keep its buffers for ever; a worker reconnects with its session token.
                t = self.config.liveness.timeout
                sock.setsockopt(zmq.HEARTBEAT_IVL, max(100, int(t * 1000 / 4)))
                sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1000, int(t * 2000)))
            if self.config.insecure:
                log.warning("INSECURE: no encryption and no authentication (--insecure); anyone who reaches "
                            "this port can read the traffic and change the model")
            else:
                self._secure(sock)
            bind = self.config.bind
            if bind.startswith("tcp://") and bind.endswith(":0"):
                bind = bind[:-2] + ":*"
            sock.bind(bind)
            yield sock
        finally:
            sock.close(linger=FLUSH_ON_CLOSE_MS)

    def _secure(self, sock: zmq.Socket) -> None:
        if not (self.config.keys and self.config.allow):
            raise ConfigError("CurveZMQ needs the server's key pair (keys) and an allowlist (allow); "
                              "or set insecure")
        keys = load_server_keys(self.config.keys)
        self.allowlist = Allowlist(self.config.allow)
        sock.curve_server = True
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.zap_domain = ZAP_DOMAIN.encode()
        # no ZAP handler (yet, or any more) means no admission, never "admit all"
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        log.info("CurveZMQ on", extra={"server_key_fingerprint": fingerprint(keys.public.decode()),
                                       "allowed_keys": len(self.allowlist)})

    async def serve(self) -> None:
        """Receive and serve messages until :meth:`stop`, then :meth:`close`.

        The loop calls :meth:`_pump` when the socket's descriptor signals; it reads the
        messages queued (up to :data:`DRAIN`, then it yields to the loop's other work and
        goes on), each message's frames together (ZeroMQ delivers a message's parts
        together), and hands each to :meth:`_on_message`."""
        if self._resources is None:
            await self.start()
        assert self._sock is not None
        self._loop = loop = asyncio.get_running_loop()
        fd = int(self._sock.getsockopt(zmq.FD))
        loop.add_reader(fd, self._pump)
        try:
            self._pump()  # what arrived before the reader was added: the edge is gone
            await self._stop.wait()
        finally:
            loop.remove_reader(fd)
            if time.monotonic() - self._last_sent < FLUSH_GRACE_S:
                # a reply just sent (the push whose step then failed, a SIGTERM's last answers) still reaches its
                # peer: a TCP connection closed with its bytes in flight can be reset under them
                await asyncio.sleep(FLUSH_GRACE_S)
            await self.close()

    def _pump(self) -> None:
        """Read and handle what is queued, until a receive finds nothing (libzmq then reads
        its commands, which re-arms the descriptor) or :data:`DRAIN` messages were read
        (then it runs again after the loop's other work). A receive that finds a message
        costs no system call; asking for EVENTS before each would cost one."""
        self._pump_due = False
        sock = self._sock
        if sock is None or self._stop.is_set():
            return
        recv = sock.recv
        self._pumping = True
        try:
            for _ in range(DRAIN):
                try:
                    ident = recv(_NOBLOCK)  # a ROUTER's message starts with its sender's routing id
                except zmq.Again:
                    return
                self._handle(sock, ident)
                if self._stop.is_set():
                    return
            self._schedule_pump()
        except zmq.ZMQError as e:  # the socket is closing
            log.debug("receive failed", extra={"error": str(e)})
        finally:
            self._pumping = False

    def _schedule_pump(self) -> None:
        if not self._pump_due and self._loop is not None:
            self._pump_due = True
            self._loop.call_soon(self._pump)

    def _handle(self, sock: zmq.Socket, ident: bytes) -> None:
        frames, count, size = self._read_message(sock)
        try:
            self._on_message(ident, frames, count, size)
        except Exception as e:  # a bug must cost one message, never the receive loop
            log.error("message handling failed", exc_info=e)
            self._refuse_unread(ident, e)
        del frames
        if self._trim:
            self._trim = False
            _release_heap()

    def _read_message(self, sock: zmq.Socket) -> tuple[list[zmq.Frame], int, int]:
        """The rest of a message whose routing id was read: the frames after it (the header
        and the payload), the count of all its frames and the bytes after the routing id;
        frames past the protocol's or the size limit are read (to keep the stream in step)
        but not kept. All parts of a ZeroMQ message arrive together, so this never waits.
        (Each frame's ``more``, which pyzmq reads as it receives it, says whether another
        follows: asking the socket costs a microsecond more a frame.)"""
        recv = sock.recv
        frames: list[zmq.Frame] = []
        count, size = 1, 0
        limit = self.config.limits.max_message_bytes
        more = True  # a routing id is always followed by the message
        while more:
            f = recv(_NOBLOCK, False)  # there already: a message's parts arrive together
            more = f.more
            count += 1
            size += len(f)
            if count <= MAX_FRAMES + 1 and size <= limit:
                frames.append(f)
        return frames, count, size

    def reload_allowlist(self) -> None:
        """Read the allowlist again now (SIGHUP)."""
        if self.allowlist is not None:
            self.allowlist.reload()

    def stop(self) -> None:
        """Ask :meth:`serve` to return (safe from a signal handler)."""
        self._stop.set()

    def _fail(self, error: BaseException) -> None:
        """A step could be neither applied whole nor closed empty (a fault, and its undo
        failed too): no step can close any more. Stop serving, loudly, so that the
        daemon exits 1 and its supervisor (docker, systemd, ``--shards``) restarts it
        from its newest checkpoint; the last checkpoint is written on the way out only
        when the model is whole (the store knows). Waiting pulls get no answer: their
        workers' heartbeats go unanswered, and they reconnect to the restarted server."""
        if self.failure is None:
            self.failure = error
            damaged = self.service.store.damaged is not None
            log.critical("a step failed and could not be undone or closed: stopping, to be restarted from the "
                         + ("newest checkpoint (the model may hold part of the step: no last checkpoint)" if damaged
                            else "last checkpoint, written now (the model is whole)"), exc_info=error, extra={
                             "version": self.service.store.version, "model_damaged": damaged})
        self.stop()

    async def stop_requested(self) -> None:
        """Wait until :meth:`stop` has been called."""
        await self._stop.wait()

    # ------------------------------------------------------------------ transport
    def _send(self, ident: bytes, msg: Any, frames: Sequence[Any]) -> None:
        header = encode_header(msg)
        sock = self._sock
        if sock is None:
            return
        out = len(header)
        try:
            # a ROUTER without ROUTER_MANDATORY drops what a full peer cannot take: NOBLOCK never raises
            _zsend(sock, ident, _MORE)
            if not frames:
                _zsend(sock, header, _NOBLOCK)
            else:
                _zsend(sock, header, _MORE)
                last = len(frames) - 1
                for i, f in enumerate(frames):
                    out += memoryview(f).nbytes
                    # zero-copy (pyzmq copies frames under its copy_threshold itself): a delta's
                    # frames are the store's immutable arrays
                    _zsend(sock, f, _NOBLOCK if i == last else _MORE, False)
        except zmq.ZMQError as e:  # the socket is closing: nothing to do
            log.debug("send failed", extra={"error": str(e)})
        self.stats.bytes_out += out
        self._last_sent = time.monotonic()
        if not self._pumping:
            self._schedule_pump()  # the send may have taken the descriptor's edge from under the reader

    def _on_message(self, ident: bytes, frames: list[zmq.Frame], count: int, size: int) -> None:
        self.stats.messages += 1
        self.stats.bytes_in += size
        if not frames:  # a ROUTER hands over at least the identity and one frame
            return
        header = frames[0]
        body = [f.buffer for f in frames]
        peer = self._peer(header)
        if peer is None:  # a key taken off the allowlist while its connection stayed open
            key = str(header.get("User-Id"))
            self.service.refuse(ident, request_id(body[0]), Unauthorised(
                f"this client's key (fingerprint {fingerprint(key)}) is no longer on the server's allowlist"))
            self.service.drop_peer(key)
            return
        if count - 1 > MAX_FRAMES or size > self.config.limits.max_message_bytes:
            what = (f"{count - 1} frames > limit {MAX_FRAMES}" if count - 1 > MAX_FRAMES else
                    f"message of {size} bytes > limit {self.config.limits.max_message_bytes}")
            self.service.refuse(ident, request_id(body[0]), OversizedMessage(what))
            self._hang_up(header, peer)
            return
        try:
            rx = decode_request(body)
        except StellaError as e:  # decode_request raises nothing else; e.req names the request if it could
            self.service.refuse(ident, e.req, e)
            return
        try:
            self.service.handle(ident, rx, peer)
        except Exception as e:
            self.service.refuse(ident, rx.msg.req, e)

    def _hang_up(self, header: zmq.Frame, peer: Peer) -> None:
        """After an oversized message: refuse its key for ``--oversized-ban-s`` (and drop its
        workers), cut its host's connections, and give the memory back once it is dropped.
        libzmq bounds frames, not messages, so the message was buffered whole; this keeps
        the same peer from doing it again at once (docs/security.md)."""
        self._trim = True
        ban_s = self.config.limits.oversized_ban_s
        if ban_s <= 0:
            return  # the operator turned hanging up off
        host = str(header.get("Peer-Address") or "")
        if self.allowlist is not None and peer.key:
            self.allowlist.ban(peer.key, ban_s)
            self.service.drop_peer(peer.key)
        log.warning("oversized message: cutting the connections of its host", extra={
            "host": host, "key_fingerprint": peer.fingerprint, "ban_s": ban_s})
        if self._connections is not None and host:
            # a moment later, so that the `oversized` reply leaves first
            asyncio.get_running_loop().call_later(HANG_UP_DELAY_S, self._connections.cut, host)

    def _refuse_unread(self, ident: bytes, exc: BaseException) -> None:
        """The last resort of the receive loop: an ``internal`` reply to the message whose
        handling failed."""
        try:
            self.service.refuse(ident, -1, exc)
        except Exception as e:
            log.error("could not refuse a message", exc_info=e)

    def _peer(self, header: zmq.Frame) -> Peer | None:
        """Who sent the message ``header`` opens: its CURVE key (checked against the
        allowlist as it is now) or, with --insecure, an anonymous peer. None: no longer
        admitted."""
        if self.allowlist is None:
            return self._insecure_peer
        key = str(header.get("User-Id"))  # the Z85 public key the ZAP handler admitted
        if not self.allowlist.admits(key):
            return None
        peer = self._peers.get(key)
        if peer is None:
            if len(self._peers) >= 4096:  # the keys an allowlist admitted over time, bounded all the same
                self._peers.clear()
            peer = self._peers[key] = Peer(key)
        return peer


def _release_heap() -> None:
    """Give freed heap memory back to the system (glibc's ``malloc_trim``; a no-op where
    there is none): a message buffered whole leaves the heap grown after it is freed."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
