"""Rebuild every figure and table (and optionally the report) for a set of runs.

    python -m analysis.build runs/tiny_study --out reports/tiny --report     # local records
    python -m analysis.build runs/tiny_study --source wandb-offline --out /tmp/x  # offline wandb runs only
    python -m analysis.build --project pace --group pace_tiny-2026-11-30 --out reports/sweep   # online wandb
    python -m analysis.build wandb:me/pace/abc123 wandb:me/pace/def456 --out reports/two
    python -m analysis.build reports/tiny/runs --out /tmp/r --report --previous reports/tiny/runs/previous_numbers.json

Writes into --out, as PNG and PDF: validation (Figure 1), stalek (Figure 3), benchmarks (Figure 5),
pace_staleness (Figure 6, --window updates), consumed_staleness (Figure 7), pool_over_time
(occupancy and PACE's rejections per step), walltime (Figure 8), large_model (Figure 9),
appendix_b and appendix_c1 (`FIGURES`); val_best.{md,tex} (per method, the in-training validation,
mean@k of the validation, of the version each run selected (best.json; with --within, its best
within --within updates instead): what selects Table 1's checkpoints, not Table 1, which is eval.py's score of them: python -m analysis.table1), numbers.json (every
number the figures, table and claims use) and, with --report, report.md (with
--previous, an earlier numbers.json, also how each verdict moved). A run folder's runs.tsv
(scripts/reproduce_tiny.sh) names runs not measured alone, which claim (e) leaves
out. A figure whose runs are absent is skipped and says so.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis import figures, trajectories  # noqa: E402
from analysis.claims import evaluate_claims, interval, learning_score  # noqa: E402
from analysis.runs import SOURCES, Run, load, load_group  # noqa: E402

# file name → (the paper's figure, function); tests/unit/test_figures.py checks each one's panels
FIGURES = {
    "validation": ("Figure 1", figures.validation_curves),
    "stalek": ("Figure 3", figures.stalek_curves),
    "benchmarks": ("Figure 5", trajectories.benchmark_curves),
    "pace_staleness": ("Figure 6", figures.pace_retained_vs_rejected),
    "consumed_staleness": ("Figure 7", figures.consumed_staleness),
    "pool_over_time": ("the pool over time", figures.pool_over_time),
    "walltime": ("Figure 8", figures.walltime_breakdown),
    "large_model": ("Figure 9", trajectories.large_model),
    "appendix_b": ("Appendix B", trajectories.all_trajectories),
    "appendix_c1": ("Appendix C.1", trajectories.small_model),
}

PICK_THEIR_MODEL = ("large_model", "appendix_c1")  # the others draw the runs of `trajectories.main_model`


def draw(name: str, runs: list[Run], window: int | None = 50, window_start: int | None = None, first: int | None = 300):
    """One figure of `FIGURES` with the build's options (Figure 6's window, Figure 5's first steps)."""
    fn = FIGURES[name][1]
    if name not in PICK_THEIR_MODEL:
        runs = trajectories.main_model(runs)
    options = {"pace_staleness": {"window": window, "start": window_start}, "benchmarks": {"first": first}}
    return fn(runs, **options.get(name, {}))


def incomparable_runs(specs: list[str]) -> frozenset[str]:
    """Runs whose wall time was not measured alone: "comparable" = no in the runs.tsv that
    scripts/reproduce_tiny.sh keeps in a study folder (the last line of a run made twice counts)."""
    latest = {}
    for spec in specs:
        tsv = Path(spec) / "runs.tsv"
        if not tsv.is_file():
            continue
        lines = tsv.read_text().splitlines()
        head = lines[0].split("\t") if lines else []
        if "run" not in head or "comparable" not in head:
            continue
        i, j = head.index("run"), head.index("comparable")
        for line in lines[1:]:
            cells = line.split("\t")
            if len(cells) > max(i, j):
                latest[cells[i]] = cells[j]
    return frozenset(name for name, ok in latest.items() if ok == "no")


def previous_verdicts(path: Path) -> dict:
    """What an earlier numbers.json decided (for the report's "how the verdicts moved")."""
    prev = json.loads(Path(path).read_text())
    claims = {k: {"verdict": c["verdict"] if c.get("tested") else "not tested", "interval": c.get("interval")}
              for k, c in prev.get("claims", {}).items()}
    return {"file": str(path), "runs": len(prev.get("runs", [])),
            "seeds": sorted({r["seed"] for r in prev.get("runs", [])}), "claims": claims}


