"""The training modes and update mode's outer-optimizer presets, as plain data.

No torch here, so that ``stella status`` can name a job's mode and outer step without
importing it; :mod:`stella.pipeline` re-exports these names (``docs/optimizer.md`` has
the modes' exact rules).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .protocol import TrainingMode

__all__ = ["Mode", "MODES", "DEFAULT_MODE", "OUTER_PRESETS", "DEFAULT_OUTER", "outer_preset"]

Mode = TrainingMode  # "update" or "gradient", declared once, with the wire schema
MODES: tuple[Mode, ...] = ("update", "gradient")
DEFAULT_MODE: Mode = "update"

# The server's outer optimizer in update mode. "average": the new model is the mean of
# the workers' weights (SGD with lr 1 on the mean pseudo-gradient). "count": a coordinate
# that n of the step's K pushes carried enters the mean times (K / n) ** 0.5
# (count_exponent 0.5): every push carried it, the mean; one push alone, sqrt(K) times its
# share. "sqrt": the whole mean times sqrt(K) (lr_worker_exponent 0.5): what the mean of K
# adaptive inner optimizers' steps loses against one dense step on their whole batch.
# "tapered": "count" on a step whose pushes are at most 2% dense, the mean from 10%, the
# exponent tapering in log density between (count_taper_from, count_taper_to): the server
# measures each step's density, so the rule follows what the adaptive density picks.
# "nesterov": DiLoCo's outer step (lr 0.7, Nesterov momentum 0.9; the buffer is updated
# where the mean pseudo-gradient has coordinates). DEFAULT_OUTER, "auto", is "tapered" over
# an adaptive inner optimizer (anything but SGD) and "average" over SGD, whose mean step is
# the dense step (stella._exchange.auto_outer; docs/optimizer.md, "The outer step follows
# the density").
OUTER_PRESETS: dict[str, dict[str, Any]] = {
    "average": {"name": "sgd", "lr": 1.0},
    "sqrt": {"name": "sgd", "lr": 1.0, "lr_worker_exponent": 0.5},
    "count": {"name": "sgd", "lr": 1.0, "count_exponent": 0.5},
    "tapered": {"name": "sgd", "lr": 1.0, "count_exponent": 0.5, "count_taper_from": 0.02, "count_taper_to": 0.1},
    "nesterov": {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True, "momentum_mode": "lazy"},
}


DEFAULT_OUTER = "auto"


def outer_preset(config: Mapping[str, Any]) -> str | None:
    """The name of the preset an outer optimizer config is, or None.

    ``config`` is the server's full config (it fills in every hyper-parameter), so a
    preset matches when each key it names has its value and every other number or flag
    is off (0 or False: it changes nothing). Other strings are not compared: a string
    only says how another hyper-parameter works (``momentum_mode`` without momentum).
    """
    for name, preset in OUTER_PRESETS.items():
        if all(config.get(k) == v for k, v in preset.items()) and not any(
                v for k, v in config.items() if k not in preset and not isinstance(v, str)):
            return name
    return None
