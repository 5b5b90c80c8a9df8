"""stella-ps settings are declared once (server/stella_ps/config.py): the flags, the
environment variables, --help, the checks and README's table all come from the one
declaration."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from stella_ps import config
from stella_ps.config import ENV, Checkpoints, ConfigError, Deadline, Limits, ServerConfig, parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_readme_table_is_the_declarations():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    assert config.readme_with_table(text) == text, \
        "README's settings table is stale: run `python -m stella_ps.config README.md`"
    assert text.count("| `--") >= len(ENV)


def test_every_setting_has_a_flag_an_environment_variable_and_its_default_in_help():
    out = subprocess.run([sys.executable, "-m", "stella_ps", "--help"], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if not k.startswith("STELLA_PS_")}).stdout
    flat = " ".join(out.split())  # argparse wraps lines
    assert len(ENV) >= 35
    for flag, var in ENV.items():
        assert var == "STELLA_PS_" + flag.replace("-", "_").upper()
        assert f"--{flag}" in flat and f"env {var}" in flat, flag
    assert flat.count("(default: ") == len(ENV)
    assert "a checkpoint every this many seconds; 0: not by time (default: 300.0;" in flat


def test_environment_values_are_parsed_and_checked_naming_the_variable(capsys):
    env = {"STELLA_PS_INSECURE": "1", "STELLA_PS_CHECKPOINT_DIR": "/tmp/ck", "STELLA_PS_DEADLINE_MIN": "0.5",
           "STELLA_PS_ADAPTIVE_DEADLINE": "no", "STELLA_PS_MAX_LR": ""}
    cfg = parse_args([], environ=env)
    assert cfg.insecure and cfg.checkpoints.dir == "/tmp/ck" and cfg.deadline.min == 0.5
    assert not cfg.deadline.adaptive and cfg.limits.max_lr is None
    assert parse_args(["--deadline-min", "2"], environ=env).deadline.min == 2.0  # flag > environment
    for var, bad in (("STELLA_PS_WORKERS", "two"), ("STELLA_PS_INSECURE", "maybe"), ("STELLA_PS_WORKERS", "0")):
        with pytest.raises(SystemExit):
            parse_args([], environ={**env, var: bad})
        err = capsys.readouterr().err
        assert var in err or ("--workers=0" in err and ">= 1" in err), err


@pytest.mark.parametrize(("make", "what"), [
    (lambda: Limits(max_workers=0), "--max-workers"),
    (lambda: Limits(push_norm_action="ignore"), "--push-norm-action"),
    (lambda: Deadline(min=5.0, max=1.0), "--deadline-min"),
    (lambda: Deadline(quantile=1.5), "--deadline-quantile"),
    (lambda: Checkpoints(keep=0), "--checkpoint-keep"),
    (lambda: ServerConfig(metrics="host:http"), "HOST:PORT"),
    (lambda: ServerConfig(limits=Limits(max_lr=0.1)), "--max-lr"),  # the default optimizer's lr is 1e-3: fine
])
def test_a_configuration_built_in_code_is_checked_as_the_flags_are(make, what):
    if what == "--max-lr":
        ServerConfig(limits=Limits(max_lr=0.1))
        with pytest.raises(ConfigError, match=what):
            ServerConfig(optimizer=config.parse_optimizer("sgd:lr=0.5"), limits=Limits(max_lr=0.1))
        return
    with pytest.raises(ConfigError, match=what):
        make()


def test_the_groups_are_handed_to_their_owners_whole():
    cfg = parse_args(["--insecure", "--checkpoint-every-steps", "7", "--liveness-timeout", "8"])
    assert cfg.checkpoints.every_steps == 7 and cfg.liveness.heartbeat_s == 1.0  # 8 / 4, at most a second
    assert {f.name for f in dataclasses.fields(ServerConfig)} >= {"limits", "liveness", "deadline", "checkpoints"}
