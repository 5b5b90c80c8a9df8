"""The rounds of :class:`~stella.StellaOptimizer`: the one background thread that uses the
connection, what one round does on it (compress, push, wait for the step, pull), and
what a round measures for the worker's controller (:class:`~stella.adapt.Controller`),
whose only feeder this is.

A round starts when the exchange (:mod:`stella._exchange`) hands over what to push and
ends when the optimizer takes its answer (:meth:`Rounds.finish`) at the start of the
next round (one round stale) or at once (``Sync(staleness=0)``). Every use of the client
happens on the thread (ZeroMQ sockets are not thread-safe). On a site's other ranks the
rounds hold no client and do nothing: their leader's answers reach them through the
site (:mod:`stella.site`).
"""
from __future__ import annotations

import dataclasses
import logging
import statistics
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from .adapt import Controller, Decision, RoundMeasure, local_steps
from .client import Client, PullResult
from .errors import PipelineError, Stopped
from .flat import FlatPush
from .layout import FlatUpdate
from .options import Compression, Connection
from .progress import Progress
from .protocol import PullCoding, Registered
from .shards import AnyClient, ShardedClient, connect

__all__ = ["Rounds", "PipelineStats", "wait_for_step"]

log = logging.getLogger("stella.pipeline")
T = TypeVar("T")

# What one round answers: the server's delta, and what this worker sent (as the server decoded it).
Answer = tuple[PullResult, FlatPush]


@dataclass
class PipelineStats:
    iterations: int = 0  # step() calls
    rounds: int = 0  # exchanges started: one per step in gradient mode, one per H steps in update mode
    wait_s: float = 0.0  # time step() spent blocked on the previous exchange
    install_s: float = 0.0  # time step() spent installing the server's answers (the training thread)
    compress_s: float = 0.0
    exchange_s: float = 0.0  # push + waiting for the step + pull, in the background
    values_pushed: int = 0
    values_pulled: int = 0
    density: float = 0.0  # the compressor's density for the latest push
    max_density: float = 0.0  # the densest push worth the worker's own work a round (the controller's cap)
    value_dtype: str = "f16"  # the coding of the latest push's values
    sync_every: int = 1  # the local steps the latest round made (update mode; 1 in gradient mode)
    least_every: int = 1  # the least local steps the next round makes (Sync.every, or its choice under "auto")
    accumulate: int = 1  # the micro-batches the latest round's gradient summed (gradient mode; 1 in update mode)
    up_mbps: float = 0.0  # the controller's estimates of the link, Mbit/s (0: not measured yet)
    down_mbps: float = 0.0
    decisions: int = 0  # the controller's changes of density or coding so far


def wait_for_step(client: AnyClient, delta: PullResult, since: int, coding: PullCoding) -> PullResult:
    """The delta of the step after ``since``, given the answer ``delta`` to a pull that
    waited for it. The server answers a waiting pull when its wait expires even if no
    step closed (it waits for workers: before the job starts, or for a missing one within
    the step deadline); then pull again rather than go on, since every further push would
    only queue up on the server (and after ``--max-queued-pushes`` be refused). A snapshot
    (the server restarted from an older checkpoint) is the answer whatever its version.
    So is a rebased answer (``PullResult.rebased``: the client reconnected while the pull
    waited): a server that restarted may have lost the push it had acknowledged, and the
    step would then wait for this worker while it waits for the step."""
    t0 = time.monotonic()
    warned = t0
    while not delta.full and delta.version <= since and not delta.rebased:
        now = time.monotonic()
        if now - warned >= 60.0:
            warned = now
            log.warning("waiting %.0f s for the server's step after version %d (the server waits for "
                        "workers; `stella status` shows which)", now - t0, since)
        delta = client.pull(since, wait_for=since + 1, index_coding=coding)
    return delta


def as_update(push: FlatPush) -> FlatUpdate:
    """What the compressor made, as the client pushes it (the sparse range starts the flat model)."""
    sp = push.sparse
    idx = np.arange(sp.numel, dtype=np.int32) if sp.indices is None else sp.indices
    return FlatUpdate(idx, sp.values, push.dense if push.dense.size else None)


# close() pushes what was left unsent; a push the server's norm bound scaled down sends the rest
# again, up to this many pushes in all (the first, the final one, is allowed 8 times the usual bound)
FLUSH_PUSHES = 4


