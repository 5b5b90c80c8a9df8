"""Who takes part: worker ids, the connection each belongs to, and whether the job
has started (the expected number of workers joined once)."""
from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field

from stella.errors import ErrorCode, NotRegistered, ServerError
from stella.protocol import WorkerReport

__all__ = ["WorkerInfo", "Membership"]

MAX_WORKER_ID = 2**31 - 1


@dataclass
class WorkerInfo:
    worker: int
    routing_id: bytes  # the ZeroMQ connection the worker joined on
    name: str = ""
    key: str = ""  # the CurveZMQ public key it connected with ("" with --insecure)
    fingerprint: str = ""  # what logs and status show of that key
    registered: bool = False
    pushes: int = 0
    pulls: int = 0
    last_seen: float = field(default_factory=time.time)  # time.time() of its latest push or pull (or join)
    report: WorkerReport | None = None  # the latest its pushes carried


class Membership:
    """Live workers by id. A worker id belongs to the connection that joined with it."""

    def __init__(self, expected: int = 1, max_workers: int = 256, max_workers_per_key: int = 8):
        self.expected = expected
        self.max_workers = max_workers  # live workers at most (--max-workers)
        self.max_workers_per_key = max_workers_per_key  # of them with one key (--max-workers-per-key)
        self.live: dict[int, WorkerInfo] = {}
        self.started = False  # set once `expected` workers have been live together
        self._next_id = 0

    def ids(self) -> list[int]:
        return sorted(self.live)

    def join(self, routing_id: bytes, want: int | None, name: str = "",
             reserved: Collection[int] = (), key: str = "", fingerprint: str = "") -> WorkerInfo:
        """Add a worker. ``want`` asks for a specific id (a restarted worker); a new id
        skips the live ones and ``reserved`` (ids whose pushes are still queued). A
        connection holds one worker id: joining again returns it, asking for another
        is refused."""
        held = next((i for i in self.live.values() if i.routing_id == routing_id), None)
        if held is not None:
            if want is not None and want != held.worker:
                raise ServerError(f"this connection already holds worker id {held.worker}; one connection "
                                  "holds one worker id", ErrorCode.WORKER_ID)
            return held
        if want is not None:
            cur = self.live.get(want)
            if cur is not None:
                if cur.routing_id != routing_id:
                    raise ServerError(f"worker id {want} is in use by another live connection",
                                      ErrorCode.WORKER_ID)
                return cur
        if len(self.live) >= self.max_workers:
            raise ServerError(f"join refused: {len(self.live)} live workers, the server's limit "
                              f"(--max-workers {self.max_workers})", ErrorCode.LIMIT)
        if key and sum(i.key == key for i in self.live.values()) >= self.max_workers_per_key:
            raise ServerError(f"join refused: this key already has {self.max_workers_per_key} live workers, the "
                              f"server's limit (--max-workers-per-key {self.max_workers_per_key})", ErrorCode.LIMIT)
        if want is not None:
            wid = want
        else:
            while self._next_id in self.live or self._next_id in reserved:
                self._next_id += 1
            if self._next_id > MAX_WORKER_ID:
                raise ServerError("no worker id left", ErrorCode.WORKER_ID)
            wid = self._next_id
        self._next_id = max(self._next_id, wid + 1)
        info = WorkerInfo(wid, routing_id, name, key, fingerprint)
        self.live[wid] = info
        if len(self.live) >= self.expected:
            self.started = True
        return info

    def leave(self, worker: int) -> None:
        self.live.pop(worker, None)

    def drop_key(self, key: str) -> list[int]:
        """Remove the live workers that connected with ``key``; returns their ids."""
        gone = [w for w, i in self.live.items() if i.key == key]
        for w in gone:
            del self.live[w]
        return gone

    def check(self, routing_id: bytes, worker: int, *, registered: bool = True) -> WorkerInfo:
        """The live worker ``worker`` of this connection (registered, unless told
        otherwise); raises :class:`NotRegistered`."""
        info = self.live.get(worker)
        if info is None:
            raise NotRegistered(f"worker {worker} has not joined (send 'join' first)")
        if info.routing_id != routing_id:
            raise NotRegistered(f"worker {worker} belongs to another connection")
        if registered and not info.registered:
            raise NotRegistered(f"worker {worker} has not registered the model")
        return info
