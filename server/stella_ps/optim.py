"""Optimizer configuration: names, PyTorch hyper-parameter names and defaults, validation.

The server's optimizers are *lazy*: only coordinates present in a step's aggregated
update change (parameter and state). The exact per-coordinate rules, shared by the
C kernel and the NumPy reference (``optim_ref``), are in ``docs/optimizer.md``.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

__all__ = ["OptimizerConfig", "OptimizerLimits", "OPTIMIZERS", "MOMENTUM_MODES", "ConfigError"]

# PyTorch's names and defaults (torch.optim.SGD / Adam / AdamW), plus Stella's
# ``momentum_mode`` for SGD (see MOMENTUM_MODES), ``lr_worker_exponent`` (a step of K
# pushes runs at lr * K ** lr_worker_exponent: 0, the mean; 0.5, update mode's "sqrt"
# outer step over adaptive inner optimizers) and ``count_exponent`` (a coordinate n of
# the K pushes carried enters the mean times (K / n) ** count_exponent: update mode's
# "count" outer step; :func:`stella_ps.aggregation.count_table`; docs/optimizer.md), which
# ``count_taper_from`` and ``count_taper_to`` taper to 0 as the step's pushes grow denser
# between the two densities (both 0: no taper; update mode's "tapered" outer step;
# :func:`stella_ps.aggregation.count_exponent_at`).
OPTIMIZERS: dict[str, dict[str, Any]] = {
    "sgd": {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False,
            "momentum_mode": "fold", "lr_worker_exponent": 0.0, "count_exponent": 0.0,
            "count_taper_from": 0.0, "count_taper_to": 0.0},
    "adam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    "adamw": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2},
}


# How SGD momentum meets sparse, error-feedback updates (docs/optimizer.md):
#   "fold": no momentum buffer; a touched coordinate moves by lr * (1 - dampening) / (1 - momentum)
#           times its update, the long-run gain of the momentum filter. The workers' error-feedback
#           residuals already do the accumulating a momentum buffer does, and a lazy buffer of a
#           rarely touched coordinate would apply a gradient impulse at 1/(1 - momentum) of the
#           dense step, the rest delayed to later touches (measured: 2x the iterations at 1%).
#   "lazy": a per-coordinate momentum buffer updated on touch only (PyTorch's SGD rule applied lazily).
MOMENTUM_MODES = ("fold", "lazy")


# The kernel computes in float32: every hyper-parameter, and every product of them the
# kernel forms, must be finite (and nonzero where it divides) there.
F32_MAX = 3.4028234663852886e38
F32_TINY = 1.1754943508222875e-38  # the smallest positive normal float32


def f32(x: float) -> float:
    """``x`` rounded to float32, as the kernel holds it."""
    return float(struct.unpack("f", struct.pack("f", x))[0])


def _num(name: str, x: Any, lo: float = 0.0, hi: float = F32_MAX, *, lo_open: bool = False,
         hi_open: bool = False) -> float:
    """``x`` as a float inside its range (``lo``/``hi`` closed unless said open)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ConfigError(f"{name} must be a number, got {type(x).__name__}")
    v = float(x)
    if (not math.isfinite(v) or (v <= lo if lo_open else v < lo) or (v >= hi if hi_open else v > hi)):
        bound = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise ConfigError(f"{name}={v:g} is outside {bound}")
    return v


