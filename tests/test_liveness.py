"""Machines come and go (issue 11): liveness, the adaptive deadline, stray joins, rejoin
and reconnect, against real stella-ps processes, real worker processes and real
sockets. Liveness timeouts are short (1-2 s) so that the module stays quick.
Checkpoints are tests/test_checkpoints.py's; the step rules, pure, tests/test_steps.py's."""
from __future__ import annotations

import functools
import signal
import subprocess
import sys
import time

import msgspec
import numpy as np
import pytest
import torch
from live import LIVENESS_S, ROOT, TARGET_ACCURACY, live_worker, log_lines, reap, version_of, wait_until

from stella import Client
from stella.protocol import Join, encode
from stella_ps.process import free_port


# --------------------------------------------------------------------------- kill -9 of a worker
@pytest.mark.slow
def test_a_killed_worker_is_declared_gone_the_job_goes_on_and_a_replacement_rejoins(make_server, make_client,
                                                                                      tmp_path):
    srv = make_server(3, ["--liveness-timeout", str(LIVENESS_S)])
    mon = make_client(srv.endpoint, join=False)
    target = 400
    logs = [tmp_path / f"w{r}.jsonl" for r in range(3)]
    # 50 ms of extra "compute" per step: the survivors must not finish before the replacement (a new
    # process importing torch on a loaded machine) is back
    procs = [live_worker(srv.endpoint, r, 3, target, logs[r], "--step-sleep", "0.05") for r in range(3)]
    try:
        wait_until(lambda: version_of(mon) >= 50, 120, "50 steps with three workers")
        victim = next(x for x in log_lines(logs[2]) if x.get("joined"))["worker"]
        procs[2].kill()  # SIGKILL: no leave, no flush, heartbeats stop
        procs[2].wait()
        v_kill = version_of(mon)
        # the next steps close without it (once the liveness timeout declares it gone, or sooner by the
        # adaptive deadline); the 30 s only bound a hang
        wait_until(lambda: version_of(mon) >= v_kill + 3, 30, "steps after the kill")
        wait_until(lambda: victim in {int(k) for k in mon.status().gone_workers}, 30, "the killed worker shown gone")
        st = mon.status()
        assert victim not in st.workers and len(st.workers) == 2
        # a replacement asks for the dead worker's id: it is free once the old connection is gone
        procs[2] = live_worker(srv.endpoint, 2, 3, target, logs[2], "--worker-id", str(victim), "--step-sleep", "0.05")
        wait_until(lambda: victim in mon.status().workers, 60, "the replacement live under the old id")

        # a replica that joins now equals the server's model after its pulls, coordinate for coordinate
        from stella.demo import demo_model

        model = demo_model(64, 0)
        rep = make_client(srv.endpoint)
        rep.register(dict(model.named_parameters()))
        snap = rep.pull(None)
        replica = {n: v.copy() for n, (_, v) in snap.tensors.items()}
        version, equal_at = snap.version, None
        for _ in range(200):
            d = rep.pull(version)
            d.apply_to(replica)  # the broadcast's messages add; a full answer installs
            version = d.version
            full = rep.pull(None)
            if full.version == version:
                for n, (_, vals) in full.tensors.items():
                    assert np.array_equal(replica[n], vals), n
                equal_at = version
                break
        assert equal_at is not None, "never caught the server between two steps"
        rep.close()  # it pushes nothing: it must not hold steps back any longer

        codes = reap(procs, 180)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0, 0]
    done = [next(x for x in log_lines(log) if x.get("done")) for log in logs]
    assert all(d["version"] >= target for d in done)
    assert min(d["accuracy"] for d in done) >= TARGET_ACCURACY, done
    assert done[2]["worker"] == victim


# --------------------------------------------------------------------------- a stray join
@pytest.mark.parametrize("stray", ["raw_join", "client_never_registers"])
def test_a_join_without_registration_stops_nobody_beyond_the_timeout(make_server, make_client, raw_dealer, stray):
    # --workers 1: a stray join neither holds a step back nor counts towards starting the job
    srv = make_server(1, ["--liveness-timeout", "1"])
    if stray == "raw_join":
        sock = raw_dealer(srv.endpoint)
        sock.send_multipart(encode(Join(req=1, name="stray")))
        stray_id = int(msgspec.msgpack.decode(sock.recv_multipart()[0])["worker"])
    else:
        stray_id = make_client(srv.endpoint, name="idle").worker_id  # heartbeats, but never registers
    a = make_client(srv.endpoint)
    a.register({"w": np.zeros(16, np.float32)}, {"name": "sgd", "lr": 1.0})
    v = 0
    for _ in range(10):
        a.push({"w": np.ones(16, np.float32)}, v)
        v = a.pull(v, wait_for=v + 1).version
    assert v == 10
    # no step waited for the stray: one that did would have been closed by its deadline, which logs
    assert "step deadline passed" not in srv.logs()
    wait_until(lambda: stray_id in a.status().gone_workers, 30, "the stray declared gone")
    st = a.status()
    assert stray_id in {int(k) for k in st.gone_workers} and st.workers == [a.worker_id]


