"""Every figure draws the paper's panels and series: hand-made runs of every method, each figure's
axes titles and legend labels against a list written from the paper's captions."""
from __future__ import annotations

import re
import zlib

import numpy as np
import pandas as pd
import pytest

from analysis import build
from analysis.runs import Run, from_records

pytestmark = pytest.mark.unit

MODEL_8B, MODEL_30B, MODEL_4B = "Qwen/Qwen3-8B-Base", "Qwen/Qwen3-30B-A3B-Base", "Qwen/Qwen3-4B-Base"
SETS = ["aime_2023", "aime_2024", "aime_2025", "beyond_aime", "brumo_2025", "hmmt_feb_2025"]

METHODS = {  # label → config deltas (analysis.runs.method_label names them)
    "Sync": {"pool": {"name": "sync"}},
    "Async": {"pool": {"name": "async"}},
    "PACE": {"pool": {"name": "pace"}},
    "PACE (raw)": {"pool": {"name": "pace"}, "pace": {"score": "raw"}},
    "PACE (gen)": {"pool": {"name": "pace"}, "pace": {"score": "generation"}},
    "M2PO": {"pool": {"name": "async"}, "algo": {"name": "m2po"}},
    "Stale-1": {"pool": {"name": "stale_k", "max_lag": 1.0}},
    "Stale-4": {"pool": {"name": "stale_k", "max_lag": 4.0}},
    "PACE γ=2": {"pool": {"name": "pace"}, "pace": {"gamma": 2.0}},
    "PACE γ=4": {"pool": {"name": "pace"}, "pace": {"gamma": 4.0}},
}
ALL = ["Sync", "Async", "PACE", "PACE (raw)", "PACE (gen)", "M2PO", "PACE γ=2", "PACE γ=4", "Stale-1", "Stale-4"]
PHASES = ["waiting for data", "training", "weight sync", "other (logging, batching)", "generation (overlapped)",
          "rescoring (PFS) (overlapped)"]
STALENESS = ["Waiting Staleness $K_{wait}$", "Generation Staleness $K_{gen}$", "Effective Staleness $S_{eff}$"]

# From the paper's captions: per figure file, each panel's title and the series it draws.
PANELS = {
    # Figure 1: validation accuracy against steps and wall time, Sync / Async / PACE
    "validation": [("Against training steps", ["Sync", "Async", "PACE"]), ("Against wall time", ["Sync", "Async", "PACE"])],
    # Figure 3: the Stale-k sweep in early training, Sync the on-policy reference; an AIME 2024 validation panel
    "stalek": [("Rollout accuracy", ["Sync", "Stale-1", "Stale-4"]), ("AIME 2024 validation", ["Sync", "Stale-1", "Stale-4"])],
    # Figure 5: validation trajectories on AIME 2024 and BeyondAIME over the first 300 steps, every method
    "benchmarks": [("AIME 2024", ALL), ("BeyondAIME", ALL)],
    # Figure 6: PACE's retained vs rejected groups over 50 updates: Waiting, Generation, Effective Staleness
    "pace_staleness": [(t, ["retained", "rejected"]) for t in STALENESS],
    # Figure 7: consumed groups' Waiting, Generation and Effective Staleness, PACE and Async
    "consumed_staleness": [(t, ["Async", "PACE"]) for t in STALENESS],
    "pool_over_time": [("Pool occupancy", ["Async", "PACE", "PACE target n* = 4"]), ("PACE's rejections", ["PACE"])],
    # Figure 8: wall time per step by phase, every method
    "walltime": [("Wall time per training step (steps ≥ 5)", PHASES)],
    # Figure 9: the 30B runs: AIME 2024 validation and time per step
    "large_model": [("AIME 2024 validation", ["Async", "PACE"]), ("Time per training step", ["Async", "PACE"])],
    # Appendix B: complete validation trajectories of every method, every benchmark and the average
    "appendix_b": [(t, ALL) for t in ["AIME 2023", "AIME 2024", "AIME 2025", "BeyondAIME", "BrUMO 2025",
                                      "HMMT Feb 2025", "Average"]],
    # Appendix C.1: 4B: Async / PACE (raw) / PACE, and γ ∈ {1, 2, 4}: validation and training reward
    "appendix_c1": [("Score: validation", ["Async", "PACE (raw)", "PACE"]),
                    ("Score: training reward", ["Async", "PACE (raw)", "PACE"]),
                    ("γ: validation", ["PACE γ=1", "PACE γ=2", "PACE γ=4"]),
                    ("γ: training reward", ["PACE γ=1", "PACE γ=2", "PACE γ=4"])],
}


