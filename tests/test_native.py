"""The native boundary: two modules by owner, one checked-call helper, C constants via cffi."""
from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch

from stella import native_errors
from stella._native import lib as client_lib
from stella.compress import BLOCK, ErrorFeedbackCompressor
from stella.errors import CodecError
from stella_ps import kernel
from stella_ps._kernel import ffi as server_ffi
from stella_ps._kernel import lib as server_lib
from stella_ps.errors import KernelError, KernelInputError, StellaPSError


@pytest.mark.parametrize("lib", [client_lib, server_lib], ids=["client", "server"])
def test_abi_and_error_text_come_from_c(lib):
    native_errors.require_abi(lib, "x")  # does not raise
    assert lib.STELLA_ABI_VERSION == lib.stella_abi_version() == native_errors.ABI_VERSION
    codes = [lib.STELLA_E_RANGE, lib.STELLA_E_ORDER, lib.STELLA_E_NONFINITE, lib.STELLA_E_CORRUPT,
             lib.STELLA_E_ARG, lib.STELLA_E_NOMEM]
    assert len(set(codes)) == len(codes) and all(c < 0 for c in codes) and lib.STELLA_OK == 0
    texts = [native_errors.strerror(lib, c) for c in codes]
    assert len(set(texts)) == len(texts) and "unknown" not in " ".join(texts)
    assert native_errors.check(lib, 7, "x", CodecError) == 7
    with pytest.raises(CodecError, match=r"what: index out of range \(code -1\)"):
        native_errors.check(lib, lib.STELLA_E_RANGE, "what", CodecError)
    with pytest.raises(MemoryError):
        native_errors.check(lib, lib.STELLA_E_NOMEM, "what", CodecError)
    with pytest.raises(KernelInputError):
        native_errors.check(lib, lib.STELLA_E_ORDER, "what", {lib.STELLA_E_ORDER: KernelInputError, None: KernelError})
    with pytest.raises(KernelError):
        native_errors.check(lib, lib.STELLA_E_ARG, "what", {lib.STELLA_E_ORDER: KernelInputError, None: KernelError})


def test_stale_build_fails_the_import():
    class Stale:
        STELLA_ABI_VERSION = native_errors.ABI_VERSION - 1

        @staticmethod
        def stella_abi_version():
            return native_errors.ABI_VERSION - 1

    with pytest.raises(ImportError, match="make install"):
        native_errors.require_abi(Stale, "stale")


def test_each_package_owns_its_c():
    """The client module has no optimizer, the server module no codec (it has the
    selection, for its broadcast), and neither ships the benchmark knobs."""
    client, server = set(dir(client_lib)), set(dir(server_lib))
    assert "stella_idx_decode" in client and "stella_ef_topk" in client
    assert not any(n.startswith(("stella_optim", "stella_union", "stella_pool")) for n in client)
    assert "stella_optim_apply" in server and "stella_union_indices" in server and "stella_ef_topk_add" in server
    assert not any(n.startswith(("stella_idx", "stella_f16", "stella_q_")) for n in server)
    for name in ("stella_optim_set_tuning", "stella_probe_random_rmw"):
        assert name not in client | server
    assert not hasattr(kernel, "set_tuning") and not hasattr(kernel, "probe_random_rmw")
    assert BLOCK == client_lib.STELLA_BLOCK


def test_server_imports_no_private_client_module():
    import stella_ps

    for path in pathlib.Path(stella_ps.__file__).parent.glob("*.py"):
        src = path.read_text()
        assert "from stella._" not in src and "import stella._" not in src, path.name


def test_server_errors_have_one_root():
    assert issubclass(KernelInputError, StellaPSError) and issubclass(KernelInputError, ValueError)
    assert issubclass(KernelError, StellaPSError) and issubclass(KernelError, RuntimeError)
    assert kernel.KernelInputError is KernelInputError


