"""Multi-process training on CPU (DDP over gloo): rank-0 batch scatter and token normalisation across ranks,
and a short `train.py` run with the rollout on rank 0 and full-state-dict weight syncs."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration

LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_machines", "1",
          "--mixed_precision", "no", "--dynamo_backend", "no"]


def _step_metrics(n: int, model: str) -> dict:
    proc = subprocess.run([*LAUNCH, "--num_processes", str(n), str(ROOT / "tests/integration/ddp_step.py"), model],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("METRICS "))
    return json.loads(line[len("METRICS "):])


def test_loss_and_gradient_do_not_depend_on_world_size(tiny_model_path):
    one, two = _step_metrics(1, tiny_model_path), _step_metrics(2, tiny_model_path)
    for key in ("train/loss", "train/grad_norm", "train/entropy", "train/ratio_mean"):
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-7), key


def test_two_process_train_run(tiny_model_path, tmp_path):
    cmd = [*LAUNCH, "--num_processes", "2", str(ROOT / "train.py"), "+exp=async_tiny", "trainer.steps=3", "data.batch_prompts=8", "rollout.max_inflight_groups=16",
           "eval.every=2", "data.arithmetic.n_val=40", "logger.mode=disabled", "logger.progress=false", f"hydra.run.dir={tmp_path}",
           "trainer.save_every=2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "train/loss" in m] == [0, 1, 2]
    # rank 0 validates on its rollout engine (θ_0, θ_2 and the final θ_3) while both ranks train
    assert [m["val/version"] for m in metrics if "val/avg" in m] == [0, 2, 3]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rollout"]["syncs"] >= 2
    assert summary["best"]["version"] in (0, 2, 3)

    # the checkpoints (Accelerate's trainer state, rank 0's run state), written with both ranks in step
    for step in (2, 3):
        ckpt = tmp_path / "checkpoints" / f"step-{step:06d}"
        assert {"run_state.pkl", "random_states_0.pkl", "model.safetensors", "optimizer.bin"} <= {p.name for p in ckpt.iterdir()}
    # and both resume from one: rank 0 restores the pool, every rank the trainer
    resume = [*LAUNCH, "--num_processes", "2", str(ROOT / "train.py"), f"resume={tmp_path / 'checkpoints' / 'step-000002'}",
              "logger.progress=false", f"hydra.run.dir={tmp_path / 'resume-hydra'}"]
    proc = subprocess.run(resume, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "train/loss" in m] == [0, 1, 2]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 3 and summary["resumed_from"].endswith("step-000002")
