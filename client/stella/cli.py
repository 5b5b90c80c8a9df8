"""``stella``: the user command line (``stella demo``, ``stella status``, ``stella keygen``,
``stella export``)."""
from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stella", description="Stella: training across sites joined by slow links")
    sub = p.add_subparsers(dest="cmd", required=True)
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
    st.add_argument("address", help="e.g. tcp://127.0.0.1:5555; a sharded job: its shards' addresses, "
                    "comma-separated, in shard order")
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
    a = p.parse_args(argv)
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
    from .shards import connect, split_address
    from .status import watch

    try:
        with connect(a.address, timeout=a.timeout, join=False, server_key=a.server_key,
                     client_key=a.client_key) as c:
            return watch(c.status, address=",".join(split_address(a.address)), as_json=a.json, interval=a.watch)
    except (StellaError, ValueError) as e:
        print(f"stella status: {e}", file=sys.stderr)
        return 1


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
    state = {spec["name"]: torch.from_numpy(arrays["param"].copy()).reshape(spec["shape"]).to(dtypes[spec["dtype"]])
             for spec, arrays in zip(ck.layout, ck.tensors)}
    torch.save(state, out)
    print(f"wrote {out}: {len(state)} tensors at version {ck.version}", file=sys.stderr)
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
