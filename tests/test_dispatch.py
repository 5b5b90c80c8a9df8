"""Run-time dispatch of the C kernels by x86-64 level (native/stella_isa.h).

Every level this CPU runs is forced in a subprocess (``STELLA_NATIVE_ISA``, read once
per process) that runs the dispatched kernels on fixed inputs: top-k selection with
error feedback (threshold and block methods, carried thresholds, ties), the codec's
f16/bf16 converters, sum of squares of wire values and q4/q2 codings, the flat
model's reads and writes of f32/f16/bf16 parameters (flat.c), and the optimizer's
apply (merge of f32/f16/bf16 and dense pushes, SGD and Adam). The outputs
must be the same bits at every level, and match the references (mass conservation and
top-ness of the selection, numpy/torch conversion, float64 numpy, ``stella_ps.optim_ref``;
the q4/q2 frames match tests/test_codec.py's NumPy reference at the build's level). A
level the CPU lacks must fall back, visibly, not crash.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import stella
from stella.native_errors import ISA_ENV, ISA_LEVELS
from stella_ps import kernel
from stella_ps.aggregation import count_table
from stella_ps.optim import OptimizerConfig
from stella_ps.optim_ref import RefTensorState

F32 = np.float32
N_TOPK, K_TOPK, TOPK_STEPS = 50_003, 500, 4
N_OPT, OPT_STEPS = 20_011, 3
CONFIGS = {
    "sgd": {"name": "sgd", "lr": 0.05, "weight_decay": 0.01, "momentum": 0.9, "nesterov": True,
            "momentum_mode": "lazy"},
    "adam": {"name": "adamw", "lr": 0.01, "weight_decay": 0.01, "betas": (0.8, 0.95)},
}


def _conversion_input() -> np.ndarray:
    rng = np.random.default_rng(3)
    special = np.array([0.0, -0.0, 1.0, 65504.0, 65520.0, 6e-8, 2.98e-8, 1e-45, -1e-40, 3.4e38, np.inf,
                        -np.inf, np.nan, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 1.00390625, 1.01171875], F32)
    return np.concatenate([special, (rng.standard_normal(4001) * 10.0 ** rng.integers(-9, 6, 4001)).astype(F32),
                           rng.integers(0, 2**32, 2001, dtype=np.uint32).view(F32)])


SUMSQ_LENGTHS = (0, 1, 15, 16, 17, 511, 512, 513, 1000, 4001)


def _sumsq_wire(dtype: str) -> np.ndarray:
    """Finite values as a push carries them in ``dtype`` (float32, float16 or bf16 bits)."""
    v = (np.random.default_rng(5).standard_normal(4001) * 10.0 ** np.random.default_rng(6).integers(-4, 4, 4001))
    v = v.astype(F32)
    if dtype == "f16":
        return v.astype(np.float16)
    return v if dtype == "f32" else (v.view(np.uint32) >> 16).astype(np.uint16)


def _topk_inputs():
    """(method, residual, gradients per step): plain random, and heavy ties."""
    rng = np.random.default_rng(11)
    for method in ("threshold", "block"):
        res = np.zeros(N_TOPK, F32)
        grads = [rng.standard_normal(N_TOPK).astype(F32) * (1 + s) for s in range(TOPK_STEPS)]
        yield method, res, grads
    ties = np.round(rng.standard_normal(N_TOPK) * 2).astype(F32)  # a handful of distinct values
    yield "threshold", ties, [None]
    # no gradient (the server's broadcast): the residual alone, step after step
    yield "threshold", rng.standard_normal(N_TOPK).astype(F32), [None] * TOPK_STEPS


def _opt_pushes(step: int):
    rng = np.random.default_rng(100 + step)
    pushes = []
    for w, dt in enumerate(("f32", "f16", "bf16", "f32")):
        idx = np.sort(rng.choice(N_OPT, N_OPT // (4 + w), replace=False)).astype(np.int32)
        v = rng.standard_normal(idx.size).astype(F32)
        if dt == "f16":
            v = v.astype(np.float16)
        elif dt == "bf16":
            v = (v.view(np.uint32) >> 16).astype(np.uint16)
        pushes.append((idx, v))
    if step == 1:  # a dense push as well
        pushes.append((None, rng.standard_normal(N_OPT).astype(F32)))
    return pushes


def _count_pushes(step: int):
    """A step scaled by count (update mode's count_exponent): step 0 six sparse pushes at 1%
    (the window's few-flag sweep), step 2 four at 0.3% (the chain of two-way merges), odd
    steps ``_opt_pushes`` (the window's vector sweep)."""
    if step % 2:
        return _opt_pushes(step)
    rng = np.random.default_rng(200 + step)
    w, n = (6, N_OPT // 100) if step == 0 else (4, N_OPT * 3 // 1000)
    return [(np.sort(rng.choice(N_OPT, n, replace=False)).astype(np.int32),
             rng.standard_normal(n).astype(F32)) for _ in range(w)]


def _count_scale(pushes) -> np.ndarray:
    table = count_table(len(pushes), 0.5, 1.0 / len(pushes))
    assert table is not None
    return table


def _as_ref(push):
    idx, v = push
    if v.dtype == np.uint16:  # bf16 bits -> float32
        v = (v.astype(np.uint32) << 16).view(F32)
    return (np.arange(N_OPT, dtype=np.int32) if idx is None else idx), v.astype(F32)


FLAT_SIZES = (5003, 0, 4099, 17, 2048)  # the flat model's parts: f32, f16, bf16 in turn


def _flat_parts() -> list[np.ndarray]:
    """The parts of a flat model as C sees them: float32, float16 and bf16 (uint16 bits)."""
    rng = np.random.default_rng(21)
    out = []
    for i, n in enumerate(FLAT_SIZES):
        v = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, n)).astype(F32)
        out.append([v, v.astype(np.float16), (v.view(np.uint32) >> 16).astype(np.uint16)][i % 3])
    return out


def _flat_ops(ffi, lib, parts: list[np.ndarray], results: dict[str, np.ndarray]) -> None:
    """flat.c's entry points on ``parts`` (written in place): gather, residual, the sparse
    and dense adds and sets; what they give into ``results``."""
    table = ffi.new("stella_flat_part[]", len(parts))
    codes = {F32: lib.STELLA_VAL_F32, np.float16: lib.STELLA_VAL_F16, np.uint16: lib.STELLA_VAL_BF16}
    at = 0
    for e, a in zip(table, parts):
        e.data = ffi.from_buffer(a) if a.size else ffi.NULL
        e.start, e.numel = at, a.size
        e.dtype = codes[a.dtype.type]
        at += a.size
    n = at
    rng = np.random.default_rng(22)
    out = np.empty(n, F32)
    assert lib.stella_flat_gather(table, len(parts), 0, n, ffi.from_buffer("float[]", out)) == 0
    results["flat_gather"] = out.copy()
    anchor = rng.standard_normal(n).astype(F32)
    assert lib.stella_flat_residual(table, len(parts), 0, n, ffi.from_buffer("float[]", anchor),
                                    ffi.from_buffer("float[]", out)) == 0
    results["flat_residual"] = out.copy()
    idx = np.sort(rng.choice(n - 7, n // 10, replace=False)).astype(np.int32)
    val = (rng.standard_normal(idx.size) * 10.0 ** rng.integers(-6, 5, idx.size)).astype(F32)
    for name in ("add_at", "set_at"):
        fn = getattr(lib, f"stella_flat_{name}")
        assert fn(table, len(parts), 7, ffi.from_buffer("int32_t[]", idx), ffi.from_buffer("float[]", val),
                  idx.size) == 0
        results[f"flat_{name}"] = np.concatenate([a.view(np.uint8) for a in parts])
    for setting in (0, 1):  # update mode's merge: the anchor takes the values, the weights its change
        assert lib.stella_flat_merge_at(table, len(parts), 7, ffi.from_buffer("int32_t[]", idx),
                                        ffi.from_buffer("float[]", val), idx.size, ffi.from_buffer("float[]", anchor),
                                        n - 7, setting) == 0
        results[f"flat_merge{setting}"] = np.concatenate([anchor.view(np.uint8), *(a.view(np.uint8) for a in parts)])
    dense = (rng.standard_normal(n - 100) * 10.0 ** rng.integers(-6, 5, n - 100)).astype(F32)
    for name in ("add_range", "set_range"):
        fn = getattr(lib, f"stella_flat_{name}")
        assert fn(table, len(parts), 50, n - 50, ffi.from_buffer("float[]", dense)) == 0
        results[f"flat_{name}"] = np.concatenate([a.view(np.uint8) for a in parts])


def run_kernels(out: str) -> None:
    """The subprocess's work: every dispatched kernel on the fixed inputs, into ``out`` (npz)."""
    from stella import _codec_native as codec_native
    from stella._native import ffi, lib

    res_: dict[str, np.ndarray] = {}
    info = stella.native_isa()
    res_["level"] = np.array([info.level, kernel.native_isa().level])
    for case, (method, res, grads) in enumerate(_topk_inputs()):
        unit = 1 if method == "threshold" else lib.STELLA_BLOCK
        state = ffi.new("stella_topk_state *")
        for step, g in enumerate(grads):
            k_units = K_TOPK if unit == 1 else K_TOPK // unit
            cap = lib.stella_topk_cap_units(k_units, -(-res.size // unit))
            idx, val, score = np.empty(cap * unit, np.int32), np.empty(cap * unit, F32), np.empty(cap, F32)
            args = ffi.new("stella_topk_args *", {"k_units": k_units, "unit": unit, "nsample": 4096, "seed": step})
            outp = ffi.new("stella_topk_out *", {"idx": ffi.from_buffer("int32_t[]", idx),
                                                 "val": ffi.from_buffer("float[]", val),
                                                 "score": ffi.from_buffer("float[]", score), "cap_units": cap})
            stats = ffi.new("stella_topk_stats *")
            gp = ffi.NULL if g is None else ffi.from_buffer("float[]", g)
            n = lib.stella_ef_topk(ffi.from_buffer("float[]", res), gp, res.size, args, state, outp, stats)
            assert n >= 0, n
            key = f"topk{case}_{step}"
            res_[key + "_idx"], res_[key + "_val"], res_[key + "_res"] = idx[:n], val[:n], res.copy()
            res_[key + "_state"] = np.array([state.emit_threshold, state.last_threshold, state.zero_threshold], F32)
            res_[key + "_passes"] = np.array([stats.passes, stats.exact_fallback])
    # the broadcast's pass that adds the step's sparse change as it goes: every level, and
    # the same bits as the scatter-add and then the pass (checked in the subprocess)
    from stella._select_native import SELECT as select
    rng = np.random.default_rng(12)
    for d, density in enumerate((0.003, 0.08, 0.6)):
        fused = rng.standard_normal(N_TOPK).astype(F32)
        plain, sf, sp = fused.copy(), select.state(), select.state()
        for step in range(TOPK_STEPS):
            t = np.sort(rng.choice(N_TOPK, int(N_TOPK * density), replace=False)).astype(np.int32)
            ch = (rng.standard_normal(t.size) * (1 + step)).astype(F32)
            i_f, v_f = select.ef_select(fused, None, K_TOPK, 1, sf, 4096, step, adds=[(t, ch)])
            plain[t] += ch
            i_p, v_p = select.ef_select(plain, None, K_TOPK, 1, sp, 4096, step)
            assert i_f.tobytes() == i_p.tobytes() and v_f.tobytes() == v_p.tobytes(), (d, step)
            assert fused.tobytes() == plain.tobytes(), (d, step)
            res_[f"add{d}_{step}_idx"], res_[f"add{d}_{step}_val"] = i_f, v_f
        res_[f"add{d}_res"] = fused
    v = _conversion_input()
    res_["f16"], res_["bf16"] = codec_native.f32_to_f16(v), codec_native.f32_to_bf16(v)
    res_["f16_back"] = codec_native.f16_to_f32(res_["f16"])
    res_["bf16_back"] = codec_native.bf16_to_f32(res_["bf16"])
    res_["f16_all"] = codec_native.f16_to_f32(np.arange(2**16, dtype=np.uint16))  # every half, sNaNs too
    qv = v[np.isfinite(v)]
    for dt in ("q4", "q2"):  # the low-bit codings: frames, the values they decode to, decoded frames
        res_[dt] = codec_native.q_encode(qv, dt)
        res_[dt + "_round"] = codec_native.q_round(qv, dt)
        res_[dt + "_back"] = codec_native.q_decode(res_[dt], qv.size, dt)
    for dt in ("f32", "f16", "bf16"):  # lengths around the lanes and the chunk of the C loop
        wire = _sumsq_wire(dt)
        res_[f"sumsq_{dt}"] = np.array([codec_native.sum_of_squares(wire[:n]) for n in SUMSQ_LENGTHS])
    for name, wire in CONFIGS.items():
        cfg = OptimizerConfig.from_wire(wire)
        st = kernel.KernelTensorState(np.linspace(-1, 1, N_OPT, dtype=F32), cfg)
        for step in range(OPT_STEPS):
            res_[f"{name}_touched{step}"] = st.apply(_opt_pushes(step), 0.25, cfg)
        for field, a in st.state_arrays().items():
            res_[f"{name}_{field}"] = a
    cfg = OptimizerConfig.from_wire({"name": "sgd", "lr": 1.0})
    st = kernel.KernelTensorState(np.linspace(-1, 1, N_OPT, dtype=F32), cfg)
    for step in range(4):
        pushes = _count_pushes(step)
        st.apply(pushes, 1.0 / len(pushes), cfg, count_scale=_count_scale(pushes))
    res_["count_param"] = st.state_arrays()["param"]
    res_["union"] = kernel.union_indices([p[0] for p in _opt_pushes(0)])
    _flat_ops(ffi, lib, _flat_parts(), res_)
    np.savez(out, **res_)


def _run(level: str, tmp_path: pathlib.Path) -> tuple[dict[str, np.ndarray], str]:
    out = tmp_path / f"{level}.npz"
    env = {**os.environ, ISA_ENV: level}
    # this file, run as a script (__main__ below): it imports the installed packages only
    p = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"{level}: rc {p.returncode}\n{p.stderr[-3000:]}"
    with np.load(out) as z:
        return {k: z[k] for k in z.files}, p.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[dict[str, np.ndarray], str]]:
    tmp = tmp_path_factory.mktemp("dispatch")
    return {level: _run(level, tmp) for level in stella.native_isa().runnable}


def test_levels_reported_and_runnable_ones_chosen_by_default():
    info, kinfo = stella.native_isa(), kernel.native_isa()
    assert info == kinfo  # one choice, made the same way in both modules
    assert info.runnable[0] == "portable" and set(info.runnable) <= set(info.compiled) <= set(ISA_LEVELS)
    if os.environ.get(ISA_ENV, "auto") == "auto":
        assert info.level == info.runnable[-1] and not info.fell_back


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="x86-64 only")
def test_variants_compiled_in_and_avx512_only_where_the_cpu_has_it():
    info = stella.native_isa()
    assert info.compiled == ISA_LEVELS  # GCC on x86-64: portable, v3 and v4 copies
    flags = set(pathlib.Path("/proc/cpuinfo").read_text().split())
    assert ("x86-64-v4" in info.runnable) == ({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= flags)
    assert ("x86-64-v3" in info.runnable) == ({"avx2", "f16c", "fma", "bmi2", "movbe"} <= flags)


def test_every_level_gives_the_same_bits(runs):
    base, _ = runs["portable"]
    for level, (got, stderr) in runs.items():
        assert list(got["level"]) == [level, level]
        assert "RuntimeWarning" not in stderr
        assert got.keys() == base.keys()
        for key in base:
            if key != "level":
                assert got[key].dtype == base[key].dtype and got[key].tobytes() == base[key].tobytes(), (level, key)


def test_results_match_the_references(runs):
    import torch

    from stella import codec

    got, _ = runs[stella.native_isa().runnable[-1]]
    # top-k: mass conserved exactly (res + grad == residual + sent), and a top set
    for case, (method, res, grads) in enumerate(_topk_inputs()):
        res = res.copy()
        for step, g in enumerate(grads):
            acc = res + g if g is not None else res
            key = f"topk{case}_{step}"
            idx, val, res = got[key + "_idx"], got[key + "_val"], got[key + "_res"]
            assert np.all(np.diff(idx) > 0) and idx.size > 0
            back = res.copy()
            back[idx] += val
            assert back.tobytes() == acc.tobytes()
            assert np.all(res[idx] == 0)
            if method == "threshold":
                assert np.abs(val).min() >= np.abs(np.delete(acc, idx)).max()
            else:
                blocks = np.pad(acc, (0, -acc.size % 16)).reshape(-1, 16).astype(np.float64)
                score = (blocks**2).sum(1)
                sent = np.unique(idx // 16)
                assert np.all(idx // 16 == np.repeat(sent, 16)[: idx.size])
                assert score[sent].min() >= np.delete(score, sent).max() * (1 - 1e-6)
    # conversions: numpy (f16) and torch (bf16), NaN stays NaN
    v = _conversion_input()
    nan = np.isnan(v)
    with np.errstate(over="ignore"):  # (to inf, as it should)
        assert got["f16"][~nan].tobytes() == v[~nan].astype(np.float16).view(np.uint16).tobytes()
    bf = torch.from_numpy(v).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert got["bf16"][~nan].tobytes() == bf[~nan].tobytes()
    assert np.all(np.isnan(got["f16_back"][nan])) and np.all(np.isnan(got["bf16_back"][nan]))
    assert got["f16_back"].tobytes() == got["f16"].view(np.float16).astype(F32).tobytes()
    every = np.arange(2**16, dtype=np.uint16).view(np.float16).astype(F32)
    nan = np.isnan(every)
    assert got["f16_all"][~nan].tobytes() == every[~nan].tobytes()
    assert np.all(got["f16_all"].view(np.uint32)[nan] & 0x7FC00000 == 0x7FC00000)  # quiet NaNs
    # q4/q2: the frames of the codec's tested reference (tests/test_codec.py), checked there at this
    # build's -march; here the values they decode to are the rounded ones, and rounding is idempotent
    for dt in ("q4", "q2"):
        assert got[dt + "_back"].tobytes() == got[dt + "_round"].tobytes()
        assert got[dt + "_round"].tobytes() == codec.quantise(got[dt + "_round"], dt).tobytes()
    # the push norm's sum of squares: float64 numpy's (the order of the additions differs)
    for dt in ("f32", "f16", "bf16"):
        wire = _sumsq_wire(dt)
        x = (wire.astype(np.uint32) << 16).view(F32) if dt == "bf16" else wire.astype(F32)
        want = [float(np.sum(np.square(x[:n].astype(np.float64)))) for n in SUMSQ_LENGTHS]
        np.testing.assert_allclose(got[f"sumsq_{dt}"], want, rtol=1e-13, atol=0)
    # the optimizer's apply: bit-identical to optim_ref, union as numpy's
    for name, wire in CONFIGS.items():
        cfg = OptimizerConfig.from_wire(wire)
        ref = RefTensorState(np.linspace(-1, 1, N_OPT, dtype=F32), cfg)
        for step in range(OPT_STEPS):
            touched = ref.apply([_as_ref(p) for p in _opt_pushes(step)], 0.25, cfg)
            np.testing.assert_array_equal(got[f"{name}_touched{step}"], touched)
        for field in ("param", "momentum_buf", "exp_avg", "exp_avg_sq", "step"):
            if f"{name}_{field}" in got:
                assert got[f"{name}_{field}"].tobytes() == getattr(ref, field).tobytes(), (name, field)
    cfg = OptimizerConfig.from_wire({"name": "sgd", "lr": 1.0})
    ref = RefTensorState(np.linspace(-1, 1, N_OPT, dtype=F32), cfg)
    for step in range(4):
        pushes = _count_pushes(step)
        ref.apply([_as_ref(p) for p in pushes], 1.0 / len(pushes), cfg, count_scale=_count_scale(pushes))
    assert got["count_param"].tobytes() == ref.param.tobytes()
    assert got["union"].tobytes() == np.unique(np.concatenate([p[0] for p in _opt_pushes(0)])).tobytes()
    # the flat model's gather widens exactly, and its residual is anchor - w in float32
    parts = _flat_parts()
    widened = np.concatenate([(a.astype(np.uint32) << 16).view(F32) if a.dtype == np.uint16 else a.astype(F32)
                              for a in parts])
    assert got["flat_gather"].tobytes() == widened.tobytes()
    anchor = np.random.default_rng(22).standard_normal(widened.size).astype(F32)
    assert got["flat_residual"].tobytes() == (anchor - widened).tobytes()


@pytest.mark.parametrize("ask", ["x86-64-v4", "x86-64-v3", "bogus"])
def test_a_level_the_cpu_lacks_falls_back_visibly(ask, tmp_path):
    info = stella.native_isa()
    if ask in info.runnable:
        pytest.skip(f"this CPU runs {ask}")
    got, stderr = _run(ask, tmp_path)  # must not die of SIGILL
    best = info.runnable[-1] if ask != "x86-64-v3" else "portable"
    assert list(got["level"]) == [best, best]
    assert f"{ISA_ENV}={ask!r}" in stderr and "RuntimeWarning" in stderr


def test_stella_ps_logs_its_level(make_server, make_client):
    ps = make_server(1, env={ISA_ENV: "portable"})
    make_client(ps.endpoint, join=False).status()  # answered: serve() has logged "listening"
    lines = [json.loads(line) for line in ps.logs().splitlines() if line.startswith("{")]
    (listening,) = [r for r in lines if r["msg"] == "listening"]
    assert listening["native_isa"] == "portable"


NODISPATCH = (("_stella_client_nodispatch", ["codec", "compress", "flat"]), ("_stella_server_nodispatch", ["optim"]))


def _build_without_dispatch():
    """Both extensions as aarch64, clang and ``-DSTELLA_NO_DISPATCH`` builds get them: one
    copy of each kernel under its plain name; (client module, server module), under names
    of their own (the production modules stay loaded). Built and loaded as the bench-only
    module is (bench/_native_bench.py); an undefined symbol fails the load, as it fails the
    import of a real build. The two builds (~10 s of compiling) are kept, as the bench-only
    one is, in ``build/`` under a hash of everything that goes into them (the native
    sources, the build's environment, the interpreter): a change of any gives a new build."""
    import hashlib
    import shutil
    import tempfile

    from bench._native_bench import NATIVE, ROOT, _build_script, _module_from

    h = hashlib.sha256(repr((sys.version, sorted((k, v) for k, v in os.environ.items()
                                                  if k.startswith(("STELLA_NATIVE_", "CC", "CFLAGS", "LDFLAGS"))),
                             NODISPATCH)).encode())
    for p in sorted(NATIVE.rglob("*")):
        if p.is_file() and p.suffix in (".c", ".h", ".py"):
            h.update(p.relative_to(NATIVE).as_posix().encode() + b"\0" + p.read_bytes())
    out = ROOT / "build" / "test_nodispatch" / h.hexdigest()[:16]
    if not out.exists():  # built aside, then moved in whole: an interrupted build leaves nothing half done
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(dir=out.parent))
        build = _build_script()
        for name, areas in NODISPATCH:
            build.builder(name, areas, defines=("STELLA_NO_DISPATCH",), absolute=True).compile(
                tmpdir=str(tmp), verbose=False)
        try:
            tmp.rename(out)
        except OSError:  # another run built it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    return [_module_from(name, next(out.glob(f"{name}*.so"))) for name, _ in NODISPATCH]


def test_a_build_without_dispatch_links_and_gives_the_same_bits():
    """Every entry point is defined once dispatch is off (a definition left inside the
    dispatching copy's section once went missing there: the client module did not
    import), and the one copy computes what the dispatched build does."""
    from stella import codec
    from stella._native import lib as prod

    client, server = _build_without_dispatch()
    for mod in (client, server):
        assert mod.ffi.string(mod.lib.stella_native_isa()) == b"portable"
    lib, ffi = client.lib, client.ffi
    assert lib.stella_topk_cap_units(1000, 10**6) == prod.stella_topk_cap_units(1000, 10**6) == 4024
    v = _conversion_input()
    v = v[np.isfinite(v)]
    for dt in ("q4", "q2"):  # the low-bit codings: the frame and the values it decodes to
        code = getattr(lib, f"STELLA_VAL_{dt.upper()}")
        size = lib.stella_q_size(v.size, code)
        frame, deq = np.empty(size, np.uint8), np.empty(v.size, F32)
        assert lib.stella_q_encode(ffi.from_buffer("float[]", v), v.size, code, ffi.from_buffer("uint8_t[]", frame),
                                   size, ffi.from_buffer("float[]", deq)) == size
        assert frame.tobytes() == codec.encode_values(v, dt).tobytes()
        assert deq.tobytes() == codec.quantise(v, dt).tobytes()
    wire = _sumsq_wire("f16")
    out = ffi.new("double *")
    assert lib.stella_values_sumsq(ffi.from_buffer(wire), wire.size, lib.STELLA_VAL_F16, out) == 0
    assert out[0] == codec.sum_of_squares(wire)
    from stella._native import ffi as prod_ffi

    flat: list[dict[str, np.ndarray]] = [{}, {}]
    _flat_ops(ffi, lib, _flat_parts(), flat[0])
    _flat_ops(prod_ffi, prod, _flat_parts(), flat[1])
    assert flat[0].keys() == flat[1].keys() and all(flat[0][k].tobytes() == flat[1][k].tobytes() for k in flat[0])


if __name__ == "__main__":  # one level's kernels in a process of their own (_run)
    run_kernels(sys.argv[1])
