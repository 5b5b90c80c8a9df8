"""The store's per-tensor work on several threads (``stella-ps --threads``): the same
bits as one thread, step for step, and a step that fails in one tensor undone in all."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from stella.payload import SparseTensor
from stella.protocol import TensorSpec
from stella_ps import runtime
from stella_ps.aggregation import Step
from stella_ps.config import Pulls
from stella_ps.errors import NonFiniteStep
from stella_ps.optim import OptimizerConfig
from stella_ps.runtime import TensorPool
from stella_ps.store import ModelStore

SIZES = [100_000, 3_000, 250_000, 17, 60_000, 1]  # large ones and ones that go whole in the broadcast
OPTIMIZERS = [OptimizerConfig.from_wire({"name": "sgd", "lr": 0.1, "momentum": 0.9}),
              OptimizerConfig.from_wire({"name": "adamw", "lr": 1e-3, "weight_decay": 0.01})]


def _store(threads: int, cfg: OptimizerConfig, pull: str = "broadcast") -> ModelStore:
    s = ModelStore(Pulls(mode=pull, values="q4", factor=2.0), history=64, threads=threads, dense_below=4096)  # type: ignore[arg-type]
    rng = np.random.default_rng(0)
    s.initialise([TensorSpec(f"t{i}", (n,), "float32") for i, n in enumerate(SIZES)],
                 [rng.standard_normal(n).astype(np.float32) for n in SIZES], cfg)
    return s


def _step(rng: np.random.Generator, workers: int = 3, big: float | None = None) -> Step:
    per_tensor = []
    for t, n in enumerate(SIZES):
        parts = []
        for _ in range(workers):
            k = max(1, n // 50)
            idx = np.sort(rng.choice(n, k, replace=False)).astype(np.int32)
            vals = rng.standard_normal(k).astype(np.float32)
            if big is not None and t == 2:
                vals[:] = big  # two of these overflow float32 when summed
            parts.append(SparseTensor(t, idx, vals))
        per_tensor.append(parts)
    return Step(per_tensor=per_tensor, scale=1.0 / workers, contributors=list(range(workers)), late=0, hparams=[])


def _state(s: ModelStore) -> list[np.ndarray]:
    out = [t.snapshot() for t in s.tensors]
    if s.broadcast is not None:
        out += s.broadcast.model + s.broadcast.residual
    return out


@pytest.fixture(autouse=True)
def _parallel_whatever_the_work(monkeypatch):
    """These steps are light: a store would run them on one thread (PARALLEL_MIN_WORK)."""
    monkeypatch.setattr(runtime, "PARALLEL_MIN_WORK", 0)


@pytest.mark.parametrize("cfg", OPTIMIZERS, ids=lambda c: c.name)
def test_threads_give_the_same_bits_as_one(cfg):
    one, four = _store(1, cfg), _store(4, cfg)
    for k in range(6):
        step = _step(np.random.default_rng(k))
        assert one.apply_step(step, cfg) == four.apply_step(step, cfg) == k + 1
        for a, b in zip(_state(one), _state(four)):
            np.testing.assert_array_equal(a, b)
        ea, eb = one.encoded_delta(k, "rice"), four.encoded_delta(k, "rice")
        assert ea.entries == eb.entries
        assert [bytes(memoryview(f)) for f in ea.frames] == [bytes(memoryview(f)) for f in eb.frames]
    one.close()
    four.close()


@pytest.mark.parametrize("pull", ["broadcast", "exact"])
def test_a_step_non_finite_in_one_tensor_changes_no_tensor(pull):
    cfg = OPTIMIZERS[0]
    s = _store(3, cfg, pull)
    s.apply_step(_step(np.random.default_rng(1)), cfg)
    before = _state(s)
    with pytest.raises(NonFiniteStep):
        s.apply_step(_step(np.random.default_rng(2), big=3e38), cfg)
    assert s.version == 1
    for a, b in zip(before, _state(s)):
        np.testing.assert_array_equal(a, b)
    assert s.apply_step(_step(np.random.default_rng(3)), cfg) == 2  # and the next step applies
    s.close()


def test_pool_runs_every_tensor_in_order_on_several_threads_and_returns_errors():
    pool = TensorPool(3)
    # by size, largest first into the lightest bin: {2}, {5}, {0, 1, 3, 4, 6}; the first tensor of each
    # bin waits for the other two, so the three bins must run at once
    together = threading.Barrier(3, timeout=30)

    def fn(t: int) -> int:
        if t in (2, 5, 0):
            together.wait()
        if t == 4:
            raise ValueError("tensor 4")
        return t * t

    out = pool.map(fn, [10, 1, 1000, 5, 7, 300, 2])
    assert out[:4] == [0, 1, 4, 9] and out[5:] == [25, 36]
    assert isinstance(out[4], ValueError)  # and the others still ran
    pool.close()
    assert TensorPool(1).map(lambda t: t, [1, 2]) == [0, 1]
    with pytest.raises(ValueError):
        TensorPool(0)


def test_light_work_stays_on_the_callers_thread():
    pool = TensorPool(2, min_work=1000)
    me = threading.get_ident()
    where: dict[int, int] = {}

    def fn(t: int) -> None:
        where[t] = threading.get_ident()

    pool.map(fn, [400, 500])
    assert set(where.values()) == {me}
    pool.map(fn, [600, 500])
    assert where[0] == me and where[1] != me  # a bin on each thread
    pool.close()
    assert TensorPool(2).min_work == runtime.PARALLEL_MIN_WORK


def test_a_snapshot_of_the_broadcast_model_is_not_changed_by_the_next_step():
    """The snapshot's frames are sent zero-copy, after the store thread has moved on to
    the next step: they must hold this version's B, not a view of the live one."""
    cfg = OPTIMIZERS[0]
    s = _store(1, cfg)
    s.apply_step(_step(np.random.default_rng(1)), cfg)
    snap = s.encoded_delta(-1, "rice")
    assert snap.full
    sent = [bytes(memoryview(f)) for f in snap.frames]
    s.apply_step(_step(np.random.default_rng(2)), cfg)
    assert [bytes(memoryview(f)) for f in snap.frames] == sent
    assert sent != [bytes(memoryview(f)) for f in s.encoded_delta(-1, "rice").frames]  # B did change
    s.close()
