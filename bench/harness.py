"""What the benchmark runners share: worker processes, per-iteration records, summaries.

Both multi-process runners, ``bench.baselines.run_ddp`` (DDP over gloo) and
``bench.stella_e2e.run_stella`` (stella-ps + Stella workers), use the same pieces, so
their numbers are taken the same way:

- :func:`launch_workers` starts one ``python -m bench.<module> worker ...`` per rank
  from the repository root (``cwd``), on loopback or in a test-bed site, each with
  its own log file; :func:`wait_workers` waits for them against one deadline and
  kills whatever is left; :func:`collect_ranks` reads the JSON every rank wrote.
- In the worker, :class:`TrainClock` keeps the training wall clock without the
  held-out evaluations, and :class:`IterRecorder` writes one record per iteration
  (forward / backward / optimizer / iteration time and, inside a test bed, the bytes
  that crossed the site's veth, :func:`veth_counters`).
- :func:`summarize` turns the ranks' records into the result dict ``bench.e2e``
  tabulates (keys described in docs/testbed.md); :func:`fmt_summary` prints one line.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import queue as queues
import statistics
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["REPO", "veth_counters", "site_iface", "IterRecorder", "TrainClock", "evaluation_stalls", "clear_of",
           "launch_workers", "wait_workers", "collect_ranks", "log_tails", "summarize", "fmt_summary"]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # cwd of every child: `-m bench.X` resolves
WARMUP_ITERS = 2  # left out of the medians (DDP bucket rebuild, PowerSGD start, first pulls)


# ============================================================ inside a worker


def veth_counters(iface: str | None):
    """``(tx_bytes, rx_bytes)`` of network interface ``iface`` (kernel counters), or
    ``None`` without an interface or when it cannot be read. Inside a test-bed site,
    ``ip netns exec`` remounts ``/sys`` so these are the site's own veth."""
    if not iface:
        return None
    base = f"/sys/class/net/{iface}/statistics/"
    try:
        with open(base + "tx_bytes") as f:
            tx = int(f.read())
        with open(base + "rx_bytes") as f:
            rx = int(f.read())
        return tx, rx
    except OSError:
        return None


def site_iface() -> str | None:
    """The site's veth when this process runs in a test-bed site, else ``None`` (loopback:
    no byte counts, since every process shares ``lo``)."""
    return os.environ.get("STELLA_WAN_IFACE") if os.environ.get("STELLA_WAN_SITE") else None


class IterRecorder:
    """One record per training iteration, appended to :attr:`iters`::

        rec.begin()                  # before the iteration (reads the byte counters)
        ...forward...;  rec.lap()
        ...backward...; rec.lap()
        ...optimizer...
        r = rec.end(step, loss)      # {"step", "loss", "fwd", "bwd", "opt", "iter"[, "bytes_up", "bytes_down"]}

    The caller adds its own fields (``compute``, ``net_wait``, ...) to the returned
    dict, which is the record itself.
    """

    def __init__(self, iface: str | None = None):
        self.iface = iface
        self.iters: list[dict] = []
        self._marks: list[float] = []
        self._c0 = None

    def begin(self) -> None:
        self._c0 = veth_counters(self.iface)
        self._marks = [time.perf_counter()]

    def lap(self) -> None:
        self._marks.append(time.perf_counter())

    def end(self, step: int, loss: float) -> dict:
        t0, t1, t2 = self._marks
        t3 = time.perf_counter()
        rec = {"step": step, "loss": loss, "fwd": t1 - t0, "bwd": t2 - t1, "opt": t3 - t2, "iter": t3 - t0}
        c1 = veth_counters(self.iface)
        if self._c0 and c1:
            rec["bytes_up"], rec["bytes_down"] = c1[0] - self._c0[0], c1[1] - self._c0[1]
        self.iters.append(rec)
        return rec


class TrainClock:
    """Training wall clock that leaves out held-out evaluations, and the evaluations
    themselves (``evals``; ``reached``: the first one that met the target)."""

    def __init__(self, wl, model):
        self.wl, self.model = wl, model
        self.evals: list[dict] = []
        self.reached: dict | None = None
        self._eval_time = 0.0
        self._t0 = time.perf_counter()

    def wall(self) -> float:
        return time.perf_counter() - self._t0 - self._eval_time

    def evaluate(self, step: int) -> float:
        t = time.perf_counter()
        m = self.wl.evaluate(self.model)
        self._eval_time += time.perf_counter() - t
        self.evals.append({"step": step, "wall": self.wall(), "metric": m})
        if self.reached is None and self.wl.reached(m):
            self.reached = {"step": step, "wall": self.evals[-1]["wall"]}
        return m