# --------------------------------------------------------------------------- SIGSTOP / SIGCONT
_STOPPABLE = r"""
import sys, time, numpy as np
from stella import Client
c = Client(sys.argv[1], timeout=20, name="stoppable")
c.register({"w": np.zeros(4, np.float32)}, {"name": "sgd", "lr": 1.0})
v = 0
for _ in range(8):                       # steps with the other worker: the deadline learns
    c.push({"w": (np.array([2], np.int32), np.ones(1, np.float32))}, v)
    v = c.pull(v, wait_for=v + 1).version
print("ready", v, flush=True)
time.sleep(0.5)                           # "computing": SIGSTOP lands here
c.push({"w": (np.array([1], np.int32), np.full(1, 8.0, np.float32))}, v)   # the marker, computed on v
print("pushed", flush=True)
c.pull(None)
c.close()
"""


def test_a_stopped_worker_is_waited_for_only_the_adaptive_deadline_and_its_late_push_is_folded(
        make_server, make_client):
    srv = make_server(2, ["--liveness-timeout", "6", "--deadline-min", "0.2", "--deadline-max", "30"])
    a = make_client(srv.endpoint)
    a.register({"w": np.zeros(4, np.float32)}, {"name": "sgd", "lr": 1.0})
    b = subprocess.Popen([sys.executable, "-c", _STOPPABLE, srv.endpoint], cwd=ROOT, stdout=subprocess.PIPE,
                         text=True)
    try:
        v = 0
        for _ in range(8):
            a.push({"w": (np.array([0], np.int32), np.ones(1, np.float32))}, v)
            v = a.pull(v, wait_for=v + 1).version
        assert b.stdout is not None
        assert b.stdout.readline().startswith("ready")
        b.send_signal(signal.SIGSTOP)
        before = a.status()
        assert before.step_deadline_s is not None and before.step_deadline_s < 30  # learnt, not the 30 s
        deadline = before.step_deadline_s
        (stopped,) = [w for w in before.workers if w != a.worker_id]
        t0 = time.monotonic()
        waited = []
        while not a.status().behind_workers:  # the other worker goes on
            assert time.monotonic() - t0 < 60, "the stopped worker was never counted behind"
            ts = time.monotonic()
            a.push({"w": (np.array([0], np.int32), np.ones(1, np.float32))}, v)
            v = a.pull(v, wait_for=v + 1, timeout=30).version
            waited.append(time.monotonic() - ts)
        # each step waited the deadline while the stopped worker was not yet silent (its last heartbeat
        # less than 1.5 intervals of 0.375 s ago); it was marked behind by a deadline that found it silent,
        # or, the moment it fell silent, by the watch a deadline set on it (the step then closed at once)
        assert waited and min(waited[:-1] or [deadline]) >= 0.8 * deadline, (waited, deadline)
        logs = srv.logs().splitlines()
        marked = [line for line in logs if '"step deadline passed"' in line]
        fell = [line for line in logs if "fell silent" in line]
        assert f'"silent_workers": [{stopped}]' in (fell or marked)[-1], (marked[-1], fell)
        for _ in range(5):  # behind: the steps do not wait for it any more (a step that did would end
            # by its deadline, and log it)
            a.push({"w": (np.array([0], np.int32), np.ones(1, np.float32))}, v)
            v = a.pull(v, wait_for=v + 1, timeout=30).version
        assert srv.logs().count('"step deadline passed"') == len(marked)
        mid = a.status()
        assert mid.behind_workers == [stopped], mid
        from stella.status import rates, render

        assert "(behind)" in render(mid, rates(mid, None, None))
        b.send_signal(signal.SIGCONT)
        assert b.stdout.readline().startswith("pushed")
        a.push({"w": (np.array([0], np.int32), np.ones(1, np.float32))}, v)  # the step the late push joins
        v = a.pull(v, wait_for=v + 1).version
        assert b.wait(30) == 0
        st = a.status()
        assert st.late_pushes >= 1 and st.behind_workers == []  # it pushed: waited for again
        final = a.pull(None).tensors["w"][1]
        # conserved: the marker's mass 8 reached the model, scaled by the mean over its step's 1 or 2
        # contributors (lr 1): -8 or -4, never 0 (dropped)
        assert final[1] in (np.float32(-8.0), np.float32(-4.0)), final
    finally:
        if b.poll() is None:
            b.send_signal(signal.SIGCONT)
            b.kill()
            b.wait()


