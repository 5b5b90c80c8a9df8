"""A step applies whole or not at all (issue 45): a failure injected at each stage of a
step, on a real server on a real socket, in this process (so that a stage can be made
to fail), and once in a real daemon whose undo fails too (it must exit 1).

Each stage's case checks that the model is exactly the state before the step or the
fully applied one (never part of it), that the version matches it (a replica built
from the pulls equals what the server says replicas hold), that the pulls waiting for
the step got an answer within a bound, and that the next step applies as usual."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from test_server_inprocess import InProcessServer

from stella import Client
from stella.errors import ServerError, StellaError
from stella_ps import aggregation, broadcast, service
from stella_ps.checkpoints import newest_valid
from stella_ps.config import Checkpoints, Pulls
from stella_ps.errors import KernelError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_W, N_B = 8192, 16  # "w" is the flat model's sparse part, "b" its dense suffix (stella.layout, dense cut 4096)
LR = 0.5
ANSWER_BOUND_S = 5.0  # a pull waiting for a failed step is answered within this (the step closes empty at once)


class Fault(RuntimeError):
    """The injected failure."""


def failing(real: Callable[..., Any], when: Callable[..., bool] = lambda *a, **k: True, times: int = 1,
            error: type[Exception] = Fault) -> Any:
    """``real``, except that its first ``times`` calls for which ``when`` holds raise ``error``
    (``.armed`` False turns it off; ``.hits`` counts the raises)."""

    def fake(*a: Any, **k: Any) -> Any:
        if fake.armed and when(*a, **k):
            fake.hits += 1
            if fake.hits >= times:
                fake.armed = False
            raise error("injected")
        return real(*a, **k)

    fake.armed, fake.hits = True, 0
    return fake


class _FailingDeque(deque):
    """A history whose next append fails (after the kernel applied a step, exact pulls)."""

    armed, hits = True, 0

    def append(self, x: Any) -> None:
        if self.armed:
            self.armed, self.hits = False, 1
            raise Fault("injected")
        super().append(x)


class Job:
    """A server in this process and two workers, ``a`` pushing part of ``w`` and ``b``
    pushing ``b`` whole, each keeping a replica from its pulls."""

    def __init__(self, keys: Any, pull: str, **config: Any):
        self.srv = InProcessServer(keys, workers=2, pulls=Pulls(mode=pull), **config)
        self.service = self.srv.server.service
        self.store = self.service.store
        rng = np.random.default_rng(0)
        self.init = {"w": rng.standard_normal(N_W).astype(np.float32), "b": rng.standard_normal(N_B).astype(np.float32)}
        self.a = Client(self.srv.endpoint, timeout=10)
        self.b = Client(self.srv.endpoint, timeout=10)
        self.a.register(self.init, {"name": "sgd", "lr": LR})
        self.b.register(self.init)
        self.replicas = [{k: v.copy() for k, v in self.init.items()} for _ in range(2)]
        self.version = 0

    def close(self) -> None:
        self.a.close(timeout=1.0)
        self.b.close(timeout=1.0)
        self.srv.close()

    def on_store(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the server's store thread (where the model lives)."""
        return asyncio.run_coroutine_threadsafe(self.service.store_thread.run(fn), self.srv.loop).result(10)

    def model(self) -> np.ndarray:
        """The exact model, flat."""
        return self.on_store(lambda: np.concatenate([s.snapshot() for s in self.store.tensors]))

    def held(self) -> np.ndarray:
        """What replicas hold (the broadcast's model, or the exact one), flat."""
        b = self.store.broadcast
        return self.model() if b is None else self.on_store(lambda: np.concatenate([m.copy() for m in b.model]))

    def push(self, who: Client) -> None:
        if who is self.a:
            who.push({"w": (np.arange(0, 400, 4, dtype=np.int32), np.ones(100, np.float32))}, self.version)
        else:
            who.push({"b": np.ones(N_B, np.float32)}, self.version)

    def pull(self, i: int) -> tuple[Any, float]:
        """Worker ``i``'s pull waiting for the next version: its answer (or the error raised) and its time."""
        c = (self.a, self.b)[i]
        t0 = time.monotonic()
        try:
            d = c.pull(self.version, wait_for=self.version + 1)
        except StellaError as e:
            return e, time.monotonic() - t0
        d.apply_to(self.replicas[i])
        return d, time.monotonic() - t0

    def step(self) -> list[tuple[Any, float]]:
        """Both push, both pull (each pull in its own thread: both wait at once)."""
        self.push(self.a)
        self.push(self.b)
        out: list[Any] = [None, None]
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, self.pull(i))) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return out

    def applied(self, before: np.ndarray) -> np.ndarray:
        """``before`` with one step of both workers' pushes applied (mean, lr)."""
        after = before.copy()
        after[0:400:4] -= np.float32(LR * 0.5)
        after[N_W:] -= np.float32(LR * 0.5)
        return after

    def check_replicas(self) -> None:
        held = self.held()
        for r in self.replicas:
            np.testing.assert_array_equal(np.concatenate([r["w"], r["b"]]), held)


