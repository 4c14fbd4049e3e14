"""The paper-scenario report (issue #20): what the simulator predicts for the paper's settings, and
which inputs reproduce the paper's Figure 8 (Async 26.19 s, PACE 28.22 s / raw 26.50 s, Sync 97.01 s).

    python scripts/sim_paper.py                       # ~10 min on one core → reports/sim/paper.md + figures
    python scripts/sim_paper.py --steps 40 --grid-steps 40 --runs /tmp/sp --out /tmp/sp_report   # quicker

Part A, the presets as configured: Qwen3-8B / 4B DAPO and the 30B-A3B MoE (`+exp=<method>_<model>
+sim=<model>`: B = 512, G = 16, 20k-token cap) on the layouts of the scale-out issue, 4 rollout + 4
trainer GPUs and 6 + 2; Sync, Async, PACE raw and PACE (effective). Each writes a run directory
(runs/sim_paper/<model>_<layout>/<method>) and `analysis.build` draws its figures (Figure 8: wall
time per step by phase; Figures 6/7: retained vs rejected, consumed staleness).

Part B, Figure 8 backwards: the 8B scenario on 4 + 4 GPUs with the batch B, a scale of the
response lengths and the number of engines varied; per cell the four step times, compared with
the paper's by their ratios. The cells closest to the paper say what its numbers imply about its
batch, lengths and hardware; the closest in which PACE rejects is run again with run directories and
figures (its values are conf/sim/qwen3_8b_fig8.yaml, the scenario of the sweep in scripts/sim_sweep.sh).

Every value the scenarios use is in conf/sim/<model>.yaml with its source (roofline estimates, not
measurements); a layout scales the trainer's per-step and per-token seconds by 4 / its GPUs.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from tqdm import tqdm  # noqa: E402

from pace.config import register as register_run  # noqa: E402
from pace.records import Fate  # noqa: E402
from pace.sim.config import register, validate_sim  # noqa: E402
from pace.sim.run import Simulation  # noqa: E402

PAPER = {"sync": 97.01, "async": 26.19, "pace_raw": 26.50, "pace": 28.22}  # Figure 8, s/step
METHODS = {"sync": ("sync", []), "async": ("async", []), "pace_raw": ("pace", ["pace.score=raw"]), "pace": ("pace", [])}
NAMES = {"sync": "Sync", "async": "Async", "pace_raw": "PACE (raw)", "pace": "PACE"}
# (model, layout, engines, trainer GPUs): the presets' 4 + 4 and the scale-out issue's 6 + 2 (the MoE's
# engines are tensor-parallel pairs: 2 engines = 4 GPUs)
LAYOUTS = [("qwen3_8b", "4+4", 4, 4), ("qwen3_8b", "6+2", 6, 2), ("qwen3_4b", "4+4", 4, 4), ("qwen3_4b", "6+2", 6, 2),
           ("qwen3_30b_a3b", "4+4", 2, 4), ("qwen3_30b_a3b", "6+2", 3, 2)]
WARMUP = 5


def config(model: str, method: str, steps: int, trainer_gpus: int, *overrides: str):
    pool, extra = METHODS[method]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("simulate", overrides=[f"+exp={pool}_{model}", f"+sim={model}", f"trainer.steps={steps}",
                                             "logger.mode=disabled", "eval.every=0", *extra, *overrides])
    t = cfg.sim.trainer  # the scenario's trainer is 4 GPUs: FSDP shards the optimizer and the tokens over them
    t.step_s, t.per_token_s = t.step_s * 4 / trainer_gpus, t.per_token_s * 4 / trainer_gpus
    t.step_s *= cfg.trainer.mini_batches / 16  # the scenarios' step_s is 16 optimizer updates (the presets' mini-batches)
    cfg.exp_name = f"{method}_{model}"
    validate_sim(cfg)
    return cfg


def simulate(cfg, run_dir: Path | None = None) -> dict:
    """Mean seconds per step by phase (steps ≥ WARMUP) and the consumed groups' staleness
    percentiles; with ``run_dir``, simulate.py's run directory too."""
    rows, consumed = [], []

    def on_step(step: int, metrics: dict, decided: list) -> None:
        rows.append(metrics)
        consumed.extend(g.staleness(g.step) for g in decided if g.fate == Fate.CONSUMED)

    t = time.perf_counter()
    if run_dir is None:
        Simulation(cfg, on_step=on_step).run()
    else:
        import simulate as simulate_py

        shutil.rmtree(run_dir, ignore_errors=True)  # a run directory is appended to: start clean
        simulate_py.run(cfg, run_dir, on_step=on_step)
    mean = {k: float(np.mean([r.get(k, 0.0) for r in rows[WARMUP:]])) for k in
            ("time/step", "time/wait_data", "time/train", "time/sync", "time/generate", "time/rescore", "pool/occupancy",
             "pool/rejected", "pool/filtered", "staleness/k_mean", "staleness/k_gen_mean", "staleness/k_wait_mean",
             "rollout/tokens_per_s", "train/response_len")}
    k = np.array(consumed)
    mean["dist"] = {name: [float(x) for x in np.percentile(k[:, i], [50, 90, 99])] + [float(k[:, i].max())]
                    for i, name in enumerate(("k", "k_gen", "k_wait"))}
    mean["wall_s"] = time.perf_counter() - t
    return mean


