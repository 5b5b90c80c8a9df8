"""stella-ps configuration: command-line flags, each with an environment override.

Precedence: flag > environment variable > default. The environment names are
listed in :data:`ENV` and in the README.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass, field

from .errors import ConfigError
from .optim import OptimizerConfig, OptimizerLimits

__all__ = ["ServerConfig", "ENV", "parse_args"]

ENV = {
    "bind": "STELLA_PS_BIND",
    "workers": "STELLA_PS_WORKERS",
    "step_deadline": "STELLA_PS_STEP_DEADLINE",
    "optimizer": "STELLA_PS_OPTIMIZER",
    "history": "STELLA_PS_HISTORY",
    "max_message_bytes": "STELLA_PS_MAX_MESSAGE_BYTES",
    "max_workers": "STELLA_PS_MAX_WORKERS",
    "max_workers_per_key": "STELLA_PS_MAX_WORKERS_PER_KEY",
    "max_waiting_pulls": "STELLA_PS_MAX_WAITING_PULLS",
    "max_queued_pushes": "STELLA_PS_MAX_QUEUED_PUSHES",
    "max_queued_push_bytes": "STELLA_PS_MAX_QUEUED_PUSH_BYTES",
    "max_model_bytes": "STELLA_PS_MAX_MODEL_BYTES",
    "max_lr": "STELLA_PS_MAX_LR",
    "max_weight_decay": "STELLA_PS_MAX_WEIGHT_DECAY",
    "max_push_norm": "STELLA_PS_MAX_PUSH_NORM",
    "push_norm_action": "STELLA_PS_PUSH_NORM_ACTION",
    "log_level": "STELLA_PS_LOG_LEVEL",
    "log_format": "STELLA_PS_LOG_FORMAT",
    "ready_file": "STELLA_PS_READY_FILE",
    "keys": "STELLA_PS_KEYS",
    "allow": "STELLA_PS_ALLOW",
    "insecure": "STELLA_PS_INSECURE",
    "metrics": "STELLA_PS_METRICS",
    "liveness_timeout": "STELLA_PS_LIVENESS_TIMEOUT",
    "adaptive_deadline": "STELLA_PS_ADAPTIVE_DEADLINE",
    "deadline_min": "STELLA_PS_DEADLINE_MIN",
    "deadline_max": "STELLA_PS_DEADLINE_MAX",
    "deadline_quantile": "STELLA_PS_DEADLINE_QUANTILE",
    "deadline_factor": "STELLA_PS_DEADLINE_FACTOR",
    "checkpoint_dir": "STELLA_PS_CHECKPOINT_DIR",
    "checkpoint_every_steps": "STELLA_PS_CHECKPOINT_EVERY_STEPS",
    "checkpoint_every_s": "STELLA_PS_CHECKPOINT_EVERY_S",
    "checkpoint_keep": "STELLA_PS_CHECKPOINT_KEEP",
}


DEFAULT_OPTIMIZER = OptimizerConfig.from_wire({"name": "sgd"})  # PyTorch's SGD defaults
PUSH_NORM_ACTIONS = ("refuse", "clip")


def default_max_model_bytes() -> int:
    """Half the machine's physical memory (16 GiB where it cannot be read): room for the
    model's parameters and optimizer state, with the other half for the pushes, pulls
    and snapshots in flight and for everything else on the host."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 16 << 30


