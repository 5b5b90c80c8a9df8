"""bench.adaptive: the fluctuating links' schedule, and the slow scenario's machinery
(a slowed worker, the per-iteration records, stopping by round) on loopback."""
from __future__ import annotations

import itertools

import pytest

from bench import adaptive as A

RECORD_FIELDS = ("t", "t_epoch", "rounds", "value_dtype", "sync_every", "accumulate", "up_mbps", "down_mbps",
                 "density", "slept", "net_wait", "compute", "iter")


def test_rate_schedule_is_seeded_bounded_and_has_the_asked_means():
    dur = 300.0
    a = A.rate_schedule(130, duration=dur, period=4, seed="0:a")
    b = A.rate_schedule(100, duration=dur, period=4, seed="0:b")
    assert a == A.rate_schedule(130, duration=dur, period=4, seed="0:a")  # deterministic
    assert a != A.rate_schedule(130, duration=dur, period=4, seed="1:a")
    for s, mean in ((a, 130), (b, 100)):
        rates = [r for _, r in s]
        assert min(rates) == pytest.approx(30, abs=0.1) and max(rates) == pytest.approx(300, abs=0.1)
        assert all(30 - 0.1 <= r <= 300 + 0.1 for r in rates)
        ts = [t for t, _ in s]
        assert ts[0] == 0 and ts == sorted(ts) and ts[-1] < dur <= ts[-1] + 4 * 1.4
        gaps = [t1 - t0 for t0, t1 in itertools.pairwise(ts)]
        assert min(gaps) >= 4 * 0.6 - 1e-6 and max(gaps) <= 4 * 1.4 + 1e-6  # a change every few seconds
        assert A.time_mean(s, dur) == pytest.approx(mean, rel=0.05)
    assert A.time_mean(b, dur) < A.time_mean(a, dur)  # site b is the slower on average
    links = A.links_of("fluctuating", 100, 2.5, 0)["links"]
    assert all(u == d for _, u, d in links["a"].schedule) and len(links["a"].schedule) >= 100 / (2.5 * 1.4) - 1
    with pytest.raises(ValueError):
        A.rate_schedule(20, duration=10)  # below the range


@pytest.mark.timeout(180)
def test_slow_scenario_machinery_on_loopback(tmp_path):
    # stopped by time (worker 0 picks the stop round), not by the step cap, which is every
    # worker's own and so, with adaptation, need not fall on the same round
    caps = A.Caps(max_seconds=2, max_steps=100_000, eval_every=10, stop_at_target=False)
    out = A.run_scenario("slow", "digits", caps, only=["adaptive_slow"], loopback=True, log_dir=str(tmp_path),
                         echo=lambda m: None)
    (r,) = out["results"]
    assert r["ok"], r.get("error")
    ranks = r["ranks"]
    assert [k["rank"] for k in ranks] == [0, 1] and [k["slowdown"] for k in ranks] == [1.0, 2.0]
    for k in ranks:
        assert k["iters"] and all(f in x for x in k["iters"] for f in RECORD_FIELDS)
        assert [x["t"] for x in k["iters"]] == sorted(x["t"] for x in k["iters"])
    assert ranks[0]["rounds"] == ranks[1]["rounds"] == ranks[0]["stop_round"]  # both stopped at the same round
    assert all(x["slept"] == 0 for x in ranks[0]["iters"])
    # the slow worker sleeps as long as its forward + backward had taken, within them: they last at least
    # twice the sleep asked for (a busy machine only lengthens both; how much slower it ran is the
    # benchmark's table)
    assert all(x["fwd"] + x["bwd"] >= 2 * x["slept"] - 1e-9 and x["slept"] > 0 for x in ranks[1]["iters"])
    st = r["stats"]
    assert len(st["per_worker"]) == 2 and all(0 <= w["wait_share"] <= 1 for w in st["per_worker"])
    assert st["codings"] and st["H_range"][0] >= 1
    text = A.table("slow", out["results"])
    assert "adaptive_slow" in text and "bound" in text
    A.plot({"slow": out}, str(tmp_path / "adaptive.png"))
    assert (tmp_path / "adaptive.png").stat().st_size > 10_000


def test_adapt_links_fall_detection_waits_less_on_the_fluctuating_links_and_not_more_on_a_steady_one(tmp_path):
    """bench.adapt_links (the controller alone over simulated rounds on this bench's link
    schedules): with its fall detection the controller waits less on the fluctuating links,
    and a steady link that rounds measure at 30-100% of changes its choice no more often."""
    import json

    from bench import adapt_links

    out = tmp_path / "links.json"
    assert adapt_links.main(["--seeds", "3", "--rounds", "300", "--json", str(out)]) == 0
    rows = {(r["rounds measure"], r["fall detection"]): r for r in json.loads(out.read_text())["rows"]}
    for measure in ("30-100% of the link", "all of the link"):
        off, on = rows[measure, False], rows[measure, True]
        assert on["waited"] < 0.8 * off["waited"], (off, on)
        assert on["steady changes in 60"] <= off["steady changes in 60"]


def test_a_workers_wait_for_worker_0s_evaluation_is_not_counted_as_the_links():
    """Worker 0 evaluates between two of its steps and worker 1 waits for it: the table's
    wait counts that stall, the wait clear of evaluations does not; a wait elsewhere counts
    in both."""

    def it(step, end, iter_s, wait):
        return {"step": step, "t_epoch": end, "iter": iter_s, "net_wait": wait, "compute": iter_s - wait,
                "rounds": step, "density": 0.01}

    # worker 0: steps of 0.1 s; after step 10 it evaluates for 1 s
    w0 = [it(s, 0.1 * s + (1.0 if s > 10 else 0.0), 0.1, 0.0) for s in range(1, 31)]
    # worker 1: waits 1 s at step 11 (the stall) and 0.05 s at step 25 (the link)
    w1 = [it(s, 0.1 * s + (1.0 if s > 10 else 0.0) + (0.05 if s >= 25 else 0.0),
             0.1 + (1.0 if s == 11 else 0.05 if s == 25 else 0.0), 1.0 if s == 11 else 0.05 if s == 25 else 0.0)
          for s in range(1, 31)]
    ranks = [{"iters": w0, "evals": [{"step": 10, "wall": 1.0, "metric": 0.5}]}, {"iters": w1, "evals": []}]
    s = A.stats_of({"ranks": ranks, "reached": None})
    one = s["per_worker"][1]
    assert one["wait_share"] > 0.25  # the stall and the link
    assert 0.0 < one["link_wait_share"] < 0.03  # the link's 0.05 s alone
    assert s["per_worker"][0]["link_wait_share"] == 0.0
