"""Transport and lifecycle: the zmq.asyncio ROUTER socket, receiving, decoding,
sending, and stopping.

Every message is decoded and validated completely (:func:`stella.protocol.decode_request`)
before the service sees it; a bad one gets an ``error`` reply naming the problem
and changes nothing. What happens to a valid request is the service's business
(``service.py``).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio

from stella.errors import OversizedMessage
from stella.protocol import decode_request, encode, request_id

from .config import ServerConfig
from .service import Service, Stats

__all__ = ["ParameterServer"]

log = logging.getLogger("stella_ps.server")


class ParameterServer:
    """One stella-ps instance: ``bind()``, then ``await serve()`` until ``stop()``."""

    def __init__(self, config: ServerConfig, ctx: zmq.asyncio.Context | None = None):
        self.config = config
        self.ctx = ctx or zmq.asyncio.Context()
        self._own_ctx = ctx is None
        self.stats = Stats()
        self.service = Service(config, self._send, self.stats)
        self.endpoint: str | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._stop = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle
    def bind(self) -> str:
        """Bind the ROUTER socket; returns the endpoint (port 0 becomes the port picked)."""
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # libzmq drops a peer whose single frame exceeds this without buffering it;
        # messages below it but above max_message_bytes get an error reply instead.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.config.max_message_bytes)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        bind = self.config.bind
        if bind.startswith("tcp://") and bind.endswith(":0"):
            bind = bind[:-2] + ":*"
        sock.bind(bind)
        self._sock = sock
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.endpoint

    async def serve(self) -> None:
        """Receive and serve messages until :meth:`stop`, then shut down."""
        if self._sock is None:
            self.bind()
        assert self._sock is not None
        log.info("listening", extra={"endpoint": self.endpoint, "workers": self.config.workers})
        recv: asyncio.Future | None = None
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            while not self._stop.is_set():
                recv = asyncio.ensure_future(self._sock.recv_multipart(copy=False))
                done, _ = await asyncio.wait({recv, stop}, return_when=asyncio.FIRST_COMPLETED)
                if recv not in done:
                    break
                frames = recv.result()
                recv = None
                self._on_message(frames)
        finally:
            stop.cancel()
            if recv is not None:
                recv.cancel()
            await self._shutdown()

    def stop(self) -> None:
        """Ask :meth:`serve` to return (safe from a signal handler)."""
        self._stop.set()

    async def stop_requested(self) -> None:
        """Wait until :meth:`stop` has been called."""
        await self._stop.wait()

    async def _shutdown(self) -> None:
        await self.service.close()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._own_ctx:
            self.ctx.term()
        log.info("stopped", extra={"version": self.service.store.version, "steps": self.stats.steps})

    # ------------------------------------------------------------------ transport
    def _send(self, ident: bytes, msg: Any, frames: Sequence[Any]) -> None:
        parts = encode(msg, frames)
        self.stats.bytes_out += sum(memoryview(p).nbytes for p in parts)
        try:
            assert self._sock is not None
            self._sock.send_multipart([ident, *parts], copy=not frames)
        except zmq.ZMQError as e:  # peer gone: nothing to do
            log.debug("send failed", extra={"error": str(e)})

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        self.stats.messages += 1
        size = sum(len(f) for f in frames)
        self.stats.bytes_in += size
        ident = frames[0].bytes
        body = [f.buffer for f in frames[1:]]
        try:
            if size > self.config.max_message_bytes:
                raise OversizedMessage(f"message of {size} bytes > limit {self.config.max_message_bytes}")
            rx = decode_request(body)
        except Exception as e:
            self.service.refuse(ident, request_id(body[0]) if body else -1, e)
            return
        try:
            self.service.handle(ident, rx)
        except Exception as e:
            self.service.refuse(ident, rx.msg.req, e)
