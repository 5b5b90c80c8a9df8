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

A process that is a worker of its own is a :class:`Solo` site: it leads, and its
collectives do nothing, so the optimizer treats both alike (:func:`site_for`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .errors import PipelineError

if dist.is_available():
    # torch.distributed.nn.functional evaluates ``group=group.WORLD`` into its functions' defaults when it is
    # imported, and torch imports it lazily: the first optimizer built (torch._dynamo's import) does. Imported after
    # the user's init_process_group, it holds the default group for good, so destroy_process_group cannot join gloo's
    # threads, and one of them, letting go of a finished collective's tensor while the interpreter shuts down, aborts
    # the process ("terminate called without an active exception"). So it is imported here, and stella's import
    # loads this module when torch is already loaded: before the script's init_process_group.
    import torch.distributed.nn.functional

__all__ = ["Site", "Solo", "site_for", "resolve_group"]

DEFAULT = "default"
T = TypeVar("T")


def resolve_group(process_group: Any) -> Any:
    """The group a :class:`Site` is made of: ``"default"`` means the default group when
    ``torch.distributed`` is initialised with more than one rank (else none); None: none."""
    if process_group == DEFAULT:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return dist.group.WORLD
        return None
    return process_group


def site_for(process_group: Any) -> Site | Solo:
    """The site a process belongs to: its group's (:func:`resolve_group`), or its own."""
    group = resolve_group(process_group)
    return Solo() if group is None else Site(group)


class Solo:
    """A worker of its own: it leads, and there is no one to average with or tell."""

    size = 1
    leads = True
    may_run_on = True  # a round may run on with more local steps (no other rank has to agree)

    def average(self, tensors: Iterable[torch.Tensor]) -> None:
        pass

    def broadcast(self, tensors: Iterable[torch.Tensor]) -> None:
        pass

    def from_leader(self, fn: Callable[[], T]) -> T:
        return fn()

    def release(self) -> None:
        pass


class _Failed:
    """What the other ranks get when the leader's call raised: its words (an exception
    need not pickle)."""

    def __init__(self, exc: BaseException):
        self.words = f"{type(exc).__name__}: {exc}"


class Site:
    """The ranks of one process group; rank 0 of the group leads."""

    # every rank would have to agree on running on, each step: a site's rounds keep their length
    may_run_on = False

    def __init__(self, group: Any):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._leader = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0

    @property
    def leads(self) -> bool:
        """This rank speaks to the server."""
        return self.rank == 0

    def release(self) -> None:
        """Let go of the group (the optimizer closed): a reference kept here would keep the
        group, and gloo's threads, alive past the user's ``destroy_process_group()`` (see the
        import of ``torch.distributed.nn.functional`` above for why that aborts at exit)."""
        self.group = None

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
        box = [obj if self.leads else None]
        dist.broadcast_object_list(box, src=self._leader, group=self.group)
        return box[0]

    def from_leader(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the leader, its result returned on every rank. When it raises, the
        leader raises it and every other rank a :class:`~stella.errors.PipelineError`
        naming it, so that no rank waits for a result that will not come."""
        if not self.leads:
            out = self.share(None)
            if isinstance(out, _Failed):
                raise PipelineError(f"the site's leader failed: {out.words}")
            return out
        try:
            out = fn()
        except BaseException as e:
            self.share(_Failed(e))
            raise
        return self.share(out)
