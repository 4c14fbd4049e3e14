"""Tests for pace.sim: the engine model against hand-computed latencies, Sync/Async step times,
occupancy and staleness of a deterministic model against the arithmetic written out here, every
pool policy in the loop, and Lemma 1 / the fate accounting / the per-token records of a noisy
multi-engine run with preemption, through the run directory that analysis reads."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from pace import staleness
from pace.errors import ConfigError
from pace.logger import group_schema
from pace.pool.policies import POLICIES
from pace.sim.config import SimRunConfig, validate_sim
from pace.sim.engine import SimEngine
from pace.sim.records import _COLUMNS, SimGroup, group_columns
from pace.sim.run import Simulation

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def sim_cfg(*overrides: str):
    cfg = OmegaConf.merge(OmegaConf.structured(SimRunConfig), OmegaConf.from_dotlist(list(overrides)))
    validate_sim(cfg)
    return cfg


# A deterministic model with binary-exact times: one engine, 1/16 s per decode step whatever the
# batch, every response 8 tokens (a "wave" of generation takes 0.5 s), training 7/8 s, sync 1/8 s,
# G = 4 with exactly 2 correct (never filtered), B = 4.
DET = ("data.batch_prompts=4", "data.group_size=4", "sim.responses.fixed_correct=2",
       "sim.responses.levels=[{len_median: 8}]", "sim.engine.step_s=0.0625",
       "sim.trainer.step_s=0.875", "sim.trainer.sync_s=0.125", "rollout.max_tokens=16", "rollout.overlong_buffer=4",
       "pool.capacity=null", "trainer.steps=10")


def _engine(**kw) -> SimEngine:
    cfg = {"step_s": 1.0, "per_seq_s": 0.0, "per_ctx_token_s": 0.0, "prefill_token_s": 0.0, "kv_tokens": None,
           "stall_s": 0.0} | kw
    return SimEngine(0, OmegaConf.create(cfg), 16)


def _group(*lengths: int, prompt: int) -> SimGroup:
    n = len(lengths)
    return SimGroup(id=0, prompt_id="p", prompt_ids=[], answer="", submitted_at=0, prompt_tokens=prompt,
                    target=np.array(lengths), lengths=list(lengths), done_at=np.full(n, -1), spans=[[] for _ in range(n)],
                    remaining=n)


def _drain(e: SimEngine) -> list:
    done = []
    while e.next_event() is not None:
        done += e.run_event()
    return done


def test_engine_latency_and_prefill_by_hand():
    """Two responses of one group (3 and 5 tokens, prompt 10): step = 1 + 0.5·running + 0.01·Σcontext,
    and the shared prompt's 10 tokens prefill once at 0.1 s each on the first step."""
    e = _engine(per_seq_s=0.5, per_ctx_token_s=0.01, prefill_token_s=0.1)
    g = _group(3, 5, prompt=10)
    e.submit(g, 0.0)
    steps = [1.0 + 1 + 1 + 0.20, 1 + 1 + 0.22, 1 + 1 + 0.24, 1 + 0.5 + 0.13, 1 + 0.5 + 0.14]
    assert e.next_event() == pytest.approx(sum(steps[:3]))
    done = _drain(e)
    assert [(f.index, f.time) for f in done] == [(0, pytest.approx(sum(steps[:3]))), (1, pytest.approx(sum(steps)))]
    assert g.spans == [[0, 3], [0, 5]] and e.stats["tokens"] == 8 and e.stats["prefill_tokens"] == 10
    assert e.stats["decode_steps"] == 5


def test_engine_arrival_joins_at_the_step_in_progress():
    """A second group arriving at t = 2.5 joins after step 3 (steps end at 1, 2, 3 at 1 s each)."""
    e = _engine()
    a, b = _group(6, prompt=2), _group(2, prompt=2)
    e.submit(a, 0.0)
    e.submit(b, 2.5)
    assert e.counter == 3 and e.clock == 3.0
    done = _drain(e)
    assert [(f.group is b, f.time) for f in done] == [(True, 5.0), (False, 6.0)]


