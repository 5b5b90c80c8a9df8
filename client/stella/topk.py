"""Top-k selection with error feedback over NumPy arrays, without torch: the C kernel
of :mod:`stella.compress` (sampled threshold, one streaming pass, indices emitted
sorted) for callers that hold their residual as a NumPy array. The server's
compressed broadcast (:mod:`stella_ps.broadcast`) selects from its residual with it.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import _select_native as _select

__all__ = ["Selector"]


class Selector:
    """Selects about ``k`` entries of largest magnitude from one residual, step after
    step, carrying the threshold across steps (like one key of the compressor)."""

    def __init__(self, seed: int = 0x5EED) -> None:
        self._state = _select.TopkState()
        self._seed = seed & 0xFFFFFFFFFFFFFFFF
        self._calls = 0

    @property
    def threshold(self) -> float:
        """The last :meth:`take`'s threshold: what it left in the residual is at most this
        in magnitude (0.0 when it took every nonzero)."""
        return float(self._state._c.last_threshold)

    def take(self, residual: np.ndarray, k: int,
             adds: Sequence[tuple[np.ndarray, np.ndarray]] = ()) -> tuple[np.ndarray, np.ndarray]:
        """The sorted indices (int32) and values (float32) of about ``k`` of ``residual``'s
        largest magnitudes (within 10%, fewer when fewer are nonzero); they become zero
        in ``residual`` (a contiguous 1-D float32 array, changed in place). ``adds``
        (each sorted unique int32 indices and float32 values) are added to ``residual``
        first, in the same pass: the result is that of ``residual[i] += v`` for each, in
        order, and then ``take``."""
        n = residual.shape[0]
        k = max(1, min(int(k), n))
        self._calls += 1
        seed = (self._seed * 0x9E3779B97F4A7C15 + self._calls) & 0xFFFFFFFFFFFFFFFF
        sample = min(n, max(4096, min(65536, 400 * n // k)))
        return _select.ef_select(residual, None, k, 1, self._state, sample, seed, adds=adds)
