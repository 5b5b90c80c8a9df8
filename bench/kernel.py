"""Benchmark of the lazy sparse optimizer kernel against what a torch user would write.

    python -m bench.kernel [--quick] [--json PATH] [--explore]

For each (optimizer, params, density, workers): the stella C kernel with 1 and 2
threads, and (several workers) on one thread with each step's pushes merged into
one before the clock starts (``stella_merged``: the update without the merge, so
the two rows split the kernel's time between them); the same lazy semantics as
vectorised torch ops (merge by cat + unique + index_add_, update by index_select /
index_copy_); and a dense torch optimizer step over the whole tensor. ``density`` is
each worker's push density; pushes are random sorted unique index sets, independent
per worker (so they overlap), and ``updates/s`` counts coordinate updates (the union
of the pushes) per second for every implementation; every timed apply gets fresh pushes and the best rep is
shown (``cpu``: per CPU second of the process). A STREAM-style triad gives this
machine's one-core bandwidth; ``B/upd`` models the DRAM bytes an update moves in
each implementation's layout, ``%bw`` is the resulting share of the triad
bandwidth, and ``floor`` times the cheapest possible random read-modify-write of
the case's touched lines (a C probe), i.e. the update rate if updates were free.
``--explore`` measures the prefetch/tile/huge-page choices of the kernel
(docs/optimizer.md).

The probe and the tuning knobs live in the bench-only build of the kernel
(``bench/_native_bench.py``, compiled into ``build/`` on first use); ``--explore``
runs on it, the main table on the production ``stella_ps.kernel``.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import numpy as np
import torch

from bench import _native_bench
from bench.harness import loadavg
from stella_ps import kernel
from stella_ps.aggregation import count_table
from stella_ps.kernel import KernelTensorState
from stella_ps.optim import OptimizerConfig

LINE = 64
IMPLS = ("stella", "torch_sparse", "torch_dense")  # what run_case measures: the kernel and two torch baselines
F32 = np.float32


def triad_gbps(n: int = 50_000_000, reps: int = 5) -> float:
    """STREAM triad a = b + s*c on one core, float32; bytes counted as STREAM does (3 per element)."""
    torch.set_num_threads(1)
    b = torch.rand(n)
    c = torch.rand(n)
    a = torch.empty(n)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        best = min(best, time.perf_counter() - t)
    return 3 * 4 * n / best / 1e9


def random_sorted(rng: np.random.Generator, numel: int, density: float) -> np.ndarray:
    """Bernoulli(density) subset of range(numel), sorted, drawn through geometric gaps."""
    if density >= 1.0:
        return np.arange(numel, dtype=np.int32)
    m = int(numel * density * 1.2 + 100)
    idx = np.cumsum(rng.geometric(density, m).astype(np.int64)) - 1
    while idx[-1] < numel:  # rare: draw more gaps
        more = np.cumsum(rng.geometric(density, m).astype(np.int64)) + idx[-1]
        idx = np.concatenate([idx, more])
    return idx[idx < numel].astype(np.int32)


def make_pushes(rng, numel, density, workers):
    return [(i := random_sorted(rng, numel, density), rng.standard_normal(i.shape[0]).astype(F32))
            for _ in range(workers)]


def premerge(pushes):
    """The pushes of one step as one push: their union, values summed."""
    union, inv = np.unique(np.concatenate([i for i, _ in pushes]), return_inverse=True)
    vals = np.zeros(union.shape[0], F32)
    np.add.at(vals, inv, np.concatenate([v for _, v in pushes]))
    return union.astype(np.int32), vals


def config(name: str) -> OptimizerConfig:
    if name == "sgd":
        return OptimizerConfig.from_wire({"name": "sgd", "lr": 0.01, "momentum": 0.9})
    return OptimizerConfig.from_wire({"name": "adamw", "lr": 1e-3, "weight_decay": 0.01})


# ----------------------------------------------------------------- torch baselines

class TorchLazy:
    """Lazy SGD-momentum / AdamW as a torch user writes it: gather, update, scatter."""

    def __init__(self, init: torch.Tensor, cfg: OptimizerConfig):
        self.cfg = cfg
        self.p = init.clone()
        if cfg.name == "sgd":
            self.buf = torch.zeros_like(self.p)
        else:
            self.m = torch.zeros_like(self.p)
            self.v = torch.zeros_like(self.p)
            self.step = torch.zeros_like(self.p, dtype=torch.int32)

    def apply(self, pushes, scale: float) -> torch.Tensor:
        h = self.cfg.hparams
        idx = torch.cat([i for i, _ in pushes]).long()
        vals = torch.cat([v for _, v in pushes])
        u, inv = torch.unique(idx, sorted=True, return_inverse=True)
        g = torch.zeros(u.shape[0]).index_add_(0, inv, vals).mul_(scale)
        p = self.p.index_select(0, u)
        if self.cfg.name == "sgd":
            buf = self.buf.index_select(0, u).mul_(h["momentum"]).add_(g, alpha=1 - h["dampening"])
            self.buf.index_copy_(0, u, buf)
            self.p.index_copy_(0, u, p.sub_(buf, alpha=h["lr"]))
            return u
        b1, b2 = h["betas"]
        k = self.step.index_select(0, u).add_(1)
        self.step.index_copy_(0, u, k)
        p.mul_(1 - h["lr"] * h["weight_decay"])
        m = self.m.index_select(0, u).mul_(b1).add_(g, alpha=1 - b1)
        v = self.v.index_select(0, u).mul_(b2).addcmul_(g, g, value=1 - b2)
        self.m.index_copy_(0, u, m)
        self.v.index_copy_(0, u, v)
        kf = k.to(torch.float64)
        step_size = (h["lr"] / (1 - torch.pow(b1, kf))).to(torch.float32)
        bc2 = torch.sqrt(1 - torch.pow(b2, kf)).to(torch.float32)
        denom = v.sqrt_().div_(bc2).add_(h["eps"])
        p.sub_(step_size * (m / denom))
        self.p.index_copy_(0, u, p)
        return u


def torch_dense_step(init: torch.Tensor, cfg: OptimizerConfig, union: np.ndarray, g: np.ndarray):
    """A dense torch.optim step (default foreach implementation) with the merged gradient."""
    p = torch.nn.Parameter(init.clone())
    p.grad = torch.zeros_like(p)
    p.grad[torch.from_numpy(union)] = torch.from_numpy(g)
    h = cfg.hparams
    opt: torch.optim.Optimizer
    if cfg.name == "sgd":
        opt = torch.optim.SGD([p], lr=h["lr"], momentum=h["momentum"])
    else:
        opt = torch.optim.AdamW([p], lr=h["lr"], betas=h["betas"], eps=h["eps"], weight_decay=h["weight_decay"])
    return opt, p


# ----------------------------------------------------------------- bytes model

def lines_touched(union: np.ndarray, record_bytes: int) -> int:
    """Distinct cache lines holding the union's records in one array of record_bytes per coordinate."""
    if union.shape[0] == 0:
        return 0
    lines = union.astype(np.int64) * record_bytes // LINE
    return int(1 + np.count_nonzero(np.diff(lines)))


