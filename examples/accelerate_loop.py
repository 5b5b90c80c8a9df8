"""Hugging Face Accelerate through Stella: ``accelerator.prepare`` takes the Stella
optimizer like any other, with its gradient-accumulation context and mixed precision.

What Stella adds to an Accelerate script (the lines marked ``# stella``)::

    ps = stella.StellaOptimizer(model, address, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3))
    model, opt, loader, sched = accelerator.prepare(model, ps, loader, sched)
    ...                          # the loop as it was: accelerator.accumulate, accelerator.backward
    ps.close()                   # pushes what is not sent yet and leaves the job (Accelerate's wrapper has no close)

    python examples/accelerate_loop.py                    # a local stella-ps and two workers
    python examples/accelerate_loop.py --address tcp://ps:5555 --rank 0 --world 2
"""
from __future__ import annotations

import math
import sys

import torch
from common import blocks, launch, report, tiny_gpt2, worker_args

import stella  # stella

TARGET = 2.7  # held-out loss two workers reach in the default 100 optimizer steps, bf16, accumulation 2


def heldout_loss(model: torch.nn.Module, accelerator) -> float:
    held = blocks("heldout")[:256]
    model.eval()
    with torch.no_grad(), accelerator.autocast():
        loss = model(input_ids=held, labels=held).loss.item()
    model.train()
    return loss


def main(argv: list[str] | None = None) -> int:
    p = worker_args(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--precision", default="bf16", choices=["no", "bf16"], help="Accelerate's mixed_precision")
    p.add_argument("--target", type=float, default=TARGET, help="the held-out loss to reach (0: none)")
    a = p.parse_args(argv)
    if a.address is None:
        return launch(__file__, sys.argv[1:] if argv is None else argv)

    from accelerate import Accelerator

    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True, mixed_precision=a.precision, gradient_accumulation_steps=a.accumulate)
    model = tiny_gpt2()
    ps = stella.StellaOptimizer(model, a.address,  # stella
                                optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3))  # stella
    sched = torch.optim.lr_scheduler.LambdaLR(ps, lambda s: min(1.0, (s + 1) / 10)
                                              * 0.5 * (1 + math.cos(math.pi * min(s, a.steps) / a.steps)))
    data = blocks("train", a.rank, a.world)
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True,
                                         generator=torch.Generator().manual_seed(a.rank))
    model, opt, loader, sched = accelerator.prepare(model, ps, loader, sched)
    first = heldout_loss(model, accelerator)
    losses, micro = [], 0
    try:
        while micro < a.steps * a.accumulate:
            for x in loader:
                with accelerator.accumulate(model):
                    loss = model(input_ids=x, labels=x).loss
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()  # a step only once the micro-batches are in (Accelerate's wrapper decides)
                    sched.step()
                    opt.zero_grad()
                losses.append(loss.item())
                micro += 1
                if micro >= a.steps * a.accumulate:
                    break
    finally:
        ps.close()  # stella: what was not sent goes to the server; the worker leaves the job
    last = heldout_loss(model, accelerator)
    return report(a.out, {"rank": a.rank, "heldout_first": first, "heldout_loss": last,
                          "train_loss_last10": sum(losses[-10:]) / 10, "version": ps.version,
                          "rounds": ps.stats.rounds, "micro_batches": micro,
                          "noise_counts": sorted({e["count"] for e in ps.state_dict().get("batch_noise", {}).get(
                              "noise", {}).values()})}, a.target)


if __name__ == "__main__":
    sys.exit(main())
