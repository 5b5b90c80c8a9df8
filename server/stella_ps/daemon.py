"""``stella-ps`` entry point: logging set-up, signals, and the uvloop event loop; with
``--shards``, the supervisor of the job's shards instead (:mod:`.supervisor`).

Only this module installs logging handlers or an event loop; the rest of the
package is library code.
"""
from __future__ import annotations

import os

# Before numpy is imported (by .server): the server does its vector work in the C kernel
# and in small numpy calls; a BLAS thread pool would only spin on the cores that the
# store thread and the kernel's threads need. An operator's own setting is kept.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import asyncio  # noqa: E402
import faulthandler  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from .config import ServerConfig, parse_args  # noqa: E402
from .errors import ConfigError  # noqa: E402

__all__ = ["main", "run"]

log = logging.getLogger("stella_ps")
SHUTDOWN_TIMEOUT_S = 10.0
CHECKPOINT_SHUTDOWN_TIMEOUT_S = 600.0  # with --checkpoint-dir: the last checkpoint of a large model takes time

_STD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and any ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update({k: v for k, v in vars(record).items() if k not in _STD_ATTRS})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extra = " ".join(f"{k}={v}" for k, v in vars(record).items() if k not in _STD_ATTRS)
        ts = time.strftime("%H:%M:%S", time.localtime(record.created))
        line = f"{ts} {record.levelname:<7} {record.name}: {record.getMessage()} {extra}".rstrip()
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _ShardLabel(logging.Filter):
    """Every line of a shard's log says which shard (the shards of a job share a log)."""

    def __init__(self, shard: str):
        super().__init__()
        self.shard = shard

    def filter(self, record: logging.LogRecord) -> bool:
        record.shard = self.shard
        return True


def _setup_logging(cfg: ServerConfig) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if cfg.log_format == "json" else TextFormatter())
    if cfg.shard:
        handler.addFilter(_ShardLabel(cfg.shard))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(cfg.log_level)


def shutdown_timeout_s(cfg: ServerConfig) -> float:
    """How long a stopping server may take (its last checkpoint, with ``--checkpoint-dir``)."""
    return CHECKPOINT_SHUTDOWN_TIMEOUT_S if cfg.checkpoints.dir else SHUTDOWN_TIMEOUT_S


async def run(cfg: ServerConfig) -> int:
    """Serve until SIGINT/SIGTERM, then shut down within ``SHUTDOWN_TIMEOUT_S`` (with
    ``--checkpoint-dir``, ``CHECKPOINT_SHUTDOWN_TIMEOUT_S``: the last checkpoint is written);
    SIGHUP reads the allowlist again. Returns the exit status: 0 after a requested stop,
    1 if serving ended by itself (a bug, or a step that could not be undone: docker or
    systemd should restart the server)."""
    from .server import ParameterServer  # here: the supervisor of --shards needs none of it

    server = ParameterServer(cfg)
    endpoint = await server.start()
    if server.metrics is not None:
        print(f"stella-ps metrics on http://{server.metrics.host}:{server.metrics.port}/metrics", flush=True)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, server.stop)
    loop.add_signal_handler(signal.SIGHUP, server.reload_allowlist)
    if cfg.ready_file:
        tmp = cfg.ready_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(endpoint + "\n")
        os.replace(tmp, cfg.ready_file)  # readers never see a half-written file
    print(f"stella-ps listening on {endpoint}", flush=True)
    task = asyncio.ensure_future(server.serve())
    stop = asyncio.ensure_future(server.stop_requested())
    await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    if not stop.done():
        stop.cancel()
        exc = None if task.cancelled() else task.exception()
        log.critical("the server stopped serving without being asked to; exiting", exc_info=exc)
        return 1
    if server.failure is None:
        log.info("shutting down")
    try:
        await asyncio.wait_for(task, shutdown_timeout_s(cfg))
    except asyncio.TimeoutError:
        log.error("shutdown timed out")
    if server.failure is not None:  # a step could not be undone (ParameterServer._fail said why)
        log.critical("exiting 1: a step failed and could not be undone or closed; restart from the newest "
                     "checkpoint",
                     extra={"error": f"{type(server.failure).__name__}: {server.failure}"})
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    _setup_logging(cfg)
    # a fatal signal (an abort in a C library, a segfault) prints every thread's Python stack to stderr, the log
    faulthandler.enable()
    if cfg.shards.count:  # one command for the shards of a job on this host
        from .supervisor import supervise

        return supervise(cfg, sys.argv[1:] if argv is None else argv, shard_stop_s=shutdown_timeout_s(cfg))
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; Windows lacks it
        runner = asyncio.run
    else:
        runner = uvloop.run
    try:
        return runner(run(cfg))
    except ConfigError as e:  # bad keys or allowlist: say so, no traceback
        print(f"stella-ps: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
