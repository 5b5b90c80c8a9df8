"""Cut links: ``python -m bench.cut [--cuts 30,120] [--trickle 60] [--json PATH]``.

Issue 45's cut-link scenarios on the slow-link test bed (``bench/wan``; needs root and
network namespaces). Sites: ``ps`` (the server, 1000 Mbit/s), ``a`` and ``b`` (a worker
each, ``--rate`` Mbit/s both ways), each worker ``docker/train/train.py`` (the digits
MLP, update mode, AdamW, the default compression) printing every step. Per scenario,
after ``--before`` seconds of training, site ``a``'s link is

- *cut* for S seconds (its port on the hub is set down: no packet passes, nothing is
  reset; TCP retransmits into the void), then restored; or
- a *trickle*: shaped to 1% of its rate for S seconds, then restored;

and both go on for ``--after`` seconds. Reported per scenario: the steps site ``b`` (the
other site) made during the disturbance and its longest gap between steps, how many
steps of ``b`` waited the step deadline for ``a`` (the server's "step deadline passed"),
whether the server declared ``a`` gone, the time from the restore to ``a``'s next step,
``a``'s reconnects (the client's "reconnecting" lines), and both workers' exit status
after SIGTERM.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from stella_ps.process import ServerProcess

from .wan.testbed import WanTestbed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "docker", "train", "train.py")
STEP = re.compile(r"step (\d+) \| version (\d+)")
STARTUP_S = 120.0  # the longest wait for both workers' first steps


def scenario(kind: str, seconds: float, a: argparse.Namespace) -> dict[str, Any]:
    lines: dict[str, list[tuple[float, str]]] = {"a": [], "b": []}

    def read(name: str, p: subprocess.Popen) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            lines[name].append((time.monotonic(), line.rstrip()))

    sites = {"ps": "1000/1000", "a": f"{a.rate}/{a.rate}", "b": f"{a.rate}/{a.rate}"}
    with WanTestbed(sites, max_lifetime=STARTUP_S + a.before + seconds + a.after + 120) as bed:
        srv = ServerProcess(2, ["--liveness-timeout", str(a.liveness)], bind=f"tcp://{bed.address('ps')}:5555",
                            log_level="INFO", popen=functools.partial(bed.popen, "ps"), cwd=ROOT)
        env = {**os.environ, **srv.client_env(), "STELLA_SERVER": srv.endpoint, "PYTHONUNBUFFERED": "1",
               "STELLA_RANK": "0", "STELLA_WORLD": "1"}  # rank 0: each prints its steps
        procs = {s: bed.popen(s, [sys.executable, TRAIN, "--steps", "0", "--eval-every", "1", "--progress-every", "0"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for s in ("a", "b")}
        for s, p in procs.items():
            threading.Thread(target=read, args=(s, p), daemon=True).start()
        # --before counts from both sites' first step, not from their start (imports and registration: a
        # loaded machine took longer than 8 s once, the cut met a job that had not begun, and b could not step)
        until = time.monotonic() + STARTUP_S
        while time.monotonic() < until and not all(any(STEP.search(x) for _, x in lines[s]) for s in ("a", "b")):
            time.sleep(0.2)
        time.sleep(a.before)
        t_cut = time.monotonic()
        if kind in ("cut", "forever"):
            bed.set_link("a", False)
        else:
            bed.set_rate("a", up=a.rate / 100, down=a.rate / 100)
        time.sleep(seconds)
        if kind == "cut":
            bed.set_link("a", True)
        elif kind == "trickle":
            bed.set_rate("a", up=a.rate, down=a.rate)
        t_up = time.monotonic()
        if kind != "forever":
            time.sleep(a.after)
        status = _status(bed, srv)
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        codes = {}
        for s, p in procs.items():
            try:
                codes[s] = p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                codes[s] = -9
        log = srv.logs()
        srv.close()

    def steps(name: str) -> list[float]:
        return [t for t, line in lines[name] if STEP.search(line)]

    sa, sb = steps("a"), steps("b")
    during_b = [t for t in sb if t_cut <= t < t_up]
    after_a = [t for t in sa if t >= t_up]
    gaps_b = [y - x for x, y in itertools.pairwise(sb) if t_cut <= y <= t_up + 1]
    deadline = [line for line in log.splitlines() if "step deadline passed" in line]
    # the liveness sweep's own line (a refusal's text may also say "declared gone": a worker id in use
    # "is freed when that connection is declared gone")
    gone = [line for line in log.splitlines() if "workers declared gone" in line]
    waits = [t for t, line in ((_ts(x), x) for x in log.splitlines()) if "step deadline passed" in line]
    return {"scenario": f"{kind} {seconds:g} s" if kind != "forever" else f"cut for good ({seconds:g} s watched)",
            "b_steps_during": len(during_b),
            "b_longest_gap_s": round(max(gaps_b, default=float("nan")), 2),
            "steps_waiting_the_deadline": len(deadline), "a_declared_gone": bool(gone), "gone_lines": gone[:3],
            "a_back_after_s": round(after_a[0] - t_up, 2) if after_a else None,
            "a_reconnects": sum("reconnecting" in line for _, line in lines["a"]),
            "exit": codes, "a_steps_after": len(after_a),
            "a_silent_after_s": _silent_after(log, t_cut),
            "late_pushes": status.get("late_pushes"),
            "deadline_waits_after_cut": len(waits)}


def _status(bed: WanTestbed, srv: ServerProcess) -> dict[str, Any]:
    """The server's counters now, asked from its own site (the test bed's addresses are not reachable from
    outside its namespaces): its version and late pushes (a push that missed its step, folded into a later one)."""
    script = ("import json, sys; from stella import Client; c = Client(sys.argv[1], join=False, timeout=10); "
              "st = c.status(); c.close(); print(json.dumps({'version': st.version, 'late_pushes': st.late_pushes}))")
    try:
        r = bed.run("ps", [sys.executable, "-c", script, srv.endpoint], timeout=60,
                    env={**os.environ, **srv.client_env()})
        return json.loads(r.stdout.strip().splitlines()[-1])
    except Exception as e:  # the report says why; the scenario's other figures stand
        return {"error": str(e)}


def _ts(line: str) -> float:
    try:
        return float(json.loads(line)["ts"])
    except (ValueError, KeyError, TypeError):
        return 0.0


def _silent_after(log: str, t_cut: float) -> float | None:
    """Seconds from the cut (monotonic) to the server's marking a silent: the log's wall-clock times are
    converted through the offset between the clocks now (both read here)."""
    offset = time.time() - time.monotonic()
    for line in log.splitlines():
        if ("fell silent" in line or "step deadline passed" in line) and '"silent_workers": [' in line \
                and '"silent_workers": []' not in line and _ts(line) - offset >= t_cut:
            return round(_ts(line) - offset - t_cut, 2)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cut", description=__doc__.split("\n\n")[0])
    p.add_argument("--cuts", default="30,120", help="cut site a for these many seconds, one scenario each")
    p.add_argument("--trickle", type=float, default=60.0, help="then 1%% of its rate for this long (0: not)")
    p.add_argument("--forever", type=float, default=60.0,
                   help="then cut site a for good, watched this long (0: not)")
    p.add_argument("--rate", type=float, default=100.0, help="the worker sites' links, Mbit/s")
    p.add_argument("--before", type=float, default=15.0)
    p.add_argument("--after", type=float, default=30.0)
    p.add_argument("--liveness", type=float, default=20.0, help="stella-ps --liveness-timeout")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    runs = [("cut", float(s)) for s in a.cuts.split(",") if s] + ([("trickle", a.trickle)] if a.trickle else []) \
        + ([("forever", a.forever)] if a.forever else [])
    rows = []
    for kind, seconds in runs:
        rows.append(scenario(kind, seconds, a))
        print(json.dumps(rows[-1]), flush=True)
    cols = ["scenario", "b_steps_during", "b_longest_gap_s", "steps_waiting_the_deadline", "a_silent_after_s",
            "a_declared_gone", "a_back_after_s", "a_reconnects", "late_pushes", "exit"]
    print(f"load {os.getloadavg()[0]:.2f}; sites a, b at {a.rate:g} Mbit/s; liveness {a.liveness:g} s")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "args": vars(a)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
