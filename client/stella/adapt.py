"""Per-worker adaptation of the exchange to the link and the computation.

Each :class:`~stella.StellaOptimizer` owns one :class:`Controller`. After every round
it is given what the round measured (:class:`RoundMeasure`: the computation, and the
push's and the pull's bytes and link time, all taken from the transfers themselves,
with no probe traffic) and picks the density and the value coding of the next push.
Its aim: the exchange hides behind the computation with a margin, ``fill`` (0.8) of a
round's compute.

The model. The uplink and downlink rates are taken from the last ``window`` (5)
rounds' bytes over link time: a push's time from send to acknowledgement, a pull's
from request to answer minus the time the server held it (``delta``'s ``held_ms``:
waiting for the step, encoding), so waiting for other workers is not mistaken for a
slow link. Of the window it takes the fastest: a busy server acknowledges late (and
answers late), which only ever makes a measurement slower than the link: on the test
bed at a steady 115 Mbit/s single rounds measured 30 to 110. The fastest of five
follows a rise at once and a fall in five rounds; against rounds that measure
uniformly 30-100% of the link it changes its choice about twice in 60 rounds, the
second fastest about six times, the median more (tests/test_adapt.py). A fall of
:data:`FALL` (3) times or more is followed in :data:`FALL_ROUNDS` (2): when that many
rounds in a row at one candidate each took more than three times what the window predicted,
the window keeps only them (a late acknowledgement is one round; a change of candidate is
the test of ``fixed`` below, not of the link; the test bed's links drop 2-10x at
once, and each drop cost up to five rounds of waiting: over simulated rounds on its
schedules, ``python -m bench.adapt_links``, the share of time waited 0.23 -> 0.10 with
exact rounds, 0.38 -> 0.25 with rounds measuring 30-100% of the link, and no more changes
on a steady one). A candidate
``(density, coding)`` would take ``compress + push' + server' + pull'``. Each of the
last three is ``fixed + per_unit * size``: the push's size is its bytes, scaled from
those measured at the current candidate by the coded size of a coordinate (value bits
plus Rice index bits, ``log2(1/density) + 2``); the pull's follow the density likewise,
in the broadcast's coding and at its factor's multiple of a push's coordinates (each
counted by its bits against f16's), both as the server's answer to the registration
said (:func:`pull_bits`); the server's is
the density (``server'`` is its time applying the round's step, the ``delta``'s
``step_ms``: decoding, applying and encoding grow with the coordinates every worker
pushes, and the workers of a job adapt alike). ``per_unit`` is the fastest of the
window's rounds once ``fixed`` is taken off. ``fixed`` is what a smaller push does not
save: a round trip, the work of handling a message, the broadcast's pass over the whole
residual (issue 21). No single size tells it apart, so it starts at 0 (a cost
proportional to the size) and is learnt from the changes of candidate: when the first
``window`` rounds after a change cost, at their fastest, more than 1.25 times what the
model predicted, or less than that much below, that change draws a line through the
fastest round on either side of it (the same link, measured at two sizes, a few rounds
apart), and ``fixed`` becomes the lesser intercept of the latest two such lines. Within
that band the prediction stands and ``fixed`` stays, so the noise of single rounds does
not teach it; and a link that changed its rate during a change fakes one line, rarely
two in a row. Waiting for other workers is in
none of these terms.

The choice. Candidates are ordered best first: densities from ``ceiling`` down to
``floor`` by factors of 1.25, and at each density the codings best first (f16, q4,
q2). Cheaper coding comes before lower density because it costs less convergence:
in the 2026-11-23 end-to-end run q4 and q2 pushes reached the byte LM's target in
the iterations f16 did, while lower densities delay what error feedback delivers
(docs/compression.md); for the same bytes up, q4 on 2% of the coordinates took the
byte LM at W = 8 to dense's loss in 1.106x its iterations where f16 on 1% took 1.182x
(bench.sim_update, five seeds; 1.115x and 1.157x through a real stella-ps:
bench/RESULTS.md). While the current candidate's prediction is within ``fill`` of
the compute, it stays, unless a better one predicts within ``raise_fill`` (0.6): the
band between the two, and ``window`` rounds at least between a change and a rise,
keep a steady link from oscillating. Above ``fill`` it moves to the best candidate
that fits, at once. When none fits, it moves to the best candidate within ``slack``
(a tenth) of the compute of the least any candidate predicts: on a link where a round
trip takes longer than the computation, a cheaper push would buy little time at a cost
in convergence, and the proportional model (``fixed`` 0) that took the cheapest there
learns after a try or two that it saves little. It rises back, after ``window``
rounds, to a better candidate within half that slack. While some candidate fits, a
push larger than the current one is predicted to cost at least in proportion to its
size (as if ``fixed`` were 0), so a ``fixed`` learnt wrongly on a link whose rate
moved during a change cannot make a large push look cheap (without this, one of three
runs on the test bed's fluctuating links rose to 5% and stalled a round 4 s). A pinned knob (a number for
the density, a coding for the values) leaves one candidate on its axis.

What a density costs the worker. A denser round also costs the worker work that no
overlap hides: installing the answer (a walk over the entries it pulled and pushed, on
the training thread) and compressing (on the device the model trains on). On a fast
link the candidates above all hide, and the link alone would take the ceiling, whatever
that work costs; on a GPU the install of a 10% answer can take longer than a step. And
density buys fewer iterations than its bytes suggest: by the sweeps of bench.sim_update
(bench/RESULTS.md) a decade more of it saves about ``DENSITY_VALUE * (1 - 1/W)`` of the
iterations to the target (the byte LM at W = 8: 1.29x dense at 1%, 1.15x at 10%, 0.99x
with every coordinate; adamlp 1.13x, 1.06x, 1.00x; one worker's model is its own, whose
pushes cost it nothing). So the controller keeps a cap on the density
(:func:`densest_worth`): the densest of the ladder whose predicted time to the target,
``(1 + a log10(ceiling / d)) (c + work(d))``, is within :data:`DENSITY_GAIN` of the
least (near its least the time is flat, and a lower density would cost iterations the
model is not sure to win back), ``c`` the round's own compute and ``work(d)`` the
install plus the compression, learnt per density from the rounds after the first
``window`` (which pay for allocations and start together), the least of each density's
latest ``window`` (other processes only ever add to a round's work: on a loaded host the
medians inflated the low densities' work until the line through two densities looked
flat and took the cap back to the ceiling for a window): two densities 2x apart or
more give a line through what each cost; before that the install is taken in
proportion to the entries a round installs (its push and its pull, the pull as
:func:`pull_bits` sizes it) and the compression as the same at every density, and the
cap moves at most a decade below what was measured. It moves at most once a ``window``
of rounds; no candidate above it is taken, and a current one above it moves down at
once. Until a density has three rounds measured the cap is the ceiling.

The first push. Before any round is measured nothing says what the link carries, and a
push at the ceiling over a slow link stalls the first round for many steps (a 9.7M-parameter
model's 10% in f16, 2.5 MB up and 1.6 MB down, waited 0.9-1.3 s at the test bed's 30-300
Mbit/s against a 0.07 s step: bench.adaptive, 2026-12-05), and the first step's compute is not
known either (the first push follows the first step). So the first push
(:meth:`Controller.first`) is the cheapest candidate, and the first measured round may already
rise to what the link has room for (a small push's latency makes the link look slower than it
is, so that rise errs low; the rounds after it rise further as above). That is update mode's
first push (its worker keeps what it did not send in its own model); in gradient mode the
server's optimizer steps on the pushed gradient itself, and a few rounds of 0.1% pushes there
cost more iterations than a first round's stall (examples/amp_compile.py's gradient run, a
compiled byte model on loopback: held-out 3.27-3.66 after 60 steps starting at the cheapest,
2.77-2.84 at the ceiling, 2026-12-05), so its first push is the ceiling's (the pipeline's
``Rounds.adapt``).

What no candidate hides, the pipeline absorbs: a worker whose exchange is still in
flight at the end of a round keeps computing (update mode: more local steps, up to
``max_sync_every``; gradient mode, when ``max_accumulate`` turns it on: more
micro-batches accumulated) and the server weights each push by the samples it carries. That
is also what makes workers of different speeds take rounds of the same wall time.

The least local steps a round makes (update mode, ``Sync(every="auto")``). A round also
costs the worker work that does not hide: on the training thread, installing the previous
round's answer and starting the next (the residual loaded, the push handed over), and
the compression, which runs on the device the model trains on (its cores, or its
stream). Per step that is ``O / H`` for a round's cost ``O``, so a model whose step is
short against its round (a GPU's step, a large model with a small batch) spends most of
its time there at H = 1. More local steps amortise it but cost iterations: by the
sweeps of bench.sim_update (bench/RESULTS.md) a local step more costs about
``LOCAL_STEP_COST * (1 - 1/W)`` more iterations to the target (nothing with one worker,
whose model is the job's). :func:`local_steps` takes the H in the allowed range that
minimises the time to the target, ``(1 + a (H - 1)) (c + O / H)``, from the medians of
the recent steps' own compute ``c`` and rounds' cost ``O``, and moves only for a
predicted gain of :data:`LOCAL_STEPS_GAIN`.
"""
from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .codec import CODINGS, VALUE_BITS, broadcast_bits, coordinate_bits
from .protocol import BroadcastInfo, ValueDtype

