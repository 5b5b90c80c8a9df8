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
second fastest about six times, the median more (tests/test_adapt.py). A candidate
``(density, coding)`` would take
``compress + push_bytes' / up + server' + pull_bytes' / down``, where
``push_bytes'`` scales the bytes measured at the current candidate by the coded size
of a coordinate (value bits plus Rice index bits, ``log2(1/density) + 2``), and the
pull's follow the density likewise, in the broadcast's q4 (it sends a multiple of a
push's coordinates). ``server'`` is the server's time applying the round's step (the
``delta``'s ``step_ms``), taken as proportional to the density: decoding, applying and
encoding grow with the coordinates every worker pushes, and the workers of a job adapt
alike (the broadcast's pass over the whole residual does not shrink: issue 21).
Waiting for other workers is in none of these terms.

The choice. Candidates are ordered best first: densities from ``ceiling`` down to
``floor`` by factors of 1.25, and at each density the codings best first (f16, q4,
q2). Cheaper coding comes before lower density because it costs less convergence:
in the 2026-11-23 end-to-end run q4 and q2 pushes reached the byte LM's target in
the iterations f16 did, while lower densities delay what error feedback delivers
(docs/compression.md). While the current candidate's prediction is within ``fill`` of
the compute, it stays, unless a better one predicts within ``raise_fill`` (0.6): the
band between the two, and ``window`` rounds at least between a change and a rise,
keep a steady link from oscillating. Above ``fill`` it moves to the best candidate
that fits, or to the cheapest one, at once. A pinned knob (a number
for the density, a coding for the values) leaves one candidate on its axis.

What no candidate hides, the pipeline absorbs: a worker whose exchange is still in
flight at the end of a round keeps computing (update mode: more local steps, up to
``max_sync_every``; gradient mode, when ``max_accumulate`` turns it on: more
micro-batches accumulated) and the server weights each push by the samples it carries. That
is also what makes workers of different speeds take rounds of the same wall time.
"""
from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from .protocol import ValueDtype

__all__ = ["Controller", "RoundMeasure", "Decision", "CODINGS", "VALUE_BITS", "coordinate_bits", "densities"]

log = logging.getLogger("stella.adapt")

CODINGS: tuple[ValueDtype, ...] = ("f16", "q4", "q2")  # the controller's codings, best first
VALUE_BITS: dict[str, float] = {"f32": 32.0, "f16": 16.0, "bf16": 16.0, "q4": 4.5, "q2": 2.5}
STEP = 1.25  # between two densities of the ladder
PULL_CODING = "q4"  # the broadcast's default coding (stella-ps --broadcast-values): the pull's bits per coordinate


def coordinate_bits(density: float, coding: str) -> float:
    """Bits a pushed coordinate costs: its value, and its Rice-coded index (gaps of
    mean ``1/density``: about ``log2(1/density) + 2`` bits)."""
    return VALUE_BITS[coding] + math.log2(1.0 / density) + 2.0


def densities(floor: float, ceiling: float) -> list[float]:
    """The ladder from ``ceiling`` down to ``floor`` by factors of :data:`STEP`."""
    out = [ceiling]
    while out[-1] / STEP > floor * (1 + 1e-9):
        out.append(out[-1] / STEP)
    if out[-1] != floor:
        out.append(floor)
    return out


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
                 codings: Sequence[ValueDtype] = CODINGS, fill: float = 0.8, raise_fill: float = 0.6,
                 window: int = 5):
        if not codings or any(c not in VALUE_BITS for c in codings):
            raise ValueError(f"codings must be a non-empty subset of {tuple(VALUE_BITS)}, got {codings!r}")
        if not 0.0 < raise_fill < fill <= 1.0 or window < 1:
            raise ValueError("need 0 < raise_fill < fill <= 1 and window >= 1")
        ladder = [density] if density is not None else densities(floor, ceiling)
        self.candidates: list[tuple[float, ValueDtype]] = [(d, c) for d in ladder for c in codings]
        self.fill, self.raise_fill = fill, raise_fill
        # start at the best candidate: a link too slow for it shows in the first round
        self.current = 0
        self._up: deque[float] = deque(maxlen=window)  # rates measured, bytes/s
        self._down: deque[float] = deque(maxlen=window)
        self._compute: deque[float] = deque(maxlen=window)
        self._compress: deque[float] = deque(maxlen=window)
        self._bytes_per_bit = 0.0  # push bytes per coded bit, at the latest candidate measured
        self._pull_per_bit = 0.0  # the latest pull's bytes per coded bit of a pushed coordinate
        self._server: deque[float] = deque(maxlen=window)  # the server's step per unit of density
        self.decisions = 0  # changes made
        self.window = window
        self._since_change = 0  # rounds observed since the latest change

    @property
    def pinned(self) -> bool:
        return len(self.candidates) == 1

    @property
    def density(self) -> float:
        return self.candidates[self.current][0]

    @property
    def value_dtype(self) -> ValueDtype:
        return self.candidates[self.current][1]

    @staticmethod
    def _rate(xs: deque[float]) -> float:
        """The fastest of the window (module doc: delays only ever slow a measurement)."""
        return max(xs) if xs else 0.0

    @property
    def up_bps(self) -> float:
        """The uplink's rate, bytes/s (0: not measured yet)."""
        return self._rate(self._up)

    @property
    def down_bps(self) -> float:
        return self._rate(self._down)

    def predict(self, i: int) -> float:
        """The exchange time the model predicts for candidate ``i`` (0 with no measurement)."""
        up, down = self.up_bps, self.down_bps
        if up <= 0.0:
            return 0.0
        d, c = self.candidates[i]
        push = self._bytes_per_bit * d * coordinate_bits(d, c) / up
        pull = self._pull_per_bit * d * coordinate_bits(d, PULL_CODING) / down if down > 0.0 else 0.0
        server = statistics.median(self._server) * d if self._server else 0.0
        return statistics.median(self._compress) + push + server + pull

    def observe(self, m: RoundMeasure) -> Decision:
        """Learn from one round, measured at the current candidate; returns the next push's."""
        self._compute.append(m.compute_s)
        self._compress.append(m.compress_s)
        self._since_change += 1
        d, c = self.candidates[self.current]
        if m.push_bytes > 0 and m.push_s > 0.0:
            self._up.append(m.push_bytes / m.push_s)
            self._bytes_per_bit = m.push_bytes / (d * coordinate_bits(d, c))
        self._server.append(m.server_s / d)
        if m.pull_s > 0.0 and m.pull_bytes > 0:
            self._down.append(m.pull_bytes / m.pull_s)
            self._pull_per_bit = m.pull_bytes / (d * coordinate_bits(d, PULL_CODING))
        if self.pinned or self.up_bps <= 0.0:
            return Decision(self.density, self.value_dtype, self.predict(self.current), "pinned" if self.pinned
                            else "no measurement yet")
        budget = statistics.median(self._compute)
        now = self.predict(self.current)
        best = self.current
        if now > self.fill * budget:  # too slow: the best candidate that fits, else the cheapest
            fits = [i for i in range(len(self.candidates)) if self.predict(i) <= self.fill * budget]
            best = fits[0] if fits else len(self.candidates) - 1
            why = "the exchange would not hide behind the computation"
        elif self._since_change >= self.window:  # fits: a better candidate only with room to spare
            better = [i for i in range(self.current) if self.predict(i) <= self.raise_fill * budget]
            if better:
                best = better[0]
            why = "the link has room for more"
        if best != self.current:
            old = self.candidates[self.current]
            self.current = best
            self._since_change = 0
            self.decisions += 1
            log.info("stella adapt: density %.3g%% %s -> %.3g%% %s (%s: predicted %.3f s against %.3f s of "
                     "compute; up %.1f Mbit/s, down %.1f Mbit/s)", 100 * old[0], old[1], 100 * self.density,
                     self.value_dtype, why, self.predict(best), budget, 8e-6 * self.up_bps, 8e-6 * self.down_bps)
            return Decision(self.density, self.value_dtype, self.predict(best), why)
        return Decision(self.density, self.value_dtype, now, "unchanged")
