"""Thin typed wrappers around ``stella._native`` for compression and wire coding.

This is the only client module that touches the cffi ``lib``: it checks
arguments, passes raw pointers (the C functions release the GIL), and turns
return codes into exceptions. Callers hand in contiguous float32/int32 data;
nothing here copies a large array.
"""
from __future__ import annotations

import numpy as np

from ._native import ffi, lib
from .errors import CodecError, StellaError

__all__ = [
    "new_state",
    "ef_threshold_select",
    "ef_block_select",
    "kth_largest_abs",
    "last_stats",
    "rice_encode",
    "rice_decode",
    "varint_encode",
    "varint_decode",
    "u16_encode",
    "u16_decode",
    "check_indices",
    "f32_to_f16",
    "f32_to_bf16",
    "f16_to_f32",
    "bf16_to_f32",
]

ABI_VERSION = 1
if lib.stella_abi_version() != ABI_VERSION:  # a stale build must fail loudly
    raise ImportError(
        f"stella._native ABI {lib.stella_abi_version()} != {ABI_VERSION}; re-run `make install`"
    )

STELLA_OK = 0
_ERRORS = {
    -1: "index out of range",
    -2: "indices not strictly increasing",
    -3: "non-finite value",
    -4: "corrupt or truncated coded bytes",
    -5: "bad argument",
    -6: "out of memory",
}
E_CORRUPT = -4
E_NOMEM = -6

_STATS = np.zeros(6, dtype=np.int64)


def _fail(rc: int, what: str) -> None:
    msg = f"{what}: {_ERRORS.get(int(rc), 'error')} (code {int(rc)})"
    if rc in (-1, -2, -4):
        raise CodecError(msg)
    if rc == E_NOMEM:
        raise MemoryError(msg)
    raise StellaError(msg)


def _fptr(t) -> "ffi.CData":
    return ffi.cast("float *", t.data_ptr())


def _np_ptr(a: np.ndarray, ctype: str):
    return ffi.cast(ctype, a.ctypes.data)


# ----------------------------------------------------------------- selection
def _ef_select(res, grad, k_units: int, unit: int, state: np.ndarray, nsample: int, seed: int):
    n = res.numel()
    nu = n if unit == 1 else (n + 15) // 16
    k_units = max(1, min(int(k_units), nu))
    cap = min(nu, 2 * k_units + 1024)
    idx = np.empty(cap * unit, dtype=np.int32)
    val = np.empty(cap * unit, dtype=np.float32)
    score = np.empty(cap if unit != 1 else 1, dtype=np.float32)
    if state.dtype != np.float32 or state.shape != (4,) or not state.flags.c_contiguous:
        raise ValueError("state must be a float32 array of 4 (zeros at first)")
    gp = ffi.NULL if grad is None else _fptr(grad)
    rc = lib.stella_ef_topk(
        _fptr(res), gp, n, k_units, unit, _np_ptr(state, "float *"), int(nsample), int(seed) & (2**64 - 1),
        _np_ptr(idx, "int32_t *"), _np_ptr(val, "float *"), _np_ptr(score, "float *"), cap,
        _np_ptr(_STATS, "int64_t *"),
    )
    if rc < 0:
        _fail(rc, "stella_ef_topk")
    return idx[:rc], val[:rc]


def _check_pair(res, grad) -> None:
    import torch

    if res.dtype != torch.float32 or res.device.type != "cpu" or not res.is_contiguous():
        raise ValueError("residual must be a contiguous float32 CPU tensor")
    if grad is not None:
        if grad.dtype != torch.float32 or grad.device.type != "cpu" or not grad.is_contiguous():
            raise ValueError("grad must be a contiguous float32 CPU tensor")
        if grad.numel() != res.numel():
            raise ValueError("grad and residual sizes differ")
    if res.numel() > 2**31 - 1:
        raise ValueError("tensors of 2**31 elements or more are not supported")


def new_state() -> np.ndarray:
    """Per-tensor selection state (threshold carried across steps)."""
    return np.zeros(4, dtype=np.float32)


def ef_threshold_select(res, grad, k: int, state: np.ndarray, nsample: int, seed: int):
    """``res += grad`` (grad may be None); select ~k largest |res| (sorted
    indices); zero them in res; ``state`` (see :func:`new_state`) is updated.

    Returns (indices int32, values float32).
    """
    _check_pair(res, grad)
    return _ef_select(res, grad, k, 1, state, nsample, seed)


def ef_block_select(res, grad, k: int, state: np.ndarray, nsample: int, seed: int):
    """Like :func:`ef_threshold_select` on whole 16-float blocks (by squared norm);
    ``k`` elements means ``round(k / 16)`` blocks, returned as element indices."""
    _check_pair(res, grad)
    kb = max(1, int(round(k / 16)))
    return _ef_select(res, grad, kb, 16, state, nsample, seed)


def last_stats() -> dict:
    """Counters of the last selection call (this thread's view; for benchmarks)."""
    s = _STATS.tolist()
    return dict(passes=s[0], estimates=s[1], trims=s[2], givebacks=s[3], units=s[4], exact_fallback=s[5])


def kth_largest_abs(v: np.ndarray, k: int) -> float:
    v = np.ascontiguousarray(v, dtype=np.float32)
    if not 1 <= k <= v.size:
        raise ValueError("need 1 <= k <= len(v)")
    return float(lib.stella_kth_largest_abs(_np_ptr(v, "float *"), v.size, int(k)))
