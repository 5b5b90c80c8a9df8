"""Fixtures: real stella-ps processes on ephemeral loopback ports, always reaped,
and clients / raw sockets that are always closed."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest
import zmq

from stella import Client

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ServerProc:
    def __init__(self, workers: int = 1, extra: list[str] | None = None):
        fd, self.ready = tempfile.mkstemp(prefix="stella-ps-test-", suffix=".addr")
        os.close(fd)
        os.unlink(self.ready)
        self.log = tempfile.NamedTemporaryFile(prefix="stella-ps-test-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "stella_ps", "--bind", "tcp://127.0.0.1:0", "--workers", str(workers),
               "--ready-file", self.ready, "--log-level", "DEBUG", *(extra or [])]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, cwd=ROOT)
        deadline = time.monotonic() + 30
        while not os.path.exists(self.ready):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"stella-ps failed to start:\n{self.logs()}")
            time.sleep(0.02)
        with open(self.ready) as f:
            self.endpoint = f.read().strip()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def logs(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def stop(self, sig: str = "terminate") -> int:
        if self.proc.poll() is None:
            getattr(self.proc, sig)()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for p in (self.ready,):
            if os.path.exists(p):
                os.unlink(p)
        return self.proc.returncode


@pytest.fixture
def make_server():
    servers: list[ServerProc] = []

    def make(workers: int = 1, extra: list[str] | None = None) -> ServerProc:
        s = ServerProc(workers, extra)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.stop()
        os.unlink(s.log.name)


@pytest.fixture
def server(make_server) -> ServerProc:
    return make_server(1)


@pytest.fixture
def make_client():
    clients: list[Client] = []

    def make(endpoint: str, **kw) -> Client:
        kw.setdefault("timeout", 10.0)
        c = Client(endpoint, **kw)
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close(timeout=1.0)


@pytest.fixture
def raw_socket():
    """A bare DEALER socket for sending hand-made (bad) messages."""
    ctx = zmq.Context.instance()
    socks: list[zmq.Socket] = []

    def make(endpoint: str) -> zmq.Socket:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 10000)
        s.connect(endpoint)
        socks.append(s)
        return s

    yield make
    for s in socks:
        s.close(linger=0)
