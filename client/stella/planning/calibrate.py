"""Calibration of ``stella plan``'s model: its coefficients fitted on measured runs
(``stella calibrate``; ``bench.plan`` on the test bed's runs).

:func:`read_runs` reads measured runs (a runs file, or the rows ``python -m bench.plan
--json`` writes: each a configuration, the catalog it ran on, and what it measured) as
:class:`Observation` s; :func:`fit_many` fits the profile's
:class:`~stella.planning.profile_file.Calibration` on them by least squares on relative
errors, as CM-DARE (Li, Walls, Guo, ICDCS 2020) fits its speed models, with fewer
coefficients where the runs are too few to determine them all (the rest from a base fit,
said in ``fitted_terms``); :func:`calibrate` is one model's. The coefficients travel in the
profile's ``calibration`` field, which ``stella plan`` reads. The coefficients, the fit and
the runs file: docs/plan.md section 3.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .catalog import Catalog, PlanError
from .model import Config, evaluate, expected_max, mix_arrays, predict
from .profile_file import Calibration, Profile

__all__ = ["Observation", "observation", "fit", "fit_many", "calibrate", "read_runs", "Run", "EXCHANGE_BOUND",
           "LINK_TERMS"]


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
# the exchange's coefficients, fitted together by non-negative least squares: each needs a run (one fewer run than
# coefficients leaves them undetermined), else the link scale alone is fitted and the rest come from the base fit
LINK_TERMS = ("round_s", "link", "exchange_stretch", "tail_loss")
# runs on shared hosts that fit host_load, worker_round_s and background (with the compute scale): else the base's
HOST_RUNS = 3


def observation(config: Config, measured: Mapping[str, Any]) -> Observation:
    """One measured run as the fit takes it: ``measured`` holds ``s_per_it``, the slowest
    machine's step (``compute_mean_s``, else ``compute_s``), the exchange per round
    (``exchange_s``, compressor included) and optionally the round (``round_s``).

    - The compute is the slowest machine's **mean** step, what its H steps of a round add up
      to. On a shared host the steps that overlap the round's background work (compressor,
      server) are the slower ones, so at H > 1 the median step overstates the mean; given
      only the median, ``round / H`` bounds the mean from above (a round is at least the
      slowest machine's H steps).
    - The exchange is no longer than the round: one exchange is in flight at a time, so a
      round lasts at least its exchange; a mean over every round can hold one slow early pull
      (a worker's snapshot over a slow downlink) that lifts it above every warm round
      (bench.plan 2026-11-26 round 4: q3's mean exchange 1.21 s in rounds of 0.21 s)."""
    def num(key: str) -> float:
        v = measured.get(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise PlanError(f"field {key!r} must be a number of seconds >= 0, got {v!r}")
        return float(v)

    s_it = num("s_per_it")
    round_s = num("round_s") if "round_s" in measured else s_it * config.sync_every
    step = num("compute_mean_s") if "compute_mean_s" in measured else min(num("compute_s"),
                                                                         round_s / config.sync_every)
    return Observation(config, step, min(num("exchange_s"), round_s), s_it)


def _nnls_wls(np: Any, a: Any, y: Any) -> Any:
    """Non-negative least squares on relative errors (each row weighted by 1 / |y|)."""
    w = 1 / np.maximum(np.abs(y), 1e-3)
    return _nonneg_lstsq(np, a * w[:, None], y * w)


def fit(profile: Profile, catalog: Catalog, observations: Sequence[Observation], source: str = "") -> Calibration:
    """Least squares on measured runs of one model (CM-DARE's approach); :func:`fit_many`."""
    return fit_many([(profile, catalog, ob) for ob in observations], source)[profile.model]


def fit_many(runs: Sequence[tuple[Profile, Catalog, Observation]], source: str = "",
             compute: float | None = None, base: Calibration | None = None) -> dict[str, Calibration]:
    """Fit the model's coefficients on measured runs, by least squares on relative errors:

    - per model, a compute scale, and across all runs the shared hosts' ``host_load``, on
      the measured compute per step: ``step = scale x (slowest machine's profiled step) x
      max(1, host_load x n / cores)`` (``host_load`` by a search on a fine grid, the scales
      in closed form at each point), with ``worker_round_s`` on a grid; on fewer than
      :data:`HOST_RUNS` runs on shared hosts, ``host_load``, ``worker_round_s`` and
      ``background`` (the share of the background CPU work inside the steps, on a grid) are the
      base's (a worker's fixed CPU per round then goes into the fixed overhead per round);
    - across all runs, a link scale, a fixed overhead per round, ``exchange_stretch`` (the
      share of the host's stretch the exchange's CPU work takes) and ``tail_loss`` (the wait of
      a message that loses its tail, in its queue's delays), by non-negative least squares on
      the measured exchange per round less the model's unstretched compressor, server and
      round trips, on the runs bound by their exchange only (:data:`EXCHANGE_BOUND`; all runs
      if fewer than 2 are); on fewer such runs than :data:`LINK_TERMS`, the link scale alone,
      the other three the base's;
    - last, across all runs that carry a measured s/it (at least 2; else the base's), ``jitter``
      (the spread of a step's and an exchange's time, :func:`stella.planning.model.expected_max`),
      by a search on a grid.

    ``compute``: the compute scale, given (the profile measured on the machines that ran the
    jobs), not fitted. ``base``: the coefficients not fitted (default: the bare structure).
    Returns a :class:`Calibration` per model (``profile.model``), its ``fitted_terms`` naming
    what was fitted."""
    import numpy as np

    if not runs:
        raise PlanError("fit: no measured runs")
    base = base or Calibration()
    names = sorted({prof.model for prof, _, _ in runs})
    which = np.array([names.index(prof.model) for prof, _, _ in runs])
    base_s, y = [], []
    mixes = [(prof, cat, ob, mix_arrays([ob.config.groups], cat.hosts)) for prof, cat, ob in runs]
    for prof, _, ob in runs:
        base_s.append(prof.compute_s * max(1.0 / g.kind.speed for g in ob.config.groups))
        y.append(ob.compute_s)
    b, yc = np.array(base_s), np.array(y)
    terms = ["compute"] if compute is None else []

    def loads(fixed: float, background: float) -> Any:
        """Each run's host load, with ``fixed`` seconds of a worker's CPU per round beside its
        compressor and the share ``background`` of the background work in it."""
        cal0 = Calibration(worker_round_s=fixed, background=background)
        return np.array([float(evaluate(dataclasses.replace(prof, calibration=cal0), cat, mix,
                                         [(ob.config.density, ob.config.coding, ob.config.sync_every,
                                           ob.config.shards)])["load"][0, 0]) for prof, cat, ob, mix in mixes])

    def errors(kappas: Any, ld: Any) -> tuple[Any, Any]:
        """Per host_load in ``kappas``: each model's compute scale and the squared relative error."""
        m = b[None, :] * np.maximum(1.0, kappas[:, None] * ld[None, :]) / yc  # the model at scale 1 / measured
        k = np.stack([np.sum(m[:, which == i], axis=1) / np.sum(m[:, which == i] ** 2, axis=1)
                      if compute is None else np.full(len(kappas), compute) for i in range(len(names))], axis=1)
        return k, np.sum((k[:, which] * m - 1) ** 2, axis=1)

    busy = loads(0.0, 0.0)  # the load is linear in the background's share: busy + share x (its load at 1)
    kappa, fixed, share, ld = 1.0, 0.0, 1.0, busy
    shared = int((busy > 0).sum())  # a run on a shared host has a load, busy alone
    if shared >= HOST_RUNS:
        # runs on a shared host: the grids' best (host_load 0.2 .. 3, worker_round_s 0 .. 10 ms, the background's
        # share 0 .. 1.5)
        best, kappas = math.inf, np.linspace(0.2, 3.0, 561)
        for f in np.linspace(0.0, 0.01, 21):
            extra = loads(float(f), 1.0) - busy
            for sh in np.linspace(0.0, 1.5, 31):
                ldf = busy + sh * extra
                errs = errors(kappas, ldf)[1]
                i = int(np.argmin(errs))
                if errs[i] < best - 1e-12:
                    best, kappa, fixed, share, ld = float(errs[i]), float(kappas[i]), float(f), float(sh), ldf
        terms += ["host_load", "worker_round_s", "background"]
    else:  # none, or too few to tell processor sharing from the compute scale: the base's
        kappa, fixed, share = base.host_load, base.worker_round_s, base.background
        ld = loads(fixed, share)
    k = errors(np.array([kappa]), ld)[0][0]
    rows_e, ye, bound = [], [], []
    for (prof, cat, ob), ki in zip(runs, k[which]):
        cal = Calibration(compute=float(ki), host_load=float(kappa), worker_round_s=fixed, background=share)
        p = predict(dataclasses.replace(prof, calibration=cal), cat, ob.config)  # exchange unstretched
        full = predict(dataclasses.replace(prof, calibration=dataclasses.replace(cal, exchange_stretch=1.0)), cat,
                       ob.config)
        tail = predict(dataclasses.replace(prof, calibration=dataclasses.replace(cal, tail_loss=1.0)), cat, ob.config)
        # at link scale 1: push + pull at the nominal rates (less their duplex overlap); the CPU work's stretch; the
        # tail losses' waits. The round trips are not scaled: they leave the measurement with compress and server
        rows_e.append([1.0, p.link_s - p.rtt_s, full.exchange_s - p.exchange_s, tail.link_s - p.link_s])
        ye.append(ob.exchange_s - (p.exchange_s - p.link_s) - p.rtt_s)  # less compress and server, unstretched
        # a worker's measured exchange ends when the step closes: in a run bound by compute, when the slowest
        # worker's push is in. It then measures the others' compute, not the link
        bound.append(ob.exchange_s > EXCHANGE_BOUND * ob.config.sync_every * ob.compute_s)
    keep = np.array(bound) if sum(bound) >= 2 else np.ones(len(bound), bool)
    ae, ve = np.array(rows_e)[keep], np.array(ye)[keep]
    if len(ve) >= len(LINK_TERMS):
        ke = _nnls_wls(np, ae, ve)
        terms += list(LINK_TERMS)
    else:  # the link scale alone, the rest the base's
        fixed_part = base.round_s * ae[:, 0] + base.exchange_stretch * ae[:, 2] + base.tail_loss * ae[:, 3]
        ke = np.array([base.round_s, _nnls_wls(np, ae[:, 1:2], ve - fixed_part)[0], base.exchange_stretch,
                       base.tail_loss])
        terms.append("link")
    cals = {n: Calibration(compute=float(max(k[i], 1e-3)), host_load=float(kappa), worker_round_s=fixed,
                           background=share,
                           link=float(max(ke[1], 1e-3)),
                           round_s=float(ke[0]), exchange_stretch=float(min(ke[2], 1.0)), tail_loss=float(ke[3]),
                           jitter=base.jitter, source=source or "fitted", runs=len(runs),
                           exchange_runs=int(keep.sum()))
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
        terms.append("jitter")
    return {n: dataclasses.replace(cal, fitted_terms=", ".join(terms)) for n, cal in cals.items()}


@dataclass(frozen=True)
class Run:
    """One measured run as :func:`read_runs` found it: its name, the catalog its configuration
    names, what it measured, and whose model it ran (``""``: the file does not say)."""

    name: str
    catalog: Catalog
    observation: Observation
    model: str = ""


def _is_description(text: str) -> bool:
    """bench.plan's description of a test-bed run ("widemlp W=2 100 Mbit/s 1.00% f16 H=1"),
    not a configuration in ``stella plan --config``'s syntax."""
    return " Mbit/s" in text


def read_runs(path: str, catalog: Catalog | None = None) -> list[Run]:
    """The measured runs in a JSON file: a runs file or ``python -m bench.plan --json``'s
    output (docs/plan.md section 3, *Calibrating on your own runs*). Each row has a
    configuration in ``stella plan --config``'s syntax (``spec``, else ``config``), the
    catalog it names (the row's ``catalog``, else the file's, else ``catalog``: a TOML path,
    relative to the file, or the catalog's tables inline) and what it measured (its
    ``measured``, else the row itself: :func:`observation`)."""
    import json
    import os

    from .catalog import catalog_from_dict, load_catalog

    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise PlanError(f"{path}: cannot read the runs: {e.strerror or e}") from None
    except ValueError as e:
        raise PlanError(f"{path}: not valid JSON: {e}") from None
    rows = doc.get("rows", doc.get("runs")) if isinstance(doc, dict) else doc
    if not isinstance(rows, list):
        raise PlanError(f"{path}: no runs in it (a JSON object with \"rows\": [...], as python -m bench.plan --json "
                        "writes, or a list of runs)")
    if not rows:
        raise PlanError(f"{path}: no runs in it (\"rows\" is empty)")
    top = doc if isinstance(doc, dict) else {}
    cache: dict[str, Catalog] = {}

    def catalog_of(spec: Any, where: str) -> Catalog | None:
        if spec is None:
            return catalog
        if isinstance(spec, dict):
            return catalog_from_dict(spec, f"{where}: catalog")
        if isinstance(spec, str):
            full = os.path.join(os.path.dirname(os.path.abspath(path)), spec)
            if full not in cache:
                cache[full] = load_catalog(full)
            return cache[full]
        raise PlanError(f"{where}: field 'catalog' must be a TOML file's path or the catalog's tables, got {spec!r}")

    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise PlanError(f"{path}: run {i}: a run is a JSON object, got {row!r}")
        name = str(row.get("run", row.get("name", i)))
        where = f"{path}: run {name}"
        text = row.get("spec", row.get("config"))
        if not isinstance(text, str):
            raise PlanError(f"{where}: missing field 'config' (the configuration, as stella plan --config takes it: "
                            "W=2,kind=NAME,density=1%,coding=q4,H=2)")
        model = row.get("model", top.get("model", ""))
        if "spec" in row or _is_description(text):  # bench.plan's row: the workload leads its description
            model = model or row.get("config", "").split(" ")[0]
        cat = catalog_of(row.get("catalog", top.get("catalog")), where)
        if _is_description(text):
            raise PlanError(f"{where}: {text!r} is bench.plan's description of a test-bed run, without its catalog "
                            "and configuration (bench.plan writes them since issue 47: \"spec\", \"catalog\"); "
                            "for an older file, python -m bench.calibrate FILE --out RUNS.json adds them")
        if cat is None:
            raise PlanError(f"{where}: no catalog for its configuration {text!r}: give --catalog (the catalog the "
                            "runs' configurations name) or a \"catalog\" in the file")
        out.append(read_run({**row, "run": name, "spec": text, "model": model}, cat, where))
    return out


def read_run(row: Mapping[str, Any], catalog: Catalog, where: str) -> Run:
    """One run from a runs file's row: its configuration (``spec``, in ``stella plan
    --config``'s syntax) on ``catalog`` and what it measured (``measured``, else the row)."""
    from .search import parse_config

    try:
        config = parse_config(str(row["spec"]), catalog)
        ob = observation(config, row.get("measured", row))
    except PlanError as e:
        raise PlanError(f"{where}: {e}") from None
    return Run(str(row.get("run", where)), catalog, ob, str(row.get("model", "")))


def calibrate(profile: Profile, runs: Sequence[Run], *, source: str, compute: float | None = None,
              base: Calibration | None = None) -> tuple[Calibration, list[str]]:
    """The profile's model fitted on its measured runs (:func:`fit_many`), and what to say
    about it: runs of other models left out, coefficients not fitted for want of runs.
    ``base``: where those come from (default: the fit ``stella plan`` uses for this profile)."""
    from .profile_file import attach_calibration

    base = base or attach_calibration(profile).calibration
    mine = [r for r in runs if r.model in ("", profile.model)]
    others = sorted({r.model for r in runs} - {"", profile.model})
    notes = []
    if not mine:
        raise PlanError(f"no runs of {profile.model!r} (the profile's model): the runs are of "
                        f"{', '.join(repr(m) for m in others)}; calibrate on runs of this model")
    if others:
        notes.append(f"left out {len(runs) - len(mine)} runs of other models ({', '.join(others)})")
    if not any(r.model for r in mine):
        notes.append(f"the runs do not say their model (\"model\"): taken as the profile's, {profile.model!r}")
    cal = fit_many([(profile, r.catalog, r.observation) for r in mine], source, compute, base)[profile.model]
    fitted = set(cal.fitted_terms.split(", "))
    shared = any(g.kind.host for r in mine for g in r.observation.config.groups)
    kept = [t for t in (*(("compute",) if compute is None else ()), *(("host_load", "worker_round_s", "background")
                                                                        if shared else ()), *LINK_TERMS, "jitter")
            if t not in fitted]
    if kept:
        bound = cal.exchange_runs
        notes.append(f"too few runs to fit every coefficient ({len(mine)} runs, {bound} in the link terms' fit, "
                     f"{len(LINK_TERMS)} needed for all four; 2 with a measured s/it for jitter; {HOST_RUNS} on "
                     "shared hosts for host_load, worker_round_s and background): fitted "
                     f"{cal.fitted_terms}; {', '.join(kept)} from the base fit ({base.source})")
        base_name = "the test bed's fit" if base.source.startswith("the test bed") else base.source
        cal = dataclasses.replace(cal, source=f"{cal.source}; fitted {cal.fitted_terms}; {', '.join(kept)} from "
                                              f"{base_name}")
    return cal, notes
