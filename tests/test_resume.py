"""A worker resumed from its own checkpoint (the model's ``state_dict`` and the
optimizer's, saved with ``torch.save``), as a training stack resumes: the optimizer is
built on a fresh model, the checkpoint is loaded after that, and the first ``step()``
joins the job (StellaOptimizer.start). Which model the job goes on from, by case
(docs/integrations.md, "Resuming"): a new stella-ps takes the checkpoint's; one that
holds the job's model at the checkpoint's version or later keeps its own; one older than
the checkpoint keeps its own too, and a warning says what was lost. Plus the plain-PyTorch
expectations of an optimizer: zero_grad's two forms, frozen parameters, a parameter added
or replaced after the optimizer was built, a scheduler built before a load."""
from __future__ import annotations

import logging

import pytest
import torch

from stella import Compression, Connection, StellaOptimizer, Sync
from stella.errors import PipelineError

N = 64
KW = dict(compression=Compression(density=0.125, method="exact", value_dtype="f32"), sync=Sync(max_every=1),
          connection=Connection(timeout=10))


class Net(torch.nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(N, generator=g))
        self.frozen = torch.nn.Parameter(torch.randn(8, generator=g), requires_grad=False)


def train(model: Net, opt: StellaOptimizer, steps: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        (model.w * torch.randn(N, generator=g)).sum().backward()
        opt.step()


def adamw(model: Net) -> torch.optim.Optimizer:
    return torch.optim.AdamW([model.w], lr=0.05)


def save_checkpoint(make_server, path) -> tuple[dict, dict, torch.Tensor]:
    """A worker trains 6 steps, and saves its checkpoint through torch.save; returns the
    two state dicts as saved and the anchor they were taken on (the job's model then)."""
    srv = make_server(1, ["--dense-below", "0"])
    model = Net()
    opt = StellaOptimizer(model, srv.endpoint, optimizer=adamw(model), **KW)
    train(model, opt, 6)
    state = opt.state_dict()
    anchor = opt._exchange.anchor.clone()
    torch.save({"model": model.state_dict(), "optimizer": state}, path)
    opt.close(flush=False)  # the worker dies: what it had not sent is in the checkpoint only
    srv.close()
    saved = torch.load(path, weights_only=True)  # what a stack's resume loads (no pickled objects)
    assert saved["optimizer"]["version"] == state["version"] >= 4 and saved["optimizer"]["unsent"]["w"].abs().sum() > 0
    return saved["model"], saved["optimizer"], anchor


def test_a_new_server_takes_the_checkpoints_model_loaded_after_the_optimizer_was_built(make_server, tmp_path):
    """The issue-46 case: the optimizer is built on the random model, then the stack loads
    the checkpoint; a new stella-ps starts from the checkpoint's model (the anchor it was
    saved with, version included) and the weights train on exactly as saved."""
    weights, state, anchor = save_checkpoint(make_server, tmp_path / "ckpt.pt")
    srv = make_server(1, ["--dense-below", "0"], pull="exact")
    model = Net(seed=1)  # a fresh random model, as a script builds it before the resume
    opt = StellaOptimizer(model, srv.endpoint, optimizer=adamw(model), **KW)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)  # made before the load, as a stack does
    opt.load_state_dict(state)  # the optimizer's side first (the order is free until the first step) ...
    model.load_state_dict(weights)  # ... then the weights
    opt.start()
    assert opt.version == state["version"]  # the new server counts on from the checkpoint's version
    assert torch.equal(opt._exchange.anchor, anchor)  # its model is the one the checkpoint was taken on
    assert torch.equal(model.w.detach(), weights["w"])  # and the weights are the checkpoint's
    train(model, opt, 2, seed=7)
    sched.step()
    assert opt.inner.param_groups[0]["lr"] == 0.025  # the scheduler made before the load drives the inner groups
    opt.synchronize()
    assert opt.version == state["version"] + 2
    opt.close()


