"""``stella.Client``: the API a training script uses to talk to ``stella-ps``.

``Client(address)`` connects and joins; ``register`` declares the model; then ``push``
and ``pull`` each step. Requests carry an id and replies are matched by it, so several
requests can be in flight: ``push(..., wait=False)`` and ``pull(..., wait=False)``
return a :class:`Pending` whose ``result()`` waits for the reply, which the pipelined
optimizer uses to overlap a push and the following pull. Every message is built and
checked by :mod:`stella.protocol`. A client is not thread-safe: use it from one thread
(the pipeline gives its background thread its own client).

The connection underneath is a :class:`stella._session.Session`: the socket, reply
matching, heartbeats, and the automatic reconnect, which joins and registers again and
re-sends every request still waiting for its reply, rebased on the server's version
(:func:`stella._session.rebase`). So a training loop, and
:class:`~stella.StellaOptimizer` on top of it, goes on through a server restart and
resumes from the server's version.
"""
from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar, cast, overload

import numpy as np
import zmq

from . import codec
from ._session import (
    CHUNK_ABOVE,
    ENV_CLIENT_KEY,
    ENV_RECONNECT,
    ENV_SERVER_KEY,
    ENV_TIMEOUT,
    Session,
    curve_keys,
    default_reconnect,
    default_timeout,
    expect,
)
from .errors import ErrorCode, ProtocolError, ServerError
from .layout import FlatLayout, FlatUpdate, FlatValues, Part
from .payload import SparseTensor, concat_entries, decode_tensors, encode_tensors, part_specs
from .protocol import (
    Delta,
    IndexCoding,
    Leave,
    Left,
    ModelDtype,
    OptimizerSet,
    Pull,
    PullCoding,
    Push,
    PushOk,
    Received,
    Registered,
    SetOptimizer,
    Status,
    StatusReply,
    TensorSpec,
    TrainingMode,
    ValueDtype,
    WorkerReport,
)

__all__ = ["Client", "Pending", "PullResult", "EncodedPush", "ENV_TIMEOUT", "ENV_SERVER_KEY", "ENV_CLIENT_KEY",
           "ENV_RECONNECT", "default_timeout", "default_reconnect", "curve_keys"]

log = logging.getLogger("stella.client")

_TORCH_DTYPES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16"}
T = TypeVar("T")
V = TypeVar("V")


def _to_numpy_f32(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor, without importing torch here
        x = x.detach().to("cpu")
        if str(x.dtype) != "torch.float32":
            x = x.float()
        return x.contiguous().numpy().reshape(-1)
    return np.ascontiguousarray(x, dtype=np.float32).reshape(-1)


def _dtype_name(x: Any) -> ModelDtype:
    if hasattr(x, "detach"):
        name = _TORCH_DTYPES.get(str(x.dtype))
    else:
        name = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}.get(np.asarray(x).dtype)
    if name is None:
        raise TypeError(f"unsupported tensor dtype {x.dtype}; use float32, float16 or bfloat16")
    return cast(ModelDtype, name)


def _values(items: list[tuple[str, Any]]) -> list[np.ndarray]:
    return [_to_numpy_f32(t) for _, t in items]


@dataclass(frozen=True)
class EncodedPush:
    """A push's entries and frames, encoded once (:meth:`Client.encode_push`)."""

    entries: list[Any]
    frames: list[Any]


