"""How traffic and convergence scale with the number of workers: exact pulls against the
compressed broadcast, and sites of ranks against flat workers.

    python -m bench.scale [--workers 2,4,8,16,32] [--workload digits] [--quick] [--json PATH] [--plot PNG]
    python -m bench.scale --sites 4x2 [--rate 100]   # 4 sites of 2 ranks vs 8 flat workers, over the test bed

Each run is ``bench.e2e``'s Stella system (``bench.stella_e2e``: update mode, the
workload's own optimizer on every worker, ``--density`` pushes in f16) with ``W``
worker processes on loopback, against a ``stella-ps`` in each pull mode
(``--pulls``: ``exact``, ``broadcast`` with the server's defaults, or
``broadcast:CODINGxFACTOR``). The reference of each ``W`` is **dense training at the
same global batch**: PyTorch DDP with ``W`` processes (``bench.baselines``), which
sees the same samples each step (``bench.workloads``). Reported per ``W`` and pull
mode: a worker's bytes sent and received per round (its client's counters) and their
ratio, the values a round carries each way, and the steps to the workload's target
(the same evaluations as ``bench.e2e``) with their ratio to DDP's.

``--sites SxR``: S sites of R ranks (``torch.distributed`` gloo inside a site, one
leader speaking to the server: ``StellaOptimizer(process_group=...)``) against S x R
flat workers, R per site, in the slow-link test bed (each site at ``--rate``
Mbit/s; loopback where there is none): WAN bytes per site per round, and steps to
target at the same samples per step. Lightweight processes: the point is bytes and
iterations, not compute (one thread each).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from typing import Any

from bench.baselines import run_ddp
from bench.harness import loadavg
from bench.stella_e2e import run_stella


@dataclass(frozen=True)
class Variant:
    """One Stella configuration of the sweep, written ``PULL[:CODINGxFACTOR][@OUTER][/DENSITY]``:
    ``exact`` or ``broadcast`` pulls (with the broadcast's value coding and factor, else
    the server's defaults), the outer step (``auto``, the default, ``average``, ``sqrt``,
    ``nesterov`` or ``lrX``: plain SGD with lr X on the mean change) and the pushes' density (else ``--density``)."""

    spec: str
    server_args: tuple[str, ...]
    outer: str
    density: str | None

    @classmethod
    def parse(cls, spec: str) -> Variant:
        rest, _, density = spec.partition("/")
        rest, _, outer = rest.partition("@")
        mode, _, coding = rest.partition(":")
        if mode not in ("exact", "broadcast"):
            raise ValueError(f"{spec}: the pull is exact or broadcast")
        args = ["--pull", mode]
        if coding:
            values, _, factor = coding.partition("x")
            args += ["--broadcast-values", values, "--broadcast-factor", factor or "1"]
        if outer.startswith("lr"):
            outer = json.dumps({"name": "sgd", "lr": float(outer[2:])})
        return cls(spec, tuple(args), outer or "auto", density or None)


def _steps(res: dict[str, Any]) -> int | None:
    reach = res.get("reached")
    return int(reach["step"]) if reach else None


def _mean_steps(steps: list[int | None]) -> float | None:
    """The mean over seeds of the steps to target; None if a seed did not reach it."""
    return None if not steps or None in steps else statistics.mean(s for s in steps if s is not None)


