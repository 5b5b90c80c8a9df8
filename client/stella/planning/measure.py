"""``stella profile``: what the planner needs to know of a model, measured; it writes the
profile file (:mod:`stella.planning.profile_file`).

On one machine (:func:`profile_model`):

- **compute**: seconds per training step (forward, backward, the local optimizer) at the
  batch size, the median of ``steps`` after warm-up, with their quartiles and standard
  deviation (``compute_spread``), under the torch thread count the workers will use
  (``threads``, default 1, recorded as ``torch_threads``);
- **bytes per round** at a few densities and value codings: a real weight change (the
  model's parameters after a few steps minus before, what update mode pushes) through the
  real compressor (:class:`stella.compress.ErrorFeedbackCompressor`) and the real encoder
  (Rice indices, the coding's values): the bytes of the frames and entries;
- **the compressor's time** per model coordinate;
- **the server's time per step** at the job's size: a real ``stella-ps`` on loopback, ``W``
  clients replaying pre-encoded pushes (:func:`replay`, the loop ``bench.server`` times
  with too) at 1 and 3 workers; the server process's CPU per step, split by least squares
  into a cost per pushed coordinate and one per model coordinate (the broadcast's pass
  over its residual), and the broadcast pull's bytes per round, with the broadcast's
  settings as that server answered the registration.

From a running job (:func:`profile_from_status`): the workers' reports (compute s/it,
exchange, density, coding, bytes per push) and the job's broadcast settings through
``status``; the server's time is not in the reports (the profile says so and takes
bench.server's figures).

The iterations-to-target factor of each configuration is not measured here: it comes from
a table (the benchmarks' or the user's), and the profile labels its source.
"""
from __future__ import annotations

import datetime
import importlib
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from ..codec import CODINGS, DEFAULT_VALUE_DTYPE
from ..layout import FlatLayout
from ..protocol import BroadcastInfo, ValueDtype
from .profile_file import STALL_S, STALL_SOURCE, ProfileError, broadcast_bytes, pull_section

if TYPE_CHECKING:
    from ..client import Client, EncodedPush

__all__ = ["profile_model", "profile_from_status", "load_model_spec", "measure_compute", "measure_steps",
           "spread_of", "measure_bytes",
           "measure_server", "replay", "describe_machine", "DEFAULT_DENSITIES", "BENCH_SERVER"]

DEFAULT_DENSITIES = (0.003, 0.01, 0.03, 0.1)
# bench.server (bench/RESULTS.md 2026-11-26, 10M parameters, 1% pushes, broadcast q4 x2): 58 ms of server CPU per
# step at W = 2, 92 ms at W = 8: ~57 ns per pushed coordinate and ~4.7 ns per model coordinate and step. A profile
# takes them where it measured no server (--no-server, --from), and says so in its source
BENCH_SERVER = {"per_update_s": 57e-9, "per_numel_s": 4.7e-9,
                "source": "bench/RESULTS.md 2026-11-26 (bench.server, 1 shard, SGD, W = 2 and 8)"}


def describe_machine() -> str:
    """This machine's CPU and its logical CPUs, for a profile's labels."""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        cpu = platform.processor()
    return f"{cpu or platform.machine()}, {os.cpu_count()} logical CPUs"


def load_model_spec(spec: str) -> dict[str, Any]:
    """``MODULE:FN``: ``FN()`` returns a dict with ``model`` (a torch module), ``batch`` (one
    batch), ``loss`` (``loss(model, batch)`` -> scalar tensor), and optionally
    ``optimizer`` (default AdamW lr 1e-3) and ``batch_size`` (default: the batch's length)."""
    mod_name, _, fn_name = spec.partition(":")
    if not mod_name or not fn_name:
        raise ProfileError(f"--model {spec!r}: expected MODULE:FUNCTION (e.g. mytrain:stella_profile)")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise ProfileError(f"--model {spec!r}: {e}") from None
    out = fn()
    for key in ("model", "batch", "loss"):
        if key not in out:
            raise ProfileError(f"--model {spec!r}: {fn_name}() must return a dict with {key!r}")
    return dict(out)


