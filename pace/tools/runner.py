"""Tool calls of multi-turn rollouts, run beside the engine.

The rollout thread (or an evaluation) hands over the text of a turn that stopped at `CODE_STOP`
(`submit` returns at once); the program runs in the sandbox on a thread pool of `tools.workers`
threads, so many responses' calls run at the same time while the engine keeps stepping the others;
`poll` returns the finished calls with the interpreter tokens to append (cut to the response's
remaining budget). A turn that stops at `CODE_STOP` without a program in front of it gets an error
message as its output, like a failing program. `turn_kwargs` gives the sampling arguments of the
next turn: the stop string while calls remain (`rollout.max_tool_calls`), none after.

Counters (`stats`): calls, sandbox seconds (summed over calls, so they can exceed wall time), and
calls per status (ok, error, timeout, killed, truncated, no_code). A failure of the sandbox
machinery itself (not of the program) is raised from `poll`: the run stops with its traceback
rather than feeding the model error messages for the rest of the run.
"""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor

from pace.tools.protocol import CODE_STOP, extract_code, format_output
from pace.tools.sandbox import Limits, Sandbox, ToolResult

NO_CODE = "SyntaxError: no program between <code> and </code>"


def is_tool_stop(completion) -> bool:
    """A vLLM completion that ended at `CODE_STOP` (the only stop string a turn is given)."""
    return completion.finish_reason == "stop" and completion.stop_reason == CODE_STOP


class ToolRunner:
    def __init__(self, cfg, tokenizer, max_tool_calls: int, on_done: Callable[[], None] | None = None):
        """``cfg``: the `tools` config node. ``on_done``: called (from a pool thread) when a call finishes."""
        self.tokenizer = tokenizer
        self.max_tool_calls = max_tool_calls
        limits = Limits(wall_s=cfg.wall_s, cpu_s=cfg.cpu_s, memory_mb=cfg.memory_mb, output_bytes=cfg.output_bytes)
        self.sandbox = Sandbox(cfg.sandbox, limits, warm=cfg.warm)
        self.output_chars = cfg.output_chars
        self._pool = ThreadPoolExecutor(cfg.workers, thread_name_prefix="tool")
        self._on_done = on_done
        self._lock = threading.Lock()
        self._running: dict[Hashable, Future] = {}
        self.stats: Counter = Counter()  # calls, seconds, status/<status>

    def turn_kwargs(self, calls: int) -> dict:
        """SamplingParams arguments of a turn after ``calls`` calls."""
        return {"stop": [CODE_STOP], "include_stop_str_in_output": True} if calls < self.max_tool_calls else {}

    def submit(self, key: Hashable, turn_ids: list[int], budget: int) -> None:
        """Run the program the turn (its token ids) ends with; ``budget``: response tokens left
        for the interpreter text and what follows. The result comes from `poll`."""
        code = extract_code(self.tokenizer.decode(turn_ids))
        if code is None:
            future: Future = Future()
            future.set_result(ToolResult(NO_CODE, "no_code", None, 0.0))
        else:
            future = self._pool.submit(self.sandbox.run, code)
        with self._lock:
            self._running[key] = (future, budget)
        if self._on_done is not None:
            future.add_done_callback(lambda _: self._on_done())

    def poll(self) -> list[tuple[Hashable, ToolResult, list[int]]]:
        """Finished calls as (key, result, interpreter tokens to append), in submission order. The
        tokens are cut to the budget given at `submit`: if they fill it the response is over."""
        with self._lock:
            done = [(k, f, b) for k, (f, b) in self._running.items() if f.done()]
            for k, _, _ in done:
                del self._running[k]
        out = []
        for key, future, budget in done:
            result = future.result()  # a sandbox failure (not the program's) raises here
            self.stats["calls"] += 1
            self.stats["seconds"] += result.seconds
            self.stats[f"status/{result.status}"] += 1
            text = format_output(result.output, self.output_chars)
            out.append((key, result, self.tokenizer(text, add_special_tokens=False).input_ids[:max(budget, 0)]))
        return out

    def wait(self) -> None:
        """Block until every submitted call has finished (`rollout.deterministic`)."""
        with self._lock:
            futures = list(self._running.values())
        for f, _ in futures:
            f.exception()

    @property
    def running(self) -> int:
        return len(self._running)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.sandbox.close()


def usage_metrics(trajectories) -> dict:
    """Tool use of the responses completed in a step (`tools/*`, docs/design.md §6 style names)."""
    n = len(trajectories)
    used = [t for t in trajectories if t.tool_calls]
    correct = [t for t in trajectories if t.correct]
    calls = sum(t.tool_calls for t in trajectories)
    out = {
        "tools/calls_per_response": calls / n,
        "tools/used_frac": len(used) / n,  # responses with at least one call
        "tools/error_frac": sum(t.tool_errors for t in trajectories) / calls if calls else 0.0,
    }
    if correct:  # the fraction of correct answers that used the tool
        out["tools/used_frac_correct"] = sum(1 for t in correct if t.tool_calls) / len(correct)
    if used:
        out["tools/acc_with_tool"] = sum(t.correct for t in used) / len(used)
    if len(used) < n:
        out["tools/acc_without_tool"] = (len(correct) - sum(1 for t in used if t.correct)) / (n - len(used))
    return out
