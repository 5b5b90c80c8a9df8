"""The Stella system for ``bench.e2e``: a real ``stella-ps`` in the test bed's ``ps``
site and one :class:`stella.StellaOptimizer` worker per site, one step stale.

Same workload, data, seed, per-worker batch and learning-rate schedule as the DDP
baselines (``bench.workloads``); the server runs the workload's optimizer lazily.
Per iteration each worker records compute time (forward + backward), the time
``step()`` blocked on the network (``net_wait``), and the bytes that really crossed
its site's link. Worker 0 evaluates its replica every ``eval_every`` steps
(evaluation time excluded from the wall clock).

Stopping early (time cap or target reached) must happen at the same *round* on every
worker (workers of different speeds may make different numbers of local steps per
round): worker 0 picks a stop round a few rounds ahead (``opt.stats.rounds +
STOP_AHEAD``) and writes it to a file in the shared log directory; every worker reads
it after each step and stops right after the step that started that round. The step
cap (``--steps``) stays a hard cap on every worker's own steps (worker 0 also picks a
stop round when it comes near it): without adaptation every worker makes the same steps
and ends there; with adaptation a worker at its cap may leave a round or two before the
others, which is safe (closing leaves the job, the server goes on without it), so runs
that compare systems end by time or target (bench.adaptive).

``--slowdown F`` makes a worker F times slower: after its backward it sleeps (F-1) x
that step's measured forward + backward time (bench.adaptive's slow scenario).

  python -m bench.stella_e2e --workload digits --steps 50          # loopback, quick check
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from bench.harness import (
    REPO,
    IterRecorder,
    TrainClock,
    collect_ranks,
    fmt_summary,
    launch_workers,
    log_tails,
    site_iface,
    summarize,
    wait_workers,
)
from stella_ps.process import ServerProcess, process_cpu_seconds

PS_PORT = 5555
STOP_AHEAD = 3  # rounds: a worker is at most one round ahead of another in synchronous mode
# per-iteration fields read from ``opt.stats``: what the worker's controller chose and measured
# per iteration, as they stand after it: the adaptive state, and the exchange's running totals (bench.plan's
# clean-window measurement sums them over the iterations clear of worker 0's evaluations)
STAT_FIELDS = ("value_dtype", "sync_every", "accumulate", "up_mbps", "down_mbps", "exchange_s", "compress_s")


def _every(v: str) -> int | str:
    """``--sync-every``: a count, or "auto"."""
    return v if v == "auto" else int(v)


def sync_kwargs(a) -> dict:
    """``stella.Sync``'s ``every``, ``max_every`` and ``max_accumulate``: the nonzero ones
    (0: the library's default), and the staleness."""
    named = {"every": a.sync_every, "max_every": a.max_sync_every, "max_accumulate": a.max_accumulate}
    return {"staleness": a.staleness, **{k: v for k, v in named.items() if v}}


def server_options(wl) -> dict:
    if wl.optimizer == "adamw":
        return {"name": "adamw", "lr": wl.lr_at(0), "betas": [0.9, 0.95], "weight_decay": wl.weight_decay}
    return {"name": "sgd", "lr": wl.lr_at(0), "momentum": 0.9, "weight_decay": wl.weight_decay}


def worker(a) -> int:
    import torch

    from bench import workloads as W
    from stella import Compression, Connection, StellaOptimizer, Sync

    torch.set_num_threads(a.threads)
    if a.site_size > 1:  # the ranks of a site: gloo among them, one leader speaks to the server
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.site_port}", rank=a.rank % a.site_size,
                                world_size=a.site_size)
    wl = W.get(a.workload)
    model = wl.build_model(a.seed if a.model_seed is None else a.model_seed)
    comp_kw: dict[str, Any] = {}  # "default": the library's own default (not passed)
    if a.density != "default":
        comp_kw["density"] = a.density if a.density == "auto" else float(a.density)
    if a.value_dtype != "default":
        comp_kw["value_dtype"] = a.value_dtype
    if a.per_tensor:
        comp_kw["per_tensor"] = True
    if a.mode == "update":  # the workload's own optimizer steps on the worker; the server's is the outer step
        mode_kw = {"mode": "update", "optimizer": wl.make_optimizer(model.parameters()),
                   "outer": json.loads(a.outer) if a.outer.startswith("{") else a.outer}
    else:
        mode_kw = {"mode": "gradient", "optimizer": server_options(wl)}
    opt = StellaOptimizer(model, a.address, compression=Compression(**comp_kw), sync=Sync(**sync_kwargs(a)),
                          connection=Connection(timeout=600, name=f"e2e-{a.rank}", server_key=a.server_key,
                                                client_key=a.client_key),
                          process_group="default" if a.site_size > 1 else None, **mode_kw)
    if a.start_after > 0:  # a worker that joins the job later (bench.slow's joiner)
        time.sleep(a.start_after)
    t_start = time.time()
    opt.start()  # the registration (the model's upload) before the clock, as before DDP's first step
    start_s = time.time() - t_start
    batches = wl.batches(a.rank, a.world, a.batch_size or wl.batch_size, a.seed)
    stop_file = os.path.join(a.log_dir, "stop_round")
    recorder = IterRecorder(site_iface())  # the same accounting as the DDP baselines
    clock = TrainClock(wl, model)
    if a.rank == 0:
        clock.evaluate(0)
    train_start = time.time()
    stop_round: int | None = None  # the round every worker ends on, once worker 0 has picked it
    step = 0
    while step < a.steps:  # every worker's own step cap (the same on all: equal steps without adaptation)
        w0, r0 = opt.stats.wait_s, opt.stats.rounds
        recorder.begin()
        c0 = time.perf_counter()
        wl.set_lr(opt, step)  # gradient mode: rides to the server with the next push; update mode: local
        opt.zero_grad()
        loss = wl.loss(model, next(batches))
        recorder.lap()
        loss.backward()
        slept = 0.0
        if a.slowdown > 1.0:  # a slower machine: (F-1) x this step's forward + backward, before step()
            slept = (a.slowdown - 1.0) * (time.perf_counter() - c0)
            time.sleep(slept)
        recorder.lap()
        opt.step()
        step += 1
        if step == 1:  # the counters after the join (the model's first copy each way) and the first round
            first = (opt.bytes_pushed, opt.bytes_pulled, opt.stats.rounds)
        rec = recorder.end(step, loss.item())
        wait = opt.stats.wait_s - w0
        rec["net_wait"], rec["compute"], rec["density"] = wait, rec["iter"] - wait, opt.stats.density
        rec["slept"], rec["t"], rec["t_epoch"] = slept, clock.wall(), time.time()
        rec["rounds"] = rounds = opt.stats.rounds
        for k in STAT_FIELDS:
            rec[k] = getattr(opt.stats, k)
        started = rounds > r0  # this step() started a round: a round boundary
        if a.rank == 0:
            if step % a.eval_every == 0 or step == a.steps:
                clock.evaluate(step)
            if stop_round is None and (clock.wall() > a.max_seconds or (a.stop_at_target and clock.reached)
                                       or step + STOP_AHEAD >= a.steps):
                stop_round = rounds + STOP_AHEAD
                with open(stop_file + ".tmp", "w") as f:
                    f.write(str(stop_round))
                os.replace(stop_file + ".tmp", stop_file)
        elif stop_round is None and os.path.exists(stop_file):
            with open(stop_file) as f:
                stop_round = int(f.read())
        if stop_round is not None and started and rounds >= stop_round:
            break
        if clock.wall() > a.max_seconds + 120:  # safety net only: worker 0 stops everyone long before
            print(f"worker {a.rank}: no stop round after {clock.wall():.0f} s, leaving", flush=True)
            break
    steady = (opt.bytes_pushed - first[0], opt.bytes_pulled - first[1], opt.stats.rounds - first[2])
    opt.synchronize()  # (the end's flush is not the steady state: not in the counters per round)
    if a.rank == 0 and (not clock.evals or clock.evals[-1]["step"] != step):
        clock.evaluate(step)
    opt.close()
    out = {"rank": a.rank, "world": a.world, "system": "stella", "workload": a.workload, "steps": step,
           "train_wall": clock.wall(), "iters": recorder.iters, "evals": clock.evals, "reached": clock.reached,
           "site": os.environ.get("STELLA_WAN_SITE"), "density": a.density, "final_density": opt.stats.density,
           "staleness": a.staleness, "mode": a.mode, "sync_every": a.sync_every, "value_dtype": a.value_dtype,
           "outer": a.outer, "rounds": opt.stats.rounds, "stop_round": stop_round, "slowdown": a.slowdown,
           "train_start_epoch": train_start, "max_sync_every": a.max_sync_every, "max_accumulate": a.max_accumulate,
           "final_value_dtype": opt.stats.value_dtype,
           "values_pushed": opt.stats.values_pushed, "values_pulled": opt.stats.values_pulled,
           "client_bytes_pushed": steady[0], "client_bytes_pulled": steady[1], "client_rounds": steady[2],
           "leader": opt.client is not None,
           "compress_s": opt.stats.compress_s, "exchange_s": opt.stats.exchange_s,
           "start_s": start_s, "start_epoch": t_start, "reconnects": getattr(opt.client, "reconnects", 0)}
    with open(a.out, "w") as f:
        json.dump(out, f)
    return 0


