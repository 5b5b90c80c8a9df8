"""Membership and synchronous step aggregation.

A step closes when every live worker has a pending push (or, with a step deadline,
when the deadline after the step's first push passes). Each closed step takes at
most one push per worker, oldest first; a push that missed its step stays queued
and is folded into the next one, never dropped. Pushes of a worker that left
still count. The first step waits until ``expected`` workers have joined once.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

__all__ = ["PendingPush", "Aggregator", "WorkerInfo"]


@dataclass
class PendingPush:
    worker: int
    version: int  # model version the gradient was computed on
    # (tensor index, sorted int32 indices or None for dense, float32 values)
    tensors: list[tuple[int, np.ndarray | None, np.ndarray]]
    nbytes: int = 0


@dataclass
class WorkerInfo:
    worker: int
    routing_id: bytes
    name: str = ""
    registered: bool = False
    pushes: int = 0


@dataclass
class Aggregator:
    expected: int = 1
    live: dict[int, WorkerInfo] = field(default_factory=dict)
    pending: dict[int, deque[PendingPush]] = field(default_factory=dict)
    started: bool = False
    _next_id: int = 0

    def join(self, routing_id: bytes, want: int | None, name: str = "") -> WorkerInfo:
        """Add a worker; ``want`` asks for a specific id (a restarted worker). Raises ValueError."""
        if want is not None:
            if want < 0 or want > 2**31:
                raise ValueError(f"worker id {want} out of range")
            cur = self.live.get(want)
            if cur is not None:
                if cur.routing_id != routing_id:
                    raise ValueError(f"worker id {want} is in use by another live connection")
                return cur
            wid = want
        else:
            while self._next_id in self.live or self._next_id in self.pending:
                self._next_id += 1
            wid = self._next_id
        self._next_id = max(self._next_id, wid + 1)
        info = WorkerInfo(wid, routing_id, name)
        self.live[wid] = info
        if len(self.live) >= self.expected:
            self.started = True
        return info

    def leave(self, worker: int) -> None:
        self.live.pop(worker, None)

    def add(self, push: PendingPush) -> int:
        """Queue a push; returns how many of this worker's pushes were already waiting."""
        q = self.pending.setdefault(push.worker, deque())
        q.append(push)
        return len(q) - 1

    def pending_count(self) -> int:
        return sum(len(q) for q in self.pending.values())

    def has_pending(self) -> bool:
        return any(self.pending.values())

    def ready(self) -> bool:
        """Does the open step have every live worker's push?"""
        if not self.started or not self.has_pending():
            return False
        return all(self.pending.get(w) for w in self.live)

    def take_step(self) -> list[PendingPush]:
        """Remove and return the open step's pushes: the oldest pending push of each worker."""
        out = []
        for w in sorted(self.pending):
            q = self.pending[w]
            if q:
                out.append(q.popleft())
            if not q and w not in self.live:
                del self.pending[w]
        return out
