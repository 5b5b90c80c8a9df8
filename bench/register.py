"""Job start: W workers register one model at the same time against a real ``stella-ps``.

Each worker is a :class:`stella.Client` in a thread of this process (registration is
I/O: the server and the sockets do the work). Two ways side by side, each on a fresh
server:

- ``held``: what the client library does. Each worker sends a probe without values;
  the first is asked for the values, and the others' probes are held until the model
  exists (protocol ``Register.wait_ms``), so the model crosses the wire once.
- ``each_sends``: every worker sends its values with its registration (what a job sees
  when every probe is answered "send them", as before protocol version 6): the server
  takes the first and ignores the rest, but each crossed the wire.

Reported: the wall time until every worker has registered, the bytes the server
received (its ``bytes_in``), and that over the model's size. On a link of ``L`` Mbit/s
into the server the extra bytes cost ``8 * bytes / L`` seconds at job start.

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
from stella.protocol import Register, Registered, TensorSpec

OPTIMIZER: dict[str, Any] = {"name": "sgd", "lr": 0.1}


def _register_all(clients: list[Client], model: dict[str, np.ndarray], how: str) -> float:
    def held(c: Client) -> None:
        c.register(model, OPTIMIZER)

    def each_sends(c: Client) -> None:  # the values with the registration, at once
        assert c.worker_id is not None  # joined
        layout = [TensorSpec(n, tuple(t.shape), "float32") for n, t in model.items()]
        msg = Register(worker=c.worker_id, tensors=layout, optimizer=OPTIMIZER, values=True)
        c._session.request(msg, Registered, list(model.values()))

    fn = held if how == "held" else each_sends
    threads = [threading.Thread(target=fn, args=(c,)) for c in clients]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def run(workers: int, numel: int, how: str) -> dict:
    model = {"w": np.random.default_rng(0).standard_normal(numel).astype(np.float32)}
    with contextlib.ExitStack() as stack:
        srv = start_shards(stack, 1, ["--max-model-bytes", str(64 * numel + (1 << 30)),
                                      "--max-workers-per-key", str(workers)], workers=workers,
                           log_level="WARNING")[0]
        clients = [stack.enter_context(Client(srv.endpoint, timeout=300, **srv.client_kwargs()))
                   for _ in range(workers)]
        wall = _register_all(clients, model, how)
        st = clients[0].status()
        ids = sorted(c.worker_id for c in clients if c.worker_id is not None)
        if len(ids) != len(clients) or st.workers != ids:
            raise RuntimeError(f"not every worker registered: {st.workers}")
    return {"workers": workers, "numel": numel, "how": how, "wall_s": round(wall, 3),
            "bytes_in": st.bytes_in, "model_bytes": 4 * numel, "uploads": round(st.bytes_in / (4 * numel), 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="8,32", help="comma-separated worker counts")
    ap.add_argument("--numel", type=float, default=1e7)
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args(argv)
    load = loadavg()
    print(f"job start: W workers register a {int(a.numel):,}-parameter model at once (load at start: {load})")
    print(f"{'W':>3} {'how':<11} {'wall s':>7} {'MB in':>8} {'x model':>8} {'wall vs held':>13}")
    rows = []
    for w in (int(x) for x in a.workers.split(",")):
        held = run(w, int(a.numel), "held")
        each = run(w, int(a.numel), "each_sends")
        for r in (held, each):
            r["wall_x_held"] = round(r["wall_s"] / held["wall_s"], 2)
            rows.append(r)
            print(f"{r['workers']:>3} {r['how']:<11} {r['wall_s']:>7.2f} {r['bytes_in'] / 1e6:>8.1f} "
                  f"{r['uploads']:>8.2f} {r['wall_x_held']:>13.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"load_at_start": load, "load_at_end": loadavg(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
