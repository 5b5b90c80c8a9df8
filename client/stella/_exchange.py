"""The two training modes' halves of :class:`~stella.StellaOptimizer`, one class each.

An exchange owns its mode's state and answers the mode's questions: which settings it
takes (its constructor checks them), what ``step()`` does, what a round pushes, what a
site's ranks average and when, how the server's answer is installed, what ``close()``
flushes, what a worker checkpoint holds, which codings its pushes may take, and which
parameter groups the wrapper shows (``groups``) and which mirror the server's optimizer
(``server``). It works on the flat model (:mod:`stella.layout`): the parameters seen as
one float32 vector (:class:`~stella.flat.FlatParams`) and one error-feedback compressor
over it (:class:`~stella.flat.FlatCompressor`, whose residual is the mode's state), so
that a round costs one call per operation whatever the model's number of tensors. Both
are made at :meth:`_Exchange.attach`, once the server said its dense cut.
:class:`~stella.StellaOptimizer` composes one with the rounds (:mod:`stella._rounds`)
and the site (:mod:`stella.site`).

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
from typing import Any

import torch

from .batch_noise import BatchNoise
from .client import PullResult
from .codec import CODINGS
from .flat import FlatCompressor, FlatParams, FlatPush
from .layout import FlatLayout, FlatValues
from .modes import MODES, OUTER_PRESETS
from .options import Compression, Sync
from .protocol import ValueDtype

__all__ = ["build_inner", "exchange_for"]

_INNER = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
# Compression.moment_power "auto" over an inner optimizer that keeps Adam's moments, in a job of at least
# MOMENT_FROM pushes a step: a push ranks its coordinates by |unsent change| x |m| ** 0.5 (Compression.moment "mean";
# bench.sim_update's `selm0.5`, the byte LM at W = 8 and 1% 1.12x dense's iterations against 1.19x by v ** 0.25,
# `selv0.25`, and 1.28x by magnitude alone; at W = 2 the mean was inside magnitudes' spread and v ** 0.25 cost
# iterations, so fewer workers keep magnitudes; docs/optimizer.md "The push's selection")
MOMENT_POWER, MOMENT_FROM = 0.25, 4
# a config's keys torch's optimizers do not take
_SERVER_ONLY = ("name", "momentum_mode", "lr_worker_exponent", "count_exponent", "count_taper_from", "count_taper_to")


def build_inner(config: Mapping[str, Any], params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The torch optimizer a config mapping (the server's names: ``{"name": "adamw", "lr": ...}``)
    describes, for update mode's local steps. ``momentum_mode``, ``lr_worker_exponent`` and
    the ``count_*`` keys (server-side notions) are ignored."""
    name = str(config.get("name", "")).lower()
    if name not in _INNER:
        raise ValueError(f"unknown optimizer {config.get('name')!r}; known: {sorted(_INNER)}")
    hp = {k: (tuple(v) if k == "betas" else v) for k, v in config.items() if k not in _SERVER_ONLY}
    return _INNER[name](params, **hp)


def auto_outer(inner: torch.optim.Optimizer) -> str:
    """The outer preset ``outer="auto"`` takes over ``inner``: "average" over SGD (the mean
    of K workers' SGD steps is the dense step on their whole batch), "tapered" over every
    other optimizer (Adam, AdamW, and the other normalising ones). Each such worker's step
    is about ``lr`` per coordinate whatever its batch, so the mean of K of them moves the
    model less than one dense step, and most of a sparse step's coordinates come from one
    push or a few, diluted by K in the mean: "count" takes a coordinate n of the K pushes
    carried at ``(K / n) ** 0.5`` times the mean. It overshot on the byte LM from 5% pushes,
    where the mean is the better rule, so "tapered" is "count" on steps whose pushes are at
    most 2% dense, the mean from 10%, and in between the exponent tapers with the density
    the server sees in each step: the rule follows what the adaptive density picks, step by
    step (docs/optimizer.md, "The outer step follows the density")."""
    return "average" if isinstance(inner, torch.optim.SGD) else "tapered"


