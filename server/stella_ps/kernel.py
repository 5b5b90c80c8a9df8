"""The server's C code behind a typed, checked Python interface: the lazy-optimizer
kernel, and the sparse primitives of the broadcast and of exact pulls.

This module is the only caller of ``stella_ps._kernel``'s functions built from
``native/optim_state.c``, ``merge.c``, ``update.c`` and ``union.c``
(declarations in ``native/cdefs/optim.h``; the module's selection, from
``native/compress.c``, is :mod:`.topk`'s, and its flat residual, from ``native/residual.c``,
:mod:`.residual`'s). It holds:

- :class:`KernelTensorState`, one tensor's parameters and optimizer state, which has
  the duck type of :class:`stella_ps.optim_ref.RefTensorState` and gives bit-identical
  results (semantics and layout measurements in ``docs/optimizer.md``);
  :func:`state_bytes`, the threads (:func:`set_num_threads`), :func:`native_isa`;
- the broadcast's wrappers (:mod:`stella_ps.broadcast`): :func:`scatter_add` and
  :func:`scatter_add_lists` (``R`` gains a coding's error, ``B`` its messages),
  and :func:`union_indices` (the sorted union of index
  lists, also what an exact pull since a version gathers).

Every array is checked here (dtype, shape, contiguity, sortedness, range) before C
sees it, and bad input raises :class:`~stella_ps.errors.KernelInputError` (a
``ValueError``); return codes are checked after every call through
:func:`stella.native_errors.check` (a code for input that passed the checks raises
:class:`~stella_ps.errors.KernelError`). Values may be float32, float16 or bfloat16
(as uint16 bit patterns, the wire view of :func:`stella.codec.wire_values`).
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from stella.native_errors import NativeIsa, check, isa_info, require_abi, sparse_lists, warn_isa_fallback
from stella.payload import SparseTensor

from ._kernel import ffi, lib
from .errors import KernelError, KernelInputError, NonFiniteStep
from .optim import OptimizerConfig

require_abi(lib, "stella_ps._kernel")
warn_isa_fallback(lib, "stella_ps._kernel")

__all__ = [
    "KernelTensorState",
    "KernelInputError",
    "KernelError",
    "set_num_threads",
    "get_num_threads",
    "union_indices",
    "scatter_add",
    "scatter_add_lists",
    "state_bytes",
    "hugepages_worthwhile",
    "ENV_THREADS",
    "native_isa",
]

ENV_THREADS = "STELLA_KERNEL_THREADS"
"""Environment override of the kernel's thread count (default 1)."""

F32 = np.float32
_INT32_LIMIT = 2**31 - 1
_KIND = {"sgd": lib.STELLA_OPT_SGD, "adam": lib.STELLA_OPT_ADAM, "adamw": lib.STELLA_OPT_ADAMW}
_FIELDS: dict[str, dict[str, tuple[int, type]]] = {
    "sgd": {"param": (lib.STELLA_FIELD_PARAM, F32), "momentum_buf": (lib.STELLA_FIELD_MOMENTUM_BUF, F32)},
    "adam": {
        "param": (lib.STELLA_FIELD_PARAM, F32),
        "exp_avg": (lib.STELLA_FIELD_EXP_AVG, F32),
        "exp_avg_sq": (lib.STELLA_FIELD_EXP_AVG_SQ, F32),
        "step": (lib.STELLA_FIELD_STEP, np.uint32),
    },
}
_FIELDS["adamw"] = _FIELDS["adam"]
# Index errors on input the wrapper checked (or was told was checked) are the
# caller's; anything else is the kernel's.
_INPUT_ERRORS = {lib.STELLA_E_RANGE: KernelInputError, lib.STELLA_E_ORDER: KernelInputError, None: KernelError}
# What apply may answer besides: a step whose result would not be finite was undone.
_APPLY_ERRORS = {**_INPUT_ERRORS, lib.STELLA_E_NONFINITE: NonFiniteStep}


_HUGE_2M = 2 << 20
_FLOATS_PER_COORD = {"sgd": 2, "adam": 4, "adamw": 4}  # record fields (native/optim_state.c)
HUGEPAGE_MAX_WASTE = 1 / 8  # round a state up to 2 MiB pages only when that adds at most this


