"""Start a ``stella-ps`` in a child process and stop it again: the one launcher.

:class:`ServerProcess` is the only code that starts a ``stella-ps`` process (but for
``stella-ps --shards N``'s supervisor, which starts its own shards, :mod:`.supervisor`). The
demo (``stella demo``), the benchmarks (``bench.pipeline``, ``bench.stella_e2e``)
and the test fixtures (``tests/conftest.py``) all use it, so "start, wait until it
listens, read its log, stop it for sure" is written once::

    with ServerProcess(workers=2) as ps:
        run_workers(ps.endpoint)
    # SIGTERM, SIGKILL if it does not exit in time; temp files removed

It runs ``python -m stella_ps`` with ``--ready-file`` in a private temp dir, bound
by default to ``tcp://127.0.0.1:0`` (an ephemeral port: the daemon writes the
endpoint it really bound into the ready-file once it listens). The daemon's
output (its log goes to stderr) is captured in a temp file, :meth:`logs`. A
process that exits, or does not listen within ``timeout`` seconds, raises
:class:`ServerStartError` carrying that log.

Standard library only: it must never import torch or numpy, so the server host
and any tool can use it.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .errors import StellaPSError

__all__ = ["ServerProcess", "ServerStartError", "DEFAULT_BIND", "free_port", "process_cpu_seconds"]

DEFAULT_BIND = "tcp://127.0.0.1:0"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0  # the daemon's own graceful shutdown is bounded by 10 s (daemon.SHUTDOWN_TIMEOUT_S)
LOG_TAIL_CHARS = 8000


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used (from /proc): a server's own
    cost, whatever its clients do."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a server that must come back on the same
    address after a restart (``--bind tcp://HOST:PORT``) or another service's fixed port."""
    s = socket.socket()
    try:
        s.bind((host, 0))
        return int(s.getsockname()[1])
    finally:
        s.close()


class ServerStartError(StellaPSError, RuntimeError):
    """The ``stella-ps`` process exited, or did not listen in time, before it wrote its
    endpoint. The message ends with the tail of the server's log; ``log`` holds all of it."""

    def __init__(self, message: str, log: str, returncode: int | None):
        tail = log[-LOG_TAIL_CHARS:]
        super().__init__(f"{message}\n--- stella-ps log ---\n{tail}" if tail else message)
        self.log = log
        self.returncode = returncode


def _reap(proc: subprocess.Popen, tmpdir: str) -> None:
    """Finalizer: a ServerProcess dropped without close() (or alive at interpreter exit)
    does not outlive its owner."""
    if proc.poll() is None:
        try:
            proc.kill()
        except ProcessLookupError:  # pragma: no cover - raced with its exit
            pass
        proc.wait()
    shutil.rmtree(tmpdir, ignore_errors=True)


