"""Every kind of bad input gets an error reply naming the problem and changes nothing.

One server serves the whole module: after every bad message the model, its version
and its optimizer are checked unchanged, and a well-behaved worker keeps training.
"""
from __future__ import annotations

import msgspec
import numpy as np
import pytest
import zmq

from stella.client import Client, curve_keys
from stella.protocol import PROTOCOL_VERSION

MAX_MSG = 2 << 20
DENSE_BELOW = 50


@pytest.fixture(scope="module")
def env(module_server_factory):
    # --oversized-ban-s 0: this module's one key goes on after its oversized messages
    # (hanging up on it is tests/test_hostile.py's)
    # --dense-below 50: the server's two tensors are the flat model's parts, w's 100 coordinates and b's 4
    srv = module_server_factory(1, ["--max-message-bytes", str(MAX_MSG), "--oversized-ban-s", "0", "--dense-below",
                                    str(DENSE_BELOW)], pull="exact")
    good = Client(srv.endpoint, timeout=10)
    init = {"w": np.arange(100, dtype=np.float32).reshape(10, 10), "b": np.zeros(4, np.float32)}
    good.register(init, {"name": "sgd", "lr": 0.1})
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.RCVTIMEO, 60000)  # the 140001-frame message takes seconds on a loaded 2-core machine
    raw.curve_serverkey, raw.curve_publickey, raw.curve_secretkey = curve_keys()  # the session's allowed pair
    raw.connect(srv.endpoint)
    state = {"srv": srv, "good": good, "raw": raw, "version": 0}
    hdr = call(raw, {"type": "join", "name": "raw"})
    state["wid"] = hdr["worker"]
    reg = call(raw, {"type": "register", "worker": state["wid"], "values": False, "optimizer": {},
                     "dense_below": DENSE_BELOW,
                     "tensors": [{"name": "w", "shape": [10, 10], "dtype": "float32"},
                                 {"name": "b", "shape": [4], "dtype": "float32"}]})
    assert reg["type"] == "registered" and not reg["needs_values"]
    yield state
    raw.close(linger=0)
    good.close()
    assert srv.alive(), srv.logs()


_req = iter(range(1000, 10**9))


def call(sock: zmq.Socket, hdr, frames=(), *, raw_header: bytes | None = None) -> dict:
    want = None
    if raw_header is None:
        req = next(_req)
        hdr = {"proto": PROTOCOL_VERSION, "req": req, **hdr}
        raw_header = msgspec.msgpack.encode(hdr)
        want = req if hdr["req"] is req else None  # a test that writes its own req gets the next reply
    sock.send_multipart([raw_header, *frames])
    while True:
        reply = msgspec.msgpack.decode(sock.recv_multipart()[0])
        # a late reply to an earlier request (one that timed out) is not this one's answer
        if want is None or reply.get("req") in (want, None):
            return reply


def i32(*xs):
    return np.array(xs, dtype="<i4").tobytes()


def f32(*xs):
    return np.array(xs, dtype="<f4").tobytes()


def push_hdr(env, tensors, version=0, **over):
    return {"type": "push", "worker": env["wid"], "version": version, "tensors": tensors, **over}


def pull_hdr(env, **over):
    return {"type": "pull", "proto": PROTOCOL_VERSION, "req": 7, "worker": env["wid"], "since": 0, **over}


def snapshot(env):
    full = env["good"].pull(None)
    return full.version, {k: v[1].copy() for k, v in full.tensors.items()}


def e(t, n, coding="raw32", vd="f32", fi=0, fv=None):
    """A tensor entry as it travels: [tensor, count, coding, value_dtype, index_frame, value_frame]."""
    if coding == "dense":
        return [t, n, coding, vd, None, fi if fv is None else fv]
    return [t, n, coding, vd, fi, fi + 1 if fv is None else fv]


