"""Protocol round trips and aggregation semantics against a real stella-ps."""
from __future__ import annotations

import signal
import threading
import time

import msgspec
import numpy as np
import pytest

from stella import BadRequest, LayoutConflict, NotRegistered, ServerUnavailable, VersionError, _session
from stella.client import Client
from stella.layout import FlatLayout
from stella.payload import model_digest
from stella.protocol import PROTOCOL_VERSION
from stella_ps.process import free_port

SGD1 = {"name": "sgd", "lr": 1.0}
DENSE_BELOW = 4096  # stella-ps --dense-below's default


def model(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((20, 10)).astype(np.float32), "b": rng.standard_normal(10).astype(np.float32)}


def sparse(idx, vals):
    return (np.asarray(idx, np.int32), np.asarray(vals, np.float32))


def test_join_register_status_round_trip(server, make_client):
    a = make_client(server.endpoint)
    b = make_client(server.endpoint)
    assert a.worker_id != b.worker_id
    r = a.register(model(), SGD1)
    assert r.created is True and r.version == 0 and r.numel == 210 and not r.needs_values
    r2 = b.register(model(1), SGD1)  # same layout, other values: joins, values ignored
    assert r2.created is False
    snap = b.pull(None)
    assert snap.full and snap.version == 0
    np.testing.assert_array_equal(snap.tensors["w"][1].reshape(20, 10), model()["w"])
    st = a.status()
    assert st.version == 0 and st.workers == sorted([a.worker_id, b.worker_id])
    assert st.bytes_in > 0 and st.bytes_out > 0 and st.numel == 210
    assert st.optimizer["name"] == "sgd" and st.optimizer["lr"] == 1.0


class RawWorker:
    """A worker speaking the protocol by hand, to stop between the probe and the upload."""

    def __init__(self, sock):
        self.sock, self.req = sock, 0
        self.worker = self.call({"type": "join", "name": "raw"})["worker"]

    def call(self, hdr, frames=()):
        self.req += 1
        self.sock.send_multipart([msgspec.msgpack.encode({"proto": PROTOCOL_VERSION, "req": self.req, **hdr}),
                                  *frames])
        return msgspec.msgpack.decode(self.sock.recv_multipart()[0])

    def register(self, m, values):
        layout = [{"name": n, "shape": list(t.shape), "dtype": "float32"} for n, t in m.items()]
        flat = FlatLayout.of(list(m.values()), DENSE_BELOW)  # the server's default cut
        v = flat.gather(list(m.values()))
        frames = [v[p.start:p.stop].tobytes() for p in flat.parts()] if values else ()
        return self.call({"type": "register", "worker": self.worker, "tensors": layout, "optimizer": SGD1,
                          "values": values, "dense_below": DENSE_BELOW}, frames)


def register_in_thread(client, m):
    out = {}

    def run():
        t0 = time.monotonic()
        out["reply"] = client.register(m, SGD1)
        out["s"] = time.monotonic() - t0

    th = threading.Thread(target=run)
    th.start()
    return th, out


def test_workers_starting_together_send_the_model_once(server, make_client, raw_dealer):
    a = RawWorker(raw_dealer(server.endpoint))
    assert a.register(model(), values=False)["needs_values"]  # a is asked for the values ...
    b = make_client(server.endpoint)
    th, out = register_in_thread(b, model(1))
    th.join(0.6)
    assert th.is_alive(), "b's probe was answered while a's upload was due: both would send the model"
    reply = a.register(model(), values=True)  # ... and sends them
    assert reply["type"] == "registered" and reply["created"], reply
    th.join(10)
    assert not th.is_alive() and out["s"] >= 0.6
    assert out["reply"].created is False and not out["reply"].needs_values  # b joined a's model, sent nothing
    np.testing.assert_array_equal(b.pull(None).tensors["w"][1].reshape(20, 10), model()["w"])
    assert b.status().workers == sorted([a.worker, b.worker_id])


def test_one_probe_per_worker_is_held(server, raw_dealer):
    a, b = RawWorker(raw_dealer(server.endpoint)), RawWorker(raw_dealer(server.endpoint))
    assert a.register(model(), values=False)["needs_values"]
    layout = [{"name": n, "shape": list(t.shape), "dtype": "float32"} for n, t in model(1).items()]
    probe = {"type": "register", "worker": b.worker, "tensors": layout, "optimizer": SGD1, "values": False,
             "wait_ms": 20_000, "dense_below": DENSE_BELOW}
    b.sock.send_multipart([msgspec.msgpack.encode({"proto": PROTOCOL_VERSION, "req": 101, **probe})])
    # held probes cost the server a task each: the second is answered at once (held, it would wait its
    # 20 s, and the socket's 10 s receive timeout would raise first)
    second = b.call({**probe})
    assert second["req"] == b.req and second["needs_values"], second
    assert a.register(model(), values=True)["created"]
    first = msgspec.msgpack.decode(b.sock.recv_multipart()[0])  # the held one, once the model exists
    assert first["req"] == 101 and first["type"] == "registered" and not first["needs_values"], first


