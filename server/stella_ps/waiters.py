"""Pulls that wait for a future version: answered when a step reaches it, or when
their timeout passes (then with what the server has). Each worker may have at most
``max_per_worker`` waiting at once (``stella-ps --max-waiting-pulls``): every one
holds its request until it is answered.

One timer serves them all, armed for the earliest deadline: every worker of a
synchronous job parks a pull each step, and a timer made and cancelled for each
would be a large share of what a pull costs the event loop. A step that answers
pulls leaves the timer as it is; when it fires, it answers the pulls whose time has
come and is armed again for the earliest left."""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from stella.errors import ErrorCode, ServerError

from .runtime import Clock, LoopClock, Timer

__all__ = ["PullWaiters"]

log = logging.getLogger("stella_ps.waiters")

# a timer may fire a little before its deadline by the event loop's clock (libuv counts whole
# milliseconds): a pull this close to its timeout is answered with the others
EARLY_S = 0.001


@dataclass(eq=False, slots=True)
class _Waiter:
    worker: int
    wait_for: int
    answer: Callable[[], None]
    deadline: float  # the clock's time at which it is answered whatever the version


def _answer(w: _Waiter) -> None:
    """Answer one waiting pull: a failure (a bug; the service refuses the pull when its
    answer fails) costs that pull, never the others released with it."""
    try:
        w.answer()
    except Exception as e:
        log.error("a waiting pull could not be answered", exc_info=e, extra={"worker": w.worker})


class PullWaiters:
    """Pending pulls and their timers; ``answer`` is called exactly once for each."""

    def __init__(self, max_per_worker: int = 8, clock: Clock | None = None) -> None:
        self.max_per_worker = max_per_worker
        self._clock = clock or LoopClock()
        self._waiting: list[_Waiter] = []
        self._per_worker: dict[int, int] = {}
        self._timer: Timer | None = None
        self._timer_at = math.inf  # when the timer fires (inf: none is armed)

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
        w = _Waiter(worker, wait_for, answer, self._clock.now() + max(0.0, timeout_s))
        self._waiting.append(w)
        self._per_worker[worker] = n + 1
        if w.deadline < self._timer_at:
            self._arm(w.deadline)

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = self._clock.call_later(max(0.0, at - self._clock.now()), self._expire)

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
            self._done(w)
            _answer(w)

    def _expire(self) -> None:
        """The timer: answer the pulls whose timeout has passed; arm it for the next."""
        self._timer, self._timer_at = None, math.inf
        now = self._clock.now() + EARLY_S
        due = [w for w in self._waiting if w.deadline <= now]
        if due:
            self._waiting = [w for w in self._waiting if w.deadline > now]
            for w in due:
                self._done(w)
                _answer(w)
        if self._waiting:
            self._arm(min(w.deadline for w in self._waiting))

    def cancel_all(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, math.inf
        self._waiting.clear()
        self._per_worker.clear()
