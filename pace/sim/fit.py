"""Fit a simulator scenario to a real run's logs.

    python -m pace.sim.fit runs/tiny_study/async_s0 --name tiny_cpu --out conf/sim/tiny_cpu.yaml

Read from the run directory (metrics.jsonl, groups/*.parquet, .hydra/config.yaml), directly:
    trainer.step_s, per_token_s   least squares of the trainer's busy time per step (time/step − time/wait_data
                                  − time/sync − time/publish: the update and its bookkeeping) on the batch's tokens, from a
                                  sync run when one is given (the trainer alone)
    trainer.colocated_slowdown    busy time of an asynchronous run over that (given both kinds; else 1)
    trainer.sync_s                mean time/sync + time/publish of the steps that synced
    engine.stall_s                rollout/sync_apply_s per weight load
    responses.levels              one level per quartile of the groups' mean length: weight, mean accuracy,
                                  Beta concentration (method of moments over the groups' accuracies),
                                  median length and log-sd of the groups' lengths, and the factor of
                                  wrong responses' length (least squares of a group's mean length on its
                                  accuracy: len = m·(acc + (1 − acc)·w))
    pfs.*                         least squares of log PFS on log prefix lag (runs of pace.score=effective;
                                  otherwise the schema's defaults, marked so)
and by simulation, the engine's decode step (`engine.step_s`, `per_seq_s`, `train_slowdown`, and
`prefill_token_s` when a run rescores prefixes, PACE effective; otherwise taken = `per_seq_s`):
Nelder–Mead on their logarithms so that the simulated run's mean rollout/tokens_per_s, mean
time/step and mean time/wait_data match the run's (the engine's latency cannot be read from the
logs; its effect on them can). Prompt lengths are not logged: `--prompt-tokens`.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import OmegaConf

TARGETS = ("rollout/groups_completed", "rollout/tokens_per_s", "time/step", "time/wait_data")


def load(run_dir: Path) -> tuple[dict, pd.DataFrame, pd.DataFrame]:
    """(run config, step rows, group rows) of a run directory."""
    cfg_path = run_dir / ".hydra" / "config.yaml"
    if not cfg_path.exists() or not (run_dir / "metrics.jsonl").exists():
        raise FileNotFoundError(f"{run_dir}: not a run directory (needs metrics.jsonl and .hydra/config.yaml)")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = pd.DataFrame([r for r in rows if "time/step" in r])
    parts = sorted((run_dir / "groups").glob("part-*.parquet"))
    groups = pd.concat([pd.read_parquet(p) for p in parts], ignore_index=True) if parts else pd.DataFrame()
    return OmegaConf.to_container(OmegaConf.load(cfg_path), resolve=True), steps, groups


def _busy(cfg: dict, steps: pd.DataFrame, prompt_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens trained, seconds the trainer is busy) per step: its update and bookkeeping (logging,
    metrics), not waiting for data and not its sync or publish (modelled apart)."""
    b, g = cfg["data"]["batch_prompts"], cfg["data"]["group_size"]
    tokens = b * g * (prompt_tokens + steps["train/response_len"].to_numpy())
    return tokens, (steps["time/step"] - steps["time/wait_data"] - _update_s(steps)).to_numpy()


def _update_s(steps: pd.DataFrame) -> pd.Series:
    """Each step's weight update, modelled apart from the trainer's busy time: θ prepared (time/sync) and
    published to the engines (time/publish, logged since time/step counts it)."""
    return sum((steps[k] for k in ("time/sync", "time/publish") if k in steps), pd.Series(0.0, index=steps.index))


def fit_trainer(cfg: dict, steps: pd.DataFrame, prompt_tokens: int) -> dict:
    tokens, train = _busy(cfg, steps, prompt_tokens)
    slope, icpt = np.polyfit(tokens, train, 1) if np.ptp(tokens) > 0 else (0.0, train.mean())
    if slope < 0:  # no measurable dependence on tokens in this run: a constant step
        slope, icpt = 0.0, float(train.mean())
    synced = steps["time/sync"] > 0 if "time/sync" in steps else pd.Series(False, index=steps.index)
    return {"step_s": float(max(icpt, 1e-3)), "per_token_s": float(slope),
            "sync_s": float(_update_s(steps)[synced].mean()) if synced.any() else 0.0}


