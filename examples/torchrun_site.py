"""A torchrun site through Stella: the processes of one ``torchrun`` (here two CPU ranks on
gloo) are ONE Stella worker. Each rank trains on its own data; at each round the ranks
average their weights over ``torch.distributed`` and the group's rank 0 alone speaks to
``stella-ps`` (README, "Several GPUs in one site"). Two such sites share one server.

What Stella adds to a torchrun script (the lines marked ``# stella``)::

    import stella
    dist.init_process_group("gloo")  # (as before: "nccl" on GPUs; torchrun sets the rest)
    opt = stella.StellaOptimizer(model, address, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3))
    ...  # the loop as it was
    opt.close()  # on every rank

``process_group="default"`` (the default) makes the initialised default group the site;
every rank calls the same methods in the same order. The script reads the server from
``--address`` or ``STELLA_SERVER``, its site's index and the number of sites from
``--rank``/``--world`` or ``STELLA_RANK``/``STELLA_WORLD``, so the ordinary launcher
starts it with no extra step:

    python examples/torchrun_site.py            # a local stella-ps and two sites of two ranks
    STELLA_SERVER=tcp://ps:5555 STELLA_RANK=0 STELLA_WORLD=2 \\
      torchrun --standalone --nproc_per_node 2 examples/torchrun_site.py   # one site

The model is a small causal convolution over bytes (torch only).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import VOCAB, blocks, launch, report, worker_args

import stella  # stella

TARGET = 2.0  # held-out loss two sites of two ranks reach in the default 150 steps: 1.53 here (ln 256 = 5.5)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]  # torchrun, with a free rendezvous port


class ByteConv(torch.nn.Module):
    """Predicts each byte from the ``(kernel - 1) * layers`` bytes before it."""

    def __init__(self, width: int = 96, kernel: int = 4, layers: int = 3):
        super().__init__()
        self.kernel = kernel
        self.emb = torch.nn.Embedding(VOCAB, width)
        self.convs = torch.nn.ModuleList(torch.nn.Conv1d(width, width, kernel) for _ in range(layers))
        self.head = torch.nn.Linear(width, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, time) -> logits (batch, time, VOCAB)
        h = self.emb(x).transpose(1, 2)
        for conv in self.convs:
            h = h + F.gelu(conv(F.pad(h, (self.kernel - 1, 0))))  # causal: pad on the left only
        return self.head(h.transpose(1, 2))


def lm_loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x[:, :-1]).reshape(-1, VOCAB), x[:, 1:].reshape(-1))


def main(argv: list[str] | None = None) -> int:
    p = worker_args(__doc__.splitlines()[0])
    env = os.environ
    p.set_defaults(address=env.get("STELLA_SERVER"), rank=int(env.get("STELLA_RANK", 0)),
                   world=int(env.get("STELLA_WORLD", 2)))
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--nproc", type=int, default=2, help="ranks per site (the one-command form's torchrun)")
    p.add_argument("--target", type=float, default=TARGET, help="the held-out loss to reach (0: none)")
    a = p.parse_args(argv)
    if a.address is None:
        if "LOCAL_RANK" in env:  # under torchrun: every rank would start a server of its own
            p.error("under torchrun, name the server: --address or STELLA_SERVER")
        env.setdefault("OMP_NUM_THREADS", "1")
        return launch(__file__, sys.argv[1:] if argv is None else argv,
                      command=[*TORCHRUN, "--nproc_per_node", str(a.nproc)])

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # the site: torchrun's ranks
    r, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # (the leader's initial weights are broadcast to the site at the start in any case)
    model = ByteConv()
    opt = stella.StellaOptimizer(model, a.address,  # stella: the default group is the site; rank 0 leads
                                 optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3))  # stella
    data = blocks("train", a.rank * n + r, a.world * n)  # every rank of every site its own share
    gen = torch.Generator().manual_seed(a.rank * n + r)
    first = 0.0
    for step in range(a.steps):
        x = data[torch.randint(0, data.shape[0], (a.batch_size,), generator=gen)]
        opt.zero_grad()
        loss = lm_loss(model, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step == 0:
            first = loss.item()
    opt.synchronize()  # the round in flight installed: the site's ranks hold the same weights
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    weights, pushed = [flat.clone() for _ in range(n)], [None] * n
    dist.all_gather(weights, flat)
    dist.all_gather_object(pushed, opt.bytes_pushed)
    version = opt.version
    opt.close()  # stella: every rank; the leader pushes what was not sent yet and leaves the job
    code = 0
    if r == 0:  # the site reports once
        with torch.no_grad():
            held = lm_loss(model, blocks("heldout")[:256]).item()
        code = report(a.out, {"site": a.rank, "ranks": n, "first_loss": first, "last_loss": loss.item(),
                              "heldout_loss": held, "version": version, "steps": a.steps,
                              "ranks_identical": all(torch.equal(w, flat) for w in weights),
                              "bytes_pushed_by_rank": pushed}, a.target)
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
