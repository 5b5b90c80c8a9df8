"""The compressed broadcast with server-side error feedback (issue 20): what the server
sent plus what it holds is the global change, exactly; a message follows the pushes'
size, not the number of workers; replicas that add the messages equal the server's
broadcast model bit for bit, lagging ones included; a checkpoint keeps the residual."""
from __future__ import annotations

import numpy as np
import pytest

from stella import Client
from stella import checkpoint_file as ckfmt
from stella.codec import broadcast_share
from stella.protocol import BroadcastInfo, TensorSpec
from stella_ps import broadcast as bmod
from stella_ps.broadcast import Broadcast
from stella_ps.config import Pulls

BIG, SMALL = 8192, 100  # a tensor that is selected from, and one that goes whole


def _whole(layout: list[TensorSpec]) -> list[bool]:
    """The small tensors go whole, as a server's dense part does."""
    return [s.numel < 4096 for s in layout]


def _info(values: str, factor: float) -> BroadcastInfo:
    info = Pulls(values=values, factor=factor).broadcast_info()  # type: ignore[arg-type]
    assert info is not None
    return info


def _dyadic(rng: np.random.Generator, n: int) -> np.ndarray:
    """Multiples of 1/64 in [-4, 4]: every sum below is exact in float32 (and f16)."""
    return (rng.integers(-256, 257, n) / 64).astype(np.float32)


@pytest.mark.parametrize("coding", ["f32", "f16"])
def test_what_was_sent_plus_what_is_held_is_the_global_change_exactly(coding):
    rng = np.random.default_rng(0)
    layout = [TensorSpec("big", (BIG,), "float32"), TensorSpec("small", (SMALL,), "float32")]
    x0 = [_dyadic(rng, BIG), _dyadic(rng, SMALL)]
    b = Broadcast(layout, x0, _info(coding, 1.0), 64, whole=_whole(layout))
    total = [np.zeros(BIG), np.zeros(SMALL)]  # the global change, float64
    sent = [np.zeros(BIG), np.zeros(SMALL)]
    for step in range(1, 13):
        touched = [np.unique(rng.integers(0, BIG, 300)).astype(np.int32), np.arange(SMALL, dtype=np.int32)]
        changes = [_dyadic(rng, t.size) for t in touched]
        log = b.step(step, touched, changes, [150.0, SMALL])
        for t in (0, 1):
            total[t][touched[t]] += changes[t]
            if log.sent[t] is None:
                sent[t] += log.values[t]
            else:
                sent[t][log.sent[t]] += log.values[t]
        k = log.values[0].size
        assert 0.9 * 150 <= k <= 1.1 * 150, k  # the message is the size of a push
        assert log.sent[1] is None and log.values[1].size == SMALL  # a small tensor goes whole
    for t in (0, 1):
        np.testing.assert_array_equal(sent[t] + b.residual[t], total[t])  # nothing lost, exactly
        np.testing.assert_array_equal(b.model[t], x0[t] + sent[t])  # B: the start plus what was sent
    assert np.count_nonzero(b.residual[0]) > 0 and not b.residual[1].any()  # owed, and a small one sent whole


@pytest.mark.parametrize("coding", ["f32", "f16", "bf16", "q4", "q2"])
def test_a_message_is_coded_once_and_b_gains_what_its_frames_decode_to(coding):
    """Each tensor's values are coded once: what B gained is what the frame that went out
    decodes to, and coding those values again gives that frame bit for bit (what the
    broadcast sent when it coded twice). Huge changes (clamped in f16) and tiny ones too."""
    from stella import codec

    rng = np.random.default_rng(5)
    layout = [TensorSpec("big", (BIG,), "float32"), TensorSpec("small", (SMALL,), "float32")]
    b = Broadcast(layout, [np.zeros(BIG, np.float32), np.zeros(SMALL, np.float32)], _info(coding, 2.0), 8,
                  whole=_whole(layout))
    for step, scale in enumerate((1.0, 1e6, 1e-40, 1e-3), start=1):
        touched = [np.unique(rng.integers(0, BIG, 200)).astype(np.int32), np.arange(SMALL, dtype=np.int32)]
        log = b.step(step, touched, [(rng.standard_normal(t.size) * scale).astype(np.float32) for t in touched],
                     [100.0, SMALL])
        msg = b.since(step - 1, step)[0]
        for e in msg.entries:
            q, frame = log.values[e.tensor], msg.frames[e.value_frame]
            np.testing.assert_array_equal(codec.decode_values(frame, e.count, e.value_dtype).view(np.uint32),
                                          q.view(np.uint32))
            assert bytes(codec.encode_values(q, e.value_dtype)) == bytes(frame)


