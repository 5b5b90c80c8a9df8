"""``stella``: the user command line (``stella demo``, ``stella status``, ``stella keygen``,
``stella export``, ``stella profile``, ``stella calibrate``, ``stella plan``). Heavy imports
(torch) happen inside the subcommand that needs them: ``stella plan`` never imports torch."""
from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stella", description="Stella: training across sites joined by slow links")
    sub = p.add_subparsers(dest="cmd", required=True)
    from .codec import VALUE_DTYPES
    from .demo import DemoConfig

    d = DemoConfig()
    demo = sub.add_parser("demo", help="train an MLP on digits with 2 workers through a real stella-ps")
    demo.add_argument("--workers", type=int, default=d.workers)
    demo.add_argument("--steps", type=int, default=d.steps)
    demo.add_argument("--batch-size", type=int, default=d.batch_size)
    demo.add_argument("--density", type=float, default=d.density, help="fraction of each gradient sent")
    demo.add_argument("--method", default=d.method, choices=["exact", "threshold", "block"])
    demo.add_argument("--lr", type=float, default=d.lr)
    demo.add_argument("--seed", type=int, default=d.seed)
    demo.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    demo.add_argument("--progress-every", type=int, default=100, metavar="N",
                      help="each worker logs a progress line every N steps (0: none)")
    demo.add_argument("--server", metavar="ADDRESS",
                      help="run one worker of the demo against this stella-ps (e.g. in a container) instead of "
                      "starting a server and all the workers here; keys from STELLA_SERVER_KEY/STELLA_CLIENT_KEY")
    demo.add_argument("--rank", type=int, default=0, help="with --server: this worker's shard (0..workers-1); "
                      "rank 0 evaluates and prints the final accuracy")
    st = sub.add_parser("status", help="a running job: one line for the job, a table of its workers")
    st.add_argument("address", help="e.g. tcp://127.0.0.1:5555; a sharded job: its first shard's address when the "
                    "shards list themselves (stella-ps --shards), else every shard's, comma-separated, in shard order")
    st.add_argument("--json", action="store_true", help="the raw reply and the rates as JSON (for scripts)")
    st.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="SECONDS",
                    help="refresh every SECONDS (default 2) until interrupted")
    st.add_argument("--timeout", type=float, default=5.0)
    st.add_argument("--server-key", help="the server's public key file (default: env STELLA_SERVER_KEY)")
    st.add_argument("--client-key", help="this client's .key_secret file (default: env STELLA_CLIENT_KEY)")
    kg = sub.add_parser("keygen", help="write a CurveZMQ key pair (ZeroMQ certificate files) and print the "
                        "public key line for an allowlist")
    kg.add_argument("directory", help="where to write NAME.key (public) and NAME.key_secret (keep it secret)")
    kg.add_argument("--name", default=None, help="file name stem (default: stella; with --server: server)")
    kg.add_argument("--server", action="store_true",
                    help="the server's own key pair (also implied by --name server): no allowlist line is printed")
    ex = sub.add_parser("export", help="write a stella-ps checkpoint's parameters as a plain PyTorch state_dict")
    ex.add_argument("checkpoint", help="a checkpoint file from stella-ps --checkpoint-dir")
    ex.add_argument("out", help="the .pt file to write (torch.save of {name: tensor})")
    pr = sub.add_parser("profile", help="measure a model for stella plan (compute s/step, bytes per round, the "
                        "server's time per step), or read a running job's reports; writes a JSON profile")
    src = pr.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="MODULE:FN", help="FN() returns {'model', 'batch', 'loss'[, 'optimizer', "
                     "'batch_size']} (docs/plan.md)")
    src.add_argument("--from", dest="from_address", metavar="ADDRESS",
                     help="a running job (its workers' reports, through status)")
    pr.add_argument("--out", required=True, metavar="PATH", help="the profile JSON to write")
    pr.add_argument("--steps", type=int, default=30, help="timed training steps (at least 5: the profile records "
                    "their median and quartiles, and stella plan widens its prediction by them)")
    pr.add_argument("--threads", type=int, default=1, help="torch threads while timing the step (default 1, as "
                    "Stella's examples and workers run: torch.set_num_threads(1)); give what your workers will use")
    pr.add_argument("--no-server", action="store_true", help="skip the real stella-ps on loopback (the server's "
                    "time then comes from bench.server's figures; give --broadcast-values and --broadcast-factor)")
    pr.add_argument("--broadcast-values", choices=VALUE_DTYPES, help="the job's stella-ps --broadcast-values: "
                    "passed to the loopback stella-ps, whose answer the profile records (default: its own)")
    pr.add_argument("--broadcast-factor", type=float, metavar="F", help="the job's stella-ps --broadcast-factor "
                    "(as --broadcast-values)")
    pr.add_argument("--target-iterations", type=float, help="dense training's iterations to the target")
    pr.add_argument("--global-batch", type=int, help="... at this global batch (default: the profile's batch)")
    pr.add_argument("--critical-batch", type=float, default=0.0,
                    help="iterations scale as 1 + B_crit/B with the global batch B (0: constant iterations)")
    pr.add_argument("--target-source", default="", help="where the target iterations come from (a label)")
    pr.add_argument("--factors", metavar="FILE", help="a TOML or JSON table of iterations factors against dense "
                    "training: [[factors]] density, coding, H, factor (workers: optional)")
    pr.add_argument("--samples", type=int, default=3, help="with --from: status replies to read")
    pr.add_argument("--batch-size", type=int, default=0, help="with --from: the workers' batch size")
    pl = sub.add_parser("plan", help="predict time and cost of a job on a catalog of machines, and pick one")
    pl.add_argument("--catalog", required=True, help="the machine catalog (TOML; docs/plan.md)")
    pl.add_argument("--profile", required=True, help="the model's profile (stella profile)")
    pl.add_argument("--deadline", help="e.g. 12h, 90m, 2d: rank by cost among those that meet it")
    pl.add_argument("--budget", type=float, help="in the catalog's currency: rank by time among those within it")
    pl.add_argument("--top", type=int, default=10, help="rows to show")
    pl.add_argument("--plot", metavar="PNG", help="write the Pareto front of time against cost")
    pl.add_argument("--json", metavar="PATH", help="write the ranked rows and the front as JSON")
    pl.add_argument("--config", metavar="K=V,...", help="predict this one configuration, term by term, instead of "
                    "searching: W=2,kind=NAME,density=1%%,coding=q4,H=2,shards=1 (or machines=2xlab+4xcloud:spot; "
                    "kind= may be left out with one kind; H and shards default to 1)")
    pl.add_argument("--max-shards", type=int, metavar="N", help="at most N stella-ps processes (also: the catalog's "
                    "[server] max_shards, the cores of the server's shared host, or of a server host of price 0)")
    pl.add_argument("--calibration", metavar="FILE|test-bed|none", default="",
                    help="the model's fitted coefficients: default the profile's own, else the test bed's fit "
                    "(bench/RESULTS.md), said so; 'none' for the bare structure; or a JSON file with a "
                    "'calibration' (a profile, bench.plan's --json output)")
    ca = sub.add_parser("calibrate", help="fit stella plan's model coefficients on your own measured runs and "
                        "attach the fit to the profile")
    ca.add_argument("runs", nargs="*", metavar="RUNS.json", help="measured runs: a runs file (docs/plan.md) or "
                    "python -m bench.plan --json's output")
    ca.add_argument("--from", dest="from_address", metavar="ADDRESS", help="also measure a running job (its "
                    "workers' reports, through status, over --samples x --interval seconds) as one more run; give "
                    "its machines with --config and --catalog")
    ca.add_argument("--config", metavar="SPEC", help="with --from: the job's machines in stella plan --config's "
                    "syntax (W=2,kind=NAME or machines=...); density, coding and H are the job's own unless given")
    ca.add_argument("--record", metavar="RUNS.json", help="with --from: add the measured run to this runs file "
                    "(made if missing); the fit takes every run in it, so runs of several jobs add up")
    ca.add_argument("--samples", type=int, default=6, help="with --from: status replies to read (default 6)")
    ca.add_argument("--interval", type=float, default=2.0, help="with --from: seconds between them (default 2)")
    ca.add_argument("--profile", required=True, help="the model's profile (stella profile); the fit is written "
                    "into it unless --out")
    ca.add_argument("--catalog", help="the catalog the runs' configurations name (unless the runs file carries "
                    "its own)")
    ca.add_argument("--out", metavar="PATH", help="write the calibrated profile here (default: back to --profile)")
    ca.add_argument("--compute-scale", type=float, metavar="X", help="the compute scale, given rather than fitted "
                    "(1: the profile was measured on the machines, and at the time, of the runs)")
    a = p.parse_args(argv)
    if a.cmd == "calibrate":
        if a.compute_scale is not None and not a.compute_scale > 0:
            p.error("calibrate: --compute-scale must be > 0")
        return calibrate(a)
    if a.cmd == "plan":
        if a.max_shards is not None and a.max_shards < 1:
            p.error("plan: --max-shards must be >= 1")
        return plan(a)
    if a.cmd == "profile":
        if a.model and (a.steps < 5 or a.threads < 1):
            p.error("profile: need --steps >= 5 (a spread needs steps) and --threads >= 1")
        if a.from_address and (a.broadcast_values or a.broadcast_factor):
            p.error("profile: --from reads the job's broadcast settings from its status; "
                    "--broadcast-values/--broadcast-factor are for --model")
        return profile(a)
    if a.cmd == "export":
        return export(a.checkpoint, a.out)
    if a.cmd == "keygen":
        name = a.name or ("server" if a.server else "stella")
        return keygen(a.directory, name, server=a.server or name == "server")
    if a.cmd == "demo":
        if a.workers < 1 or not 0 <= a.rank < a.workers or a.steps < 1 or a.progress_every < 0:
            p.error("demo: need --workers >= 1, 0 <= --rank < --workers, --steps >= 1, --progress-every >= 0")
        cfg = DemoConfig(workers=a.workers, steps=a.steps, batch_size=a.batch_size, density=a.density,
                         method=a.method, lr=a.lr, seed=a.seed, progress_every=a.progress_every)
        if a.server:
            from .demo import run_demo_worker

            return run_demo_worker(a.server, a.rank, cfg, json_path=a.json)
        from .demo import run_demo

        res = run_demo(cfg, json_path=a.json)
        return 0 if res["test_accuracy"] is not None else 1
    from .errors import StellaError
    from .shards import connect
    from .status import watch

    try:
        with connect(a.address, timeout=a.timeout, join=False, server_key=a.server_key,
                     client_key=a.client_key) as c:
            return watch(c.status, address=c.address, as_json=a.json, interval=a.watch)  # a job's shards, found
    except (StellaError, ValueError) as e:
        print(f"stella status: {e}", file=sys.stderr)
        return 1


