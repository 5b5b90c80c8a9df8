"""Top-k selection with error feedback, and wire coding: speed, count, quality, bytes.

    python -m bench.compress [--quick] [--json PATH] [--threads N] [--cuda/--no-cuda]
    python -m bench.compress --workload bytelm [--steps 30] [--densities 0.01,0.001]

For each tensor size and density, on gradient-like data (a persistent normal
component plus heavy-tailed noise, seeded, fresh noise every step), each
selection method of :class:`stella.compress.ErrorFeedbackCompressor` runs a few
warm-up steps, then timed steps (median reported; the residual carries over,
as in training). ``torch.topk`` on ``|acc|`` of the same accumulated tensor is
timed in the same run. Quality, on the last step: selected count / k, and the
fraction of the exact top-k's squared magnitude (of the same ``acc``) that the
selection captured (counting at most the k largest sent values); per timed call, the
threshold estimates from a sample and the passes over the tensor (native backend).
Wire: bytes per (index, value) pair of the selected set for every index coding x
value dtype, with encode and decode times.

``--workload NAME`` runs only the compressors on the gradients of a bench.workloads
model (e.g. ``bytelm``, the 10.8M-parameter byte-level Transformer with AdamW) trained
locally, every method and density on the same gradients each step: ms a step for the
whole model, and estimates and passes per call.

One CPU thread by default (``torch.set_num_threads(1)``; the C kernels are
single-threaded). Figures are noisy on a shared machine: the table header
prints the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

from stella import codec
from stella.compress import ErrorFeedbackCompressor

METHODS = ("threshold", "block", "exact")


def _gen_grad(n: int, mean: torch.Tensor, gen: torch.Generator, device) -> torch.Tensor:
    noise = torch.randn(n, generator=gen)
    noise.mul_(torch.rand(n, generator=gen).pow_(3))
    noise.add_(mean)
    return noise.to(device)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_topk(acc: torch.Tensor, k: int, reps: int) -> float:
    ts = []
    for _ in range(reps):
        _sync(acc.device)
        t = time.perf_counter()
        v, i = torch.topk(acc.abs(), k, sorted=False)
        _sync(acc.device)
        ts.append(time.perf_counter() - t)
        del v, i
    return min(ts)


def _count_call(tot: dict[str, int], stats: dict[str, int] | None) -> None:
    """Adds one selection's counters (``select_stats``: None off the native backend, or
    for a tensor that went whole) to ``tot``."""
    if stats is not None:
        tot["calls"] = tot.get("calls", 0) + 1
        for name in ("estimates", "passes"):
            tot[name] = tot.get(name, 0) + stats[name]


def _per_call(tot: dict[str, int]) -> dict[str, float | None]:
    """The row fields of :func:`_count_call`'s totals: estimates and passes a call."""
    calls = tot.get("calls", 0)
    return {f"{name}_per_call": tot[name] / calls if calls else None for name in ("estimates", "passes")}


def run_config(n, density, device, warmup, steps, topk_reps, seed=0, methods=METHODS):
    rows = []
    gen = torch.Generator().manual_seed(seed)
    mean = torch.randn(n, generator=gen).mul_(0.1)
    k = max(1, round(density * n))
    topk_s = None
    for method in methods:
        backend = "auto" if device.type == "cpu" else "torch"
        comp = ErrorFeedbackCompressor(density=density, method=method, backend=backend,
                                       dense_below=0)
        times = []
        gen_m = torch.Generator().manual_seed(seed + 1)  # same gradients for every method
        # the exact method is slow: fewer steps (its quality is the reference)
        w, s = (1, 1) if method == "exact" else (warmup, steps)
        sg = acc = None
        counts: dict[str, int] = {}  # selection counters over the timed steps (native backend)
        for step in range(w + s):
            g = _gen_grad(n, mean, gen_m, device)
            last = step == w + s - 1
            if last:
                seen = comp.keys()  # (a list: the compressor has no __contains__)
                res = comp.residual("w").reshape(-1) if "w" in seen else torch.zeros_like(g)
                acc = res + g
            _sync(device)
            t = time.perf_counter()
            sg = comp.compress("w", g)
            _sync(device)
            if step >= w:
                times.append(time.perf_counter() - t)
                _count_call(counts, comp.select_stats("w"))
            del g
        assert acc is not None and sg is not None  # the last step set them
        if topk_s is None:
            topk_s = _time_topk(acc, k, topk_reps)
        exact_sq = float(torch.topk(acc.abs(), k, sorted=False).values.double().square().sum())
        # the k largest of what was sent (a selection of more than k could
        # otherwise "capture" more than the exact top-k)
        sq = np.square(sg.values.astype(np.float64))
        if sq.size > k:
            sq = np.partition(sq, sq.size - k)[sq.size - k:]
        got_sq = float(sq.sum())
        med = statistics.median(times)
        row = dict(
            kind="select", device=str(device), n=n, density=density, k=k, method=method,
            ms=med * 1e3, ms_min=min(times) * 1e3, steps=len(times), topk_ms=topk_s * 1e3,
            speedup_vs_topk=topk_s / med, count_over_k=sg.count / k,
            captured=got_sq / exact_sq if exact_sq > 0 else 1.0,
            **_per_call(counts),
        )
        if device.type == "cpu" and method != "exact":
            row["last_call"] = comp.select_stats("w")
        rows.append(row)
        if method in ("threshold", "block"):
            rows.extend(wire_rows(sg, n, density, method, str(device)))
        del acc, comp
    return rows


