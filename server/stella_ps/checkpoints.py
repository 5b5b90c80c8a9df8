"""Checkpoints of the server's model: when they are written, where, how many are
kept, and which one a restarted server resumes from.

The file format (atomic write, checksums) is :mod:`stella.checkpoint`'s. Writing
one costs steps only the copy of the state arrays, made on the store thread
between two steps (:meth:`ModelStore.state_copy`); the file is written and
fsynced on a thread of its own while steps go on. At most one write is in
progress: a checkpoint that falls due meanwhile is written when it finishes (of the
version then current). On start,
:func:`newest_valid` tries the checkpoints newest first: a damaged one is
reported in the log and the next older one is used.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from stella import checkpoint as ckpt_format
from stella.checkpoint import Checkpoint, CheckpointError

__all__ = ["CheckpointPolicy", "newest_valid", "write_and_prune", "Checkpoint", "CheckpointError"]

log = logging.getLogger("stella_ps.checkpoints")


@dataclass
class CheckpointPolicy:
    """When a checkpoint is due: every ``every_steps`` versions and/or every
    ``every_s`` seconds (0 turns either off), counted from the last one written."""

    directory: str
    every_steps: int = 0
    every_s: float = 300.0
    keep: int = 3
    last_version: int = -1  # version of the last checkpoint written or resumed from
    last_time: float = 0.0  # monotonic time it was written (or the server started)
    seq: int = 0  # a counter in file names: two checkpoints of one version never share a name

    def due(self, version: int, now: float | None = None) -> bool:
        if version <= self.last_version:
            return False
        now = time.monotonic() if now is None else now
        by_steps = self.every_steps > 0 and version - max(self.last_version, 0) >= self.every_steps
        by_time = self.every_s > 0 and now - self.last_time >= self.every_s
        return by_steps or by_time


def newest_valid(directory: str) -> tuple[str, Checkpoint] | None:
    """The newest checkpoint of ``directory`` that reads back intact, or None; each
    newer one that does not is logged (and left in place for the operator). Temporary
    files of a write that a crash interrupted are deleted."""
    try:
        for n in os.listdir(directory):
            if n.startswith(".ckpt-") and ".tmp" in n:
                os.unlink(os.path.join(directory, n))
    except FileNotFoundError:
        return None
    for path, got in ckpt_format.iter_valid(directory):
        if isinstance(got, Checkpoint):
            return path, got
        log.error("checkpoint damaged, skipped; trying the previous one", extra={"path": path, "reason": str(got)})
    return None


def write_and_prune(policy: CheckpointPolicy, ckpt: Checkpoint) -> tuple[str, int, float]:
    """Write ``ckpt`` into the policy's directory and delete all but the newest
    ``keep``; returns (path, bytes, seconds). Runs on the writer thread."""
    t0 = time.perf_counter()
    os.makedirs(policy.directory, exist_ok=True)
    policy.seq += 1
    path = os.path.join(policy.directory, ckpt_format.file_name(ckpt.version, policy.seq))
    size = ckpt_format.write(path, ckpt)
    for old in ckpt_format.names(policy.directory)[policy.keep:]:
        try:
            os.unlink(os.path.join(policy.directory, old))
        except FileNotFoundError:
            pass
    return path, size, time.perf_counter() - t0
