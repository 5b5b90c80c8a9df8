"""Index and value coding on the wire (minimal: raw int32 indices, f32/f16/bf16 values).

Decoding never trusts its input: sizes, ranges and order are checked.
"""
from __future__ import annotations

import numpy as np

from .errors import CodecError

INDEX_CODINGS = ("raw32",)
VALUE_DTYPES = ("f32", "f16", "bf16")
_VALUE_ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2}


def encode_indices(idx: np.ndarray, numel: int, coding: str = "raw32") -> np.ndarray:
    if coding != "raw32":
        raise ValueError(f"unknown index coding {coding!r}")
    return np.ascontiguousarray(idx, dtype="<i4")


def decode_indices(buf, count: int, numel: int, coding: str = "raw32") -> np.ndarray:
    if coding not in INDEX_CODINGS:
        raise CodecError(f"unknown index coding {coding!r}; known: {list(INDEX_CODINGS)}")
    if len(buf) != 4 * count:
        raise CodecError(f"index frame has {len(buf)} bytes, expected {4 * count} for {count} raw32 indices")
    idx = np.frombuffer(buf, dtype="<i4")
    if count:
        if idx[0] < 0 or idx[-1] >= numel:
            raise CodecError(f"index out of range [0, {numel})")
        if count > 1 and not (np.diff(idx) > 0).all():
            raise CodecError("indices are not sorted strictly increasing (unsorted or duplicated)")
    return idx


def encode_values(values: np.ndarray, dtype: str = "f32") -> np.ndarray:
    v = np.ascontiguousarray(values, dtype=np.float32)
    if dtype == "f32":
        return v
    if dtype == "f16":
        return v.astype(np.float16)
    if dtype == "bf16":
        u = v.view(np.uint32)
        rounded = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
        return (rounded >> np.uint32(16)).astype(np.uint16)
    raise ValueError(f"unknown value dtype {dtype!r}")


def decode_values(buf, count: int, dtype: str = "f32") -> np.ndarray:
    size = _VALUE_ITEMSIZE.get(dtype)
    if size is None:
        raise CodecError(f"unknown value dtype {dtype!r}; known: {list(VALUE_DTYPES)}")
    if len(buf) != size * count:
        raise CodecError(f"value frame has {len(buf)} bytes, expected {size * count} for {count} {dtype} values")
    if dtype == "f32":
        return np.frombuffer(buf, dtype="<f4")
    if dtype == "f16":
        return np.frombuffer(buf, dtype="<f2").astype(np.float32)
    u = np.frombuffer(buf, dtype="<u2").astype(np.uint32) << np.uint32(16)
    return u.view(np.float32)
