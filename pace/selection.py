"""Table 1's selection of a run: its best validated version, that version's weights, and eval.py's score.

    <run>/best.json            {"version", "val/avg", "path"}: the in-training validation (mean@`eval.val_k`,
                               else `eval.k`) with the highest average among versions ≤ `eval.best_within`
                               (pace/validation.py); `path` holds its weights (`<run>/best`, or the
                               model on disk for θ_0)
    <run>/eval/mean@<k>.json   eval.py's score of that checkpoint (`python eval.py model.path=<run>`),
                               with the version it scored and the selection it came from

The paper: "mean@32 for all six benchmarks … at the evaluation with the highest six-benchmark
average within 300 updates". Its "evaluation" is the in-training validation here; the score is
eval.py's, with the run's own prompts, templates, sets and token budget.
"""
from __future__ import annotations

import json
from pathlib import Path


class SelectionError(Exception):
    """A run with no selection, or a selected version without its weights: one line naming both."""


def run_dir_named(path: str | Path | None) -> Path | None:
    """The run directory ``path`` names (`<run>` or `<run>/best`: a directory with best.json), else None."""
    if path is None:
        return None
    p = Path(str(path)).expanduser()
    for d in (p, p.parent):
        if (d / "best.json").is_file() and (d / ".hydra" / "config.yaml").is_file():
            return d
    return None


def val_k(cfg: dict) -> int:
    """The k of the in-training validation that selects (`eval.val_k`, else `eval.k`)."""
    ev = cfg.get("eval", {})
    return int(ev.get("val_k") or ev.get("k"))


def selection(run_dir: Path, cfg: dict) -> dict:
    """best.json with the selection's k and window; fails in one line if the version's weights are absent."""
    run_dir = Path(run_dir)
    path = run_dir / "best.json"
    if not path.is_file():
        raise SelectionError(f"{run_dir}: no best.json (no in-training validation: eval.every=0, or the run stopped before one)")
    best = json.loads(path.read_text())
    # θ_v (v > 0) is <run>/best wherever the run folder is now (best.json's `path` is where it was
    # written: the folder may have moved since); θ_0 is the model the run started from
    where = str(run_dir / "best") if best["version"] != 0 else best.get("path")
    if where is None or not (Path(where) / "config.json").is_file():
        raise SelectionError(f"{run_dir}: the selected version θ_{best['version']} has no checkpoint ({where} is not a model directory)")
    if best["version"] != 0:
        from pace.checkpoint import saved_version

        holds = saved_version(where)  # None: written before best/ named its version
        if holds is not None and holds != best["version"]:  # stopped between the two writes, never resumed
            raise SelectionError(f"{run_dir}: best.json names θ_{best['version']} but {where} holds θ_{holds} "
                                 "(the run stopped while replacing its best): resume it, or score another run")
    return {**best, "path": where, "val_k": val_k(cfg), "best_within": cfg.get("eval", {}).get("best_within")}


def result_path(run_dir: Path, k: int) -> Path:
    return Path(run_dir) / "eval" / f"mean@{k}.json"


def run_config(run_dir: Path) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(Path(run_dir) / ".hydra" / "config.yaml"), resolve=True)


def wandb_run(run_dir: Path) -> dict | None:
    """The run's wandb run, {"id", "mode"} (online, offline), if it logged to wandb: as summary.json
    records it (`RunLogger.close`), else (a run that did not finish) its newest wandb folder,
    `[offline-]run-<time>-<id>`."""
    run_dir = Path(run_dir)
    try:
        named = json.loads((run_dir / "summary.json").read_text()).get("wandb")
    except (OSError, ValueError):
        named = None
    if named:
        return named
    found = [(d.name.removeprefix("offline-"), d.name) for d in (run_dir / "wandb").glob("*run-*-*") if d.is_dir()]
    if not found:
        return None
    _, name = max(found)  # by time: `run-<YYYYmmdd_HHMMSS>-<id>` once the offline- prefix is set apart
    return {"id": name.rsplit("-", 1)[1], "mode": "offline" if name.startswith("offline-") else "online"}
