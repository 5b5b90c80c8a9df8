"""Model creation: the registration that brings the model's values creates it, every
later one joins it (:class:`Registration`).

A worker registers in two messages when the model may not exist yet: a cheap probe
(the layout, no values) and, when the answer says ``needs_values``, the upload. While
one worker uploads, the probes of the others are held (up to their ``wait_ms``), so
that a job's workers starting together send the model once. A registration
names the model's tensors and the range of the flat model this server holds
(:mod:`stella.layout`, laid out with the server's dense cut, which the registration
must have used); the range's size is checked against ``--max-model-bytes`` before its
values are decoded; a registration after the model exists must bring its layout
(:func:`~stella_ps.store.layout_diff`), its range and the job's training mode. The
digest of the values the model was created with is kept: a worker that registers those
same values learns the version whose model they are (``Registered.base``).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Coroutine
from typing import Any

import numpy as np

from stella.errors import BadRequest, ErrorCode, LayoutConflict, ProtocolError, StellaError, TransferLost
from stella.layout import FlatLayout
from stella.payload import decode_register_values, model_digest, part_specs
from stella.protocol import MAX_NUMEL, Received, Register, Registered, TensorSpec, TrainingMode, Upload, Uploaded

from .config import shard_position
from .membership import Membership, WorkerInfo
from .optim import OptimizerConfig
from .runtime import Clock, StoreThread
from .steps import StepScheduler
from .store import ModelRange, ModelStore, check_model_bytes, layout_diff
from .transfers import Upload as UploadBuffer

__all__ = ["Registration"]

log = logging.getLogger("stella_ps.registration")
HOLD_POLL_S = 0.25  # a held probe looks again this often whether the upload is still under way


class Registration:
    """Creates the job's model from the first upload and admits the registrations after it."""

    def __init__(self, store: ModelStore, store_thread: StoreThread, members: Membership, steps: StepScheduler,
                 clock: Clock, *, max_model_bytes: int, shard: str = ""):
        self.store, self._store_thread, self.members, self.steps = store, store_thread, members, steps
        self._clock = clock
        self._shard = shard  # "I/N" (stella-ps --shard): a registration must name this shard's range
        self._max_model_bytes = max_model_bytes
        self.mode: TrainingMode | None = None  # the job's, from the first registration that names one
        self._lock = asyncio.Lock()  # two first registrations must not both create the model
        self._created = asyncio.Event()  # set once the model exists: held probes join it
        # the digest of the values the model was created with, and its version then: a worker
        # registering values with that digest holds that version's model (None: resumed from a checkpoint)
        self._origin: tuple[bytes, int] | None = None

    def accept(self, msg: Register, rx: Received, info: WorkerInfo) -> Coroutine[Any, Any, Registered]:
        """Check a registration of ``info``'s worker now (a refusal raises here, having
        changed nothing) and decode its values; returns the rest of its work, to run as
        a task, whose result is the reply."""
        layout = list(msg.tensors)
        if len({s.name for s in layout}) != len(layout):
            raise ProtocolError("register: tensor names must be unique")
        empty = [s.name for s in layout if s.numel == 0]
        if empty:
            raise ProtocolError(f"register: tensors with no elements cannot be trained: {empty[:5]}")
        flat, start, stop = self._range(msg)
        parts = part_specs(flat.parts(start, stop))
        cfg = self.steps.initial(msg.optimizer)
        if not self.store.initialised:
            check_model_bytes(parts, cfg, self._max_model_bytes, self.store.pull == "broadcast")
        if msg.values and msg.upload is not None:  # the values came ahead, in pieces
            up = info.upload
            if up is None or up.transfer != msg.upload or up.have != up.total:
                raise TransferLost(f"register: upload {msg.upload:#x} is not whole here ("
                                   + ("none under way" if up is None or up.transfer != msg.upload else
                                      f"{up.have} of {up.total} bytes") + "): upload it, then register")
            rx = Received(msg, tuple(up.frames()))
        try:
            values = decode_register_values(rx, parts) if msg.values else None
        except StellaError:
            info.registering = False  # a refused upload: probes held for it stop waiting
            info.upload = None
            raise
        return self._register(msg, info, layout, (flat, start, stop), values, cfg)

    def upload(self, msg: Upload, rx: Received, info: WorkerInfo, max_push_bytes: int) -> Uploaded:
        """Take a piece of a large payload from ``info``'s worker
        (:class:`~stella_ps.transfers.Upload`): the model's values the server asked it for
        (bounded by ``--max-model-bytes``), or a registered worker's push (bounded by
        ``max_push_bytes``, ``--max-message-bytes``); one upload per worker (a new id
        starts it again)."""
        total = sum(msg.sizes)
        if info.registered:  # a push's frames
            if total > max_push_bytes:
                raise BadRequest(f"upload: a push of {total} bytes > --max-message-bytes {max_push_bytes}",
                                 code=ErrorCode.LIMIT)
        elif self.store.initialised or not info.registering:
            raise BadRequest("upload: this worker was not asked for the model's values (a registration probe "
                             "answered needs_values asks for them)", code=ErrorCode.PROTOCOL)
        elif total > self._max_model_bytes:
            raise BadRequest(f"upload: {total} bytes of values > --max-model-bytes {self._max_model_bytes}",
                             code=ErrorCode.LIMIT)
        up = info.upload
        if up is None or up.transfer != msg.transfer or up.sizes != list(msg.sizes):
            up = info.upload = UploadBuffer(msg.transfer, list(msg.sizes))
        return Uploaded(req=msg.req, transfer=msg.transfer, have=up.take(msg.offset, rx.frames))

    def _range(self, msg: Register) -> tuple[FlatLayout, int, int]:
        """The model laid out flat, and the range of it this registration gives this server."""
        if msg.dense_below != self.store.dense_below:
            raise ProtocolError(f"register: laid out with dense_below {msg.dense_below}, but this server's dense cut "
                                f"is {self.store.dense_below} (stella-ps --dense-below; its joined reply says it)")
        flat = FlatLayout.of(msg.tensors, msg.dense_below)
        stop = flat.numel if msg.stop is None else msg.stop
        if not msg.start < stop <= flat.numel:
            raise ProtocolError(f"register: range [{msg.start}, {stop}) is not inside the model's {flat.numel} "
                                "coordinates")
        if stop - msg.start > MAX_NUMEL:
            raise ProtocolError(f"register: a range of {stop - msg.start} coordinates: a server holds fewer than "
                                "2**31 (shard the job)")
        position = shard_position(self._shard)
        if position is not None and position[1] > 1:
            index, count = position  # the split every client makes (stella.shards), never a lone Client's whole model
            try:
                mine = flat.shard_ranges(count)[index]
            except ValueError as e:
                raise ProtocolError(f"register: this server is shard {self._shard}: {e}") from None
            if (msg.start, stop) != mine:
                raise LayoutConflict(f"this server is shard {self._shard} of its job, whose range of this model is "
                                     f"[{mine[0]}, {mine[1]}); the registration names [{msg.start}, {stop}): reach a "
                                     "sharded job through stella.shards.connect (its first address), or list every "
                                     "shard's address in shard order")
        return flat, msg.start, stop

    def _uploading(self, info: WorkerInfo) -> bool:
        """Whether another live worker was asked for the model's values and has not registered yet."""
        return any(m.registering and not m.registered for m in self.members.live.values() if m is not info)

    async def _hold_probe(self, info: WorkerInfo, wait_s: float) -> None:
        """Hold a probe while another worker uploads the model, so that a job's workers
        starting together send it once: until the model exists, no upload is under way
        (the uploader left, or its values were refused), or ``wait_s`` passes."""
        deadline = self._clock.now() + wait_s
        while not self.store.initialised and self._uploading(info):
            left = deadline - self._clock.now()
            if left <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._created.wait(), min(left, HOLD_POLL_S))

    async def _register(self, msg: Register, info: WorkerInfo, layout: list[TensorSpec],
                        where: tuple[FlatLayout, int, int], values: list[np.ndarray] | None,
                        cfg: OptimizerConfig) -> Registered:
        if values is None and msg.wait_ms and not self.store.initialised and not info.held:
            info.held = True  # one held probe per worker: more are answered at once
            try:
                await self._hold_probe(info, msg.wait_ms / 1000)
            finally:
                info.held = False
        async with self._lock:
            created = False
            if msg.mode is not None and self.mode is not None and msg.mode != self.mode:
                raise LayoutConflict(f"this job trains in {self.mode} mode: a {msg.mode}-mode worker cannot join it "
                                     f"(StellaOptimizer(mode={self.mode!r}))")
            if not self.store.initialised:
                if values is None:  # the client's cheap probe: send the values next
                    info.registering = True  # their upload is a sign of life only once it ends: heartbeats count
                    return Registered(req=msg.req, version=self.store.version, created=False, needs_values=True,
                                      optimizer=None, numel=0)
                await self._create(info, layout, where, values, cfg, msg.version)
                created = True
            else:
                held = self.store.model
                assert held is not None
                diff = layout_diff(held.specs, layout)
                if diff:
                    raise LayoutConflict(f"layout differs from the server's model: {diff}")
                if where[1:] != (held.start, held.stop):
                    raise LayoutConflict(f"this server holds the model's coordinates [{held.start}, {held.stop}), "
                                         f"the registration names [{where[1]}, {where[2]}) (list a sharded job's "
                                         "addresses in its shard order)")
            self.members.register(info)
            self.steps.membership_changed()
            self.mode = self.mode or msg.mode
            assert self.steps.optimizer is not None
            base = self.store.version if created else self._base(msg.digest)
            return Registered(req=msg.req, version=self.store.version, created=created, needs_values=False,
                              optimizer=self.steps.optimizer.to_wire(), numel=self.store.numel, mode=self.mode,
                              pull=self.store.pull, broadcast=self.store.broadcast_info, base=base)

    async def _create(self, info: WorkerInfo, layout: list[TensorSpec], where: tuple[FlatLayout, int, int],
                      values: list[np.ndarray], cfg: OptimizerConfig, version: int) -> None:
        """The model, from ``info``'s upload (on the store thread), with ``cfg`` in force, at
        ``version`` (the registration's: a resuming worker's checkpoint's)."""
        try:
            await self._store_thread.run(functools.partial(self.store.initialise, None, values, cfg,
                                                           model=ModelRange(layout, *where), version=version))
        except BaseException:
            info.registering = False
            info.upload = None
            raise
        info.upload = None  # the store holds the values now
        self._origin = (await self._store_thread.run(model_digest, values), self.store.version)
        self.steps.optimizer = cfg
        self._created.set()
        log.info("model initialised", extra={"tensors": len(layout), "numel": self.store.numel,
                                             "optimizer": cfg.to_wire()})

    def _base(self, digest: bytes | None) -> int | None:
        """The version whose model a registration's values (``digest``) are: the model's
        creation version if they are the values it was created with, else None."""
        if digest is None or self._origin is None or digest != self._origin[0]:
            return None
        return self._origin[1]
