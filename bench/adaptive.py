"""The adaptive controller's benchmark (issue 22): Stella with its library defaults
(density, wire coding, local steps H and accumulation chosen by the client as it
runs) against Stella pinned to fixed settings and DDP, over the slow-link test bed.

Scenarios (each system in its own fresh test bed, so each sees the same link
schedule from its start; 2 workers in sites ``a``/``b``, ``ps`` at 1000 Mbit/s):

* ``fluctuating``: every site's rate follows a seeded schedule (:func:`rate_schedule`)
  that swings between 30 and 300 Mbit/s every few seconds, mean 130 (a) and 100 (b),
  up = down. Systems: ``adaptive`` (``Compression()`` defaults, default
  sync_every / max_sync_every / max_accumulate), ``pinned_d0.001`` / ``pinned_d0.01`` /
  ``pinned_d0.1`` (``Compression(density=d, value_dtype="f16")``, ``max_sync_every =
  sync_every``, ``max_accumulate=1``) and ``ddp``.
* ``slow``: steady 115 Mbit/s; worker 1 computes twice as long per step (``--slowdown 2``
  in bench.stella_e2e: it sleeps as long as its forward + backward took). Systems:
  ``adaptive_slow``, ``adaptive_fast`` (both workers at normal speed) and
  ``pinned_slow`` (density "auto", f16, no adaptation). Goals: adaptive_slow's time to
  target within 1.1x of the bound all-fast time x 2 / 1.5; the fast worker waits < 10%.
* ``steady``: steady 100 Mbit/s; ``adaptive`` against ``old`` (density "auto", f16,
  no adaptation). Goal: adaptive's iterations to target within 1.05x of old's.

  python -m bench.adaptive                                   # all scenarios, widemlp (long)
  python -m bench.adaptive --quick --scenario slow           # digits, ~20 s of training per system
  python -m bench.adaptive --scenario fluctuating --system adaptive --system ddp --json out.json

Time to target is rank 0's training clock (from its first step, evaluations left out); ``start
lag`` is how long after the first worker began training the last one did (a worker that pulls
the model as a snapshot over its link starts that much later, and the others' first steps wait
for it), and ``from the first start`` is the time to target from the first worker's start.
``wait`` is each worker's share of its time spent waiting for its exchange; in brackets the same
over its iterations clear of worker 0's evaluations (while worker 0 evaluates, the others finish
their step and wait for its push: with 0.1% pushes that alone was 13-19% of worker 1's time).

Output: a table per scenario on stdout, ``--json PATH`` (every per-iteration record of
every worker, the link schedules and ``bed.rate_log``, machine and load average) and
``--plot PATH`` (default bench/adaptive.png: over training wall time, per worker, the
held-out metric, s/it, wait share, density, coding, H and the link rates).
``--loopback`` runs without a test bed (no shaping; for checks without root).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from bench import workloads as W
from bench.harness import REPO, WARMUP_ITERS, clear_of, collect_ranks, evaluation_stalls, loadavg

SCENARIOS = ("fluctuating", "slow", "steady")
PS_RATE = 1000.0
PIN_H = 1  # the pinned systems' local steps per round (bench.e2e's "stella": H = 1)
LO, HI = 30.0, 300.0  # the fluctuating links' range, Mbit/s
MEANS = {"a": 130.0, "b": 100.0}  # ... and their means (overall ~115)
SETTLE_ITERS = 2  # iterations after one of worker 0's evaluations before the workers are in step again
SLOW_RATE, STEADY_RATE = 115.0, 100.0

# run_stella keywords: the library's defaults (nothing passed) ...
ADAPTIVE: dict[str, Any] = {"mode": "update", "density": "default", "value_dtype": "default", "sync_every": 0,
                            "max_sync_every": 0, "max_accumulate": 0}


def pinned(density: float | str, value_dtype: str = "f16", sync_every: int = PIN_H) -> dict[str, Any]:
    """... or fixed settings: no adaptation of H or accumulation (the old behaviour)."""
    return {"mode": "update", "density": density, "value_dtype": value_dtype, "sync_every": sync_every,
            "max_sync_every": sync_every, "max_accumulate": 1}


@dataclass
class System:
    name: str
    kind: str = "stella"  # or "ddp"
    kw: dict[str, Any] = field(default_factory=dict)  # run_stella keywords


def systems_of(scenario: str) -> list[System]:
    if scenario == "fluctuating":
        return [System("adaptive", kw=ADAPTIVE), *(System(f"pinned_d{d:g}", kw=pinned(d)) for d in (0.001, 0.01, 0.1)),
                System("ddp", kind="ddp")]
    if scenario == "slow":
        return [System("adaptive_slow", kw={**ADAPTIVE, "slowdown": [1.0, 2.0]}),
                System("adaptive_fast", kw=ADAPTIVE),
                System("pinned_slow", kw={**pinned("auto"), "slowdown": [1.0, 2.0]})]
    if scenario == "steady":
        return [System("adaptive", kw=ADAPTIVE), System("old", kw=pinned("auto"))]
    raise ValueError(f"unknown scenario {scenario!r}; known {SCENARIOS}")


# ============================================================ link schedules


def rate_schedule(mean: float, *, duration: float, lo: float = LO, hi: float = HI, period: float = 4.0,
                  seed: int | str = 0, segments: int = 10) -> list[tuple[float, float]]:
    """A deterministic (seeded) rate schedule ``[(t_seconds, mbit), ...]`` from ``t = 0``
    covering ``duration`` s: a cycle of ``segments`` levels, each held ``period`` x
    U(0.6, 1.4) s, alternating low and high, that reaches exactly ``lo`` and ``hi`` and
    whose time-weighted mean is ``mean`` (levels ``lo + (hi - lo) x^g``, ``g`` solved by
    bisection), repeated until ``duration``."""
    if segments < 2 or period <= 0 or duration <= 0:
        raise ValueError("need segments >= 2, period > 0, duration > 0")
    rng = random.Random(f"stella-adaptive:{seed}")
    durs = [period * rng.uniform(0.6, 1.4) for _ in range(segments)]
    xs = [rng.uniform(0.0, 0.45) if i % 2 == 0 else rng.uniform(0.55, 1.0) for i in range(segments)]
    x0, x1 = min(xs), max(xs)
    xs = [(x - x0) / (x1 - x0) for x in xs]  # the cycle reaches lo and hi
    total = sum(durs)

    def cycle_mean(g: float) -> float:
        return sum(d * (lo + (hi - lo) * x ** g) for d, x in zip(durs, xs)) / total

    a, b = -8.0, 8.0  # log g; the mean falls as g grows
    if not cycle_mean(math.exp(b)) <= mean <= cycle_mean(math.exp(a)):
        raise ValueError(f"mean {mean} out of reach for range {lo}..{hi} with this cycle")
    for _ in range(100):
        m = (a + b) / 2
        a, b = (m, b) if cycle_mean(math.exp(m)) > mean else (a, m)
    g = math.exp((a + b) / 2)
    levels = [round(lo + (hi - lo) * x ** g, 1) for x in xs]
    out: list[tuple[float, float]] = []
    t = 0.0
    for i in range(10_000):  # bounded: duration / (0.6 period) segments
        if t >= duration:
            break
        out.append((round(t, 3), levels[i % segments]))
        t += durs[i % segments]
    return out


def time_mean(schedule: list[tuple[float, float]], until: float) -> float:
    """The time-weighted mean rate of ``schedule`` over ``[0, until]``."""
    acc = 0.0
    for (t, r), nxt in zip(schedule, [*schedule[1:], (until, None)]):
        if t >= until:
            break
        acc += r * (min(nxt[0], until) - t)
    return acc / until


def links_of(scenario: str, duration: float, period: float, seed: int) -> dict[str, Any]:
    """The test bed's sites for ``scenario`` (``bench.wan.Link`` per site) and a
    description ({site: {"schedule": [(t, mbit)], "mean": ...}})."""
    from bench.wan import Link

    sites: dict[str, Link] = {"ps": Link(PS_RATE, PS_RATE)}
    desc: dict[str, Any] = {"ps": {"schedule": [(0.0, PS_RATE)], "mean": PS_RATE}}
    for site in ("a", "b"):
        if scenario == "fluctuating":
            sched = rate_schedule(MEANS[site], duration=duration, period=period, seed=f"{seed}:{site}")
        else:
            sched = [(0.0, SLOW_RATE if scenario == "slow" else STEADY_RATE)]
        sites[site] = Link(sched[0][1], sched[0][1], schedule=tuple((t, r, r) for t, r in sched[1:]))
        desc[site] = {"schedule": sched, "mean": time_mean(sched, sched[-1][0] + 1e-9) if len(sched) > 1
                      else sched[0][1]}
    return {"links": sites, "desc": desc}


def rate_at(rate_log: list, site: str, t_bed: float) -> float | None:
    """The up rate of ``site`` at test-bed time ``t_bed`` from ``bed.rate_log``."""
    cur = None
    for t, s, up, _down in rate_log:
        if s == site and t <= t_bed:
            cur = up
    return cur


# ============================================================ running


@dataclass
class Caps:
    max_seconds: float
    max_steps: int
    eval_every: int
    stop_at_target: bool = True
    period: float = 4.0  # seconds between the fluctuating links' changes (mean)


def caps_for(workload: str, quick: bool) -> Caps:
    wl = W.get(workload)
    if quick:
        return Caps(max_seconds={"digits": 20, "widemlp": 30}.get(workload, 30), max_steps=100_000,
                    eval_every=wl.eval_every, period=2.5)
    return Caps(max_seconds={"digits": 120, "widemlp": 400}.get(workload, 900), max_steps=100_000,
                eval_every=wl.eval_every, period=4.0)


def _iters_with_time(rank: dict, kind: str) -> list[dict]:
    """The rank's per-iteration records with ``t`` (training wall seconds) and
    ``t_epoch``; DDP's records have neither: the running sum of its iteration times
    from its training start (evaluations excluded, so approximate)."""
    iters = rank.get("iters") or []
    if kind == "ddp" and iters and "t" not in iters[0]:
        t0 = (rank.get("timeline") or {}).get("train_start") or 0.0
        acc = 0.0
        for x in iters:
            acc += x["iter"]
            x["t"], x["t_epoch"] = acc, t0 + acc
            x.setdefault("rounds", x["step"])
    return iters


def run_system(system: System, scenario: str, workload: str, caps: Caps, *, seed: int = 0, loopback: bool = False,
               log_dir: str | None = None) -> dict:
    """One system's job in a fresh test bed (or on loopback): its summary, every rank's
    records (``ranks``), and the bed's ``rate_log`` and start (``bed_epoch``)."""
    from bench.baselines import run_ddp
    from bench.stella_e2e import run_stella

    dur = caps.max_seconds + 300  # the schedule outlasts training plus start-up
    lk = links_of(scenario, dur, caps.period, seed)
    t0 = time.monotonic()
    bed = None
    out: dict[str, Any] = {"system": system.name, "kind": system.kind, "scenario": scenario, "workload": workload,
                           "config": system.kw, "links": lk["desc"], "loopback": loopback}
    try:
        if not loopback:
            from bench.wan import WanTestbed

            bed = WanTestbed(lk["links"], max_lifetime=caps.max_seconds + 420).start()
            out["bed_epoch"] = time.time() - bed.elapsed()
        common: dict[str, Any] = dict(world=2, steps=caps.max_steps, max_seconds=caps.max_seconds, bed=bed,
                      sites=["a", "b"] if bed else None, seed=seed, eval_every=caps.eval_every,
                      stop_at_target=caps.stop_at_target, log_dir=log_dir)
        if system.kind == "ddp":
            res = run_ddp(workload, "ddp", calib=1, **common)
        else:
            res = run_stella(workload, ps_site="ps", **common, **system.kw)
        if bed is not None:
            out["rate_log"] = [list(x) for x in bed.rate_log]
    except Exception:
        res = {"ok": False, "error": traceback.format_exc()}
    finally:
        if bed is not None:
            bed.close()
    res.pop("per_iter", None)  # the full records are in "ranks"
    out.update(res)
    out["system"] = system.name
    out["elapsed"] = time.monotonic() - t0
    if res.get("ok"):
        ranks = collect_ranks(res["log_dir"], 2)
        for r in ranks:
            if r is None:
                continue
            for x in _iters_with_time(r, system.kind):
                if "bed_epoch" in out:
                    x["t_bed"] = x["t_epoch"] - out["bed_epoch"]
                    x["link_mbit"] = rate_at(out.get("rate_log", []), r.get("site") or "", x["t_bed"])
        out["ranks"] = ranks
        out["stats"] = stats_of(out)
    return out


