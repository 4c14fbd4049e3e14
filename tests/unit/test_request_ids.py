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
                                     "v", "v3", "vx-aime-1", "eval-aime-3", "rescore-0", "x3-1", "g3-1.2"])
def test_a_foreign_id_is_refused_naming_it(foreign):
    with pytest.raises(ValueError, match=f"request id '{foreign}' is not one of the rollout's"):
        ids.parse(foreign)


def test_a_group_key_is_only_for_responses_and_scoring():
    with pytest.raises(ValueError, match="no group key for request kind 'v'"):
        ids.group_key(ids.VALIDATION, 3)


def test_a_wire_id_is_the_request_and_its_serial():
    assert ids.wire("g3-1-2", 17) == "g3-1-2.17"
