"""The paper's small-scale claims as numbers from the logs, each decided by a rule fixed here before
the study's runs are looked at: (a)–(d) first, then (e)–(h), whose rules were committed before any
run was made or read for them (git log of this file), then (i), on the KV cache kept or recomputed
at a weight update, committed before the runs that decide it (and (e) on them) were made.

Every claim is decided on an interval over seeds: one number per seed (a paired difference where
two methods are compared; runs are paired by seed), then the 95% Student-t interval of their mean,
mean ± t(0.975, n−1) · sd / √n. The verdict is three-valued:

- **holds**: the interval lies on the side the claim states;
- **does not hold**: it lies on the other side (or, for "at least as well", wholly below the margin);
- **inconclusive**: it straddles the boundary: this many seeds cannot decide (also with one seed).

(a) A larger Stale-k lag slows early optimisation. Per run: the mean rollout accuracy of completed
    groups over the first half of training (the policy being trained, sampled every step: ~B·G
    samples a step, far less noisy than a validation). Per seed: the least-squares slope of that
    number against log2(k) over the lags run. Claim: slope < 0.
(b) Without filtering a backlog forms and the Waiting Staleness of consumed data grows. Per Async
    seed: pool occupancy, and consumed K_wait, in the last tenth of the run minus the first tenth.
    Claim: both > 0 (holds if both hold; does not hold if either does not).
(c) PACE lowers K_wait and learns at least as well as Async per step at close to Async's wall time.
    Per seed, PACE minus Async of: mean consumed K_wait after `warmup` steps (claim < 0); the
    learning score, the mean validation average over the validated versions after θ_0 (the area
    under the validation curve; without validations, last-tenth rollout accuracy), claim > −MARGIN,
    does not hold when the interval is wholly below −MARGIN; and the ratio of seconds per step
    after `warmup`, claim <= 1 + TIME_SLACK. Holds if all three hold; does not hold if any does not.
(d) Effective ranking rejects fewer long responses than Raw ranking. Per run: among rejected groups,
    the share whose mean response length exceeds the median of all completed groups of that run.
    Per seed: PACE minus PACE (raw). Claim: < 0.

(e) PACE reaches its peak validation average earlier in wall time than Sync and than Async (Figure 1,
    the abstract). Per run: the training wall time (`Run.val.wall`, the time of the steps before the
    validated version) of the first validation at the run's highest validation average, θ_0 included.
    Per seed: PACE minus Sync and PACE minus Async, in seconds. Claim: both < 0 (holds if both hold;
    does not hold if either does not). Wall times are only compared between runs made with nothing
    else on the machine: a run listed as not comparable (`incomparable`: the study script's
    runs.tsv) takes its seed out of this claim. With validations every `eval.every` steps the time is
    one of a few values per run: a tie between methods needs more seeds, not a finer rule.
(f) PACE rejects staler groups (Figure 6): the rejected groups' Waiting, Generation and Effective
    Staleness lie above the retained (consumed) groups'. Per PACE run and quantity: the probability
    that a rejected group's value exceeds a retained group's, ties counted half (the Mann–Whitney
    common-language effect size, U / (n_rejected · n_retained); 0.5 = no difference). Per seed that
    number; claim: > 0.5 for K_wait, K_gen and S_eff (holds if all three hold; does not hold if any
    does not). A run that rejected nothing leaves its seed out.
(g) The score ablation (Table 1): ranking by Effective Staleness learns at least as well as by Raw
    Staleness, which learns at least as well as by Generation Staleness. Per seed: the learning
    score of (c) of PACE minus PACE (raw), and of PACE (raw) minus PACE (gen). Claim: each > −MARGIN,
    as in (c) (holds if both hold; does not hold if either interval is wholly below −MARGIN). The
    paper compares mean@32 at each run's best checkpoint; the learning score (the mean over all
    validations after θ_0) is used here because one best validation of a run is its noisiest number.
(h) γ ∈ {1, 2, 4} give similar validation and training-reward trajectories: an equivalence claim.
    Per seed, γ = 2 minus γ = 1 and γ = 4 minus γ = 1 of (i) the learning score of (c) and (ii) the
    mean training reward over all steps (`train/reward_mean`, the area under the training-reward
    curve). Equivalent when the 95% interval lies inside (−margin, +margin): EQUIV_VAL = 0.02 for
    validation (the "as well" margin of (c) and (g), about one validation's standard deviation at
    θ_0) and EQUIV_REWARD = 0.04 for the reward (rewards are ±1, so 0.04 of reward is the same two
    points of accuracy). Holds if all four intervals lie inside; does not hold if any lies wholly
    outside (beyond +margin or below −margin); otherwise inconclusive. (A 95% interval inside the
    margin is stricter than the two one-sided tests at 5%, which use the 90% interval.)


(i) Keeping the KV cache across a weight update (`rollout.kv_on_update=keep`, the default) learns as
    well as recomputing it (`recompute`: every in-flight request prefilled again under the new
    weights at each update), for Async and for PACE; recomputing removes the stale-context error of
    the tokens generated after an update. Per method m in (Async, PACE), runs paired by seed, per
    seed "m (recompute)" minus m (the label of a recompute run: `analysis.runs.method_label`) of
    - the stale-context error: per run, the mean of `mismatch/kv_abs_logp_diff` over its steps
      weighted by `mismatch/kv_tokens` (the KV probe's mean |ℓ^μ − ℓ_fresh| over the post-update
      tokens of the spanning responses it rescored right after they finished: a token-weighted mean
      over the run); claim < 0. A run that probed no token leaves its seed out of this part;
    - the learning score of (c); claim within ±EQUIV_VAL (the 2-point margin of (c), (g) and (h)),
      does not hold when the interval lies wholly outside.
    Holds if all four parts (two per method) hold; does not hold if any does not; otherwise
    inconclusive. Reported beside the verdict, not part of it: the cost, the ratio recompute over
    keep of seconds per step after the warm-up of (c) (a seed with a run not measured alone left
    out), and the mean `rollout/reprefill_tokens` per step of the recompute runs. Without the
    probe's metric in any of these runs (`rollout.kv_probe` 0) the claim is not tested.

A claim whose runs are missing is reported as not tested. Every number comes from `Run` records.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
from scipy import stats

from analysis.figures import by_label
from analysis.runs import Run

LEVEL = 0.95
MARGIN = 0.02  # (c): "as well" = at most 2 points of validation average worse (~ one validation's sd)
TIME_SLACK = 0.10  # (c): "close to Async's wall time" = at most 10% more seconds per step
EQUIV_VAL = 0.02  # (h): "similar" validation = within ±2 points (the margin of (c) and (g))
EQUIV_REWARD = 0.04  # (h): "similar" training reward = within ±0.04 of a ±1 reward (2 points of accuracy)
HOLDS, FAILS, OPEN = "holds", "does not hold", "inconclusive"


def interval(values: list[float], level: float = LEVEL) -> dict:
    """Mean and Student-t interval of per-seed values (lo = hi = mean with one value: no interval)."""
    xs = [float(x) for x in values if x is not None and not math.isnan(float(x))]
    n = len(xs)
    mean = float(np.mean(xs)) if xs else float("nan")
    if n < 2:
        return {"n": n, "mean": mean, "lo": float("nan"), "hi": float("nan"), "values": xs, "level": level}
    half = float(stats.t.ppf(0.5 + level / 2, n - 1) * np.std(xs, ddof=1) / math.sqrt(n))
    return {"n": n, "mean": mean, "lo": mean - half, "hi": mean + half, "values": xs, "level": level}


def below(iv: dict, bound: float) -> str:
    """Verdict of "the quantity is < bound" (claims of a decrease)."""
    if iv["n"] < 2:
        return OPEN
    return HOLDS if iv["hi"] < bound else FAILS if iv["lo"] > bound else OPEN


def above(iv: dict, bound: float) -> str:
    if iv["n"] < 2:
        return OPEN
    return HOLDS if iv["lo"] > bound else FAILS if iv["hi"] < bound else OPEN


def within(iv: dict, margin: float) -> str:
    """Verdict of "the quantity is within ±margin" (an equivalence claim)."""
    if iv["n"] < 2:
        return OPEN
    if -margin < iv["lo"] and iv["hi"] < margin:
        return HOLDS
    return FAILS if iv["lo"] > margin or iv["hi"] < -margin else OPEN


def combine(verdicts: list[str]) -> str:
    return FAILS if FAILS in verdicts else HOLDS if all(v == HOLDS for v in verdicts) else OPEN


def _decided(out: dict, verdict: str) -> dict:
    return {**out, "tested": True, "verdict": verdict, "holds": verdict == HOLDS}


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(np.mean(xs)) if xs else float("nan")


def _tenth(steps: pd.DataFrame, key: str, which: int) -> float:
    n = max(1, len(steps) // 10)
    part = steps.iloc[:n] if which == 0 else steps.iloc[-n:]
    return float(part[key].mean())


def _by_seed(runs: list[Run]) -> dict[int, Run]:
    return {r.seed: r for r in runs}


def _paired(a: list[Run], b: list[Run], fn) -> tuple[dict[int, float], dict[int, float], list[float], list[int]]:
    """fn on each run of a and b; the per-seed differences a − b over the seeds both have (fn None: not had)."""
    fa, fb = {s: fn(r) for s, r in _by_seed(a).items()}, {s: fn(r) for s, r in _by_seed(b).items()}
    seeds = sorted(s for s in set(fa) & set(fb) if fa[s] is not None and fb[s] is not None)
    return fa, fb, [fa[s] - fb[s] for s in seeds], seeds


def early_rollout_acc(r: Run) -> float:
    return float(r.steps["rollout/acc_mean"].iloc[: max(1, len(r.steps) // 2)].mean())


def stale_k(groups: dict[str, list[Run]]) -> dict:
    lags = sorted((float(k.split("-", 1)[1]), k) for k in groups if k.startswith("Stale-"))
    if len(lags) < 2:
        return {"tested": False, "why": "needs Stale-k runs at two or more lags"}
    per = {label: {s: early_rollout_acc(r) for s, r in _by_seed(groups[label]).items()} for _, label in lags}
    seeds = sorted(set.intersection(*(set(v) for v in per.values())))
    x = np.log2([lag for lag, _ in lags])
    slopes = [float(np.polyfit(x, [per[label][s] for _, label in lags], 1)[0]) for s in seeds]
    early = {label: _mean(v.values()) for label, v in per.items()}
    means = [early[label] for _, label in lags]
    iv = interval(slopes)
    return _decided({"early_rollout_acc": early, "per_seed": per, "seeds": seeds,
                     "monotone": all(b <= a for a, b in zip(means, means[1:])),
                     "quantity": "slope of first-half rollout accuracy per doubling of k", "interval": iv}, below(iv, 0.0))


def backlog(groups: dict[str, list[Run]]) -> dict:
    rs = groups.get("Async", [])
    if not rs:
        return {"tested": False, "why": "needs Async runs"}
    occ = [(_tenth(r.steps, "pool/occupancy", 0), _tenth(r.steps, "pool/occupancy", 1)) for r in rs]
    kw = [(_tenth(r.steps, "staleness/k_wait_mean", 0), _tenth(r.steps, "staleness/k_wait_mean", 1)) for r in rs]
    iv_occ, iv_kw = interval([b - a for a, b in occ]), interval([b - a for a, b in kw])
    out = {"occupancy_first_tenth": _mean(a for a, _ in occ), "occupancy_last_tenth": _mean(b for _, b in occ),
           "k_wait_first_tenth": _mean(a for a, _ in kw), "k_wait_last_tenth": _mean(b for _, b in kw), "seeds": len(rs),
           "quantity": "last tenth minus first tenth (occupancy; consumed K_wait)",
           "interval": {"occupancy": iv_occ, "k_wait": iv_kw}}
    return _decided(out, combine([above(iv_occ, 0.0), above(iv_kw, 0.0)]))


def learning_score(r: Run) -> tuple[float, str]:
    """The mean validation average over the validated versions after θ_0 (the area under the
    validation curve), or, without validations after θ_0, the last-tenth rollout accuracy."""
    if not r.val.empty and (r.val["version"] > 0).any():
        return float(r.val.loc[r.val["version"] > 0, "val/avg"].mean()), "mean validation average after θ_0"
    return _tenth(r.steps, "rollout/acc_mean", 1), "last-tenth rollout accuracy"


def pace_vs_async(groups: dict[str, list[Run]], warmup: int = 5) -> dict:
    pace, asyn = groups.get("PACE", []), groups.get("Async", [])
    if not pace or not asyn:
        return {"tested": False, "why": "needs PACE and Async runs"}
    after = lambda key: lambda r: float(r.steps[key].iloc[min(warmup, len(r.steps) // 2):].mean())  # noqa: E731
    kw_p, kw_a, kw_d, seeds = _paired(pace, asyn, after("staleness/k_wait_mean"))
    metrics = {learning_score(r)[1] for r in pace + asyn}
    score = (lambda r: learning_score(r)[0]) if len(metrics) == 1 else (lambda r: _tenth(r.steps, "rollout/acc_mean", 1))
    metric = metrics.pop() if len(metrics) == 1 else "last-tenth rollout accuracy"
    sc_p, sc_a, sc_d, _ = _paired(pace, asyn, score)
    t_p, t_a, _, _ = _paired(pace, asyn, after("time/step"))
    ratios = [t_p[s] / t_a[s] for s in seeds]
    iv = {"k_wait": interval(kw_d), "score": interval(sc_d), "time_ratio": interval(ratios)}
    parts = {"lower_k_wait": below(iv["k_wait"], 0.0), "learns_as_well": above(iv["score"], -MARGIN),
             "close_wall_time": below(iv["time_ratio"], 1.0 + TIME_SLACK)}
    out = {"seeds": seeds, "k_wait_mean": {"PACE": _mean(kw_p.values()), "Async": _mean(kw_a.values())},
           "score_metric": metric, "scores": {"PACE": list(sc_p.values()), "Async": list(sc_a.values())},
           "seconds_per_step": {"PACE": _mean(t_p.values()), "Async": _mean(t_a.values())},
           "margin": MARGIN, "time_slack": TIME_SLACK, "parts": parts,
           "quantity": "per seed, PACE minus Async (K_wait, score); PACE over Async (seconds per step)", "interval": iv}
    return _decided(out, combine(list(parts.values())))


def share_long_rejected(r: Run) -> tuple[float, float, int] | None:
    """(share of rejected groups longer than the run's median completed group, their mean length, count)."""
    if r.groups.empty:
        return None
    done = r.groups.dropna(subset=["len_mean"])
    rej = done[done.fate == "rejected"]
    if rej.empty:
        return None
    median = float(done["len_mean"].median())
    return float((rej["len_mean"] > median).mean()), float(rej["len_mean"].mean()), len(rej)


def long_rejections(groups: dict[str, list[Run]]) -> dict:
    out, per = {}, {}
    for label in ("PACE", "PACE (raw)"):
        got = {r.seed: share_long_rejected(r) for r in groups.get(label, [])}
        got = {s: v for s, v in got.items() if v is not None}
        if got:
            per[label] = {s: v[0] for s, v in got.items()}
            out[label] = {"share_long": _mean(v[0] for v in got.values()), "rejected_len_mean": _mean(v[1] for v in got.values()),
                          "rejected": sum(v[2] for v in got.values()), "per_seed": per[label]}
    if len(out) < 2:
        return {"tested": False, "why": "needs PACE and PACE (raw) runs that rejected groups", **out}
    seeds = sorted(set(per["PACE"]) & set(per["PACE (raw)"]))
    iv = interval([per["PACE"][s] - per["PACE (raw)"][s] for s in seeds])
    return _decided({**out, "seeds": seeds, "quantity": "per seed, share long under PACE minus under PACE (raw)",
                     "interval": iv}, below(iv, 0.0))


def _scorer(runs: list[Run]):
    """The learning score of (c) when every run has the same kind, else last-tenth rollout accuracy for all."""
    metrics = {learning_score(r)[1] for r in runs}
    if len(metrics) == 1:
        return (lambda r: learning_score(r)[0]), metrics.pop()
    return (lambda r: _tenth(r.steps, "rollout/acc_mean", 1)), "last-tenth rollout accuracy"


def time_to_peak(r: Run) -> float | None:
    """Training wall seconds at the first validation with the run's highest validation average."""
    if r.val.empty:
        return None
    return float(r.val["wall"].iloc[int(np.argmax(r.val["val/avg"].to_numpy()))])


def earlier_peak(groups: dict[str, list[Run]], incomparable: frozenset[str] = frozenset()) -> dict:
    keep = lambda label: [r for r in groups.get(label, []) if r.name not in incomparable and not r.val.empty]  # noqa: E731
    pace = keep("PACE")
    if not pace or not keep("Sync") or not keep("Async"):
        return {"tested": False, "why": "needs PACE, Sync and Async runs with validations, made with nothing else on the machine"}
    iv, parts, t, seeds = {}, {}, {"PACE": {}}, {}
    for other in ("Sync", "Async"):
        tp, to, diffs, seeds[other] = _paired(pace, keep(other), time_to_peak)
        t["PACE"].update(tp)
        t[other] = to
        iv[other] = interval(diffs)
        parts[f"earlier_than_{other.lower()}"] = below(iv[other], 0.0)
    peak = {label: _mean(float(r.val["val/avg"].max()) for r in keep(label)) for label in ("PACE", "Sync", "Async")}
    used = [r for label in ("PACE", "Sync", "Async") for r in keep(label)]
    out = {"seeds": seeds, "time_to_peak_s": {k: _mean(v.values()) for k, v in t.items()}, "peak": peak,
           "eval_every": sorted({(r.config.get("eval") or {}).get("every") for r in used}, key=str),
           "validations_per_run": sorted({len(r.val) for r in used}),
           "left_out": sorted(r.name for label in ("PACE", "Sync", "Async") for r in groups.get(label, [])
                              if r.name in incomparable),
           "parts": parts, "quantity": "per seed, PACE minus Sync / Async: wall seconds to the peak validation",
           "interval": iv}
    return _decided(out, combine(list(parts.values())))


STALENESS_COLUMNS = {"k_wait": "Waiting Staleness", "k_gen": "Generation Staleness", "s_eff": "Effective Staleness"}


def rejected_above_retained(r: Run) -> dict[str, float] | None:
    """Per staleness column: P(rejected > retained) + ½ P(tie) over the run's groups (None: nothing rejected)."""
    if r.groups.empty:
        return None
    rej, kept = r.groups[r.groups.fate == "rejected"], r.groups[r.groups.fate == "consumed"]
    out = {}
    for col in STALENESS_COLUMNS:
        x, y = rej[col].dropna().to_numpy(float), kept[col].dropna().to_numpy(float)
        if len(x) == 0 or len(y) == 0:
            return None
        out[col] = float(stats.mannwhitneyu(x, y).statistic) / (len(x) * len(y))
    return out


def rejected_staler(groups: dict[str, list[Run]]) -> dict:
    per = {r.seed: rejected_above_retained(r) for r in groups.get("PACE", [])}
    per = {s: v for s, v in per.items() if v is not None}
    if not per:
        return {"tested": False, "why": "needs PACE runs that rejected groups"}
    iv = {col: interval([v[col] for v in per.values()]) for col in STALENESS_COLUMNS}
    parts = {col: above(iv[col], 0.5) for col in STALENESS_COLUMNS}
    return _decided({"seeds": sorted(per), "per_seed": per, "parts": parts,
                     "quantity": "P(a rejected group's staleness > a retained one's), ties half", "interval": iv},
                    combine(list(parts.values())))


def score_ablation(groups: dict[str, list[Run]]) -> dict:
    eff, raw, gen = (groups.get(k, []) for k in ("PACE", "PACE (raw)", "PACE (gen)"))
    if not eff or not raw or not gen:
        return {"tested": False, "why": "needs PACE, PACE (raw) and PACE (gen) runs"}
    score, metric = _scorer(eff + raw + gen)
    se, sr, d1, s1 = _paired(eff, raw, score)
    _, sg, d2, s2 = _paired(raw, gen, score)
    iv = {"effective_vs_raw": interval(d1), "raw_vs_generation": interval(d2)}
    parts = {k: above(v, -MARGIN) for k, v in iv.items()}
    out = {"seeds": sorted(set(s1) | set(s2)), "score_metric": metric, "margin": MARGIN, "parts": parts,
           "scores": {"PACE": _mean(se.values()), "PACE (raw)": _mean(sr.values()), "PACE (gen)": _mean(sg.values())},
           "quantity": "per seed, the learning score's difference (effective − raw; raw − generation)", "interval": iv}
    return _decided(out, combine(list(parts.values())))


def mean_reward(r: Run) -> float:
    return float(r.steps["train/reward_mean"].mean())


def gamma_equivalence(groups: dict[str, list[Run]]) -> dict:
    base = groups.get("PACE", [])
    others = {g: groups.get(f"PACE γ={g}", []) for g in (2, 4)}
    if not base or not all(others.values()):
        return {"tested": False, "why": "needs PACE runs at γ = 1, 2 and 4"}
    score, metric = _scorer(base + others[2] + others[4])
    iv, parts, means = {}, {}, {"score": {1: _mean(score(r) for r in base)}, "reward": {1: _mean(mean_reward(r) for r in base)}}
    for g, rs in others.items():
        for name, fn, margin in (("score", score, EQUIV_VAL), ("reward", mean_reward, EQUIV_REWARD)):
            fo, _, diffs, _ = _paired(rs, base, fn)  # γ = g minus γ = 1, per seed
            means[name][g] = _mean(fo.values())
            iv[f"gamma{g}_{name}"] = interval(diffs)
            parts[f"gamma{g}_{name}"] = within(iv[f"gamma{g}_{name}"], margin)
    out = {"score_metric": metric, "margins": {"score": EQUIV_VAL, "reward": EQUIV_REWARD}, "means": means,
           "parts": parts, "quantity": "per seed, γ = 2 or 4 minus γ = 1 (learning score; mean training reward)",
           "interval": iv}
    return _decided(out, combine(list(parts.values())))


KV_ERROR, KV_TOKENS, REPREFILL = "mismatch/kv_abs_logp_diff", "mismatch/kv_tokens", "rollout/reprefill_tokens"


def stale_context_error(r: Run) -> float | None:
    """The KV probe's |ℓ^μ − ℓ_fresh| per post-update token over the run (None: no token probed)."""
    if KV_ERROR not in r.steps or KV_TOKENS not in r.steps:
        return None
    d = r.steps[[KV_ERROR, KV_TOKENS]].dropna()
    d = d[d[KV_TOKENS] > 0]
    n = float(d[KV_TOKENS].sum())
    return float((d[KV_ERROR] * d[KV_TOKENS]).sum() / n) if n > 0 else None


def _after_warmup(key: str, warmup: int = 5):
    return lambda r: float(r.steps[key].iloc[min(warmup, len(r.steps) // 2):].mean()) if key in r.steps else None


def kv_recompute(groups: dict[str, list[Run]], incomparable: frozenset[str] = frozenset()) -> dict:
    methods = ("Async", "PACE")
    pairs = {m: (groups.get(m, []), groups.get(f"{m} (recompute)", [])) for m in methods}
    if not all(keep and rec for keep, rec in pairs.values()):
        return {"tested": False, "why": "needs Async, PACE, Async (recompute) and PACE (recompute) runs"}
    if all(stale_context_error(r) is None for keep, rec in pairs.values() for r in keep + rec):
        return {"tested": False, "why": f"needs the KV probe's {KV_ERROR} (rollout.kv_probe > 0)"}
    alone = lambda rs: [r for r in rs if r.name not in incomparable]  # noqa: E731
    iv, parts, per, cost = {}, {}, {}, {}
    for m, (keep, rec) in pairs.items():
        score, metric = _scorer(keep + rec)
        e_r, e_k, e_d, e_seeds = _paired(rec, keep, stale_context_error)
        s_r, s_k, s_d, s_seeds = _paired(rec, keep, score)
        t_r, t_k, _, t_seeds = _paired(alone(rec), alone(keep), _after_warmup("time/step"))
        m_ = m.lower()
        iv[f"{m_}_error"], iv[f"{m_}_score"] = interval(e_d), interval(s_d)
        parts[f"{m_}_error"], parts[f"{m_}_score"] = below(iv[f"{m_}_error"], 0.0), within(iv[f"{m_}_score"], EQUIV_VAL)
        reprefill = [float(r.steps[REPREFILL].mean()) for r in rec if REPREFILL in r.steps]
        cost[m] = {"time_ratio": interval([t_r[s] / t_k[s] for s in t_seeds]), "reprefill_tokens": interval(reprefill),
                   "seconds_per_step": {"keep": _mean(t_k.values()), "recompute": _mean(t_r.values())}}
        per[m] = {"error": {"keep": _mean(e_k.values()), "recompute": _mean(e_r.values())}, "error_seeds": e_seeds,
                  "score": {"keep": _mean(s_k.values()), "recompute": _mean(s_r.values())}, "score_seeds": s_seeds,
                  "score_metric": metric, "time_seeds": t_seeds}
    out = {"methods": per, "cost": cost, "margin": EQUIV_VAL, "parts": parts,
           "seeds": sorted({s for p in per.values() for s in p["error_seeds"] + p["score_seeds"]}),
           "quantity": "per seed, recompute minus keep (stale-context error per post-update token; learning score)",
           "interval": iv}
    return _decided(out, combine(list(parts.values())))


def evaluate_claims(runs: list[Run], incomparable: frozenset[str] = frozenset()) -> dict:
    """Every claim; ``incomparable``: names of runs whose wall time was not measured alone ((e), and (i)'s
    cost, leave them out)."""
    groups = by_label(runs)
    return {"a_stale_k": stale_k(groups), "b_backlog": backlog(groups),
            "c_pace_vs_async": pace_vs_async(groups), "d_long_rejections": long_rejections(groups),
            "e_time_to_peak": earlier_peak(groups, frozenset(incomparable)), "f_rejected_staler": rejected_staler(groups),
            "g_score_ablation": score_ablation(groups), "h_gamma": gamma_equivalence(groups),
            "i_kv_recompute": kv_recompute(groups, frozenset(incomparable))}
