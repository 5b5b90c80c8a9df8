"""bench.layouts' probe (native/bench/probe.c, the bench-only build): both layouts do the
same arithmetic on the same coordinates, so that their times compare memory, not work;
its bad arguments are refused; the command line runs and reports every row."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def nb():
    from bench import _native_bench

    _native_bench.load()
    return _native_bench


def _views(mem: np.ndarray, numel: int, layout: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(records as numel x 4, R, B) of a probe's memory in either layout."""
    if layout == 1:
        rec = mem[:numel * 8].reshape(numel, 8)
        return rec[:, :4], rec[:, 4], rec[:, 5]
    return mem[:numel * 4].reshape(numel, 4), mem[numel * 4:numel * 5], mem[numel * 5:numel * 6]


def test_both_layouts_compute_the_same_state(nb):
    numel = 5000
    rng = np.random.default_rng(3)
    mems = [np.zeros(numel * 6, np.float32), np.zeros(numel * 8, np.float32), np.zeros(numel * 4, np.float32)]
    for _ in range(4):
        idx = np.sort(rng.choice(numel, 700, replace=False)).astype(np.int32)
        g = rng.standard_normal(idx.size).astype(np.float32)
        sent = idx[::3].copy()
        for lay in (0, 1):
            nb.probe_layout(mems[lay], numel, lay, 0, idx, g)
            nb.probe_layout(mems[lay], numel, lay, 1, sent, g[:sent.size].copy())
        nb.probe_layout(mems[2], numel, 2, 0, idx, g)
    (rec0, r0, b0), (rec1, r1, b1) = _views(mems[0], numel, 0), _views(mems[1], numel, 1)
    np.testing.assert_array_equal(rec0, rec1)
    np.testing.assert_array_equal(r0, r1)
    np.testing.assert_array_equal(b0, b1)
    np.testing.assert_array_equal(mems[2].reshape(numel, 4), rec0)  # the records alone: the same update
    assert np.count_nonzero(r0) > 0 and np.count_nonzero(b0) > 0
    # what the selection took from R went to B: nothing was lost between them (p = R + B where touched)
    np.testing.assert_allclose(r0 + b0, rec0[:, 0], rtol=1e-5, atol=1e-7)


def test_bad_arguments_are_refused(nb):
    numel = 100
    mem = np.zeros(numel * 6, np.float32)
    g = np.ones(2, np.float32)
    with pytest.raises(ValueError):
        nb.probe_layout(mem, numel, 0, 0, np.array([1, numel], np.int32), g)  # out of range
    with pytest.raises(ValueError):
        nb.probe_layout(mem, numel, 1, 0, np.array([1, 2], np.int32), g)  # layout 1 needs 8 numel
    with pytest.raises(ValueError):
        nb.probe_layout(mem, numel, 2, 1, np.array([1, 2], np.int32), g)  # the records alone: no selection
    with pytest.raises(ValueError):
        nb.probe_layout(mem, numel, 0, 0, np.array([1, 2], np.int32), np.ones(3, np.float32))
    assert not mem.any()


def test_bench_layouts_runs_and_reports_every_row(tmp_path):
    out = tmp_path / "layouts.json"
    r = subprocess.run([sys.executable, "-m", "bench.layouts", "--quick", "--steps", "3", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "load at start" in r.stdout
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [(x["numel"], x["touched"], x["sent"]) for x in rows] == [
        (1_000_000, t, s) for t in (0.02, 0.002) for s in (1.0, 0.25)]
    for x in rows:
        for key in ("floor_ns", "records_ns", "today_apply_ns", "today_select_ns", "fused_apply_ns",
                    "fused_select_ns"):
            assert x[key] > 0, key
        assert x["today_ns"] == pytest.approx(x["today_apply_ns"] + x["today_select_ns"], abs=0.011)
        assert x["today_over_fused"] == pytest.approx(x["today_ns"] / x["fused_ns"], abs=0.011)