def plan(a: argparse.Namespace) -> int:
    """``stella plan``: read the catalog and the profile, search, print (and plot, write JSON)."""
    import json

    from .planning.catalog import PlanError, load_catalog
    from .planning.model import predict, with_spread
    from .planning.profile_file import attach_calibration, load_profile
    from .planning.report import pareto_plot, parse_duration, prediction_json, render, render_config, to_json
    from .planning.search import parse_config, shard_cap
    from .planning.search import plan as search

    try:
        catalog = load_catalog(a.catalog)
        prof = attach_calibration(load_profile(a.profile), a.calibration)
        if a.config:
            if a.deadline or a.budget is not None or a.plot:
                raise PlanError("--config predicts one configuration: --deadline, --budget and --plot are for the "
                                "search")
            cfg = parse_config(a.config, catalog)
            one = with_spread(prof, catalog, predict(prof, catalog, cfg))
            print(render_config(one, prof, catalog, shard_cap(catalog, a.max_shards)))
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(prediction_json(one), f, indent=1, default=str)
                print(f"wrote {a.json}")
            return 0
        deadline = parse_duration(a.deadline) if a.deadline else None
        res = search(catalog, prof, deadline_s=deadline, budget=a.budget, top=a.top, max_shards=a.max_shards)
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


def calibrate(a: argparse.Namespace) -> int:
    """``stella calibrate``: fit the model's coefficients on measured runs of the profile's
    model, write the profile with the fit (its source said), and show the fit's errors."""
    import dataclasses
    import datetime
    import os

    from .errors import StellaError
    from .planning.calibrate import calibrate as fit
    from .planning.calibrate import read_run, read_runs
    from .planning.catalog import PlanError, load_catalog
    from .planning.model import predict
    from .planning.profile_file import load_profile, write_profile

    out = a.out or a.profile
    if not a.runs and not a.from_address:
        print("stella calibrate: no runs: give a runs file (RUNS.json) or a running job (--from ADDRESS)",
              file=sys.stderr)
        return 2
    if a.from_address and not (a.config and a.catalog):
        print("stella calibrate: --from needs the job's machines: --config (W=2,kind=NAME or machines=...) on "
              "--catalog", file=sys.stderr)
        return 2
    try:
        catalog = load_catalog(a.catalog) if a.catalog else None
        prof = load_profile(a.profile)
        files = list(a.runs)
        live = None
        if a.from_address and catalog is not None:
            live = _live_run(a, catalog, prof.model)
            if a.record:
                _record(a.record, live, a.catalog)
                if os.path.abspath(a.record) not in map(os.path.abspath, files):
                    files.append(a.record)
                live = None  # read back from the record with the runs before it
        runs = [r for path in files for r in read_runs(path, catalog)]
        if live is not None and catalog is not None:
            runs.append(read_run(live, catalog, f"--from {a.from_address}"))
        mine = sum(r.model in ("", prof.model) for r in runs)
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        named = [os.path.basename(x) for x in files] + ([f"live: {a.from_address}"] if live is not None else [])
        source = (f"stella calibrate {when}: {mine} run{'s' if mine != 1 else ''} of {prof.model} "
                  f"({', '.join(named)})")
        cal, notes = fit(prof, runs, source=source, compute=a.compute_scale)
        doc = dict(prof.raw)
        doc["calibration"] = dataclasses.asdict(cal)
        write_profile(out, doc)
    except (PlanError, OSError, StellaError) as e:
        print(f"stella calibrate: {e}", file=sys.stderr)
        return 2
    fitted = dataclasses.replace(prof, calibration=cal)
    print(f"stella calibrate: {cal.source}")
    for note in notes:
        print(f"  note: {note}")
    print(f"  compute x{cal.compute:.3f}, host load x{cal.host_load:.3f}, {1e3 * cal.worker_round_s:.1f} ms of a "
          f"worker's CPU per round, background share {cal.background:.2f}, link x{cal.link:.3f}, "
          f"{1e3 * cal.round_s:.1f} ms per round, exchange stretch "
          f"x{cal.exchange_stretch:.2f}, tail loss x{cal.tail_loss:.2f} queue delays, jitter {cal.jitter:.3f} "
          f"({cal.exchange_runs} of the runs bound by their exchange)")
    print("\n  | run | configuration | predicted s/it | measured s/it | error |\n  |---|---|---|---|---|")
    errors = []
    for r in runs:
        if r.model not in ("", prof.model):
            continue
        p = predict(fitted, r.catalog, r.observation.config)
        meas = r.observation.s_per_it
        err = p.s_per_it / meas - 1 if meas > 0 else float("nan")
        if meas > 0:
            errors.append(abs(err))
        c = r.observation.config
        print(f"  | {r.name} | {c.machines}, {c.density:.2%} {c.coding}, H = {c.sync_every} | {p.s_per_it:.4g} | "
              f"{meas:.4g} | {err:+.1%} |")
    if errors:
        print(f"\n  the fit's own runs: mean absolute error {sum(errors) / len(errors):.1%}, worst "
              f"{max(errors):.1%} (in the fit, not held out)")
    print(f"wrote {out}: stella plan --profile {out} uses this fit and says so")
    return 0