def test_a_server_that_holds_the_job_keeps_its_model_and_a_server_older_than_the_checkpoint_warns(
        make_server, tmp_path, caplog):
    """A server at the checkpoint's version or later is the job's (it kept running): its model
    wins, the unsent progress is kept on top, and it is only logged. A server whose model is
    older than the checkpoint (it restarted from an older checkpoint of its own, or another
    worker made it first) wins too, with a warning naming the steps lost."""
    weights, state, _ = save_checkpoint(make_server, tmp_path / "ckpt.pt")
    srv = make_server(1, ["--dense-below", "0"], pull="exact")
    other = Net(seed=2)  # another worker makes the new server's model first, from other weights
    o2 = StellaOptimizer(other, srv.endpoint, optimizer=adamw(other), **KW)
    o2.start()
    assert o2.version == 0
    model = Net(seed=1)
    opt = StellaOptimizer(model, srv.endpoint, optimizer=adamw(model), **KW)
    model.load_state_dict(weights)
    opt.load_state_dict(state)
    with caplog.at_level(logging.INFO, logger="stella.pipeline"):
        opt.start()
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "OLDER than this checkpoint's" in warned[0].getMessage()
    assert f"{state['version']} step(s) of the checkpoint's are lost" in warned[0].getMessage()
    unsent = state["unsent"]["w"]
    assert torch.equal(opt._exchange.anchor, other.w.detach())  # the server's model won
    assert torch.allclose(opt._exchange.anchor - model.w.detach(), unsent, atol=1e-6)  # the unsent progress kept
    caplog.clear()
    # a third worker resumes from a checkpoint taken at version 0 of this job: the server is as new: no warning
    at_zero = opt.state_dict()
    assert at_zero["version"] == 0
    third = Net(seed=3)
    o3 = StellaOptimizer(third, srv.endpoint, optimizer=adamw(third), **KW)
    o3.load_state_dict(at_zero)
    with caplog.at_level(logging.INFO, logger="stella.pipeline"):
        o3.start()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert torch.allclose(o3._exchange.anchor - third.w.detach(), at_zero["unsent"]["w"], atol=1e-6)
    for o in (o2, opt, o3):
        o.close(flush=False)


def test_the_plain_pytorch_expectations_of_an_optimizer(make_server):
    srv = make_server(1)
    model = Net()
    frozen = model.frozen.detach().clone()
    opt = StellaOptimizer(model, srv.endpoint, optimizer=adamw(model), **KW)
    assert list(opt.params) == ["w"]  # requires_grad=False is not registered, nor trained
    # a state dict before the start round-trips (Accelerate's prepare does this)
    opt.load_state_dict(opt.state_dict())
    model.w.grad = torch.ones(N)
    opt.zero_grad(set_to_none=False)
    assert model.w.grad is not None and not model.w.grad.any()
    opt.zero_grad()
    assert model.w.grad is None
    train(model, opt, 3)
    assert torch.equal(model.frozen, frozen)
    opt.close()

    model = Net()
    opt = StellaOptimizer(model, srv.endpoint, optimizer=adamw(model), **KW)
    model.extra = torch.nn.Parameter(torch.zeros(4))  # a parameter added after the optimizer was built
    with pytest.raises(PipelineError, match=r"added: \['extra'\]"):
        train(model, opt, 1)
    opt.close()
    model = Net()
    opt = StellaOptimizer(model, srv.endpoint, optimizer=adamw(model), **KW)
    model.w = torch.nn.Parameter(torch.zeros(N))  # replaced (embeddings resized, a head swapped)
    with pytest.raises(PipelineError, match=r"replaced: \['w'\]"):
        opt.start()
    opt.close()


