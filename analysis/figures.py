"""The paper's figures and Table 1 from `Run`s (analysis.runs), one function each.

Every figure function takes the runs and returns a matplotlib Figure, or None when the runs hold
nothing it can draw (e.g. no Stale-k run); `save` writes PNG and PDF. Seeds of one method are
pooled: curves show the mean over seeds with the min–max range shaded.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from analysis.curves import COLORS, band, by_label, color, logged_k, smooth  # noqa: E402
from analysis.runs import Run  # noqa: E402
from analysis.trajectories import display, figure_sets, val_curve  # noqa: E402
from pace.config import target_pool  # noqa: E402

MAIN = ("Sync", "Async", "PACE")


def save(fig, out_dir: Path, name: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.png", out_dir / f"{name}.pdf"]
    fig.savefig(paths[0], dpi=150, bbox_inches="tight")
    fig.savefig(paths[1], bbox_inches="tight")
    plt.close(fig)
    return paths


# ---------------------------------------------------------------- Figure 1


def validation_curves(runs: list[Run], labels=MAIN):
    """Validation average (mean@k over the validation sets) against training steps and wall time,
    Sync / Async / PACE (Figure 1; Figure 5 and Appendix B are in analysis/trajectories.py)."""
    groups = {k: v for k, v in by_label(runs).items() if k in labels and any(not r.val.empty for r in v)}
    if not groups:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for i, (label, rs) in enumerate(groups.items()):
        rs = [r for r in rs if not r.val.empty]
        band(a, [r.val.set_index("version")["val/avg"] for r in rs], label, color(label, i))
        # wall time differs per seed: mean wall of each version over seeds
        walls = pd.concat([r.val.set_index("version")["wall"] for r in rs], axis=1).mean(axis=1)
        accs = pd.concat([r.val.set_index("version")["val/avg"] for r in rs], axis=1)
        b.plot(walls / 60, accs.mean(axis=1), color=color(label, i), label=label, marker=".")
    a.set(xlabel="training step (weights validated)", ylabel=f"validation mean@{logged_k(runs)} (avg)",
          title="Against training steps")
    b.set(xlabel="wall time (min)", title="Against wall time")
    a.legend(fontsize=8)
    fig.suptitle("Validation accuracy against steps and wall time", y=1.02)
    return fig


# ---------------------------------------------------------------- Figure 3


def stalek_curves(runs: list[Run], early: float = 0.5, window: int = 10):
    """Early training of the Stale-k sweep with Sync as the on-policy reference (Figure 3): accuracy
    of every completed group (filtered or not) against steps, and validation on the first named
    benchmark (`eval.figure_sets`: AIME 2024), over the first ``early`` fraction of the run."""
    groups = {k: v for k, v in by_label(runs).items() if k.startswith("Stale-") or k == "Sync"}
    if not any(k.startswith("Stale-") for k in groups):
        return None
    name = next(iter(figure_sets(runs)), None)  # None: no validation set logged
    fig, (ax, val) = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, (label, rs) in enumerate(groups.items()):
        c = "black" if label == "Sync" else plt.get_cmap("viridis")(i / max(len(groups), 2))  # the reference in black
        curves, vals = [], []
        for r in rs:
            n = max(1, int(len(r.steps) * early))
            curves.append(smooth(r.steps["rollout/acc_mean"], window).iloc[:n])
            v = val_curve(r, name, first=n) if name else None
            if v is not None and not v.empty:
                vals.append(v)
        band(ax, curves, label, c)
        if vals:
            band(val, vals, label, c)
    ax.set(xlabel="training step", ylabel=f"rollout accuracy ({window}-step mean)", title="Rollout accuracy")
    ax.legend(fontsize=8)
    val.set(xlabel="training step", ylabel=f"validation mean@{logged_k(runs)}",
            title=f"{display(name)} validation" if name else "validation")
    if val.lines:
        val.legend(fontsize=8)
    else:
        val.text(0.5, 0.5, "no validations logged", ha="center", va="center", transform=val.transAxes)
    fig.suptitle(f"Stale-k: early training (first {early:.0%} of steps), Sync as the on-policy reference", y=1.03)
    return fig


# ---------------------------------------------------------------- Figures 6 and 7


STALENESS = [("k_wait", "Waiting Staleness $K_{wait}$"), ("k_gen", "Generation Staleness $K_{gen}$")]


def _hist(ax, series: dict[str, np.ndarray], colors: dict[str, str]) -> None:
    values = np.concatenate([v for v in series.values() if len(v)]) if any(len(v) for v in series.values()) else np.array([0.0])
    bins = np.linspace(values.min(), max(values.max(), values.min() + 1e-6), 30)
    for name, v in series.items():
        if len(v):
            ax.hist(v, bins=bins, density=True, alpha=0.55, color=colors[name], label=f"{name} (n={len(v)})")


EFFECTIVE = ("s_eff", "Effective Staleness $S_{eff}$")
KV = ("k_kv", "KV Staleness $K_{kv}$")  # docs/pool-policies.md#kv-staleness


def decision_window(g: pd.DataFrame, window: int | None, start: int | None) -> tuple[pd.DataFrame, str]:
    """Groups decided at steps [start, start + window) (``start`` None: the last ``window`` steps
    with a decision; ``window`` None: every step), and the range in words."""
    if window is None or g.empty:
        return g, "all steps"
    first = int(g.step.max()) - window + 1 if start is None else start
    first = max(first, int(g.step.min()))
    return g[(g.step >= first) & (g.step < first + window)], f"steps {first}–{first + window - 1}"


def pace_retained_vs_rejected(runs: list[Run], label: str = "PACE", window: int | None = 50, start: int | None = None):
    """Waiting, Generation and Effective Staleness of the groups PACE kept vs rejected over a window
    of ``window`` training updates (Figure 6; `decision_window`)."""
    # the steps of PACE's decisions (a group still pooled at the end is logged at the final step)
    decided = [r.groups[r.groups.fate.isin(["consumed", "rejected"])] for r in runs if r.label == label and not r.groups.empty]
    if not decided:
        return None
    g = pd.concat([decision_window(d, window, start)[0] for d in decided], ignore_index=True)
    kept, rejected = g[g.fate == "consumed"], g[g.fate == "rejected"]
    if rejected.empty:
        return None
    span = decision_window(decided[0], window, start)[1]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for ax, (col, title) in zip(axes, [*STALENESS, EFFECTIVE]):
        _hist(ax, {"retained": kept[col].dropna().to_numpy(), "rejected": rejected[col].dropna().to_numpy()},
              {"retained": COLORS["PACE"], "rejected": "#c44e52"})
        ax.set(title=title, xlabel="steps")
    axes[0].set_ylabel("density")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{label}: retained (consumed) vs rejected groups, {span}", y=1.03)
    return fig


def consumed_staleness(runs: list[Run], labels=("Async", "PACE")):
    """Waiting, Generation and Effective Staleness of the groups each method trained on (Figure 7),
    PACE and Async side by side, or the one present. Async's groups have an Effective Staleness
    only when its run recorded one (`pool.record_effective`); the panel says which method lacks it.
    A fourth panel, the KV Staleness K_kv, when the runs logged it (runs before it have no `k_kv`)."""
    data = {}
    for label, rs in by_label(runs).items():
        frames = [r.groups for r in rs if not r.groups.empty]
        if label in labels and frames:
            g = pd.concat(frames, ignore_index=True)
            data[label] = g[g.fate == "consumed"]
    if not data:
        return None
    panels = [*STALENESS, EFFECTIVE]
    if any("k_kv" in v and v.k_kv.notna().any() for v in data.values()):
        panels.append(KV)
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4))
    for ax, (col, title) in zip(axes, panels):
        present = {k: v[col].dropna().to_numpy() if col in v else np.array([]) for k, v in data.items()}
        _hist(ax, {k: v for k, v in present.items() if len(v)}, {k: color(k) for k in data})
        ax.set(title=title, xlabel="steps")
        missing = [k for k, v in present.items() if not len(v)]
        if missing:
            ax.text(0.5, -0.22, "\n".join(f"{k}: not recorded" + (" (pool.record_effective)" if col == "s_eff" else "")
                                            for k in missing), ha="center", va="top", color="#c44e52",
                    fontsize=8, transform=ax.transAxes)
        if ax.patches:
            ax.legend(fontsize=8)
    axes[0].set_ylabel("density")
    fig.suptitle("Staleness of consumed groups", y=1.03)
    return fig


# ---------------------------------------------------------------- the pool over time


def pool_over_time(runs: list[Run], labels=("Async", "PACE"), window: int = 5):
    """The pool each step draws from: occupancy (groups waiting) of Async and PACE against training
    steps, with PACE's target n* (`pace.target_pool`, default B); and what PACE rejects to hold it
    there, groups per step (``window``-step mean). Where Waiting Staleness comes from, in one picture."""
    groups = {k: [r for r in v if "pool/occupancy" in r.steps] for k, v in by_label(runs).items() if k in labels}
    groups = {k: v for k, v in groups.items() if v}
    if not groups:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    for i, (label, rs) in enumerate(groups.items()):
        c = color(label, i)
        band(a, [r.steps["pool/occupancy"] for r in rs], label, c)
        if label.startswith("PACE"):
            target = target_pool(rs[0].config)
            if target:
                a.axhline(target, color=c, linestyle="--", linewidth=1, label=f"{label} target n* = {target}")
            if "pool/rejected" in rs[0].steps:
                band(b, [smooth(r.steps["pool/rejected"], window) for r in rs], label, c)
    a.set(xlabel="training step", ylabel="pooled groups (occupancy)", yscale="log", title="Pool occupancy")
    a.legend(fontsize=8)
    b.set(xlabel="training step", ylabel=f"groups rejected per step ({window}-step mean)", title="PACE's rejections")
    if b.lines:
        b.legend(fontsize=8)
    fig.suptitle("The pool over time: the backlog Async lets grow, and PACE's control of it", y=1.03)
    return fig


# ---------------------------------------------------------------- Figure 8

CRITICAL = [("time/wait_data", "waiting for data"), ("time/train", "training"), ("time/sync", "weight sync"),
            ("time/publish", "weight publish")]  # publish: logged from 2026-12-08 (before: outside time/step)
OVERLAPPED = [("time/generate", "generation"), ("time/rescore", "rescoring (PFS)")]


def phase_means(runs: list[Run], warmup: int = 5) -> dict[str, dict[str, float]]:
    """Seconds per step by phase, mean over steps ≥ ``warmup`` and over seeds, per method."""
    out = {}
    for label, rs in by_label(runs).items():
        # short runs (tests, dry runs) keep their second half
        steps = pd.concat([r.steps.iloc[min(warmup, len(r.steps) // 2):] for r in rs], ignore_index=True)
        if steps.empty:
            continue
        m = {k: float(steps[k].mean()) if k in steps else 0.0 for k, _ in CRITICAL + OVERLAPPED}
        m["time/step"] = float(steps["time/step"].mean())
        m["other"] = max(0.0, m["time/step"] - sum(m[k] for k, _ in CRITICAL))
        out[label] = m
    return out


def walltime_breakdown(runs: list[Run], warmup: int = 5):
    """Wall time per training step by phase (stacked: the step's critical path) with the work that
    overlaps it drawn beside, hatched: generation, and PACE's prefix rescoring."""
    means = phase_means(runs, warmup)
    if not means:
        return None
    labels = list(means)
    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(1.6 * len(labels) + 3, 3.8))
    bottom = np.zeros(len(labels))
    publishes = any("time/publish" in r.steps for r in runs)  # runs before 2026-12-08 left it out of time/step
    logged = [(k, n) for k, n in CRITICAL if k != "time/publish" or publishes]
    for i, (key, name) in enumerate([*logged, ("other", "other (logging, batching)")]):
        h = np.array([means[lb][key] for lb in labels])
        ax.bar(x - 0.2, h, 0.38, bottom=bottom, label=name, color=plt.get_cmap("tab20c")(i * 4))
        bottom += h
    for j, (key, name) in enumerate(OVERLAPPED):
        h = np.array([means[lb][key] for lb in labels])
        ax.bar(x + 0.2 + (j - 0.5) * 0.19, h, 0.18, label=f"{name} (overlapped)", fill=False,
               hatch="///" if j == 0 else "xx", edgecolor=plt.get_cmap("tab10")(j + 3))
    ax.set_xticks(x, labels, rotation=20)
    ax.set(ylabel="seconds per step", title=f"Wall time per training step (steps ≥ {warmup})")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig
