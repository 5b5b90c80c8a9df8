"""The compressed broadcast with server-side error feedback: what workers pull.

A pull of the exact model's changes carries the union of every worker's pushed
coordinates in float32, so it grows with the number of workers. The broadcast bounds
it: after each step the server adds the step's change of the exact model (after its
optimizer) to a residual ``R``, selects the top-k of ``R`` by magnitude, codes those
values as a push is coded (f16, q4, q2), keeps what it did not send (and the coding's
error) in ``R``, and sends that one message to every worker. Each worker adds the
message to its replica; so every replica equals the server's *broadcast model* ``B``
bit for bit (the same float32 additions), and the exact model minus ``R`` is ``B``
(up to float32 rounding: the server keeps both ``B`` and ``R``). What was sent plus
what is held is the global change: nothing is lost, only delayed.

The message's size follows the pushes, not the workers: per tensor, ``factor`` times
the mean count of the step's pushes (the last one seen, for a tensor the step did not
touch), so a pull costs about what a push costs whatever the number of workers.
A tensor marked ``whole`` (the server's share of the model's dense suffix of small
tensors, :mod:`stella.layout`) goes whole (its residual, when not zero), in f16
when the coding is q4 or q2: a 4- or 2-bit code has no zero and one scale per 64
values, and a whole tensor's small changes beside its large ones would each move by
a step of the largest (top-k values, alike in size, code well).

The selection does not read the whole residual every step. Each large tensor's ``R``
lives in a :class:`~.residual.FlatResidual`, whose index of the largest magnitudes is
kept current as a step adds its change, so that a step's top k costs what the step
touched and selected, never the tensor's size (no pass over ``R`` in a steady state). A
step whose touched coordinates and budget make more than ``1/INDEX_SHARE`` of the
tensor instead takes the streaming top-k over the whole residual (:mod:`.topk`, the
change added as it goes), which is cheaper there on this VM's memory; the index is then
rebuilt by its next selection.

A worker that is behind by up to ``history`` steps gets their messages in order (it
must add them one after another to stay equal to ``B``); one further behind, or new,
gets a snapshot of ``B``. docs/optimizer.md, "The broadcast", has the rules and how
the update mode's merge rule reads them.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stella import codec
from stella.payload import SparseTensor, concat_entries, encode_tensors
from stella.protocol import BroadcastInfo, TensorEntry, TensorSpec, ValueDtype

from .kernel import scatter_add, scatter_add_lists
from .residual import FlatResidual
from .runtime import TensorPool
from .topk import Selector

__all__ = ["Broadcast", "Message", "StepLog", "OWED_BYTES"]

# The index (residual.py) against the streaming pass, bench.residual on the AMD EPYC VM (load 8-11, CPU time): at
# the same touched count and k a step costs the same at 10M and 100M coordinates with the index (1.04x per touched
# coordinate) where the pass costs 4-9x; but the pass streams R at ~0.33 ns a coordinate and writing R at 2% random
# coordinates costs ~14 ns each, so the pass wins from about 1% touched (2x at 2%, 5x at 32%) and the index below
# (1.6-4.5x at 0.2-0.8% of 100M). Hence the index while touched + k < numel / INDEX_SHARE.
INDEX_SHARE = 64
PASS_PER_ACCESS = 20  # coordinates of the streaming pass that cost about what a random access does
# B's sparse messages wait (see Broadcast._owe_model) and go in together in one sweep over B's lines: a message
# of 1% touches 15% of B's lines, each a random access to memory, where the sweep streams them. On 8 tensors of
# 1.25M with messages of 1% and the caches flushed between steps (this VM): 1.5 ms a step one at a time, 0.82 ms
# in sweeps of 8, 0.52 of 16, 0.39 of 32. Tensor t sweeps at a version of its slot (version % MODEL_SLOTS ==
# t % MODEL_SLOTS) once its messages hold numel / (2 MODEL_OWED_SHARE) entries, and at any version once they
# hold numel / MODEL_OWED_SHARE or number MODEL_OWED_LISTS. The slots spread a model's sweeps over the steps and
# put those of shards with alike tensors on the same steps (a step waits for the slowest shard: sweeps on
# different steps would each hold up every shard). The wait costs at most 2 bytes a coordinate.
MODEL_OWED_SHARE, MODEL_OWED_LISTS, MODEL_SLOTS = 4, 64, 8
OWED_BYTES = 8 // MODEL_OWED_SHARE  # what the waiting messages may hold, a coordinate (int32 index, float32 value)
_Coded = tuple[list[TensorEntry], list[Any]]  # one tensor's part of a message: its entry and frames
_SERIAL = TensorPool(1)
# A step's streaming pass over a large residual (the broadcast's selection above the index's share) runs on the
# store's threads from this many: the pass is bound by memory bandwidth, which a server's cores share out many
# ways and two vCPUs of a small VM do not (on the 2-vCPU Zen 4 VM, 10M coordinates at 2% touched: 4.7-5.3 ms on
# one thread, 4.5-5.0 ms of wall and 6.5-7.4 ms of CPU on two; bench/RESULTS.md)
PASS_THREADS_FROM = 4
_FINITE = {"f16": 65504.0, "bf16": 3.3895313892515355e38}  # the largest finite value of each coding


@dataclass(frozen=True)
class Message:
    """One step's broadcast, encoded once for every worker: the version it brings a
    replica to, its entries and frames (indices Rice-coded, values in the coding)."""

    version: int
    entries: list[TensorEntry]
    frames: list[Any]
    values: int  # coordinates it carries


@dataclass
class StepLog:
    """What one step did to ``R`` and ``B``, per tensor, to replay it exactly on a
    checkpoint's slices (:func:`stella_ps.checkpoints.roll_forward`): ``R[touched] += changes``,
    then ``R[sent] -= values`` and ``B[sent] += values``."""

    touched: list[np.ndarray] = field(default_factory=list)
    changes: list[np.ndarray] = field(default_factory=list)
    sent: list[np.ndarray | None] = field(default_factory=list)  # None: the whole tensor
    values: list[np.ndarray] = field(default_factory=list)


def replay(model: np.ndarray, residual: np.ndarray, log: StepLog, t: int, lo: int, hi: int) -> None:
    """Replay tensor ``t``'s part of ``log`` on coordinates ``lo..hi-1`` of ``model`` and
    ``residual`` (a slice of B and R copied before the step): the same float32
    operations in the same order as the step itself."""
    idx, ch = log.touched[t], log.changes[t]
    a, b = np.searchsorted(idx, [lo, hi])
    residual[idx[a:b] - lo] += ch[a:b]
    sent, vals = log.sent[t], log.values[t]
    if sent is None:
        if vals.size:
            residual[:] -= vals[lo:hi]
            model[:] += vals[lo:hi]
        return
    a, b = np.searchsorted(sent, [lo, hi])
    residual[sent[a:b] - lo] -= vals[a:b]
    model[sent[a:b] - lo] += vals[a:b]


class Broadcast:
    """``B``, ``R`` and the recent messages of one model."""

    def __init__(self, layout: Sequence[TensorSpec], values: Sequence[np.ndarray], info: BroadcastInfo,
                 history: int, *, whole: Sequence[bool], residual: Sequence[np.ndarray] | None = None,
                 index: bool = True):
        self.layout = list(layout)
        self.info = info  # what workers are told of it (the coding, the factor)
        self.coding: ValueDtype = info.values
        self.factor = info.factor
        self.whole = list(whole)  # each tensor: sent whole (the dense suffix), or selected from
        self._model = [np.array(v, np.float32, copy=True).reshape(-1) for v in values]  # B
        # what B is still owed of each tensor's sparse messages, oldest first; every reader of B (the model
        # property) adds them first
        self._model_owed: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in self.layout]
        # R: a large tensor's in its FlatResidual (whose index follows it), a whole one's plain; index False: the
        # streaming pass every step (bench.broadcast's baseline)
        self._index = [FlatResidual(s.numel, s.numel) if index and not w else None
                       for s, w in zip(self.layout, self.whole)]
        self._residual = [np.zeros(s.numel, np.float32) if ix is None else ix.values
                          for s, ix in zip(self.layout, self._index)]
        if residual is not None:
            for t, r in enumerate(residual):
                np.copyto(self._residual[t], np.asarray(r, np.float32).reshape(-1))
                self._stale(t)
        # what R is still owed of each tensor's last message: (its indices, the coding's error there), added by
        # the next step's streaming pass as it goes (R's lines are read there anyway) rather than by a scattered
        # write now; every other reader of R (the residual property, the pool) adds it first
        self._pending: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(self.layout)
        self._counts = [0.0] * len(self.layout)  # each tensor's budget: the mean push count last seen
        self._selectors = [Selector(seed=0x5EED + t) for t in range(len(self.layout))]
        self.full_passes = [0] * len(self.layout)  # streaming passes over the whole residual (tests, benchmarks)
        # whether each residual may hold anything: a residual no step has touched is zero, and a pass over a large
        # one to find that out costs as much as the selection (0.5 ns per coordinate)
        self._owed = [residual is not None for _ in self.layout]
        self._messages: deque[Message] = deque(maxlen=history)
        self._valid_from = 0  # a replica older than this version gets a snapshot (resync)

    @property
    def model(self) -> list[np.ndarray]:
        """``B``, one float32 array per tensor (what every replica holds)."""
        for t in range(len(self.layout)):
            self._settle_model(t)
        return self._model

    def _settle_model(self, t: int) -> None:
        """Add tensor ``t``'s waiting messages to ``B`` (in their order: the same floats as
        one at a time)."""
        owed, self._model_owed[t] = self._model_owed[t], []
        if owed:
            scatter_add_lists(self._model[t], owed)

    def _owe_model(self, t: int, version: int, idx: np.ndarray, q: np.ndarray) -> None:
        """``B[idx] += q`` for tensor ``t`` at ``version``, now or in a later sweep with
        other messages (MODEL_OWED_SHARE, MODEL_SLOTS)."""
        owed = self._model_owed[t]
        owed.append((idx, q))
        entries = sum(i.size for i, _ in owed)  # at most MODEL_OWED_LISTS lists
        full = self.layout[t].numel // MODEL_OWED_SHARE
        if (entries >= full or len(owed) >= MODEL_OWED_LISTS
                or (entries >= full // 2 and version % MODEL_SLOTS == t % MODEL_SLOTS)):
            self._settle_model(t)

    @property
    def residual(self) -> list[np.ndarray]:
        """``R``, one float32 array per tensor (what the exact model is owed beyond ``B``)."""
        for t in range(len(self.layout)):
            self._settle(t)
        return self._residual

    def _settle(self, t: int) -> None:
        """Add tensor ``t``'s pending coding error to its residual."""
        pending, self._pending[t] = self._pending[t], None
        if pending is None:
            return
        ix = self._index[t]
        if ix is not None:
            ix.add(*pending)
        else:
            scatter_add(self._residual[t], *pending)

    def _stale(self, t: int) -> None:
        """Tensor ``t``'s ``R`` changed behind its index (a streaming pass, a scatter, a
        load): its next selection rebuilds the index."""
        ix = self._index[t]
        if ix is not None:
            ix.invalidate()

    @property
    def index_passes(self) -> list[int]:
        """Passes each tensor's index made over its ``R`` to (re)build itself (tests, benchmarks)."""
        return [0 if ix is None else ix.full_passes for ix in self._index]

    def step(self, version: int, touched: Sequence[np.ndarray],
             changes: Sequence[np.ndarray] | Callable[[int], np.ndarray],
             push_counts: Sequence[float], pool: TensorPool | None = None) -> StepLog:
        """After the step that made ``version``: ``R[touched[t]] += changes[t]`` (sorted
        unique int32 indices; the exact model's change, or ``changes(t)``, computed on
        the tensor's thread), select and
        code each tensor's message (``push_counts[t]``: the mean count of the step's
        pushes for tensor t, 0 if none touched it), add it to ``B``, keep the rest in
        ``R``; returns what it did (for a checkpoint's replay). The tensors are
        independent: ``pool`` runs them on its threads."""

        runner = pool or _SERIAL
        # the pass over a large residual takes the pool's threads itself (a flat model is one large tensor),
        # from PASS_THREADS_FROM of them
        threads = runner.threads if runner.threads >= PASS_THREADS_FROM else 1

        def one(t: int) -> tuple[np.ndarray | None, np.ndarray, _Coded | None, np.ndarray]:
            r, idx = self._residual[t], touched[t]
            ch = changes(t) if callable(changes) else changes[t]
            if idx.size:
                self._owed[t] = True
            if push_counts[t] > 0:
                self._counts[t] = push_counts[t]
            sent, q, coded = self._select(t, version, r, self.layout[t].numel, idx, ch, threads)
            if sent is None and coded is not None:
                self._settle_model(t)
                self._model[t] += q
            return sent, q, coded, ch

        done = runner.map(one, [self._cost(t, touched[t].size, push_counts[t])
                                           for t in range(len(self.layout))])
        failed = [d for d in done if isinstance(d, Exception)]
        if failed:
            raise failed[0]
        parts = [d for d in done if not isinstance(d, Exception)]
        # the sparse tensors' entries first, then the whole ones', each in tensor order
        entries, frames = concat_entries(coded for whole in (False, True) for sent, _, coded, _ in parts
                                         if coded is not None and (sent is None) == whole)
        count = sum(q.size for _, q, coded, _ in parts if coded is not None)
        self._messages.append(Message(version, entries, frames, count))
        return StepLog(list(touched), [ch for *_, ch in parts], [sent for sent, *_ in parts],
                       [q for _, q, *_ in parts])

    def _select(self, t: int, version: int, r: np.ndarray, numel: int, touched: np.ndarray,
                changes: np.ndarray, threads: int = 1) -> tuple[np.ndarray | None, np.ndarray, _Coded | None]:
        """``r[touched] += changes``, then tensor ``t``'s message: (indices, or None for
        the whole tensor; the coded values a receiver decodes; its entry and frames, None
        when it is empty); ``r`` keeps the rest and the coding's error, and ``B`` gains
        a sparse message here (a whole one: the caller)."""
        k = self._budget(self._counts[t])
        index = self._index[t] if self._index_fits(t, touched.size, k, numel) else None
        # what r is owed and not yet added: the last message's coding error, then this step's change; the index
        # takes them in one sweep, the streaming pass adds them as it goes (Selector.take's adds), anything
        # else adds them first
        pending, self._pending[t] = self._pending[t], None
        adds = ([pending] if pending is not None else []) + ([(touched, changes)] if touched.size else [])
        if index is not None:
            if adds:
                index.add_lists(adds)
            adds = []
        elif adds and (self.whole[t] or k <= 0 or not self._owed[t]):
            for a in adds:
                scatter_add(r, *a)
            adds = []
            self._stale(t)
        if self.whole[t]:
            if not r.any():
                return None, np.zeros(0, np.float32), None
            v = r.copy()
            q, coded = self._code(t, None, v, codec.dense_coding(self.coding))
            r[:] = v - q
            return None, q, coded
        if k <= 0 or not self._owed[t]:
            return np.zeros(0, np.int32), np.zeros(0, np.float32), None
        if index is not None:
            idx, v = index.select(min(k, numel))
        else:  # one streaming pass over the whole residual
            self.full_passes[t] += 1
            idx, v = self._selectors[t].take(r, k, adds=adds, threads=threads)
            self._stale(t)
        q, coded = self._code(t, idx, v, self.coding)
        # B gains what the replicas decode (in a later sweep, with other messages); the coding's error stays
        # owed (exact for f16/bf16): r is 0 at the sent coordinates (the selection zeroed them), so the error
        # is what the next step adds there
        self._owe_model(t, version, idx, q)
        err = v - q  # never -0 (x - x is +0), so a zero here adds nothing to r's +0: no need to drop the zeros
        if self.coding != "f32":  # (f32: q is v)
            self._pending[t] = (idx, err)
        return idx, q, coded

    def _budget(self, count: float) -> int:
        """Entries a tensor's message carries when its pushes held ``count`` on average."""
        return round(self.factor * count)

    def _index_fits(self, t: int, touched: int, k: int, numel: int) -> bool:
        """Whether a step of tensor ``t`` of ``touched`` coordinates and budget ``k`` selects through its index."""
        return self._index[t] is not None and touched + k < numel // INDEX_SHARE

    def _cost(self, t: int, touched: int, count: float) -> int:
        """Tensor ``t``'s part of a step in random accesses to memory, about (TensorPool
        deals the tensors to its threads by it, and runs a light step on one)."""
        numel = self.layout[t].numel
        k = self._budget(count if count > 0 else self._counts[t])
        if self._index_fits(t, touched, k, numel):
            return touched + k
        return touched + numel // PASS_PER_ACCESS

    def _code(self, t: int, idx: np.ndarray | None, v: np.ndarray,
              coding: ValueDtype) -> tuple[np.ndarray, _Coded | None]:
        """Tensor ``t``'s message values ``v`` (at ``idx``; None: the whole tensor) coded
        for the wire once (f16 and bf16 clamped to their finite range first: the excess
        stays owed): the float32 values a receiver decodes, read back from the very
        frame that goes out, and the message's entry and frames (None when empty)."""
        if not v.size:
            return v, None
        if coding in _FINITE:
            v = np.clip(v, -_FINITE[coding], _FINITE[coding])
        coded = encode_tensors([SparseTensor(t, idx, v)], self.layout, "rice", coding)
        return (v if coding == "f32" else codec.decode_values(coded[1][-1], v.size, coding)), coded

    def since(self, version: int, now: int) -> list[Message] | None:
        """The messages that bring a replica at ``version`` to ``now``, in order, or None
        when some are no longer kept (a snapshot then)."""
        if version < self._valid_from:  # B changed without a message (resync)
            return None
        if version == now:
            return []
        if not self._messages or version + 1 < self._messages[0].version or version > now:
            return None
        return [m for m in self._messages if m.version > version]

    def resync(self, exact: Sequence[np.ndarray], version: int) -> None:
        """After the step after ``version`` failed part way (``B`` or ``R`` of some
        tensors changed, no message made): ``R = exact - B`` again for every tensor, and
        no message reaches a replica at ``version`` or before, so every replica's next
        pull is a snapshot of ``B``."""
        model = self.model
        for t, x in enumerate(exact):
            np.subtract(np.asarray(x, np.float32).reshape(-1), model[t], out=self._residual[t], dtype=np.float32)
            self._stale(t)
        self._pending = [None] * len(self.layout)
        self._owed = [True] * len(self.layout)
        self._messages.clear()
        self._valid_from = version + 1
