"""BatchNoise (issue 43): a worker's Adam step taken with the second moment Adam would
keep on the whole job's batch, from the noise between the two halves of its own batch.
The step against its formula, computed here from scratch; what it refuses; through a
real stella-ps, eight AdamW workers whose pushes carry every coordinate need dense
training's iterations with it and far more without (the mean of eight Adam steps whose
second moments each hold the noise of an eighth of the batch), and eight byte-LM workers
pushing 1% need fewer with it than the outer rule alone could give."""
from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any

import pytest
import torch

from stella import BatchNoise, Compression, PipelineError, StellaOptimizer, Sync

DIM, W = 6, 8


def _halves_grads(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    signal = torch.linspace(-1.0, 1.0, DIM)
    return signal + torch.randn(DIM, generator=g), signal + torch.randn(DIM, generator=g)


def _micro_grads(step: int, k: int, salt: int = 0) -> list[torch.Tensor]:
    """Step ``step``'s k micro-batch gradients (k = 2, salt 0: the two halves)."""
    if k == 2 and salt == 0:
        return list(_halves_grads(step))
    g = torch.Generator().manual_seed(1000 * k + step + 100_000 * salt)
    signal = torch.linspace(-1.0, 1.0, DIM)
    return [signal + torch.randn(DIM, generator=g) for _ in range(k)]


def _reference(steps: int, world: int, lr: float, betas: tuple[float, float], eps: float,
               wd: float, clip: float | None = None, k: int = 2, first: bool = True, salt: int = 0) -> torch.Tensor:
    """AdamW's step, written out in float64, with the second moment ``max(v - (1 - 1/W) n, v / W)``
    (``n`` the running mean of the noise of the step's mean gradient, from the mean of its first a of k
    micro-batches against the other b's: ``(g_a - g_b) ** 2 a b / k ** 2``, ``((g_a - g_b) / 2) ** 2`` for
    two halves; a = k // 2), all bias-corrected by their counts; ``first``: the first step takes a sample
    (marked halves; an accumulation's split is known from the second step on, the first is plain AdamW's);
    ``clip``: the gradient scaled to at most that norm, the noise with it."""
    b1, b2 = betas
    p = torch.arange(DIM, dtype=torch.float64) / DIM
    m = torch.zeros(DIM, dtype=torch.float64)
    v = torch.zeros(DIM, dtype=torch.float64)
    n = torch.zeros(DIM, dtype=torch.float64)
    count = 0
    for t in range(1, steps + 1):
        gs = [x.double() for x in _micro_grads(t, k, salt)]
        a = k // 2
        b = k - a
        g = sum(gs) / k
        c = 1.0 if clip is None else min(1.0, clip / float(g.norm()))
        g = c * g
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        if first or t > 1:
            gap = c * (sum(gs[:a]) / a - sum(gs[a:]) / b)
            n = b2 * n + (1 - b2) * gap ** 2 * (a * b / k ** 2)
            count += 1
        vh = v / (1 - b2 ** t)
        job = vh if count == 0 else torch.maximum(vh - (1 - 1 / world) * n / (1 - b2 ** count), vh / world)
        p = p * (1 - lr * wd) - lr * (m / (1 - b1 ** t)) / (job.sqrt() + eps)
    return p


def _backward_halves(p: torch.Tensor, t: int, noise: BatchNoise | None) -> None:
    """Step t's two halves through backward passes (their gradients ``_halves_grads(t)``), each at half weight."""
    ga, gb = _halves_grads(t)
    p.grad = None
    (p * ga / 2).sum().backward()
    if noise is not None:
        noise.mark_half([p])
    (p * gb / 2).sum().backward()


def _run(steps: int, noise: BatchNoise | None, opt_cls=torch.optim.AdamW, clip: float | None = None,
         first: bool = True, **kw) -> torch.Tensor:
    """``first`` False: the first step's halves not marked (no sample then)."""
    p = torch.nn.Parameter(torch.arange(DIM, dtype=torch.float32) / DIM)
    opt = opt_cls([p], **kw)
    for t in range(1, steps + 1):
        _backward_halves(p, t, noise if first or t > 1 else None)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p], clip)
        opt.step()
        if noise is not None:
            noise.correct(opt)
    return p.detach()


