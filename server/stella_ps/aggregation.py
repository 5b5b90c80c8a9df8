"""Synchronous step aggregation: when a step closes, which pushes it takes, their
grouping per tensor, the mean's scale, and late pushes.

A step closes when every live worker has a pending push, or when the step deadline
after the step's first push passes (:meth:`Aggregator.deadline`). A worker a deadline
closed a step without, and that is silent too (the step scheduler tells: no heartbeat for a
while), is *behind* (:meth:`Aggregator.mark_behind`): later steps do not wait for it
until its next push arrives, so a dead or stopped worker costs a deadline or two, not
one per step until the liveness timeout declares it gone. One that is still heard from
is only slow, and every step waits for it up to the deadline. The deadline is
adaptive by default (:class:`AdaptiveDeadline`): a quantile of the recent spreads
of push arrivals within complete steps, times a factor, within the operator's
bounds; so a healthy job never waits a fixed guess, and a straggler costs a
bounded multiple of the usual spread. ``--step-deadline S`` fixes it instead.
Each closed step takes at most one push per worker, oldest first; a push that
missed its step stays queued and is folded into the next one, never dropped.
Pushes of a worker that left still count. The first step waits until the expected
number of workers have registered once (``started``, kept by the membership); the
membership also says which live workers a step waits for (``waited``).

Each worker's queue is bounded (``stella-ps --max-queued-pushes`` and
``--max-queued-push-bytes``): a push beyond either bound is refused and nothing is
queued. The bounds are checked once a push, before its values are decoded
(:meth:`Aggregator.check_room`, through :meth:`stella_ps.steps.StepScheduler.room`).
A push to an empty queue is always taken (the message size limit bounds it), so the
byte bound limits the backlog, never a worker's only push.
"""
from __future__ import annotations

import bisect
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stella.codec import broadcast_share, sum_of_squares, to_float32
from stella.errors import BadValue, ErrorCode, ServerError
from stella.payload import SparseTensor

from .errors import StepFailed

__all__ = ["PendingPush", "Step", "Aggregator", "budget_counts",
           "AdaptiveDeadline", "PushNormBound", "count_exponent_at", "count_table",
           "push_norm", "scaled", "step_count_table", "step_density", "weigh"]

log = logging.getLogger("stella_ps.aggregation")


def budget_counts(step: Step, numels: Sequence[int]) -> list[float]:
    """Each tensor's coordinates the step's pushes held, on average over its contributors,
    as the broadcast's budget counts them: a selected coordinate by its coding's bits
    against f16's (:func:`stella.codec.broadcast_share`), a whole tensor's in full."""
    n = max(1, len(step.contributors))
    codings = step.codings or {}
    out = []
    for t, parts in enumerate(step.per_tensor):
        owners = step.owners[t] if step.owners is not None else [-1] * len(parts)
        total = 0.0
        for p, w in zip(parts, owners):
            size = p.values.size
            coding = codings.get(w, "f16")
            total += size if p.indices is None or coding == "f16" else size * broadcast_share(size / numels[t], coding)
        out.append(total / n)
    return out


@dataclass(slots=True, eq=False)
class PendingPush:
    """A validated push waiting for its step (not changed once made; a plain slotted
    class: a frozen dataclass costs four times as much to make, once a push)."""

    worker: int
    version: int  # model version the update was computed on
    tensors: list[SparseTensor]
    hparams: dict[str, Any] | None = None  # optimizer changes from this push's step on
    nbytes: int = 0
    arrived: float = field(default_factory=time.monotonic)
    samples: int | None = None  # what the push says it represents (None: one unit)
    coding: str = "f16"  # its selected values' wire coding (what they count for in the broadcast's budget)


