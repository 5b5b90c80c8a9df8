"""``make docker-test`` and ``make docker-images``: the deployment, tested for real, as
docker/README.md deploys it, on one machine.

    python docker/lab.py images   # base image if missing, wheelhouse, both images
    python docker/lab.py test     # all of it, then the three-site walk-through end to end

A Docker engine and compose (docker-compose 1.29 or Compose v2) must answer, else it
says why it did not run and exits 0 (1 with STELLA_DOCKER_TEST_REQUIRED=1). The base
image is made with debootstrap if missing (no registry needed); the wheelhouse is built
on the host (`make wheelhouse`, the CPU torch wheel included); the server and CPU worker
images are built from it with ``--no-index``, only when their inputs changed (each image
carries a digest of its Dockerfile, wheels and base image), and the build stages the
legacy builder leaves dangling are pruned. Every compose file is checked by compose
itself (``config``).

The lab then follows the walk-through: keys made with ``stella keygen`` (server, two
sites and an operator on the allowlist; an outsider not), the secrets given to uid
10001; the server site runs compose.server.yml and each worker site
compose.worker.yml (with compose.lab.yml: its link shaped by tc to STELLA_LAB_RATE), each
its own compose project with an env file copied from the ``*.env.example`` files (the
server's with the STELLA_PS_ settings of lab.env: its compose file passes that file to
the server, which takes its own defaults for the rest), and the workers run the example
docker/train/train.py. Checked, in order:

1. the server is healthy; a site whose key is not on the allowlist: its worker exits
   with ``Unauthorised`` within 10 s of starting, and the server counts the refused
   connection; the two sites' links are shaped;
2. mid-run, /metrics parses (prometheus-client) with every series the dashboard needs,
   and ``stella status`` with the operator's key lists the four workers under their
   sites' names;
3. the job reaches the demo's held-out accuracy (0.93) and writes checkpoints;
4. the server container is killed (SIGKILL) and started again (``up -d``): it resumes
   from a checkpoint at least as new as the last one before the kill, and the workers
   rejoin by themselves and train on;
5. a worker's process is killed: the restart policy brings it back, it rejoins, and
   training continues;
6. site-b's line is removed from the allowlist with ``sed -i`` (a new file: the
   directory mount sees it): its workers are dropped within one liveness timeout, and
   their next connection is refused;
7. ``down`` of site-a takes under 5 s and its workers leave cleanly (the server logs
   ``worker left``, no liveness timeout);
8. everything is torn down, and no container, network or volume of the lab is left.

Standard library plus stella and prometheus-client (the project's venv); run as root
(debootstrap, chown of the keys to the images' uid 10001).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VERSION = "0.1.0"
BASE_IMAGE = os.environ.get("STELLA_BASE_IMAGE", "stella-base:bookworm")
SERVER_IMAGE = f"stella-ps:{VERSION}"
WORKER_IMAGE = f"stella-worker:{VERSION}-cpu"
IMAGE_UID = 10001
BUILD_STAGE_LABEL = "org.stella.stage=build"  # the Dockerfiles' build stages
INPUTS_LABEL = "org.stella.inputs"  # an image's digest of what it was built from
TARGET_ACCURACY = 0.93  # the demo's bar (tests/test_demo.py)
REFUSED_WITHIN_S = 10.0  # a refused key's worker exits with Unauthorised within this
DOWN_WITHIN_S = 5.0  # `down` of a worker site, its workers leaving cleanly
SITES = {"site-a": (0, 1), "site-b": (2, 3)}  # ranks
WORLD = 4
SERIES = ("stella_info", "stella_model_version", "stella_live_workers", "stella_steps", "stella_step_seconds",
          "stella_straggler_wait_seconds", "stella_pushes", "stella_pulls", "stella_bytes_received",
          "stella_bytes_sent", "stella_late_pushes", "stella_worker_density", "stella_worker_compute_seconds",
          "stella_worker_exchange_seconds", "stella_worker_wait_seconds", "stella_checkpoint_age_seconds",
          "stella_checkpoints", "stella_refused_connections")
# (stella_errors has samples only once a request was refused)


def _lab_settings() -> dict[str, str]:
    """docker/lab.env, each setting overridden by the environment."""
    out: dict[str, str] = {}
    with open(os.path.join(HERE, "lab.env")) as f:
        for line in f:
            k, sep, v = line.strip().partition("=")
            if sep and not k.startswith("#"):
                out[k] = os.environ.get(k, v)
    return out


LAB = _lab_settings()
TRAIN_TIMEOUT_S = float(LAB["STELLA_LAB_TIMEOUT"])
LIVENESS_S = float(LAB["STELLA_PS_LIVENESS_TIMEOUT"])


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


def _image_label(name: str, label: str) -> str:
    p = run(["docker", "image", "inspect", "-f", f'{{{{index .Config.Labels "{label}"}}}}', name], check=False)
    return p.stdout.strip() if p.returncode == 0 else ""


def inputs_digest(dockerfile: str, *extra: str) -> str:
    """What an image is built from: its Dockerfile, the wheelhouse's wheels, ``extra``
    files of the context and the base image's id."""
    h = hashlib.sha256()
    wheelhouse = os.path.join(HERE, "wheelhouse")
    paths = [os.path.join(HERE, dockerfile), *(os.path.join(HERE, e) for e in extra),
             *sorted(os.path.join(wheelhouse, w) for w in os.listdir(wheelhouse) if w.endswith(".whl"))]
    for path in paths:
        h.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    h.update(run(["docker", "image", "inspect", "-f", "{{.Id}}", BASE_IMAGE]).stdout.strip().encode())
    return h.hexdigest()[:16]


