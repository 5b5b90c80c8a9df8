"""Top-k gradient compression with error feedback.

A worker keeps, per tensor key, a float32 *residual* on the gradient's device.
Each step :meth:`ErrorFeedbackCompressor.compress` forms ``acc = residual + grad``
(in place, in the residual's memory), selects about ``k = density * numel``
coordinates of largest magnitude, returns them as a :class:`SparseGrad` in host
memory, and leaves everything that was not sent in the residual (the selected
coordinates become exactly zero, or hold the rounding error of the values when
``value_dtype`` is "f16"/"bf16", or their quantisation error when it is "q4"/"q2").
Nothing is lost: for every key, the sum of all values ever sent plus the current
residual equals the running sum of gradients (up to float32 rounding of the
additions).

Methods (see ``docs/compression.md``):

``"exact"``
    reference: ``torch.topk`` on ``|acc|``, then the indices are sorted.
``"threshold"`` (default)
    sampled-threshold top-k: the threshold is estimated from a small random
    sample of ``|acc|`` on the first step and then carried across steps per
    tensor (checked on a small sample, corrected by the count it produced); one
    streaming pass fuses the error-feedback add with the selection and emits
    indices already sorted. The count is kept within 10% of ``k``: too many
    candidates are trimmed (a histogram over the candidates only), too few make
    the residual whole again and the pass is repeated (gradient-free, read-only)
    at a lower threshold.
``"block"``
    block top-k on whole 16-float (64-byte) blocks ranked by their squared
    norm, as StellaTrain does. The :class:`SparseGrad` is expanded to element
    indices (16 consecutive indices per selected block), so receivers see
    ordinary sorted indices; the ``"block16"`` index coding sends only the
    block numbers.
``"dense"``
    everything is sent, the residual becomes zero.

Tensors with fewer than ``dense_below`` elements are always sent dense.

On CPU, contiguous float32 work goes through the C kernel in
``native/compress.c`` (wrapped by ``stella._select_native``; GIL released, one
thread); on CUDA (or with ``backend="torch"``) the same methods run as torch ops
on the device and only the sparse result is copied to the host.
:meth:`ErrorFeedbackCompressor.select_stats` has the C kernel's counters of a
key's last selection.

Each method on each backend is one :class:`Selector` (``Dense``, ``Exact``,
``NativeThreshold``, ``NativeBlock``, ``TorchThreshold``, ``TorchBlock``). An
:class:`Engine` picks one per residual from the method, whether the residual goes
whole (a tensor below ``dense_below``, the flat model's dense suffix) and where it
lives, and rounds what it selected to the wire dtype (the error kept in the
residual); it also flushes. Two compressors share it: :class:`ErrorFeedbackCompressor`
keeps a residual per tensor key, and :class:`stella.flat.FlatCompressor` one residual
for the whole flat model (``stella.layout``), selected in one call.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from . import codec
from ._flat_native import scatter_add
from ._select_native import BLOCK, SelectStats, TopkState
from ._select_native import SELECT as _select
from .errors import BadValue

__all__ = ["SparseGrad", "ErrorFeedbackCompressor", "Engine", "State", "Selector", "METHODS", "VALUE_DTYPES", "BLOCK",
           "quantise_torch", "k_for", "check_density", "check_value_dtype"]

METHODS = ("exact", "threshold", "block", "dense")

# The selected count must land in [LOW * k, HIGH * k] (unless fewer than
# LOW * k coordinates are nonzero).
LOW, HIGH = 0.9, 1.1


@dataclass(frozen=True)
class SparseGrad:
    """One tensor's push: sorted unique indices and their values, host memory.

    ``indices is None`` means dense: ``values`` holds all ``numel`` entries.
    """

    numel: int
    indices: np.ndarray | None  # int32, strictly increasing
    values: np.ndarray  # float32, same length as indices (or numel when dense)

    @property
    def count(self) -> int:
        return int(self.values.shape[0])

    @property
    def is_dense(self) -> bool:
        return self.indices is None

    def to_dense(self) -> np.ndarray:
        """A float32 numpy array of ``numel`` entries (zeros where nothing was sent)."""
        if self.indices is None:
            return np.array(self.values, dtype=np.float32, copy=True)
        out = np.zeros(self.numel, dtype=np.float32)
        out[self.indices] = self.values
        return out


@dataclass
class State:
    """One residual and what its selector carries across steps (one per key of an
    :class:`ErrorFeedbackCompressor`; a :class:`~stella.flat.FlatCompressor` has one for
    its sparse range, one for the dense suffix, or one per group)."""

    residual: torch.Tensor  # flat float32, on the gradient's device
    shape: torch.Size
    thr: float = 0.0  # torch selectors: threshold carried across steps (0: none yet)
    cstate: TopkState | None = None  # native selectors: thresholds carried across steps
    cstats: SelectStats | None = None  # native selectors: counters of the last selection


# value_dtype -> (largest finite value, torch dtype of the rounding)
_VALUE_LIMITS = {
    "f32": (float(np.finfo(np.float32).max), torch.float32),
    "f16": (65504.0, torch.float16),
    "bf16": (3.3895313892515355e38, torch.bfloat16),
}
VALUE_DTYPES = (*_VALUE_LIMITS, *codec.QUANT_DTYPES)


def k_for(density: float, numel: int) -> int:
    """Coordinates to select of ``numel`` at ``density`` (at least one)."""
    return min(numel, max(1, round(density * numel)))


def _units(n: int, k: int, unit: int) -> tuple[int, int]:
    """``(units in the tensor, units to select)`` for ``k`` floats of ``n``: the one place
    where k becomes units, floats for "threshold" (``unit`` 1) and ``BLOCK``-float
    blocks for "block" (``unit`` BLOCK)."""
    if unit == 1:
        return n, k
    nu, _ = _blocks(n)
    return nu, max(1, min(nu, round(k / BLOCK)))


class _Sampling:
    """How a compressor's selectors sample for their first threshold: the sample size, a
    seed per call (native) and a generator per device (torch), all from one seed."""

    def __init__(self, size: int, seed: int):
        self.size_override = size  # 0: chosen from k
        self.seed = seed
        self.calls = 0  # compress() calls so far; every one gives the next native seed
        self._gens: dict[torch.device, torch.Generator] = {}

    def size(self, n: int, k: int) -> int:
        """Units to sample (floats for "threshold", blocks for "block")."""
        if self.size_override > 0:
            return min(n, self.size_override)
        # ~400 expected sample hits above the threshold, within [4096, 65536]
        want = int(400 * n / max(k, 1))
        return min(n, max(4096, min(65536, want)))

    def next_seed(self) -> int:
        return (self.seed * 0x9E3779B97F4A7C15 + self.calls) & 0xFFFFFFFFFFFFFFFF

    def generator(self, device: torch.device) -> torch.Generator:
        g = self._gens.get(device)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed)
            self._gens[device] = g
        return g


class Selector(Protocol):
    """One method on one backend: ``residual += grad`` (``grad`` None: the residual as it
    stands), select about ``k`` floats' worth, return them, zero them in the residual."""

    def select(self, st: State, grad: torch.Tensor | None, k: int) -> SparseGrad: ...


