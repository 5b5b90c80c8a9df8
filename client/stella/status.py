"""``stella status ADDRESS``: a running job at a glance.

One line for the job (version, steps/s, bytes/s each way, checkpoint age) and a table
with a row per live worker (id, name, key fingerprint, last seen, steps, density,
s/it, wait %), from the server's ``status`` reply. The workers' columns come from the
report each push carries (:class:`stella.protocol.WorkerReport`); ``-`` where a worker
has sent none yet. Rates are averages since the server started, or, with ``--watch``,
over the last refresh.
"""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["render", "rates", "watch"]


def _bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def _age(s: float | None) -> str:
    if s is None:
        return "none"
    if s < 120:
        return f"{s:.0f}s ago" if s >= 1 else "now"
    if s < 7200:
        return f"{s / 60:.0f}m ago"
    return f"{s / 3600:.1f}h ago"


def rates(now: dict[str, Any], before: dict[str, Any] | None, dt: float | None) -> dict[str, float]:
    """steps/s and bytes/s in and out: over ``dt`` seconds since ``before``, else since
    the server started."""
    if before is not None and dt and dt > 0:
        span, base = dt, before
    else:
        span, base = max(now.get("uptime_s", 0.0), 1e-9), {"steps": 0, "bytes_in": 0, "bytes_out": 0}
    return {k: (now[k] - base[k]) / span for k in ("steps", "bytes_in", "bytes_out")}


def render(st: dict[str, Any], r: dict[str, float], address: str = "") -> str:
    """The job line and the worker table for one ``status`` reply."""
    ck = st.get("checkpoint_age_s")
    opt = (st.get("optimizer") or {}).get("name", "-")
    head = (f"stella-ps {st.get('server_version') or '?'} {address} | version {st['version']} | "
            f"{r['steps']:.2f} steps/s | in {_bytes(r['bytes_in'])}/s | out {_bytes(r['bytes_out'])}/s | "
            f"checkpoint {_age(ck) if ck is not None else 'none'} | workers {len(st['workers'])}"
            f"/{st['expected_workers']} | {opt}{' | INSECURE' if st.get('insecure') else ''}")
    cols = ("worker", "name", "key", "last seen", "steps", "density", "s/it", "wait %")
    rows = []
    behind = set(st.get("behind_workers") or ())
    live = st.get("live")
    if live is None:  # a server before per-worker status: ids and keys only
        live = [{"worker": w, "name": "", "key_fingerprint": st["worker_keys"].get(w, ""), "last_seen_s": None,
                 "report": None} for w in st["workers"]]
    for w in live:
        rep = w.get("report")
        if rep:
            it = rep["compute_s"] + rep["wait_s"]
            cells = (str(rep["step"]), f"{rep['density']:.2%}", f"{it:.3f}",
                     f"{100 * rep['wait_s'] / it:.0f}" if it > 0 else "0")
        else:
            cells = ("-", "-", "-", "-")
        seen = "-" if w.get("last_seen_s") is None else _age(w["last_seen_s"])
        if w["worker"] in behind:
            seen += " (behind)"  # silent, a deadline closed a step without it: not waited for until it pushes
        rows.append((str(w["worker"]), w.get("name") or "-", w.get("key_fingerprint") or "-", seen, *cells))
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
    lines = [head, "", "  ".join(c.ljust(wd) for c, wd in zip(cols, widths))]
    lines += ["  ".join(v.ljust(wd) for v, wd in zip(row, widths)).rstrip() for row in rows]
    if not rows:
        lines.append("(no live workers)")
    return "\n".join(lines)


def watch(fetch: Callable[[], dict[str, Any]], *, address: str = "", as_json: bool = False,
          interval: float | None = None, out: TextIO | None = None, count: int | None = None) -> int:
    """Print the status once (``interval`` None) or every ``interval`` seconds until
    interrupted (or ``count`` times); ``as_json``: the raw reply plus the rates, one JSON
    object per line."""
    out = out or sys.stdout
    before: dict[str, Any] | None = None
    t_before = 0.0
    n = 0
    try:
        while True:
            st = fetch()
            t = time.monotonic()
            r = rates(st, before, t - t_before if before is not None else None)
            if as_json:
                out.write(json.dumps({**st, "rates": r}, indent=None if interval else 2, default=str) + "\n")
            else:
                if interval and out.isatty():
                    out.write("\x1b[H\x1b[2J")  # clear the screen between refreshes
                out.write(render(st, r, address) + "\n")
            out.flush()
            n += 1
            if interval is None or (count is not None and n >= count):
                return 0
            before, t_before = st, t
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
