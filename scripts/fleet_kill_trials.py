"""Kill trials of a rollout fleet that heals: does a run whose server is SIGKILLed at a random
moment finish (the server started again, caught up, serving) or stop with its cause and a
checkpoint, never hang, and lose no group?

    python scripts/fleet_kill_trials.py --trials 10
    python scripts/fleet_kill_trials.py --trials 3 --seed 1 --steps 120 --out runs/kill-trials

Each trial runs `train.py` on the tiny model with two vLLM servers it starts itself
(`rollout.engine_process=server rollout.engines=2`, `rollout.max_engine_restarts=1`), the presets
`sync_tiny` and `async_tiny` in turn, and SIGKILLs engine 1's process group (`<run>/engines/engine1.pid`)
in one of three windows, taken in turn:
- generation: a random 2-5 steps in, a random 0-0.3 s after it holds requests (`GET <control>/fleet`)
  if it still holds them;
- update: as soon as engine 1 answers `GET /is_paused` true (vLLM's RL route: paused for a weight
  update), plus a random 0-50 ms: the kill lands in the pause, the start, the broadcast, the
  finish, the checks or the resume. A kill inside the broadcast stops the run (with a checkpoint and
  one line naming the engine, docs/weight-sync.md); anywhere else it is survived;
- validation (`eval.every`, 100 problems × 4 samples: ~2-4 s here): a random 0-1.5 s after θ_v
  loaded for a due v (engine 1's update pause seen to end); whether the kill landed in it is judged
  from its validation line (its time, less the seconds it says the validation took).

A trial passes when the run neither hangs (`--timeout` s; the whole process tree is then killed)
nor leaves a server running, and either finished all its steps with engine 1 back (engines alive
2 again) or stopped with exit code 1, one `error:` line naming engine 1, summary status "failed" and
its checkpoint; and in both cases the fates add up (every submitted group one fate, one row; in a
stopped run, the pooled and in-flight ones in its checkpoint instead),
Lemma 1 holds on every decided group (K = K_gen + K_wait recomputed from its records) and no
response was orphaned. Times come from this script's clock on the run's stderr lines, read as they
come: kill → the "failed" line, kill → the "started again" line; then the updates between the
version it was ready at and the one it was caught up with, `rollout/engine_join_s`, and engine 1's
on-policy mismatch (`mismatch/abs_logp_diff/engine1`) at its first step back (sync runs only: an
async run's consumed tokens are stale). Prints a markdown table; --out keeps the runs, the table
(`table.md`) and each trial's record (`trials.json`).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # analysis.runs
WINDOWS = ("generation", "update", "validation")
PRESETS = ("sync_tiny", "async_tiny")
ENGINE = 1  # the server killed
VAL_EVERY = 4
SMALL = ["data.batch_prompts=4", "rollout.max_inflight_groups=12", "logger.mode=disabled",
         "rollout.engine_process=server", "rollout.engines=2", "rollout.max_engine_restarts=1",
         "rollout.restart_backoff_s=0.5", "logger.progress=false"]

# --- the run's stderr lines (pace/rollout/failover.py, healing.py, pace/validation.py) -------------
FAILED = re.compile(r"rollout engine (\d+) \(\S+\) (?:failed[: ]|did not answer )")
# the weight broadcast's stop names every engine it blames (pace/weights/sync.py): "engines 0 (…) and 1 (…)"
FAILED_MANY = re.compile(r"rollout engines ((?:\d+ \(\S+\) and )+\d+ \(\S+\)) (?:failed|did not answer) ")
READY = re.compile(r"rollout engine (\d+) \(\S+\) (?:started|answers) again \(restart \d+ of at most \d+\) at θ_(\d+)")
SERVING = re.compile(r"rollout engine (\d+) \(\S+\) serves again: caught up with θ_(\d+)")
VALIDATED = re.compile(r"validation of θ_(\d+): (?:.* in ([\d.]+) s)?")


def parse(line: str) -> tuple[str, int | None, int | None] | None:
    """(event, engine, version) of a line that matters here, else None: failed (engine; a tuple of
    engines where the line names several), ready (engine, the version it is ready at), serving
    (engine, the version it was caught up with), budget (engine), validated (version), error."""
    if m := FAILED_MANY.search(line):
        return "failed", tuple(int(e) for e in re.findall(r"(\d+) \(\S+\)", m[1])), None
    if m := READY.search(line):
        return "ready", int(m[1]), int(m[2])
    if m := SERVING.search(line):
        return "serving", int(m[1]), int(m[2])
    if m := FAILED.search(line):
        return "failed", int(m[1]), None
    if "restart budget spent" in line and (m := re.search(r"rollout engine (\d+)", line)):
        return "budget", int(m[1]), None
    if m := VALIDATED.search(line):
        return "validated", None, int(m[1])
    if line.startswith("error:"):
        return "error", None, None
    return None


def timings(lines: list[tuple[float, str]], kill_t: float, engine: int, sync_every: int) -> dict:
    """From the timestamped stderr ``lines``: seconds from the kill to engine ``engine``'s first
    "failed" and "started again" lines after it, and the weight updates from the version it was
    ready at to the one it was caught up with (None where a line is missing)."""
    out = {"detect_s": None, "ready_s": None, "ready_updates": None}
    ready_v = None
    for t, line in lines:
        ev = parse(line)
        if t < kill_t or ev is None or engine not in (ev[1] if isinstance(ev[1], tuple) else (ev[1],)):
            continue
        if ev[0] == "failed" and out["detect_s"] is None:
            out["detect_s"] = t - kill_t
        elif ev[0] == "ready" and out["ready_s"] is None:
            out["ready_s"], ready_v = t - kill_t, ev[2]
        elif ev[0] == "serving" and ready_v is not None and out["ready_updates"] is None:
            out["ready_updates"] = (ev[2] - ready_v) / sync_every
    return out


COLUMNS = ("trial", "preset", "window", "kill at (step)", "outcome", "kill→detect s", "kill→ready s",
           "ready→serving (updates)", "engine_join_s", "engine 1 mismatch after join", "checks")


def _cell(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, float):
        return f"{v:.2e}" if 0 < abs(v) < 1e-3 else f"{v:.1f}"
    return str(v)


def table(results: list[dict]) -> str:
    """The trials as a markdown table, one row each (— where a value does not apply)."""
    keys = ("trial", "preset", "window", "kill_step", "outcome", "detect_s", "ready_s", "ready_updates",
            "join_s", "mismatch_after_join", "checks")
    rows = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    rows += ["| " + " | ".join(_cell(r.get("where", r.get(k)) if k == "window" else r.get(k)) for k in keys) + " |"
             for r in results]
    return "\n".join(rows)


# --- a trial -----------------------------------------------------------------------------------
class Run:
    """train.py in a session of its own, its stderr read line by line with this clock's times."""

    def __init__(self, cmd: list[str], run_dir: Path, deadline: float):
        self.dir, self.deadline, self.lines = run_dir, deadline, []
        run_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with open(self.dir / "stderr.log", "w") as log:  # the run's own stderr, kept with its times
            for line in self.proc.stderr:
                t = time.monotonic()
                self.lines.append((t, line.rstrip("\n")))
                log.write(f"{t:.3f} {line}")
                log.flush()

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise Ended(f"the run exited (code {self.proc.returncode}) before the kill")
        if time.monotonic() > self.deadline:
            raise TimeoutError("no kill moment found before the trial's timeout")

    def rows(self) -> list[dict]:
        path = self.dir / "metrics.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []

    def wait_rows(self, n: int) -> None:
        while len(self.rows()) < n:
            self.check()
            time.sleep(0.05)

    def engine(self, index: int) -> dict:
        import requests

        url = json.loads((self.dir / "fleet.json").read_text())["control"]
        return next(s for s in requests.get(url + "/fleet", timeout=5).json()["servers"] if s["index"] == index)

    def pgids(self) -> list[int]:
        return [int(p.read_text()) for p in sorted((self.dir / "engines").glob("engine*.pid"))]

    def kill_tree(self) -> None:
        import psutil

        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        for pgid in [self.proc.pid, *self.pgids()]:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