def test_a_reconnect_to_an_empty_server_waits_for_the_upload_under_way(make_server, make_client, raw_dealer,
                                                                       monkeypatch):
    """The server restarts with no checkpoint while another worker already uploads the
    model to it: the reconnecting worker's probe is held for the session's timeout,
    not the reconnect attempt's short one, and it joins that model instead of sending
    its own (an upload takes what the model's size and the link take)."""
    monkeypatch.setattr(_session, "ATTEMPT_TIMEOUT_S", 0.5)
    port = free_port()
    s1 = make_server(1, bind=f"tcp://127.0.0.1:{port}")
    c = make_client(s1.endpoint, timeout=20)
    c.register(model(1), SGD1)
    s1.kill(signal.SIGKILL)
    s1.wait(10)
    s2 = make_server(1, bind=f"tcp://127.0.0.1:{port}")
    a = RawWorker(raw_dealer(s2.endpoint))
    assert a.register(model(), values=False)["needs_values"]  # a's upload is due
    th, out = threading.Thread(target=lambda: out.update(snap=c.pull(None))), {}
    th.start()  # c finds the server gone, reconnects, and registers again
    th.join(2.0)
    assert th.is_alive(), "c's probe was answered within the attempt's timeout: it would upload its own model"
    assert a.register(model(), values=True)["created"]
    th.join(20)
    assert not th.is_alive() and c.reconnects >= 1
    np.testing.assert_array_equal(out["snap"].tensors["w"][1].reshape(20, 10), model()["w"])  # a's, not c's


@pytest.mark.parametrize("how", ["leaves", "is_refused", "goes_quiet"])
def test_a_held_probe_uploads_itself_when_the_upload_does_not_come(server, make_client, raw_dealer, how):
    a = RawWorker(raw_dealer(server.endpoint))
    assert a.register(model(), values=False)["needs_values"]
    # goes_quiet: b holds on for 90% of its timeout (its wait_ms), then is asked for the values itself
    b = make_client(server.endpoint, timeout=1.5 if how == "goes_quiet" else 60.0)
    th, out = register_in_thread(b, model(1))
    th.join(0.5)
    assert th.is_alive()
    if how == "leaves":
        assert a.call({"type": "leave", "worker": a.worker})["type"] == "left"
    if how == "is_refused":
        bad = {**model(), "b": np.full(10, np.nan, np.float32)}
        assert a.register(bad, values=True)["code"] == "bad_value"
    th.join(60)
    assert not th.is_alive() and out["reply"].created is True  # b's values made the model
    if how == "goes_quiet":
        assert out["s"] >= 1.2, out["s"]  # held its 1.35 s
    else:  # answered as soon as no upload was under way, not after the 54 s hold
        assert out["s"] < 30, out["s"]
    np.testing.assert_array_equal(b.pull(None).tensors["w"][1].reshape(20, 10), model(1)["w"])


def test_layout_conflict_names_the_difference_not_the_model(server, make_client):
    a = make_client(server.endpoint)
    a.register(model(), SGD1)
    b = make_client(server.endpoint)
    bad = {"w": np.zeros((20, 11), np.float32), "b": np.zeros(10, np.float32)}
    with pytest.raises(LayoutConflict, match=r"tensor 0 \('w', shape \[20, 11\], float32\): shape differ") as e:
        b.register(bad)
    assert "10" not in str(e.value)  # the server's shape is not told to a peer outside the job
    with pytest.raises(LayoutConflict, match="the registration's 3 tensors are not the model's count"):
        b.register({**model(), "extra": np.zeros(3, np.float32)})
    with pytest.raises(KeyError, match="not in the registered model"):  # refused locally
        b.push({"b": np.ones(10, np.float32)}, 0)
    b.layout, b._index, b.flat, b.parts, b._part_specs = a.layout, a._index, a.flat, a.parts, a._part_specs
    # (the local check bypassed: the server refuses too)
    with pytest.raises(NotRegistered, match="has not registered"):
        b.push({"b": np.ones(10, np.float32)}, 0)


