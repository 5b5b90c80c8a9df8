"""bench.flat as a user runs it: the command line, its JSON, and rows that say what the
flat machinery was measured doing (a small model: the digits CNN's layout)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_flat_runs_and_reports_every_section(tmp_path):
    out = tmp_path / "flat.json"
    r = subprocess.run([sys.executable, "-m", "bench.flat", "--quick", "--workload", "digits", "--steps", "2",
                        "--dtype", "bf16", "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "loadavg at start" in r.stdout and "loadavg at end" in r.stdout
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert len(doc["loadavg_start"]) == len(doc["loadavg_end"]) == 3
    comp = {(x["system"], x["tensors"]) for x in rows if x["kind"] == "compressor"}
    assert comp == {("flat", 8), ("flat", 1), ("per-tensor", 8), ("per-tensor", 1)}
    ops = {x["op"].split()[0] for x in rows if x["kind"] == "op"}
    assert ops == {"gather_into", "gather_grads_into", "residual_into", "add_at", "set_at", "merge_at", "add_range"}
    assert all(x["backend"] == "native" and x["dtype"] == "bfloat16" for x in rows if x["kind"] == "op")
    rounds = {x["system"]: x for x in rows if x["kind"] == "round"}
    assert rounds.keys() == {"per-tensor", "flat"}
    for x in rows:
        assert x.get("ms", x.get("total_ms", 0)) > 0