def measure_compute(model: Any, loss: Callable[[Any, Any], Any], next_batch: Callable[[], Any], optimizer: Any,
                    steps: int = 20, warmup: int = 3) -> float:
    """Median seconds of one training step (zero_grad, forward, backward, optimizer step)."""
    return statistics.median(measure_steps(model, loss, next_batch, optimizer, steps, warmup))


def spread_of(times: Sequence[float]) -> dict[str, Any]:
    """A profile's ``compute_spread``: the timed steps' count, median, quartiles, standard
    deviation, least and most (seconds)."""
    xs = sorted(times)
    q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0],) * 3
    return {"steps": len(xs), "median_s": med, "q1_s": q1, "q3_s": q3,
            "stdev_s": statistics.stdev(xs) if len(xs) > 1 else 0.0, "min_s": xs[0], "max_s": xs[-1]}


def measure_steps(model: Any, loss: Callable[[Any, Any], Any], next_batch: Callable[[], Any], optimizer: Any,
                  steps: int = 20, warmup: int = 3) -> list[float]:
    """Seconds of each of ``steps`` training steps after ``warmup``."""
    import torch

    times = []
    for i in range(warmup + steps):
        batch = next_batch()
        t0 = time.perf_counter()
        optimizer.zero_grad()
        loss(model, batch).backward()
        optimizer.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def measure_bytes(update: Mapping[str, Any], densities: Sequence[float] = DEFAULT_DENSITIES,
                  codings: Sequence[str] = CODINGS, rounds: int = 4) -> tuple[list[dict[str, Any]], float]:
    """Bytes of one push of ``update`` (name -> tensor: a real weight change) at each
    density and coding, through the real compressor and encoder, with the compressor's
    and encoder's seconds per round (``compress_s``: the median of ``rounds`` after the first); and its
    seconds per coordinate at 1% (for a coding or density with no row)."""
    import msgspec

    from ..compress import ErrorFeedbackCompressor
    from ..payload import SparseTensor, encode_tensors
    from ..protocol import TensorSpec

    layout = [TensorSpec(n, tuple(int(s) for s in t.shape), "float32") for n, t in update.items()]
    numel = sum(t.numel() for t in update.values())
    flat = {name: t.detach().float().reshape(-1) for name, t in update.items()}
    out, per_numel = [], 0.0
    for d in densities:
        for c in codings:
            # the compressor's steady state: its threshold carried from the rounds before (the first round
            # searches for it), and its residual holding what those rounds did not send
            comp = ErrorFeedbackCompressor(density=d, value_dtype=c)
            times = []
            for _ in range(rounds):
                items = []
                t0 = time.perf_counter()
                for i, (name, t) in enumerate(flat.items()):
                    sg = comp.compress(name, t.clone())
                    items.append(SparseTensor(i, None if sg.is_dense else sg.indices, sg.values))
                entries, frames = encode_tensors(items, layout, "rice", cast(ValueDtype, c))
                times.append(time.perf_counter() - t0)  # compress and encode: the worker's CPU for a push
            dt = statistics.median(times[1:]) if len(times) > 1 else times[0]
            nbytes = sum(memoryview(f).nbytes for f in frames) + len(msgspec.msgpack.encode(entries)) + 64
            out.append({"density": d, "coding": c, "bytes": nbytes, "compress_s": dt})
            if abs(d - 0.01) < 1e-12 or per_numel == 0.0:
                per_numel = dt / max(1, numel)
    return out, per_numel


