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
"""
from __future__ import annotations

import logging
import statistics
import time
import weakref
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .client import Client, PullResult
from .compress import DENSE_BELOW, ErrorFeedbackCompressor, SparseGrad
from .errors import StellaError
from .modes import DEFAULT_MODE, MODES, OUTER_PRESETS, Mode
from .progress import Progress
from .protocol import IndexCoding, PullCoding, Registered, ValueDtype

log = logging.getLogger("stella.pipeline")

__all__ = ["StellaOptimizer", "PipelineError", "PipelineStats", "DensityBudget", "MODES", "OUTER_PRESETS"]

_SERVER_HPARAMS = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "betas", "eps")

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


_INNER = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def build_inner(config: Mapping[str, Any], params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The torch optimizer a config mapping (the server's names: ``{"name": "adamw", "lr": ...}``)
    describes, for update mode's local steps. ``momentum_mode`` (a server-side notion) is ignored."""
    name = str(config.get("name", "")).lower()
    if name not in _INNER:
        raise ValueError(f"unknown optimizer {config.get('name')!r}; known: {sorted(_INNER)}")
    hp = {k: (tuple(v) if k == "betas" else v) for k, v in config.items() if k not in ("name", "momentum_mode")}
    return _INNER[name](params, **hp)


class _ServerGroup(torch.optim.Optimizer):
    """One parameter group mirroring the server's optimizer; a learning-rate scheduler
    may drive it. ``step()`` does nothing: the server steps, and changed values travel
    with the next push."""

    def __init__(self, params: list[torch.nn.Parameter], hparams: dict[str, Any]):
        super().__init__(params, hparams)

    def step(self, closure=None):
        return None


def _server_defaults(config: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (tuple(v) if k == "betas" else v) for k, v in config.items() if k in _SERVER_HPARAMS}


