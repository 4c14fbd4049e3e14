"""mean@k evaluation: prompt sets by name, sampling on a vLLM engine, grading, and the tables.

    mean@k of a benchmark = mean over its problems of (correct samples / k)

`evaluate` submits one request per problem with ``n = k`` to an engine it steps itself, hands each
finished problem's k responses to the grader while generation goes on, and shows a progress bar
with the running accuracy. The same function serves `eval.py` (its own engine) and, later,
in-training validation (the rollout engine). The table writers are pure.
"""
from __future__ import annotations

import csv
import io
from collections.abc import Callable

from pace.tasks.base import Prompt

ARITH_SETS = {f"arith_l{level}": level for level in (1, 2, 3, 4)}  # the tiny val split, by level


def mean_at_k(correct: list[list[bool]]) -> float:
    """Mean over problems of the fraction of their samples that are correct."""
    if not correct:
        raise ValueError("mean_at_k: no problems")
    return sum(sum(c) / len(c) for c in correct) / len(correct)


def load_sets(names: list[str], data_dir: str | None, template: str, arithmetic_spec=None) -> dict[str, list[Prompt]]:
    """Prompt lists by benchmark name: the math benchmarks (`math6` expands) and the tiny
    arithmetic val split (`arithmetic` = levels 1–4 as `arith_l1` … `arith_l4`)."""
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
    return name


def evaluate(engine, sets: dict[str, list[Prompt]], params, grader, progress: bool = True,
             request_prefix: str = "eval", priority: int = 0, grade_answers: int = 64) -> dict[str, list[list[bool]]]:
    """Per benchmark, per problem, the k graded samples (``params.n = k``).

    ``engine`` is a vLLM ``LLMEngine`` with nothing else running (eval.py) — the loop steps it
    until these requests are done. ``params`` must use ``RequestOutputKind.FINAL_ONLY`` so each
    problem's output arrives once, with its k samples. Finished problems are graded, overlapping
    generation, in jobs of about ``grade_answers`` answers (whole problems): one job per problem
    cost the engine loop ~15% on 2 cores in round trips to the grading processes. The grader's
    per-job deadline must allow for that many answers (see eval.py).
    """
    from tqdm import tqdm

    requests: dict[str, tuple[str, int]] = {}
    for name, prompts in sets.items():
        for i, p in enumerate(prompts):
            rid = f"{request_prefix}-{name}-{i}"
            requests[rid] = (name, i)
            engine.add_request(rid, {"prompt": p.text}, params, priority=priority)
    results: dict[str, list[list[bool] | None]] = {name: [None] * len(ps) for name, ps in sets.items()}
    buffer: list[tuple[str, int, list[str]]] = []  # finished, not yet submitted for grading
    jobs: list[tuple[list[tuple[str, int, int]], object]] = []  # ((name, i, n samples) per problem, job)
    right = total = 0
    bar = tqdm(total=len(requests), desc="eval", unit="problem", disable=not progress)

    def submit() -> None:
        if buffer:
            keys = [(name, i, len(texts)) for name, i, texts in buffer]
            texts = [t for _, _, ts in buffer for t in ts]
            golds = [sets[name][i].answer for name, i, ts in buffer for _ in ts]
            jobs.append((keys, grader.submit(texts, golds)))
            buffer.clear()

    def collect(block: bool) -> None:
        nonlocal right, total
        while jobs and (block or jobs[0][1].done()):
            keys, job = jobs.pop(0)
            scores = job.result()
            at = 0
            for name, i, n in keys:
                results[name][i] = scores[at : at + n]
                at += n
            right, total = right + sum(scores), total + len(scores)
            bar.update(len(keys))
            bar.set_postfix(acc=f"{right / max(total, 1):.3f}")

    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id in requests:
                name, i = requests[out.request_id]
                texts = [c.text for c in out.outputs]
                if len(texts) != params.n:
                    raise RuntimeError(f"{out.request_id}: {len(texts)} samples, expected n = {params.n}")
                buffer.append((name, i, texts))
        if sum(len(ts) for _, _, ts in buffer) >= grade_answers:
            submit()
        collect(block=False)
    submit()
    collect(block=True)
    bar.close()
    return results  # type: ignore[return-value]


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


def markdown_table(table: dict[str, dict[str, float]], k: int) -> str:
    header, rows = _rows(table)
    lines = [f"mean@{k} (%)", "", "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
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
