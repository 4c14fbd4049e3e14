"""Read one run's local logs: step metrics (metrics.jsonl), per-group records (groups/*.parquet), summary."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd


@dataclass
class Run:
    dir: Path
    steps: pd.DataFrame  # one row per training step
    groups: pd.DataFrame  # one row per group (DESIGN §6)
    summary: dict


def load_run(run_dir: str | Path) -> Run:
    d = Path(run_dir)
    if not (d / "metrics.jsonl").exists():
        raise FileNotFoundError(f"{d}: not a run directory (no metrics.jsonl)")
    steps = pd.read_json(d / "metrics.jsonl", lines=True)
    parts = sorted((d / "groups").glob("part-*.parquet"))
    groups = pd.concat([pd.read_parquet(p) for p in parts], ignore_index=True) if parts else pd.DataFrame()
    summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else {}
    return Run(d, steps, groups, summary)
