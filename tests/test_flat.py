"""The flat model on the worker (stella.flat): FlatParams' operations against per-tensor
torch ops, bit for bit, on every backend (the C table walk, and the torch ops that CUDA
runs, here on CPU and on a GPU when there is one); FlatCompressor's error feedback, counts
and codings, and its agreement with the per-tensor compressor it shares an engine with."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from stella import codec
from stella.compress import BLOCK, ErrorFeedbackCompressor
from stella.flat import FlatCompressor, FlatParams, FlatPush
from stella.layout import FlatLayout
from stella.protocol import TensorSpec

CUDA = torch.cuda.is_available()
no_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device here (torch.cuda.is_available() is False)")
# (backend, device): the C walk, the torch ops on CPU, and the torch ops on a GPU
BACKENDS = [("native", "cpu"), ("torch", "cpu"), pytest.param("torch", "cuda", marks=no_cuda)]
# FlatParams' also "torch-scatter": the torch ops with no staging of a dtype group (stage_max_numel 0: what a
# model past STAGE_MAX_NUMEL gets, an index_add_ a parameter)
PARAM_BACKENDS = [*BACKENDS, ("torch-scatter", "cpu"), pytest.param("torch-scatter", "cuda", marks=no_cuda)]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DENSE_BELOW = 1000

# a model's mix: large and small tensors interleaved, every dtype, an empty one, odd sizes
SHAPES = [(40, 50), (300,), (7, 300), (0,), (3, 3), (129, 17), (1000,), (64,), (33, 33)]


def _model(seed: int = 0, dtypes=DTYPES, device: str = "cpu", shapes=SHAPES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * 10.0 ** (i % 3 - 1)).to(device, dtypes[i % len(dtypes)])
            for i, s in enumerate(shapes)]


def _flat_params(params, layout: FlatLayout, backend: str) -> FlatParams:
    flat = FlatParams(params, layout, backend="torch" if backend == "torch-scatter" else backend)
    if backend == "torch-scatter":
        flat.stage_max_numel = 0
    return flat


def _layout(params, dense_below: int = DENSE_BELOW) -> FlatLayout:
    return FlatLayout.of([TensorSpec(f"t{i}", tuple(p.shape), "float32") for i, p in enumerate(params)], dense_below)


def _flat_ref(layout: FlatLayout, tensors) -> torch.Tensor:
    """The flat float32 vector of per-tensor values, by the layout (the reference)."""
    return torch.from_numpy(layout.gather([t.detach().float().cpu().numpy() for t in tensors]))


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits, every NaN taken as one (values beyond f16's range make infinities, and
    inf + -inf's NaN has the sign the hardware's path gives it: x86's default NaN in one
    backend, another order of operands in the other, seed 2686)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    view = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[a.dtype]
    a, b = a.cpu(), b.cpu()
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    return torch.equal(a.view(view)[~nan_a], b.view(view)[~nan_b])


def _assert_same_params(got, ref):
    for t, (a, b) in enumerate(zip(got, ref)):
        assert _bits_equal(a, b), f"tensor {t} ({a.dtype})"


def _sorted_indices(rng, n: int, count: int) -> np.ndarray:
    return np.sort(rng.choice(n, size=min(count, n), replace=False)).astype(np.int32)


def _values(rng, n: int) -> np.ndarray:
    """Values whose rounding to f16/bf16 matters: magnitudes over many decades, some beyond f16's range."""
    v = rng.standard_normal(n) * 10.0 ** rng.integers(-8, 6, n)
    return v.astype(np.float32)


def _per_tensor(layout, params, pos, fn):
    """``fn(flat view of tensor t, local indices, positions in pos, t's first flat
    coordinate)`` for each tensor the flat positions ``pos`` touch."""
    for t, a, b in layout.spans():
        sel = np.nonzero((pos >= a) & (pos < b))[0]
        if sel.size:
            fn(params[t].view(-1), torch.from_numpy(pos[sel] - a), torch.from_numpy(sel), a)


# ------------------------------------------------------------------------------ FlatParams


