"""stella-ps configuration: every setting declared once.

Each setting is a dataclass field whose metadata (:func:`setting`) carries its
command-line flag, environment variable, help text and range check; the flags, the
environment table (:data:`ENV`), the ``--help`` text with every default and the
validation of a directly built configuration are all generated from those
declarations. Settings are grouped into the structs their owners take:
:class:`Limits` (what peers can make the server hold), :class:`Liveness`,
:class:`Deadline` (when a step stops waiting) and :class:`Checkpoints`.

Precedence: flag > environment variable > default. A flag's environment name is
``STELLA_PS_`` and the flag in capitals (``--checkpoint-every-s`` is
``STELLA_PS_CHECKPOINT_EVERY_S``).

Standard library only (with :mod:`.optim`, itself pure Python): the container's
health check imports :func:`parse_bind` from here and must load no C extension.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import ConfigError
from .optim import OptimizerConfig, OptimizerLimits

if TYPE_CHECKING:  # the wire schema's types, for the checker only: this module loads no C extension
    from stella.protocol import BroadcastInfo, PullMode, ValueDtype

__all__ = ["ServerConfig", "Limits", "Liveness", "Deadline", "Checkpoints", "Pulls", "Shards", "ENV", "ENV_PREFIX",
           "parse_args", "parse_bind", "parse_shards", "setting", "shard_position"]

ENV_PREFIX = "STELLA_PS_"
PUSH_NORM_ACTIONS = ("refuse", "clip")
DEFAULT_OPTIMIZER = OptimizerConfig.from_wire({"name": "sgd"})  # PyTorch's SGD defaults


def parse_bind(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``:PORT`` or ``PORT`` (all interfaces) -> ``(host, port)``; port 0
    picks a free one. The metrics address's syntax."""
    host, sep, port = text.strip().rpartition(":")
    if not sep:
        host = ""
    host = host.strip("[]") or "0.0.0.0"
    try:
        p = int(port)
    except ValueError:
        raise ConfigError(f"metrics address {text!r}: need HOST:PORT") from None
    if not 0 <= p <= 65535:
        raise ConfigError(f"metrics address {text!r}: port out of range")
    return host, p


def parse_optimizer(text: str) -> OptimizerConfig:
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
    except ValueError as e:  # json, float() and ConfigError all are ValueErrors
        raise ConfigError(f"bad optimizer {text!r}: {e}") from None


def _bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{text!r} is not a boolean (1/0, true/false, yes/no)")


def _optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    return lambda text: None if text.strip() == "" else parse(text)


def parse_shard(text: str) -> str:
    """``I/N`` (0 <= I < N), or "" for an unsharded server."""
    text = text.strip()
    if not text:
        return ""
    i, sep, n = text.partition("/")
    if not (sep and i.isdigit() and n.isdigit() and 0 <= int(i) < int(n)):
        raise ValueError(f"{text!r}: a shard is I/N with 0 <= I < N, e.g. 0/2")
    return f"{int(i)}/{int(n)}"


def shard_position(shard: str) -> tuple[int, int] | None:
    """A ``--shard`` label as :func:`parse_shard` left it, as ``(index, count)``; None
    for an unsharded server ("")."""
    if not shard:
        return None
    i, _, n = shard.partition("/")
    return int(i), int(n)


def parse_shards(text: str) -> str:
    """``N`` (>= 1), ``auto``, or "" (no supervisor: this process is the server)."""
    text = text.strip().lower()
    if text in ("", "auto"):
        return text
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"{text!r}: --shards is a count >= 1, or auto")
    return str(int(text))


def _is_shards(v: Any) -> bool:
    try:
        return isinstance(v, str) and parse_shards(v) == v
    except ValueError:
        return False


def _is_shard(v: Any) -> bool:
    try:
        return isinstance(v, str) and parse_shard(v) == v
    except ValueError:
        return False


def _metrics(text: str) -> str | None:
    if not text.strip():
        return None
    parse_bind(text)
    return text


# ------------------------------------------------------------------ declarations
Check = Callable[[Any], bool]


