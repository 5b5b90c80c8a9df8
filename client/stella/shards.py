"""A job served by several ``stella-ps`` shards: the parameter space split between them.

``ShardedClient(["tcp://ps0:5555", "tcp://ps1:5555"])`` speaks the :class:`~stella.Client`
API to N shards at once (``StellaOptimizer`` and the training loop do not know the
difference; a comma-separated address does the same: :func:`connect`). Each shard is an
ordinary ``stella-ps`` serving part of the model, with its own membership, liveness,
checkpoints and keys (``stella-ps --shard I/N`` only labels it, and lets a client check
the order of its address list).

**One address is enough** when the shards list themselves: ``stella-ps --shards N``
(the shards of one host, from one command) and ``--shard-list FILE`` make each shard's
``joined`` and ``status`` replies carry the job's addresses in shard order, so
:func:`connect` given one shard's address finds the others. An address listed with
the host ``*`` is on the host the client reached that shard at (``tcp://*:5556``
after reaching ``tcp://ps.example.org:5555`` is ``tcp://ps.example.org:5556``): no
host name to configure behind NAT or a container's published ports.

**The split**: the model laid out flat (:mod:`stella.layout`, with the shards' dense
cut) is cut into N contiguous ranges of about equal size
(:meth:`~stella.layout.FlatLayout.shard_ranges`), one a shard; each registers the whole
layout and its range. Every client computes the same split from the same layout, and
the shards refuse a registration whose range differs from their model's (a wrong order
of addresses: a :class:`~stella.errors.LayoutConflict`, or the shard label's mismatch).

**Pushes and pulls go to every shard concurrently**, a push to each shard every round,
empty where the update has nothing in its range, so that every shard closes one step
per round. **A step is consistent across shards**: the client's version is a *round*
counter, each round a version per shard; a pull asks every shard for the steps after
its own version, and the client adds the same number of steps from each (the fewest any
shard had: the rest are kept and added with the next pull), so a replica never holds
shard A after round r+1 beside shard B after round r. That needs each step's message
on its own, which the compressed broadcast gives (``--pull broadcast``, the default);
a shard serving exact pulls is refused. A shard that restarted (from its checkpoint,
older than the others' state) or a client too far behind gets every shard's snapshot,
and the rounds go on from there.
"""
from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, Literal, TypeVar, overload

import msgspec

from .client import Client, Pending, PullResult, _dtype_name
from .errors import ProtocolError, StellaError
from .layout import FlatLayout, FlatUpdate, FlatValues
from .protocol import PullCoding, PushOk, Registered, StatusReply, TensorSpec, TrainingMode

__all__ = ["ShardedClient", "AnyClient", "connect", "split_address", "resolve_address"]

T = TypeVar("T")
_MAPPINGS = 64  # rounds whose per-shard versions are kept (a pull since an older round gets snapshots)


def split_address(address: str | Sequence[str]) -> list[str]:
    """``"tcp://a:5555,tcp://b:5555"`` (or a list) as a list of addresses."""
    if isinstance(address, str):
        return [a.strip() for a in address.split(",") if a.strip()]
    return list(address)


def resolve_address(listed: str, reached: str) -> str:
    """A shard list's address as this client reaches it: the host ``*`` is the host of
    ``reached``, the address the client reached the listing shard at."""
    scheme, sep, rest = listed.partition("://")
    host, _, port = rest.rpartition(":")
    if not sep or host != "*":
        return listed
    reached_host = reached.partition("://")[2].rpartition(":")[0]
    return f"{scheme}://{reached_host}:{port}"


def connect(address: str | Sequence[str], **kw: Any) -> AnyClient:
    """A :class:`Client` for one address, a :class:`ShardedClient` for several; one
    address of a job whose shards list themselves (``stella-ps --shards``, see the
    module doc): a :class:`ShardedClient` over all of them, the connection made to find
    them kept as its shard's. One shard of a job that does not list the others is
    refused: the model would be split wrongly. ``kw`` goes to every :class:`Client`."""
    addresses = split_address(address)
    if len(addresses) > 1:
        return ShardedClient(addresses, **kw)
    first = Client(addresses[0], **kw)
    try:
        if kw.get("join", True):
            listed, label = first.shard_addresses, first.shard
        else:  # a status reply says the same without joining
            st = first.status()
            listed, label = st.shards, st.shard
        if len(listed) <= 1:
            if label and not label.endswith("/1"):
                raise ProtocolError(f"{addresses[0]} is shard {label} of a sharded job and does not list the others "
                                    "(stella-ps --shards, or --shard-list): give every shard's address, "
                                    "comma-separated, in shard order")
            return first
        resolved = [resolve_address(a, first.address) for a in listed]
        at = int(label.partition("/")[0]) if label else None
        if at is None or at >= len(resolved):
            first.close()
            return ShardedClient(resolved, **kw)
        resolved[at] = first.address
    except BaseException:
        first.close(leave=False)
        raise
    return ShardedClient(resolved, _clients={at: first}, **kw)


