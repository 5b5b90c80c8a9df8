"""Wire coding of sparse pushes: sorted indices and float values.

The server imports this module to decode what workers send, so decoding never
trusts its input: the C decoders bounds-check every read, check every index
``< numel`` and strictly increasing, demand that the stream ends exactly at the
end of the buffer, and :class:`~stella.errors.CodecError` is raised for anything
else. The byte-level formats are in ``docs/compression.md``.

Index codings (``INDEX_CODINGS``), all of sorted unique int32 indices of a
tensor of ``numel`` elements, ``count`` of them (count and numel travel in the
message header, not in these bytes):

``"raw32"``      little-endian int32, 4 bytes an index.
``"varint"``     LEB128 of the gaps ``idx[i] - idx[i-1] - 1`` (``idx[-1] = -1``).
``"u16chunk"``   per nonempty 65536-element chunk: varint chunk gap, varint
                 (entries - 1), then the little-endian u16 offsets in the chunk.
``"rice"``       one byte ``b``, then Golomb-Rice codes of the gaps with
                 parameter ``2**b`` (``b`` chosen by the encoder to minimise the
                 size exactly), bit-packed LSB first. The most compact for
                 scattered sets: ~8.1 bits an index at 1% density. Default.
``"block16"``    only for sets made of whole aligned 16-element blocks (the
                 ``"block"`` method's output; the tensor's last block may be
                 short): the block numbers ``idx // 16``, Rice-coded as above.
                 ~0.5 bits an index at 1% density.

Value dtypes (``VALUE_DTYPES``): ``"f32"`` (little-endian IEEE float32),
``"f16"`` (IEEE binary16, round to nearest even, overflow to +-inf),
``"bf16"`` (upper half of float32 after round to nearest even; NaN -> 0x7fc0
with its sign, as torch), and for pushes only (``QUANT_DTYPES``) ``"q4"`` and
``"q2"``: per chunk of ``QCHUNK`` (64) values a float32 scale, the chunk's largest
magnitude ``m``, then 4- or 2-bit codes of the mid-rise levels ``+-m/(L-1), +-3m/(L-1),
..., +-m`` (``L = 2**bits``), all scales first, then all codes; 4.5 and 2.5 bits a
value. :func:`quantise` gives the values a receiver decodes, so that a sender can
keep the quantisation error (error feedback).

Every coding of zero indices or values is the empty byte string.

The wire's facts that the rest of the package reasons with live here too: the bits a
value costs in each coding (:data:`VALUE_BITS`) and a coordinate with its Rice-coded
index (:func:`coordinate_bits`), the codings an adaptive push or a plan chooses among
(:data:`CODINGS`). The dense cut, which tensors travel whole, is the server's
(``stella-ps --dense-below``, in its ``joined`` reply).

The C code is ``native/codec.c`` behind the checked wrapper ``stella._codec_native``
(index coding ids, f16/bf16 conversion, q4/q2 quantisation, the finiteness scan of
:func:`wire_values`).
"""
from __future__ import annotations

import math
import sys
from typing import Any, Literal

import numpy as np

from . import _codec_native as _native
from .errors import BadValue, CodecError

__all__ = [
    "INDEX_CODINGS",
    "VALUE_DTYPES",
    "QUANT_DTYPES",
    "QUANT_BITS",
    "QCHUNK",
    "VALUE_BITS",
    "CODINGS",
    "coordinate_bits",
    "broadcast_share",
    "broadcast_bits",
    "dense_coding",
    "DEFAULT_INDEX_CODING",
    "DEFAULT_VALUE_DTYPE",
    "encode_indices",
    "decode_indices",
    "encode_values",
    "decode_values",
    "wire_values",
    "quantise",
    "sum_of_squares",
    "to_float32",
    "value_frame_size",
    "rice_parameter",
]

INDEX_CODINGS: tuple[str, ...] = tuple(_native.INDEX_CODING_IDS)
VALUE_DTYPES: tuple[str, ...] = tuple(_native.VALUE_DTYPE_IDS)
DEFAULT_INDEX_CODING = "rice"
DEFAULT_VALUE_DTYPE = "f16"

QUANT_DTYPES: tuple[str, ...] = tuple(_native.QUANT_BITS)
QUANT_BITS: dict[str, int] = dict(_native.QUANT_BITS)
QCHUNK: int = _native.QCHUNK

_ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2}

# Bits a value costs on the wire: its item, or for q4/q2 its code and a share of its chunk's float32 scale.
VALUE_BITS: dict[str, float] = {**{d: 8.0 * n for d, n in _ITEMSIZE.items()},
                                 **{d: b + 32.0 / QCHUNK for d, b in QUANT_BITS.items()}}
ValueDtype = Literal["f32", "f16", "bf16", "q4", "q2"]  # the value codings (VALUE_DTYPES), typed
# The codings an adaptive push (stella.adapt) or a plan chooses among, best first.
CODINGS: tuple[ValueDtype, ...] = ("f16", "q4", "q2")


