"""Math datasets (DAPO-Math-17K for training) from a hub id or a local file, with DAPO's prompt template.

Field mapping covers the layouts in circulation (see shared/benchmarks/README.md):
    problem  ← `prompt` (str, or a chat list whose first message holds the problem) | `problem`
    answer   ← `reward_model.ground_truth` | `solution` | `answer`
The official DAPO file stores the template-wrapped problem; `strip_dapo_template` recovers the bare
problem so one template is applied everywhere.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

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


class DataError(ValueError):
    """Unreadable data: the message names the file or dataset."""


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


def read_rows(path: str, split: str = "train") -> list[dict]:
    """Rows of a local .jsonl / .json / .parquet file, or of a hub dataset (datasets.load_dataset)."""
    p = Path(path)
    if p.exists():
        if p.suffix == ".parquet":
            import pandas as pd

            return pd.read_parquet(p).to_dict("records")
        with open(p) as f:
            if p.suffix == ".json":
                return json.load(f)
            return [json.loads(line) for line in f if line.strip()]
    if path.startswith((".", "/", "~")) or p.suffix in (".jsonl", ".json", ".parquet"):
        raise DataError(f"data file not found: {path}")
    try:
        import datasets

        return list(datasets.load_dataset(path, split=split))
    except Exception as exc:  # noqa: BLE001 - one line for the user, whatever the hub says
        raise DataError(f"cannot load dataset {path!r} (split {split!r}): {type(exc).__name__}: {exc}".splitlines()[0]) from exc


def load_math_prompts(path: str, split: str = "train", template: str = "dapo", name: str = "math") -> list[Prompt]:
    rows = read_rows(path, split)
    prompts, skipped = [], 0
    for i, row in enumerate(rows):
        problem, answer = row_problem_answer(row)
        if problem is None:
            skipped += 1
            continue
        prompts.append(Prompt(id=f"{name}-{i:06d}", text=TEMPLATES[template](problem), answer=answer))
    if skipped:
        print(f"warning: {path}: skipped {skipped} rows without a problem or answer", file=sys.stderr)
    if not prompts:
        raise DataError(f"{path}: no usable rows (need a problem and an answer field)")
    return prompts
