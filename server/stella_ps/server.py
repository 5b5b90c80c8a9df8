"""The parameter server: a zmq.asyncio ROUTER socket, request dispatch, validation.

Every message is validated completely before it touches the store or the
aggregation queue; a bad one gets an ``error`` reply naming the problem and
changes nothing. Store work (applying steps, building pull replies) runs on one
dedicated thread so the event loop keeps receiving while the C kernel runs.
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from stella import codec
from stella.errors import CodecError, ProtocolError
from stella.wire import MAX_TENSORS, TensorSpec, pack_header, unpack_header

from .aggregation import Aggregator, PendingPush, WorkerInfo
from .config import ServerConfig
from .optim import ConfigError, OptimizerConfig
from .store import Delta, ModelStore, layout_diff

__all__ = ["ParameterServer", "Rejected"]

log = logging.getLogger("stella_ps.server")
MAX_WAIT_AHEAD = 1024  # a pull may wait for at most this many future steps
PULL_CODINGS = tuple(c for c in codec.INDEX_CODINGS if c != "block16")


class Rejected(Exception):
    """A request the server refuses; ``code`` and the message go back to the sender."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class Stats:
    started: float = field(default_factory=time.time)
    bytes_in: int = 0
    bytes_out: int = 0
    messages: int = 0
    errors: int = 0
    pushes: int = 0
    pulls: int = 0
    steps: int = 0
    late_pushes: int = 0


@dataclass
class _Waiter:
    ident: bytes
    hdr: dict[str, Any]
    wait_for: int
    timer: asyncio.TimerHandle | None = None


