"""Update mode (worker-side optimizer, compressed pseudo-gradients, outer step on the
server) against a real stella-ps: the merge rule, exactly, on deterministic toys;
conservation of the weights' change; the replica never drifting from the server."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from live import wait_until

from stella import Compression, Connection, StellaOptimizer, Sync
from stella.client import Client
from stella.pipeline import OUTER_PRESETS, build_inner

N = 8


class Toy(torch.nn.Module):
    def __init__(self, n: int = N, init: torch.Tensor | None = None):
        super().__init__()
        self.w = torch.nn.Parameter(torch.arange(n, dtype=torch.float32) if init is None else init.clone())


def grad_of(rank: int, t: int, n: int = N) -> torch.Tensor:
    """Dyadic gradients (multiples of 1/8, small): every sum below is exact in float32."""
    return (torch.arange(n, dtype=torch.float32) % 5 - 2 + 0.125 * (t + 1) * (rank + 1)) * (1 if t % 3 else -1)


def local_step(model: Toy, opt: StellaOptimizer, rank: int, t: int) -> torch.Tensor:
    """One iteration with inner SGD(lr=1): the weights move by exactly -grad_of(rank, t)."""
    used = model.w.detach().clone()
    opt.zero_grad()
    (model.w * grad_of(rank, t, model.w.numel())).sum().backward()
    opt.step()
    return used


def reference_run(h: int, steps: int, w0: torch.Tensor) -> list[list[torch.Tensor]]:
    """The merge rule as docs/optimizer.md writes it, for two workers, dense pushes,
    inner SGD lr 1, outer plain averaging, one round of overlap. Returns the weights
    each worker computed each iteration on."""
    x = w0.clone()  # the server's model
    a = [w0.clone(), w0.clone()]  # each worker's anchor
    w = [w0.clone(), w0.clone()]
    inflight: list[torch.Tensor | None] = [None, None]  # c: the pseudo-gradient a worker has in flight
    server_after: list[torch.Tensor] = []  # the server's model after each round
    used: list[list[torch.Tensor]] = [[], []]
    for t in range(steps):
        for i in (0, 1):
            used[i].append(w[i].clone())
            w[i] = w[i] - grad_of(i, t)
        if (t + 1) % h:
            continue
        r = len(server_after)  # the round that starts now
        for i in (0, 1):
            if inflight[i] is not None:  # round r-1 has finished: merge it
                new = server_after[r - 1]
                w[i] = w[i] + (new - a[i]) + inflight[i]
                a[i] = new.clone()
            inflight[i] = a[i] - w[i]  # dense: everything not yet sent goes
        x = x - (inflight[0] + inflight[1]) / 2  # outer SGD, lr 1, on the mean
        server_after.append(x.clone())
    return used


@pytest.mark.parametrize("pull", [["--pull", "exact"], ["--pull", "broadcast", "--broadcast-values", "f32"]],
                         ids=["exact", "broadcast"])
@pytest.mark.parametrize("h", [1, 2, 3])
def test_merge_rule_is_exact_on_a_deterministic_toy(make_server, h, pull):
    """The merge rule, bit for bit, with exact pulls and with the broadcast: a tensor this
    small goes whole in a broadcast, in f32 here, so the broadcast model is the exact one
    (the sums are exact) and both give the reference's weights."""
    steps = 9
    srv = make_server(2, pull)
    w0 = torch.arange(N, dtype=torch.float32)
    models = [Toy(), Toy()]
    opts = [StellaOptimizer(m, srv.endpoint, optimizer={"name": "sgd", "lr": 1.0},
                            compression=Compression(method="dense", value_dtype="f32"),
                            sync=Sync(every=h, max_every=h), connection=Connection(timeout=10, worker_id=i))
            for i, m in enumerate(models)]
    assert all(o.mode == "update" for o in opts)
    used: list[list[torch.Tensor]] = [[], []]
    for t in range(steps):  # one thread drives both: each step() returns once its round is started
        for i in (0, 1):
            used[i].append(local_step(models[i], opts[i], i, t))
    expect = reference_run(h, steps, w0)
    for i in (0, 1):
        for t in range(steps):
            assert torch.equal(used[i][t], expect[i][t]), f"worker {i}, iteration {t}: {used[i][t]} != {expect[i][t]}"
    for o in opts:
        o.close()