@pytest.mark.parametrize("backend,device", PARAM_BACKENDS)
def test_gather_and_residual_over_any_range(backend, device):
    params = _model(1, device=device)
    layout = _layout(params)
    flat = _flat_params(params, layout, backend)
    ref = _flat_ref(layout, params).to(device)
    out = torch.full((layout.numel,), float("nan"), device=device)
    flat.gather_into(out)
    assert _bits_equal(out, ref)
    anchor = torch.randn(layout.numel, generator=torch.Generator().manual_seed(2)).to(device)
    flat.residual_into(anchor, out)
    assert _bits_equal(out, anchor - ref)
    a2 = anchor.clone()
    flat.residual_into(a2, a2)  # out may be the anchor
    assert _bits_equal(a2, anchor - ref)
    rng = np.random.default_rng(3)
    for lo, n in [(0, 0), (layout.sparse_numel, layout.numel - layout.sparse_numel), (1, 1),
                  *((int(x), int(y)) for x, y in zip(rng.integers(0, layout.numel, 8), rng.integers(0, 3000, 8)))]:
        n = min(n, layout.numel - lo)
        part = torch.empty(n, device=device)
        flat.gather_into(part, lo)
        assert _bits_equal(part, ref[lo:lo + n]), (lo, n)
        flat.residual_into(anchor[lo:lo + n].contiguous(), part, lo)
        assert _bits_equal(part, anchor[lo:lo + n] - ref[lo:lo + n]), (lo, n)


@pytest.mark.parametrize("backend,device", PARAM_BACKENDS)
def test_gather_grads_missing_ones_are_zeros(backend, device):
    params = _model(4, device=device)
    layout = _layout(params)
    for i, p in enumerate(params):
        p.grad = None if i % 3 == 1 else torch.randn(p.shape, device=device).to(p.dtype)
    params[2].grad = torch.randn(300, 7, device=device).to(params[2].dtype).t()  # not contiguous
    flat = _flat_params(params, layout, backend)
    out = torch.full((layout.numel,), float("nan"), device=device)
    flat.gather_grads_into(out)
    ref = _flat_ref(layout, [p.grad if p.grad is not None else torch.zeros(p.shape) for p in params])
    assert _bits_equal(out, ref.to(device))
    params[0].grad = None  # the next step's: the table follows
    params[1].grad = torch.ones(params[1].shape, device=device, dtype=params[1].dtype)
    flat.gather_grads_into(out)
    ref = _flat_ref(layout, [p.grad if p.grad is not None else torch.zeros(p.shape) for p in params])
    assert _bits_equal(out, ref.to(device))


@pytest.mark.parametrize("backend,device", PARAM_BACKENDS)
@pytest.mark.parametrize("op", ("add", "set"))
def test_sparse_install_matches_index_add(backend, device, op):
    """add_at is w.index_add_(0, idx, vals.to(w.dtype)) per tensor, set_at index_copy_: bit for bit."""
    params = _model(5, device=device)
    layout = _layout(params)
    ref = [p.clone() for p in params]
    flat = _flat_params(params, layout, backend)
    rng = np.random.default_rng(6)
    for step, (start, density) in enumerate([(0, 0.05), (0, 0.5), (700, 0.1), (0, 1.0)]):
        n = layout.numel - start
        idx = _sorted_indices(rng, n, int(density * n))
        vals = _values(rng, idx.size)
        if step == 1:  # frames from the wire are read-only buffers
            vals = np.frombuffer(vals.tobytes(), np.float32)
        (flat.add_at if op == "add" else flat.set_at)(idx, vals, start)

        def per(w, at, sel, lo, vals=vals):
            v = torch.from_numpy(vals.copy())[sel].to(w.device, w.dtype)
            (w.index_add_ if op == "add" else w.index_copy_)(0, at.to(w.device), v)

        _per_tensor(layout, ref, idx.astype(np.int64) + start, per)
        _assert_same_params(params, ref)