@dataclass
class PullResult:
    """What changed on the server, in the flat model's coordinates (:mod:`stella.layout`),
    in one of two forms (docs/protocol.md, ``delta``):

    - ``values``: pieces whose float32 values are to be *installed* (exact pulls, and
      every snapshot: ``full``);
    - ``steps`` (the server's compressed broadcast): one list of pieces per step after
      the pull's ``since``, in order, whose float32 values are to be *added*, one step
      after another: a replica that adds them equals the server's broadcast model bit
      for bit. ``values`` is then empty.

    ``tensors`` and :meth:`apply_to` give the installed values per tensor name (the API
    for scripts; the optimizer works on the flat pieces). ``rebased``: the pull was made
    before a reconnect and rebased after it (its ``wait_for`` dropped, or turned into a
    snapshot; :func:`stella._session.rebase`), so this answer need not contain the step
    it waited for. ``held_s``: how long the server held the pull before it sent the
    answer (waiting for the step, encoding): the rest of the time the pull took is the
    link's (:mod:`stella.adapt` measures with it).
    """

    version: int
    full: bool
    values: list[FlatValues] = field(default_factory=list)
    rebased: bool = False
    steps: list[list[FlatValues]] = field(default_factory=list)
    held_s: float = 0.0
    step_s: float = 0.0  # the server's time applying its latest step
    pushes: int = 0  # the pushes the server's latest step combined (0: not said)
    layout: FlatLayout | None = None  # the model's (for the per-tensor views)
    names: tuple[str, ...] = ()  # its tensors' names, by tensor number

    @property
    def count(self) -> int:
        """Values carried (all steps)."""
        return sum(p.values.size for pieces in (self.values, *self.steps) for p in pieces)

    def per_name(self, pieces: list[FlatValues]) -> dict[str, tuple[np.ndarray | None, np.ndarray]]:
        if not pieces:
            return {}
        assert self.layout is not None, "a decoded pull holds its layout"
        return {self.names[t]: v for t, v in sorted(self.layout.per_tensor(pieces).items())}

    @property
    def tensors(self) -> dict[str, tuple[np.ndarray | None, np.ndarray]]:
        """The values to install, per tensor name: ``(indices in the tensor or None if
        all of it, float32 values)``."""
        return self.per_name(self.values)

    def apply_to(self, params: Mapping[str, Any]) -> None:
        """Install the values (or add the steps) into local tensors (NumPy arrays or torch
        tensors, any device), by name."""
        for name, (idx, vals) in self.tensors.items():
            _put(params[name], idx, vals, add=False)
        for step in self.steps:
            for name, (idx, vals) in self.per_name(step).items():
                _put(params[name], idx, vals, add=True)


def update_parts(g: Any) -> tuple[Any, Any]:
    """``(indices or None, values)`` of one tensor's update as :meth:`Client.push` takes
    it: an object with ``indices`` and ``values``, a pair, or a dense array."""
    if hasattr(g, "indices") and hasattr(g, "values"):
        return g.indices, g.values
    if isinstance(g, tuple):
        return g[0], g[1]
    return None, g


def _put(dst: Any, idx: np.ndarray | None, vals: np.ndarray, *, add: bool) -> None:
    """``dst[idx] = vals`` (or ``+=``), for a NumPy array or a torch tensor; float32
    additions, as the server makes them."""
    if hasattr(dst, "detach"):
        import torch

        flat = dst.detach().view(-1)
        # frames are read-only buffers; torch wants writable memory
        src = torch.from_numpy(vals if vals.flags.writeable else vals.copy()).to(flat.device, flat.dtype)
        at = None if idx is None else torch.from_numpy(idx.astype(np.int64)).to(flat.device)
        if add:
            flat.add_(src) if at is None else flat.index_add_(0, at, src)
        elif at is None:
            flat.copy_(src)
        else:
            flat[at] = src
    else:
        flat = dst.reshape(-1)
        if idx is None:
            flat[:] = flat + vals if add else vals
        elif add:
            flat[idx] += vals
        else:
            flat[idx] = vals


class Pending(Generic[T]):
    """A request in flight; :meth:`result` waits for its reply (once)."""

    def __init__(self, session: Session, req: int, parse: Callable[[Received], T], timeout: float | None):
        self._session, self.req, self._parse, self._timeout = session, req, parse, timeout

    def result(self, timeout: float | None = None) -> T:
        """The parsed reply; raises the server's error, or :class:`ServerUnavailable`."""
        rx = self._session.wait_resilient(self.req, timeout=self._timeout if timeout is None else timeout)
        return self._parse(rx)