def _run_accumulating(steps: int, noise: BatchNoise | None, k: int, clip: float | None = None,
                      **kw) -> torch.Tensor:
    """Each step's gradient accumulated over k backward passes (a loss divided by k each,
    as a Trainer's accumulation does), no mark: the split is BatchNoise's own count."""
    p = torch.nn.Parameter(torch.arange(DIM, dtype=torch.float32) / DIM)
    opt = torch.optim.AdamW([p], **kw)
    if noise is not None:
        noise.attach([p])
    for t in range(1, steps + 1):
        p.grad = None
        for g in _micro_grads(t, k):
            (p * g / k).sum().backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p], clip)
        opt.step()
        if noise is not None:
            noise.correct(opt)
    return p.detach()


def test_the_corrected_step_is_adams_with_the_jobs_second_moment():
    kw = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    got = _run(12, BatchNoise(W), **kw)
    want = _reference(12, W, kw["lr"], kw["betas"], kw["eps"], kw["weight_decay"])
    assert torch.allclose(got.double(), want, rtol=0, atol=2e-6), (got, want)
    plain = _run(12, None, **kw)
    # the correction is not a rounding: every coordinate moved further than plain AdamW took it
    assert (got - plain).abs().min() > 1e-4
    # one worker: its own second moment is the job's
    assert _reference(12, 1, kw["lr"], kw["betas"], kw["eps"], kw["weight_decay"]).sub(
        _run(12, BatchNoise(1), **kw).double()).abs().max() < 2e-6


def test_a_clipped_gradient_is_corrected_with_the_noise_clipped_alike():
    """A clip between the backward passes and the step (a Trainer's max_grad_norm) scales
    what Adam sees; the noise of what it saw is scaled alike (the whole gradient's norm noted
    by a hook after the backward passes, against the one at the step)."""
    kw = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    got = _run(12, BatchNoise(W), clip=1.0, **kw)
    want = _reference(12, W, kw["lr"], kw["betas"], kw["eps"], kw["weight_decay"], clip=1.0)
    assert torch.allclose(got.double(), want, rtol=0, atol=2e-6), (got, want)
    unclipped_noise = _reference(12, W, kw["lr"], kw["betas"], kw["eps"], kw["weight_decay"])
    assert (got.double() - unclipped_noise).abs().max() > 1e-3  # the clip was at work


@pytest.mark.parametrize("k", [2, 3, 4])
def test_an_accumulated_step_splits_itself_at_half_its_backward_passes(k):
    """No mark_half: the hook counts k backward passes (a Trainer's, Lightning's or
    Accelerate's accumulation) and keeps the gradient after k // 2 of them (none on the first
    step, before k is known); uneven splits (k = 3) weigh the two parts' gap by a b / k^2.
    With k = 2 it is the marked halves' step bit for bit; a clip is read off as with a mark."""
    kw = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for clip in (None, 1.0):
        got = _run_accumulating(12, BatchNoise(W), k, clip=clip, **kw)
        want = _reference(12, W, kw["lr"], kw["betas"], kw["eps"], kw["weight_decay"], clip=clip, k=k, first=False)
        assert torch.allclose(got.double(), want, rtol=0, atol=2e-6), (k, clip, got, want)
        assert (got - _run_accumulating(12, None, k, clip=clip, **kw)).abs().min() > 1e-4
        if k == 2:
            assert torch.equal(got, _run(12, BatchNoise(W), clip=clip, first=False, **kw))