__all__ = ["Controller", "RoundMeasure", "Decision", "densities", "pull_bits", "local_steps", "densest_worth"]

log = logging.getLogger("stella.adapt")

STEP = 1.25  # between two densities of the ladder


def pull_bits(density: float, broadcast: BroadcastInfo | None, coding: str = "f16") -> float:
    """Bits per model coordinate of a pull answering pushes of ``density`` in ``coding``:
    the server's broadcast (its factor times the pushes' coordinates, each counted by its
    bits against f16's, :func:`~stella.codec.broadcast_share`; in the broadcast's coding),
    or with exact pulls (None) the pushed coordinates in float32 (their union over the
    workers grows with their number; the controller's measured bytes per bit carries that)."""
    if broadcast is None:
        return density * coordinate_bits(density, "f32")
    return broadcast_bits(density, broadcast.factor, broadcast.values, coding)


def densities(floor: float, ceiling: float) -> list[float]:
    """The ladder from ``ceiling`` down to ``floor`` by factors of :data:`STEP`."""
    out = [ceiling]
    while out[-1] / STEP > floor * (1 + 1e-9):
        out.append(out[-1] / STEP)
    if out[-1] != floor:
        out.append(floor)
    return out


# The iterations a local step more costs at W workers, LOCAL_STEP_COST * (1 - 1/W) of them: from bench.sim_update's
# sweeps (bench/RESULTS.md): the byte LM at W = 2 needed 1.3-1.5x dense's iterations at H = 8 (0.04-0.07 a step),
# at W = 8 2.38x against 1.53x at H = 1 (0.08 a step); adamlp at W = 8 0.07 a step at H = 8 and 0.2 at H = 4
LOCAL_STEP_COST = 0.12
LOCAL_STEPS_GAIN = 0.05  # the least predicted saving of time to the target that changes H