def test_a_coarse_coding_keeps_its_error_owed_and_old_messages_give_way_to_a_snapshot():
    rng = np.random.default_rng(1)
    layout = [TensorSpec("big", (BIG,), "float32")]
    b = Broadcast(layout, [np.zeros(BIG, np.float32)], _info("q4", 2.0), 3, whole=_whole(layout))
    x = np.zeros(BIG, np.float64)
    for step in range(1, 7):
        idx = np.unique(rng.integers(0, BIG, 400)).astype(np.int32)
        ch = rng.standard_normal(idx.size).astype(np.float32)
        log = b.step(step, [idx], [ch], [float(idx.size)])
        x[idx] += ch
        assert log.values[0].size <= 2.2 * idx.size
    np.testing.assert_allclose(b.model[0] + b.residual[0], x, atol=1e-5)  # B + R is the exact model
    assert [m.version for m in b.since(3, 6)] == [4, 5, 6] and b.since(6, 6) == []
    assert b.since(2, 6) is None  # three messages kept: a replica at version 2 gets a snapshot


# ------------------------------------------------------------------ through a real server
def _push(c: Client, rng: np.random.Generator, v: int) -> None:
    idx = np.sort(rng.choice(BIG, 80, replace=False)).astype(np.int32)
    c.push({"w": (idx, rng.standard_normal(80).astype(np.float32)), "b": rng.standard_normal(SMALL)}, v,
           value_dtype="f16")


def test_replicas_that_add_the_messages_equal_the_broadcast_model_bit_for_bit(make_server, make_client):
    """Two workers push top-k updates; one pulls every step, the other every third step
    (several messages, added in order); both replicas equal the server's broadcast model
    (a new worker's snapshot) bit for bit, and a pull carries about two pushes' worth of
    coordinates (--broadcast-factor 2), in q4."""
    srv = make_server(2)
    init = {"w": np.zeros(BIG, np.float32), "b": np.zeros(SMALL, np.float32)}
    a, b = make_client(srv.endpoint), make_client(srv.endpoint)
    a.register(init, {"name": "adam", "lr": 0.01})
    b.register(init)
    rep = [{k: v.copy() for k, v in init.items()} for _ in range(2)]
    since = [0, 0]
    rng = np.random.default_rng(2)
    pulled = []
    for step in range(12):
        for c in (a, b):
            _push(c, rng, step)
        d = a.pull(since[0], wait_for=step + 1)
        assert d.steps and not d.tensors and len(d.steps) == d.version - since[0]
        pulled.append(d.count - SMALL)
        d.apply_to(rep[0])
        since[0] = d.version
        if step % 3 == 2:  # the other one is behind: three messages at once
            d = b.pull(since[1], wait_for=step + 1)
            assert len(d.steps) == 3
            d.apply_to(rep[1])
            since[1] = d.version
        else:
            b.pull(step, wait_for=step + 1)  # waits for the step, installs nothing
    probe = make_client(srv.endpoint)
    probe.register(init)
    snap = probe.pull(None)
    assert snap.full and snap.version == 12 == since[0] == since[1]
    for r in rep:
        for name in init:
            assert np.array_equal(r[name], snap.tensors[name][1]), name
    assert all(140 <= n <= 180 for n in pulled[1:]), pulled  # 2 x 80 coordinates a step, whatever W


@pytest.mark.parametrize("coding", ["f16", "q4", "q2"])
def test_the_broadcast_budget_follows_the_pushes_bytes_not_their_coordinates(make_server, make_client, coding):
    """Two workers push 80 of 8192 coordinates a step in ``coding``: a pull carries the
    broadcast factor (2) times the pushes' coordinates, each counted by its bits against an
    f16 coordinate's (stella.codec.broadcast_share): 160 for f16 pushes, about 85 for q4 and
    72 for q2, so the pull stays about a push's bytes whatever the coding (with the budget in
    coordinates, q4 pushes got 160: a pull of 1.8x the push's bytes, which also cost the byte
    LM iterations, bench/RESULTS.md "A push's bytes on twice the coordinates")."""
    srv = make_server(2)
    init = {"w": np.zeros(BIG, np.float32), "b": np.zeros(SMALL, np.float32)}
    a, b = make_client(srv.endpoint), make_client(srv.endpoint)
    a.register(init, {"name": "adam", "lr": 0.01})
    b.register(init)
    rng = np.random.default_rng(4)
    pulled = []
    for step in range(8):
        for c in (a, b):
            idx = np.sort(rng.choice(BIG, 80, replace=False)).astype(np.int32)
            c.push({"w": (idx, rng.standard_normal(80).astype(np.float32)), "b": rng.standard_normal(SMALL)}, step,
                   value_dtype=coding)
        pulled.append(a.pull(step, wait_for=step + 1).count - SMALL)
        b.pull(step, wait_for=step + 1)
    expected = 2 * 80 * broadcast_share(80 / BIG, coding)
    assert expected == (160 if coding == "f16" else pytest.approx(85.4 if coding == "q4" else 72.5, abs=0.5))
    # (fewer where the residual owes fewer coordinates than the budget: the workers' pushes overlap)
    assert all(0.85 * expected <= n <= expected + 1 for n in pulled), (coding, expected, pulled)