def setting(default: Any = dataclasses.MISSING, *, help: str, parse: Callable[[str], Any] | None = None,
            check: tuple[Check, str] | None = None, flag: str | None = None, factory: Callable[[], Any] | None = None,
            choices: tuple[str, ...] | None = None, show: str | None = None, metavar: str | None = None) -> Any:
    """A configuration field: ``default`` (or ``factory``), its ``help``, how a flag or
    environment value is parsed (``parse``; from the default's type if omitted), a
    ``check`` (predicate, what it requires), the ``flag`` if not the field's name
    (under its struct's prefix), ``choices``, and ``show``: how ``--help`` prints a
    default that is not a plain value."""
    meta = {"help": help, "parse": parse, "check": check, "flag": flag, "choices": choices, "show": show,
            "metavar": metavar}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def at_least(lo: float) -> tuple[Check, str]:
    return (lambda v: v >= lo, f">= {lo:g}")


def _finite_at_least(lo: float) -> tuple[Check, str]:
    return (lambda v: math.isfinite(v) and v >= lo, f"a finite number >= {lo:g}")


def _optional_finite_at_least(lo: float) -> tuple[Check, str]:
    return (lambda v: v is None or (math.isfinite(v) and v >= lo), f"a finite number >= {lo:g} (or unset)")


def _validate(obj: Any) -> None:
    for f in dataclasses.fields(obj):
        check = f.metadata.get("check")
        if check is not None and not check[0](getattr(obj, f.name)):
            raise ConfigError(f"{_flag_of(type(obj), f)}={getattr(obj, f.name)!r}: must be {check[1]}")
        choices = f.metadata.get("choices")
        if choices is not None and getattr(obj, f.name) not in choices:
            raise ConfigError(f"{_flag_of(type(obj), f)}={getattr(obj, f.name)!r}: must be one of {list(choices)}")


