"""``make docker-test`` and ``make docker-images``: the deployment, tested for real.

    python docker/lab.py images   # base image if missing, wheelhouse, both images
    python docker/lab.py test     # all of it, then the lab compose file end to end

The test, in order: a Docker engine and compose (docker-compose 1.29 or Compose v2)
must answer, else it says why it did not run and exits 0 (1 with
STELLA_DOCKER_TEST_REQUIRED=1); the base image is made with debootstrap if missing
(no registry needed); the wheelhouse is built on the host (`make wheelhouse`, the CPU
torch wheel included); the server and CPU worker images are built from it with
``--no-index``; every compose file is checked by compose itself (``config``); keys are
made with ``stella keygen`` and handed to the containers as secrets; the lab compose
file runs a server and two worker sites whose links are shaped by tc to
STELLA_LAB_RATE; the demo trains to its target (held-out accuracy >= 0.93, the bar of
tests/test_demo.py) while /metrics is scraped and parsed with prometheus-client's
parser and ``stella status`` shows the job; then a worker container is killed (SIGKILL
to its process, as a crash) and must come back by its restart policy and rejoin.
Whether training continues after that is reported: it needs the liveness work of
issue 11 (a dead worker is dropped from the step), so it is asserted only with
STELLA_LAB_EXPECT_CONTINUE=1. Everything is torn down at the end, and the test checks
that no container, network or volume of its project is left.

Standard library plus prometheus-client (the project's venv); run as root (debootstrap,
chown of the keys to the images' uid 10001).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VERSION = "0.1.0"
BASE_IMAGE = os.environ.get("STELLA_BASE_IMAGE", "stella-base:bookworm")
SERVER_IMAGE = f"stella-ps:{VERSION}"
WORKER_IMAGE = f"stella-worker:{VERSION}-cpu"
IMAGE_UID = 10001
TARGET_ACCURACY = 0.93  # the demo's bar (tests/test_demo.py)
LAB_RATE = os.environ.get("STELLA_LAB_RATE", "20mbit")
LAB_STEPS = int(os.environ.get("STELLA_LAB_STEPS", "400"))
TRAIN_TIMEOUT_S = float(os.environ.get("STELLA_LAB_TIMEOUT", "900"))
SERIES = ("stella_info", "stella_model_version", "stella_live_workers", "stella_steps", "stella_step_seconds",
          "stella_straggler_wait_seconds", "stella_pushes", "stella_pulls", "stella_bytes_received",
          "stella_bytes_sent", "stella_late_pushes", "stella_worker_density", "stella_worker_compute_seconds",
          "stella_worker_exchange_seconds", "stella_worker_wait_seconds", "stella_checkpoint_age_seconds")
# (stella_errors has samples only once a request was refused)


class NotRun(Exception):
    """The test cannot run here (no engine, no compose); the message says why."""


def say(msg: str) -> None:
    print(f"[docker-test {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd: list[str], *, check: bool = True, capture: bool = True, **kw: Any) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, text=True, capture_output=capture, **kw)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{(p.stdout or '')[-3000:]}"
                           f"{(p.stderr or '')[-3000:]}")
    return p


# ---------------------------------------------------------------- engine, images
def engine() -> list[str]:
    """The compose command; raises :class:`NotRun` saying what is missing."""
    if shutil.which("docker") is None:
        raise NotRun("no `docker` command. Install the engine: apt-get install -y docker.io docker-compose "
                     "debootstrap; then start it: dockerd &")
    p = run(["docker", "info", "--format", "{{.ServerVersion}}"], check=False)
    if p.returncode != 0:
        why = ((p.stderr or p.stdout).strip().splitlines() or ["docker info failed"])[-1]
        raise NotRun(f"no Docker engine reachable ({why}). "
                     "Start one: dockerd & (installed with apt-get install -y docker.io)")
    say(f"Docker engine {p.stdout.strip()}")
    if shutil.which("docker-compose"):
        v = run(["docker-compose", "version", "--short"], check=False).stdout.strip()
        say(f"docker-compose {v}")
        return ["docker-compose"]
    if run(["docker", "compose", "version"], check=False).returncode == 0:
        say("Compose v2 (docker compose)")
        return ["docker", "compose"]
    raise NotRun("no compose: apt-get install -y docker-compose (1.29), or the Compose v2 plugin")


def image_exists(name: str) -> bool:
    return run(["docker", "image", "inspect", name], check=False).returncode == 0


def image_size(name: str) -> int:
    return int(run(["docker", "image", "inspect", "-f", "{{.Size}}", name]).stdout.strip())


def images() -> dict[str, int]:
    """Base image (if missing), wheelhouse, server and CPU worker images; their sizes."""
    if not image_exists(BASE_IMAGE):
        if BASE_IMAGE != "stella-base:bookworm":
            raise RuntimeError(f"base image {BASE_IMAGE} is missing (pull it, or unset STELLA_BASE_IMAGE)")
        say(f"making the base image {BASE_IMAGE} with debootstrap (a few minutes)")
        run(["sh", os.path.join(HERE, "make-base-image.sh"), BASE_IMAGE], capture=False)
    say("wheelhouse (make wheelhouse: the project's wheel for a portable x86-64 level, its dependencies, CPU torch)")
    run(["make", "-s", "wheelhouse"], cwd=ROOT, capture=False)
    for dockerfile, tag in (("server.Dockerfile", SERVER_IMAGE), ("worker.Dockerfile", WORKER_IMAGE)):
        say(f"docker build {tag} (from {BASE_IMAGE}, pip --no-index from the wheelhouse)")
        t0 = time.monotonic()
        run(["docker", "build", "-q", "-f", os.path.join(HERE, dockerfile), "-t", tag,
             "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", HERE])
        say(f"  built in {time.monotonic() - t0:.0f} s")
    sizes = {name: image_size(name) for name in (BASE_IMAGE, SERVER_IMAGE, WORKER_IMAGE)}
    for name, size in sizes.items():
        say(f"  image {name}: {size / 1e6:.0f} MB")
    return sizes


# ---------------------------------------------------------------- keys
def make_keys(directory: str) -> dict[str, str]:
    """Server, two sites and an operator (for `stella status`); the allowlist; files
    readable by the images' user only (chown to its uid)."""
    from stella.cli import keygen

    lines = []
    for name in ("server", "site-a", "site-b", "operator"):
        with open(os.devnull, "w") as devnull:
            saved, sys.stdout, sys.stderr = (sys.stdout, sys.stderr), devnull, devnull
            try:
                assert keygen(directory, name) == 0
            finally:
                sys.stdout, sys.stderr = saved
        if name != "server":
            with open(os.path.join(directory, f"{name}.key")) as f:
                key = re.search(r'public-key = "(.{40})"', f.read())
            assert key, f"no public key in {name}.key"
            lines.append(f"{key.group(1)} {name}")
    with open(os.path.join(directory, "allowlist"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if os.geteuid() == 0:
        for fn in os.listdir(directory):
            os.chown(os.path.join(directory, fn), IMAGE_UID, IMAGE_UID)
    else:  # pragma: no cover - the images' user could not read 0600 files of another uid
        raise RuntimeError("run make docker-test as root (the keys are chowned to the images' uid 10001)")
    os.chmod(directory, 0o755)
    return {"server_public": os.path.join(directory, "server.key"),
            "operator": os.path.join(directory, "operator.key_secret")}


# ---------------------------------------------------------------- the lab
class Lab:
    def __init__(self, compose: list[str], keys_dir: str, env_file: str):
        self.project = f"stella-lab-{os.getpid()}"
        self.cmd = [*compose, "-p", self.project, "--env-file", env_file, "-f", os.path.join(HERE, "compose.lab.yml")]
        self.keys_dir = keys_dir

    def compose(self, *args: str, check: bool = True, capture: bool = True,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return run([*self.cmd, *args], check=check, capture=capture, cwd=ROOT, env=env)

    def container(self, service: str) -> str:
        out = run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={self.project}",
                   "--filter", f"label=com.docker.compose.service={service}"]).stdout.split()
        if not out:
            raise RuntimeError(f"no container for {service}")
        return out[0]

    def inspect(self, service: str) -> dict:
        return json.loads(run(["docker", "inspect", self.container(service)]).stdout)[0]

    def ip(self, service: str) -> str:
        nets = self.inspect(service)["NetworkSettings"]["Networks"]
        return next(iter(nets.values()))["IPAddress"]

    def logs(self, service: str) -> str:
        p = run(["docker", "logs", self.container(service)], check=False)
        return p.stdout + p.stderr

    def leftovers(self) -> list[str]:
        label = f"label=com.docker.compose.project={self.project}"
        out = []
        for kind in (["ps", "-aq"], ["network", "ls", "-q"], ["volume", "ls", "-q"]):
            ids = run(["docker", *kind, "--filter", label]).stdout.split()
            out += [f"{kind[0]} {i}" for i in ids]
        return out

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "--timeout", "10", check=False)


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(fam.name, {})[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(fams: dict, family: str, name: str | None = None) -> float:
    vals = [v for (n, _), v in fams.get(family, {}).items() if name is None or n == name]
    if not vals:
        raise KeyError(family)
    return vals[0]


def status(address: str, keys: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "STELLA_SERVER_KEY": keys["server_public"], "STELLA_CLIENT_KEY": keys["operator"]}
    return run([sys.executable, "-m", "stella.cli", "status", address, *args], env=env, check=False)


def wait_for(what: str, cond, timeout: float, every: float = 1.0):
    """Poll ``cond`` until it returns something other than None, False or empty (0 counts)."""
    t_end = time.monotonic() + timeout
    while True:
        v = cond()
        if v is not None and v is not False and not (isinstance(v, (list, dict)) and not v):
            return v
        if time.monotonic() > t_end:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def lab_test(compose: list[str], sizes: dict[str, int]) -> dict[str, Any]:
    report: dict[str, Any] = {"images_mb": {k: round(v / 1e6) for k, v in sizes.items()}, "rate": LAB_RATE}
    with tempfile.TemporaryDirectory(prefix="stella-lab-") as tmp:
        keys_dir = os.path.join(tmp, "keys")
        os.makedirs(keys_dir)
        keys = make_keys(keys_dir)
        env_file = os.path.join(tmp, "lab.env")
        with open(os.path.join(HERE, "lab.env")) as f:
            env_text = f.read()
        overrides = {"STELLA_KEYS_DIR": keys_dir, "STELLA_LAB_RATE": LAB_RATE, "STELLA_LAB_STEPS": str(LAB_STEPS),
                     "STELLA_SERVER_IMAGE": SERVER_IMAGE, "STELLA_WORKER_IMAGE": WORKER_IMAGE}
        for k, v in overrides.items():
            env_text = re.sub(rf"^{k}=.*$", f"{k}={v}", env_text, flags=re.M)
        with open(env_file, "w") as f:
            f.write(env_text)
        lab = Lab(compose, keys_dir, env_file)
        say("compose files, as compose reads them (config -q)")
        lab.compose("config", "-q")
        for name, extra in (("compose.server.yml", {}), ("compose.worker.yml", {"STELLA_SERVER": "tcp://ps:5555"})):
            run([*compose, "--env-file", env_file, "-f", os.path.join(HERE, name), "config", "-q"], cwd=ROOT,
                env={**os.environ, **extra})
            say(f"  {name}: ok")
        say(f"lab up: project {lab.project}, sites shaped to {LAB_RATE} each way, {LAB_STEPS} steps")
        t0 = time.monotonic()
        try:
            lab.compose("up", "-d")
            ps_ip = lab.ip("ps")
            address, metrics_url = f"tcp://{ps_ip}:5555", f"http://{ps_ip}:9100/metrics"
            health = lab.inspect("ps")["State"].get("Health", {}).get("Status")
            say(f"stella-ps at {address}, health {health}; metrics at {metrics_url}")
            assert health == "healthy", f"server container not healthy: {health}"
            for site in ("site-a", "site-b"):
                q = run(["docker", "exec", lab.container(site), "tc", "qdisc", "show", "dev", "eth0"]).stdout
                assert "tbf" in q, f"{site} not shaped: {q}"
                said = [line for line in lab.logs(site).splitlines() if line.startswith("stella-worker:")]
                say(f"  {site}: {' / '.join(said)}")
                say(f"    tc: {' | '.join(line.strip() for line in q.splitlines() if 'tbf' in line)}")
            # mid-run: the metrics endpoint and stella status
            wait_for("the job to pass a quarter of its steps", lambda: _version(metrics_url) >= LAB_STEPS // 4,
                     TRAIN_TIMEOUT_S)
            fams = scrape(metrics_url)
            missing = [s for s in SERIES if s not in fams]
            assert not missing, f"series missing from /metrics: {missing}"
            live = sample(fams, "stella_live_workers")
            dens = fams["stella_worker_density"]
            assert live == 2 and len(dens) == 2, f"live workers {live}, density series {dens}"
            say(f"/metrics parsed (prometheus-client): {len(fams)} families, version "
                f"{sample(fams, 'stella_model_version'):.0f}, live workers {live:.0f}, densities "
                f"{sorted(round(v, 4) for v in dens.values())}, bytes in {sample(fams, 'stella_bytes_received'):.0f}")
            st = status(address, keys)
            assert st.returncode == 0, st.stderr
            say("stella status:\n" + st.stdout.rstrip())
            # to the end of training
            code = wait_for("site-a to finish", lambda: _exited(lab, "site-a"), TRAIN_TIMEOUT_S)
            wall = time.monotonic() - t0
            log_a = lab.logs("site-a")
            m = re.search(r"result: test accuracy ([0-9.]+) after (\d+) steps in ([0-9.]+) s", log_a)
            assert code == 0 and m, f"site-a exited {code}:\n{log_a[-3000:]}"
            acc, train_s = float(m.group(1)), float(m.group(3))
            progress = [line for line in log_a.splitlines() if line.startswith("stella step")]
            say(f"site-a: test accuracy {acc:.4f} after {m.group(2)} steps; training {train_s:.1f} s, "
                f"lab up to result {wall:.1f} s")
            for line in progress:
                say(f"  site-a progress: {line}")
            assert acc >= TARGET_ACCURACY, f"accuracy {acc} below the demo's target {TARGET_ACCURACY}"
            wait_for("site-b to finish", lambda: _exited(lab, "site-b"), 120)
            report.update(accuracy=acc, train_s=train_s, lab_wall_s=round(wall, 1))
            report["crash"] = crash_test(lab, metrics_url, address, keys)
        finally:
            say("lab down")
            lab.down()
            left = lab.leftovers()
            report["leftovers"] = left
        assert not left, f"left behind: {left}"
        say("nothing left behind (containers, networks, volumes of the project)")
    return report


def _version(metrics_url: str) -> float:
    try:
        return sample(scrape(metrics_url), "stella_model_version")
    except (OSError, KeyError):
        return -1.0


def _exited(lab: Lab, service: str) -> int | None:
    st = lab.inspect(service)["State"]
    return None if st["Running"] or st.get("Restarting") else int(st["ExitCode"])


def crash_test(lab: Lab, metrics_url: str, address: str, keys: dict[str, str]) -> dict[str, Any]:
    """Start site-b's worker again, crash it (SIGKILL to its process from the host), and
    watch the restart policy bring it back and the worker rejoin."""
    say("crash test: site-b trains again; its process is then killed as a crash")
    # long enough to be killed mid-run (the shell's variable beats the env file in 1.29 and v2)
    lab.compose("up", "-d", "--no-deps", "--force-recreate", "site-b", env={**os.environ, "STELLA_LAB_STEPS": "100000"})
    v0 = _version(metrics_url)
    wait_for("site-b to push again", lambda: _version(metrics_url) >= v0 + 20, 300)
    before = lab.inspect("site-b")
    ids_before = {w["worker"] for w in _live(address, keys)}
    os.kill(before["State"]["Pid"], signal.SIGKILL)
    t_kill = time.monotonic()
    v_kill = _version(metrics_url)
    say(f"  killed site-b (pid {before['State']['Pid']}, restarts so far {before['RestartCount']}) at version "
        f"{v_kill:.0f}")

    def back() -> dict | None:
        s = lab.inspect("site-b")
        return s if s["RestartCount"] > before["RestartCount"] and s["State"]["Running"] else None

    s = wait_for("site-b to be restarted by its restart policy", back, 120, 0.5)
    restarted_s = time.monotonic() - t_kill
    say(f"  site-b back after {restarted_s:.1f} s (restart policy {s['HostConfig']['RestartPolicy']['Name']}, "
        f"restarts {s['RestartCount']})")
    rejoined = wait_for("the restarted worker to rejoin",
                        lambda: [w for w in _live(address, keys) if w["worker"] not in ids_before
                                 and w["name"] == "demo-worker-1"], 120)
    rejoin_s = time.monotonic() - t_kill
    say(f"  rejoined as worker {rejoined[0]['worker']} after {rejoin_s:.1f} s")
    time.sleep(20)
    v_after = _version(metrics_url)
    continued = v_after > v_kill + 5
    live = _live(address, keys)
    say(f"  20 s later: version {v_after:.0f} (at the kill {v_kill:.0f}); live workers "
        f"{[(w['worker'], w['name']) for w in live]}")
    if continued:
        say("  training continued after the crash")
    else:
        say("  training did NOT continue: the killed worker's id is still live (no liveness yet, issue 11), "
            "so every step waits for its push")
    if os.environ.get("STELLA_LAB_EXPECT_CONTINUE") == "1":
        assert continued, "training stalled after the crash"
    return {"restarted_after_s": round(restarted_s, 1), "rejoined_after_s": round(rejoin_s, 1),
            "training_continued": continued, "version_at_kill": v_kill, "version_20s_later": v_after}


def _live(address: str, keys: dict[str, str]) -> list[dict]:
    """The live workers as `stella status --json` lists them ([] if it fails 3 times)."""
    for _ in range(3):
        p = status(address, keys, "--json", "--timeout", "10")
        if p.returncode == 0:
            return json.loads(p.stdout).get("live") or []
        say(f"  (stella status failed: {p.stderr.strip()[-300:]})")
    return []


def main(argv: list[str]) -> int:
    what = argv[1] if len(argv) > 1 else "test"
    if what not in ("images", "test"):
        print("usage: python docker/lab.py [images|test]", file=sys.stderr)
        return 2
    try:
        compose = engine()
    except NotRun as e:
        print(f"make docker-{what}: NOT RUN: {e}", flush=True)
        return 1 if os.environ.get("STELLA_DOCKER_TEST_REQUIRED") == "1" else 0
    t0 = time.monotonic()
    sizes = images()
    if what == "images":
        return 0
    report = lab_test(compose, sizes)
    say(f"PASSED in {time.monotonic() - t0:.0f} s: {json.dumps(report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
