"""The service: one handler per request type, and the composition of the parts that
do the work.

The transport (``server.py``) hands every decoded, validated request to
:meth:`Service.handle`; a handler either answers at once through the ``send``
callback or starts a task (store work runs on the store thread, so the event loop
keeps receiving while the C kernel runs). A handler refuses a request by raising one
of the client package's exceptions (:mod:`stella.errors`), which carry their error
code; whether raised at once or inside a task, the refusal reaches the sender the
same way (:meth:`Service.refuse`) and the request changes nothing.

The parts, each in its own module: who takes part (:mod:`.membership`), when a step
closes and with which optimizer configuration (:mod:`.steps`), pulls waiting for a
version (:mod:`.waiters`) and their answers (:mod:`.answers`), the model (:mod:`.store`) and its creation by the first
upload (:mod:`.registration`), checkpoints (:mod:`.checkpoints`), the job's snapshot for ``status`` and the metrics
(:mod:`.stats`), over the small runtime of :mod:`.runtime`. :meth:`Service.running`
pairs the start and the stop of each.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from stella.errors import ErrorCode, ProtocolError, StellaError, TransferLost, VersionError
from stella.payload import decode_tensors
from stella.protocol import (
    MAX_NAME_BYTES,
    Chunk,
    Error,
    Fetch,
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
    SetOptimizer,
    Status,
    StatusReply,
    Upload,
    WorkerStatus,
    check_payload,
)

from . import __version__
from .aggregation import PushNormBound
from .answers import PullAnswers
from .checkpoints import Checkpointer
from .config import ServerConfig
from .membership import Membership, WorkerInfo
from .registration import Registration
from .runtime import Clock, LoopClock, StoreThread, Tasks, Timer, default_threads
from .security import fingerprint
from .shardlist import ShardList
from .stats import JobSnapshot, Stats
from .steps import StepScheduler
from .store import ModelStore
from .transfers import Transfers
from .waiters import PullWaiters

__all__ = ["Service", "Peer", "MAX_WAIT_AHEAD"]

log = logging.getLogger("stella_ps.service")
MAX_WAIT_AHEAD = 1024  # a pull may wait for at most this many future steps

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


class Service:
    """Handlers over membership, steps, waiters, the store and checkpoints."""

    def __init__(self, config: ServerConfig, send: Send, stats: Stats | None = None, clock: Clock | None = None):
        self.config = config
        self._send = send
        self.stats = stats or Stats()
        self.clock = clock or LoopClock()
        limits = config.limits
        self.members = Membership(expected=config.workers, max_workers=limits.max_workers,
                                  max_workers_per_key=limits.max_workers_per_key, clock=self.clock.now)
        self.waiters = PullWaiters(max_per_worker=limits.max_waiting_pulls, clock=self.clock)
        self.store = ModelStore(config.pulls, history=config.history, threads=config.threads or default_threads(),
                                dense_below=config.dense_below)
        self.store_thread = StoreThread()
        self.tasks = Tasks()
        self.steps = StepScheduler(self.store, self.members, self.store_thread, self.tasks, self.clock, self.stats,
                                   deadline=config.deadline, limits=limits, liveness=config.liveness,
                                   default_optimizer=config.optimizer)
        self.checkpointer = Checkpointer(config.checkpoints, self.store, self.store_thread, self.tasks, self.stats,
                                         lambda: self.steps.optimizer)
        self.steps.on_step(self.waiters.release)
        self.steps.on_step(self.checkpointer.maybe)
        # a step that can be neither applied whole nor closed empty: the transport stops serving (the daemon exits 1)
        self.on_failure: Callable[[BaseException], None] = lambda e: log.critical("no step can close", exc_info=e)
        self.steps.on_failure(lambda e: self.on_failure(e))
        self.push_bound = PushNormBound(limits.max_push_norm, limits.push_norm_action, limits.push_norm_factor,
                                        model_change=limits.max_push_change)
        self.registration = Registration(self.store, self.store_thread, self.members, self.steps, self.clock,
                                         max_model_bytes=limits.max_model_bytes, shard=config.shard)
        # the allowlist's name of a key, for status (the transport sets it when it runs with keys)
        self.key_name: Callable[[str], str] = lambda key: ""
        self.shard_list = ShardList(config.shard_list, config.shard)  # the job's shards, for joined and status
        self._sweeper: Timer | None = None
        self.transfers = Transfers(self.clock.now, max_total=limits.max_workers)  # large answers, in pieces
        self.answers = PullAnswers(self.store, self.store_thread, self.tasks, self._send, self.refuse,
                                   lambda: 1e3 * self.steps.last_apply_s, self.transfers,
                                   pushes=lambda: self.steps.last_pushes)

    # ------------------------------------------------------------------ lifecycle
    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Service]:
        """Resume from the newest checkpoint and sweep for silent workers while inside;
        on the way out write the last checkpoint, then stop every part, in reverse order."""
        async with contextlib.AsyncExitStack() as stack:
            stack.callback(self.store.close)  # after the store thread: its last task may use the pool
            stack.callback(self.store_thread.close)
            stack.callback(self.steps.close)
            stack.push_async_callback(self.tasks.close)
            stack.callback(self.waiters.cancel_all)
            self.resume()
            stack.push_async_callback(self.checkpointer.close)
            if self.config.liveness.timeout > 0:
                self._sweep()
                stack.callback(lambda: self._sweeper.cancel() if self._sweeper is not None else None)
            yield self

    def resume(self) -> None:
        """Become the newest valid checkpoint, if any (before serving)."""
        cfg = self.checkpointer.resume()
        if cfg is not None:
            self.steps.optimizer = cfg
            # the job had started: steps close with whoever is back, not once --workers have joined
            # again (workers that come back later fold their pushes in; waiting for all could be forever)
            self.members.started = self.members.stepped = True

    def _sweep(self) -> None:
        timeout = self.config.liveness.timeout
        gone = self.members.sweep(timeout)
        if gone:
            self.stats.workers_gone += len(gone)
            log.warning("workers declared gone: not heard from within the liveness timeout",
                        extra={"workers": gone, "liveness_timeout_s": timeout, "live": len(self.members.live)})
            self.steps.workers_lost(gone)
        self._sweeper = self.clock.call_later(max(0.05, timeout / 8), self._sweep)

    def refuse(self, ident: bytes, req: int, exc: BaseException) -> None:
        """Answer a request with an ``error`` reply: the code of a :class:`StellaError`,
        or ``internal`` (logged with its traceback) for anything else."""
        if isinstance(exc, StellaError):
            code, message = exc.code, str(exc)
            log.warning("rejected", extra={"code": code.value, "reason": message})
        else:  # a bug must not take the server down
            code, message = ErrorCode.INTERNAL, f"internal server error: {type(exc).__name__}: {exc}"
            log.error("internal error", exc_info=exc)
        self.stats.count_error(code.value)
        self._send(ident, Error(req=max(req, 0), code=code.value, message=message), ())

    def _spawn(self, coro: Any, ident: bytes, req: int) -> None:
        """Run a handler's task; if it fails, request ``req`` of ``ident`` is refused."""
        self.tasks.spawn(coro, lambda e: self.refuse(ident, req, e))

    def drop_peer(self, key: str) -> None:
        """Forget the live workers of a key that is no longer admitted, so that steps do
        not wait for them."""
        gone = self.members.drop_key(key)
        if gone:
            log.warning("workers dropped: their key left the allowlist", extra={"workers": gone})
            self.steps.workers_lost(gone)

    # ------------------------------------------------------------------ observation
    def snapshot(self) -> JobSnapshot:
        """The job now, as ``status``, the metrics and ``/healthz`` show it."""
        s, now, live = self.stats, self.clock.now(), self.members.live
        shown, metrics_only = s.counters()
        age = None if s.last_checkpoint is None else max(0.0, time.time() - s.last_checkpoint)
        status = StatusReply(
            req=0, **shown, version=self.store.version, initialised=self.store.initialised, workers=self.members.ids(),
            worker_keys={w: i.fingerprint for w, i in live.items()}, insecure=self.config.insecure,
            expected_workers=self.config.workers, pending_pushes=self.steps.pending_count(),
            numel=self.store.numel, tensors=len(self.store.model.specs) if self.store.model else len(self.store.layout),
            optimizer=self.steps.optimizer.to_wire() if self.steps.optimizer else None, server_version=__version__,
            live=[WorkerStatus(worker=w, name=i.name, key_fingerprint=i.fingerprint,
                               last_seen_s=max(0.0, now - i.last_seen), pushes=i.pushes, pulls=i.pulls,
                               report=i.report, key_name=self.key_name(i.key)[:MAX_NAME_BYTES])
                  for w, i in sorted(live.items())],
            checkpoint_age_s=age, last_seen_s={w: round(now - i.last_seen, 3) for w, i in live.items()},
            gone_workers={w: round(now - i.last_seen, 3) for w, i in self.members.gone.items()},
            liveness_timeout_s=self.config.liveness.timeout, step_deadline_s=self.steps.deadline_now(),
            checkpoint_version=self.checkpointer.version, behind_workers=self.steps.behind(),
            mode=self.registration.mode, shard=self.config.shard, pull=self.store.pull,
            broadcast=self.store.broadcast_info, dense_below=self.config.dense_below,
            shards=self.shard_list.addresses())
        return JobSnapshot(status, **metrics_only, clipped_pushes=self.push_bound.clipped)

    # ------------------------------------------------------------------ dispatch
    def handle(self, ident: bytes, rx: Received, peer: Peer) -> None:
        """Serve one request from ``peer``; raises a :class:`StellaError` to refuse it."""
        match rx.msg:
            case Push() as msg if msg.pull is not None:
                self._push_and_pull(ident, msg, msg.pull, rx)
            case Push() as msg:
                self._push(ident, msg, rx)
            case Pull() as msg:
                self._pull(ident, msg)
            case Join() as msg:
                self._join(ident, msg, peer)
            case Register() as msg:
                work = self.registration.accept(msg, rx, self._member(ident, msg.worker, registered=False))
                self._spawn(self._reply(ident, work), ident, msg.req)
            case SetOptimizer() as msg:
                self._member(ident, msg.worker)
                cfg = self.steps.set_optimizer(msg.hparams)
                self._send(ident, OptimizerSet(req=msg.req, optimizer=cfg.to_wire(), version=self.store.version), ())
            case Status() as msg:
                self._send(ident, self.snapshot().status_reply(msg.req), ())
            case Leave() as msg:
                self._leave(ident, msg)
            case Heartbeat() as msg:
                self._heartbeat(ident, msg, peer)
            case Fetch() as msg:
                info = self._member(ident, msg.worker, registered=False)
                parts = self.transfers.piece(info.worker, msg.transfer, msg.offset, msg.length)
                self._send(ident, Chunk(req=msg.req, transfer=msg.transfer, offset=msg.offset), parts)
            case Upload() as msg:
                reply = self.registration.upload(msg, rx, self._member(ident, msg.worker, registered=False),
                                                 self.config.limits.max_message_bytes)
                self._send(ident, reply, ())
            case _:  # pragma: no cover - decode_request returns only the types above
                raise ProtocolError(f"no handler for {type(rx.msg).__name__}")

    # ------------------------------------------------------------------ handlers
    def _member(self, ident: bytes, worker: int, registered: bool = True) -> WorkerInfo:
        """The live worker ``worker`` of this connection; a gone one speaking again on
        its own connection is live again first."""
        members = self.members
        if worker not in members.live and members.revive(ident, worker) is not None:
            log.info("worker back", extra={"worker": worker, "live": len(self.members.live)})
        return members.check(ident, worker, registered=registered)

    def _join(self, ident: bytes, msg: Join, peer: Peer) -> None:
        info = self.members.join(ident, msg.worker, msg.name, reserved=self.steps.pending_workers(),
                                 key=peer.key, fingerprint=peer.fingerprint, session=msg.session)
        log.info("worker joined", extra={"worker": info.worker, "worker_name": info.name,
                                         "key_fingerprint": info.fingerprint, "live": len(self.members.live)})
        if msg.version is not None and msg.version > self.store.version:  # the server lost steps
            log.warning("a worker reconnects having seen a newer version: this server restarted from an older "
                        "checkpoint, or empty (no --checkpoint-dir)", extra={
                            "worker": info.worker, "worker_version": msg.version, "version": self.store.version})
        self._send(ident, Joined(req=msg.req, worker=info.worker, version=self.store.version,
                                 workers=len(self.members.live), initialised=self.store.initialised,
                                 session=info.session, heartbeat_s=self.config.liveness.heartbeat_s,
                                 liveness_s=self.config.liveness.timeout,
                                 shard=self.config.shard, dense_below=self.config.dense_below,
                                 shards=self.shard_list.addresses()), ())
        self.steps.membership_changed()

    def _heartbeat(self, ident: bytes, msg: Heartbeat, peer: Peer) -> None:
        _, revived = self.members.heartbeat(msg.worker, msg.session, peer.key)
        if revived:
            log.info("worker back (heartbeat)", extra={"worker": msg.worker, "live": len(self.members.live)})
        self._send(ident, HeartbeatOk(req=msg.req, version=self.store.version), ())

    def _leave(self, ident: bytes, msg: Leave) -> None:
        info = self._member(ident, msg.worker, registered=False)
        self.members.leave(info.worker)
        self.transfers.drop(info.worker)
        log.info("worker left", extra={"worker": info.worker, "live": len(self.members.live)})
        self._send(ident, Left(req=msg.req, worker=info.worker, version=self.store.version), ())
        self.steps.membership_changed()

    async def _reply(self, ident: bytes, work: Awaitable[Any]) -> None:
        """Send the reply ``work`` comes to (run by :meth:`_spawn`, which refuses on failure)."""
        self._send(ident, await work, ())

    def _push(self, ident: bytes, msg: Push, rx: Received) -> None:
        info = self._member(ident, msg.worker)
        if msg.req and msg.req <= info.last_push_req:  # re-sent after a reconnect: queued already
            self.stats.duplicate_pushes += 1
            self._send(ident, PushOk(req=msg.req, step=self.store.version, version=self.store.version,
                                     clipped=info.last_push_clipped), ())
            return
        if msg.upload is not None:  # its frames came ahead, in pieces
            up = info.upload
            if up is None or up.transfer != msg.upload or up.have != up.total:
                raise TransferLost(f"push: upload {msg.upload:#x} is not whole here: upload it, then push")
            frames = tuple(up.frames())
            check_payload(msg, frames)
            rx = Received(msg, frames)
            info.upload = None
        if msg.version > self.store.version:
            raise VersionError(f"push computed on version {msg.version}, but the server is at "
                               f"{self.store.version} (a version from the future)")
        nbytes = 0
        for f in rx.frames:
            nbytes += f.nbytes
        room = self.steps.room(info.worker, nbytes)  # before the work of decoding
        bound = self.push_bound
        if bound.on:  # the norm's parts come from the pass that checks the values
            sumsq: list[float] = []
            optimizer = self.steps.optimizer
            final = msg.final and not info.final_pushed  # one per registration
            tensors, kept = bound.apply(info.worker, decode_tensors(rx, self.store.layout, sumsq=sumsq), sumsq,
                                        model_norm=self.store.param_norm,
                                        gain=optimizer.push_gain() if optimizer is not None else None, final=final)
            info.final_pushed = info.final_pushed or final
        else:
            tensors, kept = decode_tensors(rx, self.store.layout), 1.0
        # the coding of its selected values (a push has one; the dense suffix's may differ): the broadcast's
        # budget counts its coordinates by their bits
        coding = next((e.value_dtype for e in msg.tensors if e.index_frame is not None), "f16")
        queued = self.steps.offer(room, msg.version, tensors, msg.hparams, msg.samples, coding)
        info.last_push_req = msg.req
        # what was scaled off is the worker's to send again: it is told where (this server's range) and how much
        info.last_push_clipped = [] if kept >= 1.0 else [(*self._range(), kept)]
        info.pushes += 1
        if msg.report is not None:
            info.report = msg.report
        self.stats.pushes += 1
        self._send(ident, PushOk(req=msg.req, step=self.store.version + queued, version=self.store.version,
                                 clipped=info.last_push_clipped), ())

    def _range(self) -> tuple[int, int]:
        """The range of the flat model this server holds."""
        model = self.store.model
        return (model.start, model.stop) if model is not None else (0, self.store.numel)

    def _push_and_pull(self, ident: bytes, msg: Push, pull: Pull, rx: Received) -> None:
        """A push with the round's pull riding on it: the push as :meth:`_push` takes it,
        then the pull as :meth:`_pull` would have taken it in a message of its own, each
        answered under its own ``req``. The pull is checked first, so that a refusal of
        either changes nothing; a refused push refuses its pull too. The sender's membership
        before either: a server that restarted from an older checkpoint does not know the
        worker, and must say so (the worker joins again and rebases), not that the pull is
        from the future (which a worker cannot mend)."""
        try:
            self._member(ident, msg.worker)
            self._check_pull(pull)
            self._push(ident, msg, rx)
        except Exception as e:
            self.refuse(ident, pull.req, e)
            raise  # the push's own refusal
        try:
            # the pull's hold starts now, once the push is taken and acknowledged, as when it came on its own
            # after the push: a worker takes the time from the acknowledgement to the answer, less the hold, as
            # the answer's link time
            self._pull(ident, pull)
        except Exception as e:  # e.g. too many waiting pulls: the push stays queued
            self.refuse(ident, pull.req, e)

    def _check_pull(self, msg: Pull) -> None:
        v = self.store.version
        if msg.since > v:
            raise VersionError(f"pull since version {msg.since}, but the server is at {v} (from the future)")
        wait_for = msg.wait_for or 0
        if wait_for > v + MAX_WAIT_AHEAD:
            raise VersionError(f"pull waits for version {wait_for}, more than {MAX_WAIT_AHEAD} ahead of {v}")

    def _pull(self, ident: bytes, msg: Pull) -> None:
        info = self._member(ident, msg.worker)
        info.pulls += 1
        self._check_pull(msg)
        wait_for = msg.wait_for or 0
        v = self.store.version
        arrived = time.monotonic()
        if wait_for <= v:
            self.answers.answer(ident, msg, arrived)
        else:
            self.waiters.add(msg.worker, wait_for, msg.timeout_ms / 1000,
                             lambda: self.answers.answer(ident, msg, arrived))
        self.stats.pulls += 1