class Ended(RuntimeError):
    """The run ended before the kill."""


def _aim(run: Run, window: str, rng: random.Random) -> dict:
    """Wait for a moment in ``window``; what was seen there (the kill follows at once)."""
    import requests

    if window == "generation":
        run.wait_rows(rng.randint(2, 5))
        delay = rng.uniform(0.0, 0.3)
        while True:  # holding requests, and still a random delay later (a sync run's generation is short)
            run.check()
            try:
                if run.engine(ENGINE)["requests"] > 0:
                    time.sleep(delay)
                    if (held := run.engine(ENGINE)["requests"]) > 0:
                        return {"requests": held}
            except (requests.RequestException, OSError, StopIteration):
                pass
            time.sleep(0.02)
    if window == "update":
        run.wait_rows(rng.randint(2, 5))
        url = run.engine(ENGINE)["url"]
        with requests.Session() as http:
            while True:
                run.check()
                try:
                    if http.get(url + "/is_paused", timeout=1).json().get("is_paused"):
                        break
                except (requests.RequestException, ValueError):
                    pass
        time.sleep(rng.uniform(0.0, 0.05))
        return {"paused_seen": True}
    version = VAL_EVERY * rng.randint(1, 2)  # the validation of θ_version runs after row `version`...
    run.wait_rows(version)
    url, seen, t_row = run.engine(ENGINE)["url"], False, time.monotonic()
    with requests.Session() as http:  # ...once θ_version loaded: the update's pause seen to end (or 3 s passed)
        while True:
            run.check()
            try:
                paused = http.get(url + "/is_paused", timeout=1).json().get("is_paused")
            except (requests.RequestException, ValueError):
                paused = None
            seen = seen or bool(paused)
            if paused is False and (seen or time.monotonic() - t_row > 3.0):
                break
    time.sleep(rng.uniform(0.0, 1.5))
    return {"validating": version}


