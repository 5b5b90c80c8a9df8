"""``stella plan`` and ``stella profile``: the catalog's schema check, the model's sanity
(monotone in what it should be, compute-bound where the links are fast), the revocation
arithmetic, the ranking under a deadline and a budget, the CLI's speed on 10 kinds
without torch, the least-squares fit, and a profile of a tiny model against a real
``stella-ps``."""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import subprocess
import sys

import pytest
import tomllib

from stella.codec import coordinate_bits
from stella.planning.calibrate import Observation, fit_many
from stella.planning.catalog import SERVER_RESTART_S, Catalog, CatalogError, PlanError, catalog_from_dict, load_catalog
from stella.planning.model import START_S, TAIL_FLIGHT_BYTES, TAIL_OVERFLOW, Config, Group, expected_max, predict
from stella.planning.profile_file import STALL_S, Calibration, Profile, ProfileError, load_profile, profile_from_dict
from stella.planning.report import parse_duration, render
from stella.planning.search import plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "docs", "catalog.example.toml")
N = 10_000_000

GOOD = """
currency = "USD"
prices_note = "illustrative"

[server]
price = 0.5
cores = 4
up_mbps = 10000
down_mbps = 10000

[kinds.lab]
gpu = "RTX 4090"
gpus = 2
speed = 1.0
onprem = true
count = 1
up_mbps = 100
down_mbps = 100

[kinds.cloud]
gpu = "A100"
speed = 1.5
count = 8
price = 3.0
spot_price = 1.0
mttr_h = 4
up_mbps = 1000
down_mbps = 1000
"""


def profile_doc(**over) -> dict:
    def pb(d, c):
        return N * d * coordinate_bits(d, c) / 8 + 2000

    doc = {"stella_profile": 1, "model": "toy", "numel": N, "sparse_numel": N, "batch_size": 32, "compute_s": 0.2,
           "compress_s_per_numel": 1e-9,
           "push": [{"density": d, "coding": c, "bytes": pb(d, c)} for d in (0.003, 0.01, 0.03)
                    for c in ("f16", "q4", "q2")],
           "pull": {"factor": 2.0, "values": "q4",
                    "bytes": [{"density": d, "bytes": pb(min(1, 2 * d), "q4")} for d in (0.003, 0.01, 0.03)]},
           "server": {"per_update_s": 57e-9, "per_numel_s": 4.7e-9},
           "target": {"dense_iterations": 10_000, "global_batch": 64, "critical_batch": 0, "source": "test"},
           "factors": [{"density": 0.01, "coding": "f16", "H": 1, "factor": 1.1, "source": "t1"},
                       {"density": 0.01, "coding": "q2", "H": 1, "factor": 1.2, "source": "t2"},
                       {"density": 0.001, "coding": "q2", "H": 8, "factor": 1.6, "source": "t3"}]}
    doc.update(over)
    return doc


@pytest.fixture
def catalog(tmp_path) -> Catalog:
    path = tmp_path / "c.toml"
    path.write_text(GOOD)
    return load_catalog(str(path))


@pytest.fixture
def profile() -> Profile:
    return profile_from_dict(profile_doc())


# ------------------------------------------------------------------ the catalog


@pytest.mark.parametrize("edit, message", [
    (("price = 3.0", "prise = 3.0"), "kind 'cloud': unknown field 'prise' (did you mean 'price'?)"),
    (("speed = 1.5\n", ""), "kind 'cloud': missing field 'speed'"),
    (("count = 8", 'count = "8"'), "kind 'cloud': field 'count' must be int, got '8'"),
    (("count = 8", "count = 0"), "kind 'cloud': field 'count' must be > 0, got 0"),
    (("up_mbps = 1000\n", "up_mbps = -5\n"), "kind 'cloud': field 'up_mbps' must be > 0, got -5"),
    (("onprem = true", "onprem = true\nprice = 2.0"), "kind 'lab': field 'price' must be 0 for an on-premises kind"),
    (("onprem = true", "onprem = true\nspot_price = 1.0"), "kind 'lab': field 'spot_price' is for cloud kinds"),
    (("mttr_h = 4\n", ""), "kind 'cloud': fields 'spot_price' and 'mttr_h' go together"),
    (("price = 3.0\n", ""), "kind 'cloud': missing field 'price'"),
    (("[server]", "[serve]"), "unknown field 'serve' (did you mean 'server'?)"),
    (("gpus = 2", "gpus = 2.5"), "kind 'lab': field 'gpus' must be int, got 2.5"),
    (("onprem = true", "onprem = 1"), "kind 'lab': field 'onprem' must be bool, got 1"),
    (("cores = 4", "cores = 4\ncpus = 3"), "[server]: unknown field 'cpus'"),
    (("currency", "currency = = "), "not valid TOML"),
])
def test_catalog_errors_name_the_file_kind_and_field(tmp_path, edit, message):
    path = tmp_path / "bad.toml"
    path.write_text(GOOD.replace(*edit, 1))
    with pytest.raises(CatalogError) as e:
        load_catalog(str(path))
    assert str(e.value).startswith(str(path)), e.value
    assert message in str(e.value), e.value


def test_catalog_missing_parts(tmp_path):
    with pytest.raises(CatalogError, match="cannot read the catalog"):
        load_catalog(str(tmp_path / "nope.toml"))
    for text, msg in (("[kinds.a]\ngpu='x'\n", "missing table [server]"),
                      ("[server]\nprice=1\nup_mbps=1\ndown_mbps=1\n", "no machine kinds")):
        (tmp_path / "x.toml").write_text(text)
        with pytest.raises(CatalogError, match=msg.replace("[", r"\[")):
            load_catalog(str(tmp_path / "x.toml"))


