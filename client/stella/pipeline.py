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

import logging
import statistics
import time
import warnings
import weakref
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

import torch

from ._exchange import Grads, build_inner, exchange_for
from .client import Client, PullResult
from .compress import DENSE_BELOW, METHODS, VALUE_DTYPES, ErrorFeedbackCompressor, SparseGrad
from .errors import StellaError
from .modes import DEFAULT_MODE, MODES, OUTER_PRESETS, Mode
from .progress import Progress
from .protocol import IndexCoding, PullCoding, Registered, ValueDtype
from .site import Site, resolve_group

log = logging.getLogger("stella.pipeline")

__all__ = ["StellaOptimizer", "Compression", "PipelineError", "PipelineStats", "DensityBudget", "MODES",
           "OUTER_PRESETS", "build_inner"]


class PipelineError(StellaError):
    """The background exchange failed; the cause is chained (``__cause__``)."""


class DensityBudget:
    """``density="auto"``: spend the link time that the computation hides, never less
    than ``floor``.

    With one step of staleness the exchange of step ``t`` (compress, push, the server's
    step, pull) runs while the model computes step ``t+1``; it costs nothing as long as
    it ends first. The budget compares the median exchange time ``x`` with the median
    compute time ``c`` (what the training loop does between two ``step()`` calls) over
    the last ``window`` steps: below ``fill / step`` of ``c`` the density grows by
    ``step`` (up to ``ceiling``), above ``fill`` of ``c`` it shrinks by ``step`` (down to
    ``floor``). After a change the window restarts, so every decision is taken on
    measurements at the current density. A denser push delivers more of the gradient
    per step, which error feedback would otherwise deliver steps later; below ``floor``
    the iterations needed grow faster than the time per iteration falls, so a link too
    slow for ``floor`` is left to show as waiting.
    """

    def __init__(self, floor: float = 0.01, ceiling: float = 0.1, *, fill: float = 0.8, step: float = 1.25,
                 window: int = 4):
        if not 0.0 < floor <= ceiling <= 1.0:
            raise ValueError(f"need 0 < floor <= ceiling <= 1, got floor={floor}, ceiling={ceiling}")
        if not 0.0 < fill <= 1.0 or step <= 1.0 or window < 1:
            raise ValueError("need 0 < fill <= 1, step > 1, window >= 1")
        self.floor, self.ceiling, self.fill, self.step, self.window = floor, ceiling, fill, step, window
        self.density = floor
        self._compute: deque[float] = deque(maxlen=window)
        self._exchange: deque[float] = deque(maxlen=window)

    def observe(self, compute_s: float, exchange_s: float) -> float:
        """Record one step's compute and exchange time; returns the density for the next push."""
        self._compute.append(compute_s)
        self._exchange.append(exchange_s)
        if len(self._exchange) < self.window:
            return self.density
        c, x = statistics.median(self._compute), statistics.median(self._exchange)
        new = self.density
        if x * self.step < self.fill * c:
            new = min(self.ceiling, self.density * self.step)
        elif x > self.fill * c:
            new = max(self.floor, self.density / self.step)
        if new != self.density:
            self.density = new
            self._compute.clear()
            self._exchange.clear()
        return self.density


@dataclass(frozen=True)
class Compression:
    """How :class:`StellaOptimizer` compresses its pushes (``docs/compression.md``).

    ``density``: the fraction of each tensor pushed per exchange, or ``"auto"``
    (default): a :class:`DensityBudget` from ``min_density`` up to ``max_density``,
    raised while the exchange hides behind the computation. ``method`` ("threshold",
    "block", "exact" or "dense") and ``dense_below`` (smaller tensors go dense): the
    compressor, :mod:`stella.compress`. ``value_dtype`` and ``index_coding``: the wire
    coding of pushes (``value_dtype`` "q4"/"q2": 4.5 or 2.5 bits a value, the
    quantisation error kept in the residual).
    """

    density: float | Literal["auto"] = "auto"
    min_density: float = 0.01
    max_density: float = 0.1
    method: str = "threshold"
    dense_below: int = DENSE_BELOW
    value_dtype: ValueDtype = "f16"
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
        if self.value_dtype not in VALUE_DTYPES:
            raise ValueError(f"value_dtype must be one of {VALUE_DTYPES}, got {self.value_dtype!r}")
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


