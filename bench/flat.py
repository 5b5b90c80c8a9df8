"""The flat model on a CPU worker (stella.flat) against the per-tensor path of today.

    python -m bench.flat [--quick] [--json PATH] [--densities 0.01,0.001] [--dtype f32|bf16|f16]
                         [--steps N] [--workload bytelm] [--quiet-below LOAD]

On the byte LM's layout (bench.workloads ``bytelm``, or ``--workload``'s: 76 tensors,
10.8M coordinates; the 26 of at least 4096 elements make the sparse range, the 50 others
the dense suffix), one thread, every system in the same run, back to back:

1. **compressor**: ns per coordinate of a compression (``residual += grad``, top-k at the
   density, values to f16) in its steady state (thresholds carried), median of
   ``--steps`` after warm-up: :class:`~stella.flat.FlatCompressor` on the 76 tensors'
   flat vector and on ONE tensor of the same size (the goal: 76 / 1 <= 1.2x), and the
   per-tensor :class:`~stella.compress.ErrorFeedbackCompressor` on the 76 tensors
   (today's) and on the one tensor.
2. **operations**: :class:`~stella.flat.FlatParams` on the model's parameters (``--dtype``),
   warm caches, best of ``--steps``: ns per coordinate (per entry for the sparse ones).
3. **round**: an update-mode worker's round at H = 1 (after a local step, not timed):
   the residual ``anchor - w``, its compression, and the install of the server's answer
   (a broadcast of as many coordinates as the push, the dense suffix whole) with the
   merge rule ``w += (a_new - a) + c``. The per-tensor path is _exchange.py's of today
   (``_load_residuals``, ``compress`` per tensor, ``install`` per tensor), copied here
   because that module is being rewritten onto the flat one; the flat path is
   ``residual_into`` + ``compress(None)`` + ``merge_at``/``merge_range`` (the broadcast)
   and ``add_at``/``add_range`` (what was sent). ms per round,
   median of ``--steps``, per phase.
4. **host blocking** (CUDA only, through bench.cuda's ``--flat``): whether an install's
   ``merge_at``, and the copy of its indices to the device, hold the host while a
   training step's kernels are queued (:func:`host_block_rows`).

The load average is printed at the start and the end (DESIGN.md: timings on a 2-core
machine measure contention when anything else runs); ``--quiet-below`` waits (up to 10
minutes) for the 1-minute load to drop below it first.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from stella.compress import ErrorFeedbackCompressor, SparseGrad
from stella.flat import FlatCompressor, FlatParams
from stella.layout import FlatLayout
from stella.protocol import TensorSpec

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
DENSE_BELOW = 4096  # codec.DENSE_BELOW, the server's default cut
VALUE_DTYPE = "f16"  # the pushes' first coding (codec.CODINGS)


def model_params(dtype: torch.dtype, workload: str = "bytelm",
                 device: str = "cpu") -> tuple[list[tuple[str, torch.Tensor]], FlatLayout]:
    """A bench.workloads model's parameters (by registration order) in ``dtype`` on
    ``device``, and their layout."""
    from bench import workloads

    model = workloads.get(workload).build_model(0)
    params = [(n, p.detach().to(device, dtype).contiguous()) for n, p in model.named_parameters()]
    return params, FlatLayout.of([TensorSpec(n, tuple(p.shape), "float32") for n, p in params], DENSE_BELOW)


def grads(numel: int, count: int, seed: int = 0, device: str = "cpu") -> list[torch.Tensor]:
    """``count`` gradient-like flat vectors (bench.compress's: a persistent component plus
    heavy-tailed noise) on ``device``, made once and cycled (their making is not what is
    measured)."""
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(numel, generator=g).mul_(0.1)
    out = []
    for _ in range(count):
        x = torch.randn(numel, generator=g)
        x.mul_(torch.rand(numel, generator=g).pow_(3)).add_(mean)
        out.append(x.to(device))
    return out


def _sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _median_s(fn: Callable[[int], Any], warmup: int, steps: int, device: torch.device | str = "cpu") -> float:
    for s in range(warmup):
        fn(s)
    ts = []
    for s in range(warmup, warmup + steps):
        _sync(device)
        t = time.perf_counter()
        fn(s)
        _sync(device)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


# ------------------------------------------------------------------------------ 1. compressor


def compressor_rows(layout: FlatLayout, density: float, steps: int, gs: list[torch.Tensor]) -> list[dict]:
    """Section 1 on the device of ``gs`` (the flat gradients the steps cycle through)."""
    n = layout.numel
    device = gs[0].device
    one = FlatLayout.of([TensorSpec("w", (n,), "float32")], DENSE_BELOW)
    split = [[g[a:b] for _, a, b in sorted(layout.spans())] for g in gs]  # views per tensor, by tensor number
    names = [f"t{t}" for t in range(len(layout.numels))]
    rows: list[dict[str, Any]] = []

    def flat(lay: FlatLayout) -> Callable[[int], Any]:
        comp = FlatCompressor(lay, density, value_dtype=VALUE_DTYPE, device=device)
        return lambda s: comp.compress(gs[s % len(gs)])

    def per_tensor(one_tensor: bool) -> Callable[[int], Any]:
        comp = ErrorFeedbackCompressor(density, value_dtype=VALUE_DTYPE, dense_below=DENSE_BELOW)
        if one_tensor:
            return lambda s: comp.compress("w", gs[s % len(gs)])

        def run(s: int) -> None:
            for name, g in zip(names, split[s % len(gs)]):
                comp.compress(name, g)
        return run

    systems = (("flat", len(layout.numels), flat(layout)), ("flat", 1, flat(one)),
               ("per-tensor", len(layout.numels), per_tensor(False)), ("per-tensor", 1, per_tensor(True)))
    for system, tensors, fn in systems:
        dt = _median_s(fn, 3, steps, device)
        rows.append(dict(kind="compressor", device=str(device), system=system, tensors=tensors, numel=n,
                         density=density, value_dtype=VALUE_DTYPE, ms=1e3 * dt, ns_per_coordinate=1e9 * dt / n))
    base: dict[str, float] = {r["system"]: r["ns_per_coordinate"] for r in rows if r["tensors"] == 1}
    for r in rows:
        r["vs_one_tensor"] = r["ns_per_coordinate"] / base[r["system"]]
    return rows


# ------------------------------------------------------------------------------ 2. operations


def op_rows(params: list[tuple[str, torch.Tensor]], layout: FlatLayout, density: float, steps: int) -> list[dict]:
    """Section 2 on the parameters' device."""
    tensors = [p for _, p in params]
    flat = FlatParams(tensors, layout)
    device = flat.device
    n, s = layout.numel, layout.sparse_numel
    rng = np.random.default_rng(0)
    idx = np.sort(rng.choice(n, max(1, int(density * n)), replace=False)).astype(np.int32)
    vals = (rng.standard_normal(idx.size) * 1e-4).astype(np.float32)
    out, anchor = torch.empty(n, device=device), torch.randn(n).to(device)
    anchor2 = anchor.clone()
    dense = (rng.standard_normal(n - s) * 1e-4).astype(np.float32)
    for p in tensors:
        p.grad = torch.randn(p.shape).to(device, p.dtype)
    ops: list[tuple[str, Callable[[], None], int]] = [
        ("gather_into", lambda: flat.gather_into(out), n),
        ("gather_grads_into", lambda: flat.gather_grads_into(out), n),
        ("residual_into", lambda: flat.residual_into(anchor, out), n),
        (f"add_at {density:.1%}", lambda: flat.add_at(idx, vals), idx.size),
        (f"set_at {density:.1%}", lambda: flat.set_at(idx, vals), idx.size),
        (f"merge_at {density:.1%}", lambda: flat.merge_at(idx, vals, anchor2), idx.size),
        ("add_range suffix", lambda: flat.add_range(dense, s), n - s),
        ("add_range all", lambda: flat.add_range(anchor, 0), n),
    ]
    backends = [flat.backend] * len(ops)
    if flat.backend == "torch":  # the sparse writes as a model past STAGE_MAX_NUMEL takes them: a parameter at a time
        each = FlatParams(tensors, layout)
        each.stage_max_numel = 0
        ops += [(f"add_at {density:.1%}", lambda: each.add_at(idx, vals), idx.size),
                (f"set_at {density:.1%}", lambda: each.set_at(idx, vals), idx.size),
                (f"merge_at {density:.1%}", lambda: each.merge_at(idx, vals, anchor2), idx.size)]
        backends += ["torch/param"] * 3
    rows: list[dict[str, Any]] = []
    for (name, fn, count), backend in zip(ops, backends, strict=True):
        fn()
        best = min(_time(fn, device) for _ in range(steps))
        rows.append(dict(kind="op", device=str(device), op=name, dtype=str(tensors[0].dtype).removeprefix("torch."),
                         backend=backend,
                         count=count, numel=n, ms=1e3 * best, ns_per_coordinate=1e9 * best / n,
                         ns_per_entry=1e9 * best / max(1, count)))
    for p in tensors:
        p.grad = None
    return rows


