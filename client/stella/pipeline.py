"""The one-step-stale training pipeline: a drop-in optimizer for any ``torch.nn.Module``.

The training script keeps its loop::

    opt = stella.StellaOptimizer(model, "tcp://ps-host:5555", optimizer={"name": "adamw", "lr": 1e-3})
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    opt.close()

``step()`` hands iteration ``t``'s gradient to a background thread and returns at
once; the thread compresses it (top-k with error feedback), pushes it, waits for the
server to close the step and pulls the delta. The next ``step()`` first installs that
delta. So the forward/backward of iteration ``t`` runs on weights that include
updates ``0..t-2``: exactly one step stale, and communication of step ``t-1`` overlaps
the computation of step ``t``.

Gradients are double-buffered without copies: ``step()`` takes the ``.grad`` tensors
autograd just produced (they become the in-flight generation) and leaves ``.grad``
unset, so the next backward writes a fresh generation while the previous one is being
compressed.

The wrapper is a ``torch.optim.Optimizer`` with one parameter group whose
hyper-parameters mirror the server's optimizer: a learning-rate scheduler (or any code
that edits ``param_groups[0]``) keeps working; changes travel with the next push and
apply from the step it joins. Errors in the background thread are raised from the next ``step()``,
``synchronize()`` or ``close()``, never swallowed.
"""
from __future__ import annotations

import statistics
import time
import weakref
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from .client import Client, PullResult
from .compress import DENSE_BELOW, ErrorFeedbackCompressor
from .errors import StellaError
from .protocol import IndexCoding, PullCoding, Registered, ValueDtype

__all__ = ["StellaOptimizer", "PipelineError", "PipelineStats", "DensityBudget"]

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
    iterations: int = 0
    wait_s: float = 0.0  # time step() spent blocked on the previous exchange
    compress_s: float = 0.0
    exchange_s: float = 0.0  # push + waiting for the step + pull, in the background
    values_pushed: int = 0
    values_pulled: int = 0
    density: float = 0.0  # the compressor's density for the latest push


