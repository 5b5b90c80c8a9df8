"""A round's push and pull in one message (``Push.pull``, protocol 15; ``Client.push_pull``),
against a real server: the same answers as the two sent apart, each under its own request
id; a refusal of either before the pull is taken changes nothing and fails both; a
refusal of the pull alone leaves the push queued; a reconnect re-sends them apart."""
from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest

from stella import Client
from stella.errors import BadRequest, ErrorCode, ProtocolError, VersionError
from stella.protocol import Pull, Push

SGD = {"name": "sgd", "lr": 1.0}
N = 10_000  # above the server's dense cut: pushes are sparse


def _update(seed: int, k: int = 8) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    idx = np.sort(rng.choice(N, k, replace=False)).astype(np.int32)
    return {"w": (idx, rng.standard_normal(k).astype(np.float32))}


def _replica(c: Client) -> np.ndarray:
    model = {"w": np.zeros(N, np.float32)}
    c.pull(None).apply_to(model)
    return model["w"]


def _register(c: Client) -> None:
    c.register({"w": np.zeros(N, np.float32)}, SGD)


def test_one_message_answers_as_two_did(make_server, make_client):
    """Two servers, two workers each: one pair pushes and pulls apart, the other in one
    message; every step's answer and the models are equal bit for bit."""
    models = []
    for together in (False, True):
        srv = make_server(2, pull="exact")
        cs = [make_client(srv.endpoint) for _ in range(2)]
        for c in cs:
            _register(c)
        deltas = []
        for step in range(5):
            if together:
                pairs = [c.push_pull(_update(10 * step + r), step, step, wait_for=step + 1)
                         for r, c in enumerate(cs)]
                oks = [a.result() for a, _ in pairs]
                answers = [b.result() for _, b in pairs]
            else:
                sent = [c.push(_update(10 * step + r), step, wait=False) for r, c in enumerate(cs)]
                pulls = [c.pull(step, wait_for=step + 1, wait=False) for c in cs]
                oks = [p.result() for p in sent]
                answers = [p.result() for p in pulls]
            assert [ok.step for ok in oks] == [step] * 2  # the step each joined: the same either way
            assert [a.version for a in answers] == [step + 1] * 2
            deltas.append([(i.tolist(), v.tolist()) for a in answers for i, v in a.tensors.values()])
        models.append((_replica(cs[0]), deltas))
        assert cs[0].status().pulls == 2 * 5 + 1 and cs[0].status().pushes == 2 * 5
    np.testing.assert_array_equal(models[0][0], models[1][0])
    assert models[0][1] == models[1][1]


def test_a_refused_push_refuses_its_pull_and_queues_nothing(make_server, make_client):
    srv = make_server(1)
    c = make_client(srv.endpoint)
    _register(c)
    before = c.status()
    push, pull = c.push_pull(_update(0), 5, 0, wait_for=1)  # a version from the future
    with pytest.raises(VersionError):
        push.result()
    with pytest.raises(VersionError):
        pull.result()
    # the pull's own check fails first: nothing queued either
    push, pull = c.push_pull(_update(1), 0, 9, wait_for=10)
    for p in (push, pull):
        with pytest.raises(VersionError, match="from the future"):
            p.result()
    after = c.status()
    assert (after.pushes, after.pulls, after.pending_pushes, after.version) == (before.pushes, before.pulls, 0, 0)
    # the connection is as good as before
    push, pull = c.push_pull(_update(2), 0, 0, wait_for=1)
    assert push.result().step == 0 and pull.result().version == 1


def test_a_refused_pull_leaves_its_push_queued(make_server, make_client):
    """Two workers, so that no step closes; this one's waiting pulls are bounded at one:
    the second pair's pull is refused, its push is queued all the same."""
    srv = make_server(2, ["--max-waiting-pulls", "1"])
    c = make_client(srv.endpoint)
    _register(c)
    other = make_client(srv.endpoint)
    _register(other)
    first = c.pull(0, wait_for=1, wait=False)
    push, pull = c.push_pull(_update(0), 0, 0, wait_for=1)
    assert push.result().step == 0
    with pytest.raises(BadRequest) as refused:
        pull.result()
    assert refused.value.code == ErrorCode.LIMIT
    assert c.status().pending_pushes == 1
    other.push(_update(1), 0)
    assert first.result().version == 1


def test_a_message_the_server_cannot_read_fails_both_at_once(make_server, make_client):
    """A pull of another worker riding on a push: the server refuses the message under
    the push's id, the only one it can read; the pull's wait ends with that refusal, not
    with its timeout."""
    srv = make_server(1)
    c = make_client(srv.endpoint, timeout=30)
    _register(c)
    s = c._session
    w = s.worker()
    a, b = s.send_pair(Push(worker=w, version=0, tensors=[]), [], Pull(worker=w + 1, since=0), 30)
    t0 = time.monotonic()
    with pytest.raises(ProtocolError, match="its pull is worker"):
        s.wait(a)
    with pytest.raises(ProtocolError, match="its pull is worker"):
        s.wait(b)
    assert time.monotonic() - t0 < 10
    assert c.status().pending_pushes == 0


def test_a_pair_in_flight_through_a_reconnect_is_sent_again_apart(make_server, make_client):
    """The server stops answering with a pair in flight (the pull waiting for a step the
    other worker's push closes); after the reconnect both are answered: the push once
    (not queued twice), the pull rebased."""
    srv = make_server(1, ["--liveness-timeout", "1"], pull="exact")
    c = make_client(srv.endpoint, timeout=120)
    _register(c)
    srv.kill(signal.SIGSTOP)
    resume = threading.Timer(2.5, srv.kill, (signal.SIGCONT,))
    resume.start()
    try:
        push, pull = c.push_pull(_update(0), 0, 0, wait_for=1)
        assert push.result().step in (0, 1)  # 1: the re-sent copy of a push the server had taken
        answer = pull.result()
    finally:
        resume.join()
    assert c.reconnects >= 1 and answer.version in (0, 1)
    st = c.status()
    assert st.pushes == 1 and st.version == 1
    np.testing.assert_array_equal(_replica(c)[_update(0)["w"][0]], -_update(0)["w"][1])


def test_a_snapshot_riding_on_a_push_comes_in_pieces(make_server, make_client, monkeypatch):
    """A round's pull becomes a snapshot when the replica's history is lost (a server
    restarted from an older checkpoint); on a push, its answer larger than a message
    (4 MiB: 1.2M coordinates) still comes as a transfer fetched in pieces."""
    from stella._session import Session

    assembled = []
    assemble = Session._assemble
    monkeypatch.setattr(Session, "_assemble", lambda self, req, t: assembled.append(req) or assemble(self, req, t))
    srv = make_server(1, pull="exact")
    c = make_client(srv.endpoint, timeout=30)
    n = 1_200_000
    values = np.arange(n, dtype=np.float32) / n
    c.register({"w": values}, SGD)
    idx = np.array([0, n // 2, n - 1], np.int32)
    push, pull = c.push_pull({"w": (idx, np.ones(3, np.float32))}, 0, None)
    assert push.result().step == 0
    snap = pull.result()
    assert snap.full and snap.version in (0, 1) and assembled == [pull.req]
    if snap.version == 1:  # the step the push closed (one worker) was applied before the snapshot was taken
        values[idx] -= 1.0
    np.testing.assert_array_equal(snap.tensors["w"][1], values)
