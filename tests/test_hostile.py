"""Hostile allowed peers (issue 25): with the default flags, no message stops the server
answering others, and no sequence of messages leaves a non-finite value in the model.

Each case was reproduced against the server before its fix: a deeply nested or
non-UTF-8 header, an eps that underflows in float32, the routes to a non-finite model
(a huge lr, a huge weight decay, huge pushes), a stream of stray joins, all checkpoints
damaged and two restarts, and a many-frame message. docs/security.md names these
tests line by line."""
from __future__ import annotations

import signal
import threading
import time

import msgspec
import numpy as np
import pytest
import zmq
from live import wait_until

from stella import Client
from stella import checkpoint_file as ckfmt
from stella.client import curve_keys
from stella.errors import BadRequest, Unauthorised
from stella.protocol import PROTOCOL_VERSION
from stella_ps.process import free_port


def call(sock: zmq.Socket, header: bytes, frames: tuple = ()) -> dict:
    sock.send_multipart([header, *frames])
    return msgspec.msgpack.decode(sock.recv_multipart()[0])


def enc(hdr: dict) -> bytes:
    return msgspec.msgpack.encode({"proto": PROTOCOL_VERSION, "req": 7, **hdr})


def answers(c: Client) -> int:
    """The server still answers: its version, through a well-behaved client."""
    return c.status().version


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# ------------------------------------------------------------------ headers that used to end the receive loop
@pytest.fixture(scope="module")
def srv(module_server_factory):
    return module_server_factory(1)


def test_a_deeply_nested_header_is_refused_and_the_server_goes_on(srv, raw_dealer, make_client):
    good = make_client(srv.endpoint)
    raw = raw_dealer(srv.endpoint)
    for header in (b"\x81\xa1a" * 1000 + b"\xc0", b"\x81\xa1a" + b"\x91" * 100_000 + b"\xc0"):  # maps, arrays
        r = call(raw, header)
        assert r["type"] == "error" and r["code"] == "protocol" and "nested too deeply" in r["message"], r
    assert answers(good) == 0 and srv.alive()