class Dense:
    """``"dense"`` (and tensors below ``dense_below``): everything goes."""

    def select(self, st: State, grad: torch.Tensor | None, k: int) -> SparseGrad:
        _add(st.residual, grad)
        return _take_dense(st.residual)


class Exact:
    """``"exact"``, the reference: ``torch.topk`` of ``|acc|``, indices sorted (any backend)."""

    def select(self, st: State, grad: torch.Tensor | None, k: int) -> SparseGrad:
        acc = st.residual
        _add(acc, grad)
        _, idx = torch.topk(acc.abs(), k, sorted=False)
        idx = idx.sort().values
        val = acc[idx]
        acc[idx] = 0.0
        return SparseGrad(acc.numel(), _host_i32(idx), _host_f32(val))


class NativeThreshold:
    """``"threshold"`` in C (contiguous float32 CPU): the error-feedback add fused with a
    sampled-threshold selection, thresholds carried in ``st.cstate``."""

    unit = 1

    def __init__(self, sampling: _Sampling):
        self.sampling = sampling

    def select(self, st: State, grad: torch.Tensor | None, k: int) -> SparseGrad:
        res = st.residual
        nu, ku = _units(res.numel(), k, self.unit)
        if st.cstate is None:
            st.cstate, st.cstats = _select.state(), _select.stats()
        g = None if grad is None else grad.contiguous()
        idx, val = _select.ef_select(res, g, ku, self.unit, st.cstate, self.sampling.size(nu, ku),
                                     self.sampling.next_seed(), st.cstats)
        return SparseGrad(res.numel(), idx, val)