# ============================================================ summaries


def _steady(iters: list[dict]) -> list[dict]:
    return iters[min(WARMUP_ITERS, max(0, len(iters) - 1)):]


def _share(waits: list[dict]) -> float | None:
    return sum(x["net_wait"] for x in waits) / max(1e-12, sum(x["iter"] for x in waits)) if waits else None


def stats_of(res: dict) -> dict:
    """The table's figures from a run's records (per worker where it says so). ``wait_share``
    counts every steady iteration; ``link_wait_share`` those clear of worker 0's evaluations
    (:func:`bench.harness.evaluation_stalls`, settling for two iterations after each): a wait
    there is the job's stall for the evaluation, not the exchange's."""
    ranks = [r for r in res.get("ranks") or [] if r]
    per: list[dict[str, Any]] = []
    med = [statistics.median(x["iter"] for x in _steady(r["iters"])) for r in ranks if r["iters"]]
    stalls = evaluation_stalls(ranks[0], SETTLE_ITERS * max(med)) if ranks and med else []
    for r in ranks:
        it = _steady(r["iters"])
        if not it:
            per.append({})
            continue
        d = {"s_per_it": statistics.median(x["iter"] for x in it), "wait_share": _share(it),
             "link_wait_share": _share([x for x in it if "t_epoch" in x and clear_of(x, stalls)]),
             "compute": statistics.median(x["compute"] for x in it), "steps": r.get("steps"),
             "rounds": r.get("rounds", r.get("steps"))}
        if "bytes_up" in it[0]:  # veth bytes both ways over the rounds those iterations started
            skip = len(r["iters"]) - len(it)
            nr = (it[-1].get("rounds") or 0) - ((r["iters"][skip - 1].get("rounds") or 0) if skip else 0)
            d["bytes_per_round"] = sum(x["bytes_up"] + x["bytes_down"] for x in it) / max(1, nr)
        if "density" in it[-1]:
            d["density_final"] = r["iters"][-1]["density"]
            d["density_median"] = statistics.median(x["density"] for x in it)
        per.append(d)
    out: dict[str, Any] = {"per_worker": per}
    reach = res.get("reached")
    out["time_to_target"] = reach["wall"] if reach else None
    out["iters_to_target"] = reach["step"] if reach else None
    starts = [r["train_start_epoch"] for r in ranks if r.get("train_start_epoch")]
    # job start: how long after the first worker began training the last one did (a joiner pulling the
    # model as a snapshot over its link starts that much later); rank 0's clock, time to target, starts at its own
    out["start_lag_s"] = max(starts) - min(starts) if len(starts) > 1 else None
    # the job's time to target: from the first worker's start
    out["job_time_to_target"] = None
    if reach and len(starts) > 1 and ranks[0].get("train_start_epoch"):
        out["job_time_to_target"] = reach["wall"] + ranks[0]["train_start_epoch"] - min(starts)
    bpr = [d["bytes_per_round"] for d in per if "bytes_per_round" in d]
    if bpr:
        out["bytes_per_round"], out["bytes_source"] = statistics.mean(bpr), "veth"
    elif res.get("client_bytes_per_round"):
        c = res["client_bytes_per_round"]
        out["bytes_per_round"], out["bytes_source"] = c["pushed"] + c["pulled"], "client"
    allit = [x for r in ranks for x in _steady(r["iters"])]
    if res.get("kind") == "stella" and allit:
        codings: dict[str, int] = {}
        for x in allit:
            codings[str(x.get("value_dtype"))] = codings.get(str(x.get("value_dtype")), 0) + 1
        out["codings"] = {k: v / len(allit) for k, v in sorted(codings.items(), key=lambda kv: -kv[1])}
        hs = [int(x.get("sync_every") or 1) for x in allit]
        acc = [int(x.get("accumulate") or 1) for x in allit]
        out["H_range"], out["accumulate_range"] = [min(hs), max(hs)], [min(acc), max(acc)]
        out["density_median"] = statistics.median(x["density"] for x in allit)
    return out


