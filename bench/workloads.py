"""Workloads trained by the end-to-end benchmark (real data, shipped offline,
deterministic by seed).

* ``bytelm``   byte-level causal Transformer LM (~10.8M params) on the Python
               standard library's own ``.py`` sources; held-out loss (nats/byte)
               on a fixed sample of windows from held-out files.
* ``digits``   small CNN (~0.55M params) on scikit-learn's 8x8 digits; test accuracy
               on the demo's split (``stella.demo.load_digits_split``: 20% held out,
               stratified).
* ``tinylm``   the same byte LM made small (d64, 2 layers, ~0.12M params) with
               AdamW: a language model with Adam that trains in minutes on one
               core (the update rules' sweeps, ``bench.sim_update``).
* ``adamlp``   a small MLP (64-256-256-10) with AdamW on the same digits: an Adam
               workload cheap enough to train at W = 8 inside the tests.
* ``widemlp``  communication-bound MLP 64-3072-3072-10 (~9.7M params) on the
               same digits: a dense fp32 exchange at 100 Mbit/s costs ~50-100x
               its compute.

Every workload exposes the same interface (:class:`Workload`): ``build_model(seed)``,
``batches(rank, world_size, batch_size, seed)`` (an endless iterator of this
worker's share of the *global* batch: the global batch of step ``t`` depends
only on ``seed`` and ``t``, so every system sees the same data whatever its
world size split), ``loss(model, batch)``, ``evaluate(model)`` -> held-out
metric, ``target`` and the optimizer/LR schedule (``make_optimizer``,
``lr_at``) that all systems share.
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from stella.demo import accuracy, build_mlp, load_digits_split

__all__ = ["Workload", "WORKLOADS", "get", "stdlib_corpus", "ByteLM", "count_params"]


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@dataclass
class Workload:
    name: str
    description: str
    build_model: Callable[[int], nn.Module]
    batches: Callable[[int, int, int, int], Iterator[tuple[torch.Tensor, torch.Tensor]]]
    loss: Callable[[nn.Module, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]
    evaluate: Callable[[nn.Module], float]
    metric: str                 # name of the held-out metric
    higher_is_better: bool
    target: float               # held-out metric to reach
    batch_size: int             # per worker
    lr: float
    warmup: int = 0             # linear warm-up steps, then constant LR
    weight_decay: float = 0.0
    optimizer: str = "adamw"    # adamw | sgd (momentum 0.9)
    eval_every: int = 10        # steps between held-out evaluations
    notes: dict[str, str] = field(default_factory=dict)

    def lr_at(self, step: int) -> float:
        """Learning rate of (0-based) step ``step``: linear warm-up, then constant."""
        if self.warmup and step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        return self.lr

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        if self.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=self.lr_at(0), betas=(0.9, 0.95), weight_decay=self.weight_decay)
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.lr_at(0), momentum=0.9, weight_decay=self.weight_decay)
        raise ValueError(self.optimizer)

    def set_lr(self, opt: torch.optim.Optimizer, step: int):
        for g in opt.param_groups:
            g["lr"] = self.lr_at(step)

    def reached(self, value: float) -> bool:
        return value >= self.target if self.higher_is_better else value <= self.target


# ============================================================ byte-level LM

CONTEXT = 128


def _stdlib_files():
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        top = rel.split(os.sep)[0]
        # third-party packages and the (huge, data-heavy) regression-test suite are not "the stdlib"
        if top in ("site-packages", "dist-packages", "test", "__pycache__"):
            dirnames[:] = []
            continue
        dirnames.sort()
        for fn in sorted(filenames):
            if fn.endswith(".py"):
                out.append(os.path.relpath(os.path.join(dirpath, fn), root))
    return root, sorted(out)


@lru_cache(maxsize=1)
def stdlib_corpus(heldout_percent: int = 5) -> dict[str, np.ndarray]:
    """Concatenated bytes of the stdlib's ``.py`` files, split by file: a file is
    held out when ``sha1(relative path) % 100 < heldout_percent``."""
    root, files = _stdlib_files()
    train: list[bytes] = []
    held: list[bytes] = []
    for rel in files:
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read() + b"\n\n"
        h = int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 100
        (held if h < heldout_percent else train).append(data)
    tr = np.frombuffer(b"".join(train), dtype=np.uint8).copy()
    he = np.frombuffer(b"".join(held), dtype=np.uint8).copy()
    return {"train": tr, "heldout": he, "files": len(files), "root": root}


class _Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ByteLM(nn.Module):
    """GPT-style pre-norm decoder over bytes, tied input/output embedding."""

    def __init__(self, d_model: int = 384, n_layers: int = 6, n_heads: int = 6, context: int = CONTEXT):
        super().__init__()
        self.tok = nn.Embedding(256, d_model)
        self.pos = nn.Parameter(torch.zeros(context, d_model))
        self.blocks = nn.ModuleList([_Block(d_model, n_heads) for _ in range(n_layers)])
        self.ln = nn.LayerNorm(d_model)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.01)
        for b in self.blocks:
            assert isinstance(b, _Block)
            for lin in (b.qkv, b.proj, b.fc1, b.fc2):
                nn.init.normal_(lin.weight, std=0.02)
                nn.init.zeros_(lin.bias)
            nn.init.normal_(b.proj.weight, std=0.02 / math.sqrt(2 * n_layers))
            nn.init.normal_(b.fc2.weight, std=0.02 / math.sqrt(2 * n_layers))

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.ln(x) @ self.tok.weight.t()


def _lm_batches(rank, world, batch_size, seed):
    data = torch.from_numpy(stdlib_corpus()["train"])
    n = len(data) - CONTEXT - 1
    offs = torch.arange(CONTEXT + 1)
    step = 0
    while True:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, n, (world * batch_size,), generator=g)[rank * batch_size:(rank + 1) * batch_size]
        w = data[starts[:, None] + offs].long()
        yield w[:, :-1], w[:, 1:]
        step += 1


def _lm_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))


_LM_EVAL_WINDOWS = 64


@lru_cache(maxsize=1)
def _lm_eval_set():
    held = torch.from_numpy(stdlib_corpus()["heldout"])
    g = torch.Generator().manual_seed(12345)
    starts = torch.randint(0, len(held) - CONTEXT - 1, (_LM_EVAL_WINDOWS,), generator=g)
    w = held[starts[:, None] + torch.arange(CONTEXT + 1)].long()
    return w[:, :-1], w[:, 1:]


@torch.no_grad()
def _lm_eval(model):
    was = model.training
    model.eval()
    x, y = _lm_eval_set()
    tot = 0.0
    for i in range(0, len(x), 16):
        tot += F.cross_entropy(model(x[i:i + 16]).reshape(-1, 256), y[i:i + 16].reshape(-1), reduction="sum").item()
    model.train(was)
    return tot / y.numel()


def _build_lm(seed, **kw):
    torch.manual_seed(seed)
    return ByteLM(**kw)


# ============================================================ digits


@lru_cache(maxsize=1)
def digits_data():
    """The demo's digits split (``stella.demo.load_digits_split``: 20% held out,
    stratified, seed 0): ``(x_train, y_train, x_test, y_test)``, loaded once per process."""
    return load_digits_split(0)


def _digits_batches(rank, world, batch_size, seed):
    X, y, _, _ = digits_data()
    step = 0
    while True:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        idx = torch.randint(0, len(y), (world * batch_size,), generator=g)[rank * batch_size:(rank + 1) * batch_size]
        yield X[idx], y[idx]
        step += 1


def _cls_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def _digits_eval(model):
    _, _, X, y = digits_data()
    return accuracy(model, X, y)


class DigitsCNN(nn.Module):
    """conv3x3(32) - conv3x3(64) - maxpool2 - fc(512) - fc(10) on 8x8 digits (~0.55M params).
    Convolutions carry the compute, the fully connected layer the bytes: a DDP iteration
    at 100 Mbit/s (2.2 MB dense fp32 each way, 0.19 s) is 8-25x its compute on one CPU
    core (0.008-0.025 s measured in bench/RESULTS.md, depending on contention)."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(1, 32, 3, padding=1)
        self.c2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 4 * 4, 512)
        self.fc2 = nn.Linear(512, 10)

    def forward(self, x):
        x = x.view(-1, 1, 8, 8)
        x = F.max_pool2d(F.relu(self.c2(F.relu(self.c1(x)))), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def _cnn(seed):
    torch.manual_seed(seed)
    return DigitsCNN()


# ============================================================ registry

WIDE = 3072

WORKLOADS: dict[str, Workload] = {
    "bytelm": Workload(
        name="bytelm",
        description="byte-level Transformer LM (d384, 6 layers, ctx 128, 10.8M params) on the Python stdlib's "
                    ".py sources",
        build_model=lambda seed: _build_lm(seed),
        batches=_lm_batches, loss=_lm_loss, evaluate=_lm_eval,
        metric="heldout_loss", higher_is_better=False, target=2.5,
        batch_size=8, lr=1e-3, warmup=20, weight_decay=0.01, optimizer="adamw", eval_every=10,
    ),
    "tinylm": Workload(
        name="tinylm",
        description="byte-level Transformer LM (d64, 2 layers, ctx 128, 0.12M params) on the Python stdlib's "
                    ".py sources",
        build_model=lambda seed: _build_lm(seed, d_model=64, n_layers=2, n_heads=4),
        batches=_lm_batches, loss=_lm_loss, evaluate=_lm_eval,
        metric="heldout_loss", higher_is_better=False, target=2.6,
        batch_size=8, lr=3e-3, warmup=20, weight_decay=0.01, optimizer="adamw", eval_every=10,
    ),
    "digits": Workload(
        name="digits",
        description="small CNN (conv32-conv64-pool-fc512-fc10, 0.55M params) on sklearn digits (1438 train / 359 test)",
        build_model=_cnn,
        batches=_digits_batches, loss=_cls_loss, evaluate=_digits_eval,
        metric="test_accuracy", higher_is_better=True, target=0.95,
        batch_size=32, lr=0.02, optimizer="sgd", eval_every=10,
    ),
    "adamlp": Workload(
        name="adamlp",
        description="MLP 64-256-256-10 (0.08M params) with AdamW on sklearn digits: the update rules' test at W = 8",
        build_model=lambda seed: build_mlp((64, 256, 256, 10), seed),
        batches=_digits_batches, loss=_cls_loss, evaluate=_digits_eval,
        metric="test_accuracy", higher_is_better=True, target=0.95,
        batch_size=16, lr=1e-3, weight_decay=0.01, optimizer="adamw", eval_every=5,
    ),
    "widemlp": Workload(
        name="widemlp",
        description=f"communication-bound MLP 64-{WIDE}-{WIDE}-10 (9.7M params) on sklearn digits",
        build_model=lambda seed: build_mlp((64, WIDE, WIDE, 10), seed),
        batches=_digits_batches, loss=_cls_loss, evaluate=_digits_eval,
        metric="test_accuracy", higher_is_better=True, target=0.95,
        batch_size=32, lr=0.05, optimizer="sgd", eval_every=5,
    ),
}


def get(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise KeyError(f"unknown workload {name!r}; known: {sorted(WORKLOADS)}") from None
