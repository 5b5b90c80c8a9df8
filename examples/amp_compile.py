"""Mixed precision and ``torch.compile`` through Stella, in both training modes: a plain
PyTorch loop with ``torch.autocast`` (bf16, or fp16 with ``GradScaler``, whose
``unscale_`` and ``step`` take the Stella optimizer like any other) and a compiled model.

    python examples/amp_compile.py --amp fp16 --compile          # a local stella-ps, two workers
    python examples/amp_compile.py --amp bf16 --mode gradient
    python examples/amp_compile.py --amp fp16 --compile --accumulate 2   # two backward passes a step

With ``--accumulate`` 2 or more in update mode, the default ``BatchNoise`` measures the
gradient's noise from the step's halves (docs/optimizer.md) on the compiled model, under
GradScaler; the report's ``noise_counts`` shows its samples.

The model is a small byte-level language model (the next byte from the 16 before it),
quick to compile on a CPU.
"""
from __future__ import annotations

import sys

import torch
from common import blocks, launch, report, worker_args

import stella

WINDOW = 16


class ByteMLP(torch.nn.Module):
    def __init__(self, width: int = 256):
        super().__init__()
        self.embed = torch.nn.Embedding(256, 32)
        self.hidden = torch.nn.Linear(WINDOW * 32, width)
        self.out = torch.nn.Linear(width, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.nn.functional.gelu(self.hidden(self.embed(x).flatten(1))))


def windows(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the 16 bytes before, the byte) pairs from blocks of bytes."""
    w = data.unfold(1, WINDOW + 1, WINDOW + 1).reshape(-1, WINDOW + 1)
    return w[:, :WINDOW], w[:, WINDOW]


def main(argv: list[str] | None = None) -> int:
    p = worker_args(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--amp", default="bf16", choices=["none", "bf16", "fp16"], help="autocast dtype")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--mode", default="update", choices=["update", "gradient"], help="Stella's training mode")
    p.add_argument("--target", type=float, default=3.0, help="the held-out loss to reach (0: none)")
    p.add_argument("--accumulate", type=int, default=1, help="backward passes (micro-batches) per optimizer step")
    a = p.parse_args(argv)
    if a.address is None:
        return launch(__file__, sys.argv[1:] if argv is None else argv)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = ByteMLP()
    if a.mode == "update":
        opt = stella.StellaOptimizer(model, a.address, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3))
    else:  # the server runs AdamW on the workers' mean gradient
        opt = stella.StellaOptimizer(model, a.address, mode="gradient", optimizer={"name": "adamw", "lr": 3e-3})
    net = torch.compile(model) if a.compile else model
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.amp)
    scaler = torch.amp.GradScaler("cpu", enabled=a.amp == "fp16")
    x, y = windows(blocks("train", a.rank, a.world))
    hx, hy = windows(blocks("heldout"))
    gen = torch.Generator().manual_seed(a.rank)
    losses, skipped = [], 0
    try:
        for _ in range(a.steps):
            i = torch.randint(0, x.shape[0], (64,), generator=gen)
            opt.zero_grad(set_to_none=True)
            step_loss = 0.0
            for part in i.chunk(a.accumulate):  # each micro-batch's share of the step's mean loss
                with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                    loss = torch.nn.functional.cross_entropy(net(x[part]), y[part]) * (part.numel() / i.numel())
                scaler.scale(loss).backward()
                step_loss += loss.item()
            scaler.unscale_(opt)  # the gradients, unscaled in place, before clipping
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scale = scaler.get_scale() if scaler.is_enabled() else 1.0
            scaler.step(opt)  # skips the step (no push) when the scaled gradients overflowed
            scaler.update()
            skipped += int(scaler.is_enabled() and scaler.get_scale() < scale)
            losses.append(step_loss)
    finally:
        opt.close()
    with torch.no_grad():
        held = torch.nn.functional.cross_entropy(net(hx[:4096]), hy[:4096]).item()
    return report(a.out, {"rank": a.rank, "amp": a.amp, "compile": a.compile, "mode": a.mode, "first_loss": losses[0],
                          "last10": sum(losses[-10:]) / 10, "heldout_loss": held, "skipped_steps": skipped,
                          "rounds": opt.stats.rounds, "version": opt.version, "density": opt.stats.density,
                          "decisions": opt.stats.decisions, "down_mbps": opt.stats.down_mbps,
                          "noise_counts": sorted({e["count"] for e in opt.state_dict().get("batch_noise", {}).get(
                              "noise", {}).values()})}, a.target)


if __name__ == "__main__":
    sys.exit(main())