def stella(workload: str, w: int, v: Variant, a: argparse.Namespace, *, bed: Any = None, site_size: int = 1,
           sites: list[str] | None = None) -> dict[str, Any]:
    """One configuration at ``W`` over every seed: the traffic and server CPU of the
    first seed's run, the steps to target of each."""
    runs = []
    for seed in a.seed_list:
        res = run_stella(workload, world=w, steps=a.steps, max_seconds=a.max_seconds, bed=bed, sites=sites,
                         seed=seed, stop_at_target=True, density=v.density or a.density, mode="update",
                         server_args=v.server_args, outer=v.outer, site_size=site_size)
        if not res.get("ok"):
            raise RuntimeError(f"W={w} {v.spec} seed {seed}: {res.get('error')}")
        runs.append(res)
    res = runs[0]
    nbytes, values = res["client_bytes_per_round"], res["values_per_round"]
    per_site_wan = None
    if bed is not None:  # the veth counters of each site: what crossed its link
        per_site_wan = (res["bytes_up_median"] or 0) + (res["bytes_down_median"] or 0)
    return {"workers": w, "pull": v.spec, "site_size": site_size, "density": v.density or a.density,
            "server_cpu_ms_per_round": round(res["server_cpu_ms_per_round"], 2),
            "push_bytes_per_round": round(nbytes["pushed"]), "pull_bytes_per_round": round(nbytes["pulled"]),
            "push_values_per_round": round(values["pushed"]), "pull_values_per_round": round(values["pulled"]),
            "steps_to_target": _mean_steps([_steps(r) for r in runs]), "steps_by_seed": [_steps(r) for r in runs],
            "final_metric": res["final_metric"], "metric": res["metric"],
            "train_wall_s": res["train_wall"],
            "wan_bytes_per_rank_per_iter": per_site_wan}


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _ratio(x: float | None, y: float | None) -> str:
    return f"{x / y:.2f}" if x and y else "-"


def _table(workload: str, rows: list[dict[str, Any]], dense: dict[int, float | None]) -> None:
    exact = {r["workers"]: r["steps_to_target"] for r in rows if r["pull"] == "exact"}
    print(f"{'W':>3} {'configuration':<22} {'push B/rnd':>11} {'pull B/rnd':>11} {'pull/push':>9} "
          f"{'values push/pull':>17} {'server ms':>9} {'steps':>6} {'DDP':>5} {'x DDP':>6} {'x exact':>7}")
    for r in rows:
        d, s = dense.get(r["workers"]), r["steps_to_target"]
        print(f"{r['workers']:>3} {r['pull']:<22} {r['push_bytes_per_round']:>11,} {r['pull_bytes_per_round']:>11,} "
              f"{r['pull_bytes_per_round'] / max(1, r['push_bytes_per_round']):>9.2f} "
              f"{r['push_values_per_round']:>8,}/{r['pull_values_per_round']:<8,} "
              f"{r['server_cpu_ms_per_round']:>9.2f} {_num(s):>6} {_num(d):>5} {_ratio(s, d):>6} "
              f"{_ratio(s, exact.get(r['workers'])):>7}")


