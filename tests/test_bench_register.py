"""bench.register on a real server: at job start the model crosses the wire once with
the client library's held probes, and once per worker when each sends it."""
from __future__ import annotations

from bench import register as R


def test_the_model_crosses_the_wire_once_when_workers_start_together():
    held = R.run(6, 200_000, "held")
    each = R.run(6, 200_000, "each_sends")
    model = 4 * 200_000
    # bytes_in also counts the joins, probes and status calls: a few kB
    assert model <= held["bytes_in"] < model + 64_000, held
    assert 6 * model <= each["bytes_in"] < 6 * model + 64_000, each
