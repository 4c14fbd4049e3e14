"""How close a simulated run (pace/sim) is to the real run it models: a table and a figure.

    python -m analysis.calibration --pair runs/tiny_study/async_s0 runs/sim_calib/async_s0 fitted \\
        --pair runs/tiny_study/sync_s0 runs/sim_calib/sync_s0 held-out --out reports/sim

Per pair, real vs simulated (and their ratio): seconds per step, trainer wait per step, tokens and
groups produced per step, pool occupancy (mean and last tenth), consumed K_wait and K_gen,
rejected and filtered groups per step. The figure draws occupancy and consumed K_wait over steps.
Writes calibration.md, calibration.json and calibration.{png,pdf} under --out.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from analysis.figures import save
from analysis.runs import Run, load_local

ROWS = [  # (name, how it is computed from a Run)
    ("s/step", lambda r: r.steps["time/step"].mean()),
    ("trainer wait s/step", lambda r: r.steps["time/wait_data"].mean()),
    ("tokens/s", lambda r: r.steps["rollout/tokens_per_s"].mean()),
    ("groups completed/step", lambda r: r.steps["rollout/groups_completed"].mean()),
    ("occupancy (mean)", lambda r: r.steps["pool/occupancy"].mean()),
    ("occupancy (last tenth)", lambda r: _tenth(r.steps["pool/occupancy"])),
    ("consumed K_wait", lambda r: r.steps["staleness/k_wait_mean"].mean()),
    ("consumed K_gen", lambda r: r.steps["staleness/k_gen_mean"].mean()),
    ("rejected/step", lambda r: r.steps["pool/rejected"].mean()),
    ("filtered/step", lambda r: r.steps["pool/filtered"].mean()),
]


def _tenth(s) -> float:
    return float(s.tail(max(1, len(s) // 10)).mean())


def compare(real: Run, sim: Run) -> dict[str, tuple[float, float]]:
    return {name: (float(f(real)), float(f(sim))) for name, f in ROWS}


def table(pairs: list[tuple[str, str, dict]]) -> str:
    head = "| quantity | " + " | ".join(f"{name} ({kind}): real / sim / ratio" for name, kind, _ in pairs) + " |"
    lines = [head, "| --- |" + " --- |" * len(pairs)]
    for q, _ in ROWS:
        cells = []
        for _, _, c in pairs:
            r, s = c[q]
            ratio = f"{s / r:.2f}" if abs(r) > 1e-9 else ("= 0" if abs(s) < 1e-9 else "—")
            cells.append(f"{r:.3g} / {s:.3g} / {ratio}")
        lines.append(f"| {q} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(pairs: list[tuple[str, str, Run, Run]]):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(pairs), figsize=(3.6 * len(pairs), 5.4), squeeze=False, sharex="col")
    for j, (name, kind, real, sim) in enumerate(pairs):
        for i, (key, what) in enumerate((("pool/occupancy", "pooled groups"), ("staleness/k_wait_mean", "consumed K_wait"))):
            ax = axes[i][j]
            ax.plot(real.steps["step"], real.steps[key], label="real", color="#4c72b0")
            ax.plot(sim.steps["step"], sim.steps[key], label="simulated", color="#dd8452", linestyle="--")
            ax.set_ylabel(what)
            if i == 0:
                ax.set_title(f"{name} ({kind})", fontsize=9)
            else:
                ax.set_xlabel("training step")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", nargs=3, action="append", metavar=("REAL", "SIM", "KIND"), required=True,
                    help="a real run directory, its simulation, and a word for the table (fitted / held-out)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    runs = [(Path(r).name, kind, load_local(r), load_local(s)) for r, s, kind in args.pair]
    compared = [(name, kind, compare(real, sim)) for name, kind, real, sim in runs]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "calibration.md").write_text(table(compared) + "\n")
    (args.out / "calibration.json").write_text(json.dumps(
        {f"{name} ({kind})": {q: {"real": r, "sim": s} for q, (r, s) in c.items()} for name, kind, c in compared},
        indent=2, default=lambda x: None if np.isnan(x) else x))
    save(figure(runs), args.out, "calibration")
    print(table(compared))


if __name__ == "__main__":
    main()