def _live_run(a: argparse.Namespace, catalog: Any, model: str) -> dict[str, Any]:
    """``calibrate --from``: the running job measured (:func:`stella.planning.measure.run_from_status`)
    as a runs file's row, its configuration the user's machines with the job's own density,
    coding and H (or the user's, which must then be the job's)."""
    import datetime

    from .planning.catalog import PlanError
    from .planning.measure import run_from_status
    from .planning.search import parse_config

    print(f"stella calibrate: reading the job at {a.from_address} for {a.samples * a.interval:g} s ...",
          file=sys.stderr)
    m = run_from_status(a.from_address, samples=a.samples, interval=a.interval)
    given = {k.strip().lower(): v.strip() for k, _, v in (p.partition("=") for p in a.config.split(",") if p.strip())}
    spec = a.config
    for key, value in (("density", m["density"]), ("coding", m["coding"]), ("H", m["H"])):
        if key.lower() not in given:
            spec += f",{key}={value}"
    config = parse_config(spec, catalog)
    job = {"workers": (config.workers, m["workers"]), "H": (config.sync_every, m["H"]),
           "coding": (config.coding, m["coding"])}
    wrong = [f"{k} {said} (the job: {got})" for k, (said, got) in job.items() if said != got]
    if abs(config.density - m["density"]) > 0.05 * m["density"]:
        wrong.append(f"density {config.density:g} (the job: {m['density']:g})")
    if wrong:
        raise PlanError(f"--config {spec!r} does not describe the job at {a.from_address}: " + "; ".join(wrong))
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return {"run": f"{a.from_address} {when}", "spec": spec, "model": model, "measured": m}


