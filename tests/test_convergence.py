"""On digits, 1% density with error feedback reaches dense training's accuracy within
1.3x the steps (two workers, one-step-stale pipeline, real stella-ps)."""
from __future__ import annotations

import threading

import pytest
import torch

from stella import Compression, Connection, StellaOptimizer
from stella.demo import accuracy, build_mlp, load_digits_split

# 0.93, not 0.95: on this split the MLP plateaus at 0.93-0.96, so the step where a curve first holds 0.95 is
# noise (dense: 360-420 of 500 steps on this VM, never in one CI run); 0.93 lies on the slope (dense 190-290).
TARGET = 0.93
EVAL_EVERY = 10
MAX_STEPS = 500
LR = 0.05


def train(endpoint: str, density: float, method: str, lr: float = LR) -> list[tuple[int, float]]:
    """Two workers in threads; returns worker 0's (step, test accuracy) curve."""
    xtr, ytr, xte, yte = load_digits_split(0)
    models = [build_mlp((64, 128, 128, 10), 0) for _ in range(2)]  # built before the threads: torch's RNG is global
    curve: list[tuple[int, float]] = []
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            model = models[rank]
            opt = StellaOptimizer(model, endpoint, mode="gradient",
                                  optimizer={"name": "sgd", "lr": lr, "momentum": 0.9},
                                  compression=Compression(density=density, method=method),
                                  connection=Connection(timeout=60, worker_id=rank))
            gen = torch.Generator().manual_seed(rank)
            shard = torch.arange(rank, xtr.shape[0], 2)
            for step in range(1, MAX_STEPS + 1):
                b = shard[torch.randint(0, shard.numel(), (32,), generator=gen)]
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(xtr[b]), ytr[b]).backward()
                opt.step()
                if rank == 0 and step % EVAL_EVERY == 0:
                    curve.append((step, accuracy(model, xte, yte)))
            opt.close(flush=False)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return curve


def steps_to(curve, target, window: int = 3):
    """First step where the mean of the last ``window`` evaluations reaches ``target``
    (one lucky evaluation does not count)."""
    for i in range(window - 1, len(curve)):
        if sum(a for _, a in curve[i - window + 1:i + 1]) / window >= target:
            return curve[i][0]
    return None


@pytest.mark.slow
@pytest.mark.timeout(900)  # 2 x 500 steps x 2 workers; ~10 s idle, minutes on a contended 2-core machine
@pytest.mark.parametrize("method", ["threshold"])
def test_one_percent_reaches_dense_accuracy_within_1_3x_steps(make_server, method):
    torch.manual_seed(0)
    dense = train(make_server(2).endpoint, 1.0, "dense")
    sparse = train(make_server(2).endpoint, 0.01, method)
    d, s = steps_to(dense, TARGET), steps_to(sparse, TARGET)
    assert d is not None, f"dense never reached {TARGET}: {dense}"
    assert s is not None, f"1% never reached {TARGET}: {sparse}"
    assert s <= 1.3 * d, f"1% needed {s} steps, dense {d} (> 1.3x)\ndense {dense}\nsparse {sparse}"


if __name__ == "__main__":  # print both curves (python tests/test_convergence.py [LR ...])
    import os
    import sys
    import tempfile

    from stella_ps.process import ServerProcess
    from stella_ps.security import write_keyset

    keys = write_keyset(tempfile.mkdtemp(), clients=("client",))  # the suite's CurveZMQ set-up (conftest.curve_keys)
    os.environ.update({"STELLA_PS_KEYS": keys.server_secret, "STELLA_PS_ALLOW": keys.allowlist,
                       "STELLA_SERVER_KEY": keys.server_public, "STELLA_CLIENT_KEY": keys.client_secrets["client"]})

    for lr in map(float, sys.argv[1:] or [LR]):
        for density, method in ((1.0, "dense"), (0.01, "threshold")):
            with ServerProcess(2) as srv:
                c = train(srv.endpoint, density, method, lr)
            print(lr, density, method, {t: steps_to(c, t) for t in (0.9, TARGET, 0.95)}, flush=True)