def fit_trainers(runs: list[tuple[dict, pd.DataFrame, pd.DataFrame]], prompt_tokens: int) -> dict:
    """The trainer alone from a sync run (its engines idle while it trains), and the factor by which
    the steps of the other runs (training while the engines generate) are longer: measured when
    both kinds are given, else 1 with the trainer as that run measured it."""
    alone = [r for r in runs if r[0]["pool"]["name"] == "sync"]
    shared = [r for r in runs if r[0]["pool"]["name"] != "sync"]
    cfg, steps, _ = (alone or shared)[0]
    t = fit_trainer(cfg, steps, prompt_tokens)
    t["colocated_slowdown"] = 1.0
    if alone and shared:
        tokens, busy = _busy(*shared[0][:2], prompt_tokens)
        t["colocated_slowdown"] = float(max(busy.mean() / (t["step_s"] + t["per_token_s"] * tokens.mean()), 1.0))
    return t


def fit_levels(groups: pd.DataFrame, g: int, n_levels: int = 4) -> list[dict]:
    done = groups[groups.c.notna() & (groups.lengths.map(len) == g)]
    if done.empty:
        raise ValueError(f"no complete groups of G = {g} in the run's Parquet")
    mean_len = done.len_mean.to_numpy()
    acc = done.acc_mean.to_numpy()
    edges = np.unique(np.quantile(mean_len, np.linspace(0, 1, n_levels + 1)))
    which = np.clip(np.searchsorted(edges, mean_len, side="right") - 1, 0, len(edges) - 2)
    levels = []
    for k in range(len(edges) - 1):
        at = which == k
        if not at.any():
            continue
        p, lens = float(acc[at].mean()), np.concatenate(done.lengths[at].to_numpy()).astype(float)
        # Beta-binomial: Var(k/G) = p(1−p)/G · (1 + (G − 1)/(κ + 1))
        var, binom = float(acc[at].var()), p * (1 - p) / g
        excess = (var / binom - 1) / (g - 1) if binom > 0 else 0.0
        kappa = None if excess <= 1e-6 else float(max(1 / excess - 1, 1e-3))
        # len = m·(acc + (1 − acc)·w): least squares in (m, m·w)
        x = np.stack([acc[at], 1 - acc[at]], axis=1)
        (m_right, m_wrong), *_ = np.linalg.lstsq(x, mean_len[at], rcond=None)
        w = float(m_wrong / m_right) if m_right > 0 and m_wrong > 0 else 1.0
        right = float(m_right) if m_right > 0 else float(lens.mean())
        sigma = float(np.log(lens).std())
        levels.append({"weight": round(float(at.mean()), 4), "p_correct": round(p, 4),
                       "concentration": None if kappa is None else round(kappa, 3),
                       "len_median": round(right * math.exp(-sigma**2 / 2), 2),  # log-normal: mean = median·e^{σ²/2}
                       "len_sigma": round(sigma, 4), "wrong_len_factor": round(w, 4)})
    return levels


def fit_pfs(groups: pd.DataFrame, prefix: int) -> dict | None:
    """log PFS = log scale + power · log lag (+ noise), lag the mean lag of the groups' prefixes."""
    scored = groups[groups.pfs.notna() & (groups.pfs > 0) & groups.pfs_version.notna()]
    if len(scored) < 20:
        return None
    from pace.sim.records import span_prefix_lag

    lags = np.array([np.mean([span_prefix_lag(list(s), int(v), prefix) for s in spans])
                     for spans, v in zip(scored.version_spans, scored.pfs_version)])
    pfs = scored.pfs.to_numpy()
    ok = lags > 0
    if ok.sum() < 20:
        return None
    power, log_scale = np.polyfit(np.log(lags[ok]), np.log(pfs[ok]), 1)
    resid = np.log(pfs[ok]) - (log_scale + power * np.log(lags[ok]))
    return {"scale": float(math.exp(log_scale)), "power": float(power), "noise": float(resid.std())}