def native_isa() -> NativeIsa:
    """The x86-64 level the kernel's apply (merge and update) runs at: ``portable``,
    ``x86-64-v3`` or ``x86-64-v4`` (``STELLA_NATIVE_ISA`` overrides; native/stella_isa.h)."""
    return isa_info(lib)


def _exact_state_bytes(numel: int, name: str) -> int:
    return ((numel + 15) & ~15) * _FLOATS_PER_COORD[name] * 4


def hugepages_worthwhile(numel: int, name: str) -> bool:
    """Whether a state of ``numel`` coordinates for optimizer ``name`` should live on
    2 MiB pages: only when rounding its size up to whole 2 MiB pages adds at most
    :data:`HUGEPAGE_MAX_WASTE` of it (a 2.1 MiB state would otherwise take 4 MiB)."""
    exact = _exact_state_bytes(numel, name)
    if exact < _HUGE_2M:
        return False
    rounded = (exact + _HUGE_2M - 1) & ~(_HUGE_2M - 1)
    return rounded - exact <= exact * HUGEPAGE_MAX_WASTE


def state_bytes(numel: int, name: str, hugepages: bool | None = None) -> int:
    """Bytes the kernel allocates for one tensor's parameters and optimizer state, as
    ``stella_optim_new`` computes them: a record of 2 float32 per coordinate for SGD
    (parameter, momentum buffer: SGD keeps the slot even when momentum is folded or
    0), 4 for Adam/AdamW (parameter, exp_avg, exp_avg_sq, step), coordinates padded to
    16, and with huge pages the size rounded up to 2 MiB. ``hugepages`` None: the
    choice :class:`KernelTensorState` makes by default (:func:`hugepages_worthwhile`).
    Known before anything is allocated, so a registration can be refused up front."""
    if name not in _FLOATS_PER_COORD:
        raise KernelInputError(f"unknown optimizer {name!r}")
    exact = _exact_state_bytes(numel, name)
    if hugepages is None:
        hugepages = hugepages_worthwhile(numel, name)
    if hugepages and exact >= _HUGE_2M:
        return (exact + _HUGE_2M - 1) & ~(_HUGE_2M - 1)
    return exact


def _threads_from_env() -> int:
    raw = os.environ.get(ENV_THREADS, "1")
    try:
        n = int(raw)
    except ValueError:
        raise KernelInputError(f"{ENV_THREADS}={raw!r} is not an integer") from None
    if n < 1:
        raise KernelInputError(f"{ENV_THREADS}={n} must be >= 1")
    return n


_num_threads = _threads_from_env()


def set_num_threads(n: int) -> None:
    """Threads used by apply and gather (each call splits its coordinate range)."""
    global _num_threads
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 64:
        raise KernelInputError(f"thread count must be an int in [1, 64], got {n!r}")
    _num_threads = n


def get_num_threads() -> int:
    return _num_threads


def _sorted_indices(idx: object, numel: int, what: str) -> np.ndarray:
    """``idx`` as a contiguous 1-D int32 array, strictly increasing, inside [0, numel)."""
    if not isinstance(idx, np.ndarray) or idx.dtype != np.int32 or idx.ndim != 1:
        got = f"{idx.dtype}[{idx.ndim}-D]" if isinstance(idx, np.ndarray) else type(idx).__name__
        raise KernelInputError(f"{what}: indices must be a 1-D int32 array, got {got}")
    if not idx.flags.c_contiguous:
        raise KernelInputError(f"{what}: indices must be contiguous")
    where = ffi.new("int64_t *")
    rc = lib.stella_check_sorted(ffi.from_buffer("int32_t[]", idx), idx.shape[0], numel, where)
    if rc == lib.STELLA_E_RANGE:
        pos = where[0]
        raise KernelInputError(f"{what}: index {int(idx[pos])} at position {pos} is outside [0, {numel})")
    if rc == lib.STELLA_E_ORDER:
        raise KernelInputError(f"{what}: indices not strictly increasing at position {where[0]}")
    check(lib, rc, what, KernelError)
    return idx


