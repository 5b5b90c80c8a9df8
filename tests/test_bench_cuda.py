"""bench.cuda's training part, run on the CPU (``--device cpu``, the dry run of its code
paths CI can do): dense, then each Stella configuration (``h1`` and the library's
``defaults``) through a real ``stella-ps``, each worker's s/step beside its own compute
measured in the same run. The GPU figures themselves need a GPU (bench/RESULTS.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_the_training_part_runs_both_configurations_and_reports_each_workers_own_compute(tmp_path):
    out = tmp_path / "cuda.json"
    r = subprocess.run([sys.executable, "-m", "bench.cuda", "--device", "cpu", "--steps", "6", "--workers", "2",
                        "--configs", "h1,defaults", "--compressor-only", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    # --compressor-only skips training: the compressor rows are there, no Stella run
    doc = json.loads(out.read_text())
    assert doc["compressor"] and "stella" not in doc
    # both configurations on the same LM at 0.12M parameters (tinylm; the 10.8M one is the GPU's: on this CPU it
    # was the suite's longest test, 157 s with both)
    r = subprocess.run([sys.executable, "-m", "bench.cuda", "--device", "cpu", "--workload", "tinylm", "--steps", "6",
                        "--workers", "2", "--configs", "h1,defaults,auto", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    doc = json.loads(out.read_text())  # written whether or not the loss check passed on 6 steps
    assert doc["workload"] == "tinylm" and [run["config"] for run in doc["stella"]] == ["h1", "defaults", "auto"], \
        r.stdout + r.stderr
    for run in doc["stella"]:
        assert len(run["workers"]) == 2
        for w in run["workers"]:
            assert w["compute_s_per_step"] > 0 and w["s_per_step"] > 0
            assert w["x_compute"] == pytest.approx(w["s_per_step"] / w["compute_s_per_step"])
            assert w["bytes_pushed"] > 0 and w["bytes_pulled"] > 0
    h1 = doc["stella"][0]["workers"][0]
    assert h1["sync_every"] == 1 and h1["value_dtype"] == "f16"
