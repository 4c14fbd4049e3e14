"""Table 1's gathering on hand-made run folders: eval.py's scores of each run's selected checkpoint,
by method, never the in-training validation that selected it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from analysis import table1
from tests.helpers import make_run


def test_the_table_holds_eval_py_scores_by_method_with_versions_and_ks(tmp_path):
    runs = tmp_path / "runs"
    make_run(runs, "sync0", "sync", 0, 20, [0.10, 0.30])
    make_run(runs, "pace0", "pace", 0, 30, [0.20, 0.40])
    make_run(runs, "pace1", "pace", 1, 10, [0.40, 0.60])
    make_run(runs, "gen0", "pace", 0, 40, [0.50, 0.50], score="generation")
    out = tmp_path / "out"
    table1.main([str(runs), "--out", str(out), "--no-score"])
    md = (out / "table1.md").read_text()
    lines = md.splitlines()
    assert "| method | Arith L1 | Arith L2 | Avg. |" in lines
    assert "| Sync | 10.00 | 30.00 | 20.00 |" in lines
    # PACE: two seeds, mean ± standard deviation over seeds: L1 (20, 40), L2 (40, 60), avg (30, 50)
    assert "| PACE | 30.00 ± 14.14 | 50.00 ± 14.14 | 40.00 ± 14.14 |" in lines
    # the ranking ablation: PACE (gen) beside the PACE runs, which rank by Effective Staleness
    assert "| PACE (gen) | 50.00 | 50.00 | 50.00 |" in lines and "| PACE (effective) | 30.00 ± 14.14 | 50.00 ± 14.14 | 40.00 ± 14.14 |" in lines
    # the caption: the scoring k, the selection's k and window, each run's selected version
    assert "mean@4 (%) by eval.py" in md and "in-training validation (mean@2) with the best average within 300 updates" in md
    assert "Sync: θ_20 (seed 0)" in md and "PACE: θ_30 (seed 0), θ_10 (seed 1)" in md
    assert "PACE (gen): θ_40 (seed 0)" in md  # the ablation's runs too
    # never the validation numbers that selected the versions (80, 85, 90 here)
    assert not any(x in md for x in ("80.00", "85.00", "90.00"))
    data = json.loads((out / "table1.json").read_text())
    assert data["rows"]["Sync"]["mean"] == {"arith_l1": 0.10, "arith_l2": 0.30, "avg": pytest.approx(0.20)}
    csv = (out / "table1.csv").read_text().splitlines()
    assert csv[0] == "block,method,Arith L1,Arith L2,Avg.,seeds,selected versions"
    assert csv[1] == "Table 1,Sync,10.00,30.00,20.00,1,sync0:20"
    tex = (out / "table1.tex").read_text()
    assert r"\caption{" in tex and r"PACE & 30.00 $\pm$ 14.14" in tex and r"$\theta$_20" not in tex
    assert not (out / "table1_multiturn.md").exists()


def test_multiturn_runs_have_their_own_table(tmp_path):
    make_run(tmp_path / "runs", "sync", "sync", 0, 20, [0.1, 0.3])
    make_run(tmp_path / "runs", "tool", "async", 0, 10, [0.5, 0.7], tools=2)
    table1.main([str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--no-score"])
    single = (tmp_path / "out" / "table1.md").read_text()
    multi = (tmp_path / "out" / "table1_multiturn.md").read_text()
    assert "| Sync |" in single and "| Async |" not in single
    assert "| Async | 50.00 | 70.00 | 60.00 |" in multi and "| Sync |" not in multi


def _fails(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        table1.main(argv)
    msg = str(exc.value.code)
    assert msg.startswith("error: ") and "\n" not in msg
    return msg


def test_a_selected_version_without_a_checkpoint_is_refused_naming_run_and_version(tmp_path, capsys):
    make_run(tmp_path / "runs", "sync0", "sync", 0, 20, [0.1, 0.3])
    bad = make_run(tmp_path / "runs", "pace0", "pace", 0, 30, [0.2, 0.4], checkpoint=False)
    msg = _fails([str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--no-score"], capsys)
    assert str(bad) in msg and "θ_30 has no checkpoint" in msg
    assert not (tmp_path / "out" / "table1.md").exists()


def test_a_score_of_another_version_is_not_used(tmp_path, capsys):
    """eval.py scored θ_20, then the selection moved (a resumed run): the score is stale."""
    d = make_run(tmp_path / "runs", "sync0", "sync", 0, 20, [0.1, 0.3])
    best = json.loads((d / "best.json").read_text())
    (d / "best.json").write_text(json.dumps({**best, "version": 25}))
    msg = _fails([str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--no-score"], capsys)
    assert "θ_25 not scored at mean@4" in msg


def test_a_run_never_validated_is_refused(tmp_path, capsys):
    d = make_run(tmp_path / "runs", "sync0", "sync", 0, 20, [0.1, 0.3])
    (d / "best.json").unlink()
    assert "no best.json" in _fails([str(tmp_path / "runs"), "--out", str(tmp_path / "out")], capsys)


def test_from_wandb_the_scores_come_from_each_runs_summary(tmp_path):
    """Online runs: eval.py wrote `eval/<bench>/mean@k` and `eval/version` into each run's summary;
    the validation's keys there (`val/...`) are not read, an eval job's own run is skipped, and a
    score of another version than the selection's does not count."""
    from types import SimpleNamespace

    def run(rid, pool, version, scored_version, scores, job_type="train"):
        cfg = {"seed": {"value": 0}, "pool": {"value": {"name": pool}}, "algo": {"value": {"name": "dapo"}},
               "eval": {"value": {"k": 32, "val_k": 4, "best_within": 300}}, "rollout": {"value": {"max_tool_calls": 0}}}
        summary = {"best": {"version": version, "val/avg": 0.9, "path": "/gone"}, "eval/version": scored_version,
                   **{f"eval/{n}/mean@32": v for n, v in scores.items()}, "val/aime_2024/mean@4": 0.9, "val/avg": 0.9}
        return SimpleNamespace(id=rid, name=rid, config=cfg, summary=summary, job_type=job_type)

    runs = [run("a", "sync", 20, 20, {"aime_2024": 0.1, "avg": 0.1}), run("b", "pace", 30, 30, {"aime_2024": 0.3, "avg": 0.3}),
            run("e", "pace", 30, 30, {"aime_2024": 0.7, "avg": 0.7}, job_type="eval"),
            run("c", "async", 40, 10, {"aime_2024": 0.5, "avg": 0.5})]
    api = SimpleNamespace(runs=lambda path, filters: runs)
    entries = table1.wandb_entries("pace", "g", api=api)
    assert [(e.name, e.scores) for e in entries] == [("a", {"aime_2024": 0.1, "avg": 0.1}), ("b", {"aime_2024": 0.3, "avg": 0.3}),
                                                     ("c", None)]
    table1.build(entries[:2], tmp_path)
    md = (tmp_path / "table1.md").read_text()
    assert "| Sync | 10.00 | 10.00 |" in md and "| PACE | 30.00 | 30.00 |" in md and "mean@32 (%) by eval.py" in md
    assert "(mean@4) with the best average within 300 updates" in md and "PACE: θ_30 (seed 0)" in md
    with pytest.raises(table1.SelectionError, match="wandb:pace/c: θ_40 has no eval.py score"):
        table1.score(entries, tmp_path, None, [])


