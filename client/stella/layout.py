r"""The flat model: one coordinate space for all of a model's tensors, on the workers
and on the server alike, the way DDP's buckets and FSDP's flat parameters lay a model
out.

A :class:`FlatLayout` puts the tensors one after another: first every tensor with at
least ``dense_below`` elements, in the order they were registered, then the smaller
ones (biases, norms), in the same order. The small ones thus make one contiguous
*dense suffix* ``[sparse_numel, numel)``: a push or a broadcast sends it whole, and the
top-k selection runs over one contiguous range, ``[0, sparse_numel)``, whatever the
number of tensors. The cut is the server's (``stella-ps --dense-below``, announced in
:class:`~stella.protocol.BroadcastInfo`), so every worker and shard computes the same
layout from the registered tensors.

A sharded job splits the flat space into contiguous ranges, one per shard
(:meth:`FlatLayout.shard_ranges`); on the wire every index is relative to its shard's
range, so a shard holds fewer than 2**31 coordinates. A server holds its range as at
most two :class:`Part`\ s, the tensors of its store and of the wire's entries: the large
tensors' coordinates in the range (a push selects among them) and the range's share of
the dense suffix (sent whole), whatever the number of the model's tensors.

NumPy only (the checkpoint file's reader lays a model out with it too); no torch: the
server uses it.
"""
from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["FlatLayout", "Part", "FlatUpdate", "FlatValues", "ALIGN", "MAX_NUMEL"]

MAX_NUMEL = 2**31 - 1  # coordinates one server holds at most: int32 indices on the wire

ALIGN = 16  # shard boundaries fall on multiples of this (whole 64-byte lines, whole blocks of the block method)


@dataclass(frozen=True)
class Part:
    """One of a server's tensors: flat coordinates ``[start, start + numel)`` of the model,
    ``whole``: the dense suffix's share (it travels whole)."""

    start: int
    numel: int
    whole: bool

    @property
    def stop(self) -> int:
        return self.start + self.numel

    @property
    def name(self) -> str:
        return "dense" if self.whole else "sparse"




@dataclass(frozen=True)
class FlatUpdate:
    """What one push carries, in the flat model's coordinates: ``values`` (float32) at
    ``indices`` (sorted unique int64), and ``dense``: the dense suffix's values whole
    (``numel - sparse_numel`` of them), or None. An index may fall in the dense suffix
    only when ``dense`` is None."""

    indices: np.ndarray
    values: np.ndarray
    dense: np.ndarray | None = None

    @property
    def count(self) -> int:
        return int(self.values.size) + (0 if self.dense is None else int(self.dense.size))


@dataclass(frozen=True)
class FlatValues:
    """Pulled values in the flat model's coordinates ``start + indices`` (``indices``
    sorted unique int32), or with ``indices`` None the run ``[start, start + values.size)``."""

    values: np.ndarray
    indices: np.ndarray | None = None
    start: int = 0


