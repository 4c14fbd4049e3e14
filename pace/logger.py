"""Run logging in one place: wandb (online/offline/disabled) plus a local run directory.

Local layout (read by `analysis/`; names are the API of docs/design.md §6):
    metrics.jsonl            one JSON object per training step (validations: `val/*` in the step's
                             row; the final weights' in rows after the last step)
    groups/part-NNNNN.parquet one row per group whose fate was decided (and, at the end, the rest)
    summary.json             fate counts and final numbers (and the best validated checkpoint)
wandb gets the same step metrics, the summary, and the per-group parts both as an artifact and
as run files (`groups/part-*.parquet`, inside an offline run's directory).
"""
from __future__ import annotations

import json
import math
import netrc
import os
import sys
from pathlib import Path

from pace.records import Fate, Group
from pace.staleness import version_spans


def group_schema():
    """Column types of the per-group Parquet parts, fixed so that every part has the same schema
    (a part where a column happens to be all-null must not be typed `null`, or the parts of one
    run could not be read together)."""
    import pyarrow as pa

    i, f, s = pa.int64(), pa.float64(), pa.string()
    return pa.schema([
        ("id", i), ("prompt_id", s), ("fate", s), ("reason", s), ("step", i), ("submitted_at", i),
        ("c", i), ("k", f), ("k_gen", f), ("k_kv", f), ("k_wait", f), ("pfs", f), ("u", f), ("s_eff", f),
        ("score", f), ("rho", f), ("budget", i), ("pfs_version", i), ("reward_mean", f),
        ("reward_std", f), ("acc_mean", f), ("len_mean", f), ("len_max", i),
        ("lengths", pa.list_(i)), ("num_tokens", i), ("versions_spanned", i),
        ("num_actions", i), ("tool_calls", pa.list_(i)), ("tool_errors", i),
        ("completed_at", pa.list_(i)), ("version_spans", pa.list_(pa.list_(i))), ("resumed_tokens", pa.list_(i)),
        ("engine", pa.list_(i)),
        ("request_starts", pa.list_(pa.list_(i))), ("kv_reprefill", pa.bool_()),
    ])


def group_row(group: Group) -> dict:
    """One per-group record (docs/design.md §6). Staleness is taken at the step the fate was decided."""
    trajs = [t for t in group.trajectories if len(t) > 0]
    spans = [version_spans(t.action_versions) for t in trajs]  # [v, n, v, n, …]; versions only go up
    row = {
        "id": group.id,
        "prompt_id": group.prompt_id,
        "fate": group.fate.value,
        "reason": group.reason,
        "step": group.step,
        "submitted_at": group.submitted_at,
        "c": None, "k": None, "k_gen": None, "k_kv": None, "k_wait": None,
        "pfs": group.pfs,
        "u": group.scores.get("u"),
        "s_eff": group.scores.get("s_eff"),
        "score": group.scores.get("score"),
        "rho": group.scores.get("rho"),  # PACE: the step's rejection rate and budget (rejected groups)
        "budget": group.scores.get("budget"),
        "pfs_version": group.pfs_version,
        "reward_mean": None, "reward_std": None, "acc_mean": None,
        "len_mean": None, "len_max": None, "lengths": [len(t) for t in trajs],
        "num_tokens": sum(len(t) for t in trajs),
        "versions_spanned": None,
        # multi-turn tool use: model-generated tokens (num_tokens less tool output), calls per response
        "num_actions": sum(t.num_actions for t in trajs),
        "tool_calls": [t.tool_calls for t in trajs],
        "tool_errors": sum(t.tool_errors for t in trajs),
        # per response: c(τ), and the versions of its model tokens as [v, n, v, n, …] spans, from
        # which K, K_gen and K_wait can be recomputed independently of the logged values
        "completed_at": [t.completed_at for t in trajs],
        "version_spans": spans,
        # per response: tokens kept from a checkpoint and continued after a restart (0: generated in one go)
        "resumed_tokens": [t.resumed for t in trajs],
        # per response: the rollout engine that served all of it (−1: several, or unknown)
        "engine": [t.engine for t in trajs],
        # per response: where (in model tokens, as the spans count) a later engine request began (a
        # tool turn, a continuation), and whether every update re-prefilled the group's requests
        # (rollout.kv_on_update=recompute): with the spans, K_kv follows (pace/staleness.py)
        "request_starts": [t.action_starts for t in trajs],
        "kv_reprefill": group.kv_reprefill,
    }
    complete = len(trajs) == len(group.trajectories) and trajs and all(t.completed_at >= 0 for t in trajs)
    if complete:
        rewards = [t.reward for t in trajs]
        mean = sum(rewards) / len(rewards)
        row.update(
            c=group.completed_at,
            reward_mean=mean,
            reward_std=math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)),
            acc_mean=sum(t.correct for t in trajs) / len(trajs),
            len_mean=row["num_tokens"] / len(trajs),
            len_max=max(row["lengths"]),
            versions_spanned=max(s[-2] - s[0] + 1 for s in spans),  # first and last span's versions
        )
        if group.step is not None:
            row["k"], row["k_gen"], row["k_wait"] = group.staleness(group.step)
            row["k_kv"] = group.k_kv()  # KV staleness (≥ K_gen): the oldest weights in each token's context
    return row


