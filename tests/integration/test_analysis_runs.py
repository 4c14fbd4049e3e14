"""analysis/ on real logs: short tiny runs of every method the figures need (the `study` fixture,
tests/conftest.py), built into every figure, the report and Table 1, from local records and from the
offline wandb runs alone."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from analysis.build import FIGURES, build
from analysis.runs import load
from tests.helpers import ROOT

pytestmark = pytest.mark.integration


def _numbers(out):
    numbers = json.loads((out / "numbers.json").read_text())
    for r in numbers["runs"]:
        r.pop("source")
    return numbers


def test_every_figure_table_and_the_report_build(study, tmp_path):
    runs = load(str(study), "local")
    assert sorted(r.label for r in runs) == ["Async", "PACE", "PACE (raw)", "Stale-1", "Stale-8", "Sync"]
    numbers = build(runs, tmp_path, report=True, title="test")
    assert numbers["skipped"] == []
    assert numbers["figures"] == list(FIGURES)
    for name in FIGURES:
        for ext in ("png", "pdf"):
            assert (tmp_path / f"{name}.{ext}").stat().st_size > 1000, name
    table = (tmp_path / "val_best.md").read_text().splitlines()
    assert table[0] == "In-training validation, best per run: mean@2 (%)"
    assert table[2] == "| method | Arith L1 | Arith L2 | Arith L3 | Arith L4 | Avg. |"
    assert [row.split(" | ")[0].strip("| ") for row in table[4:]] == ["Sync", "Async", "PACE", "PACE (raw)", "Stale-1", "Stale-8"]
    assert "\\begin{tabular}" in (tmp_path / "val_best.tex").read_text()
    # each run's best validation: θ_0, the first version loaded at or past each multiple of 2
    # (updates held during a validation may skip one), and the final θ_5; the one best.json names
    for run in runs:
        versions = run.val["version"].tolist()
        assert versions[0] == 0 and versions[-1] == 5 and versions == sorted(set(versions)), versions
        assert numbers["val_best"]["table"][run.label]["avg"] == pytest.approx(run.val["val/avg"].max())
        best = numbers["val_best"]["best"][run.label][0]["version"]
        assert run.summary["best"]["version"] == best
    # every claim whose runs are here is tested (PACE and PACE (raw) both rejected groups); the score
    # ablation, γ and the KV cache need PACE (gen), γ = 2, 4 and recompute runs, which this study does not make
    untested = {k for k, c in numbers["claims"].items() if not c["tested"]}
    assert untested == {"g_score_ablation", "h_gamma", "i_kv_recompute"}, {k: numbers["claims"][k] for k in untested}
    assert numbers["claims"]["e_time_to_peak"]["seeds"] == {"Sync": [0], "Async": [0]}
    report = (tmp_path / "report.md").read_text()
    for name in FIGURES:
        assert f"({name}.png)" in report
    # one seed per method: every claim is decided on an interval over seeds, so none is decided here
    assert report.count("**inconclusive**") == 6 and "- Not tested here: (g) needs" in report and "; (i) needs" in report
    assert all(c["verdict"] == "inconclusive" for c in numbers["claims"].values() if c["tested"])
    assert "| method | seeds | best (selects Table 1's checkpoint) | final | mean after θ_0 |" in report
    assert "## In-training validation mean@2: best per run" in report and "Table 1 layout" not in report
    by_method = {(r.label, r.seed): r for r in runs}
    for row in numbers["runs"]:  # every run's validation averages, in version order
        run = by_method[row["label"], row["seed"]]
        assert row["validation_avg"] == run.val["val/avg"].tolist() and row["validation_versions"] == run.val["version"].tolist()


def test_offline_wandb_runs_alone_give_the_same_numbers(study, tmp_path):
    build(load(str(study), "local"), tmp_path / "local")
    copy = tmp_path / "copy"
    shutil.copytree(study, copy)
    for run_dir in copy.glob("*/*"):  # the local records go: only the offline wandb runs remain
        if (run_dir / "metrics.jsonl").exists():
            shutil.rmtree(run_dir / "groups")
            (run_dir / "metrics.jsonl").unlink()
            (run_dir / "summary.json").unlink()
    runs = load(str(copy), "wandb-offline")
    assert len(runs) == 6 and all(not r.groups.empty for r in runs)
    build(runs, tmp_path / "wandb")
    local, wandb = _numbers(tmp_path / "local"), _numbers(tmp_path / "wandb")
    assert wandb == local
    assert (tmp_path / "local" / "val_best.md").read_text() == (tmp_path / "wandb" / "val_best.md").read_text()


def test_cli_builds_from_a_sweep_folder(study, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "analysis.build", str(study / "stalek"), "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "2 runs (Stale-1, Stale-8)" in proc.stdout and (tmp_path / "stalek.png").exists()
    # a run that did not finish (here: marked interrupted) is left out unless asked for, and named
    copy = tmp_path / "copy"
    shutil.copytree(study / "stalek", copy)
    summary = next(copy.glob("*/summary.json"))
    summary.write_text(summary.read_text().replace('"status": "finished"', '"status": "interrupted"'))
    part = subprocess.run([sys.executable, "-m", "analysis.build", str(copy), "--out", str(tmp_path / "p")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert part.returncode == 0 and "1 runs" in part.stdout
    assert f"left out (not finished; --include-unfinished keeps them): {summary.parent.name}" in part.stderr
    bad = subprocess.run([sys.executable, "-m", "analysis.build", str(tmp_path / "nothing"), "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and bad.stderr.strip().startswith("error:") and len(bad.stderr.strip().splitlines()) == 1


def test_table1_scores_each_runs_selected_checkpoint_with_eval_py(study, tmp_path):
    """The one command on two of the study's runs (copied elsewhere: a run folder can move): eval.py
    scores each run's selected version (best.json, from the in-training validation of 5 problems per
    level) on the run's arithmetic sets, here cut to 4 problems per level (data.arithmetic.n_val=16)
    to keep the test short; the table holds those scores, never the validation's."""
    runs = tmp_path / "runs"
    for run_dir in sorted(study.glob("main/*")):
        if any(f"+exp={name}" in run_dir.name for name in ("sync_tiny", "pace_tiny")):
            shutil.copytree(run_dir, runs / run_dir.name)
    assert len(list(runs.iterdir())) == 2
    out = tmp_path / "table"
    cmd = [sys.executable, "-m", "analysis.table1", str(runs), "--out", str(out), "--eval-arg", "data.arithmetic.n_val=16"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    md = (out / "table1.md").read_text()
    table = json.loads((out / "table1.json").read_text())
    assert list(table["rows"]) == ["Sync", "PACE"] and table["k"] == 2
    for run_dir in runs.iterdir():
        run = load(str(run_dir), "local")[0]
        best = json.loads((run_dir / "best.json").read_text())
        scored = json.loads((run_dir / "eval" / "mean@2.json").read_text())
        assert scored["selected"]["version"] == best["version"] == run.summary["best"]["version"]
        assert scored["model"] == str(run_dir / "best") if best["version"] else scored["model"] == best["path"]
        assert scored["problems"] == {f"arith_l{i}": 4 for i in range(1, 5)}  # eval.py's sets, not the validation's 5
        assert table["rows"][run.label]["mean"] == scored["mean@2"]
        cells = [f"{100 * scored['mean@2'][n]:.2f}" for n in ("arith_l1", "arith_l2", "arith_l3", "arith_l4", "avg")]
        assert f"| {run.label} | {' | '.join(cells)} |" in md
        assert f"{run.label}: θ_{best['version']} (seed 0)" in md
    assert "by eval.py" in md and "in-training validation (mean@2) with the best average within the whole run" in md
    # scored once: a second call gathers without running eval.py again
    again = subprocess.run(cmd + ["--no-score"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and (out / "table1.md").read_text() == md