def goals(scenario: str, results: list[dict]) -> dict[str, Any]:
    """The scenario's goal figures (``None`` where a run did not reach the target)."""
    by = {r["system"]: r.get("stats") or {} for r in results if r.get("ok")}

    def ttt(name):
        return (by.get(name) or {}).get("time_to_target")

    g: dict[str, Any] = {}
    if scenario == "slow":
        fast, slow = ttt("adaptive_fast"), ttt("adaptive_slow")
        g["bound_s"] = fast * 2 / 1.5 if fast else None
        g["adaptive_slow_over_bound"] = slow / g["bound_s"] if slow and g["bound_s"] else None
        for name in ("adaptive_slow", "pinned_slow", "adaptive_fast"):
            pw = (by.get(name) or {}).get("per_worker") or []
            g[f"{name}_fast_worker_wait"] = pw[0].get("wait_share") if pw else None
        g["pass"] = bool(g["adaptive_slow_over_bound"] is not None and g["adaptive_slow_over_bound"] <= 1.1
                         and (g["adaptive_slow_fast_worker_wait"] or 1.0) < 0.10)
    elif scenario == "steady":
        a, o = (by.get("adaptive") or {}).get("iters_to_target"), (by.get("old") or {}).get("iters_to_target")
        g["iters_adaptive_over_old"] = a / o if a and o else None
        g["time_adaptive_over_old"] = ttt("adaptive") / ttt("old") if ttt("adaptive") and ttt("old") else None
        g["pass"] = bool(g["iters_adaptive_over_old"] is not None and g["iters_adaptive_over_old"] <= 1.05)
    elif scenario == "fluctuating":
        a = ttt("adaptive")
        g["time_other_over_adaptive"] = {n: (ttt(n) / a if a and ttt(n) else None) for n in by if n != "adaptive"}
    return g