def _record(path: str, row: dict[str, Any], catalog: str) -> None:
    """Add ``row`` to the runs file ``path`` (made if missing), naming its catalog relative to it."""
    import json
    import os

    from .planning.catalog import PlanError

    doc: dict[str, Any] = {"rows": []}
    if os.path.exists(path):
        with open(path) as f:
            doc = json.load(f)
        if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
            raise PlanError(f"{path}: not a runs file (a JSON object with \"rows\": [...])")
    row = {**row, "catalog": os.path.relpath(os.path.abspath(catalog), os.path.dirname(os.path.abspath(path)))}
    doc["rows"].append(row)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def profile(a: argparse.Namespace) -> int:
    """``stella profile``: measure (``--model``) or read (``--from``), then write the JSON."""
    from .errors import StellaError
    from .planning.profile_file import read_factors, write_profile

    try:
        target = None
        if a.target_iterations:
            target = {"dense_iterations": a.target_iterations, "global_batch": a.global_batch or 0,
                      "critical_batch": a.critical_batch,
                      "source": a.target_source or "user-given (stella profile --target-iterations)"}
        factors = read_factors(a.factors) if a.factors else []
        if a.from_address:
            from .planning.measure import profile_from_status

            doc = profile_from_status(a.from_address, samples=a.samples, batch_size=a.batch_size or 1)
        else:
            from .planning.measure import load_model_spec, profile_model

            spec = load_model_spec(a.model)
            batch = spec["batch"]
            bs = int(spec.get("batch_size") or len(batch[0] if isinstance(batch, (tuple, list)) else batch))
            doc = profile_model(spec["model"], spec["loss"], lambda: batch, optimizer=spec.get("optimizer"),
                                batch_size=bs, name=a.model, steps=a.steps, threads=a.threads,
                                server=not a.no_server,
                                broadcast_values=a.broadcast_values, broadcast_factor=a.broadcast_factor,
                                log=lambda s: print(s, file=sys.stderr))
        if target:
            target["global_batch"] = target["global_batch"] or doc["batch_size"]
            doc["target"] = target
        if factors:
            doc["factors"] = factors
        write_profile(a.out, doc)  # what is written must read back
    except (StellaError, OSError) as e:
        print(f"stella profile: {e}", file=sys.stderr)
        return 2
    spread = doc.get("compute_spread") or {}
    print(f"wrote {a.out}: {doc['numel']:,} parameters, {doc['compute_s']:.4g} s/step at batch {doc['batch_size']}"
          + (f" (quartiles {spread['q1_s']:.4g}-{spread['q3_s']:.4g} s over {spread['steps']} steps)" if spread
             else "") + (f", {doc['torch_threads']} torch thread(s)" if doc.get("torch_threads") else ""),
          file=sys.stderr)
    if not doc.get("calibration"):
        print("  no calibration in it: stella plan uses the test bed's fit (bench/RESULTS.md) and says so; "
              "stella calibrate fits one on your own runs (docs/plan.md)", file=sys.stderr)
    return 0


