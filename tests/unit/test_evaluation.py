"""mean@k and the Table 1 writers (pure)."""
from __future__ import annotations

import pytest

from pace.evaluation import csv_table, latex_table, markdown_table, mean_at_k, summarize

pytestmark = pytest.mark.unit


def test_mean_at_k_by_hand():
    # problem 1: 2 of 4 right, problem 2: 4 of 4, problem 3: 0 of 4 → (0.5 + 1 + 0) / 3
    assert mean_at_k([[1, 0, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]]) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        mean_at_k([])


def test_summary_average_is_unweighted_over_benchmarks():
    s = summarize({"aime_2024": [[True, False]] * 30, "beyond_aime": [[True, True]] * 100})
    assert s == {"aime_2024": 0.5, "beyond_aime": 1.0, "avg": 0.75}


def test_tables_have_one_row_per_method_and_the_table_1_columns():
    table = {"PACE": {"aime_2024": 0.5, "hmmt_feb_2025": 0.25, "avg": 0.375},
             "Async_x": {"aime_2024": 0.25, "hmmt_feb_2025": 0.0, "avg": 0.125}}
    md = markdown_table(table, 32).splitlines()
    assert md[0] == "mean@32 (%)" and md[2] == "| method | AIME 2024 | HMMT Feb 2025 | Avg. |"
    assert md[4] == "| PACE | 50.00 | 25.00 | 37.50 |"
    assert csv_table(table).splitlines()[2] == "Async_x,25.00,0.00,12.50"
    tex = latex_table(table, 32)
    assert r"Async\_x & 25.00 & 0.00 & 12.50 \\" in tex and r"\begin{tabular}{lccc}" in tex
