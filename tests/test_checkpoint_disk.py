"""A checkpoint write that fails (issue 45, "the disk"): the disk is full (ENOSPC, a real
tmpfs of a few MB) or the directory became read-only (EROFS, a read-only bind mount).
A real ``stella-ps`` with a worker training through its socket: the steps go on; the
log, the metrics and ``stella status`` say the write failed and why; the newest valid
checkpoint stays, intact, with no temporary file beside it, and a restarted server
resumes from it; once the disk is writable again the next due checkpoint is written
and the failure is no longer shown. Mounting needs root (and a kernel that lets this
process mount): the tests skip, saying why, where it cannot."""
from __future__ import annotations

import contextlib
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from live import dead_pid, wait_until

from stella import Client
from stella import checkpoint_file as ckfmt
from stella.cli import main as stella_main
from stella_ps.process import ServerProcess, free_port

NUMEL = 100_000  # 4 arrays of 400 kB a checkpoint (SGD momentum, the broadcast's model and residual): 1.6 MB
EVERY = 5  # a checkpoint every 5 steps
SGD = {"name": "sgd", "lr": 0.01, "momentum": 0.9}


def _mount(*args: str) -> None:
    r = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise OSError(f"mount {' '.join(args)}: {r.stderr.strip() or r.returncode}")


def _umount(directory: Path) -> None:
    if subprocess.run(["umount", str(directory)], capture_output=True, timeout=30).returncode != 0:
        # busy (a failed test left its server writing there): detach it now, freed once unused
        subprocess.run(["umount", "-l", str(directory)], capture_output=True, timeout=30, check=True)


@contextlib.contextmanager
def tmpfs(directory: Path, size: str) -> Iterator[None]:
    """A tmpfs of ``size`` on ``directory`` for the block (skips the test where it cannot be mounted)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    directory.mkdir(exist_ok=True)
    try:
        _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory))
    except OSError as e:
        pytest.skip(f"cannot mount a tmpfs here: {e}")
    try:
        yield
    finally:
        _umount(directory)


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[None]:
    """``directory`` read-only for the block: a read-only bind mount of it on itself (chmod
    does not stop root). Skips the test where it cannot be mounted."""
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root (chmod 0555 does not stop root)")
    try:
        _mount("--bind", str(directory), str(directory))
    except OSError as e:
        pytest.skip(f"cannot bind-mount here: {e}")
    try:
        try:
            _mount("-o", "remount,bind,ro", str(directory))
        except OSError as e:
            pytest.skip(f"cannot remount a bind mount read-only here: {e}")
        yield
    finally:
        _umount(directory)


def train(c: Client, v: int, to: int) -> int:
    """A worker's steps through the real socket: push a gradient, pull the next version, until ``to``."""
    rng = np.random.default_rng(v)
    while v < to:
        c.push({"w": rng.standard_normal(NUMEL).astype(np.float32)}, v)
        v = c.pull(v, wait_for=v + 1).version
    return v


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise KeyError(name)


def status_text(endpoint: str, capsys: pytest.CaptureFixture[str]) -> str:
    """What ``stella status ADDRESS`` prints."""
    capsys.readouterr()
    assert stella_main(["status", endpoint]) == 0
    return capsys.readouterr().out


def start(make_server, ckdir: Path, port: int) -> ServerProcess:
    return make_server(1, ["--checkpoint-dir", str(ckdir), "--checkpoint-every-steps", str(EVERY),
                           "--checkpoint-every-s", "0", "--checkpoint-keep", "2", "--metrics", f"127.0.0.1:{port}"])


def failures_reach(c: Client, n: int) -> None:
    wait_until(lambda: c.status().checkpoint_failures >= n, 20, f"{n} failed checkpoint writes")


def checkpoints_of(ckdir: Path) -> dict[str, int]:
    """The checkpoint files, each read back whole (every checksum), by name: their versions."""
    return {n: ckfmt.read(str(ckdir / n)).version for n in ckfmt.names(str(ckdir))}


def assert_failing(c: Client, port: int, srv: ServerProcess, capsys, *, reason: str, failed: int, kept: int) -> None:
    """Status, metrics, ``stella status`` and the log all say the writes fail, and why."""
    st = c.status()
    assert st.checkpoint_error is not None and st.checkpoint_error.startswith(reason + ":"), st.checkpoint_error
    assert st.checkpoint_failures == failed and st.checkpoint_version == kept
    assert metric(port, "stella_checkpoint_failures_total") == failed
    assert metric(port, "stella_checkpoint_failing") == 1
    text = status_text(srv.endpoint, capsys)
    assert f"CHECKPOINT FAILING: {reason}:" in text and f"{failed} failed, version {kept} kept" in text, text
    logs = srv.logs()
    assert "checkpoint write failed; training goes on; the newest valid checkpoint is kept" in logs
    assert reason in logs


