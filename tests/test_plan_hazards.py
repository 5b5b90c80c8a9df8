"""Issue 47's trip hazards for a new user of ``stella profile`` and ``stella plan``, one test
(or a few) each, in the order a user meets them:

1. the profile sets and records the torch thread count, and a spread of the step that the
   plan shows and widens its prediction by;
2. the plan says which fit it uses (the test bed's, attached by default; none; a file's);
3. ``stella plan --config`` predicts one configuration, term by term;
4. a kind's count may be a range, and alike kinds make no repeated rows;
5. shards are capped (``--max-shards``, ``[server] max_shards``, the server's host's cores);
6. the iterations factor of a configuration not in the table is never optimistic, and an
   unverified factor is flagged;
7. the header says how many were ranked and why the others were not; singular and plural.

Small synthetic profiles (``tests.test_plan.profile_doc``); no training runs but one tiny
profile of a 19k-parameter MLP."""
from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import tomllib
from tests.test_plan import GOOD, ROOT, profile_doc

from stella.cli import main
from stella.planning.catalog import CatalogError, catalog_from_dict
from stella.planning.model import Config, Group, predict, with_spread
from stella.planning.profile_file import TEST_BED_FIT, Calibration, profile_from_dict
from stella.planning.report import plural, render
from stella.planning.search import _mixes, plan, shard_cap

SPREAD = {"steps": 30, "median_s": 0.2, "q1_s": 0.18, "q3_s": 0.23, "stdev_s": 0.03, "min_s": 0.15, "max_s": 0.3}


def write(tmp_path, name: str, text_or_doc) -> str:
    path = tmp_path / name
    path.write_text(text_or_doc if isinstance(text_or_doc, str) else json.dumps(text_or_doc))
    return str(path)


def cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


# ------------------------------------------------------------------ 1. threads and the step's spread


def test_profile_sets_and_records_the_workers_thread_count_and_the_steps_spread(tmp_path, capsys):
    """`stella profile` times the step with torch's thread count set as the workers run it (1
    unless --threads says), records it and the quartiles of --steps timed steps, and leaves
    the caller's thread count as it found it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = tmp_path / "p.json"
        base = ["profile", "--model", "tests.test_plan:tiny_spec", "--out", str(out), "--no-server",
                "--broadcast-values", "f16", "--broadcast-factor", "1.5"]
        rc, _, err = cli(capsys, *base, "--steps", "8")
        assert rc == 0, err
        doc = json.loads(out.read_text())
        assert doc["torch_threads"] == 1 and "torch threads 1" in doc["device"]
        assert torch.get_num_threads() == 2  # put back
        sp = doc["compute_spread"]
        assert sp["steps"] == 8 and sp["q1_s"] <= sp["median_s"] == doc["compute_s"] <= sp["q3_s"]
        assert sp["min_s"] <= sp["q1_s"] and sp["q3_s"] <= sp["max_s"] and sp["stdev_s"] >= 0
        assert "quartiles" in err and "torch thread" in err
        assert cli(capsys, *base, "--steps", "6", "--threads", "2")[0] == 0
        assert json.loads(out.read_text())["torch_threads"] == 2
        with pytest.raises(SystemExit):  # too few steps for a spread
            main([*base, "--steps", "3"])
    finally:
        torch.set_num_threads(before)


def test_the_plan_shows_the_profiles_threads_and_spread_and_widens_its_prediction(tmp_path, capsys):
    doc = profile_doc(compute_spread=SPREAD, torch_threads=1, measured_at="2026-12-01 10:00 UTC")
    prof = profile_from_dict(doc)
    assert prof.compute_spread == (0.18, 0.23) and prof.threads == 1
    cat_path = write(tmp_path, "c.toml", GOOD)
    rc, text, _ = cli(capsys, "plan", "--catalog", cat_path, "--profile", write(tmp_path, "p.json", doc))
    assert rc == 0
    assert "quartiles 0.18-0.23 s over 30 steps, 1 torch thread, measured 2026-12-01 10:00 UTC" in text
    expected = next(ln for ln in text.splitlines() if ln.startswith("  expected:"))
    assert "with the profile's spread of the step:" in expected
    # the range is the model again at the quartiles: around the median's, wider than nothing
    res = plan(catalog_from_dict(tomllib.loads(GOOD), cat_path), prof)
    p = res.rows[0]
    assert p.s_per_it_range is not None and p.time_range is not None
    lo, hi = p.s_per_it_range
    assert lo <= p.s_per_it <= hi and lo < hi
    if p.bound == "compute":
        assert hi / lo == pytest.approx(0.23 / 0.18, rel=0.02)
    # a profile without them says so, and gets no range
    rc, text, _ = cli(capsys, "plan", "--catalog", cat_path, "--profile", write(tmp_path, "q.json", profile_doc()))
    assert "no spread measured" in text and "torch threads not recorded" in text
    assert "spread of the step" not in text


# ------------------------------------------------------------------ 2. which fit


def test_the_plan_says_which_fit_it_uses(tmp_path, capsys):
    """A profile with no calibration gets the test bed's fit, said so; --calibration none is
    the bare structure, and the plan says what to do; a file's fit (bench.plan's output) is
    named; a profile's own fit is kept."""
    cat = write(tmp_path, "c.toml", GOOD)
    bare = write(tmp_path, "p.json", profile_doc())
    rc, text, _ = cli(capsys, "plan", "--catalog", cat, "--profile", bare)
    assert rc == 0 and "model calibration: the test bed's fit from bench/RESULTS.md" in text
    assert "not fitted on this model's runs" in text
    rc, text, _ = cli(capsys, "plan", "--catalog", cat, "--profile", bare, "--calibration", "none")
    assert rc == 0 and "model calibration: not fitted (the bare structure)" in text
    assert "fit one on your own runs with stella calibrate" in text
    bench_json = os.path.join(ROOT, "bench", "PLAN.json")
    rc, text, _ = cli(capsys, "plan", "--catalog", cat, "--profile", bare, "--calibration", bench_json)
    assert rc == 0 and "model calibration: bench.plan 2026-11-26 23:37 UTC: 61 test-bed runs" in text
    own = profile_doc(calibration={"link": 1.2, "source": "my runs", "runs": 5})
    rc, text, _ = cli(capsys, "plan", "--catalog", cat, "--profile", write(tmp_path, "own.json", own))
    assert "model calibration: my runs" in text
    rc, _, err = cli(capsys, "plan", "--catalog", cat, "--profile", bare, "--calibration", str(tmp_path / "no.json"))
    assert rc == 2 and "cannot read the calibration" in err


