"""Presets side by side on the same config: seconds per step by phase, staleness, pool, reward.

    python scripts/bench_presets.py                                   # sync_tiny vs async_tiny, 40 steps
    python scripts/bench_presets.py --presets async_tiny pace_tiny --steps 100
    python scripts/bench_presets.py --steps 100 -- trainer.lr=5e-5    # extra overrides for every run
    python scripts/bench_presets.py --keep runs/bench ...             # keep the runs (metrics.jsonl)

Runs `train.py +exp=<preset>` for each preset one after the other with identical overrides, reads
their metrics.jsonl and prints mean seconds per step (after `--warmup` steps) by phase (generation
= engine step time, waiting for data, training, weight sync, rescoring), mean staleness, pool
occupancy (and its course over the run), and each preset's per-step wall-time ratio to the first.
In-training validation is off (`eval.every=0`) unless an override sets `eval.every`.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ["time/step", "time/generate", "time/wait_data", "time/train", "time/sync", "time/rescore"]
EXTRA = ["staleness/k_mean", "staleness/k_wait_mean", "staleness/k_gen_mean", "pool/occupancy", "pool/rejected",
         "rollout/tokens_per_s", "rollout/rescore_seqs", "pool/pfs_coverage"]


def run(preset: str, steps: int, overrides: list[str], run_dir: Path) -> tuple[list[dict], float]:
    cmd = [sys.executable, str(ROOT / "train.py"), f"+exp={preset}", f"trainer.steps={steps}",
           "logger.mode=disabled", "logger.progress=false", f"hydra.run.dir={run_dir}",
           *(["eval.every=0"] if not any(o.startswith("eval.every=") for o in overrides) else []), *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{preset} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/loss" in r], wall  # training steps (not rows of final validations)


def mean(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if key in r]
    return sum(vals) / len(vals) if vals else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["sync_tiny", "async_tiny"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out of the means")
    ap.add_argument("--keep", type=Path, help="keep each run's directory (metrics.jsonl) under this folder")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides applied to every run")
    args = ap.parse_args()

    results, traces = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            rows, wall = run(preset, args.steps, args.overrides, (args.keep or Path(tmp)) / preset)
            traces[preset] = rows
            steady = rows[args.warmup :]
            results[preset] = {k: mean(steady, k) for k in PHASES + EXTRA}
            results[preset]["reward first 10"] = mean(rows[:10], "train/reward_mean")
            results[preset]["reward last 10"] = mean(rows[-10:], "train/reward_mean")
            print(f"{preset}: {len(rows)} steps in {wall:.0f} s (process wall time, incl. start-up)", flush=True)

    first = args.presets[0]
    print(f"\nmeans over steps {args.warmup}..{args.steps - 1}")
    print(f"{'':<24}" + "".join(f"{p:>16}" for p in args.presets))
    for k in PHASES + EXTRA + ["reward first 10", "reward last 10"]:
        print(f"{k:<24}" + "".join(f"{results[p][k]:>16.3f}" for p in args.presets))
    print("\npool occupancy / mean K_wait of consumed groups, by tenth of the run")
    for p in args.presets:
        rows = traces[p]
        tenths = [rows[i * len(rows) // 10 : (i + 1) * len(rows) // 10] for i in range(10)]
        print(f"{p:<24}" + " ".join(
            f"{mean(t, 'pool/occupancy'):5.0f}/{mean(t, 'staleness/k_wait_mean'):<4.1f}" for t in tenths))
    for p in args.presets[1:]:
        print(f"per-step wall-time ratio {p}/{first}: {results[p]['time/step'] / results[first]['time/step']:.3f}")


if __name__ == "__main__":
    main()
