"""ServerProcess: the one launcher of stella-ps (demo, benchmarks, these fixtures)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from stella import Client
from stella.errors import ServerUnavailable
from stella_ps.process import ServerProcess, ServerStartError


def test_starts_on_an_ephemeral_port_and_answers_status():
    with ServerProcess(workers=2, log_level="DEBUG") as ps:
        assert ps.alive() and ps.returncode is None and ps.pid > 0
        assert ps.endpoint.startswith("tcp://127.0.0.1:") and not ps.endpoint.endswith(":0")
        with Client(ps.endpoint, timeout=10, join=False) as c:
            status = c.status()
        assert status.version == 0 and status.workers == []
        assert "listening on" in ps.logs()


def test_close_is_graceful_idempotent_and_removes_its_files():
    ps = ServerProcess()
    tmp = os.path.dirname(ps._ready)
    assert os.path.isdir(tmp)
    assert ps.close() == 0  # SIGTERM: the daemon shuts down cleanly
    assert ps.close() == 0 and ps.stop() == 0
    assert not ps.alive() and ps.returncode == 0
    assert not os.path.exists(tmp)
    assert '"shutting down"' in ps.logs()  # the log outlives the temp file


def test_args_env_and_cwd_reach_the_server(tmp_path):
    with ServerProcess(1, ["--log-format", "text"], log_level="DEBUG", env={"STELLA_PS_HISTORY": "7"},
                       cwd=tmp_path) as ps:
        with Client(ps.endpoint, timeout=10, join=False) as c:
            c.status()
        assert os.readlink(f"/proc/{ps.pid}/cwd") == str(tmp_path)
        with open(f"/proc/{ps.pid}/environ", "rb") as f:
            assert b"STELLA_PS_HISTORY=7\0" in f.read()
    assert " INFO " in ps.logs() and not ps.logs().lstrip().startswith("{")  # text, not JSON


def test_a_bad_flag_fails_fast_with_the_log_in_the_error():
    t0 = time.monotonic()
    with pytest.raises(ServerStartError, match=r"unrecognized arguments: --no-such-flag") as err:
        ServerProcess(args=["--no-such-flag"], timeout=120)
    assert time.monotonic() - t0 < 60  # the exit is noticed (~0.3 s), not the 120 s start timeout
    assert err.value.returncode == 2 and "usage: stella-ps" in err.value.log


def test_start_timeout_names_the_limit_and_kills_the_process():
    started: list[subprocess.Popen] = []

    def never_listens(argv, **kw):  # a child that never writes the ready-file
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], **kw))
        return started[0]

    with pytest.raises(ServerStartError, match=r"did not listen within 0\.5 s"):
        ServerProcess(timeout=0.5, popen=never_listens)
    assert started[0].poll() is not None  # stopped, not left behind


def test_sigkill_path():
    ps = ServerProcess()
    ps.kill()  # SIGKILL: no graceful shutdown
    assert ps.wait(10) == -signal.SIGKILL
    assert not ps.alive() and ps.returncode == -signal.SIGKILL
    assert ps.close() == -signal.SIGKILL
    assert '"shutting down"' not in ps.logs()


def test_a_stopped_server_is_unavailable_then_still_closes():
    """SIGSTOP: clients time out with ServerUnavailable; close() still ends the process."""
    ps = ServerProcess()
    try:
        ps.kill(signal.SIGSTOP)
        with Client(ps.endpoint, timeout=0.5, join=False) as c, pytest.raises(ServerUnavailable):
            c.status()
    finally:
        rc = ps.close(timeout=5)
        assert rc == 0, ps.logs()[-6000:]  # SIGCONT + SIGTERM: still a clean shutdown (-6 once in CI: its log says why)
    assert not ps.alive()


def test_dropped_without_close_is_reaped_by_the_finalizer():
    ps = ServerProcess()
    pid, tmp = ps.pid, os.path.dirname(ps._ready)
    proc = ps._proc
    del ps
    import gc

    gc.collect()
    assert proc.poll() is not None, f"stella-ps {pid} outlived its ServerProcess"
    assert not os.path.exists(tmp)


def test_process_module_imports_neither_torch_nor_numpy():
    code = "import sys, stella_ps.process; sys.exit(bool({'torch', 'numpy'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def _io_thread_policies(pid: int) -> dict[str, int]:
    """The scheduling policy of each ZeroMQ I/O thread of process ``pid`` (/proc's stat, field 41)."""
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{t}/comm") as f:
            comm = f.read().strip()
        if comm.startswith("ZMQbg/IO"):
            with open(f"/proc/{pid}/task/{t}/stat") as f:
                out[comm] = int(f.read().rsplit(")", 1)[1].split()[38])
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_BATCH and /proc are Linux's")
def test_zeromqs_io_thread_runs_under_sched_batch_unless_told_not_to(make_server, make_client):
    """A woken SCHED_BATCH thread does not preempt the event loop that woke it with a reply
    (bench/RESULTS.md: 27-28 context switches a step fell to 10-11 at 100k parameters, W = 8);
    ``--no-io-batch`` leaves the I/O thread an ordinary one. Either way the server serves."""
    for args, policy in (([], os.SCHED_BATCH), (["--no-io-batch"], os.SCHED_OTHER)):
        srv = make_server(1, args)
        assert make_client(srv.endpoint).status().version == 0
        policies = _io_thread_policies(srv.pid)
        assert policies and set(policies.values()) == {policy}, (args, policies)