def _strings(obj: object) -> list[str]:
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, dict):
        return [s for k, v in obj.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(obj, list):
        return [s for v in obj for s in _strings(v)]
    return []


def _headers(wid: int) -> dict[str, dict]:
    """A valid header of every request type that carries strings."""
    return {
        "join": {"type": "join", "name": "site-a"},
        "register": {"type": "register", "worker": wid, "values": False,
                     "optimizer": {"name": "sgd", "momentum_mode": "fold"},
                     "tensors": [{"name": "w", "shape": [4], "dtype": "float32"}]},
        "pull": {"type": "pull", "worker": wid, "since": 0, "coding": "rice"},
        "set_optimizer": {"type": "set_optimizer", "worker": wid, "hparams": {"lr": 0.1}},
        "status": {"type": "status"},
    }


def _cases() -> list[tuple[str, str]]:
    return [(kind, s) for kind, hdr in _headers(0).items() for s in dict.fromkeys(_strings(hdr))]


@pytest.mark.parametrize(("kind", "string"), _cases())
def test_invalid_utf8_in_any_string_field_is_a_protocol_refusal(srv, raw_dealer, make_client, kind, string):
    """Every string of every request (keys and values), its bytes replaced by invalid
    UTF-8 of the same length: a ``protocol`` refusal naming the request, never
    ``internal``, and the server answers others afterwards."""
    good = make_client(srv.endpoint)
    good.register({"w": np.zeros(4, np.float32)})
    header = enc(_headers(good.worker_id)[kind])
    packed = msgspec.msgpack.encode(string)
    bad = packed[:len(packed) - len(string)] + b"\xff" * len(string)
    assert packed in header
    r = call(raw_dealer(srv.endpoint), header.replace(packed, bad, 1))
    assert r["type"] == "error" and r["code"] == "protocol" and r["req"] == 7, r
    # the message names the cause, unless the mangled string was the key "type" itself
    assert "UTF-8" in r["message"] or (string == "type" and "unknown request type" in r["message"]), r
    answers(good)


@pytest.mark.parametrize("missing", ["proto", "req"])
def test_a_header_without_proto_or_req_is_refused(srv, raw_dealer, missing):
    hdr = {"type": "status", "proto": PROTOCOL_VERSION, "req": 9}
    del hdr[missing]
    r = call(raw_dealer(srv.endpoint), msgspec.msgpack.encode(hdr))
    assert r["type"] == "error" and r["code"] == "protocol", r
    assert missing in r["message"] or "protocol version" in r["message"], r


# ------------------------------------------------------------------ hyper-parameters, in float32
def test_an_eps_that_underflows_in_float32_is_refused_on_register_and_on_a_running_job(make_server, make_client):
    s = make_server(1, pull="exact")
    c = make_client(s.endpoint)
    with pytest.raises(BadRequest, match="eps"):
        c.register({"w": np.zeros(8, np.float32)}, {"name": "adam", "eps": 1e-46})
    c.register({"w": np.zeros(8, np.float32)}, {"name": "adam", "lr": 0.01})
    for eps in (1e-46, 1e-40, 1e-20):  # 0 in float32, subnormal, below --min-eps
        with pytest.raises(BadRequest, match="eps"):
            c.set_optimizer(eps=eps)
    c.push({"w": np.zeros(8, np.float32)}, 0)  # a zero gradient: NaN everywhere with eps 0
    vals = c.pull(0, wait_for=1).tensors["w"][1]
    assert np.all(np.isfinite(vals)) and c.status().optimizer["eps"] == 1e-8


def test_a_huge_lr_or_weight_decay_is_refused_with_the_default_flags(make_server, make_client):
    s = make_server(1, pull="exact")
    c = make_client(s.endpoint)
    with pytest.raises(BadRequest, match="weight_decay"):
        c.register({"w": np.zeros(8, np.float32)}, {"name": "adam", "weight_decay": 3e38})
    c.register({"w": np.zeros(8, np.float32)}, {"name": "sgd", "lr": 1.0})
    with pytest.raises(BadRequest, match="--max-lr"):
        c.set_optimizer(lr=3e38)
    with pytest.raises(BadRequest, match="--max-lr"):
        c.push({"w": np.full(8, 10.0, np.float32)}, 0, hparams={"lr": 3e38})
    c.push({"w": np.full(8, 10.0, np.float32)}, 0)
    np.testing.assert_array_equal(c.pull(0, wait_for=1).tensors["w"][1], np.full(8, -10.0, np.float32))


# ------------------------------------------------------------------ huge pushes: the clip and the finite-step guard
DIM = 64


def _honest_step(c: Client, v: int, target: np.ndarray, w: np.ndarray) -> tuple[int, np.ndarray]:
    """One step of least squares towards ``target`` (update mode: the change of the
    weights, which the outer step subtracts)."""
    c.push({"w": 0.2 * (w - target)}, v, wait=False)
    d = c.pull(v, wait_for=v + 1)
    idx, vals = d.tensors["w"]
    w = w.copy()
    if idx is None:
        w[:] = vals
    else:
        w[idx] = vals
    return d.version, w


def test_huge_pushes_are_clipped_and_the_honest_worker_keeps_training(make_server, make_client):
    """The update mode's outer step (plain averaging, lr 1) with one honest worker and
    one that pushes +-3e38 everywhere in three consecutive steps: with the default flags
    the relative push-norm clip holds each to 10 usual pushes, the model stays finite
    and the honest loss falls again."""
    s = make_server(2, pull="exact")
    honest, bad = make_client(s.endpoint), make_client(s.endpoint)
    rng = np.random.default_rng(0)
    w = rng.standard_normal(DIM).astype(np.float32)
    target = np.zeros(DIM, np.float32)
    honest.register({"w": w}, {"name": "sgd", "lr": 1.0}, mode="update")
    bad.register({"w": w}, mode="update")
    v, losses = 0, []
    for step in range(40):
        if 10 <= step < 13:
            bad.push({"w": np.full(DIM, 3e38 if step % 2 else -3e38, np.float32)}, v, wait=False)
        else:
            bad.push({"w": np.zeros(DIM, np.float32)}, v, wait=False)
        v, w = _honest_step(honest, v, target, w)
        assert np.all(np.isfinite(w)), step
        losses.append(float(np.sum((w - target) ** 2)))
    assert s.logs().count("push clipped") >= 3
    assert losses[-1] < losses[9] and losses[-1] < 0.1 * max(losses[10:14]), losses


def _flat(d) -> np.ndarray:
    return np.concatenate([np.ravel(v[1]) for _, v in sorted(d.tensors.items())])


@pytest.mark.parametrize(("mode", "optimizer"), [
    ("update", {"name": "sgd", "lr": 1.0}),  # the outer step of plain averaging
    ("update", {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}),  # DiLoCo's outer Nesterov
    ("gradient", {"name": "sgd", "lr": 0.1, "momentum": 0.9}),
    ("gradient", {"name": "adam", "lr": 1e-3}),  # a step of about lr whatever the push: no model bound needed
], ids=["update-avg", "update-nesterov", "gradient-momentum", "gradient-adam"])
@pytest.mark.parametrize(("value", "pull"), [(3e38, None), (3e38, "exact"), (1e30, None)],
                         ids=["3e38", "3e38-exact", "1e30"])
def test_a_huge_first_push_moves_the_model_by_at_most_its_own_norm(make_server, make_client, mode, optimizer, value,
                                                                    pull):
    """Issue 45: the job's very first push, +-value at every coordinate of a dense and a
    sparse tensor, from an allowed key, with the default flags: the relative clip knows no
    pushes yet, and --max-push-change 1 holds what the push can change to the model's L2
    norm (an SGD step's lr / (1 - momentum) times the push's norm). The largest parameter
    is at most twice what it was (it was 3e38 before the bound), in the exact model and
    in what replicas hold; an honest worker is answered and trains on."""
    s = make_server(1, pull=pull)
    bad, honest = make_client(s.endpoint), make_client(s.endpoint)
    rng = np.random.default_rng(0)
    w = {"a": (0.05 * rng.standard_normal((100, 100))).astype(np.float32), "b": np.zeros(100, np.float32)}
    before = np.concatenate([w["a"].ravel(), w["b"]])
    bad.register(w, optimizer, mode=mode)
    signs = np.where(rng.random(10_000) < 0.5, -1.0, 1.0).astype(np.float32).reshape(100, 100)
    bad.push({"a": value * signs, "b": np.full(100, value, np.float32)}, 0)
    wait_until(lambda: answers(bad) == 1, 30, "step 1: its push alone")
    if optimizer["name"] == "adam":  # its square overflows float32: the finite-step guard dropped it
        with pytest.raises(BadRequest, match="non-finite"):
            bad.pull(1)
    honest.register(w, mode=mode)
    d = honest.pull(-1)
    assert d.version == 1
    after = _flat(d)
    assert np.all(np.isfinite(after))
    assert np.abs(after).max() <= 2 * np.abs(before).max(), (np.abs(after).max(), np.abs(before).max())
    if optimizer["name"] == "sgd":
        assert "push clipped" in s.logs() and "--max-push-change" in s.logs()
    for v in range(1, 4):  # the honest worker trains on (the other one pushes nothing now)
        bad.push({"b": np.zeros(100, np.float32)}, v)
        honest.push({"a": 0.01 * np.ones((100, 100), np.float32)}, v)
        assert honest.pull(v, wait_for=v + 1).version == v + 1
    assert answers(honest) == 4


def test_a_huge_first_push_on_one_coordinate_moves_it_by_at_most_the_models_norm(make_server, make_client):
    """The bound is on the push's L2 norm: a push on one coordinate can move that one by
    up to the model's norm (docs/security.md, known limits), and no further."""
    s = make_server(1, pull="exact")
    bad = make_client(s.endpoint)
    rng = np.random.default_rng(0)
    w = (0.05 * rng.standard_normal(10_000)).astype(np.float32)
    bad.register({"w": w}, {"name": "sgd", "lr": 1.0}, mode="update")
    bad.push({"w": (np.array([7], np.int32), np.array([3e38], np.float32))}, 0)
    after = bad.pull(-1, wait_for=1).tensors["w"][1]
    change = float(np.linalg.norm(after.astype(np.float64) - w))
    assert change <= 1.0001 * float(np.linalg.norm(w.astype(np.float64))), change
    assert np.count_nonzero(after != w) == 1


def test_the_finite_step_guard_undoes_a_step_drops_the_offender_and_refuses_its_next_request(
        make_server, make_client):
    """Without the clips (--push-norm-factor 0 --max-push-change 0), a push that makes lr
    * value overflow: the step is undone, applied without that push, and the offender's
    next request is refused naming it; nothing in the model is ever non-finite."""
    s = make_server(2, ["--push-norm-factor", "0", "--max-push-change", "0"])
    honest, bad = make_client(s.endpoint), make_client(s.endpoint)
    w0 = np.ones(DIM, np.float32)
    honest.register({"w": w0}, {"name": "sgd", "lr": 100.0})
    bad.register({"w": w0})
    honest.push({"w": np.full(DIM, 0.01, np.float32)}, 0)
    bad.push({"w": np.full(DIM, 3e38, np.float32)}, 0)
    d = honest.pull(0, wait_for=1)
    assert d.version == 1
    # applied without the offender: the honest push alone, at full weight (1 - 100 * 0.01)
    np.testing.assert_array_equal(honest.pull(None).tensors["w"][1], np.zeros(DIM, np.float32))
    with pytest.raises(BadRequest, match=rf"\[bad_value\].*worker {bad.worker_id}.*non-finite"):
        bad.pull(1)
    assert "would have made the model non-finite" in s.logs()
    # every push of a step overflowing on its own: an empty step, the model as it was
    before = honest.pull(None).tensors["w"][1].copy()
    honest.push({"w": np.full(DIM, 3e38, np.float32)}, 1)
    bad.push({"w": np.full(DIM, 3e38, np.float32)}, 1)
    wait_until(lambda: answers(honest) == 2, 30, "the empty step")
    probe = make_client(s.endpoint)
    probe.register({"w": w0})
    np.testing.assert_array_equal(probe.pull(None).tensors["w"][1], before)
    for c in (honest, bad):
        with pytest.raises(BadRequest, match="non-finite"):
            c.pull(2)


# ------------------------------------------------------------------ stray joins
def test_a_stream_of_stray_joins_holds_no_step(make_server, make_client):
    s = make_server(1, ["--liveness-timeout", "2"])
    a = make_client(s.endpoint)
    a.register({"w": np.zeros(16, np.float32)}, {"name": "sgd", "lr": 1.0})
    stop = threading.Event()
    joined = []

    def strays() -> None:  # a new connection and a join every 50 ms, never a registration
        ctx = zmq.Context()
        try:
            for _ in range(60):
                if stop.is_set():
                    break
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVTIMEO, 10000)
                sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve_keys()
                sock.connect(s.endpoint)
                joined.append(call(sock, enc({"type": "join", "name": "stray"})))
                sock.close(linger=0)
                time.sleep(0.05)
        finally:
            ctx.term()

    t = threading.Thread(target=strays)
    t.start()
    v, deadline = 0, time.monotonic() + 60
    try:
        while v < 60 or (len(joined) < 10 and t.is_alive()):  # the steps go on while ten strays join,
            assert time.monotonic() < deadline, (v, len(joined))  # however slowly a busy machine lets them
            a.push({"w": np.ones(16, np.float32)}, v)
            v = a.pull(v, wait_for=v + 1).version
            time.sleep(0.02)
    finally:
        stop.set()
        t.join(30)
    # each got a worker id, or, once its key held --max-workers-per-key strays, a refusal
    assert v >= 60 and len(joined) >= 10 and sum(r["type"] == "joined" for r in joined) >= 7
    assert all(r["type"] == "joined" or r.get("code") == "limit" for r in joined), joined
    assert "step deadline passed" not in s.logs()  # no step ever waited for a stray


