"""The fixed cost of a `train.py` launch, in wall and CPU seconds, for checkouts side by side.

    python scripts/bench_launch.py [--repeats 3] [--checkout DIR ...] [-- overrides...]

Runs a short tiny run (default: `+exp=async_tiny`, 2 steps at B = 4, no validation, nothing logged) in each
checkout in turn, `--repeats` rounds, and prints per checkout the median wall seconds and the CPU
seconds the machine was busy meanwhile (/proc/stat: every process the run started, those left to init
included, which a rusage of its children misses), with each checkout's ratio to the first. Most of a short
run is its fixed cost (imports, engine, helper processes, teardown), which is what the test suite pays at each
of its launches (docs/tests.md). Run it with nothing else on the machine.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ["+exp=async_tiny", "trainer.steps=2", "data.batch_prompts=4", "rollout.max_inflight_groups=8", "eval.every=0",
       "logger.mode=disabled", "logger.progress=false"]


def busy_s() -> float:
    """CPU seconds all cores have been busy since boot (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def launch(checkout: Path, overrides: list[str]) -> tuple[float, float]:
    """(wall s, CPU s the machine was busy during the run)."""
    with tempfile.TemporaryDirectory() as run_dir:
        busy, t0 = busy_s(), time.monotonic()
        proc = subprocess.run([sys.executable, str(checkout / "train.py"), *overrides, f"hydra.run.dir={run_dir}"],
                              cwd=checkout, capture_output=True, text=True, timeout=900)
        time.sleep(2.0)  # processes the run left behind as they exit
        wall, cpu = time.monotonic() - t0 - 2.0, busy_s() - busy
    if proc.returncode != 0:
        sys.exit(f"{checkout}: train.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--checkout", type=Path, action="append", help="a checkout of this repository (default: this one)")
    parser.add_argument("overrides", nargs="*", help="train.py overrides replacing the default run's")
    args = parser.parse_args()
    checkouts = [c.resolve() for c in (args.checkout or [ROOT])]
    overrides = args.overrides or RUN
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = {c: [] for c in checkouts}
    for r in range(args.repeats):
        for c in checkouts:
            results[c].append(launch(c, overrides))
            print(f"round {r + 1}: {c}: wall {results[c][-1][0]:.1f} s, CPU {results[c][-1][1]:.1f} s", flush=True)
    first = checkouts[0]
    base_wall = statistics.median(w for w, _ in results[first])
    base_cpu = statistics.median(c for _, c in results[first])
    print(f"\n{'checkout':<40} {'wall s':>8} {'CPU s':>8} {'wall ×':>7} {'CPU ×':>7}")
    for c in checkouts:
        wall = statistics.median(w for w, _ in results[c])
        cpu = statistics.median(x for _, x in results[c])
        print(f"{str(c)[-40:]:<40} {wall:8.1f} {cpu:8.1f} {wall / base_wall:7.2f} {cpu / base_cpu:7.2f}")


if __name__ == "__main__":
    main()
