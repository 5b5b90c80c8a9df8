"""Checked wrapper of ``native/compress.c``: error feedback fused with top-k selection,
for contiguous float32 CPU tensors or NumPy arrays, over whichever cffi module holds
that code. Two do, each for its owner (``native/build_cffi.py``): the client's
``stella._native`` (the compressor, :mod:`stella.compress`, through
``stella._select_native``) and the server's ``stella_ps._kernel`` (its broadcast
selects from NumPy residuals, without torch, through :mod:`stella_ps.topk`), so that
each side's hot loop stays in its own module.

:class:`Selection` is the only caller of the selection functions of a ``lib``. The C
API takes typed structs (``native/cdefs/compress.h``): a :class:`TopkState` is carried
per tensor across steps, and a caller that wants the counters of a call passes a
:class:`SelectStats`. Buffers go to C through ``ffi.from_buffer`` (CPU tensors through
their ``.numpy()`` view); the C call releases the GIL. The server imports this public
module, never a private ``stella._*`` one.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .native_errors import check, require_abi, sparse_lists

__all__ = ["Selection", "TopkState", "SelectStats"]

_STAT_FIELDS = ("passes", "estimates", "trims", "givebacks", "units", "exact_fallback")


class TopkState:
    """Per-tensor selection state (the thresholds carried across steps), zeros at first;
    made by :meth:`Selection.state`."""

    __slots__ = ("_c",)

    def __init__(self, c: Any) -> None:
        self._c = c

    @property
    def last_threshold(self) -> float:
        """The last selection's threshold: what it left is at most this in magnitude."""
        return float(self._c.last_threshold)


class SelectStats:
    """Counters of one selection call, filled by C when passed in (benchmarks, tests):
    passes over the tensor, threshold estimates, trims, give-backs, units selected,
    and whether the exact fallback gave the threshold; made by :meth:`Selection.stats`."""

    __slots__ = ("_c",)

    def __init__(self, c: Any) -> None:
        self._c = c

    def as_dict(self) -> dict[str, int]:
        return {name: int(getattr(self._c, name)) for name in _STAT_FIELDS}


def _as_array(x, what: str) -> np.ndarray:
    """A contiguous 1-D float32 CPU view of a NumPy array or torch tensor (no copy)."""
    if not isinstance(x, np.ndarray):
        if x.dtype.is_floating_point is False or x.device.type != "cpu" or not x.is_contiguous():
            raise ValueError(f"{what} must be a contiguous float32 CPU tensor")
        x = x.detach().numpy()
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        raise ValueError(f"{what} must be a contiguous float32 array")
    return x.reshape(-1)


def _check_pair(res, grad) -> tuple[np.ndarray, np.ndarray | None]:
    r = _as_array(res, "residual")
    g = None if grad is None else _as_array(grad, "grad")
    if g is not None and g.shape[0] != r.shape[0]:
        raise ValueError("grad and residual sizes differ")
    if r.shape[0] > 2**31 - 1:
        raise ValueError("tensors of 2**31 elements or more are not supported")
    return r, g


class Selection:
    """The selection functions of one cffi module (``ffi``, ``lib``) built with the
    compress area, its ABI checked once here."""

    def __init__(self, ffi: Any, lib: Any, module_name: str):
        require_abi(lib, module_name)
        self._ffi, self._lib = ffi, lib
        self.block: int = lib.STELLA_BLOCK  # floats per block of the "block" method (native/cdefs/compress.h)
        self.max_adds: int = lib.STELLA_TOPK_MAX_ADDS  # sparse changes one ef_select call may add as it goes

    def state(self) -> TopkState:
        return TopkState(self._ffi.new("stella_topk_state *"))

    def stats(self) -> SelectStats:
        return SelectStats(self._ffi.new("stella_topk_stats *"))

    def ef_select(self, res, grad, k_units: int, unit: int, state: TopkState, nsample: int, seed: int,
                  stats: SelectStats | None = None, adds: Sequence[tuple[np.ndarray, np.ndarray]] = (),
                  threads: int = 1):
        """``res += grad`` (grad may be None); select about ``k_units`` units of largest
        magnitude (``unit`` 1: floats by ``|res|``; ``block``: whole blocks by squared
        norm), returned as sorted element indices; zero them in res. ``nsample`` units are
        sampled for the first threshold; ``state`` is updated, ``stats`` filled when given.

        ``adds``: sparse changes ``(indices, values)`` to add to ``res`` first, one after
        another (at most ``max_adds``; int32 indices, strictly increasing and in range;
        float32 values; unit 1, no ``grad``). The result is the same, bit for bit, as
        ``res[indices] += values`` for each and then the call without them; the first pass
        adds them a tile at a time as it goes.

        ``threads``: unit 1's pass runs on up to this many threads (ranges of at least 1M
        coordinates each), with the same result bit for bit.

        Returns (indices int32, values float32).
        """
        ffi, lib = self._ffi, self._lib
        r, g = _check_pair(res, grad)
        if unit not in (1, self.block):
            raise ValueError(f"unit must be 1 or {self.block}, got {unit}")
        if not isinstance(state, TopkState):
            raise TypeError("state must be a TopkState")
        if adds and (unit != 1 or g is not None):
            raise ValueError("adds: unit 1 and no grad only")
        if len(adds) > self.max_adds:
            raise ValueError(f"adds: at most {self.max_adds} lists")
        n = r.shape[0]
        nu = n if unit == 1 else (n + self.block - 1) // self.block
        k_units = max(1, min(int(k_units), nu))
        cap = lib.stella_topk_cap_units(k_units, nu)
        idx = np.empty(cap * unit, dtype=np.int32)
        val = np.empty(cap * unit, dtype=np.float32)
        score = np.empty(cap if unit != 1 else 1, dtype=np.float32)
        args = ffi.new("stella_topk_args *", {"k_units": k_units, "unit": unit, "nsample": int(nsample),
                                              "seed": int(seed) & (2**64 - 1), "threads": max(1, int(threads))})
        bufs = (ffi.from_buffer("int32_t[]", idx, require_writable=True),
                ffi.from_buffer("float[]", val, require_writable=True),
                ffi.from_buffer("float[]", score, require_writable=True))
        out = ffi.new("stella_topk_out *", {"idx": bufs[0], "val": bufs[1], "score": bufs[2], "cap_units": cap})
        res_c = ffi.from_buffer("float[]", r, require_writable=True)
        stats_c = ffi.NULL if stats is None else stats._c
        if not adds:
            grad_c = ffi.NULL if g is None else ffi.from_buffer("float[]", g)
            rc = lib.stella_ef_topk(res_c, grad_c, n, args, state._c, out, stats_c)
            check(lib, rc, "stella_ef_topk", ValueError)
        else:
            for ai, av in adds:
                if not (isinstance(ai, np.ndarray) and isinstance(av, np.ndarray) and ai.dtype == np.int32
                        and av.dtype == np.float32 and ai.ndim == av.ndim == 1 and ai.shape == av.shape
                        and ai.flags.c_contiguous and av.flags.c_contiguous):
                    raise ValueError("adds: 1-D contiguous int32 indices and float32 values of one length")
            lists, _keep = sparse_lists(ffi, adds)
            rc = lib.stella_ef_topk_add(res_c, n, lists, len(adds), args, state._c, out, stats_c)
            check(lib, rc, "stella_ef_topk_add", ValueError)
        return idx[:rc], val[:rc]
