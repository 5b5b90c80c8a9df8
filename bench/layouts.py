"""The memory a server step touches per pushed coordinate, with the broadcast's residual
``R`` and model ``B`` beside the optimizer's record (today) or inside it (issue 44's design
change, "R and B in the kernel's record"): a probe of the floor each layout sets, before
any of the server is rewritten for it.

Today a coordinate's AdamW state is one 16-byte record ``{p, m, v, step}`` (one cache line
a random update), and the broadcast keeps ``R`` and ``B`` as two float32 arrays of their
own: a step's apply updates the record and then adds the change to ``R`` (a second line),
and its selection reads and zeroes ``R`` and adds to ``B`` at the coordinates it sends (two
more). Fused, one 32-byte record ``{p, m, v, step, R, B, -, -}`` holds all of it: one line
a coordinate for the apply, and the same line for the selection.

``stella_probe_layout`` (native/bench/probe.c, the bench-only build) runs each phase in C
over sorted coordinates, every line prefetched ahead, with AdamW's arithmetic: phase 0 the
apply at the touched coordinates (the record updated, its change added to ``R``), phase 1
the selection at the sent ones (``R`` read and zeroed, ``B`` gains it). The sent are a
random share of the touched (``--sent``, default 1 and 0.25: two workers' pushes with the
broadcast's factor of 2 send about every touched coordinate; eight send a quarter). Each
step draws new sets (each coordinate touched with the given probability, as
bench.residual's steps) and runs both layouts on them, alternating which goes first, after
10 warm-up steps. Reported: the median of each phase's thread CPU time in ns per touched
coordinate, the random read-modify-write floor of one float a line at the same coordinates
(``stella_probe_random_rmw``, bench.kernel's roofline), and today's over fused.

    python -m bench.layouts [--quick] [--steps 20] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from bench._native_bench import probe_layout, probe_random_rmw
from bench.harness import loadavg
from bench.residual import _steps

WARMUP = 10
CASES = ((10_000_000, 0.02), (10_000_000, 0.002), (100_000_000, 0.002))
QUICK = ((1_000_000, 0.02), (1_000_000, 0.002))
LAYOUTS = ("today", "fused")


def run(numel: int, touched: float, sent: float, steps: int, seed: int = 0,
        warmup: int = WARMUP) -> dict:
    """Both layouts on the same ``warmup + steps`` steps of ``numel`` coordinates
    (``touched``: each coordinate's probability a step; ``sent``: the share of the touched
    that the selection sends). One row: medians in ns per touched coordinate."""
    # every page mapped before timing; the records alone in memory of their own (not the lines just touched)
    mems = [np.ones(numel * 6, np.float32), np.ones(numel * 8, np.float32), np.ones(numel * 4, np.float32)]
    floor_buf = np.ones(numel, np.float32)
    rng = np.random.default_rng(seed + 1)
    times: dict[str, list[float]] = {f"{lay}_{ph}": [] for lay in LAYOUTS for ph in ("apply", "select")}
    times["floor"] = []
    times["records"] = []
    counts = []
    for s, (idx, g) in enumerate(_steps(numel, touched, warmup + steps, seed)):
        chosen = idx[rng.random(idx.size) < sent] if sent < 1.0 else idx
        order = (0, 1) if s % 2 == 0 else (1, 0)
        got: dict[str, float] = {}
        for lay in order:
            for phase, (at, vals) in enumerate(((idx, g), (chosen, g[:chosen.size]))):
                t0 = time.thread_time()
                probe_layout(mems[lay], numel, lay, phase, at, np.ascontiguousarray(vals))
                got[f"{LAYOUTS[lay]}_{('apply', 'select')[phase]}"] = time.thread_time() - t0
        t0 = time.thread_time()
        probe_layout(mems[2], numel, 2, 0, idx, g)
        got["records"] = time.thread_time() - t0
        t0 = time.thread_time()
        probe_random_rmw(floor_buf, idx, 1)
        got["floor"] = time.thread_time() - t0
        if s >= warmup:
            for name, secs in got.items():
                times[name].append(secs)
            counts.append(idx.size)
    n = float(np.mean(counts))
    row: dict = {"numel": numel, "touched": touched, "sent": sent, "touched_count": round(n), "steps": steps}
    for name, spans in times.items():
        row[f"{name}_ns"] = round(1e9 * float(np.median(spans)) / n, 2)
    for kind in LAYOUTS:
        row[f"{kind}_ns"] = round(row[f"{kind}_apply_ns"] + row[f"{kind}_select_ns"], 2)
    row["today_over_fused"] = round(row["today_ns"] / row["fused_ns"], 2)
    for kind in LAYOUTS:  # the step's memory over the kernel's own (the records alone): a floor of server / kernel
        row[f"{kind}_over_records"] = round(row[f"{kind}_ns"] / row["records_ns"], 2)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.layouts", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1M coordinates (seconds)")
    p.add_argument("--steps", type=int, default=20, help="timed steps after the 10 warm-up steps")
    p.add_argument("--sent", default="1,0.25", help="shares of the touched coordinates the selection sends")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    load_start = loadavg()
    print(f"bench.layouts: ns per touched coordinate, thread CPU, medians of {a.steps} steps "
          f"(load at start: {load_start})", flush=True)
    print(f"{'numel':>11} {'touched':>7} {'sent':>5} | {'floor':>6} {'records':>7} | {'today apply':>11} "
          f"{'select':>7} {'total':>7} | {'fused apply':>11} {'select':>7} {'total':>7} | {'today/fused':>11} | "
          f"{'/ records: today':>16} {'fused':>6}")
    rows = []
    for numel, touched in QUICK if a.quick else CASES:
        for sent in (float(x) for x in a.sent.split(",")):
            r = run(numel, touched, sent, a.steps)
            rows.append(r)
            print(f"{numel:>11,} {touched:>7.2%} {sent:>5.2f} | {r['floor_ns']:>6.2f} {r['records_ns']:>7.2f} | "
                  f"{r['today_apply_ns']:>11.2f} {r['today_select_ns']:>7.2f} {r['today_ns']:>7.2f} | "
                  f"{r['fused_apply_ns']:>11.2f} {r['fused_select_ns']:>7.2f} {r['fused_ns']:>7.2f} | "
                  f"{r['today_over_fused']:>10.2f}x | {r['today_over_records']:>15.2f}x "
                  f"{r['fused_over_records']:>5.2f}x", flush=True)
    load_end = loadavg()
    print(f"load at start: {load_start}; at end: {load_end}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"load_at_start": load_start, "load_at_end": load_end, "warmup": WARMUP, "rows": rows}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
