"""The checkpoint file: the server's model and optimizer state at one version.

One file holds everything ``stella-ps`` needs to resume: the version, the model (its
tensors' names, shapes and dtypes, the dense cut that lays it out flat, and the range
of the flat model the server held: :mod:`stella.layout`), the server's tensors (the
parts of that range), the optimizer configuration, and for every server tensor every
state array the store keeps for that optimizer (``param`` and e.g. ``exp_avg``,
``exp_avg_sq``, ``step``; or ``momentum_buf``: whatever the kernel's
``state_arrays()`` names, so the outer step of update mode is covered the same
way). NumPy, the standard library and :mod:`stella.layout` only: the server writes and
reads it, and ``stella export`` (which alone imports torch) reads it too. A file
without a model (written before the flat layout) lists the model's tensors as the
server's tensors.

Layout, little-endian::

    b"STELLACK"  u32 format   u64 header_len   header (JSON, UTF-8)   u32 crc32(header)
    padding to 64 bytes
    the arrays, each at the offset the header gives, 64-byte aligned
    b"STELLEND"

The header lists every array with its tensor, name, dtype, offset, byte count and
CRC-32, and the file's total size: :func:`read` refuses a file that is truncated,
extended, or whose header or any array fails its checksum (:class:`CheckpointError`),
so a corrupt checkpoint is never loaded. :func:`write` writes atomically: a
temporary file in the same directory, fsync, rename, fsync of the directory; a
crash leaves either the old set of files or the new one.
"""
from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from .errors import StellaError
from .layout import FlatLayout

__all__ = ["Checkpoint", "CheckpointError", "write", "read", "read_header", "names", "file_name", "temporary_name",
           "is_temporary", "iter_valid", "layout_of", "FORMAT", "SUFFIX"]

MAGIC = b"STELLACK"
END = b"STELLEND"
FORMAT = 1
SUFFIX = ".stella-ckpt"
_ALIGN = 64
_CHUNK = 64 << 20  # bytes checksummed / written at a time
_DTYPES = {"float32": np.float32, "uint32": np.uint32}


class CheckpointError(StellaError, ValueError):
    """A checkpoint file that is truncated, corrupt, or not a checkpoint."""


@dataclass
class Checkpoint:
    """What a checkpoint holds. ``tensors[i]`` maps state-array names to flat arrays
    for the server's tensor ``layout[i]`` (a dict with ``name``, ``shape``, ``dtype``).
    ``model``: the model they are a range of (``tensors``: its layout as such dicts,
    ``dense_below``, ``start``, ``stop``); None in a file written before the flat
    layout, whose ``layout`` is the model's own."""

    version: int
    layout: list[dict[str, Any]]
    optimizer: dict[str, Any]
    tensors: list[dict[str, np.ndarray]]
    created: float = 0.0
    model: dict[str, Any] | None = None

    def params(self) -> tuple[dict[str, np.ndarray], list[str]]:
        """The model's parameters this checkpoint holds whole, by tensor name, shaped as
        registered (float32), and the names of those it holds only part of (a shard's
        range cuts them)."""
        if self.model is None:
            return {spec["name"]: arrays["param"].reshape(spec["shape"])
                    for spec, arrays in zip(self.layout, self.tensors)}, []
        specs = self.model["tensors"]
        flat = FlatLayout.of(specs, self.model["dense_below"])
        start, stop = int(self.model["start"]), int(self.model["stop"])
        values = np.concatenate([a["param"] for a in self.tensors])
        whole, cut = {}, []
        for t, spec in enumerate(specs):
            a, b = flat.span(t)
            if start <= a and b <= stop:
                whole[spec["name"]] = values[a - start:b - start].reshape(spec["shape"])
            elif a < stop and start < b:
                cut.append(spec["name"])
        return whole, cut


def _pad(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _crc(a: np.ndarray) -> int:
    mv = a.data.cast("B")
    c = 0
    for i in range(0, len(mv), _CHUNK):
        c = zlib.crc32(mv[i:i + _CHUNK], c)
    return c


def write(path: str, ckpt: Checkpoint) -> int:
    """Write ``ckpt`` to ``path`` atomically; returns the file's size in bytes."""
    entries, offset = [], 0
    flat: list[np.ndarray] = []
    for t, arrays in enumerate(ckpt.tensors):
        for name in sorted(arrays):
            a = np.ascontiguousarray(arrays[name]).reshape(-1)
            if a.dtype.name not in _DTYPES:
                raise CheckpointError(f"tensor {t} {name}: unsupported dtype {a.dtype}")
            entries.append({"tensor": t, "name": name, "dtype": a.dtype.name, "offset": offset,
                            "nbytes": a.nbytes, "crc32": _crc(a)})
            flat.append(a)
            offset = _pad(offset + a.nbytes)
    header = {"format": FORMAT, "version": ckpt.version, "layout": ckpt.layout, "optimizer": ckpt.optimizer,
              "created": ckpt.created, "arrays": entries, "model": ckpt.model}
    hb = json.dumps(header, separators=(",", ":")).encode()
    # the header's trailer: its checksum and the file's total size (a file cut anywhere is detected)
    base = _pad(len(MAGIC) + 12 + len(hb) + 12)
    total = base + offset + len(END)
    head = MAGIC + struct.pack("<IQ", FORMAT, len(hb)) + hb + struct.pack("<IQ", zlib.crc32(hb), total)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, temporary_name(os.path.basename(path)))
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            f.write(b"\0" * (base - len(head)))
            pos = 0
            for e, a in zip(entries, flat):
                f.write(b"\0" * (e["offset"] - pos))
                mv = a.data.cast("B")
                for i in range(0, len(mv), _CHUNK):
                    f.write(mv[i:i + _CHUNK])
                pos = e["offset"] + a.nbytes
            f.write(b"\0" * (offset - pos))
            f.write(END)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:  # gone, or a directory that became read-only: the write's own error is the one to raise
            pass
        raise
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash
    finally:
        os.close(fd)
    return total