@pytest.mark.parametrize("backend,device", PARAM_BACKENDS)
@pytest.mark.parametrize("op", ("add", "set"))
def test_dense_range_matches_add_and_copy(backend, device, op):
    params = _model(7, device=device)
    layout = _layout(params)
    ref = [p.clone() for p in params]
    flat = _flat_params(params, layout, backend)
    rng = np.random.default_rng(8)
    for lo, hi in [(layout.sparse_numel, layout.numel), (0, layout.numel), (13, 5000), (2999, 3001)]:
        vals = _values(rng, hi - lo)
        src = vals if lo % 2 else torch.from_numpy(vals).to(device)  # host arrays or device tensors
        (flat.add_range if op == "add" else flat.set_range)(src, lo)
        for t, a, b in layout.spans():
            x, y = max(a, lo), min(b, hi)
            if x < y:
                w = ref[t].view(-1)[x - a:y - a]
                v = torch.from_numpy(vals[x - lo:y - lo]).to(device, w.dtype)
                w.add_(v) if op == "add" else w.copy_(v)
        _assert_same_params(params, ref)


@pytest.mark.parametrize("backend,device", PARAM_BACKENDS)
@pytest.mark.parametrize("add", (True, False), ids=("broadcast", "exact"))
def test_merge_is_the_update_modes_install(backend, device, add):
    """merge_at / merge_range are _exchange.py's install, per tensor, bit for bit: the
    anchor takes the server's values (added, or in their place) and the weights move by the
    anchor's change."""
    params = _model(12, device=device)
    layout = _layout(params)
    ref = [p.clone() for p in params]
    flat = _flat_params(params, layout, backend)
    g = torch.Generator().manual_seed(13)
    anchor = (_flat_ref(layout, params) + torch.randn(layout.numel, generator=g) * 1e-2).to(device)
    ref_anchor = anchor.clone()
    rng = np.random.default_rng(14)
    for start, density in [(0, 0.05), (500, 0.3)]:
        n = layout.numel - start
        idx = _sorted_indices(rng, n, int(density * n))
        vals = _values(rng, idx.size)
        flat.merge_at(idx, vals, anchor[start:], add=add, start=start)

        def per(w, at, sel, lo, vals=vals):
            a = ref_anchor
            at_a = (at + lo).to(a.device)
            at = at.to(w.device)
            new = torch.from_numpy(vals.copy())[sel].to(a.device)
            if add:  # _exchange.py's install of a broadcast step
                before = a.index_select(0, at_a)
                a.index_add_(0, at_a, new)
                w.index_add_(0, at, (a.index_select(0, at_a) - before).to(w.dtype))
            else:  # and of exact values
                w.index_add_(0, at, (new - a.index_select(0, at_a)).to(w.dtype))
                a.index_copy_(0, at_a, new)

        _per_tensor(layout, ref, idx.astype(np.int64) + start, per)
        _assert_same_params(params, ref)
        assert _bits_equal(anchor, ref_anchor)
    s = layout.sparse_numel
    dense = _values(rng, layout.numel - s)
    flat.merge_range(dense, anchor[s:], s, add=add)
    for t, lo, hi in layout.spans():
        if lo >= s:
            a, w = ref_anchor[lo:hi], ref[t].view(-1)
            new = torch.from_numpy(dense[lo - s:hi - s]).to(device)
            if add:
                before = a.clone()
                a.add_(new)
                w.add_((a - before).to(w.dtype))
            else:
                w.add_((new - a).to(w.dtype))
                a.copy_(new)
    _assert_same_params(params, ref)
    assert _bits_equal(anchor, ref_anchor)
    with pytest.raises(ValueError):  # beyond the anchor
        flat.merge_at(np.array([0, 10], np.int32), np.ones(2, np.float32), anchor[:10].clone())


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=12), seed=st.integers(0, 2**16),
       dense_below=st.integers(0, 200), density=st.floats(0.0, 1.0))
