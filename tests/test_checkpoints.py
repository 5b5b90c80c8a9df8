"""Checkpoints (issue 11, issue 25): a killed server resumes from its newest valid
checkpoint and the workers reconnect by themselves; the store's state round-trips bit
for bit, also when copied a slice at a time while steps go on; damaged checkpoints are
reported and moved aside; SIGTERM writes one; periodic ones are bounded in number."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from live import ROOT, TARGET_ACCURACY, dead_pid, live_worker, log_lines, reap, version_of, wait_until

from stella import checkpoint_file as ckfmt
from stella_ps.process import free_port


# --------------------------------------------------------------------------- kill -9 of the server
@pytest.mark.slow
def test_a_killed_server_restarts_from_its_checkpoint_and_the_workers_reconnect(make_server, make_client, tmp_path):
    port = free_port()
    ckdir = tmp_path / "ck"
    args = ["--liveness-timeout", "2", "--checkpoint-dir", str(ckdir), "--checkpoint-every-steps", "10"]
    srv = make_server(2, args, bind=f"tcp://127.0.0.1:{port}")
    mon = make_client(srv.endpoint, join=False)
    target = 160
    logs = [tmp_path / f"w{r}.jsonl" for r in range(2)]
    procs = [live_worker(srv.endpoint, r, 2, target, logs[r], "--timeout", "5") for r in range(2)]
    try:
        wait_until(lambda: version_of(mon) >= 60, 120, "60 steps")
        for p in procs:  # held still, so that the test looks at the restarted server first
            p.send_signal(signal.SIGSTOP)
        srv.kill()  # SIGKILL: no final checkpoint
        srv.wait(10)
        mon.close()
        newest = ckfmt.names(str(ckdir))[0]
        ck = ckfmt.read(str(ckdir / newest))
        # one every 10 steps, one write at a time: which is the newest when the kill lands depends on how
        # the writes kept up (40-80 on an idle machine); the resumed server starts from it, whichever it is
        assert ck.version >= 10, [ln for ln in srv.logs().splitlines() if "checkpoint" in ln]
        srv2 = make_server(2, args, bind=f"tcp://127.0.0.1:{port}")
        from stella.demo import demo_model

        model = demo_model(64, 0)
        probe = make_client(srv2.endpoint)
        reg = probe.register(dict(model.named_parameters()))
        # the job's first values (the same seed), but a resumed server knows no creation values: a snapshot
        assert not reg.created and reg.version == ck.version and reg.base is None
        # status says which checkpoint it resumed from and how old it is (the file's age), not "none"
        st = probe.status()
        assert st.checkpoint_version == ck.version
        assert st.checkpoint_age_s is not None and 0 <= st.checkpoint_age_s < 600
        snap = probe.pull(None)
        assert snap.version == ck.version
        # the workers' model: the broadcast model the checkpoint holds (the exact one with --pull exact)
        held = np.concatenate([a.get("bcast_model", a["param"]) for a in ck.tensors])  # the flat model's parts
        assert np.array_equal(np.concatenate([piece.values for piece in snap.values]), held)  # bit for bit
        probe.close()
        for p in procs:  # the workers find the new server by themselves
            p.send_signal(signal.SIGCONT)
        codes = reap(procs, 180)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
    assert codes == [0, 0]
    done = [next(x for x in log_lines(log) if x.get("done")) for log in logs]
    assert all(d["reconnects"] >= 1 for d in done), done
    assert all(d["version"] >= target for d in done)
    assert min(d["accuracy"] for d in done) >= TARGET_ACCURACY, done
    assert "resumed from checkpoint" in srv2.logs()


def test_restore_gives_back_every_state_array_bit_for_bit(tmp_path):
    """The store's whole state (parameters and Adam moments and step counts), restored
    from a checkpoint and copied out again, equals what was written."""
    from stella.payload import SparseTensor
    from stella.protocol import TensorSpec
    from stella_ps.aggregation import Step
    from stella_ps.checkpoints import state_copy
    from stella_ps.config import Pulls
    from stella_ps.optim import OptimizerConfig
    from stella_ps.store import ModelStore

    cfg = OptimizerConfig.from_wire({"name": "adamw", "lr": 0.01, "weight_decay": 0.1})
    layout = [TensorSpec("a", (50, 3), "float32"), TensorSpec("b", (7,), "float32")]
    rng = np.random.default_rng(0)
    s = ModelStore(Pulls(mode="exact"), history=64, threads=1, dense_below=4096)
    s.initialise(layout, [rng.standard_normal(150).astype(np.float32), rng.standard_normal(7).astype(np.float32)],
                 cfg)
    for _ in range(5):
        idx = np.unique(rng.integers(0, 150, 20)).astype(np.int32)
        s.apply_step(Step([[SparseTensor(0, idx, rng.standard_normal(idx.size).astype(np.float32))],
                           [SparseTensor(1, None, rng.standard_normal(7).astype(np.float32))]], 1.0, [0], 0, []),
                     cfg)
    version, arrays = state_copy(s)
    path = str(tmp_path / ckfmt.file_name(version, 1))
    ckfmt.write(path, ckfmt.Checkpoint(version, ckfmt.layout_of(layout), cfg.to_wire(), arrays))
    back = ckfmt.read(path)
    s2 = ModelStore(Pulls(mode="exact"), history=64, threads=1, dense_below=4096)
    s2.restore(layout, back.tensors, OptimizerConfig.from_wire(back.optimizer), back.version)
    v2, arrays2 = state_copy(s2)
    assert v2 == version == 5
    for a1, a2 in zip(arrays, arrays2):
        assert set(a1) == set(a2) == {"param", "exp_avg", "exp_avg_sq", "step"}
        for k in a1:
            assert a1[k].dtype == a2[k].dtype and np.array_equal(a1[k], a2[k]), k


# --------------------------------------------------------------------------- damaged checkpoints
def _two_checkpoints(directory: Path) -> tuple[Path, Path]:
    layout = [{"name": "w", "shape": [1000], "dtype": "float32"}]
    paths = []
    for seq, version in ((1, 10), (2, 20)):
        arrays = [{"param": np.full(1000, version, np.float32), "momentum_buf": np.zeros(1000, np.float32)}]
        p = directory / ckfmt.file_name(version, seq)
        ckfmt.write(str(p), ckfmt.Checkpoint(version, layout, {"name": "sgd", "lr": 0.1, "momentum": 0.9}, arrays))
        paths.append(p)
    return paths[0], paths[1]


def test_a_reader_leaves_the_temporary_file_of_a_write_in_progress_and_deletes_a_crashed_ones(tmp_path):
    """newest_valid deletes a temporary file whose writer is gone (a crash's leftover),
    never one whose writer still runs: a second process reading the directory (a test
    polling for a checkpoint, an operator's tool) once deleted a running server's file
    under it, and that server's write failed at its rename (ENOENT)."""
    from stella_ps.checkpoints import newest_valid

    _, newest = _two_checkpoints(tmp_path)
    gone = dead_pid()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        names = {pid: ckfmt.temporary_name(ckfmt.file_name(30, 3), pid=pid)
                 for pid in (gone, running.pid, os.getpid())}
        for n in names.values():
            (tmp_path / n).write_bytes(b"partial")
        path, ck = newest_valid(str(tmp_path))
        assert path == str(newest) and ck.version == 20
        assert not (tmp_path / names[gone]).exists()
        assert (tmp_path / names[running.pid]).exists() and (tmp_path / names[os.getpid()]).exists()
        running.kill()
        running.wait()
        newest_valid(str(tmp_path))  # its writer gone too: a leftover now
        assert not (tmp_path / names[running.pid]).exists() and (tmp_path / names[os.getpid()]).exists()
    finally:
        running.kill()
        running.wait()


@pytest.mark.parametrize("damage", ["truncate", "flip_a_value_bit", "flip_a_header_byte"])
def test_a_damaged_newest_checkpoint_is_reported_and_the_previous_one_used(make_server, make_client, tmp_path,
                                                                           damage):
    _older, newest = _two_checkpoints(tmp_path)
    data = bytearray(newest.read_bytes())
    if damage == "truncate":
        data = data[:len(data) // 2]
    elif damage == "flip_a_value_bit":
        data[-len(ckfmt.END) - 100] ^= 0x01  # inside the last array
    else:
        data[30] ^= 0x20  # inside the JSON header
    newest.write_bytes(bytes(data))
    with pytest.raises(ckfmt.CheckpointError):
        ckfmt.read(str(newest))
    srv = make_server(1, ["--checkpoint-dir", str(tmp_path)])
    c = make_client(srv.endpoint)
    st = c.status()
    assert st.version == 10 and st.checkpoint_version == 10
    c.register({"w": np.zeros(1000, np.float32)})
    vals = c.pull(None).tensors["w"][1]
    assert np.all(vals == 10.0)
    assert "checkpoint damaged" in srv.logs() and newest.name in srv.logs()


# --------------------------------------------------------------------------- SIGTERM checkpoint + export
def test_sigterm_writes_a_checkpoint_and_export_loads_into_the_model(make_server, make_client, tmp_path):
    ckdir = tmp_path / "ck"
    srv = make_server(1, ["--checkpoint-dir", str(ckdir), "--checkpoint-every-s", "0"], pull="exact")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    c = make_client(srv.endpoint)
    c.register(dict(model.named_parameters()), {"name": "adam", "lr": 0.01})
    v = 0
    rng = np.random.default_rng(1)
    for _ in range(4):
        c.push({n: rng.standard_normal(p.numel()).astype(np.float32) for n, p in model.named_parameters()}, v)
        v = c.pull(v, wait_for=v + 1).version
    server_params = {n: vals.copy() for n, (_, vals) in c.pull(None).tensors.items()}
    c.close()
    assert srv.close() == 0  # SIGTERM: a graceful stop writes the last checkpoint
    files = ckfmt.names(str(ckdir))
    assert len(files) == 1 and ckfmt.read(str(ckdir / files[0])).version == 4
    out = tmp_path / "model.pt"
    r = subprocess.run([sys.executable, "-m", "stella.cli", "export", str(ckdir / files[0]), str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    sd = torch.load(out, weights_only=True)
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    fresh.load_state_dict(sd)  # strict: the same names and shapes
    for n, p in fresh.named_parameters():
        assert torch.equal(p.detach().reshape(-1), torch.from_numpy(server_params[n])), n


def test_periodic_checkpoints_are_bounded_in_number(make_server, make_client, tmp_path):
    srv = make_server(1, ["--checkpoint-dir", str(tmp_path), "--checkpoint-every-steps", "2",
                          "--checkpoint-keep", "2"])
    c = make_client(srv.endpoint)
    c.register({"w": np.zeros(64, np.float32)})
    v = 0
    for _ in range(10):
        c.push({"w": np.ones(64, np.float32)}, v)
        v = c.pull(v, wait_for=v + 1).version
        if v % 2 == 0:  # each due checkpoint written (and the older pruned) before the next step, so that
            # a slow write cannot skip versions (one write at a time: at load 3 the write of version 2 outlasted
            # the next eight steps, and versions 2 and 10 were kept)
            wait_until(lambda v=v: c.status().checkpoint_version == v, 30, f"the checkpoint of version {v}")
    kept = [ckfmt.read(str(tmp_path / n)).version for n in ckfmt.names(str(tmp_path))]
    assert kept == [10, 8] and c.status().checkpoint_version == 10, kept
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporary files left


@pytest.mark.parametrize("pull", ["exact", "broadcast"])
@pytest.mark.parametrize("opt", [{"name": "adamw", "lr": 0.01, "weight_decay": 0.1},
                                 {"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True},
                                 {"name": "sgd", "lr": 1.0, "count_exponent": 0.5},  # update mode's "count"
                                 # tapered: each step's pushes (about 3.3% dense) between from and to
                                 {"name": "sgd", "lr": 1.0, "count_exponent": 0.5, "count_taper_from": 0.01,
                                  "count_taper_to": 0.1}])
def test_a_copy_in_slices_rolled_forward_equals_the_store_bit_for_bit(opt, pull):
    """A checkpoint copies the state a slice at a time while steps go on; the logged
    steps, applied to the slices copied before them, give exactly the store's state
    (with the broadcast, its model and residual too: a step's selection is replayed)."""
    from stella.payload import SparseTensor
    from stella.protocol import TensorSpec
    from stella_ps.aggregation import Step
    from stella_ps.checkpoints import copy_in_slices, roll_forward, state_copy
    from stella_ps.config import Pulls
    from stella_ps.optim import OptimizerConfig
    from stella_ps.store import ModelStore

    cfg = OptimizerConfig.from_wire(opt)
    big = 5000  # above the broadcast's whole-tensor size: its messages are selected
    layout = [TensorSpec("a", (big,), "float32"), TensorSpec("b", (37,), "float32")]
    rng = np.random.default_rng(3)
    s = ModelStore(Pulls(mode=pull), history=64, threads=1, dense_below=4096)
    s.initialise(layout, [rng.standard_normal(n).astype(np.float32) for n in (big, 37)], cfg)

    def step() -> None:
        idx = [np.unique(rng.integers(0, big, 150)).astype(np.int32) for _ in range(2)]
        per_tensor = [[SparseTensor(0, i, rng.standard_normal(i.size).astype(np.float32)) for i in idx],
                      [SparseTensor(1, None, rng.standard_normal(37).astype(np.float32))]]
        s.apply_step(Step(per_tensor, 0.5, [0, 1], 0, []), cfg)

    for _ in range(3):
        step()
    slices = 0

    async def run(fn, *args):  # the store thread's run, in this thread: a step after every slice
        nonlocal slices
        out = fn(*args)
        if fn == s.copy_records:
            slices += 1
            step()
        return out

    copy = asyncio.run(copy_in_slices(s, run, 128))  # the server's own copy, in slices of 128
    assert slices == copy.slices == 40 + 1 and len(copy.redo) == slices and copy.version == 3 + slices
    kind = OptimizerConfig.from_wire({"name": cfg.name})
    rolled = roll_forward(kind, [big, 37], copy.copies, copy.redo, s.sparse_numels())
    _, truth = state_copy(s)
    assert ("bcast_residual" in truth[0]) == (pull == "broadcast")
    for got, want in zip(rolled, truth):
        assert set(got) == set(want)
        for k in want:
            assert np.array_equal(got[k], want[k]), k
