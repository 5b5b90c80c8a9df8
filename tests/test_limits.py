"""Bounds on what a peer can make the server hold, and operator bounds on values.

Each limit is hit against a real server: the reply names the code and the flag, and
nothing changed (version, model, optimizer, status counts, memory where it matters).
"""
from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest
import zmq
from zmq.utils.monitor import parse_monitor_message

from stella import Client
from stella.errors import BadRequest, ErrorCode, from_reply
from stella.protocol import MAX_HEADER_BYTES, PROTOCOL_VERSION
from stella_ps.broadcast import OWED_BYTES
from stella_ps.config import parse_args
from stella_ps.kernel import state_bytes
from stella_ps.process import ServerStartError
from stella_ps.store import model_bytes

MiB = 1 << 20


def call(sock: zmq.Socket, hdr: dict, frames=()) -> dict:
    sock.send_multipart([msgspec.msgpack.encode({"proto": PROTOCOL_VERSION, "req": 7, **hdr}), *frames])
    return msgspec.msgpack.decode(sock.recv_multipart()[0])


def refused(exc_info, code: str, *fragments: str) -> None:
    e = exc_info.value
    assert isinstance(e, BadRequest) and e.code == ErrorCode(code), repr(e)
    for f in fragments:
        assert f in str(e), str(e)


def rss_hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_limit_code_maps_to_bad_request():
    e = from_reply("limit", "too many")
    assert isinstance(e, BadRequest) and e.code is ErrorCode.LIMIT and "[limit] too many" in str(e)


