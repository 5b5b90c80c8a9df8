"""Hostile-input fuzzing of one live ``stella-ps`` while a correct worker trains.

Design (docs/security.md has the prose):

- One server (``--workers 1 --step-deadline 0.05 --max-message-bytes 1 MiB
  --dense-below 300``) with a three-tensor model (2000, 256 and 7 float32 values, plain
  SGD): laid out flat, the server's two tensors are w's 2000 coordinates and the dense
  part of e's and b's 263, what a push's entries name.
- Identities: ``observer`` (a :class:`stella.Client` that joined and registered and
  never pushes: it reads ``status`` and full snapshots for the checks), ``trainer``
  (a :class:`stella.Client` in a background thread: push a small sparse update, pull
  until the step closed, keep a local replica from the deltas), and two raw DEALER
  sockets of the fuzzer: ``reg`` joined and registered (so pushes and pulls reach
  their handlers, where most of the validation is) and ``anon``, which never joins.
  Neither the observer nor ``reg`` pushes in every step, so steps close on the step
  deadline (``reg`` also pushes valid updates now and then: a step with two pushes).
- Every fuzz message is sent with the trainer paused (a lock the trainer holds for a
  whole push + pull; the fuzzer lets it take a step every few messages). Around each
  message: version, ``pending_pushes``, ``optimizer``, live workers and the sha256 of
  a full snapshot (observer's ``pull(None)``). A rejected message must get an
  ``error`` whose code is a known :class:`~stella.errors.ErrorCode` other than
  ``internal`` (a server bug) and ``unavailable`` (client side only), and the five
  must be exactly equal afterwards. Where the client library's own decoder refuses the
  message, the server's code must be the same. A message that happens to be valid is
  accepted: its effect is undone where it can be (a join is left, a leave re-joined,
  an optimizer change set back) and then the same things are checked, except the
  model and version after an accepted push (whose step the deadline closes).
- The messages: valid messages of every request type with one (sometimes two)
  mutations: a field replaced by junk of any MessagePack type, out of range, wrapped
  in a list, deleted, or an unknown field added; frames dropped, duplicated, swapped,
  inserted, resized or overwritten; frame references moved; counts huge, zero, off by
  one; index frames of each coding (raw32, varint, u16chunk, rice, block16) corrupted
  at byte level or re-coded out of range, unsorted or duplicated; NaN/Inf values in
  f32, f16, bf16; random bytes as header with a random number of frames.
- Invariants after every message: the server process is alive and its VmRSS stays
  below its RSS after registration plus ``RSS_BOUND`` (64 MiB); at the end VmHWM
  obeys the same bound, the trainer made progress without an error, and its replica
  equals the server's model.

Two settings: the short one runs in the normal suite (``FUZZ_SHORT`` messages)::

    .venv/bin/python -m pytest -q tests/test_fuzz.py

and the long one (at least ``FUZZ_LONG`` = 10,000 messages, about 6 minutes) only with
``STELLA_FUZZ_LONG=1``; ``-s`` prints the summary (counts per code, peak RSS,
duration), ``STELLA_FUZZ_REPORT=PATH`` also writes it as JSON::

    STELLA_FUZZ_LONG=1 .venv/bin/python -m pytest -q -s -m slow tests/test_fuzz.py
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections import Counter
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from stella import Client, codec, protocol
from stella.client import curve_keys
from stella.errors import ErrorCode, StellaError
from stella.layout import FlatLayout
from stella_ps.process import ServerProcess
from stella_ps.service import MAX_WAIT_AHEAD

MAX_MSG = 1 << 20
STEP_DEADLINE_S = 0.05
RSS_BOUND = 64 << 20  # bytes over the server's VmRSS after registration
REPLY_TIMEOUT_S = 10.0
TRAIN_EVERY = 16  # the trainer takes a step at least every this many fuzz messages
FUZZ_SHORT = 300
FUZZ_LONG = 10_000
LONG = os.environ.get("STELLA_FUZZ_LONG") == "1"

LAYOUT = {"w": (40, 50), "e": (256,), "b": (7,)}
NAMES = list(LAYOUT)
DENSE_BELOW = 300  # stella-ps --dense-below: the server's tensors are w's 2000 coordinates and e's and b's 263
# the server's tensors, the parts of the flat model (stella.layout), what a push's entries name
NUMEL = [p.numel for p in FlatLayout.of([np.empty(s) for s in LAYOUT.values()], DENSE_BELOW).parts()]
SPECS = [{"name": n, "shape": list(s), "dtype": "float32"} for n, s in LAYOUT.items()]
OPTIMIZER = {"name": "sgd", "lr": 0.5}
CODINGS = ["raw32", "varint", "u16chunk", "rice", "block16"]
PULL_CODINGS = ["raw32", "varint", "u16chunk", "rice"]
VALUE_DTYPES = ["f32", "f16", "bf16", "q4", "q2"]
# codes a server may answer a hostile message with: everything but a bug and the client-only code
KNOWN_CODES = {c.value for c in ErrorCode} - {ErrorCode.INTERNAL.value, ErrorCode.UNAVAILABLE.value}

# ------------------------------------------------------------------ connections
# The one place that knows whether stella-ps runs with CurveZMQ (the default; in the
# suite, conftest's session key set in the environment); STELLA_FUZZ_SERVER=insecure
# runs the same against a plaintext server (--insecure).
SECURE = os.environ.get("STELLA_FUZZ_SERVER", "curve") != "insecure"


def start_server(factory, args: list[str], **kw: Any) -> ServerProcess:
    return factory(1, args, secure=SECURE, **kw)


def client_kwargs(srv: ServerProcess) -> dict[str, Any]:
    """Keys for stella.Client: the server's own when it made them, else (empty) the
    STELLA_SERVER_KEY / STELLA_CLIENT_KEY environment the client reads by itself."""
    return srv.client_kwargs() if SECURE else {}


def raw_socket(srv: ServerProcess) -> zmq.Socket:
    """A bare DEALER for hand-made messages, with an allowed key pair when secure."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    keys = curve_keys(**client_kwargs(srv)) if SECURE else None
    if keys is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys
    sock.connect(srv.endpoint)
    return sock


