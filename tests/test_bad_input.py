"""Every kind of bad input gets an error reply naming the problem and changes nothing.

One server serves the whole module: after every bad message the model, its version
and its optimizer are checked unchanged, and a well-behaved worker keeps training.
"""
from __future__ import annotations

import msgpack
import numpy as np
import pytest
import zmq

from conftest import ServerProc
from stella.client import Client
from stella.wire import PROTOCOL_VERSION

MAX_MSG = 2 << 20


@pytest.fixture(scope="module")
def env():
    srv = ServerProc(workers=1, extra=["--max-message-bytes", str(MAX_MSG)])
    good = Client(srv.endpoint, timeout=10)
    init = {"w": np.arange(100, dtype=np.float32).reshape(10, 10), "b": np.zeros(4, np.float32)}
    good.register(init, {"name": "sgd", "lr": 0.1})
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.RCVTIMEO, 10000)
    raw.connect(srv.endpoint)
    state = {"srv": srv, "good": good, "raw": raw, "version": 0}
    hdr = call(raw, {"type": "join", "name": "raw"})
    state["wid"] = hdr["worker"]
    reg = call(raw, {"type": "register", "worker": state["wid"], "values": False, "optimizer": {},
                     "tensors": [{"name": "w", "shape": [10, 10], "dtype": "float32"},
                                 {"name": "b", "shape": [4], "dtype": "float32"}]})
    assert reg["type"] == "registered"
    yield state
    raw.close(linger=0)
    good.close()
    assert srv.alive(), srv.logs()
    srv.stop()


_req = iter(range(1000, 10**9))


def call(sock: zmq.Socket, hdr, frames=(), *, raw_header: bytes | None = None) -> dict:
    if raw_header is None:
        hdr = {"proto": PROTOCOL_VERSION, "req": next(_req), **hdr}
        raw_header = msgpack.packb(hdr, use_bin_type=True)
    sock.send_multipart([raw_header, *frames])
    return msgpack.unpackb(sock.recv_multipart()[0], raw=False)


def i32(*xs):
    return np.array(xs, dtype="<i4").tobytes()


def f32(*xs):
    return np.array(xs, dtype="<f4").tobytes()


def push_hdr(env, tensors, version=0, **over):
    return {"type": "push", "worker": env["wid"], "version": version, "tensors": tensors, **over}


def snapshot(env):
    full = env["good"].pull(None)
    return full.version, {k: v[1].copy() for k, v in full.tensors.items()}


