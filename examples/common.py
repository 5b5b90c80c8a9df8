"""What the examples share: a byte-level text that ships with Python, a small GPT-2-style
model from ``transformers``' own config class (no download), and a launcher that runs an
example's worker twice against a ``stella-ps`` of its own, so that each example runs
with one command.

Every example is a training script as a user writes it: its worker part takes
``--address`` (the server) and trains; run without ``--address``, it starts a local
``stella-ps`` (CurveZMQ keys made for the run) and two copies of itself on loopback,
prints their output, and exits non-zero when a worker fails or misses the loss the
example states.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from typing import Any

import torch

VOCAB = 256  # bytes
CONTEXT = 64


def text_bytes(limit: int = 400_000) -> bytes:
    """The first ``limit`` bytes of the standard library's own Python sources, in a
    fixed order: a text every Python install ships."""
    root = sysconfig.get_paths()["stdlib"]
    out = bytearray()
    for name in sorted(os.listdir(root)):  # the top-level modules: the same files on every 3.x install
        if name.endswith(".py"):
            with open(os.path.join(root, name), "rb") as f:
                out += f.read()
            if len(out) >= limit:
                break
    return bytes(out[:limit])


def blocks(split: str, rank: int = 0, world: int = 1, context: int = CONTEXT) -> torch.Tensor:
    """Non-overlapping blocks of ``context`` bytes (a causal LM predicts each byte from
    those before it in its block): the first 90% of the text trains
    (each worker takes every ``world``-th block from ``rank``), the rest is held out."""
    data = torch.frombuffer(bytearray(text_bytes()), dtype=torch.uint8).long()
    cut = int(0.9 * data.numel())
    part = data[:cut] if split == "train" else data[cut:]
    n = part.numel() // context
    b = part[:n * context].view(n, context)
    return b[rank::world] if split == "train" else b


def tiny_gpt2(seed: int = 0, layers: int = 2, width: int = 64) -> Any:
    """A randomly initialised GPT-2-style causal LM over bytes (``transformers``' own
    classes; nothing is downloaded). The same seed gives every worker the same weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=width, n_layer=layers, n_head=2,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def worker_args(description: str) -> argparse.ArgumentParser:
    """The options every example's worker takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--address", help="stella-ps address; none: start one here with two workers")
    p.add_argument("--rank", type=int, default=0, help="this worker's index (its share of the data)")
    p.add_argument("--world", type=int, default=2, help="how many workers share the data")
    p.add_argument("--out", help="write the worker's figures (JSON) here")
    return p


def report(path: str | None, figures: dict[str, Any], target: float = 0.0) -> int:
    """The worker's figures: one JSON line on stdout, written in one system call (the
    workers share the launcher's stdout, and a line of theirs must not interleave), and
    to ``path``. Returns the worker's exit status: 2 when ``target`` is set and the
    figures' ``heldout_loss`` did not reach it (said on stderr), else 0."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (json.dumps(figures) + "\n").encode())
    if path:
        with open(path, "w") as f:
            json.dump(figures, f)
    held = figures["heldout_loss"]
    if target and held > target:
        print(f"held-out loss {held:.3f} did not reach {target}", file=sys.stderr)
        return 2
    return 0


def launch(script: str, argv: Sequence[str], *, workers: int = 2, server_args: Sequence[str] = (),
           command: Sequence[str] | None = None, timeout: float = 900.0) -> int:
    """Start a local ``stella-ps`` and ``workers`` copies of ``script`` against it (each
    with ``--address --rank --world`` added to ``argv``; ``command``: the launcher to
    run the script with instead of this interpreter, e.g. torchrun); their exit status."""
    from stella_ps.process import ServerProcess

    with ServerProcess(workers, list(server_args), log_level="WARNING") as ps:
        env = {**os.environ, **ps.client_env(), "PYTHONUNBUFFERED": "1"}
        procs = []
        for rank in range(workers):
            cmd = [*(command or [sys.executable]), script, *argv, "--address", ps.endpoint, "--rank", str(rank),
                   "--world", str(workers)]
            procs.append(subprocess.Popen(cmd, env=env))
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        if any(codes):
            print(f"worker exit codes {codes}; stella-ps log:\n{ps.logs()[-3000:]}", file=sys.stderr)
            return 1
    return 0
