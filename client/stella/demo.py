"""``stella demo``: a real two-worker training run through a real ``stella-ps``.

Starts a ``stella-ps`` subprocess and ``workers`` worker processes on loopback. Each
worker trains the same MLP on its shard of scikit-learn's handwritten digits
(1,797 real 8x8 images that ship with the package; 20% held out, stratified), pushing
top-k compressed gradients with error feedback and pulling back what changed, through
the one-step-stale pipeline (:class:`stella.StellaOptimizer`). Worker 0 also
evaluates the held-out accuracy of its replica as training goes, and at the end
on the final model.

The demo is the application that composes both packages: the client library
(``stella``) for the workers and the server's launcher
(:class:`stella_ps.process.ServerProcess`), imported only inside :func:`run_demo` so
that importing the client library never imports the server package.

It also owns the digits data and model helpers that the benchmarks and tests reuse
(``bench.workloads``, ``bench.pipeline``, ``tests/test_convergence.py``), so there is
one split and one MLP: :func:`load_digits_split`, :func:`build_mlp`, :func:`accuracy`.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["DemoConfig", "run_demo", "run_demo_worker", "load_digits_split", "build_mlp", "accuracy",
           "shuffled_batches",
           "TEST_FRACTION"]

TEST_FRACTION = 0.2  # held out per class (stratified)


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
    progress_every: int = 100  # each worker logs a progress line every this many steps (0: none)


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as (data float64 (1797, 64) in 0..16, target int64), read from
    the CSV that ships inside scikit-learn without importing it (the import costs ~2.5 s
    per worker process); identical to ``sklearn.datasets.load_digits()``."""
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")
    path = os.path.join(os.path.dirname(spec.origin), "datasets", "data", "digits.csv.gz") if spec and spec.origin \
        else ""
    if os.path.exists(path):
        d = np.loadtxt(path, delimiter=",")
        return d[:, :-1], d[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.data, bunch.target.astype(np.int64)


def load_digits_split(seed: int = 0, test_fraction: float = TEST_FRACTION):
    """Digits as float32 tensors scaled to [0, 1]: ``(x_train, y_train, x_test, y_test)``.

    Stratified: ``round(test_fraction * n_c)`` images of each class ``c``, drawn with
    ``seed``, are held out (359 of 1,797 at 20%); both parts keep the file order.
    """
    import numpy as np
    import torch

    data, target = load_digits_arrays()
    rng = np.random.default_rng(seed)
    test = np.zeros(len(target), dtype=bool)
    for c in np.unique(target):
        members = np.flatnonzero(target == c)
        test[rng.permutation(members)[:round(test_fraction * len(members))]] = True
    x = torch.from_numpy((data / 16.0).astype(np.float32))
    y = torch.from_numpy(target)
    tr, te = torch.from_numpy(np.flatnonzero(~test)), torch.from_numpy(np.flatnonzero(test))
    return x[tr], y[tr], x[te], y[te]


def build_mlp(widths: Sequence[int], seed: int) -> torch.nn.Sequential:
    """``Linear(widths[0], widths[1]) - ReLU - ... - Linear(widths[-2], widths[-1])``,
    initialised from ``torch.manual_seed(seed)``."""
    import torch

    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def demo_model(hidden: int, seed: int) -> torch.nn.Sequential:
    """The demo's MLP: 64 pixels - ``hidden`` - ``hidden`` - 10 classes."""
    return build_mlp((64, hidden, hidden, 10), seed)


def shuffled_batches(n: int, batch_size: int, gen: torch.Generator) -> Iterator[torch.Tensor]:
    """Index batches of ``range(n)``, epoch after epoch, each epoch a fresh permutation
    from ``gen`` (the tail shorter than a batch is dropped)."""
    import torch

    while True:
        perm = torch.randperm(n, generator=gen)
        for pos in range(0, n - batch_size + 1, batch_size):
            yield perm[pos:pos + batch_size]


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Share of ``x`` classified as ``y`` (eval mode, no grad; the mode is restored)."""
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return float((model(x).argmax(1) == y).float().mean())
    finally:
        model.train(was_training)


def _worker(address: str, rank: int, cfg: DemoConfig, progress, keys: dict[str, str]) -> None:
    import torch

    from .options import Compression, Connection
    from .pipeline import StellaOptimizer

    torch.set_num_threads(1)
    if cfg.progress_every:
        from .progress import log_to_stderr

        log_to_stderr()
    xtr, ytr, xte, yte = load_digits_split(cfg.seed)
    shard = torch.arange(rank, xtr.shape[0], cfg.workers)
    xtr, ytr = xtr[shard], ytr[shard]
    model = demo_model(cfg.hidden, cfg.seed)
    opt = StellaOptimizer(model, address, optimizer={"name": "adamw", "lr": cfg.lr, "weight_decay": 0.0},
                          compression=Compression(density=cfg.density, method=cfg.method),
                          connection=Connection(timeout=cfg.timeout, name=f"demo-worker-{rank}",
                                                server_key=keys.get("server_key"), client_key=keys.get("client_key")),
                          progress_every=cfg.progress_every)
    # the learning rate falls linearly to a tenth over the run, so that the last step's model, the one
    # evaluated, is not caught mid-oscillation (a constant rate left it 2-4 points off its best at random)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - 0.9 * min(s, cfg.steps) / cfg.steps)
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    batches = shuffled_batches(xtr.shape[0], cfg.batch_size, gen)
    try:
        for step in range(cfg.steps):
            b = next(batches)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xtr[b]), ytr[b])
            loss.backward()
            opt.step()
            sched.step()
            acc = None
            if rank == 0 and (step + 1) % cfg.eval_every == 0:
                acc = accuracy(model, xte, yte)
            progress.put(("step", rank, step + 1, loss.item(), opt.bytes_pushed, opt.bytes_pulled, acc, opt.version))
        opt.synchronize()  # install the last step: the replica equals the server's model
        final_acc = accuracy(model, xte, yte) if rank == 0 else None
        version = opt.version
    finally:
        opt.close()  # pushes what is left in the error-feedback residual, leaves
    progress.put(("done", rank, opt.bytes_pushed, opt.bytes_pulled, version, final_acc))


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def run_demo(cfg: DemoConfig, *, json_path: str | None = None, out: TextIO = sys.stdout) -> dict[str, Any]:
    """Run the demo; prints progress and a summary, returns the figures."""
    from stella_ps.process import ServerProcess  # the application composes client and server

    t0 = time.perf_counter()
    ps = ServerProcess(cfg.workers, log_level="WARNING")
    endpoint = ps.endpoint
    ctx = mp.get_context("spawn")
    progress = ctx.Queue()
    # the server runs with CurveZMQ keys made for this run; each worker gets the client's pair
    procs = [ctx.Process(target=_worker, args=(endpoint, r, cfg, progress, ps.client_kwargs()), daemon=True)
             for r in range(cfg.workers)]
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
                    raise RuntimeError(f"demo worker failed (exit codes {[p.exitcode for p in procs]}); "
                                       f"stella-ps log:\n{ps.logs()[-4000:]}") from None
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

        keys = ps.client_kwargs()
        with Client(endpoint, timeout=10, join=False, server_key=keys.get("server_key"),
                    client_key=keys.get("client_key")) as c:
            status = c.status()
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        ps.close()
    wall = time.perf_counter() - t0
    model = demo_model(cfg.hidden, cfg.seed)
    numel = sum(p.numel() for p in model.parameters())
    pushed = sum(m[2] for m in done.values())
    pulled = sum(m[3] for m in done.values())
    dense = cfg.steps * cfg.workers * 2 * 4 * numel  # fp32 push + pull of the whole model per worker-step
    result = {
        "test_accuracy": done[0][5],
        "steps": cfg.steps,
        "server_version": status.version,
        "wall_s": round(wall, 3),
        "bytes_pushed": pushed,
        "bytes_pulled": pulled,
        "bytes_dense_equivalent": dense,
        "wire_reduction": round(dense / max(1, pushed + pulled), 2),
        "workers": cfg.workers,
        "density": cfg.density,
        "method": cfg.method,
        "params": numel,
        "server_bytes_in": status.bytes_in,
        "server_bytes_out": status.bytes_out,
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


class _PrintProgress:
    """The progress sink of a lone demo worker (``stella demo --server``): rank 0's
    evaluations, printed as they come."""

    def __init__(self, cfg: DemoConfig, out: TextIO):
        self.cfg, self.out = cfg, out
        self.final: tuple | None = None

    def put(self, msg: tuple) -> None:
        if msg[0] == "done":
            self.final = msg
            return
        _, _rank, step, loss, pushed, pulled, acc, version = msg
        if acc is not None:
            print(f"step {step:4d}/{self.cfg.steps} | loss {loss:.4f} | test acc {acc:.4f} | version {version} | "
                  f"pushed {_mb(pushed)} | pulled {_mb(pulled)}", file=self.out, flush=True)


def run_demo_worker(address: str, rank: int, cfg: DemoConfig, *, json_path: str | None = None,
                    out: TextIO = sys.stdout) -> int:
    """One worker of the demo against a running ``stella-ps`` at ``address`` (keys from
    ``STELLA_SERVER_KEY``/``STELLA_CLIENT_KEY``): what each site's container runs in
    the lab compose file. Rank 0 prints the final held-out accuracy; returns 0."""
    t0 = time.perf_counter()
    print(f"stella demo worker {rank}/{cfg.workers}: stella-ps at {address}, {cfg.steps} steps, density "
          f"{cfg.density:.0%} ({cfg.method})", file=out, flush=True)
    sink = _PrintProgress(cfg, out)
    _worker(address, rank, cfg, sink, {})
    assert sink.final is not None
    _, _, pushed, pulled, version, final_acc = sink.final
    wall = time.perf_counter() - t0
    result = {"rank": rank, "test_accuracy": final_acc, "steps": cfg.steps, "server_version": version,
              "wall_s": round(wall, 3), "bytes_pushed": pushed, "bytes_pulled": pulled, "config": asdict(cfg)}
    acc = "" if final_acc is None else f"test accuracy {final_acc:.4f} "
    print(f"result: {acc}after {cfg.steps} steps in {wall:.1f} s (server version {version}); "
          f"pushed {_mb(pushed)}, pulled {_mb(pulled)}", file=out, flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
    return 0