def _time(fn: Callable[[], None], device: torch.device | str = "cpu") -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


# ------------------------------------------------------------------------------ 3. the round


class PerTensorRound:
    """Today's update-mode round, per tensor: _exchange.py's ``_load_residuals``, a
    compression per tensor, and ``install`` of a broadcast step and of what was sent."""

    def __init__(self, params: dict[str, torch.Tensor], density: float):
        self.params = params
        self.compressor = ErrorFeedbackCompressor(density, value_dtype=VALUE_DTYPE, dense_below=DENSE_BELOW)
        self.anchor = {n: p.detach().reshape(-1).to(torch.float32, copy=True) for n, p in params.items()}

    @torch.no_grad()
    def residual(self) -> None:
        for n, p in self.params.items():
            torch.sub(self.anchor[n], p.detach().reshape(-1), out=self.compressor.residual_buffer(n, p))

    def compress(self) -> dict[str, SparseGrad]:
        return {n: self.compressor.compress(n, None) for n in self.params}

    @torch.no_grad()
    def install(self, step: dict[str, tuple[np.ndarray | None, np.ndarray]], sent: dict[str, SparseGrad]) -> None:
        for n, (idx, vals) in step.items():
            a, w = self.anchor[n], self.params[n].detach().view(-1)
            inc = torch.from_numpy(vals).to(a.device, torch.float32)
            if idx is None:
                before = a.clone()
                a.add_(inc)
                w.add_((a - before).to(w.dtype))
            else:
                at = torch.from_numpy(idx.astype(np.int64)).to(a.device)
                before = a.index_select(0, at)
                a.index_add_(0, at, inc)
                w.index_add_(0, at, (a.index_select(0, at) - before).to(w.dtype))
        for n, sg in sent.items():
            w = self.params[n].detach().view(-1)
            c = torch.from_numpy(sg.values).to(w.device, torch.float32).to(w.dtype)
            if sg.indices is None:
                w.add_(c)
            else:
                w.index_add_(0, torch.from_numpy(sg.indices.astype(np.int64)).to(w.device), c)


