"""End-to-end: `python train.py` on the tiny default with the real engine, grader and trainer."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from tests.helpers import (ROOT, _check_accounting, _read, check_pace_decisions, check_staleness, run_train,
                           wait_for_rows)

pytestmark = pytest.mark.integration

# B = 8: quick steps, same code path; in-training validation off except where it is tested
SMALL = ["data.batch_prompts=8", "rollout.max_inflight_groups=16", "eval.every=0"]


@pytest.mark.parametrize("preset, extra", [
    ("m2po_tiny", []),  # M2PO, Algorithm 1 (the paper variant)
    # decoupled PPO + TIS, with in-flight requests prefilled again at each update
    ("async_tiny", ["algo.ratio_ref=proximal", "algo.is_correction=tis", "algo.is_threshold=2.0",
                    "rollout.kv_on_update=recompute"]),
])
def test_off_policy_corrections_train_end_to_end(tiny_model_path, tmp_path, preset, extra):
    proc = run_train([f"+exp={preset}", "trainer.steps=5", "logger.mode=disabled", *SMALL, *extra], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics, groups, summary = _read(tmp_path)
    assert [m["step"] for m in metrics] == list(range(5))
    _check_accounting(groups, summary)
    recompute = "rollout.kv_on_update=recompute" in extra
    check_staleness(groups, kv="recompute" if recompute else "keep")  # K, K_gen, K_wait from the version spans: Lemma 1 holds
    if recompute:  # responses were in flight at updates: their tokens so far were prefilled again
        assert sum(m["rollout/reprefill_tokens"] for m in metrics) > 0 and (groups.versions_spanned > 1).any()
    prefix = "m2po/" if preset.startswith("m2po") else "mismatch/truncated_frac"
    assert all(any(k.startswith(prefix) for k in m) for m in metrics)
    if preset.startswith("m2po"):
        assert all(0 <= m["m2po/masked_frac"] <= m["m2po/trust_region_frac"] <= 1 for m in metrics)
    measured = [m for m in metrics if m["mismatch/tokens"] > 0]
    assert measured, "no on-policy token in the run"  # the first step's tokens are all version 0
    assert all(m["mismatch/abs_logp_diff"] < 1e-3 for m in measured), [m["mismatch/abs_logp_diff"] for m in measured]


def test_in_training_validation_logs_and_keeps_the_best(tiny_model_path, tmp_path):
    # Sync: the trainer waits for generation at the engine's version while validation holds the
    # updates, so this also checks that the hold cannot deadlock. 10 problems per level, k = 2.
    args = ["+exp=sync_tiny", "trainer.steps=4", "logger.mode=disabled", *SMALL[:-1], "eval.every=2", "eval.k=2",
            "eval.at_start=false", "eval.best_within=3", "data.arithmetic.n_val=40"]
    proc = run_train(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics, groups, summary = _read(tmp_path)
    train_rows = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in train_rows] == [0, 1, 2, 3]
    assert all(m["staleness/k_mean"] == 0 for m in train_rows)  # still on-policy
    val = [m for m in metrics if "val/avg" in m]
    assert [m["val/version"] for m in val] == [2, 4]  # every 2 steps, and the final weights
    assert val[-1]["step"] >= 4  # the final validation comes after the last training step
    levels = [f"val/arith_l{i}/mean@2" for i in (1, 2, 3, 4)]
    for m in val:
        assert all(round(m[key] * 20, 9) == round(m[key] * 20) for key in levels)  # 10 problems × 2 samples
        assert m["val/avg"] == pytest.approx(sum(m[key] for key in levels) / 4)
        assert m["time/validate"] > 0 and m["val/response_len"] > 0
    # best within 3 updates: θ_2 (θ_4 is past N), saved as a loadable model
    assert summary["best"]["version"] == 2 and summary["best"]["val/avg"] == pytest.approx(val[0]["val/avg"])
    assert summary["best"]["path"] == str(tmp_path / "best")
    assert [v["version"] for v in summary["validations"]] == [2, 4]
    assert json.loads((tmp_path / "best.json").read_text()) == summary["best"]
    from transformers import AutoModelForCausalLM

    best = AutoModelForCausalLM.from_pretrained(tmp_path / "best").state_dict()
    init = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    assert best.keys() == init.keys()
    assert any(not torch.equal(best[k], init[k]) for k in init)  # two updates moved the weights


def test_sigint_stops_cleanly(tiny_model_path, tmp_path):
    cmd = [sys.executable, str(ROOT / "train.py"), "+exp=async_tiny", "trainer.steps=100000", "logger.mode=disabled", *SMALL,
           f"hydra.run.dir={tmp_path}", "logger.progress=false"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_rows(proc, tmp_path, 2)
    proc.send_signal(signal.SIGINT)
    t0 = time.time()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert time.time() - t0 < 30
    assert "interrupted" in err and "resume with: python train.py resume=" in err
    _, groups, summary = _read(tmp_path)
    assert summary["status"] == "interrupted"
    assert (tmp_path / "checkpoints" / f"step-{summary['steps']:06d}" / "run_state.pkl").exists()
    # pooled and in-flight groups live on in the checkpoint (the resumed run logs them); none was dropped
    fates = summary["fates"]
    assert fates["submitted"] == sum(v for k, v in fates.items() if k != "submitted") and fates["dropped_shutdown"] == 0
    assert len(groups) == fates["submitted"] - fates["pooled"] - fates["inflight"] and groups["id"].is_unique


@pytest.mark.parametrize(
    "args, needle",
    [
        (["model.path=/no/such/model"], "model.path: directory not found: /no/such/model"),
        (["+exp=async_qwen3_8b"], "no CUDA GPU"),
        (["data.source=math", "data.path=/no/such/file.jsonl"], "data file not found: /no/such/file.jsonl"),
        (["trainer.foo=1"], "trainer.foo"),
        (["pool.name=bogus"], "pool.name='bogus'"),
        (["data.group_size=1"], "data.group_size"),
        (["pool.name=tests.unit.test_pool_plugins:NoSelect"], "NoSelect lacks select(), load_state_dict()"),
        (["rollout.engine_process=server", "rollout.servers=[http://127.0.0.1:9]"],
         "rollout.servers: http://127.0.0.1:9: it does not answer"),
    ],
)
def test_bad_input_is_one_clear_line(args, needle, tmp_path):
    proc = run_train(args, tmp_path, timeout=300)
    assert proc.returncode != 0
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr


def test_pace_run_rejects_and_logs_scores(tiny_model_path, tmp_path):
    # A small target pool and production well ahead of training (B = 4, 32 groups in flight) force
    # rejections and rescoring within a few steps: rescoring runs only after a sync that finds the
    # pool over its target, which at B = 8 with 16 in flight happened in 0 of 6 steps in some runs.
    proc = run_train(["+exp=pace_tiny", "trainer.steps=8", "data.batch_prompts=4", "rollout.max_inflight_groups=32",
                      "eval.every=0", "pace.target_pool=4", "pace.ema=0.0", "logger.mode=disabled"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics, groups, summary = _read(tmp_path)
    _check_accounting(groups, summary)
    rejected = groups[groups.fate == "rejected"]
    assert summary["fates"]["rejected"] == len(rejected) == sum(m["pool/rejected"] for m in metrics)
    assert len(rejected) > 0
    assert rejected[["k_wait", "k_gen", "score", "u", "rho", "budget"]].notna().all().all()
    check_staleness(groups, kv="keep")
    assert all("pool/rho" in m and "pool/budget" in m for m in metrics)
    check_pace_decisions(groups, gamma=1.0)


def test_a_pool_policy_given_by_import_path_trains_end_to_end(tiny_model_path, tmp_path):
    """examples/pool_policies/freshest.py through `pool.name=module:Class` and `pool.args`: it trains
    on the freshest B and drops the oldest beyond keep·B (keep = 1 with 32 groups in flight over
    B = 4: production outruns training, so every step after the first finds more than B pooled)."""
    proc = run_train(["pool.name=examples.pool_policies.freshest:FreshestPolicy", "+pool.args.keep=1", "trainer.steps=4",
                      "data.batch_prompts=4", "rollout.max_inflight_groups=32", "eval.every=0", "logger.mode=disabled"],
                     tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics, groups, summary = _read(tmp_path)
    _check_accounting(groups, summary)
    check_staleness(groups)
    dropped = groups[groups.fate == "dropped_stale"]
    assert summary["fates"]["dropped_stale"] == len(dropped) == sum(m["pool/dropped"] for m in metrics) > 0
    assert (dropped.reason == "freshest: beyond 4").all()
    assert [m["pool/dropped_total"] for m in metrics] == list(np.cumsum([m["pool/dropped"] for m in metrics]))
    for step, at in groups[groups.fate.isin(["consumed", "dropped_stale"])].groupby("step"):
        consumed, dropped = at[at.fate == "consumed"], at[at.fate == "dropped_stale"]
        assert len(consumed) == 4 and (not len(dropped) or consumed.k.max() <= dropped.k.min() + 1e-12), step