def _kill(run: Run) -> float:
    pgid = int((run.dir / "engines" / f"engine{ENGINE}.pid").read_text())
    os.killpg(pgid, signal.SIGKILL)
    return time.monotonic()


def _lemma1(groups) -> tuple[float, int]:
    """Max |K − K_gen − K_wait| recomputed against the logged values over every decided group, and
    the groups with a token newer than its completion or a completion after the step."""
    from analysis.runs import recomputed_staleness

    worst, bad = 0.0, 0
    for _, row in groups.dropna(subset=["k"]).iterrows():
        k, k_gen, k_wait = recomputed_staleness(row)
        worst = max(worst, abs(row.k - k), abs(row.k_gen - k_gen), abs(row.k_wait - k_wait))
        bad += any(not (max(s[0::2]) <= c <= row.step) for s, c in zip(row.version_spans, row.completed_at))
    return worst, bad


def _fates_ok(summary: dict, groups, checkpoint: str | None) -> bool:
    """Every submitted group has one fate and one row, except, in a stopped run, those its
    checkpoint keeps pooled or in flight (logged once decided after a resume)."""
    import pickle

    fates, kept = summary["fates"], ()
    if checkpoint:
        with open(Path(checkpoint) / "run_state.pkl", "rb") as f:
            pool = pickle.load(f)["pool"]
        if len(pool["pooled"]) != fates["pooled"] or len(pool["inflight"]) != fates["inflight"]:
            return False
        kept = ("pooled", "inflight")
    logged = {f: n for f, n in fates.items() if f != "submitted" and f not in kept}
    return (fates["submitted"] == sum(v for k, v in fates.items() if k != "submitted") and groups.id.is_unique
            and len(groups) == sum(logged.values()) and all((groups.fate == f).sum() == n for f, n in logged.items()))


def _judge(run: Run, out: dict, steps: int, sync_every: int) -> dict:
    import pandas as pd

    lines = [line for _, line in run.lines]
    summary_path = run.dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    rows = run.rows()
    errors = [line for line in lines if line.startswith("error:")]
    checkpoint = summary.get("checkpoint")
    if run.proc.returncode == 0 and summary.get("status") == "finished" and summary.get("steps") == steps:
        out["outcome"] = "finished"
    elif (run.proc.returncode == 1 and summary.get("status") == "failed" and checkpoint and Path(checkpoint).exists()
          and len(errors) == 1 and f"rollout engine {ENGINE} " in errors[0]):
        out["outcome"] = "stopped"
        out["cause"] = errors[0]
    else:
        out["outcome"] = f"bad (code {run.proc.returncode}, status {summary.get('status')})"
    problems = []
    if (run.dir / "groups").exists() and summary.get("fates"):
        groups = pd.read_parquet(run.dir / "groups")
        out["lemma1_max_err"], out["lemma1_bad"] = _lemma1(groups)
        out["fates_ok"] = _fates_ok(summary, groups, checkpoint if out["outcome"] == "stopped" else None)
        out["groups"] = len(groups)
        problems += [] if out["fates_ok"] else ["fates"]
        problems += [] if out["lemma1_max_err"] < 1e-9 and out["lemma1_bad"] == 0 else ["lemma1"]
    else:
        problems.append("no groups/fates")
    out["orphaned"] = summary.get("rollout", {}).get("orphaned_responses")
    problems += [] if out["orphaned"] == 0 else ["orphaned"]
    alive = [m["rollout/engines_alive"] for m in rows if "rollout/engines_alive" in m]  # not the final validation's row
    out["alive"] = [a for i, a in enumerate(alive) if i == 0 or a != alive[i - 1]]
    out["back"] = 1 in alive and 2 in alive[alive.index(1):]  # (another engine may fail later: noted below)
    failed = [(t, ev[1]) for t, line in run.lines if line.startswith("warning:") and (ev := parse(line)) and ev[0] == "failed"]
    out["others_failed"] = sorted({i for _, i in failed if i != ENGINE})
    out["failed_again"] = sum(1 for t, i in failed if i == ENGINE and t > out["kill_t"]) > 1
    if out["outcome"] == "finished" and not out["back"]:
        problems.append("not back")
    joined = [i for i, m in enumerate(rows) if m.get("rollout/engine_join_s") == m.get("rollout/engine_join_s")
              and m.get("rollout/engine_join_s") is not None]
    out["join_s"] = rows[joined[0]]["rollout/engine_join_s"] if joined else None
    back = next((m for m in rows[joined[0]:] if m.get(f"mismatch/tokens/engine{ENGINE}", 0) > 0), None) if joined else None
    out["mismatch_after_join"] = back.get(f"mismatch/abs_logp_diff/engine{ENGINE}") if back else None
    out.update(timings(run.lines, out["kill_t"], ENGINE, sync_every))
    if out["window"] == "validation":  # landed in it: its line came after the kill
        took = [(t, float(m[2])) for t, line in run.lines
                if (m := VALIDATED.search(line)) and int(m[1]) == out["validating"] and m[2] is not None]
        # printed when the trainer next polls: the start estimated from it is late, never early
        out["landed"] = bool(took) and took[0][0] - took[0][1] <= out["kill_t"] < took[0][0]
    else:  # generation: it held requests a moment before; update: it was paused 0-50 ms before
        out["landed"] = out.get("requests", 0) > 0 or out.get("paused_seen", False)
    out["where"] = out["window"] + ("" if out["landed"] else " (missed)")
    problems += [] if out["leftover"] == 0 else ["server left running"]
    out["ok"] = out["outcome"] in ("finished", "stopped") and not problems
    out["checks"] = "ok" if out["ok"] else ", ".join(problems) or "outcome"
    if out["others_failed"] or out["failed_again"]:  # not killed here: handled like any failure, but worth a look
        again = ["engine 1 again"] if out["failed_again"] else []
        out["checks"] += "; also failed: " + ", ".join([f"engine {i}" for i in out["others_failed"]] + again)
    out["stderr_tail"] = lines[-15:]
    return out


