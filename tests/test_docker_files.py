"""docker/ without an engine: the compose files parse and say what the deployment
promises (keys as files, never in the environment; checkpoints on the server's volume;
an allowlist mounted as a directory; CPU worker sites with a GPU override; workers under
an init process; shaped lab sites), the Dockerfiles are multi-stage, pinned and non-root
where they should be, the entrypoints handle their arguments, and the example train.py
stops cleanly on SIGTERM against a real server. ``make docker-test`` runs the real
thing where an engine answers."""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml

from stella.cli import main as stella_main
from stella_ps.config import ENV, parse_args, parse_bind

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKER = os.path.join(ROOT, "docker")
COMPOSE_FILES = ("compose.server.yml", "compose.worker.yml", "compose.shards.yml")  # a site each
OVERRIDES = ("compose.worker.gpu.yml", "compose.lab.yml")  # added to compose.worker.yml
KEY_SETTINGS = ("STELLA_PS_KEYS", "STELLA_PS_ALLOW", "STELLA_SERVER_KEY", "STELLA_CLIENT_KEY")
SERVER_KEYS_DIR = "/etc/stella/keys"
SETTINGS = frozenset(ENV.values())  # every STELLA_PS_ variable stella-ps reads
# the only server settings a compose file may set: what its own mounts, ports and services fix
COMPOSE_OWNS = {"STELLA_PS_KEYS": "the keys' mount", "STELLA_PS_ALLOW": "the keys' mount",
                "STELLA_PS_METRICS": "the metrics port published",
                "STELLA_PS_SHARDS": "the sharded site's one command"}


def load(name: str) -> dict:
    with open(os.path.join(DOCKER, name)) as f:
        return yaml.safe_load(f)


def defaults(value: str) -> str:
    """A compose value with every ``${VAR:-default}``/``${VAR-default}`` at its default."""
    return re.sub(r"\$\{\w+:?-([^}]*)\}", r"\1", str(value))


def environment(svc: dict) -> dict[str, str | None]:
    """A service's ``environment:``, as a map or a list (``K=V``, or ``K`` alone: None)."""
    env = svc.get("environment") or {}
    if isinstance(env, list):
        return {k: (v if sep else None) for k, sep, v in (str(e).partition("=") for e in env)}
    return dict(env)


def server_default() -> object:
    return parse_args(["--insecure"], {})


def image_env() -> dict[str, str]:
    """The STELLA_PS_ settings server.Dockerfile's ``ENV`` gives the server."""
    with open(os.path.join(DOCKER, "server.Dockerfile")) as f:
        return dict(re.findall(r"^(?:ENV)?\s*(STELLA_PS_\w+)=(\S*?)\s*\\?$", f.read(), re.M))


def env_settings(name: str) -> dict[str, str]:
    """The settings an env file sets (its uncommented ``K=V`` lines)."""
    with open(os.path.join(DOCKER, name)) as f:
        return dict(re.findall(r"^(\w+)=(.*)$", f.read(), re.M))


def server_environment(svc: dict, env_file: str = "server.env.example") -> dict[str, str]:
    """What the server of ``svc`` reads: the image's ENV, under the env file compose passes
    (``env_file``), under the service's ``environment:``."""
    assert svc["env_file"] == "${STELLA_ENV_FILE:-server.env}"
    return {**image_env(), **env_settings(env_file), **{k: str(v) for k, v in environment(svc).items()}}


def redeclared(text: str) -> list[str]:
    """What a compose file's ``text`` declares of the server's settings that is not its
    own (:data:`COMPOSE_OWNS`): a setting with a value of its own, a default (``${...:-x}``,
    or the server's default written out), a variable that is a second name for a
    setting (``STELLA_X`` beside ``STELLA_PS_X``) or a ``STELLA_PS_`` variable of its
    own; and a server service that does not take the env file."""
    found = []
    for name, svc in (yaml.safe_load(text).get("services") or {}).items():
        env = environment(svc)
        if "stella-ps" in str(svc.get("image")) and "env_file" not in svc:
            found.append(f"{name}: no env_file (the server's settings come from the user's env file)")
        for k, v in env.items():
            if not k.startswith("STELLA_PS_"):
                continue
            if k not in COMPOSE_OWNS:
                found.append(f"{name}: {k}={v!r}: a server setting declared in compose (the env file's)")
            elif v is None or "$" in str(v):
                found.append(f"{name}: {k}={v!r}: interpolated (a second default or name)")
            elif parse_args(["--insecure"], {k: str(v)}) == server_default():
                found.append(f"{name}: {k}={v!r}: the server's own default, written again")
    for var in re.findall(r"\$\{?(STELLA_\w+)", text):
        if var.startswith("STELLA_PS_"):
            found.append(f"${{{var}}}: a compose variable in the server's namespace")
        elif "STELLA_PS_" + var[len("STELLA_"):] in SETTINGS:
            found.append(f"${{{var}}}: a second name for STELLA_PS_{var[len('STELLA_'):]}")
    return found


