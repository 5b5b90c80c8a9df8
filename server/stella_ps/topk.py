"""Top-k selection with error feedback over NumPy arrays, without torch, for the
server's compressed broadcast (:mod:`.broadcast`): the C selection of the workers'
compressor (``native/compress.c``: sampled threshold, one streaming pass, indices
emitted sorted), compiled into the server's own module, ``stella_ps._kernel``, beside
the broadcast's pool and scatter, so that a step's selection stays in one module.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from stella.native_select import Selection

from ._kernel import ffi, lib

SELECT = Selection(ffi, lib, "stella_ps._kernel")  # the selection functions of this module

__all__ = ["Selector", "SELECT"]


class Selector:
    """Selects about ``k`` entries of largest magnitude from one residual, step after
    step, carrying the threshold across steps (like one key of the compressor)."""

    def __init__(self, seed: int = 0x5EED) -> None:
        self._state = SELECT.state()
        self._seed = seed & 0xFFFFFFFFFFFFFFFF
        self._calls = 0

    @property
    def threshold(self) -> float:
        """The last :meth:`take`'s threshold: what it left in the residual is at most this
        in magnitude (0.0 when it took every nonzero)."""
        return self._state.last_threshold

    def take(self, residual: np.ndarray, k: int, adds: Sequence[tuple[np.ndarray, np.ndarray]] = (),
             threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """The sorted indices (int32) and values (float32) of about ``k`` of ``residual``'s
        largest magnitudes (within 10%, fewer when fewer are nonzero); they become zero
        in ``residual`` (a contiguous 1-D float32 array, changed in place). ``adds``
        (each sorted unique int32 indices and float32 values) are added to ``residual``
        first, in the same pass: the result is that of ``residual[i] += v`` for each, in
        order, and then ``take``. ``threads``: the pass over ``residual`` on up to this many
        threads, the same result bit for bit."""
        n = residual.shape[0]
        k = max(1, min(int(k), n))
        self._calls += 1
        seed = (self._seed * 0x9E3779B97F4A7C15 + self._calls) & 0xFFFFFFFFFFFFFFFF
        sample = min(n, max(4096, min(65536, 400 * n // k)))
        return SELECT.ef_select(residual, None, k, 1, self._state, sample, seed, adds=adds, threads=threads)
