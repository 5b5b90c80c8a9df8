"""The density controller alone over simulated rounds on bench.adaptive's fluctuating links
(issue 43): the share of a job's time its workers would wait for the exchange, with the
controller's fall detection (``stella.adapt.FALL``) and without it, side by side.

Each round the controller's current candidate is sent over a link whose rate follows
:func:`bench.adaptive.rate_schedule` (30-300 Mbit/s, mean 115, a level every ``--period``
rounds on average, up = down): the push's coded size and the broadcast's pull (twice the
push's coordinates in q4) over the rate, plus 10 ms of compression, against ``--compute``
seconds of computation. Each round either takes exactly what the link carries, or (as on the
test bed, where a busy server acknowledges late) a uniform 30-100% of it.
A round waits for what its exchange takes beyond the computation (no running on: what the
pipeline would absorb with local steps counts as waiting here).

  python -m bench.adapt_links                       # 8 seeds, 600 rounds each, both noises
  python -m bench.adapt_links --json out.json

Columns: waited (the share of the rounds' time), mean density, decisions (changes of
candidate), and on a steady noisy link (115 Mbit/s) the changes in 60 rounds.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import stella.adapt as adapt
from bench.adaptive import rate_schedule
from bench.harness import loadavg
from stella.adapt import Controller, RoundMeasure, pull_bits
from stella.codec import coordinate_bits
from stella.protocol import BroadcastInfo

N = 10_000_000  # the coordinates a push selects from
BCAST = BroadcastInfo(values="q4", factor=2.0)
COMPRESS_S = 0.01


@contextmanager
def fall_detection(on: bool) -> Iterator[None]:
    """The controller as it is (``on``) or with its fall detection off (a fall needs more
    rounds in a row than any run has)."""
    saved = adapt.FALL_ROUNDS
    adapt.FALL_ROUNDS = saved if on else 1 << 30
    try:
        yield
    finally:
        adapt.FALL_ROUNDS = saved


def round_at(c: Controller, mbit: float, compute_s: float) -> RoundMeasure:
    d, coding = c.density, c.value_dtype
    push = int(N * d * coordinate_bits(d, coding) / 8) + 2000
    pull = int(N * pull_bits(d, BCAST, coding) / 8)
    bps = mbit * 1e6 / 8
    return RoundMeasure(compute_s=compute_s, compress_s=COMPRESS_S, push_bytes=push, push_s=push / bps,
                        pull_bytes=pull, pull_s=pull / bps)


def controller() -> Controller:
    c = Controller(density=None, floor=0.001, ceiling=0.1)
    c.broadcast = BCAST
    c.first()
    return c


def run(seed: int, rounds: int, noise: float, compute_s: float, period: float) -> dict[str, float]:
    """One job: the share of its time waited, the mean density, the decisions."""
    sched = rate_schedule(115.0, duration=3 * rounds * compute_s, period=period * compute_s, seed=f"{seed}")
    rng = random.Random(seed)
    c = controller()
    t = waited = 0.0
    j = 0
    dens = []
    for _ in range(rounds):
        while j + 1 < len(sched) and sched[j + 1][0] <= t:
            j += 1
        m = round_at(c, sched[j][1] * (1.0 - noise * rng.random()), compute_s)
        exchange = m.compress_s + m.push_s + m.pull_s
        waited += max(0.0, exchange - compute_s)
        t += max(compute_s, exchange)
        dens.append(c.density)
        c.observe(m)
    return {"waited": waited / t, "density": statistics.mean(dens), "decisions": float(c.decisions)}


def steady_changes(seed: int, noise: float, compute_s: float) -> int:
    """Changes of candidate in 60 rounds on a steady 115 Mbit/s link, after 15 to settle."""
    rng = random.Random(seed)
    c = controller()
    for _ in range(15):
        c.observe(round_at(c, 115.0 * (1.0 - noise * rng.random()), compute_s))
    before = c.decisions
    for _ in range(60):
        c.observe(round_at(c, 115.0 * (1.0 - noise * rng.random()), compute_s))
    return c.decisions - before


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=600)
    ap.add_argument("--compute", type=float, default=0.2, help="seconds of computation a round")
    ap.add_argument("--period", type=float, default=20.0, help="rounds a link level holds, on average")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    load = loadavg()
    rows: list[dict[str, Any]] = []
    for noise in (0.7, 0.0):
        for on in (False, True):
            with fall_detection(on):
                runs = [run(s, a.rounds, noise, a.compute, a.period) for s in range(a.seeds)]
                steady = [steady_changes(s, noise, a.compute) for s in range(a.seeds)]
            measure = f"{100 * (1 - noise):.0f}-100% of the link" if noise else "all of the link"
            rows.append({"rounds measure": measure, "fall detection": on,
                         **{k: statistics.mean(r[k] for r in runs) for k in runs[0]},
                         "steady changes in 60": statistics.mean(steady), "steady max": max(steady)})
    print(f"# python -m bench.adapt_links {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip())
    print(f"# {a.seeds} seeds x {a.rounds} rounds, {a.compute} s of compute a round, a level every {a.period} rounds;"
          f" load average at start {load}")
    print("| rounds measure | fall detection | waited | mean density | decisions | steady: changes in 60 (max) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rounds measure']} | {'on' if r['fall detection'] else 'off'} | {r['waited']:.3f} | "
              f"{100 * r['density']:.2f}% | {r['decisions']:.0f} | {r['steady changes in 60']:.1f} "
              f"({r['steady max']}) |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "load_at_start": load, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
