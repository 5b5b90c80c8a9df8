"""Pulls that wait for a future version: answered when a step reaches it, or when
their timeout passes (then with what the server has). Each worker may have at most
``max_per_worker`` waiting at once (``stella-ps --max-waiting-pulls``): every one
holds a timer and its request until it is answered."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from stella.errors import ErrorCode, ServerError

from .runtime import Clock, LoopClock, Timer

__all__ = ["PullWaiters"]


@dataclass(eq=False)
class _Waiter:
    worker: int
    wait_for: int
    answer: Callable[[], None]
    timer: Timer | None = field(default=None, repr=False)


class PullWaiters:
    """Pending pulls and their timers; ``answer`` is called exactly once for each."""

    def __init__(self, max_per_worker: int = 8, clock: Clock | None = None) -> None:
        self.max_per_worker = max_per_worker
        self._clock = clock or LoopClock()
        self._waiting: list[_Waiter] = []
        self._per_worker: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def waiting(self, worker: int) -> int:
        """Pulls of ``worker`` waiting now."""
        return self._per_worker.get(worker, 0)

    def add(self, worker: int, wait_for: int, timeout_s: float, answer: Callable[[], None]) -> None:
        """Wait for ``wait_for``; raises a ``limit`` :class:`ServerError` (and holds
        nothing) when ``worker`` already has ``max_per_worker`` pulls waiting."""
        n = self.waiting(worker)
        if n >= self.max_per_worker:
            raise ServerError(f"pull refused: worker {worker} already has {n} pulls waiting for a future "
                              f"version, the server's limit (--max-waiting-pulls {self.max_per_worker})",
                              ErrorCode.LIMIT)
        w = _Waiter(worker, wait_for, answer)
        w.timer = self._clock.call_later(max(0.0, timeout_s), lambda: self._expire(w))
        self._waiting.append(w)
        self._per_worker[worker] = n + 1

    def _done(self, w: _Waiter) -> None:
        n = self._per_worker[w.worker] - 1
        if n:
            self._per_worker[w.worker] = n
        else:
            del self._per_worker[w.worker]

    def release(self, version: int) -> None:
        """Answer every pull waiting for ``version`` or an older one."""
        ready = [w for w in self._waiting if w.wait_for <= version]
        if not ready:
            return
        self._waiting = [w for w in self._waiting if w.wait_for > version]
        for w in ready:
            if w.timer is not None:
                w.timer.cancel()
            self._done(w)
            w.answer()

    def _expire(self, w: _Waiter) -> None:
        if w in self._waiting:
            self._waiting.remove(w)
            self._done(w)
            w.answer()

    def cancel_all(self) -> None:
        for w in self._waiting:
            if w.timer is not None:
                w.timer.cancel()
        self._waiting.clear()
        self._per_worker.clear()