def part_a(steps: int, runs: Path) -> list[dict]:
    out = []
    cases = [(m, lay, e, tg, meth) for m, lay, e, tg in LAYOUTS for meth in METHODS]
    for model, layout, engines, trainer_gpus, method in tqdm(cases, desc="A: presets", dynamic_ncols=True):
        cfg = config(model, method, steps, trainer_gpus, f"rollout.engines={engines}")
        run_dir = runs / f"{model}_{layout.replace('+', '-')}" / method
        out.append({"model": model, "layout": layout, "method": method, "run_dir": str(run_dir), **simulate(cfg, run_dir)})
    return out


# The rollout GPU's memory-bound decode terms and KV budget: the scenario's H100 estimates, or an H200
# (4.8 vs 3.35 TB/s of HBM: ×0.7 the weights and KV read per step; 141 vs 80 GB: ~2× the KV tokens)
HARDWARE = {"H100": (1.0, 1.0), "H200": (0.7, 2.0)}


def grid_cells() -> list[dict]:
    seqs = {0.25: 192, 0.5: 96, 1.0: 48}  # an H100's KV budget (350k tokens) over a running sequence's mean context
    return [{"B": b, "length_scale": ls, "engines": e, "gpu": hw, "max_num_seqs": seqs[ls] * int(HARDWARE[hw][1])}
            for b, ls, e, hw in itertools.product((8, 16, 32, 64), (0.25, 0.5, 1.0), (4, 8), HARDWARE)]


@functools.cache
def _engine_8b():
    return OmegaConf.load(ROOT / "conf" / "sim" / "qwen3_8b.yaml").sim.engine


def cell_overrides(c: dict) -> list[str]:
    read, kv = HARDWARE[c["gpu"]]
    e = _engine_8b()
    return [f"data.batch_prompts={c['B']}", f"rollout.max_inflight_groups={2 * c['B']}",  # the presets' 2B in flight
            f"sim.responses.length_scale={c['length_scale']}", f"rollout.engines={c['engines']}",
            f"rollout.max_num_seqs={c['max_num_seqs']}", f"trainer.mini_batches={min(16, c['B'])}",
            f"sim.engine.step_s={e.step_s * read:.6g}", f"sim.engine.per_ctx_token_s={e.per_ctx_token_s * read:.6g}",
            f"sim.engine.kv_tokens={int(e.kv_tokens * kv)}"]


