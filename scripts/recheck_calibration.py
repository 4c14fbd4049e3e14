"""Re-simulate a calibration's runs with the current code against the real values it stored, for when
the real runs are not on the machine (reports/sim/calibration.json keeps them).

    python scripts/recheck_calibration.py                       # every run of reports/sim/calibration.json
    python scripts/recheck_calibration.py pace_s0 pace_raw_s0   # some of them

Each run is simulated with the overrides scripts/reproduce_tiny.sh gave the real one (its method's
preset, seed, 100 steps) and `+sim=tiny_cpu`, then measured by analysis.calibration's own rows.
Writes reports/sim/recheck.md: real / simulated when the calibration was made / simulated now, with
the ratios to the real value.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from analysis.calibration import ROWS  # noqa: E402
from analysis.runs import load_local  # noqa: E402


def method_overrides() -> dict[str, list[str]]:
    """The study's methods → their overrides, read from scripts/reproduce_tiny.sh's METHOD table."""
    text = (ROOT / "scripts" / "reproduce_tiny.sh").read_text()
    table = text[text.index("declare -A METHOD=("):]
    table = table[:table.index("\n)")]
    return {m: args.split() for m, args in re.findall(r'\[(\w+)\]="([^"]+)"', table)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="*", help="run names (async_s0, pace_s0, …); default: all in the calibration")
    ap.add_argument("--calibration", type=Path, default=ROOT / "reports" / "sim" / "calibration.json")
    ap.add_argument("--scenario", default="tiny_cpu")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--sims", type=Path, default=ROOT / "runs" / "sim_recheck")
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "sim" / "recheck.md")
    args = ap.parse_args()
    stored = {k.split()[0]: v for k, v in json.loads(args.calibration.read_text()).items()}
    methods = method_overrides()
    lines = [f"# The calibration re-simulated with the current code ({args.calibration.name})", "",
             "`python scripts/recheck_calibration.py`: real / simulated when the calibration was made / simulated "
             "now (ratio to real).", "",
             "| run | " + " | ".join(name for name, _ in ROWS) + " |", "| --- |" + " --- |" * len(ROWS)]
    for name in args.runs or list(stored):
        if name not in stored:
            raise SystemExit(f"error: {name}: not in {args.calibration} (it has {', '.join(stored)})")
        method, seed = name.rsplit("_s", 1)
        run_dir = args.sims / name
        shutil.rmtree(run_dir, ignore_errors=True)  # run directories are appended to
        subprocess.run([sys.executable, "simulate.py", *methods[method], f"seed={seed}", f"trainer.steps={args.steps}",
                        f"+sim={args.scenario}", "logger.progress=false", f"hydra.run.dir={run_dir}"],
                       cwd=ROOT, check=True, capture_output=True)
        run = load_local(run_dir)
        cells = []
        for row, fn in ROWS:
            real, then, now = stored[name][row]["real"], stored[name][row]["sim"], float(fn(run))
            ratio = (lambda x: f"{x / real:.2f}") if real else (lambda x: "=" if x == real else "∞")
            cells.append(f"{real:.3g} / {then:.3g} ({ratio(then)}) / {now:.3g} ({ratio(now)})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