def test_sortedness_check_reports_position():
    cfg = _cfg()
    state = kernel.KernelTensorState(np.zeros(5, np.float32), cfg)
    with pytest.raises(KernelInputError, match="index 9 at position 2 is outside"):
        state.apply([(np.array([1, 2, 9], np.int32), np.ones(3, np.float32))], 1.0, cfg)
    with pytest.raises(KernelInputError, match="not strictly increasing at position 1"):
        kernel.union_indices([np.array([3, 3], np.int32)])


def _first_offender(idx: np.ndarray, numel: int) -> tuple[str, int] | None:
    prev = -1
    for i, x in enumerate(idx.tolist()):
        if x < 0 or x >= numel:
            return "range", i
        if x <= prev:
            return "order", i
        prev = x
    return None


def test_sortedness_check_finds_the_first_offender_in_long_arrays():
    """The check runs whole blocks without branches and the scalar loop from the first
    block marked: every kind of fault, anywhere (block edges included), against a
    plain loop; the error kinds interleaved so that the first one must win."""
    rng = np.random.default_rng(7)
    out = server_ffi.new("int64_t *")
    codes = {server_lib.STELLA_E_RANGE: "range", server_lib.STELLA_E_ORDER: "order"}
    for case in range(400):
        n = int(rng.integers(1, 1400))
        numel = int(rng.choice([n + 5, 3 * n, 2**31 - 1, 2**40]))
        idx = np.sort(rng.choice(min(numel, 4 * n + 10), n, replace=False)).astype(np.int32)
        for _ in range(int(rng.integers(0, 3))):  # 0, 1 or 2 faults
            pos = int(rng.choice([0, 255, 256, 257, 511, 512, n - 1, int(rng.integers(0, n))])) % n
            kind = rng.integers(0, 4)
            idx[pos] = (-1 if kind == 0 else min(numel, 2**31 - 1) if kind == 1 else
                        idx[pos - 1] if kind == 2 and pos else max(idx[pos] - 7, -3))
        rc = server_lib.stella_check_sorted(server_ffi.from_buffer("int32_t[]", idx), n, numel, out)
        want = _first_offender(idx, numel)
        got = None if rc == server_lib.STELLA_OK else (codes[rc], int(out[0]))
        assert got == want, (case, n, numel, got, want)


def _cfg():
    from stella_ps.optim import OptimizerConfig

    return OptimizerConfig.from_wire({"name": "sgd", "lr": 0.1})


@pytest.mark.parametrize("method", ["threshold", "block"])
def test_select_stats_are_filled_per_key(method):
    comp = ErrorFeedbackCompressor(density=0.01, method=method, backend="native")
    comp.compress("w", torch.randn(100_000))
    stats = comp.select_stats("w")
    assert set(stats) == {"passes", "estimates", "trims", "givebacks", "units", "exact_fallback"}
    assert stats["passes"] >= 1 and stats["estimates"] >= 1
    k_units = 1000 if method == "threshold" else round(1000 / BLOCK)
    assert 0.9 * k_units <= stats["units"] <= 1.1 * k_units + 1
    torch_comp = ErrorFeedbackCompressor(density=0.01, method=method, backend="torch")
    torch_comp.compress("w", torch.randn(100_000))
    assert torch_comp.select_stats("w") is None


STEADY_CALLS = 24  # selections counted once the residual has settled (after as many again)


