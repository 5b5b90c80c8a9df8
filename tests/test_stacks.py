"""The training stacks people already use (issue 46), each through its runnable example in
examples/, run the way its docstring says (one command: a local stella-ps and two workers),
with small step counts: exit status 0 and the loss each test states. Lightning, a torchrun
site, the Hugging Face Trainer (bf16, accumulation, save_steps, evaluation, resume against a
new stella-ps), Accelerate, autocast (bf16; fp16 with GradScaler) with torch.compile in both
modes, and the README's plain loop. A stack whose extra is not installed is skipped, saying
which."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run_example(script: str, *args: str, timeout: float = 180.0) -> list[dict[str, Any]]:
    """``python examples/<script> args...`` from the repository root, as a user runs it from a
    fresh shell (none of the test session's STELLA_* keys: the launcher makes its own);
    asserts it exited 0 and returns the JSON lines it printed (one per worker or site)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STELLA_")}
    r = subprocess.run([sys.executable, f"examples/{script}", *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, f"{script} {' '.join(args)} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return figures(r.stdout)


def figures(out: str) -> list[dict[str, Any]]:
    """The workers' figures in their shared stdout: each a JSON object written in one system
    call (examples/common.py's report), so whole, though another worker's unfinished line
    may precede it; ordered by rank (or site)."""
    found, dec = [], json.JSONDecoder()
    for m in re.finditer(r'\{"(?:rank|site)": ', out):
        found.append(dec.raw_decode(out, m.start())[0])
    return sorted(found, key=lambda f: f.get("rank", f.get("site", 0)))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lightning_module_trains_clips_schedules_and_resumes_against_a_new_server(tmp_path):
    """Two Lightning workers (configure_optimizers returns StellaOptimizer + a LambdaLR,
    gradient_clip_val=1.0, accumulate_grad_batches=2 whose halves BatchNoise splits by
    counting the backward passes) train 40 steps with a checkpoint at 40; then two new workers
    resume from it (trainer.fit(ckpt_path=...)) against a NEW stella-ps (each run of the
    example starts its own) and train to 45. Measured here (with the accumulation and
    BatchNoise): held-out 2.71 at 40 (5.5 at the start), 2.70 at 45; the first resumed step's
    training loss 2.75-2.86 against 2.89-2.91 at 40."""
    pytest.importorskip("lightning", reason="the Lightning example needs the extra stella[lightning]")
    pytest.importorskip("transformers", reason="the Lightning example's model needs transformers (stella[hf])")
    out = str(tmp_path / "ckpt")
    common = ["--schedule-steps", "45", "--save-steps", "40", "--output-dir", out, "--accumulate", "2"]
    first = run_example("lightning_module.py", "--steps", "40", "--target", "3.0", *common)
    assert sorted(f["rank"] for f in first) == [0, 1]
    for f in first:
        assert f["steps"] == 40 and f["losses"]["1"] > 5.0 and f["heldout_loss"] < 3.0
        assert f["max_grad_norm_stepped"] <= 1.0 + 1e-4  # Lightning's clipping happened before the inner AdamW's step
        assert f["lr"] == pytest.approx(f["scheduled_lr"])  # the scheduler on the wrapper drives the inner AdamW
        # the default BatchNoise: a noise sample a step from the second on, every parameter (Lightning's
        # accumulation split at its middle)
        assert f["noise_counts"] == [39]
        assert os.path.exists(os.path.join(out, f"rank{f['rank']}", "checkpoint-40.ckpt"))

    resumed = run_example("lightning_module.py", "--steps", "45", "--resume", "--target", "0", *common)
    at40 = {f["rank"]: f for f in first}
    saved = {r: torch.load(os.path.join(out, f"rank{r}", "checkpoint-40.ckpt"), map_location="cpu",
                           weights_only=False)["optimizer_states"][0]["version"] for r in at40}
    for f in resumed:
        was = at40[f["rank"]]
        assert f["resumed_from"].endswith("checkpoint-40.ckpt") and f["steps"] == 45
        assert min(map(int, f["losses"])) == 41  # the fit loop went on from the checkpoint's step
        # the checkpoint's model, not the random one (5.5): the bar, within 2%
        assert f["heldout_loss"] <= 1.02 * was["heldout_loss"]
        assert f["losses"]["41"] < 1.15 * was["train_loss"]
        # the new server's count starts at the version of the checkpoint that created its model, one rank's (a
        # new model would count from 0: 5 steps, at most 5 rounds); the ranks' may differ (update mode rounds as
        # its exchanges come back, fewer a step on a loaded machine: 34 and 40 in one CI run), and neither is
        # above its first run's last version, which may lie a few rounds past it
        assert 10 < saved[f["rank"]] <= was["version"] and f["version"] >= min(saved.values()), (saved, f["version"])
        assert f["lr"] == pytest.approx(f["scheduled_lr"])  # (after load_state_dict too)
        assert f["noise_counts"] == [44]  # the checkpoint's running noise came back, and five steps added to it


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_site_of_two_gloo_ranks_is_one_worker(tmp_path):
    """Two sites, each ``torchrun --standalone --nproc_per_node 2`` of the example (gloo on
    CPU), through one stella-ps, 40 steps. Measured here: held-out 1.95-1.96 (5.4-5.5 at
    the first step; 1.79-1.80 after 60); the ranks of a site end identical and only rank 0
    pushed."""
    figures = run_example("torchrun_site.py", "--steps", "40", "--target", "2.2")
    assert sorted(f["site"] for f in figures) == [0, 1], figures  # one report per site (its rank 0)
    for f in figures:
        assert f["ranks"] == 2 and f["ranks_identical"], f
        assert f["bytes_pushed_by_rank"][0] > 0 and f["bytes_pushed_by_rank"][1] == 0, f  # the leader speaks for it
        assert f["first_loss"] > 5.0 and f["heldout_loss"] < 2.2, f
        # each of the site's 40 rounds is in a step of its own (40 here: both sites in each step; more when the
        # server's adaptive deadline closed a step without a late site)
        assert f["version"] >= 40, f


@pytest.mark.slow
def test_hf_trainer_trains_saves_evaluates_and_resumes_against_a_new_server(tmp_path):
    """Two Trainer workers (bf16, accumulation 2 whose halves the default BatchNoise splits by counting
    the backward passes, the Trainer's clip, a checkpoint at step 20, evaluation), then both resumed
    from checkpoint-20 against a new stella-ps: the loss 5 steps after the resume is no
    higher than at the checkpoint (within 2%; issue 46 saw it go back to the random
    initialisation's) and follows the uninterrupted run's; the checkpoint holds the
    running noise of every parameter, a sample a step from the second."""
    pytest.importorskip("transformers", reason="the Hugging Face stack is an extra: pip install 'stella[hf]'")
    common = ["--output-dir", str(tmp_path), "--steps", "30", "--save-steps", "20", "--log-steps", "5", "--bf16",
              "--accumulate", "2"]
    first = run_example("hf_trainer.py", *common, "--target", "3.6")
    assert [r["rank"] for r in first] == [0, 1]
    for r in first:
        assert r["losses"]["5"] > r["losses"]["30"] + 1.0 and r["heldout_loss"] < 3.6  # it learns
        assert r["version"] >= 25
    assert all((tmp_path / f"rank{r}" / "checkpoint-20" / "optimizer.pt").exists() for r in (0, 1))
    states = {r: torch.load(tmp_path / f"rank{r}" / "checkpoint-20" / "optimizer.pt", map_location="cpu",
                            weights_only=False) for r in (0, 1)}
    saved = {r: st["version"] for r, st in states.items()}
    for st in states.values():
        noise = st["batch_noise"]["noise"]
        assert noise and {e["count"] for e in noise.values()} == {19}, {k: e["count"] for k, e in noise.items()}
        assert all(bool(torch.isfinite(e["noise"]).all()) and float(e["noise"].max()) > 0 for e in noise.values())
    again = run_example("hf_trainer.py", *common, "--resume", "checkpoint-20", "--target", "3.6")
    for before, after in zip(first, again):
        at_n, resumed = before["losses"]["20"], after["losses"]["25"]
        assert resumed <= 1.02 * at_n, (before["losses"], after["losses"])
        assert abs(resumed - before["losses"]["25"]) <= 0.05 * before["losses"]["25"]
        # the new server counted on from the version of the checkpoint that created its model, one rank's (a new
        # model would count from 0: 10 steps, about 10 rounds); the ranks' may differ (update mode rounds as its
        # exchanges come back: the check against step 20 failed once in CI with a final version of 25, as the
        # Lightning test's 34 and 40), and 8 of the 10 resumed steps' rounds come on top of it
        assert 10 < saved[before["rank"]] <= before["version"], (saved, before["version"])
        assert after["version"] >= min(saved.values()) + 8, (saved, after["version"])
        assert after["inner_lr"] == after["scheduled_lr"]  # the Trainer's schedule still drives the local steps


@pytest.mark.slow
def test_accelerate_prepares_accumulates_and_trains_in_bf16():
    pytest.importorskip("accelerate", reason="the Accelerate stack is an extra: pip install 'stella[hf]'")
    pytest.importorskip("transformers", reason="the example's model is transformers' GPT-2: pip install 'stella[hf]'")
    for r in run_example("accelerate_loop.py", "--steps", "30", "--accumulate", "2", "--precision", "bf16",
                         "--target", "3.6"):
        assert r["heldout_loss"] < r["heldout_first"] - 1.5
        assert r["noise_counts"] == [29]  # the default BatchNoise split each step's two micro-batches from the second
        assert r["micro_batches"] == 60 and 15 <= r["rounds"] <= 30  # a step per two micro-batches, a round per step
        # or fewer (update mode runs on while an exchange is late)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--amp", "bf16"], ["--amp", "fp16", "--compile", "--mode", "gradient"],
                                   ["--amp", "fp16", "--compile", "--accumulate", "2"]],
                         ids=["bf16-update", "fp16-gradscaler-compile-gradient",
                              "fp16-gradscaler-compile-update-halves"])
def test_autocast_gradscaler_and_compile_train_in_both_modes(flags):
    """bf16 autocast in update mode; fp16 autocast with GradScaler (its unscale_ and step
    through the wrapper) on a torch.compile'd model in gradient mode, and in update mode with
    two backward passes a step, where the default BatchNoise's hooks measure the noise on the
    compiled model under GradScaler (a sample every step after the first)."""
    # gradient mode 80 steps: its controller takes the pushes to 0.1-0.2% on this CPU (top-k's work against a
    # small compiled step), where 60 steps ended at held-out 2.75-3.04 over twelve quiet runs, before this stop's
    # code and after it (CI once 3.012); 80 steps end at 2.74-2.88
    steps = "80" if "gradient" in flags else "60"
    for r in run_example("amp_compile.py", *flags, "--steps", steps, "--target", "3.0"):
        assert r["last10"] < r["first_loss"] - 2.0 and r["heldout_loss"] < 3.0
        if "--accumulate" in flags:  # (a step GradScaler skips costs the samples of up to three)
            assert len(r["noise_counts"]) == 1 and 59 - 3 * r["skipped_steps"] <= r["noise_counts"][0] <= 59
        else:
            assert r["noise_counts"] == []
        assert r["rounds"] >= 10  # update mode runs on (more local steps a round) while an exchange is late,
        # so under load (CI) fewer rounds happen; 10 still proves the exchange took part


@pytest.mark.slow
def test_the_plain_loop_of_the_readme_trains():
    for r in run_example("plain_loop.py", "--steps", "60", "--target", "3.0"):
        # update mode runs on while an exchange is late, so the rounds a 60-step run gets depend on
        # the machine's load (a CI run under load got 19); 10 still proves the exchange took part
        assert r["heldout_loss"] < 3.0 and r["version"] >= 10