def test_several_parameters_in_groups_each_take_their_own_step():
    """The correction runs on lists of a group's parameters (torch's multi-tensor ops): three
    parameters in two groups of different learning rates and decays, each with gradients of
    its own, each against the float64 reference of its own; one parameter without a
    gradient in a step (skipped by AdamW, as by BatchNoise) keeps its own count."""
    kw = dict(betas=(0.9, 0.95), eps=1e-8)
    ps = [torch.nn.Parameter(torch.arange(DIM, dtype=torch.float32) / DIM) for _ in range(3)]
    groups = [{"params": ps[:2], "lr": 0.01, "weight_decay": 0.1}, {"params": ps[2:], "lr": 0.03, "weight_decay": 0.0}]
    opt, noise = torch.optim.AdamW(groups, **kw), BatchNoise(W)
    noise.attach(ps)
    k = 4
    for t in range(1, 13):
        for p in ps:
            p.grad = None
        for j in range(k):
            loss = sum((p * _micro_grads(t, k, salt=i + 1)[j] / k).sum() for i, p in enumerate(ps) if i < 2 or t > 6)
            loss.backward()
        opt.step()
        noise.correct(opt)
    for i, (p, lr, wd) in enumerate(zip(ps[:2], (0.01, 0.01), (0.1, 0.1))):
        want = _reference(12, W, lr, kw["betas"], kw["eps"], wd, k=k, first=False, salt=i + 1)
        assert torch.allclose(p.detach().double(), want, rtol=0, atol=2e-6), (i, p, want)
    assert noise._noise[ps[0]][1] == 11 and noise._noise[ps[2]][1] == 5  # the third: from step 8 (7 learns k)


def test_a_step_skipped_without_correct_costs_samples_not_a_finite_model():
    """GradScaler skips the step whose gradient overflowed: no optimizer step, no correct(),
    the gradients zeroed. Its passes and its kept (overflowed) first half must not make the
    next step's sample: that step is twice as long as the one before, takes none, and so
    does the one after (its length differs from the long one's); the model stays finite and
    the noise counts the steps that had halves of their own."""
    kw = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    p = torch.nn.Parameter(torch.arange(DIM, dtype=torch.float32) / DIM)
    opt, noise = torch.optim.AdamW([p], **kw), BatchNoise(W)
    noise.attach([p])
    for t in range(1, 9):
        p.grad = None
        gs = _micro_grads(t, 2)
        if t == 4:
            gs[0] = torch.full((DIM,), float("inf"))
        for g in gs:
            (p * g / 2).sum().backward()
        if t == 4:  # overflowed: skipped, as GradScaler does
            continue
        opt.step()
        noise.correct(opt)
    assert bool(torch.isfinite(p).all())
    noise_now, count = noise._noise[p]
    assert bool(torch.isfinite(noise_now).all())
    assert count == 4  # steps 2, 3, 7, 8 (1: k not known yet; 4 skipped; 5 ran on from it; 6 after the long one)


def test_a_bf16_parameters_running_noise_is_kept_in_float32():
    """Pure bf16 training (parameters, gradients and Adam's state in bf16): the running noise
    is float32, where beta2 = 0.999 moves it (in bf16 0.999 x a value rounds back to it and
    its small additions are lost: a bf16 running noise read 20% high at 600 steps), and
    after 600 steps it reads the same noise as the float32 run's within 2%."""
    kw = dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8)
    est = {}
    for dtype in (torch.float32, torch.bfloat16):
        p = torch.nn.Parameter(torch.zeros(4096, dtype=dtype))
        opt, noise = torch.optim.AdamW([p], **kw), BatchNoise(W)
        noise.attach([p])
        g = torch.Generator().manual_seed(3)
        for _ in range(600):
            p.grad = None
            for _ in range(2):  # signal 0.1, noise 1 per half (its mean's variance: 1/2)
                (p * (0.1 + torch.randn(4096, generator=g)).to(dtype) / 2).sum().backward()
            opt.step()
            noise.correct(opt)
        n, count = noise._noise[p]
        est[dtype] = float(n.double().mean()) / (1 - 0.999 ** count)
        assert n.dtype == torch.float32
    assert est[torch.bfloat16] == pytest.approx(est[torch.float32], rel=0.02)
    assert est[torch.float32] == pytest.approx(0.5, rel=0.1)