def test_engine_update_in_flight_splits_spans_and_kv_preempts():
    """An update lands at the step in progress: later tokens carry the new version. A KV budget that
    holds one sequence at a time runs them one after another (the newest preempted, recomputed)."""
    e = _engine(stall_s=0.5)
    g = _group(6, prompt=2)
    e.submit(g, 0.0)
    assert e.load_weights(1, 2.5) == []  # steps end at 1, 2, 3: the third is in progress at 2.5
    assert e.clock == 3.5  # 3.0 + the 0.5 s stall
    assert [f.time for f in _drain(e)] == [6.5] and g.spans == [[0, 3, 1, 3]]

    e = _engine(kv_tokens=12)
    g = _group(6, 6, prompt=2)
    e.submit(g, 0.0)
    finished = _drain(e)
    assert e.stats["preempted"] >= 1 and sorted(f.index for f in finished) == [0, 1]
    assert [sum(s[1::2]) for s in g.spans] == [6, 6]  # every token once, across the preemption
    assert max(f.time for f in finished) > 6  # not both at once: 2 × (2 + 6) > 12 tokens of KV


def test_engine_kv_staleness_under_keep_and_recompute_by_hand():
    """The update case above, with a prompt prefill of 0.1 s a token: under keep the three tokens
    after the update attend to version 0's KV (w_t = 0 throughout: K_kv = 6/6 = 1 > K_gen = 3/6);
    with `reprefill` the load re-prefills prompt (2) + response so far (3): 5 tokens, 0.5 s on the
    next step, and w_t = v_t (K_kv = K_gen)."""
    for reprefill, end, k_kv in ((False, 6.7, 1.0), (True, 7.2, 0.5)):
        e = _engine(stall_s=0.5, prefill_token_s=0.1)
        e.reprefill = reprefill
        g = _group(6, prompt=2)
        e.submit(g, 0.0)  # steps end at 1.2 (with the prompt's 0.2 s), 2.2, 3.2
        e.load_weights(1, 2.5)
        assert [f.time for f in _drain(e)] == [pytest.approx(end)] and g.spans == [[0, 3, 1, 3]]
        g.done_at[:] = 1
        g.complete()
        assert g.staleness(1)[1] == 0.5 and g.k_kv() == k_kv
        assert e.stats["reprefill_tokens"] == 5 * reprefill and e.stats["prefill_tokens"] == 2 + 5 * reprefill


def test_span_kv_sum_by_hand():
    from pace.sim.records import span_kv_sum

    spans = [0, 3, 1, 2, 4, 5]  # v = 0 0 0 1 1 4 4 4 4 4
    assert span_kv_sum(spans) == 0
    assert span_kv_sum(spans, [4]) == 1 * 6  # tokens 4… attend to the KV of token 4 (version 1)
    assert span_kv_sum(spans, [3, 6]) == 1 * 3 + 4 * 4  # runs 0–2 (v 0), 3–5 (v 1), 6–9 (v 4)
    for starts in ([], [4], [3, 6], [1, 2, 5, 9]):  # the per-token definition, pace/staleness.py
        assert span_kv_sum(spans, starts) == int(staleness.kv_versions(np.repeat(spans[0::2], spans[1::2]), starts).sum())


def _waves(step: int) -> tuple[int, int, int]:
    """Async in the deterministic model, by hand. Waves of 4 groups × 2 (max_inflight 8) run in
    lockstep: wave w runs [(w−1)/2, w/2]. Batch 0 forms at 0.5; the trainer is free again at
    1.5 + j after step j (train 0.875 + sync 0.125), so batch j forms at 0.5 + j and takes the
    FIFO groups 4j…4j+3, all of wave w = j // 2 + 1. θ_{j+1} exists at 1.375 + j (c counts those
    ≤ the finish time w/2) and loads at 1.5 + j (tokens of wave w carry the loads ≤ its start)."""
    w = step // 2 + 1
    c = sum(1.375 + i <= w / 2 for i in range(step + 1))
    v = sum(1.5 + i <= (w - 1) / 2 for i in range(step + 1))
    return w, c, v