def build(runs: list[Run], out: Path, within: int | None = None, report: bool = False, title: str = "",
          incomparable: frozenset[str] = frozenset(), previous: Path | None = None, window: int | None = 50,
          window_start: int | None = None, first: int | None = 300) -> dict:
    from pace.evaluation import latex_table, markdown_table

    out.mkdir(parents=True, exist_ok=True)
    made, skipped = [], []
    for name in FIGURES:
        fig = draw(name, runs, window, window_start, first)
        if fig is None:
            skipped.append(name)
        else:
            figures.save(fig, out, name)
            made.append(name)
    table, k, where = val_best_table(runs, within)
    if table:
        (out / "val_best.md").write_text("In-training validation, best per run: " + markdown_table(table, k))
        (out / "val_best.tex").write_text("% In-training validation, best per run: " + latex_table(table, k).lstrip("% "))
    order = {label: i for i, label in enumerate(figures.by_label(runs))}
    runs = sorted(runs, key=lambda r: (order[r.label], r.seed, r.name))
    numbers = {
        "setup": setup_of(runs),
        "runs": [{"name": r.name, "source": r.source, "label": r.label, "seed": r.seed, "steps": len(r.steps),
                  "validations": len(r.val), "groups": len(r.groups),
                  "validation_versions": [int(v) for v in r.val["version"]] if not r.val.empty else [],
                  "validation_avg": [float(v) for v in r.val["val/avg"]] if not r.val.empty else [],
                  "learning_score": learning_score(r)[0],
                  "train_seconds": float(r.steps["time/step"].sum()) if not r.steps.empty else 0.0} for r in runs],
        "val_best": {"k": k, "within": within, "table": table, "best": where,
                      "avg_interval": {label: interval([b["avg"] for b in rows]) for label, rows in where.items()}},
        "seconds_per_step": figures.phase_means(runs),
        "val_noise": val_noise(runs),
        "kv": kv_staleness(runs),
        "claims": evaluate_claims(runs, incomparable),
        "incomparable": sorted(incomparable & {r.name for r in runs}),
        "figures": made, "skipped": skipped,
    }
    if previous is not None:
        numbers["previous"] = previous_verdicts(previous)
    (out / "numbers.json").write_text(json.dumps(numbers, indent=1, sort_keys=True, default=float))
    if report:
        from analysis.report import write_report

        write_report(out, numbers, title)
    return numbers


def best_validation(run: Run, within: int | None):
    """The validation row of the run's selected version: its summary's `best` (best.json: what Table 1
    scores) when ``within`` is None, else, and for a run with no summary, the highest average among
    versions ≤ ``within`` (None: the run's `eval.best_within`), earliest on ties."""
    val = run.val
    if val.empty:
        return None
    if within is None:
        chosen = (run.summary.get("best") or {}).get("version")
        rows = val[val["version"] == chosen] if chosen is not None else val.iloc[:0]
        if not rows.empty:
            return rows.iloc[0]
        within = (run.config.get("eval") or {}).get("best_within")
    if within is not None:
        val = val[val["version"] <= within]
    if val.empty:
        return None
    return val.loc[val["val/avg"].idxmax()]


def val_best_table(runs: list[Run], within: int | None = None) -> tuple[dict[str, dict[str, float]], str, dict]:
    """Per method, the in-training validation (mean@k of `eval.val_k` samples, on the validation's
    problems) at each run's selected version (``within`` None; else its best validation within
    ``within`` updates: `best_validation`), averaged over seeds; k; and
    per method the versions and seeds. Not Table 1 (eval.py's scores of those versions:
    analysis/table1.py)."""
    import numpy as np

    table, where, k = {}, {}, "k"
    for label, rs in figures.by_label(runs).items():
        rows = [(r, best_validation(r, within)) for r in rs]
        rows = [(r, b) for r, b in rows if b is not None]
        if not rows:
            continue
        # sorted names: arith_l1…l4, and the six math benchmarks in Table 1's order
        cols = sorted(c for c in rows[0][1].index if c.startswith("val/") and "/mean@" in c)
        k = cols[0].rsplit("@", 1)[1] if cols else k
        scores = {c.split("/")[1]: float(np.mean([b[c] for _, b in rows])) for c in cols}
        scores["avg"] = float(np.mean([b["val/avg"] for _, b in rows]))
        table[label] = scores
        where[label] = [{"run": r.name, "seed": r.seed, "version": int(b["version"]), "avg": float(b["val/avg"])}
                        for r, b in rows]
    return table, k, where


def val_noise(runs: list[Run]) -> dict | None:
    """Spread of the validation average of θ_0 (the same weights in every run) over seeds: the noise
    floor of one validation. The engine's sampling follows the run's seed, so runs of one seed
    validate θ_0 alike (0.350-0.351 over 12 methods of seed 0): one run per seed counts."""
    import numpy as np

    first = {}  # one run per seed: runs of one seed sample θ_0's validation alike, so they show no noise
    for r in runs:
        if not r.val.empty and int(r.val["version"].iloc[0]) == 0:
            first.setdefault(r.seed, float(r.val["val/avg"].iloc[0]))
    v0 = list(first.values())
    if len(v0) < 2:
        return None
    return {"runs": len(v0), "min": min(v0), "max": max(v0), "std": float(np.std(v0, ddof=1))}