@dataclass(frozen=True)
class Step:
    """What one closed step applies.

    ``per_tensor[t]`` holds the pushes' parts for tensor ``t`` as the wire decoder
    made them (:class:`~stella.payload.SparseTensor`); their sum is applied times ``scale``, the mean over the step's
    contributors. ``late`` counts pushes computed on a version older than the one
    before this step (they missed their own step and were folded into this one).
    ``hparams`` are the optimizer changes the step's pushes carry, in worker order.
    """

    per_tensor: list[list[SparseTensor]]
    scale: float
    contributors: list[int]
    late: int
    hparams: list[dict[str, Any]]
    owners: list[list[int]] | None = None  # owners[t][i]: the worker of per_tensor[t][i]
    # weighted steps (pushes of unequal samples): each contributor's samples, and the
    # samples one unit of its (pre-multiplied) values stands for (see :func:`weigh`)
    samples: dict[int, int] | None = None
    unit: float = 1.0
    codings: dict[int, str] | None = None  # each contributor's push coding (None: f16 for all)

    @classmethod
    def empty(cls, ntensors: int) -> Step:
        """A step of no push: it changes no parameter, and the version moves on."""
        return cls([[] for _ in range(ntensors)], 0.0, [], 0, [], [[] for _ in range(ntensors)])

    def without(self, workers: Collection[int]) -> Step:
        """This step without the pushes of ``workers``, the (weighted) mean over the
        others (a step with no contributor left changes nothing)."""
        assert self.owners is not None, "a step built without owners cannot drop a worker's push"
        drop = set(workers)
        keep = [w for w in self.contributors if w not in drop]
        per_tensor = [[p for p, w in zip(parts, owners) if w not in drop]
                      for parts, owners in zip(self.per_tensor, self.owners)]
        owners = [[w for w in owners if w not in drop] for owners in self.owners]
        if not keep:
            scale = 0.0
        elif self.samples is None:
            scale = 1.0 / len(keep)
        else:
            scale = self.unit / sum(self.samples[w] for w in keep)
        return Step(per_tensor, scale, keep, self.late, self.hparams, owners, self.samples, self.unit, self.codings)

    def only(self, worker: int) -> Step:
        """The push of ``worker`` alone, at this step's scale (the others as zero)."""
        s = self.without([w for w in self.contributors if w != worker])
        return Step(s.per_tensor, self.scale, s.contributors, 0, [], s.owners, self.samples, self.unit, self.codings)


def weigh(pushes: list[PendingPush], max_ratio: float) -> tuple[dict[int, int] | None, float, list[list[SparseTensor]]]:
    """The weighting of one step's pushes by the samples each represents.

    The step applies ``sum_i n_i v_i / N`` (``N = sum_i n_i``) instead of the plain
    mean. It is computed as ``scale * sum_i (n_i / u) v_i`` with ``u = N / K`` (K
    pushes) and ``scale = u / N = 1 / K``: each push's values are multiplied by
    ``n_i / u`` once, here, and the kernel's sum and scale are those of an unweighted
    step. A push without ``samples`` counts as 1; each ``n_i`` is capped at
    ``max_ratio`` times the smallest of the step (``--max-sample-ratio``), so one
    push's claim cannot take over the mean. Equal samples (the usual case): no
    weighting (returns None) and the values are untouched, bit for bit as before.
    """
    ns = [p.samples or 1 for p in pushes]
    if len(set(ns)) <= 1:
        return None, 1.0, [p.tensors for p in pushes]
    cap = max_ratio * min(ns)
    ns = [int(min(n, cap)) for n in ns]
    if len(set(ns)) <= 1:
        return None, 1.0, [p.tensors for p in pushes]
    unit = sum(ns) / len(ns)
    tensors = [p.tensors if n == unit else scaled(p.tensors, n / unit) for p, n in zip(pushes, ns)]
    return {p.worker: n for p, n in zip(pushes, ns)}, unit, tensors


@dataclass
class AdaptiveDeadline:
    """The step deadline learnt from the job: ``factor`` times the ``quantile`` of the
    arrival spreads (seconds from a step's opening, the later of the previous close
    and its first push, to its last push) of the last ``window`` steps that closed
    complete, clamped to ``[minimum, maximum]``. Until ``min_samples`` spreads are
    known, twice that of the largest one seen (a quantile of a few is no estimate,
    but waiting out ``maximum`` on every step of a young job, or of a server just
    restarted, would be the fixed guess this replaces); ``maximum`` before the first.
    Steps closed by the deadline are not samples: their spread is only known to be
    longer, and counting them would let stragglers raise it."""

    quantile: float = 0.9
    factor: float = 3.0
    minimum: float = 1.0
    maximum: float = 60.0
    window: int = 100
    min_samples: int = 5
    spreads: deque[float] = field(default_factory=deque)

    def observe(self, spread: float) -> None:
        self.spreads.append(max(0.0, spread))
        while len(self.spreads) > self.window:
            self.spreads.popleft()

    def value(self) -> float:
        if not self.spreads:
            return self.maximum
        if len(self.spreads) < self.min_samples:
            wait = 2.0 * self.factor * max(self.spreads)
        else:
            xs = sorted(self.spreads)
            wait = self.factor * xs[min(len(xs) - 1, max(0, math.ceil(self.quantile * len(xs)) - 1))]
        return min(self.maximum, max(self.minimum, wait))


