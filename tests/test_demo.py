"""The main job: two workers train digits through a real stella-ps to the stated accuracy."""
from __future__ import annotations

import io
import json

from stella.demo import DemoConfig, run_demo


def test_two_worker_demo_reaches_93_percent(tmp_path):
    out = io.StringIO()
    cfg = DemoConfig(workers=2, steps=400, density=0.05)
    res = run_demo(cfg, json_path=str(tmp_path / "demo.json"), out=out)
    assert res["test_accuracy"] >= 0.93, out.getvalue()
    assert res["steps"] == 400 and res["server_version"] == 401  # + the residual flush at close
    saved = json.loads((tmp_path / "demo.json").read_text())
    for key in ("test_accuracy", "steps", "wall_s", "bytes_pushed", "bytes_pulled", "bytes_dense_equivalent"):
        assert key in saved
    # sparse exchange at 5% density must move several times less than dense
    assert saved["bytes_pushed"] + saved["bytes_pulled"] < saved["bytes_dense_equivalent"] / 4
    assert "step  400/400" in out.getvalue()
