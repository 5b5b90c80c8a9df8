"""The model store: its tensors (a server holds its range of the flat model as at most
two, its *parts*: the large tensors' coordinates and the dense suffix, :mod:`stella.layout`;
the store itself takes any tensors), float32 with their optimizer state, the version,
and the
encoded answers to pulls: with ``pull="broadcast"`` (the default) the server's
compressed broadcast (:mod:`.broadcast`: its model ``B`` and residual ``R``, and the
recent steps' messages), with ``pull="exact"`` the history of which coordinates each
step touched, whose current values a pull gathers.

All methods run on the server's single store thread, so a step and a pull never
interleave: a pull always sees the model exactly at the version it reports. A step
applies whole or not at all (:meth:`ModelStore.apply_step`: a failure anywhere in it is
undone, or, when the undo fails too, the store says it is damaged and takes no more
steps). The
store never holds the optimizer configuration: the step scheduler owns it and passes it
to every step.
"""
from __future__ import annotations

import functools
import logging
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stella.codec import sum_of_squares
from stella.errors import ErrorCode, ServerError
from stella.layout import FlatLayout, Part
from stella.payload import SparseTensor, concat_entries, encode_tensors, part_specs
from stella.protocol import PullCoding, PullMode, TensorEntry, TensorSpec

from .aggregation import Step, budget_counts, step_count_table
from .broadcast import OWED_BYTES, Broadcast, StepLog
from .config import Pulls
from .errors import CopyAbandoned, ModelDamaged, NonFiniteStep, StepFailed
from .kernel import KernelTensorState, state_bytes, union_indices
from .optim import OptimizerConfig
from .runtime import TensorPool

__all__ = ["ModelStore", "ModelRange", "Changes", "EncodedChanges", "layout_diff", "check_model_bytes", "model_bytes",
           "RecordCopy", "RedoEntry", "l2_norm"]

log = logging.getLogger("stella_ps.store")

# a step applied while a checkpoint's copy went on (the copy's log, read by checkpoints.roll_forward): the
# version after the step, the step, its optimizer configuration, what it did to the broadcast
RedoEntry = tuple[int, Step, OptimizerConfig, StepLog | None]


@dataclass(frozen=True)
class ModelRange:
    """The registered model the store's tensors are: its tensors, laid out flat, and the
    range ``[start, stop)`` of it this server holds (its parts are the store's tensors)."""

    specs: list[TensorSpec]
    flat: FlatLayout
    start: int
    stop: int

    @property
    def parts(self) -> list[Part]:
        return self.flat.parts(self.start, self.stop)


@dataclass
class RecordCopy:
    """Records of coordinates ``start..start+n-1`` of one tensor, copied at ``version``
    (and the slice of its broadcast model and residual, with a broadcast)."""

    start: int
    n: int
    version: int
    records: np.ndarray | None
    bcast: tuple[np.ndarray, np.ndarray] | None = None


@dataclass(frozen=True)
class Changes:
    """What changed after a version, the answer to a pull: the touched coordinates of
    each tensor with their current float32 values (``full``: every tensor, dense)."""

    version: int
    full: bool
    tensors: list[SparseTensor]


@dataclass(frozen=True)
class EncodedChanges:
    """A pull's answer as it goes on the wire (a ``delta`` reply): :class:`Changes` for
    one index coding, or (``add``) broadcast messages, ``parts`` entries each."""

    version: int
    full: bool
    entries: list[TensorEntry]
    frames: list[Any]
    add: bool = False
    parts: list[int] = field(default_factory=list)

    @functools.cached_property
    def nbytes(self) -> int:
        """The payload's bytes (whether it goes whole or in pieces)."""
        return sum(memoryview(f).nbytes for f in self.frames)


def l2_norm(values: Sequence[np.ndarray]) -> float:
    """The L2 norm of float32 arrays together, accumulated in float64 (one C pass each)."""
    return math.sqrt(sum(sum_of_squares(np.ascontiguousarray(v, np.float32).reshape(-1)) for v in values))