def _read_head(f: BinaryIO, path: str) -> tuple[dict[str, Any], int, int]:
    start = f.read(len(MAGIC) + 12)
    if len(start) < len(MAGIC) + 12 or not start.startswith(MAGIC):
        raise CheckpointError(f"{path}: not a Stella checkpoint (bad magic)")
    fmt, hlen = struct.unpack("<IQ", start[len(MAGIC):])
    if fmt != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {fmt}, this version reads {FORMAT}")
    if hlen > 1 << 30:
        raise CheckpointError(f"{path}: header length {hlen} is implausible")
    hb = f.read(hlen)
    tail = f.read(12)
    if len(hb) != hlen or len(tail) != 12:
        raise CheckpointError(f"{path}: truncated header")
    crc, total = struct.unpack("<IQ", tail)
    if zlib.crc32(hb) != crc:
        raise CheckpointError(f"{path}: header checksum mismatch")
    try:
        header = json.loads(hb)
    except ValueError as e:
        raise CheckpointError(f"{path}: header is not JSON: {e}") from None
    return header, _pad(len(MAGIC) + 12 + hlen + 12), total


def read_header(path: str) -> dict[str, Any]:
    """The checked header alone (version, layout, optimizer, arrays), without the arrays."""
    with open(path, "rb") as f:
        return _read_head(f, path)[0]


def read(path: str) -> Checkpoint:
    """Read and verify a checkpoint (size, header and every array's checksum); raises
    :class:`CheckpointError` for any damage, ``OSError`` when it cannot be read."""
    with open(path, "rb") as f:
        header, base, total = _read_head(f, path)
        size = os.fstat(f.fileno()).st_size
        if size != total:
            raise CheckpointError(f"{path}: {size} bytes, the header says {total} (truncated or extended)")
        try:
            layout = list(header["layout"])
            tensors: list[dict[str, np.ndarray]] = [{} for _ in layout]
            for e in header["arrays"]:
                dt = _DTYPES.get(e["dtype"])
                if dt is None or not 0 <= e["tensor"] < len(layout):
                    raise CheckpointError(f"{path}: bad array entry {e}")
                a = np.empty(e["nbytes"] // np.dtype(dt).itemsize, dt)
                f.seek(base + e["offset"])
                if f.readinto(a.data.cast("B")) != e["nbytes"]:
                    raise CheckpointError(f"{path}: truncated array {e['name']} of tensor {e['tensor']}")
                if _crc(a) != e["crc32"]:
                    raise CheckpointError(f"{path}: checksum mismatch in {e['name']} of tensor {e['tensor']}")
                tensors[e["tensor"]][e["name"]] = a
            f.seek(total - len(END))
            if f.read(len(END)) != END:
                raise CheckpointError(f"{path}: bad end marker")
            for spec, arrays in zip(layout, tensors):
                numel = int(np.prod(spec["shape"], dtype=np.int64))
                if "param" not in arrays or any(a.size != numel for a in arrays.values()):
                    raise CheckpointError(f"{path}: tensor {spec['name']!r} lacks its parameters or has arrays "
                                          f"of the wrong size")
            model = header.get("model")
            if model is not None:
                model = {"tensors": list(model["tensors"]), "dense_below": int(model["dense_below"]),
                         "start": int(model["start"]), "stop": int(model["stop"])}
            return Checkpoint(int(header["version"]), layout, dict(header["optimizer"]), tensors,
                              float(header.get("created", 0.0)), model)
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{path}: malformed header: {e!r}") from None


def names(directory: str) -> list[str]:
    """Checkpoint files in ``directory``, newest (highest version, then newest write) first."""
    try:
        files = [n for n in os.listdir(directory) if n.endswith(SUFFIX) and not n.startswith(".")]
    except FileNotFoundError:
        return []
    return sorted(files, reverse=True)  # the names carry a zero-padded version and sequence


def file_name(version: int, seq: int) -> str:
    return f"ckpt-{version:015d}-{seq:06d}{SUFFIX}"


def temporary_name(name: str, pid: int | None = None) -> str:
    """The temporary file :func:`write` writes checkpoint ``name`` into before renaming
    it, as process ``pid`` (default: this one) names it."""
    return f".{name}.tmp{os.getpid() if pid is None else pid}"


def is_temporary(name: str, pid: int | None = None) -> bool:
    """Whether ``name`` is a temporary file of :func:`write` (of process ``pid`` only, if given)."""
    return (name.startswith(".ckpt-") and SUFFIX + ".tmp" in name
            and (pid is None or name.endswith(f".tmp{pid}")))


def iter_valid(directory: str) -> Iterable[tuple[str, Checkpoint | CheckpointError | OSError]]:
    """Each checkpoint of ``directory``, newest first, read and verified (or the error)."""
    for n in names(directory):
        path = os.path.join(directory, n)
        try:
            yield path, read(path)
        except (CheckpointError, OSError) as e:
            yield path, e


def layout_of(specs: Sequence[Any]) -> list[dict[str, Any]]:
    """A layout (TensorSpec objects) as the header's plain dicts."""
    return [{"name": s.name, "shape": list(s.shape), "dtype": s.dtype} for s in specs]
