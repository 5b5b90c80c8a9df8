"""The service: one handler per request type, membership, the optimizer configuration,
and the scheduling of steps.

The transport (``server.py``) hands every decoded, validated request to
:meth:`Service.handle`; a handler either answers at once through the ``send``
callback or starts a task (store work runs on one dedicated thread, so the event
loop keeps receiving while the C kernel runs). A handler refuses a request by
raising one of the client package's exceptions (:mod:`stella.errors`), which carry
their error code; whether raised at once or inside a task, the refusal reaches the
sender the same way (:meth:`Service.refuse`) and the request changes nothing.

The service is the only writer of the optimizer configuration: ``set_optimizer``
and the ``hparams`` that pushes carry change it on the event loop, and each step
takes the configuration in force when it closes.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stella import codec
from stella.errors import (
    BadValue,
    ErrorCode,
    LayoutConflict,
    ProtocolError,
    ServerError,
    StellaError,
    VersionError,
)
from stella.protocol import (
    Delta,
    Error,
    Heartbeat,
    HeartbeatOk,
    Join,
    Joined,
    Leave,
    Left,
    OptimizerSet,
    Pull,
    Push,
    PushOk,
    Received,
    Register,
    Registered,
    SetOptimizer,
    Status,
    StatusReply,
    TrainingMode,
    WorkerStatus,
    decode_tensors,
)

from .aggregation import AdaptiveDeadline, Aggregator, PendingPush, push_norm, scaled
from .checkpoints import Checkpoint, CheckpointPolicy, newest_valid, write_and_prune
from .config import ServerConfig
from .errors import ConfigError
from .kernel import state_bytes
from .membership import Membership, WorkerInfo
from .optim import OptimizerConfig
from .security import fingerprint
from .store import ModelStore, RecordCopy, layout_diff, roll_forward
from .waiters import PullWaiters

__all__ = ["Service", "Stats", "MAX_WAIT_AHEAD"]

log = logging.getLogger("stella_ps.service")
MAX_WAIT_AHEAD = 1024  # a pull may wait for at most this many future steps
CHECKPOINT_SLICE = 1 << 18  # coordinates a checkpoint copies per store-thread task (4 MiB of Adam records)
SILENT_BEATS = 1.5  # a worker not heard from for this many heartbeat intervals is silent (README "Stragglers")

Send = Callable[[bytes, Any, Sequence[Any]], None]


@dataclass(frozen=True)
class Peer:
    """Who sent a message: its CurveZMQ public key (Z85); with ``--insecure``, an
    anonymous peer (empty key)."""

    key: str

    @property
    def fingerprint(self) -> str:
        """What logs and ``status`` show of the key (computed on join only)."""
        return fingerprint(self.key) if self.key else "insecure"


@dataclass
class Stats:
    """Counters reported by ``status``; the transport counts messages and bytes."""

    started: float = field(default_factory=time.time)
    bytes_in: int = 0
    bytes_out: int = 0
    messages: int = 0
    errors: int = 0
    pushes: int = 0
    pulls: int = 0
    steps: int = 0
    late_pushes: int = 0
    errors_by_code: dict[str, int] = field(default_factory=dict)
    # steps' timings (sum and count, exported as Prometheus summaries): the wall time
    # between two consecutive steps closing, the store's apply, and how long a step
    # stayed open after its first push (waiting for the last worker, or the deadline)
    step_interval_s: float = 0.0
    step_intervals: int = 0
    apply_s: float = 0.0
    straggler_wait_s: float = 0.0
    last_step_at: float | None = None  # time.time() when the latest step closed
    # time.time() of the latest completed checkpoint. The checkpoint writer (issue 11)
    # sets it; until one exists the age reads as absent (status) or NaN (metrics).
    last_checkpoint: float | None = None

    def checkpoint_age(self, now: float | None = None) -> float | None:
        """Seconds since the latest checkpoint, None when none has been written."""
        if self.last_checkpoint is None:
            return None
        return max(0.0, (time.time() if now is None else now) - self.last_checkpoint)
    gone: int = 0  # workers declared gone (liveness timeout)
    duplicate_pushes: int = 0  # pushes re-sent after a reconnect and not queued again
    checkpoints: int = 0
    checkpoint_stall_s: float = 0.0  # the longest time a checkpoint's state copy held steps back


def _optimizer_error(e: ConfigError) -> ServerError:
    return ServerError(str(e), ErrorCode.OPTIMIZER)


class Service:
    """Handlers, membership, the optimizer configuration and step scheduling."""

    def __init__(self, config: ServerConfig, send: Send, stats: Stats | None = None):
        self.config = config
        self._send = send
        self.stats = stats or Stats()
        self.members = Membership(expected=config.workers, max_workers=config.max_workers,
                                  max_workers_per_key=config.max_workers_per_key)
        adaptive = (AdaptiveDeadline(quantile=config.deadline_quantile, factor=config.deadline_factor,
                                     minimum=config.deadline_min, maximum=config.deadline_max)
                    if config.adaptive_deadline else None)
        self.agg = Aggregator(step_deadline=config.step_deadline, max_queued_pushes=config.max_queued_pushes,
                              max_queued_push_bytes=config.max_queued_push_bytes, adaptive=adaptive)
        self.waiters = PullWaiters(max_per_worker=config.max_waiting_pulls)
        self.store = ModelStore(history=config.history)
        self.optimizer: OptimizerConfig | None = None  # set when the model is initialised
        # the job's training mode ("gradient"/"update"), from the first registration that names one
        self.mode: TrainingMode | None = None
        self._exec = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stella-store")
        self._tasks: set[asyncio.Task] = set()
        self._applying = False
        self._deadline: asyncio.TimerHandle | None = None
        self._init_lock = asyncio.Lock()
        self._step_opened: float | None = None  # perf_counter of the open step's first push
        self._sweeper: asyncio.TimerHandle | None = None
        self._lost_worker = False  # a worker was declared gone while the open step waited
        self.checkpoints: CheckpointPolicy | None = None
        if config.checkpoint_dir:
            self.checkpoints = CheckpointPolicy(config.checkpoint_dir, config.checkpoint_every_steps,
                                                config.checkpoint_every_s, config.checkpoint_keep,
                                                last_time=time.monotonic())
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stella-checkpoint")
        self._writing: asyncio.Future | None = None
        self._closing = False
        self._scheduled = False  # a periodic checkpoint task is spawned or running
        self.checkpoint_version: int | None = None  # the newest checkpoint on disk (written or resumed from)

    # ------------------------------------------------------------------ plumbing
    def refuse(self, ident: bytes, req: int, exc: BaseException) -> None:
        """Answer a request with an ``error`` reply: the code of a :class:`StellaError`,
        or ``internal`` (logged with its traceback) for anything else."""
        self.stats.errors += 1
        if isinstance(exc, StellaError):
            code, message = exc.code, str(exc)
            log.warning("rejected", extra={"code": code.value, "reason": message})
        else:  # a bug must not take the server down
            code, message = ErrorCode.INTERNAL, f"internal server error: {type(exc).__name__}: {exc}"
            log.error("internal error", exc_info=exc)
        self.stats.errors_by_code[code.value] = self.stats.errors_by_code.get(code.value, 0) + 1
        self._send(ident, Error(req=max(req, 0), code=code.value, message=message), ())

    def _spawn(self, coro: Awaitable[Any], ident: bytes | None = None, req: int = 0) -> None:
        """Run ``coro`` as a task; if it fails, the request ``req`` of ``ident`` is refused."""

        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except BaseException as e:
                if ident is not None:
                    self.refuse(ident, req, e)
                else:
                    log.error("background task failed", exc_info=e)

        task = asyncio.ensure_future(guarded())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _in_store(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._exec, fn, *args)

    async def close(self) -> None:
        """Write a last checkpoint (when checkpoints are on and the model moved on since
        the last one), cancel pending work and stop the store and writer threads."""
        self._closing = True
        if self._sweeper:
            self._sweeper.cancel()
        while self._writing is not None:
            await asyncio.gather(self._writing, return_exceptions=True)
        if self.checkpoints is not None and self.store.initialised and \
                self.store.version > self.checkpoints.last_version:
            try:
                await self.checkpoint()
            except Exception as e:
                log.error("final checkpoint failed", exc_info=e)
        self.waiters.cancel_all()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._deadline:
            self._deadline.cancel()
        self._exec.shutdown(wait=True)
        self._writer.shutdown(wait=True)

    # ------------------------------------------------------------------ liveness and checkpoints
    @property
    def heartbeat_s(self) -> float:
        """How often clients send a heartbeat (the ``joined`` reply says it); 0: never."""
        t = self.config.liveness_timeout
        return t / 4 if t > 0 else 0.0

    def start(self) -> None:
        """Start the liveness sweep (on the running loop)."""
        if self.config.liveness_timeout > 0 and self._sweeper is None:
            self._sweep()

    def _sweep(self) -> None:
        timeout = self.config.liveness_timeout
        gone = self.members.sweep(timeout)
        if gone:
            self.stats.gone += len(gone)
            self._lost_worker = True  # the open step's spread now includes the wait for the gone one
            log.warning("workers declared gone: not heard from within the liveness timeout",
                        extra={"workers": gone, "liveness_timeout_s": timeout, "live": len(self.members.live)})
            self._maybe_close_steps()
        self._sweeper = asyncio.get_running_loop().call_later(max(0.05, timeout / 8), self._sweep)

    def resume(self) -> int | None:
        """Become the newest valid checkpoint of ``--checkpoint-dir`` (before serving);
        returns its version, or None when there is none."""
        if self.checkpoints is None:
            return None
        found = newest_valid(self.checkpoints.directory)
        if found is None:
            log.info("no checkpoint to resume from", extra={"checkpoint_dir": self.checkpoints.directory})
            return None
        path, ck = found
        from stella.protocol import TensorSpec

        layout = [TensorSpec(d["name"], tuple(d["shape"]), d["dtype"]) for d in ck.layout]
        cfg = OptimizerConfig.from_wire(ck.optimizer)
        self.store.restore(layout, ck.tensors, cfg, ck.version)
        self.optimizer = cfg
        # the job had started: steps close with whoever is back, not once --workers have joined
        # again (workers that come back later fold their pushes in; waiting for all could be forever)
        self.members.started = True
        self.checkpoints.last_version = self.checkpoint_version = ck.version
        log.info("resumed from checkpoint", extra={"path": path, "version": ck.version, "numel": self.store.numel,
                                                   "optimizer": cfg.to_wire()})
        return ck.version

    def _maybe_checkpoint(self) -> None:
        cp = self.checkpoints
        if cp is not None and not self._closing and not self._scheduled and cp.due(self.store.version):
            self._scheduled = True  # set now: steps that close before the task starts schedule no second one
            self._spawn(self._scheduled_checkpoint())

    async def _scheduled_checkpoint(self) -> None:
        try:
            await self.checkpoint()
        finally:
            self._scheduled = False
            self._maybe_checkpoint()  # one that fell due while this one was written

    async def checkpoint(self) -> str:
        """Write a checkpoint of the model now; returns its path. Steps wait only for
        the copy of the state (on the store thread). One at a time: ``_writing`` is
        set before the first await, so no second one starts meanwhile."""
        assert self.checkpoints is not None and self.optimizer is not None
        while self._writing is not None:
            await asyncio.gather(self._writing, return_exceptions=True)
        cp = self.checkpoints
        loop = asyncio.get_running_loop()
        self._writing = loop.create_future()
        try:
            # the state is copied a slice at a time, each slice one store-thread task, so a
            # step waits for one slice at most; the steps applied meanwhile are logged and
            # rolled forward on the writer's thread (store.roll_forward)
            t_copy = time.perf_counter()
            await self._in_store(self.store.begin_copy)
            copies: list[list[RecordCopy]] = []
            stall = 0.0
            for t, spec in enumerate(self.store.layout):
                slices = []
                for start in range(0, spec.numel, CHECKPOINT_SLICE):
                    t0 = time.perf_counter()
                    slices.append(await self._in_store(self.store.copy_records, t, start,
                                                       min(CHECKPOINT_SLICE, spec.numel - start)))
                    stall = max(stall, time.perf_counter() - t0)
                copies.append(slices)
            version, redo = await self._in_store(self.store.end_copy)
            copy_s = time.perf_counter() - t_copy
            self.stats.checkpoint_stall_s = max(self.stats.checkpoint_stall_s, stall)
            from stella.checkpoint import layout_of

            kind = self.store.tensors[0].name if self.store.tensors else self.optimizer.name
            scratch_cfg = OptimizerConfig.from_wire({"name": kind})
            numels = [s.numel for s in self.store.layout]
            layout, opt = layout_of(self.store.layout), self.optimizer.to_wire()

            def build_and_write() -> tuple[str, int, float]:
                arrays = roll_forward(scratch_cfg, numels, copies, redo)
                return write_and_prune(cp, Checkpoint(version, layout, opt, arrays, time.time()))

            cp.last_version, cp.last_time = version, time.monotonic()
            path, size, write_s = await loop.run_in_executor(self._writer, build_and_write)
            self.stats.checkpoints += 1
            self.stats.last_checkpoint = time.time()  # status's and the metrics' checkpoint age
            self.checkpoint_version = version
            log.info("checkpoint written", extra={"path": path, "version": version, "bytes": size,
                                                  "stall_ms": round(1e3 * stall, 3), "copy_s": round(copy_s, 3),
                                                  "steps_rolled_forward": len(redo), "write_s": round(write_s, 3)})
            return path
        finally:
            fut, self._writing = self._writing, None
            fut.set_result(None)

    # ------------------------------------------------------------------ dispatch
    def drop_peer(self, key: str) -> None:
        """Forget the live workers of a key that is no longer admitted, so that steps do
        not wait for them."""
        gone = self.members.drop_key(key)
        if gone:
            log.warning("workers dropped: their key left the allowlist", extra={"workers": gone})
            self._maybe_close_steps()

    def handle(self, ident: bytes, rx: Received, peer: Peer) -> None:
        """Serve one request from ``peer``; raises a :class:`StellaError` to refuse it."""
        match rx.msg:
            case Push():
                self._push(ident, rx)
            case Pull():
                self._pull(ident, rx.msg)
            case Join():
                self._join(ident, rx.msg, peer)
            case Register():
                self._register(ident, rx)
            case SetOptimizer():
                self._set_optimizer(ident, rx.msg)
            case Status():
                self._status(ident, rx.msg)
            case Leave():
                self._leave(ident, rx.msg)
            case Heartbeat():
                self._heartbeat(ident, rx.msg, peer)
            case _:  # pragma: no cover - decode_request returns only the types above
                raise ProtocolError(f"no handler for {type(rx.msg).__name__}")

    # ------------------------------------------------------------------ handlers
    def _member(self, ident: bytes, worker: int, registered: bool = True) -> WorkerInfo:
        """The live worker ``worker`` of this connection; a gone one speaking again on
        its own connection is live again first."""
        if worker not in self.members.live and self.members.revive(ident, worker) is not None:
            log.info("worker back", extra={"worker": worker, "live": len(self.members.live)})
        return self.members.check(ident, worker, registered=registered)

    def _join(self, ident: bytes, msg: Join, peer: Peer) -> None:
        info = self.members.join(ident, msg.worker, msg.name, reserved=self.agg.pending_workers(),
                                 key=peer.key, fingerprint=peer.fingerprint, session=msg.session)
        log.info("worker joined", extra={"worker": info.worker, "worker_name": info.name,
                                         "key_fingerprint": info.fingerprint, "live": len(self.members.live)})
        self._send(ident, Joined(req=msg.req, worker=info.worker, version=self.store.version,
                                 workers=len(self.members.live), initialised=self.store.initialised,
                                 session=info.session, heartbeat_s=self.heartbeat_s), ())
        self._maybe_close_steps()

    def _heartbeat(self, ident: bytes, msg: Heartbeat, peer: Peer) -> None:
        _, revived = self.members.heartbeat(msg.worker, msg.session, peer.key)
        if revived:
            log.info("worker back (heartbeat)", extra={"worker": msg.worker, "live": len(self.members.live)})
        self._send(ident, HeartbeatOk(req=msg.req, version=self.store.version), ())

    def _leave(self, ident: bytes, msg: Leave) -> None:
        info = self._member(ident, msg.worker, registered=False)
        self.members.leave(info.worker)
        log.info("worker left", extra={"worker": info.worker, "live": len(self.members.live)})
        self._send(ident, Left(req=msg.req, worker=info.worker, version=self.store.version), ())
        self._maybe_close_steps()

    def worker_statuses(self, now: float | None = None) -> list[WorkerStatus]:
        """The live workers as ``status`` and the metrics report them, in id order."""
        now = time.monotonic() if now is None else now
        return [WorkerStatus(worker=w, name=i.name, key_fingerprint=i.fingerprint,
                             last_seen_s=max(0.0, now - i.last_seen), pushes=i.pushes, pulls=i.pulls,
                             report=i.report)
                for w, i in sorted(self.members.live.items())]

    def _status(self, ident: bytes, msg: Status) -> None:
        from . import __version__

        s = self.stats
        now = time.monotonic()
        self._send(ident, StatusReply(
            req=msg.req, version=self.store.version, initialised=self.store.initialised,
            workers=self.members.ids(), expected_workers=self.config.workers,
            worker_keys={w: i.fingerprint for w, i in self.members.live.items()}, insecure=self.config.insecure,
            pending_pushes=self.agg.pending_count(), steps=s.steps, pushes=s.pushes, pulls=s.pulls,
            late_pushes=s.late_pushes, bytes_in=s.bytes_in, bytes_out=s.bytes_out, messages=s.messages,
            errors=s.errors, uptime_s=time.time() - s.started, numel=self.store.numel,
            tensors=len(self.store.layout),
            optimizer=self.optimizer.to_wire() if self.optimizer else None,
            server_version=__version__, live=self.worker_statuses(), checkpoint_age_s=s.checkpoint_age(),
            last_seen_s={w: round(now - i.last_seen, 3) for w, i in self.members.live.items()},
            gone_workers={w: round(now - i.last_seen, 3) for w, i in self.members.gone.items()},
            liveness_timeout_s=self.config.liveness_timeout, step_deadline_s=self.agg.current_deadline(),
            checkpoint_version=self.checkpoint_version,
            behind_workers=[w for w in self.agg.behind() if w in self.members.live],
        ), ())

    def _register(self, ident: bytes, rx: Received) -> None:
        msg: Register = rx.msg
        info = self._member(ident, msg.worker, registered=False)
        layout = list(msg.tensors)
        if len({s.name for s in layout}) != len(layout):
            raise ProtocolError("register: tensor names must be unique")
        empty = [s.name for s in layout if s.numel == 0]
        if empty:
            raise ProtocolError(f"register: tensors with no elements cannot be trained: {empty[:5]}")
        try:
            cfg = OptimizerConfig.from_wire(dict(msg.optimizer)) if msg.optimizer else self.config.optimizer
            self.config.optimizer_limits.check(cfg)
        except ConfigError as e:
            raise _optimizer_error(e) from None
        if not self.store.initialised:
            self._check_model_bytes(layout, cfg)
        values = None
        if msg.values:
            values = []
            for spec, frame in zip(layout, rx.frames):
                try:
                    values.append(codec.wire_values(frame, spec.numel, "f32"))
                except BadValue:
                    raise BadValue(f"register: tensor {spec.name!r} has NaN/Inf initial values") from None
        self._spawn(self._register_async(ident, msg, info, layout, values, cfg), ident, msg.req)

    def _check_model_bytes(self, layout: list, cfg: OptimizerConfig) -> None:
        """Refuse, before anything is allocated, a model whose parameters and optimizer
        state (as the kernel allocates them) exceed ``--max-model-bytes``."""
        need = sum(state_bytes(s.numel, cfg.name) for s in layout)
        limit = self.config.max_model_bytes
        if need > limit:
            numel = sum(s.numel for s in layout)
            raise ServerError(f"register refused: {numel} coordinates with {cfg.name} need {need} bytes of "
                              f"parameters and optimizer state, more than the server's limit of {limit} bytes "
                              f"(--max-model-bytes)", ErrorCode.LIMIT)

    async def _register_async(self, ident: bytes, msg: Register, info: WorkerInfo, layout: list,
                              values: list[np.ndarray] | None, cfg: OptimizerConfig) -> None:
        async with self._init_lock:  # two first registrations must not both initialise
            created = False
            if msg.mode is not None and self.mode is not None and msg.mode != self.mode:
                raise LayoutConflict(f"this job trains in {self.mode} mode: a {msg.mode}-mode worker cannot join it "
                                     f"(StellaOptimizer(mode={self.mode!r}))")
            if not self.store.initialised:
                if values is None:  # the client's cheap probe: send the values next
                    self._send(ident, Registered(req=msg.req, version=self.store.version, created=False,
                                                 needs_values=True, optimizer=None, numel=0), ())
                    return
                await self._in_store(self.store.initialise, layout, values, cfg)
                self.optimizer = cfg
                created = True
                log.info("model initialised", extra={"tensors": len(layout), "numel": self.store.numel,
                                                     "optimizer": cfg.to_wire()})
            else:
                diff = layout_diff(self.store.layout, layout)
                if diff:
                    raise LayoutConflict(f"layout differs from the server's model: {diff}")
            info.registered = True
            self.mode = self.mode or msg.mode
            assert self.optimizer is not None
            self._send(ident, Registered(req=msg.req, version=self.store.version, created=created,
                                         needs_values=False, optimizer=self.optimizer.to_wire(),
                                         numel=self.store.numel, mode=self.mode), ())

    def _changed_optimizer(self, hparams: dict[str, Any]) -> OptimizerConfig:
        assert self.optimizer is not None  # a registered worker implies a model
        try:
            return self.config.optimizer_limits.check(self.optimizer.updated(dict(hparams)))
        except ConfigError as e:
            raise _optimizer_error(e) from None

    def _set_optimizer(self, ident: bytes, msg: SetOptimizer) -> None:
        self._member(ident, msg.worker)
        self.optimizer = self._changed_optimizer(msg.hparams)
        self._send(ident, OptimizerSet(req=msg.req, optimizer=self.optimizer.to_wire(),
                                       version=self.store.version), ())

    def _push(self, ident: bytes, rx: Received) -> None:
        msg: Push = rx.msg
        info = self._member(ident, msg.worker)
        if msg.req and msg.req <= info.last_push_req:  # re-sent after a reconnect: queued already
            self.stats.duplicate_pushes += 1
            self._send(ident, PushOk(req=msg.req, step=self.store.version, version=self.store.version), ())
            return
        if msg.version > self.store.version:
            raise VersionError(f"push computed on version {msg.version}, but the server is at "
                               f"{self.store.version} (a version from the future)")
        nbytes = sum(f.nbytes for f in rx.frames)
        self.agg.check_room(info.worker, nbytes)  # before the work of decoding
        tensors = decode_tensors(rx, self.store.layout)
        if msg.hparams:
            self._changed_optimizer(msg.hparams)  # refused now, not when the step applies
        if self.config.max_push_norm:
            tensors = self._bounded(info.worker, tensors)
        if not self.agg.has_pending():
            self._step_opened = time.perf_counter()
        queued = self.agg.add(PendingPush(info.worker, msg.version, tensors, msg.hparams, nbytes))
        info.last_push_req = msg.req
        info.pushes += 1
        if msg.report is not None:
            info.report = msg.report
        self.stats.pushes += 1
        self._send(ident, PushOk(req=msg.req, step=self.store.version + queued, version=self.store.version), ())
        self._maybe_close_steps(first_push=True)

    def _bounded(self, worker: int, tensors: list) -> list:
        """The push's tensors inside ``--max-push-norm``: refused above it, or scaled down
        to it (float32 copies) with ``--push-norm-action clip``."""
        bound = self.config.max_push_norm
        norm = push_norm(tensors)
        log.debug("push norm", extra={"worker": worker, "norm": norm})
        if norm <= bound:
            return tensors
        if self.config.push_norm_action == "refuse":
            raise BadValue(f"push refused: the L2 norm of its values, {norm:.6g}, is above the server's limit "
                           f"{bound:g} (--max-push-norm)")
        log.warning("push clipped", extra={"worker": worker, "norm": norm, "limit": "--max-push-norm",
                                           "max_push_norm": bound})
        return scaled(tensors, bound / norm)

    def _pull(self, ident: bytes, msg: Pull) -> None:
        info = self._member(ident, msg.worker)
        info.pulls += 1
        v = self.store.version
        if msg.since > v:
            raise VersionError(f"pull since version {msg.since}, but the server is at {v} (from the future)")
        wait_for = msg.wait_for or 0
        if wait_for > v + MAX_WAIT_AHEAD:
            raise VersionError(f"pull waits for version {wait_for}, more than {MAX_WAIT_AHEAD} ahead of {v}")
        if wait_for <= v:
            self._spawn(self._reply_delta(ident, msg), ident, msg.req)
        else:
            self.waiters.add(msg.worker, wait_for, msg.timeout_ms / 1000,
                             lambda: self._spawn(self._reply_delta(ident, msg), ident, msg.req))
        self.stats.pulls += 1

    async def _reply_delta(self, ident: bytes, msg: Pull) -> None:
        enc = await self._in_store(self.store.encoded_delta, msg.since, msg.coding)
        self._send(ident, Delta(req=msg.req, version=enc.version, full=enc.full, tensors=enc.entries), enc.frames)

    # ------------------------------------------------------------------ steps
    def _maybe_close_steps(self, first_push: bool = False) -> None:
        if self._applying:
            return  # the running apply loop checks again when it finishes
        if self.agg.should_close(self.members.live, self.members.started):
            self._applying = True
            self._spawn(self._apply_ready())
        elif first_push and self._deadline is None and self.agg.has_pending():
            after = self.agg.deadline(self.members.started)
            if after is not None:
                self._deadline = asyncio.get_running_loop().call_later(after, self._on_deadline)

    def _on_deadline(self) -> None:
        self._deadline = None
        if not self._applying and self.agg.has_pending():
            missing = self.agg.missing(self.members.live)
            # of those, the silent ones (no heartbeat for 1.5 intervals: dead, stopped, cut off) are
            # behind, not waited for again until they push; one still heard from is only slow
            hb, now = self.heartbeat_s, time.monotonic()
            silent = [w for w in missing if hb > 0 and now - self.members.live[w].last_seen > SILENT_BEATS * hb]
            log.info("step deadline passed", extra={"missing_workers": missing, "silent_workers": silent,
                                                    "version": self.store.version})
            self.agg.mark_behind(silent, self.members.live)
            self._applying = True
            self._spawn(self._apply_ready(force=True))

    def _step_optimizer(self, changes: list[dict[str, Any]]) -> OptimizerConfig:
        """The configuration a step runs with, after the changes its pushes carry
        (each was checked when its push arrived)."""
        for hp in changes:
            try:
                self.optimizer = self._changed_optimizer(hp)
            except ServerError as e:  # valid alone, but not after an earlier change
                log.warning("optimizer change dropped", extra={"hparams": hp, "reason": str(e)})
        assert self.optimizer is not None
        return self.optimizer

    def _count_step(self, late: int, t0: float, opened: float | None) -> None:
        s = self.stats
        s.steps += 1
        s.late_pushes += late
        s.apply_s += time.perf_counter() - t0
        if opened is not None:
            s.straggler_wait_s += max(0.0, t0 - opened)
        now = time.time()
        if s.last_step_at is not None:
            s.step_interval_s += now - s.last_step_at
            s.step_intervals += 1
        s.last_step_at = now

    async def _apply_ready(self, force: bool = False) -> None:
        try:
            while force or self.agg.should_close(self.members.live, self.members.started):
                complete = not force and not self._lost_worker
                force = self._lost_worker = False
                if self._deadline:
                    self._deadline.cancel()
                    self._deadline = None
                step = self.agg.take_step(self.store.version, len(self.store.layout), complete=complete)
                if step is None:
                    break
                cfg = self._step_optimizer(step.hparams)
                t0 = time.perf_counter()
                opened, self._step_opened = self._step_opened, (t0 if self.agg.has_pending() else None)
                version = await self._in_store(self.store.apply_step, step, cfg)
                self._count_step(step.late, t0, opened)
                log.debug("step applied", extra={"version": version, "contributors": len(step.contributors),
                                                  "apply_ms": round(1e3 * (time.perf_counter() - t0), 3)})
                self.waiters.release(version)
                self._maybe_checkpoint()
        finally:
            self._applying = False
        if self.agg.has_pending():
            self._maybe_close_steps(first_push=True)
