"""`python train.py +exp=<method>_tiny_tool`: every pool policy (and M2PO) runs unchanged in the
multi-turn tool setting; the accounting and Lemma 1 hold on every logged group, and the tool
records (calls per response, model-token counts) are in the per-group Parquet and the metrics."""
from __future__ import annotations

import pytest

from tests.conftest import run_train
from tests.integration.test_train_e2e import _check_accounting, _read

pytestmark = pytest.mark.integration

SMALL = {"data.batch_prompts": 4, "data.group_size": 4, "rollout.max_inflight_groups": 12, "eval.every": 0,
         "trainer.steps": 3, "logger.mode": "disabled"}


@pytest.mark.parametrize("preset, extra", [
    ("sync_tiny_tool", {}),
    ("async_tiny_tool", {}),
    # target B, ρ without memory and a backlog: rejections from the first steps
    # (G = 8: most groups of the weak tiny tool model are all wrong and filtered; more are mixed at G = 8)
    ("pace_tiny_tool", {"pace.target_pool": 4, "pace.ema": 0.0, "rollout.max_inflight_groups": 48,
                        "data.group_size": 8, "trainer.steps": 5}),
    ("async_tiny_tool", {"pool": "stale_k", "pool.max_lag": 1}),
    ("async_tiny_tool", {"pool": "gate", "pool.max_head_offpolicyness": 1}),
    ("async_tiny_tool", {"algo": "m2po"}),
])
def test_every_policy_runs_with_tools(tiny_tool_model_path, tmp_path, preset, extra):
    proc = run_train([f"+exp={preset}", *(f"{k}={v}" for k, v in {**SMALL, **extra}.items())], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics, groups, summary = _read(tmp_path)
    assert [m["step"] for m in metrics] == list(range({**SMALL, **extra}["trainer.steps"]))
    _check_accounting(groups, summary)
    decided = groups.dropna(subset=["k"])
    assert len(decided) > 0 and ((decided.k - decided.k_gen - decided.k_wait).abs() < 1e-9).all()
    complete = groups.dropna(subset=["c"])
    calls = complete.tool_calls.map(sum)
    assert (calls > 0).any(), "no response called the tool"
    used = complete[calls > 0]
    assert (used.num_actions < used.num_tokens).all()  # tool output is not counted as actions
    assert (complete[calls == 0].num_actions == complete[calls == 0].num_tokens).all()
    for m in metrics:
        assert 0 <= m["tools/used_frac"] <= 1 and m["train/action_len"] <= m["train/response_len"]
        assert "time/tools" in m and "tools/errors/timeout" in m
    if "pace" in preset:
        assert (groups.fate == "rejected").any()
