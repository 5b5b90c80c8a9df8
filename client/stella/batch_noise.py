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

Where the halves come from. A step whose gradient is accumulated over k >= 2 backward
passes (a Trainer's, Lightning's or Accelerate's gradient accumulation, or any loop's)
splits itself: a hook on each parameter counts its backward passes and keeps its
gradient after the first ``a = k // 2`` of them (k read off the step before: the first
step keeps nothing and takes no sample, and a loop of one backward pass a step never
keeps a copy). A step takes a sample only when it is as long as the one before: one that
ran on from a step skipped without :meth:`correct` (GradScaler's, when the gradient
overflowed: its passes and kept gradient would count into the next) does not. With
``H`` the kept gradient and ``G`` the whole one, the a passes' and the other ``b = k - a``
passes' means differ by noise alone, and ``(a / b) (H (a + b) / a
- G) ** 2`` is an unbiased estimate of the noise variance of ``G`` (for ``a = b``:
``(2 H - G) ** 2 = ((g_a - g_b) / 2) ** 2``), whatever the loss's scale. A loop of one
backward pass a step splits its batch in two and says where the first half ends:
``loss(first half) / 2``, ``backward()``, :meth:`mark_half`, ``loss(second half) / 2``,
``backward()``, ``step()`` (a mark, when given, takes the place of the count: two equal
halves). A step with neither takes no sample (its correction uses the running noise, when
there is one); successive steps' gradients are no substitute: on the byte LM they differ
by far more than the noise (bench/RESULTS.md).

