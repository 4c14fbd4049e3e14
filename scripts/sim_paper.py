"""The paper-scenario report: what the simulator predicts for the paper presets on their node, and
which inputs reproduce the paper's Figure 8 (Async 26.19 s, PACE 28.22 s / raw 26.50 s, Sync 97.01 s).

    python scripts/sim_paper.py                       # ~25 min on 2 shared cores → reports/sim/paper.md + figures
    python scripts/sim_paper.py --a-steps 60 --grid-steps 40 --runs /tmp/sp --out /tmp/sp_report   # quicker
    python scripts/sim_paper.py --parts S             # ~2 min: the weight sync full vs delta → reports/sim/weight_delta.md

Part A, the presets as configured (`+exp=<method>_<preset> +sim=<scenario>`, each preset on its
own scenario, nothing else overridden: the run's own validation cadence included): the paper's step
(B = 32 prompts × 16, one optimizer update per version) for the four paper settings — Qwen3-8B on 4
rollout + 4 trainer H200s, the 8B on H100s (5 + 3), Qwen3-4B (5 + 3 H200s) and Qwen3-30B-A3B (8
trainer H200s + 4 engines of TP 2 on a second node) — beside DAPO's 512-prompt step
(`*_qwen3_8b_dapo512`, 16 updates per version). Sync, Async, PACE raw and PACE; each writes a run
directory (runs/sim_paper/<row>/<method>) and `analysis.build` draws its figures (Figure 8: wall
time per step by phase; Figures 6/7: retained vs rejected, consumed staleness). Hours for 300
steps are the simulated wall time of the run, per 300 steps. The check table says, per paper
setting, whether the comparison the paper makes exists there: Async's pool past n*, PACE
rejecting in ≥ 25% of steps ≥ 5, PACE/Async ≤ 1.10, Sync/Async ≥ 1.5.

Part B, Figure 8 backwards: the 8B scenario on 4 trainer GPUs with the batch B, a scale of the
response lengths, the number of engines and the GPU varied (DAPO's 16 updates per version, the
grid's setting since it was made); per cell the four step times, compared with the paper's by their
ratios. The closest cell in which PACE rejects is run again with run directories and figures (its
values are conf/sim/qwen3_8b_fig8.yaml).

Part S, delta weight sync: the four paper settings' Sync, Async and PACE presets as in part A, with
every sync full (`rollout.weight_delta=false`, the presets) and with deltas after the first
(`rollout.weight_delta=true`); the sync's seconds from its bytes (pace/sim/sync.py).

Every value the scenarios use is in conf/sim/<scenario>.yaml with its source (roofline estimates,
not measurements), for the placement of the preset the scenario is named after.
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

if __name__ == "__main__":  # the script and its simulate.py children: one thread each (not when a test imports it)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from tqdm import tqdm  # noqa: E402

from pace.config import register as register_run  # noqa: E402
from pace.config import target_pool  # noqa: E402
from pace.records import Fate  # noqa: E402
from pace.sim.config import register, validate_sim  # noqa: E402
from pace.sim.run import Simulation  # noqa: E402
from pace.sim.sync import SyncModel  # noqa: E402

PAPER = {"sync": 97.01, "async": 26.19, "pace_raw": 26.50, "pace": 28.22}  # Figure 8, s/step
METHODS = {"sync": ("sync", []), "async": ("async", []), "pace_raw": ("pace", ["pace.score=raw"]), "pace": ("pace", [])}
NAMES = {"sync": "Sync", "async": "Async", "pace_raw": "PACE (raw)", "pace": "PACE"}
# Part A's rows: (label = preset suffix, scenario, node as rollout + trainer GPUs). The four paper
# settings first (PAPER_SETTINGS: the check table), each preset on its own scenario, then DAPO's step.
ROWS = [("qwen3_8b", "qwen3_8b", "4 + 4 H200"),
        ("qwen3_8b_h100", "qwen3_8b_h100", "5 + 3 H100"),
        ("qwen3_4b", "qwen3_4b", "5 + 3 H200"),
        ("qwen3_30b_a3b", "qwen3_30b_a3b", "4 × TP2 (node 1) + 8 H200"),
        ("qwen3_8b_dapo512", "qwen3_8b", "4 + 4 H200")]
PAPER_SETTINGS = ("qwen3_8b", "qwen3_8b_h100", "qwen3_4b", "qwen3_30b_a3b")
# What "the paper's comparison exists" means here (the check table): PACE rejects in at least this
# share of steps ≥ WARMUP, costs at most this over Async, and Sync is at least this much slower.
CHECK = {"rejecting_steps": 0.25, "pace_over_async": 1.10, "sync_over_async": 1.5}
WARMUP = 5


def config(preset: str, scenario: str, method: str, steps: int, *overrides: str):
    pool, extra = METHODS[method]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("simulate", overrides=[f"+exp={pool}_{preset}", f"+sim={scenario}", f"trainer.steps={steps}",
                                             "logger.mode=disabled", *extra, *overrides])
    cfg.exp_name = f"{method}_{preset}"
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
        sim = Simulation(cfg, on_step=on_step)
        sim.run()
        total_s = sim.now
    else:
        import simulate as simulate_py

        shutil.rmtree(run_dir, ignore_errors=True)  # a run directory is appended to: start clean
        total_s = simulate_py.run(cfg, run_dir, on_step=on_step)["sim"]["sim_s"]
    mean = {k: float(np.mean([r.get(k, 0.0) for r in rows[WARMUP:]])) for k in
            ("time/step", "time/wait_data", "time/train", "time/sync", "time/generate", "time/rescore", "pool/occupancy",
             "pool/rejected", "pool/filtered", "staleness/k_mean", "staleness/k_gen_mean", "staleness/k_wait_mean",
             "rollout/tokens_per_s", "train/response_len", "sync/pause_s")}
    mean["rejecting_steps"] = float(np.mean([r.get("pool/rejected", 0) > 0 for r in rows[WARMUP:]]))
    mean["pool_max"] = float(max(r.get("pool/occupancy", 0) for r in rows[WARMUP:]))
    mean["n_star"] = target_pool(cfg)
    mean["hours_per_300"] = total_s / len(rows) * 300 / 3600  # the run's simulated wall time, per 300 steps
    k = np.array(consumed)
    mean["dist"] = {name: [float(x) for x in np.percentile(k[:, i], [50, 90, 99])] + [float(k[:, i].max())]
                    for i, name in enumerate(("k", "k_gen", "k_wait"))}
    mean["wall_s"] = time.perf_counter() - t
    return mean


def part_a(steps: int, runs: Path) -> list[dict]:
    out = []
    cases = [(*row, meth) for row in ROWS for meth in METHODS]
    for label, scenario, node, method in tqdm(cases, desc="A: presets", dynamic_ncols=True):
        cfg = config(label, scenario, method, steps)
        run_dir = runs / label / method
        out.append({"row": label, "preset": label, "scenario": scenario, "node": node, "method": method,
                    "B": cfg.data.batch_prompts, "updates": cfg.trainer.mini_batches, "run_dir": str(run_dir),
                    **simulate(cfg, run_dir)})
    return out


# The rollout GPU's memory-bound decode terms and KV budget: the scenario's H100 estimates, or an H200
# (4.8 vs 3.35 TB/s of HBM: ×0.7 the weights and KV read per step; 141 vs 80 GB: ~2× the KV tokens)
HARDWARE = {"H100": (1.0, 1.0), "H200": (0.7, 2.0)}


def grid_cells() -> list[dict]:
    seqs = {0.25: 192, 0.5: 96, 1.0: 48}  # an H100's KV budget (350k tokens) over a running sequence's mean context
    return [{"B": b, "length_scale": ls, "engines": e, "gpu": hw, "max_num_seqs": seqs[ls] * int(HARDWARE[hw][1])}
            for b, ls, e, hw in itertools.product((8, 16, 32, 64), (0.25, 0.5, 1.0), (4, 8), HARDWARE)]


@functools.cache
def _engine_h100():
    return OmegaConf.load(ROOT / "conf" / "sim" / "qwen3_8b_h100.yaml").sim.engine


def cell_overrides(c: dict) -> list[str]:
    read, kv = HARDWARE[c["gpu"]]
    e = _engine_h100()
    return [f"data.batch_prompts={c['B']}", f"rollout.max_inflight_groups={2 * c['B']}",  # 2B in flight (the grid's choice since it was made)
            f"sim.responses.length_scale={c['length_scale']}", f"rollout.engines={c['engines']}",
            f"rollout.max_num_seqs={c['max_num_seqs']}", f"trainer.mini_batches={min(16, c['B'])}",
            f"sim.engine.step_s={e.step_s * read:.6g}", f"sim.engine.per_ctx_token_s={e.per_ctx_token_s * read:.6g}",
            f"sim.engine.kv_tokens={int(e.kv_tokens * kv)}"]


def part_b(steps: int) -> list[dict]:
    out = []
    for c in tqdm(grid_cells(), desc="B: Figure 8 grid", dynamic_ncols=True):
        res = {m: simulate(config("qwen3_8b", "qwen3_8b", m, steps, "eval.every=0", *cell_overrides(c))) for m in METHODS}
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


PAPER_HOURS = {m: PAPER[m] * 300 / 3600 for m in PAPER}  # Figure 8's s/step × 300 steps


def check(by: dict, label: str) -> dict:
    """The paper setting ``label`` against CHECK: the numbers and whether each holds."""
    t = {m: by[label, m]["time/step"] for m in ("sync", "async", "pace")}  # PACE (raw) is reported, not checked
    a, p = by[label, "async"], by[label, "pace"]
    out = {"async": t["async"], "sync_over_async": t["sync"] / t["async"], "pace_over_async": t["pace"] / t["async"],
           "rejecting_steps": p["rejecting_steps"], "rejected": p["pool/rejected"], "pool_max": a["pool_max"],
           "n_star": p["n_star"], "hours": {m: by[label, m]["hours_per_300"] for m in ("async", "pace", "sync")}}
    out["holds"] = (out["pool_max"] > out["n_star"] and out["rejecting_steps"] >= CHECK["rejecting_steps"]
                    and out["pace_over_async"] <= CHECK["pace_over_async"]
                    and out["sync_over_async"] >= CHECK["sync_over_async"])
    return out


def part_a_lines(a: list[dict], args) -> list[str]:
    by = {(r["row"], r["method"]): r for r in a}
    node = {label: n for label, _, n in ROWS}
    ph = PAPER_HOURS
    lines = ["## A. The presets as configured", "",
             f"`python simulate.py +exp=<method>_<preset> +sim=<scenario> trainer.steps={args.a_steps}` for each row, "
             "each preset on its own scenario, nothing else overridden (the presets' in-training validation included: "
             "it holds weight loads for `sim.trainer.val_s`). The paper's step is B = 32 prompts × 16 responses and one "
             "optimizer update per policy version; `dapo512` is DAPO's step, 512 prompts and 16 updates per version. "
             "Hours: the simulated wall time of the run, per 300 steps. The paper row's hours are Figure 8's seconds per "
             f"step × 300 (PACE {ph['pace']:.2f} h); the paper's 2 h 54 min is its PACE run's time to its peak "
             "accuracy, not a 300-step time, and is not compared here.", "",
             "### Does the paper's comparison exist in each setting?", "",
             f"What the paper shows in all four settings, PACE ≠ Async, needs a pool past n* under Async, PACE "
             f"rejecting in ≥ {CHECK['rejecting_steps']:.0%} of steps ≥ {WARMUP}, PACE/Async ≤ "
             f"{CHECK['pace_over_async']:.2f} and Sync clearly slower (Sync/Async ≥ {CHECK['sync_over_async']}).", "",
             _row("setting", "preset / scenario", "node (rollout + trainer)", "Async s/step", "Sync/Async", "PACE/Async",
                  "PACE rejects (steps ≥ 5)", "rejected/step", "Async pool max / n*", "Async h/300", "PACE h/300",
                  "Sync h/300", "holds"),
             _row("---", "---", "---", *["---:"] * 9, "---"),
             _row("paper (Figure 8; 2 h 54 min to PACE's peak)", "", "", PAPER["async"],
                  f"{PAPER['sync'] / PAPER['async']:.2f}", f"{PAPER['pace'] / PAPER['async']:.3f}", "", "", "",
                  f"{ph['async']:.2f}", f"{ph['pace']:.2f}", f"{ph['sync']:.2f}", "")]
    for label in PAPER_SETTINGS:
        if (label, "async") not in by:
            continue
        c = check(by, label)
        h = c["hours"]
        lines.append(_row(label, f"`*_{label}` / `{by[label, 'async']['scenario']}`", node[label], f"{c['async']:.1f}",
                          f"{c['sync_over_async']:.2f}", f"{c['pace_over_async']:.3f}", f"{100 * c['rejecting_steps']:.0f}%",
                          f"{c['rejected']:.2f}", f"{c['pool_max']:.0f} / {c['n_star']}", f"{h['async']:.2f}",
                          f"{h['pace']:.2f}", f"{h['sync']:.2f}", "yes" if c["holds"] else "**no**"))
    lines += ["", "### Step time per method, and the ratios", "",
              _row("preset", "scenario", "node (rollout + trainer)", "B × updates", "Sync s/step", "Async", "PACE raw",
                   "PACE", "Sync/Async", "PACE/Async", "PACE raw/Async", "Async h/300", "PACE h/300", "Sync h/300"),
              _row("---", "---", "---", "---", *["---:"] * 10),
              _row("paper (Figure 8; hours = s/step × 300)", "", "", "", PAPER["sync"], PAPER["async"], PAPER["pace_raw"],
                   PAPER["pace"], f"{PAPER['sync'] / PAPER['async']:.2f}", f"{PAPER['pace'] / PAPER['async']:.3f}",
                   f"{PAPER['pace_raw'] / PAPER['async']:.3f}", f"{ph['async']:.2f}", f"{ph['pace']:.2f}", f"{ph['sync']:.2f}")]
    for label, scenario, nd in ROWS:
        if (label, "async") not in by:
            continue
        t = {m: by[label, m]["time/step"] for m in METHODS}
        h = {m: by[label, m]["hours_per_300"] for m in METHODS}
        r = by[label, "async"]
        lines.append(_row(label, scenario, nd, f"{r['B']} × {r['updates']}", *(f"{t[m]:.1f}" for m in METHODS),
                          f"{t['sync'] / t['async']:.2f}", f"{t['pace'] / t['async']:.3f}",
                          f"{t['pace_raw'] / t['async']:.3f}", f"{h['async']:.2f}", f"{h['pace']:.2f}", f"{h['sync']:.2f}"))
    lines += ["", "### Phases, the pool and staleness", "",
              _row("preset", "method", "s/step", "wait", "train", "sync", "pool", "rejected/step", "steps rejecting",
                   "K p50/p90/max", "K_gen p50/p90/max", "K_wait p50/p90/max", "tokens/s", "mean response"),
              _row("---", "---", *["---:"] * 7, "---", "---", "---", "---:", "---:")]
    for r in a:
        d = r["dist"]
        lines.append(_row(r["row"], NAMES[r["method"]], f"{r['time/step']:.1f}", f"{r['time/wait_data']:.1f}",
                          f"{r['time/train']:.1f}", f"{r['time/sync']:.1f}", f"{r['pool/occupancy']:.0f}",
                          f"{r['pool/rejected']:.2f}", f"{100 * r['rejecting_steps']:.0f}%", _pct(d["k"]),
                          _pct(d["k_gen"]), _pct(d["k_wait"]), f"{r['rollout/tokens_per_s']:,.0f}",
                          f"{r['train/response_len']:,.0f}"))
    figs = ", ".join(f"[{label}](paper_{label}/walltime.png)" for label, *_ in ROWS)
    return lines + ["", f"Figures (`python -m analysis.build`, one directory per row): {figs}; each directory also "
                    "has consumed_staleness.png (Figure 7) and pace_staleness.png (Figure 6).", ""]



def part_s(steps: int) -> list[dict]:
    out = []
    cases = [(label, scenario, m, delta) for label, scenario, _ in ROWS if label in PAPER_SETTINGS
             for m in ("sync", "async", "pace") for delta in (False, True)]
    for label, scenario, method, delta in tqdm(cases, desc="S: weight delta", dynamic_ncols=True):
        cfg = config(label, scenario, method, steps, f"rollout.weight_delta={str(delta).lower()}")
        model = SyncModel(cfg)
        first, second = model.sync(1), model.sync(2)  # a full sync, then (with deltas) a delta
        out.append({"row": label, "method": method, "weight_delta": delta, "full_s": first.seconds,
                    "delta_s": second.seconds, "delta_pause_s": second.pause_s, "full_pause_s": first.pause_s,
                    "full_gb": first.bytes / 1e9, "delta_gb": second.bytes / 1e9, **simulate(cfg)})
    return out


def write_sync_report(s: list[dict], out: Path, args) -> None:
    by = {(r["row"], r["method"], r["weight_delta"]): r for r in s}
    lines = ["# Delta weight sync: predicted sync seconds and step times", "",
             f"`python scripts/sim_paper.py --parts S --a-steps {args.a_steps}` (written by the script). Each paper "
             "preset on its own scenario as in paper.md part A, with `rollout.weight_delta=false` (every sync full, the "
             "presets) and `=true` (deltas after the first sync; a full one every `rollout.full_sync_every` = 100 versions). "
             "A sync's seconds = `sim.sync.fixed_s` + bytes / `sim.sync.gb_per_s`; a delta sends an int32 index + the bf16 "
             "value per changed element (`sim.sync.changed_frac` of them); the engines' pause scales alike "
             "(pace/sim/sync.py). Means over steps ≥ 5. **Estimates**: the full sync is the scenarios' assumed value, "
             "its split and the changed fraction are from verl's delta_sharded measurements (docs/simulator.md); "
             "nothing here was measured on a GPU.", "",
             _row("setting", "method", "GB full / delta", "sync s full / delta", "pause s full / delta",
                  "time/sync per step, delta", "s/step full", "s/step delta", "delta/full", "h/300 full", "h/300 delta"),
             _row("---", "---", *["---:"] * 9)]
    for label in PAPER_SETTINGS:
        for m in ("sync", "async", "pace"):
            if (label, m, True) not in by:
                continue
            f, d = by[label, m, False], by[label, m, True]
            lines.append(_row(label, NAMES[m], f"{d['full_gb']:.1f} / {d['delta_gb']:.2f}",
                              f"{d['full_s']:.2f} / {d['delta_s']:.2f}", f"{d['full_pause_s']:.2f} / {d['delta_pause_s']:.2f}",
                              f"{d['time/sync']:.2f}", f"{f['time/step']:.1f}", f"{d['time/step']:.1f}",
                              f"{d['time/step'] / f['time/step']:.3f}", f"{f['hours_per_300']:.2f}",
                              f"{d['hours_per_300']:.2f}"))
    lines += ["", "Does the paper's comparison still exist (part A's check) with deltas?", "",
              _row("setting", "PACE rejects full / delta", "Async pool max / n*, full / delta", "PACE/Async full / delta",
                   "Sync/Async full / delta", "holds full / delta"), _row("---", *["---:"] * 4, "---")]
    for label in PAPER_SETTINGS:
        if (label, "pace", True) not in by:
            continue
        c = [check({(label, m): by[label, m, delta] for m in ("sync", "async", "pace")}, label) for delta in (False, True)]
        lines.append(_row(label, " / ".join(f"{100 * x['rejecting_steps']:.0f}%" for x in c),
                          " / ".join(f"{x['pool_max']:.0f}" for x in c) + f" (n* = {c[0]['n_star']})",
                          " / ".join(f"{x['pace_over_async']:.3f}" for x in c),
                          " / ".join(f"{x['sync_over_async']:.2f}" for x in c),
                          " / ".join("yes" if x["holds"] else "**no**" for x in c)))
    (out / "weight_delta.md").write_text("\n".join(lines) + "\n")


def write_report(a: list[dict], b: list[dict], best: list[dict], out: Path, args) -> None:
    lines = ["# Paper scenarios: predicted step times and staleness", "",
             f"`python scripts/sim_paper.py --a-steps {args.a_steps} --steps {args.steps} --grid-steps {args.grid_steps}` "
             "(written by the script; "
             "the reading of these numbers is in [README.md](README.md)). Means over steps ≥ 5; staleness of the consumed "
             "groups (p50 / p90 / max). Every input is an estimate with its source in `conf/sim/<scenario>.yaml`; nothing "
             "here was measured on a GPU.", ""]
    if a:
        lines += part_a_lines(a, args)
    if b:
        p = PAPER
        lines += ["## B. Figure 8 backwards: the 8B scenario (trainer on 4 GPUs), with B, the response lengths and the "
                  "rollout GPUs varied", "",
                  "Distance: the root mean square of log(predicted / paper) over the four step times (0 = all four equal to "
                  "the paper's; 0.1 ≈ 10% off on average). `length scale` multiplies the scenario's lengths (mean consumed "
                  "response length in the next column); `max_num_seqs` is set from the KV budget for that length. Every "
                  "cell takes min(16, B) optimizer updates per policy version (`trainer.mini_batches`, DAPO's 16 "
                  "mini-batches; the paper's step, and part A's presets, take one): 16 for B ≥ 16, 8 for B = 8; 2B "
                  "groups in flight; no in-training validation.", "",
                  _row("distance", "B", "updates/version", "length scale", "mean len", "rollout GPUs", "GPU", "Sync", "Async",
                       "PACE raw", "PACE", "Sync/Async", "PACE/Async", "PACE raw/Async", "train", "PACE rejected/step",
                       "rescoring s/step"),
                  _row(*["---:"] * 6, "---", *["---:"] * 10),
                  _row("paper", "", "1", "", "", "", "", p["sync"], p["async"], p["pace_raw"], p["pace"],
                       f"{p['sync'] / p['async']:.2f}", f"{p['pace'] / p['async']:.3f}", f"{p['pace_raw'] / p['async']:.3f}",
                       "", "", "")]
        for r in b:
            t = r["step"]
            lines.append(_row(f"{r['distance']:.2f}", r["B"], min(16, r["B"]), r["length_scale"], f"{r['response_len']:,.0f}", r["engines"],
                              r["gpu"], *(f"{t[m]:.1f}" for m in METHODS), f"{t['sync'] / t['async']:.2f}",
                              f"{t['pace'] / t['async']:.3f}", f"{t['pace_raw'] / t['async']:.3f}", f"{r['train']:.1f}",
                              f"{r['pace_rejected']:.1f}", f"{r['rescore']:.2f}"))
    if best:
        c = _closest_rejecting(b)
        lines += ["", f"The closest cell in which PACE rejects (B = {c['B']}, {min(16, c['B'])} updates per version, length scale {c['length_scale']}, {c['engines']} "
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
    ap.add_argument("--a-steps", type=int, default=300, help="steps of each part-A run (the presets' 300)")
    ap.add_argument("--steps", type=int, default=60, help="steps of the closest cell's runs (part B)")
    ap.add_argument("--grid-steps", type=int, default=60, help="steps of each part-B run")
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "sim_paper")
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "sim")
    ap.add_argument("--parts", default="ABS", help="any of A (presets), B (Figure 8 grid), S (weight delta)")
    args = ap.parse_args()
    register_run()
    register()
    args.out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    a = part_a(args.a_steps, args.runs) if "A" in args.parts else []
    for label, *_ in ROWS if a else []:
        build_figures([r["run_dir"] for r in a if r["row"] == label], args.out / f"paper_{label}")
    b = part_b(args.grid_steps) if "B" in args.parts else []
    if "S" in args.parts:
        s = part_s(args.a_steps)
        write_sync_report(s, args.out, args)
        (args.out / "weight_delta.json").write_text(json.dumps(s, indent=1))
        print(f"{args.out / 'weight_delta.md'} in {time.perf_counter() - t:.0f} s")
    if not (a or b):
        return  # paper.md is parts A and B: not rewritten without them
    best = []
    if b:
        c = _closest_rejecting(b)
        for m in METHODS:
            cfg = config("qwen3_8b", "qwen3_8b", m, args.steps, "eval.every=0", *cell_overrides(c))
            best.append({"method": m, "run_dir": str(args.runs / "fig8" / m), **simulate(cfg, args.runs / "fig8" / m)})
        build_figures([r["run_dir"] for r in best], args.out / "paper_fig8")
    write_report(a, b, best, args.out, args)
    by = {(r["row"], r["method"]): r for r in a}
    checks = {label: check(by, label) for label in PAPER_SETTINGS if (label, "async") in by}
    (args.out / "paper.json").write_text(json.dumps({"A": a, "check": checks, "B": b, "closest": best}, indent=1))
    print(f"{args.out / 'paper.md'} in {time.perf_counter() - t:.0f} s")


if __name__ == "__main__":
    main()
