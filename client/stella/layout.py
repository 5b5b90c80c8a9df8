"""The flat model: one coordinate space for all of a model's tensors, on the workers
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
range, so a shard holds fewer than 2**31 coordinates.

No torch here: the server uses it too.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .protocol import MAX_NUMEL, TensorSpec

__all__ = ["FlatLayout", "ALIGN"]

ALIGN = 16  # shard boundaries fall on multiples of this (whole 64-byte lines, whole blocks of the block method)


@dataclass(frozen=True)
class FlatLayout:
    """Where each registered tensor lives in the flat coordinate space (module doc)."""

    specs: tuple[TensorSpec, ...]
    dense_below: int
    order: tuple[int, ...] = field(init=False)  # tensor numbers (registration order) in flat order
    starts: tuple[int, ...] = field(init=False)  # each tensor's first flat coordinate, by tensor number
    numel: int = field(init=False)
    sparse_numel: int = field(init=False)  # the large tensors' coordinates: the dense suffix starts here

    def __post_init__(self) -> None:
        if self.dense_below < 0:
            raise ValueError(f"dense_below must be >= 0, got {self.dense_below}")
        large = [t for t, s in enumerate(self.specs) if s.numel >= self.dense_below]
        small = [t for t, s in enumerate(self.specs) if s.numel < self.dense_below]
        order = (*large, *small)
        starts = [0] * len(self.specs)
        at = 0
        for t in order:
            starts[t] = at
            at += self.specs[t].numel
        object.__setattr__(self, "order", order)
        object.__setattr__(self, "starts", tuple(starts))
        object.__setattr__(self, "numel", at)
        object.__setattr__(self, "sparse_numel", sum(self.specs[t].numel for t in large))

    @classmethod
    def of(cls, specs: Sequence[TensorSpec], dense_below: int) -> FlatLayout:
        return cls(tuple(specs), int(dense_below))

    def span(self, tensor: int) -> tuple[int, int]:
        """Tensor ``tensor``'s flat range ``[start, stop)``."""
        start = self.starts[tensor]
        return start, start + self.specs[tensor].numel

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
        for t in range(len(self.specs)):
            a, b = self.span(t)
            lo, hi = max(a, start), min(b, stop)
            out.append(flat[lo - start:hi - start] if lo < hi else flat[:0])
        return out