def dangling_mb() -> float:
    ids = run(["docker", "images", "-q", "--filter", "dangling=true"]).stdout.split()
    return sum(image_size(i) for i in set(ids)) / 1e6


def images() -> dict[str, int]:
    """Base image (if missing), wheelhouse, server and CPU worker images (built when their
    inputs changed; dangling build stages pruned); their sizes."""
    if not image_exists(BASE_IMAGE):
        if BASE_IMAGE != "stella-base:bookworm":
            raise RuntimeError(f"base image {BASE_IMAGE} is missing (pull it, or unset STELLA_BASE_IMAGE)")
        say(f"making the base image {BASE_IMAGE} with debootstrap (a few minutes)")
        run(["sh", os.path.join(HERE, "make-base-image.sh"), BASE_IMAGE], capture=False)
    say("wheelhouse (make wheelhouse: the project's wheel for a portable x86-64 level, its dependencies, CPU torch)")
    run(["make", "-s", "wheelhouse"], cwd=ROOT, capture=False)
    built = False
    for dockerfile, tag, extra in (("server.Dockerfile", SERVER_IMAGE, ()),
                                   ("worker.Dockerfile", WORKER_IMAGE, ("worker-entrypoint.sh",))):
        digest = inputs_digest(dockerfile, *extra)
        if image_exists(tag) and _image_label(tag, INPUTS_LABEL) == digest:
            say(f"image {tag} is up to date (inputs {digest})")
            continue
        say(f"docker build {tag} (from {BASE_IMAGE}, pip --no-index from the wheelhouse; inputs {digest})")
        t0 = time.monotonic()
        run(["docker", "build", "-q", "-f", os.path.join(HERE, dockerfile), "-t", tag, "--label",
             f"{INPUTS_LABEL}={digest}", "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", HERE])
        say(f"  built in {time.monotonic() - t0:.0f} s")
        built = True
    if built:
        before = dangling_mb()
        # the build stages, and the images the new ones replaced; never anything else
        for label in (BUILD_STAGE_LABEL, INPUTS_LABEL):
            run(["docker", "image", "prune", "-f", "--filter", f"label={label}"])
        say(f"  dangling images: {before:.0f} MB before the prune, {dangling_mb():.0f} MB after")
    sizes = {name: image_size(name) for name in (BASE_IMAGE, SERVER_IMAGE, WORKER_IMAGE)}
    for name, size in sizes.items():
        say(f"  image {name}: {size / 1e6:.0f} MB")
    return sizes


