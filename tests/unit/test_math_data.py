"""Tests for pace.tasks.math on the real DAPO-Math-17K copies in ../shared/benchmarks/ and on tmp files:
field mapping, templates, errors, and the deduplication by problem (`data.dedup`).

The shared benchmarks directory sits beside the clone (CI has it there too); tests that read it are
skipped with a reason when it is absent on a developer's machine, and fail when it is absent in CI.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pace.config import Config
from pace.tasks.loading import train_prompts
from pace.tasks.math import (
    DAPO_PREFIX,
    DAPO_SUFFIX,
    DataError,
    distinct_loader_rows,
    load_math_prompts,
    row_problem_answer,
    strip_dapo_template,
)
from pace.tiny import build_tokenizer
from tests.helpers import BENCH, needs_shared

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
    return load_math_prompts(str(FULL), dedup=False)


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
    path = write_jsonl(tmp_path / "ok.jsonl", [{"problem": "a", "answer": "1"}])
    load_math_prompts(str(path))
    assert capsys.readouterr().err == f"{path}: 1 rows read, 1 problems kept (data.dedup: 0 repeated rows dropped)\n"


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


# ---------------------------------------------------------------- deduplication by problem (data.dedup)


def official_rows(problems: list[tuple[str, str]]) -> list[dict]:
    """Rows in the layout of BytedTsinghua-SIA/DAPO-Math-17k: a template-wrapped chat list, the answer
    in reward_model, a per-row UUID-like index (so whole rows are never equal)."""
    return [{"data_source": "math_dapo", "prompt": [{"content": wrap(q), "role": "user"}], "ability": "MATH",
             "reward_model": {"ground_truth": a, "style": "rule-lighteval/MATH_v2"},
             "extra_info": {"index": f"uuid-{i}"}} for i, (q, a) in enumerate(problems)]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def count_line(err: str, path: Path) -> str:
    [line] = [line for line in err.splitlines() if line.startswith(f"{path}: ")]
    return line


THREE = [("What is 1+1?", "2"), ("What is 2+3?", "5"), ("What is 7-4?", "3")]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_three_problems_repeated_100_times_give_three_prompts(tmp_path: Path, capsys, fmt: str) -> None:
    rows = official_rows(THREE * 100)  # the block repeated, as the hub file repeats its 17,917 rows
    path = (write_parquet if fmt == "parquet" else write_jsonl)(tmp_path / f"d.{fmt}", rows)
    prompts = load_math_prompts(str(path))
    assert [(p.id, p.text, p.answer) for p in prompts] == [
        ("math-000000", wrap("What is 1+1?"), "2"), ("math-000001", wrap("What is 2+3?"), "5"),
        ("math-000002", wrap("What is 7-4?"), "3")]
    assert count_line(capsys.readouterr().err, path) == (
        f"{path}: 300 rows read, 3 problems kept (data.dedup: 297 repeated rows dropped)")

    every = load_math_prompts(str(path), dedup=False)  # the recipe's file, as it is
    assert len(every) == 300 and [p.id for p in every[:4]] == ["math-000000", "math-000001", "math-000002",
                                                                "math-000003"]
    assert [p.answer for p in every] == ["2", "5", "3"] * 100
    assert count_line(capsys.readouterr().err, path) == (
        f"{path}: 300 rows read, 300 prompts kept (data.dedup=false: repeats kept)")


def test_the_repeats_are_dropped_on_the_columns_before_rows_become_dicts() -> None:
    pa = pytest.importorskip("pyarrow")
    block = pa.Table.from_pylist(official_rows(THREE))
    table = pa.concat_tables([block] * 100)  # 100 chunks: codes must agree across them
    assert table.column("prompt").num_chunks == 100
    indices, counts, rows = distinct_loader_rows(table)
    assert (indices, counts) == ([0, 1, 2], [100, 100, 100])
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["2", "5", "3"]
    assert set(rows[0]) == {"prompt", "reward_model"}  # only the columns the loader reads become dicts


def test_the_first_element_of_a_chat_list_decides_and_null_and_empty_lists_are_values_of_their_own() -> None:
    from pace.tasks.dedup import distinct_rows

    pa = pytest.importorskip("pyarrow")
    msg = lambda content, role="user": {"content": content, "role": role}  # noqa: E731
    prompts = [[msg("q")], [], None, [msg("q"), msg("later turn")], [msg("q", "system")], [], None, [msg(None)],
               [msg("r")], [msg("q")]]
    table = pa.concat_tables([pa.table({"prompt": pa.array(prompts[:5])}), pa.table({"prompt": pa.array(prompts[5:])})])
    assert distinct_rows(table, ("prompt",)) == ([0, 1, 2, 4, 7, 8], [3, 2, 2, 1, 1, 1])


def test_dictionary_columns_with_a_dictionary_per_chunk_are_unified() -> None:
    # a categorical column written by pandas: each chunk has its own dictionary, index 0 means "1" in
    # the first and "2" in the second
    from pace.tasks.dedup import distinct_rows

    pa = pytest.importorskip("pyarrow")
    answer = pa.chunked_array([pa.DictionaryArray.from_arrays(pa.array([0, 0]), pa.array(["1"])),
                               pa.DictionaryArray.from_arrays(pa.array([0, 1]), pa.array(["2", "1"]))])
    table = pa.table({"problem": pa.chunked_array([["a", "a"], ["a", "a"]]), "answer": answer})
    assert distinct_rows(table, ("problem", "answer")) == ([0, 2], [3, 1])


def test_rows_are_taken_from_the_right_chunks() -> None:
    from pace.tasks.dedup import take_rows

    pa = pytest.importorskip("pyarrow")
    table = pa.concat_tables([pa.table({"x": list(range(k, k + 4))}) for k in range(0, 40, 4)])  # 10 chunks of 4
    for indices in ([0, 5, 6, 17, 39], [3, 4], [38], []):
        assert take_rows(table, indices).column("x").to_pylist() == indices


def test_a_column_arrow_cannot_encode_is_read_row_by_row(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    answer = pa.array([[("x", 1)]] * 3, type=pa.map_(pa.string(), pa.int64()))  # a map: not dictionary-encodable
    table = pa.table({"problem": ["a", "a", "b"], "answer": answer})
    indices, counts, _ = distinct_loader_rows(table)
    assert (indices, counts) == ([0, 1, 2], [1, 1, 1])  # every row, each once: stage 2 still dedups them


def test_first_occurrence_order_and_ids(tmp_path: Path) -> None:
    rows = [{"problem": q, "answer": a} for q, a in
            [("b", "1"), ("a", "2"), ("b", "1"), ("c", "3"), ("a", "2"), ("c", "3"), ("d", "4")]]
    for path in (write_jsonl(tmp_path / "d.jsonl", rows), write_parquet(tmp_path / "d.parquet", rows)):
        prompts = load_math_prompts(str(path), template="plain")
        assert [(p.id, p.text) for p in prompts] == [("math-000000", "b"), ("math-000001", "a"),
                                                     ("math-000003", "c"), ("math-000006", "d")]


def test_a_problem_whose_rows_disagree_on_the_answer_is_dropped_and_counted(tmp_path: Path, capsys) -> None:
    # "a" has answer 1 in 3 rows and 2 in one: no single answer to reward, whichever row comes first
    rows = [("b", "7"), ("a", "1"), ("a", "1"), ("b", "7"), ("a", "2"), ("c", "5"), ("a", "1")]
    for fmt in ("jsonl", "parquet"):
        path = (write_parquet if fmt == "parquet" else write_jsonl)(tmp_path / f"d.{fmt}", official_rows(rows))
        prompts = load_math_prompts(str(path), template="plain")
        assert [(p.id, p.text, p.answer) for p in prompts] == [("math-000000", "b", "7"), ("math-000005", "c", "5")]
        assert count_line(capsys.readouterr().err, path) == (
            f"{path}: 7 rows read, 2 problems kept (data.dedup: 1 repeated rows dropped; 1 problems (4 rows) "
            "dropped: their rows disagree on the answer, the first at row 1)")
        assert len(load_math_prompts(str(path), dedup=False)) == 7  # the recipe's file keeps both answers


def test_wrapped_and_bare_copies_of_a_problem_are_one_problem(tmp_path: Path) -> None:
    rows = [{"prompt": wrap("q?"), "solution": "3"}, {"prompt": "q?", "solution": "3"},
            {"prompt": [{"content": wrap("q?"), "role": "user"}], "solution": " 3 "}]
    [p] = load_math_prompts(str(write_jsonl(tmp_path / "d.jsonl", rows)))
    assert (p.id, p.text, p.answer) == ("math-000000", wrap("q?"), "3")


def test_unusable_rows_are_counted_with_their_repeats(tmp_path: Path, capsys) -> None:
    rows = [{"problem": "a", "answer": "1"}, {"problem": "b", "answer": None}] * 50
    path = write_parquet(tmp_path / "d.parquet", rows)
    assert [p.id for p in load_math_prompts(str(path))] == ["math-000000"]
    err = capsys.readouterr().err
    assert f"warning: {path}: skipped 50 rows without a problem or answer" in err
    assert count_line(err, path) == f"{path}: 100 rows read, 1 problems kept (data.dedup: 49 repeated rows dropped)"


def test_official_layout_parquet_loads(tmp_path: Path) -> None:
    # the hub's own file (data/dapo-math-17k.parquet) read locally: pandas' to_dict handed the chat list
    # back as a numpy array, and every row was skipped
    rows = official_rows(THREE)
    for dedup in (True, False):
        got = load_math_prompts(str(write_parquet(tmp_path / "o.parquet", rows)), dedup=dedup)
        assert [(p.text, p.answer) for p in got] == [(wrap(q), a) for q, a in THREE]


def test_data_dedup_key_reaches_the_loader_and_only_kept_problems_are_rendered(tmp_path: Path, monkeypatch) -> None:
    tok = build_tokenizer()
    tok.chat_template = "{% for m in messages %}<|user|>{{ m.content }}{% endfor %}<|assistant|>"
    rendered = []
    render = tok.apply_chat_template
    monkeypatch.setattr(tok, "apply_chat_template", lambda *a, **k: rendered.append(1) or render(*a, **k))
    path = write_parquet(tmp_path / "d.parquet", official_rows(THREE * 100))
    cfg = OmegaConf.structured(Config)
    for key, value in {"data.source": "math", "data.path": str(path), "data.template": "plain",
                       "data.chat_template": True, "rollout.max_model_len": 4096}.items():
        OmegaConf.update(cfg, key, value)
    assert cfg.data.dedup is True  # the default
    assert [p.text for p in train_prompts(cfg, tok)] == [f"<|user|>{q}<|assistant|>" for q, _ in THREE]
    assert len(rendered) == 3
    cfg.data.dedup = False
    assert len(train_prompts(cfg, tok)) == 300 and len(rendered) == 303


@needs_bench
def test_the_real_block_deduplicated(capsys) -> None:
    rows = read_jsonl(FULL)
    answers: dict[str, set[str]] = {}
    for row in rows:
        answers.setdefault(row["prompt"][0]["content"], set()).add(row["reward_model"]["ground_truth"])
    assert len(answers) == 17_290  # shared/benchmarks/README.md: 17,290 distinct problem strings
    conflicting = {q for q, a in answers.items() if len(a) > 1}
    prompts = load_math_prompts(str(FULL))
    assert len(prompts) == len(answers) - len(conflicting) == 17_279
    assert {strip_dapo_template(p.text) for p in prompts} == set(answers) - conflicting
    ids = [int(p.id.split("-")[1]) for p in prompts]
    assert ids == sorted(ids) and ids[:3] == [0, 1, 2]
    for i in ids[::500]:  # each prompt is its problem's first row
        row = rows[i]
        assert next(j for j, r in enumerate(rows) if r["prompt"][0]["content"] == row["prompt"][0]["content"]) == i
    assert count_line(capsys.readouterr().err, FULL) == (
        f"{FULL}: 17,917 rows read, 17,279 problems kept (data.dedup: 616 repeated rows dropped; 11 problems "
        "(22 rows) dropped: their rows disagree on the answer, the first at row 35)")