# ------------------------------------------------------------------ checkpoints all damaged, then two restarts
@pytest.mark.slow
def test_all_checkpoints_damaged_then_two_restarts_resume_from_one_written_after_the_first(
        make_server, make_client, tmp_path):
    port = free_port()
    ckdir = tmp_path / "ck"
    args = ["--checkpoint-dir", str(ckdir), "--checkpoint-every-steps", "5", "--checkpoint-every-s", "0"]
    w = {"w": np.zeros(32, np.float32)}

    def train(srv, steps: int) -> int:
        c = make_client(srv.endpoint)
        reg = c.register(w, {"name": "sgd", "lr": 0.1})
        v = reg.version
        for _ in range(steps):
            c.push({"w": np.ones(32, np.float32)}, v)
            v = c.pull(v, wait_for=v + 1).version
        wait_until(lambda: (c.status().checkpoint_version or 0) >= v - v % 5, 30, "a checkpoint")
        c.close()
        return v

    s1 = make_server(1, args, bind=f"tcp://127.0.0.1:{port}")
    assert train(s1, 32) == 32
    s1.kill(signal.SIGKILL)
    s1.wait(10)
    damaged = ckfmt.names(str(ckdir))
    assert damaged
    for n in damaged:
        p = ckdir / n
        p.write_bytes(p.read_bytes()[:100])
    s2 = make_server(1, args, bind=f"tcp://127.0.0.1:{port}")
    assert train(s2, 12) == 12  # started empty: the worker seeded it again
    assert sorted(p.name for p in (ckdir / "damaged").iterdir()) == sorted(damaged)
    s2.kill(signal.SIGKILL)
    s2.wait(10)
    s3 = make_server(1, args, bind=f"tcp://127.0.0.1:{port}")
    c = make_client(s3.endpoint)
    st = c.status()
    # written after the first restart: the one of step 10, or (a checkpoint copies the state a slice at a
    # time and rolls forward the steps applied meanwhile) of a step after it, never the damaged ones' 30
    assert 10 <= st.version == st.checkpoint_version <= 12, st
    assert "resumed from checkpoint" in s3.logs()