def _value_code(vals: object, n: int, what: str) -> int:
    if not isinstance(vals, np.ndarray) or vals.ndim != 1:
        raise KernelInputError(f"{what}: values must be a 1-D array")
    if vals.shape[0] != n:
        raise KernelInputError(f"{what}: {vals.shape[0]} values for {n} indices")
    if not vals.flags.c_contiguous:
        raise KernelInputError(f"{what}: values must be contiguous")
    if vals.dtype == np.float32:
        return int(lib.STELLA_VAL_F32)
    if vals.dtype == np.float16:
        return int(lib.STELLA_VAL_F16)
    if vals.dtype == np.uint16 or vals.dtype.name == "bfloat16":  # bf16 as raw bit patterns
        return int(lib.STELLA_VAL_BF16)
    raise KernelInputError(f"{what}: values must be float32, float16 or bfloat16 (uint16 bits), got {vals.dtype}")


def _c_config(cfg: OptimizerConfig) -> object:
    """The hyper-parameters rounded to float32 by the same expressions as optim_ref."""
    cfg = cfg.rule()
    h = cfg.hparams
    c = ffi.new("stella_optim_cfg *")
    c.kind = _KIND[cfg.name]
    c.lr = F32(h["lr"])
    c.lr_d = float(h["lr"])
    c.weight_decay = F32(h["weight_decay"])
    c.has_weight_decay = bool(h["weight_decay"])
    if cfg.name == "sgd":
        c.momentum = F32(h["momentum"])
        c.has_momentum = bool(h["momentum"])
        c.one_minus_dampening = F32(1.0 - h["dampening"])
        c.nesterov = bool(h["nesterov"])
    else:
        b1, b2 = h["betas"]
        c.beta1, c.beta2 = F32(b1), F32(b2)
        c.one_minus_beta1 = F32(1) - F32(b1)
        c.one_minus_beta2 = F32(1) - F32(b2)
        c.beta1_d, c.beta2_d = float(b1), float(b2)
        c.eps = F32(h["eps"])
        c.decay_factor = F32(1.0 - h["lr"] * h["weight_decay"])
    return c