def local_steps(compute_s: float, round_s: float, workers: int, least: int, most: int, current: int) -> int:
    """The least local steps of the next rounds (``Sync(every="auto")``, module doc): the H
    in ``[least, most]`` minimising ``(1 + a (H - 1)) (compute_s + round_s / H)`` with
    ``a = LOCAL_STEP_COST * (1 - 1 / workers)``, or ``current`` when that saves less than
    :data:`LOCAL_STEPS_GAIN` of its predicted time."""
    a = LOCAL_STEP_COST * (1.0 - 1.0 / max(1, workers))
    c, o = max(0.0, compute_s), max(0.0, round_s)

    def time_to_target(h: int) -> float:
        return (1.0 + a * (h - 1)) * (c + o / h)

    current = min(most, max(least, current))
    best = min(range(least, most + 1), key=time_to_target)
    if time_to_target(best) > (1.0 - LOCAL_STEPS_GAIN) * time_to_target(current):
        return current
    return best


# The iterations to the target a decade more density saves at W workers, DENSITY_VALUE * (1 - 1/W) of them: from
# bench.sim_update's sweeps (bench/RESULTS.md, BatchNoise on): the byte LM at W = 8 1.29x dense's iterations at 1%,
# 1.15x at 10% (0.14 a decade), 0.99x at 100%; adamlp at W = 8 1.13x, 1.06x, 1.00x (0.07); widemlp about none
DENSITY_VALUE = 0.12
DENSITY_GAIN = 0.05  # the cap: the densest density predicted within this of the least time to the target


