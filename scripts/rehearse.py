"""A CPU rehearsal of every paper preset: its own control flow, end to end, before a GPU-day is spent on it.

    python scripts/rehearse.py                                  # the five paper settings, one after another
    python scripts/rehearse.py --presets pace_qwen3_8b_h100 --faults --out runs/rehearsal
    python scripts/rehearse.py --presets sync_qwen3_8b pace_qwen3_30b_a3b -- rehearsal.steps=12

Each preset runs as its launch command would run it on its GPUs, with only what a CPU cannot have swapped
(`+rehearsal=cpu`, pace/rehearsal/overlay.py, docs/rehearsal.md): two trainer processes under
`torchrun --nproc_per_node 2` (gloo), the preset's engines as at most two engines of the same kind, a tiny
model of its family, steps shortened, the healing timeouts scaled. Then as an operator would: a run that
stops with a checkpoint is resumed (`resume=<run dir>`) until it finishes; `eval.py` scores its selected
checkpoint at the preset's mean@k (`--k`) and `analysis.table1` builds its Table 1 row (`--k 0`: skipped).

`--faults` injects the two faults a GPU run has hung on (pace/rehearsal/faults.py): engine 0 slowed to about
one step a second while it validates θ_final (its validation requests, returned whole, take longer than the scaled
`rollout.engine_timeout_s`: the run must finish without failing it), and engine 1 frozen as the
update to θ_`--block-at` (3 before the end) starts its transfer (the run must stop within the scaled
`rollout.update_timeout_s`, every trainer rank writing the checkpoint, and `resume=` must finish it).

Prints one row per preset: finished, steps, runs (resumes + 1), checkpoints, validations, engine
failures and restarts, the stops' causes, the selected version and its Table 1 average; `--out` keeps the
runs and writes the table to `<out>/rehearsal.md`. Everything is read from the runs' records
(summary.json, metrics, best.json, eval/mean@k.json, table1.json), not from their logs.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pace.rehearsal.overlay import SETTINGS  # noqa: E402

ERROR = re.compile(r"^error: (.*)$", re.M)


def launch(args: list[str], log: Path, timeout: float) -> int:
    """`torchrun --standalone --nproc_per_node 2 train.py <args>`, its output appended to ``log``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "train.py"), *args]
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd[3:])}\n")
        f.flush()
        try:
            return subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return -9


def steps_of(preset: str, extra: list[str]) -> int:
    """The rehearsal's trainer.steps: the preset composed with the overlay, as train.py will."""
    from hydra import compose, initialize_config_dir

    from pace.config import register
    from pace.rehearsal import overlay

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=[f"+exp={preset}", "+rehearsal=cpu", *extra])
    overlay.apply(cfg, world=2, say=False)
    return cfg.trainer.steps


def rehearse(preset: str, out: Path, extra: list[str], faults: bool, block_at: int | None, timeout: float,
             max_resumes: int, k: int | None) -> dict:
    run = out / preset
    log = out / f"{preset}.log"
    log.unlink(missing_ok=True)
    args = [f"+exp={preset}", "+rehearsal=cpu", f"hydra.run.dir={run}", "logger.mode=offline", "logger.progress=false",
            *extra]
    steps = steps_of(preset, extra)
    if faults:  # engine 0 slowed in the final validation; engine 1 frozen in the update to θ_block (default: 3 before the end)
        block_at = steps - 3 if block_at is None else block_at
        args += ["rehearsal.slow_engine=0", f"rehearsal.slow_version={steps}", f"rehearsal.block_update={block_at}",
                 "rehearsal.block_engine=1"]
    t0 = time.monotonic()
    codes = [launch(args, log, timeout)]
    while codes[-1] != 0 and len(codes) <= max_resumes and _checkpoints(run):
        codes.append(launch([f"resume={run}", "logger.progress=false"], log, timeout))
    row = {"preset": preset, "codes": codes, "planned": steps, "minutes": round((time.monotonic() - t0) / 60, 1)}
    text = log.read_text(errors="replace")
    row["stops"] = list(dict.fromkeys(m.strip()[:160] for m in ERROR.findall(text)))  # one line a cause (every rank says it)
    row["slowed"] = "slowed" in text and "while it validates" in text
    summary = _json(run / "summary.json") or {}
    row.update(finished=summary.get("status") == "finished", steps=summary.get("steps"),
               checkpoints=len(_checkpoints(run)), validations=len(summary.get("validations") or []),
               failures=(summary.get("rollout") or {}).get("engine_failures"),
               restarts=(summary.get("rollout") or {}).get("engine_restarts"),
               best=(summary.get("best") or {}).get("version"))
    row["resumed_from"] = summary.get("resumed_from")
    if k != 0 and row["finished"]:  # k: eval.py's samples (None: the preset's eval.k)
        table = out / f"{preset}-table1"
        proc = subprocess.run([sys.executable, "-m", "analysis.table1", str(run), "--out", str(table),
                               *([] if k is None else ["--k", str(k)])], cwd=ROOT, capture_output=True, text=True)
        built = _json(table / "table1.json") or _json(table / "table1_multiturn.json")  # a tool preset's block
        row["table1"] = _average(built) if proc.returncode == 0 and built else f"failed: {proc.stderr.strip()[-200:]}"
    return row


def _checkpoints(run: Path) -> list[Path]:
    return sorted(p for p in (run / "checkpoints").glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _average(table: dict) -> str:
    """The first row's average, as Table 1 prints it (%)."""
    for method, row in (table.get("rows") or {}).items():
        return f"{method} {100 * row['mean']['avg']:.2f}"
    return "-"


def markdown(rows: list[dict]) -> str:
    head = ["preset", "finished", "steps", "runs", "checkpoints kept", "validations", "failed / restarted", "stops",
            "selected", "Table 1 avg", "minutes"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        stops = "; ".join(r["stops"]) or "none"
        lines.append("| " + " | ".join(str(c) for c in [
            r["preset"], "yes" if r["finished"] else "**no**", r["steps"], len(r["codes"]), r["checkpoints"],
            r["validations"], f"{r['failures']} / {r['restarts']}", stops, f"θ_{r['best']}" if r["best"] is not None
            else "-", r.get("table1", "-"), r["minutes"]]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=list(SETTINGS))
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary directory)")
    parser.add_argument("--faults", action="store_true", help="a slowed validation and a frozen broadcast")
    parser.add_argument("--block-at", type=int, default=None,
                        help="--faults: the version whose update is frozen (default: 3 before the last)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a run may take before it is killed")
    parser.add_argument("--max-resumes", type=int, default=3)
    parser.add_argument("--k", type=int, default=None, help="eval.py's samples a problem (default: the preset's "
                        "eval.k, 32; 0: no eval.py and no Table 1)")
    parser.add_argument("overrides", nargs="*", help="more overrides for every run (after --)")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="rehearsal-"))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for preset in args.presets:
        print(f"rehearsing {preset} (log: {out / preset}.log)", file=sys.stderr, flush=True)
        rows.append(rehearse(preset, out.resolve(), args.overrides, args.faults, args.block_at, args.timeout,
                             args.max_resumes, args.k))
        print(markdown(rows[-1:]), file=sys.stderr, flush=True)
    table = markdown(rows)
    (out / "rehearsal.md").write_text(table)
    (out / "rehearsal.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(table)
    return 0 if all(r["finished"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