def test_a_slow_worker_still_heard_from_is_waited_for_every_step(make_server, make_client):
    """A worker that computes long but heartbeats is slow, not behind: every step waits
    for it up to the deadline (a synchronous job), and none runs on without it."""
    srv = make_server(2, ["--liveness-timeout", "6", "--deadline-min", "0.3", "--deadline-max", "30"])
    a, b = make_client(srv.endpoint), make_client(srv.endpoint)  # b heartbeats from its own thread
    for c in (a, b):
        c.register({"w": np.zeros(4, np.float32)}, {"name": "sgd", "lr": 1.0})
    v = 0
    for _ in range(8):
        for c in (a, b):
            c.push({"w": (np.array([0], np.int32), np.ones(1, np.float32))}, v)
        v = a.pull(v, wait_for=v + 1).version
        b.pull(v - 1, wait_for=v)
    deadline = a.status().step_deadline_s
    assert deadline is not None and deadline < 30  # learnt, not the --deadline-max
    # a pull answers with what it has once its timeout passes: give it room past a deadline learnt
    # under load, and check each step closed (a step left open would make the next pull answer early)
    wait = 2 * deadline + 5
    t0 = time.monotonic()
    for _ in range(4):  # b "computes" for ~4 heartbeat intervals: every step waits the deadline for it
        a.push({"w": (np.array([0], np.int32), np.ones(1, np.float32))}, v)
        v, was = a.pull(v, wait_for=v + 1, timeout=wait).version, v
        assert v == was + 1
        time.sleep(1.0)
        assert a.status().behind_workers == []
    took = time.monotonic() - t0 - 4.0
    assert took >= 4 * 0.8 * deadline, (took, deadline)
    b.push({"w": (np.array([1], np.int32), np.ones(1, np.float32))}, 8)  # its late push, folded
    a.push({"w": (np.array([0], np.int32), np.ones(1, np.float32))}, v)
    v, was = a.pull(v, wait_for=v + 1, timeout=wait).version, v
    assert v == was + 1
    assert a.status().late_pushes >= 1