def dense_coding(coding: str) -> ValueDtype:
    """The coding of values that travel whole (the dense suffix of small tensors, in a push
    or the server's broadcast) when the rest go as ``coding``: f16 for q4/q2 (a 4- or
    2-bit code has no zero and one scale per 64 values, so a whole tensor's small changes
    beside its large ones would each move by a step of the largest), else ``coding``."""
    return "f16" if coding in QUANT_BITS else coding  # type: ignore[return-value]


def coordinate_bits(density: float, coding: str) -> float:
    """Bits a pushed coordinate costs: its value, and its Rice-coded index (gaps of
    mean ``1/density``: about ``log2(1/density) + 2`` bits)."""
    return VALUE_BITS[coding] + math.log2(1.0 / density) + 2.0


def broadcast_share(density: float, coding: str) -> float:
    """What a coordinate pushed in ``coding`` at ``density`` counts for in the server's
    broadcast budget (``--broadcast-factor`` times the pushes' coordinates): its bits
    against an f16 coordinate's, at most 1. The budget follows the pushes' bytes, so
    that a pull stays about a push whatever its coding (q4 at 2%: 0.51, so the broadcast
    carries about 2% where an f16 push's 1% gets 2%; bench/RESULTS.md "A push's bytes on
    twice the coordinates": more of it cost iterations too); f16, bf16 and f32 pushes count
    in full."""
    if density <= 0.0:
        return 1.0
    return min(1.0, coordinate_bits(density, coding) / coordinate_bits(density, "f16"))


def broadcast_bits(density: float, factor: float, values: str, coding: str = "f16") -> float:
    """Bits per model coordinate of a broadcast answering pushes of ``density`` in
    ``coding``: ``factor`` times their coordinates, each counted by
    :func:`broadcast_share` (at most all), each its value in ``values`` and its Rice-coded
    index. Exact pulls are factor 1 in f32 with f16's count (the pushed coordinates with
    their float32 values, whatever the pushes' coding)."""
    k = min(1.0, factor * density * broadcast_share(density, coding))
    return k * coordinate_bits(k, values)


_LITTLE = sys.byteorder == "little"


def value_frame_size(dtype: str, count: int) -> int:
    """Bytes of the wire frame of ``count`` values of ``dtype``: ``itemsize * count``,
    or for q4/q2 ``4 * ceil(count / QCHUNK) + ceil(count * bits / 8)``."""
    if dtype in QUANT_BITS:
        return _native.q_size(count, dtype)
    try:
        return _ITEMSIZE[dtype] * int(count)
    except KeyError:
        raise ValueError(f"value dtype must be one of {VALUE_DTYPES}, got {dtype!r}") from None


def encode_indices(idx: np.ndarray, numel: int, coding: str) -> np.ndarray:
    """Sorted unique int32 indices (each < numel) -> coded bytes (a uint8 array).

    Raises ValueError for an unknown coding or indices that are not sorted,
    unique and in range (a bug of the caller, not corrupt input), and for
    "block16" when the set is not made of whole 16-element blocks.
    """
    if coding not in INDEX_CODINGS:
        raise ValueError(f"index coding must be one of {INDEX_CODINGS}, got {coding!r}")
    return _native.idx_encode(idx, numel, coding)


def decode_indices(buf, count: int, numel: int, coding: str) -> np.ndarray:
    """Coded bytes -> ``count`` int32 indices, strictly increasing, each < numel.

    ``buf`` is any contiguous buffer (bytes, memoryview, uint8 array, zmq frame
    buffer). Raises CodecError if the bytes are corrupt or truncated, have
    trailing bytes, or decode to indices out of range or not strictly
    increasing, and for an unknown coding or impossible count.
    """
    if coding not in INDEX_CODINGS:
        raise CodecError(f"unknown index coding {coding!r}")
    return _native.idx_decode(buf, count, numel, coding)