@pytest.mark.parametrize("method", ["threshold", "block"])
def test_a_steady_gradient_stream_keeps_the_carried_threshold(method):
    """Once the residual has settled, each selection starts from the threshold the last
    one carried and does not sample the tensor again. Error feedback cuts the residual
    near the kept threshold every step, so its scores pile up just below it: a threshold
    carried from the slope of the tail above came out low, drew several times the
    candidates, and was estimated again nearly every call (up to a second pass over the
    tensor for blocks)."""
    from bench.compress import _gen_grad

    n, density = 300_000, 0.003
    gen = torch.Generator().manual_seed(3)
    mean = torch.randn(n, generator=gen) * 0.1
    comp = ErrorFeedbackCompressor(density=density, method=method, backend="native", dense_below=0)
    estimates = passes = 0
    for step in range(2 * STEADY_CALLS):
        comp.compress("w", _gen_grad(n, mean, gen, torch.device("cpu")))
        if step >= STEADY_CALLS:
            stats = comp.select_stats("w")
            estimates, passes = estimates + stats["estimates"], passes + stats["passes"]
    assert estimates <= STEADY_CALLS // 4 and passes == STEADY_CALLS


def test_the_broadcasts_selection_keeps_its_carried_threshold():
    """The server's broadcast (stella_ps.topk.Selector, over the server's own module): each
    step adds a random change at the touched 2% of the residual (two pushes of 1%) in the
    pass, and takes 1%."""
    from stella_ps.topk import SELECT

    n, k = 400_000, 4_000
    rng = np.random.default_rng(5)
    r, state = np.zeros(n, np.float32), SELECT.state()
    estimates = 0
    for step in range(2 * STEADY_CALLS):
        idx = np.unique(rng.choice(n, n // 50, replace=False)).astype(np.int32)
        change = (rng.standard_normal(idx.size) * 1e-3).astype(np.float32)
        stats = SELECT.stats()
        SELECT.ef_select(r, None, k, 1, state, 40_000, step, adds=[(idx, change)], stats=stats)
        if step >= STEADY_CALLS:
            estimates += stats.as_dict()["estimates"]
            assert stats.as_dict()["passes"] == 1
    assert estimates <= STEADY_CALLS // 4


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("n", [3_000, 70_001])  # below and above the pass's tiles (4096 floats)
def test_a_selection_that_adds_sparse_changes_matches_the_scatters_then_the_pass(n):
    """stella_ef_topk_add (the broadcast's step: the last message's coding error, then
    the step's change): the same selection, residual and carried thresholds, bit for bit,
    as adding the changes one after the other and then selecting; at densities from none
    to all, with changes that meet at some coordinates, one that cancels a value exactly
    (to 0 and -0), k from 1 to n."""
    from stella_ps.topk import Selector

    rng = np.random.default_rng(5)
    for density in (0.0, 0.001, 0.03, 0.3, 1.0):
        for k in (1, n // 100, n):
            plain = (rng.standard_normal(n) * 0.01).astype(np.float32)
            plain[rng.random(n) < 0.3] = 0.0
            plain[:3] = -0.0
            fused = plain.copy()
            sp, sf = Selector(seed=9), Selector(seed=9)
            for step in range(4):
                adds = []
                for part in range(1 + step % 3):  # 1, 2 or 3 lists
                    idx = np.sort(rng.choice(n, int(n * density), replace=False)).astype(np.int32)
                    ch = (rng.standard_normal(idx.size) * (1 + step) * 10.0**-part).astype(np.float32)
                    if idx.size > 1 and part == 0:
                        ch[0], ch[1] = -plain[idx[0]], -np.float32(0.0)
                    plain[idx] += ch
                    adds.append((idx, ch))
                ip, vp = sp.take(plain, k)
                i_f, vf = sf.take(fused, k, adds=adds)
                case = (n, density, k, step)
                assert _same_bits(ip, i_f) and _same_bits(vp, vf), case
                assert _same_bits(plain, fused) and sp.threshold == sf.threshold, case
                assert ip.size > 0 or not plain.any(), case


def test_a_bad_sparse_change_is_refused_before_anything_is_written():
    from stella._select_native import SELECT as select

    rng = np.random.default_rng(6)
    res = rng.standard_normal(10_000).astype(np.float32)
    before = res.copy()
    good_idx, good_val = np.array([3, 70, 9_999], np.int32), np.ones(3, np.float32)
    bad = {
        "out of range": (np.array([3, 70, 10_000], np.int32), good_val),
        "negative": (np.array([-1, 70, 900], np.int32), good_val),
        "unsorted": (np.array([70, 3, 900], np.int32), good_val),
        "repeated": (np.array([3, 70, 70], np.int32), good_val),
        "int64": (good_idx.astype(np.int64), good_val),
        "f64": (good_idx, good_val.astype(np.float64)),
        "lengths": (good_idx, np.ones(2, np.float32)),
    }
    for what, add in bad.items():
        for adds in ([add], [(good_idx, good_val), add]):  # a good list before a bad one is not added either
            with pytest.raises(ValueError):
                select.ef_select(res, None, 100, 1, select.state(), 4096, 1, adds=adds)  # type: ignore[arg-type]
            assert _same_bits(res, before), what
    with pytest.raises(ValueError, match="at most"):
        select.ef_select(res, None, 100, 1, select.state(), 4096, 1, adds=[(good_idx, good_val)] * 5)
    for unit, grad in ((BLOCK, None), (1, np.zeros_like(res))):  # blocks, or a gradient as well: not offered
        with pytest.raises(ValueError, match="unit 1 and no grad"):
            select.ef_select(res, grad, 100, unit, select.state(), 4096, 1, adds=[(good_idx, good_val)])
        assert _same_bits(res, before)


# ------------------------------------------------------------------------------ the selection's pass on threads

def _selection_run(threads: int, n: int, k: int, steps: int, seed: int, case: str):
    """``steps`` selections over one residual (the broadcast's: adds, no gradient; or the
    compressor's: a gradient), carrying the state; every output and the residual after each."""
    from stella_ps.topk import SELECT

    rng = np.random.default_rng(seed)
    res = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    if case == "ties":  # every magnitude equal: no threshold between 0 and all; the exact fallback, truncated
        res[:] = np.float32(1.0)
    state, out = SELECT.state(), []
    for step in range(steps):
        stats = SELECT.stats()
        if case == "grad":
            g = (rng.standard_normal(n) * 10.0 ** (step % 3 - 3)).astype(np.float32)
            idx, val = SELECT.ef_select(res, g, k, 1, state, 4096, seed + step, stats, threads=threads)
        else:
            adds = []
            if case != "ties":
                for _ in range(2):
                    i = np.sort(rng.choice(n, n // 50, replace=False)).astype(np.int32)
                    adds.append((i, (rng.standard_normal(i.size) * 10.0 ** (step % 3 - 2)).astype(np.float32)))
            idx, val = SELECT.ef_select(res, None, k, 1, state, 4096, seed + step, stats, adds=adds, threads=threads)
        out.append((idx.copy(), val.copy(), res.copy(), state.last_threshold, stats.as_dict()))
    return out


@pytest.mark.parametrize("case", ["adds", "grad", "ties"])
def test_the_selections_pass_on_threads_gives_the_same_bits(case):
    """ef_select's unit-1 pass split over threads (ranges of whole tiles, each into its own buffers, joined in
    order): the same indices, values, residual and carried state as one pass, through estimates, give-backs
    of an overflow (the first steps' thresholds), and the exact fallback's truncated pass (ties)."""
    n, k = 2_500_000 + 4321, 25_000  # 2 ranges at 1M a thread at least (3 asked)
    one = _selection_run(1, n, k, 4 if case != "ties" else 1, 7, case)
    three = _selection_run(3, n, k, 4 if case != "ties" else 1, 7, case)
    seen = set()
    for a, b in zip(one, three, strict=True):
        assert np.array_equal(a[0], b[0]) and a[1].tobytes() == b[1].tobytes()
        assert a[2].tobytes() == b[2].tobytes()
        assert a[3] == b[3] and a[4] == b[4]
        seen |= {name for name, v in a[4].items() if v and name in ("givebacks", "exact_fallback")}
    if case == "ties":
        assert "exact_fallback" in seen  # the truncated pass ran