class _AllOf(Generic[T]):
    """Requests in flight on every shard, one :class:`Pending`-like result."""

    def __init__(self, pendings: list[Pending[Any]], combine: Callable[[list[Any]], T]):
        self._pendings, self._combine = pendings, combine

    def result(self, timeout: float | None = None) -> T:
        return self._combine([p.result(timeout) for p in self._pendings])


class ShardedClient:
    """The :class:`~stella.Client` API over N ``stella-ps`` shards (see the module doc).
    Keyword arguments go to every shard's :class:`~stella.Client` (keys included: the
    shards of a job share the allowlist and the client's key pair)."""

    def __init__(self, addresses: Sequence[str], *, _clients: Mapping[int, Client] | None = None, **kw: Any):
        self.addresses = split_address(addresses)
        given = dict(_clients or {})  # shards already connected (connect()'s first), now this object's
        if len(self.addresses) < 2:
            for c in given.values():
                c.close(leave=False)
            raise ValueError("a sharded job has at least two addresses (one: stella.Client)")
        self.shards: list[Client] = []
        try:
            for i, a in enumerate(self.addresses):
                self.shards.append(given.pop(i) if i in given else Client(a, **kw))
        except BaseException:
            for c in given.values():
                c.close(leave=False)
            self.close(leave=False)
            raise
        self._check_labels()
        self.layout: list[TensorSpec] = []
        self.flat: FlatLayout | None = None
        self._rounds: OrderedDict[int, list[int]] = OrderedDict()  # round -> each shard's version
        self._ahead: list[list[list[FlatValues]]] = [[] for _ in self.shards]  # steps pulled beyond the last round
        self._version = 0

    # ------------------------------------------------------------------ what a Client shows
    @property
    def address(self) -> str:
        return ",".join(self.addresses)

    @property
    def timeout(self) -> float:
        return self.shards[0].timeout

    @property
    def worker_id(self) -> int | None:
        return self.shards[0].worker_id

    @property
    def secure(self) -> bool:
        return all(c.secure for c in self.shards)

    @property
    def server_version(self) -> int:
        return self._version

    @property
    def reconnects(self) -> int:
        return sum(c.reconnects for c in self.shards)

    @property
    def bytes_pushed(self) -> int:
        return sum(c.bytes_pushed for c in self.shards)

    @property
    def bytes_pulled(self) -> int:
        return sum(c.bytes_pulled for c in self.shards)

    def _check_labels(self) -> None:
        n = len(self.shards)
        for i, c in enumerate(self.shards):
            label = c.shard
            if label and label != f"{i}/{n}":
                raise ProtocolError(f"{self.addresses[i]} is shard {label} of its job, but it is number {i} of the "
                                    f"{n} addresses given: list the shards in their order (stella-ps --shard)")

    # ------------------------------------------------------------------ the model
    def join(self, worker_id: int | None = None, *, timeout: float | None = None) -> int:
        ids = [c.join(worker_id, timeout=timeout) for c in self.shards]  # every shard, not just the first
        return ids[0]

    def register(self, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
                 optimizer: Mapping[str, Any] | None = None, *, mode: TrainingMode | None = None,
                 timeout: float | None = None, version: int = 0) -> Registered:
        """Register the model with each shard, for its range (see :meth:`stella.Client.register`)."""
        items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
        cuts = {c._session.dense_below for c in self.shards}
        if len(cuts) > 1:
            raise StellaError(f"the shards lay the model out with different dense cuts {sorted(cuts)} "
                              "(stella-ps --dense-below): start them alike")
        self.layout = [TensorSpec(n, tuple(int(s) for s in t.shape), _dtype_name(t)) for n, t in items]
        self.flat = FlatLayout.of(self.layout, cuts.pop())
        ranges = self.flat.shard_ranges(len(self.shards))
        replies = [c.register(items, optimizer, mode=mode, timeout=timeout, range=r, version=version)
                   for c, r in zip(self.shards, ranges)]
        for r, a in zip(replies, self.addresses):
            if r.pull not in (None, "broadcast"):
                raise StellaError(f"{a} serves {r.pull} pulls: a sharded job needs each step's message, the "
                                  f"compressed broadcast (stella-ps --pull broadcast, the default)")
        if any(r.broadcast != replies[0].broadcast for r in replies):
            raise StellaError("the shards run different broadcasts (stella-ps --broadcast-values, "
                              f"--broadcast-factor): {[r.broadcast for r in replies]}; start them alike")
        bases = [r.base for r in replies if r.base is not None]
        if len(bases) < len(replies):  # some shard's piece is not this worker's: a snapshot of every shard
            return msgspec.structs.replace(replies[0], base=None)
        # every shard holds this worker's piece at a known version: the rounds start there (a round
        # ahead for each step the busiest shard made since, which a pull since the base brings)
        start = max(bases)
        self._ahead = [[] for _ in self.shards]
        self._record(start, bases)
        moved = max(r.version - b for r, b in zip(replies, bases))
        return msgspec.structs.replace(replies[0], version=start + moved, base=start)

    # ------------------------------------------------------------------ rounds
    def _record(self, version: int, per_shard: list[int]) -> None:
        self._rounds[version] = per_shard
        self._version = max(self._version, version)
        while len(self._rounds) > _MAPPINGS:
            self._rounds.popitem(last=False)

    @overload
    def push(self, grads: Mapping[str, Any] | FlatUpdate, version: int, *, wait: Literal[True] = ...,
             **kw: Any) -> PushOk: ...
    @overload
    def push(self, grads: Mapping[str, Any] | FlatUpdate, version: int, *, wait: Literal[False],
             **kw: Any) -> _AllOf[PushOk]: ...
    def push(self, grads: Mapping[str, Any] | FlatUpdate, version: int, *, wait: bool = True, **kw: Any
             ) -> PushOk | _AllOf[PushOk]:
        """Push one round's update, computed on round ``version``: each shard gets the
        part in its range (possibly nothing), on its own version."""
        at = self._pushed_at(version)
        update = grads if isinstance(grads, FlatUpdate) else self.shards[0].flatten(grads)
        out = _AllOf([c.push(update, v, wait=False, **kw) for c, v in zip(self.shards, at)],
                      functools.partial(self._push_ok, int(version), at[0]))
        return out.result() if wait else out

    def _pushed_at(self, version: int) -> list[int]:
        """Each shard's version of round ``version``."""
        at = self._rounds.get(int(version))
        if at is None:
            raise StellaError(f"round {version} is not one this client pulled (it knows "
                              f"{min(self._rounds, default=None)}..{self._version})")
        return at

    def _push_ok(self, version: int, first: int, oks: list[PushOk]) -> PushOk:
        return PushOk(req=oks[0].req, step=version + oks[0].step - first, version=self._version,
                      clipped=[c for ok in oks for c in ok.clipped])  # each shard clips its own range

    def push_pull(self, grads: Mapping[str, Any] | FlatUpdate, version: int, since: int | None, *,
                  wait_for: int | None = None, pull_coding: PullCoding = "rice", timeout: float | None = None,
                  **kw: Any) -> tuple[_AllOf[PushOk], _AllOf[PullResult]]:
        """:meth:`push` and :meth:`pull` (``wait=False``) of one round, one message to
        each shard (:meth:`stella.Client.push_pull`); a pull of a snapshot goes after the
        pushes, on its own."""
        at = self._pushed_at(version)
        update = grads if isinstance(grads, FlatUpdate) else self.shards[0].flatten(grads)
        since_at = None if since is None else self._rounds.get(int(since))
        if since_at is None:
            return (self.push(update, version, wait=False, timeout=timeout, **kw),
                    self.pull(since, wait_for=wait_for, index_coding=pull_coding, timeout=timeout, wait=False))
        assert since is not None
        pairs = [c.push_pull(update, v, p, wait_for=w, pull_coding=pull_coding, timeout=timeout, **kw)
                 for c, v, (p, w) in zip(self.shards, at, self._pulled_at(since, since_at, wait_for))]
        return (_AllOf([a for a, _ in pairs], functools.partial(self._push_ok, int(version), at[0])),
                _AllOf([b for _, b in pairs], functools.partial(self._rounds_after, since, since_at)))

    def _pulled_at(self, since: int, at: list[int], wait_for: int | None) -> list[tuple[int, int | None]]:
        """Each shard's ``(since, wait_for)`` of a pull of the rounds after round ``since``
        (the shard's versions ``at``): past the steps a shard gave ahead of the others."""
        out = []
        for v, n in zip(at, (len(a) for a in self._ahead)):
            out.append((v + n, None if wait_for is None or wait_for - since <= n else v + (wait_for - since)))
        return out

    @overload
    def pull(self, since: int | None = ..., *, wait_for: int | None = ..., index_coding: PullCoding = ...,
             timeout: float | None = ..., wait: Literal[True] = ...) -> PullResult: ...
    @overload
    def pull(self, since: int | None = ..., *, wait_for: int | None = ..., index_coding: PullCoding = ...,
             timeout: float | None = ..., wait: Literal[False]) -> _AllOf[PullResult]: ...
    def pull(self, since: int | None = None, *, wait_for: int | None = None, index_coding: PullCoding = "rice",
             timeout: float | None = None, wait: bool = True) -> PullResult | _AllOf[PullResult]:
        """The steps after round ``since`` that every shard has made (None, or a round
        this client no longer maps: a snapshot of every shard); ``wait_for`` (a round)
        holds the reply until each shard made its step, or the wait expires."""
        at = None if since is None else self._rounds.get(int(since))
        if at is None:
            return self._snapshot(since, index_coding, timeout, wait)
        assert since is not None
        pendings = [c.pull(p, wait_for=w, index_coding=index_coding, timeout=timeout, wait=False)
                    for c, (p, w) in zip(self.shards, self._pulled_at(since, at, wait_for))]
        out = _AllOf(pendings, functools.partial(self._rounds_after, since, at))
        return out.result() if wait else out

    def _snapshot(self, since: int | None, coding: PullCoding, timeout: float | None,
                  wait: bool) -> PullResult | _AllOf[PullResult]:
        pendings = [c.pull(None, index_coding=coding, timeout=timeout, wait=False) for c in self.shards]
        out = _AllOf(pendings, functools.partial(self._from_snapshots, since))
        return out.result() if wait else out

    def _from_snapshots(self, since: int | None, results: list[PullResult]) -> PullResult:
        for r in results:
            if not r.full:  # pragma: no cover - a pull since -1 is always a snapshot
                raise ProtocolError("a shard answered a snapshot pull with a delta")
        version = max(self._version + (since is not None), max(r.version for r in results))
        self._ahead = [[] for _ in self.shards]
        self._record(version, [r.version for r in results])
        return PullResult(version, True, [v for r in results for v in r.values],
                          rebased=any(r.rebased for r in results),
                          held_s=min(r.held_s for r in results), step_s=max(r.step_s for r in results),
                          pushes=max(r.pushes for r in results),
                          layout=self.flat, names=results[0].names)

    def _rounds_after(self, since: int, at: list[int], results: list[PullResult]) -> PullResult:
        """The rounds every shard has the steps of, after ``since``; a snapshot from any
        shard (it restarted, or this client is too far behind) makes it every shard's."""
        if any(r.full for r in results):
            return self._snapshot(None, "rice", None, True)  # type: ignore[return-value]
        for r, a in zip(results, self.addresses):
            if r.values:
                raise StellaError(f"{a} answered with exact values: a sharded job needs the compressed broadcast "
                                  f"(stella-ps --pull broadcast)")
        for s, r in enumerate(results):
            self._ahead[s].extend(r.steps)
        n = min(len(a) for a in self._ahead)
        steps = []
        for i in range(n):  # the shards' pieces of a step, in range order
            steps.append([piece for a in self._ahead for piece in a[i]])
        self._ahead = [a[n:] for a in self._ahead]
        if n:
            self._record(since + n, [v + n for v in at])
        return PullResult(since + n, False, rebased=any(r.rebased for r in results), steps=steps,
                          held_s=min(r.held_s for r in results), step_s=max(r.step_s for r in results),
                          pushes=max(r.pushes for r in results),
                          layout=self.flat, names=results[0].names)

    # ------------------------------------------------------------------ the rest of the API
    def status(self, *, timeout: float | None = None) -> list[StatusReply]:
        """Every shard's status, in shard order."""
        return [c.status(timeout=timeout) for c in self.shards]

    def set_optimizer(self, *, timeout: float | None = None, **hparams: Any) -> dict[str, Any]:
        configs = [c.set_optimizer(timeout=timeout, **hparams) for c in self.shards]  # every shard's
        return configs[0]

    def leave(self, *, timeout: float | None = None) -> None:
        for c in self.shards:
            c.leave(timeout=timeout)

    def stop(self) -> None:
        for c in self.shards:
            c.stop()

    def close(self, *, leave: bool = True, timeout: float = 5.0) -> None:
        for c in self.shards:
            c.close(leave=leave, timeout=timeout)

    def __enter__(self) -> ShardedClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


AnyClient = Client | ShardedClient  # what StellaOptimizer speaks through
