"""Workloads: deterministic by seed, sizes as documented, same global batch whatever the split."""

import pytest
import torch

from bench import workloads as W


@pytest.mark.parametrize("name,lo,hi", [("digits", 4e5, 7e5), ("widemlp", 9e6, 11e6), ("bytelm", 10e6, 30e6)])
def test_param_counts(name, lo, hi):
    assert lo <= W.count_params(W.get(name).build_model(0)) <= hi


@pytest.mark.parametrize("name", ["digits", "bytelm"])
def test_batches_deterministic_and_split_by_rank(name):
    wl = W.get(name)
    a = [next(wl.batches(r, 2, 4, 3)) for r in range(2)]
    b = [next(wl.batches(r, 2, 4, 3)) for r in range(2)]
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    whole = next(wl.batches(0, 1, 8, 3))
    assert torch.equal(torch.cat([a[0][0], a[1][0]]), whole[0])  # same global batch, any split
    assert not torch.equal(a[0][0], next(wl.batches(0, 2, 4, 4))[0])


def test_models_seeded():
    m1, m2 = W.get("digits").build_model(5), W.get("digits").build_model(5)
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))


def test_corpus_split_by_file():
    c = W.stdlib_corpus()
    assert c["files"] > 500 and len(c["train"]) > 5_000_000 and len(c["heldout"]) > 50_000


def test_eval_metrics_in_range():
    wl = W.get("digits")
    acc = wl.evaluate(wl.build_model(0))
    assert 0.0 <= acc <= 1.0
    assert wl.reached(0.96) and not wl.reached(0.5)
    lm = W.get("bytelm")
    assert not lm.higher_is_better and lm.reached(2.0)
    assert lm.lr_at(0) < lm.lr_at(100) == lm.lr


def test_digits_workloads_use_the_demo_split():
    from stella.demo import load_digits_split

    ref = load_digits_split(0)
    assert all(torch.equal(a, b) for a, b in zip(W.digits_data(), ref))