@dataclass(frozen=True)
class OptimizerConfig:
    """A validated optimizer: ``name`` in :data:`OPTIMIZERS` and its full hyper-parameters."""

    name: str
    hparams: dict[str, Any] = field(default_factory=dict)
    _per_count: dict[int, OptimizerConfig] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_wire(cls, obj: Any) -> OptimizerConfig:
        """Validate ``{"name": ..., <hyper-parameter>: value, ...}`` from the network."""
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ConfigError("optimizer must be a map with a string 'name'")
        name = obj["name"].lower()
        if name not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {obj['name']!r}; known: {sorted(OPTIMIZERS)}")
        return cls(name, {}).updated({k: v for k, v in obj.items() if k != "name"})

    def updated(self, changes: dict[str, Any]) -> OptimizerConfig:
        """A copy with some hyper-parameters changed (used for learning-rate schedules)."""
        defaults = OPTIMIZERS[self.name]
        unknown = sorted(set(changes) - set(defaults))
        if unknown:
            raise ConfigError(f"unknown hyper-parameter(s) {unknown} for {self.name}; known: {sorted(defaults)}")
        hp = {**defaults, **self.hparams, **changes}
        out: dict[str, Any] = {"lr": _num("lr", hp["lr"])}
        out["weight_decay"] = _num("weight_decay", hp["weight_decay"])
        if self.name == "sgd":
            # momentum 1 never forgets (and folds to an infinite gain); dampening above 1
            # would make steps climb the gradient
            out["momentum"] = _num("momentum", hp["momentum"], 0.0, 1.0, hi_open=True)
            out["dampening"] = _num("dampening", hp["dampening"], 0.0, 1.0)
            if not isinstance(hp["nesterov"], bool):
                raise ConfigError("nesterov must be a bool")
            out["nesterov"] = hp["nesterov"]
            if out["nesterov"] and (out["momentum"] <= 0 or out["dampening"] != 0):
                raise ConfigError("nesterov momentum requires momentum > 0 and dampening = 0")
            if hp["momentum_mode"] not in MOMENTUM_MODES:
                raise ConfigError(f"momentum_mode must be one of {list(MOMENTUM_MODES)}, got {hp['momentum_mode']!r}")
            out["momentum_mode"] = hp["momentum_mode"]
            out["lr_worker_exponent"] = _num("lr_worker_exponent", hp["lr_worker_exponent"], 0.0, 1.0)
            out["count_exponent"] = _num("count_exponent", hp["count_exponent"], 0.0, 1.0)
            if out["lr_worker_exponent"] + out["count_exponent"] > 1.0:
                # a lone push moves its coordinates by lr K ** (both - 1) times its value: at most lr
                raise ConfigError(f"lr_worker_exponent + count_exponent = "
                                  f"{out['lr_worker_exponent'] + out['count_exponent']:g} is above 1 (a push "
                                  "alone would move the model further than lr times itself)")
            lo = out["count_taper_from"] = _num("count_taper_from", hp["count_taper_from"], 0.0, 1.0)
            hi = out["count_taper_to"] = _num("count_taper_to", hp["count_taper_to"], 0.0, 1.0)
            if (lo or hi) and not 0.0 < lo < hi:
                raise ConfigError(f"count_taper_from={lo:g} and count_taper_to={hi:g}: need 0 < from < to <= 1, "
                                  "or both 0 (no taper)")
            if f32(out["momentum"]) >= 1.0:
                raise ConfigError(f"momentum={out['momentum']!r} is 1 in float32, the kernel's precision")
            lr = out["lr"]
            if out["momentum_mode"] == "fold" and out["momentum"]:
                lr = lr * (1.0 - out["dampening"]) / (1.0 - out["momentum"])  # the folded step (rule())
                if lr > F32_MAX:
                    raise ConfigError(f"lr * (1 - dampening) / (1 - momentum) = {lr:g}, the folded step, overflows "
                                      "float32")
            if lr * out["weight_decay"] > F32_MAX:  # the kernel forms lr * (g + weight_decay * p)
                raise ConfigError(f"lr * weight_decay = {lr * out['weight_decay']:g} overflows float32")
        else:
            b = hp["betas"]
            if not isinstance(b, (list, tuple)) or len(b) != 2:
                raise ConfigError("betas must be a pair")
            out["betas"] = tuple(_num(f"betas[{i}]", b[i], 0.0, 1.0, hi_open=True) for i in (0, 1))
            for i, beta in enumerate(out["betas"]):
                if f32(beta) >= 1.0:  # 1 - beta would be 0 in the kernel's float32
                    raise ConfigError(f"betas[{i}]={beta!r} is 1 in float32, the kernel's precision")
            # eps = 0 divides 0 by 0; a subnormal (or one that underflows to 0) in float32 is no better
            out["eps"] = _num("eps", hp["eps"], 0.0, lo_open=True)
            if f32(out["eps"]) < F32_TINY:
                raise ConfigError(f"eps={out['eps']:g} is below the smallest normal float32 ({F32_TINY:g}), the "
                                  "kernel's precision")
            first = out["lr"] / (1.0 - out["betas"][0])  # the first step's bias-corrected step size
            if first > F32_MAX:
                raise ConfigError(f"lr / (1 - betas[0]) = {first:g}, the first step's size, overflows float32")
            if self.name == "adamw" and out["lr"] * out["weight_decay"] > 1.0:
                # AdamW multiplies a touched parameter by 1 - lr * weight_decay
                raise ConfigError(f"lr * weight_decay = {out['lr'] * out['weight_decay']} > 1 flips the "
                                  "parameters' sign at every step")
        return OptimizerConfig(self.name, out)

    def for_pushes(self, count: int) -> OptimizerConfig:
        """The configuration a step of ``count`` pushes runs: SGD's ``lr`` times
        ``count ** lr_worker_exponent`` (itself when the exponent is 0 or ``count`` <= 1).
        The same object for the same count, so the kernel keeps its converted copy.

        In update mode the outer step averages K pseudo-gradients that adaptive inner
        optimizers (Adam, AdamW) each normalised on their own share of the batch: their
        noise shrinks in the mean by about sqrt(K), their signal does not, and the mean
        moves the model about sqrt(K) times less than one dense Adam step on the whole
        batch. An exponent of 0.5 gives that back (docs/optimizer.md, "The outer step's
        scale"). The operator's ``--max-lr`` bounds ``lr`` as given, before the factor."""
        exp = self.hparams.get("lr_worker_exponent", 0.0)
        if not exp or count <= 1:
            return self
        done = self._per_count.get(count)
        if done is None:
            lr = self.hparams["lr"] * float(count) ** exp
            done = self._per_count[count] = OptimizerConfig(self.name, {**self.hparams, "lr": lr})
        return done

    def rule(self) -> OptimizerConfig:
        """The configuration the update rule really runs: SGD with ``momentum_mode="fold"``
        becomes momentum-free SGD at the folded learning rate (float64, rounded to float32
        once by the kernel and the reference alike)."""
        h = self.hparams
        if self.name != "sgd" or h["momentum_mode"] != "fold" or not h["momentum"]:
            return self
        lr = h["lr"] * (1.0 - h["dampening"]) / (1.0 - h["momentum"])
        return OptimizerConfig("sgd", {**h, "lr": lr, "momentum": 0.0, "dampening": 0.0, "nesterov": False})

    def push_gain(self) -> float | None:
        """How far one push moves a coordinate per unit of its value, over every step it
        takes part in: SGD's ``lr * (1 - dampening) / (1 - momentum)`` (the folded step;
        a lazy momentum buffer, Nesterov's too, adds up to the same), whatever the
        training mode (gradient mode's SGD, or update mode's outer step). None for Adam
        and AdamW: their step is about ``lr`` whatever the push's size (the push-norm
        bound relative to the model, :class:`~stella_ps.aggregation.PushNormBound`, needs a gain)."""
        if self.name != "sgd":
            return None
        h = self.hparams
        return float(h["lr"] * (1.0 - h["dampening"]) / (1.0 - h["momentum"]))

    def to_wire(self) -> dict[str, Any]:
        d = {"name": self.name, **self.hparams}
        if "betas" in d:
            d["betas"] = list(d["betas"])
        return d


