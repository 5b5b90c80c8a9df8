"""Slow-link test bed: real namespaces, real veths, real tbf, real TCP bytes.

Skipped (with the reason) when not root or when `ip netns` is unavailable.
The whole module takes ~60 s; the four longest tests are marked slow.
"""

import os
import subprocess
import sys
import time

import pytest

from bench.wan import Link, NotRootError, WanTestbed, bulk, netns_available

_ok, _why = netns_available()
needs_netns = pytest.mark.skipif(not _ok, reason=f"slow-link test bed unavailable: {_why}")
pytestmark = pytest.mark.testbed  # timed transfers: one bed at a time (the test-bed tests of other modules too)


def _netns_names():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _root_links():
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def test_refuses_clearly_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NotRootError, match="needs root"):
        WanTestbed({"a": Link(100, 100)})


def test_cli_exits_nonzero_without_root():
    code = ("import os, sys; os.geteuid = lambda: 1000; from bench.wan.__main__ import main; "
            "sys.exit(main(['check']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 2
    assert "needs root" in r.stderr


def test_link_parse():
    link = Link.parse("100/20@5:50/-@10:100")
    assert (link.up, link.down) == (100, 20)
    assert link.schedule == ((5.0, 50.0, None), (10.0, 100.0, 100.0))
    assert Link.parse("-").up is None


def _tbf_rates(bed, site: str) -> list[str]:
    """The rates of the site's shapers as tc shows them: [uplink, downlink]."""
    return [line.split(" rate ")[1].split()[0] for line in bed.qdisc_stats(site).splitlines()
            if line.startswith("qdisc tbf")]


# A busy machine can only slow a transfer down, never push it past its shaper: the tests bound
# measured rates from above (within 10%) and check the configured rates as tc reads them back; from
# below they ask for a quarter or more of the rate, a margin a loaded machine's bulk transfer keeps.
# How close a transfer comes to its rate is `python -m bench.wan check`'s table.
@needs_netns
def test_shaped_link_delivers_configured_rate():
    with WanTestbed({"a": Link(100, 100), "b": Link(100, 100)}, max_lifetime=60) as bed:
        m = bulk.measure(bed, "a", "b", seconds=2.0)
        # site-to-site crosses a's uplink and b's downlink, both 100 Mbit/s
        assert _tbf_rates(bed, "a") == _tbf_rates(bed, "b") == ["100Mbit", "100Mbit"]
        assert 25.0 <= m["mbit"] <= 110.0, f"delivered {m['mbit']:.1f} Mbit/s on a 100 Mbit/s link"
        assert bed.counters("a")["tx_bytes"] >= m["bytes"]  # real bytes left the site


@pytest.mark.slow
@needs_netns
def test_asymmetric_link_is_asymmetric_and_set_rate_works():
    with WanTestbed({"a": Link(100, 20)}, max_lifetime=60) as bed:
        assert _tbf_rates(bed, "a") == ["100Mbit", "20Mbit"]
        up = bed.measure("a", "hub", seconds=1.5)
        down = bed.measure("hub", "a", seconds=1.5)
        assert 25.0 <= up <= 110.0, up
        assert 5.0 <= down <= 22.0, down
        bed.set_rate("a", up=40)
        assert _tbf_rates(bed, "a") == ["40Mbit", "20Mbit"]
        up2 = bed.measure("a", "hub", seconds=1.5)
        assert 10.0 <= up2 <= 44.0, up2


@pytest.mark.slow
@needs_netns
def test_rate_schedule_takes_effect():
    change_at = 2.0
    with WanTestbed({"a": Link(100, 100, schedule=((change_at, 25, None),))}, max_lifetime=60) as bed:
        start = bed.elapsed()
        samples = bulk.transfer(bed, "a", "hub", duration=4.0)
        off = change_at - start  # schedule instant on the receiver's clock (+ connect time)
        before = bulk.rate_between(samples, 0.3, off - 0.4)
        after = bulk.rate_between(samples, off + 0.6, samples[-1][0])
        assert 27.5 < before <= 110.0, before  # not yet the 25 Mbit/s
        assert 6.0 <= after <= 27.5, after
        assert bed.rates("a") == (25, 100)
        assert [x[1:] for x in bed.rate_log][-1] == ("a", 25, 100)


@needs_netns
def test_teardown_leaves_nothing_behind_even_after_exception():
    before_links = _root_links()
    with pytest.raises(RuntimeError, match="boom"), \
            WanTestbed({"ps": Link(1000, 1000), "a": Link(100, 100), "b": Link(50, 10)}, max_lifetime=60) as bed:
        prefix = bed.prefix
        assert {f"{prefix}-ps", f"{prefix}-a", f"{prefix}-b", f"{prefix}-hub"} <= _netns_names()
        p = bed.popen("a", ["sleep", "30"])
        raise RuntimeError("boom")
    assert p.poll() is not None, "process started in the test bed survived teardown"
    after = _netns_names()
    # none of its namespaces is left (test beds of other test runs on a shared machine may come and go
    # meanwhile: the lists before and after need not be equal)
    assert not any(n.startswith(prefix) for n in after), after
    assert _root_links() == before_links  # no veth ever appeared in (or leaked to) the root namespace


@needs_netns
def test_watchdog_bounds_lifetime():
    bed = WanTestbed({"a": Link(100, 100)}, max_lifetime=1.0).start()
    t0 = time.monotonic()
    while not bed.closed and time.monotonic() - t0 < 30:  # ~1 s; 30 s only bound a hang
        time.sleep(0.1)
    assert bed.closed
    assert not any(n.startswith(bed.prefix) for n in _netns_names())


@pytest.mark.slow
@needs_netns
def test_powersgd_ddp_baseline_runs_over_shaped_links():
    """Regression for the gloo issue-order race (docs/testbed.md): the serialized
    PowerSGD hook trains over two shaped sites, both ranks issue identical
    collective sequences, and the veth counters show the compressed traffic."""
    from bench import baselines

    with WanTestbed({"a": Link(500, 500), "b": Link(500, 500)}, max_lifetime=120) as bed:
        r = baselines.run_ddp("widemlp", "powersgd", world=2, steps=4, max_seconds=40, bed=bed, calib=0,
                              eval_every=4, trace=True)
        assert r["ok"], r.get("error")
        assert r["steps"] == 4
        assert "identical on all ranks" in baselines.compare_traces(r["log_dir"], 2)
        per_iter = r["per_iter"]
        dense = 9_670_666 * 4
        assert per_iter[0]["bytes_up"] > 0.9 * dense          # vanilla all-reduce before start_powerSGD_iter
        assert per_iter[-1]["bytes_up"] < 0.02 * dense        # rank-4 PowerSGD afterwards


@needs_netns
@pytest.mark.parametrize("sig,repeat", [("SIGTERM", 1), ("SIGINT", 1), ("SIGTERM", 20)])
def test_signal_tears_down(sig, repeat):
    """A process holding a test bed that gets SIGTERM/SIGINT (also several in a row, as when
    ``timeout`` forwards one more) removes its namespaces and children."""
    import signal as _signal

    code = ("import sys, time; from bench.wan import WanTestbed, Link\n"
            "with WanTestbed({'a': Link(100, 100)}, max_lifetime=60) as bed:\n"
            "    p = bed.popen('a', ['sleep', '60'])\n"
            "    print(bed.prefix, p.pid, flush=True)\n"
            "    time.sleep(60)\n")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=repo)
    try:
        prefix, child = proc.stdout.readline().split()
        assert any(n.startswith(prefix) for n in _netns_names())
        for _ in range(repeat):
            proc.send_signal(getattr(_signal, sig))
            time.sleep(0.01)
        proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert not any(n.startswith(prefix) for n in _netns_names())
    assert not os.path.exists(f"/proc/{child}") or _proc_state(child) == "Z"