class Aggregator:
    """Pending pushes per worker and the rule that closes a step."""

    def __init__(self, step_deadline: float = 0.0, max_queued_pushes: int = 4,
                 max_queued_push_bytes: int = 256 << 20, adaptive: AdaptiveDeadline | None = None,
                 clock: Callable[[], float] = time.monotonic, max_sample_ratio: float = 8.0):
        self.max_sample_ratio = max_sample_ratio  # the largest push's weight over the smallest's, in a step
        self._clock = clock  # the time a step closes (push arrivals are stamped by whoever makes them)
        self.step_deadline = step_deadline  # seconds; 0: the adaptive deadline, or none
        self.adaptive = adaptive  # used when step_deadline is 0; None: wait for every live worker
        self.max_queued_pushes = max_queued_pushes  # per worker
        self.max_queued_push_bytes = max_queued_push_bytes  # per worker, once its queue is not empty
        self._pending: dict[int, deque[PendingPush]] = {}  # only queues that hold a push (take_step drops the empty)
        self._last_close = 0.0  # monotonic time the previous step closed
        self._pushed_before: set[int] = set()  # workers with a step behind them
        self._behind: set[int] = set()  # silent, missed a step the deadline closed: not waited for until they push

    def check_room(self, worker: int, nbytes: int) -> None:
        """Raise a ``limit`` :class:`ServerError` if a push of ``nbytes`` from ``worker``
        would exceed its queue's bounds."""
        q = self._pending.get(worker)
        if not q:
            return
        if len(q) >= self.max_queued_pushes:
            raise ServerError(f"push refused: worker {worker} already has {len(q)} pushes waiting for their "
                              f"step, the server's limit (--max-queued-pushes {self.max_queued_pushes})",
                              ErrorCode.LIMIT)
        queued = sum(p.nbytes for p in q)
        if queued + nbytes > self.max_queued_push_bytes:
            raise ServerError(f"push refused: worker {worker} has {queued} bytes of pushes waiting for their step; "
                              f"{nbytes} more would exceed the server's limit "
                              f"(--max-queued-push-bytes {self.max_queued_push_bytes})", ErrorCode.LIMIT)

    def add(self, push: PendingPush) -> int:
        """Queue a push whose room :meth:`check_room` found (the step scheduler's
        :meth:`~stella_ps.steps.StepScheduler.room`, before the push was decoded);
        returns how many of this worker's pushes were already waiting."""
        q = self._pending.get(push.worker)
        if q is None:
            q = self._pending[push.worker] = deque()
        q.append(push)
        self._behind.discard(push.worker)
        return len(q) - 1

    def pending_count(self) -> int:
        return sum(len(q) for q in self._pending.values())

    def has_pending(self) -> bool:
        return bool(self._pending)  # no queue in it is empty

    def pending_workers(self) -> set[int]:
        """Workers with queued pushes (those of a worker that left included)."""
        return {w for w, q in self._pending.items() if q}

    def missing(self, live: Collection[int]) -> list[int]:
        """Live workers the open step still waits for (those behind excepted)."""
        return [w for w in live if not self._pending.get(w) and w not in self._behind]

    def has_pending_of(self, worker: int) -> bool:
        """Whether ``worker`` has a push waiting for its step."""
        return bool(self._pending.get(worker))

    def mark_behind(self, workers: Collection[int], live: Collection[int]) -> None:
        """``workers`` missed a step the deadline closed, and are silent: wait for none
        of them until its next push arrives. Workers no longer ``live`` are forgotten (the set
        stays bounded by the live workers in a job of many comings and goings)."""
        self._behind.intersection_update(live)
        self._behind.update(workers)

    def behind(self) -> list[int]:
        return sorted(self._behind)

    def should_close(self, live: Collection[int], started: bool) -> bool:
        """Does the open step close now: some push pending and every live worker's in
        (with no live worker left, whatever is pending closes)? (Asked on every push: the
        counts answer no in O(1) until enough workers are in; then it stops at the first
        worker missing.)"""
        if not started or not self.has_pending():
            return False
        pending, behind = self._pending, self._behind
        if len(pending) + len(behind) < len(live):  # each waited worker is in one of the two (they may hold others)
            return False
        return all(pending.get(w) or w in behind for w in live)

    def deadline(self, started: bool) -> float | None:
        """Seconds after the open step's first push at which it closes without the
        missing workers, or None to wait for all of them."""
        if not started:
            return None
        if self.step_deadline > 0:
            return self.step_deadline
        return self.adaptive.value() if self.adaptive is not None else None

    def current_deadline(self) -> float | None:
        """The deadline in force (for ``status``)."""
        return self.deadline(True)

    def take_step(self, version: int, ntensors: int, complete: bool = True) -> Step | None:
        """Remove the open step's pushes (the oldest pending push of each worker) and
        group them; ``version`` is the model's version before the step. ``complete``:
        every live worker's push is in (not closed by the deadline), so the step's
        arrival spread teaches the adaptive deadline."""
        now = self._clock()
        pushes = []
        for w in sorted(self._pending):
            q = self._pending[w]
            if q:
                pushes.append(q.popleft())
            if not q:
                del self._pending[w]
        if not pushes:
            return None
        try:
            return self._group(pushes, version, ntensors, complete, now)
        except Exception as e:  # the pushes are taken: the step closes empty without them (StepScheduler)
            raise StepFailed(f"step {version + 1} failed in the aggregation ({type(e).__name__}: {e}); its pushes "
                             "were dropped", [p.worker for p in pushes]) from e

    def _group(self, pushes: list[PendingPush], version: int, ntensors: int, complete: bool, now: float) -> Step:
        """The step of ``pushes`` (taken from their queues), closed at ``now``."""
        newcomer = any(p.worker not in self._pushed_before for p in pushes)
        self._pushed_before.update(p.worker for p in pushes)
        # a worker's first push comes after its start-up, not after a step: no sample
        if complete and not newcomer and self.adaptive is not None and len(pushes) > 1:
            opened = max(self._last_close, min(p.arrived for p in pushes))
            self.adaptive.observe(max(p.arrived for p in pushes) - opened)
        self._last_close = now
        samples, unit, weighted = weigh(pushes, self.max_sample_ratio)
        per_tensor: list[list[SparseTensor]] = [[] for _ in range(ntensors)]
        owners: list[list[int]] = [[] for _ in range(ntensors)]
        for p, tensors in zip(pushes, weighted):
            for s in tensors:
                per_tensor[s.tensor].append(s)
                owners[s.tensor].append(p.worker)
        return Step(
            per_tensor=per_tensor,
            scale=1.0 / len(pushes),
            contributors=[p.worker for p in pushes],
            late=sum(p.version < version - 1 for p in pushes),
            hparams=[p.hparams for p in pushes if p.hparams],
            owners=owners,
            samples=samples,
            unit=unit,
            codings={p.worker: p.coding for p in pushes},
        )