def _fmt(v, spec=".2f", none="-"):
    return none if v is None else format(v, spec)


def table(scenario: str, results: list[dict]) -> str:
    lines = [f"## {scenario}",
             "| system | time to target (s) | it to target | s/it w0 / w1 | wait w0 / w1 (clear of evals) | kB/round | "
             "density final w0,w1; median | codings | H range (acc) | final metric | start lag (s) | "
             "from the first start (s) |",
             "|" + "---|" * 12]
    for r in results:
        if not r.get("ok"):
            err = str(r.get("error") or "").strip().splitlines()
            lines.append(f"| {r['system']} | FAILED: {err[-1][:90] if err else ''} |" + " |" * 10)
            continue
        s = r["stats"]
        pw = s["per_worker"] + [{}] * (2 - len(s["per_worker"]))
        spi = " / ".join(_fmt(w.get("s_per_it"), ".3f") for w in pw)
        wait = " / ".join(_fmt(100 * w["wait_share"], ".0f") + "%" if w.get("wait_share") is not None else "-"
                          for w in pw)
        clear = [w.get("link_wait_share") for w in pw]
        if any(v is not None for v in clear):
            wait += " (" + " / ".join("-" if v is None else f"{100 * v:.0f}%" for v in clear) + ")"
        bpr = _fmt(s["bytes_per_round"] / 1e3, ".0f") if s.get("bytes_per_round") is not None else "-"
        if "density_median" in s:
            dens = ",".join(_fmt(w.get("density_final"), ".3g") for w in pw) + f"; {s['density_median']:.3g}"
        else:
            dens = "dense"
        cod = ", ".join(f"{k} {100 * v:.0f}%" for k, v in s["codings"].items()) if s.get("codings") else "f32"
        hr = s.get("H_range")
        hs = "-" if not hr else (f"{hr[0]}" if hr[0] == hr[1] else f"{hr[0]}-{hr[1]}")
        ar = s.get("accumulate_range")
        if ar and ar != [1, 1]:
            hs += f" (acc {ar[0]}-{ar[1]})"
        fm = r.get("final_metric")
        lines.append(f"| {r['system']} | {_fmt(s['time_to_target'], '.1f', 'not reached')} | "
                     f"{_fmt(s['iters_to_target'], 'd')} | {spi} | {wait} | {bpr} | {dens} | {cod} | {hs} | "
                     f"{_fmt(fm, '.4f')} | {_fmt(s.get('start_lag_s'), '.2f')} | "
                     f"{_fmt(s.get('job_time_to_target'), '.1f')} |")
    g = goals(scenario, results)
    if scenario == "slow":
        def pct(v):
            return "-" if v is None else f"{100 * v:.0f}%"

        lines.append(f"bound = adaptive_fast x 2 / 1.5 = {_fmt(g['bound_s'], '.1f')} s; adaptive_slow / bound = "
                     f"{_fmt(g['adaptive_slow_over_bound'])} (goal <= 1.1); fast worker (w0) waits: adaptive_slow "
                     f"{pct(g['adaptive_slow_fast_worker_wait'])} (goal < 10%), pinned_slow "
                     f"{pct(g['pinned_slow_fast_worker_wait'])}, adaptive_fast "
                     f"{pct(g['adaptive_fast_fast_worker_wait'])}")
    elif scenario == "steady":
        lines.append(f"iterations to target adaptive / old = {_fmt(g['iters_adaptive_over_old'])} (goal <= 1.05); "
                     f"time adaptive / old = {_fmt(g['time_adaptive_over_old'])}")
    elif scenario == "fluctuating":
        lines.append("time to target, other / adaptive: " + ", ".join(
            f"{n} {_fmt(v)}" for n, v in g["time_other_over_adaptive"].items()))
    return "\n".join(lines)


