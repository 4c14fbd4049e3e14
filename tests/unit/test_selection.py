"""A run's selection as Table 1 reads it: best.json checked against the weights best/ says it
holds, and the run's wandb run."""
from __future__ import annotations

import json

import pytest

from pace import selection
from tests.helpers import compose_cfg


def _run(tmp_path, version: int, holds: int | None):
    d = tmp_path / "run"
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "config.yaml").write_text("eval: {k: 4, val_k: 2, best_within: 300}\n")
    (d / "best.json").write_text(json.dumps({"version": version, "val/avg": 0.5, "path": str(d / "best")}))
    (d / "best").mkdir()
    (d / "best" / "config.json").write_text("{}")
    if holds is not None:
        (d / "best" / "version.json").write_text(json.dumps({"version": holds}))
    return d


def test_the_selection_refuses_weights_of_another_version(tmp_path):
    """A run killed between best/'s rename and best.json's write (and never resumed): best/ holds
    θ_30, best.json names θ_10. Scoring best/ as θ_10 would be a wrong Table 1 row."""
    d = _run(tmp_path, version=10, holds=30)
    with pytest.raises(selection.SelectionError, match=r"best.json names θ_10 but .*best holds θ_30"):
        selection.selection(d, selection.run_config(d))
    d.joinpath("best", "version.json").write_text(json.dumps({"version": 10}))
    assert selection.selection(d, selection.run_config(d))["version"] == 10


def test_a_best_directory_from_before_version_json_is_taken_at_its_word(tmp_path):
    d = _run(tmp_path, version=10, holds=None)
    assert selection.selection(d, selection.run_config(d))["path"] == str(d / "best")


def test_the_wandb_run_is_the_one_summary_json_names_else_the_newest_folder(tmp_path):
    d = tmp_path / "run"
    (d / "wandb" / "run-20250101_000000-older").mkdir(parents=True)
    (d / "wandb" / "offline-run-20260101_000000-newer").mkdir()
    assert selection.wandb_run(d) == {"id": "newer", "mode": "offline"}  # by time, not by name
    (d / "summary.json").write_text(json.dumps({"status": "done", "wandb": {"id": "named", "mode": "online"}}))
    assert selection.wandb_run(d) == {"id": "named", "mode": "online"}
    assert selection.wandb_run(tmp_path / "none") is None


def test_the_logger_names_its_wandb_run_in_summary_json(tmp_path, monkeypatch):
    """An offline run: summary.json names the wandb run the run's folder holds, so eval.py's scores
    go to a run of their own (not resumed by id on a server that never saw it)."""
    from pace.logger import RunLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = compose_cfg(["logger.mode=offline"])
    logger = RunLogger(cfg, tmp_path, {}, group="g")
    logger.close([], {"status": "finished"})
    named = json.loads((tmp_path / "summary.json").read_text())["wandb"]
    folder = next((tmp_path / "wandb").glob("offline-run-*"))
    assert named == {"id": folder.name.rsplit("-", 1)[1], "mode": "offline"} == selection.wandb_run(tmp_path)
