"""Load: many worker processes in synchronous steps against one stella-ps (bench.load),
and the conserved-sum check: every push_ok is in the model exactly once, the model is
exactly the one the pushes predict, and every worker's replica equals it.

The servers run over CurveZMQ with the session's keys (conftest), which the worker
processes read from the environment. The 32-worker run (about 20 s with start-up on
two cores) is marked slow; a 4-worker run keeps the check in the fast suite.
"""
from __future__ import annotations

import numpy as np
import pytest

from bench.load import SHARED, expected_model, run_load


def check(result: dict, workers: int) -> None:
    c = result["conserved"]
    assert c["steps"] > 0, result
    assert c["push_ok"] == c["server_pushes"] == workers * c["steps"], result
    assert c["pushes_accounted"] and c["replicas_agree"], result
    assert c["model_exact"], result
    assert c["ok"]


def test_expected_model_is_exact():
    w = expected_model(32, 1000)
    assert np.all(w[:SHARED] == -1000.0) and np.all(w[SHARED:] == -31.25)


@pytest.mark.timeout(120)
def test_load_conserved_sum_4_workers():
    check(run_load(workers=4, seconds=1.0, secure=True), 4)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_load_conserved_sum_32_workers():
    check(run_load(workers=32, seconds=5.0, secure=True), 32)  # its steps/s are bench.load's to print


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_load_conserved_sum_32_workers_on_2_shards():
    """Issue 21: 32 workers against two shards (the tensor cut between them): every shard
    makes every step and counts every push, and the model is exact."""
    result = run_load(workers=32, seconds=5.0, secure=True, shards=2)
    check(result, 32)
    assert result["conserved"]["shards"] == 2