def test_the_shipped_fit_is_the_test_beds_last_round():
    """TEST_BED_FIT is bench/PLAN14.json's calibration (rounds 13-14: the fit judged on a model
    outside it), copied into the product (which imports nothing from bench)."""
    with open(os.path.join(ROOT, "bench", "PLAN14.json")) as f:
        bench = json.load(f)["calibration"]
    for k in ("compute", "host_load", "exchange_stretch", "link", "round_s", "tail_loss", "jitter",
              "worker_round_s", "background", "runs", "exchange_runs"):
        assert getattr(TEST_BED_FIT, k) == pytest.approx(bench[k], rel=1e-3), k


# ------------------------------------------------------------------ 3. one configuration


def test_plan_config_predicts_one_configuration_term_by_term(tmp_path, capsys):
    slow = GOOD.replace("up_mbps = 1000\ndown_mbps = 1000", "up_mbps = 20\ndown_mbps = 20")  # the cloud's links
    assert slow != GOOD
    cat_path = write(tmp_path, "c.toml", slow)
    doc = profile_doc(compute_spread=SPREAD, torch_threads=1)
    prof_path = write(tmp_path, "p.json", doc)
    rc, text, err = cli(capsys, "plan", "--catalog", cat_path, "--profile", prof_path, "--config",
                        "W=2,kind=cloud,density=1%,coding=q4,H=2,shards=2", "--json", str(tmp_path / "one.json"))
    assert rc == 0, err
    for term in ("compute", "compress", "push", "server", "pull", "duplex", "tail loss", "rtt", "fixed", "exchange",
                 "overlap", "round"):
        assert any(ln.strip().startswith(term + " ") for ln in text.splitlines()), term
    assert "bound: " in text and "s/it: " in text and "time to target: " in text
    # the figures are stella.planning.model.predict's, with the test bed's fit attached
    cat = catalog_from_dict(tomllib.loads(slow), cat_path)
    prof = dataclasses.replace(profile_from_dict(doc), calibration=TEST_BED_FIT)
    cfg = Config((Group(cat.kind("cloud"), "ondemand", 2),), 0.01, "q4", 2, 2)
    p = with_spread(prof, cat, predict(prof, cat, cfg))
    assert f"s/it: {p.s_per_it:.4g}" in text and f"bound: {p.bound}" in text
    assert p.exchange_s == pytest.approx(p.compress_s + p.push_s + p.server_s + p.pull_s - p.duplex_s + p.tail_s
                                         + p.rtt_s + p.fixed_s)
    assert p.overlap_s == pytest.approx(p.compute_s + p.exchange_s - p.round_s)
    assert p.push_at == "uplink" and p.pull_at == "downlink"  # 20 Mbit/s sites, a 10 Gbit/s server
    one = json.loads((tmp_path / "one.json").read_text())
    assert one["s_per_it"] == pytest.approx(p.s_per_it) and one["config"]["shards"] == 2
    # the mix spelled out, a spot market, the one kind left implicit
    rc, text, _ = cli(capsys, "plan", "--catalog", cat_path, "--profile", prof_path, "--config",
                      "machines=1xlab+4xcloud:spot,density=0.003,coding=q2")
    assert rc == 0 and "1x lab + 4x cloud (spot)" in text and "H = 1, 1 shard " in text
    one_kind = write(tmp_path, "one.toml", GOOD.split("[kinds.cloud]")[0])
    assert cli(capsys, "plan", "--catalog", one_kind, "--profile", prof_path, "--config",
               "W=1,density=0.01,coding=f16")[0] == 0
    # beyond the factors table: the round's terms, and no estimate of the time (not inf, not nan)
    rc, text, _ = cli(capsys, "plan", "--catalog", cat_path, "--profile", prof_path, "--config",
                      "W=2,kind=cloud,density=0.0005,coding=q2,H=16")
    assert rc == 0 and "iterations: no estimate (beyond the factors table" in text
    assert "time to target, cost: no estimate" in text and "nan" not in text and "s/it: " in text