# ============================================================ plot

CODING_ORDER = ["f32", "bf16", "f16", "q8", "q4", "q2"]


def _rolling(xs: list[float], ys: list[float], n: int = 7) -> tuple[list[float], list[float]]:
    if len(ys) < n:
        return xs, ys
    h = n // 2
    return xs[h:len(xs) - h], [statistics.median(ys[i - h:i + h + 1]) for i in range(h, len(ys) - h)]


def _wait_share(iters: list[dict], n: int = 7) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for i in range(len(iters)):
        w = iters[max(0, i - n + 1):i + 1]
        xs.append(iters[i]["t"])
        ys.append(sum(x["net_wait"] for x in w) / max(1e-12, sum(x["iter"] for x in w)))
    return xs, ys


def plot(scenarios: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s for s in scenarios if scenarios[s]["results"]]
    if not names:
        return
    rows = ["metric", "s/it", "wait share", "density", "coding", "H", "link Mbit/s"]
    fig, axes = plt.subplots(len(rows), len(names), figsize=(6.5 * len(names), 2.3 * len(rows)), squeeze=False,
                             sharex="col")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for c, scen in enumerate(names):
        results = scenarios[scen]["results"]
        ax = {name: axes[i][c] for i, name in enumerate(rows)}
        codings = sorted({str(x.get("value_dtype")) for r in results if r.get("ok") and r["kind"] == "stella"
                          for k in r["ranks"] if k for x in k["iters"]},
                         key=lambda v: CODING_ORDER.index(v) if v in CODING_ORDER else len(CODING_ORDER))
        for i, r in enumerate(results):
            if not r.get("ok"):
                continue
            col = colors[i % len(colors)]
            ax["metric"].plot([e["wall"] for e in r["evals"]], [e["metric"] for e in r["evals"]], color=col,
                              marker=".", label=r["system"])
            for k in r["ranks"]:
                if not k or not k["iters"]:
                    continue
                it, ls = k["iters"], "-" if k["rank"] == 0 else "--"
                t = [x["t"] for x in it]
                ax["s/it"].plot(*_rolling(t, [x["iter"] for x in it]), color=col, ls=ls, lw=1)
                ax["wait share"].plot(*_wait_share(it), color=col, ls=ls, lw=1)
                if r["kind"] != "stella":
                    continue
                ax["density"].plot(t, [x["density"] for x in it], color=col, ls=ls, lw=1)
                ax["coding"].step(t, [codings.index(str(x.get("value_dtype"))) for x in it], color=col, ls=ls,
                                  lw=1, where="post")
                ax["H"].step(t, [x.get("sync_every") or 1 for x in it], color=col, ls=ls, lw=1, where="post")
                meas = [(x["t"], x["up_mbps"]) for x in it if x.get("up_mbps")]
                if meas:
                    ax["link Mbit/s"].plot(*zip(*meas), color=col, ls="none", marker=".", ms=2,
                                           label=f"{r['system']} w{k['rank']} measured up")
        # the link schedule (the same in every system's bed), aligned to the first run's training start
        first = next((r for r in results if r.get("ok") and r.get("bed_epoch") and r["ranks"][0]), None)
        off = (first["ranks"][0].get("train_start_epoch") or first["ranks"][0]["iters"][0]["t_epoch"]) \
            - first["bed_epoch"] if first else 0.0
        tmax = max([x["t"] for r in results if r.get("ok") for k in r["ranks"] if k for x in k["iters"]] or [1.0])
        for site, ls in (("a", "-"), ("b", "--")):
            sched = scenarios[scen]["links"][site]["schedule"]
            ts = [t - off for t, _ in sched] + [tmax]
            vs = [v for _, v in sched] + [sched[-1][1]]
            before = [v for t, v in zip(ts, vs) if t <= 0]  # the rate at the training start, then its changes
            keep = [(0.0, before[-1] if before else vs[0])] + [(t, v) for t, v in zip(ts, vs) if 0 < t <= tmax]
            if keep:
                ax["link Mbit/s"].step(*zip(*keep), where="post", color="black", ls=ls, lw=1,
                                       label=f"site {site} ({'w0' if site == 'a' else 'w1'}) schedule, at "
                                             f"{first['system'] if first else '?'}'s training time")
        # the time axis ends a little after the adaptive runs, so that a baseline many times
        # slower (DDP, a pinned density the link cannot carry) does not squeeze them flat
        ends = [x["t"] for r in results if r.get("ok") and r["system"].startswith("adaptive")
                for k in r["ranks"] if k for x in k["iters"]]
        cut = ""
        if ends and 1.5 * max(ends) < tmax:
            for name in rows:
                ax[name].set_xlim(0, 1.5 * max(ends))
            cut = f"; time cut at {1.5 * max(ends):.0f} s of {tmax:.0f}"
        ax["metric"].set_title(f"{scen} ({scenarios[scen]['workload']}); solid w0 (site a), dashed w1 (site b){cut}",
                               fontsize=9)
        ax["metric"].legend(fontsize=7)
        ax["density"].set_yscale("log")
        ax["coding"].set_yticks(range(len(codings)), codings)
        ax["link Mbit/s"].legend(fontsize=6)
        ax["link Mbit/s"].set_xlabel("training wall time (s)")
        for name in rows:
            ax[name].set_ylabel(name)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ============================================================ main


