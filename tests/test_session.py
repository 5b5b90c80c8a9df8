"""The session's reconnect rules: how a reconnect rebases the requests still waiting for
their replies (:func:`stella._session.rebase`, a pure table test, no sockets), and that
a pull's answer says when it was rebased (against a real server)."""
from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest

from stella._session import rebase
from stella.protocol import (
    Heartbeat,
    Join,
    Leave,
    Pull,
    Push,
    Register,
    SetOptimizer,
    Status,
    TensorSpec,
)
from stella_ps.process import free_port

OLD, NEW = 3, 9  # the worker id before the reconnect and after it
REG = Register(worker=OLD, tensors=[TensorSpec("w", (4,), "float32")], optimizer={}, values=False)

# (request before the reconnect, server version, need_snapshot, the request as re-sent)
CASES = {
    # a push is tagged with at most the server's version (it may never have had the push's)
    "push on an older version": (Push(worker=OLD, version=5, tensors=[]), 7, False,
                                 Push(worker=NEW, version=5, tensors=[])),
    "push from the future is clamped": (Push(worker=OLD, version=12, tensors=[]), 7, False,
                                        Push(worker=NEW, version=7, tensors=[])),
    "push clamped after a snapshot reset": (Push(worker=OLD, version=12, tensors=[]), 7, True,
                                            Push(worker=NEW, version=7, tensors=[])),
    # a pull since a version the server does not have becomes a snapshot, answered at once
    "pull since > server version": (Pull(worker=OLD, since=12, wait_for=13), 7, False,
                                    Pull(worker=NEW, since=-1, wait_for=None)),
    "pull since > server version, no wait": (Pull(worker=OLD, since=8), 7, False, Pull(worker=NEW, since=-1)),
    # the server went back: any incremental pull becomes a snapshot
    "need_snapshot": (Pull(worker=OLD, since=2, wait_for=3), 7, True, Pull(worker=NEW, since=-1, wait_for=None)),
    "need_snapshot, since 0": (Pull(worker=OLD, since=0), 7, True, Pull(worker=NEW, since=-1)),
    # a waiting pull is answered at once (the push its step waits for may be lost)
    "waiting pull": (Pull(worker=OLD, since=6, wait_for=7, timeout_ms=5000, coding="rice"), 7, False,
                     Pull(worker=NEW, since=6, wait_for=None, timeout_ms=5000, coding="rice")),
    "waiting pull at the server's version": (Pull(worker=OLD, since=7, wait_for=8), 7, False,
                                             Pull(worker=NEW, since=7, wait_for=None)),
    # a snapshot stays a snapshot; a pull with nothing to rebase only takes the new id
    "snapshot": (Pull(worker=OLD, since=-1), 7, True, Pull(worker=NEW, since=-1)),
    "plain pull": (Pull(worker=OLD, since=4), 7, False, Pull(worker=NEW, since=4)),
    # the other requests that name a worker take the new id
    "set_optimizer": (SetOptimizer(worker=OLD, hparams={"lr": 0.5}), 7, False,
                      SetOptimizer(worker=NEW, hparams={"lr": 0.5})),
    "leave": (Leave(worker=OLD), 7, True, Leave(worker=NEW)),
    # untouched: status names no worker; join, register and heartbeats are redone, never re-sent
    "status": (Status(), 7, True, Status()),
    "heartbeat": (Heartbeat(worker=OLD, session=11), 7, True, Heartbeat(worker=OLD, session=11)),
    "join": (Join(worker=OLD, name="w", session=11), 7, True, Join(worker=OLD, name="w", session=11)),
    "register": (REG, 0, True, REG),
}


@pytest.mark.parametrize("before,server_version,need_snapshot,after", CASES.values(), ids=CASES.keys())
def test_rebase(before, server_version, need_snapshot, after):
    got = rebase(before, server_version, need_snapshot, NEW)
    assert got == after
    assert type(got) is type(after)


def test_rebase_on_the_same_server_keeps_a_pulls_wait():
    """The server gave the session back (it did not restart): a waiting pull keeps its
    wait (the push its step takes is still queued there); the other rules stand."""
    waiting = Pull(worker=OLD, since=6, wait_for=7, timeout_ms=5000, coding="rice")
    assert rebase(waiting, 7, False, NEW, same_server=True) == Pull(worker=NEW, since=6, wait_for=7,
                                                                     timeout_ms=5000, coding="rice")
    assert rebase(waiting, 7, False, NEW) == Pull(worker=NEW, since=6, wait_for=None, timeout_ms=5000, coding="rice")
    assert rebase(Pull(worker=OLD, since=12, wait_for=13), 7, False, NEW, same_server=True) == \
        Pull(worker=NEW, since=-1, wait_for=None)
    assert rebase(Push(worker=OLD, version=12, tensors=[]), 7, False, NEW, same_server=True) == \
        Push(worker=NEW, version=7, tensors=[])


def test_rebase_is_pure():
    msg = Pull(worker=OLD, since=12, wait_for=13, req=5)
    got = rebase(msg, 7, True, NEW)
    assert msg == Pull(worker=OLD, since=12, wait_for=13, req=5)  # frozen; the request itself is unchanged
    assert got.req == 5  # the request id travels with it (a re-send keeps its id)
    assert rebase(got, 7, True, NEW) == got  # a rebased request is rebased already


