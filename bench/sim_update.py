"""Same-process simulation of update mode, to choose its outer rule (issue 43): W
workers, H local steps a round, top-k pushes of the weights' unsent change, the
server's outer step, the compressed broadcast and one round of overlap, on the
bench workloads, against dense training at the same global batch.

    python -m bench.sim_update --workloads digits,tinylm --workers 2,8 --H 1,8 \\
        --density 0.01 --rules avg,lr2,nesterov --seeds 0,1,2 --steps 300 [--json PATH]
    python -m bench.sim_update --plot PNG --from a.json,b.json --rules avg,lrsqrt --H 1

What it mirrors of the real system (docs/optimizer.md "Update mode", "The broadcast"):

- **Worker** ``i``: weights ``w`` (its model), anchor ``a`` (its replica of the
  broadcast model ``B``), its own inner optimizer (the workload's: AdamW with betas
  (0.9, 0.95), or SGD with momentum 0.9, PyTorch's formulas on one flat vector) on its
  share of the global batch. Every H-th step a round: merge the previous round
  (``w <- w + (B - a) + c_prev``, ``a <- B``), then push ``c = C(a - w)``: the top
  ``density`` of the large tensors' coordinates (exact top-k over the flat model, the
  tensors under ``--dense-below`` whole), values rounded to f16 (``--push-values``).
  What is not sent stays in ``a - w``.
- **Server**: the step's mean pseudo-gradient (``avg``), the outer SGD on the
  coordinates pushed (lazy momentum), ``R += dx``; the broadcast takes the top
  ``factor x k`` of ``|R|`` on the large tensors (``k`` counted as the server counts it, by
  the pushes' bits against f16's: :func:`stella.codec.broadcast_share`; until 2612f59 the
  coordinates themselves, so a q4 run's ``--factor 1`` then is about ``--factor 2`` now)
  and all of the small ones, coded q4 (f16 for the small ones) as ``stella.codec.quantise`` does, ``B += m``, ``R -= m``
  (``--pull exact``: ``B = x``).
- **Overlap**: a round's result reaches the workers at the next round's start, after
  their next H steps (``Sync(staleness=1)``); every worker is as fast as the others.

The rule (``--rules``, joined with ``+``): ``avg`` (lr 1: the plain mean), ``lrX``
(outer lr X), ``lrpowP`` (lr W ** P: ``stella-ps``'s ``lr_worker_exponent``), ``lrsqrt``
(lr sqrt(W), the "sqrt" preset), ``nesterov`` (lr 0.7, momentum 0.9) or
``nestX:M`` (lr X, momentum M), ``count`` (each coordinate's sum divided by the
pushes that carried it, not by W), ``cpowP`` (the mean times ``(W / n) ** P`` at a
coordinate n pushes carried: ``stella-ps``'s ``count_exponent``, ``cpow0.5`` the
"count" preset; ``ctaper``: ``cpow0.5`` at steps of at most 2% pushes, the mean from 10%,
the exponent tapering in log density between, the "tapered" preset; ``ctaperF:T``, from F
to T), ``eager`` (the worker keeps its own in-flight push
at 1/W, as its share of the mean, instead of whole). Two estimates of the outer step's
scale, between 1 and sqrt(W), each step (the multiplier's spread is printed):
``norm`` (the mean brought to the pushes' RMS length: ``sqrt(W sum |p_i|^2) / |sum
p_i|``; ``normemaB``, the same from an EMA of decay B of the steps before, as a server
would have it) and ``adamv`` (the length of the step Adam would take on the whole batch
against a worker's, from the workers' own moments: signal ``m^2`` less the momentum's
share of the noise, noise ``v`` less the signal, divided by W on the whole batch).
Two per-coordinate forms of that estimate, on the workers: ``adamc`` (each worker's
Adam step is taken with the second moment Adam would have on W times its batch,
``mu^2 + s^2 / W`` for the signal ``mu^2`` and the noise ``s^2`` its moments give, so
that the mean of W such steps is the whole batch's step) and ``adamcp`` (the worker's
steps unchanged, the values it pushes multiplied by that ratio, ``sqrt(v / v')``, when
sent). Three probes of the second moment, which a real job could not afford as they
stand: ``vdense`` (an oracle: every worker steps with the second moment of the workers'
mean gradient, what dense Adam keeps), ``vshare`` (every worker's second moment
replaced by the workers' mean) and ``vmix`` (the whole batch's estimated from the
workers' mean moments, ``v / W + (1 - 1/W) m^2``). ``vsplit`` (what a real job can
afford, :class:`stella.BatchNoise`): each worker measures its gradient's noise from the two
halves of its batch, a running mean ``n`` of ``((g_a - g_b) / 2) ** 2``, and steps with
``max(v - (1 - 1/W) n, v / W)``, the second moment Adam keeps on the whole batch
(``vsplitwE``: with W ** E in place of W, a probe of a world over- or under-stated); ``vdiff``
the same from two successive steps' gradients, ``(g_t - g_{t-1}) ** 2 / 2`` (no halves;
worse than none on the byte LM, whose gradient moves between steps). ``lendG``: a coordinate some but
not all workers pushed is applied at the pushers' mean (the others' shares lent), later
pushes that agree repay the loan instead of being applied again, pushes that disagree
take it back, and a loan decays back by ``1 - G`` a step (:func:`_lend`: the sum of the
means is kept). Three shared index sets, so that a coordinate is averaged over every
worker's value instead of one worker's divided by W: ``gtopk`` (an oracle: every worker
pushes its values at the top k of the workers' summed unsent change), ``cyclic`` (at the
round's leader's own top k, the leader taking turns: ScaleCom's rule, here as if the
indices reached the others before they push) and ``bidxF`` (its own top ``F x k``, and
its values at the latest broadcast's indices, which every replica has: values only,
no index bytes). ``heldF`` keeps each worker's unsent change apart and its model at
``B - F x unsent`` (:func:`_hold`): ``held1`` is today's worker, whose model holds all
of its own progress not yet in the broadcast, ``heldw`` F = 1 / W (its own share of a
mean, as the other workers hold none of it). ``dwarmN``: the pushes' density (and the
broadcast's budget with it) warms up, falling geometrically from 10x the run's at step 0
to the run's at step N (deep gradient compression's sparsity warm-up). ``selvP``: a worker's
push takes the top k of ``|unsent| x (v + 1e-30) ** P``, ``v`` its Adam ``exp_avg_sq`` (the
worker's ``Compression(moment_power=P)``, which adds ``eps^2`` instead: the same ranking wherever a
gradient passes 1e-8), its values unweighted; ``selmP`` the same with ``|m| ** P``, ``m`` the
worker's Adam ``exp_avg`` (the gradient's mean, without its noise); ``ageA`` multiplies either score by
``1 + r / A``, ``r`` the rounds since the worker last pushed the coordinate (a change that waited long goes
before an equal fresh one). ``--staleness 0`` merges each round's
result before the next local step (no overlap), to tell what the one round of delay
costs.

Reported per configuration: ``ratio``, the iterations Stella needs against dense at
the same global batch, from the held-out loss (cross-entropy on the test set for the
digits workloads, the held-out bytes for the LMs) of worker 0's model (its replica
with its own unsent progress, what ``bench.e2e`` evaluates; the server's model is in
the JSON too), each curve taken as its running best. Stella's best at the end ``L_s``
against dense's ``L_d``: if Stella reached ``L_d``, the step it did so over the run's
length (<= 1); else the run's length over the step dense reached ``L_s`` (> 1); both
interpolated between evaluations. The mean and the seeds' values are printed;
``--json`` keeps the curves.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from bench import workloads as WL
from bench.harness import loadavg
from stella.codec import broadcast_share, quantise
from stella.modes import OUTER_PRESETS
from stella_ps.aggregation import count_exponent_at
from stella_ps.config import ServerConfig

DENSE_BELOW = ServerConfig().dense_below


@dataclass(frozen=True)
class Rule:
    """An outer rule of the sweep (see the module's text)."""

    spec: str
    lr: float = 1.0
    lr_power: float = 0.0
    momentum: float = 0.0
    nesterov: bool = False
    count: bool = False
    eager: bool = False
    norm: bool = False
    norm_ema: float = 0.0
    adamv: bool = False
    adamc: bool = False
    adamcp: bool = False
    vshare: bool = False
    vdense: bool = False
    vmix: bool = False
    vsplit: bool = False
    vdiff: bool = False
    lend: float = 0.0  # > 0: ``lendG``, lending at decay G (see the module's text)
    index: str = ""  # the pushes' shared index set: "" (each its own top-k), gtopk, cyclic, bidx
    own: float = 1.0  # with ``bidx``: the share of k each worker still picks by its own top-k
    count_power: float = 0.0  # ``cpowP``: the mean times (W / pushes carrying the coordinate) ** P
    taper: tuple[float, float] | None = None  # ``ctaper[F:T]``: ``cpow0.5`` tapered to the mean from F to T
    held: float = 1.0  # ``heldF``: the weight of its own unsent change in a worker's model (-1: 1 / W)
    vworld: float = 1.0  # ``vsplitwE``: vsplit's world taken as W ** E
    warm: int = 0  # ``dwarmN``: the density falls geometrically from 10x to the run's over the first N steps
    selv: float = 0.0  # ``selvP``: a push's top k by |unsent| x v ** P (v: the worker's Adam second moment)
    selm: float = 0.0  # ``selmP``: a push's top k by |unsent| x |m| ** P (m: the worker's Adam first moment)
    age: float = 0.0  # ``ageA``: the push's score times (1 + rounds since the worker last pushed it / A)

    @classmethod
    def parse(cls, spec: str) -> Rule:
        kw: dict = {}
        for part in spec.split("+"):
            if part == "avg":
                continue
            if part == "lrsqrt":
                kw["lr_power"] = 0.5
            elif part.startswith("lrpow"):
                kw["lr_power"] = float(part[5:])
            elif part.startswith("lr"):
                kw["lr"] = float(part[2:])
            elif part == "nesterov":
                kw.update(lr=0.7, momentum=0.9, nesterov=True)
            elif part.startswith("nest"):
                lr, _, mom = part[4:].partition(":")
                kw.update(lr=float(lr), momentum=float(mom or 0.9), nesterov=True)
            elif part in ("gtopk", "cyclic"):
                kw["index"] = part
            elif part.startswith("bidx"):
                kw.update(index="bidx", own=float(part[4:] or 1.0))
            elif part.startswith("ctaper"):
                lo, _, hi = part[6:].partition(":")
                preset = OUTER_PRESETS["tapered"]
                kw.update(count_power=0.5, taper=(float(lo) if lo else preset["count_taper_from"],
                                                  float(hi) if hi else preset["count_taper_to"]))
            elif part.startswith("cpow"):
                kw["count_power"] = float(part[4:])
            elif part.startswith("held"):
                kw["held"] = -1.0 if part[4:] == "w" else float(part[4:])
            elif part.startswith("vsplitw"):
                kw.update(vsplit=True, vworld=float(part[7:]))
            elif part.startswith("selv"):
                kw["selv"] = float(part[4:] or 0.5)
            elif part.startswith("selm"):
                kw["selm"] = float(part[4:] or 1.0)
            elif part.startswith("age"):
                kw["age"] = float(part[3:] or 50)
            elif part.startswith("dwarm"):
                kw["warm"] = int(part[5:])
            elif part.startswith("lend"):
                kw["lend"] = float(part[4:] or 0.9)
            elif part.startswith("normema"):  # norm, from an EMA of the earlier steps' (the server's way)
                kw.update(norm=True, norm_ema=float(part[7:] or 0.9))
            elif part in ("count", "eager", "norm", "adamv", "adamc", "adamcp", "vshare", "vdense", "vmix",
                          "vsplit", "vdiff"):
                kw[part] = True
            else:
                raise ValueError(f"unknown rule part {part!r} in {spec!r}")
        return cls(spec, **kw)

    def outer_lr(self, world: int) -> float:
        return self.lr * world ** self.lr_power

    def held_weight(self, world: int) -> float:
        return 1.0 / world if self.held < 0 else self.held


class Flat:
    """The model's parameters as one flat vector: the large tensors first (the sparse
    part, ``[0, ns)``), then those under the dense cut, as ``stella.layout`` lays
    them out."""

    def __init__(self, model: torch.nn.Module, dense_below: int):
        params = list(model.parameters())
        self.params = [p for p in params if p.numel() >= dense_below] + [p for p in params if p.numel() < dense_below]
        self.ns = sum(p.numel() for p in self.params if p.numel() >= dense_below)
        self.n = sum(p.numel() for p in self.params)

    def get(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def grad(self) -> torch.Tensor:
        return torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in self.params])

    def load(self, flat: torch.Tensor) -> None:
        off = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(flat[off:off + p.numel()].view_as(p))
                off += p.numel()


