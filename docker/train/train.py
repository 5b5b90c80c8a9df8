"""An example Stella worker, what each worker container of a site runs by default
(compose.worker.yml: ``STELLA_COMMAND=python /work/train.py``, this directory mounted
at /work). Replace it with your own script; what it shows:

- the training loop is plain PyTorch; ``stella.StellaOptimizer(model,
  os.environ["STELLA_SERVER"], optimizer=torch.optim.AdamW(...))`` is the one change
  (update mode: the AdamW steps run here, the server averages the workers' changes).
  The keys come from ``STELLA_SERVER_KEY``/``STELLA_CLIENT_KEY``, which the compose
  file points at its secrets; ``STELLA_RANK`` and ``STELLA_WORLD`` pick this worker's
  shard of the data;
- a clean stop: ``docker-compose stop``/``down`` sends SIGTERM (``init: true`` passes it
  on to this process), which ends the loop after the current step, so that
  ``opt.close()`` runs: what was not sent yet is pushed, and the worker leaves the job
  (the server logs ``worker left``, not a liveness timeout);
- a key the server refuses (not on its allowlist) ends the script at once with
  ``Unauthorised``, naming the key's fingerprint;
- a job that goes on: when the server already holds a model (restored from its
  checkpoint volume, or trained by other workers), the worker says so and continues it.

The model is `stella demo`'s: an MLP on scikit-learn's handwritten digits, each worker
training on its shard; rank 0 prints the held-out accuracy every ``--eval-every`` steps.

    python train.py [--steps N] [--eval-every N] [--batch-size N] [--lr LR]

``--steps 0`` trains until stopped.
"""
from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import threading

import torch

import stella
from stella.demo import accuracy, demo_model, load_digits_split, shuffled_batches


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000, help="steps of this worker (0: until stopped)")
    p.add_argument("--eval-every", type=int, default=100, help="rank 0 evaluates every N steps (0: never)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--progress-every", type=int, default=100, help="a progress line every N steps (0: none)")
    a = p.parse_args(argv)
    address = os.environ["STELLA_SERVER"]
    rank, world = int(os.environ.get("STELLA_RANK", "0")), int(os.environ.get("STELLA_WORLD", "1"))

    # SIGTERM: finish the step, then close() (push the rest, leave); a wait for the server in progress (the
    # other sites not up yet, the server down) ends at once (opt.stop()), so the stop takes seconds at most
    stop = threading.Event()
    opts: list[stella.StellaOptimizer] = []

    def on_sigterm(signum: int, frame: object) -> None:
        stop.set()
        for o in opts:
            o.stop()

    signal.signal(signal.SIGTERM, on_sigterm)
    torch.set_num_threads(1)
    if a.progress_every:
        from stella.progress import log_to_stderr

        log_to_stderr()
    model = demo_model(hidden=256, seed=0)  # every worker starts from the same weights
    try:  # before loading data: a site whose key is refused learns it at once
        opt = stella.StellaOptimizer(model, address, optimizer=torch.optim.AdamW(model.parameters(), lr=a.lr),
                                     connection=stella.Connection(name=f"train-{rank}"),
                                     progress_every=a.progress_every)
        opts.append(opt)
        opt.start()  # join now (the first step would): the model as built, every worker's the same
    except stella.Stopped:
        print("train.py: stopped (SIGTERM) before joining the job", flush=True)
        opt.close()
        return 0
    except stella.StellaError as e:
        print(f"train.py: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    x, y, x_test, y_test = load_digits_split(seed=0)
    shard = torch.arange(rank, x.shape[0], world)
    x, y = x[shard], y[shard]
    if opt.version > 0:
        print(f"train.py: worker {rank}/{world} continues the server's model at version {opt.version} (restored "
              "from its checkpoint, or trained by the other workers); to start afresh, remove the server site's "
              "checkpoints volume (docker/README.md, 'Starting afresh')", flush=True)
    else:
        print(f"train.py: worker {rank}/{world} starts a new model at {address}", flush=True)

    batches = shuffled_batches(x.shape[0], a.batch_size, torch.Generator().manual_seed(rank))
    step = 0
    try:
        while not stop.is_set() and (a.steps == 0 or step < a.steps):
            b = next(batches)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[b]), y[b])
            loss.backward()
            try:
                opt.step()
            except stella.Stopped:
                break
            step += 1
            if rank == 0 and a.eval_every and step % a.eval_every == 0:
                print(f"train.py: step {step} | version {opt.version} | loss {loss.item():.4f} | test accuracy "
                      f"{accuracy(model, x_test, y_test):.4f}", flush=True)
        why = "stopped (SIGTERM)" if stop.is_set() else "done"
        if not stop.is_set():
            opt.synchronize()  # the replica becomes the server's model
        result = f"test accuracy {accuracy(model, x_test, y_test):.4f} " if rank == 0 else ""
        print(f"train.py: {why}: {result}after {step} steps (server version {opt.version})", flush=True)
    except stella.StellaError as e:
        print(f"train.py: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        opt.close(flush=False)
        return 1
    opt.close()  # pushes what was not sent yet, and leaves
    print("train.py: left the job", flush=True)
    return 0


if __name__ == "__main__":
    status = main()
    # The interpreter's teardown garbage-collects torch's whole object graph, several times
    # over (seconds on a small machine, which `docker stop` waits for); frozen, it is skipped
    # and the process ends as soon as close() is done.
    gc.freeze()
    sys.exit(status)