class ServerProcess:
    """A ``stella-ps`` child process, started and waited for in the constructor.

    Args:
        workers: ``--workers`` (workers that must join before the first step closes).
        args: further command-line flags, e.g. ``["--history", "3"]``.
        bind: ``--bind``; port 0 picks a free port (see :attr:`endpoint`).
        log_level: ``--log-level`` (``None``: leave it to the environment / default).
        env: environment overrides on top of ``os.environ`` (e.g. ``STELLA_KERNEL_THREADS``).
        cwd: working directory of the child.
        timeout: seconds to wait until it listens.
        python: interpreter to run (default: this one).
        popen: how to start the argv; default :class:`subprocess.Popen`. The slow-link
            test bed passes ``functools.partial(bed.popen, site)`` to run it in a site.
        secure: CurveZMQ (the default). Unless ``args`` (or ``STELLA_PS_KEYS`` in the
            environment) give keys, a fresh key set is made in the temp dir: a server
            pair and one allowed client pair, which :meth:`client_kwargs` and
            :meth:`client_env` hand to clients. ``False`` runs it with ``--insecure``.

    Attributes: :attr:`endpoint` (what workers connect to), :attr:`pid`,
    :attr:`returncode` (``None`` while running), :attr:`argv`.
    """

    def __init__(
        self,
        workers: int = 1,
        args: Sequence[str] = (),
        *,
        bind: str = DEFAULT_BIND,
        log_level: str | None = "INFO",
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        timeout: float = START_TIMEOUT_S,
        python: str = sys.executable,
        popen: Callable[..., subprocess.Popen[Any]] = subprocess.Popen,
        secure: bool = True,
    ):
        self._tmpdir = tempfile.mkdtemp(prefix="stella-ps-")
        self._ready = os.path.join(self._tmpdir, "endpoint")
        self._log_path = os.path.join(self._tmpdir, "stella-ps.log")
        self._log_text: str | None = None  # kept after close() removes the file
        self._closed = False
        self.argv = [python, "-m", "stella_ps", "--bind", bind, "--workers", str(workers),
                     "--ready-file", self._ready]
        if log_level is not None:
            self.argv += ["--log-level", log_level]
        self.argv += list(args)
        full_env = dict(os.environ)
        full_env.update(env or {})
        self._client_keys: dict[str, str] = {}
        self._key_args: list[str] = []
        if not secure:
            if "--insecure" not in self.argv:
                self.argv.append("--insecure")
        elif "--keys" not in self.argv and "--insecure" not in self.argv and not full_env.get("STELLA_PS_KEYS"):
            from .security import write_keyset  # pyzmq only; this module stays light otherwise

            keys = write_keyset(os.path.join(self._tmpdir, "keys"))
            self.argv += ["--keys", keys.server_secret, "--allow", keys.allowlist]
            self._client_keys = {"server_key": keys.server_public, "client_key": keys.client_secrets["client"]}
            self._key_args = ["--keys", keys.server_secret, "--allow", keys.allowlist]
        try:
            with open(self._log_path, "wb") as log:
                self._proc = popen(self.argv, env=full_env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT)
        except BaseException:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            raise
        self._finalizer = weakref.finalize(self, _reap, self._proc, self._tmpdir)
        try:
            self.endpoint = self._wait_ready(timeout)
        except BaseException:
            self.close(timeout=2.0)
            raise

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while not os.path.exists(self._ready):  # the daemon renames it into place: never half-written
            if self._proc.poll() is not None:
                raise ServerStartError(f"stella-ps exited with code {self._proc.returncode} before listening "
                                       f"({' '.join(self.argv)})", self.logs(), self._proc.returncode)
            if time.monotonic() > deadline:
                raise ServerStartError(f"stella-ps did not listen within {timeout:g} s ({' '.join(self.argv)})",
                                       self.logs(), None)
            time.sleep(0.01)
        with open(self._ready) as f:
            return f.read().strip()

    def client_kwargs(self) -> dict[str, str]:
        """``server_key`` and ``client_key`` for :class:`stella.Client` / ``StellaOptimizer``
        when this object made the keys; empty otherwise (insecure, or keys given)."""
        return dict(self._client_keys)

    def key_args(self) -> list[str]:
        """``--keys``/``--allow`` flags that make another server use the keys this object
        made (the shards of one job share them); empty otherwise."""
        return list(self._key_args)

    def client_env(self) -> dict[str, str]:
        """The same as environment variables, for worker processes."""
        if not self._client_keys:
            return {}
        return {"STELLA_SERVER_KEY": self._client_keys["server_key"],
                "STELLA_CLIENT_KEY": self._client_keys["client_key"]}

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once the process has exited (negative: killed by that signal)."""
        return self._proc.poll()

    def alive(self) -> bool:
        return self._proc.poll() is None

    def logs(self) -> str:
        """Everything the server wrote so far (its log lines and its one stdout line)."""
        if self._log_text is not None:
            return self._log_text
        try:
            with open(self._log_path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (default SIGKILL) and return at once; for tests of crashes and
        hangs (``SIGSTOP``). :meth:`close` still reaps the process afterwards."""
        if self._proc.poll() is None:
            self._proc.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the process to exit; returns its exit status (``subprocess.TimeoutExpired``
        if it is still running after ``timeout`` seconds)."""
        return self._proc.wait(timeout)

    def close(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """Stop the server: SIGTERM (a graceful shutdown), SIGKILL if it has not exited
        after ``timeout`` seconds. Removes the temp files (:meth:`logs` keeps working).
        Safe to call again; returns the exit status."""
        if not self._closed:
            self._closed = True
            if self._proc.poll() is None:
                try:
                    self._proc.send_signal(signal.SIGCONT)  # a SIGSTOPped server cannot act on SIGTERM
                    self._proc.terminate()
                    self._proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            self._log_text = self.logs()
            self._finalizer()  # reaps (no-op here) and removes the temp dir, once
        return self._proc.wait()

    stop = close

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.alive() else f"exited {self._proc.returncode}"
        return f"<ServerProcess pid={self.pid} {getattr(self, 'endpoint', '?')} {state}>"
