"""The server's broadcast step alone (``stella_ps.broadcast.Broadcast.step``): with the
index of the residual's largest magnitudes (``stella_ps.residual``, where a step is light
enough for it), and with the streaming pass over the whole residual every step, side by
side on the same steps.

Each step, W pushes of ``density`` each touch their union of every tensor; the
broadcast adds a change there, selects ``factor`` x a push's coordinates per tensor, codes
them (q4 by default) and builds the message. Reported: median ms a step after 5 warm-up
steps, the passes over the whole residual (streaming, or the index rebuilding itself), and
pass / index.

    python -m bench.broadcast [--quick] [--workers 2,8] [--densities 0.0003,0.001,0.003,0.01] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from bench.harness import loadavg
from stella.protocol import TensorSpec
from stella_ps.broadcast import Broadcast
from stella_ps.config import Pulls

TENSORS = 8


def _steps(numel: int, workers: int, density: float, steps: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    per = max(1, int(numel * density))
    for _ in range(steps):
        touched, changes = [], []
        for _ in range(TENSORS):
            idx = np.unique(np.concatenate([rng.choice(numel, per, replace=False) for _ in range(workers)]))
            touched.append(idx.astype(np.int32))
            changes.append((rng.standard_normal(idx.size) * 1e-3).astype(np.float32))
        yield touched, changes, [float(per)] * TENSORS


def run(numel: int, workers: int, density: float, steps: int, coding: str, factor: float) -> dict:
    layout = [TensorSpec(f"t{i}", (numel,), "float32") for i in range(TENSORS)]
    info = Pulls(values=coding, factor=factor).broadcast_info()  # type: ignore[arg-type]
    assert info is not None
    both = {name: Broadcast(layout, [np.zeros(numel, np.float32) for _ in layout], info, 64, whole=[False] * TENSORS,
                            index=name == "index")
            for name in ("index", "pass")}
    times: dict[str, list[float]] = {name: [] for name in both}
    for s, (touched, changes, counts) in enumerate(_steps(numel, workers, density, steps), 1):
        for name, b in both.items():  # the same steps, in turn
            t0 = time.perf_counter()
            b.step(s, touched, changes, counts)
            times[name].append(time.perf_counter() - t0)
    ms = {name: 1e3 * float(np.median(t[5:])) for name, t in times.items()}
    return {"numel": numel, "tensors": TENSORS, "workers": workers, "density": density, "coding": coding,
            "factor": factor, "steps": steps, "index_ms": round(ms["index"], 3), "pass_ms": round(ms["pass"], 3),
            "speedup": round(ms["pass"] / ms["index"], 2),
            "index_full_passes": sum(both["index"].full_passes) + sum(both["index"].index_passes),
            "pass_full_passes": sum(both["pass"].full_passes)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.broadcast", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tensors of 250k, 20 steps")
    p.add_argument("--workers", default="2,8")
    p.add_argument("--densities", default="0.0003,0.001,0.003,0.01")
    p.add_argument("--coding", default="q4")
    p.add_argument("--factor", type=float, default=2.0)
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    numel, steps = (250_000, 20) if a.quick else (1_250_000, 40)
    load = loadavg()
    rows = [run(numel, int(w), float(d), steps, a.coding, a.factor)
            for w in a.workers.split(",") for d in a.densities.split(",")]
    print(f"Broadcast.step: {TENSORS} tensors of {numel:,}, {a.coding} x{a.factor:g}, {steps} steps "
          f"(load at start: {load})")
    print(f"{'W':>3} {'density':>8} {'index ms':>8} {'pass ms':>8} {'pass/index':>10} "
          f"{'full passes (index)':>20}")
    for r in rows:
        print(f"{r['workers']:>3} {r['density']:>8.2%} {r['index_ms']:>8.2f} {r['pass_ms']:>8.2f} "
              f"{r['speedup']:>10.2f} "
              f"{r['index_full_passes']:>10} of {r['pass_full_passes']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"load_at_start": load, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