def assert_clear(c: Client, port: int, srv: ServerProcess, capsys, *, version: int, failed: int) -> None:
    st = c.status()
    assert st.checkpoint_error is None and st.checkpoint_failures == failed and st.checkpoint_version == version
    assert metric(port, "stella_checkpoint_failing") == 0
    assert metric(port, "stella_checkpoint_failures_total") == failed
    assert "CHECKPOINT FAILING" not in status_text(srv.endpoint, capsys)
    assert "checkpoint writes work again" in srv.logs()


def test_a_full_disk_fails_checkpoints_while_training_goes_on(make_server, make_client, tmp_path, capsys):
    ckdir, port = tmp_path / "ck", free_port()
    with tmpfs(ckdir, "8m"):
        srv = start(make_server, ckdir, port)
        try:
            c = make_client(srv.endpoint)
            c.register({"w": np.zeros(NUMEL, np.float32)}, SGD)
            v = 0
            for n in (1, 2):  # two checkpoints, as many as --checkpoint-keep 2 keeps
                v = train(c, v, n * EVERY)
                wait_until(lambda v=v: c.status().checkpoint_version == v, 20, f"the checkpoint of version {v}")
            kept = checkpoints_of(ckdir)
            assert sorted(kept.values()) == [EVERY, 2 * EVERY]
            # fill the disk but for half a checkpoint: the next write starts, runs out of space part way
            fs = os.statvfs(ckdir)
            filler = ckdir / "filler"
            filler.write_bytes(b"\0" * (fs.f_bavail * fs.f_frsize - (ckdir / min(kept)).stat().st_size // 2))
            for n in (1, 2):  # the checkpoints of versions 15 and 20 fail; the steps go on
                v = train(c, v, v + EVERY)
                failures_reach(c, n)
            assert c.status().version == v == 4 * EVERY
            assert_failing(c, port, srv, capsys, reason="ENOSPC", failed=2, kept=2 * EVERY)
            assert metric(port, "stella_checkpoints_total") == 2
            # nothing was pruned for the writes that failed, both checkpoints read back whole, and no partial
            # temporary file is left
            assert checkpoints_of(ckdir) == kept
            assert sorted(os.listdir(ckdir)) == sorted([*kept, "filler"])
            filler.unlink()  # space again: the next due checkpoint is written, and the failure is no longer shown
            v = train(c, v, v + EVERY)
            wait_until(lambda: c.status().checkpoint_version == v, 20, "a checkpoint once space is free")
            assert_clear(c, port, srv, capsys, version=v, failed=2)
            assert sorted(checkpoints_of(ckdir).values()) == [2 * EVERY, v]  # and only now the oldest is pruned
            c.close()
        finally:
            srv.close()  # before the tmpfs goes
    assert srv.returncode == 0


def test_a_read_only_directory_fails_checkpoints_and_a_restart_resumes_from_the_newest(make_server, make_client,
                                                                                       tmp_path, capsys):
    ckdir, port = tmp_path / "ck", free_port()
    ckdir.mkdir()
    srv = start(make_server, ckdir, port)
    c = make_client(srv.endpoint)
    c.register({"w": np.zeros(NUMEL, np.float32)}, SGD)
    v = train(c, 0, EVERY)
    wait_until(lambda: c.status().checkpoint_version == EVERY, 20, "the first checkpoint")
    (first, _), = checkpoints_of(ckdir).items()
    # a write a crash interrupted, not this server's: its writer is gone
    crashed = ckfmt.temporary_name(ckfmt.file_name(4, 1), pid=dead_pid())
    (ckdir / crashed).write_bytes(b"partial")
    with read_only(ckdir):  # no write is in progress: the steps wait for this test
        v = train(c, v, 2 * EVERY)
        failures_reach(c, 1)
        assert c.status().version == v
        assert_failing(c, port, srv, capsys, reason="EROFS", failed=1, kept=EVERY)
        c.close()
        # the last checkpoint on SIGTERM fails too; said so, and the server still stops cleanly
        assert srv.close() == 0
        assert "final checkpoint failed; the newest valid checkpoint is kept" in srv.logs()
        assert checkpoints_of(ckdir) == {first: EVERY} and sorted(os.listdir(ckdir)) == sorted([first, crashed])
        # a restart on the read-only directory resumes from the newest valid checkpoint (the crashed write's
        # temporary file, which it cannot delete now, in its way or not)
        srv = start(make_server, ckdir, port)
        c = make_client(srv.endpoint)
        reg = c.register({"w": np.zeros(NUMEL, np.float32)}, SGD)
        assert not reg.created and reg.version == EVERY
        v = train(c, EVERY, 2 * EVERY)  # and trains on, failing its checkpoints
        failures_reach(c, 1)
        assert_failing(c, port, srv, capsys, reason="EROFS", failed=1, kept=EVERY)
    v = train(c, v, 3 * EVERY)  # writable again: the next due checkpoint is written
    wait_until(lambda: c.status().checkpoint_version == v, 20, "a checkpoint once the directory is writable")
    assert_clear(c, port, srv, capsys, version=v, failed=1)
    assert sorted(checkpoints_of(ckdir).values()) == [EVERY, v]
    assert "temporary checkpoint file not deleted" in srv.logs()
