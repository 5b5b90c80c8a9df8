"""bench.server's pinned mode: each shard's threads on a core of their own, one thread
each, the light workers on the cores left over; a real run on loopback. The pinning is
checked by the threads' affinity, which a busy machine cannot change; the CPU shares it
measures are the benchmark's to print."""
from __future__ import annotations

import os

import pytest

from bench import server as S

CPUS = sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize("shards", [1, 2])
def test_pinned_shards_run_on_a_core_each(shards):
    if len(CPUS) < shards:
        pytest.skip(f"{shards} shards pinned need {shards} usable cores, this process has {len(CPUS)}")
    r = S.run_throughput(200_000, 0.01, workers=2, steps=20, optimizer="sgd", shards=shards, pin=True)
    assert r["pinned"] and r["shards"] == shards
    assert r["server_cpus"] == [[CPUS[i]] for i in range(shards)]  # every thread of shard i on core i alone
    assert r["steps_per_s"] > 0 and r["bytes_pushed_per_step"] > 0 and r["bytes_pulled_per_step"] > 0
    # both CPU shares are measured (CPU time over wall time, whatever the machine's load); how many
    # cores the pinned shards kept busy is bench.server's table ("srv cores"), not a bound here: over a
    # short run the counters' 10 ms ticks and a busy machine put it a few percent either side
    assert r["worker_cores_busy"] > 0 and r["server_cores_busy"] > 0


def test_unpinned_servers_may_use_every_core():
    r = S.run_throughput(200_000, 0.01, workers=2, steps=10, optimizer="sgd")
    assert not r["pinned"] and r["server_cpus"] == [CPUS]


def test_push_decode_cost_times_the_loops_work_on_one_push_of_the_run():
    r = S.push_decode_cost(80_000, 0.01, reps=5)
    assert r["entries"] == S.TENSORS * 100  # 1% of each of the 8 tensors of 10,000
    assert min(r["header_us"], r["tensors_us"], r["norm_us"]) > 0
    assert r["total_us"] == pytest.approx(r["header_us"] + r["tensors_us"] + r["norm_us"], abs=0.02)
    assert r["ns_per_entry"] == pytest.approx(1e3 * r["total_us"] / r["entries"], rel=0.01)


def test_one_host_runs_the_shards_through_the_supervisor():
    """``--one-host``: ``stella-ps --shards 2`` starts the shards, each pinned to its share of
    the cores; the workers are given the first address and find the other shard."""
    if len(CPUS) < 2:
        pytest.skip(f"2 shards pinned need 2 usable cores, this process has {len(CPUS)}")
    r = S.run_throughput(200_000, 0.01, workers=2, steps=10, optimizer="sgd", shards=2, one_host=True)
    assert r["one_host"] and r["shards"] == 2
    half = -(-len(CPUS) // 2)  # the first share takes the odd core
    shares = [CPUS[:half], CPUS[half:]]
    assert r["server_cpus"] == [CPUS, *shares]  # the supervisor, then each shard on its share
    assert r["steps_per_s"] > 0 and r["bytes_pushed_per_step"] > 0 and r["bytes_pulled_per_step"] > 0
