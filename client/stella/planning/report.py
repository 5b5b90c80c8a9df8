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

from .catalog import PlanError
from .model import Prediction
from .search import TOP_ROWS, PlanResult

__all__ = ["parse_duration", "table", "recommend", "render", "to_json", "pareto_plot"]


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
                      str(c.shards), f"{p.s_per_it:.3g}", p.bound, f"{p.iterations:.0f}", _dur(p.time_s),
                      _money(p.cost, currency), f"{100 * p.revocation_cost / p.cost:.0f}%" if p.cost > 0 else "-"))
    widths = [max(len(h), *(len(r[i]) for r in lines)) if lines else len(h) for i, h in enumerate(cols)]
    out = ["  ".join(h.ljust(wd) for h, wd in zip(cols, widths))]
    out += ["  ".join(v.ljust(wd) for v, wd in zip(r, widths)).rstrip() for r in lines]
    return "\n".join(out)


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
        f"recommended: {c.machines}  (W = {c.workers} workers, one per machine; several GPUs in a machine combine "
        "inside it through torch.distributed)",
        f"  server:  {shard_line}",
        f"  workers: stella.StellaOptimizer(model, ADDRESS, optimizer=..., sync=stella.Sync(every={c.sync_every}, "
        f"max_every={max_h}),",
        f"               compression=stella.Compression(density={c.density:g}, value_dtype=\"{c.coding}\"))",
        f"  expected: {p.s_per_it:.3g} s/it ({p.bound}-bound), {p.iterations:.0f} iterations "
        f"(x{p.factor:.2f} dense: {p.factor_source}), {_dur(p.time_s)}",
    ]
    if spot:
        lines.append(f"  spot: ~{p.revocations:.1f} revocations expected; keep replacements starting "
                     "with the same command (a new worker joins any time and pulls a snapshot)")
    return "\n".join(lines)


def render(res: PlanResult) -> str:
    cur = res.catalog.currency
    cons = []
    if res.deadline_s is not None:
        cons.append(f"deadline {_dur(res.deadline_s)}")
    if res.budget is not None:
        cons.append(f"budget {_money(res.budget, cur)}")
    p = res.profile
    head = [f"stella plan: {p.model} ({p.numel / 1e6:.3g}M parameters, {p.compute_s:.3g} s/step at batch "
            f"{p.batch_size} on the profiled machine), catalog {res.catalog.path}",
            f"  {res.considered:,} configurations considered in {res.seconds:.2f} s, {res.feasible:,} within "
            f"{' and '.join(cons) if cons else 'no constraint'}; ranked by {res.objective}",
            f"  target: {p.dense_iterations:.0f} dense iterations at batch {p.target_batch} ({p.target_source}); "
            f"model calibration: {p.calibration.source}"]
    if res.catalog.prices_note:
        head.append(f"  prices: {res.catalog.prices_note}")
    if not res.rows:
        return "\n".join([*head, "", "no configuration meets the constraints; the Pareto front of time against cost:",
                          table(res.pareto[:TOP_ROWS], cur)])
    return "\n".join([*head, "", table(res.rows, cur), "", recommend(res.rows[0]), "",
                      f"Pareto front (time against cost): {len(res.pareto)} configurations"])


def to_json(res: PlanResult) -> dict[str, Any]:
    def row(p: Prediction) -> dict[str, Any]:
        d = dataclasses.asdict(p)
        d["config"] = {"machines": [{"kind": g.kind.name, "market": g.market, "count": g.count}
                                    for g in p.config.groups], "density": p.config.density,
                       "coding": p.config.coding, "sync_every": p.config.sync_every, "shards": p.config.shards}
        return d

    return {"objective": res.objective, "deadline_s": res.deadline_s, "budget": res.budget,
            "considered": res.considered, "feasible": res.feasible, "seconds": res.seconds,
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

