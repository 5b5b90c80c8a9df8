"""When a step closes, and with which optimizer configuration: :class:`StepScheduler`.

The rules (README "Stragglers", docs/protocol.md):

- A step closes when every worker it waits for (:meth:`Membership.waited`: those that
  pushed, and the job's first cohort) has a pending push (:meth:`Aggregator.should_close`),
  once the job has started (``--workers`` registered once).
- Otherwise the deadline after the step's first push closes it without the missing
  workers (fixed, or learnt from the job: :class:`~stella_ps.aggregation.AdaptiveDeadline`).
- Of the missing workers, the *silent* ones (no request or heartbeat for
  :data:`SILENT_BEATS` heartbeat intervals: dead, stopped, cut off) are then *behind*:
  later steps do not wait for them until their next push arrives. One still heard from
  (a long evaluation, a slow machine) is only slow and waited for up to the deadline;
  but if it falls silent before its next push (a link cut just before the deadline), it
  is behind from that moment, and a step that waited only for it closes then: a cut
  site costs the others one deadline, not one per step until the silence shows.
- A push that missed its step is folded into the next one (the aggregator keeps it).
- A worker declared gone (liveness) or dropped (allowlist) stops being waited for at
  once; the step its loss closes is not a sample for the adaptive deadline.
- The finite-step guard: a step whose result would hold a NaN or Inf anywhere is undone
  by the kernel; it is applied again without the pushes that are non-finite on their
  own (their workers' next request is refused), or as an empty step.
- A step applies whole or not at all: one that fails anywhere (its aggregation, the
  kernel, the broadcast, memory, a bug) is undone by the store and closes empty, its
  pushes dropped, so that the pulls waiting for it are answered. One that can be
  neither applied whole nor closed (its undo failed too, :class:`ModelDamaged`) closes
  no step after it: :meth:`StepScheduler.on_failure` tells the server, which stops and
  exits 1 (without a last checkpoint when the model may be damaged), for its supervisor
  to restart it from its newest checkpoint.

The scheduler is the only writer of the optimizer configuration in force:
``set_optimizer`` and the ``hparams`` pushes carry change it on the event loop (each
checked on arrival against the operator's bounds), and each step takes the
configuration in force when it closes. Applying runs on the store thread; the event
loop keeps receiving. Time comes from a :class:`~stella_ps.runtime.Clock`, so
``tests/test_steps.py`` drives every rule with a fake clock and no sleeps.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from stella.errors import ErrorCode, ServerError
from stella.payload import SparseTensor

from .aggregation import AdaptiveDeadline, Aggregator, PendingPush, Step
from .config import Deadline, Limits, Liveness
from .errors import ConfigError, NonFiniteStep, StepFailed
from .membership import Membership
from .optim import OptimizerConfig
from .runtime import Clock, StoreThread, Tasks, Timer
from .stats import Stats
from .store import ModelStore

__all__ = ["StepScheduler", "Room", "SILENT_BEATS"]

# A step of at most this many pushed values, on a model of at most this many coordinates, is applied on the
# event loop when the store thread is idle (see _apply_ready).
LIGHT_STEP_VALUES = 16_384
LIGHT_STEP_NUMEL = 1 << 22

log = logging.getLogger("stella_ps.steps")
SILENT_BEATS = 1.5  # a worker not heard from for this many heartbeat intervals is silent

StepListener = Callable[[int], None]
FailureListener = Callable[[BaseException], None]


@dataclass(frozen=True, slots=True)
class Room:
    """A push's place in its worker's queue, found by :meth:`StepScheduler.room` before
    the push's values are decoded; :meth:`StepScheduler.offer` takes it and checks the
    queue's bounds no second time (the two run on the event loop with no await between
    them, so nothing else is queued meanwhile)."""

    worker: int
    nbytes: int


class StepScheduler:
    """Pending pushes, the deadline, and the apply loop of one job."""

    def __init__(self, store: ModelStore, members: Membership, store_thread: StoreThread, tasks: Tasks, clock: Clock,
                 stats: Stats, *, deadline: Deadline, limits: Limits, liveness: Liveness,
                 default_optimizer: OptimizerConfig):
        self.store, self.members, self._store_thread, self._tasks = store, members, store_thread, tasks
        self._clock, self._stats = clock, stats
        self._limits = limits.optimizer_limits
        self._silent_after = SILENT_BEATS * liveness.heartbeat_s
        self.default_optimizer = default_optimizer
        adaptive = (AdaptiveDeadline(quantile=deadline.quantile, factor=deadline.factor, minimum=deadline.min,
                                     maximum=deadline.max) if deadline.adaptive else None)
        self.agg = Aggregator(step_deadline=deadline.fixed, max_queued_pushes=limits.max_queued_pushes,
                              max_queued_push_bytes=limits.max_queued_push_bytes, adaptive=adaptive,
                              clock=clock.now, max_sample_ratio=limits.max_sample_ratio)
        self.optimizer: OptimizerConfig | None = None  # in force; set when the model is initialised
        self.last_apply_s = 0.0  # the latest step's time on the store thread (pulls tell workers)
        self.last_pushes = 0  # the pushes the latest step that had any combined (pulls tell workers)
        self._listeners: list[StepListener] = []
        self._failure_listeners: list[FailureListener] = []
        self.failed: BaseException | None = None  # why no step can close any more (on_failure)
        self._applying = False
        self._timer: Timer | None = None
        self._silence: Timer | None = None  # watches missing workers still heard from at a deadline
        self._watched: set[int] = set()
        self._opened: float | None = None  # when the open step's first push arrived
        self._lost_worker = False  # a worker was lost while the open step waited: not a complete step
        self._idle = asyncio.Event()
        self._idle.set()

    def on_step(self, listener: StepListener) -> None:
        """Call ``listener(version)`` after each step is applied."""
        self._listeners.append(listener)

    # ------------------------------------------------------------------ the optimizer in force
    def checked(self, cfg: OptimizerConfig) -> OptimizerConfig:
        """``cfg`` if inside the operator's bounds; a ``optimizer`` refusal otherwise."""
        try:
            return self._limits.check(cfg)
        except ConfigError as e:
            raise ServerError(str(e), ErrorCode.OPTIMIZER) from None

    def initial(self, wire: dict[str, Any] | None) -> OptimizerConfig:
        """The configuration a registration asks for (``None``/empty: the server's default), checked."""
        try:
            cfg = OptimizerConfig.from_wire(dict(wire)) if wire else self.default_optimizer
        except ConfigError as e:
            raise ServerError(str(e), ErrorCode.OPTIMIZER) from None
        return self.checked(cfg)

    def change(self, hparams: dict[str, Any]) -> OptimizerConfig:
        """The configuration in force with ``hparams`` changed, checked; not applied."""
        assert self.optimizer is not None  # a registered worker implies a model
        try:
            return self.checked(self.optimizer.updated(dict(hparams)))
        except ConfigError as e:
            raise ServerError(str(e), ErrorCode.OPTIMIZER) from None

    def set_optimizer(self, hparams: dict[str, Any]) -> OptimizerConfig:
        """Change the configuration from the next step that closes on."""
        self.optimizer = self.change(hparams)
        return self.optimizer

    def _for_step(self, changes: list[dict[str, Any]]) -> OptimizerConfig:
        """The configuration a step runs with, after the changes its pushes carry (each
        was checked when its push arrived; one valid alone may not be after another)."""
        for hp in changes:
            try:
                self.optimizer = self.change(hp)
            except ServerError as e:
                log.warning("optimizer change dropped", extra={"hparams": hp, "reason": str(e)})
        assert self.optimizer is not None
        return self.optimizer

    # ------------------------------------------------------------------ events
    def room(self, worker: int, nbytes: int) -> Room:
        """Room for a push of ``nbytes`` from ``worker`` (the one check of its queue's
        bounds); a ``limit`` refusal, changing nothing, beyond them."""
        self.agg.check_room(worker, nbytes)
        return Room(worker, nbytes)

    def offer(self, room: Room, version: int, tensors: list[SparseTensor], hparams: dict[str, Any] | None,
              samples: int | None = None, coding: str = "f16") -> int:
        """Queue a validated push in the ``room`` found for it (refused, changing nothing,
        with ``hparams`` out of bounds); returns how many of its worker's pushes wait before it.
        ``coding``: its selected values' wire coding (the broadcast's budget counts by it)."""
        if hparams:
            self.change(hparams)  # refused now, not when the step applies
        now = self._clock.now()
        if not self.agg.has_pending():
            self._opened = now
        queued = self.agg.add(PendingPush(room.worker, version, tensors, hparams, room.nbytes, arrived=now,
                                          samples=samples, coding=coding))
        self.members.pushed(room.worker)
        self._maybe_close(first_push=True)
        return queued

    def membership_changed(self) -> None:
        """A worker joined or left: the open step may close now."""
        self._maybe_close()

    def workers_lost(self, workers: Sequence[int]) -> None:
        """``workers`` were declared gone or dropped while steps may wait for them."""
        if workers:
            self._lost_worker = True  # the open step's spread now includes the wait for the lost ones
            self._maybe_close()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._silence is not None:
            self._silence.cancel()
            self._silence = None

    async def idle(self) -> None:
        """Wait until no step is being applied."""
        await self._idle.wait()

    # ------------------------------------------------------------------ what status shows
    def pending_count(self) -> int:
        """Pushes waiting for their step."""
        return self.agg.pending_count()

    def pending_workers(self) -> set[int]:
        """Workers with pushes waiting (their ids stay reserved: those of a worker that left included)."""
        return self.agg.pending_workers()

    def deadline_now(self) -> float | None:
        """The deadline a step waits for missing workers now (None: it waits for all)."""
        return self.agg.current_deadline()

    def behind(self) -> list[int]:
        """Live workers a deadline closed a step without, silent: not waited for until they push."""
        return [w for w in self.agg.behind() if w in self.members.live]

    # ------------------------------------------------------------------ the finite-step guard
    def _apply_guarded(self, step: Step, cfg: OptimizerConfig) -> int:
        """On the store thread (a light step: on the loop), after ``step`` was undone for a
        non-finite result: the pushes that are non-finite alone (at the step's scale) are
        the offenders; the step is applied without them, or, if that is not finite either,
        as an empty step (the version moves on, the model does not). Offenders' next request is
        refused (:meth:`Membership.refuse_next`)."""
        offenders = [w for w in step.contributors if not self.store.finite_alone(step.only(w), cfg)]
        # marked before the version moves on: a request of theirs that sees the new version is refused
        for w in offenders:
            self.members.refuse_next(w, f"the push of worker {w} for step {self.store.version + 1} was not applied: "
                                        "it would have made the model non-finite (NaN/Inf)")
        rest = step.without(offenders) if offenders else step.without(step.contributors)
        try:
            version = self.store.apply_step(rest, cfg)
        except NonFiniteStep:
            rest = step.without(step.contributors)
            version = self.store.apply_step(rest, cfg)
        dropped = [w for w in step.contributors if w not in rest.contributors]
        self._stats.rejected_steps += 1
        self._stats.rejected_pushes += len(dropped)
        log.error("step would have made the model non-finite: pushes dropped", extra={
            "version": version, "offenders": offenders, "dropped_workers": dropped,
            "applied_workers": rest.contributors})
        return version

    # ------------------------------------------------------------------ a step, whole or not at all
    def _take_step(self, complete: bool) -> tuple[Step | None, StepFailed | None]:
        """The open step's pushes, taken from their queues: the step, or (None, why) when
        it could not be built (its pushes are gone: it closes empty), or (None, None)
        when there was nothing to take."""
        try:
            return self.agg.take_step(self.store.version, len(self.store.layout), complete=complete), None
        except StepFailed as e:
            return None, e
        except Exception as e:  # before any push was taken (Aggregator.take_step names the taken ones)
            return None, StepFailed(f"step {self.store.version + 1} failed in the aggregation "
                                    f"({type(e).__name__}: {e})")

    def _apply_whole(self, step: Step | None, cfg: OptimizerConfig, failed: StepFailed | None) -> int:
        """On the store thread (a light step: on the loop, :meth:`_light`): ``step`` applied
        whole, or not at all and closed empty (:meth:`_close_empty`); ``step`` None: it
        could not be built (``failed``), and closes empty. Raises (:class:`ModelDamaged`,
        or the empty step's own failure) only when the step can be neither: the caller
        stops the server."""
        if step is None:
            assert failed is not None
            return self._close_empty(failed.workers, cfg, failed)
        try:
            try:
                return self.store.apply_step(step, cfg)
            except NonFiniteStep:
                return self._apply_guarded(step, cfg)
        except StepFailed as e:  # undone: the model is as before the step
            return self._close_empty(step.contributors, cfg, e)

    def _light(self, step: Step | None) -> bool:
        """Whether ``step`` is light enough to apply on the event loop: few pushed values, on a
        model small enough that the step's heaviest work (the broadcast's pass over its
        residual, when it cannot use its index) takes about a millisecond."""
        if self.store.numel > LIGHT_STEP_NUMEL:
            return False
        if step is None:
            return True
        return sum(p.values.size for parts in step.per_tensor for p in parts) <= LIGHT_STEP_VALUES

    def _close_empty(self, dropped: Sequence[int], cfg: OptimizerConfig, error: StepFailed) -> int:
        """On the store thread (or the loop), after a step failed and changed nothing
        (:class:`StepFailed`): it closes empty (the version moves on, so that every pull waiting for it is
        answered; the model does not), and its pushes (of ``dropped``) are dropped, as a
        non-finite step's are when nothing else is left."""
        version = self.store.apply_step(Step.empty(len(self.store.layout)), cfg)
        self._stats.rejected_steps += 1
        self._stats.rejected_pushes += len(dropped)
        log.error("step failed and was undone: its pushes were dropped", extra={
            "version": version, "dropped_workers": list(dropped), "error": str(error)})
        return version

    def on_failure(self, listener: FailureListener) -> None:
        """Call ``listener(error)`` once if a step can neither be applied whole nor closed
        empty (:meth:`_apply_whole` raised): no step closes after it, and the server must
        stop (it exits 1: docs/security.md)."""
        self._failure_listeners.append(listener)

    def _fail(self, error: BaseException) -> None:
        if self.failed is not None:
            return
        self.failed = error
        self.close()
        for listener in self._failure_listeners:
            listener(error)

    # ------------------------------------------------------------------ closing steps
    def _maybe_close(self, first_push: bool = False) -> None:
        if self._applying or self.failed is not None:
            return  # the running apply loop checks again when it finishes; after a failure no step closes
        if self.agg.should_close(self.members.waited(), self.members.started):
            self._start_applying(force=False)
        elif first_push and self._timer is None and self.agg.has_pending():
            after = self.agg.deadline(self.members.started)
            if after is not None:
                self._timer = self._clock.call_later(after, self._on_deadline)

    def _on_deadline(self) -> None:
        self._timer = None
        if self._applying or self.failed is not None or not self.agg.has_pending():
            return
        missing = self.agg.missing(self.members.waited())
        silent = self.members.silent(missing, self._silent_after)
        log.info("step deadline passed", extra={"missing_workers": missing, "silent_workers": silent,
                                                "version": self.store.version})
        self.agg.mark_behind(silent, self.members.live)
        self._watched.update(w for w in missing if w not in silent)
        self._watch_silence()
        self._start_applying(force=True)

    def _watch_silence(self) -> None:
        """Look again, when the first of the watched workers could have fallen silent,
        whether they did (until each pushes, is silent, or is gone)."""
        if self._silence is not None or self._silent_after <= 0 or self.failed is not None:
            return
        live = self.members.live
        self._watched = {w for w in self._watched if w in live and not self.agg.has_pending_of(w)}
        if not self._watched:
            return
        first = min(live[w].last_seen for w in self._watched)
        self._silence = self._clock.call_later(first + self._silent_after - self._clock.now() + 0.01,
                                               self._on_silence)

    def _on_silence(self) -> None:
        self._silence = None
        if self.failed is not None:
            return
        waiting = [w for w in self._watched if w in self.members.live and not self.agg.has_pending_of(w)]
        silent = self.members.silent(waiting, self._silent_after)
        if silent:
            log.info("workers that missed a step fell silent: not waited for until they push",
                     extra={"silent_workers": silent, "version": self.store.version})
            self.agg.mark_behind(silent, self.members.live)
            self._watched.difference_update(silent)
            self._maybe_close()
        self._watch_silence()

    def _start_applying(self, force: bool) -> None:
        self._applying = True
        self._idle.clear()
        self._tasks.spawn(self._apply_ready(force))

    async def _apply_ready(self, force: bool) -> None:
        try:
            while force or self.agg.should_close(self.members.waited(), self.members.started):
                complete = not force and not self._lost_worker
                force = self._lost_worker = False
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
                step, failed = self._take_step(complete)
                if step is None and failed is None:
                    break
                cfg = self.optimizer
                if step is not None:
                    # counted now, in the loop: the store thread makes the step's version visible (a pull answered,
                    # then a status read) before this coroutine goes on after the apply
                    self._stats.late_pushes += step.late
                    try:
                        cfg = self._for_step(step.hparams)
                    except Exception as e:  # a bug: each change was checked when its push arrived
                        failed = StepFailed(f"step {self.store.version + 1} failed in its optimizer changes "
                                            f"({type(e).__name__}: {e}); its pushes were dropped", step.contributors)
                        step = None
                assert cfg is not None
                t0 = self._clock.now()
                opened, self._opened = self._opened, (t0 if self.agg.has_pending() else None)
                try:
                    if self._light(step) and self._store_thread.idle:
                        # on the loop: nothing else holds the store, and the hop to its thread and back (two
                        # wake-ups, the GIL passed twice) would cost more than the step
                        version = self._apply_whole(step, cfg, failed)
                    else:
                        version = await self._store_thread.run(self._apply_whole, step, cfg, failed)
                except Exception as e:  # neither whole nor closed empty: no step can close after it
                    self._fail(e)
                    return
                now = self._clock.now()
                self._stats.count_step(now, now - t0, opened)
                self.last_apply_s = now - t0
                if step is not None and step.contributors:
                    self.last_pushes = len(set(step.contributors))
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("step applied", extra={"version": version, "apply_ms": round(1e3 * (now - t0), 3),
                                                     "contributors": len(step.contributors) if step else 0})
                self.members.stepped = True
                for listener in self._listeners:
                    try:
                        listener(version)
                    except Exception as e:  # the step is applied: one listener's bug must not cost the others
                        log.error("after a step: a listener failed", exc_info=e, extra={"version": version})
        finally:
            self._applying = False
            self._idle.set()
        if self.agg.has_pending():
            self._maybe_close(first_push=True)
