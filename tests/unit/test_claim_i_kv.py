"""Claim (i) of analysis/claims.py on hand-built runs: the KV cache kept vs recomputed at an update,
per method (Async, PACE) and paired by seed: the probe's stale-context error, the learning score,
the cost beside the verdict; and the labels that tell the recompute runs apart."""
from __future__ import annotations

import pandas as pd
import pytest

from analysis import claims
from analysis.runs import from_records, method_label

pytestmark = pytest.mark.unit

POOL = {"Async": "async", "PACE": "pace"}


def _run(method: str, kv: str | None, seed: int, error: float, after: list[float], seconds: float = 1.0,
         tokens: float = 20.0, reprefill: float = 0.0):
    """8 steps; the probe's error on every step; validations of versions 0, 2, 4, … (θ_0 at 0.1)."""
    cfg = {"pool": {"name": POOL[method]}, "seed": seed, **({"rollout": {"kv_on_update": kv}} if kv else {})}
    rows = [{"step": i, "time/step": seconds, "rollout/acc_mean": 0.5, "pool/occupancy": 1.0, "staleness/k_wait_mean": 1.0,
             claims.KV_ERROR: error, claims.KV_TOKENS: tokens,
             claims.REPREFILL: reprefill} for i in range(8)]
    rows += [{"val/avg": a, "val/version": 2 * i} for i, a in enumerate([0.1, *after])]
    name = f"{method.lower()}{'_recompute' if kv == 'recompute' else ''}_s{seed}"
    return from_records(name, "local", rows, pd.DataFrame(), {}, cfg)


def _study(rec_error=(1e-6, 2e-6, 1e-6), rec_score=(0.0, 0.003, -0.003), seconds=1.2) -> list:
    """Keep (no rollout key: the default) and recompute runs of Async and PACE, seeds 0–2."""
    runs = []
    for s in range(3):
        for m in ("Async", "PACE"):
            runs.append(_run(m, None, s, 0.2 + s / 100, [0.5, 0.6]))
            runs.append(_run(m, "recompute", s, rec_error[s], [0.5 + rec_score[s], 0.6], seconds=seconds, reprefill=40.0))
    return runs


def test_recompute_runs_are_labelled_apart_and_a_run_without_the_key_keeps():
    assert method_label({"pool": {"name": "async"}, "rollout": {"kv_on_update": "recompute"}}) == "Async (recompute)"
    assert method_label({"pool": {"name": "pace"}, "rollout": {"kv_on_update": "recompute"}}) == "PACE (recompute)"
    assert method_label({"pool": {"name": "pace"}, "rollout": {"kv_on_update": "keep"}}) == "PACE"
    assert method_label({"pool": {"name": "async"}, "rollout": {}}) == "Async"
    assert method_label({"pool": {"name": "sync"}}) == "Sync"


def test_the_stale_context_error_is_token_weighted_over_the_run():
    r = _run("Async", None, 0, 0.0, [0.5])
    r.steps[claims.KV_ERROR] = [0.1, 0.4, float("nan"), 0.9, 0, 0, 0, 0]
    r.steps[claims.KV_TOKENS] = [30, 10, 0, 0, 0, 0, 0, 0]  # a step with no probed token does not count
    assert claims.stale_context_error(r) == pytest.approx((0.1 * 30 + 0.4 * 10) / 40)
    r.steps[claims.KV_TOKENS] = 0
    assert claims.stale_context_error(r) is None
    assert claims.stale_context_error(from_records("x", "local", [{"step": 0, "time/step": 1.0}], pd.DataFrame(), {}, {})) is None


def test_i_holds_when_recompute_removes_the_error_and_learns_alike():
    i = claims.evaluate_claims(_study())["i_kv_recompute"]
    assert i["tested"] and i["verdict"] == "holds"
    assert set(i["parts"]) == {"async_error", "async_score", "pace_error", "pace_score"}
    assert i["interval"]["async_error"]["values"] == pytest.approx([1e-6 - 0.2, 2e-6 - 0.21, 1e-6 - 0.22])
    assert i["interval"]["pace_score"]["values"] == pytest.approx([0.0, 0.0015, -0.0015])  # the mean after θ_0
    assert i["methods"]["Async"]["error"]["keep"] == pytest.approx(0.21)
    # the cost: reported, not decided on
    assert i["cost"]["PACE"]["time_ratio"]["values"] == pytest.approx([1.2] * 3)
    assert i["cost"]["Async"]["reprefill_tokens"]["mean"] == 40.0


def test_i_does_not_hold_when_recompute_learns_worse_or_keeps_the_error():
    worse = claims.evaluate_claims(_study(rec_score=(-0.2, -0.21, -0.19)))["i_kv_recompute"]
    assert worse["parts"]["async_score"] == "does not hold" and worse["verdict"] == "does not hold"
    # recompute learning far better also fails the claim: keeping the cache does not learn as well
    better = claims.evaluate_claims(_study(rec_score=(0.2, 0.21, 0.19)))["i_kv_recompute"]
    assert better["parts"]["pace_score"] == "does not hold" and better["verdict"] == "does not hold"
    stale = claims.evaluate_claims(_study(rec_error=(0.5, 0.6, 0.55)))["i_kv_recompute"]  # above keep's 0.2 in every seed
    assert stale["parts"]["pace_error"] == "does not hold" and stale["verdict"] == "does not hold"


def test_i_is_inconclusive_when_the_learning_spread_straddles_the_margin_and_says_the_seeds_it_needs():
    from analysis.report import _needs

    i = claims.evaluate_claims(_study(rec_score=(0.06, -0.06, 0.01)))["i_kv_recompute"]
    assert i["parts"]["async_score"] == "inconclusive" and i["parts"]["async_error"] == "holds"
    assert i["verdict"] == "inconclusive"
    assert "async score: about" in _needs("i_kv_recompute", i) or "async score: more than" in _needs("i_kv_recompute", i)


def test_i_cost_leaves_out_runs_not_measured_alone_and_is_not_tested_without_its_runs():
    runs = _study()
    i = claims.evaluate_claims(runs, frozenset({"pace_recompute_s1"}))["i_kv_recompute"]
    assert i["methods"]["PACE"]["time_seeds"] == [0, 2] and i["methods"]["Async"]["time_seeds"] == [0, 1, 2]
    assert i["verdict"] == "holds"  # the verdict reads no wall time
    runs[0].steps[claims.KV_TOKENS] = 0  # Async keep, seed 0, probed nothing: its seed leaves the error part only
    i = claims.evaluate_claims(runs)["i_kv_recompute"]
    assert i["methods"]["Async"]["error_seeds"] == [1, 2] and i["methods"]["Async"]["score_seeds"] == [0, 1, 2]
    keep_only = [r for r in runs if "recompute" not in r.label]
    assert not claims.evaluate_claims(keep_only)["i_kv_recompute"]["tested"]
    for r in runs:  # no probe: the error parts have nothing to decide on
        r.steps = r.steps.drop(columns=[claims.KV_ERROR])
    i = claims.evaluate_claims(runs)["i_kv_recompute"]
    assert not i["tested"] and "rollout.kv_probe" in i["why"]
