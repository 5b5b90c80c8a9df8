"""``stella status``'s job line names the training mode and the server's optimizer
(update mode: the outer step, recognised by its preset), from ``StatusReply`` objects
built here; and that a real server's config of each preset is recognised."""
from __future__ import annotations

import io
import json
import subprocess
import sys

import msgspec
import numpy as np
import pytest

from stella import Client
from stella.modes import OUTER_PRESETS, outer_preset
from stella.protocol import StatusReply
from stella.status import rates, render, render_shards, watch


def sgd(**hp) -> dict:
    """An SGD config as the server answers it: every hyper-parameter filled in, in its order."""
    full = {"lr": 0.001, "weight_decay": 0.0, "momentum": 0.0, "dampening": 0.0, "nesterov": False,
            "momentum_mode": "fold", "lr_worker_exponent": 0.0, "count_exponent": 0.0, "count_taper_from": 0.0,
            "count_taper_to": 0.0, **hp}
    return {"name": "sgd", **full}


AVERAGE = sgd(**{k: v for k, v in OUTER_PRESETS["average"].items() if k != "name"})
NESTEROV = sgd(**{k: v for k, v in OUTER_PRESETS["nesterov"].items() if k != "name"})
SQRT = sgd(**{k: v for k, v in OUTER_PRESETS["sqrt"].items() if k != "name"})
COUNT = sgd(**{k: v for k, v in OUTER_PRESETS["count"].items() if k != "name"})
TAPERED = sgd(**{k: v for k, v in OUTER_PRESETS["tapered"].items() if k != "name"})
ADAMW = {"name": "adamw", "lr": 0.001, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-08}


def reply(optimizer, mode=None) -> StatusReply:
    return StatusReply(version=3, initialised=True, workers=[], worker_keys={}, insecure=False, expected_workers=2,
                       pending_pushes=0, steps=10, pushes=0, pulls=0, late_pushes=0, bytes_in=0, bytes_out=0,
                       messages=0, errors=0, uptime_s=5.0, numel=8, tensors=1, optimizer=optimizer, mode=mode)


def job(st: StatusReply) -> str:
    head = render(st, rates(st, None, None)).splitlines()[0]
    return head.split("| workers 0/2 | ")[1]


@pytest.mark.parametrize("optimizer,mode,expect", [
    (AVERAGE, "update", "mode update, outer average"),
    (NESTEROV, "update", "mode update, outer nesterov(lr 0.7, momentum 0.9)"),
    (SQRT, "update", "mode update, outer sqrt(lr 1, lr_worker_exponent 0.5)"),
    (COUNT, "update", "mode update, outer count(lr 1, count_exponent 0.5)"),
    (TAPERED, "update", "mode update, outer tapered(lr 1, count_exponent 0.5, count_taper_from 0.02, "
                        "count_taper_to 0.1)"),
    # any other outer config: its name and the hyper-parameters that are not off
    ({**NESTEROV, "lr": 0.35}, "update", "mode update, outer sgd(lr 0.35, momentum 0.9, nesterov True, "
                                         "momentum_mode lazy)"),
    ({**AVERAGE, "lr": 0.5}, "update", "mode update, outer sgd(lr 0.5, momentum_mode fold)"),  # not a mean
    ({**AVERAGE, "momentum": 0.5}, "update", "mode update, outer sgd(lr 1, momentum 0.5, momentum_mode fold)"),
    (ADAMW, "gradient", "mode gradient, optimizer adamw(lr 0.001, weight_decay 0.01, betas (0.9, 0.999), "
                        "eps 1e-08)"),
    (sgd(lr=0.05, momentum=0.9), "gradient", "mode gradient, optimizer sgd(lr 0.05, momentum 0.9, momentum_mode fold)"),
    (AVERAGE, None, "sgd"),  # a server that does not say the mode: as before
    (ADAMW, None, "adamw"),
    (None, None, "-"),
])
def test_the_job_line_names_the_mode_and_the_optimizer(optimizer, mode, expect):
    assert job(reply(optimizer, mode)) == expect


def test_insecure_still_ends_the_job_line():
    st = msgspec.structs.replace(reply(AVERAGE, "update"), insecure=True)
    assert job(st) == "mode update, outer average | INSECURE"


def test_a_failing_checkpoint_write_is_on_the_job_line_until_one_succeeds():
    st = msgspec.structs.replace(reply(AVERAGE, "update"), checkpoint_age_s=600.0, checkpoint_version=2,
                                 checkpoint_error="ENOSPC: No space left on device", checkpoint_failures=3)
    head = render(st, rates(st, None, None)).splitlines()[0]
    assert ("| checkpoint 10m ago | CHECKPOINT FAILING: ENOSPC: No space left on device (3 failed, version 2 kept) "
            "| workers 0/2 |") in head
    shards = render_shards([st, reply(AVERAGE, "update")], [rates(st, None, None)] * 2, ["a", "b"]).splitlines()
    assert shards[0].endswith("| CHECKPOINT FAILING") and "CHECKPOINT FAILING: ENOSPC" in shards[1]
    assert "FAILING" not in shards[2]
    cleared = msgspec.structs.replace(st, checkpoint_error=None)  # a write succeeded again; the count stays
    assert "FAILING" not in render(cleared, rates(cleared, None, None))


def test_outer_presets_are_recognised_in_the_servers_full_config():
    assert outer_preset(AVERAGE) == "average" and outer_preset(NESTEROV) == "nesterov"
    assert outer_preset(OUTER_PRESETS["average"]) == "average"  # as registered, before the server fills it in
    assert outer_preset({**AVERAGE, "weight_decay": 0.1}) is None  # a number left on changes the step
    assert outer_preset({**NESTEROV, "momentum_mode": "fold"}) is None
    assert outer_preset(ADAMW) is None and outer_preset({}) is None


def test_json_is_the_plain_reply_with_the_mode():
    out = io.StringIO()
    watch(lambda: reply(NESTEROV, "update"), as_json=True, out=out)
    got = json.loads(out.getvalue())
    assert got["mode"] == "update" and got["optimizer"]["momentum"] == 0.9 and "type" not in got


def test_status_imports_no_torch():
    code = "import sys, stella.status; sys.exit(bool({'torch'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("preset", sorted(OUTER_PRESETS))
def test_a_real_servers_config_of_each_preset_is_recognised(make_server, preset):
    with Client(make_server(1).endpoint, timeout=10) as c:
        reply = c.register({"w": np.zeros(4, np.float32)}, OUTER_PRESETS[preset], mode="update")
    assert reply.optimizer is not None and outer_preset(reply.optimizer) == preset
