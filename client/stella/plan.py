"""``stella plan``: what a job will cost, how long it will take, and on which machines.

Three inputs, one answer:

- a **catalog** (TOML, :func:`load_catalog`) of the machine kinds a user can get: the lab's
  own GPUs (price 0, a fixed count), cloud kinds on demand and on the spot market (price
  per hour, mean time to revocation), each with its links, and the host that runs
  ``stella-ps``;
- a **profile** (JSON, :func:`load_profile`, written by ``stella profile``) of the model:
  compute seconds per step, bytes per round at a few densities and codings, the server's
  time per step, the iterations dense training needs to reach the target and the factor
  each Stella configuration costs against them (with its source), and the coefficients a
  regression on measured runs fitted (:func:`fit`);
- the user's **deadline** and/or **budget**.

**The model** (:func:`predict`) follows Stella's own structure. A round is ``H`` local steps
on every machine (a site: its GPUs combine inside with torch.distributed and one worker
speaks over the WAN). The slowest machine sets the round's compute; faster ones run on
(more local steps, up to ``max_sync_every``) and their pushes carry more samples. The
exchange of a round runs in the background while the next round computes (one round
stale): compress, push over the slowest uplink (and the server site's downlink, which
carries every worker's push), the server's step (per pushed coordinate and per model
coordinate, divided among shards), the broadcast pull over the slowest downlink, and the
wait of a message that loses its tail in a drop-tail queue. A round lasts the longer of the
two. Six coefficients calibrate it, fitted by least squares on measured runs as CM-DARE (Li,
Walls, Guo, ICDCS 2020) fits its speed models: the compute scale, processor sharing on a
shared host, the share of it the exchange's CPU work takes, the link scale, a fixed
overhead per round and the tail loss's wait (docs/plan.md section 3).

**Time to target** = dense iterations (at the job's global batch, through a critical batch
size: iterations scale as ``1 + B_crit / B``) x the configuration's iterations factor, at
the predicted iterations per second. **Revocations**: a spot kind of ``n`` machines with a
mean time to revocation ``m`` loses ``n T / m`` machines over ``T``; each costs the
server's stall on the silent worker (the chaos benchmark's figure), the replacement's
start and snapshot pull during which the job runs without that machine's share, and its
lost work (its unsent local steps and residual). Cost = machines' prices x time + the
server hosts; the share of it due to revocations is reported.

:func:`plan` enumerates machine mixes (the on-premises kinds, all of each or none, with up
to two rented kinds, each on demand or spot, in counts 1, 2, 4, ... up to what is
available) x densities x codings x H x shards, vectorised with NumPy, and ranks them:
cheapest within the deadline, fastest within the budget, or the Pareto front of time
against cost. No torch: ``stella plan`` answers in well under a second for 10 kinds.
"""
from __future__ import annotations

import dataclasses
import difflib
import itertools
import json
import math
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .codec import CODINGS, VALUE_BITS, coordinate_bits
from .errors import StellaError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10: the tomli backport, if installed
    try:
        import tomli as tomllib  # type: ignore[import-not-found,no-redef,unused-ignore]
    except ImportError:
        tomllib = None  # type: ignore[assignment,unused-ignore]

__all__ = ["PlanError", "CatalogError", "ProfileError", "MachineKind", "ServerHost", "Catalog", "Calibration",
           "Profile", "Group", "Config", "Prediction", "Observation", "PlanResult", "load_catalog", "load_profile",
           "predict", "fit", "plan", "render", "recommend", "parse_duration", "pareto_plot",
           "DENSITIES", "CODINGS", "SYNC_EVERY", "SHARDS"]

DENSITIES: tuple[float, ...] = (0.001, 0.003, 0.01, 0.03, 0.1)
SYNC_EVERY: tuple[int, ...] = (1, 2, 4, 8)
SHARDS: tuple[int, ...] = (1, 2, 4, 8)
# bench.server, 2026-11-26: 2 shards on 2 cores made 1.78-1.80x one shard's steps/s (W = 2)
SHARD_EXPONENT = 0.85
SHARD_SOURCE = "bench/RESULTS.md 2026-11-26 (bench.server: 2 shards 1.78x on 2 cores)"
# bench.chaos, 2026-11-23: the longest stall a killed worker caused (one step deadline)
STALL_S, STALL_SOURCE = 0.83, "bench/CHAOS.json 2026-11-23 (longest stall, 3 workers at 20 Mbit/s)"
START_S = 10.0  # a replacement worker's process start (imports, CUDA, join) before its snapshot pull
SERVER_RESTART_S = 0.5  # bench.chaos: 0.35 s from the kill to listening, then the workers' reconnects
MAX_RATIO_H = 8  # run-on: a fast machine makes at most this many times the slowest one's local steps
TOP_ROWS = 10
PARETO_POINTS = 40  # the front as plan() returns it (thinned evenly when longer)
CHUNK = 600_000  # elements of the (mixes, groups, settings) arrays per evaluation


class PlanError(StellaError, ValueError):
    """A catalog, profile or plan request that cannot be used (the message says where)."""


class CatalogError(PlanError):
    """The catalog file is not valid: the message names the file, the kind and the field."""


class ProfileError(PlanError):
    """The profile file is not valid, or lacks what the model needs."""


# ============================================================ the catalog


@dataclass(frozen=True)
class MachineKind:
    """One kind of machine (``[kinds.NAME]`` in the catalog). A machine is one site: its
    ``gpus`` combine inside it, and one Stella worker speaks for it over its links."""

    name: str
    gpu: str
    gpus: int  # per machine
    speed: float  # compute speed of one GPU relative to the profiled machine (1.0: the same)
    count: int  # machines available (on-premises: the ones the lab has)
    up_mbps: float
    down_mbps: float
    onprem: bool = False
    price: float = 0.0  # per machine-hour, on demand (on-premises: 0)
    spot_price: float | None = None  # per machine-hour on the spot market (None: not offered)
    mttr_h: float | None = None  # spot: mean time to revocation, hours
    replace_s: float = 300.0  # spot: a revoked machine's replacement, from request to training
    rtt_ms: float = 0.0  # round-trip time to the server's site
    host: str = ""  # a shared host ([hosts.NAME]) whose cores its workers share with other kinds and the server
    burst_kb: float = 0.0  # a token-bucket shaper's burst on its links: this much of a message passes at line rate
    # the bottleneck's drop-tail queue on each link, in ms at its rate (0: not modelled), where the bottleneck is
    # a hop away from the sender (a shaper on the sender's own interface pushes back without loss)
    up_queue_ms: float = 0.0
    down_queue_ms: float = 0.0

    def price_of(self, market: str) -> float:
        return self.spot_price if market == "spot" and self.spot_price is not None else self.price


@dataclass(frozen=True)
class ServerHost:
    """The CPU host that runs ``stella-ps`` (``[server]``); shards beyond its cores take more hosts."""

    name: str
    price: float
    cores: int
    up_mbps: float
    down_mbps: float
    mttr_h: float | None = None  # mean time between its failures or revocations (None: not modelled)
    restart_s: float = SERVER_RESTART_S  # from a failure to serving again from the newest checkpoint
    host: str = ""  # a shared host ([hosts.NAME]) it shares with workers


@dataclass(frozen=True)
class Catalog:
    kinds: tuple[MachineKind, ...]
    server: ServerHost
    currency: str = "USD"
    prices_note: str = ""  # where the prices come from ("illustrative ..." in the example)
    path: str = ""
    hosts: tuple[tuple[str, int], ...] = ()  # shared hosts: (name, cores)

    def kind(self, name: str) -> MachineKind:
        for k in self.kinds:
            if k.name == name:
                return k
        raise CatalogError(f"{self.path}: no kind {name!r} (kinds: {', '.join(k.name for k in self.kinds)})")


# field -> (type, required, check, what the check says)
_Check = tuple[type | tuple[type, ...], bool, Any, str]
_POS = (lambda v: v > 0, "> 0")
_NONNEG = (lambda v: v >= 0, ">= 0")
_NUM = (int, float)
KIND_FIELDS: dict[str, _Check] = {
    "gpu": (str, True, None, ""),
    "gpus": (int, False, *_POS),
    "speed": (_NUM, True, *_POS),
    "count": (int, True, *_POS),
    "up_mbps": (_NUM, True, *_POS),
    "down_mbps": (_NUM, True, *_POS),
    "onprem": (bool, False, None, ""),
    "price": (_NUM, False, *_NONNEG),
    "spot_price": (_NUM, False, *_NONNEG),
    "mttr_h": (_NUM, False, *_POS),
    "replace_s": (_NUM, False, *_NONNEG),
    "rtt_ms": (_NUM, False, *_NONNEG),
    "host": (str, False, None, ""),
    "burst_kb": (_NUM, False, *_NONNEG),
    "up_queue_ms": (_NUM, False, *_NONNEG),
    "down_queue_ms": (_NUM, False, *_NONNEG),
}
SERVER_FIELDS: dict[str, _Check] = {
    "name": (str, False, None, ""),
    "price": (_NUM, True, *_NONNEG),
    "cores": (int, False, *_POS),
    "up_mbps": (_NUM, True, *_POS),
    "down_mbps": (_NUM, True, *_POS),
    "mttr_h": (_NUM, False, *_POS),
    "restart_s": (_NUM, False, *_NONNEG),
    "host": (str, False, None, ""),
}
HOST_FIELDS: dict[str, _Check] = {"cores": (int, True, *_POS)}
TOP_FIELDS = {"currency", "prices_note", "server", "kinds", "hosts"}