def reg_hdr(env, tensors=None, values=False, optimizer=None):
    return {"type": "register", "worker": env["wid"], "values": values, "optimizer": optimizer or {},
            "tensors": tensors or [{"name": "b", "shape": [4], "dtype": "float32"}], "dense_below": DENSE_BELOW}


def set_opt(env, **hp):
    return {"type": "set_optimizer", "worker": env["wid"], "hparams": hp}


CASES = {
    # name: (builder(env) -> (header|None, frames, raw_header|None), expected code, message fragment)
    "unknown type": (lambda e: ({"type": "explode"}, [], None), "protocol", "unknown request type 'explode'"),
    "type is a list": (lambda e: ({"type": ["push"]}, [], None), "protocol", "unknown request type ['push']"),
    "type is a map": (lambda e: ({"type": {"push": 1}}, [], None), "protocol", "unknown request type"),
    "reply type as a request": (lambda e: ({"type": "joined"}, [], None), "protocol", "unknown request type"),
    "malformed msgpack": (lambda e: (None, [], b"\xc1\xc1garbage"), "protocol", "malformed MessagePack"),
    "empty header": (lambda e: (None, [], b""), "protocol", "malformed MessagePack"),
    "header not a map": (lambda e: (None, [], msgspec.msgpack.encode([1, 2, 3])), "protocol", "must be a map"),
    "wrong protocol version": (
        lambda e: (None, [], msgspec.msgpack.encode({"type": "status", "proto": 99, "req": 1})), "protocol",
        "protocol version 99"),
    "protocol version as float": (
        lambda e: (None, [], msgspec.msgpack.encode({"type": "status", "proto": float(PROTOCOL_VERSION), "req": 1})),
        "protocol", f"protocol version {float(PROTOCOL_VERSION)}"),
    "protocol version as bool": (
        lambda e: (None, [], msgspec.msgpack.encode({"type": "status", "proto": True, "req": 1})), "protocol",
        "protocol version True"),
    "request id as bool": (lambda e: ({"type": "status", "req": True}, [], None), "protocol",
                           "Expected `int`, got `bool` - at `$.req`"),
    "unknown field": (lambda e: ({"type": "status", "pad": 1}, [], None), "protocol", "unknown field `pad`"),
    "missing field": (lambda e: ({"type": "push", "worker": e["wid"], "tensors": []}, [], None), "protocol",
                      "missing required field `version`"),
    "wrong field type": (lambda e: (push_hdr(e, [], version="0"), [], None), "protocol",
                         "Expected `int`, got `str` - at `$.version`"),
    "version as float": (lambda e: (push_hdr(e, [], version=0.0), [], None), "protocol",
                         "Expected `int`, got `float` - at `$.version`"),
    "entry not an array": (lambda e: (push_hdr(e, [{"t": 0, "n": 1}]), [i32(1), f32(1)], None), "protocol",
                           "at `$.tensors[0]`"),
    "coding is a list": (lambda e: (push_hdr(e, [[0, 1, ["raw32"], "f32", 0, 1]]), [i32(1), f32(1)], None),
                         "protocol", "at `$.tensors[0].coding`"),
    "coding is a map": (lambda e: (push_hdr(e, [[0, 1, {"raw32": 1}, "f32", 0, 1]]), [i32(1), f32(1)], None),
                        "protocol", "at `$.tensors[0].coding`"),
    "value dtype is a list": (lambda e: (push_hdr(e, [[0, 1, "raw32", ["f32"], 0, 1]]), [i32(1), f32(1)], None),
                              "protocol", "at `$.tensors[0].value_dtype`"),
    "too few frames": (lambda e: (push_hdr(e, [e_(0, 2)]), [i32(1, 2)], None), "protocol", "frame 1 missing"),
    "too many frames": (lambda e: (push_hdr(e, [e_(0, 1)]), [i32(1), f32(1), f32(1)], None), "protocol",
                        "3 payload frames, the entries describe 2"),
    "frames out of order": (lambda e: (push_hdr(e, [e_(0, 1, fi=1, fv=0)]), [f32(1), i32(1)], None), "protocol",
                            "frame 1 referenced where frame 0 comes next"),
    "frame referenced twice": (lambda e: (push_hdr(e, [e_(0, 1), e_(1, 1, fi=1)]), [i32(1), f32(1), f32(1)],
                                          None), "protocol", "frame 1 referenced where frame 2 comes next"),
    "dense entry with an index frame": (lambda e: (push_hdr(e, [[1, 4, "dense", "f32", 0, 1]]),
                                                   [i32(1), f32(1, 1, 1, 1)], None), "protocol",
                                        "forbidden when dense"),
    "sparse entry without an index frame": (lambda e: (push_hdr(e, [[0, 1, "raw32", "f32", None, 0]]), [f32(1)],
                                                       None), "protocol", "index frame is required"),
    "too many frames in a message": (lambda e: ({"type": "status"}, [b""] * 140_000, None), "oversized",
                                     "frames > limit"),
    "payload on status": (lambda e: ({"type": "status"}, [b"x"], None), "protocol", "expected no payload frames"),
    "value frame wrong size (float64)": (
        lambda e: (push_hdr(e, [e_(0, 2)]), [i32(1, 2), np.ones(2).tobytes()], None), "codec",
        "16 bytes for 2 values (need 8)"),
    "index frame wrong size": (lambda e: (push_hdr(e, [e_(0, 2)]), [i32(1), f32(1, 2)], None), "codec",
                               "index frame (raw32)"),
    "unknown value dtype": (lambda e: (push_hdr(e, [e_(0, 1, vd="f64")]), [i32(1), f32(1)], None),
                            "protocol", "at `$.tensors[0].value_dtype`"),
    "unknown index coding": (lambda e: (push_hdr(e, [e_(0, 1, coding="zip")]), [i32(1), f32(1)], None),
                             "protocol", "at `$.tensors[0].coding`"),
    "index out of range": (lambda e: (push_hdr(e, [e_(0, 2)]), [i32(5, 100), f32(1, 1)], None), "codec",
                           "out of range"),
    "negative index": (lambda e: (push_hdr(e, [e_(0, 2)]), [i32(-1, 3), f32(1, 1)], None), "codec",
                       "out of range"),
    "unsorted indices": (lambda e: (push_hdr(e, [e_(0, 3)]), [i32(5, 3, 9), f32(1, 1, 1)], None), "codec",
                         "not sorted strictly increasing"),
    "duplicated indices": (lambda e: (push_hdr(e, [e_(0, 3)]), [i32(3, 3, 9), f32(1, 1, 1)], None),
                           "codec", "duplicated"),
    "NaN value": (lambda e: (push_hdr(e, [e_(0, 2)]), [i32(1, 2), f32(1, np.nan)], None), "bad_value",
                  "NaN/Inf"),
    "Inf value (dense)": (lambda e: (push_hdr(e, [e_(1, 4, "dense")]), [f32(1, 1, np.inf, 1)], None),
                          "bad_value", "NaN/Inf"),
    "Inf value (f16)": (lambda e: (push_hdr(e, [e_(0, 1, vd="f16")]), [i32(3), np.float16([np.inf]).tobytes()],
                                   None), "bad_value", "NaN/Inf"),
    "NaN value (bf16)": (lambda e: (push_hdr(e, [e_(0, 1, vd="bf16")]), [i32(3), np.uint16([0x7fc0]).tobytes()],
                                    None), "bad_value", "NaN/Inf"),
    "q4 value frame wrong size": (lambda e: (push_hdr(e, [e_(0, 2, vd="q4")]), [i32(1, 2), f32(1) + b"\x00\x00"],
                                            None), "codec", "6 bytes for 2 values (need 5)"),
    "q2 dense value frame wrong size": (lambda e: (push_hdr(e, [e_(1, 4, "dense", vd="q2")]), [f32(1)], None),
                                        "codec", "4 bytes for 4 values (need 5)"),
    "q4 NaN scale": (lambda e: (push_hdr(e, [e_(0, 2, vd="q4")]), [i32(1, 2), f32(np.nan) + b"\x21"], None),
                     "bad_value", "scale negative, NaN or Inf"),
    "q2 Inf scale": (lambda e: (push_hdr(e, [e_(1, 4, "dense", vd="q2")]), [f32(np.inf) + b"\x1b"], None),
                     "bad_value", "scale negative, NaN or Inf"),
    "q4 negative scale": (lambda e: (push_hdr(e, [e_(0, 2, vd="q4")]), [i32(1, 2), f32(-1.0) + b"\x21"], None),
                          "bad_value", "scale negative, NaN or Inf"),
    "q2 scale -0.0": (lambda e: (push_hdr(e, [e_(0, 1, vd="q2")]), [i32(3), f32(-0.0) + b"\x02"], None),
                      "bad_value", "scale negative, NaN or Inf"),
    "q2 pad bits set": (lambda e: (push_hdr(e, [e_(0, 1, vd="q2")]), [i32(3), f32(1.0) + b"\x06"], None),
                        "codec", "corrupt"),
    "q4 pad bits set": (lambda e: (push_hdr(e, [e_(0, 3, vd="q4")]), [i32(1, 2, 3), f32(1.0) + b"\x21\x13"], None),
                        "codec", "corrupt"),
    "dense count wrong": (lambda e: (push_hdr(e, [e_(1, 3, "dense")]), [f32(1, 1, 1)], None),
                          "protocol", "needs 4 values"),
    "unknown tensor": (lambda e: (push_hdr(e, [e_(7, 1)]), [i32(1), f32(1)], None), "unknown_tensor",
                       "tensor 7 is not in the model"),
    "tensor named not numbered": (lambda e: (push_hdr(e, [e_("w", 1)]), [i32(1), f32(1)], None),
                                  "protocol", "at `$.tensors[0].tensor`"),
    "tensor twice": (lambda e: (push_hdr(e, [e_(0, 1), e_(0, 1, fi=2)]), [i32(1), f32(1)] * 2, None),
                     "protocol", "appears twice"),
    "version from the future": (lambda e: (push_hdr(e, [e_(0, 1)], version=10**6), [i32(1), f32(1)], None),
                                "version", "from the future"),
    "negative version": (lambda e: (push_hdr(e, [e_(0, 1)], version=-2), [i32(1), f32(1)], None),
                         "protocol", "Expected `int` >= 0 - at `$.version`"),
    "push with a bad hyper-parameter": (lambda e: (push_hdr(e, [e_(0, 1)], hparams={"lr": -1.0}),
                                                   [i32(1), f32(1)], None), "optimizer", "lr=-1 is outside"),
    "pull from the future": (lambda e: ({"type": "pull", "worker": e["wid"], "since": 10**6}, [], None), "version",
                             "from the future"),
    "pull with a block-only coding": (lambda e: ({"type": "pull", "worker": e["wid"], "since": 0,
                                                  "coding": "block16"}, [], None), "protocol", "at `$.coding`"),
    "pull waiting too far ahead": (lambda e: ({"type": "pull", "worker": e["wid"], "since": 0,
                                               "wait_for": 10**6}, [], None), "version", "more than 1024 ahead"),
    "count larger than tensor": (lambda e: (push_hdr(e, [e_(1, 5)]), [i32(0, 1, 2, 3, 4), f32(*[1] * 5)],
                                            None), "oversized", "5 values > its 4 elements"),
    "oversized header": (lambda e: ({"type": "status", "pad": "x" * (1 << 20)}, [], None), "oversized",
                         "oversized header"),
    "oversized message": (lambda e: (push_hdr(e, [e_(0, 1)]), [i32(1), b"\0" * MAX_MSG], None), "oversized",
                          "limit"),
    "impersonating another worker": (lambda e: (push_hdr(e, [], worker=e["good"].worker_id), [], None),
                                     "not_registered", "belongs to another connection"),
    "worker never joined": (lambda e: (push_hdr(e, [], worker=4242), [], None), "not_registered", "has not joined"),
    "register bad dtype": (lambda e: (reg_hdr(e, [{"name": "w", "shape": [10, 10], "dtype": "float64"}]), [], None),
                           "protocol", "at `$.tensors[0].dtype`"),
    "register bad shape": (lambda e: (reg_hdr(e, [{"name": "w", "shape": [10, -1], "dtype": "float32"}]), [], None),
                           "protocol", "at `$.tensors[0].shape[1]`"),
    "register a name that is a list": (lambda e: (reg_hdr(e, [{"name": ["w"], "shape": [4], "dtype": "float32"}]),
                                                  [], None), "protocol", "at `$.tensors[0].name`"),
    "register a zero-element tensor": (lambda e: (reg_hdr(e, [{"name": "w", "shape": [0, 3], "dtype": "float32"}]),
                                                  [], None), "protocol", "no elements"),
    "register wrong value frame": (lambda e: (reg_hdr(e, values=True), [f32(1, 2)], None), "codec", "value frame"),
    "register NaN initial values": (lambda e: (reg_hdr(e, values=True), [f32(1, 2, np.nan, 4)], None),
                                    "bad_value", "NaN/Inf initial values"),
    "register bad optimizer": (lambda e: (reg_hdr(e, optimizer={"name": "adamw", "lr": -1}), [], None),
                               "optimizer", "lr=-1 is outside"),
    "register adam with eps 0": (lambda e: (reg_hdr(e, optimizer={"name": "adam", "eps": 0.0}), [], None),
                                 "optimizer", "eps=0 is outside (0,"),
    "register sgd with dampening 2": (lambda e: (reg_hdr(e, optimizer={"name": "sgd", "dampening": 2.0}), [], None),
                                      "optimizer", "dampening=2 is outside [0, 1]"),
    "register adam with beta 1": (lambda e: (reg_hdr(e, optimizer={"name": "adam", "betas": [1.0, 0.9]}), [], None),
                                  "optimizer", "betas[0]=1 is outside [0, 1)"),
    "register adamw lr * weight_decay > 1": (lambda e: (reg_hdr(e, optimizer={"name": "adamw", "lr": 10.0,
                                                                              "weight_decay": 0.5}), [], None),
                                             "optimizer", "lr * weight_decay = 5.0 > 1"),
    "register lr not finite in float32": (lambda e: (reg_hdr(e, optimizer={"name": "sgd", "lr": 1e300}), [], None),
                                          "optimizer", "lr=1e+300 is outside"),
    "set_optimizer unknown hparam": (lambda e: (set_opt(e, betas=[0.9, 0.99]), [], None), "optimizer",
                                     "unknown hyper-parameter"),
    "set_optimizer bad value": (lambda e: (set_opt(e, momentum=float("nan")), [], None), "optimizer",
                                "momentum=nan"),
    "set_optimizer negative lr": (lambda e: (set_opt(e, lr=-0.5), [], None), "optimizer", "lr=-0.5 is outside"),
    "set_optimizer unknown momentum_mode": (lambda e: (set_opt(e, momentum_mode="eager"), [], None),
                                            "optimizer", "momentum_mode must be one of"),
    "set_optimizer momentum 1": (lambda e: (set_opt(e, momentum=1.0), [], None), "optimizer",
                                 "momentum=1 is outside [0, 1)"),
    "set_optimizer hparams a list": (lambda e: ({"type": "set_optimizer", "worker": e["wid"], "hparams": [1]},
                                                [], None), "protocol", "at `$.hparams`"),
    # the round's pull riding on a push (protocol 15): checked before anything is queued
    "push's pull of another worker": (lambda e: (push_hdr(e, [], pull=pull_hdr(e, worker=e["wid"] + 1)), [], None),
                                      "protocol", "its pull is worker"),
    "push's pull of another protocol": (lambda e: (push_hdr(e, [], pull=pull_hdr(e, proto=PROTOCOL_VERSION - 1)),
                                                   [], None), "protocol", "its pull's protocol version"),
    "push's pull from the future": (lambda e: (push_hdr(e, [e_(0, 1)], pull=pull_hdr(e, since=10**6)),
                                               [i32(0), f32(1.0)], None), "version", "from the future"),
    # a server restarted from an older checkpoint gets the pair of a worker it does not know, its pull
    # since a version it never reached: the worker is told to join again, the one answer it can act on
    "push's pull from the future, of a worker that never joined": (
        lambda e: (push_hdr(e, [e_(0, 1)], worker=4242, pull=pull_hdr(e, worker=4242, since=10**6)),
                   [i32(0), f32(1.0)], None), "not_registered", "has not joined"),
    "push's pull not a pull": (lambda e: (push_hdr(e, [], pull={"type": "status", "proto": PROTOCOL_VERSION}),
                                          [], None), "protocol", "`$.pull.type`"),
}
e_ = e


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_rejected_and_changes_nothing(env, case):
    build, code, fragment = CASES[case]
    before = snapshot(env)
    opt_before = env["good"].status().optimizer
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
    assert st.optimizer == opt_before and st.pending_pushes == 0
    assert env["srv"].alive()


