"""bench.zmq_floor runs end to end (a few hundred requests, CurveZMQ and plaintext) and
reports a cost for each."""
from __future__ import annotations

import json

from bench import zmq_floor


def test_zmq_floor_reports_each_case(tmp_path, capsys):
    out = tmp_path / "floor.json"
    assert zmq_floor.main(["--requests", "300", "--sizes", "1200", "--frames", "1,3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["curve"], r["frames"]) for r in rows] == [(True, 1), (True, 3), (False, 1), (False, 3)]
    assert all(r["requests"] == 300 and r["server_cpu_us"] > 0 and r["round_trip_us"] > 0 for r in rows)
    assert "server CPU us/req" in capsys.readouterr().out
