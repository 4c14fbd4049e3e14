"""Generated multi-term addition/subtraction of graded difficulty: the tiny default's task.

A prompt is the bare expression, ``"12+345-7=?\\n"``; a correct response works the chain of
partial sums left to right, one line per operation, and ends with the answer line that the
grader reads (the content after the last ``Answer:``)::

    12+345=357
    357-7=350
    Answer: 350

Operands have a width drawn uniformly in 1..digits (so ``12+345+7`` mixes widths), and a
``-`` is only drawn when the running total covers it: every partial sum is non-negative, so
the model never has to produce a sign, only borrow. Response length grows with the number
of terms, so rollouts of the hard levels are several times longer than the easy ones.

Levels (tokens are characters, as in ``pace.tiny``'s tokenizer; prompt includes its "\\n",
response excludes EOS; over the 1,000 prompts per level of the default train split):

    | level | terms | digits | prompt tokens | response tokens (min / mean / max) |
    | ----- | ----- | ------ | ------------- | ---------------------------------- |
    | 1     | 2     | ≤ 2    | 6–8           | 15 / 18.4 / 21                     |
    | 2     | 3     | ≤ 2    | 8–11          | 21 / 26.7 / 32                     |
    | 3     | 4     | ≤ 3    | 10–18         | 27 / 42.0 / 53                     |
    | 4     | 5     | ≤ 3    | 12–22         | 33 / 53.1 / 67                     |
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

from pace.tasks.base import Prompt

# level -> (number of terms, maximum operand width in digits)
LEVELS: dict[int, tuple[int, int]] = {1: (2, 2), 2: (3, 2), 3: (4, 3), 4: (5, 3)}

ANSWER_PREFIX = "Answer: "
_TERM = re.compile(r"([+-]?)(\d+)")


@dataclass
class ArithmeticSpec:
    """Which problems make up the train and val splits."""

    levels: list[int] | None = None  # subset of LEVELS; None = all, mixed in equal shares
    n_train: int = 4000  # training prompts (the RL prompt pool)
    n_val: int = 400  # held-out prompts, disjoint from train
    seed: int = 0  # the splits are a pure function of (levels, n_train, n_val, seed)

    def level_list(self) -> list[int]:
        return check_levels(self.levels, LEVELS, "ArithmeticSpec")


def check_levels(levels: list[int] | None, known: dict, owner: str) -> list[int]:
    """``levels`` (None: all of ``known``), each one known; else a ValueError naming them."""
    out = sorted(known) if levels is None else list(levels)
    if not out or any(lv not in known for lv in out):
        raise ValueError(f"{owner}.levels: {levels!r}; known levels are {sorted(known)}")
    return out


def _operand(rng: random.Random, digits: int) -> int:
    width = rng.randint(1, digits)
    return rng.randint(0, 9) if width == 1 else rng.randrange(10 ** (width - 1), 10**width)


def random_expression(rng: random.Random, level: int) -> str:
    """One expression of ``level`` such as ``"12+345-7"``; partial sums never go negative."""
    terms, digits = LEVELS[level]
    total = _operand(rng, digits)
    parts = [str(total)]
    for _ in range(terms - 1):
        x = _operand(rng, digits)
        op = "-" if x <= total and rng.random() < 0.5 else "+"
        total = total - x if op == "-" else total + x
        parts.append(f"{op}{x}")
    return "".join(parts)


def prompt_text(expression: str) -> str:
    return f"{expression}=?\n"


def _steps(expression: str) -> list[tuple[int, str, int, int]]:
    """The chain of (left, op, operand, result) that evaluates ``expression`` left to right."""
    (_, first), *rest = _TERM.findall(expression)
    total, steps = int(first), []
    for op, x in rest:
        result = total - int(x) if op == "-" else total + int(x)
        steps.append((total, op, int(x), result))
        total = result
    return steps


def solution(prompt: Prompt) -> str:
    """The worked correct response to ``prompt`` (no EOS)."""
    steps = _steps(prompt.text.removesuffix("=?\n"))
    lines = [f"{a}{op}{x}={r}" for a, op, x, r in steps]
    return "\n".join(lines) + f"\n{ANSWER_PREFIX}{steps[-1][3]}"


def make_prompts(spec: ArithmeticSpec, split: str) -> list[Prompt]:
    """The ``split`` ("train" or "val") prompts: deterministic from the spec, unique, disjoint.

    Levels are assigned round-robin (prompt i has level ``levels[i % len(levels)]``), so any
    prefix of the list is a balanced mix. Val is drawn first from its own stream, so it does
    not change with ``n_train``; train redraws anything that collides with val.
    """
    if split not in ("train", "val"):
        raise ValueError(f"make_prompts: split must be 'train' or 'val', got {split!r}")
    levels = spec.level_list()
    val = draw_expressions(random.Random(f"arith-val-{spec.seed}"), levels, spec.n_val, taken=set())
    if split == "val":
        exprs = val
    else:
        exprs = draw_expressions(random.Random(f"arith-train-{spec.seed}"), levels, spec.n_train, taken=set(val))
    return [
        Prompt(
            id=f"arith-{split}-{i:06d}",
            text=prompt_text(e),
            answer=str(_steps(e)[-1][3]),
            meta={"level": levels[i % len(levels)]},
        )
        for i, e in enumerate(exprs)
    ]


def draw_expressions(rng: random.Random, levels: list[int], n: int, taken: set[str],
                     expression=None) -> list[str]:
    """``n`` distinct expressions not in ``taken``, levels round-robin; ``expression(rng, level)``
    draws one (default: this module's)."""
    expression = expression or random_expression
    out: list[str] = []
    seen = set(taken)
    for i in range(n):
        level = levels[i % len(levels)]
        for _ in range(10_000):  # level 1 holds ~20k distinct problems; the others millions
            e = expression(rng, level)
            if e not in seen:
                break
        else:
            raise ValueError(f"make_prompts: level {level} has run out of distinct problems at {i} prompts")
        seen.add(e)
        out.append(e)
    return out
