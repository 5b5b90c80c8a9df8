"""The fit of ``stella plan``'s coefficients on measured runs lives in the product,
:mod:`stella.planning.calibrate` (``stella calibrate``); this module is the benchmarks'
name for it, and adds what to an older ``python -m bench.plan --json`` file its runs'
catalogs and configurations, which ``stella calibrate`` reads:

  python -m bench.calibrate bench/PLAN.json --out runs.json
  stella calibrate --profile widemlp.profile.json runs.json
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from stella.planning.calibrate import EXCHANGE_BOUND, Observation, calibrate, fit, fit_many, observation, read_runs

__all__ = ["Observation", "observation", "fit", "fit_many", "calibrate", "read_runs", "EXCHANGE_BOUND",
           "with_catalogs"]


def with_catalogs(doc: dict[str, Any]) -> dict[str, Any]:
    """bench.plan's output with each row's test-bed catalog and configuration (``catalog``,
    ``spec``: :func:`bench.plan.testbed_row`), found by the run's name in :func:`bench.plan.runs`;
    rows of runs no longer listed there are left out."""
    from bench.plan import runs, testbed_row

    known = {r.name: r for r in runs(quick=False)}
    rows = [{**row, **testbed_row(known[row["run"]])} for row in doc.get("rows", []) if row.get("run") in known]
    return {**doc, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="python -m bench.plan --json's output (e.g. bench/PLAN.json)")
    ap.add_argument("--out", required=True, help="the runs file to write (stella calibrate reads it)")
    a = ap.parse_args(argv)
    with open(a.json) as f:
        doc = with_catalogs(json.load(f))
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {a.out}: {len(doc['rows'])} runs with their test-bed catalogs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