def densest_worth(ladder: Sequence[float], compute_s: float, work_s: Callable[[float], float], workers: int) -> int:
    """The index in ``ladder`` (densest first) of the density worth the worker's own work a
    round (module doc): the densest whose predicted time to the target,
    ``(1 + a log10(ladder[0] / d)) (compute_s + work_s(d))`` with ``a = DENSITY_VALUE (1 - 1/workers)``,
    is within :data:`DENSITY_GAIN` of the least (the time is flat near its least: a lower
    density there would cost iterations the model is not sure to win back)."""
    a = DENSITY_VALUE * (1.0 - 1.0 / max(1, workers))
    top, c = ladder[0], max(0.0, compute_s)
    times = [(1.0 + a * math.log10(top / d)) * (c + max(0.0, work_s(d))) for d in ladder]
    least = min(times)
    return next(i for i, t in enumerate(times) if t <= (1.0 + DENSITY_GAIN) * least)


class _Work:
    """The worker's own work a round (the install and the compression) as a function of
    the density (module doc). Each density the rounds ran at keeps its latest ``window``
    rounds (after the first ``window`` of the run: they pay for allocations); one
    with three is a point, the least install and the least compression of them: the work
    at one density is the same each round, and what varies is what other threads and
    processes add to its wall time (a round's work only ever measures longer than it is,
    as a busy server only ever makes a link look slower). Two points whose
    densities differ by 2x or more: a least-squares line through the points' totals, rising
    with the density or flat. Else, from the latest point: the install in proportion to the
    entries a round installs (its push and its pull), the compression the same at every
    density."""

    LEAST = 3  # rounds at a density that make it a point

    def __init__(self, window: int):
        self.window = window
        self._at: dict[float, deque[tuple[float, float]]] = {}  # density -> (install, compression) seconds
        self._latest = 0.0
        self._rounds = 0
        # the points and, through two of them 2x apart, the line (mean density, mean seconds, slope), worked out
        # once per round measured: the controller predicts every density of its ladder from them
        self._fit: tuple[dict[float, tuple[float, float]], tuple[float, float, float] | None] | None = None

    def add(self, d: float, install_s: float, compress_s: float) -> None:
        self._rounds += 1
        if self._rounds > self.window:
            self._at.setdefault(d, deque(maxlen=self.window)).append((install_s, compress_s))
            self._latest = d
            self._fit = None

    def _model(self) -> tuple[dict[float, tuple[float, float]], tuple[float, float, float] | None]:
        if self._fit is None:
            points = {d: (min(i for i, _ in q), min(c for _, c in q))
                      for d, q in self._at.items() if len(q) >= self.LEAST}
            line = None
            if len(points) >= 2 and max(points) >= 2.0 * min(points):
                xs, ys = list(points), [i + c for i, c in points.values()]
                slope = max(0.0, statistics.linear_regression(xs, ys).slope)
                line = (statistics.fmean(xs), statistics.fmean(ys), slope)
            self._fit = points, line
        return self._fit

    @property
    def measured(self) -> bool:
        return bool(self._model()[0])

    @staticmethod
    def units(d: float, broadcast: BroadcastInfo | None, workers: int) -> float:
        """A round's installed entries at density ``d``, per model coordinate: its push and
        the pull's (the broadcast's factor times a push's, or the union of the workers' pushes)."""
        pull = min(1.0, broadcast.factor * d) if broadcast is not None else min(1.0, max(1, workers) * d)
        return d + pull

    def _latest_point(self, points: dict[float, tuple[float, float]]) -> float:
        return self._latest if self._latest in points else next(iter(points))

    def lowest(self) -> float:
        """The least density the model predicts from what it measured: the line's every
        one, a decade below the latest point without (a step, not a leap, on a guess)."""
        points, line = self._model()
        if line is not None or not points:
            return 0.0
        return self._latest_point(points) / 10.0

    def predict(self, d: float, broadcast: BroadcastInfo | None, workers: int) -> float:
        points, line = self._model()
        if not points:
            return 0.0
        if line is not None:
            mean_d, mean_s, slope = line
            return max(0.0, mean_s + slope * (d - mean_d))
        d0 = self._latest_point(points)
        install, compress = points[d0]
        return compress + install * self.units(d, broadcast, workers) / self.units(d0, broadcast, workers)


