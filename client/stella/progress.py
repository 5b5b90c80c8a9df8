"""Where a worker's time goes, measured between ``step()`` calls: the report its pushes
carry to the server (:class:`~stella.protocol.WorkerReport`, shown by ``stella status``
and the metrics) and, every ``every`` steps, a one-line summary::

    stella step 200 | 0.034 s/it | wait 2% | density 5.00% q4 | H 1 | batch x1 | up 96 down 240 Mbit/s | ...

logged to the ``stella.progress`` logger at INFO. Library code installs no handler:
the demo (and any training script that wants the lines) configures one, e.g.
:func:`log_to_stderr`. ``StellaOptimizer(progress_every=N)`` turns the line on;
the report is sent in any case (a few dozen bytes per push).

Computation is the time between two ``step()`` calls minus what ``step()`` spent
waiting for an exchange in between; exchange is the background thread's compress +
push + step + pull of the latest finished exchange. In update mode (an exchange every
``sync_every`` steps) the waits and exchanges land on the steps that start a round.
"""
from __future__ import annotations

import logging
import sys
import time
from typing import Any

from .protocol import WorkerReport

__all__ = ["Progress", "log_to_stderr", "LOGGER"]

LOGGER = "stella.progress"
log = logging.getLogger(LOGGER)


def log_to_stderr() -> None:
    """Show the progress lines on stderr (for applications: the demo, the worker image)."""
    if not any(getattr(h, "_stella_progress", False) for h in log.handlers):
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(message)s"))
        h._stella_progress = True  # type: ignore[attr-defined]
        log.addHandler(h)
    log.setLevel(logging.INFO)


def _fraction(x: float) -> float:
    """A density as the report's bounds take it, in [0, 1]."""
    return min(1.0, max(0.0, float(x)))


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


class Progress:
    """Fed once per ``step()`` (:meth:`on_step`, on the training thread); its latest
    :meth:`report` is read by the exchange thread when it pushes (one attribute read of
    a frozen message, so no lock)."""

    def __init__(self, every: int = 0):
        if every < 0:
            raise ValueError("progress_every must be >= 0 (0: no progress lines)")
        self.every = every
        self._report: WorkerReport | None = None
        self._last_end: float | None = None
        self._last_wait = 0.0
        self._last_exchange = 0.0
        # the window of the next progress line
        self._line_t: float | None = None
        self._line_step = 0
        self._line_wait = 0.0

    def report(self) -> WorkerReport | None:
        return self._report

    def on_step(self, stats: Any, client: Any) -> WorkerReport | None:
        """Once per ``step()``, before it starts an exchange: ``stats`` is the optimizer's
        :class:`~stella.pipeline.PipelineStats` (``iterations`` already counting this
        step), ``client`` its :class:`~stella.Client`. Times are taken between these calls.
        Returns the new report (None on the first call: no interval yet)."""
        report = None
        now = time.perf_counter()
        exchanged = stats.exchange_s + stats.compress_s
        pushed, pulled = getattr(client, "bytes_pushed", 0), getattr(client, "bytes_pulled", 0)
        if self._last_end is not None:
            wait = max(0.0, stats.wait_s - self._last_wait)
            self._report = report = WorkerReport(
                step=stats.iterations, compute_s=max(0.0, now - self._last_end - wait),
                exchange_s=max(0.0, exchanged - self._last_exchange), wait_s=wait,
                density=_fraction(stats.density), bytes_pushed=int(pushed),
                bytes_pulled=int(pulled), value_dtype=stats.value_dtype, local_steps=stats.sync_every,
                accumulate=stats.accumulate, up_bps=min(1e13, stats.up_mbps * 1e6 / 8),
                down_bps=min(1e13, stats.down_mbps * 1e6 / 8), max_density=_fraction(stats.max_density))
        self._last_end, self._last_wait, self._last_exchange = now, stats.wait_s, exchanged
        if not self.every:
            return report
        if self._line_t is None:
            self._line_t, self._line_step, self._line_wait = now, stats.iterations, stats.wait_s
            return report
        if stats.iterations % self.every == 0 and stats.iterations > self._line_step:
            n, dt = stats.iterations - self._line_step, now - self._line_t
            wait_pct = 100.0 * (stats.wait_s - self._line_wait) / dt if dt > 0 else 0.0
            log.info(f"stella step {stats.iterations} | {dt / n:.3f} s/it | wait {wait_pct:.0f}% | "
                     f"density {stats.density:.2%} {stats.value_dtype} | H {stats.sync_every} | "
                     f"batch x{stats.accumulate} | up {stats.up_mbps:.0f} down {stats.down_mbps:.0f} Mbit/s | "
                     f"pushed {_mb(pushed)} pulled {_mb(pulled)}")
            self._line_t, self._line_step, self._line_wait = now, stats.iterations, stats.wait_s
        return report
