"""Load test: 32 worker processes against one ``stella-ps`` on loopback, synchronous
steps, for a bounded time; throughput, and a conserved-sum check that every accepted
push is in the model exactly once.

Each worker owns ``K`` coordinates of one float32 tensor and shares ``SHARED`` more
with every other worker. Every step it pushes the value 1.0 at all of them (Rice-coded
indices, f32 values) and pulls until the step closed. The server runs plain SGD with
lr = 1 (``{"name": "sgd", "lr": 1.0}``) from a zero model, and every step has all ``W``
pushes (the end is announced as a version ahead of time, so no step closes short), so
the mean is exact in float32 and the final model is known exactly:

    shared coordinates:  -steps          (W ones, times 1/W, per step)
    worker r's own:      -steps / W      (one 1.0, times 1/W, per step; W a power of two)
    every push_ok a worker got is counted: sum == W * steps == the server's `pushes`

Also checked: every worker's replica (built from its delta pulls) equals the final
snapshot. Run both transports side by side (``--transport both``, the default):
plaintext (``--insecure``) and CurveZMQ with ephemeral keys, and their ratio.

``--shards N``: the job on N ``stella-ps`` shards (:mod:`stella.shards`; the tensor is
cut between them), the workers pushing to and pulling from all of them. The shards
serve the broadcast (sharding needs it) with f32 values and room for every changed
coordinate (``--broadcast-values f32 --broadcast-factor 4096``), so the broadcast model
is the exact model and the same check holds; every shard must count every push.

    python -m bench.load [--quick] [--workers 32] [--seconds 20] [--transport both|curve|plain] [--shards N]
                         [--json PATH]
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np

from bench.harness import await_ready, start_shards
from stella_ps.process import process_cpu_seconds

K = 256  # coordinates each worker owns
SHARED = 16  # coordinates every worker pushes to
OPTIMIZER = {"name": "sgd", "lr": 1.0}
CLIENT_TIMEOUT_S = 60.0
MAX_STEPS = 1_000_000  # a bound on every worker's loop besides the announced end
KEY_ENV = ("STELLA_SERVER_KEY", "STELLA_CLIENT_KEY")


def layout(workers: int) -> dict[str, np.ndarray]:
    return {"w": np.zeros(SHARED + workers * K, np.float32)}


def expected_model(workers: int, steps: int) -> np.ndarray:
    """The model after ``steps`` steps of all ``workers`` pushes (see the module docstring)."""
    w = np.zeros(SHARED + workers * K, np.float32)
    w[:SHARED] = -float(steps)
    w[SHARED:] = np.float32(-steps) / np.float32(workers)
    return w


def make_client(endpoint: str | list[str], keys: dict[str, str], secure: bool, name: str, join: bool = True) -> Any:
    """The one place a client connects: CurveZMQ with ``keys`` (or, when empty, the
    STELLA_SERVER_KEY / STELLA_CLIENT_KEY environment), or plaintext with that
    environment cleared (in this process: the workers' own, or the parent's for the
    duration of a plaintext run)."""
    from stella.shards import connect

    if not secure:
        for k in KEY_ENV:
            os.environ.pop(k, None)
    return connect(endpoint, timeout=CLIENT_TIMEOUT_S, name=name, join=join, **(keys if secure else {}))


def _status(c: Any) -> Any:
    """The status (a list of the shards' for a sharded job: then their sums and the
    fewest steps, with ``per_shard`` the replies)."""
    st = c.status()
    if not isinstance(st, list):
        return st
    from types import SimpleNamespace

    return SimpleNamespace(steps=min(s.steps for s in st), version=max(s.version for s in st),
                           pushes=min(s.pushes for s in st), pending_pushes=sum(s.pending_pushes for s in st),
                           per_shard=st)


def _worker(endpoint: str | list[str], keys: dict[str, str], secure: bool, rank: int, workers: int, go: Any,
            stop_at: Any, out: Any) -> None:
    try:
        c = make_client(endpoint, keys, secure, f"load{rank}")
        init = layout(workers)
        c.register(init, OPTIMIZER)
        full = c.pull(None)
        replica = {"w": init["w"].copy()}
        full.apply_to(replica)
        v = full.version
        idx = np.concatenate([np.arange(SHARED), SHARED + rank * K + np.arange(K)]).astype(np.int32)
        ones = np.ones(idx.size, np.float32)
        out.put(("ready", rank))
        go.wait(300)
        pushed0, pulled0 = c.bytes_pushed, c.bytes_pulled
        oks = steps = 0
        t0 = time.perf_counter()
        while steps < MAX_STEPS:
            end = stop_at.value
            if 0 <= end <= v:  # the announced last version: no push for it or later
                break
            ok = c.push({"w": (idx, ones)}, v, index_coding="rice", value_dtype="f32")
            oks += 1
            d = c.pull(v, wait_for=ok.step + 1, index_coding="rice")
            d.apply_to(replica)
            v = d.version
            steps += 1
        wall = time.perf_counter() - t0
        digest = hashlib.sha256(replica["w"].tobytes()).hexdigest()
        out.put(("done", rank, oks, steps, v, wall, c.bytes_pushed - pushed0, c.bytes_pulled - pulled0, digest))
        c.close()
    except BaseException as e:  # reported by the parent
        out.put(("error", rank, repr(e)))


def run_load(workers: int = 32, seconds: float = 20.0, secure: bool = True, log_level: str = "WARNING",
             shards: int = 1) -> dict:
    """One timed run; returns throughput and the conserved-sum result (``conserved``)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    go = ctx.Event()
    stop_at = ctx.Value("q", -1)
    common = ["--max-workers", str(max(256, workers + 1)),
              "--max-workers-per-key", str(workers + 1)]  # every worker (and the observer) holds the one client key
    # the check reads the exact model's sums from a snapshot: exact pulls, or a broadcast that sends it all exactly
    pull = (["--pull", "exact"] if shards == 1 else
            ["--pull", "broadcast", "--broadcast-values", "f32", "--broadcast-factor", "4096"])
    with contextlib.ExitStack() as stack:
        servers = start_shards(stack, shards, [*common, *pull], workers=workers, log_level=log_level, secure=secure)
        first = servers[0]
        srv_pids = [s.pid for s in servers]
        endpoint: str | list[str] = first.endpoint if shards == 1 else [s.endpoint for s in servers]
        keys = first.client_kwargs() if secure else {}
        procs = [ctx.Process(target=_worker, args=(endpoint, keys, secure, r, workers, go, stop_at, out),
                             daemon=True) for r in range(workers)]
        try:
            for p in procs:
                p.start()
            await_ready(out, workers)
            status = make_client(endpoint, keys, secure, "load-observer", join=False)  # never a worker
            s0 = _status(status)
            cpu0, t0 = sum(process_cpu_seconds(p) for p in srv_pids), time.perf_counter()
            go.set()
            time.sleep(seconds)
            # announce the end: a version no worker can have reached (each step needs all of them)
            with stop_at.get_lock():
                stop_at.value = _status(status).version + 3
            done = [out.get(timeout=CLIENT_TIMEOUT_S + 30) for _ in range(workers)]
            wall, cpu = time.perf_counter() - t0, sum(process_cpu_seconds(p) for p in srv_pids) - cpu0
            errors = [d for d in done if d[0] != "done"]
            if errors:
                raise RuntimeError(f"workers failed: {errors[:3]}")
            s1 = _status(status)
            final = _snapshot(status, workers)
            status.close()
        finally:
            with stop_at.get_lock():  # on a failure too: no worker waits for the start or pushes on
                stop_at.value = 0
            go.set()
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
                    p.join(5)
    steps = s1.steps - s0.steps
    oks = sum(d[2] for d in done)
    expect = expected_model(workers, s1.version)
    digests = {d[8] for d in done}
    every_shard = [(b.steps - a.steps, b.pushes - a.pushes) for a, b in
                   zip(getattr(s0, "per_shard", [s0]), getattr(s1, "per_shard", [s1]))]
    conserved = {
        "push_ok": oks, "server_pushes": s1.pushes - s0.pushes, "steps": steps,
        "final_version": s1.version, "shards": shards,
        # every shard made every step and counted every push
        "pushes_accounted": all(sp == oks == workers * steps and ss == steps for ss, sp in every_shard)
        and s1.pending_pushes == 0,
        "model_exact": final.tobytes() == expect.tobytes(),
        "max_abs_error": float(np.max(np.abs(final - expect))),
        "replicas_agree": digests == {hashlib.sha256(final.tobytes()).hexdigest()},
    }
    conserved["ok"] = conserved["pushes_accounted"] and conserved["model_exact"] and conserved["replicas_agree"]
    nbytes = sum(d[6] + d[7] for d in done)
    return {
        "transport": "curve" if secure else "plain", "workers": workers, "shards": shards, "seconds": round(wall, 2),
        "numel": SHARED + workers * K, "indices_per_push": SHARED + K,
        "steps_per_s": round(steps / wall, 2), "pushes_per_s": round(oks / wall, 1),
        "mb_per_s": round(nbytes / wall / 1e6, 3), "bytes_per_step": round(nbytes / max(steps, 1)),
        "server_cpu_ms_per_step": round(1e3 * cpu / max(steps, 1), 3),
        "conserved": conserved,
    }