def test_example_catalog_loads_and_says_its_prices_are_illustrative():
    cat = load_catalog(EXAMPLE)
    assert "ILLUSTRATIVE" in cat.prices_note
    assert any(k.onprem and k.price == 0 for k in cat.kinds)
    assert any(k.spot_price is not None and k.mttr_h for k in cat.kinds)
    with open(EXAMPLE) as f:
        assert "ILLUSTRATIVE PRICES ONLY" in f.read()


def test_profile_errors():
    with pytest.raises(ProfileError, match="not a Stella profile"):
        profile_from_dict({"model": "x"}, "p.json")
    doc = profile_doc()
    del doc["compute_s"]
    with pytest.raises(ProfileError, match=r"p\.json: missing field 'compute_s'"):
        profile_from_dict(doc, "p.json")
    with pytest.raises(ProfileError, match="coding 'q3'"):
        profile_from_dict(profile_doc(push=[{"density": 0.01, "coding": "q3", "bytes": 1}]), "p.json")


def test_a_profile_says_the_broadcast_it_was_measured_under():
    """The broadcast's factor and coding are the server's settings: a profile without them is
    refused with the fix, not given a default; exact pulls are the pushed coordinates in f32."""
    doc = profile_doc()
    del doc["pull"]["factor"]
    with pytest.raises(ProfileError, match=r"p\.json: pull: missing field 'factor'.*write the profile again with "
                       "stella profile"):
        profile_from_dict(doc, "p.json")
    with pytest.raises(ProfileError, match="coding 'q3'"):
        profile_from_dict(profile_doc(pull={**profile_doc()["pull"], "values": "q3"}), "p.json")
    f16 = profile_from_dict(profile_doc(pull={**profile_doc()["pull"], "values": "f16", "factor": 1.0}))
    assert (f16.pull_values, f16.pull_factor) == ("f16", 1.0)
    exact = profile_from_dict(profile_doc(pull={"mode": "exact", "bytes": [{"density": 0.01, "bytes": 1e6}]}))
    assert (exact.pull_values, exact.pull_factor) == ("f32", 1.0)
    assert exact.pull_bytes(0.01) == pytest.approx(1e6)
    assert exact.pull_bytes(0.02) == pytest.approx(1e6 * 0.02 * coordinate_bits(0.02, "f32")
                                                   / (0.01 * coordinate_bits(0.01, "f32")))


def test_the_planner_is_a_stack_the_library_does_not_import():
    """stella.planning's modules import only those below them (catalog <- profile_file <- model
    <- search <- report; measure beside, on profile_file; calibrate beside report, on search), no
    library module but the command line imports the planner, and no product code imports the
    benchmarks."""
    import ast

    client = os.path.join(ROOT, "client", "stella")
    stack = ["catalog", "profile_file", "model", "search", "report"]

    def imported(path: str) -> set[str]:
        with open(path) as f:
            tree = ast.parse(f.read())
        out = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                out.add(("." * node.level) + (node.module or ""))
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
        return out

    allowed = {m: set(stack[:i]) for i, m in enumerate(stack)} | {"measure": {"catalog", "profile_file"},
                                                                   "calibrate": set(stack[:4])}
    for name in sorted(os.listdir(os.path.join(client, "planning"))):
        if name.endswith(".py") and name != "__init__.py":
            mods = imported(os.path.join(client, "planning", name))
            own = {m[1:] for m in mods if m.startswith(".") and not m.startswith("..")}
            assert own <= allowed[name[:-3]], (name, own)
    for dirpath, _, names in os.walk(client):
        for name in names:
            if not name.endswith(".py"):
                continue
            mods = imported(os.path.join(dirpath, name))
            assert not any(m.split(".")[0] == "bench" for m in mods), (dirpath, name)
            if os.path.basename(dirpath) != "planning" and name != "cli.py":
                assert not any("planning" in m for m in mods), (dirpath, name)


# ------------------------------------------------------------------ the model


def config(cat: Catalog, *groups: tuple[str, str, int], d=0.01, c="f16", h=1, s=1) -> Config:
    return Config(tuple(Group(cat.kind(k), m, n) for k, m, n in groups), d, c, h, s)


def with_links(cat: Catalog, name: str, up: float, down: float | None = None) -> Catalog:
    kinds = tuple(dataclasses.replace(k, up_mbps=up, down_mbps=down or up) if k.name == name else k
                  for k in cat.kinds)
    return dataclasses.replace(cat, kinds=kinds)


def test_compute_bound_on_fast_links_and_link_bound_on_slow_ones(catalog, profile):
    fast = predict(profile, catalog, config(catalog, ("cloud", "ondemand", 2)))
    assert fast.bound == "compute"
    assert fast.s_per_it == pytest.approx(0.2 / 1.5)
    slow_cat = with_links(catalog, "cloud", 1)
    slow = predict(profile, slow_cat, config(slow_cat, ("cloud", "ondemand", 2)))
    assert slow.bound in ("push", "pull")
    assert slow.s_per_it > 5 * fast.s_per_it
    # the push over 1 Mbit/s: its bytes over the rate
    assert slow.link_s >= profile.push_bytes(0.01, "f16") / (1e6 / 8)