SURPRISE = 1.25  # a change of candidate whose cost differs more than this from the prediction teaches ``fixed``
# a fall: this many rounds in a row at one candidate, each slower than FALL times what the window predicted, and the
# window keeps only them (on a steady link single rounds measure 30-110% of its rate; the test bed's drops are 2-10x)
FALL, FALL_ROUNDS = 3.0, 2


class _Cost:
    """One term of a round's cost, ``fixed + per_unit * size`` (the size: bytes, or the
    density), learnt from the rounds as the module doc describes. ``per_unit``: from the
    fastest of the latest ``window`` rounds. ``fixed``: 0 until two changes of candidate
    turned out to cost, over their first ``window`` rounds, more than :data:`SURPRISE`
    times what the model predicted, or less than that much below; then the lesser
    intercept of the two lines through the fastest round on either side of each change
    (the same link, two sizes). It is never taken above a recent round."""

    def __init__(self, window: int):
        self.recent: deque[tuple[int, float, float]] = deque(maxlen=window)  # (candidate, size, seconds)
        self._fixed = 0.0
        self._slow = 0  # the latest rounds in a row that took FALL times their prediction or more
        self._lines: deque[float] = deque(maxlen=2)  # the intercepts of the latest two surprises
        self._before: tuple[float, float] | None = None  # the fastest round before the latest change
        self._after: list[tuple[float, float]] = []  # the rounds since, until a window is full
        # (fixed, per unit, the fastest round's seconds per unit) of the window as it stands: the
        # controller predicts every candidate from them each round (None: not worked out since add())
        self._parts: tuple[float, float, float] | None = None

    @property
    def measured(self) -> bool:
        return bool(self.recent)

    @property
    def rate(self) -> float:
        """Size per second of the fastest recent round (0: none measured)."""
        return max((x / t for _, x, t in self.recent if t > 0.0), default=0.0)

    def add(self, candidate: int, size: float, seconds: float) -> None:
        # at the candidate of the round before only: a change of candidate is the fixed part's test (a smaller push
        # over a link whose round trip dominates takes far more than its share), not the link's
        if self.recent and self.recent[-1][0] == candidate and seconds > FALL * self.predict(size):
            self._slow += 1
        else:
            self._slow = 0
        self._parts = None
        if self.recent and self.recent[-1][0] != candidate:
            old = self.recent[-1][0]
            self._before = min(((x, t) for c, x, t in self.recent if c == old), key=lambda xt: xt[1])
            self._after = []
        self.recent.append((candidate, size, seconds))
        if self._slow >= FALL_ROUNDS:  # the link fell: what it carried before no longer says what it carries
            while len(self.recent) > FALL_ROUNDS:
                self.recent.popleft()
            self._before = None  # nor does a change of candidate across the fall teach ``fixed``
        if self._before is None:
            return
        self._after.append((size, seconds))
        if len(self._after) < (self.recent.maxlen or 1):
            return
        (x1, t1), (x2, t2) = self._before, min(self._after, key=lambda xt: xt[1])
        self._before = None
        if x1 <= 0.0 or x2 <= 0.0 or abs(x1 - x2) <= 1e-6 * max(x1, x2):
            return
        fixed = min(self._fixed, t1)
        predicted = fixed + (t1 - fixed) * x2 / x1
        if predicted > 0.0 and not predicted / SURPRISE <= t2 <= predicted * SURPRISE:
            # the lesser of this line's intercept and the previous surprise's: a link that changed
            # its rate during the change fakes one, rarely two in a row
            self._lines.append(max(0.0, (t2 * x1 - t1 * x2) / (x1 - x2)))
            self._fixed = min(self._lines) if len(self._lines) == 2 else 0.0

    def _model(self) -> tuple[float, float, float]:
        if self._parts is None:
            if not self.recent:
                self._parts = (0.0, 0.0, 0.0)
            else:
                fixed = min(self._fixed, min(t for _, _, t in self.recent))
                self._parts = (fixed, min(((t - fixed) / x for _, x, t in self.recent if x > 0.0), default=0.0),
                               min((t / x for _, x, t in self.recent if x > 0.0), default=0.0))
        return self._parts

    def parts(self) -> tuple[float, float]:
        """``(fixed seconds, seconds per unit of size)``."""
        fixed, per_unit, _ = self._model()
        return fixed, per_unit

    def predict(self, size: float, cautious: bool = False) -> float:
        """``cautious``: at least the fastest recent round's time per unit of size (the
        proportional model), which only ever raises a larger size's prediction."""
        fixed, per_unit, proportional = self._model()
        secs = fixed + per_unit * size
        return max(secs, size * proportional) if cautious else secs


