"""Server throughput: how fast ``stella-ps`` (one, or N shards) turns pushes into steps.

``W`` light worker processes (NumPy only, no model) each replay pre-encoded sparse
updates (top-``density`` indices, Rice-coded, f16 values; encoded once before timing,
:meth:`stella.Client.encode_push`) and pull each step without decoding it
(``decode=False``), as fast as the server answers: push and pull go out together, to
every shard at once (:func:`stella.planning.measure.replay`, the loop ``stella profile``
times the server with), so the clients cost little and every step carries the whole server
path: receive, decode and validate, aggregate, apply with the lazy optimizer, build the
step's broadcast message and send it to every worker. With ``--shards N`` the model is
split as :mod:`stella.shards` splits it, each worker pushing each shard its part.

Reported per (shards, optimizer): steps/s, pushes/s (one per worker per step, to all
shards), pushed updates/s (coordinates), MB/s into and out of the servers (their own
byte counters), the step latency seen by a worker (push sent to the step's answer from
every shard; p50 and p99), the servers' CPU per step and peak RSS (all shards together,
from /proc; ``ms/wkr/step``: that CPU over the workers, the per-message cost's measure, since each
worker sends a push and a pull a step, in one message (``--messages 2``: two, as before protocol 15),
and gets their replies; ``wkr ms/step``: one light worker's
CPU a step, all its threads), and, in this process, the cost of decoding and validating one push header
and of the work the server's event loop does on each push of the run (header, indices
and value checks, the push-norm bound's sum of squares).

With ``--pin`` each shard runs on a core of its own with one thread (``--threads 1``:
"one shard, one core") and the worker processes on the cores left over (all of them
when none is): the server's CPU a step is then its work alone, not its share of cores
the workers also use. ``srv cores`` is the servers' CPU time over the wall time: how
many cores they kept busy; ``wkr cores`` the same for the light workers (all their
threads: replaying pushes, receiving pulls, CurveZMQ both ways). On a machine with
as many cores as shards the workers share the shards' cores, so the two columns
together show what the shards were left.

With ``--one-host`` the shards are started as an operator of a many-core host starts
them, by one command, ``stella-ps --shards N`` (the supervisor: each shard pinned to its
share of the cores, with that many threads; ``--shards 1`` too, so that both sides of
the comparison run the same way), and the workers are given the first address only
(they find the others, :func:`stella.shards.connect`). The servers' CPU and RSS are the
supervisor's and its shards'.

``--plot PATH`` draws pushed updates/s against shards, a line per (workers, optimizer),
beside the linear scaling from one shard.

    python -m bench.server [--quick] [--workers 2,8] [--shards 1,2,4] [--pin | --one-host] [--json PATH] [--plot PATH]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import time

import numpy as np

from bench.harness import await_ready, loadavg, start_shards
from stella import payload, protocol
from stella.planning.measure import replay
from stella.shards import ShardedClient, connect
from stella_ps.aggregation import push_norm
from stella_ps.process import process_cpu_seconds

VARIANTS = 4  # different updates per worker, replayed in turn


def model_sizes(numel: int, tensors: int) -> list[int]:
    """``tensors`` tensor sizes summing to ``numel``: one tensor; a few equal ones (under
    16); or a transformer's shapes (``--tensors 76``: the byte LM's count, 300: a 1B
    model's scaled down): per layer the attention's in and out projections, the MLP's two,
    their biases and two layer norms' weights and biases (12 tensors; the small ones fall
    under the server's dense cut, as they do in a real model), the token and position
    embeddings and a final norm (4), and extra norm-sized tensors for a remainder. The
    width d is the largest whose layers fit; the token embedding takes what is left."""
    if tensors < 16:
        return [numel // tensors + (i < numel % tensors) for i in range(tensors)]
    layers, extra = divmod(tensors - 4, 12)
    ctx = 256

    def body(d: int) -> list[int]:
        layer = [3 * d * d, 3 * d, d * d, d, 4 * d * d, 4 * d, 4 * d * d, d, d, d, d, d]
        return [ctx * d] + layer * layers + [d, d] + [d] * extra

    d = 1
    while sum(body(d + 1)) + 256 * (d + 1) <= numel:  # a vocabulary of at least 256 rows left over
        d += 1
    rest = body(d)
    return [numel - sum(rest), *rest]


def _layout(numel: int, tensors: int) -> dict[str, np.ndarray]:
    return {f"t{i}": np.zeros(n, np.float32) for i, n in enumerate(model_sizes(numel, tensors))}


def _worker(endpoints: list[str], rank: int, numel: int, tensors: int, density: float, steps: int, optimizer: dict,
            out, keys: dict, cpus: list[int] | None = None, separate: bool = False) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    rng = np.random.default_rng(rank)
    init = _layout(numel, tensors)
    c = connect(endpoints, timeout=120, **keys)
    c.register(init, optimizer)
    clients = c.shards if isinstance(c, ShardedClient) else [c]
    layout = clients[0].flat
    assert layout is not None
    encoded = []  # per variant, per shard
    for _ in range(VARIANTS):
        upd: dict[str, object] = {}
        count = 0  # coordinates a push carries
        for i, (name, t) in enumerate(init.items()):
            if layout.span(i)[0] >= layout.sparse_numel:  # the dense suffix (the server's cut): whole, as a worker does
                upd[name] = (rng.standard_normal(t.size) * 1e-3).astype(np.float32)
                count += t.size
                continue
            k = max(1, int(t.size * density))
            idx = np.sort(rng.choice(t.size, k, replace=False)).astype(np.int32)
            upd[name] = (idx, (rng.standard_normal(k) * 1e-3).astype(np.float32))
            count += k
        flat = c.shards[0].flatten(upd) if isinstance(c, ShardedClient) else c.flatten(upd)  # each shard its range
        encoded.append([cl.encode_push(flat, value_dtype="f16", index_coding="rice") for cl in clients])
    versions = [cl.pull(None, decode=False).version for cl in clients]
    out.put(("ready", rank))
    pushed0, pulled0 = c.bytes_pushed, c.bytes_pulled  # the timed loop's bytes only
    t0, c0 = time.perf_counter(), time.process_time()
    _, latencies = replay(clients, encoded, versions, steps, separate)  # stella profile's loop: one implementation
    out.put(("done", rank, time.perf_counter() - t0, c.bytes_pushed - pushed0, c.bytes_pulled - pulled0,
             latencies, time.process_time() - c0, count))
    c.close()


def _peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")  # pragma: no cover


def _threads(pid: int) -> list[int]:
    """The thread ids of process ``pid`` (one may end before the caller reaches it)."""
    return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process ``pid`` onto ``cpus`` (threads it starts later inherit it)."""
    for tid in _threads(pid):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(tid, cpus)