def push_norm(tensors: list[SparseTensor]) -> float:
    """The L2 norm of a push's values over all its tensors, accumulated in float64 (the
    values are finite, but float32 squares of 3e38 overflow): one C pass per tensor
    over the values as they travelled, no conversion, and no BLAS (whose threads would
    spin on the server's other cores)."""
    total = 0.0
    for s in tensors:
        v = s.values
        total += sum_of_squares(v if v.flags.c_contiguous else np.ascontiguousarray(v))
    return math.sqrt(total)


def scaled(tensors: list[SparseTensor], factor: float) -> list[SparseTensor]:
    """The push with every value multiplied by ``factor``, as float32 copies
    (the wire views are read-only and may be float16 or bf16)."""
    out = []
    for s in tensors:
        v = (to_float32(s.values).astype(np.float64) * factor).astype(np.float32)
        out.append(SparseTensor(s.tensor, s.indices, v))
    return out


def count_exponent_at(hparams: dict[str, Any], density: float) -> float:
    """The ``count_exponent`` a step whose pushes are ``density`` dense takes: the
    configured one up to ``count_taper_from``, none (the plain mean) from
    ``count_taper_to`` on, and in between the configured one times ``log(to / density) /
    log(to / from)`` (linear in log density). Both 0 (the default): the configured
    exponent at every density. ``outer="tapered"`` (the default over adaptive inner
    optimizers) tapers it from 2% to 10%: the count is the better rule at 1%, the mean at
    10%, the taper better than either between (docs/optimizer.md, "The outer step follows
    the density")."""
    p = float(hparams.get("count_exponent", 0.0))
    lo, hi = float(hparams.get("count_taper_from", 0.0)), float(hparams.get("count_taper_to", 0.0))
    if not p or not hi or density <= lo:
        return p
    if density >= hi:
        return 0.0
    return p * math.log(hi / density) / math.log(hi / lo)