class FlatRound:
    """The same round on the flat model: one call a phase."""

    def __init__(self, params: list[torch.Tensor], layout: FlatLayout, density: float):
        self.flat = FlatParams(params, layout)
        self.compressor = FlatCompressor(layout, density, value_dtype=VALUE_DTYPE, device=self.flat.device)
        self.anchor = torch.empty(layout.numel, device=self.flat.device)
        self.flat.gather_into(self.anchor)
        self.s = layout.sparse_numel

    def residual(self) -> None:
        self.flat.residual_into(self.anchor, self.compressor.residual)

    def compress(self) -> Any:
        return self.compressor.compress(None)

    def install(self, idx: np.ndarray, vals: np.ndarray, dense: np.ndarray, sent: Any) -> None:
        s = self.s
        self.flat.merge_at(idx, vals, self.anchor)  # the broadcast step: a += v, w += the change
        self.flat.merge_range(dense, self.anchor[s:], s)
        if sent.sparse.indices is not None:  # and what this worker sent: w += c
            self.flat.add_at(sent.sparse.indices, sent.sparse.values)
        self.flat.add_range(sent.dense, s)


def round_rows(params: list[tuple[str, torch.Tensor]], layout: FlatLayout, density: float, steps: int) -> list[dict]:
    """Section 3 on the parameters' device."""
    n, s = layout.numel, layout.sparse_numel
    device = params[0][1].device
    names = [name for name, _ in params]
    per = PerTensorRound({name: p.clone() for name, p in params}, density)
    flat = FlatRound([p.clone() for _, p in params], layout, density)
    rng = np.random.default_rng(1)
    local = grads(n, 3, seed=2, device=str(device))  # the local steps' changes of the weights
    for x in local:
        x.mul_(1e-3)
    times: dict[str, dict[str, list[float]]] = {sys_: {"residual": [], "compress": [], "install": []}
                                                  for sys_ in ("per-tensor", "flat")}
    for step in range(3 + steps):
        # a local step (not timed), the same change on both replicas
        change = local[step % len(local)]
        for name, (_, a, b) in zip(names, sorted(layout.spans())):
            per.params[name].view(-1).add_(change[a:b].to(per.params[name].dtype))
        flat.flat.add_range(change, 0)
        # the server's broadcast: as many coordinates as a push, then the dense suffix whole
        k = max(1, round(density * s))
        b_idx = np.sort(rng.choice(s, k, replace=False)).astype(np.int32)
        b_val = (rng.standard_normal(k) * 1e-3).astype(np.float32)
        b_dense = (rng.standard_normal(n - s) * 1e-4).astype(np.float32)
        msg = _per_tensor_message(layout, names, b_idx, b_val, b_dense)
        for system, rnd in (("per-tensor", per), ("flat", flat)):
            _sync(device)
            t0 = time.perf_counter()
            rnd.residual()
            _sync(device)
            t1 = time.perf_counter()
            sent = rnd.compress()  # (the sparse result is on the host: the compression syncs)
            t2 = time.perf_counter()
            if system == "flat":
                flat.install(b_idx, b_val, b_dense, sent)
            else:
                per.install(msg, sent)
            _sync(device)
            t3 = time.perf_counter()
            if step >= 3:
                for phase, dt in (("residual", t1 - t0), ("compress", t2 - t1), ("install", t3 - t2)):
                    times[system][phase].append(dt)
    rows: list[dict[str, Any]] = []
    for system, phases in times.items():
        med = {p: statistics.median(v) for p, v in phases.items()}
        total = statistics.median([sum(x) for x in zip(*phases.values())])
        rows.append(dict(kind="round", device=str(device), system=system, tensors=len(names), numel=n, density=density,
                         dtype=str(params[0][1].dtype).removeprefix("torch."),
                         **{f"{p}_ms": 1e3 * v for p, v in med.items()}, total_ms=1e3 * total,
                         ns_per_coordinate=1e9 * total / n))
    base = next(r["total_ms"] for r in rows if r["system"] == "per-tensor")
    for r in rows:
        r["speedup"] = base / r["total_ms"]
    return rows