def test_async_and_sync_match_hand_computed_step_times_occupancy_and_staleness():
    a = Simulation(sim_cfg(*DET, "pool.name=async", "rollout.max_inflight_groups=8"))
    a.run()
    for j, row in enumerate(a.rows):
        _, c, v = _waves(j)
        assert row["time/step"] == pytest.approx(1.5 if j == 0 else 1.0)  # the first step waits for wave 1
        # the row is logged at 1.375 + j: 2 + 2j waves of 8 groups arrived, 4(j + 1) consumed
        assert row["pool/occupancy"] == 12 + 12 * j
        assert row["staleness/k_gen_mean"] == pytest.approx(c - v)
        assert row["staleness/k_wait_mean"] == pytest.approx(j - c)
        assert row["staleness/k_mean"] == pytest.approx(j - v)
    s = Simulation(sim_cfg(*DET, "pool.name=sync"))
    s.run()
    # one wave per step at θ_j: generate 0.5, train 0.875, sync 0.125; nothing waits, nothing is stale
    assert [r["time/step"] for r in s.rows] == pytest.approx([1.5] * 10)
    assert all(r["pool/occupancy"] == 0 and r["staleness/k_mean"] == 0 for r in s.rows)
    assert s.now == pytest.approx(1.5 * 10 - 0.125)  # the last step's train end (its sync follows)
    # the same training time made of a step cost and 2 updates of 0.3125 s: the same run, to the float
    u = Simulation(sim_cfg(*DET, "pool.name=sync", "sim.trainer.step_s=0.25", "sim.trainer.per_update_s=0.3125",
                           "trainer.mini_batches=2"))
    u.run()
    assert [r["time/step"] for r in u.rows] == pytest.approx([1.5] * 10) and u.now == pytest.approx(s.now)


def test_capacity_back_pressure_bounds_the_pool():
    sim = Simulation(sim_cfg(*DET, "pool.name=async", "rollout.max_inflight_groups=8", "pool.capacity=24"))
    sim.run()
    occ = [r["pool/occupancy"] + r["rollout/inflight"] for r in sim.rows]
    assert max(occ) <= 24 and sim.rows[-1]["pool/occupancy"] >= 12


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_runs_and_keeps_the_accounting(policy):
    extra = {"stale_k": ["pool.max_lag=1"], "gate": ["pool.max_head_offpolicyness=1"]}.get(policy, [])
    sim = Simulation(sim_cfg(*NOISY, f"pool.name={policy}", *extra))
    sim.run()
    c = sim.pool.counts()
    assert c["consumed"] == 20 * 8 and sum(v for k, v in c.items() if k != "submitted") == c["submitted"]
    k = [r["staleness/k_mean"] for r in sim.rows]
    if policy == "sync":
        assert max(k) == 0
    if policy == "stale_k":
        assert max(r["staleness/k_max"] for r in sim.rows) <= 1 and c["dropped_stale"] > 0
    if policy == "pace":
        assert c["rejected"] > 0 and sim.stats["rescored"] > 0  # effective ranking rescored prefixes
    if policy == "async":
        assert np.mean(k[10:]) > 2  # the backlog the other policies bound


# Noisy and multi-engine: long-tailed lengths that span updates, three engines, a KV budget that
# forces preemption, in-flight cap 32 over B = 8.
NOISY = ("data.batch_prompts=8", "data.group_size=8", "rollout.max_inflight_groups=32", "rollout.engines=3",
         "rollout.max_tokens=96", "rollout.max_num_seqs=64", "trainer.steps=20", "sim.engine.kv_tokens=3000",
         "sim.engine.step_s=0.01", "sim.engine.per_seq_s=0.0002", "sim.engine.prefill_token_s=0.0001",
         "sim.engine.stall_s=0.05", "sim.trainer.step_s=1.0", "sim.trainer.sync_s=0.1",
         "sim.responses.levels=[{p_correct: 0.6, concentration: 2, len_median: 30, len_sigma: 0.8, wrong_len_factor: 1.5}]")


