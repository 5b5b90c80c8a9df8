"""Wire coding: bit-exact round trips, and corrupt input always rejected with CodecError."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from stella import codec
from stella.errors import BadValue, CodecError, StellaError

CODINGS = codec.INDEX_CODINGS
EXACT_DTYPES = tuple(d for d in codec.VALUE_DTYPES if d not in codec.QUANT_DTYPES)  # f32, f16, bf16
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _random_set(seed: int, numel: int, density: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    count = min(numel, max(0, round(numel * density)))
    if count == 0:
        return np.zeros(0, np.int32)
    if count * 4 > numel:  # dense-ish: a mask
        return np.flatnonzero(rng.random(numel) < density).astype(np.int32)
    return np.unique(rng.integers(0, numel, size=count)).astype(np.int32)


def _blocky(idx: np.ndarray, numel: int) -> np.ndarray:
    """The whole 16-blocks that contain idx (for the block16 coding)."""
    if idx.size == 0:
        return idx
    b = np.unique(idx // 16).astype(np.int64)
    out = (b[:, None] * 16 + np.arange(16)).reshape(-1)
    return out[out < numel].astype(np.int32)


def _roundtrip(idx: np.ndarray, numel: int, coding: str) -> bytes:
    if coding == "block16":
        idx = _blocky(idx, numel)
    enc = codec.encode_indices(idx, numel, coding)
    raw = bytes(memoryview(enc))
    out = codec.decode_indices(raw, idx.size, numel, coding)
    assert out.dtype == np.int32
    assert np.array_equal(out, idx)
    return raw


def test_codings_listed():
    assert "raw32" in CODINGS and "rice" in CODINGS and len(set(CODINGS)) == len(CODINGS)
    assert codec.VALUE_DTYPES == ("f32", "f16", "bf16", "q4", "q2")
    assert codec.QUANT_DTYPES == ("q4", "q2")


@FAST
@given(
    seed=st.integers(0, 2**32 - 1),
    numel=st.integers(1, 300_000),
    density=st.sampled_from([0.0001, 0.001, 0.01, 0.05, 0.2, 0.5]),
    coding=st.sampled_from(CODINGS),
)
def test_roundtrip_random_sets(seed, numel, density, coding):
    idx = _random_set(seed, numel, density)
    _roundtrip(idx, numel, coding)


@pytest.mark.parametrize("coding", CODINGS)
@pytest.mark.parametrize(
    "numel,idx",
    [
        (1, []),
        (1, [0]),
        (10, [9]),
        (10, [0, 9]),
        (10, list(range(10))),
        (65536, [0, 65535]),
        (65537, [65535, 65536]),
        (2**31, [0, 2**31 - 1]),
        (2**31, [2**31 - 1]),
        (2**31, [2**31 - 3, 2**31 - 2, 2**31 - 1]),
        (2**31 - 1, [5, 2**30, 2**31 - 2]),
        (2**31, list(range(0, 2**31, 2**24))),
        (1000, [*list(range(0, 1000, 16)), 999]),
    ],
)
def test_roundtrip_edges(coding, numel, idx):
    idx = np.array(sorted(set(idx)), dtype=np.int32)
    if coding == "block16" and numel == 2**31 and len(idx) > 3:
        idx = idx[:2]  # 16 * 128 blocks is fine, but keep it quick
    raw = _roundtrip(idx, numel, coding)
    if idx.size == 0:
        assert raw == b""


@pytest.mark.parametrize("coding", CODINGS)
def test_block_runs_roundtrip(coding):
    # block top-k output: runs of 16 consecutive indices
    blocks = np.unique(np.random.default_rng(1).integers(0, 100_000, 700))
    idx = (blocks[:, None] * 16 + np.arange(16)).reshape(-1).astype(np.int32)
    _roundtrip(idx, 1_600_000, coding)


def test_rice_size_near_entropy():
    numel = 1_000_000
    idx = _random_set(3, numel, 0.01)
    raw = codec.encode_indices(idx, numel, "rice")
    bits = 8 * raw.size / idx.size
    assert bits < 8.5  # entropy of a 1% Bernoulli set: ~8.08 bits an index
    assert codec.rice_parameter(idx) in (5, 6, 7)


def test_rice_parameter_is_the_smallest_of_least_cost():
    """The encoder's b against a brute force over all 32: count (1 + b) + sum(g >> b)
    least, the smallest b on a tie (C walks from an estimate: the cost is convex in b).
    Sets of every shape: random at many densities, runs, a few huge gaps, a full range,
    single indices, gaps near 2^31."""
    rng = np.random.default_rng(17)

    def brute(idx: np.ndarray) -> int:
        g = np.diff(np.concatenate([[-1], idx.astype(np.int64)])) - 1
        return int(np.argmin([idx.size * (1 + b) + int((g >> b).sum()) for b in range(32)]))

    sets = [np.array([0]), np.array([2**31 - 2]), np.array([0, 2**31 - 2]), np.arange(1000)]
    for _ in range(60):
        numel = int(rng.choice([100, 10_000, 10**6, 2**31 - 1]))
        count = int(rng.integers(1, min(numel, 3000) + 1))
        sets.append(np.unique(rng.integers(0, numel, count)))  # random, of any density
        starts = np.unique(rng.integers(0, max(1, numel - 16), max(1, count // 16)))
        sets.append(np.unique((starts[:, None] + np.arange(16)).ravel()))  # runs
        sets.append(np.unique(np.concatenate([rng.integers(0, 200, count), rng.integers(0, numel, 2)])))  # outliers
    for idx in sets:
        idx = idx.astype(np.int32)
        b = codec.rice_parameter(idx)
        assert b == brute(idx), (idx.size, int(idx[-1]))
        assert bytes(codec.encode_indices(idx, 2**31 - 1, "rice")) == _rice_bytes(idx, b)


@pytest.mark.parametrize("coding", CODINGS)
def test_truncated_extended_wrong_count(coding):
    numel = 200_003
    idx = _random_set(7, numel, 0.01)
    if coding == "block16":
        idx = _blocky(idx, numel)
    raw = bytes(memoryview(codec.encode_indices(idx, numel, coding)))
    for bad in (raw[:-1], raw[: len(raw) // 2], raw + b"\x00", raw + b"\x01", b""):
        with pytest.raises(CodecError):
            codec.decode_indices(bad, idx.size, numel, coding)
    for count in (idx.size - 1, idx.size + 1, 0):
        with pytest.raises(CodecError):
            codec.decode_indices(raw, count, numel, coding)
    with pytest.raises(CodecError):  # an index >= numel
        codec.decode_indices(raw, idx.size, int(idx[-1]), coding)
    with pytest.raises(CodecError):
        codec.decode_indices(raw, idx.size, numel + 1, "nope")
    with pytest.raises(CodecError):
        codec.decode_indices(raw, numel + 1, numel, coding)


def test_block16_needs_whole_blocks():
    with pytest.raises(ValueError):
        codec.encode_indices(np.arange(1, 17, dtype=np.int32), 100, "block16")
    with pytest.raises(ValueError):
        codec.encode_indices(np.arange(0, 15, dtype=np.int32), 100, "block16")
    # the short last block of a 100-element tensor: 96..99
    idx = np.concatenate([np.arange(16, 32), np.arange(96, 100)]).astype(np.int32)
    raw = _roundtrip(idx, 100, "block16")
    with pytest.raises(CodecError):  # count must match the blocks
        codec.decode_indices(raw, 32, 100, "block16")
    with pytest.raises(CodecError):
        codec.decode_indices(raw, 20, 101, "block16")


def test_raw32_order_and_range_checked():
    good = np.array([1, 5, 9], np.int32)
    codec.decode_indices(good.tobytes(), 3, 10, "raw32")
    for bad in ([1, 1, 9], [5, 1, 9], [-1, 2, 3], [1, 2, 10]):
        with pytest.raises(CodecError):
            codec.decode_indices(np.array(bad, np.int32).tobytes(), 3, 10, "raw32")


def test_noncanonical_varint_rejected():
    # gap 1 written as 0x81 0x00 (overlong) instead of 0x01
    with pytest.raises(CodecError):
        codec.decode_indices(b"\x81\x00", 1, 100, "varint")
    # a gap of 2**32 - 1: too large
    with pytest.raises(CodecError):
        codec.decode_indices(b"\xff\xff\xff\xff\x0f", 1, 2**31, "varint")
    assert codec.decode_indices(b"\x01", 1, 100, "varint").tolist() == [1]


def test_rice_padding_and_parameter_checked():
    idx = np.array([3, 4, 10], np.int32)
    raw = bytearray(memoryview(codec.encode_indices(idx, 100, "rice")))
    bad = bytearray(raw)
    bad[0] = 32  # b > 31
    with pytest.raises(CodecError):
        codec.decode_indices(bytes(bad), 3, 100, "rice")
    bad = bytearray(raw)
    bad[-1] |= 0x80  # a set padding bit
    with pytest.raises(CodecError):
        codec.decode_indices(bytes(bad), 3, 100, "rice")


def _rice_bytes(idx: np.ndarray, b: int) -> bytes:
    """A Rice stream of ``idx`` with parameter ``b``, bit by bit (docs/compression.md)."""
    bits: list[int] = []
    prev = -1
    for x in idx.tolist():
        g = x - prev - 1
        prev = x
        bits += [0] * (g >> b) + [1] + [(g >> j) & 1 for j in range(b)]
    bits += [0] * (-len(bits) % 8)
    body = bytes(sum(bit << j for j, bit in enumerate(bits[k:k + 8])) for k in range(0, len(bits), 8))
    return bytes([b]) + body


@pytest.mark.parametrize("b", [0, 1, 3, 9, 20, 25, 26, 31])
def test_rice_any_parameter_long_and_short_codes(b):
    # the decoder reads codes of up to 57 bits from one load and longer ones (long zero runs,
    # a large b) bit by bit, near the buffer's end too: every parameter, mixed gap sizes
    rng = np.random.default_rng(b)
    numel = 2**31
    gaps = np.where(rng.random(300) < 0.2, rng.integers(0, 2**31 // 400, 300), rng.integers(0, 64, 300))
    if b < 9:  # a gap costs gap >> b zero bits: keep the stream small
        gaps = gaps.clip(max=2**(b + 12))
    idx = (np.cumsum(gaps + 1) - 1).astype(np.int64)
    idx = idx[idx < numel].astype(np.int32)
    raw = _rice_bytes(idx, b)
    assert codec.decode_indices(raw, idx.size, numel, "rice").tolist() == idx.tolist()
    with pytest.raises(CodecError):  # the last index is out of range
        codec.decode_indices(raw, idx.size, int(idx[-1]), "rice")
    with pytest.raises(CodecError):
        codec.decode_indices(raw[:-1], idx.size, numel, "rice")


def test_encode_rejects_bad_input():
    for coding in CODINGS:
        with pytest.raises(ValueError):
            codec.encode_indices(np.array([3, 2], np.int32), 10, coding)
        with pytest.raises(ValueError):
            codec.encode_indices(np.array([3, 10], np.int32), 10, coding)
        with pytest.raises(ValueError):
            codec.encode_indices(np.array([1, 1], np.int32), 10, coding)
    with pytest.raises(ValueError):
        codec.encode_indices(np.array([1], np.int32), 10, "nope")
    with pytest.raises(ValueError):  # would wrap to 5 as int32
        codec.encode_indices(np.array([2**32 + 5], np.int64), 10, "raw32")
    assert codec.decode_indices(codec.encode_indices(np.array([1, 4], np.int64), 10, "rice"),
                                2, 10, "rice").tolist() == [1, 4]


def _check_or_codec_error(data: bytes, count: int, numel: int, coding: str):
    try:
        out = codec.decode_indices(data, count, numel, coding)
    except CodecError:
        return None
    assert out.dtype == np.int32 and out.size == count
    if count:
        assert out[0] >= 0 and out[-1] < numel
        assert np.all(np.diff(out.astype(np.int64)) > 0)
    return out


@settings(max_examples=400, deadline=None)
@given(
    data=st.binary(max_size=64),
    count=st.integers(0, 80),
    numel=st.sampled_from([1, 7, 100, 70_000, 2**31]),
    coding=st.sampled_from(CODINGS),
)
def test_fuzz_random_bytes(data, count, numel, coding):
    assume(count <= numel)
    _check_or_codec_error(data, count, numel, coding)


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    coding=st.sampled_from(CODINGS),
    flips=st.lists(st.integers(0, 10**9), min_size=1, max_size=4),
)
def test_fuzz_bit_flips(seed, coding, flips):
    numel = 150_000
    idx = _random_set(seed, numel, 0.005)
    if coding == "block16":
        idx = _blocky(idx, numel)
    raw = bytearray(memoryview(codec.encode_indices(idx, numel, coding)))
    assume(len(raw) > 0)
    for f in flips:
        bit = f % (8 * len(raw))
        raw[bit // 8] ^= 1 << (bit % 8)
    _check_or_codec_error(bytes(raw), idx.size, numel, coding)


def test_buffer_types_accepted():
    idx = np.array([0, 7, 99], np.int32)
    enc = codec.encode_indices(idx, 100, "rice")
    for buf in (enc, bytes(enc), bytearray(enc), memoryview(bytes(enc))):
        assert codec.decode_indices(buf, 3, 100, "rice").tolist() == [0, 7, 99]


def test_codec_error_is_stella_error():
    assert issubclass(CodecError, StellaError)


# ----------------------------------------------------------------- values
_SPECIAL = np.array(
    [0.0, -0.0, 1.0, -1.0, 65504.0, 65519.99, 65520.0, 1e6, -1e6, 6.1e-5, 5.96e-8, 2.98e-8,
     2.99e-8, 1e-10, 3.4e38, -3.4e38, np.inf, -np.inf, 1.0 + 2**-11, 1.0 + 3 * 2**-11,
     1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.00390625, 1.01171875, 1e-40, -1e-45],
    dtype=np.float32,
)


@pytest.mark.parametrize("dtype,tdtype", [("f16", torch.float16), ("bf16", torch.bfloat16)])
def test_values_match_torch(dtype, tdtype):
    rng = np.random.default_rng(5)
    v = np.concatenate([
        _SPECIAL,
        (rng.standard_normal(5000) * 10.0 ** rng.integers(-9, 6, 5000)).astype(np.float32),
        rng.integers(0, 2**32, 5000, dtype=np.uint32).view(np.float32),
    ])
    v = v[~np.isnan(v)]
    enc = codec.encode_values(v, dtype)
    assert enc.dtype == np.uint8 and enc.size == 2 * v.size
    ref = torch.from_numpy(v).to(tdtype)
    assert np.array_equal(enc.view(np.uint16), ref.view(torch.int16).numpy().view(np.uint16))
    back = codec.decode_values(bytes(enc), v.size, dtype)
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, ref.float().numpy())


@pytest.mark.parametrize("dtype", EXACT_DTYPES)
def test_values_roundtrip_and_size_checked(dtype):
    v = np.array([1.5, -2.25, np.nan, np.inf, 0.0], np.float32)
    enc = codec.encode_values(v, dtype)
    back = codec.decode_values(enc, 5, dtype)
    assert np.isnan(back[2]) and back[3] == np.inf
    np.testing.assert_array_equal(back[[0, 1, 3, 4]], v[[0, 1, 3, 4]])
    assert codec.decode_values(b"", 0, dtype).size == 0
    for bad in (bytes(enc)[:-1], bytes(enc) + b"\x00"):
        with pytest.raises(CodecError):
            codec.decode_values(bad, 5, dtype)
    with pytest.raises(CodecError):
        codec.decode_values(bytes(enc), 4, dtype)
    # unaligned buffers decode too
    shifted = memoryview(b"\x00" + bytes(enc))[1:]
    np.testing.assert_array_equal(codec.decode_values(shifted, 5, dtype)[[0, 1, 3, 4]], back[[0, 1, 3, 4]])


def test_values_unknown_dtype():
    with pytest.raises(CodecError):
        codec.decode_values(b"\x00\x00", 1, "f8")
    with pytest.raises(ValueError):
        codec.encode_values(np.zeros(1, np.float32), "f8")


def test_f16_nan_stays_nan():
    v = np.array([np.nan, -np.nan], np.float32)
    for dtype in ("f16", "bf16"):
        assert np.isnan(codec.decode_values(codec.encode_values(v, dtype), 2, dtype)).all()


@pytest.mark.parametrize("dtype", EXACT_DTYPES)
def test_wire_values_view_and_finiteness(dtype):
    """A zero-copy view as the values travel; NaN/Inf anywhere (the C scan works in
    blocks: first, middle, last position) raises BadValue."""
    n = 10_000
    v = np.random.default_rng(8).standard_normal(n).astype(np.float32)
    enc = codec.encode_values(v, dtype)
    view = codec.wire_values(enc, n, dtype)
    assert view.dtype == {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}[dtype]
    assert np.shares_memory(view, enc)
    np.testing.assert_array_equal(codec.decode_values(enc, n, dtype),
                                  view.astype(np.float32) if dtype != "bf16"
                                  else (view.astype(np.uint32) << 16).view(np.float32))
    for bad in (np.nan, np.inf, -np.inf):
        for pos in (0, 4095, 4096, n - 1):
            w = v.copy()
            w[pos] = bad
            with pytest.raises(BadValue, match="NaN/Inf"):
                codec.wire_values(codec.encode_values(w, dtype), n, dtype)
    # the largest finite values and subnormals pass
    edge = np.array([65504.0, -65504.0, 6e-8, 0.0, -0.0], np.float32)
    if dtype == "f32":  # (rounds to Inf in f16 and bf16)
        edge = np.append(edge, np.float32(np.finfo(np.float32).max))
    codec.wire_values(codec.encode_values(edge, dtype), edge.size, dtype)
    shifted = memoryview(b"\x00" + bytes(enc))[1:]  # unaligned: copied, still checked
    np.testing.assert_array_equal(codec.wire_values(shifted, n, dtype), view)
    with pytest.raises(CodecError):
        codec.wire_values(bytes(enc)[:-1], n, dtype)
    assert codec.wire_values(b"", 0, dtype).size == 0


# ---- q4 / q2 ----------------------------------------------------------------------
def _q_reference(v: np.ndarray, dtype: str) -> tuple[bytes, np.ndarray]:
    """docs/compression.md's q4/q2 format in NumPy: (frame, decoded values)."""
    bits = codec.QUANT_BITS[dtype]
    top = (1 << bits) - 1
    h = np.float32(top / 2)
    levels = np.array([(2 * k - top) / top for k in range(top + 1)], np.float32)
    n = v.size
    nch = -(-n // codec.QCHUNK)
    chunks = np.zeros(nch * codec.QCHUNK, np.float32)
    chunks[:n] = v
    chunks = chunks.reshape(nch, codec.QCHUNK)
    m = np.abs(chunks).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        x = chunks / m
        y = x * h
        t = y + np.float32(h + 0.5)
        k = np.where(m > 0, np.minimum(np.floor(t), top), (top + 1) // 2).astype(np.int64).reshape(-1)[:n]
    dec = (np.repeat(m[:, 0], codec.QCHUNK)[:n] * levels[k]).astype(np.float32)
    packed = np.zeros(-(-n * bits // 8), np.uint8)
    pos = np.arange(n) * bits
    np.bitwise_or.at(packed, pos // 8, (k << (pos % 8)).astype(np.uint8))
    return m.astype("<f4").tobytes() + packed.tobytes(), dec


def _q_inputs():
    rng = np.random.default_rng(11)
    yield "count 1", np.array([-3.25], np.float32)
    yield "count 1, zero", np.zeros(1, np.float32)
    for n in (63, 64, 65, 127, 129, 1000, 4099):
        yield f"normal {n}", rng.standard_normal(n).astype(np.float32)
    v = rng.standard_normal(300).astype(np.float32)
    v[64:128] = 0.0  # a chunk of zeros
    v[130:140] = 0.0  # zeros inside a chunk
    v[200] = -0.0
    yield "zeros", v
    wide = rng.standard_normal(5000) * 10.0 ** rng.integers(-38, 38, 5000)
    yield "magnitudes", wide.astype(np.float32)
    yield "huge", np.array([np.finfo(np.float32).max, -np.finfo(np.float32).max, 1e38, 3.0], np.float32)
    yield "tiny", np.array([1e-38, -1e-40, 1e-45, 0.0, 2e-45, -1.4e-45], np.float32)
    yield "ties", np.array([1.0, 0.0, -1.0, 1 / 3, 2 / 3, -1 / 3, 0.2, 0.6, -0.2, -0.6] * 7, np.float32)
    yield "random bits", rng.integers(0, 2**32, 3000, dtype=np.uint32).view(np.float32)


_Q_CASES = [(name, v[np.isfinite(v)]) for name, v in _q_inputs()]


@pytest.mark.parametrize("dtype", codec.QUANT_DTYPES)
@pytest.mark.parametrize("name,v", _Q_CASES, ids=[c[0] for c in _Q_CASES])
def test_q_matches_numpy_reference_bit_for_bit(dtype, name, v):
    frame, dec = _q_reference(v, dtype)
    enc = codec.encode_values(v, dtype)
    assert enc.dtype == np.uint8 and enc.size == codec.value_frame_size(dtype, v.size) == len(frame)
    assert bytes(enc) == frame
    back = codec.decode_values(bytes(enc), v.size, dtype)
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back.view(np.uint32), dec.view(np.uint32))
    np.testing.assert_array_equal(codec.quantise(v, dtype).view(np.uint32), dec.view(np.uint32))
    np.testing.assert_array_equal(codec.wire_values(enc, v.size, dtype), back)


@pytest.mark.parametrize("dtype", codec.QUANT_DTYPES)
@pytest.mark.parametrize("name,v", _Q_CASES, ids=[c[0] for c in _Q_CASES])
def test_q_error_bound_exact_top_level_and_idempotence(dtype, name, v):
    """|decoded - v| <= s / 2 with the step s = 2 m / (L - 1) (m the chunk's largest
    magnitude, sent exactly), and quantising decoded values again changes nothing."""
    top = (1 << codec.QUANT_BITS[dtype]) - 1
    q = codec.quantise(v, dtype)
    assert np.isfinite(q).all()
    pad = -v.size % codec.QCHUNK
    m = np.abs(np.concatenate([v, np.zeros(pad, np.float32)])).reshape(-1, codec.QCHUNK).max(1)
    m_each = np.repeat(m, codec.QCHUNK)[: v.size].astype(np.float64)
    err = np.abs(q.astype(np.float64) - v.astype(np.float64))
    # half a step, plus float32 rounding of the level (relative) and of subnormals (absolute)
    assert (err <= m_each / top * (1 + 1e-6) + 2.0**-149 * 4).all()
    qm = np.abs(np.concatenate([q, np.zeros(pad, np.float32)])).reshape(-1, codec.QCHUNK).max(1)
    np.testing.assert_array_equal(qm, m)
    np.testing.assert_array_equal(codec.quantise(q, dtype).view(np.uint32), q.view(np.uint32))
    assert bytes(codec.encode_values(q, dtype)) == bytes(codec.encode_values(v, dtype))


def test_q_worked_example_and_sizes():
    """docs/compression.md's example; 4.5 and 2.5 bits a value with 64-value chunks."""
    v = np.array([1.0, -2.5], np.float32)
    assert bytes(codec.encode_values(v, "q4")).hex(" ") == "00 00 20 40 0b"
    assert bytes(codec.encode_values(v, "q2")).hex(" ") == "00 00 20 40 02"
    np.testing.assert_array_equal(codec.decode_values(b"\x00\x00\x20\x40\x0b", 2, "q4"),
                                  np.float32([np.float32(2.5) * np.float32(7 / 15), -2.5]))
    assert codec.QCHUNK == 64
    for dtype, bits in (("q4", 4.5), ("q2", 2.5)):
        assert codec.value_frame_size(dtype, 64 * 1000) * 8 / (64 * 1000) == bits
        assert codec.value_frame_size(dtype, 0) == 0
        assert codec.value_frame_size(dtype, 1) == 5
    assert codec.value_frame_size("q4", 65) == 8 + 33 and codec.value_frame_size("q2", 65) == 8 + 17


@pytest.mark.parametrize("dtype", codec.QUANT_DTYPES)
def test_q_corrupt_input_rejected(dtype):
    n = 130  # 3 chunks, the last of 2 values
    v = np.random.default_rng(2).standard_normal(n).astype(np.float32)
    enc = bytes(codec.encode_values(v, dtype))
    assert codec.decode_values(b"", 0, dtype).size == 0
    for bad, count in ((enc[:-1], n), (enc + b"\x00", n), (enc, n + 3), (enc, n - 3), (b"\x00", 0)):
        with pytest.raises(CodecError, match="bytes for"):
            codec.decode_values(bad, count, dtype)
    with pytest.raises(CodecError):  # q2: the same size as 130 values, but its pad bits are set
        codec.decode_values(enc, n - 1, dtype)
    for count in (-1, 2**31 + 1, 2**62):  # refused before anything is allocated for it
        with pytest.raises(CodecError, match="impossible count"):
            codec.decode_values(enc, count, dtype)
    for scale in (np.nan, np.inf, -np.inf, -1.0, -0.0, -1e-45):
        for chunk in (0, 2):
            bad = bytearray(enc)
            bad[4 * chunk:4 * chunk + 4] = np.float32(scale).tobytes()
            with pytest.raises(BadValue, match="scale negative, NaN or Inf"):
                codec.wire_values(bytes(bad), n, dtype)
    # 130 values: 260 (q2) or 520 (q4) code bits, so the last byte has 4 (q2) or 0 (q4) pad bits
    if dtype == "q2":
        bad = bytearray(enc)
        bad[-1] |= 0x10
        with pytest.raises(CodecError, match="corrupt"):
            codec.wire_values(bytes(bad), n, dtype)
    odd = bytes(codec.encode_values(v[:3], dtype))  # 3 values: 12 or 6 bits, pad above
    bad = bytearray(odd)
    bad[-1] |= 0x80
    with pytest.raises(CodecError, match="corrupt"):
        codec.decode_values(bytes(bad), 3, dtype)
    shifted = memoryview(b"\x00" + enc)[1:]  # unaligned buffers decode too
    np.testing.assert_array_equal(codec.decode_values(shifted, n, dtype), codec.decode_values(enc, n, dtype))
    for x in (np.nan, np.inf, -np.inf):
        w = v.copy()
        w[77] = x
        with pytest.raises(BadValue, match="NaN/Inf"):
            codec.encode_values(w, dtype)
        with pytest.raises(BadValue, match="NaN/Inf"):
            codec.quantise(w, dtype)
    with pytest.raises(ValueError):
        codec.quantise(v, "f16")


@FAST
@given(st.binary(max_size=200), st.integers(0, 400), st.sampled_from(codec.QUANT_DTYPES))
def test_q_fuzz_decodes_or_refuses(buf, count, dtype):
    """Any bytes: finite values of the right count, or CodecError / BadValue."""
    try:
        out = codec.wire_values(buf, count, dtype)
    except (CodecError, BadValue):
        return
    assert len(buf) == codec.value_frame_size(dtype, count)
    assert out.shape == (count,) and out.dtype == np.float32 and np.isfinite(out).all()


@FAST
@given(st.integers(1, 300), st.sampled_from(codec.QUANT_DTYPES), st.integers(0, 2**32 - 1))
def test_q_fuzz_valid_frames_round_trip(count, dtype, seed):
    """A frame with random codes and valid scales decodes to values that encode back to
    the same codes (canonical when no chunk's scale is 0)."""
    rng = np.random.default_rng(seed)
    size = codec.value_frame_size(dtype, count)
    nch = -(-count // codec.QCHUNK)
    scales = np.abs(rng.standard_normal(nch)).astype("<f4") + np.float32(0.5)
    codes = bytearray(rng.integers(0, 256, size - 4 * nch, dtype=np.uint8).tobytes())
    used = count * codec.QUANT_BITS[dtype]
    if used % 8:
        codes[-1] &= (1 << (used % 8)) - 1
    frame = scales.tobytes() + bytes(codes)
    out = codec.decode_values(frame, count, dtype)
    again = codec.decode_values(codec.encode_values(out, dtype), count, dtype)
    np.testing.assert_array_equal(again, codec.quantise(out, dtype))
    np.testing.assert_array_equal(codec.quantise(again, dtype), again)


def test_a_delta_of_values_to_install_refuses_coded_values_and_a_broadcast_takes_them():
    from stella.errors import ProtocolError
    from stella.payload import SparseTensor, encode_tensors
    from stella.protocol import Delta, TensorSpec, decode_reply, encode

    layout = [TensorSpec("w", (10,), "float32")]
    for vd in ("q4", "f16"):
        entries, frames = encode_tensors([SparseTensor(0, np.array([1, 4], np.int32), np.ones(2, np.float32))],
                                         layout, "raw32", vd)
        with pytest.raises(ProtocolError, match="exact"):  # a replica installs exact values only
            decode_reply(encode(Delta(version=1, full=False, tensors=entries), frames))
        rx = decode_reply(encode(Delta(version=1, full=False, tensors=entries, add=True, parts=[1]), frames))
        assert rx.msg.add and rx.msg.parts == [1]  # values to add: the broadcast's coding
    two = entries + [msgspec.structs.replace(e, index_frame=e.index_frame + 2, value_frame=e.value_frame + 2)
                     for e in entries]
    with pytest.raises(ProtocolError, match="appears twice"):  # one message names a tensor once
        decode_reply(encode(Delta(version=2, full=False, tensors=two, add=True, parts=[2]), frames + frames))
    assert decode_reply(encode(Delta(version=2, full=False, tensors=two, add=True, parts=[1, 1]), frames + frames))
    with pytest.raises(ProtocolError, match="parts add up"):
        decode_reply(encode(Delta(version=2, full=False, tensors=two, add=True, parts=[1]), frames + frames))


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_the_sum_of_squares_of_wire_values_matches_float64_numpy(dtype):
    """The push-norm bounds' one C pass (stella._codec_native.sum_of_squares), against
    NumPy in float64 on the values as the receiver decodes them, huge ones included."""
    from stella._codec_native import sum_of_squares

    rng = np.random.default_rng(7)
    vals = np.concatenate([rng.standard_normal(1001), [3e38 if dtype != "f16" else 6e4, -1e-30]]).astype(np.float32)
    wire = np.frombuffer(codec.encode_values(vals, dtype), dtype={"f32": np.float32, "f16": np.float16,
                                                                  "bf16": np.uint16}[dtype])
    want = np.square(codec.decode_values(wire.tobytes(), vals.size, dtype).astype(np.float64)).sum()
    assert sum_of_squares(wire) == pytest.approx(want, rel=1e-12) and np.isfinite(sum_of_squares(wire))