def layout_diff(have: Sequence[TensorSpec], got: Sequence[TensorSpec], limit: int = 5) -> str | None:
    """A sentence naming which of the registration's own tensors differ from the
    server's model (``have``), or None if identical. It names what differs (count,
    name, shape, dtype) but never the server's values: the sender is not a member of
    the job yet, and the model's layout is not for it to learn from an error."""
    diffs: list[str] = []
    if len(have) != len(got):
        diffs.append(f"the registration's {len(got)} tensors are not the model's count")
    for i, (a, b) in enumerate(zip(have, got)):
        what = [k for k, x, y in (("name", a.name, b.name), ("shape", a.shape, b.shape), ("dtype", a.dtype, b.dtype))
                if x != y]
        if what:
            diffs.append(f"tensor {i} ({b.name!r}, shape {list(b.shape)}, {b.dtype}): {' and '.join(what)} differ")
    if not diffs:
        return None
    more = f" (and {len(diffs) - limit} more)" if len(diffs) > limit else ""
    return "; ".join(diffs[:limit]) + more


def model_bytes(numels: Sequence[int], optimizer: str, broadcast: bool) -> int:
    """Bytes the store allocates for a model: the kernel's parameters and optimizer state
    (:func:`~stella_ps.kernel.state_bytes`) and, with the broadcast, its model and
    residual (8 bytes a coordinate) and the messages its model may owe between sweeps
    (:data:`~stella_ps.broadcast.OWED_BYTES`, 2 bytes a coordinate)."""
    return sum(state_bytes(n, optimizer) + ((8 + OWED_BYTES) * n if broadcast else 0) for n in numels)


def check_model_bytes(layout: Sequence[TensorSpec], cfg: OptimizerConfig, limit: int, broadcast: bool) -> None:
    """Refuse (a ``limit`` :class:`ServerError`), before anything is allocated, a model
    whose parameters, optimizer state and broadcast state (:func:`model_bytes`) exceed
    ``limit`` bytes (``--max-model-bytes``)."""
    need = model_bytes([s.numel for s in layout], cfg.name, broadcast)
    if need > limit:
        numel = sum(s.numel for s in layout)
        raise ServerError(f"register refused: {numel} coordinates with {cfg.name} need {need} bytes of parameters "
                          f"and optimizer {'and broadcast ' if broadcast else ''}state, more than the server's limit "
                          f"of {limit} bytes (--max-model-bytes)", ErrorCode.LIMIT)