@pytest.mark.parametrize("config, message", [
    ("W=2,density=0.01,coding=f16", "the catalog has 2 kinds: say which, kind=NAME"),
    ("W=2,kind=cloud,coding=f16", "missing density="),
    ("W=2,kind=cloud,density=0.01,coding=q3", "coding='q3'"),
    ("W=9,kind=cloud,density=0.01,coding=f16", "9 of kind 'cloud': the catalog has 1 to 8"),
    ("W=1,kind=lab,market=spot,density=0.01,coding=f16", "kind 'lab' is not offered 'spot'"),
    ("W=2,kind=cloud,density=0.01,coding=f16,speed=2", "'speed=2' is not one of"),
    ("machines=2cloud,density=0.01,coding=f16", "is not COUNTxKIND[:MARKET]"),
])
def test_plan_config_errors(tmp_path, capsys, config, message):
    rc, _, err = cli(capsys, "plan", "--catalog", write(tmp_path, "c.toml", GOOD), "--profile",
                     write(tmp_path, "p.json", profile_doc()), "--config", config)
    assert rc == 2 and message in err, err


# ------------------------------------------------------------------ 4. counts as ranges, no repeated rows

LAB = """
[server]
price = 0
cores = 8
up_mbps = 1000
down_mbps = 1000
"""


def lab_kind(name: str, count: str = "1") -> str:
    return f"""
[kinds.{name}]
gpu = "cpu"
speed = 1.0
count = {count}
onprem = true
up_mbps = 100
down_mbps = 100
"""


def test_an_onprem_count_may_be_a_range(tmp_path):
    whole = catalog_from_dict(tomllib.loads(LAB + lab_kind("bed", "3")))
    assert [sum(g.count for g in m) for m in _mixes(whole)] == [3]  # all or none, as before
    for spelled in ('"1-3"', '"up to 3"'):
        cat = catalog_from_dict(tomllib.loads(LAB + lab_kind("bed", spelled)))
        assert (cat.kinds[0].min_count, cat.kinds[0].count) == (1, 3)
        assert [sum(g.count for g in m) for m in _mixes(cat)] == [1, 2, 3]
        res = plan(cat, profile_from_dict(profile_doc()))
        assert sorted(p.config.workers for p in res.rows) == [1, 2, 3]
    two = catalog_from_dict(tomllib.loads(LAB + lab_kind("bed", '"2-3"')))
    assert [sum(g.count for g in m) for m in _mixes(two)] == [2, 3]
    for bad, msg in (('"3-1"', "must be 1 <= fewest <= most"), ('"a few"', "field 'count' must be int"),
                     ('"0-2"', "must be 1 <= fewest <= most")):
        with pytest.raises(CatalogError, match=msg):
            catalog_from_dict(tomllib.loads(LAB + lab_kind("bed", bad)), "c.toml")


