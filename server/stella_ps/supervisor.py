"""``stella-ps --shards N``: the shards of one job on one host, from one command.

One ``stella-ps`` is one event loop and one store thread: the receive, decode and
encode of every message run in Python under one interpreter lock, and the kernel's
pool helps only the apply and the broadcast. A CPU host of 16-64 cores is used by
running several servers, each holding a range of the flat model (:mod:`stella.shards`):
processes, not threads, so that nothing is shared but the host. Each shard is the
ordinary server, with all its behaviour (membership, liveness, checkpoints, metrics)
unchanged; this module only starts them, tells them and their clients where the
others are, and keeps them running.

**What each shard is given.** The supervisor's own command line is passed on whole,
and after it (argparse keeps a flag's last value) shard I's own settings:
``--shard I/N``; ``--bind`` on the port + I (with port 0 each picks one, which it
keeps when it is restarted); ``--metrics`` on the port + I (one endpoint per shard,
each labelled with its shard: Prometheus sums across targets, and each ``/healthz``
answers for one event loop); ``--checkpoint-dir DIR/I``; its share of ``--threads``
(0: of its cores, at most 8); ``--shard-list``, the file of the job's addresses that
the supervisor writes (its ``joined`` and ``status`` replies hand them out, so
workers and ``stella status`` need the first address only). With ``--pin-shards``
(the default) and at least as many cores as shards, each shard runs on a contiguous
share of the cores this process may use, set before it starts (its threads inherit
it).

**One job.** ``DIR/shards.json`` records the job's shard count: a restart resumes
every shard from its own checkpoint, ``--shards auto`` takes the recorded count (a
shard's checkpoint holds its range, which depends on the count), and another count
is refused, as is a directory that holds a single server's checkpoints.

**Keeping them running.** A shard that exits unasked is started again on the same
address, after 1 s, doubling to 30 s while it keeps failing (a shard up for 60 s is
well again); its workers reconnect as they do to any restarted server. The
supervisor gives up, stopping the job, when a shard fails 10 times in a row or
exits before it ever listened. SIGTERM and SIGINT stop every shard (each writes its
last checkpoint), SIGKILL after the daemon's own shutdown bound; SIGHUP is passed
on (the allowlist). The shards run in process groups of their own, so that only the
supervisor signals them; a shard also gets SIGTERM if the supervisor itself dies.

**Exit status**: 0 after a requested stop in which every shard stopped cleanly; 1
when a shard failed (did not start, failed too often, or did not stop cleanly); 2
for a bad configuration.

Standard library only: the supervisor holds no model and imports no numpy.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType

from .config import ServerConfig, parse_bind
from .errors import ConfigError

__all__ = ["Supervisor", "ShardPlan", "plan", "shard_count", "advertised", "JOB_FILE", "MAX_THREADS_PER_SHARD"]

log = logging.getLogger("stella_ps.supervisor")
JOB_FILE = "shards.json"  # in --checkpoint-dir: the job's shard count
MAX_THREADS_PER_SHARD = 8  # a server's pool gains little beyond (runtime.default_threads)
BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_S = 60.0  # a shard up this long starts its failure count afresh
MAX_FAILURES = 10  # failures in a row after which the supervisor gives up
POLL_S = 0.1
STOP_MARGIN_S = 15.0  # beyond the daemon's own shutdown bound, before SIGKILL
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ShardPlan:
    """What shard ``index`` of ``count`` is started with."""

    index: int
    count: int
    bind: str
    metrics: str | None
    checkpoint_dir: str | None
    threads: int
    cpus: tuple[int, ...] | None  # None: not pinned

    @property
    def label(self) -> str:
        return f"{self.index}/{self.count}"


def _cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return list(range(os.cpu_count() or 1))


def _job_count(directory: str | None) -> int | None:
    """The shard count recorded in ``directory`` (None: no job there yet)."""
    if not directory:
        return None
    try:
        with open(os.path.join(directory, JOB_FILE)) as f:
            n = json.load(f)["shards"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{os.path.join(directory, JOB_FILE)} cannot be read ({e}): it records the job's "
                          "shard count") from None
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"{os.path.join(directory, JOB_FILE)} records {n!r} shards")
    return n


def shard_count(cfg: ServerConfig, cores: int) -> tuple[int, str]:
    """The job's shard count and why: ``--shards N``, or ``auto``: the count of the job
    in ``--checkpoint-dir`` if it holds one, else one a core (the model, which bounds
    a useful count too, is not known before the workers register it)."""
    directory = cfg.checkpoints.dir
    recorded = _job_count(directory)
    if cfg.shards.count == "auto":
        if recorded is not None:
            return recorded, f"auto: the job in {directory} has {recorded} shards"
        return cores, (f"auto: one a core this process may use ({cores}); the model is not known at start, and "
                       "each shard needs a range of it (16 coordinates at least)")
    n = int(cfg.shards.count)
    if recorded is not None and recorded != n:
        raise ConfigError(f"{directory} holds the checkpoints of a job of {recorded} shards: --shards {recorded} "
                          f"resumes it (a shard's checkpoint holds its own range of the model, which the count "
                          f"decides); {n} shards need another --checkpoint-dir")
    return n, f"--shards {n}"


def _split(cores: Sequence[int], n: int) -> list[tuple[int, ...]]:
    """``cores`` in ``n`` contiguous shares, sizes differing by one at most."""
    q, r = divmod(len(cores), n)
    out, at = [], 0
    for i in range(n):
        size = q + (i < r)
        out.append(tuple(cores[at:at + size]))
        at += size
    return out


def plan(cfg: ServerConfig, n: int, cores: Sequence[int]) -> list[ShardPlan]:
    """Each shard's bind, metrics, checkpoint directory, threads and cores (module doc)."""
    host, _, port = cfg.bind[len("tcp://"):].rpartition(":")
    base = int(port)
    if base and base + n - 1 > 65535:
        raise ConfigError(f"--bind port {base} + {n} shards passes 65535")
    metrics_host, metrics_port = parse_bind(cfg.metrics) if cfg.metrics else ("", 0)
    if cfg.metrics and metrics_port and metrics_port + n - 1 > 65535:
        raise ConfigError(f"--metrics port {metrics_port} + {n} shards passes 65535")
    shares = _split(cores, n) if cfg.shards.pin and n <= len(cores) else None
    out = []
    for i in range(n):
        cpus = shares[i] if shares else None
        if cfg.threads:
            threads = max(1, cfg.threads // n)
        else:
            threads = max(1, min(MAX_THREADS_PER_SHARD, len(cpus) if cpus else len(cores) // n))
        metrics = f"{metrics_host}:{metrics_port + i if metrics_port else 0}" if cfg.metrics else None
        ckpt = os.path.join(cfg.checkpoints.dir, str(i)) if cfg.checkpoints.dir else None
        out.append(ShardPlan(i, n, f"tcp://{host}:{base + i if base else 0}", metrics, ckpt, threads, cpus))
    return out


def advertised(endpoint: str, advertise: str | None) -> str:
    """The shard list's entry for a shard bound at ``endpoint``: on the ``advertise``
    host, else ``*`` (the host the client reached the first shard at)."""
    port = endpoint.rpartition(":")[2]
    host = advertise or "*"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address
    return f"tcp://{host}:{port}"


def _write_atomically(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # readers never see a half-written file


_prctl: Callable[..., int] | None
try:  # the shards get SIGTERM when the supervisor dies, however it dies (Linux)
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _prctl = None


def _child_setup(cpus: tuple[int, ...] | None, parent: int) -> None:
    """Runs in the child between fork and exec (the supervisor has no other threads).
    A process group of its own: a terminal's Ctrl-C (or ``timeout``'s signal to the
    group) reaches the supervisor alone, which stops each shard once; a second signal
    after a shard's loop has ended would kill it on its way out."""
    os.setpgid(0, 0)
    if cpus:
        os.sched_setaffinity(0, cpus)
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the supervisor died before that took effect
            os._exit(1)


@dataclass
class _Shard:
    plan: ShardPlan
    ready_file: str
    proc: subprocess.Popen[bytes] | None = None
    endpoint: str | None = None  # as bound, once it listened (a restart binds it again)
    listening: bool = False  # this run of it has listened
    started_at: float = 0.0
    failures: int = 0  # in a row
    restarts: int = 0
    due: float | None = None  # when to start it again (monotonic)
    codes: list[int] = field(default_factory=list)  # exit statuses of its runs


class Supervisor:
    """Starts the shards of ``cfg`` (its ``shards`` group says how many), keeps them
    running and stops them (module doc). ``argv`` is the supervisor's own command line,
    passed on to every shard before its own flags; ``shard_stop_s`` the bound of a
    shard's own shutdown (the daemon's), after which (and a margin) it is killed."""

    def __init__(self, cfg: ServerConfig, argv: Sequence[str], *, shard_stop_s: float, python: str = sys.executable):
        self.cfg, self.argv, self.python = cfg, list(argv), python
        cores = _cores()
        self.count, why = shard_count(cfg, len(cores))
        if self.count > 1024:
            raise ConfigError(f"{self.count} shards: a job has at most 1024")
        self._check_directory()
        self.plans = plan(cfg, self.count, cores)
        self.grace_s = shard_stop_s + STOP_MARGIN_S
        self._tmp = tempfile.mkdtemp(prefix="stella-ps-shards-")
        self.shard_list = os.path.join(self._tmp, "shards")
        self.shards = [_Shard(p, os.path.join(self._tmp, f"{p.index}.endpoint")) for p in self.plans]
        self._stop_signal: int | None = None
        self._hup = False
        self.failed: str | None = None  # why the supervisor gave up
        pinned = self.plans[0].cpus is not None
        log.info("starting the shards of one job", extra={
            "shards": self.count, "why": why, "cores": len(cores), "pinned": pinned,
            "threads_per_shard": self.plans[0].threads})
        if cfg.shards.pin and not pinned:
            log.warning("more shards than cores: the shards share them, not pinned",
                        extra={"shards": self.count, "cores": len(cores)})

    def _check_directory(self) -> None:
        d = self.cfg.checkpoints.dir
        if d and _job_count(d) is None and os.path.isdir(d) and any(
                n.endswith(".stella-ckpt") for n in os.listdir(d)):
            raise ConfigError(f"{d} holds a single server's checkpoints: resume that job without --shards, or give "
                              "the sharded job another --checkpoint-dir")

    # ------------------------------------------------------------------ the shards
    def _argv(self, s: _Shard) -> list[str]:
        p = s.plan
        return [self.python, "-m", "stella_ps", *self.argv,
                "--shards", "", "--advertise", "",
                "--shard", p.label if p.count > 1 else "",
                "--shard-list", self.shard_list if p.count > 1 else "",
                "--bind", s.endpoint or p.bind,
                "--ready-file", s.ready_file,
                "--threads", str(p.threads),
                "--metrics", p.metrics or "",
                "--checkpoint-dir", p.checkpoint_dir or ""]

    def _start(self, s: _Shard) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(s.ready_file)
        cpus, parent = s.plan.cpus, os.getpid()
        s.proc = subprocess.Popen(self._argv(s), stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(),
                                  preexec_fn=lambda: _child_setup(cpus, parent))
        s.started_at, s.listening, s.due = time.monotonic(), False, None
        log.info("shard started", extra={"shard": s.plan.label, "pid": s.proc.pid, "bind": s.endpoint or s.plan.bind,
                                         "cpus": list(cpus) if cpus else None, "threads": s.plan.threads})

    def _listened(self, s: _Shard) -> bool:
        """Whether ``s`` listens now (it wrote its ready file); notes its endpoint."""
        if not s.listening and os.path.exists(s.ready_file):
            with open(s.ready_file) as f:
                s.endpoint = f.read().strip()
            s.listening = True
            log.info("shard listening", extra={"shard": s.plan.label, "endpoint": s.endpoint,
                                               "restarts": s.restarts})
        return s.listening

    def _exited(self, s: _Shard, code: int) -> None:
        """A shard exited unasked: start it again later, or give up on the job."""
        assert s.proc is not None
        s.codes.append(code)
        up = time.monotonic() - s.started_at
        s.failures = 1 if up >= STABLE_S else s.failures + 1
        s.proc = None
        if s.endpoint is None:
            self.failed = f"shard {s.plan.label} exited with status {code} before it listened"
        elif s.failures > MAX_FAILURES:
            self.failed = f"shard {s.plan.label} failed {s.failures} times in a row"
        if self.failed:
            log.error("giving up: stopping the job", extra={"why": self.failed})
            return
        delay = min(BACKOFF_MAX_S, BACKOFF_MIN_S * 2 ** (s.failures - 1))
        s.due = time.monotonic() + delay
        log.error("shard exited: starting it again", extra={
            "shard": s.plan.label, "status": code, "up_s": round(up, 1), "in_s": delay, "failures": s.failures})

    # ------------------------------------------------------------------ the job
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            self._hup = True
        else:
            self._stop_signal = signum

    def _publish(self, ready_file: str | None) -> None:
        """Once every shard listens: the shard list (when its ports were picked at start),
        the job's record in the checkpoint directory, and the supervisor's ready file."""
        endpoints = [s.endpoint for s in self.shards]
        assert all(endpoints)
        if self.count > 1 and not os.path.exists(self.shard_list):
            self._write_shard_list(endpoints)  # type: ignore[arg-type]
        d = self.cfg.checkpoints.dir
        if d:
            os.makedirs(d, exist_ok=True)
            _write_atomically(os.path.join(d, JOB_FILE), json.dumps({"shards": self.count}) + "\n")
        if ready_file:
            _write_atomically(ready_file, f"{endpoints[0]}\n")
        print(f"stella-ps listening on {endpoints[0]}", flush=True)
        print(f"stella-ps job of {self.count} shard{'s' if self.count > 1 else ''}: "
              f"{', '.join(str(e) for e in endpoints)}", flush=True)
        log.info("the job's shards listen", extra={"endpoints": endpoints})

    def _write_shard_list(self, endpoints: Sequence[str]) -> None:
        lines = [advertised(e, self.cfg.shards.advertise) for e in endpoints]
        _write_atomically(self.shard_list, "".join(line + "\n" for line in lines))

    def run(self) -> int:
        """Start the shards, keep them running until SIGTERM/SIGINT (or giving up), stop
        them; the exit status (module doc). Call from the main thread."""
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        try:
            return self._run()
        finally:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def _run(self) -> int:
        if self.count > 1 and all(not p.bind.endswith(":0") for p in self.plans):
            self._write_shard_list([p.bind for p in self.plans])  # known now: no shard answers without it
        for s in self.shards:
            self._start(s)
        published = False
        while self._stop_signal is None and self.failed is None:
            if self._hup:
                self._hup = False
                for s in self.shards:
                    if s.proc is not None and s.proc.poll() is None:
                        s.proc.send_signal(signal.SIGHUP)
            now = time.monotonic()
            for s in self.shards:
                if s.proc is None:
                    if s.due is not None and now >= s.due:
                        s.restarts += 1
                        self._start(s)
                    continue
                code = s.proc.poll()
                if code is None:
                    self._listened(s)
                elif self._stop_signal is None:  # a shard stopped by the operator's Ctrl-C stops with the job
                    self._exited(s, code)
            if not published and all(s.listening for s in self.shards):
                self._publish(self.cfg.ready_file)
                published = True
            time.sleep(POLL_S)
        return self._stop()

    def _stop(self) -> int:
        alive = [s for s in self.shards if s.proc is not None and s.proc.poll() is None]
        log.info("stopping the shards", extra={"signal": self._stop_signal, "why": self.failed, "shards": len(alive)})
        for s in alive:
            assert s.proc is not None
            with contextlib.suppress(ProcessLookupError):
                s.proc.send_signal(signal.SIGCONT)  # a stopped shard cannot act on SIGTERM
                s.proc.terminate()
        deadline = time.monotonic() + self.grace_s
        clean = True
        for s in self.shards:
            if s.proc is None:
                continue
            try:
                code = s.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("shard did not stop in time: killed", extra={"shard": s.plan.label, "grace_s": self.grace_s})
                s.proc.kill()
                code = s.proc.wait()
            s.codes.append(code)
            if code != 0:
                clean = False
                log.error("shard did not stop cleanly", extra={"shard": s.plan.label, "status": code})
        status = 1 if self.failed or not clean else 0
        log.info("stopped", extra={"status": status, "restarts": {s.plan.label: s.restarts for s in self.shards}})
        return status


def supervise(cfg: ServerConfig, argv: Sequence[str], *, shard_stop_s: float) -> int:
    """``stella-ps --shards``: run the job's shards until stopped; the exit status."""
    try:
        supervisor = Supervisor(cfg, argv, shard_stop_s=shard_stop_s)
    except ConfigError as e:
        print(f"stella-ps: error: {e}", file=sys.stderr)
        return 2
    return supervisor.run()