def step_density(step: Step, sparse: Sequence[int]) -> float:
    """The mean density of ``step``'s pushes over the tensors whose numels ``sparse``
    maps (index: numel, 0 for a tensor sent whole): the values they carried there over
    the pushes times those tensors' coordinates (1 when there are none)."""
    numel = sum(sparse)
    pushes = len(step.contributors)
    if not numel or not pushes:
        return 1.0
    values = sum(p.values.size for n, parts in zip(sparse, step.per_tensor) if n for p in parts)
    return min(1.0, values / (pushes * numel))


def step_count_table(step: Step, hparams: dict[str, Any], sparse: Sequence[int]) -> np.ndarray | None:
    """:func:`count_table` for ``step`` at the exponent its density takes
    (:func:`count_exponent_at`); the store's apply and a checkpoint's roll-forward both
    make it so, from the same step."""
    return count_table(len(step.contributors), count_exponent_at(hparams, step_density(step, sparse)), step.scale)


def count_table(pushes: int, exponent: float, scale: float) -> np.ndarray | None:
    """Update mode's ``count_exponent`` (docs/optimizer.md "The outer step per
    coordinate") as the kernel's ``count_scale``: entry ``n`` is ``scale * (pushes / n)
    ** exponent`` (float64, rounded once to float32), the multiplier of a sum that ``n``
    of the step's ``pushes`` pushes carried, counted in the kernel's merge (entry 0 is
    never used). So a coordinate every push carried takes the mean's ``scale`` bit for
    bit, and one a single push carried ``pushes ** exponent`` times its share of the
    mean. None when nothing is scaled by count (no exponent, one push)."""
    if not exponent or pushes <= 1:
        return None
    n = np.arange(pushes + 1, dtype=np.float64)
    n[0] = pushes
    table = (scale * (pushes / n) ** exponent).astype(np.float32)
    table[0] = 0.0
    return table


FINAL_ALLOWANCE = 8.0  # a final push's relative bound, in the usual one's