def test_a_hook_called_where_no_pass_takes_callbacks_does_its_work_at_once():
    """The gradients are kept at the end of the backward pass (a callback the autograd
    engine runs); where there is none to queue on (the hook called outside the engine,
    as another engine might), the work is done at once; a pass that never reached its end
    leaves nothing behind."""
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    noise = BatchNoise(W)
    noise._split[p] = 1
    noise._after_backward(p)
    assert p in noise._kept and torch.equal(noise._half[p][0], torch.ones(3)) and not noise._queued
    # a pass that raised before its end: the next step's correct() leaves nothing of it behind (else no pass
    # would queue its callback again, and what it owed would pile up)
    noise._queued, noise._due_norm = True, [p]
    opt = torch.optim.AdamW([p])
    opt.step()
    noise.correct(opt)
    assert not noise._queued and not noise._due_norm and not noise._due_keep


@pytest.mark.parametrize("reentrant", [False, True], ids=["checkpoint", "reentrant-checkpoint"])
def test_activation_checkpointing_changes_nothing(reentrant):
    """A block under torch.utils.checkpoint (its backward a recomputation, with reentrant
    checkpointing a backward pass of its own inside the outer one, whose end runs the
    queued callback early): the same steps, bit for bit, as the plain model's."""
    from torch.utils.checkpoint import checkpoint

    def run(ckpt: bool) -> tuple[torch.Tensor, set[int]]:
        torch.manual_seed(0)
        l1, l2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        params = [*l1.parameters(), *l2.parameters()]
        opt, noise = torch.optim.AdamW(params, lr=0.01), BatchNoise(W)
        noise.attach(params)
        g = torch.Generator().manual_seed(1)
        for _ in range(8):
            for p in params:
                p.grad = None
            for _ in range(2):
                x = torch.randn(32, 8, generator=g).requires_grad_(reentrant)  # (reentrant: an input needs grad)
                h = checkpoint(lambda z: torch.tanh(l1(z)), x, use_reentrant=reentrant) if ckpt else torch.tanh(l1(x))
                (l2(h).square().mean() / 2).backward()
            opt.step()
            noise.correct(opt)
        return torch.cat([p.detach().reshape(-1) for p in params]), {c for _, c in noise._noise.values()}

    plain, counts = run(False)
    got, got_counts = run(True)
    assert counts == got_counts == {7} and torch.equal(got, plain)


def _two_pass_steps(steps: int, make_opt: Any, before: Any = None, after: Any = None) -> torch.Tensor:
    """A Linear(8, 4) trained ``steps`` steps of two backward passes each, the optimizer
    ``make_opt(params)`` makes corrected by ``BatchNoise(W)``; ``before(step, opt, noise)``
    runs before a step's passes, ``after(step, opt, noise)`` after its correction. Returns
    the parameters."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4)
    params = list(lin.parameters())
    opt, noise = make_opt(params), BatchNoise(W)
    noise.attach(params)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        if before is not None:
            before(step, opt, noise)
        for p in params:
            p.grad = None
        for _ in range(2):
            lin(torch.randn(16, 8, generator=g)).square().mean().div(2).backward()
        opt.step()
        noise.correct(opt)
        if after is not None:
            after(step, opt, noise)
    return torch.cat([p.detach().reshape(-1) for p in params])


def test_a_step_count_on_the_device_is_read_once_and_counted_bit_for_bit(monkeypatch):
    """A fused (or capturable) Adam keeps its step count on the parameters' device, where
    reading it each step would wait for the GPU once a parameter: it is read once, then
    counted (also on steps a world of one leaves uncorrected), and read again after a
    load_state_dict (new tensors) even one that took the count back. Here fused AdamW on the
    CPU, its count taken for a device's: the same steps, bit for bit, as reading it every time."""
    import stella.batch_noise as bn

    saved: list[Any] = []
    counts: list[tuple[float, float]] = []

    def before(step: int, opt: torch.optim.Optimizer, noise: BatchNoise) -> None:
        if step == 4:
            saved.append(copy.deepcopy(opt.state_dict()))
        if step == 7:  # back to step 4's optimizer state: the count goes back with it
            opt.load_state_dict(saved[-1])
        noise.world = 1 if step in (5, 6) else W  # (a job of one worker for two steps: none corrected)

    def after(step: int, opt: torch.optim.Optimizer, noise: BatchNoise) -> None:
        if step >= 2:  # (corrected from the step after the first sample)
            counts.extend((noise._device_steps[p][1], float(opt.state[p]["step"]))
                          for p in opt.param_groups[0]["params"])

    def fused(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=0.01, fused=True)

    read = _two_pass_steps(10, fused, before)
    monkeypatch.setattr(bn, "_on_host", lambda t: False)
    got = _two_pass_steps(10, fused, before, after)
    assert torch.equal(got, read)
    assert [c for c, _ in counts] == [t for _, t in counts] and counts[-1][1] == 7.0  # 10 steps, 3 taken back


