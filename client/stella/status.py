"""``stella status ADDRESS``: a running job at a glance.

One line for the job (version, steps/s, bytes/s each way, checkpoint age, and ``CHECKPOINT
FAILING: ENOSPC: No space left on device (2 failed, version 40 kept)`` while writes fail, workers, and
the training mode with the server's optimizer: ``mode update, outer average`` or
``outer nesterov(lr 0.7, momentum 0.9)``, ``mode gradient, optimizer adamw(lr 0.001,
...)``) and a table with a row per live worker (id, name, key fingerprint with the
allowlist's name for the key, last seen, steps, density, s/it, wait %), from the
server's ``status`` reply. The workers' columns come from the
report each push carries (:class:`stella.protocol.WorkerReport`); ``-`` where a worker
has sent none yet. Rates are averages since the server started, or, with ``--watch``,
over the last refresh.

A sharded job (``stella status ADDR`` of a job whose shards list themselves, ``stella-ps
--shards``; else ``stella status ADDR0,ADDR1,...``, :mod:`stella.shards`): one line for the
job across its shards (the rounds every shard has made, the slowest shard's steps/s,
bytes summed, the oldest checkpoint, the fewest live workers), a line per shard, and
the worker table of the first shard (every worker joins every shard).
"""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any, TextIO

import msgspec

from .modes import OUTER_PRESETS, outer_preset
from .protocol import StatusReply, WorkerReport

__all__ = ["render", "render_shards", "rates", "watch", "plain"]


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


def rates(now: StatusReply, before: StatusReply | None, dt: float | None) -> dict[str, float]:
    """steps/s and bytes/s in and out: over ``dt`` seconds since ``before``, else since
    the server started."""
    if before is not None and dt and dt > 0:
        span, base = dt, (before.steps, before.bytes_in, before.bytes_out)
    else:
        span, base = max(now.uptime_s, 1e-9), (0, 0, 0)
    return {"steps": (now.steps - base[0]) / span, "bytes_in": (now.bytes_in - base[1]) / span,
            "bytes_out": (now.bytes_out - base[2]) / span}


def plain(st: StatusReply) -> dict[str, Any]:
    """The reply as plain data (nested structs as dicts too), without the message envelope:
    what ``stella status --json`` prints."""
    return {k: v for k, v in msgspec.to_builtins(st).items() if k not in ("proto", "req", "type")}


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(_value(x) for x in v) + ")"
    return str(v)


def _hparams(config: dict[str, Any], keys: Iterable[str] | None = None) -> str:
    """``(hparam value, ...)``: the hyper-parameters in ``keys``, or all but those that
    are off (0 or False: they change nothing)."""
    shown = [k for k in config if k != "name" and config[k] is not False and config[k] != 0] if keys is None else keys
    return "(" + ", ".join(f"{k} {_value(config[k])}" for k in shown) + ")"


def _job(st: StatusReply) -> str:
    """What the job trains with: the mode and the server's optimizer (update mode: the
    outer step, named by its preset); a server that does not say its mode: the name."""
    config = st.optimizer or {}
    name = config.get("name", "-")
    if st.mode == "gradient":
        return f"mode gradient, optimizer {name}{_hparams(config)}"
    if st.mode != "update":
        return name
    preset = outer_preset(config)
    if preset == "average":  # its one number, lr 1, is what makes it the mean of the workers' models
        outer = "average"
    elif preset is not None:  # the preset's name, with its numbers
        outer = preset + _hparams(config, [k for k, v in OUTER_PRESETS[preset].items() if type(v) in (int, float)])
    else:
        outer = name + _hparams(config)
    return f"mode update, outer {outer}"


def _mbit(bps: float) -> str:
    return f"{8e-6 * bps:.0f}" if bps > 0 else "-"


def _cells(rep: WorkerReport | None) -> tuple[str, ...]:
    """A worker's report as the table shows it: what its controller chose (density, and
    the densest worth its own work, coding, local steps H, micro-batches per step) and the
    rates it measured."""
    if rep is None:
        return ("-",) * 9
    it = rep.compute_s + rep.wait_s
    density = f"{rep.density:.2%}" + (f" (max {rep.max_density:.2%})" if rep.max_density else "")
    return (str(rep.step), density, rep.value_dtype or "-", str(rep.local_steps or "-"),
            str(rep.accumulate or "-"), f"{it:.3f}", f"{100 * rep.wait_s / it:.0f}" if it > 0 else "0",
            _mbit(rep.up_bps), _mbit(rep.down_bps))