def test_close_pushes_the_whole_residual_unclipped(make_server):
    """Issue 45: close() flushes the whole error-feedback residual as one push, far above
    the job's usual push norm (here over 10x its median: --push-norm-factor's default
    bound), and the clip used to scale it down ("push clipped" on every clean stop in the
    Docker walk-through), losing part of it. The final push is allowed more, once: it
    arrives whole, and the server's model becomes the worker's weights."""
    import json

    import numpy as np

    from stella import Client

    n = 20_000
    srv = make_server(1, pull="exact")  # default push bounds
    model = torch.nn.Linear(n, 1, bias=False)
    opt = StellaOptimizer(model, srv.endpoint, optimizer=torch.optim.SGD(model.parameters(), lr=2e-4),
                          compression=Compression(density=0.001, method="exact", value_dtype="f32"),
                          sync=Sync(max_every=1), connection=Connection(timeout=10))
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        opt.zero_grad()
        model.weight.grad = torch.randn(1, n, generator=g)
        opt.step()
    opt.close()
    w = model.weight.detach().reshape(-1).numpy()
    norms = [json.loads(line)["norm"] for line in srv.logs().splitlines() if '"push norm"' in line]
    assert len(norms) == 41 and norms[-1] > 10 * float(np.median(norms[:-1]))  # the flush: above the usual bound
    assert '"push clipped"' not in srv.logs()
    with Client(srv.endpoint, timeout=10) as c:
        c.register({"weight": np.zeros((1, n), np.float32)})
        server_model = c.pull(None).tensors["weight"][1].reshape(-1)
    np.testing.assert_allclose(server_model, w, atol=1e-6)  # nothing the worker had was lost


@pytest.mark.parametrize("mode", ["update", "gradient"])
def test_a_clipped_push_loses_nothing_the_rest_goes_out_later(make_server, mode):
    """Issue 45: the push-norm bound scales a push down. Before, the worker was not told,
    and the part scaled off was lost (1,605 'push clipped' in the soak's hour). Now the
    reply says where and by how much; the worker's residual takes it back and sends it in
    later pushes, close() included. One worker under an absolute bound that clips most of
    its pushes: the server's model ends where the unclipped sum of the steps puts it
    (gradient mode: lr times the gradients' sum; update mode: the worker's own weights)."""
    import numpy as np

    from stella import Client

    n = 400
    bound = "0.3" if mode == "update" else "6"  # about half the usual push's norm: lr x gradient, or gradient
    srv = make_server(1, ["--max-push-norm", bound, "--push-norm-action", "clip"], pull="exact")
    model = torch.nn.Linear(n, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    lr = 0.05
    if mode == "update":
        kw = {"optimizer": torch.optim.SGD(model.parameters(), lr=lr)}
    else:
        kw = {"optimizer": {"name": "sgd", "lr": lr}, "mode": "gradient"}
    opt = StellaOptimizer(model, srv.endpoint, compression=Compression(density=0.25, method="exact", value_dtype="f32"),
                          sync=Sync(max_every=1), connection=Connection(timeout=10), **kw)
    g = torch.Generator().manual_seed(1)
    total = torch.zeros(n)
    for step in range(30):
        opt.zero_grad()
        grad = torch.randn(1, n, generator=g) if step < 10 else torch.zeros(1, n)  # then the residual drains
        total += grad.reshape(-1)
        model.weight.grad = grad
        opt.step()
    opt.close()
    logs = srv.logs()
    assert logs.count('"push clipped"') >= 5  # the bound was met again and again
    with Client(srv.endpoint, timeout=10) as c:
        c.register({"weight": np.zeros((1, n), np.float32)})
        server_model = c.pull(None).tensors["weight"][1].reshape(-1)
    expected = (-lr * total).numpy() if mode == "gradient" else model.weight.detach().reshape(-1).numpy()
    np.testing.assert_allclose(server_model, expected, atol=2e-5)  # what was scaled off came later, whole
    if mode == "update":
        np.testing.assert_allclose(expected, (-lr * total).numpy(), atol=2e-5)
