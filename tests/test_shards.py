"""Sharded stella-ps (issue 21): the split of the parameter space, rounds consistent
across shards (replicas equal the concatenation of the shards' broadcast models bit for
bit), training through shards with StellaOptimizer, a shard killed and restarted from its
own checkpoint while the others go on, and the refusals (shards listed out of order, a
shard serving exact pulls)."""
from __future__ import annotations

import itertools
import json
import signal
import threading

import numpy as np
import pytest
from live import TARGET_ACCURACY, live_worker, log_lines, reap, wait_until

from stella import StellaError
from stella.errors import ProtocolError
from stella.layout import ALIGN, FlatLayout
from stella.shards import ShardedClient
from stella_ps.process import free_port

LAYOUT = {"a": 10, "w": 100_000, "b": 50, "v": 300_000}


# --------------------------------------------------------------------------- the split
@pytest.mark.parametrize("shards", [1, 2, 3, 4, 7])
def test_the_split_cuts_the_flat_model_into_ranges_of_about_equal_size(shards):
    flat = FlatLayout((10, 100_000, 50, 300_000, 7, 64_000), 4096)
    ranges = flat.shard_ranges(shards)
    assert len(ranges) == shards and ranges[0][0] == 0 and ranges[-1][1] == flat.numel
    assert all(b == c for (_, b), (c, _) in itertools.pairwise(ranges))  # contiguous: every coordinate once
    assert all(a % ALIGN == 0 for a, _ in ranges)  # whole lines, whole blocks
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 2 * ALIGN
    for a, b in ranges:  # a shard's parts: its large tensors' coordinates, then its share of the dense suffix
        parts = flat.parts(a, b)
        assert sum(p.numel for p in parts) == b - a and [p.whole for p in parts] == sorted(p.whole for p in parts)


# --------------------------------------------------------------------------- rounds
def _shards(make_server, n: int, workers: int, args=()) -> list[str]:
    return [make_server(workers, ["--shard", f"{i}/{n}", *args]).endpoint for i in range(n)]