CASES = {
    # name: (builder(env) -> (header|None, frames, raw_header|None), expected code, message fragment)
    "unknown type": (lambda e: ({"type": "explode"}, [], None), "protocol", "unknown message type"),
    "malformed msgpack": (lambda e: (None, [], b"\xc1\xc1garbage"), "protocol", "malformed MessagePack"),
    "empty header": (lambda e: (None, [], b""), "protocol", "malformed MessagePack"),
    "header not a map": (lambda e: (None, [], msgpack.packb([1, 2, 3])), "protocol", "must be a map"),
    "wrong protocol version": (
        lambda e: (None, [], msgpack.packb({"type": "status", "proto": 99, "req": 1})), "protocol",
        "protocol version 99"),
    "missing field": (lambda e: ({"type": "push", "worker": e["wid"], "tensors": []}, [], None), "protocol",
                      "missing field 'version'"),
    "wrong field type": (lambda e: (push_hdr(e, [], version="0"), [], None), "protocol",
                         "'version' must be int"),
    "too few frames": (lambda e: (push_hdr(e, [{"t": 0, "n": 2}]), [i32(1, 2)], None), "protocol",
                       "frames missing"),
    "too many frames": (lambda e: (push_hdr(e, [{"t": 0, "n": 1}]), [i32(1), f32(1), f32(1)], None), "protocol",
                        "3 payload frames, header describes 2"),
    "payload on status": (lambda e: ({"type": "status"}, [b"x"], None), "protocol", "expected no payload frames"),
    "value frame wrong size (float64)": (
        lambda e: (push_hdr(e, [{"t": 0, "n": 2}]), [i32(1, 2), np.ones(2).tobytes()], None), "codec",
        "16 bytes for 2 values (need 8)"),
    "index frame wrong size": (lambda e: (push_hdr(e, [{"t": 0, "n": 2}]), [i32(1), f32(1, 2)], None), "codec",
                               "index frame (raw32)"),
    "unknown value dtype": (lambda e: (push_hdr(e, [{"t": 0, "n": 1, "vd": "f64"}]), [i32(1), f32(1)], None),
                            "codec", "unknown value dtype"),
    "unknown index coding": (lambda e: (push_hdr(e, [{"t": 0, "n": 1, "ic": "zip"}]), [i32(1), f32(1)], None),
                             "codec", "unknown index coding"),
    "index out of range": (lambda e: (push_hdr(e, [{"t": 0, "n": 2}]), [i32(5, 100), f32(1, 1)], None), "codec",
                           "out of range"),
    "negative index": (lambda e: (push_hdr(e, [{"t": 0, "n": 2}]), [i32(-1, 3), f32(1, 1)], None), "codec",
                       "out of range"),
    "unsorted indices": (lambda e: (push_hdr(e, [{"t": 0, "n": 3}]), [i32(5, 3, 9), f32(1, 1, 1)], None), "codec",
                         "not sorted strictly increasing"),
    "duplicated indices": (lambda e: (push_hdr(e, [{"t": 0, "n": 3}]), [i32(3, 3, 9), f32(1, 1, 1)], None),
                           "codec", "duplicated"),
    "NaN value": (lambda e: (push_hdr(e, [{"t": 0, "n": 2}]), [i32(1, 2), f32(1, np.nan)], None), "bad_value",
                  "NaN/Inf"),
    "Inf value (dense)": (lambda e: (push_hdr(e, [{"t": 1, "n": 4, "ic": "dense"}]), [f32(1, 1, np.inf, 1)], None),
                          "bad_value", "NaN/Inf"),
    "dense count wrong": (lambda e: (push_hdr(e, [{"t": 1, "n": 3, "ic": "dense"}]), [f32(1, 1, 1)], None),
                          "protocol", "needs 4 values"),
    "unknown tensor": (lambda e: (push_hdr(e, [{"t": 7, "n": 1}]), [i32(1), f32(1)], None), "unknown_tensor",
                       "tensor 7 is not in the model"),
    "tensor named not indexed": (lambda e: (push_hdr(e, [{"t": "w", "n": 1}]), [i32(1), f32(1)], None),
                                 "unknown_tensor", "not in the model"),
    "tensor twice": (lambda e: (push_hdr(e, [{"t": 0, "n": 1}, {"t": 0, "n": 1}]), [i32(1), f32(1)] * 2, None),
                     "protocol", "appears twice"),
    "version from the future": (lambda e: (push_hdr(e, [{"t": 0, "n": 1}], version=10**6), [i32(1), f32(1)], None),
                                "version", "from the future"),
    "negative version": (lambda e: (push_hdr(e, [{"t": 0, "n": 1}], version=-2), [i32(1), f32(1)], None),
                         "version", "from the future"),
    "pull from the future": (lambda e: ({"type": "pull", "worker": e["wid"], "since": 10**6}, [], None), "version",
                             "from the future"),
    "pull with a block-only coding": (lambda e: ({"type": "pull", "worker": e["wid"], "since": 0, "ic": "block16"},
                                                  [], None), "protocol", "not available for pulls"),
    "count larger than tensor": (lambda e: (push_hdr(e, [{"t": 1, "n": 5}]), [i32(0, 1, 2, 3, 4), f32(*[1] * 5)],
                                            None), "oversized", "5 values > its 4 elements"),
    "oversized header": (lambda e: ({"type": "status", "pad": "x" * (1 << 20)}, [], None), "oversized",
                         "oversized header"),
    "oversized message": (lambda e: (push_hdr(e, [{"t": 0, "n": 1}]), [i32(1), b"\0" * MAX_MSG], None), "oversized",
                          "limit"),
    "impersonating another worker": (lambda e: (push_hdr(e, [], worker=e["good"].worker_id), [], None),
                                     "not_registered", "belongs to another connection"),
    "worker never joined": (lambda e: (push_hdr(e, [], worker=4242), [], None), "not_registered", "has not joined"),
    "register bad dtype": (lambda e: ({"type": "register", "worker": e["wid"], "values": False, "optimizer": {},
                                       "tensors": [{"name": "w", "shape": [10, 10], "dtype": "float64"}]}, [], None),
                           "protocol", "dtype 'float64' not supported"),
    "register bad shape": (lambda e: ({"type": "register", "worker": e["wid"], "values": False, "optimizer": {},
                                       "tensors": [{"name": "w", "shape": [10, -1], "dtype": "float32"}]}, [], None),
                           "protocol", "'shape' must be"),
    "register wrong value frame": (lambda e: ({"type": "register", "worker": e["wid"], "values": True,
                                               "optimizer": {}, "tensors": [{"name": "b", "shape": [4],
                                                                             "dtype": "float32"}]}, [f32(1, 2)], None),
                                   "codec", "value frame"),
    "register bad optimizer": (lambda e: ({"type": "register", "worker": e["wid"], "values": False,
                                           "optimizer": {"name": "adamw", "lr": -1},
                                           "tensors": [{"name": "b", "shape": [4], "dtype": "float32"}]}, [], None),
                               "optimizer", "lr=-1.0 is outside"),
    "set_optimizer unknown hparam": (lambda e: ({"type": "set_optimizer", "worker": e["wid"],
                                                 "hparams": {"betas": [0.9, 0.99]}}, [], None), "optimizer",
                                     "unknown hyper-parameter"),
    "set_optimizer bad value": (lambda e: ({"type": "set_optimizer", "worker": e["wid"],
                                            "hparams": {"momentum": float("nan")}}, [], None), "optimizer",
                                "momentum=nan"),
    "set_optimizer unknown momentum_mode": (lambda e: ({"type": "set_optimizer", "worker": e["wid"],
                                                        "hparams": {"momentum_mode": "eager"}}, [], None),
                                            "optimizer", "momentum_mode must be one of"),
    "set_optimizer fold with momentum 1": (lambda e: ({"type": "set_optimizer", "worker": e["wid"],
                                                       "hparams": {"momentum": 1.0}}, [], None),
                                           "optimizer", "requires momentum < 1"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_rejected_and_changes_nothing(env, case):
    build, code, fragment = CASES[case]
    before = snapshot(env)
    opt_before = env["good"].status()["optimizer"]
    hdr, frames, raw_header = build(env)
    reply = call(env["raw"], hdr, frames, raw_header=raw_header)
    assert reply["type"] == "error", reply
    assert reply["code"] == code, reply
    assert fragment in reply["message"], reply
    after = snapshot(env)
    assert after[0] == before[0]
    for k in before[1]:
        assert after[1][k].tobytes() == before[1][k].tobytes()
    st = env["good"].status()
    assert st["optimizer"] == opt_before and st["pending_pushes"] == 0
    assert env["srv"].alive()


def test_good_worker_keeps_training_after_bad_input(env):
    good = env["good"]
    v = good.status()["version"]
    # the raw worker is live too: it must push for the step to close
    call(env["raw"], push_hdr(env, [{"t": 1, "n": 1}], version=v), [i32(0), f32(1)])
    good.push({"b": (np.array([0], np.int32), np.array([1.0], np.float32))}, v)
    d = good.pull(v, wait_for=v + 1)
    assert d.version == v + 1
    np.testing.assert_allclose(d.tensors["b"][1], [-0.1])