# --------------------------------------------------------------------------- the server's heartbeat
def _established_from(port: int) -> int:
    """TCP connections in state ESTABLISHED whose local port is ``port`` (IPv4)."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.read().splitlines()[1:]]
    return sum(int(r[1].split(":")[1], 16) == port and r[3] == "01" for r in rows)


_PAUSABLE = r"""
import sys, numpy as np
from stella import Client
c = Client(sys.argv[1], timeout=10, name="pausable")
c.register({"w": np.zeros(4, np.float32)}, {"name": "sgd", "lr": 1.0})
print("ready", flush=True)
sys.stdin.readline()                      # SIGSTOP lands here
c.push({"w": np.ones(4, np.float32)}, 0)
print("pushed", c.pull(0, wait_for=1).version, c.reconnects, flush=True)
c.close()
"""


def test_the_server_heartbeat_drops_the_connection_of_a_peer_that_stopped_answering(make_server):
    """The server PINGs its peers in the transport: the connections of a process that
    no longer answers (stopped here; a vanished host in life) are closed after twice
    the liveness timeout, and the process, once back, reconnects by itself."""
    port = free_port()
    srv = make_server(1, ["--liveness-timeout", "1"], bind=f"tcp://127.0.0.1:{port}")
    p = subprocess.Popen([sys.executable, "-c", _PAUSABLE, srv.endpoint], cwd=ROOT, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdin is not None
        assert p.stdout.readline().startswith("ready")
        assert _established_from(port) >= 2  # its request socket and its heartbeat socket
        p.send_signal(signal.SIGSTOP)
        took = wait_until(lambda: _established_from(port) == 0, 30, "the server drops the stopped peer",
                           every=0.1)
        assert took >= 1.0  # not before the worker could be declared gone
        p.send_signal(signal.SIGCONT)
        p.stdin.write("go\n")
        p.stdin.flush()
        out = p.stdout.readline().split()
        assert out[:2] == ["pushed", "1"] and int(out[2]) >= 1, out  # back, through a reconnect
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()


# --------------------------------------------------------------------------- a long stall
def test_a_long_stall_holds_the_optimizer_back_and_never_overflows_the_push_queue(make_server):
    """A worker whose steps cannot close (the job waits for its second worker) waits:
    its pulls expire every 0.45 s, but it does not push again into a queue the server
    bounds at 2 (which used to end it with a PipelineError)."""
    import threading

    from stella import Compression, Connection, StellaOptimizer, Sync

    srv = make_server(2, ["--max-queued-pushes", "2", "--liveness-timeout", "30"])
    errors: list[BaseException] = []
    opts: list[StellaOptimizer] = []

    def train(seed: int, steps: int) -> None:
        try:
            torch.manual_seed(seed)
            model = torch.nn.Linear(8, 2)
            opt = StellaOptimizer(model, srv.endpoint, optimizer={"name": "sgd", "lr": 0.1},
                                  compression=Compression(method="dense"), sync=Sync(max_every=1),
                                  connection=Connection(timeout=0.5))
            opts.append(opt)
            x = torch.randn(16, 8)
            for _ in range(steps):
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
            opt.close()
        except BaseException as e:  # reported below
            errors.append(e)

    a = threading.Thread(target=train, args=(0, 6))
    a.start()
    with Client(srv.endpoint, join=False, timeout=30) as mon:
        # its first pull and four expired waits (counted, not slept for: a busy machine makes fewer in a
        # given time): without the fix the third push is refused (limit)
        wait_until(lambda: mon.status().pulls >= 5, 60, "five pulls of the stalled worker")
        st = mon.status()
    assert a.is_alive() and not errors, errors
    assert st.version == 0 and st.pending_pushes <= 1, st  # held back, not queueing
    b = threading.Thread(target=train, args=(1, 6))
    b.start()
    a.join(60)
    b.join(60)
    assert not a.is_alive() and not b.is_alive()
    assert not errors, errors
    with Client(srv.endpoint, join=False, timeout=5) as mon:
        st = mon.status()
    assert st.version >= 6 and not st.errors, st


def test_a_push_lost_with_a_killed_server_does_not_hold_its_worker_and_the_step_waiting_for_each_other(
        make_server, tmp_path):
    """A worker's push is acknowledged, then the server is killed before its step closes
    and resumes from a checkpoint of the version the push was computed on: the push is
    gone, and the worker must not wait for a step that waits for its push."""
    import threading

    from stella import Compression, Connection, StellaOptimizer

    port = free_port()
    args = ["--liveness-timeout", "2", "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every-steps", "1"]
    srv = make_server(2, args, bind=f"tcp://127.0.0.1:{port}")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x = torch.randn(8, 4)
    # a's requests time out after 120 s: it must learn of the restart by its heartbeats, and its
    # re-sent pull must not wait (for 108 s) for the step that waits for its lost push
    a = StellaOptimizer(model, srv.endpoint, optimizer={"name": "sgd", "lr": 0.1},
                        compression=Compression(method="dense"), connection=Connection(timeout=120))
    b = Client(srv.endpoint, timeout=30)
    b.register({n: p.detach().numpy() for n, p in model.named_parameters()})

    def a_step() -> None:
        a.zero_grad()
        model(x).square().mean().backward()
        a.step()

    def b_step(v: int) -> int:
        b.push({n: np.full(p.numel(), 0.01, np.float32) for n, p in model.named_parameters()}, v)
        return b.pull(v, wait_for=v + 1, timeout=90).version

    a_step()  # exchange 0 in the background: push on version 0, wait for 1
    assert b_step(0) == 1
    a_step()  # exchange 1: a's push on version 1, queued until b's comes
    with Client(srv.endpoint, join=False, timeout=5) as mon:
        wait_until(lambda: mon.status().pending_pushes == 1 and mon.status().checkpoint_version == 1, 30,
                    "a's push queued on a checkpoint of version 1")
    srv.kill()  # a's acknowledged push dies with the server
    srv.wait(10)
    srv2 = make_server(2, args, bind=f"tcp://127.0.0.1:{port}")
    with Client(srv2.endpoint, join=False, timeout=5) as mon:  # a finds the new server by itself
        wait_until(lambda: len(mon.status().workers) == 1, 30, "a reconnected")
    errors: list[BaseException] = []

    def a_more() -> None:
        try:
            a_step()  # waits for exchange 1, then pushes again on version 1
        except BaseException as e:  # reported below
            errors.append(e)

    t = threading.Thread(target=a_more)
    t.start()
    t0 = time.monotonic()
    v = b_step(1)  # the step after the restart needs a's push: a must not wait for it (108 s) in turn
    took = time.monotonic() - t0
    t.join(30)
    assert not errors, errors
    assert v == 2 and took < 60, (v, took)  # ~1 s
    assert "resumed from checkpoint" in srv2.logs()
    b.close()  # first: a's flush on close then closes a step of its own
    a.close()


# --------------------------------------------------------------------------- a snapshot over a slow link
_SNAPSHOT_CLIENT = """
import sys, time, numpy as np
from stella import Client
c = Client(sys.argv[1], timeout=60, name=sys.argv[2])
c.register({"w": np.zeros(int(sys.argv[3]), np.float32)}, {"name": "sgd", "lr": 0.1})
if sys.argv[2] == "first":
    print("registered", flush=True)
    time.sleep(float(sys.argv[4]))  # stays joined: the job is not over
