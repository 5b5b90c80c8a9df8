"""The server's policies, driven directly with a fake clock and no sleeps: when a step
closes (complete, deadline, silent or slow, behind, late fold, lost worker), pulls
waiting for a version, and the encoded-delta cache. The real store, kernel and store
thread do the work; only time is simulated."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np
import pytest

from stella.errors import ServerError
from stella.payload import SparseTensor
from stella.protocol import TensorSpec
from stella_ps.config import Deadline, Limits, Liveness, Pulls
from stella_ps.membership import Membership
from stella_ps.optim import OptimizerConfig
from stella_ps.runtime import StoreThread, Tasks
from stella_ps.stats import Stats
from stella_ps.steps import SILENT_BEATS, StepScheduler
from stella_ps.store import ModelStore
from stella_ps.waiters import PullWaiters

LIVENESS_S = 20.0  # heartbeats every second (at most): silent after 1.5 s
SGD = OptimizerConfig.from_wire({"name": "sgd", "lr": 1.0})


class FakeClock:
    """Monotonic time that moves only when told to; timers fire in order as it does."""

    def __init__(self) -> None:
        self.t = 1000.0
        self._timers: list[_Timer] = []

    def now(self) -> float:
        return self.t

    def call_later(self, delay: float, fn: Callable[[], None]) -> _Timer:
        timer = _Timer(self.t + max(0.0, delay), fn)
        self._timers.append(timer)
        return timer

    def advance(self, dt: float) -> None:
        end = self.t + dt
        while True:
            due = [h for h in self._timers if not h.cancelled and h.when <= end]
            if not due:
                break
            h = min(due, key=lambda h: h.when)
            self._timers.remove(h)
            self.t = h.when
            h.fn()
        self.t = end

    def pending(self) -> list[float]:
        """When the armed timers fire, in seconds from now."""
        return sorted(h.when - self.t for h in self._timers if not h.cancelled)


class _Timer:
    def __init__(self, when: float, fn: Callable[[], None]):
        self.when, self.fn, self.cancelled = when, fn, False

    def cancel(self) -> None:
        self.cancelled = True


class Job:
    """A StepScheduler over a real one-tensor store, with ``n`` registered workers."""

    def __init__(self, n: int = 2, *, deadline: Deadline | None = None, started: bool = True):
        self.clock = FakeClock()
        self.members = Membership(expected=n, clock=self.clock.now)
        self.store = ModelStore(Pulls(mode="exact"), history=64, threads=1, dense_below=4096)
        self.store.initialise([TensorSpec("w", (8,), "float32")], [np.zeros(8, np.float32)], SGD)
        self.thread, self.tasks, self.stats = StoreThread(), Tasks(), Stats()
        self.steps = StepScheduler(self.store, self.members, self.thread, self.tasks, self.clock, self.stats,
                                   deadline=deadline or Deadline(fixed=5.0), limits=Limits(),
                                   liveness=Liveness(timeout=LIVENESS_S), default_optimizer=SGD)
        self.steps.optimizer = SGD
        self.applied: list[int] = []
        self.steps.on_step(self.applied.append)
        for w in range(n):
            self.members.register(self.members.join(f"conn-{w}".encode(), None))
        self.members.started = started

    def push(self, worker: int, version: int | None = None, value: float = 1.0) -> int:
        v = self.store.version if version is None else version
        t = SparseTensor(0, np.array([worker], np.int32), np.array([value], np.float32))
        return self.steps.offer(self.steps.room(worker, 8), v, [t], None)

    async def settle(self) -> None:
        """Let the spawned apply task run to its end (store thread included)."""
        for _ in range(3):
            await asyncio.sleep(0)
            await self.steps.idle()

    def heartbeat(self, worker: int) -> None:
        info = self.members.live[worker]
        self.members.heartbeat(worker, info.session, "")

    def beating(self, dt: float, *workers: int) -> None:
        """Let ``dt`` seconds pass, ``workers`` heartbeating every half second meanwhile."""
        end = self.clock.t + dt
        while self.clock.t < end:
            for w in workers:
                self.heartbeat(w)
            self.clock.advance(min(0.5, end - self.clock.t))

    async def close(self) -> None:
        self.steps.close()
        await self.tasks.close()
        self.thread.close()


def run(test: Callable[[], object]) -> None:
    asyncio.run(test())  # type: ignore[arg-type]


# ------------------------------------------------------------------ step closing
def test_a_step_closes_when_every_live_worker_has_pushed_and_not_before():
    async def main() -> None:
        job = Job(2)
        assert job.push(0) == 0
        await job.settle()
        assert job.store.version == 0 and job.applied == [] and job.clock.pending() == [5.0]
        job.clock.advance(1.0)
        job.push(1)
        await job.settle()
        assert job.store.version == 1 and job.applied == [1] and job.clock.pending() == []
        assert job.stats.steps == 1 and job.stats.straggler_wait_s == pytest.approx(1.0)
        np.testing.assert_array_equal(job.store.tensors[0].snapshot()[:2], [-0.5, -0.5])  # the mean, lr 1
        await job.close()

    run(main)


def test_no_step_closes_before_the_expected_workers_have_joined_once():
    async def main() -> None:
        job = Job(2, started=False)
        job.push(0)
        job.push(1)
        job.clock.advance(100.0)  # no deadline either: the job has not started
        await job.settle()
        assert job.store.version == 0 and job.clock.pending() == []
        job.members.started = True
        job.steps.membership_changed()
        await job.settle()
        assert job.store.version == 1
        await job.close()

    run(main)


def test_the_deadline_closes_a_step_without_a_slow_worker_that_is_still_heard_from():
    async def main() -> None:
        job = Job(3)
        job.push(0)
        job.push(1)
        job.beating(4.9, 2)  # slow, not silent
        await job.settle()
        assert job.store.version == 0
        job.beating(0.2, 2)  # the deadline: 5 s after the first push
        await job.settle()
        assert job.store.version == 1 and job.steps.agg.behind() == []
        # the next step waits for the slow worker again, up to the deadline
        job.push(0)
        job.push(1)
        await job.settle()
        assert job.store.version == 1 and pytest.approx(5.0) in job.clock.pending()
        job.beating(5.0, 2)
        await job.settle()
        assert job.store.version == 2 and job.steps.agg.behind() == []
        await job.close()

    run(main)


def test_a_worker_that_falls_silent_after_a_deadline_costs_the_others_that_deadline_and_no_more():
    """Cut off just before a deadline (heard from then, so only slow), it is behind from
    the moment it is silent (1.5 heartbeats): the step waiting for it closes then, and the
    steps after it do not wait (bench.cut measured 8 steps waiting the deadline before)."""
    async def main() -> None:
        job = Job(3)
        job.push(0)
        job.push(1)
        job.beating(5.0, 0, 1, 2)  # the deadline passes with worker 2 heard from: slow, not behind
        await job.settle()
        assert job.store.version == 1 and job.steps.agg.behind() == []
        job.push(0)
        job.push(1)  # the next step waits for worker 2, whose link is now cut (no more heartbeats)
        job.beating(1.0, 0, 1)
        await job.settle()
        assert job.store.version == 1  # not silent yet
        job.beating(0.6, 0, 1)  # 1.5 heartbeats since its last: silent, behind, and the step closes
        await job.settle()
        assert job.store.version == 2 and job.steps.agg.behind() == [2]
        for _ in range(3):  # the following steps do not wait for it
            job.push(0)
            job.push(1)
            await job.settle()
        assert job.store.version == 5
        # its link is back: its push is folded in and it is waited for again
        job.heartbeat(2)
        job.push(2, version=1)
        assert job.steps.agg.behind() == []
        await job.close()

    run(main)


def test_a_silent_worker_missed_by_a_deadline_is_behind_until_its_late_push_is_folded_in():
    async def main() -> None:
        job = Job(3)
        job.clock.advance(SILENT_BEATS * LIVENESS_S / 4 + 0.1)  # worker 2 sends nothing: silent
        for w in (0, 1):
            job.heartbeat(w)
        job.push(0)
        job.push(1)
        job.clock.advance(5.0)
        await job.settle()
        assert job.store.version == 1 and job.steps.agg.behind() == [2]
        # behind: the following steps do not wait for it, nor for a deadline
        for _ in range(3):
            job.push(0)
            job.push(1)
            await job.settle()
        assert job.store.version == 4 and job.clock.pending() == []
        # its push computed on version 0 arrives: folded into the next step, counted late,
        # and it is waited for again
        job.push(2, version=0, value=4.0)
        assert job.steps.agg.behind() == []
        job.push(0)
        job.push(1)
        await job.settle()
        assert job.store.version == 5 and job.stats.late_pushes == 1
        assert job.store.tensors[0].snapshot()[2] == pytest.approx(-4.0 / 3)  # its value, in a mean of 3
        job.push(0)
        await job.settle()
        assert job.store.version == 5 and job.clock.pending() == [pytest.approx(5.0)]
        await job.close()

    run(main)


def test_a_lost_worker_closes_the_open_step_at_once_and_is_no_sample_for_the_adaptive_deadline():
    async def main() -> None:
        job = Job(2, deadline=Deadline())  # adaptive: 60 s until learnt
        for _ in range(2):  # two complete steps, 0.5 s apart: learnt from the second
            job.push(0)
            job.clock.advance(0.5)
            job.push(1)
            await job.settle()
        adaptive = job.steps.agg.adaptive
        assert adaptive is not None and list(adaptive.spreads) == [pytest.approx(0.5)]
        assert job.steps.agg.current_deadline() == pytest.approx(6 * 0.5)  # 2 x factor 3 x the largest
        job.push(0)
        job.clock.advance(2.0)
        job.heartbeat(0)
        gone = job.members.sweep(1.0)  # worker 1 not heard from for more than 1 s
        assert gone == [1]
        job.steps.workers_lost(gone)
        await job.settle()
        assert job.store.version == 3 and len(adaptive.spreads) == 1  # closed, and learnt nothing
        assert job.clock.pending() == []
        await job.close()

    run(main)


def test_optimizer_changes_ride_on_pushes_and_apply_from_the_step_they_join():
    async def main() -> None:
        job = Job(1)
        t = SparseTensor(0, np.array([0], np.int32), np.array([1.0], np.float32))
        with pytest.raises(ServerError, match="lr"):
            job.steps.offer(job.steps.room(0, 8), 0, [t], {"lr": -1.0})  # refused on arrival: nothing queued
        assert not job.steps.agg.has_pending()
        job.steps.offer(job.steps.room(0, 8), 0, [t], {"lr": 0.25})
        await job.settle()
        assert job.steps.optimizer is not None and job.steps.optimizer.hparams["lr"] == 0.25
        assert job.store.tensors[0].snapshot()[0] == pytest.approx(-0.25)
        await job.close()

    run(main)


# ------------------------------------------------------------------ waiting pulls
@pytest.mark.parametrize(("waits", "release", "answered"), [
    ([(0, 3, 10.0), (1, 4, 10.0), (0, 5, 10.0)], 4, [3, 4]),
    ([(0, 3, 10.0)], 2, []),
    ([(0, 1, 10.0), (1, 1, 10.0)], 9, [1, 1]),
    ([], 1, []),
])
def test_release_answers_every_pull_waiting_for_that_version_or_older(waits, release, answered):
    clock = FakeClock()
    w = PullWaiters(max_per_worker=4, clock=clock)
    got: list[int] = []
    for worker, version, timeout in waits:
        w.add(worker, version, timeout, lambda v=version: got.append(v))
    w.release(release)
    assert sorted(got) == answered and len(w) == len(waits) - len(answered)
    clock.advance(100.0)  # the rest expire, each answered exactly once
    assert len(got) == len(waits) and len(w) == 0 and all(w.waiting(k) == 0 for k in range(2))


def test_a_waiting_pull_expires_at_its_timeout_and_a_worker_waits_for_at_most_its_limit():
    clock = FakeClock()
    w = PullWaiters(max_per_worker=2, clock=clock)
    got: list[str] = []
    w.add(0, 5, 1.0, lambda: got.append("a"))
    w.add(0, 5, 3.0, lambda: got.append("b"))
    with pytest.raises(ServerError, match="--max-waiting-pulls 2"):
        w.add(0, 5, 1.0, lambda: got.append("c"))
    w.add(1, 5, 1.0, lambda: got.append("d"))  # the limit is per worker
    clock.advance(1.5)
    assert sorted(got) == ["a", "d"] and w.waiting(0) == 1
    w.release(5)
    assert sorted(got) == ["a", "b", "d"]
    clock.advance(10.0)  # a released pull's timer does not answer it twice
    assert len(got) == 3
    w.add(0, 9, 1.0, lambda: got.append("e"))
    w.cancel_all()
    clock.advance(10.0)
    assert len(got) == 3 and len(w) == 0


# ------------------------------------------------------------------ the encoded-delta cache
def _store(history: int = 3) -> ModelStore:
    s = ModelStore(Pulls(mode="exact"), history=history, threads=1, dense_below=4096)
    s.initialise([TensorSpec("a", (100,), "float32"), TensorSpec("b", (4,), "float32")],
                 [np.zeros(100, np.float32), np.zeros(4, np.float32)], SGD)
    return s


def _step(s: ModelStore, idx: list[int]) -> None:
    from stella_ps.aggregation import Step

    i = np.array(idx, np.int32)
    s.apply_step(Step([[SparseTensor(0, i, np.ones(i.size, np.float32))], []], 1.0, [0], 0, []), SGD)


@pytest.mark.parametrize(("since", "full", "indices"), [
    (-1, True, None),  # a new worker: a snapshot
    (0, True, None),  # older than the history kept (3 steps of 4): a snapshot
    (1, False, [1, 2, 3, 9]),  # steps 2..4
    (2, False, [2, 3, 9]),
    (3, False, [3, 9]),
    (4, False, []),  # up to date: nothing
])
def test_the_delta_since_a_version_is_the_union_of_the_steps_after_it(since, full, indices):
    s = _store()
    for idx in ([0], [1, 2], [2, 3], [3, 9]):
        _step(s, idx)
    enc = s.encoded_delta(since, "rice")
    assert enc.version == 4 and enc.full == full
    if full:
        assert [e.tensor for e in enc.entries] == [0, 1] and all(e.coding == "dense" for e in enc.entries)
    else:
        got = [e for e in enc.entries if e.tensor == 0]
        assert sum(e.count for e in got) == len(indices) and all(e.tensor != 1 for e in enc.entries)


def test_an_encoded_delta_is_built_once_per_version_since_and_coding():
    s = _store()
    _step(s, [1, 5])
    a = s.encoded_delta(0, "rice")
    assert s.encoded_delta(0, "rice") is a  # every worker of the step gets the same bytes
    b = s.encoded_delta(0, "raw32")
    assert b is not a and b.entries[0].coding == "raw32"
    assert s.encoded_delta(-1, "rice") is not a
    _step(s, [2])  # a step empties the cache: the next answer is of the new version
    c = s.encoded_delta(0, "rice")
    assert c is not a and c.version == 2 and c.entries[0].count == 3


# ------------------------------------------------------------------ the rules' parts
def test_the_adaptive_deadline_follows_the_arrival_spreads_within_its_bounds():
    from stella_ps.aggregation import AdaptiveDeadline

    d = AdaptiveDeadline(quantile=0.9, factor=3.0, minimum=0.5, maximum=30.0, window=20, min_samples=5)
    assert d.value() == 30.0  # nothing learnt: the upper bound
    d.observe(2.0)
    assert d.value() == pytest.approx(12.0)  # one sample: twice the factor times the largest
    d.spreads.clear()
    for x in (0.01, 0.02, 0.01, 0.03):
        d.observe(x)
    assert d.value() == 0.5  # 6 x 0.03 is below the lower bound
    d.spreads.clear()
    for x in (0.01, 0.02, 0.01, 0.03, 0.02):
        d.observe(x)
    assert d.value() == 0.5  # 3 x 0.03 is below the lower bound
    for _ in range(20):
        d.observe(1.0)  # a slower job: the window forgets the old spreads
    assert d.value() == pytest.approx(3.0)
    for _ in range(20):
        d.observe(100.0)
    assert d.value() == 30.0


def test_a_worker_a_deadline_closed_a_step_without_is_not_waited_for_until_it_pushes():
    from stella_ps.aggregation import Aggregator, PendingPush

    agg = Aggregator(max_queued_pushes=4)
    live = [0, 1, 2]
    agg.add(PendingPush(0, 0, []))
    agg.add(PendingPush(1, 0, []))
    assert agg.missing(live) == [2] and not agg.should_close(live, True)
    agg.mark_behind([7], [7])
    agg.mark_behind(agg.missing(live), live)  # the deadline closes the step without worker 2; 7 left
    assert agg.behind() == [2]
    assert agg.take_step(0, 0, complete=False) is not None
    agg.add(PendingPush(0, 1, []))
    agg.add(PendingPush(1, 1, []))
    assert agg.missing(live) == [] and agg.should_close(live, True)  # 2 is behind: not waited for
    agg.take_step(1, 0)
    agg.add(PendingPush(2, 0, []))  # its late push: waited for again from now on
    assert agg.behind() == []
    step = agg.take_step(2, 0)
    assert step is not None and step.contributors == [2] and step.late == 1
    agg.add(PendingPush(0, 3, []))
    assert agg.missing(live) == [1, 2]


def test_membership_declares_silent_workers_gone_revives_them_and_lets_a_session_reclaim_an_id():
    from stella.errors import NotRegistered, ServerError
    from stella_ps.membership import Membership

    m = Membership(expected=2)
    a = m.join(b"conn-a", None)
    b = m.join(b"conn-b", None)
    a.registered = True  # b joined but never registered
    now = time.monotonic()
    assert m.sweep(1.0, now + 0.5) == []
    a.last_seen = now + 1.0  # a heartbeat; b sends nothing
    assert m.sweep(1.0, now + 1.6) == [b.worker]
    assert set(m.gone) == {b.worker} and set(m.live) == {a.worker}
    # a's old connection is still live: a new connection without the session is refused...
    with pytest.raises(ServerError, match="in use"):
        m.join(b"conn-a2", a.worker)
    # ...with it, the id moves over (a reconnect), keeping the worker's state
    a.last_push_req = 7
    moved = m.join(b"conn-a2", a.worker, session=a.session)
    assert moved is a and a.routing_id == b"conn-a2" and a.last_push_req == 7
    # a gone id is given again to a new connection (a restarted process)
    again = m.join(b"conn-b2", b.worker)
    assert again.worker == b.worker and b.worker not in m.gone
    # heartbeats: an unknown session is refused; a gone registered worker is revived by one
    with pytest.raises(NotRegistered):
        m.heartbeat(a.worker, a.session + 1, "")
    assert m.sweep(1.0, time.monotonic() + 5) == [a.worker, again.worker]
    info, revived = m.heartbeat(a.worker, a.session, "")
    assert revived and info is a and a.worker in m.live
    # a gone worker speaking on its own connection is live again
    assert m.revive(b"conn-b2", again.worker) is again and again.worker in m.live


def test_a_worker_asked_for_the_models_values_is_kept_alive_by_its_heartbeats_meanwhile():
    """Its upload (39 MB take 31 s at 10 Mbit/s) may outlast the liveness timeout: a joined
    worker the server asked for the values counts its heartbeats, as a registered one does;
    a stray join still does not."""
    from stella_ps.membership import Membership

    m = Membership(expected=2)
    up = m.join(b"conn-up", None)
    stray = m.join(b"conn-stray", None)
    waiting = m.join(b"conn-waiting", None)
    up.registering = True
    waiting.held = True  # its probe is held while `up` uploads (5 Mbit/s: 62 s; it was declared gone at 20 s)
    now = time.monotonic()
    up.last_seen = stray.last_seen = waiting.last_seen = now + 2.0  # all heartbeat; none sends a request
    assert m.sweep(1.0, now + 2.5) == [stray.worker]
    assert up.worker in m.live and waiting.worker in m.live



def test_the_workers_steps_wait_for_follow_every_change_of_the_live_set():
    """``Membership.waited`` is kept between changes (a push must not walk the live
    workers): after each way a worker comes, goes, registers or pushes, it is what a
    fresh walk of the live workers gives."""
    m = Membership(expected=2)

    def fresh() -> tuple[int, ...]:
        return tuple(w for w, i in m.live.items() if i.waited)

    seen = []

    def check() -> None:
        assert m.waited() == fresh()
        seen.append(m.waited())

    a, b = m.join(b"conn-a", None), m.join(b"conn-b", None)
    check()  # joined, not registered: not waited
    m.register(a)
    m.register(b)
    check()
    m.stepped = True
    late = m.join(b"conn-late", None)
    m.register(late)  # after the first step: waited from its first push on
    check()
    m.pushed(late.worker)
    check()
    m.leave(b.worker)
    check()
    now = time.monotonic()
    a.last_seen = now + 10
    assert m.sweep(1.0, now + 5) == [late.worker]
    check()
    assert m.revive(b"conn-late", late.worker) is late
    check()
    assert m.sweep(1.0, now + 5) == [late.worker]
    info, revived = m.heartbeat(late.worker, late.session, "")
    assert info is late
    assert revived
    check()
    assert m.sweep(1.0, now + 5) == [late.worker]
    assert m.join(b"conn-late2", late.worker, session=late.session) is late  # back from gone with its token
    check()
    keyed = m.join(b"conn-k", None, key="k")
    m.register(keyed)
    m.pushed(keyed.worker)
    check()
    assert m.drop_key("k") == [keyed.worker]
    check()
    assert seen == [(), (a.worker, b.worker), (a.worker, b.worker), (a.worker, b.worker, late.worker),
                    (a.worker, late.worker), (a.worker,), (a.worker, late.worker), (a.worker, late.worker),
                    (a.worker, late.worker), (a.worker, late.worker, keyed.worker), (a.worker, late.worker)]


def test_a_push_does_not_walk_the_live_workers():
    """What a push's check of "does the step close" reads does not grow with the
    workers: over a step of 64 workers' pushes it visits at most 3 x 64 of them (the
    last push's walk and the one list of who is waited), where a walk per push visits
    64 x 65 / 2 or more."""
    async def main() -> None:
        n = 64
        job = Job(n)
        visited = [0]
        live = job.members.live

        class Counting(dict):
            def items(self):  # the walk of waited()
                for kv in super().items():
                    visited[0] += 1
                    yield kv

        job.members.live = Counting(live)
        waited = job.members.waited

        class CountingTuple(tuple):
            def __iter__(self):  # the walk of should_close
                for w in super().__iter__():
                    visited[0] += 1
                    yield w

        job.members.waited = lambda: CountingTuple(waited())  # type: ignore[method-assign]
        for w in range(n):
            job.push(w)
        await job.settle()
        assert job.store.version == 1 and job.applied == [1]
        assert visited[0] <= 3 * n, visited[0]
        await job.close()

    run(main)


# ------------------------------------------------------------------ a step that fails part way
class _Fault(Exception):
    pass


def test_a_steps_late_pushes_are_counted_before_its_version_is_visible():
    """The store thread moves the version, and a pull waiting for it is answered from then
    on, before the loop goes on after the apply. A status read right after that pull must
    already count the step's late pushes (CI read 0 there, at the version of the step that
    held the late push)."""
    async def main() -> None:
        job = Job(2)
        for _ in range(3):
            job.push(0)
            job.push(1)
            await job.settle()
        seen: list[tuple[int, int]] = []
        real = job.store.apply_step

        def apply_step(*a, **k):  # on the store thread: the moment the new version is visible
            v = real(*a, **k)
            seen.append((job.store.version, job.stats.late_pushes))
            return v

        job.store.apply_step = apply_step  # type: ignore[method-assign]
        job.push(0, version=0)  # computed on version 0 with the store at 3: late
        job.push(1)
        await job.settle()
        assert seen == [(4, 1)] and job.stats.late_pushes == 1
        await job.close()

    run(main)


def test_a_step_that_fails_in_the_broadcast_is_undone_and_the_version_still_moves_on():
    """The broadcast's part of a step raises (a fault, MemoryError): the kernel's part is
    undone, B + R is the exact model again, every replica's next pull is a snapshot, the
    step closes empty so that waiting pulls are answered, and the next step applies."""
    async def main() -> None:
        job = Job(2)
        store = ModelStore(Pulls(), history=64, threads=1, dense_below=4096)
        store.initialise([TensorSpec("w", (8,), "float32")], [np.zeros(8, np.float32)], SGD)
        job.store = job.steps.store = store
        job.push(0)
        job.push(1)
        await job.settle()
        assert store.version == 1 and job.applied == [1]
        before = store.tensors[0].snapshot()
        real_step = store.broadcast.step

        def failing(*a, **k):  # once: the empty step after it succeeds
            store.broadcast.step = real_step  # type: ignore[method-assign]
            real_step(*a, **k)  # B and R changed for the tensor, then the fault: no message
            raise _Fault("injected")

        store.broadcast.step = failing  # type: ignore[method-assign]
        job.push(0, value=4.0)
        job.push(1, value=4.0)
        await job.settle()
        assert store.version == 2 and job.applied == [1, 2]  # closed empty: the waiting pulls get version 2
        np.testing.assert_array_equal(store.tensors[0].snapshot(), before)  # the failed step's pushes: undone
        b = store.broadcast
        np.testing.assert_array_equal(b.model[0] + b.residual[0], before)  # nothing owed is lost
        assert b.since(1, 2) is None  # no message bridges the failure: a snapshot
        assert job.stats.rejected_steps == 1 and job.stats.rejected_pushes == 2
        job.push(0, value=2.0)
        job.push(1, value=2.0)
        await job.settle()
        assert store.version == 3
        np.testing.assert_array_equal(store.tensors[0].snapshot()[:2], before[:2] - 1.0)  # mean 2 x 0.5 x lr 1
        await job.close()

    run(main)


def test_a_checkpoint_copy_that_overlaps_a_failed_step_is_abandoned():
    from stella_ps.aggregation import Step
    from stella_ps.errors import CopyAbandoned, StepFailed

    store = ModelStore(Pulls(), history=64, threads=1, dense_below=4096)
    store.initialise([TensorSpec("w", (8,), "float32")], [np.zeros(8, np.float32)], SGD)
    store.begin_copy()
    store.copy_records(0, 0, 8)

    def failing(*a, **k):
        raise _Fault("injected")

    store.broadcast.step = failing  # type: ignore[method-assign]
    t = SparseTensor(0, np.array([1], np.int32), np.array([1.0], np.float32))
    with pytest.raises(StepFailed, match="step 1 failed in the broadcast"):
        store.apply_step(Step(per_tensor=[[t]], scale=1.0, contributors=[0], late=0, hparams=[]), SGD)
    assert store.version == 0
    with pytest.raises(CopyAbandoned):
        store.end_copy()
    store.begin_copy()  # the next copy starts afresh and ends normally
    assert store.end_copy() == (0, [])