def run_scenario(scenario: str, workload: str, caps: Caps, *, only: list[str] | None = None, seed: int = 0,
                 loopback: bool = False, log_dir: str | None = None, echo=print) -> dict:
    systems = [s for s in systems_of(scenario) if not only or s.name in only]
    out = {"workload": workload, "caps": caps.__dict__, "results": [],
           "links": links_of(scenario, caps.max_seconds + 300, caps.period, seed)["desc"]}
    for s in systems:
        r = run_system(s, scenario, workload, caps, seed=seed, loopback=loopback, log_dir=log_dir)
        out["results"].append(r)
        if r.get("ok"):
            st = r["stats"]
            ttt = "not reached" if st["time_to_target"] is None else f"{st['time_to_target']:.1f} s"
            echo(f"{scenario:>11} {s.name:>14}: {r['steps']} steps, to target {ttt}, final {r['final_metric']:.4f} "
                 f"({r['elapsed']:.0f} s)")
        else:
            echo(f"{scenario:>11} {s.name:>14}: FAILED\n{r.get('error')}")
    out["goals"] = goals(scenario, out["results"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.adaptive", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", action="append", choices=SCENARIOS, help="repeatable; default all")
    ap.add_argument("--workload", choices=sorted(W.WORKLOADS), help="default widemlp (digits with --quick)")
    ap.add_argument("--quick", action="store_true", help="short runs (digits, 20 s of training per system)")
    ap.add_argument("--system", action="append", help="only these systems (names as in the tables); repeatable")
    ap.add_argument("--max-seconds", type=float, help="override the training wall cap per system")
    ap.add_argument("--period", type=float, help="mean seconds between the fluctuating links' changes")
    ap.add_argument("--no-stop-at-target", action="store_true", help="train for the whole cap")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--loopback", action="store_true", help="no test bed (no shaping: machinery checks only)")
    ap.add_argument("--json")
    ap.add_argument("--plot", default=os.path.join(REPO, "bench", "adaptive.png"), help="'' for none")
    a = ap.parse_args(argv)
    from bench.e2e import machine

    workload = a.workload or ("digits" if a.quick else "widemlp")
    caps = caps_for(workload, a.quick)
    if a.max_seconds:
        caps.max_seconds = a.max_seconds
    if a.period:
        caps.period = a.period
    caps.stop_at_target = not a.no_stop_at_target
    scens = a.scenario or list(SCENARIOS)
    known = {s.name for sc in scens for s in systems_of(sc)}
    for s in a.system or ():
        if s not in known:
            ap.error(f"unknown system {s!r} for {scens}; known: {sorted(known)}")
    command = "python -m bench.adaptive " + " ".join(sys.argv[1:] if argv is None else argv)
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load0, mach = loadavg(), machine()
    log_root = tempfile.mkdtemp(prefix="adaptive-")
    print(f"# {command}\n# {started}; {mach}\n# load average at start {load0}; workload {workload}; "
          f"caps {caps.__dict__}; logs {log_root}", flush=True)
    done: dict[str, dict] = {}
    for scen in scens:
        done[scen] = run_scenario(scen, workload, caps, only=a.system, seed=a.seed, loopback=a.loopback,
                                  log_dir=log_root, echo=lambda m: print(m, flush=True))
    print()
    for scen in scens:
        d = done[scen]["links"]
        print("links: " + ", ".join(f"{s} mean {d[s]['mean']:.0f} Mbit/s" for s in ("a", "b"))
              + (" (schedule 30..300, bed per system)" if scen == "fluctuating" else "")
              + (" [loopback: unshaped]" if a.loopback else ""))
        print(table(scen, done[scen]["results"]) + "\n")
    load1 = loadavg()
    print(f"# load average at start {load0}, at end {load1}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"command": command, "started": started, "machine": mach, "loadavg_start": load0,
                       "loadavg_end": load1, "workload": workload, "quick": a.quick, "scenarios": done}, f)
    if a.plot:
        plot(done, a.plot)
        print(f"# plot {a.plot}")
    return 0 if all(r.get("ok") for d in done.values() for r in d["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
