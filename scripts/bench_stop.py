"""Preemption trials: does every SIGTERM to a multi-process run end in a checkpoint, within the
launcher's grace period, that `resume=` continues?

    python scripts/bench_stop.py                        # 10 trials to torchrun, 10 to every process
    python scripts/bench_stop.py --trials 3 --targets everyone

Each trial starts `torchrun --standalone --nproc_per_node 2 train.py +exp=async_tiny` (the engine in
its own process, in-training validation every 2 steps), waits for a random number of logged steps
(3-8) plus a random delay within a step, so the signal lands mid-update, mid-generation or
mid-validation, and sends SIGTERM to torchrun alone or to every process of the job (as Slurm's
`scancel` or a preemption does). A trial passes when the run exits by itself within torchrun's grace
period (30 s: it is SIGKILLed otherwise) with `summary.json` and its checkpoint, no engine process
died on the signal, and `resume=` from that checkpoint trains one more step and finishes, with
the groups in flight at the stop continued. Prints one row per trial and the totals.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRACE_S = 30.0  # torchrun's default --shutdown-timeout
RUN = ["+exp=async_tiny", "trainer.steps=40", "data.batch_prompts=8", "rollout.max_inflight_groups=32", "eval.every=2",
       "eval.val_max_problems=64", "trainer.save_every=0", "logger.mode=disabled", "logger.progress=false"]
DEATHS = ("Process EngineCore:", "died unexpectedly", "EngineCore encountered a fatal error", "did not stop within")


def torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _rows(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _send(proc: subprocess.Popen, target: str) -> None:
    import psutil

    if target == "torchrun":
        os.kill(proc.pid, signal.SIGTERM)
        return
    for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass


def _validating(checkpoint: Path) -> bool:
    """Was an in-training validation running at the checkpoint? (The rollout then saves the version
    being validated as the next one due, to redo it; otherwise one its engines have not loaded yet.)"""
    import pickle

    sys.path.insert(0, str(ROOT))
    with open(checkpoint / "run_state.pkl", "rb") as f:
        rollout = pickle.load(f)["rollout"]
    return rollout["val_next"] <= rollout["engine_version"]


def trial(run: Path, target: str, rng: random.Random) -> dict:
    rows, delay = rng.randint(3, 8), rng.uniform(0.0, 2.5)
    proc = subprocess.Popen([*torchrun(), str(ROOT / "train.py"), *RUN, f"hydra.run.dir={run}"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        while _rows(run / "metrics.jsonl") < rows:
            if proc.poll() is not None:
                return {"error": "exited before the signal: " + proc.stderr.read()[-500:]}
            time.sleep(0.05)
        time.sleep(delay)
        _send(proc, target)
        t0 = time.time()
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
        took = time.time() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    out = {"target": target, "after_rows": rows, "delay_s": round(delay, 2), "exit_s": round(took, 1),
           "status": summary.get("status"), "steps": summary.get("steps"), "checkpoint": summary.get("checkpoint"),
           "in_flight_kept": summary.get("fates", {}).get("inflight"), "sigkilled": "forcefully exiting via 9" in err,
           "engine_died": any(d in err for d in DEATHS)}
    if not out["checkpoint"]:
        return out | {"ok": False}
    out["validating"] = _validating(Path(out["checkpoint"]))
    resumed = subprocess.run([*torchrun(), str(ROOT / "train.py"), f"resume={out['checkpoint']}",
                              f"trainer.steps={summary['steps'] + 1}", f"hydra.run.dir={run / 'resume-hydra'}"],
                             cwd=ROOT, capture_output=True, text=True, timeout=600)
    after = json.loads((run / "summary.json").read_text())
    out["resumed"] = resumed.returncode == 0 and after.get("status") == "finished"
    out["continued"] = after.get("rollout", {}).get("resumed_groups", 0)
    out["ok"] = (out["status"] == "interrupted" and took < GRACE_S and not out["sigkilled"] and not out["engine_died"]
                 and out["resumed"] and out["continued"] == out["in_flight_kept"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=10, help="signals of each kind")
    ap.add_argument("--targets", nargs="+", default=["torchrun", "everyone"], choices=["torchrun", "everyone"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary directory)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        print("| # | SIGTERM to | after step | + delay (s) | validating | exit after signal (s) | checkpoint "
              "| groups kept in flight | resumed, kept groups continued | ok |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for i in range(args.trials):
            for target in args.targets:
                r = trial(root / f"{i}-{target}", target, rng)
                results.append(r)
                if "error" in r:
                    print(f"| {i} | {target} | error: {r['error']} |", flush=True)
                    continue
                print(f"| {i} | {target} | {r['after_rows']} | {r['delay_s']} | {r.get('validating')} | {r['exit_s']} | "
                      f"{Path(r['checkpoint']).name if r['checkpoint'] else 'none'} | {r['in_flight_kept']} | "
                      f"{r.get('resumed')}, {r.get('continued')} | {'yes' if r['ok'] else 'NO'} |", flush=True)
    ok = [r for r in results if r.get("ok")]
    exits = [r["exit_s"] for r in results if "exit_s" in r]
    print(f"{len(ok)} of {len(results)} stops checkpointed within the {GRACE_S:.0f} s grace period and resumed "
          f"(exit after the signal: {min(exits):.1f}-{max(exits):.1f} s)")
    sys.exit(0 if len(ok) == len(results) else 1)


if __name__ == "__main__":
    main()