@example(sizes=[20, 22, 22, 23, 23, 23, 128, 300, 300, 300], seed=2686, dense_below=23, density=0.8932448113096556)
def test_native_and_torch_backends_agree(sizes, seed, dense_below, density):
    """Any layout: the C walk and the torch ops leave the same bits (gather, add_at, add_range)."""
    shapes = [(n,) for n in sizes]
    a = _model(seed, device="cpu", shapes=shapes)
    b = [p.clone() for p in a]
    layout = _layout(a, dense_below)
    fa, fb = FlatParams(a, layout, backend="native"), FlatParams(b, layout, backend="torch")
    fc = _flat_params(c := [p.clone() for p in a], layout, "torch-scatter")
    rng = np.random.default_rng(seed)
    idx = _sorted_indices(rng, layout.numel, int(density * layout.numel))
    vals = _values(rng, idx.size)
    fa.add_at(idx, vals)
    fb.add_at(idx, vals)
    fc.add_at(idx, vals)
    dense = _values(rng, layout.numel - layout.sparse_numel)
    fa.add_range(dense, layout.sparse_numel)
    fb.add_range(dense, layout.sparse_numel)
    fc.add_range(dense, layout.sparse_numel)
    _assert_same_params(a, b)
    _assert_same_params(a, c)
    oa, ob = torch.empty(layout.numel), torch.empty(layout.numel)
    fa.gather_into(oa)
    fb.gather_into(ob)
    assert _bits_equal(oa, ob)


@pytest.mark.parametrize("backend", ("native", "torch", "torch-scatter"))
def test_bad_indices_are_refused_and_change_nothing(backend):
    params = _model(9)
    layout = _layout(params)
    flat = _flat_params(params, layout, backend)
    before = [p.clone() for p in params]
    v = np.ones(3, np.float32)
    for idx, start in [([5, 3, 9], 0), ([1, 1, 2], 0), ([0, 1, layout.numel], 0), ([-1, 0, 1], 0),
                       ([0, 1, layout.numel - 10], 11)]:
        with pytest.raises(ValueError):
            flat.add_at(np.array(idx, np.int32), v, start)
    with pytest.raises(ValueError):
        flat.add_at(np.array([1, 2, 3], np.int64), v)
    with pytest.raises(ValueError):
        flat.set_at(np.array([1, 2], np.int32), v)
    with pytest.raises(ValueError):
        flat.gather_into(torch.empty(10), layout.numel - 5)
    with pytest.raises(ValueError):
        flat.gather_into(torch.empty(10, dtype=torch.float64))
    with pytest.raises(ValueError):
        flat.add_range(np.ones(10, np.float32), layout.numel - 5)
    _assert_same_params(params, before)


def test_parameters_are_checked_and_followed():
    params = _model(10)
    layout = _layout(params)
    with pytest.raises(ValueError, match="dtype"):
        FlatParams([params[0].double(), *params[1:]], layout)
    with pytest.raises(ValueError, match="contiguous"):
        FlatParams([torch.randn(50, 40).t(), *params[1:]], layout)
    with pytest.raises(ValueError, match="elements, the layout has"):
        FlatParams([torch.randn(40, 49), *params[1:]], layout)
    with pytest.raises(ValueError, match="parameters for a layout"):
        FlatParams(params[:-1], layout)
    with pytest.raises(ValueError, match="native"):
        FlatParams(params, layout, backend="cuda")
    # by name; the user's tensors are the ones written (no copy, no p.data swap)
    module = torch.nn.Module()
    for i, p in enumerate(params):
        module.register_parameter(f"t{i}", torch.nn.Parameter(p))
    named = dict(module.named_parameters())
    flat = FlatParams(named, layout)
    before = named["t0"].data_ptr()
    flat.set_range(np.zeros(layout.numel, np.float32), 0)
    assert named["t0"].data_ptr() == before and not named["t0"].detach().any()
    # a parameter re-pointed by its framework is followed on the next operation
    named["t0"].data = torch.ones(40, 50)
    out = torch.empty(layout.numel)
    flat.gather_into(out)
    assert out[: 40 * 50].eq(1).all()
    named["t0"].data = torch.ones(40, 50, dtype=torch.float64)
    with pytest.raises(ValueError, match="dtype"):
        flat.gather_into(out)