def test_a_checkpoint_keeps_the_residual_and_a_replica_goes_on_after_the_restart(make_server, make_client,
                                                                               tmp_path):
    from stella_ps.process import free_port

    port = free_port()
    args = ["--checkpoint-dir", str(tmp_path), "--checkpoint-every-s", "0"]
    srv = make_server(1, args, bind=f"tcp://127.0.0.1:{port}")
    init = {"w": np.zeros(BIG, np.float32), "b": np.zeros(SMALL, np.float32)}
    c = make_client(srv.endpoint)
    c.register(init, {"name": "sgd", "lr": 0.5})
    rep = {k: v.copy() for k, v in init.items()}
    rng = np.random.default_rng(3)
    for step in range(6):
        _push(c, rng, step)
        c.pull(step, wait_for=step + 1).apply_to(rep)
    c.close()
    assert srv.close() == 0  # SIGTERM: a checkpoint of version 6
    (first,) = ckfmt.names(str(tmp_path))
    ck = ckfmt.read(str(tmp_path / first))
    residual = ck.tensors[0]["bcast_residual"]
    assert ck.version == 6 and np.count_nonzero(residual) > 0  # what is owed is in the checkpoint
    assert np.array_equal(ck.tensors[0]["bcast_model"], rep["w"])

    srv2 = make_server(1, args, bind=f"tcp://127.0.0.1:{port}")
    c2 = make_client(srv2.endpoint)
    assert c2.register(init).version == 6
    for step in range(6, 9):  # the replica of version 6 goes on with the messages of the resumed server
        _push(c2, rng, step)
        d = c2.pull(step, wait_for=step + 1)
        assert not d.full
        d.apply_to(rep)
    snap = c2.pull(None)
    assert np.array_equal(snap.tensors["w"][1], rep["w"]) and np.array_equal(snap.tensors["b"][1], rep["b"])
    c2.close()
    assert srv2.close() == 0
    newest = ckfmt.read(str(tmp_path / ckfmt.names(str(tmp_path))[0]))
    assert newest.version == 9 and not np.array_equal(newest.tensors[0]["bcast_residual"], residual)


@pytest.mark.parametrize("coding", ["f32", "f16", "q4"])
def test_the_index_selects_the_exact_top_k_without_a_pass_over_the_residual(coding):
    """Sparse steps on a large tensor: the selection comes from the residual's index, kept
    current by the steps' changes (no pass over the whole residual), and is the top k of
    the residual by magnitude, step after step; sent plus held is the global change."""
    n, k = 100_000, 150
    rng = np.random.default_rng(2)
    layout = [TensorSpec("big", (n,), "float32")]
    b = Broadcast(layout, [np.zeros(n, np.float32)], _info(coding, 1.0), 64, whole=_whole(layout))
    total, sent = np.zeros(n), np.zeros(n)
    ref = np.zeros(n, np.float32)  # R as the steps define it, kept here: reading b.residual would settle what it owes
    steps = 40
    for step in range(1, steps + 1):
        idx = np.unique(rng.integers(0, n, 300)).astype(np.int32)
        ch = _dyadic(rng, idx.size)
        ref[idx] += ch
        before = ref.copy()
        log = b.step(step, [idx], [ch], [float(k)])
        ref[log.sent[0]] -= log.values[0]
        total[idx] += ch
        sent[log.sent[0]] += log.values[0]
        got = log.sent[0]
        assert got.size == k and np.all(np.diff(got) > 0)
        # the top k of |R| (ties would make it ambiguous: multiples of 1/64 have many, so compare the magnitudes)
        want = np.sort(np.abs(before))[-k:]
        np.testing.assert_array_equal(np.sort(np.abs(before[got])), want)
    assert b.full_passes == [0] and b.index_passes == [0]  # no pass over R: the index gave every step
    assert b.residual[0].tobytes() == ref.tobytes()
    if coding != "q4":
        np.testing.assert_array_equal(sent + b.residual[0], total)  # nothing lost, exactly
    else:
        np.testing.assert_allclose(sent + b.residual[0], total, atol=1e-5)


