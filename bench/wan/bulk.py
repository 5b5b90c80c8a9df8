"""Bulk-TCP rate measurement between two namespaces of a test bed.

A receiver in ``dst`` and a sender in ``src`` run as small child Python
processes (``ip netns exec``); the receiver timestamps every ``recv`` and
reports a cumulative byte curve, so callers can look at the rate over any
window (e.g. before and after a scheduled rate change).  Every run is bounded:
the sender stops after ``warmup + seconds`` and both children are killed after
a hard timeout.
"""

from __future__ import annotations

import json
import subprocess
import sys

_RECV = r"""
import json, socket, sys, time
addr, port, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((addr, port)); s.listen(1); s.settimeout(limit)
print("ready", flush=True)
c, _ = s.accept(); c.settimeout(limit)
samples = []; n = 0; t0 = None; last = 0.0
deadline = time.monotonic() + limit
while time.monotonic() < deadline:
    d = c.recv(1 << 20)
    if not d:
        break
    now = time.monotonic()
    if t0 is None:
        t0 = now
    n += len(d)
    if now - last >= 0.02:
        samples.append((now - t0, n)); last = now
if t0 is not None:
    samples.append((time.monotonic() - t0, n))
print(json.dumps(samples), flush=True)
"""

_SEND = r"""
import socket, sys, time
addr, port, dur = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
for i in range(100):
    try:
        s = socket.create_connection((addr, port), timeout=5); break
    except OSError:
        time.sleep(0.05)
else:
    sys.exit("could not connect")
buf = b"\0" * (1 << 18); end = time.monotonic() + dur
while time.monotonic() < end:
    s.sendall(buf)
s.close()
"""


def _ns(bed, site: str) -> tuple[str, str]:
    if site == "hub":
        return bed.hub_ns, bed.hub_address
    return bed.namespace(site), bed.address(site)


def transfer(bed, src: str, dst: str, duration: float, port: int = 5201) -> list[tuple[float, int]]:
    """Send bulk TCP ``src`` -> ``dst`` for ``duration`` s; returns the
    receiver's cumulative ``(seconds since first byte, bytes)`` samples."""
    if duration <= 0 or duration > 60:
        raise ValueError("duration must be in (0, 60] seconds")
    bed._check_open()
    dns, daddr = _ns(bed, dst)
    sns, _ = _ns(bed, src)
    limit = duration + 15.0
    recv = subprocess.Popen(["ip", "netns", "exec", dns, sys.executable, "-c", _RECV, daddr, str(port), str(limit)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    bed._procs.append(recv)
    assert recv.stdout is not None and recv.stderr is not None  # both piped
    try:
        line = recv.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"receiver failed: {line}{recv.stderr.read()}")
        send = subprocess.Popen(["ip", "netns", "exec", sns, sys.executable, "-c", _SEND, daddr, str(port),
                                 str(duration)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        bed._procs.append(send)
        _, serr = send.communicate(timeout=limit)
        out, err = recv.communicate(timeout=limit)
        if send.returncode != 0 or recv.returncode != 0:
            raise RuntimeError(f"bulk transfer {src}->{dst} failed: {serr} {err}")
        return [tuple(x) for x in json.loads(out.strip().splitlines()[-1])]
    finally:
        for p in (recv,) + ((send,) if "send" in locals() else ()):
            if p.poll() is None:
                p.kill()
                p.wait()


def rate_between(samples: list[tuple[float, int]], t_from: float, t_to: float) -> float:
    """Mbit/s delivered between two instants of a cumulative byte curve."""
    pts = [(t, n) for t, n in samples if t_from <= t <= t_to]
    if len(pts) < 2 or pts[-1][0] - pts[0][0] <= 0:
        raise ValueError(f"no samples in [{t_from}, {t_to}]")
    return (pts[-1][1] - pts[0][1]) * 8 / (pts[-1][0] - pts[0][0]) / 1e6


def measure(bed, src: str, dst: str, seconds: float = 2.0, warmup: float = 0.3, port: int = 5201) -> dict:
    samples = transfer(bed, src, dst, seconds + warmup, port=port)
    end = samples[-1][0]
    return {"src": src, "dst": dst, "mbit": rate_between(samples, warmup, end), "seconds": end - warmup,
            "bytes": samples[-1][1]}