def _count_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def resolve_wandb_mode(mode: str) -> str:
    """`online` without credentials becomes `offline` (never an interactive prompt)."""
    if mode != "online":
        return mode
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        rc = netrc.netrc()
        if any("wandb" in host for host in rc.hosts):
            return "online"
    except (FileNotFoundError, netrc.NetrcParseError):
        pass
    print("logger.mode=online but no wandb API key found: logging offline (sync later with `wandb sync`)", file=sys.stderr)
    return "offline"


class RunLogger:
    """``resume``: the `state_dict` of a checkpoint. The run directory is rewound to it (metrics
    rows and Parquet parts written after it are removed: the resumed run writes them again) and
    the same wandb run continues (wandb keeps rows it already has for a step)."""

    def __init__(self, cfg, run_dir: str | Path, config_dict: dict, group: str | None = None, resume: dict | None = None):
        self.dir = Path(run_dir)
        (self.dir / "groups").mkdir(parents=True, exist_ok=True)
        self.flush_every = cfg.logger.flush_every
        if resume is not None:
            self._rewind(resume)
        self._metrics = open(self.dir / "metrics.jsonl", "a")
        self._lines = resume["metrics_rows"] if resume is not None else _count_lines(self.dir / "metrics.jsonl")
        self._rows: list[dict] = []
        self._part = len(list((self.dir / "groups").glob("part-*.parquet")))
        self.mode = resolve_wandb_mode(cfg.logger.mode)
        self.run = None
        if self.mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            wandb_id = resume.get("wandb_id") if resume is not None else None
            self.run = wandb.init(
                id=wandb_id,
                resume="allow" if wandb_id else None,
                project=cfg.logger.project,
                group=group or cfg.logger.group,
                name=cfg.logger.name or cfg.exp_name,
                tags=list(cfg.logger.tags),
                config=config_dict,
                dir=str(self.dir),
                mode=self.mode,
                settings=wandb.Settings(console="off", init_timeout=120),
            )

    def state_dict(self) -> dict:
        """Where the records stand (call `flush` first, as a checkpoint does)."""
        return {"metrics_rows": self._lines, "parts": self._part, "wandb_id": None if self.run is None else self.run.id}

    def _rewind(self, state: dict) -> None:
        path = self.dir / "metrics.jsonl"
        if path.exists():
            lines = path.read_text().splitlines(keepends=True)
            path.write_text("".join(lines[: state["metrics_rows"]]))
        for part in (self.dir / "groups").glob("part-*.parquet"):
            if int(part.stem.split("-")[1]) >= state["parts"]:
                part.unlink()

    def log(self, step: int, metrics: dict) -> None:
        record = {"step": step, **metrics}
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()
        self._lines += 1
        if self.run is not None:
            self.run.log(metrics, step=step)

    def log_groups(self, groups: list[Group], step: int) -> None:
        self._rows.extend(group_row(g) for g in groups)
        if (step + 1) % self.flush_every == 0:
            self.flush()

    def flush(self) -> None:
        if not self._rows:
            return
        import pyarrow.parquet as pq

        path = self.dir / "groups" / f"part-{self._part:05d}.parquet"
        pq.write_table(self._table(), path)
        self._part += 1
        self._rows = []

    def _table(self):
        """The pending rows as one Parquet part (a subclass may keep other records: pace/sim/output.py)."""
        import pyarrow as pa

        return pa.Table.from_pylist(self._rows, schema=group_schema())

    def close(self, remaining: list[Group], summary: dict) -> None:
        """Log groups still pooled / in flight with those fates, write the summary, finish wandb."""
        self._rows.extend(group_row(g) for g in remaining if g.fate in (Fate.POOLED, Fate.INFLIGHT))
        self.flush()
        self._metrics.close()
        if self.run is not None:  # where eval.py puts its scores of this run (pace/selection.py)
            summary = {**summary, "wandb": {"id": self.run.id, "mode": self.mode}}
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2))
        if self.run is not None:
            import wandb

            self.run.summary.update(summary)
            # The per-group records also go into the run's own files (uploaded with the run, and
            # kept in an offline run's directory), so the wandb run alone rebuilds every figure.
            import shutil

            shutil.copytree(self.dir / "groups", Path(self.run.dir) / "groups", dirs_exist_ok=True)
            artifact = wandb.Artifact(f"groups-{self.run.id}", type="groups")
            artifact.add_dir(str(self.dir / "groups"))
            self.run.log_artifact(artifact)
            self.run.finish()
