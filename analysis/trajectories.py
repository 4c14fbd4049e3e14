"""The paper's validation- and reward-trajectory figures beyond Figure 1: Figure 5 (the two named
benchmarks, every method), Figure 9 (the large model: one benchmark and time per step), Appendix B
(every benchmark and the average, every method) and Appendix C.1 (the small model: the score
variants and the γ runs, validation and training reward).

Which benchmarks: the run's `eval.figure_sets` (conf/eval/*.yaml: math6 names aime_2024 and
beyond_aime, the tiny arithmetic eval its two hardest levels); Figure 5 draws each, Figures 3 and 9
the first. A run saved before the key existed falls back to the last two of its logged sets, by
name. Which model: the main figures draw the model with the most runs (`main_model`); Figure 9
the runs whose `model.path` contains "30B", Appendix C.1 those with "4B"; when no run matches and
all runs share one model (the tiny lab), that model's runs.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from analysis.curves import band, by_label, color, logged_k, smooth
from analysis.runs import Run

LARGE, SMALL = "30B", "4B"  # the paper's Figure 9 model and Appendix C.1 model (Qwen3-30B-A3B, Qwen3-4B)


def display(name: str) -> str:
    """A validation set's name as the paper writes it (AIME 2024, BeyondAIME), else as logged."""
    from pace.tasks.benchmarks import BENCHMARKS

    return BENCHMARKS[name].title if name in BENCHMARKS else name


def logged_sets(runs: list[Run]) -> list[str]:
    """Validation sets in the runs' logs (`val/<set>/mean@k`), sorted by name."""
    return sorted({c.split("/")[1] for r in runs for c in r.val.columns if c.startswith("val/") and "/mean@" in c})


def figure_sets(runs: list[Run]) -> list[str]:
    """The validation sets the figures name: the first run's `eval.figure_sets` that has one."""
    for r in runs:
        named = (r.config.get("eval") or {}).get("figure_sets")
        if named:
            return list(named)
    return logged_sets(runs)[-2:]


def val_curve(run: Run, name: str, first: int | None = None) -> pd.Series | None:
    """``val/<name>/mean@k`` (or ``val/avg`` for "avg") of one run against the validated version."""
    col = "val/avg" if name == "avg" else next((c for c in run.val.columns if c.startswith(f"val/{name}/mean@")), None)
    if col is None or run.val.empty:
        return None
    s = run.val.set_index("version")[col].dropna()
    return s if first is None else s[s.index <= first]


def _val_panel(ax, groups: dict[str, list[Run]], name: str | None, first: int | None = None, legend: bool = True) -> None:
    """One benchmark's validation against steps, one curve per method; says so when not logged
    (``name`` None: the runs logged no validation set)."""
    if name is None:
        ax.set(title="validation", xlabel="training step")
        ax.text(0.5, 0.5, "no validations logged", ha="center", va="center", transform=ax.transAxes)
        return
    for i, (label, rs) in enumerate(groups.items()):
        curves = [c for c in (val_curve(r, name, first) for r in rs) if c is not None and not c.empty]
        if curves:
            band(ax, curves, label, color(label, i))
    ax.set(title="Average" if name == "avg" else display(name), xlabel="training step")
    if ax.lines and legend:
        ax.legend(fontsize=7)
    elif not ax.lines:
        ax.text(0.5, 0.5, f"{name}: not in the validation logs", ha="center", va="center", transform=ax.transAxes)


def _validated(runs: list[Run]) -> dict[str, list[Run]]:
    return {k: [r for r in v if not r.val.empty] for k, v in by_label(runs).items() if any(not r.val.empty for r in v)}


# ---------------------------------------------------------------- Figure 5


def benchmark_curves(runs: list[Run], first: int | None = 300):
    """Validation trajectories of every method on the named benchmarks (`eval.figure_sets`: AIME 2024
    and BeyondAIME) over the first ``first`` training steps (Figure 5; None: the whole run)."""
    groups = _validated(runs)
    if not groups:
        return None
    names = figure_sets(runs)
    if not names:  # validated, but no set's mean@k logged
        return None
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        _val_panel(ax, groups, name, first)
    axes[0][0].set_ylabel(f"validation mean@{logged_k(runs)}")
    span = f"the first {first} steps" if first is not None else "the whole run"
    fig.suptitle(f"Validation trajectories over {span}", y=1.03)
    return fig


# ---------------------------------------------------------------- Appendix B


def all_trajectories(runs: list[Run]):
    """Complete validation trajectories of every method: each logged benchmark and the average
    (Appendix B)."""
    groups = _validated(runs)
    if not groups:
        return None
    names = [*logged_sets(runs), "avg"]
    cols = min(4, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        _val_panel(ax, groups, name, legend=False)
    for ax in list(axes.flat)[len(names):]:
        ax.remove()
    axes[0][0].set_ylabel(f"validation mean@{logged_k(runs)}")
    fig.suptitle("Complete validation trajectories", y=1.01)
    fig.tight_layout()
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="upper left", bbox_to_anchor=(1.0, 0.95), fontsize=8)
    return fig