def _per_tensor_message(layout: FlatLayout, names: list[str], idx: np.ndarray, vals: np.ndarray,
                        dense: np.ndarray) -> dict[str, tuple[np.ndarray | None, np.ndarray]]:
    """The flat broadcast step as today's per-tensor message: sparse entries per large
    tensor (indices relative to it), each small tensor whole."""
    out: dict[str, tuple[np.ndarray | None, np.ndarray]] = {}
    s = layout.sparse_numel
    for t, a, b in layout.spans():
        name = names[t]
        if b <= s:
            lo, hi = np.searchsorted(idx, [a, b])
            if hi > lo:
                out[name] = (idx[lo:hi] - np.int32(a), vals[lo:hi])
        else:
            out[name] = (None, dense[a - s:b - s])
    return out


# ------------------------------------------------------------------------------ 4. does an install block the host?


def host_block_rows(params: list[tuple[str, torch.Tensor]], layout: FlatLayout, density: float,
                    steps: int) -> list[dict]:
    """On CUDA only (bench.cuda's ``--flat``): the host time of an install's ``merge_at``,
    and of the host-to-device copy of its indices, made while about 20 ms of kernels are
    queued on the stream (a training step's, in life), against the queue's own time. A
    copy from pageable memory waits for the queue to drain: the host cannot queue the next
    step meanwhile. The last row is the same copy from pinned memory with
    ``non_blocking=True``, which need not wait (what an install could do)."""
    tensors = [p for _, p in params]
    device = tensors[0].device
    if device.type != "cuda":
        return []
    flat = FlatParams(tensors, layout)
    n = layout.numel
    rng = np.random.default_rng(0)
    idx = np.sort(rng.choice(n, max(1, int(density * n)), replace=False)).astype(np.int32)
    vals = (rng.standard_normal(idx.size) * 1e-4).astype(np.float32)
    anchor = torch.randn(n).to(device)
    m = torch.randn(2048, 2048, device=device)

    def queue() -> None:  # kernels queued, not waited for
        for _ in range(reps):
            torch.mm(m, m)

    reps = 1
    queue()
    _sync(device)
    while _time(queue, device) < 0.02 and reps < 4096:  # about 20 ms of queued kernels
        reps *= 2
    queued = statistics.median(_time(queue, device) for _ in range(3))

    def pinned_copy() -> None:
        staged = torch.empty(idx.size, dtype=torch.int32, pin_memory=True)
        staged.numpy()[:] = idx
        staged.to(device, non_blocking=True)

    ops: list[tuple[str, Callable[[], Any]]] = [
        (f"merge_at {density:.1%}", lambda: flat.merge_at(idx, vals, anchor)),
        ("indices to device, pageable", lambda: torch.from_numpy(idx.copy()).to(device)),
        ("indices to device, pinned non-blocking", pinned_copy),
    ]
    rows: list[dict[str, Any]] = []
    for name, fn in ops:
        fn()
        host = []
        for _ in range(steps):
            _sync(device)
            queue()
            t = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t)
            _sync(device)
        h = statistics.median(host)
        rows.append(dict(kind="host", device=str(device), op=name, dtype=str(tensors[0].dtype).removeprefix("torch."),
                         count=int(idx.size), queued_ms=1e3 * queued, host_ms=1e3 * h, waits=h > 0.5 * queued))
    return rows


