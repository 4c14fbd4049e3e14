"""Generated products and long sums that are much easier with the Python tool (the tiny multi-turn tool task).

A prompt is the bare expression, ``"4821*937=?\\n"``. Worked in the head, a product of two
multi-digit numbers is out of the tiny model's reach; with the tool it is one line of code. The
two response styles the SFT warm start mixes (`pace.tiny` builds it):

    with the tool                                    direct (in the head)
    <code>                                           Answer: 4517277
    print(4821*937)
    </code>
    <interpreter>
    4517277
    </interpreter>
    Answer: 4517277

Both traces are right; the model can only reproduce the direct one where it has learned the
arithmetic (level 1, in part), while the tool trace only asks it to copy the expression into the
program and the interpreter's output into the answer. (No ``` fence in the tiny traces: every
character is a token; `extract_code` accepts fenced and bare programs.)

The interpreter block is what the rollout appends after running the code (pace/tools/protocol.py);
in a trace it stands for the tool's real output, so the model learns to read it. The warm start
uses the tool on a fraction of its traces only, so RL has a tool-use rate to raise.

Levels (operand widths in digits; the sums have five terms):

    | level | expression        | example         |
    | ----- | ----------------- | --------------- |
    | 1     | 1-digit × 2-digit | 7*86            |
    | 2     | 2-digit × 2-digit | 47*86           |
    | 3     | 3-digit × 3-digit | 482*937         |
    | 4     | sum of 5 × 4-digit | 4821+9370+1234+5678+2468 |
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from pace.tasks.arithmetic import check_levels, draw_expressions
from pace.tasks.base import Prompt
from pace.tools.protocol import CODE_START, CODE_STOP, format_output

LEVELS: dict[int, tuple[str, list[int]]] = {1: ("*", [1, 2]), 2: ("*", [2, 2]), 3: ("*", [3, 3]), 4: ("+", [4] * 5)}
ANSWER_PREFIX = "Answer: "


@dataclass
class ToolArithmeticSpec:
    levels: list[int] | None = None  # subset of LEVELS; None = all, round-robin
    n_train: int = 2000  # level 1 has 810 distinct problems: 500 per level for training, 100 for val
    n_val: int = 400
    seed: int = 0

    def level_list(self) -> list[int]:
        return check_levels(self.levels, LEVELS, "ToolArithmeticSpec")


def random_expression(rng: random.Random, level: int) -> str:
    op, widths = LEVELS[level]
    return op.join(str(rng.randrange(10 ** (w - 1), 10**w)) for w in widths)


def evaluate(expression: str) -> int:
    """The value of a product or sum of non-negative integers (no eval)."""
    if "*" in expression:
        out = 1
        for x in expression.split("*"):
            out *= int(x)
        return out
    return sum(int(x) for x in expression.split("+"))


def tool_segments(prompt: Prompt) -> tuple[str, str, str]:
    """The response that asks the tool, as (model text up to the stop, interpreter text, model
    text after it): the middle part is what the rollout appends (context, not actions)."""
    expression = prompt.text.removesuffix("=?\n")
    value = str(evaluate(expression))
    return f"{CODE_START}\nprint({expression})\n{CODE_STOP}", format_output(value, 1000), f"{ANSWER_PREFIX}{value}"


def tool_solution(prompt: Prompt) -> str:
    """The response that asks the tool, reads its output and answers (no EOS)."""
    return "".join(tool_segments(prompt))


def direct_solution(prompt: Prompt) -> str:
    """The answer given directly, without the tool (no EOS)."""
    return ANSWER_PREFIX + str(evaluate(prompt.text.removesuffix("=?\n")))


def make_prompts(spec: ToolArithmeticSpec, split: str) -> list[Prompt]:
    """The ``split`` ("train" or "val") prompts: deterministic from the spec, unique, disjoint."""
    if split not in ("train", "val"):
        raise ValueError(f"make_prompts: split must be 'train' or 'val', got {split!r}")
    levels = spec.level_list()
    val = draw_expressions(random.Random(f"tool-val-{spec.seed}"), levels, spec.n_val, set(), random_expression)
    exprs = val if split == "val" else draw_expressions(random.Random(f"tool-train-{spec.seed}"), levels, spec.n_train,
                                                        set(val), random_expression)
    return [Prompt(id=f"tool-{split}-{i:06d}", text=f"{e}=?\n", answer=str(evaluate(e)),
                   meta={"level": levels[i % len(levels)]}) for i, e in enumerate(exprs)]

