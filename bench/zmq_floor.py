"""The transport's floor: what a bare pyzmq ROUTER costs a server a request and its reply.

    python -m bench.zmq_floor [--requests 20000] [--sizes 1200,12000] [--frames 1,3] [--json PATH]

A ROUTER (the server, on one core) answers a DEALER (the client, on another core where
there is one) request by request, lock-step, with a trivial handler: receive the message,
send a 40-byte reply. Reported: the server process's CPU per request and reply (all its
threads: the event loop's, libzmq's I/O thread) and the wall time a round trip, with
CurveZMQ and without, by request size and frames. What ``bench.server``'s ``ms/wkr/step``
cannot go below: a worker's round is one request (the push carrying its pull) and two
replies, before any of stella-ps's own work.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time

import zmq

from bench.harness import loadavg

REPLY = b"ok" * 20


def _cpus() -> tuple[list[int], list[int]]:
    cpus = sorted(os.sched_getaffinity(0))
    return [cpus[0]], cpus[1:] or cpus


def _server(q: mp.Queue, n: int, keys: tuple[bytes, bytes] | None) -> None:
    os.sched_setaffinity(0, _cpus()[0])
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    if keys is not None:
        s.curve_server = True
        s.curve_publickey, s.curve_secretkey = keys
    q.put(s.bind_to_random_port("tcp://127.0.0.1"))
    for i in range(n):
        m = s.recv_multipart(copy=False)
        if i == 0:
            c0 = time.process_time()
        s.send_multipart([m[0], REPLY], copy=False)
    q.put(time.process_time() - c0)
    s.close(0)
    ctx.term()


def _client(port: int, n: int, size: int, frames: int, keys: tuple[bytes, bytes, bytes] | None) -> None:
    os.sched_setaffinity(0, _cpus()[1])
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    if keys is not None:
        s.curve_serverkey, s.curve_publickey, s.curve_secretkey = keys
    s.connect(f"tcp://127.0.0.1:{port}")
    parts = [os.urandom(size // frames) for _ in range(frames)]
    for _ in range(n):
        s.send_multipart(parts)
        s.recv_multipart()
    s.close(0)
    ctx.term()


def run(n: int, size: int, frames: int, curve: bool) -> dict:
    server_pub, server_sec = zmq.curve_keypair()
    client_pub, client_sec = zmq.curve_keypair()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    srv = ctx.Process(target=_server, args=(q, n + 1, (server_pub, server_sec) if curve else None))
    srv.start()
    port = q.get(timeout=60)
    cli = ctx.Process(target=_client, args=(port, n + 1, size, frames,
                                            (server_pub, client_pub, client_sec) if curve else None))
    t0 = time.perf_counter()
    cli.start()
    cpu = q.get(timeout=600)
    wall = time.perf_counter() - t0
    cli.join(60)
    srv.join(60)
    return {"curve": curve, "bytes": size, "frames": frames, "requests": n,
            "server_cpu_us": round(1e6 * cpu / n, 2), "round_trip_us": round(1e6 * wall / n, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.zmq_floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--sizes", default="1200,12000", help="request bytes, comma-separated")
    p.add_argument("--frames", default="1,3", help="frames a request, comma-separated")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    load = loadavg()
    rows = [run(a.requests, int(size), int(frames), curve) for curve in (True, False)
            for size in a.sizes.split(",") for frames in a.frames.split(",")]
    print(f"bare pyzmq ROUTER, lock-step requests and 40-byte replies, a trivial handler (load at start: {load})")
    print(f"{'curve':>5} {'bytes':>6} {'frames':>6} {'server CPU us/req':>17} {'round trip us':>13}")
    for r in rows:
        print(f"{'yes' if r['curve'] else 'no':>5} {r['bytes']:>6} {r['frames']:>6} {r['server_cpu_us']:>17.1f} "
              f"{r['round_trip_us']:>13.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"load_at_start": load, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