# ------------------------------------------------------------------------------ the run


def device_rows(device: str, densities: list[float], steps: int, dtypes: tuple[str, ...] = ("f32", "bf16"),
                workload: str = "bytelm") -> list[dict]:
    """All three sections on ``device`` (bench.cuda's ``--flat``): the compressors per
    density, then per parameter dtype the operations and the rounds."""
    _, layout = model_params(torch.float32, workload)
    gs = grads(layout.numel, 3, device=device)
    rows = [r for d in densities for r in compressor_rows(layout, d, steps, gs)]
    del gs
    for dt in dtypes:
        params, _ = model_params(DTYPES[dt], workload, device)
        rows.extend(op_rows(params, layout, densities[0], steps))
        rows.extend(r for d in densities for r in round_rows(params, layout, d, steps))
        rows.extend(host_block_rows(params, layout, densities[0], steps))
    return rows


def print_tables(rows: list[dict], out=sys.stdout) -> None:
    comp = [r for r in rows if r["kind"] == "compressor"]
    if comp:
        print(f"{'compressor':11} {'tensors':>7} {'coordinates':>12} {'dens':>6} {'ms':>8} {'ns/coord':>9} "
              f"{'vs 1 tensor':>11}", file=out)
        for r in comp:
            print(f"{r['system']:11} {r['tensors']:>7} {r['numel']:>12,} {r['density']:>6.1%} {r['ms']:8.2f} "
                  f"{r['ns_per_coordinate']:9.3f} {r['vs_one_tensor']:10.2f}x", file=out)
        print(file=out)
    ops = [r for r in rows if r["kind"] == "op"]
    if ops:
        print(f"{'FlatParams op':20} {'dtype':8} {'backend':11} {'ms':>8} {'ns/coord':>9} {'ns/entry':>9}", file=out)
        for r in ops:
            print(f"{r['op']:20} {r['dtype']:8} {r['backend']:11} {r['ms']:8.3f} {r['ns_per_coordinate']:9.3f} "
                  f"{r['ns_per_entry']:9.2f}", file=out)
        print(file=out)
    host = [r for r in rows if r["kind"] == "host"]
    if host:
        print(f"{'with kernels queued':40} {'dtype':8} {'queued ms':>9} {'host ms':>8} waits", file=out)
        for r in host:
            print(f"{r['op']:40} {r['dtype']:8} {r['queued_ms']:9.2f} {r['host_ms']:8.2f} {r['waits']}", file=out)
        print(file=out)
    rnd = [r for r in rows if r["kind"] == "round"]
    if rnd:
        print(f"{'round':11} {'dtype':8} {'dens':>6} {'residual':>9} {'compress':>9} {'install':>9} {'total ms':>9} "
              f"{'ns/coord':>9} {'speedup':>8}", file=out)
        for r in rnd:
            print(f"{r['system']:11} {r['dtype']:8} {r['density']:>6.1%} {r['residual_ms']:9.2f} "
                  f"{r['compress_ms']:9.2f} {r['install_ms']:9.2f} {r['total_ms']:9.2f} "
                  f"{r['ns_per_coordinate']:9.3f} {r['speedup']:7.2f}x", file=out)