def config(label: str, model: str | None, record: bool = False) -> dict:
    m = METHODS[label]
    return {"pool": {"name": "async", "record_effective": record, **m.get("pool", {})},
            "pace": {"score": "effective", "gamma": 1.0, "target_pool": None, **m.get("pace", {})},
            "algo": {"name": "dapo", **m.get("algo", {})}, "data": {"batch_prompts": 4}, "model": {"path": model},
            "eval": {"figure_sets": ["aime_2024", "beyond_aime"]} if model else {}, "seed": 0}


def groups_of(label: str, steps: int, effective: bool, rng) -> pd.DataFrame:
    rows = []
    for step in range(steps):
        for i in range(6):
            fate = "rejected" if label.startswith("PACE") and i >= 4 else "consumed"
            k_gen, k_wait = float(rng.integers(0, 3)), float(rng.integers(0, 8))
            u = float(rng.random())
            rows.append({"fate": fate, "step": step, "k_gen": k_gen, "k_wait": k_wait, "k": k_gen + k_wait,
                         "len_mean": float(rng.integers(10, 100)), "acc_mean": 0.5, "reward_mean": 0.0,
                         "s_eff": k_wait + u * k_gen if effective else None})
    return pd.DataFrame(rows)


def run(label: str, model: str | None = MODEL_8B, steps: int = 80, record: bool = False, sets=SETS) -> Run:
    rng = np.random.default_rng(zlib.crc32(f"{label} {model}".encode()))  # the same values in every process
    rows = [{"step": i, "time/step": 1.0 + rng.random(), "time/train": 0.5, "time/wait_data": 0.2, "time/sync": 0.1,
             "time/generate": 0.9, "time/rescore": 0.05, "staleness/k_wait_mean": 1.0,
             "train/reward_mean": rng.random(), "rollout/acc_mean": rng.random(),
             "pool/occupancy": 4 + i, "pool/rejected": 2 if label.startswith("PACE") else 0} for i in range(steps)]
    rows += [{"val/version": v, "val/avg": rng.random(), **{f"val/{s}/mean@32": rng.random() for s in sets}}
             for v in range(0, steps + 1, 10)]
    effective = label.startswith("PACE") or record
    return from_records(f"{label}-{model}", "local", rows, groups_of(label, steps, effective, rng), {}, config(label, model, record))


def paper_runs(record_async: bool = True) -> list[Run]:
    """Every 8B method; Async, PACE on 30B; Async, PACE (raw), PACE and γ = 2, 4 on 4B."""
    runs = [run(label, record=label == "Async" and record_async) for label in ALL]
    runs += [run(label, MODEL_30B) for label in ("Async", "PACE")]
    runs += [run(label, MODEL_4B) for label in ("Async", "PACE (raw)", "PACE", "PACE γ=2", "PACE γ=4")]
    return runs


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


def panels(fig) -> list[tuple[str, list[str]]]:
    """(title, series labels) per axes; a label's " (n=…)" count is left out."""
    out = []
    for ax in fig.axes:
        labels = [re.sub(r" \(n=\d+\)$", "", lb) for lb in ax.get_legend_handles_labels()[1]]
        out.append((ax.get_title(), list(dict.fromkeys(labels))))
    return out