def observed(steps: pd.DataFrame) -> dict[str, float]:
    return {k: float(steps[k].mean()) for k in TARGETS if k in steps}


def simulate(run_cfg: dict, sim: dict, steps: int | None = None):
    from pace.sim.config import SimRunConfig, validate_sim
    from pace.sim.run import Simulation

    base = {k: v for k, v in run_cfg.items() if k != "sim"}
    cfg = OmegaConf.merge(OmegaConf.structured(SimRunConfig), base, {"sim": sim})
    if steps is not None:
        cfg.trainer.steps = steps
    cfg.logger.mode = "disabled"
    validate_sim(cfg)
    s = Simulation(cfg)
    s.run()
    return s, pd.DataFrame(s.rows)


def loss(real: dict, rows: pd.DataFrame) -> float:
    """Squared log errors of production (groups and tokens per step) and step time, and the
    trainer's wait relative to the step (it can be ~0)."""
    sim = observed(rows)
    step = real["time/step"]
    logs = ("rollout/groups_completed", "rollout/tokens_per_s", "time/step")
    return (sum(math.log(max(sim[k], 1e-9) / real[k]) ** 2 for k in logs)
            + ((sim["time/wait_data"] - real["time/wait_data"]) / step) ** 2)


def fit(run_dirs: list[Path], name: str, prompt_tokens: int, fit_steps: int | None, empirical: bool = False,
        progress: bool = True) -> dict:
    """A scenario from one run (or several: the engine fitted to all of them at once; the trainer,
    stall and PFS from the first; the responses from all their groups)."""
    from scipy.optimize import minimize
    from tqdm import tqdm

    runs = [load(d) for d in run_dirs]
    run_cfg, steps, _ = runs[0]
    groups = pd.concat([r[2] for r in runs], ignore_index=True)
    g = run_cfg["data"]["group_size"]
    trainer = fit_trainers(runs, prompt_tokens)
    apply = steps["rollout/sync_apply_s"].to_numpy() if "rollout/sync_apply_s" in steps else np.zeros(0)
    loads = steps["rollout/engine_version"].to_numpy() if "rollout/engine_version" in steps else np.zeros(0)
    stall = float(apply[-1] / max(loads[-1], 1)) if len(apply) else 0.0  # cumulative seconds / loads
    pfs = fit_pfs(groups, run_cfg.get("pace", {}).get("prefix_tokens", 16)) if "pfs" in groups else None
    responses = {"prompt_tokens": prompt_tokens, "levels": fit_levels(groups, g)}
    if empirical:
        responses["empirical"] = str(run_dirs[0])
    sim = {"name": name, "engine": {"stall_s": stall}, "trainer": trainer, "responses": responses}
    if pfs is not None:
        sim["pfs"] = pfs
    n = fit_steps or len(steps)
    reals = [observed(r[1].head(n)) for r in runs]  # the steps the simulation covers
    real = reals[0]
    # first guess: the engine's tokens/s at its in-flight sequences, all in a per-sequence cost
    seqs = min(run_cfg["rollout"]["max_inflight_groups"] * g, run_cfg["rollout"]["max_num_seqs"])
    b0 = 1.0 / max(real["rollout/tokens_per_s"], 1e-9)
    # a PACE (effective) run among them rescores prefixes: its prefill cost is then fitted too
    rescoring = any(r[0]["pool"]["name"] == "pace" and r[0].get("pace", {}).get("score") == "effective" for r in runs)
    x0 = np.log([max(b0 * seqs * 0.1, 1e-6), b0 * 0.9, 1.5] + ([b0 * 0.3] if rescoring else []))
    bar = tqdm(desc=f"fit {' + '.join(d.name for d in run_dirs)}", disable=not progress, unit="sim")

    def objective(x):
        a, b, s, *p = np.exp(x)
        if s < 1:
            return 1e3 + (1 - s)  # the trainer never speeds the engine up
        sim["engine"] |= _engine(a, b, s, *p)
        value = sum(loss(obs, simulate(r[0], sim, n)[1]) for obs, r in zip(reals, runs))
        bar.update()
        bar.set_postfix(loss=f"{value:.4f}")
        return value

    best = minimize(objective, x0, method="Nelder-Mead", options={"xatol": 0.02, "fatol": 1e-4, "maxfev": 120})
    bar.close()
    sim["engine"] |= _engine(*np.exp(best.x))
    sims = [observed(simulate(r[0], sim, n)[1]) for r in runs]
    sources = {
        "fitted_from": [str(d) for d in run_dirs], "fit_steps": n, "fit_loss": round(float(best.fun), 5),
        "fit_evaluations": int(best.nfev),
        "engine": ("step_s, per_seq_s, train_slowdown" + (", prefill_token_s" if rescoring else "") + " by simulation "
                   "(pace/sim/fit.py)" + ("" if rescoring else "; prefill_token_s = per_seq_s (assumed)")
                   + "; stall_s = rollout/sync_apply_s per load"),
        "trainer": ("least squares of time/step - time/wait_data - time/sync on batch tokens (of a sync run if one is "
                    "given); colocated_slowdown = the other run's busy time over that (1 with one kind of run); "
                    "sync_s = mean time/sync"),
        "responses": (f"{'drawn from ' + str(run_dirs[0]) + ' (empirical); levels: ' if empirical else ''}the runs' groups "
                      f"by quartile of mean length; prompt_tokens = {prompt_tokens} (not logged: given)"),
        "pfs": "least squares of log PFS on log prefix lag" if pfs is not None else "schema defaults (the run has no PFS)",
        "observed": [{k: round(v, 4) for k, v in o.items()} for o in reals],
        "simulated": [{k: round(v, 4) for k, v in o.items()} for o in sims],
    }
    sim["sources"] = sources
    return {"run": {k: run_cfg[k] for k in ("data", "rollout", "trainer") if k in run_cfg}, "sim": sim}


