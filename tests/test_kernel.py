"""The C lazy-optimizer kernel against the NumPy reference (optim_ref)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stella_ps import kernel
from stella_ps.aggregation import count_table
from stella_ps.kernel import KernelTensorState, union_indices
from stella_ps.optim import OptimizerConfig
from stella_ps.optim_ref import RefTensorState

F32 = np.float32
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=150)


@pytest.fixture(autouse=True)
def _one_thread():
    kernel.set_num_threads(1)
    yield
    kernel.set_num_threads(1)


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest even."""
    u = x.astype(F32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_to_f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(F32)


def as_ref_push(push):
    """The reference takes float32 values: fp16 and bf16 converted first."""
    idx, vals = push
    if vals.dtype == np.uint16:
        return idx, bf16_to_f32(vals)
    return idx, vals.astype(F32)


def make_push(rng: np.random.Generator, numel: int, density: float, dense: bool, dtype: str):
    if dense:
        idx = None
        n = numel
    else:
        n = int(rng.binomial(numel, density))
        idx = np.sort(rng.choice(numel, n, replace=False)).astype(np.int32)
    vals = rng.standard_normal(n).astype(F32) * F32(rng.choice([1e-3, 1.0, 30.0]))
    if dtype == "f16":
        vals = vals.astype(np.float16)
    elif dtype == "bf16":
        vals = to_bf16_bits(vals)
    return idx, vals


@st.composite
def configs(draw, name=None):
    name = name or draw(st.sampled_from(["sgd", "adam", "adamw"]))
    lr = draw(st.floats(1e-4, 1.0))
    wd = draw(st.sampled_from([0.0, draw(st.floats(1e-4, 0.5))]))
    if name == "sgd":
        momentum = draw(st.sampled_from([0.0, draw(st.floats(0.0, 0.99))]))
        nesterov = momentum > 0 and draw(st.booleans())
        dampening = 0.0 if nesterov else draw(st.sampled_from([0.0, draw(st.floats(0.0, 0.9))]))
        hp = {"momentum": momentum, "dampening": dampening, "nesterov": nesterov,
              "momentum_mode": draw(st.sampled_from(["fold", "lazy"]))}
    else:
        b1 = draw(st.sampled_from([0.0, 0.9, draw(st.floats(0.0, 0.999))]))
        b2 = draw(st.sampled_from([0.999, 0.5, draw(st.floats(0.0, 0.9999))]))
        hp = {"betas": (b1, b2), "eps": draw(st.sampled_from([1e-8, 1e-3]))}
    return OptimizerConfig.from_wire({"name": name, "lr": lr, "weight_decay": wd, **hp})


def assert_same_state(k: KernelTensorState, r: RefTensorState):
    arrays = k.state_arrays()
    for name, a in arrays.items():
        want = getattr(r, name)
        if a.dtype == np.uint32:
            np.testing.assert_array_equal(a, want, err_msg=name)
        else:  # float32 rounding: the kernel is bit-identical in practice
            np.testing.assert_allclose(a, want, rtol=1e-6, atol=1e-30, err_msg=name)
    np.testing.assert_array_equal(k.snapshot(), arrays["param"])


def assert_same_bits(k: KernelTensorState, r: RefTensorState):
    """Every state field of the kernel equal bit for bit to the reference's."""
    for name, a in k.state_arrays().items():
        assert a.tobytes() == getattr(r, name).tobytes(), name


@SETTINGS
@given(
    cfg=configs(),
    numel=st.integers(1, 2000),
    workers=st.integers(1, 6),
    steps=st.integers(1, 50),
    seed=st.integers(0, 2**32 - 1),
    dense_prob=st.sampled_from([0.0, 0.1, 0.3]),
    count=st.sampled_from([0.0, 0.5, 1.0]),
)
def test_matches_reference(cfg, numel, workers, steps, seed, dense_prob, count):
    """Random steps (a count exponent: each coordinate's sum scaled by the pushes that
    carried it, update mode's count_exponent) equal the reference bit for bit."""
    rng = np.random.default_rng(seed)
    init = rng.standard_normal(numel).astype(F32)
    k, r = KernelTensorState(init, cfg), RefTensorState(init, cfg)
    for _step in range(steps):
        if rng.random() < 0.2:  # learning-rate schedule
            cfg = cfg.updated({"lr": min(1.0, float(cfg.hparams["lr"] * rng.uniform(0.5, 1.5)))})  # lr * wd <= 1
        w = int(rng.integers(1, workers + 1))
        density = float(rng.choice([0.001, 0.01, 0.1, 0.5, 1.0]))
        pushes = [
            make_push(rng, numel, density, rng.random() < dense_prob, str(rng.choice(["f32", "f16", "bf16"])))
            for _ in range(w)
        ]
        cs = count_table(w, count, 1.0 / w)
        got = k.apply(pushes, 1.0 / w, cfg, count_scale=cs)
        want = r.apply([as_ref_push(p) for p in pushes], 1.0 / w, cfg, count_scale=cs)
        np.testing.assert_array_equal(got, want)
        assert got.dtype == np.int32
    assert_same_state(k, r)


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_bit_identical_long_run(name):
    """Fifty steps of overlapping pushes: every field equal bit for bit."""
    rng = np.random.default_rng(7)
    hp = {"momentum": 0.9, "nesterov": True, "momentum_mode": "lazy"} if name == "sgd" else {"betas": (0.8, 0.95)}
    cfg = OptimizerConfig.from_wire({"name": name, "lr": 0.05, "weight_decay": 0.01, **hp})
    init = rng.standard_normal(5000).astype(F32)
    k, r = KernelTensorState(init, cfg), RefTensorState(init, cfg)
    for step in range(50):
        cfg = cfg.updated({"lr": 0.05 * (1 - step / 60)})
        pushes = [make_push(rng, 5000, 0.05, False, "f32") for _ in range(4)]
        k.apply(pushes, 0.25, cfg)
        r.apply(pushes, 0.25, cfg)
    assert_same_bits(k, r)


def _kernel_and_reference(name: str, numel: int, rng: np.random.Generator):
    """A config with momentum or betas and weight decay, and kernel and reference
    states from one random init."""
    hp = {"momentum": 0.9} if name == "sgd" else {"betas": (0.8, 0.95)}
    cfg = OptimizerConfig.from_wire({"name": name, "lr": 0.05, "weight_decay": 0.01, **hp})
    init = rng.standard_normal(numel).astype(F32)
    return cfg, KernelTensorState(init, cfg), RefTensorState(init, cfg)


def _some_negative_zeros(rng: np.random.Generator, vals: np.ndarray) -> None:
    """About 2% of ``vals`` (f32, f16, or bf16 bits) set to -0.0, in place."""
    z = rng.choice(vals.size, max(1, vals.size // 50), replace=False)
    vals[z] = np.array(-0.0, np.float32).astype(vals.dtype) if vals.dtype != np.uint16 else 0x8000


@pytest.mark.parametrize("name", ["sgd", "adamw"])
@pytest.mark.parametrize("workers", [3, 4, 6])
@pytest.mark.parametrize("threads", [1, 2])
def test_several_sparse_pushes_bit_identical(name, workers, threads):
    """Three to six sparse pushes at low density (update.c: with 3 or 4, the first W - 1
    chained through two-way merges, the last merged into the tiles; with 6, the window)
    and at 1% (the window):
    every field equal bit for bit to the reference, with coordinates shared by some
    pushes, negative zeros, mixed value codings, and pushes that end early; odd steps
    scaled by count (count_exponent 0.5: the chain's entries carry their counts)."""
    rng = np.random.default_rng(23 + workers)
    numel = 200_000
    cfg, k, r = _kernel_and_reference(name, numel, rng)
    kernel.set_num_threads(threads)  # the autouse fixture resets it
    for step in range(6):
        density = (0.0005, 0.002, 0.01)[step % 3]
        base = make_push(rng, numel, density, False, "f32")[0]
        pushes = []
        for w in range(workers):
            own = make_push(rng, numel // (1 + (w + step) % 3), density, False, "f32")[0]  # some end early
            shared = rng.choice(base, base.size // 2, replace=False)  # half of base in every push
            idx = np.union1d(own, shared).astype(np.int32)
            dt = ("f32", "f16", "bf16")[(w + step) % 3]
            vals = make_push(rng, idx.size, 1.0, True, dt)[1]
            _some_negative_zeros(rng, vals)
            pushes.append((idx, vals))
        cs = count_table(workers, 0.5, 1.0 / workers) if step % 2 else None
        got = k.apply(pushes, 1.0 / workers, cfg, count_scale=cs)
        want = r.apply([as_ref_push(p) for p in pushes], 1.0 / workers, cfg, count_scale=cs)
        np.testing.assert_array_equal(got, want)
    assert_same_bits(k, r)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
@pytest.mark.parametrize("dtypes", [("f32", "f32"), ("f16", "bf16"), ("bf16", "f32")])
@pytest.mark.parametrize("threads", [1, 2])
def test_two_sparse_pushes_bit_identical(name, dtypes, threads):
    """Two sparse pushes below the comparison merge's density bound (merge.c: the
    two-way merge, not the window): every field equal bit for bit to the reference,
    over tiles, thread ranges, shared and one-sided coordinates, negative zeros, mixed
    value codings, and a push that ends long before the tensor does; odd steps scaled by
    count (count_exponent 0.5: a one-sided sum at sqrt(2) times a shared one's scale)."""
    rng = np.random.default_rng(11)
    numel = 300_000
    cfg, k, r = _kernel_and_reference(name, numel, rng)
    kernel.set_num_threads(threads)  # the autouse fixture resets it
    for step in range(6):
        density = (0.001, 0.01, 0.04)[step % 3]
        a = make_push(rng, numel, density, False, dtypes[0])
        b = make_push(rng, numel // (1 + step % 2), density, False, dtypes[1])  # odd steps: b stops halfway
        shared = rng.choice(a[0], a[0].size // 3, replace=False)  # a third of a's coordinates in b too
        bi = np.union1d(b[0], shared).astype(np.int32)
        bv = make_push(rng, bi.size, 1.0, True, dtypes[1])[1]
        for vals in (a[1], bv):
            _some_negative_zeros(rng, vals)
        pushes = [a, (bi, bv)]
        cs = count_table(2, 0.5, 0.5) if step % 2 else None
        got = k.apply(pushes, 0.5, cfg, count_scale=cs)
        want = r.apply([as_ref_push(p) for p in pushes], 0.5, cfg, count_scale=cs)
        np.testing.assert_array_equal(got, want)
    assert_same_bits(k, r)


@pytest.mark.parametrize("threads", [1, 2])
def test_count_scale_against_a_brute_force_count(threads):
    """The kernel's scale by count (update mode's count_exponent, counted in its merge):
    the parameters after SGD at lr 1 equal a brute-force count's over dense copies,
    ``sum / K * (K / n) ** 0.5``, with float16 and dense pushes among sparse ones, 300
    pushes (coordinate 0 in every push, 1 + i in push i alone), and a later step that
    counts from nothing; a table too short for the pushes is refused."""
    kernel.set_num_threads(threads)  # the autouse fixture resets it
    rng = np.random.default_rng(3)
    numel, K = 100_000, 6
    cfg = OptimizerConfig.from_wire({"name": "sgd", "lr": 1.0})
    k = KernelTensorState(np.zeros(numel, F32), cfg)
    p0 = np.zeros(numel, np.float64)
    for trial in range(4):
        pushes = []
        for i in range(K - (trial % 2)):  # odd trials: a push without this tensor
            if i == 0 and trial >= 2:
                pushes.append((None, rng.standard_normal(numel).astype(F32)))
                continue
            idx = np.sort(rng.choice(numel, size=500 * (1 + i), replace=False)).astype(np.int32)
            pushes.append((idx, rng.standard_normal(idx.size).astype(np.float16 if i % 2 else F32)))
        total, carried = np.zeros(numel, np.float64), np.zeros(numel, np.int64)
        for idx, v in pushes:
            at = np.arange(numel) if idx is None else idx
            total[at] += v.astype(np.float64)
            carried[at] += 1
        touched = k.apply(pushes, 1.0 / K, cfg, count_scale=count_table(K, 0.5, 1.0 / K))
        np.testing.assert_array_equal(touched, np.flatnonzero(carried))
        hit = carried > 0
        p0[hit] -= total[hit] / K * (K / carried[hit]) ** 0.5
        np.testing.assert_allclose(k.state_arrays()["param"], p0, rtol=1e-5, atol=1e-6)
    many = [(np.array([0, 1 + i], np.int32), np.ones(2, F32)) for i in range(300)]
    k = KernelTensorState(np.zeros(400, F32), cfg)
    k.apply(many, 1.0 / 300, cfg, count_scale=count_table(300, 1.0, 1.0 / 300))
    np.testing.assert_allclose(k.state_arrays()["param"][:301], -1.0, rtol=1e-6)
    assert not k.state_arrays()["param"][301:].any()
    assert count_table(1, 0.5, 1.0) is None and count_table(8, 0.0, 0.125) is None
    with pytest.raises(kernel.KernelInputError, match="count_scale"):
        k.apply(many, 1.0 / 300, cfg, count_scale=count_table(299, 1.0, 1.0 / 300))
    np.testing.assert_allclose(k.state_arrays()["param"][:301], -1.0, rtol=1e-6)  # the refused step changed nothing


def test_edge_cases():
    cfg = OptimizerConfig.from_wire({"name": "adamw", "lr": 0.1})
    numel = 100
    init = np.arange(numel, dtype=F32)
    k, r = KernelTensorState(init, cfg), RefTensorState(init, cfg)
    cases = [
        [],  # no pushes at all
        [(np.empty(0, np.int32), np.empty(0, F32))],  # empty push
        [(np.array([0, numel - 1], np.int32), np.array([1, -1], F32))],  # first and last index
        [(np.array([42], np.int32), np.array([v], F32)) for v in (1, 2, 3, 4, 5, 6)],  # one coordinate, all
        [(np.array([3], np.int32), np.array([1], F32)), (None, np.ones(numel, np.float16))],
    ]
    for pushes in cases:
        w = max(len(pushes), 1)
        got = k.apply(pushes, 1.0 / w, cfg)
        want = r.apply([as_ref_push(p) for p in pushes], 1.0 / w, cfg)
        np.testing.assert_array_equal(got, want)
    assert_same_state(k, r)
    assert k.state_arrays()["step"][42] == 2


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_single_coordinate_tensor(name):
    cfg = OptimizerConfig.from_wire({"name": name, "lr": 0.5})
    k, r = KernelTensorState(np.ones(1, F32), cfg), RefTensorState(np.ones(1, F32), cfg)
    for pushes in ([(None, np.array([2.0], F32))], [(np.array([0], np.int32), np.array([1.0], F32))] * 3):
        np.testing.assert_array_equal(k.apply(pushes, 0.5, cfg), r.apply(pushes, 0.5, cfg))
    assert_same_state(k, r)
    assert k.numel == 1


def test_shape_is_flattened_and_init_copied():
    cfg = OptimizerConfig.from_wire({"name": "sgd", "lr": 1.0})
    init = np.arange(12, dtype=F32).reshape(3, 4)
    k = KernelTensorState(init, cfg)
    init[0, 0] = 99
    assert k.numel == 12
    np.testing.assert_array_equal(k.snapshot(), np.arange(12, dtype=F32))


@pytest.mark.parametrize("name", ["sgd", "adamw"])
@pytest.mark.parametrize("dense", [False, True])
def test_threads_give_identical_results(name, dense):
    """Large enough that two threads really split the coordinate range."""
    rng = np.random.default_rng(3)
    sgd = {"momentum": 0.9, "momentum_mode": "lazy"} if name == "sgd" else {}
    cfg = OptimizerConfig.from_wire({"name": name, "lr": 0.01, **sgd})
    numel = 300_000
    init = rng.standard_normal(numel).astype(F32)
    states = {t: KernelTensorState(init, cfg) for t in (1, 2)}
    ref = RefTensorState(init, cfg)
    for _step in range(3):
        pushes = [make_push(rng, numel, 0.2, dense and w == 0, ["f32", "f16", "bf16"][w % 3]) for w in range(3)]
        ref.apply([as_ref_push(p) for p in pushes], 1 / 3, cfg)
        touched = {}
        for t, s in states.items():
            kernel.set_num_threads(t)
            touched[t] = s.apply(pushes, 1 / 3, cfg)
        np.testing.assert_array_equal(touched[1], touched[2])
        idx = touched[1]
        kernel.set_num_threads(2)
        g2 = states[2].gather(idx)
        kernel.set_num_threads(1)
        np.testing.assert_array_equal(states[1].gather(idx), g2)
    a1, a2 = states[1].state_arrays(), states[2].state_arrays()
    for n in a1:
        assert a1[n].tobytes() == a2[n].tobytes(), n
    assert touched[1].shape[0] > 4096  # several tiles per thread
    assert_same_state(states[2], ref)


SPLIT_NUMEL = 2_000_000  # three 5% pushes on this many coordinates: enough work for two or more threads


def _state_on_threads(name: str, threads: int, seed: int) -> tuple[np.random.Generator, OptimizerConfig,
                                                                    KernelTensorState]:
    """A state whose applies of :func:`_three_pushes` two or more threads split (the
    autouse fixture resets the threads)."""
    rng = np.random.default_rng(seed)
    cfg = OptimizerConfig.from_wire({"name": name, "lr": 0.05, "weight_decay": 0.01})
    k = KernelTensorState(rng.standard_normal(SPLIT_NUMEL).astype(F32), cfg)
    kernel.set_num_threads(threads)
    return rng, cfg, k


def _three_pushes(rng: np.random.Generator) -> list:
    return [make_push(rng, SPLIT_NUMEL, 0.05, False, "f16") for _ in range(3)]


@pytest.mark.parametrize("name", ["sgd", "adamw"])
@pytest.mark.parametrize("threads", [1, 2])
def test_last_changes_are_what_the_apply_did_bit_for_bit(name, threads):
    """The change the apply wrote as it went (the broadcast's input) equals the
    parameters after minus before, float32, at its touched indices; a rolled-back or
    mismatched apply has none to give. Each thread's range keeps its changes where it
    wrote them, and the reader follows the ranges."""
    rng, cfg, k = _state_on_threads(name, threads, 11)
    for _step in range(3):
        before = k.state_arrays()["param"].copy()
        touched = k.apply(_three_pushes(rng), 1 / 3, cfg)
        after = k.state_arrays()["param"]
        want = after[touched] - before[touched]
        assert k.last_changes(touched).tobytes() == want.tobytes()
        assert np.count_nonzero(want) > 0.9 * touched.size
    with pytest.raises(kernel.KernelError, match="not the last apply"):
        k.last_changes(touched[:-1])


@pytest.mark.parametrize("name", ["sgd", "adamw"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_rollback_puts_back_every_record_the_apply_changed(name, threads):
    """The undo log, range by range as the threads wrote it: a rollback after a threaded
    apply gives back the state before it, every field bit for bit."""
    rng, cfg, k = _state_on_threads(name, threads, 12)
    k.apply(_three_pushes(rng), 1 / 3, cfg)  # moments not zero
    before = {f: a.copy() for f, a in k.state_arrays().items()}
    touched = k.apply(_three_pushes(rng), 1 / 3, cfg)
    assert not np.array_equal(k.state_arrays()["param"], before["param"])
    k.rollback(touched)
    for f, a in k.state_arrays().items():
        assert a.tobytes() == before[f].tobytes(), f
    with pytest.raises(kernel.KernelError):
        k.last_changes(touched)  # rolled back: nothing to give


def test_env_and_setter_for_threads():
    kernel.set_num_threads(2)
    assert kernel.get_num_threads() == 2
    for bad in (0, -1, 1.5, True, 65):
        with pytest.raises(ValueError):
            kernel.set_num_threads(bad)


@pytest.mark.parametrize(
    "push, why",
    [
        ((np.array([0, 100], np.int32), np.ones(2, F32)), "outside"),
        ((np.array([-1, 3], np.int32), np.ones(2, F32)), "outside"),
        ((np.array([5, 3], np.int32), np.ones(2, F32)), "increasing"),
        ((np.array([3, 3], np.int32), np.ones(2, F32)), "increasing"),
        ((np.array([1, 2], np.int64), np.ones(2, F32)), "int32"),
        ((np.array([1, 2], np.int32), np.ones(2, np.float64)), "float32"),
        ((np.array([1, 2], np.int32), np.ones(3, F32)), "values for"),
        ((np.array([[1, 2]], np.int32), np.ones(2, F32)), "1-D"),
        ((np.arange(0, 8, dtype=np.int32)[::2], np.ones(4, F32)), "contiguous"),
        ((None, np.ones(99, F32)), "values for"),
        ([1, 2], "1-D"),
    ],
)
def test_wrapper_rejects_bad_pushes(push, why):
    cfg = OptimizerConfig.from_wire({"name": "adam"})
    k = KernelTensorState(np.zeros(100, F32), cfg)
    before = k.state_arrays()
    good = (np.array([1, 2], np.int32), np.ones(2, F32))
    with pytest.raises(ValueError, match=why):
        k.apply([good, push], 0.5, cfg)  # the good push must not be applied either
    for n, a in k.state_arrays().items():
        np.testing.assert_array_equal(a, before[n])


def test_wrapper_rejects_other_bad_input():
    cfg = OptimizerConfig.from_wire({"name": "sgd"})
    k = KernelTensorState(np.zeros(10, F32), cfg)
    with pytest.raises(ValueError):
        k.gather(np.array([10], np.int32))
    with pytest.raises(ValueError):
        k.gather(np.array([1], np.int64))
    with pytest.raises(ValueError):
        k.apply([], 1.0, OptimizerConfig.from_wire({"name": "adam"}))
    with pytest.raises(ValueError):
        KernelTensorState(np.zeros(3, np.float64), cfg)
    with pytest.raises(ValueError):
        KernelTensorState(np.zeros(0, F32), cfg)
    with pytest.raises(ValueError):
        k.load_state_arrays({"param": np.zeros(10, F32)})
    with pytest.raises(ValueError):
        k.load_state_arrays({"param": np.zeros(10, F32), "momentum_buf": np.zeros(9, F32)})
    with pytest.raises(ValueError):
        union_indices([np.array([2, 1], np.int32)])


def test_gather_and_snapshot():
    rng = np.random.default_rng(1)
    for name in ("sgd", "adamw"):
        cfg = OptimizerConfig.from_wire({"name": name})
        init = rng.standard_normal(1000).astype(F32)
        k = KernelTensorState(init, cfg)
        idx = rng.integers(0, 1000, 300).astype(np.int32)  # any order, repeats allowed
        np.testing.assert_array_equal(k.gather(idx), init[idx])
        np.testing.assert_array_equal(k.snapshot(), init)
        assert k.gather(np.empty(0, np.int32)).shape == (0,)


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_state_arrays_round_trip(name):
    rng = np.random.default_rng(2)
    sgd = {"momentum": 0.5, "momentum_mode": "lazy"} if name == "sgd" else {}
    cfg = OptimizerConfig.from_wire({"name": name, "lr": 0.1, **sgd})
    init = rng.standard_normal(777).astype(F32)
    a, r = KernelTensorState(init, cfg), RefTensorState(init, cfg)
    for _ in range(5):
        pushes = [make_push(rng, 777, 0.3, False, "f32") for _ in range(2)]
        a.apply(pushes, 0.5, cfg)
        r.apply(pushes, 0.5, cfg)
    saved = a.state_arrays()
    b = KernelTensorState(np.zeros(777, F32), cfg)
    b.load_state_arrays(saved)
    for n, x in b.state_arrays().items():
        assert x.tobytes() == saved[n].tobytes()
    pushes = [make_push(rng, 777, 0.3, False, "f32") for _ in range(2)]
    a.apply(pushes, 0.5, cfg)
    b.apply(pushes, 0.5, cfg)
    r.apply(pushes, 0.5, cfg)
    assert_same_state(b, r)
    assert_same_state(a, r)


@settings(deadline=None, max_examples=100)
@given(st.lists(st.lists(st.integers(0, 2**31 - 2), max_size=60), max_size=40))
def test_union_indices_matches_unique(lists):
    arrays = [np.unique(np.array(x, np.int32)).astype(np.int32) for x in lists]
    got = union_indices(arrays)
    want = np.unique(np.concatenate(arrays)) if arrays else np.empty(0, np.int32)
    np.testing.assert_array_equal(got, want.astype(np.int32))
    assert got.dtype == np.int32


def test_union_indices_large():
    rng = np.random.default_rng(4)
    arrays = [np.sort(rng.choice(10**6, 10**4, replace=False)).astype(np.int32) for _ in range(37)]
    np.testing.assert_array_equal(union_indices(arrays), np.unique(np.concatenate(arrays)))


def test_scatter_add_matches_numpy_bit_for_bit_and_refuses_out_of_range():
    rng = np.random.default_rng(5)
    dst = rng.standard_normal(100_000).astype(np.float32)
    idx = np.sort(rng.choice(dst.size, 3_000, replace=False)).astype(np.int32)
    src = rng.standard_normal(idx.size).astype(np.float32)
    want = dst.copy()
    want[idx] += src
    kernel.scatter_add(dst, idx, src)
    assert dst.tobytes() == want.tobytes()
    before = dst.copy()
    with pytest.raises(kernel.KernelInputError, match="out of range"):
        kernel.scatter_add(dst, np.array([0, dst.size], np.int32), np.ones(2, np.float32))
    with pytest.raises(kernel.KernelInputError):
        kernel.scatter_add(dst, np.array([-1], np.int32), np.ones(1, np.float32))
    assert dst.tobytes() == before.tobytes()  # nothing changed


@pytest.mark.parametrize("numel", [1, 4095, 4096, 4097, 100_003])
def test_scatter_add_lists_adds_list_after_list_bit_for_bit_and_refuses_bad_lists_whole(numel):
    rng = np.random.default_rng(numel)
    dst = rng.standard_normal(numel).astype(np.float32)
    # overlapping lists of values far apart in size: float32 sums that depend on the order of the adds
    lists = []
    for m in range(9):
        idx = np.sort(rng.choice(numel, rng.integers(0, numel + 1) if m % 4 else numel, replace=False))
        lists.append((idx.astype(np.int32), (rng.standard_normal(idx.size) * 10.0 ** rng.integers(-6, 7)).astype(
            np.float32)))
    lists.insert(3, (np.zeros(0, np.int32), np.zeros(0, np.float32)))
    want = dst.copy()
    for idx, v in lists:  # one at a time, in order
        want[idx] += v
    got = dst.copy()
    kernel.scatter_add_lists(got, lists)
    assert got.tobytes() == want.tobytes()
    unordered = lists[0][0][::-1].copy()
    for bad, match in [((np.array([numel], np.int32), np.ones(1, np.float32)), "out of range"),
                       ((np.array([-1], np.int32), np.ones(1, np.float32)), "out of range"),
                       ((np.array([0, 0], np.int32), np.ones(2, np.float32)), "order"),
                       ((unordered, np.ones(unordered.size, np.float32)), "order" if unordered.size > 1 else None)]:
        if match is None:
            continue
        before = got.copy()
        with pytest.raises(kernel.KernelInputError):
            kernel.scatter_add_lists(got, [*lists, bad])  # the bad list last: the good ones before it not added
        assert got.tobytes() == before.tobytes()
    with pytest.raises(kernel.KernelInputError, match="indices for"):
        kernel.scatter_add_lists(got, [(np.zeros(2, np.int32), np.zeros(3, np.float32))])
    kernel.scatter_add_lists(got, [])  # nothing to add
    assert got.tobytes() == want.tobytes()


@pytest.fixture(scope="module")
def native_bench():
    """bench/_native_bench.py, its build loaded (compiled on first use into build/: one
    module fixture, so that parallel test workers do not compile it side by side)."""
    from bench import _native_bench

    _native_bench.state_class()
    return _native_bench


@pytest.mark.parametrize("tuning", [(0, 16, 0), (3, 16, 1), (8, 64, 2), "default", (24, 4096, 3)])
@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_tiles_and_prefetch_do_not_change_results(native_bench, name, tuning):
    """Unions far larger than a tile: the merge stops and resumes mid-window.

    Runs on the bench-only build (bench/_native_bench.py: the same kernel sources with
    the tuning as knobs); production builds compile the default tuning."""
    TunableState = native_bench.state_class()
    default = native_bench.default_tuning()
    if tuning == "default":
        tuning = default
    rng = np.random.default_rng(5)
    hp = {"momentum": 0.9, "momentum_mode": "lazy"} if name == "sgd" else {"weight_decay": 0.1}
    cfg = OptimizerConfig.from_wire({"name": name, "lr": 0.01, **hp})
    numel = 20_000
    init = rng.standard_normal(numel).astype(F32)
    k, r = TunableState(init, cfg), RefTensorState(init, cfg)
    native_bench.set_tuning(*tuning)
    try:
        for step in range(6):
            pushes = [make_push(rng, numel, [0.01, 0.3, 0.9][w % 3], step == 2 and w == 0, ["f32", "bf16"][w % 2])
                      for w in range(4)]
            np.testing.assert_array_equal(k.apply(pushes, 0.25, cfg),
                                          r.apply([as_ref_push(p) for p in pushes], 0.25, cfg))
            for threads in (2, 1):  # gather through both paths
                kernel.set_num_threads(threads)
                idx = rng.integers(0, numel, 5000).astype(np.int32)
                np.testing.assert_array_equal(k.gather(idx), r.param[idx])
    finally:
        native_bench.set_tuning(*default)
    for n, a in k.state_arrays().items():
        assert a.tobytes() == getattr(r, n).tobytes(), n