@pytest.mark.parametrize("name", list(PANELS))
def test_each_figure_draws_the_papers_panels_and_series(name):
    fig = build.draw(name, paper_runs())
    assert fig is not None, f"{name} drew nothing"
    assert panels(fig) == PANELS[name]


def test_every_figure_of_the_build_is_checked():
    assert set(build.FIGURES) == set(PANELS)


def test_walltime_bars_name_every_method_of_the_main_model():
    fig = build.draw("walltime", paper_runs())
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ALL


def test_figure_5_draws_the_first_300_steps_and_figure_6_a_window_of_50_updates():
    runs = [run("PACE", steps=400), run("Async", steps=400)]
    left = pd.DataFrame([{"fate": "pooled", "step": 400, "k_gen": 0.0, "k_wait": 0.0, "k": 0.0}])
    runs[0].groups = pd.concat([runs[0].groups, left], ignore_index=True)  # still pooled at the end: no decision
    fig = build.draw("benchmarks", runs)
    assert max(max(line.get_xdata()) for line in fig.axes[0].lines) == 300
    assert max(max(line.get_xdata()) for line in build.draw("benchmarks", runs, first=None).axes[0].lines) == 400
    fig = build.draw("pace_staleness", runs)
    assert "steps 350–399" in fig._suptitle.get_text()
    counts = [int(re.search(r"n=(\d+)", lb).group(1)) for lb in fig.axes[0].get_legend_handles_labels()[1]]
    assert counts == [50 * 4, 50 * 2]  # 4 retained and 2 rejected groups a step, over 50 steps
    fig = build.draw("pace_staleness", runs, window=20, window_start=10)
    assert "steps 10–29" in fig._suptitle.get_text()


def test_figure_7_says_when_asyncs_effective_staleness_was_not_recorded():
    fig = build.draw("consumed_staleness", paper_runs(record_async=False))
    effective = fig.axes[2]
    assert panels(fig)[2] == (STALENESS[2], ["PACE"])  # not K drawn in its place
    assert [t.get_text() for t in effective.texts] == ["Async: not recorded (pool.record_effective)"]
    assert not fig.axes[0].texts


def test_the_tiny_lab_draws_its_analogues_from_one_model():
    """One model, the arithmetic levels named by `eval.figure_sets`: Figure 9 and Appendix C.1 draw
    every run given, Figure 5 the named levels."""
    levels = ["arith_l1", "arith_l2", "arith_l3", "arith_l4"]
    runs = [run(label, model=None, sets=levels) for label in ("Sync", "Async", "PACE", "PACE (raw)", "PACE γ=2")]
    for r in runs:
        r.config["eval"] = {"figure_sets": ["arith_l3", "arith_l4"]}
    assert [t for t, _ in panels(build.draw("benchmarks", runs))] == ["arith_l3", "arith_l4"]
    assert panels(build.draw("large_model", runs))[0] == (
        "arith_l3 validation", ["Sync", "Async", "PACE", "PACE (raw)", "PACE γ=2"])
    assert [s for _, s in panels(build.draw("appendix_c1", runs))] == [["Async", "PACE (raw)", "PACE"]] * 2 + [
        ["PACE γ=1", "PACE γ=2"]] * 2
    for r in runs:  # a run saved before the key: the last two logged sets
        r.config["eval"] = {}
    assert [t for t, _ in panels(build.draw("benchmarks", runs))] == ["arith_l3", "arith_l4"]