def rss(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v, _unit = line.split()
                out[k[:-1]] = int(v) * 1024
    return out


# ------------------------------------------------------------------ the harness
class Harness:
    """The server, its three well-behaved users, the trainer thread and the checks."""

    def __init__(self, srv: ServerProcess):
        self.srv = srv
        self.cond = threading.Condition()  # held by the trainer for a step, by the fuzzer for a message
        self.stop = threading.Event()
        self.trainer_steps = 0
        self.requested = 0
        self.trainer_error: BaseException | None = None
        self.sent = 0
        self.since_step = 0
        self.codes: Counter[str] = Counter()
        self.accepted: Counter[str] = Counter()
        self.mutations: Counter[str] = Counter()
        self.stale = 0
        self.failure: BaseException | None = None
        self._req = 10**9  # random headers pick small request ids; ours never collide with them
        self._baseline: dict[str, Any] | None = None
        self.init = {n: (np.arange(np.prod(s), dtype=np.float32) / 100).reshape(s) for n, s in LAYOUT.items()}

        kw = client_kwargs(srv)
        self.observer = Client(srv.endpoint, timeout=REPLY_TIMEOUT_S, name="observer", **kw)
        self.observer.register(self.init, OPTIMIZER)
        self.trainer = Client(srv.endpoint, timeout=REPLY_TIMEOUT_S, name="trainer", **kw)
        self.trainer.register(self.init, OPTIMIZER)
        self.replica = {n: v.copy() for n, v in self.init.items()}  # the trainer's copy, from its pulls
        self.socks = {"reg": raw_socket(srv), "anon": raw_socket(srv)}
        self.wid = self._call("reg", {"type": "join", "name": "fuzz"})["worker"]
        self._register_reg()
        self.rss0 = rss(srv.pid)["VmRSS"]
        self.peak_rss = self.rss0
        self.t0 = time.monotonic()
        self.version = self.observer.status().version
        self._thread = threading.Thread(target=self._train, name="trainer", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- plumbing
    def next_req(self) -> int:
        self._req += 1
        return self._req

    def _register_reg(self) -> None:
        reply = self._call("reg", {"type": "register", "worker": self.wid, "values": False, "optimizer": {},
                                   "tensors": SPECS, "dense_below": DENSE_BELOW})
        assert reply["type"] == "registered" and not reply["needs_values"], reply

    def _call(self, sock: str, hdr: dict) -> dict:
        """A well-formed request of ours and its reply (set-up and clean-up only)."""
        req = self.next_req()
        header = {"proto": protocol.PROTOCOL_VERSION, "req": req, **hdr}
        self.socks[sock].send_multipart([msgspec.msgpack.encode(header)])
        return self._recv(sock, req)[0]

    def _recv(self, sock: str, req: int, unreadable: bool = False) -> tuple[dict, list[bytes]]:
        """The reply to ``req``; ``unreadable``: the header is malformed, and the server may
        not have been able to read its ``req`` where this process could (msgspec's nesting
        limit follows the process's recursion limit), so its refusal may say 0."""
        s = self.socks[sock]
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not s.poll(int(left * 1000) + 1):
                raise AssertionError(f"no reply to req {req} within {REPLY_TIMEOUT_S} s; server alive: "
                                     f"{self.srv.alive()}\n{self.srv.logs()[-3000:]}")
            parts = s.recv_multipart()
            protocol.decode_reply(parts)  # every reply is itself a valid message
            hdr = msgspec.msgpack.decode(parts[0])
            if hdr["req"] == req or (unreadable and hdr["req"] == 0 and hdr["type"] == "error"):
                return hdr, parts
            self.stale += 1  # a reply to a pull that waited (answered once the trainer stepped)

    def state(self) -> dict[str, Any]:
        """What a rejected message must not change (the trainer is paused)."""
        s = self.observer.status()
        full = self.observer.pull(None)
        h = hashlib.sha256()
        for name in NAMES:
            h.update(name.encode() + b"\0" + full.tensors[name][1].tobytes())
        return {"version": s.version, "snapshot_version": full.version, "model": h.hexdigest(),
                "pending_pushes": s.pending_pushes, "optimizer": s.optimizer, "workers": s.workers}

    def check_memory(self) -> None:
        r = rss(self.srv.pid)["VmRSS"]
        self.peak_rss = max(self.peak_rss, r)
        assert r <= self.rss0 + RSS_BOUND, f"stella-ps VmRSS {r >> 20} MiB > {self.rss0 >> 20} + 64 MiB"

    # ---------------------------------------------------------------- trainer
    def _train(self) -> None:
        """One step (push, then pull until it closed) each time the fuzzer asks for one."""
        rng = np.random.default_rng(1)
        try:
            v = self.trainer.pull(None).version
            while True:
                with self.cond:
                    self.cond.wait_for(lambda: self.stop.is_set() or self.requested > self.trainer_steps,
                                       timeout=1.0)
                    if self.stop.is_set():
                        return
                    if self.requested <= self.trainer_steps:
                        continue
                    idx = np.sort(rng.choice(NUMEL[0], 16, replace=False)).astype(np.int32)
                    ok = self.trainer.push({"w": (idx, rng.standard_normal(16).astype(np.float32))}, v)
                    d = self.trainer.pull(v, wait_for=ok.step + 1)  # until the step of this push closed
                    assert d.version > ok.step, (d.version, ok.step)
                    d.apply_to(self.replica)
                    v = d.version
                    self.trainer_steps += 1
                    self.cond.notify_all()
        except BaseException as e:  # reported by the test
            with self.cond:
                self.trainer_error = e
                self.cond.notify_all()

    def let_trainer_step(self) -> None:
        with self.cond:
            self.requested = self.trainer_steps + 1
            self.cond.notify_all()
            ok = self.cond.wait_for(lambda: self.trainer_steps >= self.requested or self.trainer_error is not None,
                                    timeout=REPLY_TIMEOUT_S)
        assert self.trainer_error is None, repr(self.trainer_error)
        assert ok, "the trainer made no step"
        self.since_step = 0
        self._baseline = None

    # ---------------------------------------------------------------- one message
    def send(self, sock: str, frames: list[bytes], what: str) -> dict:
        """Send one fuzz message, check the reply and that a refusal changed nothing."""
        try:
            return self._send_checked(sock, frames, what)
        except BaseException as e:
            # the first failure is what counts: hypothesis replays the failing example against a
            # server whose state moved on, and may then report only that the replay differed
            if self.failure is None:
                self.failure = e
            raise

    def _send_checked(self, sock: str, frames: list[bytes], what: str) -> dict:
        if self.since_step >= TRAIN_EVERY:
            self.let_trainer_step()
        frames = self._no_future_wait(frames)
        predicted = predict(frames)
        req = max(protocol.request_id(frames[0]), 0)
        with self.cond:
            if self._baseline is None:
                self._baseline = self.state()
            before = self._baseline
            self.socks[sock].send_multipart(frames)
            desc = describe(sock, frames, what)
            # a header nested deeper than the server's decoder goes (its limit follows its recursion
            # limit, which hypothesis raises in this process) may be unreadable there alone
            nested = "nested" in what
            try:
                reply, _ = self._recv(sock, req, unreadable=predicted == ErrorCode.PROTOCOL.value or nested)
            except AssertionError as e:
                raise AssertionError(f"{desc}\n{e}") from None
            self.sent += 1
            self.since_step += 1
            if reply["type"] == "error":
                code = reply["code"]
                assert code in KNOWN_CODES, f"{desc}\n-> {reply}"
                if predicted is not None and not (nested and code == ErrorCode.PROTOCOL.value):
                    assert code == predicted, f"client decoder says {predicted}; {desc}\n-> {reply}"
                self.codes[code] += 1
                after = self.state()
                assert after == before, f"a refused message changed the server: {desc}\n-> {reply}\n" \
                                        f"{before}\n{after}"
            else:
                assert predicted is None, f"client decoder refuses ({predicted}) what the server took: {desc}"
                self.accepted[reply["type"]] += 1
                after = self._settle(sock, reply, before, desc)
            self._baseline = after
            self.version = after["version"]
            assert self.srv.alive(), self.srv.logs()[-3000:]
            self.check_memory()
        return reply

    def _no_future_wait(self, frames: list[bytes]) -> list[bytes]:
        """A valid pull waiting for a later version would be answered only after the
        trainer steps (while it is paused): it waits for at most the current version."""
        try:
            msg = protocol.decode_request(frames).msg
        except StellaError:
            return frames
        if isinstance(msg, protocol.Pull) and msg.wait_for is not None \
                and self.version < msg.wait_for <= self.version + MAX_WAIT_AHEAD:  # farther: refused
            return protocol.encode(msgspec.structs.replace(msg, wait_for=self.version))
        return frames

    def _settle(self, sock: str, reply: dict, before: dict, desc: str) -> dict:
        """Undo what an accepted message did; check the rest is as before."""
        kind = reply["type"]
        if kind == "joined" and not (sock == "reg" and reply["worker"] == self.wid):
            left = self._call(sock, {"type": "leave", "worker": reply["worker"]})
            assert left["type"] == "left", left
        elif kind == "left":
            assert sock == "reg" and reply["worker"] == self.wid, f"{desc}\n-> {reply}"
            joined = self._call("reg", {"type": "join", "worker": self.wid, "name": "fuzz"})
            assert joined["type"] == "joined" and joined["worker"] == self.wid, joined
            self._register_reg()
        elif kind == "push_ok":  # the step deadline closes the step with this push alone
            deadline = time.monotonic() + REPLY_TIMEOUT_S
            while (s := self.observer.status()).pending_pushes or s.version <= before["version"]:
                assert time.monotonic() < deadline, "an accepted push's step never closed"
                time.sleep(0.01)
        after = self.state()
        if after["optimizer"] != before["optimizer"]:  # set_optimizer or a push's hparams
            hp = {k: v for k, v in before["optimizer"].items() if k != "name"}
            assert self._call("reg", {"type": "set_optimizer", "worker": self.wid, "hparams": hp})["type"] \
                == "optimizer_set"
            after = self.state()
        same = ("optimizer", "workers", "pending_pushes") if kind == "push_ok" else tuple(before)
        for k in same:
            assert after[k] == before[k], f"{k} after an accepted {kind}: {desc}\n{before}\n{after}"
        return after

    def close(self) -> None:
        self.stop.set()
        self._thread.join(REPLY_TIMEOUT_S + 5)
        for s in self.socks.values():
            s.close(linger=0)
        self.trainer.close()
        self.observer.close()

    def summary(self) -> dict[str, Any]:
        r = rss(self.srv.pid)
        return {"messages": self.sent, "rejected": sum(self.codes.values()), "rejected_by_code": dict(self.codes),
                "accepted_by_type": dict(self.accepted), "mutations": dict(self.mutations),
                "stale_replies": self.stale, "trainer_steps": self.trainer_steps,
                "rss_after_register_mib": round(self.rss0 / 2**20, 1),
                "peak_rss_mib": round(max(self.peak_rss, r["VmRSS"]) / 2**20, 1),
                "vmhwm_mib": round(r["VmHWM"] / 2**20, 1), "duration_s": round(time.monotonic() - self.t0, 1)}


def predict(frames: list[bytes]) -> str | None:
    """The code the client library's decoder gives the message (None: it decodes)."""
    if len(frames) > protocol.MAX_FRAMES or sum(len(f) for f in frames) > MAX_MSG:
        return ErrorCode.OVERSIZED.value  # the server's bounds, before it decodes
    try:
        protocol.decode_request(frames)
    except StellaError as e:
        return e.code.value
    return None


def describe(sock: str, frames: list[bytes], what: str) -> str:
    try:
        hdr: Any = msgspec.msgpack.decode(frames[0])
        text = repr(hdr)
    except Exception:
        text = f"raw {frames[0][:64]!r}"
    return f"[{sock}] {what}: header {text[:600]}; frames {[len(f) for f in frames[1:]][:16]}"


# ------------------------------------------------------------------ messages
def _indices(rng: np.random.Generator, numel: int, coding: str) -> np.ndarray:
    if coding == "block16":
        blocks = (numel + 15) // 16
        chosen = np.sort(rng.choice(blocks, int(rng.integers(1, min(blocks, 4) + 1)), replace=False))
        idx = (chosen[:, None] * 16 + np.arange(16)).reshape(-1)
        return idx[idx < numel].astype(np.int32)
    k = int(rng.integers(1, min(numel, 64) + 1))
    return np.sort(rng.choice(numel, k, replace=False)).astype(np.int32)


def _values(rng: np.random.Generator, n: int, vd: str) -> bytes:
    return bytes(codec.encode_values((rng.standard_normal(n) * 1e-2).astype(np.float32), vd))


def build_push(rng: np.random.Generator, wid: int, version: int, coding: str | None = None) -> tuple[dict, list]:
    """A valid push: 1-3 tensors in random order, each its own coding and value dtype."""
    order = rng.permutation(len(NUMEL))[: int(rng.integers(1, len(NUMEL) + 1))] if coding is None else [0]
    entries: list[list] = []
    frames: list[bytes] = []
    for t in order:
        t = int(t)
        c = coding or str(rng.choice([*CODINGS, "dense"]))
        vd = str(rng.choice(VALUE_DTYPES))
        if c == "dense":
            entries.append([t, NUMEL[t], "dense", vd, None, len(frames)])
            frames.append(_values(rng, NUMEL[t], vd))
            continue
        if c == "block16" and NUMEL[t] < 16:
            c = "raw32"
        idx = _indices(rng, NUMEL[t], c)
        entries.append([t, int(idx.size), c, vd, len(frames), len(frames) + 1])
        frames.append(bytes(codec.encode_indices(idx, NUMEL[t], c)))
        frames.append(_values(rng, idx.size, vd))
    hdr = {"type": "push", "worker": wid, "version": version, "tensors": entries}
    if rng.random() < 0.2:
        hdr["hparams"] = {"lr": OPTIMIZER["lr"]}
    return hdr, frames


def build_other(rng: np.random.Generator, wid: int, version: int) -> tuple[dict, list]:
    # what is drawn from rng must not depend on the version (hypothesis replays draws)
    kind = str(rng.choice(["pull", "pull", "status", "set_optimizer", "register", "join", "leave", "fetch",
                           "upload"]))
    if kind == "pull":
        hdr: dict = {"type": "pull", "worker": wid, "since": int(rng.random() * (version + 2)) - 1,
                     "coding": str(rng.choice(PULL_CODINGS))}
        if rng.random() < 0.5:
            hdr["wait_for"] = int(rng.random() * (version + 1))
            hdr["timeout_ms"] = int(rng.integers(0, 1000))
        return hdr, []
    if kind == "status":
        return {"type": "status"}, []
    if kind == "set_optimizer":
        return {"type": "set_optimizer", "worker": wid, "hparams": {"lr": OPTIMIZER["lr"]}}, []
    if kind == "register":
        values = rng.random() < 0.3
        frames = [np.zeros(n, "<f4").tobytes() for n in NUMEL] if values else []
        specs = [{**t, "shape": list(t["shape"])} for t in SPECS]  # mutate() edits in place
        return {"type": "register", "worker": wid, "values": values, "optimizer": {}, "tensors": specs,
                "dense_below": DENSE_BELOW}, frames
    if kind == "join":
        return {"type": "join", "worker": wid, "name": "fuzz"}, []
    if kind == "fetch":  # of a transfer never made (a chunked answer's): refused, `transfer`
        return {"type": "fetch", "worker": wid, "transfer": int(rng.integers(1, 2**62)),
                "offset": int(rng.integers(0, 1 << 20)), "length": int(rng.integers(1, 1 << 20))}, []
    if kind == "upload":  # a piece of a push's payload: held for a push naming it, which never comes
        n = int(rng.integers(1, 4096))
        return {"type": "upload", "worker": wid, "transfer": int(rng.integers(1, 2**62)), "offset": 0,
                "sizes": [n, int(rng.integers(0, 1 << 20))]}, [bytes(n)]
    return {"type": "leave", "worker": wid}, []


JUNK = st.one_of(
    st.none(), st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([-1, 0, 1, 2, 7, 2**31 - 1, 2**31, 2**32, 2**62, 2**62 + 1, 2**63 - 1, 2**64 - 1, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.binary(max_size=12),
    st.sampled_from(["raw32", "varint", "u16chunk", "rice", "block16", "dense", "f32", "f16", "bf16", "push",
                     "pull", "float64", "sgd", "", "x" * 2000]),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(-3, 3), max_size=2),
)


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    out = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        out.append((*prefix, k))
        out.extend(_paths(v, (*prefix, k)))
    return out


def _at(obj: Any, path: tuple) -> Any:
    for k in path:
        obj = obj[k]
    return obj


def _parent(obj: Any, path: tuple) -> Any:
    for k in path[:-1]:
        obj = obj[k]
    return obj


NAN_BITS = {"f32": [b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\x00\x00\x80\xff", b"\x01\x00\x80\x7f"],
            "f16": [b"\x00\x7e", b"\x00\x7c", b"\x00\xfc", b"\x01\x7c"],
            "bf16": [b"\xc0\x7f", b"\x80\x7f", b"\x80\xff", b"\x81\x7f"]}
# q4/q2: a chunk's float32 scale NaN, Inf, negative or -0.0
NAN_BITS["q4"] = NAN_BITS["q2"] = [*NAN_BITS["f32"], b"\x00\x00\x80\xbf", b"\x00\x00\x00\x80"]


def mutate(data: st.DataObject, rng: np.random.Generator, hdr: dict, frames: list[bytes]) -> tuple[dict, list, str]:
    """One mutation of a valid message (header as a dict, payload frames as bytes)."""
    frames = list(frames)
    entries = hdr.get("tensors") if hdr.get("type") == "push" else None
    kinds = ["set_field", "set_field", "delete_field", "add_field", "wrap_in_list", "frames", "frames", "proto",
             "type", "nested", "bad_utf8"]
    if entries:
        kinds += ["count", "count", "frame_ref", "frame_ref", "nan_value", "index_bytes", "index_bytes",
                  "index_recode", "value_size", "tensor_id"]
    kind = data.draw(st.sampled_from(kinds), label="mutation")
    paths = _paths(hdr)
    if kind == "set_field":
        path = data.draw(st.sampled_from(paths))
        _parent(hdr, path)[path[-1]] = data.draw(JUNK)
    elif kind == "delete_field":
        path = data.draw(st.sampled_from(paths))
        del _parent(hdr, path)[path[-1]]
    elif kind == "add_field":
        dicts = [hdr] + [_at(hdr, p) for p in paths if isinstance(_at(hdr, p), dict)]
        target = dicts[data.draw(st.integers(0, len(dicts) - 1))]
        target[data.draw(st.text(min_size=1, max_size=8))] = data.draw(JUNK)
    elif kind == "wrap_in_list":
        path = data.draw(st.sampled_from(paths))
        p = _parent(hdr, path)
        p[path[-1]] = [p[path[-1]]]
    elif kind == "nested":  # a value nested deeper than any decoder goes: maps or arrays
        path = data.draw(st.sampled_from(paths))
        depth = data.draw(st.sampled_from([100, 1000, 30_000]))
        opener = data.draw(st.sampled_from([b"\x81\xa1a", b"\x91"]))
        _parent(hdr, path)[path[-1]] = msgspec.Raw(opener * depth + b"\xc0")
    elif kind == "bad_utf8":  # a string value (the type's too) whose bytes are not UTF-8
        strings = [p for p in paths if isinstance(_at(hdr, p), str)] or [("type",)]
        path = data.draw(st.sampled_from(strings))
        n = max(1, len(str(_at(hdr, path))))
        bad = data.draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xfd"]))
        raw = (bad * n)[:31]
        _parent(hdr, path)[path[-1]] = msgspec.Raw(bytes([0xA0 | len(raw)]) + raw)
    elif kind == "proto":
        V = protocol.PROTOCOL_VERSION
        hdr["proto"] = data.draw(st.one_of(st.sampled_from([V - 1, V + 1, float(V), True, str(V), None, [V]]), JUNK))
    elif kind == "type":
        hdr["type"] = data.draw(st.one_of(st.sampled_from(["joined", "delta", "error", "Push", "push ", ""]), JUNK))
    elif kind == "frames":
        op = data.draw(st.sampled_from(["drop", "dup", "swap", "insert", "truncate", "extend", "random", "many",
                                        "none", "huge"]), label="frame op")
        n = len(frames)
        if op == "drop" and n:
            del frames[int(rng.integers(n))]
        elif op == "dup" and n:
            i = int(rng.integers(n))
            frames.insert(i, frames[i])
        elif op == "swap" and n >= 2:
            i, j = rng.choice(n, 2, replace=False)
            frames[i], frames[j] = frames[j], frames[i]
        elif op == "insert":
            frames.insert(int(rng.integers(n + 1)), data.draw(st.binary(max_size=64)))
        elif op == "truncate" and n:
            i = int(rng.integers(n))
            frames[i] = frames[i][: int(rng.integers(len(frames[i]) + 1))]
        elif op == "extend" and n:
            i = int(rng.integers(n))
            frames[i] = frames[i] + rng.bytes(int(rng.integers(1, 9)))
        elif op == "random" and n:
            frames[int(rng.integers(n))] = rng.bytes(int(rng.integers(0, 300)))
        elif op == "many":
            frames += [b""] * data.draw(st.integers(1, 300))
        elif op == "none":
            frames = []
        else:  # frames adding up to more than the server's message limit, none above it (a frame
            # above the limit costs the peer its connection, by design: libzmq's MAXMSGSIZE)
            big = data.draw(st.sampled_from([MAX_MSG, MAX_MSG // 2 + 1]))
            frames += [bytes(big)] * (1 if big == MAX_MSG else 2)
    elif kind == "count":
        e = entries[data.draw(st.integers(0, len(entries) - 1))]
        e[1] = data.draw(st.sampled_from([0, e[1] - 1, e[1] + 1, 2 * e[1], NUMEL[e[0]] + 1, 2**31 - 1, 2**31,
                                          MAX_MSG, -1]))
    elif kind == "frame_ref":
        e = entries[data.draw(st.integers(0, len(entries) - 1))]
        slot = data.draw(st.sampled_from([4, 5]))
        e[slot] = data.draw(st.sampled_from([None, 0, 1, 2, (e[slot] or 0) + 1, (e[slot] or 0) - 1, e[9 - slot],
                                             protocol.MAX_FRAMES, protocol.MAX_FRAMES - 1]))
    elif kind == "nan_value":
        e = entries[data.draw(st.integers(0, len(entries) - 1))]
        f = bytearray(frames[e[5]])
        if e[3] in codec.QUANT_DTYPES:  # a scale: the frame starts with one per chunk
            item, pos = 4, 4 * int(rng.integers(max(-(-e[1] // codec.QCHUNK), 1)))
        else:
            item = 4 if e[3] == "f32" else 2
            pos = int(rng.integers(max(e[1], 1))) * item
        f[pos:pos + item] = data.draw(st.sampled_from(NAN_BITS[e[3]]))
        frames[e[5]] = bytes(f[: len(frames[e[5]])])
    elif kind == "value_size":
        e = entries[data.draw(st.integers(0, len(entries) - 1))]
        f = frames[e[5]]
        frames[e[5]] = data.draw(st.sampled_from([f[:-1], f + b"\0", f[:-2], f + b"\0\0", f + f, b""]))
    elif kind == "tensor_id":
        e = entries[data.draw(st.integers(0, len(entries) - 1))]
        e[0] = data.draw(st.sampled_from([3, 4, 2**31 - 1, -1, (e[0] + 1) % 3]))
    else:  # the index frame of a sparse entry
        sparse = [e for e in entries if e[4] is not None]
        if not sparse:
            return hdr, frames, "no sparse entry"
        e = sparse[data.draw(st.integers(0, len(sparse) - 1))]
        t, fi, orig = e[0], e[4], e[2]
        f = bytearray(frames[fi])
        if kind == "index_bytes":
            op = data.draw(st.sampled_from(["flip", "byte", "truncate", "extend", "zero", "ones", "random"]))
            if op == "flip" and f:
                for _ in range(int(rng.integers(1, 4))):
                    f[int(rng.integers(len(f)))] ^= 1 << int(rng.integers(8))
            elif op == "byte" and f:
                f[int(rng.integers(len(f)))] = data.draw(st.integers(0, 255))
            elif op == "truncate":
                f = f[: int(rng.integers(len(f) + 1))]
            elif op == "extend":
                f += rng.bytes(int(rng.integers(1, 9)))
            elif op == "zero":
                f = bytearray(len(f))
            elif op == "ones":
                f = bytearray(b"\xff" * len(f))
            else:
                f = bytearray(rng.bytes(len(f)))
            frames[fi] = bytes(f)
            kind = f"index_bytes/{e[2]}/{op}"
        else:  # well-formed coding of a bad index set
            numel, item = NUMEL[t], (4 if e[3] == "f32" else 2)
            op = data.draw(st.sampled_from(["out_of_range", "unsorted", "duplicate", "negative"]))
            idx = np.array(codec.decode_indices(frames[fi], e[1], numel, e[2]), dtype=np.int64)
            if op == "out_of_range" and e[2] != "raw32":  # coded for a bigger tensor: past this one's end
                big = numel * 4 + 64
                start = (numel + 15) // 16 * 16
                extra = np.arange(start, start + 16) if e[2] == "block16" else np.arange(numel, numel + 3)
                idx = extra if e[2] == "block16" else np.union1d(idx, extra)
                frames[fi] = bytes(codec.encode_indices(idx.astype(np.int32), big, e[2]))
            else:  # raw32 carries any int32s: unsorted, duplicated, negative, past the end
                if idx.size < 2:
                    idx = np.array([0, 1])
                if op == "out_of_range":
                    idx[-1] = numel + int(rng.integers(0, 3))
                elif op == "unsorted":
                    idx[[0, -1]] = idx[[-1, 0]]
                elif op == "duplicate":
                    idx[1] = idx[0]
                else:
                    idx[0] = -1 - int(rng.integers(0, 3))
                e[2] = "raw32"
                frames[fi] = idx.astype("<i4").tobytes()
            e[1] = int(idx.size)
            frames[e[5]] = bytes(idx.size * item)
            kind = f"index_recode/{orig}/{op}"
    return hdr, frames, kind


def _encode(hdr: dict, frames: list, req: int | None) -> list[bytes]:
    hdr = {"proto": protocol.PROTOCOL_VERSION, **hdr} if "proto" not in hdr else hdr
    if req is not None and "req" not in hdr:
        hdr = {**hdr, "req": req}
    return [msgspec.msgpack.encode(hdr), *frames]


# ------------------------------------------------------------------ the state machine
class FuzzMachine(RuleBasedStateMachine):
    """Each rule sends one message (the harness checks it); the server and the
    harness live across runs (class attribute ``h``)."""

    h: Harness

    def _rng(self, data: st.DataObject) -> np.random.Generator:
        return np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))

    def _mutated(self, data: st.DataObject, hdr: dict, frames: list, sock: str, stack: bool = True) -> None:
        rng = self._rng(data)
        self.h.mutations[f"base:{sock}:{hdr['type']}"] += 1
        hdr, frames, kind = mutate(data, rng, hdr, frames)
        if stack and data.draw(st.integers(0, 4)) == 0:  # now and then a second mutation
            try:
                hdr, frames, kind2 = mutate(data, rng, hdr, frames)
                kind = f"{kind}+{kind2}"
            except (IndexError, KeyError, TypeError, ValueError, AttributeError, StellaError):
                pass  # the first one broke what the second one needed: send the first alone
        for k in kind.split("+"):
            self.h.mutations[k.split("/")[0]] += 1
        req = None if data.draw(st.integers(0, 19)) == 0 else self.h.next_req()  # sometimes no req at all
        try:
            msg = _encode(hdr, frames, req)
        except (OverflowError, TypeError):  # not representable in MessagePack: nothing to send
            return
        self.h.send(sock, msg, kind)

    @rule(data=st.data())
    def mutated_push(self, data: st.DataObject) -> None:
        hdr, frames = build_push(self._rng(data), self.h.wid, self.h.version)
        self._mutated(data, hdr, frames, "reg")

    @rule(data=st.data(), coding=st.sampled_from(CODINGS))
    def corrupt_index_stream(self, data: st.DataObject, coding: str) -> None:
        rng = self._rng(data)
        hdr, frames = build_push(rng, self.h.wid, self.h.version, coding=coding)
        hdr, frames, kind = mutate_index(data, rng, hdr, frames)
        self.h.mutations["/".join(kind.split("/")[:2])] += 1  # index_bytes/<coding>
        self.h.send("reg", _encode(hdr, frames, self.h.next_req()), kind)

    @rule(data=st.data(), sock=st.sampled_from(["reg", "reg", "anon"]))
    def mutated_other(self, data: st.DataObject, sock: str) -> None:
        hdr, frames = build_other(self._rng(data), self.h.wid, self.h.version)
        self._mutated(data, hdr, frames, sock)

    @rule(data=st.data(), sock=st.sampled_from(["reg", "anon"]))
    def random_message(self, data: st.DataObject, sock: str) -> None:
        header = data.draw(st.one_of(
            st.binary(max_size=64),
            JUNK.map(msgspec.msgpack.encode),
            st.dictionaries(st.sampled_from(["type", "proto", "req", "worker", "version", "tensors", "since", "x"]),
                            JUNK, max_size=6).map(msgspec.msgpack.encode),
        ), label="header")
        frames = data.draw(st.lists(st.binary(max_size=32), max_size=8), label="frames")
        self.h.mutations["random"] += 1
        self.h.send(sock, [header, *frames], "random")

    @rule(data=st.data())
    def valid_push(self, data: st.DataObject) -> None:
        """An accepted push of the fuzzer's worker (one call in four; each waits for its step)."""
        if data.draw(st.integers(0, 3), label="skip"):
            return
        hdr, frames = build_push(self._rng(data), self.h.wid, self.h.version)
        hdr.pop("hparams", None)
        reply = self.h.send("reg", _encode(hdr, frames, self.h.next_req()), "valid push")
        assert reply["type"] == "push_ok", reply

    @rule()
    def trainer_step(self) -> None:
        self.h.let_trainer_step()

    @invariant()
    def server_alive(self) -> None:
        assert self.h.srv.alive(), self.h.srv.logs()[-3000:]
        assert self.h.trainer_error is None, repr(self.h.trainer_error)


def mutate_index(data: st.DataObject, rng: np.random.Generator, hdr: dict, frames: list) -> tuple[dict, list, str]:
    """An index-frame corruption of the push's one sparse entry."""
    for _ in range(20):
        h2 = json.loads(json.dumps(hdr))
        h2, f2, kind = mutate(_Forced(data, ["index_bytes", "index_recode"]), rng, h2, list(frames))
        if kind.startswith("index"):
            return h2, f2, kind
    return hdr, frames, "unmutated"


class _Forced:
    """A ``data`` whose first draw (the mutation kind) is limited to ``kinds``."""

    def __init__(self, data: st.DataObject, kinds: list[str]):
        self.data, self.kinds, self.first = data, kinds, True

    def draw(self, strategy: Any, label: Any = None) -> Any:
        if self.first:
            self.first = False
            return self.data.draw(st.sampled_from(self.kinds), label="index mutation")
        return self.data.draw(strategy, label=label)


# ------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def harness(module_server_factory):
    srv = start_server(module_server_factory,
                       ["--max-message-bytes", str(MAX_MSG), "--step-deadline", str(STEP_DEADLINE_S),
                        "--oversized-ban-s", "0", "--dense-below", str(DENSE_BELOW)],  # the fuzzer's key goes on
                       # after oversized messages
                       log_level="WARNING")
    h = Harness(srv)
    yield h
    h.close()
    assert srv.alive(), srv.logs()[-3000:]


def run_fuzz(h: Harness, messages: int, time_limit_s: float) -> dict[str, Any]:
    FuzzMachine.h = h
    cfg = settings(max_examples=max(messages // 20, 1), stateful_step_count=40, deadline=None, database=None,
                   phases=[Phase.generate], suppress_health_check=list(HealthCheck), print_blob=False)
    start, deadline = h.sent, time.monotonic() + time_limit_s
    while h.sent - start < messages and time.monotonic() < deadline:
        try:
            run_state_machine_as_test(FuzzMachine, settings=cfg)
        except Exception:
            if h.failure is not None:
                raise h.failure from None
            raise
    h.let_trainer_step()
    final = h.state()
    assert h.trainer_error is None, repr(h.trainer_error)
    with h.cond:  # the trainer's replica, built from deltas, is the server's model
        h.stop.set()
    h._thread.join(REPLY_TIMEOUT_S + 5)
    full = h.observer.pull(None)
    for name in NAMES:
        assert full.tensors[name][1].tobytes() == h.replica[name].reshape(-1).tobytes(), name
    out = h.summary()
    out["final_version"] = final["version"]
    assert out["rejected"] > 0.5 * out["messages"], out  # the fuzzer mostly sends bad messages
    assert out["trainer_steps"] > 0
    r = rss(h.srv.pid)
    assert r["VmHWM"] <= h.rss0 + RSS_BOUND, out
    print("\nfuzz summary:", json.dumps(out, indent=1))
    if os.environ.get("STELLA_FUZZ_REPORT"):
        with open(os.environ["STELLA_FUZZ_REPORT"], "w") as f:
            json.dump(out, f, indent=2)
    assert h.sent - start >= messages, f"only {h.sent - start} messages in {time_limit_s} s"
    return out


@pytest.mark.skipif(LONG, reason="STELLA_FUZZ_LONG=1 runs the long setting instead")
@pytest.mark.timeout(240)
def test_fuzz_short(harness):
    run_fuzz(harness, FUZZ_SHORT, time_limit_s=150)  # ~15 s; the limit only bounds a hang


@pytest.mark.slow
@pytest.mark.skipif(not LONG, reason="the long fuzz run needs STELLA_FUZZ_LONG=1")
@pytest.mark.timeout(1800)
def test_fuzz_long(harness):
    run_fuzz(harness, FUZZ_LONG, time_limit_s=1500)
