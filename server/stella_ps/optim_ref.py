"""NumPy reference of the lazy sparse optimizers and the merge of pushes.

This is the executable specification (docs/optimizer.md) that the C kernel is
tested against. It is written for clarity, not speed; all arithmetic is float32
except the bias-correction factors, which are computed in float64 and rounded
once to float32.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .optim import OptimizerConfig

__all__ = ["Push", "merge_pushes", "RefTensorState"]

# (indices, values): sorted unique int32 indices, or None for a dense push of all
# coordinates; values as float32 (or float16 / bfloat16-as-uint16 converted first).
Push = tuple[np.ndarray | None, np.ndarray]

F32 = np.float32


def merge_pushes(pushes: Sequence[Push], numel: int, scale: float,
                 count_scale: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Union of the pushes' indices and the scaled sum of their values there.

    Values at a coordinate are summed in push order, then multiplied once by ``scale``
    (1 / number of contributing workers), or, with ``count_scale``, by
    ``count_scale[n]``, ``n`` the pushes that carry the coordinate.
    """
    idx_list = [np.arange(numel, dtype=np.int32) if i is None else i for i, _ in pushes]
    union = np.unique(np.concatenate(idx_list)) if idx_list else np.empty(0, np.int32)
    union = union.astype(np.int32, copy=False)
    acc = np.zeros(union.shape[0], dtype=F32)
    carried = np.zeros(union.shape[0], dtype=np.int64)
    for idx, (_, vals) in zip(idx_list, pushes):
        pos = np.searchsorted(union, idx)
        acc[pos] += np.asarray(vals, dtype=F32)  # unique idx within one push: no lost adds
        carried[pos] += 1
    if count_scale is not None:
        return union, acc * np.asarray(count_scale, F32)[carried]
    return union, acc * F32(scale)


def bias_factors(cfg: OptimizerConfig, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-coordinate Adam step size lr/(1-b1^k) and sqrt(1-b2^k), float64 -> float32."""
    b1, b2 = cfg.hparams["betas"]
    kk = k.astype(np.float64)
    step_size = cfg.hparams["lr"] / (1.0 - np.power(b1, kk))
    bc2_sqrt = np.sqrt(1.0 - np.power(b2, kk))
    return step_size.astype(F32), bc2_sqrt.astype(F32)


class RefTensorState:
    """One tensor's float32 parameters and lazy optimizer state, in plain NumPy arrays."""

    def __init__(self, init: np.ndarray, cfg: OptimizerConfig):
        self.numel = int(init.size)
        self.param = np.array(init, dtype=F32).reshape(-1)
        self.name = cfg.name
        if cfg.name == "sgd":
            self.momentum_buf = np.zeros(self.numel, F32)
        else:
            self.exp_avg = np.zeros(self.numel, F32)
            self.exp_avg_sq = np.zeros(self.numel, F32)
            self.step = np.zeros(self.numel, np.uint32)

    def apply(self, pushes: Sequence[Push], scale: float, cfg: OptimizerConfig, *,
              count_scale: np.ndarray | None = None) -> np.ndarray:
        """Merge ``pushes``, apply the mean with the lazy optimizer; returns the touched indices."""
        idx, g = merge_pushes(pushes, self.numel, scale, count_scale)
        if idx.size:
            (self._sgd if cfg.name == "sgd" else self._adam)(idx, g, cfg)
        return idx

    def _sgd(self, idx: np.ndarray, g: np.ndarray, cfg: OptimizerConfig) -> None:
        h = cfg.rule().hparams
        p = self.param[idx]
        d = g
        if h["weight_decay"]:
            d = d + F32(h["weight_decay"]) * p
        if h["momentum"]:
            buf = F32(h["momentum"]) * self.momentum_buf[idx] + F32(1.0 - h["dampening"]) * d
            self.momentum_buf[idx] = buf
            d = d + F32(h["momentum"]) * buf if h["nesterov"] else buf
        self.param[idx] = p - F32(h["lr"]) * d

    def _adam(self, idx: np.ndarray, g: np.ndarray, cfg: OptimizerConfig) -> None:
        h = cfg.hparams
        b1, b2 = (F32(b) for b in h["betas"])
        k = self.step[idx] + np.uint32(1)
        self.step[idx] = k
        p = self.param[idx]
        wd = h["weight_decay"]
        if cfg.name == "adamw" and wd:
            p = p * F32(1.0 - h["lr"] * wd)
        d = g + F32(wd) * p if (cfg.name == "adam" and wd) else g
        m = b1 * self.exp_avg[idx] + (F32(1) - b1) * d
        v = b2 * self.exp_avg_sq[idx] + (F32(1) - b2) * d * d
        self.exp_avg[idx] = m
        self.exp_avg_sq[idx] = v
        step_size, bc2_sqrt = bias_factors(cfg, k)
        denom = np.sqrt(v) / bc2_sqrt + F32(h["eps"])
        self.param[idx] = p - step_size * (m / denom)

    def gather(self, idx: np.ndarray) -> np.ndarray:
        return self.param[idx]

    def snapshot(self) -> np.ndarray:
        return self.param.copy()