@pytest.fixture
def job(curve_keys):
    jobs: list[Job] = []

    def make(pull: str) -> Job:
        jobs.append(Job(curve_keys, pull))
        return jobs[-1]

    yield make
    for j in jobs:
        j.close()


def _inject(stage: str, job: Job, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Make ``stage`` of the next step fail once; returns the fake."""
    store = job.store
    if stage == "decode":  # a push's values, on arrival
        fake = failing(service.decode_tensors)
        monkeypatch.setattr(service, "decode_tensors", fake)
    elif stage == "aggregate":  # the step's grouping of its pushes
        fake = failing(aggregation.Aggregator._group)
        monkeypatch.setattr(aggregation.Aggregator, "_group", fake)
    elif stage == "apply":  # the kernel: tensor 1 returns an error (and changed nothing) after tensor 0 applied
        fake = failing(store.tensors[1].apply, error=KernelError)
        monkeypatch.setattr(store.tensors[1], "apply", fake)
    elif stage == "broadcast":  # the residual and selection of tensor 1, after tensor 0's changed B and R
        fake = failing(broadcast.Broadcast._select, when=lambda self, t, *a: t == 1)
        monkeypatch.setattr(broadcast.Broadcast, "_select", fake)
    elif stage == "broadcast-encode":  # coding the broadcast's message
        fake = failing(broadcast.encode_tensors)
        monkeypatch.setattr(broadcast, "encode_tensors", fake)
    elif stage == "history":  # exact pulls: recording the step's coordinates, after the kernel applied it
        fake = store._history = _FailingDeque(store._history, maxlen=store._history.maxlen)
    elif stage == "pull-encode":  # the pulls' answer, after the step applied: while armed (the test disarms it)
        fake = failing(store._encode, times=1 << 30)
        monkeypatch.setattr(store, "_encode", fake)
    else:  # pragma: no cover
        raise AssertionError(stage)
    return fake


# stage -> (pull modes, what the failed step leaves: "undone" (closed empty) or "applied")
STAGES = {
    "decode": (("broadcast", "exact"), "applied"),  # the push is refused; sent again, the step applies whole
    "aggregate": (("broadcast", "exact"), "undone"),
    "apply": (("broadcast", "exact"), "undone"),
    "broadcast": (("broadcast",), "undone"),
    "broadcast-encode": (("broadcast",), "undone"),
    "history": (("exact",), "undone"),
    "pull-encode": (("broadcast", "exact"), "applied"),  # the pulls are refused; asked again, answered
}


@pytest.mark.parametrize(("stage", "pull"), [(s, p) for s, (modes, _) in STAGES.items() for p in modes])
def test_a_failure_at_each_stage_of_a_step_leaves_it_whole_or_undone_and_answers_its_pulls(
        job, monkeypatch, stage, pull):
    j = job(pull)
    for _ in range(2):  # two usual steps first (the broadcast owes something; pulls are hot)
        assert all(d.version == j.version + 1 for d, _ in j.step())
        j.version += 1
    j.check_replicas()
    before, stats = j.model(), j.srv.server.stats
    rejected = stats.rejected_steps
    fake = _inject(stage, j, monkeypatch)

    if stage == "decode":
        with pytest.raises(ServerError, match="internal"):
            j.push(j.a)  # refused, nothing queued: the client's next try is taken
        assert j.service.steps.pending_count() == 0 and j.store.version == j.version
        answers = j.step()
    else:
        answers = j.step()
    assert fake.hits == 1 or stage == "pull-encode", f"{stage}: the fault was not reached"
    for _, took in answers:
        assert took < ANSWER_BOUND_S, f"{stage}: a pull took {took:.1f}s"
    if stage == "pull-encode":  # the step applied; its answers could not be made: each pull is refused at once
        assert all(isinstance(got, ServerError) and "internal" in str(got) for got, _ in answers), answers
        fake.armed = False
        answers = [j.pull(i) for i in range(2)]  # asked again
    assert all(not isinstance(got, Exception) and got.version == j.version + 1 for got, _ in answers), answers
    j.version += 1
    assert j.store.version == j.version and j.a.status().version == j.version

    after = j.model()
    if STAGES[stage][1] == "undone":
        np.testing.assert_array_equal(after, before)  # not one coordinate of the failed step
        assert stats.rejected_steps == rejected + 1
    else:
        np.testing.assert_allclose(after, j.applied(before), rtol=0, atol=1e-6)
        assert stats.rejected_steps == rejected
    j.check_replicas()  # the version's model is what replicas hold

    for _ in range(2):  # and the job goes on
        before = j.model()
        assert all(d.version == j.version + 1 for d, _ in j.step())
        j.version += 1
        np.testing.assert_allclose(j.model(), j.applied(before), rtol=0, atol=1e-6)
    j.check_replicas()
    assert j.srv.server.failure is None


def test_a_listener_that_fails_after_a_step_costs_no_pull_its_answer(job, monkeypatch):
    """After the step applied: the checkpoint policy raising (a bug), or one waiting
    pull's answer failing, costs neither the step nor the other pulls."""
    j = job("broadcast")
    fake = failing(j.service.checkpointer.maybe)
    monkeypatch.setattr(j.service.steps, "_listeners",
                        [j.service.waiters.release, fake])  # the order the service registers them in
    answers = j.step()
    assert fake.hits == 1 and all(d.version == 1 for d, _ in answers)
    j.version = 1
    fake_answer = failing(j.store.cached_delta)  # the first pull released by the step: its answer fails
    monkeypatch.setattr(j.store, "cached_delta", fake_answer)
    answers = j.step()
    assert fake_answer.hits == 1
    errors = [got for got, _ in answers if isinstance(got, Exception)]
    assert len(errors) == 1 and "internal" in str(errors[0]), answers  # refused, not left waiting
    assert all(took < ANSWER_BOUND_S for _, took in answers)
    j.version = 2
    assert j.store.version == 2 and j.srv.server.failure is None


def test_a_step_whose_undo_fails_stops_the_in_process_server(job, monkeypatch):
    """Tensor 1 fails in the kernel and tensor 0's rollback fails too: the model may hold
    part of the step. No step closes after it, the store refuses to be copied, and the
    server stops serving by itself (its failure says why)."""
    j = job("exact")
    assert all(d.version == 1 for d, _ in j.step())
    j.version = 1
    _inject("apply", j, monkeypatch)

    def broken_rollback(touched: Any) -> None:
        raise Fault("injected: the rollback fails too")

    monkeypatch.setattr(j.store.tensors[0], "rollback", broken_rollback)
    j.push(j.a)
    j.push(j.b)
    deadline = time.monotonic() + ANSWER_BOUND_S
    while not j.srv.serving.done() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert j.srv.serving.done(), "the server went on serving a model it could not undo"
    assert j.srv.server.failure is not None and j.store.damaged and "could not be undone" in j.store.damaged
    assert j.store.version == 1 and j.service.steps.failed is not None


def test_a_failed_step_whose_empty_step_fails_too_stops_the_server_after_a_last_checkpoint(
        curve_keys, monkeypatch, tmp_path):
    """The broadcast fails at every step: the failed step is undone (the model is whole),
    but the empty step that would close it fails as well, so the version cannot move.
    The server stops serving by itself, and, its model being whole, writes its last
    checkpoint on the way out (the restart loses nothing)."""
    j = Job(curve_keys, "broadcast", checkpoints=Checkpoints(dir=str(tmp_path)))
    try:
        assert all(d.version == 1 for d, _ in j.step())
        j.version = 1
        before = j.model()
        monkeypatch.setattr(broadcast.Broadcast, "_select", failing(broadcast.Broadcast._select, times=1 << 30))
        j.push(j.a)
        j.push(j.b)
        deadline = time.monotonic() + ANSWER_BOUND_S
        while not j.srv.serving.done() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert j.srv.serving.done() and j.srv.server.failure is not None
        assert j.store.damaged is None and j.store.version == 1
        # the server is stopped (its store thread too): the model is read here
        np.testing.assert_array_equal(np.concatenate([t.snapshot() for t in j.store.tensors]), before)
    finally:
        j.close()
    found = newest_valid(str(tmp_path))
    assert found is not None and found[1].version == 1


FATAL_SCRIPT = textwrap.dedent('''
    """stella-ps whose kernel fails on the dense part of a step whose pushes hold 7.0, and whose rollback fails."""
    import sys

    from stella_ps import daemon
    from stella_ps.kernel import KernelTensorState

    real_apply = KernelTensorState.apply


    def apply(self, pushes, scale, cfg, **kw):
        if self.numel == N_B and any(float(p.values[0]) == 7.0 for p in pushes):
            raise RuntimeError("injected: a fault in the kernel's apply")
        return real_apply(self, pushes, scale, cfg, **kw)


    def rollback(self, touched):
        raise RuntimeError("injected: the rollback fails too")


    KernelTensorState.apply = apply
    KernelTensorState.rollback = rollback
    sys.exit(daemon.main(sys.argv[1:]))
''').replace("N_B", str(N_B))


def test_a_daemon_whose_step_cannot_be_undone_exits_1_keeping_its_newest_checkpoint(tmp_path):
    """A real stella-ps: step 4 fails part way and its undo fails too. The daemon logs
    why at CRITICAL and exits 1 (for its supervisor to restart it), within a bound; it
    writes no last checkpoint of the damaged model (the newest stays version 2, though
    the model had reached 3); the waiting pull is not answered, and is not left waiting
    beyond its own timeout."""
    script, ready, ckpt, log = tmp_path / "ps.py", tmp_path / "ready", tmp_path / "ckpt", tmp_path / "log"
    script.write_text(FATAL_SCRIPT)
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, str(script), "--bind", "tcp://127.0.0.1:0", "--workers", "2",
                                 "--ready-file", str(ready), "--checkpoint-dir", str(ckpt), "--checkpoint-every-steps",
                                 "2", "--log-format", "text"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.02)
        endpoint = ready.read_text().strip()
        rng = np.random.default_rng(0)
        init = {"w": rng.standard_normal(N_W).astype(np.float32), "b": rng.standard_normal(N_B).astype(np.float32)}
        a, b = Client(endpoint, timeout=5, reconnect=0), Client(endpoint, timeout=5, reconnect=0)
        try:
            a.register(init, {"name": "sgd", "lr": LR})
            b.register(init)
            for v in range(3):
                a.push({"w": (np.array([1, 2], np.int32), np.ones(2, np.float32))}, v)
                b.push({"b": np.ones(N_B, np.float32)}, v)
                assert a.pull(v, wait_for=v + 1).version == v + 1
                if v == 1:  # the checkpoint of version 2 is on disk before the next steps
                    while (found := newest_valid(str(ckpt))) is None or found[1].version < 2:
                        assert time.monotonic() < deadline, log.read_text()
                        time.sleep(0.02)
            a.push({"w": (np.array([1, 2], np.int32), np.ones(2, np.float32))}, 3)
            t0 = time.monotonic()
            b.push({"b": np.full(N_B, 7.0, np.float32)}, 3)
            with pytest.raises(StellaError):  # no answer: the server is gone (a worker would reconnect)
                a.pull(3, wait_for=4, timeout=2)
            assert proc.wait(10) == 1, log.read_text()
            assert time.monotonic() - t0 < 10
        finally:
            a.close(timeout=0.5)
            b.close(timeout=0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "CRITICAL" in text and "could not be undone" in text and "exiting 1" in text, text
    assert "no last checkpoint" in text, text
    found = newest_valid(str(ckpt))
    assert found is not None and found[1].version == 2, text