def test_groups_satisfy_lemma_1_and_their_token_records():
    decided = []
    sim = Simulation(sim_cfg(*NOISY, "pool.name=async"), on_step=lambda step, m, d: decided.extend(d))
    sim.run()
    assert sum(e.stats["preempted"] for e in sim.engines) > 0  # the KV budget was binding
    consumed = [g for g in decided if g.fate.value == "consumed"]
    assert any(g.k_gen() > 0 for g in consumed)  # updates landed mid-response
    for g in consumed:
        versions = [np.repeat(s[0::2], s[1::2]) for s in g.spans]
        assert [len(v) for v in versions] == g.target.tolist()
        assert all((np.diff(v) >= 0).all() and v.max() <= c for v, c in zip(versions, g.done_at.tolist()))
        expect = staleness.group_staleness(versions, g.done_at.tolist(), g.step)
        k, k_gen, k_wait = g.staleness(g.step)
        assert (k, k_gen, k_wait) == pytest.approx(expect, abs=1e-12) and k == pytest.approx(k_gen + k_wait, abs=1e-12)


def test_kv_staleness_of_simulated_groups_is_the_per_token_definition():
    """K_kv of each consumed group equals `pace.staleness`'s per token: w_t the version of the
    first token of the engine run that made it (a preempted sequence is prefilled again on resume),
    K_kv ≥ K_gen; with engines that re-prefill at every update, K_kv = K_gen."""
    decided = []
    sim = Simulation(sim_cfg(*NOISY, "pool.name=async"), on_step=lambda step, m, d: decided.extend(d))
    sim.run()
    consumed = [g for g in decided if g.fate.value == "consumed"]
    resumed_on_newer = 0  # runs resumed after preemption under a newer version than the response's first
    for g in consumed:
        versions = [np.repeat(s[0::2], s[1::2]) for s in g.spans]
        kv = [staleness.kv_versions(v, g.kv_starts.get(j, ())) for j, v in enumerate(versions)]
        resumed_on_newer += sum((w != w[0]).any() for w in kv)
        assert g.k_kv() == pytest.approx(staleness.group_kv_staleness(kv, g.done_at.tolist()), abs=1e-12)
        assert g.k_kv() >= g.k_gen() - 1e-12
    assert resumed_on_newer > 0 and any(g.k_kv() > g.k_gen() for g in consumed)
    rows = group_columns(consumed)
    assert rows["k_kv"] == [g.k_kv() for g in consumed]

    decided.clear()
    sim = Simulation(sim_cfg(*NOISY, "pool.name=async"), on_step=lambda step, m, d: decided.extend(d))
    for e in sim.engines:
        e.reprefill = True
    sim.run()
    consumed = [g for g in decided if g.fate.value == "consumed"]
    assert sum(e.stats["reprefill_tokens"] for e in sim.engines) > 0
    assert any(g.k_gen() > 0 for g in consumed)
    assert all(g.k_kv() == pytest.approx(g.k_gen(), abs=1e-12) for g in consumed)


