"""What a stop and a resume cost: the generation a preemption loses, and how closely a resumed run
repeats an uninterrupted one.

    python scripts/bench_resume.py --preemption                      # the tiny default, SIGTERM at step 5, 3 trials
    python scripts/bench_resume.py                                   # sync_tiny and async_tiny, 8 steps, resume at 4
    python scripts/bench_resume.py --presets pace_tiny --steps 20 --at 10

`--preemption`: the tiny default (`python train.py`) is stopped by SIGTERM after step `--at`, as a
cluster preempts it, then resumed; with `rollout.resume_inflight=false` (the groups in flight are
dropped, as before in-flight resume) and `true` (they are kept and continued), side by side in
each trial. Generated tokens lost = the tokens the rollout read before the stop that no group of
the run or its checkpoint holds (trained on, filtered or rejected, pooled, or kept in flight). The
restart's time is from launching `resume=` to its first trained step (both modes start the same
engine and model; the pool at the checkpoint feeds the first steps).

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


def _held_tokens(run_dir: Path, checkpoint: Path) -> tuple[int, int, int]:
    """(tokens in the groups the stopped run logged, in the checkpoint's pool, kept in flight)."""
    import pickle

    import pandas as pd

    sys.path.insert(0, str(ROOT))  # the checkpoint holds pace's records
    g = pd.read_parquet(run_dir / "groups")
    logged = int(g.num_actions.sum())  # dropped groups are logged without tokens
    with open(checkpoint / "run_state.pkl", "rb") as f:
        state = pickle.load(f)
    pooled = sum(t.num_actions for grp in state["pool"]["pooled"] for t in grp.trajectories)
    kept = 0
    for item in state["rollout"].get("inflight", []):
        trajs = item.responses.values() if hasattr(item, "group") else item.trajectories
        kept += sum(t.num_actions for t in trajs)
    return logged, pooled, kept


def preemption(trials: int, at: int, steps: int) -> None:
    import signal
    import time

    print(f"| trial | rollout.resume_inflight | groups in flight at the stop | generated tokens before the stop | lost "
          "| kept in flight | restart → first trained step (s) |")
    print("|---|---|---|---|---|---|---|")
    lost_by = {"false": [], "true": []}
    with tempfile.TemporaryDirectory() as tmp:
        for trial in range(trials):
            for mode in ("false", "true"):
                run = Path(tmp) / f"{trial}-{mode}"
                cmd = [sys.executable, str(ROOT / "train.py"), f"trainer.steps={steps}", f"rollout.resume_inflight={mode}",
                       "logger.mode=disabled", "logger.progress=false", f"hydra.run.dir={run}"]
                proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                metrics = run / "metrics.jsonl"
                while not (metrics.exists() and len(metrics.read_text().splitlines()) >= at):
                    if proc.poll() is not None:
                        sys.exit(f"train.py stopped before step {at}:\n{proc.stderr.read()[-3000:]}")
                    time.sleep(0.2)
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=120)
                summary = json.loads((run / "summary.json").read_text())
                v, checkpoint = summary["steps"], Path(summary["checkpoint"])
                made = summary["rollout"]["tokens"]
                logged, pooled, kept = _held_tokens(run, checkpoint)
                lost = made - logged - pooled - kept
                inflight = summary["fates"]["inflight"] + summary["fates"]["dropped_shutdown"]
                t0 = time.perf_counter()
                resumed = subprocess.Popen([sys.executable, str(ROOT / "train.py"), f"resume={run}", f"trainer.steps={v + 2}",
                                            f"hydra.run.dir={run / 'resume-hydra'}"], cwd=ROOT, stdout=subprocess.DEVNULL,
                                           stderr=subprocess.PIPE, text=True)
                first = None
                while resumed.poll() is None:
                    if first is None and len(metrics.read_text().splitlines()) > v:
                        first = time.perf_counter() - t0
                    time.sleep(0.1)
                if resumed.returncode != 0:
                    sys.exit(f"the resume failed:\n{resumed.stderr.read()[-3000:]}")
                first = first if first is not None else time.perf_counter() - t0
                lost_by[mode].append(lost)
                print(f"| {trial} | {mode} | {inflight} | {made:,} | {lost:,} | {kept:,} | {first:.1f} |", flush=True)
    for mode, xs in lost_by.items():
        print(f"resume_inflight={mode}: {sum(xs) / len(xs):,.0f} generated tokens lost per preemption (mean of {len(xs)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preemption", action="store_true", help="tokens lost per preemption, without and with in-flight resume")
    ap.add_argument("--trials", type=int, default=3, help="--preemption: stops of each kind")
    ap.add_argument("--presets", nargs="+", default=["sync_tiny", "sync_tiny:rollout.deterministic=true", "async_tiny"],
                    help="presets, each optionally with overrides after ':' (comma-separated)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--at", type=int, default=None,
                    help="the step whose checkpoint is resumed (4); --preemption: the SIGTERM after this step (5)")
    args = ap.parse_args()
    if args.preemption:
        return preemption(args.trials, args.at or 5, max(args.steps, 40))
    args.at = args.at or 4
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