@no_cuda
def test_cuda_parameters_take_the_torch_backend():
    params = _model(11, device="cuda")
    flat = FlatParams(params, _layout(params))
    assert flat.backend == "torch" and flat.device.type == "cuda"
    with pytest.raises(ValueError, match="native"):
        FlatParams(params, _layout(params), backend="native")


# ------------------------------------------------------------------------------ FlatCompressor

FLAT_SHAPES = [(300, 200), (500,), (129, 77), (64,), (10_007,), (3, 3), (1,)]


def _grads(layout: FlatLayout, steps: int, seed: int = 0):
    """Gradient-like flat vectors: a persistent part plus heavy-tailed noise, changing scale."""
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(layout.numel, generator=g) * 0.1
    for s in range(steps):
        noise = torch.randn(layout.numel, generator=g) * torch.rand(layout.numel, generator=g) ** 3
        yield (mean + noise) * 10.0 ** (s % 3 - 1)


def _sent(push: FlatPush) -> np.ndarray:
    return push.to_dense().astype(np.float64)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("method", ("threshold", "block", "exact", "dense"))
@pytest.mark.parametrize("value_dtype", ("f32", "f16", "q2"))
def test_flat_error_feedback_conserves_mass(backend, device, method, value_dtype):
    layout = _layout([torch.empty(s) for s in FLAT_SHAPES])
    comp = FlatCompressor(layout, 0.01, method, device=device, backend=backend, value_dtype=value_dtype)
    total = np.zeros(layout.numel)
    sent = np.zeros(layout.numel)
    steps = 6
    for g in _grads(layout, steps):
        total += g.double().numpy()
        push = comp.compress(g.to(device))
        assert push.sparse_numel == layout.sparse_numel and push.numel == layout.numel
        assert push.dense_dtype == ("f16" if value_dtype == "q2" else value_dtype)
        sp = push.sparse
        if sp.indices is not None:
            assert sp.indices.dtype == np.int32 and np.all(np.diff(sp.indices) > 0)
            assert sp.count == 0 or (sp.indices[0] >= 0 and sp.indices[-1] < layout.sparse_numel)
        # what goes out is exactly what the wire carries
        for vals, dtype in ((sp.values, value_dtype), (push.dense, push.dense_dtype)):
            wire = codec.decode_values(codec.encode_values(vals, dtype), vals.size, dtype)
            np.testing.assert_array_equal(wire, vals)
        sent += _sent(push)
    res = comp.residual.double().cpu().numpy()
    scale = np.abs(total).max()
    assert np.abs(sent + res - total).max() < 1e-5 * steps * scale
    last = comp.flush()
    assert last.value_dtype == last.dense_dtype == "f32"
    np.testing.assert_array_equal(last.to_dense(), comp.residual.cpu().numpy() + res.astype(np.float32))
    assert not comp.residual.any()


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("method", ("threshold", "block"))
def test_flat_counts_within_tolerance(backend, device, method):
    layout = _layout([torch.empty(s) for s in FLAT_SHAPES])
    density = 0.01
    comp = FlatCompressor(layout, density, method, device=device, backend=backend)
    k = round(density * layout.sparse_numel)
    for g in _grads(layout, 6, seed=1):
        push = comp.compress(g.to(device))
        got = push.sparse.count if method == "threshold" else push.sparse.count / BLOCK
        want = k if method == "threshold" else round(k / BLOCK)
        assert 0.9 * want <= got <= 1.1 * want + 1
        assert push.dense.size == layout.numel - layout.sparse_numel