def _plot(workload: str, rows: list[dict[str, Any]], dense: dict[int, float | None], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for pull in dict.fromkeys(r["pull"] for r in rows):
        style = "o--" if pull == "exact" else "s-"
        rs = [r for r in rows if r["pull"] == pull]
        ws = [r["workers"] for r in rs]
        ax1.plot(ws, [r["pull_bytes_per_round"] / 1e3 for r in rs], style, label=f"pull ({pull})")
        ax2.plot(ws, [(r["steps_to_target"] or float("nan")) / (dense.get(r["workers"]) or float("nan"))
                      for r in rs], style, label=pull)
    pushes = sorted({(r["workers"], r["push_bytes_per_round"]) for r in rows if r["pull"] == rows[0]["pull"]})
    ax1.plot([w for w, _ in pushes], [b / 1e3 for _, b in pushes], "k:", label="push")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers W")
        ax.legend(fontsize=8)
    ax1.set_ylabel("kB per worker per round")
    ax2.set_ylabel("steps to target / DDP's at the same global batch")
    ax2.axhline(1.0, color="gray", lw=0.5)
    fig.suptitle(f"bench.scale: {workload}, update mode, f16 pushes, loopback")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="digits")
    p.add_argument("--workers", default="2,4,8,16,32")
    p.add_argument("--pulls", default="exact,broadcast",
                   help="configurations, comma-separated: PULL[:CODINGxFACTOR][@OUTER][/DENSITY] (see Variant), "
                        "e.g. exact, broadcast, broadcast:f16x1, exact@lr2, broadcast/auto")
    p.add_argument("--density", default="0.01", help="the pushes' density, or auto")
    p.add_argument("--steps", type=int, default=400, help="the most steps of a run (it stops at the target)")
    p.add_argument("--max-seconds", type=float, default=1800)
    p.add_argument("--seeds", default="0", help="seeds, comma-separated: steps to target are their mean")
    p.add_argument("--sites", help="SxR: S sites of R ranks against S*R flat workers (the test bed)")
    p.add_argument("--rate", type=float, default=100.0, help="Mbit/s of each site (--sites)")
    p.add_argument("--ps-rate", type=float, default=1000.0)
    p.add_argument("--quick", action="store_true", help="W 2 and 8")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PNG")
    a = p.parse_args(argv)
    a.seed_list = [int(x) for x in a.seeds.split(",")]
    if a.quick:
        a.workers = "2,8"
    load0 = loadavg()
    if a.sites:
        return _sites(a, load0)
    ws = [int(x) for x in a.workers.split(",")]
    variants = [Variant.parse(x) for x in a.pulls.split(",")]
    dense, dense_by_seed = {}, {}
    for w in ws:
        ddp = [run_ddp(a.workload, "ddp", world=w, steps=a.steps, max_seconds=a.max_seconds, seed=seed,
                       stop_at_target=True) for seed in a.seed_list]
        dense_by_seed[w] = [_steps(d) if d.get("ok") else None for d in ddp]
        dense[w] = _mean_steps(dense_by_seed[w])
        print(f"# W={w} DDP: {dense_by_seed[w]} steps", file=sys.stderr, flush=True)
    rows = []
    for w in ws:
        for v in variants:
            rows.append(stella(a.workload, w, v, a))
            print(f"# W={w} {v.spec}: {rows[-1]['steps_by_seed']} steps, {rows[-1]['train_wall_s']:.0f} s",
                  file=sys.stderr, flush=True)
    print(f"bench.scale: {a.workload}, update mode, {a.density} f16 pushes, at most {a.steps} steps, seeds "
          f"{a.seeds} (steps: their mean); loopback; load {load0} -> {loadavg()}")
    _table(a.workload, rows, dense)
    if a.plot:
        _plot(a.workload, rows, dense, a.plot)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "ddp_steps": dense, "ddp_steps_by_seed": dense_by_seed, "load": [load0, loadavg()],
                       "args": vars(a)}, f, indent=1)
    return 0


def _sites(a: argparse.Namespace, load0: str) -> int:
    s, r = (int(x) for x in a.sites.split("x"))
    bed, where = None, "loopback (no test bed)"
    try:
        from bench.wan import Link, WanTestbed

        bed = WanTestbed({"ps": Link(a.ps_rate, a.ps_rate), **{f"s{i}": Link(a.rate, a.rate) for i in range(s)}},
                         max_lifetime=6 * a.max_seconds).start()
        where = f"test bed: {s} sites at {a.rate:g} Mbit/s each way, the server at {a.ps_rate:g}"
    except Exception as e:  # no network namespaces here
        print(f"NOTE: no slow-link test bed ({e}); loopback", file=sys.stderr)
    sites = [f"s{i // r}" for i in range(s * r)] if bed is not None else None  # R ranks (or workers) per site
    try:
        v = Variant.parse("broadcast")
        hier = stella(a.workload, s * r, v, a, bed=bed, site_size=r, sites=sites)
        flat = stella(a.workload, s * r, v, a, bed=bed, site_size=1, sites=sites)
    finally:
        if bed is not None:
            bed.close()
    print(f"bench.scale --sites {a.sites}: {a.workload}, {where}; load {load0} -> {loadavg()}")
    print(f"{'layout':<26} {'workers (server)':>17} {'WAN B/site/round':>17} {'steps to target':>16}")
    for row, layout, members in ((hier, f"{s} sites x {r} ranks", s), (flat, f"{s * r} flat, {r} per site", s * r)):
        per_member = row["push_bytes_per_round"] + row["pull_bytes_per_round"]
        print(f"{layout:<26} {members:>17} {per_member * members // s:>17,} {_num(row['steps_to_target']):>16}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"hierarchical": hier, "flat": flat, "where": where, "load": [load0, loadavg()]}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