def test_one_worker_never_waits_for_its_own_update(exact_server):
    """With one worker and plain averaging the global change *is* the worker's own
    update: the merge rule keeps the local trajectory exact, no step is stale."""
    model = Toy()
    w0 = model.w.detach().clone()
    opt = StellaOptimizer(model, exact_server.endpoint, optimizer={"name": "sgd", "lr": 1.0},
                          compression=Compression(method="dense", value_dtype="f32"), sync=Sync(max_every=1),
                          connection=Connection(timeout=10))
    total = torch.zeros(N)
    for t in range(6):
        used = local_step(model, opt, 0, t)
        assert torch.equal(used, w0 - total)
        total += grad_of(0, t)
    opt.close()


def _server_model(srv, numel: int, version: int) -> torch.Tensor:
    """The server's model once it reaches ``version`` (read by an observer that registers
    after the workers have left: a registered worker takes part in every step)."""
    with Client(srv.endpoint, timeout=10, join=False) as c:
        # a step closed by the last push is applied right after it is acknowledged (30 s: a hang)
        wait_until(lambda: c.status().version >= version, 30, f"version {version}")
    with Client(srv.endpoint, timeout=10) as c:
        c.register({"w": np.zeros(numel, np.float32)})
        snap = c.pull(None)
        assert snap.version == version
        return torch.from_numpy(snap.tensors["w"][1].copy())


@pytest.mark.parametrize("value_dtype,per_tensor", [("f32", False), ("f16", False), ("q4", False), ("q2", False),
                                                    ("f32", True)])
def test_sparse_pushes_conserve_the_weights_change_and_the_replica_matches_the_server(make_server, value_dtype,
                                                                                     per_tensor):
    """Top-k pushes: what a worker has not sent stays in its weights. After the last
    exchange, for each worker ``a - w = (sum of its local steps) - (sum of what it
    sent)``, and the server moved by minus the mean of what was sent, so
    ``sum_i (a - w_i) = sum_i sum_t g_i(t) + 2 (x_final - x_0)`` exactly (q4/q2: up to
    float32 rounding, their decoded values are not dyadic); the anchor equals the
    server's model bit for bit."""
    n, steps = 64, 10
    srv = make_server(2, ["--dense-below", "0"], pull="exact")  # the small tensor selected from, not sent whole
    init = torch.zeros(n)
    models = [Toy(n, init), Toy(n, init)]
    opts = [StellaOptimizer(m, srv.endpoint, optimizer={"name": "sgd", "lr": 1.0},
                            compression=Compression(density=0.125, method="exact",
                                                    value_dtype=value_dtype, per_tensor=per_tensor),
                            sync=Sync(max_every=1), connection=Connection(timeout=10, worker_id=i))
            for i, m in enumerate(models)]
    for o in opts:
        o.start()
    assert all(o._exchange.compressor.per_tensor == per_tensor for o in opts)
    total = [torch.zeros(n), torch.zeros(n)]
    for t in range(steps):
        for i in (0, 1):
            local_step(models[i], opts[i], i, t)
            total[i] += grad_of(i, t, n)
    for o in opts:
        o.synchronize()
    for o in opts:
        assert o.pull_latest() == steps  # nothing else is in flight: the replica catches up
        o.close(flush=False)
    x = _server_model(srv, n, steps)
    unsent = []
    for i, o in enumerate(opts):
        a = o._exchange.anchor
        assert torch.equal(a, x), "the replica drifted from the server's model"
        unsent.append(a - models[i].w.detach())
        assert unsent[i].abs().sum() > 0  # top-k left something behind, in the weights
    lhs, rhs = unsent[0] + unsent[1], total[0] + total[1] + 2 * (x - init)
    if value_dtype in ("q4", "q2"):
        torch.testing.assert_close(lhs, rhs, rtol=0, atol=1e-4)
    else:
        assert torch.equal(lhs, rhs)


@pytest.mark.parametrize("power,moment,pushed", [(0.25, "mean", range(0, 8)), (0.25, "second", range(0, 8)),
                                                 (0.0, "mean", range(56, 64)), ("auto", "mean", range(56, 64))])