def test_simulate_writes_the_run_directory_analysis_reads(tmp_path):
    """simulate.py end to end: summarize_run checks Lemma 1 on the logged groups, their recomputation
    from the version spans and the fate accounting (exit status 1 if one fails)."""
    run = tmp_path / "run"
    overrides = [o for o in NOISY if not o.startswith("sim.responses.levels")]
    cmd = [sys.executable, "simulate.py", *overrides, "pool=pace", "logger.progress=false", f"hydra.run.dir={run}",
           "+sim.responses.levels=[{p_correct: 0.6, concentration: 2, len_median: 30, len_sigma: 0.8}]"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["simulated"] and summary["steps"] == 20
    out = subprocess.run([sys.executable, "analysis/summarize_run.py", str(run)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Lemma 1" in out.stdout and "recomputed from per-token version spans" in out.stdout
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 20 and all("pool/budget" in r and "staleness/effective_mean" in r for r in rows)
    # the analysis tools read it: a calibration of the run against itself (ratios 1), a one-point trade-off
    for tool, args in (("analysis.calibration", ["--pair", str(run), str(run), "self"]), ("analysis.tradeoff", [str(run)])):
        out = subprocess.run([sys.executable, "-m", tool, *args, "--out", str(tmp_path / tool)], cwd=ROOT,
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    calib = json.loads((tmp_path / "analysis.calibration" / "calibration.json").read_text())["run (self)"]
    assert calib["s/step"]["real"] == calib["s/step"]["sim"] > 0
    (point,) = json.loads((tmp_path / "analysis.tradeoff" / "tradeoff.json").read_text())
    assert point["label"] == "PACE" and 0 < point["rejected_share"] < 1 and point["k"] == pytest.approx(
        point["k_wait"] + point["k_gen"], abs=1e-9)


def test_group_rows_have_the_logger_schema():
    assert tuple(group_schema().names) == _COLUMNS


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="sim.engine.kv_tokens"):
        sim_cfg("sim.engine.kv_tokens=50", "rollout.max_tokens=96")
    with pytest.raises(ConfigError, match="sim.responses.fixed_correct"):
        sim_cfg("sim.responses.fixed_correct=9", "data.group_size=8")
    with pytest.raises(ConfigError, match="pool.name"):
        sim_cfg("pool.name=nope")


def test_engine_train_slowdown_scales_the_steps_after_the_one_in_progress():
    e = _engine()
    g = _group(4, prompt=2)
    e.submit(g, 0.0)
    e.set_slowdown(2.0, 1.5)  # step 2 (1 → 2 s) is in progress: steps 3 and 4 take 2 s each
    assert [f.time for f in _drain(e)] == [6.0]


def test_fit_recovers_the_response_trainer_and_pfs_models():
    """fit.py on synthetic logs drawn from known models gets them back."""
    import pandas as pd

    from pace.sim import fit

    rng = np.random.default_rng(0)
    g, rows = 8, []
    for _ in range(4000):  # one level: p ~ Beta(0.5·4, 0.5·4), right responses ~40 tokens, wrong ×1.5
        p = rng.beta(2.0, 2.0)
        correct = rng.random(g) < p
        lengths = np.rint(np.where(correct, 40, 60) * np.exp(0.1 * rng.standard_normal(g))).astype(int)
        rows.append({"c": 1, "lengths": lengths.tolist(), "len_mean": lengths.mean(), "acc_mean": correct.mean()})
    (lv,) = fit.fit_levels(pd.DataFrame(rows), g, n_levels=1)
    assert lv["p_correct"] == pytest.approx(0.5, abs=0.02) and lv["concentration"] == pytest.approx(4.0, rel=0.2)
    assert lv["wrong_len_factor"] == pytest.approx(1.5, rel=0.05)
    assert lv["len_median"] * np.exp(lv["len_sigma"] ** 2 / 2) == pytest.approx(40, rel=0.05)

    tokens = rng.integers(20, 60, size=50)
    steps = pd.DataFrame({"train/response_len": tokens, "time/wait_data": 0.5, "time/sync": 0.2,
                          "time/step": 0.5 + 0.2 + 1.0 + 1e-4 * 4 * g * (32 + tokens)})
    t = fit.fit_trainer({"data": {"batch_prompts": 4, "group_size": g}}, steps, prompt_tokens=32)
    assert t["step_s"] == pytest.approx(1.0) and t["per_token_s"] == pytest.approx(1e-4) and t["sync_s"] == pytest.approx(0.2)

    lags = rng.integers(1, 6, size=300)  # every response's 4-token prefix made `lag` versions before the rescore
    pfs = 0.05 * lags**1.5 * np.exp(0.2 * rng.standard_normal(300))
    groups = pd.DataFrame({"pfs": pfs, "pfs_version": 10, "version_spans": [[[10 - k, 4]] for k in lags]})
    got = fit.fit_pfs(groups, prefix=4)
    assert got["power"] == pytest.approx(1.5, abs=0.1) and got["scale"] == pytest.approx(0.05, rel=0.15)
    assert got["noise"] == pytest.approx(0.2, abs=0.05)


def test_phase_metrics_count_engine_and_rescoring_seconds():
    """time/generate is each engine's busy seconds since the last step (≤ the step's wall time); PACE
    effective's time/rescore is the prefill seconds of its rescored prefixes (the engines' counters)."""
    sim = Simulation(sim_cfg(*NOISY, "pool.name=pace"))
    stats = sim.run()
    rows = sim.rows
    assert all(0 < r["time/generate"] <= r["time/step"] + 1e-9 for r in rows[1:])
    total = sum(r["time/rescore"] for r in rows) * len(sim.engines)
    assert stats["rescored"] > 0 and total > 0 and total <= stats["rescore_s"] + 1e-9
    assert stats["rescore_s"] == pytest.approx(stats["rescore_tokens"] * 0.0001, rel=0.05)  # × slowdown 1, prefill_token_s


def test_length_scale_multiplies_the_drawn_lengths_before_the_cap():
    from pace.sim.responses import ResponseModel

    def lengths(scale: float) -> np.ndarray:
        cfg = sim_cfg(*NOISY, f"sim.responses.length_scale={scale}").sim.responses
        model = ResponseModel(cfg, 8, 96, 16, np.random.default_rng(0))
        return np.concatenate([model.draw()[0] for _ in range(200)])

    one, two = lengths(1.0), lengths(2.0)
    short = one < 40  # doubled, these stay under the cap of 96
    assert np.abs(two[short] - 2 * one[short]).max() <= 1 and two.max() == 96
    with pytest.raises(ConfigError, match="sim.responses.length_scale"):
        sim_cfg(*NOISY, "sim.responses.length_scale=0")


def test_simulate_run_outside_hydra_writes_a_run_directory_analysis_labels(tmp_path):
    """scripts call simulate.run(cfg, run_dir): the config analysis reads is written there too."""
    from hydra import compose, initialize_config_dir

    import simulate
    from analysis.runs import load_local

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("simulate", overrides=[*NOISY, "pool=stale_k", "pool.max_lag=2", "logger.progress=false"])
    seen = []
    summary = simulate.run(cfg, tmp_path / "run", on_step=lambda step, m, d: seen.append(step))
    run = load_local(tmp_path / "run")
    assert summary["steps"] == 20 and seen == list(range(20)) and run.label == "Stale-2" and len(run.steps) == 20


@pytest.mark.parametrize("cap,buffer", [(20480, 4096), (96, 16), (64, 0)])
def test_simulated_rewards_use_the_real_overlong_penalty(cap, buffer):
    """The simulator's vectorised shaping is DAPO's `overlong_penalty` (the one train.py grades with)."""
    from pace.algo.advantages import overlong_penalty
    from pace.sim.responses import _overlong

    lens = np.unique(np.r_[1, np.linspace(1, cap, 97).astype(int), cap - buffer, cap - buffer + 1, cap])
    lens = lens[lens >= 1]
    expect = [overlong_penalty(int(n), cap, buffer) for n in lens]
    assert _overlong(lens, cap, buffer).tolist() == pytest.approx(expect, abs=1e-15)


def test_the_tokens_a_preemption_would_lose_are_the_engines_tokens_not_in_completed_groups():
    """`sim/inflight_tokens` (simulate.py's estimate of what a preemption loses without in-flight
    resume) against an independent count: every decode token the engines made is in a completed
    group (decided or pooled) or in flight. Preemption on (the KV budget binds), three engines."""
    decided = []
    sim = Simulation(sim_cfg(*NOISY, "pool.name=async"), on_step=lambda step, m, d: decided.extend(d))
    sim.run()
    assert sum(e.stats["preempted"] for e in sim.engines) > 0
    done = sum(g.num_tokens for g in decided) + sum(g.num_tokens for g in sim.pool.remaining() if g.fate.value == "pooled")
    work = sim._inflight_work()
    assert work["sim/inflight_tokens"] == sum(e.tokens for e in sim.engines) - done > 0
    assert all(r["sim/inflight_tokens"] > 0 and r["sim/inflight_gpu_s"] > 0 for r in sim.rows)


def _sim_paper():
    """scripts/sim_paper.py as a module: its paper settings, the check's thresholds and `check`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sim_paper", ROOT / "scripts" / "sim_paper.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SIM_PAPER = _sim_paper()


@pytest.mark.parametrize("preset", SIM_PAPER.PAPER_SETTINGS)
def test_paper_presets_build_a_pool_past_n_star_that_pace_rejects_from(preset):
    """40 steps of each paper preset as configured, on its own scenario (validation included), held to
    scripts/sim_paper.py's check: Async's pool passes n* (= B), PACE rejects in at least a quarter of
    its steps at most 10% slower than Async, Sync is clearly slower. With generation the slower side
    (the 4B on 4 + 4 GPUs, the 30B-A3B on one node) PACE never rejects and the paper's comparison
    does not exist."""
    sp = SIM_PAPER
    sp.register_run()
    sp.register()
    scenario = next(scenario for row, scenario, _ in sp.ROWS if row == preset)
    by = {(preset, m): sp.simulate(sp.config(preset, scenario, m, 40)) for m in ("sync", "async", "pace")}
    got = sp.check(by, preset)
    assert got["pool_max"] > got["n_star"]
    assert got["rejecting_steps"] >= sp.CHECK["rejecting_steps"]
    assert got["pace_over_async"] <= sp.CHECK["pace_over_async"]
    assert got["sync_over_async"] >= sp.CHECK["sync_over_async"]
    assert got["holds"]


def test_client_cost_lengthens_the_steps_that_overlap_generation_by_the_measured_curve():
    """sim.client: a step starting while the engines decode R tokens/s takes × (1 + slowdown(busy)),
    busy = R · us_per_token · 1e-6, slowdown interpolated in the measured curve; Sync's steps (the
    engines idle while it trains) are not touched."""
    e = _engine(step_s=0.5, per_seq_s=0.25)
    e.submit(_group(8, 8, prompt=2), 0.0)
    assert e.n == 2 and e.token_rate() == pytest.approx(2.0)  # 2 tokens a step of 0.5 + 2 · 0.25 s
    client = ("sim.client.us_per_token=150000", "sim.client.curve=[[0,0],[0.2,0.1],[1,1]]")
    s = Simulation(sim_cfg(*DET, "pool.name=async", "rollout.max_inflight_groups=8", *client))
    s.engines = [e]
    assert s._client_slowdown() == pytest.approx(1 + 0.1 + 0.9 * (0.3 - 0.2) / 0.8)  # busy 2 · 0.15 = 0.3
    base = Simulation(sim_cfg(*DET, "pool.name=async", "rollout.max_inflight_groups=8"))
    slow = Simulation(sim_cfg(*DET, "pool.name=async", "rollout.max_inflight_groups=8", *client))
    base.run()
    slow.run()
    longer = [b["time/step"] < s["time/step"] for b, s in zip(base.rows[1:], slow.rows[1:])]
    assert all(longer)
    sync = Simulation(sim_cfg(*DET, "pool.name=sync", *client))
    sync.run()
    assert [r["time/step"] for r in sync.rows] == pytest.approx([1.5] * 10)
    with pytest.raises(ConfigError, match="sim.client"):
        sim_cfg("sim.client.curve=[[0.5,0],[0.2,1]]")
