"""Thin typed wrappers around ``stella._native`` for compression and wire coding.

This is the only client module that touches the cffi ``lib``: it checks
arguments, passes raw pointers (the C functions release the GIL), and turns
return codes into exceptions. Callers hand in contiguous float32/int32 data;
nothing here copies a large array.
"""
from __future__ import annotations

import threading

import numpy as np

from ._native import ffi, lib
from .errors import CodecError, StellaError

__all__ = [
    "new_state",
    "ef_threshold_select",
    "ef_block_select",
    "kth_largest_abs",
    "last_stats",
    "CODING_IDS",
    "idx_encode",
    "idx_decode",
    "rice_param",
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

_TLS = threading.local()  # last_stats() per thread (the kernels run with the GIL released)


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
    stats = np.zeros(6, dtype=np.int64)
    rc = lib.stella_ef_topk(
        _fptr(res), gp, n, k_units, unit, _np_ptr(state, "float *"), int(nsample), int(seed) & (2**64 - 1),
        _np_ptr(idx, "int32_t *"), _np_ptr(val, "float *"), _np_ptr(score, "float *"), cap,
        _np_ptr(stats, "int64_t *"),
    )
    _TLS.stats = stats
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
    """Counters of this thread's last selection call (for benchmarks and tests)."""
    s = getattr(_TLS, "stats", np.zeros(6, dtype=np.int64)).tolist()
    return dict(passes=s[0], estimates=s[1], trims=s[2], givebacks=s[3], units=s[4], exact_fallback=s[5])


def kth_largest_abs(v: np.ndarray, k: int) -> float:
    v = np.ascontiguousarray(v, dtype=np.float32)
    if not 1 <= k <= v.size:
        raise ValueError("need 1 <= k <= len(v)")
    return float(lib.stella_kth_largest_abs(_np_ptr(v, "float *"), v.size, int(k)))


# ------------------------------------------------------------------- codec
CODING_IDS = {"raw32": 0, "varint": 1, "u16": 2, "rice": 3, "block16": 4}


def _u8(buf) -> np.ndarray:
    """A read-only uint8 view of any contiguous buffer (bytes, memoryview, ndarray, zmq frame)."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise CodecError("coded buffer is not contiguous")
        return buf.reshape(-1).view(np.uint8)
    try:
        return np.frombuffer(buf, dtype=np.uint8)
    except (TypeError, ValueError) as e:
        raise CodecError(f"not a contiguous byte buffer: {e}") from None


def idx_encode(idx: np.ndarray, numel: int, coding: str) -> np.ndarray:
    cid = CODING_IDS[coding]
    idx = np.asarray(idx)
    if idx.dtype != np.int32:
        if idx.size and (idx.dtype.kind not in "iu" or idx.min() < 0 or idx.max() >= numel):
            raise ValueError(f"indices must be integers in [0, {numel})")
    idx = np.ascontiguousarray(idx, dtype=np.int32).reshape(-1)
    count = idx.size
    bound = lib.stella_idx_bound(count, int(numel), cid)
    if bound < 0:
        raise ValueError(f"bad count {count} / numel {numel} for index coding {coding!r}")
    out = np.empty(max(bound, 1), dtype=np.uint8)
    n = lib.stella_idx_encode(
        _np_ptr(idx, "int32_t *"), count, int(numel), cid, _np_ptr(out, "uint8_t *"), out.size
    )
    if n < 0:
        if n in (-1, -2):
            raise ValueError(f"indices must be sorted, unique and in [0, {numel}): {_ERRORS[n]}")
        if n == -5 and coding == "block16":
            raise ValueError("block16 needs whole aligned 16-element blocks (method='block')")
        _fail(n, "stella_idx_encode")
    return out[:n]


def idx_decode(buf, count: int, numel: int, coding: str) -> np.ndarray:
    cid = CODING_IDS.get(coding)
    if cid is None:
        raise CodecError(f"unknown index coding {coding!r}")
    count, numel = int(count), int(numel)
    if not (0 <= numel <= 2**31) or not (0 <= count <= numel):
        raise CodecError(f"impossible count {count} for numel {numel}")
    b = _u8(buf)
    # every index costs at least 4 bytes (raw32), 1 byte (varint), 2 bytes (u16), 1 bit (rice):
    # refuse before allocating for a count the buffer cannot hold
    floor_bits = {0: 32, 1: 8, 2: 16, 3: 1, 4: 1 / 16}[cid]
    if count * floor_bits > 8 * b.size:
        raise CodecError(f"{coding}: {b.size} bytes cannot hold {count} indices")
    out = np.empty(count, dtype=np.int32)
    rc = lib.stella_idx_decode(
        _np_ptr(b, "uint8_t *") if b.size else ffi.NULL, b.size, count, numel, cid,
        _np_ptr(out, "int32_t *") if count else ffi.NULL,
    )
    if rc < 0:
        if rc == -5:
            raise CodecError(f"{coding}: bad arguments (count {count}, numel {numel})")
        if rc == -1:
            raise CodecError(f"{coding}: index out of range [0, {numel})")
        if rc == -2:
            raise CodecError(f"{coding}: indices not sorted strictly increasing (unsorted or duplicated)")
        raise CodecError(f"{coding}: corrupt, truncated or out-of-range index stream "
                         f"({b.size} bytes, {count} indices, numel {numel})")
    return out


def rice_param(idx: np.ndarray) -> int:
    idx = np.ascontiguousarray(idx, dtype=np.int32)
    return int(lib.stella_rice_param(_np_ptr(idx, "int32_t *"), idx.size))


_CTYPE = {np.float32: "float *", np.uint16: "uint16_t *"}


def _convert(fn, src: np.ndarray, src_dtype, dst_dtype) -> np.ndarray:
    """Element-wise float conversion by the C function ``fn(src, n, dst)``."""
    src = np.ascontiguousarray(src, dtype=src_dtype)
    out = np.empty(src.size, dtype=dst_dtype)
    fn(_np_ptr(src, _CTYPE[src_dtype]), src.size, _np_ptr(out, _CTYPE[dst_dtype]))
    return out


def f32_to_f16(v: np.ndarray) -> np.ndarray:
    return _convert(lib.stella_f32_to_f16, v, np.float32, np.uint16)


def f32_to_bf16(v: np.ndarray) -> np.ndarray:
    return _convert(lib.stella_f32_to_bf16, v, np.float32, np.uint16)


def f16_to_f32(h: np.ndarray) -> np.ndarray:
    return _convert(lib.stella_f16_to_f32, h, np.uint16, np.float32)


def bf16_to_f32(h: np.ndarray) -> np.ndarray:
    return _convert(lib.stella_bf16_to_f32, h, np.uint16, np.float32)
