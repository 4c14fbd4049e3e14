"""Claims (e)–(h) of analysis/claims.py on hand-built runs: time to the peak validation, rejected vs
retained staleness (Figure 6), the score ablation and γ's equivalence, each with its verdicts."""
from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from analysis import claims
from analysis.runs import from_records


def _run(cfg: dict, seed: int, steps: dict, val: list[float] | None = None, groups: pd.DataFrame | None = None,
         seconds: float = 1.0, name: str | None = None, every: int = 2):
    n = len(next(iter(steps.values())))
    rows = [{"step": i, "train/loss": 0.0, "time/step": seconds, **{k: v[i] for k, v in steps.items()}} for i in range(n)]
    rows += [{"val/avg": a, "val/version": every * i} for i, a in enumerate(val or [])]
    r = from_records(name or f"{cfg['pool']['name']}_s{seed}", "local", rows,
                     groups if groups is not None else pd.DataFrame(), {}, {**cfg, "seed": seed})
    return r


SYNC, ASYNC, PACE = {"pool": {"name": "sync"}}, {"pool": {"name": "async"}}, {"pool": {"name": "pace"}}
STEPS = {"rollout/acc_mean": [0.5] * 8, "train/reward_mean": [0.0] * 8, "pool/occupancy": [1.0] * 8,
         "staleness/k_wait_mean": [1.0] * 8}


def test_e_time_to_peak_is_the_first_best_validation_in_wall_time():
    # validations of versions 0, 2, 4, 6, 8 at 1 s a step (sync 2 s a step): wall 0, 2, 4, 6, 8 (sync: ×2)
    r = _run(PACE, 0, STEPS, [0.1, 0.5, 0.5, 0.4, 0.3])
    assert claims.time_to_peak(r) == 2.0  # the first of the tied best
    groups = {"PACE": [_run(PACE, s, STEPS, [0.1, 0.2, 0.5 + s / 100, 0.4, 0.3]) for s in range(3)],  # peak at 4 s
              "Sync": [_run(SYNC, s, STEPS, [0.1, 0.2, 0.3, 0.5, 0.4], seconds=2.0) for s in range(3)],  # at 12 s
              "Async": [_run(ASYNC, s, STEPS, [0.1, 0.2, 0.3, 0.4, 0.5 + s / 100]) for s in range(3)]}  # at 8 s
    e = claims.earlier_peak(groups)
    assert e["interval"]["Sync"]["values"] == [-8.0] * 3 and e["interval"]["Async"]["values"] == [-4.0] * 3
    assert e["verdict"] == "holds" and e["time_to_peak_s"] == {"PACE": 4.0, "Sync": 12.0, "Async": 8.0}
    # Async peaking first in one seed: the Async part is undecided
    groups["Async"][1] = _run(ASYNC, 1, STEPS, [0.1, 0.9, 0.3, 0.4, 0.5])
    assert claims.earlier_peak(groups)["parts"] == {"earlier_than_sync": "holds", "earlier_than_async": "inconclusive"}
    # a run whose wall time was not measured alone takes its seed out of the claim
    e = claims.earlier_peak(groups, frozenset({"async_s1"}))
    assert e["seeds"]["Async"] == [0, 2] and e["left_out"] == ["async_s1"] and e["verdict"] == "holds"
    # PACE later than Sync in every seed: does not hold
    groups["PACE"] = [_run(PACE, s, STEPS, [0.1, 0.2, 0.3, 0.4, 0.5], seconds=4.0) for s in range(3)]  # at 32 s
    assert claims.earlier_peak(groups)["parts"]["earlier_than_sync"] == "does not hold"


def _fig6(rejected: dict, kept: dict) -> pd.DataFrame:
    rows = [{"fate": "rejected", **dict(zip(rejected, vals))} for vals in zip(*rejected.values())]
    rows += [{"fate": "consumed", **dict(zip(kept, vals))} for vals in zip(*kept.values())]
    return pd.DataFrame(rows)