def bytes_per_update(impl: str, name: str, union: np.ndarray, pushes, numel: int) -> float:
    """DRAM bytes per coordinate update: state lines read + written back, push streams read,
    touched indices written (dense: whole arrays streamed)."""
    n = max(union.shape[0], 1)
    fields = 2 if name == "sgd" else 4
    stream = sum(i.nbytes + v.nbytes for i, v in pushes) + 4 * n
    if impl.startswith("stella"):
        state = 2 * LINE * lines_touched(union, 4 * fields)
    elif impl == "torch_sparse":  # one array per field, plus merge temporaries (~6 x 4 B per pushed entry)
        state = 2 * LINE * fields * lines_touched(union, 4)
        stream += 6 * 4 * sum(i.shape[0] for i, _ in pushes)
    else:  # dense: read p, grad and state, write p and state
        state = numel * (20 if name == "sgd" else 28)  # SGD: p, grad, buf in + p, buf out; AdamW: 4 in, 3 out
    return (state + stream) / n


# ----------------------------------------------------------------- driver

def timed(fn):
    """(wall seconds, CPU seconds of this process, result)."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - t0, time.process_time() - c0, out


_floor_buf: dict[tuple[int, int], np.ndarray] = {}


def rmw_floor(numel: int, record_floats: int, union: np.ndarray, reps: int) -> float:
    """Random read-modify-write of one float per touched record (C loop, prefetched):
    coordinate updates per second if the update itself were free."""
    key = (numel, record_floats)
    if key not in _floor_buf:
        _floor_buf.clear()
        _floor_buf[key] = np.ones(numel * record_floats, F32)  # pages touched: no faults while timed
    buf = _floor_buf[key]
    best = 0.0
    for _ in range(reps):
        wall, _, _ = timed(lambda: _native_bench.probe_random_rmw(buf, union, record_floats, 16))
        best = max(best, union.shape[0] / wall)
    return best


def run_case(rows, name, numel, density, workers, bw, reps, torch_reps=2, seed=0,
             impls=IMPLS):
    """Every timed apply gets a fresh push set (as in training, where the touched lines
    change every step); the best rep is reported."""
    rng = np.random.default_rng(seed)
    cfg = config(name)
    sets = [make_pushes(rng, numel, density, workers) for _ in range(reps + 1)]
    init = rng.standard_normal(numel).astype(F32)
    scale = 1.0 / workers
    union = np.unique(np.concatenate([i for i, _ in sets[0]]))
    record = 2 if name == "sgd" else 4
    floor = rmw_floor(numel, record, union.astype(np.int32), 10)

    def row(impl, threads, best):
        (ups, ups_cpu, union_, pushes) = best
        u = union_.shape[0]
        bpu = bytes_per_update(impl, name, union_, pushes, numel)
        r = {"optimizer": name if name != "sgd" else "sgd_momentum", "params": numel, "density": density,
             "workers": workers, "impl": impl, "threads": threads, "union": u, "step_ms": u / ups * 1e3,
             "updates_per_s": ups, "updates_per_cpu_s": ups_cpu, "bytes_per_update": bpu, "triad_gbps": bw,
             "bw_fraction": ups * bpu / (bw * 1e9), "rmw_floor_updates_per_s": floor,
             "floor_fraction": ups / floor, "loadavg": loadavg()}
        rows.append(r)
        print_row(r)

    def run(apply_fn, n_reps):
        apply_fn(sets[0])  # warm-up (allocations, first touch)
        best: tuple[float, float, Any, Any] = (0.0, 0.0, None, None)
        for pushes in sets[1:1 + n_reps]:
            wall, cpu, u = timed(lambda pushes=pushes: apply_fn(pushes))
            u = np.asarray(u)
            best = (max(best[0], u.shape[0] / wall), max(best[1], u.shape[0] / max(cpu, 1e-9)),
                    u if best[2] is None else best[2], pushes if best[3] is None else best[3])
        return best

    if "stella" in impls:
        st = KernelTensorState(init, cfg)
        for threads in (1, 2):
            kernel.set_num_threads(threads)
            row("stella", threads, run(lambda p: st.apply(p, scale, cfg), reps))
        kernel.set_num_threads(1)
        if workers > 1:  # update mode's "count" outer step: each sum scaled by the pushes that carried it
            cs = count_table(workers, 0.5, scale)
            row("stella_count", 1, run(lambda p: st.apply(p, scale, cfg, count_scale=cs), reps))
        if workers > 1:  # the same steps as one push each, merged before the clock starts
            merged = {id(p): [premerge(p)] for p in sets}
            row("stella_merged", 1, run(lambda p: st.apply(merged[id(p)], scale, cfg), reps))
            del merged
        del st
    torch.set_num_threads(1)
    if "torch_sparse" in impls:
        tl = TorchLazy(torch.from_numpy(init), cfg)
        tsets = {id(p): [(torch.from_numpy(i), torch.from_numpy(v)) for i, v in p] for p in sets}
        row("torch_sparse", 1, run(lambda p: tl.apply(tsets[id(p)], scale).numpy(), torch_reps))
        del tl, tsets
    if "torch_dense" in impls:
        g = np.zeros(union.shape[0], F32)  # values do not change the cost of a dense step
        opt, p = torch_dense_step(torch.from_numpy(init), cfg, union, g)
        row("torch_dense", 1, run(lambda _: (opt.step(), union)[1], torch_reps))
        del opt, p


HEADER = (f"{'optimizer':<13}{'params':>7}{'dens':>7}{'W':>3} {'impl':<13}{'thr':>3}{'union':>10}"
          f"{'ms/step':>10}{'Mupd/s':>9}{'cpu':>7}{'B/upd':>7}{'%bw':>6}{'floor':>7}{'%fl':>5}")


def print_row(r):
    extra = "".join(f" {k}={r[k]}" for k in ("hugepages", "prefetch", "prefetch_kind", "tile") if k in r)
    floor = f"{r['rmw_floor_updates_per_s'] / 1e6:>7.1f}{100 * r['floor_fraction']:>4.0f}%" \
        if "rmw_floor_updates_per_s" in r else ""
    print(f"{r['optimizer']:<13}{r['params'] // 10**6:>6}M{r['density'] * 100:>6.1f}%{r['workers']:>3} "
          f"{r['impl']:<13}{r['threads']:>3}{r['union']:>10}{r['step_ms']:>10.2f}"
          f"{r['updates_per_s'] / 1e6:>9.1f}{r.get('updates_per_cpu_s', 0) / 1e6:>7.1f}"
          f"{r['bytes_per_update']:>7.0f}{100 * r['bw_fraction']:>5.0f}%{floor}{extra}", flush=True)


EXPLORE_VARIANTS = [  # (hugepages, prefetch distance, prefetch kind (set_tuning mode), tile)
    (True, 0, 0, 512),
    (True, 8, 0, 512),
    (True, 16, 0, 512),
    (True, 32, 0, 512),
    (True, 16, 1, 512),
    (True, 32, 1, 512),
    (True, 64, 1, 512),
    (True, 32, 1, 128),
    (True, 32, 1, 2048),
    (False, 32, 1, 512),
]


def explore(rows, numel, bw, reps, names=("adamw", "sgd"), density=0.01, variants=EXPLORE_VARIANTS):
    """Huge pages, prefetch distance/kind/tile of the kernel, one thread, interleaved in time.

    Variants take turns (rep by rep) and every apply gets a fresh push set, so drifting
    load from other processes and cache reuse between reps hit every variant alike.
    The best rep of each variant is reported (wall clock and CPU time).
    """
    kernel.set_num_threads(1)
    TunableState = _native_bench.state_class()
    for name in names:
        rng = np.random.default_rng(0)
        cfg = config(name)
        init = rng.standard_normal(numel).astype(F32)
        states = {}
        for huge, *_ in variants:
            if huge not in states:
                states[huge] = TunableState(init, cfg, hugepages=huge)
        for st_ in states.values():
            st_.apply(make_pushes(rng, numel, density, 4), 0.25, cfg)
        best: dict[Any, tuple[float, float, Any]] = dict.fromkeys(variants, (0.0, 0.0, None))
        for rep in range(reps):
            order = variants[rep % len(variants):] + variants[:rep % len(variants)]
            for v in order:
                huge, pd, mode, tile = v
                pushes = make_pushes(rng, numel, density, 4)
                _native_bench.set_tuning(pd, tile, mode)
                st_ = states[huge]
                t0, c0 = time.perf_counter(), time.process_time()
                union = st_.apply(pushes, 0.25, cfg)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                w, c, _ = best[v]
                best[v] = (max(w, union.shape[0] / wall), max(c, union.shape[0] / cpu), (union, pushes))
        for v in variants:
            huge, pd, mode, tile = v
            ups, ups_cpu, (union, pushes) = best[v]
            u = union.shape[0]
            rec = 4 * (2 if name == "sgd" else 4)
            state = 2 * LINE * lines_touched(union, rec)
            bpu = (state + sum(i.nbytes + v_.nbytes for i, v_ in pushes) + 4 * u) / u
            r = {"optimizer": name if name != "sgd" else "sgd_momentum", "params": numel,
                 "density": density, "workers": 4, "impl": "stella", "threads": 1, "union": u,
                 "step_ms": u / ups * 1e3, "updates_per_s": ups, "updates_per_cpu_s": ups_cpu,
                 "bytes_per_update": bpu, "triad_gbps": bw, "bw_fraction": ups * bpu / (bw * 1e9),
                 "loadavg": loadavg(), "hugepages": huge, "prefetch": pd,
                 "prefetch_kind": ["prefetchw-L1", "prefetcht1-L2", "prefetchw-L1+merge", "prefetcht1-L2+merge"][mode],
                 "tile": tile}
            rows.append(r)
            print_row(r)
        del states
    _native_bench.set_tuning(*_native_bench.default_tuning())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10M parameters, fewer cases (under a minute)")
    ap.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    ap.add_argument("--explore", action="store_true", help="prefetch / tile / huge-page measurements")
    ap.add_argument("--params", type=int, nargs="*", help="override the parameter counts")
    ap.add_argument("--optimizers", nargs="*", choices=["sgd", "adamw"], help="only these optimizers")
    ap.add_argument("--densities", type=float, nargs="*", help="override the per-worker densities")
    ap.add_argument("--workers", type=int, nargs="*", help="override the worker counts")
    ap.add_argument("--reps", type=int, help="timed reps per stella case (torch: a third of it)")
    ap.add_argument("--impls", nargs="*", choices=IMPLS,
                    help="only these implementations (default: all three)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    bw = triad_gbps(20_000_000 if args.quick else 50_000_000)
    print(f"# cpu={os.cpu_count()} loadavg={loadavg()} triad(1 core)={bw:.1f} GB/s torch={torch.__version__}")
    print(HEADER)
    rows: list[dict] = []
    if args.explore:
        explore(rows, (args.params or [100_000_000])[0], bw, 3 if args.quick else 5)
    else:
        sizes = args.params or ([10_000_000] if args.quick else [10_000_000, 100_000_000])
        densities = args.densities or ((0.01,) if args.quick else (0.001, 0.01, 0.1))
        for numel in sizes:
            reps = args.reps or (3 if numel >= 50_000_000 or args.quick else 5)
            torch_reps = max(1, reps // 3) if args.reps else (1 if numel >= 50_000_000 or args.quick else 2)
            for name in args.optimizers or ("sgd", "adamw"):
                for density in densities:
                    for workers in args.workers or (1, 4):
                        if args.quick and density > 0.05:
                            continue
                        run_case(rows, name, numel, density, workers, bw, reps, torch_reps,
                                 impls=tuple(args.impls or IMPLS))
    print(f"# loadavg at end: {loadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
