"""A small AdamW Transformer (the byte LM of bench.workloads, shrunk) trained through a
real stella-ps in update mode, two workers, one round of overlap: it must reach the
held-out loss that dense data-parallel training reaches.

- With a fixed compression (1% of each tensor, q4 values) and one local step a round,
  the run does not depend on timing: it must take no more than 1.2x the dense run's
  steps (it takes 120 against 140 here, every time).
- With the defaults (the controller picks density and coding from the measured
  rounds, and a round runs on with more local steps while its exchange is in flight),
  the steps depend on how the threads and the server are scheduled: 100 to 170 in
  runs on the 2-core VM, 1.2x being 168. So this run must reach the target, within
  1.5x; the bound on iterations is the fixed run's.

The dense run is DDP's arithmetic in one process: one AdamW on the mean loss of both
workers' batches (the mean of two per-worker mean gradients)."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from bench import workloads as W
from stella import Compression, Connection, StellaOptimizer, Sync

pytestmark = pytest.mark.slow

BATCH, LR, EVAL_EVERY, MAX_STEPS, TARGET = 8, 3e-3, 10, 250, 2.6
SIZE = {"d_model": 64, "n_layers": 2, "n_heads": 4}


def make_model() -> torch.nn.Module:
    return W._build_lm(0, **SIZE)


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.01)


@torch.no_grad()
def heldout_loss(model: torch.nn.Module) -> float:
    x, y = W._lm_eval_set()
    x, y = x[:32], y[:32]
    return F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)).item()


def steps_to_target(curve: list[tuple[int, float]]) -> int | None:
    return next((s for s, loss in curve if loss <= TARGET), None)


def dense_curve() -> list[tuple[int, float]]:
    model = make_model()
    opt = adamw(model.parameters())
    feeds = [W._lm_batches(r, 2, BATCH, 0) for r in (0, 1)]
    curve = []
    for step in range(1, MAX_STEPS + 1):
        opt.zero_grad()
        loss = sum(W._lm_loss(model, next(f)) for f in feeds) / 2
        loss.backward()
        opt.step()
        if step % EVAL_EVERY == 0:
            curve.append((step, heldout_loss(model)))
            if curve[-1][1] <= TARGET:
                break
    return curve


def stella_curve(endpoint: str, **kw) -> list[tuple[int, float]]:
    models = [make_model(), make_model()]
    curve: list[tuple[int, float]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def worker(rank: int) -> None:
        try:
            model = models[rank]
            opt = StellaOptimizer(model, endpoint, optimizer=adamw(model.parameters()),
                                  connection=Connection(timeout=60, worker_id=rank), **kw)
            feed = W._lm_batches(rank, 2, BATCH, 0)
            for step in range(1, MAX_STEPS + 1):
                opt.zero_grad()
                W._lm_loss(model, next(feed)).backward()
                opt.step()
                if rank == 0 and step % EVAL_EVERY == 0:
                    curve.append((step, heldout_loss(model)))
                    if curve[-1][1] <= TARGET:
                        stop.set()
                # both workers stop at the same step (a synchronous server waits for every live worker)
                if stop.is_set() and step % EVAL_EVERY == 0:
                    break
            opt.close()
        except BaseException as e:
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=worker, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    return curve


@pytest.fixture(scope="module")
def dense_steps() -> int:
    torch.set_num_threads(1)
    dense = steps_to_target(dense_curve())
    assert dense is not None and 1.5 * dense <= MAX_STEPS, "the dense reference must reach the target"
    return dense


@pytest.mark.parametrize("config, bound", [
    ({"compression": Compression(density=0.01, value_dtype="q4"), "sync": Sync(max_every=1)}, 1.2),
    ({}, 1.5),
], ids=["fixed-1pct-q4", "defaults"])
def test_adamw_transformer_in_update_mode_reaches_the_dense_loss(make_server, dense_steps, config, bound):
    torch.set_num_threads(1)
    curve = stella_curve(make_server(2).endpoint, **config)
    got = steps_to_target(curve)
    assert got is not None, f"update mode never reached {TARGET}: {curve}"
    print(f"steps to held-out loss {TARGET}: dense {dense_steps}, update mode {got}")
    assert got <= bound * dense_steps, f"update mode needed {got} steps, dense {dense_steps}: {curve}"