# ---------------------------------------------------------------- keys
def make_keys(directory: str) -> dict[str, str]:
    """Server, two sites, an operator (for `stella status`) and an outsider; the
    allowlist (all but the server and the outsider); the secrets the containers read
    given to the images' uid, as docker/README.md says. Returns the operator's paths and
    the sites' allowlist lines."""
    from stella.cli import keygen

    lines = {}
    for name in ("server", "site-a", "site-b", "operator", "outsider"):
        with open(os.devnull, "w") as devnull:
            saved, sys.stdout, sys.stderr = (sys.stdout, sys.stderr), devnull, devnull
            try:
                assert keygen(directory, name, server=name == "server") == 0
            finally:
                sys.stdout, sys.stderr = saved
        if name not in ("server", "outsider"):
            with open(os.path.join(directory, f"{name}.key")) as f:
                key = re.search(r'public-key = "(.{40})"', f.read())
            assert key, f"no public key in {name}.key"
            lines[name] = f"{key.group(1)} {name}"
    with open(os.path.join(directory, "allowlist"), "w") as f:
        f.write("# the lab's sites and its operator\n" + "\n".join(lines.values()) + "\n")
    if os.geteuid() != 0:  # pragma: no cover - the images' user could not read 0600 files of another uid
        raise RuntimeError("run make docker-test as root (the keys are chowned to the images' uid 10001)")
    for name in ("server", "site-a", "site-b", "outsider"):  # what the containers read; the operator's stays
        os.chown(os.path.join(directory, f"{name}.key_secret"), IMAGE_UID, IMAGE_UID)
    os.chmod(directory, 0o755)
    return {"server_public": os.path.join(directory, "server.key"),
            "operator": os.path.join(directory, "operator.key_secret"), "line site-b": lines["site-b"]}


# ---------------------------------------------------------------- sites
def env_file(path: str, example: str, settings: dict[str, str]) -> None:
    """``path``: the documented copy of ``example`` with ``settings`` changed, uncommented
    (``#NAME=``) or added."""
    with open(os.path.join(HERE, example)) as f:
        text = f.read()
    for k, v in settings.items():
        text, n = re.subn(rf"^#?{k}=.*$", lambda m, k=k, v=v: f"{k}={v}", text, count=1, flags=re.M)
        if not n:
            text += f"{k}={v}\n"
    with open(path, "w") as f:
        f.write(text)


class Site:
    """One site: a compose project of its own, from its compose files and env file."""

    def __init__(self, compose: list[str], project: str, env: str, *files: str):
        self.project = project
        self.cmd = [*compose, "-p", project, "--env-file", env, *(a for f in files for a in ("-f",
                                                                                             os.path.join(HERE, f)))]

    def compose(self, *args: str, check: bool = True, timeout: float | None = None) -> subprocess.CompletedProcess:
        return run([*self.cmd, *args], check=check, cwd=ROOT, timeout=timeout)

    def container(self, service: str) -> str:
        out = run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={self.project}",
                   "--filter", f"label=com.docker.compose.service={service}",
                   "--filter", "label=com.docker.compose.oneoff=False"]).stdout.split()
        if not out:
            raise RuntimeError(f"no container for {self.project} {service}")
        return out[0]

    def inspect(self, service: str) -> dict:
        return json.loads(run(["docker", "inspect", self.container(service)]).stdout)[0]

    def logs(self, service: str) -> str:
        p = run(["docker", "logs", self.container(service)], check=False)
        return p.stdout + p.stderr

    def leftovers(self) -> list[str]:
        label = f"label=com.docker.compose.project={self.project}"
        out = []
        for kind in (["ps", "-aq"], ["network", "ls", "-q"], ["volume", "ls", "-q"]):
            ids = run(["docker", *kind, "--filter", label]).stdout.split()
            out += [f"{self.project} {kind[0]} {i}" for i in ids]
        return out

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "--timeout", "10", check=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


