"""mean@k evaluation: prompt sets by name, sampling on a vLLM engine, grading, and the tables.

    mean@k of a benchmark = mean over its problems of (correct samples / k)

`EvalRun` submits one request per problem with ``n = k`` to an engine, hands each finished
problem's k responses to the grader while generation goes on, and shows a progress bar with the
running accuracy. `evaluate` steps an engine of its own (eval.py); the rollout thread steps
the same `EvalRun` between rollout work for in-training validation. The table writers are pure.
"""
from __future__ import annotations

import csv
import io
from collections.abc import Callable

from pace.rollout import request_ids
from pace.tasks.base import Prompt

ARITH_SETS = {f"arith_l{level}": level for level in (1, 2, 3, 4)}  # the tiny val split, by level
TOOL_SETS = {f"tool_l{level}": level for level in (1, 2, 3, 4)}  # the tiny tool task's val split, by level


def mean_at_k(correct: list[list[bool]]) -> float:
    """Mean over problems of the fraction of their samples that are correct."""
    if not correct:
        raise ValueError("mean_at_k: no problems")
    return sum(sum(c) / len(c) for c in correct) / len(correct)


def load_sets(names: list[str], data_dir: str | None, template: str, arithmetic_spec=None,
              tool_spec=None) -> dict[str, list[Prompt]]:
    """Prompt lists by benchmark name: the math benchmarks (`math6` expands), the tiny
    arithmetic val split (`arithmetic` = levels 1–4 as `arith_l1` … `arith_l4`) and the tiny tool
    task's (`tool_arithmetic` = `tool_l1` … `tool_l4`)."""
    from pace.tasks import benchmarks

    out: dict[str, list[Prompt]] = {}
    math_names = []
    for name in names:
        if name == "arithmetic" or name in ARITH_SETS:
            from pace.tasks.arithmetic import ArithmeticSpec, make_prompts

            val = make_prompts(arithmetic_spec or ArithmeticSpec(), "val")
            for set_name, level in ARITH_SETS.items():
                if name in ("arithmetic", set_name):
                    out[set_name] = [p for p in val if p.meta["level"] == level]
        elif name == "tool_arithmetic" or name in TOOL_SETS:
            from pace.tasks import tool_arithmetic

            val = tool_arithmetic.make_prompts(tool_spec or tool_arithmetic.ToolArithmeticSpec(), "val")
            for set_name, level in TOOL_SETS.items():
                if name in ("tool_arithmetic", set_name):
                    out[set_name] = [p for p in val if p.meta["level"] == level]
        else:
            math_names.append(name)
    for name in benchmarks.expand(math_names):
        out[name] = benchmarks.load_benchmark(name, data_dir, template)
    return out


def title(name: str) -> str:
    from pace.tasks.benchmarks import BENCHMARKS

    if name in BENCHMARKS:
        return BENCHMARKS[name].title
    if name in ARITH_SETS:
        return f"Arith L{ARITH_SETS[name]}"
    if name in TOOL_SETS:
        return f"Tool L{TOOL_SETS[name]}"
    return name


def sets_from_config(cfg, tokenizer) -> tuple[dict[str, list[Prompt]], dict[str, int]]:
    """`eval.benchmarks` as prompt lists, with the training template (and chat template), and per
    set the number of prompts dropped because they cannot fit the engine's context with the
    response budget (`eval.max_tokens` or `rollout.max_tokens`). A set with nothing left is a
    `DataError` naming the keys to change."""
    from omegaconf import OmegaConf

    from pace.errors import DataError
    from pace.tasks.base import drop_overlong, prompt_token_limit, with_chat_template

    sets = load_sets(list(cfg.eval.benchmarks), cfg.eval.data_dir, cfg.data.template,
                     OmegaConf.to_object(cfg.data.arithmetic), OmegaConf.to_object(cfg.data.tool_arithmetic))
    if cfg.data.chat_template:
        sets = {name: with_chat_template(ps, tokenizer, cfg.data.enable_thinking) for name, ps in sets.items()}
    max_tokens = cfg.eval.max_tokens or cfg.rollout.max_tokens
    limit, keys = prompt_token_limit(cfg.rollout.max_model_len, max_tokens)
    dropped = {}
    for name, prompts in sets.items():
        # text prompts are tokenized by the engine, with the tokenizer's special tokens
        sets[name], dropped[name] = drop_overlong(prompts, tokenizer, limit, add_special_tokens=True)
        if not sets[name]:
            raise DataError(f"{name}: all {len(prompts)} prompts are longer than {limit} tokens ({keys}): raise "
                            "rollout.max_model_len, or lower eval.max_tokens / rollout.max_tokens")
    return sets, dropped


