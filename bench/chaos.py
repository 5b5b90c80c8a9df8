"""Training while machines come and go: ``python -m bench.chaos [--quick] [--json PATH]``.

Two runs of the same job over the slow-link test bed (``bench/wan``: every worker and
the server a site of its own, each worker site's access link shaped with ``tbf`` to
``--rate`` Mbit/s each way, the server's to ``--ps-rate``). It needs root; where
network namespaces are not available it says so and runs on loopback, and
``--loopback`` asks for loopback. ``--workers`` worker processes
(``bench.live_worker``: the demo's MLP on the digits, the default update mode with a
local AdamW, 5% top-k, plus ``--step-sleep`` seconds per step standing in for a
GPU's compute) train until the server's version reaches ``--target``,
through a ``stella-ps`` with ``--checkpoint-dir`` and a short liveness timeout.

- **undisturbed**: nothing happens.
- **chaos**: every ``--kill-every`` seconds one worker (in turn) is killed with
  SIGKILL and started again ``--back-after`` seconds later asking for its old id; the
  server is killed with SIGKILL once, at ``--server-kill-at`` seconds, and started again
  at once on the same address and checkpoint directory. Nobody intervenes otherwise:
  the workers reconnect by themselves.

The schedule and the times count from the run's first step (worker start-up, ~5-25 s
of importing torch on a loaded 2-core machine, is not part of either). A monitor
process in the server's site (unshaped: it talks to the server over that site's
loopback) polls ``status`` every 0.2 s. Reported per run: the time until the server's
version first reached the target (and the ratio chaos / undisturbed, the goal being
<= 1.25), the steps lost (versions the server went back on its restart, from its
log), the longest stall (the longest time the version did not move between the first
step and the target), the reconnects of the workers running at the end, and the
workers' held-out accuracy at the end. ``--repeat N`` runs the pair N times and
reports every ratio and their median (a 2-core machine is noisy: a killed worker
frees a core, a restarted one spends seconds importing torch).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from stella_ps.process import ServerProcess, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLL_S = 0.2
Launch = Callable[..., subprocess.Popen]  # Popen-like: (argv, **kw)


def monitor(endpoint: str, out: str, max_seconds: float) -> int:
    """The monitor process: ``<monotonic time> <version>`` appended to ``out`` every
    poll the server answers, for at most ``max_seconds``; keys from the environment."""
    from stella import Client
    from stella.errors import StellaError

    t_end = time.monotonic() + max_seconds
    with open(out, "a", buffering=1) as f:
        while time.monotonic() < t_end:
            try:
                with Client(endpoint, timeout=0.5, join=False) as c:
                    v = int(c.status(timeout=0.5).version)
                f.write(f"{time.monotonic():.3f} {v}\n")
            except StellaError:
                pass
            time.sleep(POLL_S)
    return 0


def _samples(path: str) -> list[tuple[float, int]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = [line.split() for line in f.read().splitlines()]
    return [(float(t), int(v)) for t, v in (r for r in rows if len(r) == 2)]


def _json_lines(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        try:
            x = json.loads(line)
        except ValueError:
            continue
        if isinstance(x, dict):
            out.append(x)
    return out


def run(chaos: bool, a: argparse.Namespace, workdir: str, bed: Any = None) -> dict[str, Any]:
    """One run; ``bed``: the test bed (None: loopback)."""
    host = bed.address("ps") if bed is not None else "127.0.0.1"
    bind = f"tcp://{host}:{free_port() if bed is None else 5555 + int(chaos)}"
    ckdir = os.path.join(workdir, "ck")
    args = ["--liveness-timeout", str(a.liveness), "--checkpoint-dir", ckdir,
            "--checkpoint-every-steps", str(a.checkpoint_every)]

    def launcher(site: str) -> Launch:
        return functools.partial(bed.popen, site) if bed is not None else subprocess.Popen

    srv = ServerProcess(a.workers, args, bind=bind, log_level="INFO", popen=launcher("ps"), cwd=ROOT)
    env = {**os.environ, **srv.client_env()}
    keys_args = list(srv.argv[srv.argv.index("--keys"):srv.argv.index("--keys") + 4]) if "--keys" in srv.argv else []
    endpoint = srv.endpoint
    vfile = os.path.join(workdir, "versions.txt")
    mon = launcher("ps")([sys.executable, "-m", "bench.chaos", "monitor", endpoint, vfile,
                          "--max-seconds", str(a.max_seconds + 30)], cwd=ROOT, env=env,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def worker(rank: int, worker_id: int | None = None) -> subprocess.Popen:
        log = os.path.join(workdir, f"w{rank}.jsonl")
        extra = ["--worker-id", str(worker_id)] if worker_id is not None else []
        return launcher(f"w{rank}")(
            [sys.executable, "-m", "bench.live_worker", endpoint, "--rank", str(rank), "--world", str(a.workers),
             "--target-version", str(a.target), "--log", log, "--timeout", "5", "--hidden", str(a.hidden),
             "--step-sleep", str(a.step_sleep), "--max-steps", str(10 * a.target), *extra],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def worker_id(rank: int) -> int | None:
        path = os.path.join(workdir, f"w{rank}.jsonl")
        if not os.path.exists(path):
            return None
        with open(path) as f:
            joined = [json.loads(x) for x in f.read().splitlines() if '"joined"' in x]
        return joined[-1]["worker"] if joined else None

    t0 = time.monotonic()
    procs = {r: worker(r) for r in range(a.workers)}
    ids: dict[int, int] = {}  # rank -> worker id, read from the worker's log
    events: list[tuple[float, str]] = []
    back: dict[int, float] = {}
    turn, server_killed, lost = 0, False, 0
    reached: float | None = None
    started: float | None = None  # the first step: the schedule and the time to target count from it
    next_kill = float("inf")
    servers = [srv]
    try:
        while time.monotonic() - t0 < a.max_seconds:
            now = time.monotonic() - t0
            samples = _samples(vfile)
            if samples:
                if started is None:
                    first = next((t for t, v in samples if v >= 1), None)
                    if first is not None:
                        started = first - t0
                        next_kill = started + a.kill_every
                if reached is None and started is not None:
                    hit = next((t for t, v in samples if v >= a.target), None)
                    if hit is not None:
                        reached = hit - t0 - started
            if all(p.poll() is not None for p in procs.values()) and not back:
                break
            if chaos and now >= next_kill and reached is None:
                r = turn % a.workers
                turn += 1
                next_kill += a.kill_every
                if procs[r].poll() is None and worker_id(r) is not None:
                    ids[r] = worker_id(r)  # type: ignore[assignment]
                    procs[r].kill()
                    procs[r].wait()
                    back[r] = now + a.back_after
                    events.append((now, f"killed worker rank {r}"))
            for r, when in list(back.items()):
                if now >= when:
                    procs[r] = worker(r, ids[r])
                    del back[r]
                    events.append((now, f"restarted worker rank {r} asking for id {ids[r]}"))
            if (chaos and not server_killed and reached is None and started is not None
                    and now - started >= a.server_kill_at):
                server_killed = True
                before = max((v for _, v in samples), default=0)
                srv.kill()
                srv.wait(10)
                events.append((now, f"killed the server (last seen at version {before})"))
                srv = ServerProcess(a.workers, [*args, *keys_args], bind=bind, log_level="INFO", env=env,
                                    secure=True, popen=launcher("ps"), cwd=ROOT)
                servers.append(srv)
                resumed = next((int(x["version"]) for x in _json_lines(srv.logs())
                                if x.get("msg") == "resumed from checkpoint"), 0)
                lost = max(0, before - resumed)
                events.append((time.monotonic() - t0, f"server restarted from the checkpoint of version {resumed}"))
            time.sleep(POLL_S)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in [*procs.values(), mon]:
            if p is mon and p.poll() is None:
                p.kill()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for s in servers:
            s.close()
    samples = _samples(vfile)
    stall, prev_t, prev_v = 0.0, None, None
    end = t0 + started + reached if started is not None and reached is not None else float("inf")
    for t, v in samples:
        if started is None or t < t0 + started or t > end:
            continue  # start-up (workers import torch and join) and wind-down are not stalls
        if prev_v is None or v != prev_v:
            prev_t, prev_v = t, v
        elif prev_t is not None:
            stall = max(stall, t - prev_t)
    done = []
    for r in range(a.workers):
        path = os.path.join(workdir, f"w{r}.jsonl")
        lines = []
        if os.path.exists(path):
            with open(path) as f:
                lines = [json.loads(x) for x in f.read().splitlines() if x.strip()]
        done += [x for x in lines if x.get("done")]
    return {"run": "chaos" if chaos else "undisturbed", "time_to_target_s": reached, "steps_lost": lost,
            "longest_stall_s": round(stall, 2), "reconnects": sum(d.get("reconnects", 0) for d in done),
            "accuracy_min": min((d["accuracy"] for d in done), default=None),
            "accuracy_max": max((d["accuracy"] for d in done), default=None),
            "events": [(round(t, 2), e) for t, e in events],
            "versions": [(round(t - t0, 1), v) for i, (t, v) in enumerate(samples) if i % 10 == 0],
            "server_log_tail": [x for x in _json_lines(servers[-1].logs())
                                if x.get("level") == "warning" or "gone" in str(x.get("msg"))][-30:]}


def _testbed(a: argparse.Namespace) -> tuple[Any, str]:
    """The test bed for the runs, or (None, why not) for loopback."""
    if a.loopback:
        return None, "loopback (--loopback)"
    from bench.wan import Link, WanTestbed
    from bench.wan.testbed import TestbedError

    sites = {"ps": Link(a.ps_rate, a.ps_rate), **{f"w{r}": Link(a.rate, a.rate) for r in range(a.workers)}}
    try:
        bed = WanTestbed(sites, max_lifetime=a.repeat * 2 * (a.max_seconds + 120) + 60).start()
    except TestbedError as e:
        print(f"NOTE: no slow-link test bed ({e}); running on loopback", file=sys.stderr)
        return None, f"loopback (no test bed: {e})"
    return bed, f"test bed: workers at {a.rate:g} Mbit/s each way, server at {a.ps_rate:g}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["monitor"]:
        m = argparse.ArgumentParser(prog="python -m bench.chaos monitor")
        m.add_argument("endpoint")
        m.add_argument("out")
        m.add_argument("--max-seconds", type=float, default=600.0)
        ma = m.parse_args(argv[1:])
        return monitor(ma.endpoint, ma.out, ma.max_seconds)
    p = argparse.ArgumentParser(prog="python -m bench.chaos")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--target", type=int, default=1500, help="server version to reach")
    p.add_argument("--hidden", type=int, default=64, help="hidden width of the workers' MLP")
    p.add_argument("--step-sleep", type=float, default=0.03,
                   help="seconds of stand-in 'GPU compute' per step (a sleep: no CPU, so that on a small machine "
                        "a killed worker does not speed the others up by freeing a core)")
    p.add_argument("--rate", type=float, default=20.0, help="Mbit/s of each worker site's link, each way")
    p.add_argument("--ps-rate", type=float, default=100.0, help="Mbit/s of the server site's link, each way")
    p.add_argument("--loopback", action="store_true", help="loopback instead of the test bed")
    p.add_argument("--liveness", type=float, default=2.0, help="--liveness-timeout of the server")
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--kill-every", type=float, default=15.0, help="seconds between worker kills (from the first step)")
    p.add_argument("--back-after", type=float, default=5.0, help="seconds until a killed worker is started again")
    p.add_argument("--server-kill-at", type=float, default=20.0, help="seconds after the first step")
    p.add_argument("--max-seconds", type=float, default=400.0)
    p.add_argument("--repeat", type=int, default=1, help="undisturbed/chaos pairs to run")
    p.add_argument("--quick", action="store_true", help="target 500, a kill every 8 s, the server at 6 s")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    if a.quick:
        a.target, a.kill_every, a.back_after, a.server_kill_at = 500, 8.0, 3.0, 6.0
    bed, network = _testbed(a)
    rows = []
    try:
        for _ in range(a.repeat):
            for chaos in (False, True):
                with tempfile.TemporaryDirectory(prefix="stella-chaos-") as d:
                    rows.append(run(chaos, a, d, bed))
    finally:
        if bed is not None:
            bed.close()
    ratios = []
    for i in range(0, len(rows), 2):
        base, hit = rows[i]["time_to_target_s"], rows[i + 1]["time_to_target_s"]
        ratios.append(hit / base if base and hit else None)
    print(f"network: {network}; {a.workers} workers, target version {a.target}")
    print(f"{'run':<12} {'to target s':>11} {'steps lost':>10} {'longest stall s':>15} {'reconnects':>10} "
          f"{'accuracy':>13}")
    for r in rows:
        tt = f"{r['time_to_target_s']:.1f}" if r["time_to_target_s"] else "never"
        acc = f"{r['accuracy_min']:.3f}-{r['accuracy_max']:.3f}" if r["accuracy_min"] is not None else "-"
        print(f"{r['run']:<12} {tt:>11} {r['steps_lost']:>10} {r['longest_stall_s']:>15} {r['reconnects']:>10} "
              f"{acc:>13}")
    ok = [x for x in ratios if x is not None]
    print("chaos / undisturbed time to target: " + ", ".join(f"{x:.2f}x" if x else "not reached" for x in ratios)
          + (f"; median {statistics.median(ok):.2f}x (goal <= 1.25x)" if ok else ""))
    for r in rows[1::2]:
        for t, e in r["events"]:
            print(f"  {t:7.2f}s  {e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "ratios": ratios, "median_ratio": statistics.median(ok) if ok else None,
                       "network": network, "workers": a.workers, "target_version": a.target}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
