"""One training worker as a process of its own, for the liveness tests and
``bench.chaos``: it can be killed with SIGKILL, stopped with SIGSTOP and started
again, and reports what it did as JSON lines.

    python -m bench.live_worker ADDRESS --rank 0 --world 3 --target-version 200 --log w0.jsonl

It trains the demo's MLP on its shard of the digits (``stella.demo``) with
:class:`stella.StellaOptimizer` (the default update mode: a local AdamW, top-k of
the weight changes with error feedback, averaged on the server)
until the server's version reaches ``--target-version`` (or ``--max-steps``, or a
SIGTERM: ``StellaOptimizer.stop()``), so that workers that come and go finish together. Each step appends
``{"t", "step", "version", "loss"}`` to the log; the end appends ``{"done": true,
"accuracy", "version", "reconnects", "worker"}`` with the held-out accuracy of its
replica after the last exchange.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.live_worker")
    p.add_argument("address")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True, help="shards of the training data")
    p.add_argument("--target-version", type=int, required=True)
    p.add_argument("--max-steps", type=int, default=5000)
    p.add_argument("--log", required=True)
    p.add_argument("--worker-id", type=int, default=None, help="ask for this worker id (a restarted worker)")
    p.add_argument("--density", type=float, default=0.05)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds of 'compute' per step")
    a = p.parse_args(argv)

    import torch

    from stella import Compression, Connection, StellaOptimizer, Stopped
    from stella.demo import accuracy, demo_model, load_digits_split, shuffled_batches

    torch.set_num_threads(1)
    xtr, ytr, xte, yte = load_digits_split(a.seed)
    shard = torch.arange(a.rank, xtr.shape[0], a.world)
    xtr, ytr = xtr[shard], ytr[shard]
    model = demo_model(a.hidden, a.seed)
    log = open(a.log, "a", buffering=1)  # noqa: SIM115 - written until the process ends
    opt = StellaOptimizer(model, a.address, optimizer={"name": "adamw", "lr": a.lr, "weight_decay": 0.0},
                          compression=Compression(density=a.density, method="threshold"),
                          connection=Connection(timeout=a.timeout, name=f"live-worker-{a.rank}", worker_id=a.worker_id))
    stopping = []

    def stop(*_: object) -> None:  # SIGTERM (bench.soak's end): the loop ends after this step, cleanly
        stopping.append(True)
        opt.stop()

    signal.signal(signal.SIGTERM, stop)
    opt.start()
    log.write(json.dumps({"t": time.time(), "joined": True, "worker": opt.client.worker_id,
                          "version": opt.version, "pid": os.getpid()}) + "\n")
    gen = torch.Generator().manual_seed(a.seed * 1000 + a.rank + 7919 * (a.worker_id or 0))
    batches = shuffled_batches(xtr.shape[0], a.batch_size, gen)
    step = 0
    try:
        while opt.version < a.target_version and step < a.max_steps and not stopping:
            b = next(batches)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xtr[b]), ytr[b])
            loss.backward()
            if a.step_sleep:
                time.sleep(a.step_sleep)
            try:
                opt.step()
            except Stopped:
                break
            step += 1
            log.write(json.dumps({"t": time.time(), "step": step, "version": opt.version,
                                  "loss": round(loss.item(), 5)}) + "\n")
        if not stopping:
            opt.synchronize()
        acc = accuracy(model, xte, yte)
        log.write(json.dumps({"t": time.time(), "done": True, "accuracy": acc, "version": opt.version,
                              "reconnects": opt.client.reconnects, "worker": opt.client.worker_id,
                              "steps": step}) + "\n")
    finally:
        opt.close()
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