def encode_values(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> wire bytes (a uint8 array, :func:`value_frame_size` long).

    q4/q2 raise BadValue for NaN or Inf (f32/f16/bf16 carry them, and the server
    refuses them)."""
    value_frame_size(dtype, 0)
    v = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    if dtype in QUANT_BITS:
        return _native.q_encode(v, dtype)
    if dtype == "f32":
        if not _LITTLE:  # pragma: no cover - big-endian hosts
            v = v.astype("<f4")
        return v.view(np.uint8)
    if dtype == "f16":
        out = _native.f32_to_f16(v)
    else:
        out = _native.f32_to_bf16(v)
    if not _LITTLE:  # pragma: no cover
        out = out.byteswap()
    return out.view(np.uint8)


_WIRE_VIEW: dict[str, np.dtype[Any]] = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2"), "bf16": np.dtype("<u2")}


def _wire_view(buf, count: int, dtype: str) -> np.ndarray:
    """``buf`` as ``count`` values of ``dtype`` as they travel (float32, float16, or
    uint16 bf16 bit patterns), read-only, aligned (copied only when ``buf`` is not).
    Raises CodecError when the size is not ``count * itemsize`` or the dtype is unknown."""
    size = _ITEMSIZE.get(dtype)
    if size is None:
        raise CodecError(f"unknown value dtype {dtype!r}")
    count = int(count)
    dt = _WIRE_VIEW[dtype]
    if type(buf) is memoryview and buf.c_contiguous:  # a frame, read in place
        if count < 0 or buf.nbytes != count * size:
            raise CodecError(f"{dtype}: {buf.nbytes} bytes for {count} values (need {count * size})")
        v = np.frombuffer(buf, dt)
    else:
        b = _native.byte_view(buf)
        if count < 0 or b.size != count * size:
            raise CodecError(f"{dtype}: {b.size} bytes for {count} values (need {count * size})")
        v = b.view(dt)
    if not v.flags.aligned:  # (flags, not .ctypes: a microsecond less a frame)
        v = np.frombuffer(v.tobytes(), dt)
    return v


def decode_values(buf, count: int, dtype: str) -> np.ndarray:
    """Wire bytes -> ``count`` float32 values (for "f32" possibly a read-only view
    of ``buf``). Raises CodecError when the size is not :func:`value_frame_size` or
    the dtype is unknown. NaN and Inf pass through (:func:`wire_values` is the
    checked decoder the server uses); q4/q2 frames cannot hold them, and a scale
    that is negative, NaN or Inf raises BadValue."""
    if dtype in QUANT_BITS:
        return _native.q_decode(buf, count, dtype)
    v = _wire_view(buf, count, dtype)
    if dtype == "f32":
        return v if _LITTLE else v.astype(np.float32)
    h = v.view(np.uint16)
    if not _LITTLE:  # pragma: no cover
        h = h.astype(np.uint16)
    return _native.f16_to_f32(h) if dtype == "f16" else _native.bf16_to_f32(h)


def wire_values(buf, count: int, dtype: str) -> np.ndarray:
    """Wire bytes -> a read-only view of ``count`` values as they travel: float32 for
    "f32", float16 for "f16", uint16 bit patterns for "bf16" (the kernel reads all
    three); q4/q2 frames are dequantised (in C) into a new float32 array. Raises
    CodecError when the size is not :func:`value_frame_size`, the dtype is unknown or a
    q4/q2 pad bit is set, and BadValue when a value is NaN or Inf or a q4/q2 scale is
    negative, NaN or Inf: what this returns is safe to hand to the kernel unchecked."""
    if dtype in QUANT_BITS:
        return _native.q_decode(buf, count, dtype)
    v = _wire_view(buf, count, dtype)
    _native.values_check(v, dtype)  # one C pass over the bits, no conversion
    return v


def wire_values_sumsq(buf, count: int, dtype: str) -> tuple[np.ndarray, float]:
    """:func:`wire_values` and the sum of the squares of the values (float64), from one C
    pass: a sum that is finite proves every value finite (a float32's square is below
    2**256, and fewer than 2**31 of them sum below 2**287); a sum that is not is
    answered by the check's own refusal. Raises as :func:`wire_values` does."""
    if dtype in QUANT_BITS:
        v = _native.q_decode(buf, count, dtype)
        return v, _native.sum_of_squares(v)
    v = _wire_view(buf, count, dtype)
    ss = _native.sum_of_squares(v)
    if not math.isfinite(ss):
        _native.values_check(v, dtype)  # raises BadValue, naming the dtype and the count
        raise BadValue(f"{dtype}: {count} values: not finite")  # pragma: no cover - the check raised
    return v, ss


def to_float32(values: np.ndarray) -> np.ndarray:
    """Wire values as :func:`wire_values` returns them (float32, float16, or bf16 bit
    patterns as uint16) as float32, exactly (a float32 array is returned as it is)."""
    if values.dtype == np.uint16:  # bf16: the upper half of a float32
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32, copy=False)


def sum_of_squares(values: np.ndarray) -> float:
    """The sum of the squares of wire values (float32, float16 or uint16 bf16 bits, a
    contiguous 1-D array), accumulated in float64: one C pass, no conversion."""
    return _native.sum_of_squares(values)


def quantise(values: np.ndarray, dtype: str) -> np.ndarray:
    """The float32 values a receiver decodes from ``encode_values(values, dtype)``
    for ``dtype`` "q4"/"q2" (without building the frame): each within half a step,
    ``m / (L - 1)``, of its input, and quantising them again changes nothing.
    BadValue for NaN or Inf."""
    if dtype not in QUANT_BITS:
        raise ValueError(f"quantise: dtype must be one of {QUANT_DTYPES}, got {dtype!r}")
    return _native.q_round(values, dtype)


def rice_parameter(idx: np.ndarray) -> int:
    """The Rice parameter ``b`` the encoder would choose for these indices."""
    return _native.rice_param(idx)
