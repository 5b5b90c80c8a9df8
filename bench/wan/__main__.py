"""Command line for the slow-link test bed.

  python -m bench.wan check [--site a=100/100 ...] [--seconds 2]
  python -m bench.wan run --site ps=1000 --site a=100/100 --site b=100/20 [--on a --on b] \
        [--timeout 600] -- CMD ARGS...        # {site} {rank} {world} {addr_ps} ... substituted
  python -m bench.wan up --site a=100 --site b=100/20 [--hold 600]
  python -m bench.wan down PREFIX | --stale
  python -m bench.wan list

Sites: ``NAME=UP/DOWN`` in Mbit/s (``NAME=RATE`` for symmetric, ``-`` for
unshaped), optional schedule ``NAME=100/100@5:20/20@10:100/100``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from .testbed import STATE_DIR, Link, NetnsUnavailableError, NotRootError, TestbedError, WanTestbed, cleanup_stale

DEFAULT_SITES = ["ps=1000/1000", "a=100/100", "b=100/100"]


def _sites(specs):
    out = {}
    for spec in specs or DEFAULT_SITES:
        name, sep, link = spec.partition("=")
        if not sep:
            raise SystemExit(f"bad --site {spec!r}: expected NAME=UP/DOWN")
        out[name] = Link.parse(link)
    return out


def cmd_check(a):
    sites = _sites(a.site)
    rows = []
    with WanTestbed(sites, max_lifetime=60 + 10 * len(sites) * a.seconds) as bed:
        print(f"test bed {bed.prefix} subnet {bed.subnet}", flush=True)
        for name in sites:
            up, down = bed.rates(name)
            r_up = bed.measure(name, "hub", a.seconds)
            r_down = bed.measure("hub", name, a.seconds)
            rows.append({"site": name, "up_cfg": up, "up_mbit": round(r_up, 2), "down_cfg": down,
                         "down_mbit": round(r_down, 2)})
            f = lambda v: "-" if not v else f"{v:g}"
            print(f"{name:>6}  up {f(up):>6} Mbit/s cfg -> {r_up:8.2f} delivered"
                  f"   down {f(down):>6} Mbit/s cfg -> {r_down:8.2f} delivered", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


def cmd_run(a):
    if not a.cmd:
        raise SystemExit("run: give the command after --")
    cmd = a.cmd[1:] if a.cmd[0] == "--" else a.cmd
    sites = _sites(a.site)
    on = a.on or [s for s in sites if s != "ps"] or list(sites)
    rc = 0
    with WanTestbed(sites, max_lifetime=a.timeout + 30) as bed:
        subst = {f"addr_{n}": bed.address(n) for n in sites}
        procs = []
        for rank, name in enumerate(on):
            argv = [x.format(site=name, rank=rank, world=len(on), **subst) for x in cmd]
            procs.append((name, bed.popen(name, argv, rank=rank, world=len(on))))
        deadline = time.monotonic() + a.timeout
        for name, p in procs:
            try:
                r = p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"bench.wan run: site {name} exceeded --timeout {a.timeout:g}s, killing", file=sys.stderr)
                r = 124
            rc = rc or r
        for name in sites:
            c = bed.counters(name)
            print(f"bench.wan: site {name}: sent {c['tx_bytes']} B, received {c['rx_bytes']} B", file=sys.stderr)
    return rc


def cmd_up(a):
    sites = _sites(a.site)
    with WanTestbed(sites, max_lifetime=a.hold + 30) as bed:
        print(json.dumps(bed.describe(), indent=1), flush=True)
        print(f"# up; run things with: ip netns exec {bed.namespace(next(iter(sites)))} CMD ; "
              f"tear down with Ctrl-C or `python -m bench.wan down {bed.prefix}` "
              f"(auto after {a.hold:g}s)", file=sys.stderr, flush=True)
        end = time.monotonic() + a.hold
        try:
            while time.monotonic() < end and not bed.closed:
                # a `down` from another shell deletes the namespaces: notice it
                if subprocess.run(["ip", "netns", "pids", bed.hub_ns], capture_output=True).returncode != 0:
                    break
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    return 0


def cmd_down(a):
    if not a.prefix and not a.stale:
        raise SystemExit("down: give a PREFIX or --stale")
    removed = cleanup_stale(a.prefix)
    print("removed: " + (" ".join(removed) if removed else "nothing"))
    return 0


def cmd_list(a):
    if not os.path.isdir(STATE_DIR):
        print("no test beds")
        return 0
    for fn in sorted(os.listdir(STATE_DIR)):
        with open(os.path.join(STATE_DIR, fn)) as f:
            st = json.load(f)
        print(st["prefix"], "owner", st["owner_pid"], json.dumps({n: s["address"] for n, s in st["sites"].items()}))
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.wan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd_name", required=True)
    site_help = "NAME=UP/DOWN in Mbit/s (repeatable); default " + " ".join(DEFAULT_SITES)
    p = sub.add_parser("check", help="measure every link's delivered up/down rate")
    p.add_argument("--site", action="append", help=site_help)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--json")
    p.set_defaults(fn=cmd_check)
    p = sub.add_parser("run", help="bring up sites, run CMD in each, tear down")
    p.add_argument("--site", action="append", help=site_help)
    p.add_argument("--on", action="append", help="sites to run CMD in (default: all but ps)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser("up", help="bring up sites and hold them (Ctrl-C / --hold / down)")
    p.add_argument("--site", action="append", help=site_help)
    p.add_argument("--hold", type=float, default=600.0, help="seconds before automatic teardown")
    p.set_defaults(fn=cmd_up)
    p = sub.add_parser("down", help="tear down a test bed by prefix, or every test bed whose owner died")
    p.add_argument("prefix", nargs="?")
    p.add_argument("--stale", action="store_true")
    p.set_defaults(fn=cmd_down)
    p = sub.add_parser("list", help="list live test beds")
    p.set_defaults(fn=cmd_list)
    a = ap.parse_args(argv)
    try:
        return a.fn(a)
    except (NotRootError, NetnsUnavailableError) as e:
        print(f"bench.wan: error: {e}", file=sys.stderr)
        return 2
    except TestbedError as e:
        print(f"bench.wan: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