class _FromSession(Generic[V]):
    """A :class:`Client` attribute that its session holds (read and written there)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, owner: type) -> _FromSession[V]: ...
    @overload
    def __get__(self, obj: Client, owner: type) -> V: ...
    def __get__(self, obj: Client | None, owner: type) -> Any:
        return self if obj is None else getattr(obj._session, self._name)

    def __set__(self, obj: Client, value: V) -> None:
        setattr(obj._session, self._name, value)


class Client:
    """Connection to one stella-ps.

    ``Client(address)`` connects and joins; ``register`` declares the model layout (the first
    registration initialises the server's store); then ``push`` and ``pull`` each step.
    Every blocking call takes ``timeout`` (seconds; default ``STELLA_TIMEOUT`` or 60) and
    raises :class:`ServerUnavailable` when it passes.

    ``server_key`` (the server's public certificate file or Z85 key) and ``client_key``
    (this client's ``.key_secret`` certificate file), or ``STELLA_SERVER_KEY`` and
    ``STELLA_CLIENT_KEY``, turn on CurveZMQ: encryption, and authentication on both
    sides. Without them the client speaks plaintext, which only a server started with
    ``--insecure`` accepts.

    ``reconnect`` (seconds; default ``STELLA_RECONNECT_S`` or 300, 0: never) bounds
    the automatic reconnect (see :mod:`stella._session`), :attr:`reconnect_s` afterwards;
    ``heartbeat`` False sends no heartbeats (the server then declares the worker gone when
    it is silent for its liveness timeout). :attr:`reconnects` counts the reconnects made.
    """

    address = _FromSession[str]()
    name = _FromSession[str]()
    timeout = _FromSession[float]()  # seconds, the default of every blocking call
    worker_id = _FromSession[int | None]()
    secure = _FromSession[bool]()  # CurveZMQ keys are in use
    server_version = _FromSession[int]()  # the server's version in its last join/register reply
    shard = _FromSession[str]()  # "I/N" when the server is shard I of a sharded job (stella.shards)
    reconnect_s = _FromSession[float]()  # the overall deadline of a reconnect (0: never reconnect)
    reconnects = _FromSession[int]()  # reconnects made
    bytes_pushed = _FromSession[int]()
    bytes_pulled = _FromSession[int]()

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = None,
        name: str = "",
        worker_id: int | None = None,
        join: bool = True,
        server_key: str | None = None,
        client_key: str | None = None,
        ctx: zmq.Context | None = None,
        reconnect: float | None = None,
        heartbeat: bool = True,
    ):
        reconnect_s = default_reconnect() if reconnect is None else float(reconnect)
        self._session = Session(address, timeout=default_timeout() if timeout is None else float(timeout),
                                reconnect_s=reconnect_s, name=name or f"pid{os.getpid()}", worker_id=worker_id,
                                server_key=server_key, client_key=client_key, ctx=ctx, heartbeat=heartbeat)
        self.layout: list[TensorSpec] = []  # the model's tensors, as registered
        self.flat: FlatLayout | None = None  # the model laid out flat
        self.range = (0, 0)  # the flat coordinates this server holds
        self.parts: list[Part] = []  # the range as the server's tensors, what the wire's entries name
        self._part_specs: list[TensorSpec] = []
        self._index: dict[str, int] = {}
        self.shard_addresses: list[str] = []  # the job's shards as the server's join reply lists them (stella.shards)
        if join:
            try:
                self.join(worker_id)
            except ServerError as e:
                if worker_id is None or e.code != ErrorCode.WORKER_ID:
                    raise
                # still held by a connection the server has not declared gone: a restarted worker's own old
                # one, until --liveness-timeout. Not waited for: a new id, as a reconnect takes in that case
                log.warning("the worker id asked for is still held by a connection the server has not declared "
                            "gone (a restarted worker's old one): joining with a new id",
                            extra={"address": address, "worker": worker_id, "reason": str(e)})
                self.join(None)

    def _tensor(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in the registered model") from None

    def join(self, worker_id: int | None = None, *, timeout: float | None = None) -> int:
        """Join the job (as ``worker_id`` if given: a restarted worker); returns the id."""
        reply = self._session.join(worker_id, timeout)
        self.shard_addresses = list(reply.shards)
        return reply.worker

    def register(
        self,
        tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
        optimizer: Mapping[str, Any] | None = None,
        *,
        mode: TrainingMode | None = None,
        timeout: float | None = None,
        range: tuple[int, int] | None = None,
        version: int = 0,
    ) -> Registered:
        """Declare the model layout; the first registration also sends the initial values.
        The model is laid out flat with the server's dense cut (:mod:`stella.layout`);
        ``range``: the flat coordinates ``[start, stop)`` this server holds (a sharded
        job's shard; None: all of them).

        ``mode`` ("gradient" or "update", as :class:`~stella.StellaOptimizer` sends it)
        makes the server refuse workers of the other mode in the same job.

        ``optimizer`` is the server-side optimizer (``{"name": "adamw", "lr": ...}``);
        None takes the server's default (``stella-ps --optimizer``). Later workers with
        the same layout join the existing model; a different layout raises
        :class:`LayoutConflict`. The reply's ``base`` says where to start: the version
        whose model equals these values (this registration created the model, or the
        model was created with the same values: the registration carries their digest,
        :func:`stella.payload.model_digest`), to pull since; None: pull a full snapshot.
        ``version``: the version of the job's model these values are (a worker resuming
        from its checkpoint); a registration that creates the model starts the count there.
        """
        items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
        layout = [TensorSpec(n, tuple(int(s) for s in t.shape), _dtype_name(t)) for n, t in items]
        flat = FlatLayout.of(layout, self._session.dense_below)
        start, stop = (0, flat.numel) if range is None else range
        parts = flat.parts(start, stop)

        def values() -> list[np.ndarray]:  # the range's values, a frame per part
            v = flat.gather(_values(items), start, stop)
            return [v[p.start - start:p.stop - start] for p in parts]

        # a reconnect registers again, reading the values then (a server that lost the model needs them)
        reply = self._session.register(layout, start, stop, flat.dense_below, dict(optimizer or {}), mode, values,
                                       timeout, version)
        self.layout, self.flat, self.range, self.parts = layout, flat, (start, stop), parts
        self._part_specs = part_specs(parts)
        self._index = {s.name: i for i, s in enumerate(layout)}
        return reply

    @overload
    def push(self, grads: Mapping[str, Any] | FlatUpdate | EncodedPush, version: int, *, value_dtype: ValueDtype = ...,
             index_coding: IndexCoding = ..., hparams: Mapping[str, Any] | None = ...,
             report: WorkerReport | None = ..., samples: int | None = ..., final: bool = ...,
             timeout: float | None = ...,
             wait: Literal[True] = ...) -> PushOk: ...
    @overload
    def push(self, grads: Mapping[str, Any] | FlatUpdate | EncodedPush, version: int, *, value_dtype: ValueDtype = ...,
             index_coding: IndexCoding = ..., hparams: Mapping[str, Any] | None = ...,
             report: WorkerReport | None = ..., samples: int | None = ..., final: bool = ...,
             timeout: float | None = ...,
             wait: Literal[False]) -> Pending[PushOk]: ...
    @overload
    def push(self, grads: Mapping[str, Any] | FlatUpdate | EncodedPush, version: int, *, value_dtype: ValueDtype = ...,
             index_coding: IndexCoding = ..., hparams: Mapping[str, Any] | None = ...,
             report: WorkerReport | None = ..., samples: int | None = ..., final: bool = ...,
             timeout: float | None = ...,
             wait: bool) -> PushOk | Pending[PushOk]: ...
    def push(
        self,
        grads: Mapping[str, Any] | FlatUpdate | EncodedPush,
        version: int,
        *,
        value_dtype: ValueDtype = "f32",
        index_coding: IndexCoding = "rice",
        hparams: Mapping[str, Any] | None = None,
        report: WorkerReport | None = None,
        samples: int | None = None,
        final: bool = False,
        timeout: float | None = None,
        wait: bool = True,
    ) -> PushOk | Pending[PushOk]:
        """Push one step's update, computed on model ``version``.

        ``grads`` maps tensor names to a sparse update (an object with ``indices``
        and ``values``, e.g. :class:`stella.compress.SparseGrad`, or a pair
        ``(indices, values)`` with sorted unique indices; ``indices`` None means dense)
        or to a dense array; or ``grads`` is the update in the flat model's coordinates
        (a :class:`~stella.layout.FlatUpdate`: one vector, what the optimizer pushes), or
        an :class:`EncodedPush`, whose codings were fixed when it was encoded. Values
        travel as ``value_dtype``: "f32" by default, exact; "f16"/"bf16" round them and
        "q4"/"q2" quantise them to 4 or 2 bits with a scale per 64 values; the dense suffix
        of small tensors, when it goes whole, in :func:`stella.codec.dense_coding` of it
        (the compressor keeps those errors in its residual when it is told the dtype;
        docs/compression.md). ``hparams`` change optimizer
        hyper-parameters from the step this push joins on (no extra round trip).
        ``report``: this worker's timings, shown by ``stella status`` and the metrics.
        ``samples``: what the update represents (samples, or micro-batches): the server
        weights the pushes of a step by it (None: one unit; docs/optimizer.md).
        ``final``: this worker's last push, its whole error-feedback residual (close()): the
        server's push clip allows it more, once (docs/security.md).
        Returns :class:`~stella.protocol.PushOk` (``step`` the push joined; ``clipped``:
        where the server's push-norm bound scaled the push down and the factor it kept, the
        rest being the caller's to send again, as :class:`~stella.StellaOptimizer` does), or
        a :class:`Pending` of it with ``wait=False``.
        """
        msg, frames = self._push_message(grads, version, value_dtype, index_coding, hparams, report, samples, final,
                                         timeout)
        s = self._session
        pending = Pending(s, s.send(msg, frames, timeout), self._push_ok, timeout)
        return pending if not wait else pending.result()

    def _push_message(self, grads: Mapping[str, Any] | FlatUpdate | EncodedPush, version: int,
                      value_dtype: ValueDtype, index_coding: IndexCoding, hparams: Mapping[str, Any] | None,
                      report: WorkerReport | None, samples: int | None, final: bool, timeout: float | None
                      ) -> tuple[Push, list[Any]]:
        enc = grads if isinstance(grads, EncodedPush) else self.encode_push(grads, value_dtype=value_dtype,
                                                                             index_coding=index_coding)
        frames = list(enc.frames)
        s = self._session
        msg = Push(worker=s.worker(), version=s.push_version(int(version)), tensors=enc.entries,
                   hparams=dict(hparams) if hparams else None, report=report, samples=samples, final=final)
        if sum(memoryview(f).nbytes for f in frames) > CHUNK_ABOVE:  # over a slow link: in pieces first
            msg, frames = s.staged(msg, frames, timeout), []
        return msg, frames

    @overload
    def pull(self, since: int | None = ..., *, wait_for: int | None = ..., index_coding: PullCoding = ...,
             timeout: float | None = ..., decode: bool = ..., wait: Literal[True] = ...) -> PullResult: ...
    @overload
    def pull(self, since: int | None = ..., *, wait_for: int | None = ..., index_coding: PullCoding = ...,
             timeout: float | None = ..., decode: bool = ..., wait: Literal[False]) -> Pending[PullResult]: ...
    @overload
    def pull(self, since: int | None = ..., *, wait_for: int | None = ..., index_coding: PullCoding = ...,
             timeout: float | None = ..., decode: bool = ..., wait: bool) -> PullResult | Pending[PullResult]: ...
    def pull(
        self,
        since: int | None = None,
        *,
        wait_for: int | None = None,
        index_coding: PullCoding = "rice",
        timeout: float | None = None,
        decode: bool = True,
        wait: bool = True,
    ) -> PullResult | Pending[PullResult]:
        """What changed after version ``since`` (None: a full snapshot), a :class:`PullResult`
        (or a :class:`Pending` of it with ``wait=False``).

        With ``wait_for``, the server holds the reply until its version reaches it
        (or ``timeout`` passes, then it answers with what it has). ``decode=False``: the
        reply's version only, its values dropped unread (a monitor, a benchmark's
        light client); a replica must decode every answer.
        """
        s = self._session
        msg, parse = self._pull_message(since, wait_for, index_coding, timeout, decode)
        pending = Pending(s, s.send(msg, (), timeout), parse, timeout)
        return pending if not wait else pending.result()

    def _pull_message(self, since: int | None, wait_for: int | None, index_coding: PullCoding,
                      timeout: float | None, decode: bool) -> tuple[Pull, Callable[[Received], PullResult]]:
        s = self._session
        t = s.timeout if timeout is None else timeout
        if s.need_snapshot and since is not None:
            since, wait_for = None, None  # the replica is of a history the server lost: its snapshot
        msg = Pull(worker=s.worker(), since=-1 if since is None else int(since), coding=index_coding,
                   wait_for=None if wait_for is None else int(wait_for),
                   timeout_ms=int(t * 1000 * 0.9),  # the server answers before we give up
                   chunk_bytes=CHUNK_ABOVE)  # a larger answer (a snapshot) comes in pieces
        return msg, (self._pull_result if decode else functools.partial(self._pull_result, decode=False))

    def push_pull(self, grads: Mapping[str, Any] | FlatUpdate | EncodedPush, version: int, since: int | None, *,
                  wait_for: int | None = None, value_dtype: ValueDtype = "f32", index_coding: IndexCoding = "rice",
                  pull_coding: PullCoding = "rice", hparams: Mapping[str, Any] | None = None,
                  report: WorkerReport | None = None, samples: int | None = None, timeout: float | None = None,
                  decode: bool = True) -> tuple[Pending[PushOk], Pending[PullResult]]:
        """One round's :meth:`push` and :meth:`pull` (``wait=False`` both, the pull after the
        push) in one message: the server handles the pull once the push is queued and
        answers each on its own, so the two :class:`Pending` results are those of the two
        calls, at one message a round instead of two (docs/protocol.md, ``push``). A push
        that goes up in pieces (over a slow link) and its pull go as two messages."""
        msg, frames = self._push_message(grads, version, value_dtype, index_coding, hparams, report, samples,
                                         False, timeout)
        pull, parse = self._pull_message(since, wait_for, pull_coding, timeout, decode)
        s = self._session
        if msg.upload is not None:
            a, b = s.send_apart(msg, frames, pull, timeout)
        else:
            a, b = s.send_pair(msg, frames, pull, timeout)
        return Pending(s, a, self._push_ok, timeout), Pending(s, b, parse, timeout)

    def flatten(self, grads: Mapping[str, Any]) -> FlatUpdate:
        """Per-tensor updates (as :meth:`push` takes them) as one update of the flat model."""
        per_tensor = {}
        for name, g in grads.items():
            idx, vals = update_parts(g)
            per_tensor[self._tensor(name)] = (None if idx is None else np.asarray(idx), _to_numpy_f32(vals))
        if self.flat is None:
            raise ProtocolError("register the model first")
        return self.flat.flatten(per_tensor)

    def encode_push(self, grads: Mapping[str, Any] | FlatUpdate, *, value_dtype: ValueDtype = "f32",
                    index_coding: IndexCoding = "rice") -> EncodedPush:
        """``grads`` (as :meth:`push` takes them) encoded once, to be pushed any number of
        times (``push(encoded, version)``: replay, as ``bench.server`` does): the parts of
        the update in this server's range, each part one entry."""
        update = grads if isinstance(grads, FlatUpdate) else self.flatten(grads)
        assert self.flat is not None
        sparse, whole = [], []
        for k, p in enumerate(self.parts):
            a, b = np.searchsorted(update.indices, [p.start, p.stop])
            if p.whole and update.dense is not None:
                if a < b:
                    raise ValueError("an update gives the dense suffix whole and some of its coordinates besides")
                cut = self.flat.sparse_numel
                whole.append(SparseTensor(k, None, update.dense[p.start - cut:p.stop - cut]))
            elif a < b:
                sparse.append(SparseTensor(k, (update.indices[a:b] - p.start).astype(np.int32),
                                           np.ascontiguousarray(update.values[a:b], np.float32)))
        entries, frames = concat_entries([encode_tensors(sparse, self._part_specs, index_coding, value_dtype),
                                          encode_tensors(whole, self._part_specs, index_coding,
                                                         codec.dense_coding(value_dtype))])
        return EncodedPush(entries, frames)

    def _push_ok(self, rx: Received) -> PushOk:
        ok = expect(rx, PushOk)
        self._session.saw(ok.version)
        return ok

    def _pull_result(self, rx: Received, decode: bool = True) -> PullResult:
        delta = expect(rx, Delta)
        self._session.saw(delta.version)
        if delta.full:
            self._session.need_snapshot = False
        rebased = self._session.was_rebased(delta.req)
        held, step = delta.held_ms / 1e3, delta.step_ms / 1e3
        if not decode:  # the version only
            return PullResult(delta.version, delta.full, rebased=rebased, held_s=held, step_s=step,
                              pushes=delta.pushes)
        decoded = [self._flat_values(s) for s in decode_tensors(rx, self._part_specs, float32=True)]
        kw = dict(rebased=rebased, held_s=held, step_s=step, pushes=delta.pushes, layout=self.flat,
                  names=tuple(s.name for s in self.layout))
        if not delta.add:
            return PullResult(delta.version, delta.full, decoded, **kw)  # type: ignore[arg-type]
        steps, at = [], 0
        for n in delta.parts:  # one part per step made after ``since`` (none: no step)
            steps.append(decoded[at:at + n])
            at += n
        return PullResult(delta.version, False, steps=steps, **kw)  # type: ignore[arg-type]

    def _flat_values(self, s: SparseTensor) -> FlatValues:
        """A decoded entry (a part of this server's range) in the flat model's coordinates."""
        return FlatValues(s.values, s.indices, self.parts[s.tensor].start)

    def status(self, *, timeout: float | None = None) -> StatusReply:
        """The server's counters (see docs/protocol.md, ``status``); needs no join."""
        return self._session.request(Status(), StatusReply, timeout=timeout)

    def set_optimizer(self, *, timeout: float | None = None, **hparams: Any) -> dict[str, Any]:
        """Change optimizer hyper-parameters (e.g. ``lr``) from the next step on."""
        msg = SetOptimizer(worker=self._session.worker(), hparams=hparams)
        return self._session.request(msg, OptimizerSet, timeout=timeout).optimizer

    def leave(self, *, timeout: float | None = None) -> None:
        if self.worker_id is not None:
            self._session.request(Leave(worker=self.worker_id), Left, timeout=timeout)

    def stop(self) -> None:
        """End a wait in progress at once (it raises :class:`~stella.errors.Stopped`) and
        any reconnecting; safe from a signal handler or another thread. Requests after it
        run as usual, within a second each if the stop found the client waiting (the
        server was not answering then)."""
        self._session.stop()

    def close(self, *, leave: bool = True, timeout: float = 5.0) -> None:
        """Leave the job (best effort) and close the socket; safe to call twice."""
        if self._session.closed:
            return
        self._session.stop_reconnecting()  # a client on its way out does not reconnect
        if leave and self.worker_id is not None:
            try:
                self.leave(timeout=timeout)
            except Exception:
                pass
        self._session.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
