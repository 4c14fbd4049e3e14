"""The paper's four small-scale claims as numbers from the logs, each with a verdict whose rule is
fixed here, before any run is looked at (issue #5):

(a) a larger Stale-k lag slows early optimisation: the mean rollout accuracy over the first half
    of training falls as the lag grows (holds if it is lower at the largest lag than at the
    smallest, and never rises from one lag to the next);
(b) without filtering a backlog forms and the Waiting Staleness of consumed data grows: Async's
    pool occupancy and consumed K_wait are higher in the last tenth of the run than in the first
    (mean over seeds);
(c) PACE lowers K_wait and learns at least as well as Async per step at close to Async's wall time:
    mean consumed K_wait lower; final validation average not below Async's by more than the
    standard error of the difference over seeds (no validation: last-tenth rollout accuracy);
    seconds per step at most 10% above Async's;
(d) Effective ranking rejects fewer long responses than Raw ranking: among rejected groups, the
    share whose mean response length exceeds the median of all completed groups in the same
    run is lower under PACE than under PACE (raw).

A claim whose runs are missing is reported as not tested. Every number comes from `Run` records.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analysis.figures import by_label
from analysis.runs import Run


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(np.mean(xs)) if xs else float("nan")


def _tenth(steps: pd.DataFrame, key: str, which: int) -> float:
    n = max(1, len(steps) // 10)
    part = steps.iloc[:n] if which == 0 else steps.iloc[-n:]
    return float(part[key].mean())


def stale_k(groups: dict[str, list[Run]]) -> dict:
    lags = sorted((float(k.split("-", 1)[1]), k) for k in groups if k.startswith("Stale-"))
    if len(lags) < 2:
        return {"tested": False, "why": "needs Stale-k runs at two or more lags"}
    early = {}
    for lag, label in lags:
        early[label] = _mean(float(r.steps["rollout/acc_mean"].iloc[: max(1, len(r.steps) // 2)].mean()) for r in groups[label])
    vals = [early[label] for _, label in lags]
    monotone = all(b <= a for a, b in zip(vals, vals[1:]))
    return {"tested": True, "holds": bool(vals[-1] < vals[0] and monotone),
            "early_rollout_acc": early, "monotone": monotone}


def backlog(groups: dict[str, list[Run]]) -> dict:
    rs = groups.get("Async", [])
    if not rs:
        return {"tested": False, "why": "needs Async runs"}
    occ = [_tenth(r.steps, "pool/occupancy", 0) for r in rs], [_tenth(r.steps, "pool/occupancy", 1) for r in rs]
    kw = [_tenth(r.steps, "staleness/k_wait_mean", 0) for r in rs], [_tenth(r.steps, "staleness/k_wait_mean", 1) for r in rs]
    out = {"occupancy_first_tenth": _mean(occ[0]), "occupancy_last_tenth": _mean(occ[1]),
           "k_wait_first_tenth": _mean(kw[0]), "k_wait_last_tenth": _mean(kw[1]), "seeds": len(rs)}
    out["tested"] = True
    out["holds"] = bool(out["occupancy_last_tenth"] > out["occupancy_first_tenth"]
                        and out["k_wait_last_tenth"] > out["k_wait_first_tenth"])
    return out


def _final_scores(runs: list[Run]) -> tuple[list[float], str]:
    """The final validation average of each run, or, unless every run has validations, the
    last-tenth rollout accuracy of each (one metric for all runs compared)."""
    if all(not r.val.empty for r in runs):
        return [float(r.val["val/avg"].iloc[-1]) for r in runs], "final validation average"
    return [_tenth(r.steps, "rollout/acc_mean", 1) for r in runs], "last-tenth rollout accuracy"


def pace_vs_async(groups: dict[str, list[Run]], warmup: int = 5) -> dict:
    pace, asyn = groups.get("PACE", []), groups.get("Async", [])
    if not pace or not asyn:
        return {"tested": False, "why": "needs PACE and Async runs"}
    after = lambda r, key: float(r.steps[key].iloc[min(warmup, len(r.steps) // 2):].mean())  # noqa: E731
    kw = {k: _mean(after(r, "staleness/k_wait_mean") for r in rs) for k, rs in (("PACE", pace), ("Async", asyn))}
    sps = {k: _mean(after(r, "time/step") for r in rs) for k, rs in (("PACE", pace), ("Async", asyn))}
    values, metric = _final_scores(pace + asyn)
    scores = {"PACE": values[: len(pace)], "Async": values[len(pace):]}
    se = math.sqrt(sum(np.var(v, ddof=1) / len(v) if len(v) > 1 else 0.0 for v in scores.values()))
    diff = _mean(scores["PACE"]) - _mean(scores["Async"])
    out = {
        "tested": True,
        "k_wait_mean": kw, "lower_k_wait": bool(kw["PACE"] < kw["Async"]),
        "score_metric": metric, "scores": scores, "score_diff": diff, "score_diff_se": se,
        "learns_as_well": bool(diff >= -se) if se > 0 else bool(diff >= 0),
        "seconds_per_step": sps, "time_ratio": sps["PACE"] / sps["Async"],
    }
    out["close_wall_time"] = bool(out["time_ratio"] <= 1.10)
    out["holds"] = out["lower_k_wait"] and out["learns_as_well"] and out["close_wall_time"]
    return out


def long_rejections(groups: dict[str, list[Run]]) -> dict:
    out = {}
    for label in ("PACE", "PACE (raw)"):
        shares, lens, n = [], [], 0
        for r in groups.get(label, []):
            g = r.groups
            if g.empty:
                continue
            done = g.dropna(subset=["len_mean"])
            rej = done[done.fate == "rejected"]
            if rej.empty:
                continue
            median = float(done["len_mean"].median())
            shares.append(float((rej["len_mean"] > median).mean()))
            lens.append(float(rej["len_mean"].mean()))
            n += len(rej)
        if shares:
            out[label] = {"share_long": _mean(shares), "rejected_len_mean": _mean(lens), "rejected": n}
    if len(out) < 2:
        return {"tested": False, "why": "needs PACE and PACE (raw) runs that rejected groups", **out}
    return {"tested": True, "holds": bool(out["PACE"]["share_long"] < out["PACE (raw)"]["share_long"]), **out}


def evaluate_claims(runs: list[Run]) -> dict:
    groups = by_label(runs)
    return {"a_stale_k": stale_k(groups), "b_backlog": backlog(groups),
            "c_pace_vs_async": pace_vs_async(groups), "d_long_rejections": long_rejections(groups)}