class ParameterServer:
    """One stella-ps instance. ``await serve()`` runs it until ``stop()``."""

    def __init__(self, config: ServerConfig, ctx: zmq.asyncio.Context | None = None):
        self.config = config
        self.ctx = ctx or zmq.asyncio.Context()
        self._own_ctx = ctx is None
        self.store = ModelStore(history=config.history)
        self.agg = Aggregator(expected=config.workers)
        self.stats = Stats()
        self.endpoint: str | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._exec = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stella-store")
        self._stop = asyncio.Event()
        self._waiters: list[_Waiter] = []
        self._applying = False
        self._tasks: set[asyncio.Task] = set()
        self._deadline: asyncio.TimerHandle | None = None
        self._init_lock = asyncio.Lock()

    # ------------------------------------------------------------------ lifecycle
    def bind(self) -> str:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # libzmq drops a peer whose single frame exceeds this without buffering it;
        # messages below it but above max_message_bytes get an error reply instead.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.config.max_message_bytes)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        bind = self.config.bind
        if bind.startswith("tcp://") and bind.endswith(":0"):
            bind = bind[:-2] + ":*"
        sock.bind(bind)
        self._sock = sock
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.endpoint

    async def serve(self) -> None:
        if self._sock is None:
            self.bind()
        log.info("listening", extra={"endpoint": self.endpoint, "workers": self.config.workers})
        recv = None
        try:
            while not self._stop.is_set():
                recv = asyncio.ensure_future(self._sock.recv_multipart(copy=False))
                stop = asyncio.ensure_future(self._stop.wait())
                done, _ = await asyncio.wait({recv, stop}, return_when=asyncio.FIRST_COMPLETED)
                stop.cancel()
                if recv not in done:
                    recv.cancel()
                    break
                frames = recv.result()
                recv = None
                self._on_message(frames)
        finally:
            if recv is not None:
                recv.cancel()
            await self._shutdown()

    def stop(self) -> None:
        self._stop.set()

    async def _shutdown(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._deadline:
            self._deadline.cancel()
        self._exec.shutdown(wait=True)
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._own_ctx:
            self.ctx.term()
        log.info("stopped", extra={"version": self.store.version, "steps": self.stats.steps})

    # ------------------------------------------------------------------ transport
    def _send(self, ident: bytes, msg_type: str, req: int, frames: list[Any] = (), **fields: Any) -> None:
        hdr = pack_header(msg_type, req, **fields)
        parts = [ident, hdr, *frames]
        self.stats.bytes_out += len(hdr) + sum(memoryview(f).nbytes for f in frames)
        try:
            self._sock.send_multipart(parts, copy=len(frames) == 0)
        except zmq.ZMQError as e:  # peer gone: nothing to do
            log.debug("send failed", extra={"error": str(e)})

    def _error(self, ident: bytes, req: int, code: str, message: str, level: int = logging.WARNING) -> None:
        self.stats.errors += 1
        log.log(level, "rejected", extra={"code": code, "reason": message})
        self._send(ident, "error", req, code=code, message=message)

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        self.stats.messages += 1
        size = sum(len(f) for f in frames)
        self.stats.bytes_in += size
        ident = frames[0].bytes
        body = frames[1:]
        req = -1
        try:
            if not body:
                raise ProtocolError("empty message: no header frame")
            if size > self.config.max_message_bytes:
                raise Rejected("oversized", f"message of {size} bytes > limit {self.config.max_message_bytes}")
            hdr = unpack_header(body[0].buffer)
            req = hdr["req"]
            handler = getattr(self, "_on_" + hdr["type"])
            handler(ident, hdr, body[1:])
        except Rejected as e:
            self._error(ident, req, e.code, str(e))
        except ProtocolError as e:
            self._error(ident, req, e.code, str(e))
        except Exception as e:  # a bug must not take the server down
            log.exception("internal error")
            self._error(ident, req, "internal", f"internal server error: {type(e).__name__}: {e}")

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _in_store(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._exec, fn, *args)

    # ------------------------------------------------------------------ helpers
    def _worker(self, ident: bytes, hdr: dict[str, Any], registered: bool = True) -> WorkerInfo:
        wid = hdr["worker"]
        info = self.agg.live.get(wid)
        if info is None:
            raise Rejected("not_registered", f"worker {wid} has not joined (send 'join' first)")
        if info.routing_id != ident:
            raise Rejected("not_registered", f"worker {wid} belongs to another connection")
        if registered and not info.registered:
            raise Rejected("not_registered", f"worker {wid} has not registered the model")
        return info

    @staticmethod
    def _no_frames(hdr: dict[str, Any], frames: list) -> None:
        if frames:
            raise ProtocolError(f"{hdr['type']}: expected no payload frames, got {len(frames)}")

    # ------------------------------------------------------------------ handlers
    def _on_join(self, ident, hdr, frames) -> None:
        self._no_frames(hdr, frames)
        try:
            info = self.agg.join(ident, hdr.get("worker"), hdr.get("name", ""))
        except ValueError as e:
            raise Rejected("worker_id", str(e)) from None
        log.info("worker joined", extra={"worker": info.worker, "worker_name": info.name, "live": len(self.agg.live)})
        self._send(ident, "joined", hdr["req"], worker=info.worker, version=self.store.version,
                   workers=len(self.agg.live), initialised=self.store.initialised)
        self._maybe_close_steps()

    def _on_leave(self, ident, hdr, frames) -> None:
        self._no_frames(hdr, frames)
        info = self._worker(ident, hdr, registered=False)
        self.agg.leave(info.worker)
        log.info("worker left", extra={"worker": info.worker, "live": len(self.agg.live)})
        self._send(ident, "left", hdr["req"], worker=info.worker, version=self.store.version)
        self._maybe_close_steps()

    def _on_status(self, ident, hdr, frames) -> None:
        self._no_frames(hdr, frames)
        s = self.stats
        self._send(
            ident, "status", hdr["req"],
            version=self.store.version, initialised=self.store.initialised,
            workers=sorted(self.agg.live), expected_workers=self.config.workers,
            pending_pushes=self.agg.pending_count(), steps=s.steps, pushes=s.pushes, pulls=s.pulls,
            late_pushes=s.late_pushes, bytes_in=s.bytes_in, bytes_out=s.bytes_out, messages=s.messages,
            errors=s.errors, uptime_s=time.time() - s.started, numel=self.store.numel,
            tensors=len(self.store.layout or ()),
            optimizer=self.store.optimizer.to_wire() if self.store.optimizer else None,
        )

    def _on_register(self, ident, hdr, frames) -> None:
        info = self._worker(ident, hdr, registered=False)
        specs_raw = hdr["tensors"]
        if not specs_raw or len(specs_raw) > MAX_TENSORS:
            raise ProtocolError(f"register: between 1 and {MAX_TENSORS} tensors required")
        layout = [TensorSpec.from_wire(t) for t in specs_raw]
        if len({s.name for s in layout}) != len(layout):
            raise ProtocolError("register: tensor names must be unique")
        opt_raw = hdr["optimizer"] or self.config.optimizer or {"name": "sgd"}
        try:
            cfg = OptimizerConfig.from_wire(opt_raw)
        except ConfigError as e:
            raise Rejected("optimizer", str(e)) from None
        values = None
        if hdr["values"]:
            if len(frames) != len(layout):
                raise ProtocolError(f"register: expected {len(layout)} value frames, got {len(frames)}")
            values = []
            for spec, f in zip(layout, frames):
                try:
                    v = codec.decode_values(f.buffer, spec.numel, "f32")
                except CodecError as e:
                    raise CodecError(f"register: tensor {spec.name!r} value frame: {e}") from None
                if not np.isfinite(v).all():
                    raise Rejected("bad_value", f"register: tensor {spec.name!r} has NaN/Inf initial values")
                values.append(v)
        else:
            self._no_frames(hdr, frames)
        self._spawn(self._register(ident, hdr, info, layout, values, cfg))

    async def _register(self, ident, hdr, info, layout, values, cfg) -> None:
        async with self._init_lock:  # two first registrations must not both initialise
            created = False
            if not self.store.initialised:
                if values is None:
                    # the client's normal probe before it sends the initial values
                    self._error(ident, hdr["req"], "not_registered",
                                "model not initialised yet: register with values", level=logging.DEBUG)
                    return
                await self._in_store(self.store.initialise, layout, values, cfg)
                created = True
                log.info("model initialised", extra={"tensors": len(layout), "numel": self.store.numel,
                                                     "optimizer": cfg.to_wire()})
            else:
                diff = layout_diff(self.store.layout, layout)
                if diff:
                    self._error(ident, hdr["req"], "layout_conflict", f"layout differs from the server's model: {diff}")
                    return
            info.registered = True
            self._send(ident, "registered", hdr["req"], version=self.store.version, created=created,
                       optimizer=self.store.optimizer.to_wire(), numel=self.store.numel)

    def _on_set_optimizer(self, ident, hdr, frames) -> None:
        self._no_frames(hdr, frames)
        self._worker(ident, hdr)
        try:
            self.store.optimizer = self.store.optimizer.updated(hdr["hparams"])
        except ConfigError as e:
            raise Rejected("optimizer", str(e)) from None
        self._send(ident, "optimizer_set", hdr["req"], optimizer=self.store.optimizer.to_wire(),
                   version=self.store.version)

    def _on_push(self, ident, hdr, frames) -> None:
        info = self._worker(ident, hdr)
        version = hdr["version"]
        if version < 0 or version > self.store.version:
            raise Rejected("version", f"push computed on version {version}, but the server is at "
                           f"{self.store.version} (a version from the future)")
        entries = hdr["tensors"]
        layout = self.store.layout
        tensors: list[tuple[int, np.ndarray | None, np.ndarray]] = []
        seen: set[int] = set()
        fi = 0
        for e in entries:
            if not isinstance(e, dict):
                raise ProtocolError("push: each tensor entry must be a map")
            t, n, ic, vd = e.get("t"), e.get("n"), e.get("ic", "raw32"), e.get("vd", "f32")
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < len(layout):
                raise Rejected("unknown_tensor", f"push: tensor {t!r} is not in the model (0..{len(layout) - 1})")
            if t in seen:
                raise ProtocolError(f"push: tensor {t} appears twice")
            seen.add(t)
            spec = layout[t]
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ProtocolError(f"push: tensor {spec.name!r}: count must be a non-negative int")
            if n > spec.numel:
                raise Rejected("oversized", f"push: tensor {spec.name!r}: {n} values > its {spec.numel} elements")
            dense = ic == "dense"
            need = 1 if dense else 2
            if fi + need > len(frames):
                raise ProtocolError(f"push: frames missing for tensor {spec.name!r} "
                                    f"({len(frames)} payload frames for {len(entries)} tensors)")
            if dense:
                if n != spec.numel:
                    raise ProtocolError(f"push: dense tensor {spec.name!r} needs {spec.numel} values, got {n}")
                idx = None
            else:
                try:
                    idx = codec.decode_indices(frames[fi].buffer, n, spec.numel, ic)
                except CodecError as e:
                    raise CodecError(f"push: tensor {spec.name!r} index frame ({ic}): {e}") from None
            try:
                vals = codec.decode_values(frames[fi + need - 1].buffer, n, vd)
            except CodecError as e:
                raise CodecError(f"push: tensor {spec.name!r} value frame ({vd}): {e}") from None
            fi += need
            if not np.isfinite(vals).all():
                raise Rejected("bad_value", f"push: tensor {spec.name!r} has NaN/Inf values")
            tensors.append((t, idx, vals))
        if fi != len(frames):
            raise ProtocolError(f"push: {len(frames)} payload frames, header describes {fi}")
        push = PendingPush(info.worker, version, tensors, sum(len(f) for f in frames))
        queued = self.agg.add(push)
        info.pushes += 1
        self.stats.pushes += 1
        self._send(ident, "push_ok", hdr["req"], step=self.store.version + queued, version=self.store.version)
        self._maybe_close_steps(first_push=True)

    def _on_pull(self, ident, hdr, frames) -> None:
        self._no_frames(hdr, frames)
        self._worker(ident, hdr)
        since, v = hdr["since"], self.store.version
        if since > v:
            raise Rejected("version", f"pull since version {since}, but the server is at {v} (from the future)")
        ic = hdr.get("ic", "raw32")
        if ic not in PULL_CODINGS:  # block16 codes only whole blocks, which a delta need not be
            raise ProtocolError(f"pull: index coding {ic!r} not available for pulls; known: {list(PULL_CODINGS)}")
        wait_for = hdr.get("wait_for", 0)
        if wait_for > v + MAX_WAIT_AHEAD:
            raise Rejected("version", f"pull waits for version {wait_for}, more than {MAX_WAIT_AHEAD} ahead of {v}")
        self.stats.pulls += 1
        if wait_for <= v:
            self._spawn(self._reply_delta(ident, hdr))
            return
        w = _Waiter(ident, hdr, wait_for)
        timeout_ms = hdr.get("timeout_ms", 60_000)
        w.timer = asyncio.get_running_loop().call_later(max(0, timeout_ms) / 1000, self._expire, w)
        self._waiters.append(w)

    def _expire(self, w: _Waiter) -> None:
        if w in self._waiters:
            self._waiters.remove(w)
            self._spawn(self._reply_delta(w.ident, w.hdr))

    async def _reply_delta(self, ident, hdr) -> None:
        delta: Delta = await self._in_store(self.store.delta_since, hdr["since"])
        ic = hdr.get("ic", "raw32")
        entries, out = [], []
        for t, idx, vals in delta.tensors:
            if idx is None:
                entries.append({"t": t, "n": int(vals.size), "ic": "dense"})
                out.append(vals)
            else:
                entries.append({"t": t, "n": int(idx.size), "ic": ic})
                out.append(codec.encode_indices(idx, self.store.layout[t].numel, ic))
                out.append(vals)
        self._send(ident, "delta", hdr["req"], out, version=delta.version, full=delta.full, tensors=entries)

    # ------------------------------------------------------------------ aggregation
    def _maybe_close_steps(self, first_push: bool = False) -> None:
        if self._applying:
            return  # the running apply loop re-checks when it finishes
        if self.agg.ready() or (self.agg.started and not self.agg.live and self.agg.has_pending()):
            self._applying = True
            self._spawn(self._apply_ready())
        elif first_push and self.config.step_deadline > 0 and self._deadline is None and self.agg.started:
            self._deadline = asyncio.get_running_loop().call_later(self.config.step_deadline, self._on_deadline)

    def _on_deadline(self) -> None:
        self._deadline = None
        if not self._applying and self.agg.has_pending():
            missing = [w for w in self.agg.live if not self.agg.pending.get(w)]
            log.info("step deadline passed", extra={"missing_workers": missing, "version": self.store.version})
            self._applying = True
            self._spawn(self._apply_ready(force=True))

    async def _apply_ready(self, force: bool = False) -> None:
        try:
            while force or self.agg.ready() or (self.agg.started and not self.agg.live and self.agg.has_pending()):
                force = False
                if self._deadline:
                    self._deadline.cancel()
                    self._deadline = None
                pushes = self.agg.take_step()
                if not pushes:
                    break
                per_tensor: list[list] = [[] for _ in self.store.layout]
                for p in pushes:
                    if p.version < self.store.version - 1:
                        self.stats.late_pushes += 1
                    for t, idx, vals in p.tensors:
                        per_tensor[t].append((idx, vals))
                cfg = self.store.optimizer
                t0 = time.perf_counter()
                version = await self._in_store(self.store.apply_step, per_tensor, 1.0 / len(pushes), cfg)
                self.stats.steps += 1
                log.debug("step applied", extra={"version": version, "contributors": len(pushes),
                                                  "apply_ms": round(1e3 * (time.perf_counter() - t0), 3)})
                self._serve_waiters()
        finally:
            self._applying = False
        if self.agg.has_pending():
            self._maybe_close_steps(first_push=True)

    def _serve_waiters(self) -> None:
        v = self.store.version
        ready = [w for w in self._waiters if w.wait_for <= v]
        for w in ready:
            self._waiters.remove(w)
            if w.timer:
                w.timer.cancel()
            self._spawn(self._reply_delta(w.ident, w.hdr))
