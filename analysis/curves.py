"""How the figures draw methods (analysis/figures.py, analysis/trajectories.py): their order and
colours, the seeds of one method pooled into a band, smoothing, and the k of the logged mean@k.

Seeds of one method are pooled: a curve is the mean over seeds, on the x values all seeds share,
with the min–max range shaded.
"""
from __future__ import annotations

import re
from collections import defaultdict

import matplotlib
import pandas as pd

from analysis.runs import Run

ORDER = ["Sync", "Async", "PACE", "PACE (raw)", "PACE (gen)", "M2PO"]  # then the rest, sorted
COLORS = {"Sync": "#4c72b0", "Async": "#dd8452", "PACE": "#55a868", "PACE (raw)": "#8172b3",
          "PACE (gen)": "#937860", "M2PO": "#c44e52"}


def by_label(runs: list[Run]) -> dict[str, list[Run]]:
    out: dict[str, list[Run]] = defaultdict(list)
    for r in runs:
        out[r.label].append(r)
    known = [k for k in ORDER if k in out]
    return {k: out[k] for k in known + sorted(set(out) - set(known), key=_natural)}


def _natural(label: str):
    return [float(t) if t.replace(".", "", 1).isdigit() else t for t in re.split(r"([0-9.]+)", label)]


def color(label: str, i: int = 0):
    return COLORS.get(label, matplotlib.colormaps["tab10"](i % 10))


def band(ax, curves: list[pd.Series], label: str, c, x_scale: float = 1.0) -> None:
    """Mean over seeds (on the x values all seeds share) with the min–max range."""
    table = pd.concat(curves, axis=1).dropna()
    if table.empty:
        return
    x = table.index.to_numpy(dtype=float) * x_scale
    ax.plot(x, table.mean(axis=1), color=c, label=f"{label} (n={len(curves)})" if len(curves) > 1 else label)
    if len(curves) > 1:
        ax.fill_between(x, table.min(axis=1), table.max(axis=1), color=c, alpha=0.2, linewidth=0)


def smooth(s: pd.Series, window: int) -> pd.Series:
    return s.rolling(window, min_periods=1).mean()


def logged_k(runs: list[Run]) -> str:
    """The k of the runs' logged `val/<set>/mean@k` (for axis labels), "k" when none is logged."""
    for r in runs:
        for col in r.val.columns:
            if col.startswith("val/") and "/mean@" in col:
                return col.rsplit("@", 1)[1]
    return "k"