def test_alike_kinds_make_no_repeated_rows():
    """Three on-premises kinds alike but for their names (one machine each): W = 1, 2, 3 once
    each, not every subset of the three (7 rows, 3 of them W = 1 and alike)."""
    cat = catalog_from_dict(tomllib.loads(LAB + lab_kind("a") + lab_kind("b") + lab_kind("c")))
    res = plan(cat, profile_from_dict(profile_doc()))
    assert sorted(p.config.workers for p in res.rows) == [1, 2, 3]
    keys = [(p.config.workers, p.config.density, p.config.coding, p.config.sync_every, p.config.shards,
             round(p.s_per_it, 12)) for p in res.rows]
    assert len(set(keys)) == len(keys)
    # a kind that differs (a slower link) is not merged
    slow = LAB + lab_kind("a") + lab_kind("b").replace("up_mbps = 100", "up_mbps = 10")
    assert len(_mixes(catalog_from_dict(tomllib.loads(slow)))) == 3


# ------------------------------------------------------------------ 5. shards capped


def server_bound_profile():
    """A tiny step beside a server's pass over 10M coordinates: more shards always look faster."""
    return profile_from_dict(profile_doc(compute_s=0.001))


def test_shards_never_exceed_the_cap(tmp_path, capsys):
    prof = server_bound_profile()
    doc = tomllib.loads(GOOD)
    doc["server"]["cores"] = 8
    free = plan(catalog_from_dict(doc), prof)
    assert max(p.config.shards for p in free.rows) == 8  # uncapped (a rented host, 8 cores): 8 shards win
    # the server on a shared host of 2 cores (the test bed): at most 2 stella-ps processes
    bed = dict(doc, hosts={"bed": {"cores": 2}}, server=dict(doc["server"], host="bed"))
    res = plan(catalog_from_dict(bed), prof)
    assert res.shard_cap[0] == 2 and max(p.config.shards for p in res.rows) == 2
    assert "shards: at most 2 (the server's host 'bed' has 2 cores)" in render(res)
    # a server host of one's own (price 0) is one host: its cores
    own = dict(doc, server=dict(doc["server"], price=0, cores=2))
    assert max(p.config.shards for p in plan(catalog_from_dict(own), prof).rows) <= 2
    # ... and on a shared host, that host's cores (not [server] cores, whose default is 1)
    bed0 = dict(bed, server=dict(bed["server"], price=0, cores=1))
    assert shard_cap(catalog_from_dict(bed0)) == (2, "the server's host 'bed' has 2 cores")
    # [server] max_shards, and --max-shards (a cap not in 1, 2, 4, 8 is tried itself)
    capped = dict(doc, server=dict(doc["server"], max_shards=3))
    res = plan(catalog_from_dict(capped), prof)
    assert max(p.config.shards for p in res.rows) == 3
    assert shard_cap(catalog_from_dict(capped), 1) == (1, "--max-shards")
    prof_path = write(tmp_path, "p.json", profile_doc(compute_s=0.001))
    rc, text, _ = cli(capsys, "plan", "--catalog", write(tmp_path, "c.toml", GOOD), "--profile", prof_path,
                      "--max-shards", "1", "--json", str(tmp_path / "o.json"))
    assert rc == 0 and "shards: at most 1 (--max-shards)" in text and "stella-ps --shard" not in text
    assert {r["config"]["shards"] for r in json.loads((tmp_path / "o.json").read_text())["rows"]} == {1}
    with pytest.raises(CatalogError, match="'max_shards' must be > 0"):
        catalog_from_dict(dict(doc, server=dict(doc["server"], max_shards=0)))


# ------------------------------------------------------------------ 6. factors: conservative, flagged


def test_a_missing_factor_is_never_optimistic():
    """Entries at H = 1 say nothing of H = 4: a configuration no entry is at least as harsh as
    is not considered (it took the nearest entry's x1.10 before); between entries, the bound
    (the harsher entries' smallest factor), not the midpoint; a table that breaks monotonicity
    gives the larger."""
    one = profile_from_dict(profile_doc(factors=[{"density": 0.005, "coding": "q2", "H": 1, "factor": 1.1}]))
    f, src = one.factor(0.03, "q2", 4)
    assert f == math.inf and "beyond the factors table" in src
    assert one.factor(0.03, "q2", 1)[0] == 1.1 and "at most" in one.factor(0.03, "q2", 1)[1]
    assert one.factor(0.03, "f16", 1)[0] == 1.1
    assert one.factor(0.001, "q2", 1)[0] == math.inf  # a lower density than measured
    prof = profile_from_dict(profile_doc())  # 1% f16 x1.1, 1% q2 x1.2, 0.1% q2 H=8 x1.6
    assert prof.factor(0.003, "q2", 4)[0] == pytest.approx(1.6)
    odd = profile_from_dict(profile_doc(factors=[{"density": 0.01, "coding": "f16", "H": 1, "factor": 1.5},
                                                 {"density": 0.001, "coding": "q2", "H": 8, "factor": 1.2}]))
    f, src = odd.factor(0.003, "q4", 2)
    assert f == 1.5 and "not monotone" in src
    assert prof.factor_measured(0.01, "f16", 1) and not prof.factor_measured(0.003, "q2", 4)