else:
    t = time.monotonic()
    r = c.pull(None)
    print(f"snapshot {r.version} {time.monotonic() - t:.2f} s reconnects {c.reconnects}", flush=True)
c.close()
"""


@pytest.mark.testbed
def test_a_snapshot_that_outlasts_four_heartbeats_on_a_slow_link_is_not_taken_for_a_lost_server(tmp_path):
    """A worker joining over a slow link pulls the model's snapshot (3 MB over 4 Mbit/s: ~6 s)
    while its heartbeats share that link (1 s heartbeats: "lost" after 4 s without a reply).
    The heartbeats get through beside the snapshot (tbf keeps at most 50 ms queued), and the
    pull completes without a reconnect."""
    from bench.wan import Link, WanTestbed, netns_available
    from stella_ps.process import ServerProcess

    ok, why = netns_available()
    if not ok:
        pytest.skip(f"slow-link test bed unavailable: {why}")
    numel = 750_000
    with WanTestbed({"ps": Link(1000, 1000), "a": Link(1000, 1000), "b": Link(4, 4)}, max_lifetime=120) as bed:
        ps = ServerProcess(2, ["--liveness-timeout", "4"], bind=f"tcp://{bed.address('ps')}:{free_port()}",
                           log_level="INFO", cwd=ROOT, timeout=60, popen=functools.partial(bed.popen, "ps"))
        try:
            first = bed.popen("a", [sys.executable, "-c", _SNAPSHOT_CLIENT, ps.endpoint, "first", str(numel), "40"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            assert first.stdout is not None
            assert first.stdout.readline().startswith("registered")  # the model is in the server
            second = bed.run("b", [sys.executable, "-c", _SNAPSHOT_CLIENT, ps.endpoint, "second", str(numel)],
                             timeout=60)
            out = second.stdout
            first.kill()
            first.wait()
        finally:
            ps.close()
    assert second.returncode == 0, second.stderr[-2000:]
    seconds, reconnects = float(out.split()[2]), int(out.split()[5])
    assert seconds > 5.0  # the link's rate (6 s): the heartbeats really did wait behind the snapshot
    assert reconnects == 0, out


def test_a_worker_declared_gone_while_it_registers_reconnects_once_not_for_ever(make_server, make_client):
    """A joined worker declared gone before it registered (as one uploading the model's
    values over a slow link was, before the server counted its heartbeats) has its
    heartbeats refused meanwhile. Its next request that waits (a pull held for the next
    step, or a snapshot on a slow link) reconnects once and goes on. Before, the refusal
    outlived the reconnect (the session token is kept across it), so the client reconnected
    again every 0.2 s for as long as the request waited."""
    srv = make_server(1, ["--liveness-timeout", "1"])
    c = make_client(srv.endpoint, reconnect=30)
    # joined, not registered: gone after 1 s, and its heartbeats (every 0.25 s) refused from then on
    wait_until(lambda: "workers declared gone" in srv.logs(), 30, "the joined worker declared gone")
    # three heartbeats refused (counted, not slept for): the client has had the refusal
    wait_until(lambda: srv.logs().count('"code": "not_registered"') >= 3, 30, "its heartbeats refused")
    v = c.register({"w": np.zeros(16, np.float32)}, {"name": "sgd", "lr": 0.1}).version
    for _ in range(2):  # nobody pushes: the server holds each until its timeout
        t = time.monotonic()
        r = c.pull(v, wait_for=v + 1, timeout=2)
    assert r.version == v and time.monotonic() - t > 1.5  # the second was held, not answered by a rebase
    assert c.reconnects == 1, c.reconnects