def test_a_push_ranks_the_unsent_change_by_adams_moments(make_server, power, moment, pushed):
    """``Compression(moment_power=..., moment=...)``: AdamW's first step moves every
    coordinate by about its learning rate (more where the weight decay adds to it: the last
    ones), but the first eight have gradients 10^5 times the others'; ranked by ``|a - w|
    |m| ** 0.5`` or ``|a - w| v ** 0.25`` they are the push, by ``|a - w|`` alone (0; and
    "auto" in a job of one worker) the last eight are. The server's model moved exactly
    where the push went, by what the worker moved there."""
    n = 64
    srv = make_server(1, ["--dense-below", "0"], pull="exact")
    model = Toy(n)
    w0 = model.w.detach().clone()
    inner = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.0, 0.999), weight_decay=0.1)
    opt = StellaOptimizer(model, srv.endpoint, optimizer=inner,
                          compression=Compression(density=8 / n, method="exact", value_dtype="f32",
                                                  moment_power=power, moment=moment),
                          sync=Sync(max_every=1), connection=Connection(timeout=10))
    opt.start()
    g = torch.full((n,), 1e-3)
    g[:8] = 100.0
    opt.zero_grad()
    (model.w * g).sum().backward()
    opt.step()
    moved = w0 - model.w.detach()
    opt.synchronize()
    opt.close(flush=False)
    x = _server_model(srv, n, 1)
    changed = torch.nonzero(x != w0).reshape(-1).tolist()
    assert changed == list(pushed)
    torch.testing.assert_close((w0 - x)[list(pushed)], moved[list(pushed)], rtol=1e-6, atol=0)


@pytest.mark.parametrize("workers,weighted", [(3, True), (2, False)])
def test_auto_weighs_the_push_by_the_gradients_mean_from_four_workers(make_server, workers, weighted):
    """``moment_power="auto"`` over AdamW: the server's count of a step's pushes (the
    workers' first round) turns the weighting on from the second round in a job of four
    workers (three AdamW, one SGD), and leaves it off in one of three; SGD never has it.
    The weights are ``(|exp_avg| + eps) ** 0.5`` (the default ``moment="mean"``)."""
    n = 64
    srv = make_server(workers + 1, ["--dense-below", "0"], pull="exact")
    models = [Toy(n) for _ in range(workers + 1)]
    opts = [StellaOptimizer(m, srv.endpoint, optimizer={"name": "sgd" if i == workers else "adamw", "lr": 0.01},
                            compression=Compression(density=0.125, method="exact", value_dtype="f32"),
                            sync=Sync(max_every=1), connection=Connection(timeout=10, worker_id=i))
            for i, m in enumerate(models)]
    for o in opts:
        o.start()
    for t in range(3):
        for i, (m, o) in enumerate(zip(models, opts)):
            local_step(m, o, i, t)
    for i, o in enumerate(opts):
        assert o._exchange.job_size == workers + 1
        weight = o._exchange.compressor.weight
        assert (weight is not None) == (weighted and i < workers)
        if weight is not None:  # the default moment, "mean": (|exp_avg| + eps) ** 0.5, of the round just pushed
            m = o._exchange.inner.state[models[i].w]["exp_avg"].reshape(-1)
            torch.testing.assert_close(weight, (m.abs() + 1e-8).sqrt(), rtol=1e-6, atol=0)
        o.close(flush=False)


def test_close_flushes_what_was_not_sent(make_server):
    exact_server = make_server(1, ["--dense-below", "0"], pull="exact")  # the small tensor selected from
    n = 256
    model = Toy(n, torch.zeros(n))
    opt = StellaOptimizer(model, exact_server.endpoint, optimizer={"name": "sgd", "lr": 1.0},
                          compression=Compression(density=0.05, method="exact", value_dtype="f32"),
                          sync=Sync(max_every=1), connection=Connection(timeout=10))
    total = torch.zeros(n)
    for t in range(5):
        local_step(model, opt, 0, t)
        total += grad_of(0, t, n)
    opt.close()
    # one worker, plain averaging: the server's model is the worker's, everything delivered
    assert torch.equal(_server_model(exact_server, n, 6), -total)  # 5 rounds and the flush


