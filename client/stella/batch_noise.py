"""Adam's second moment for the whole job's batch, from one worker's own (update mode,
issue 43).

In update mode each of W workers takes its own Adam step on its share of the global
batch, and the server averages the steps. Adam divides by the root of its second moment
``v``: a worker's ``v`` holds the noise of a batch W times smaller than the job's, so
where the gradient is mostly noise each worker's step is up to sqrt(W) times shorter
than the step dense Adam takes on the whole batch, and so is their mean. On the
simulation's byte LM (W = 8, every coordinate exact) the mean of eight Adam steps needs
1.37x dense's iterations; with dense's own second moment, 1.00x (bench/RESULTS.md).

A worker can measure its noise without any exchange: the gradients of the two halves of
its batch differ by noise alone, and ``((g_a - g_b) / 2) ** 2`` is an unbiased estimate
of the noise variance ``s2`` of their mean, coordinate by coordinate. Its running mean
``n`` (Adam's ``beta2``, bias-corrected by its own count) gives the second moment Adam
would keep on the job's batch, ``v' = v - (1 - 1/W) n`` (the signal is the same, the
noise W times smaller), kept at least ``v / W`` (what the whole noise spread over W
workers leaves); the worker's step is then taken with ``v'`` in place of ``v``: after
the optimizer's own step, each parameter moves by ``lr m (1 / (sqrt(v) + eps) -
1 / (sqrt(v') + eps))`` more, where ``m`` and ``v`` are Adam's bias-corrected moments.
The optimizer's state is left as it is (its ``v`` stays the worker's own, for the next
step's running mean). Estimates of the noise read off the momenta, which need no split,
worked on an MLP but not on the byte LM (its mean gradient moves from step to step more
than a momentum follows); the halves measure it on both.

The training loop computes the two halves' gradients, one after the other, and says
where the first ends: ``loss(first half) / 2``, ``backward()``, :meth:`mark_half`,
``loss(second half) / 2``, ``backward()``, ``step()`` (or any gradient accumulation of
an even number of micro-batches, marked after the first half of them). A clip of the
gradient between the backward passes and the step (``clip_grad_norm_``, a Trainer's
``max_grad_norm``) scales what Adam sees, and the noise with it: a hook notes each
parameter's whole gradient's norm after the backward passes, and the step reads the clip's
factor off the norm it finds. The cost: two copies of the parameters' size (the first
half's gradient, the noise's running mean), a norm per parameter per backward pass after
the mark, and a few element-wise passes a step.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["BatchNoise"]


class BatchNoise:
    """The correction of one worker's Adam step to the step Adam would take on ``world``
    times its batch (the module doc). ``world``: the Adam steps the server's mean
    averages, the job's workers (each rank of a site counting as one)."""

    def __init__(self, world: int):
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ValueError(f"world must be an int >= 1, got {world!r}")
        self.world = world
        self._half: dict[torch.Tensor, torch.Tensor] = {}  # each parameter's gradient after the first half
        self._noise: dict[torch.Tensor, tuple[torch.Tensor, int]] = {}  # running mean of the noise, its count
        # each parameter's whole gradient's norm as the backward passes after the mark left it (a hook's), before
        # anything scaled it: a clip between the backward and the step (the Trainer's max_grad_norm) is read off it
        self._total_norm: dict[torch.Tensor, torch.Tensor] = {}
        self._hooked: set[torch.Tensor] = set()
        self._marked = False

    @staticmethod
    def check(optimizer: torch.optim.Optimizer) -> None:
        """Refuse an optimizer whose step is not Adam's ``m / (sqrt(v) + eps)``."""
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise ValueError(f"BatchNoise corrects an Adam or AdamW step, not {type(optimizer).__name__}")
        for group in optimizer.param_groups:
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError("BatchNoise: amsgrad and maximize are not supported")

    @torch.no_grad()
    def mark_half(self, params: list[torch.Tensor]) -> None:
        """The first half's gradients are in ``params``' ``.grad`` now: keep them."""
        self._total_norm.clear()
        for p in params:
            if p not in self._hooked and p.requires_grad:
                p.register_post_accumulate_grad_hook(self._after_backward)
                self._hooked.add(p)
            if p.grad is None:
                self._half.pop(p, None)
                continue
            kept = self._half.get(p)
            if kept is None or kept.shape != p.grad.shape or kept.dtype != p.grad.dtype:
                self._half[p] = p.grad.detach().clone()
            else:
                kept.copy_(p.grad)
        self._marked = True

    @torch.no_grad()
    def _after_backward(self, p: torch.Tensor) -> None:
        """A backward pass added to ``p.grad``: after the mark, note the whole gradient's norm."""
        if self._marked and p.grad is not None:
            self._total_norm[p] = torch.linalg.vector_norm(p.grad)

    def state(self, params: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """The running noise of each of ``params`` (by name) and its count, for a worker
        checkpoint (:meth:`load` takes it back)."""
        noise = {}
        for name, p in params.items():
            got = self._noise.get(p)
            if got is not None:
                noise[name] = {"noise": got[0].detach().clone(), "count": got[1]}
        return {"world": self.world, "noise": noise}

    @torch.no_grad()
    def load(self, params: Mapping[str, torch.Tensor], state: Mapping[str, Any]) -> None:
        """Take back :meth:`state`'s running noise for the parameters of the same names
        (one of another shape is refused, and nothing is loaded)."""
        loaded = {}
        for name, entry in dict(state.get("noise", {})).items():
            p = params.get(name)
            if p is None:
                continue
            noise = torch.as_tensor(entry["noise"])
            if noise.shape != p.shape:
                raise ValueError(f"batch noise of {name!r}: shape {tuple(noise.shape)}, the parameter's "
                                 f"{tuple(p.shape)}")
            loaded[p] = (noise.to(device=p.device, dtype=p.dtype).clone(), int(entry["count"]))
        self._noise.update(loaded)

    @torch.no_grad()
    def correct(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``optimizer.step()`` on the whole batch's gradient (both halves): add
        the noise the halves show to its running mean and move each parameter as the step
        with the job's second moment would have (the module doc)."""
        if not self._marked:
            raise RuntimeError("BatchNoise: call mark_half() between the two halves' backward passes")
        self._marked = False
        keep = 1.0 - 1.0 / self.world
        for group in optimizer.param_groups:
            b1, b2 = group["betas"]
            lr, eps = float(group["lr"]), group["eps"]
            for p in group["params"]:
                half, st, total = self._half.get(p), optimizer.state.get(p), self._total_norm.get(p)
                if p.grad is None or half is None or total is None or not st or "exp_avg_sq" not in st:
                    continue
                # the step's gradient is the whole one times c (1, or a clip's factor): the noise of what Adam
                # saw is c times that of the halves
                now = torch.linalg.vector_norm(p.grad)
                c = torch.where(total > 0, now / total, torch.ones_like(total))
                # c (g_a - g_b) / 2: the gradient holds c (g_a + g_b) / 2, the kept first half g_a / 2
                diff = half.mul_(2 * c).sub_(p.grad)
                noise, count = self._noise.get(p, (None, 0))
                if noise is None:
                    noise = torch.zeros_like(diff)
                noise.mul_(b2).addcmul_(diff, diff, value=1 - b2)
                count += 1
                self._total_norm.pop(p)
                self._noise[p] = (noise, count)
                if self.world == 1:
                    continue
                t = float(st["step"])
                vh = st["exp_avg_sq"] / (1 - b2 ** t)
                job = torch.maximum(vh - noise * (keep / (1 - b2 ** count)), vh / self.world)
                more = (vh.sqrt_().add_(eps).reciprocal_()).sub_(job.sqrt_().add_(eps).reciprocal_())
                p.add_(st["exp_avg"] * more, alpha=lr / (1 - b1 ** t))