def run_stella(workload: str, *, world: int = 2, steps: int = 50, max_seconds: float = 300.0, bed=None,
               sites: list[str] | None = None, ps_site: str = "ps", seed: int = 0,
               eval_every: int | None = None, stop_at_target: bool = False, threads: int = 1,
               density="auto", staleness: int = 1, log_dir: str | None = None, mode: str = "gradient",
               sync_every: int | str = 1, value_dtype: str = "auto", outer: str = "auto",
               server_args: tuple[str, ...] = (), site_size: int = 1, slowdown: float | list[float] = 1.0,
               max_sync_every: int = 0, max_accumulate: int = 0, per_tensor: bool = False,
               start_after: list[float] | None = None, expected: int | None = None,
               model_seeds: list[int | None] | None = None) -> dict:
    """Run one Stella job (server + ``world`` workers) and return its summary. The
    server's log is kept as ``ps.log`` in the job's log directory (``log_dir`` key).
    ``server_args``: more stella-ps flags. ``site_size`` > 1: the workers are sites of
    that many ranks (consecutive ranks, gloo among them, one worker to the server).
    ``slowdown``: each worker's compute-time factor (one for all, or a list per rank).
    ``density``/``value_dtype`` "default", ``sync_every``/``max_sync_every``/
    ``max_accumulate`` 0: not passed, the library's defaults. ``per_tensor``: each large
    tensor its own share of a push (``Compression(per_tensor=True)``). ``start_after``: seconds
    each rank waits before it joins (a joiner mid-job); ``expected``: the workers the server
    waits for before its first step (default: every worker); ``model_seeds``: each rank's
    model seed (None: ``seed``; another makes that worker pull a snapshot when it joins)."""
    from bench import workloads as W
    from stella_ps.process import free_port

    wl = W.get(workload)
    slow = list(slowdown) if isinstance(slowdown, (list, tuple)) else [float(slowdown)] * world
    if len(slow) != world:
        raise ValueError(f"slowdown: one factor per rank ({world}), got {slow}")
    tmp = tempfile.mkdtemp(prefix=f"stella-{workload}-", dir=log_dir)
    host = bed.address(ps_site) if bed is not None else "127.0.0.1"
    ps = ServerProcess(expected or world // site_size, ["--max-workers-per-key", str(world + 1), *server_args],
                       bind=f"tcp://{host}:{PS_PORT if bed else 0}", log_level="INFO", cwd=REPO, timeout=60,
                       popen=functools.partial(bed.popen, ps_site) if bed is not None else subprocess.Popen)
    site_ports = [free_port() for _ in range(world // site_size)]
    server_cpu = process_cpu_seconds(ps.pid)  # its start-up is not the job's
    try:
        if bed is not None:
            sites = sites or [s for s in bed.sites if s != ps_site][:world]
        argvs = []
        for r in range(world):
            argv = [sys.executable, "-m", "bench.stella_e2e", "worker", "--address", ps.endpoint, "--rank", str(r),
                    "--world", str(world), "--workload", workload, "--steps", str(steps),
                    "--max-seconds", str(max_seconds), "--seed", str(seed),
                    "--eval-every", str(eval_every or wl.eval_every), "--threads", str(threads),
                    "--density", str(density), "--staleness", str(staleness), "--log-dir", tmp,
                    "--mode", mode, "--sync-every", str(sync_every), "--value-dtype", value_dtype, "--outer", outer,
                    "--out", os.path.join(tmp, f"rank{r}.json"), "--site-size", str(site_size),
                    "--site-port", str(site_ports[r // site_size]), "--slowdown", str(slow[r]),
                    "--max-sync-every", str(max_sync_every), "--max-accumulate", str(max_accumulate)]
            for flag, path in ps.client_kwargs().items():  # the CurveZMQ keys made for this job
                argv += [f"--{flag.replace('_', '-')}", path]
            if stop_at_target:
                argv.append("--stop-at-target")
            if per_tensor:
                argv.append("--per-tensor")
            if start_after and start_after[r] > 0:
                argv += ["--start-after", str(start_after[r])]
            if model_seeds and model_seeds[r] is not None:
                argv += ["--model-seed", str(model_seeds[r])]
            argvs.append(argv)
        rcs = wait_workers(launch_workers(argvs, tmp, bed=bed, sites=sites), max_seconds + 180)
        server_cpu = process_cpu_seconds(ps.pid) - server_cpu
    finally:
        ps.close()
        with open(os.path.join(tmp, "ps.log"), "w") as f:
            f.write(ps.logs())
    if None in rcs:
        return {"ok": False, "error": f"stella job exceeded {max_seconds + 180:.0f} s\n{log_tails(tmp, rcs)}",
                "log_dir": tmp}
    found = collect_ranks(tmp, world)
    if any(rcs) or None in found:
        return {"ok": False, "error": f"stella workers exited {rcs}:\n{log_tails(tmp, rcs)}", "log_dir": tmp}
    ranks = [k for k in found if k is not None]
    res = summarize("stella", workload, ranks, wl)
    res["density"] = density
    res.update(mode=mode, sync_every=sync_every, value_dtype=value_dtype, outer=outer, slowdown=slow,
               max_sync_every=max_sync_every, max_accumulate=max_accumulate, per_tensor=per_tensor)
    # where the time of an exchange goes (profile), per iteration, mean over workers
    res["compress_s_per_iter"] = sum(k["compress_s"] / max(1, k["steps"]) for k in ranks) / world
    res["exchange_s_per_iter"] = sum(k["exchange_s"] / max(1, k["steps"]) for k in ranks) / world
    res["final_density"] = [k.get("final_density") for k in ranks]
    # what each worker (a site's leader) sent and received, per round, by its client's counters
    leaders = [k for k in ranks if k.get("leader", True)]
    res["client_bytes_per_round"] = {  # after the join: the steady state
        "pushed": statistics.mean(k["client_bytes_pushed"] / max(1, k["client_rounds"]) for k in leaders),
        "pulled": statistics.mean(k["client_bytes_pulled"] / max(1, k["client_rounds"]) for k in leaders)}
    res["values_per_round"] = {"pushed": statistics.mean(k["values_pushed"] / max(1, k["rounds"]) for k in leaders),
                               "pulled": statistics.mean(k["values_pulled"] / max(1, k["rounds"]) for k in leaders)}
    res["site_size"] = site_size
    # the server's CPU over the job (joins, steps, pulls, the end's flush) per round of its workers
    res["server_cpu_ms_per_round"] = 1e3 * server_cpu / max(1, max(k["rounds"] for k in leaders))
    res["log_dir"] = tmp
    return res


def system(name: str, **kw) -> Callable[[Any, Any], dict]:
    """A ``bench.e2e`` runner for one Stella configuration (``run_stella`` keywords)."""
    def run(spec, bed) -> dict:
        res = run_stella(spec.workload, world=spec.world, steps=spec.max_steps, max_seconds=spec.max_seconds,
                         bed=bed, sites=spec.worker_sites[:spec.world], ps_site=spec.ps_site, seed=spec.seed,
                         eval_every=spec.eval_every, stop_at_target=spec.stop_at_target,
                         log_dir=spec.log_dir or None, **kw)
        res["system"] = name
        return res

    run.__name__ = f"run_{name}"
    return run


# The configurations bench.e2e registers (name -> run_stella keywords). "stella" is the
# default mode with default settings; the others vary one thing each.
SYSTEMS: dict[str, dict[str, Any]] = {
    "stella": {"mode": "update"},  # the library's defaults: update mode, H >= 1, density and coding adapted
    "stella_f16": {"mode": "update", "value_dtype": "f16", "max_sync_every": 1},  # issue 20's default: f16, H = 1
    "stella_q4": {"mode": "update", "value_dtype": "q4", "max_sync_every": 1},  # 4-bit values, density "auto"
    "stella_q2": {"mode": "update", "value_dtype": "q2", "max_sync_every": 1},  # ... and 2-bit values
    "stella_lean": {"mode": "update", "value_dtype": "q2", "density": 0.005, "max_sync_every": 1},  # fewest bytes
    "stella_h8": {"mode": "update", "value_dtype": "q2", "density": 0.006, "sync_every": 8,
                  "max_sync_every": 8},  # local steps
    "stella_nesterov": {"mode": "update", "value_dtype": "q2", "density": 0.006, "sync_every": 8,
                        "max_sync_every": 8, "outer": "nesterov"},
    # one top-k over the flat model (stella_f16) against a quota per tensor: whether per-tensor fairness matters
    "stella_f16_per_tensor": {"mode": "update", "value_dtype": "f16", "max_sync_every": 1, "per_tensor": True},
    # the defaults with the least H chosen by what a round costs against a step (Sync(every="auto"))
    "stella_auto": {"mode": "update", "sync_every": "auto"},
    "stella_grad": {"mode": "gradient"},  # StellaTrain's gradient mode, one step stale
    "stella_grad_sync": {"mode": "gradient", "staleness": 0},  # gradient mode without overlap
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.stella_e2e")
    sub = ap.add_subparsers(dest="cmd")
    w = sub.add_parser("worker")
    w.add_argument("--address", required=True)
    w.add_argument("--rank", type=int, required=True)
    w.add_argument("--world", type=int, required=True)
    w.add_argument("--workload", required=True)
    w.add_argument("--steps", type=int, required=True)
    w.add_argument("--max-seconds", type=float, required=True)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--eval-every", type=int, default=10)
    w.add_argument("--threads", type=int, default=1)
    w.add_argument("--density", default="auto", help='a fraction, "auto", or "default" (not passed)')
    w.add_argument("--staleness", type=int, default=1)
    w.add_argument("--batch-size", type=int, default=0)
    w.add_argument("--mode", choices=("gradient", "update"), default="gradient")
    w.add_argument("--sync-every", type=_every, default=1,
                   help="0: the library's default (not passed); auto: Sync(every='auto')")
    w.add_argument("--value-dtype", default="auto", help='a wire dtype, "auto", or "default" (not passed)')
    w.add_argument("--outer", default="auto", help="auto, a preset's name or the outer optimizer's config as JSON")
    w.add_argument("--stop-at-target", action="store_true")
    w.add_argument("--per-tensor", action="store_true", help="each large tensor its own share of a push")
    w.add_argument("--log-dir", required=True)
    w.add_argument("--out", required=True)
    w.add_argument("--server-key", help="the server's public key file (CurveZMQ)")
    w.add_argument("--client-key", help="this worker's .key_secret file (CurveZMQ)")
    w.add_argument("--site-size", type=int, default=1)
    w.add_argument("--site-port", type=int, default=0)
    w.add_argument("--slowdown", type=float, default=1.0, help="sleep (F-1) x each step's forward+backward")
    w.add_argument("--max-sync-every", type=int, default=0, help="0: the library's default (not passed)")
    w.add_argument("--max-accumulate", type=int, default=0, help="0: the library's default (not passed)")
    w.add_argument("--start-after", type=float, default=0.0, help="join the job this many seconds after launch")
    w.add_argument("--model-seed", type=int, default=None,
                   help="build the model with this seed (default --seed): another seed's values are not the job's, "
                        "so the worker pulls a snapshot")
    ap.add_argument("--workload", default="digits")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--max-seconds", type=float, default=120)
    ap.add_argument("--density", default="auto")
    ap.add_argument("--staleness", type=int, default=1)
    ap.add_argument("--mode", choices=("gradient", "update"), default="gradient")
    ap.add_argument("--sync-every", type=int, default=1)
    ap.add_argument("--value-dtype", default="f16")
    ap.add_argument("--outer", default="auto")
    a = ap.parse_args(argv)
    if a.cmd == "worker":
        return worker(a)
    res = run_stella(a.workload, steps=a.steps, max_seconds=a.max_seconds, density=a.density, staleness=a.staleness,
                     mode=a.mode, sync_every=a.sync_every, value_dtype=a.value_dtype, outer=a.outer)
    print(fmt_summary(res))
    return 0 if res.get("ok") else 1


if __name__ == "__main__":
    raise SystemExit(main())
