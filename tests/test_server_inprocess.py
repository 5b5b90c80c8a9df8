"""The server in this process, on a real socket: its internals can be observed and
paused, which a subprocess hides."""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from stella import Client
from stella_ps.config import Pulls, ServerConfig
from stella_ps.server import ParameterServer


class InProcessServer:
    """A ParameterServer on its own event loop in a background thread, on port 0."""

    def __init__(self, keys, **config):
        # pulls of exact values: the tests read the values a pull installs
        config.setdefault("pulls", Pulls(mode="exact"))
        self.server = ParameterServer(ServerConfig(bind="tcp://127.0.0.1:0", keys=keys.server_secret,
                                                   allow=keys.allowlist, **config))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.endpoint = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)
        self.serving = asyncio.run_coroutine_threadsafe(self.server.serve(), self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.stop)
        self.serving.result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        assert not self.thread.is_alive(), "server did not stop"
        self.loop.close()


@pytest.fixture
def inproc(curve_keys):
    servers = []

    def make(**config) -> InProcessServer:
        s = InProcessServer(curve_keys, **config)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


def test_round_trip_and_clean_stop(inproc):
    srv = inproc()
    with Client(srv.endpoint, timeout=10) as c:
        c.register({"w": np.arange(8, dtype=np.float32)}, {"name": "sgd", "lr": 1.0})
        c.push({"w": (np.array([2, 5], np.int32), np.array([1.0, -1.0], np.float32))}, 0)
        d = c.pull(0, wait_for=1)
        np.testing.assert_array_equal(d.tensors["w"][0], [2, 5])
        np.testing.assert_array_equal(d.tensors["w"][1], [1.0, 6.0])
    service = srv.server.service
    assert service.store.version == 1 and srv.server.stats.steps == 1
    assert len(service.waiters) == 0 and not service.steps.agg.has_pending()


def test_set_optimizer_during_an_apply_is_not_lost(inproc, monkeypatch):
    """A learning-rate change that arrives while a step is being applied on the store
    thread holds after that step: the store never writes the configuration back (it
    used to write the step's old configuration over the new one). (Every step on the
    store thread: a light one would be applied on the loop, which no request can
    interrupt.)"""
    from stella_ps import steps as steps_mod

    monkeypatch.setattr(steps_mod, "LIGHT_STEP_VALUES", -1)
    srv = inproc()
    store = srv.server.service.store
    entered, release = threading.Event(), threading.Event()
    apply_step = store.apply_step

    def slow_apply(step, cfg):
        entered.set()
        assert release.wait(10)
        return apply_step(step, cfg)

    store.apply_step = slow_apply
    with Client(srv.endpoint, timeout=10) as a, Client(srv.endpoint, timeout=10) as b:
        a.register({"w": np.zeros(4, np.float32)}, {"name": "sgd", "lr": 1.0})
        b.register({"w": np.zeros(4, np.float32)})
        a.push({"w": np.ones(4, np.float32)}, 0)  # b is live too, so step 0 closes on b's push:
        b.push({"w": np.ones(4, np.float32)}, 0)
        assert entered.wait(10)  # step 0 is on the store thread now
        assert a.set_optimizer(lr=0.125)["lr"] == 0.125
        release.set()
        d = a.pull(0, wait_for=1)
        np.testing.assert_array_equal(d.tensors["w"][1], [-1.0] * 4)  # step 0 ran at lr 1
        assert a.status().optimizer["lr"] == 0.125  # and the change made meanwhile holds
        store.apply_step = apply_step
        a.push({"w": np.ones(4, np.float32)}, 1)
        b.push({"w": np.ones(4, np.float32)}, 1)
        d = a.pull(1, wait_for=2)
        np.testing.assert_array_equal(d.tensors["w"][1], [-1.125] * 4)  # step 1 at the new lr


def _steps_on_threads(inproc, monkeypatch, light: int) -> tuple[list[str], np.ndarray]:
    """Six AdamW steps of one worker, pushes of 10 to 3,000 values, with ``LIGHT_STEP_VALUES``
    at ``light``: the thread each step was applied on, and the model after them."""
    from stella_ps import steps as steps_mod

    monkeypatch.setattr(steps_mod, "LIGHT_STEP_VALUES", light)
    threads: list[str] = []
    apply_whole = steps_mod.StepScheduler._apply_whole

    def recorded(self, *args):
        threads.append(threading.current_thread().name)
        return apply_whole(self, *args)

    monkeypatch.setattr(steps_mod.StepScheduler, "_apply_whole", recorded)
    srv = inproc()
    rng = np.random.default_rng(0)
    n = 20_000
    with Client(srv.endpoint, timeout=10) as c:
        c.register({"w": rng.standard_normal(n).astype(np.float32)}, {"name": "adamw", "lr": 0.01})
        for v, k in enumerate((10, 3000, 10, 3000, 500, 10)):
            idx = np.sort(rng.choice(n, k, replace=False)).astype(np.int32)
            c.push({"w": (idx, rng.standard_normal(k).astype(np.float32))}, v)
            assert c.pull(v, wait_for=v + 1).version == v + 1
        model = c.pull(None).tensors["w"][1].copy()
    return threads, model


def test_a_light_step_applies_on_the_loop_and_a_heavy_one_on_the_store_thread(inproc, monkeypatch):
    """Steps of few values skip the hop to the store thread (when it is idle); larger ones
    take it; the model is the same bit for bit either way."""
    mixed, model = _steps_on_threads(inproc, monkeypatch, 1000)
    loop = mixed[0]
    assert loop != "stella-store_0"
    assert mixed == [loop, "stella-store_0", loop, "stella-store_0", loop, loop]
    every, reference = _steps_on_threads(inproc, monkeypatch, -1)
    assert every == ["stella-store_0"] * 6
    assert model.tobytes() == reference.tobytes()




def test_a_reply_sent_just_before_the_stop_reaches_its_peer(inproc, monkeypatch):
    """The server stops in the moment it sends a reply (as the daemon does when the step
    a push closed cannot be undone: that push's acknowledgement goes out, then the
    server stops): the reply still reaches the client whole. Closed at once (no
    ``FLUSH_GRACE_S``, no linger), 8 MiB were lost in most runs: the TCP connection was
    reset under them."""
    from stella import client as client_mod
    from stella_ps import server as server_mod

    monkeypatch.setattr(client_mod, "CHUNK_ABOVE", 1 << 30)  # the answer in one message, not fetched in pieces
    numel = 1 << 21  # 8 MiB of model: still on its way when the server stops
    init = {"w": np.arange(numel, dtype=np.float32)}
    send, armed = server_mod.ParameterServer._send, threading.Event()

    def send_then_stop(self, ident, msg, frames):
        send(self, ident, msg, frames)
        if armed.is_set() and sum(memoryview(f).nbytes for f in frames) >= 4 * numel:
            self.stop()

    monkeypatch.setattr(server_mod.ParameterServer, "_send", send_then_stop)
    srv = inproc()
    c = Client(srv.endpoint, timeout=3, reconnect=0)
    try:
        c.register(init, {"name": "sgd", "lr": 1.0})
        armed.set()
        full = c.pull()
    finally:
        c.close(timeout=0.3)
    np.testing.assert_array_equal(full.tensors["w"][1], init["w"])
    assert srv.serving.result(5) is None  # it stopped
