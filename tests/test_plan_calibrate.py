"""``stella calibrate``: the model's coefficients fitted on a user's own measured runs (a runs
file naming the user's catalog, or bench.plan's output) and attached to the profile, which
``stella plan`` then says it uses; fewer coefficients on too few runs, said so; clear errors
for unusable input. Real CLI invocations on real files in tmp_path; the runs are the model's
own predictions at known coefficients, so the fit must find those coefficients again."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
from tests.test_plan import ROOT, profile_doc

from stella.cli import main
from stella.planning.catalog import load_catalog
from stella.planning.model import predict
from stella.planning.profile_file import TEST_BED_FIT, Calibration, load_profile, profile_from_dict
from stella.planning.search import parse_config

TRUTH = Calibration(compute=1.3, host_load=0.85, exchange_stretch=0.4, link=1.1, round_s=0.02, tail_loss=1.2,
                    jitter=0.25, worker_round_s=0.003, background=0.5)
# (W, Mbit/s, density, speed, H, shared host, a drop-tail queue on the downlink), as test_plan's fit test
RUNS = ((2, 100, 0.01, 1.5, 1, "", 0), (3, 20, 0.01, 1.0, 2, "bed", 0), (4, 50, 0.03, 0.7, 1, "bed", 0),
        (2, 10, 0.003, 1.5, 4, "", 50), (3, 200, 0.01, 2.0, 1, "bed", 0), (2, 30, 0.03, 1.0, 1, "", 0),
        (3, 5, 0.01, 2.0, 1, "bed", 50), (4, 8, 0.03, 1.0, 2, "bed", 0), (2, 6, 0.01, 1.0, 1, "", 50),
        (3, 4, 0.003, 1.0, 1, "bed", 50))
assert len(RUNS) == 10


def catalog_toml() -> str:
    text = ("[hosts.bed]\ncores = 2\n\n[server]\nprice = 0.5\ncores = 4\nup_mbps = 10000\ndown_mbps = 10000\n"
            "host = \"bed\"\n")
    for i, (_, rate, _, speed, _, host, queue) in enumerate(RUNS):
        text += (f"\n[kinds.k{i}]\ngpu = \"x\"\nspeed = {speed}\ncount = 8\nprice = 1.0\nup_mbps = {rate}\n"
                 f"down_mbps = {rate}\ndown_queue_ms = {queue}\n" + (f"host = \"{host}\"\n" if host else ""))
    return text


def measured_runs(tmp_path, truth: Calibration = TRUTH, which: tuple[int, ...] = tuple(range(10)), **top) -> str:
    """A runs file of the runs ``which``, each what the model predicts at ``truth``, naming the catalog."""
    (tmp_path / "c.toml").write_text(catalog_toml())
    cat = load_catalog(str(tmp_path / "c.toml"))
    prof = dataclasses.replace(profile_from_dict(profile_doc()), calibration=truth)
    rows = []
    for i in which:
        w, _, d, _, h, _, _ = RUNS[i]
        spec = f"W={w},kind=k{i},market=ondemand,density={d},coding=f16,H={h}"
        p = predict(prof, cat, parse_config(spec, cat))
        rows.append({"run": f"r{i}", "config": spec, "measured": {"s_per_it": p.s_per_it, "round_s": p.round_s,
                                                                   "compute_mean_s": p.compute_s / h,
                                                                   "compute_s": p.compute_s / h,
                                                                   "exchange_s": p.exchange_s}})
    path = tmp_path / "runs.json"
    path.write_text(json.dumps({"model": "toy", "catalog": "c.toml", **top, "rows": rows}))
    return str(path)


def cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_calibrate_fits_the_users_runs_and_attaches_the_fit_to_the_profile(tmp_path, capsys):
    runs = measured_runs(tmp_path)
    prof_path = tmp_path / "p.json"
    prof_path.write_text(json.dumps(profile_doc()))
    out = tmp_path / "fitted.json"
    rc, text, err = cli(capsys, "calibrate", "--profile", str(prof_path), runs, "--out", str(out))
    assert rc == 0, err
    cal = load_profile(str(out)).calibration
    for k in ("compute", "exchange_stretch", "link", "round_s", "tail_loss"):
        assert getattr(cal, k) == pytest.approx(getattr(TRUTH, k), rel=1e-6), k
    assert cal.host_load == pytest.approx(0.85, abs=0.003) and cal.jitter == pytest.approx(0.25, abs=1e-9)
    assert cal.worker_round_s == pytest.approx(0.003, abs=1e-9) and cal.background == pytest.approx(0.5, abs=1e-9)
    assert cal.runs == 10 and cal.source.startswith("stella calibrate ") and "10 runs of toy (runs.json)" in cal.source
    assert cal.fitted_terms == ("compute, host_load, worker_round_s, background, round_s, link, exchange_stretch, "
                                "tail_loss, jitter")
    assert "too few" not in text and "| r3 |" in text and "mean absolute error 0.0%" in text
    assert json.loads(prof_path.read_text()).get("calibration") is None  # --out: the profile itself untouched
    # stella plan says which fit it uses
    rc, text, _ = cli(capsys, "plan", "--catalog", str(tmp_path / "c.toml"), "--profile", str(out), "--config",
                      "W=2,kind=k0,market=ondemand,density=1%,coding=f16")
    assert rc == 0 and f"model calibration: {cal.source}" in text
    # without --out the fit is written back into the profile; --compute-scale gives the scale, not fitted
    rc, _, err = cli(capsys, "calibrate", "--profile", str(prof_path), runs, "--compute-scale", "1.3")
    assert rc == 0, err
    back = load_profile(str(prof_path)).calibration
    assert back.compute == 1.3 and back.link == pytest.approx(1.1, rel=1e-6)
    assert not back.fitted_terms.startswith("compute")


def test_too_few_runs_fit_fewer_coefficients_and_say_so(tmp_path, capsys):
    """Two runs (on hosts of their own) cannot fix four link terms: the link scale alone is
    fitted, with the compute scale and jitter; the rest come from the fit the plan used (the
    test bed's), and the output and the fit's source say so."""
    truth = dataclasses.replace(TEST_BED_FIT, compute=1.2, link=1.4, jitter=0.1)
    runs = measured_runs(tmp_path, truth, which=(0, 8))
    prof_path = tmp_path / "p.json"
    prof_path.write_text(json.dumps(profile_doc()))
    rc, text, err = cli(capsys, "calibrate", "--profile", str(prof_path), runs)
    assert rc == 0, err
    cal = load_profile(str(prof_path)).calibration
    assert cal.fitted_terms == "compute, link, jitter"
    assert cal.compute == pytest.approx(1.2, rel=1e-6) and cal.link == pytest.approx(1.4, rel=1e-6)
    assert cal.jitter == pytest.approx(0.1, abs=1e-9)
    for k in ("round_s", "exchange_stretch", "tail_loss", "host_load", "worker_round_s"):
        assert getattr(cal, k) == getattr(TEST_BED_FIT, k), k
    assert "note: too few runs to fit every coefficient (2 runs" in text
    assert "round_s, exchange_stretch, tail_loss from the base fit (the test bed's fit" in text
    assert cal.source.endswith("fitted compute, link, jitter; round_s, exchange_stretch, tail_loss from the test "
                               "bed's fit")
    # one run: the compute and link scales, nothing else
    runs = measured_runs(tmp_path, truth, which=(8,))
    rc, text, err = cli(capsys, "calibrate", "--profile", str(prof_path), runs, "--out", str(tmp_path / "one.json"))
    assert rc == 0, err
    one = load_profile(str(tmp_path / "one.json")).calibration
    assert one.fitted_terms == "compute, link" and one.link == pytest.approx(1.4, rel=1e-6)
    assert one.jitter == cal.jitter  # the profile's own fit (the one above) is now the base


@pytest.mark.parametrize("edit, message", [
    (lambda d: {**d, "rows": []}, "no runs in it"),
    (lambda d: {**d, "model": "gru"}, "no runs of 'toy' (the profile's model): the runs are of 'gru'"),
    (lambda d: {k: v for k, v in d.items() if k != "catalog"}, "give --catalog"),
    (lambda d: {**d, "rows": [{**d["rows"][0], "config": "toy W=2 100 Mbit/s 1.00% f16 H=1"}]},
     "python -m bench.calibrate FILE --out RUNS.json"),
    (lambda d: {**d, "rows": [{**d["rows"][0], "measured": {"s_per_it": 0.5, "compute_s": 0.1}}]},
     "run r0: field 'exchange_s' must be a number of seconds"),
    (lambda d: {**d, "rows": [{**d["rows"][0], "config": "W=2,kind=nope,density=1%,coding=f16"}]}, "run r0: "),
    (lambda d: {"no": "rows"}, "no runs in it"),
])
def test_calibrate_refuses_unusable_runs_clearly(tmp_path, capsys, edit, message):
    runs = measured_runs(tmp_path, which=(0, 1))
    with open(runs) as f:
        doc = edit(json.load(f))
    with open(runs, "w") as f:
        json.dump(doc, f)
    prof_path = tmp_path / "p.json"
    prof_path.write_text(json.dumps(profile_doc()))
    rc, _, err = cli(capsys, "calibrate", "--profile", str(prof_path), runs)
    assert rc == 2 and err.startswith("stella calibrate: ") and message in err, err
    assert "calibration" not in json.loads(prof_path.read_text())  # nothing written
    # runs of another model beside the profile's are left out, and said so
    if message.startswith("no runs of"):
        both = {**doc, "rows": doc["rows"] + [{**r, "model": "toy", "run": r["run"] + "b"} for r in doc["rows"]]}
        with open(runs, "w") as f:
            json.dump(both, f)
        rc, text, err = cli(capsys, "calibrate", "--profile", str(prof_path), runs)
        assert rc == 0, err
        assert "left out 2 runs of other models (gru)" in text


def test_calibrate_reads_bench_plans_runs(tmp_path, capsys):
    """bench.plan's output (bench/PLAN.json, 69 test-bed runs of widemlp and digits), given
    each row's test-bed catalog and configuration by python -m bench.calibrate: stella
    calibrate fits widemlp's coefficients on its 60 runs, leaving digits' out."""
    from bench.calibrate import main as convert

    runs = str(tmp_path / "runs.json")
    assert convert([os.path.join(ROOT, "bench", "PLAN.json"), "--out", runs]) == 0
    with open(os.path.join(ROOT, "bench", "PLAN.json")) as f:
        prof = {**json.load(f)["profiles"]["widemlp"], "stella_profile": 1, "model": "widemlp", "batch_size": 32,
                "target": {"dense_iterations": 1000, "global_batch": 64}}
    prof_path = tmp_path / "widemlp.json"
    prof_path.write_text(json.dumps(prof))
    rc, text, err = cli(capsys, "calibrate", "--profile", str(prof_path), runs, "--compute-scale", "1")
    assert rc == 0, err
    cal = load_profile(str(prof_path)).calibration
    assert cal.runs == 60 and "left out 9 runs of other models (digits)" in text
    assert "too few" not in text and 0.8 < cal.link < 1.3 and 1.0 < cal.host_load < 1.3
    mean = float(text.split("mean absolute error ")[1].split("%")[0])
    assert mean < 15  # the test bed's fit made 12% on these workloads


def test_calibrate_from_a_running_job_measures_it_records_the_run_and_checks_the_configuration(
        tmp_path, capsys, make_server, make_client):
    """``stella calibrate --from``: a real stella-ps with two workers stepping every ~40 ms
    (each push carrying its report, as StellaOptimizer's do), read through status over a
    window; the run's pace is the workers' own, its density, coding and H the job's, and it
    is added to the runs file that the fit then reads. A configuration that is not the job's
    is refused, saying why."""
    import threading
    import time

    import numpy as np

    from stella.protocol import WorkerReport

    srv = make_server(2)
    workers = [make_client(srv.endpoint) for _ in range(2)]
    for c in workers:
        c.register({"w": np.zeros(10_000, np.float32)}, {"name": "sgd", "lr": 0.01}, mode="update")
    stop, paces = threading.Event(), {}
    idx = np.arange(0, 10_000, 100, dtype=np.int32)

    def train(i: int, c) -> None:
        v = c.pull(None).version
        t0, step = time.monotonic(), 0
        while not stop.is_set() and step < 2_000:
            time.sleep(0.04)  # the step's compute
            step += 1
            rep = WorkerReport(step=step, compute_s=0.04, exchange_s=0.005, wait_s=0.0, density=0.01,
                               value_dtype="q4", local_steps=1)
            c.push({"w": (idx, np.full(idx.size, 1e-3, np.float32))}, v, value_dtype="q4", report=rep)
            v = c.pull(v, wait_for=v + 1).version
        paces[i] = (time.monotonic() - t0) / step

    threads = [threading.Thread(target=train, args=(i, c)) for i, c in enumerate(workers)]
    for t in threads:
        t.start()
    try:
        (tmp_path / "c.toml").write_text(catalog_toml())
        prof_path = tmp_path / "p.json"
        prof_path.write_text(json.dumps(profile_doc()))
        record = tmp_path / "live-runs.json"
        args = ["calibrate", "--profile", str(prof_path), "--from", srv.endpoint, "--catalog",
                str(tmp_path / "c.toml"), "--samples", "4", "--interval", "0.5"]
        rc, _, err = cli(capsys, *args, "--config", "W=3,kind=k0")
        assert rc == 2 and "does not describe the job" in err and "workers 3 (the job: 2)" in err, err
        rc, _, err = cli(capsys, *args, "--config", "W=2,kind=k0,coding=f16")
        assert rc == 2 and "coding f16 (the job: q4)" in err, err
        rc, text, err = cli(capsys, *args, "--config", "W=2,kind=k0", "--record", str(record), "--out",
                            str(tmp_path / "fitted.json"))
        assert rc == 0, err
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    rows = json.loads(record.read_text())["rows"]
    assert len(rows) == 1 and rows[0]["catalog"] == "c.toml" and rows[0]["model"] == "toy"
    assert rows[0]["spec"] == "W=2,kind=k0,density=0.01,coding=q4,H=1"
    m = rows[0]["measured"]
    assert m["workers"] == 2 and m["compute_s"] == pytest.approx(0.04) and m["exchange_s"] == pytest.approx(0.005)
    # the pace read through status is the workers' own (a round's granularity over a 1.5 s window)
    assert m["s_per_it"] == pytest.approx(max(paces.values()), rel=0.3), (m, paces)
    cal = load_profile(str(tmp_path / "fitted.json")).calibration
    assert cal.runs == 1 and "1 run of toy (live-runs.json)" in cal.source
    assert f"| {rows[0]['run']} |" in text