def kv_staleness(runs: list[Run]) -> dict:
    """Per method (means over its runs), what the KV cache's staleness cost: the consumed groups' K_gen
    and K_kv (groups column `k_kv`), the KV probe's tokens per step and its error per token
    (`claims.stale_context_error`), the tokens re-prefilled per step; {} when no run logged any of it."""
    from analysis.claims import KV_TOKENS, REPREFILL, stale_context_error

    def consumed(r: Run, col: str):
        g = r.groups
        return float(g.loc[g.fate == "consumed", col].mean()) if not g.empty and col in g and "fate" in g else None

    def per_step(r: Run, key: str):
        return float(r.steps[key].fillna(0).mean()) if key in r.steps else None

    def mean(xs) -> float | None:
        xs = [x for x in xs if x is not None and x == x]
        return sum(xs) / len(xs) if xs else None

    fns = {"k_gen": lambda r: consumed(r, "k_gen"), "k_kv": lambda r: consumed(r, "k_kv"),
           "kv_tokens_per_step": lambda r: per_step(r, KV_TOKENS), "kv_error": stale_context_error,
           "reprefill_tokens_per_step": lambda r: per_step(r, REPREFILL)}
    out = {label: {k: mean(fn(r) for r in rs) for k, fn in fns.items()} for label, rs in figures.by_label(runs).items()}
    logged = any(v is not None for row in out.values() for k, v in row.items() if k != "k_gen")
    return {label: {**row, "runs": len(figures.by_label(runs)[label])} for label, row in out.items()} if logged else {}


def setup_of(runs: list[Run]) -> dict:
    """The settings the runs share (from the first run's config; `varies` lists those that differ)."""
    keys = {"model": "model.path", "data": "data.source", "B": "data.batch_prompts", "G": "data.group_size",
            "max_tokens": "rollout.max_tokens", "lr": "trainer.lr", "eval_k": "eval.k", "eval_every": "eval.every",
            "eval_problems": "eval.val_max_problems", "eval_sets": "eval.benchmarks",
            "kv_on_update": "rollout.kv_on_update", "kv_probe": "rollout.kv_probe"}

    def get(cfg: dict, dotted: str):
        for part in dotted.split("."):
            cfg = cfg.get(part, {}) if isinstance(cfg, dict) else {}
        return None if cfg == {} else cfg

    out = {name: get(runs[0].config, key) for name, key in keys.items()}
    out["steps"] = max(len(r.steps) for r in runs)
    out["varies"] = [name for name, key in keys.items() if any(get(r.config, key) != out[name] for r in runs)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*", help="run directories / sweep folders, or wandb:<entity>/<project>/<id>")
    ap.add_argument("--source", choices=SOURCES[:2], default="local", help="for directories: local records or their offline wandb runs")
    ap.add_argument("--project", help="online wandb project (with --group)")
    ap.add_argument("--entity")
    ap.add_argument("--group", help="every run of this wandb group")
    ap.add_argument("--within", type=int, help="val_best: best validation among versions <= N (default: each run's selection, best.json)")
    ap.add_argument("--window", type=int, default=50, help="Figure 6: training updates drawn (0: all; default 50)")
    ap.add_argument("--window-start", type=int, help="Figure 6: first step of the window (default: the last --window steps)")
    ap.add_argument("--first", type=int, default=300, help="Figure 5: validations of the first N steps (0: all; default 300)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--report", action="store_true", help="also write report.md")
    ap.add_argument("--title", default="")
    ap.add_argument("--previous", type=Path, help="an earlier numbers.json: the report says how each verdict moved")
    ap.add_argument("--include-unfinished", action="store_true",
                    help="also use runs that are still going, were interrupted or failed (summary status)")
    args = ap.parse_args()
    if not args.specs and not args.group:
        ap.error("give run directories / wandb:… specs, or --project and --group")
    try:
        runs = [r for spec in args.specs for r in load(spec, args.source)]
        if args.group:
            if not args.project:
                ap.error("--group needs --project")
            runs += load_group(args.project, args.group, args.entity)
    except (FileNotFoundError, ValueError) as exc:
        sys.exit(f"error: {exc}")
    if not args.include_unfinished:
        unfinished = [r.name for r in runs if r.summary.get("status") != "finished"]
        runs = [r for r in runs if r.summary.get("status") == "finished"]
        if unfinished:
            print(f"left out (not finished; --include-unfinished keeps them): {', '.join(unfinished)}", file=sys.stderr)
    if not runs:
        sys.exit("error: no runs found")
    if args.previous is not None and not args.previous.is_file():
        sys.exit(f"error: --previous {args.previous}: no such file")
    numbers = build(runs, args.out, args.within, args.report, args.title, incomparable_runs(args.specs), args.previous,
                    args.window or None, args.window_start, args.first or None)
    print(f"{len(runs)} runs ({', '.join(sorted({r.label for r in runs}))}) → {args.out}")
    print(f"figures: {', '.join(numbers['figures']) or 'none'}"
          + (f"; skipped (no runs for them): {', '.join(numbers['skipped'])}" if numbers["skipped"] else ""))


if __name__ == "__main__":
    main()
