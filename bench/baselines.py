"""PyTorch DDP baselines, run as real multi-process jobs over gloo.

Systems (same model / data / seed / batch / LR schedule as every other system):

* ``ddp``       plain DDP, dense fp32 all-reduce (default reducer)
* ``fp16``      DDP + ``fp16_compress_hook``
* ``powersgd``  DDP + PowerSGD (rank 4, start_powerSGD_iter=2, error feedback,
                warm start), through :func:`serialized_hook`, which makes it
                correct over gloo (see docs/testbed.md, "PowerSGD over gloo")
* ``powersgd_stock`` the unmodified ``powerSGD_hook`` (reproduces the failure)
* ``batched_powersgd`` / ``batched_powersgd_stock`` the same for ``batched_powerSGD_hook``

One process per worker.  With a :class:`bench.wan.WanTestbed` every worker
runs in its own site namespace (``ip netns exec``) and gloo talks over the
shaped veths; without one, everything runs on loopback (quick checks).

Per iteration each worker records forward / backward / optimizer time, the
total iteration time and -- inside a test bed -- the bytes that really left
and entered its site (``/sys/class/net/wan0/statistics/{tx,rx}_bytes``, which
``ip netns exec`` remounts for the namespace).  Rank 0 evaluates the held-out
metric every ``eval_every`` steps; evaluation time is excluded from the
training wall clock.

  python -m bench.baselines --workload widemlp --system powersgd --steps 20            # loopback
  python -m bench.baselines --workload widemlp --system ddp --wan 100 --steps 10       # shaped, 2 sites
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from bench.harness import (
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
from stella_ps.process import free_port

SYSTEMS = ("ddp", "fp16", "powersgd", "batched_powersgd", "powersgd_stock", "batched_powersgd_stock")
DEFAULT_SYSTEMS = ("ddp", "powersgd", "fp16")


# ============================================================ hooks


def serialized_hook(hook):
    """Wrap a DDP comm hook so that the collectives of different buckets never
    overlap: bucket ``i``'s hook starts only when bucket ``i-1``'s whole future
    chain has completed.

    Why: ``powerSGD_hook`` issues its P and Q all-reduces from ``Future.then``
    callbacks.  With gloo those callbacks run on gloo's worker threads as soon
    as the previous collective of *that bucket* completes, so with several
    buckets in flight the order in which collectives are *issued* depends on
    timing and differs between ranks.  Gloo matches collectives purely by issue
    order (a per-process-group sequence number), so rank 0's P(bucket 1) meets
    rank 1's Q(bucket 0) -> "received data size doesn't match", or, when two
    buffers happen to have the same size, silently sums unrelated tensors.
    Chaining the buckets restores one global issue order on every rank, while
    the hook still runs asynchronously (backward keeps computing).
    """
    import torch

    state_box: dict[str, Any] = {"prev": None}

    def wrapped(state, bucket):
        prev = state_box["prev"]
        out: torch.futures.Future = torch.futures.Future()

        def start(_=None):
            try:
                inner = hook(state, bucket)
            except BaseException as e:  # pragma: no cover - propagate into DDP
                out.set_exception(e)
                return

            def done(f):
                try:
                    out.set_result(f.value())
                except BaseException as e:
                    out.set_exception(e)

            inner.add_done_callback(done)

        if prev is None or prev.done():
            start()
        else:
            prev.add_done_callback(start)
        state_box["prev"] = out
        if bucket.is_last():
            state_box["prev"] = None  # DDP waits for every bucket before the next iteration
        return out

    return wrapped


def _patch_orthogonalize_2d(ps_module):
    """``batched_powerSGD_hook`` (torch 2.13) passes its 2-D ``(side, rank)`` P/Q
    to ``_orthogonalize``, which since the batched ``powerSGD_hook`` rewrite
    asserts a 3-D ``(batch, n, rank)`` input -> a bare ``AssertionError`` on
    every backend.  Accept 2-D input as a batch of one (a view: in-place
    results land in the caller's tensor)."""
    orig = ps_module._orthogonalize
    if getattr(orig, "_stella_2d", False):
        return

    def _orthogonalize(matrices, epsilon=0):
        if matrices.dim() == 2:
            return orig(matrices.unsqueeze(0), epsilon)
        return orig(matrices, epsilon)

    _orthogonalize._stella_2d = True  # type: ignore[attr-defined]
    ps_module._orthogonalize = _orthogonalize


def install_hook(model, system: str, rank_: int = 4, start_iter: int = 2):
    """Register the comm hook of ``system`` on DDP ``model``; returns its state."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    if system == "ddp":
        return None
    if system == "batched_powersgd":
        _patch_orthogonalize_2d(ps)
    if system == "fp16":
        model.register_comm_hook(None, dh.fp16_compress_hook)
        return None
    st = ps.PowerSGDState(process_group=None, matrix_approximation_rank=rank_, start_powerSGD_iter=start_iter,
                          min_compression_rate=2, use_error_feedback=True, warm_start=True, random_seed=0)
    base = {"powersgd": ps.powerSGD_hook, "powersgd_stock": ps.powerSGD_hook,
            "batched_powersgd": ps.batched_powerSGD_hook, "batched_powersgd_stock": ps.batched_powerSGD_hook}[system]
    model.register_comm_hook(st, base if system.endswith("_stock") else serialized_hook(base))
    return st


# ============================================================ worker


def _trace_collectives(path: str):
    """Log every ``dist.all_reduce`` issued through ``torch.distributed`` (which
    is what powerSGD_hook calls) with its issue order, size and issuing thread;
    written unbuffered so the log survives gloo's abort on a mismatch."""
    import threading

    import torch.distributed as dist

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    orig = dist.all_reduce
    seq = [0]
    lock = threading.Lock()

    def all_reduce(tensor, *args, **kw):
        with lock:
            seq[0] += 1
            os.write(fd, f"{seq[0]} numel={tensor.numel()} shape={tuple(tensor.shape)} "
                         f"thread={threading.current_thread().name}\n".encode())
            return orig(tensor, *args, **kw)

    dist.all_reduce = all_reduce


def worker(a) -> int:
    import datetime

    timeline = {"entry": time.time()}
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bench import workloads as W

    timeline["imports"] = time.time()
    torch.set_num_threads(a.threads)
    wl = W.get(a.workload)
    if a.trace_collectives:
        _trace_collectives(a.trace_collectives)
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}:{a.port}", rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=max(60, a.max_seconds)))
    timeline["process_group"] = time.time()
    model = wl.build_model(a.seed)
    ddp = DDP(model, bucket_cap_mb=a.bucket_mb)  # broadcasts rank 0's parameters
    timeline["ddp_ready"] = time.time()
    install_hook(ddp, a.system, a.powersgd_rank, a.start_powersgd_iter)
    opt = wl.make_optimizer(ddp.parameters())
    batches = wl.batches(a.rank, a.world, a.batch_size or wl.batch_size, a.seed)

    # pure-compute calibration: backward without communication (no_sync), grads discarded
    calib = []
    for _ in range(a.calib):
        b = next(wl.batches(a.rank, a.world, a.batch_size or wl.batch_size, a.seed + 7919))
        with ddp.no_sync():
            t = time.perf_counter()
            wl.loss(ddp, b).backward()
            calib.append(time.perf_counter() - t)
    opt.zero_grad(set_to_none=True)
    bwd_compute = statistics.median(calib) if calib else None
    dist.barrier()

    recorder = IterRecorder(site_iface())
    clock = TrainClock(wl, model)
    stop = torch.zeros(1)
    if a.rank == 0:
        clock.evaluate(0)
    timeline["train_start"] = time.time()
    step = 0
    while step < a.steps:
        recorder.begin()
        wl.set_lr(opt, step)
        opt.zero_grad(set_to_none=True)
        b = next(batches)
        loss = wl.loss(ddp, b)
        recorder.lap()
        loss.backward()  # DDP all-reduces (overlapped) and waits for every bucket here
        recorder.lap()
        opt.step()
        step += 1
        rec = recorder.end(step, loss.item())
        comp_bwd = min(rec["bwd"], bwd_compute) if bwd_compute is not None else rec["bwd"]
        rec["compute"] = rec["fwd"] + comp_bwd + rec["opt"]
        rec["net_wait"] = max(0.0, rec["iter"] - rec["compute"])
        if a.rank == 0 and (step % a.eval_every == 0 or step == a.steps):
            clock.evaluate(step)
        # all ranks agree on stopping (time budget / target): one tiny all-reduce
        stop.zero_()
        if a.rank == 0 and (clock.wall() > a.max_seconds or (a.stop_at_target and clock.reached is not None)):
            stop.fill_(1.0)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item() > 0:
            break
    if a.rank == 0 and (not clock.evals or clock.evals[-1]["step"] != step):
        clock.evaluate(step)
    timeline["train_end"] = time.time()
    out = {"timeline": timeline, "launched": a.launched, "rank": a.rank, "world": a.world, "system": a.system,
           "workload": a.workload, "steps": step, "train_wall": clock.wall(), "bwd_compute_calib": bwd_compute,
           "iters": recorder.iters, "evals": clock.evals, "reached": clock.reached,
           "site": os.environ.get("STELLA_WAN_SITE")}
    with open(a.out, "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
    return 0


# ============================================================ launcher


def run_ddp(workload: str, system: str, *, world: int = 2, steps: int = 50, max_seconds: float = 300.0,
            bed=None, sites: list[str] | None = None, seed: int = 0, eval_every: int | None = None,
            stop_at_target: bool = False, threads: int = 1, batch_size: int | None = None,
            bucket_mb: float = 25.0, calib: int = 3, powersgd_rank: int = 4, start_powersgd_iter: int = 2,
            log_dir: str | None = None, trace: bool = False) -> dict:
    """Run one DDP job (``world`` processes) and return its summary + raw records.

    With ``bed`` (a started WanTestbed) rank ``r`` runs in ``sites[r]`` and
    rank 0's site address is the rendezvous; otherwise on loopback.  The job
    is killed after ``max_seconds`` of training plus 120 s of start-up slack.
    """
    from bench import workloads as W

    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; known {SYSTEMS}")
    wl = W.get(workload)
    tmp = tempfile.mkdtemp(prefix=f"ddp-{workload}-{system}-", dir=log_dir)
    if bed is not None:
        sites = sites or [s for s in bed.sites if s != "ps"][:world]
        if len(sites) < world:
            raise ValueError(f"need {world} sites, test bed has {sites}")
        master = bed.address(sites[0])
        port = 29500 + (os.getpid() % 1000)
    else:
        master, port = "127.0.0.1", free_port()
    argvs = []
    for r in range(world):
        argv = [sys.executable, "-m", "bench.baselines", "worker", "--rank", str(r), "--world", str(world),
                "--master", master, "--port", str(port), "--system", system, "--workload", workload,
                "--steps", str(steps), "--max-seconds", str(max_seconds), "--seed", str(seed),
                "--eval-every", str(eval_every or wl.eval_every), "--threads", str(threads),
                "--bucket-mb", str(bucket_mb), "--calib", str(calib), "--powersgd-rank", str(powersgd_rank),
                "--start-powersgd-iter", str(start_powersgd_iter), "--out", os.path.join(tmp, f"rank{r}.json"),
                "--launched", repr(time.time())]
        if stop_at_target:
            argv.append("--stop-at-target")
        if batch_size:
            argv += ["--batch-size", str(batch_size)]
        if trace:
            argv += ["--trace-collectives", os.path.join(tmp, f"rank{r}.trace")]
        argvs.append(argv)
    procs = launch_workers(argvs, tmp, bed=bed, sites=sites)
    rcs = wait_workers(procs, max_seconds + 120)
    found = collect_ranks(tmp, world)
    if any(x is None for x in found):
        return {"system": system, "workload": workload, "ok": False, "error": log_tails(tmp, rcs), "log_dir": tmp}
    ranks = [k for k in found if k is not None]
    res = summarize(system, workload, ranks, wl)
    res["log_dir"] = tmp
    return res


def compare_traces(log_dir: str, world: int) -> str:
    """First position where the ranks issued different collectives."""
    seqs = []
    for r in range(world):
        try:
            with open(os.path.join(log_dir, f"rank{r}.trace")) as f:
                seqs.append([line.split(" ", 1)[1].strip() for line in f if line.strip()])
        except OSError:
            return f"(no trace for rank {r})"
    n = min(len(s) for s in seqs)
    for i in range(n):
        calls = [s[i] for s in seqs]
        if len({c.split(" thread=")[0] for c in calls}) > 1:
            lines = [f"collective #{i + 1}: ranks issued DIFFERENT all_reduces:"]
            lines += [f"  rank {r}: {c}" for r, c in enumerate(calls)]
            lines += [f"  (rank {r} before: {' | '.join(seqs[r][max(0, i - 3):i])})" for r in range(world)]
            return "\n".join(lines)
    return f"first {n} traced all_reduces identical on all ranks (lengths {[len(s) for s in seqs]})"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        ap = argparse.ArgumentParser(prog="bench.baselines worker")
        for k, t in (("--rank", int), ("--world", int), ("--master", str), ("--port", int), ("--system", str),
                     ("--workload", str), ("--steps", int), ("--max-seconds", float), ("--seed", int),
                     ("--eval-every", int), ("--threads", int), ("--bucket-mb", float), ("--calib", int),
                     ("--powersgd-rank", int), ("--start-powersgd-iter", int), ("--out", str),
                     ("--batch-size", int), ("--trace-collectives", str), ("--launched", float)):
            optional = k in ("--batch-size", "--trace-collectives", "--launched")
            ap.add_argument(k, type=t, default=None if optional else ...)
        ap.add_argument("--stop-at-target", action="store_true")
        return worker(ap.parse_args(argv[1:]))
    ap = argparse.ArgumentParser(prog="python -m bench.baselines", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="widemlp")
    ap.add_argument("--system", action="append", choices=SYSTEMS, help=f"repeatable; default {DEFAULT_SYSTEMS}")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-seconds", type=float, default=120)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--wan", help="run in a test bed: per-site UP[/DOWN] Mbit/s (e.g. 100 or 100/20); default loopback")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--trace-collectives", action="store_true",
                    help="log every all_reduce issued via torch.distributed (order, size, thread) per rank")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    results = []
    bed = None
    try:
        if a.wan:
            from bench.wan import Link, WanTestbed

            link = Link.parse(a.wan)
            bed = WanTestbed({f"w{r}": link for r in range(a.world)},
                             max_lifetime=len(a.system or DEFAULT_SYSTEMS) * (a.max_seconds + 180)).start()
        for system in a.system or DEFAULT_SYSTEMS:
            r = run_ddp(a.workload, system, world=a.world, steps=a.steps, max_seconds=a.max_seconds, bed=bed,
                        seed=a.seed, eval_every=a.eval_every, bucket_mb=a.bucket_mb,
                        trace=a.trace_collectives)
            print(fmt_summary(r), flush=True)
            if a.trace_collectives:
                print(compare_traces(r["log_dir"], a.world), flush=True)
            results.append(r)
    finally:
        if bed is not None:
            bed.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