def _update(rng: np.random.Generator, init: dict[str, np.ndarray]) -> dict:
    out = {}
    for name, x in init.items():
        k = max(1, x.size // 100)
        idx = np.sort(rng.choice(x.size, k, replace=False)).astype(np.int32)
        out[name] = (idx, rng.standard_normal(k).astype(np.float32))
    return out


def test_replicas_equal_the_shards_broadcast_models_bit_for_bit(make_server):
    addrs = _shards(make_server, 2, 2)
    rng0 = np.random.default_rng(0)
    init = {k: rng0.standard_normal(n).astype(np.float32) for k, n in LAYOUT.items()}
    results: list[tuple[int, dict[str, np.ndarray]]] = []
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            with ShardedClient(addrs, timeout=30) as c:
                c.register(init, {"name": "adamw", "lr": 0.01})
                snap = c.pull(None)
                rep = {k: v.copy() for k, v in init.items()}
                snap.apply_to(rep)
                v, rng = snap.version, np.random.default_rng(rank + 1)
                for _ in range(15):
                    c.push(_update(rng, init), v, value_dtype="f16")
                    d = c.pull(v, wait_for=v + 1)
                    while not d.full and d.version <= v:
                        d = c.pull(v, wait_for=v + 1)
                    assert d.version == v + 1 and len(d.steps) == 1  # one round: one step of every shard
                    d.apply_to(rep)
                    v = d.version
                results.append((v, rep))
        except BaseException as e:  # reported by the test's thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    with ShardedClient(addrs, timeout=30) as probe:
        probe.register(init)
        snap = probe.pull(None)  # each shard's broadcast model, laid end to end
        model = {k: v.copy() for k, v in init.items()}
        snap.apply_to(model)
        statuses = probe.status()
    assert [s.shard for s in statuses] == ["0/2", "1/2"]
    assert [s.version for s in statuses] == [15, 15]
    assert [s.numel for s in statuses] == [b - a for a, b in FlatLayout(tuple(LAYOUT.values()), 4096).shard_ranges(2)]
    for v, rep in results:
        assert v == 15
        for k in model:
            assert np.array_equal(rep[k], model[k]), k
    assert any(not np.array_equal(model[k], init[k]) for k in model)


def test_a_shard_ahead_gives_its_extra_steps_only_with_the_others(make_server):
    """Shard 1 closes a step that shard 0 has not (a push reached it alone): a pull adds
    no step until every shard has it, and then exactly one of each."""
    addrs = _shards(make_server, 2, 1)
    init = {k: np.zeros(n, np.float32) for k, n in LAYOUT.items()}
    with ShardedClient(addrs, timeout=30) as c:
        c.register(init, {"name": "sgd", "lr": 1.0})
        v = c.pull(None).version
        rng = np.random.default_rng(0)
        upd = c.shards[0].flatten(_update(rng, init))  # each shard pushes the part in its range
        c.shards[1].push(upd, 0)
        d = c.pull(v, wait_for=v + 1, timeout=1.0)
        assert d.version == v and d.steps == []  # shard 1's step is kept, not added
        c.shards[0].push(upd, 0)
        d = c.pull(v, wait_for=v + 1)
        assert d.version == v + 1 and len(d.steps) == 1
        assert set(d.per_name(d.steps[0])) == set(LAYOUT)  # (the small ones: the dense part, sent whole)


def test_a_worker_holding_the_first_values_starts_from_its_registration(make_server):
    """Every shard tells a worker whose pieces are the values the job was created with their
    version: its rounds start there, and a pull since brings the steps every shard made
    since, not a snapshot; the replica equals the shards' broadcast models bit for bit."""
    addrs = _shards(make_server, 2, 1)
    init = {k: np.random.default_rng(0).standard_normal(n).astype(np.float32) for k, n in LAYOUT.items()}
    with ShardedClient(addrs, timeout=30) as a:
        reg = a.register(init, {"name": "adamw", "lr": 0.01})
        assert reg.base == 0 and reg.version == 0  # it created both shards' models
        v, rng = 0, np.random.default_rng(1)
        for _ in range(3):
            a.push(_update(rng, init), v, value_dtype="f16")
            v = a.pull(v, wait_for=v + 1).version
        assert v == 3
        with ShardedClient(addrs, timeout=30) as late, ShardedClient(addrs, timeout=30) as other:
            reg = late.register(init)
            assert reg.base == 0 and reg.version == 3
            before = late.bytes_pulled
            d = late.pull(reg.base)
            assert not d.full and d.version == 3 and len(d.steps) == 3
            assert late.bytes_pulled - before < sum(LAYOUT.values())  # three messages, not 4 B a coordinate
            rep = {k: x.copy() for k, x in init.items()}
            d.apply_to(rep)
            assert other.register({k: x + 1 for k, x in init.items()}).base is None  # other values: a snapshot
            snap = other.pull(None)
            model = {k: x.copy() for k, x in init.items()}
            snap.apply_to(model)
            assert snap.full and snap.version >= 3
            for k in model:
                assert np.array_equal(rep[k], model[k]), k
            assert any(not np.array_equal(model[k], init[k]) for k in model)


# --------------------------------------------------------------------------- refusals
def test_shards_listed_out_of_order_are_refused(make_server):
    addrs = _shards(make_server, 2, 1)
    with pytest.raises(ProtocolError, match=r"shard 1/2 .* number 0"):
        ShardedClient(list(reversed(addrs)), timeout=10)


def test_a_shard_serving_exact_pulls_is_refused(make_server):
    addrs = _shards(make_server, 2, 1, ["--pull", "exact"])
    with ShardedClient(addrs, timeout=10) as c, pytest.raises(StellaError, match="broadcast"):
        c.register({k: np.zeros(n, np.float32) for k, n in LAYOUT.items()})


# --------------------------------------------------------------------------- training, restart
@pytest.mark.slow
def test_training_goes_on_while_a_shard_restarts_from_its_own_checkpoint(make_server, tmp_path):
    ports = [free_port(), free_port()]
    args = [[ "--shard", f"{i}/2", "--liveness-timeout", "2", "--checkpoint-dir", str(tmp_path / f"ck{i}"),
              "--checkpoint-every-steps", "10"] for i in range(2)]
    servers = [make_server(2, args[i], bind=f"tcp://127.0.0.1:{ports[i]}") for i in range(2)]
    address = ",".join(s.endpoint for s in servers)
    target = 150
    logs = [tmp_path / f"w{r}.jsonl" for r in range(2)]
    procs = [live_worker(address, r, 2, target, logs[r], "--timeout", "5") for r in range(2)]
    mon = ShardedClient([s.endpoint for s in servers], timeout=10, join=False)
    try:
        wait_until(lambda: min(s.version for s in mon.status()) >= 50, 120, "50 rounds")
        servers[1].kill()  # SIGKILL: shard 1 loses the steps since its last checkpoint
        servers[1].wait(10)
        before = mon.shards[0].status().version
        servers[1] = make_server(2, args[1], bind=f"tcp://127.0.0.1:{ports[1]}")
        codes = reap(procs, 240)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        mon.close(leave=False)
    assert codes == [0, 0]
    assert "resumed from checkpoint" in servers[1].logs()
    done = [next(x for x in log_lines(log) if x.get("done")) for log in logs]
    assert all(d["reconnects"] >= 1 for d in done), done  # the restarted shard's connection came back
    assert all(d["version"] >= target for d in done), done
    assert min(d["accuracy"] for d in done) >= TARGET_ACCURACY, done
    # shard 0 never stopped: it went on from where it was
    assert "resumed from checkpoint" not in servers[0].logs() and before >= 50


# --------------------------------------------------------------------------- status
def test_stella_status_shows_the_job_across_its_shards(make_server, capsys):
    from stella.cli import main as stella_main

    addrs = _shards(make_server, 2, 1)
    with ShardedClient(addrs, timeout=30) as c:
        c.register({k: np.zeros(n, np.float32) for k, n in LAYOUT.items()}, {"name": "sgd", "lr": 1.0})
        v = c.pull(None).version
        c.push(_update(np.random.default_rng(0), {k: np.zeros(n, np.float32) for k, n in LAYOUT.items()}), v)
        assert c.pull(v, wait_for=v + 1).version == v + 1
        assert [st.shard for st in c.status()] == ["0/2", "1/2"]
        assert stella_main(["status", ",".join(addrs)]) == 0
        text = capsys.readouterr().out.splitlines()
        assert "| 2 shards | rounds 1 |" in text[0] and "workers 1/1" in text[0]
        assert text[1].startswith(f"  shard 0/2 {addrs[0]} | version 1")
        assert text[2].startswith(f"  shard 1/2 {addrs[1]} | version 1")
        assert stella_main(["status", ",".join(addrs), "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert [s["shard"] for s in doc["shards"]] == ["0/2", "1/2"] and all(s["version"] == 1 for s in doc["shards"])


def test_a_model_too_small_for_its_shards_is_refused_by_the_client(make_server):
    addrs = _shards(make_server, 2, 1)
    with ShardedClient(addrs, timeout=10) as c, pytest.raises(ValueError, match="use fewer shards"):
        c.register({"w": np.zeros(15, np.float32)})  # ranges on 16-coordinate boundaries: shard 0 gets nothing


def test_a_pre_encoded_push_replays_and_a_pull_without_decoding_gives_the_version(make_server):
    """What bench.server's light clients do: one encoding pushed at every step, pulls
    that read only the version; the model moves by the same update each step."""
    from stella import Client

    srv = make_server(1, pull="exact")
    with Client(srv.endpoint, timeout=10) as c:
        c.register({"w": np.zeros(100, np.float32)}, {"name": "sgd", "lr": 1.0})
        enc = c.encode_push({"w": (np.array([3, 7], np.int32), np.array([1.0, -2.0], np.float32))})
        v = c.pull(None, decode=False).version
        for _ in range(3):
            c.push(enc, v)
            d = c.pull(v, wait_for=v + 1, decode=False)
            assert d.version == v + 1 and not d.tensors and not d.steps
            v = d.version
        w = c.pull(None).tensors["w"][1]
        assert w[3] == -3.0 and w[7] == 6.0 and np.count_nonzero(w) == 2


def test_a_sharded_push_ok_lists_the_range_each_shard_clipped(make_server):
    """Each shard bounds its own part of a push; the reply names each range a shard scaled
    down and the factor it kept, in the flat model's coordinates (the worker's residual
    takes the rest back), and none for a shard that took its part whole."""
    addrs = _shards(make_server, 2, 1, ["--max-push-norm", "5", "--push-norm-action", "clip"])
    ranges = FlatLayout(tuple(LAYOUT.values()), 4096).shard_ranges(2)
    with ShardedClient(addrs, timeout=30) as c:
        c.register({k: np.zeros(n, np.float32) for k, n in LAYOUT.items()}, {"name": "sgd", "lr": 1.0})
        v = c.pull(None).version
        idx = np.arange(LAYOUT["v"] - 10, LAYOUT["v"], dtype=np.int32)  # the tail of v: shard 1's range
        ok = c.push({"v": (idx, np.full(10, 10.0, np.float32)), "w": (np.array([3], np.int32), np.ones(1, np.float32))},
                    v)
    assert len(ok.clipped) == 1
    start, stop, kept = ok.clipped[0]
    assert (start, stop) == ranges[1] and kept == pytest.approx(5 / np.sqrt(1000.0), rel=1e-6)


def test_a_round_in_one_message_to_each_shard_and_its_snapshot_fallback(make_server):
    """push_pull sends each shard its push with the pull riding on it and answers as push
    and pull did; a pull of a round this client does not map (None: a snapshot) goes after
    the pushes on its own, and still answers."""
    addrs = _shards(make_server, 2, 1)
    init = {k: np.zeros(n, np.float32) for k, n in LAYOUT.items()}
    rng = np.random.default_rng(0)
    with ShardedClient(addrs, timeout=30) as c:
        c.register(init, {"name": "sgd", "lr": 1.0})
        v = c.pull(None).version
        push, pull = c.push_pull(_update(rng, init), v, v, wait_for=v + 1)
        assert push.result().step == v
        d = pull.result()
        assert d.version == v + 1 and len(d.steps) == 1 and set(d.per_name(d.steps[0])) == set(LAYOUT)
        push, pull = c.push_pull(_update(rng, init), v + 1, None)
        assert push.result().step == v + 1
        snap = pull.result()
        assert snap.full and snap.version >= v + 1 and set(snap.tensors) == set(LAYOUT)