# ------------------------------------------------------------------ the many-frame message
def test_a_many_frame_message_is_refused_its_host_cut_its_key_banned_and_the_memory_given_back(
        make_server, make_client, raw_dealer):
    """libzmq bounds frames, not messages: a message of many frames under the frame
    limit is buffered whole. The server answers `oversized`, cuts the connections of its
    host, refuses its key for --oversized-ban-s and gives the memory back."""
    s = make_server(1, ["--max-message-bytes", str(1 << 20), "--oversized-ban-s", "30"])
    good = make_client(s.endpoint)
    good.register({"w": np.zeros(8, np.float32)})
    before = rss(s.pid)
    raw = raw_dealer(s.endpoint)
    frame = b"\0" * (512 << 10)
    r = call(raw, enc({"type": "status"}), tuple([frame] * 128))  # 64 MiB in all
    assert r["type"] == "error" and r["code"] == "oversized", r
    # the key is refused: its workers are dropped, and a new connection cannot join
    with pytest.raises(Unauthorised):  # at the handshake: the timeout only bounds a hang
        Client(s.endpoint, timeout=30, reconnect=0)
    wait_until(lambda: rss(s.pid) < before + (24 << 20), 30, "the heap given back")
    assert "oversized message: cutting the connections of its host" in s.logs()
    assert s.alive()
