"""Checked wrappers of ``native/codec.c`` (module ``stella._native``): index codings,
f16/bf16 conversion, q4/q2 quantisation and the finiteness scan of value frames.

The only caller of the codec functions of ``lib``; :mod:`stella.codec` is the public
API on top. Buffers go to C through ``ffi.from_buffer`` (typed, kept alive for the
call); sizes are checked before each call and return codes after it
(:func:`stella.native_errors.check`). The wire-name -> C-constant tables below are
the only place the ids appear in Python.
"""
from __future__ import annotations

import numpy as np

from ._native import ffi, lib
from .errors import BadValue, CodecError
from .native_errors import NativeIsa, check, isa_info, require_abi, warn_isa_fallback

require_abi(lib, "stella._native")
warn_isa_fallback(lib, "stella._native")

__all__ = [
    "INDEX_CODING_IDS",
    "VALUE_DTYPE_IDS",
    "byte_view",
    "idx_encode",
    "idx_decode",
    "rice_param",
    "f32_to_f16",
    "f32_to_bf16",
    "f16_to_f32",
    "bf16_to_f32",
    "values_check",
    "QCHUNK",
    "QUANT_BITS",
    "q_size",
    "q_encode",
    "q_round",
    "q_decode",
    "native_isa",
]

INDEX_CODING_IDS = {
    "raw32": lib.STELLA_IDX_RAW32,
    "varint": lib.STELLA_IDX_VARINT,
    "u16chunk": lib.STELLA_IDX_U16CHUNK,
    "rice": lib.STELLA_IDX_RICE,
    "block16": lib.STELLA_IDX_BLOCK16,
}
"""Wire name of an index coding -> its id in native/cdefs/codec.h."""

VALUE_DTYPE_IDS = {"f32": lib.STELLA_VAL_F32, "f16": lib.STELLA_VAL_F16, "bf16": lib.STELLA_VAL_BF16,
                   "q4": lib.STELLA_VAL_Q4, "q2": lib.STELLA_VAL_Q2}
"""Wire name of a value dtype -> its id in native/stella_native.h."""

QCHUNK: int = lib.STELLA_QCHUNK
"""Values per scale of the q4/q2 codings (native/cdefs/codec.h)."""

QUANT_BITS = {"q4": 4, "q2": 2}
"""Bits per code of each low-bit value dtype."""

# The fewest bits an index can take in each coding (raw32 4 bytes, varint 1 byte,
# u16chunk 2 bytes, rice 1 bit, block16 1 bit a block): a count the buffer cannot
# hold is refused before anything is allocated for it.
_MIN_BITS = {"raw32": 32, "varint": 8, "u16chunk": 16, "rice": 1, "block16": 1 / 16}



def native_isa() -> NativeIsa:
    """The x86-64 level of ``stella._native``'s dispatched kernels (top-k selection,
    f16/bf16 conversion); :func:`stella.native_isa` is the public name."""
    return isa_info(lib)


def byte_view(buf) -> np.ndarray:
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
    """Sorted unique indices -> coded bytes; ValueError for indices that are not."""
    cid = INDEX_CODING_IDS[coding]
    idx = np.asarray(idx)
    # other integer dtypes are converted, after a range check that int32 could not hold
    if idx.dtype != np.int32 and idx.size and (idx.dtype.kind not in "iu" or idx.min() < 0 or idx.max() >= numel):
        raise ValueError(f"indices must be integers in [0, {numel})")
    idx = np.ascontiguousarray(idx, dtype=np.int32).reshape(-1)
    count = idx.shape[0]
    bound = lib.stella_idx_bound(count, int(numel), cid)
    if bound < 0:
        raise ValueError(f"bad count {count} / numel {numel} for index coding {coding!r}")
    out = np.empty(max(bound, 1), dtype=np.uint8)
    n = lib.stella_idx_encode(ffi.from_buffer("int32_t[]", idx), count, int(numel), cid,
                              ffi.from_buffer("uint8_t[]", out), out.shape[0])
    if n == lib.STELLA_E_ARG and coding == "block16":
        raise ValueError("block16 needs whole aligned 16-element blocks (method='block')")
    # out of range or unsorted input to the encoder is the caller's bug, not corrupt data
    check(lib, n, f"{coding} encode: indices must be sorted, unique and in [0, {numel})", ValueError)
    return out[:n]


def idx_decode(buf, count: int, numel: int, coding: str) -> np.ndarray:
    """Coded bytes -> ``count`` int32 indices, strictly increasing, < numel; CodecError otherwise."""
    cid = INDEX_CODING_IDS.get(coding)
    if cid is None:
        raise CodecError(f"unknown index coding {coding!r}")
    count, numel = int(count), int(numel)
    if not (0 <= numel <= 2**31) or not (0 <= count <= numel):
        raise CodecError(f"impossible count {count} for numel {numel}")
    b = buf if type(buf) is memoryview and buf.c_contiguous else byte_view(buf)  # a frame: read in place
    nbytes = b.nbytes
    if count * _MIN_BITS[coding] > 8 * nbytes:
        raise CodecError(f"{coding}: {nbytes} bytes cannot hold {count} indices")
    out = np.empty(count, dtype=np.int32)
    rc = lib.stella_idx_decode(ffi.from_buffer("uint8_t[]", b), nbytes, count, numel, cid,
                               ffi.from_buffer("int32_t[]", out, require_writable=True))
    if rc < 0:  # (the message is made only for an error: every push decodes here)
        check(lib, rc, f"{coding} decode ({nbytes} bytes, {count} indices, numel {numel})", CodecError)
    return out


