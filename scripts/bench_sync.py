"""Weight sync and step time with the engine in process vs in its own process, side by side.

    python scripts/bench_sync.py                          # sync_tiny and async_tiny, 30 steps each way
    python scripts/bench_sync.py --base /tmp/base         # and the same presets from another checkout
    python scripts/bench_sync.py --steps 60 --presets async_tiny pace_tiny

For each preset and each placement (`rollout.engine_process=inproc|child`, and `--base`: another
checkout's train.py with its own defaults, e.g. the commit before the weight-transfer engines),
one `train.py` run after the other with identical overrides; it prints, after `--warmup` steps:
seconds per step, the trainer's share of a sync (`time/sync`: materialise and write θ), the
engine's share per sync (`rollout/sync_apply_s` over `rollout.syncs`: pause, load, resume), the
run's wall time (start-up included), and each run's step time against the first way's
(`--ways`), then the async/sync step-time ratio of each placement. Measure with nothing else running.
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


def run(root: Path, preset: str, steps: int, overrides: list[str], run_dir: Path) -> dict:
    cmd = [sys.executable, str(root / "train.py"), f"+exp={preset}", f"trainer.steps={steps}", "eval.every=0",
           "logger.mode=disabled", "logger.progress=false", f"hydra.run.dir={run_dir}", *overrides]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{preset} {overrides} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/loss" in r]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"rows": rows, "wall": time.time() - t0, "syncs": summary["rollout"]["syncs"],
            "apply_s": summary["rollout"]["sync_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["sync_tiny", "async_tiny"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--base", type=Path, help="another checkout to run the same presets from (its defaults)")
    ap.add_argument("--ways", nargs="+", default=["base", "inproc", "child"], help="which of base / inproc / child to run")
    ap.add_argument("overrides", nargs="*", help="after --: overrides for every run")
    args = ap.parse_args()
    ways = [("inproc", ROOT, ["rollout.engine_process=inproc"]), ("child", ROOT, ["rollout.engine_process=child"])]
    if args.base is not None:
        ways.insert(0, ("base", args.base.resolve(), []))
    ways = [w for w in ways if w[0] in args.ways]
    results: dict[tuple[str, str], dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            for name, root, extra in ways:
                print(f"running {preset} ({name}) …", file=sys.stderr, flush=True)
                results[preset, name] = run(root, preset, args.steps, [*extra, *args.overrides], Path(tmp) / f"{preset}-{name}")
    mean = lambda rows, key: sum(r.get(key, 0.0) for r in rows) / max(len(rows), 1)  # noqa: E731
    print(f"{'preset':<12} {'engine':<7} {'s/step':>7} {'vs ' + ways[0][0]:>9} {'sync trainer s':>14} {'sync engine s':>13} "
          f"{'syncs':>5} {'wall s':>7}")
    for preset in args.presets:
        ref = mean(results[preset, ways[0][0]]["rows"][args.warmup:], "time/step")
        for name, _, _ in ways:
            r = results[preset, name]
            rows = r["rows"][args.warmup:]
            step = mean(rows, "time/step")
            print(f"{preset:<12} {name:<7} {step:7.3f} {step / ref:9.3f} {mean(rows, 'time/sync'):14.4f} "
                  f"{r['apply_s'] / max(r['syncs'], 1):13.4f} {r['syncs']:5d} {r['wall']:7.1f}")
    if "sync_tiny" in args.presets and "async_tiny" in args.presets:
        for name, _, _ in ways:
            s = mean(results["sync_tiny", name]["rows"][args.warmup:], "time/step")
            a = mean(results["async_tiny", name]["rows"][args.warmup:], "time/step")
            print(f"async/sync step-time ratio ({name}): {a / s:.3f}")


if __name__ == "__main__":
    main()
