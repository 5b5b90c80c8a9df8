"""The payloads of pushes, deltas and registrations: a message's tensor entries and
their raw frames to arrays and back.

:func:`decode_tensors` checks a push's or delta's entries (which
:func:`stella.protocol.decode_request` already proved well framed) against the
model's layout, decodes the indices (strictly increasing, in range) and checks
that the values are finite: what it returns, :class:`SparseTensor`, is what the
kernel may trust without checking again. :func:`encode_tensors` is the one
encoder of pushes and deltas, :func:`concat_entries` joins encoded parts (their
frame numbers renumbered), and a registration's values and digest are read and
made here too.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from . import codec
from .errors import BadValue, CodecError, ErrorCode, OversizedMessage, ProtocolError, ServerError
from .layout import Part
from .protocol import IndexCoding, Received, Register, TensorEntry, TensorSpec, ValueDtype, tag_of

__all__ = ["SparseTensor", "encode_tensors", "concat_entries", "decode_tensors", "decode_register_values",
           "model_digest", "part_specs"]


@dataclass(frozen=True, slots=True)
class SparseTensor:
    """One tensor's part of a push or delta, decoded and proved valid against the
    model: ``indices`` strictly increasing int32 inside the tensor (None: dense, every
    coordinate in order) and ``values`` as they travelled (float32, float16, or bf16
    bit patterns as uint16; q4/q2 dequantised to float32), all finite. The one shape of a
    sparse tensor from the wire to the kernel and back: :func:`decode_tensors` makes it
    (so the kernel applies it without checking again), the server's store holds it, and
    :func:`encode_tensors` takes it (then ``values`` are float32 to be coded)."""

    tensor: int
    indices: np.ndarray | None
    values: np.ndarray


def decode_tensors(rx: Received, layout: Sequence[TensorSpec], *, float32: bool = False,
                   sumsq: list[float] | None = None) -> list[SparseTensor]:
    """Check a push's or delta's entries against ``layout`` and decode them: values as
    they travelled (the server's kernel reads f16 and bf16 as they are), or with
    ``float32`` as float32 (what a worker adds to its replica), in the same pass.
    ``sumsq``: a list to which the sum of the squares of each tensor's values (float64,
    the push norm's parts) is appended; the one C pass over the values that sums them
    also proves them finite (a float32's square is finite in float64, and so is the sum
    of fewer than 2**31 of them), so it costs nothing beside the check.

    Raises :class:`ServerError` with code ``unknown_tensor`` for a tensor not in the
    layout, :class:`OversizedMessage` for more values than the tensor has,
    :class:`ProtocolError` for a dense entry of the wrong count, :class:`CodecError`
    for corrupt indices (or q4/q2 pad bits) and :class:`~stella.errors.BadValue` for
    NaN or Inf (or a negative, NaN or Inf q4/q2 scale)."""
    out = []
    frames = rx.frames
    for e in rx.msg.tensors:
        t, count = e.tensor, e.count
        if t >= len(layout):
            raise ServerError(f"{tag_of(rx.msg)}: tensor {t} is not in the model (0..{len(layout) - 1})",
                              ErrorCode.UNKNOWN_TENSOR)
        spec = layout[t]
        numel = spec.numel
        if count > numel:
            raise OversizedMessage(f"{tag_of(rx.msg)}: tensor {spec.name!r}: {count} values > its {numel} elements")
        if e.index_frame is None:
            if count != numel:
                raise ProtocolError(f"{tag_of(rx.msg)}: dense tensor {spec.name!r} needs {numel} values, got {count}")
            idx = None
        else:
            try:
                idx = codec.decode_indices(frames[e.index_frame], count, numel, e.coding)
            except CodecError as err:
                raise CodecError(f"{tag_of(rx.msg)}: tensor {spec.name!r} index frame ({e.coding}): {err}") from None
        try:
            if sumsq is None:
                vals = codec.wire_values(frames[e.value_frame], count, e.value_dtype)
            else:
                vals, ss = codec.wire_values_sumsq(frames[e.value_frame], count, e.value_dtype)
                sumsq.append(ss)
            if float32:
                vals = codec.to_float32(vals)
        except ProtocolError as err:
            raise type(err)(f"{tag_of(rx.msg)}: tensor {spec.name!r} value frame ({e.value_dtype}): {err}") from None
        out.append(SparseTensor(t, idx, vals))
    return out


def model_digest(values: Sequence[np.ndarray]) -> bytes:
    """SHA-256 of a model's values as its registration sends them (per tensor, in the
    layout's order: its element count, then its float32 bytes): what ``Register.digest``
    carries and what the server compares with the values the model was created with."""
    h = hashlib.sha256()
    for v in values:
        a = np.ascontiguousarray(v, dtype="<f4").reshape(-1)
        h.update(a.size.to_bytes(8, "little"))
        h.update(a.data)  # large updates run without the GIL
    return h.digest()


def part_specs(parts: Sequence[Part]) -> list[TensorSpec]:
    """A server's parts of the flat model (:mod:`stella.layout`) as its tensors, what the
    wire's entries name."""
    return [TensorSpec(p.name, (p.numel,), "float32") for p in parts]


def decode_register_values(rx: Received, parts: Sequence[TensorSpec]) -> list[np.ndarray]:
    """The initial float32 values a ``register`` with ``values`` carries, one flat array
    per part of the server's range (``parts``); raises :class:`CodecError` for a frame
    of the wrong size and :class:`~stella.errors.BadValue` naming the first part with a
    NaN or Inf."""
    msg = rx.msg
    assert isinstance(msg, Register) and msg.values
    if len(rx.frames) != len(parts):
        raise ProtocolError(f"register: expected {len(parts)} value frames (the parts of the range), "
                            f"got {len(rx.frames)}")
    out = []
    for spec, frame in zip(parts, rx.frames):
        if frame.nbytes != 4 * spec.numel:
            raise CodecError(f"register: part {spec.name!r} value frame: {frame.nbytes} bytes for "
                             f"{spec.numel} float32 values (need {4 * spec.numel})")
        try:
            out.append(codec.wire_values(frame, spec.numel, "f32"))
        except BadValue:
            raise BadValue(f"register: part {spec.name!r} has NaN/Inf initial values") from None
    return out


def encode_tensors(
    tensors: Sequence[SparseTensor],
    layout: Sequence[TensorSpec],
    coding: IndexCoding,
    value_dtype: ValueDtype,
) -> tuple[list[TensorEntry], list[Any]]:
    """Entries and payload frames for sparse tensors (sorted unique indices or None for
    dense; float32 values, sent as ``value_dtype``): the one encoder of pushes and deltas."""
    entries: list[TensorEntry] = []
    frames: list[Any] = []
    for s in tensors:
        t, idx, vals = s.tensor, s.indices, s.values
        if idx is None:
            entries.append(TensorEntry(t, int(vals.size), "dense", value_dtype, None, len(frames)))
        else:
            entries.append(TensorEntry(t, int(idx.size), coding, value_dtype, len(frames), len(frames) + 1))
            frames.append(codec.encode_indices(idx, layout[t].numel, coding))
        frames.append(codec.encode_values(vals, value_dtype))
    return entries, frames


def concat_entries(parts: Iterable[tuple[Sequence[TensorEntry], Sequence[Any]]]) -> tuple[list[TensorEntry], list[Any]]:
    """Several (entries, frames) pairs, as :func:`encode_tensors` returns them, joined
    into one: each pair's frames follow the previous pairs', and its entries' frame
    numbers move with them."""
    entries: list[TensorEntry] = []
    frames: list[Any] = []
    for part_entries, part_frames in parts:
        off = len(frames)
        entries += [msgspec.structs.replace(e, index_frame=None if e.index_frame is None else e.index_frame + off,
                                            value_frame=e.value_frame + off) for e in part_entries]
        frames += part_frames
    return entries, frames
