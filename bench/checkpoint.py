"""What a checkpoint costs the steps: ``python -m bench.checkpoint [--numel 100e6] [--quick]``.

A model store of ``--numel`` coordinates with AdamW state (the server's C kernel,
4 float32-sized fields per coordinate) takes lazy steps of ``--density`` (one push
per step, sorted random indices). Measured, in one process, as the server does it:

- ``step_ms``: one step (apply) with no checkpoint running;
- ``stall_ms``: the longest store-thread task of a checkpoint's copy (one slice of
  ``CHECKPOINT_SLICE`` coordinates, a memcpy): the longest a step waits for a
  checkpoint; ``whole_copy_ms``: the copy as one task, for contrast (not used);
- ``copy_s``, ``steps_rolled_forward``: the whole sliced copy, with steps between
  slices, and the steps logged meanwhile;
- ``roll_forward_s``, ``write_s`` and ``bytes``: on the writer's thread, the logged
  steps applied to a scratch state and the file written (atomic, checksummed), and
  ``step_ms_during_write`` (median, max) of steps taken meanwhile (the writer
  competes for CPU and memory bandwidth, not for the store thread).

Prints a table; ``--json PATH`` writes the figures.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import threading
import time

import numpy as np

from stella import checkpoint_file as ckfmt
from stella.payload import SparseTensor
from stella.protocol import TensorSpec
from stella_ps.aggregation import Step
from stella_ps.checkpoints import CHECKPOINT_SLICE, copy_in_slices, roll_forward, state_copy
from stella_ps.config import Pulls
from stella_ps.optim import OptimizerConfig
from stella_ps.store import ModelStore


def _step(rng: np.random.Generator, layout: list[TensorSpec], density: float) -> Step:
    per_tensor = []
    for t, s in enumerate(layout):
        k = max(1, int(s.numel * density))
        idx = np.unique(rng.integers(0, s.numel, k)).astype(np.int32)
        per_tensor.append([SparseTensor(t, idx, rng.standard_normal(idx.size).astype(np.float32))])
    return Step(per_tensor, 1.0, [0], 0, [])


def run(numel: int, density: float, tensors: int, directory: str) -> dict:
    cfg = OptimizerConfig.from_wire({"name": "adamw", "lr": 1e-3, "weight_decay": 0.01})
    per = numel // tensors
    layout = [TensorSpec(f"t{i}", (per,), "float32") for i in range(tensors)]
    rng = np.random.default_rng(0)
    store = ModelStore(Pulls(mode="exact"), history=64, threads=1, dense_below=4096)
    store.initialise(layout, [rng.standard_normal(per).astype(np.float32) for _ in layout], cfg)
    steps = [_step(rng, layout, density) for _ in range(4)]
    for st in steps[:2]:
        store.apply_step(st, cfg)  # warm
    times = []
    for i in range(8):
        t0 = time.perf_counter()
        store.apply_step(steps[i % 4], cfg)
        times.append(time.perf_counter() - t0)
    step_ms = 1e3 * statistics.median(times)
    # the old way, for contrast: the whole state copied in one store-thread task
    t0 = time.perf_counter()
    state_copy(store)
    whole_copy_ms = 1e3 * (time.perf_counter() - t0)
    # the server's way (Checkpointer.write): copy_in_slices, one task per slice of
    # CHECKPOINT_SLICE coordinates, with steps in between (here one after every 4 slices); the
    # steps applied meanwhile are rolled forward on the writer's thread
    slice_times: list[float] = []

    async def run(fn, *args):  # the store thread's run, in this thread, a step between slices
        t0 = time.perf_counter()
        out = fn(*args)
        if fn == store.copy_records:
            slice_times.append(time.perf_counter() - t0)
            if len(slice_times) % 4 == 0:
                store.apply_step(steps[len(slice_times) % 4], cfg)
        return out

    t_copy = time.perf_counter()
    sliced = asyncio.run(copy_in_slices(store, run, CHECKPOINT_SLICE))
    copy_s = time.perf_counter() - t_copy
    version, copies, redo = sliced.version, sliced.copies, sliced.redo
    path = os.path.join(directory, ckfmt.file_name(version, 1))
    out: dict = {}
    kind = OptimizerConfig.from_wire({"name": "adamw"})

    def write() -> None:
        t0 = time.perf_counter()
        arrays = roll_forward(kind, [s.numel for s in layout], copies, redo)
        out["roll_forward_s"] = time.perf_counter() - t0
        ck = ckfmt.Checkpoint(version, ckfmt.layout_of(layout), cfg.to_wire(), arrays, time.time())
        out["bytes"] = ckfmt.write(path, ck)
        out["write_s"] = time.perf_counter() - t0

    th = threading.Thread(target=write)
    during = []
    th.start()
    i = 0
    while th.is_alive() and i < 10_000:
        t0 = time.perf_counter()
        store.apply_step(steps[i % 4], cfg)
        during.append(time.perf_counter() - t0)
        i += 1
    th.join()
    t0 = time.perf_counter()
    back = ckfmt.read(path)
    read_s = time.perf_counter() - t0
    assert back.version == version
    return {"numel": numel, "optimizer": "adamw", "density": density, "tensors": tensors, "step_ms": step_ms,
            "stall_ms": 1e3 * max(slice_times), "stall_ms_median": 1e3 * statistics.median(slice_times),
            "slices": len(slice_times), "copy_s": copy_s, "steps_rolled_forward": len(redo),
            "whole_copy_ms (one task, not used)": whole_copy_ms,
            "roll_forward_s": out["roll_forward_s"], "write_s": out["write_s"],
            "bytes": out["bytes"], "steps_during_write": len(during),
            "step_ms_during_write_median": 1e3 * statistics.median(during) if during else None,
            "step_ms_during_write_max": 1e3 * max(during) if during else None, "read_verify_s": read_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.checkpoint")
    p.add_argument("--numel", type=float, default=100e6)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--tensors", type=int, default=4)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir, removed)")
    p.add_argument("--quick", action="store_true", help="10M coordinates")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    numel = int(10e6 if a.quick else a.numel)
    directory = a.dir or tempfile.mkdtemp(prefix="stella-ckpt-bench-")
    try:
        r = run(numel, a.density, a.tensors, directory)
    finally:
        if a.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    r["loadavg"] = os.getloadavg()[0]
    for k, v in r.items():
        print(f"{k:>30}: {v:.4g}" if isinstance(v, float) else f"{k:>30}: {v}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