def default_max_model_bytes() -> int:
    """Half the machine's physical memory (16 GiB where it cannot be read): room for the
    model's parameters and optimizer state, with the other half for the pushes, pulls
    and snapshots in flight and for everything else on the host."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 16 << 30


# ------------------------------------------------------------------ the structs
@dataclass(frozen=True)
class Limits:
    """Resource bounds on what peers can make the server hold (README "Limits")."""

    max_message_bytes: int = setting(1 << 30, check=at_least(1024), show="1 GiB",
                                     help="largest accepted message, bytes: a larger one is answered `oversized`, "
                                          "its host's connections are cut and its key refused for "
                                          "--oversized-ban-s")
    oversized_ban_s: float = setting(60.0, check=_finite_at_least(0),
                                     help="seconds a key is refused after it sent an oversized message (its "
                                          "host's connections are cut too); 0: neither")
    max_workers: int = setting(256, help="live workers at most; a join beyond is refused", check=at_least(1))
    max_workers_per_key: int = setting(8, help="live workers holding one client key (a site's machines or GPUs)",
                                       check=at_least(1))
    max_waiting_pulls: int = setting(8, help="pulls per worker waiting for a future version", check=at_least(1))
    max_queued_pushes: int = setting(4, help="pushes per worker waiting for their step", check=at_least(1))
    max_queued_push_bytes: int = setting(256 << 20, check=at_least(0), show="256 MiB",
                                         help="bytes of pushes per worker waiting for their step; a push to an "
                                              "empty queue is always taken (--max-message-bytes bounds it)")
    max_model_bytes: int = setting(factory=default_max_model_bytes, check=at_least(1), show="half the physical memory",
                                   help="parameters plus optimizer state of the registered model, checked before "
                                        "allocating")
    # bounds no real job reaches (README "Limits"), on by default; '' turns one off
    max_lr: float | None = setting(100.0, parse=_optional(float), check=_optional_finite_at_least(0),
                                   help="largest lr a registration, set_optimizer or push may ask for; '': none")
    max_weight_decay: float | None = setting(10.0, parse=_optional(float), check=_optional_finite_at_least(0),
                                             help="largest weight_decay; '': none")
    min_eps: float | None = setting(1e-16, parse=_optional(float), check=_optional_finite_at_least(0),
                                    help="smallest Adam eps; '': none")
    max_push_norm: float = setting(0.0, check=_finite_at_least(0),
                                   help="L2 norm bound of one push's values; 0: none")
    push_norm_action: str = setting("refuse", choices=PUSH_NORM_ACTIONS,
                                    help="a push above --max-push-norm: refuse it, or clip it to the bound")
    max_sample_ratio: float = setting(8.0, check=_finite_at_least(1),
                                      help="in a step, the largest weight a push's samples give it over the "
                                           "smallest's (docs/optimizer.md, weighting by samples)")
    push_norm_factor: float = setting(10.0, check=_finite_at_least(0),
                                      help="clip a push whose L2 norm is above this many times the median of the "
                                           "job's recent pushes; 0: never")
    max_push_change: float = setting(1.0, check=_finite_at_least(0),
                                     help="until the job's recent pushes are known (its first 8, and after a "
                                          "restart), clip a push that could change the model by more than this "
                                          "many times the model's L2 norm (SGD: lr / (1 - momentum) times the "
                                          "push's norm); 0: never")

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def optimizer_limits(self) -> OptimizerLimits:
        """The hyper-parameter bounds, as :meth:`OptimizerLimits.check` applies them."""
        return OptimizerLimits(self.max_lr, self.max_weight_decay, self.min_eps)


HEARTBEAT_MAX_S = 1.0


@dataclass(frozen=True)
class Liveness:
    """When a worker counts as gone (README "Operations")."""

    timeout: float = setting(20.0, check=_finite_at_least(0),
                             help="declare a worker gone when neither a request nor a heartbeat came from it for "
                                  "this many seconds (a joined one not yet registered nor asked for the model's "
                                  "values: no request); 0: never")

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def heartbeat_s(self) -> float:
        """How often clients send a heartbeat (the ``joined`` reply says it); 0: never. At
        most a second: a worker cut off is *silent* after 1.5 of them (the steps stop waiting
        for it), long before the liveness timeout declares it gone."""
        return min(self.timeout / 4, HEARTBEAT_MAX_S) if self.timeout > 0 else 0.0


@dataclass(frozen=True)
class Deadline:
    """How long an open step waits for missing workers (aggregation.AdaptiveDeadline)."""

    fixed: float = setting(0.0, flag="step-deadline", check=_finite_at_least(0),
                           help="close a step this many seconds after its first push even if workers are missing; "
                                "0: the adaptive deadline (or wait for all, with --no-adaptive-deadline)")
    adaptive: bool = setting(True, flag="adaptive-deadline",
                             help="without --step-deadline, close a step missing workers after the deadline learnt "
                                  "from push arrivals")
    min: float = setting(1.0, check=(lambda v: math.isfinite(v) and v > 0, "> 0"),
                         help="adaptive deadline's lower bound, seconds")
    max: float = setting(60.0, check=_finite_at_least(0),
                         help="adaptive deadline's upper bound, and its value until learnt, seconds")
    quantile: float = setting(0.9, check=(lambda v: 0 < v <= 1, "in (0, 1]"),
                              help="quantile of recent arrival spreads")
    factor: float = setting(3.0, check=(lambda v: math.isfinite(v) and v > 0, "> 0"),
                            help="multiple of that quantile")

    def __post_init__(self) -> None:
        _validate(self)
        if self.min > self.max:
            raise ConfigError(f"--deadline-min {self.min:g} is above --deadline-max {self.max:g}")


@dataclass(frozen=True)
class Checkpoints:
    """Where and when the server writes checkpoints (checkpoints.py)."""

    dir: str | None = setting(None, parse=_optional(str), metavar="DIR",
                              help="write checkpoints here, and resume from the newest valid one on start; "
                                   "unset: no checkpoints")
    every_steps: int = setting(0, check=at_least(0), help="a checkpoint every this many steps; 0: not by steps")
    every_s: float = setting(300.0, check=_finite_at_least(0),
                             help="a checkpoint every this many seconds; 0: not by time")
    keep: int = setting(3, check=at_least(1), help="valid checkpoints kept (older ones are deleted)")

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True)
class Pulls:
    """What a pull carries (store.py, broadcast.py, docs/optimizer.md "The broadcast")."""

    mode: PullMode = setting("broadcast", flag="pull", choices=("broadcast", "exact"),
                        help="broadcast: one compressed message per step for all workers, what the server did not "
                             "send kept in its residual (pull bytes do not grow with the workers); exact: the union "
                             "of every worker's pushed coordinates with their float32 values")
    values: ValueDtype = setting("q4", flag="broadcast-values", choices=("f32", "f16", "bf16", "q4", "q2"),
                          help="the broadcast's value coding (the coding's error stays in the server's residual)")
    factor: float = setting(2.0, flag="broadcast-factor", check=(lambda v: math.isfinite(v) and v > 0, "> 0"),
                            help="coordinates a broadcast carries per tensor, as a multiple of the mean count of "
                                 "the step's pushes (a q4/q2 push's coordinates counted by their bits against f16's)")

    def __post_init__(self) -> None:
        _validate(self)

    def broadcast_info(self) -> BroadcastInfo | None:
        """What workers and planners are told of the broadcast (None: exact pulls)."""
        from stella.protocol import BroadcastInfo

        if self.mode != "broadcast":
            return None
        return BroadcastInfo(values=self.values, factor=self.factor)


@dataclass(frozen=True)
class Shards:
    """One command for the shards of one job on this host (supervisor.py, README "Many cores on one host")."""

    count: str = setting("", flag="shards", parse=parse_shards, check=(_is_shards, "a count >= 1, or auto"),
                         metavar="N|auto",
                         help="start N shard servers of one job on this host and keep them running (shard I: "
                              "`--shard I/N` on the --bind port + I, --metrics port + I, --checkpoint-dir DIR/I, "
                              "its share of --threads and of the cores); workers and `stella status` need only the "
                              "first address. auto: a shard per core this process may use (the count of the job "
                              "in --checkpoint-dir when it holds one); '': this process is the server")
    advertise: str | None = setting(None, parse=_optional(str), metavar="HOST",
                                    help="with --shards: the host workers reach the shards at, in the list the "
                                         "first shard hands them; unset: the host each worker reached the first "
                                         "shard at (needs no configuration behind NAT or published ports)")
    pin: bool = setting(True, flag="pin-shards",
                        help="with --shards: each shard on cores of its own (its share of the cores this process "
                             "may use), when there are at least as many cores as shards")

    def __post_init__(self) -> None:
        _validate(self)


# a struct's flags are its fields' names under a prefix (unless a field names its own flag)
_PREFIX = {Limits: "", Liveness: "liveness-", Deadline: "deadline-", Checkpoints: "checkpoint-", Pulls: "",
           Shards: ""}


@dataclass(frozen=True)
class ServerConfig:
    """Everything the daemon can be told, validated. ``bind`` may use port 0 for an
    ephemeral port."""

    bind: str = setting("tcp://0.0.0.0:5555", help="ZeroMQ endpoint to listen on")
    workers: int = setting(1, check=at_least(1),
                           help="workers that must have registered before the first step closes (a resumed job "
                                "does not wait for them again)")
    optimizer: OptimizerConfig = setting(DEFAULT_OPTIMIZER, parse=parse_optimizer, show="sgd (PyTorch's defaults)",
                                         help="the server's optimizer when a registration names none, e.g. "
                                              "'adamw:lr=0.001,weight_decay=0.01' or JSON (update-mode workers "
                                              "always name their outer step)")
    threads: int = setting(0, check=at_least(0),
                           help="threads for a step's work (apply, the broadcast's selection and coding; from 4, "
                                "the broadcast's pass over a large residual in ranges too): 0 takes the cores this "
                                "process may use, up to 8; 1 does it all on the store thread")
    io_batch: bool = setting(True, help="ZeroMQ's I/O thread under the SCHED_BATCH policy (Linux), so that a reply "
                                        "sent does not switch to it and back before the next message is read: 60% "
                                        "fewer context switches and 7-17% less CPU a step on a 100k-parameter model")
    dense_below: int = setting(4096, check=at_least(0),
                               help="tensors with fewer elements (biases, norms) travel whole, in pushes and in the "
                                    "broadcast: the model is laid out flat with them last (stella.layout); workers "
                                    "take it from the server")
    history: int = setting(64, check=at_least(1),
                           help="applied steps remembered for delta pulls; an older `since` gets a snapshot")
    log_level: str = setting("INFO", parse=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="log level")
    log_format: str = setting("json", choices=("json", "text"), help="log lines as JSON objects or as text")
    ready_file: str | None = setting(None, parse=_optional(str), metavar="PATH",
                                     help="write the bound endpoint to this file once listening (scripts, tests)")
    keys: str | None = setting(None, parse=_optional(str), metavar="PATH",
                               help="the server's key pair: the '.key_secret' certificate `stella keygen` writes "
                                    "(required unless --insecure)")
    allow: str | None = setting(None, parse=_optional(str), metavar="PATH",
                                help="allowlist of client public keys, one Z85 key per line; re-read on change and "
                                     "on SIGHUP (required unless --insecure)")
    insecure: bool = setting(False, help="plaintext and no authentication: anyone who reaches the port can read the "
                                         "traffic and change the model")
    metrics: str | None = setting(None, parse=_metrics, metavar="HOST:PORT",
                                  help="serve Prometheus metrics (/metrics) and a health check (/healthz) over HTTP "
                                       "here, e.g. 0.0.0.0:9100; unset: off")
    shard: str = setting("", parse=parse_shard, check=(_is_shard, "I/N with 0 <= I < N"), metavar="I/N",
                         help="this server is shard I of N of a sharded job (clients list the N addresses in shard "
                              "order; a label for status and metrics, and the clients' check of that order)")
    shard_list: str | None = setting(None, parse=_optional(str), metavar="PATH",
                                     help="a file of the job's shard addresses in shard order, one a line "
                                          "(tcp://HOST:PORT; host `*`: the host a client reached this server at), "
                                          "handed to workers and `stella status` so that one address reaches "
                                          "the whole job; read again when it changes (--shards writes it)")
    limits: Limits = field(default_factory=Limits)
    liveness: Liveness = field(default_factory=Liveness)
    deadline: Deadline = field(default_factory=Deadline)
    checkpoints: Checkpoints = field(default_factory=Checkpoints)
    pulls: Pulls = field(default_factory=Pulls)
    shards: Shards = field(default_factory=Shards)

    def __post_init__(self) -> None:
        _validate(self)
        if self.metrics is not None:
            parse_bind(self.metrics)
        if self.shards.count:
            if self.shard or self.shard_list:
                raise ConfigError("--shards starts the shards of a job and labels them itself: it takes neither "
                                  "--shard nor --shard-list (those are for a shard started on its own)")
            if not (self.bind.startswith("tcp://") and self.bind.rpartition(":")[2].isdigit()):
                raise ConfigError(f"--shards needs a TCP --bind with a port (shard I on the port + I), "
                                  f"not {self.bind!r}")
        try:  # the server's own default must obey the operator's bounds
            self.limits.optimizer_limits.check(self.optimizer)
        except ConfigError as e:
            raise ConfigError(f"--optimizer {self.optimizer.to_wire()}: {e}") from None


# ------------------------------------------------------------------ generated: flags and environment
def _default(f: dataclasses.Field[Any]) -> Any:
    """A field's default value (its factory called if it has one)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    assert callable(f.default_factory)
    return f.default_factory()