def evaluation_stalls(rank0: Mapping[str, Any], settle_s: float) -> list[tuple[float, float]]:
    """The epoch spans in which worker 0 held the job up to evaluate (between the step it
    evaluated after and its next one), each stretched by ``settle_s`` after its end: while
    worker 0 evaluates the others finish the step in hand, push, and wait for its push, so a
    wait there is the benchmark's, not the link's."""
    evals = {e["step"] for e in rank0.get("evals", [])}
    its = rank0.get("iters") or []
    return [(a["t_epoch"], b["t_epoch"] - b["iter"] + settle_s) for a, b in itertools.pairwise(its)
            if a["step"] in evals]


def clear_of(x: Mapping[str, Any], stalls: Sequence[tuple[float, float]]) -> bool:
    """Whether iteration record ``x`` (its ``t_epoch`` end and ``iter`` length) overlaps none of ``stalls``."""
    lo, hi = x["t_epoch"] - x["iter"], x["t_epoch"]
    return not any(lo < end and hi > begin for begin, end in stalls)


# ============================================================ the launcher side


def loadavg() -> str:
    """The 1-, 5- and 15-minute load averages, for a benchmark's record of how quiet it ran."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def await_ready(queue, workers: int, timeout: float = 300.0, procs: Sequence[Any] = ()) -> None:
    """Wait for ``workers`` ``("ready", ...)`` messages on a multiprocessing queue; a
    worker process of ``procs`` that exits first fails the wait at once."""
    deadline = time.monotonic() + timeout
    got = 0
    while got < workers:
        try:
            msg = queue.get(timeout=1.0)
        except queues.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"{len(dead)} worker process(es) exited before they were ready "
                                   f"(exit code {dead[0].exitcode}; their traceback is above)") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"{got} of {workers} workers ready after {timeout:.0f} s") from None
            continue
        if msg[0] != "ready":
            raise RuntimeError(f"worker failed to start: {msg}")
        got += 1


def launch_workers(argvs: Sequence[Sequence[str]], log_dir: str, *, bed=None,
                   sites: Sequence[str] | None = None) -> list[subprocess.Popen]:
    """Start rank ``r`` as ``argvs[r]`` (``python -m bench.X worker ...``) from the
    repository root, output to ``log_dir/rank<r>.log``; with a test bed ``bed``, in
    site ``sites[r]`` (with ``STELLA_WAN_*`` and rank/world in its environment),
    otherwise on loopback in its own session."""
    world = len(argvs)
    procs: list[subprocess.Popen] = []
    try:
        for r, argv in enumerate(argvs):
            with open(os.path.join(log_dir, f"rank{r}.log"), "w") as log:
                if bed is not None:
                    assert sites is not None, "a test bed needs each rank's site"
                    p = bed.popen(sites[r], list(argv), rank=r, world=world, stdout=log, stderr=subprocess.STDOUT,
                                  cwd=REPO)
                else:
                    p = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                         start_new_session=True)
            procs.append(p)
    except BaseException:
        wait_workers(procs, 0.0)
        raise
    return procs


def wait_workers(procs: Sequence[subprocess.Popen], timeout: float) -> list[int | None]:
    """Wait for every process until one shared deadline ``timeout`` s from now; returns
    their exit codes, ``None`` for those still running then. Whatever is still running
    at the end (also on Ctrl-C or an error) is killed with its process group."""
    deadline = time.monotonic() + timeout
    rcs: list[int | None] = []
    try:
        for p in procs:
            try:
                rcs.append(p.wait(timeout=max(0.01, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                rcs.append(None)
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, 9)
                except ProcessLookupError:
                    pass
                except PermissionError:  # pragma: no cover - not its own group leader
                    p.kill()
                p.wait()
    return rcs


def collect_ranks(log_dir: str, world: int) -> list[dict | None]:
    """The JSON each rank wrote to ``log_dir/rank<r>.json`` (``None`` where missing or torn)."""
    import json

    ranks: list[dict | None] = []
    for r in range(world):
        try:
            with open(os.path.join(log_dir, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
        except (OSError, ValueError):
            ranks.append(None)
    return ranks


def log_tails(log_dir: str, rcs: Sequence[int | None], lines: int = 15) -> str:
    """The last ``lines`` lines of every rank's log, headed by its exit code."""
    out = []
    for r, rc in enumerate(rcs):
        try:
            with open(os.path.join(log_dir, f"rank{r}.log"), errors="replace") as f:
                tail = "".join(f.readlines()[-lines:])
        except OSError as e:
            tail = f"(no log: {e})\n"
        out.append(f"--- rank {r} (rc={rc}) ---\n{tail}")
    return "\n".join(out)