def export(checkpoint: str, out: str) -> int:
    """Write the parameters of ``checkpoint`` (verified first) to ``out`` as a PyTorch
    ``state_dict``: each tensor named and shaped as registered, in its registered dtype,
    ready for ``model.load_state_dict(torch.load(out))``. Optimizer state is not part of
    it (the server's lazy optimizer state has no PyTorch counterpart)."""
    import torch

    from .checkpoint_file import CheckpointError, read

    try:
        ck = read(checkpoint)
    except (CheckpointError, OSError) as e:
        print(f"stella export: {e}", file=sys.stderr)
        return 1
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    params, cut = ck.params()
    registered = {spec["name"]: spec["dtype"] for spec in (ck.model["tensors"] if ck.model else ck.layout)}
    state = {name: torch.from_numpy(p.copy()).to(dtypes[registered[name]]) for name, p in params.items()}
    torch.save(state, out)
    print(f"wrote {out}: {len(state)} tensors at version {ck.version}", file=sys.stderr)
    if cut:
        print(f"stella export: this shard's checkpoint holds only part of {len(cut)} tensors (e.g. {cut[0]!r}), "
              "left out: their other parts are in the other shards' checkpoints", file=sys.stderr)
    return 0


def keygen(directory: str, name: str, *, server: bool = False) -> int:
    """Write ``NAME.key`` and ``NAME.key_secret`` (mode 0600) into ``directory``; print the
    public key with the name, the allowlist line for it. The ``server``'s own pair gets
    no such line (it is not a client of itself), but says where its two files go."""
    import os

    import zmq.auth

    os.makedirs(directory, exist_ok=True)
    secret_path = os.path.join(directory, f"{name}.key_secret")
    if os.path.exists(secret_path):
        print(f"stella keygen: {secret_path} exists; not overwriting a key", file=sys.stderr)
        return 1
    public_path, secret_path = zmq.auth.create_certificates(directory, name)
    os.chmod(secret_path, 0o600)
    public, _ = zmq.auth.load_certificate(public_path)
    if server:
        print(f"wrote {public_path} (the server's public key: give it to every worker site and operator, "
              f"STELLA_SERVER_KEY) and {secret_path} (stella-ps --keys, STELLA_PS_KEYS: keep it on the server's "
              "machine). The server's own key does not go on the allowlist; the workers' keys do.", file=sys.stderr)
        return 0
    print(f"{public.decode()} {name}")
    print(f"wrote {public_path} (public: give it out, put the line above on the server's allowlist) and "
          f"{secret_path} (secret: keep it on this machine)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
