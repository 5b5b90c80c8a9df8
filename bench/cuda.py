"""The CUDA paths, on a machine with an NVIDIA GPU: workers training on the GPU through a real `stella-ps`.

    python -m bench.cuda [--steps 300] [--workers 2] [--configs h1,defaults] [--json PATH] [--profile PATH]
                         [--quick] [--flat] [--compressor-only]

1. **Training.** The byte-level Transformer LM (bench.workloads ``bytelm``, AdamW) on the GPU:
   dense on one process (the baseline), then, for each of ``--configs``, ``--workers`` worker
   processes sharing the GPU, each with a :class:`stella.StellaOptimizer` (update mode) against a
   real ``stella-ps`` on this host's CPU over loopback, CurveZMQ on: ``h1`` pins H = 1 and 1% f16,
   ``defaults`` is the library's own (H, density and coding chosen by the controller). Every run
   takes ``--steps`` steps per process; reported: held-out loss, s/step, each worker's own compute
   (the same model and inner optimizer without Stella, timed in the worker just before) and the
   ratio of the two, and the bytes each worker moved. The check passes when every Stella worker's
   held-out loss is within 5% of the dense run's (the same iterations, twice the samples).
2. **The compressor on the GPU**: :class:`stella.compress.ErrorFeedbackCompressor` on CUDA tensors
   of the model's shapes and on one tensor of 100M coordinates, per density, in its steady state
   (threshold carried over): ms per round and ns per coordinate. `stella plan`'s scenarios assume
   1 ns per coordinate for a GPU's threshold pass.
   With ``--flat``, bench.flat's sections on the GPU as well: :class:`stella.flat.FlatCompressor`
   on the model's 76 tensors against one tensor of the same size (and the per-tensor compressor on
   both), :class:`stella.flat.FlatParams`' operations, and an update-mode round (residual,
   compression, install) per tensor and flat, with float32 and bfloat16 parameters.
   ``--compressor-only`` measures this part alone (no training, no profile).
3. **A profile** (`stella profile`'s :func:`stella.planning.measure.profile_model`) of the LM on the GPU,
   written to ``--profile``: the compute per step a catalog's speed is relative to.

CI has no GPU: this module says so and exits 0 where CUDA is not available.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

TARGET_REL = 1.05


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()


def _train(wl, model, opt, batches, steps: int, dev) -> float:
    """``steps`` training steps on ``dev`` (the workload's learning-rate schedule); their wall seconds."""
    t0 = time.perf_counter()
    for step in range(steps):
        wl.set_lr(opt, step)
        x, y = (t.to(dev, non_blocking=True) for t in next(batches))
        opt.zero_grad()
        wl.loss(model, (x, y)).backward()
        opt.step()
    _sync(dev)
    return time.perf_counter() - t0


def _own_compute(wl, model, rank: int, world: int, seed: int, steps: int, dev) -> float:
    """Seconds a step of ``model``'s own training (a copy, its own inner optimizer, batches
    of its own) takes on ``dev``, without Stella: what a worker's step costs at best."""
    import copy

    m = copy.deepcopy(model)
    opt = wl.make_optimizer(m.parameters())
    batches = wl.batches(rank, world, wl.batch_size, seed + 1000)
    _train(wl, m, opt, batches, 3, dev)  # warm-up: allocations, kernels chosen
    return _train(wl, m, opt, batches, steps, dev) / steps


def _configured(stella: Any, config: str) -> dict[str, Any]:
    """The StellaOptimizer keywords of a ``--configs`` name."""
    if config == "h1":
        # max_every = every: no round runs on to more local steps (by default one may, up to 4 H, while its
        # exchange is still in flight: a loaded CI machine's h1 run ended a round at H = 2)
        return {"sync": stella.Sync(every=1, max_every=1),
                "compression": stella.Compression(density=0.01, value_dtype="f16")}
    if config == "defaults":
        return {}  # the library's own: H, density and coding chosen by the controller
    if config == "auto":  # the defaults with the least H chosen by what a round costs (Sync(every="auto"))
        return {"sync": stella.Sync(every="auto")}
    if config == "h4":  # the defaults at H = 4: rounds a quarter as often, their fixed costs hidden behind 4 steps
        return {"sync": stella.Sync(every=4, max_every=4)}
    if config == "nobn":  # the defaults without BatchNoise: what its hooks and correction cost a step
        return {"batch_noise": None}
    if config == "fused":  # the defaults over a fused AdamW (its step count kept on the device; _worker builds it)
        return {}
    raise ValueError(f"unknown config {config!r} (h1, defaults, auto, h4, nobn, fused)")


def _worker(rank: int, world: int, address: str, keys: dict[str, str], steps: int, seed: int, device: str,
            config: str, q: Any, workload: str = "bytelm", cprofile: str | None = None) -> None:
    import torch

    import stella
    from bench import workloads as W

    if os.environ.get("STELLA_BENCH_LOG"):  # the library's decisions (the controller's, H's) on stderr
        import logging

        logging.basicConfig(level=logging.INFO, format=f"worker {rank} %(relativeCreated)6.0f ms %(message)s")
    torch.manual_seed(seed + rank)
    wl = W.get(workload)
    dev = torch.device(device)
    if dev.type == "cpu":  # the workers share the host's cores: torch's default (all of them each) oversubscribes
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    model = wl.build_model(seed).to(dev)
    # a short run (the tests') times 3 steps of its own compute after the warm-up; a real one a tenth of its steps
    compute = _own_compute(wl, model, rank, world, seed, max(10, steps // 10) if steps >= 100 else 3, dev)
    inner = wl.make_optimizer(model.parameters())
    if config == "fused":  # HF Trainer's adamw_torch_fused: one kernel a step, the step count a device tensor
        d = inner.defaults
        inner = torch.optim.AdamW(model.parameters(), lr=d["lr"], betas=d["betas"], eps=d["eps"],
                                  weight_decay=d["weight_decay"], fused=True)
    opt = stella.StellaOptimizer(model, address, optimizer=inner, connection=stella.Connection(**keys),
                                 **_configured(stella, config))
    opt.start()  # the registration before the clock
    batches = wl.batches(rank, world, wl.batch_size, seed)
    if cprofile and rank == 0:  # where the training thread's time goes (Python 3.12's profiler sees every thread)
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        wall = prof.runcall(_train, wl, model, opt, batches, steps, dev)
        text = io.StringIO()
        for key in ("tottime", "cumulative"):
            pstats.Stats(prof, stream=text).sort_stats(key).print_stats(45)
        with open(f"{cprofile}.{config}.txt", "w") as f:
            f.write(f"{config}: {steps} steps, {wall:.2f} s under cProfile\n{text.getvalue()}")
    else:
        wall = _train(wl, model, opt, batches, steps, dev)
    moved = {"bytes_pushed": opt.bytes_pushed, "bytes_pulled": opt.bytes_pulled}
    opt.close()  # pushes what is left and installs the last pull
    st = opt.stats
    q.put({"rank": rank, "wall_s": wall, "s_per_step": wall / steps, "compute_s_per_step": compute,
           "x_compute": wall / steps / compute, "heldout_loss": wl.evaluate(model.cpu()),
           **moved, "values_pushed": st.values_pushed, "values_pulled": st.values_pulled,
           "sync_every": st.sync_every, "density": st.density, "max_density": st.max_density,
           "value_dtype": st.value_dtype,
           # where a step's time beyond compute goes: blocked on the previous exchange and installing its answer
           # (the training thread), compressing (the exchange's thread)
           "rounds": st.rounds, "wait_s_per_step": st.wait_s / steps, "compress_s_per_step": st.compress_s / steps,
           "install_s_per_step": st.install_s / steps})


def dense(steps: int, seed: int, device: str, workload: str = "bytelm") -> dict[str, Any]:
    import torch

    from bench import workloads as W

    torch.manual_seed(seed)
    wl = W.get(workload)
    dev = torch.device(device)
    model = wl.build_model(seed).to(dev)
    opt = wl.make_optimizer(model.parameters())
    batches = wl.batches(0, 1, wl.batch_size, seed)
    wall = _train(wl, model, opt, batches, steps, dev)
    return {"wall_s": wall, "s_per_step": wall / steps, "heldout_loss": wl.evaluate(model.cpu())}


def stella_run(workers: int, steps: int, seed: int, device: str, config: str = "h1",
               workload: str = "bytelm", cprofile: str | None = None) -> dict[str, Any]:
    from stella_ps.process import ServerProcess

    ctx = mp.get_context("spawn")
    with ServerProcess(workers=workers) as ps:
        q = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(r, workers, ps.endpoint, ps.client_kwargs(), steps, seed, device,
                                                   config, q, workload, cprofile))
                 for r in range(workers)]
        for p in procs:
            p.start()
        res = [q.get(timeout=900) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        codes = [p.exitcode for p in procs]
    if any(c != 0 for c in codes):
        raise RuntimeError(f"worker exit codes {codes}")
    return {"config": config, "workers": sorted(res, key=lambda r: r["rank"])}


def compressor(shapes: dict[str, tuple[int, ...]], device: str, densities=(0.001, 0.01, 0.1),
               rounds: int = 6, big: int = 100_000_000) -> list[dict]:
    import torch

    from stella.compress import ErrorFeedbackCompressor

    dev = torch.device(device)
    out = []
    for label, sh in (("bytelm tensors", shapes), (f"one tensor of {big:,}", {"w": (big,)})):
        grads = {n: torch.randn(*s, device=dev) for n, s in sh.items()}
        numel = sum(g.numel() for g in grads.values())
        for d in densities:
            comp = ErrorFeedbackCompressor(density=d, value_dtype="f16")
            times = []
            for _ in range(rounds):
                _sync(dev)
                t0 = time.perf_counter()
                for n, g in grads.items():
                    comp.compress(n, g)
                _sync(dev)
                times.append(time.perf_counter() - t0)
            dt = statistics.median(times[1:])
            out.append({"tensors": label, "numel": numel, "density": d, "ms_per_round": 1e3 * dt,
                        "ns_per_coordinate": 1e9 * dt / numel})
        del grads
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--configs", default="h1,defaults",
                    help="Stella configurations to train, comma-separated: h1 (H = 1, 1%% f16), defaults (the "
                         "library's own), h4 (the defaults at H = 4), nobn (the defaults without BatchNoise), "
                         "fused (the defaults over a fused AdamW)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true", help="100 steps")
    ap.add_argument("--profile", help="write the GPU profile of the LM here")
    ap.add_argument("--flat", action="store_true", help="also the flat model's compressor, operations and round "
                                                           "(bench.flat) on the GPU")
    ap.add_argument("--compressor-only", action="store_true", help="only the compressor part (2.)")
    ap.add_argument("--cprofile", metavar="PREFIX", help="worker 0 of each configuration trains under cProfile (so "
                    "slower) and writes its top functions to PREFIX.CONFIG.txt")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # "cpu": a dry run of the code paths
    # the training part's model: bench.workloads' name (the dry run on a CPU takes "tinylm", the same LM at 0.12M)
    ap.add_argument("--workload", default="bytelm", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.quick:
        a.steps = min(a.steps, 100)
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench.cuda: no CUDA device here (torch.cuda.is_available() is False): nothing to measure")
        return 0
    from bench import workloads as W

    out: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "device": torch.cuda.get_device_name(0) if a.device == "cuda" else a.device,
                           "torch": torch.__version__,
                           "steps": a.steps, "workers": a.workers, "workload": a.workload}
    print(f"bench.cuda: {out['started']}, {out['device']}, torch {out['torch']}", flush=True)

    def save() -> None:  # after each part: a run cut short (a device lease's end) keeps what it measured
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)

    if not a.compressor_only:
        train(out, a)
        save()
    model = W.get("bytelm").build_model(0)
    out["compressor"] = compressor({n: tuple(p.shape) for n, p in model.named_parameters()}, a.device,
                                   big=100_000_000 if a.device == "cuda" else 1_000_000)
    print("| tensors | coordinates | density | ms per round | ns per coordinate |\n|---|---|---|---|---|")
    for r in out["compressor"]:
        print(f"| {r['tensors']} | {r['numel']:,} | {r['density']:.1%} | {r['ms_per_round']:.2f} | "
              f"{r['ns_per_coordinate']:.3f} |", flush=True)
    save()
    if a.flat:
        from bench import flat as F

        out["flat"] = F.device_rows(a.device, [0.01, 0.001], steps=10)
        F.print_tables(out["flat"])
        save()
    if a.profile and not a.compressor_only:
        profile(out, a)
    save()
    return 0 if out.get("passed", True) else 1


