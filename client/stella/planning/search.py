"""The search: every configuration of a catalog, ranked under a deadline and/or a budget.

:func:`plan` enumerates machine mixes (the on-premises kinds, all of each or none, with up
to two rented kinds, each on demand or spot, in counts 1, 2, 4, ... up to what is
available) x densities x codings (:data:`stella.codec.CODINGS`) x H x shards, evaluates
them with the model (:func:`stella.planning.model.evaluate`, in chunks that stay in
cache) and ranks them: cheapest within the deadline, fastest within the budget, or the
fastest; it also keeps the Pareto front of time against cost. No torch: ``stella plan``
answers in well under a second for 10 kinds.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..codec import CODINGS
from .catalog import Catalog, MachineKind, PlanError
from .model import Config, Group, Mix, Prediction, evaluate, mix_arrays, prediction, with_spread
from .profile_file import Profile

__all__ = ["PlanResult", "plan", "parse_config", "shard_cap", "shard_choices", "DENSITIES", "SYNC_EVERY", "SHARDS",
           "TOP_ROWS", "CONFIG_KEYS"]

DENSITIES: tuple[float, ...] = (0.001, 0.003, 0.01, 0.03, 0.1)
SYNC_EVERY: tuple[int, ...] = (1, 2, 4, 8)
SHARDS: tuple[int, ...] = (1, 2, 4, 8)
TOP_ROWS = 10
PARETO_POINTS = 40  # the front as plan() returns it (thinned evenly when longer)
CHUNK = 600_000  # elements of the (mixes, groups, settings) arrays per evaluation


def _ladder(n: int) -> list[int]:
    out, c = [], 1
    while c < n:
        out.append(c)
        c *= 2
    return [*out, n]


def _counts(k: MachineKind) -> list[int]:
    """The counts of a kind a mix may take: every one from its fewest to its most when they are few (an
    on-premises kind given a range), else the ladder 1, 2, 4, ... (from the fewest) and the most."""
    lo, hi = k.counts_from, k.count
    if k.onprem and hi - lo < 8:
        return list(range(lo, hi + 1))
    return sorted({c for c in _ladder(hi) if c >= lo} | {lo})


def _mixes(catalog: Catalog, max_rented: int = 2) -> list[tuple[Group, ...]]:
    """Every machine mix (module doc), each once: kinds alike in all but their names (a lab's
    machines written as one kind each) are one, so mixes that differ only in which of them
    they take are the same configuration, kept in its first spelling."""
    alike: dict[MachineKind, int] = {}  # a kind, less its name and counts -> its class
    cls = {id(k): alike.setdefault(dataclasses.replace(k, name="", count=0, min_count=0), len(alike))
           for k in catalog.kinds}
    seen: set[tuple[tuple[int, str, int], ...]] = set()
    unique = []
    for m in _all_mixes(catalog, max_rented):
        tally: dict[tuple[int, str], int] = {}
        for g in m:
            key = (cls[id(g.kind)], g.market)
            tally[key] = tally.get(key, 0) + g.count
        sig = tuple(sorted((k, mk, n) for (k, mk), n in tally.items()))
        if sig not in seen:
            seen.add(sig)
            unique.append(m)
    return unique


def _all_mixes(catalog: Catalog, max_rented: int = 2) -> list[tuple[Group, ...]]:
    import itertools

    onprem = [k for k in catalog.kinds if k.onprem]
    rented = [(k, m) for k in catalog.kinds if not k.onprem
              for m in (("ondemand", "spot") if k.spot_price is not None else ("ondemand",))]
    labs: list[tuple[Group, ...]]
    if len(onprem) > 4:  # all of them or none
        labs = [(), tuple(Group(k, "onprem", k.count) for k in onprem)]
    else:
        lab_sets = [c for r in range(len(onprem) + 1) for c in itertools.combinations(onprem, r)]
        labs = [tuple(Group(k, "onprem", n) for k, n in zip(lab, ns))
                for lab in lab_sets for ns in itertools.product(*(_counts(k) for k in lab))]
    out: list[tuple[Group, ...]] = []
    for base in labs:
        if base:
            out.append(base)
        for r in range(1, max_rented + 1):
            for combo in itertools.combinations(rented, r):
                for counts in itertools.product(*(_counts(k) for k, _ in combo)):
                    if r == 2 and combo[0][0] is combo[1][0] and sum(counts) > combo[0][0].count:
                        continue  # one kind's machines on both markets: no more than there are
                    out.append(base + tuple(Group(k, m, c) for (k, m), c in zip(combo, counts)))
    return out


def shard_cap(catalog: Catalog, max_shards: int | None = None) -> tuple[int, str]:
    """The most ``stella-ps`` processes a plan may run, and why (``(0, "")``: no limit).
    The tightest of: ``max_shards`` (``stella plan --max-shards``); the catalog's ``[server]
    max_shards``; the cores of the shared host the server runs on (``[server] host``: one
    host, its processes share its cores); or else, for a server host of price 0 (one's own:
    the plan cannot rent more of it), its ``cores``."""
    srv = catalog.server
    caps: list[tuple[int, str]] = []
    if max_shards:
        caps.append((max_shards, "--max-shards"))
    if srv.max_shards:
        caps.append((srv.max_shards, "[server] max_shards"))
    if srv.host:  # its cores are the shared host's
        cores = dict(catalog.hosts)[srv.host]
        caps.append((cores, f"the server's host '{srv.host}' has {cores} cores"))
    elif srv.price == 0:
        caps.append((srv.cores, f"the server host has {srv.cores} core{'s' if srv.cores != 1 else ''} ([server] "
                                "cores) and costs nothing: one's own, one host"))
    return min(caps, key=lambda c: c[0]) if caps else (0, "")


def shard_choices(shards: Sequence[int], cap: int) -> tuple[int, ...]:
    """The shard counts a plan tries under ``cap`` (0: none): those of ``shards`` within it, and the cap itself."""
    if not cap:
        return tuple(shards)
    return tuple(sorted({s for s in shards if s <= cap} | ({cap} if cap < max(shards) else set())))


@dataclass
class PlanResult:
    rows: list[Prediction]  # ranked
    pareto: list[Prediction]  # time against cost, fastest first
    considered: int
    objective: str
    deadline_s: float | None
    budget: float | None
    feasible: int
    catalog: Catalog
    profile: Profile
    seconds: float = 0.0
    # why the others were not ranked: no estimate of their iterations (beyond the factors table), revocations
    # that outrun the job (lam x loss >= 0.9), and of those left, over the deadline, over the budget
    no_estimate: int = 0
    unstable: int = 0
    over_deadline: int = 0
    over_budget: int = 0
    shard_cap: tuple[int, str] = (0, "")


def plan(catalog: Catalog, profile: Profile, *, deadline_s: float | None = None, budget: float | None = None,
         top: int = TOP_ROWS, densities: Sequence[float] = DENSITIES, codings: Sequence[str] = CODINGS,
         sync_every: Sequence[int] = SYNC_EVERY, shards: Sequence[int] = SHARDS, max_rented: int = 2,
         checkpoint_every: int = 100, max_shards: int | None = None) -> PlanResult:
    """Every configuration (module doc), ranked: with a deadline, the cheapest that meets
    it (and the budget, if given); with only a budget, the fastest within it; with
    neither, the fastest. Also the Pareto front of time against cost. Shards are capped by
    :func:`shard_cap`; the ranked rows carry the range the profile's spread gives."""
    import time

    import numpy as np

    t_start = time.perf_counter()
    mixes = _mixes(catalog, max_rented)
    if not mixes:
        raise PlanError(f"{catalog.path}: no machine mix to consider")
    mix = mix_arrays(mixes, catalog.hosts)
    cap = shard_cap(catalog, max_shards)
    shards = shard_choices(shards, cap[0])
    settings = [(d, c, h, s) for d in densities for c in codings for h in sync_every for s in shards]
    objective = "cost" if deadline_s is not None else "time"
    m = len(mixes)
    best_key = np.full((m, 2), np.inf)  # per mix: (objective, the other), its best setting
    best_set = np.zeros(m, int)
    cand_t, cand_c, cand_m, cand_s = [], [], [], []  # points that may be on the Pareto front
    bins = 4000  # log10(seconds) in [0, 8): the front's pre-filter
    feasible = no_estimate = unstable = over_deadline = over_budget = 0
    chunk = max(1, CHUNK // max(1, m * mix.count.shape[1]))  # arrays that stay in cache
    for j0 in range(0, len(settings), chunk):
        part = settings[j0:j0 + chunk]
        r = evaluate(profile, catalog, mix, part, checkpoint_every, detail=False)
        t, cost = r["time_s"], r["cost"]
        ok = np.isfinite(t)
        no_f = ~np.isfinite(r["factor"])
        no_estimate += int(no_f.sum())
        unstable += int((~ok & ~no_f).sum())
        if deadline_s is not None:
            late = ok & (t > deadline_s)
            over_deadline += int(late.sum())
            ok &= ~late
        if budget is not None:
            dear = ok & (cost > budget)
            over_budget += int(dear.sum())
            ok &= ~dear
        feasible += int(ok.sum())
        key = np.where(ok, cost if objective == "cost" else t, np.inf)
        tie = t if objective == "cost" else cost
        j = np.lexsort((tie, key), axis=1)[:, 0] if key.shape[1] > 1 else np.zeros(m, int)
        k1, k2 = key[np.arange(m), j], tie[np.arange(m), j]
        better = (k1 < best_key[:, 0]) | ((k1 == best_key[:, 0]) & (k2 < best_key[:, 1]))
        best_key[better] = np.stack([k1, k2], axis=1)[better]
        best_set[better] = j0 + j[better]
        # the front's candidates: cheaper than everything in the faster bins of this chunk
        fin = np.isfinite(t)
        b = np.clip((np.log10(np.clip(t, 1.0, 1e8)) * bins / 8).astype(int), 0, bins - 1)
        low = np.full(bins, np.inf)
        np.minimum.at(low, b[fin], cost[fin])
        before = np.concatenate(([np.inf], np.minimum.accumulate(low)[:-1]))
        keep = fin & (cost < before[b])
        ii, jj = np.nonzero(keep)
        cand_t.append(t[ii, jj])
        cand_c.append(cost[ii, jj])
        cand_m.append(ii)
        cand_s.append(j0 + jj)
    order = [int(i) for i in np.lexsort((best_key[:, 1], best_key[:, 0]))[:top] if np.isfinite(best_key[i, 0])]
    ct, cc, cm, cs = (np.concatenate(x) for x in (cand_t, cand_c, cand_m, cand_s))
    o = np.lexsort((cc, ct))
    front_idx, lowest = [], math.inf
    for i in o:
        if cc[i] < lowest * (1 - 1e-9):
            lowest = cc[i]
            front_idx.append(i)
    if len(front_idx) > PARETO_POINTS:  # thinned evenly, the ends kept
        step = (len(front_idx) - 1) / (PARETO_POINTS - 1)
        front_idx = [front_idx[round(k * step)] for k in range(PARETO_POINTS)]
    pairs = [(i, int(best_set[i])) for i in order] + [(int(cm[i]), int(cs[i])) for i in front_idx]
    got = _predict_many(profile, catalog, mixes, mix, settings, pairs, checkpoint_every)
    rows, pareto = got[:len(order)], got[len(order):]
    rows = [with_spread(profile, catalog, p, checkpoint_every) for p in rows]
    return PlanResult(rows, pareto, m * len(settings), objective, deadline_s, budget, feasible, catalog,
                      profile, time.perf_counter() - t_start, no_estimate=no_estimate, unstable=unstable,
                      over_deadline=over_deadline, over_budget=over_budget, shard_cap=cap)


def _predict_many(profile: Profile, catalog: Catalog, mixes: Sequence[Sequence[Group]], mix: Mix,
                  settings: Sequence[tuple[float, str, int, int]], pairs: Sequence[tuple[int, int]],
                  checkpoint_every: int) -> list[Prediction]:
    """Predictions for (mix, setting) pairs, one model evaluation per distinct setting."""
    import numpy as np

    out: dict[tuple[int, int], Prediction] = {}
    by_setting: dict[int, list[int]] = {}
    for i, j in pairs:
        by_setting.setdefault(j, []).append(i)
    for j, idx in by_setting.items():
        rows = np.array(sorted(set(idx)))
        sub = Mix(**{f.name: getattr(mix, f.name)[rows] for f in dataclasses.fields(Mix)})
        r = evaluate(profile, catalog, sub, [settings[j]], checkpoint_every)
        for n, i in enumerate(rows):
            out[(int(i), j)] = prediction(profile, _config(mixes[i], settings[j]), r, n)
    return [out[p] for p in pairs]


def _config(groups: Sequence[Group], setting: tuple[float, str, int, int]) -> Config:
    d, c, h, s = setting
    return Config(tuple(groups), d, c, h, s)



CONFIG_KEYS = ("machines", "kind", "W", "market", "density", "coding", "H", "shards")


def parse_config(text: str, catalog: Catalog) -> Config:
    """One configuration from ``stella plan --config``: comma-separated ``key=value``:

    - the machines: ``W=2`` (of the catalog's only kind, or of ``kind=NAME``; ``market=``
      ``onprem``, ``ondemand`` or ``spot``, by default the kind's own: on premises, or on
      demand), or ``machines=2xlab+4xcloud:spot``;
    - ``density=0.01`` (or ``1%``), ``coding=f16``, ``H=1`` (default 1), ``shards=1`` (default 1).
    """
    where = f"--config {text!r}"
    fields: dict[str, str] = {}
    for part in (x.strip() for x in text.split(",")):
        if not part:
            continue
        key, eq, val = part.partition("=")
        key, val = key.strip(), val.strip()
        canon = {k.lower(): k for k in CONFIG_KEYS}.get(key.lower())
        if not eq or canon is None:
            raise PlanError(f"{where}: {part!r} is not one of {', '.join(k + '=' for k in CONFIG_KEYS)}")
        fields[canon] = val

    def num(key: str, cast: type, default: Any = None) -> Any:
        if key not in fields:
            if default is None:
                raise PlanError(f"{where}: missing {key}=")
            return default
        v = fields[key]
        try:
            x = float(v[:-1]) / 100 if cast is float and v.endswith("%") else cast(v)
        except ValueError:
            raise PlanError(f"{where}: {key}={v!r} is not a number") from None
        return x

    def market_of(kind: MachineKind, m: str) -> str:
        m = m or ("onprem" if kind.onprem else "ondemand")
        ok = ("onprem",) if kind.onprem else ("ondemand", "spot") if kind.spot_price is not None else ("ondemand",)
        if m not in ok:
            raise PlanError(f"{where}: kind {kind.name!r} is not offered {m!r} (it is: {', '.join(ok)})")
        return m

    groups: list[Group] = []
    if "machines" in fields:
        if {"W", "kind", "market"} & fields.keys():
            raise PlanError(f"{where}: give machines= or W= (with kind=, market=), not both")
        for item in fields["machines"].split("+"):
            count, x, rest = item.strip().partition("x")
            name, _, m = rest.partition(":")
            if not x or not count.strip().isdigit():
                raise PlanError(f"{where}: machines entry {item.strip()!r} is not COUNTxKIND[:MARKET] "
                                "(e.g. 2xlab+4xcloud:spot)")
            kind = catalog.kind(name.strip())
            groups.append(Group(kind, market_of(kind, m.strip()), int(count)))
    else:
        w = num("W", int)
        if "kind" in fields:
            kind = catalog.kind(fields["kind"])
        elif len(catalog.kinds) == 1:
            kind = catalog.kinds[0]
        else:
            raise PlanError(f"{where}: the catalog has {len(catalog.kinds)} kinds: say which, kind=NAME "
                            f"(kinds: {', '.join(k.name for k in catalog.kinds)}), or machines=...")
        groups.append(Group(kind, market_of(kind, fields.get("market", "")), w))
    for g in groups:
        if not 1 <= g.count <= g.kind.count:
            raise PlanError(f"{where}: {g.count} of kind {g.kind.name!r}: the catalog has 1 to {g.kind.count}")
    density, h, shards = num("density", float), num("H", int, 1), num("shards", int, 1)
    coding = fields.get("coding", "")
    if coding not in CODINGS:
        raise PlanError(f"{where}: coding={coding!r}: one of {', '.join(CODINGS)}")
    if not 0 < density <= 1 or h < 1 or shards < 1:
        raise PlanError(f"{where}: need 0 < density <= 1 (e.g. 0.01 or 1%), H >= 1, shards >= 1")
    return Config(tuple(groups), density, coding, h, shards)
