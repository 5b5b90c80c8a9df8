"""The worker's side of the flat model (:mod:`stella.layout`): the model's parameters read
and written as one flat float32 vector, and top-k with error feedback over it.

A worker's round used to loop over tensors: ``anchor - weights`` per tensor, a
compression call per tensor, an ``index_add_`` or three per tensor to install the
server's answer. On a GPU each is a kernel launch or more (the compressor costs ~2.1 ns
a coordinate on a byte LM's 76 tensors, against 0.03-0.13 ns on one tensor of the same
size); on a CPU each is a Python dispatch. Here every operation costs one call
whatever the number of tensors.

:class:`FlatParams` sees the parameters (by tensor number of a
:class:`~stella.layout.FlatLayout`) as one flat float32 vector *without moving them*:
the training framework keeps its own tensors (no ``p.data`` swap, which would break
FSDP, torch.compile's guards or a user's references). On CPU each operation is one call
into ``native/flat.c`` (a table of pointers, dtypes and flat starts walked in C, the GIL
released; :mod:`stella._flat_native`). On CUDA (or with ``backend="torch"``) each is a
fixed handful of torch ops whatever the number of tensors: multi-tensor ``_foreach_*``
ops over the parameters and views of the flat buffer, one group per parameter dtype. The
sparse forms there (``add_at``, ``set_at``) stage a group of up to ``STAGE_MAX_NUMEL``
(32M) coordinates in one buffer (``torch.cat``), index into it once and copy it back
(``_foreach_copy_``): four passes over the group (on an H200, bench.cuda --flat, a sparse
add of 1% into the byte LM's 10.8M took 1.35 ms, the entries' copy to the device included)
in place of a launch per tensor. A larger group takes an ``index_add_`` per
parameter on its slice of the entries (found on the host), since its passes would grow
with the model (16 GB a call for 1B float32 parameters) while the launches grow only with
the tensors; aliasing the parameters' memory would avoid both, at the price of pointer
arithmetic on memory torch does not know is shared. Update mode's install
(:meth:`FlatParams.merge_at`) moves the anchor and the weights in the same call.

Rounding is torch's everywhere: writes into f16/bf16 parameters round to nearest even,
additions round the value to the parameter's dtype and then the sum, as
``w.index_add_(0, idx, val.to(w.dtype))`` and ``w.add_(val.to(w.dtype))`` do
(tests/test_flat.py checks both backends bit for bit against those per-tensor ops).

:class:`FlatCompressor` is :class:`~stella.compress.ErrorFeedbackCompressor`'s
semantics over one flat residual, through the same :class:`~stella.compress.Engine`
(its selectors, rounding and flush): the sparse range ``[0, sparse_numel)`` is selected
in one call (the C threshold selection on CPU, the torch one on CUDA), the dense suffix
goes whole, and a compression returns a :class:`FlatPush`.
"""
from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import codec
from .compress import Engine, SparseGrad, State, check_density, check_value_dtype, k_for
from .layout import FlatLayout
from .protocol import MAX_NUMEL

__all__ = ["FlatParams", "FlatCompressor", "FlatPush", "PARAM_DTYPES"]

PARAM_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
"""The parameter dtypes :class:`FlatParams` takes, and their names in C (``_flat_native.DTYPES``)."""
# the torch backend's sparse add or set stages a dtype group in one buffer up to this many coordinates
# (FlatParams._scatter): on a GPU its four passes over 32M float32 coordinates (512 MB) would take 0.1-0.5 ms at
# 1-4 TB/s, about what a few hundred launches take (an estimate; the per-parameter path is not timed on a GPU)
STAGE_MAX_NUMEL = 1 << 25