def test_runs_without_validation_or_figure_sets_draw_what_they_have(tmp_path):
    """Runs with no validation and no `eval.figure_sets` (eval.every 0): Figure 9 draws its time per
    step with the validation panel saying none was logged; the validation figures are skipped."""
    runs = [run(label, MODEL_30B) for label in ("Async", "PACE")]
    for r in runs:
        r.val, r.config["eval"] = pd.DataFrame(), {}
    fig = build.draw("large_model", runs)
    assert panels(fig) == [("validation", []), ("Time per training step", ["Async", "PACE"])]
    assert [t.get_text() for t in fig.axes[0].texts] == ["no validations logged"]
    numbers = build.build(runs, tmp_path)
    assert {"validation", "benchmarks", "appendix_b"} <= set(numbers["skipped"]) and "large_model" in numbers["figures"]
    only_avg = [run(label, MODEL_30B, sets=[]) for label in ("Stale-1", "Sync")]  # val/avg but no set's mean@k
    for r in only_avg:
        r.config["eval"] = {}
    assert build.draw("benchmarks", only_avg) is None
    assert panels(build.draw("stalek", only_avg))[1] == ("validation", [])


def test_build_writes_every_figure(tmp_path):
    numbers = build.build(paper_runs(), tmp_path)
    assert numbers["figures"] == list(build.FIGURES) and not numbers["skipped"]
    assert all((tmp_path / f"{name}.png").is_file() for name in build.FIGURES)


def test_trajectories_and_figures_import_one_way():
    """figures draws Figure 3 with trajectories' validation helpers; trajectories draws with the shared
    band and colours (analysis/curves.py), not with figures: no import cycle, no private names."""
    import subprocess
    import sys
    from pathlib import Path

    code = "import sys, analysis.trajectories; print('analysis.figures' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "False"


def test_figure_7_draws_kv_staleness_as_a_fourth_panel_only_when_the_runs_logged_it():
    runs = [run("Async", record=True), run("PACE")]
    assert len(build.draw("consumed_staleness", runs).axes) == 3  # runs from before K_kv: no empty panel
    for r in runs:  # K_kv = K_gen + 1 on PACE's groups, + 2 on Async's
        r.groups["k_kv"] = r.groups.k_gen + (1.0 if r.label == "PACE" else 2.0)
    fig = build.draw("consumed_staleness", runs)
    assert panels(fig)[:3] == PANELS["consumed_staleness"] and panels(fig)[3] == ("KV Staleness $K_{kv}$", ["Async", "PACE"])
    consumed = {r.label: r.groups[r.groups.fate == "consumed"] for r in runs}
    counts = [int(re.search(r"n=(\d+)", lb).group(1)) for lb in fig.axes[3].get_legend_handles_labels()[1]]
    assert counts == [len(consumed["Async"]), len(consumed["PACE"])]
    # the bars are the consumed groups' K_kv (densities: each method's mean is the bars' centroid, to a bin)
    for label, bars in zip(["Async", "PACE"], fig.axes[3].containers):
        mass = [p.get_height() * p.get_width() for p in bars]
        centroid = sum(m * (p.get_x() + p.get_width() / 2) for m, p in zip(mass, bars))
        assert sum(mass) == pytest.approx(1.0) and centroid == pytest.approx(consumed[label].k_kv.mean(), abs=0.1)
    # one method logged it, the other did not: the panel says which
    runs[0].groups = runs[0].groups.drop(columns="k_kv")
    fig = build.draw("consumed_staleness", runs)
    assert panels(fig)[3] == ("KV Staleness $K_{kv}$", ["PACE"])
    assert [t.get_text() for t in fig.axes[3].texts] == ["Async: not recorded"]


def test_walltime_bars_draw_the_publish_of_runs_that_logged_it():
    """Runs from 2026-12-08 count the publish of θ in time/step and log it (`time/publish`): a bar of its
    own, and "other" is what is left of the step after it; older runs draw no publish bar."""
    from analysis.figures import phase_means

    runs = [run("Sync"), run("Async")]
    for r in runs[1:]:
        r.steps["time/publish"] = 0.25
    fig = build.draw("walltime", runs)
    assert "weight publish" in panels(fig)[0][1]
    means = phase_means(runs)
    steps = runs[1].steps.iloc[5:]
    assert means["Async"]["other"] == pytest.approx(float(steps["time/step"].mean()) - 0.2 - 0.5 - 0.1 - 0.25)
    assert "weight publish" not in panels(build.draw("walltime", runs[:1]))[0][1]
