"""pace/tools/runner.py: tool calls run beside the caller (real bubblewrap sandbox), their output
comes back as interpreter tokens cut to the response budget, and the per-turn stop string ends
after max_tool_calls."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from pace.config import ToolsConfig
from pace.tiny import build_tokenizer
from pace.tools.protocol import CODE_STOP, OUTPUT_END, OUTPUT_START
from pace.tools.runner import NO_CODE, ToolRunner, is_tool_stop, usage_metrics

pytestmark = pytest.mark.unit


@pytest.fixture()
def runner():
    tok = build_tokenizer()
    runner = ToolRunner(ToolsConfig(workers=4, wall_s=5.0, cpu_s=2), tok, max_tool_calls=2)
    yield runner
    runner.close()


def _ids(runner, text):
    return runner.tokenizer(text, add_special_tokens=False).input_ids


def _wait(runner, n, timeout=30.0):
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += runner.poll()
        time.sleep(0.01)
    return got


def test_calls_run_concurrently_and_return_interpreter_tokens(runner):
    t0 = time.monotonic()
    for i in range(4):  # each sleeps 1 s: together well under 4 s
        runner.submit(i, _ids(runner, f"<code>\nimport time\ntime.sleep(1)\nprint({i} * 7)\n</code>"), budget=200)
    assert runner.running == 4
    got = _wait(runner, 4)
    assert time.monotonic() - t0 < 3.0
    assert sorted(k for k, _, _ in got) == [0, 1, 2, 3]
    for key, result, ids in got:
        assert result.status == "ok"
        assert runner.tokenizer.decode(ids) == f"{OUTPUT_START}{key * 7}{OUTPUT_END}"
    assert runner.stats["calls"] == 4 and runner.stats["status/ok"] == 4 and runner.running == 0


def test_errors_are_output_and_counted_and_budget_cuts(runner):
    runner.submit("raise", _ids(runner, "<code>\n1/0\n</code>"), budget=500)
    runner.submit("empty", _ids(runner, f"no program {CODE_STOP}"), budget=500)
    runner.submit("cut", _ids(runner, "<code>\nprint('x' * 100)\n</code>"), budget=10)
    got = {k: (r, ids) for k, r, ids in _wait(runner, 3)}
    assert got["raise"][0].status == "error" and "ZeroDivisionError" in runner.tokenizer.decode(got["raise"][1])
    assert got["empty"][0].status == "no_code" and NO_CODE in runner.tokenizer.decode(got["empty"][1])
    assert len(got["cut"][1]) == 10  # fills the budget: the response is over
    assert runner.stats["status/error"] == 1 and runner.stats["status/no_code"] == 1


def test_turn_kwargs_stop_at_code_until_the_call_limit(runner):
    assert runner.turn_kwargs(0) == runner.turn_kwargs(1) == {"stop": [CODE_STOP], "include_stop_str_in_output": True}
    assert runner.turn_kwargs(2) == {}
    assert is_tool_stop(SimpleNamespace(finish_reason="stop", stop_reason=CODE_STOP))
    assert not is_tool_stop(SimpleNamespace(finish_reason="stop", stop_reason=None))  # EOS
    assert not is_tool_stop(SimpleNamespace(finish_reason="length", stop_reason=None))


def test_usage_metrics():
    t = lambda calls, ok, err=0: SimpleNamespace(tool_calls=calls, correct=ok, tool_errors=err)  # noqa: E731
    m = usage_metrics([t(1, True), t(2, False, 1), t(0, True), t(0, False)])
    assert m["tools/calls_per_response"] == 0.75 and m["tools/used_frac"] == 0.5
    assert m["tools/used_frac_correct"] == 0.5 and m["tools/error_frac"] == pytest.approx(1 / 3)
    assert m["tools/acc_with_tool"] == 0.5 and m["tools/acc_without_tool"] == 0.5
    assert "tools/used_frac_correct" not in usage_metrics([t(1, False)])