def summarize(system: str, workload: str, ranks: list[dict], wl) -> dict:
    """The result of one job from its ranks' records (rank 0's times and evaluations,
    bytes as the mean over ranks of each rank's median)."""
    r0 = ranks[0]
    iters = r0["iters"]
    skip = min(WARMUP_ITERS, max(0, len(iters) - 1))
    steady = iters[skip:] or iters

    def med(key):
        return statistics.median(x[key] for x in steady) if steady else None

    def bytes_med(key):
        vals = [statistics.median(x[key] for x in (r["iters"][skip:] or r["iters"])) for r in ranks
                if r["iters"] and key in r["iters"][0]]
        return statistics.mean(vals) if vals else None

    evals = r0["evals"]
    tl = r0.get("timeline", {})
    startup = None
    if tl and r0.get("launched"):
        t = r0["launched"]
        startup = {k: round(v - t, 3) for k, v in tl.items()}
    return {
        "startup": startup,  # seconds since launch: python+torch imports, gloo rendezvous, DDP broadcast, ...
        "system": system, "workload": workload, "ok": True, "world": len(ranks),
        "steps": r0["steps"], "train_wall": r0["train_wall"],
        "iter_median": med("iter"), "compute_median": med("compute"),
        "net_wait_fraction": (sum(x["net_wait"] for x in steady) / sum(x["iter"] for x in steady)) if steady else None,
        "bytes_up_median": bytes_med("bytes_up"), "bytes_down_median": bytes_med("bytes_down"),
        "bytes_source": "veth counters" if iters and "bytes_up" in iters[0] else None,
        "final_metric": evals[-1]["metric"] if evals else None, "metric": wl.metric,
        "target": wl.target, "reached": r0["reached"], "evals": evals,
        "per_iter": [{k: x.get(k) for k in ("step", "iter", "compute", "net_wait", "bytes_up", "bytes_down", "loss")}
                     for x in iters],
        "per_rank_bytes": [{"up_total": sum(x.get("bytes_up", 0) for x in r["iters"]),
                            "down_total": sum(x.get("bytes_down", 0) for x in r["iters"])} for r in ranks],
    }


def fmt_summary(r: dict) -> str:
    if not r.get("ok"):
        return f"{r['workload']:>8} {r['system']:>22}  FAILED\n{r.get('error', '')}"

    def mb(v):
        return "n/a" if v is None else f"{v / 1e6:.2f}"

    reach = r["reached"]
    return (f"{r['workload']:>8} {r['system']:>22}  steps {r['steps']:4d}  iter {r['iter_median']:.3f}s  "
            f"compute {r['compute_median']:.3f}s  net-wait {100 * r['net_wait_fraction']:.0f}%  "
            f"MB/iter up {mb(r['bytes_up_median'])} down {mb(r['bytes_down_median'])}  "
            f"{r['metric']} {r['final_metric']:.4f}  "
            f"target@{'-' if not reach else '{} it / {:.1f} s'.format(reach['step'], reach['wall'])}")


def start_shards(stack: contextlib.ExitStack, shards: int, args: Sequence[str] = (), **kw: Any) -> list[Any]:
    """``shards`` ``stella-ps`` processes of one job (``--shard I/N`` when more than one,
    each with its share of this host's cores as ``--threads`` unless ``args`` says), closed
    with ``stack``; the others use the keys the first made (a job's shards share
    them), so the first's ``client_kwargs()`` reach every one."""
    from stella_ps.process import ServerProcess
    from stella_ps.runtime import default_threads

    if shards > 1 and "--threads" not in args:  # the shards share this host's cores, as an operator would split them
        args = [*args, "--threads", str(max(1, default_threads() // shards))]

    def start(i: int, more: Sequence[str]) -> Any:
        label = ["--shard", f"{i}/{shards}"] if shards > 1 else []
        return stack.enter_context(ServerProcess(args=[*args, *label, *more], **kw))

    first = start(0, ())
    return [first] + [start(i, first.key_args()) for i in range(1, shards)]
