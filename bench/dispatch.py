"""The C kernels at every x86-64 level this CPU runs (run-time dispatch, native/stella_isa.h).

    python -m bench.dispatch [--quick] [--reps N] [--json PATH]

Builds nothing: the installed modules hold a portable copy of the dispatched kernels
(at the build's ``-march``; wheels and images use ``x86-64-v2``) and, built with GCC on
x86-64, an x86-64-v3 (AVX2, F16C, FMA) and an x86-64-v4 (AVX-512) copy. For each level
in ``stella.native_isa().runnable`` a subprocess runs with ``STELLA_NATIVE_ISA`` set to
it and times, on fixed inputs: top-k selection with error feedback (threshold and block
methods, carried thresholds, fresh gradient each call), the optimizer's apply (merge of
4 sparse pushes in f32 / f16 and the SGD or AdamW update), the union of sorted index
lists (not dispatched: a control), and the bulk f16/bf16 conversions of the codec. The
table gives the median time of a call (the best of ``--rounds`` subprocesses per level,
run in alternating order) and the ratio ``portable / level`` (above 1: faster than
portable); the union, which no level changes, shows the noise. Compare levels only
within one run; ``--json`` writes the rows.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

F32 = np.float32


def _median_time(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _cases(quick: bool) -> dict[str, Callable[[int], float]]:
    """name -> (reps -> median seconds of one call), on the current process's level."""
    from stella._native import ffi, lib
    from stella_ps import kernel
    from stella_ps.optim import OptimizerConfig

    rng = np.random.default_rng(0)
    n = 1 << (20 if quick else 22)  # floats of the top-k tensor and of the optimizer state
    cases: dict[str, Callable[[int], float]] = {}

    def topk(unit: int) -> Callable[[int], float]:
        res = np.zeros(n, F32)
        grad = rng.standard_normal(n).astype(F32)
        k_units = max(1, n // 1000 // unit)  # 0.1% of the elements
        cap = lib.stella_topk_cap_units(k_units, -(-n // unit))
        idx, val, score = np.empty(cap * unit, np.int32), np.empty(cap * unit, F32), np.empty(cap, F32)
        state = ffi.new("stella_topk_state *")
        args = ffi.new("stella_topk_args *", {"k_units": k_units, "unit": unit, "nsample": 16384, "seed": 1})
        bufs = (ffi.from_buffer("int32_t[]", idx), ffi.from_buffer("float[]", val),
                ffi.from_buffer("float[]", score))  # the struct holds bare pointers: keep these
        out = ffi.new("stella_topk_out *", {"idx": bufs[0], "val": bufs[1], "score": bufs[2], "cap_units": cap})
        res_c, grad_c = ffi.from_buffer("float[]", res), ffi.from_buffer("float[]", grad)

        def call() -> None:
            assert bufs and lib.stella_ef_topk(res_c, grad_c, n, args, state, out, ffi.NULL) >= 0

        return lambda reps: _median_time(call, reps, warmup=4)

    cases[f"top-k threshold, {n >> 20}M f32, k 0.1%"] = topk(1)
    cases[f"top-k block16, {n >> 20}M f32, k 0.1%"] = topk(16)

    def apply(name: str, dtype: str, density: float) -> Callable[[int], float]:
        wire = {"name": name, "lr": 0.01}
        cfg = OptimizerConfig.from_wire(wire)
        st = kernel.KernelTensorState(np.zeros(n, F32), cfg)
        pushes = []
        for _ in range(4):
            idx = np.sort(rng.choice(n, int(n * density), replace=False)).astype(np.int32)
            v = rng.standard_normal(idx.size).astype(F32)
            pushes.append((idx, v.astype(np.float16) if dtype == "f16" else v))
        return lambda reps: _median_time(lambda: st.apply(pushes, 0.25, cfg, checked=False), reps)

    cases[f"apply sgd, 4 pushes f32 1%, {n >> 20}M"] = apply("sgd", "f32", 0.01)
    cases[f"apply sgd, 4 pushes f16 1%, {n >> 20}M"] = apply("sgd", "f16", 0.01)
    cases[f"apply sgd, 4 pushes f16 10%, {n >> 20}M"] = apply("sgd", "f16", 0.10)
    cases[f"apply adamw, 4 pushes f32 1%, {n >> 20}M"] = apply("adamw", "f32", 0.01)

    lists = [np.sort(rng.choice(n, n // 100, replace=False)).astype(np.int32) for _ in range(8)]
    cases[f"union of 8 lists of 1% (control), {n >> 20}M"] = (
        lambda reps: _median_time(lambda: kernel.union_indices(lists, checked=False), reps))

    m = 1 << 20
    v = (rng.standard_normal(m) * 3).astype(F32)
    h = v.astype(np.float16).view(np.uint16)
    b = (v.view(np.uint32) >> 16).astype(np.uint16)
    o32, o16 = np.empty(m, F32), np.empty(m, np.uint16)
    c_v, c_h, c_b = ffi.from_buffer("float[]", v), ffi.from_buffer("uint16_t[]", h), ffi.from_buffer("uint16_t[]", b)
    c_o32, c_o16 = ffi.from_buffer("float[]", o32), ffi.from_buffer("uint16_t[]", o16)
    cases["f16 decode (f16 -> f32), 1M"] = lambda reps: _median_time(lambda: lib.stella_f16_to_f32(c_h, m, c_o32), reps)
    cases["f16 encode (f32 -> f16), 1M"] = lambda reps: _median_time(lambda: lib.stella_f32_to_f16(c_v, m, c_o16), reps)
    cases["bf16 decode, 1M"] = lambda reps: _median_time(lambda: lib.stella_bf16_to_f32(c_b, m, c_o32), reps)
    cases["bf16 encode, 1M"] = lambda reps: _median_time(lambda: lib.stella_f32_to_bf16(c_v, m, c_o16), reps)
    return cases


def _child(quick: bool, reps: int) -> None:
    import stella
    from stella_ps import kernel

    info = stella.native_isa()
    out = {"level": info.level, "kernel_level": kernel.native_isa().level,
           "times": {name: case(reps) for name, case in _cases(quick).items()}}
    print(json.dumps(out))


def _run_level(level: str, quick: bool, reps: int) -> dict:
    env = {**os.environ, "STELLA_NATIVE_ISA": level}
    cmd = [sys.executable, "-m", "bench.dispatch", "--child", "--reps", str(reps)] + (["--quick"] if quick else [])
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    got = json.loads(p.stdout.strip().splitlines()[-1])
    if got["level"] != level or got["kernel_level"] != level:
        raise RuntimeError(f"asked for {level}, ran {got['level']} / {got['kernel_level']}")
    return got["times"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1M-float tensors instead of 4M")
    ap.add_argument("--reps", type=int, default=15, help="timed calls per case (the median is shown)")
    ap.add_argument("--rounds", type=int, default=2, help="subprocesses per level, in alternating order")
    ap.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args.quick, args.reps)
        return 0
    import stella

    info = stella.native_isa()
    levels = list(info.runnable)
    print(f"levels compiled: {', '.join(info.compiled)}; this CPU runs: {', '.join(levels)}")
    # rounds alternate the levels' order (a VM's clock and caches drift); best round kept
    times: dict[str, dict[str, float]] = {}
    for r in range(args.rounds):
        for level in levels if r % 2 == 0 else levels[::-1]:
            got = _run_level(level, args.quick, args.reps)
            times[level] = {k: min(t, times.get(level, got)[k]) for k, t in got.items()}
    base = times["portable"]
    head = f"{'kernel':<42}" + "".join(f"{lv + ' ms':>16}" for lv in levels) + "".join(
        f"{'x ' + lv:>14}" for lv in levels[1:])
    print(head)
    print("-" * len(head))
    rows = []
    for name in base:
        line = f"{name:<42}" + "".join(f"{times[lv][name] * 1e3:>16.3f}" for lv in levels)
        line += "".join(f"{base[name] / times[lv][name]:>14.2f}" for lv in levels[1:])
        print(line)
        for lv in levels:
            rows.append({"kernel": name, "level": lv, "seconds": times[lv][name],
                         "speedup_vs_portable": base[name] / times[lv][name]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"compiled": list(info.compiled), "runnable": levels, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