class KernelTensorState:
    """One tensor's float32 parameters and lazy optimizer state, held by the C kernel.

    State is one interleaved record per coordinate (docs/optimizer.md); ``hugepages``
    asks the OS for 2 MiB pages for it (None, the default: when that wastes little,
    :func:`hugepages_worthwhile`); :func:`state_bytes` is its size in advance.

    The C calls release the GIL; one state must not be used from two threads at
    once (the server applies a tensor's steps one after another).
    """

    def __init__(self, init: np.ndarray, cfg: OptimizerConfig, *, hugepages: bool | None = None):
        if cfg.name not in _KIND:
            raise KernelInputError(f"unknown optimizer {cfg.name!r}")
        init = np.asarray(init)
        if init.dtype != np.float32:
            raise KernelInputError(f"initial values must be float32, got {init.dtype}")
        if not 1 <= init.size <= _INT32_LIMIT:
            raise KernelInputError(f"tensor size {init.size} outside [1, 2**31 - 1]")
        self.numel = int(init.size)
        self.name = cfg.name
        if hugepages is None:
            hugepages = hugepages_worthwhile(self.numel, cfg.name)
        ptr = lib.stella_optim_new(_KIND[cfg.name], self.numel, int(hugepages))
        if ptr == ffi.NULL:
            raise MemoryError(f"cannot allocate the state of a {self.numel}-coordinate tensor")
        self._st = ffi.gc(ptr, lib.stella_optim_free, size=int(lib.stella_optim_bytes(ptr)))
        self._set_field(lib.STELLA_FIELD_PARAM, np.ascontiguousarray(init.reshape(-1)))
        self._cfg_key: OptimizerConfig | None = None
        self._cfg_c: object = None

    @property
    def nbytes(self) -> int:
        """Bytes of parameter and optimizer state held in C."""
        return int(lib.stella_optim_bytes(self._st))

    def _set_field(self, field: int, arr: np.ndarray) -> None:
        rc = lib.stella_optim_set_field(self._st, field, ffi.from_buffer(arr), arr.shape[0])
        check(lib, rc, "set_field", KernelError)

    def _config(self, cfg: OptimizerConfig) -> object:
        if cfg is not self._cfg_key:
            if cfg.name != self.name:
                raise KernelInputError(f"state was built for {self.name}, apply got {cfg.name}")
            self._cfg_c, self._cfg_key = _c_config(cfg), cfg
        return self._cfg_c

    def apply(self, pushes: Sequence[SparseTensor | tuple[np.ndarray | None, np.ndarray]], scale: float,
              cfg: OptimizerConfig, *, checked: bool = True, count_scale: np.ndarray | None = None) -> np.ndarray:
        """Merge ``pushes``, apply ``scale`` times their sum with the lazy optimizer;
        with ``count_scale`` (float32, at least ``len(pushes) + 1`` values), a sum that
        ``n`` pushes carried is multiplied by ``count_scale[n]`` instead (counted in the
        merge: :func:`stella_ps.aggregation.count_table`).

        A push is the :class:`~stella.payload.SparseTensor` the wire decoder made (the
        server's path), or an ``(indices or None for dense, values)`` pair (tests, the
        reference's duck type).

        Returns the sorted union of the touched indices (int32). Every push is
        checked first (dtype, shape, contiguity, strictly increasing, in range: the
        scan costs ~0.6 ns per index, ~2% of an update), so bad input raises
        :class:`KernelInputError` and changes nothing, whatever the caller checked.
        ``checked=False`` skips the index scan for pushes whose indices the wire decoder
        already proved sorted, unique and in range (the server's path). Values are
        float32, float16 or bfloat16 bits (uint16); finiteness is not checked here
        (:func:`stella.codec.wire_values` does it on the server's path). An apply that
        raises, for any reason, changed nothing (the store relies on it to undo a step
        over several tensors).
        """
        c_cfg = self._config(cfg)
        w = len(pushes)
        keep = []  # cffi buffers must outlive the call
        c_push = ffi.new("stella_push[]", max(w, 1))
        total = 0
        for k, push in enumerate(pushes):
            if isinstance(push, SparseTensor):
                idx, vals = push.indices, push.values
            else:
                try:
                    idx, vals = push
                except (TypeError, ValueError):
                    raise KernelInputError(f"push {k}: expected a SparseTensor or an (indices, values) pair") from None
            what = f"push {k}"
            if idx is None:
                n = self.numel
                c_push[k].idx = ffi.NULL
            else:
                if checked:
                    _sorted_indices(idx, self.numel, what)
                n = idx.shape[0]
                ib = ffi.from_buffer("int32_t[]", idx)
                keep.append(ib)
                c_push[k].idx = ib
            c_push[k].dtype = _value_code(vals, n, what)
            vb = ffi.from_buffer(vals)
            keep.append(vb)
            c_push[k].val = vb
            c_push[k].n = n
            total += n
        bound = min(total, self.numel)
        out = np.empty(bound, np.int32)
        c_cs = ffi.NULL
        if count_scale is not None:
            if (count_scale.dtype != F32 or count_scale.ndim != 1 or count_scale.shape[0] < w + 1
                    or not count_scale.flags.c_contiguous or w > 65535):
                raise KernelInputError(f"count_scale must be {w + 1} or more contiguous float32 values "
                                       f"(for up to 65535 pushes)")
            c_cs = ffi.from_buffer("float[]", count_scale)
        rc = lib.stella_optim_apply(self._st, c_push, w, float(scale), c_cs, c_cfg,
                                    ffi.from_buffer("int32_t[]", out, require_writable=True), bound, _num_threads)
        # an error code: the kernel changed nothing (it undid what it wrote)
        count = check(lib, rc, "apply: a result would be NaN or Inf, the step was undone" if
                      rc == lib.STELLA_E_NONFINITE else "apply", _APPLY_ERRORS)
        touched = out[:count]
        try:
            # Heavy overlap leaves most of the bound unused: do not keep it alive.
            return touched if 2 * count >= bound else touched.copy()
        except BaseException:  # MemoryError: this apply fails whole, as the kernel's own errors do
            self.rollback(touched)
            raise

    def rollback(self, touched: np.ndarray) -> None:
        """Undo the last :meth:`apply` (``touched``: what it returned): its records go back
        to what they were, from the kernel's undo log. Only the last apply, and only
        before any other call changed the state."""
        if not isinstance(touched, np.ndarray) or touched.dtype != np.int32 or touched.ndim != 1:
            raise KernelInputError("rollback: touched must be the int32 array apply returned")
        touched = np.ascontiguousarray(touched)
        rc = lib.stella_optim_rollback(self._st, ffi.from_buffer("int32_t[]", touched), touched.shape[0])
        check(lib, rc, "rollback: not the last apply's touched indices", _INPUT_ERRORS)

    def last_changes(self, touched: np.ndarray) -> np.ndarray:
        """What the last :meth:`apply` (``touched``: what it returned) did to the
        parameters there: ``p_now - p_before``, float32, as the apply computed it (a copy of
        the kernel's buffer, valid until the next apply)."""
        if not isinstance(touched, np.ndarray) or touched.dtype != np.int32 or touched.ndim != 1:
            raise KernelInputError("last_changes: touched must be the int32 array apply returned")
        out = np.empty(touched.shape[0], F32)
        rc = lib.stella_optim_last_changes(self._st, touched.shape[0],
                                           ffi.from_buffer("float[]", out, require_writable=True))
        check(lib, rc, "last_changes: not the last apply's touched indices", _INPUT_ERRORS)
        return out

    def gather(self, idx: np.ndarray) -> np.ndarray:
        """Current float32 parameters at ``idx`` (int32, any order, inside [0, numel))."""
        if not isinstance(idx, np.ndarray) or idx.dtype != np.int32 or idx.ndim != 1:
            raise KernelInputError("gather: indices must be a 1-D int32 array")
        idx = np.ascontiguousarray(idx)
        out = np.empty(idx.shape[0], F32)
        rc = lib.stella_optim_gather(self._st, ffi.from_buffer("int32_t[]", idx), idx.shape[0],
                                     ffi.from_buffer("float[]", out, require_writable=True), _num_threads)
        check(lib, rc, f"gather: an index outside [0, {self.numel})", _INPUT_ERRORS)
        return out

    def _get_field(self, field: int, dtype: type) -> np.ndarray:
        out: np.ndarray = np.empty(self.numel, dtype)
        rc = lib.stella_optim_get_field(self._st, field, ffi.from_buffer(out, require_writable=True),
                                              self.numel)
        check(lib, rc, "get_field", KernelError)
        return out

    def snapshot(self) -> np.ndarray:
        """A float32 copy of all parameters (flat)."""
        return self._get_field(lib.STELLA_FIELD_PARAM, F32)

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Parameters and optimizer state as flat arrays, named as in RefTensorState."""
        return {name: self._get_field(f, dt) for name, (f, dt) in _FIELDS[self.name].items()}

    @property
    def fields(self) -> int:
        """uint32-sized fields per coordinate record (2 for SGD, 4 for Adam/AdamW)."""
        return len(_FIELDS[self.name])

    def records(self, start: int, n: int) -> np.ndarray:
        """A copy of the records of coordinates ``start..start+n-1`` (every field,
        interleaved as held: ``n * fields`` uint32); one memcpy."""
        if not (start >= 0 and n >= 0 and start + n <= self.numel):
            raise KernelInputError(f"records {start}..{start + n} outside a {self.numel}-coordinate tensor")
        out: np.ndarray = np.empty(n * self.fields, np.uint32)
        rc = lib.stella_optim_get_records(self._st, ffi.from_buffer(out, require_writable=True),
                                                start, n)
        check(lib, rc, "get_records", KernelError)
        return out

    def load_records(self, records: np.ndarray, start: int) -> None:
        """Overwrite the records from ``start`` with ``records`` (as :meth:`records` gives them)."""
        records = np.ascontiguousarray(records, np.uint32)
        n, rem = divmod(records.size, self.fields)
        if rem or not (start >= 0 and start + n <= self.numel):
            raise KernelInputError(f"{records.size} record words do not fit from coordinate {start}")
        rc = lib.stella_optim_set_records(self._st, ffi.from_buffer(records), start, n)
        check(lib, rc, "set_records", KernelError)

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Replace the whole state by arrays from :meth:`state_arrays` (checked first)."""
        fields = _FIELDS[self.name]
        if set(arrays) != set(fields):
            raise KernelInputError(f"{self.name} state needs arrays {sorted(fields)}, got {sorted(arrays)}")
        ready: dict[int, np.ndarray] = {}
        for name, (f, dt) in fields.items():
            a = np.asarray(arrays[name])
            if a.size != self.numel:
                raise KernelInputError(f"{name}: {a.size} values for a {self.numel}-coordinate tensor")
            if a.dtype != dt:
                raise KernelInputError(f"{name}: dtype must be {np.dtype(dt).name}, got {a.dtype}")
            ready[f] = np.ascontiguousarray(a.reshape(-1))
        for f, a in ready.items():  # all checked: nothing changes on bad input
            self._set_field(f, a)