@pytest.mark.parametrize("method", ("threshold", "block", "exact"))
@pytest.mark.parametrize("value_dtype", ("f32", "bf16", "q4"))
def test_one_tensor_flat_is_the_per_tensor_compressor(method, value_dtype):
    """One engine: on a layout of one large tensor, the flat compressor sends what the
    per-tensor one sends, bit for bit, step after step (thresholds carried, seeds alike)."""
    n = 60_013
    layout = _layout([torch.empty(n)])
    flat = FlatCompressor(layout, 0.02, method, value_dtype=value_dtype)
    per = ErrorFeedbackCompressor(0.02, method, value_dtype=value_dtype)
    for g in _grads(layout, 8, seed=2):
        a, b = flat.compress(g), per.compress("w", g)
        np.testing.assert_array_equal(a.sparse.indices, b.indices)
        np.testing.assert_array_equal(a.sparse.values.view(np.uint32), b.values.view(np.uint32))
        assert a.dense.size == 0
        assert torch.equal(flat.residual, per.residual("w"))
        assert flat.select_stats() == per.select_stats("w")


def test_residual_given_or_added_is_the_same():
    """The update mode writes the residual and compresses None; the gradient mode adds a
    gradient in the selection's pass: the same floats either way."""
    layout = _layout([torch.empty(s) for s in FLAT_SHAPES])
    a, b = FlatCompressor(layout, 0.05), FlatCompressor(layout, 0.05)
    for g in _grads(layout, 4, seed=3):
        pa = a.compress(g)
        b.residual.add_(g)
        pb = b.compress(None)
        np.testing.assert_array_equal(pa.sparse.indices, pb.sparse.indices)
        np.testing.assert_array_equal(pa.sparse.values, pb.sparse.values)
        np.testing.assert_array_equal(pa.dense, pb.dense)
        assert torch.equal(a.residual, b.residual)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("per_tensor", (False, True))
@pytest.mark.parametrize("value_dtype", ("f32", "f16", "q4"))
def test_a_weighted_residual_is_ranked_by_its_weight_and_sent_unweighted(backend, device, per_tensor, value_dtype):
    """``weight`` (the update mode's ``moment_power``): the residual's sparse range holds
    ``r x u``; the push takes the top k of ``|r| u`` (exact: no coordinate left behind
    outranks one sent), carries ``r`` there (to a float32 rounding of the division, then the
    coding's), and leaves ``(r - sent) u`` behind; the dense suffix is untouched."""
    layout = _layout([torch.empty(s) for s in FLAT_SHAPES])
    s = layout.sparse_numel
    g = torch.Generator().manual_seed(5)
    r = torch.randn(layout.numel, generator=g)
    u = torch.rand(s, generator=g) ** 4 + 1e-3  # weights over three decades: the ranking by |r| alone differs
    comp = FlatCompressor(layout, 0.03, "exact", device=device, backend=backend, value_dtype=value_dtype,
                          group_quotas=per_tensor)
    comp.residual.copy_(r.to(device))
    comp.residual[:s].mul_(u.to(device))
    comp.weight = u.to(device)
    push = comp.compress(None)
    idx = push.sparse.indices.astype(np.int64)
    score = (r[:s].abs() * u).numpy()
    left = np.ones(s, bool)
    left[idx] = False
    for _, a, b in (layout.spans() if per_tensor else [(0, 0, s)]):
        if b <= s:
            mine = (idx >= a) & (idx < b)
            assert score[idx[mine]].min() >= score[a:b][left[a:b]].max()
    plain = set(np.argsort(-r[:s].abs().numpy())[: idx.size].tolist())
    assert len(plain & set(idx.tolist())) < 0.5 * idx.size  # not the plain magnitudes' choice
    rv = r[:s].numpy()[idx]
    if value_dtype == "f32":
        np.testing.assert_allclose(push.sparse.values, rv, rtol=3e-7, atol=0)
    else:
        rtol, atol = {"f16": (1e-3, 0.0), "q4": (0.0, 0.25 * np.abs(rv).max())}[value_dtype]
        np.testing.assert_allclose(push.sparse.values, rv, rtol=rtol, atol=atol)
    res = comp.residual.cpu().double().numpy()
    expect = (r[:s].double() * u.double()).numpy()
    expect[idx] = (rv.astype(np.float64) - push.sparse.values) * u.double().numpy()[idx]
    np.testing.assert_allclose(res[:s], expect, rtol=1e-5, atol=1e-6 * np.abs(expect).max())
    np.testing.assert_allclose(push.dense, r[s:].numpy(), rtol=1e-3, atol=0)  # its own coding, never weighted
    # the server's push-norm bound kept half of it: the other half goes back, weighted like the rest
    applied = comp.take_back(push, [(0, s, 0.5)])
    back = (push.sparse.values.astype(np.float64) - applied.sparse.values) * u.double().numpy()[idx]
    got = comp.residual.cpu().double().numpy()[idx] - res[idx]
    np.testing.assert_allclose(got, back, rtol=1e-5, atol=1e-7 * np.abs(back).max())