class Forwarding:
    """What Lightning's LightningOptimizer (``self.optimizers()``) is: an object of a class
    derived from its own and the optimizer's that reads missing attributes from the
    optimizer (lightning 2.6) or, in older releases, copied its ``__dict__``; either way
    its writes stay its own."""

    def __init__(self, optimizer: torch.optim.Optimizer, copy_dict: bool):
        if copy_dict:
            self.__dict__ = {k: v for k, v in optimizer.__dict__.items() if k not in ("step", "__del__")}
        self._optimizer = optimizer
        self.__class__ = type("Wrapped" + optimizer.__class__.__name__, (self.__class__, optimizer.__class__), {})

    def __getattr__(self, item):
        return getattr(self._optimizer, item)


@pytest.mark.parametrize("copy_dict", [False, True], ids=["forwarding", "dict_copy"])
def test_close_through_a_wrapper_acts_on_the_optimizer_and_flushes(make_server, copy_dict):
    """A wrapper made before the start (a copied __dict__ says: not started, nothing in
    flight): state_dict() and close() through it finish the round in flight and flush, as
    on the optimizer, whose own flags and version follow."""
    exact_server = make_server(1, ["--dense-below", "0"], pull="exact")
    n = 256
    model = Toy(n, torch.zeros(n))
    opt = StellaOptimizer(model, exact_server.endpoint, optimizer={"name": "sgd", "lr": 1.0},
                          compression=Compression(density=0.05, method="exact", value_dtype="f32"),
                          sync=Sync(max_every=1), connection=Connection(timeout=10))
    wrapped = Forwarding(opt, copy_dict)
    total = torch.zeros(n)
    for t in range(5):
        local_step(model, opt, 0, t)
        total += grad_of(0, t, n)
    assert wrapped.state_dict()["version"] == opt.version == 5 and not opt._pending  # the round in flight, installed
    wrapped.close()
    assert opt._closed
    assert torch.equal(_server_model(exact_server, n, 6), -total)  # 5 rounds and the flush
    opt.close()  # (idempotent)


def test_nesterov_outer_step_matches_torch_sgd(exact_server):
    """The outer step on the server is torch's SGD(nesterov) on the pseudo-gradient
    (dense here, so lazy == dense)."""
    n = 16
    model = Toy(n, torch.zeros(n))
    opt = StellaOptimizer(model, exact_server.endpoint, optimizer={"name": "sgd", "lr": 1.0}, outer="nesterov",
                          compression=Compression(method="dense", value_dtype="f32"),
                          sync=Sync(max_every=1, staleness=0), connection=Connection(timeout=10))
    ref_p = torch.nn.Parameter(torch.zeros(n))
    outer = OUTER_PRESETS["nesterov"]
    ref = torch.optim.SGD([ref_p], lr=outer["lr"], momentum=outer["momentum"], nesterov=True)
    for t in range(4):
        local_step(model, opt, 0, t)
        ref_p.grad = grad_of(0, t, n)  # the pseudo-gradient of one local SGD(lr 1) step
        ref.step()
        # staleness 0, one worker, everything sent: the replica is the server's model
        assert torch.allclose(model.w.detach(), ref_p.detach(), rtol=1e-6, atol=1e-6)
    assert torch.equal(model.w.detach(), opt._exchange.anchor)
    opt.close(flush=False)
    assert torch.equal(_server_model(exact_server, n, 4), model.w.detach())


