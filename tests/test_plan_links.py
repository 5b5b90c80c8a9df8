"""Issue 47, links as they are: a server site whose link is shaped like the workers', shared by
every worker, full duplex. The structure the model must have (W pushes share the server's
downlink; the pushes in and the broadcast out overlap, so a round's link time is near the
busier direction's, not the sum), the vectorised search agreeing with ``predict`` on such
configurations, and the issue's measured rows as far as a stand-in profile reproduces them."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from tests.test_plan import profile_doc

from stella.planning.catalog import catalog_from_dict
from stella.planning.model import Config, Group, evaluate, mix_arrays, predict, prediction
from stella.planning.profile_file import Calibration, profile_from_dict


def catalog(worker_mbps: float, server_mbps: float, *, down_queue_ms: float = 0, cores: int = 1,
            server_down_mbps: float | None = None):
    return catalog_from_dict({
        "server": {"price": 0, "cores": cores, "up_mbps": server_mbps, "down_mbps": server_down_mbps or server_mbps},
        "kinds": {"site": {"gpu": "x", "speed": 1.0, "count": 8, "onprem": True, "up_mbps": worker_mbps,
                           "down_mbps": worker_mbps, "down_queue_ms": down_queue_ms}}}, "links")


def bare():
    """The toy profile, the bare structure (link x1, no jitter, no fixed overhead): the round's
    terms are the formulas themselves."""
    return dataclasses.replace(profile_from_dict(profile_doc()), calibration=Calibration())


def cfg(cat, w: int, d: float = 0.01, c: str = "f16", h: int = 1, s: int = 1) -> Config:
    return Config((Group(cat.kind("site"), "onprem", w),), d, c, h, s)


def test_every_workers_push_shares_the_server_sites_downlink():
    """W pushes of s bytes into a server site of R bytes/s take W s / R, whatever the workers'
    own links (here 100 times faster); the broadcast out of it likewise."""
    prof = bare()
    rate = 10e6 / 8
    for w in (1, 2, 4, 8):
        p = predict(prof, catalog(1000, 10), cfg(catalog(1000, 10), w))
        assert p.push_at == "server" and p.pull_at == "server"
        assert p.push_s == pytest.approx(w * prof.push_bytes(0.01, "f16") / rate, rel=1e-9)
        assert p.pull_s == pytest.approx(w * prof.pull_bytes(0.01) / rate, rel=1e-9)
    # S shards on hosts of one core: S hosts, each with its own link, share the load
    p4 = predict(prof, catalog(1000, 10), cfg(catalog(1000, 10), 4, s=2))
    assert p4.push_s == pytest.approx(2 * prof.push_bytes(0.01, "f16") / rate, rel=1e-9)


def test_the_server_links_two_directions_overlap_full_duplex():
    """Pushes arriving and the broadcast leaving on the server's link overlap: a round's link
    time is the busier direction's W messages plus one message the other way, not their sum.
    With many workers that is about the larger direction alone."""
    prof = bare()
    cat = catalog(1000, 10)
    rate = 10e6 / 8
    s, p_ = prof.push_bytes(0.01, "f16"), prof.pull_bytes(0.01)
    for w in (2, 3, 8):
        p = predict(prof, cat, cfg(cat, w))
        pipelined = max(w * s + p_, s + w * p_) / rate
        assert p.link_s == pytest.approx(pipelined, rel=1e-9)
        assert p.duplex_s == pytest.approx(p.push_s + p.pull_s - pipelined, rel=1e-9) and p.duplex_s > 0
        assert p.exchange_s == pytest.approx(p.compress_s + p.push_s + p.server_s + p.pull_s - p.duplex_s
                                             + p.tail_s + p.rtt_s + p.fixed_s)
    # W = 8: the busier direction (X) and one message the other way (at most X / W): about max, not the sum
    p8 = predict(prof, cat, cfg(cat, 8))
    x = max(p8.push_s, p8.pull_s)
    assert x <= p8.link_s <= x * (1 + 1 / 8) * (1 + 1e-12)
    assert p8.link_s < 0.6 * (p8.push_s + p8.pull_s)
    # one worker: nothing to overlap with (its pull, then its next push): the sum
    p1 = predict(prof, cat, cfg(cat, 1))
    assert p1.duplex_s == 0 and p1.link_s == pytest.approx(p1.push_s + p1.pull_s, rel=1e-9)


def test_a_fat_server_link_changes_nothing():
    """Where the server's link is not the bottleneck (the test bed's 1000 Mbit/s against the
    workers' 10-100, where the shipped fit was made) each worker's push and pull are serial on
    its own link, as before: no overlap, the sum."""
    prof = bare()
    for rate in (10, 30, 100):
        cat = catalog(rate, 1000)
        for w in (2, 4):
            p = predict(prof, cat, cfg(cat, w))
            assert p.duplex_s == 0 and p.push_at == "uplink" and p.pull_at == "downlink"
            assert p.link_s == pytest.approx(p.push_s + p.pull_s, rel=1e-9)


def test_the_search_agrees_with_predict_on_shaped_server_sites():
    """The vectorised evaluation over many mixes and settings gives each configuration what
    ``predict`` gives it, on server sites shaped like the workers' (the overlap included)."""
    prof = dataclasses.replace(bare(), calibration=Calibration(link=1.05, jitter=0.2, round_s=0.01, tail_loss=1.4))
    for server in (10, 30, 1000):
        cat = catalog(10, server, down_queue_ms=50)
        kind = cat.kind("site")
        mixes = [[Group(kind, "onprem", w)] for w in (1, 2, 3, 5, 8)]
        settings = [(d, c, h, s) for d in (0.003, 0.01, 0.03) for c in ("f16", "q2") for h in (1, 4) for s in (1, 2)]
        r = evaluate(prof, cat, mix_arrays(mixes, cat.hosts), settings)
        for i, m in enumerate(mixes):
            for j, (d, c, h, s) in enumerate(settings):
                one = predict(prof, cat, Config(tuple(m), d, c, h, s))
                sub = {k: np.asarray(a)[i:i + 1, j:j + 1] for k, a in r.items()}
                many = prediction(prof, one.config, sub, 0)
                assert many.s_per_it == pytest.approx(one.s_per_it, rel=1e-12)
                assert many.duplex_s == pytest.approx(one.duplex_s, rel=1e-12, abs=1e-15)
                assert many.link_s == pytest.approx(one.link_s, rel=1e-12)