def trial(n: int, window: str, preset: str, run_dir: Path, steps: int, rng: random.Random, timeout: float) -> dict:
    evals = [f"eval.every={VAL_EVERY}", "eval.val_max_problems=25"] if window == "validation" else ["eval.every=0"]
    cmd = [sys.executable, str(ROOT / "train.py"), f"+exp={preset}", *SMALL, *evals, f"trainer.steps={steps}",
           f"hydra.run.dir={run_dir}"]
    out = {"trial": n, "preset": preset, "window": window, "run_dir": str(run_dir)}
    start = time.monotonic()
    run = Run(cmd, run_dir, start + timeout)
    try:
        out |= _aim(run, window, rng)
        out["kill_step"] = len(run.rows())
        out["kill_t"] = _kill(run)
        out["kill_after_s"] = round(out["kill_t"] - start, 1)
        run.proc.wait(timeout=max(1.0, run.deadline - time.monotonic()))
    except (TimeoutError, subprocess.TimeoutExpired) as exc:
        run.kill_tree()
        run.proc.wait()
        return out | {"outcome": "hang", "ok": False, "checks": str(exc)[:80], "stderr_tail": [x for _, x in run.lines[-15:]]}
    except Ended as exc:
        run.proc.wait()
        return out | {"outcome": "no kill", "ok": False, "checks": str(exc), "stderr_tail": [x for _, x in run.lines[-15:]]}
    finally:
        if run.proc.poll() is None:
            run.kill_tree()
    run._reader.join(5)
    time.sleep(1.0)
    out["leftover"] = 0
    for pgid in run.pgids():  # the run stops the servers it started
        try:
            os.killpg(pgid, 0)
            out["leftover"] += 1
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    out["seconds"] = round(time.monotonic() - start, 1)
    return _judge(run, out, steps, sync_every=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--first", type=int, default=0, help="number of the first trial (its window and preset follow)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=120, help="steps of each run: enough for a restart (30-80 s here)")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds a trial may take; more is a hang")
    ap.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS, help="taken in turn")
    ap.add_argument("--windows", nargs="+", default=list(WINDOWS), choices=WINDOWS, help="taken in turn")
    ap.add_argument("--out", type=Path, default=None, help="keep the runs, table.md and trials.json here")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for n in range(args.first, args.first + args.trials):
            window, preset = args.windows[n % len(args.windows)], args.presets[n % len(args.presets)]
            r = trial(n, window, preset, root / f"trial{n:02d}", args.steps, rng, args.timeout)
            results.append(r)
            print(f"trial {n}: {preset}, {window}: {r['outcome']}, {r['checks']}", file=sys.stderr, flush=True)
            if args.out:
                (root / "trials.json").write_text(json.dumps(results, indent=1, default=str))
    text = table(results)
    passed = sum(r["ok"] for r in results)
    footer = f"\n\n{passed} of {len(results)} trials passed (seed {args.seed}, {args.steps} steps)."
    print(text + footer)
    if args.out:
        (args.out / "table.md").write_text(text + footer + "\n")
    sys.exit(0 if passed == len(results) else 1)


if __name__ == "__main__":
    main()
