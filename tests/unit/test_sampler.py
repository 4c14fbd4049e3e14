"""Tests for pace.tasks.base.PromptSampler: epoch coverage and exact resume from state_dict."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pace.tasks.base import Prompt, PromptSampler

pytestmark = pytest.mark.unit


def prompts(n: int) -> list[Prompt]:
    return [Prompt(id=f"p{i}", text=f"q{i}", answer=str(i)) for i in range(n)]


def draw(sampler: PromptSampler, k: int) -> list[str]:
    return [sampler.next().id for _ in range(k)]


@settings(deadline=None, max_examples=50)
@given(st.integers(1, 40), st.integers(0, 10**6), st.integers(1, 4))
def test_every_prompt_once_per_epoch(n: int, seed: int, epochs: int) -> None:
    s = PromptSampler(prompts(n), seed=seed)
    seq = draw(s, n * epochs)
    for e in range(epochs):
        assert sorted(seq[e * n : (e + 1) * n]) == sorted(f"p{i}" for i in range(n))
    assert s.position == n * epochs


def test_epochs_are_reshuffled_and_seed_matters() -> None:
    n = 20
    a = draw(PromptSampler(prompts(n), seed=0), 2 * n)
    assert a[:n] != a[n:]  # a new order each epoch
    assert a[:n] != [f"p{i}" for i in range(n)]  # shuffled, not the file order
    assert draw(PromptSampler(prompts(n), seed=1), n) != a[:n]
    assert draw(PromptSampler(prompts(n), seed=0), 2 * n) == a  # deterministic


@settings(deadline=None, max_examples=50)
@given(st.integers(1, 15), st.integers(0, 1000), st.integers(0, 50), st.integers(1, 40))
def test_state_dict_resumes_the_exact_sequence(n: int, seed: int, before: int, after: int) -> None:
    reference = PromptSampler(prompts(n), seed=seed)
    draw(reference, before)
    state = reference.state_dict()
    expected = draw(reference, after)

    fresh = PromptSampler(prompts(n), seed=12345)  # seed comes from the state
    fresh.load_state_dict(state)
    assert draw(fresh, after) == expected

    # Rewinding a sampler that has already moved on (its cached epoch order must be dropped).
    moved = PromptSampler(prompts(n), seed=seed + 1)
    draw(moved, before + after + n)
    moved.load_state_dict(state)
    assert draw(moved, after) == expected


def test_state_dict_is_plain_and_does_not_alias() -> None:
    s = PromptSampler(prompts(5), seed=3)
    draw(s, 7)
    state = s.state_dict()
    assert state == {"seed": 3, "position": 7, "returned": []}
    draw(s, 2)
    assert state == {"seed": 3, "position": 7, "returned": []}


def test_empty_prompt_list_raises() -> None:
    with pytest.raises(ValueError):
        PromptSampler([])


def test_returned_prompts_come_first_and_survive_a_checkpoint() -> None:
    prompts = [Prompt(f"p{i}", f"q{i}", str(i)) for i in range(10)]
    a = PromptSampler(prompts, seed=3)
    drawn = [a.next().id for _ in range(4)]
    a.give_back([drawn[1], drawn[3]])  # two groups cut short
    b = PromptSampler(prompts, seed=3)
    b.load_state_dict(a.state_dict())
    expected = [a.next().id for _ in range(8)]
    assert expected[:2] == [drawn[1], drawn[3]] and not set(expected[2:]) & set(drawn[:4])
    assert [b.next().id for _ in range(8)] == expected
    assert b.position == 4 + 6  # returned prompts do not move the walk
    with pytest.raises(ValueError, match="'nope' is not in the prompt list"):
        a.give_back(["nope"])