def _groups() -> dict[str, type]:
    """``ServerConfig``'s sub-structs by field name."""
    out: dict[str, type] = {}
    for f in dataclasses.fields(ServerConfig):
        if "help" not in f.metadata:
            assert isinstance(f.default_factory, type)
            out[f.name] = f.default_factory
    return out


def _flag_of(struct: type, f: dataclasses.Field[Any]) -> str:
    return "--" + (f.metadata.get("flag") or _PREFIX.get(struct, "") + f.name.replace("_", "-"))


def _settings() -> Iterator[tuple[str | None, type, dataclasses.Field[Any]]]:
    """``(group field or None, struct, field)`` for every setting, in declaration order."""
    groups = _groups()
    for f in dataclasses.fields(ServerConfig):
        if f.name in groups:
            for g in dataclasses.fields(groups[f.name]):
                yield f.name, groups[f.name], g
        else:
            yield None, ServerConfig, f


def _env_name(flag: str) -> str:
    return ENV_PREFIX + flag[2:].replace("-", "_").upper()


ENV: dict[str, str] = {_flag_of(s, f)[2:]: _env_name(_flag_of(s, f)) for _, s, f in _settings()}
"""Every setting's environment variable, by flag name (``"checkpoint-dir": "STELLA_PS_CHECKPOINT_DIR"``)."""


