"""Runs as analysis reads them, from any of three sources that hold the same records (docs/design.md §6).

    local         a run directory: metrics.jsonl, groups/part-*.parquet, summary.json, .hydra/config.yaml
    wandb-offline an offline wandb run inside the run directory (wandb/offline-run-*/): its
                  transaction log (history, summary, config) and its files (groups/part-*.parquet)
    wandb         an online run through the wandb API (`wandb:<entity>/<project>/<run id>`, or every
                  run of a group with `load_group`)

Every source yields the same `Run`: one row per training step, one row per validation, one row
per group, the summary and the resolved config; `label` names the method from the config alone.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

SOURCES = ("local", "wandb-offline", "wandb")


class Labelled:
    """What a run's config names: its method (`method_label`) and seed. Needs a ``config`` dict."""

    config: dict

    @property
    def label(self) -> str:
        return method_label(self.config)

    @property
    def seed(self) -> int:
        return int(self.config.get("seed", 0))


@dataclass
class Run(Labelled):
    name: str  # run directory name or wandb run id
    source: str
    config: dict  # the resolved run config (nested, as train.py saw it)
    steps: pd.DataFrame  # one row per training step, indexed 0..n-1; `wall` = cumulative time/step
    val: pd.DataFrame  # one row per validation: version, wall (when θ_version existed), val/*
    groups: pd.DataFrame  # one row per group (docs/design.md §6)
    summary: dict

    @property
    def dir(self) -> str:  # kept for scripts written against the first version
        return self.name


def method_label(cfg: dict) -> str:
    """The method's name in figures and tables, from the config: Sync, Async, Stale-4, PACE γ=2, …;
    " (recompute)" after it for a run with `rollout.kv_on_update=recompute` (without the key: keep)."""
    kv = (cfg.get("rollout") or {}).get("kv_on_update", "keep")
    return _method(cfg) + (" (recompute)" if kv == "recompute" else "")


def _method(cfg: dict) -> str:
    pool, algo, pace = cfg.get("pool", {}), cfg.get("algo", {}), cfg.get("pace", {})
    if algo.get("name") == "m2po":
        return "M2PO" if algo.get("m2po_variant", "paper") == "paper" else "M2PO (adaptive clip)"
    label = _base_label(pool, algo, pace)
    kind = algo.get("is_correction", "none")
    if kind == "none":
        return label
    level = algo.get("is_level", "token")
    return f"{label} + {kind.upper()}" + ("" if level == "token" else f" ({level})")


def _base_label(pool: dict, algo: dict, pace: dict) -> str:
    name = pool.get("name", "async")
    if name == "sync":
        return "Sync"
    if name == "async":
        return "Async" if algo.get("ratio_ref", "behavior") == "behavior" else "Async (proximal)"
    if name == "stale_k":
        return f"Stale-{pool.get('max_lag', 4):g}"
    if name == "gate":
        return f"Gate η={pool.get('max_head_offpolicyness')}"
    score = pace.get("score", "effective")
    label = "PACE" + {"effective": "", "raw": " (raw)", "generation": " (gen)"}[score]
    label += " (KV-aware)" if pace.get("kv_aware") else ""  # ranked by K_kv in K_gen's place
    gamma = float(pace.get("gamma", 1.0))
    return label if gamma == 1.0 or score != "effective" else f"{label} γ={gamma:g}"


# ---------------------------------------------------------------- one shape for every source


def from_records(name: str, source: str, rows: list[dict], groups: pd.DataFrame, summary: dict, config: dict) -> Run:
    """A `Run` from logged step rows (metrics.jsonl or wandb history: the same keys)."""
    # a training step's row has its time (a simulated run, pace/sim, has no loss); validations' rows do not
    steps = pd.DataFrame([r for r in rows if "time/step" in r])
    if not steps.empty:
        steps = steps.sort_values("step" if "step" in steps else "_step").reset_index(drop=True)
        steps["wall"] = steps["time/step"].cumsum()
    val = pd.DataFrame([r for r in rows if "val/avg" in r])
    if not val.empty:
        val = val.sort_values("val/version").reset_index(drop=True)
        # θ_v exists once v training steps are done: its wall time is the time of steps 0 … v-1
        walls = [0.0, *steps["wall"].tolist()] if not steps.empty else [0.0]
        val["wall"] = [walls[min(int(v), len(walls) - 1)] for v in val["val/version"]]
        val["version"] = val["val/version"].astype(int)
    return Run(name, source, config, steps, val, groups, summary)


def _parquet_dir(d: Path) -> pd.DataFrame:
    parts = sorted(d.glob("part-*.parquet"))
    return pd.concat([pd.read_parquet(p) for p in parts], ignore_index=True) if parts else pd.DataFrame()


def load_local(run_dir: str | Path) -> Run:
    d = Path(run_dir)
    if not (d / "metrics.jsonl").exists():
        raise FileNotFoundError(f"{d}: not a run directory (no metrics.jsonl)")
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else {}
    return from_records(d.name, "local", rows, _parquet_dir(d / "groups"), summary, _hydra_config(d))


def _hydra_config(d: Path) -> dict:
    from pace.selection import run_config

    return run_config(d) if (d / ".hydra" / "config.yaml").exists() else {}


