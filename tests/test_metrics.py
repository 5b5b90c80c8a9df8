"""The Prometheus endpoint and /healthz against a real server (in this process, and one
``stella-ps --metrics`` daemon with its container health check), the workers' reports
riding on their pushes, and ``stella status``'s table."""
from __future__ import annotations

import asyncio
import io
import json
import math
import os
import re
import socket
import urllib.request

import msgspec
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server_inprocess import InProcessServer

from stella import Client, VersionError
from stella.cli import main as stella_main
from stella.protocol import StatusReply, WorkerReport, WorkerStatus
from stella.status import rates, render, watch
from stella_ps import health
from stella_ps.config import parse_bind
from stella_ps.errors import ConfigError
from stella_ps.kernel import native_isa
from stella_ps.metrics import MetricsServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def inproc(curve_keys):
    s = InProcessServer(curve_keys)
    yield s
    s.close()


def scrape(url: str) -> dict[str, list]:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = fam.samples
    return out


def value(fams: dict[str, list], series: str, **labels: str) -> float:
    for fam in fams.values():
        for s in fam:
            if s.name == series and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(f"{series} {labels} not in the scrape")


def test_parse_bind():
    assert parse_bind("0.0.0.0:9100") == ("0.0.0.0", 9100)
    assert parse_bind(":9100") == ("0.0.0.0", 9100)
    assert parse_bind("9100") == ("0.0.0.0", 9100)
    assert parse_bind("127.0.0.1:0") == ("127.0.0.1", 0)
    with pytest.raises(ConfigError, match="HOST:PORT"):
        parse_bind("localhost:http")


def test_metrics_in_process_show_the_whole_job(inproc):
    srv = inproc
    metrics = MetricsServer(srv.server.service.snapshot, "127.0.0.1:0")
    addr = asyncio.run_coroutine_threadsafe(metrics.start(), srv.loop).result(10)
    base = f"http://{addr}"
    try:
        with Client(srv.endpoint, timeout=10, name="site-a") as c:
            c.register({"w": np.zeros(8, np.float32)}, {"name": "sgd", "lr": 1.0})
            rep = WorkerReport(step=7, compute_s=0.05, exchange_s=0.02, wait_s=0.01, density=0.25,
                               bytes_pushed=123, bytes_pulled=456, value_dtype="q4", local_steps=3, accumulate=1,
                               up_bps=12.5e6, down_bps=25e6, max_density=0.5)
            c.push({"w": (np.array([1, 3], np.int32), np.array([1.0, 2.0], np.float32))}, 0, report=rep)
            c.pull(0, wait_for=1)
            with pytest.raises(VersionError):  # a refused request shows under its code
                c.pull(10**6)
            st = c.status()
            fams = scrape(base + "/metrics")
            w = str(c.worker_id)
            with urllib.request.urlopen(base + "/healthz", timeout=10) as r:
                healthz = json.loads(r.read())
    finally:
        asyncio.run_coroutine_threadsafe(metrics.close(), srv.loop).result(10)
    assert value(fams, "stella_info", version="0.1.0") == 1
    assert value(fams, "stella_info", shard="") == 1  # not a shard of a sharded job
    assert value(fams, "stella_info", native_isa=native_isa().level) == 1  # the C kernel's x86-64 level
    assert value(fams, "stella_model_version") == 1
    assert value(fams, "stella_live_workers") == 1
    assert value(fams, "stella_steps_total") == 1
    assert value(fams, "stella_step_apply_seconds_count") == 1
    assert value(fams, "stella_straggler_wait_seconds_count") == 1
    assert value(fams, "stella_pushes_total", worker=w, name="site-a") == 1
    assert value(fams, "stella_pulls_total", worker=w, name="site-a") >= 1
    assert value(fams, "stella_worker_density", worker=w) == 0.25
    assert value(fams, "stella_worker_max_density", worker=w) == 0.5  # the controller's cap
    assert value(fams, "stella_worker_compute_seconds", worker=w) == pytest.approx(0.05)
    assert value(fams, "stella_worker_exchange_seconds", worker=w) == pytest.approx(0.02)
    assert value(fams, "stella_worker_wait_seconds", worker=w) == pytest.approx(0.01)
    assert value(fams, "stella_worker_steps", worker=w) == 7
    assert value(fams, "stella_bytes_received_total") > 0 and value(fams, "stella_bytes_sent_total") > 0
    assert value(fams, "stella_errors_total", code="version") == 1
    assert math.isnan(value(fams, "stella_checkpoint_age_seconds"))  # no checkpoints yet (issue 11)
    assert value(fams, "stella_late_pushes_total") == 0
    assert healthz["status"] == "ok" and healthz["version"] == 1
    # the status reply carries the same: per worker, with the report its push carried
    (live,) = st.live
    assert live.name == "site-a" and live.pushes == 1 and live.report.density == 0.25
    assert st.checkpoint_age_s is None and st.server_version == "0.1.0"
    table = render(st, rates(st, None, None), srv.endpoint)
    assert "version 1" in table and "checkpoint none" in table
    row = next(line for line in table.splitlines() if "site-a" in line)
    assert "25.00% (max 50.00%)" in row and "0.060" in row and "17" in row  # density (its cap), s/it, wait %
    # what the worker's controller chose and measured: coding, H, batch, Mbit/s up and down
    assert " q4 " in row and " 3 " in row and " 100 " in row and " 200" in row
    assert value(fams, "stella_worker_value_bits", worker=w, name="site-a") == 4.5
    assert value(fams, "stella_worker_local_steps", worker=w, name="site-a") == 3
    assert value(fams, "stella_worker_uplink_bytes_per_second", worker=w, name="site-a") == 12.5e6
    # every series the Grafana dashboard queries is one the server exports
    with open(os.path.join(ROOT, "docker", "grafana-dashboard.json")) as f:
        exprs = re.findall(r'"expr":\s*"([^"]*)"', f.read())
    queried = {m for e in exprs for m in re.findall(r"\bstella_[a-z0-9_]+", e)}
    exported = {smp.name for fam in fams.values() for smp in fam}
    assert len(exprs) >= 10 and queried and not queried - exported, sorted(queried - exported)