def wire_rows(sg, n, density, method, device):
    rows = []
    idx, val = sg.indices, sg.values
    for coding in codec.INDEX_CODINGS:
        t = time.perf_counter()
        try:
            enc = codec.encode_indices(idx, n, coding)
        except ValueError:  # block16 needs whole blocks
            continue
        enc_s = time.perf_counter() - t
        t = time.perf_counter()
        codec.decode_indices(enc, idx.size, n, coding)
        dec_s = time.perf_counter() - t  # round trips are tests/test_codec.py's to prove
        for dtype in codec.VALUE_DTYPES:
            t = time.perf_counter()
            ev = codec.encode_values(val, dtype)
            venc = time.perf_counter() - t
            t = time.perf_counter()
            codec.decode_values(ev, val.size, dtype)
            vdec = time.perf_counter() - t
            rows.append(dict(
                kind="wire", device=device, n=n, density=density, method=method, coding=coding,
                dtype=dtype, pairs=int(idx.size),
                bytes_per_pair=(enc.size + ev.size) / max(1, idx.size),
                index_bits=8 * enc.size / max(1, idx.size),
                idx_enc_ms=enc_s * 1e3, idx_dec_ms=dec_s * 1e3,
                val_enc_ms=venc * 1e3, val_dec_ms=vdec * 1e3,
            ))
    return rows


def run_workload(name: str, densities, warmup: int, steps: int, seed: int = 0) -> list[dict]:
    """The compressors on a training run's own gradients: ``bench.workloads``' model
    ``name`` trained locally with its optimizer, and every step each (method, density)
    compressor (``ErrorFeedbackCompressor``, native backend) compresses every parameter's
    gradient, as a worker's gradient exchange does. Per (method, density): ms a step for
    the whole model after ``warmup`` steps, and threshold estimates and passes per call
    of the tensors selected from (the small ones go whole)."""
    from bench import workloads

    wl = workloads.get(name)
    model = wl.build_model(seed)
    opt = wl.make_optimizer(model.parameters())
    batches = wl.batches(0, 1, wl.batch_size, seed)
    comps = {(m, d): ErrorFeedbackCompressor(density=d, method=m, backend="native")
             for m in ("threshold", "block") for d in densities}
    seconds = dict.fromkeys(comps, 0.0)
    totals: dict[tuple[str, float], dict[str, int]] = {key: {} for key in comps}
    params = list(model.named_parameters())
    for step in range(warmup + steps):
        wl.set_lr(opt, step)
        opt.zero_grad()
        wl.loss(model, next(batches)).backward()
        for key, comp in comps.items():
            t = time.perf_counter()
            for pname, prm in params:
                comp.compress(pname, prm.grad)
            if step < warmup:
                continue
            seconds[key] += time.perf_counter() - t
            for pname, _ in params:
                _count_call(totals[key], comp.select_stats(pname))
        opt.step()
    numel = sum(p.numel() for _, p in params)
    return [dict(kind="workload", workload=name, params=numel, tensors=len(params), method=m, density=d,
                 steps=steps, ms_per_step=1e3 * seconds[m, d] / steps, **_per_call(t))
            for (m, d), t in totals.items()]


def _calls_columns(r: dict) -> str:
    """A row's estimates and passes a call, or nothing when it has none."""
    if r.get("estimates_per_call") is None:
        return ""
    return f" {r['estimates_per_call']:9.2f} {r['passes_per_call']:6.2f}"


