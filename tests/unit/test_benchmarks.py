"""The six evaluation benchmarks load from the real copies in ../shared/benchmarks/ and grade.

Every row of every file loads with its own field mapping; each reference answer, written the way a
model answers (DAPO's `Answer:` line), grades correct against itself; a wrong answer grades wrong.
"""
from __future__ import annotations

import json

import pytest

from pace.errors import DataError
from pace.reward import is_correct
from pace.tasks.benchmarks import BENCHMARKS, SETS, expand, load_benchmark
from pace.tasks.math import DAPO_PREFIX
from tests.helpers import BENCH, needs_shared

pytestmark = pytest.mark.unit

needs_bench = needs_shared(*(BENCH / f"{name}.jsonl" for name in BENCHMARKS))  # in CI: fails, never skips
ROWS = {"aime_2023": 30, "aime_2024": 30, "aime_2025": 30, "beyond_aime": 100, "brumo_2025": 30, "hmmt_feb_2025": 30}


def test_math6_is_the_six_benchmarks_of_table_1_in_order():
    assert expand(["math6"]) == list(ROWS)
    assert expand(["aime_2024", "math6"])[:2] == ["aime_2024", "aime_2023"]  # no repeats
    assert set(SETS) == {"math6"} and set(BENCHMARKS) == set(ROWS)
    with pytest.raises(DataError, match="unknown benchmark 'aime_1999'"):
        expand(["aime_1999"])


@needs_bench
@pytest.mark.parametrize("name", list(ROWS))
def test_every_row_loads_with_its_answer_field(name):
    prompts = load_benchmark(name, data_dir=str(BENCH))
    rows = [json.loads(line) for line in (BENCH / f"{name}.jsonl").read_text().splitlines() if line.strip()]
    assert len(prompts) == ROWS[name] == len(rows)
    assert [p.answer for p in prompts] == [str(r["answer"]).strip() for r in rows]  # never the worked solution
    assert all(p.text.startswith(DAPO_PREFIX) and r["problem"] in p.text for p, r in zip(prompts, rows))
    assert len({p.id for p in prompts}) == len(prompts) and all(p.meta["benchmark"] == name for p in prompts)


@needs_bench
@pytest.mark.parametrize("name", list(ROWS))
def test_reference_answers_grade_correct_against_themselves_and_wrong_ones_do_not(name):
    prompts = load_benchmark(name, data_dir=str(BENCH))
    right = [p.id for p in prompts if is_correct(f"Some reasoning.\nAnswer: {p.answer}", p.answer)]
    assert right == [p.id for p in prompts]
    wrong = [p.id for p in prompts if is_correct("Some reasoning.\nAnswer: 123456789", p.answer)]
    assert wrong == []


def test_aime_2023_keeps_only_the_2023_rows_of_the_hub_file(tmp_path):
    # the hub id holds AIME 2022–2024: a local file in the hub layout is filtered the same way
    rows = [{"id": i, "problem": f"p{i}", "answer": str(i), "url": f"https://x/{y}_AIME_I_Problems/Problem_{i}"}
            for i, y in enumerate([2022, 2023, 2024, 2023])]
    (tmp_path / "aime_2023.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert [p.answer for p in load_benchmark("aime_2023", data_dir=str(tmp_path))] == ["1", "3"]


def test_missing_file_and_bad_rows_fail_or_warn_naming_the_file(tmp_path, capsys):
    with pytest.raises(DataError, match="no aime_2025.jsonl"):
        load_benchmark("aime_2025", data_dir=str(tmp_path))
    (tmp_path / "aime_2025.jsonl").write_text('{"problem": "1+1?", "answer": 2}\n{"problem": "", "answer": 3}\n{"problem": "x"}\n')
    assert [p.answer for p in load_benchmark("aime_2025", data_dir=str(tmp_path))] == ["2"]
    err = capsys.readouterr().err
    assert "aime_2025.jsonl: skipped 2 rows" in err
