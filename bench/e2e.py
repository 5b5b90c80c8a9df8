"""End-to-end benchmark: every system, every workload, every link rate, in the
same run, over the slow-link test bed (2 workers, sites ``a``/``b`` shaped to
the link rate in both directions; site ``ps`` for a parameter server).

  python -m bench.e2e --quick                       # < 10 min
  python -m bench.e2e                               # full (long)
  python -m bench.e2e --workload widemlp --rate 100 --system ddp --system powersgd --json out.json

Writes a table to stdout, ``--json PATH``, its block of ``bench/RESULTS.md`` (table,
machine, command: between its marker lines, the rest of the file kept; ``--results-md ''``:
none) and ``bench/e2e_heldout.png`` (held-out metric against training wall time, one
panel per workload x rate; ``--plot ''``: none).

Systems are pluggable (see :data:`SYSTEMS` and :func:`register_system`): the DDP
baselines (``bench.baselines``) and Stella (``bench.stella_e2e``) are registered
below. A system is a callable ``runner(spec: RunSpec, bed: WanTestbed) -> dict``
returning the keys of ``bench.harness.summarize``; see :class:`RunSpec` and
``docs/testbed.md`` ("Plugging a system into bench.e2e") for the contract.

``RESULTS.md`` holds measurements only (tables, machine, command); what they mean
is written in ``docs/results-notes.md``, by a person, against a named run.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from bench import baselines, stella_e2e
from bench import workloads as W
from bench.harness import REPO
from bench.wan import Link, WanTestbed


@dataclass
class RunSpec:
    """Everything a system needs to run one (workload, link rate) cell.

    Same for every system in a run: workload (model, data, seed, per-worker
    batch, LR schedule -- all in ``bench.workloads.get(workload)``), number of
    workers, step cap and the wall-time cap, which the runner must enforce
    (the harness additionally kills nothing itself: a runner that overruns
    ``max_seconds`` by more than its own slack is a bug).
    """

    workload: str
    rate_mbit: float
    world: int = 2
    worker_sites: list[str] = field(default_factory=lambda: ["a", "b"])
    ps_site: str = "ps"
    max_steps: int = 100
    max_seconds: float = 300.0
    seed: int = 0
    eval_every: int | None = None
    stop_at_target: bool = False
    log_dir: str = ""
    calib: int = 3              # no-communication backward passes to calibrate "compute" (baselines)


Runner = Callable[[RunSpec, WanTestbed], dict]
SYSTEMS: dict[str, Runner] = {}


def register_system(name: str, runner: Runner):
    """Add a system to the benchmark (idempotent by name)."""
    SYSTEMS[name] = runner


def _ddp_runner(system: str) -> Runner:
    def run(spec: RunSpec, bed: WanTestbed) -> dict:
        return baselines.run_ddp(spec.workload, system, world=spec.world, steps=spec.max_steps,
                                 max_seconds=spec.max_seconds, bed=bed, sites=spec.worker_sites[:spec.world],
                                 seed=spec.seed, eval_every=spec.eval_every, stop_at_target=spec.stop_at_target,
                                 log_dir=spec.log_dir or None, calib=spec.calib)
    run.__name__ = f"run_{system}"
    return run


register_system("ddp", _ddp_runner("ddp"))
register_system("powersgd", _ddp_runner("powersgd"))
register_system("fp16", _ddp_runner("fp16"))

for _name, _kw in stella_e2e.SYSTEMS.items():
    register_system(_name, stella_e2e.system(_name, **_kw))

GOAL_BASELINES = ("ddp", "powersgd", "fp16")
REQUIRED_KEYS = ("ok", "steps", "iter_median", "evals", "final_metric", "reached")

QUICK = {  # per workload: steps, max seconds per system, eval every
    "digits": dict(max_steps=40, max_seconds=20, eval_every=10),
    "widemlp": dict(max_steps=12, max_seconds=30, eval_every=4),
    "bytelm": dict(max_steps=4, max_seconds=25, eval_every=4),
}
FULL = {
    "digits": dict(max_steps=300, max_seconds=120, eval_every=10),
    "widemlp": dict(max_steps=300, max_seconds=600, eval_every=5),  # room for systems that need more steps
    "bytelm": dict(max_steps=200, max_seconds=1800, eval_every=10),
}


def run_cell(system: str, spec: RunSpec, bed: WanTestbed) -> dict:
    before = {s: bed.counters(s) for s in [*spec.worker_sites[:spec.world], spec.ps_site]}
    t0 = time.monotonic()
    try:
        res = SYSTEMS[system](spec, bed)
    except Exception:
        res = {"ok": False, "error": traceback.format_exc()}
    res.setdefault("system", system)
    res.setdefault("workload", spec.workload)
    res["rate_mbit"] = spec.rate_mbit
    res["elapsed"] = time.monotonic() - t0
    after = {s: bed.counters(s) for s in before}
    # harness-side byte count over the whole run (includes start-up: model
    # broadcast / initial pull), per worker per step -- same method for all systems
    steps = max(1, res.get("steps") or 1)
    ws = spec.worker_sites[:spec.world]
    res["harness_bytes"] = {
        "worker_up_per_step": statistics.mean((after[s]["tx_bytes"] - before[s]["tx_bytes"]) / steps for s in ws),
        "worker_down_per_step": statistics.mean((after[s]["rx_bytes"] - before[s]["rx_bytes"]) / steps for s in ws),
        "ps_up_total": after[spec.ps_site]["tx_bytes"] - before[spec.ps_site]["tx_bytes"],
        "ps_down_total": after[spec.ps_site]["rx_bytes"] - before[spec.ps_site]["rx_bytes"],
    }
    if res.get("ok"):
        missing = [k for k in REQUIRED_KEYS if k not in res]
        if missing:
            res["ok"] = False
            res["error"] = f"runner result lacks {missing}"
    return res


def _mb(v):
    return "n/a" if v is None else f"{v / 1e6:.2f}"


def table(results: list[dict]) -> str:
    hdr = ("| workload | Mbit/s | system | s/it median | compute (s) | net wait* | MB/it up | MB/it down | "
           "steps | to target (it / s) | final metric |")
    lines = [hdr, "|" + "---|" * 11]
    for r in results:
        if not r.get("ok"):
            lines.append(f"| {r['workload']} | {r['rate_mbit']:g} | {r['system']} | FAILED | | | | | | | "
                         f"{str(r.get('error', '')).strip().splitlines()[-1][:80] if r.get('error') else ''} |")
            continue
        up = r.get("bytes_up_median")
        down = r.get("bytes_down_median")
        if up is None:
            up, down = r["harness_bytes"]["worker_up_per_step"], r["harness_bytes"]["worker_down_per_step"]
        reach = r.get("reached")
        nw = r.get("net_wait_fraction")
        cm = r.get("compute_median")
        lines.append(
            f"| {r['workload']} | {r['rate_mbit']:g} | {r['system']} | {r['iter_median']:.3f} | "
            f"{'n/a' if cm is None else f'{cm:.3f}'} | {'n/a' if nw is None else f'{100 * nw:.0f}%'} | "
            f"{_mb(up)} | {_mb(down)} | {r['steps']} | "
            f"{'not reached' if not reach else '{} / {:.1f}'.format(reach['step'], reach['wall'])} | "
            f"{r.get('metric', '')} {r['final_metric']:.4f} |")
    return "\n".join(lines)


def machine() -> str:
    import torch

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = float("nan")
    return (f"{platform.node()}: {cpu}, {os.cpu_count()} logical CPUs, {mem:.0f} GiB RAM, "
            f"Linux {platform.release()}, Python {platform.python_version()}, torch {torch.__version__}; "
            f"links: tbf in network namespaces (bench.wan), 1 torch thread per worker")


def plot(results: list[dict], path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({(r["workload"], r["rate_mbit"]) for r in results})
    if not cells:
        return
    n = len(cells)
    cols = min(n, 2)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.8 * rows), squeeze=False)
    for ax, (wl, rate) in zip(axes.flat, cells):
        for r in results:
            if (r["workload"], r["rate_mbit"]) != (wl, rate) or not r.get("ok") or not r.get("evals"):
                continue
            ax.plot([e["wall"] for e in r["evals"]], [e["metric"] for e in r["evals"]], marker="o", ms=3,
                    label=r["system"])
        w = W.get(wl)
        ax.axhline(w.target, color="grey", ls="--", lw=0.8, label="target")
        ax.set_title(f"{wl} @ {rate:g} Mbit/s per site")
        ax.set_xlabel("training wall time (s)")
        ax.set_ylabel(w.metric)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bytes_per_iter(r: dict) -> float | None:
    """Bytes through a worker site's link per training iteration, both directions: each
    rank's total over its iterations (kernel counters; start-up and evaluation excluded)
    over its iteration count, mean over ranks. A mean, not the table's median, which
    reads 0 for a system that exchanges every H > 1 iterations."""
    per_rank, steps = r.get("per_rank_bytes"), r.get("steps")
    if per_rank and steps:
        return sum(b["up_total"] + b["down_total"] for b in per_rank) / len(per_rank) / steps
    up, down = r.get("bytes_up_median"), r.get("bytes_down_median")
    return None if up is None or down is None else up + down


def goal_ratios(results: list[dict]) -> list[dict]:
    """Stella against the issue's goals, one dict per Stella row (sorted by workload, rate,
    system): ``iter_over_compute`` (Stella's s/it over its compute), ``speedup`` per
    baseline (the baseline's time to target over Stella's; ``None`` unless both reached),
    ``iterations_vs_ddp`` (Stella's iterations to target over DDP's, or ``None``),
    ``bytes_vs_ddp`` (Stella's bytes per iteration per worker, both directions, over
    DDP's) and ``ideal`` (DDP's s/it over its compute-only s/it: the most any system can
    gain over DDP on this machine; ``of_ideal`` = DDP/Stella time to target over it)."""
    rows = {(r.get("workload"), r.get("rate_mbit"), r.get("system")): r for r in results if r.get("ok")}
    out = []
    for (wl, rate, system), st in sorted(rows.items(), key=lambda kv: (str(kv[0][0]), kv[0][1] or 0, kv[0][2])):
        if not str(system).startswith("stella"):
            continue
        comp = st.get("compute_median")
        speedup = {}
        for base in GOAL_BASELINES:
            b = rows.get((wl, rate, base))
            speedup[base] = (b["reached"]["wall"] / st["reached"]["wall"]
                             if b and b.get("reached") and st.get("reached") else None)
        d = rows.get((wl, rate, "ddp"))
        sb, db = _bytes_per_iter(st), (_bytes_per_iter(d) if d else None)
        ideal = d["iter_median"] / d["compute_median"] if d and d.get("compute_median") else None
        out.append({"workload": wl, "rate_mbit": rate, "system": system,
                    "iter_over_compute": st["iter_median"] / comp if comp else None, "speedup": speedup,
                    "stella_reached": bool(st.get("reached")),
                    "iterations_vs_ddp": (st["reached"]["step"] / d["reached"]["step"]
                                          if d and d.get("reached") and st.get("reached") else None),
                    "bytes_vs_ddp": sb / db if sb is not None and db else None,
                    "ideal": ideal,
                    "of_ideal": speedup["ddp"] / ideal if ideal and speedup["ddp"] is not None else None})
    return out


def goals_section(results: list[dict]) -> str:
    """:func:`goal_ratios` as a markdown table."""
    out = ["| workload | Mbit/s | system | Stella s/it / its compute | time to target: DDP / Stella | "
           "PowerSGD / Stella | fp16 / Stella | iterations: Stella / DDP | bytes/it: Stella / DDP | "
           "ideal DDP / Stella (DDP s/it / compute) | measured / ideal |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for g in goal_ratios(results):
        ioc = g["iter_over_compute"]
        cells = [f"{ioc:.2f}x" if ioc is not None else "n/a"]
        for base, x in g["speedup"].items():
            cells.append(f"{x:.1f}x" if x is not None else
                         "n/a (" + ("Stella" if not g["stella_reached"] else base) + " did not reach)")
        it = g["iterations_vs_ddp"]
        cells.append(f"{it:.2f}x" if it is not None else "n/a")
        b = g["bytes_vs_ddp"]
        cells.append(f"1/{1 / b:.0f}" if b else "n/a")
        cells.append(f"{g['ideal']:.1f}x" if g["ideal"] else "n/a")
        cells.append(f"{g['of_ideal']:.2f}" if g["of_ideal"] is not None else "n/a")
        out.append(f"| {g['workload']} | {g['rate_mbit']:g} | {g['system']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


# bench.e2e's block of RESULTS.md lies between these lines; everything else in the file is other runs' and is kept
BLOCK_BEGIN = "<!-- bench.e2e's block: written by python -m bench.e2e from here to its end line -->"
BLOCK_END = "<!-- end of bench.e2e's block -->"


def write_results_md(results: list[dict], path: str, command: str, png: str, links: dict, started: str,
                     loads: str = ""):
    """The run's block of ``path`` (RESULTS.md): written between :data:`BLOCK_BEGIN` and
    :data:`BLOCK_END` in place of the previous run's, the rest of the file kept (the other
    benchmarks' sections); a file without the block gets it at its top."""
    f = io.StringIO()
    _write_block(f, results, command, png, links, started, loads)
    block = f"{BLOCK_BEGIN}\n{f.getvalue()}{BLOCK_END}\n"
    try:
        with open(path) as old:
            text = old.read()
    except FileNotFoundError:
        text = ""
    if BLOCK_BEGIN in text and BLOCK_END in text.split(BLOCK_BEGIN, 1)[1]:
        before, rest = text.split(BLOCK_BEGIN, 1)
        after = rest.split(BLOCK_END, 1)[1].lstrip("\n")
        text = before + block + ("\n" + after if after else "")
    else:
        text = block + ("\n" + text if text else "")
    with open(path, "w") as out:
        out.write(text)


def _write_block(f: io.StringIO, results: list[dict], command: str, png: str, links: dict, started: str,
                 loads: str) -> None:
    f.write("# End-to-end results (bench.e2e)\n\n")
    f.write(f"Command: `{command}`  \nStarted: {started} UTC  \nMachine: {machine()}  \n"
            f"CPU contention: {loads} (the 2 cores are shared with other jobs: compute times are inflated "
            f"accordingly)\n\n")
    f.write("Per cell: 2 workers in sites `a`, `b` (uplink = downlink = the rate), `ps` site at "
            f"{links['ps']} Mbit/s. Delivered TCP goodput on these links is ~95.6% of the tbf rate "
            "(header overhead; see docs/testbed.md).\n\n")
    f.write("Columns: median time per iteration after 2 warm-up iterations (rank 0); compute = forward + "
            "backward (no-communication calibration) + optimizer; net wait = share of iteration time not "
            "explained by compute (*for fp16/PowerSGD this includes the hooks' compression work); "
            "MB/it = bytes through each worker site's veth per iteration (kernel "
            "counters, median over iterations, mean over workers); to target = first evaluation at or past "
            "the workload's target (iterations / training wall seconds, evaluation time excluded).\n\n")
    f.write(table(results) + "\n\n")
    tg = {n: f"{w.metric} {'>=' if w.higher_is_better else '<='} {w.target}" for n, w in W.WORKLOADS.items()}
    f.write("Targets: " + "; ".join(f"{k}: {v}" for k, v in tg.items()) + "\n\n")
    f.write("Stella against the goals (ratios from the table above):\n\n" + goals_section(results) + "\n\n")
    f.write("What these numbers mean, and how they carry over to GPU workers: docs/results-notes.md.\n\n")
    if png:
        f.write(f"![held-out metric vs wall time]({os.path.basename(png)})\n")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.e2e", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="reduced run (< 10 minutes)")
    ap.add_argument("--workload", action="append", choices=sorted(W.WORKLOADS))
    ap.add_argument("--rate", action="append", type=float, help="Mbit/s per site (default 100 and 500)")
    ap.add_argument("--system", action="append", help="default: all registered")
    ap.add_argument("--ps-rate", type=float, default=1000.0)
    ap.add_argument("--steps", type=int, help="override the per-workload step cap")
    ap.add_argument("--max-seconds", type=float, help="override the per-system training wall cap")
    ap.add_argument("--stop-at-target", action="store_true")
    ap.add_argument("--eval-every", type=int, metavar="N",
                    help="evaluate every N steps (default: the workload's, 5-10): the resolution of the iterations "
                         "to the target")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    ap.add_argument("--from-json", help="re-render table / RESULTS.md / plot from a saved --json file, run nothing")
    ap.add_argument("--results-md", default=os.path.join(REPO, "bench", "RESULTS.md"))
    ap.add_argument("--plot", default=os.path.join(REPO, "bench", "e2e_heldout.png"))
    a = ap.parse_args(argv)
    command = "python -m bench.e2e " + " ".join(sys.argv[1:] if argv is None else argv)
    if a.from_json:
        with open(a.from_json) as f:
            saved = json.load(f)
        saved_results = saved["results"]
        print(table(saved_results))
        if a.plot:
            plot(saved_results, a.plot)
        if a.results_md:
            write_results_md(saved_results, a.results_md, saved["command"], a.plot,
                             {"ps": saved.get("ps_rate", a.ps_rate)}, saved.get("started", "?"), saved.get("loads", ""))
        return 0
    started = datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M")
    load_start = os.getloadavg()
    systems = a.system or list(SYSTEMS)
    for s in systems:
        if s not in SYSTEMS:
            ap.error(f"unknown system {s!r}; registered: {sorted(SYSTEMS)}")
    wls = a.workload or ["digits", "widemlp", "bytelm"]
    rates = a.rate or [100.0, 500.0]
    caps = QUICK if a.quick else FULL
    log_root = tempfile.mkdtemp(prefix="e2e-")
    results: list[dict] = []
    per_sys_budget = max((a.max_seconds or caps[w]["max_seconds"]) + 150 for w in wls)
    print(f"# systems {systems}; workloads {wls}; rates {rates} Mbit/s; logs {log_root}", flush=True)
    for wl in wls:
        for rate in rates:
            link = Link(rate, rate)
            sites = {"ps": Link(a.ps_rate, a.ps_rate), "a": link, "b": link}
            with WanTestbed(sites, max_lifetime=len(systems) * per_sys_budget + 60) as bed:
                for system in systems:
                    c = caps[wl]
                    spec = RunSpec(workload=wl, rate_mbit=rate, max_steps=a.steps or c["max_steps"],
                                   max_seconds=a.max_seconds or c["max_seconds"], seed=a.seed,
                                   eval_every=a.eval_every or c["eval_every"], stop_at_target=a.stop_at_target,
                                   log_dir=log_root, calib=1 if a.quick else 3)
                    r = run_cell(system, spec, bed)
                    results.append(r)
                    if r.get("ok"):
                        print(f"{wl:>8} {rate:5g} Mbit/s {system:>10}: {r['steps']} steps, "
                              f"iter {r['iter_median']:.3f}s, final {r['final_metric']:.4f} "
                              f"({r['elapsed']:.0f}s)", flush=True)
                    else:
                        print(f"{wl:>8} {rate:5g} Mbit/s {system:>10}: FAILED\n{r.get('error')}", flush=True)
    print()
    print(table(results))
    le = os.getloadavg()
    loads = (f"load average (1/5/15 min) at start {load_start[0]:.1f}/{load_start[1]:.1f}/{load_start[2]:.1f}, "
             f"at end {le[0]:.1f}/{le[1]:.1f}/{le[2]:.1f}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"command": command, "machine": machine(), "started": started, "loads": loads,
                       "ps_rate": a.ps_rate, "results": results}, f, indent=1)
    if a.plot:
        plot(results, a.plot)
    if a.results_md:
        write_results_md(results, a.results_md, command, a.plot, {"ps": a.ps_rate}, started, loads)
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
