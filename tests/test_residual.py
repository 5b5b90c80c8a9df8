"""The flat residual and its selection index (native/residual.c behind
stella_ps.residual.FlatResidual) against a NumPy reference: R bit for bit, the exact top
k with ties to the lower index, the groups' quotas, the dense suffix, load, bad input,
and no full pass in a steady run."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from stella_ps.errors import KernelInputError
from stella_ps.residual import FlatResidual

F32 = np.float32
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=60)


class Reference:
    """What a FlatResidual must do, in NumPy."""

    def __init__(self, numel: int, sparse_numel: int, bounds: np.ndarray):
        self.r = np.zeros(numel, F32)
        self.sparse_numel = sparse_numel
        self.bounds = bounds

    def add(self, idx: np.ndarray, vals: np.ndarray) -> None:
        self.r[idx] += vals  # unique indices: one float32 addition each

    def select(self, ks: list[int]) -> tuple[np.ndarray, np.ndarray]:
        picked = []
        for g, k in enumerate(ks):
            lo, hi = int(self.bounds[g]), int(self.bounds[g + 1])
            a = np.abs(self.r[lo:hi])
            nz = np.flatnonzero(a)
            order = nz[np.lexsort((nz, -a[nz]))][:k]  # larger |R| first, then the lower index
            picked.append(np.sort(order) + lo)
        idx = np.concatenate(picked).astype(np.int32) if picked else np.zeros(0, np.int32)
        vals = self.r[idx].copy()
        self.r[idx] = 0.0
        return idx, vals


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def draw_bounds(rng: np.random.Generator, sparse_numel: int, groups: int) -> np.ndarray:
    if sparse_numel == 0:
        return np.array([0], np.int64)
    groups = min(groups, sparse_numel)
    cuts = np.sort(rng.choice(np.arange(1, sparse_numel), groups - 1, replace=False)) if groups > 1 else []
    return np.array([0, *cuts, sparse_numel], np.int64)


def draw_values(rng: np.random.Generator, n: int, kind: str, scale: float) -> np.ndarray:
    if kind == "normal":
        return (rng.standard_normal(n) * scale).astype(F32)
    if kind == "dyadic":  # few distinct magnitudes: many ties, exact sums
        return (rng.integers(-8, 9, n) * F32(0.25) * F32(scale)).astype(F32)
    # a wide spread of magnitudes: every bucket, denormals too
    return (rng.standard_normal(n) * np.exp2(rng.integers(-140, 40, n))).astype(F32)


def draw_add(rng: np.random.Generator, numel: int, kind: str, scale: float) -> tuple[np.ndarray, np.ndarray]:
    density = rng.choice([0.01, 0.1, 0.5, 1.0])
    idx = np.flatnonzero(rng.random(numel) < density).astype(np.int32)
    return idx, draw_values(rng, idx.size, kind, scale)


def check_select(res: FlatResidual, ref: Reference, ks: list[int]) -> None:
    got = res.select(ks if res.groups != 1 else ks[0])
    want = ref.select(ks)
    assert np.array_equal(got[0], want[0])
    assert same_bits(got[1], want[1])
    assert got[0].dtype == np.int32 and got[1].dtype == F32


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), numel=st.integers(1, 3000), dense=st.integers(0, 300),
       groups=st.sampled_from([None, 1, 2, 7]), kind=st.sampled_from(["normal", "dyadic", "wide"]),
       steps=st.integers(1, 40))
def test_matches_the_reference_step_after_step(seed, numel, dense, groups, kind, steps):
    rng = np.random.default_rng(seed)
    sparse_numel = max(0, numel - dense)
    bounds = draw_bounds(rng, sparse_numel, groups or 1)
    res = FlatResidual(numel, sparse_numel, None if groups is None else bounds)
    ref = Reference(numel, sparse_numel, bounds)
    sizes = np.diff(bounds)
    scale = 1.0
    for _ in range(steps):
        scale *= float(np.exp2(rng.integers(-3, 2)))
        idx, vals = draw_add(rng, numel, kind, scale)
        res.add(idx, vals)
        ref.add(idx, vals)
        assert same_bits(res.residual, ref.r)
        if rng.random() < 0.8 and sizes.size:
            ks = [int(rng.integers(0, s + 1)) if rng.random() < 0.2 else int(rng.integers(0, max(1, s // 10) + 1))
                  for s in sizes]
            check_select(res, ref, ks)
        if rng.random() < 0.1:
            assert same_bits(res.take_dense(), ref.r[sparse_numel:].copy())
            ref.r[sparse_numel:] = 0.0
        assert same_bits(res.residual, ref.r)
        res.verify()


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), numel=st.integers(16, 2000), steps=st.integers(1, 30))
@example(seed=588, numel=523, steps=26)
def test_what_was_sent_and_what_is_held_is_everything_added(seed, numel, steps):
    rng = np.random.default_rng(seed)
    res = FlatResidual(numel, numel)
    added = np.zeros(numel, np.float64)
    sent = np.zeros(numel, np.float64)
    for _ in range(steps):
        idx, vals = draw_add(rng, numel, "dyadic", 1.0)  # quarters: every float32 sum here is exact
        res.add(idx, vals)
        added[idx] += vals
        out, v = res.select(int(rng.integers(0, numel // 4 + 1)))
        sent[out] += v
        # the coding's error goes back where it was sent (here: about a quarter of the value, rounded to
        # quarters, so that every value stays on the quarter grid and every float32 sum stays exact: a quarter
        # of a quarter, and so on, grows the values' bits until a sum rounds, as seed 588 found)
        back = (np.round(v * F32(0.25) * 4) / 4).astype(F32)
        res.add(out, back)
        sent[out] -= back
    assert np.array_equal(sent + res.residual.astype(np.float64), added)
    res.verify()


def test_each_group_gets_its_quota_from_its_own_range():
    rng = np.random.default_rng(3)
    bounds = np.array([0, 100, 1000, 1010, 5000])
    res = FlatResidual(6000, 5000, bounds)
    ref = Reference(6000, 5000, bounds)
    for step in range(30):
        idx = np.flatnonzero(rng.random(6000) < 0.2).astype(np.int32)
        # group 1's values are 1000x the others': a global top-k would take only from it
        vals = (rng.standard_normal(idx.size) * np.where((idx >= 100) & (idx < 1000), 1000, 1)).astype(F32)
        res.add(idx, vals)
        ref.add(idx, vals)
        ks = [5, 50, 10, 0] if step % 2 else [100, 0, 3, 400]
        got, _ = res.select(ks)
        counts = np.diff(np.searchsorted(got, bounds))
        assert list(counts) == [min(k, int(np.count_nonzero(ref.r[a:b]))) for k, a, b in
                                zip(ks, bounds[:-1], bounds[1:])]
        want, _ = ref.select(ks)
        assert np.array_equal(got, want)
    res.verify()


def test_the_dense_suffix_is_never_selected_and_goes_whole():
    res = FlatResidual(1000, 900)
    idx = np.arange(1000, dtype=np.int32)
    vals = np.where(idx >= 900, 1e6, 1.0).astype(F32)  # the suffix holds the largest values
    res.add(idx, vals)
    got, v = res.select(900)
    assert np.array_equal(got, np.arange(900)) and np.all(v == 1.0)
    assert np.all(res.residual[900:] == 1e6)
    got, _ = res.select(900)
    assert got.size == 0  # only zeros left in the sparse range
    dense = res.take_dense()
    assert dense.dtype == F32 and np.all(dense == 1e6) and dense.size == 100
    assert not res.residual.any()
    assert res.take_dense().size == 100 and not res.take_dense().any()


def test_ties_go_to_the_lower_index_whatever_the_sign():
    res = FlatResidual(64, 64)
    idx = np.arange(64, dtype=np.int32)
    vals = np.where(idx % 2, -1.0, 1.0).astype(F32)
    vals[[5, 40]] = 2.0
    res.add(idx, vals)
    got, v = res.select(10)
    assert list(got) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 40]
    assert list(v) == [1, -1, 1, -1, 1, 2, 1, -1, 1, 2]


def test_fewer_nonzeros_than_k_gives_them_all():
    res = FlatResidual(100, 100)
    res.add(np.array([3, 50, 99], np.int32), np.array([1, -2, 3], F32))
    got, v = res.select(100)
    assert list(got) == [3, 50, 99] and list(v) == [1, -2, 3]
    assert res.select(100)[0].size == 0
    assert res.full_passes == 0


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), cut=st.integers(0, 20), groups=st.sampled_from([None, 3]))
def test_load_then_continuing_equals_continuing_without_it(seed, cut, groups):
    numel, sparse_numel = 1500, 1400
    bounds = None if groups is None else [0, 400, 401, 1400]
    rng = np.random.default_rng(seed)
    calls = []
    for _ in range(25):
        idx, vals = draw_add(rng, numel, "normal", float(np.exp2(rng.integers(-4, 4))))
        ks = [int(rng.integers(0, 60))] if groups is None else [int(rng.integers(0, 30)), 1, int(rng.integers(0, 60))]
        calls.append((idx, vals, ks))

    def run(res: FlatResidual, part: list) -> list:
        out = []
        for idx, vals, ks in part:
            res.add(idx, vals)
            out.append(res.select(ks if groups else ks[0]))
        return out

    straight = FlatResidual(numel, sparse_numel, bounds)
    first = run(straight, calls[:cut])
    rest = run(straight, calls[cut:])
    resumed = FlatResidual(numel, sparse_numel, bounds)
    assert [same_bits(a[1], b[1]) for a, b in zip(run(resumed, calls[:cut]), first)] == [True] * cut
    saved = resumed.residual.copy()
    loaded = FlatResidual(numel, sparse_numel, bounds)
    loaded.add(np.array([7], np.int32), np.array([123.0], F32))  # whatever it held before is replaced
    loaded.load(saved)
    assert same_bits(loaded.residual, saved)
    again = run(loaded, calls[cut:])
    for (i1, v1), (i2, v2) in zip(rest, again):
        assert np.array_equal(i1, i2) and same_bits(v1, v2)
    assert same_bits(loaded.residual, straight.residual)
    loaded.verify()


def test_bad_input_is_refused_and_changes_nothing():
    res = FlatResidual(100, 90, [0, 40, 90])
    res.add(np.arange(0, 100, 3, dtype=np.int32), np.linspace(-1, 1, 34, dtype=F32))
    before = res.residual.copy()
    i = np.array([1, 2, 3], np.int32)
    v = np.ones(3, F32)
    bad_adds = [
        (np.array([3, 2, 5], np.int32), v),  # unsorted
        (np.array([2, 2, 5], np.int32), v),  # duplicate
        (np.array([1, 2, 100], np.int32), v),  # out of range
        (np.array([-1, 2, 5], np.int32), v),  # negative
        (i.astype(np.int64), v),  # wrong dtypes
        (i, v.astype(np.float64)),
        (i, v.astype(np.float16)),
        (i, np.ones(4, F32)),  # length
        (np.arange(6, dtype=np.int32)[::2], v),  # not contiguous
        (i, np.array([1, np.nan, 1], F32)),  # not finite
        (i, np.array([1, 1, np.inf], F32)),
        (i.reshape(3, 1), v),
        ([1, 2, 3], v),
    ]
    for idx, vals in bad_adds:
        with pytest.raises(KernelInputError):
            res.add(idx, vals)  # type: ignore[arg-type]
        assert same_bits(res.residual, before)
    for k in ([-1, 3], [41, 3], [3, 51], [3], [1, 2, 3], 5, [1.5, 2], True, "3"):
        with pytest.raises(KernelInputError):
            res.select(k)  # type: ignore[arg-type]
        assert same_bits(res.residual, before)
    for r in (np.zeros(99, F32), np.zeros(100, np.float64), np.full(100, np.nan, F32)):
        with pytest.raises(KernelInputError):
            res.load(r)
        assert same_bits(res.residual, before)
    with pytest.raises(ValueError):  # read only: changes go through the methods
        res.residual[0] = 1.0
    res.verify()
    got, _ = res.select([40, 50])  # and it still works
    assert got.size == int(np.count_nonzero(before[:90]))


@pytest.mark.parametrize("args", [(-1, 0), (10, 11), (10, 5, [0, 5, 5]), (10, 5, [0, 6]), (10, 5, [1, 5]),
                                  (10, 0, [0, 3]), (10, 5, [[0, 5]]), (2**31, 0), (10.0, 5)])
def test_bad_shapes_are_refused(args):
    with pytest.raises(KernelInputError):
        FlatResidual(*args)


def test_no_sparse_range():
    res = FlatResidual(10, 0)
    assert res.groups == 0
    res.add(np.arange(10, dtype=np.int32), np.ones(10, F32))
    assert res.select(0)[0].size == 0 and res.select([])[0].size == 0
    assert np.all(res.take_dense() == 1)


@pytest.mark.parametrize("touched, k", [(0.02, 0.02), (0.08, 0.005), (0.32, 0.005)])
def test_a_steady_run_makes_no_full_pass(touched, k):
    """The benchmark's distribution (bench.residual): random touched sets with normal
    changes, a fixed k; after warm-up the index never passes over R."""
    numel = 100_000
    rng = np.random.default_rng(11)
    res = FlatResidual(numel, numel)
    kk = int(k * numel)
    for step in range(300):
        idx = np.flatnonzero(rng.random(numel) < touched).astype(np.int32)
        res.add(idx, rng.standard_normal(idx.size).astype(F32))
        got, _ = res.select(kk)
        assert got.size == min(kk, int(np.count_nonzero(res.residual)) + got.size)
        if step == 20:
            warm = res.full_passes
    assert res.full_passes == warm == 0
    res.verify()
    assert res.tracked <= int(np.count_nonzero(res.residual))
    assert res.bytes >= res.residual.nbytes


def test_a_coordinate_listed_twice_in_its_bucket_counts_once():
    """A coordinate that leaves a bucket and comes back is listed there twice: the
    boundary's selection and a list's compaction both see it once."""
    res = FlatResidual(200, 200)
    ref = Reference(200, 200, np.array([0, 200]))

    def add(idx, vals):
        idx, vals = np.array(idx, np.int32), np.array(vals, F32)
        res.add(idx, vals)
        ref.add(idx, vals)

    add(range(10), [1.0] * 10)
    for _ in range(100):  # 3 goes to 2.0 and back to 1.0: a hundred entries of it in 1.0's list
        add([3], [1.0])
        add([3], [-1.0])
    add([7], [1.0])  # 7 leaves 1.0's bucket: the list is compacted, 3 kept once
    res.verify()
    check_select(res, ref, [5])  # the boundary is 1.0's bucket: 7, then 0, 1, 2, 3
    add([3], [0.5])
    for _ in range(10):
        add([3], [-0.5])
        add([3], [0.5])
    check_select(res, ref, [3])
    check_select(res, ref, [200])
    res.verify()
    assert not res.residual.any()


def test_a_decaying_residual_refills_by_full_passes_and_stays_exact():
    """Changes that shrink faster than the floor's margin leave fewer than k tracked:
    the index refills by a pass over R, and every selection is still the exact top k."""
    numel = 20_000
    rng = np.random.default_rng(5)
    res = FlatResidual(numel, numel, [0, 5000, numel])
    ref = Reference(numel, numel, np.array([0, 5000, numel]))
    for step in range(60):
        idx = np.flatnonzero(rng.random(numel) < 0.1).astype(np.int32)
        vals = (rng.standard_normal(idx.size) * 0.5 ** step).astype(F32)
        res.add(idx, vals)
        ref.add(idx, vals)
        check_select(res, ref, [50, 200])
    assert res.full_passes > 0
    assert same_bits(res.residual, ref.r)
    res.verify()


def test_the_benchmark_runs_both_systems_on_the_same_steps():
    from bench.residual import run

    rows = run(50_000, 0.05, (0.01, 0.002), steps=3) + run(50_000, 0.05, (0.01,), steps=3, error=0.1)
    assert [r["k"] for r in rows] == [500, 100, 500]
    for r in rows:
        assert r["index_step_ms"] > 0 and r["pass_step_ms"] > 0 and r["index_full_passes"] == 0
        assert r["index_bytes_per_coord"] >= 4


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), lists=st.integers(0, 4), numel=st.integers(1, 2000))
def test_adding_lists_in_one_sweep_equals_one_add_each(seed, lists, numel):
    rng = np.random.default_rng(seed)
    sparse_numel = int(rng.integers(0, numel + 1))
    one, each = FlatResidual(numel, sparse_numel), FlatResidual(numel, sparse_numel)
    for _ in range(5):
        adds = [draw_add(rng, numel, str(rng.choice(["normal", "dyadic", "wide"])), 1.0) for _ in range(lists)]
        one.add_lists(adds)
        for idx, vals in adds:
            each.add(idx, vals)
        assert same_bits(one.residual, each.residual)
        if sparse_numel:
            k = int(rng.integers(0, sparse_numel + 1))
            a, b = one.select(k), each.select(k)
            assert np.array_equal(a[0], b[0]) and same_bits(a[1], b[1])
        one.verify()


def test_bad_lists_are_refused_before_anything_changes():
    res = FlatResidual(100, 80)
    good = (np.array([1, 50, 90], np.int32), np.ones(3, F32))
    for bad in [(np.array([5, 4], np.int32), np.ones(2, F32)), (np.array([100], np.int32), np.ones(1, F32)),
                (np.array([3], np.int32), np.array([np.inf], F32)), (np.array([3], np.int64), np.ones(1, F32)),
                "not a pair"]:
        with pytest.raises(KernelInputError, match="list 1"):
            res.add_lists([good, bad])  # type: ignore[list-item]
        assert not res.residual.any()
    with pytest.raises(KernelInputError):
        res.add_lists([good] * 5)
    res.add_lists([])
    assert not res.residual.any()