def part_b(steps: int) -> list[dict]:
    out = []
    for c in tqdm(grid_cells(), desc="B: Figure 8 grid", dynamic_ncols=True):
        res = {m: simulate(config("qwen3_8b", m, steps, 4, *cell_overrides(c))) for m in METHODS}
        pred = {m: res[m]["time/step"] for m in METHODS}
        dist = math.sqrt(np.mean([math.log(pred[m] / PAPER[m]) ** 2 for m in METHODS]))
        out.append({**c, "step": pred, "distance": dist, "train": res["async"]["time/train"],
                    "response_len": res["async"]["train/response_len"], "pace_rejected": res["pace"]["pool/rejected"],
                    "rescore": res["pace"]["time/rescore"], "async_k_wait": res["async"]["staleness/k_wait_mean"],
                    "sync_wait": res["sync"]["time/wait_data"]})
    return sorted(out, key=lambda r: r["distance"])


def _closest_rejecting(b: list[dict]) -> dict:
    """The grid cell closest to the paper among those where PACE rejects (≥ 0.5 groups per step):
    Figures 6 and 8 need rejections; the closest of all is the first row of the table."""
    return next((r for r in b if r["pace_rejected"] >= 0.5), b[0])


def build_figures(dirs: list[str], out: Path) -> None:
    subprocess.run([sys.executable, "-m", "analysis.build", *dirs, "--out", str(out)], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)


def _row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _pct(d: list[float]) -> str:
    return f"{d[0]:.1f} / {d[1]:.1f} / {d[3]:.0f}"  # p50 / p90 / max