@pytest.mark.parametrize("method", ("threshold", "exact"))
def test_group_quotas_give_each_tensor_its_share(method):
    shapes = [(400, 100), (20_000,), (64,), (5_000,)]
    layout = _layout([torch.empty(s) for s in shapes])
    density = 0.02
    comp = FlatCompressor(layout, density, method, group_quotas=True, value_dtype="q4")
    total = np.zeros(layout.numel)
    sent = np.zeros(layout.numel)
    g = torch.Generator().manual_seed(4)
    for _ in range(4):
        x = torch.randn(layout.numel, generator=g)
        x[: 40_000] *= 1000.0  # the first tensor dwarfs the others: a global top-k would take only it
        total += x.double().numpy()
        push = comp.compress(x)
        sent += _sent(push)
        idx = push.sparse.indices.astype(np.int64)
        for _, a, b in layout.spans():
            if b <= layout.sparse_numel:
                k = round(density * (b - a))
                assert 0.9 * k <= np.count_nonzero((idx >= a) & (idx < b)) <= 1.1 * k
    res = comp.residual.double().numpy()
    assert np.abs(sent + res - total).max() < 1e-5 * 4 * np.abs(total).max()
    assert comp.select_stats() is None or comp.select_stats()["units"] > 0


def test_compressor_settings_are_checked():
    layout = _layout([torch.empty(s) for s in FLAT_SHAPES])
    with pytest.raises(ValueError, match="method"):
        FlatCompressor(layout, method="nope")
    with pytest.raises(ValueError, match="density"):
        FlatCompressor(layout, density=0.0)
    with pytest.raises(ValueError, match="value_dtype"):
        FlatCompressor(layout, value_dtype="q3")
    comp = FlatCompressor(layout)
    with pytest.raises(ValueError, match="elements"):
        comp.compress(torch.zeros(layout.numel - 1))
    comp.set_density(0.5)
    assert comp.density == 0.5
    empty = comp.compress(torch.zeros(layout.numel))
    assert empty.sparse.count == 0 and not empty.dense.any()
    with pytest.raises(ValueError, match="native"):
        FlatCompressor(layout, backend="native", device="cuda")


@pytest.mark.parametrize("dense_sparse", [False, True])
def test_take_back_returns_what_the_server_scaled_off_to_the_residual(dense_sparse):
    """PushOk's ``clipped``: over each range the push's values are scaled as the server
    scales them (float64 times the factor, to float32) and the rest, ``sent - applied``,
    goes back into the residual, sparse range and dense suffix alike; other ranges untouched."""
    layout = FlatLayout((5000, 10, 6000, 20), 4096)  # sparse range 11,000, dense suffix 30
    comp = FlatCompressor(layout, 0.01, "dense" if dense_sparse else "exact")
    g = torch.Generator().manual_seed(3)
    sent = comp.compress(torch.randn(layout.numel, generator=g))
    before = comp.residual.clone()
    s = layout.sparse_numel
    clipped = [(0, 4096, 0.5), (8192, layout.numel, 0.25)]  # two shards' ranges clipped, the middle one not
    applied = comp.take_back(sent, clipped)
    whole, got = sent.to_dense(), applied.to_dense()
    factor = np.ones(layout.numel)
    factor[:4096], factor[8192:] = 0.5, 0.25
    want = (whole.astype(np.float64) * factor).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal((comp.residual - before).numpy(), whole - want)
    assert applied.sparse_numel == s and (applied.sparse.indices is None) == dense_sparse
    assert comp.take_back(sent, []) is sent