def tool_runner(cfg, tokenizer, on_done=None):
    """A `ToolRunner` when the config uses tools (rollout.max_tool_calls > 0), else None."""
    if not cfg.rollout.max_tool_calls:
        return None
    from pace.tools.runner import ToolRunner

    return ToolRunner(cfg.tools, tokenizer, cfg.rollout.max_tool_calls, on_done=on_done)


def sampling_params(cfg, tokenizer, seeded: bool = True, k: int | None = None):
    """``n = k`` (default `eval.k`) samples per problem, returned once per problem with all k (FINAL_ONLY),
    stopping where the rollout's responses stop (pace/rollout/stopping.py).

    ``seeded``: a per-request seed (``seed``), for eval.py on a GPU engine of its own. vLLM's CPU
    build fails on seeded requests whenever a step also holds a partially prefilled one ("CPU
    Generator does not use offset"); there, and on the rollout engine, sampling is unseeded and
    reproducible through the engine's seed (`LLM(seed=...)`) and the request order instead.
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from pace.rollout.stopping import stop_token_ids

    return SamplingParams(n=k or cfg.eval.k, max_tokens=cfg.eval.max_tokens or cfg.rollout.max_tokens,
                          temperature=cfg.eval.temperature, top_p=cfg.eval.top_p,
                          stop_token_ids=stop_token_ids(tokenizer, cfg.data),
                          seed=cfg.seed if seeded else None, output_kind=RequestOutputKind.FINAL_ONLY)


class EvalRun:
    """One evaluation's requests on an engine stepped by someone else (eval.py's loop, or the
    rollout thread during in-training validation).

    ``submit`` adds one request per problem (``params.n = k``, FINAL_ONLY) with ids
    ``<prefix>-<set>-<i>``; the stepper hands every finished output whose id ``owns`` to
    ``on_output`` and calls ``poll`` between steps. Finished problems are graded, overlapping
    generation, in jobs of about ``grade_answers`` answers (whole problems): one job per problem
    cost the engine loop ~15% on 2 cores in round trips to the grading processes. Each job's
    deadline is ``answer_timeout_s`` per answer (the training grader's is per group of G).

    With a ``tokenizer`` a problem goes to the engine as the token ids the engine would make of its
    text (`engine_token_ids`), asking for routed experts from the end of its prompt
    (`routed_experts_prompt_start`, as every tool turn does): on an engine that returns them
    (`algo.routing_replay`), whose every request gets its tokens' routes, a validation request then
    gets no row for its prompt. vLLM 0.32 has no request field that turns them off: the rows of its
    samples' tokens still come back, unread (docs/routing-replay.md). Without one, text prompts.

    With ``tools`` (a `ToolRunner`: multi-turn tool use, as in training) each of the k samples is
    its own request ``<prefix>-<set>-<i>-<j>``; a turn that stops at ``</code>`` runs its program,
    and ``poll`` appends the output and submits the next turn (``-<turn>`` appended to the id)
    within the ``params.max_tokens`` budget. Tool output counts toward the response length; a
    sample is graded on its own tokens only (a program printing "Answer: ..." does not answer).
    """

    def __init__(self, sets: dict[str, list[Prompt]], params, grader, prefix: str = "eval",
                 grade_answers: int = 64, answer_timeout_s: float | None = None, progress: bool = False,
                 tools=None, tokenizer=None):
        self.sets, self.params, self.grader, self.prefix = sets, params, grader, prefix
        self.tools = tools
        self.tokenizer = tokenizer  # prompts sent as token ids (see above); None: as text
        self._samples: dict[tuple[str, int], list] = {}  # tools: per problem, k (length, own tokens) or None
        # per sample in progress: prompt, response (with tool output), turn, the model's own tokens
        self._turns: dict[tuple[str, int, int], tuple[list[int], list[int], int, list[int]]] = {}
        self._engine = self._priority = self._salt = None
        self.grade_answers = grade_answers
        self.answer_timeout_s = answer_timeout_s
        self.results: dict[str, list[list[bool] | None]] = {name: [None] * len(ps) for name, ps in sets.items()}
        self._requests: dict[str, tuple[str, int]] = {}
        self._buffer: list[tuple[str, int, list[str]]] = []  # finished, not yet submitted for grading
        self._jobs: list[tuple[list[tuple[str, int, int]], object]] = []  # ((set, i, n) per problem, job)
        self._received = self._graded = 0
        self._right = self._total = 0
        self.lengths: list[int] = []  # response lengths in tokens, every sample
        from tqdm import tqdm

        self._bar = tqdm(total=sum(len(ps) for ps in sets.values()), desc="eval", unit="problem",
                         disable=not progress, dynamic_ncols=True)

    @property
    def tool_calls(self) -> int:
        return self.tools.stats["calls"] if self.tools is not None else 0

    @property
    def num_problems(self) -> int:
        return sum(len(ps) for ps in self.sets.values())

    def submit(self, engine, priority: int = 0, salt: str | None = None) -> None:
        """Add every problem's request; ``salt`` keys the prefix cache (the weight version)."""
        self._engine, self._priority, self._salt = engine, priority, salt
        for name, prompts in self.sets.items():
            for i, p in enumerate(prompts):
                if self.tools is not None:
                    self._samples[(name, i)] = [None] * self.params.n
                    ids = self.tools.tokenizer(p.text, add_special_tokens=False).input_ids
                    for j in range(self.params.n):
                        self._add_turn((name, i, j), ids, [], 0)
                    continue
                rid = request_ids.evaluation(self.prefix, name, i)
                self._requests[rid] = (name, i)
                engine.add_request(rid, *self._request(p.text), priority=priority)

    def resubmit(self, engine, request_id: str) -> None:
        """Send a request again as it was first sent (its engine failed: pace/rollout/failover.py)."""
        key = self._requests.pop(request_id)
        if self.tools is not None:
            prompt_ids, response, turn, own = self._turns[key]
            self._add_turn(key, prompt_ids, response, turn, own)
            return
        name, i = key
        self._requests[request_id] = key
        engine.add_request(request_id, *self._request(self.sets[name][i].text), priority=self._priority)

    def _request(self, text: str) -> tuple[dict, object]:
        """A problem's prompt and sampling parameters: its text, or (``tokenizer``) its token ids with
        routed experts asked from the end of the prompt (a shallow copy of ``params``: vLLM clones a
        request's parameters before it changes any, vllm/v1/engine/input_processor.py)."""
        if self.tokenizer is None:
            prompt, params = {"prompt": text}, self.params
        else:
            import copy

            from pace.tasks.base import engine_token_ids

            ids = engine_token_ids(self.tokenizer, text)
            prompt, params = {"prompt_token_ids": ids}, copy.copy(self.params)
            params.routed_experts_prompt_start = len(ids)
        if self._salt is not None:
            prompt["cache_salt"] = self._salt
        return prompt, params

    def owns(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def request_ids(self) -> list[str]:
        return list(self._requests)

    def _add_turn(self, key: tuple[str, int, int], prompt_ids: list[int], response: list[int], turn: int,
                  own: list[int] | None = None) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        name, i, j = key
        rid = request_ids.evaluation(self.prefix, name, i, j, turn)
        p = self.params
        seed = None if p.seed is None else p.seed + j + 100_003 * turn  # k distinct samples, seeded
        params = SamplingParams(n=1, max_tokens=p.max_tokens - len(response), temperature=p.temperature, top_p=p.top_p,
                                stop_token_ids=p.stop_token_ids, seed=seed, output_kind=RequestOutputKind.FINAL_ONLY,
                                routed_experts_prompt_start=len(prompt_ids) + len(response),  # none of its prompt's
                                **self.tools.turn_kwargs(turn))
        self._requests[rid] = key
        self._turns[key] = (prompt_ids, response, turn, [] if own is None else own)
        prompt = {"prompt_token_ids": prompt_ids + response}
        if self._salt is not None:
            prompt["cache_salt"] = self._salt
        self._engine.add_request(rid, prompt, params, priority=self._priority)

    def _on_turn(self, key: tuple[str, int, int], completion) -> None:
        from pace.tools.runner import is_tool_stop

        prompt_ids, response, turn, own = self._turns[key]
        start = len(response)
        response += completion.token_ids
        own += completion.token_ids
        left = self.params.max_tokens - len(response)
        if is_tool_stop(completion) and left > 0:
            self.tools.submit(key, response[start:], left)
        else:
            self._sample_done(key)

    def _collect_tools(self) -> None:
        for key, _result, ids in self.tools.poll():
            prompt_ids, response, turn, own = self._turns[key]
            response += ids
            if len(response) >= self.params.max_tokens:
                self._sample_done(key)
            else:
                self._add_turn(key, prompt_ids, response, turn + 1, own)

    def _sample_done(self, key: tuple[str, int, int]) -> None:
        name, i, j = key
        _, response, _, own = self._turns.pop(key)
        samples = self._samples[(name, i)]
        samples[j] = (len(response), own)
        if all(s is not None for s in samples):
            del self._samples[(name, i)]
            self.lengths.extend(n for n, _ in samples)
            texts = self.tools.tokenizer.batch_decode([own for _, own in samples], skip_special_tokens=True)
            self._buffer.append((name, i, texts))
            self._received += 1

    def on_output(self, out) -> None:
        if not out.finished:
            return
        if self.tools is not None:
            self._on_turn(self._requests[out.request_id], out.outputs[0])
            return
        name, i = self._requests[out.request_id]
        texts = [c.text for c in out.outputs]
        if len(texts) != self.params.n:
            raise RuntimeError(f"{out.request_id}: {len(texts)} samples, expected n = {self.params.n}")
        self.lengths.extend(len(c.token_ids) for c in out.outputs)
        self._buffer.append((name, i, texts))
        self._received += 1

    def poll(self, block: bool = False) -> bool:
        """Hand full grading jobs (all remaining once every problem is in) to the grader and take
        finished ones; ``block`` waits for all submitted jobs. True when every problem is graded."""
        if self.tools is not None:
            self._collect_tools()
        pending = sum(len(ts) for _, _, ts in self._buffer)
        if pending and (pending >= self.grade_answers or self._received == self.num_problems):
            self._submit_grading()
        while self._jobs and (block or self._jobs[0][1].done()):
            keys, job = self._jobs.pop(0)
            scores = job.result()
            at = 0
            for name, i, n in keys:
                self.results[name][i] = scores[at : at + n]
                at += n
            self._graded += len(keys)
            self._right, self._total = self._right + sum(scores), self._total + len(scores)
            self._bar.update(len(keys))
            self._bar.set_postfix(acc=f"{self._right / max(self._total, 1):.3f}")
        if self.done:
            self._bar.close()
            if self.tools is not None:
                self.tools.close()
        return self.done

    @property
    def done(self) -> bool:
        return self._graded == self.num_problems

    def _submit_grading(self) -> None:
        keys = [(name, i, len(texts)) for name, i, texts in self._buffer]
        texts = [t for _, _, ts in self._buffer for t in ts]
        golds = [self.sets[name][i].answer for name, i, ts in self._buffer for _ in ts]
        timeout = None if self.answer_timeout_s is None else self.answer_timeout_s * len(texts)
        self._jobs.append((keys, self.grader.submit(texts, golds, timeout_s=timeout)))
        self._buffer.clear()


def evaluate(engine, sets: dict[str, list[Prompt]], params, grader, progress: bool = True,
             request_prefix: str = "eval", priority: int = 0, grade_answers: int = 64,
             answer_timeout_s: float | None = None, tools=None) -> dict[str, list[list[bool]]]:
    """Per benchmark, per problem, the k graded samples (``params.n = k``), on an engine
    (a vLLM ``LLMEngine``) with nothing else running: this loop steps it until they are done.
    ``tools``: a `ToolRunner` for multi-turn tool use (see `EvalRun`)."""
    import time

    run = EvalRun(sets, params, grader, request_prefix, grade_answers, answer_timeout_s, progress, tools)
    run.submit(engine, priority)
    while engine.has_unfinished_requests() or (tools is not None and tools.running):
        if engine.has_unfinished_requests():
            for out in engine.step():
                if run.owns(out.request_id):
                    run.on_output(out)
        else:
            time.sleep(0.005)  # only tool calls are running
        run.poll()
    run.poll(block=True)
    return run.results  # type: ignore[return-value]


def summarize(results: dict[str, list[list[bool]]]) -> dict[str, float]:
    """mean@k per benchmark plus `avg`, the unweighted mean over benchmarks (Table 1's average)."""
    scores = {name: mean_at_k(correct) for name, correct in results.items()}
    scores["avg"] = sum(scores.values()) / len(scores)
    return scores


def _rows(table: dict[str, dict[str, float]]) -> tuple[list[str], list[list[str]]]:
    """Header and rows (one per method / model, one column per benchmark, then the average), in %."""
    names = [n for n in next(iter(table.values())) if n != "avg"]
    header = ["method", *(title(n) for n in names), "Avg."]
    rows = [[method, *(f"{100 * s[n]:.2f}" for n in names), f"{100 * s['avg']:.2f}"] for method, s in table.items()]
    return header, rows


def markdown_table(table: dict[str, dict[str, float]], k: int, dropped: dict[str, int] | None = None) -> str:
    """The table; ``dropped`` (prompts per benchmark too long for the context) is noted under it."""
    header, rows = _rows(table)
    lines = [f"mean@{k} (%)", "", "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    cut = {name: n for name, n in (dropped or {}).items() if n}
    if cut:
        lines += ["", "Prompts dropped (too long for the engine's context): "
                  + ", ".join(f"{title(name)} {n}" for name, n in cut.items())]
    return "\n".join(lines) + "\n"


def csv_table(table: dict[str, dict[str, float]]) -> str:
    header, rows = _rows(table)
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows([header, *rows])
    return buf.getvalue()


def latex_table(table: dict[str, dict[str, float]], k: int) -> str:
    header, rows = _rows(table)
    esc: Callable[[str], str] = lambda s: s.replace("_", r"\_").replace("%", r"\%")  # noqa: E731
    lines = [
        r"\begin{tabular}{l" + "c" * (len(header) - 1) + "}",
        r"\toprule",
        " & ".join(esc(h) for h in header) + r" \\",
        r"\midrule",
        *(" & ".join(esc(c) for c in r) + r" \\" for r in rows),
        r"\bottomrule",
        r"\end{tabular}",
    ]
    return f"% mean@{k} (%)\n" + "\n".join(lines) + "\n"
