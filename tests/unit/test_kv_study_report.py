"""The KV study's report from its run folder alone (scripts/kv_study.sh): five methods, Sync, Async,
PACE and Async / PACE with the KV cache recomputed, written to disk as a study leaves them; claims (e)
and (i) decided, the claims whose runs are absent listed as not tested, the KV table drawn."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import yaml

from analysis import build
from analysis.claims import KV_ERROR, KV_TOKENS, REPREFILL
from analysis.runs import load

pytestmark = pytest.mark.unit

STEPS, EVERY = 20, 2  # validations at versions 0, 2, …, 20: 11 a run, as eval.every=10 over 100 steps
METHODS = {  # directory prefix → (pool, kv_on_update, seconds per step, where its validation peaks)
    "sync": ("sync", "keep", 2.0, 8), "async": ("async", "keep", 1.0, 8), "pace": ("pace", "keep", 1.0, 4),
    "async_recompute": ("async", "recompute", 1.1, 8), "pace_recompute": ("pace", "recompute", 1.1, 4),
}


def _write_run(root, method: str, seed: int) -> None:
    pool, kv, seconds, peak = METHODS[method]
    rng = np.random.default_rng(seed * 31 + len(method))
    d = root / f"{method}_s{seed}"
    (d / ".hydra").mkdir(parents=True)
    (d / "groups").mkdir()
    cfg = {"pool": {"name": pool}, "pace": {"score": "effective", "gamma": 1.0, "target_pool": None},
           "algo": {"name": "dapo"}, "rollout": {"kv_on_update": kv, "kv_probe": 1.0, "max_tokens": 96},
           "data": {"batch_prompts": 4, "group_size": 8}, "eval": {"every": EVERY}, "seed": seed}
    (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    error = 0.0 if pool == "sync" else 2e-6 if kv == "recompute" else 0.05 + 0.01 * rng.random()
    rows = [{"step": i, "time/step": seconds * (1 + 0.01 * rng.random()), "time/train": 0.5, "time/wait_data": 0.1,
             "time/sync": 0.1, "time/generate": 0.8, "train/reward_mean": 0.1, "rollout/acc_mean": 0.5,
             "pool/occupancy": 8 + i, "pool/rejected": 2 if pool == "pace" else 0, "staleness/k_wait_mean": 1.0,
             "staleness/k_kv_mean": 1.5, KV_ERROR: error, KV_TOKENS: 0.0 if pool == "sync" else 40.0,
             REPREFILL: 120.0 if kv == "recompute" else 0.0} for i in range(STEPS)]
    for v in range(0, STEPS + 1, EVERY):  # the peak at version `peak`, the same height in each seed ± noise
        avg = 0.6 + 0.01 * rng.random() if v == peak else 0.3 + 0.2 * v / STEPS
        rows.append({"val/version": v, "val/avg": avg, "val/arith_l1/mean@4": avg})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "summary.json").write_text(json.dumps({"status": "finished"}))
    g = pd.DataFrame([{"step": s, "fate": "rejected" if pool == "pace" and i == 0 else "consumed", "k_gen": 0.5 + i / 4,
                       "k_wait": float(i), "k": 0.5 + i * 1.25, "k_kv": 0.5 + i / 4 + (0.0 if kv == "recompute" else 1.0),
                       "s_eff": i + 0.5, "len_mean": 20.0 + i, "acc_mean": 0.5, "reward_mean": 0.0}
                      for s in range(STEPS) for i in range(4)])
    g.to_parquet(d / "groups" / "part-00000.parquet")


def test_the_kv_study_reports_claims_e_and_i_and_skips_the_claims_it_has_no_runs_for(tmp_path):
    study = tmp_path / "kv_study"
    for seed in range(3):
        for method in METHODS:
            _write_run(study, method, seed)
    (study / "runs.tsv").write_text("run\tstarted (UTC)\tcommit\twall_s\trun_cpu_s\tother_cpu_s\tcomparable\n"
                                    + "".join(f"{m}_s{s}\tx\tc\t1\t1\t0\tyes\n" for s in range(3) for m in METHODS))
    runs = load(str(study))
    assert sorted({r.label for r in runs}) == ["Async", "Async (recompute)", "PACE", "PACE (recompute)", "Sync"]
    out = tmp_path / "report"
    numbers = build.build(runs, out, report=True, incomparable=build.incomparable_runs([str(study)]))
    c = numbers["claims"]
    assert {k for k, v in c.items() if v["tested"]} == {"b_backlog", "c_pace_vs_async", "e_time_to_peak",
                                                         "f_rejected_staler", "i_kv_recompute"}
    assert c["e_time_to_peak"]["verdict"] == "holds" and c["e_time_to_peak"]["validations_per_run"] == [11]
    assert c["i_kv_recompute"]["verdict"] == "holds"
    assert numbers["kv"]["Async"]["k_kv"] == pytest.approx(numbers["kv"]["Async"]["k_gen"] + 1.0)
    assert numbers["kv"]["PACE (recompute)"]["k_kv"] == pytest.approx(numbers["kv"]["PACE (recompute)"]["k_gen"])
    text = (out / "report.md").read_text()
    assert "- (e) PACE reaches" in text and "validated every 2 steps (11 validations a run" in text
    assert "- (i) Keeping the KV cache" in text and "recompute − keep" in text
    assert "- Not tested here: (a) needs Stale-k" in text
    assert "**not tested**" not in text and "(d) needs PACE and PACE (raw)" in text
    kv_rows = [line for line in text.splitlines() if line.startswith("| ") and "K_kv" not in line and "---" not in line
               and line.split(" | ")[0][2:] in numbers["kv"]]
    assert [r.split(" | ")[0][2:] for r in kv_rows[-5:]] == ["Sync", "Async", "PACE", "Async (recompute)", "PACE (recompute)"]
    assert "## KV-cache staleness" in text and "| Async (recompute) | 3 | 0.88 | 0.88 | 40.0 | 2e-06 | 120.0 |" in text