def train(out: dict[str, Any], a: argparse.Namespace) -> None:
    """Part 1 into ``out``: dense, then the Stella workers, and the check."""
    out["dense"] = dense(a.steps, a.seed, a.device, a.workload)
    print(f"dense, 1 process: held-out loss {out['dense']['heldout_loss']:.3f}, "
          f"{1e3 * out['dense']['s_per_step']:.1f} ms/step", flush=True)
    out["stella"] = [stella_run(a.workers, a.steps, a.seed, a.device, c, a.workload, a.cprofile)
                     for c in a.configs.split(",")]
    for run in out["stella"]:
        for w in run["workers"]:
            print(f"stella {run['config']} worker {w['rank']}: held-out loss {w['heldout_loss']:.3f}, "
                  f"{1e3 * w['s_per_step']:.1f} ms/step against its own compute {1e3 * w['compute_s_per_step']:.1f} "
                  f"({w['x_compute']:.2f}x; last round H = {w['sync_every']}, {w['density']:.2%} {w['value_dtype']}, "
                  f"at most {w['max_density']:.2%}), "
                  f"{w['bytes_pushed'] / 1e6:.1f} MB pushed, {w['bytes_pulled'] / 1e6:.1f} MB pulled; "
                  f"{w['rounds']} rounds, a step waited {1e3 * w['wait_s_per_step']:.1f} ms, installed "
                  f"{1e3 * w['install_s_per_step']:.1f} ms and compressed {1e3 * w['compress_s_per_step']:.1f} ms "
                  f"(the exchange's thread)", flush=True)
    worst = max(w["heldout_loss"] for run in out["stella"] for w in run["workers"])
    out["passed"] = worst <= TARGET_REL * out["dense"]["heldout_loss"]
    print(f"training check: worst Stella worker {worst:.3f} against dense {out['dense']['heldout_loss']:.3f} "
          f"(pass within {100 * (TARGET_REL - 1):.0f}%): {'PASS' if out['passed'] else 'FAIL'}", flush=True)


def profile(out: dict[str, Any], a: argparse.Namespace) -> None:
    """Part 3 into ``out``: the LM's GPU profile, written to ``a.profile``."""
    import torch

    from bench import workloads as W
    from stella.planning.measure import profile_model
    from stella.planning.profile_file import write_profile

    wl = W.get("bytelm")
    dev = torch.device(a.device)
    m = wl.build_model(0).to(dev)
    batches = wl.batches(0, 1, wl.batch_size, 0)
    doc = profile_model(m, wl.loss, lambda: tuple(t.to(dev) for t in next(batches)),
                        optimizer=wl.make_optimizer(m.parameters()), batch_size=wl.batch_size, name="bytelm",
                        log=print)
    write_profile(a.profile, doc)
    out["profile"] = {k: doc.get(k) for k in ("device", "compute_s", "compress_s_per_numel", "server")}
    print(f"profile: {a.profile}: compute {1e3 * doc['compute_s']:.2f} ms/step on {doc.get('device')}")


if __name__ == "__main__":
    sys.exit(main())