def test_mean_of_two_workers_applied_once_per_step(make_server, make_client):
    # toy pushes that move the model by more than its norm: without the bound relative to it
    srv = make_server(2, ["--max-push-change", "0"], pull="exact")
    a, b = make_client(srv.endpoint), make_client(srv.endpoint)
    m = model()
    a.register(m, SGD1)
    b.register(m, SGD1)
    a.push({"w": sparse([0, 5, 7], [1, 2, 3])}, 0)
    # the step must not close with one of two workers
    assert a.pull(0, wait_for=1, timeout=0.5).version == 0
    b.push({"w": sparse([5, 9], [10, 20]), "b": np.full(10, 4.0, np.float32)}, 0)
    d = a.pull(0, wait_for=1)
    assert d.version == 1
    idx, vals = d.tensors["w"]
    np.testing.assert_array_equal(idx, [0, 5, 7, 9])
    w = m["w"].reshape(-1)
    expect = np.array([w[0] - 0.5, w[5] - 6.0, w[7] - 1.5, w[9] - 10.0], np.float32)
    np.testing.assert_array_equal(vals, expect)
    np.testing.assert_array_equal(d.tensors["b"][1], m["b"] - np.float32(2.0))
    assert a.status().steps == 1


@pytest.mark.parametrize("value_dtype", ["q4", "q2"])
def test_quantised_push_applies_exactly_the_decoded_values(make_server, make_client, value_dtype):
    """A q4/q2 push costs its frame size on the wire, and the server applies exactly what
    the codec decodes (SGD lr 1, one worker). The model's two tensors are both small: the
    flat model's dense suffix; "w" is pushed sparse, so the whole push is one sparse
    vector over it ("b"'s coordinates after "w"'s), quantised as one. (Values up to 100
    on a model of norm 15: without the bound relative to its norm, --max-push-change 0.)"""
    from stella import codec

    c = make_client(make_server(1, ["--max-push-change", "0"], pull="exact").endpoint)
    m = model()
    c.register(m, SGD1)
    rng = np.random.default_rng(3)
    idx = np.sort(rng.choice(200, 130, replace=False)).astype(np.int32)
    vals = (rng.standard_normal(130) * 10.0 ** rng.integers(-3, 3, 130)).astype(np.float32)
    dense_b = rng.standard_normal(10).astype(np.float32)
    bytes_in = c.status().bytes_in
    c.push({"w": (idx, vals), "b": dense_b}, 0, value_dtype=value_dtype, index_coding="raw32")
    d = c.pull(0, wait_for=1)
    sent = c.status().bytes_in - bytes_in
    need = 4 * 140 + codec.value_frame_size(value_dtype, 140)
    assert need <= sent < need + 512  # the frames plus a small header (and the status request)
    q = codec.quantise(np.concatenate([vals, dense_b]), value_dtype)
    w = m["w"].reshape(-1).copy()
    w[idx] -= q[:130]
    got_idx, got = d.tensors["w"]
    np.testing.assert_array_equal(got_idx, idx)
    np.testing.assert_array_equal(got, w[idx])
    np.testing.assert_array_equal(d.tensors["b"][1], m["b"] - q[130:])


def test_replicas_equal_server_bit_for_bit(make_server, make_client):
    srv = make_server(2)
    rng = np.random.default_rng(3)
    clients = [make_client(srv.endpoint) for _ in range(2)]
    init = model()
    replicas = []
    for c in clients:
        c.register(init, {"name": "adamw", "lr": 0.01})
        snap = c.pull(None)
        rep = {k: np.zeros_like(v) for k, v in init.items()}
        snap.apply_to(rep)
        replicas.append((c, rep, [snap.version]))
    for step in range(15):
        for c, _rep, ver in replicas:
            k = int(rng.integers(1, 40))
            idx = np.sort(rng.choice(200, k, replace=False)).astype(np.int32)
            c.push({"w": (idx, rng.standard_normal(k).astype(np.float32))}, ver[0])
        for c, rep, ver in replicas:
            # skip some pulls so deltas span several steps
            if step % 4 == 3 and c is clients[1]:
                continue
            d = c.pull(ver[0], wait_for=step + 1)
            d.apply_to(rep)
            ver[0] = d.version
    for c, rep, ver in replicas:
        d = c.pull(ver[0])
        d.apply_to(rep)
        full = c.pull(None)
        for name in init:
            assert rep[name].tobytes() == full.tensors[name][1].tobytes()


