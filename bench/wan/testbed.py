"""Slow-link test bed: emulated sites as Linux network namespaces.

Topology (everything lives in namespaces this module creates; the root
namespace gets no interface, route or address)::

        site "a" ns             hub ns                site "b" ns
      +------------+      +----------------+      +------------+
      | wan0 (tbf  |======| h0 (tbf down)  |      |            |
      |  = uplink) | veth |      br0       | veth |   wan0     |
      +------------+      |  (10.R.S.254)  |======|            |
                          | h1 (tbf down)  |      +------------+
                          +----------------+

* every site (the parameter server is just one more site, conventionally
  named ``"ps"``) has one veth pair: ``wan0`` inside the site namespace and
  ``hN`` inside the hub namespace, enslaved to the hub's bridge ``br0``;
* ``tbf`` on the site end (egress = traffic leaving the site) shapes the
  *uplink*, ``tbf`` on the hub end (egress towards the site) shapes the
  *downlink*.  A site-to-site packet therefore crosses the sender's uplink
  and the receiver's downlink, like a real WAN with access links;
* the bridge itself has an address (``.254``) so the hub can act as an
  unshaped measurement end point for one link at a time (``check``);
* one private /24 per test bed (random ``10.x.y.0/24``); test beds are
  separate L2 domains, so parallel test beds never see each other.

Needs root (``CAP_NET_ADMIN``).  Everything is torn down by ``close()`` /
``__exit__``, at interpreter exit (``atexit``) and on SIGINT/SIGTERM.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "Link",
    "WanTestbed",
    "TestbedError",
    "NotRootError",
    "NetnsUnavailableError",
    "STATE_DIR",
    "PREFIX_ROOT",
    "cleanup_stale",
    "netns_available",
    "tbf_burst_bytes",
    "TBF_QUEUE_MS",
]

#: every namespace a test bed creates is named ``f"{PREFIX_ROOT}{8 hex}-{site}"``
PREFIX_ROOT = "stw"
#: one small JSON file per live test bed (owner pid, namespaces) for ``down``
STATE_DIR = os.environ.get("STELLA_WAN_STATE_DIR", "/run/stella-wan")
#: hard upper bound on the lifetime of any test bed (seconds)
MAX_LIFETIME_S = 6 * 3600.0
SITE_IF = "wan0"
BRIDGE = "br0"
_CMD_TIMEOUT = 20.0


class TestbedError(RuntimeError):
    """A test bed could not be created, changed or torn down."""


class NotRootError(TestbedError):
    """Raised when the test bed is used without root / CAP_NET_ADMIN."""

    def __init__(self, msg: str | None = None):
        super().__init__(
            msg
            or "bench.wan needs root (CAP_NET_ADMIN) to create network namespaces, "
            "veth pairs and tbf qdiscs; run it as root (e.g. `sudo .venv/bin/python -m bench.wan ...`)"
        )


class NetnsUnavailableError(TestbedError):
    """`ip netns` / `tc` is missing or the kernel refuses namespaces."""


@dataclass(frozen=True)
class Link:
    """Access link of one site, in Mbit/s.  ``None`` (or 0) means unshaped.

    ``schedule`` is an optional list of ``(t_seconds, up, down)``: at ``t``
    seconds after the test bed came up the rates change to ``up``/``down``
    (``None`` keeps that direction's current rate).  Applied by a background
    thread with ``tc qdisc change``.
    """

    up: float | None = 100.0
    down: float | None = 100.0
    schedule: tuple[tuple[float, float | None, float | None], ...] = ()

    def __post_init__(self):
        for v in (self.up, self.down):
            if v is not None and v < 0:
                raise ValueError(f"link rate must be >= 0 Mbit/s, got {v}")
        sched = tuple(sorted((float(t), u, d) for t, u, d in self.schedule))
        object.__setattr__(self, "schedule", sched)

    @classmethod
    def parse(cls, text: str) -> Link:
        """``"100"`` (symmetric), ``"100/20"`` (up/down), ``"-"`` (unshaped),
        optionally followed by ``@t:up/down`` schedule points, e.g.
        ``"100/100@5:20/20@10:100/100"``."""
        parts = text.split("@")
        up, down = _parse_pair(parts[0])
        sched = []
        for p in parts[1:]:
            t, _, rate = p.partition(":")
            u, d = _parse_pair(rate)
            sched.append((float(t), u, d))
        return cls(up, down, tuple(sched))

    def describe(self) -> str:
        f = lambda v: "unshaped" if not v else f"{v:g}"
        s = f"{f(self.up)}/{f(self.down)} Mbit/s"
        for t, u, d in self.schedule:
            s += f" @{t:g}s->{f(u)}/{f(d)}"
        return s


def _parse_pair(text: str) -> tuple[float | None, float | None]:
    text = text.strip()
    conv = lambda s: None if s in ("-", "", "inf", "none") else float(s)
    if "/" in text:
        a, b = text.split("/", 1)
        return conv(a), conv(b)
    v = conv(text)
    return v, v


def is_root() -> bool:
    return os.geteuid() == 0


def netns_available() -> tuple[bool, str]:
    """(ok, reason): can this process build a test bed here?"""
    if not is_root():
        return False, str(NotRootError())
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) not found on PATH"
    try:
        r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    except Exception as e:  # pragma: no cover - depends on host
        return False, f"`ip netns list` failed: {e}"
    if r.returncode != 0:
        return False, f"`ip netns list` failed: {r.stderr.strip()}"
    return True, ""


def _run(args: Sequence[str], check: bool = True, timeout: float = _CMD_TIMEOUT) -> subprocess.CompletedProcess:
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise TestbedError(f"`{' '.join(args)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r


#: the burst's floor: more than one TSO/GSO super-packet, which is up to 65,535 bytes of IP packet plus its
#: 14-byte Ethernet header (what tbf counts). A burst of exactly 64 KiB was 13 bytes short: a super-packet queued
#: while the rate was high (its burst larger) could never gather the tokens to leave once the rate dropped below
#: 131 Mbit/s, and the link stalled until a rate change raised the burst again (bench.adaptive's fluctuating
#: links, seed 4: 11.6 s and 14.1 s stalls after drops from 300 to 35 and 30 Mbit/s; issue 45 saw 15.3 s)
TBF_MIN_BURST = 80 * 1024


def tbf_burst_bytes(rate_mbit: float) -> int:
    """The token bucket's burst at ``rate_mbit``: at least :data:`TBF_MIN_BURST` (more
    than one TSO/GSO super-packet with its link-layer header), and >= 4 ms worth at high
    rates so that the bucket is not starved by timer granularity. That much of a message
    passes at line rate once the bucket refilled."""
    return max(TBF_MIN_BURST, int(rate_mbit * 1e6 / 8 * 0.004))


#: the tbf queue: this many ms at the rate, beside the burst; a packet that finds it full is dropped
TBF_QUEUE_MS = 50


def _tbf_args(rate_mbit: float) -> list[str]:
    return ["tbf", "rate", f"{int(rate_mbit * 1e6)}bit", "burst", str(tbf_burst_bytes(rate_mbit)),
            "latency", f"{TBF_QUEUE_MS}ms"]


# --------------------------------------------------------------------------- #
# global registry so atexit / signal handlers can tear everything down

_LIVE: weakref.WeakSet[WanTestbed] = weakref.WeakSet()
_HANDLERS_INSTALLED = False
_PREV_HANDLERS: dict[int, object] = {}
_SIGNAL_TEARDOWN = threading.Event()  # set once a signal started the teardown


def _teardown_all():
    for bed in list(_LIVE):
        try:
            bed.close()
        except Exception as e:  # pragma: no cover
            print(f"bench.wan: teardown of {bed.prefix} failed: {e}", file=sys.stderr)


def _signal_handler(signum, frame):
    # A second signal during the teardown (``timeout`` forwarding a TERM, an impatient
    # Ctrl-C) must not abort it half-way: close() marks a bed closed before deleting its
    # namespaces, so an interrupted teardown would leave them behind for good.
    if _SIGNAL_TEARDOWN.is_set():
        return
    _SIGNAL_TEARDOWN.set()
    _teardown_all()
    prev = _PREV_HANDLERS.get(signum)
    if callable(prev):
        prev(signum, frame)
        return
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def _install_handlers():
    global _HANDLERS_INSTALLED
    if _HANDLERS_INSTALLED:
        return
    atexit.register(_teardown_all)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                prev = signal.getsignal(sig)
                plain = (signal.SIG_DFL, signal.SIG_IGN, None, signal.default_int_handler)
                _PREV_HANDLERS[sig] = prev if prev not in plain else None
                signal.signal(sig, _signal_handler)
            except (ValueError, OSError):  # pragma: no cover
                pass
    _HANDLERS_INSTALLED = True


# --------------------------------------------------------------------------- #


@dataclass
class _Site:
    name: str
    index: int
    ns: str
    hub_if: str
    address: str
    up: float | None
    down: float | None
    schedule: tuple = ()


class WanTestbed:
    """A set of emulated sites joined through a hub with shaped access links.

    >>> with WanTestbed({"ps": Link(1000, 1000), "a": Link(100, 100), "b": Link(100, 20)}) as bed:
    ...     srv = bed.popen("ps", ["stella-ps", "--bind", f"tcp://{bed.address('ps')}:5555"])
    ...     bed.run("a", [sys.executable, "train.py"], timeout=60)
    ...     bed.set_rate("b", up=50)

    Parameters
    ----------
    sites: mapping of site name -> :class:`Link` (or an ``"up/down"`` string).
    max_lifetime: seconds; the test bed tears itself down after this long
        (a watchdog thread), so nothing outlives a run by accident.
    prefix: namespace name prefix (default: random ``stwXXXXXXXX``).
    """

    def __init__(
        self,
        sites: Mapping[str, Link | str],
        *,
        max_lifetime: float = 3600.0,
        prefix: str | None = None,
        subnet: tuple[int, int] | None = None,
        state_dir: str | None = STATE_DIR,
    ):
        if not sites:
            raise ValueError("a test bed needs at least one site")
        if not is_root():
            raise NotRootError()
        ok, why = netns_available()
        if not ok:
            raise NetnsUnavailableError(why)
        if len(sites) > 250:
            raise ValueError("at most 250 sites")
        self.prefix = prefix or f"{PREFIX_ROOT}{secrets.token_hex(4)}"
        self.max_lifetime = min(float(max_lifetime), MAX_LIFETIME_S)
        self._state_dir = state_dir
        rnd = random.Random(self.prefix)
        sx, sy = subnet or (rnd.randrange(64, 250), rnd.randrange(1, 250))
        self.subnet = f"10.{sx}.{sy}.0/24"
        self.hub_ns = f"{self.prefix}-hub"
        self.hub_address = f"10.{sx}.{sy}.254"
        self.sites: dict[str, _Site] = {}
        for i, (name, link) in enumerate(sites.items()):
            if not name or not all(c.isalnum() or c in "_" for c in name) or len(name) > 30:
                raise ValueError(f"bad site name {name!r} (alphanumeric/underscore, <= 30 chars)")
            if isinstance(link, str):
                link = Link.parse(link)
            self.sites[name] = _Site(
                name=name, index=i, ns=f"{self.prefix}-{name}", hub_if=f"h{i}",
                address=f"10.{sx}.{sy}.{i + 1}", up=link.up or None, down=link.down or None,
                schedule=link.schedule,
            )
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.RLock()
        self._closed = False
        self._up = False
        self._stop = threading.Event()
        self._done = threading.Event()
        self._threads: list[threading.Thread] = []
        self.t0: float | None = None
        self.rate_log: list[tuple[float, str, float | None, float | None]] = []

    # ------------------------------------------------------------------ life
    def __enter__(self) -> WanTestbed:
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def start(self) -> WanTestbed:
        if self._up:
            return self
        _install_handlers()
        _LIVE.add(self)
        self._up = True  # from here on close() must clean up
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        self.t0 = time.monotonic()
        self._write_state()
        self._spawn(self._watchdog, "wan-watchdog")
        if any(s.schedule for s in self.sites.values()):
            self._spawn(self._scheduler, "wan-schedule")
        return self

    def _spawn(self, fn, name):
        t = threading.Thread(target=fn, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _build(self):
        hub = self.hub_ns
        _run(["ip", "netns", "add", hub])
        _run(["ip", "-n", hub, "link", "set", "lo", "up"])
        _run(["ip", "-n", hub, "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "-n", hub, "addr", "add", f"{self.hub_address}/24", "dev", BRIDGE])
        _run(["ip", "-n", hub, "link", "set", BRIDGE, "up"])
        for s in self.sites.values():
            _run(["ip", "netns", "add", s.ns])
            _run(["ip", "-n", s.ns, "link", "set", "lo", "up"])
            # veth created inside the hub namespace with its peer moved straight
            # into the site namespace: the root namespace never sees it.
            _run(["ip", "-n", hub, "link", "add", s.hub_if, "type", "veth", "peer", "name", SITE_IF, "netns", s.ns])
            _run(["ip", "-n", hub, "link", "set", s.hub_if, "master", BRIDGE])
            _run(["ip", "-n", hub, "link", "set", s.hub_if, "up"])
            _run(["ip", "-n", s.ns, "addr", "add", f"{s.address}/24", "dev", SITE_IF])
            _run(["ip", "-n", s.ns, "link", "set", SITE_IF, "up"])
            self._apply(s, s.up, s.down, add=True)

    def _apply(self, s: _Site, up: float | None, down: float | None, add: bool = False):
        for ns, dev, rate, old in ((s.ns, SITE_IF, up, None if add else s.up),
                                   (self.hub_ns, s.hub_if, down, None if add else s.down)):
            if rate:
                verb = "change" if old else "add"
                _run(["tc", "-n", ns, "qdisc", verb, "dev", dev, "root", *_tbf_args(rate)])
            elif old:
                _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"])
        s.up, s.down = up, down
        self.rate_log.append((self.elapsed(), s.name, up, down))

    def close(self):
        """Kill every process started in the test bed and delete its namespaces
        (which removes the veths, bridge and qdiscs with them).  Idempotent."""
        with self._lock:
            if self._closed or not self._up:
                self._closed = True
                self._done.set()
                return
            self._closed = True
        self._stop.set()
        for p in self._procs:
            _kill(p)
        errors = []
        for ns in [s.ns for s in self.sites.values()] + [self.hub_ns]:
            r = _run(["ip", "netns", "del", ns], check=False)
            if r.returncode != 0 and "No such file" not in r.stderr:
                errors.append(f"{ns}: {r.stderr.strip()}")
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=2)
        self._remove_state()
        _LIVE.discard(self)
        self._done.set()
        if errors:
            raise TestbedError("teardown incomplete: " + "; ".join(errors))

    @property
    def closed(self) -> bool:
        """True once teardown has completed."""
        return self._done.is_set()

    def elapsed(self) -> float:
        return 0.0 if self.t0 is None else time.monotonic() - self.t0

    def _watchdog(self):
        if not self._stop.wait(self.max_lifetime):
            print(f"bench.wan: test bed {self.prefix} reached max_lifetime={self.max_lifetime:g}s, tearing down",
                  file=sys.stderr)
            self.close()

    def _scheduler(self):
        events = sorted((t, s.name, u, d) for s in self.sites.values() for (t, u, d) in s.schedule)
        for t, name, u, d in events:
            if self._stop.wait(max(0.0, t - self.elapsed())):
                return
            with self._lock:
                if self._closed:
                    return
                s = self.sites[name]
                try:
                    self._apply(s, u if u is not None else s.up, d if d is not None else s.down)
                except TestbedError as e:  # pragma: no cover
                    print(f"bench.wan: schedule step failed: {e}", file=sys.stderr)

    # ---------------------------------------------------------------- state
    def _write_state(self):
        if not self._state_dir:
            return
        try:
            os.makedirs(self._state_dir, exist_ok=True)
            with open(os.path.join(self._state_dir, f"{self.prefix}.json"), "w") as f:
                json.dump(self.describe(), f, indent=1)
        except OSError:
            pass

    def _remove_state(self):
        if self._state_dir:
            try:
                os.unlink(os.path.join(self._state_dir, f"{self.prefix}.json"))
            except OSError:
                pass

    def describe(self) -> dict:
        return {
            "prefix": self.prefix,
            "owner_pid": os.getpid(),
            "subnet": self.subnet,
            "hub": {"ns": self.hub_ns, "address": self.hub_address},
            "sites": {
                n: {"ns": s.ns, "address": s.address, "iface": SITE_IF, "hub_iface": s.hub_if,
                    "up_mbit": s.up, "down_mbit": s.down, "schedule": [list(x) for x in s.schedule]}
                for n, s in self.sites.items()
            },
            "namespaces": [s.ns for s in self.sites.values()] + [self.hub_ns],
        }

    # ------------------------------------------------------------- queries
    def _site(self, site: str) -> _Site:
        try:
            return self.sites[site]
        except KeyError:
            raise KeyError(f"no site {site!r}; sites are {sorted(self.sites)}") from None

    def address(self, site: str) -> str:
        """IPv4 address of ``site`` (reachable from every other site)."""
        return self._site(site).address

    def namespace(self, site: str) -> str:
        return self._site(site).ns

    iface = SITE_IF  #: name of the WAN interface inside every site namespace

    def rates(self, site: str) -> tuple[float | None, float | None]:
        s = self._site(site)
        return s.up, s.down

    def set_rate(self, site: str, up: float | None = None, down: float | None = None):
        """Change a site's uplink and/or downlink rate now (Mbit/s; ``None`` keeps
        the current value, ``0`` removes shaping)."""
        with self._lock:
            self._check_open()
            s = self._site(site)
            self._apply(s, s.up if up is None else (up or None), s.down if down is None else (down or None))

    def set_link(self, site: str, connected: bool) -> None:
        """Cut ``site`` off (its port on the hub down: no packet passes either way, no
        connection is reset) or connect it again; its shaping is kept."""
        self._check_open()
        s = self._site(site)
        _run(["ip", "-n", self.hub_ns, "link", "set", s.hub_if, "up" if connected else "down"])
        with self._lock:
            self.rate_log.append((self.elapsed(), s.name, s.up if connected else 0.0, s.down if connected else 0.0))

    def counters(self, site: str) -> dict[str, int]:
        """Bytes/packets through the site's WAN interface: ``tx_bytes`` is what
        left the site (uplink), ``rx_bytes`` what arrived (downlink)."""
        s = self._site(site)
        r = _run(["ip", "-n", s.ns, "-j", "-s", "link", "show", "dev", SITE_IF])
        st = json.loads(r.stdout)[0]["stats64"]
        return {"tx_bytes": st["tx"]["bytes"], "rx_bytes": st["rx"]["bytes"],
                "tx_packets": st["tx"]["packets"], "rx_packets": st["rx"]["packets"],
                "tx_dropped": st["tx"]["dropped"]}

    def qdisc_stats(self, site: str) -> str:
        s = self._site(site)
        a = _run(["tc", "-n", s.ns, "-s", "qdisc", "show", "dev", SITE_IF]).stdout
        b = _run(["tc", "-n", self.hub_ns, "-s", "qdisc", "show", "dev", s.hub_if]).stdout
        return f"[{site} uplink]\n{a}[{site} downlink]\n{b}"

    def env(self, site: str, rank: int | None = None, world: int | None = None) -> dict[str, str]:
        """Environment variables describing the test bed for a process in ``site``."""
        e = {
            "STELLA_WAN_SITE": site,
            "STELLA_WAN_IFACE": SITE_IF,
            "STELLA_WAN_ADDR": self.address(site),
            "STELLA_WAN_SITES": json.dumps({n: s.address for n, s in self.sites.items()}),
            "GLOO_SOCKET_IFNAME": SITE_IF,
        }
        for n, s in self.sites.items():
            e[f"STELLA_WAN_ADDR_{n.upper()}"] = s.address
        if rank is not None:
            e["STELLA_WAN_RANK"] = str(rank)
        if world is not None:
            e["STELLA_WAN_WORLD"] = str(world)
        return e

    # ----------------------------------------------------------- processes
    def _check_open(self):
        if self._closed or not self._up:
            raise TestbedError(f"test bed {self.prefix} is not running")

    def wrap(self, site: str, argv: Sequence[str]) -> list[str]:
        """argv that runs ``argv`` inside ``site``'s namespace."""
        return ["ip", "netns", "exec", self._site(site).ns] + [str(a) for a in argv]

    def popen(self, site: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              rank: int | None = None, world: int | None = None, **kw) -> subprocess.Popen:
        """Start ``argv`` inside ``site`` (``ip netns exec``).  The process gets
        its own session (killed as a group at teardown) and the environment of
        :meth:`env` on top of ``env`` (default: ``os.environ``)."""
        self._check_open()
        full_env = dict(os.environ if env is None else env)
        full_env.update(self.env(site, rank, world))
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen(self.wrap(site, argv), env=full_env, **kw)
        self._procs.append(p)
        return p

    def run(self, site: str, argv: Sequence[str], *, timeout: float, check: bool = False,
            **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``site`` to completion; killed after ``timeout`` s."""
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        kw.setdefault("text", True)
        p = self.popen(site, argv, **kw)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(p)
            out, err = p.communicate()
            raise TestbedError(f"{argv[0]} in site {site} exceeded {timeout:g}s") from None
        cp = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        if check and p.returncode != 0:
            raise TestbedError(f"{argv} in site {site} exited {p.returncode}: {err}")
        return cp

    # --------------------------------------------------------- measurement
    def measure(self, src: str, dst: str, seconds: float = 2.0, port: int = 5201) -> float:
        """Delivered TCP goodput in Mbit/s from site ``src`` to site ``dst``
        (``"hub"`` for the unshaped hub end point), measured by the receiver
        over ``seconds`` of bulk transfer after a 0.3 s warm-up."""
        from . import bulk

        return bulk.measure(self, src, dst, seconds=seconds, port=port)["mbit"]


def _kill(p: subprocess.Popen, grace: float = 2.0):
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        p.terminate()
    try:
        p.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            p.kill()
        p.wait(timeout=5)


def cleanup_stale(prefix: str | None = None, state_dir: str = STATE_DIR) -> list[str]:
    """Delete namespaces of test beds whose owner process is gone (or, with
    ``prefix``, of that one test bed).  Only namespaces recorded in a state
    file of this module, or named ``<prefix>-*``, are touched."""
    removed = []
    states = []
    if os.path.isdir(state_dir):
        for fn in os.listdir(state_dir):
            if fn.endswith(".json"):
                try:
                    with open(os.path.join(state_dir, fn)) as f:
                        states.append((fn, json.load(f)))
                except (OSError, ValueError):
                    continue
    listed = _run(["ip", "netns", "list"]).stdout.split("\n")
    present = {line.split()[0] for line in listed if line.strip()}
    for fn, st in states:
        if prefix is not None and st.get("prefix") != prefix:
            continue
        if prefix is None and _pid_alive(st.get("owner_pid", -1)):
            continue
        for ns in st.get("namespaces", []):
            if ns in present:
                _run(["ip", "netns", "del", ns], check=False)
                removed.append(ns)
        try:
            os.unlink(os.path.join(state_dir, fn))
        except OSError:
            pass
    if prefix is not None:
        for ns in present:
            if ns.startswith(prefix + "-") and ns not in removed:
                _run(["ip", "netns", "del", ns], check=False)
                removed.append(ns)
    return removed


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