def _out_f32(a: np.ndarray, what: str) -> object:
    """``a``'s buffer for the C to write into: a flat, contiguous, writable float32 array
    (else :class:`KernelInputError`, "``what`` must be ...")."""
    if a.dtype != F32 or a.ndim != 1 or not a.flags.c_contiguous or not a.flags.writeable:
        raise KernelInputError(f"{what} must be a flat, contiguous, writable float32 array")
    return ffi.from_buffer("float[]", a, require_writable=True)


def scatter_add(dst: np.ndarray, idx: np.ndarray, src: np.ndarray) -> None:
    """``dst[idx] += src`` in one C pass (float32 ``dst``, flat and contiguous; int32
    ``idx`` in range, in any order; float32 ``src`` of the same length)."""
    out = _out_f32(dst, "scatter_add: dst")
    idx, src = np.ascontiguousarray(idx, np.int32), np.ascontiguousarray(src, F32)
    if idx.shape != src.shape or idx.ndim != 1:
        raise KernelInputError(f"scatter_add: {idx.shape[0]} indices for {src.size} values")
    rc = lib.stella_scatter_add(out, dst.shape[0], ffi.from_buffer("int32_t[]", idx), ffi.from_buffer("float[]", src),
                                idx.shape[0])
    check(lib, rc, "scatter_add: an index out of range", _INPUT_ERRORS)