def test_status_table_watch_and_json():
    st = StatusReply(version=3, workers=[0], expected_workers=2, worker_keys={0: "ab12"}, insecure=False,
                     steps=10, bytes_in=4000, bytes_out=8000, uptime_s=5.0, optimizer={"name": "adamw"},
                     server_version="0.1.0", checkpoint_age_s=30.0,
                     live=[WorkerStatus(worker=0, name="w0", key_fingerprint="ab12", last_seen_s=0.2, pushes=3,
                                        pulls=3, report=None)],
                     initialised=True, pending_pushes=0, pushes=3, pulls=3, late_pushes=0, messages=6, errors=0,
                     numel=8, tensors=1)
    out = io.StringIO()
    seq = iter([st, msgspec.structs.replace(st, steps=14, bytes_in=6000)])
    assert watch(lambda: next(seq), interval=0.01, count=2, out=out) == 0
    first, second = out.getvalue().split("stella-ps ")[1:]
    assert "| 2.00 steps/s" in first and "checkpoint 30s ago" in first and "w0" in first
    # the second is over the refresh ("| 2.00", not "2.00": a rate of 392.00 ends in it)
    assert "steps/s" in second and "| 2.00 steps/s" not in second
    out = io.StringIO()
    watch(lambda: st, as_json=True, out=out)
    assert json.loads(out.getvalue())["rates"]["steps"] == 2.0


def test_status_cli_against_a_daemon_with_metrics_and_its_health_check(make_server, capsys, monkeypatch):
    with socket.socket() as s:  # a free port for the metrics endpoint
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = make_server(1, ["--metrics", f"127.0.0.1:{port}"], log_level="WARNING")
    assert stella_main(["status", srv.endpoint]) == 0
    out = capsys.readouterr().out
    assert "version 0" in out and "(no live workers)" in out
    assert stella_main(["status", srv.endpoint, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["version"] == 0
    assert health.main(["--url", f"http://127.0.0.1:{port}/healthz"]) == 0
    assert health.health_url(f"0.0.0.0:{port}") == f"http://127.0.0.1:{port}/healthz"
    assert value(scrape(f"http://127.0.0.1:{port}/metrics"), "stella_live_workers") == 0
    srv.close()
    assert health.main(["--url", f"http://127.0.0.1:{port}/healthz", "--timeout", "1"]) == 1
    monkeypatch.delenv("STELLA_PS_METRICS", raising=False)
    assert health.main([]) == 1  # no --url and no STELLA_PS_METRICS: says so, unhealthy


def test_status_cli_names_an_unreachable_server(capsys):
    assert stella_main(["status", "tcp://127.0.0.1:9", "--timeout", "0.3"]) == 1
    assert "stella status:" in capsys.readouterr().err


def test_optimizer_reports_its_timings_and_logs_progress(inproc, caplog):
    import logging

    import torch

    from stella import Compression, Connection, StellaOptimizer
    from stella.progress import LOGGER

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    caplog.set_level(logging.INFO, logger=LOGGER)
    opt = StellaOptimizer(model, inproc.endpoint, mode="gradient", optimizer={"name": "sgd", "lr": 0.1},
                          progress_every=2, compression=Compression(density=0.5),
                          connection=Connection(timeout=10, name="reporter"))
    try:
        for _ in range(5):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
        opt.synchronize()
        report = opt.rounds.progress.report()
        with Client(inproc.endpoint, timeout=10, join=False) as c:
            (live,) = c.status().live
    finally:
        opt.close()
    assert report is not None and report.step == 5 and report.density == 0.5
    assert report.max_density == 0.5  # a pinned density: no ladder, the cap is the density
    assert live.name == "reporter" and live.report is not None and live.report.step >= 2
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert [line.split(" |")[0] for line in lines] == ["stella step 2", "stella step 4"]
    assert all("s/it" in line and "wait" in line and "density 50.00%" in line for line in lines)


def test_no_progress_lines_by_default(inproc, caplog):
    import logging

    import torch

    from stella import Compression, Connection, StellaOptimizer
    from stella.progress import LOGGER, Progress

    with pytest.raises(ValueError):
        Progress(-1)
    caplog.set_level(logging.INFO, logger=LOGGER)
    model = torch.nn.Linear(4, 1)
    opt = StellaOptimizer(model, inproc.endpoint, mode="gradient", compression=Compression(density=1.0),
                          connection=Connection(timeout=10))
    try:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    finally:
        opt.close()
    assert not [r for r in caplog.records if r.name == LOGGER]
