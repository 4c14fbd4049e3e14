"""The trade-off of a sweep (simulated or real): seconds per step vs consumed staleness vs rejected share.

    python simulate.py -m +exp=pace_qwen3_8b +sim=qwen3_8b_fig8 pace.target_pool=32,64,128 rollout.engines=4,8,12 \
        hydra.sweep.dir=runs/sim_sweep/pace              # and +exp=async_qwen3_8b into runs/sim_sweep/async
    python -m analysis.tradeoff runs/sim_sweep --out reports/sim/sweep

One point per run: mean s/step and mean consumed K (= K_wait + K_gen, both drawn) after a warm-up,
coloured by the share of completed informative groups rejected (rejected / (consumed + rejected +
dropped_stale)); labelled by the run's own overrides that differ between the runs (what the sweep
varied). Writes tradeoff.md (the table), tradeoff.json and tradeoff.{png,pdf}.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from analysis.figures import save
from analysis.runs import find_run_dirs, load_local


def point(run_dir: Path, warmup: int) -> dict:
    run = load_local(run_dir)
    s = run.steps.iloc[warmup:] if len(run.steps) > warmup else run.steps
    fates = run.summary.get("fates", {})
    taken = fates.get("consumed", 0) + fates.get("rejected", 0) + fates.get("dropped_stale", 0)
    ov_path = run_dir / ".hydra" / "overrides.yaml"
    overrides = yaml.safe_load(ov_path.read_text()) if ov_path.exists() else []
    return {"run": run_dir.name, "label": run.label, "varied": " ".join(o for o in overrides if not o.startswith(("+", "hydra"))),
            "s_per_step": float(s["time/step"].mean()), "k": float(s["staleness/k_mean"].mean()),
            "k_wait": float(s["staleness/k_wait_mean"].mean()), "k_gen": float(s["staleness/k_gen_mean"].mean()),
            "rejected_share": (fates.get("rejected", 0) + fates.get("dropped_stale", 0)) / taken if taken else 0.0,
            "occupancy": float(s["pool/occupancy"].mean())}


def figure(points: list[dict]):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.8, 4.6))
    vmax = max(0.05, max(p["rejected_share"] for p in points))
    labels = sorted({p["label"] for p in points})
    for label, marker in zip(labels, "os^Dv<>P*X" * 10):  # one marker per method
        ps = [p for p in points if p["label"] == label]
        sc = ax.scatter([p["s_per_step"] for p in ps], [p["k"] for p in ps], c=[p["rejected_share"] for p in ps],
                        cmap="viridis", vmin=0, vmax=vmax, s=60, marker=marker, label=label, edgecolors="k", linewidths=0.4)
    for p in points:  # what the sweep varied, keys without their group (target_pool=16 engines=8)
        text = " ".join(o.split(".")[-1] for o in p["varied"].split())
        ax.annotate(text, (p["s_per_step"], p["k"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.legend(fontsize=7)
    ax.set_xlabel("seconds per training step")
    ax.set_ylabel("consumed policy lag K = K_wait + K_gen")
    fig.colorbar(sc, ax=ax, label="share of completed groups rejected")
    fig.tight_layout()
    return fig


def table(points: list[dict]) -> str:
    lines = ["| run | varied | s/step | K | K_wait | K_gen | rejected share | occupancy |", "| --- |" + " --- |" * 7]
    for p in points:
        lines.append(f"| {p['label']} | {p['varied']} | {p['s_per_step']:.2f} | {p['k']:.2f} | {p['k_wait']:.2f} | "
                     f"{p['k_gen']:.2f} | {p['rejected_share']:.3f} | {p['occupancy']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep", type=Path, help="a directory holding run directories (a Hydra multirun sweep)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the means")
    args = ap.parse_args()
    dirs = find_run_dirs(args.sweep)
    if not dirs:
        raise SystemExit(f"error: {args.sweep}: no run directories (no metrics.jsonl below it)")
    points = [point(d, args.warmup) for d in dirs]
    shared = set.intersection(*(set(p["varied"].split()) for p in points)) if len(points) > 1 else set()
    for p in points:  # label a point by what differs between the runs (not the sweep's fixed overrides)
        p["varied"] = " ".join(o for o in p["varied"].split() if o not in shared)
    points = sorted(points, key=lambda p: (p["label"], p["varied"]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tradeoff.md").write_text(table(points) + "\n")
    (args.out / "tradeoff.json").write_text(json.dumps(points, indent=2))
    save(figure(points), args.out, "tradeoff")
    print(table(points))


if __name__ == "__main__":
    main()
