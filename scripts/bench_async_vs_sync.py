"""Per-step wall time of async vs sync DAPO, side by side on the same config, with the time per phase.

    python scripts/bench_async_vs_sync.py                    # tiny default, 40 steps each
    python scripts/bench_async_vs_sync.py --steps 100 -- trainer.lr=5e-5   # extra overrides for both

Runs `train.py +exp=sync_tiny` and `+exp=async_tiny` one after the other with identical overrides,
reads their metrics.jsonl and prints mean seconds per step (after `--warmup` steps) by phase:
generation (engine step time), waiting for data, training, weight sync; and the async/sync ratio.
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
PHASES = ["time/step", "time/generate", "time/wait_data", "time/train", "time/sync"]


def run(preset: str, steps: int, overrides: list[str], run_dir: Path) -> tuple[list[dict], float]:
    cmd = [sys.executable, str(ROOT / "train.py"), f"+exp={preset}", f"trainer.steps={steps}",
           "logger.mode=disabled", "logger.progress=false", f"hydra.run.dir={run_dir}", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{preset} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()], wall


def mean(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if key in r]
    return sum(vals) / len(vals) if vals else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out of the means")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides applied to both runs")
    args = ap.parse_args()

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in ("sync_tiny", "async_tiny"):
            rows, wall = run(preset, args.steps, args.overrides, Path(tmp) / preset)
            steady = rows[args.warmup :]
            results[preset] = {k: mean(steady, k) for k in PHASES}
            results[preset]["reward_first"] = mean(rows[:10], "train/reward_mean")
            results[preset]["reward_last"] = mean(rows[-10:], "train/reward_mean")
            results[preset]["k_mean"] = mean(steady, "staleness/k_mean")
            results[preset]["wall_s"] = wall
            print(f"{preset}: {len(rows)} steps in {wall:.0f} s (process wall time, incl. start-up)", flush=True)

    s, a = results["sync_tiny"], results["async_tiny"]
    print(f"\nmean seconds per step over steps {args.warmup}..{args.steps - 1}")
    print(f"{'phase':<18}{'sync':>10}{'async':>10}{'async/sync':>12}")
    for k in PHASES:
        print(f"{k:<18}{s[k]:>10.3f}{a[k]:>10.3f}{a[k] / s[k] if s[k] else float('nan'):>12.2f}")
    print(f"{'staleness K':<18}{s['k_mean']:>10.2f}{a['k_mean']:>10.2f}")
    print(f"{'reward first 10':<18}{s['reward_first']:>10.3f}{a['reward_first']:>10.3f}")
    print(f"{'reward last 10':<18}{s['reward_last']:>10.3f}{a['reward_last']:>10.3f}")
    print(f"\nper-step wall-time ratio async/sync: {a['time/step'] / s['time/step']:.2f}")


if __name__ == "__main__":
    main()