def load_in_place(opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """``opt.load_state_dict(state)``, keeping its ``param_groups`` list, their dicts and its
    ``state`` mapping the same objects: torch replaces them, which would leave the wrapper's
    groups (and a scheduler built on the wrapper, or a training stack's copy of it, such as
    Lightning's ``LightningOptimizer``) driving groups the optimizer no longer steps with."""
    groups, held = opt.param_groups, opt.state
    opt.load_state_dict(state)
    for old, new in zip(groups, opt.param_groups):
        if old is not new:
            old.clear()
            old.update(new)
    if held is not opt.state:
        held.clear()
        held.update(opt.state)
    opt.param_groups, opt.state = groups, held


class _ServerGroup(torch.optim.Optimizer):
    """One parameter group mirroring the server's optimizer; a learning-rate scheduler
    may drive it. ``step()`` does nothing: the server steps, and changed values travel
    with the next push."""

    def __init__(self, params: list[torch.nn.Parameter], hparams: dict[str, Any]):
        super().__init__(params, hparams)

    def step(self, closure=None):
        return None


def _by_name(flat: torch.Tensor, layout: FlatLayout, names: list[str]) -> dict[str, torch.Tensor]:
    """A flat vector's per-tensor parts (host copies), by name: what a worker checkpoint holds."""
    host = flat.detach().cpu()
    return {n: host[a:b].clone() for n, (a, b) in zip(names, (layout.span(t) for t in range(len(names))))}


def _from_names(parts: Mapping[str, torch.Tensor], layout: FlatLayout, names: list[str], out: torch.Tensor) -> None:
    """:func:`_by_name`'s inverse, into ``out``."""
    for t, n in enumerate(names):
        a, b = layout.span(t)
        out[a:b].copy_(parts[n].reshape(-1).to(out.device, torch.float32))


class _Exchange:
    """What both modes share: the parameters (as a flat vector once attached), the
    compressor, and the mirror of the server's optimizer (``server``), whose changed
    hyper-parameters ride on the next push."""

    mode: str
    inner: torch.optim.Optimizer | None = None
    outer: torch.optim.Optimizer | None = None
    groups: torch.optim.Optimizer  # the optimizer whose param_groups (and state) the wrapper shows
    server: torch.optim.Optimizer  # its one group mirrors the server's optimizer
    server_config: Mapping[str, Any] | None  # what to register with
    noise: BatchNoise | None = None  # update mode: the local steps taken with the job's second moment
    flat: FlatParams
    compressor: FlatCompressor

    sync_every = 1  # the least local steps a round makes (update mode's H)
    job_size = 1  # the pushes of the latest step installed (the server's count; the pipeline sets it)
    auto_every = False  # Sync(every="auto"): the rounds choose sync_every
    codings: tuple[ValueDtype, ...]  # the codings the controller may give its pushes, best first
    # how much of a step the exchange in flight must still take for a round to run on (Rounds.runs_on)
    run_on_margin: float

    def __init__(self, params: dict[str, torch.nn.Parameter], compression: Compression):
        self.params = params
        self._names = list(params)
        c = compression
        # the compressor's density and coding until the first push (stella.adapt's Controller.first moves an
        # adaptive one to its cheapest candidate then): the density pinned or its ceiling, the best coding;
        # values are rounded to the wire coding inside the compressor, the rounding error kept in the residual
        self._first = (c.max_density if c.density == "auto" else float(c.density), c.method,
                       self.codings[0] if c.value_dtype == "auto" else c.value_dtype)
        self._per_tensor = c.per_tensor
        self._moment_power, self._moment = c.moment_power, c.moment
        self.local_steps = 0  # update mode: inner steps since the last exchange started
        # the round step() just ended: its local steps (update mode) and the micro-batches its
        # gradient averages (gradient mode); the samples it represents are their product
        self.round_steps = 1
        self.round_batches = 1
        self._hparam_names: list[str] = []  # the server's, from its answer to the registration

    def attach(self, server_optimizer: Mapping[str, Any], layout: FlatLayout) -> None:
        """After the registration, with the replica holding the server's model: the flat
        view of the parameters and the compressor over it (``layout``: the model laid out
        with the server's dense cut), then the groups (``server_optimizer``: the config
        the server answered with)."""
        self.layout = layout
        self.flat = FlatParams(list(self.params.values()), layout)
        density, method, coding = self._first
        self.compressor = FlatCompressor(layout, density, method, device=self.flat.device, value_dtype=coding,
                                         group_quotas=self._per_tensor)
        # the mirror takes the server's values, except where a scheduler moved one from the config given
        group = self.server.param_groups[0]
        answered, given = self._hparams_of(server_optimizer), self._hparams_of(self.server_config or {})
        for k, v in answered.items():
            if k not in group or group[k] == given.get(k):
                group[k] = v
        self.server.defaults.update(answered)
        self._hparam_names = list(answered)

    def _mirror(self) -> _ServerGroup:
        """A group mirroring the server's optimizer: until the start, the config given
        (``server_config``); from then, its names and values are those the server answered
        with (every key but "name", :meth:`attach`), never copied from the server's code. A
        param_group is a plain dict, so it holds the server-only string ``momentum_mode`` too,
        and the server takes every name it answered with as a change: none is left out.
        Schedulers touch only the keys they know (lr, momentum, betas). Lists (``betas``) are
        tuples there, as torch's own optimizers keep them."""
        hparams = self._hparams_of(self.server_config or {})
        self._hparam_names = list(hparams)
        return _ServerGroup(list(self.params.values()), hparams)

    @staticmethod
    def _hparams_of(config: Mapping[str, Any]) -> dict[str, Any]:
        return {k: (tuple(v) if isinstance(v, list) else v) for k, v in config.items() if k != "name"}

    def hparams(self) -> dict[str, Any]:
        """The server's hyper-parameters as the mirror holds them now (a scheduler may have moved them)."""
        g = self.server.param_groups[0]
        return {k: (list(g[k]) if isinstance(g[k], tuple) else g[k]) for k in self._hparam_names if k in g}

    def average_step(self, site: Any) -> None:
        """Every ``step()``, before :meth:`step`: what a site's ranks average then (nothing)."""

    def average_round(self, site: Any) -> None:
        """At the start of a round, before :meth:`outgoing`: what a site's ranks average then (nothing)."""

    def step(self, run_on: bool = False) -> bool:
        """The training loop's ``step()``: whether a round starts now. ``run_on``: the
        exchange in flight is far from done, so the round may go on (a local step more,
        or a micro-batch more) up to its bound."""
        raise NotImplementedError

    def outgoing(self, version: int, computed_on: int) -> tuple[torch.Tensor | None, int]:
        """With the previous round installed (the replica at ``version``): what this round's
        compression adds to the residual (None: the residual as it stands), and the version
        it was computed on."""
        raise NotImplementedError

    def install(self, delta: PullResult, sent: FlatPush | None) -> None:
        """Install the server's answer to the round that sent ``sent``."""
        raise NotImplementedError

    def prepare_flush(self) -> None:
        """Before ``close()`` pushes what was not sent: make the compressor's residual whole."""

    def state(self) -> dict[str, Any]:
        """This mode's part of a worker checkpoint."""
        raise NotImplementedError

    def restore(self, state: Mapping[str, Any], snap: PullResult) -> None:
        """Load :meth:`state` on top of the server's current model ``snap`` (a snapshot)."""
        raise NotImplementedError

    def unstarted_state(self, saved: Mapping[str, Any] | None) -> dict[str, Any]:
        """:meth:`state` before the start (nothing exchanged yet): a checkpoint loaded then
        (``saved``) and not applied yet, as it was loaded."""
        raise NotImplementedError

    def before_start(self, saved: Mapping[str, Any]) -> None:
        """A worker checkpoint loaded before the start, before the registration: the
        parameters become the model to register (the one the checkpoint's weights came from)."""

    def after_start(self, saved: Mapping[str, Any]) -> None:
        """The rest of it, once attached, with the replica holding the server's model."""
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
        if sync.max_accumulate > 1:
            raise ValueError("max_accumulate is for gradient mode (update mode runs on with local steps instead: "
                             "Sync(max_every=...))")
        super().__init__(params, compression)
        self.inner = (optimizer if isinstance(optimizer, torch.optim.Optimizer)
                      else build_inner(optimizer, list(params.values())))
        # the wrapper's groups are the inner optimizer's (schedulers built on either drive the local steps)
        self.groups = self.inner
        if outer == "auto":
            outer = auto_outer(self.inner)
        if isinstance(outer, str) and outer not in OUTER_PRESETS:
            raise ValueError(f"outer must be 'auto', one of {sorted(OUTER_PRESETS)} or a config mapping, got "
                             f"{outer!r}")
        self.server_config = OUTER_PRESETS[outer] if isinstance(outer, str) else outer
        self.outer = self.server = self._mirror()  # `outer` mirrors the server's optimizer
        # Sync(every="auto"): the least H is the rounds' to choose (stella._rounds), from 1
        self.auto_every = sync.every == "auto"
        least = 1 if sync.every == "auto" else sync.every
        self.sync_every = least
        self.max_sync_every = 4 * least if sync.max_every is None else sync.max_every
        self.round_steps = least

    def attach(self, server_optimizer: Mapping[str, Any], layout: FlatLayout) -> None:
        super().attach(server_optimizer, layout)
        # the replica of the server's model, exact (float32, flat, the parameters' device)
        self.anchor = torch.empty(layout.numel, dtype=torch.float32, device=self.flat.device)
        self.flat.gather_into(self.anchor)
        self._weight: torch.Tensor | None = None  # Compression.moment_power's weights of the sparse range

    def average_round(self, site: Any) -> None:
        """The site's weights: the mean of its ranks'."""
        with torch.no_grad():
            site.average(p.detach() for p in self.params.values())

    def step(self, run_on: bool = False) -> bool:
        self.inner.step()  # the local step, dense, on this worker's gradient
        if self.noise is not None:  # taken again with the whole job's second moment
            self.noise.correct(self.inner)
        self.local_steps += 1
        if self.local_steps < self.sync_every or (run_on and self.local_steps < self.max_sync_every):
            return False
        self.round_steps, self.local_steps = self.local_steps, 0
        return True

    def outgoing(self, version: int, computed_on: int) -> tuple[torch.Tensor | None, int]:
        self._load_residual()
        self._weigh()
        self.outer.step()  # counts the round for a scheduler driving the outer group
        return None, version  # the residual as it stands, on the installed version

    def _load_residual(self) -> None:
        """The residual becomes ``a - w``, the pseudo-gradient not sent yet (nothing is in
        flight when this runs): one pass over the flat model."""
        self.flat.residual_into(self.anchor, self.compressor.residual)
        self.compressor.weight = None

    @torch.no_grad()
    def _weigh(self) -> None:
        """``Compression.moment_power``: the residual's sparse range times ``s ** (2 P)``, the
        gradient's scale ``s`` from the inner optimizer's state (``moment="mean"``:
        ``|exp_avg| + eps``; ``"second"``: ``sqrt(exp_avg_sq + eps^2)``), gathered flat (two
        passes over the sparse range and one over the residual), so that the push ranks the
        unsent change by it; nothing when P is 0 (``"auto"`` in a job of fewer than
        MOMENT_FROM pushes a step) or a large tensor has no such state (SGD, a parameter not
        stepped yet)."""
        if self._moment_power == "auto":
            power = MOMENT_POWER if self.job_size >= MOMENT_FROM else 0.0
        else:
            power = float(self._moment_power)
        s = self.layout.sparse_numel
        if power == 0.0 or s == 0:
            return
        state, key = self.inner.state, "exp_avg" if self._moment == "mean" else "exp_avg_sq"
        moments: list[torch.Tensor | None] = [None] * len(self.params)
        for t, p in enumerate(self.params.values()):
            st = state.get(p)
            v = st.get(key) if st else None
            ok = isinstance(v, torch.Tensor) and v.numel() == p.numel() and v.device == p.device
            moments[t] = v if ok else None  # (a state kept elsewhere, offloaded: not used)
        if any(moments[t] is None for t, _, b in self.layout.spans() if b <= s):
            return
        if self._weight is None:
            self._weight = torch.empty(s, dtype=torch.float32, device=self.flat.device)
        w = self._weight
        self.flat.gather_tensors_into(moments, w, 0)
        eps = min(float(g.get("eps", 1e-8)) for g in self.inner.param_groups)
        if self._moment == "mean":  # (|m| + eps) ** (2 P)
            w.abs_().add_(eps)
            exponent = 2.0 * power
        else:  # (v + eps^2) ** P
            w.add_(eps * eps)
            exponent = power
        if exponent == 0.5:
            w.sqrt_()
        elif exponent == 0.25:
            w.sqrt_().sqrt_()
        else:
            w.pow_(exponent)
        self.compressor.residual[:s].mul_(w)
        self.compressor.weight = w

    def install(self, delta: PullResult, sent: FlatPush | None) -> None:
        """The merge rule, ``w <- w + (a_new - a) + c`` and ``a <- a_new`` (pipeline's
        module doc), where ``c`` is what this worker sent in the round that just finished.
        The anchor's new values are installed (exact pulls, snapshots) or added, step
        after step (the broadcast: then the anchor equals the server's broadcast model)."""
        for piece in delta.values:
            self._merge(piece, add=False)
        for step in delta.steps:
            for piece in step:
                self._merge(piece, add=True)
        if sent is not None:
            if sent.sparse.indices is None:
                self.flat.add_range(sent.sparse.values, 0)
            elif sent.sparse.indices.size:
                self.flat.add_at(sent.sparse.indices, sent.sparse.values)
            if sent.dense.size:
                self.flat.add_range(sent.dense, self.layout.sparse_numel)

    def _merge(self, piece: FlatValues, *, add: bool) -> None:
        if piece.indices is None:
            a = self.anchor[piece.start:piece.start + piece.values.size]
            self.flat.merge_range(piece.values, a, piece.start, add=add)
        elif piece.indices.size:
            self.flat.merge_at(piece.indices, piece.values, self.anchor[piece.start:], add=add, start=piece.start)

    def prepare_flush(self) -> None:
        self._load_residual()

    def state(self) -> dict[str, Any]:
        unsent = torch.empty_like(self.anchor)
        self.flat.residual_into(self.anchor, unsent)
        return {"inner": self.inner.state_dict(), "unsent": _by_name(unsent, self.layout, self._names)}

    def unstarted_state(self, saved: Mapping[str, Any] | None) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "unsent": None if saved is None else saved.get("unsent")}

    @torch.no_grad()
    def before_start(self, saved: Mapping[str, Any]) -> None:
        """The weights become the anchor they were saved with, ``w + (a - w)``: the model
        the job held then, which a new server takes as its own."""
        unsent = saved.get("unsent")
        if unsent is not None:
            for n, p in self.params.items():
                p.add_(unsent[n].reshape(p.shape).to(p.device, p.dtype))

    @torch.no_grad()
    def after_start(self, saved: Mapping[str, Any]) -> None:
        """The weights become the server's model minus the saved unsent progress."""
        if saved.get("unsent") is not None:
            unsent = torch.empty_like(self.anchor)
            _from_names(saved["unsent"], self.layout, self._names, unsent)
            self.flat.set_range(self.anchor - unsent, 0)

    @torch.no_grad()
    def restore(self, state: Mapping[str, Any], snap: PullResult) -> None:
        """The weights become the server's model minus the saved unsent progress."""
        load_in_place(self.inner, state["inner"])
        snap.apply_to(self.params)
        self.flat.gather_into(self.anchor)
        self.after_start(state)