def _proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2]


@needs_netns
def test_a_message_that_overflows_the_downlink_queue_in_one_flight_is_cut():
    """bench.transport on the real test bed, four messages each way (the slow test below sends
    twenty and times them): 288 KiB down a 20 Mbit/s link overflows its queue (186 KiB) in one
    flight, and the queue drops; at 50 Mbit/s (queue 369 KiB) nothing is dropped."""
    from bench.transport import measure

    assert measure(20, 288 * 1024, reps=4)["drops_down"] > 0
    assert measure(50, 288 * 1024, reps=4)["drops_down"] == 0


@pytest.mark.slow
@needs_netns
def test_a_message_that_overflows_the_downlink_queue_in_one_flight_loses_its_tail():
    """bench.transport on the real test bed: 288 KiB down a 20 Mbit/s link (queue 186 KiB)
    waits for TCP's timer (stella plan's tail loss); the same message up, shaped on the
    sender's own interface, and 288 KiB down at 50 Mbit/s (queue 369 KiB) do not.

    Whether one message waits depends on the sender's window when it starts: here 15-17 of 17
    did, in one CI run 1 of 3. So the test sends 17 and asks for one wait, not a median.
    The waits are bounded from below only (a busy machine only lengthens them); that the
    message at 50 Mbit/s has no tail to wait for is told by the downlink queue's drop counter,
    not by its time. The times, and the uplink's (shaped on the sender's own interface, whose
    drops TCP learns of at once), are bench.transport's table."""
    from bench.transport import measure

    hit = measure(20, 288 * 1024, reps=20)
    assert hit["down_tail_hits"] >= 1, hit
    # (until 2026-12-02 a timer's wait, longer than a queue delay, was asserted too: with the tbf burst at
    # exactly 64 KiB, a TSO/GSO super-packet (65,549 bytes with its Ethernet header) could not leave, and the
    # waits seen were, at least in part, that. With the 80 KiB floor the tail is lost and found again within
    # the queue delay: bench/RESULTS.md "Rate drops")
    assert min(hit["down_all_s"]) >= hit["base_s"], hit
    assert hit["drops_down"] > 0, hit
    fits = measure(50, 288 * 1024, reps=6)
    assert fits["drops_down"] == 0, fits  # nothing lost down: no tail to wait for
