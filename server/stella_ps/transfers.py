"""Large messages over slow links, in pieces that a reconnect resumes (issue 45).

Two directions:

- **Answers** (:class:`Transfers`): a pull whose answer is larger than the worker's
  ``chunk_bytes`` (a snapshot, a long catch-up) is answered ``chunked``: the answer's
  frames (its header first) are held here as transfer ``T``, and the worker fetches
  them in pieces (``fetch``). Each piece is a request of its own, answered within a
  few seconds whatever the link, so no request outlasts its timeout, heartbeats and
  other traffic go between pieces, and a piece lost with the link is fetched again,
  not the whole answer (a transfer is held for its worker id, which a reconnect with
  the session token keeps). The frames held are the store's immutable encoded answer
  (shared by every worker fetching the same one): holding them costs no copy.
- **Uploads** (:class:`Upload`, kept on the :class:`~stella_ps.membership.WorkerInfo`):
  the model's values, which the server asked one worker for, come in ``upload``
  pieces into a buffer, and the ``register`` that names the upload takes them from it.

Bounds: a worker holds one answer transfer at a time (a newer one replaces it); at
most ``max_total`` are held (the least recently used goes); one idle for ``idle_s``
seconds is dropped. A fetch of a transfer not held, or of another worker's, is refused
(``transfer``) and changes nothing; the worker then asks again for the answer itself.
"""
from __future__ import annotations

import bisect
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stella.errors import BadRequest, ErrorCode, TransferLost
from stella.protocol import MAX_CHUNK_FRAMES

__all__ = ["Transfers", "Upload", "IDLE_S"]

IDLE_S = 300.0  # a transfer not fetched from for this long is dropped (its worker is gone, or gave it up)


def _bytes(f: Any) -> memoryview:
    m = f if type(f) is memoryview else memoryview(f)
    return m if m.format == "B" and m.ndim == 1 and m.contiguous else m.cast("B")


@dataclass(eq=False)
class _Held:
    worker: int
    parts: list[memoryview]
    starts: list[int]  # each part's first byte in the transfer
    total: int
    used: float


class Transfers:
    """The answers held for fetching, by transfer id (least recently used first)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, *, idle_s: float = IDLE_S, max_total: int = 256):
        self._clock = clock
        self.idle_s, self.max_total = idle_s, max_total
        self._held: OrderedDict[int, _Held] = OrderedDict()
        self._of: dict[int, int] = {}  # worker -> its transfer

    def __len__(self) -> int:
        return len(self._held)

    def offer(self, worker: int, header: bytes, frames: Sequence[Any]) -> tuple[int, list[int]]:
        """Hold the answer ``header`` + ``frames`` for ``worker``'s fetches; returns the
        transfer's id and its frames' sizes (the header's first)."""
        self.expire()
        self.drop(worker)
        parts = [_bytes(header), *(_bytes(f) for f in frames)]
        sizes = [p.nbytes for p in parts]
        starts, at = [], 0
        for n in sizes:
            starts.append(at)
            at += n
        transfer = secrets.randbits(63) or 1
        self._held[transfer] = _Held(worker, parts, starts, at, self._clock())
        self._of[worker] = transfer
        while len(self._held) > self.max_total:
            _, old = self._held.popitem(last=False)
            self._of.pop(old.worker, None)
        return transfer, sizes

    def piece(self, worker: int, transfer: int, offset: int, length: int) -> list[memoryview]:
        """Bytes ``[offset, offset + length)`` of ``worker``'s transfer, in at most
        ``MAX_CHUNK_FRAMES`` frames (views of the held frames; one joined copy when the
        piece spans more). Raises :class:`TransferLost` for a transfer not held for this
        worker, :class:`BadRequest` for a range outside it."""
        self.expire()
        held = self._held.get(transfer)
        if held is None or held.worker != worker:
            raise TransferLost(f"transfer {transfer:#x} is not held for worker {worker} (expired after "
                               f"{self.idle_s:g} s idle, replaced by a newer answer, or the server restarted): "
                               "ask for the answer again")
        if offset + length > held.total:
            raise BadRequest(f"fetch: bytes [{offset}, {offset + length}) are outside transfer {transfer:#x}'s "
                             f"{held.total}", code=ErrorCode.PROTOCOL)
        held.used = self._clock()
        self._held.move_to_end(transfer)
        out: list[memoryview] = []
        i = bisect.bisect_right(held.starts, offset) - 1
        end = offset + length
        while offset < end:
            part, start = held.parts[i], held.starts[i]
            take = part[offset - start:min(end - start, part.nbytes)]
            if take.nbytes:
                out.append(take)
            offset += take.nbytes
            i += 1
        if len(out) > MAX_CHUNK_FRAMES:
            return [memoryview(b"".join(out))]
        return out

    def drop(self, worker: int) -> None:
        """Forget ``worker``'s transfer (it left, or a newer answer replaces it)."""
        transfer = self._of.pop(worker, None)
        if transfer is not None:
            self._held.pop(transfer, None)

    def expire(self) -> None:
        """Drop the transfers idle for ``idle_s`` (least recently used first: stop at the first in use)."""
        now = self._clock()
        while self._held:
            transfer, held = next(iter(self._held.items()))
            if now - held.used <= self.idle_s:
                return
            del self._held[transfer]
            if self._of.get(held.worker) == transfer:
                del self._of[held.worker]


@dataclass(eq=False)
class Upload:
    """A large payload coming in pieces (the model's values from the worker asked for
    them, or a registered worker's push). Its buffer is allocated zeroed by the OS
    (``calloc``: pages are resident only once written), so a declared size costs memory
    only as its bytes arrive, as a message of that size would."""

    transfer: int
    sizes: list[int]
    buffer: np.ndarray = field(init=False)
    have: int = 0

    def __post_init__(self) -> None:
        self.buffer = np.zeros(sum(self.sizes), np.uint8)

    @property
    def total(self) -> int:
        return int(self.buffer.size)

    def take(self, offset: int, frames: Sequence[memoryview]) -> int:
        """Write a piece starting at ``offset`` if it starts where the upload stands (else
        nothing: a re-sent piece, or one after a lost one); returns the bytes held."""
        if offset != self.have:
            return self.have
        n = sum(f.nbytes for f in frames)
        if self.have + n > self.total:
            raise BadRequest(f"upload: a piece of {n} bytes at {offset} runs past the upload's {self.total}",
                             code=ErrorCode.PROTOCOL)
        at = self.have
        for f in frames:
            self.buffer[at:at + f.nbytes] = np.frombuffer(_bytes(f), np.uint8)
            at += f.nbytes
        self.have = at
        return self.have

    def frames(self) -> list[memoryview]:
        """The value frames, once the upload is whole."""
        view, out, at = memoryview(self.buffer.data), [], 0
        for n in self.sizes:
            out.append(view[at:at + n])
            at += n
        return out
