"""A simulated run's directory, as train.py writes it (pace/logger.py, docs/design.md §6): metrics.jsonl, the
per-group Parquet parts (same schema, built from version spans) and summary.json, plus wandb when
`logger.mode` asks for it. `analysis.build` and `analysis/summarize_run.py` read it unchanged."""
from __future__ import annotations

from pace.logger import RunLogger, group_schema
from pace.sim.records import group_columns


class SimLogger(RunLogger):
    """`RunLogger` whose per-group rows are built column-wise from `SimGroup`s at each flush (a
    cluster-scale run decides hundreds of thousands of groups)."""

    def __init__(self, *args, groups: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.groups = groups

    def log_groups(self, groups, step: int) -> None:
        if self.groups:
            self._rows.extend(groups)
        if (step + 1) % self.flush_every == 0:
            self.flush()

    def _table(self):
        import pyarrow as pa

        return pa.Table.from_pydict(group_columns(self._rows), schema=group_schema())
