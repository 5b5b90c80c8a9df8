"""``stella-ps-health``: the container health check. It asks the running server itself,
through its ``/healthz`` (served on the daemon's event loop, see :mod:`.metrics`), so
a wedged loop fails the check as surely as a dead process.

The address is ``--url``, else the port of ``STELLA_PS_METRICS`` on 127.0.0.1 (the
image sets both that variable and this check). The shards of ``stella-ps --shards N``
serve their metrics on that port + I: when the first answers as shard ``0/N``, the
others are asked too, and all must answer. Exit status 0: healthy; 1: not.
Standard library only (it imports :mod:`.config`, itself free of C extensions), so
that the check stays cheap every few seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from .config import ENV, parse_bind

ENV_METRICS = ENV["metrics"]

__all__ = ["main", "health_url"]


def health_url(metrics: str | None) -> str:
    """The ``/healthz`` URL on this host for the metrics address ``metrics``."""
    if not metrics:
        raise ValueError(f"no metrics endpoint: set {ENV_METRICS} (e.g. 0.0.0.0:9100) or pass --url")
    host, port = parse_bind(metrics)
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://{host}:{port}/healthz"


def _get(url: str, timeout: float) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body: dict[str, Any] = json.loads(r.read())
    if body.get("status") != "ok":
        raise ValueError(f"{url}: {body}")
    return body


def _shard_urls(url: str, shard: str) -> list[str]:
    """The other shards' ``/healthz`` when ``url`` answered as shard ``0/N`` (ports + I)."""
    index, _, count = shard.partition("/")
    if index != "0" or not count.isdigit():
        return []
    parts = urllib.parse.urlsplit(url)
    if parts.port is None:
        return []
    host = parts.hostname or "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    return [urllib.parse.urlunsplit(parts._replace(netloc=f"{host}:{parts.port + i}")) for i in range(1, int(count))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stella-ps-health", description="exit 0 if the local stella-ps answers "
                                "its health check, 1 otherwise")
    p.add_argument("--url", help=f"the /healthz URL (default: from {ENV_METRICS})")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    p.add_argument("--quiet", "-q", action="store_true")
    a = p.parse_args(argv)
    try:
        url = a.url or health_url(os.environ.get(ENV_METRICS))
        bodies = [_get(url, a.timeout)]
        bodies += [_get(u, a.timeout) for u in _shard_urls(url, str(bodies[0].get("shard", "")))]
    except (ValueError, OSError, urllib.error.URLError) as e:
        print(f"stella-ps-health: unhealthy: {e}", file=sys.stderr)
        return 1
    if not a.quiet:
        print("\n".join(json.dumps(b) for b in bodies))
    return 0


if __name__ == "__main__":
    sys.exit(main())