def mounts(svc: dict) -> dict[str, str]:
    """A service's volumes (``SOURCE:TARGET[:MODE]``, the source perhaps a ``${VAR:-...}``):
    target -> source."""
    out = {}
    for v in svc.get("volumes", []):
        v = re.sub(r":(ro|rw)$", "", v)
        source, _, target = v.rpartition(":")
        out[target] = source
    return out


@pytest.mark.parametrize("name", COMPOSE_FILES + OVERRIDES)
def test_compose_file_parses_for_1_29_and_v2(name):
    doc = load(name)
    # 1.29 refuses a top-level `name:`; `version:` is obsolete in v2: neither appears
    assert "name" not in doc and "version" not in doc
    assert set(doc) <= {"services", "secrets", "volumes", "networks"} | {k for k in doc if k.startswith("x-")}
    for svc_name, svc in doc["services"].items():
        if name in COMPOSE_FILES:
            assert "image" in svc and "restart" in svc, svc_name
        env = svc.get("environment") or {}
        for k, v in env.items():  # keys travel as files: the environment only names them
            if k in KEY_SETTINGS:
                assert str(v).startswith(("/run/secrets/", SERVER_KEYS_DIR + "/")), (svc_name, k, v)
    for secret in (doc.get("secrets") or {}).values():
        assert set(secret) == {"file"}, secret


def test_server_site_writes_checkpoints_to_its_volume():
    """Issue 24, 1: the image turns checkpoints on, on the volume the compose file mounts;
    their intervals are the server's own defaults unless the env file sets them."""
    with open(os.path.join(DOCKER, "server.Dockerfile")) as f:
        text = f.read()
    volume = re.search(r'^VOLUME \["([^"]+)"\]', text, re.M).group(1)
    assert image_env()["STELLA_PS_CHECKPOINT_DIR"] == volume, "the image's default"
    ps = load("compose.server.yml")["services"]["ps"]
    assert mounts(ps)[volume] == "checkpoints"
    cfg = parse_args([], server_environment(ps))
    assert cfg.checkpoints.dir == volume
    assert dataclasses.replace(cfg.checkpoints, dir=None) == server_default().checkpoints  # the server's intervals
    # an empty STELLA_PS_CHECKPOINT_DIR in the env file turns them off (env_file wins over the image)
    assert parse_args([], {**server_environment(ps), "STELLA_PS_CHECKPOINT_DIR": ""}).checkpoints.dir is None
    # the volume belongs to the image's user (a named volume starts as a copy of it)
    assert "chown -R stella:stella /var/lib/stella" in text and volume.startswith("/var/lib/stella/")


def test_the_sharded_server_site_is_one_command_for_a_shard_a_core():
    """Issue 44: one service runs ``stella-ps --shards auto``, a shard per core the container
    may use, on the host's network (the shards' ports, however many, are the host's: 5555 + I,
    metrics on the host's loopback, 9100 + I), every shard's checkpoints in the one volume
    (DIR/I); the keys' directory and the rest of the configuration are the single server's,
    from the same env file."""
    single = load("compose.server.yml")["services"]["ps"]
    doc = load("compose.shards.yml")
    (svc,) = doc["services"].values()
    cfg = parse_args([], server_environment(svc))
    assert cfg.shards.count == "auto" and cfg.shard == "" and cfg.shards.pin
    assert svc["network_mode"] == "host" and "ports" not in svc
    assert cfg.bind == "tcp://0.0.0.0:5555" and parse_bind(cfg.metrics) == ("127.0.0.1", 9100)
    assert cfg.checkpoints.dir and mounts(svc)[cfg.checkpoints.dir] == "checkpoints" and set(doc["volumes"]) == {
        "checkpoints"}
    assert defaults(mounts(svc)[SERVER_KEYS_DIR]) == "./keys"
    assert svc["env_file"] == single["env_file"] and svc["restart"] == single["restart"]
    own = ("STELLA_PS_SHARDS", "STELLA_PS_METRICS")
    assert {k: v for k, v in svc["environment"].items() if k not in own} == {
        k: v for k, v in single["environment"].items() if k not in own}


