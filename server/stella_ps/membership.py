"""Who takes part: worker ids, the connection each belongs to, whether the job has
started (the expected number of workers registered once), which workers steps wait
for, and liveness.

Waited for: a registered worker that has pushed, or that registered before the job's
first step closed (the job's first cohort: a job started with ``--workers N`` waits
for its N workers' first pushes). A connection that joined, or even registered later,
holds no step back until its first push arrives; so stray joins cost nothing.

Liveness: a registered worker is heard from by its requests and by its heartbeats
(sent from a socket of the client's own, so a long forward/backward never misses
one); one not heard from for the liveness timeout is declared *gone*: it leaves the
live set (the open step stops waiting for it; its queued pushes still count), and
``status`` lists it among the gone. A worker that joined but never registered is
gone once the same timeout passes after its last request, heartbeats or not, so a
stray ``join`` never holds steps back; except one the server asked for the model's values
(they may take longer than the timeout to arrive over a slow link): its heartbeats count.
A gone worker that speaks again on its own connection (a process that was stopped, a
link that came back) is live again at once; its id is free for a new connection to take (a restarted process rejoining
with its old id), and a client that holds the worker's session token takes the id
to a new connection even while it is still live (a reconnect).
"""
from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from stella.errors import BadValue, ErrorCode, NotRegistered, ServerError
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
    registering: bool = False  # asked to send the model's values (its upload may outlast the liveness timeout)
    held: bool = False  # a probe of its is held for another worker's upload (one at a time)
    waited: bool = False  # steps wait for its push (see the module doc)
    pushes: int = 0
    final_pushed: bool = False  # its one final push (close()'s residual, allowed more by the push clip) came
    pulls: int = 0
    report: WorkerReport | None = None  # the latest its pushes carried
    session: int = field(default_factory=lambda: secrets.randbits(63))  # token for heartbeats and reconnects
    last_seen: float = field(default_factory=time.monotonic)  # any request or heartbeat
    last_request: float = field(default_factory=time.monotonic)  # a request on its own connection
    last_push_req: int = 0  # request id of the newest push taken (a re-sent push is not queued twice)
    last_push_clipped: list[tuple[int, int, float]] = field(default_factory=list)  # its PushOk's, for a re-send
    gone_at: float | None = None
    refusal: str | None = None  # why its next request is refused (a push the server dropped)
    upload: Any = None  # the model's values coming in pieces (stella_ps.transfers.Upload), asked of it


