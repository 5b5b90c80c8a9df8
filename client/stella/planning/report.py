"""What a plan says to a person: durations read and written, the ranked table, the
recommended ``stella-ps`` and ``StellaOptimizer`` settings, the JSON, the Pareto plot.

:func:`render` is what ``stella plan`` prints (:func:`stella.cli.main`); :func:`to_json`
what ``--json`` writes; :func:`pareto_plot` (matplotlib, imported on use) what ``--plot``
draws.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from .catalog import Catalog, PlanError
from .model import Prediction
from .profile_file import Profile
from .search import TOP_ROWS, PlanResult

__all__ = ["parse_duration", "table", "recommend", "render", "render_config", "describe_profile", "to_json",
           "prediction_json", "pareto_plot", "plural"]


def plural(n: int, word: str, many: str = "") -> str:
    """``1 configuration``, ``2 configurations``, ``1,680 configurations``."""
    return f"{n:,} {word if n == 1 else many or word + 's'}"


def parse_duration(text: str) -> float:
    """``12h``, ``90m``, ``3600s``, ``2d``, ``1h30m``; a bare number is hours. Seconds."""
    import re

    t = text.strip().lower()
    if not t:
        raise PlanError("empty duration")
    try:
        return float(t) * 3600.0
    except ValueError:
        pass
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([smhd])", t)
    if not parts or re.sub(r"(\d+(?:\.\d+)?)\s*([smhd])", "", t).strip():
        raise PlanError(f"cannot read the duration {text!r} (e.g. 12h, 90m, 1h30m, 2d)")
    unit = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
    return sum(float(n) * unit[u] for n, u in parts)


def _dur(s: float) -> str:
    if not math.isfinite(s):
        return "never"
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def _money(x: float, cur: str) -> str:
    return f"{x:,.0f} {cur}" if x >= 100 else f"{x:,.2f} {cur}"


def table(rows: Sequence[Prediction], currency: str) -> str:
    cols = ("#", "machines", "W", "GPUs", "density/coding/H", "shards", "s/it", "bound", "iters", "time", "cost",
            "revoc.")
    lines = []
    for n, p in enumerate(rows, 1):
        c = p.config
        gpus = sum(g.count * g.kind.gpus for g in c.groups)
        lines.append((str(n), c.machines, str(c.workers), str(gpus), f"{c.density:.2%}/{c.coding}/{c.sync_every}",
                      str(c.shards), f"{p.s_per_it:.3g}", p.bound,
                      f"{p.iterations:.0f}" + ("" if p.factor_measured else "*"), _dur(p.time_s),
                      _money(p.cost, currency), f"{100 * p.revocation_cost / p.cost:.0f}%" if p.cost > 0 else "-"))
    widths = [max(len(h), *(len(r[i]) for r in lines)) if lines else len(h) for i, h in enumerate(cols)]
    out = ["  ".join(h.ljust(wd) for h, wd in zip(cols, widths))]
    out += ["  ".join(v.ljust(wd) for v, wd in zip(r, widths)).rstrip() for r in lines]
    if any(not p.factor_measured for p in rows):
        out.append("* iterations factor not measured at that setting: a bound from the factors table, or assumed "
                   "(docs/plan.md section 1)")
    return "\n".join(out)


def _range(p: Prediction) -> str:
    if p.s_per_it_range is None or p.time_range is None:
        return ""
    (a, b), (t0, t1) = p.s_per_it_range, p.time_range
    return f" (with the profile's spread of the step: {a:.3g}-{b:.3g} s/it, {_dur(t0)} to {_dur(t1)})"


def _factor(p: Prediction) -> str:
    if not math.isfinite(p.factor):
        return p.factor_source
    flag = "" if p.factor_measured else "UNVERIFIED factor, "
    return f"x{p.factor:.2f} dense: {flag}{p.factor_source}"


def recommend(p: Prediction, checkpoint_every: int = 100) -> str:
    """The ``stella-ps`` and ``StellaOptimizer`` settings for one row."""
    c = p.config
    ck = f"--checkpoint-every-steps {checkpoint_every}"
    shard_line = (f"stella-ps --workers {c.workers} --checkpoint-dir DIR {ck}" if c.shards == 1 else
                  f"{c.shards} processes: stella-ps --shard I/{c.shards} --bind tcp://0.0.0.0:$((5555+I)) --workers "
                  f"{c.workers} --checkpoint-dir DIR/I {ck}  (I = 0..{c.shards - 1}; the workers get the "
                  "addresses comma-separated, in shard order)")
    max_h = max(c.sync_every, p.max_sync_every)
    spot = [g for g in c.groups if g.market == "spot"]
    lines = [
        f"recommended: {c.machines}  (W = {plural(c.workers, 'worker')}, one per machine; several GPUs in a "
        "machine combine inside it through torch.distributed)",
        f"  server:  {shard_line}",
        f"  workers: stella.StellaOptimizer(model, ADDRESS, optimizer=..., sync=stella.Sync(every={c.sync_every}, "
        f"max_every={max_h}),",
        f"               compression=stella.Compression(density={c.density:g}, value_dtype=\"{c.coding}\"))",
        f"  expected: {p.s_per_it:.3g} s/it ({p.bound}-bound), {p.iterations:.0f} iterations "
        f"({_factor(p)}), {_dur(p.time_s)}{_range(p)}",
    ]
    if spot:
        lines.append(f"  spot: ~{p.revocations:.1f} revocations expected; keep replacements starting "
                     "with the same command (a new worker joins any time and pulls a snapshot)")
    return "\n".join(lines)


def describe_profile(p: Profile) -> str:
    """The profile's compute as measured: its step, spread, thread count and age."""
    spread = p.compute_spread
    parts = [f"{p.compute_s:.3g} s/step at batch {p.batch_size}"]
    if spread is not None:
        parts.append(f"quartiles {spread[0]:.3g}-{spread[1]:.3g} s over {p.compute_steps} steps")
    else:
        parts.append("no spread measured (one figure)")
    if p.threads:
        parts.append(plural(p.threads, "torch thread") + ("" if p.threads == 1 else
                                                           " (workers run 1 unless they set more)"))
    else:
        parts.append("torch threads not recorded")
    if p.measured_at:
        parts.append(f"measured {p.measured_at}")
    return ", ".join(parts)


