"""What a :class:`~stella.StellaOptimizer` is told, in three groups, each checked when
it is made: how pushes are compressed (:class:`Compression`), when a worker exchanges
(:class:`Sync`), and how it reaches the server (:class:`Connection`). A mode's own
rules (which fields it takes) are checked by its exchange (:mod:`stella._exchange`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, get_args

from .codec import VALUE_DTYPES
from .compress import METHODS
from .protocol import IndexCoding, ValueDtype

__all__ = ["Compression", "Sync", "Connection", "removed_keyword"]

def _count(name: str, v: Any, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")


@dataclass(frozen=True)
class Compression:
    """How pushes are compressed (``docs/compression.md``).

    ``density``: the fraction of each tensor pushed per exchange, or ``"auto"``
    (default): chosen each round by the worker's :class:`~stella.adapt.Controller`
    between ``min_density`` and ``max_density``, so that the exchange hides behind the
    computation. ``method`` ("threshold", "block", "exact" or "dense"): the compressor,
    :mod:`stella.compress`. Which small tensors go whole is the server's
    (``stella-ps --dense-below``: the model's flat layout, :mod:`stella.layout`).
    ``value_dtype``: the wire coding of pushed values, or ``"auto"`` (default): the
    controller picks among f16, q4 and q2 (4.5 or 2.5 bits a value, the quantisation
    error kept in the residual); a coding pins it. ``index_coding``: the indices'.
    ``per_tensor``: each large tensor gets its own share of a push (``density`` times
    its size, one selection per tensor) instead of one top-k over the whole flat model
    (default, one selection: a tensor of large values may take more than its share).
    ``moment_power`` (update mode): a push takes the coordinates of largest ``|unsent
    change| x s ** (2 P)``, ``s`` the gradient's scale from the inner optimizer's state,
    so that among changes of one size those whose gradients are larger (worth more of
    the loss) go first; ``"auto"`` (default): 0.25 where the inner optimizer keeps Adam's
    moments (Adam, AdamW) and the job has at least 4 workers pushing, plain magnitudes
    otherwise; 0: plain magnitudes (the rule before; docs/optimizer.md "The push's
    selection"). ``moment``: which scale: ``"mean"`` (default) ``|exp_avg| + eps``, the
    gradient's mean (its signal), or ``"second"`` ``sqrt(exp_avg_sq + eps^2)``, its root
    mean square (signal and noise: the rule of 2026-12-05, which needed 6% more
    iterations at eight workers).
    """

    density: float | Literal["auto"] = "auto"
    min_density: float = 0.001
    max_density: float = 0.1
    method: str = "threshold"
    value_dtype: ValueDtype | Literal["auto"] = "auto"
    index_coding: IndexCoding = "rice"
    per_tensor: bool = False
    moment_power: float | Literal["auto"] = "auto"
    moment: Literal["mean", "second"] = "mean"

    def __post_init__(self) -> None:
        if isinstance(self.density, str):
            if self.density != "auto":
                raise ValueError(f"density must be a number or 'auto', got {self.density!r}")
        elif not 0.0 < self.density <= 1.0:  # NaN too
            raise ValueError(f"density must be in (0, 1] or 'auto', got {self.density!r}")
        if not 0.0 < self.min_density <= self.max_density <= 1.0:
            raise ValueError(f"need 0 < min_density <= max_density <= 1, got {self.min_density}, {self.max_density}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.value_dtype != "auto" and self.value_dtype not in VALUE_DTYPES:
            raise ValueError(f"value_dtype must be 'auto' or one of {VALUE_DTYPES}, got {self.value_dtype!r}")
        if isinstance(self.moment_power, str):
            if self.moment_power != "auto":
                raise ValueError(f"moment_power must be a number in [0, 1] or 'auto', got {self.moment_power!r}")
        elif isinstance(self.moment_power, bool) or not 0.0 <= self.moment_power <= 1.0:  # NaN too
            raise ValueError(f"moment_power must be a number in [0, 1] or 'auto', got {self.moment_power!r}")
        if self.moment not in ("mean", "second"):
            raise ValueError(f"moment must be 'mean' or 'second', got {self.moment!r}")
        if self.index_coding not in get_args(IndexCoding):
            raise ValueError(f"index_coding must be one of {get_args(IndexCoding)}, got {self.index_coding!r}")


@dataclass(frozen=True)
class Sync:
    """When a worker exchanges (``docs/optimizer.md``).

    ``every``: update mode's local steps per exchange (H; 1 = every step): the least a
    round makes. ``"auto"``: the worker chooses that least, from 1 to ``max_every``, by
    what a round costs it against a step's compute and what a local step more costs in
    iterations (:func:`stella.adapt.local_steps`; a site's leader chooses for its ranks).
    ``max_every`` (update mode; None: ``4 * every``, 4 for ``"auto"``): while the exchange
    in flight is not done, a round runs on with more local steps, up to this many, instead
    of waiting; ``= every`` pins H. ``max_accumulate`` (gradient mode; 1, off by
    default): the same with micro-batches, whose gradients are averaged into one push (a
    larger batch). Off by default because the server's optimizer then takes fewer steps
    per sample: on digits (dense SGD, momentum 0.9) up to 4 micro-batches per step
    needed about twice the samples to reach an accuracy; turn it on where a slow link or
    a slower peer would otherwise idle the workers. Either way each push carries the
    samples it represents (``batch_size`` per step, or one per step when None) and the
    server weights the step's pushes by them, so workers of different speeds each
    compute what fits in a round and none idles.

    ``staleness``: 1 (overlapped: the exchange of round r runs while round r+1
    computes) or 0 (each exchange finishes inside the ``step()`` that starts it; the
    non-overlapped baseline).
    """

    every: int | Literal["auto"] = 1
    max_every: int | None = None
    max_accumulate: int = 1
    batch_size: int | None = None
    staleness: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.every, str) and self.every != "auto":
            raise ValueError(f"every must be an integer >= 1 or 'auto', got {self.every!r}")
        if self.every != "auto":
            _count("every", self.every, 1)
        if self.max_every is not None:
            _count("max_every", self.max_every, 1 if self.every == "auto" else self.every)
        _count("max_accumulate", self.max_accumulate, 1)
        if self.batch_size is not None:
            _count("batch_size", self.batch_size, 1)
        if self.staleness not in (0, 1) or isinstance(self.staleness, bool):
            raise ValueError(f"staleness must be 0 or 1, got {self.staleness!r}")


@dataclass(frozen=True)
class Connection:
    """How a worker reaches ``stella-ps`` (the keyword arguments of
    :class:`~stella.Client`): ``timeout`` of each call (None: ``STELLA_TIMEOUT`` or its
    default), the worker's ``name`` in ``stella status``, a ``worker_id`` to ask for, and
    the CurveZMQ keys (None: ``STELLA_SERVER_KEY`` / ``STELLA_CLIENT_KEY``)."""

    timeout: float | None = None
    name: str = ""
    worker_id: int | None = None
    server_key: str | None = None
    client_key: str | None = None

    def client_kwargs(self) -> dict[str, Any]:
        return asdict(self)


# The keyword arguments StellaOptimizer took before these groups, and where each went.
_MOVED = {**{f.name: ("compression", "Compression", f.name) for f in fields(Compression)},
          **{f.name: ("connection", "Connection", f.name) for f in fields(Connection)},
          "sync_every": ("sync", "Sync", "every"), "max_sync_every": ("sync", "Sync", "max_every"),
          **{k: ("sync", "Sync", k) for k in ("max_accumulate", "batch_size", "staleness")}}
# ... and those that went, with why
_GONE = {"compress_in_backward": "the flat compressor selects over every tensor in one pass once backward is done "
                                 "(stella.flat): there is no per-tensor compression to start early"}


def removed_keyword(owner: str, kwargs: dict[str, Any]) -> TypeError | None:
    """The error for keyword arguments ``owner`` no longer takes, naming the new
    spelling of each that moved into a group (None when ``kwargs`` is empty)."""
    if not kwargs:
        return None
    gone = next((k for k in kwargs if k in _GONE), None)
    if gone is not None:
        return TypeError(f"{owner}() takes no {gone}= any more: {_GONE[gone]}")
    moved = [k for k in kwargs if k in _MOVED]
    if len(moved) < len(kwargs):
        unknown = next(k for k in kwargs if k not in _MOVED)
        if unknown == "client":
            return TypeError(f"{owner}() takes a connected client as its address: {owner}(model, client, ...)")
        return TypeError(f"{owner}() got an unexpected keyword argument {unknown!r}")
    groups: dict[str, list[str]] = {}
    for k in moved:
        arg, cls, name = _MOVED[k]
        groups.setdefault(f"{arg}=stella.{cls}", []).append(f"{name}=...")
    spelled = ", ".join(f"{g}({', '.join(v)})" for g, v in groups.items())
    return TypeError(f"{owner}() no longer takes {', '.join(f'{k}=' for k in moved)} of its own: pass {spelled}")