class NativeBlock(NativeThreshold):
    """``"block"`` in C: whole ``BLOCK``-float blocks by squared norm."""

    unit = BLOCK


class TorchThreshold:
    """``"threshold"`` as torch ops on the residual's device (CUDA, or ``backend="torch"``):
    the threshold carried in ``st.thr``, the count kept within ``[LOW k, HIGH k]``."""

    unit = 1

    def __init__(self, sampling: _Sampling):
        self.sampling = sampling

    def select(self, st: State, grad: torch.Tensor | None, k: int) -> SparseGrad:
        acc = st.residual
        _add(acc, grad)
        n = acc.numel()
        _, ku = _units(n, k, self.unit)
        picked, st.thr = self._pick(self._score(acc), ku, st.thr)
        idx = self._indices(picked, n, acc.device)
        val = acc[idx]
        acc[idx] = 0.0
        return SparseGrad(n, _host_i32(idx), _host_f32(val))

    def _score(self, acc: torch.Tensor) -> torch.Tensor:
        return acc.abs()

    def _indices(self, picked: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
        return picked

    def _sample_thr(self, score: torch.Tensor, k: int) -> float:
        """Threshold whose expected count of ``score >= thr`` is ``k`` (sampled)."""
        n = score.numel()
        s = self.sampling.size(n, k)
        if s >= n:
            sample = score
        else:
            pos = torch.randint(0, n, (s,), device=score.device, generator=self.sampling.generator(score.device))
            sample = score[pos]
        m = max(1, min(sample.numel(), round(sample.numel() * k / n)))
        return float(torch.topk(sample, m, sorted=False).values.min())

    def _pick(self, score: torch.Tensor, k: int, thr: float) -> tuple[torch.Tensor, float]:
        """Indices (sorted) of ``score >= thr`` with a count in [LOW k, HIGH k]; next threshold."""
        if thr <= 0.0:
            thr = self._sample_thr(score, k)
        tiny = float(np.finfo(np.float32).tiny)
        thr = max(thr, tiny)
        idx = torch.nonzero(score >= thr).reshape(-1)
        c = idx.numel()
        if c > HIGH * k:
            top_t = torch.topk(score[idx], k, sorted=False).values.min()
            idx = idx[score[idx] >= top_t]
            thr = float(top_t)
        elif c < LOW * k and thr > tiny:
            # too few: the exact k-th largest score, then one more mask
            top = float(torch.topk(score, k, sorted=False).values.min())
            thr = max(top, tiny)
            idx = torch.nonzero(score >= thr).reshape(-1)
        return idx, thr


class TorchBlock(TorchThreshold):
    """``"block"`` as torch ops: blocks scored by squared norm (a partial last block padded
    with zeros), the picked blocks expanded to element indices."""

    unit = BLOCK

    def _score(self, acc: torch.Tensor) -> torch.Tensor:
        nb, pad = _blocks(acc.numel())
        sq = acc.square()
        if pad:
            sq = torch.cat([sq, sq.new_zeros(pad)])
        return sq.view(nb, BLOCK).sum(1)

    def _indices(self, picked: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
        idx = (picked.view(-1, 1) * BLOCK + torch.arange(BLOCK, device=device)).reshape(-1)
        nb, pad = _blocks(n)
        if pad and picked.numel() and int(picked[-1]) == nb - 1:  # the partial last block: no padding sent
            idx = idx[: idx.numel() - pad]
        return idx


def _blocks(n: int) -> tuple[int, int]:
    """Blocks of ``BLOCK`` floats covering ``n``, and the padding of the last one."""
    nb = (n + BLOCK - 1) // BLOCK
    return nb, nb * BLOCK - n


class Engine:
    """A method on its backends, shared by both compressors: the :class:`Selector` for a
    residual (from the method, whether the residual goes whole, and where it lives), the
    rounding of what it selected to the wire dtype with the error kept in the residual,
    and the flush."""

    def __init__(self, method: str = "threshold", backend: str = "auto", sample_size: int = 0, seed: int = 0x5EED):
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if backend not in ("auto", "native", "torch"):
            raise ValueError(f"backend must be 'auto', 'native' or 'torch', got {backend!r}")
        self.method = method
        self.backend = backend
        self.sampling = _Sampling(int(sample_size), int(seed))
        self._dense, self._exact = Dense(), Exact()
        self._native = {"threshold": NativeThreshold(self.sampling), "block": NativeBlock(self.sampling)}
        self._torch = {"threshold": TorchThreshold(self.sampling), "block": TorchBlock(self.sampling)}

    def compress(self, st: State, grad: torch.Tensor | None, k: int, value_dtype: str, *,
                 dense: bool = False) -> SparseGrad:
        """``st.residual += grad`` (flat float32 on the residual's device, or None); select
        about ``k`` coordinates (all of them when ``dense`` or the method is "dense"); round
        the values to ``value_dtype`` (:meth:`round_values`); the rest stays in the residual.
        The caller counts its calls (``sampling.calls``: every one gives the next seed)."""
        n = st.residual.numel()
        if n == 0:
            sg = SparseGrad(0, np.zeros(0, np.int32), np.zeros(0, np.float32))
        else:
            sg = self.selector(st.residual, dense).select(st, grad, k)
        return self.round_values(st, sg, value_dtype)

    def selector(self, res: torch.Tensor, dense: bool = False) -> Selector:
        """The selector for a residual: from the method, ``dense`` and where it lives."""
        if self.method == "dense" or dense:
            return self._dense
        native = self.use_native(res)  # also refuses backend="native" off the CPU, for every method
        if self.method == "exact":
            return self._exact
        return (self._native if native else self._torch)[self.method]

    def round_values(self, st: State, sg: SparseGrad, value_dtype: str,
                     scale: np.ndarray | None = None) -> SparseGrad:
        """``sg`` (selected from ``st.residual``, indices relative to it) with its values
        rounded to ``value_dtype``: f16/bf16 clamped to the finite range and rounded, q4/q2
        quantised as the receiver decodes them (NaN/Inf: BadValue); the error added back
        into the residual at the selected coordinates (times ``scale`` there, float32 of
        ``sg``'s values: a residual that holds its values weighted, FlatCompressor's
        ``weight``)."""
        if value_dtype == "f32" or sg.count == 0:
            return sg
        res = st.residual
        vals = torch.from_numpy(sg.values)
        if value_dtype in codec.QUANT_BITS:
            if self.use_native(res):
                q = torch.from_numpy(codec.quantise(sg.values, value_dtype))
            else:  # on the residual's device
                vals = vals.to(res.device)
                q = quantise_torch(vals, value_dtype)
        else:
            limit, tdtype = _VALUE_LIMITS[value_dtype]
            q = vals.clamp(-limit, limit).to(tdtype).float()
        # exact for f16/bf16 (q is vals rounded to fewer mantissa bits); one float32
        # rounding of the error for q4/q2
        err = vals - q
        if scale is not None:
            err = err * torch.from_numpy(scale).to(err.device)
        if sg.indices is None:
            res.add_(err.to(res.device))
        elif self.use_native(res):  # (err is on the host): one C walk; index_put_(accumulate) cost 4x
            scatter_add(res, sg.indices, err.numpy())
        else:  # unique indices: the same sums as index_put_(accumulate=True), without its sort on CUDA
            res.index_add_(0, torch.from_numpy(sg.indices).to(device=res.device, dtype=torch.long),
                           err.to(res.device))
        return SparseGrad(sg.numel, sg.indices, _host_f32(q))

    @staticmethod
    def flush(st: State, whole: bool = False) -> SparseGrad:
        """Everything left in ``st.residual`` (sparse nonzeros, or dense when that is
        smaller or ``whole``), exact float32; it becomes zero."""
        res = st.residual
        n = res.numel()
        nz = torch.count_nonzero(res).item() if n and not whole else 0
        if whole or nz * 2 >= n:  # 8 bytes a pair vs 4 a value: dense is smaller
            return _take_dense(res)
        idx = torch.nonzero(res).reshape(-1)
        val = res[idx]
        res.zero_()
        return SparseGrad(n, _host_i32(idx), _host_f32(val))

    def use_native(self, res: torch.Tensor) -> bool:
        if self.backend == "torch" or res.device.type != "cpu":
            if self.backend == "native" and res.device.type != "cpu":
                raise ValueError("backend='native' needs CPU tensors")
            return False
        if self.backend == "native":
            return True
        return res.numel() < 2**31  # int32 indices in the C kernel: torch ops beyond


def check_value_dtype(value_dtype: str) -> str:
    """``value_dtype``, one of :data:`VALUE_DTYPES` (ValueError otherwise)."""
    if value_dtype not in VALUE_DTYPES:
        raise ValueError(f"value_dtype must be one of {VALUE_DTYPES}, got {value_dtype!r}")
    return value_dtype


def check_density(density: float) -> float:
    """``density`` as a float in (0, 1] (ValueError otherwise)."""
    density = float(density)
    if not (0.0 < density <= 1.0) or math.isnan(density):
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    return density


class ErrorFeedbackCompressor:
    """Per-key error-feedback residuals, values rounded to the wire dtype, and a
    :class:`Selector` per method and backend (see module doc), through an :class:`Engine`."""

    def __init__(
        self,
        density: float = 0.01,
        method: str = "threshold",
        dense_below: int = 4096,
        *,
        backend: str = "auto",
        value_dtype: str = "f32",
        sample_size: int = 0,
        seed: int = 0x5EED,
    ):
        self._engine = Engine(method, backend, sample_size, seed)
        if dense_below < 0:
            raise ValueError("dense_below must be >= 0")
        self.set_density(density)
        self.value_dtype = check_value_dtype(value_dtype)
        self.dense_below = int(dense_below)
        self._states: dict[str, State] = {}

    @property
    def method(self) -> str:
        return self._engine.method

    @property
    def backend(self) -> str:
        return self._engine.backend

    # ------------------------------------------------------------------ API
    def set_density(self, density: float) -> None:
        self.density = check_density(density)

    def keys(self) -> list[str]:
        return list(self._states)

    def select_stats(self, key: str) -> dict[str, int] | None:
        """Counters of ``key``'s last selection by the C kernel (passes, estimates,
        trims, givebacks, units, exact_fallback), or None if it never ran for ``key``.
        For benchmarks and tests."""
        st = self._states[key]
        return None if st.cstats is None else st.cstats.as_dict()

    def residual(self, key: str) -> torch.Tensor:
        """The live residual of ``key`` (shape of the gradient, float32, its device).

        It is the compressor's own memory: read it, don't write it.
        """
        st = self._states[key]
        return st.residual.view(st.shape)

    def residual_buffer(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """``key``'s residual as a flat float32 tensor the caller may overwrite (created,
        zero, on ``like``'s device and with its shape on first use).

        For callers that define the residual themselves: the update mode writes the
        not-yet-sent change of its weights here and then calls ``compress(key, None)``.
        """
        return self._state_for(key, like).residual

    def compress(self, key: str, grad: torch.Tensor | None) -> SparseGrad:
        """``residual += grad`` (``grad`` None: the residual as it is); select; the
        rest stays in the residual.

        With ``value_dtype`` "f16" or "bf16" the returned values are already
        rounded to that dtype (clamped to its finite range; still float32
        arrays, encoded exactly by ``codec.encode_values``) and the rounding
        error stays in the residual, so nothing is lost to the wire format.
        With "q4" or "q2" they are the values the receiver decodes
        (``codec.quantise``, or :func:`quantise_torch` on the torch path: the same
        bits), dense tensors included, and the quantisation error stays in the
        residual; a NaN or Inf raises :class:`~stella.errors.BadValue`.
        """
        g: torch.Tensor | None = None
        if grad is None:
            if key not in self._states:
                raise KeyError(f"{key!r}: no residual to compress (call residual_buffer first)")
            st = self._states[key]
        elif not isinstance(grad, torch.Tensor):
            raise TypeError("grad must be a torch.Tensor or None")
        else:
            st = self._state_for(key, grad)
            g = grad.detach().reshape(-1)
            if g.dtype != torch.float32:
                g = g.float()
        n = st.residual.numel()
        self._engine.sampling.calls += 1
        return self._engine.compress(st, g, k_for(self.density, n), self.value_dtype,
                                     dense=n < self.dense_below)

    def flush(self, key: str) -> SparseGrad:
        """Everything left in ``key``'s residual (sparse nonzeros or dense); it becomes zero.

        Values are exact float32 (never rounded to ``value_dtype``): send them as "f32".
        """
        return self._engine.flush(self._states[key])

    # ------------------------------------------------------------ internals
    def _state_for(self, key: str, grad: torch.Tensor) -> State:
        st = self._states.get(key)
        if st is None:
            res = torch.zeros(grad.numel(), dtype=torch.float32, device=grad.device)
            st = State(res, grad.shape)
            self._states[key] = st
        elif st.residual.numel() != grad.numel():
            raise ValueError(
                f"{key!r}: gradient has {grad.numel()} elements, its residual {st.residual.numel()}"
            )
        elif st.residual.device != grad.device:
            # the model moved: the residual follows it
            st.residual = st.residual.to(grad.device)
        return st


def _add(res: torch.Tensor, g: torch.Tensor | None) -> None:
    if g is not None:
        res.add_(g if g.device == res.device else g.to(res.device))


def _take_dense(res: torch.Tensor) -> SparseGrad:
    vals = _host_f32(res, copy=True)
    res.zero_()
    return SparseGrad(res.numel(), None, vals)


def quantise_torch(values: torch.Tensor, dtype: str) -> torch.Tensor:
    """``codec.quantise`` as torch ops on ``values``' device: the float32 values a
    receiver decodes from the "q4"/"q2" frame of the flat float32 ``values``, bit for
    bit the C encoder's (the same float32 operations in the same order; the format is
    in docs/compression.md). BadValue for NaN or Inf."""
    bits = codec.QUANT_BITS[dtype]
    top = (1 << bits) - 1
    h = top / 2
    n = values.numel()
    if not bool(torch.isfinite(values).all()):
        raise BadValue(f"{dtype} encode of {n} values: NaN/Inf value")
    chunks = torch.nn.functional.pad(values, (0, -n % codec.QCHUNK)).view(-1, codec.QCHUNK)
    m = chunks.abs().amax(1, keepdim=True)  # the scale: each chunk's largest magnitude
    x = chunks / m
    y = x * h  # separate ops, never fused: C computes t = (v / m) * h + (h + 1/2) the same way
    t = y + (h + 0.5)
    k = torch.where(m > 0, t.floor().clamp(max=top), float((top + 1) // 2)).long()
    levels = torch.tensor([(2 * j - top) / top for j in range(top + 1)], dtype=torch.float32, device=values.device)
    return (m * levels[k]).view(-1)[:n]


def _host_i32(t: torch.Tensor) -> np.ndarray:
    return t.to(device="cpu", dtype=torch.int32).numpy()


def _host_f32(t: torch.Tensor, copy: bool = False) -> np.ndarray:
    out = t.detach().to(device="cpu", dtype=torch.float32)
    if copy and out.data_ptr() == t.data_ptr():
        out = out.clone()
    return out.numpy()
