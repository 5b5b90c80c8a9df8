"""The broadcast's residual over the flat model, with the selection index that lets a
step's top-k cost what the step touched and selected, never the model's size.

The compressed broadcast keeps a residual ``R``: what the exact model is owed beyond
what the workers hold. Each step adds its change at the touched coordinates, takes the
coordinates of largest ``|R|`` out of ``R`` to send, and keeps the rest. Over the flat
coordinate space (:class:`stella.layout.FlatLayout`: the large tensors in
``[0, sparse_numel)``, then the dense suffix that always goes whole), a
:class:`FlatResidual` holds ``R`` and an index of its largest magnitudes that every
:meth:`~FlatResidual.add` keeps current in O(entries added), so that
:meth:`~FlatResidual.select` costs O(k) and no pass over ``R`` runs in a steady state.

The index (``native/residual.c``, whose header comment has the details and the
measurements behind its constants): coordinates bucketed by ``|R|`` at 16 buckets an
octave (the float's exponent and top 4 mantissa bits); per bucket an append-only list of
its coordinates, whose stale entries are told by reading ``R`` itself (an entry is valid
when the coordinate's bucket is still the list's) and dropped when they outnumber the
valid ones; only buckets at or above a *floor* are tracked (about 4 x k coordinates, the
ones under it being smaller than anything tracked). A selection takes whole buckets from
the top and the exact top of the boundary bucket by a radix select, and sorts the k
indices by a radix sort. It needs a full pass over a group's ``R`` only when its tracked
coordinates cannot supply k while smaller nonzeros exist (``full_passes`` counts them):
the residual's magnitudes fell below the floor, or a :meth:`~FlatResidual.load` replaced
it. Why this design: it holds nothing per coordinate beyond ``R`` itself (a bucket byte
per coordinate would cost a byte of every coordinate to save a read of ``R`` that the
validation does anyway), appends are sequential writes to a few hot list tails, and both
the selection and the sort are linear in k.

Memory: ``R``'s 4 bytes a coordinate; up to about 12 bytes per *tracked* coordinate (a
list entry, stale entries, list capacity); 16 bytes of work space per selected
coordinate, kept between calls. :attr:`FlatResidual.bytes` says what a residual holds
(``python -m bench.residual`` prints it per coordinate: 4.0-5.6 bytes, ``R`` included).

Against the streaming top-k (:mod:`.topk`, one fused pass over all of ``R``): at the same
touched count and k a step here costs the same on 10M and 100M coordinates (within 1.2x),
where the pass costs 4-9x; but the pass streams ``R`` at ~0.33 ns a coordinate, and at 2%
touched or more it is cheaper than the index's random accesses at the touched and the
selected coordinates (bench/RESULTS.md, "The flat residual's index"). The index pays
below about 1%.

Semantics: :meth:`~FlatResidual.add` is ``R[idx] += vals`` in float32, in index order;
:meth:`~FlatResidual.select` returns the exact top k of ``|R|`` in each group, ties going
to the lower index, and sets ``R`` to +0 there. Every result depends only on the sequence
of calls, never on what the index held (a checkpoint's replay gives the same bits).

Every input is checked here (dtype, shape, contiguity; sortedness, range and finiteness
by the C, before anything changes), and bad input raises
:class:`~stella_ps.errors.KernelInputError` and changes nothing. The C calls release the
GIL; one residual must not be used from two threads at once.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from stella.native_errors import check, require_abi, sparse_lists

from ._kernel import ffi, lib
from .errors import KernelError, KernelInputError

require_abi(lib, "stella_ps._kernel")

__all__ = ["FlatResidual", "KernelInputError", "MAX_LISTS"]

F32 = np.float32
MAX_LISTS = int(lib.STELLA_RESIDUAL_MAX_LISTS)
"""The most lists one :meth:`FlatResidual.add_lists` takes."""
_INT32_LIMIT = 2**31 - 1
_INPUT_ERRORS: dict[Any, type[BaseException]] = {
    lib.STELLA_E_RANGE: KernelInputError, lib.STELLA_E_ORDER: KernelInputError,
    lib.STELLA_E_NONFINITE: KernelInputError, lib.STELLA_E_ARG: KernelInputError, None: KernelError}


def _count(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise KernelInputError(f"{what} must be an int, got {type(value).__name__}")
    return int(value)


class FlatResidual:
    """``R``, float32 zeros of ``numel`` coordinates, with the index of its largest
    magnitudes over ``[0, sparse_numel)`` (module doc).

    ``groups``: the boundaries ``0 = b_0 < b_1 < ... < b_G = sparse_numel`` of the groups
    (e.g. the large tensors' spans) that :meth:`select` gives a quota each; None: one group,
    the whole sparse range (none when ``sparse_numel`` is 0).
    """

    def __init__(self, numel: int, sparse_numel: int, groups: Sequence[int] | np.ndarray | None = None):
        numel, sparse_numel = _count(numel, "numel"), _count(sparse_numel, "sparse_numel")
        if not 0 <= numel <= _INT32_LIMIT:
            raise KernelInputError(f"numel {numel} outside [0, 2**31 - 1]")
        if not 0 <= sparse_numel <= numel:
            raise KernelInputError(f"sparse_numel {sparse_numel} outside [0, numel = {numel}]")
        if groups is None:
            bounds = np.array([0, sparse_numel] if sparse_numel else [0], np.int64)
        else:
            bounds = np.asarray(groups)
            if bounds.ndim != 1 or bounds.dtype.kind not in "iu":
                raise KernelInputError("groups must be a 1-D sequence of int boundaries")
            bounds = bounds.astype(np.int64)
            if (bounds.size < 1 or bounds[0] != 0 or bounds[-1] != sparse_numel
                    or (bounds.size == 1) != (sparse_numel == 0) or np.any(np.diff(bounds) <= 0)):
                raise KernelInputError(f"groups must be strictly increasing boundaries from 0 to sparse_numel = "
                                       f"{sparse_numel}, got {bounds.tolist()[:8]}...")
        self.numel = numel
        self.sparse_numel = sparse_numel
        self.bounds = bounds
        self.bounds.flags.writeable = False
        self._r = np.zeros(numel, F32)
        self._view = self._r.view()
        self._view.flags.writeable = False
        ptr = lib.stella_residual_new(ffi.from_buffer("float[]", self._r, require_writable=True), numel,
                                      sparse_numel, ffi.from_buffer("int64_t[]", bounds), bounds.size - 1)
        if ptr == ffi.NULL:
            raise MemoryError(f"cannot allocate the index of a {numel}-coordinate residual")
        self._st = ffi.gc(ptr, lib.stella_residual_free)
        self._stats = ffi.new("stella_residual_stats *")

    @property
    def groups(self) -> int:
        """How many groups :meth:`select` takes a quota for."""
        return int(self.bounds.size - 1)

    @property
    def residual(self) -> np.ndarray:
        """``R`` itself (a read-only view: change it through :meth:`add`, :meth:`select`,
        :meth:`take_dense` and :meth:`load` only, or the index no longer matches it)."""
        return self._view

    def add(self, idx: np.ndarray, vals: np.ndarray) -> None:
        """``R[idx] += vals``: ``idx`` sorted unique int32 in ``[0, numel)``, ``vals``
        finite float32 of its length (both 1-D, contiguous). Costs O(len(idx))."""
        self.add_lists([(idx, vals)])

    def add_lists(self, lists: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        """:meth:`add` of each ``(idx, vals)`` of ``lists`` in turn (at most
        :data:`MAX_LISTS`), in one sweep: ``R`` is read and written once per coordinate,
        which gets its values in list order (the same floats as one :meth:`add` a list):
        a step's coding error and its change in one call. (Measured no faster than an add
        a list: the merge costs about what the second sweep saves.) All lists are checked
        before anything changes."""
        if len(lists) > MAX_LISTS:
            raise KernelInputError(f"add_lists: at most {MAX_LISTS} lists, got {len(lists)}")
        what = "add" if len(lists) == 1 else "add_lists"
        for n, pair in enumerate(lists):
            at = "" if len(lists) == 1 else f" (list {n})"
            try:
                idx, vals = pair
            except (TypeError, ValueError):
                raise KernelInputError(f"{what}{at}: expected an (indices, values) pair") from None
            if (not isinstance(idx, np.ndarray) or idx.dtype != np.int32 or idx.ndim != 1
                    or not idx.flags.c_contiguous):
                raise KernelInputError(f"{what}{at}: indices must be a contiguous 1-D int32 array")
            if (not isinstance(vals, np.ndarray) or vals.dtype != F32 or vals.ndim != 1
                    or not vals.flags.c_contiguous):
                raise KernelInputError(f"{what}{at}: values must be a contiguous 1-D float32 array")
            if vals.shape[0] != idx.shape[0]:
                raise KernelInputError(f"{what}{at}: {vals.shape[0]} values for {idx.shape[0]} indices")
        c_lists, _keep = sparse_lists(ffi, lists)
        bad, where = ffi.new("int32_t *"), ffi.new("int64_t *")
        rc = lib.stella_residual_add_lists(self._st, c_lists, len(lists), bad, where)
        if rc < 0 and lists:
            idx, vals = lists[bad[0]]
            at = "" if len(lists) == 1 else f" (list {bad[0]})"
            if rc == lib.STELLA_E_RANGE:
                raise KernelInputError(f"{what}{at}: index {int(idx[where[0]])} at position {where[0]} is outside "
                                       f"[0, {self.numel})")
            if rc == lib.STELLA_E_ORDER:
                raise KernelInputError(f"{what}{at}: indices not strictly increasing at position {where[0]}")
            if rc == lib.STELLA_E_NONFINITE:
                raise KernelInputError(f"{what}{at}: value {float(vals[where[0]])} at position {where[0]} is not "
                                       "finite")
        check(lib, rc, what, _INPUT_ERRORS)

    def select(self, k: int | Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` coordinates of largest ``|R|`` in ``[0, sparse_numel)`` (an int, with one
        group), or ``k[g]`` in each group ``g`` (a sequence, one per group): exactly as many
        as there are nonzeros when fewer; between equal magnitudes the lower index first.
        Returns their sorted int32 indices and float32 values (``R``'s there), and sets
        ``R`` to +0 there. The dense suffix is never selected (:meth:`take_dense`)."""
        if isinstance(k, (int, np.integer)) and not isinstance(k, bool):
            if self.groups != 1 and not (self.groups == 0 and k == 0):
                raise KernelInputError(f"select: {self.groups} groups need one k each, got an int")
            ks = np.array([int(k)] * self.groups, np.int64)
        else:
            try:
                ks = np.asarray(k)
            except (TypeError, ValueError):
                raise KernelInputError("select: k must be an int or a sequence of ints") from None
            if ks.ndim != 1 or ks.shape[0] != self.groups or (ks.size and ks.dtype.kind not in "iu"):
                raise KernelInputError(f"select: {self.groups} groups need one int k each, got {ks.shape} {ks.dtype}")
            ks = np.ascontiguousarray(ks, np.int64)
        sizes = np.diff(self.bounds)
        bad = np.flatnonzero((ks < 0) | (ks > sizes))
        if bad.size:
            g = int(bad[0])
            raise KernelInputError(f"select: k = {int(ks[g])} outside [0, {int(sizes[g])}] for group {g}")
        total = int(ks.sum())
        idx, vals = np.empty(total, np.int32), np.empty(total, F32)
        n = check(lib, lib.stella_residual_select(
            self._st, ffi.from_buffer("int64_t[]", ks), self.groups,
            ffi.from_buffer("int32_t[]", idx, require_writable=True),
            ffi.from_buffer("float[]", vals, require_writable=True), total), "select", KernelError)
        if n == total:
            return idx, vals
        return idx[:n].copy(), vals[:n].copy()

    def take_dense(self) -> np.ndarray:
        """A float32 copy of the dense suffix ``R[sparse_numel:]``, which becomes +0 (it goes
        whole)."""
        out = self._r[self.sparse_numel:].copy()
        self._r[self.sparse_numel:] = 0.0
        return out

    @property
    def values(self) -> np.ndarray:
        """``R`` itself, writable, for a caller that changes it in bulk (the broadcast's
        streaming pass, where a step touches too much for the index to pay): call
        :meth:`invalidate` after, and the next selection rebuilds the index."""
        return self._r

    def invalidate(self) -> None:
        """``R`` was changed through :attr:`values`: each group's index is rebuilt by its
        next selection (one pass over it, counted in :attr:`full_passes`)."""
        lib.stella_residual_invalidate(self._st)

    def load(self, r: np.ndarray) -> None:
        """Set ``R`` wholesale (a checkpoint's residual: ``numel`` finite float32 values, any
        shape); each group's index is rebuilt by its next selection (one pass over it,
        counted in :attr:`full_passes`)."""
        if not isinstance(r, np.ndarray) or r.dtype != F32 or r.size != self.numel:
            raise KernelInputError(f"load: R must be a float32 array of {self.numel} values")
        flat = r.reshape(-1)
        if not np.isfinite(flat).all():
            raise KernelInputError("load: R holds NaN or Inf")
        np.copyto(self._r, flat)
        lib.stella_residual_invalidate(self._st)

    def _read_stats(self) -> Any:
        lib.stella_residual_stats_get(self._st, self._stats)
        return self._stats

    @property
    def full_passes(self) -> int:
        """Passes a group's index made over all of that group's ``R`` (refills, and the
        rebuilds after :meth:`load`)."""
        return int(self._read_stats().full_passes)

    @property
    def bytes(self) -> int:
        """Bytes this residual holds: ``R`` and the index (lists, tables, work space)."""
        return int(self._read_stats().bytes) + self._r.nbytes

    @property
    def tracked(self) -> int:
        """Coordinates the index tracks (at or above their group's floor)."""
        return int(self._read_stats().tracked)

    def verify(self) -> None:
        """Tests: raise :class:`~stella_ps.errors.KernelError` unless the index matches ``R``
        (O(numel))."""
        check(lib, lib.stella_residual_verify(self._st), "verify: the index does not match R", KernelError)