def test_a_server_site_no_faster_than_the_workers_paces_the_broadcast_no_tail_loss():
    """A worker's downlink queue overflows (and the broadcast loses its tail) only where the
    server sends faster than that downlink drains: a server site shaped at the workers' rate
    paces the flight itself."""
    prof = dataclasses.replace(bare(), calibration=Calibration(tail_loss=1.5))
    # a pull inside the tail-loss window at 10 Mbit/s: over 1.3 x the queue (62.5 KB + the burst), one flight
    d = next(x for x in (0.003, 0.005, 0.01, 0.02) if 1.3 * 10e6 / 8 * 0.05 < prof.pull_bytes(x) <= 320 * 1024)
    fast = catalog(10, 1000, down_queue_ms=50)
    shaped = catalog(10, 10, down_queue_ms=50)
    assert predict(prof, fast, cfg(fast, 2, d=d)).tail_s > 0
    assert predict(prof, shaped, cfg(shaped, 2, d=d)).tail_s == 0


def test_bench_plans_runs_shape_the_server_site_and_a_held_out_workload_takes_the_shared_fit():
    """bench.plan's validation (issue 47): a run that shapes the server's site describes it so to
    the planner (the catalog's server link at the run's rate) and names it; a workload held out
    of the fit is predicted with the coefficients the fitted workloads share, saying so."""
    from bench.plan import PS_RATE, calibration_for, runs, testbed_catalog

    rs = {r.name: r for r in runs(quick=False)}
    shaped = [r for r in rs.values() if r.ps != PS_RATE]
    assert {r.role for r in shaped} == {"fit", "held-out"}
    held = [r for r in rs.values() if r.role == "held-out"]
    assert {r.workload for r in held} == {"bytelm"} and "bytelm" not in {r.workload for r in rs.values()
                                                                          if r.role == "fit"}
    r = rs["g4"]
    cat = testbed_catalog(r)[0]
    assert (cat.server.up_mbps, cat.server.down_mbps) == (10, 10) and "server 10 " in r.describe()
    assert testbed_catalog(rs["g1"])[0].server.up_mbps == PS_RATE and "server" not in rs["g1"].describe()
    # the shared coefficients, under the held-out workload's own profile
    fitted = Calibration(link=1.2, round_s=0.01, runs=5, source="bench.plan: 5 runs")
    cals = {"digits": fitted, "widemlp": fitted}
    assert calibration_for("widemlp", cals) is fitted
    lm = calibration_for("bytelm", cals)
    assert (lm.link, lm.round_s, lm.runs) == (1.2, 0.01, 5) and "other workloads than bytelm" in lm.source
    assert calibration_for("bytelm", {}) == Calibration()


def test_bench_plans_own_pick_is_the_plans_fastest_row_run_as_planned():
    """The plan's own pick (issue 47's third goal): bench.plan asks ``plan`` for the fastest
    configuration on the test bed as a user would describe it (up to 3 sites and the server's
    site at 100 Mbit/s, one stella-ps), and runs that configuration. The run must be the row:
    its own catalog predicts the same s/it, at most 3 workers, one shard, every round measured."""
    from bench.plan import PICK_MOST, PICK_RATE, own_pick, testbed_catalog

    prof = dataclasses.replace(profile_from_dict(profile_doc()),
                               calibration=Calibration(link=1.1, round_s=0.01, runs=4, source="test"))
    run, best = own_pick(prof, "bytelm", 30)
    assert run.role == "pick" and 1 <= run.world <= PICK_MOST and best.config.shards == 1
    assert run.up == run.down == run.ps == PICK_RATE
    assert (run.density, run.coding, run.h) == (best.config.density, best.config.coding, best.config.sync_every)
    assert run.steps >= 4 * run.h
    cat, cfg_ = testbed_catalog(run)
    assert predict(prof, cat, cfg_).s_per_it == pytest.approx(best.s_per_it, rel=1e-9)