def test_f_rejected_groups_are_compared_with_the_retained_by_pairs():
    # K_wait: rejected [3, 5] vs kept [1, 3]: pairs (3>1, 3=3 half, 5>1, 5>3) = 3.5 / 4 = 0.875
    # K_gen: rejected [0, 0] vs kept [0, 1]: ties (0,0) twice count ½ each, (0<1) twice: 1 / 4 = 0.25
    # S_eff: rejected [4, 6] vs kept [1, 2]: 4 / 4 = 1
    g = _fig6({"k_wait": [3, 5], "k_gen": [0, 0], "s_eff": [4, 6]}, {"k_wait": [1, 3], "k_gen": [0, 1], "s_eff": [1, 2]})
    assert claims.rejected_above_retained(_run(PACE, 0, STEPS, groups=g)) == {"k_wait": 0.875, "k_gen": 0.25, "s_eff": 1.0}
    above = _fig6({"k_wait": [3, 5], "k_gen": [1, 2], "s_eff": [4, 6]}, {"k_wait": [1, 3], "k_gen": [0, 1], "s_eff": [1, 2]})
    f = claims.rejected_staler({"PACE": [_run(PACE, s, STEPS, groups=above) for s in range(3)]})
    assert f["parts"] == {"k_wait": "holds", "k_gen": "holds", "s_eff": "holds"} and f["verdict"] == "holds"
    runs = [_run(PACE, s, STEPS, groups=g) for s in range(3)]  # K_gen below 0.5 in every seed
    assert claims.rejected_staler({"PACE": runs})["parts"]["k_gen"] == "does not hold"
    none = _fig6({"k_wait": [], "k_gen": [], "s_eff": []}, {"k_wait": [1], "k_gen": [0], "s_eff": [1]})
    assert not claims.rejected_staler({"PACE": [_run(PACE, 0, STEPS, groups=none)]})["tested"]


def _pace(score: str, seed: int, after: list[float], reward: float = 0.0, gamma: float = 1.0):
    cfg = {"pool": {"name": "pace"}, "pace": {"score": score, "gamma": gamma}}
    return _run(cfg, seed, {**STEPS, "train/reward_mean": [reward] * 8}, [0.1, *after],
                name=f"pace_{score}_{gamma:g}_s{seed}")


def test_g_the_score_ablation_against_the_margin():
    eff = [_pace("effective", s, [0.50 + d, 0.60]) for s, d in enumerate([0.0, 0.02, 0.01])]
    raw = [_pace("raw", s, [0.50, 0.60]) for s in range(3)]
    gen = [_pace("generation", s, [0.40, 0.50]) for s in range(3)]  # raw − gen = +0.1 in every seed
    g = claims.score_ablation({"PACE": eff, "PACE (raw)": raw, "PACE (gen)": gen})
    assert g["interval"]["effective_vs_raw"]["values"] == pytest.approx([0.0, 0.01, 0.005])  # the mean after θ_0
    assert g["interval"]["raw_vs_generation"]["values"] == pytest.approx([0.1] * 3) and g["verdict"] == "holds"
    worse = [_pace("effective", s, [0.40 + d, 0.50]) for s, d in enumerate([0.0, 0.01, -0.01])]  # −0.1 vs raw
    g = claims.score_ablation({"PACE": worse, "PACE (raw)": raw, "PACE (gen)": gen})
    assert g["parts"] == {"effective_vs_raw": "does not hold", "raw_vs_generation": "holds"} and g["verdict"] == "does not hold"


def test_h_gamma_is_equivalent_only_inside_both_margins():
    base = [_pace("effective", s, [0.5, 0.6], reward=0.1) for s in range(3)]
    close = {g: [_pace("effective", s, [0.5 + d, 0.6], reward=0.1 + d, gamma=g) for s, d in enumerate([0.0, 0.004, -0.004])]
             for g in (2, 4)}
    groups = {"PACE": base, "PACE γ=2": close[2], "PACE γ=4": close[4]}
    h = claims.gamma_equivalence(groups)
    assert set(h["parts"]) == {"gamma2_score", "gamma2_reward", "gamma4_score", "gamma4_reward"}
    assert h["verdict"] == "holds" and h["means"]["reward"][1] == pytest.approx(0.1)
    assert h["means"]["score"][2] == pytest.approx(0.55) and h["means"]["reward"][4] == pytest.approx(0.1)
    # γ = 4's reward 0.1 higher in every seed: outside ±0.04, does not hold
    groups["PACE γ=4"] = [_pace("effective", s, [0.5, 0.6], reward=0.2 + d, gamma=4) for s, d in enumerate([0.0, 0.01, -0.01])]
    h = claims.gamma_equivalence(groups)
    assert h["parts"]["gamma4_reward"] == "does not hold" and h["verdict"] == "does not hold"
    assert h["means"]["reward"][4] == pytest.approx(0.2)  # γ = 4's own mean, not γ = 1's
    # spread wider than the margin: inconclusive
    groups["PACE γ=4"] = [_pace("effective", s, [0.5 + d, 0.6], reward=0.1, gamma=4) for s, d in enumerate([0.06, -0.06, 0.0])]
    assert claims.gamma_equivalence(groups)["parts"]["gamma4_score"] == "inconclusive"
    assert claims.within(claims.interval([0.01, 0.012, 0.011]), 0.02) == "holds"
    assert claims.within(claims.interval([0.05, 0.052, 0.051]), 0.02) == "does not hold"
    assert not claims.gamma_equivalence({"PACE": base, "PACE γ=2": close[2]})["tested"]