class Membership:
    """Live workers by id. A worker id belongs to the connection that joined with it."""

    def __init__(self, expected: int = 1, max_workers: int = 256, max_workers_per_key: int = 8,
                 clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self.expected = expected
        self.max_workers = max_workers  # live workers at most (--max-workers)
        self.max_workers_per_key = max_workers_per_key  # of them with one key (--max-workers-per-key)
        self.live: dict[int, WorkerInfo] = {}
        self.gone: OrderedDict[int, WorkerInfo] = OrderedDict()  # declared gone, oldest first (bounded)
        self.started = False  # set once `expected` workers have been registered and live together
        self.stepped = False  # a step has closed (since start, or the job resumed from a checkpoint)
        self._next_id = 0
        self._waited: tuple[int, ...] | None = None  # waited()'s answer until the live set or a flag changes

    def _changed(self) -> None:
        self._waited = None

    def _put_live(self, worker: int, info: WorkerInfo) -> None:
        self.live[worker] = info
        self._changed()

    def ids(self) -> list[int]:
        return sorted(self.live)

    def join(self, routing_id: bytes, want: int | None, name: str = "",
             reserved: Collection[int] = (), key: str = "", fingerprint: str = "",
             session: int | None = None) -> WorkerInfo:
        """Add a worker. ``want`` asks for a specific id (a restarted worker): a live
        id is refused unless ``session`` is its token (then the id moves to this
        connection, keeping its state); a gone id is given again. A new id skips the
        live ones and ``reserved`` (ids whose pushes are still queued). A connection
        holds one worker id: joining again returns it, asking for another is refused."""
        held = next((i for i in self.live.values() if i.routing_id == routing_id), None)
        if held is not None:
            if want is not None and want != held.worker:
                raise ServerError(f"this connection already holds worker id {held.worker}; one connection "
                                  "holds one worker id", ErrorCode.WORKER_ID)
            held.last_seen = held.last_request = self._clock()
            return held
        if want is not None:
            cur = self.live.get(want)
            if cur is not None:
                if session is not None and session == cur.session and key == cur.key:
                    cur.routing_id = routing_id  # a reconnect: same worker, new connection
                    cur.last_seen = cur.last_request = self._clock()
                    return cur
                raise ServerError(f"worker id {want} is in use by another live connection (it is freed when "
                                  "that connection is declared gone)", ErrorCode.WORKER_ID)
            old = self.gone.get(want)
            if old is not None and session is not None and session == old.session and key == old.key:
                del self.gone[want]  # the same client back: its state (push dedup) goes on
                old.routing_id, old.gone_at = routing_id, None
                old.last_seen = old.last_request = self._clock()
                self._put_live(want, old)
                return old
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
        info.last_seen = info.last_request = self._clock()
        self.gone.pop(wid, None)
        self._put_live(wid, info)
        return info

    def register(self, info: WorkerInfo) -> None:
        """``info``'s worker registered the model: it takes part, and is waited for at once
        if the job's first step has not closed yet."""
        info.registered = True
        if not info.waited and not self.stepped:
            info.waited = True
            self._changed()
        if sum(i.registered for i in self.live.values()) >= self.expected:
            self.started = True

    def pushed(self, worker: int) -> None:
        """A push of ``worker`` arrived: from now on steps wait for it."""
        info = self.live.get(worker)
        if info is not None and not info.waited:
            info.waited = True
            self._changed()

    def waited(self) -> tuple[int, ...]:
        """The live workers steps wait for (asked on every push: kept until the live set
        or a worker's flag changes, so a push does not walk the live workers)."""
        if self._waited is None:
            self._waited = tuple(w for w, i in self.live.items() if i.waited)
        return self._waited

    def leave(self, worker: int) -> None:
        if self.live.pop(worker, None) is not None:
            self._changed()

    def sweep(self, timeout: float, now: float | None = None) -> list[int]:
        """Declare gone the live workers not heard from for ``timeout`` seconds (and
        those joined but unregistered for that long since their last request);
        returns their ids. A worker inside its registration (uploading the model, or its
        probe held while another uploads) is heard from by its heartbeats: over a slow
        link the upload, and so the hold, may outlast the timeout."""
        now = self._clock() if now is None else now
        out = [w for w, i in self.live.items()
               if now - (i.last_seen if i.registered or i.registering or i.held else i.last_request) > timeout]
        for w in out:
            info = self.live.pop(w)
            info.gone_at = now
            self.gone[w] = info
            self.gone.move_to_end(w)
        if out:
            self._changed()
        while len(self.gone) > self.max_workers:
            self.gone.popitem(last=False)
        return out

    def revive(self, routing_id: bytes, worker: int) -> WorkerInfo | None:
        """A gone worker speaking again on its own connection is live again (if its
        id was not given to another connection meanwhile); returns it, or None."""
        info = self.gone.get(worker)
        if info is None or info.routing_id != routing_id or worker in self.live:
            return None
        del self.gone[worker]
        info.gone_at = None
        info.last_seen = info.last_request = self._clock()
        self._put_live(worker, info)
        return info

    def heartbeat(self, worker: int, session: int, key: str) -> tuple[WorkerInfo, bool]:
        """Record a heartbeat; returns the worker and whether it was revived (a gone,
        registered worker whose client beats again). Raises :class:`NotRegistered`
        for a worker or session the server does not know (e.g. after a restart)."""
        info = self.live.get(worker)
        revived = False
        if info is None:
            old = self.gone.get(worker)
            if old is not None and old.session == session and old.key == key and (old.registered or old.registering):
                del self.gone[worker]
                old.gone_at = None
                self._put_live(worker, old)
                info = old
                revived = True
        if info is None or info.session != session or info.key != key:
            raise NotRegistered(f"worker {worker} with this session is not known to the server (restarted, or "
                                "the worker was declared gone and its id taken): join again")
        info.last_seen = self._clock()
        return info, revived

    def refuse_next(self, worker: int, why: str) -> None:
        """Refuse the next request of ``worker`` with ``why`` (:meth:`check` raises it)."""
        info = self.live.get(worker) or self.gone.get(worker)
        if info is not None:
            info.refusal = why

    def silent(self, workers: Collection[int], after: float) -> list[int]:
        """Of ``workers``, the live ones not heard from (requests or heartbeats) for more
        than ``after`` seconds; none when ``after`` is 0 (liveness is off)."""
        if after <= 0:
            return []
        now = self._clock()
        return [w for w in workers if w in self.live and now - self.live[w].last_seen > after]

    def drop_key(self, key: str) -> list[int]:
        """Remove the live workers that connected with ``key``; returns their ids."""
        gone = [w for w, i in self.live.items() if i.key == key]
        for w in gone:
            del self.live[w]
        if gone:
            self._changed()
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
        info.last_seen = info.last_request = self._clock()
        if info.refusal is not None:
            why, info.refusal = info.refusal, None
            raise BadValue(why)
        return info