# ---------------------------------------------------------------- model selection


def model_name(cfg: dict) -> str:
    return (cfg.get("model") or {}).get("path") or "tiny"


def main_model(runs: list[Run]) -> list[Run]:
    """The runs of the model with the most runs (the paper's main figures are of one model, 8B; Figure 9
    and Appendix C.1 pick theirs with `of_model`). All runs when they share one model."""
    from collections import Counter

    counts = Counter(model_name(r.config) for r in runs)
    if len(counts) <= 1:
        return runs
    top = max(counts, key=lambda m: (counts[m], m))
    return [r for r in runs if model_name(r.config) == top]


def of_model(runs: list[Run], hint: str) -> tuple[list[Run], str] | None:
    """The runs of the model whose name contains ``hint``, else all runs when they share one model
    (the tiny lab's analogue); None when runs of several other models are given."""
    matched = [r for r in runs if hint.lower() in model_name(r.config).lower()]
    models = sorted({model_name(r.config) for r in (matched or runs)})
    if matched or len(models) == 1:
        return matched or runs, ", ".join(models)
    return None


# ---------------------------------------------------------------- Figure 9


def large_model(runs: list[Run], hint: str = LARGE, window: int = 10):
    """The large model's runs (Figure 9): validation on the first named benchmark, and wall time per
    training step (``window``-step mean)."""
    picked = of_model(runs, hint)
    if picked is None:
        return None
    rs, model = picked
    groups = {k: v for k, v in by_label(rs).items() if any(not r.steps.empty for r in v)}
    if not groups:
        return None
    name = next(iter(figure_sets(rs)), None)  # None: no validation logged (the time per step still draws)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    _val_panel(a, {k: [r for r in v if not r.val.empty] for k, v in groups.items()}, name)
    if name is not None:
        a.set(title=f"{display(name)} validation")
    a.set(ylabel=f"validation mean@{logged_k(rs)}")
    for i, (label, group) in enumerate(groups.items()):
        band(b, [smooth(r.steps["time/step"], window) for r in group], label, color(label, i))
    b.set(title="Time per training step", xlabel="training step", ylabel=f"seconds per step ({window}-step mean)")
    b.legend(fontsize=7)
    fig.suptitle(f"{model}: validation and time per step", y=1.03)
    return fig


# ---------------------------------------------------------------- Appendix C.1


SCORE_VARIANTS = ("Async", "PACE (raw)", "PACE")


def gamma_label(run: Run) -> str | None:
    """"PACE γ=g" for a PACE run with the effective score (γ = 1 included), else None."""
    cfg = run.config
    if (cfg.get("pool") or {}).get("name") != "pace" or (cfg.get("pace") or {}).get("score", "effective") != "effective":
        return None
    if run.label != "PACE" and not run.label.startswith("PACE γ="):
        return None  # e.g. an IS-corrected PACE run: not one of the γ runs
    return f"PACE γ={float((cfg.get('pace') or {}).get('gamma', 1.0)):g}"


def small_model(runs: list[Run], hint: str = SMALL, window: int = 10):
    """The small model's ablations (Appendix C.1): Async / PACE (raw) / PACE, and PACE at each γ,
    each as validation (average) and training reward (``window``-step mean) against steps."""
    picked = of_model(runs, hint)
    if picked is None:
        return None
    rs, model = picked
    labelled = by_label(rs)
    rows = {"Score": {k: labelled[k] for k in SCORE_VARIANTS if k in labelled}, "γ": {}}
    for r in rs:
        g = gamma_label(r)
        if g is not None:
            rows["γ"].setdefault(g, []).append(r)
    rows["γ"] = dict(sorted(rows["γ"].items(), key=lambda kv: float(kv[0].split("=")[1])))
    rows = {k: v for k, v in rows.items() if len(v) > 1}  # a comparison needs two
    if not rows:
        return None
    fig, axes = plt.subplots(len(rows), 2, figsize=(10, 3.4 * len(rows)), squeeze=False)
    for (row, groups), (a, b) in zip(rows.items(), axes):
        _val_panel(a, {k: [r for r in v if not r.val.empty] for k, v in groups.items()}, "avg")
        a.set(title=f"{row}: validation", ylabel=f"validation mean@{logged_k(rs)} (avg)")
        for i, (label, group) in enumerate(groups.items()):
            curves = [smooth(r.steps["train/reward_mean"], window) for r in group if "train/reward_mean" in r.steps]
            if curves:
                band(b, curves, label, color(label, i))
        b.set(title=f"{row}: training reward", xlabel="training step", ylabel=f"reward of trained groups ({window}-step mean)")
        if b.lines:
            b.legend(fontsize=7)
    fig.suptitle(f"{model}: score variants and γ", y=1.01)
    fig.tight_layout()
    return fig