def test_update_mode_refuses_what_it_cannot_do(server):
    model = Toy()
    with pytest.raises(ValueError, match="update mode runs the optimizer on the worker"):
        StellaOptimizer(model, server.endpoint)
    with pytest.raises(ValueError, match="gradient mode runs the optimizer on the server"):
        StellaOptimizer(model, server.endpoint, mode="gradient", optimizer=torch.optim.SGD(model.parameters(), lr=1))
    with pytest.raises(ValueError, match="every must be an integer >= 1"):
        StellaOptimizer(model, server.endpoint, optimizer={"name": "sgd", "lr": 1.0}, sync=Sync(every=0))
    with pytest.raises(ValueError, match="are for update mode"):
        StellaOptimizer(model, server.endpoint, mode="gradient", sync=Sync(every=2))
    with pytest.raises(ValueError, match="max_accumulate is for gradient mode"):
        StellaOptimizer(model, server.endpoint, optimizer={"name": "sgd", "lr": 1.0}, sync=Sync(max_accumulate=2))
    with pytest.raises(ValueError, match="outer"):
        StellaOptimizer(model, server.endpoint, optimizer={"name": "sgd", "lr": 1.0}, outer="adam")
    with pytest.raises(ValueError, match="unknown optimizer"):
        build_inner({"name": "lion"}, list(model.parameters()))


@pytest.mark.parametrize("inner,preset", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "average"),
    (lambda ps: {"name": "sgd", "lr": 1.0}, "average"),
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3), "tapered"),
    (lambda ps: {"name": "adam", "lr": 1e-3}, "tapered"),
    (lambda ps: torch.optim.RMSprop(ps, lr=1e-3), "tapered"),
])
def test_the_default_outer_step_follows_the_inner_optimizer(server, inner, preset):
    """outer="auto" (the default): the plain mean over SGD; over an adaptive optimizer
    "tapered" (the count up to 3% pushes, the mean from 10%, decided by the server step by
    step from the density it sees), whatever the density pinned or its adaptive range; the
    mirror group carries the hyper-parameters the server will run."""
    model = Toy()
    for compression in (Compression(density=0.01), Compression(max_density=0.01), Compression(max_density=0.05),
                        Compression(), Compression(density=0.1)):
        opt = StellaOptimizer(model, server.endpoint, optimizer=inner(list(model.parameters())),
                              compression=compression)
        assert opt._exchange.server_config == OUTER_PRESETS[preset], compression
        group = opt.outer.param_groups[0]
        assert group.get("count_exponent", 0.0) == (0.5 if preset == "tapered" else 0.0)
        assert (group.get("count_taper_from", 0.0), group.get("count_taper_to", 0.0)) == \
            ((0.02, 0.1) if preset == "tapered" else (0.0, 0.0))


def test_schedules_drive_the_inner_and_the_outer_learning_rate(server):
    model = Toy()
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    opt = StellaOptimizer(model, server.endpoint, optimizer=inner,
                          compression=Compression(method="dense", value_dtype="f32"), sync=Sync(max_every=1),
                          connection=Connection(timeout=10))
    sched_in = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)  # on the wrapper: the inner groups
    assert opt.outer is not None
    sched_out = torch.optim.lr_scheduler.LambdaLR(opt.outer, lambda s: 0.25 if s else 1.0)
    local_step(model, opt, 0, 0)
    sched_in.step()
    sched_out.step()
    assert inner.param_groups[0]["lr"] == 0.5
    assert opt.outer.param_groups[0]["lr"] == 0.25
    local_step(model, opt, 0, 1)  # the outer lr rides with this push
    opt.synchronize()
    with Client(server.endpoint, timeout=10) as c:
        assert c.status().optimizer["lr"] == 0.25
    opt.close()


@pytest.mark.parametrize("when", ["before_start", "after_start"])
def test_a_scheduler_on_the_wrapper_still_drives_the_inner_lr_after_load_state_dict(server, when):
    """A training stack's resume: the scheduler is built on the wrapper, then the
    optimizer's checkpoint is loaded (HF Trainer, Lightning). torch's load_state_dict
    replaces the inner optimizer's group dicts; the wrapper's (and the scheduler's) must
    stay the ones the inner steps with."""
    model = Toy()
    opt = StellaOptimizer(model, server.endpoint, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                          connection=Connection(timeout=10))
    groups = opt.param_groups
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    if when == "after_start":
        local_step(model, opt, 0, 0)
    saved = opt.state_dict()
    saved["inner"]["param_groups"][0]["lr"] = 0.75  # what the checkpoint holds
    opt.load_state_dict(saved)
    assert opt.param_groups is groups is opt.inner.param_groups and opt.state is opt.inner.state
    assert opt.inner.param_groups[0]["lr"] == 0.75
    local_step(model, opt, 0, 1)
    sched.step()
    assert opt.inner.param_groups[0]["lr"] == 0.5  # the schedule's, on the groups the inner steps with
    opt.close()