def write_report(a: list[dict], b: list[dict], best: list[dict], out: Path, args) -> None:
    lines = ["# Paper scenarios: predicted step times and staleness (issue #20)", "",
             f"`python scripts/sim_paper.py --steps {args.steps} --grid-steps {args.grid_steps}` (written by the script; "
             "the reading of these numbers is in [README.md](README.md)). Means over steps ≥ 5; staleness of the consumed "
             "groups (p50 / p90 / max). Every input is an estimate with its source in `conf/sim/<model>.yaml`; nothing "
             "here was measured on a GPU.", ""]
    if a:
        lines += ["## A. The presets as configured (B = 512, G = 16, cap 20,480)", "",
                  _row("model", "GPUs rollout+trainer", "method", "s/step", "wait", "train", "sync", "generate (overlapped)",
                       "pool", "rejected/step", "K p50/p90/max", "K_gen p50/p90/max", "K_wait p50/p90/max", "tokens/s"),
                  _row(*["---"] * 3, *["---:"] * 7, *["---"] * 3, "---:")]
        for r in a:
            d = r["dist"]
            lines.append(_row(r["model"], r["layout"], NAMES[r["method"]], f"{r['time/step']:.0f}", f"{r['time/wait_data']:.0f}",
                              f"{r['time/train']:.0f}", f"{r['time/sync']:.1f}", f"{r['time/generate']:.0f}",
                              f"{r['pool/occupancy']:.0f}", f"{r['pool/rejected']:.1f}", _pct(d["k"]), _pct(d["k_gen"]),
                              _pct(d["k_wait"]), f"{r['rollout/tokens_per_s']:,.0f}"))
        step = {(r["model"], r["layout"], r["method"]): r["time/step"] for r in a}
        ratios = ", ".join(f"{m} {lay} {step[m, lay, 'sync'] / step[m, lay, 'async']:.2f}" for m, lay, _, _ in LAYOUTS)
        figs = ", ".join(f"[{m} {lay}](paper_{m}_{lay.replace('+', '-')}/walltime.png)" for m, lay, _, _ in LAYOUTS)
        lines += ["", f"Sync / Async step-time ratio: {ratios} (paper: 97.01 / 26.19 = 3.70).", "",
                  f"Figures (`python -m analysis.build`, one directory per model and layout): {figs}; each directory also "
                  "has consumed_staleness.png (Figure 7) and pace_staleness.png (Figure 6).", ""]
    if b:
        p = PAPER
        lines += ["## B. Figure 8 backwards: the 8B scenario (trainer on 4 GPUs), with B, the response lengths and the "
                  "rollout GPUs varied", "",
                  "Distance: the root mean square of log(predicted / paper) over the four step times (0 = all four equal to "
                  "the paper's; 0.1 ≈ 10% off on average). `length scale` multiplies the scenario's lengths (mean consumed "
                  "response length in the next column); `max_num_seqs` is set from the KV budget for that length.", "",
                  _row("distance", "B", "length scale", "mean len", "rollout GPUs", "GPU", "Sync", "Async", "PACE raw", "PACE",
                       "Sync/Async", "PACE/Async", "PACE raw/Async", "train", "PACE rejected/step", "rescoring s/step"),
                  _row(*["---:"] * 5, "---", *["---:"] * 10),
                  _row("paper", "", "", "", "", "", p["sync"], p["async"], p["pace_raw"], p["pace"],
                       f"{p['sync'] / p['async']:.2f}", f"{p['pace'] / p['async']:.3f}", f"{p['pace_raw'] / p['async']:.3f}",
                       "", "", "")]
        for r in b:
            t = r["step"]
            lines.append(_row(f"{r['distance']:.2f}", r["B"], r["length_scale"], f"{r['response_len']:,.0f}", r["engines"],
                              r["gpu"], *(f"{t[m]:.1f}" for m in METHODS), f"{t['sync'] / t['async']:.2f}",
                              f"{t['pace'] / t['async']:.3f}", f"{t['pace_raw'] / t['async']:.3f}", f"{r['train']:.1f}",
                              f"{r['pace_rejected']:.1f}", f"{r['rescore']:.2f}"))
    if best:
        c = _closest_rejecting(b)
        lines += ["", f"The closest cell in which PACE rejects (B = {c['B']}, length scale {c['length_scale']}, {c['engines']} "
                  f"{c['gpu']} rollout GPUs, distance {c['distance']:.2f}; `conf/sim/qwen3_8b_fig8.yaml`), run again for "
                  f"{args.steps} steps with run directories: [walltime.png](paper_fig8/walltime.png) "
                  "(Figure 8), [consumed_staleness.png](paper_fig8/consumed_staleness.png), "
                  "[pace_staleness.png](paper_fig8/pace_staleness.png).", "",
                  _row("method", "s/step", "wait", "train", "sync", "pool", "rejected/step", "K p50/p90/max", "K_gen p50/p90/max",
                       "K_wait p50/p90/max"),
                  _row("---", *["---:"] * 6, "---", "---", "---")]
        for r in best:
            d = r["dist"]
            lines.append(_row(NAMES[r["method"]], f"{r['time/step']:.1f}", f"{r['time/wait_data']:.1f}", f"{r['time/train']:.1f}",
                              f"{r['time/sync']:.1f}", f"{r['pool/occupancy']:.0f}", f"{r['pool/rejected']:.1f}", _pct(d["k"]),
                              _pct(d["k_gen"]), _pct(d["k_wait"])))
    (out / "paper.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="steps of each part-A run and of the closest cell's runs")
    ap.add_argument("--grid-steps", type=int, default=60, help="steps of each part-B run")
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "sim_paper")
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "sim")
    ap.add_argument("--parts", default="AB", help="A (presets), B (Figure 8 grid) or both")
    args = ap.parse_args()
    register_run()
    register()
    args.out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    a = part_a(args.steps, args.runs) if "A" in args.parts else []
    for model, layout, _, _ in LAYOUTS if a else []:
        key = f"{model}_{layout.replace('+', '-')}"
        build_figures([r["run_dir"] for r in a if (r["model"], r["layout"]) == (model, layout)], args.out / f"paper_{key}")
    b = part_b(args.grid_steps) if "B" in args.parts else []
    best = []
    if b:
        c = _closest_rejecting(b)
        for m in METHODS:
            cfg = config("qwen3_8b", m, args.steps, 4, *cell_overrides(c))
            best.append({"method": m, "run_dir": str(args.runs / "fig8" / m), **simulate(cfg, args.runs / "fig8" / m)})
        build_figures([r["run_dir"] for r in best], args.out / "paper_fig8")
    write_report(a, b, best, args.out, args)
    (args.out / "paper.json").write_text(json.dumps({"A": a, "B": b, "closest": best}, indent=1))
    print(f"{args.out / 'paper.md'} in {time.perf_counter() - t:.0f} s")


if __name__ == "__main__":
    main()
