"""The performance model: one configuration's seconds per iteration, time to target and cost.

It follows Stella's own structure. A round is ``H`` local steps on every machine (a site:
its GPUs combine inside with torch.distributed and one worker speaks over the WAN). The
slowest machine sets the round's compute; faster ones run on (more local steps, up to
``max_sync_every``) and their pushes carry more samples. The exchange of a round runs in
the background while the next round computes (one round stale): compress, push over the
slowest uplink (and the server site's downlink, which carries every worker's push), the
server's step (per pushed coordinate and per model coordinate, divided among shards), the
broadcast pull over the slowest downlink (and the server site's uplink, which carries it to
every worker), and the wait of a message that loses its tail in a drop-tail queue. The server
site's link is full duplex: where it is the bottleneck, the pushes of the next round arrive
while the broadcast still goes out, and the two directions overlap (:func:`_evaluate_arrays`).
A round lasts the longer of compute and exchange (their expected max, with the calibration's
jitter). The profile's :class:`~stella.planning.profile_file.Calibration`
scales it: the compute scale, processor sharing on a shared host, the share of it the
exchange's CPU work takes, the link scale, a fixed overhead per round and the tail loss's
wait (docs/plan.md section 3).

**Time to target** = dense iterations (at the job's global batch, through a critical batch
size: iterations scale as ``1 + B_crit / B``) x the configuration's iterations factor, at
the predicted iterations per second. **Revocations**: a spot kind of ``n`` machines with a
mean time to revocation ``m`` loses ``n T / m`` machines over ``T``; each costs the
server's stall on the silent worker (the chaos benchmark's figure), the replacement's
start and snapshot pull during which the job runs without that machine's share, and its
lost work (its unsent local steps and residual). Cost = machines' prices x time + the
server hosts; the share of it due to revocations is reported.

:func:`predict` answers one configuration; :func:`evaluate` answers arrays of machine mixes
(:func:`mix_arrays`) x settings at once, vectorised with NumPy, for the search. No torch.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .catalog import Catalog, MachineKind
from .profile_file import Profile

__all__ = ["Group", "Config", "Prediction", "Mix", "mix_arrays", "evaluate", "expected_max", "predict",
           "prediction", "with_spread", "BOUNDS", "SHARD_EXPONENT", "START_S", "MAX_RATIO_H", "TAIL_OVERFLOW",
           "TAIL_FLIGHT_BYTES"]

# bench.server (bench/RESULTS.md 2026-11-26): 2 shards on 2 cores made 1.78-1.80x one shard's steps/s (W = 2);
# S shards divide the server's step by S^0.85
SHARD_EXPONENT = 0.85
# a replacement worker's process start (imports, CUDA, join) before its snapshot pull: an allowance, not measured
START_S = 10.0
MAX_RATIO_H = 8  # run-on: a fast machine makes at most this many times the slowest one's local steps


@dataclass(frozen=True)
class Group:
    """Machines of one kind in one market ("onprem", "ondemand" or "spot")."""

    kind: MachineKind
    market: str
    count: int

    @property
    def label(self) -> str:
        return f"{self.count}x {self.kind.name}" + ("" if self.market == "onprem" else f" ({self.market})")


@dataclass(frozen=True)
class Config:
    groups: tuple[Group, ...]
    density: float
    coding: str
    sync_every: int  # H
    shards: int = 1

    @property
    def workers(self) -> int:
        return sum(g.count for g in self.groups)

    @property
    def machines(self) -> str:
        return " + ".join(g.label for g in self.groups)


@dataclass(frozen=True)
class Prediction:
    config: Config
    s_per_it: float  # seconds per local step of the slowest machine (round / H)
    round_s: float
    compute_s: float  # a round's compute (the slowest machine's H steps)
    exchange_s: float  # a round's exchange: compress + link + server + fixed
    link_s: float
    server_s: float
    bound: str  # what sets the round: compute, push, pull, server
    max_sync_every: int  # what the fastest machine needs to run on through the round
    samples_per_s: float
    iterations: float  # the job's iterations to the target (dense x factor at its batch)
    factor: float
    factor_source: str
    time_s: float  # to the target, revocations included
    revocations: float  # expected
    cost: float
    revocation_cost: float  # the part of cost due to revocations
    factor_measured: bool = True  # the factor is the table's entry for this configuration (not a bound, not assumed)
    # the exchange's terms, each as it enters the round (seconds): the slowest machine's compressor and fixed CPU,
    # the push and the pull (the link coefficient applied), the part of them the server link's two directions
    # overlap, the tail-loss wait, twice the largest RTT, the fixed overhead; and where the push and the pull are
    # bound ("uplink"/"downlink": the slowest machine's own link, "server": the server site's link carrying all W)
    compress_s: float = 0.0
    push_s: float = 0.0
    pull_s: float = 0.0
    duplex_s: float = 0.0  # what the server link's two directions overlap (full duplex): push + pull less this
    tail_s: float = 0.0
    rtt_s: float = 0.0
    fixed_s: float = 0.0
    push_at: str = ""
    pull_at: str = ""
    # with the profile's spread of the step time: s/it and time to target at its quartiles (None: no spread)
    s_per_it_range: tuple[float, float] | None = None
    time_range: tuple[float, float] | None = None

    @property
    def overlap_s(self) -> float:
        """What the round hides: compute and exchange run side by side (one round stale)."""
        return self.compute_s + self.exchange_s - self.round_s


@dataclass(frozen=True)
class Mix:
    """A machine mix as the model reads it: arrays of shape (mixes, groups)."""

    count: Any
    gpus: Any
    t_rel: Any  # step time relative to the profiled machine (1 / speed); inf where count is 0
    up: Any  # bytes/s
    down: Any
    rtt: Any  # seconds
    price: Any  # per machine-hour in its market
    lam: Any  # revocations per second per machine (0: not spot)
    replace_s: Any
    burst: Any  # bytes
    up_queue: Any  # bytes a link's bottleneck holds (rate x queue + burst; 0: not modelled)
    down_queue: Any
    host: Any  # index into the catalog's hosts, -1: a host of its own
    # derived once (shape (mixes, 1) unless said): what every setting reads
    w: Any = None  # workers
    t_rel_max: Any = None  # the slowest machine's step time relative to the profiled one
    t_rel_min: Any = None
    inv_up: Any = None  # seconds per byte of the slowest uplink
    inv_down: Any = None
    rtt_max: Any = None
    gpus_total: Any = None
    rate: Any = None  # revocations per second of each group (mixes, groups)
    rate_total: Any = None
    price_h: Any = None  # the machines' price per hour
    boot_rate: Any = None  # replacements' price per second of the job
    rejoin_s: Any = None  # (mixes, groups) of a machine's snapshot pull, per model coordinate


GOODPUT = 1.0  # nominal rates; the link coefficient of the calibration takes the protocol overhead


def mix_arrays(mixes: Sequence[Sequence[Group]], hosts: Sequence[tuple[str, int]] = ()):
    import numpy as np

    width = max(1, max(len(m) for m in mixes))
    index = {name: i for i, (name, _) in enumerate(hosts)}
    # per distinct (kind, market): its fields, once (a catalog has a few kinds; the mixes, millions of groups)
    fields = ("count", "gpus", "t_rel", "up", "down", "rtt", "price", "lam", "replace_s", "burst", "up_queue",
              "down_queue", "host")
    absent = (0.0, 0.0, math.inf, math.inf, math.inf, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1)
    seen: dict[tuple[int, str], tuple[float, ...]] = {}

    def row(g: Group) -> tuple[float, ...]:
        key = (id(g.kind), g.market)
        if key not in seen:
            k = g.kind
            up, down = k.up_mbps * 1e6 / 8 * GOODPUT, k.down_mbps * 1e6 / 8 * GOODPUT
            burst = k.burst_kb * 1024
            seen[key] = (k.gpus, 1.0 / k.speed, up, down, k.rtt_ms / 1e3, k.price_of(g.market),
                         1.0 / (k.mttr_h * 3600.0) if g.market == "spot" and k.mttr_h else 0.0, k.replace_s, burst,
                         up * k.up_queue_ms / 1e3 + burst if k.up_queue_ms > 0 else 0.0,
                         down * k.down_queue_ms / 1e3 + burst if k.down_queue_ms > 0 else 0.0,
                         index[k.host] if k.host else -1)
        return (g.count, *seen[key])

    table = np.array([[row(g) for g in m] + [absent] * (width - len(m)) for m in mixes], float)
    a = {f: table[:, :, i] for i, f in enumerate(fields)}
    a["host"] = a["host"].astype(int)
    present = a["count"] > 0
    col = lambda x: x[:, None]
    rate = a["count"] * a["lam"]
    return Mix(**a, w=col(a["count"].sum(axis=1)), t_rel_max=col(np.where(present, a["t_rel"], 0.0).max(axis=1)),
                t_rel_min=col(a["t_rel"].min(axis=1)), inv_up=col((1 / a["up"]).max(axis=1)),
                inv_down=col((1 / a["down"]).max(axis=1)),
                rtt_max=col(a["rtt"].max(axis=1)),
                gpus_total=col((a["count"] * a["gpus"]).sum(axis=1)), rate=rate, rate_total=col(rate.sum(axis=1)),
                price_h=col((a["count"] * a["price"]).sum(axis=1)),
                boot_rate=col((rate * a["price"] * a["replace_s"]).sum(axis=1)) / 3600,
                rejoin_s=np.where(present, 4 / a["down"], 0.0))


def evaluate(profile: Profile, catalog: Catalog, mix: Mix, settings: Sequence[tuple[float, str, int, int]],
              checkpoint_every: int = 100, detail: bool = True) -> dict[str, Any]:
    """The model for every mix (rows) at every setting ``(density, coding, H, shards)``
    (columns): a dict of arrays of shape (mixes, settings)."""
    import numpy as np

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # inf: a configuration not considered
        return _evaluate_arrays(np, profile, catalog, mix, settings, checkpoint_every, detail)


def _evaluate_arrays(np: Any, profile: Profile, catalog: Catalog, mix: Mix,
                     settings: Sequence[tuple[float, str, int, int]], checkpoint_every: int,
                     detail: bool) -> dict[str, Any]:
    cal, srv, n, bs = profile.calibration, catalog.server, profile.numel, profile.batch_size
    d = np.array([x[0] for x in settings], float)[None, :]
    h = np.array([x[2] for x in settings], float)[None, :]
    shards = np.array([x[3] for x in settings], float)[None, :]
    push_b = np.array([profile.push_bytes(x[0], x[1]) for x in settings])[None, :]
    pull_b = np.array([profile.pull_bytes(x[0], x[1]) for x in settings])[None, :]
    w = mix.w
    # the exchange of a round: compress, push (slowest uplink, or the server's downlink carrying every push),
    # the server's step (per pushed and per model coordinate, over the shards), the broadcast pull
    hosts = np.ceil(shards / srv.cores)
    # each machine's message over its own link, less what its shaper's burst lets through at line rate (the
    # bucket refills between rounds), the slowest of them
    if mix.burst.any():
        burst = mix.burst[:, :, None]
        push_s = (np.maximum(push_b[:, None, :] - burst, 0) / mix.up[:, :, None]).max(axis=1)
        pull_s = (np.maximum(pull_b[:, None, :] - burst, 0) / mix.down[:, :, None]).max(axis=1)
    else:
        push_s, pull_s = push_b * mix.inv_up, pull_b * mix.inv_down
    # the server site's link carries every worker's push in (its downlink) and the broadcast to every worker out
    # (its uplink): W messages each way per round, one message at the server's rate for the first one served
    srv_down, srv_up = srv.down_mbps * 1e6 / 8 * hosts, srv.up_mbps * 1e6 / 8 * hosts
    push_srv, pull_srv = push_b * w / srv_down, pull_b * w / srv_up
    push_at_srv, pull_at_srv = push_srv > push_s, pull_srv > pull_s
    push_one, pull_one = np.maximum(push_s, push_b / srv_down), np.maximum(pull_s, pull_b / srv_up)
    push_s = np.maximum(push_s, push_srv)
    pull_s = np.maximum(pull_s, pull_srv)
    # full duplex: the two directions of the server's link overlap across workers. In steady state a worker
    # pushes round r+1 as soon as its own pull of round r is in (one exchange in flight), while the broadcast
    # still goes out to the others; the server steps once it has all W pushes. So a round's link time is the
    # busier direction's W messages plus one message the other way (the first pull before the first push, or
    # the last push after the last pull): max(push + pull_one, push_one + pull), and the sum less their
    # overlap. Where the server's link is not the bottleneck (push = push_one, pull = pull_one) the overlap is 0
    duplex = np.minimum(push_s - push_one, pull_s - pull_one)
    tail = 0.0
    if cal.tail_loss and (mix.up_queue.any() or mix.down_queue.any()):
        # a machine's queue overflows only where the other end sends faster than the machine's link drains: a
        # server site whose link is no faster paces the flight itself (its own shaper pushes back on TCP)
        up_q = np.where(mix.up < srv.down_mbps * 1e6 / 8, mix.up_queue, 0.0)
        down_q = np.where(mix.down < srv.up_mbps * 1e6 / 8, mix.down_queue, 0.0)
        tail = cal.tail_loss * (_tail_loss_s(np, push_b, up_q, mix.up) + _tail_loss_s(np, pull_b, down_q, mix.down))
    link = cal.link * (push_s + pull_s - duplex) + tail + 2 * mix.rtt_max
    server = (profile.server_per_update_s * w * profile.sparse_numel * d + profile.server_per_numel_s * n) / \
        np.minimum(shards, srv.cores * hosts) ** SHARD_EXPONENT
    # one worker's CPU per round: its compressor, and the fixed rest (decode and apply the pull, the messages)
    compress_1 = np.array([profile.compress_s(x[0], x[1]) for x in settings])[None, :] + cal.worker_round_s
    # compute: each machine's step, calibrated and stretched by its shared host; the slowest sets the round
    step = profile.compute_s * cal.compute
    if (mix.host >= 0).any():
        load, stretch, s_server = _host_load(np, catalog, mix, profile.compute_s, h, compress_1, server,
                                             cal.host_load, cal.background)
        present = (mix.count > 0)[:, :, None]
        t_step = mix.t_rel[:, :, None] * step * stretch  # inf where a group is absent
        t_slow = np.where(present, t_step, 0.0).max(axis=1)
        t_fast = t_step.min(axis=1)
        slowest = np.where(present, t_step, -1.0).argmax(axis=1)[:, None, :]
        s_slow = np.take_along_axis(stretch, slowest, axis=1)[:, 0, :]
        load_slow = np.take_along_axis(load, slowest, axis=1)[:, 0, :]
    else:  # no shared host: nothing stretches
        t_step = mix.t_rel[:, :, None] * step + 0 * h[:, None, :]
        t_slow, t_fast = mix.t_rel_max * step + 0 * h, mix.t_rel_min * step + 0 * h
        s_slow = s_server = 1.0
        load_slow = 0.0
    compute = h * t_slow
    # the exchange: the slowest machine's compressor (its push is the last; stretched on a shared host as its
    # compute is), the link, the server's step (stretched where it shares that host)
    compress = compress_1 * mix.t_rel_max * (1 + cal.exchange_stretch * (s_slow - 1))
    server = server * (1 + cal.exchange_stretch * (s_server - 1))
    exchange = compress + link + server + cal.round_s
    round_s = expected_max(np, compute, exchange, cal.jitter, h)
    # run-on: a faster machine keeps stepping through the round, up to max_sync_every (absent groups: t_step
    # inf, so h steps of no machine)
    max_h = np.minimum(np.ceil(h * t_slow / t_fast - 1e-9), h * MAX_RATIO_H)
    steps = np.maximum(np.minimum(max_h[:, None, :], np.floor(round_s[:, None, :] / t_step + 1e-9)), h[:, None, :])
    machine_samples = mix.gpus * bs  # per step, one machine of the group
    samples = np.einsum("mk,mks->ms", mix.count * machine_samples, steps)  # per round
    batch = mix.gpus_total * bs  # the job's global batch per iteration
    its_per_s = samples / round_s / batch
    # iterations to the target: dense training's at this batch x the configuration's factor (at the H the
    # fastest machines make and the mix's number of workers)
    h_eff = steps.max(axis=1)
    factor = np.empty_like(round_s)
    workers = np.broadcast_to(w, round_s.shape)[:, 0].astype(int)
    for j, (dj, cj, hj, _) in enumerate(settings):
        col = np.maximum(h_eff[:, j], hj).astype(int)
        for wx, hx in set(zip(workers.tolist(), col.tolist())):
            factor[(workers == wx) & (col == hx), j] = profile.factor(dj, cj, hx, wx)[0]
    dense = profile.dense_iterations * (1 + profile.critical_batch / batch) / \
        (1 + profile.critical_batch / profile.target_batch)
    iterations = dense * factor
    t0 = iterations / its_per_s
    # revocations: each spot machine lost costs the stall, its share of the job (its samples over the
    # round's, weighted by how much the iterations depend on the batch) during its replacement and rejoin
    # (a float32 snapshot pull, the process start), and its lost work: half a round of local steps and its
    # residual (<= 1/(d W) steps of the job's mean update)
    rate = mix.rate
    s_it = round_s / h
    lost = (h / 2 + 1.0 / (d * w)) * s_it
    share_rate = np.einsum("mk,mks->ms", rate * machine_samples, steps) / samples
    # the machine's samples matter as far as the iterations depend on the batch: d log(iterations) / d log(1/B)
    beta = (profile.critical_batch / batch) / (1 + profile.critical_batch / batch)
    share_rate_time = beta * np.einsum("mk,mks->ms", rate * machine_samples * (mix.replace_s + n * mix.rejoin_s
                                                                                + START_S), steps) / samples
    lam_total = mix.rate_total + 0 * d
    lam_loss = profile.stall_s * lam_total + share_rate_time + share_rate * lost  # job seconds lost per second
    if srv.mttr_h:  # the server: its restart, and the steps since the newest checkpoint (half an interval)
        lam_srv = hosts / (srv.mttr_h * 3600.0)
        lam_loss = lam_loss + lam_srv * (srv.restart_s + checkpoint_every / 2 * s_it)
        lam_total = lam_total + lam_srv
    time_s = np.where(lam_loss < 0.9, t0 / np.maximum(1 - lam_loss, 0.1), np.inf)
    price_h = mix.price_h + srv.price * hosts
    boot = mix.boot_rate * time_s  # a replacement is paid for while it starts (the revoked machine no longer is)
    cost = price_h * time_s / 3600 + boot
    if not detail:  # what the ranking reads
        return {"time_s": time_s, "cost": cost, "factor": factor}
    cost0 = price_h * t0 / 3600
    parts = np.stack(np.broadcast_arrays(cal.link * push_s, cal.link * pull_s, server, compress))
    bound = np.where(compute >= exchange, 0, 1 + parts.argmax(axis=0))
    return {"s_per_it": s_it, "round_s": round_s, "compute_s": compute, "exchange_s": exchange, "link_s": link,
            "server_s": server + 0 * w, "bound": bound, "max_sync_every": max_h, "samples_per_s": samples / round_s,
            "iterations": iterations, "factor": factor, "h_eff": h_eff, "time_s": time_s,
            "revocations": lam_total * time_s, "cost": cost, "revocation_cost": cost - np.minimum(cost0, cost),
            "load": load_slow + 0 * round_s, **{k: np.broadcast_to(np.asarray(x, float), round_s.shape) for k, x in (
                ("compress_s", compress), ("push_s", cal.link * push_s), ("pull_s", cal.link * pull_s),
                ("duplex_s", cal.link * duplex),
                ("tail_s", tail), ("rtt_s", 2 * mix.rtt_max), ("fixed_s", cal.round_s),
                ("push_at_server", push_at_srv), ("pull_at_server", pull_at_srv))}}


# The window of message sizes that lose their tail, as bench.transport measured it on the test bed's links at
# 10-100 Mbit/s (2026-11-26, docs/plan.md section 3): above TAIL_OVERFLOW x the queue (a message a little over
# the queue gets through: the queue drains while the flight arrives), and up to TCP's largest single flight. A
# larger message loses, if at all, mid-flight, and the segments behind the loss repair it at once
TAIL_OVERFLOW = 1.3
TAIL_FLIGHT_BYTES = 320 * 1024


def _tail_loss_s(np: Any, size: Any, queue: Any, rate: Any) -> Any:
    """The wait of a message that loses its tail, in queue delays (the calibration's
    ``tail_loss`` scales it), the longest over the mix's machines: shape (mixes, settings).

    A message that TCP sends as one flight (up to :data:`TAIL_FLIGHT_BYTES`) into a
    drop-tail queue it overflows (``queue``: bytes, 0 where not modelled; by
    :data:`TAIL_OVERFLOW` x the queue, as measured) loses its last
    segments. No later segment tells the sender, so it waits for its timer (a tail-loss
    probe, or the retransmission timeout), about one to two queue delays with the queue
    full. bench.transport measures it: docs/plan.md section 3."""
    q = queue[:, :, None]
    hit = (q > 0) & (size[:, None, :] > TAIL_OVERFLOW * q) & (size[:, None, :] <= TAIL_FLIGHT_BYTES)
    return np.where(hit, q / rate[:, :, None], 0.0).max(axis=1)


def expected_max(np: Any, compute: Any, exchange: Any, jitter: float, h: Any) -> Any:
    """A round's expected length: ``E[max(C, E)]`` for its compute ``C`` (H steps) and its
    exchange ``E``, each normal around the model's value with the coefficient of variation
    ``jitter`` (a round's H steps vary independently: ``jitter / sqrt(H)``); Clark's formula
    (1961). One step stale, a worker waits for the exchange it started a round ago whenever
    that round's exchange outlasts this round's compute; with the two close, that is half the
    rounds, and the mean wait grows with their spread. ``jitter`` 0: ``max(C, E)``."""
    top = np.maximum(compute, exchange)
    if not jitter:
        return top
    # Clark's E[max] = max(C, E) - |C - E| erfc(a / sqrt 2) / 2 + theta phi(a), a = |C - E| / theta; erfc by
    # Abramowitz and Stegun 7.1.26 (to 1.5e-7), whose exp(-a^2 / 2) is phi's own. In place: stella plan
    # evaluates millions of configurations at once. inf: a configuration not considered
    shape = top.shape
    compute, exchange, top = (np.atleast_1d(np.asarray(x, float)) for x in (compute, exchange, top))  # no copies
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        gap = np.abs(compute - exchange)
        theta = np.sqrt(compute * compute / h + exchange * exchange)
        theta *= jitter
        a = gap / theta
        g = a * a
        g *= -0.5
        np.exp(g, out=g)
        t = a * (0.3275911 / math.sqrt(2))
        t += 1
        np.reciprocal(t, out=t)
        poly = t * 1.061405429
        for k in (-1.453152027, 1.421413741, -0.284496736, 0.254829592):
            poly += k
            poly *= t
        poly *= g
        poly *= gap
        poly *= -0.5
        g *= theta
        g *= 1 / math.sqrt(2 * math.pi)
        poly += g
        poly += top
    return np.where(np.isfinite(poly), poly, top).reshape(shape)


def _host_load(np: Any, catalog: Catalog, mix: Mix, compute_s: float, h: Any, compress: Any, server: Any,
               host_load: float, background: float = 1.0) -> tuple[Any, Any, Any]:
    """Processor sharing on the catalog's shared hosts: ``(load, stretch, server_stretch)``.

    A worker on a shared host is busy through its round's compute; the CPU work of a round that
    runs in the background (each worker's compressor, and the server's step if ``stella-ps``
    shares the host) lands in that window too, for the next round's compute overlaps it, the
    share ``background`` of it (the calibration's; the rest runs while the host waits on its
    links). So the host carries ``n = busy + background x (W_host x compress + server) / (H x step)`` runnable
    processes (``step``: its fastest machine's as profiled, uncalibrated; a slower machine there
    is slower by waiting, not by CPU work, so ``busy`` counts each machine by the share of the
    time it computes, ``t_fastest / t_machine``; ``compress``: one worker's, per round) on ``cores``
    cores, and every step there stretches by ``max(1, host_load x n / cores)``, the
    calibration's ``host_load`` fitted on measured runs. The exchange's CPU work (compressor,
    server) takes the share ``exchange_stretch`` of that stretch: it runs partly beside the
    compute and partly while the host waits on the link. ``load`` is ``n / cores`` per group (0
    off the shared hosts), of shape (mixes, groups, settings), ``stretch`` each group's factor,
    ``server_stretch`` (mixes, settings) the server's (1 off the shared hosts)."""
    m, g = mix.count.shape
    ones = np.ones((m, g, h.shape[1]))
    load, stretch, server_stretch = 0 * ones, ones, ones[:, 0, :]
    for i, (name, cores) in enumerate(catalog.hosts):
        on = (mix.host == i) & (mix.count > 0)
        if not on.any():
            continue
        w_h = (mix.count * on).sum(axis=1)[:, None]
        t_min = np.where(on, mix.t_rel, np.inf).min(axis=1)[:, None]  # inf: none on it
        step = compute_s * t_min
        # a machine slower than the host's fastest is slower by waiting: it is runnable t_min / t_rel of the time
        busy = (mix.count * on * np.where(on, t_min / mix.t_rel, 0.0)).sum(axis=1)[:, None]
        bg = w_h * compress + (server if catalog.server.host == name else 0.0)
        n_h = np.where(w_h > 0, busy + background * bg / (h * step), 0.0) / cores
        s_h = np.maximum(1.0, host_load * n_h)
        load = np.where(on[:, :, None], n_h[:, None, :], load)
        stretch = np.where(on[:, :, None], s_h[:, None, :], stretch)
        if catalog.server.host == name:
            server_stretch = s_h
    return load, stretch, server_stretch


BOUNDS = ("compute", "push", "pull", "server", "compress")


def predict(profile: Profile, catalog: Catalog, config: Config, checkpoint_every: int = 100) -> Prediction:
    """The model's prediction for one configuration (module doc)."""
    setting = (config.density, config.coding, config.sync_every, config.shards)
    r = evaluate(profile, catalog, mix_arrays([config.groups], catalog.hosts), [setting], checkpoint_every)
    return prediction(profile, config, r, 0)


def prediction(profile: Profile, config: Config, r: Mapping[str, Any], i: int) -> Prediction:
    v = {k: a[i, 0] for k, a in r.items()}
    h_factor = max(config.sync_every, int(v["h_eff"]))
    source = profile.factor(config.density, config.coding, h_factor, config.workers)[1]
    return Prediction(config=config, s_per_it=float(v["s_per_it"]), round_s=float(v["round_s"]),
                      compute_s=float(v["compute_s"]), exchange_s=float(v["exchange_s"]),
                      link_s=float(v["link_s"]), server_s=float(v["server_s"]), bound=BOUNDS[int(v["bound"])],
                      max_sync_every=int(v["max_sync_every"]), samples_per_s=float(v["samples_per_s"]),
                      iterations=float(v["iterations"]), factor=float(v["factor"]), factor_source=source,
                      time_s=float(v["time_s"]), revocations=float(v["revocations"]), cost=float(v["cost"]),
                      revocation_cost=float(v["revocation_cost"]),
                      factor_measured=profile.factor_measured(config.density, config.coding, h_factor,
                                                              config.workers),
                      compress_s=float(v["compress_s"]), push_s=float(v["push_s"]), pull_s=float(v["pull_s"]),
                      duplex_s=float(v["duplex_s"]), tail_s=float(v["tail_s"]), rtt_s=float(v["rtt_s"]),
                      fixed_s=float(v["fixed_s"]),
                      push_at="server" if v["push_at_server"] else "uplink",
                      pull_at="server" if v["pull_at_server"] else "downlink")


def with_spread(profile: Profile, catalog: Catalog, p: Prediction, checkpoint_every: int = 100) -> Prediction:
    """``p`` with the range its profile's spread of the step time gives: s/it and time to the
    target predicted again at the step's quartiles (unchanged where the profile has no spread)."""
    import dataclasses

    spread = profile.compute_spread
    if spread is None:
        return p
    lo, hi = (predict(dataclasses.replace(profile, compute_s=q), catalog, p.config, checkpoint_every)
              for q in spread)
    s_lo, s_hi = min(lo.s_per_it, p.s_per_it), max(hi.s_per_it, p.s_per_it)
    t_lo, t_hi = min(lo.time_s, p.time_s), max(hi.time_s, p.time_s)
    return dataclasses.replace(p, s_per_it_range=(s_lo, s_hi), time_range=(t_lo, t_hi))

