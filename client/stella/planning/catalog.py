"""The catalog (TOML): the machine kinds a user can get, and the host that runs ``stella-ps``.

The lab's own GPUs (``onprem = true``: price 0, a fixed count), cloud kinds on demand and
on the spot market (price per machine-hour, mean time to revocation), each with its links,
and the ``[server]`` host; shared hosts (``[hosts.NAME]``) whose cores several kinds and the
server share. :func:`load_catalog` checks every field and names the file, the kind and the
field of the first problem (format: docs/plan.md section 2).

The bottom of the planner's stack (:mod:`stella.planning`): it also declares
:class:`PlanError`, the root of the planner's errors.
"""
from __future__ import annotations

import difflib
import math
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import StellaError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10: the tomli backport, if installed
    try:
        import tomli as tomllib  # type: ignore[import-not-found,no-redef,unused-ignore]
    except ImportError:
        tomllib = None  # type: ignore[assignment,unused-ignore]

__all__ = ["PlanError", "CatalogError", "MachineKind", "ServerHost", "Catalog", "load_catalog", "catalog_from_dict",
           "read_toml", "SERVER_RESTART_S"]

# bench.chaos (bench/CHAOS.json, 2026-11-23): 0.35 s from the server's kill to listening again, then the
# workers' reconnects; a [server] host's restart_s unless the catalog says
SERVER_RESTART_S = 0.5


class PlanError(StellaError, ValueError):
    """A catalog, profile or plan request that cannot be used (the message says where)."""


class CatalogError(PlanError):
    """The catalog file is not valid: the message names the file, the kind and the field."""


@dataclass(frozen=True)
class MachineKind:
    """One kind of machine (``[kinds.NAME]`` in the catalog). A machine is one site: its
    ``gpus`` combine inside it, and one Stella worker speaks for it over its links."""

    name: str
    gpu: str
    gpus: int  # per machine
    speed: float  # compute speed of one GPU relative to the profiled machine (1.0: the same)
    count: int  # machines available (on-premises: the ones the lab has); with a range, its top
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
    # the fewest machines of the kind a mix takes (0: the default: all of an on-premises kind, 1 of a rented one);
    # count = "1-3" in the catalog: 1
    min_count: int = 0

    @property
    def counts_from(self) -> int:
        return self.min_count or (self.count if self.onprem else 1)

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
    max_shards: int = 0  # the most stella-ps processes a plan may run (0: no limit said)


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
    "count": ((int, str), True, None, ""),  # an int, or a range "1-3" (checked by _count)
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
    "max_shards": (int, False, *_POS),
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


def _count(v: int | str, where: str) -> tuple[int, int]:
    """A kind's ``count``: ``(fewest, most)``; ``(0, n)`` for a plain ``n`` (the kind's default: all of an
    on-premises kind), ``(a, b)`` for a range ``"a-b"`` (or ``"up to b"``: ``(1, b)``)."""
    import re

    if isinstance(v, int):
        if v <= 0:
            raise CatalogError(f"{where}: field 'count' must be > 0, got {v!r}")
        return 0, v
    m = re.fullmatch(r"\s*(?:(\d+)\s*-\s*|up\s+to\s+)(\d+)\s*", v)
    if not m:
        raise CatalogError(f"{where}: field 'count' must be int, got {v!r} (or a range of machines: \"1-3\", "
                           "\"up to 3\")")
    lo, hi = int(m.group(1) or 1), int(m.group(2))
    if not 1 <= lo <= hi:
        raise CatalogError(f"{where}: field 'count' range {v!r} must be 1 <= fewest <= most")
    return lo, hi


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
                        restart_s=float(s.get("restart_s", SERVER_RESTART_S)), host=host_of(s, f"{path}: [server]"),
                        max_shards=s.get("max_shards", 0))
    kinds_t = doc.get("kinds")
    if not isinstance(kinds_t, dict) or not kinds_t:
        raise CatalogError(f"{path}: no machine kinds: add at least one [kinds.NAME] table")
    kinds = []
    for name, t in kinds_t.items():
        where = f"{path}: kind {name!r}"
        if not isinstance(t, dict):
            raise CatalogError(f"{where}: must be a table ([kinds.{name}])")
        v = _fields(t, KIND_FIELDS, where)
        min_count, count = _count(v["count"], where)
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
                                 count=count, min_count=min_count, up_mbps=float(v["up_mbps"]),
                                 down_mbps=float(v["down_mbps"]),
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

