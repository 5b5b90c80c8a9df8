"""A long job with churn: ``python -m bench.soak [--minutes 60] [--json PATH]``.

Issue 45's soak, on the slow-link test bed (``bench/wan``; needs root and network
namespaces): ``--workers`` sites (``bench.live_worker``: the digits MLP, update mode,
AdamW) at ``--rate`` Mbit/s each, the server's site at ``--ps-rate``, a ``stella-ps``
with ``--checkpoint-dir``, trained for ``--minutes`` from its first step. Every ``--every`` seconds one
fault, in turn (none later than ``--every`` s before the end):

1. a worker killed (SIGKILL) and started again ``--back-after`` s later with its id;
2. a worker replaced: killed, and a new process (no id: a new worker) started;
3. the server killed (SIGKILL) and started again at once from its checkpoint;
4. a site cut off for ``--cut`` seconds (its port on the hub down), then restored.

First, an undisturbed run of ``--reference-minutes`` gives the job's pace (versions a
second, after a warm-up); the soak's pace over its whole length, against it, is its
time to any version against an undisturbed run's (the goal: <= 1.15x). Reported:
that ratio, the steps lost (versions a restarted server went back), the longest stall
(the version not moving, from the monitor's 0.2 s polls), each server process's RSS
and open descriptors after its warm-up and at its end (the longest-lived one is the
leak test: <= 1.1x), the workers' reconnects, and every warning and error line of the
servers and workers, counted by message.
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench.chaos import ROOT, _json_lines, _samples
from bench.harness import loadavg
from stella_ps.process import ServerProcess

WARMUP_S = 20.0  # after a server (re)starts: imports done, workers back, steps flowing
START_LIMIT_S = 120.0  # a run whose first step has not come by then ends there (its pace is none)
FAULTS = ("restart a worker", "replace a worker", "restart the server", "cut a site")


def proc_usage(pid: int) -> dict[str, int] | None:
    """A process's resident memory (kB) and open descriptors, from /proc (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(x.split()[1]) for x in f if x.startswith("VmRSS:"))
        return {"rss_kb": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}
    except (OSError, StopIteration, ValueError):
        return None


