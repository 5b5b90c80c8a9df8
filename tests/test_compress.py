"""Top-k selection with error feedback: conservation, counts, order, quality."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from stella import codec
from stella.compress import BLOCK, ErrorFeedbackCompressor, SparseGrad, quantise_torch
from stella.errors import BadValue

SPARSE_METHODS = ("exact", "threshold", "block")
BACKENDS = ("native", "torch")


def _grad(n: int, seed: int, mean: torch.Tensor | None = None) -> torch.Tensor:
    """Gradient-like: a persistent component plus heavy-tailed noise."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 3
    return noise if mean is None else mean + noise


def _check_sparse(sg: SparseGrad, n: int):
    assert sg.numel == n
    assert sg.values.dtype == np.float32
    if sg.indices is None:
        assert sg.values.shape == (n,)
        return
    assert sg.indices.dtype == np.int32
    assert sg.indices.shape == sg.values.shape
    if sg.count:
        assert sg.indices[0] >= 0 and sg.indices[-1] < n
        assert np.all(np.diff(sg.indices.astype(np.int64)) > 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", (*SPARSE_METHODS, "dense"))
def test_error_feedback_conserves_mass(method, backend):
    n, steps = 60_013, 12  # not a multiple of 16: a partial last block
    comp = ErrorFeedbackCompressor(density=0.01, method=method, backend=backend)
    mean = torch.randn(n, generator=torch.Generator().manual_seed(9)) * 0.1
    total = torch.zeros(n, dtype=torch.float64)
    sent = np.zeros(n, dtype=np.float64)
    for s in range(steps):
        g = _grad(n, s, mean).reshape(7, -1) if n % 7 == 0 else _grad(n, s, mean)
        total += g.reshape(-1).double()
        sg = comp.compress("w", g)
        _check_sparse(sg, n)
        if sg.indices is None:
            sent += sg.values
        else:
            np.add.at(sent, sg.indices, sg.values)
    res = comp.residual("w").reshape(-1).double().numpy()
    err = np.abs(sent + res - total.numpy()).max()
    # float32 rounding of the residual additions: a few ulps of the running sums
    assert err < 1e-5 * steps * max(1.0, float(total.abs().max()))
    last = comp.flush("w")
    _check_sparse(last, n)
    np.testing.assert_allclose(last.to_dense().astype(np.float64), res, rtol=0, atol=0)
    assert float(comp.residual("w").abs().max()) == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", ("threshold", "block"))
@pytest.mark.parametrize("n,density", [(50_000, 0.01), (1_000_000, 0.001), (300_000, 0.05), (8_000, 0.1)])
def test_counts_within_tolerance(method, backend, n, density):
    comp = ErrorFeedbackCompressor(density=density, method=method, backend=backend)
    k = max(1, round(density * n))
    mean = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 0.3
    for s in range(6):
        sg = comp.compress("w", _grad(n, 100 + s, mean))
        _check_sparse(sg, n)
        if method == "block":
            kb = max(1, round(k / BLOCK))
            assert 0.9 * kb <= sg.count / BLOCK <= 1.1 * kb + 1, (s, sg.count, kb)
        else:
            assert 0.9 * k <= sg.count <= 1.1 * k, (s, sg.count, k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_threshold_captures_topk_mass(backend):
    n, k = 400_000, 4_000
    g = _grad(n, 5)
    exact = torch.topk(g.abs(), k).values.square().sum().item()
    comp = ErrorFeedbackCompressor(density=k / n, method="threshold", backend=backend)
    sg = comp.compress("w", g.clone())
    got = float(np.square(sg.values.astype(np.float64)).sum())
    assert got >= 0.95 * exact * min(1.0, sg.count / k)
    assert abs(sg.count - k) <= 0.1 * k


def test_exact_is_topk():
    n, k = 100_000, 1_000
    g = _grad(n, 2)
    comp = ErrorFeedbackCompressor(density=k / n, method="exact")
    sg = comp.compress("w", g)
    ref = torch.topk(g.abs(), k).indices.sort().values.numpy()
    assert np.array_equal(sg.indices, ref.astype(np.int32))
    np.testing.assert_array_equal(sg.values, g.numpy()[ref])


def test_native_and_torch_agree_on_selection_quality():
    n = 200_000
    g = _grad(n, 11)
    a = ErrorFeedbackCompressor(0.01, backend="native").compress("w", g)
    b = ErrorFeedbackCompressor(0.01, backend="torch").compress("w", g)
    ia, ib = set(a.indices.tolist()), set(b.indices.tolist())
    assert len(ia & ib) >= 0.85 * min(len(ia), len(ib))


def test_small_tensors_go_dense():
    comp = ErrorFeedbackCompressor(density=0.01, dense_below=4096)
    g = torch.randn(10, 40)
    sg = comp.compress("bias", g)
    assert sg.indices is None and sg.is_dense
    np.testing.assert_array_equal(sg.values, g.reshape(-1).numpy())
    assert float(comp.residual("bias").abs().max()) == 0.0
    assert comp.residual("bias").shape == g.shape


def test_dense_method_and_flush_empty():
    comp = ErrorFeedbackCompressor(method="dense")
    g = torch.randn(10_000)
    sg = comp.compress("w", g)
    assert sg.is_dense and np.array_equal(sg.values, g.numpy())
    fl = comp.flush("w")
    assert fl.count == 0 and fl.indices is not None


def test_zero_and_sparse_gradients():
    n = 100_000
    comp = ErrorFeedbackCompressor(density=0.01)
    sg = comp.compress("w", torch.zeros(n))
    assert sg.count == 0
    g = torch.zeros(n)
    g[::1000] = torch.arange(1, 101, dtype=torch.float32)  # 100 nonzeros < k = 1000
    sg = comp.compress("w", g)
    assert sg.count == 100 and np.array_equal(sg.indices, np.arange(0, n, 1000, dtype=np.int32))


@pytest.mark.parametrize("method", ("threshold", "block"))
def test_ties_take_exactly_k(method):
    # all magnitudes equal: the sampled threshold cannot separate anything; the
    # exact fallback with positional tie-breaking must still land on k
    n = 64_000
    comp = ErrorFeedbackCompressor(density=0.01, method=method)
    g = torch.ones(n)
    g[1::2] = -1
    sg = comp.compress("w", g)
    k = 640
    assert 0.9 * k <= sg.count <= 1.1 * k + BLOCK
    _check_sparse(sg, n)
    assert comp.select_stats("w")["exact_fallback"] in (0, 1)


def test_set_density_and_errors():
    comp = ErrorFeedbackCompressor(density=0.01)
    comp.compress("w", torch.randn(100_000))
    comp.set_density(0.001)
    sg = comp.compress("w", torch.randn(100_000))
    assert 90 <= sg.count <= 110
    with pytest.raises(ValueError):
        comp.set_density(0.0)
    with pytest.raises(ValueError):
        comp.set_density(1.5)
    with pytest.raises(ValueError):
        comp.compress("w", torch.randn(10))
    with pytest.raises(ValueError):
        ErrorFeedbackCompressor(method="nope")
    with pytest.raises(KeyError):
        comp.flush("missing")


def test_noncontiguous_and_half_gradients():
    comp = ErrorFeedbackCompressor(density=0.01)
    g = torch.randn(300, 200).t()  # not contiguous
    sg = comp.compress("w", g)
    _check_sparse(sg, 60_000)
    np.testing.assert_array_equal(sg.values, g.reshape(-1).numpy()[sg.indices])
    h = torch.randn(60_000).bfloat16()
    sg = comp.compress("h", h)
    np.testing.assert_array_equal(sg.values, h.float().numpy()[sg.indices])


def test_grad_not_modified():
    g = _grad(50_000, 3)
    before = g.clone()
    for method in SPARSE_METHODS:
        ErrorFeedbackCompressor(method=method).compress("w", g)
    assert torch.equal(g, before)


def test_sparse_grad_to_dense():
    sg = SparseGrad(5, np.array([1, 3], np.int32), np.array([2.0, -1.0], np.float32))
    assert sg.to_dense().tolist() == [0.0, 2.0, 0.0, -1.0, 0.0]
    assert sg.count == 2 and not sg.is_dense


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value_dtype,tdtype", [("f16", torch.float16), ("bf16", torch.bfloat16)])
def test_value_rounding_error_stays_in_residual(backend, value_dtype, tdtype):
    from stella import codec

    n, steps = 50_000, 5
    comp = ErrorFeedbackCompressor(0.01, backend=backend, value_dtype=value_dtype)
    total = torch.zeros(n, dtype=torch.float64)
    sent = np.zeros(n, dtype=np.float64)
    for s in range(steps):
        g = _grad(n, 40 + s) * 3e4  # big enough that f16 overflows without the clamp
        total += g.double()
        sg = comp.compress("w", g)
        # values are exactly representable: the wire round trip changes nothing
        wire = codec.decode_values(codec.encode_values(sg.values, value_dtype), sg.count, value_dtype)
        np.testing.assert_array_equal(wire, sg.values)
        assert np.isfinite(sg.values).all()
        np.add.at(sent, sg.indices, sg.values)
    res = comp.residual("w").double().numpy()
    scale = float(total.abs().max())
    assert np.abs(sent + res - total.numpy()).max() < 1e-5 * steps * scale


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", (*SPARSE_METHODS, "dense"))
@pytest.mark.parametrize("value_dtype", codec.QUANT_DTYPES)
def test_quantised_values_conserve_mass(value_dtype, method, backend):
    """q4/q2: the values returned are what the receiver decodes, and the sum of all
    decoded values ever sent plus the residual is the sum of the gradients."""
    n, steps = 20_011, 8
    comp = ErrorFeedbackCompressor(0.02, method=method, backend=backend, value_dtype=value_dtype)
    small = ErrorFeedbackCompressor(0.02, method=method, backend=backend, value_dtype=value_dtype)  # dense_below
    mean = torch.randn(n, generator=torch.Generator().manual_seed(3)) * 0.1
    total = torch.zeros(n, dtype=torch.float64)
    sent = {"w": np.zeros(n, dtype=np.float64), "b": np.zeros(1000, dtype=np.float64)}
    for s in range(steps):
        g = _grad(n, 70 + s, mean) * 10.0 ** (s % 5 - 2)  # magnitudes change from step to step
        total += g.double()
        for c, key, x in ((comp, "w", g), (small, "b", g[:1000])):
            sg = c.compress(key, x)
            _check_sparse(sg, x.numel())
            assert key == "w" or sg.is_dense  # below dense_below: dense, quantised all the same
            wire = codec.decode_values(codec.encode_values(sg.values, value_dtype), sg.count, value_dtype)
            np.testing.assert_array_equal(wire, sg.values)  # exactly what the receiver decodes
            np.add.at(sent[key], slice(None) if sg.indices is None else sg.indices, sg.values)
    scale = float(total.abs().max())
    for c, key in ((comp, "w"), (small, "b")):
        res = c.residual(key).double().numpy()
        assert np.abs(sent[key] + res - total.numpy()[: res.size]).max() < 1e-5 * steps * scale


@pytest.mark.parametrize("value_dtype", codec.QUANT_DTYPES)
def test_quantised_native_and_torch_paths_agree_bit_for_bit(value_dtype):
    """Same selection ("exact" is torch.topk on both paths), so the same values and
    residuals: the torch quantiser is the C one."""
    n = 30_007
    a = ErrorFeedbackCompressor(0.03, method="exact", backend="native", value_dtype=value_dtype)
    b = ErrorFeedbackCompressor(0.03, method="exact", backend="torch", value_dtype=value_dtype)
    for s in range(4):
        g = _grad(n, 90 + s) * 10.0 ** (3 * s - 6)
        sa, sb = a.compress("w", g), b.compress("w", g)
        np.testing.assert_array_equal(sa.indices, sb.indices)
        np.testing.assert_array_equal(sa.values.view(np.uint32), sb.values.view(np.uint32))
        assert torch.equal(a.residual("w"), b.residual("w"))


@pytest.mark.parametrize("value_dtype", codec.QUANT_DTYPES)
def test_quantise_torch_matches_c_and_refuses_nan(value_dtype):
    rng = np.random.default_rng(4)
    for n in (1, 64, 65, 1000):
        v = (rng.standard_normal(n) * 10.0 ** rng.integers(-40, 38, n)).astype(np.float32)
        v[: n // 3] = 0.0
        got = quantise_torch(torch.from_numpy(v), value_dtype).numpy()
        np.testing.assert_array_equal(got.view(np.uint32), codec.quantise(v, value_dtype).view(np.uint32))
    for backend in BACKENDS:
        comp = ErrorFeedbackCompressor(1.0, method="dense", backend=backend, value_dtype=value_dtype)
        with pytest.raises(BadValue, match="NaN/Inf"):
            comp.compress("w", torch.tensor([1.0, float("nan"), 2.0]))
    with pytest.raises(ValueError, match="value_dtype"):
        ErrorFeedbackCompressor(value_dtype="q3")
