"""The training-stack examples (examples/), each run as a user runs it: one command that
starts a real stella-ps and two workers on loopback, with fewer steps than the example's
default, reaching a stated loss. Hugging Face Trainer (bf16, gradient accumulation,
save_steps, evaluation, resume from its own checkpoint against a new stella-ps),
Accelerate (prepare, accumulate, mixed precision), and a plain loop with autocast
(bf16; fp16 with GradScaler) and torch.compile in both training modes.

Skipped, with the reason, where the stack's extra is not installed (``stella[hf]``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


def run_example(name: str, *args: str, timeout: float = 240) -> list[dict]:
    """Run ``examples/<name>.py`` (its one-command form: a local stella-ps and two workers);
    the workers' JSON lines, by rank. Fails with the output when the example fails."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", f"{name}.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"rank"')]
    assert sorted(r["rank"] for r in rows) == [0, 1], out[-6000:]
    return sorted(rows, key=lambda r: r["rank"])


def test_hf_trainer_trains_saves_evaluates_and_resumes_against_a_new_server(tmp_path):
    """Two Trainer workers (bf16, accumulation 2, a checkpoint at step 20, evaluation), then
    both resumed from checkpoint-20 against a new stella-ps: the loss 5 steps after the
    resume is no higher than at the checkpoint (within 2%; issue 46 saw it go back to the
    random initialisation's) and follows the uninterrupted run's."""
    pytest.importorskip("transformers", reason="the Hugging Face stack is an extra: pip install 'stella[hf]'")
    common = ["--output-dir", str(tmp_path), "--steps", "30", "--save-steps", "20", "--log-steps", "5", "--bf16",
              "--accumulate", "2"]
    first = run_example("hf_trainer", *common, "--target", "3.6")
    for r in first:
        assert r["losses"]["5"] > r["losses"]["30"] + 1.0 and r["heldout_loss"] < 3.6  # it learns
        assert r["version"] >= 25
    assert all((tmp_path / f"rank{r}" / "checkpoint-20" / "optimizer.pt").exists() for r in (0, 1))
    again = run_example("hf_trainer", *common, "--resume", "checkpoint-20", "--target", "3.6")
    for before, after in zip(first, again):
        at_n, resumed = before["losses"]["20"], after["losses"]["25"]
        assert resumed <= 1.02 * at_n, (before["losses"], after["losses"])
        assert abs(resumed - before["losses"]["25"]) <= 0.05 * before["losses"]["25"]
        assert after["version"] >= 20 + 8  # the new server counted on from the checkpoint's version
        assert after["inner_lr"] == after["scheduled_lr"]  # the Trainer's schedule still drives the local steps


def test_accelerate_prepares_accumulates_and_trains_in_bf16():
    pytest.importorskip("accelerate", reason="the Accelerate stack is an extra: pip install 'stella[hf]'")
    pytest.importorskip("transformers", reason="the example's model is transformers' GPT-2: pip install 'stella[hf]'")
    for r in run_example("accelerate_loop", "--steps", "30", "--accumulate", "2", "--precision", "bf16",
                         "--target", "3.6"):
        assert r["heldout_loss"] < r["heldout_first"] - 1.5
        assert r["micro_batches"] == 60 and 15 <= r["rounds"] <= 30  # a step per two micro-batches, a round per step
        # or fewer (update mode runs on while an exchange is late)


@pytest.mark.parametrize("flags", [["--amp", "bf16"], ["--amp", "fp16", "--compile", "--mode", "gradient"]],
                         ids=["bf16-update", "fp16-gradscaler-compile-gradient"])
def test_autocast_gradscaler_and_compile_train_in_both_modes(flags):
    """bf16 autocast in update mode; fp16 autocast with GradScaler (its unscale_ and step
    through the wrapper) on a torch.compile'd model in gradient mode (one compile: the
    inductor's is the costly part; update mode compiled was checked by hand, docs/integrations.md)."""
    for r in run_example("amp_compile", *flags, "--steps", "60", "--target", "3.0"):
        assert r["last10"] < r["first_loss"] - 2.0 and r["heldout_loss"] < 3.0
        assert r["rounds"] >= 20  # update mode runs on (more local steps a round) while an exchange is late


def test_the_plain_loop_of_the_readme_trains():
    for r in run_example("plain_loop", "--steps", "60", "--target", "3.0"):
        assert r["heldout_loss"] < 3.0 and r["version"] >= 20
