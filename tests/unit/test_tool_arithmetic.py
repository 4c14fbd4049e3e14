"""pace/tasks/tool_arithmetic.py: the tiny tool task, its traces, and that the protocol and the
grader read them as a rollout would."""
from __future__ import annotations

import pytest

from pace.reward import is_correct
from pace.tasks.tool_arithmetic import (LEVELS, ToolArithmeticSpec, direct_solution, evaluate, make_prompts,
                                        tool_segments, tool_solution)
from pace.tools.protocol import CODE_STOP, OUTPUT_END, OUTPUT_START, extract_code

pytestmark = pytest.mark.unit


def test_splits_are_deterministic_disjoint_and_graded():
    spec = ToolArithmeticSpec(n_train=200, n_val=40)
    train, val = make_prompts(spec, "train"), make_prompts(spec, "val")
    assert train == make_prompts(spec, "train") and len(train) == 200 and len(val) == 40
    assert not {p.text for p in train} & {p.text for p in val}
    assert [p.meta["level"] for p in train[:8]] == [1, 2, 3, 4, 1, 2, 3, 4]
    for p in train:
        expr = p.text.removesuffix("=?\n")
        op, widths = LEVELS[p.meta["level"]]
        assert [len(x) for x in expr.split(op)] == widths
        assert p.answer == str(evaluate(expr))
    with pytest.raises(ValueError, match="known levels"):
        make_prompts(ToolArithmeticSpec(levels=[9]), "train")


def test_tool_trace_is_a_rollout_the_protocol_and_grader_accept():
    from pace.tools.sandbox import Sandbox

    p = make_prompts(ToolArithmeticSpec(n_train=8, n_val=4, levels=[3]), "train")[0]
    trace = tool_solution(p)
    # the rollout stops right after the code block: that prefix holds the program to run
    upto = trace[: trace.index(CODE_STOP) + len(CODE_STOP)]
    code = extract_code(upto)
    with Sandbox("bwrap") as sb:
        assert sb.run(code).output.strip() == p.answer  # the interpreter text in the trace is the tool's output
    assert f"<interpreter>\n{p.answer}\n</interpreter>" in trace
    assert is_correct(trace, p.answer)


def test_both_traces_grade_correct_and_the_tool_output_is_context():
    for p in make_prompts(ToolArithmeticSpec(n_train=8, n_val=4), "train"):
        call, output, answer = tool_segments(p)
        assert call.endswith(CODE_STOP) and output.startswith(OUTPUT_START) and output.endswith(OUTPUT_END)
        assert p.answer in output and answer == f"Answer: {p.answer}"
        assert is_correct(direct_solution(p), p.answer) and is_correct(tool_solution(p), p.answer)
        assert not is_correct(direct_solution(p) + "1", p.answer)