def _engine(a: float, b: float, s: float, p: float | None = None) -> dict:
    """The fitted decode step. Without a rescoring run the prefill of a token is taken to cost what
    one sequence adds to a decode step (one token through the model either way: an upper bound,
    prefill batches better); with one, it is fitted."""
    return {"step_s": float(a), "per_seq_s": float(b), "prefill_token_s": float(b if p is None else p),
            "train_slowdown": float(s)}


def write_scenario(scenario: dict, out: Path) -> None:
    """A `conf/sim/<name>.yaml` (`+sim=<name>`): only `sim` (the run's own settings come from its preset)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    body = OmegaConf.to_yaml(OmegaConf.create({"sim": scenario["sim"]}))
    head = "# @package _global_\n# Fitted by `python -m pace.sim.fit` (pace/sim/fit.py); sources under sim.sources.\n"
    out.write_text(head + body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path, nargs="+", help="run directories (the engine is fitted to all of them)")
    ap.add_argument("--name", default=None, help="scenario name (default: the run directory's name)")
    ap.add_argument("--out", type=Path, default=None, help="scenario file (default: conf/sim/<name>.yaml)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--fit-steps", type=int, default=None, help="steps simulated per evaluation (default: the run's)")
    ap.add_argument("--empirical", action="store_true", help="draw the first run's logged groups instead of the levels")
    args = ap.parse_args()
    name = args.name or args.runs[0].name
    try:
        scenario = fit(args.runs, name, args.prompt_tokens, args.fit_steps, args.empirical)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    out = args.out or Path("conf/sim") / f"{name}.yaml"
    write_scenario(scenario, out)
    src = scenario["sim"]["sources"]
    print(f"{out}: observed {src['observed']}, simulated {src['simulated']}", file=sys.stderr)


if __name__ == "__main__":
    main()
