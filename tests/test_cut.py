"""A site's link cut in the middle of training (issue 45), on the slow-link test bed:
bench.cut's scenario, shortened. The other site loses at most about one step deadline
(the cut worker is behind the moment it falls silent), the cut site is back within
seconds of its link with at most one reconnect, and both stop cleanly."""
from __future__ import annotations

import argparse

import pytest

from bench.cut import scenario
from bench.wan import netns_available


@pytest.mark.slow
def test_a_site_cut_for_12_s_costs_the_other_one_deadline_and_comes_back_by_itself():
    ok, why = netns_available()
    if not ok:
        pytest.skip(f"slow-link test bed unavailable: {why}")
    a = argparse.Namespace(rate=100.0, before=8.0, after=10.0, liveness=20.0)
    r = scenario("cut", 12.0, a)
    assert r["b_steps_during"] > 50, r  # the other site trained on through the cut
    # one step waited the deadline (about a second), or none: a was silent within 1.5 heartbeats
    assert r["steps_waiting_the_deadline"] <= 2 and r["b_longest_gap_s"] < 4.0, r
    assert r["a_silent_after_s"] is not None and r["a_silent_after_s"] < 4.0, r
    assert not r["a_declared_gone"], r  # 12 s < the 20 s liveness timeout
    assert r["a_back_after_s"] is not None and r["a_back_after_s"] < 10.0 and r["a_reconnects"] <= 1, r
    assert r["exit"] == {"a": 0, "b": 0}, r
