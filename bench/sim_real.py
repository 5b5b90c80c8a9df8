"""The simulation's runs through a real ``stella-ps``: W workers of update mode in threads
of this process (each on its share of the global batch dense training takes whole, as
bench.sim_update's workers), a server of its own per run, worker 0's held-out loss
against dense's (issue 43: "show that the two agree").

    python -m bench.sim_real --workload tinylm --workers 8 --density 0.1 --seeds 0,1,2 \\
        --steps 300 --batch-noise both [--outer auto] [--moment-power auto|P] [--moment mean|second] \\
        [--push-values f16|q4|q2] [--factor F] [--json PATH]

Each worker is a ``StellaOptimizer`` with the workload's inner optimizer, H = 1, pushes
at ``--density`` in ``--push-values`` (f16; both pinned; ranked by
``Compression(moment_power=..., moment=...)``, ``--moment-power`` and ``--moment``, the
defaults ``auto`` and ``mean``), the server's default broadcast (``--factor``: its
``--broadcast-factor``, the coordinates it carries per pushed one), CurveZMQ on loopback.
``--batch-noise``: ``on`` (each batch's halves accumulated as two backward passes, which
the optimizer's default ``BatchNoise`` splits; its world the server's), ``off``
(``batch_noise=None``: plain Adam steps, one backward pass) or ``both``. The figure is
bench.sim_update's: the iterations to dense's final held-out loss against dense at the
same global batch (:func:`bench.sim_update.step_ratio`). The run is repeatable to the
last digit for one seed and setting (the server closes each step when all W pushes are in,
and sums them in worker order); a perturbation of the first steps moves the byte LM's
figure by up to 0.15 on a seed (bench/RESULTS.md), so give it several seeds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from typing import Any, Literal

import torch

from bench import workloads as WL
from bench.sim_update import Curve, _halves, heldout_loss, run_dense, step_ratio
from stella import Compression, Connection, StellaOptimizer, Sync
from stella.protocol import ValueDtype

__all__ = ["train", "main"]


def train(endpoint: str, outer: str, *, world: int = 8, seed: int = 0, density: float = 0.03, noise: bool = False,
          workload: str = "adamlp", steps: int = 150, eval_every: int = 5,
          keys: dict[str, str] | None = None, moment_power: float | str = "auto",
          moment: Literal["mean", "second"] = "mean", push_values: ValueDtype = "f16") -> Curve:
    """``world`` workers in threads through the server at ``endpoint``; worker 0's held-out
    loss curve. ``noise``: each worker's batch halves accumulated one after the other (two
    backward passes, which the optimizer's default BatchNoise splits itself; its world read
    off the server: at mid-run every worker's must be ``world``, else RuntimeError);
    otherwise one backward pass and ``batch_noise=None``. ``keys``: the CurveZMQ keys
    (``ServerProcess.client_kwargs()``; None: the environment's). ``moment_power``,
    ``moment``, ``push_values``: the pushes' ``Compression(moment_power=..., moment=..., value_dtype=...)``."""
    wl = WL.get(workload)
    models = [wl.build_model(seed) for _ in range(world)]  # before the threads: torch's RNG is global
    curve = Curve()
    curve.steps.append(0)
    curve.loss.append(heldout_loss(wl, models[0]))
    errors: list[BaseException] = []
    worlds: list[int] = []
    lock = threading.Lock()

    def worker(rank: int) -> None:
        try:
            model = models[rank]
            opt = StellaOptimizer(model, endpoint, optimizer=wl.make_optimizer(model.parameters()), outer=outer,
                                  sync=Sync(every=1, max_every=1),
                                  compression=Compression(density=density, value_dtype=push_values,
                                                          moment_power=moment_power, moment=moment),
                                  connection=Connection(timeout=120, worker_id=rank, **(keys or {})),
                                  **({} if noise else {"batch_noise": None}))
            batches = wl.batches(rank, world, wl.batch_size, seed)
            for step in range(1, steps + 1):
                wl.set_lr(opt, step - 1)  # the workload's schedule (warm-up), as dense training's
                opt.zero_grad()
                if noise:
                    first, second = _halves(next(batches))
                    (wl.loss(model, first) / 2).backward()
                    (wl.loss(model, second) / 2).backward()
                else:
                    wl.loss(model, next(batches)).backward()
                opt.step()
                if noise and step == steps // 2:
                    with lock:
                        worlds.append(opt.batch_noise.world if opt.batch_noise is not None else 0)
                if rank == 0 and step % eval_every == 0:
                    with lock:
                        curve.steps.append(step)
                        curve.loss.append(heldout_loss(wl, model))
            opt.close(flush=False)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
    finally:
        torch.set_num_threads(threads_before)
    if errors:
        raise errors[0]
    if noise and worlds != [world] * world:
        raise RuntimeError(f"BatchNoise's world at mid-run: {worlds}, not the server's {world} pushes a step")
    return curve


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="tinylm")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--outer", default="auto")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--batch-noise", default="both", choices=("on", "off", "both"))
    ap.add_argument("--moment-power", default="auto", help="the pushes' Compression(moment_power=...): auto or P")
    ap.add_argument("--moment", default="mean", choices=("mean", "second"), help="the pushes' Compression(moment=...)")
    ap.add_argument("--push-values", default="f16", choices=("f16", "q4", "q2"), help="the pushes' value coding")
    ap.add_argument("--factor", type=float, help="the server's --broadcast-factor (unset: its default)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    from stella_ps.process import ServerProcess

    seeds = [int(s) for s in a.seeds.split(",")]
    power: float | str = a.moment_power if a.moment_power == "auto" else float(a.moment_power)
    modes = {"on": [True], "off": [False], "both": [False, True]}[a.batch_noise]
    rows: list[dict[str, Any]] = []
    print(f"{'workload':9} {'W':>3} {'density':>8} {'outer':8} {'moment':>6} {'BatchNoise':10} {'ratio':>6}  seeds",
          flush=True)
    for noise in modes:
        ratios = []
        t0 = time.time()
        for seed in seeds:
            dense = run_dense(a.workload, a.workers, seed, a.steps, a.eval_every)
            with ServerProcess(a.workers, [] if a.factor is None else ["--broadcast-factor", str(a.factor)]) as srv:
                curve = train(srv.endpoint, a.outer, world=a.workers, seed=seed, density=a.density, noise=noise,
                              workload=a.workload, steps=a.steps, eval_every=a.eval_every, keys=srv.client_kwargs(),
                              moment_power=power, moment=a.moment, push_values=a.push_values)
            ratios.append(step_ratio(curve, dense))
            print(f"#   seed {seed}: {ratios[-1]:.3f} ({time.time() - t0:.0f} s so far)", flush=True)
        mean = statistics.mean(ratios)
        rows.append({"workload": a.workload, "W": a.workers, "density": a.density, "outer": a.outer,
                     "moment_power": power, "moment": a.moment, "push_values": a.push_values, "factor": a.factor,
                     "batch_noise": noise, "seeds": seeds, "ratios": ratios,
                     "mean": mean})
        print(f"{a.workload:9} {a.workers:>3} {a.density:>8.4f} {a.outer:8} {a.moment_power:>6} "
              f"{'on' if noise else 'off':10} "
              f"{mean:>6.3f}  {' '.join(f'{r:.3f}' for r in ratios)}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"argv": sys.argv[1:] if argv is None else argv, "rows": rows}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
