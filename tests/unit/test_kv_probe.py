"""The stale-KV probe's arithmetic (pace/rollout/kv_probe.py) without an engine: which tokens a probe
measures, the gap summed over them, the per-step metrics and the config check (its request id:
test_request_ids.py; on the real engine: tests/integration/test_engine_rollout.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from pace.rollout.kv_probe import STATS, kv_gap, kv_probe_metrics, probed_tokens

pytestmark = pytest.mark.unit


def test_only_the_last_requests_own_tokens_after_the_update_are_probed():
    # tokens 0-3: the first request (v0, v0, v1, v1); a tool output (4-5, context); the last request
    # from 6 on: first token at v1, then v2 from 8. A probe under v2 measures 8, 9 and 11 (10 is
    # context); not 2-3 (an earlier request), nor 6-7 (the request's own version: fresh KV).
    versions = [0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2]
    mask = [True] * 4 + [False] * 2 + [True] * 4 + [False, True]
    assert probed_tokens(versions, 6, mask, 2).tolist() == [8, 9, 11]
    assert probed_tokens(versions, 6, None, 2).tolist() == [8, 9, 10, 11]
    # under v1 (say the probe version were the first token's) nothing: no update inside the request
    assert probed_tokens(versions, 6, mask, 1).tolist() == []
    # one request from 0: tokens labelled 2 after a first token at 0
    assert probed_tokens(versions, 0, None, 2).tolist() == [8, 9, 10, 11]
    # a response within one version, an empty one, a start past the end
    assert probed_tokens([3, 3, 3], 0, None, 3).tolist() == []
    assert probed_tokens([], 0, None, 0).tolist() == []
    assert probed_tokens([0, 1], 2, None, 1).tolist() == []


def test_the_gap_is_summed_over_the_probed_tokens_only():
    versions = [0, 0, 1, 1, 1]
    behaviour = np.array([-1.0, -2.0, -0.5, -0.25, -3.0], dtype=np.float32)
    fresh = [-9.0, -9.0, -0.75, -0.5, -3.0]  # the first two differ hugely: not probed (v0)
    mask = [True, True, True, True, False]
    total, n = kv_gap(versions, 0, mask, behaviour, fresh, 1)
    assert (total, n) == (0.25 + 0.25, 2)
    total, n = kv_gap(versions, 0, None, behaviour, fresh, 1)
    assert (total, n) == (0.5, 3)
    assert kv_gap(versions, 0, mask, behaviour, fresh, 0) == (0.0, 0)


def test_the_step_metric_is_the_gap_per_token_of_the_probes_returned_in_the_interval():
    last = dict(STATS)
    s = last | {"kv_probes": 3, "kv_probe_cancelled": 1, "kv_probe_tokens": 8, "kv_probe_abs_sum": 2.0}
    assert kv_probe_metrics(s, last) == {"mismatch/kv_abs_logp_diff": 0.25, "mismatch/kv_tokens": 8,
                                         "rollout/kv_probes": 3, "rollout/kv_probe_cancelled": 1}
    later = s | {"kv_probes": 4, "kv_probe_tokens": 10, "kv_probe_abs_sum": 3.0}
    out = kv_probe_metrics(later, s)  # only what came back since the last step: 1.0 over 2 tokens
    assert out["mismatch/kv_abs_logp_diff"] == 0.5 and out["mismatch/kv_tokens"] == 2
    assert out["rollout/kv_probes"] == 1 and out["rollout/kv_probe_cancelled"] == 0
    none = kv_probe_metrics(later, later)
    assert math.isnan(none["mismatch/kv_abs_logp_diff"]) and none["mismatch/kv_tokens"] == 0
    # stats restored from a checkpoint written before the probe existed: its counters start at 0
    assert kv_probe_metrics(s, {"tokens": 5})["mismatch/kv_tokens"] == 8


@pytest.mark.parametrize("value", [-0.1, 1.5])
def test_the_config_check_names_the_key(value):
    from pace.config_checks import validate
    from pace.errors import ConfigError
    from tests.helpers import compose_cfg

    validate(compose_cfg(["rollout.kv_probe=0.5"]))
    with pytest.raises(ConfigError, match=r"rollout\.kv_probe"):
        validate(compose_cfg([f"rollout.kv_probe={value}"]))


def test_the_probe_needs_temperature_1():
    """ℓ^μ is tempered (processed log-probs); a probe's prompt log-probs are not: the gap would be the
    temperature's, not the stale context's."""
    from pace.config_checks import validate
    from pace.errors import ConfigError
    from tests.helpers import compose_cfg

    validate(compose_cfg(["rollout.temperature=0.7"]))
    with pytest.raises(ConfigError, match=r"rollout\.kv_probe .* needs rollout\.temperature=1"):
        validate(compose_cfg(["rollout.kv_probe=0.5", "rollout.temperature=0.7"]))


# ---------------------------------------------------------------- the mixin on a stand-in fleet

class _Fleet:
    def __init__(self):
        self.added, self.aborted = [], []

    def add_request(self, rid, prompt, params, priority=0, group=None):
        self.added.append((rid, prompt, params, priority, group))

    def abort_request(self, ids):
        self.aborted += ids


def _worker(share: float = 1.0, seed: int = 0):
    from types import SimpleNamespace

    from pace.rollout.failover import FailoverMixin
    from pace.rollout.kv_probe import KvProbeMixin

    class Worker(KvProbeMixin, FailoverMixin):
        pass

    w = Worker()
    w.fleet, w.engine_version, w.stats = _Fleet(), 2, {"failover_requests": 0}
    w._rescoring, w._rescore_started, w._val = {}, None, None
    w._init_kv_probe(SimpleNamespace(rollout=SimpleNamespace(kv_probe=share), data=SimpleNamespace(seed=seed)))
    return w


def _traj(versions, starts=(), mask=None):
    from pace.records import Trajectory

    n = len(versions)
    t = Trajectory(list(range(10, 10 + n)), [-0.5] * n, versions, action_mask=mask)
    t.starts = list(starts)
    return t


def _answer(rid, token_ids, fresh_from, fresh):
    """A finished probe: prompt log-probs ``fresh`` for token_ids[fresh_from:]."""
    from types import SimpleNamespace

    lps = [None] * fresh_from + [{tok: SimpleNamespace(logprob=x)} for tok, x in zip(token_ids[fresh_from:], fresh)]
    return SimpleNamespace(request_id=rid, finished=True, prompt_logprobs=lps, outputs=[])


def test_a_spanning_response_is_probed_under_its_last_tokens_weights_and_its_gap_counted():
    from pace.records import Group
    from pace.rollout import engine as engine_lib
    from pace.rollout import request_ids

    w = _worker()
    g = Group(7, "p", [5, 6], "3", 0)
    cases = {
        0: _traj([1, 1, 2, 2]),  # spans 1 → 2: probed
        1: _traj([2, 2]),  # one version: nothing to measure
        2: _traj([0, 1]),  # its last token's weights are gone (the engines hold 2)
        3: _traj([0, 1, 1, 2], starts=[1]),  # last request from 1, first token at 1: probed (token 3)
        4: _traj([1, 1, 2, 2], starts=[2]),  # last request began under 2: fresh KV
    }
    for i, t in cases.items():
        w._maybe_probe_kv(g, i, t)
    assert [a[0] for a in w.fleet.added] == [request_ids.kv_probe(7, 0), request_ids.kv_probe(7, 3)]
    rid, prompt, params, priority, _ = w.fleet.added[0]
    assert prompt == {"prompt_token_ids": [5, 6, 10, 11, 12, 13], "cache_salt": engine_lib.cache_salt(2)}
    assert params.prompt_logprobs == 0 and priority == engine_lib.SCORING_PRIORITY and w.stats["kv_probes"] == 2
    assert params.routed_experts_prompt_start == 6  # MoE routing replay: a probe's routes are not asked for
    # the engine's fresh log-probs: tokens 2-3 of response 0 differ by 0.25 and 0.5; 0-1 (v1) are not counted
    w._consume_kv_probe(_answer(rid, prompt["prompt_token_ids"], 2, [-9.0, -9.0, -0.75, -1.0]))
    assert (w.stats["kv_probe_abs_sum"], w.stats["kv_probe_tokens"]) == (0.75, 2) and len(w._kv_probes) == 1


def test_probes_are_dropped_at_an_update_and_on_a_failed_engine_and_never_sent_between_the_halves():
    from pace.records import Group
    from pace.rollout import request_ids

    w = _worker()
    g = Group(3, "p", [5], "3", 0)
    w._maybe_probe_kv(g, 0, _traj([1, 2]))
    w._cancel_kv_probes()  # begin_update (or _apply_update before the load)
    assert w.fleet.aborted == [request_ids.kv_probe(3, 0)] and not w._kv_probes and w.stats["kv_probe_cancelled"] == 1
    late = request_ids.kv_probe(3, 0)
    w._consume_kv_probe(_answer(late, [5, 10, 11], 1, [-1.0, -1.0]))  # its output arriving after the abort
    assert w.stats["kv_probe_tokens"] == 0
    w._maybe_probe_kv(g, 1, _traj([1, 2]))  # still θ_2 loaded, the update under way: not sent
    assert len(w.fleet.added) == 1
    w.engine_version = 3  # end_update
    w._maybe_probe_kv(g, 2, _traj([2, 3]))
    assert len(w.fleet.added) == 2
    w._recover([request_ids.kv_probe(3, 2)])  # its engine failed: dropped, not sent again
    assert len(w.fleet.added) == 2 and not w._kv_probes and w.stats["kv_probe_cancelled"] == 2
    assert w.stats["failover_requests"] == 1


def test_the_probed_share_is_drawn_per_response_and_repeats():
    from pace.records import Group

    def probed(seed):
        w = _worker(share=0.25, seed=seed)
        for gid in range(100):
            g = Group(gid, "p", [5], "3", 0)
            for i in range(4):
                w._maybe_probe_kv(g, i, _traj([1, 2]))
        return [a[0] for a in w.fleet.added]

    first = probed(0)
    assert 60 <= len(first) <= 140  # 400 × 0.25 = 100
    assert probed(0) == first and probed(1) != first
    off = _worker(share=0.0)
    off._maybe_probe_kv(Group(0, "p", [5], "3", 0), 0, _traj([1, 2]))
    assert not off.fleet.added