class PushNormBound:
    """The bounds on one push's L2 norm (over all its values, float64):

    - ``absolute`` (``--max-push-norm``, 0: none): above it a push is refused
      (``action`` "refuse") or scaled down to it ("clip");
    - ``factor`` (``--push-norm-factor``, 0: none): above ``factor`` times the median
      norm of the last ``window`` pushes of the job (once ``min_samples`` are known) a
      push is scaled down to that bound. On by default: a push thousands of times the
      usual (a bug, or a hostile worker) moves the model by at most ``factor`` usual
      pushes, and the median follows honest changes of scale within a window. The
      norms recorded are those after clipping, so clipped pushes cannot raise the bound
      by themselves (a key with most of a job's workers can still move it: docs/security.md);
    - ``model_change`` (``--max-push-change``, 0: none): until that median is learnt (the
      job's first ``min_samples`` pushes, and again after every restart; for ever with
      ``factor`` 0), a push is
      scaled down so that the change it can make, ``gain`` (the optimizer's
      :meth:`~stella_ps.optim.OptimizerConfig.push_gain`) times its norm, is at most
      ``model_change`` times ``model_norm``, the L2 norm of the model (the server's range
      of it) as it was registered or resumed. So the first pushes of a job are bounded
      too, with the default flags. Without a gain (Adam, AdamW: a step is about ``lr``
      whatever the push) or a scale (a model of zeros) there is no such bound;
    - a worker's *final* push (``close()``: its whole error-feedback residual, which holds
      more than a round's top-k: 1.2-1.5x the relative bound in the Docker walk-through),
      once per registration, is allowed :data:`FINAL_ALLOWANCE` times the relative bound,
      within the bound relative to the model (applied to it whether or not the median is
      learnt) and the absolute one; its norm does not join the median.
    """

    def __init__(self, absolute: float = 0.0, action: str = "refuse", factor: float = 0.0, window: int = 64,
                 min_samples: int = 8, model_change: float = 0.0):
        self.absolute, self.action, self.factor = absolute, action, factor
        self.model_change = model_change
        self.min_samples = min_samples
        self._window = window
        self._norms: deque[float] = deque()  # the recent nonzero norms, oldest first
        self._sorted: list[float] = []  # the same, in order (the median without a sort a push)
        self.clipped = 0  # pushes scaled down (any bound)
        self._unscaled = False  # said once that a model of zeros gives no bound relative to it

    def relative_limit(self) -> float | None:
        """``factor`` times the median of the recent nonzero norms; None until learnt."""
        if not self.factor or len(self._sorted) < self.min_samples:
            return None
        xs = self._sorted
        return self.factor * xs[len(xs) // 2]

    def model_limit(self, model_norm: float, gain: float | None, always: bool = False) -> float | None:
        """The bound relative to the model, while the median is not learnt (``always``:
        learnt or not); None: none."""
        if not self.model_change or not gain or (self.relative_limit() is not None and not always):
            return None
        if model_norm <= 0:
            if not self._unscaled:
                self._unscaled = True
                log.warning("the model is all zeros: until the job's first pushes are known, only --max-push-norm "
                            "bounds a push (--max-push-change is relative to the model's norm)")
            return None
        return self.model_change * model_norm / gain

    def _record(self, norm: float) -> None:
        if len(self._norms) >= self._window:
            old = self._norms.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._norms.append(norm)
        bisect.insort(self._sorted, norm)

    @property
    def on(self) -> bool:
        """Whether any bound is set (a push's norm is needed)."""
        return bool(self.absolute or self.factor or self.model_change)

    def apply(self, worker: int, tensors: list[SparseTensor], sumsq: list[float] | None = None, *,
              model_norm: float = 0.0, gain: float | None = None,
              final: bool = False) -> tuple[list[SparseTensor], float]:
        """The push inside the bounds, and the factor kept (1.0: as it is): refused
        (:class:`~stella.errors.BadValue`) or scaled down (float32 copies; the server tells
        the worker the factor, and the worker's residual takes back what was scaled off).
        ``sumsq``: the sums of the squares of its tensors' values, as the decoder found them
        (:func:`stella.payload.decode_tensors`); None: computed here. ``model_norm`` and
        ``gain``: the model's norm and the optimizer's gain in force (``--max-push-change``).
        ``final``: a worker's final push (the class doc)."""
        if not self.on:
            return tensors, 1.0
        norm = push_norm(tensors) if sumsq is None else math.sqrt(sum(sumsq))  # push_norm's order: its bits
        if log.isEnabledFor(logging.DEBUG):
            log.debug("push norm", extra={"worker": worker, "norm": norm})
        limit, which = math.inf, ""
        if self.absolute and norm > self.absolute:
            if self.action == "refuse":
                raise BadValue(f"push refused: the L2 norm of its values, {norm:.6g}, is above the server's limit "
                               f"{self.absolute:g} (--max-push-norm)")
            limit, which = self.absolute, "--max-push-norm"
        relative = self.relative_limit()
        if relative is not None and final:
            relative *= FINAL_ALLOWANCE
        for bound, flag in ((relative, "--push-norm-factor"),
                            (self.model_limit(model_norm, gain, always=final), "--max-push-change")):
            if bound is not None and norm > bound and bound < limit:
                limit, which = bound, flag
        kept = 1.0
        if norm > limit:
            log.warning("push clipped", extra={"worker": worker, "norm": norm, "limit": which, "bound": limit,
                                               "final": final})
            self.clipped += 1
            kept = limit / norm
            tensors, norm = scaled(tensors, kept), limit
        if norm > 0 and not final:
            self._record(norm)
        return tensors, kept
