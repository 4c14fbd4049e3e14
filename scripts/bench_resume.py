"""How closely a resumed run repeats an uninterrupted one, per pool policy (issue #6).

    python scripts/bench_resume.py                                   # sync_tiny and async_tiny, 8 steps, resume at 4
    python scripts/bench_resume.py --presets pace_tiny --steps 20 --at 10

For each preset: run A uninterrupted with a checkpoint at step `--at`; run A' the same way again
(how far two uninterrupted runs differ: the noise floor); copy A and resume the copy from its
step-`at` checkpoint (B). For the steps from `at` on, prints how many consumed groups B and A'
share with A (same prompt, same response lengths, same rewards) and the largest difference in
train/loss. With `pool=sync` and `rollout.deterministic=true` B equals A exactly. Without that flag
a sync run is not repeatable: a group filtered by dynamic sampling is regenerated when its grade
comes back from the grading process, and the engine step it joins (and so the sampling RNG
stream) depends on that timing. Asynchronous runs differ as much as two uninterrupted runs do:
which groups complete before which training step depends on timing.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = ["data.batch_prompts=8", "rollout.max_inflight_groups=16", "eval.every=0", "logger.mode=disabled",
        "logger.progress=false"]


def _train(args: list[str], run_dir: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"train.py {' '.join(args)} failed:\n{proc.stderr[-3000:]}")


def _consumed(run_dir: Path, start: int) -> dict[int, list[tuple]]:
    import pandas as pd

    g = pd.read_parquet(run_dir / "groups")
    g = g[(g.fate == "consumed") & (g.step >= start)]
    out: dict[int, list[tuple]] = {}
    for r in g.itertuples():
        out.setdefault(int(r.step), []).append((r.prompt_id, tuple(r.lengths), round(r.reward_mean, 9)))
    return out


def _losses(run_dir: Path, start: int) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows if "train/loss" in r and r["step"] >= start]


def compare(a: Path, other: Path, start: int) -> tuple[int, int, float]:
    ca, co = _consumed(a, start), _consumed(other, start)
    same = sum(len(set(ca[s]) & set(co.get(s, []))) for s in ca)
    total = sum(len(v) for v in ca.values())
    dloss = max(abs(x - y) for x, y in zip(_losses(a, start), _losses(other, start)))
    return same, total, dloss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["sync_tiny", "sync_tiny:rollout.deterministic=true", "async_tiny"],
                    help="presets, each optionally with overrides after ':' (comma-separated)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--at", type=int, default=4, help="the step whose checkpoint is resumed")
    args = ap.parse_args()
    print(f"| preset | consumed groups of steps {args.at}–{args.steps - 1} shared with A: resumed B | second run A' "
          "| max abs Δ train/loss: B | A' |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for i, spec in enumerate(args.presets):
            preset, _, extra = spec.partition(":")
            common = [f"+exp={preset}", f"trainer.steps={args.steps}", f"trainer.save_every={args.at}", *BASE,
                      *(extra.split(",") if extra else [])]
            a, a2, b = (Path(tmp) / str(i) / x for x in ("a", "a2", "b"))
            _train(common, a)
            _train(common, a2)
            shutil.copytree(a, b)
            _train([f"resume={b / 'checkpoints' / f'step-{args.at:06d}'}"], Path(tmp) / str(i) / "resume-hydra")
            sb, total, lb = compare(a, b, args.at)
            s2, _, l2 = compare(a, a2, args.at)
            print(f"| {spec} | {sb}/{total} | {s2}/{total} | {lb:.2e} | {l2:.2e} |", flush=True)


if __name__ == "__main__":
    main()
