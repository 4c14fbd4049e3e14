"""Per-group Parquet parts share one schema, so a run's parts read back together."""
from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pace.logger import group_row, group_schema
from pace.records import Fate, Group, Trajectory

pytestmark = pytest.mark.unit


def group(gid: int, pfs: float | None) -> Group:
    t = Trajectory([1, 2], [-0.1, -0.2], [0, 1], 1, "stop", correct=True, reward=1.0)
    g = Group(gid, f"p{gid}", [1], "3", 0, [t], pfs=pfs, pfs_version=None if pfs is None else 1)
    g.fate, g.step = Fate.CONSUMED, 2
    return g


def test_parts_with_all_null_columns_read_back_with_the_others(tmp_path):
    # part 0: no group has a PFS (e.g. an async run's first steps); part 1: one has
    for part, rows in enumerate([[group_row(group(0, None))], [group_row(group(1, 0.25))]]):
        pq.write_table(pa.Table.from_pylist(rows, schema=group_schema()), tmp_path / f"part-{part:05d}.parquet")
    df = pd.read_parquet(tmp_path).sort_values("id")
    assert df.pfs.isna().tolist() == [True, False] and df.pfs.iloc[1] == 0.25
    assert df.k.tolist() == [1.5, 1.5]  # K = 2 − mean version 0.5, at step 2
    assert list(df.lengths.iloc[0]) == [2]


def test_schema_names_every_field_of_a_row():
    assert set(group_row(group(0, None))) == set(group_schema().names)