class FlatParams:
    """A model's parameters as one flat float32 vector (module doc).

    ``params``: the layout's tensors by tensor number (a sequence), or by name (a
    mapping); float32, float16 or bfloat16, contiguous, all on one device, each of its
    spec's shape. They stay where they are: the operations read and write the tensors
    themselves (``p.data`` re-pointed is noticed on the next operation). ``backend``:
    "native" (CPU only), "torch", or "auto" (native on CPU).

    Flat buffers (``out``, ``anchor``, values) are float32 tensors on the parameters'
    device holding the coordinates ``[start, start + len)``; sparse indices and their
    values are the wire's host NumPy arrays (int32, strictly increasing, relative to
    ``start``; float32). One thread at a time: the operations share the pointer table.
    """

    def __init__(self, params: Sequence[torch.Tensor] | Mapping[str, torch.Tensor], layout: FlatLayout, *,
                 backend: str = "auto"):
        if backend not in ("auto", "native", "torch"):
            raise ValueError(f"backend must be 'auto', 'native' or 'torch', got {backend!r}")
        if isinstance(params, Mapping):  # by name, in the order the layout was made from
            params = list(params.values())
        self.layout = layout
        self._params = list(params)
        if len(self._params) != len(layout.numels):
            raise ValueError(f"{len(self._params)} parameters for a layout of {len(layout.numels)} tensors")
        self.device = self._check()
        if backend == "native" and self.device.type != "cpu":
            raise ValueError(f"backend='native' needs CPU parameters, these are on {self.device}")
        if backend == "auto":  # the one that ran, never "auto": a caller (bench.flat's table, a test) reads it
            backend = "native" if self.device.type == "cpu" else "torch"
        self.backend = backend
        self.numel = layout.numel
        self.sparse_numel = layout.sparse_numel
        self._order = list(layout.order)  # flat position -> tensor number
        self._sizes = [layout.numels[t] for t in self._order]
        self._fstarts = [layout.starts[t] for t in self._order]  # flat position -> first flat coordinate
        self._ptrs: list[int] | None = None  # the parameters' addresses as last seen
        self._flat: list[torch.Tensor] = []  # torch backend: flat views of the parameters, by flat position
        self._plans: dict[tuple[int, int], _Plan] = {}
        # torch backend: a sparse add or set stages a dtype group's parameters in one buffer up to this
        # many coordinates, and scatters into each parameter past it (_scatter)
        self.stage_max_numel = STAGE_MAX_NUMEL
        if self.backend == "native":
            from ._flat_native import PartTable

            dtypes = [PARAM_DTYPES[self._params[t].dtype] for t in self._order]
            self._table = PartTable(self._sizes, dtypes)
            self._grad_table = PartTable(self._sizes, dtypes)
        self._refresh()

    # ------------------------------------------------------------------ dense
    @torch.no_grad()
    def gather_into(self, out: torch.Tensor, start: int = 0) -> None:
        """``out = w[start, start + len(out))``, exactly."""
        self._refresh()
        if self.backend == "native":
            self._table.gather(out, start)
            return
        self._torch_gather(self._flat, out, start)

    @torch.no_grad()
    def gather_grads_into(self, out: torch.Tensor, start: int = 0) -> None:
        """``out`` = the parameters' gradients (``p.grad``) over ``[start, start + len(out))``;
        a parameter without one counts as zeros."""
        self._refresh()
        grads = [self._grad_of(t) for t in self._order]  # flat position -> contiguous grad or None
        if self.backend == "native":
            for i, g in enumerate(grads):
                self._grad_table.point(i, 0 if g is None else g.data_ptr(),
                                       None if g is None else PARAM_DTYPES[g.dtype])
            self._grad_table.gather(out, start)  # (grads holds any contiguous copies until here)
            return
        self._torch_gather([None if g is None else g.view(-1) for g in grads], out, start)

    @torch.no_grad()
    def gather_tensors_into(self, tensors: Sequence[torch.Tensor | None], out: torch.Tensor, start: int = 0) -> None:
        """``out`` = the flat vector of ``tensors`` (one per parameter, by tensor number, each
        of its parameter's size on its device, any float dtype: an optimizer's state; None:
        zeros) over ``[start, start + len(out))``, in float32."""
        if len(tensors) != len(self._params):
            raise ValueError(f"{len(tensors)} tensors for {len(self._params)} parameters")
        src: list[torch.Tensor | None] = []
        for t in self._order:
            x = tensors[t]
            if x is not None and (x.numel() != self._params[t].numel() or x.device != self.device):
                raise ValueError(f"tensor {t}: {x.numel()} elements on {x.device}, its parameter "
                                 f"{self._params[t].numel()} on {self.device}")
            src.append(None if x is None else x.detach().reshape(-1))
        self._torch_gather(src, out, start)

    @torch.no_grad()
    def residual_into(self, anchor: torch.Tensor, out: torch.Tensor, start: int = 0) -> None:
        """``out = anchor - w`` over ``[start, start + len(out))`` in float32 (the update
        mode's pseudo-gradient; ``out`` may be ``anchor``)."""
        self._refresh()
        if self.backend == "native":
            self._table.residual(anchor, out, start)
            return
        self._check_buffer(anchor, out.numel(), "anchor")
        w = torch.empty_like(out) if _shares(out, anchor) else out
        self._torch_gather(self._flat, w, start)
        torch.sub(anchor, w, out=out)

    @torch.no_grad()
    def add_range(self, vals: torch.Tensor | np.ndarray, start: int) -> None:
        """``w[start, start + len(vals)) += vals``: each value rounded to its parameter's
        dtype, then added (torch's ``w.add_(vals.to(w.dtype))``). The dense suffix of a
        broadcast, a dense step."""
        self._refresh()
        if self.backend == "native":
            self._table.add_range(_host_f32(vals), start)
            return
        v = self._device_f32(vals)
        plan = self._plan(start, v.numel())
        for dtype, (views, pos) in plan.groups.items():
            src = (v if dtype == torch.float32 else v.to(dtype)).split(plan.sizes)
            torch._foreach_add_(views, [src[j] for j in pos])

    @torch.no_grad()
    def set_range(self, vals: torch.Tensor | np.ndarray, start: int) -> None:
        """``w[start, start + len(vals)) = vals``, rounded to each parameter's dtype (a
        snapshot, the dense suffix of an exact pull)."""
        self._refresh()
        if self.backend == "native":
            self._table.set_range(_host_f32(vals), start)
            return
        v = self._device_f32(vals)
        plan = self._plan(start, v.numel())
        src = v.split(plan.sizes)
        for views, pos in plan.groups.values():
            torch._foreach_copy_(views, [src[j] for j in pos])

    # ------------------------------------------------------------------ sparse
    @torch.no_grad()
    def add_at(self, idx: np.ndarray, vals: np.ndarray, start: int = 0) -> None:
        """``w[start + idx] += vals``: the install of the server's answer. ``idx`` strictly
        increasing int32, ``vals`` float32 (host arrays, read-only ones too); rounded as
        torch's ``w.index_add_(0, idx, vals.to(w.dtype))``."""
        self._refresh()
        if self.backend == "native":
            self._table.add_at(idx, vals, start)
            return
        self._torch_sparse(idx, vals, start, add=True)

    @torch.no_grad()
    def set_at(self, idx: np.ndarray, vals: np.ndarray, start: int = 0) -> None:
        """``w[start + idx] = vals``, rounded to each parameter's dtype (an exact pull's values)."""
        self._refresh()
        if self.backend == "native":
            self._table.set_at(idx, vals, start)
            return
        self._torch_sparse(idx, vals, start, add=False)

    # ------------------------------------------------------------------ update mode's merge
    @torch.no_grad()
    def merge_at(self, idx: np.ndarray, vals: np.ndarray, anchor: torch.Tensor, *, add: bool = True,
                 start: int = 0) -> None:
        """Update mode's install of the server's answer at ``start + idx`` (the merge rule
        ``w <- w + (a_new - a)``, local progress kept): the anchor, the flat float32 replica
        of the server's model holding ``[start, start + len(anchor))``, takes ``vals``,
        added (``add``: a broadcast step) or in their place (exact values), and the weights
        move by the anchor's change ``a_new - a_old`` in float32, rounded as :meth:`add_at`
        rounds. One walk on CPU; bit for bit _exchange.py's ``index_add_``/``index_copy_``
        of the anchor and ``index_add_`` of the change into the weights."""
        self._refresh()
        if self.backend == "native":
            self._table.merge_at(idx, vals, anchor, start, add=add)
            return
        self._check_buffer(anchor, anchor.numel(), "anchor")
        _check_indices(idx, vals, min(self.numel - start, anchor.numel()))
        at = self._device_index(idx)
        v = torch.from_numpy(_host_f32(vals, writable=True)).to(self.device)
        before = anchor.index_select(0, at)
        if add:
            anchor.index_add_(0, at, v)
            change = anchor.index_select(0, at) - before
        else:
            change = v - before
            anchor.index_copy_(0, at, v)
        self._torch_sparse(idx, change, start, add=True, at=at)

    @torch.no_grad()
    def merge_range(self, vals: torch.Tensor | np.ndarray, anchor: torch.Tensor, start: int, *,
                    add: bool = True) -> None:
        """:meth:`merge_at` over the range ``[start, start + len(vals))`` (the dense suffix,
        a snapshot), ``anchor`` holding that range."""
        v = self._device_f32(vals)
        self._check_buffer(anchor, v.numel(), "anchor")
        if add:
            before = anchor.clone()
            anchor.add_(v)
            change = anchor - before
        else:
            change = v - anchor
            anchor.copy_(v)
        self.add_range(change, start)

    # ------------------------------------------------------------------ internals
    def _check(self) -> torch.device:
        """The parameters' one device, every parameter checked (ValueError naming the first
        that is not of the layout's shape, a float dtype it takes, contiguous, on that device)."""
        devices = {p.device for p in self._params}
        if len(devices) > 1:
            raise ValueError(f"parameters on several devices: {sorted(str(d) for d in devices)}")
        for t, (p, numel) in enumerate(zip(self._params, self.layout.numels)):
            what = f"parameter {t}"
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{what}: a torch.Tensor expected, got {type(p).__name__}")
            if p.numel() != numel:
                raise ValueError(f"{what}: {p.numel()} elements, the layout has {numel}")
            if p.dtype not in PARAM_DTYPES:
                raise ValueError(f"{what}: dtype {p.dtype}; a flat model takes float32, float16 or bfloat16")
            if not p.is_contiguous():
                raise ValueError(f"{what}: not contiguous")
        return devices.pop() if devices else torch.device("cpu")

    def _refresh(self) -> None:
        """Follow the parameters' memory: a parameter whose ``data`` was re-pointed since
        the last operation is checked again and its new address (views) taken."""
        ptrs = [p.data_ptr() for p in self._params]
        if ptrs == self._ptrs:
            return
        if self._ptrs is not None:
            device = self._check()
            if device != self.device:
                raise ValueError(f"the parameters moved from {self.device} to {device}: make a new FlatParams")
        self._ptrs = ptrs
        if self.backend == "native":
            for i, t in enumerate(self._order):
                self._table.point(i, ptrs[t], PARAM_DTYPES[self._params[t].dtype])
        else:
            self._flat = [self._params[t].detach().view(-1) for t in self._order]
            self._plans = {}

    def _grad_of(self, t: int) -> torch.Tensor | None:
        p = self._params[t]
        g = p.grad
        if g is None:
            return None
        if g.device != self.device or g.dtype not in PARAM_DTYPES or g.numel() != p.numel():
            raise ValueError(f"parameter {t}: gradient of {g.numel()} {g.dtype} on {g.device}, the parameter "
                             f"{p.numel()} on {self.device}")
        return g if g.is_contiguous() else g.contiguous()

    def _check_buffer(self, x: torch.Tensor, n: int, what: str) -> None:
        if (not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.device != self.device
                or not x.is_contiguous() or x.numel() != n):
            raise ValueError(f"{what}: a contiguous float32 tensor of {n} elements on {self.device} expected")

    def _device_f32(self, vals: torch.Tensor | np.ndarray) -> torch.Tensor:
        if isinstance(vals, np.ndarray):
            vals = torch.from_numpy(_host_f32(vals, writable=True))
        return vals.detach().reshape(-1).to(self.device, torch.float32)

    def _plan(self, start: int, n: int) -> _Plan:
        """The pieces of ``[start, start + n)``, by parameter dtype (cached per range)."""
        key = (int(start), int(n))
        plan = self._plans.get(key)
        if plan is None:
            pieces = self._pieces(*key)
            plan = _Plan([b - a for _, a, b in pieces], {})
            for j, (i, a, b) in enumerate(pieces):
                w = self._flat[i]
                views, pos = plan.groups.setdefault(w.dtype, ([], []))
                views.append(w if (a, b) == (0, w.numel()) else w[a:b])
                pos.append(j)
            if len(self._plans) > 16:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def _pieces(self, start: int, n: int) -> list[tuple[int, int, int]]:
        """``(flat position, a, b)``: the parameters' local ranges ``[a, b)`` that make up
        ``[start, start + n)``, in order (empty ones left out)."""
        if start < 0 or n < 0 or start + n > self.numel:
            raise ValueError(f"range [{start}, {start + n}) outside the flat vector's [0, {self.numel})")
        out = []
        stop = start + n
        i = max(0, bisect.bisect_right(self._fstarts, start) - 1)
        while i < len(self._order) and self._fstarts[i] < stop:
            lo, hi = max(start, self._fstarts[i]), min(stop, self._fstarts[i] + self._sizes[i])
            if lo < hi:
                out.append((i, lo - self._fstarts[i], hi - self._fstarts[i]))
            i += 1
        return out

    def _torch_gather(self, src: Sequence[torch.Tensor | None], out: torch.Tensor, start: int) -> None:
        """``out`` = the flat vector of ``src`` (by flat position; None: zeros) over
        ``[start, start + len(out))``: one multi-tensor copy per dtype."""
        self._check_buffer(out, out.numel(), "out")
        pieces = self._pieces(start, out.numel())
        bufs = out.split([b - a for _, a, b in pieces])
        groups: dict[torch.dtype | None, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for buf, (i, a, b) in zip(bufs, pieces):
            s = src[i]
            dst, srcs = groups.setdefault(None if s is None else s.dtype, ([], []))
            dst.append(buf)
            if s is not None:
                srcs.append(s if (a, b) == (0, s.numel()) else s[a:b])
        for dtype, (dst, srcs) in groups.items():
            if dtype is None:
                torch._foreach_zero_(dst)
            else:
                torch._foreach_copy_(dst, srcs)

    def _device_index(self, idx: np.ndarray) -> torch.Tensor:
        return _device_index(idx, self.device)

    def _torch_sparse(self, idx: np.ndarray, vals: np.ndarray | torch.Tensor, start: int, *, add: bool,
                      at: torch.Tensor | None = None) -> None:
        """``add_at``/``set_at`` as torch ops: per dtype group, its parameters staged in one
        buffer, one ``index_add_``/``index_copy_``, copied back (module doc). ``vals``: host
        floats, or float32 on the device; ``at``: ``idx`` on the device already (merge_at's,
        checked there)."""
        if not 0 <= start <= self.numel:
            raise ValueError(f"start {start} outside [0, {self.numel}]")
        if at is None:
            _check_indices(idx, vals, self.numel - start)
        if not idx.size:
            return
        v = vals if isinstance(vals, torch.Tensor) else torch.from_numpy(_host_f32(vals, writable=True))
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, w in enumerate(self._flat):
            by_dtype.setdefault(w.dtype, []).append(i)
        if len(by_dtype) == 1:  # one group: the flat vector itself, at the indices as they are
            ((dtype, members),) = by_dtype.items()
            dev = self._device_index(idx) if at is None else at
            self._scatter(members, dev + start if start else dev, v.to(self.device, dtype), add, idx, start)
            return
        pos = idx.astype(np.int64) + start
        # each entry's parameter: the indices are sorted, so each parameter's entries are the run from
        # the first at or past its start (one search per parameter, not one per entry)
        fstarts = np.asarray(self._fstarts, np.int64)
        cuts = np.searchsorted(pos, fstarts, side="left")
        part = np.repeat(np.arange(len(fstarts)), np.diff(cuts, append=pos.size))
        for dtype, members in by_dtype.items():
            # group-local coordinates: each parameter's start within its group's buffer
            gstart = np.zeros(len(self._flat), np.int64)
            gstart[members] = np.cumsum([0, *(self._sizes[i] for i in members[:-1])])
            mine = np.zeros(len(self._flat), bool)
            mine[members] = True
            sel = mine[part]
            if not sel.any():
                continue
            local = pos[sel] - fstarts[part[sel]] + gstart[part[sel]]
            src = v[torch.from_numpy(sel).to(v.device)].to(self.device, dtype)
            self._scatter(members, torch.from_numpy(local).to(self.device), src, add, local, 0)

    def _scatter(self, members: list[int], at: torch.Tensor, src: torch.Tensor, add: bool, host: np.ndarray,
                 offset: int) -> None:
        """One dtype group's ``index_add_``/``index_copy_`` at group-local ``at`` (sorted;
        ``host + offset`` the same on the host). Up to :attr:`stage_max_numel` coordinates
        the group's parameters are staged in one buffer and copied back: two launches and
        four passes over the group; past that, one ``index_add_`` a parameter that has
        entries, each on its own slice of ``at``: a launch a tensor, but no pass over the
        model (a 1B-parameter model's staging would move 16 GB a call)."""
        views = [self._flat[i] for i in members]
        sizes = [self._sizes[i] for i in members]
        if sum(sizes) > self.stage_max_numel:
            starts = np.cumsum([0, *sizes[:-1]], dtype=np.int64)
            cuts = [*np.searchsorted(host, starts - offset, side="left").tolist(), at.numel()]
            for j, w in enumerate(views):
                a, b = cuts[j], cuts[j + 1]
                if a < b:
                    seg = at[a:b] - int(starts[j]) if starts[j] else at[a:b]
                    if add:
                        w.index_add_(0, seg, src[a:b])
                    else:
                        w.index_copy_(0, seg, src[a:b])
            return
        staged = torch.cat(views)
        if add:
            staged.index_add_(0, at, src)
        else:
            staged.index_copy_(0, at, src)
        torch._foreach_copy_(views, list(staged.split([self._sizes[i] for i in members])))


@dataclass
class _Plan:
    """The pieces of one flat range: their sizes in order, and per parameter dtype the
    parameters' views and the pieces' positions."""

    sizes: list[int]
    groups: dict[torch.dtype, tuple[list[torch.Tensor], list[int]]]


@dataclass(frozen=True)
class FlatPush:
    """What a :class:`FlatCompressor` sends: one sparse vector over the sparse range
    ``[0, sparse_numel)`` and the dense suffix's values ``[sparse_numel, numel)``, host
    memory. ``sparse.values`` are exact in ``value_dtype``, ``dense`` in ``dense_dtype``
    (float32 arrays, encoded exactly by ``codec.encode_values``)."""

    sparse: SparseGrad  # numel = sparse_numel; indices sorted int32, or None: the whole range
    dense: np.ndarray  # float32, numel - sparse_numel values
    value_dtype: str
    dense_dtype: str

    @property
    def sparse_numel(self) -> int:
        return self.sparse.numel

    @property
    def numel(self) -> int:
        return self.sparse.numel + int(self.dense.shape[0])

    @property
    def count(self) -> int:
        """Values carried."""
        return self.sparse.count + int(self.dense.shape[0])

    def to_dense(self) -> np.ndarray:
        """The whole flat vector (zeros where nothing was sent), float32."""
        return np.concatenate([self.sparse.to_dense(), self.dense])


class FlatCompressor:
    """Top-k with error feedback over a flat model's one residual (module doc; the
    semantics of :class:`~stella.compress.ErrorFeedbackCompressor`, shared through its
    :class:`~stella.compress.Engine`).

    Each :meth:`compress` selects about ``density * sparse_numel`` coordinates of the
    sparse range by magnitude (``method``: "threshold", "exact", "block", or "dense" for
    everything) and takes the dense suffix whole. Sparse values are rounded to
    ``value_dtype``, the suffix's to :attr:`dense_dtype` (f16 when the push is q4/q2, as
    the server's broadcast codes whole tensors: a 4- or 2-bit code has no zero, and one
    scale per 64 values); both rounding errors stay in the residual. ``group_quotas``
    (``Compression(per_tensor=True)``): each of the layout's tensors in the sparse range
    gets ``density`` times its size, selected one call per tensor.

    The residual lives on ``device``: :attr:`residual`, flat float32 of ``layout.numel``;
    the update mode writes ``anchor - w`` into it (:meth:`FlatParams.residual_into`) and
    calls ``compress(None)``.

    :attr:`weight` (None, or positive float32 of ``sparse_numel`` on ``device``): the
    sparse range of the residual holds its values times it, so the selection ranks
    ``|r| x weight`` (the update mode's ``Compression.moment_power``); the values a push
    carries are divided by it again, and what stays behind is in the weighted units. The
    update mode rebuilds the residual (and sets this) before every compression.
    """

    def __init__(self, layout: FlatLayout, density: float = 0.01, method: str = "threshold", *,
                 device: torch.device | str = "cpu", backend: str = "auto", value_dtype: str = "f32",
                 group_quotas: bool = False, sample_size: int = 0, seed: int = 0x5EED):
        self._engine = Engine(method, backend, sample_size, seed)
        if layout.sparse_numel > MAX_NUMEL:
            raise ValueError(f"a sparse range of {layout.sparse_numel:,} coordinates: its indices are int32 "
                             f"(at most {MAX_NUMEL:,})")
        self.layout = layout
        self.set_density(density)
        self.value_dtype = check_value_dtype(value_dtype)
        self.numel, self.sparse_numel = layout.numel, layout.sparse_numel
        if backend == "native" and torch.device(device).type != "cpu":
            raise ValueError(f"backend='native' needs CPU tensors, not {device}")
        self._residual = torch.zeros(layout.numel, dtype=torch.float32, device=device)
        s = self.sparse_numel
        self._sparse = State(self._residual[:s], torch.Size([s]))
        self._dense = State(self._residual[s:], torch.Size([self.numel - s]))
        # per-group quotas: one state (thresholds carried) per large tensor, views of the sparse range
        self._groups = ([(a, State(self._residual[a:b], torch.Size([b - a]))) for _, a, b in layout.spans() if b <= s]
                        if group_quotas and method != "dense" else None)
        self.weight: torch.Tensor | None = None

    @property
    def method(self) -> str:
        return self._engine.method

    @property
    def per_tensor(self) -> bool:
        """Whether each large tensor gets its own quota (``group_quotas``)."""
        return self._groups is not None

    @property
    def backend(self) -> str:
        return self._engine.backend

    @property
    def residual(self) -> torch.Tensor:
        """The live flat residual (float32, ``layout.numel``, on the compressor's device):
        what was not sent yet. The caller may overwrite it between compressions."""
        return self._residual

    @property
    def dense_dtype(self) -> str:
        """The coding of the dense suffix's values: f16 for q4/q2 pushes, else the push's."""
        return "f16" if self.value_dtype in codec.QUANT_BITS else self.value_dtype

    def set_density(self, density: float) -> None:
        self.density = check_density(density)

    def compress(self, grad: torch.Tensor | None = None) -> FlatPush:
        """``residual += grad`` (a flat float32 vector of ``numel``, e.g. from
        :meth:`FlatParams.gather_grads_into`; None: the residual as it stands); select;
        the rest, and the rounding errors, stay in the residual. q4/q2 values are what the
        receiver decodes; a NaN or Inf among them raises :class:`~stella.errors.BadValue`."""
        g: torch.Tensor | None = None
        if grad is not None:
            if not isinstance(grad, torch.Tensor):
                raise TypeError("grad must be a torch.Tensor or None")
            if grad.numel() != self.numel:
                raise ValueError(f"grad has {grad.numel()} elements, the flat model {self.numel}")
            g = grad.detach().reshape(-1).to(self._residual.device, torch.float32)
        s, eng, w = self.sparse_numel, self._engine, self.weight
        gs = None if g is None else g[:s]
        if self._groups is None and w is None:
            eng.sampling.calls += 1
            sparse = eng.compress(self._sparse, gs, k_for(self.density, s), self.value_dtype)
        else:
            if self._groups is None:
                eng.sampling.calls += 1
                sg = eng.compress(self._sparse, gs, k_for(self.density, s), "f32")
            else:
                sg = self._select_groups(gs)
            scale = None
            if w is not None and sg.count:  # the values as they are, not weighted
                at = w if sg.indices is None else w[_device_index(sg.indices, w.device)]
                scale = _host_f32(at)
                sg = SparseGrad(sg.numel, sg.indices, np.divide(sg.values, scale, dtype=np.float32))
            sparse = eng.round_values(self._sparse, sg, self.value_dtype, scale)
        dense = eng.compress(self._dense, None if g is None else g[s:], 0, self.dense_dtype, dense=True)
        return FlatPush(sparse, dense.values, self.value_dtype, self.dense_dtype)

    def flush(self) -> FlatPush:
        """Everything left in the residual, exact float32 (send it as "f32"); it becomes zero."""
        return FlatPush(self._engine.flush(self._sparse), self._engine.flush(self._dense, whole=True).values,
                        "f32", "f32")

    def take_back(self, sent: FlatPush, clipped: Sequence[tuple[int, int, float]]) -> FlatPush:
        """The server scaled ``sent`` down over each range ``[start, stop)`` of the flat
        model in ``clipped`` to the factor it kept (its push-norm bound,
        :class:`~stella.protocol.PushOk`'s ``clipped``): what it scaled off goes back into
        the residual, to go out with a later push, so nothing is lost. Returns the push as
        the server applied it (its values scaled as the server scales them)."""
        if not clipped:
            return sent
        s, idx = self.sparse_numel, sent.sparse.indices
        sparse = np.array(sent.sparse.values, dtype=np.float32, copy=True)
        dense = np.array(sent.dense, dtype=np.float32, copy=True)
        for start, stop, kept in clipped:
            if idx is None:
                lo, hi = min(start, s), min(stop, s)
            else:
                lo, hi = (int(i) for i in np.searchsorted(idx, (start, stop)))
            a, b = min(max(start - s, 0), dense.size), min(max(stop - s, 0), dense.size)
            for vals, i, j in ((sparse, lo, hi), (dense, a, b)):
                if j > i:  # float64 times the factor, as the server scales (aggregation.scaled)
                    vals[i:j] = (vals[i:j].astype(np.float64) * kept).astype(np.float32)
        res = self._residual
        off = torch.from_numpy(np.subtract(sent.sparse.values, sparse, dtype=np.float32)).to(res.device)
        w = self.weight
        if idx is None:
            res[:s].add_(off if w is None else off * w)
        elif idx.size:
            at = _device_index(idx, res.device)
            res.index_add_(0, at, off if w is None else off * w[at])
        if dense.size:
            res[s:].add_(torch.from_numpy(np.subtract(sent.dense, dense, dtype=np.float32)).to(res.device))
        return FlatPush(SparseGrad(sent.sparse.numel, idx, sparse), dense, sent.value_dtype, sent.dense_dtype)

    def select_stats(self) -> dict[str, int] | None:
        """The C kernel's counters of the last selection (summed over the groups with
        ``group_quotas``), or None when it never ran. For benchmarks and tests."""
        states = [st for _, st in self._groups] if self._groups is not None else [self._sparse]
        stats = [st.cstats.as_dict() for st in states if st.cstats is not None]
        if not stats:
            return None
        return {k: sum(d[k] for d in stats) for k in stats[0]}

    def _select_groups(self, gs: torch.Tensor | None) -> SparseGrad:
        """Each group's own top-k (its quota), unrounded, as one sorted vector of the sparse range."""
        assert self._groups is not None
        idx, val = [], []
        for a, st in self._groups:
            n = st.residual.numel()
            self._engine.sampling.calls += 1
            sg = self._engine.compress(st, None if gs is None else gs[a:a + n], k_for(self.density, n), "f32")
            idx.append(np.arange(n, dtype=np.int32) + a if sg.indices is None else sg.indices + np.int32(a))
            val.append(sg.values)
        s = self.sparse_numel
        if not idx:
            return SparseGrad(s, np.zeros(0, np.int32), np.zeros(0, np.float32))
        return SparseGrad(s, np.concatenate(idx), np.concatenate(val))


def _check_indices(idx: np.ndarray, vals: Any, limit: int) -> None:
    """ValueError unless ``idx`` is a 1-D int32 array, strictly increasing in ``[0, limit)``,
    with one value each in ``vals``."""
    if not (isinstance(idx, np.ndarray) and idx.dtype == np.int32 and idx.ndim == 1):
        raise ValueError("indices must be a 1-D int32 array")
    if tuple(vals.shape) != idx.shape:
        raise ValueError("values must be one float per index")
    if idx.size and (idx[0] < 0 or int(idx[-1]) >= limit or not np.all(idx[1:] > idx[:-1])):
        raise ValueError(f"indices must be strictly increasing in [0, {limit})")


def _device_index(idx: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host int32 indices as int64 on ``device``: copied over as they are (half the bytes
    of int64), widened there."""
    return torch.from_numpy(idx if idx.flags.writeable else idx.copy()).to(device).long()


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _host_f32(vals: Any, writable: bool = False) -> np.ndarray:
    """A contiguous 1-D float32 host array of ``vals`` (a NumPy array or a tensor): no
    copy when it is one already (read-only too, unless ``writable``: torch wants writable
    memory, and the wire's frames are read-only buffers)."""
    if isinstance(vals, torch.Tensor):
        vals = vals.detach().reshape(-1).to("cpu", torch.float32).numpy()
    a = np.ascontiguousarray(vals, dtype=np.float32).reshape(-1)
    return a if a.flags.writeable or not writable else a.copy()