def test_the_report_states_every_claim_and_the_seeds_an_open_one_needs(tmp_path):
    from analysis.build import incomparable_runs
    from analysis.claims import evaluate_claims
    from analysis.report import write_report

    fig6 = _fig6({"k_wait": [3, 5], "k_gen": [1, 2], "s_eff": [4, 6]}, {"k_wait": [1, 3], "k_gen": [0, 1], "s_eff": [1, 2]})
    fig6["len_mean"] = 10.0
    runs = []
    for s, d in enumerate([0.0, 0.03, -0.02]):
        runs += [_run(SYNC, s, STEPS, [0.1, 0.2, 0.3, 0.5, 0.4], seconds=2.0),
                 _run(ASYNC, s, STEPS, [0.1, 0.2, 0.3, 0.4, 0.5]),
                 _pace("raw", s, [0.5, 0.6]), _pace("generation", s, [0.4, 0.5]),
                 _pace("effective", s, [0.5 + 2 * d, 0.6], gamma=2), _pace("effective", s, [0.5, 0.6], gamma=4)]
        pace = _pace("effective", s, [0.6 + d, 0.5, 0.55, 0.55])  # its peak first, at version 2
        runs.append(dataclasses.replace(pace, groups=fig6))
    (tmp_path / "runs.tsv").write_text("run\tstarted (UTC)\tcommit\twall_s\trun_cpu_s\tother_cpu_s\tcomparable\n"
                                       "sync_s2\tx\tc\t1\t1\t99\tno\nasync_s1\tx\tc\t1\t1\t99\tno\nasync_s1\tx\tc\t1\t1\t0\tyes\n")
    incomparable = incomparable_runs([str(tmp_path)])
    assert incomparable == {"sync_s2"}  # async_s1 was made again, alone
    claims_ = evaluate_claims(runs, incomparable)
    assert all(c["tested"] for k, c in claims_.items() if k not in ("a_stale_k", "d_long_rejections", "i_kv_recompute"))
    assert claims_["e_time_to_peak"]["left_out"] == ["sync_s2"] and claims_["e_time_to_peak"]["seeds"]["Sync"] == [0, 1]
    import json

    from analysis.build import previous_verdicts

    old = {"runs": [{"seed": 0}, {"seed": 1}], "claims": {
        "c_pace_vs_async": {"tested": True, "verdict": "holds", "interval": {"k_wait": claims.interval([-2.0, -1.0])}},
        "d_long_rejections": {"tested": False, "why": "no runs"}}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    numbers = {"setup": {}, "runs": [], "claims": claims_, "figures": [], "skipped": [],
               "previous": previous_verdicts(tmp_path / "old.json")}
    text = write_report(tmp_path, numbers).read_text()
    assert "## How the verdicts moved" in text and "2 runs, seeds 0, 1" in text
    moved = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| (")}
    assert "holds (k_wait -1.5, 2 seeds)" in moved["(c)"] and "| not tested |" in moved["(d)"]
    assert "(not a claim then)" in moved["(e)"] and moved["(e)"].endswith("holds (Sync -10; Async -6, 2 seeds) |")
    for head in ("(e) PACE reaches", "(f) The groups PACE rejects", "(g) Ranking by Effective", "(h) γ = 1, 2 and 4"):
        assert head in text, head
    h = claims_["h_gamma"]
    # γ = 2 − γ = 1 per seed: 0, +0.0225, −0.015 (a spread as wide as the ±0.02 margin): open, and the seeds it needs said
    assert h["parts"]["gamma2_score"] == "inconclusive" and "gamma2 score: about" in text
    for what in ("validation", "training reward"):  # each of the four intervals says which trajectory it compares
        assert all(f"{what}, γ={g} − γ=1 " in text for g in (2, 4)), what
    assert h["parts"]["gamma4_score"] == "holds" and claims_["e_time_to_peak"]["verdict"] == "holds"
    assert "Left out (wall time not measured alone): sync_s2" in text


def test_a_verdict_gist_says_seed_in_the_singular_for_one():
    from analysis.report import _gist

    one = {"verdict": "inconclusive", "interval": {"mean": 0.5, "n": 1}}
    two = {"verdict": "holds", "interval": {"Sync": {"mean": -1.0, "n": 2}, "Async": {"mean": -2.0, "n": 3}}}
    assert _gist(one) == "inconclusive (+0.5, 1 seed)"
    assert _gist(two) == "holds (Sync -1; Async -2, 2 seeds)"