def _host_tensor(vals: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    # pulled frames are read-only buffers; torch wants writable memory
    return torch.from_numpy(vals if vals.flags.writeable else vals.copy()).to(like.device, torch.float32)


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

    ``density``: the fraction of each tensor pushed per exchange, or ``"auto"``
    (default): a :class:`DensityBudget` from ``min_density`` up to ``max_density``,
    raised while the exchange hides behind the computation. ``method``/``dense_below``:
    the compressor. ``value_dtype`` and ``index_coding``: wire coding of pushes
    (``value_dtype`` "q4"/"q2": 4.5 or 2.5 bits a value, the quantisation error kept in
    the residual).
    ``server_key``/``client_key``: CurveZMQ keys (see :class:`~stella.client.Client`;
    or ``STELLA_SERVER_KEY``/``STELLA_CLIENT_KEY``). ``staleness``: 1 (overlapped) or 0
    (each exchange finishes inside the ``step()`` that starts it; the non-overlapped
    baseline). ``compress_in_backward`` (gradient mode): compress each gradient from
    its autograd hook.
    ``progress_every``: log a one-line summary every that many steps (0: none; see
    :mod:`stella.progress`). The timings travel with the pushes in any case.
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
        density: float | str = "auto",
        min_density: float = 0.01,
        max_density: float = 0.1,
        method: str = "threshold",
        dense_below: int = DENSE_BELOW,
        value_dtype: ValueDtype = "f16",
        index_coding: IndexCoding = "rice",
        staleness: int = 1,
        timeout: float | None = None,
        name: str = "",
        worker_id: int | None = None,
        server_key: str | None = None,
        client_key: str | None = None,
        compress_in_backward: bool = False,
        client: Client | None = None,
        progress_every: int = 0,
    ):
        mode = mode or DEFAULT_MODE
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if staleness not in (0, 1):
            raise ValueError("staleness must be 0 or 1")
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be an integer >= 1, got {sync_every!r}")
        if isinstance(density, str) and density != "auto":
            raise ValueError(f"density must be a number or 'auto', got {density!r}")
        # tensors without elements never change: nothing to exchange
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.numel() > 0]
        if not named:
            raise ValueError("model has no trainable parameters")
        params = [p for _, p in named]
        self.mode: Mode = mode
        self.inner: torch.optim.Optimizer | None = None
        if mode == "update":
            if optimizer is None:
                raise ValueError("update mode runs the optimizer on the worker: pass optimizer= a torch "
                                 "optimizer over the model's parameters or a config such as "
                                 "{'name': 'adamw', 'lr': 1e-3}")
            if compress_in_backward:
                raise ValueError("compress_in_backward is for gradient mode (update mode compresses weight changes)")
            self.inner = (optimizer if isinstance(optimizer, torch.optim.Optimizer)
                          else build_inner(optimizer, params))
            if any(not p.is_contiguous() for p in params):
                raise ValueError("update mode needs contiguous parameters")
            if isinstance(outer, str) and outer not in OUTER_PRESETS:
                raise ValueError(f"outer must be one of {sorted(OUTER_PRESETS)} or a config mapping, got {outer!r}")
            server_config: Mapping[str, Any] | None = OUTER_PRESETS[outer] if isinstance(outer, str) else outer
        else:
            if isinstance(optimizer, torch.optim.Optimizer):
                raise ValueError("gradient mode runs the optimizer on the server: pass its config as a mapping, "
                                 "or use mode='update' to step this torch optimizer on the worker")
            if sync_every != 1:
                raise ValueError("sync_every is for update mode (gradient mode exchanges every step)")
            server_config = optimizer
        self.names = [n for n, _ in named]
        self.params = dict(named)
        self.sync_every = sync_every
        self.staleness = staleness
        self.value_dtype = value_dtype
        self.index_coding = index_coding
        # block16 codes only whole blocks, which the union a pull returns need not be
        self.pull_coding: PullCoding = "rice" if index_coding == "block16" else index_coding
        self.budget: DensityBudget | None = None
        if isinstance(density, str):  # "auto", checked above
            self.budget = DensityBudget(min_density, max_density)
            density = self.budget.density
        # values are rounded to the wire dtype inside the compressor, the rounding error kept in the residual
        self.compressor = ErrorFeedbackCompressor(density, method=method, dense_below=dense_below,
                                                  value_dtype=value_dtype)
        self.stats = PipelineStats(density=float(density))
        self.progress = Progress(progress_every)
        self._last_step_end: float | None = None
        self._last_exchange_s = 0.0
        self._local_steps = 0  # update mode: inner steps since the last exchange started
        # every use of the client happens on this one thread (ZeroMQ sockets are not thread-safe)
        self._exec = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stella-pipeline")
        # an optimizer dropped without close() still lets its thread go (its Client closes its own socket)
        weakref.finalize(self, self._exec.shutdown, wait=False)
        self._inflight: Future | None = None
        self._closed = False
        self._early: dict[str, Future] = {}
        self._compress_exec: ThreadPoolExecutor | None = None

        def init() -> tuple[Registered, PullResult]:
            self.client = client or Client(address, timeout=timeout, name=name, worker_id=worker_id,
                                           server_key=server_key, client_key=client_key)
            reply = self.client.register(self.params, server_config, mode=self.mode)
            return reply, self.client.pull(None)

        try:
            reply, snap = self._exec.submit(init).result()
        except BaseException:
            self._exec.shutdown(wait=False)
            raise
        self.server_optimizer: dict[str, Any] = reply.optimizer or {}
        with torch.no_grad():
            snap.apply_to(self.params)
        self.version = snap.version  # the version of the server's model the replica (anchor) holds
        if self.inner is not None:
            # the wrapper's groups are the inner optimizer's (schedulers built on either drive the
            # local steps); `outer` mirrors the server's optimizer
            super().__init__(params, self.inner.defaults)
            self.param_groups = self.inner.param_groups
            self.state = self.inner.state
            self.outer: torch.optim.Optimizer | None = _ServerGroup(params, _server_defaults(self.server_optimizer))
            self._server_group = self.outer.param_groups[0]
            # update mode's replica of the server's model, exact (float32, flat, the parameter's device)
            self._anchor = {n: p.detach().reshape(-1).to(torch.float32, copy=True) for n, p in named}
        else:
            # the parameter group mirrors the server's optimizer, so that schedulers can edit it
            super().__init__(params, _server_defaults(self.server_optimizer))
            self.outer = None
            self._server_group = self.param_groups[0]
            if compress_in_backward:
                self._compress_exec = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stella-compress")
                for n, p in self.params.items():
                    p.register_post_accumulate_grad_hook(self._early_hook(n))
        self._sent_hparams = self._hparams()

    # ------------------------------------------------------------------ helpers
    def _early_hook(self, name: str):
        def hook(p: torch.Tensor) -> None:
            g, p.grad = p.grad, None  # this generation is handed off now
            assert g is not None and self._compress_exec is not None
            # one thread, FIFO: step t-1's compression of this key finishes before step t's starts
            self._early[name] = self._compress_exec.submit(self.compressor.compress, name, g)

        return hook

    def _hparams(self) -> dict[str, Any]:
        g = self._server_group
        return {k: (list(g[k]) if k == "betas" else g[k]) for k in _SERVER_HPARAMS if k in g}

    def _exchange(self, grads: Mapping[str, torch.Tensor | Future | None], version: int, since: int,
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
        push = self.client.push(sparse, version, value_dtype=self.value_dtype, index_coding=self.index_coding,
                                hparams=hparams or None, report=self.progress.report(), wait=False)
        pull = self.client.pull(since, wait_for=since + 1, index_coding=self.pull_coding, wait=False)
        push.result()
        delta = self._wait_step(pull.result(), since)
        self.stats.compress_s += t1 - t0
        t2 = time.perf_counter()
        self.stats.exchange_s += t2 - t1
        self._last_exchange_s = t2 - t0
        self.stats.values_pushed += sum(s.values.size for s in sparse.values())
        self.stats.values_pulled += delta.count
        return delta, sparse

    def _wait_step(self, delta: PullResult, since: int) -> PullResult:
        """The delta of the step after ``since``. The server answers a waiting pull when
        its wait expires even if no step closed (it waits for workers: before the job
        starts, or for a missing one within the step deadline); then pull again rather
        than go on, since every further push would only queue up on the server (and
        after ``--max-queued-pushes`` be refused). A snapshot (the server restarted
        from an older checkpoint) is the answer whatever its version. So is a rebased
        answer (the client reconnected while the pull waited, ``PullResult.rebased``): a
        server that restarted may have lost the push it had acknowledged, and the step
        would then wait for this worker while it waits for the step."""
        t0 = time.monotonic()
        warned = t0
        while not delta.full and delta.version <= since and not delta.rebased:
            now = time.monotonic()
            if now - warned >= 60.0:
                warned = now
                log.warning("waiting %.0f s for the server's step after version %d (the server waits for "
                            "workers; `stella status` shows which)", now - t0, since)
            delta = self.client.pull(since, wait_for=since + 1, index_coding=self.pull_coding)
        return delta

    def _finish_inflight(self) -> None:
        """Wait for the in-flight exchange and install its delta into the replica."""
        if self._inflight is None:
            return
        fut, self._inflight = self._inflight, None
        t0 = time.perf_counter()
        try:
            delta, sent = fut.result()
        except Exception as e:
            raise PipelineError(f"background exchange failed: {type(e).__name__}: {e}") from e
        self.stats.wait_s += time.perf_counter() - t0
        self._install(delta, sent)

    @torch.no_grad()
    def _install(self, delta: PullResult, sent: Mapping[str, SparseGrad]) -> None:
        """Gradient mode: the pulled values replace the replica's. Update mode: the merge
        rule, ``w <- w + (a_new - a) + c`` and ``a <- a_new`` (module doc), where ``c`` is
        what this worker sent in the exchange that just finished."""
        if self.inner is None:
            delta.apply_to(self.params)
            self.version = delta.version
            return
        for n, (idx, vals) in delta.tensors.items():
            a, w = self._anchor[n], self.params[n].detach().view(-1)
            new = _host_tensor(vals, a)
            if idx is None:
                w.add_((new - a).to(w.dtype))
                a.copy_(new)
            else:
                at = torch.from_numpy(idx.astype(np.int64)).to(a.device)
                w.index_add_(0, at, (new - a.index_select(0, at)).to(w.dtype))
                a.index_copy_(0, at, new)
        for n, sg in sent.items():
            w = self.params[n].detach().view(-1)
            c = _host_tensor(sg.values, w).to(w.dtype)
            if sg.indices is None:
                w.add_(c)
            else:
                w.index_add_(0, torch.from_numpy(sg.indices.astype(np.int64)).to(w.device), c)
        self.version = delta.version

    @torch.no_grad()
    def _load_residuals(self) -> None:
        """Update mode, main thread: each tensor's residual becomes ``a - w``, the
        pseudo-gradient not sent yet (nothing is in flight when this runs)."""
        for n, p in self.params.items():
            torch.sub(self._anchor[n], p.detach().reshape(-1), out=self.compressor.residual_buffer(n, p))

    def _start_exchange(self, grads: Mapping[str, torch.Tensor | Future | None], compute_version: int) -> None:
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
        if self.inner is not None:
            self._load_residuals()
            grads = dict.fromkeys(self.names)
            compute_version = self.version
            assert self.outer is not None
            self.outer.step()  # counts the round for a scheduler driving the outer group
        hp = self._hparams()
        changed = {k: v for k, v in hp.items() if self._sent_hparams.get(k) != v}
        self._sent_hparams = hp
        self._inflight = self._exec.submit(self._exchange, grads, compute_version, self.version, changed)
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
        if self.inner is not None:
            self.inner.step()  # the local step, dense, on this worker's gradient
            self._local_steps += 1
            if self._local_steps >= self.sync_every:
                self._local_steps = 0
                self._start_exchange({}, self.version)
            return loss
        grads: dict[str, torch.Tensor | Future | None] = dict(self._early)  # compressions started in backward
        self._early = {}
        for n, p in self.params.items():
            if p.grad is not None:
                grads[n] = p.grad
                p.grad = None  # this generation is now in flight; backward makes a new one
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
        delta = self._exec.submit(self.client.pull, self.version).result()
        self._install(delta, {})
        return self.version

    # ------------------------------------------------------------------ worker checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The worker's own side, for a checkpoint: the inner optimizer's state and what
        was not sent yet (update mode: ``anchor - weights``; gradient mode: the
        error-feedback residuals). Finishes the exchange in flight first, so nothing is
        half-merged. The weights themselves are the server's business (and
        ``model.state_dict()``'s)."""
        self._finish_inflight()
        out: dict[str, Any] = {"mode": self.mode, "version": self.version, "local_steps": self._local_steps,
                               "density": self.compressor.density}
        if self.inner is not None:
            out["inner"] = self.inner.state_dict()
            out["unsent"] = {n: (a - self.params[n].detach().reshape(-1).float()).cpu()
                             for n, a in self._anchor.items()}
        else:
            out["residuals"] = {n: self.compressor.residual(n).detach().cpu().clone() for n in self.compressor.keys()}  # noqa: SIM118
        return out

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` into a fresh wrapper, rebased on the server's
        current model (which may have moved on, or been restored from an older
        checkpoint): the weights become the server's model minus the saved unsent
        progress (update mode) or the server's model with the saved residuals
        (gradient mode)."""
        if state.get("mode") != self.mode:
            raise ValueError(f"a {state.get('mode')!r}-mode state cannot load into a {self.mode!r}-mode optimizer")
        self._finish_inflight()
        unsent = None
        if self.inner is not None:
            unsent = {n: state["unsent"][n].to(a.device, torch.float32).reshape(-1) for n, a in self._anchor.items()}
            self.inner.load_state_dict(state["inner"])
        else:
            for n, r in state.get("residuals", {}).items():
                p = self.params[n]
                self.compressor.residual_buffer(n, p).copy_(r.reshape(-1).to(p.device, torch.float32))
        self._local_steps = int(state.get("local_steps", 0))
        if self.budget is None and "density" in state:
            self.compressor.set_density(float(state["density"]))
        snap = self._exec.submit(self.client.pull, None).result()
        snap.apply_to(self.params)
        self.version = snap.version
        if unsent is not None:
            for n, p in self.params.items():
                a = self._anchor[n]
                a.copy_(p.detach().reshape(-1))
                p.detach().view(-1).copy_((a - unsent[n]).to(p.dtype))

    def close(self, *, flush: bool = True) -> None:
        """Finish the in-flight exchange, push what has not been sent (gradient mode:
        the residuals; update mode: the rest of the weights' change), so nothing is lost,
        leave the job and close the connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._finish_inflight()
            if flush:
                if self.inner is not None:
                    self._load_residuals()

                def flush_residuals():
                    rest = {n: self.compressor.flush(n) for n in self.compressor.keys()}  # noqa: SIM118 - not a dict
                    if rest:
                        self.client.push(rest, self.version, value_dtype="f32")

                self._exec.submit(flush_residuals).result()
        finally:
            self._exec.submit(self.client.close).result()
            self._exec.shutdown(wait=True)
            if self._compress_exec is not None:
                self._compress_exec.shutdown(wait=True)

    def __enter__(self) -> StellaOptimizer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