@pytest.mark.parametrize("name", COMPOSE_FILES + OVERRIDES)
def test_compose_files_leave_the_servers_settings_to_the_server(name):
    """Architecture review 2.3: every server setting is declared once, in stella_ps.config.
    A compose file passes the user's env file to the server (`env_file`) and sets only
    what its own mounts, ports and services fix: no default of its own, no second name
    (``${STELLA_CHECKPOINT_EVERY_S:-300}`` beside STELLA_PS_CHECKPOINT_EVERY_S)."""
    with open(os.path.join(DOCKER, name)) as f:
        text = f.read()
    assert redeclared(text) == []
    assert not re.findall(r"STELLA_PS_[A-Z_]+: \$\{", text)  # the review's grep


@pytest.mark.parametrize("snippet,why", [
    ("STELLA_PS_WORKERS: ${STELLA_WORKERS:-2}", "a server setting declared in compose"),
    ("STELLA_PS_LOG_LEVEL: ${STELLA_PS_LOG_LEVEL:-INFO}", "a server setting declared in compose"),
    ("STELLA_PS_CHECKPOINT_KEEP: 3", "a server setting declared in compose"),
    ("STELLA_PS_METRICS: ${STELLA_METRICS:-0.0.0.0:9100}", "interpolated"),
    ("STELLA_PS_SHARDS: ''", "the server's own default"),
    ("X_RETRIES: ${STELLA_CHECKPOINT_KEEP:-3}", "a second name for STELLA_PS_CHECKPOINT_KEEP"),
    ("X_PORT: ${STELLA_PS_PUBLISH:-5555}", "a compose variable in the server's namespace")])
def test_a_redeclared_setting_is_found(snippet, why):
    """The check above finds each way a compose file could declare a setting again."""
    text = ("services:\n  ps:\n    image: stella-ps:0.1.0\n    env_file: server.env\n    environment:\n"
            f"      STELLA_PS_KEYS: /etc/stella/keys/server.key_secret\n      {snippet}\n")
    found = redeclared(text)
    assert found and why in " ".join(found), found
    assert "no env_file" in " ".join(redeclared(text.replace("    env_file: server.env\n", "")))
    assert redeclared(text.replace(snippet, "")) == []


def test_every_stella_ps_name_in_docker_is_a_setting():
    """A STELLA_PS_ name anywhere under docker/ (compose, env files, Dockerfiles, scripts,
    docs) is one stella-ps reads (stella_ps.config.ENV): a misspelt or invented one would
    be passed to the server and silently ignored."""
    found: dict[str, set[str]] = {}
    for dirpath, dirs, files in os.walk(DOCKER):
        dirs[:] = [d for d in dirs if d not in ("wheelhouse", "keys")]
        for name in files:
            if name.endswith(".env") and name != "lab.env":  # a user's own env files (ignored by git)
                continue
            try:
                with open(os.path.join(dirpath, name)) as f:
                    text = f.read()
            except UnicodeDecodeError:
                continue
            for var in re.findall(r"\bSTELLA_PS_[A-Z0-9_]*[A-Z0-9]\b", text):
                found.setdefault(var, set()).add(os.path.relpath(os.path.join(dirpath, name), DOCKER))
    assert found and not {v: f for v, f in found.items() if v not in SETTINGS}


@pytest.mark.parametrize("name", ["server.env.example", "lab.env"])
def test_env_files_set_only_what_they_mean_to(name):
    """An env file lists the server's settings commented out, without values (`stella-ps
    --help` has them); one it sets differs from the server's default; no second names."""
    with open(os.path.join(DOCKER, name)) as f:
        text = f.read()
    for var in re.findall(r"^#?\s*(STELLA_\w+)=", text, re.M):
        assert var.startswith("STELLA_PS_") or "STELLA_PS_" + var[len("STELLA_"):] not in SETTINGS, var
    assert re.findall(r"^#(STELLA_PS_\w+)=(.+)$", text, re.M) == []  # no copies of defaults
    for k, v in env_settings(name).items():
        if k.startswith("STELLA_PS_"):
            assert parse_args(["--insecure"], {k: v}) != server_default(), f"{k}={v} is the server's default"


