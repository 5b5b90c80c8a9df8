"""The profile (JSON): what the planner knows of a model, and how it reads and writes it.

A profile (written by ``stella profile``, :mod:`stella.planning.measure`) holds: compute
seconds per step at a batch size; bytes per round at a few densities and codings, and the
compressor's seconds; the broadcast pull's bytes, with the broadcast's settings as the
server answered them; the server's time per pushed and per model coordinate; the
iterations dense training needs to reach the target and the factor each configuration
costs against them (each with its source); and the coefficients a regression on measured
runs fitted (:class:`Calibration`; ``stella calibrate`` fits them,
:mod:`stella.planning.calibrate`). :func:`load_profile` checks it and returns a
:class:`Profile`, which answers the bytes, the compressor's time and the iterations factor
of any configuration from what was measured. Format: docs/plan.md section 1.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..codec import VALUE_BITS, broadcast_bits, coordinate_bits
from ..protocol import BroadcastInfo
from .catalog import PlanError, read_toml

__all__ = ["ProfileError", "Calibration", "Profile", "profile_from_dict", "load_profile", "write_profile",
           "pull_section", "broadcast_bytes", "read_factors", "read_calibration", "attach_calibration", "STALL_S",
           "STALL_SOURCE", "TEST_BED_FIT", "NO_TABLE_ENTRY", "BARE_SOURCE"]

# bench.chaos (bench/CHAOS.json, 2026-11-23, 3 workers at 20 Mbit/s): the longest stall a killed worker caused
# the others (one step deadline); a profile's revocation.stall_s unless it says
STALL_S, STALL_SOURCE = 0.83, "bench/CHAOS.json 2026-11-23 (longest stall, 3 workers at 20 Mbit/s)"


class ProfileError(PlanError):
    """The profile file is not valid, or lacks what the model needs."""


@dataclass(frozen=True)
class Calibration:
    """The model's fitted coefficients (``stella calibrate`` fits them on measured runs);
    the defaults are the bare structure."""

    compute: float = 1.0  # measured step time / the profile's, on a host of its own
    host_load: float = 1.0  # processor sharing on a shared host: steps stretch by max(1, host_load x n / cores)
    exchange_stretch: float = 0.0  # the share of that stretch the exchange's CPU work (compressor, server) takes
    link: float = 1.0  # measured link time / bytes over the nominal rate
    round_s: float = 0.0  # fixed seconds per round (messages, scheduling)
    tail_loss: float = 0.0  # a message that loses its tail waits this many of its queue's delays (TCP's timer)
    jitter: float = 0.0  # coefficient of variation of a step's and an exchange's time (the round's expected max)
    worker_round_s: float = 0.0  # a worker's CPU per round beside its compressor (decoding, applying, messages)
    # the share of the background CPU work (the workers' compressors and fixed round, the server's step) that
    # lands inside the steps on a shared host, and so counts in its load (the rest runs while it waits on links)
    background: float = 1.0
    source: str = "not fitted (the bare structure)"
    runs: int = 0
    exchange_runs: int = 0  # of those, the runs bound by their exchange (the link terms' fit)
    fitted_terms: str = ""  # the coefficients fitted on those runs, comma-separated (the rest: a base fit's)

    @property
    def fitted(self) -> bool:
        return self.runs > 0 or not self.source.startswith(BARE_SOURCE)


BARE_SOURCE = Calibration.source
# The fit that ships: bench.plan's last rounds (bench/PLAN14.json, docs/plan.md section 5, rounds 13-14), on the
# slow-link test bed (2 logical CPUs shared by every worker and stella-ps; 6 of its 26 runs shape the server's site
# like the workers'). `stella plan` attaches it to a profile that has none, and says so; --calibration none runs the
# bare structure. It was fitted on digits and widemlp, and judged on a model outside the fit (the byte LM).
TEST_BED_FIT = Calibration(
    compute=1.0, host_load=1.055, exchange_stretch=0, link=1.0259, round_s=0, tail_loss=0.2478,
    jitter=0.575, worker_round_s=0.01, background=0.35,
    source="the test bed's fit from bench/RESULTS.md (bench.plan rounds 13-14, 2026-12-02: 26 runs of digits and "
           "widemlp on a 2-core host, 6 with the server's site shaped; held out, the byte LM: 8.3% MAPE), not fitted "
           "on this model's runs",
    runs=26, exchange_runs=11)
# With no factors table, one assumed entry: Stella's reference setting (1% f16, H = 1) costs dense training's
# iterations. Unverified, and the conservative rule (Profile.factor) then considers nothing harsher than it
NO_TABLE_ENTRY = (0.01, "f16", 1, 1.0, "no factors table: assumed equal to dense training at 1% f16 H = 1 "
                                       "(unverified; give stella profile --factors)", None)
# a factors entry: (density, coding, H, factor, source, workers: the Stella workers it was measured with, None: not
# said, and then it stands for any number)
FactorEntry = tuple[float, str, int, float, str, "int | None"]


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
    pull_factor: float  # the broadcast's, as the server answered (exact pulls: 1, f32)
    pull_values: str
    server_per_update_s: float  # server CPU per pushed coordinate
    server_per_numel_s: float  # ... and per model coordinate, per step (the broadcast's pass)
    dense_iterations: float  # dense training's iterations to the target at target_batch
    target_batch: int  # the global batch those iterations were measured at
    critical_batch: float  # iterations scale as (1 + critical_batch / B)
    target_source: str
    factors: tuple[FactorEntry, ...]  # (density, coding, H, factor, source, workers)
    calibration: Calibration = field(default_factory=Calibration)
    stall_s: float = STALL_S
    device: str = ""
    path: str = ""
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    compress: tuple[tuple[float, str, float], ...] = ()  # (density, coding, seconds per round) measured
    # the step's spread over the timed steps: their quartiles (0: not measured) and count, and the torch thread
    # count it was measured with (0: not recorded)
    compute_q1_s: float = 0.0
    compute_q3_s: float = 0.0
    compute_steps: int = 0
    threads: int = 0
    measured_at: str = ""

    @property
    def compute_spread(self) -> tuple[float, float] | None:
        """The quartiles of the step time, where measured."""
        if self.compute_steps > 1 and 0 < self.compute_q1_s <= self.compute_q3_s:
            return self.compute_q1_s, self.compute_q3_s
        return None

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

    def pull_bytes(self, density: float, coding: str = "f16") -> float:
        """A round's pull answering pushes of ``density`` in ``coding`` (the measured rows:
        f16 pushes); exact pulls carry the pushed coordinates in f32 whatever their coding."""
        def coded(d: float, c: str) -> float:
            return broadcast_bytes(self.sparse_numel, d, self.pull_factor, self.pull_values, c)

        a, b = _line([(coded(d, "f16"), y) for d, y in self.pull])
        exact = self.pull_factor == 1.0 and self.pull_values == "f32"
        return a + b * coded(density, "f16" if exact else coding)

    def factor(self, density: float, coding: str, h: int, workers: int | None = None) -> tuple[float, str]:
        """Iterations to target against dense training for a configuration of ``workers``
        Stella workers (None: any), with its source.

        The table's entry when there is one. Otherwise the bound monotonicity gives, and
        never less: a configuration *harsher* on every axis (lower density, a coarser
        coding, more local steps, more workers) needs at least as many iterations, so the
        smallest factor of the entries at least as harsh as this one bounds it from above,
        and that bound is the estimate (or the largest factor of the milder entries, if the
        measurements disagree with monotonicity and it is larger). A configuration that no
        entry is at least as harsh as (it has a larger H, a lower density, a coarser coding
        or more workers than everything measured that bounds it) is beyond the table:
        infinite (not considered). An entry that does not say its workers stands for any
        number of them. With no table, :data:`NO_TABLE_ENTRY` is the table."""
        table = self.factors or (NO_TABLE_ENTRY,)
        q = (density, _CODING_RANK.get(coding, 2), h, workers)
        for e in sorted(table, key=lambda e: e[5] is None):  # an entry at these very workers before one for any
            if _same(e, density, coding, h, workers):
                return e[3], e[4]
        milder = [e for e in table if _harsher(q, _axes(e))]
        harsher = [e for e in table if _harsher(_axes(e), q)]
        lo = max(milder, key=lambda e: e[3]) if milder else None
        hi = min(harsher, key=lambda e: e[3]) if harsher else None
        if hi is None:  # nothing measured bounds it: no estimate; such configurations are not considered
            return math.inf, ("beyond the factors table (no entry is at least as harsh: lower density, coarser "
                              "coding, more local steps, more workers): not considered; add an entry measured there")
        if lo is not None and lo[3] > hi[3]:  # the table is not monotone here: the larger of the two
            return lo[3], f"at least {_entry(lo)} (the table is not monotone: at most {_entry(hi)})"
        return hi[3], f"at most {_entry(hi)} (the bound; not measured here)"

    def factor_measured(self, density: float, coding: str, h: int, workers: int | None = None) -> bool:
        """Whether the table has this very configuration (not a bound, not assumed)."""
        return any(_same(e, density, coding, h, workers) for e in self.factors)


# a coding's harshness: its place among the codings by bits a value, the coarsest last (equal bits: one rank)
_BY_BITS = sorted(VALUE_BITS, key=lambda c: -VALUE_BITS[c])
_CODING_RANK = {c: min(i for i, d in enumerate(_BY_BITS) if VALUE_BITS[d] == VALUE_BITS[c]) for c in _BY_BITS}


def _same(e: FactorEntry, density: float, coding: str, h: int, workers: int | None) -> bool:
    """Entry ``e`` was measured at this configuration (an entry or a query without workers: any)."""
    return (abs(e[0] - density) <= 1e-9 * density and e[1] == coding and e[2] == h
            and (e[5] is None or workers is None or e[5] == workers))


def _axes(e: FactorEntry) -> tuple[float, int, int, int | None]:
    return e[0], _CODING_RANK.get(e[1], 2), e[2], e[5]


def _harsher(a: tuple[float, int, int, int | None], b: tuple[float, int, int, int | None]) -> bool:
    """Configuration ``a`` (density, coding rank, H, workers) is at least as harsh as ``b`` on
    every axis (workers not said on either side: that axis left out)."""
    return (a[0] <= b[0] * (1 + 1e-9) and a[1] >= b[1] and a[2] >= b[2]
            and (a[3] is None or b[3] is None or a[3] >= b[3]))


def _entry(e: FactorEntry) -> str:
    at = "" if e[5] is None else f"/W={e[5]}"
    return f"{e[0]:.2%}/{e[1]}/H={e[2]}{at} x{e[3]:.2f} ({e[4]})"


def _workers(e: Mapping[str, Any], where: str) -> int | None:
    """A factors entry's optional ``workers`` (a count >= 1)."""
    w = e.get("workers")
    if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
        raise ProfileError(f"{where}: field 'workers' must be a count >= 1, got {w!r}")
    return w


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


