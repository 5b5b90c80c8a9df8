"""Calibration of ``stella plan``'s model: its coefficients fitted on measured runs.

``bench.plan`` measures runs on the slow-link test bed and fits the profile's
:class:`~stella.planning.profile_file.Calibration` on them (:func:`fit_many`), by least
squares on relative errors as CM-DARE (Li, Walls, Guo, ICDCS 2020) fits its speed models;
the coefficients then travel in the profile's ``calibration`` field, which the product
reads. Measurement and calibration live beside the product, not inside it: nothing in
``stella`` imports this module. The coefficients and the fit: docs/plan.md section 3.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stella.planning.catalog import Catalog, PlanError
from stella.planning.model import Config, evaluate, expected_max, mix_arrays, predict
from stella.planning.profile_file import Calibration, Profile

__all__ = ["Observation", "fit", "fit_many", "EXCHANGE_BOUND"]


@dataclass(frozen=True)
class Observation:
    """One measured run, for :func:`fit`: the configuration and what it measured (per
    iteration: compute; per round: the exchange, in the background)."""

    config: Config
    compute_s: float  # measured compute per local step (slowest machine)
    exchange_s: float  # measured exchange per round (compress + push + step + pull)
    s_per_it: float = 0.0  # measured round / H (for reports)


def _nonneg_lstsq(np: Any, a: Any, y: Any) -> Any:
    """Least squares with every coefficient >= 0: the best over the subsets of columns left
    free (the others 0) whose solution is non-negative (a few columns: all subsets)."""
    best, best_err = np.zeros(a.shape[1]), float(np.sum(y ** 2))
    for cols in itertools.product((False, True), repeat=a.shape[1]):
        if not any(cols):
            continue
        sel = np.array(cols)
        x = np.linalg.lstsq(a[:, sel], y, rcond=None)[0]
        if (x < 0).any():
            continue
        full = np.zeros(a.shape[1])
        full[sel] = x
        err = float(np.sum((a @ full - y) ** 2))
        if err < best_err:
            best, best_err = full, err
    return best


EXCHANGE_BOUND = 1.1  # a run's exchange sets its round when it exceeds its compute by this factor


def fit(profile: Profile, catalog: Catalog, observations: Sequence[Observation], source: str = "") -> Calibration:
    """Least squares on measured runs of one model (CM-DARE's approach); :func:`fit_many`."""
    return fit_many([(profile, catalog, ob) for ob in observations], source)[profile.model]


def fit_many(runs: Sequence[tuple[Profile, Catalog, Observation]], source: str = "",
             compute: float | None = None) -> dict[str, Calibration]:
    """Fit the model's coefficients on measured runs, by least squares on relative errors:

    - per model, a compute scale, and across all runs the shared hosts' ``host_load``, on
      the measured compute per step: ``step = scale x (slowest machine's profiled step) x
      max(1, host_load x n / cores)`` (``host_load`` by a search on a fine grid, the scales
      in closed form at each point);
    - across all runs, a link scale, a fixed overhead per round, ``exchange_stretch`` (the
      share of the host's stretch the exchange's CPU work takes) and ``tail_loss`` (the wait of
      a message that loses its tail, in its queue's delays), by non-negative least squares on
      the measured exchange per round less the model's unstretched compressor and server, on
      the runs bound by their exchange only (:data:`EXCHANGE_BOUND`; all runs if
      fewer than 2 are);
    - last, across all runs that carry a measured s/it, ``jitter`` (the spread of a step's and an
      exchange's time, :func:`stella.planning.model.expected_max`), by a search on a grid.

    Returns a :class:`Calibration` per model (``profile.model``)."""
    import numpy as np

    if len(runs) < 2:
        raise PlanError("fit: need at least 2 measured runs")
    names = sorted({prof.model for prof, _, _ in runs})
    which = np.array([names.index(prof.model) for prof, _, _ in runs])
    base, y = [], []
    mixes = [(prof, cat, ob, mix_arrays([ob.config.groups], cat.hosts)) for prof, cat, ob in runs]
    for prof, _, ob in runs:
        base.append(prof.compute_s * max(1.0 / g.kind.speed for g in ob.config.groups))
        y.append(ob.compute_s)
    b, yc = np.array(base), np.array(y)

    def loads(fixed: float) -> Any:
        """Each run's host load, with ``fixed`` seconds of a worker's CPU per round beside its compressor."""
        cal0 = Calibration(worker_round_s=fixed)
        return np.array([float(evaluate(dataclasses.replace(prof, calibration=cal0), cat, mix,
                                         [(ob.config.density, ob.config.coding, ob.config.sync_every,
                                           ob.config.shards)])["load"][0, 0]) for prof, cat, ob, mix in mixes])

    def scales(kappa: float, ld: Any) -> tuple[Any, float]:
        m = b * np.maximum(1.0, kappa * ld) / yc  # the model at scale 1, relative to the measurement
        k = np.array([np.sum(m[which == i]) / np.sum(m[which == i] ** 2) if compute is None else compute
                      for i in range(len(names))])
        return k, float(np.sum((k[which] * m - 1) ** 2))

    kappa, fixed, ld = 1.0, 0.0, loads(0.0)
    if (ld > 0).any():  # runs on a shared host: the grids' best (host_load 0.2 .. 3, worker_round_s 0 .. 10 ms)
        best = math.inf
        for f in np.linspace(0.0, 0.01, 21):
            ldf = loads(float(f))
            kf = min(np.linspace(0.2, 3.0, 561), key=lambda x: scales(float(x), ldf)[1])
            err = scales(float(kf), ldf)[1]
            if err < best - 1e-12:
                best, kappa, fixed, ld = err, float(kf), float(f), ldf
    k = scales(float(kappa), ld)[0]
    rows_e, ye, bound = [], [], []
    for (prof, cat, ob), ki in zip(runs, k[which]):
        cal = Calibration(compute=float(ki), host_load=float(kappa), worker_round_s=fixed)
        p = predict(dataclasses.replace(prof, calibration=cal), cat, ob.config)  # exchange unstretched
        full = predict(dataclasses.replace(prof, calibration=dataclasses.replace(cal, exchange_stretch=1.0)), cat,
                       ob.config)
        tail = predict(dataclasses.replace(prof, calibration=dataclasses.replace(cal, tail_loss=1.0)), cat, ob.config)
        # at link scale 1: push + pull at the nominal rates (+ RTTs); the CPU work's stretch; the tail losses' waits
        rows_e.append([1.0, p.link_s, full.exchange_s - p.exchange_s, tail.link_s - p.link_s])
        ye.append(ob.exchange_s - (p.exchange_s - p.link_s))  # less compress and server, unstretched
        # a worker's measured exchange ends when the step closes: in a run bound by compute, when the slowest
        # worker's push is in. It then measures the others' compute, not the link
        bound.append(ob.exchange_s > EXCHANGE_BOUND * ob.config.sync_every * ob.compute_s)
    keep = np.array(bound) if sum(bound) >= 2 else np.ones(len(bound), bool)
    ae, ve = np.array(rows_e)[keep], np.array(ye)[keep]
    we = 1 / np.maximum(np.abs(ve), 1e-3)
    ke = _nonneg_lstsq(np, ae * we[:, None], ve * we)
    cals = {n: Calibration(compute=float(max(k[i], 1e-3)), host_load=float(kappa), worker_round_s=fixed,
                           link=float(max(ke[1], 1e-3)),
                           round_s=float(ke[0]), exchange_stretch=float(min(ke[2], 1.0)), tail_loss=float(ke[3]),
                           source=source or "fitted", runs=len(runs), exchange_runs=int(keep.sum()))
            for i, n in enumerate(names)}
    # last, the round's spread, on every run's measured s/it: the model's compute and exchange at the fitted
    # coefficients, their expected max over a grid of jitter (0 .. 0.6)
    parts: list[tuple[float, float, int, float]] = []
    for prof, cat, ob in runs:
        if ob.s_per_it > 0:
            p = predict(dataclasses.replace(prof, calibration=cals[prof.model]), cat, ob.config)
            parts.append((p.compute_s, p.exchange_s, ob.config.sync_every, ob.s_per_it))
    if len(parts) >= 2:
        cs, es, hs, ys = (np.array([x[i] for x in parts], float) for i in range(4))

        def spread_err(j: float) -> float:
            return float(np.sum((expected_max(np, cs, es, j, hs) / hs / ys - 1) ** 2))

        jitter = min(np.linspace(0.0, 0.6, 121), key=lambda j: spread_err(float(j)))
        cals = {n: dataclasses.replace(cal, jitter=float(jitter)) for n, cal in cals.items()}
    return cals