def test_monotone_in_links_density_coding_speed_and_shards(catalog, profile):
    prev = math.inf
    for rate in (1, 3, 10, 30, 100, 1000):
        cat = with_links(catalog, "cloud", rate)
        p = predict(profile, cat, config(cat, ("cloud", "ondemand", 4)))
        assert p.s_per_it <= prev + 1e-12
        prev = p.s_per_it
    cat = with_links(catalog, "cloud", 5)
    s = [predict(profile, cat, config(cat, ("cloud", "ondemand", 2), d=d)).s_per_it for d in (0.003, 0.01, 0.03)]
    assert s == sorted(s) and s[0] < s[-1]
    codings = [predict(profile, cat, config(cat, ("cloud", "ondemand", 2), c=c)).link_s for c in ("f16", "q4", "q2")]
    assert codings == sorted(codings, reverse=True)
    # H local steps: the same exchange per round spread over H steps
    h1, h16 = (predict(profile, cat, config(cat, ("cloud", "ondemand", 2), h=h)) for h in (1, 16))
    assert h16.s_per_it < h1.s_per_it and h16.round_s > h1.round_s
    # a slower GPU never makes it faster; more shards never make the server slower
    slow = dataclasses.replace(catalog, kinds=tuple(dataclasses.replace(k, speed=0.5) for k in catalog.kinds))
    assert predict(profile, slow, config(slow, ("cloud", "ondemand", 2))).s_per_it > \
        predict(profile, catalog, config(catalog, ("cloud", "ondemand", 2))).s_per_it
    servers = [predict(profile, catalog, config(catalog, ("cloud", "ondemand", 8), s=s)).server_s for s in (1, 2, 4)]
    assert servers == sorted(servers, reverse=True)
    # bytes: linear in the coded bits, as measured
    assert profile.push_bytes(0.01, "f16") == pytest.approx(N * 0.01 * coordinate_bits(0.01, "f16") / 8 + 2000)


def test_unequal_speeds_run_on(catalog, profile):
    """A lab of speed 1 beside cloud machines of speed 1.5: the round is the lab's H
    steps, the cloud machines make more local steps in it, and the job's samples/s is
    more than either part's."""
    both = predict(profile, catalog, config(catalog, ("lab", "onprem", 1), ("cloud", "ondemand", 2), h=2))
    assert both.round_s == pytest.approx(2 * 0.2)
    assert both.max_sync_every == 3  # ceil(2 x 1.5)
    lab = predict(profile, catalog, config(catalog, ("lab", "onprem", 1), h=2))
    cloud = predict(profile, catalog, config(catalog, ("cloud", "ondemand", 2), h=2))
    assert both.samples_per_s == pytest.approx(lab.samples_per_s + cloud.samples_per_s, rel=0.2)
    assert both.samples_per_s > max(lab.samples_per_s, cloud.samples_per_s)


def test_iterations_factor_table(profile):
    assert profile.factor(0.01, "f16", 1) == (1.1, "t1")
    f, src = profile.factor(0.003, "q2", 4)  # between 1%/q2/1 (1.2) and 0.1%/q2/8 (1.6): the bound, not the middle
    assert f == pytest.approx(1.6) and "at most" in src
    f, src = profile.factor(0.1, "f16", 1)  # milder than every entry: the harsher one bounds it
    assert f == 1.1 and "at most" in src
    f, src = profile.factor(0.0005, "q2", 16)  # harsher than everything measured
    assert f == math.inf and "not considered" in src
    # no table: x1.00 at 1% f16 H = 1, assumed, and nothing harsher (tests/test_plan_hazards.py)
    assert profile_from_dict(profile_doc(factors=[])).factor(0.01, "f16", 1)[0] == 1.0


def test_iterations_factor_by_the_number_of_workers(catalog):
    """Entries measured at a number of workers: more workers is harsher (issue 43: the
    iterations grow with W), so an entry at W = 8 bounds W = 4 from above and nothing bounds
    W = 16; an entry that does not say its workers stands for any number, after one at the
    very workers. The plan's rows take the factor of their own number of machines."""
    doc = profile_doc(factors=[{"density": 0.01, "coding": "f16", "H": 1, "factor": 1.0, "workers": 2,
                                "source": "w2"},
                               {"density": 0.01, "coding": "f16", "H": 1, "factor": 1.3, "workers": 8,
                                "source": "w8"}])
    prof = profile_from_dict(doc)
    assert prof.factor(0.01, "f16", 1, 2) == (1.0, "w2") and prof.factor(0.01, "f16", 1, 8) == (1.3, "w8")
    f, src = prof.factor(0.01, "f16", 1, 4)
    assert f == 1.3 and "at most" in src and "W=8" in src and not prof.factor_measured(0.01, "f16", 1, 4)
    f, src = prof.factor(0.01, "f16", 1, 16)
    assert f == math.inf and "more workers" in src
    assert prof.factor(0.03, "f16", 1, 2)[0] == 1.0  # milder on density: the W = 2 entry bounds it
    two = predict(prof, catalog, config(catalog, ("cloud", "ondemand", 2)))
    four = predict(prof, catalog, config(catalog, ("cloud", "ondemand", 4)))
    assert (two.factor, two.factor_measured, four.factor, four.factor_measured) == (1.0, True, 1.3, False)
    assert four.iterations == pytest.approx(10_000 * 1.3) and "W=8" in four.factor_source
    anyw = profile_from_dict(profile_doc(factors=[*doc["factors"], {"density": 0.01, "coding": "f16", "H": 1,
                                                                    "factor": 1.1, "source": "any"}]))
    assert anyw.factor(0.01, "f16", 1, 16) == (1.1, "any") and anyw.factor(0.01, "f16", 1, 8) == (1.3, "w8")
    with pytest.raises(ProfileError, match="workers"):
        profile_from_dict(profile_doc(factors=[{"density": 0.01, "coding": "f16", "H": 1, "factor": 1.0,
                                                "workers": 0}]))


