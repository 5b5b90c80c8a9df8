"""Checkpoints of the server's model: when they are written, how, where, how many are
kept, and which one a restarted server resumes from (:class:`Checkpointer`).

The file format (atomic write, checksums) is :mod:`stella.checkpoint_file`'s.
Writing one costs the steps only a copy of the state, made on the store thread a
slice at a time (:func:`copy_in_slices`, a memcpy of :data:`CHECKPOINT_SLICE`
coordinates per store-thread task), so a step waits for one slice at most; the steps
applied while the copy goes on are logged by the store and rolled forward onto the
slices copied before them (:func:`roll_forward`) on the writer's own
thread, which also writes and fsyncs the file while steps go on. The result is the
exact state of one version. At most one write is in progress: a checkpoint that
falls due meanwhile is written when it finishes (of the version then current). On
start, :func:`newest_valid` tries the checkpoints newest first: a damaged one is
reported in the log and the next older one is used.

A write that fails (a full disk, ENOSPC; a directory that became read-only, EROFS;
any other error) costs the job nothing but that checkpoint: the steps go on, the
temporary file is removed, and nothing older is pruned (pruning follows a successful
write only), so the newest valid checkpoint stays where a restart finds it. The
failure is logged (``checkpoint write failed``), counted and shown until a write
succeeds again (:class:`~stella_ps.stats.Stats`: ``status`` and the metrics). It is
retried on the schedule, not sooner: a failed attempt counts as the checkpoint that
was due, and the next one due is written as usual; a retry would cost what any
checkpoint costs (a copy of the state), so a disk that stays full costs no more than
the schedule already does, and the first due checkpoint after space is freed succeeds.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from stella import checkpoint_file as ckpt_format
from stella.checkpoint_file import Checkpoint, CheckpointError
from stella.layout import FlatLayout
from stella.payload import SparseTensor
from stella.protocol import TensorSpec

from .aggregation import step_count_table
from .broadcast import replay
from .config import Checkpoints
from .kernel import KernelTensorState
from .optim import OptimizerConfig
from .runtime import StoreThread, Tasks
from .stats import Stats
from .store import ModelRange, ModelStore, RecordCopy, RedoEntry

__all__ = ["Checkpointer", "CheckpointPolicy", "SlicedCopy", "copy_in_slices", "roll_forward", "state_copy", "restore",
           "newest_valid", "write_and_prune", "describe_error", "Checkpoint", "CheckpointError", "CHECKPOINT_SLICE",
           "BCAST_ARRAYS"]

log = logging.getLogger("stella_ps.checkpoints")
CHECKPOINT_SLICE = 1 << 18  # coordinates a checkpoint copies per store-thread task (4 MiB of Adam records)
BCAST_ARRAYS = ("bcast_model", "bcast_residual")  # a tensor's broadcast model and residual in a checkpoint
MAX_ERROR_CHARS = 200  # of a failed write's description in status

Run = Callable[..., Awaitable[Any]]


@dataclass
class CheckpointPolicy:
    """Where checkpoints go, how many are kept, and when one is due: the daemon's
    :class:`~stella_ps.config.Checkpoints` (``every_steps`` versions and/or ``every_s``
    seconds, 0 turns either off), with a directory. By steps, one is due once the
    version passes a multiple of ``every_steps`` that the last one written did not
    reach: a checkpoint rolls forward the steps applied while it copies, and one that
    reached 28 of a policy of 5 makes the next due at 30, not 33 (counted from the
    last one, a job that stops at 32 would never write it, however fast its steps);
    by time, ``every_s`` after the last one written."""

    settings: Checkpoints
    last_version: int = -1  # version of the last checkpoint written or resumed from
    last_time: float = 0.0  # monotonic time it was written (or the server started)
    seq: int = 0  # a counter in file names: two checkpoints of one version never share a name

    def __post_init__(self) -> None:
        if not self.settings.dir:
            raise ValueError("a checkpoint policy needs a directory (--checkpoint-dir)")

    @property
    def directory(self) -> str:
        assert self.settings.dir is not None
        return self.settings.dir

    def due(self, version: int, now: float | None = None) -> bool:
        if version <= self.last_version:
            return False
        now = time.monotonic() if now is None else now
        every_steps, every_s = self.settings.every_steps, self.settings.every_s
        by_steps = every_steps > 0 and version // every_steps > max(self.last_version, 0) // every_steps
        by_time = every_s > 0 and now - self.last_time >= every_s
        return by_steps or by_time


@dataclass
class SlicedCopy:
    """A checkpoint's copy of the store: the slices of each tensor (each copied at its
    own version), the steps applied meanwhile, and the version they reach."""

    version: int
    copies: list[list[RecordCopy]]
    redo: list[RedoEntry]
    stall_s: float  # the longest one slice's task took: the longest a step waited
    slices: int


async def copy_in_slices(store: ModelStore, run: Run, slice_size: int = CHECKPOINT_SLICE) -> SlicedCopy:
    """Copy ``store``'s state a slice of ``slice_size`` coordinates at a time, each slice
    one ``await run(fn, *args)`` (the store thread's :meth:`~StoreThread.run` on the
    server), so that steps go on between slices; :func:`roll_forward`
    turns the result into the state of one version."""
    await run(store.begin_copy)
    copies: list[list[RecordCopy]] = []
    stall, slices = 0.0, 0
    for t, spec in enumerate(store.layout):
        per_tensor = []
        for start in range(0, spec.numel, slice_size):
            t0 = time.perf_counter()
            per_tensor.append(await run(store.copy_records, t, start, min(slice_size, spec.numel - start)))
            stall = max(stall, time.perf_counter() - t0)
            slices += 1
        copies.append(per_tensor)
    version, redo = await run(store.end_copy)
    return SlicedCopy(version, copies, redo, stall, slices)


def state_copy(store: ModelStore) -> tuple[int, list[dict[str, np.ndarray]]]:
    """The version and a copy of every tensor's arrays as a checkpoint holds them
    (parameters, the kernel's optimizer state, and with a broadcast :data:`BCAST_ARRAYS`),
    in one go. The server never does this (it copies a slice at a time:
    :func:`copy_in_slices`); tests compare against it, and ``bench.checkpoint`` times it
    for contrast."""
    out = [s.state_arrays() for s in store.tensors]
    b = store.broadcast
    if b is not None:
        for t, a in enumerate(out):
            a.update(zip(BCAST_ARRAYS, (b.model[t].copy(), b.residual[t].copy())))
    return store.version, out


def model_of(store: ModelStore) -> dict[str, Any] | None:
    """What a checkpoint says of the model ``store`` holds a range of (None: tensors given directly)."""
    m = store.model
    if m is None:
        return None
    return {"tensors": ckpt_format.layout_of(m.specs), "dense_below": m.flat.dense_below, "start": m.start,
            "stop": m.stop}


def restore(store: ModelStore, ck: Checkpoint) -> OptimizerConfig:
    """Make ``store`` the model of checkpoint ``ck``; returns the optimizer configuration
    it was written with. A checkpoint without the broadcast's arrays (written by an
    exact-pull job) gives a broadcast whose model is the checkpoint's, nothing owed. A
    checkpoint written before the flat layout (its tensors the model's own) is laid out
    flat with the server's cut (``store.dense_below``), its arrays joined into the parts."""
    cfg = OptimizerConfig.from_wire(ck.optimizer)
    if ck.model is not None:
        specs = [TensorSpec(d["name"], tuple(d["shape"]), d["dtype"]) for d in ck.model["tensors"]]
        model = ModelRange(specs, FlatLayout.of(specs, ck.model["dense_below"]), ck.model["start"], ck.model["stop"])
        arrays = ck.tensors
    else:  # written before the flat layout: the model's own tensors, joined into the parts
        specs = [TensorSpec(d["name"], tuple(d["shape"]), d["dtype"]) for d in ck.layout]
        flat = FlatLayout.of(specs, store.dense_below)
        model = ModelRange(specs, flat, 0, flat.numel)
        arrays = [{name: np.concatenate([ck.tensors[t][name] for t in flat.order if p.start <= flat.starts[t] < p.stop])
                   for name in ck.tensors[0]} for p in model.parts]
    kernel = [{k: v for k, v in a.items() if k not in BCAST_ARRAYS} for a in arrays]
    saved = all(set(BCAST_ARRAYS) <= set(a) for a in arrays)
    bcast = ([a[BCAST_ARRAYS[0]] for a in arrays], [a[BCAST_ARRAYS[1]] for a in arrays]) if saved else None
    store.restore(None, kernel, cfg, ck.version, bcast, model=model)
    return cfg


def roll_forward(kind: OptimizerConfig, numels: list[int], copies: list[list[RecordCopy]],
                 redo: list[RedoEntry], sparse: list[int] | None = None) -> list[dict[str, np.ndarray]]:
    """The state arrays of every tensor at the version of the last ``redo`` step (or
    of the copies, if none): each slice, copied at its own version, gets the logged
    steps after that version applied to its coordinates only. The lazy optimizers
    are per coordinate (each coordinate's parameter, moments and step count change
    only with the contributions to that coordinate, merged in the same order), so
    this gives bit for bit the state the store itself reached. Runs on the
    checkpoint writer's thread, on a scratch state; ``kind`` names the optimizer.
    ``sparse``: the store's :meth:`~stella_ps.store.ModelStore.sparse_numels` (a step's
    count table follows its density there; None: every tensor sparse)."""
    out = []
    for t, (numel, slices) in enumerate(zip(numels, copies, strict=True)):
        bcast = _rolled_broadcast(t, numel, slices, redo)
        st = KernelTensorState(np.zeros(numel, np.float32), kind)
        for c in slices:
            assert c.records is not None
            st.load_records(c.records, c.start)
            c.records = None  # the memory goes as soon as it is in the scratch state
        starts = np.array([c.start for c in slices], np.int64)
        versions = np.array([c.version for c in slices], np.int64)
        for after, step, cfg, _ in redo:
            contributions = step.per_tensor[t]
            if not contributions:
                continue
            stale = versions < after  # slices copied before this step
            if not stale.any():
                continue
            keep = []
            for part in contributions:
                if stale.all():
                    keep.append(part)
                    continue
                idx, vals = part.indices, part.values
                if idx is None:
                    idx_all = np.concatenate([np.arange(c.start, c.start + c.n, dtype=np.int32)
                                              for c, s in zip(slices, stale) if s])
                    keep.append(SparseTensor(t, idx_all, np.ascontiguousarray(vals[idx_all])))
                    continue
                m = stale[np.searchsorted(starts, idx, side="right") - 1]
                if m.any():
                    keep.append(SparseTensor(t, np.ascontiguousarray(idx[m]), np.ascontiguousarray(vals[m])))
            if keep:  # the counts of a coordinate are those of the whole step: the cut keeps or drops it whole
                st.apply(keep, step.scale, cfg.for_pushes(len(step.contributors)), checked=False,
                         count_scale=step_count_table(step, cfg.hparams, numels if sparse is None else sparse))
        out.append({**st.state_arrays(), **bcast})
        del st
    return out


def _rolled_broadcast(t: int, numel: int, slices: list[RecordCopy], redo: list[RedoEntry]) -> dict[str, np.ndarray]:
    """Tensor ``t``'s broadcast model and residual at the last logged step: each slice's
    copy with the steps logged after it replayed on its coordinates ({} without a broadcast)."""
    if not slices or slices[0].bcast is None:
        return {}
    model, residual = np.empty(numel, np.float32), np.empty(numel, np.float32)
    for c in slices:
        assert c.bcast is not None
        lo, hi = c.start, c.start + c.n
        model[lo:hi], residual[lo:hi] = c.bcast
        c.bcast = None
        for after, _step, _cfg, log in redo:
            if after > c.version and log is not None:
                replay(model[lo:hi], residual[lo:hi], log, t, lo, hi)
    return dict(zip(BCAST_ARRAYS, (model, residual)))


DAMAGED = "damaged"  # the subfolder damaged checkpoints are moved into


def newest_valid(directory: str) -> tuple[str, Checkpoint] | None:
    """The newest checkpoint of ``directory`` that reads back intact, or None. Each newer
    one that does not is logged and moved into ``damaged/`` (kept for the operator, out
    of the way: it never counts towards ``--checkpoint-keep``, so pruning never deletes
    a valid checkpoint in its place). Temporary files of a write that a crash
    interrupted are deleted (where the directory is read-only, left with a warning:
    they are never read, and the resume goes on); one whose writer still runs here
    (:func:`_writer_alive`) is a write in progress, and left to it."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return None
    for n in names:
        if ckpt_format.is_temporary(n) and not _writer_alive(n):
            try:
                os.unlink(os.path.join(directory, n))
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("temporary checkpoint file not deleted", extra={"path": os.path.join(directory, n),
                                                                            "error": describe_error(e)})
    for path, got in ckpt_format.iter_valid(directory):
        if isinstance(got, Checkpoint):
            return path, got
        aside = os.path.join(directory, DAMAGED, os.path.basename(path))
        try:
            os.makedirs(os.path.dirname(aside), exist_ok=True)
            os.replace(path, aside)
        except OSError as e:
            aside = f"(not moved: {e})"
        log.error("checkpoint damaged, moved aside; trying the previous one",
                  extra={"path": path, "moved_to": aside, "reason": str(got)})
    return None


def _writer_alive(name: str) -> bool:
    """Whether the process that names temporary checkpoint file ``name`` (the pid after
    its ``.tmp``) runs on this host: this one, or one that a signal 0 finds (a permission
    error too: someone else's process). Its write may be in progress: a reader that
    deleted the file under it (a second process reading the directory while a server
    writes) would fail that write at its rename."""
    digits = name.rpartition(".tmp")[2]
    if not digits.isdigit():
        return False
    pid = int(digits)
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError, ValueError):
        return True
    return True


def write_and_prune(policy: CheckpointPolicy, ckpt: Checkpoint) -> tuple[str, int, float]:
    """Write ``ckpt`` into the policy's directory and delete all but the newest
    ``keep`` (never the one just written); returns (path, bytes, seconds). Runs on the
    writer thread."""
    t0 = time.perf_counter()
    os.makedirs(policy.directory, exist_ok=True)
    _remove_own_temporary(policy.directory)
    policy.seq += 1
    path = os.path.join(policy.directory, ckpt_format.file_name(ckpt.version, policy.seq))
    size = ckpt_format.write(path, ckpt)  # a failure raises here: nothing older is touched, no temporary file stays
    older = [n for n in ckpt_format.names(policy.directory) if n != os.path.basename(path)]
    for old in older[policy.settings.keep - 1:]:
        try:
            os.unlink(os.path.join(policy.directory, old))
        except FileNotFoundError:
            pass
        except OSError as e:  # the new one is written: an old one left behind is worth a warning, not a failure
            log.warning("old checkpoint not deleted", extra={"path": os.path.join(policy.directory, old),
                                                             "error": describe_error(e)})
    return path, size, time.perf_counter() - t0


def _remove_own_temporary(directory: str) -> None:
    """Delete a temporary file an earlier write of this process could not (its directory
    was read-only then); another process's are left alone."""
    for n in os.listdir(directory):
        if ckpt_format.is_temporary(n, os.getpid()):
            try:
                os.unlink(os.path.join(directory, n))
            except FileNotFoundError:
                pass


def describe_error(e: BaseException) -> str:
    """A failed write as ``status`` and the log say it: ``ENOSPC: No space left on
    device`` for an OS error, else the exception's type and message (at most
    :data:`MAX_ERROR_CHARS` characters)."""
    if isinstance(e, OSError) and e.errno is not None and e.errno in errno.errorcode:
        text = f"{errno.errorcode[e.errno]}: {e.strerror}"
    else:
        text = f"{type(e).__name__}: {e}"
    return text[:MAX_ERROR_CHARS]


class Checkpointer:
    """Resume on start, periodic checkpoints, and the last one on the way out, of one
    store. ``optimizer()`` gives the configuration in force (the step scheduler's)."""

    def __init__(self, cfg: Checkpoints, store: ModelStore, store_thread: StoreThread, tasks: Tasks, stats: Stats,
                 optimizer: Callable[[], OptimizerConfig | None]):
        self.store, self._store_thread, self._tasks, self._stats = store, store_thread, tasks, stats
        self._optimizer = optimizer
        self.policy: CheckpointPolicy | None = None
        if cfg.dir:
            self.policy = CheckpointPolicy(cfg, last_time=time.monotonic())
        self._writer = StoreThread("stella-checkpoint")
        self._writing: asyncio.Future[None] | None = None
        self._closing = False
        self._scheduled = False  # a periodic checkpoint task is spawned or running
        self.version: int | None = None  # the newest checkpoint on disk (written or resumed from)
        self.path: str | None = None  # its file
        self._failed_in_a_row = 0  # writes failed since the last one that succeeded

    def resume(self) -> OptimizerConfig | None:
        """Become the newest valid checkpoint of the directory (before serving); returns
        the optimizer configuration it was written with, or None when there is none."""
        if self.policy is None:
            return None
        found = newest_valid(self.policy.directory)
        if found is None:
            log.info("no checkpoint to resume from", extra={"checkpoint_dir": self.policy.directory})
            return None
        path, ck = found
        cfg = restore(self.store, ck)
        self.policy.last_version = self.version = ck.version
        self.path = path
        # its age is the file's: status and the age metric say how old the newest checkpoint is from the start,
        # not "none" (and an age alert) until the next one is written
        self._stats.last_checkpoint = os.path.getmtime(path)
        log.info("resumed from checkpoint", extra={"path": path, "version": ck.version, "numel": self.store.numel,
                                                   "optimizer": cfg.to_wire()})
        return cfg

    def maybe(self, version: int) -> None:
        """After a step: start a checkpoint if one is due (one at a time)."""
        cp = self.policy
        if cp is not None and not self._closing and not self._scheduled and cp.due(version):
            self._scheduled = True  # set now: steps that close before the task starts schedule no second one
            self._tasks.spawn(self._scheduled_write())

    async def _scheduled_write(self) -> None:
        try:
            await self.write()
        except Exception:
            pass  # logged and counted by write(); the next due checkpoint is the retry
        finally:
            self._scheduled = False
            self.maybe(self.store.version)  # one that fell due while this one was written

    async def write(self, final: bool = False) -> str:
        """Write a checkpoint of the model now; returns its path. Steps wait only for the
        slices of the copy. One at a time: ``_writing`` is set before the first await,
        so no second one starts meanwhile. A failure is logged and counted here
        (:meth:`_failed`), then raised."""
        optimizer = self._optimizer()
        assert self.policy is not None and optimizer is not None
        while self._writing is not None:
            await asyncio.gather(self._writing, return_exceptions=True)
        cp = self.policy
        self._writing = asyncio.get_running_loop().create_future()
        version = self.store.version
        try:
            t_copy = time.perf_counter()
            copy = await copy_in_slices(self.store, self._store_thread.run)
            copy_s = time.perf_counter() - t_copy
            self._stats.checkpoint_stall_s = max(self._stats.checkpoint_stall_s, copy.stall_s)
            kind = OptimizerConfig.from_wire({"name": self.store.tensors[0].name if self.store.tensors
                                              else optimizer.name})
            numels, sparse = [s.numel for s in self.store.layout], self.store.sparse_numels()
            layout, opt, model = ckpt_format.layout_of(self.store.layout), optimizer.to_wire(), model_of(self.store)

            def build_and_write() -> tuple[str, int, float]:
                arrays = roll_forward(kind, numels, copy.copies, copy.redo, sparse)
                return write_and_prune(cp, Checkpoint(copy.version, layout, opt, arrays, time.time(), model))

            # the schedule moves on whether the write succeeds or not: a failed one is retried when the next is due
            version, cp.last_version, cp.last_time = copy.version, copy.version, time.monotonic()
            path, size, write_s = await self._writer.run(build_and_write)
            self._stats.checkpoints += 1
            self._stats.last_checkpoint = time.time()
            self._stats.checkpoint_error = None
            self.version, self.path = copy.version, path
            log.info("checkpoint written", extra={"path": path, "version": copy.version, "bytes": size,
                                                  "stall_ms": round(1e3 * copy.stall_s, 3),
                                                  "copy_s": round(copy_s, 3), "steps_rolled_forward": len(copy.redo),
                                                  "write_s": round(write_s, 3)})
            if self._failed_in_a_row:
                log.info("checkpoint writes work again", extra={"path": path, "version": copy.version,
                                                                "failed_before": self._failed_in_a_row})
                self._failed_in_a_row = 0
            return path
        except Exception as e:
            self._failed(e, version, final)
            raise
        finally:
            fut, self._writing = self._writing, None
            fut.set_result(None)

    def _failed(self, e: Exception, version: int, final: bool) -> None:
        """Count and log a write that failed; what is on disk is as it was."""
        self._failed_in_a_row += 1
        self._stats.checkpoint_failures += 1
        self._stats.checkpoint_error = error = describe_error(e)
        what = "final checkpoint failed" if final else "checkpoint write failed; training goes on"
        kept = "there is no checkpoint yet" if self.path is None else "the newest valid checkpoint is kept"
        assert self.policy is not None
        # an OS error says all there is to say; anything else may be a bug: its traceback too
        log.error(f"{what}; {kept}", exc_info=None if isinstance(e, OSError) else e,
                  extra={"version": version, "error": error, "checkpoint_dir": self.policy.directory,
                         "failed_in_a_row": self._failed_in_a_row, "kept": self.path, "kept_version": self.version,
                         "retry": "none (stopping)" if final else "when the next checkpoint is due"})

    async def close(self) -> None:
        """Wait for a write in progress, then write a last checkpoint when the model moved
        on since the newest one on disk (and is whole: not after :class:`ModelDamaged`); stop
        the writer thread."""
        self._closing = True
        while self._writing is not None:
            await asyncio.gather(self._writing, return_exceptions=True)
        # against the newest on disk, not the last attempt: a periodic write that failed at this version is tried again
        written = -1 if self.version is None else self.version
        if self.store.damaged is not None:  # the model may hold part of a step: keep the newest checkpoint
            log.error("no last checkpoint: the model may hold part of a failed step",
                      extra={"version": self.store.version, "checkpoint_version": self.version})
        elif self.policy is not None and self.store.initialised and self.store.version > written:
            try:
                await self.write(final=True)
            except Exception:
                pass  # logged by write()
        self._writer.close()