def scatter_add_lists(dst: np.ndarray, lists: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    """``dst[idx] += val`` for each ``(idx, val)`` of ``lists`` in turn, in one C sweep
    over ``dst`` tile by tile (float32 ``dst``, flat and contiguous; each ``idx`` sorted,
    unique int32 in range, ``val`` float32 of its length; all checked before anything is
    written). The same floats as one :func:`scatter_add` per list, in list order."""
    out = _out_f32(dst, "scatter_add_lists: dst")
    keep = []
    for i, v in lists:
        i, v = np.ascontiguousarray(i, np.int32), np.ascontiguousarray(v, F32)
        if i.shape != v.shape or i.ndim != 1:
            raise KernelInputError(f"scatter_add_lists: {i.shape[0]} indices for {v.size} values")
        keep.append((i, v))
    c_lists, _bufs = sparse_lists(ffi, keep)
    rc = lib.stella_scatter_add_lists(out, dst.shape[0], c_lists, len(keep))
    check(lib, rc, "scatter_add_lists: an index list out of range or order", _INPUT_ERRORS)


def union_indices(lists: Sequence[np.ndarray], *, checked: bool = True) -> np.ndarray:
    """Sorted union of sorted unique int32 index lists (the pull delta since a version).

    ``checked=False`` trusts the lists (the kernel's own output of earlier steps)."""
    if checked:
        keep = [_sorted_indices(a, _INT32_LIMIT + 1, f"list {k}") for k, a in enumerate(lists)]
    else:
        keep = list(lists)
    k = len(keep)
    total = sum(a.shape[0] for a in keep)
    out = np.empty(total, np.int32)
    ptrs = ffi.new("int32_t *[]", max(k, 1))
    bufs = []
    for i, a in enumerate(keep):
        b = ffi.from_buffer("int32_t[]", a)
        bufs.append(b)
        ptrs[i] = b
    lens = ffi.new("int64_t[]", [a.shape[0] for a in keep] or [0])
    n = check(lib, lib.stella_union_indices(ptrs, lens, k, ffi.from_buffer("int32_t[]", out), total),
              "union", KernelError)
    return out[:n] if 2 * n >= total else out[:n].copy()
