"""The overlapped training pipeline: a drop-in optimizer for any ``torch.nn.Module``.

The training script keeps its loop::

    opt = stella.StellaOptimizer(model, "tcp://ps-host:5555",
                                 optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    opt.close()

Two training modes (``docs/optimizer.md`` has the exact rules):

``mode="update"`` (the default)
    The worker runs the optimizer itself (the user's ``torch.optim.Optimizer``, or
    one built from a config mapping), dense, on its own gradients; its state never
    leaves the worker. Every ``sync_every`` = H steps it pushes the compressed
    *pseudo-gradient*: the change of its weights since the model the server last
    sent, minus what is already in flight (top-k of it, values rounded to the wire
    dtype; whatever is not sent stays in the weights and goes out with a later
    round). The server averages the workers' pseudo-gradients and applies an *outer*
    optimizer lazily (``outer``: plain averaging, or Nesterov momentum). The exchange
    of round ``r`` runs while the worker computes round ``r+1``; when the server's
    change arrives it is merged into the local weights without losing the local
    progress made meanwhile::

        anchor a: the worker's exact copy of the server's model
        on arrival of version v+1:  G = a_(v+1) - a_v;  w <- w + G + c_r;  a <- a_(v+1)

    where ``c_r`` is the pseudo-gradient this worker pushed (as the server decoded
    it). Invariant at every sync point: ``a - w = residual + in-flight pushes``.
``mode="gradient"`` (StellaTrain's)
    The worker pushes top-k of its gradient plus an error-feedback residual; the
    server runs the optimizer (``optimizer`` is its config) lazily on the mean.
    ``step()`` hands iteration ``t``'s gradient to a background thread and returns at
    once, so the forward/backward of iteration ``t`` runs on weights that include
    updates ``0..t-2`` (one step stale). It suits SGD; with Adam-family optimizers
    it needs several times the iterations of dense training (README).

In both modes every use of the connection happens on one background thread, errors
there are raised from the next ``step()``, ``synchronize()`` or ``close()``, and
``close()`` pushes what is left unsent, so nothing is lost.

Learning-rate schedules: in update mode the wrapper's ``param_groups`` *are* the
inner optimizer's, so a scheduler built on the wrapper (or on the user's optimizer)
drives the local learning rate; ``opt.outer`` mirrors the server's outer optimizer
(a ``torch.optim.Optimizer`` a scheduler can drive too). In gradient mode the
wrapper's own group mirrors the server's optimizer. Changed server hyper-parameters
travel with the next push and apply from the step it joins.

Each mode's half (what a step does, what a round pushes, how the answer is installed,
what a checkpoint holds, which groups the wrapper shows) is one class in
:mod:`stella._exchange`; :class:`StellaOptimizer` composes one and owns the rest.
"""
from __future__ import annotations

import dataclasses
import logging
import statistics
import time
import warnings
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

import torch

from ._exchange import Grads, build_inner, exchange_for
from .adapt import Controller, RoundMeasure
from .client import PullResult
from .codec import CODINGS, DENSE_BELOW
from .compress import METHODS, VALUE_DTYPES, ErrorFeedbackCompressor, SparseGrad
from .errors import StellaError
from .modes import DEFAULT_MODE, MODES, OUTER_PRESETS, Mode
from .progress import Progress
from .protocol import IndexCoding, PullCoding, Registered, ValueDtype
from .shards import AnyClient, connect
from .site import Site, resolve_group

log = logging.getLogger("stella.pipeline")

__all__ = ["StellaOptimizer", "Compression", "PipelineError", "PipelineStats", "MODES", "OUTER_PRESETS",
           "build_inner"]


class PipelineError(StellaError):
    """The background exchange failed; the cause is chained (``__cause__``)."""


