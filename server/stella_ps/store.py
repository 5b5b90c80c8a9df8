"""The model store: float32 tensors with their optimizer state, the version, and the
history of which coordinates each step touched (for pulls of what changed).

All methods run on the server's single store thread, so a step and a pull never
interleave: a pull always sees the model exactly at the version it reports.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from stella.wire import TensorSpec

from .kernel import KernelTensorState, union_indices
from .optim import OptimizerConfig
from .optim_ref import Push

__all__ = ["ModelStore", "Delta", "layout_diff"]


@dataclass
class Delta:
    """The answer to a pull: per tensor ``(indices or None for dense, float32 values)``."""

    version: int
    full: bool
    tensors: list[tuple[int, np.ndarray | None, np.ndarray]]


def layout_diff(have: Sequence[TensorSpec], got: Sequence[TensorSpec], limit: int = 5) -> str | None:
    """A sentence naming how ``got`` differs from ``have``, or None if identical."""
    diffs: list[str] = []
    if len(have) != len(got):
        diffs.append(f"server model has {len(have)} tensors, registration has {len(got)}")
    for i, (a, b) in enumerate(zip(have, got)):
        if a.name != b.name:
            diffs.append(f"tensor {i}: name {b.name!r} != server's {a.name!r}")
        if a.shape != b.shape:
            diffs.append(f"tensor {a.name!r}: shape {list(b.shape)} != server's {list(a.shape)}")
        if a.dtype != b.dtype:
            diffs.append(f"tensor {a.name!r}: dtype {b.dtype} != server's {a.dtype}")
    if not diffs:
        return None
    more = f" (and {len(diffs) - limit} more)" if len(diffs) > limit else ""
    return "; ".join(diffs[:limit]) + more


class ModelStore:
    """Holds the registered model. Not thread-safe: use from one thread."""

    def __init__(self, history: int = 64):
        self.layout: list[TensorSpec] | None = None
        self.tensors: list[KernelTensorState] = []
        self.optimizer: OptimizerConfig | None = None
        self.version = 0
        self.history_len = history
        # (version after the step, touched indices per tensor)
        self._history: deque[tuple[int, list[np.ndarray]]] = deque(maxlen=history)
        self._delta_cache: tuple[int, int, Delta] | None = None

    @property
    def initialised(self) -> bool:
        return self.layout is not None

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.layout or ())

    def initialise(self, layout: list[TensorSpec], values: list[np.ndarray], cfg: OptimizerConfig) -> None:
        self.tensors = [KernelTensorState(v, cfg) for v in values]
        self.layout = layout
        self.optimizer = cfg

    def apply_step(self, pushes: list[list[Push]], scale: float, cfg: OptimizerConfig) -> int:
        """Apply one step: ``pushes[t]`` are the contributions to tensor ``t``."""
        touched = []
        for state, tensor_pushes in zip(self.tensors, pushes):
            if tensor_pushes:
                touched.append(state.apply(tensor_pushes, scale, cfg))
            else:
                touched.append(np.empty(0, np.int32))
        self.optimizer = cfg
        self.version += 1
        self._history.append((self.version, touched))
        return self.version

    def delta_since(self, since: int) -> Delta:
        """Coordinates changed after version ``since`` with their current values.

        A snapshot when ``since`` is negative or older than the history kept.
        """
        v = self.version
        if self._delta_cache and self._delta_cache[:2] == (since, v):
            return self._delta_cache[2]  # every worker pulls the same delta each step
        oldest_base = self._history[0][0] - 1 if self._history else v
        if since < 0 or since < oldest_base:
            delta = Delta(v, True, [(t, None, s.snapshot()) for t, s in enumerate(self.tensors)])
        else:
            steps = [touched for after, touched in self._history if after > since]
            out = []
            for t, state in enumerate(self.tensors):
                lists = [s[t] for s in steps if s[t].size]
                if not lists:
                    continue
                idx = lists[0] if len(lists) == 1 else union_indices(lists)
                out.append((t, idx, state.gather(idx)))
            delta = Delta(v, False, out)
        self._delta_cache = (since, v, delta)
        return delta