@dataclass(frozen=True)
class RoundMeasure:
    """What one finished round measured (seconds, bytes)."""

    compute_s: float  # the computation a round offers to hide the exchange behind
    compress_s: float
    push_bytes: int
    push_s: float  # send to acknowledgement
    pull_bytes: int
    pull_s: float  # request to answer, minus the time the server held it (<= 0: not measured)
    server_s: float = 0.0  # the server's time applying the round's step
    # the worker's own work (module doc, "What a density costs the worker"): installing the round's answer, the
    # round's compute without that work, and the job's workers
    install_s: float = 0.0
    own_compute_s: float = 0.0  # the least of the recent steps' (times the round's H); 0: not measured
    workers: int = 1


@dataclass(frozen=True)
class Decision:
    density: float
    value_dtype: ValueDtype
    predicted_s: float  # the exchange the model predicts for it (0 before any measurement)
    reason: str


class Controller:
    """Picks each push's density and coding from the measured rates (module doc).

    ``density``: a number pins it; None: adaptive between ``floor`` and ``ceiling``.
    ``codings``: the value codings allowed, best first (one: pinned).
    """

    def __init__(self, *, density: float | None, floor: float, ceiling: float,
                 codings: Sequence[ValueDtype] = CODINGS, fill: float = 0.8,
                 raise_fill: float = 0.6, slack: float = 0.1, window: int = 5):
        if not codings or any(c not in VALUE_BITS for c in codings):
            raise ValueError(f"codings must be a non-empty subset of {tuple(VALUE_BITS)}, got {codings!r}")
        if not 0.0 < raise_fill < fill <= 1.0 or not 0.0 < slack <= 1.0 or window < 1:
            raise ValueError("need 0 < raise_fill < fill <= 1, 0 < slack <= 1 and window >= 1")
        ladder = [density] if density is not None else densities(floor, ceiling)
        self.candidates: list[tuple[float, ValueDtype]] = [(d, c) for d in ladder for c in codings]
        self.ladder = ladder
        self.cap = 0  # the densest density of the ladder worth the worker's work a round (densest_worth)
        self._work = _Work(window)
        self._workers = 1
        self.fill, self.raise_fill = fill, raise_fill
        self.slack = slack
        # start at the best candidate: a link too slow for it shows in the first round
        self.current = 0
        self._up = _Cost(window)  # push bytes -> seconds
        self._down = _Cost(window)  # pull bytes -> seconds
        self._server = _Cost(window)  # density -> the server's step, seconds
        self._compute: deque[float] = deque(maxlen=window)
        self._compress: deque[float] = deque(maxlen=window)
        self._compress_s = 0.0  # their median, for every candidate's prediction
        self._bytes_per_bit = 0.0  # push bytes per coded bit, at the latest candidate measured
        self._pull_per_bit = 0.0  # the latest pull's bytes per coded bit (pull_bits)
        # the server's broadcast, from its answer to the registration (None: exact pulls)
        self.broadcast: BroadcastInfo | None = None
        self.decisions = 0  # changes made
        self.window = window
        self._since_change = 0  # rounds observed since the latest change
        self._since_cap = window  # rounds observed since the cap moved (it may move once it has a measurement)

    @property
    def pinned(self) -> bool:
        return len(self.candidates) == 1

    @property
    def density(self) -> float:
        return self.candidates[self.current][0]

    @property
    def value_dtype(self) -> ValueDtype:
        return self.candidates[self.current][1]

    @property
    def max_density(self) -> float:
        """The densest push worth the worker's own work a round (module doc)."""
        return self.ladder[self.cap]

    def worker_work_s(self, density: float) -> float:
        """The worker's own work a round at ``density``, as the model predicts it (0: not measured)."""
        return self._work.predict(density, self.broadcast, self._workers) if self._work.measured else 0.0

    @property
    def fixed_s(self) -> float:
        """The part of a round's exchange that no cheaper push saves (the model's; 0 until
        two changes of candidate taught it, module doc)."""
        return sum(cost.parts()[0] for cost in (self._up, self._down, self._server))

    @property
    def up_bps(self) -> float:
        """The uplink's rate, bytes/s: the fastest push of the window (0: not measured yet)."""
        return self._up.rate

    @property
    def down_bps(self) -> float:
        return self._down.rate

    def predict(self, i: int, cautious: bool = False) -> float:
        """The exchange time the model predicts for candidate ``i`` (0 with no measurement);
        ``cautious``: a larger push than the current one costs at least proportionally more."""
        if not self._up.measured:
            return 0.0
        d, c = self.candidates[i]
        push = self._up.predict(self._bytes_per_bit * d * coordinate_bits(d, c), cautious)
        pull = self._down.predict(self._pull_per_bit * pull_bits(d, self.broadcast, c), cautious)
        return self._compress_s + push + self._server.predict(d, cautious) + pull

    def first(self) -> Decision:
        """The first push's candidate, before any round is measured (module doc): the
        cheapest, and the first measured round may already rise. No change once a round
        was measured, or pinned."""
        if self.pinned or self._up.measured:
            return Decision(self.density, self.value_dtype, self.predict(self.current), "unchanged")
        self.current = len(self.candidates) - 1
        self._since_change = self.window  # from the first measurement a better candidate may be taken
        return Decision(self.density, self.value_dtype, 0.0, "nothing measured yet: the cheapest push")

    def observe(self, m: RoundMeasure) -> Decision:
        """Learn from one round, measured at the current candidate; returns the next push's."""
        self._compute.append(m.compute_s)
        self._compress.append(m.compress_s)
        self._compress_s = statistics.median(self._compress)
        self._since_change += 1
        i, (d, c) = self.current, self.candidates[self.current]
        if m.push_bytes > 0 and m.push_s > 0.0:
            self._up.add(i, m.push_bytes, m.push_s)
            self._bytes_per_bit = m.push_bytes / (d * coordinate_bits(d, c))
        self._server.add(i, d, m.server_s)
        if m.pull_s > 0.0 and m.pull_bytes > 0:
            self._down.add(i, m.pull_bytes, m.pull_s)
            self._pull_per_bit = m.pull_bytes / pull_bits(d, self.broadcast, c)
        self._workers = max(1, m.workers)
        self._work.add(d, m.install_s, m.compress_s)
        cap_moved = self._move_cap(m)
        if self.pinned or not self._up.measured:
            return Decision(self.density, self.value_dtype, self.predict(self.current), "pinned" if self.pinned
                            else "no measurement yet")
        budget = statistics.median(self._compute)
        # while some push hides, a larger one is predicted cautiously (``fixed`` learnt on a link
        # whose rate moved could make it look cheap); when none does, ``fixed`` is most of every
        # round, and the larger push costs what the model says
        # a candidate denser than the cap is never taken (its prediction: infinite)
        worth = [d_j <= self.max_density * (1 + 1e-9) for d_j, _ in self.candidates]
        predicted = [self.predict(j, cautious=True) if worth[j] else math.inf for j in range(len(self.candidates))]
        fits = any(p <= self.fill * budget for p in predicted)
        if not fits:
            predicted = [self.predict(j) if worth[j] else math.inf for j in range(len(self.candidates))]
        now = predicted[i]
        best = i
        # what a round can reach: within the margin of the compute if any candidate fits; else the
        # least any candidate predicts, give or take ``slack`` of the compute (the pipeline absorbs
        # the rest: a cheaper push would cost convergence to save little time)
        reach = self.fill * budget if fits else min(predicted) + self.slack * budget
        if now > reach:  # too slow, or above the cap: the best candidate that reaches, at once
            best = next(j for j, p in enumerate(predicted) if p <= reach)
            why = ("the worker's own work a round (install, compression) costs more than the density saves"
                   if not worth[i] else "the exchange would not hide behind the computation" if fits else
                   "no push hides behind the computation: the best that saves nearly all a cheaper one would")
        elif self._since_change >= self.window or cap_moved:  # reaches: a better one only with room to spare
            room = self.raise_fill * budget if fits else min(predicted) + self.slack * budget / 2
            best = next(j for j, p in enumerate(predicted[:i + 1]) if p <= room or j == i)
            why = "the link has room for more" if fits else "a cheaper push saves little time"
        if best != self.current:
            old = self.candidates[self.current]
            self.current = best
            self._since_change = 0
            self.decisions += 1
            log.info("stella adapt: density %.3g%% %s -> %.3g%% %s (%s: predicted %.3f s against %.3f s of "
                     "compute; up %.1f Mbit/s, down %.1f Mbit/s, fixed %.1f ms a round)", 100 * old[0], old[1],
                     100 * self.density, self.value_dtype, why, predicted[best], budget, 8e-6 * self.up_bps,
                     8e-6 * self.down_bps, 1e3 * self.fixed_s)
            return Decision(self.density, self.value_dtype, predicted[best], why)
        return Decision(self.density, self.value_dtype, now, "unchanged")

    def _move_cap(self, m: RoundMeasure) -> bool:
        """Set :attr:`cap` from the round's own compute and the worker's work a round
        (:func:`densest_worth`); whether it moved."""
        self._since_cap += 1
        if len(self.ladder) == 1 or not self._work.measured or m.own_compute_s <= 0.0 \
                or self._since_cap < self.window:
            return False
        # without a line through two densities, no further than the model's guess reaches
        lowest = self._work.lowest() * (1 - 1e-9)
        ladder = [d for d in self.ladder if d >= lowest] or self.ladder[:1]
        cap = densest_worth(ladder, m.own_compute_s, self.worker_work_s, self._workers)
        if cap == self.cap:
            return False
        log.info("stella adapt: the densest push worth its work %.3g%% -> %.3g%% (predicted work a round %.2f ms "
                 "against %.2f ms there, %.2f ms of compute, %d workers)", 100 * self.ladder[self.cap],
                 100 * self.ladder[cap], 1e3 * self.worker_work_s(self.ladder[cap]),
                 1e3 * self.worker_work_s(self.ladder[self.cap]), 1e3 * m.own_compute_s, self._workers)
        self.cap, self._since_cap = cap, 0
        return True