def _wait_for_step(client: Client, delta: PullResult, since: int, coding: PullCoding) -> PullResult:
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

    ``model``: any module; every parameter with ``requires_grad`` is registered under
    its ``named_parameters`` name.

    ``optimizer``: update mode: the worker's optimizer, a ``torch.optim.Optimizer`` over
    the model's parameters or a config mapping (``{"name": "adamw", "lr": 1e-3, ...}``)
    to build one. Gradient mode: the server's optimizer config (None: the server's
    default, ``stella-ps --optimizer``).
    ``mode``: "update" (default) or "gradient". ``outer``: update mode's server-side
    optimizer, "average" (default), "nesterov" or a config mapping.
    ``sync_every``: update mode's local steps per exchange (H; 1 = every step).

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
        address: str,
        *,
        optimizer: torch.optim.Optimizer | Mapping[str, Any] | None = None,
        mode: Mode | None = None,
        outer: str | Mapping[str, Any] = "average",
        sync_every: int = 1,
        compression: Compression | None = None,
        staleness: int = 1,
        timeout: float | None = None,
        name: str = "",
        worker_id: int | None = None,
        server_key: str | None = None,
        client_key: str | None = None,
        compress_in_backward: bool = False,
        client: Client | None = None,
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
        # tensors without elements never change: nothing to exchange
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad and p.numel() > 0}
        if not self.params:
            raise ValueError("model has no trainable parameters")
        self.mode: Mode = mode
        self.staleness = staleness
        # block16 codes only whole blocks, which the union a pull returns need not be
        self.pull_coding: PullCoding = "rice" if c.index_coding == "block16" else c.index_coding
        self.budget: DensityBudget | None = None
        density = c.density
        if isinstance(density, str):  # "auto"
            self.budget = DensityBudget(c.min_density, c.max_density)
            density = self.budget.density
        # values are rounded to the wire dtype inside the compressor, the rounding error kept in the residual
        self.compressor = ErrorFeedbackCompressor(density, method=c.method, dense_below=c.dense_below,
                                                  value_dtype=c.value_dtype)
        self._exchange = exchange_for(mode, self.params, self.compressor, optimizer, outer, sync_every=sync_every,
                                      compress_in_backward=compress_in_backward)
        group = resolve_group(process_group)
        self.site: Site | None = Site(group) if group is not None else None
        if self.site is not None and compress_in_backward:
            raise ValueError("compress_in_backward compresses each rank's own gradient: a site averages them first")
        leader = self.site is None or self.site.is_leader
        self.stats = PipelineStats(density=float(density))
        self.progress = Progress(progress_every)
        self._last_step_end: float | None = None
        self._last_exchange_s = 0.0
        # every use of the client happens on this one thread (ZeroMQ sockets are not thread-safe)
        self._exec = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stella-pipeline")
        # an optimizer dropped without close() still lets its thread go (its Client closes its own socket)
        weakref.finalize(self, self._exec.shutdown, wait=False)
        self._inflight: Future | None = None  # the leader's exchange in flight
        self._pending = False  # a round is in flight (on every rank of a site)
        self._closed = False
        self.client: Client | None = None  # the leader's (a site's other ranks never connect)

        def init() -> tuple[Registered, PullResult]:
            self.client = client or Client(address, timeout=timeout, name=name, worker_id=worker_id,
                                           server_key=server_key, client_key=client_key)
            reply = self.client.register(self.params, self._exchange.server_config, mode=self.mode)
            return reply, self.client.pull(None)

        start: tuple[dict[str, Any], int] | None = None
        if leader:
            try:
                reply, snap = self._exec.submit(init).result()
            except BaseException:
                self._exec.shutdown(wait=False)
                raise
            with torch.no_grad():
                snap.apply_to(self.params)
            start = (reply.optimizer or {}, snap.version)
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
    def _round(self, grads: Grads, version: int, since: int,
               hparams: dict | None) -> tuple[PullResult, dict[str, SparseGrad]]:
        """Background thread: compress (a gradient, an early compression's future, or,
        for None, the residual as the update mode left it), push, wait for the step,
        pull the delta."""
        t0 = time.perf_counter()
        sparse = {n: g.result() if isinstance(g, Future) else self.compressor.compress(n, g)
                  for n, g in grads.items()}
        t1 = time.perf_counter()
        # a changed learning rate (or other hyper-parameter) rides on the push: it applies
        # from the step this push joins, with no round trip of its own
        client = self._client()
        push = client.push(sparse, version, value_dtype=self.compression.value_dtype,
                                index_coding=self.compression.index_coding, hparams=hparams or None,
                                report=self.progress.report(), wait=False)
        pull = client.pull(since, wait_for=since + 1, index_coding=self.pull_coding, wait=False)
        push.result()
        delta = _wait_for_step(client, pull.result(), since, self.pull_coding)
        self.stats.compress_s += t1 - t0
        t2 = time.perf_counter()
        self.stats.exchange_s += t2 - t1
        self._last_exchange_s = t2 - t0
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

    def _start_exchange(self, grads: Grads, compute_version: int) -> None:
        """Finish the exchange in flight (installing it), adapt the density, start the next one."""
        entered = time.perf_counter()
        had_inflight = self._inflight is not None
        self._finish_inflight()
        if self.budget is not None and had_inflight and self._last_step_end is not None:
            # the exchange just finished ran alongside the computation since the last one started
            density = self.budget.observe(entered - self._last_step_end, self._last_exchange_s)
            if density != self.compressor.density:
                self.compressor.set_density(density)  # safe: the background thread is idle now
        self.stats.density = self.compressor.density
        if self.site is not None and self.mode == "update":  # the site's weights: the mean of its ranks'
            with torch.no_grad():
                self.site.average(p.detach() for p in self.params.values())
        grads, compute_version = self._exchange.outgoing(grads, compute_version, self.version)
        hp = self._exchange.hparams()
        changed = {k: v for k, v in hp.items() if self._sent_hparams.get(k) != v}
        self._sent_hparams = hp
        if self._leads:
            self._inflight = self._exec.submit(self._round, grads, compute_version, self.version, changed)
        self._pending = True
        self.stats.rounds += 1
        if self.staleness == 0:
            self._finish_inflight()
        self._last_step_end = time.perf_counter()

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
        self.progress.on_step(self.stats, self.client)  # timings for the next push, the progress line
        if self.site is not None and self.mode == "gradient":  # the site's gradient: the mean of its ranks'
            self.site.average(p.grad for p in self.params.values() if p.grad is not None)
        grads = self._exchange.step()  # update mode: the local step; a round every sync_every steps
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

    def _client(self) -> Client:
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
        if self.budget is None and "density" in state:
            self.compressor.set_density(float(state["density"]))
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
