"""Slow links: ``python -m bench.slow [--rates 5,10] [--joiner 10] [--join-at 90] [--json PATH]``.

Issue 45's slow-link scenario on the test bed (``bench/wan``; needs root and network
namespaces): a job whose sites sit behind home or spot-market uplinks, shaped from the
start (the model's first copy included), and a site that joins mid-job over one of them.

- sites ``w0``, ``w1``, ...: a worker each at ``--rates`` Mbit/s both ways (5 and 10 by
  default), started together; the server's site ``ps`` at ``--ps-rate``;
- site ``join`` (``--joiner`` Mbit/s; 0: none) starts ``--join-at`` seconds later, with
  initial values of its own (another seed): it registers, pulls the job's model (a
  snapshot, 39 MB in pieces) and trains on;
- ``--workload`` (widemlp by default: 9.7M parameters, a 39 MB first copy: 62 s at
  5 Mbit/s) in update mode with the library's default compression and adaptation, until
  worker 0 reaches the workload's target or ``--max-seconds``.

Reported: whether and when the target was reached, each worker's start (join and
registration, for the joiner with its catch-up), steps, longest gap between its steps
after its first, network wait share and reconnects, and the server's "declared gone"
and "step deadline passed" counts: a large message must cause no liveness drop.
``--baseline`` runs the same job at ``--baseline-rate`` Mbit/s first, for the ratio.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from typing import Any

from bench.harness import collect_ranks, loadavg
from bench.stella_e2e import run_stella
from bench.wan import Link, WanTestbed


def job(rates: list[float], joiner: float, a: argparse.Namespace) -> dict[str, Any]:
    sites = {"ps": Link(a.ps_rate, a.ps_rate), **{f"w{i}": Link(r, r) for i, r in enumerate(rates)}}
    names = [f"w{i}" for i in range(len(rates))]
    start_after: list[float] = [0.0] * len(rates)
    seeds: list[int | None] = [None] * len(rates)
    if joiner:
        sites["join"] = Link(joiner, joiner)
        names.append("join")
        start_after.append(a.join_at)
        # its own initial values: not the job's, so it pulls the model (a snapshot, in pieces) as any worker
        # joining a job that has moved on does, whatever the history the server keeps
        seeds.append(1000)
    t0 = time.time()
    with WanTestbed(sites, max_lifetime=a.max_seconds + a.join_at + 600) as bed:
        res = run_stella(a.workload, world=len(names), steps=a.max_steps, max_seconds=a.max_seconds, bed=bed,
                         sites=names, density="default", value_dtype="default", sync_every=0, mode="update",
                         stop_at_target=True, start_after=start_after, expected=len(rates), log_dir=a.log_dir,
                         model_seeds=seeds)
    out: dict[str, Any] = {"rates": rates, "joiner": joiner, "wall_s": round(time.time() - t0, 1),
                           "ok": bool(res.get("ok"))}
    if not res.get("ok"):
        out["error"] = str(res.get("error", ""))[-3000:]
        return out
    ranks = [r for r in collect_ranks(res["log_dir"], len(names)) if r is not None]
    with open(os.path.join(res["log_dir"], "ps.log"), errors="replace") as f:
        log = f.read()
    reached = res.get("reached")
    out.update({
        "target": res["target"], "final_metric": res.get("final_metric"),
        "reached_s": round(reached["wall"], 1) if reached else None,
        "reached_step": reached["step"] if reached else None,
        "declared_gone": sum("workers declared gone" in line for line in log.splitlines()),
        "deadline_steps": sum("step deadline passed" in line for line in log.splitlines()),
        "transfers_lost": sum('"code": "transfer"' in line for line in log.splitlines()),
        "workers": [worker_row(name, r) for name, r in zip(names, ranks)],
        "log_dir": res["log_dir"]})
    return out


def worker_row(site: str, r: dict[str, Any]) -> dict[str, Any]:
    iters = r["iters"]
    ts = [x["t"] for x in iters]
    gaps = [y - x for x, y in itertools.pairwise(ts)]
    total = sum(x["iter"] for x in iters) or 1.0
    return {"site": site, "start_s": round(r.get("start_s", float("nan")), 1), "steps": r["steps"],
            "rounds": r["rounds"], "longest_gap_s": round(max(gaps, default=0.0), 2),
            "net_wait": round(sum(x["net_wait"] for x in iters) / total, 3), "reconnects": r.get("reconnects", 0),
            "first_step_s": round(iters[0]["iter"], 2) if iters else None}


def render(rows: list[dict[str, Any]]) -> str:
    out = []
    for r in rows:
        head = f"sites {'/'.join(f'{x:g}' for x in r['rates'])} Mbit/s" + (
            f" + joiner {r['joiner']:g} Mbit/s" if r["joiner"] else "")
        if not r["ok"]:
            out.append(f"{head}: FAILED\n{r.get('error', '')}")
            continue
        reached = (f"reached at {r['reached_s']} s (step {r['reached_step']})" if r["reached_s"] is not None
                   else "NOT reached")
        out.append(f"{head}: target {r['target']} {reached}, final {r['final_metric']:.4f}; declared gone "
                   f"{r['declared_gone']}, steps waiting the deadline {r['deadline_steps']}, transfers lost "
                   f"{r['transfers_lost']} [{r['wall_s']:.0f} s]")
        out.append("  site | start s | steps | rounds | longest gap s | net wait | reconnects")
        for w in r["workers"]:
            out.append(f"  {w['site']} | {w['start_s']} | {w['steps']} | {w['rounds']} | {w['longest_gap_s']} | "
                       f"{w['net_wait']:.0%} | {w['reconnects']}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.slow", description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="5,10", help="the starting sites' links, Mbit/s, one worker each")
    p.add_argument("--joiner", type=float, default=10.0, help="a site joining mid-job at this rate (0: none)")
    p.add_argument("--join-at", type=float, default=90.0,
                   help="seconds after the start (the first copy of widemlp takes 62-66 s at 5 Mbit/s: later than "
                        "that, the joiner is not one of the job's first workers, whose first step waits for all)")
    p.add_argument("--ps-rate", type=float, default=1000.0)
    p.add_argument("--workload", default="widemlp")
    p.add_argument("--max-seconds", type=float, default=600.0)
    p.add_argument("--max-steps", type=int, default=100_000)
    p.add_argument("--baseline", action="store_true", help="the same job at --baseline-rate first")
    p.add_argument("--baseline-rate", type=float, default=100.0)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    rates = [float(x) for x in a.rates.split(",") if x]
    load = loadavg()
    rows = []
    if a.baseline:
        rows.append(job([a.baseline_rate] * len(rates), a.baseline_rate if a.joiner else 0.0, a))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "error"}), flush=True)
    rows.append(job(rates, a.joiner, a))
    print(f"load {load} at the start; workload {a.workload}; the server's site at {a.ps_rate:g} Mbit/s")
    print(render(rows))
    if a.baseline and rows[0].get("reached_s") and rows[-1].get("reached_s"):
        print(f"time to target: {rows[-1]['reached_s'] / rows[0]['reached_s']:.2f}x the {a.baseline_rate:g} Mbit/s "
              "job's")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "args": vars(a), "load": load}, f, indent=1)
    return 0 if all(r["ok"] and r.get("reached_s") is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
