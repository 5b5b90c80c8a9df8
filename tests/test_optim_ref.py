"""Lazy sparse optimizer semantics (the NumPy reference the C kernel is held to)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from stella_ps.optim import ConfigError, OptimizerConfig
from stella_ps.optim_ref import RefTensorState, merge_pushes

CASES = [
    ("sgd", {"lr": 0.1}),
    ("sgd", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01, "momentum_mode": "lazy"}),
    ("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "momentum_mode": "lazy"}),
    ("sgd", {"lr": 0.1, "momentum": 0.9, "dampening": 0.5, "weight_decay": 0.01}),  # fold (default)
    ("adam", {"lr": 0.01, "weight_decay": 0.1}),
    ("adamw", {"lr": 0.01, "betas": (0.8, 0.99)}),
]
TORCH = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


@pytest.mark.parametrize("name,hp", CASES)
def test_equals_torch_when_every_coordinate_is_touched(name, hp):
    """With dense updates every step, lazy == dense: the reference must match PyTorch."""
    cfg = OptimizerConfig.from_wire({"name": name, **hp})
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal(257).astype(np.float32)
    st = RefTensorState(x0, cfg)
    p = torch.nn.Parameter(torch.tensor(x0))
    if hp.get("momentum") and hp.get("momentum_mode", "fold") == "fold":
        # folded momentum == momentum-free SGD at lr * (1 - dampening) / (1 - momentum)
        lr = hp["lr"] * (1 - hp.get("dampening", 0.0)) / (1 - hp["momentum"])
        opt = torch.optim.SGD([p], lr=lr, weight_decay=hp.get("weight_decay", 0.0))
    else:
        opt = TORCH[name]([p], **{k: v for k, v in hp.items() if k != "momentum_mode"})
    for _ in range(30):
        g = rng.standard_normal(257).astype(np.float32)
        st.apply([(None, g)], 1.0, cfg)
        p.grad = torch.from_numpy(g)
        opt.step()
    np.testing.assert_allclose(st.param, p.detach().numpy(), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name,hp", CASES)
def test_untouched_coordinates_are_frozen(name, hp):
    cfg = OptimizerConfig.from_wire({"name": name, **hp})
    x0 = np.linspace(-1, 1, 50, dtype=np.float32)
    st = RefTensorState(x0, cfg)
    st.apply([(None, np.ones(50, np.float32))], 1.0, cfg)  # gives every coordinate state
    frozen = {k: v.copy() for k, v in vars(st).items() if isinstance(v, np.ndarray)}
    touched = np.array([3, 17], np.int32)
    for _ in range(5):
        st.apply([(touched, np.ones(2, np.float32))], 1.0, cfg)
    for k, before in frozen.items():
        after = getattr(st, k)
        keep = np.setdiff1d(np.arange(50), touched)
        np.testing.assert_array_equal(after[keep], before[keep], err_msg=k)
        if k == "param":
            assert (after[touched] != before[touched]).all()


def test_folded_momentum_moves_an_impulse_by_the_full_momentum_gain():
    """A coordinate touched once with update G moves by lr * G / (1 - momentum) at once under
    "fold" (what dense momentum SGD moves it in total, over many steps); under "lazy" it moves
    by lr * G now and the rest only at its later touches."""
    fold = OptimizerConfig.from_wire({"name": "sgd", "lr": 0.1, "momentum": 0.9})
    lazy = fold.updated({"momentum_mode": "lazy"})
    assert fold.hparams["momentum_mode"] == "fold"
    moved = {}
    for cfg in (fold, lazy):
        st = RefTensorState(np.zeros(8, np.float32), cfg)
        st.apply([(np.array([2], np.int32), np.array([1.0], np.float32))], 1.0, cfg)
        moved[cfg.hparams["momentum_mode"]] = -float(st.param[2])
    assert moved["fold"] == pytest.approx(1.0, rel=1e-6)
    assert moved["lazy"] == pytest.approx(0.1, rel=1e-6)
    with pytest.raises(ConfigError, match="momentum_mode"):
        fold.updated({"momentum_mode": "eager"})


def test_adam_bias_correction_is_per_coordinate():
    """A coordinate first touched at step 100 takes a first Adam step of size lr (|m/sqrt(v)| = 1)."""
    cfg = OptimizerConfig.from_wire({"name": "adam", "lr": 0.01})
    st = RefTensorState(np.zeros(4, np.float32), cfg)
    for _ in range(100):
        st.apply([(np.array([0], np.int32), np.array([1.0], np.float32))], 1.0, cfg)
    st.apply([(np.array([3], np.int32), np.array([5.0], np.float32))], 1.0, cfg)
    assert st.step.tolist() == [100, 0, 0, 1]
    np.testing.assert_allclose(st.param[3], -0.01, rtol=1e-5)


def test_merge_sums_duplicates_in_push_order_then_scales():
    a = (np.array([1, 4], np.int32), np.array([1.0, 2.0], np.float32))
    b = (np.array([4, 6], np.int32), np.array([10.0, 3.0], np.float32))
    dense = (None, np.ones(8, np.float32))
    idx, g = merge_pushes([a, b], 8, 0.5)
    assert idx.tolist() == [1, 4, 6] and g.tolist() == [0.5, 6.0, 1.5]
    idx, g = merge_pushes([a, dense], 8, 0.5)
    assert idx.tolist() == list(range(8))
    np.testing.assert_array_equal(g, [0.5, 1.0, 0.5, 0.5, 1.5, 0.5, 0.5, 0.5])


def test_config_validation_uses_pytorch_names_and_defaults():
    cfg = OptimizerConfig.from_wire({"name": "AdamW"})
    assert cfg.hparams == {"lr": 1e-3, "weight_decay": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8}
    assert cfg.updated({"lr": 0.5}).hparams["lr"] == 0.5
    for bad, msg in [({"name": "lamb"}, "unknown optimizer"), ({"name": "sgd", "lr": -1}, "outside"),
                     ({"name": "adam", "betas": [0.9, 1.0]}, "betas"), ({"name": "sgd", "nesterov": True}, "nesterov"),
                     ({"name": "sgd", "lr": "fast"}, "number"), ({"name": "sgd", "gamma": 1}, "unknown hyper")]:
        with pytest.raises(ConfigError, match=msg):
            OptimizerConfig.from_wire(bad)
