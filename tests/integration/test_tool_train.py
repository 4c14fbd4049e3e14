"""`python train.py +exp=<method>_tiny_tool`: every pool policy (and M2PO) runs unchanged in the
multi-turn tool setting; the accounting and Lemma 1 hold on every logged group, and the tool
records (calls per response, model-token counts) are in the per-group Parquet and the metrics."""
from __future__ import annotations

import pytest

from analysis.runs import recomputed_staleness
from tests.helpers import _check_accounting, _read, check_pace_decisions, check_staleness, run_train

pytestmark = pytest.mark.integration

SMALL = {"data.batch_prompts": 4, "data.group_size": 4, "rollout.max_inflight_groups": 12, "eval.every": 0,
         "trainer.steps": 3, "logger.mode": "disabled"}


# Async itself (async_tiny_tool, nothing overridden) has no run of its own: its configuration is the
# server run's but for the engine's process, and the M2PO run's but for the loss, and every
# assertion is made on both.
@pytest.mark.parametrize("preset, extra", [
    ("sync_tiny_tool", {}),
    # target B, ρ without memory and a backlog: rejections from the first steps
    # (G = 8: most groups of the weak tiny tool model are all wrong and filtered; more are mixed at G = 8)
    ("pace_tiny_tool", {"pace.target_pool": 4, "pace.ema": 0.0, "rollout.max_inflight_groups": 48,
                        "data.group_size": 8, "trainer.steps": 5}),
    ("async_tiny_tool", {"pool": "stale_k", "pool.max_lag": 1}),
    ("async_tiny_tool", {"pool": "gate", "pool.max_head_offpolicyness": 1}),
    ("async_tiny_tool", {"algo": "m2po"}),
    ("async_tiny_tool", {"rollout.engine_process": "server"}),  # tool turns through a vLLM HTTP server
])
def test_every_policy_runs_with_tools(tiny_tool_model_path, tmp_path, preset, extra):
    proc = run_train([f"+exp={preset}", *(f"{k}={v}" for k, v in {**SMALL, **extra}.items())], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics, groups, summary = _read(tmp_path)
    assert summary["engine_process"] == extra.get("rollout.engine_process", "inproc"), summary["engine_process"]
    assert [m["step"] for m in metrics] == list(range({**SMALL, **extra}["trainer.steps"]))
    _check_accounting(groups, summary)
    check_staleness(groups)  # logged K, K_gen, K_wait = recomputed from per-token version spans
    complete = groups.dropna(subset=["c"])
    calls = complete.tool_calls.map(sum)
    assert (calls > 0).any(), "no response called the tool"
    used = complete[calls > 0]
    assert (used.num_actions < used.num_tokens).all()  # tool output is not counted as actions
    assert (complete[calls == 0].num_actions == complete[calls == 0].num_tokens).all()
    # each tool output is followed by a new engine request (prefilled anew: KV staleness restarts
    # there), unless it used up the response's budget (then the response is that long)
    from omegaconf import OmegaConf

    budget = OmegaConf.load(tmp_path / ".hydra" / "config.yaml").rollout.max_tokens
    for _, row in complete.iterrows():
        for n_calls, starts, length in zip(row.tool_calls, row.request_starts, row.lengths):
            assert list(starts) == sorted(set(starts)), row.id
            assert len(starts) == n_calls or (length >= budget and len(starts) == n_calls - 1), (row.id, starts, n_calls)
    for m in metrics:
        assert m["train/action_len"] <= m["train/response_len"]
        assert "time/tools" in m and "tools/errors/timeout" in m
        # tool use of the responses completed during the step: none in a step where no group completed
        # (seen with PACE at a pool target of B, which trains on the backlog)
        assert ("tools/used_frac" in m) == (m["rollout/groups_completed"] > 0), m
        assert 0 <= m.get("tools/used_frac", 0) <= 1
    assert any("tools/used_frac" in m for m in metrics)
    if "pace" in preset:
        assert (groups.fate == "rejected").any()
        check_pace_decisions(groups, gamma=1.0)
    if extra.get("pool") == "stale_k":  # consumed within the lag, dropped beyond it (K recomputed)
        lag = {fate: [recomputed_staleness(r)[0] for _, r in groups[groups.fate == fate].iterrows()]
               for fate in ("consumed", "dropped_stale")}
        assert max(lag["consumed"]) <= extra["pool.max_lag"] < min(lag["dropped_stale"], default=float("inf"))
    if extra.get("pool") == "gate":
        check_gate(groups, SMALL["data.batch_prompts"], extra["pool.max_head_offpolicyness"])


def check_gate(groups, batch: int, eta: int) -> None:
    """AReaL's bound from the records alone: when a group started at trainer version v, at most
    (v + η + 1)·B started groups were not yet discarded (filtered or dropped). The count is a lower
    bound: every group discarded at a version <= v is taken as discarded before the start."""
    g = groups.sort_values("id")
    gone = g[g.fate.isin(["filtered", "dropped_shutdown"])]
    for row in g.itertuples():
        freed = ((gone.id < row.id) & (gone.step <= row.submitted_at)).sum()
        assert row.id + 1 - freed <= (row.submitted_at + eta + 1) * batch, row.id  # ids count started groups
