"""Checked wrapper of ``native/flat.c`` in ``stella._native``: tensors in CPU memory,
each its own allocation, read and written as one flat float32 vector
(:class:`stella.flat.FlatParams` on CPU). The only caller of the flat functions of ``lib``.

A :class:`PartTable` is the C table of parts (``native/cdefs/flat.h``): one entry per
tensor in flat order, with its first flat coordinate, size, dtype and data pointer.
Sizes and dtypes are fixed when it is made; the pointers are the caller's to keep
current (:meth:`PartTable.point`): C writes wherever they say, so the caller holds the
tensors they point into for as long as the table is used. Buffers (``out``, ``anchor``,
values) are contiguous float32 CPU torch tensors or NumPy arrays, checked here;
indices are the wire's NumPy int32 arrays. Each call releases the GIL.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._native import ffi, lib
from .native_errors import check, require_abi

__all__ = ["PartTable", "DTYPES", "scatter_add"]

require_abi(lib, "stella._native")

DTYPES = {"f32": lib.STELLA_VAL_F32, "f16": lib.STELLA_VAL_F16, "bf16": lib.STELLA_VAL_BF16}
"""The dtypes a part may have (the parameters' float32, float16, bfloat16)."""


def _floats(x: Any, n: int, what: str, writable: bool) -> Any:
    """A C ``float *`` to the ``n`` floats of ``x`` (a contiguous float32 CPU torch tensor
    or NumPy array of exactly ``n`` elements), and the object that keeps it alive."""
    if isinstance(x, np.ndarray):
        if x.dtype != np.float32 or not x.flags.c_contiguous or x.size != n:
            raise ValueError(f"{what}: a contiguous float32 array of {n} elements expected, got "
                             f"{x.dtype} {x.shape}")
        if writable and not x.flags.writeable:
            raise ValueError(f"{what}: a read-only array")
        return ffi.from_buffer("float[]", x, require_writable=writable)
    dtype, device = getattr(x, "dtype", None), getattr(x, "device", None)
    if (str(dtype) != "torch.float32" or getattr(device, "type", None) != "cpu" or not x.is_contiguous()
            or x.numel() != n):
        raise ValueError(f"{what}: a contiguous float32 CPU tensor of {n} elements expected, got "
                         f"{dtype} {tuple(getattr(x, 'shape', ()))} on {device}")
    return ffi.cast("float *", x.data_ptr())


class PartTable:
    """The C table of parts of one flat vector (module doc): ``numels`` and ``dtypes``
    (names of :data:`DTYPES`) of the tensors in flat order; data pointers NULL until
    :meth:`point`."""

    def __init__(self, numels: Sequence[int], dtypes: Sequence[str]):
        if len(numels) != len(dtypes):
            raise ValueError("one dtype per part")
        if len(numels) >= 2**31:
            raise ValueError("too many parts")
        self.nparts = len(numels)
        self._c = ffi.new("stella_flat_part[]", max(1, self.nparts))
        at = 0
        for i, (n, d) in enumerate(zip(numels, dtypes)):
            if n < 0 or d not in DTYPES:
                raise ValueError(f"part {i}: bad size {n} or dtype {d!r}")
            self._c[i].start, self._c[i].numel, self._c[i].dtype = at, int(n), DTYPES[d]
            at += int(n)
        self.numel = at
        self.dtypes = list(dtypes)

    def point(self, i: int, ptr: int, dtype: str | None = None) -> None:
        """Part ``i``'s data is at address ``ptr`` (0: NULL, zeros when read, refused when
        written), of ``dtype`` when given (a gradient may differ from its parameter)."""
        self._c[i].data = ffi.cast("void *", ptr)
        if dtype is not None and dtype != self.dtypes[i]:
            if dtype not in DTYPES:
                raise ValueError(f"part {i}: bad dtype {dtype!r}")
            self._c[i].dtype, self.dtypes[i] = DTYPES[dtype], dtype

    def _range(self, lo: int, n: int) -> tuple[int, int]:
        lo, n = int(lo), int(n)
        if lo < 0 or n < 0 or lo + n > self.numel:
            raise ValueError(f"range [{lo}, {lo + n}) outside the flat vector's [0, {self.numel})")
        return lo, lo + n

    def gather(self, out: Any, lo: int = 0) -> None:
        """``out = w[lo, lo + len(out))``."""
        n = _len(out)
        a, b = self._range(lo, n)
        check(lib, lib.stella_flat_gather(self._c, self.nparts, a, b, _floats(out, n, "out", True)),
              "stella_flat_gather", ValueError)

    def residual(self, anchor: Any, out: Any, lo: int = 0) -> None:
        """``out = anchor - w[lo, lo + len(out))`` (``out`` may be ``anchor``)."""
        n = _len(out)
        a, b = self._range(lo, n)
        check(lib, lib.stella_flat_residual(self._c, self.nparts, a, b, _floats(anchor, n, "anchor", False),
                                            _floats(out, n, "out", True)), "stella_flat_residual", ValueError)

    def add_range(self, val: Any, lo: int) -> None:
        """``w[lo, lo + len(val)) += val`` (rounded to each part's dtype, as torch's ``add_``)."""
        n = _len(val)
        a, b = self._range(lo, n)
        check(lib, lib.stella_flat_add_range(self._c, self.nparts, a, b, _floats(val, n, "values", False)),
              "stella_flat_add_range", ValueError)

    def set_range(self, val: Any, lo: int) -> None:
        """``w[lo, lo + len(val)) = val`` (rounded to each part's dtype)."""
        n = _len(val)
        a, b = self._range(lo, n)
        check(lib, lib.stella_flat_set_range(self._c, self.nparts, a, b, _floats(val, n, "values", False)),
              "stella_flat_set_range", ValueError)

    def add_at(self, idx: np.ndarray, val: np.ndarray, base: int = 0) -> None:
        """``w[base + idx] += val`` (``idx`` strictly increasing int32; rounded as torch's
        ``index_add_`` of ``val`` in each part's dtype)."""
        self._sparse(lib.stella_flat_add_at, "stella_flat_add_at", idx, val, base)

    def set_at(self, idx: np.ndarray, val: np.ndarray, base: int = 0) -> None:
        """``w[base + idx] = val`` (rounded to each part's dtype)."""
        self._sparse(lib.stella_flat_set_at, "stella_flat_set_at", idx, val, base)

    def merge_at(self, idx: np.ndarray, val: np.ndarray, anchor: Any, base: int = 0, *, add: bool = True) -> None:
        """Update mode's merge at ``base + idx``: ``anchor[idx] += val`` (``add``) or
        ``= val``, and ``w[base + idx] +=`` the anchor's change (``anchor`` holds the
        coordinates ``base, base + 1, ...``; float32, writable)."""
        a = _floats(anchor, _len(anchor), "anchor", True)
        self._sparse(lib.stella_flat_merge_at, "stella_flat_merge_at", idx, val, base, a, _len(anchor), int(not add))

    def _sparse(self, fn: Any, what: str, idx: np.ndarray, val: np.ndarray, base: int, *extra: Any) -> None:
        if not (isinstance(idx, np.ndarray) and idx.dtype == np.int32 and idx.ndim == 1 and idx.flags.c_contiguous):
            raise ValueError(f"{what}: indices must be a 1-D contiguous int32 array")
        n = idx.shape[0]
        if not 0 <= int(base) <= self.numel:
            raise ValueError(f"{what}: base {base} outside [0, {self.numel}]")
        v = _floats(val, n, "values", False)
        check(lib, fn(self._c, self.nparts, int(base), ffi.from_buffer("int32_t[]", idx), v, n, *extra), what,
              ValueError)


def scatter_add(dst: Any, idx: np.ndarray, val: np.ndarray) -> None:
    """``dst[idx] += val`` for a contiguous float32 CPU tensor or array ``dst`` (``idx``
    strictly increasing int32): :meth:`PartTable.add_at` on a table of one part. The
    compressor's rounding error goes back into its residual this way (torch's
    ``index_put_(accumulate=True)`` took ~4x as long)."""
    n = _len(dst)
    _floats(dst, n, "dst", True)  # checked: a contiguous float32 CPU buffer
    table = PartTable([n], ["f32"])
    table.point(0, dst.ctypes.data if isinstance(dst, np.ndarray) else dst.data_ptr())
    table.add_at(idx, val)


def _len(x: Any) -> int:
    return int(x.size if isinstance(x, np.ndarray) else x.numel())