def test_good_worker_keeps_training_after_bad_input(env):
    good = env["good"]
    v = good.status().version
    # the raw worker is live too: it must push for the step to close
    call(env["raw"], push_hdr(env, [e(1, 1)], version=v), [i32(0), f32(1)])
    good.push({"b": (np.array([0], np.int32), np.array([1.0], np.float32))}, v)
    d = good.pull(v, wait_for=v + 1)
    assert d.version == v + 1
    np.testing.assert_allclose(d.tensors["b"][1], [-0.1])


def test_quantised_push_applies_what_it_decodes_to(env):
    """A q4 push that the server takes: the step applies the dequantised values."""
    good = env["good"]
    v = good.status().version
    before = snapshot(env)[1]["w"].reshape(-1)
    scale_and_codes = f32(2.5) + bytes([0x0B])  # [1.0, -2.5] -> codes 11, 0: levels 7/15 * 2.5, -2.5
    assert call(env["raw"], push_hdr(env, [e(0, 2, vd="q4")], version=v), [i32(5, 6), scale_and_codes])["type"] \
        == "push_ok"
    good.push({"b": (np.array([0], np.int32), np.array([0.0], np.float32))}, v)
    d = good.pull(v, wait_for=v + 1)
    assert d.version == v + 1
    after = snapshot(env)[1]["w"].reshape(-1)
    sent = np.array([np.float32(2.5) * np.float32(7 / 15), -2.5], np.float32)
    np.testing.assert_allclose(after[5:7], before[5:7] - np.float32(0.1) * sent / 2, rtol=1e-6)


def test_a_burst_of_queued_messages_is_answered_every_one(env):
    # the receive loop reads what is already queued in batches (server.DRAIN at a time): none
    # may be lost at a batch's edge, the multi-frame ones (refused here) included
    from stella_ps.server import DRAIN

    raw = env["raw"]
    reqs = [next(_req) for _ in range(3 * DRAIN + 7)]
    for r in reqs:
        frames = [b"x"] if r % 2 else []
        raw.send_multipart([msgspec.msgpack.encode({"proto": PROTOCOL_VERSION, "req": r, "type": "status"}),
                            *frames])
    got = [msgspec.msgpack.decode(raw.recv_multipart()[0]) for _ in reqs]
    assert sorted(g["req"] for g in got) == reqs
    assert {g["type"] for g in got if g["req"] % 2 == 0} == {"status"}
    assert env["srv"].alive()