def _snapshot(c: Any, workers: int) -> np.ndarray:
    """The final model: the observer joins only now (a live worker that never pushes
    would hold every step), after the workers left."""
    c.join(None)
    c.register(layout(workers), OPTIMIZER)
    w = np.asarray(c.pull(None).tensors["w"][1]).reshape(-1).copy()
    c.leave()
    return w


def print_table(rows: list[dict]) -> None:
    print(f"stella-ps load: {rows[0]['workers']} worker processes on loopback, {rows[0]['shards']} shard(s), "
          f"synchronous steps, "
          f"{rows[0]['indices_per_push']} indices (Rice, f32) per push, SGD lr=1")
    print(f"{'transport':<10} {'time s':>7} {'steps/s':>8} {'pushes/s':>9} {'MB/s':>7} {'B/step':>9} "
          f"{'srv ms/step':>12} {'steps':>6} {'conserved':>10}")
    for r in rows:
        c = r["conserved"]
        print(f"{r['transport']:<10} {r['seconds']:>7.1f} {r['steps_per_s']:>8.1f} {r['pushes_per_s']:>9.0f} "
              f"{r['mb_per_s']:>7.2f} {r['bytes_per_step']:>9,} {r['server_cpu_ms_per_step']:>12.2f} "
              f"{c['steps']:>6} {'exact' if c['ok'] else 'FAILED':>10}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="5 s per transport instead of 20")
    p.add_argument("--workers", type=int, default=32)
    p.add_argument("--seconds", type=float, default=None)
    p.add_argument("--transport", choices=["both", "curve", "plain"], default="both")
    p.add_argument("--shards", type=int, default=1, help="stella-ps shards serving the job (default 1)")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    if a.workers & (a.workers - 1):
        p.error("--workers must be a power of two (the exact-mean check divides by it)")
    seconds = a.seconds or (5.0 if a.quick else 20.0)
    modes = {"both": [False, True], "plain": [False], "curve": [True]}[a.transport]
    rows = [run_load(a.workers, seconds, secure=m, shards=a.shards) for m in modes]
    print_table(rows)
    result: dict[str, Any] = {"runs": rows}
    if len(rows) == 2:
        plain, curve = rows
        result["curve_over_plain"] = {k: round(curve[k] / plain[k], 3) for k in ("steps_per_s", "mb_per_s")}
        result["curve_over_plain"]["server_cpu_per_step"] = round(
            curve["server_cpu_ms_per_step"] / plain["server_cpu_ms_per_step"], 3)
        print(f"\nCurveZMQ / plaintext: steps/s x{result['curve_over_plain']['steps_per_s']:.3f}, "
              f"server CPU per step x{result['curve_over_plain']['server_cpu_per_step']:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if all(r["conserved"]["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