@pytest.mark.parametrize("every", [1, 5, 0])
def test_b_takes_its_messages_in_later_sweeps_with_the_same_floats(every):
    """B's sparse messages wait and go in together (MODEL_OWED_SHARE, MODEL_OWED_LISTS);
    B read after every step, every fifth or only at the end is the start plus the messages
    added one at a time, in order, bit for bit, and the wait stays bounded."""
    rng = np.random.default_rng(7)
    sizes = [BIG, 3 * BIG, SMALL]
    layout = [TensorSpec(f"t{i}", (n,), "float32") for i, n in enumerate(sizes)]
    x0 = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    b = Broadcast(layout, x0, _info("q4", 2.0), 64, whole=_whole(layout))
    want = [x.copy() for x in x0]
    for step in range(1, 90):
        dens = 0.001 if step < 60 else 0.05  # small messages (the list bound), then large (the entry bound)
        touched = [np.sort(rng.choice(n, max(1, int(n * dens)), replace=False)).astype(np.int32) for n in sizes]
        changes = [(rng.standard_normal(t.size) * 10.0 ** rng.integers(-4, 2)).astype(np.float32) for t in touched]
        log = b.step(step, touched, changes, [t.size / 2 for t in touched])
        for t, (sent, v) in enumerate(zip(log.sent, log.values)):
            if sent is None:
                want[t] += v
            else:
                want[t][sent] += v
        for t, n in enumerate(sizes):
            assert len(b._model_owed[t]) < bmod.MODEL_OWED_LISTS
            assert sum(i.size for i, _ in b._model_owed[t]) < n // bmod.MODEL_OWED_SHARE
        if every and step % every == 0:
            assert [m.tobytes() for m in b.model] == [w.tobytes() for w in want]
    assert [m.tobytes() for m in b.model] == [w.tobytes() for w in want]


def test_dense_steps_select_with_one_pass_and_then_rebuild_the_index():
    n = 20_000
    b = Broadcast([TensorSpec("big", (n,), "float32")], [np.zeros(n, np.float32)], _info("f32", 1.0), 64,
                  whole=[False])
    rng = np.random.default_rng(3)
    for step in range(1, 4):
        idx = np.arange(n, dtype=np.int32)
        log = b.step(step, [idx], [rng.standard_normal(n).astype(np.float32)], [2000.0])
        assert 0.9 * 2000 <= log.sent[0].size <= 1.1 * 2000
    assert b.full_passes == [3] and b.index_passes == [0]
    idx = np.arange(0, n, 500, dtype=np.int32)  # a light step: the index again, rebuilt once after the passes
    log = b.step(4, [idx], [np.ones(idx.size, np.float32)], [20.0])
    assert b.full_passes == [3] and b.index_passes == [1] and log.sent[0].size == 20


def test_a_pool_of_threads_passes_over_the_residual_in_ranges_with_the_same_bits():
    """A store with PASS_THREADS_FROM threads or more splits the streaming pass over a large residual (here
    2.1M coordinates, 2% touched a step: the pass, not the index) into ranges: the messages and R as with one."""
    from stella_ps.runtime import TensorPool

    n = 2_100_000
    logs, residuals = [], []
    for threads in (1, bmod.PASS_THREADS_FROM):
        pool = TensorPool(threads)
        b = Broadcast([TensorSpec("big", (n,), "float32")], [np.zeros(n, np.float32)], _info("q4", 1.0), 64,
                      whole=[False])
        rng = np.random.default_rng(5)
        got = []
        for step in range(1, 5):
            idx = np.sort(rng.choice(n, n // 50, replace=False)).astype(np.int32)
            log = b.step(step, [idx], [(rng.standard_normal(idx.size) * 1e-3).astype(np.float32)], [n / 100],
                         pool=pool)
            got.append((log.sent[0].copy(), log.values[0].tobytes()))
        pool.close()
        assert b.full_passes == [4]
        logs.append(got)
        residuals.append(b.residual[0].tobytes())
    assert all(np.array_equal(a[0], c[0]) and a[1] == c[1] for a, c in zip(*logs, strict=True))
    assert residuals[0] == residuals[1]


def test_bench_broadcast_runs_both_on_the_same_steps():
    from bench.broadcast import run

    r = run(250_000, 2, 0.0003, 8, "q4", 2.0)
    assert r["pass_full_passes"] == 8 * 8  # every tensor, every step
    assert r["index_full_passes"] == 0  # the index never reads all of R
    assert r["index_ms"] > 0 and r["pass_ms"] > 0
