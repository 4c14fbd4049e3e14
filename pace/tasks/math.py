"""Math datasets (DAPO-Math-17K for training) from a hub id or a local file, with DAPO's prompt template.

Field mapping covers the layouts in circulation (see shared/benchmarks/README.md):
    problem  ← `prompt` (str, or a chat list whose first message holds the problem) | `problem`
    answer   ← `reward_model.ground_truth` | `solution` | `answer`
The official DAPO file stores the template-wrapped problem; `strip_dapo_template` recovers the bare
problem so one template is applied everywhere. The hub's DAPO-Math-17k repeats its rows 100 times:
`load_math_prompts` keeps one prompt per problem (`data.dedup`), dropping the repeats on the arrow
columns (`pace.tasks.dedup`) before any row becomes a Python object.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from pace.errors import DataError
from pace.tasks.base import Prompt

DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'

# Multi-turn tool use (ReTool setting, rollout.max_tool_calls > 0): the protocol of pace/tools/protocol.py.
RETOOL_PREFIX = (
    "Solve the following math problem step by step. You may write Python code to help your reasoning: "
    "put a complete script (with its imports) between <code> and </code>, as\n<code>\n```python\n"
    "print(1 + 1)\n```\n</code>\nand it will be run in a sandbox; what it prints comes back between "
    "<interpreter> and </interpreter>, and you continue from there. Use print to see results. "
    "The last line of your response should be of the form Answer: $Answer (without quotes) where "
    "$Answer is the answer to the problem.\n\n"
)

TEMPLATES = {
    "dapo": lambda problem: DAPO_PREFIX + problem + DAPO_SUFFIX,
    "retool": lambda problem: RETOOL_PREFIX + problem + DAPO_SUFFIX,
    "plain": lambda problem: problem,
}


def strip_dapo_template(text: str) -> str:
    if text.startswith(DAPO_PREFIX) and text.endswith(DAPO_SUFFIX):
        return text[len(DAPO_PREFIX) : -len(DAPO_SUFFIX)]
    return text


def row_problem_answer(row: dict) -> tuple[str | None, str | None]:
    prompt = row.get("prompt", row.get("problem"))
    if isinstance(prompt, list):
        prompt = prompt[0].get("content") if prompt and isinstance(prompt[0], dict) else None
    answer = None
    if isinstance(row.get("reward_model"), dict):
        answer = row["reward_model"].get("ground_truth")
    if answer is None:
        answer = row.get("solution", row.get("answer"))
    if not isinstance(prompt, str) or not prompt.strip() or answer is None or str(answer).strip() == "":
        return None, None
    return strip_dapo_template(prompt), str(answer).strip()


def read_source(path: str, split: str = "train"):
    """A local .jsonl / .json file as a list of row dicts; a local .parquet file or a hub dataset
    (datasets.load_dataset) as a pyarrow Table, so that repeated rows can be dropped on the columns."""
    p = Path(path)
    if p.exists():
        if p.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(p)
        with open(p) as f:
            if p.suffix == ".json":
                return json.load(f)
            return [json.loads(line) for line in f if line.strip()]
    if path.startswith((".", "/", "~")) or p.suffix in (".jsonl", ".json", ".parquet"):
        raise DataError(f"data file not found: {path}")
    try:
        import datasets

        return datasets.load_dataset(path, split=split).with_format("arrow")[:]
    except Exception as exc:  # noqa: BLE001 - one line for the user, whatever the hub says
        raise DataError(f"cannot load dataset {path!r} (split {split!r}): {type(exc).__name__}: {exc}".splitlines()[0]) from exc


def read_rows(path: str, split: str = "train") -> list[dict]:
    """Rows of a local .jsonl / .json / .parquet file, or of a hub dataset, as dicts."""
    source = read_source(path, split)
    # to_pylist, not pandas' to_dict: pandas hands a list column back as numpy arrays, which the
    # chat-list layout (`prompt` = [{content, role}]) would not be read from
    return source if isinstance(source, list) else source.to_pylist()


# The columns `row_problem_answer` reads: rows equal on them give the same problem and answer.
LOADER_COLUMNS = ("prompt", "problem", "reward_model", "solution", "answer")


def distinct_loader_rows(table) -> tuple[list[int], list[int], list[dict]]:
    """The first row of each distinct value of `LOADER_COLUMNS`, in file order (`pace.tasks.dedup`):
    their indices, how many rows each stands for, and those rows (these columns) as dicts."""
    import pyarrow as pa

    from pace.tasks.dedup import distinct_rows, take_rows

    table = table.select([name for name in LOADER_COLUMNS if name in table.column_names])
    try:
        first, counts = distinct_rows(table, LOADER_COLUMNS)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):  # a type it cannot encode
        return list(range(table.num_rows)), [1] * table.num_rows, table.to_pylist()
    return first, counts, take_rows(table, first).to_pylist()


def load_math_prompts(path: str, split: str = "train", template: str = "dapo", name: str = "math",
                      dedup: bool = True) -> list[Prompt]:
    """The prompts of a math dataset, ids `{name}-{row}`, with the counts on stderr.

    `dedup` (`data.dedup`): one prompt per distinct problem (after `strip_dapo_template`), its first
    row's, in file order. A problem whose rows disagree on the answer is dropped: it has no single
    answer to reward, and the first row's is no likelier right than the others'. Repeats are dropped
    on the raw columns first (`distinct_loader_rows`), so only distinct rows are read into Prompts.
    """
    source = read_source(path, split)
    if isinstance(source, list):
        rows, indices, counts = source, range(len(source)), [1] * len(source)
    elif dedup:
        indices, counts, rows = distinct_loader_rows(source)
    else:
        rows = source.select([c for c in LOADER_COLUMNS if c in source.column_names]).to_pylist()
        indices, counts = range(len(rows)), [1] * len(rows)
    prompts: list[Prompt] = []
    first: dict[str, tuple[int, str]] = {}  # problem → its first row and answer
    rows_of: dict[str, int] = {}  # problem → rows read with it
    disagree: set[str] = set()
    skipped = 0
    for i, n, row in zip(indices, counts, rows):
        problem, answer = row_problem_answer(row)
        if problem is None:
            skipped += n
        elif not dedup:
            prompts.append(Prompt(id=f"{name}-{i:06d}", text=TEMPLATES[template](problem), answer=answer))
        else:
            if problem not in first:
                first[problem] = (i, answer)
            elif answer != first[problem][1]:
                disagree.add(problem)
            rows_of[problem] = rows_of.get(problem, 0) + n
    n_rows = sum(counts)
    if skipped:
        print(f"warning: {path}: skipped {skipped} rows without a problem or answer", file=sys.stderr)
    if dedup:
        prompts = [Prompt(id=f"{name}-{i:06d}", text=TEMPLATES[template](problem), answer=answer)
                   for problem, (i, answer) in first.items() if problem not in disagree]
        conflict_rows = sum(rows_of[problem] for problem in disagree)
        repeated = n_rows - skipped - conflict_rows - len(prompts)
        note = (f"; {len(disagree)} problems ({conflict_rows:,} rows) dropped: their rows disagree on the answer, "
                f"the first at row {min(first[problem][0] for problem in disagree)}" if disagree else "")
        print(f"{path}: {n_rows:,} rows read, {len(prompts):,} problems kept "
              f"(data.dedup: {repeated:,} repeated rows dropped{note})", file=sys.stderr)
    else:
        print(f"{path}: {n_rows:,} rows read, {len(prompts):,} prompts kept (data.dedup=false: repeats kept)",
              file=sys.stderr)
    if not prompts:
        raise DataError(f"{path}: no usable rows (need a problem and an answer field)")
    return prompts
