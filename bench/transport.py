"""How long one message takes over a shaped link, by size: the transport under `stella plan`'s link model.

    python -m bench.transport [--rates 10,20,30,50] [--sizes 128,192,256,320,384,512,768] [--reps 12]
                              [--json PATH] [--quick]

One test bed per (rate, size): the server's site at 1000 Mbit/s, one worker site at the rate both
ways (``bench.wan``: tbf, 50 ms of queue beside its burst). A ZeroMQ DEALER in the worker's site
asks a ROUTER in the server's site for ``size`` kB (its downlink: the broadcast pull's direction)
and sends ``size`` kB up (the push's), ``reps`` times each, 0.3 s apart (a round's compute), on one
connection. Each message's time is compared with ``max(0, size - burst) / rate``, the model's
link time without loss, and the median of the repetitions after the third is reported.

What it showed on 2026-11-26 (docs/plan.md section 3): a message down a link whose drop-tail queue
(rate x 50 ms + burst) it overflows, but which TCP sends as one flight (up to about 350 kB here),
loses its tail. No later segment acknowledges past the loss, so the sender waits for a timer
(tail-loss probe or retransmission timeout), about one to two queue delays. Larger messages lose
mid-flight and recover at once; the uplink, shaped on the sender's own interface, never drops.
Needs root (network namespaces); bounded: at most 60 s per test bed.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time

from bench.harness import loadavg

GAP_S = 0.3
PORT = 7777


def _peer(role: str, addr: str, plan: str = "[]") -> None:
    import zmq

    ctx = zmq.Context()
    if role == "server":
        s = ctx.socket(zmq.ROUTER)
        s.bind(f"tcp://{addr}:{PORT}")
        end = time.monotonic() + 60
        while time.monotonic() < end:
            if not s.poll(500):
                continue
            ident, want, _ = s.recv_multipart()
            if want == b"stop":
                break
            s.send_multipart([ident, b"x", bytes(int(want))])
        return
    s = ctx.socket(zmq.DEALER)
    s.connect(f"tcp://{addr}:{PORT}")
    s.send_multipart([b"0", b""])
    s.recv_multipart()
    out = []
    for up, down in json.loads(plan):
        time.sleep(GAP_S)
        t = time.perf_counter()
        s.send_multipart([str(down).encode(), bytes(up)])
        s.recv_multipart()
        out.append([up, down, time.perf_counter() - t])
    s.send_multipart([b"stop", b""])
    print(json.dumps(out))


def measure(rate: float, size: int, reps: int) -> dict:
    from bench.wan import TBF_QUEUE_MS, Link, WanTestbed, tbf_burst_bytes

    with WanTestbed({"ps": Link(1000, 1000), "w0": Link(rate, rate)}, max_lifetime=120) as bed:
        srv = bed.popen("ps", [sys.executable, "-m", "bench.transport", "--peer", "server", bed.address("ps")])
        time.sleep(0.3)
        plan = json.dumps([[1, size]] * reps + [[size, 1]] * reps)
        cp = bed.run("w0", [sys.executable, "-m", "bench.transport", "--peer", "client", bed.address("ps"), plan],
                     timeout=60)
        if cp.returncode != 0:
            raise RuntimeError(f"client failed: {cp.stderr[-2000:]}")
        rows = json.loads(cp.stdout)
        drops = [int(x) for x in re.findall(r"dropped (\d+)", bed.qdisc_stats("w0"))]
        srv.wait(timeout=10)
    burst = tbf_burst_bytes(rate)
    base = max(0, size - burst) * 8 / (rate * 1e6)
    down = [t for up, dn, t in rows if dn == size][3:]
    up = [t for up, dn, t in rows if up == size][3:]
    queue = rate * 1e6 / 8 * TBF_QUEUE_MS / 1e3 + burst
    return {"rate_mbps": rate, "size": size, "queue_bytes": queue, "base_s": base,
            "down_s": statistics.median(down), "up_s": statistics.median(up),
            "down_tail_hits": sum(t > base + 0.5 * queue * 8 / (rate * 1e6) for t in down), "reps": len(down),
            "drops_up": drops[0] if drops else None, "drops_down": drops[1] if len(drops) > 1 else None,
            "down_all_s": down}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="10,20,30,50")
    ap.add_argument("--sizes", default="128,192,256,320,384,512,768", help="kB (1024 bytes)")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true", help="20 and 50 Mbit/s, three sizes, 6 messages each")
    ap.add_argument("--peer", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.peer:
        _peer(*a.peer)
        return 0
    if a.quick:
        a.rates, a.sizes, a.reps = "20,50", "224,288,352", 6
    from bench.e2e import machine  # here: bench.e2e imports torch, which the peers (and tests) need not wait for

    rows: list[dict] = []
    out = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_start": loadavg(),
           "machine": machine(), "rows": rows}
    print(f"bench.transport: {out['started']}, load {out['load_start']}, {out['machine']}")
    print("| Mbit/s | kB | queue kB | no-loss model ms | down ms (median) | tail-loss hits | extra / queue delay "
          "| up ms | drops up / down |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rate in (float(x) for x in a.rates.split(",")):
        for kb in (int(x) for x in a.sizes.split(",")):
            r = measure(rate, kb * 1024, max(4, a.reps))
            rows.append(r)
            qdelay = r["queue_bytes"] * 8 / (rate * 1e6)
            print(f"| {rate:g} | {kb} | {r['queue_bytes'] / 1024:.0f} | {1e3 * r['base_s']:.1f} | "
                  f"{1e3 * r['down_s']:.1f} | {r['down_tail_hits']}/{r['reps']} | "
                  f"{(r['down_s'] - r['base_s']) / qdelay:.2f} | {1e3 * r['up_s']:.1f} | "
                  f"{r['drops_up']} / {r['drops_down']} |", flush=True)
    out["load_end"] = loadavg()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