@dataclass(frozen=True)
class ServerConfig:
    """Everything the daemon can be told, validated. ``bind`` may use port 0 for an
    ephemeral port."""

    bind: str = "tcp://0.0.0.0:5555"
    workers: int = 1  # steps wait until this many workers have joined once
    step_deadline: float = 0.0  # seconds after a step's first push; 0 = wait for every live worker
    # the optimizer when a registration names none (plain SGD, PyTorch's defaults, if unset)
    optimizer: OptimizerConfig = DEFAULT_OPTIMIZER
    history: int = 64  # applied steps remembered for delta pulls; older `since` gets a snapshot
    max_message_bytes: int = 1 << 30
    # resource bounds on what peers can make the server hold (README "Limits")
    max_workers: int = 256  # live workers; a join beyond is refused
    max_workers_per_key: int = 8  # live workers holding one client key (a site's machine or GPUs)
    max_waiting_pulls: int = 8  # pulls per worker waiting for a future version
    max_queued_pushes: int = 4  # pushes per worker waiting for their step
    # bytes of pushes per worker waiting for their step; a push to an empty queue is
    # always taken (max_message_bytes bounds it)
    max_queued_push_bytes: int = 256 << 20
    # parameters + optimizer state of the model (kernel.state_bytes), checked before allocating
    max_model_bytes: int = field(default_factory=default_max_model_bytes)
    # operator bounds on hyper-parameters (--max-lr, --max-weight-decay); the default optimizer obeys them
    optimizer_limits: OptimizerLimits = field(default_factory=OptimizerLimits)
    max_push_norm: float = 0.0  # L2 norm of one push's values; 0 = no bound
    push_norm_action: str = "refuse"  # above max_push_norm: "refuse" the push or "clip" it to the bound
    log_level: str = "INFO"
    log_format: str = "json"
    ready_file: str | None = None  # the bound endpoint is written here once listening
    keys: str | None = None  # the server's certificate file with its secret key (CurveZMQ)
    allow: str | None = None  # the allowlist: client public keys admitted
    insecure: bool = False  # plaintext, no authentication: only with this explicit choice
    metrics: str | None = None  # HOST:PORT of the Prometheus endpoint and /healthz; None = off
    # liveness: a worker not heard from (requests, heartbeats) for this long is declared gone; 0 = never
    liveness_timeout: float = 20.0
    # the adaptive step deadline (aggregation.AdaptiveDeadline), used when step_deadline is 0
    adaptive_deadline: bool = True
    deadline_min: float = 1.0
    deadline_max: float = 60.0
    deadline_quantile: float = 0.9
    deadline_factor: float = 3.0
    # checkpoints (checkpoints.py): resumed from on start, written every N steps and/or S seconds and on SIGTERM
    checkpoint_dir: str | None = None
    checkpoint_every_steps: int = 0  # 0: not by step count
    checkpoint_every_s: float = 300.0  # 0: not by time
    checkpoint_keep: int = 3


