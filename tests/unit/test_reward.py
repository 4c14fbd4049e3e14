"""Tests for pace.reward: extraction, correctness, adversarial inputs (pure; the process pool
that runs them is tested in tests/integration/test_grader_processes.py)."""
from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pace.reward import ANSWER_TIMEOUT_S, extract_answer, is_correct
from tests.helpers import ADVERSARIAL

# ---------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Let me think.\nAnswer: 42", "42"),
        ("Answer: $\\frac{1}{2}$.", "\\frac{1}{2}"),
        ("Answer: $$7$$", "7"),
        ("**Answer:** 13", "13"),
        ("Answer: 5.\nThanks for reading", "5"),
        ("Answer:\n\n  17\n", "17"),  # marker ending its line: the next line, as DAPO's regex does
        ("Answer: \\boxed{9}", "9"),
        ("Answer: 3.5", "3.5"),  # only a *trailing* period is stripped
    ],
)
def test_extract_answer_line(text: str, expected: str) -> None:
    assert extract_answer(text) == expected


def test_extract_missing() -> None:
    assert extract_answer("") is None
    assert extract_answer("I am not sure what the result is.") is None
    assert extract_answer("Answer:   \n") is None  # empty answer and no box


def test_extract_last_answer_line_wins() -> None:
    text = "Answer: 1\nWait, let me recheck.\nAnswer: 2\nAnswer: 3"
    assert extract_answer(text) == "3"


def test_extract_answer_line_beats_boxed() -> None:
    assert extract_answer("so \\boxed{4}\nAnswer: 5") == "5"


def test_extract_boxed_nested_braces() -> None:
    assert extract_answer("thus \\boxed{\\frac{1}{\\sqrt{2}}} done") == "\\frac{1}{\\sqrt{2}}"
    assert extract_answer("\\boxed{1} then \\boxed{2^{10}}") == "2^{10}"  # the last box
    assert extract_answer("\\boxed{\\{1,2\\}}") == "\\{1,2\\}"  # escaped braces do not count


def test_extract_boxed_unbalanced() -> None:
    # The last box never closes (cut off mid-answer): no answer, not an earlier box.
    assert extract_answer("\\boxed{1} and \\boxed{\\frac{1}{2}") is None
    assert extract_answer("\\boxed{") is None


def test_extract_only_looks_at_the_tail() -> None:
    # An "Answer:" more than TAIL_CHARS (4,000) before the end is not the final answer.
    assert extract_answer("Answer: 1\n" + "x" * 5_000) is None
    assert extract_answer("x" * 5_000 + "\nAnswer: 1") == "1"


# ---------------------------------------------------------------- correctness


@pytest.mark.parametrize(
    "response, gold",
    [
        ("Answer: 25", "25"),
        ("Answer: 25", "025"),  # zero-padded AIME gold
        ("Answer: 025", "25"),
        ("Answer: 1,000", "1000"),
        ("Answer: -3", "-3"),
        ("Answer: 0.50", "0.5"),
        ("Answer: 0.5", "\\frac{1}{2}"),
        ("Answer: \\frac{1}{2}", "0.5"),
        ("Answer: 2^{99}", "2^{99}"),
        ("Answer: 633825300114114700748351602688", "2^{99}"),
        ("Answer: \\sqrt{3}", "\\sqrt{3}"),
        ("The answer is \\boxed{\\frac{3}{4}}.", "\\frac{3}{4}"),
    ],
)
def test_is_correct_true(response: str, gold: str) -> None:
    assert is_correct(response, gold) is True


@pytest.mark.parametrize(
    "response, gold",
    [
        ("Answer: 24", "25"),
        ("Answer: 1,2", "12"),  # a pair, not a thousands separator
        ("Answer: \\frac{1}{3}", "0.5"),
        ("Answer: 2^{98}", "2^{99}"),
        ("Answer: \\sqrt{2}", "\\sqrt{3}"),
        ("no final answer here", "25"),
        ("Answer: 25", ""),
    ],
)
def test_is_correct_false(response: str, gold: str) -> None:
    assert is_correct(response, gold) is False


def test_is_correct_off_main_thread() -> None:
    # math-verify raises off the main thread when its signal timeout is on; is_correct must drop
    # the timeout there instead of silently scoring every LaTeX answer False.
    out: list[bool] = []
    t = threading.Thread(target=lambda: out.append(is_correct("Answer: \\frac{2}{4}", "\\frac{1}{2}")))
    t.start()
    t.join(timeout=30)
    assert out == [True]


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=-(10**30), max_value=10**30))
def test_integer_answer_property(n: int) -> None:
    assert is_correct(f"Some reasoning... Answer: {n}", str(n))


# ---------------------------------------------------------------- adversarial outputs

# Each call may spend up to ANSWER_TIMEOUT_S in each of parse(gold), parse(pred), verify.
QUICK_S = 3 * ANSWER_TIMEOUT_S + 0.5


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_never_raises_and_is_quick(name: str) -> None:
    text = ADVERSARIAL[name]
    t0 = time.monotonic()
    extracted = extract_answer(text)
    assert extracted is None or isinstance(extracted, str)
    assert is_correct(text, "25") in (True, False)
    assert time.monotonic() - t0 < QUICK_S, name


def test_adversarial_expected_values() -> None:
    assert is_correct(ADVERSARIAL["million_chars_then_answer"], "25") is True
    assert is_correct(ADVERSARIAL["huge_number"], "25") is False
    assert is_correct(ADVERSARIAL["huge_number_in_tail"], "9" * 3_001) is True  # exact, no int() limit


def test_extraction_is_linear_on_long_inputs() -> None:
    # Pure string work: no regex backtracking, cost bounded by the 4,000-char tail.
    t0 = time.monotonic()
    for text in (("Answer:" * 200_000), ("\\boxed{" * 200_000), ("{" * 1_000_000)):
        extract_answer(text)
    assert time.monotonic() - t0 < 1.0


def test_a_failed_answer_is_none_and_scores_wrong(monkeypatch) -> None:
    import pace.reward as reward

    def boom(*a, **k):
        raise RecursionError("sympy blew up")

    monkeypatch.setattr(reward, "_math_verify", boom)
    assert reward.check_answer("Answer: \\frac{1}{2}", "\\frac{1}{2}") is None
    assert reward.is_correct("Answer: \\frac{1}{2}", "\\frac{1}{2}") is False
    assert reward.check_answer("Answer: 7", "7") is True  # the plain-number path never calls it