def host_gateway() -> str:
    """The address `host.docker.internal` (`host-gateway`) is in a container: the host,
    as the engine maps it (the default bridge's gateway unless configured otherwise)."""
    out = run(["docker", "run", "--rm", "--add-host", "host.docker.internal:host-gateway", BASE_IMAGE,
               "getent", "hosts", "host.docker.internal"]).stdout.split()
    assert out, "host-gateway did not resolve"
    return out[0]


# ---------------------------------------------------------------- observing the job
def scrape(url: str) -> dict[str, dict[tuple, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(fam.name, {})[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(fams: dict, family: str, name: str | None = None, **labels: str) -> float:
    vals = [v for (n, lv), v in fams.get(family, {}).items()
            if (name is None or n == name) and all((k, x) in lv for k, x in labels.items())]
    if not vals:
        raise KeyError(family)
    return vals[0]


class Job:
    """The running job as the operator sees it: `stella status` (the operator's key) and /metrics."""

    def __init__(self, address: str, metrics_url: str, keys: dict[str, str]):
        self.address, self.metrics_url, self.keys = address, metrics_url, keys

    def status(self) -> Any | None:
        """The status reply, or None if the server does not answer (it may be restarting)."""
        from stella import Client, StellaError

        try:
            with Client(self.address, timeout=5, join=False, server_key=self.keys["server_public"],
                        client_key=self.keys["operator"]) as c:
                return c.status()
        except (StellaError, OSError):
            return None

    def version(self) -> float:
        try:
            return sample(scrape(self.metrics_url), "stella_model_version")
        except (OSError, KeyError):
            return -1.0

    def live(self) -> list[Any]:
        st = self.status()
        return list(st.live or []) if st is not None else []

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "STELLA_SERVER_KEY": self.keys["server_public"],
               "STELLA_CLIENT_KEY": self.keys["operator"]}
        return run([sys.executable, "-m", "stella.cli", "status", self.address, *args], env=env, check=False)


def wait_for(what: str, cond: Callable[[], Any], timeout: float, every: float = 1.0) -> Any:
    """Poll ``cond`` until it returns something other than None, False or empty (0 counts)."""
    t_end = time.monotonic() + timeout
    while True:
        v = cond()
        if v is not None and v is not False and not (isinstance(v, (list, dict)) and not v):
            return v
        if time.monotonic() > t_end:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def server_log(site: Site) -> list[dict]:
    """The server's JSON log lines (both runs of its container, after a restart)."""
    out = []
    for line in site.logs("ps").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def accuracies(site: Site) -> list[tuple[int, float]]:
    """Rank 0's held-out accuracy by step, from train.py's lines."""
    return [(int(m.group(1)), float(m.group(2))) for m in
            re.finditer(r"train\.py: step (\d+) \| version \d+ \| loss \S+ \| test accuracy ([0-9.]+)",
                        site.logs("worker-0"))]


# ---------------------------------------------------------------- the lab
def lab_test(compose: list[str], sizes: dict[str, int]) -> dict[str, Any]:
    report: dict[str, Any] = {"images_mb": {k: round(v / 1e6) for k, v in sizes.items()},
                              "rate": LAB["STELLA_LAB_RATE"]}
    prefix = f"stella-lab-{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="stella-lab-") as tmp:
        keys_dir = os.path.join(tmp, "keys")
        os.makedirs(keys_dir)
        keys = make_keys(keys_dir)
        gateway, port, metrics_port = host_gateway(), free_port(), free_port()
        server_env = os.path.join(tmp, "server.env")
        env_file(server_env, "server.env.example", {
            "STELLA_ENV_FILE": server_env,  # the server's environment too: not docker/server.env
            "STELLA_SERVER_IMAGE": SERVER_IMAGE, "STELLA_KEYS_DIR": keys_dir,
            # the workers' port on the bridge's gateway only (host.docker.internal), metrics on loopback
            "STELLA_PUBLISH": f"{gateway}:{port}", "STELLA_METRICS_PUBLISH": f"127.0.0.1:{metrics_port}",
            # the server's own settings: the lab's (lab.env), and its job's size
            **{k: v for k, v in LAB.items() if k.startswith("STELLA_PS_")}, "STELLA_PS_WORKERS": str(WORLD)})
        for site, ranks in (*SITES.items(), ("outsider", (0, 1))):
            env_file(os.path.join(tmp, f"{site}.env"), "worker.env.example", {
                "STELLA_WORKER_IMAGE": WORKER_IMAGE, "STELLA_SERVER": f"tcp://host.docker.internal:{port}",
                "STELLA_KEYS_DIR": keys_dir, "STELLA_SITE": site, "STELLA_RANK_0": str(ranks[0]),
                "STELLA_RANK_1": str(ranks[1]), "STELLA_WORLD": str(WORLD),
                "STELLA_COMMAND": f"python /work/train.py --steps 0 --eval-every {LAB['STELLA_LAB_EVAL_EVERY']}",
                "STELLA_SHAPE_RATE": LAB["STELLA_LAB_RATE"], "STELLA_SHAPE_DELAY": LAB["STELLA_LAB_DELAY"]})
        server = Site(compose, f"{prefix}-server", server_env, "compose.server.yml")
        sites = {s: Site(compose, f"{prefix}-{s}", os.path.join(tmp, f"{s}.env"), "compose.worker.yml",
                         "compose.lab.yml") for s in (*SITES, "outsider")}
        say("compose files, as compose reads them (config -q)")
        server.compose("config", "-q")
        sites["site-a"].compose("config", "-q")
        gpu = Site(compose, f"{prefix}-gpu", os.path.join(tmp, "site-a.env"), "compose.worker.yml",
                   "compose.worker.gpu.yml")
        gpu.compose("config", "-q")
        Site(compose, f"{prefix}-shards", server_env, "compose.shards.yml").compose("config", "-q")
        say("  compose.server.yml, compose.shards.yml, compose.worker.yml (+ compose.lab.yml, "
            "+ compose.worker.gpu.yml): ok")
        job = Job(f"tcp://{gateway}:{port}", f"http://127.0.0.1:{metrics_port}/metrics", keys)
        t0 = time.monotonic()
        try:
            say(f"server site up: project {server.project}, workers' port {gateway}:{port}")
            server.compose("up", "-d")
            wait_for("the server to be healthy",
                     lambda: server.inspect("ps")["State"].get("Health", {}).get("Status") == "healthy", 90, 1.0)
            say(f"  stella-ps healthy after {time.monotonic() - t0:.1f} s")
            # before the sites train: the time bound is the refusal's, not that of a CPU shared with four workers
            report["outsider"] = outsider(sites["outsider"], job)
            for s in SITES:
                say(f"worker site up: project {sites[s].project}, ranks {SITES[s]}, link {LAB['STELLA_LAB_RATE']}")
                sites[s].compose("up", "-d")
            report.update(training(server, sites, job, t0))
            report["server_restart"] = server_restart(server, sites, job)
            report["crash"] = crash(sites["site-b"], job)
            report["revoked"] = revoke(server, sites["site-b"], job, keys_dir, keys["line site-b"])
            report["down"] = down_site(server, sites["site-a"], job)
        finally:
            say("lab down")
            left: list[str] = []
            for site in (*sites.values(), gpu, server):
                site.down()
                left += site.leftovers()
            report["leftovers"] = left
        assert not left, f"left behind: {left}"
        say("nothing left behind (containers, networks, volumes of the lab's projects)")
    return report


def training(server: Site, sites: dict[str, Site], job: Job, t0: float) -> dict[str, Any]:
    """Checks 1-3: shaped links, /metrics and status mid-run, the target accuracy, checkpoints."""
    st = wait_for("the status reply", job.status, 60)
    assert st.liveness_timeout_s == LIVENESS_S, st.liveness_timeout_s
    for s in SITES:
        for w in ("worker-0", "worker-1"):
            q = run(["docker", "exec", sites[s].container(w), "tc", "qdisc", "show", "dev", "eth0"]).stdout
            assert "tbf" in q, f"{s} {w} not shaped: {q}"
        said = [line for line in sites[s].logs("worker-0").splitlines() if line.startswith("stella-worker:")]
        say(f"  {s}: {' / '.join(said)}")
    wait_for("the job to pass 50 steps", lambda: job.version() >= 50, TRAIN_TIMEOUT_S)
    fams = scrape(job.metrics_url)
    missing = [s for s in SERIES if s not in fams]
    assert not missing, f"series missing from /metrics: {missing}"
    live = sample(fams, "stella_live_workers")
    dens = fams["stella_worker_density"]
    assert live == WORLD and len(dens) == WORLD, f"live workers {live}, density series {dens}"
    say(f"/metrics parsed (prometheus-client): {len(fams)} families, version "
        f"{sample(fams, 'stella_model_version'):.0f}, live workers {live:.0f}, densities "
        f"{sorted(round(v, 4) for v in dens.values())}, bytes in {sample(fams, 'stella_bytes_received'):.0f}")
    cli = job.cli()
    assert cli.returncode == 0, cli.stderr
    say("stella status (the operator's key):\n" + cli.stdout.rstrip())
    names = sorted(w.key_name for w in job.live())
    assert names == ["site-a", "site-a", "site-b", "site-b"], names
    acc = wait_for(f"held-out accuracy >= {TARGET_ACCURACY}",
                   lambda: next(((s, a) for s, a in accuracies(sites["site-a"]) if a >= TARGET_ACCURACY), None),
                   TRAIN_TIMEOUT_S)
    reached_s = time.monotonic() - t0
    say(f"rank 0 reached test accuracy {acc[1]:.4f} at its step {acc[0]}, {reached_s:.1f} s after the lab came up")
    ck = wait_for("a checkpoint", lambda: (job.status() or st).checkpoint_version, 120)
    n = sample(scrape(job.metrics_url), "stella_checkpoints")
    say(f"checkpoints on: the newest at version {ck} ({n:.0f} written), on the volume "
        f"{server.project}_checkpoints")
    assert n >= 1
    return {"accuracy": acc[1], "accuracy_at_step": acc[0], "target_reached_s": round(reached_s, 1),
            "checkpoint_version": ck}


def server_restart(server: Site, sites: dict[str, Site], job: Job) -> dict[str, Any]:
    """Check 4: kill -9 the server container, `up -d`: resumed from the newest checkpoint
    written before the kill, the workers back by themselves."""
    st = job.status()
    assert st is not None and st.checkpoint_version is not None
    ids = {w.worker for w in st.live or []}
    run(["docker", "kill", "--signal", "KILL", server.container("ps")])
    t_kill, t_kill_wall = time.monotonic(), time.time()
    # the job went on between the status reply and the kill: the server's log has the last word
    written = [int(e["version"]) for e in server_log(server) if e.get("msg") == "checkpoint written"
               and e.get("ts", 0) <= t_kill_wall]
    ck = max(written)
    say(f"server killed (SIGKILL) at version >= {st.version}, the newest checkpoint written before at version {ck} "
        f"({len(written)} written); up -d again")
    server.compose("up", "-d")
    wait_for("the server to be healthy again",
             lambda: server.inspect("ps")["State"].get("Health", {}).get("Status") == "healthy", 90, 1.0)
    resumed = [e for e in server_log(server) if e.get("msg") == "resumed from checkpoint"]
    assert resumed, "the restarted server did not resume from a checkpoint"
    v_resumed = int(resumed[-1]["version"])
    assert v_resumed >= ck, f"resumed at {v_resumed}, the newest checkpoint before the kill was {ck}"
    say(f"  resumed from the checkpoint of version {v_resumed} (>= {ck})")
    back = wait_for("the workers to rejoin by themselves",
                    lambda: (lambda s: s if s is not None and len(s.live or []) == WORLD else None)(job.status()),
                    120, 1.0)
    rejoin_s = time.monotonic() - t_kill
    v_back = back.version
    wait_for("training to go on", lambda: job.version() >= v_back + 20, 120)
    say(f"  all {WORLD} workers back {rejoin_s:.1f} s after the kill (ids {sorted(ids)} -> "
        f"{sorted(w.worker for w in back.live)}), training goes on")
    return {"version_before_kill": st.version, "checkpoint_before_kill": ck, "resumed_at": v_resumed,
            "rejoined_after_s": round(rejoin_s, 1)}


def crash(site: Site, job: Job) -> dict[str, Any]:
    """Check 5: a worker's process is killed (a crash); its restart policy brings it back and
    it rejoins; training continues."""
    before = site.inspect("worker-1")
    ids = {w.worker for w in job.live()}
    pid = before["State"]["Pid"]  # the container's init; the worker dies with it
    os.kill(pid, signal.SIGKILL)
    t_kill = time.monotonic()
    v_kill = job.version()
    say(f"crash: {site.project} worker-1 killed (pid {pid}) at version {v_kill:.0f}")

    def back() -> dict | None:
        s = site.inspect("worker-1")
        return s if s["RestartCount"] > before["RestartCount"] and s["State"]["Running"] else None

    s = wait_for("the worker to be restarted by its restart policy", back, 120, 0.5)
    restarted_s = time.monotonic() - t_kill
    rank = SITES["site-b"][1]
    rejoined = wait_for("the restarted worker to rejoin", lambda: [
        w for w in job.live() if w.name == f"train-{rank}" and w.worker not in ids], 120, 0.5)
    rejoin_s = time.monotonic() - t_kill
    v0 = job.version()
    time.sleep(10)
    v1 = job.version()
    assert v1 > v0 + 5, f"training stalled after the crash: version {v0:.0f} -> {v1:.0f} in 10 s"
    say(f"  back after {restarted_s:.1f} s (restart policy {s['HostConfig']['RestartPolicy']['Name']}), "
        f"rejoined as worker {rejoined[0].worker} after {rejoin_s:.1f} s; training continues: version {v0:.0f} -> "
        f"{v1:.0f} in 10 s")
    return {"restarted_after_s": round(restarted_s, 1), "rejoined_after_s": round(rejoin_s, 1),
            "steps_in_10s_after": v1 - v0}


def outsider(site: Site, job: Job) -> dict[str, Any]:
    """Check 1: a site whose key is not on the allowlist: its worker exits with
    Unauthorised within 10 s of starting, and the server counts the refused connection."""
    before = sample(scrape(job.metrics_url), "stella_refused_connections", reason="not_allowed")
    name = f"{site.project}-run"
    t0 = time.monotonic()
    p = site.compose("run", "-T", "--name", name, "worker-0", check=False, timeout=120)
    took = time.monotonic() - t0
    state = json.loads(run(["docker", "inspect", name]).stdout)[0]["State"]
    run(["docker", "rm", "-f", name])
    lived = _seconds(state["FinishedAt"]) - _seconds(state["StartedAt"])
    out = (p.stdout or "") + (p.stderr or "")
    line = next((x for x in out.splitlines() if "Unauthorised" in x), "")
    after = sample(scrape(job.metrics_url), "stella_refused_connections", reason="not_allowed")
    say(f"outsider: its worker exited {p.returncode} {lived:.1f} s after its container started ({took:.1f} s with "
        f"compose creating it): {line[:240]}")
    assert p.returncode != 0 and "refused this client's key" in line, out[-2000:]
    assert lived < REFUSED_WITHIN_S, f"the refused worker took {lived:.1f} s"
    assert after > before, (before, after)
    say(f"  stella_refused_connections_total{{reason=\"not_allowed\"}}: {before:.0f} -> {after:.0f}")
    site.down()
    return {"exit_status": p.returncode, "exited_after_s": round(lived, 1), "compose_run_s": round(took, 1)}


def _seconds(stamp: str) -> float:
    """An engine's RFC 3339 time (nanoseconds, Z) as epoch seconds."""
    from datetime import datetime, timezone

    day, _, frac = stamp.rstrip("Z").partition(".")
    base = datetime.strptime(day, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc).timestamp()
    return base + float("0." + (frac or "0"))


def revoke(server: Site, site: Site, job: Job, keys_dir: str, line: str) -> dict[str, Any]:
    """Check 6: the site's line removed from the allowlist with sed -i: its workers are
    dropped within one liveness timeout, and their next connection is refused."""
    from stella.protocol import key_fingerprint

    path = os.path.join(keys_dir, "allowlist")
    fingerprint = key_fingerprint(line.split()[0])
    ino = os.stat(path).st_ino
    run(["sed", "-i", f"/ {re.escape(line.split()[1])}$/d", path])
    t0, t0_wall = time.monotonic(), time.time()
    assert os.stat(path).st_ino != ino  # sed -i writes a new file: a single-file mount would still see the old
    say(f"revoked: site-b's line removed from the allowlist with sed -i (key {fingerprint})")
    wait_for("site-b's workers to be dropped", lambda: (lambda st: st is not None and not [
        w for w in st.live or [] if w.key_fingerprint == fingerprint])(job.status()), LIVENESS_S + 5, 0.5)
    dropped_s = time.monotonic() - t0
    assert dropped_s <= LIVENESS_S, f"dropped after {dropped_s:.1f} s, the liveness timeout is {LIVENESS_S:g} s"
    say(f"  site-b's workers dropped after {dropped_s:.1f} s (liveness timeout {LIVENESS_S:g} s)")

    def refused() -> dict | None:
        return next((e for e in server_log(server) if e.get("ts", 0) >= t0_wall
                     and e.get("msg") == "connection refused: key not on the allowlist"
                     and e.get("key_fingerprint") == fingerprint), None)

    wait_for("site-b's next connection to be refused", refused, 60, 1.0)
    refused_s = time.monotonic() - t0
    logs = site.logs("worker-0") + site.logs("worker-1")
    told = [x for x in logs.splitlines() if "Unauthorised" in x]
    assert told, "site-b's workers did not say Unauthorised"
    say(f"  their next connection refused after {refused_s:.1f} s (the server logs its fingerprint); a worker "
        f"says: {told[-1][:200]}")
    site.down()
    return {"dropped_after_s": round(dropped_s, 1), "refused_after_s": round(refused_s, 1)}


def down_site(server: Site, site: Site, job: Job) -> dict[str, Any]:
    """Check 7: `down` of a worker site takes under 5 s, and its workers leave cleanly."""
    st = job.status()
    assert st is not None
    ids = sorted(w.worker for w in st.live or [] if w.key_name == "site-a")
    assert len(ids) == 2, st.live
    # rank 0's last words, read while `down` removes its container
    follow = subprocess.Popen(["docker", "logs", "-f", "--since", "1s", site.container("worker-0")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0_wall, t0 = time.time(), time.monotonic()
    site.compose("down", "--timeout", "30")
    took = time.monotonic() - t0
    try:
        words, _ = follow.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        follow.kill()
        words, _ = follow.communicate()
    log = [e for e in server_log(server) if e.get("ts", 0) >= t0_wall]
    left = sorted(e["worker"] for e in log if e.get("msg") == "worker left")
    gone = [e for e in log if "declared gone" in str(e.get("msg"))]
    final = [x for x in words.splitlines() if x.startswith("train.py: stopped")]
    say(f"down of {site.project}: {took:.1f} s; the server logged 'worker left' for {left} (site-a's: {ids}), "
        f"no liveness timeout: {not gone}")
    if final:
        say(f"  rank 0's last words: {final[-1]}")
    assert took < DOWN_WITHIN_S, f"down took {took:.1f} s"
    assert left == ids and not gone, (left, gone)
    return {"down_s": round(took, 1), "left": left}


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
    say(f"images ready in {time.monotonic() - t0:.0f} s")
    if what == "images":
        return 0
    report = lab_test(compose, sizes)
    say(f"PASSED in {time.monotonic() - t0:.0f} s: {json.dumps(report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