def replay(clients: Sequence[Client], pushes: Sequence[Sequence[EncodedPush]], versions: Sequence[int],
           steps: int, separate: bool = False) -> tuple[list[int], list[float]]:
    """``steps`` steps of pre-encoded pushes, as fast as the server answers: each step every
    client pushes its push of ``pushes[step % len(pushes)]`` and pulls the step's answer
    without decoding it, all sent at once (in one message, as a worker's round sends them;
    ``separate``: two); the step ends when every answer is in. Returns
    the clients' versions after the last step and each step's seconds (sent to answered).
    :func:`measure_server` and ``bench.server`` time the server with it."""
    versions = list(versions)
    seconds = []
    for s in range(steps):
        t0 = time.perf_counter()
        if separate:  # the push and the pull as two messages, as before protocol 15
            sent = [c.push(e, v, wait=False) for c, e, v in zip(clients, pushes[s % len(pushes)], versions)]
            pulls = [c.pull(v, wait_for=v + 1, decode=False, wait=False) for c, v in zip(clients, versions)]
        else:  # one message: what a worker's round sends
            pairs = [c.push_pull(e, v, v, wait_for=v + 1, decode=False)
                     for c, e, v in zip(clients, pushes[s % len(pushes)], versions)]
            sent, pulls = [a for a, _ in pairs], [b for _, b in pairs]
        for p in sent:
            p.result()
        versions = [p.result().version for p in pulls]
        seconds.append(time.perf_counter() - t0)
    return versions, seconds


MIN_SERVER_CPU_S = 0.25  # a point's server CPU at least this (25 ticks of /proc's 10 ms: within 4%) ...
MAX_SERVER_POINT_S = 10.0  # ... or this long, whichever comes first


