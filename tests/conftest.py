"""Fixtures: real stella-ps processes on ephemeral loopback ports (always reaped), clients
that are always closed, and a guard that every ZeroMQ socket is closed again.

Servers (all :class:`stella_ps.process.ServerProcess`, log level DEBUG, cwd = repo root):

- ``server``: one single-worker server for the test.
- ``make_server(workers=1, args=(), pull=None, **kw)``: start as many as the test needs;
  all are stopped after the test. ``pull="exact"`` adds ``--pull exact`` (pulls of exact
  values, which many tests check bit for bit; the default is the compressed broadcast).
  ``kw`` goes to ``ServerProcess`` (``env``, ``bind``, ...).
- ``exact_server``: ``server`` with ``--pull exact``.
- ``module_server_factory``: the same factory, module scope, for a module whose tests
  share one server (bad-input tables, expensive set-ups)::

      @pytest.fixture(scope="module")
      def srv(module_server_factory):
          return module_server_factory(1, ["--max-message-bytes", str(MAX_MSG)])

Pass ``args`` (extra flags) as a list, e.g. ``make_server(1, ["--history", "3"])``.
"""
from __future__ import annotations

import functools
import gc
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import zmq

from stella import Client
from stella.client import curve_keys as stella_curve_keys
from stella_ps.process import ServerProcess
from stella_ps.security import KeySet, write_keyset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZMQ_TERM_TIMEOUT_S = 10.0


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``make test``/``test-fast``: ``-n 3 --dist loadgroup``), the tests
    of a module that share a module-scoped fixture (a server, a build, a set-up of seconds)
    run on one worker, so that it is made once, and the tests marked ``testbed`` run on one
    worker, one at a time; every other test goes wherever a worker is free. Everything else
    the tests share is the worker's own: ephemeral ports, temporary directories, the
    environment (the session's keys), hypothesis' database."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        # the test bed's training runs and timed transfers run one after another: two side by side (a soak's
        # three workers beside a cut's two, all on two cores) stretch each other's step spreads past what
        # their assertions allow (a 12 s cut fell inside a 14 s adaptive deadline)
        if item.get_closest_marker("testbed") is not None:
            item.add_marker(pytest.mark.xdist_group("testbed"))
            continue
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        shared = [name for name, defs in info.name2fixturedefs.items()
                  if defs and defs[-1].scope == "module" and name != "zmq_context_terminates"]
        if shared:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


@pytest.fixture(scope="session", autouse=True)
def curve_keys(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeySet]:
    """The whole suite runs over CurveZMQ, the default: one key set for the session, in
    the environment every server (``STELLA_PS_KEYS``/``STELLA_PS_ALLOW``) and every client
    (``STELLA_SERVER_KEY``/``STELLA_CLIENT_KEY``) of the tests reads, subprocesses
    included. ``keys.client_secrets["outsider"]`` is a valid key pair that is NOT on the
    allowlist."""
    directory = str(tmp_path_factory.mktemp("curve"))
    keys = write_keyset(directory, clients=("client",))
    outsider = write_keyset(os.path.join(directory, "outsider"), clients=("outsider",))
    keys.client_secrets["outsider"] = outsider.client_secrets["outsider"]
    env = {"STELLA_PS_KEYS": keys.server_secret, "STELLA_PS_ALLOW": keys.allowlist,
           "STELLA_SERVER_KEY": keys.server_public, "STELLA_CLIENT_KEY": keys.client_secrets["client"]}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield keys
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def curve_dealer(endpoint: str, ctx: zmq.Context | None = None, *, timeout_ms: int = 10000) -> zmq.Socket:
    """A bare DEALER with the session's client keys, for hand-made (bad) messages."""
    sock = (ctx or zmq.Context.instance()).socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    keys = stella_curve_keys()
    if keys is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys
    sock.connect(endpoint)
    return sock


@pytest.fixture
def raw_dealer() -> Iterator[Callable[[str], zmq.Socket]]:
    """Factory of bare CurveZMQ DEALER sockets (closed after the test)."""
    socks: list[zmq.Socket] = []

    def make(endpoint: str) -> zmq.Socket:
        socks.append(curve_dealer(endpoint))
        return socks[-1]

    yield make
    for sock in socks:
        sock.close(linger=0)


ServerFactory = Callable[..., ServerProcess]


def _all_at_once(calls: Iterable[Callable[[], object]]) -> None:
    """Run ``calls`` side by side and raise the first error: a test's servers stop and its
    clients leave in parallel (a client's close waits for its heartbeat thread, a server's for
    its graceful shutdown), not one after another."""
    calls = list(calls)
    if len(calls) < 2:
        for call in calls:
            call()
        return
    with ThreadPoolExecutor(len(calls), thread_name_prefix="teardown") as pool:
        for future in [pool.submit(call) for call in calls]:
            future.result()


def _server_factory() -> Iterator[ServerFactory]:
    servers: list[ServerProcess] = []

    def make(workers: int = 1, args: Sequence[str] = (), *, pull: str | None = None, **kw: Any) -> ServerProcess:
        kw.setdefault("log_level", "DEBUG")
        kw.setdefault("cwd", ROOT)
        if pull is not None:  # "exact": pulls of exact values, the semantics many tests check bit for bit
            args = [*args, "--pull", pull]
        s = ServerProcess(workers, args, **kw)
        servers.append(s)
        return s

    yield make
    _all_at_once(s.close for s in servers)


@pytest.fixture
def make_server() -> Iterator[ServerFactory]:
    """Factory of servers that live until the end of the test."""
    yield from _server_factory()


@pytest.fixture(scope="module")
def module_server_factory() -> Iterator[ServerFactory]:
    """Factory of servers that live until the end of the module (shared by its tests)."""
    yield from _server_factory()


@pytest.fixture
def server(make_server: ServerFactory) -> ServerProcess:
    return make_server(1)


@pytest.fixture
def exact_server(make_server: ServerFactory) -> ServerProcess:
    """One single-worker server whose pulls carry exact values (``--pull exact``)."""
    return make_server(1, pull="exact")


@pytest.fixture
def make_client() -> Iterator[Callable[..., Client]]:
    clients: list[Client] = []

    def make(endpoint: str, **kw: Any) -> Client:
        kw.setdefault("timeout", 10.0)
        c = Client(endpoint, **kw)
        clients.append(c)
        return c

    yield make
    _all_at_once(functools.partial(c.close, timeout=1.0) for c in clients)


@pytest.fixture(scope="module", autouse=True)
def zmq_context_terminates() -> Iterator[None]:
    """pyzmq's discipline, once per module (module-scoped fixtures share sockets across
    tests): after the module every socket on the global context must be closed, and the
    context must terminate. A socket left open would hang ``term()``; it is named in the
    failure instead, then closed with linger 0 so the next module starts clean."""
    yield
    ctx = zmq.Context.instance()
    gc.collect()  # dropped Clients close their sockets in a finalizer

    def still_open() -> list[zmq.Socket]:
        return [s for s in list(getattr(ctx, "_sockets", ())) if not s.closed]

    # a socket that its owner's thread is still closing (a client's heartbeat thread closes its own
    # when it sees the stop, a busy machine may take a while) is given the time, not called a leak
    deadline = time.monotonic() + ZMQ_TERM_TIMEOUT_S
    while still_open() and time.monotonic() < deadline:
        time.sleep(0.05)
    leaked = still_open()
    for s in leaked:
        s.close(linger=0)
    done = threading.Event()

    def term() -> None:
        ctx.term()
        done.set()

    threading.Thread(target=term, name="zmq-term", daemon=True).start()
    terminated = done.wait(ZMQ_TERM_TIMEOUT_S)
    if leaked:
        pytest.fail(f"{len(leaked)} ZeroMQ socket(s) left open by this module: {leaked}")
    if not terminated:
        pytest.fail(f"the ZeroMQ context did not terminate within {ZMQ_TERM_TIMEOUT_S:g} s")
