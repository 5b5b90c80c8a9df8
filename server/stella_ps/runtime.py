"""The small runtime the service's parts share: the store thread, background tasks,
and the clock.

- :class:`StoreThread`: every use of the model store runs on one dedicated thread,
  one task at a time, so a step and a pull never interleave and the event loop keeps
  receiving while the C kernel runs; while the thread is idle the loop may read what
  the store has made already (a pull's cached answer), which no task can change then.
- :class:`TensorPool`: the store thread's per-tensor work (a step's apply, its
  broadcast) spread over a few threads; the C calls release the GIL.
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
import os
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

__all__ = ["StoreThread", "TensorPool", "default_threads", "Tasks", "Clock", "LoopClock", "Timer",
           "PARALLEL_MIN_WORK"]

log = logging.getLogger("stella_ps.runtime")
T = TypeVar("T")

# A step whose work (TensorPool.map's sizes: about one random access to memory each) is under this runs
# on the caller's thread. Handing it to the pool costs wake-ups, and two threads that each run a tensor's
# Python between short C calls pass the GIL back and forth (16 context switches a step per thread at 0.1%
# pushes): at 2 workers and 0.1% of 10M parameters (a step's apply ~20k units, its broadcast ~80k), one
# thread took 10.2 ms of server CPU a step and two 12.9 ms; at 1% (200k and 700k) two threads were
# 1.3-1.4x one.
PARALLEL_MIN_WORK = 100_000


class StoreThread:
    """One thread for the model store (and one for any other serial owner, e.g. the
    checkpoint writer): :meth:`run` awaits ``fn(*args)`` on it. A plain thread over a
    queue, the result handed back with the loop's ``call_soon_threadsafe``: an
    executor's submit and its chained futures cost several times as much a hand-off,
    and a step makes one."""

    def __init__(self, name: str = "stella-store"):
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=f"{name}_0", daemon=True)
        self._started = False
        self._closed = False
        # tasks handed to the thread (counted on the event loop) and finished (counted on the thread):
        # each counter has one writer, so reading both needs no lock
        self._submitted = 0
        self._finished = 0

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise RuntimeError("cannot run a task on a closed store thread")
        if not self._started:
            self._started = True
            self._thread.start()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._submitted += 1
        self._queue.put((loop, fut, fn, args))
        return await fut

    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            loop, fut, fn, args = job
            try:
                if fut.cancelled():  # its awaiter gave up before it started: not run
                    continue
                try:
                    result, error = fn(*args), None
                except BaseException as e:
                    result, error = None, e
            finally:
                self._finished += 1
            try:
                loop.call_soon_threadsafe(_settle, fut, result, error)
            except RuntimeError:  # the loop is closed: nobody awaits it any more
                pass

    @property
    def idle(self) -> bool:
        """Nothing handed to the thread is running or waiting (asked on the event loop,
        the only caller of :meth:`run`): what the thread owns may be read on the loop
        until the loop's next :meth:`run`."""
        return self._finished == self._submitted

    def close(self) -> None:
        """Let the tasks handed over finish, and stop the thread."""
        if self._closed:
            return
        self._closed = True
        if self._started:
            self._queue.put(None)
            self._thread.join()


_Job = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[..., Any], tuple[Any, ...]]


def _settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    """On the loop: a store-thread task's outcome into its future (unless its awaiter gave up)."""
    if fut.cancelled():
        return
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)


def default_threads(limit: int = 8) -> int:
    """The cores this process may run on (its CPU affinity), at most ``limit``."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        n = os.cpu_count() or 1
    return max(1, min(limit, n))


class TensorPool:
    """Runs ``fn(t)`` for every tensor ``t`` of a model on ``threads`` threads, the
    caller's among them: the tensors are dealt into one bin per thread by size (largest
    first, each into the lightest bin), so a model of many small tensors costs one task
    per thread, not one per tensor. Every tensor's work is independent, and the heavy
    part of it is C that releases the GIL. ``threads`` 1: a plain loop on the caller's
    thread, as is a call whose work (the sum of the sizes) is under ``min_work``
    (default :data:`PARALLEL_MIN_WORK`)."""

    def __init__(self, threads: int = 1, name: str = "stella-tensors", min_work: int | None = None):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self.min_work = PARALLEL_MIN_WORK if min_work is None else min_work
        self._exec = ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix=name) if threads > 1 else None

    def map(self, fn: Callable[[int], T], sizes: Sequence[int]) -> list[T | Exception]:
        """``fn(t)`` for each tensor (``sizes[t]``: its share of the work), in tensor
        order: each result, or the exception it raised (every tensor runs, whatever the
        others do, so the caller knows which ones changed)."""
        out: list[T | Exception] = [None] * len(sizes)  # type: ignore[list-item]

        def run(ts: list[int]) -> None:
            for t in ts:
                try:
                    out[t] = fn(t)
                except Exception as e:
                    out[t] = e

        if self._exec is None or len(sizes) < 2 or sum(sizes) < self.min_work:
            run(list(range(len(sizes))))
            return out
        bins: list[list[int]] = [[] for _ in range(min(self.threads, len(sizes)))]
        load = [0] * len(bins)
        for t in sorted(range(len(sizes)), key=lambda t: -sizes[t]):
            b = load.index(min(load))
            bins[b].append(t)
            load[b] += max(1, sizes[t])
        futures = []
        for ts in bins[1:]:
            if not ts:
                continue
            try:
                futures.append(self._exec.submit(run, sorted(ts)))
            except RuntimeError:  # the pool cannot take it (shut down, no thread): its tensors run here
                run(sorted(ts))
        run(sorted(bins[0]))
        for f in futures:
            f.result()
        return out

    def close(self) -> None:
        if self._exec is not None:
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