def test_the_server_image_sets_only_what_differs_from_the_defaults():
    env = image_env()
    assert {"STELLA_PS_KEYS", "STELLA_PS_ALLOW", "STELLA_PS_METRICS", "STELLA_PS_CHECKPOINT_DIR"} <= set(env)
    for k, v in env.items():
        assert parse_args(["--insecure"], {k: v}) != server_default(), f"{k}={v} is the server's default"


def test_the_allowlist_is_mounted_as_a_directory():
    """Issue 24, 2: a single-file mount pins the inode; `sed -i` and editors replace the
    file. The server site mounts the keys' directory and reads the allowlist there."""
    ps = load("compose.server.yml")["services"]["ps"]
    allow, keys = ps["environment"]["STELLA_PS_ALLOW"], ps["environment"]["STELLA_PS_KEYS"]
    target = os.path.dirname(allow)
    assert target == os.path.dirname(keys) == SERVER_KEYS_DIR
    assert defaults(mounts(ps)[target]) == "./keys"  # STELLA_KEYS_DIR
    assert f":{target}:ro" in str(ps["volumes"])  # read-only
    assert "secrets" not in ps and "secrets" not in load("compose.server.yml")


def test_worker_sites_run_on_cpu_and_the_gpu_override_reserves_one_each():
    """Issue 24, 3: compose.worker.yml asks for no GPU (1.29 cannot remove `deploy:` in an
    override), compose.worker.gpu.yml adds one per worker."""
    workers = load("compose.worker.yml")["services"]
    gpus = load("compose.worker.gpu.yml")["services"]
    assert len(workers) >= 2 and set(gpus) == set(workers)
    ids = []
    for name, w in workers.items():
        assert "deploy" not in w and "runtime" not in w, name
        assert w["environment"]["STELLA_CLIENT_KEY"] == "/run/secrets/client_key"
        (dev,) = gpus[name]["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
        ids += dev["device_ids"]
    assert len(set(ids)) == len(ids)  # a GPU each
    ps = load("compose.server.yml")["services"]["ps"]
    assert any("127.0.0.1:9100" in p for p in ps["ports"])


def test_workers_run_under_an_init_that_passes_sigterm_on():
    """Issue 24, 4: a training script as PID 1 never sees SIGTERM; `init: true` passes it on."""
    for name, w in load("compose.worker.yml")["services"].items():
        assert w["init"] is True, name
        assert defaults(w["command"]) == "python /work/train.py"
        assert mounts(w)["/work"] == "${STELLA_TRAIN_DIR:-./train}"
    assert os.path.exists(os.path.join(DOCKER, "train", "train.py"))  # the default STELLA_TRAIN_DIR holds one


def test_lab_sites_are_shaped_and_come_back():
    """The lab runs compose.worker.yml with compose.lab.yml: every worker may shape its link."""
    workers = load("compose.worker.yml")["services"]
    lab = load("compose.lab.yml")["services"]
    assert set(lab) == set(workers)
    for name, w in workers.items():
        assert lab[name] == {"cap_add": ["NET_ADMIN"]}
        assert w["restart"] == "on-failure"
        assert w["environment"]["STELLA_SHAPE_RATE"].startswith("${STELLA_SHAPE_RATE")
        assert len(w["secrets"]) == 2  # the server's public key and the site's own pair only
    assert "cap_add" not in str(workers)  # production sites get no NET_ADMIN
    # every lab setting lab.py reads is in lab.env
    with open(os.path.join(DOCKER, "lab.py")) as f:
        used = set(re.findall(r'LAB\["(\w+)"\]', f.read()))
    with open(os.path.join(DOCKER, "lab.env")) as f:
        given = set(re.findall(r"^(\w+)=", f.read(), re.M))
    assert used and used <= given, used - given


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed")
@pytest.mark.parametrize("files,example", [(["compose.server.yml"], "server.env.example"),
                                           (["compose.shards.yml"], "server.env.example"),
                                           (["compose.worker.yml"], "worker.env.example"),
                                           (["compose.worker.yml", "compose.worker.gpu.yml"], "worker.env.example"),
                                           (["compose.worker.yml", "compose.lab.yml"], "worker.env.example")])
def test_docker_compose_reads_it(files, example):
    cmd = ["docker-compose", "--env-file", os.path.join(DOCKER, example)]
    for f in files:
        cmd += ["-f", os.path.join(DOCKER, f)]
    env = {**os.environ, "STELLA_ENV_FILE": os.path.join(DOCKER, example)}  # the server's env file
    p = subprocess.run([*cmd, "config"], capture_output=True, text=True, cwd=ROOT, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    services = yaml.safe_load(p.stdout)["services"]
    assert services
    for name, svc in services.items():  # the env file's server settings reach the server
        if "stella-ps" in svc["image"]:
            given = {k: v for k, v in env_settings(example).items() if k.startswith("STELLA_PS_")}
            assert given and given.items() <= svc["environment"].items(), name
    if "compose.worker.gpu.yml" not in files and "compose.worker.yml" in files:
        assert "nvidia" not in p.stdout  # a CPU site as it is


@pytest.mark.parametrize("name", ["server.Dockerfile", "worker.Dockerfile"])
def test_dockerfiles_are_multi_stage_and_pinned(name):
    with open(os.path.join(DOCKER, name)) as f:
        text = f.read()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M).group(1)
    assert re.search(r":\d+\.\d+", base) and "latest" not in base, base  # a pinned official image
    assert len(re.findall(r"^FROM ", text, re.M)) == 2 and "COPY --from=build" in text
    assert "--no-index --find-links /wheelhouse" in text
    if name == "server.Dockerfile":
        assert re.search(r"^USER stella$", text, re.M) and "HEALTHCHECK" in text and "VOLUME" in text
        assert '! /opt/stella/bin/python -c "import torch"' in text  # no torch in the server image


def test_dockerignore_lets_in_only_wheels_and_the_entrypoint():
    with open(os.path.join(DOCKER, ".dockerignore")) as f:
        rules = [r for r in f.read().splitlines() if r and not r.startswith("#")]
    assert rules[0] == "*" and all(r.startswith("!") for r in rules[1:])
    assert not any("key" in r or "env" in r for r in rules)


def _fake_tc(tmp_path, lacking: str = "") -> str:
    """A ``tc`` that logs its arguments and fails for those containing ``lacking``
    (a kernel without netem, police...)."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    tc = bindir / "tc"
    fail = f'case "$*" in *{lacking}*) exit 2;; esac\n' if lacking else ""
    tc.write_text(f"#!/bin/sh\n{fail}echo \"tc $*\" >> {tmp_path}/tc.log\n")
    tc.chmod(0o755)
    return str(bindir)


def entrypoint(env: dict, *cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", os.path.join(DOCKER, "worker-entrypoint.sh"), *cmd], capture_output=True,
                          text=True, env=env, timeout=30)


def test_worker_entrypoint_shapes_then_runs_the_command(tmp_path):
    env = {"PATH": _fake_tc(tmp_path) + ":" + os.environ["PATH"], "STELLA_RUN_AS_ROOT": "1",
           "STELLA_SHAPE_RATE": "20mbit", "STELLA_SHAPE_DELAY": "10ms"}
    p = entrypoint(env, "echo", "ran", "a b")
    assert p.returncode == 0, p.stderr
    assert p.stdout == "ran a b\n" and "eth0 shaped: uplink 20mbit +10ms, downlink 20mbit" in p.stderr
    tc = (tmp_path / "tc.log").read_text().splitlines()
    assert tc[0] == "tc qdisc replace dev eth0 root handle 1: netem delay 10ms"
    assert "tbf rate 20mbit" in tc[1] and "ingress" in tc[2] and "police rate 20mbit" in tc[3]
    # unshaped: no tc at all, the command's exit status comes through
    p = entrypoint({**env, "STELLA_SHAPE_RATE": ""}, "sh", "-c", "exit 3")
    assert p.returncode == 3 and len((tmp_path / "tc.log").read_text().splitlines()) == 4


@pytest.mark.parametrize("lacking", ["netem", "police"])
def test_worker_entrypoint_says_what_the_kernel_lacks(tmp_path, lacking):
    env = {"PATH": _fake_tc(tmp_path, lacking) + ":" + os.environ["PATH"], "STELLA_RUN_AS_ROOT": "1",
           "STELLA_SHAPE_RATE": "5mbit", "STELLA_SHAPE_DELAY": "10ms"}
    p = entrypoint(env, "true")
    assert p.returncode == 0, p.stderr
    tc = (tmp_path / "tc.log").read_text()
    assert "tbf rate 5mbit" in tc  # the uplink is always shaped
    assert ("no delay: this kernel has no netem" in p.stderr) == (lacking == "netem")
    assert ("downlink not shaped" in p.stderr) == (lacking == "police")


def test_worker_entrypoint_fails_when_the_uplink_cannot_be_shaped(tmp_path):
    env = {"PATH": _fake_tc(tmp_path, "tbf") + ":" + os.environ["PATH"], "STELLA_RUN_AS_ROOT": "1",
           "STELLA_SHAPE_RATE": "5mbit"}
    assert entrypoint(env, "echo", "never").returncode != 0


def test_server_entrypoint_reads_the_images_environment(monkeypatch):
    monkeypatch.setenv("STELLA_PS_METRICS", "0.0.0.0:9100")
    monkeypatch.setenv("STELLA_PS_BIND", "tcp://0.0.0.0:5555")
    cfg = parse_args(["--insecure"])
    assert cfg.metrics == "0.0.0.0:9100" and cfg.bind == "tcp://0.0.0.0:5555"
    assert parse_args(["--insecure", "--metrics", "127.0.0.1:0"]).metrics == "127.0.0.1:0"
    monkeypatch.delenv("STELLA_PS_METRICS")
    assert parse_args(["--insecure"]).metrics is None  # off unless asked for
    with pytest.raises(SystemExit):
        parse_args(["--insecure", "--metrics", "host:notaport"])


@pytest.mark.parametrize("argv", [["--server", "tcp://x:1", "--rank", "2", "--workers", "2"],
                                  ["--server", "tcp://x:1", "--rank", "-1"],
                                  ["--progress-every", "-1"]])
def test_demo_worker_arguments_are_checked(argv, capsys):
    with pytest.raises(SystemExit) as e:
        stella_main(["demo", *argv])
    assert e.value.code == 2 and "demo: need" in capsys.readouterr().err


def test_docker_test_says_why_it_did_not_run(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # no docker command on PATH
    p = subprocess.run([sys.executable, os.path.join(DOCKER, "lab.py"), "test"], capture_output=True, text=True,
                       env=env, timeout=60)
    assert p.returncode == 0 and "NOT RUN: no `docker` command" in p.stdout, p.stdout + p.stderr
    p = subprocess.run([sys.executable, os.path.join(DOCKER, "lab.py"), "test"], capture_output=True, text=True,
                       env={**env, "STELLA_DOCKER_TEST_REQUIRED": "1"}, timeout=60)
    assert p.returncode == 1


# ------------------------------------------------------------------ the example train.py, for real
TRAIN = os.path.join(DOCKER, "train", "train.py")


def _train(srv, rank: int, *args: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, TRAIN, "--eval-every", "0", "--progress-every", "0", *args],
                            env={**os.environ, "STELLA_SERVER": srv.endpoint, "STELLA_RANK": str(rank),
                                 "STELLA_WORLD": "1", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_line(p: subprocess.Popen, text: str, timeout: float) -> str:
    assert p.stdout is not None
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        line = p.stdout.readline()
        if text in line:
            return line
        if not line and p.poll() is not None:
            break
    raise AssertionError(f"no {text!r} from train.py (exit {p.poll()})")


@pytest.mark.timeout(180)
def test_train_py_stops_cleanly_on_sigterm_continues_a_model_and_is_told_a_refused_key(make_server, curve_keys):
    """Issue 24, 4, 5 and 8: SIGTERM (what `init: true` passes on at `down`) ends the loop
    and close() runs: the server logs a leave, not a liveness timeout; a second run says
    it continues the server's model; a key not on the allowlist ends it at once."""
    srv = make_server(1, ["--liveness-timeout", "60"])
    p = _train(srv, 0, "--steps", "0", "--eval-every", "5")  # a line every 5 steps
    try:
        _wait_line(p, "starts a new model", 60)
        _wait_line(p, "train.py: step 5 |", 60)  # some steps
        p.send_signal(signal.SIGTERM)
        # the step ends and close() leaves (~1 s), not a 60 s request or liveness timeout later
        out, _ = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0 and "stopped (SIGTERM)" in out and "left the job" in out, out
    assert '"msg": "worker left"' in srv.logs() and "declared gone" not in srv.logs()
    again = _train(srv, 0, "--steps", "3")
    # meanwhile a key not on the allowlist: told at once, not after its 600 s timeout (torch's import is the rest)
    refused = _train(srv, 0, STELLA_CLIENT_KEY=curve_keys.client_secrets["outsider"], STELLA_TIMEOUT="600")
    out, _ = again.communicate(timeout=60)
    assert again.returncode == 0 and re.search(r"continues the server's model at version [1-9]", out), out
    assert "Starting afresh" in out
    out, _ = refused.communicate(timeout=60)
    assert refused.returncode == 1 and "Unauthorised" in out and "refused this client's key" in out, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("waiting_for", ["the other sites", "a stopped server"])
def test_train_py_stops_on_sigterm_while_it_waits_for_the_server(make_server, waiting_for):
    """Issue 45: a worker waiting inside Stella (for the other sites of a job not started
    yet, or for a server that stopped answering, while it reconnects) ended only by SIGKILL
    30 s later. SIGTERM's handler calls opt.stop(): the wait ends at once, close() runs,
    and the process exits cleanly (the run records how long it took; the bound here only
    catches a hang: STELLA_TIMEOUT is 60 s)."""
    srv = make_server(2 if waiting_for == "the other sites" else 1, ["--liveness-timeout", "60"])
    p = _train(srv, 0, "--steps", "0", "--eval-every", "5", STELLA_TIMEOUT="60")
    stopped = False
    try:
        _wait_line(p, "starts a new model", 60)
        if waiting_for == "a stopped server":
            _wait_line(p, "train.py: step 5 |", 60)
            os.kill(srv.pid, signal.SIGSTOP)
            stopped = True
        time.sleep(2.0)  # well inside its wait (a step's push and pull)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=20)
        took = time.monotonic() - t0
    finally:
        if stopped:
            os.kill(srv.pid, signal.SIGCONT)
        if p.poll() is None:
            p.kill()
    print(f"SIGTERM to exit while waiting for {waiting_for}: {took:.2f} s")
    assert p.returncode == 0 and "stopped (SIGTERM)" in out, out


# ------------------------------------------------------------------ the walk-through's text
def _readme() -> str:
    with open(os.path.join(DOCKER, "README.md")) as f:
        return f.read()


def test_every_compose_command_of_the_walk_through_names_its_project_and_env_file():
    """Issue 24, 8: without -p every site on one host is the project `docker`; without
    --env-file every site reads docker/.env, and a server site's `up` would run with none
    of its settings. So every command, in a code block or inline, in docker/README.md or in
    a compose file's header, names both."""
    text = _readme()
    cmds = [line.strip() for line in text.splitlines() if re.match(r"\s*(docker-compose|docker compose) ", line)]
    assert len(cmds) >= 8
    assert all(" -p " in c for c in cmds), [c for c in cmds if " -p " not in c]
    inline = [" ".join(c.split()) for c in re.findall(r"`((?:docker-compose|docker compose) [^`]*)`", text)]
    inline = [c for c in inline if " -p " in c]  # not the generic `docker-compose -f ...`
    assert len(inline) >= 3
    for name in COMPOSE_FILES + OVERRIDES:
        with open(os.path.join(DOCKER, name)) as f:
            cmds += [line[1:].strip() for line in f if re.match(r"#\s\s+(docker-compose|docker compose) ", line)]
    assert all(" --env-file " in c for c in cmds + inline), [c for c in cmds + inline if "--env-file" not in c]


def test_the_walk_through_has_an_operator_key_and_a_fresh_start():
    text = _readme()
    assert "stella keygen ~/.stella --name operator" in text and "operator.key_secret" in text
    assert "## Stopping, restarting, starting afresh" in text and "docker volume rm stella-server_checkpoints" in text
    assert "tcp://host.docker.internal:5555" in text and "--env-file docker/site-a.env" in text


def test_no_stale_promises_in_docker():
    """Issue 24, 7: liveness and checkpoints exist; nothing in docker/ says they will."""
    stale = re.compile(r"issue 11|until issue|stay live|NaN until|once the server writes|liveness work", re.I)
    found = []
    for dirpath, _, files in os.walk(DOCKER):
        if "wheelhouse" in dirpath:
            continue
        for name in files:
            if name.endswith((".py", ".md", ".yml", ".env", ".example", "Dockerfile", ".sh")):
                with open(os.path.join(dirpath, name)) as f:
                    found += [f"{name}: {m.group(0)}" for m in stale.finditer(f.read())]
    assert not found, found