def _unwrap_wandb_config(config: dict) -> dict:
    """wandb stores each top-level key as {"value": …}; `_wandb` is its own bookkeeping."""
    return {k: (v["value"] if isinstance(v, dict) and set(v) <= {"value", "desc"} and "value" in v else v)
            for k, v in config.items() if k != "_wandb"}


def load_wandb_offline(path: str | Path) -> Run:
    """A run directory's offline wandb run (or an ``offline-run-*`` directory itself)."""
    from analysis.wandb_log import read_run

    path = Path(path)
    runs = [path] if path.name.startswith(("offline-run-", "run-")) else sorted((path / "wandb").glob("offline-run-*"))
    if not runs:
        raise FileNotFoundError(f"{path}: no offline wandb run (wandb/offline-run-*)")
    run_dir = runs[-1]
    log = read_run(run_dir)
    rows = [{**h, "step": h.get("_step")} for h in log.history]
    groups = _parquet_dir(run_dir / "files" / "groups")
    summary = {k: v for k, v in log.summary.items() if not k.startswith("_")}
    name = path.name if not path.name.startswith("offline-run-") else log.id
    return from_records(name, "wandb-offline", rows, groups, summary, _unwrap_wandb_config(log.config))


def load_wandb(path: str, api=None) -> Run:
    """An online run, ``<entity>/<project>/<run id>``: history, summary, config and the group records
    (the run's ``groups/`` files, downloaded to wandb's cache)."""
    import tempfile

    import wandb

    api = api or wandb.Api()
    run = api.run(path)
    rows = [{**r, "step": r.get("_step")} for r in run.scan_history()]
    with tempfile.TemporaryDirectory() as tmp:
        for f in run.files():
            if f.name.startswith("groups/") and f.name.endswith(".parquet"):
                f.download(root=tmp, replace=True)
        groups = _parquet_dir(Path(tmp) / "groups")
    summary = {k: v for k, v in dict(run.summary).items() if not k.startswith("_")}
    return from_records(run.id, "wandb", rows, groups, summary, _unwrap_wandb_config(dict(run.config)))


def load_group(project: str, group: str, entity: str | None = None, api=None) -> list[Run]:
    """Every run of a wandb group (a Hydra multirun shares one)."""
    import wandb

    api = api or wandb.Api()
    prefix = f"{entity}/{project}" if entity else project
    return [load_wandb(f"{prefix}/{r.id}", api) for r in api.runs(prefix, filters={"group": group})]


def find_run_dirs(root: str | Path) -> list[Path]:
    """Run directories under ``root`` (itself, or any depth below, e.g. a multirun sweep): those with
    local records or an offline wandb run."""
    root = Path(root)
    found = {p.parent for p in root.rglob("metrics.jsonl")}
    found |= {p.parent.parent for p in root.rglob("offline-run-*") if p.parent.name == "wandb"}
    if root in found:
        return [root]
    return sorted(found)


def load(spec: str, source: str = "local") -> list[Run]:
    """Runs from a spec: ``wandb:<entity>/<project>/<id>``, or a directory holding run directories
    read from ``source`` (`local` records or their `wandb-offline` copies)."""
    if spec.startswith("wandb:"):
        return [load_wandb(spec.removeprefix("wandb:"))]
    dirs = find_run_dirs(spec)
    if not dirs:
        raise FileNotFoundError(f"{spec}: no run directories (no metrics.jsonl below it)")
    loader = {"local": load_local, "wandb-offline": load_wandb_offline}[source]
    return [loader(d) for d in dirs]


def load_run(run_dir: str | Path) -> Run:
    """One local run directory (summarize_run.py)."""
    return load_local(run_dir)


def recomputed_kv(row) -> float | None:
    """K_kv of a logged group recomputed from its per-response records (version spans, request
    starts, c(τ), kv_reprefill), or None for a run logged before them."""
    import numpy as np

    from pace.staleness import group_kv_staleness, kv_versions

    starts, reprefill = row.get("request_starts"), row.get("kv_reprefill")
    if not hasattr(starts, "__len__") or reprefill is None or reprefill != reprefill:  # absent, or NaN in a mixed table
        return None
    kv = [kv_versions(np.repeat(spans[0::2], spans[1::2]), starts, bool(row["kv_reprefill"]))
          for spans, starts in zip(row["version_spans"], row["request_starts"])]
    return group_kv_staleness(kv, row["completed_at"])


def recomputed_staleness(row) -> tuple[float, float, float]:
    """(K, K_gen, K_wait) of a logged group recomputed from its per-response records alone (the
    version spans of its model tokens, each response's c(τ), the step its fate was decided): an
    independent check of the logged `k`, `k_gen`, `k_wait` (docs/design.md §2, token-weighted)."""
    tokens = version_sum = completed = 0
    for spans, c in zip(row["version_spans"], row["completed_at"]):
        vs, ns = spans[0::2], spans[1::2]
        n = sum(ns)
        tokens += n
        version_sum += sum(v * k for v, k in zip(vs, ns))
        completed += c * n
    j = row["step"]
    return (j * tokens - version_sum) / tokens, (completed - version_sum) / tokens, j - completed / tokens