class _Unread(torch.Tensor):
    """A learning rate that BatchNoise must not read (AdamW's own item() may)."""

    def __float__(self) -> float:
        raise AssertionError("read the learning rate")


def test_a_learning_rate_tensor_on_the_device_is_not_read(monkeypatch):
    """A learning rate kept as a tensor (a compiled optimizer step's, with a scheduler that
    changes it in place) on the device multiplies the correction there instead of being
    read each step: the same steps as a float's, to rounding."""
    import stella.batch_noise as bn

    def scheduled(lr: Any) -> tuple[Any, Any]:
        scheds: list[Any] = []

        def make(params: list[torch.Tensor]) -> torch.optim.Optimizer:
            opt = torch.optim.AdamW(params, lr=lr)
            scheds.append(torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - 0.05 * s))
            return opt

        return make, lambda step, opt, noise: scheds[-1].step()

    make, step_lr = scheduled(0.01)
    want = _two_pass_steps(8, make, after=step_lr)
    monkeypatch.setattr(bn, "_on_host", lambda t: False)  # every tensor a device's
    make, step_lr = scheduled(torch.tensor(0.01).as_subclass(_Unread))
    got = _two_pass_steps(8, make, after=step_lr)
    assert torch.allclose(got, want, rtol=0, atol=1e-6)


def test_under_compiled_autograd_it_measures_from_its_second_step_as_eager_does():
    """Compiled autograd (Dynamo compiling the backward pass, which calls the hooks from its
    graph and runs no queued callback): the first step traces the hooks, which do nothing
    there, and the hooks are put back as ones Dynamo leaves out of its graphs. After a
    first step of one backward pass (which eager BatchNoise does not sample either) the
    steps, samples and running noise are eager's, bit for bit (Dynamo's ``eager`` backend:
    the same kernels)."""
    import torch._dynamo
    from torch._dynamo import compiled_autograd

    def run(compiled: bool) -> tuple[torch.Tensor, torch.Tensor, set[int]]:
        torch.manual_seed(0)
        l1, l2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        params = [*l1.parameters(), *l2.parameters()]
        opt, noise = torch.optim.AdamW(params, lr=0.01), BatchNoise(W)
        noise.attach(params)
        g = torch.Generator().manual_seed(1)
        torch._dynamo.reset()
        with compiled_autograd._enable(torch.compile(backend="eager")) if compiled else contextlib.nullcontext():
            for step in range(8):
                for p in params:
                    p.grad = None
                for _ in range(1 if step == 0 else 2):
                    x = torch.randn(32, 8, generator=g)
                    (l2(torch.tanh(l1(x))).square().mean() / 2).backward()
                opt.step()
                noise.correct(opt)
        return (torch.cat([p.detach().reshape(-1) for p in params]),
                torch.cat([n.reshape(-1) for n, _ in noise._noise.values()]), {c for _, c in noise._noise.values()})

    plain, plain_noise, counts = run(False)
    got, got_noise, got_counts = run(True)
    assert counts == got_counts == {6}
    assert torch.equal(got_noise, plain_noise) and torch.equal(got, plain)


def test_a_step_of_one_backward_pass_takes_no_sample_and_a_warning_says_so():
    """Without accumulation or a mark there are no halves: the step is plain AdamW's (no
    noise measured, nothing corrected), and the third such step in a row warns."""
    kw = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    with pytest.warns(UserWarning, match="without halves"):
        got = _run_accumulating(4, BatchNoise(W), 1, **kw)
    assert torch.equal(got, _run_accumulating(4, None, 1, **kw))