@dataclass(frozen=True)
class Compression:
    """How :class:`StellaOptimizer` compresses its pushes (``docs/compression.md``).

    ``density``: the fraction of each tensor pushed per exchange, or ``"auto"``
    (default): chosen each round by the worker's :class:`~stella.adapt.Controller`
    between ``min_density`` and ``max_density``, so that the exchange hides behind the
    computation. ``method`` ("threshold", "block", "exact" or "dense") and
    ``dense_below`` (smaller tensors go dense): the compressor, :mod:`stella.compress`.
    ``value_dtype``: the wire coding of pushed values, or ``"auto"`` (default): the
    controller picks among f16, q4 and q2 (4.5 or 2.5 bits a value, the quantisation
    error kept in the residual); a coding pins it. ``index_coding``: the indices'.
    """

    density: float | Literal["auto"] = "auto"
    min_density: float = 0.001
    max_density: float = 0.1
    method: str = "threshold"
    dense_below: int = DENSE_BELOW
    value_dtype: ValueDtype | Literal["auto"] = "auto"
    index_coding: IndexCoding = "rice"

    def __post_init__(self) -> None:
        if isinstance(self.density, str):
            if self.density != "auto":
                raise ValueError(f"density must be a number or 'auto', got {self.density!r}")
        elif not 0.0 < self.density <= 1.0:  # NaN too
            raise ValueError(f"density must be in (0, 1] or 'auto', got {self.density!r}")
        if not 0.0 < self.min_density <= self.max_density <= 1.0:
            raise ValueError(f"need 0 < min_density <= max_density <= 1, got {self.min_density}, {self.max_density}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if not self.dense_below >= 0:
            raise ValueError(f"dense_below must be >= 0, got {self.dense_below!r}")
        if self.value_dtype != "auto" and self.value_dtype not in VALUE_DTYPES:
            raise ValueError(f"value_dtype must be 'auto' or one of {VALUE_DTYPES}, got {self.value_dtype!r}")
        if self.index_coding not in get_args(IndexCoding):
            raise ValueError(f"index_coding must be one of {get_args(IndexCoding)}, got {self.index_coding!r}")


_COMPRESSION_FIELDS = tuple(f.name for f in fields(Compression))


def _compression(compression: Compression | None, old: Mapping[str, Any]) -> Compression:
    """``compression=``, or the keyword arguments it took over (deprecated: each warns)."""
    unknown = sorted(set(old) - set(_COMPRESSION_FIELDS))
    if unknown:
        raise TypeError(f"StellaOptimizer() got an unexpected keyword argument {unknown[0]!r}")
    if not old:
        return Compression() if compression is None else compression
    if compression is not None:
        raise TypeError(f"StellaOptimizer() takes compression= or the old {', '.join(f'{k}=' for k in old)}, "
                        f"not both: pass compression=stella.Compression({', '.join(f'{k}=...' for k in old)})")
    for k in old:  # stacklevel 3: the caller of StellaOptimizer()
        warnings.warn(f"StellaOptimizer({k}=...) is deprecated: pass compression=stella.Compression({k}=...)",
                      DeprecationWarning, stacklevel=3)
    return Compression(**old)


@dataclass
class PipelineStats:
    iterations: int = 0  # step() calls
    rounds: int = 0  # exchanges started: one per step in gradient mode, one per sync_every steps in update mode
    wait_s: float = 0.0  # time step() spent blocked on the previous exchange
    compress_s: float = 0.0
    exchange_s: float = 0.0  # push + waiting for the step + pull, in the background
    values_pushed: int = 0
    values_pulled: int = 0
    density: float = 0.0  # the compressor's density for the latest push
    value_dtype: str = "f16"  # the coding of the latest push's values
    sync_every: int = 1  # the local steps the latest round made (update mode; 1 in gradient mode)
    accumulate: int = 1  # the micro-batches the latest round's gradient summed (gradient mode; 1 in update mode)
    up_mbps: float = 0.0  # the controller's estimates of the link, Mbit/s (0: not measured yet)
    down_mbps: float = 0.0
    decisions: int = 0  # the controller's changes of density or coding so far


def _wait_for_step(client: AnyClient, delta: PullResult, since: int, coding: PullCoding) -> PullResult:
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


class StellaOptimizer(torch.optim.Optimizer):
    """Data-parallel training through ``stella-ps`` with the exchange hidden behind the
    computation (see the module doc for the two modes).

    ``address``: the server's ``tcp://host:port``; several (a list, or comma-separated):
    the shards of a sharded job, in their order (:mod:`stella.shards`).
    ``model``: any module; every parameter with ``requires_grad`` is registered under
    its ``named_parameters`` name.

    ``optimizer``: update mode: the worker's optimizer, a ``torch.optim.Optimizer`` over
    the model's parameters or a config mapping (``{"name": "adamw", "lr": 1e-3, ...}``)
    to build one. Gradient mode: the server's optimizer config (None: the server's
    default, ``stella-ps --optimizer``).
    ``mode``: "update" (default) or "gradient". ``outer``: update mode's server-side
    optimizer, "average" (default), "nesterov" or a config mapping.
    ``sync_every``: update mode's local steps per exchange (H; 1 = every step): the
    least a round makes. ``max_sync_every`` (update mode; default ``4 * sync_every``):
    while the exchange in flight is not done, a round runs on with more local steps, up
    to this many, instead of waiting; ``= sync_every`` pins H. ``max_accumulate``
    (gradient mode; default 1, off): the same with micro-batches, whose gradients are
    averaged into one push (a larger batch). Off by default because the server's
    optimizer then takes fewer steps per sample: on digits (dense SGD, momentum 0.9) up
    to 4 micro-batches per step needed about twice the samples to reach an accuracy;
    turn it on where a slow link or a slower peer would otherwise idle the workers.
    Either way each push carries the samples it represents (``batch_size`` per step, or
    one per step when None) and the server weights the step's pushes by them, so workers
    of different speeds each compute what fits in a round and none idles
    (docs/optimizer.md).

    ``compression``: a :class:`Compression` (density, method, wire coding; its
    defaults when None). Its fields are also accepted as keyword arguments of their
    own, the old form, with a :class:`DeprecationWarning`; not both.
    ``server_key``/``client_key``: CurveZMQ keys (see :class:`~stella.client.Client`;
    or ``STELLA_SERVER_KEY``/``STELLA_CLIENT_KEY``). ``staleness``: 1 (overlapped) or 0
    (each exchange finishes inside the ``step()`` that starts it; the non-overlapped
    baseline). ``compress_in_backward`` (gradient mode): compress each gradient from
    its autograd hook.
    ``progress_every``: log a one-line summary every that many steps (0: none; see
    :mod:`stella.progress`). The timings travel with the pushes in any case.
    ``process_group``: the ranks of this site (:mod:`stella.site`): they average over
    ``torch.distributed`` (update mode: their weights each round; gradient mode: their
    gradients each step) and the group's rank 0 alone speaks to the server, then shares
    its answer. ``"default"`` (the default): the default group when ``torch.distributed``
    is initialised with more than one rank; None: this process is a worker of its own.
    Every rank calls the same methods in the same order, as with any collective.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        address: str | Sequence[str],
        *,
        optimizer: torch.optim.Optimizer | Mapping[str, Any] | None = None,
        mode: Mode | None = None,
        outer: str | Mapping[str, Any] = "average",
        sync_every: int = 1,
        max_sync_every: int | None = None,
        max_accumulate: int | None = None,
        batch_size: int | None = None,
        compression: Compression | None = None,
        staleness: int = 1,
        timeout: float | None = None,
        name: str = "",
        worker_id: int | None = None,
        server_key: str | None = None,
        client_key: str | None = None,
        compress_in_backward: bool = False,
        client: AnyClient | None = None,
        progress_every: int = 0,
        process_group: Any = "default",
        **deprecated: Any,
    ):
        self.compression = c = _compression(compression, deprecated)
        mode = mode or DEFAULT_MODE
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if staleness not in (0, 1):
            raise ValueError("staleness must be 0 or 1")
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be an integer >= 1, got {sync_every!r}")
        if max_sync_every is None:
            max_sync_every = 4 * sync_every if mode == "update" else 1
        if max_accumulate is None:  # off by default (the class doc says why)
            max_accumulate = 1
        for k, v, lo in (("max_sync_every", max_sync_every, sync_every), ("max_accumulate", max_accumulate, 1),
                         ("batch_size", 1 if batch_size is None else batch_size, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{k} must be an integer >= {lo}, got {v!r}")
        if mode == "gradient" and max_sync_every != 1:
            raise ValueError("max_sync_every is for update mode (gradient mode exchanges every step)")
        if max_accumulate > 1 and (mode == "update" or compress_in_backward):
            raise ValueError("max_accumulate is for gradient mode without compress_in_backward (update mode "
                             "runs on with local steps instead: max_sync_every)")
        self.samples_per_step = batch_size or 1
        # tensors without elements never change: nothing to exchange
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad and p.numel() > 0}
        if not self.params:
            raise ValueError("model has no trainable parameters")
        self.mode: Mode = mode
        self.staleness = staleness
        # block16 codes only whole blocks, which the union a pull returns need not be
        self.pull_coding: PullCoding = "rice" if c.index_coding == "block16" else c.index_coding
        # gradient mode's pushes feed the server's optimizer (momentum, Adam) directly: 2-bit
        # values made its steps erratic on digits (tests/test_convergence.py), so it stops at q4
        # (compressions started in backward run on their own thread, so their coding cannot change)
        auto_codings = CODINGS if mode == "update" else CODINGS[:1] if compress_in_backward else CODINGS[:2]
        self.controller = Controller(density=None if c.density == "auto" else float(c.density),
                                     floor=c.min_density, ceiling=c.max_density,
                                     codings=auto_codings if c.value_dtype == "auto" else (c.value_dtype,))
        # how much of a step the exchange must still take for a round to run on: local steps
        # cost little (a tenth); a micro-batch more changes the server's step (half)
        self._run_on_margin = 0.1 if mode == "update" else 0.5
        # values are rounded to the wire dtype inside the compressor, the rounding error kept in the residual
        self.compressor = ErrorFeedbackCompressor(self.controller.density, method=c.method, dense_below=c.dense_below,
                                                  value_dtype=self.controller.value_dtype)
        self._exchange = exchange_for(mode, self.params, self.compressor, optimizer, outer, sync_every=sync_every,
                                      max_sync_every=max_sync_every, max_accumulate=max_accumulate,
                                      compress_in_backward=compress_in_backward)
        group = resolve_group(process_group)
        self.site: Site | None = Site(group) if group is not None else None
        if self.site is not None and compress_in_backward:
            raise ValueError("compress_in_backward compresses each rank's own gradient: a site averages them first")
        leader = self.site is None or self.site.is_leader
        self.stats = PipelineStats(density=self.controller.density, value_dtype=self.controller.value_dtype)
        self.progress = Progress(progress_every)
        self._step_compute: deque[float] = deque(maxlen=8)  # per step(), the computation before it
        self._exchange_times: deque[float] = deque(maxlen=8)  # whole rounds, start to answer
        self._measure: RoundMeasure | None = None  # the latest finished round's, for the controller
        self._inflight_since = 0.0
        # every use of the client happens on this one thread (ZeroMQ sockets are not thread-safe)
        self._exec = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stella-pipeline")
        # an optimizer dropped without close() still lets its thread go (its Client closes its own socket)
        weakref.finalize(self, self._exec.shutdown, wait=False)
        self._inflight: Future | None = None  # the leader's exchange in flight
        self._pending = False  # a round is in flight (on every rank of a site)
        self._closed = False
        self.client: AnyClient | None = None  # the leader's (a site's other ranks never connect)

        def init() -> tuple[Registered, PullResult | None]:
            self.client = client or connect(address, timeout=timeout, name=name, worker_id=worker_id,
                                            server_key=server_key, client_key=client_key)
            reply = self.client.register(self.params, self._exchange.server_config, mode=self.mode)
            self.controller.broadcast = reply.broadcast  # the pull's coding and size, as the server has them
            if reply.base is None:  # the job's model is not this worker's values: its snapshot
                return reply, self.client.pull(None)
            # this worker's values are the model at reply.base (it created the model, or the job was created
            # with the same values, e.g. from the same seed): only the steps since then, if any, to pull. Over a
            # slow link a snapshot would cost every worker the model's size once more before its first step
            return reply, None if reply.base == reply.version else self.client.pull(reply.base)

        start: tuple[dict[str, Any], int] | None = None
        if leader:
            try:
                reply, snap = self._exec.submit(init).result()
            except BaseException:
                self._exec.shutdown(wait=False)
                raise
            if snap is not None:
                with torch.no_grad():
                    snap.apply_to(self.params)
            start = (reply.optimizer or {}, reply.version if snap is None else snap.version)
        if self.site is not None:  # the leader's model and the server's answer, on every rank
            with torch.no_grad():
                self.site.broadcast(p.detach() for p in self.params.values())
            start = self.site.share(start)
        assert start is not None
        self.server_optimizer: dict[str, Any] = start[0]
        self.version = start[1]  # the version of the server's model the replica (anchor) holds
        self._exchange.attach(self.server_optimizer)
        # the wrapper shows the exchange's groups: a scheduler built on it drives them
        super().__init__(list(self.params.values()), self._exchange.groups.defaults)
        self.param_groups = self._exchange.groups.param_groups
        self.state = self._exchange.groups.state
        self._sent_hparams = self._exchange.hparams()

    @property
    def bytes_pushed(self) -> int:
        """Bytes this worker sent to the server so far (0 on a site's other ranks)."""
        return self.client.bytes_pushed if self.client is not None else 0

    @property
    def bytes_pulled(self) -> int:
        """Bytes this worker received from the server so far (0 on a site's other ranks)."""
        return self.client.bytes_pulled if self.client is not None else 0

    @property
    def inner(self) -> torch.optim.Optimizer | None:
        """Update mode: the worker's own optimizer (the local steps); gradient mode: None."""
        return self._exchange.inner

    @property
    def outer(self) -> torch.optim.Optimizer | None:
        """Update mode: the mirror of the server's outer optimizer (a scheduler may drive
        it); gradient mode: None (the wrapper's own group mirrors the server's optimizer)."""
        return self._exchange.outer

    # ------------------------------------------------------------------ the exchange
    def _round(self, grads: Grads, version: int, since: int, hparams: dict | None,
               samples: int) -> tuple[PullResult, dict[str, SparseGrad]]:
        """Background thread: compress (a gradient, an early compression's future, or,
        for None, the residual as the update mode left it), push, wait for the step,
        pull the delta; measure the transfers for the controller."""
        t0 = time.perf_counter()
        sparse = {n: g.result() if isinstance(g, Future) else self.compressor.compress(n, g)
                  for n, g in grads.items()}
        t1 = time.perf_counter()
        # a changed learning rate (or other hyper-parameter) rides on the push: it applies
        # from the step this push joins, with no round trip of its own
        client = self._client()
        up0, down0 = client.bytes_pushed, client.bytes_pulled
        push = client.push(sparse, version, value_dtype=self.controller.value_dtype,
                           index_coding=self.compression.index_coding, hparams=hparams or None,
                           report=self.progress.report(), samples=samples, wait=False)
        pull = client.pull(since, wait_for=since + 1, index_coding=self.pull_coding, wait=False)
        t_pull = time.perf_counter()  # queued behind the push: the server sees it once the push is in
        push.result()
        t_ack = time.perf_counter()
        first = pull.result()
        t2 = time.perf_counter()
        up1, down1 = client.bytes_pushed, client.bytes_pulled
        delta = _wait_for_step(client, first, since, self.pull_coding)
        # the pull's link time: its answer's time less what the server held it (waiting for the
        # step, for other workers); the push's: send to acknowledgement
        pull_s = (t2 - max(t_pull, t_ack) - first.held_s) if delta is first else 0.0
        self._measure = RoundMeasure(compute_s=0.0, compress_s=t1 - t0, push_bytes=up1 - up0, push_s=t_ack - t1,
                                     pull_bytes=down1 - down0, pull_s=max(0.0, pull_s), server_s=first.step_s)
        self.stats.compress_s += t1 - t0
        t3 = time.perf_counter()
        self.stats.exchange_s += t3 - t1
        self._exchange_times.append(t3 - t0)
        self.stats.values_pushed += sum(s.values.size for s in sparse.values())
        self.stats.values_pulled += delta.count
        return delta, sparse

    def _finish_inflight(self) -> None:
        """Wait for the in-flight exchange and install its delta into the replica (a
        site's leader shares it with the other ranks, which install the same)."""
        if not self._pending:
            return
        self._pending = False
        t0 = time.perf_counter()
        result: tuple[PullResult, dict[str, SparseGrad]] | BaseException | None = None
        if self._inflight is not None:
            fut, self._inflight = self._inflight, None
            try:
                result = fut.result()
            except Exception as e:
                result = e
        if self.site is not None:
            result = self.site.share(result if not isinstance(result, BaseException) else
                                     PipelineError(f"the site leader's exchange failed: {type(result).__name__}: "
                                                   f"{result}"))
        if isinstance(result, BaseException):
            raise PipelineError(f"background exchange failed: {type(result).__name__}: {result}") from result
        assert result is not None
        delta, sent = result
        self.stats.wait_s += time.perf_counter() - t0
        self._exchange.install(delta, sent)
        self.version = delta.version

    @property
    def _leads(self) -> bool:
        """This process speaks to the server (no site, or the site's leader)."""
        return self.site is None or self.site.is_leader

    def _from_leader(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the leader's pipeline thread, its result shared with the site."""
        out = self._exec.submit(fn, *args).result() if self._leads else None
        return out if self.site is None else self.site.share(out)

    def _adapt(self) -> None:
        """Feed the controller the round just finished and set the next push's density
        and coding (the background thread is idle now)."""
        m, self._measure = self._measure, None
        if m is None or not self._step_compute:
            return
        # the computation a round offers at the least H (a round that ran on offered more)
        compute = statistics.median(self._step_compute) * self._exchange.sync_every
        d = self.controller.observe(dataclasses.replace(m, compute_s=compute))
        if d.density != self.compressor.density:
            self.compressor.set_density(d.density)
        self.compressor.value_dtype = d.value_dtype
        s = self.stats
        s.up_mbps, s.down_mbps = 8e-6 * self.controller.up_bps, 8e-6 * self.controller.down_bps
        s.decisions = self.controller.decisions

    def _runs_on(self) -> bool:
        """Should the round run on (another local step, or micro-batch) instead of waiting?
        While the exchange in flight is not done and is expected (by the median of recent
        rounds) to take more than a part of a step more (update mode a tenth, gradient mode
        half): waiting that long costs less than the overshoot would. A site's ranks would
        have to agree on it every step: they do not run on."""
        if self.site is not None or self._inflight is None or self._inflight.done() or not self._exchange_times:
            return False
        step = statistics.median(self._step_compute) if self._step_compute else 0.0
        left = statistics.median(self._exchange_times) - (time.perf_counter() - self._inflight_since)
        return left > self._run_on_margin * step

    def _start_exchange(self, grads: Grads, compute_version: int) -> None:
        """Finish the exchange in flight (installing it), adapt the exchange, start the next one."""
        self._finish_inflight()
        if self._leads:
            self._adapt()
        s = self.stats
        s.density, s.value_dtype = self.compressor.density, self.compressor.value_dtype
        s.sync_every, s.accumulate = self._exchange.round_steps, self._exchange.round_batches
        if self.site is not None and self.mode == "update":  # the site's weights: the mean of its ranks'
            with torch.no_grad():
                self.site.average(p.detach() for p in self.params.values())
        grads, compute_version = self._exchange.outgoing(grads, compute_version, self.version)
        hp = self._exchange.hparams()
        changed = {k: v for k, v in hp.items() if self._sent_hparams.get(k) != v}
        self._sent_hparams = hp
        if self._leads:
            samples = self.samples_per_step * self._exchange.round_steps * self._exchange.round_batches
            self._inflight_since = time.perf_counter()
            self._inflight = self._exec.submit(self._round, grads, compute_version, self.version, changed, samples)
        self._pending = True
        self.stats.rounds += 1
        if self.staleness == 0:
            self._finish_inflight()

    # ------------------------------------------------------------------ optimizer API
    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params.values():
            p.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        if self._closed:
            raise PipelineError("step() after close()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.stats.iterations += 1
        report = self.progress.on_step(self.stats, self.client)  # timings for the next push, the progress line
        if report is not None:
            self._step_compute.append(report.compute_s)
        if self.site is not None and self.mode == "gradient":  # the site's gradient: the mean of its ranks'
            self.site.average(p.grad for p in self.params.values() if p.grad is not None)
        # update mode: the local step, a round every sync_every steps or more; gradient mode: a round,
        # or a micro-batch accumulated while the exchange in flight is far from done
        grads = self._exchange.step(self._runs_on())
        if grads is not None:
            self._start_exchange(grads, self.version)  # the version this gradient was computed on
        return loss

    def synchronize(self) -> int:
        """Finish the in-flight exchange and install it; returns the replica's version."""
        self._finish_inflight()
        return self.version

    def pull_latest(self) -> int:
        """Install everything the server has applied so far (e.g. after training). In
        update mode the server's changes are merged: local progress not sent yet stays."""
        self._finish_inflight()
        delta = self._from_leader(lambda: self._client().pull(self.version))
        self._exchange.install(delta, {})
        self.version = delta.version
        return self.version

    def _client(self) -> AnyClient:
        assert self.client is not None, "only a site's leader speaks to the server"
        return self.client

    # ------------------------------------------------------------------ worker checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The worker's own side, for a checkpoint: the inner optimizer's state and what
        was not sent yet (update mode: ``anchor - weights``; gradient mode: the
        error-feedback residuals). Finishes the exchange in flight first, so nothing is
        half-merged. The weights themselves are the server's business (and
        ``model.state_dict()``'s)."""
        self._finish_inflight()
        return {"mode": self.mode, "version": self.version, "local_steps": self._exchange.local_steps,
                "density": self.compressor.density, **self._exchange.state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` into a fresh wrapper, rebased on the server's
        current model (which may have moved on, or been restored from an older
        checkpoint): the weights become the server's model minus the saved unsent
        progress (update mode) or the server's model with the saved residuals
        (gradient mode)."""
        if state.get("mode") != self.mode:
            raise ValueError(f"a {state.get('mode')!r}-mode state cannot load into a {self.mode!r}-mode optimizer")
        self._finish_inflight()
        self._exchange.local_steps = int(state.get("local_steps", 0))
        snap = self._from_leader(lambda: self._client().pull(None))
        self._exchange.restore(state, snap)
        self.version = snap.version

    def close(self, *, flush: bool = True) -> None:
        """Finish the in-flight exchange, push what has not been sent (gradient mode:
        the residuals; update mode: the rest of the weights' change), so nothing is lost,
        leave the job and close the connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._finish_inflight()
            if flush and self._leads:
                self._exchange.prepare_flush()

                def flush_residuals():
                    rest = {n: self.compressor.flush(n) for n in self.compressor.keys()}  # noqa: SIM118 - not a dict
                    if rest:
                        self._client().push(rest, self.version, value_dtype="f32")

                self._exec.submit(flush_residuals).result()
        finally:
            if self.client is not None:
                self._exec.submit(self.client.close).result()
            self._exec.shutdown(wait=True)
            self._exchange.close()

    def __enter__(self) -> StellaOptimizer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