def _unknown(where: str, key: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1)
    return f"{where}: unknown field {key!r}" + (f" (did you mean {close[0]!r}?)" if close else "") + \
        f"; fields: {', '.join(sorted(known))}"


def _fields(table: Mapping[str, Any], spec: Mapping[str, _Check], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in table:
        if key not in spec:
            raise CatalogError(_unknown(where, key, spec))
    for key, (typ, required, check, says) in spec.items():
        if key not in table:
            if required:
                raise CatalogError(f"{where}: missing field {key!r}")
            continue
        v = table[key]
        ok = isinstance(v, typ) and not (isinstance(v, bool) and typ is not bool)
        if not ok:
            names = " or ".join(t.__name__ for t in (typ if isinstance(typ, tuple) else (typ,)))
            raise CatalogError(f"{where}: field {key!r} must be {names}, got {v!r}")
        if isinstance(v, float) and not math.isfinite(v):
            raise CatalogError(f"{where}: field {key!r} must be finite, got {v!r}")
        if check is not None and not check(v):
            raise CatalogError(f"{where}: field {key!r} must be {says}, got {v!r}")
        out[key] = v
    return out


def read_toml(path: str) -> dict[str, Any]:
    """A TOML file as a dict (stdlib ``tomllib``)."""
    if tomllib is None:  # pragma: no cover
        raise PlanError("reading TOML needs Python >= 3.11 (tomllib) or the tomli package")
    with open(path, "rb") as f:
        return tomllib.load(f)


def load_catalog(path: str) -> Catalog:
    """Read and check a catalog; :class:`CatalogError` names the file, kind and field of
    the first problem. Format: docs/plan.md."""
    if tomllib is None:  # pragma: no cover
        raise CatalogError("reading a TOML catalog needs Python >= 3.11 (tomllib) or the tomli package")
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as e:
        raise CatalogError(f"{path}: cannot read the catalog: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise CatalogError(f"{path}: not valid TOML: {e}") from None
    return catalog_from_dict(doc, path)


def catalog_from_dict(doc: Mapping[str, Any], path: str = "<catalog>") -> Catalog:
    for key in doc:
        if key not in TOP_FIELDS:
            raise CatalogError(_unknown(path, key, TOP_FIELDS))
    server_t = doc.get("server")
    if not isinstance(server_t, dict):
        raise CatalogError(f"{path}: missing table [server] (the host that runs stella-ps: price, up_mbps, down_mbps)")
    hosts_t = doc.get("hosts", {})
    if not isinstance(hosts_t, dict):
        raise CatalogError(f"{path}: 'hosts' must be tables ([hosts.NAME] with cores = N)")
    hosts = []
    for name, t in hosts_t.items():
        if not isinstance(t, dict):
            raise CatalogError(f"{path}: host {name!r}: must be a table ([hosts.{name}] with cores = N)")
        hosts.append((name, int(_fields(t, HOST_FIELDS, f"{path}: host {name!r}")["cores"])))

    def host_of(v: Mapping[str, Any], where: str) -> str:
        h = v.get("host", "")
        if h and h not in hosts_t:
            raise CatalogError(f"{where}: field 'host' names no [hosts.{h}] table"
                               + (f" (hosts: {', '.join(hosts_t)})" if hosts_t else ""))
        return h

    s = _fields(server_t, SERVER_FIELDS, f"{path}: [server]")
    server = ServerHost(name=s.get("name", "server"), price=float(s["price"]), cores=s.get("cores", 1),
                        up_mbps=float(s["up_mbps"]), down_mbps=float(s["down_mbps"]),
                        mttr_h=None if "mttr_h" not in s else float(s["mttr_h"]),
                        restart_s=float(s.get("restart_s", SERVER_RESTART_S)), host=host_of(s, f"{path}: [server]"))
    kinds_t = doc.get("kinds")
    if not isinstance(kinds_t, dict) or not kinds_t:
        raise CatalogError(f"{path}: no machine kinds: add at least one [kinds.NAME] table")
    kinds = []
    for name, t in kinds_t.items():
        where = f"{path}: kind {name!r}"
        if not isinstance(t, dict):
            raise CatalogError(f"{where}: must be a table ([kinds.{name}])")
        v = _fields(t, KIND_FIELDS, where)
        onprem = v.get("onprem", False)
        if onprem:
            for bad in ("spot_price", "mttr_h"):
                if bad in v:
                    raise CatalogError(f"{where}: field {bad!r} is for cloud kinds; an on-premises kind "
                                       "(onprem = true) has no spot market")
            if v.get("price", 0) != 0:
                raise CatalogError(f"{where}: field 'price' must be 0 for an on-premises kind (onprem = true), "
                                   f"got {v['price']!r}")
        else:
            if "price" not in v:
                raise CatalogError(f"{where}: missing field 'price' (per machine-hour, on demand; "
                                   "set onprem = true for the lab's own machines)")
            if ("spot_price" in v) != ("mttr_h" in v):
                raise CatalogError(f"{where}: fields 'spot_price' and 'mttr_h' go together (a spot market needs "
                                   "its price and its mean time to revocation)")
        kinds.append(MachineKind(name=name, gpu=v["gpu"], gpus=v.get("gpus", 1), speed=float(v["speed"]),
                                 count=v["count"], up_mbps=float(v["up_mbps"]), down_mbps=float(v["down_mbps"]),
                                 onprem=onprem, price=float(v.get("price", 0.0)),
                                 spot_price=None if "spot_price" not in v else float(v["spot_price"]),
                                 mttr_h=None if "mttr_h" not in v else float(v["mttr_h"]),
                                 replace_s=float(v.get("replace_s", 300.0)), rtt_ms=float(v.get("rtt_ms", 0.0)),
                                 host=host_of(v, where), burst_kb=float(v.get("burst_kb", 0.0)),
                                 up_queue_ms=float(v.get("up_queue_ms", 0.0)),
                                 down_queue_ms=float(v.get("down_queue_ms", 0.0))))
    currency, note = doc.get("currency", "USD"), doc.get("prices_note", "")
    if not isinstance(currency, str) or not isinstance(note, str):
        raise CatalogError(f"{path}: fields 'currency' and 'prices_note' must be strings")
    return Catalog(tuple(kinds), server, currency, note, path, tuple(hosts))


# ============================================================ the profile


@dataclass(frozen=True)
class Calibration:
    """The model's fitted coefficients (:func:`fit`); the defaults are the bare structure."""

    compute: float = 1.0  # measured step time / the profile's, on a host of its own
    host_load: float = 1.0  # processor sharing on a shared host: steps stretch by max(1, host_load x n / cores)
    exchange_stretch: float = 0.0  # the share of that stretch the exchange's CPU work (compressor, server) takes
    link: float = 1.0  # measured link time / bytes over the nominal rate
    round_s: float = 0.0  # fixed seconds per round (messages, scheduling)
    tail_loss: float = 0.0  # a message that loses its tail waits this many of its queue's delays (TCP's timer)
    jitter: float = 0.0  # coefficient of variation of a step's and an exchange's time (the round's expected max)
    worker_round_s: float = 0.0  # a worker's CPU per round beside its compressor (decoding, applying, messages)
    source: str = "not fitted (the bare structure)"
    runs: int = 0
    exchange_runs: int = 0  # of those, the runs bound by their exchange (the link terms' fit)


@dataclass(frozen=True)
class Profile:
    """A model's profile (``stella profile`` writes it; docs/plan.md has the format)."""

    model: str
    numel: int
    sparse_numel: int  # coordinates in tensors that go top-k (the rest go dense every round)
    batch_size: int
    compute_s: float  # one step (forward, backward, local optimizer) at batch_size, profiled machine
    compress_s_per_numel: float  # the compressor's seconds per coordinate, where ``compress`` has no row
    push: tuple[tuple[float, str, float], ...]  # (density, coding, bytes per round) measured
    pull: tuple[tuple[float, float], ...]  # (density of the pushes, bytes per round of the broadcast)
    pull_factor: float
    pull_values: str
    server_per_update_s: float  # server CPU per pushed coordinate
    server_per_numel_s: float  # ... and per model coordinate, per step (the broadcast's pass)
    dense_iterations: float  # dense training's iterations to the target at target_batch
    target_batch: int  # the global batch those iterations were measured at
    critical_batch: float  # iterations scale as (1 + critical_batch / B)
    target_source: str
    factors: tuple[tuple[float, str, int, float, str], ...]  # (density, coding, H, factor, source)
    calibration: Calibration = field(default_factory=Calibration)
    stall_s: float = STALL_S
    device: str = ""
    path: str = ""
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    compress: tuple[tuple[float, str, float], ...] = ()  # (density, coding, seconds per round) measured

    # ---- the compressor's time: linear in the density, per coding, on what was measured
    def compress_s(self, density: float, coding: str) -> float:
        pts = [(d, y) for d, c, y in self.compress if c == coding] or [(d, y) for d, _, y in self.compress]
        if len(pts) < 2:
            return self.compress_s_per_numel * self.numel
        a, b = _line(pts)
        return a + b * density

    # ---- bytes: linear in the coded bits, fitted on what was measured
    def push_bytes(self, density: float, coding: str) -> float:
        a, b = _line([(self.sparse_numel * d * coordinate_bits(d, c) / 8, y) for d, c, y in self.push])
        return a + b * self.sparse_numel * density * coordinate_bits(density, coding) / 8

    def pull_bytes(self, density: float) -> float:
        def coded(d: float) -> float:
            k = min(1.0, self.pull_factor * d)
            return self.sparse_numel * k * coordinate_bits(k, self.pull_values) / 8

        a, b = _line([(coded(d), y) for d, y in self.pull])
        return a + b * coded(density)

    def factor(self, density: float, coding: str, h: int) -> tuple[float, str]:
        """Iterations to target against dense training for a configuration, with its source.

        The table's entry when there is one; otherwise bounds from monotonicity: a
        configuration *harsher* on every axis (lower density, a coarser coding, more local
        steps) needs at least as many iterations. The estimate is the midpoint of the
        largest factor of the milder entries and the smallest of the harsher ones; the
        harsher one's alone for a configuration milder than the table's; infinite (not
        considered) for one harsher than every entry, since nothing bounds it; else the
        nearest entry."""
        if not self.factors:
            return 1.0, "no table: assumed equal to dense training's iterations (unverified)"
        q = (density, _CODING_RANK.get(coding, 2), h)
        for e in self.factors:
            if abs(e[0] - density) <= 1e-9 * density and e[1] == coding and e[2] == h:
                return e[3], e[4]
        milder = [e for e in self.factors if _harsher(q, _axes(e))]
        harsher = [e for e in self.factors if _harsher(_axes(e), q)]
        lo = max(milder, key=lambda e: e[3]) if milder else None
        hi = min(harsher, key=lambda e: e[3]) if harsher else None
        if lo and hi:
            f = (lo[3] + max(lo[3], hi[3])) / 2
            return f, f"between {_entry(lo)} and {_entry(hi)} (interpolated)"
        if lo:  # harsher than anything measured: no estimate; such configurations are not considered
            return math.inf, f"harsher than every entry of the table (at least {_entry(lo)}): not considered"
        if hi:
            return hi[3], f"at most {_entry(hi)} (milder than every entry)"

        def dist(e: tuple[float, str, int, float, str]) -> float:
            return (abs(math.log(e[0] / density)) + 0.7 * abs(_CODING_RANK.get(e[1], 2) - q[1])
                    + abs(math.log2(e[2] / h)))

        best = min(self.factors, key=dist)
        return best[3], f"nearest {_entry(best)}"


_CODING_RANK = {c: i for i, c in enumerate(("f32", "f16", "bf16", "q4", "q2"))}
_CODING_RANK["bf16"] = _CODING_RANK["f16"]


def _axes(e: tuple[float, str, int, float, str]) -> tuple[float, int, int]:
    return e[0], _CODING_RANK.get(e[1], 2), e[2]


def _harsher(a: tuple[float, int, int], b: tuple[float, int, int]) -> bool:
    """Configuration ``a`` (density, coding rank, H) is at least as harsh as ``b`` on every axis."""
    return a[0] <= b[0] * (1 + 1e-9) and a[1] >= b[1] and a[2] >= b[2]


def _entry(e: tuple[float, str, int, float, str]) -> str:
    return f"{e[0]:.2%}/{e[1]}/H={e[2]} x{e[3]:.2f} ({e[4]})"


def _line(pts: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` (``a`` >= 0); through the origin with one point."""
    if not pts:
        return 0.0, 1.0
    if len(pts) == 1 or len({x for x, _ in pts}) == 1:
        x, y = pts[0]
        return 0.0, y / x if x > 0 else 0.0
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    b = sum((x - mx) * (y - my) for x, y in pts) / sxx
    a = my - b * mx
    if a < 0:  # a negative fixed part is noise: refit through the origin
        a, b = 0.0, sum(x * y for x, y in pts) / sum(x * x for x, _ in pts)
    return a, b


def _req(doc: Mapping[str, Any], key: str, where: str, typ: type | tuple[type, ...] = (int, float)) -> Any:
    if key not in doc:
        raise ProfileError(f"{where}: missing field {key!r}")
    v = doc[key]
    if not isinstance(v, typ) or isinstance(v, bool):
        raise ProfileError(f"{where}: field {key!r} has the wrong type: {v!r}")
    return v


def profile_from_dict(doc: Mapping[str, Any], path: str = "<profile>") -> Profile:
    if doc.get("stella_profile") != 1:
        raise ProfileError(f"{path}: not a Stella profile (no \"stella_profile\": 1; write one with stella profile)")
    where = path
    push = tuple((float(_req(e, "density", f"{where}: push")), str(_req(e, "coding", f"{where}: push", str)),
                  float(_req(e, "bytes", f"{where}: push"))) for e in _req(doc, "push", where, list))
    for d, c, _ in push:
        if c not in VALUE_BITS or not 0 < d <= 1:
            raise ProfileError(f"{where}: push entry with density {d} and coding {c!r} is not valid")
    if not push:
        raise ProfileError(f"{where}: field 'push' is empty (bytes per round at a few densities are needed)")
    pull_t = _req(doc, "pull", where, dict)
    pull = tuple((float(_req(e, "density", f"{where}: pull")), float(_req(e, "bytes", f"{where}: pull")))
                 for e in _req(pull_t, "bytes", f"{where}: pull", list))
    server = _req(doc, "server", where, dict)
    target = _req(doc, "target", where, dict)
    factors = tuple((float(_req(e, "density", f"{where}: factors")), str(_req(e, "coding", f"{where}: factors", str)),
                     int(_req(e, "H", f"{where}: factors", int)), float(_req(e, "factor", f"{where}: factors")),
                     str(e.get("source", target.get("source", "")))) for e in doc.get("factors", []))
    cal_t = doc.get("calibration") or {}
    cal = Calibration(**{k: cal_t[k] for k in (f.name for f in dataclasses.fields(Calibration)) if k in cal_t})
    rev = doc.get("revocation") or {}
    numel = int(_req(doc, "numel", where))
    return Profile(
        model=str(doc.get("model", "?")), numel=numel, sparse_numel=int(doc.get("sparse_numel", numel)),
        batch_size=int(_req(doc, "batch_size", where)), compute_s=float(_req(doc, "compute_s", where)),
        compress_s_per_numel=float(doc.get("compress_s_per_numel", 0.0)), push=push, pull=pull,
        compress=tuple((d, c, float(e["compress_s"])) for (d, c, _), e in zip(push, doc["push"]) if "compress_s" in e),
        pull_factor=float(pull_t.get("factor", 2.0)), pull_values=str(pull_t.get("values", "q4")),
        server_per_update_s=float(_req(server, "per_update_s", f"{where}: server")),
        server_per_numel_s=float(_req(server, "per_numel_s", f"{where}: server")),
        dense_iterations=float(_req(target, "dense_iterations", f"{where}: target")),
        target_batch=int(_req(target, "global_batch", f"{where}: target")),
        critical_batch=float(target.get("critical_batch", 0.0)), target_source=str(target.get("source", "")),
        factors=factors, calibration=cal, stall_s=float(rev.get("stall_s", STALL_S)),
        device=str(doc.get("device", "")), path=path, raw=doc)


def load_profile(path: str) -> Profile:
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise ProfileError(f"{path}: cannot read the profile: {e.strerror or e}") from None
    except ValueError as e:
        raise ProfileError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ProfileError(f"{path}: a profile is a JSON object")
    return profile_from_dict(doc, path)


# ============================================================ the model


@dataclass(frozen=True)
class Group:
    """Machines of one kind in one market ("onprem", "ondemand" or "spot")."""

    kind: MachineKind
    market: str
    count: int

    @property
    def label(self) -> str:
        return f"{self.count}x {self.kind.name}" + ("" if self.market == "onprem" else f" ({self.market})")


@dataclass(frozen=True)
class Config:
    groups: tuple[Group, ...]
    density: float
    coding: str
    sync_every: int  # H
    shards: int = 1

    @property
    def workers(self) -> int:
        return sum(g.count for g in self.groups)

    @property
    def machines(self) -> str:
        return " + ".join(g.label for g in self.groups)


@dataclass(frozen=True)
class Prediction:
    config: Config
    s_per_it: float  # seconds per local step of the slowest machine (round / H)
    round_s: float
    compute_s: float  # a round's compute (the slowest machine's H steps)
    exchange_s: float  # a round's exchange: compress + link + server + fixed
    link_s: float
    server_s: float
    bound: str  # what sets the round: compute, push, pull, server
    max_sync_every: int  # what the fastest machine needs to run on through the round
    samples_per_s: float
    iterations: float  # the job's iterations to the target (dense x factor at its batch)
    factor: float
    factor_source: str
    time_s: float  # to the target, revocations included
    revocations: float  # expected
    cost: float
    revocation_cost: float  # the part of cost due to revocations


@dataclass(frozen=True)
class _Mix:
    """A machine mix as the model reads it: arrays of shape (mixes, groups)."""

    count: Any
    gpus: Any
    t_rel: Any  # step time relative to the profiled machine (1 / speed); inf where count is 0
    up: Any  # bytes/s
    down: Any
    rtt: Any  # seconds
    price: Any  # per machine-hour in its market
    lam: Any  # revocations per second per machine (0: not spot)
    replace_s: Any
    burst: Any  # bytes
    up_queue: Any  # bytes a link's bottleneck holds (rate x queue + burst; 0: not modelled)
    down_queue: Any
    host: Any  # index into the catalog's hosts, -1: a host of its own
    # derived once (shape (mixes, 1) unless said): what every setting reads
    w: Any = None  # workers
    t_rel_max: Any = None  # the slowest machine's step time relative to the profiled one
    t_rel_min: Any = None
    inv_up: Any = None  # seconds per byte of the slowest uplink
    inv_down: Any = None
    rtt_max: Any = None
    gpus_total: Any = None
    rate: Any = None  # revocations per second of each group (mixes, groups)
    rate_total: Any = None
    price_h: Any = None  # the machines' price per hour
    boot_rate: Any = None  # replacements' price per second of the job
    rejoin_s: Any = None  # (mixes, groups) of a machine's snapshot pull, per model coordinate


GOODPUT = 1.0  # nominal rates; the link coefficient of the calibration takes the protocol overhead


def _mix_arrays(mixes: Sequence[Sequence[Group]], hosts: Sequence[tuple[str, int]] = ()):
    import numpy as np

    width = max(1, max(len(m) for m in mixes))
    index = {name: i for i, (name, _) in enumerate(hosts)}
    # per distinct (kind, market): its fields, once (a catalog has a few kinds; the mixes, millions of groups)
    fields = ("count", "gpus", "t_rel", "up", "down", "rtt", "price", "lam", "replace_s", "burst", "up_queue",
              "down_queue", "host")
    absent = (0.0, 0.0, math.inf, math.inf, math.inf, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1)
    seen: dict[tuple[int, str], tuple[float, ...]] = {}

    def row(g: Group) -> tuple[float, ...]:
        key = (id(g.kind), g.market)
        if key not in seen:
            k = g.kind
            up, down = k.up_mbps * 1e6 / 8 * GOODPUT, k.down_mbps * 1e6 / 8 * GOODPUT
            burst = k.burst_kb * 1024
            seen[key] = (k.gpus, 1.0 / k.speed, up, down, k.rtt_ms / 1e3, k.price_of(g.market),
                         1.0 / (k.mttr_h * 3600.0) if g.market == "spot" and k.mttr_h else 0.0, k.replace_s, burst,
                         up * k.up_queue_ms / 1e3 + burst if k.up_queue_ms > 0 else 0.0,
                         down * k.down_queue_ms / 1e3 + burst if k.down_queue_ms > 0 else 0.0,
                         index[k.host] if k.host else -1)
        return (g.count, *seen[key])

    table = np.array([[row(g) for g in m] + [absent] * (width - len(m)) for m in mixes], float)
    a = {f: table[:, :, i] for i, f in enumerate(fields)}
    a["host"] = a["host"].astype(int)
    present = a["count"] > 0
    col = lambda x: x[:, None]
    rate = a["count"] * a["lam"]
    return _Mix(**a, w=col(a["count"].sum(axis=1)), t_rel_max=col(np.where(present, a["t_rel"], 0.0).max(axis=1)),
                t_rel_min=col(a["t_rel"].min(axis=1)), inv_up=col((1 / a["up"]).max(axis=1)),
                inv_down=col((1 / a["down"]).max(axis=1)),
                rtt_max=col(a["rtt"].max(axis=1)),
                gpus_total=col((a["count"] * a["gpus"]).sum(axis=1)), rate=rate, rate_total=col(rate.sum(axis=1)),
                price_h=col((a["count"] * a["price"]).sum(axis=1)),
                boot_rate=col((rate * a["price"] * a["replace_s"]).sum(axis=1)) / 3600,
                rejoin_s=np.where(present, 4 / a["down"], 0.0))


def _evaluate(profile: Profile, catalog: Catalog, mix: _Mix, settings: Sequence[tuple[float, str, int, int]],
              checkpoint_every: int = 100, detail: bool = True) -> dict[str, Any]:
    """The model for every mix (rows) at every setting ``(density, coding, H, shards)``
    (columns): a dict of arrays of shape (mixes, settings)."""
    import numpy as np

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # inf: a configuration not considered
        return _evaluate_arrays(np, profile, catalog, mix, settings, checkpoint_every, detail)


def _evaluate_arrays(np: Any, profile: Profile, catalog: Catalog, mix: _Mix,
                     settings: Sequence[tuple[float, str, int, int]], checkpoint_every: int,
                     detail: bool) -> dict[str, Any]:
    cal, srv, n, bs = profile.calibration, catalog.server, profile.numel, profile.batch_size
    d = np.array([x[0] for x in settings], float)[None, :]
    h = np.array([x[2] for x in settings], float)[None, :]
    shards = np.array([x[3] for x in settings], float)[None, :]
    push_b = np.array([profile.push_bytes(x[0], x[1]) for x in settings])[None, :]
    pull_b = np.array([profile.pull_bytes(x[0]) for x in settings])[None, :]
    w = mix.w
    # the exchange of a round: compress, push (slowest uplink, or the server's downlink carrying every push),
    # the server's step (per pushed and per model coordinate, over the shards), the broadcast pull
    hosts = np.ceil(shards / srv.cores)
    # each machine's message over its own link, less what its shaper's burst lets through at line rate (the
    # bucket refills between rounds), the slowest of them
    if mix.burst.any():
        burst = mix.burst[:, :, None]
        push_s = (np.maximum(push_b[:, None, :] - burst, 0) / mix.up[:, :, None]).max(axis=1)
        pull_s = (np.maximum(pull_b[:, None, :] - burst, 0) / mix.down[:, :, None]).max(axis=1)
    else:
        push_s, pull_s = push_b * mix.inv_up, pull_b * mix.inv_down
    push_s = np.maximum(push_s, push_b * w / (srv.down_mbps * 1e6 / 8 * hosts))
    pull_s = np.maximum(pull_s, pull_b * w / (srv.up_mbps * 1e6 / 8 * hosts))
    tail = 0.0
    if cal.tail_loss and (mix.up_queue.any() or mix.down_queue.any()):
        tail = cal.tail_loss * (_tail_loss_s(np, push_b, mix.up_queue, mix.up)
                                + _tail_loss_s(np, pull_b, mix.down_queue, mix.down))
    link = cal.link * (push_s + pull_s) + tail + 2 * mix.rtt_max
    server = (profile.server_per_update_s * w * profile.sparse_numel * d + profile.server_per_numel_s * n) / \
        np.minimum(shards, srv.cores * hosts) ** SHARD_EXPONENT
    # one worker's CPU per round: its compressor, and the fixed rest (decode and apply the pull, the messages)
    compress_1 = np.array([profile.compress_s(x[0], x[1]) for x in settings])[None, :] + cal.worker_round_s
    # compute: each machine's step, calibrated and stretched by its shared host; the slowest sets the round
    step = profile.compute_s * cal.compute
    if (mix.host >= 0).any():
        load, stretch, s_server = _host_load(np, catalog, mix, profile.compute_s, h, compress_1, server,
                                             cal.host_load)
        present = (mix.count > 0)[:, :, None]
        t_step = mix.t_rel[:, :, None] * step * stretch  # inf where a group is absent
        t_slow = np.where(present, t_step, 0.0).max(axis=1)
        t_fast = t_step.min(axis=1)
        slowest = np.where(present, t_step, -1.0).argmax(axis=1)[:, None, :]
        s_slow = np.take_along_axis(stretch, slowest, axis=1)[:, 0, :]
        load_slow = np.take_along_axis(load, slowest, axis=1)[:, 0, :]
    else:  # no shared host: nothing stretches
        t_step = mix.t_rel[:, :, None] * step + 0 * h[:, None, :]
        t_slow, t_fast = mix.t_rel_max * step + 0 * h, mix.t_rel_min * step + 0 * h
        s_slow = s_server = 1.0
        load_slow = 0.0
    compute = h * t_slow
    # the exchange: the slowest machine's compressor (its push is the last; stretched on a shared host as its
    # compute is), the link, the server's step (stretched where it shares that host)
    compress = compress_1 * mix.t_rel_max * (1 + cal.exchange_stretch * (s_slow - 1))
    server = server * (1 + cal.exchange_stretch * (s_server - 1))
    exchange = compress + link + server + cal.round_s
    round_s = _expected_max(np, compute, exchange, cal.jitter, h)
    # run-on: a faster machine keeps stepping through the round, up to max_sync_every (absent groups: t_step
    # inf, so h steps of no machine)
    max_h = np.minimum(np.ceil(h * t_slow / t_fast - 1e-9), h * MAX_RATIO_H)
    steps = np.maximum(np.minimum(max_h[:, None, :], np.floor(round_s[:, None, :] / t_step + 1e-9)), h[:, None, :])
    machine_samples = mix.gpus * bs  # per step, one machine of the group
    samples = np.einsum("mk,mks->ms", mix.count * machine_samples, steps)  # per round
    batch = mix.gpus_total * bs  # the job's global batch per iteration
    its_per_s = samples / round_s / batch
    # iterations to the target: dense training's at this batch x the configuration's factor (at the H the
    # fastest machines make)
    h_eff = steps.max(axis=1)
    factor = np.empty_like(round_s)
    for j, (dj, cj, hj, _) in enumerate(settings):
        factor[:, j] = profile.factor(dj, cj, hj)[0]
        col = h_eff[:, j]
        if (col > hj).any():
            for x in np.unique(col[col > hj]):
                factor[col == x, j] = profile.factor(dj, cj, int(x))[0]
    dense = profile.dense_iterations * (1 + profile.critical_batch / batch) / \
        (1 + profile.critical_batch / profile.target_batch)
    iterations = dense * factor
    t0 = iterations / its_per_s
    # revocations: each spot machine lost costs the stall, its share of the job (its samples over the
    # round's, weighted by how much the iterations depend on the batch) during its replacement and rejoin
    # (a float32 snapshot pull, the process start), and its lost work: half a round of local steps and its
    # residual (<= 1/(d W) steps of the job's mean update)
    rate = mix.rate
    s_it = round_s / h
    lost = (h / 2 + 1.0 / (d * w)) * s_it
    share_rate = np.einsum("mk,mks->ms", rate * machine_samples, steps) / samples
    # the machine's samples matter as far as the iterations depend on the batch: d log(iterations) / d log(1/B)
    beta = (profile.critical_batch / batch) / (1 + profile.critical_batch / batch)
    share_rate_time = beta * np.einsum("mk,mks->ms", rate * machine_samples * (mix.replace_s + n * mix.rejoin_s
                                                                                + START_S), steps) / samples
    lam_total = mix.rate_total + 0 * d
    lam_loss = profile.stall_s * lam_total + share_rate_time + share_rate * lost  # job seconds lost per second
    if srv.mttr_h:  # the server: its restart, and the steps since the newest checkpoint (half an interval)
        lam_srv = hosts / (srv.mttr_h * 3600.0)
        lam_loss = lam_loss + lam_srv * (srv.restart_s + checkpoint_every / 2 * s_it)
        lam_total = lam_total + lam_srv
    time_s = np.where(lam_loss < 0.9, t0 / np.maximum(1 - lam_loss, 0.1), np.inf)
    price_h = mix.price_h + srv.price * hosts
    boot = mix.boot_rate * time_s  # a replacement is paid for while it starts (the revoked machine no longer is)
    cost = price_h * time_s / 3600 + boot
    if not detail:  # what the ranking reads
        return {"time_s": time_s, "cost": cost}
    cost0 = price_h * t0 / 3600
    parts = np.stack(np.broadcast_arrays(cal.link * push_s, cal.link * pull_s, server, compress))
    bound = np.where(compute >= exchange, 0, 1 + parts.argmax(axis=0))
    return {"s_per_it": s_it, "round_s": round_s, "compute_s": compute, "exchange_s": exchange, "link_s": link,
            "server_s": server + 0 * w, "bound": bound, "max_sync_every": max_h, "samples_per_s": samples / round_s,
            "iterations": iterations, "factor": factor, "h_eff": h_eff, "time_s": time_s,
            "revocations": lam_total * time_s, "cost": cost, "revocation_cost": cost - np.minimum(cost0, cost),
            "load": load_slow + 0 * round_s}


# The window of message sizes that lose their tail, as bench.transport measured it on the test bed's links at
# 10-100 Mbit/s (2026-11-26, docs/plan.md section 3): above TAIL_OVERFLOW x the queue (a message a little over
# the queue gets through: the queue drains while the flight arrives), and up to TCP's largest single flight. A
# larger message loses, if at all, mid-flight, and the segments behind the loss repair it at once
TAIL_OVERFLOW = 1.3
TAIL_FLIGHT_BYTES = 320 * 1024


def _tail_loss_s(np: Any, size: Any, queue: Any, rate: Any) -> Any:
    """The wait of a message that loses its tail, in queue delays (the calibration's
    ``tail_loss`` scales it), the longest over the mix's machines: shape (mixes, settings).

    A message that TCP sends as one flight (up to :data:`TAIL_FLIGHT_BYTES`) into a
    drop-tail queue it overflows (``queue``: bytes, 0 where not modelled; by
    :data:`TAIL_OVERFLOW` x the queue, as measured) loses its last
    segments. No later segment tells the sender, so it waits for its timer (a tail-loss
    probe, or the retransmission timeout), about one to two queue delays with the queue
    full. bench.transport measures it: docs/plan.md section 3."""
    q = queue[:, :, None]
    hit = (q > 0) & (size[:, None, :] > TAIL_OVERFLOW * q) & (size[:, None, :] <= TAIL_FLIGHT_BYTES)
    return np.where(hit, q / rate[:, :, None], 0.0).max(axis=1)


def _expected_max(np: Any, compute: Any, exchange: Any, jitter: float, h: Any) -> Any:
    """A round's expected length: ``E[max(C, E)]`` for its compute ``C`` (H steps) and its
    exchange ``E``, each normal around the model's value with the coefficient of variation
    ``jitter`` (a round's H steps vary independently: ``jitter / sqrt(H)``); Clark's formula
    (1961). One step stale, a worker waits for the exchange it started a round ago whenever
    that round's exchange outlasts this round's compute; with the two close, that is half the
    rounds, and the mean wait grows with their spread. ``jitter`` 0: ``max(C, E)``."""
    top = np.maximum(compute, exchange)
    if not jitter:
        return top
    # Clark's E[max] = max(C, E) - |C - E| erfc(a / sqrt 2) / 2 + theta phi(a), a = |C - E| / theta; erfc by
    # Abramowitz and Stegun 7.1.26 (to 1.5e-7), whose exp(-a^2 / 2) is phi's own. In place: stella plan
    # evaluates millions of configurations at once. inf: a configuration not considered
    shape = top.shape
    compute, exchange, top = (np.atleast_1d(np.asarray(x, float)) for x in (compute, exchange, top))  # no copies
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        gap = np.abs(compute - exchange)
        theta = np.sqrt(compute * compute / h + exchange * exchange)
        theta *= jitter
        a = gap / theta
        g = a * a
        g *= -0.5
        np.exp(g, out=g)
        t = a * (0.3275911 / math.sqrt(2))
        t += 1
        np.reciprocal(t, out=t)
        poly = t * 1.061405429
        for k in (-1.453152027, 1.421413741, -0.284496736, 0.254829592):
            poly += k
            poly *= t
        poly *= g
        poly *= gap
        poly *= -0.5
        g *= theta
        g *= 1 / math.sqrt(2 * math.pi)
        poly += g
        poly += top
    return np.where(np.isfinite(poly), poly, top).reshape(shape)


def _host_load(np: Any, catalog: Catalog, mix: _Mix, compute_s: float, h: Any, compress: Any, server: Any,
               host_load: float) -> tuple[Any, Any, Any]:
    """Processor sharing on the catalog's shared hosts: ``(load, stretch, server_stretch)``.

    A worker on a shared host is busy through its round's compute; the CPU work of a round that
    runs in the background (each worker's compressor, and the server's step if ``stella-ps``
    shares the host) lands in that window too, for the next round's compute overlaps it. So
    the host carries ``n = busy + (W_host x compress + server) / (H x step)`` runnable
    processes (``step``: its fastest machine's as profiled, uncalibrated; a slower machine there
    is slower by waiting, not by CPU work, so ``busy`` counts each machine by the share of the
    time it computes, ``t_fastest / t_machine``; ``compress``: one worker's, per round) on ``cores``
    cores, and every step there stretches by ``max(1, host_load x n / cores)``, the
    calibration's ``host_load`` fitted on measured runs. The exchange's CPU work (compressor,
    server) takes the share ``exchange_stretch`` of that stretch: it runs partly beside the
    compute and partly while the host waits on the link. ``load`` is ``n / cores`` per group (0
    off the shared hosts), of shape (mixes, groups, settings), ``stretch`` each group's factor,
    ``server_stretch`` (mixes, settings) the server's (1 off the shared hosts)."""
    m, g = mix.count.shape
    ones = np.ones((m, g, h.shape[1]))
    load, stretch, server_stretch = 0 * ones, ones, ones[:, 0, :]
    for i, (name, cores) in enumerate(catalog.hosts):
        on = (mix.host == i) & (mix.count > 0)
        if not on.any():
            continue
        w_h = (mix.count * on).sum(axis=1)[:, None]
        t_min = np.where(on, mix.t_rel, np.inf).min(axis=1)[:, None]  # inf: none on it
        step = compute_s * t_min
        # a machine slower than the host's fastest is slower by waiting: it is runnable t_min / t_rel of the time
        busy = (mix.count * on * np.where(on, t_min / mix.t_rel, 0.0)).sum(axis=1)[:, None]
        bg = w_h * compress + (server if catalog.server.host == name else 0.0)
        n_h = np.where(w_h > 0, busy + bg / (h * step), 0.0) / cores
        s_h = np.maximum(1.0, host_load * n_h)
        load = np.where(on[:, :, None], n_h[:, None, :], load)
        stretch = np.where(on[:, :, None], s_h[:, None, :], stretch)
        if catalog.server.host == name:
            server_stretch = s_h
    return load, stretch, server_stretch


BOUNDS = ("compute", "push", "pull", "server", "compress")


def predict(profile: Profile, catalog: Catalog, config: Config, checkpoint_every: int = 100) -> Prediction:
    """The model's prediction for one configuration (module doc)."""
    setting = (config.density, config.coding, config.sync_every, config.shards)
    r = _evaluate(profile, catalog, _mix_arrays([config.groups], catalog.hosts), [setting], checkpoint_every)
    return _prediction(profile, config, r, 0)


def _prediction(profile: Profile, config: Config, r: Mapping[str, Any], i: int) -> Prediction:
    v = {k: a[i, 0] for k, a in r.items()}
    source = profile.factor(config.density, config.coding, max(config.sync_every, int(v["h_eff"])))[1]
    return Prediction(config=config, s_per_it=float(v["s_per_it"]), round_s=float(v["round_s"]),
                      compute_s=float(v["compute_s"]), exchange_s=float(v["exchange_s"]),
                      link_s=float(v["link_s"]), server_s=float(v["server_s"]), bound=BOUNDS[int(v["bound"])],
                      max_sync_every=int(v["max_sync_every"]), samples_per_s=float(v["samples_per_s"]),
                      iterations=float(v["iterations"]), factor=float(v["factor"]), factor_source=source,
                      time_s=float(v["time_s"]), revocations=float(v["revocations"]), cost=float(v["cost"]),
                      revocation_cost=float(v["revocation_cost"]))


# ============================================================ calibration


@dataclass(frozen=True)
class Observation:
    """One measured run, for :func:`fit`: the configuration and what it measured (per
    iteration: compute; per round: the exchange, in the background)."""

    config: Config
    compute_s: float  # measured compute per local step (slowest machine)
    exchange_s: float  # measured exchange per round (compress + push + step + pull)
    s_per_it: float = 0.0  # measured round / H (for reports)


def _nonneg_lstsq(np: Any, a: Any, y: Any) -> Any:
    """Least squares with every coefficient >= 0: the best over the subsets of columns left
    free (the others 0) whose solution is non-negative (a few columns: all subsets)."""
    best, best_err = np.zeros(a.shape[1]), float(np.sum(y ** 2))
    for cols in itertools.product((False, True), repeat=a.shape[1]):
        if not any(cols):
            continue
        sel = np.array(cols)
        x = np.linalg.lstsq(a[:, sel], y, rcond=None)[0]
        if (x < 0).any():
            continue
        full = np.zeros(a.shape[1])
        full[sel] = x
        err = float(np.sum((a @ full - y) ** 2))
        if err < best_err:
            best, best_err = full, err
    return best


EXCHANGE_BOUND = 1.1  # a run's exchange sets its round when it exceeds its compute by this factor


def fit(profile: Profile, catalog: Catalog, observations: Sequence[Observation], source: str = "") -> Calibration:
    """Least squares on measured runs of one model (CM-DARE's approach); :func:`fit_many`."""
    return fit_many([(profile, catalog, ob) for ob in observations], source)[profile.model]


def fit_many(runs: Sequence[tuple[Profile, Catalog, Observation]], source: str = "",
             compute: float | None = None) -> dict[str, Calibration]:
    """Fit the model's coefficients on measured runs, by least squares on relative errors:

    - per model, a compute scale, and across all runs the shared hosts' ``host_load``, on
      the measured compute per step: ``step = scale x (slowest machine's profiled step) x
      max(1, host_load x n / cores)`` (``host_load`` by a search on a fine grid, the scales
      in closed form at each point);
    - across all runs, a link scale, a fixed overhead per round, ``exchange_stretch`` (the
      share of the host's stretch the exchange's CPU work takes) and ``tail_loss`` (the wait of
      a message that loses its tail, in its queue's delays), by non-negative least squares on
      the measured exchange per round less the model's unstretched compressor and server, on
      the runs bound by their exchange only (:data:`EXCHANGE_BOUND`; all runs if
      fewer than 2 are);
    - last, across all runs that carry a measured s/it, ``jitter`` (the spread of a step's and an
      exchange's time, :func:`_expected_max`), by a search on a grid.

    Returns a :class:`Calibration` per model (``profile.model``)."""
    import numpy as np

    if len(runs) < 2:
        raise PlanError("fit: need at least 2 measured runs")
    names = sorted({prof.model for prof, _, _ in runs})
    which = np.array([names.index(prof.model) for prof, _, _ in runs])
    base, y = [], []
    mixes = [(prof, cat, ob, _mix_arrays([ob.config.groups], cat.hosts)) for prof, cat, ob in runs]
    for prof, _, ob in runs:
        base.append(prof.compute_s * max(1.0 / g.kind.speed for g in ob.config.groups))
        y.append(ob.compute_s)
    b, yc = np.array(base), np.array(y)

    def loads(fixed: float) -> Any:
        """Each run's host load, with ``fixed`` seconds of a worker's CPU per round beside its compressor."""
        cal0 = Calibration(worker_round_s=fixed)
        return np.array([float(_evaluate(dataclasses.replace(prof, calibration=cal0), cat, mix,
                                         [(ob.config.density, ob.config.coding, ob.config.sync_every,
                                           ob.config.shards)])["load"][0, 0]) for prof, cat, ob, mix in mixes])

    def scales(kappa: float, ld: Any) -> tuple[Any, float]:
        m = b * np.maximum(1.0, kappa * ld) / yc  # the model at scale 1, relative to the measurement
        k = np.array([np.sum(m[which == i]) / np.sum(m[which == i] ** 2) if compute is None else compute
                      for i in range(len(names))])
        return k, float(np.sum((k[which] * m - 1) ** 2))

    kappa, fixed, ld = 1.0, 0.0, loads(0.0)
    if (ld > 0).any():  # runs on a shared host: the grids' best (host_load 0.2 .. 3, worker_round_s 0 .. 10 ms)
        best = math.inf
        for f in np.linspace(0.0, 0.01, 21):
            ldf = loads(float(f))
            kf = min(np.linspace(0.2, 3.0, 561), key=lambda x: scales(float(x), ldf)[1])
            err = scales(float(kf), ldf)[1]
            if err < best - 1e-12:
                best, kappa, fixed, ld = err, float(kf), float(f), ldf
    k = scales(float(kappa), ld)[0]
    rows_e, ye, bound = [], [], []
    for (prof, cat, ob), ki in zip(runs, k[which]):
        cal = Calibration(compute=float(ki), host_load=float(kappa), worker_round_s=fixed)
        p = predict(dataclasses.replace(prof, calibration=cal), cat, ob.config)  # exchange unstretched
        full = predict(dataclasses.replace(prof, calibration=dataclasses.replace(cal, exchange_stretch=1.0)), cat,
                       ob.config)
        tail = predict(dataclasses.replace(prof, calibration=dataclasses.replace(cal, tail_loss=1.0)), cat, ob.config)
        # at link scale 1: push + pull at the nominal rates (+ RTTs); the CPU work's stretch; the tail losses' waits
        rows_e.append([1.0, p.link_s, full.exchange_s - p.exchange_s, tail.link_s - p.link_s])
        ye.append(ob.exchange_s - (p.exchange_s - p.link_s))  # less compress and server, unstretched
        # a worker's measured exchange ends when the step closes: in a run bound by compute, when the slowest
        # worker's push is in. It then measures the others' compute, not the link
        bound.append(ob.exchange_s > EXCHANGE_BOUND * ob.config.sync_every * ob.compute_s)
    keep = np.array(bound) if sum(bound) >= 2 else np.ones(len(bound), bool)
    ae, ve = np.array(rows_e)[keep], np.array(ye)[keep]
    we = 1 / np.maximum(np.abs(ve), 1e-3)
    ke = _nonneg_lstsq(np, ae * we[:, None], ve * we)
    cals = {n: Calibration(compute=float(max(k[i], 1e-3)), host_load=float(kappa), worker_round_s=fixed,
                           link=float(max(ke[1], 1e-3)),
                           round_s=float(ke[0]), exchange_stretch=float(min(ke[2], 1.0)), tail_loss=float(ke[3]),
                           source=source or "fitted", runs=len(runs), exchange_runs=int(keep.sum()))
            for i, n in enumerate(names)}
    # last, the round's spread, on every run's measured s/it: the model's compute and exchange at the fitted
    # coefficients, their expected max over a grid of jitter (0 .. 0.6)
    parts: list[tuple[float, float, int, float]] = []
    for prof, cat, ob in runs:
        if ob.s_per_it > 0:
            p = predict(dataclasses.replace(prof, calibration=cals[prof.model]), cat, ob.config)
            parts.append((p.compute_s, p.exchange_s, ob.config.sync_every, ob.s_per_it))
    if len(parts) >= 2:
        cs, es, hs, ys = (np.array([x[i] for x in parts], float) for i in range(4))

        def spread_err(j: float) -> float:
            return float(np.sum((_expected_max(np, cs, es, j, hs) / hs / ys - 1) ** 2))

        jitter = min(np.linspace(0.0, 0.6, 121), key=lambda j: spread_err(float(j)))
        cals = {n: dataclasses.replace(cal, jitter=float(jitter)) for n, cal in cals.items()}
    return cals


# ============================================================ enumeration and ranking


def _ladder(n: int) -> list[int]:
    out, c = [], 1
    while c < n:
        out.append(c)
        c *= 2
    return [*out, n]


def _mixes(catalog: Catalog, max_rented: int = 2) -> list[tuple[Group, ...]]:
    import itertools

    onprem = [k for k in catalog.kinds if k.onprem]
    rented = [(k, m) for k in catalog.kinds if not k.onprem
              for m in (("ondemand", "spot") if k.spot_price is not None else ("ondemand",))]
    if len(onprem) > 4:  # all of them or none
        lab_sets: list[tuple[MachineKind, ...]] = [(), tuple(onprem)]
    else:
        lab_sets = [c for r in range(len(onprem) + 1) for c in itertools.combinations(onprem, r)]
    out: list[tuple[Group, ...]] = []
    for lab in lab_sets:
        base = tuple(Group(k, "onprem", k.count) for k in lab)
        if base:
            out.append(base)
        for r in range(1, max_rented + 1):
            for combo in itertools.combinations(rented, r):
                for counts in itertools.product(*(_ladder(k.count) for k, _ in combo)):
                    if r == 2 and combo[0][0] is combo[1][0] and sum(counts) > combo[0][0].count:
                        continue  # one kind's machines on both markets: no more than there are
                    out.append(base + tuple(Group(k, m, c) for (k, m), c in zip(combo, counts)))
    return out


@dataclass
class PlanResult:
    rows: list[Prediction]  # ranked
    pareto: list[Prediction]  # time against cost, fastest first
    considered: int
    objective: str
    deadline_s: float | None
    budget: float | None
    feasible: int
    catalog: Catalog
    profile: Profile
    seconds: float = 0.0


def plan(catalog: Catalog, profile: Profile, *, deadline_s: float | None = None, budget: float | None = None,
         top: int = TOP_ROWS, densities: Sequence[float] = DENSITIES, codings: Sequence[str] = CODINGS,
         sync_every: Sequence[int] = SYNC_EVERY, shards: Sequence[int] = SHARDS, max_rented: int = 2,
         checkpoint_every: int = 100) -> PlanResult:
    """Every configuration (module doc), ranked: with a deadline, the cheapest that meets
    it (and the budget, if given); with only a budget, the fastest within it; with
    neither, the fastest. Also the Pareto front of time against cost."""
    import time

    import numpy as np

    t_start = time.perf_counter()
    mixes = _mixes(catalog, max_rented)
    if not mixes:
        raise PlanError(f"{catalog.path}: no machine mix to consider")
    mix = _mix_arrays(mixes, catalog.hosts)
    settings = [(d, c, h, s) for d in densities for c in codings for h in sync_every for s in shards]
    objective = "cost" if deadline_s is not None else "time"
    m = len(mixes)
    best_key = np.full((m, 2), np.inf)  # per mix: (objective, the other), its best setting
    best_set = np.zeros(m, int)
    cand_t, cand_c, cand_m, cand_s = [], [], [], []  # points that may be on the Pareto front
    bins = 4000  # log10(seconds) in [0, 8): the front's pre-filter
    feasible = 0
    chunk = max(1, CHUNK // max(1, m * mix.count.shape[1]))  # arrays that stay in cache
    for j0 in range(0, len(settings), chunk):
        part = settings[j0:j0 + chunk]
        r = _evaluate(profile, catalog, mix, part, checkpoint_every, detail=False)
        t, cost = r["time_s"], r["cost"]
        ok = np.isfinite(t)
        if deadline_s is not None:
            ok &= t <= deadline_s
        if budget is not None:
            ok &= cost <= budget
        feasible += int(ok.sum())
        key = np.where(ok, cost if objective == "cost" else t, np.inf)
        tie = t if objective == "cost" else cost
        j = np.lexsort((tie, key), axis=1)[:, 0] if key.shape[1] > 1 else np.zeros(m, int)
        k1, k2 = key[np.arange(m), j], tie[np.arange(m), j]
        better = (k1 < best_key[:, 0]) | ((k1 == best_key[:, 0]) & (k2 < best_key[:, 1]))
        best_key[better] = np.stack([k1, k2], axis=1)[better]
        best_set[better] = j0 + j[better]
        # the front's candidates: cheaper than everything in the faster bins of this chunk
        fin = np.isfinite(t)
        b = np.clip((np.log10(np.clip(t, 1.0, 1e8)) * bins / 8).astype(int), 0, bins - 1)
        low = np.full(bins, np.inf)
        np.minimum.at(low, b[fin], cost[fin])
        before = np.concatenate(([np.inf], np.minimum.accumulate(low)[:-1]))
        keep = fin & (cost < before[b])
        ii, jj = np.nonzero(keep)
        cand_t.append(t[ii, jj])
        cand_c.append(cost[ii, jj])
        cand_m.append(ii)
        cand_s.append(j0 + jj)
    order = [int(i) for i in np.lexsort((best_key[:, 1], best_key[:, 0]))[:top] if np.isfinite(best_key[i, 0])]
    ct, cc, cm, cs = (np.concatenate(x) for x in (cand_t, cand_c, cand_m, cand_s))
    o = np.lexsort((cc, ct))
    front_idx, lowest = [], math.inf
    for i in o:
        if cc[i] < lowest * (1 - 1e-9):
            lowest = cc[i]
            front_idx.append(i)
    if len(front_idx) > PARETO_POINTS:  # thinned evenly, the ends kept
        step = (len(front_idx) - 1) / (PARETO_POINTS - 1)
        front_idx = [front_idx[round(k * step)] for k in range(PARETO_POINTS)]
    pairs = [(i, int(best_set[i])) for i in order] + [(int(cm[i]), int(cs[i])) for i in front_idx]
    got = _predict_many(profile, catalog, mixes, mix, settings, pairs, checkpoint_every)
    rows, pareto = got[:len(order)], got[len(order):]
    return PlanResult(rows, pareto, m * len(settings), objective, deadline_s, budget, feasible, catalog,
                      profile, time.perf_counter() - t_start)


def _predict_many(profile: Profile, catalog: Catalog, mixes: Sequence[Sequence[Group]], mix: _Mix,
                  settings: Sequence[tuple[float, str, int, int]], pairs: Sequence[tuple[int, int]],
                  checkpoint_every: int) -> list[Prediction]:
    """Predictions for (mix, setting) pairs, one model evaluation per distinct setting."""
    import numpy as np

    out: dict[tuple[int, int], Prediction] = {}
    by_setting: dict[int, list[int]] = {}
    for i, j in pairs:
        by_setting.setdefault(j, []).append(i)
    for j, idx in by_setting.items():
        rows = np.array(sorted(set(idx)))
        sub = _Mix(**{f.name: getattr(mix, f.name)[rows] for f in dataclasses.fields(_Mix)})
        r = _evaluate(profile, catalog, sub, [settings[j]], checkpoint_every)
        for n, i in enumerate(rows):
            out[(int(i), j)] = _prediction(profile, _config(mixes[i], settings[j]), r, n)
    return [out[p] for p in pairs]


def _config(groups: Sequence[Group], setting: tuple[float, str, int, int]) -> Config:
    d, c, h, s = setting
    return Config(tuple(groups), d, c, h, s)


# ============================================================ output


def parse_duration(text: str) -> float:
    """``12h``, ``90m``, ``3600s``, ``2d``, ``1h30m``; a bare number is hours. Seconds."""
    import re

    t = text.strip().lower()
    if not t:
        raise PlanError("empty duration")
    try:
        return float(t) * 3600.0
    except ValueError:
        pass
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([smhd])", t)
    if not parts or re.sub(r"(\d+(?:\.\d+)?)\s*([smhd])", "", t).strip():
        raise PlanError(f"cannot read the duration {text!r} (e.g. 12h, 90m, 1h30m, 2d)")
    unit = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
    return sum(float(n) * unit[u] for n, u in parts)


def _dur(s: float) -> str:
    if not math.isfinite(s):
        return "never"
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def _money(x: float, cur: str) -> str:
    return f"{x:,.0f} {cur}" if x >= 100 else f"{x:,.2f} {cur}"


def table(rows: Sequence[Prediction], currency: str) -> str:
    cols = ("#", "machines", "W", "GPUs", "density/coding/H", "shards", "s/it", "bound", "iters", "time", "cost",
            "revoc.")
    lines = []
    for n, p in enumerate(rows, 1):
        c = p.config
        gpus = sum(g.count * g.kind.gpus for g in c.groups)
        lines.append((str(n), c.machines, str(c.workers), str(gpus), f"{c.density:.2%}/{c.coding}/{c.sync_every}",
                      str(c.shards), f"{p.s_per_it:.3g}", p.bound, f"{p.iterations:.0f}", _dur(p.time_s),
                      _money(p.cost, currency), f"{100 * p.revocation_cost / p.cost:.0f}%" if p.cost > 0 else "-"))
    widths = [max(len(h), *(len(r[i]) for r in lines)) if lines else len(h) for i, h in enumerate(cols)]
    out = ["  ".join(h.ljust(wd) for h, wd in zip(cols, widths))]
    out += ["  ".join(v.ljust(wd) for v, wd in zip(r, widths)).rstrip() for r in lines]
    return "\n".join(out)


def recommend(p: Prediction, checkpoint_every: int = 100) -> str:
    """The ``stella-ps`` and ``StellaOptimizer`` settings for one row."""
    c = p.config
    ck = f"--checkpoint-every-steps {checkpoint_every}"
    shard_line = (f"stella-ps --workers {c.workers} --checkpoint-dir DIR {ck}" if c.shards == 1 else
                  f"{c.shards} processes: stella-ps --shard I/{c.shards} --bind tcp://0.0.0.0:$((5555+I)) --workers "
                  f"{c.workers} --checkpoint-dir DIR/I {ck}  (I = 0..{c.shards - 1}; the workers get the "
                  "addresses comma-separated, in shard order)")
    max_h = max(c.sync_every, p.max_sync_every)
    spot = [g for g in c.groups if g.market == "spot"]
    lines = [
        f"recommended: {c.machines}  (W = {c.workers} workers, one per machine; several GPUs in a machine combine "
        "inside it through torch.distributed)",
        f"  server:  {shard_line}",
        f"  workers: stella.StellaOptimizer(model, ADDRESS, optimizer=..., sync_every={c.sync_every}, "
        f"max_sync_every={max_h},",
        f"               compression=stella.Compression(density={c.density:g}, value_dtype=\"{c.coding}\"))",
        f"  expected: {p.s_per_it:.3g} s/it ({p.bound}-bound), {p.iterations:.0f} iterations "
        f"(x{p.factor:.2f} dense: {p.factor_source}), {_dur(p.time_s)}",
    ]
    if spot:
        lines.append(f"  spot: ~{p.revocations:.1f} revocations expected; keep replacements starting "
                     "with the same command (a new worker joins any time and pulls a snapshot)")
    return "\n".join(lines)


def render(res: PlanResult) -> str:
    cur = res.catalog.currency
    cons = []
    if res.deadline_s is not None:
        cons.append(f"deadline {_dur(res.deadline_s)}")
    if res.budget is not None:
        cons.append(f"budget {_money(res.budget, cur)}")
    p = res.profile
    head = [f"stella plan: {p.model} ({p.numel / 1e6:.3g}M parameters, {p.compute_s:.3g} s/step at batch "
            f"{p.batch_size} on the profiled machine), catalog {res.catalog.path}",
            f"  {res.considered:,} configurations considered in {res.seconds:.2f} s, {res.feasible:,} within "
            f"{' and '.join(cons) if cons else 'no constraint'}; ranked by {res.objective}",
            f"  target: {p.dense_iterations:.0f} dense iterations at batch {p.target_batch} ({p.target_source}); "
            f"model calibration: {p.calibration.source}"]
    if res.catalog.prices_note:
        head.append(f"  prices: {res.catalog.prices_note}")
    if not res.rows:
        return "\n".join([*head, "", "no configuration meets the constraints; the Pareto front of time against cost:",
                          table(res.pareto[:TOP_ROWS], cur)])
    return "\n".join([*head, "", table(res.rows, cur), "", recommend(res.rows[0]), "",
                      f"Pareto front (time against cost): {len(res.pareto)} configurations"])


def to_json(res: PlanResult) -> dict[str, Any]:
    def row(p: Prediction) -> dict[str, Any]:
        d = dataclasses.asdict(p)
        d["config"] = {"machines": [{"kind": g.kind.name, "market": g.market, "count": g.count}
                                    for g in p.config.groups], "density": p.config.density,
                       "coding": p.config.coding, "sync_every": p.config.sync_every, "shards": p.config.shards}
        return d

    return {"objective": res.objective, "deadline_s": res.deadline_s, "budget": res.budget,
            "considered": res.considered, "feasible": res.feasible, "seconds": res.seconds,
            "currency": res.catalog.currency, "rows": [row(p) for p in res.rows],
            "pareto": [row(p) for p in res.pareto]}


def pareto_plot(res: PlanResult, path: str, title: str = "") -> None:
    """Time against cost of the Pareto front (and the ranked rows) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    fr = res.pareto
    ax.step([p.time_s / 3600 for p in fr], [p.cost for p in fr], where="post", color="C0", marker="o", ms=3,
            label="Pareto front")
    if res.rows:
        ax.scatter([p.time_s / 3600 for p in res.rows], [p.cost for p in res.rows], color="C1", zorder=3,
                   label="ranked rows")
        b = res.rows[0]
        ax.annotate("recommended", (b.time_s / 3600, b.cost), textcoords="offset points", xytext=(8, 8))
    if res.deadline_s is not None:
        ax.axvline(res.deadline_s / 3600, color="grey", ls="--", label="deadline")
    if res.budget is not None:
        ax.axhline(res.budget, color="grey", ls=":", label="budget")
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter

    hours = FuncFormatter(lambda v, _: f"{v:g}")
    ax.xaxis.set_major_formatter(hours)
    ax.xaxis.set_minor_formatter(hours)
    ax.set_xlabel("time to target (h)")
    ax.set_ylabel(f"cost ({res.catalog.currency})")
    ax.set_title(title or f"{res.profile.model}: time against cost")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main_plan(a: Any) -> int:
    """``stella plan`` (arguments parsed by stella.cli)."""
    try:
        catalog = load_catalog(a.catalog)
        profile = load_profile(a.profile)
        deadline = parse_duration(a.deadline) if a.deadline else None
        res = plan(catalog, profile, deadline_s=deadline, budget=a.budget, top=a.top)
    except PlanError as e:
        print(f"stella plan: {e}", file=sys.stderr)
        return 2
    print(render(res))
    if a.plot:
        pareto_plot(res, a.plot)
        print(f"wrote {a.plot}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(to_json(res), f, indent=1, default=str)
        print(f"wrote {a.json}")
    return 0 if res.rows else 1


def write_json(path: str, doc: Mapping[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
