"""Pulls answered: a step prepares the answer every worker of a synchronous job asks
for next, and while the store thread is idle the event loop sends it with a look-up,
no task and no hand-off; any other answer is made on the store thread, in one trip for
every pull due by then (each ``(since, coding)`` encoded once, the store's cache).

A pull whose answer cannot be made (or fails to be sent) is refused; the others are
answered. The service hands a pull here once it may be answered (at once, or when the
version it waits for comes, :mod:`.waiters`).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from stella.protocol import Chunked, Delta, Pull, PullCoding, encode_header

from .runtime import StoreThread, Tasks
from .store import EncodedChanges, ModelStore
from .transfers import Transfers

__all__ = ["PullAnswers"]


class PullAnswers:
    """Answers pulls from ``store``: ``send(ident, msg, frames)`` sends a reply,
    ``refuse(ident, req, exc)`` an error; ``step_ms()`` is the last step's apply time
    and ``pushes()`` the pushes it combined, which every answer carries. An answer
    larger than its pull's ``chunk_bytes`` is held in ``transfers`` and answered
    ``chunked`` (fetched in pieces)."""

    def __init__(self, store: ModelStore, store_thread: StoreThread, tasks: Tasks,
                 send: Callable[[bytes, Any, Sequence[Any]], None], refuse: Callable[[bytes, int, BaseException], None],
                 step_ms: Callable[[], float], transfers: Transfers | None = None,
                 pushes: Callable[[], int] = lambda: 0):
        self.store = store
        self.store_thread = store_thread
        self.tasks = tasks
        self._send = send
        self._refuse = refuse
        self._step_ms = step_ms
        self._pushes = pushes
        self.transfers = Transfers() if transfers is None else transfers
        self._due: list[tuple[bytes, Pull, float]] = []  # pulls ready to be answered
        self._answering = False  # a task is answering them

    def answer(self, ident: bytes, msg: Pull, arrived: float) -> None:
        """Answer the pull ``msg`` (received at ``arrived``, ``time.monotonic``): now when
        its answer is made already and the store thread is idle; else soon, with the
        other pulls ready by then. Never raises: a failure is the pull's refusal (a
        pull released by a step is answered from the step's loop)."""
        try:
            if not self._answering and self.store_thread.idle:
                enc = self.store.cached_delta(msg.since, msg.coding)
                if enc is not None:
                    self._send_delta(ident, msg, arrived, enc, time.monotonic())
                    return
            self._due.append((ident, msg, arrived))
            if not self._answering:
                self._answering = True
                self.tasks.spawn(self._answer_due())
        except Exception as e:  # a bug costs this pull its answer, never the others released with it
            self._refuse(ident, msg.req, e)

    async def _answer_due(self) -> None:
        try:
            while self._due:
                due, self._due = self._due, []
                try:
                    encoded = await self.store_thread.run(self._encode, [(m.since, m.coding) for _, m, _ in due])
                except Exception as e:
                    encoded = [e] * len(due)
                now = time.monotonic()
                for (ident, msg, arrived), enc in zip(due, encoded):
                    if isinstance(enc, Exception):
                        self._refuse(ident, msg.req, enc)
                    else:
                        self._send_delta(ident, msg, arrived, enc, now)
        finally:
            self._answering = False

    def _send_delta(self, ident: bytes, msg: Pull, arrived: float, enc: EncodedChanges, now: float) -> None:
        held_ms = min(1e9, 1e3 * (now - arrived))  # the worker's measure of its link leaves it out
        try:
            delta = Delta(req=msg.req, version=enc.version, full=enc.full, tensors=enc.entries, add=enc.add,
                          parts=enc.parts, held_ms=held_ms, step_ms=min(1e9, self._step_ms()),
                          pushes=self._pushes())
            if msg.chunk_bytes and enc.nbytes > msg.chunk_bytes:  # over a slow link: fetched in pieces
                transfer, sizes = self.transfers.offer(msg.worker, encode_header(delta), enc.frames)
                self._send(ident, Chunked(req=msg.req, transfer=transfer, sizes=sizes), ())
            else:
                self._send(ident, delta, enc.frames)
        except Exception as e:  # a bug costs this pull its answer, not the others
            self._refuse(ident, msg.req, e)

    def _encode(self, keys: list[tuple[int, PullCoding]]) -> list[EncodedChanges | Exception]:
        """On the store thread: the answer for each ``(since, coding)``, or the exception it raised."""
        out: list[EncodedChanges | Exception] = []
        for since, coding in keys:
            try:
                out.append(self.store.encoded_delta(since, coding))
            except Exception as e:
                out.append(e)
        return out
