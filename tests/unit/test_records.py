"""The compact per-token record of a response (`Trajectory`, pace/records.py): 13 bytes a token,
grown in chunks, trimmed when finished, pickled without spare capacity, views that read and write."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from pace.records import TOKEN, Group, Trajectory

pytestmark = pytest.mark.unit


def test_streamed_chunks_equal_a_trajectory_built_at_once():
    t = Trajectory()
    t.extend([5, 6, 7], [-0.5, -0.25, -1.0], 0)
    t.extend([8], [-2.0], 1)
    t.extend([9, 10], 0.0, 1, action=False)  # tool output: context
    t.extend([], [], 2)
    ref = Trajectory([5, 6, 7, 8, 9, 10], [-0.5, -0.25, -1.0, -2.0, 0.0, 0.0], [0, 0, 0, 1, 1, 1],
                     action_mask=[True] * 4 + [False] * 2)
    for name in ("response_ids", "logprobs", "versions", "action_mask", "action_ids", "action_versions"):
        assert np.array_equal(getattr(t, name), getattr(ref, name)), name
    assert len(t) == 6 and t.num_actions == 4 and t.response_ids.dtype == np.int32 and t.logprobs.dtype == np.float32
    assert Trajectory([1], [0.0], [0]).action_mask is None  # no tool token: no mask


def test_finish_trims_growth_and_pickle_keeps_only_the_tokens():
    t = Trajectory()
    for i in range(600):  # one token per engine step: into the array by FLUSH = 256 at a time
        t.extend([i], [-0.1], i // 10)
        assert len(t) == i + 1
    assert t.nbytes > 600 * TOKEN.itemsize  # doubling left spare capacity
    back = pickle.loads(pickle.dumps(t))
    assert back.nbytes == 600 * TOKEN.itemsize == 7800 and np.array_equal(back.versions, t.versions)
    assert back.response_ids.tolist() == list(range(600))
    t.finish()
    assert t.nbytes == 7800 and t.versions[-1] == 59
    t.versions[595:] = 60  # vLLM's spans replace the rollout's stamps in place
    assert t.versions[-5:].tolist() == [60] * 5


def test_float32_log_probs_are_the_engine_values():
    """vLLM reports ℓ^μ as float32: storing float32 loses nothing."""
    values = np.float32([-0.123456789, -7.5e-8, -30.25]).astype(float).tolist()
    assert Trajectory([1, 2, 3], values, [0, 0, 0]).logprobs.astype(float).tolist() == values


def test_a_group_with_compact_records_keeps_its_staleness():
    trajs = [Trajectory([1] * 4, [-0.1] * 4, [0, 0, 1, 2], completed_at=2),
             Trajectory([1] * 2, [-0.1] * 2, [1, 1], completed_at=1)]
    g = Group(0, "p", [1], "1", 0, trajs)
    k, k_gen, k_wait = g.staleness(4)
    # 6 tokens, Σ v = 5; K_gen = (4·2 − 3 + 2·1 − 2) / 6; K_wait = (4·(4 − 2) + 2·(4 − 1)) / 6
    assert (k, k_gen, k_wait) == pytest.approx((4 - 5 / 6, 5 / 6, 14 / 6), abs=1e-12)
    assert k == pytest.approx(k_gen + k_wait)


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="one log-prob, version"):
        Trajectory([1, 2], [-0.1], [0, 0])


def test_a_checkpoint_from_before_the_compact_record_still_loads():
    """Older checkpoints pickled Trajectory as a dataclass of lists (with `text`)."""
    t = Trajectory.__new__(Trajectory)
    t.__setstate__({"response_ids": [4, 5], "logprobs": [-0.5, -1.5], "versions": [2, 3], "completed_at": 3,
                    "finish_reason": "stop", "text": "ab", "correct": True, "reward": 1.0, "advantage": 0.5,
                    "action_mask": None, "tool_calls": 0, "tool_errors": 0})
    assert t.response_ids.tolist() == [4, 5] and t.versions.tolist() == [2, 3] and t.action_mask is None
    assert t.completed_at == 3 and t.correct and t.advantage == 0.5 and len(t) == 2


def _rows(first: int, n: int, layers: int = 3, k: int = 2) -> np.ndarray:
    """Routes whose every entry names its position (mod 256): which request wrote a row shows."""
    return np.broadcast_to(((first + np.arange(n)) % 256).astype(np.uint8)[:, None, None], (n, layers, k)).copy()


def test_routes_of_a_response_continued_keep_each_segments_rows():
    """A first request returns the prompt's rows and the response's so far; a continuation that
    computes the same positions again (its prefill) returns them too: the first ones are kept."""
    t = Trajectory([5, 6, 7], [-0.1] * 3, [0] * 3)
    t.add_routes(_rows(0, 6), position=0, prompt_len=4)  # prompt 0-3, response tokens 0-1 (the last is no input)
    assert t.prompt_routes.shape == (4, 3, 2) and len(t.routes) == 2
    t.extend([8, 9], [-0.2] * 2, 1)
    second = _rows(0, 8) + 100  # the continuation's prefill recomputed every position (other experts)
    t.add_routes(second, position=0, prompt_len=4)
    assert t.prompt_routes[:, 0, 0].tolist() == [0, 1, 2, 3]  # the prompt's first rows kept
    assert t.routes[:, 0, 0].tolist() == [4, 5, 106, 107]  # tokens 0-1 from the first request, 2-3 from the second
    t.add_routes(_rows(8, 1) + 50, position=8, prompt_len=4)  # a request asked for the new positions only
    assert t.routes[:, 0, 0].tolist() == [4, 5, 106, 107, 58][:len(t)]
    with pytest.raises(ValueError, match="unrecorded"):
        t.add_routes(_rows(20, 1), position=20, prompt_len=4)


def test_routes_follow_truncation_and_pickling_and_count_in_nbytes():
    t = Trajectory([1, 2, 3, 4], [0.0] * 4, [0] * 4)
    before = t.nbytes
    t.add_routes(_rows(0, 5), position=0, prompt_len=2)
    assert t.nbytes == before + 5 * 3 * 2
    t.truncate(2)
    assert len(t.routes) == 2
    back = pickle.loads(pickle.dumps(t))
    assert back.prompt_routes.tolist() == t.prompt_routes.tolist() and back.routes.tolist() == t.routes.tolist()
    old = {k: v for k, v in t.__getstate__().items() if k not in ("prompt_routes", "routes")}
    fresh = Trajectory.__new__(Trajectory)
    fresh.__setstate__(old)  # a checkpoint from before routing replay
    assert fresh.routes is None and fresh.prompt_routes is None
