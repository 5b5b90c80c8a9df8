"""Lightning through Stella: a ``LightningModule`` whose ``configure_optimizers`` returns a
``StellaOptimizer`` (an AdamW inside) and a learning-rate schedule, trained by
``lightning.Trainer`` with automatic optimization and gradient clipping; each worker a
Trainer of its own, all through one ``stella-ps``.

What Stella adds to a LightningModule (the lines marked ``# stella``)::

    import stella

    def configure_optimizers(self):
        opt = stella.StellaOptimizer(self, address, optimizer=torch.optim.AdamW(self.parameters(), lr=3e-3))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": LambdaLR(opt, ...), "interval": "step"}}

    def on_train_end(self):
        self.optimizers().close()  # pushes what is not sent yet and leaves the job

The Trainer steps it with a closure (``optimizer.step(closure)``), clips the gradients
inside that closure (``gradient_clip_val``), zeroes them through its
``LightningOptimizer``, and saves ``optimizer.state_dict()`` in its checkpoints;
``trainer.fit(ckpt_path=...)`` loads it back before the first step, so resuming against
the same ``stella-ps`` or a new one trains on from the checkpoint's model
(docs/integrations.md).

    python examples/lightning_module.py                        # a local stella-ps and two workers
    python examples/lightning_module.py --steps 40 --save-steps 40 && \\
      python examples/lightning_module.py --steps 50 --resume   # resume, against a new stella-ps
    python examples/lightning_module.py --address tcp://ps:5555 --rank 0 --world 2   # one worker
"""
from __future__ import annotations

import logging
import math
import os
import sys
import warnings
from typing import Any

import torch
from common import blocks, launch, report, tiny_gpt2, worker_args

import stella  # stella

TARGET = 2.6  # held-out loss two workers reach in the default 100 steps: 2.44-2.47 here (ln 256 = 5.5 at the start)


def lightning_module(address: str, steps: int, lr: float = 3e-3, warmup: int = 10):  # -> L.LightningModule
    """The module (its class made here so that the one-command launcher, which only starts
    processes, does not import lightning)."""
    import lightning as L

    class ByteLM(L.LightningModule):
        """A small GPT-2-style model of bytes, with its optimizer and schedule."""

        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_gpt2()
            self.losses: dict[int, float] = {}  # training loss by step (the step it ends)
            self.clipped: list[float] = []  # the gradient norm each inner step used (after clipping)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = self.model(input_ids=batch, labels=batch).loss
            self.losses[self.trainer.global_step + 1] = loss.item()
            return loss

        def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            self.log("val_loss", self.model(input_ids=batch, labels=batch).loss, batch_size=batch.shape[0])

        def configure_optimizers(self) -> dict[str, Any]:
            inner = torch.optim.AdamW(self.parameters(), lr=lr)
            opt = stella.StellaOptimizer(self, address, optimizer=inner)  # stella
            # (a figure for this example's test: the gradient norm the inner AdamW steps with, after the clipping)
            inner.register_step_pre_hook(lambda o, args, kwargs: self.clipped.append(grad_norm(self)))

            def schedule(step: int) -> float:  # linear warm-up, then cosine down to 10%
                if step < warmup:
                    return (step + 1) / warmup
                return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, steps - warmup))))

            sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def on_train_end(self) -> None:  # stella: the end of fit (after its last checkpoint)
            self.optimizers().close()  # stella: what was not sent goes to the server; the worker leaves the job

    return ByteLM()


def grad_norm(module: torch.nn.Module) -> float:
    return float(torch.norm(torch.stack([p.grad.norm() for p in module.parameters() if p.grad is not None])))


def newest(directory: str) -> str | None:
    """The checkpoint of the highest step in ``directory`` (``checkpoint-<step>.ckpt``)."""
    steps = [int(f[len("checkpoint-"):-len(".ckpt")]) for f in os.listdir(directory)
             if f.startswith("checkpoint-") and f.endswith(".ckpt")] if os.path.isdir(directory) else []
    return os.path.join(directory, f"checkpoint-{max(steps)}.ckpt") if steps else None


def main(argv: list[str] | None = None) -> int:
    p = worker_args(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="the Trainer's max_steps (counting a resumed run's)")
    p.add_argument("--schedule-steps", type=int, default=0,
                   help="the learning-rate schedule's length (0: --steps): a run stopped early, to resume later, "
                        "keeps the schedule of the whole")
    p.add_argument("--save-steps", type=int, default=0, help="a checkpoint every that many steps (0: none)")
    p.add_argument("--output-dir", default="lightning-out", help="the checkpoints (one folder per rank)")
    p.add_argument("--resume", nargs="?", const=True, default=None,
                   help="resume from the newest checkpoint in --output-dir, or from the one named "
                        "(e.g. checkpoint-40.ckpt)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--accumulate", type=int, default=1, help="the Trainer's accumulate_grad_batches")
    p.add_argument("--log-steps", type=int, default=10, help="report the training loss every that many steps")
    p.add_argument("--target", type=float, default=TARGET, help="the held-out loss to reach (0: none)")
    a = p.parse_args(argv)
    if a.address is None:
        return launch(__file__, sys.argv[1:] if argv is None else argv)

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    for quiet in ("does not have many workers", "that ended before the epoch ended",  # a resume mid-epoch
                  "but have no `val_dataloader`", "LeafSpec"):  # (validation after fit; lightning's own)
        warnings.filterwarnings("ignore", f".*{quiet}.*")
    out = os.path.join(a.output_dir, f"rank{a.rank}")
    ckpt_path = None
    if a.resume:
        ckpt_path = newest(out) if a.resume is True else os.path.join(out, a.resume)
        if ckpt_path is None or not os.path.exists(ckpt_path):
            print(f"no checkpoint to resume from in {out}", file=sys.stderr)
            return 1
    lm = lightning_module(a.address, a.schedule_steps or a.steps)
    train = torch.utils.data.DataLoader(blocks("train", a.rank, a.world), batch_size=a.batch_size, shuffle=True,
                                        generator=torch.Generator().manual_seed(a.rank))
    held = torch.utils.data.DataLoader(blocks("heldout")[:256], batch_size=64)
    callbacks = [ModelCheckpoint(dirpath=out, filename="checkpoint-{step}", auto_insert_metric_name=False,
                                 every_n_train_steps=a.save_steps, save_top_k=-1)] if a.save_steps else []
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=a.steps, gradient_clip_val=1.0, logger=False,
                        accumulate_grad_batches=a.accumulate,
                        enable_checkpointing=bool(a.save_steps), callbacks=callbacks, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(lm, train, ckpt_path=ckpt_path)
    opt = trainer.optimizers[0]
    held_loss = trainer.validate(lm, held, verbose=False)[0]["val_loss"]
    sched = trainer.lr_scheduler_configs[0].scheduler
    steps = sorted(lm.losses)
    last = [lm.losses[s] for s in steps[-a.log_steps:]]
    return report(a.out, {"rank": a.rank, "heldout_loss": held_loss, "train_loss": sum(last) / max(1, len(last)),
                          "losses": {s: lm.losses[s] for s in steps if s == steps[0] or s % a.log_steps == 0},
                          "steps": trainer.global_step, "resumed_from": ckpt_path, "version": opt.version,
                          "max_grad_norm_stepped": max(lm.clipped, default=0.0), "lr": opt.inner.param_groups[0]["lr"],
                          "scheduled_lr": sched.get_last_lr()[0],
                          "noise_counts": sorted({e["count"] for e in opt.state_dict().get("batch_noise", {}).get(
                              "noise", {}).values()})}, a.target)


if __name__ == "__main__":
    sys.exit(main())