def test_a_worker_restores_its_own_side_on_top_of_the_servers_model(make_server):
    """state_dict() holds the inner optimizer's state and the unsent progress; a
    restarted worker keeps that progress on top of the server's current model (which
    another worker moved meanwhile)."""
    n = 64
    srv = make_server(1, ["--dense-below", "0"])  # the small tensor selected from, not sent whole
    model = Toy(n, torch.zeros(n))
    inner = torch.optim.AdamW(model.parameters(), lr=0.125)
    opt = StellaOptimizer(model, srv.endpoint, optimizer=inner,
                          compression=Compression(density=0.125, method="exact", value_dtype="f32"),
                          sync=Sync(max_every=1), connection=Connection(timeout=10))
    for t in range(4):
        local_step(model, opt, 0, t)
    saved = opt.state_dict()
    before = opt._exchange.anchor.clone()
    unsent = saved["unsent"]["w"]
    assert torch.equal(unsent, before - model.w.detach()) and unsent.abs().sum() > 0
    opt.close(flush=False)  # the worker dies: its unsent progress is only in the checkpoint

    other = Toy(n, torch.zeros(n))  # meanwhile another worker moves the server's model
    o2 = StellaOptimizer(other, srv.endpoint, optimizer={"name": "sgd", "lr": 1.0},
                         compression=Compression(method="dense", value_dtype="f32"),
                         sync=Sync(max_every=1, staleness=0), connection=Connection(timeout=10))
    local_step(other, o2, 1, 7)
    o2.close(flush=False)

    model2 = Toy(n, torch.ones(n))
    opt2 = StellaOptimizer(model2, srv.endpoint, optimizer=torch.optim.AdamW(model2.parameters(), lr=0.125),
                           compression=Compression(density=0.125, method="exact", value_dtype="f32"),
                           sync=Sync(max_every=1), connection=Connection(timeout=10))
    opt2.load_state_dict(saved)  # applied by the start, on the server's model (which holds the job)
    opt2.start()
    x = opt2._exchange.anchor
    assert opt2.version == 5 and not torch.equal(x, before)  # the server moved on
    assert torch.allclose(x, other.w.detach(), atol=1e-6)  # ... to what the other worker made of it
    assert torch.allclose(x - model2.w.detach(), unsent, atol=1e-6)  # the unsent progress survived
    st, st2 = inner.state_dict()["state"][0], opt2.inner.state_dict()["state"][0]
    assert torch.equal(st["exp_avg"], st2["exp_avg"]) and torch.equal(st["exp_avg_sq"], st2["exp_avg_sq"])
    local_step(model2, opt2, 0, 4)  # and training goes on
    opt2.close()
    with pytest.raises(ValueError, match="gradient"):  # (another job: this one refuses gradient-mode workers)
        g = StellaOptimizer(Toy(n), make_server(1).endpoint, mode="gradient", optimizer={"name": "sgd", "lr": 1.0},
                            connection=Connection(timeout=10))
        try:
            g.load_state_dict(saved)
        finally:
            g.close(flush=False)


def test_a_job_refuses_workers_of_the_other_mode(server):
    """The first registration names the job's mode; a worker of the other mode is refused
    before it can mix gradients with weight changes, and the job goes on."""
    from stella.errors import LayoutConflict

    model = Toy()
    opt = StellaOptimizer(model, server.endpoint, optimizer={"name": "sgd", "lr": 1.0}, sync=Sync(max_every=1),
                          connection=Connection(timeout=10))
    opt.start()
    with pytest.raises(LayoutConflict, match="update mode"):
        StellaOptimizer(Toy(), server.endpoint, mode="gradient", optimizer={"name": "sgd", "lr": 1.0},
                        connection=Connection(timeout=10)).start()
    with Client(server.endpoint, timeout=10) as c:  # a client that names no mode is not refused
        assert c.register({"w": np.zeros(N, np.float32)}).mode == "update"
        c.leave()
    local_step(model, opt, 0, 0)
    opt.close()