def test_time_to_target_and_critical_batch(catalog, profile):
    p = predict(profile, catalog, config(catalog, ("cloud", "ondemand", 2)))
    assert p.iterations == pytest.approx(10_000 * 1.1)
    assert p.time_s == pytest.approx(p.iterations * p.s_per_it)
    # with a critical batch, a larger global batch needs fewer iterations: 1 + B_crit / B
    crit = profile_from_dict(profile_doc(target={"dense_iterations": 10_000, "global_batch": 64,
                                                   "critical_batch": 640}))
    q = predict(crit, catalog, config(catalog, ("cloud", "ondemand", 4)))  # batch 128
    assert q.iterations == pytest.approx(10_000 * 1.1 * (1 + 640 / 128) / (1 + 640 / 64))


def test_revocation_arithmetic(catalog, profile):
    on = predict(profile, catalog, config(catalog, ("cloud", "ondemand", 4)))
    assert on.revocations == 0 and on.revocation_cost == 0
    assert on.cost == pytest.approx((4 * 3.0 + 0.5) * on.time_s / 3600)
    lam = 4 / (4 * 3600)  # revocations per second
    lost = (1 / 2 + 1 / (0.01 * 4)) * on.s_per_it  # half a round and the residual's steps
    # iterations that do not depend on the batch (critical batch 0): a lost machine costs the stall and its work
    spot0 = predict(profile, catalog, config(catalog, ("cloud", "spot", 4)))
    assert spot0.time_s == pytest.approx(on.time_s / (1 - lam * (STALL_S + lost / 4)))
    # iterations that scale with 1/B: also its share of the samples while its replacement starts
    crit = profile_from_dict(profile_doc(target={"dense_iterations": 10_000, "global_batch": 64,
                                                   "critical_batch": 1e15}))
    on = predict(crit, catalog, config(catalog, ("cloud", "ondemand", 4)))
    spot = predict(crit, catalog, config(catalog, ("cloud", "spot", 4)))
    share = 1 / 4
    rejoin = N * 4 / (1000e6 / 8) + START_S
    loss = STALL_S + share * (300 + rejoin) + share * lost
    t = on.time_s / (1 - lam * loss)
    assert spot.time_s == pytest.approx(t)
    assert spot.revocations == pytest.approx(lam * t)
    cost = (4 * 1.0 + 0.5) * t / 3600 + lam * 1.0 * 300 / 3600 * t
    assert spot.cost == pytest.approx(cost)
    assert spot.revocation_cost == pytest.approx(cost - (4 * 1.0 + 0.5) * on.time_s / 3600)
    # revoked more often: a larger share of the cost
    often = dataclasses.replace(catalog, kinds=tuple(dataclasses.replace(k, mttr_h=0.5) for k in catalog.kinds))
    p2 = predict(crit, often, config(often, ("cloud", "spot", 4)))
    assert p2.revocation_cost / p2.cost > spot.revocation_cost / spot.cost
    # a server that fails: its restart and half a checkpoint interval of steps
    srv = dataclasses.replace(catalog, server=dataclasses.replace(catalog.server, mttr_h=1.0))
    p3 = predict(crit, srv, config(srv, ("cloud", "ondemand", 4)), checkpoint_every=100)
    lam_s = 1 / 3600
    assert p3.time_s == pytest.approx(on.time_s / (1 - lam_s * (SERVER_RESTART_S + 50 * on.s_per_it)))


# ------------------------------------------------------------------ planning


def test_plan_ranks_by_cost_under_a_deadline_and_by_time_under_a_budget(catalog, profile):
    free = plan(catalog, profile)
    fastest = free.rows[0].time_s
    deadline = fastest * 3
    res = plan(catalog, profile, deadline_s=deadline)
    assert res.rows and res.objective == "cost"
    assert all(p.time_s <= deadline for p in res.rows)
    assert [p.cost for p in res.rows] == sorted(p.cost for p in res.rows)
    assert res.rows[0].cost <= min(p.cost for p in free.rows)
    budget = res.rows[0].cost * 1.5
    res2 = plan(catalog, profile, budget=budget)
    assert res2.objective == "time" and all(p.cost <= budget for p in res2.rows)
    assert [p.time_s for p in res2.rows] == sorted(p.time_s for p in res2.rows)
    both = plan(catalog, profile, deadline_s=deadline, budget=budget)
    assert all(p.time_s <= deadline and p.cost <= budget for p in both.rows)
    # the Pareto front: faster is dearer, and no ranked row beats it on both
    fr = res.pareto
    assert all(a.time_s <= b.time_s and a.cost > b.cost for a, b in itertools.pairwise(fr))
    for p in res.rows:
        assert any(f.time_s <= p.time_s * (1 + 1e-9) and f.cost <= p.cost * (1 + 1e-9) for f in fr)
    none = plan(catalog, profile, deadline_s=1.0)
    assert not none.rows and none.feasible == 0 and none.pareto
    assert "no configuration meets" in render(none)
    text = render(res)
    assert "recommended:" in text and "StellaOptimizer" in text and "stella-ps --workers" in text


