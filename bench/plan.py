"""Validation of ``stella plan``'s model on the slow-link test bed, and two scenarios.

1. **Profiles** of ``digits``, ``widemlp`` and ``bytelm`` (``stella.planning.measure.profile_model`` on
   the bench workloads: compute s/step at their batch on one torch thread, bytes per round through the
   real compressor and encoder, the server's CPU per step from a real ``stella-ps`` on
   loopback). Their target iterations and factors come from bench/RESULTS.md (labelled).
2. **Fit**: a few real jobs over the test bed (``bench.stella_e2e.run_stella``, update mode,
   density/coding/H pinned, no adaptation) at fixed step counts; the model's four
   coefficients are fitted on them by least squares (:func:`stella.planning.calibrate.fit_many`,
   as ``stella calibrate`` does on a user's runs). Each row of ``--json`` carries its run's
   catalog and configuration (``catalog``, ``spec``), which ``stella calibrate`` reads.
3. **Held out**: a workload outside the fit (``bytelm``, the AdamW byte LM: fit on digits
   and widemlp, predict the third with its own profile and the fit's shared coefficients,
   :func:`calibration_for`), in 8 configurations (W, link rates, asymmetric links, densities,
   codings, H; half with the server's site shaped like the workers', several bound by their
   exchange), predicted first, then measured: s/it (round seconds / H) and, for the runs that stop at the
   target, time to target. MAPE and the worst error against the issue's goals (15% / 30%,
   time to target 25%).
4. **Hybrid scenario** (model only, docs/catalog.example.toml's illustrative prices):
   the lab's GPUs alone, rented GPUs alone, and both, for a 350M-parameter LM, StellaTrain's
   claim's style: time and cost of each, and what the mix saves.
5. **1B parameters on 32 consumer GPUs**, each site at 100 Mbit/s, the server's measured
   per-update cost and shards: the share of compute-bound throughput Stella reaches
   against DDP's, and what limits it.

  python -m bench.plan                         # all (needs root for the test bed; ~10-15 min)
  python -m bench.plan --quick                 # fewer, shorter runs
  python -m bench.plan --scenarios-only        # 4 and 5 (no runs; uses saved profiles if any)
  python -m bench.plan profile --workload widemlp --out widemlp.profile.json

Output: tables on stdout, ``--json PATH`` (default bench/PLAN.json), the Pareto plot of the
hybrid scenario (bench/plan_pareto.png).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.harness import REPO, clear_of, evaluation_stalls, loadavg
from bench.wan import TBF_QUEUE_MS, tbf_burst_bytes
from stella.codec import coordinate_bits
from stella.planning.calibrate import fit_many, observation
from stella.planning.catalog import Catalog, catalog_from_dict, load_catalog
from stella.planning.measure import BENCH_SERVER, describe_machine
from stella.planning.model import Config, Group, Prediction, predict
from stella.planning.profile_file import (
    STALL_S,
    STALL_SOURCE,
    Calibration,
    Profile,
    broadcast_bytes,
    profile_from_dict,
    pull_section,
    write_profile,
)
from stella.planning.report import pareto_plot, recommend, table
from stella.planning.search import parse_config, plan
from stella_ps.config import Pulls

OUT_DIR = os.path.join(REPO, "bench", "out", "plan")
PS_RATE = 1000.0
DATE = "2026-11-26"
# Iterations to the target: dense training's (DDP, same global batch) and Stella's factor per
# configuration, from the benchmarks (source labelled on every entry).
R26 = f"bench/RESULTS.md {DATE}"
R23 = "bench/RESULTS.md 2026-11-23"
TARGETS: dict[str, dict[str, Any]] = {
    "digits": {"dense_iterations": 140, "global_batch": 64, "critical_batch": 0,
               "source": f"{R26} (DDP, W = 2: 140 iterations to test accuracy 0.95; bench.scale: 130-160 for W = "
                         "2..32, so iterations do not fall with the batch: critical batch 0)"},
    "widemlp": {"dense_iterations": 85, "global_batch": 64, "critical_batch": 0,
                "source": f"{R26} (DDP, W = 2: 85 iterations to test accuracy 0.95)"},
}
FACTORS: dict[str, list[dict[str, Any]]] = {
    "digits": [
        {"density": 0.01, "coding": "f16", "H": 1, "factor": 180 / 140,
         "source": f"{R26} bench.scale (1% f16, W=2..16)"},
        {"density": 0.01, "coding": "q4", "H": 1, "factor": 190 / 140, "source": f"{R23} stella_q4"},
        {"density": 0.01, "coding": "q2", "H": 1, "factor": 180 / 140, "source": f"{R23} stella_q2"},
        {"density": 0.005, "coding": "q2", "H": 1, "factor": 180 / 140, "source": f"{R23} stella_lean"},
        {"density": 0.006, "coding": "q2", "H": 8, "factor": 180 / 140, "source": f"{R23} stella_h8"},
    ],
    "widemlp": [
        {"density": 0.01, "coding": "f16", "H": 1, "factor": 90 / 85, "source": f"{R26} stella (defaults)"},
        {"density": 0.01, "coding": "q4", "H": 1, "factor": 90 / 85, "source": f"{R23} stella_q4"},
        {"density": 0.01, "coding": "q2", "H": 1, "factor": 100 / 85, "source": f"{R23} stella_q2"},
        {"density": 0.005, "coding": "q2", "H": 1, "factor": 90 / 85, "source": f"{R23} stella_lean"},
        {"density": 0.006, "coding": "q2", "H": 8, "factor": 125 / 85, "source": f"{R23} stella_h8"},
    ],
    # the AdamW byte LM (10.8M): the model the scenarios extrapolate from
    "lm": [
        {"density": 0.01, "coding": "f16", "H": 1, "factor": 1.15, "source": f"{R23}/{DATE} byte LM (1.0-1.3)"},
        {"density": 0.01, "coding": "q4", "H": 1, "factor": 1.0, "source": f"{R23} byte LM stella_q4"},
        {"density": 0.01, "coding": "q2", "H": 1, "factor": 1.2, "source": f"{R23} byte LM stella_q2"},
        {"density": 0.005, "coding": "q2", "H": 1, "factor": 1.2, "source": f"{R23} byte LM stella_lean"},
        {"density": 0.006, "coding": "q2", "H": 8, "factor": 1.5, "source": f"{R23} byte LM stella_h8"},
        {"density": 0.001, "coding": "q2", "H": 8, "factor": 1.8,
         "source": "assumed (not measured): 0.1% with H = 8 below stella_h8"},
    ],
}


# ============================================================ profiles


def profile_workload(name: str, steps: int = 20, log=print) -> dict[str, Any]:
    """``stella.planning.measure.profile_model`` on a bench workload (one torch thread, as the test bed's workers)."""
    import torch

    from bench import workloads as W
    from stella.planning.measure import profile_model

    torch.set_num_threads(1)
    wl = W.get(name)
    model = wl.build_model(0)
    batches = wl.batches(0, 1, wl.batch_size, 0)
    doc = profile_model(model, wl.loss, lambda: next(batches), optimizer=wl.make_optimizer(model.parameters()),
                        batch_size=wl.batch_size, name=name, steps=steps, target=TARGETS.get(name),
                        factors=FACTORS.get(name, ()), log=log)
    return doc


def analytic_profile(name: str, numel: int, compute_s: float, batch_size: int, *, dense_iterations: float,
                     global_batch: int, critical_batch: float, target_source: str, factors: list[dict[str, Any]],
                     server: dict[str, Any] | None = None) -> dict[str, Any]:
    """A profile from the model's size alone (for scenarios beyond this machine): bytes
    from the coded bits per coordinate (:func:`stella.codec.coordinate_bits`; the
    broadcast as ``stella-ps`` runs it by default, :class:`stella_ps.config.Pulls`), the
    server's cost per coordinate from bench.server, the compressor at 1 ns per coordinate
    (a GPU's threshold pass)."""
    push = [{"density": d, "coding": c, "bytes": numel * d * coordinate_bits(d, c) / 8}
            for d in (0.001, 0.01, 0.1) for c in ("f16", "q4", "q2")]
    broadcast = Pulls().broadcast_info()
    assert broadcast is not None  # the daemon's default pulls are the broadcast
    pull = pull_section(broadcast, [{"density": d, "bytes": broadcast_bytes(numel, d, broadcast.factor,
                                                                            broadcast.values)}
                                    for d in (0.001, 0.01, 0.1)])
    return {"stella_profile": 1, "model": name, "numel": numel, "sparse_numel": numel, "batch_size": batch_size,
            "device": "analytic (not measured)", "compute_s": compute_s, "compress_s_per_numel": 1e-9,
            "push": push, "pull": pull,
            "server": dict(server or BENCH_SERVER),
            "target": {"dense_iterations": dense_iterations, "global_batch": global_batch,
                       "critical_batch": critical_batch, "source": target_source},
            "factors": factors, "revocation": {"stall_s": STALL_S, "source": STALL_SOURCE}}


# ============================================================ test-bed runs


@dataclass
class Run:
    name: str
    workload: str
    role: str  # "fit" or "held-out"
    world: int
    up: float  # Mbit/s of each worker site
    down: float
    density: float
    coding: str
    h: int
    max_h: int = 0  # 0: = h
    slowdown: list[float] = field(default_factory=list)  # per rank; empty: all 1
    steps: int = 30
    to_target: bool = False
    ps: float = PS_RATE  # Mbit/s of the server's site, each way (issue 47: shaped like the workers' sites)

    @property
    def skewed(self) -> bool:
        """Whether the workers run at unequal speeds."""
        return len(set(self.slowdown)) > 1

    def describe(self) -> str:
        link = f"{self.up:g}" if self.up == self.down else f"{self.up:g}/{self.down:g}"
        mix = " speeds " + ":".join(f"{1 / s:.2g}" for s in self.slowdown) if self.skewed else ""
        server = f" server {self.ps:g}" if self.ps != PS_RATE else ""
        return (f"{self.workload} W={self.world} {link} Mbit/s{server} {self.density:.2%} {self.coding} H={self.h}"
                + (f" (run-on to {self.max_h})" if self.max_h > self.h else "") + mix)


def runs(quick: bool) -> list[Run]:
    s = 20 if quick else 30
    fit = [
        Run("f1", "widemlp", "fit", 2, 100, 100, 0.01, "f16", 1, steps=s),
        Run("f2", "widemlp", "fit", 2, 20, 20, 0.01, "f16", 1, steps=s),
        Run("f3", "widemlp", "fit", 3, 50, 50, 0.03, "q4", 1, steps=s),
        Run("f4", "widemlp", "fit", 2, 10, 10, 0.003, "q2", 2, steps=s),
        Run("f5", "digits", "fit", 2, 100, 100, 0.01, "f16", 1, steps=3 * s),
    ]
    # the first round's held-out runs (2026-11-26 14:19): the model then missed them (17.8% MAPE, worst 33.5%)
    # for want of processor sharing on the test bed's 2 cores; since that model was shaped on them, they are
    # fit runs now, and the held-out runs below are new
    fit += [
        Run("h1", "widemlp", "fit", 4, 100, 100, 0.01, "f16", 1, steps=s),
        Run("h2", "widemlp", "fit", 2, 30, 30, 0.03, "f16", 1, steps=s),
        Run("h3", "widemlp", "fit", 2, 50, 10, 0.01, "q4", 1, steps=s),
        Run("h4", "widemlp", "fit", 3, 20, 20, 0.01, "q2", 4, steps=2 * s),
        Run("h5", "widemlp", "fit", 2, 100, 100, 0.01, "f16", 2, max_h=4, slowdown=[1.0, 2.0], steps=2 * s),
        Run("h7", "digits", "fit", 2, 100, 100, 0.01, "f16", 1, steps=400, to_target=True),
        Run("h8", "digits", "fit", 3, 20, 20, 0.03, "q4", 2, steps=400, to_target=True),
        Run("h9", "widemlp", "fit", 2, 50, 50, 0.01, "f16", 1, steps=200, to_target=True),
    ]
    # the second round's held-out runs (2026-11-26 15:31, processor sharing in, the compressor's time from a
    # cold first call at 1%): 14.4% MAPE, worst 39.6% (n2, 0.3% q2, over-predicted as f4 was: the compressor's
    # steady state is cheaper, and depends on density); fit runs since the profile measures that
    fit += [
        Run("n1", "widemlp", "fit", 3, 100, 100, 0.01, "q4", 2, steps=s),
        Run("n2", "widemlp", "fit", 4, 50, 50, 0.003, "q2", 1, steps=s),
        Run("n3", "widemlp", "fit", 2, 30, 30, 0.01, "q2", 1, max_h=2, slowdown=[1.0, 1.5], steps=2 * s),
        Run("n4", "widemlp", "fit", 2, 100, 20, 0.03, "q4", 2, steps=s),
        Run("n5", "widemlp", "fit", 3, 10, 10, 0.003, "q2", 4, steps=2 * s),
        Run("n6", "digits", "fit", 4, 50, 50, 0.01, "q4", 1, steps=400, to_target=True),
        Run("n7", "widemlp", "fit", 2, 100, 100, 0.01, "q4", 1, steps=200, to_target=True),
    ]
    # the third round's held-out runs (2026-11-26 15:41, steady compressor, burst, exchange-bound link fit):
    # 17.2% MAPE, worst 33.8% (r4: its pull lost its tail at 20 Mbit/s, bench.transport); fit runs since the
    # model has the tail loss and the fit takes a round's mean step
    fit += [
        Run("r1", "widemlp", "fit", 3, 30, 30, 0.003, "f16", 1, steps=s),
        Run("r2", "widemlp", "fit", 4, 100, 100, 0.01, "q2", 2, steps=s),
        Run("r3", "widemlp", "fit", 2, 50, 50, 0.03, "q2", 1, steps=s),
        Run("r4", "widemlp", "fit", 3, 50, 20, 0.01, "f16", 2, steps=s),
        Run("r5", "widemlp", "fit", 2, 20, 20, 0.003, "q4", 2, max_h=4, slowdown=[1.0, 2.0], steps=2 * s),
        Run("r6", "digits", "fit", 3, 100, 100, 0.01, "q2", 1, steps=400, to_target=True),
        Run("r7", "widemlp", "fit", 3, 100, 100, 0.005, "q4", 1, steps=200, to_target=True),
    ]
    # the fourth round's held-out runs (2026-11-26 19:10, tail loss above 1.0 x the queue, profiles from 15:38):
    # 18.7% MAPE, worst 52.6% (q8: 1.1 x the queue at 30 Mbit/s lost no tail, as bench.transport shows; and the
    # profiles predated the server's speed-ups of that afternoon); fit runs since
    fit += [
        Run("q1", "widemlp", "fit", 2, 20, 20, 0.01, "q4", 1, steps=s),
        Run("q2", "widemlp", "fit", 3, 10, 10, 0.003, "f16", 2, steps=s),
        Run("q3", "widemlp", "fit", 2, 50, 10, 0.005, "q4", 2, steps=s),
        Run("q4", "widemlp", "fit", 4, 50, 50, 0.01, "q4", 1, steps=s),
        Run("q5", "widemlp", "fit", 3, 20, 20, 0.03, "q4", 2, steps=s),
        Run("q6", "widemlp", "fit", 2, 100, 100, 0.03, "f16", 2, max_h=3, slowdown=[1.0, 1.4], steps=2 * s),
        Run("q7", "digits", "fit", 3, 30, 30, 0.01, "f16", 1, steps=400, to_target=True),
        Run("q8", "widemlp", "fit", 2, 30, 30, 0.01, "f16", 1, steps=200, to_target=True),
    ]
    # the fifth round's held-out runs (2026-11-26 19:42, fresh profiles, every fit run measured again, the
    # exchange bounded by the round): 14.6% MAPE, worst 49.5% (s5: a worker slower by waiting loads the shared
    # host less; and a to-target run's time held the registering worker's snapshot over its shaped link)
    fit += [
        Run("s1", "widemlp", "fit", 2, 20, 20, 0.005, "f16", 1, steps=s),
        Run("s2", "widemlp", "fit", 3, 10, 10, 0.01, "q2", 2, steps=s),
        Run("s3", "widemlp", "fit", 2, 30, 20, 0.01, "q4", 2, steps=s),
        Run("s4", "widemlp", "fit", 4, 100, 100, 0.03, "q2", 1, steps=s),
        Run("s5", "widemlp", "fit", 2, 50, 50, 0.003, "f16", 1, max_h=2, slowdown=[1.0, 1.6], steps=2 * s),
        Run("s6", "digits", "fit", 2, 10, 10, 0.03, "q4", 1, steps=400, to_target=True),
        Run("s7", "widemlp", "fit", 3, 30, 30, 0.01, "q2", 1, steps=200, to_target=True),
    ]
    # the sixth round's held-out runs (2026-11-26 19:55, a machine slower by waiting loads its host less):
    # 16.8% MAPE, worst 35.6% (t2, t4: rank 0's pace was not the job's, above); fit runs since
    fit += [
        Run("t1", "widemlp", "fit", 2, 20, 20, 0.01, "q2", 2, steps=s),
        Run("t2", "widemlp", "fit", 3, 50, 50, 0.005, "f16", 1, steps=s),
        Run("t3", "widemlp", "fit", 2, 100, 100, 0.01, "q4", 1, max_h=2, slowdown=[1.0, 1.4], steps=2 * s),
        Run("t4", "widemlp", "fit", 4, 30, 30, 0.003, "q4", 2, steps=s),
        Run("t5", "widemlp", "fit", 2, 10, 50, 0.01, "q4", 1, steps=s),
        Run("t6", "digits", "fit", 3, 50, 50, 0.03, "f16", 1, steps=400, to_target=True),
        Run("t7", "widemlp", "fit", 2, 50, 50, 0.005, "q2", 1, steps=200, to_target=True),
    ]
    # the seventh round's held-out runs (2026-11-26 20:02, the slowest worker's pace): 17.9% MAPE, worst 31.4%
    # (u5: the run's end, where the faster workers had left, counted in its pace; and every run's pace held
    # worker 0's evaluation stalls); fit runs since the measurement steps around both and the round is the
    # expected max of compute and exchange
    fit += [
        Run("u1", "widemlp", "fit", 3, 20, 20, 0.005, "q4", 1, steps=s),
        Run("u2", "widemlp", "fit", 2, 30, 30, 0.03, "q4", 2, steps=s),
        Run("u3", "widemlp", "fit", 4, 50, 50, 0.003, "f16", 1, steps=s),
        Run("u4", "widemlp", "fit", 2, 100, 10, 0.003, "q2", 2, steps=s),
        Run("u5", "widemlp", "fit", 3, 100, 100, 0.01, "f16", 2, max_h=3, slowdown=[1.0, 1.0, 1.5], steps=2 * s),
        Run("u6", "digits", "fit", 2, 20, 20, 0.01, "q2", 1, steps=400, to_target=True),
        Run("u7", "widemlp", "fit", 3, 50, 50, 0.01, "q4", 1, steps=200, to_target=True),
    ]
    # the eighth round's held-out runs (2026-11-26 22:16, the round as the expected max, the pace clear of
    # evaluations and of the run's end): 11.5% MAPE, worst 41.6% (v7: digits to the target, whose evaluations
    # leave no steps clear of them; a run to the target now measures its pace in a twin job); fit runs since
    fit += [
        Run("v1", "widemlp", "fit", 3, 30, 30, 0.01, "q2", 1, steps=s),
        Run("v2", "widemlp", "fit", 4, 20, 20, 0.005, "q4", 2, steps=s),
        Run("v3", "widemlp", "fit", 2, 50, 50, 0.003, "q2", 1, steps=s),
        Run("v4", "widemlp", "fit", 3, 100, 30, 0.03, "q4", 1, steps=s),
        Run("v5", "widemlp", "fit", 3, 50, 50, 0.005, "f16", 2, max_h=3, slowdown=[1.0, 1.0, 1.6], steps=2 * s),
        Run("v6", "widemlp", "fit", 4, 100, 100, 0.003, "q2", 1, steps=s),
        Run("v7", "digits", "fit", 3, 20, 20, 0.005, "f16", 1, steps=400, to_target=True),
        Run("v8", "widemlp", "fit", 2, 30, 30, 0.01, "q4", 2, steps=200, to_target=True),
    ]
    # the ninth round's held-out runs (2026-11-26 22:46): 13.9% MAPE, worst 27.1%, time to target +6%, -22%: the
    # goals met. Fit runs since; the tenth round keeps the ninth's fit (they stay out of --fit) and judges the
    # same model on new runs
    fit += [
        Run("w1", "widemlp", "fit", 2, 20, 20, 0.003, "f16", 2, steps=s),
        Run("w2", "widemlp", "fit", 3, 100, 100, 0.03, "q2", 2, steps=s),
        Run("w3", "widemlp", "fit", 4, 30, 30, 0.01, "q4", 1, steps=s),
        Run("w4", "widemlp", "fit", 2, 50, 20, 0.005, "q2", 1, steps=s),
        Run("w5", "widemlp", "fit", 2, 30, 30, 0.01, "f16", 2, max_h=4, slowdown=[1.0, 1.7], steps=2 * s),
        Run("w6", "digits", "fit", 2, 50, 50, 0.03, "q4", 1, steps=400, to_target=True),
        Run("w7", "widemlp", "fit", 3, 100, 100, 0.005, "q2", 2, steps=200, to_target=True),
        Run("w8", "digits", "fit", 4, 30, 30, 0.01, "f16", 1, steps=400, to_target=True),
    ]
    # the tenth round's held-out runs (2026-11-26 23:12, round 9's model and fit unchanged): 12.6% MAPE, worst
    # 37.8% (x7: digits at W = 3, whose 8 ms steps feel a worker's fixed CPU per round; rounds 8-9 had v7 and
    # w8 low too), time to target -11%, +12%; fit runs since the model has worker_round_s
    fit += [
        Run("x1", "widemlp", "fit", 3, 20, 20, 0.01, "f16", 2, steps=s),
        Run("x2", "widemlp", "fit", 2, 100, 100, 0.005, "q4", 1, steps=s),
        Run("x3", "widemlp", "fit", 4, 50, 50, 0.01, "q2", 2, steps=s),
        Run("x4", "widemlp", "fit", 2, 30, 100, 0.03, "q2", 1, steps=s),
        Run("x5", "widemlp", "fit", 3, 30, 30, 0.003, "q4", 2, max_h=3, slowdown=[1.0, 1.0, 1.4], steps=2 * s),
        Run("x6", "widemlp", "fit", 4, 20, 20, 0.003, "f16", 1, steps=s),
        Run("x7", "digits", "fit", 3, 100, 100, 0.01, "q4", 1, steps=400, to_target=True),
        Run("x8", "widemlp", "fit", 2, 50, 50, 0.01, "f16", 1, steps=200, to_target=True),
    ]
    # the eleventh round's held-out runs (2026-11-26 23:20, worker_round_s): 6.6% MAPE, worst 11.3%, time to
    # target +20%, -19% (y7, y8 measured again at 23:28 after the shaping fix). Fit runs since; the twelfth
    # round keeps the eleventh's fit (they stay out of --fit) and judges the same model on new runs
    fit += [
        Run("y1", "widemlp", "fit", 2, 30, 30, 0.005, "f16", 1, steps=s),
        Run("y2", "widemlp", "fit", 3, 50, 20, 0.003, "q4", 2, steps=s),
        Run("y3", "widemlp", "fit", 4, 100, 100, 0.005, "q4", 2, steps=s),
        Run("y4", "widemlp", "fit", 2, 20, 20, 0.03, "q2", 2, steps=s),
        Run("y5", "widemlp", "fit", 2, 100, 100, 0.003, "q2", 1, max_h=2, slowdown=[1.0, 1.5], steps=2 * s),
        Run("y6", "digits", "fit", 4, 50, 50, 0.01, "q2", 1, steps=3 * s),
        Run("y7", "digits", "fit", 3, 30, 30, 0.01, "f16", 1, steps=400, to_target=True),
        Run("y8", "widemlp", "fit", 3, 30, 30, 0.01, "q4", 1, steps=200, to_target=True),
    ]
    held = [
        Run("z1", "widemlp", "held-out", 3, 100, 100, 0.003, "f16", 1, steps=s),
        Run("z2", "widemlp", "held-out", 2, 50, 50, 0.01, "q2", 2, steps=s),
        Run("z3", "widemlp", "held-out", 4, 30, 30, 0.005, "q2", 1, steps=s),
        Run("z4", "widemlp", "held-out", 3, 20, 100, 0.01, "q4", 2, steps=s),
        Run("z5", "widemlp", "held-out", 3, 50, 50, 0.01, "q4", 2, max_h=3, slowdown=[1.0, 1.0, 1.5], steps=2 * s),
        Run("z6", "digits", "held-out", 2, 30, 30, 0.01, "q4", 1, steps=3 * s),
        Run("z7", "digits", "held-out", 4, 20, 20, 0.01, "q2", 1, steps=400, to_target=True),
        Run("z8", "widemlp", "held-out", 2, 20, 20, 0.01, "q4", 1, steps=200, to_target=True),
    ]
    # the twelfth round's held-out runs (2026-11-26 23:30): 12.0% MAPE, worst 26.8%, the goals met; fit runs since.
    # Then issue 47 found the model 33-56% high on exchange-bound runs whose server site was shaped too (every run
    # above gives the server 1000 Mbit/s), and a workload outside the fit off by up to 56%
    fit += [dataclasses.replace(r, role="fit") for r in held]
    # the server's site shaped like the workers' (links as they are; the model's server link is full duplex
    # since issue 47): fit runs, several bound by their exchange
    fit += [
        Run("k1", "widemlp", "fit", 2, 30, 30, 0.1, "f16", 1, steps=20, ps=30),
        Run("k2", "widemlp", "fit", 3, 10, 10, 0.03, "q4", 1, steps=20, ps=10),
        Run("k3", "widemlp", "fit", 2, 100, 100, 0.01, "f16", 1, steps=s, ps=100),
        Run("k4", "digits", "fit", 3, 50, 50, 0.03, "f16", 1, steps=3 * s, ps=50),
        Run("k5", "widemlp", "fit", 4, 50, 50, 0.01, "q4", 2, steps=s, ps=50),
        Run("k6", "widemlp", "fit", 2, 20, 20, 0.03, "q2", 1, steps=s, ps=20),
    ]
    # held out: a workload outside the fit (the AdamW byte LM, 10.8M parameters in 76 tensors: neither the
    # optimizer nor the model's shape of the two fitted), predicted from its own fresh profile and the fit's
    # coefficients; half of them with the server's site shaped, several bound by their exchange
    held = [
        Run("g1", "bytelm", "held-out", 2, 100, 100, 0.01, "f16", 1, steps=s),
        Run("g2", "bytelm", "held-out", 2, 20, 20, 0.03, "f16", 1, steps=s, ps=20),
        Run("g3", "bytelm", "held-out", 3, 50, 50, 0.01, "q4", 1, steps=s, ps=50),
        Run("g4", "bytelm", "held-out", 2, 10, 10, 0.01, "f16", 1, steps=s, ps=10),
        Run("g5", "bytelm", "held-out", 3, 30, 30, 0.005, "q2", 2, steps=s),
        Run("g6", "bytelm", "held-out", 2, 100, 100, 0.1, "f16", 1, steps=s, ps=100),
        Run("g7", "bytelm", "held-out", 4, 30, 30, 0.01, "q2", 1, steps=s, ps=30),
        Run("g8", "bytelm", "held-out", 2, 50, 10, 0.03, "q4", 2, steps=s, ps=50),
    ]
    # round 13 (2026-12-02 08:16, g1-g8 and the pick): 13.3% / 28.4%, the pick -20.9%: every compute-bound byte LM
    # run was 15-28% low. The byte LM's steps are 8x widemlp's, so the background work (compressors, the server)
    # that the fit had counted whole in the host's load hid how steps share the cores; its share is a coefficient
    # since (Calibration.background). Round 14 judges that on new runs of the same held-out workload
    # (--only g9,...,g16,p1), with round 13's fit runs (--fit-from)
    held += [
        Run("g9", "bytelm", "held-out", 2, 30, 30, 0.1, "q4", 1, steps=s, ps=30),
        Run("g10", "bytelm", "held-out", 3, 100, 100, 0.003, "f16", 1, steps=s),
        Run("g11", "bytelm", "held-out", 2, 50, 50, 0.03, "q2", 2, steps=s, ps=50),
        Run("g12", "bytelm", "held-out", 4, 50, 50, 0.005, "q4", 1, steps=s, ps=50),
        Run("g13", "bytelm", "held-out", 2, 10, 30, 0.01, "q4", 1, steps=s, ps=30),
        Run("g14", "bytelm", "held-out", 3, 20, 20, 0.03, "f16", 1, steps=s, ps=20),
        Run("g15", "bytelm", "held-out", 2, 100, 50, 0.01, "q2", 4, steps=2 * s),
        Run("g16", "bytelm", "held-out", 2, 10, 10, 0.03, "q4", 1, steps=s, ps=10),
    ]
    if quick:
        held = held[:6]
    return fit + held


def testbed_catalog_doc(r: Run) -> dict[str, Any]:
    """The run as the planner sees it, as a catalog's tables: one machine kind per distinct
    worker speed, the sites' links, the server's site at its rate (1000 Mbit/s unless the run
    shapes it), all on one shared host (this machine's cores)."""
    kinds: dict[float, int] = {}
    for f in r.slowdown or [1.0] * r.world:
        kinds[f] = kinds.get(f, 0) + 1
    return {
        "hosts": {"bed": {"cores": os.cpu_count() or 1}},  # every worker and stella-ps share this machine
        "server": {"price": 0, "cores": 2, "up_mbps": r.ps, "down_mbps": r.ps, "host": "bed"},
        "kinds": {f"site-x{f:g}": {"gpu": "cpu", "speed": 1 / f, "count": n, "onprem": True, "up_mbps": r.up,
                                   "down_mbps": r.down, "host": "bed",
                                   "burst_kb": tbf_burst_bytes(min(r.up, r.down)) / 1024,
                                   # the downlink's tbf sits at the hub, a hop from the sender (the server):
                                   # its queue drops; the uplink's, on the worker's own interface, pushes back
                                   "down_queue_ms": TBF_QUEUE_MS}
                  for f, n in kinds.items()}}


def testbed_spec(r: Run) -> str:
    """The run's configuration in ``stella plan --config``'s syntax, on :func:`testbed_catalog_doc`."""
    kinds = testbed_catalog_doc(r)["kinds"]
    machines = "+".join(f"{k['count']}x{name}" for name, k in kinds.items())
    return f"machines={machines},density={r.density!r},coding={r.coding},H={r.h},shards=1"


def testbed_row(r: Run) -> dict[str, Any]:
    """What a row of the output adds for ``stella calibrate``: the run's catalog and configuration."""
    return {"spec": testbed_spec(r), "catalog": testbed_catalog_doc(r)}


PICK_RATE, PICK_MOST = 100.0, 3  # the pick's test bed: up to 3 sites at 100 Mbit/s, the server's site too


def pick_catalog_doc(rate: float = PICK_RATE, most: int = PICK_MOST) -> dict[str, Any]:
    """The test bed as a user would describe it to ``stella plan`` before choosing: up to
    ``most`` like sites at ``rate`` Mbit/s each way, the server's site at the same rate, one
    ``stella-ps`` (the bench runs one), all on this host."""
    doc = testbed_catalog_doc(Run("pick", "", "pick", 1, rate, rate, 0.01, "f16", 1, ps=rate))
    doc["server"]["max_shards"] = 1
    (kind,) = doc["kinds"].values()
    doc["kinds"] = {"site-x1": {**kind, "count": f"up to {most}"}}
    return doc


def own_pick(prof: Profile, workload: str, steps: int) -> tuple[Run, Prediction]:
    """``stella plan``'s fastest configuration for ``prof`` on :func:`pick_catalog_doc`, as a
    run of the test bed (role "pick"), and the plan's prediction of it. The run takes ``steps``
    iterations, and at least 16 rounds' worth at a large H, so that its pace is measured over
    rounds."""
    cat = catalog_from_dict(pick_catalog_doc(), "test bed (the plan's own pick)")
    # what a user would give: iterations that fall with the global batch (else one site is always fastest),
    # and the byte LM's measured factors (bench/RESULTS.md), so the pick weighs H and density as measured
    prof = dataclasses.replace(
        prof, dense_iterations=2000, target_batch=prof.batch_size, critical_batch=64 * prof.batch_size,
        target_source="assumed for the pick: 2,000 iterations at one site's batch, falling with the global batch",
        factors=tuple((f["density"], f["coding"], f["H"], f["factor"], f["source"], f.get("workers"))
                      for f in FACTORS["lm"]))
    best = plan(cat, prof, max_shards=1).rows[0]
    c = best.config
    run = Run("p1", workload, "pick", c.workers, PICK_RATE, PICK_RATE, c.density, c.coding, c.sync_every,
              steps=max(steps, 16 * c.sync_every), ps=PICK_RATE)
    return run, best


def testbed_catalog(r: Run) -> tuple[Catalog, Config]:
    """The run as the planner sees it (:func:`testbed_catalog_doc`) and its configuration."""
    cat = catalog_from_dict(testbed_catalog_doc(r), f"test bed ({r.name})")
    return cat, parse_config(testbed_spec(r), cat)


def _shape_after_join(bed, r: Run, model_bytes: int, stop: threading.Event) -> None:
    """Set every worker site's link to the run's rate once the model's first copy is in: the registering
    worker's upload has reached the server, or W - 1 worker sites have had a snapshot come down them. Since
    protocol 7 (2026-11-28) a worker whose values are those the job was created with (the same seed) pulls
    no snapshot, so the upload is the one copy; workers starting together send the values once (probes are
    held while one uploads, protocol 6). Bounded by ``stop`` and 300 s. (Until 2026-11-28 every worker but
    the registering one pulled a snapshot, and the watcher waited for W - 1 of them: 39 MB on 30 Mbit/s
    links, 11 s inside round 11's first time to target, when it shaped earlier.)"""
    sites = [f"w{i}" for i in range(r.world)]
    deadline = time.monotonic() + 300
    while not stop.is_set() and time.monotonic() < deadline:
        uploaded = bed.counters("ps")["rx_bytes"] >= 0.98 * model_bytes
        if uploaded or sum(bed.counters(site)["rx_bytes"] >= 0.98 * model_bytes for site in sites) >= r.world - 1:
            for site in sites:
                bed.set_rate(site, up=r.up, down=r.down)
            if r.ps != PS_RATE:
                bed.set_rate("ps", up=r.ps, down=r.ps)
            return
        stop.wait(0.2)


WARM_ROUNDS = 4  # a worker's rounds before this are its join, snapshot and warm-up
SETTLE_ROUNDS = 2  # rounds after an evaluation ends before the workers are in step again


def clean_measure(ranks: Sequence[Mapping[str, Any]], h: int, skewed: bool = False) -> dict[str, Any]:
    """A job's pace, compute and exchange from its workers' iteration records (bench.stella_e2e), on
    the iterations clear of worker 0's held-out evaluations.

    Worker 0 evaluates between steps (its own clock leaves that out), and the job stalls meanwhile:
    the others finish the step in hand, push, and wait for worker 0's next push. Counted, each stall
    lifts the others' pace (2026-11-26 round 7: widemlp evaluates every 5 steps, ~0.25 s each on
    this bed, +10-20% s/it). Worker 0's clock alone is no cure: while it evaluates, the others run
    a step or two ahead on the freed cores, and its next rounds find their pulls waiting (-10-25%).
    So an iteration counts where it neither overlaps an evaluation nor starts within
    :data:`SETTLE_ROUNDS` rounds after one ends, and only once every worker has made
    :data:`WARM_ROUNDS` rounds (a worker that registered first runs rounds alone until the others
    join).

    Returns ``s_per_it`` and ``round_s`` (the slowest worker's: its mean clean iteration x its
    iterations per round, over H), ``round_s_per_rank``, ``compute_s`` / ``compute_mean_s`` (the
    slowest worker's clean steps, median and mean), ``exchange_s`` (per round, compressor included:
    the workers' mean, or with unequal speeds the slowest one's; summed over the clean iterations
    where the records carry the running totals, else the whole run's), ``clean_share``."""
    def epoch_span(x: Mapping[str, Any]) -> tuple[float, float]:
        return x["t_epoch"] - x["iter"], x["t_epoch"]

    warm_from = max(next((x["t_epoch"] for x in k["iters"] if x["rounds"] >= WARM_ROUNDS), k["iters"][-1]["t_epoch"])
                    for k in ranks)
    warm = [[x for x in k["iters"] if x["t_epoch"] >= warm_from] or k["iters"][len(k["iters"]) // 3:]
            for k in ranks]
    # and up to the end: once a worker has made its last step, the others' rounds wait for it to leave (u5 in
    # round 7: 0.8-2.7 s steps at the end of a run-on run, the faster workers at their step cap first)
    finish = min(epoch_span(k["iters"][-1])[0] for k in ranks)
    warm = [[x for x in w if x["t_epoch"] <= finish] or w for w in warm]

    # each worker's iteration before each of its iterations (by step), to difference its running totals
    before = [{x["step"]: p for p, x in itertools.pairwise(k["iters"])} for k in ranks]

    def started(i: int, its: Sequence[Mapping[str, Any]], key: str = "rounds") -> float:
        """What ``key``'s running total gained over ``its`` (iterations of worker ``i``)."""
        return sum(x[key] - before[i][x["step"]][key] if x["step"] in before[i] else 0.0 for x in its)

    def steps_per_round(i: int, w: Sequence[Mapping[str, Any]]) -> float:
        """A worker's steps per round (run-on: a faster worker makes more) between the first and the
        last of its warm steps that started a round (whole rounds: no edge counted half)."""
        firsts = [x for x in w if started(i, [x]) > 0]
        if len(firsts) < 2:
            return len(w) / max(1.0, started(i, w))
        return (firsts[-1]["step"] - firsts[0]["step"]) / (firsts[-1]["rounds"] - firsts[0]["rounds"])

    per_round = [steps_per_round(i, w) for i, w in enumerate(warm)]
    settle = SETTLE_ROUNDS * max(statistics.median(x["iter"] for x in w) * pr for w, pr in zip(warm, per_round))
    stalls = evaluation_stalls(ranks[0], settle)
    clean = [[x for x in w if clear_of(x, stalls)] for w in warm]
    clean = [c if len(c) >= 3 else w for c, w in zip(clean, warm)]  # too few: the warm iterations, stalls and all
    paces = [statistics.mean(x["iter"] for x in c) * pr for c, pr in zip(clean, per_round)]
    slow = max(range(len(ranks)), key=lambda i: statistics.mean(x["compute"] for x in clean[i]))

    def exchange(i: int) -> float:
        k, c = ranks[i], clean[i]
        rounds = started(i, c)
        if "exchange_s" in c[0] and rounds:  # the running totals, differenced over the clean iterations
            return (started(i, c, "exchange_s") + started(i, c, "compress_s")) / rounds
        return (k["exchange_s"] + k["compress_s"]) / max(1, k["rounds"])

    round_s = max(paces)
    return {"s_per_it": round_s / h, "round_s": round_s, "round_s_per_rank": paces,
            "compute_s": statistics.median(x["compute"] for x in clean[slow]),
            "compute_mean_s": statistics.mean(x["compute"] for x in clean[slow]),
            "exchange_s": exchange(slow) if skewed else statistics.mean(exchange(i) for i in range(len(ranks))),
            "clean_share": sum(map(len, clean)) / max(1, sum(map(len, warm)))}


def remeasure(r: Run, m: Mapping[str, Any]) -> dict[str, Any]:
    """An earlier run's measurement, taken again from its workers' logs by :func:`clean_measure`."""
    from bench.harness import collect_ranks

    ranks = [k for k in collect_ranks(m["log_dir"], r.world) if k is not None]
    return {**m, **clean_measure(ranks, r.h, skewed=r.skewed)}


PACE_STEPS = {"digits": 90, "widemlp": 30}  # a to-target run's twin, which measures its pace


def measure(r: Run, model_bytes: int, log=print) -> dict[str, Any]:
    """One real job over the test bed; what it measured (per round, per step, to target).

    A run to the target evaluates worker 0's model every few steps, and the job stalls meanwhile
    (:func:`clean_measure`): digits evaluates for 60-85 ms every 5 steps of 30-40 ms, so no
    stretch of its steps is clear of them (2026-11-26 round 8: its pace read 12-42% slow). Its
    pace, compute and exchange therefore come from a twin job of the same configuration that
    evaluates only at its end (:data:`PACE_STEPS` steps); the run itself gives the time and the
    iterations to the target, and its own pace is kept as ``with_evaluations``."""
    if not r.to_target:
        return _job(r, model_bytes, log)
    pace = _job(dataclasses.replace(r, name=f"{r.name} pace", to_target=False, steps=PACE_STEPS[r.workload]),
                model_bytes, log)
    target = _job(r, model_bytes, log)
    keys = ("s_per_it", "round_s", "round_s_per_rank", "compute_s", "compute_mean_s", "exchange_s", "clean_share",
            "log_dir")
    return {**target, **{k: pace[k] for k in keys},
            "with_evaluations": {k: target[k] for k in keys}}


def _job(r: Run, model_bytes: int, log=print) -> dict[str, Any]:
    from bench.harness import collect_ranks
    from bench.stella_e2e import run_stella
    from bench.wan import Link, WanTestbed

    # Every worker site starts at the server's rate, and a watcher sets each site's own rate once the model's
    # first copy (registration, snapshot: 39 MB for widemlp) has crossed its link: the runs measure the rounds,
    # not that copy. (Over 10 Mbit/s the copy once outlasted the liveness timeout and the workers reconnected
    # for ever; fixed since, in the client and the server: tests/test_liveness.py, test_steps.py.)
    sites = {"ps": Link(PS_RATE, PS_RATE), **{f"w{i}": Link(PS_RATE, PS_RATE) for i in range(r.world)}}
    t0 = time.time()
    with WanTestbed(sites, max_lifetime=900) as bed:
        stop = threading.Event()
        watcher = threading.Thread(target=_shape_after_join, args=(bed, r, model_bytes, stop), daemon=True)
        watcher.start()
        try:
                res = run_stella(r.workload, world=r.world, steps=r.steps, max_seconds=150, bed=bed,
                             sites=[f"w{i}" for i in range(r.world)], density=r.density, value_dtype=r.coding,
                             sync_every=r.h, max_sync_every=r.max_h or r.h, max_accumulate=1, mode="update",
                             slowdown=r.slowdown or 1.0, stop_at_target=r.to_target, log_dir=OUT_DIR,
                             eval_every=None if r.to_target else 10 ** 6)  # no evaluation stalls to step around
        finally:
            stop.set()
            watcher.join(timeout=5)
    if not res.get("ok"):
        raise RuntimeError(f"{r.name}: {res.get('error', '')[:2000]}")
    ranks = [k for k in collect_ranks(res["log_dir"], r.world) if k is not None]
    out = clean_measure(ranks, r.h, skewed=r.skewed)
    reached = res.get("reached")
    out.update({"log_dir": res["log_dir"], "steps": res["steps"], "iter_median": res["iter_median"],
                "reached": reached, "final_metric": res.get("final_metric"),
                "bytes_per_round": res.get("client_bytes_per_round"),
                "server_cpu_ms_per_round": res.get("server_cpu_ms_per_round"), "wall_s": time.time() - t0})
    log(f"  {r.name} {r.describe()}: {out['s_per_it']:.4f} s/it (round {out['round_s']:.3f} s), compute "
        f"{out['compute_s']:.4f} s, exchange {out['exchange_s']:.3f} s/round, {out['clean_share']:.0%} of warm "
        "iterations clear of evaluations"
        + (f", target at {reached['step']} it / {reached['wall']:.1f} s" if reached else "")
        + f" [{out['wall_s']:.0f} s]")
    return out


# ============================================================ scenarios


def lm_profile(numel: float, compute_s: float, batch: int, name: str, dense_iterations: float,
               server: dict[str, Any] | None = None) -> Profile:
    doc = analytic_profile(name, int(numel), compute_s, batch, dense_iterations=dense_iterations,
                           global_batch=batch * 8, critical_batch=batch * 64,
                           target_source="assumed: a pre-training budget (scenario, not measured)",
                           factors=FACTORS["lm"], server=server)
    return profile_from_dict(doc, f"<{name}>")


def restricted(cat: Catalog, keep) -> Catalog:
    return dataclasses.replace(cat, kinds=tuple(k for k in cat.kinds if keep(k)))


EXAMPLE_PROFILE = os.path.join(REPO, "docs", "profile.example.json")
DENSE_350M, DEADLINE_H = 100_000, 8  # the lab alone needs ~15 h: it cannot meet the deadline


def hybrid_scenario(cal: Calibration | None, log=print) -> dict[str, Any]:
    """The lab's GPUs, rented GPUs, and both, for a 350M-parameter LM on the example catalog."""
    cat = load_catalog(os.path.join(REPO, "docs", "catalog.example.toml"))
    # 350M parameters, 8 x 1024 tokens per GPU step, ~60 TFLOP/s sustained on an RTX 4090 (6 N tokens FLOPs)
    numel, tokens = 350e6, 8 * 1024
    compute_s = 6 * numel * tokens / 60e12
    prof = lm_profile(numel, compute_s, 8, "LM 350M (scenario)", dense_iterations=DENSE_350M)
    if cal is not None:  # the link coefficient and fixed round overhead measured on the test bed; compute as profiled
        prof = dataclasses.replace(prof, calibration=dataclasses.replace(
            cal, compute=1.0, source=f"test bed fit ({cal.runs} runs), compute as profiled"))
    # the README's worked example reads this profile (analytic, labelled as such)
    doc = dict(prof.raw)
    doc["calibration"] = dataclasses.asdict(prof.calibration)
    doc["device"] = ("analytic scenario profile written by python -m bench.plan (not measured): 350M parameters, "
                     "6 N tokens FLOPs at 60 TFLOP/s on an RTX 4090")
    write_profile(EXAMPLE_PROFILE, doc)
    deadline = DEADLINE_H * 3600.0
    out: dict[str, Any] = {"model": prof.model, "compute_s": compute_s, "deadline_h": deadline / 3600,
                           "prices": cat.prices_note}
    rows: dict[str, dict[str, Any]] = {}
    for label, c in (("on-premises only", restricted(cat, lambda k: k.onprem)),
                     ("cloud only", restricted(cat, lambda k: not k.onprem)),
                     ("hybrid", cat)):
        cheapest = plan(c, prof, deadline_s=deadline)
        fastest = plan(c, prof)
        pick = cheapest.rows[0] if cheapest.rows else fastest.rows[0]
        rows[label] = {"row": pick, "meets_deadline": bool(cheapest.rows), "fastest": fastest.rows[0],
                       "result": cheapest}
    # savings: cloud cost against cloud alone (both within the deadline), time against the lab alone
    h, cl, lab = rows["hybrid"]["row"], rows["cloud only"]["row"], rows["on-premises only"]["row"]
    out["rows"] = {k: summary(v["row"]) | {"meets_deadline": v["meets_deadline"],
                                           "fastest": summary(v["fastest"])} for k, v in rows.items()}
    def cloud_cost(p: Prediction) -> float:
        return sum(g.count * g.kind.price_of(g.market) for g in p.config.groups) * p.time_s / 3600

    out["cloud_cost_saving"] = 1 - cloud_cost(h) / cloud_cost(cl) if cloud_cost(cl) > 0 else None
    out["cost_saving"] = 1 - h.cost / cl.cost
    out["time_saving_vs_lab"] = 1 - h.time_s / lab.time_s
    out["time_saving_vs_cloud"] = 1 - h.time_s / cl.time_s
    pareto_plot(rows["hybrid"]["result"], os.path.join(REPO, "bench", "plan_pareto.png"),
                  title=f"{prof.model}: hybrid catalog, deadline {DEADLINE_H} h (illustrative prices)")
    log(f"\nHybrid scenario: {prof.model}, {compute_s:.2f} s/step per RTX 4090, {DENSE_350M:,} dense iterations at "
        f"batch 64, deadline {DEADLINE_H} h, prices: {cat.prices_note}")
    log(table([rows[k]["row"] for k in ("on-premises only", "cloud only", "hybrid")], cat.currency))
    log(f"  hybrid against cloud only: {100 * out['cost_saving']:.0f}% less cost "
        f"({100 * (out['cloud_cost_saving'] or 0):.0f}% "
        f"less cloud spend), {_less(out['time_saving_vs_cloud'])} time; against the lab alone: "
        f"{_less(out['time_saving_vs_lab'])} time")
    log(recommend(h))
    return out


def chaos_check(log=print) -> dict[str, Any]:
    """The revocation model against bench.chaos's measurement (bench/CHAOS.json, 2026-11-23): 3 workers at
    20 Mbit/s, the demo MLP (hidden 256) at 5%, update mode, 0.03 s of stand-in compute a step; one worker
    killed every 15 s (each back 5 s later), the server killed once, a checkpoint every 20 steps; target
    version 1500. The model sees it as 3 spot machines revoked every 45 s each and a server failing once a
    minute; the ratio of its times with and without revocations against the measured ratios."""
    with open(os.path.join(REPO, "bench", "CHAOS.json")) as f:
        chaos = json.load(f)
    undisturbed = [r["time_to_target_s"] for r in chaos["rows"] if r["run"] == "undisturbed"]
    s_it = statistics.mean(undisturbed) / chaos["target_version"]
    numel = 64 * 256 + 256 + 256 * 10 + 10
    doc = analytic_profile("demo MLP (chaos)", numel, s_it, 32, dense_iterations=chaos["target_version"],
                           global_batch=96, critical_batch=0, target_source="bench/CHAOS.json target version",
                           factors=[{"density": 0.05, "coding": "f16", "H": 1, "factor": 1.0, "source": "chaos"}])
    prof = profile_from_dict(doc, "<chaos>")
    kinds = {"w": {"gpu": "cpu", "speed": 1.0, "count": 3, "price": 1.0, "spot_price": 1.0, "mttr_h": 45 / 3600,
                   "replace_s": 5.0, "up_mbps": 20, "down_mbps": 20}}
    server = {"price": 0, "up_mbps": 100, "down_mbps": 100}
    calm = catalog_from_dict({"server": server, "kinds": kinds}, "<chaos>")
    rough = catalog_from_dict({"server": {**server, "mttr_h": 60 / 3600}, "kinds": kinds}, "<chaos>")
    cfg = lambda cat, m: Config((Group(cat.kinds[0], m, 3),), 0.05, "f16", 1, 1)
    t0 = predict(prof, calm, cfg(calm, "ondemand"), checkpoint_every=20).time_s
    t1 = predict(prof, rough, cfg(rough, "spot"), checkpoint_every=20).time_s
    out = {"predicted_ratio": t1 / t0, "measured_ratios": chaos["ratios"]}
    log(f"\nRevocation model against bench.chaos (bench/CHAOS.json): predicted time-to-target ratio "
        f"{t1 / t0:.3f}, measured " + ", ".join(f"{r:.3f}" for r in chaos["ratios"]))
    return out


def summary(p: Prediction) -> dict[str, Any]:
    return {"machines": p.config.machines, "W": p.config.workers, "density": p.config.density,
            "coding": p.config.coding, "H": p.config.sync_every, "shards": p.config.shards, "s_per_it": p.s_per_it,
            "bound": p.bound, "compute_s": p.compute_s, "link_s": p.link_s, "server_s": p.server_s,
            "iterations": p.iterations, "time_h": p.time_s / 3600, "cost": p.cost,
            "revocation_share": p.revocation_cost / p.cost if p.cost > 0 else 0.0}


def billion_scenario(cal: Calibration | None, server: dict[str, Any] | None, log=print) -> dict[str, Any]:
    """1B parameters on 32 consumer GPUs (RTX 4090 class), each its own site at 100 Mbit/s."""
    numel, tokens, w = 1e9, 8 * 1024, 32
    compute_s = 6 * numel * tokens / 60e12  # ~0.82 s per step at 60 TFLOP/s sustained
    prof = lm_profile(numel, compute_s, 8, "LM 1B (scenario)", dense_iterations=50_000, server=server)
    if cal is not None:
        prof = dataclasses.replace(prof, calibration=dataclasses.replace(
            cal, compute=1.0, source=f"test bed fit ({cal.runs} runs), compute as profiled"))
    cat = catalog_from_dict({
        "prices_note": "scenario: prices do not matter here",
        "server": {"name": "cloud CPU host, 10 Gbit/s", "price": 0, "cores": 16, "up_mbps": 10000,
                   "down_mbps": 10000},
        "kinds": {"4090-site": {"gpu": "RTX 4090", "speed": 1.0, "count": w, "onprem": True, "up_mbps": 100,
                                "down_mbps": 100, "rtt_ms": 40}}}, "<1B scenario>")
    group = (Group(cat.kinds[0], "onprem", w),)
    rows = []
    for d in (0.01, 0.003, 0.001):
        for c in ("f16", "q4", "q2"):
            for h in (1, 2, 4, 8):  # the factors table goes to H = 8
                for s in (1, 4, 16):
                    rows.append(predict(prof, cat, Config(group, d, c, h, s)))
    ddp_bytes = 2 * (w - 1) / w * 4 * numel  # ring all-reduce, fp32, each way per step
    ddp_s = max(compute_s, ddp_bytes / (100e6 / 8))  # overlapped with backward at best
    # Stella's throughput against compute-bound, and against the iterations it costs
    best_raw = max(rows, key=lambda p: compute_s / p.s_per_it / p.factor)
    one_shard = [p for p in rows if p.config.shards == 1]
    best_one = max(one_shard, key=lambda p: compute_s / p.s_per_it / p.factor)
    picks = {"best": best_raw, "best with one shard": best_one,
             "1% f16 H=1, one shard": next(p for p in rows if p.config.density == 0.01 and p.config.coding == "f16"
                                            and p.config.sync_every == 1 and p.config.shards == 1)}
    out: dict[str, Any] = {"numel": numel, "workers": w, "compute_s": compute_s, "ddp_s_per_it": ddp_s,
                           "ddp_share": compute_s / ddp_s, "server": dict(prof.raw["server"]), "rows": {}}
    log(f"\n1B-parameter scenario: 32 sites x 1 RTX 4090-class GPU, 100 Mbit/s each way, server host 10 Gbit/s "
        f"(server cost per pushed coordinate {1e9 * prof.server_per_update_s:.0f} ns, per model coordinate "
        f"{1e9 * prof.server_per_numel_s:.1f} ns: {prof.raw['server'].get('source', '')})")
    log(f"  compute {compute_s:.2f} s/step; DDP (ring all-reduce, fp32): {ddp_bytes / 1e9:.2f} GB each way per step, "
        f"{ddp_s:.0f} s/it: {100 * compute_s / ddp_s:.2f}% of compute-bound throughput")
    for k, p in picks.items():
        share = compute_s / p.s_per_it
        parts = {"compute": p.compute_s, "link (push+pull)": p.link_s, "server": p.server_s}
        out["rows"][k] = summary(p) | {"share": share, "share_per_iteration_factor": share / p.factor,
                                       "factor": p.factor, "vs_ddp": ddp_s / p.s_per_it}
        log(f"  {k:24s} {p.config.density:.2%} {p.config.coding} H={p.config.sync_every} shards="
            f"{p.config.shards}: {p.s_per_it:.3f} s/it, {100 * share:.0f}% of compute-bound "
            f"({100 * share / p.factor:.0f}% after the x{p.factor:.2f} iterations), {ddp_s / p.s_per_it:.0f}x "
            f"DDP's speed; per round: " + ", ".join(f"{n} {v:.2f} s" for n, v in parts.items())
            + f"; limited by {p.bound}")
    return out


# ============================================================ main


def calibration_for(workload: str, cals: Mapping[str, Calibration]) -> Calibration:
    """The fit's coefficients for ``workload``: its own where it had fit runs; for a workload
    held out of the fit, those the fitted workloads share. With the compute scale given (1:
    the profiles were measured on the machine that ran the jobs), the fit's only per-model
    term, every fitted workload carries the same coefficients; the held-out one takes them
    with its own fresh profile, as a user's model would take a fit made on others."""
    if workload in cals:
        return cals[workload]
    if not cals:
        return Calibration()
    shared = cals[min(cals)]
    return dataclasses.replace(shared, source=f"{shared.source} (fitted on other workloads than {workload}: "
                                               f"{', '.join(sorted(cals))})")


def mape(pairs: list[tuple[float, float]]) -> float:
    return 100 * statistics.mean(abs(p - m) / m for p, m in pairs) if pairs else float("nan")


def validate(a, log=print) -> dict[str, Any]:
    os.makedirs(OUT_DIR, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out: dict[str, Any] = {"started": started, "load_start": loadavg(), "machine": machine(),
                           "command": "python -m bench.plan " + " ".join(sys.argv[1:])}
    log(f"bench.plan: started {started}, load average {out['load_start']}, {out['machine']}")
    profiles: dict[str, Profile] = {}
    out["profiles"] = {}
    plan_runs = runs(a.quick)
    if a.only:
        plan_runs = [r for r in plan_runs if r.name in a.only.split(",") or r.role == "fit"]
    if a.fit:  # a subset of the fit runs (measured again when the system changed under the earlier ones)
        plan_runs = [r for r in plan_runs if r.name in a.fit.split(",") or r.role != "fit"]
    for wl in sorted({r.workload for r in plan_runs}):
        path = os.path.join(OUT_DIR, f"{wl}.profile.json")
        if (a.reuse_profiles or a.from_json) and os.path.exists(path):
            with open(path) as f:
                doc = json.load(f)
            rows = doc["server"].get("measured", [])
            several = [r for r in rows if r["workers"] > 1]
            if several:  # the pull of a job of several workers (stella profile takes these since 2026-11-26)
                doc["pull"]["bytes"] = [{"density": r["density"], "bytes": r["pull_bytes"]} for r in several]
        else:
            log(f"profile {wl}:")
            doc = profile_workload(wl, log=log)
            write_profile(path, doc)
        profiles[wl] = profile_from_dict(doc, path)
        out["profiles"][wl] = {k: doc[k] for k in ("numel", "compute_s", "compress_s_per_numel", "push", "pull",
                                                     "server", "load_average", "measured_at")}
    measured: dict[str, dict[str, Any]] = {}
    by_name = {r.name: r for r in plan_runs}
    if a.from_json:  # the runs measured before: fit and predict again, run nothing
        with open(a.from_json) as f:
            old = json.load(f)
        measured = {x["run"]: x["measured"] for x in old["rows"]}
        if a.remeasure:
            measured = {n: remeasure(by_name[n], m) for n, m in measured.items() if n in by_name}
            out["remeasured"] = True
        for k in ("started", "load_start", "load_end", "machine", "command", "pick_run"):
            out[k] = old.get(k, out.get(k))
        out["reanalysed"] = f"python -m bench.plan --from-json {a.from_json}"
    elif a.fit_from:  # the fit runs as earlier runs measured them; the held-out runs are measured now
        fit_names = {r.name for r in plan_runs if r.role == "fit"}
        out["fit_runs_from"] = []
        for path in a.fit_from:
            with open(path) as f:
                old = json.load(f)
            # a run to the target measured before it had a twin for its pace (2026-11-26 22:50) is measured again
            got = {x["run"]: x["measured"] for x in old["rows"] if x["run"] in fit_names and x["run"] not in measured
                   and ("with_evaluations" in x["measured"] or not by_name[x["run"]].to_target)}
            if a.remeasure:
                got = {n: remeasure(by_name[n], m) for n, m in got.items()}
            measured.update(got)
            out["fit_runs_from"].append({"path": os.path.relpath(path, REPO), "started": old.get("started"),
                                         "load_start": old.get("load_start"), "machine": old.get("machine"),
                                         "runs": sorted(got)})
            log(f"fit runs {', '.join(sorted(got))}: as measured by {path} ({old.get('started')})")
    for r in plan_runs:
        if r.role != "fit" or r.name in measured:
            continue
        try:
            measured[r.name] = measure(r, 4 * profiles[r.workload].numel, log)
        except Exception as e:  # a failed run is reported, the rest go on
            log(f"  {r.name} FAILED: {e}")
            traceback.print_exc()
    obs = []
    for r in plan_runs:
        if r.role == "fit" and r.name in measured:
            cat, cfg = testbed_catalog(r)
            m = measured[r.name]
            obs.append((profiles[r.workload], cat, observation(cfg, m)))
    # the profiles were measured on this machine just before the runs: the compute scale is 1 by construction
    # (fitted, it trades off against host_load: on a loaded host both scale every step)
    cals = fit_many(obs, compute=1.0, source=f"bench.plan {started}: {len(obs)} test-bed runs") \
        if len(obs) >= 2 else {}
    out["calibrations"] = {k: dataclasses.asdict(c) for k, c in cals.items()}
    cal = cals.get("widemlp", Calibration())
    out["calibration"] = dataclasses.asdict(cal)
    for k, c in cals.items():  # the fitted coefficients go into the profile (stella plan reads them there)
        path = os.path.join(OUT_DIR, f"{k}.profile.json")
        with open(path) as f:
            doc = json.load(f)
        doc["calibration"] = dataclasses.asdict(c)
        write_profile(path, doc)
        log(f"fitted ({k}): compute x{c.compute:.3f}, host load x{c.host_load:.3f}, exchange stretch "
            f"x{c.exchange_stretch:.2f}, background share {c.background:.2f}, "
            f"link x{c.link:.3f}, tail loss x{c.tail_loss:.2f} queue delays, {1e3 * c.round_s:.1f} ms per round, "
            f"jitter {c.jitter:.3f}, {1e3 * c.worker_round_s:.1f} ms of a worker's CPU per round ({c.runs} runs, "
            f"{c.exchange_runs} bound by their exchange)")
    if "bytelm" in profiles and (not a.only or "p1" in a.only.split(",")):
        old_pick = out.get("pick_run")
        if a.from_json and old_pick:  # the run as it was chosen then, whatever the plan says now
            pick = Run(**old_pick)
        else:
            prof = dataclasses.replace(profiles["bytelm"], calibration=calibration_for("bytelm", cals))
            pick, pick_pred = own_pick(prof, "bytelm", 20 if a.quick else 30)
            out["pick_run"] = dataclasses.asdict(pick)
            out["pick_plan"] = summary(pick_pred)
            log(f"the plan's own pick for bytelm on {PICK_MOST} sites at {PICK_RATE:g} Mbit/s: {pick.describe()}, "
                f"predicted {pick_pred.s_per_it:.4f} s/it (bound by {pick_pred.bound}); run as {pick.name}")
        plan_runs.append(pick)
    # predict every held-out run first, then measure it
    rows = []
    for r in plan_runs:
        cat, cfg = testbed_catalog(r)
        prof = dataclasses.replace(profiles[r.workload], calibration=calibration_for(r.workload, cals))
        pred = predict(prof, cat, cfg)
        if r.role != "fit" and r.name not in measured and not a.from_json:
            try:
                measured[r.name] = measure(r, 4 * profiles[r.workload].numel, log)
            except Exception as e:
                log(f"  {r.name} FAILED: {e}")
                traceback.print_exc()
                continue
        if r.name not in measured:
            continue
        m = measured[r.name]
        row = {"run": r.name, "role": r.role, "config": r.describe(), **testbed_row(r), "pred_s_per_it": pred.s_per_it,
               "meas_s_per_it": m["s_per_it"], "err_s_per_it": pred.s_per_it / m["s_per_it"] - 1,
               "bound": pred.bound, "pred_compute_s": pred.compute_s / r.h, "meas_compute_s": m["compute_s"],
               "pred_exchange_s": pred.exchange_s, "meas_exchange_s": m["exchange_s"], "measured": m}
        if r.to_target:
            row["pred_iterations"], row["factor_source"] = pred.iterations, pred.factor_source
            row["pred_time_s"] = pred.time_s
            if m["reached"] and math.isfinite(pred.time_s):  # inf: harsher than the factor table, no estimate
                row["meas_iterations"], row["meas_time_s"] = m["reached"]["step"], m["reached"]["wall"]
                row["err_time"] = pred.time_s / m["reached"]["wall"] - 1
        rows.append(row)
    out["rows"] = rows
    out.setdefault("load_end", loadavg())
    held = [x for x in rows if x["role"] == "held-out"]
    out["held_out_mape"] = mape([(x["pred_s_per_it"], x["meas_s_per_it"]) for x in held])
    out["held_out_max_error"] = 100 * max((abs(x["err_s_per_it"]) for x in held), default=float("nan"))
    out["fit_mape"] = mape([(x["pred_s_per_it"], x["meas_s_per_it"]) for x in rows if x["role"] == "fit"])
    tt = [x for x in held if "err_time" in x]
    out["time_to_target_errors"] = [100 * x["err_time"] for x in tt]
    picked = [x for x in rows if x["role"] == "pick"]
    out["pick_error"] = 100 * picked[0]["err_s_per_it"] if picked else None
    shaped = [x for x in held if x["catalog"]["server"]["up_mbps"] != PS_RATE and x["bound"] != "compute"]
    out["held_out_exchange_shaped_errors"] = [100 * x["err_s_per_it"] for x in shaped]
    log("\n" + render_validation(out))
    return out


def render_validation(out: dict[str, Any]) -> str:
    lines = [f"Validation (machine: {out['machine']}; load average at start {out['load_start']}, at end "
             f"{out['load_end']})", "",
             "| run | role | configuration | predicted s/it | measured s/it | error | bound (model) | "
             "predicted / measured time to target |", "|---|---|---|---|---|---|---|---|"]
    for x in out["rows"]:
        tt = ""
        if "pred_time_s" in x and not math.isfinite(x["pred_time_s"]):
            tt = "no estimate: " + x["factor_source"] + (
                f" / {x['measured']['reached']['wall']:.1f} s ({x['measured']['reached']['step']} it)"
                if x["measured"].get("reached") else "")
        elif "pred_time_s" in x:
            tt = (f"{x['pred_time_s']:.1f} s ({x['pred_iterations']:.0f} it) / "
                  + (f"{x['meas_time_s']:.1f} s ({x['meas_iterations']} it): {100 * x['err_time']:+.0f}%"
                     if "meas_time_s" in x else "not reached"))
        lines.append(f"| {x['run']} | {x['role']} | {x['config']} | {x['pred_s_per_it']:.4f} | "
                     f"{x['meas_s_per_it']:.4f} | {100 * x['err_s_per_it']:+.1f}% | {x['bound']} | {tt} |")
    lines += ["", f"held-out s/it: MAPE {out['held_out_mape']:.1f}% (goal <= 15%), worst "
              f"{out['held_out_max_error']:.1f}% (goal <= 30%); fit runs: MAPE {out['fit_mape']:.1f}%",
              "held-out time to target errors: " + (", ".join(f"{e:+.0f}%" for e in out["time_to_target_errors"])
                                                    or "none reached") + " (goal within 25%)"]
    shaped = out.get("held_out_exchange_shaped_errors") or []
    if shaped:
        lines.append(f"held-out runs bound by their exchange, the server's site shaped: mean error "
                     f"{statistics.mean(shaped):+.1f}% (" + ", ".join(f"{e:+.1f}%" for e in shaped)
                     + ") (goal within 15%)")
    if out.get("pick_error") is not None:
        lines.append(f"the plan's own pick (p1): predicted against measured {out['pick_error']:+.1f}% "
                     "(goal within 15%)")
    return "\n".join(lines)


def ten_kind_catalog(path: str) -> None:
    """A catalog of 10 kinds (2 on-premises, 8 rentable on demand or spot): the issue's
    size for the speed of planning."""
    kinds = [f'[kinds.lab{i}]\ngpu="x"\ngpus=2\nspeed=1.0\nonprem=true\ncount=1\nup_mbps=100\ndown_mbps=100\n'
             for i in range(2)]
    kinds += [f'[kinds.cloud{i}]\ngpu="y"\nspeed={0.5 + 0.3 * i}\ncount=16\nprice={0.5 + i}\n'
              f'spot_price={0.2 + 0.4 * i}\nmttr_h=4\nup_mbps=1000\ndown_mbps=1000\n' for i in range(8)]
    with open(path, "w") as f:
        f.write("[server]\nprice=0.5\ncores=8\nup_mbps=10000\ndown_mbps=10000\n\n" + "\n".join(kinds))


def _less(saving: float) -> str:
    """A saving as "N% less", or "N% more" where it is negative."""
    return f"{100 * abs(saving):.0f}% {'less' if saving >= 0 else 'more'}"


def planning_speed(log=print) -> dict[str, Any]:
    """``stella plan`` on a 10-kind catalog with the example profile, in a process of its
    own: its CPU seconds (import included; goal < 2 s) and whether it imported torch."""
    import resource
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        cat, out = os.path.join(tmp, "ten.toml"), os.path.join(tmp, "o.json")
        ten_kind_catalog(cat)
        prof = os.path.join(REPO, "docs", "profile.example.json")
        code = ("import sys; from stella.cli import main; "
                f"rc = main(['plan', '--catalog', {cat!r}, '--profile', {prof!r}, '--deadline', '12h', "
                f"'--json', {out!r}]); print('TORCH' if 'torch' in sys.modules else 'NO-TORCH'); sys.exit(rc)")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if run.returncode != 0:
            raise RuntimeError(f"stella plan failed: {run.stderr[-2000:]}")
        with open(out) as f:
            considered = json.load(f)["considered"]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    res = {"cpu_s": cpu, "considered": considered, "torch_imported": "NO-TORCH" not in run.stdout,
           "load": os.getloadavg()[0]}
    log(f"\nplanning speed: stella plan on a 10-kind catalog considered {considered:,} configurations in "
        f"{cpu:.2f} s of CPU (goal < 2 s), torch {'imported' if res['torch_imported'] else 'not imported'}, "
        f"load {res['load']:.2f}")
    return res


def machine() -> str:
    return f"{platform.node()}: {describe_machine()}, Linux {platform.release()}, Python {platform.python_version()}"



def _jsonable(o: Any) -> Any:
    """What json.dump writes for an object it does not know: a dataclass's fields, else its text."""
    return dataclasses.asdict(o) if dataclasses.is_dataclass(o) and not isinstance(o, type) else str(o)

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.plan", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    pr = sub.add_parser("profile", help="profile a bench workload (stella profile for digits/widemlp)")
    pr.add_argument("--workload", required=True, choices=("digits", "widemlp", "bytelm"))
    pr.add_argument("--out", required=True)
    pr.add_argument("--steps", type=int, default=20)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=os.path.join(REPO, "bench", "PLAN.json"))
    ap.add_argument("--scenarios-only", action="store_true", help="no test-bed runs")
    ap.add_argument("--reuse-profiles", action="store_true", help="use bench/out/plan/*.profile.json if present")
    ap.add_argument("--only", help="held-out runs to make, comma-separated (the fit runs always run)")
    ap.add_argument("--fit", help="the fit runs to use, comma-separated (default: all)")
    ap.add_argument("--fit-from", action="append",
                    help="take the fit runs' measurements from a previous --json (repeat for several; the held-out "
                    "runs are measured)")
    ap.add_argument("--from-json", help="fit and predict again from the runs a previous --json measured (no runs)")
    ap.add_argument("--remeasure", action="store_true",
                    help="with --from-json / --fit-from: measure those runs again from their workers' logs "
                    "(bench.plan.clean_measure), not as the earlier --json recorded them")
    a = ap.parse_args(argv)
    if a.cmd == "profile":
        doc = profile_workload(a.workload, a.steps, log=lambda s: print(s, file=sys.stderr))
        write_profile(a.out, doc)
        print(f"wrote {a.out}")
        return 0
    out: dict[str, Any] = {}
    cal = None
    server = None
    if not a.scenarios_only:
        out = validate(a)
        cal = Calibration(**out["calibration"])
    elif os.path.exists(a.json):
        with open(a.json) as f:
            old = json.load(f)
        if "calibration" in old:
            cal = Calibration(**old["calibration"])
            out = old
    wp = os.path.join(OUT_DIR, "widemlp.profile.json")
    if os.path.exists(wp):  # the server's cost as measured here at 9.7M parameters
        with open(wp) as f:
            srv = json.load(f)["server"]
        server = {"per_update_s": srv["per_update_s"], "per_numel_s": srv["per_numel_s"],
                  "source": f"measured by bench.plan's widemlp profile ({srv.get('source', '')})"}
    out["hybrid"] = hybrid_scenario(cal)
    out["billion"] = billion_scenario(cal, server)
    out["chaos"] = chaos_check()
    out["planning"] = planning_speed()
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1, default=_jsonable)
    print(f"\nwrote {a.json}, bench/plan_pareto.png")
    if not a.scenarios_only:
        goal = out["held_out_mape"] <= 15 and out["held_out_max_error"] <= 30
        print(f"s/it goals {'met' if goal else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
