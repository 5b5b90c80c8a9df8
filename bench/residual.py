"""The broadcast's selection over the flat residual: the index (``stella_ps.residual.
FlatResidual``: add, then select) beside today's streaming pass (``stella_ps.topk.
Selector.take`` with the step's change as its adds: what ``stella_ps.broadcast`` runs
every step once the touched coordinates pass 1/64 of a tensor), on the same steps.

Each step touches a random set of ``touched`` x numel coordinates (each coordinate with
that probability, sorted) with standard normal changes, and selects ``k`` x numel. Both
systems get the same steps, one after the other, for 10 warm-up steps then ``--steps``
timed ones. Reported per system: the median ms a step (the index: add and select apart;
the thread's CPU time, which other work on a shared machine does not inflate, or wall
time with ``--clock wall``), ns per touched coordinate and per selected one; for the
index also its full passes after warm-up, its bytes per coordinate (``R`` included) and
the share of coordinates it tracks. Then the larger model's over the smaller's (100M over
10M; 10M over 1M with --quick): a step at the same touched count and k (the larger model
touched at a tenth of the densities: the claim that a step costs what was pushed, not
the model's size; goal <= 1.2x), and per touched coordinate at the same densities.

With ``--error F`` each step also adds F x the values sent back at the sent coordinates
(a coding's error, as the broadcast does), so that the residual keeps what was not sent
(at 2% touched and k = 2% it is otherwise nearly emptied every step).

    python -m bench.residual [--quick] [--steps 30] [--clock cpu|wall] [--error F] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator

import numpy as np

from bench.harness import loadavg
from stella_ps.residual import FlatResidual
from stella_ps.topk import Selector

TOUCHED = (0.02, 0.08, 0.32)
KS = (0.02, 0.005)
WARMUP = 10


def _steps(numel: int, touched: float, steps: int, seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Random sorted touched sets (each coordinate with probability ``touched``: geometric
    gaps, O(touched) to draw) and their standard normal changes."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        want = int(numel * touched * 1.02 + 6 * (numel * touched) ** 0.5 + 64)
        idx = np.cumsum(rng.geometric(touched, want)) - 1
        while idx[-1] < numel:  # (never in practice: the draw holds 6 sigmas more than the mean)
            idx = np.concatenate([idx, idx[-1] + np.cumsum(rng.geometric(touched, want))])
        idx = idx[:np.searchsorted(idx, numel)].astype(np.int32)
        yield idx, rng.standard_normal(idx.size, dtype=np.float32)


def run(numel: int, touched: float, ks: tuple[float, ...], steps: int, seed: int = 0, clock: str = "cpu",
        error: float = 0.0) -> list[dict]:
    """One row per k: both systems on the same steps (all the ks share the steps).
    ``clock``: ``cpu`` (the thread's CPU time: what a step costs, whatever else runs on the
    machine) or ``wall``. ``error``: after each selection, ``error`` x the values sent go
    back at the sent coordinates (a coding's error, as the broadcast adds it: the index
    adds it with the next step's change, ``add_lists``; the pass as one more list of its
    adds), so the residual keeps what was not sent."""
    now = time.thread_time if clock == "cpu" else time.perf_counter
    sizes = [max(1, round(k * numel)) for k in ks]
    index = [FlatResidual(numel, numel) for _ in ks]
    passes = [(np.zeros(numel, np.float32), Selector(seed=0x5EED)) for _ in ks]
    t_add: list[list[float]] = [[] for _ in ks]
    t_sel: list[list[float]] = [[] for _ in ks]
    t_pass: list[list[float]] = [[] for _ in ks]
    counts: list[int] = []
    warm = [0] * len(ks)
    empty = (np.zeros(0, np.int32), np.zeros(0, np.float32))
    owed = [[empty, empty] for _ in ks]  # the error each system owes its residual: index, pass
    for s, (idx, ch) in enumerate(_steps(numel, touched, WARMUP + steps, seed)):
        if s == WARMUP:
            warm = [fr.full_passes for fr in index]
        for j, k in enumerate(sizes):
            fr = index[j]
            t0 = now()
            if error:
                fr.add_lists([owed[j][0], (idx, ch)])
            else:
                fr.add(idx, ch)
            t1 = now()
            sent = fr.select(k)
            t2 = now()
            r, selector = passes[j]
            sent_pass = selector.take(r, k, adds=[owed[j][1], (idx, ch)] if error else [(idx, ch)])
            t3 = now()
            if error:
                owed[j] = [(i, (v * np.float32(error)).astype(np.float32)) for i, v in (sent, sent_pass)]
            if s >= WARMUP:
                t_add[j].append(t1 - t0)
                t_sel[j].append(t2 - t1)
                t_pass[j].append(t3 - t2)
        if s >= WARMUP:
            counts.append(idx.size)
    n_touched = float(np.mean(counts))
    rows = []
    for j, (kf, k) in enumerate(zip(ks, sizes)):
        add, sel, pas = (float(np.median(t)) for t in (t_add[j], t_sel[j], t_pass[j]))
        step = float(np.median(np.add(t_add[j], t_sel[j])))
        fr = index[j]
        rows.append({
            "numel": numel, "touched": touched, "k_share": kf, "touched_count": round(n_touched), "k": k,
            "steps": steps, "clock": clock, "error": error,
            "index_add_ms": round(1e3 * add, 3), "index_select_ms": round(1e3 * sel, 3),
            "index_step_ms": round(1e3 * step, 3), "index_ns_per_touched": round(1e9 * add / n_touched, 2),
            "index_ns_per_selected": round(1e9 * sel / k, 2),
            "index_ns_per_touched_step": round(1e9 * step / n_touched, 2),
            "index_full_passes": fr.full_passes - warm[j], "index_full_passes_warmup": warm[j],
            "index_bytes_per_coord": round(fr.bytes / numel, 2), "index_tracked_share": round(fr.tracked / numel, 4),
            "pass_step_ms": round(1e3 * pas, 3), "pass_ns_per_touched": round(1e9 * pas / n_touched, 2),
            "pass_over_index": round(pas / step, 2),
        })
    return rows


def _table(rows: list[dict]) -> None:
    print(f"{'numel':>11} {'touched':>7} {'k':>6} | {'add ms':>8} {'sel ms':>7} {'step ms':>8} {'ns/touch':>8} "
          f"{'ns/sel':>7} {'passes':>6} {'B/coord':>7} {'tracked':>7} | {'pass ms':>8} {'ns/touch':>8} | "
          f"{'pass/index':>10}")
    for r in rows:
        print(f"{r['numel']:>11,} {r['touched']:>7.2%} {r['k_share']:>6.2%} | {r['index_add_ms']:>8.2f} "
              f"{r['index_select_ms']:>7.2f} {r['index_step_ms']:>8.2f} {r['index_ns_per_touched_step']:>8.2f} "
              f"{r['index_ns_per_selected']:>7.2f} {r['index_full_passes']:>6} {r['index_bytes_per_coord']:>7.2f} "
              f"{r['index_tracked_share']:>7.1%} | {r['pass_step_ms']:>8.2f} {r['pass_ns_per_touched']:>8.2f} | "
              f"{r['pass_over_index']:>10.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.residual", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1M and 10M coordinates (else 10M and 100M)")
    p.add_argument("--steps", type=int, default=30, help="timed steps after the 10 warm-up steps")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="cpu: the thread's CPU time (default: robust to other work on a shared machine); wall")
    p.add_argument("--error", type=float, default=0.0, metavar="F",
                   help="add F x the values sent back at the sent coordinates after each step (a coding's error; "
                        "default 0: what is sent leaves the residual)")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    small, large = (1_000_000, 10_000_000) if a.quick else (10_000_000, 100_000_000)
    scale = large // small
    load_start = loadavg()
    print(f"bench.residual: index (FlatResidual add + select) against the streaming pass (Selector.take with "
          f"adds), {WARMUP} warm-up + {a.steps} timed steps, medians of {a.clock} time, coding error {a.error:g} "
          f"(load at start: {load_start})",
          flush=True)
    rows = []
    for numel in (small, large):
        for touched in TOUCHED:
            rows += run(numel, touched, KS, a.steps, clock=a.clock, error=a.error)
    # the larger model with the smaller one's touched counts and k: a tenth (or 1/scale) of the densities
    same = []
    for touched in TOUCHED:
        same += run(large, touched / scale, tuple(k / scale for k in KS), a.steps, clock=a.clock,
                    error=a.error)
    load_end = loadavg()
    print("\nsame densities:")
    _table(rows)
    print(f"\n{large:,} coordinates with the touched counts and k of {small:,}:")
    _table(same)
    ratios = []
    for r_small in (r for r in rows if r["numel"] == small):
        key = (r_small["touched"], r_small["k_share"])
        r_large = next(r for r in rows if r["numel"] == large and (r["touched"], r["k_share"]) == key)
        r_same = next(r for r in same if abs(r["touched"] * scale - key[0]) < 1e-12
                      and abs(r["k_share"] * scale - key[1]) < 1e-12)
        ratios.append({
            "touched": key[0], "k_share": key[1],
            "index_same_counts": round(r_same["index_step_ms"] / r_small["index_step_ms"], 2),
            "pass_same_counts": round(r_same["pass_step_ms"] / r_small["pass_step_ms"], 2),
            "index_same_densities_per_touched": round(r_large["index_ns_per_touched_step"]
                                                      / r_small["index_ns_per_touched_step"], 2),
            "pass_same_densities_per_touched": round(r_large["pass_ns_per_touched"]
                                                     / r_small["pass_ns_per_touched"], 2),
        })
    print(f"\n{large:,} / {small:,}: per step at the same touched count and k (goal <= 1.2x for the index), and per "
          "touched coordinate at the same densities")
    print(f"{'touched':>7} {'k':>6} | {'index, same counts':>18} {'pass, same counts':>17} | "
          f"{'index, per touched':>18} {'pass, per touched':>17}")
    for q in ratios:
        print(f"{q['touched']:>7.2%} {q['k_share']:>6.2%} | {q['index_same_counts']:>17.2f}x "
              f"{q['pass_same_counts']:>16.2f}x | {q['index_same_densities_per_touched']:>17.2f}x "
              f"{q['pass_same_densities_per_touched']:>16.2f}x")
    print(f"\nload at start: {load_start}; at end: {load_end}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"load_at_start": load_start, "load_at_end": load_end, "warmup": WARMUP, "clock": a.clock,
                       "error": a.error, "rows": rows, "same_counts": same, "ratios": ratios}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