def _thread_cpus(pid: int) -> list[int]:
    """The CPUs any thread of process ``pid`` may run on."""
    out: set[int] = set()
    for tid in _threads(pid):
        with contextlib.suppress(ProcessLookupError):
            out |= os.sched_getaffinity(tid)
    return sorted(out)


def _counters(endpoints: list[str], keys: dict) -> list[protocol.StatusReply]:
    """Every shard's status (one address of a job that lists its shards: all of them)."""
    with connect(endpoints, timeout=30, join=False, **keys) as c:
        got = c.status()
    return got if isinstance(got, list) else [got]


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (the supervisor's shards)."""
    out: list[int] = []
    for tid in _threads(pid):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def run_throughput(numel: int, density: float, workers: int, steps: int, optimizer: str, shards: int = 1,
                   server_args: tuple[str, ...] = (), pin: bool = False, one_host: bool = False,
                   tensors: int = 1, messages: int = 1) -> dict:
    name, _, preset = optimizer.partition("+")  # "sgd+count": SGD with the "count" outer step's scaling
    opt = {"name": name, "lr": 1e-3, **({"count_exponent": 0.5} if preset == "count" else {})}
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    if "--max-workers-per-key" not in server_args:  # every light worker uses the one key
        server_args = (*server_args, "--max-workers-per-key", str(max(8, workers)))
    cpus = sorted(os.sched_getaffinity(0))
    worker_cpus = None
    if pin:
        if "--threads" not in server_args:
            server_args = (*server_args, "--threads", "1")
        worker_cpus = cpus[shards:] or cpus
    with contextlib.ExitStack() as stack:
        if one_host:  # one command: the supervisor starts, pins and lists the shards
            from stella_ps.process import ServerProcess

            sup = stack.enter_context(ServerProcess(workers, [*server_args, "--shards", str(shards)],
                                                    log_level="WARNING"))
            servers, pids = [sup], [sup.pid, *_children(sup.pid)]
            assert len(pids) == shards + 1, pids
        else:
            servers = start_shards(stack, shards, server_args, workers=workers, log_level="WARNING")
            pids = [s.pid for s in servers]
        if pin:
            for i, s in enumerate(servers):
                _pin(s.pid, {cpus[i % len(cpus)]})
        keys, endpoints = servers[0].client_kwargs(), [s.endpoint for s in servers]
        procs = [ctx.Process(target=_worker, args=(endpoints, r, numel, tensors, density, steps, opt, out, keys,
                                                              worker_cpus, messages == 2))
                 for r in range(workers)]
        for p in procs:
            p.start()
        await_ready(out, workers, procs=procs)
        st0 = _counters(endpoints, keys)
        server_cpus = [_thread_cpus(p) for p in pids]
        cpu0, t0 = sum(process_cpu_seconds(p) for p in pids), time.perf_counter()
        done = [out.get(timeout=600) for _ in range(workers)]
        wall = time.perf_counter() - t0
        cpu = sum(process_cpu_seconds(p) for p in pids) - cpu0
        st1 = _counters(endpoints, keys)
        rss = sum(_peak_rss_mb(p) for p in pids)
        for p in procs:
            p.join(30)
    k = done[0][7]  # coordinates a push carries (every worker's pushes are alike in size)
    lat = np.concatenate([np.asarray(d[5]) for d in done])
    mb_in = sum(b.bytes_in - a.bytes_in for a, b in zip(st0, st1)) / 1e6
    mb_out = sum(b.bytes_out - a.bytes_out for a, b in zip(st0, st1)) / 1e6
    return {
        "numel": numel, "tensors": tensors, "density": density, "workers": workers, "shards": shards, "steps": steps,
        "optimizer": optimizer, "messages": messages, "pinned": pin, "one_host": one_host, "server_cpus": server_cpus,
        "wall_s": round(wall, 3),
        "steps_per_s": round(steps / wall, 2),
        "pushes_per_s": round(steps * workers / wall, 1),
        "updates_per_s": round(steps * workers * k / wall),
        "mb_in_per_s": round(mb_in / wall, 2), "mb_out_per_s": round(mb_out / wall, 2),
        "step_latency_ms_p50": round(1e3 * float(np.percentile(lat, 50)), 3),
        "step_latency_ms_p99": round(1e3 * float(np.percentile(lat, 99)), 3),
        "server_cpu_ms_per_step": round(1e3 * cpu / steps, 3),
        # the per-message cost's measure: each worker sends a push and a pull a step (in one message, or two with
        # --messages 2) and gets their two replies
        "server_cpu_ms_per_worker_step": round(1e3 * cpu / (steps * workers), 4),
        "server_cores_busy": round(cpu / wall, 3),
        "worker_cores_busy": round(sum(d[6] for d in done) / wall, 3),  # their CPU, all threads
        "worker_cpu_ms_per_step": round(1e3 * sum(d[6] for d in done) / (steps * workers), 4),  # one worker's
        "updates_per_push": k,
        "server_cpu_ns_per_update": round(1e9 * cpu / (steps * workers * k), 2),
        "server_peak_rss_mb": round(rss, 1),
        "bytes_pushed_per_step": round(sum(d[3] for d in done) / steps),  # all workers
        "bytes_pulled_per_step": round(sum(d[4] for d in done) / steps),
    }


def per_worker_costs(rows: list[dict]) -> list[dict]:
    """For each (tensors, optimizer, messages) run at two or more worker counts on one shard:
    the least-squares line ``server CPU a step = a + b W`` (the mean of a configuration's
    repeated rows first). ``b`` is the per-message cost proper, a worker's round (its request
    and the two replies) as the server pays it; ``a`` is the step's own work, which
    ``ms/wkr/step`` divides among the workers too."""
    groups: dict[tuple, dict[int, list[float]]] = {}
    for r in rows:
        if r["shards"] == 1:
            key = (r["tensors"], r["optimizer"], r.get("messages", 1))
            groups.setdefault(key, {}).setdefault(r["workers"], []).append(r["server_cpu_ms_per_step"])
    out = []
    for (tensors, optimizer, messages), by_w in groups.items():
        if len(by_w) < 2:
            continue
        ws = np.array(sorted(by_w), dtype=float)
        ys = np.array([np.mean(by_w[int(w)]) for w in ws])
        b, a = np.polyfit(ws, ys, 1)
        out.append({"tensors": tensors, "optimizer": optimizer, "messages": messages,
                    "workers": ",".join(str(int(w)) for w in ws),
                    "fixed_ms_per_step": round(float(a), 4), "ms_per_added_worker": round(float(b), 4)})
    return out


def _plot(rows: list[dict], pin: bool, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for i, key in enumerate(dict.fromkeys((r["workers"], r["optimizer"]) for r in rows)):
        rs = sorted((r for r in rows if (r["workers"], r["optimizer"]) == key), key=lambda r: r["shards"])
        xs = [r["shards"] for r in rs]
        color = f"C{i}"
        ax1.plot(xs, [r["updates_per_s"] / 1e6 for r in rs], "o-", color=color, label=f"W = {key[0]}, {key[1]}")
        one = next((r["updates_per_s"] for r in rs if r["shards"] == 1), None)
        if one:
            ax1.plot(xs, [one * x / 1e6 for x in xs], ":", color=color, lw=0.8)
        ax2.plot(xs, [r["server_cpu_ms_per_step"] for r in rs], "s-", color=color, label=f"W = {key[0]}, {key[1]}")
    for ax in (ax1, ax2):
        ax.set_xlabel("shards")
        ax.set_xticks(sorted({r["shards"] for r in rows}))
        ax.legend(fontsize=8)
    ax1.set_ylabel("M pushed updates/s (dotted: linear from 1 shard)")
    ax2.set_ylabel("servers' CPU ms a step (all shards)")
    how = "a core and a thread each" if pin else "threads: cores / shards"
    fig.suptitle(f"bench.server: shards on {len(os.sched_getaffinity(0))} cores ({how}), "
                 f"{rows[0]['numel']:,} parameters, {rows[0]['density']:.0%} pushes, loopback")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def header_decode_cost(tensors: int, reps: int) -> dict:
    """Decode and validate one push header of ``tensors`` sparse entries (no payload
    checks against a model): microseconds per header."""
    layout = [protocol.TensorSpec(f"t{i}", (100_000,), "float32") for i in range(tensors)]
    idx = np.arange(0, 100_000, 100, dtype=np.int32)
    vals = np.ones(idx.size, np.float32)
    entries, frames = payload.encode_tensors([payload.SparseTensor(t, idx, vals) for t in range(tensors)], layout,
                                              "rice", "f16")
    parts = protocol.encode(protocol.Push(req=1, worker=0, version=0, tensors=entries), frames)
    parts = [memoryview(bytes(p)) for p in parts]
    t0 = time.perf_counter()
    for _ in range(reps):
        protocol.decode_request(parts)
    per = (time.perf_counter() - t0) / reps
    return {"tensors": tensors, "header_bytes": len(parts[0]), "decode_us": round(1e6 * per, 2)}


def push_decode_cost(numel: int, density: float, reps: int) -> dict:
    """The event loop's work on one push of the throughput run (``numel`` parameters in
    one part (the server's flat range), ``density`` of each, Rice + f16), in this process: microseconds per
    push to decode the header, to decode the indices and check the values of every
    tensor, and to take the push's norm (the push-norm bound, on by default)."""
    rng = np.random.default_rng(0)
    layout = [protocol.TensorSpec("part0", (numel,), "float32")]
    k = max(1, int(numel * density))
    sparse = [payload.SparseTensor(0, np.sort(rng.choice(numel, k, replace=False)).astype(np.int32),
                                   (rng.standard_normal(k) * 1e-3).astype(np.float32))]
    entries, frames = payload.encode_tensors(sparse, layout, "rice", "f16")
    parts = [memoryview(bytes(p)) for p in protocol.encode(protocol.Push(req=1, worker=0, version=0,
                                                                         tensors=entries), frames)]
    rx = protocol.decode_request(parts)
    tensors = payload.decode_tensors(rx, layout)
    stages = {"header": lambda: protocol.decode_request(parts), "tensors": lambda: payload.decode_tensors(rx, layout),
              "norm": lambda: push_norm(tensors)}
    us = {}
    for name, fn in stages.items():
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        us[name] = 1e6 * (time.perf_counter() - t0) / reps
    total = sum(us.values())
    return {"entries": k, "header_us": round(us["header"], 2), "tensors_us": round(us["tensors"], 2),
            "norm_us": round(us["norm"], 2), "total_us": round(total, 2),
            "ns_per_entry": round(1e3 * total / k, 3)}


def kernel_cost(rows: list[dict], allocations: int = 3) -> None:
    """The kernel alone (``bench.kernel``'s run, one thread, best of 5 fresh push sets) on
    each row's step: its workers' pushes at the row's density (dense suffix included), applied
    to the row's parameters with its optimizer. Adds the kernel's CPU per pushed update and the
    server's over it (``x_kernel``): what the server's path costs beyond the apply.

    The kernel runs on ``allocations`` states of its own, each allocated afresh, and the
    least is taken (the spread in ``kernel_cpu_ns_spread``): on a VM a gigabyte-sized state's
    random updates cost up to 2x more in one allocation than in the next, as the host maps
    its pages (bench/RESULTS.md, "What the server's layout leaves"), and one draw made the
    ratio at 100M a matter of luck."""
    from bench.kernel import run_case

    cache: dict[tuple, tuple[float, float]] = {}
    for r in rows:
        key = (r["numel"], r["updates_per_push"], r["workers"], r["optimizer"])
        if key not in cache:
            per_alloc = []
            for _ in range(allocations):
                got: list[dict] = []
                run_case(got, r["optimizer"].partition("+")[0], r["numel"], r["updates_per_push"] / r["numel"],
                         r["workers"], bw=float("nan"), reps=5, impls=("stella",))
                one = next(g for g in got if g["impl"] == "stella" and g["threads"] == 1)
                step_cpu_s = one["union"] / one["updates_per_cpu_s"]  # the kernel's CPU for one step's pushes
                per_alloc.append(1e9 * step_cpu_s / (r["workers"] * r["updates_per_push"]))
            cache[key] = (min(per_alloc), max(per_alloc))
        best, worst = cache[key]
        r["kernel_cpu_ns_per_update"] = round(best, 2)
        r["kernel_cpu_ns_spread"] = [round(best, 2), round(worst, 2)]
        r["x_kernel"] = round(r["server_cpu_ns_per_update"] / best, 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.server", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1M parameters, 40 steps")
    p.add_argument("--numel", type=int, default=None)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--workers", default="2", help="worker counts, comma-separated (default 2)")
    p.add_argument("--shards", default="1,2,4", help="comma-separated shard counts to run (default 1,2,4)")
    p.add_argument("--optimizers", default="sgd,adamw",
                   help="comma-separated; sgd+count: SGD with count_exponent 0.5 (update mode's \"count\" outer step)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--server-args", default="", help="flags for stella-ps, e.g. '--push-norm-factor 0'")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--pin", action="store_true",
                     help="each shard on a core of its own with one thread, the workers on the other cores")
    how.add_argument("--one-host", action="store_true",
                     help="the shards from one command, stella-ps --shards N (pinned and listed by the supervisor); "
                          "the workers given the first address")
    p.add_argument("--tensors", default="1",
                   help="model layouts, comma-separated tensor counts (default 1; 76: the byte LM's count, 300: a 1B "
                        "transformer's, shapes scaled to --numel, see model_sizes)")
    p.add_argument("--messages", default="1",
                   help="messages a worker sends a step, comma-separated: 1 (the push carrying its pull, protocol 15, "
                        "what a worker's round sends), 2 (push and pull apart, as before); '1,2': both, side by side")
    p.add_argument("--kernel", action="store_true",
                   help="also time the kernel alone (bench.kernel, one thread) on each case's pushes, in this run: "
                        "the server's CPU per pushed update over the kernel's (the least of three fresh states)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH", help="updates/s and server CPU against shards (PNG)")
    a = p.parse_args(argv)
    workers = [int(w) for w in str(a.workers).split(",")]
    numel = a.numel or (1_000_000 if a.quick else 10_000_000)
    steps = a.steps or (40 if a.quick else 100)
    server_args = tuple(a.server_args.split())
    load = loadavg()
    rows = [run_throughput(numel, a.density, w, steps, opt, int(n), server_args, a.pin, a.one_host, int(t), int(m))
            for t in a.tensors.split(",") for w in workers for n in a.shards.split(",")
            for opt in a.optimizers.split(",") for m in a.messages.split(",")]
    if a.kernel:
        kernel_cost(rows)
    load_end = loadavg()
    dec = [header_decode_cost(t, 2000 if a.quick else 20000) for t in (1, 16, 128)]
    push = push_decode_cost(numel, a.density, 100 if a.quick else 1000)
    print(f"stella-ps throughput: {'/'.join(map(str, workers))} workers, {numel:,} parameters in {a.tensors} tensors, "
          f"density {a.density:.0%}, pre-encoded Rice + f16 pushes replayed, push + pull per step"
          f"{', shards pinned to a core each' if a.pin else ''}"
          f"{', shards from one command (stella-ps --shards N, pinned by it)' if a.one_host else ''}"
          f" (load at start: {load}; at end: {load_end})")
    print(f"{'tensors':>7} {'W':>3} {'shards':>6} {'optimizer':<9} {'msgs':>4} {'steps/s':>8} {'pushes/s':>9} "
          f"{'M upd/s':>8} {'x 1 shard':>9} "
          f"{'MB/s in':>8} {'MB/s out':>9} {'p50 ms':>7} {'p99 ms':>7} {'srv ms/step':>12} {'ms/wkr/step':>11} "
          f"{'srv cores':>9} {'wkr cores':>9} {'wkr ms/step':>12} {'RSS MB':>7} {'srv ns/upd':>10} {'kern ns/upd':>11} "
          f"{'x kernel':>8}")
    one = {(r["tensors"], r["workers"], r["optimizer"], r["messages"]): r["updates_per_s"]
           for r in rows if r["shards"] == 1}
    for r in rows:
        base = one.get((r["tensors"], r["workers"], r["optimizer"], r["messages"]))
        r["x_one_shard"] = round(r["updates_per_s"] / base, 3) if base else None
        kern = r.get("kernel_cpu_ns_per_update", float("nan"))
        print(f"{r['tensors']:>7} {r['workers']:>3} {r['shards']:>6} {r['optimizer']:<9} {r['messages']:>4} "
              f"{r['steps_per_s']:>8.1f} "
              f"{r['pushes_per_s']:>9.1f} {r['updates_per_s'] / 1e6:>8.2f} {r['x_one_shard'] or float('nan'):>9.2f} "
              f"{r['mb_in_per_s']:>8.2f} "
              f"{r['mb_out_per_s']:>9.2f} {r['step_latency_ms_p50']:>7.1f} {r['step_latency_ms_p99']:>7.1f} "
              f"{r['server_cpu_ms_per_step']:>12.2f} {r['server_cpu_ms_per_worker_step']:>11.3f} "
              f"{r['server_cores_busy']:>9.2f} {r['worker_cores_busy']:>9.2f} {r['worker_cpu_ms_per_step']:>12.3f} "
              f"{r['server_peak_rss_mb']:>7.0f} {r['server_cpu_ns_per_update']:>10.1f} {kern:>11.1f} "
              f"{r.get('x_kernel', float('nan')):>8.2f}")
    marginal = per_worker_costs(rows)
    if marginal:
        print("\nserver CPU a step as a + b W over the worker counts run (one shard): b, what each added worker's "
              "messages cost a step, and a, the step's own")
        print(f"{'tensors':>7} {'optimizer':<9} {'msgs':>4} {'W':>9} {'a ms/step':>10} {'b ms/wkr':>9}")
        for m in marginal:
            print(f"{m['tensors']:>7} {m['optimizer']:<9} {m['messages']:>4} {m['workers']:>9} "
                  f"{m['fixed_ms_per_step']:>10.3f} {m['ms_per_added_worker']:>9.3f}")
    print("\npush header decode + validation (this process)")
    print(f"{'tensors':>8} {'header B':>9} {'us':>8}")
    for d in dec:
        print(f"{d['tensors']:>8} {d['header_bytes']:>9} {d['decode_us']:>8.2f}")
    print(f"\none push of the run on the server's event loop (this process): {push['entries']:,} entries "
          f"in one part, Rice + f16")
    print(f"{'header us':>10} {'tensors us':>11} {'norm us':>8} {'total us':>9} {'ns/entry':>9}")
    print(f"{push['header_us']:>10.2f} {push['tensors_us']:>11.2f} {push['norm_us']:>8.2f} {push['total_us']:>9.2f} "
          f"{push['ns_per_entry']:>9.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"load_at_start": load, "load_at_end": load_end, "throughput": rows, "header_decode": dec,
                       "push_decode": push, "per_worker": marginal}, f, indent=2)
    if a.plot:
        _plot(rows, a.pin, a.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