def test_with_no_table_the_pick_is_not_the_harshest_setting_and_its_factor_is_flagged(tmp_path, capsys):
    """No factors table: the plan assumes x1.00 only at 1% f16 H = 1 (unverified) and considers
    nothing harsher, so its pick is not 0.1% f16 H = 8; the pick's line and the table flag it."""
    doc = profile_doc(factors=[])
    prof = profile_from_dict(doc)
    res = plan(catalog_from_dict(tomllib.loads(GOOD)), prof)
    for p in res.rows:
        c = p.config
        assert c.density >= 0.01 and c.coding == "f16" and c.sync_every == 1 and p.factor == 1.0
        assert not p.factor_measured
    assert res.no_estimate > 0
    rc, text, _ = cli(capsys, "plan", "--catalog", write(tmp_path, "c.toml", GOOD), "--profile",
                      write(tmp_path, "p.json", doc))
    assert rc == 0
    expected = next(ln for ln in text.splitlines() if ln.startswith("  expected:"))
    assert "UNVERIFIED factor" in expected and "no factors table" in expected
    assert "* iterations factor not measured at that setting" in text
    # a measured entry is not flagged (one kind: no run-on, whose faster machines make more local steps than H)
    cloud_only = GOOD.split("[kinds.lab]")[0] + "[kinds.cloud]" + GOOD.split("[kinds.cloud]")[1]
    measured = plan(catalog_from_dict(tomllib.loads(cloud_only)), profile_from_dict(profile_doc(
        factors=[{"density": d, "coding": c, "H": h, "factor": 1.0} for d in (0.001, 0.003, 0.01, 0.03, 0.1)
                 for c in ("f16", "q4", "q2") for h in (1, 2, 4, 8)])))
    assert all(p.factor_measured for p in measured.rows)
    assert "UNVERIFIED" not in render(measured) and "* iterations factor" not in render(measured)


# ------------------------------------------------------------------ 7. wording


H1 = [{"density": 0.01, "coding": "f16", "H": 1, "factor": 1.1}, {"density": 0.003, "coding": "q2", "H": 1,
                                                                   "factor": 1.3}]  # nothing said of H > 1


def test_the_header_says_what_was_ranked_and_why_the_rest_was_not(tmp_path, capsys):
    cat_path = write(tmp_path, "c.toml", GOOD)
    prof_path = write(tmp_path, "p.json", profile_doc(factors=H1))
    rc, text, _ = cli(capsys, "plan", "--catalog", cat_path, "--profile", prof_path, "--calibration", "none")
    assert rc == 0 and "within no constraint" not in text
    res = plan(catalog_from_dict(tomllib.loads(GOOD), cat_path), profile_from_dict(profile_doc(factors=H1)))
    assert res.no_estimate > 0
    assert res.feasible + res.no_estimate + res.unstable == res.considered
    assert (f"{res.considered:,} configurations evaluated in" in text
            and f": {res.feasible:,} ranked by time (no deadline or budget given); not ranked: "
                f"{res.no_estimate:,} beyond the factors table" in text)
    fastest = res.rows[0].time_s
    res = plan(catalog_from_dict(tomllib.loads(GOOD), cat_path), profile_from_dict(profile_doc(factors=H1)),
               deadline_s=fastest * 1.5, budget=res.rows[0].cost * 0.9)
    assert res.feasible + res.no_estimate + res.unstable + res.over_deadline + res.over_budget == res.considered
    assert res.over_deadline > 0 and res.over_budget > 0
    head = render(res)
    assert "miss the deadline" in head and "over the budget" in head and "ranked by cost" in head


def test_one_configuration_is_singular():
    assert plural(1, "configuration") == "1 configuration" and plural(1680, "configuration") == "1,680 configurations"
    cat = catalog_from_dict(tomllib.loads(LAB + lab_kind("bed")))
    res = plan(cat, profile_from_dict(profile_doc()), densities=(0.01,), codings=("f16",), sync_every=(1,),
               shards=(1,))
    text = render(res)
    assert len(res.pareto) == 1 and "Pareto front (time against cost): 1 configuration" in text
    assert "1 configurations" not in text
    assert "1 configuration evaluated in" in text


def test_calibration_of_a_profile_is_kept_and_bare_is_said():
    assert not Calibration().fitted and TEST_BED_FIT.fitted
    assert Calibration(source="bench.plan: 3 runs", runs=3).fitted