@dataclass(frozen=True)
class OptimizerLimits:
    """Bounds the operator sets on hyper-parameters (``stella-ps --max-lr``,
    ``--max-weight-decay``), checked beside the mathematical ranges of
    :meth:`OptimizerConfig.updated` whenever a configuration is made: a registration,
    ``set_optimizer``, the ``hparams`` of a push, and the server's own default.

    ``max_lr`` bounds ``lr`` as PyTorch names it (SGD's folded momentum moves a
    coordinate by ``lr / (1 - momentum)``; ``momentum`` itself is only kept below 1);
    ``min_eps`` bounds Adam's ``eps`` from below (a tiny ``eps`` turns a gradient whose
    square underflows into a step of ``lr * m / eps``). None: no bound."""

    max_lr: float | None = None
    max_weight_decay: float | None = None
    min_eps: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_lr", "max_weight_decay", "min_eps"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"{name} must be a finite number >= 0, got {v!r}")

    def check(self, cfg: OptimizerConfig) -> OptimizerConfig:
        """``cfg`` if inside the bounds; raises :class:`ConfigError` naming the bound."""
        h = cfg.hparams
        if self.max_lr is not None and h["lr"] > self.max_lr:
            raise ConfigError(f"lr={h['lr']:g} is above the server's limit {self.max_lr:g} (--max-lr)")
        if self.max_weight_decay is not None and h["weight_decay"] > self.max_weight_decay:
            raise ConfigError(f"weight_decay={h['weight_decay']:g} is above the server's limit "
                              f"{self.max_weight_decay:g} (--max-weight-decay)")
        if self.min_eps is not None and "eps" in h and h["eps"] < self.min_eps:
            raise ConfigError(f"eps={h['eps']:g} is below the server's limit {self.min_eps:g} (--min-eps)")
        return cfg