def measure_server(shapes: Mapping[str, tuple[int, ...]], *, points: Sequence[tuple[int, float]] = ((1, 0.01),
                   (3, 0.01), (3, 0.03)), steps: int = 12, warmup: int = 3, timeout: float = 120.0,
                   server_args: Sequence[str] = (),
                   log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The server's CPU per step for each ``(workers, density)`` point, on loopback, a
    fresh ``stella-ps`` per point with ``server_args`` (e.g. the job's broadcast flags),
    replayed ``steps`` at a time until its CPU is at least ``MIN_SERVER_CPU_S`` or
    ``MAX_SERVER_POINT_S`` have passed; fitted into per pushed coordinate + per model coordinate. ``broadcast``: the
    broadcast's settings as the server answered the registration (None: exact pulls)."""
    import numpy as np

    from stella_ps.process import ServerProcess, process_cpu_seconds

    from ..client import Client

    numel = sum(int(np.prod(s)) for s in shapes.values())
    rng = np.random.default_rng(0)
    rows = []
    answered: list[BroadcastInfo | None] = []
    cuts: set[int] = set()  # the servers' dense cuts, as their clients laid the model out
    for workers, density in points:
        with ServerProcess(workers, ["--max-workers-per-key", str(workers + 1), *server_args], log_level="WARNING",
                           timeout=60) as ps:
            keys = ps.client_kwargs()
            clients = [Client(ps.endpoint, timeout=timeout, name=f"profile-{i}", server_key=keys.get("server_key"),
                              client_key=keys.get("client_key")) for i in range(workers)]
            try:
                init = {n: np.zeros(s, np.float32) for n, s in shapes.items()}
                for c in clients:
                    answered.append(c.register(init, {"name": "sgd", "lr": 1.0}, mode="update").broadcast)
                    assert c.flat is not None
                    cuts.add(c.flat.dense_below)
                encoded = []
                for c in clients:
                    upd = {}
                    for n, t in init.items():
                        k = max(1, int(t.size * density))
                        idx = np.sort(rng.choice(t.size, k, replace=False)).astype(np.int32)
                        upd[n] = (idx, (rng.standard_normal(k) * 1e-3).astype(np.float32))
                    encoded.append(c.encode_push(upd, value_dtype="f16", index_coding="rice"))
                versions = [c.pull(None, decode=False).version for c in clients]
                versions, _ = replay(clients, [encoded], versions, warmup)
                cpu0, t0, pulled0 = process_cpu_seconds(ps.pid), time.perf_counter(), clients[0].bytes_pulled
                done = 0
                while True:  # /proc counts CPU in ticks (10 ms): run on until the count is worth reading
                    versions, _ = replay(clients, [encoded], versions, steps)
                    done += steps
                    if (process_cpu_seconds(ps.pid) - cpu0 >= MIN_SERVER_CPU_S
                            or time.perf_counter() - t0 >= MAX_SERVER_POINT_S):
                        break
                cpu = (process_cpu_seconds(ps.pid) - cpu0) / done
                wall = (time.perf_counter() - t0) / done
                pulled = (clients[0].bytes_pulled - pulled0) / done
            finally:
                for c in clients:
                    c.close()
        rows.append({"workers": workers, "density": density, "cpu_s_per_step": cpu, "wall_s_per_step": wall,
                     "pull_bytes": pulled, "updates": workers * sum(max(1, int(np.prod(s) * density))
                                                                    for s in shapes.values())})
        log(f"  server: W={workers} density {density:g}: {1e3 * cpu:.1f} ms CPU/step, pull {pulled:,.0f} B/round")
    if any(b != answered[0] for b in answered):
        raise ProfileError(f"the loopback stella-ps answered different broadcast settings: {answered}")
    # cpu = per_update * updates + fixed, fixed = per_numel * numel
    a = np.array([[r["updates"], 1.0] for r in rows])
    y = np.array([r["cpu_s_per_step"] for r in rows])
    per_update, fixed = np.linalg.lstsq(a, y, rcond=None)[0]
    if per_update < 0 or fixed < 0:
        per_update, fixed = max(per_update, 0.0), max(float(np.mean(y - max(per_update, 0.0) * a[:, 0])), 0.0)
    return {"per_update_s": float(per_update), "per_numel_s": float(fixed) / numel, "measured": rows,
            "source": f"measured: stella-ps on loopback, {describe_machine()}", "broadcast": answered[0],
            "dense_below": cuts.pop() if len(cuts) == 1 else sorted(cuts)}


def _broadcast_flags(values: str | None, factor: float | None) -> list[str]:
    """``stella-ps`` flags for the job's broadcast settings, those given."""
    return ([] if values is None else ["--broadcast-values", values]) + \
        ([] if factor is None else ["--broadcast-factor", repr(float(factor))])


def profile_model(model: Any, loss: Callable[[Any, Any], Any], next_batch: Callable[[], Any], *,
                  optimizer: Any = None, batch_size: int, name: str = "model", steps: int = 30,
                  threads: int | None = 1,
                  densities: Sequence[float] = DEFAULT_DENSITIES, server: bool = True,
                  broadcast_values: str | None = None, broadcast_factor: float | None = None,
                  dense_below: int | None = None, target: Mapping[str, Any] | None = None,
                  factors: Sequence[Mapping[str, Any]] = (),
                  log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Measure a model (module doc) and return the profile as a JSON-ready dict.

    ``broadcast_values``, ``broadcast_factor``: the job's broadcast settings (``stella-ps
    --broadcast-values``, ``--broadcast-factor``). With ``server``, the loopback ``stella-ps``
    runs those given (its own defaults for the others) and the profile records what it
    answered at registration; without, no server is asked, so both must be given, and the
    pull's bytes are estimated from their coded bits. ``dense_below``: the job's dense cut
    (``stella-ps --dense-below``; None: the server's default), which tensors go whole.
    ``threads``: torch's thread count while the step is timed (the workers', 1 by default as
    Stella's examples set it; None: leave torch's as it is), recorded as ``torch_threads``."""
    import torch

    if not server and (broadcast_values is None or broadcast_factor is None):
        raise ProfileError("no server is measured (--no-server), so the job's broadcast settings must be given: "
                           "--broadcast-values and --broadcast-factor, as its stella-ps runs them")
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    before_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        used_threads = torch.get_num_threads()
        spread = spread_of(measure_steps(model, loss, next_batch, optimizer, steps=steps))
    finally:
        torch.set_num_threads(before_threads)
    compute_s = spread["median_s"]
    log(f"  compute: {1e3 * compute_s:.1f} ms/step at batch {batch_size} (quartiles {1e3 * spread['q1_s']:.1f}-"
        f"{1e3 * spread['q3_s']:.1f} ms over {spread['steps']} steps, {used_threads} torch thread(s))")
    update = {n: (p.detach() - before[n]) for n, p in params.items()}  # the weights' change: what update mode pushes
    push, per_numel = measure_bytes(update, densities)
    log("  push bytes: " + ", ".join(f"{e['density']:g}/{e['coding']} {e['bytes']:,}" for e in push))
    numel = sum(p.numel() for p in params.values())
    if dense_below is None:
        from stella_ps.config import ServerConfig

        dense_below = ServerConfig().dense_below
    sparse_numel = FlatLayout.of(list(params.values()), dense_below).sparse_numel  # the layout's own cut
    shapes = {n: tuple(int(s) for s in p.shape) for n, p in params.items()}
    if server:
        srv = measure_server(shapes, points=((1, 0.01), (3, 0.01), (3, 0.03)),  # with the job's dense cut too
                             server_args=[*_broadcast_flags(broadcast_values, broadcast_factor), "--dense-below",
                                          str(dense_below)], log=log)
        answered = srv.pop("broadcast")
        # the broadcast of a job of one worker is smaller (its residual is one push's): the rows with W > 1
        several = [r for r in srv["measured"] if r["workers"] > 1] or srv["measured"]
        pull = pull_section(answered, [{"density": r["density"], "bytes": r["pull_bytes"]} for r in several])
    else:
        assert broadcast_values is not None and broadcast_factor is not None
        given = BroadcastInfo(values=cast(ValueDtype, broadcast_values), factor=float(broadcast_factor))
        srv = dict(BENCH_SERVER)
        pull = pull_section(given, [{"density": d, "bytes": broadcast_bytes(sparse_numel, d, given.factor,
                                                                            given.values)} for d in densities],
                            source="estimated from the coded bits: the broadcast's factor x the pushes' "
                                   "coordinates, in its coding (no server measured)")
    return {
        "stella_profile": 1, "model": name, "numel": numel, "sparse_numel": sparse_numel, "batch_size": batch_size,
        "device": str(next(iter(params.values())).device) + f" ({describe_machine()}, torch threads "
                                                              f"{used_threads})",
        "torch_threads": used_threads, "compute_spread": spread,
        "measured_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_average": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "compute_s": compute_s, "compress_s_per_numel": per_numel, "push": push, "pull": pull, "server": srv,
        "target": dict(target or {"dense_iterations": 1000, "global_batch": batch_size, "critical_batch": 0,
                                   "source": "placeholder: give --target-iterations (dense training's iterations "
                                   "to the target)"}),
        "factors": [dict(f) for f in factors],
        "revocation": {"stall_s": STALL_S, "source": STALL_SOURCE},
    }


def _status_replies(address: str, samples: int, interval: float, timeout: float, server_key: str | None,
                    client_key: str | None, sleep: Callable[[float], None] = time.sleep) -> Iterator[Any]:
    """A running job's ``status`` replies (one per shard, a list, for a sharded job),
    ``samples`` of them ``interval`` seconds apart, over one connection that does not join."""
    from ..shards import connect

    with connect(address, timeout=timeout, join=False, server_key=server_key, client_key=client_key) as c:
        for i in range(samples):
            yield c.status()
            if i + 1 < samples:
                sleep(interval)


def profile_from_status(address: str, *, samples: int = 3, interval: float = 2.0, timeout: float = 5.0,
                        server_key: str | None = None, client_key: str | None = None,
                        batch_size: int = 1) -> dict[str, Any]:
    """A profile from a running job's ``status`` replies (its workers' reports): compute
    s/it (the median over workers and samples), bytes per push and pull at the density
    and coding the workers use, and the job's broadcast settings as its status says them.
    The server's time comes from bench.server's figures."""
    reps: list[Any] = []
    pushes: list[tuple[float, str, float, float]] = []
    numel = 0
    broadcast: list[BroadcastInfo | None] = []
    for got in _status_replies(address, max(1, samples), interval, timeout, server_key, client_key):
        st = got[0] if isinstance(got, list) else got
        numel = sum(s.numel for s in got) if isinstance(got, list) else st.numel
        broadcast = [s.broadcast for s in got] if isinstance(got, list) else [st.broadcast]
        for w in st.live or []:
            r = w.report
            if r is None or w.pushes == 0:
                continue
            reps.append(r)
            pushes.append((r.density, r.value_dtype or DEFAULT_VALUE_DTYPE, r.bytes_pushed / w.pushes,
                           r.bytes_pulled / max(1, w.pulls)))
    if not reps:
        raise ProfileError(f"{address}: no worker has reported yet (a report rides on each push)")
    if any(b != broadcast[0] for b in broadcast):
        raise ProfileError(f"{address}: the shards answer different broadcast settings: {broadcast}")
    d = statistics.median(p[0] for p in pushes)
    coding = statistics.mode(p[1] for p in pushes)
    return {
        "stella_profile": 1, "model": f"job at {address}", "numel": numel, "sparse_numel": numel,
        "batch_size": batch_size, "device": "the job's workers (from their reports)",
        "measured_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "compute_s": statistics.median(r.compute_s for r in reps),
        "compute_spread": spread_of([r.compute_s for r in reps]) | {
            "source": "the workers' reports (each a running mean of its steps), not single steps"},
        "compress_s_per_numel": 0.0,
        "push": [{"density": d, "coding": coding, "bytes": statistics.median(p[2] for p in pushes)}],
        "pull": pull_section(broadcast[0], [{"density": d, "bytes": statistics.median(p[3] for p in pushes)}]),
        "server": dict(BENCH_SERVER),
        "target": {"dense_iterations": 1000, "global_batch": batch_size, "critical_batch": 0,
                   "source": "placeholder: give --target-iterations"},
        "factors": [], "revocation": {"stall_s": STALL_S, "source": STALL_SOURCE},
        "reports": len(reps),
    }


def run_from_status(address: str, *, samples: int = 6, interval: float = 2.0, timeout: float = 5.0,
                    server_key: str | None = None, client_key: str | None = None,
                    clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """A running job's pace, as ``stella calibrate --from`` records it: ``samples`` of its
    ``status`` replies, ``interval`` seconds apart, and each worker's reports in them.

    - ``s_per_it``: the slowest worker's seconds per iteration over the window (its report's
      step count, which rides on each push, against this clock: good to about a round over
      the window, so a window of 20 rounds or more);
    - ``compute_s``: the slowest worker's step (the median of its reports' running means);
    - ``exchange_s``: the median of the reports' exchange per round (compressor, push, the
      server's step and the pull);
    - what the job runs, to check a configuration against: ``workers`` (those that made a
      step in the window), ``density``, ``coding`` and ``H`` (the median local steps a round).

    Raises :class:`ProfileError` when no worker made a step in the window."""
    steps: dict[int, list[tuple[float, int]]] = {}
    reports: list[Any] = []
    for got in _status_replies(address, max(2, samples), interval, timeout, server_key, client_key, sleep):
        now = clock()
        st = got[0] if isinstance(got, list) else got  # every shard has the same workers
        for w in st.live or []:
            r = w.report
            if r is None:
                continue
            steps.setdefault(w.worker, []).append((now, r.step))
            reports.append((w.worker, r))
    paces = {}
    for worker, seen in steps.items():
        (t0, s0), (t1, s1) = seen[0], seen[-1]
        if s1 > s0 and t1 > t0:
            paces[worker] = (t1 - t0) / (s1 - s0)
    if not paces:
        window = max(2, samples) * interval
        raise ProfileError(f"{address}: no worker made a step in the {window:g} s window (of {len(steps)} that "
                           "have reported): is the job training? A longer window: --samples, --interval")
    slowest = max(paces, key=lambda w: paces[w])
    mine = [r for w, r in reports if w in paces]
    by_worker = {w: statistics.median(r.compute_s for v, r in reports if v == w) for w in paces}
    return {
        "s_per_it": paces[slowest], "compute_s": max(by_worker.values()),
        "exchange_s": statistics.median(r.exchange_s for r in mine),
        "workers": len(paces), "density": statistics.median(r.density for r in mine),
        "coding": statistics.mode(r.value_dtype or DEFAULT_VALUE_DTYPE for r in mine),
        "H": max(1, round(statistics.median(r.local_steps or 1 for r in mine))),
        "window_s": steps[slowest][-1][0] - steps[slowest][0][0], "reports": len(mine),
    }