def _wait_quiet(below: float, timeout: float = 600.0) -> None:
    t0 = time.monotonic()
    while os.getloadavg()[0] >= below and time.monotonic() - t0 < timeout:
        time.sleep(10)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 steps, density 1%% only")
    ap.add_argument("--json", metavar="PATH", help="write the rows (and the run's facts) as JSON")
    ap.add_argument("--densities", default="0.01,0.001", help="comma-separated (default 0.01,0.001)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="f32", help="the parameters' dtype (default f32)")
    ap.add_argument("--steps", type=int, default=15, help="timed steps after warm-up (default 15)")
    ap.add_argument("--workload", default="bytelm", help="the bench.workloads model whose layout is measured "
                                                         "(default bytelm)")
    ap.add_argument("--quiet-below", type=float, metavar="LOAD",
                    help="wait (up to 10 min) for the 1-minute load average to drop below LOAD")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    densities = [float(d) for d in args.densities.split(",")]
    steps = args.steps
    if args.quick:
        densities, steps = densities[:1], min(steps, 5)
    if args.quiet_below is not None:
        _wait_quiet(args.quiet_below)
    params, layout = model_params(DTYPES[args.dtype], args.workload)
    load0 = os.getloadavg()
    print(f"# bench.flat  {platform.processor() or platform.machine()}  cpus={os.cpu_count()}  "
          f"torch={torch.__version__} threads=1  {args.workload}: {len(layout.numels)} tensors, "
          f"{layout.numel:,} coordinates ({layout.sparse_numel:,} sparse)  params {args.dtype}  "
          f"loadavg at start: {load0[0]:.2f},{load0[1]:.2f},{load0[2]:.2f}", flush=True)
    t0 = time.perf_counter()
    gs = grads(layout.numel, 3)
    rows: list[dict] = []
    for d in densities:
        rows.extend(compressor_rows(layout, d, steps, gs))
    rows.extend(op_rows(params, layout, densities[0], steps))
    for d in densities:
        rows.extend(round_rows(params, layout, d, steps))
    load1 = os.getloadavg()
    print_tables(rows)
    print(f"# {time.perf_counter() - t0:.1f} s; loadavg at end: {load1[0]:.2f},{load1[1]:.2f},{load1[2]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"loadavg_start": load0, "loadavg_end": load1, "dtype": args.dtype, "steps": steps,
                       "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