def test_flags_env_and_defaults(monkeypatch):
    d = parse_args([]).limits
    assert (d.max_workers, d.max_waiting_pulls, d.max_queued_pushes) == (256, 8, 4)
    assert d.max_queued_push_bytes == 256 * MiB and d.max_model_bytes > 0
    assert d.max_push_norm == 0 and d.push_norm_action == "refuse"
    # bounds no real job reaches are on by default (issue 25); '' turns one off
    lim = d.optimizer_limits
    assert (lim.max_lr, lim.max_weight_decay, lim.min_eps) == (100.0, 10.0, 1e-16)
    assert parse_args(["--max-lr", ""]).limits.max_lr is None
    monkeypatch.setenv("STELLA_PS_MAX_WORKERS", "3")
    monkeypatch.setenv("STELLA_PS_MAX_LR", "0.5")
    monkeypatch.setenv("STELLA_PS_PUSH_NORM_ACTION", "clip")
    c = parse_args(["--max-waiting-pulls", "2"]).limits
    assert (c.max_workers, c.max_waiting_pulls, c.push_norm_action) == (3, 2, "clip")
    assert c.optimizer_limits.max_lr == 0.5
    assert parse_args(["--max-workers", "5"]).limits.max_workers == 5  # flag > env
    for bad in (["--max-workers", "0"], ["--max-push-norm", "-1"], ["--max-lr", "nan"],
                ["--push-norm-action", "ignore"], ["--optimizer", "sgd:lr=0.9"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


# ---------------------------------------------------------------- live workers
def test_max_workers(make_server, make_client, raw_dealer):
    srv = make_server(1, ["--max-workers", "2"])
    a = make_client(srv.endpoint)
    make_client(srv.endpoint)
    with pytest.raises(BadRequest) as ei:
        make_client(srv.endpoint)
    refused(ei, "limit", "2 live workers", "--max-workers 2")
    raw = raw_dealer(srv.endpoint)
    r = call(raw, {"type": "join", "name": "third"})
    assert r["type"] == "error" and r["code"] == "limit"
    assert a.status().workers == [0, 1]
    assert a.join(a.worker_id) == a.worker_id  # a live worker re-joining is not a new one
    a.leave()
    assert call(raw, {"type": "join", "name": "third"})["type"] == "joined"  # room again
    assert "--max-workers" in srv.logs()


def test_max_workers_per_key(make_server, make_client, tmp_path):
    """One key (a site's machine) holds at most --max-workers-per-key live workers;
    another key still joins."""
    from stella_ps.security import write_keyset

    keys = write_keyset(str(tmp_path), clients=("site_a", "site_b"))
    srv = make_server(1, ["--keys", keys.server_secret, "--allow", keys.allowlist, "--max-workers-per-key", "2"])
    site_a = {"server_key": keys.server_public, "client_key": keys.client_secrets["site_a"]}
    a1 = make_client(srv.endpoint, **site_a)
    make_client(srv.endpoint, **site_a)
    with pytest.raises(BadRequest) as ei:
        make_client(srv.endpoint, **site_a)
    refused(ei, "limit", "this key already has 2 live workers", "--max-workers-per-key 2")
    make_client(srv.endpoint, server_key=keys.server_public, client_key=keys.client_secrets["site_b"])
    st = a1.status()
    assert len(st.workers) == 3 and len(set(st.worker_keys.values())) == 2


def test_a_frame_over_the_limit_costs_the_connection_not_memory(make_server, raw_dealer):
    """libzmq drops a peer whose frame exceeds --max-message-bytes before buffering it:
    a 40-frame, 320 MiB message to a 4 MiB server is never held."""
    srv = make_server(1, ["--max-message-bytes", str(4 * MiB)])
    rss0 = _rss_kib(srv.pid)
    raw = raw_dealer(srv.endpoint)
    dropped = raw.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        frame = b"\0" * (8 * MiB)
        raw.send_multipart([msgspec.msgpack.encode({"type": "status", "proto": PROTOCOL_VERSION, "req": 1}),
                            *[frame] * 40])
        # the connection is dropped (seen as it happens, not as a reply that did not come within some time;
        # 30 s only bound a hang), and no reply came
        assert dropped.poll(30_000), "the server did not drop the connection"
        assert parse_monitor_message(dropped.recv_multipart())["event"] == zmq.EVENT_DISCONNECTED
        assert not raw.poll(0)
    finally:
        raw.disable_monitor()
        dropped.close(linger=0)
    assert srv.alive() and _rss_kib(srv.pid) - rss0 < 64 * 1024
    with Client(srv.endpoint, timeout=10, join=False) as c:  # others are served as before
        assert c.status().messages >= 1


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_max_workers_from_the_environment(make_server, make_client):
    srv = make_server(1, env={"STELLA_PS_MAX_WORKERS": "1"})
    make_client(srv.endpoint)
    with pytest.raises(BadRequest) as ei:
        make_client(srv.endpoint)
    refused(ei, "limit", "--max-workers 1")


def test_huge_worker_name_is_refused_and_nothing_held(server, make_client, raw_dealer):
    c = make_client(server.endpoint)
    raw = raw_dealer(server.endpoint)
    r = call(raw, {"type": "join", "name": "x" * MiB})
    assert r["type"] == "error" and r["code"] == "oversized" and f"> {MAX_HEADER_BYTES}" in r["message"]
    r = call(raw, {"type": "join", "name": "x" * 2000})  # below the header bound, above MAX_NAME_BYTES
    assert r["type"] == "error" and r["code"] == "protocol" and "$.name" in r["message"]
    assert c.status().workers == [c.worker_id]


# ---------------------------------------------------------------- waiting pulls
def test_max_waiting_pulls_per_worker(make_server, make_client):
    srv = make_server(1, ["--max-waiting-pulls", "3"])
    a, b = make_client(srv.endpoint), make_client(srv.endpoint)
    a.register({"w": np.zeros(4, np.float32)}, {"name": "sgd", "lr": 1.0})
    b.register({"w": np.zeros(4, np.float32)})
    waiting = [a.pull(0, wait_for=1, wait=False, timeout=30) for _ in range(3)]
    pulls = a.status().pulls
    with pytest.raises(BadRequest) as ei:
        a.pull(0, wait_for=1, timeout=30)
    refused(ei, "limit", "3 pulls waiting", "--max-waiting-pulls 3")
    assert a.status().pulls == pulls and a.status().errors >= 1
    b.pull(0, wait_for=1, wait=False, timeout=30)  # the bound is per worker
    a.pull(0)  # a pull of the present is not a waiting one
    # answered waiters are counted out: a step releases them, then there is room again
    a.push({"w": np.ones(4, np.float32)}, 0)
    b.push({"w": np.ones(4, np.float32)}, 0)
    assert [p.result().version for p in waiting] == [1, 1, 1]
    more = [a.pull(1, wait_for=2, wait=False, timeout=1.0) for _ in range(3)]
    assert [p.result().version for p in more] == [1, 1, 1]  # expired (timeout): counted out too
    again = [a.pull(1, wait_for=2, wait=False, timeout=1.0) for _ in range(3)]
    assert [p.result().version for p in again] == [1, 1, 1]


# ---------------------------------------------------------------- queued pushes
def _two_workers(make_server, make_client, args):
    srv = make_server(2, args)
    a, b = make_client(srv.endpoint), make_client(srv.endpoint)
    a.register({"w": np.zeros(1024, np.float32)}, {"name": "sgd", "lr": 1.0})
    b.register({"w": np.zeros(1024, np.float32)})
    return srv, a, b


def test_max_queued_pushes_per_worker(make_server, make_client):
    _srv, a, b = _two_workers(make_server, make_client, ["--max-queued-pushes", "2"])
    g = {"w": (np.array([1], np.int32), np.array([1.0], np.float32))}
    a.push(g, 0)
    a.push(g, 0)  # b never pushes: a's pushes wait for their step
    with pytest.raises(BadRequest) as ei:
        a.push(g, 0)
    refused(ei, "limit", "2 pushes waiting", "--max-queued-pushes 2")
    st = a.status()
    assert st.pending_pushes == 2 and st.pushes == 2 and st.version == 0
    b.push(g, 0)  # closes step 1 with a's first push; a has room for one more
    assert a.pull(0, wait_for=1).version == 1
    a.push(g, 1)
    assert a.status().pending_pushes == 2


def test_max_queued_push_bytes_per_worker(make_server, make_client):
    _srv, a, _b = _two_workers(make_server, make_client, ["--max-queued-push-bytes", "6000"])
    dense = {"w": np.ones(1024, np.float32)}  # 4096 bytes of values
    a.push(dense, 0)  # a push to an empty queue is always taken, whatever its size
    with pytest.raises(BadRequest) as ei:
        a.push(dense, 0)
    refused(ei, "limit", "4096 bytes of pushes waiting", "--max-queued-push-bytes 6000")
    a.push({"w": (np.array([1], np.int32), np.array([1.0], np.float32))}, 0)  # small: fits
    st = a.status()
    assert st.pending_pushes == 2 and st.version == 0


# ---------------------------------------------------------------- model bytes
def test_max_model_bytes_refused_before_allocating(make_server, make_client):
    n = 100_000
    adam, sgd = state_bytes(n, "adam"), state_bytes(n, "sgd")
    assert (adam, sgd) == (16 * n, 8 * n)
    # with the broadcast (the default) the store holds 10 bytes a coordinate more: its model and residual, and
    # up to 2 for the messages its model owes between sweeps
    assert model_bytes([n], "adam", broadcast=True) == adam + 10 * n
    srv = make_server(1, ["--max-model-bytes", str(2 * MiB)])
    c = make_client(srv.endpoint)
    with pytest.raises(BadRequest) as ei:
        c.register({"w": np.zeros(n, np.float32)}, {"name": "adam"})
    refused(ei, "limit", f"need {adam + 10 * n} bytes", f"limit of {2 * MiB} bytes", "--max-model-bytes")
    st = c.status()
    assert not st.initialised and st.numel == 0 and st.bytes_in < 10_000  # the values were never sent
    c.register({"w": np.zeros(n, np.float32)}, {"name": "sgd"})  # 1.6 MB: fits
    assert c.status().numel == n


def _registration_growth(make_server, make_client, tensors: int, coords: int) -> tuple[int, int, int]:
    srv = make_server(1, log_level="WARNING")
    c = make_client(srv.endpoint, timeout=60)
    time.sleep(0.2)
    before = rss_hwm(srv.pid)
    c.register({f"t{i}": np.ones(coords, np.float32) for i in range(tensors)}, {"name": "adam"})
    # what the registration allocates: not the room for the messages the broadcast's model may owe later
    allocated = model_bytes([coords] * tensors, "adam", broadcast=True) - OWED_BYTES * tensors * coords
    return rss_hwm(srv.pid) - before, allocated, 4 * tensors * coords


@pytest.mark.parametrize("tensors,coords", [(1, 16 * MiB), (40, 460_000)], ids=["one-64MiB", "40-odd-sized"])
def test_registration_peak_is_state_plus_message(make_server, make_client, tensors, coords):
    """Adam keeps 16 bytes a coordinate (4x the values), the broadcast 8 more (its model
    and residual); the registration message (1x) is the only other thing the first
    registration holds. Before huge pages were rationed, the 40 odd-sized tensors took
    5.6x their values (2 MiB rounding)."""
    grew, state, values = _registration_growth(make_server, make_client, tensors, coords)
    assert state <= 6.05 * values
    assert grew <= state + values + 24 * MiB, (grew / values, state / values)


# ---------------------------------------------------------------- hyper-parameters
def test_max_lr_and_weight_decay(make_server, make_client):
    srv = make_server(1, ["--max-lr", "0.5", "--max-weight-decay", "0.1"])
    c = make_client(srv.endpoint)
    w = {"w": np.zeros(4, np.float32)}
    with pytest.raises(BadRequest) as ei:
        c.register(w, {"name": "adamw", "lr": 0.6})
    refused(ei, "optimizer", "lr=0.6 is above the server's limit 0.5", "--max-lr")
    with pytest.raises(BadRequest) as ei:
        c.register(w, {"name": "adamw", "weight_decay": 0.2})
    refused(ei, "optimizer", "weight_decay=0.2", "--max-weight-decay")
    assert not c.status().initialised
    c.register(w, {"name": "adamw", "lr": 0.5, "weight_decay": 0.1})
    opt = c.status().optimizer
    with pytest.raises(BadRequest) as ei:
        c.set_optimizer(lr=0.75)
    refused(ei, "optimizer", "--max-lr")
    with pytest.raises(BadRequest) as ei:
        c.push({"w": np.ones(4, np.float32)}, 0, hparams={"weight_decay": 0.5})
    refused(ei, "optimizer", "--max-weight-decay")
    st = c.status()
    assert st.optimizer == opt and st.pending_pushes == 0 and st.version == 0
    c.set_optimizer(lr=0.25)  # inside the bounds
    assert c.status().optimizer["lr"] == 0.25


def test_default_optimizer_must_obey_the_bounds(make_server):
    with pytest.raises(ServerStartError) as ei:
        make_server(1, ["--optimizer", "sgd:lr=1.0", "--max-lr", "0.5"])
    assert "--max-lr" in ei.value.log


# ---------------------------------------------------------------- push norm
def _norm_server(make_server, make_client, *args):
    srv = make_server(1, ["--max-push-norm", "5", *args], pull="exact")
    c = make_client(srv.endpoint)
    c.register({"w": np.zeros(2, np.float32), "b": np.zeros(3, np.float32)}, {"name": "sgd", "lr": 1.0})
    return srv, c


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_push_norm_refused(make_server, make_client, dtype):
    _srv, c = _norm_server(make_server, make_client)
    with pytest.raises(BadRequest) as ei:  # norm over all tensors: sqrt(9 + 16 + 1) > 5
        c.push({"w": np.array([3.0, 0.0], np.float32), "b": np.array([4.0, 0, 1], np.float32)}, 0,
               value_dtype=dtype)
    refused(ei, "bad_value", "5.09902", "--max-push-norm")
    st = c.status()
    assert st.version == 0 and st.pending_pushes == 0 and st.pushes == 0
    c.push({"w": np.array([3.0, 0.0], np.float32), "b": np.array([4.0, 0, 0], np.float32)}, 0,
           value_dtype=dtype)  # exactly 5: taken
    assert c.pull(0, wait_for=1).version == 1


def test_push_norm_refuses_values_near_float32_max(make_server, make_client):
    _srv, c = _norm_server(make_server, make_client)
    with pytest.raises(BadRequest) as ei:
        c.push({"w": np.array([3e38, -3e38], np.float32)}, 0)
    refused(ei, "bad_value", "4.24264e+38", "--max-push-norm")
    assert c.status().version == 0


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_push_norm_clip(make_server, make_client, dtype):
    srv, c = _norm_server(make_server, make_client, "--push-norm-action", "clip")
    ok = c.push({"w": np.array([30.0, 40.0], np.float32)}, 0, value_dtype=dtype)  # norm 50: scaled by 1/10
    assert ok.clipped == [(0, 5, 0.1)]  # the server's range (w then b) and the factor kept: the worker's to resend
    d = c.pull(0, wait_for=1)
    assert d.version == 1
    np.testing.assert_allclose(d.tensors["w"][1], [-3.0, -4.0], rtol=1e-6)
    assert "push clipped" in srv.logs() and "--max-push-norm" in srv.logs()