class ModelStore:
    """Holds the registered model. Not thread-safe: use from one thread."""

    def __init__(self, pulls: Pulls, *, history: int, threads: int, dense_below: int):
        self.dense_below = dense_below  # the server's dense cut: how a registration lays its model out flat
        self.model: ModelRange | None = None  # the registered model (None: tensors given directly)
        self.layout: list[TensorSpec] = []  # the store's tensors (a model's parts), what the wire's entries name
        self._pool = TensorPool(threads)  # a step's per-tensor work (apply, broadcast) on this many threads
        self.tensors: list[KernelTensorState] = []
        self.version = 0
        # the L2 norm of the parameters held, as created or restored (the push-norm bound's unit of a change: a
        # norm now would cost a pass over the model a push)
        self.param_norm = 0.0
        self.pull: PullMode = pulls.mode
        self.broadcast_info = pulls.broadcast_info()  # None: exact pulls
        self._history_len = history
        self.broadcast: Broadcast | None = None
        # (version after the step, touched indices per tensor)
        self._history: deque[tuple[int, list[np.ndarray]]] = deque(maxlen=history)
        # encoded deltas of the current version, by (since, coding): every worker of a
        # synchronous job pulls the same one each step; emptied by every step
        self._encoded: dict[tuple[int, str], EncodedChanges] = {}
        # index codings pulls asked for since the previous version (what a synchronous job's
        # workers ask for every step): a step encodes that answer at once (prepared)
        self._hot: set[str] = set()
        # while a checkpoint copies the state a slice at a time: the steps applied meanwhile
        self._redo: list[RedoEntry] | None = None
        self._copy_abandoned = False  # a step failed while a checkpoint's copy was logging (end_copy refuses it)
        self.damaged: str | None = None  # why the model may hold part of a step (ModelDamaged): nothing more applies

    @property
    def initialised(self) -> bool:
        return bool(self.layout)

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.layout)

    @staticmethod
    def _layout(model: ModelRange | None, layout: list[TensorSpec] | None) -> list[TensorSpec]:
        if model is not None:
            return part_specs(model.parts)
        assert layout is not None, "tensors or a model"
        return layout

    def _whole(self) -> list[bool]:
        """Which tensors the broadcast sends whole: a model's dense part."""
        return [p.whole for p in self.model.parts] if self.model is not None else [False] * len(self.layout)

    def sparse_numels(self) -> list[int]:
        """Each tensor's numel, 0 for one sent whole (the model's dense part): where a step's
        density is measured (:func:`stella_ps.aggregation.step_density`)."""
        return [0 if whole else s.numel for s, whole in zip(self.layout, self._whole())]

    def initialise(self, layout: list[TensorSpec] | None, values: list[np.ndarray], cfg: OptimizerConfig, *,
                   model: ModelRange | None = None, version: int = 0) -> None:
        """Create the tensors (``layout``, or ``model``'s parts) with initial float32
        ``values`` and state for ``cfg``'s optimizer, as the model at ``version``."""
        tensors = [KernelTensorState(v, cfg) for v in values]
        self.layout, self.model, self.tensors = self._layout(model, layout), model, tensors
        self.version = version
        self.param_norm = l2_norm(values)
        if self.broadcast_info is not None:
            self.broadcast = Broadcast(self.layout, values, self.broadcast_info, self._history_len,
                                       whole=self._whole())

    def begin_copy(self) -> int:
        """Start a checkpoint's copy: from now on the steps applied are logged, so that
        slices copied at different versions can be rolled forward to one
        (:func:`stella_ps.checkpoints.roll_forward`)."""
        if self.damaged is not None:
            raise ModelDamaged(self.damaged)
        self._redo = []
        self._copy_abandoned = False
        return self.version

    def copy_records(self, tensor: int, start: int, n: int) -> RecordCopy:
        """One slice of a checkpoint's copy (a memcpy: steps wait only this long)."""
        if self.damaged is not None:
            raise ModelDamaged(self.damaged)
        b = self.broadcast
        bcast = None if b is None else (b.model[tensor][start:start + n].copy(),
                                        b.residual[tensor][start:start + n].copy())
        return RecordCopy(start, n, self.version, self.tensors[tensor].records(start, n), bcast)

    def end_copy(self) -> tuple[int, list[RedoEntry]]:
        """The version now and the steps applied since :meth:`begin_copy`."""
        redo, self._redo = self._redo or [], None
        if self.damaged is not None:
            raise ModelDamaged(self.damaged)
        if self._copy_abandoned:
            self._copy_abandoned = False
            raise CopyAbandoned(f"a step failed during the checkpoint's copy (now at version {self.version}): "
                                "the copy was abandoned; the next checkpoint starts afresh")
        return self.version, redo

    def restore(self, layout: list[TensorSpec] | None, arrays: list[dict[str, np.ndarray]], cfg: OptimizerConfig,
                version: int, broadcast: tuple[list[np.ndarray], list[np.ndarray]] | None = None, *,
                model: ModelRange | None = None) -> None:
        """Become the model of a checkpoint: its tensors (``layout``, or ``model``'s parts),
        each one's state ``arrays`` for ``cfg``'s optimizer (``param`` and the kernel's
        state), at ``version``; with a broadcast, its model and residual per tensor (None:
        a checkpoint of an exact-pull job, whose ``B`` is the model, nothing owed). No
        history: every pull's first answer is a snapshot."""
        layout = self._layout(model, layout)
        tensors = []
        for spec, a in zip(layout, arrays, strict=True):
            if a["param"].size != spec.numel:
                raise ValueError(f"checkpoint: tensor {spec.name!r} holds {a['param'].size} values, not its "
                                 f"{spec.numel}")
            st = KernelTensorState(a["param"], cfg)
            st.load_state_arrays(a)
            tensors.append(st)
        self.layout, self.model = layout, model
        self.tensors, self.version = tensors, version
        self.param_norm = l2_norm([a["param"] for a in arrays])
        self._history.clear()
        self._encoded.clear()
        self.broadcast = None
        if self.broadcast_info is not None:
            bmodel, residual = broadcast if broadcast is not None else ([a["param"] for a in arrays], None)
            self.broadcast = Broadcast(self.layout, bmodel, self.broadcast_info, self._history_len,
                                       whole=self._whole(), residual=residual)

    def close(self) -> None:
        """Stop the pool's threads (the store is not used again)."""
        self._pool.close()

    def apply_step(self, step: Step, cfg: OptimizerConfig) -> int:
        """Apply one closed step with optimizer ``cfg``, whole or not at all; returns the
        new version.

        The contributions were validated by the wire decoder (sorted, unique,
        in-range indices; finite values), so the kernel does not scan them again.
        Raises :class:`NonFiniteStep` when a value the step would write (parameter or
        optimizer state, in any tensor) is NaN or Inf, and :class:`StepFailed` when
        anything else fails on the way (the kernel, the broadcast, memory, a bug): either
        way the step changed nothing (the kernel undid its tensor, the tensors before it
        are rolled back, the broadcast is made whole again) and the version did not move.
        :class:`ModelDamaged` when undoing it failed too (then the store refuses every
        step and checkpoint copy after it)."""
        if self.damaged is not None:
            raise ModelDamaged(self.damaged)
        version = self.version + 1
        try:
            touched = self._apply(step, cfg)
        except (NonFiniteStep, ModelDamaged):
            raise
        except Exception as e:  # KernelError, MemoryError, a fault: the kernel's part is undone already
            raise StepFailed(f"step {version} failed in the kernel's apply ({type(e).__name__}: {e}); nothing "
                             "changed") from e
        stage = "in the broadcast"
        try:
            log = None
            if self.broadcast is not None:
                counts = budget_counts(step, [spec.numel for spec in self.layout])
                log = self.broadcast.step(  # each tensor's change taken on its own thread, with the rest of its part
                    version, touched, lambda t: self.tensors[t].last_changes(touched[t]) if touched[t].size
                    else np.empty(0, np.float32), counts, pool=self._pool)
            stage = "after the kernel's apply"
            if self.broadcast is None:
                self._history.append((version, touched))
            if self._redo is not None:
                self._redo.append((version, step, cfg, log))
        except Exception as e:  # MemoryError, or a fault: the step must not stay half applied
            self._undo(version, touched, f"{stage}: {type(e).__name__}: {e}")
            raise StepFailed(f"step {version} failed {stage} ({type(e).__name__}: {e}); it was undone") from e
        self.version = version
        self._encoded.clear()
        self._prepare()
        return version

    def _undo(self, version: int, touched: list[np.ndarray], why: str) -> None:
        """Undo step ``version``, which the kernel applied (``touched``) and which failed
        after: the kernel's records back, its history and redo entries gone, the
        broadcast's ``R`` recomputed (``B`` may have changed: every replica's next pull is
        a snapshot, and a checkpoint's copy under way is abandoned). Raises
        :class:`ModelDamaged` when that fails too."""
        try:
            if self._history and self._history[-1][0] == version:
                self._history.pop()
            if self._redo and self._redo[-1][0] == version:
                self._redo.pop()
            self._rollback(touched)
            self._encoded.clear()  # answers made before: B may have changed without a message
            if self.broadcast is not None:
                self._copy_abandoned = self._redo is not None
                self.broadcast.resync([s.snapshot() for s in self.tensors], self.version)
        except Exception as e:
            raise self._damage(f"step {version} failed ({why}) and could not be undone ({type(e).__name__}: {e})") \
                from e

    def _damage(self, why: str) -> ModelDamaged:
        """The model may hold part of a step: refuse every step and checkpoint copy from now on."""
        self.damaged = why
        self._copy_abandoned = True
        return ModelDamaged(why)

    def _prepare(self) -> None:
        """After a step, on the store thread: the answer of a pull since the version before
        it, in each coding pulls asked for last step (every worker of a synchronous job
        pulls it now, and the event loop finds it ready: :meth:`cached_delta`). A failure
        leaves it to the pull that asks."""
        since = self.version - 1
        hot, self._hot = self._hot, set()  # this version's pulls say which to prepare next
        for coding in hot:
            try:
                self._encoded[(since, coding)] = self._encode(since, coding)  # type: ignore[arg-type]
            except Exception as e:  # the pull that asks meets it, and is refused
                log.debug("delta not prepared", extra={"since": since, "coding": coding, "error": str(e)})

    def _apply(self, step: Step, cfg: OptimizerConfig) -> list[np.ndarray]:
        """Every tensor's part of ``step``, on the pool's threads; when one fails (a
        non-finite result: that tensor undid itself), the others are undone too."""
        pushes = len(step.contributors)
        step_cfg = cfg.for_pushes(pushes)
        counts = step_count_table(step, cfg.hparams, self.sparse_numels())

        def one(t: int) -> np.ndarray:
            contributions = step.per_tensor[t]
            if not contributions:
                return np.empty(0, np.int32)
            state = self.tensors[t]
            return state.apply(contributions, step.scale, step_cfg, checked=False, count_scale=counts)

        try:
            done = self._pool.map(one, [sum(p.values.size for p in c) for c in step.per_tensor])
        except Exception as e:  # not one tensor's failure (map hands those back): which ones ran is unknown
            raise self._damage(f"step {self.version + 1}: the tensor pool failed ({type(e).__name__}: {e})") from e
        failed = [d for d in done if isinstance(d, Exception)]
        if failed:  # each failed tensor changed nothing (KernelTensorState.apply): undo the others
            try:
                self._rollback([np.empty(0, np.int32) if isinstance(d, Exception) else d for d in done])
            except Exception as e:
                raise self._damage(f"step {self.version + 1} failed in the kernel's apply ({failed[0]!r}) and its "
                                   f"other tensors could not be undone ({type(e).__name__}: {e})") from e
            raise failed[0]
        return done  # type: ignore[return-value]

    def _rollback(self, touched: list[np.ndarray]) -> None:
        for state, t in zip(self.tensors, touched):
            if t.size:
                state.rollback(t)

    def finite_alone(self, step: Step, cfg: OptimizerConfig) -> bool:
        """Would ``step`` leave every value finite? Applied and undone: nothing changes."""
        try:
            touched = self._apply(step, cfg)
        except NonFiniteStep:
            return False
        try:
            self._rollback(touched)
        except Exception as e:
            raise self._damage(f"step {self.version + 1}: a trial of one push could not be undone "
                               f"({type(e).__name__}: {e})") from e
        return True

    def changes_since(self, since: int) -> Changes:
        """Coordinates changed after version ``since`` with their current values.

        A snapshot when ``since`` is negative or older than the history kept.
        """
        v = self.version
        oldest_base = self._history[0][0] - 1 if self._history else v
        if since < 0 or since < oldest_base:
            return Changes(v, True, [SparseTensor(t, None, s.snapshot()) for t, s in enumerate(self.tensors)])
        steps = [touched for after, touched in self._history if after > since]
        out: list[SparseTensor] = []
        for t, state in enumerate(self.tensors):
            lists = [s[t] for s in steps if s[t].size]
            if not lists:
                continue
            # the kernel's own output: sorted and unique already
            idx = lists[0] if len(lists) == 1 else union_indices(lists, checked=False)
            out.append(SparseTensor(t, idx, state.gather(idx)))
        return Changes(v, False, out)

    def encoded_delta(self, since: int, coding: PullCoding) -> EncodedChanges:
        """The answer to a pull since version ``since``, built once per version, ``since``
        and coding: the broadcast messages since then (their own coding), or
        :meth:`changes_since` (float32 values, ``coding`` indices); a snapshot of the
        model replicas hold when ``since`` is too old or new (-1)."""
        key = (since, coding)
        enc = self._encoded.get(key)
        if enc is None:
            enc = self._encoded[key] = self._encode(since, coding)
        if since == self.version - 1:
            self._hot.add(coding)
        return enc

    def cached_delta(self, since: int, coding: PullCoding) -> EncodedChanges | None:
        """:meth:`encoded_delta` if it is made already, else None (called on the event loop
        while the store thread is idle: a dictionary look-up, and the coding noted as hot)."""
        enc = self._encoded.get((since, coding))
        if enc is not None and since == self.version - 1:
            self._hot.add(coding)
        return enc

    def _encode(self, since: int, coding: PullCoding) -> EncodedChanges:
        b = self.broadcast
        if b is None:
            changes = self.changes_since(since)
            entries, frames = encode_tensors(changes.tensors, self.layout, coding, "f32")
            return EncodedChanges(changes.version, changes.full, entries, frames)
        messages = b.since(since, self.version) if since >= 0 else None
        if messages is None:  # a snapshot of B, what every replica holds
            # copies: the frames go out zero-copy, after this returns, and the next step changes B in place; a
            # view would let a replica get some of the next step's values with this version's number
            snap = [SparseTensor(t, None, m.copy()) for t, m in enumerate(b.model)]
            entries, frames = encode_tensors(snap, self.layout, coding, "f32")
            return EncodedChanges(self.version, True, entries, frames)
        entries, frames = concat_entries((m.entries, m.frames) for m in messages)  # one after another
        return EncodedChanges(self.version, False, entries, frames, add=True, parts=[len(m.entries) for m in messages])

