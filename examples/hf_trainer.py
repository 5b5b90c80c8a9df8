"""Hugging Face ``Trainer`` through Stella: a small GPT-2-style model learns bytes of the
standard library's sources, each worker a ``Trainer`` of its own, all through one ``stella-ps``.

What Stella adds to a Trainer script (the lines marked ``# stella``; with ``--accumulate`` 2 or
more, the optimizer's default ``stella.BatchNoise`` reads the noise between the two halves of
each step's accumulation)::

    import stella
    opt = stella.StellaOptimizer(model, address, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3))
    trainer = Trainer(model, args, train_dataset=train, eval_dataset=held, optimizers=(opt, None))
    trainer.train(resume_from_checkpoint=...)
    opt.close()  # pushes what is not sent yet and leaves the job

The Trainer makes its learning-rate schedule on the optimizer as usual; ``save_steps``
checkpoints hold the optimizer's side (``optimizer.pt``); resuming from one, against the
same ``stella-ps`` or a new one, trains on from the checkpoint's model
(docs/integrations.md).

    python examples/hf_trainer.py                   # a local stella-ps and two workers
    python examples/hf_trainer.py --address tcp://ps:5555 --rank 0 --world 2   # one worker
"""
from __future__ import annotations

import os
import sys

import torch
from common import blocks, launch, report, tiny_gpt2, worker_args

import stella  # stella

TARGET = 2.6  # held-out loss two workers reach in the default 120 steps: 2.21-2.23 (ln 256 = 5.5 at the start)


class Blocks(torch.utils.data.Dataset):
    def __init__(self, data: torch.Tensor):
        self.data = data

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def main(argv: list[str] | None = None) -> int:
    p = worker_args(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--save-steps", type=int, default=0, help="a checkpoint every that many steps (0: none)")
    p.add_argument("--output-dir", default="hf-trainer-out", help="the Trainer's checkpoints (one folder per rank)")
    p.add_argument("--resume", nargs="?", const=True, default=None,
                   help="resume from the newest checkpoint in --output-dir, or from the one named (e.g. checkpoint-40)")
    p.add_argument("--log-steps", type=int, default=10, help="log the training loss every that many steps")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast")
    p.add_argument("--accumulate", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--target", type=float, default=TARGET, help="the held-out loss to reach (0: none)")
    a = p.parse_args(argv)
    if a.address is None:
        return launch(__file__, sys.argv[1:] if argv is None else argv)

    from transformers import Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    model = tiny_gpt2()
    out = os.path.join(a.output_dir, f"rank{a.rank}")
    args = TrainingArguments(output_dir=out, max_steps=a.steps, per_device_train_batch_size=16,
                             per_device_eval_batch_size=64, learning_rate=3e-3, warmup_steps=10,
                             lr_scheduler_type="cosine", max_grad_norm=1.0, gradient_accumulation_steps=a.accumulate,
                             bf16=a.bf16, use_cpu=True, logging_steps=a.log_steps, eval_strategy="steps",
                             eval_steps=max(a.steps // 2, 1), save_strategy="steps" if a.save_steps else "no",
                             save_steps=a.save_steps or 500, report_to="none", seed=a.rank,
                             dataloader_num_workers=0, disable_tqdm=True)
    opt = stella.StellaOptimizer(model, a.address,  # stella
                                 optimizer=torch.optim.AdamW(model.parameters(), lr=args.learning_rate))  # stella

    train, held = Blocks(blocks("train", a.rank, a.world)), Blocks(blocks("heldout")[:256])
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=held,
                      optimizers=(opt, None))  # stella: the Trainer's schedule drives the optimizer's groups
    try:
        resume = a.resume if a.resume in (None, True) else os.path.join(out, a.resume)
        result = trainer.train(resume_from_checkpoint=resume)
    finally:
        opt.close()  # stella: what was not sent goes to the server; the worker leaves the job
    held_loss = trainer.evaluate()["eval_loss"]
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return report(a.out, {"rank": a.rank, "train_loss": result.training_loss, "heldout_loss": held_loss,
                          "losses": {int(e["step"]): e["loss"] for e in logs}, "version": opt.version,
                          "steps": trainer.state.global_step, "scheduled_lr": trainer.lr_scheduler.get_last_lr()[0],
                          "inner_lr": opt.inner.param_groups[0]["lr"]}, a.target)


if __name__ == "__main__":
    sys.exit(main())
