"""A request's frames onto the client's DEALER socket and a reply's off it, at the
least cost per frame: plain int flags and the Cython socket's own ``send`` (pyzmq's
``enum.Flag`` arithmetic and its Python send layer cost microseconds a frame, every
step), a receive tried before any poll (one that finds a message costs no system
call; asking for ``EVENTS`` or polling would), and each frame's ``more`` read as it
is received."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq
import zmq.backend

__all__ = ["send_message", "receive_message", "writable"]

_MORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLOUT = int(zmq.POLLOUT)
_zsend = zmq.backend.Socket.send


def send_message(sock: zmq.Socket, header: bytes, frames: Sequence[Any], wait: bool = True) -> int | None:
    """Send ``header`` and ``frames`` (zero-copy above pyzmq's copy threshold) and return
    the bytes sent; with ``wait`` False, nothing (None) unless the socket takes the
    header at once (ZeroMQ then takes the message's other parts with it)."""
    n = len(header)
    try:
        _zsend(sock, header, (0 if wait else _NOBLOCK) | (_MORE if frames else 0))
    except zmq.Again:
        if wait:
            raise
        return None
    last = len(frames) - 1
    for i, f in enumerate(frames):
        n += memoryview(f).nbytes
        _zsend(sock, f, 0 if i == last else _MORE, False)
    return n


def receive_message(sock: zmq.Socket) -> tuple[list[memoryview], int]:
    """The frames of the message queued and their bytes; :class:`zmq.Again` if none is
    (a message's parts arrive together)."""
    f = sock.recv(_NOBLOCK, False)
    parts, n = [f.buffer], len(f)
    while f.more:
        f = sock.recv(_NOBLOCK, False)
        parts.append(f.buffer)
        n += len(f)
    return parts, n


def writable(sock: zmq.Socket, t: float, watch: zmq.Socket, check: Callable[[], None]) -> bool:
    """Whether ``sock`` can send within ``t`` seconds (with IMMEDIATE: once a connection
    has finished its handshake); ``check()`` runs whenever ``watch`` (the handshake
    monitor) has news, and may raise."""
    if int(sock.get(_EVENTS)) & _POLLOUT:  # (no poll system call)
        return True
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLOUT)
    poller.register(watch, zmq.POLLIN)
    deadline = time.monotonic() + t
    while True:
        check()
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if sock in dict(poller.poll(int(left * 1000) + 1)):
            return True
