"""``python -m bench.pipeline``: does the one-step-stale pipeline hide communication?

On loopback with a real ``stella-ps`` and two worker processes, time per iteration of
a model whose dense gradient has >= 10M parameters, in one run:

- ``compute``: forward + backward only (no Stella);
- ``sync``: push, wait for the step, pull and install inside ``step()`` (staleness 0);
- ``pipeline``: the one-step-stale pipeline (staleness 1);

Goal: ``pipeline`` within 1.15x of ``compute``. Table on stdout, ``--json PATH``.
Every worker uses one torch thread, so the two workers occupy this machine's two
cores; the server, compression and pulls compete with compute for them, which a
real deployment (server on its own host, GPU compute) does not have.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import statistics
import time

from stella.demo import build_mlp
from stella_ps.process import ServerProcess


def build(width: int, depth: int, seed: int = 0):
    """MLP 512 - ``width`` x ``depth`` - 10."""
    return build_mlp((512, *[width] * depth, 10), seed)


def _worker(mode: str, address: str | None, rank: int, args, out, keys: dict) -> None:
    import torch

    from stella import Compression, Connection, StellaOptimizer, Sync

    torch.set_num_threads(1)
    model = build(args.width, args.depth)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 512, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)
    opt = None
    if mode != "compute":
        opt = StellaOptimizer(model, address, mode="gradient", optimizer={"name": "sgd", "lr": 0.01, "momentum": 0.9},
                              compression=Compression(density=args.density, value_dtype=args.value_dtype,
                                                      index_coding=args.index_coding),
                              sync=Sync(staleness=0 if mode == "sync" else 1),
                              connection=Connection(timeout=120, **keys))
    times = []
    b0 = (0, 0)
    for it in range(args.warmup + args.iters):
        if opt is not None and it == args.warmup:
            opt.synchronize()
            b0 = (opt.client.bytes_pushed, opt.client.bytes_pulled)
            s0 = (opt.stats.wait_s, opt.stats.compress_s, opt.stats.exchange_s, opt.stats.iterations)
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if opt is not None:
            opt.step()
        if it >= args.warmup:
            times.append(time.perf_counter() - t0)
    res = {"rank": rank, "times": times}
    if opt is not None:
        s = opt.stats
        res.update(wait_s=s.wait_s - s0[0], compress_s=s.compress_s - s0[1], exchange_s=s.exchange_s - s0[2],
                   iterations=s.iterations - s0[3], bytes_pushed=opt.client.bytes_pushed - b0[0],
                   bytes_pulled=opt.client.bytes_pulled - b0[1])
        opt.close(flush=False)
    out.put(res)


def run_mode(mode: str, args) -> dict:
    ps = None if mode == "compute" else ServerProcess(args.workers, log_level="WARNING")
    address = ps.endpoint if ps is not None else None
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    keys = ps.client_kwargs() if ps is not None else {}
    procs = [ctx.Process(target=_worker, args=(mode, address, r, args, q, keys)) for r in range(args.workers)]
    try:
        for p in procs:
            p.start()
        results = [q.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        if ps is not None:
            ps.close()
    per_rank = [statistics.median(r["times"]) for r in results]
    row = {"mode": mode, "workers": args.workers, "iters": args.iters, "median_iter_s": max(per_rank)}
    if mode != "compute":
        n = sum(r["iterations"] for r in results)
        total = sum(sum(r["times"]) for r in results)
        row["wait_fraction"] = sum(r["wait_s"] for r in results) / total
        row["compress_ms"] = 1e3 * sum(r["compress_s"] for r in results) / n
        row["exchange_ms"] = 1e3 * sum(r["exchange_s"] for r in results) / n
        row["bytes_per_iter_up"] = sum(r["bytes_pushed"] for r in results) / n
        row["bytes_per_iter_down"] = sum(r["bytes_pulled"] for r in results) / n
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations (under a minute)")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--width", type=int, default=3072)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--value-dtype", default="f16")
    ap.add_argument("--index-coding", default="rice")
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args(argv)
    if args.quick:
        args.iters, args.warmup = 15, 3
    numel = sum(p.numel() for p in build(args.width, args.depth).parameters())
    print(f"model: MLP 512-{args.width}x{args.depth}-10, {numel / 1e6:.1f}M parameters, batch {args.batch}, "
          f"{args.workers} workers, density {args.density}, values {args.value_dtype}, "
          f"indices {args.index_coding}; {platform.processor() or platform.machine()}")
    rows = [run_mode(m, args) for m in ("compute", "sync", "pipeline")]
    base = rows[0]["median_iter_s"]
    print(f"\n{'mode':<13}{'iter ms':>10}{'vs compute':>12}{'wait %':>9}{'compress ms':>13}{'exchange ms':>13}"
          f"{'up KB/it':>10}{'down KB/it':>12}")
    for r in rows:
        r["ratio_vs_compute"] = r["median_iter_s"] / base
        r["params"] = numel
        extra = ""
        if r["mode"] != "compute":
            extra = (f"{100 * r['wait_fraction']:>9.1f}{r['compress_ms']:>13.2f}{r['exchange_ms']:>13.2f}"
                     f"{r['bytes_per_iter_up'] / 1e3:>10.1f}{r['bytes_per_iter_down'] / 1e3:>12.1f}")
        print(f"{r['mode']:<13}{1e3 * r['median_iter_s']:>10.2f}{r['ratio_vs_compute']:>12.3f}{extra}")
    for r in rows[2:]:
        goal = r["ratio_vs_compute"] <= 1.15
        print(f"{r['mode']} / compute = {r['ratio_vs_compute']:.3f} (goal <= 1.15: {'met' if goal else 'missed'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
