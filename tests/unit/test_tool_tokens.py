"""Tool-output tokens in a response (multi-turn tool rollouts): context, not actions. They are
masked out of the loss and its token count, and left out of the staleness averages."""
from __future__ import annotations

import pytest
import torch

from pace import staleness
from pace.algo.microbatch import collate
from pace.records import Group, Trajectory

pytestmark = pytest.mark.unit

# 3 model tokens (v = 0, 0, 1), 4 tool-output tokens (placeholders: version -7, log-prob 0), 2 model tokens (v = 2)
MASK = [True, True, True, False, False, False, False, True, True]
VERSIONS = [0, 0, 1, -7, -7, -7, -7, 2, 2]


def tool_traj(c: int = 3) -> Trajectory:
    return Trajectory(response_ids=list(range(10, 19)), logprobs=[-0.5] * 3 + [0.0] * 4 + [-0.25] * 2,
                      versions=list(VERSIONS), completed_at=c, finish_reason="stop", action_mask=list(MASK))


def test_staleness_averages_only_model_tokens():
    t = tool_traj()
    plain = Trajectory(response_ids=[1] * 5, logprobs=[0.0] * 5, versions=[0, 0, 1, 2, 2], completed_at=3, finish_reason="stop")
    assert t.action_versions.tolist() == plain.versions.tolist() and t.num_actions == 5 and len(t) == 9
    assert t.action_ids.tolist() == [10, 11, 12, 17, 18] and plain.action_ids.tolist() == plain.response_ids.tolist()  # graded text
    g_tool, g_plain = Group(0, "p", [1], "1", 0, [t]), Group(1, "p", [1], "1", 0, [plain])
    for step in (3, 4, 7):
        k, k_gen, k_wait = g_tool.staleness(step)
        assert (k, k_gen, k_wait) == g_plain.staleness(step)
        assert k == pytest.approx(k_gen + k_wait, abs=1e-12)  # Lemma 1 on model tokens
    assert g_tool.k_gen() == staleness.generation_staleness([0, 0, 1, 2, 2], 3)
    assert g_tool.k_wait(5) == 2


def test_collate_masks_tool_tokens_out_of_the_loss():
    prompt = [1, 2, 3]
    b = collate([tool_traj(), Trajectory([7, 8], [-1.0, -1.0], [0, 0], 0, "stop")], [prompt, prompt])
    # flat per-response-token tensors: trajectory 0's 9 tokens, then trajectory 1's 2
    assert b["loss_mask"].tolist() == [float(a) for a in MASK] + [1.0, 1.0]
    assert b["loss_mask"][:9].sum() == 5 and b["loss_mask"][9:].sum() == 2
    assert torch.equal(b["targets"][:9], torch.arange(10, 19))  # tool tokens stay in the context
    # response token t is scored at position len(prompt) − 1 + t of its row (rows of width 12)
    assert b["index"].tolist() == [2 + t for t in range(9)] + [12 + 2, 12 + 3]
    assert torch.equal(b["input_ids"][0, 3:], torch.arange(10, 19))
