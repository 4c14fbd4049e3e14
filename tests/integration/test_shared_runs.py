"""What the shared runs show (tests/conftest.py: `async_run`, `sync_run` and the `study`'s sweeps, each
made once and read by several files): an async run's logs and records, a sync run on policy and
resumed to the bit, a multirun's job folders. The tests that make runs of their own are in
test_train_e2e.py and test_resume.py (apart, so that the suite's two workers can share them out).
"""
from __future__ import annotations

import shutil

import pytest

from tests.helpers import _check_accounting, _read, check_staleness, run_train

pytestmark = pytest.mark.integration

STEP_KEYS = [
    "train/reward_mean", "train/loss", "train/clipfrac", "train/entropy", "train/response_len",
    "pool/occupancy", "pool/rejected", "staleness/k_mean", "staleness/k_gen_mean", "staleness/k_wait_mean",
    "version", "time/step", "time/wait_data", "time/train", "time/sync", "rollout/tokens_per_s", "rollout/inflight",
]


def test_async_run_logs_everything(async_run):
    """The shared async run (tests/conftest.py: 6 steps, B = 8, logged offline to wandb too)."""
    steps = 6
    metrics, groups, summary = _read(async_run)
    assert [m["step"] for m in metrics] == list(range(steps))
    for key in STEP_KEYS:
        assert all(key in m for m in metrics), key
    assert summary["status"] == "finished" and summary["steps"] == steps
    _check_accounting(groups, summary)
    consumed = groups[groups.fate == "consumed"]
    assert len(consumed) == steps * 8
    # K, K_gen, K_wait of every decided group recomputed from its per-token version spans (Lemma 1
    # follows: K − K_gen − K_wait = c̄ − c̄ from the same records); K_kv too (keep: each response's
    # context is its first token's version)
    check_staleness(groups, kv="keep")
    assert (consumed.k_kv > consumed.k_gen).any()  # tokens written on a stale context were trained on
    assert (consumed.step.value_counts() == 8).all() and sorted(consumed.step.unique()) == list(range(steps))
    # dynamic sampling on correctness: filtered groups are all right or all wrong, consumed ones mixed
    assert groups[groups.fate == "filtered"].acc_mean.isin([0.0, 1.0]).all()
    assert ((consumed.acc_mean > 0) & (consumed.acc_mean < 1)).all()
    assert list((async_run / "wandb").glob("offline-run-*")), "no offline wandb run directory"


def test_sync_run_is_on_policy(sync_run):
    """The shared sync run (tests/conftest.py: 10 steps, B = 8)."""
    steps = 10
    metrics, groups, summary = _read(sync_run)
    _check_accounting(groups, summary)
    consumed = groups[groups.fate == "consumed"]
    assert len(consumed) == steps * 8
    assert (consumed.k == 0).all() and (consumed.versions_spanned == 1).all()
    check_staleness(groups)
    assert summary["fates"]["pooled"] == 0  # exactly one batch generated per step
    assert all(m["staleness/k_mean"] == 0 for m in metrics)
    # The weights really reached the engine at every sync: every trained token is on-policy, and in
    # float32 the engine's ℓ^μ equals the trainer's log π to rounding (~4e-7 a token), flat over the
    # run. Weights that miss the engine grow it step by step: the tied head left at θ_0 gave 3.2e-5
    # at step 1 and 5e-4 by step 9; a dropped layer, nats.
    diffs = [m["mismatch/abs_logp_diff"] for m in metrics]
    for m in metrics:
        assert m["mismatch/tokens"] == consumed[consumed.step == m["step"]].num_actions.sum(), m["step"]
        assert abs(m["mismatch/k3_kl"]) < 1e-8, m
    assert max(diffs) < 5e-6 and max(diffs[-3:]) < 3 * max(diffs[:3]), diffs
    assert all(abs(m["train/ratio_mean"] - 1) < 1e-5 for m in metrics), [m["train/ratio_mean"] for m in metrics]


def test_sync_resume_equals_the_uninterrupted_run(sync_run, tmp_path):
    """Sync policy, fixed seed, rollout.deterministic (the shared sync run, tests/conftest.py: 10
    steps, a checkpoint every 3): resuming a copy of it from the step-3 checkpoint reproduces the
    uninterrupted run's steps 3 to 9: same groups (ids, prompts, responses' lengths and rewards),
    same losses, to the bit."""
    a, b = sync_run, tmp_path / "b"
    shutil.copytree(a, b)
    proc = run_train([f"resume={b / 'checkpoints' / 'step-000003'}"], tmp_path / "resume-hydra")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "of those in flight at the checkpoint 0 continued, 0 dropped" in proc.stderr  # sync: nothing in flight at a step boundary

    def consumed(run):
        _, g, summary = _read(run)
        _check_accounting(g, summary)
        g = g[g.fate == "consumed"].sort_values(["step", "id"])
        return [(r.step, r.id, r.prompt_id, tuple(r.lengths), r.reward_mean, r.c) for r in g.itertuples()]

    assert consumed(b) == consumed(a)
    keys = ("train/loss", "train/reward_mean", "train/entropy", "version", "staleness/k_mean")
    assert [[m[k] for k in keys] for m in _read(b)[0]] == [[m[k] for k in keys] for m in _read(a)[0]]


def test_multirun_sweep_runs_each_job_in_its_own_directory(study):
    """`train.py -m +exp=stalek_tiny pool.max_lag=1,8`: the Stale-k sweep of the shared study
    (tests/conftest.py), whose sweep folder the run was given."""
    jobs = sorted(p for p in (study / "stalek").iterdir() if p.is_dir())
    assert [p.name.split("_")[0] for p in jobs] == ["0", "1"]
    assert ["pool.max_lag=1" in jobs[0].name, "pool.max_lag=8" in jobs[1].name] == [True, True]
    for job in jobs:
        _, groups, summary = _read(job)
        assert summary["status"] == "finished"
        _check_accounting(groups, summary)
