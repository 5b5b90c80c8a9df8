"""The two training modes' halves of :class:`~stella.StellaOptimizer`, one class each.

An exchange owns its mode's state and answers the mode's questions: which settings it
takes (its constructor checks them), what ``step()`` does, what a round pushes, what a
site's ranks average and when, how the server's answer is installed, what ``close()``
flushes, what a worker checkpoint holds, which codings its pushes may take, and which
parameter groups the wrapper shows (``groups``) and which mirror the server's optimizer
(``server``). It owns the error-feedback compressor (its residuals are the mode's
state). :class:`~stella.StellaOptimizer` composes one with the rounds
(:mod:`stella._rounds`) and the site (:mod:`stella.site`).

:class:`_UpdateExchange`: the worker steps its own (inner) optimizer; a round pushes
the weights' change since the server's model (the residual ``anchor - weights``); the
server's answer is merged by ``w <- w + (a_new - a) + c``, ``a <- a_new``. The
wrapper's groups are the inner optimizer's; ``outer`` mirrors the server's outer step.

:class:`_GradientExchange`: a round pushes the gradient (plus the error-feedback
residual); the server's values replace the replica's. The wrapper's own group mirrors
the server's optimizer.
"""
from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from .client import PullResult
from .codec import CODINGS
from .compress import ErrorFeedbackCompressor, SparseGrad
from .modes import MODES, OUTER_PRESETS
from .options import Compression, Sync
from .protocol import ValueDtype

__all__ = ["build_inner", "exchange_for", "Grads"]

# What a round hands the background thread per tensor: a gradient, a compression
# already started (a future of its SparseGrad), or None (the residual as it stands).
Grads = dict[str, torch.Tensor | Future[SparseGrad] | None]

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


