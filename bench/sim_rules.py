"""In-process simulation of sparse update rules (no server, no network): W workers,
top-k with error feedback, one step stale, on the e2e workloads. Used to choose the
update rule; the real system is measured by bench.e2e.

  python -m bench.sim_rules --workload widemlp --rules dense,lazy,dgc --steps 150
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import cast

import torch

from bench import workloads as W
from stella_ps.config import ServerConfig

DENSE_BELOW = ServerConfig().dense_below  # the server's dense cut (stella-ps --dense-below), also the hybrid rule's


def topk_ef(acc: torch.Tensor, density: float, dense_below: int = DENSE_BELOW):
    n = acc.numel()
    if n < dense_below:
        sent = acc.clone()
        acc.zero_()
        return sent
    k = max(1, round(density * n))
    idx = torch.topk(acc.abs(), k, sorted=False).indices
    sent = torch.zeros_like(acc)
    sent[idx] = acc[idx]
    acc[idx] = 0
    return sent


class Rule:
    """Per-parameter flat tensors. worker(t, w, grads) -> pushes; server(pushes)."""

    def __init__(self, name, params, wl, world, density):
        self.name, self.wl, self.world, self.density = name, wl, world, density
        self.p = [q.detach().reshape(-1).clone() for q in params]
        self.res = [[torch.zeros_like(x) for x in self.p] for _ in range(world)]
        self.wm = [[torch.zeros_like(x) for x in self.p] for _ in range(world)]  # worker momentum / m
        self.wv = [[torch.zeros_like(x) for x in self.p] for _ in range(world)]
        self.m = [torch.zeros_like(x) for x in self.p]
        self.v = [torch.zeros_like(x) for x in self.p]
        self.k = [torch.zeros_like(x) for x in self.p]  # per-coordinate touch count
        self.t = 0
        self.b1, self.b2 = (0.9, 0.95)
        self.mom = 0.9

    def step(self, grads_per_worker, lr):
        wd = self.wl.weight_decay
        adam = self.wl.optimizer == "adamw"
        rule = self.name
        self.t += 1
        for i in range(len(self.p)):
            pushes = []
            for w in range(self.world):
                g = grads_per_worker[w][i]
                if rule == "dense":
                    pushes.append(g.clone())
                    continue
                if rule in ("lazy", "lazyplain", "hybrid"):
                    self.res[w][i] += g
                elif rule == "dgc":  # worker momentum, EF on lr * velocity
                    if adam:
                        m, v = self.wm[w][i], self.wv[w][i]
                        m.mul_(self.b1).add_(g, alpha=1 - self.b1)
                        v.mul_(self.b2).addcmul_(g, g, value=1 - self.b2)
                        mh = m / (1 - self.b1 ** self.t)
                        vh = v / (1 - self.b2 ** self.t)
                        d = mh / (vh.sqrt() + 1e-8) + wd * self.p[i]
                    else:
                        u = self.wm[w][i]
                        u.mul_(self.mom).add_(g + wd * self.p[i])
                        d = u
                    self.res[w][i] += lr * d
                pushes.append(topk_ef(self.res[w][i], self.density))
            agg = sum(pushes) / self.world
            p = self.p[i]
            if rule == "dgc":
                p -= agg
                continue
            touched = agg != 0 if rule != "dense" else torch.ones_like(agg, dtype=torch.bool)
            if adam:
                m, v, k = self.m[i], self.v[i], self.k[i]
                k[touched] += 1
                g = agg[touched]
                m[touched] = self.b1 * m[touched] + (1 - self.b1) * g
                v[touched] = self.b2 * v[touched] + (1 - self.b2) * g * g
                kk = k[touched]
                upd = (m[touched] / (1 - self.b1 ** kk)) / ((v[touched] / (1 - self.b2 ** kk)).sqrt() + 1e-8)
                p[touched] = p[touched] * (1 - lr * wd) - lr * upd
            else:
                g = agg[touched] + wd * p[touched]
                if rule == "lazyplain" or (rule == "hybrid" and p.numel() >= DENSE_BELOW):
                    p[touched] -= lr / (1 - self.mom) * g
                else:
                    b = self.m[i]
                    b[touched] = self.mom * b[touched] + g
                    p[touched] -= lr * b[touched]


def run(workload, rule, steps, density, world=2, seed=0, staleness=1, log=print):
    wl = W.get(workload)
    model = wl.build_model(seed)
    params = list(model.parameters())
    R = Rule(rule, params, wl, world, density)
    its = [wl.batches(r, world, wl.batch_size, seed) for r in range(world)]
    hist = [[x.clone() for x in R.p]]
    evals = []
    reached = None
    t0 = time.time()
    for t in range(steps):
        grads = []
        for r in range(world):
            model.zero_grad()
            wl.loss(model, next(its[r])).backward()
            grads.append([cast(torch.Tensor, q.grad).detach().reshape(-1).clone() for q in params])  # all have one
        R.step(grads, wl.lr_at(t))
        hist.append([x.clone() for x in R.p])
        hist = hist[-(staleness + 1):]
        with torch.no_grad():
            for q, x in zip(params, hist[0]):
                q.copy_(x.view_as(q))
        if (t + 1) % wl.eval_every == 0:
            # evaluate the server's model
            with torch.no_grad():
                saved = [q.clone() for q in params]
                for q, x in zip(params, R.p):
                    q.copy_(x.view_as(q))
                val = wl.evaluate(model)
                for q, x in zip(params, saved):
                    q.copy_(x)
            evals.append((t + 1, val))
            if reached is None and wl.reached(val):
                reached = t + 1
            log(f"  {workload} {rule} step {t+1} {wl.metric} {val:.4f} ({time.time()-t0:.0f}s)")
    return {"workload": workload, "rule": rule, "density": density, "reached": reached, "evals": evals}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="widemlp")
    ap.add_argument("--rules", default="dense,lazy,dgc")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--staleness", type=int, default=1)
    ap.add_argument("--lr", type=float, default=0)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = []
    for rule in a.rules.split(","):
        if a.lr:
            W.WORKLOADS[a.workload].lr = a.lr
        r = run(a.workload, rule, a.steps, a.density, seed=a.seed, staleness=a.staleness,
                log=lambda s: print(s, file=sys.stderr, flush=True))
        out.append(r)
        print(f"{a.workload:8s} {rule:10s} dens {a.density:.3f} reached {r['reached']} final {r['evals'][-1][1]:.4f}",
              flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
