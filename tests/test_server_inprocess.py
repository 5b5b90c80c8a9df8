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


def test_set_optimizer_during_an_apply_is_not_lost(inproc):
    """A learning-rate change that arrives while a step is being applied on the store
    thread holds after that step: the store never writes the configuration back (it
    used to write the step's old configuration over the new one)."""
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
