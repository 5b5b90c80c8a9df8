"""``stella demo``: a real two-worker training run through a real ``stella-ps``.

Starts a ``stella-ps`` subprocess and ``workers`` worker processes on loopback. Each
worker trains the same MLP on its shard of scikit-learn's handwritten digits
(1,797 real 8x8 images that ship with the package; 20% held out), pushing top-k
compressed gradients with error feedback and pulling back what changed, through
the one-step-stale pipeline (:class:`stella.StellaOptimizer`). Worker 0 also
evaluates the held-out accuracy of its replica as training goes, and at the end
on the final model.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

__all__ = ["DemoConfig", "run_demo", "start_server", "stop_server", "wait_ready", "load_digits_split"]


@dataclass
class DemoConfig:
    workers: int = 2
    steps: int = 400
    batch_size: int = 32
    density: float = 0.05
    method: str = "threshold"
    lr: float = 3e-3
    hidden: int = 256
    seed: int = 0
    eval_every: int = 25
    timeout: float = 60.0


def load_digits_split(seed: int = 0):
    """Digits as float32 tensors: (x_train, y_train, x_test, y_test), 20% held out, stratified."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    return (torch.from_numpy(xtr), torch.from_numpy(ytr).long(), torch.from_numpy(xte), torch.from_numpy(yte).long())


def build_model(hidden: int, seed: int):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


def accuracy(model, x, y) -> float:
    import torch

    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def _worker(address: str, rank: int, cfg: DemoConfig, progress) -> None:
    import torch

    from .pipeline import StellaOptimizer

    torch.set_num_threads(1)
    xtr, ytr, xte, yte = load_digits_split(cfg.seed)
    shard = torch.arange(rank, xtr.shape[0], cfg.workers)
    xtr, ytr = xtr[shard], ytr[shard]
    model = build_model(cfg.hidden, cfg.seed)
    opt = StellaOptimizer(model, address, optimizer={"name": "adamw", "lr": cfg.lr, "weight_decay": 0.0},
                          density=cfg.density, method=cfg.method, dense_below=1024, timeout=cfg.timeout,
                          name=f"demo-worker-{rank}")
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    perm, pos = torch.randperm(xtr.shape[0], generator=gen), 0
    try:
        for step in range(cfg.steps):
            if pos + cfg.batch_size > perm.numel():
                perm, pos = torch.randperm(xtr.shape[0], generator=gen), 0
            b = perm[pos:pos + cfg.batch_size]
            pos += cfg.batch_size
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xtr[b]), ytr[b])
            loss.backward()
            opt.step()
            acc = None
            if rank == 0 and (step + 1) % cfg.eval_every == 0:
                acc = accuracy(model, xte, yte)
            progress.put(("step", rank, step + 1, loss.item(), opt.client.bytes_pushed, opt.client.bytes_pulled,
                          acc, opt.version))
        opt.synchronize()  # install the last step: the replica equals the server's model
        final_acc = accuracy(model, xte, yte) if rank == 0 else None
        version = opt.version
    finally:
        opt.close()  # pushes what is left in the error-feedback residual, leaves
    progress.put(("done", rank, opt.client.bytes_pushed, opt.client.bytes_pulled, version, final_acc))


def start_server(workers: int, extra: list[str] | None = None, timeout: float = 30.0):
    """Start ``stella-ps`` on an ephemeral loopback port; returns (process, endpoint)."""
    fd, ready = tempfile.mkstemp(prefix="stella-ps-", suffix=".addr")
    os.close(fd)
    os.unlink(ready)
    cmd = [sys.executable, "-m", "stella_ps", "--bind", "tcp://127.0.0.1:0", "--workers", str(workers),
           "--ready-file", ready, "--log-level", "WARNING", *(extra or [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    endpoint = wait_ready(ready, proc, timeout)
    os.unlink(ready)
    return proc, endpoint


def wait_ready(ready: str, proc: subprocess.Popen, timeout: float) -> str:
    """Wait until the ``stella-ps`` process ``proc`` writes its endpoint to ``--ready-file
    ready``; returns the endpoint. Kills ``proc`` and raises if it exits or times out first."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(ready):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"stella-ps did not start (exit code {proc.poll()})")
        time.sleep(0.02)
    with open(ready) as f:
        return f.read().strip()


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def run_demo(cfg: DemoConfig, *, json_path: str | None = None, out=sys.stdout) -> dict:
    """Run the demo; prints progress and a summary, returns the figures."""
    t0 = time.perf_counter()
    proc, endpoint = start_server(cfg.workers)
    ctx = mp.get_context("spawn")
    progress = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(endpoint, r, cfg, progress), daemon=True) for r in range(cfg.workers)]
    print(f"stella demo: stella-ps at {endpoint}, {cfg.workers} workers, digits MLP, top-k density "
          f"{cfg.density:.0%} ({cfg.method}) with error feedback, {cfg.steps} steps", file=out, flush=True)
    try:
        for p in procs:
            p.start()
        done: dict[int, tuple] = {}
        last: dict[int, tuple] = {}
        acc = None
        deadline = time.monotonic() + max(300.0, cfg.steps * 2.0)
        while len(done) < cfg.workers:
            try:
                msg = progress.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"demo worker failed (exit codes {[p.exitcode for p in procs]})")
                continue
            if msg[0] == "done":
                done[msg[1]] = msg
                continue
            _, rank, step, loss, pushed, pulled, a, version = msg
            last[rank] = msg
            if a is not None:
                acc = a
            if rank == 0 and step % cfg.eval_every == 0:
                tot_push = sum(m[4] for m in last.values())
                tot_pull = sum(m[5] for m in last.values())
                print(f"step {step:4d}/{cfg.steps} | loss {loss:.4f} | test acc {acc:.4f} | version {version} | "
                      f"pushed {_mb(tot_push)} | pulled {_mb(tot_pull)}", file=out, flush=True)
        for p in procs:
            p.join(30)
        status = None
        from .client import Client

        with Client(endpoint, timeout=10, join=False) as c:
            status = c.status()
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        stop_server(proc)
    wall = time.perf_counter() - t0
    model = build_model(cfg.hidden, cfg.seed)
    numel = sum(p.numel() for p in model.parameters())
    pushed = sum(m[2] for m in done.values())
    pulled = sum(m[3] for m in done.values())
    dense = cfg.steps * cfg.workers * 2 * 4 * numel  # fp32 push + pull of the whole model per worker-step
    result = {
        "test_accuracy": done[0][5],
        "steps": cfg.steps,
        "server_version": status["version"],
        "wall_s": round(wall, 3),
        "bytes_pushed": pushed,
        "bytes_pulled": pulled,
        "bytes_dense_equivalent": dense,
        "wire_reduction": round(dense / max(1, pushed + pulled), 2),
        "workers": cfg.workers,
        "density": cfg.density,
        "method": cfg.method,
        "params": numel,
        "server_bytes_in": status["bytes_in"],
        "server_bytes_out": status["bytes_out"],
        "config": asdict(cfg),
    }
    print(f"\nresult: test accuracy {result['test_accuracy']:.4f} after {result['steps']} steps in {wall:.1f} s",
          file=out)
    print(f"wire:   pushed {_mb(pushed)} + pulled {_mb(pulled)} = {_mb(pushed + pulled)}; dense exchange "
          f"would send {_mb(dense)} ({result['wire_reduction']}x less)", file=out, flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
    return result
