"""Job start: W workers register one model at the same time against a real ``stella-ps``,
and each pulls what it needs to start from (what ``StellaOptimizer`` does; undecoded:
the bytes count).

Each worker is a :class:`stella.Client` in a thread of this process (registration is
I/O: the server and the sockets do the work). Every worker holds the same values (one
seed). Three ways side by side, each on a fresh server:

- ``digest``: what the client library does. Each worker sends a probe without values,
  carrying the values' digest; the first is asked for the values, and the others'
  probes are held until the model exists (protocol ``Register.wait_ms``), so the model
  crosses the wire once; their digests equal the model's, so the reply's ``base`` tells
  them they hold it, and nobody pulls a snapshot (protocol version 7).
- ``snapshots``: the same registrations, but every worker other than the first pulls a
  snapshot (protocol version 6: the model comes down every other worker's link).
- ``each_sends``: every worker sends its values with its registration and the others
  pull a snapshot (what a job saw when every probe was answered "send them", before
  protocol version 6): the server takes the first upload and ignores the rest, but each
  crossed the wire.

Reported: the wall time until every worker has registered and pulled, the bytes the
server received and sent (its ``bytes_in`` and ``bytes_out``), and each over the
model's size. On a link of ``L`` Mbit/s into each worker the bytes cost ``8 * bytes /
L`` seconds at job start, the snapshot on the joiners' links before their first step.

    python -m bench.register [--workers 8,32] [--numel 10000000] [--json PATH]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import threading
import time
from typing import Any

import numpy as np

from bench.harness import loadavg, start_shards
from stella import Client
from stella.layout import FlatLayout
from stella.protocol import Register, Registered, TensorSpec

OPTIMIZER: dict[str, Any] = {"name": "sgd", "lr": 0.1}
HOWS = ("digest", "snapshots", "each_sends")


def _start_all(clients: list[Client], model: dict[str, np.ndarray], how: str) -> float:
    def start(c: Client) -> None:
        if how == "each_sends":  # the values with the registration, at once
            assert c.worker_id is not None  # joined
            layout = [TensorSpec(n, tuple(t.shape), "float32") for n, t in model.items()]
            cut = c._session.dense_below  # the model laid out flat, a frame per part (stella.layout)
            flat = FlatLayout.of(layout, cut)
            values = flat.gather(list(model.values()))
            msg = Register(worker=c.worker_id, tensors=layout, optimizer=OPTIMIZER, values=True, dense_below=cut)
            reply = c._session.request(msg, Registered, [values[p.start:p.stop] for p in flat.parts()])
            base = reply.version if reply.created else None
        else:
            reply = c.register(model, OPTIMIZER)
            base = reply.base if how == "digest" or reply.created else None
        if base is None:
            c.pull(None, decode=False)  # the bytes count here, not decoding them
        elif base != reply.version:
            c.pull(base, decode=False)

    errors: list[BaseException] = []

    def run(c: Client) -> None:
        try:
            start(c)
        except BaseException as e:  # raised on the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(c,)) for c in clients]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def run(workers: int, numel: int, how: str) -> dict:
    model = {"w": np.random.default_rng(0).standard_normal(numel).astype(np.float32)}
    with contextlib.ExitStack() as stack:
        srv = start_shards(stack, 1, ["--max-model-bytes", str(64 * numel + (1 << 30)),
                                      "--max-workers-per-key", str(workers)], workers=workers,
                           log_level="WARNING")[0]
        clients = [stack.enter_context(Client(srv.endpoint, timeout=300, **srv.client_kwargs()))
                   for _ in range(workers)]
        wall = _start_all(clients, model, how)
        st = clients[0].status()
        ids = sorted(c.worker_id for c in clients if c.worker_id is not None)
        if len(ids) != len(clients) or st.workers != ids:
            raise RuntimeError(f"not every worker registered: {st.workers}")
    return {"workers": workers, "numel": numel, "how": how, "wall_s": round(wall, 3),
            "bytes_in": st.bytes_in, "bytes_out": st.bytes_out, "model_bytes": 4 * numel,
            "uploads": round(st.bytes_in / (4 * numel), 2), "downloads": round(st.bytes_out / (4 * numel), 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="8,32", help="comma-separated worker counts")
    ap.add_argument("--numel", type=float, default=1e7)
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args(argv)
    load = loadavg()
    print(f"job start: W workers register a {int(a.numel):,}-parameter model at once and pull what they need "
          f"(load at start: {load})")
    print(f"{'W':>3} {'how':<11} {'wall s':>7} {'MB in':>8} {'x model':>8} {'MB out':>8} {'x model':>8} "
          f"{'wall vs digest':>15}")
    rows = []
    for w in (int(x) for x in a.workers.split(",")):
        runs = [run(w, int(a.numel), how) for how in HOWS]
        for r in runs:
            r["wall_x_digest"] = round(r["wall_s"] / runs[0]["wall_s"], 2)
            rows.append(r)
            print(f"{r['workers']:>3} {r['how']:<11} {r['wall_s']:>7.2f} {r['bytes_in'] / 1e6:>8.1f} "
                  f"{r['uploads']:>8.2f} {r['bytes_out'] / 1e6:>8.1f} {r['downloads']:>8.2f} "
                  f"{r['wall_x_digest']:>15.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"load_at_start": load, "load_at_end": loadavg(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
