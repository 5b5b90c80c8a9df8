"""bench.register on a real server: at job start the model crosses the wire once with
the client library's held probes, and once per worker when each sends it; the workers
holding the model's values pull no snapshot with the digest, one each without it."""
from __future__ import annotations

from bench import register as R


def test_the_model_crosses_the_wire_once_when_workers_start_together():
    digest = R.run(6, 200_000, "digest")
    snapshots = R.run(6, 200_000, "snapshots")
    each = R.run(6, 200_000, "each_sends")
    model = 4 * 200_000
    # bytes_in and bytes_out also count the joins, probes, replies and status calls: a few kB
    for r in (digest, snapshots):
        assert model <= r["bytes_in"] < model + 64_000, r
    assert 6 * model <= each["bytes_in"] < 6 * model + 64_000, each
    assert digest["bytes_out"] < 64_000, digest  # nobody pulled the model
    for r in (snapshots, each):
        assert 5 * model <= r["bytes_out"] < 5 * model + 64_000, r  # every worker but the first
