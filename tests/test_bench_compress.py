"""bench.compress as a user runs it (it once stopped with a TypeError that no test saw):
the command line, its JSON, and what its rows must say about the compressors."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_compress_runs_and_reports_sound_rows(tmp_path):
    out = tmp_path / "compress.json"
    r = subprocess.run([sys.executable, "-m", "bench.compress", "--sizes", "2e5", "--densities", "0.01",
                        "--no-cuda", "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())
    select = {x["method"]: x for x in rows if x["kind"] == "select"}
    assert {"threshold", "block", "exact"} <= select.keys()
    assert abs(select["exact"]["captured"] - 1.0) < 1e-9 and select["exact"]["count_over_k"] == 1.0
    # the threshold selector keeps about k entries and nearly all of the top k's mass
    assert 0.9 <= select["threshold"]["count_over_k"] <= 1.1
    assert select["threshold"]["captured"] > 0.95
    # one pass a call, and the carried thresholds hold once the residual has settled
    for method in ("threshold", "block"):
        assert 1.0 <= select[method]["passes_per_call"] <= 1.2 and select[method]["estimates_per_call"] <= 0.5
    assert select["exact"]["estimates_per_call"] is None
    coding = [x for x in rows if x["kind"] == "wire"]
    assert coding, "no coding rows"
    by = {(x["method"], x["coding"], x["dtype"]): x["bytes_per_pair"] for x in coding}
    assert by[("threshold", "raw32", "f32")] == 8.0  # 4-byte index + 4-byte value, nothing else
    # Rice-coded indices cost fewer bytes than raw ones at 1% (gaps of about 100: ~8 bits)
    assert by[("threshold", "rice", "f16")] < by[("threshold", "varint", "f16")] < by[("threshold", "raw32", "f16")]
    assert by[("threshold", "rice", "f16")] < 3.5


def test_bench_compress_on_a_workloads_gradients(tmp_path):
    """--workload: every method and density on the same training run's gradients."""
    out = tmp_path / "workload.json"
    r = subprocess.run([sys.executable, "-m", "bench.compress", "--workload", "digits", "--steps", "3",
                        "--densities", "0.01,0.001", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert {(x["method"], x["density"]) for x in rows} == {(m, d) for m in ("threshold", "block")
                                                           for d in (0.01, 0.001)}
    for x in rows:
        assert x["kind"] == "workload" and x["params"] == 548_746 and x["ms_per_step"] > 0
        assert x["passes_per_call"] >= 1.0
    assert "workload" in r.stdout and "digits" in r.stdout
