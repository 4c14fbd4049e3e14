"""Delta weight sync through the path a run takes (`rollout.weight_delta`): two vLLM CPU engines in
child processes over the gloo backend, each sync after the first sending only the elements whose
engine-dtype value changed (pace/weights/delta.py), each worker patching its mirror and reloading
every tensor through the checked reload (pace/weights/gloo.py). After every sync each engine
worker's fingerprints of what it loaded are the trainer's θ_v, bit for bit (`weights_checked`), and
a sync run's on-policy tokens stay at float32 rounding — through a forced full sync
(`rollout.full_sync_every`) and a resume, which starts with whole tensors.

Seen failing (by hand): one patch dropped on the wire (the run stops: `StaleEngine`, a tensor
differs); the tied output head not re-processed after a patched reload (the mismatch grows past
5e-6 by step 3).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


RUN = ["+exp=sync_tiny", "data.batch_prompts=8", "rollout.engines=2", "rollout.engine_process=child", "rollout.weight_transfer=gloo",
       "rollout.weight_delta=true", "rollout.full_sync_every=3",
       # float32 moves nearly every element each step: a delta anyway, so every sync after a full one is one
       "rollout.delta_max_frac=1.0", "eval.every=0", "logger.mode=disabled"]


def _train(run_dir: Path, hydra_dir: Path, *args: str) -> dict:
    cmd = [sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={hydra_dir}", "logger.progress=false"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((run_dir / "summary.json").read_text())


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "train/loss" in line]


def test_two_engines_take_delta_syncs_exactly_through_a_forced_full_sync_and_a_resume(tiny_model_path, tmp_path):
    run = tmp_path / "run"
    summary = _train(run, run, *RUN, "trainer.steps=4", "trainer.save_every=2")
    assert summary["status"] == "finished" and summary["rollout"]["syncs"] == 4
    assert summary["rollout"]["weights_checked"] == 4  # every worker loaded θ_v's exact tensors, deltas included
    rows = _rows(run)
    # θ_1 whole (the engines' baseline is unknown), θ_2 and θ_3 patches, θ_4 whole (3 versions after θ_1)
    assert [r["sync/full"] for r in rows] == [1, 0, 0, 1]
    for r in rows:
        if not r["sync/full"]:
            changed = round(r["sync/changed_frac"] * rows[0]["sync/bytes"] / 4)  # elements, float32
            assert r["sync/bytes"] == changed * (4 + 4) and 0 < r["sync/changed_frac"] < 1  # int32 index + value
        assert r["sync/pause_s"] >= 0
    mismatch = [r["mismatch/abs_logp_diff"] for r in rows if "mismatch/abs_logp_diff" in r]
    assert len(mismatch) == 4 and max(mismatch) < 5e-6, mismatch  # float32 rounding: ~4e-7 measured
    out = subprocess.run([sys.executable, "-m", "analysis.summarize_run", str(run)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert "weight syncs: 4 (2 whole, 2 patches)" in out.stdout, out.stdout + out.stderr

    # resumed from θ_2: the engines start from the model directory, so θ_2 goes whole, then patches
    summary = _train(run, tmp_path / "resume-hydra", f"resume={run / 'checkpoints' / 'step-000002'}", "trainer.steps=6",
                     "trainer.save_every=100")
    assert summary["status"] == "finished" and summary["resumed_from"].endswith("step-000002")
    # counted on from the checkpoint's θ_1; then the reload probe's θ_0 and θ_2 at the start (θ_2 whole:
    # the probe's whole θ_0 is not the resume's baseline), θ_3 … θ_6
    assert summary["rollout"]["weights_checked"] == summary["rollout"]["syncs"] == 1 + 6
    assert summary["rollout"]["reload_probe_engines"] == 2 and summary["rollout"]["reload_probe_shift"] < 1e-5
    rows = _rows(run)[-4:]  # steps 2..5 of the resumed run
    assert [r["step"] for r in rows] == [2, 3, 4, 5]
    assert [r["sync/full"] for r in rows] == [0, 0, 1, 0]  # θ_3, θ_4 patches on θ_2; θ_5 whole (every 3)
    mismatch = [r["mismatch/abs_logp_diff"] for r in rows if "mismatch/abs_logp_diff" in r]
    assert len(mismatch) == 4 and max(mismatch) < 5e-6, mismatch