class Job:
    """A server, its monitor and ``workers`` live workers on the test bed."""

    def __init__(self, bed: Any, a: argparse.Namespace, workdir: str):
        self.bed, self.a, self.workdir = bed, a, workdir
        self.bind = f"tcp://{bed.address('ps')}:5555"
        self.args = ["--liveness-timeout", str(a.liveness), "--checkpoint-dir", os.path.join(workdir, "ck"),
                     "--checkpoint-every-steps", str(a.checkpoint_every)]
        self.servers: list[dict[str, Any]] = []  # each server process: its usage after warm-up and at its end
        self.env: dict[str, str] = {}
        self.srv = self._server(None)
        self.env = {**os.environ, **self.srv.client_env()}
        self.keys = self.srv.key_args()  # a restarted server uses the same keys (or the environment's)
        self.vfile = os.path.join(workdir, "versions.txt")
        self.mon = bed.popen("ps", [sys.executable, "-m", "bench.chaos", "monitor", self.srv.endpoint, self.vfile,
                                    "--max-seconds", str(a.minutes * 60 + a.reference_minutes * 60 + 300)],
                             cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        self.procs: dict[int, subprocess.Popen] = {}
        self.logs: list[str] = []  # every worker process's log file
        self.errs: list[str] = []  # ... and its stderr
        self.lost = 0
        for r in range(a.workers):
            self.procs[r] = self.worker(r)

    def _server(self, keys: list[str] | None) -> ServerProcess:
        """The first server (``keys`` None: it makes the job's keys), or a restart with the same."""
        kw: dict[str, Any] = {"env": self.env, "secure": True} if keys is not None else {}
        srv = ServerProcess(self.a.workers, [*self.args, *(keys or [])], bind=self.bind, log_level="INFO",
                            popen=functools.partial(self.bed.popen, "ps"), cwd=ROOT, **kw)
        self.servers.append({"pid": srv.pid, "started": time.monotonic(), "ended": None, "warm": None, "end": None,
                             "proc": srv})
        return srv

    def worker(self, rank: int, worker_id: int | None = None) -> subprocess.Popen:
        n = len(self.logs)
        log, err = os.path.join(self.workdir, f"w{rank}-{n}.jsonl"), os.path.join(self.workdir, f"w{rank}-{n}.err")
        self.logs.append(log)
        self.errs.append(err)
        extra = ["--worker-id", str(worker_id)] if worker_id is not None else []
        with open(err, "w") as e:
            return self.bed.popen(
                f"w{rank}", [sys.executable, "-m", "bench.live_worker", self.srv.endpoint, "--rank", str(rank),
                             "--world", str(self.a.workers), "--target-version", str(10**9), "--max-steps",
                             str(10**9), "--log", log, "--timeout", "10", "--step-sleep", str(self.a.step_sleep),
                             *extra], cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL, stdout=e, stderr=e)

    def worker_id(self, rank: int) -> int | None:
        for log in reversed(self.logs):
            if os.path.basename(log).startswith(f"w{rank}-") and os.path.exists(log):
                with open(log) as f:
                    joined = [json.loads(x) for x in f.read().splitlines() if '"joined"' in x]
                if joined:
                    return int(joined[-1]["worker"])
        return None

    def sample_servers(self) -> None:
        """Each live server's usage: once after its warm-up, and its latest (its end's, once it is gone)."""
        now = time.monotonic()
        for s in self.servers:
            use = proc_usage(s["pid"])
            if use is None:
                continue
            if s["warm"] is None and now - s["started"] >= WARMUP_S:
                s["warm"] = use
            if s["warm"] is not None:
                s["end"] = use

    def restart_server(self) -> str:
        before = max((v for _, v in _samples(self.vfile)), default=0)
        self.sample_servers()
        self.srv.kill()
        self.srv.wait(10)
        self.servers[-1]["ended"] = time.monotonic()
        self.srv = self._server(self.keys)
        resumed = next((int(x["version"]) for x in _json_lines(self.srv.logs())
                        if x.get("msg") == "resumed from checkpoint"), 0)
        self.lost += max(0, before - resumed)
        return f"restarted the server: version {before} -> resumed from {resumed}"

    def close(self) -> dict[int, int | None]:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes: dict[int, int | None] = {}
        for r, p in self.procs.items():
            try:
                codes[r] = p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                codes[r] = None
        self.sample_servers()
        self.servers[-1]["ended"] = time.monotonic()
        if self.mon.poll() is None:
            self.mon.kill()
        self.mon.wait()
        for s in self.servers:
            s["proc"].close()
        return codes


def _pace(samples: list[tuple[float, int]], t_from: float, t_to: float) -> float | None:
    inside = [(t, v) for t, v in samples if t_from <= t <= t_to]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def _stall(samples: list[tuple[float, int]], t_from: float, t_to: float = float("inf")) -> float:
    """The longest time the version did not move between ``t_from`` and ``t_to`` (the run's
    end: after it the workers are stopped and the monitor sees the last version stand, which
    is no stall of the job's; until 2026-12-02 that end was counted, 2.17 s in an hour's
    undisturbed reference run)."""
    stall, since, last = 0.0, None, None
    for t, v in samples:
        if t < t_from:
            continue
        if t > t_to:
            break
        if last is None or v != last:
            since, last = t, v
        elif since is not None:
            stall = max(stall, t - since)
    return stall


def run(bed: Any, a: argparse.Namespace, minutes: float, churn: bool) -> dict[str, Any]:
    workdir = tempfile.mkdtemp(prefix=f"stella-soak-{'churn' if churn else 'ref'}-")
    job = Job(bed, a, workdir)
    t0, t0_wall = time.monotonic(), time.time()
    events: list[tuple[float, str]] = []
    back: dict[int, tuple[float, int | None]] = {}
    turn, started = 0, None
    # the run's length counts from its first step, not from its start: on a loaded machine the
    # workers' start (imports, handshakes) took more than 10 s, and a 30 s reference run then had
    # no time left after its warm-up to measure a pace (CI, 2026-12-02)
    stop_at = START_LIMIT_S  # seconds after t0: until the first step, the wait for it; then the run's end
    try:
        while True:
            time.sleep(0.5)
            now = time.monotonic() - t0
            if now >= stop_at:
                break
            job.sample_servers()
            if started is None:
                first = next((t for t, v in _samples(job.vfile) if v >= 1), None)
                started = None if first is None else first - t0
                next_fault = (started or 0.0) + a.every
                if started is not None:
                    stop_at = started + minutes * 60
                continue
            for r, (when, wid) in list(back.items()):
                if now >= when:
                    job.procs[r] = job.worker(r, wid)
                    del back[r]
                    events.append((now, f"worker rank {r} started again" + (f" as id {wid}" if wid is not None
                                                                             else ", a new worker")))
            if not churn or now < next_fault or back:
                continue
            if now + a.every > stop_at:
                continue  # each fault has its interval to recover in before the run ends (a worker started
                # again 2 s before the end was stopped by SIGTERM in its imports: no clean exit to count)
            kind = a.faults[turn % len(a.faults)]
            r = (turn // len(a.faults)) % a.workers
            turn += 1
            next_fault = now + a.every
            if kind == "restart a worker" or kind == "replace a worker":
                wid = job.worker_id(r)
                job.procs[r].kill()
                job.procs[r].wait()
                back[r] = (now + a.back_after, wid if kind == "restart a worker" else None)
                events.append((now, f"{kind}: rank {r} (id {wid}) killed"))
            elif kind == "restart the server":
                events.append((now, job.restart_server()))
            else:
                bed.set_link(f"w{r}", False)
                events.append((now, f"cut site w{r} for {a.cut:g} s"))
                time.sleep(a.cut)
                bed.set_link(f"w{r}", True)
                events.append((time.monotonic() - t0, f"site w{r} restored"))
    finally:
        codes = job.close()
    samples = _samples(job.vfile)
    begin = t0 + (started or 0.0)
    end = begin + minutes * 60
    warm = begin + WARMUP_S
    out: dict[str, Any] = {
        "run": "churn" if churn else "undisturbed", "minutes": minutes, "workdir": workdir,
        "versions": samples[-1][1] if samples else 0, "pace": _pace(samples, warm, end),
        "steps_lost": job.lost, "longest_stall_s": round(_stall(samples, warm, end), 2), "exit": codes,
        "events": [(round(t, 1), e) for t, e in events]}
    reconnects, done = 0, 0
    lines: collections.Counter[str] = collections.Counter()
    for log, err in zip(job.logs, job.errs):
        if os.path.exists(log):
            with open(log) as f:
                for x in f.read().splitlines():
                    if '"done"' in x:
                        d = json.loads(x)
                        reconnects += d.get("reconnects", 0)
                        done += 1
        if os.path.exists(err):
            with open(err, errors="replace") as f:
                for x in f.read().splitlines():
                    if "Error" in x or "Traceback" in x or "WARNING" in x or "warning" in x.lower():
                        lines[f"worker: {x.strip()[:160]}"] += 1
    clipped = []  # each clipped push: when (s into the run, as the events), whose, its norm against the bound
    for srv in job.servers:
        for rec in _json_lines(srv["proc"].logs()):
            if rec.get("level") in ("warning", "error", "critical"):
                lines[f"server {rec.get('level')}: {rec.get('msg')}"] += 1
            if rec.get("msg") == "push clipped":
                clipped.append({"t": round(rec.get("ts", t0_wall) - t0_wall, 1), "worker": rec.get("worker"),
                                "norm": rec.get("norm"), "bound": rec.get("bound"), "limit": rec.get("limit"),
                                "final": rec.get("final")})
    out.update(reconnects=reconnects, clean_exits=done, messages=dict(lines.most_common()), clipped=clipped,
               servers=[{"lived_s": round(s["ended"] - s["started"], 1), "warm": s["warm"], "end": s["end"]}
                        for s in job.servers])
    longest = max(job.servers, key=lambda s: s["ended"] - s["started"] if s["warm"] and s["end"] else -1.0)
    if longest["warm"] and longest["end"]:
        out["server_longest_lived_s"] = round(longest["ended"] - longest["started"], 1)
        out["server_rss_ratio"] = round(longest["end"]["rss_kb"] / longest["warm"]["rss_kb"], 3)
        out["server_fds_ratio"] = round(longest["end"]["fds"] / longest["warm"]["fds"], 3)
    return out


def render(ref: dict[str, Any], soak: dict[str, Any], a: argparse.Namespace) -> str:
    ratio = (ref["pace"] / soak["pace"]) if ref.get("pace") and soak.get("pace") else None
    rows = [
        ("time to a version, churn / undisturbed", f"{ratio:.3f}x" if ratio else "n/a", "<= 1.15x"),
        ("versions (undisturbed pace, churn pace)", f"{ref.get('pace') or 0:.2f}/s, {soak.get('pace') or 0:.2f}/s "
         f"({soak['versions']} in {soak['minutes']:g} min)", ""),
        ("faults", str(len([e for e in soak["events"] if "killed" in e[1] or "restarted the" in e[1]
                            or "cut site" in e[1]])), f"one every {a.every:g} s, in turn: {', '.join(a.faults)}"),
        ("steps lost (server restarts)", str(soak["steps_lost"]), ""),
        ("longest stall", f"{soak['longest_stall_s']} s", ""),
        ("server RSS, end / after warm-up (longest-lived)", f"{soak.get('server_rss_ratio', 'n/a')}",
         f"<= 1.1x ({soak.get('server_longest_lived_s', 'n/a')} s)"),
        ("server descriptors, end / after warm-up", f"{soak.get('server_fds_ratio', 'n/a')}", "<= 1.1x"),
        ("workers' reconnects", str(soak["reconnects"]), ""),
        ("clean exits at the end (SIGTERM)", f"{sum(c == 0 for c in soak['exit'].values())}/{len(soak['exit'])}", ""),
    ]
    out = [" | ".join(r) for r in rows]
    out.append("warning and error lines (count):")
    out += [f"  {n} x {m}" for m, n in soak["messages"].items()] or ["  none"]
    return "\n".join(out)


def _faults(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in FAULTS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"faults are some of {', '.join(FAULTS)}; not {unknown or text!r}")
    return kinds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--reference-minutes", type=float, default=None, help="the undisturbed run (default: "
                   "a quarter of --minutes, at most 8)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rate", type=float, default=50.0, help="Mbit/s of each worker site, each way")
    p.add_argument("--ps-rate", type=float, default=1000.0)
    p.add_argument("--every", type=float, default=120.0, help="seconds between faults")
    p.add_argument("--faults", type=_faults, default=FAULTS, help="the faults, in turn, comma-separated (default: "
                   f"{','.join(FAULTS)}; without 'restart the server' one server lives the whole run)")
    p.add_argument("--back-after", type=float, default=5.0, help="a killed worker starts again this much later")
    p.add_argument("--cut", type=float, default=30.0, help="seconds a cut site is off")
    p.add_argument("--liveness", type=float, default=20.0)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--step-sleep", type=float, default=0.05, help="extra 'compute' per step, seconds")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    if a.reference_minutes is None:
        a.reference_minutes = min(8.0, a.minutes / 4)
    from bench.wan import Link, WanTestbed

    load = loadavg()
    sites = {"ps": Link(a.ps_rate, a.ps_rate), **{f"w{r}": Link(a.rate, a.rate) for r in range(a.workers)}}
    with WanTestbed(sites, max_lifetime=(a.minutes + a.reference_minutes) * 60 + 900) as bed:
        ref = run(bed, a, a.reference_minutes, churn=False)
        print(json.dumps({k: ref[k] for k in ("run", "pace", "versions", "longest_stall_s")}), flush=True)
    with WanTestbed(sites, max_lifetime=a.minutes * 60 + 900) as bed:
        soak = run(bed, a, a.minutes, churn=True)
    print(f"load {load} at the start; {a.workers} workers (digits MLP) at {a.rate:g} Mbit/s, the server at "
          f"{a.ps_rate:g}; {a.minutes:g} min with churn against {a.reference_minutes:g} min undisturbed")
    print(render(ref, soak, a))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"reference": ref, "soak": soak, "args": vars(a), "load": load}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