A clip of the gradient between the backward passes and the step (``clip_grad_norm_``, a
Trainer's ``max_grad_norm``) scales what Adam sees, and the noise with it: the hook notes
each parameter's gradient's norm after each backward pass past the split, and the step
reads the clip's factor off the norm it finds. The cost: two copies of the parameters'
size (the kept gradient, the noise's running mean); at the end of a backward pass (the
autograd engine's queued callback) one multi-tensor copy or norm of the gradients due;
a few multi-tensor element-wise passes a step.
"""
from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["BatchNoise"]


def _noise_dtype(dtype: torch.dtype) -> torch.dtype:
    """The running noise's dtype: at least float32 (in bf16 or f16, ``beta2`` = 0.999 times a
    value rounds back to the value, and an EMA never moves)."""
    return torch.promote_types(dtype, torch.float32)


_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)  # (torch >= 2.3)


def _on_host(t: torch.Tensor) -> bool:
    """Whether reading ``t`` costs no wait for a device."""
    return t.device.type == "cpu"


def _in_compiled_backward() -> bool:
    """Whether compiled autograd is running a backward pass (its graph calls the hooks)."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return ca is not None and bool(ca.in_compiled_autograd_region)


class BatchNoise:
    """The correction of one worker's Adam step to the step Adam would take on ``world``
    times its batch (the module doc). ``world``: the Adam steps the server's mean
    averages, the job's workers (each rank of a site counting as one); None: read off the
    server, the pushes its latest step combined times the site's ranks, as each round's
    answer tells it (1, no correction, until the first answer; a job whose workers come
    and go follows them). ``warn``: say so when three steps in a row had no halves (the
    optimizer's default BatchNoise does not: a loop without them simply goes uncorrected).

    The optimizer wrapper (``StellaOptimizer(batch_noise=...)``) attaches it to its
    parameters and calls :meth:`correct` after each local step; used on its own, call
    :meth:`attach` before the first backward pass and :meth:`correct` after each
    ``optimizer.step()``."""

    def __init__(self, world: int | None = None, *, warn: bool = True):
        if world is not None and (isinstance(world, bool) or not isinstance(world, int) or world < 1):
            raise ValueError(f"world must be an int >= 1 or None (the server's), got {world!r}")
        self.world = 1 if world is None else world
        self.follows_server = world is None
        self._passes: dict[torch.Tensor, int] = {}  # backward passes into each parameter's gradient this step
        self._split: dict[torch.Tensor, int] = {}  # the pass after which each one's gradient is kept (k // 2)
        self._length: dict[torch.Tensor, int] = {}  # each one's backward passes in the step before
        self._half: dict[torch.Tensor, tuple[torch.Tensor, int]] = {}  # that gradient, and the passes it holds
        self._kept: set[torch.Tensor] = set()  # the parameters whose gradient was kept this step
        self._noise: dict[torch.Tensor, tuple[torch.Tensor, int]] = {}  # running mean of the noise, its count
        # each parameter's whole gradient's norm as the backward passes after the split left it (the hook's),
        # before anything scaled it: a clip between the backward and the step is read off it
        self._total_norm: dict[torch.Tensor, torch.Tensor] = {}
        self._hooked: dict[torch.Tensor, Any] = {}  # each parameter's hook's handle
        # compiled autograd traced the hooks (Dynamo compiling the backward pass): they did nothing there, and
        # correct() puts hooks Dynamo leaves out of its graphs in their place (_compiled)
        self._traced = False
        self._compiled = False
        self._marked = False  # mark_half() this step: two equal halves, the passes not counted
        self._unsplit = 0  # steps in a row without halves (a warning after a few, when ``warn``)
        # what the backward pass under way owes its end (_end_of_pass): gradients to keep, norms to note
        self._due_keep: list[tuple[torch.Tensor, int]] = []
        self._due_norm: list[torch.Tensor] = []
        self._queued = False
        # Adam's step count for the parameters whose count lives on a device (fused, capturable): the tensor
        # it was read off, and the count (_step_of)
        self._device_steps: dict[torch.Tensor, tuple[torch.Tensor, float]] = {}
        self.warn = warn

    @staticmethod
    def fits(optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s step is one this corrects (:meth:`check` without the error)."""
        try:
            BatchNoise.check(optimizer)
        except ValueError:
            return False
        return True

    @staticmethod
    def check(optimizer: torch.optim.Optimizer) -> None:
        """Refuse an optimizer whose step is not Adam's ``m / (sqrt(v) + eps)``."""
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise ValueError(f"BatchNoise corrects an Adam or AdamW step, not {type(optimizer).__name__}")
        for group in optimizer.param_groups:
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError("BatchNoise: amsgrad and maximize are not supported")

    def job_size(self, workers: int) -> None:
        """The server's latest step combined the steps of ``workers`` ranks: the world,
        when it follows the server (0: not said, nothing changes)."""
        if self.follows_server and workers >= 1:
            self.world = int(workers)

    def attach(self, params: Iterable[torch.Tensor]) -> None:
        """Count the backward passes into ``params``' gradients from now on (a hook on
        each; attaching twice is once)."""
        for p in params:
            if p not in self._hooked and p.requires_grad:
                self._hooked[p] = p.register_post_accumulate_grad_hook(self._hook())

    def _hook(self) -> Any:
        """The hook on each parameter: :meth:`_after_backward`, or once compiled autograd
        traced it, the same kept out of Dynamo's graphs (run as it is, in the graph's
        place: compiled autograd calls a parameter's hooks from its graph)."""
        if not self._compiled:
            return self._after_backward
        import torch._dynamo  # (imported already: compiled autograd traced the hooks)

        return torch._dynamo.disable(self._after_backward)

    def _retrace(self) -> None:
        """Compiled autograd traced the hooks: hook each parameter again with the hook it
        leaves out of its graphs (the step traced went unmeasured)."""
        self._traced = False
        self._compiled = True
        hook = self._hook()
        for p, handle in self._hooked.items():
            handle.remove()
            self._hooked[p] = p.register_post_accumulate_grad_hook(hook)

    @torch.no_grad()
    def mark_half(self, params: list[torch.Tensor]) -> None:
        """The first half's gradients are in ``params``' ``.grad`` now: keep them (this
        step's split, in place of the count of backward passes)."""
        self.attach(params)
        self._total_norm.clear()
        for p in params:
            if p.grad is None:
                self._kept.discard(p)
        self._keep([(p, 1) for p in params])
        self._marked = True

    def _keep(self, due: list[tuple[torch.Tensor, int]]) -> None:
        """Keep each ``(p, passes)``'s gradient now (one multi-tensor copy into the buffers
        kept before), as the first ``passes`` passes' part of the step's."""
        dst, src = [], []
        for p, passes in due:
            grad = p.grad
            if grad is None:
                continue
            kept = self._half.get(p)
            if kept is None or kept[0].shape != grad.shape or kept[0].dtype != grad.dtype:
                self._half[p] = (grad.detach().clone(), passes)
            else:
                self._half[p] = (kept[0], passes)
                dst.append(kept[0])
                src.append(grad)
            self._kept.add(p)
        if dst:
            torch._foreach_copy_(dst, src)

    def _after_backward(self, p: torch.Tensor) -> None:
        """A backward pass added to ``p.grad``: count it; at the split its gradient is to
        be kept, after it its norm noted, both at the end of the pass (:meth:`_end_of_pass`)."""
        if _is_compiling():  # traced into a compiled backward pass: nothing here would run there
            self._traced = True
            return
        if p.grad is None:
            return
        if self._marked:
            self._due_norm.append(p)
        else:
            n = self._passes.get(p, 0) + 1
            self._passes[p] = n
            a = self._split.get(p, 0)
            if n == a:
                self._due_keep.append((p, a))
            elif n > a > 0:
                self._due_norm.append(p)
            else:
                return
        if not self._queued:  # once a pass: the engine calls it when the pass is done
            if _in_compiled_backward():  # compiled autograd's pass runs no queued callback: now
                self._end_of_pass()
                return
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_pass)
                self._queued = True
            except RuntimeError:  # no pass to queue on (an engine that takes no callbacks): now
                self._end_of_pass()

    @torch.no_grad()
    def _end_of_pass(self) -> None:
        """The backward pass is done: keep the gradients due (one multi-tensor copy) and note
        the norms due (one multi-tensor norm), for every parameter at once."""
        self._queued = False
        due_keep, self._due_keep = self._due_keep, []
        due_norm, self._due_norm = self._due_norm, []
        self._keep(due_keep)
        grads = [(p, p.grad) for p in due_norm if p.grad is not None]
        if grads:
            for (p, _), norm in zip(grads, torch._foreach_norm([g for _, g in grads])):
                self._total_norm[p] = norm

    def state(self, params: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """The running noise of each of ``params`` (by name), its count, split and step
        length, for a worker checkpoint (:meth:`load` takes it back)."""
        noise = {}
        for name, p in params.items():
            got = self._noise.get(p)
            if got is not None:
                noise[name] = {"noise": got[0].detach().clone(), "count": got[1], "split": self._split.get(p, 0),
                               "length": self._length.get(p, 0)}
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
            loaded[p] = (noise.to(device=p.device, dtype=_noise_dtype(p.dtype)).clone(), int(entry["count"]),
                         int(entry.get("split", 0)), int(entry.get("length", 0)))
        for p, (noise, count, split, length) in loaded.items():
            self._noise[p] = (noise, count)
            self._split[p] = split
            self._length[p] = length

    @torch.no_grad()
    def correct(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``optimizer.step()`` on the whole batch's gradient: add the noise the
        step's halves show to its running mean and move each parameter as the step with
        the job's second moment would have (the module doc)."""
        marked, self._marked = self._marked, False
        if self._traced:
            self._retrace()
        # a pass whose end never came (it raised before the engine ran its callback) leaves nothing behind
        self._queued = False
        self._due_keep.clear()
        self._due_norm.clear()
        self.attach(p for group in optimizer.param_groups for p in group["params"])  # (counted from the next step)
        if not marked and not self._kept and not self._noise:  # nothing kept, nothing measured yet: the splits
            self._split.update((p, n // 2) for p, n in self._passes.items())  # (a loop of one pass: no per-
            self._length.update(self._passes)  # parameter work beyond this)
            self._passes.clear()
            self._half.clear()
            self._total_norm.clear()
            self._note_unsplit(False)
            return
        keep = 1.0 - 1.0 / self.world
        sampled = False
        for group in optimizer.param_groups:
            b1, b2 = group["betas"]
            eps = group["eps"]
            # a learning rate kept as a tensor on the device (a compiled optimizer step's, a capturable one's)
            # multiplies the correction there: reading it would wait for the GPU
            lr_dev = group["lr"] if isinstance(group["lr"], torch.Tensor) and not _on_host(group["lr"]) else None
            lr = 1.0 if lr_dev is not None else float(group["lr"])
            # what the group's parameters take, in lists for torch's multi-tensor (foreach) ops: a handful of
            # kernels a step for the whole group instead of a dozen a parameter (the launches, on a GPU, would
            # be the step's cost); the arithmetic is the one the module doc gives, parameter by parameter
            s_half: list[torch.Tensor] = []  # sampled: the kept gradient, the whole one, its norm then,
            s_grad: list[torch.Tensor] = []  # the running noise, (a + b) / a and (1 - b2) a / b
            s_total: list[torch.Tensor] = []
            s_noise: list[torch.Tensor] = []
            s_ab: list[float] = []
            s_w: list[float] = []
            c_p: list[torch.Tensor] = []  # corrected: the parameter, Adam's moments, the running noise,
            c_m: list[torch.Tensor] = []  # 1 - b2^t, keep / (1 - b2^count), lr / (1 - b1^t)
            c_v: list[torch.Tensor] = []
            c_noise: list[torch.Tensor] = []
            c_bc2: list[float] = []
            c_keep: list[float] = []
            c_lr: list[float] = []
            for p in group["params"]:
                passes = 2 if marked else self._passes.pop(p, 0)
                half = self._half.get(p) if p in self._kept else None
                total = self._total_norm.pop(p, None)
                if not marked and p in self._hooked:
                    # a step as long as the one before: its count starts where that step's correct() ended it.
                    # One that is not (a step skipped without correct(), as GradScaler skips one whose gradient
                    # overflowed, so that its passes and its kept gradient ran on into this one) takes no sample
                    if passes != self._length.get(p):
                        half = None
                    self._length[p] = passes
                    self._split[p] = passes // 2  # next step's split (0: one pass, no halves)
                    if passes < 2:
                        self._half.pop(p, None)  # (a loop without halves holds no copy)
                st = optimizer.state.get(p)
                if p.grad is None or not st or "exp_avg_sq" not in st:
                    continue
                noise, count = self._noise.get(p, (None, 0))
                a = 1 if marked or half is None else half[1]
                b = 1 if marked else passes - a
                if half is not None and total is not None and b > 0:
                    if noise is None:
                        noise = torch.zeros_like(p.grad, dtype=_noise_dtype(p.grad.dtype))
                    count += 1
                    self._noise[p] = (noise, count)
                    s_half.append(half[0])
                    s_grad.append(p.grad)
                    s_total.append(total)
                    s_noise.append(noise)
                    s_ab.append((a + b) / a)
                    s_w.append((1 - b2) * (a / b))
                if noise is None:
                    continue
                t = self._step_of(p, st["step"])  # (counted on every step Adam took since it was read)
                if self.world == 1:
                    continue
                c_p.append(p)
                c_m.append(st["exp_avg"])
                c_v.append(st["exp_avg_sq"])
                c_noise.append(noise)
                c_bc2.append(1 - b2 ** t)
                c_keep.append(keep / (1 - b2 ** count))
                c_lr.append(lr / (1 - b1 ** t))
            if s_half:
                sampled = True
                # the step's gradient is the whole one times c (1, or a clip's factor): the noise of what Adam
                # saw is c times that of the halves; b (the a passes' mean less the other b's) = c H (a + b) / a - G
                scale = torch._foreach_div(torch._foreach_norm(s_grad), torch._foreach_clamp_min(s_total, 1e-30))
                torch._foreach_mul_(scale, s_ab)
                torch._foreach_mul_(s_half, scale)
                torch._foreach_sub_(s_half, s_grad)
                torch._foreach_mul_(s_noise, b2)
                torch._foreach_addcmul_(s_noise, s_half, s_half, s_w)
            if c_p:
                vh = torch._foreach_div(c_v, c_bc2)
                less = list(torch._foreach_mul(c_noise, c_keep))
                if any(x.dtype != v.dtype for x, v in zip(less, vh)):  # (a low-precision model's noise: float32)
                    less = [x.to(v.dtype) for x, v in zip(less, vh)]
                job = torch._foreach_sub(vh, less)
                torch._foreach_maximum_(job, torch._foreach_div(vh, float(self.world)))
                for x in (vh, job):  # 1 / (sqrt(.) + eps)
                    torch._foreach_sqrt_(x)
                    torch._foreach_add_(x, eps)
                    torch._foreach_reciprocal_(x)
                torch._foreach_sub_(vh, job)  # how much further the job's step goes, per unit of m
                torch._foreach_mul_(vh, c_m)
                torch._foreach_mul_(vh, c_lr)
                if lr_dev is not None:
                    torch._foreach_mul_(vh, lr_dev)
                torch._foreach_add_(c_p, vh)
        self._kept.clear()
        self._total_norm.clear()
        self._note_unsplit(sampled)

    def _step_of(self, p: torch.Tensor, step: Any) -> float:
        """Adam's step count for ``p`` (after the step just taken), read without waiting for
        the device: a fused or capturable optimizer keeps it on the parameters' device, where
        reading it would wait for the GPU, once a parameter a step. There it is read once and
        then counted (Adam advanced it by one for every step it took on ``p``, and every such
        step is followed by this one's correction); a state loaded since (a new tensor) is
        read again."""
        if not isinstance(step, torch.Tensor) or _on_host(step):
            return float(step)
        seen = self._device_steps.get(p)
        t = float(step) if seen is None or seen[0] is not step else seen[1] + 1.0
        self._device_steps[p] = (step, t)
        return t

    def _note_unsplit(self, sampled: bool) -> None:
        self._unsplit = 0 if sampled else self._unsplit + 1
        if self._unsplit == 3 and self.warn:
            warnings.warn("BatchNoise: three steps without halves (one backward pass a step and no mark_half()): "
                          "no noise measured, the steps are not corrected; accumulate the gradient over two or "
                          "more backward passes, or call mark_half() between a batch's halves", stacklevel=3)