def test_one_worker_is_plain_adam_bit_for_bit():
    kw = dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8)
    assert torch.equal(_run(5, BatchNoise(1), torch.optim.Adam, **kw), _run(5, None, torch.optim.Adam, **kw))


def test_its_running_noise_goes_into_a_worker_checkpoint_and_comes_back():
    """Three steps, a checkpoint of the optimizer and the noise, a new BatchNoise loaded
    from it, three more: the parameter of six steps in one go, bit for bit; and the
    optimizer's state_dict carries it."""
    kw = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    whole = _run(6, BatchNoise(W), **kw)
    p = torch.nn.Parameter(torch.arange(DIM, dtype=torch.float32) / DIM)
    opt, noise = torch.optim.AdamW([p], **kw), BatchNoise(W)
    for t in range(1, 7):
        if t == 4:  # the checkpoint, and a restart from it
            saved, opt_state = noise.state({"p": p}), opt.state_dict()
            assert set(saved["noise"]) == {"p"} and saved["noise"]["p"]["count"] == 3
            opt, noise = torch.optim.AdamW([p], **kw), BatchNoise(W)
            opt.load_state_dict(opt_state)
            noise.load({"p": p}, saved)
        _backward_halves(p, t, noise)
        opt.step()
        noise.correct(opt)
    assert torch.equal(p.detach(), whole)
    with pytest.raises(ValueError, match="shape"):
        BatchNoise(W).load({"p": torch.zeros(DIM + 1)}, saved)
    model = torch.nn.Linear(3, 2)
    wrapper = StellaOptimizer(model, "tcp://127.0.0.1:9", optimizer={"name": "adamw", "lr": 1e-3},
                              batch_noise=BatchNoise(2))
    weight = {"weight": torch.full((2, 3), 0.5), "bias": torch.ones(2)}
    state = wrapper.state_dict()  # before the start: as built, no noise yet
    state["batch_noise"] = {"world": 2, "noise": {k: {"noise": v, "count": 4} for k, v in weight.items()}}
    wrapper.load_state_dict(state)
    back = wrapper.state_dict()["batch_noise"]["noise"]
    assert {k: (torch.equal(v["noise"], weight[k]), v["count"]) for k, v in back.items()} == \
        {"weight": (True, 4), "bias": (True, 4)}


def test_its_world_follows_the_servers_count_unless_fixed():
    """``BatchNoise()`` takes the job's size from each round's answer (the pushes the
    server's latest step combined, times the site's ranks; the real-server tests below
    check it reaches WORLD); a fixed world stays; 0 (not said) changes nothing; until told,
    1: one worker's own step, uncorrected."""
    auto, fixed = BatchNoise(), BatchNoise(4)
    assert auto.world == 1 and auto.follows_server and not fixed.follows_server
    for n in (8, 0, 6):
        auto.job_size(n)
        fixed.job_size(n)
    assert (auto.world, fixed.world) == (6, 4)
    kw = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    assert torch.equal(_run(5, BatchNoise(), **kw), _run(5, BatchNoise(1), **kw))


