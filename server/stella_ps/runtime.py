"""The small runtime the service's parts share: the store thread, background tasks,
and the clock.

- :class:`StoreThread`: every use of the model store runs on one dedicated thread,
  one task at a time, so a step and a pull never interleave and the event loop keeps
  receiving while the C kernel runs.
- :class:`Tasks`: coroutines started from handlers and timers; a task that fails
  reports its exception to the ``on_error`` given with it (the service refuses the
  request that started it), never to the event loop's default handler.
- :class:`Clock`: monotonic time and timers. The step and liveness policies take one,
  so that tests drive them with a fake clock and no sleeps (``tests/test_steps.py``).

Nothing here imports the rest of the package: the service, the step scheduler and
the checkpointer all sit on top of it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

__all__ = ["StoreThread", "Tasks", "Clock", "LoopClock", "Timer"]

log = logging.getLogger("stella_ps.runtime")
T = TypeVar("T")


class StoreThread:
    """One thread for the model store (and one for any other serial owner, e.g. the
    checkpoint writer): :meth:`run` awaits ``fn(*args)`` on it."""

    def __init__(self, name: str = "stella-store"):
        self._exec = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._exec, fn, *args)

    def close(self) -> None:
        """Wait for the running task and stop the thread."""
        self._exec.shutdown(wait=True)


class Tasks:
    """Background tasks of the running loop, cancelled together by :meth:`close`."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Awaitable[Any], on_error: Callable[[BaseException], None] | None = None) -> None:
        """Run ``coro``; if it raises, ``on_error(exc)`` is called (or it is logged)."""

        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except BaseException as e:
                if on_error is not None:
                    on_error(e)
                else:
                    log.error("background task failed", exc_info=e)

        task = asyncio.ensure_future(guarded())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def __len__(self) -> int:
        return len(self._tasks)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """Monotonic seconds and one-shot timers."""

    def now(self) -> float: ...

    def call_later(self, delay: float, fn: Callable[[], None]) -> Timer: ...


class LoopClock:
    """The real clock: ``time.monotonic`` and the running event loop's timers."""

    def now(self) -> float:
        return time.monotonic()

    def call_later(self, delay: float, fn: Callable[[], None]) -> Timer:
        return asyncio.get_running_loop().call_later(max(0.0, delay), fn)