def test_snapshot_when_version_too_old(make_server, make_client):
    srv = make_server(1, ["--history", "3"], pull="exact")
    a = make_client(srv.endpoint)
    a.register(model(), SGD1)
    for v in range(6):
        a.push({"w": sparse([v], [1.0])}, v)
        assert a.pull(v, wait_for=v + 1).version == v + 1
    assert a.pull(3).full is False
    assert a.pull(2).full is True  # steps 1..3 are gone from the history
    d = a.pull(4)
    assert not d.full and list(d.tensors) == ["w"] and list(d.tensors["w"][0]) == [4, 5]
    assert a.pull(6).tensors == {}


def test_version_from_the_future_refused(server, make_client):
    a = make_client(server.endpoint)
    a.register(model(), SGD1)
    with pytest.raises(VersionError, match="future"):
        a.push({"b": np.ones(10, np.float32)}, 5)
    with pytest.raises(VersionError, match="future"):
        a.pull(3)


def test_late_push_folded_into_next_step(make_server, make_client):
    srv = make_server(2, ["--step-deadline", "0.3"], pull="exact")
    a, b = make_client(srv.endpoint), make_client(srv.endpoint)
    m = model()
    a.register(m, SGD1)
    b.register(m, SGD1)
    a.push({"w": sparse([1], [2.0])}, 0)
    d = a.pull(0, wait_for=1, timeout=5)  # b is a straggler: the deadline closes step 0
    assert d.version == 1
    np.testing.assert_array_equal(d.tensors["w"][1], [m["w"].reshape(-1)[1] - 2.0])  # mean over 1 contributor
    b.push({"w": sparse([2], [4.0])}, 0)  # late: computed on 0, folds into step 1
    a.push({"w": sparse([3], [6.0])}, 1)
    d = a.pull(1, wait_for=2, timeout=5)
    assert d.version == 2
    np.testing.assert_array_equal(d.tensors["w"][0], [2, 3])
    np.testing.assert_allclose(d.tensors["w"][1], m["w"].reshape(-1)[[2, 3]] - [2.0, 3.0])
    assert a.status().late_pushes == 0  # one step behind is the pipeline's normal staleness


def test_leave_lets_steps_proceed_and_counts_pending(make_server, make_client):
    srv = make_server(2, pull="exact")
    a, b = make_client(srv.endpoint), make_client(srv.endpoint)
    m = model()
    a.register(m, SGD1)
    b.register(m, SGD1)
    b.push({"w": sparse([0], [8.0])}, 0)  # b's last push, then it leaves
    b.leave()
    a.push({"w": sparse([0], [2.0])}, 0)
    d = a.pull(0, wait_for=1)
    np.testing.assert_array_equal(d.tensors["w"][1], [m["w"].reshape(-1)[0] - 5.0])
    a.push({"w": sparse([1], [2.0])}, 1)  # alone now: steps close on a's pushes
    assert a.pull(1, wait_for=2).version == 2
    assert a.status().workers == [a.worker_id]


def test_rejoin_with_same_id_and_conflict(server, make_client):
    a = make_client(server.endpoint)
    wid = a.worker_id
    other = make_client(server.endpoint, join=False)
    with pytest.raises(BadRequest, match=r"\[worker_id\] worker id \d+ is in use"):
        other.join(wid)
    # a restarted process asking for its old id, still held by its killed incarnation's connection
    # (until the liveness timeout): it does not fail, it joins with a new id (bench.soak's restarted worker)
    again = make_client(server.endpoint, worker_id=wid)
    assert again.worker_id not in (None, wid)
    a.leave()
    assert other.join(wid) == wid


def test_set_optimizer_changes_lr_from_next_step(exact_server, make_client):
    a = make_client(exact_server.endpoint)
    m = model()
    a.register(m, SGD1)
    assert a.set_optimizer(lr=0.5)["lr"] == 0.5
    a.push({"b": np.ones(10, np.float32)}, 0)
    d = a.pull(0, wait_for=1)
    np.testing.assert_array_equal(d.tensors["b"][1], m["b"] - np.float32(0.5))
    with pytest.raises(BadRequest, match=r"\[optimizer\] unknown hyper-parameter"):
        a.set_optimizer(gamma=3)


