"""The evaluation benchmarks of the paper (Table 1), by name, from the hub or a local folder.

    load_benchmark("aime_2024")                          # datasets.load_dataset("HuggingFaceH4/aime_2024")
    load_benchmark("aime_2024", data_dir="bench/")       # bench/aime_2024.jsonl (same fields)
    expand(["math6"])                                    # the six benchmarks of Table 1, in column order

Each source keeps its own field names; the registry maps them to problem / answer explicitly
(some rows also carry a worked `solution`, which must not be taken for the answer). The prompt
template is the training one (`pace.tasks.math.TEMPLATES`), so evaluation asks the way training did.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pace.errors import DataError
from pace.tasks.base import Prompt
from pace.tasks.math import TEMPLATES, read_rows


@dataclass(frozen=True)
class Benchmark:
    name: str
    title: str  # column heading in the tables
    hub_id: str
    split: str
    problem_field: str = "problem"
    answer_field: str = "answer"
    keep: Callable[[dict], bool] | None = None  # row filter (a hub file holding several years)


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        # AI-MO's validation set holds AIME 2022–2024; the 2023 rows are the ones whose AoPS url says so
        Benchmark("aime_2023", "AIME 2023", "AI-MO/aimo-validation-aime", "train",
                  keep=lambda row: "2023_AIME" in str(row.get("url", ""))),
        Benchmark("aime_2024", "AIME 2024", "HuggingFaceH4/aime_2024", "train"),
        Benchmark("aime_2025", "AIME 2025", "MathArena/aime_2025", "train"),
        Benchmark("beyond_aime", "BeyondAIME", "ByteDance-Seed/BeyondAIME", "test"),
        Benchmark("brumo_2025", "BrUMO 2025", "MathArena/brumo_2025", "train"),
        Benchmark("hmmt_feb_2025", "HMMT Feb 2025", "MathArena/hmmt_feb_2025", "train"),
    )
}

SETS: dict[str, list[str]] = {"math6": list(BENCHMARKS)}


def expand(names: list[str]) -> list[str]:
    """Benchmark names with sets (`math6`) expanded, in order, without repeats."""
    out: list[str] = []
    for name in names:
        for n in SETS.get(name, [name]):
            if n not in BENCHMARKS:
                known = ", ".join([*SETS, *BENCHMARKS])
                raise DataError(f"unknown benchmark {n!r} (known: {known})")
            if n not in out:
                out.append(n)
    return out


def load_benchmark(name: str, data_dir: str | None = None, template: str = "dapo") -> list[Prompt]:
    """Prompts of one benchmark; ``data_dir`` holds ``<name>.jsonl`` (or .json/.parquet) copies."""
    bench = BENCHMARKS[expand([name])[0]]
    source = bench.hub_id
    if data_dir is not None:
        matches = sorted(Path(data_dir).glob(f"{name}.*"))
        if not matches:
            raise DataError(f"{name}: no {name}.jsonl / .json / .parquet in {data_dir}")
        source = str(matches[0])
    rows = read_rows(source, bench.split)
    prompts, skipped = [], 0
    for i, row in enumerate(rows):
        if bench.keep is not None and not bench.keep(row):
            continue
        problem, answer = row.get(bench.problem_field), row.get(bench.answer_field)
        if not isinstance(problem, str) or not problem.strip() or answer is None or str(answer).strip() == "":
            skipped += 1
            continue
        prompts.append(Prompt(id=f"{name}-{i:04d}", text=TEMPLATES[template](problem), answer=str(answer).strip(),
                              meta={"benchmark": name}))
    if skipped:
        print(f"warning: {source}: skipped {skipped} rows without {bench.problem_field!r} or {bench.answer_field!r}",
              file=sys.stderr)
    if not prompts:
        raise DataError(f"{source}: no usable rows for benchmark {name}")
    return prompts
