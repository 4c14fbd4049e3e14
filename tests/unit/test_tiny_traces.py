"""The tiny model's SFT traces (pace/tiny.py): worked solutions, direct answers and slips."""
from __future__ import annotations

import random
import re

import pytest

from pace.tasks.arithmetic import ANSWER_PREFIX, solution
from pace.tasks.base import Prompt
from pace.tiny import _sft_examples, _with_slip
from pace.tiny_spec import TinySpec

pytestmark = pytest.mark.unit
STEP = re.compile(r"(\d+)([+-])(\d+)=(\d+)")


def _steps(response: str) -> tuple[list[tuple[int, str, int, int]], int]:
    *lines, answer = response.split("\n")
    return [tuple(int(g) if g.isdigit() else g for g in STEP.fullmatch(line).groups()) for line in lines], int(
        answer.removeprefix(ANSWER_PREFIX))


def test_a_slip_is_one_wrong_result_carried_on_consistently() -> None:
    for seed in range(200):
        _check_slip(random.Random(seed), ["5+3=?\n", "12+345-7=?\n", "99-9+10+5=?\n", "7-7+0-0+1=?\n"][seed % 4])


def _check_slip(rng: random.Random, text: str) -> None:
    steps, answer = _steps(_with_slip(text, rng))
    right, right_answer = _steps(solution(Prompt(id="", text=text, answer="")))
    assert len(steps) == len(right) and [(op, x) for _, op, x, _ in steps] == [(op, x) for _, op, x, _ in right]
    wrong = [i for i, (a, op, x, r) in enumerate(steps) if r != (a + x if op == "+" else a - x)]
    assert len(wrong) == 1  # exactly one step is wrong ...
    a, op, x, r = steps[wrong[0]]
    assert 1 <= r - (a + x if op == "+" else a - x) <= 9  # ... too high by 1-9
    for (_, _, _, prev), (left, _, _, _) in zip(steps, steps[1:]):
        assert left == prev  # and the chain carries on from it
    assert answer == steps[-1][3] != right_answer and all(r >= 0 for *_, r in steps)


def test_the_fractions_of_direct_answers_and_slips() -> None:
    def kinds(spec: TinySpec) -> dict[str, int]:
        out = {"direct": 0, "slip": 0, "worked": 0}
        for text, [(response, trained)] in _sft_examples(spec, random.Random(0), 2000, set()):
            assert trained
            if "=" not in response:
                out["direct"] += 1
            elif response == solution(Prompt(id="", text=text, answer="")):
                out["worked"] += 1
            else:
                out["slip"] += 1
        return out

    assert kinds(TinySpec(error_fraction=0.0)) == {"direct": 0, "slip": 0, "worked": 2000}
    slips = kinds(TinySpec())  # the default: 40% of the traces slip once
    assert slips["direct"] == 0 and 700 < slips["slip"] < 900  # 0.4 · 2000 = 800 ± 3σ (σ ≈ 22)
    direct = kinds(TinySpec(direct_fraction=0.3, error_fraction=0.0))
    assert direct["slip"] == 0 and 520 < direct["direct"] < 680


def test_the_knobs_at_zero_keep_the_earlier_models_keys() -> None:
    # a knob at 0 is left out of the key, so the models built before the knob existed keep their caches:
    # the 700-step default of before, and the tool model (conf/model/tiny_tool.yaml)
    assert TinySpec(sft_steps=700, error_fraction=0.0).key() == "c055a169a715"
    assert TinySpec().key() == "c2b4bafd5563"  # 1,500 steps, error_fraction 0.4: the runs in README "Measured"
    assert len({TinySpec().key(), TinySpec(error_fraction=0.0).key(), TinySpec(direct_fraction=0.4).key()}) == 3