def print_tables(rows, out=sys.stdout):
    work = [r for r in rows if r["kind"] == "workload"]
    if work:
        print(f"{'workload':9} {'params':>11} {'tensors':>7} {'dens':>6} {'method':9} {'ms/step':>8} "
              f"{'estimates':>9} {'passes':>6}", file=out)
        for r in work:
            print(f"{r['workload']:9} {r['params']:>11,} {r['tensors']:>7} {r['density']:>6.3%} {r['method']:9} "
                  f"{r['ms_per_step']:8.2f}{_calls_columns(r)}", file=out)
        print(file=out)
    sel = [r for r in rows if r["kind"] == "select"]
    if not sel:
        return
    print(f"{'device':6} {'n':>11} {'dens':>6} {'method':9} {'ms':>8} {'min ms':>8} "
          f"{'topk ms':>9} {'x topk':>7} {'cnt/k':>6} {'captured':>8} {'estimates':>9} {'passes':>6}", file=out)
    for r in sel:
        print(f"{r['device']:6} {r['n']:>11,} {r['density']:>6.3%} {r['method']:9} {r['ms']:8.2f} "
              f"{r['ms_min']:8.2f} {r['topk_ms']:9.1f} {r['speedup_vs_topk']:7.1f} "
              f"{r['count_over_k']:6.3f} {r['captured']:8.4f}{_calls_columns(r)}", file=out)
    wire = [r for r in rows if r["kind"] == "wire"]
    if not wire:
        return
    print(file=out)
    print(f"{'device':6} {'n':>11} {'dens':>6} {'method':9} {'coding':9} "
          + " ".join(f"{d + ' B/pair':>12}" for d in codec.VALUE_DTYPES)
          + f" {'idx bits':>9} {'enc ms':>7} {'dec ms':>7}", file=out)
    keys = []
    for r in wire:
        key = (r["device"], r["n"], r["density"], r["method"], r["coding"])
        if key not in keys:
            keys.append(key)
    for key in keys:
        rs = {r["dtype"]: r for r in wire
              if (r["device"], r["n"], r["density"], r["method"], r["coding"]) == key}
        any_r = next(iter(rs.values()))
        print(f"{key[0]:6} {key[1]:>11,} {key[2]:>6.3%} {key[3]:9} {key[4]:9} "
              + " ".join(f"{rs[d]['bytes_per_pair']:12.3f}" for d in codec.VALUE_DTYPES)
              + f" {any_r['index_bits']:9.2f} {any_r['idx_enc_ms']:7.2f} {any_r['idx_dec_ms']:7.2f}",
              file=out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="small run (under a minute): 1M at 1%% and 0.1%%, 25M at 1%% without 'exact'")
    ap.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--sizes", type=str, default=None, help="comma-separated sizes, e.g. 1e6,25e6")
    ap.add_argument("--densities", type=str, default=None, help="comma-separated, e.g. 0.01,0.001")
    ap.add_argument("--workload", metavar="NAME",
                    help="only the compressors on the gradients of a bench.workloads model (e.g. bytelm) "
                         "trained locally: ms a step for the whole model")
    ap.add_argument("--steps", type=int, default=30, help="--workload's timed steps (after 10 warm-up)")
    ap.add_argument("--cuda", dest="cuda", action="store_true", default=None)
    ap.add_argument("--no-cuda", dest="cuda", action="store_false")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        sizes, dens, warmup, steps, reps = [1_000_000, 25_000_000], [0.01, 0.001], 2, 3, 1
    else:
        sizes, dens, warmup, steps, reps = [1_000_000, 25_000_000, 100_000_000], [0.01, 0.001], 3, 5, 2
    if args.sizes:
        sizes = [int(float(s)) for s in args.sizes.split(",")]
    if args.densities:
        dens = [float(d) for d in args.densities.split(",")]
    devices = [torch.device("cpu")]
    use_cuda = torch.cuda.is_available() if args.cuda is None else args.cuda
    if use_cuda:
        devices.append(torch.device("cuda"))
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"# bench.compress  {platform.processor() or platform.machine()}  cpus={os.cpu_count()}  "
          f"torch={torch.__version__} threads={torch.get_num_threads()}  "
          f"loadavg={load[0]:.2f},{load[1]:.2f},{load[2]:.2f}"
          + (f"  cuda={torch.cuda.get_device_name()}" if use_cuda else ""))
    rows = []
    t0 = time.perf_counter()
    if args.workload:
        rows.extend(run_workload(args.workload, dens, 10, args.steps))
        devices = []
    for dev in devices:
        for n in sizes:
            for d in dens:
                # --quick: tensors over 1M only at the first density, and without the
                # exact method (slow; torch.topk is timed anyway)
                if args.quick and n > 1_000_000 and d != dens[0]:
                    continue
                methods = METHODS if not args.quick or n <= 1_000_000 else METHODS[:2]
                rows.extend(run_config(n, d, dev, warmup, steps, reps, methods=methods))
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print_tables(rows)
    print(f"# {time.perf_counter() - t0:.1f} s; loadavg after: {load[0]:.2f},{load[1]:.2f},{load[2]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