def render(st: StatusReply, r: dict[str, float], address: str = "") -> str:
    """The job line and the worker table for one ``status`` reply."""
    head = (f"stella-ps {st.server_version or '?'} {address} | {_figures(st, r)} | "
            f"{_job(st)}{' | INSECURE' if st.insecure else ''}")
    cols = ("worker", "name", "key", "last seen", "steps", "density", "coding", "H", "batch x", "s/it", "wait %",
            "up Mbit/s", "down Mbit/s")
    behind = set(st.behind_workers)
    if st.live is None:  # a server before per-worker status: ids and keys only
        live: list[tuple[int, str, str, float | None, WorkerReport | None]] = [
            (w, "", st.worker_keys.get(w, ""), None, None) for w in st.workers]
    else:
        live = [(w.worker, w.name, f"{w.key_fingerprint} {w.key_name}".strip(), w.last_seen_s, w.report)
                for w in st.live]
    rows = []
    for worker, name, key, last_seen, rep in live:
        seen = "-" if last_seen is None else _age(last_seen)
        if worker in behind:
            seen += " (behind)"  # silent, a deadline closed a step without it: not waited for until it pushes
        rows.append((str(worker), name or "-", key or "-", seen, *_cells(rep)))
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
    lines = [head, "", "  ".join(c.ljust(wd) for c, wd in zip(cols, widths))]
    lines += ["  ".join(v.ljust(wd) for v, wd in zip(row, widths)).rstrip() for row in rows]
    if not rows:
        lines.append("(no live workers)")
    return "\n".join(lines)


def _figures(st: StatusReply, r: dict[str, float]) -> str:
    """One server's figures: version, rates, checkpoint age (and a failing write), workers."""
    return (f"version {st.version} | {r['steps']:.2f} steps/s | in {_bytes(r['bytes_in'])}/s | "
            f"out {_bytes(r['bytes_out'])}/s | checkpoint {_age(st.checkpoint_age_s)}{_failing(st)} | "
            f"workers {len(st.workers)}/{st.expected_workers}")


def _failing(st: StatusReply) -> str:
    """`` | CHECKPOINT FAILING: why (n failed, version v kept)`` while the latest write
    failed (README "Operations": training goes on, the newest valid checkpoint is kept)."""
    if st.checkpoint_error is None:
        return ""
    kept = "none kept" if st.checkpoint_version is None else f"version {st.checkpoint_version} kept"
    return f" | CHECKPOINT FAILING: {st.checkpoint_error} ({st.checkpoint_failures} failed, {kept})"


def render_shards(sts: list[StatusReply], rs: list[dict[str, float]], addresses: list[str]) -> str:
    """The job line across the shards, a line per shard, the first shard's worker table."""
    ages = [st.checkpoint_age_s for st in sts]
    oldest = _age(None if None in ages else max(a for a in ages if a is not None))
    head = (f"stella-ps {sts[0].server_version or '?'} | {len(sts)} shards | rounds {min(st.version for st in sts)} "
            f"| {min(r['steps'] for r in rs):.2f} steps/s | in {_bytes(sum(r['bytes_in'] for r in rs))}/s | "
            f"out {_bytes(sum(r['bytes_out'] for r in rs))}/s | checkpoint {oldest} | workers "
            f"{min(len(st.workers) for st in sts)}/{sts[0].expected_workers} | {_job(sts[0])}"
            f"{' | INSECURE' if any(st.insecure for st in sts) else ''}"
            f"{' | CHECKPOINT FAILING' if any(st.checkpoint_error is not None for st in sts) else ''}")
    shards = [f"  shard {st.shard or '?'} {a} | {_figures(st, r)}" for st, r, a in zip(sts, rs, addresses)]
    table = render(sts[0], rs[0]).splitlines()[1:]  # the first shard's workers
    return "\n".join([head, *shards, *table])


def watch(fetch: Callable[[], StatusReply | list[StatusReply]], *, address: str = "", as_json: bool = False,
          interval: float | None = None, out: TextIO | None = None, count: int | None = None) -> int:
    """Print the status once (``interval`` None) or every ``interval`` seconds until
    interrupted (or ``count`` times); ``as_json``: the reply as plain data (:func:`plain`)
    plus the rates, one JSON object per line. ``fetch`` returning a list: the shards of a
    sharded job, ``address`` their comma-separated addresses (JSON: ``{"shards": [...]}``)."""
    out = out or sys.stdout
    before: list[StatusReply] | None = None
    t_before = 0.0
    n = 0
    try:
        while True:
            got = fetch()
            sts = got if isinstance(got, list) else [got]
            t = time.monotonic()
            prev: list[StatusReply | None] = list(before) if before is not None else [None] * len(sts)
            dt = t - t_before if before is not None else None
            rs = [rates(st, b, dt) for st, b in zip(sts, prev)]
            if as_json:
                docs = [{**plain(st), "rates": r} for st, r in zip(sts, rs)]
                doc = docs[0] if not isinstance(got, list) else {"shards": docs}
                out.write(json.dumps(doc, indent=None if interval else 2, default=str) + "\n")
            else:
                if interval and out.isatty():
                    out.write("\x1b[H\x1b[2J")  # clear the screen between refreshes
                text = (render(sts[0], rs[0], address) if not isinstance(got, list)
                        else render_shards(sts, rs, address.split(",")))
                out.write(text + "\n")
            out.flush()
            n += 1
            if interval is None or (count is not None and n >= count):
                return 0
            before, t_before = sts, t
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
