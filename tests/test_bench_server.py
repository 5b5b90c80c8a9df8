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
    # 150 steps: each shard's CPU over the run, read from /proc in 10 ms units, is then several units (20 steps
    # took under 10 ms a shard: CI once read 0)
    r = S.run_throughput(200_000, 0.01, workers=2, steps=150, optimizer="sgd", shards=shards, pin=True)
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
    assert r["entries"] == 800  # 1% of the one part of 80,000
    assert min(r["header_us"], r["tensors_us"], r["norm_us"]) > 0
    assert r["total_us"] == pytest.approx(r["header_us"] + r["tensors_us"] + r["norm_us"], abs=0.02)
    assert r["ns_per_entry"] == pytest.approx(1e3 * r["total_us"] / r["entries"], rel=0.01)


@pytest.mark.parametrize("numel,tensors", [(10_000_000, 76), (100_000_000, 300), (100_000, 76), (1000, 1), (999, 4)])
def test_model_sizes_lays_out_the_asked_tensor_count_and_model_size(numel, tensors):
    sizes = S.model_sizes(numel, tensors)
    assert len(sizes) == tensors and sum(sizes) == numel and min(sizes) > 0


def test_a_transformer_layout_pushes_its_small_tensors_whole_and_the_kernel_is_timed_beside_it():
    """76 tensors (the byte LM's count): the biases and norms are under the server's dense
    cut (4096), so a push carries them whole besides 1% of the large ones; ``kernel_cost``
    times the kernel on the same step and gives the server's cost over it."""
    sizes = S.model_sizes(1_000_000, 76)
    small = sum(n for n in sizes if n < 4096)
    assert 0 < small < 1_000_000 // 10
    r = S.run_throughput(1_000_000, 0.01, workers=2, steps=10, optimizer="sgd", tensors=76)
    large = sum(max(1, int(n * 0.01)) for n in sizes if n >= 4096)
    assert r["tensors"] == 76 and r["updates_per_push"] == small + large
    S.kernel_cost([r], allocations=2)
    assert r["kernel_cpu_ns_per_update"] > 0
    lo, hi = r["kernel_cpu_ns_spread"]  # the least of two fresh states is the one taken
    assert lo == r["kernel_cpu_ns_per_update"] <= hi
    assert r["x_kernel"] == pytest.approx(r["server_cpu_ns_per_update"] / r["kernel_cpu_ns_per_update"], rel=0.01)


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


def test_per_worker_costs_fit_a_line_through_each_configurations_worker_counts():
    """b is what each added worker costs a step, a the step's own; repeats are averaged
    first; configurations run at one worker count, or on several shards, give no line."""
    from bench.server import per_worker_costs

    def row(w, ms, **kw):
        return {"shards": 1, "tensors": 1, "optimizer": "sgd", "messages": 1, "workers": w,
                "server_cpu_ms_per_step": ms, **kw}

    rows = [row(2, 0.6), row(8, 1.9), row(2, 0.8), row(32, 6.7),  # 0.3 + 0.2 W, W = 2 twice (0.6, 0.8: 0.7)
            row(2, 0.9, messages=2), row(8, 2.1, messages=2),
            row(2, 1.0, optimizer="adamw"), row(2, 3.0, shards=2), row(8, 9.0, shards=2)]
    got = {(m["optimizer"], m["messages"]): m for m in per_worker_costs(rows)}
    assert set(got) == {("sgd", 1), ("sgd", 2)}
    assert got["sgd", 1]["workers"] == "2,8,32"
    assert got["sgd", 1]["ms_per_added_worker"] == pytest.approx(0.2, abs=1e-3)
    assert got["sgd", 1]["fixed_ms_per_step"] == pytest.approx(0.3, abs=1e-3)
    assert got["sgd", 2]["ms_per_added_worker"] == pytest.approx(0.2) and got["sgd", 2]["fixed_ms_per_step"] == \
        pytest.approx(0.5)