def _batch_second_moment(moments: tuple[torch.Tensor, torch.Tensor, float, float], world: int) -> torch.Tensor:
    """The second moment Adam would have on ``world`` times the batch, per coordinate,
    from one worker's bias-corrected ``(m, v, b1, eps)``: the signal ``mu^2`` and the noise
    ``s^2`` of one gradient that its moments give (``m^2 = mu^2 + c s^2``, ``v = mu^2 + s^2``,
    ``c`` the share of the noise's variance the momentum keeps), ``v' = mu^2 + s^2 / world``
    (at most ``v``)."""
    mh, vh, b1, _ = moments
    c = (1 - b1) / (1 + b1)
    m2 = mh.square()
    noise = (vh - m2).clamp(min=0) / (1 - c)
    signal = (m2 - c * noise).clamp(min=0)
    return torch.minimum(signal + noise / world, vh)


class Inner:
    """The workload's own optimizer (``Workload.make_optimizer``, what every system of the
    benchmarks runs) stepping the flat vector ``w`` in place, at ``lr_mult`` times the
    workload's learning rate of each step."""

    def __init__(self, wl: WL.Workload, w: torch.Tensor, lr_mult: float = 1.0, batch_mult: int = 1):
        self.wl, self.w, self.lr_mult, self.batch_mult = wl, w, lr_mult, batch_mult
        self.opt = wl.make_optimizer([w])

    def _moments(self) -> tuple[torch.Tensor, torch.Tensor, float, float] | None:
        """The bias-corrected moments ``(m, v)`` of the latest Adam step, with ``b1`` and
        ``eps``; None before a step or for an optimizer without them."""
        st = self.opt.state.get(self.w, {})
        if "exp_avg_sq" not in st:
            return None
        group = self.opt.param_groups[0]
        b1, b2 = group["betas"]
        n = float(st["step"])
        return st["exp_avg"] / (1 - b1 ** n), st["exp_avg_sq"] / (1 - b2 ** n), b1, group["eps"]

    def dense_gain(self, world: int) -> tuple[float, float]:
        """``(|u_dense|^2, |u|^2)``: the squared length of this worker's Adam step and of
        the step Adam would take on ``world`` times the batch, both estimated from its own
        moments (the signal ``m^2``, the noise ``v - m^2``, a batch ``world`` times larger
        divides the noise by ``world``); ``(1, 1)`` for an optimizer without them."""
        moments = self._moments()
        if moments is None:
            return 1.0, 1.0
        mh, vh, b1, eps = moments
        m2, v = mh.double().square(), vh.double()
        c = (1 - b1) / (1 + b1)  # the share of the gradient's noise variance the momentum keeps
        signal = (m2 - c * (v - m2)).clamp(min=0)
        noise = (v - signal).clamp(min=0)
        weight = signal + c * noise / world  # the squared momentum of the whole batch: both steps' numerator
        dense = weight / ((signal + noise / world).sqrt() + eps).square()
        own = weight / (v.sqrt() + eps).square()
        return float(dense.sum()), float(own.sum())

    def batch_gain(self, world: int) -> torch.Tensor | None:
        """Per coordinate, how much longer Adam's step on ``world`` times the batch is than
        this worker's, ``(sqrt(v) + eps) / (sqrt(v') + eps)`` in [1, sqrt(world)]
        (:func:`_batch_second_moment`'s ``v'``). None before a step or without Adam."""
        moments = self._moments()
        if moments is None:
            return None
        _, vh, _, eps = moments
        return (vh.sqrt() + eps) / (_batch_second_moment(moments, world).sqrt() + eps)

    def take_denominator(self, v: torch.Tensor,
                         moments: tuple[torch.Tensor, torch.Tensor, float, float] | None = None) -> None:
        """The latest Adam step taken again with the bias-corrected second moment ``v``
        (``moments``: :meth:`_moments`, when the caller has them)."""
        if moments is None:
            moments = self._moments()
        if moments is not None:
            mh, vh, _, eps = moments
            self.w.sub_(self.opt.param_groups[0]["lr"] * mh * (1 / (v.sqrt() + eps) - 1 / (vh.sqrt() + eps)))

    def step(self, g: torch.Tensor, t: int) -> None:
        for group in self.opt.param_groups:
            group["lr"] = self.wl.lr_at(t) * self.lr_mult
        self.w.grad = g
        self.opt.step()
        if self.batch_mult > 1:  # ``adamc``: the step taken again with the whole batch's second moment
            moments = self._moments()
            if moments is not None:
                self.take_denominator(_batch_second_moment(moments, self.batch_mult), moments)