def _host_tensor(vals: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    # pulled frames are read-only buffers; torch wants writable memory
    return torch.from_numpy(vals if vals.flags.writeable else vals.copy()).to(like.device, torch.float32)


def _indices(idx: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(idx.astype(np.int64)).to(device)


class _Exchange:
    """What both modes share: the parameters, the compressor, and the mirror of the
    server's optimizer (``server``), whose changed hyper-parameters ride on the next push."""

    mode: str
    inner: torch.optim.Optimizer | None = None
    outer: torch.optim.Optimizer | None = None
    groups: torch.optim.Optimizer  # the optimizer whose param_groups (and state) the wrapper shows
    server: torch.optim.Optimizer  # its one group mirrors the server's optimizer
    server_config: Mapping[str, Any] | None  # what to register with

    sync_every = 1  # the least local steps a round makes (update mode's H)
    codings: tuple[ValueDtype, ...]  # the codings the controller may give its pushes, best first
    # how much of a step the exchange in flight must still take for a round to run on (Rounds.runs_on)
    run_on_margin: float

    def __init__(self, params: dict[str, torch.nn.Parameter], compression: Compression):
        self.params = params
        c = compression
        # the controller's first candidate (stella.adapt): the density pinned or its ceiling, the best coding;
        # values are rounded to the wire coding inside the compressor, the rounding error kept in the residual
        self.compressor = ErrorFeedbackCompressor(
            c.max_density if c.density == "auto" else float(c.density), method=c.method, dense_below=0,
            value_dtype=self.codings[0] if c.value_dtype == "auto" else c.value_dtype)
        self.local_steps = 0  # update mode: inner steps since the last exchange started
        # the round step() just ended: its local steps (update mode) and the micro-batches its
        # gradient averages (gradient mode); the samples it represents are their product
        self.round_steps = 1
        self.round_batches = 1
        self._hparam_names: list[str] = []  # the server's, from its answer to the registration

    def attach(self, server_optimizer: Mapping[str, Any]) -> None:
        """After the registration, with the replica holding the server's model: set up
        the groups (``server_optimizer``: the config the server answered with)."""
        raise NotImplementedError

    def _mirror(self, server_optimizer: Mapping[str, Any]) -> _ServerGroup:
        """A group mirroring the server's optimizer, its names taken from the config the server
        answered with (every key but "name"), never copied from the server's code. A param_group
        is a plain dict, so it holds the server-only string ``momentum_mode`` too, and the server
        takes every name it answered with as a change: none is left out. Schedulers touch only
        the keys they know (lr, momentum, betas). Lists (``betas``) are tuples there, as torch's
        own optimizers keep them."""
        hparams = {k: (tuple(v) if isinstance(v, list) else v) for k, v in server_optimizer.items() if k != "name"}
        self._hparam_names = list(hparams)
        return _ServerGroup(list(self.params.values()), hparams)

    def hparams(self) -> dict[str, Any]:
        """The server's hyper-parameters as the mirror holds them now (a scheduler may have moved them)."""
        g = self.server.param_groups[0]
        return {k: (list(g[k]) if isinstance(g[k], tuple) else g[k]) for k in self._hparam_names if k in g}

    def average_step(self, site: Any) -> None:
        """Every ``step()``, before :meth:`step`: what a site's ranks average then (nothing)."""

    def average_round(self, site: Any) -> None:
        """At the start of a round, before :meth:`outgoing`: what a site's ranks average then (nothing)."""

    def step(self, run_on: bool = False) -> Grads | None:
        """The training loop's ``step()``: what the round to start now pushes, or None (no
        round). ``run_on``: the exchange in flight is far from done, so the round may go
        on (a local step more, or a micro-batch more) up to its bound."""
        raise NotImplementedError

    def outgoing(self, grads: Grads, computed_on: int, version: int) -> tuple[Grads, int]:
        """With the previous round installed (the replica at ``version``): what this round
        pushes, and the version it was computed on."""
        return grads, computed_on

    def install(self, delta: PullResult, sent: Mapping[str, SparseGrad]) -> None:
        """Install the server's answer to the round that sent ``sent``."""
        raise NotImplementedError

    def prepare_flush(self) -> None:
        """Before ``close()`` pushes what was not sent: make the compressor's residuals whole."""

    def state(self) -> dict[str, Any]:
        """This mode's part of a worker checkpoint."""
        raise NotImplementedError

    def restore(self, state: Mapping[str, Any], snap: PullResult) -> None:
        """Load :meth:`state` on top of the server's current model ``snap`` (a snapshot)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class _UpdateExchange(_Exchange):
    mode = "update"
    inner: torch.optim.Optimizer
    outer: torch.optim.Optimizer
    codings = CODINGS
    run_on_margin = 0.1  # a local step more costs little

    def __init__(self, params: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer | Mapping[str, Any] |
                 None, outer: str | Mapping[str, Any], compression: Compression, sync: Sync, site: Any):
        if optimizer is None:
            raise ValueError("update mode runs the optimizer on the worker: pass optimizer= a torch "
                             "optimizer over the model's parameters or a config such as "
                             "{'name': 'adamw', 'lr': 1e-3}")
        if sync.compress_in_backward:
            raise ValueError("compress_in_backward is for gradient mode (update mode compresses weight changes)")
        if sync.max_accumulate > 1:
            raise ValueError("max_accumulate is for gradient mode without compress_in_backward (update mode runs on "
                             "with local steps instead: Sync(max_every=...))")
        super().__init__(params, compression)
        self.inner = (optimizer if isinstance(optimizer, torch.optim.Optimizer)
                      else build_inner(optimizer, list(params.values())))
        if any(not p.is_contiguous() for p in params.values()):
            raise ValueError("update mode needs contiguous parameters")
        if isinstance(outer, str) and outer not in OUTER_PRESETS:
            raise ValueError(f"outer must be one of {sorted(OUTER_PRESETS)} or a config mapping, got {outer!r}")
        self.server_config = OUTER_PRESETS[outer] if isinstance(outer, str) else outer
        self.sync_every = sync.every
        self.max_sync_every = 4 * sync.every if sync.max_every is None else sync.max_every
        self.round_steps = sync.every
        self.anchor: dict[str, torch.Tensor] = {}

    def average_round(self, site: Any) -> None:
        """The site's weights: the mean of its ranks'."""
        with torch.no_grad():
            site.average(p.detach() for p in self.params.values())

    def attach(self, server_optimizer: Mapping[str, Any]) -> None:
        # the wrapper's groups are the inner optimizer's (schedulers built on either drive the
        # local steps); `outer` mirrors the server's optimizer
        self.groups = self.inner
        self.outer = self.server = self._mirror(server_optimizer)
        # the replica of the server's model, exact (float32, flat, the parameter's device)
        self.anchor = {n: p.detach().reshape(-1).to(torch.float32, copy=True) for n, p in self.params.items()}

    def step(self, run_on: bool = False) -> Grads | None:
        self.inner.step()  # the local step, dense, on this worker's gradient
        self.local_steps += 1
        if self.local_steps < self.sync_every or (run_on and self.local_steps < self.max_sync_every):
            return None
        self.round_steps, self.local_steps = self.local_steps, 0
        return {}

    def outgoing(self, grads: Grads, computed_on: int, version: int) -> tuple[Grads, int]:
        self._load_residuals()
        self.outer.step()  # counts the round for a scheduler driving the outer group
        return dict.fromkeys(self.params), version  # the residuals as they stand, on the installed version

    @torch.no_grad()
    def _load_residuals(self) -> None:
        """Each tensor's residual becomes ``a - w``, the pseudo-gradient not sent yet
        (nothing is in flight when this runs)."""
        for n, p in self.params.items():
            torch.sub(self.anchor[n], p.detach().reshape(-1), out=self.compressor.residual_buffer(n, p))

    @torch.no_grad()
    def install(self, delta: PullResult, sent: Mapping[str, SparseGrad]) -> None:
        """The merge rule, ``w <- w + (a_new - a) + c`` and ``a <- a_new`` (pipeline's
        module doc), where ``c`` is what this worker sent in the round that just finished.
        The anchor's new values are installed (exact pulls, snapshots) or added, step
        after step (the broadcast: then the anchor equals the server's broadcast model)."""
        for n, (idx, vals) in delta.tensors.items():
            a, w = self.anchor[n], self.params[n].detach().view(-1)
            new = _host_tensor(vals, a)
            if idx is None:
                w.add_((new - a).to(w.dtype))
                a.copy_(new)
            else:
                at = _indices(idx, a.device)
                w.index_add_(0, at, (new - a.index_select(0, at)).to(w.dtype))
                a.index_copy_(0, at, new)
        for step in delta.steps:
            for n, (idx, vals) in delta.per_name(step).items():
                a, w = self.anchor[n], self.params[n].detach().view(-1)
                inc = _host_tensor(vals, a)
                if idx is None:
                    before = a.clone()
                    a.add_(inc)
                    w.add_((a - before).to(w.dtype))
                else:
                    at = _indices(idx, a.device)
                    before = a.index_select(0, at)
                    a.index_add_(0, at, inc)
                    w.index_add_(0, at, (a.index_select(0, at) - before).to(w.dtype))
        for n, sg in sent.items():
            w = self.params[n].detach().view(-1)
            c = _host_tensor(sg.values, w).to(w.dtype)
            if sg.indices is None:
                w.add_(c)
            else:
                w.index_add_(0, _indices(sg.indices, w.device), c)

    def prepare_flush(self) -> None:
        self._load_residuals()

    def state(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(),
                "unsent": {n: (a - self.params[n].detach().reshape(-1).float()).cpu() for n, a in self.anchor.items()}}

    @torch.no_grad()
    def restore(self, state: Mapping[str, Any], snap: PullResult) -> None:
        """The weights become the server's model minus the saved unsent progress."""
        unsent = {n: state["unsent"][n].to(a.device, torch.float32).reshape(-1) for n, a in self.anchor.items()}
        self.inner.load_state_dict(state["inner"])
        snap.apply_to(self.params)
        for n, p in self.params.items():
            a = self.anchor[n]
            a.copy_(p.detach().reshape(-1))
            p.detach().view(-1).copy_((a - unsent[n]).to(p.dtype))


class _GradientExchange(_Exchange):
    mode = "gradient"
    run_on_margin = 0.5  # a micro-batch more changes the server's step

    def __init__(self, params: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer | Mapping[str, Any] |
                 None, compression: Compression, sync: Sync, site: Any):
        if isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError("gradient mode runs the optimizer on the server: pass its config as a mapping, "
                             "or use mode='update' to step this torch optimizer on the worker")
        if sync.every != 1 or sync.max_every not in (None, 1):
            raise ValueError("Sync(every=, max_every=) are for update mode (gradient mode exchanges every step)")
        if sync.compress_in_backward and (sync.max_accumulate > 1 or site.size > 1):
            raise ValueError("compress_in_backward compresses each rank's own gradient as backward makes it: a "
                             "site's ranks average theirs first, and max_accumulate sums micro-batches first")
        # its pushes feed the server's optimizer (momentum, Adam) directly: 2-bit values made its steps erratic
        # on digits (tests/test_convergence.py), so it stops at q4; compressions started in backward run on their
        # own thread, so their coding cannot change
        self.codings = CODINGS[:1] if sync.compress_in_backward else CODINGS[:2]
        super().__init__(params, compression)
        self.server_config = optimizer
        self._compress_in_backward = sync.compress_in_backward
        self.max_accumulate = sync.max_accumulate
        self._acc: dict[str, torch.Tensor] = {}  # the micro-batches' gradients summed so far
        self._acc_batches = 0
        self._early: dict[str, Future[SparseGrad]] = {}
        self._compress_exec: ThreadPoolExecutor | None = None

    def attach(self, server_optimizer: Mapping[str, Any]) -> None:
        # the wrapper's group mirrors the server's optimizer, so that schedulers can edit it
        self.groups = self.server = self._mirror(server_optimizer)
        if self._compress_in_backward:
            self._compress_exec = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stella-compress")
            for n, p in self.params.items():
                p.register_post_accumulate_grad_hook(self._early_hook(n))

    def _early_hook(self, name: str):
        def hook(p: torch.Tensor) -> None:
            g, p.grad = p.grad, None  # this generation is handed off now
            assert g is not None and self._compress_exec is not None
            # one thread, FIFO: step t-1's compression of this key finishes before step t's starts
            self._early[name] = self._compress_exec.submit(self.compressor.compress, name, g)

        return hook

    def average_step(self, site: Any) -> None:
        """The site's gradient: the mean of its ranks'."""
        site.average(p.grad for p in self.params.values() if p.grad is not None)

    def step(self, run_on: bool = False) -> Grads | None:
        grads: Grads = dict(self._early)  # compressions started in backward
        self._early = {}
        for n, p in self.params.items():
            if p.grad is not None:
                grads[n] = p.grad
                p.grad = None  # this generation is now in flight; backward makes a new one
        if self.max_accumulate == 1:  # (compress_in_backward's futures never accumulate)
            return grads
        for n, g in grads.items():  # accumulate: the mean of the round's micro-batches goes out
            assert isinstance(g, torch.Tensor)
            if n in self._acc:
                self._acc[n].add_(g)
            else:
                self._acc[n] = g  # this generation is ours: p.grad no longer holds it
        self._acc_batches += 1
        if run_on and self._acc_batches < self.max_accumulate:
            return None
        k, acc = self._acc_batches, self._acc
        self._acc, self._acc_batches = {}, 0
        self.round_batches = k
        if k > 1:
            for g in acc.values():
                g.div_(k)
        return dict(acc)

    @torch.no_grad()
    def install(self, delta: PullResult, sent: Mapping[str, SparseGrad]) -> None:
        delta.apply_to(self.params)  # the server's values replace the replica's

    @torch.no_grad()
    def prepare_flush(self) -> None:
        """Micro-batches accumulated for a round that never started go out with the residuals."""
        k, acc = self._acc_batches, self._acc
        self._acc, self._acc_batches = {}, 0
        for n, g in acc.items():
            self.compressor.residual_buffer(n, self.params[n]).add_(g.reshape(-1).to(torch.float32), alpha=1.0 / k)

    def state(self) -> dict[str, Any]:
        return {"residuals": {n: self.compressor.residual(n).detach().cpu().clone()
                              for n in self.compressor.keys()}}  # noqa: SIM118 - not a dict

    @torch.no_grad()
    def restore(self, state: Mapping[str, Any], snap: PullResult) -> None:
        """The server's model, with the saved residuals."""
        for n, r in state.get("residuals", {}).items():
            p = self.params[n]
            self.compressor.residual_buffer(n, p).copy_(r.reshape(-1).to(p.device, torch.float32))
        snap.apply_to(self.params)

    def close(self) -> None:
        if self._compress_exec is not None:
            self._compress_exec.shutdown(wait=True)


def exchange_for(mode: str, params: dict[str, torch.nn.Parameter],
                 optimizer: torch.optim.Optimizer | Mapping[str, Any] | None, outer: str | Mapping[str, Any],
                 compression: Compression, sync: Sync, site: Any) -> _Exchange:
    """The exchange of ``mode`` ("update" or "gradient"), its settings checked."""
    if mode == "update":
        return _UpdateExchange(params, optimizer, outer, compression, sync, site)
    if mode == "gradient":
        return _GradientExchange(params, optimizer, compression, sync, site)
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