# --------------------------------------------------------------------------- against a real server
def test_a_pull_waiting_through_a_restart_is_answered_at_once_and_says_so(make_server, make_client):
    """The server restarts (killed, a new one on the same port, no checkpoint) while a pull
    waits for a step that cannot come; the client reconnects to the new server (which does
    not know its session) and the re-sent pull, its wait dropped, is answered at once,
    marked ``rebased``: the push that step would take may have been lost with the server.
    A pull made afterwards is not."""
    port = free_port()
    srv = make_server(1, ["--liveness-timeout", "1"], bind=f"tcp://127.0.0.1:{port}")
    c = make_client(srv.endpoint, timeout=120)
    c.register({"w": np.zeros(4, np.float32)}, {"name": "sgd", "lr": 1.0})
    assert not c.pull(None).rebased
    pending = c.pull(0, wait_for=1, wait=False)
    srv.kill()
    srv.wait(10)
    t0 = time.monotonic()
    make_server(1, ["--liveness-timeout", "1"], bind=f"tcp://127.0.0.1:{port}")
    delta = pending.result()
    assert delta.rebased and delta.version == 0 and c.reconnects >= 1
    assert time.monotonic() - t0 < 60  # a few seconds: not held until the pull's 108 s wait expired
    assert not c.pull(0).rebased


def test_a_rounds_pull_built_before_its_pushs_reconnect_is_rebased_on_the_restarted_server(make_server, make_client):
    """The round's push and pull are built, then the socket finds no server (killed): they
    go as two sends, and the push's waits out its timeout and connects again, to a server
    restarted from older state (here empty, at version 0; the worker had seen 3). The pull,
    built before that reconnect, must be rebased as a re-sent one is: a snapshot, marked
    ``rebased``. Sent as built it asked for the steps after version 3 and was refused
    (a version from the future), and the round failed: CI's killed-shard test."""
    port = free_port()
    srv = make_server(1, ["--liveness-timeout", "1"], bind=f"tcp://127.0.0.1:{port}")
    c = make_client(srv.endpoint, timeout=2.0)
    c.register({"w": np.zeros(4, np.float32)}, {"name": "sgd", "lr": 1.0})
    one = {"w": np.ones(4, np.float32)}
    for v in range(3):
        c.push(one, v)
        assert c.pull(v, wait_for=v + 1).version == v + 1
    srv.kill()
    srv.wait(10)
    time.sleep(0.5)  # the socket sees its peer gone: a send finds no connection
    restart = threading.Timer(3.0, make_server, (1, ["--liveness-timeout", "1"]),
                              {"bind": f"tcp://127.0.0.1:{port}"})  # after the push's 2 s wait for the socket
    restart.start()
    try:
        push, pull = c.push_pull(one, 3, 3, wait_for=4)
    finally:
        restart.join()
    assert c.reconnects >= 1
    assert push.result().version <= 1  # tagged with the new server's version, not 3
    got = pull.result()
    assert got.full and got.rebased and got.version <= 1


def test_a_pull_waiting_through_a_reconnect_to_the_same_server_keeps_waiting_for_its_step(make_server, make_client):
    """The server stops answering (stopped for 2.5 s) while worker a's pull waits for the
    step its acknowledged push is queued for; a reconnects when the server is back, which
    gives its session back: it did not restart and still holds a's push. So the re-sent
    pull keeps its wait and is answered by the step: version 1, not rebased. (Answered
    at once, it ended the pipeline's round and the worker pushed again into the queue of
    a step that could not close: tests/test_liveness.py's stalled worker under load.)"""
    srv = make_server(2, ["--liveness-timeout", "1"])
    a = make_client(srv.endpoint, timeout=120)
    b = make_client(srv.endpoint, timeout=120)
    a.register({"w": np.zeros(4, np.float32)}, {"name": "sgd", "lr": 1.0})
    b.register({"w": np.zeros(4, np.float32)}, {"name": "sgd", "lr": 1.0})
    a.push({"w": np.ones(4, np.float32)}, 0)
    pending = a.pull(0, wait_for=1, wait=False)
    srv.kill(signal.SIGSTOP)
    resume = threading.Timer(2.5, srv.kill, (signal.SIGCONT,))
    resume.start()
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(pending.result()))  # its wait reconnects, as a round's does
    waiter.start()
    resume.join()
    deadline = time.monotonic() + 60
    while a.reconnects == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a.reconnects >= 1
    # the step waits for b, unless the server, back from its stop, found b silent for longer than the
    # liveness timeout first and closed the step with a's push alone (a race of the stop's length)
    b.push({"w": np.ones(4, np.float32)}, 0)
    waiter.join(60)
    (delta,) = got
    # the step's answer; before, the re-sent pull was answered at once, marked rebased (version 0, or 1 if
    # the step had closed meanwhile)
    assert delta.version == 1 and not delta.rebased


def test_a_connection_dropped_after_its_monitor_closed_leaves_the_process_able_to_connect(make_server, make_client):
    """libzmq sends a socket's monitor events from the context's IO thread, blocking, and
    keeps a closed socket's monitor until its reaper gets to it. A client that closed its
    handshake reader first, and then lost its connection (the server went away while the
    socket was being torn down: a race a test suite met about once in 50 clients), left that
    thread waiting for ever: no socket of the process connected again. The reader's close
    stops the monitor first; here the connection drops with the reader closed and the
    socket still open, and a new client in the same process must still connect."""
    gone = make_server(1)
    c = make_client(gone.endpoint, timeout=10)
    c._session._handshakes.close()
    gone.stop()
    time.sleep(0.5)  # the drop reaches the client's IO thread
    other = make_server(1)
    t0 = time.monotonic()
    make_client(other.endpoint, timeout=10).status()
    assert time.monotonic() - t0 < 10
