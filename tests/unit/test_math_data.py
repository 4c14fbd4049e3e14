"""Tests for pace.tasks.math on the real DAPO-Math-17K copies in ../shared/benchmarks/ and on tmp files.

The shared benchmarks directory sits beside the clone (CI has it there too); tests that read it are
skipped with a reason when it is absent on a developer's machine, and fail when it is absent in CI.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pace.tasks.math import (
    DAPO_PREFIX,
    DAPO_SUFFIX,
    DataError,
    load_math_prompts,
    row_problem_answer,
    strip_dapo_template,
)
from tests.conftest import BENCH, needs_shared

pytestmark = pytest.mark.unit

FULL = BENCH / "dapo_math_17k.jsonl"
HEAD = BENCH / "dapo_math_17k_processed_head.jsonl"
needs_bench = needs_shared(FULL, HEAD)  # in CI (CI set) a missing copy fails the tests instead of skipping them


def wrap(problem: str) -> str:
    return DAPO_PREFIX + problem + DAPO_SUFFIX


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def full_prompts():
    return load_math_prompts(str(FULL))


# ---------------------------------------------------------------- the shared copies


@needs_bench
def test_full_file_loads_every_row(full_prompts) -> None:
    rows = read_jsonl(FULL)
    assert len(rows) == len(full_prompts) == 17_917
    for i in (0, 1, 2, 9_000, 17_916):
        p, row = full_prompts[i], rows[i]
        assert p.text == wrap(row["prompt"][0]["content"])
        assert p.answer == row["reward_model"]["ground_truth"]
        assert p.id == f"math-{i:06d}"
    assert full_prompts[0].answer == "34" and full_prompts[2].answer == "-3"
    assert len({p.id for p in full_prompts}) == 17_917


@needs_bench
def test_template_applied_exactly_once(full_prompts) -> None:
    for p in full_prompts[:200]:
        assert p.text.startswith(DAPO_PREFIX) and p.text.endswith(DAPO_SUFFIX)
        assert p.text.count(DAPO_PREFIX) == 1 and p.text.count(DAPO_SUFFIX) == 1


@needs_bench
def test_processed_head_matches_the_first_rows(full_prompts) -> None:
    head = load_math_prompts(str(HEAD))
    rows = read_jsonl(HEAD)
    assert len(head) == len(rows) == 14
    for h, f, row in zip(head, full_prompts[:14], rows):
        assert h.text == f.text == wrap(row["prompt"])
        assert h.answer == f.answer == row["solution"]
        assert h.id == f.id


@needs_bench
def test_strip_recovers_the_bare_problem_from_the_official_prompt() -> None:
    for row in read_jsonl(HEAD):
        official = row["source_prompt"][0]["content"]
        assert official == wrap(row["prompt"])
        assert strip_dapo_template(official) == row["prompt"]


@needs_bench
def test_official_layout_is_not_wrapped_twice(tmp_path: Path) -> None:
    # The official BytedTsinghua-SIA row is {prompt=source_prompt (template-wrapped chat list), reward_model, ...}.
    rows = read_jsonl(HEAD)
    official = [
        {"data_source": r["data_source"], "prompt": r["source_prompt"], "ability": r["ability"],
         "reward_model": r["reward_model"], "extra_info": r["extra_info"]}
        for r in rows
    ]
    got = load_math_prompts(str(write_jsonl(tmp_path / "official.jsonl", official)))
    assert [p.text for p in got] == [wrap(r["prompt"]) for r in rows]
    assert [p.answer for p in got] == [r["solution"] for r in rows]


# ---------------------------------------------------------------- field mapping, templates, errors


def test_row_layouts() -> None:
    assert row_problem_answer({"problem": "1+1?", "answer": 2}) == ("1+1?", "2")
    assert row_problem_answer({"prompt": "1+1?", "solution": " 2 "}) == ("1+1?", "2")
    assert row_problem_answer({"prompt": [{"role": "user", "content": wrap("1+1?")}],
                               "reward_model": {"ground_truth": "2"}}) == ("1+1?", "2")
    # reward_model.ground_truth wins over solution when both exist
    assert row_problem_answer({"prompt": "q", "solution": "1", "reward_model": {"ground_truth": "7"}}) == ("q", "7")
    assert row_problem_answer({"prompt": "q", "answer": 0}) == ("q", "0")  # a falsy answer is still an answer


@pytest.mark.parametrize(
    "row",
    [
        {"answer": "3"},  # no problem
        {"problem": "   ", "answer": "3"},  # blank problem
        {"problem": "q"},  # no answer
        {"problem": "q", "answer": "  "},  # blank answer
        {"prompt": [], "answer": "3"},  # empty chat list
        {"prompt": ["not a message"], "answer": "3"},
    ],
)
def test_unusable_rows(row: dict) -> None:
    assert row_problem_answer(row) == (None, None)


def test_plain_template_leaves_the_problem_bare(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"problem": "2+2?", "answer": "4"}])
    [p] = load_math_prompts(str(path), template="plain", name="toy")
    assert (p.id, p.text, p.answer) == ("toy-000000", "2+2?", "4")


def test_bad_rows_are_skipped_with_a_warning_naming_the_file(tmp_path: Path, capsys) -> None:
    path = write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            {"problem": "a?", "answer": "1"},
            {"problem": "b?"},  # no answer
            {"answer": "3"},  # no problem
            {"problem": "d?", "answer": "4"},
        ],
    )
    prompts = load_math_prompts(str(path))
    assert [p.answer for p in prompts] == ["1", "4"]
    assert [p.text for p in prompts] == [wrap("a?"), wrap("d?")]
    assert [p.id for p in prompts] == ["math-000000", "math-000003"]  # ids keep the row index
    err = capsys.readouterr().err
    assert str(path) in err and "skipped 2" in err


def test_no_warning_when_every_row_is_usable(tmp_path: Path, capsys) -> None:
    load_math_prompts(str(write_jsonl(tmp_path / "ok.jsonl", [{"problem": "a", "answer": "1"}])))
    assert capsys.readouterr().err == ""


def test_file_without_usable_rows_raises(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "empty.jsonl", [{"problem": "q"}])
    with pytest.raises(DataError, match="empty.jsonl"):
        load_math_prompts(str(path))


@pytest.mark.parametrize("name", ["missing.jsonl", "missing.parquet", "sub/missing.json"])
def test_missing_local_file_raises_naming_the_path(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    with pytest.raises(DataError) as info:
        load_math_prompts(str(path))
    assert str(path) in str(info.value)


def test_missing_relative_path_is_not_sent_to_the_hub() -> None:
    with pytest.raises(DataError, match=r"data/nope\.jsonl"):
        load_math_prompts("./data/nope.jsonl")


def test_json_and_parquet_files(tmp_path: Path) -> None:
    rows = [{"problem": "a", "answer": "1"}, {"problem": "b", "answer": "2"}]
    js = tmp_path / "d.json"
    js.write_text(json.dumps(rows))
    assert [p.answer for p in load_math_prompts(str(js))] == ["1", "2"]
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    pq = tmp_path / "d.parquet"
    pd.DataFrame(rows).to_parquet(pq)
    assert [p.text for p in load_math_prompts(str(pq))] == [wrap("a"), wrap("b")]