def test_relative_paths_and_runs_of_the_same_name_in_two_sweeps(tmp_path, monkeypatch):
    """Run folders and --out given relative to the caller's directory reach eval.py (run from the
    repository) as the same folders; `0_seed=0` of two sweeps get their own eval.py directories
    and their own names in the table."""
    from types import SimpleNamespace

    a = make_run(tmp_path / "sweeps" / "sync", "0_seed=0", "sync", 0, 20, None)
    b = make_run(tmp_path / "sweeps" / "pace", "0_seed=0", "pace", 0, 30, None)
    calls = []

    def fake_eval(cmd, cwd, **kw):  # eval.py, as it resolves paths: against its own cwd
        args = dict(c.split("=", 1) for c in cmd[2:] if "=" in c)
        run, hydra_dir = (Path(cwd) / args[key].strip("'") for key in ("model.path", "hydra.run.dir"))
        calls.append((run, hydra_dir))
        version = json.loads((run / "best.json").read_text())["version"]
        (run / "eval").mkdir()
        (run / "eval" / "mean@4.json").write_text(json.dumps({"selected": {"version": version}, "mean@4": {
            "arith_l1": version / 100, "arith_l2": version / 100, "avg": version / 100}}))
        return SimpleNamespace(returncode=0, stderr="")

    monkeypatch.setattr(table1.subprocess, "run", fake_eval)
    monkeypatch.chdir(tmp_path)
    table1.main(["sweeps", "--out", "out"])
    assert sorted(run for run, _ in calls) == [b, a]
    assert len({h for _, h in calls}) == 2 and all(h.is_relative_to(tmp_path / "out") for _, h in calls)
    csv = (tmp_path / "out" / "table1.csv").read_text()
    assert "sync/0_seed=0:20" in csv and "pace/0_seed=0:30" in csv
