"""docker/ without an engine: the compose files parse and say what the deployment
promises (keys as secrets, restart policies, GPUs, shaped lab sites), the Dockerfiles
are multi-stage, pinned and non-root where they should be, and the entrypoints handle
their arguments. ``make docker-test`` runs the real thing where an engine answers."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from stella.cli import main as stella_main
from stella_ps.config import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKER = os.path.join(ROOT, "docker")
COMPOSE_FILES = ("compose.server.yml", "compose.worker.yml", "compose.lab.yml")


def load(name: str) -> dict:
    with open(os.path.join(DOCKER, name)) as f:
        return yaml.safe_load(f)


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_file_parses_for_1_29_and_v2(name):
    doc = load(name)
    # 1.29 refuses a top-level `name:`; `version:` is obsolete in v2: neither appears
    assert "name" not in doc and "version" not in doc
    assert set(doc) <= {"services", "secrets", "volumes", "networks"} | {k for k in doc if k.startswith("x-")}
    for svc_name, svc in doc["services"].items():
        assert "image" in svc and "restart" in svc, svc_name
        env = svc.get("environment") or {}
        for k, v in env.items():  # keys travel as secrets: the environment only names their files
            if k in ("STELLA_PS_KEYS", "STELLA_PS_ALLOW", "STELLA_SERVER_KEY", "STELLA_CLIENT_KEY"):
                assert str(v).startswith("/run/secrets/"), (svc_name, k, v)
    for secret in (doc.get("secrets") or {}).values():
        assert set(secret) == {"file"}, secret


def test_lab_sites_are_shaped_and_come_back():
    doc = load("compose.lab.yml")
    ps, sites = doc["services"]["ps"], [doc["services"][s] for s in ("site-a", "site-b")]
    assert ps["restart"] == "unless-stopped" and "checkpoints" in ps["volumes"][0]
    assert ps["environment"]["STELLA_PS_METRICS"] == "0.0.0.0:9100"
    for i, site in enumerate(sites):
        assert site["cap_add"] == ["NET_ADMIN"] and site["restart"] == "on-failure"
        assert site["environment"]["STELLA_SHAPE_RATE"].startswith("${STELLA_LAB_RATE")
        assert site["depends_on"]["ps"]["condition"] == "service_healthy"
        assert site["command"][:4] == ["stella", "demo", "--server", "tcp://ps:5555"]
        assert site["command"][site["command"].index("--rank") + 1] == str(i)
        assert len(site["secrets"]) == 2  # the server's public key and the site's own pair only
    # every variable the lab reads has a default or a line in lab.env
    with open(os.path.join(DOCKER, "compose.lab.yml")) as f:
        used = set(re.findall(r"\$\{(\w+)(?::?-[^}]*)?\}", f.read()))
    with open(os.path.join(DOCKER, "lab.env")) as f:
        given = set(re.findall(r"^(\w+)=", f.read(), re.M))
    assert used <= given, used - given


def test_worker_site_reserves_gpus_and_server_site_keeps_metrics_local():
    workers = load("compose.worker.yml")["services"]
    assert len(workers) >= 2
    for w in workers.values():
        (dev,) = w["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
        assert w["environment"]["STELLA_CLIENT_KEY"] == "/run/secrets/client_key"
    ps = load("compose.server.yml")["services"]["ps"]
    assert any("127.0.0.1:9100" in p for p in ps["ports"])


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed")
@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_docker_compose_reads_it(name):
    env = {**os.environ, "STELLA_SERVER": "tcp://ps:5555"}
    p = subprocess.run(["docker-compose", "--env-file", os.path.join(DOCKER, "lab.env"), "-f",
                        os.path.join(DOCKER, name), "config", "-q"], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=60)
    assert p.returncode == 0, p.stderr


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