def broadcast_bytes(sparse_numel: int, density: float, factor: float, values: str, coding: str = "f16") -> float:
    """The coded bytes of a broadcast answering pushes of ``density`` in ``coding``
    (:func:`stella.codec.broadcast_bits`). Exact pulls are factor 1 in f32 (the pushed
    coordinates with their float32 values: pass f16, whatever the pushes' coding)."""
    return sparse_numel * broadcast_bits(density, factor, values, coding) / 8


def pull_section(broadcast: BroadcastInfo | None, rows: Sequence[Mapping[str, Any]],
                 **extra: Any) -> dict[str, Any]:
    """A profile's ``pull``: the bytes per round measured (``rows``: ``density``, ``bytes``)
    and the broadcast they were measured under, as the server said it (``Registered`` or
    ``StatusReply``: None for exact pulls)."""
    head: dict[str, Any] = ({"mode": "exact"} if broadcast is None else
                            {"factor": broadcast.factor, "values": broadcast.values})
    return {**head, "bytes": [dict(r) for r in rows], **extra}


def _broadcast(pull: Mapping[str, Any], where: str) -> tuple[float, str]:
    """``(factor, values)`` of the pull's broadcast. The server's settings are facts of the
    job, not the planner's to assume: a profile that does not say them is refused."""
    mode = pull.get("mode", "broadcast")
    if mode == "exact":  # the pushed coordinates with their float32 values (stella-ps --pull exact)
        return 1.0, "f32"
    if mode != "broadcast":
        raise ProfileError(f"{where}: field 'mode' must be 'broadcast' or 'exact', got {mode!r}")
    missing = [k for k in ("factor", "values") if k not in pull]
    if missing:
        raise ProfileError(f"{where}: missing field {missing[0]!r}: the broadcast's settings are the server's "
                           "(stella-ps --broadcast-factor, --broadcast-values); write the profile again with "
                           "stella profile, which records what the server answers, or add \"factor\" and "
                           "\"values\" as the job's stella-ps runs them")
    factor, values = _req(pull, "factor", where), _req(pull, "values", where, str)
    if values not in VALUE_BITS or not (math.isfinite(factor) and factor > 0):
        raise ProfileError(f"{where}: broadcast factor {factor!r} and coding {values!r} are not valid")
    return float(factor), values


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
    pull_factor, pull_values = _broadcast(pull_t, f"{where}: pull")
    pull = tuple((float(_req(e, "density", f"{where}: pull")), float(_req(e, "bytes", f"{where}: pull")))
                 for e in _req(pull_t, "bytes", f"{where}: pull", list))
    server = _req(doc, "server", where, dict)
    target = _req(doc, "target", where, dict)
    factors = tuple((float(_req(e, "density", f"{where}: factors")), str(_req(e, "coding", f"{where}: factors", str)),
                     int(_req(e, "H", f"{where}: factors", int)), float(_req(e, "factor", f"{where}: factors")),
                     str(e.get("source", target.get("source", ""))), _workers(e, f"{where}: factors"))
                    for e in doc.get("factors", []))
    cal_t = doc.get("calibration") or {}
    cal = Calibration(**{k: cal_t[k] for k in (f.name for f in dataclasses.fields(Calibration)) if k in cal_t})
    rev = doc.get("revocation") or {}
    numel = int(_req(doc, "numel", where))
    spread = doc.get("compute_spread") or {}
    if not isinstance(spread, dict):
        raise ProfileError(f"{where}: field 'compute_spread' must be an object (steps, q1_s, q3_s)")
    threads = doc.get("torch_threads", 0)
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 0:
        raise ProfileError(f"{where}: field 'torch_threads' must be a count, got {threads!r}")
    return Profile(
        model=str(doc.get("model", "?")), numel=numel, sparse_numel=int(doc.get("sparse_numel", numel)),
        batch_size=int(_req(doc, "batch_size", where)), compute_s=float(_req(doc, "compute_s", where)),
        compress_s_per_numel=float(doc.get("compress_s_per_numel", 0.0)), push=push, pull=pull,
        compress=tuple((d, c, float(e["compress_s"])) for (d, c, _), e in zip(push, doc["push"]) if "compress_s" in e),
        pull_factor=pull_factor, pull_values=pull_values,
        server_per_update_s=float(_req(server, "per_update_s", f"{where}: server")),
        server_per_numel_s=float(_req(server, "per_numel_s", f"{where}: server")),
        dense_iterations=float(_req(target, "dense_iterations", f"{where}: target")),
        target_batch=int(_req(target, "global_batch", f"{where}: target")),
        critical_batch=float(target.get("critical_batch", 0.0)), target_source=str(target.get("source", "")),
        factors=factors, calibration=cal, stall_s=float(rev.get("stall_s", STALL_S)),
        device=str(doc.get("device", "")), path=path, raw=doc,
        compute_q1_s=float(spread.get("q1_s", 0.0)), compute_q3_s=float(spread.get("q3_s", 0.0)),
        compute_steps=int(spread.get("steps", 0)), threads=int(doc.get("torch_threads", 0)),
        measured_at=str(doc.get("measured_at", "")))


