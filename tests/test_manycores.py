"""Many cores on one host (issue 44): ``stella-ps --shards N`` starts the shards of one
job from one command, and a worker needs only the first address. A StellaOptimizer given
that address trains through every shard (its replica equals the shards' broadcast models
bit for bit); a shard process killed is started again by the supervisor on its address,
from its own checkpoint, and training goes on; SIGTERM stops them all, each with its last
checkpoint, and a restart resumes them; ``stella status`` of the one address shows the
whole job. The supervisor's plan (ports, metrics, checkpoint directories, threads, cores),
the shard list and the address the client makes of it are checked on their own."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from live import wait_until

from stella import Client, Connection, StellaOptimizer
from stella.errors import LayoutConflict, ProtocolError
from stella.layout import FlatLayout
from stella.shards import ShardedClient, connect, resolve_address
from stella_ps import health
from stella_ps.config import ConfigError, parse_args
from stella_ps.process import ServerStartError, free_port
from stella_ps.shardlist import ShardList, read_addresses
from stella_ps.supervisor import JOB_FILE, Supervisor, advertised, plan, shard_count

TORCH_SEED = 0



def _free_pair() -> int:
    """A port free with the next one (the shards' metrics go on the port + I)."""
    import socket

    for _ in range(64):
        p = free_port()
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError("no two consecutive free ports")

def _model() -> torch.nn.Module:
    torch.manual_seed(TORCH_SEED)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4))


def _batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    x = torch.randn(64, 32, generator=g)
    return x, (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0).long()


def _train(opt: StellaOptimizer, model: torch.nn.Module, steps: range) -> float:
    loss = torch.tensor(0.0)
    for t in steps:
        x, y = _batch(t)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    return float(loss.detach())


def _optimizer(model: torch.nn.Module, address: str, timeout: float = 30.0) -> StellaOptimizer:
    return StellaOptimizer(model, address, mode="gradient", optimizer={"name": "sgd", "lr": 0.1},
                           connection=Connection(timeout=timeout))


def _shard_pids(srv) -> dict[str, int]:
    """Each shard's pid now, from the supervisor's "shard started" log lines."""
    pids = {}
    for line in srv.logs().splitlines():
        if line.startswith("{") and '"shard started"' in line:
            rec = json.loads(line)
            pids[rec["shard"]] = rec["pid"]
    return pids