def test_hparams_on_a_push_apply_from_the_step_it_joins(make_server, make_client):
    """A learning-rate change travels with the push (no round trip of its own) and
    applies exactly from the step that push joins."""
    srv = make_server(2, pull="exact")
    a, b = make_client(srv.endpoint), make_client(srv.endpoint)
    m = model()
    a.register(m, SGD1)
    b.register(m, SGD1)
    a.push({"b": np.ones(10, np.float32)}, 0)
    b.push({"b": np.ones(10, np.float32)}, 0)
    assert a.pull(0, wait_for=1).version == 1  # step 0 at lr 1
    a.push({"b": np.ones(10, np.float32)}, 1, hparams={"lr": 0.25})
    assert a.status().optimizer["lr"] == 1.0  # not before its step closes
    b.push({"b": np.ones(10, np.float32)}, 1)
    d = a.pull(0, wait_for=2)
    np.testing.assert_array_equal(d.tensors["b"][1], m["b"] - np.float32(1.0) - np.float32(0.25))
    assert a.status().optimizer["lr"] == 0.25
    with pytest.raises(BadRequest, match=r"\[optimizer\] lr=-1 is outside"):  # refused when pushed
        a.push({"b": np.ones(10, np.float32)}, 2, hparams={"lr": -1.0})
    assert a.status().pending_pushes == 0


def test_a_worker_holding_the_models_first_values_pulls_only_the_steps_since(server, make_client, raw_dealer):
    """The registration's digest: a worker whose values are those the model was created
    with (the same seed) is told their version (``base``) and needs only the steps since;
    other values, or a digest of the wrong size, get no base or a clear refusal."""
    a = make_client(server.endpoint)
    assert a.register(model(), SGD1).base == 0  # it created the model
    b, c = make_client(server.endpoint), make_client(server.endpoint)
    assert b.register(model(), SGD1).base == 0
    assert c.register(model(1), SGD1).base is None  # other values: a snapshot
    for cl in (a, b, c):
        cl.push({"w": sparse([3, 7], [1.0, -2.0])}, 0, wait=False)
    assert a.pull(0, wait_for=1).version == 1
    late = make_client(server.endpoint)
    reg = late.register(model(), SGD1)
    assert reg.base == 0 and reg.version == 1 and not reg.created
    mine = model()
    delta = late.pull(reg.base)
    assert not delta.full  # the step's change, not the model
    delta.apply_to(mine)
    snap = late.pull(None)
    for name, (_, vals) in snap.tensors.items():
        assert np.array_equal(mine[name].reshape(-1), vals), name
    assert not np.array_equal(mine["w"], model()["w"])

    raw = RawWorker(raw_dealer(server.endpoint))
    layout = [{"name": n, "shape": list(t.shape), "dtype": "float32"} for n, t in model().items()]
    bad = raw.call({"type": "register", "worker": raw.worker, "tensors": layout, "optimizer": SGD1, "values": False,
                    "digest": b"short"})
    assert bad["type"] == "error" and "digest" in bad["message"], bad
    flat = FlatLayout.of(list(model().values()), DENSE_BELOW)
    parts = [flat.gather(list(model().values()))[p.start:p.stop] for p in flat.parts()]  # what a client hashes
    ok = raw.call({"type": "register", "worker": raw.worker, "tensors": layout, "optimizer": SGD1, "values": False,
                   "digest": model_digest(parts), "dense_below": DENSE_BELOW})
    assert ok["type"] == "registered" and ok["base"] == 0 and a.status().version == 1  # the refusal changed nothing


def test_first_registration_with_an_empty_tensor_is_answered(server, make_client):
    """A zero-element tensor in the registration that would initialise the model is
    refused with a clear error (it used to leave the request unanswered), and the
    model can still be initialised afterwards."""
    a = make_client(server.endpoint, timeout=5)
    with pytest.raises(BadRequest, match="no elements"):
        a.register({**model(), "empty": np.zeros((0, 4), np.float32)}, SGD1)
    assert a.register(model(), SGD1).created


def test_timeout_when_server_is_down():
    c = Client("tcp://127.0.0.1:9", timeout=0.3, join=False)
    try:
        with pytest.raises(ServerUnavailable):
            c.join()
        with pytest.raises(TimeoutError):  # also a builtin TimeoutError
            c.status()
    finally:
        c.close()


def test_sigterm_shuts_down_cleanly(make_server, make_client):
    srv = make_server(1)
    a = make_client(srv.endpoint)
    a.register(model(), SGD1)
    assert srv.close() == 0
    assert '"shutting down"' in srv.logs() and '"stopped"' in srv.logs()


def test_server_never_imports_torch():
    """The daemon runs on a CPU host that needs no torch; the wire schema must not pull it in."""
    import subprocess
    import sys

    code = "import sys, stella_ps.daemon, stella_ps.server; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