class _GradientExchange(_Exchange):
    mode = "gradient"
    codings = CODINGS[:2]  # its pushes feed the server's optimizer (momentum, Adam): 2-bit values made its
    # steps erratic on digits (tests/test_convergence.py), so it stops at q4
    run_on_margin = 0.5  # a micro-batch more changes the server's step

    def __init__(self, params: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer | Mapping[str, Any] |
                 None, compression: Compression, sync: Sync, site: Any):
        if isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError("gradient mode runs the optimizer on the server: pass its config as a mapping, "
                             "or use mode='update' to step this torch optimizer on the worker")
        if sync.every != 1 or sync.max_every not in (None, 1):
            raise ValueError("Sync(every=, max_every=) are for update mode (gradient mode exchanges every step)")
        super().__init__(params, compression)
        self.server_config = optimizer
        # the wrapper's group mirrors the server's optimizer, so that schedulers can edit it (without a
        # config given, the server's default: StellaOptimizer starts at once, to know it)
        self.groups = self.server = self._mirror()
        self.max_accumulate = sync.max_accumulate
        self._grad: torch.Tensor | None = None  # the round's gradient, flat (the micro-batches summed so far)
        self._acc_batches = 0

    def attach(self, server_optimizer: Mapping[str, Any], layout: FlatLayout) -> None:
        super().attach(server_optimizer, layout)

    def average_step(self, site: Any) -> None:
        """The site's gradient: the mean of its ranks'."""
        site.average(p.grad for p in self.params.values() if p.grad is not None)

    def step(self, run_on: bool = False) -> bool:
        grad = torch.empty(self.layout.numel, dtype=torch.float32, device=self.flat.device)
        self.flat.gather_grads_into(grad)  # a missing gradient counts as zeros
        for p in self.params.values():
            p.grad = None  # this generation is in the flat gradient now; backward makes a new one
        if self._grad is None:
            self._grad = grad
        else:
            self._grad.add_(grad)
        self._acc_batches += 1
        if self.max_accumulate > 1 and run_on and self._acc_batches < self.max_accumulate:
            return False
        self.round_batches = self._acc_batches
        return True

    def outgoing(self, version: int, computed_on: int) -> tuple[torch.Tensor | None, int]:
        grad, k = self._grad, self._acc_batches
        self._grad, self._acc_batches = None, 0
        if grad is not None and k > 1:  # the mean of the round's micro-batches goes out
            grad.div_(k)
        return grad, computed_on

    @torch.no_grad()
    def install(self, delta: PullResult, sent: FlatPush | None) -> None:
        """The server's values replace the replica's (the broadcast's are added)."""
        for piece in delta.values:
            if piece.indices is None:
                self.flat.set_range(piece.values, piece.start)
            elif piece.indices.size:
                self.flat.set_at(piece.indices, piece.values, piece.start)
        for step in delta.steps:
            for piece in step:
                if piece.indices is None:
                    self.flat.add_range(piece.values, piece.start)
                elif piece.indices.size:
                    self.flat.add_at(piece.indices, piece.values, piece.start)

    @torch.no_grad()
    def prepare_flush(self) -> None:
        """Micro-batches accumulated for a round that never started go out with the residual."""
        grad, k = self._grad, self._acc_batches
        self._grad, self._acc_batches = None, 0
        if grad is not None:
            self.compressor.residual.add_(grad, alpha=1.0 / k)

    def state(self) -> dict[str, Any]:
        return {"residuals": _by_name(self.compressor.residual, self.layout, self._names)}

    def unstarted_state(self, saved: Mapping[str, Any] | None) -> dict[str, Any]:
        return {"residuals": None if saved is None else saved.get("residuals")}

    @torch.no_grad()
    def after_start(self, saved: Mapping[str, Any]) -> None:
        """The saved residuals, on the server's model."""
        if saved.get("residuals") is not None:
            _from_names(saved["residuals"], self.layout, self._names, self.compressor.residual)

    @torch.no_grad()
    def restore(self, state: Mapping[str, Any], snap: PullResult) -> None:
        """The server's model, with the saved residuals."""
        if state.get("residuals") is not None:
            _from_names(state["residuals"], self.layout, self._names, self.compressor.residual)
        snap.apply_to(self.params)


def exchange_for(mode: str, params: dict[str, torch.nn.Parameter],
                 optimizer: torch.optim.Optimizer | Mapping[str, Any] | None, outer: str | Mapping[str, Any],
                 compression: Compression, sync: Sync, site: Any) -> _Exchange:
    """The exchange of ``mode`` ("update" or "gradient"), its settings checked."""
    if mode == "update":
        return _UpdateExchange(params, optimizer, outer, compression, sync, site)
    if mode == "gradient":
        return _GradientExchange(params, optimizer, compression, sync, site)
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
