"""A site: the ranks of one machine or LAN that combine over ``torch.distributed``
first (NCCL on GPUs, gloo on CPU) and speak to ``stella-ps`` through one leader.

Inside a site the links are fast and dense collectives are cheap; between sites they
are slow. So :class:`~stella.StellaOptimizer` given a process group (or, by default,
the default group when ``torch.distributed`` is initialised) makes the group one
Stella worker: every rank computes on its own data; at each round the ranks average
(update mode: their weights, one all-reduce; gradient mode: their gradients, every
step) and the group's rank 0, the *leader*, alone compresses, pushes and pulls; it
then shares what the server answered (and what it sent) with the other ranks, which
install the same, so the ranks stay identical. The server sees one worker per site
and the WAN carries one worker's bytes per site, however many GPUs it has.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["Site", "resolve_group"]

DEFAULT = "default"


def resolve_group(process_group: Any) -> Any:
    """The group a :class:`Site` is made of: ``"default"`` means the default group when
    ``torch.distributed`` is initialised with more than one rank (else none); None: none."""
    if process_group == DEFAULT:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return dist.group.WORLD
        return None
    return process_group


class Site:
    """The ranks of one process group; rank 0 of the group leads."""

    def __init__(self, group: Any):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._leader = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def average(self, tensors: Iterable[torch.Tensor]) -> None:
        """Every rank's tensors become the mean over the ranks (in place; one all-reduce
        per dtype and device, over a flat buffer)."""
        by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            by_kind.setdefault((t.dtype, t.device), []).append(t)
        for group in by_kind.values():
            flat = _flatten_dense_tensors(group)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            flat.div_(self.size)
            for t, v in zip(group, _unflatten_dense_tensors(flat, group)):
                t.copy_(v)

    def broadcast(self, tensors: Iterable[torch.Tensor]) -> None:
        """The leader's tensors, to every rank (in place)."""
        for t in tensors:
            dist.broadcast(t, src=self._leader, group=self.group)

    def share(self, obj: Any) -> Any:
        """The leader's ``obj`` (any picklable value), returned on every rank."""
        box = [obj if self.is_leader else None]
        dist.broadcast_object_list(box, src=self._leader, group=self.group)
        return box[0]