def _parser_of(f: dataclasses.Field[Any]) -> Callable[[str], Any]:
    parse: Callable[[str], Any] | None = f.metadata.get("parse")
    if parse is not None:
        return parse
    default = _default(f)
    return _bool if isinstance(default, bool) else type(default)


def _shown(f: dataclasses.Field[Any], value: Any) -> str:
    if f.metadata.get("show") and value == _default(f):
        return str(f.metadata["show"])
    return "unset" if value is None else repr(value) if isinstance(value, str) else str(value)


def parse_args(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> ServerConfig:
    """The configuration from ``argv`` (default ``sys.argv``) and the environment;
    exits with a usage error naming the flag or variable on bad input."""
    env = os.environ if environ is None else environ
    p = argparse.ArgumentParser(
        prog="stella-ps",
        description="Stella parameter server: stores the model and optimizer state, aggregates sparse pushes and "
                    "serves pulls of what changed. Every flag has an environment variable (shown in its help); "
                    "precedence: flag > environment > default.")
    defaults: dict[str, Any] = {}
    for group, struct, f in _settings():
        flag = _flag_of(struct, f)
        name, var, parse = flag[2:].replace("-", "_"), _env_name(flag), _parser_of(f)
        if var in env:
            try:
                default = parse(env[var])
            except (ValueError, TypeError) as e:
                p.error(f"environment {var}={env[var]!r}: {e}")
        else:
            default = _default(f)
        defaults[name] = (group, f.name)

        def checked(text: str, parse: Callable[[str], Any] = parse) -> Any:
            try:
                return parse(text)
            except ConfigError as e:
                raise argparse.ArgumentTypeError(str(e)) from None

        help_text = f"{f.metadata['help']} (default: {_shown(f, default)}; env {var})".replace("%", "%%")
        if isinstance(default, bool) or parse is _bool:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            p.add_argument(flag, dest=name, type=checked, default=default, choices=f.metadata.get("choices"),
                           metavar=f.metadata.get("metavar"), help=help_text)
    a = vars(p.parse_args(argv))
    top: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    for name, (group, field_name) in defaults.items():
        (top if group is None else groups.setdefault(group, {}))[field_name] = a[name]
    try:
        cfg = ServerConfig(**top, **{g: _groups()[g](**kw) for g, kw in groups.items()})
    except ConfigError as e:
        p.error(str(e))
    if not cfg.insecure and not (cfg.keys and cfg.allow):
        p.error("stella-ps needs --keys SERVER.key_secret and --allow ALLOWLIST (make them with `stella keygen`), "
                "or --insecure to run without encryption and authentication")
    return cfg


# ------------------------------------------------------------------ generated: the README's table
README_BEGIN = "<!-- stella-ps settings: generated by `python -m stella_ps.config` -->"
README_END = "<!-- end of stella-ps settings -->"


def markdown_table() -> str:
    """Every setting as a Markdown table row (flag, environment variable, default, meaning):
    README "Configuration" holds exactly this between :data:`README_BEGIN` and
    :data:`README_END` (a test checks it)."""
    rows = ["| flag | environment | default | meaning |", "| --- | --- | --- | --- |"]
    for _, struct, f in _settings():
        flag = _flag_of(struct, f)
        shown_flag = f"`{flag}` / `--no-{flag[2:]}`" if isinstance(_default(f), bool) else f"`{flag}`"
        meaning = str(f.metadata["help"]).replace("|", "\\|")
        rows.append(f"| {shown_flag} | `{_env_name(flag)}` | {_shown(f, _default(f))} | {meaning} |")
    return "\n".join([README_BEGIN, *rows, README_END])


def readme_with_table(text: str) -> str:
    """``text`` (the README) with its settings table replaced by :func:`markdown_table`."""
    start, end = text.index(README_BEGIN), text.index(README_END) + len(README_END)
    return text[:start] + markdown_table() + text[end:]


if __name__ == "__main__":  # python -m stella_ps.config [README.md]: print the table, or rewrite it there
    import sys

    if len(sys.argv) > 1:
        with open(sys.argv[1]) as fh:
            body = readme_with_table(fh.read())
        with open(sys.argv[1], "w") as fh:
            fh.write(body)
    else:
        print(markdown_table())
