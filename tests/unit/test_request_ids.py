"""The rollout's request ids (pace/rollout/request_ids.py): every kind read back as built, any other id refused."""
from __future__ import annotations

import pytest

from pace.rollout import request_ids as ids
from pace.rollout.request_ids import RequestId

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("built", "parsed"), [
    (ids.response(0, 0), RequestId("g", 0, 0)),
    (ids.response(12, 7), RequestId("g", 12, 7)),
    (ids.response(12, 7, turn=3), RequestId("g", 12, 7, 3)),
    (ids.scoring(40, 15), RequestId("s", 40, 15)),
    (ids.kv_probe(40, 15), RequestId("k", 40, 15)),
    (ids.evaluation(ids.validation_prefix(6), "arith_l1", 3), RequestId("v", 6)),
    (ids.evaluation(ids.validation_prefix(0), "math-500", 3, sample=2, turn=1), RequestId("v", 0)),  # a '-' in the set
])
def test_an_id_reads_back_as_it_was_built(built, parsed):
    assert ids.parse(built) == parsed and ids.kind(built) == parsed.kind


def test_the_ids_are_the_ones_the_engines_have_always_seen():
    assert (ids.response(3, 1), ids.response(3, 1, 2), ids.scoring(3, 1)) == ("g3-1", "g3-1-2", "s3-1")
    assert (ids.group_key(ids.RESPONSE, 3), ids.group_key(ids.SCORING, 3)) == ("g3", "s3")
    assert ids.evaluation(ids.validation_prefix(4), "aime", 9, 1, 2) == "v4-aime-9-1-2"
    assert ids.evaluation("eval", "aime", 9, 1) == "eval-aime-9-1"


@pytest.mark.parametrize("foreign", ["", "g", "g3", "g3-", "g-1", "gx-1", "g3-1-2-4", "g3-1-0", "s3", "s3-1-2",
                                     "v", "v3", "vx-aime-1", "k3", "k3-1-2", "eval-aime-3", "rescore-0", "x3-1", "g3-1.2"])
def test_a_foreign_id_is_refused_naming_it(foreign):
    with pytest.raises(ValueError, match=f"request id '{foreign}' is not one of the rollout's"):
        ids.parse(foreign)


def test_a_group_key_is_only_for_responses_and_scoring():
    with pytest.raises(ValueError, match="no group key for request kind 'v'"):
        ids.group_key(ids.VALIDATION, 3)
    with pytest.raises(ValueError, match="no group key for request kind 'k'"):  # a probe is one request
        ids.group_key(ids.KV_PROBE, 3)


def test_a_wire_id_is_the_request_and_its_serial():
    assert ids.wire("g3-1-2", 17) == "g3-1-2.17"


def test_rescore_ids_are_apart_from_the_rollouts_and_refused_by_parse():
    """`rescore`'s requests share an engine with a rollout worker's in tests: none may be taken
    for a scoring request of the worker's (``s<group>-<i>``), nor read as any rollout request."""
    assert [ids.rescore(i) for i in range(2)] == ["rescore-0", "rescore-1"]  # the ids rescore has always sent
    assert ids.rescore(0) not in (ids.scoring(0, 0), ids.response(0, 0))
    with pytest.raises(ValueError, match="not one of the rollout's"):
        ids.parse(ids.rescore(0))


def test_rescore_sends_its_own_ids_and_takes_only_their_outputs(monkeypatch):
    """On an engine a rollout worker shares, a finished scoring request of its group 0 is not
    one of `rescore`'s answers."""
    from collections import defaultdict
    from types import SimpleNamespace

    from pace.rollout import engine as engine_lib

    monkeypatch.setattr(engine_lib, "scoring_params", lambda: "params")

    def out(rid, logprob):
        return SimpleNamespace(request_id=rid, finished=True,
                               prompt_logprobs=[None] + [defaultdict(lambda: SimpleNamespace(logprob=logprob))] * 3)

    class Engine:
        def __init__(self):
            self.added = []

        def add_request(self, rid, prompt, params):
            self.added.append((rid, prompt["prompt_token_ids"], params))

        def step(self):
            # the worker's scoring request first, then rescore's own
            return [out(ids.scoring(0, 0), -9.0), out(ids.scoring(0, 1), -9.0)] + [
                out(rid, -float(i + 1)) for i, (rid, _, _) in enumerate(self.added)]

    llm = SimpleNamespace(llm_engine=Engine())
    scores = engine_lib.rescore(llm, [([5, 1, 2, 3], 2), ([5, 3, 2, 1], 1)])
    assert [rid for rid, _, _ in llm.llm_engine.added] == [ids.rescore(0), ids.rescore(1)]
    assert scores == [[-1.0, -1.0], [-2.0, -2.0, -2.0]]
