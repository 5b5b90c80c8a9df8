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

:class:`StellaOptimizer` is three parts composed: the mode's half (what a step does,
what a round pushes, what a site averages, how the answer is installed, what a
checkpoint holds, which groups the wrapper shows: one class per mode in
:mod:`stella._exchange`), the rounds (the background thread, one round's push and pull,
the controller: :mod:`stella._rounds`) and the site (:mod:`stella.site`: who speaks to
the server, and what the other ranks are told). It keeps the optimizer API.
"""
from __future__ import annotations

import functools
import inspect
import logging
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar, cast

import torch

from ._exchange import build_inner, exchange_for, load_in_place
from ._rounds import PipelineStats, Rounds
from .batch_noise import BatchNoise
from .errors import PipelineError, StellaError, Stopped
from .layout import FlatLayout
from .modes import DEFAULT_MODE, DEFAULT_OUTER, MODES, OUTER_PRESETS, Mode
from .options import Compression, Connection, Sync, removed_keyword
from .shards import AnyClient
from .site import site_for

log = logging.getLogger("stella.pipeline")

_F = TypeVar("_F", bound=Callable[..., Any])


def _on_owner(method: _F) -> _F:
    """``method`` runs on the optimizer itself also when called through a wrapper that
    reads the optimizer's attributes but writes its own: Lightning's ``LightningOptimizer``
    (what ``self.optimizers()`` returns; it forwards missing attributes to the optimizer,
    older releases copied its ``__dict__``) is one. Run on the wrapper, ``close()`` would
    finish the round and close the shared connection while the optimizer's own flags and
    version stayed as they were (in flight, not closed; with a copied ``__dict__``, the
    copy's stale flags skipped the round in flight and the flush: the last progress lost
    without a word)."""

    @functools.wraps(method)
    def on_owner(self: StellaOptimizer, *args: Any, **kwargs: Any) -> Any:
        return method(getattr(self, "_owner", self), *args, **kwargs)

    return cast(_F, on_owner)


__all__ = ["StellaOptimizer", "Compression", "Sync", "Connection", "PipelineError", "PipelineStats", "MODES",
           "OUTER_PRESETS", "build_inner"]


class StellaOptimizer(torch.optim.Optimizer):
    """Data-parallel training through ``stella-ps`` with the exchange hidden behind the
    computation (see the module doc for the two modes).

    ``model``: any module; every parameter with ``requires_grad`` is registered under
    its ``named_parameters`` name. ``address``: the server's ``tcp://host:port``; several
    (a list, or comma-separated): the shards of a sharded job, in their order
    (:mod:`stella.shards`); or a connected :class:`~stella.Client` (or sharded client).

    ``optimizer``: update mode: the worker's optimizer, a ``torch.optim.Optimizer`` over
    the model's parameters or a config mapping (``{"name": "adamw", "lr": 1e-3, ...}``)
    to build one. Gradient mode: the server's optimizer config (None: the server's
    default, ``stella-ps --optimizer``).
    ``mode``: "update" (default) or "gradient". ``outer``: update mode's server-side
    optimizer: "auto" (default: "count" over an adaptive optimizer such as AdamW with
    pushes at most 3% dense, else "average"), "average" (the mean of the workers'
    changes), "count" (a coordinate that n of the step's K pushes carried at
    ``(K / n) ** 0.5`` times the mean), "sqrt" (the mean times the square root of the
    step's pushes), "nesterov" or a config mapping.
    ``sync``: when to exchange (:class:`~stella.options.Sync`: H, running on, staleness,
    batch size). ``compression``: how to compress (:class:`~stella.options.Compression`:
    density, method, wire coding). ``connection``: how to reach the server
    (:class:`~stella.options.Connection`: timeout, name, worker id, CurveZMQ keys).
    ``process_group``: the ranks of this site (:mod:`stella.site`): they average over
    ``torch.distributed`` (update mode: their weights each round; gradient mode: their
    gradients each step) and the group's rank 0 alone speaks to the server, then shares
    its answer. ``"default"`` (the default): the default group when ``torch.distributed``
    is initialised with more than one rank; None: this process is a worker of its own.
    Every rank calls the same methods in the same order, as with any collective.
    ``progress_every``: log a one-line summary every that many steps (0: none; see
    :mod:`stella.progress`). The timings travel with the pushes in any case.
    ``batch_noise``: update mode with Adam or AdamW: each local step taken with the
    second moment Adam would keep on the whole job's batch, from the noise between the
    two halves of this worker's batch (:class:`~stella.BatchNoise`): a step accumulated
    over two or more backward passes splits itself at half of them; a loop of one pass a
    step calls :meth:`mark_half` between its batch's halves' backward passes. ``"auto"``
    (the default): a ``BatchNoise()`` (its world the server's) wherever it applies (update
    mode, Adam or AdamW), silent where the loop has no halves; None: none (plain Adam
    steps, and no copies: it keeps two of the parameters' size once it has halves).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> StellaOptimizer:
        # the keywords of the form before the groups (compression=, sync=, connection=) are refused here,
        # before __init__, with the new spelling named
        err = removed_keyword(cls.__name__, {k: v for k, v in kwargs.items() if k not in _PARAMETERS})
        if err is not None:
            raise err
        return super().__new__(cls)

    def __init__(self, model: torch.nn.Module, address: str | Sequence[str] | AnyClient, *,
                 optimizer: torch.optim.Optimizer | Mapping[str, Any] | None = None, mode: Mode | None = None,
                 outer: str | Mapping[str, Any] = DEFAULT_OUTER, sync: Sync = Sync(),
                 compression: Compression = Compression(), connection: Connection = Connection(),
                 process_group: Any = "default", progress_every: int = 0,
                 batch_noise: BatchNoise | Literal["auto"] | None = "auto"):
        self._owner = self  # what a wrapper reading this optimizer's attributes acts on (_on_owner)
        # tensors without elements never change: nothing to exchange
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad and p.numel() > 0}
        if not self.params:
            raise ValueError("model has no trainable parameters")
        self._model = weakref.ref(model)  # looked at again by the start: was a parameter added or replaced since?
        self.mode: Mode = mode or DEFAULT_MODE
        self.sync, self.compression = sync, compression
        self.site = site_for(process_group)
        # a model under DistributedDataParallel: its gradients are averaged over DDP's ranks every backward pass,
        # and the site averages them again; the default BatchNoise's halves would mix a rank's own gradient (kept
        # after the first passes) with the ranks' mean (the last pass's), over-stating the noise
        wrapped = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        if wrapped:
            warnings.warn("StellaOptimizer was given a DistributedDataParallel model: DDP averages the gradients "
                          "every backward pass, and the ranks of a site average already (update mode: the weights "
                          "each round; gradient mode: the gradients each step). Give it the module itself "
                          "(ddp.module, unwrapped) and leave the averaging to the site; the default BatchNoise is "
                          "off for this one (docs/integrations.md, torchrun)", stacklevel=2)
        self._exchange = exchange_for(self.mode, self.params, optimizer, outer, compression, sync, self.site)
        if isinstance(batch_noise, str):
            if batch_noise != "auto":
                raise ValueError(f"batch_noise must be a BatchNoise, 'auto' or None, got {batch_noise!r}")
            inner = self._exchange.inner
            fits = self.mode == "update" and inner is not None and BatchNoise.fits(inner) and not wrapped
            batch_noise = BatchNoise(warn=False) if fits else None
        if batch_noise is not None:
            if self.mode != "update":
                raise ValueError("batch_noise corrects the workers' own Adam steps: update mode only")
            inner = self._exchange.inner
            assert inner is not None  # update mode
            BatchNoise.check(inner)
            batch_noise.attach(self.params.values())  # counts the backward passes from the first
            self._exchange.noise = batch_noise
        self.rounds = Rounds(self._exchange, compression, leads=self.site.leads, may_run_on=self.site.may_run_on,
                             progress_every=progress_every)
        self._address, self._connection = address, connection
        self._pending = False  # a round is in flight (on every rank of a site)
        self._closed = False
        self._started = False
        self._saved: Mapping[str, Any] | None = None  # a worker checkpoint loaded before the start, applied by it
        self.server_optimizer: dict[str, Any] = {}  # the server's optimizer config, as it answered the registration
        self.version: int = 0  # the version of the server's model the replica (anchor) holds
        # the wrapper shows the exchange's groups (param_groups, state): a scheduler built on it drives them
        super().__init__(list(self.params.values()), self._exchange.groups.defaults)
        self._shows_groups = True
        self._sent_hparams: dict[str, Any] = {}
        if self.mode == "gradient" and self._exchange.server_config is None:
            self.start()  # the wrapper's group mirrors the server's default optimizer: it must be known now

    # ------------------------------------------------------------------ the groups shown
    # ``param_groups`` and ``state`` are the exchange's (update mode: the inner optimizer's), read
    # each time: a torch optimizer's load_state_dict replaces its lists, and a scheduler built on
    # the wrapper before that must still drive them. Until torch's constructor is done, its own.
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        if self.__dict__.get("_shows_groups"):
            return self._exchange.groups.param_groups
        return self.__dict__["_own_groups"]

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        if self.__dict__.get("_shows_groups"):
            self._exchange.groups.param_groups = groups
        else:
            self.__dict__["_own_groups"] = groups

    @property
    def state(self) -> Any:
        if self.__dict__.get("_shows_groups"):
            return self._exchange.groups.state
        return self.__dict__["_own_state"]

    @state.setter
    def state(self, state: Any) -> None:
        if self.__dict__.get("_shows_groups"):
            self._exchange.groups.state = state
        else:
            self.__dict__["_own_state"] = state

    # ------------------------------------------------------------------ the start
    @_on_owner
    def start(self) -> None:
        """Join the job with the model as the parameters hold it now. The first ``step()``
        (or ``synchronize()``, ``pull_latest()``) calls it, so that a checkpoint loaded after
        the optimizer was built (``model.load_state_dict``, a training stack's resume) is
        what a new server starts from; a worker checkpoint loaded before it
        (:meth:`load_state_dict`) is applied here. Which model wins when the server already
        holds one: :meth:`load_state_dict`. Idempotent; every rank of a site calls it."""
        if self._started:
            return
        if self._closed:
            raise PipelineError("start() after close()")
        self._check_parameters()
        saved, self._saved = self._saved, None
        before = None
        if saved is not None:
            self._exchange.before_start(saved)
            before = self._flat_copy()
        version = int(saved.get("version") or 0) if saved is not None else 0
        created, start = self.site.from_leader(lambda: self._register(self._address, self._connection, version))
        with torch.no_grad():  # the leader's model, on every rank
            self.site.broadcast(p.detach() for p in self.params.values())
        self.server_optimizer, self.version = start[0], start[1]
        self._exchange.attach(self.server_optimizer, start[2])  # laid out flat with the server's dense cut
        self._sent_hparams = self._exchange.hparams()
        self._started = True
        if saved is not None:
            self._resumed(saved, created, before)
            self._exchange.after_start(saved)

    def _register(self, address: Any, connection: Connection,
                  version: int) -> tuple[bool, tuple[dict[str, Any], int, FlatLayout]]:
        """Join the job and hold its model (the model at ``version``, if this registration
        creates it): whether this registration created it, the server's optimizer config,
        the version held, and the model's flat layout."""
        reply, snap = self.rounds.open(address, connection, self.params, self._exchange.server_config, self.mode,
                                       version)
        client = self.rounds.client
        assert client is not None and client.flat is not None
        if snap is None:
            return reply.created, (reply.optimizer or {}, reply.version, client.flat)
        with torch.no_grad():
            snap.apply_to(self.params)
        return reply.created, (reply.optimizer or {}, snap.version, client.flat)

    def _check_parameters(self) -> None:
        """The model's trainable parameters are still those the optimizer was built on: one
        added or replaced since (a layer added, embeddings resized) would train without
        ever reaching the server."""
        model = self._model()
        if model is None:
            return
        now = {n: p for n, p in model.named_parameters() if p.requires_grad and p.numel() > 0}
        added = [n for n in now if n not in self.params]
        replaced = [n for n, p in now.items() if n in self.params and p is not self.params[n]]
        if added or replaced:
            raise PipelineError(f"the model's parameters changed after StellaOptimizer was built (added: "
                                f"{added[:5]}, replaced: {replaced[:5]}): build the optimizer once the model is "
                                "complete (after resizing embeddings, adding heads, or loading a model that "
                                "replaces its parameters)")

    def _flat_copy(self) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([p.detach().reshape(-1).float() for p in self.params.values()])

    def _resumed(self, saved: Mapping[str, Any], created: bool, before: torch.Tensor | None) -> None:
        """Say which model a resumed worker holds: the rule of :meth:`load_state_dict`,
        and, when the server's model replaced the checkpoint's, by how much it differs."""
        was = saved.get("version")
        if created:
            log.info("stella-ps had no model: the job starts from this worker's checkpoint (taken at version %s)",
                     was, extra={"version": self.version, "checkpoint_version": was})
            return
        moved = 0.0
        if before is not None:
            moved = float((self._flat_copy() - before).norm() / before.norm().clamp_min(1e-12))
        extra = {"version": self.version, "checkpoint_version": was, "moved": moved}
        if was is None or moved == 0.0:
            log.info("joined the job's model at version %d", self.version, extra=extra)
        elif self.version >= int(was):
            log.info("resuming on stella-ps's model at version %d, as new as this checkpoint's (version %s) or newer: "
                     "the server holds the job's progress since, and its model is the one trained on (it differs from "
                     "the checkpoint's by %.3g of its norm)", self.version, was, moved, extra=extra)
        else:
            log.warning("stella-ps holds a model at version %d, OLDER than this checkpoint's (version %s): the "
                        "server's model wins and replaced the checkpoint's weights (they differ by %.3g of their "
                        "norm), so %d step(s) of the checkpoint's are lost. To train on from the checkpoint's model, "
                        "start a new stella-ps (without --resume) and this worker first: the first worker to start "
                        "gives it its model", self.version, was, moved, int(was) - self.version, extra=extra)

    @property
    def client(self) -> AnyClient | None:
        """The connection (the leader's; None on a site's other ranks)."""
        return self.rounds.client

    @property
    def stats(self) -> PipelineStats:
        return self.rounds.stats

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

    # ------------------------------------------------------------------ rounds
    def _finish_round(self) -> None:
        """Wait for the round in flight and install its answer (a site's leader shares it
        with the other ranks, which install the same)."""
        if not self._pending:
            return
        self._pending = False
        t0 = time.perf_counter()
        # the answer, and the least H the leader chose since (Sync(every="auto")): every rank of a site takes
        # it here, at the same step
        answer, every = self.site.from_leader(lambda: (self.rounds.finish(), self.rounds.next_every))
        self.stats.wait_s += time.perf_counter() - t0
        assert answer is not None
        self._exchange.sync_every = every
        delta, sent = answer
        t1 = time.perf_counter()
        self._exchange.install(delta, sent)
        installed = time.perf_counter() - t1
        self.stats.install_s += installed
        self.rounds.note_install(installed)
        self.version = delta.version
        if delta.pushes:  # 0: not said (a snapshot)
            self._exchange.job_size = delta.pushes  # the rounds read it there
        if self._exchange.noise is not None:  # BatchNoise(world=None): the job's size, as the server saw it
            self._exchange.noise.job_size(delta.pushes * self.site.size)

    def _start_round(self, computed_on: int) -> None:
        """Install the round in flight, adapt, and start the next one."""
        t0, waited = time.perf_counter(), self.stats.wait_s
        self._finish_round()
        self.rounds.adapt()
        self._exchange.average_round(self.site)
        grads, computed_on = self._exchange.outgoing(self.version, computed_on)
        hp = self._exchange.hparams()
        changed = {k: v for k, v in hp.items() if self._sent_hparams.get(k) != v}
        self._sent_hparams = hp
        samples = (self.sync.batch_size or 1) * self._exchange.round_steps * self._exchange.round_batches
        self.rounds.start(grads, computed_on, self.version, changed, samples)
        self._pending = True
        self.rounds.note_round(time.perf_counter() - t0 - (self.stats.wait_s - waited))
        if self.sync.staleness == 0:
            self._finish_round()

    # ------------------------------------------------------------------ optimizer API
    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params.values():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_()
                p.grad.zero_()

    @property
    def batch_noise(self) -> BatchNoise | None:
        """The :class:`~stella.BatchNoise` this optimizer's local steps are corrected by (None: none)."""
        return self._exchange.noise

    def mark_half(self) -> None:
        """With ``batch_noise``: the gradients hold the first half of this step's batch now
        (each half's loss divided by 2, as for any accumulation of two micro-batches). Not
        needed where the step accumulates two or more backward passes: it splits itself."""
        noise = self._exchange.noise
        if noise is None:
            raise PipelineError("mark_half() needs a batch_noise (update mode over Adam or AdamW; not None)")
        noise.mark_half(list(self.params.values()))

    @torch.no_grad()
    def step(self, closure=None):
        if self._closed:
            raise PipelineError("step() after close()")
        if self.rounds.stopped:
            raise Stopped("stop() was called: close() the optimizer")
        self.start()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.rounds.on_step()
        self._exchange.average_step(self.site)
        # update mode: the local step, a round every H steps or more; gradient mode: a round, or a
        # micro-batch accumulated while the exchange in flight is far from done
        if self._exchange.step(self.rounds.runs_on()):
            self._start_round(self.version)  # the version this gradient was computed on
        return loss

    @_on_owner
    def synchronize(self) -> int:
        """Finish the in-flight exchange and install it; returns the replica's version."""
        self.start()
        self._finish_round()
        return self.version

    @_on_owner
    def pull_latest(self) -> int:
        """Install everything the server has applied so far (e.g. after training). In
        update mode the server's changes are merged: local progress not sent yet stays."""
        self.start()
        self._finish_round()
        delta = self.site.from_leader(lambda: self.rounds.call(lambda c: c.pull(self.version)))
        self._exchange.install(delta, None)
        self.version = delta.version
        return self.version

    # ------------------------------------------------------------------ worker checkpoints
    @_on_owner
    def state_dict(self) -> dict[str, Any]:
        """The worker's own side, for a checkpoint: the inner optimizer's state and what
        was not sent yet (update mode: ``anchor - weights``; gradient mode: the
        error-feedback residuals), and the version of the server's model it was taken on.
        Finishes the exchange in flight first, so nothing is half-merged. The weights
        themselves are ``model.state_dict()``'s. Before the start (nothing exchanged yet):
        the state as built, or as :meth:`load_state_dict` loaded it."""
        head: dict[str, Any] = {"mode": self.mode, "local_steps": self._exchange.local_steps,
                "density": self._exchange.compressor.density if self._started else None}
        if self._exchange.noise is not None:  # the running noise of each parameter (BatchNoise)
            head["batch_noise"] = self._exchange.noise.state(self.params)
        if not self._started:
            saved = self._saved
            return {**head, "version": None if saved is None else saved.get("version"),
                    **self._exchange.unstarted_state(saved)}
        self._finish_round()
        return {**head, "version": self.version, **self._exchange.state()}

    @_on_owner
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`, with the weights of the same checkpoint loaded in the
        model (before or after this call, as long as it is before the first ``step()``).

        Which model the job goes on from (docs/optimizer.md, "Resuming"):

        - a new ``stella-ps`` (it holds no model): the checkpoint's. The start registers
          the model the checkpoint's weights were computed from (update mode: the weights
          plus the saved unsent progress) and the weights train on as they were saved;
        - a ``stella-ps`` that holds the job's model (it kept running, or restarted from
          its own checkpoint): the server's, which every other worker shares; the saved
          unsent progress is kept on top of it (update mode: the weights become the
          server's model minus it; gradient mode: the residuals). When the server's model
          replaced weights that differ from it, a warning says so, and says louder when
          the server's version is older than the checkpoint's (steps were lost: a new
          server takes the checkpoint's model).

        Called after the start (the job running), it rebases on the server's model the
        same way."""
        if state.get("mode") != self.mode:
            raise ValueError(f"a {state.get('mode')!r}-mode state cannot load into a {self.mode!r}-mode optimizer")
        self._exchange.local_steps = int(state.get("local_steps", 0))
        if self._exchange.noise is not None and "batch_noise" in state:
            self._exchange.noise.load(self.params, state["batch_noise"])
        if not self._started:
            if self._exchange.inner is not None and "inner" in state:
                load_in_place(self._exchange.inner, state["inner"])  # the wrapper's groups stay the inner's
            self._saved = state  # applied by the start, on whichever model the server holds then
            return
        self._finish_round()
        before = self._flat_copy()
        snap = self.site.from_leader(lambda: self.rounds.call(lambda c: c.pull(None)))
        self._exchange.restore(state, snap)
        self.version = snap.version
        self._resumed(state, False, before)

    @_on_owner
    def stop(self) -> None:
        """End training from a signal handler (or another thread): a wait for the server in
        progress (the other sites not up yet, a server down and being reconnected to) ends
        at once, and ``step()`` raises :class:`~stella.errors.Stopped` from then on. Then
        call :meth:`close`: it pushes what was not sent and leaves, as usual, within about a
        second a request if the stop found the worker waiting (the server was not answering).
        Safe to call at any time, more than once::

            signal.signal(signal.SIGTERM, lambda *_: opt.stop())
            try:
                for x, y in loader: ...
            except stella.Stopped:
                pass
            opt.close()
        """
        self.rounds.stop()

    @_on_owner
    def close(self, *, flush: bool = True) -> None:
        """Finish the in-flight exchange, push what has not been sent (gradient mode:
        the residuals; update mode: the rest of the weights' change), so nothing is lost,
        leave the job and close the connection. Idempotent. After :meth:`stop`, a round
        that the stop cut short is dropped, and with it the push of what it had not sent
        (whether its push reached the server is not known): the log says so."""
        if self._closed:
            return
        self._closed = True
        try:
            try:
                self._finish_round()
            except Stopped as e:
                flush = False
                log.warning("closing after stop(): the exchange in flight was cut short, and what this worker "
                            "had not sent is not pushed (%s)", e)
            if flush and self._started:
                self._exchange.prepare_flush()
                try:
                    self.rounds.flush(self.version)
                except StellaError as e:
                    if not self.rounds.stopped:
                        raise
                    log.warning("closing after stop(): the last push of what this worker had not sent failed "
                                "(%s: %s); it is lost", type(e).__name__, e)
        finally:
            self.rounds.close()
            self._exchange.close()
            self.site.release()  # the process group is the user's to destroy, not ours to keep alive

    def __enter__(self) -> StellaOptimizer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_PARAMETERS = frozenset(inspect.signature(StellaOptimizer.__init__).parameters) - {"self"}
# what inspect.signature(StellaOptimizer) shows: __init__'s, not __new__'s catch-all
StellaOptimizer.__signature__ = inspect.signature(StellaOptimizer.__init__).replace(  # type: ignore[attr-defined]
    parameters=list(inspect.signature(StellaOptimizer.__init__).parameters.values())[1:])