def _calibration(p: Profile) -> str:
    cal = p.calibration
    if cal.fitted:
        return f"model calibration: {cal.source}"
    return (f"model calibration: {cal.source}; fit one on your own runs with stella calibrate, drop --calibration "
            "none for the test bed's fit, or --calibration FILE for another fit (docs/plan.md)")


def _considered(res: PlanResult) -> str:
    cur = res.catalog.currency
    out = f"{plural(res.considered, 'configuration')} evaluated in {res.seconds:.2f} s"
    why = []
    if res.no_estimate:
        why.append(f"{res.no_estimate:,} beyond the factors table (no estimate of their iterations)")
    if res.unstable:
        why.append(f"{res.unstable:,} lost to revocations faster than they run")
    if res.over_deadline:
        why.append(f"{res.over_deadline:,} miss the deadline {_dur(res.deadline_s or 0)}")
    if res.over_budget:
        why.append(f"{res.over_budget:,} over the budget {_money(res.budget or 0, cur)}")
    rank = {"cost": "ranked by cost", "time": "ranked by time"}[res.objective]
    out += f": {res.feasible:,} {rank}"
    if res.deadline_s is None and res.budget is None:
        out += " (no deadline or budget given)"
    if why:
        out += "; not ranked: " + ", ".join(why)
    return out


def render(res: PlanResult) -> str:
    cur = res.catalog.currency
    p = res.profile
    head = [f"stella plan: {p.model} ({p.numel / 1e6:.3g}M parameters), catalog {res.catalog.path}",
            f"  profile: {describe_profile(p)}",
            f"  {_considered(res)}",
            f"  target: {p.dense_iterations:.0f} dense iterations at batch {p.target_batch} ({p.target_source})",
            f"  {_calibration(p)}"]
    if res.shard_cap[0]:
        head.append(f"  shards: at most {res.shard_cap[0]} ({res.shard_cap[1]})")
    if res.catalog.prices_note:
        head.append(f"  prices: {res.catalog.prices_note}")
    if not res.rows:
        return "\n".join([*head, "", "no configuration meets the constraints; the Pareto front of time against cost:",
                          table(res.pareto[:TOP_ROWS], cur)])
    return "\n".join([*head, "", table(res.rows, cur), "", recommend(res.rows[0]), "",
                      f"Pareto front (time against cost): {plural(len(res.pareto), 'configuration')}"])