class Rounds:
    """The background thread, the round in flight, the controller and what it measures.

    ``exchange``: the mode's half (:mod:`stella._exchange`): its compressor is the one
    this compresses with and the controller tunes, ``codings`` the controller's choice
    and ``run_on_margin`` when a round may run on. ``leads``: this process speaks to the
    server; ``may_run_on``: its rounds may run on (a site's ranks may not)."""

    def __init__(self, exchange: Any, compression: Compression, *, leads: bool, may_run_on: bool,
                 progress_every: int):
        c = compression
        self.exchange, self.compression = exchange, c
        self.controller = Controller(density=None if c.density == "auto" else float(c.density),
                                     floor=c.min_density, ceiling=c.max_density,
                                     codings=exchange.codings if c.value_dtype == "auto" else (c.value_dtype,))
        # block16 codes only whole blocks, which the broadcast or the union a pull returns need not be
        self.pull_coding: PullCoding = "rice" if c.index_coding == "block16" else c.index_coding
        self.leads, self.may_run_on = leads, may_run_on
        self.stats = PipelineStats(density=self.controller.density, max_density=self.controller.max_density,
                                   value_dtype=self.controller.value_dtype)
        self._compressor: Any = None  # the exchange's, once attached
        self.progress = Progress(progress_every)
        self.client: AnyClient | None = None  # the leader's (a site's other ranks never connect)
        self._step_compute: deque[float] = deque(maxlen=8)  # per step(), the computation before it
        self._exchange_times: deque[float] = deque(maxlen=8)  # whole rounds, start to answer
        # Sync(every="auto")'s inputs: per round, the training thread's work ending one round and starting the
        # next (not its waits) and the compression (the exchange's thread, on the model's device); per step, the
        # computation without the round's work (``_unpaid``: the latest round's, in the interval on_step measures)
        self._round_work: deque[float] = deque(maxlen=8)
        self._compress_times: deque[float] = deque(maxlen=8)
        self._own_compute: deque[float] = deque(maxlen=8)
        self._unpaid = 0.0
        self.next_every = exchange.sync_every  # Sync(every="auto"): the least H the leader chose, not yet taken
        self._measure: RoundMeasure | None = None  # the latest finished round's, for the controller
        self._inflight: Future[Answer] | None = None
        self._inflight_since = 0.0
        self.stopped = False  # stop() was called
        self._exec = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stella-pipeline")
        # an optimizer dropped without close() still lets its thread go (its Client closes its own socket)
        weakref.finalize(self, self._exec.shutdown, wait=False)

    @property
    def compressor(self) -> Any:
        """The exchange's compressor (made when it attached, the server's dense cut known)."""
        return self.exchange.compressor

    # ------------------------------------------------------------------ on the thread
    def call(self, fn: Callable[[AnyClient], T]) -> T:
        """``fn(client)`` on the background thread (the leader's; the thread is idle)."""
        assert self.client is not None, "only a site's leader speaks to the server"
        client = self.client
        return self._exec.submit(fn, client).result()

    def open(self, address: str | Sequence[str] | AnyClient, connection: Connection, params: Mapping[str, Any],
             optimizer: Mapping[str, Any] | None, mode: str, version: int = 0) -> tuple[Registered, PullResult | None]:
        """Connect (unless ``address`` is a connected client), register the model (the
        job's model at ``version``: a resuming worker's) and pull what the worker's values
        lack: the job's snapshot when the job's model is not these values, the steps since
        its ``base`` when it is (or nothing)."""

        def register() -> tuple[Registered, PullResult | None]:
            client = self.client = (address if isinstance(address, Client | ShardedClient)  # connected by the caller
                                    else connect(address, **connection.client_kwargs()))
            if self.stopped:
                client.stop()
            reply = client.register(params, optimizer, mode=mode, version=version)  # type: ignore[arg-type]
            self.controller.broadcast = reply.broadcast  # the pull's coding and size, as the server has them
            if reply.base is None:
                return reply, client.pull(None)
            # these values are the model at reply.base (this worker created it, or the job was created with the
            # same values): only the steps since then, if any. Over a slow link a snapshot would cost every worker
            # the model's size once more before its first step
            return reply, None if reply.base == reply.version else client.pull(reply.base)

        try:
            return self._exec.submit(register).result()
        except BaseException:
            self._exec.shutdown(wait=False)
            raise

    def _round(self, grad: Any, version: int, since: int, hparams: dict[str, Any] | None,
               samples: int) -> Answer:
        """Compress (the round's flat gradient, or, for None, the residual as the update
        mode left it), push, wait for the step, pull the delta; measure the transfers for
        the controller."""
        t0 = time.perf_counter()
        sent = self.compressor.compress(grad)
        t1 = time.perf_counter()
        # a changed learning rate (or other hyper-parameter) rides on the push: it applies
        # from the step this push joins, with no round trip of its own
        client = self.client
        assert client is not None
        up0, down0 = client.bytes_pushed, client.bytes_pulled
        # the pull rides on the push (one message): the server sees it once the push is in
        push, pull = client.push_pull(as_update(sent), version, since, wait_for=since + 1,
                                      value_dtype=sent.value_dtype, index_coding=self.compression.index_coding,
                                      pull_coding=self.pull_coding, hparams=hparams or None,
                                      report=self.progress.report(), samples=samples)
        t_pull = time.perf_counter()
        ok = push.result()
        t_ack = time.perf_counter()
        # the server's push-norm bound scaled part of it off: back into the residual, and installed as applied
        sent = self.compressor.take_back(sent, ok.clipped)
        first = pull.result()
        t2 = time.perf_counter()
        up1, down1 = client.bytes_pushed, client.bytes_pulled
        delta = wait_for_step(client, first, since, self.pull_coding)
        # the pull's link time: its answer's time less what the server held it (waiting for the
        # step, for other workers); the push's: send to acknowledgement
        pull_s = (t2 - max(t_pull, t_ack) - first.held_s) if delta is first else 0.0
        self._measure = RoundMeasure(compute_s=0.0, compress_s=t1 - t0, push_bytes=up1 - up0, push_s=t_ack - t1,
                                     pull_bytes=down1 - down0, pull_s=max(0.0, pull_s), server_s=first.step_s)
        self.stats.compress_s += t1 - t0
        self._compress_times.append(t1 - t0)
        t3 = time.perf_counter()
        self.stats.exchange_s += t3 - t1
        self._exchange_times.append(t3 - t0)
        self.stats.values_pushed += sent.count
        self.stats.values_pulled += delta.count
        return delta, sent

    @property
    def job_size(self) -> int:
        """The pushes of the latest step installed (the workers whose models the job
        averages): the exchange's, which the pipeline sets from each answer."""
        return int(self.exchange.job_size)

    # ------------------------------------------------------------------ from the training loop
    def on_step(self) -> None:
        """Once per ``step()``: count it and take its computation's time (progress report)."""
        self.stats.iterations += 1
        report = self.progress.on_step(self.stats, self.client)  # timings for the next push, the progress line
        if report is not None:
            self._step_compute.append(report.compute_s)
            self._own_compute.append(max(0.0, report.compute_s - self._unpaid))
        self._unpaid = 0.0

    def note_round(self, work_s: float) -> None:
        """The training thread's work of the round just started: installing the previous
        answer, adapting, loading what to push, handing it over (its waits not counted)."""
        self._round_work.append(work_s)
        self._unpaid += work_s

    def note_install(self, seconds: float) -> None:
        """The training thread installed the answer of the round just finished in
        ``seconds``, for the controller."""
        if self._measure is not None:
            self._measure = dataclasses.replace(self._measure, install_s=seconds)

    def runs_on(self) -> bool:
        """Should the round run on (another local step, or micro-batch) instead of waiting?
        While the exchange in flight is not done and is expected (by the median of recent
        rounds) to take more than the exchange's ``run_on_margin`` of a step more: waiting
        that long costs less than the overshoot would."""
        fut = self._inflight
        if not self.may_run_on or fut is None or fut.done() or not self._exchange_times:
            return False
        step = statistics.median(self._step_compute) if self._step_compute else 0.0
        left = statistics.median(self._exchange_times) - (time.perf_counter() - self._inflight_since)
        return bool(left > self.exchange.run_on_margin * step)

    def start(self, grad: Any, version: int, since: int, hparams: dict[str, Any], samples: int) -> None:
        """Start the round that pushes ``grad`` (the flat gradient computed on ``version``,
        or None: the residual) and pulls the step after ``since`` (the leader's; nothing
        on a site's other ranks)."""
        self.stats.rounds += 1
        if self.leads:
            self._inflight_since = time.perf_counter()
            self._inflight = self._exec.submit(self._round, grad, version, since, hparams, samples)

    def finish(self) -> Answer | None:
        """The answer of the round in flight, once it is done (None: none in flight);
        its failure as a :class:`~stella.errors.PipelineError`."""
        fut, self._inflight = self._inflight, None
        if fut is None:
            return None
        try:
            return fut.result()
        except Stopped:
            raise
        except Exception as e:
            raise PipelineError(f"background exchange failed: {type(e).__name__}: {e}") from e

    def adapt(self) -> None:
        """Feed the controller the round just finished and set the next push's density
        and coding (the thread is idle now), then note the round about to start."""
        m, self._measure = self._measure, None
        if m is None and self.leads and self.stats.rounds == 0 and self.exchange.mode == "update":
            # update mode's first push: nothing measured the link yet (stella.adapt, "The first push"; gradient
            # mode's stays at the ceiling)
            self._take(self.controller.first())
        elif m is not None and self._step_compute:
            # the computation a round offers at the least H (a round that ran on offered more)
            every = self.exchange.sync_every
            compute = statistics.median(self._step_compute) * every
            # the cap weighs the worker's work a round, the least of its rounds, against the least of its
            # steps' own compute: both as they cost without the other processes of a loaded host
            own = min(self._own_compute) * every if self._own_compute else 0.0
            self._take(self.controller.observe(dataclasses.replace(m, compute_s=compute, own_compute_s=own,
                                                                   workers=self.job_size)))
            s = self.stats
            s.up_mbps, s.down_mbps = 8e-6 * self.controller.up_bps, 8e-6 * self.controller.down_bps
            s.decisions, s.max_density = self.controller.decisions, self.controller.max_density
        self._choose_local_steps()
        s = self.stats
        s.density, s.value_dtype = self.compressor.density, self.compressor.value_dtype
        s.sync_every, s.accumulate = self.exchange.round_steps, self.exchange.round_batches
        s.least_every = self.exchange.sync_every

    def _take(self, d: Decision) -> None:
        """Give the compressor the controller's choice for the next push."""
        if d.density != self.compressor.density:
            self.compressor.set_density(d.density)
        self.compressor.value_dtype = d.value_dtype

    def _choose_local_steps(self) -> None:
        """``Sync(every="auto")``: the least local steps of the rounds after the next, from
        what a round costs this worker against a step's own compute
        (:func:`stella.adapt.local_steps`), in :attr:`next_every`: it travels with the next
        answer (the pipeline's ``_finish_round``), so that a site's ranks, which run no
        rounds of their own, take it at the same step as their leader."""
        ex = self.exchange
        if not (ex.auto_every and self.leads) or len(self._round_work) < 3 or not self._own_compute:
            return
        work = statistics.median(self._round_work)
        compress = statistics.median(self._compress_times) if self._compress_times else 0.0
        compute = statistics.median(self._own_compute)
        h = local_steps(compute, work + compress, self.job_size, 1, ex.max_sync_every, self.next_every)
        if h != self.next_every:
            log.info("stella: local steps a round %d -> %d (a round costs %.2f ms of work and %.2f ms of compression "
                     "against %.2f ms of compute a step, %d workers)", self.next_every, h, 1e3 * work,
                     1e3 * compress, 1e3 * compute, self.job_size)
            self.next_every = h

    # ------------------------------------------------------------------ the end
    def flush(self, version: int) -> None:
        """Push what was not sent (the residuals, whole, in float32), so nothing is lost."""
        if not self.leads:
            return

        def flush(client: AnyClient) -> None:
            rest = self.compressor.flush()
            for _ in range(FLUSH_PUSHES):
                if not rest.count:
                    return
                ok = client.push(as_update(rest), version, value_dtype="f32", final=True)
                if not ok.clipped:
                    return
                # the push-norm bound scaled it down: what it scaled off goes out in the next push
                self.compressor.take_back(rest, ok.clipped)
                rest = self.compressor.flush()
            if rest.count:
                lost = float(np.linalg.norm(rest.to_dense().astype(np.float64)))
                log.warning("close(): the server's push-norm bound scaled down %d pushes of what was left unsent; "
                            "the rest (L2 norm %.4g) is dropped", FLUSH_PUSHES, lost)

        self.call(flush)

    def stop(self) -> None:
        """End the thread's wait for the server, if any (:meth:`stella.Client.stop`); safe
        from a signal handler."""
        self.stopped = True
        client = self.client
        if client is not None:
            client.stop()

    def close(self) -> None:
        """Leave the job, close the connection and stop the thread."""
        try:
            if self.client is not None:
                try:
                    fut = self._exec.submit(self.client.close)
                except RuntimeError:  # the thread was shut down (a registration failed): nothing runs on it
                    self.client.close()
                else:
                    fut.result()
        finally:
            self._exec.shutdown(wait=True)