def _update_worker(endpoint: str, passes: int, **kw) -> tuple[torch.Tensor, StellaOptimizer]:
    """One AdamW worker in update mode, 4 steps of ``passes`` backward passes each, through
    ``endpoint`` (exact pulls); its weights and optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = StellaOptimizer(model, endpoint, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01),
                          sync=Sync(every=1, max_every=1), compression=Compression(density=1.0), **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        opt.zero_grad()
        for _ in range(passes):
            x = torch.randn(16, 8, generator=g)
            (model(x).square().mean() / passes).backward()
        opt.step()
    opt.close(flush=False)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), opt


def test_the_optimizer_corrects_by_default_where_it_applies_and_costs_nothing_without_halves(make_server):
    """``StellaOptimizer``'s default (``batch_noise="auto"``): a ``BatchNoise()`` in update
    mode over Adam/AdamW, none over SGD. Through a real stella-ps, a loop of one backward
    pass a step trains bit for bit as without it, keeps no copy of a gradient and says
    nothing; one that accumulates two passes is corrected (from the second step) and holds
    its running noise."""
    model = torch.nn.Linear(3, 2)
    auto = StellaOptimizer(model, "tcp://127.0.0.1:9", optimizer={"name": "adamw", "lr": 1e-3})
    assert isinstance(auto.batch_noise, BatchNoise) and auto.batch_noise.follows_server
    assert StellaOptimizer(model, "tcp://127.0.0.1:9", optimizer={"name": "adamw", "lr": 1e-3},
                           batch_noise=None).batch_noise is None
    assert StellaOptimizer(model, "tcp://127.0.0.1:9", optimizer=torch.optim.SGD(model.parameters(), lr=0.1)
                           ).batch_noise is None
    with pytest.raises(ValueError, match="auto"):
        StellaOptimizer(model, "tcp://127.0.0.1:9", optimizer={"name": "adamw", "lr": 1e-3}, batch_noise="on")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain, opt = _update_worker(make_server(1, pull="exact").endpoint, 1)
    assert opt.batch_noise is not None and not opt.batch_noise._half and not opt.batch_noise._noise
    off, _ = _update_worker(make_server(1, pull="exact").endpoint, 1, batch_noise=None)
    assert torch.equal(plain, off)
    two, opt = _update_worker(make_server(1, pull="exact").endpoint, 2)
    two_off, _ = _update_worker(make_server(1, pull="exact").endpoint, 2, batch_noise=None)
    assert {count for _, count in opt.batch_noise._noise.values()} == {3}  # type: ignore[union-attr]
    # one worker: the server's world is 1, the job's batch is its own: corrected by nothing
    assert torch.equal(two, two_off)


def test_a_ddp_model_is_warned_of_and_gets_no_default_batch_noise(tmp_path):
    """DDP's gradients are its ranks' mean after the last backward pass and a rank's own
    before: halves mixed so would over-state the noise. A model handed over wrapped is
    warned of (the site averages already) and the default BatchNoise stays off; unwrapped,
    the same model gets it. No server is reached: the optimizer joins at its first step."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        lin = torch.nn.Linear(4, 2)
        ddp = torch.nn.parallel.DistributedDataParallel(lin)
        with pytest.warns(UserWarning, match="DistributedDataParallel"):
            wrapped = StellaOptimizer(ddp, "tcp://127.0.0.1:9", optimizer=torch.optim.AdamW(ddp.parameters()))
        plain = StellaOptimizer(lin, "tcp://127.0.0.1:9", optimizer=torch.optim.AdamW(lin.parameters()))
        assert wrapped.batch_noise is None and isinstance(plain.batch_noise, BatchNoise)
        wrapped.close()
        plain.close()
    finally:
        dist.destroy_process_group()


def test_what_it_refuses():
    model = torch.nn.Linear(3, 2)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError):
            BatchNoise(bad)
    with pytest.raises(ValueError, match="Adam or AdamW"):
        BatchNoise.check(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="amsgrad"):
        BatchNoise.check(torch.optim.AdamW(model.parameters(), amsgrad=True))
    # the optimizer: gradient mode, or an optimizer it does not correct, refused when built (no server needed)
    with pytest.raises(ValueError, match="update mode"):
        StellaOptimizer(model, "tcp://127.0.0.1:9", mode="gradient", batch_noise=BatchNoise(2))
    with pytest.raises(ValueError, match="Adam or AdamW"):
        StellaOptimizer(model, "tcp://127.0.0.1:9", optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        batch_noise=BatchNoise(2))
    opt2 = StellaOptimizer(model, "tcp://127.0.0.1:9", optimizer={"name": "adamw", "lr": 1e-3}, batch_noise=None)
    with pytest.raises(PipelineError, match="batch_noise"):
        opt2.mark_half()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_eight_adamw_workers_need_dense_iterations_with_the_jobs_second_moment(make_server):
    """Pushes of every coordinate, so that what is left is the second moment alone: the
    mean of eight Adam steps needs 1.74x dense's iterations in the simulation (1.89x
    through stella-ps at seed 0), with BatchNoise 1.00x (through stella-ps 0.99-1.00x with
    ``BatchNoise()``, 1.035x with the world fixed at 8 and the halves marked)."""
    from test_outer_rule import EVAL_EVERY, STEPS, WORLD, train

    from bench.sim_update import run_dense, step_ratio

    dense = run_dense("adamlp", WORLD, 0, STEPS, EVAL_EVERY)
    with_noise = step_ratio(train(make_server(WORLD).endpoint, "auto", density=1.0, noise=True), dense)
    without = step_ratio(train(make_server(WORLD).endpoint, "auto", density=1.0), dense)
    print(f"W = {WORLD}, every coordinate: BatchNoise {with_noise:.2f}x, without {without:.2f}x dense's iterations")
    assert with_noise <= 1.2, f"with BatchNoise: {with_noise:.2f}x dense's iterations (bound 1.2x)"
    assert without > 1.5, f"without: {without:.2f}x (the test no longer tells them apart)"


