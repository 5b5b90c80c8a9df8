"""Helpers of the tests that run real worker processes (``bench.live_worker``) against
real servers: start one, read its JSON log, wait for a condition, reap."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from stella import Client

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIVENESS_S = 1.5
TARGET_ACCURACY = 0.85  # the undisturbed 3-worker run reaches ~0.89 at version 150 (bench.live_worker)


def live_worker(endpoint: str, rank: int, world: int, target: int, log: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "bench.live_worker", endpoint, "--rank", str(rank), "--world",
                             str(world), "--target-version", str(target), "--log", str(log), *extra],
                            cwd=ROOT, stdin=subprocess.DEVNULL)


def log_lines(log: Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def wait_until(cond: Callable[[], bool], timeout: float, what: str, every: float = 0.05) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout:g}s: {what}")
        time.sleep(every)
    return time.monotonic() - t0


def reap(procs: list[subprocess.Popen], timeout: float = 120.0) -> list[int]:
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def version_of(c: Client) -> int:
    return int(c.status().version)
