"""Process layouts side by side: seconds per step of each preset in each layout, paired by seed, in one run.

    python scripts/bench_layouts.py                                   # DEFAULT_LAYOUTS below, seeds 0 1
    python scripts/bench_layouts.py --presets sync_tiny async_tiny --seeds 0 1 2 --steps 40 \\
        --layout inproc="rollout.engine_process=inproc" --layout child="rollout.engine_process=child"
    python scripts/bench_layouts.py --keep runs/layouts ...           # keep every run's directory

A layout is a named set of Hydra overrides (where the engine runs, how its output reaches the
rollout thread, what priority it runs at). For each seed, each preset runs in each layout, one run
after another (`train.py +exp=<preset> seed=<s>`, in-training validation off), so that the layouts'
runs of one seed and preset are made minutes apart. Printed: mean seconds per step after
`--warmup` steps (the loop's wall time per step: the update's publish included) per run; per preset
each layout's ratio to the first, per seed and its mean; within each layout Async/Sync and
PACE/Async per seed and their means (when those presets are in the run). Nothing else should run
on the machine meanwhile.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_presets import mean, run  # noqa: E402

DEFAULT_LAYOUTS = [  # docs/benchmarks.md "Process layouts on 2 cores"
    "inproc=rollout.engine_process=inproc rollout.stream_interval=1 rollout.engine_nice=0",  # the tiny presets' today
    "child=rollout.engine_process=child rollout.stream_interval=16 rollout.engine_nice=0",
    "child_nice=rollout.engine_process=child rollout.stream_interval=16 rollout.engine_nice=10",
]


def parse_layout(spec: str) -> tuple[str, list[str]]:
    name, _, overrides = spec.partition("=")
    if not name:
        sys.exit(f"--layout {spec!r}: give NAME=OVERRIDES (overrides separated by spaces, may be empty)")
    return name, overrides.split()


def _per_seed(values: list[float]) -> str:
    """The mean, and each seed's value when there are several."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return f"{m:.3f}"
    return f"{m:.3f} (seeds: {', '.join(f'{v:.3f}' for v in values)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["sync_tiny", "async_tiny", "pace_tiny"])
    ap.add_argument("--layout", action="append", help="NAME=OVERRIDES (repeat; the first is the reference)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out of the means")
    ap.add_argument("--keep", type=Path, help="keep each run's directory under this folder")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides applied to every run")
    args = ap.parse_args()
    layouts = dict(parse_layout(s) for s in (args.layout or DEFAULT_LAYOUTS))

    secs: dict[tuple[str, str, int], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        for seed in args.seeds:
            for preset in args.presets:
                for name, extra in layouts.items():
                    rows, wall = run(preset, args.steps, [f"seed={seed}", *extra, *args.overrides],
                                     root / f"{preset}_{name}_s{seed}")
                    secs[preset, name, seed] = mean(rows[args.warmup:], "time/step")
                    print(f"seed {seed} {preset:<12} {name:<10} {secs[preset, name, seed]:.3f} s/step "
                          f"({len(rows)} steps, {wall:.0f} s with start-up)", flush=True)

    first = next(iter(layouts))
    print(f"\nseconds per step (steps {args.warmup}..{args.steps - 1}), mean over seeds {args.seeds}")
    print(f"{'':<14}" + "".join(f"{n:>14}" for n in layouts))
    for p in args.presets:
        print(f"{p:<14}" + "".join(f"{statistics.fmean(secs[p, n, s] for s in args.seeds):>14.3f}" for n in layouts))
    print(f"\neach layout over {first}, paired by seed")
    for p in args.presets:
        for n in list(layouts)[1:]:
            print(f"  {p} {n}/{first}: {_per_seed([secs[p, n, s] / secs[p, first, s] for s in args.seeds])}")
    pairs = [(a, b) for a, b in (("async_tiny", "sync_tiny"), ("pace_tiny", "async_tiny"))
             if a in args.presets and b in args.presets]
    if pairs:
        print("\nwithin each layout, paired by seed")
        for n in layouts:
            for a, b in pairs:
                print(f"  {n}: {a}/{b}: {_per_seed([secs[a, n, s] / secs[b, n, s] for s in args.seeds])}")


if __name__ == "__main__":
    main()
