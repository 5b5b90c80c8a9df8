"""Training while machines come and go: ``python -m bench.chaos [--quick] [--json PATH]``.

Two runs of the same job, on loopback (not the network-namespace test bed of
``bench/wan``: the point here is what the failures cost, and loopback keeps a run
short on a 2-core machine): ``--workers`` worker processes (``bench.live_worker``:
the demo's MLP on the digits, AdamW on the server, 5% top-k) train until the server's
version reaches ``--target``; a ``stella-ps`` with ``--checkpoint-dir`` and a short
liveness timeout.

- **undisturbed**: nothing happens.
- **chaos**: every ``--kill-every`` seconds one worker (in turn) is killed with
  SIGKILL and started again ``--back-after`` seconds later asking for its old id; the
  server is killed with SIGKILL once, at ``--server-kill-at`` seconds, and started again
  at once on the same port and checkpoint directory. Nobody intervenes otherwise:
  the workers reconnect by themselves.

The schedule and the times count from the run's first step (worker start-up, ~5-25 s
of importing torch on a loaded 2-core machine, is not part of either). Reported per
run: the time until the server's version first reached the target
(and the ratio chaos / undisturbed, the goal being <= 1.25), the steps lost (versions
the server went back on its restart), the longest stall (longest time the version
did not move between the first step and the target, as seen by a monitor polling
``status`` every 0.2 s), the reconnects of the workers running at the end and
the workers' held-out accuracy at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from stella import Client
from stella.errors import StellaError
from stella_ps.process import ServerProcess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def _status(endpoint: str, env: dict[str, str]) -> dict[str, Any] | None:
    try:
        with Client(endpoint, timeout=0.5, join=False, server_key=env.get("STELLA_SERVER_KEY"),
                    client_key=env.get("STELLA_CLIENT_KEY")) as c:
            return c.status(timeout=0.5)
    except StellaError:
        return None


def run(chaos: bool, a: argparse.Namespace, workdir: str) -> dict[str, Any]:
    port = _port()
    ckdir = os.path.join(workdir, "ck")
    args = ["--liveness-timeout", str(a.liveness), "--checkpoint-dir", ckdir,
            "--checkpoint-every-steps", str(a.checkpoint_every)]
    bind = f"tcp://127.0.0.1:{port}"
    srv = ServerProcess(a.workers, args, bind=bind, log_level="INFO")
    env = {**os.environ, **srv.client_env()}
    server_env = dict(env)
    keys_args = list(srv.argv[srv.argv.index("--keys"):srv.argv.index("--keys") + 4]) if "--keys" in srv.argv else []

    def worker(rank: int, worker_id: int | None = None) -> subprocess.Popen:
        log = os.path.join(workdir, f"w{rank}.jsonl")
        extra = ["--worker-id", str(worker_id)] if worker_id is not None else []
        return subprocess.Popen([sys.executable, "-m", "bench.live_worker", srv_endpoint, "--rank", str(rank),
                                 "--world", str(a.workers), "--target-version", str(a.target), "--log", log,
                                 "--timeout", "5", *extra], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    srv_endpoint = srv.endpoint
    t0 = time.monotonic()
    procs = {r: worker(r) for r in range(a.workers)}
    ids: dict[int, int] = {}  # rank -> worker id, read from the worker's log

    def worker_id(rank: int) -> int | None:
        path = os.path.join(workdir, f"w{rank}.jsonl")
        if not os.path.exists(path):
            return None
        with open(path) as f:
            joined = [json.loads(x) for x in f.read().splitlines() if '"joined"' in x]
        return joined[-1]["worker"] if joined else None
    events: list[tuple[float, str]] = []
    samples: list[tuple[float, int]] = []
    back: dict[int, float] = {}
    turn, server_killed, lost = 0, False, 0
    reached: float | None = None
    started: float | None = None  # the first step: the schedule and the time to target count from it
    next_kill = float("inf")
    servers = [srv]
    try:
        while time.monotonic() - t0 < a.max_seconds:
            now = time.monotonic() - t0
            st = _status(srv_endpoint, env)
            if st is not None:
                samples.append((now, int(st["version"])))
                if started is None and st["version"] >= 1:
                    started = now
                    next_kill = now + a.kill_every
                if reached is None and st["version"] >= a.target and started is not None:
                    reached = now - started
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
            if chaos and not server_killed and started is not None and now - started >= a.server_kill_at:
                server_killed = True
                before = max((v for _, v in samples), default=0)
                srv.kill()
                srv.wait(10)
                events.append((now, f"killed the server at version {before}"))
                srv = ServerProcess(a.workers, [*args, *keys_args], bind=bind, log_level="INFO", env=server_env,
                                    secure=True)
                servers.append(srv)
                st2 = _status(srv_endpoint, env)
                resumed = int(st2["version"]) if st2 else 0
                lost = before - resumed
                events.append((time.monotonic() - t0, f"server restarted from the checkpoint of version {resumed}"))
            time.sleep(0.2)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for s in servers:
            s.close()
    stall, prev_t, prev_v = 0.0, None, None
    end = started + reached if started is not None and reached is not None else float("inf")
    for t, v in samples:
        if started is None or t < started or t > end:
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
            "versions": [(round(t, 1), v) for i, (t, v) in enumerate(samples) if i % 10 == 0],
            "server_log_tail": [ln for ln in servers[-1].logs().splitlines() if "WARN" in ln.upper()
                                or "gone" in ln or "joined" in ln][-30:]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chaos")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--target", type=int, default=1500, help="server version to reach")
    p.add_argument("--liveness", type=float, default=2.0, help="--liveness-timeout of the server")
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--kill-every", type=float, default=15.0, help="seconds between worker kills (from the first step)")
    p.add_argument("--back-after", type=float, default=5.0, help="seconds until a killed worker is started again")
    p.add_argument("--server-kill-at", type=float, default=20.0, help="seconds after the first step")
    p.add_argument("--max-seconds", type=float, default=400.0)
    p.add_argument("--quick", action="store_true", help="target 500, a kill every 8 s, the server at 6 s")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    if a.quick:
        a.target, a.kill_every, a.back_after, a.server_kill_at = 500, 8.0, 3.0, 6.0
    rows = []
    for chaos in (False, True):
        with tempfile.TemporaryDirectory(prefix="stella-chaos-") as d:
            rows.append(run(chaos, a, d))
    base, hit = rows[0]["time_to_target_s"], rows[1]["time_to_target_s"]
    ratio = hit / base if base and hit else None
    print(f"{'run':<12} {'to target s':>11} {'steps lost':>10} {'longest stall s':>15} {'reconnects':>10} "
          f"{'accuracy':>13}")
    for r in rows:
        tt = f"{r['time_to_target_s']:.1f}" if r["time_to_target_s"] else "never"
        acc = f"{r['accuracy_min']:.3f}-{r['accuracy_max']:.3f}" if r["accuracy_min"] is not None else "-"
        print(f"{r['run']:<12} {tt:>11} {r['steps_lost']:>10} {r['longest_stall_s']:>15} {r['reconnects']:>10} "
              f"{acc:>13}")
    print(f"chaos / undisturbed time to target: {ratio:.2f}x (goal <= 1.25x)" if ratio else "target not reached")
    for t, e in rows[1]["events"]:
        print(f"  {t:7.2f}s  {e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "ratio": ratio, "network": "loopback", "workers": a.workers,
                       "target_version": a.target}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
