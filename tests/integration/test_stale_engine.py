"""An engine whose loader receives weights other than those it is labelled with, in bf16 (injected
into `load_weights`: what the fingerprint observes), where the on-policy guard
(pace/weights/mismatch.py, bound 0.2 nats a token) cannot see it: the weight fingerprints after each sync
(pace/weights/fingerprint.py) stop the run at that sync; a correct bf16 run is silent. Real tiny runs (vLLM
CPU engine in bf16, grading processes, trainer), ~35 s each on 2 cores."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, run_train

pytestmark = pytest.mark.integration

BF16 = ["+exp=sync_tiny", "model.dtype=bfloat16", "trainer.steps=4", "logger.mode=disabled", "data.batch_prompts=8",
        "rollout.max_inflight_groups=16", "eval.every=0"]


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def _mismatch(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m["mismatch/abs_logp_diff"] for m in rows]


def test_an_engine_one_version_behind_in_bf16_stops_the_run_at_that_sync(tiny_model_path, tmp_path):
    """From the sync of θ_2 on the engine loads the update before the one it is given (the weight
    update applied one version late) and is labelled with the new version. The on-policy mismatch
    stays at bf16's rounding, far under its bound; the fingerprints of the sync of θ_2 differ from
    the trainer's, and the run stops at the end of the next step, before another sync, with a
    checkpoint and one line naming the worker, the version and how far behind it is."""
    cmd = [sys.executable, str(ROOT / "tests" / "integration" / "faulty_train.py"), *BF16, f"hydra.run.dir={tmp_path}",
           "logger.progress=false"]
    env = {**os.environ, "PACE_FAULT": "stale_engine@2", "HYDRA_FULL_ERROR": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    diffs = _mismatch(tmp_path)
    print(f"one version behind: on-policy mismatch per step {['%.1e' % d for d in diffs]}")
    assert "injected: θ_2 labelled on the weights of the update before it" in proc.stderr
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rollout engine worker 0 is labelled θ_2 but received other weights: "), last
    assert "they are θ_1's: the engine is 1 version behind" in last and "Traceback" not in proc.stderr
    assert max(diffs) < 0.2  # what the on-policy guard alone would have let pass
    summary = _summary(tmp_path)
    assert summary["status"] == "failed" and summary["steps"] == 3 and len(diffs) == 3
    assert summary["rollout"]["weights_checked"] == 2  # θ_1 passed, θ_2 was caught
    assert f"checkpoint (engine weights are not the trainer's): {tmp_path / 'checkpoints' / 'step-000003'}" in proc.stderr


def test_a_correct_bf16_run_checks_every_sync_and_is_silent(tiny_model_path, tmp_path):
    proc = run_train(BF16, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "error:" not in proc.stderr and "warning: on-policy" not in proc.stderr
    summary = _summary(tmp_path)
    assert summary["status"] == "finished" and summary["steps"] == 4
    assert summary["rollout"]["weights_checked"] >= 3  # θ_1 … θ_3 (θ_4 is loaded as the run ends, or not)