@dataclass(frozen=True)
class FlatLayout:
    """Where each registered tensor lives in the flat coordinate space (module doc)."""

    numels: tuple[int, ...]  # each tensor's size, in registration order
    dense_below: int
    order: tuple[int, ...] = field(init=False)  # tensor numbers (registration order) in flat order
    starts: tuple[int, ...] = field(init=False)  # each tensor's first flat coordinate, by tensor number
    numel: int = field(init=False)
    sparse_numel: int = field(init=False)  # the large tensors' coordinates: the dense suffix starts here

    def __post_init__(self) -> None:
        if self.dense_below < 0:
            raise ValueError(f"dense_below must be >= 0, got {self.dense_below}")
        large = [t for t, n in enumerate(self.numels) if n >= self.dense_below]
        small = [t for t, n in enumerate(self.numels) if n < self.dense_below]
        order = (*large, *small)
        starts = [0] * len(self.numels)
        at = 0
        for t in order:
            starts[t] = at
            at += self.numels[t]
        object.__setattr__(self, "order", order)
        object.__setattr__(self, "starts", tuple(starts))
        object.__setattr__(self, "numel", at)
        object.__setattr__(self, "sparse_numel", sum(self.numels[t] for t in large))

    @classmethod
    def of(cls, specs: Sequence[Any], dense_below: int) -> FlatLayout:
        """The layout of tensors given by anything with a ``numel`` (a TensorSpec) or a
        ``shape`` (an array, a tensor, a checkpoint's layout entry)."""
        def numel(s: Any) -> int:
            if hasattr(s, "numel"):
                n = s.numel
                return int(n() if callable(n) else n)
            shape = s["shape"] if isinstance(s, dict) else s.shape
            return int(np.prod(shape, dtype=np.int64))

        return cls(tuple(numel(s) for s in specs), int(dense_below))

    def span(self, tensor: int) -> tuple[int, int]:
        """Tensor ``tensor``'s flat range ``[start, stop)``."""
        start = self.starts[tensor]
        return start, start + self.numels[tensor]

    def spans(self) -> list[tuple[int, int, int]]:
        """``(tensor, start, stop)`` for every tensor, in flat order."""
        return [(t, *self.span(t)) for t in self.order]

    def shard_ranges(self, shards: int) -> list[tuple[int, int]]:
        """The flat space cut into ``shards`` contiguous ranges of about equal size,
        boundaries on multiples of :data:`ALIGN`; refused when a range would hold 2**31
        coordinates or more (int32 indices on the wire) or none."""
        if shards < 1:
            raise ValueError("a job needs at least one shard")
        cuts = [0, *(min(self.numel, round(self.numel * i / shards) // ALIGN * ALIGN) for i in range(1, shards)),
                self.numel]
        ranges = list(itertools.pairwise(cuts))
        if any(b <= a for a, b in ranges):
            raise ValueError(f"a model of {self.numel:,} coordinates leaves a shard of {shards} without any: "
                             "use fewer shards")
        if any(b - a > MAX_NUMEL for a, b in ranges):
            raise ValueError(f"a model of {self.numel:,} coordinates needs at least "
                             f"{-(-self.numel // MAX_NUMEL)} shards (a shard holds fewer than 2**31)")
        return ranges

    def parts(self, start: int = 0, stop: int | None = None) -> list[Part]:
        """The server's tensors for the range ``[start, stop)``: its large tensors'
        coordinates, then its share of the dense suffix (an empty one left out)."""
        stop = self.numel if stop is None else stop
        if not 0 <= start < stop <= self.numel:
            raise ValueError(f"range [{start}, {stop}) is not inside the model's {self.numel} coordinates")
        cut = min(max(self.sparse_numel, start), stop)
        return [p for p in (Part(start, cut - start, False), Part(cut, stop - cut, True)) if p.numel]

    def flatten(self, updates: Mapping[int, tuple[np.ndarray | None, np.ndarray]]) -> FlatUpdate:
        """Per-tensor updates (by tensor number: sorted indices inside the tensor, or None
        for all of it; values) as one :class:`FlatUpdate`: the dense suffix whole when
        every small tensor is given whole, else its coordinates among the indices."""
        small = self.order[len(self.order) - sum(1 for n in self.numels if n < self.dense_below):]
        whole = bool(small) and all(t in updates and updates[t][0] is None for t in small)
        idx, vals = [], []
        for t in self.order:
            if t not in updates or (whole and t in small):
                continue
            i, v = updates[t]
            v = np.asarray(v, np.float32).reshape(-1)
            idx.append(np.arange(v.size, dtype=np.int64) if i is None else np.asarray(i, np.int64))
            idx[-1] += self.starts[t]
            vals.append(v)
        dense = np.concatenate([np.asarray(updates[t][1], np.float32).reshape(-1) for t in small]) if whole else None
        return FlatUpdate(np.concatenate(idx) if idx else np.zeros(0, np.int64),
                          np.concatenate(vals) if vals else np.zeros(0, np.float32), dense)

    def per_tensor(self, pieces: Sequence[FlatValues]) -> dict[int, tuple[np.ndarray | None, np.ndarray]]:
        """Pulled pieces as per-tensor ``(indices in the tensor, or None for all of it;
        values)``, by tensor number (a tensor the pieces do not touch is left out)."""
        out: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        whole: dict[int, np.ndarray] = {}
        bounds = np.array([self.span(t)[0] for t in self.order] + [self.numel], np.int64)
        for piece in pieces:
            if piece.indices is None:
                lo, hi = piece.start, piece.start + piece.values.size
                for t, a, b in self.spans():
                    x, y = max(a, lo), min(b, hi)
                    if x >= y:
                        continue
                    if x == a and y == b:
                        whole[t] = piece.values[a - lo:b - lo]
                    else:
                        ix, vx = out.setdefault(t, ([], []))
                        ix.append(np.arange(x - a, y - a, dtype=np.int64))
                        vx.append(piece.values[x - lo:y - lo])
                continue
            cuts = np.searchsorted(piece.indices, bounds - piece.start)
            for j, t in enumerate(self.order):
                c0, c1 = cuts[j], cuts[j + 1]
                if c0 < c1:
                    ix, vx = out.setdefault(t, ([], []))
                    ix.append(piece.indices[c0:c1].astype(np.int64) + (piece.start - bounds[j]))
                    vx.append(piece.values[c0:c1])
        result: dict[int, tuple[np.ndarray | None, np.ndarray]] = {t: (None, v) for t, v in whole.items()}
        for t, (ix, vx) in out.items():
            result[t] = (np.concatenate(ix).astype(np.int32), np.concatenate(vx))
        return result

    def gather(self, values: Sequence[np.ndarray], start: int = 0, stop: int | None = None) -> np.ndarray:
        """The flat float32 vector ``[start, stop)`` of per-tensor ``values`` (by tensor
        number, any shape)."""
        stop = self.numel if stop is None else stop
        out = np.empty(stop - start, np.float32)
        for t, a, b in self.spans():
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                out[lo - start:hi - start] = np.asarray(values[t], np.float32).reshape(-1)[lo - a:hi - a]
        return out

    def tensors(self, flat: np.ndarray, start: int = 0) -> list[np.ndarray]:
        """Views of a flat vector (holding ``[start, start + len(flat))``) as each tensor's
        part of it, by tensor number (empty where the tensor is outside it)."""
        out = []
        stop = start + flat.shape[0]
        for t in range(len(self.numels)):
            a, b = self.span(t)
            lo, hi = max(a, start), min(b, stop)
            out.append(flat[lo - start:hi - start] if lo < hi else flat[:0])
        return out