def rice_param(idx: np.ndarray) -> int:
    idx = np.ascontiguousarray(idx, dtype=np.int32).reshape(-1)
    return int(lib.stella_rice_param(ffi.from_buffer("int32_t[]", idx), idx.shape[0]))


_CTYPE = {np.float32: "float[]", np.uint16: "uint16_t[]"}


def _convert(fn, src: np.ndarray, src_dtype, dst_dtype) -> np.ndarray:
    """Element-wise float conversion by the C function ``fn(src, n, dst)``."""
    src = np.ascontiguousarray(src, dtype=src_dtype).reshape(-1)
    out = np.empty(src.shape[0], dtype=dst_dtype)
    fn(ffi.from_buffer(_CTYPE[src_dtype], src), src.shape[0],
       ffi.from_buffer(_CTYPE[dst_dtype], out, require_writable=True))
    return out


def f32_to_f16(v: np.ndarray) -> np.ndarray:
    return _convert(lib.stella_f32_to_f16, v, np.float32, np.uint16)


def f32_to_bf16(v: np.ndarray) -> np.ndarray:
    return _convert(lib.stella_f32_to_bf16, v, np.float32, np.uint16)


def f16_to_f32(h: np.ndarray) -> np.ndarray:
    return _convert(lib.stella_f16_to_f32, h, np.uint16, np.float32)


def bf16_to_f32(h: np.ndarray) -> np.ndarray:
    return _convert(lib.stella_bf16_to_f32, h, np.uint16, np.float32)


def values_check(values: np.ndarray, dtype: str) -> None:
    """BadValue unless every value of the contiguous 1-D array (float32, float16 or
    uint16 bf16 bits, as ``dtype`` says) is finite: one C pass, no conversion."""
    rc = lib.stella_values_check(ffi.from_buffer(values), values.shape[0], VALUE_DTYPE_IDS[dtype])
    if rc < 0:
        check(lib, rc, f"{dtype}: {values.shape[0]} values", BadValue)


_WIRE_DTYPES = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(np.uint16): "bf16"}


def sum_of_squares(values: np.ndarray) -> float:
    """The sum of the squares of a contiguous 1-D array of float32, float16 or uint16
    (bf16 bits) values, accumulated in float64: one C pass, no conversion."""
    dtype = _WIRE_DTYPES[values.dtype]
    out = ffi.new("double *")
    rc = lib.stella_values_sumsq(ffi.from_buffer(values), values.shape[0], VALUE_DTYPE_IDS[dtype], out)
    if rc < 0:
        check(lib, rc, f"{dtype}: {values.shape[0]} values", ValueError)
    return float(out[0])


def q_size(count: int, dtype: str) -> int:
    """Bytes of a ``dtype`` ("q4"/"q2") frame of ``count`` values."""
    return check(lib, lib.stella_q_size(int(count), VALUE_DTYPE_IDS[dtype]), f"{dtype}: {count} values", ValueError)


def _q_encode(values: np.ndarray, dtype: str, frame: bool) -> np.ndarray:
    """stella_q_encode: the frame (``frame``) or the values it decodes to (not ``frame``)."""
    v = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    n = v.shape[0]
    out = np.empty(q_size(n, dtype) if frame else n, dtype=np.uint8 if frame else np.float32)
    buf = ffi.from_buffer("uint8_t[]" if frame else "float[]", out, require_writable=True)
    rc = lib.stella_q_encode(ffi.from_buffer("float[]", v), n, VALUE_DTYPE_IDS[dtype],
                             buf if frame else ffi.NULL, out.shape[0] if frame else 0, ffi.NULL if frame else buf)
    check(lib, rc, f"{dtype} encode of {n} values", {lib.STELLA_E_NONFINITE: BadValue, None: ValueError})
    return out


def q_encode(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> the ``dtype`` ("q4"/"q2") frame; BadValue for NaN/Inf."""
    return _q_encode(values, dtype, True)


def q_round(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> the float32 values their ``dtype`` frame decodes to; BadValue for NaN/Inf."""
    return _q_encode(values, dtype, False)


def q_decode(buf, count: int, dtype: str) -> np.ndarray:
    """A ``dtype`` frame -> ``count`` float32 values. CodecError for a frame of the wrong
    size or with pad bits set, BadValue for a negative, NaN or Inf scale."""
    b = byte_view(buf)
    count = int(count)
    need = lib.stella_q_size(count, VALUE_DTYPE_IDS[dtype]) if 0 <= count < 2**62 else -1
    if need < 0:
        raise CodecError(f"{dtype}: impossible count {count}")
    if need != b.shape[0]:  # checked before anything is allocated for count
        raise CodecError(f"{dtype}: {b.shape[0]} bytes for {count} values (need {need})")
    out = np.empty(count, dtype=np.float32)
    rc = lib.stella_q_decode(ffi.from_buffer("uint8_t[]", b), b.shape[0], count, VALUE_DTYPE_IDS[dtype],
                             ffi.from_buffer("float[]", out, require_writable=True))
    check(lib, rc, f"{dtype} decode ({b.shape[0]} bytes, {count} values)",
          {lib.STELLA_E_SCALE: BadValue, None: CodecError})
    return out