def _halves(batch: tuple[torch.Tensor, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A batch's two halves (its first dimension split), for ``vsplit``."""
    x, y = batch
    h = x.shape[0] // 2
    return [(x[:h], y[:h]), (x[h:], y[h:])]


def _round(x: torch.Tensor, dtype: str) -> torch.Tensor:
    if dtype == "f32":
        return x.clone()
    if dtype == "f16":
        return x.half().float()
    if dtype == "bf16":
        return x.bfloat16().float()
    return torch.from_numpy(quantise(np.ascontiguousarray(x.numpy(), dtype=np.float32), dtype))


def _top(vec: torch.Tensor, ns: int, k: int) -> torch.Tensor:
    """The indices of ``vec``'s top ``k`` magnitudes in ``[0, ns)``, ascending."""
    return torch.topk(vec[:ns].abs(), min(k, ns), sorted=False).indices.sort().values


def _sparse_send(vec: torch.Tensor, ns: int, k: int, dtype: str, small_dtype: str,
                 at: torch.Tensor | None = None) -> torch.Tensor:
    """What a receiver decodes of ``vec``: its top ``k`` magnitudes of ``[0, ns)``
    (ascending index order, coded ``dtype``), its values at the indices ``at`` of
    ``[0, ns)`` too (a set the receiver knows: values only), and all of ``[ns, n)`` coded
    ``small_dtype``."""
    out = torch.zeros_like(vec)
    idx = _top(vec, ns, k) if k > 0 and ns > 0 else torch.zeros(0, dtype=torch.long)
    if at is not None:
        idx = torch.cat([idx, at]).unique()
    if len(idx):
        out[idx] = _round(vec[idx], dtype)
    out[ns:] = _round(vec[ns:], small_dtype)
    return out


def _push_indices(rule: Rule, unsent: list[torch.Tensor], ns: int, k: int, round_no: int,
                  b_idx: torch.Tensor | None) -> tuple[int, torch.Tensor | None]:
    """``(own_k, at)`` of the round's pushes (:func:`_sparse_send`): each worker's own top
    ``own_k`` and its values at the shared indices ``at`` (the rule's ``index``)."""
    if rule.index == "gtopk":  # an oracle: the top k of the workers' summed unsent change
        return 0, _top(torch.stack(unsent).sum(0), ns, k)
    if rule.index == "cyclic":  # the round's leader's own top k, known to all before they push
        return 0, _top(unsent[round_no % len(unsent)], ns, k)
    if rule.index == "bidx":  # the latest broadcast's indices, which every replica has
        return max(1, round(rule.own * k)), b_idx
    return k, None


def _hold(w: torch.Tensor, w0: torch.Tensor, unsent: torch.Tensor, held: float) -> None:
    """``heldF``: a local step from ``w0`` to ``w`` joins the worker's unsent change
    (``a - w``'s sign) whole, and its model at ``F`` of it: ``w <- w0 + F (w - w0)``."""
    step = w - w0
    unsent.sub_(step)
    w.copy_(torch.add(w0, step, alpha=held))


def heldout_loss(wl: WL.Workload, model: torch.nn.Module) -> float:
    """The workload's held-out cross-entropy (the LMs' own metric; the test set's for digits)."""
    if wl.metric == "heldout_loss":
        return wl.evaluate(model)
    _, _, x, y = WL.digits_data()
    was = model.training
    model.eval()
    with torch.no_grad():
        val = float(F.cross_entropy(model(x), y))
    model.train(was)
    return val


@dataclass
class Config:
    workload: str
    world: int
    H: int
    density: float
    rule: str
    seed: int
    steps: int
    pull: str = "broadcast"
    factor: float = 2.0
    push_values: str = "f16"
    bcast_values: str = "q4"
    eval_every: int = 10
    staleness: int = 1  # 0: each round's result is merged before the next local step (no overlap)


@dataclass
class Curve:
    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)  # worker 0's model (what bench.e2e evaluates)
    server: list[float] = field(default_factory=list)  # the server's exact model at the same steps

    def best(self) -> list[float]:
        return list(itertools.accumulate(self.loss, min))


def _evaluate(wl, model, flat: Flat, vec: torch.Tensor, curve: Curve, step: int) -> None:
    flat.load(vec)
    curve.steps.append(step)
    curve.loss.append(heldout_loss(wl, model))


def run_dense(workload: str, world: int, seed: int, steps: int, eval_every: int, lr_mult: float = 1.0) -> Curve:
    """Dense training at the global batch of ``world`` workers (what DDP computes), at
    ``lr_mult`` times the workload's learning rate (a check that a rule's gain is not
    only a larger step the workload's own rate would also give)."""
    wl = WL.get(workload)
    model = wl.build_model(seed)
    flat = Flat(model, DENSE_BELOW)
    w = flat.get()
    opt = Inner(wl, w, lr_mult)
    batches = wl.batches(0, 1, wl.batch_size * world, seed)
    curve = Curve()
    _evaluate(wl, model, flat, w, curve, 0)
    for t in range(steps):
        flat.load(w)
        model.zero_grad(set_to_none=True)
        wl.loss(model, next(batches)).backward()
        opt.step(flat.grad(), t)
        if (t + 1) % eval_every == 0:
            _evaluate(wl, model, flat, w, curve, t + 1)
    return curve


def _lend(mean: torch.Tensor, total: torch.Tensor, carried: torch.Tensor, loan: torch.Tensor, world: int,
          decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``lend``: the step's pseudo-gradient from its mean, and the coordinates it moves.
    Pushes that agree with a coordinate's outstanding loan repay it (their mean part is
    not applied again, up to the loan); pushes that disagree take it back whole; a
    coordinate some but not all workers pushed, with no loan, is lent the others' shares
    (applied at the pushers' mean, not divided by W); every loan decays back by ``1 -
    decay`` a step. What is applied in the end is the sum of the means."""
    agree, disagree = mean * loan > 0, mean * loan < 0
    repay = torch.where(agree, loan.sign() * torch.minimum(mean.abs(), loan.abs()), torch.zeros_like(loan))
    g = mean - repay - torch.where(disagree, loan, torch.zeros_like(loan))
    loan.sub_(repay)
    loan[disagree] = 0.0
    lent = (carried > 0) & (carried < world) & (loan == 0)
    extra = torch.where(lent, total / carried.clamp(min=1) - mean, torch.zeros_like(loan))
    g = g + extra
    loan.add_(extra)
    back = loan * (1.0 - decay)
    g = g - back
    loan.sub_(back)
    return g, (loan != 0) | (back != 0) | disagree


def run_stella(cfg: Config) -> Curve:
    wl = WL.get(cfg.workload)
    rule = Rule.parse(cfg.rule)
    W = cfg.world
    model = wl.build_model(cfg.seed)
    flat = Flat(model, DENSE_BELOW)
    x = flat.get()                       # the server's exact model
    B = x.clone()                        # the broadcast model every replica holds
    R = torch.zeros_like(x)              # what the server owes the replicas
    buf = torch.zeros_like(x) if rule.momentum else None
    ws = [x.clone() for _ in range(W)]   # the workers' weights
    anchors = [x.clone() for _ in range(W)]
    inflight: list[torch.Tensor | None] = [None] * W
    inner = [Inner(wl, w, batch_mult=W if rule.adamc else 1) for w in ws]
    batches = [wl.batches(r, W, wl.batch_size, cfg.seed) for r in range(W)]
    k = max(1, round(cfg.density * flat.ns))
    share = broadcast_share(cfg.density, cfg.push_values)  # the server's budget counts the pushes' bits
    kb = max(1, round(cfg.factor * share * k))
    lr_out = rule.outer_lr(W)
    norms: list[float] = []
    vd: torch.Tensor | None = None  # ``vdense``'s running second moment of the mean gradient
    # ``vsplit``: each worker's running second moment of its gradient's noise, from its batch's two halves
    split_noise: list[torch.Tensor | None] = [None] * W
    b2s = inner[0].opt.param_groups[0]["betas"][1] if rule.vsplit or rule.vdiff else 0.0
    # ``vdiff``: the same noise from two successive steps' gradients, (g_t - g_t-1)^2 / 2 (no halves)
    prev_grad: list[torch.Tensor | None] = [None] * W
    diff_count = [0] * W
    loan = torch.zeros_like(x)  # ``lend``: what the outer step applied beyond the mean, per coordinate
    q_ema: float | None = None
    b_idx: torch.Tensor | None = None  # ``bidx``: the latest broadcast's indices of [0, ns) (every replica has them)
    n_values: list[int] = []  # values of [0, ns) a push carries, for the bytes
    ages = [torch.zeros(flat.ns) for _ in range(W)] if rule.age else []  # ``age``: rounds since each was pushed
    held = rule.held_weight(W)
    # ``heldF``: each worker's unsent change kept apart, its model the broadcast model less
    # F times it (F = 1: today's worker, whose model holds all of its own unsent progress)
    unsent_own = [torch.zeros_like(x) for _ in range(W)] if held != 1.0 else None

    def merge(i: int) -> None:
        """Worker ``i`` installs the round its push in flight was in: ``w <- w + (B - a) + c``,
        ``a <- B`` (nothing in flight: nothing to install)."""
        c_sent = inflight[i]
        if c_sent is not None:
            if unsent_own is not None:
                ws[i].copy_(B - held * unsent_own[i])
            else:
                ws[i].add_(B - anchors[i])
                ws[i].add_(c_sent, alpha=1.0 / W if rule.eager else 1.0)
            anchors[i] = B.clone()
            inflight[i] = None

    curve = Curve()
    _evaluate(wl, model, flat, x, curve, 0)
    curve.server.append(curve.loss[0])
    for t in range(cfg.steps + 1):
        if t % cfg.H == 0 or t == cfg.steps:
            pushes = []
            for i in range(W):
                merge(i)  # the previous round
            unsent = unsent_own if unsent_own is not None else [anchors[i] - ws[i] for i in range(W)]
            k_t = k
            if rule.warm and t < rule.warm:  # density warm-up: 10x the run's at step 0, the run's at step N
                k_t = min(flat.ns, round(k * 10 ** (1 - t / rule.warm)))
            kb = max(1, round(cfg.factor * share * k_t))
            own_k, at = _push_indices(rule, unsent, flat.ns, k_t, t // cfg.H, b_idx)
            for i in range(W):
                state = inner[i].opt.state.get(inner[i].w, {})
                vi = state.get("exp_avg_sq") if rule.selv else state.get("exp_avg") if rule.selm else None
                if vi is not None and at is None:  # the top k by |unsent| weighted by the gradient's scale
                    weight = (vi[:flat.ns] + 1e-30).pow(rule.selv) if rule.selv else \
                        (vi[:flat.ns].abs() + 1e-30).pow(rule.selm)
                    score = unsent[i][:flat.ns].abs() * weight
                    if rule.age:
                        score = score * (1.0 + ages[i] / rule.age)
                    sel = torch.topk(score, min(own_k, flat.ns), sorted=False).indices.sort().values
                    c = _sparse_send(unsent[i], flat.ns, 0, cfg.push_values, "f16", sel)
                else:
                    c = _sparse_send(unsent[i], flat.ns, own_k, cfg.push_values, "f16", at)
                n_values.append(int((c[:flat.ns] != 0).sum()))
                if rule.age:
                    ages[i].add_(1.0)
                    ages[i][c[:flat.ns] != 0] = 0.0
                if unsent_own is not None:
                    unsent_own[i].sub_(c)
                if rule.eager:  # the worker's own push counts at its share of the mean, at once
                    ws[i].add_(c, alpha=1.0 - 1.0 / W)
                inflight[i] = c
                gain = inner[i].batch_gain(W) if rule.adamcp else None
                pushes.append(c if gain is None else c * gain)
            total = torch.stack(pushes).sum(0)
            carried = torch.stack([p != 0 for p in pushes]).sum(0)
            touched = carried > 0
            touched[flat.ns:] = True
            g = total / carried.clamp(min=1) if rule.count else total / W
            power = rule.count_power
            if rule.taper:  # the exponent at the step's density, as stella-ps's "tapered" outer step takes it
                power = count_exponent_at({"count_exponent": power, "count_taper_from": rule.taper[0],
                                           "count_taper_to": rule.taper[1]}, sum(n_values[-W:]) / (W * flat.ns))
            if power:  # a coordinate few workers pushed scaled up, one all pushed left at the mean
                g *= (W / carried.clamp(min=1)) ** power
            if rule.lend:  # lend a coordinate the shares of the workers that did not push it, take them back later
                g, moved = _lend(g, total, carried, loan, W, rule.lend)
                touched |= moved
            if rule.norm:  # the mean's length brought to the pushes' RMS length, between 1x and sqrt(W)x
                sumsq = sum(float(p.double().square().sum()) for p in pushes)
                tot = float(total.double().square().sum())
                q = min(float(W), max(1.0, W * sumsq / tot if tot > 0 else 1.0))
                if rule.norm_ema:  # this step at the estimate of the steps before it, then the estimate updated
                    q_used = q_ema if q_ema is not None else 1.0
                    q_ema = q if q_ema is None else rule.norm_ema * q_ema + (1 - rule.norm_ema) * q
                    q = q_used
                lr_out = rule.lr * math.sqrt(q)
                norms.append(lr_out / rule.lr)
            if rule.adamv and t > 0:  # the mean's step scaled to the step Adam would take on the whole batch
                gains = [inner[i].dense_gain(W) for i in range(W)]
                q = sum(d for d, _ in gains) / max(sum(o for _, o in gains), 1e-30)
                lr_out = rule.lr * min(math.sqrt(W), max(1.0, math.sqrt(q)))
                norms.append(lr_out / rule.lr)
            old = x.clone()
            if buf is not None:
                buf[touched] = rule.momentum * buf[touched] + g[touched]
                d = g[touched] + rule.momentum * buf[touched] if rule.nesterov else buf[touched]
                x[touched] -= lr_out * d
            else:
                x[touched] -= lr_out * g[touched]
            if cfg.pull == "exact":
                B = x.clone()
            else:
                R += x - old
                m = _sparse_send(R, flat.ns, kb, cfg.bcast_values, "f16")
                R -= m
                b_idx = m[:flat.ns].nonzero().flatten()
                B = B + m
            if cfg.staleness == 0:  # this round, before the next local step
                for i in range(W):
                    merge(i)
            if (t % cfg.eval_every == 0 and t) or t == cfg.steps:
                _evaluate(wl, model, flat, ws[0], curve, t)
                flat.load(x)
                curve.server.append(heldout_loss(wl, model))
        if t == cfg.steps:
            break
        before = [w.clone() for w in ws] if unsent_own is not None else []
        grads = []
        for i in range(W):
            flat.load(ws[i])
            batch = next(batches[i])
            if rule.vsplit:  # the gradient of each half of the batch: their mean, and the noise their difference shows
                halves = []
                for part in _halves(batch):
                    model.zero_grad(set_to_none=True)
                    wl.loss(model, part).backward()
                    halves.append(flat.grad())
                grads.append((halves[0] + halves[1]) / 2)
                noise_sq = ((halves[0] - halves[1]) / 2).square()
                running = split_noise[i]
                split_noise[i] = (noise_sq * (1 - b2s) if running is None
                                  else running.mul_(b2s).add_(noise_sq, alpha=1 - b2s))
                continue
            model.zero_grad(set_to_none=True)
            wl.loss(model, batch).backward()
            grads.append(flat.grad())
            if rule.vdiff:
                prev = prev_grad[i]
                if prev is not None:
                    noise_sq = (grads[-1] - prev).square_().mul_(0.5)
                    running = split_noise[i]
                    split_noise[i] = (noise_sq * (1 - b2s) if running is None
                                      else running.mul_(b2s).add_(noise_sq, alpha=1 - b2s))
                    diff_count[i] += 1
                prev_grad[i] = grads[-1].clone()
        if rule.vdense:  # the oracle: the second moment of the workers' mean gradient (a dense exchange a step)
            b2 = inner[0].opt.param_groups[0]["betas"][1]
            g_mean = torch.stack(grads).mean(0)
            vd = g_mean.square().mul_(1 - b2) if vd is None else vd.mul_(b2).addcmul_(g_mean, g_mean, value=1 - b2)
        for i in range(W):
            inner[i].step(grads[i], t)
            if rule.vdense:
                inner[i].take_denominator(vd / (1 - b2 ** (t + 1)))
            if rule.vsplit:  # the whole batch's second moment: the worker's, less (1 - 1/W) of its measured noise
                mo = inner[i]._moments()
                noise = split_noise[i]
                if mo is not None and noise is not None:
                    vh = mo[1]
                    We = W ** rule.vworld
                    v_est = torch.maximum(vh - (1 - 1 / We) * noise / (1 - b2s ** (t + 1)), vh / We)
                    inner[i].take_denominator(v_est, mo)
            if rule.vdiff:
                mo = inner[i]._moments()
                noise = split_noise[i]
                if mo is not None and noise is not None:
                    vh = mo[1]
                    v_est = torch.maximum(vh - (1 - 1 / W) * noise / (1 - b2s ** diff_count[i]), vh / W)
                    inner[i].take_denominator(v_est, mo)
        if rule.vmix:  # the whole batch's second moment from the workers' mean moments: v / W + (1 - 1/W) m^2
            moments = [inner[i]._moments() for i in range(W)]
            if all(mo is not None for mo in moments):
                m_bar = torch.stack([mo[0] for mo in moments if mo is not None]).mean(0)
                v_bar = torch.stack([mo[1] for mo in moments if mo is not None]).mean(0)
                v_est = torch.minimum(v_bar / W + (1 - 1 / W) * m_bar.square(), v_bar)
                for i in range(W):
                    inner[i].take_denominator(v_est)
        if rule.vshare:  # every worker's second moment becomes their mean (a probe: it would cost a dense exchange)
            vs = [inner[i].opt.state[ws[i]]["exp_avg_sq"] for i in range(W)]
            mean_v = torch.stack(vs).mean(0)
            for v in vs:
                v.copy_(mean_v)
        for i, w0 in enumerate(before):
            assert unsent_own is not None
            _hold(ws[i], w0, unsent_own[i], held)
    if rule.index:
        print(f"#   values a push carries (seed {cfg.seed}): {statistics.mean(n_values) / k:.2f} k", flush=True)
    if norms:
        qs = np.quantile(norms, [0.1, 0.5, 0.9])
        print(f"#   norm multiplier (seed {cfg.seed}): p10 {qs[0]:.2f} median {qs[1]:.2f} p90 {qs[2]:.2f}", flush=True)
    return curve


def _interp_step(curve_steps: list[int], best: list[float], level: float) -> float | None:
    """The (interpolated) step a running-best curve first reaches ``level``."""
    for j, v in enumerate(best):
        if v <= level:
            if j == 0:
                return float(curve_steps[0])
            s0, s1, v0 = curve_steps[j - 1], curve_steps[j], best[j - 1]
            return s0 + (s1 - s0) * (v0 - level) / max(v0 - v, 1e-12)
    return None


def step_ratio(stella: Curve, dense: Curve) -> float:
    """Iterations Stella needs against dense (see the module's text)."""
    sb, db = stella.best(), dense.best()
    T = stella.steps[-1]
    reached = _interp_step(stella.steps, sb, db[-1])
    if reached is not None:
        return reached / dense.steps[-1]
    td = _interp_step(dense.steps, db, sb[-1])
    return T / td if td else math.inf


def plot(rows: list[dict], path: str) -> None:
    """Iterations against dense over W, one line per (workload, H, density, rule), with
    each seed's value as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[tuple, list[dict]] = {}
    for r in rows:
        lines.setdefault((r["workload"], r["H"], r["density"], r["rule"]), []).append(r)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (workload, H, density, rule), rs in sorted(lines.items()):
        rs.sort(key=lambda r: r["W"])
        ws = [r["W"] for r in rs]
        (line,) = ax.plot(ws, [r["ratio"] for r in rs], marker="o",
                          label=f"{workload} H={H} {density:g} {rule}")
        for r in rs:
            ax.scatter([r["W"]] * len(r["ratios"]), r["ratios"], s=8, color=line.get_color(), alpha=0.5)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers W")
    ax.set_ylabel("iterations against dense at the same global batch")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="digits")
    ap.add_argument("--workers", default="2,8")
    ap.add_argument("--H", default="1")
    ap.add_argument("--density", default="0.01")
    ap.add_argument("--rules", default="avg,lr2,nesterov")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--pull", default="broadcast", choices=("broadcast", "exact"))
    ap.add_argument("--factor", type=float, default=2.0)
    ap.add_argument("--staleness", type=int, default=1, choices=(0, 1),
                    help="0: each round's result reaches the workers before their next local step")
    ap.add_argument("--push-values", default="f16")
    ap.add_argument("--bcast-values", default="q4")
    ap.add_argument("--dense-lr-mult", type=float, default=1.0,
                    help="the dense reference at this multiple of the workload's learning rate")
    ap.add_argument("--json")
    ap.add_argument("--plot", metavar="PNG", help="with --from: plot the rows of these JSON files (those of --rules "
                    "and --H) and stop")
    ap.add_argument("--from", dest="sources", default="", help="comma-separated JSON files of earlier runs")
    a = ap.parse_args(argv)
    if a.plot:
        rules, hs = a.rules.split(","), [int(h) for h in a.H.split(",")]
        shown: list[dict] = []
        for src in filter(None, a.sources.split(",")):
            with open(src) as f:
                shown += [r for r in json.load(f)["rows"] if r["rule"] in rules and r["H"] in hs]
        plot(shown, a.plot)
        return
    torch.set_num_threads(1)
    ints = lambda s: [int(v) for v in s.split(",")]
    rows: list[dict] = []
    print(f"# load {loadavg()}; dense at {a.dense_lr_mult}x the workload's lr", flush=True)
    print(f"{'workload':8s} {'W':>3s} {'H':>3s} {'density':>7s} {'rule':16s} {'ratio':>6s}  seeds", flush=True)
    for workload in a.workloads.split(","):
        for W in ints(a.workers):
            ev = a.eval_every
            dense = {s: run_dense(workload, W, s, a.steps, ev, a.dense_lr_mult) for s in ints(a.seeds)}
            for H, dens, rule in itertools.product(ints(a.H), [float(d) for d in a.density.split(",")],
                                                   a.rules.split(",")):
                t0 = time.time()
                ratios, curves = [], []
                for s in ints(a.seeds):
                    cfg = Config(workload, W, H, dens, rule, s, a.steps, a.pull, a.factor, a.push_values,
                                 a.bcast_values, ev if ev % H == 0 else H * max(1, round(ev / H)), a.staleness)
                    c = run_stella(cfg)
                    ratios.append(step_ratio(c, dense[s]))
                    print(f"#   {workload} W={W} H={H} {dens:g} {rule} seed {s}: {ratios[-1]:.3f} "
                          f"({time.time() - t0:.0f} s so far)", flush=True)  # a long row's progress
                    curves.append({"seed": s, "steps": c.steps, "loss": c.loss, "server_loss": c.server,
                                   "dense_steps": dense[s].steps, "dense_loss": dense[s].loss})
                mean = statistics.mean(ratios)
                print(f"{workload:8s} {W:3d} {H:3d} {dens:7.4f} {rule:16s} {mean:6.3f}  "
                      f"{' '.join(f'{r:.3f}' for r in ratios)}  ({time.time() - t0:.0f} s)", flush=True)
                rows.append({"workload": workload, "W": W, "H": H, "density": dens, "rule": rule,
                             "pull": a.pull, "staleness": a.staleness, "steps": a.steps,
                             "dense_lr_mult": a.dense_lr_mult, "ratio": mean,
                             "ratios": ratios, "curves": curves})
                if a.json:
                    with open(a.json, "w") as f:
                        json.dump({"argv": sys.argv[1:], "rows": rows}, f)


if __name__ == "__main__":
    main()