BOUND_WEIGHTED = 1.27


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_eight_byte_lm_workers_pushing_1pc_need_fewer_iterations_with_it_and_with_the_weighted_push(make_server):
    """The byte LM (tinylm: a Transformer, AdamW, warm-up), eight workers pushing 1% through
    stella-ps with the default outer rule, 200 steps, the mean of seeds 0 and 1.

    BatchNoise as a user sets it up (``BatchNoise()``: its world the server's count of
    pushes, the halves two backward passes it splits itself), pushes ranked by magnitude
    (``moment_power=0``, the rule before): 1.35x dense's iterations with it (1.36, 1.35 on
    2026-12-05; 1.31, 1.31 earlier, and 1.30, 1.26 when the correction ran tensor by
    tensor, its last bits other; seed 2 1.37) against 1.52x without (1.50, 1.54; seed 2
    1.42: the runs without it left the suite on 2026-12-05, a third of its longest test's
    time; test_eight_adamw_workers_need_dense_iterations_with_the_jobs_second_moment keeps
    BatchNoise against none at W = 8 through stella-ps). One seed moves by up to 0.15 with
    a perturbation of its first steps (the world fixed at 8 from the first step instead of 1
    until the server's first answer: seed 0 1.15), hence two.

    With it and the default ranking (``moment_power="auto"``: ``|a - w| |m| ** 0.5`` from
    four workers, ``m`` Adam's ``exp_avg``) fewer again, under BOUND_WEIGHTED, which the
    ranking by magnitude does not meet (docs/optimizer.md "The push's selection"):
    1.13x (1.13, 1.13 on 2026-12-05); by the second moment (``|a - w| v ** 0.25``, the default of
    stop 70) 1.19x (1.22, 1.15)."""
    from test_outer_rule import WORLD, train

    from bench.sim_update import run_dense, step_ratio

    steps, every, bound, seeds = 200, 10, 1.4, (0, 1)
    kw = dict(density=0.01, workload="tinylm", steps=steps, eval_every=every)
    with_noise, weighted = [], []
    for seed in seeds:
        dense = run_dense("tinylm", WORLD, seed, steps, every)
        for out, power in ((with_noise, 0.0), (weighted, "auto")):
            curve = train(make_server(WORLD).endpoint, "auto", seed=seed, noise=True, moment_power=power, **kw)
            out.append(step_ratio(curve, dense))
    mean_with, mean_weighted = (sum(r) / len(seeds) for r in (with_noise, weighted))
    print(f"byte LM, W = {WORLD}, 1%, seeds {seeds}: BatchNoise {with_noise} (mean {mean_with:.2f}x), "
          f"BatchNoise and the weighted push {weighted} (mean {mean_weighted:.2f}x) dense's iterations")
    assert mean_with <= bound, f"with BatchNoise: {mean_with:.2f}x dense's iterations (bound {bound}x)"
    assert mean_weighted <= BOUND_WEIGHTED, (f"the default ranking: {mean_weighted:.2f}x dense's iterations "
                                             f"(bound {BOUND_WEIGHTED}x)")
    assert mean_with > BOUND_WEIGHTED, f"by magnitude: {mean_with:.2f}x (the test no longer tells them apart)"
