"""Pulls that wait for a future version: answered when a step reaches it, or when
their timeout passes (then with what the server has)."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["PullWaiters"]


@dataclass(eq=False)
class _Waiter:
    wait_for: int
    answer: Callable[[], None]
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


class PullWaiters:
    """Pending pulls and their timers; ``answer`` is called exactly once for each."""

    def __init__(self) -> None:
        self._waiting: list[_Waiter] = []

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, wait_for: int, timeout_s: float, answer: Callable[[], None]) -> None:
        w = _Waiter(wait_for, answer)
        w.timer = asyncio.get_running_loop().call_later(max(0.0, timeout_s), self._expire, w)
        self._waiting.append(w)

    def release(self, version: int) -> None:
        """Answer every pull waiting for ``version`` or an older one."""
        ready = [w for w in self._waiting if w.wait_for <= version]
        if not ready:
            return
        self._waiting = [w for w in self._waiting if w.wait_for > version]
        for w in ready:
            if w.timer is not None:
                w.timer.cancel()
            w.answer()

    def _expire(self, w: _Waiter) -> None:
        if w in self._waiting:
            self._waiting.remove(w)
            w.answer()

    def cancel_all(self) -> None:
        for w in self._waiting:
            if w.timer is not None:
                w.timer.cancel()
        self._waiting.clear()
