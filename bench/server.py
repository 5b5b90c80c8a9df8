"""Server throughput: how fast one ``stella-ps`` turns pushes into applied steps.

``W`` worker processes (NumPy only, no model) each push a pre-built sparse update
(top-``density`` indices, Rice-coded, f16 values) per step and pull the step's delta,
synchronously, as fast as the server answers; every step therefore carries the whole
server path: receive, decode and validate, aggregate, merge and apply with the lazy
optimizer, build the delta and send it to every worker. Reported: steps/s, applied
updates/s (coordinates pushed per second), and the server's own CPU time per step
(from /proc, so the workers' time is not counted), plus the cost of decoding and
validating one push header in this process.

    python -m bench.server [--quick] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time

import numpy as np

from bench.harness import await_ready, process_cpu_seconds
from stella import Client, protocol
from stella_ps.process import ServerProcess

TENSORS = 8


def _layout(numel: int) -> dict[str, np.ndarray]:
    per = numel // TENSORS
    return {f"t{i}": np.zeros(per, np.float32) for i in range(TENSORS)}


def _worker(endpoint: str, rank: int, numel: int, density: float, steps: int, optimizer: dict, out,
            keys: dict) -> None:
    rng = np.random.default_rng(rank)
    init = _layout(numel)
    c = Client(endpoint, timeout=120, **keys)
    c.register(init, optimizer)
    version = c.pull(None).version
    pushes = []
    for _ in range(4):  # a few different updates, built before timing
        upd = {}
        for name, t in init.items():
            k = max(1, int(t.size * density))
            idx = np.sort(rng.choice(t.size, k, replace=False)).astype(np.int32)
            upd[name] = (idx, (rng.standard_normal(k) * 1e-3).astype(np.float32))
        pushes.append(upd)
    out.put(("ready", rank))
    pushed0, pulled0 = c.bytes_pushed, c.bytes_pulled  # the timed loop's bytes only
    t0 = time.perf_counter()
    for s in range(steps):
        c.push(pushes[s % len(pushes)], version, value_dtype="f16", index_coding="rice")
        version = c.pull(version, wait_for=version + 1, index_coding="rice").version
    out.put(("done", rank, time.perf_counter() - t0, c.bytes_pushed - pushed0, c.bytes_pulled - pulled0))
    c.close()


def run_throughput(numel: int, density: float, workers: int, steps: int, optimizer: str,
                   server_args: tuple[str, ...] = ()) -> dict:
    opt = {"name": optimizer, "lr": 1e-3}
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with ServerProcess(workers=workers, args=server_args, log_level="WARNING") as srv:
        keys = srv.client_kwargs()
        procs = [ctx.Process(target=_worker, args=(srv.endpoint, r, numel, density, steps, opt, out, keys))
                 for r in range(workers)]
        for p in procs:
            p.start()
        await_ready(out, workers)
        cpu0, t0 = process_cpu_seconds(srv.pid), time.perf_counter()
        done = [out.get(timeout=600) for _ in range(workers)]
        wall, cpu = time.perf_counter() - t0, process_cpu_seconds(srv.pid) - cpu0
        for p in procs:
            p.join(30)
    k = sum(max(1, int((numel // TENSORS) * density)) for _ in range(TENSORS))
    return {
        "numel": numel, "density": density, "workers": workers, "steps": steps, "optimizer": optimizer,
        "wall_s": round(wall, 3),
        "steps_per_s": round(steps / wall, 2),
        "updates_per_s": round(steps * workers * k / wall),
        "server_cpu_ms_per_step": round(1e3 * cpu / steps, 3),
        "server_cpu_ns_per_update": round(1e9 * cpu / (steps * workers * k), 2),
        "bytes_pushed_per_step": round(sum(d[3] for d in done) / steps),  # all workers
        "bytes_pulled_per_step": round(sum(d[4] for d in done) / steps),
    }


def header_decode_cost(tensors: int, reps: int) -> dict:
    """Decode and validate one push header of ``tensors`` sparse entries (no payload
    checks against a model): microseconds per header."""
    layout = [protocol.TensorSpec(f"t{i}", (100_000,), "float32") for i in range(tensors)]
    idx = np.arange(0, 100_000, 100, dtype=np.int32)
    vals = np.ones(idx.size, np.float32)
    entries, frames = protocol.encode_tensors([protocol.SparseTensor(t, idx, vals) for t in range(tensors)], layout,
                                              "rice", "f16")
    parts = protocol.encode(protocol.Push(req=1, worker=0, version=0, tensors=entries), frames)
    parts = [memoryview(bytes(p)) for p in parts]
    t0 = time.perf_counter()
    for _ in range(reps):
        protocol.decode_request(parts)
    per = (time.perf_counter() - t0) / reps
    return {"tensors": tensors, "header_bytes": len(parts[0]), "decode_us": round(1e6 * per, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.server", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1M parameters, 40 steps")
    p.add_argument("--numel", type=int, default=None)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--server-args", default="", help="flags for stella-ps, e.g. '--push-norm-factor 0'")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    numel = a.numel or (1_000_000 if a.quick else 10_000_000)
    steps = a.steps or (40 if a.quick else 100)
    server_args = tuple(a.server_args.split())
    rows = [run_throughput(numel, a.density, a.workers, steps, opt, server_args) for opt in ("sgd", "adamw")]
    dec = [header_decode_cost(t, 2000 if a.quick else 20000) for t in (1, 16, 128)]
    print(f"stella-ps throughput: {a.workers} workers, {numel:,} parameters in {TENSORS} tensors, "
          f"density {a.density:.0%}, Rice + f16 pushes, synchronous push + pull per step")
    print(f"{'optimizer':<10} {'steps/s':>8} {'M upd/s':>8} {'srv ms/step':>12} {'srv ns/upd':>11} "
          f"{'push B/step':>12} {'pull B/step':>12}")
    for r in rows:
        print(f"{r['optimizer']:<10} {r['steps_per_s']:>8.1f} {r['updates_per_s'] / 1e6:>8.2f} "
              f"{r['server_cpu_ms_per_step']:>12.2f} {r['server_cpu_ns_per_update']:>11.1f} "
              f"{r['bytes_pushed_per_step']:>12,} {r['bytes_pulled_per_step']:>12,}")
    print("\npush header decode + validation (this process)")
    print(f"{'tensors':>8} {'header B':>9} {'us':>8}")
    for d in dec:
        print(f"{d['tensors']:>8} {d['header_bytes']:>9} {d['decode_us']:>8.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"throughput": rows, "header_decode": dec}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