def _broadcast_model(address: str, model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The shards' broadcast models laid end to end, as a new worker's snapshot gets them."""
    init = {n: p.detach().numpy().copy() for n, p in _model().named_parameters()}
    with connect(address, timeout=30) as probe:
        assert isinstance(probe, ShardedClient)
        probe.register(init)
        snap = probe.pull(None)
        out = {k: v.copy() for k, v in init.items()}
        snap.apply_to(out)
    return out


# --------------------------------------------------------------------------- one command, one address
def test_one_address_trains_through_both_shards_and_the_replica_is_their_broadcast_model(make_server, capsys):
    from stella.cli import main as stella_main

    metrics = _free_pair()
    srv = make_server(1, ["--shards", "2", "--metrics", f"127.0.0.1:{metrics}"])
    model = _model()
    opt = _optimizer(model, srv.endpoint)  # the first shard's address, nothing else
    try:
        opt.start()
        assert isinstance(opt.client, ShardedClient) and len(opt.client.shards) == 2
        assert [c.shard for c in opt.client.shards] == ["0/2", "1/2"]
        first = _train(opt, model, range(0, 3))
        last = _train(opt, model, range(3, 30))
        opt.synchronize()
        version = opt.pull_latest()
        replica = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
        statuses = opt.client.status()
    finally:
        opt.close(flush=False)  # the residual stays unsent: the model stays the replica's
    assert version >= 29 and last < first
    assert [s.shard for s in statuses] == ["0/2", "1/2"]
    assert all(s.shards == statuses[0].shards and len(s.shards) == 2 for s in statuses)
    flat = FlatLayout.of(list(_model().parameters()), statuses[0].dense_below)
    assert [s.numel for s in statuses] == [b - a for a, b in flat.shard_ranges(2)]  # each holds its range
    model_now = _broadcast_model(srv.endpoint, model)
    for name, values in replica.items():
        assert np.array_equal(values, model_now[name]), name  # bit for bit
    assert any(not np.array_equal(model_now[n], p.detach().numpy()) for n, p in _model().named_parameters())

    # `stella status` of the one address: the whole job, a line per shard
    assert stella_main(["status", srv.endpoint]) == 0
    text = capsys.readouterr().out.splitlines()
    addresses = opt.client.addresses
    assert "| 2 shards |" in text[0]
    assert text[1].startswith(f"  shard 0/2 {addresses[0]} | version ")
    assert text[2].startswith(f"  shard 1/2 {addresses[1]} | version ")
    assert stella_main(["status", srv.endpoint, "--json"]) == 0
    assert [s["shard"] for s in json.loads(capsys.readouterr().out)["shards"]] == ["0/2", "1/2"]
    # the metrics: one endpoint a shard, on the port + I; the health check asks both
    assert health.main(["--url", f"http://127.0.0.1:{metrics}/healthz"]) == 0
    bodies = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [b["shard"] for b in bodies] == ["0/2", "1/2"]


def test_a_killed_shard_is_started_again_from_its_checkpoint_and_training_goes_on(make_server, tmp_path):
    ck = tmp_path / "ck"
    srv = make_server(1, ["--shards", "2", "--checkpoint-dir", str(ck), "--checkpoint-every-steps", "5",
                          "--liveness-timeout", "2"])
    model = _model()
    opt = _optimizer(model, srv.endpoint, timeout=5.0)
    try:
        _train(opt, model, range(0, 12))
        pids = _shard_pids(srv)
        wait_until(lambda: any(n.endswith(".stella-ckpt") for n in os.listdir(ck / "1")), 30, "shard 1's checkpoint")
        os.kill(pids["1/2"], signal.SIGKILL)
        wait_until(lambda: _shard_pids(srv)["1/2"] != pids["1/2"], 30, "shard 1 started again")
        _train(opt, model, range(12, 30))
        opt.synchronize()
        version = opt.pull_latest()
        reconnects = opt.client.reconnects
        statuses = opt.client.status()
    finally:
        opt.close(flush=False)
    assert version >= 20 and reconnects >= 1
    assert _shard_pids(srv)["0/2"] == pids["0/2"]  # shard 0 never stopped
    logs = srv.logs()
    assert '"shard exited: starting it again"' in logs
    resumed = [json.loads(x) for x in logs.splitlines() if x.startswith("{") and '"resumed from checkpoint"' in x]
    assert [r["shard"] for r in resumed] == ["1/2"]
    assert statuses[1].uptime_s < statuses[0].uptime_s
    assert srv.close() == 0  # a shard that was restarted and ran on is not a failed job


def test_sigterm_stops_every_shard_with_its_last_checkpoint_and_a_restart_resumes_them(make_server, tmp_path):
    ck = tmp_path / "ck"
    args = ["--shards", "2", "--checkpoint-dir", str(ck), "--checkpoint-every-s", "0"]
    srv = make_server(1, args)
    model = _model()
    opt = _optimizer(model, srv.endpoint)
    try:
        _train(opt, model, range(8))
    finally:
        opt.close()
    with connect(srv.endpoint, timeout=30, join=False) as c:
        versions = [s.version for s in c.status()]
    assert min(versions) >= 7
    assert srv.close() == 0  # SIGTERM: every shard stopped cleanly
    assert json.loads((ck / JOB_FILE).read_text()) == {"shards": 2}
    for i in range(2):
        files = sorted(n for n in os.listdir(ck / str(i)) if n.endswith(".stella-ckpt"))
        assert files and int(files[-1].split("-")[1]) == versions[i], files  # the version it stopped at
    again = make_server(1, ["--shards", "auto", "--checkpoint-dir", str(ck)])  # auto: the job's own count
    with connect(again.endpoint, timeout=30, join=False) as c:
        assert [s.version for s in c.status()] == versions
    assert '"resumed from checkpoint"' in again.logs()


def test_the_supervisor_fails_when_a_shard_cannot_start(make_server):
    taken = socket.socket()
    for _ in range(20):  # a free port whose successor is free too (another test's server may hold it)
        port = free_port()
        try:
            taken.bind(("127.0.0.1", port + 1))
            break
        except OSError:
            continue
    with taken:  # shard 1's port (port + 1) is somebody else's
        taken.listen()
        with pytest.raises(ServerStartError) as e:
            make_server(1, ["--shards", "2"], bind=f"tcp://127.0.0.1:{port}", timeout=60)
    assert e.value.returncode == 1 and "before it listened" in e.value.log


def test_one_shard_of_a_job_that_does_not_list_the_others_is_refused(make_server):
    srv = make_server(1, ["--shard", "0/2"])
    with pytest.raises(ProtocolError, match=r"shard 0/2 .* does not list the others"):
        connect(srv.endpoint, timeout=10)
    # a plain Client given the one address would register the whole model with the first shard: refused
    with Client(srv.endpoint, timeout=10) as c, pytest.raises(LayoutConflict, match=r"shard 0/2 .* stella.shards"):
        c.register({"w": np.zeros(100_000, np.float32)})


# --------------------------------------------------------------------------- the parts
def _cfg(*args: str):
    return parse_args(["--insecure", *args], {})


def test_the_plan_gives_each_shard_its_port_metrics_directory_threads_and_cores():
    cfg = _cfg("--shards", "4", "--bind", "tcp://0.0.0.0:5555", "--metrics", "0.0.0.0:9100",
               "--checkpoint-dir", "/ck")
    plans = plan(cfg, 4, list(range(16)))
    assert [p.bind for p in plans] == [f"tcp://0.0.0.0:{5555 + i}" for i in range(4)]
    assert [p.metrics for p in plans] == [f"0.0.0.0:{9100 + i}" for i in range(4)]
    assert [p.checkpoint_dir for p in plans] == [f"/ck/{i}" for i in range(4)]
    assert [p.cpus for p in plans] == [tuple(range(4 * i, 4 * i + 4)) for i in range(4)]
    assert [p.threads for p in plans] == [4] * 4 and [p.label for p in plans] == ["0/4", "1/4", "2/4", "3/4"]
    uneven = plan(_cfg("--shards", "3"), 3, [0, 1, 2, 3, 4, 5, 6])
    assert [p.cpus for p in uneven] == [(0, 1, 2), (3, 4), (5, 6)] and [p.threads for p in uneven] == [3, 2, 2]
    assert [p.threads for p in plan(_cfg("--shards", "2", "--threads", "6"), 2, range(16))] == [3, 3]
    crowded = plan(_cfg("--shards", "4"), 4, [0, 1])  # more shards than cores: they share them
    assert all(p.cpus is None and p.threads == 1 for p in crowded)
    assert all(p.cpus is None for p in plan(_cfg("--shards", "2", "--no-pin-shards"), 2, range(8)))
    picked = plan(_cfg("--shards", "2", "--bind", "tcp://127.0.0.1:0", "--metrics", "127.0.0.1:0"), 2, [0, 1])
    assert [(p.bind, p.metrics, p.checkpoint_dir) for p in picked] == [("tcp://127.0.0.1:0", "127.0.0.1:0", None)] * 2
    with pytest.raises(ConfigError, match="65535"):
        plan(_cfg("--shards", "4", "--bind", "tcp://*:65534"), 4, range(4))


def test_auto_is_a_shard_a_core_or_the_count_of_the_job_in_the_checkpoint_directory(tmp_path):
    assert shard_count(_cfg("--shards", "auto"), 48)[0] == 48
    (tmp_path / JOB_FILE).write_text('{"shards": 2}\n')
    auto = _cfg("--shards", "auto", "--checkpoint-dir", str(tmp_path))
    assert shard_count(auto, 48) == (2, f"auto: the job in {tmp_path} has 2 shards")
    assert shard_count(_cfg("--shards", "2", "--checkpoint-dir", str(tmp_path)), 48)[0] == 2
    with pytest.raises(ConfigError, match="a job of 2 shards: --shards 2 resumes it"):
        shard_count(_cfg("--shards", "3", "--checkpoint-dir", str(tmp_path)), 48)
    single = tmp_path / "single"
    single.mkdir()
    (single / "ckpt-000000000000010-000001.stella-ckpt").write_bytes(b"")
    with pytest.raises(ConfigError, match="a single server's checkpoints"):
        Supervisor(_cfg("--shards", "2", "--checkpoint-dir", str(single)), [], shard_stop_s=10)


def test_the_settings_of_shards_are_checked():
    for argv in (["--shards", "0"], ["--shards", "two"], ["--shards", "2", "--shard", "0/2"],
                 ["--shards", "2", "--shard-list", "/x"], ["--shards", "2", "--bind", "ipc:///tmp/ps"]):
        with pytest.raises(SystemExit):
            _cfg(*argv)
    assert _cfg("--shards", "AUTO").shards.count == "auto"
    assert parse_args([], {"STELLA_PS_INSECURE": "1", "STELLA_PS_SHARDS": "4"}).shards.count == "4"


def test_the_shard_list_and_the_addresses_a_client_makes_of_it(tmp_path):
    assert advertised("tcp://0.0.0.0:5556", None) == "tcp://*:5556"
    assert advertised("tcp://0.0.0.0:5556", "ps.example.org") == "tcp://ps.example.org:5556"
    assert advertised("tcp://[::]:5556", "fd00::5") == "tcp://[fd00::5]:5556"
    assert resolve_address("tcp://*:5556", "tcp://ps.example.org:5555") == "tcp://ps.example.org:5556"
    assert resolve_address("tcp://*:5556", "tcp://[::1]:5555") == "tcp://[::1]:5556"
    assert resolve_address("tcp://10.0.0.5:5556", "tcp://ps.example.org:5555") == "tcp://10.0.0.5:5556"
    assert read_addresses("# the job\ntcp://*:5555\n\ntcp://b:5556  # shard 1\n") == ["tcp://*:5555", "tcp://b:5556"]
    for bad in ("ps:5555", "tcp://ps", "tcp://ps:http", "tcp://ps:70000"):
        with pytest.raises(ValueError, match="line 1"):
            read_addresses(bad)
    path = tmp_path / "shards"
    listed = ShardList(str(path), "0/2")
    assert listed.addresses() == []  # not written yet
    path.write_text("tcp://*:5555\ntcp://*:5556\n")
    assert listed.addresses() == ["tcp://*:5555", "tcp://*:5556"]
    path.write_text("tcp://*:5555\n")  # not the two its label says: not handed out
    assert listed.addresses() == []
    assert ShardList(None).addresses() == []


def test_the_supervisor_imports_neither_numpy_nor_zmq():
    code = ("import sys, stella_ps.supervisor, stella_ps.daemon; "
            "print(sorted(m for m in ('numpy', 'zmq', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
