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

from ..codec import CODINGS
from .catalog import Catalog, MachineKind, PlanError
from .model import Config, Group, Mix, Prediction, evaluate, mix_arrays, prediction
from .profile_file import Profile

__all__ = ["PlanResult", "plan", "DENSITIES", "SYNC_EVERY", "SHARDS", "TOP_ROWS"]

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


def _mixes(catalog: Catalog, max_rented: int = 2) -> list[tuple[Group, ...]]:
    import itertools

    onprem = [k for k in catalog.kinds if k.onprem]
    rented = [(k, m) for k in catalog.kinds if not k.onprem
              for m in (("ondemand", "spot") if k.spot_price is not None else ("ondemand",))]
    if len(onprem) > 4:  # all of them or none
        lab_sets: list[tuple[MachineKind, ...]] = [(), tuple(onprem)]
    else:
        lab_sets = [c for r in range(len(onprem) + 1) for c in itertools.combinations(onprem, r)]
    out: list[tuple[Group, ...]] = []
    for lab in lab_sets:
        base = tuple(Group(k, "onprem", k.count) for k in lab)
        if base:
            out.append(base)
        for r in range(1, max_rented + 1):
            for combo in itertools.combinations(rented, r):
                for counts in itertools.product(*(_ladder(k.count) for k, _ in combo)):
                    if r == 2 and combo[0][0] is combo[1][0] and sum(counts) > combo[0][0].count:
                        continue  # one kind's machines on both markets: no more than there are
                    out.append(base + tuple(Group(k, m, c) for (k, m), c in zip(combo, counts)))
    return out


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


def plan(catalog: Catalog, profile: Profile, *, deadline_s: float | None = None, budget: float | None = None,
         top: int = TOP_ROWS, densities: Sequence[float] = DENSITIES, codings: Sequence[str] = CODINGS,
         sync_every: Sequence[int] = SYNC_EVERY, shards: Sequence[int] = SHARDS, max_rented: int = 2,
         checkpoint_every: int = 100) -> PlanResult:
    """Every configuration (module doc), ranked: with a deadline, the cheapest that meets
    it (and the budget, if given); with only a budget, the fastest within it; with
    neither, the fastest. Also the Pareto front of time against cost."""
    import time

    import numpy as np

    t_start = time.perf_counter()
    mixes = _mixes(catalog, max_rented)
    if not mixes:
        raise PlanError(f"{catalog.path}: no machine mix to consider")
    mix = mix_arrays(mixes, catalog.hosts)
    settings = [(d, c, h, s) for d in densities for c in codings for h in sync_every for s in shards]
    objective = "cost" if deadline_s is not None else "time"
    m = len(mixes)
    best_key = np.full((m, 2), np.inf)  # per mix: (objective, the other), its best setting
    best_set = np.zeros(m, int)
    cand_t, cand_c, cand_m, cand_s = [], [], [], []  # points that may be on the Pareto front
    bins = 4000  # log10(seconds) in [0, 8): the front's pre-filter
    feasible = 0
    chunk = max(1, CHUNK // max(1, m * mix.count.shape[1]))  # arrays that stay in cache
    for j0 in range(0, len(settings), chunk):
        part = settings[j0:j0 + chunk]
        r = evaluate(profile, catalog, mix, part, checkpoint_every, detail=False)
        t, cost = r["time_s"], r["cost"]
        ok = np.isfinite(t)
        if deadline_s is not None:
            ok &= t <= deadline_s
        if budget is not None:
            ok &= cost <= budget
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
    return PlanResult(rows, pareto, m * len(settings), objective, deadline_s, budget, feasible, catalog,
                      profile, time.perf_counter() - t_start)


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