def render_config(p: Prediction, profile: Profile, catalog: Catalog, cap: tuple[int, str] = (0, "")) -> str:
    """One configuration's prediction, term by term (``stella plan --config``)."""
    c = p.config
    cur = catalog.currency
    where = {"uplink": "the slowest machine's uplink", "downlink": "the slowest machine's downlink",
             "server": f"the server site's link, carrying all {c.workers}"}
    terms = [("compute", p.compute_s, f"{c.sync_every} step{'s' if c.sync_every != 1 else ''} of the slowest "
                                      "machine"),
             ("compress", p.compress_s, "the slowest machine's compressor and fixed CPU per round"),
             ("push", p.push_s, f"over {where[p.push_at]}"),
             ("server", p.server_s, f"the server's step over {plural(c.shards, 'shard')}"),
             ("pull", p.pull_s, f"the broadcast over {where[p.pull_at]}"),
             ("duplex", p.duplex_s, "taken off: the server link's pushes in and broadcast out overlap (full duplex)"),
             ("tail loss", p.tail_s, "a message overflowing a drop-tail queue in one flight"),
             ("rtt", p.rtt_s, "twice the largest round trip"),
             ("fixed", p.fixed_s, "the calibration's fixed overhead per round")]
    lines = [f"stella plan --config: {p.config.machines}, {c.density:.2%} {c.coding}, H = {c.sync_every}, "
             f"{plural(c.shards, 'shard')} (W = {c.workers}), catalog {catalog.path}",
             f"  profile: {profile.model}: {describe_profile(profile)}",
             f"  {_calibration(profile)}"]
    if cap[0] and c.shards > cap[0]:
        lines.append(f"  warning: {c.shards} shards is more than this catalog allows a plan ({cap[0]}: {cap[1]})")
    lines.append("")
    lines.append("  per round (seconds):")
    for name, v, what in terms:
        lines.append(f"    {name:<10} {v:8.4f}  {what}")
    lines += [f"    {'exchange':<10} {p.exchange_s:8.4f}  compress + push + server + pull - duplex + tail + rtt "
              "+ fixed, in the background (one round stale)",
              f"    {'overlap':<10} {p.overlap_s:8.4f}  compute + exchange - round: what running them side by side "
              "hides",
              f"    {'round':<10} {p.round_s:8.4f}  the expected max of compute and exchange "
              f"(jitter {profile.calibration.jitter:g})",
              "",
              f"  bound: {p.bound}" + (" (compute outlasts the exchange)" if p.bound == "compute" else
                                       f" (the exchange outlasts compute; {p.bound} is its largest term)"),
              f"  s/it: {p.s_per_it:.4g}" + (f"  (with the profile's spread of the step: {p.s_per_it_range[0]:.4g}-"
                                             f"{p.s_per_it_range[1]:.4g})" if p.s_per_it_range else ""),
              f"  iterations: {p.iterations:.0f} ({_factor(p)})" if math.isfinite(p.iterations) else
              f"  iterations: no estimate ({_factor(p)})"]
    if not math.isfinite(p.time_s):
        lines += ["  time to target, cost: no estimate (the iterations factor: see above; the s/it stands)"]
    else:
        lines += [f"  time to target: {_dur(p.time_s)}" + (f" ({_dur(p.time_range[0])} to {_dur(p.time_range[1])})"
                                                           if p.time_range else ""),
                  f"  cost: {_money(p.cost, cur)}" + (f", {p.revocations:.1f} revocations expected" if p.revocations
                                                      else "")]
    return "\n".join(lines)


def prediction_json(p: Prediction) -> dict[str, Any]:
    """One prediction as JSON: every field, the overlap, and the configuration by kind names."""
    d = dataclasses.asdict(p)
    d["overlap_s"] = p.overlap_s
    d["config"] = {"machines": [{"kind": g.kind.name, "market": g.market, "count": g.count}
                                for g in p.config.groups], "density": p.config.density,
                   "coding": p.config.coding, "sync_every": p.config.sync_every, "shards": p.config.shards}
    return d


def to_json(res: PlanResult) -> dict[str, Any]:
    row = prediction_json
    return {"objective": res.objective, "deadline_s": res.deadline_s, "budget": res.budget,
            "considered": res.considered, "feasible": res.feasible, "seconds": res.seconds,
            "not_ranked": {"no_estimate": res.no_estimate, "unstable": res.unstable,
                           "over_deadline": res.over_deadline, "over_budget": res.over_budget},
            "shard_cap": {"shards": res.shard_cap[0], "why": res.shard_cap[1]},
            "calibration": res.profile.calibration.source,
            "currency": res.catalog.currency, "rows": [row(p) for p in res.rows],
            "pareto": [row(p) for p in res.pareto]}


def pareto_plot(res: PlanResult, path: str, title: str = "") -> None:
    """Time against cost of the Pareto front (and the ranked rows) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    fr = res.pareto
    ax.step([p.time_s / 3600 for p in fr], [p.cost for p in fr], where="post", color="C0", marker="o", ms=3,
            label="Pareto front")
    if res.rows:
        ax.scatter([p.time_s / 3600 for p in res.rows], [p.cost for p in res.rows], color="C1", zorder=3,
                   label="ranked rows")
        b = res.rows[0]
        ax.annotate("recommended", (b.time_s / 3600, b.cost), textcoords="offset points", xytext=(8, 8))
    if res.deadline_s is not None:
        ax.axvline(res.deadline_s / 3600, color="grey", ls="--", label="deadline")
    if res.budget is not None:
        ax.axhline(res.budget, color="grey", ls=":", label="budget")
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter

    hours = FuncFormatter(lambda v, _: f"{v:g}")
    ax.xaxis.set_major_formatter(hours)
    ax.xaxis.set_minor_formatter(hours)
    ax.set_xlabel("time to target (h)")
    ax.set_ylabel(f"cost ({res.catalog.currency})")
    ax.set_title(title or f"{res.profile.model}: time against cost")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