def _parse_optimizer(text: str) -> OptimizerConfig:
    """``adamw`` or ``adamw:lr=0.001,weight_decay=0.01`` or a JSON map, validated."""
    text = text.strip()
    if not text:
        return DEFAULT_OPTIMIZER
    try:
        if text.startswith("{"):
            obj = json.loads(text)
        else:
            name, _, rest = text.partition(":")
            obj = {"name": name}
            for item in filter(None, rest.split(",")):
                k, _, v = item.partition("=")
                obj[k.strip()] = json.loads(v) if v.strip()[:1] in "[{tf" else float(v)
        return OptimizerConfig.from_wire(obj)
    except (ValueError, ConfigError) as e:  # json and float() raise ValueError
        raise argparse.ArgumentTypeError(f"bad optimizer {text!r}: {e}") from None


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    d = ServerConfig()
    env = os.environ
    p = argparse.ArgumentParser(
        prog="stella-ps",
        description="Stella parameter server: stores the model and optimizer state, "
        "aggregates sparse pushes and serves pulls of what changed.",
    )
    p.add_argument("--bind", default=env.get(ENV["bind"], d.bind), help=f"ZeroMQ endpoint (env {ENV['bind']})")
    p.add_argument("--workers", type=int, default=int(env.get(ENV["workers"], d.workers)),
                   help=f"workers that must join before the first step closes (env {ENV['workers']})")
    p.add_argument("--step-deadline", type=float, default=float(env.get(ENV["step_deadline"], d.step_deadline)),
                   help=f"close a step this many seconds after its first push even if workers are missing; "
                   f"0 waits for all (env {ENV['step_deadline']})")
    p.add_argument("--optimizer", type=_parse_optimizer, default=_parse_optimizer(env.get(ENV["optimizer"], "")),
                   help="default optimizer, e.g. 'adamw:lr=0.001,weight_decay=0.01' or JSON; used when a "
                   f"registration names none (env {ENV['optimizer']})")
    p.add_argument("--history", type=int, default=int(env.get(ENV["history"], d.history)),
                   help=f"steps kept for delta pulls (env {ENV['history']})")
    p.add_argument("--max-message-bytes", type=int,
                   default=int(env.get(ENV["max_message_bytes"], d.max_message_bytes)),
                   help=f"largest accepted message (env {ENV['max_message_bytes']})")
    p.add_argument("--log-level", default=env.get(ENV["log_level"], d.log_level),
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], type=str.upper)
    p.add_argument("--log-format", default=env.get(ENV["log_format"], d.log_format), choices=["json", "text"])
    p.add_argument("--ready-file", default=env.get(ENV["ready_file"]),
                   help="write the bound endpoint to this file once listening (for scripts and tests)")
    p.add_argument("--keys", default=env.get(ENV["keys"]),
                   help="the server's key pair: the '.key_secret' certificate `stella keygen` writes "
                   f"(env {ENV['keys']})")
    p.add_argument("--allow", default=env.get(ENV["allow"]),
                   help="allowlist of client public keys, one Z85 key per line; re-read on change and on SIGHUP "
                   f"(env {ENV['allow']})")
    p.add_argument("--insecure", action="store_true",
                   default=env.get(ENV["insecure"], "").lower() in ("1", "true", "yes"),
                   help="plaintext and no authentication: anyone who reaches the port can read the traffic and "
                   f"change the model (env {ENV['insecure']}=1)")
    p.add_argument("--max-workers", type=int, default=int(env.get(ENV["max_workers"], d.max_workers)),
                   help=f"live workers at most; a join beyond is refused (env {ENV['max_workers']})")
    p.add_argument("--max-workers-per-key", type=int,
                   default=int(env.get(ENV["max_workers_per_key"], d.max_workers_per_key)),
                   help=f"live workers with one client key at most (env {ENV['max_workers_per_key']})")
    p.add_argument("--max-waiting-pulls", type=int,
                   default=int(env.get(ENV["max_waiting_pulls"], d.max_waiting_pulls)),
                   help=f"pulls per worker waiting for a future version (env {ENV['max_waiting_pulls']})")
    p.add_argument("--max-queued-pushes", type=int,
                   default=int(env.get(ENV["max_queued_pushes"], d.max_queued_pushes)),
                   help=f"pushes per worker waiting for their step (env {ENV['max_queued_pushes']})")
    p.add_argument("--max-queued-push-bytes", type=int,
                   default=int(env.get(ENV["max_queued_push_bytes"], d.max_queued_push_bytes)),
                   help="bytes of pushes per worker waiting for their step; a push to an empty queue is always "
                   f"taken (env {ENV['max_queued_push_bytes']})")
    p.add_argument("--max-model-bytes", type=int, default=int(env.get(ENV["max_model_bytes"], d.max_model_bytes)),
                   help="parameters plus optimizer state of the registered model, checked before allocating; "
                   f"default half the physical memory (env {ENV['max_model_bytes']})")
    p.add_argument("--max-lr", type=float, default=_opt_float(env.get(ENV["max_lr"])),
                   help=f"largest lr a registration, set_optimizer or push may ask for (env {ENV['max_lr']})")
    p.add_argument("--max-weight-decay", type=float, default=_opt_float(env.get(ENV["max_weight_decay"])),
                   help=f"largest weight_decay (env {ENV['max_weight_decay']})")
    p.add_argument("--max-push-norm", type=float,
                   default=float(env.get(ENV["max_push_norm"], d.max_push_norm)),
                   help=f"L2 norm bound of one push's values, 0 = none (env {ENV['max_push_norm']})")
    p.add_argument("--push-norm-action", choices=PUSH_NORM_ACTIONS,
                   default=env.get(ENV["push_norm_action"], d.push_norm_action),
                   help=f"a push above --max-push-norm: refuse it, or clip it to the bound "
                   f"(env {ENV['push_norm_action']})")
    p.add_argument("--metrics", metavar="HOST:PORT", default=env.get(ENV["metrics"]) or None,
                   help="serve Prometheus metrics (/metrics) and a health check (/healthz) over HTTP here, "
                   f"e.g. 0.0.0.0:9100; off unless given (env {ENV['metrics']})")
    p.add_argument("--liveness-timeout", type=float,
                   default=float(env.get(ENV["liveness_timeout"], d.liveness_timeout)),
                   help="declare a worker gone when neither a request nor a heartbeat came from it for this many "
                   f"seconds (a joined, unregistered one: no request); 0 never does (env {ENV['liveness_timeout']})")
    p.add_argument("--adaptive-deadline", action=argparse.BooleanOptionalAction,
                   default=env.get(ENV["adaptive_deadline"], "1").lower() in ("1", "true", "yes"),
                   help="without --step-deadline, close a step missing workers after the deadline learnt from push "
                   f"arrivals (default on; env {ENV['adaptive_deadline']})")
    p.add_argument("--deadline-min", type=float, default=float(env.get(ENV["deadline_min"], d.deadline_min)),
                   help=f"adaptive deadline's lower bound, seconds (env {ENV['deadline_min']})")
    p.add_argument("--deadline-max", type=float, default=float(env.get(ENV["deadline_max"], d.deadline_max)),
                   help=f"adaptive deadline's upper bound, and its value until learnt (env {ENV['deadline_max']})")
    p.add_argument("--deadline-quantile", type=float,
                   default=float(env.get(ENV["deadline_quantile"], d.deadline_quantile)),
                   help=f"quantile of recent arrival spreads (env {ENV['deadline_quantile']})")
    p.add_argument("--deadline-factor", type=float,
                   default=float(env.get(ENV["deadline_factor"], d.deadline_factor)),
                   help=f"multiple of that quantile (env {ENV['deadline_factor']})")
    p.add_argument("--checkpoint-dir", default=env.get(ENV["checkpoint_dir"]),
                   help="write checkpoints here, and resume from the newest valid one on start "
                   f"(env {ENV['checkpoint_dir']})")
    p.add_argument("--checkpoint-every-steps", type=int,
                   default=int(env.get(ENV["checkpoint_every_steps"], d.checkpoint_every_steps)),
                   help=f"a checkpoint every this many steps, 0 = not by steps (env {ENV['checkpoint_every_steps']})")
    p.add_argument("--checkpoint-every-s", type=float,
                   default=float(env.get(ENV["checkpoint_every_s"], d.checkpoint_every_s)),
                   help=f"a checkpoint every this many seconds, 0 = not by time (env {ENV['checkpoint_every_s']})")
    p.add_argument("--checkpoint-keep", type=int, default=int(env.get(ENV["checkpoint_keep"], d.checkpoint_keep)),
                   help=f"checkpoints kept (the oldest are deleted) (env {ENV['checkpoint_keep']})")
    a = p.parse_args(argv)
    if a.liveness_timeout < 0 or a.checkpoint_every_steps < 0 or a.checkpoint_every_s < 0 or a.checkpoint_keep < 1:
        p.error("--liveness-timeout, --checkpoint-every-steps and --checkpoint-every-s must be >= 0, "
                "--checkpoint-keep >= 1")
    if not (0 < a.deadline_min <= a.deadline_max and 0 < a.deadline_quantile <= 1 and a.deadline_factor > 0):
        p.error("need 0 < --deadline-min <= --deadline-max, 0 < --deadline-quantile <= 1, --deadline-factor > 0")
    if not a.insecure and not (a.keys and a.allow):
        p.error("stella-ps needs --keys SERVER.key_secret and --allow ALLOWLIST (make them with `stella keygen`), "
                "or --insecure to run without encryption and authentication")
    if a.workers < 1 or a.history < 1 or a.step_deadline < 0 or a.max_message_bytes < 1024:
        p.error("--workers and --history must be >= 1, --step-deadline >= 0, --max-message-bytes >= 1024")
    if min(a.max_workers, a.max_workers_per_key, a.max_waiting_pulls, a.max_queued_pushes) < 1:
        p.error("--max-workers, --max-workers-per-key, --max-waiting-pulls and --max-queued-pushes must be >= 1")
    if a.max_queued_push_bytes < 0 or a.max_model_bytes < 1:
        p.error("--max-queued-push-bytes must be >= 0 and --max-model-bytes >= 1")
    if not (math.isfinite(a.max_push_norm) and a.max_push_norm >= 0):
        p.error("--max-push-norm must be a finite number >= 0 (0: no bound)")
    if a.metrics:
        from .metrics import parse_bind

        try:
            parse_bind(a.metrics)
        except ConfigError as e:
            p.error(f"--metrics: {e}")
    try:
        limits = OptimizerLimits(a.max_lr, a.max_weight_decay)
    except ConfigError as e:
        p.error(f"--max-lr/--max-weight-decay: {e}")
    try:  # the server's own default must obey the operator's bounds
        limits.check(a.optimizer)
    except ConfigError as e:
        p.error(f"--optimizer {a.optimizer.to_wire()}: {e}")
    return ServerConfig(
        bind=a.bind, workers=a.workers, step_deadline=a.step_deadline, optimizer=a.optimizer,
        history=a.history, max_message_bytes=a.max_message_bytes, max_workers=a.max_workers,
        max_workers_per_key=a.max_workers_per_key,
        max_waiting_pulls=a.max_waiting_pulls, max_queued_pushes=a.max_queued_pushes,
        max_queued_push_bytes=a.max_queued_push_bytes, max_model_bytes=a.max_model_bytes,
        optimizer_limits=limits, max_push_norm=a.max_push_norm, push_norm_action=a.push_norm_action,
        log_level=a.log_level, log_format=a.log_format, ready_file=a.ready_file, keys=a.keys, allow=a.allow,
        metrics=a.metrics,
        insecure=a.insecure, liveness_timeout=a.liveness_timeout, adaptive_deadline=a.adaptive_deadline,
        deadline_min=a.deadline_min, deadline_max=a.deadline_max, deadline_quantile=a.deadline_quantile,
        deadline_factor=a.deadline_factor, checkpoint_dir=a.checkpoint_dir,
        checkpoint_every_steps=a.checkpoint_every_steps, checkpoint_every_s=a.checkpoint_every_s,
        checkpoint_keep=a.checkpoint_keep,
    )


def _opt_float(text: str | None) -> float | None:
    return float(text) if text not in (None, "") else None
