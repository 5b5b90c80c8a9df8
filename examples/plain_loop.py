"""A plain PyTorch training loop through Stella: the three lines it adds are marked.

    python examples/plain_loop.py                      # a local stella-ps and two workers
    python examples/plain_loop.py --address tcp://ps:5555 --rank 0 --world 2
"""
from __future__ import annotations

import sys

import torch
from amp_compile import ByteMLP, windows
from common import blocks, launch, report, worker_args

import stella  # stella


def main(argv: list[str] | None = None) -> int:
    p = worker_args(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--target", type=float, default=2.6, help="the held-out loss to reach (0: none)")
    a = p.parse_args(argv)
    if a.address is None:
        return launch(__file__, sys.argv[1:] if argv is None else argv)

    torch.set_num_threads(1)
    torch.manual_seed(0)  # every worker starts from the same weights
    model = ByteMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    opt = stella.StellaOptimizer(model, a.address, optimizer=opt)  # stella: wraps the optimizer
    x, y = windows(blocks("train", a.rank, a.world))
    gen = torch.Generator().manual_seed(a.rank)
    for _ in range(a.steps):
        i = torch.randint(0, x.shape[0], (64,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x[i]), y[i])
        opt.zero_grad()
        loss.backward()
        opt.step()  # the local step; the exchange with stella-ps runs behind the next steps
    opt.close()  # stella: pushes what is not sent yet and leaves the job
    hx, hy = windows(blocks("heldout"))
    with torch.no_grad():
        held = torch.nn.functional.cross_entropy(model(hx[:4096]), hy[:4096]).item()
    return report(a.out, {"rank": a.rank, "last_loss": loss.item(), "heldout_loss": held, "version": opt.version},
                  a.target)


if __name__ == "__main__":
    sys.exit(main())