def _read_json(path: str, what: str) -> Any:
    """The JSON document in ``path``; a :class:`ProfileError` naming ``what`` it should hold."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise ProfileError(f"{path}: cannot read the {what}: {e.strerror or e}") from None
    except ValueError as e:
        raise ProfileError(f"{path}: not valid JSON: {e}") from None


def load_profile(path: str) -> Profile:
    doc = _read_json(path, "profile")
    if not isinstance(doc, dict):
        raise ProfileError(f"{path}: a profile is a JSON object")
    return profile_from_dict(doc, path)


def write_profile(path: str, doc: Mapping[str, Any]) -> None:
    """Write a profile, atomically, once it reads back (:func:`profile_from_dict`)."""
    profile_from_dict(doc, path)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def read_factors(path: str) -> list[dict[str, Any]]:
    """A user's table of iterations factors (TOML ``[[factors]]`` or a JSON list), labelled
    with its file as the source."""
    try:
        if path.endswith(".toml"):
            rows = read_toml(path).get("factors", [])
        else:
            with open(path) as f:
                rows = json.load(f)
    except (OSError, ValueError) as e:
        if isinstance(e, PlanError):
            raise
        raise ProfileError(f"{path}: cannot read the factors table: {e}") from None
    out = []
    for i, r in enumerate(rows):
        missing = [k for k in ("density", "coding", "H", "factor") if k not in r]
        if missing:
            raise ProfileError(f"{path}: factors entry {i}: missing {', '.join(missing)}")
        _workers(r, f"{path}: factors entry {i}")
        out.append({**r, "source": r.get("source", f"user table {path}")})
    return out


def read_calibration(path: str) -> Calibration:
    """A fit from a JSON file: a profile's ``calibration``, bench.plan's output
    (``bench/PLAN.json``: its ``calibration``), or the coefficients themselves."""
    doc = _read_json(path, "calibration")
    cal_t = doc.get("calibration", doc) if isinstance(doc, dict) else None
    names = {f.name for f in dataclasses.fields(Calibration)}
    if not isinstance(cal_t, dict) or not (set(cal_t) & names):
        raise ProfileError(f"{path}: no calibration in it (a JSON object with \"calibration\": {{...}} or the "
                           f"coefficients: {', '.join(sorted(names))})")
    cal = Calibration(**{k: cal_t[k] for k in names if k in cal_t})
    if cal.source == BARE_SOURCE:
        cal = dataclasses.replace(cal, source=f"{path}")
    return cal


def attach_calibration(profile: Profile, which: str = "") -> Profile:
    """The profile with the fit ``stella plan`` uses: ``which`` is ``""`` (the profile's own
    if it has one, else :data:`TEST_BED_FIT`), ``"test-bed"``, ``"none"`` (the bare
    structure) or a JSON file (:func:`read_calibration`)."""
    if which == "" and profile.calibration.fitted:
        return profile
    if which in ("", "test-bed"):
        cal = TEST_BED_FIT
    elif which == "none":
        cal = Calibration(source=f"{BARE_SOURCE}: --calibration none")
    else:
        cal = read_calibration(which)
    return dataclasses.replace(profile, calibration=cal)
