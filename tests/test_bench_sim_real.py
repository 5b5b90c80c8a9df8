"""bench.sim_real as a user runs it: the simulation's workers through a real stella-ps
(CurveZMQ, a server per run), with and without BatchNoise, its table and JSON."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_sim_real_runs_both_settings_and_reports_each_seeds_ratio(tmp_path):
    out = tmp_path / "real.json"
    r = subprocess.run([sys.executable, "-m", "bench.sim_real", "--workload", "adamlp", "--workers", "2",
                        "--density", "0.03", "--steps", "20", "--eval-every", "5", "--seeds", "0,1",
                        "--batch-noise", "both", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["batch_noise"] for row in rows] == [False, True]
    for row in rows:
        assert row["W"] == 2 and row["seeds"] == [0, 1] and len(row["ratios"]) == 2
        # a ratio of iterations against dense: trained, and within a factor of dense either way
        assert all(0.3 < x < 3.0 for x in row["ratios"]) and row["mean"] == sum(row["ratios"]) / 2
    assert "on " in r.stdout and "off" in r.stdout