def test_parse_duration():
    assert parse_duration("12h") == 12 * 3600
    assert parse_duration("1h30m") == 5400
    assert parse_duration("90m") == 5400
    assert parse_duration("2d") == 2 * 86400
    assert parse_duration("1.5") == 5400
    with pytest.raises(PlanError, match="cannot read the duration"):
        parse_duration("soon")


def test_cli_plans_ten_kinds_without_torch(tmp_path):
    """`stella plan` on a 10-kind catalog enumerates over a million configurations and
    never imports torch (its speed, < 2 s, is measured by `python -m bench.plan`)."""
    from bench.plan import ten_kind_catalog

    ten_kind_catalog(str(tmp_path / "ten.toml"))
    (tmp_path / "p.json").write_text(json.dumps(profile_doc()))
    code = ("import sys; from stella.cli import main; "
            f"rc = main(['plan', '--catalog', {str(tmp_path / 'ten.toml')!r}, '--profile', "
            f"{str(tmp_path / 'p.json')!r}, '--deadline', '12h', '--json', {str(tmp_path / 'o.json')!r}]); "
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH'); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "NO-TORCH" in out.stdout
    doc = json.loads((tmp_path / "o.json").read_text())
    assert doc["considered"] > 1_000_000 and doc["rows"]


def test_cli_reports_catalog_errors(tmp_path, capsys):
    from stella.cli import main

    (tmp_path / "c.toml").write_text(GOOD.replace("speed = 1.5", "speed = 'fast'"))
    (tmp_path / "p.json").write_text(json.dumps(profile_doc()))
    assert main(["plan", "--catalog", str(tmp_path / "c.toml"), "--profile", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "c.toml: kind 'cloud': field 'speed' must be int or float, got 'fast'" in err


def test_fit_recovers_known_coefficients(catalog, profile):
    """Runs predicted with known coefficients, some on a shared host of 2 cores (the server
    there too), some on hosts of their own: the fit finds the coefficients again."""
    truth = Calibration(compute=1.3, host_load=0.85, exchange_stretch=0.4, link=1.1, round_s=0.02, tail_loss=1.2,
                          jitter=0.25, worker_round_s=0.003)
    fitted_profile = dataclasses.replace(profile, calibration=truth)
    obs = []
    runs = ((2, 100, 0.01, 1.5, 1, ""), (3, 20, 0.01, 1.0, 2, "bed"), (4, 50, 0.03, 0.7, 1, "bed"),
            (2, 10, 0.003, 1.5, 4, ""), (3, 200, 0.01, 2.0, 1, "bed"), (2, 30, 0.03, 1.0, 1, ""),
            (3, 5, 0.01, 2.0, 1, "bed"), (4, 8, 0.03, 1.0, 2, "bed"), (2, 6, 0.01, 1.0, 1, ""),
            (3, 4, 0.003, 1.0, 1, "bed"))
    queued = (3, 6, 8, 9)  # a drop-tail queue on the downlink: 6, 8 and 9 are bound by a pull that loses its tail
    for i, (w, rate, d, speed, h, host) in enumerate(runs):
        kind = dataclasses.replace(catalog.kind("cloud"), name=f"k{i}", speed=speed, up_mbps=rate, down_mbps=rate,
                                   host=host, down_queue_ms=50 if i in queued else 0)
        cfg = Config((Group(kind, "ondemand", w),), d, "f16", h, 1)
        cat = dataclasses.replace(catalog, kinds=(kind,), hosts=(("bed", 2),),
                                  server=dataclasses.replace(catalog.server, host="bed"))
        p = predict(fitted_profile, cat, cfg)
        if host:  # the host is loaded past its cores: the stretch is what the fit must find
            assert p.compute_s > h * profile.compute_s / speed * 1.3 * 1.2
        obs.append((profile, cat, Observation(cfg, p.compute_s / h, p.exchange_s, p.s_per_it)))
    cal = fit_many(obs, source="test")[profile.model]
    assert cal.compute == pytest.approx(1.3, rel=1e-6)
    assert cal.host_load == pytest.approx(0.85, abs=0.003)  # the grid's step is 0.005
    assert cal.exchange_stretch == pytest.approx(0.4, rel=1e-6)
    assert cal.link == pytest.approx(1.1, rel=1e-6)
    assert cal.round_s == pytest.approx(0.02, rel=1e-6)
    assert cal.tail_loss == pytest.approx(1.2, rel=1e-6)
    assert cal.jitter == pytest.approx(0.25, abs=1e-9)  # on the grid (step 0.005)
    assert cal.worker_round_s == pytest.approx(0.003, abs=1e-9)  # on the grid (step 0.5 ms)
    assert cal.runs == 10 and cal.source == "test"
    assert 4 <= cal.exchange_runs < 10  # the link terms: fitted on the runs bound by their exchange


def test_round_is_the_expected_max_of_compute_and_exchange(catalog, profile):
    """With jitter, a round is E[max(C, E)] for normal C and E (Clark's formula): against a
    Monte Carlo estimate; it tends to max(C, E) as they part, and is max(C, E) at jitter 0."""
    import numpy as np

    rng = np.random.default_rng(0)
    for c, e, h, j in ((1.0, 1.0, 1, 0.2), (1.0, 0.8, 2, 0.3), (0.5, 1.2, 4, 0.25)):
        sc, se = j * c / math.sqrt(h), j * e
        mc = np.maximum(rng.normal(c, sc, 400_000), rng.normal(e, se, 400_000)).mean()
        got = float(expected_max(np, np.array(c), np.array(e), j, np.array(float(h))))
        assert got == pytest.approx(mc, rel=2e-3)
    assert float(expected_max(np, np.array(1.0), np.array(1.0), 0.2, np.array(1.0))) > 1.1
    assert float(expected_max(np, np.array(3.0), np.array(1.0), 0.2, np.array(1.0))) == pytest.approx(3.0, rel=1e-4)
    assert float(expected_max(np, np.array(1.0), np.array(0.9), 0.0, np.array(1.0))) == 1.0
    kind = dataclasses.replace(catalog.kind("cloud"), up_mbps=20, down_mbps=20)
    cfg = Config((Group(kind, "ondemand", 2),), 0.01, "f16", 1, 1)
    cat = dataclasses.replace(catalog, kinds=(kind,))
    plain = predict(profile, cat, cfg)
    spread = predict(dataclasses.replace(profile, calibration=Calibration(jitter=0.2)), cat, cfg)
    assert plain.round_s == max(plain.compute_s, plain.exchange_s)
    assert spread.round_s > plain.round_s


def test_shared_host_stretches_compute(catalog, profile):
    """Processor sharing: W workers and the server on one host of C cores stretch each step by
    host_load x (W + background / compute) / C; on hosts of their own they do not."""
    prof = dataclasses.replace(profile, calibration=Calibration(host_load=1.0))
    own = dataclasses.replace(catalog.kind("cloud"), name="own", count=4)
    shared = dataclasses.replace(own, name="shared", host="bed")
    cat = dataclasses.replace(catalog, kinds=(own, shared), hosts=(("bed", 2),),
                              server=dataclasses.replace(catalog.server, host="bed"))
    step = prof.compute_s / own.speed
    for w in (1, 2, 4):
        alone = predict(prof, cat, Config((Group(own, "ondemand", w),), 0.01, "f16", 1, 1))
        assert alone.compute_s == pytest.approx(step)
        bed = predict(prof, cat, Config((Group(shared, "ondemand", w),), 0.01, "f16", 1, 1))
        server = (prof.server_per_update_s * w * prof.sparse_numel * 0.01 + prof.server_per_numel_s * prof.numel)
        n = w + (w * prof.compress_s_per_numel * prof.numel + server) / step
        assert bed.compute_s == pytest.approx(step * max(1.0, n / 2), rel=1e-9)


def test_a_machine_slower_by_waiting_loads_its_shared_host_less(catalog, profile):
    """On a shared host, a machine f times slower than the host's fastest computes 1/f of
    the time: the host carries 1 + 1/f workers (plus the background), not 2."""
    prof = dataclasses.replace(profile, calibration=Calibration(host_load=1.0))
    fast = dataclasses.replace(catalog.kind("cloud"), name="fast", speed=1.0, host="bed")
    slow = dataclasses.replace(fast, name="slow", speed=0.5)
    cat = dataclasses.replace(catalog, kinds=(fast, slow), hosts=(("bed", 1),))  # the server on its own host
    step = prof.compute_s
    both = predict(prof, cat, Config((Group(fast, "ondemand", 1), Group(slow, "ondemand", 1)),
                                         0.01, "f16", 1, 1))
    n = 1 + 0.5 + 2 * prof.compress_s_per_numel * prof.numel / step
    assert both.compute_s == pytest.approx(2 * step * max(1.0, n), rel=1e-9)  # the slow machine's step, stretched
    two_fast = predict(prof, cat, Config((Group(fast, "ondemand", 2),), 0.01, "f16", 1, 1))
    assert two_fast.compute_s == pytest.approx(step * (n + 0.5), rel=1e-9)


def test_shaper_burst_passes_at_line_rate(catalog, profile):
    """A token-bucket shaper's burst carries the first burst_kb of each message at line rate:
    the link time is the rest over the rate (none when the message fits)."""
    prof = dataclasses.replace(profile, calibration=Calibration())
    plain = dataclasses.replace(catalog.kind("cloud"), name="plain", up_mbps=10, down_mbps=10)
    burst = dataclasses.replace(plain, name="burst", burst_kb=64)
    cat = dataclasses.replace(catalog, kinds=(plain, burst),  # the server's links: not the bound
                              server=dataclasses.replace(catalog.server, up_mbps=1e7, down_mbps=1e7))
    for d in (0.001, 0.01):
        a = predict(prof, cat, Config((Group(plain, "ondemand", 2),), d, "f16", 1, 1))
        b = predict(prof, cat, Config((Group(burst, "ondemand", 2),), d, "f16", 1, 1))
        push, pull = prof.push_bytes(d, "f16"), prof.pull_bytes(d)
        assert a.link_s == pytest.approx((push + pull) / 1.25e6)
        assert b.link_s == pytest.approx((max(push - 65536, 0) + max(pull - 65536, 0)) / 1.25e6, abs=1e-4)
        assert b.link_s < a.link_s


def test_a_message_that_overflows_its_queue_in_one_flight_waits_for_its_tail(catalog, profile):
    """A drop-tail queue (down_queue_ms at the rate, plus the burst) that a message overflows
    (by TAIL_OVERFLOW x the queue) while TCP still sends it as one flight (<= TAIL_FLIGHT_BYTES)
    costs tail_loss x the
    queue's delay; a message that fits the queue, or a longer one, costs nothing more. Each
    link counts only where its queue is declared."""
    prof = dataclasses.replace(profile, calibration=Calibration(tail_loss=1.5))
    plain = dataclasses.replace(catalog.kind("cloud"), name="plain", up_mbps=20, down_mbps=20)
    down_q = dataclasses.replace(plain, name="down", down_queue_ms=50)
    both_q = dataclasses.replace(down_q, name="both", up_queue_ms=50)
    cat = dataclasses.replace(catalog, kinds=(plain, down_q, both_q),
                              server=dataclasses.replace(catalog.server, up_mbps=1e7, down_mbps=1e7))
    queue = 20e6 / 8 * 0.050  # bytes; its delay: 50 ms
    wait = 1.5 * 0.050
    for d, coding in ((0.003, "f16"), (0.01, "f16"), (0.03, "f16"), (0.01, "q4")):
        push, pull = prof.push_bytes(d, coding), prof.pull_bytes(d)
        link = {k.name: predict(prof, cat, Config((Group(k, "ondemand", 2),), d, coding, 1, 1)).link_s
                for k in (plain, down_q, both_q)}
        hit = lambda size: TAIL_OVERFLOW * queue < size <= TAIL_FLIGHT_BYTES
        assert link["down"] - link["plain"] == pytest.approx(wait if hit(pull) else 0.0, abs=1e-9)
        assert link["both"] - link["down"] == pytest.approx(wait if hit(push) else 0.0, abs=1e-9)
    # the profile's sizes put each case in play: under the queue, in the window, past one flight
    assert prof.pull_bytes(0.003) < TAIL_OVERFLOW * queue < prof.pull_bytes(0.01) <= TAIL_FLIGHT_BYTES \
        < prof.pull_bytes(0.03)
    # with the burst, the queue holds the burst too
    burst = dataclasses.replace(down_q, name="burst", burst_kb=64)
    cat = dataclasses.replace(cat, kinds=(burst,))
    b = predict(prof, cat, Config((Group(burst, "ondemand", 2),), 0.01, "f16", 1, 1))
    b0 = predict(dataclasses.replace(prof, calibration=Calibration()), cat,
                   Config((Group(burst, "ondemand", 2),), 0.01, "f16", 1, 1))
    assert b.link_s - b0.link_s == pytest.approx(1.5 * (queue + 65536) / (20e6 / 8))


def test_catalog_hosts_are_checked(tmp_path):
    doc = tomllib.loads(GOOD)
    doc["kinds"]["cloud"]["host"] = "bed"
    with pytest.raises(CatalogError, match=r"kind 'cloud': field 'host' names no \[hosts.bed\] table"):
        catalog_from_dict(doc, "c.toml")
    doc["hosts"] = {"bed": {"cores": 0}}
    with pytest.raises(CatalogError, match=r"host 'bed': field 'cores' must be > 0, got 0"):
        catalog_from_dict(doc, "c.toml")
    doc["hosts"] = {"bed": {"cores": 2}}
    cat = catalog_from_dict(doc, "c.toml")
    assert cat.hosts == (("bed", 2),) and cat.kind("cloud").host == "bed"


# ------------------------------------------------------------------ profiles, for real


def tiny_spec():
    """``stella profile --model tests.test_plan:tiny_spec``: a small MLP."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    return {"model": model, "batch": (x, y),
            "loss": lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])}


def test_profile_of_a_tiny_model_against_a_real_server():
    from stella.planning.measure import profile_model

    spec = tiny_spec()
    doc = profile_model(spec["model"], spec["loss"], lambda: spec["batch"], batch_size=32, name="tiny", steps=5,
                        densities=(0.01, 0.1), broadcast_values="q2", broadcast_factor=3.0, dense_below=300)
    prof = profile_from_dict(doc, "tiny")
    # the loopback stella-ps ran the job's broadcast flags and dense cut, and the profile says what it answered
    assert (doc["pull"]["values"], doc["pull"]["factor"]) == ("q2", 3.0) and "broadcast" not in doc["server"]
    assert (prof.pull_values, prof.pull_factor) == ("q2", 3.0)
    assert doc["server"]["dense_below"] == 300  # its servers laid the model out with the job's cut
    assert prof.numel == 64 * 256 + 256 + 256 * 10 + 10 and prof.sparse_numel == 64 * 256 + 256 * 10
    assert 0 < prof.compute_s < 1
    b = {(e[0], e[1]): e[2] for e in prof.push}
    assert b[(0.1, "f16")] > b[(0.01, "f16")]
    assert b[(0.1, "f16")] > b[(0.1, "q4")] > b[(0.1, "q2")]
    rows = doc["server"]["measured"]
    assert [r["workers"] for r in rows] == [1, 3, 3]
    assert all(r["cpu_s_per_step"] > 0 and r["pull_bytes"] > 0 for r in rows)
    assert doc["server"]["per_update_s"] >= 0 and doc["server"]["per_numel_s"] >= 0
    assert "placeholder" in doc["target"]["source"]


def test_profile_cli_and_from_a_running_job(tmp_path, capsys, make_server, make_client):
    import numpy as np

    from stella.cli import main
    from stella.protocol import WorkerReport

    factors = tmp_path / "f.toml"
    factors.write_text('[[factors]]\ndensity = 0.01\ncoding = "f16"\nH = 1\nfactor = 1.2\n')
    out = tmp_path / "p.json"
    args = ["profile", "--model", "tests.test_plan:tiny_spec", "--out", str(out), "--steps", "5", "--no-server",
            "--target-iterations", "500", "--factors", str(factors)]
    assert main(args) == 2  # no server asked: the job's broadcast settings must be given
    assert "--broadcast-values and --broadcast-factor" in capsys.readouterr().err
    assert main([*args, "--broadcast-values", "f16", "--broadcast-factor", "1.5"]) == 0
    prof = load_profile(str(out))
    assert prof.dense_iterations == 500 and prof.factors[0][3] == 1.2
    assert prof.factors[0][4] == f"user table {factors}"
    assert (prof.pull_values, prof.pull_factor) == ("f16", 1.5)
    # a running job: one worker pushing with a report, its server's broadcast not the default
    srv = make_server(1, ["--broadcast-values", "bf16", "--broadcast-factor", "3"])
    c = make_client(srv.endpoint)
    c.register({"w": np.zeros(10_000, np.float32)}, {"name": "sgd", "lr": 1.0}, mode="update")
    v = c.pull(None).version
    idx = np.arange(0, 10_000, 100, dtype=np.int32)
    rep = WorkerReport(step=1, compute_s=0.05, exchange_s=0.01, wait_s=0.0, density=0.01, bytes_pushed=0,
                       bytes_pulled=0, value_dtype="f16")
    for _ in range(2):
        c.push({"w": (idx, np.ones(idx.size, np.float32))}, v, value_dtype="f16", report=rep)
        v = c.pull(v, wait_for=v + 1).version
    out2 = tmp_path / "live.json"
    assert main(["profile", "--from", srv.endpoint, "--out", str(out2), "--samples", "1"]) == 0
    live = load_profile(str(out2))
    assert live.compute_s == pytest.approx(0.05) and live.numel == 10_000
    assert live.push[0][:2] == (0.01, "f16")
    assert (live.pull_values, live.pull_factor) == ("bf16", 3.0)  # what the job runs, from its status
    # a job with exact pulls: so says its profile
    ex = make_server(1, pull="exact")
    c = make_client(ex.endpoint)
    c.register({"w": np.zeros(10_000, np.float32)}, {"name": "sgd", "lr": 1.0}, mode="update")
    v = c.pull(None).version
    c.push({"w": (idx, np.ones(idx.size, np.float32))}, v, value_dtype="f16", report=rep)
    assert main(["profile", "--from", ex.endpoint, "--out", str(out2), "--samples", "1"]) == 0
    with open(out2) as f:
        assert json.load(f)["pull"]["mode"] == "exact"


def _records(step_s: float, n: int, h: int = 1, t0: float = 1000.0, wait: float = 0.0) -> list[dict]:
    """Synthetic bench.stella_e2e iteration records: n steps of step_s (+ wait at each round's
    last step), H steps per round, the exchange's running totals 0.1 s per round."""
    out, t = [], t0
    for i in range(1, n + 1):
        w = wait if i % h == 0 else 0.0
        t += step_s + w
        rounds = (i + h - 1) // h
        out.append({"step": i, "iter": step_s + w, "compute": step_s, "net_wait": w, "t_epoch": t, "rounds": rounds,
                    "exchange_s": 0.1 * rounds, "compress_s": 0.0})
    return out


def test_clean_measure_steps_around_evaluations_and_the_runs_end():
    """bench.plan's measurement of a run from its workers' records: worker 0's evaluation stalls
    (the others wait through them) and the steps after the first worker left are not the job's
    pace; the steps clear of both are."""
    from bench.plan import clean_measure

    w0 = _records(0.2, 60)
    w1 = _records(0.2, 60)
    for x in w1[20:]:  # worker 1 waits 1 s through worker 0's evaluation after step 20
        x["t_epoch"] += 1.0
    w1[20]["iter"] += 1.0
    w1[20]["net_wait"] = 1.0
    for x in w0[20:]:
        x["t_epoch"] += 1.0
    w1.append({**w1[-1], "step": 61, "iter": 3.0, "net_wait": 2.8, "t_epoch": w1[-1]["t_epoch"] + 3.0,
               "rounds": 61, "exchange_s": 6.1 + 2.8})  # alone at the end: waits for worker 0 to leave
    ranks = [{"iters": w0, "evals": [{"step": 0}, {"step": 20}], "exchange_s": 9.0, "compress_s": 0.0, "rounds": 60},
             {"iters": w1, "evals": [], "exchange_s": 9.0, "compress_s": 0.0, "rounds": 61}]
    m = clean_measure(ranks, 1)
    assert m["s_per_it"] == pytest.approx(0.2, rel=1e-6)
    assert m["compute_mean_s"] == pytest.approx(0.2) and m["exchange_s"] == pytest.approx(0.1)
    assert 0.8 < m["clean_share"] < 1.0
    # counted whole, the stall and the end lift the pace by 4 s over 58 steps
    naive = (w1[-1]["t_epoch"] - w1[2]["t_epoch"]) / (len(w1) - 3)
    assert naive > 0.26
    # H = 2: a round is two steps
    m2 = clean_measure([{"iters": _records(0.1, 40, h=2), "evals": [], "exchange_s": 2.0, "compress_s": 0.0,
                         "rounds": 20}], 2)
    assert m2["round_s"] == pytest.approx(0.2) and m2["s_per_it"] == pytest.approx(0.1)