class StellaOptimizer(torch.optim.Optimizer):
    """One-step-stale data-parallel training through ``stella-ps`` (see module doc).

    ``model``: any module; every parameter with ``requires_grad`` is registered under
    its ``named_parameters`` name. ``optimizer``: the server-side optimizer config
    (None: the server's default, ``stella-ps --optimizer``).
    ``density``: the fraction of each tensor pushed per step, or ``"auto"`` (default):
    a :class:`DensityBudget` from ``min_density`` up to ``max_density``, raised while the
    exchange hides behind the computation. ``method``/``dense_below``: the compressor. ``value_dtype`` and
    ``index_coding``: wire coding of pushes. ``server_key``/``client_key``: CurveZMQ
    keys (see :class:`~stella.client.Client`; or ``STELLA_SERVER_KEY``/``STELLA_CLIENT_KEY``).
    ``staleness``: 1 (pipelined) or 0 (push,
    wait and install inside ``step()``; the non-overlapped baseline). One step of
    staleness suited the SGD models measured but stalled an AdamW Transformer (see
    bench/RESULTS.md and the README): check it against ``staleness=0`` for a new model.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        address: str,
        *,
        optimizer: Mapping[str, Any] | None = None,
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
    ):
        if staleness not in (0, 1):
            raise ValueError("staleness must be 0 or 1")
        # tensors without elements never change: nothing to exchange
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.numel() > 0]
        if not named:
            raise ValueError("model has no trainable parameters")
        self.names = [n for n, _ in named]
        self.params = dict(named)
        self.staleness = staleness
        self.value_dtype = value_dtype
        self.index_coding = index_coding
        # block16 codes only whole blocks, which the union a pull returns need not be
        self.pull_coding: PullCoding = "rice" if index_coding == "block16" else index_coding
        self.budget: DensityBudget | None = None
        if density == "auto":
            self.budget = DensityBudget(min_density, max_density)
            density = self.budget.density
        elif isinstance(density, str):
            raise ValueError(f"density must be a number or 'auto', got {density!r}")
        # values are rounded to the wire dtype inside the compressor, the rounding error kept in the residual
        self.compressor = ErrorFeedbackCompressor(density, method=method, dense_below=dense_below,
                                                  value_dtype=value_dtype)
        self.stats = PipelineStats(density=float(density))
        self._last_step_end: float | None = None
        self._last_exchange_s = 0.0
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
            reply = self.client.register(self.params, optimizer)
            return reply, self.client.pull(None)

        try:
            reply, snap = self._exec.submit(init).result()
        except BaseException:
            self._exec.shutdown(wait=False)
            raise
        self.server_optimizer: dict[str, Any] = reply.optimizer or {}
        # the parameter group mirrors the server's optimizer, so that schedulers can edit it
        defaults = {k: (tuple(v) if k == "betas" else v) for k, v in self.server_optimizer.items()
                    if k in _SERVER_HPARAMS}
        super().__init__([p for _, p in named], defaults)
        if compress_in_backward:
            self._compress_exec = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stella-compress")
            for n, p in self.params.items():
                p.register_post_accumulate_grad_hook(self._early_hook(n))
        with torch.no_grad():
            snap.apply_to(self.params)
        self.version = snap.version  # the version the local replica holds
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
        g = self.param_groups[0]
        return {k: (list(g[k]) if k == "betas" else g[k]) for k in _SERVER_HPARAMS if k in g}

    def _exchange(self, grads: dict[str, torch.Tensor | Future], version: int, since: int,
                  hparams: dict | None) -> PullResult:
        """Background thread: compress, push, wait for the step, pull the delta."""
        t0 = time.perf_counter()
        sparse = {n: g.result() if isinstance(g, Future) else self.compressor.compress(n, g)
                  for n, g in grads.items()}
        t1 = time.perf_counter()
        # a changed learning rate (or other hyper-parameter) rides on the push: it applies
        # from the step this push joins, with no round trip of its own
        push = self.client.push(sparse, version, value_dtype=self.value_dtype, index_coding=self.index_coding,
                                hparams=hparams or None, wait=False)
        pull = self.client.pull(since, wait_for=since + 1, index_coding=self.pull_coding, wait=False)
        push.result()
        delta = pull.result()
        self.stats.compress_s += t1 - t0
        t2 = time.perf_counter()
        self.stats.exchange_s += t2 - t1
        self._last_exchange_s = t2 - t0
        self.stats.values_pushed += sum(s.values.size for s in sparse.values())
        self.stats.values_pulled += delta.count
        return delta

    def _finish_inflight(self) -> None:
        """Wait for the in-flight exchange and install its delta into the replica."""
        if self._inflight is None:
            return
        fut, self._inflight = self._inflight, None
        t0 = time.perf_counter()
        try:
            delta = fut.result()
        except Exception as e:
            raise PipelineError(f"background exchange failed: {type(e).__name__}: {e}") from e
        self.stats.wait_s += time.perf_counter() - t0
        with torch.no_grad():
            delta.apply_to(self.params)
        self.version = delta.version

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
        grads: dict[str, torch.Tensor | Future] = dict(self._early)  # compressions started in backward
        self._early = {}
        for n, p in self.params.items():
            if p.grad is not None:
                grads[n] = p.grad
                p.grad = None  # this generation is now in flight; backward makes a new one
        compute_version = self.version  # the weights this gradient was computed on
        entered = time.perf_counter()
        had_inflight = self._inflight is not None
        self._finish_inflight()  # install update t-1: the next forward sees 0..t-1
        if self.budget is not None and had_inflight and self._last_step_end is not None:
            # the exchange just finished ran alongside the computation between the two step() calls
            density = self.budget.observe(entered - self._last_step_end, self._last_exchange_s)
            if density != self.compressor.density:
                self.compressor.set_density(density)  # safe: the background thread is idle now
        self.stats.density = self.compressor.density
        hp = self._hparams()
        changed = {k: v for k, v in hp.items() if self._sent_hparams.get(k) != v}
        self._sent_hparams = hp
        self._inflight = self._exec.submit(self._exchange, grads, compute_version, self.version, changed)
        self.stats.iterations += 1
        if self.staleness == 0:
            self._finish_inflight()
        self._last_step_end = time.perf_counter()
        return loss

    def synchronize(self) -> int:
        """Finish the in-flight exchange and install it; returns the replica's version."""
        self._finish_inflight()
        return self.version

    def pull_latest(self) -> int:
        """Install everything the server has applied so far (e.g. after training)."""
        self._finish_inflight()
        delta = self._exec.submit(self.client.pull, self.version).result()
        with torch.no_grad():
            delta.apply_to(self.params)
        self.version = delta.version
        return self.version

    def close(self, *, flush: bool = True) -> None:
        """Finish the in-flight exchange, push what is left in the residuals (so no
        gradient mass is lost), leave the job and close the connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._finish_inflight()
            if flush:
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
