"""analysis/ without runs: the .wandb log reader on synthetic files, method labels from configs,
and the claim rules on hand-made step / group tables."""
from __future__ import annotations

import struct

import pandas as pd
import pytest

from analysis import claims
from analysis.runs import Run, from_records, method_label
from analysis.wandb_log import BLOCK, HEADER, WandbLogError, read_run, records
from tests.helpers import compose_cfg


def _chunks(payload: bytes, pos: int) -> tuple[bytes, int]:
    """One record as the writer lays it out from file offset ``pos`` (LevelDB log format)."""
    out, first = b"", True
    while True:
        room = BLOCK - pos % BLOCK
        if room < 7:
            out, pos = out + b"\0" * room, pos + room
            continue
        piece, payload = payload[: room - 7], payload[room - 7 :]
        kind = (1 if not payload else 2) if first else (4 if not payload else 3)
        out += struct.pack("<IHB", 0, len(piece), kind) + piece
        pos += 7 + len(piece)
        first = False
        if not payload:
            return out, pos


def _write(path, payloads: list[bytes]) -> None:
    data, pos = HEADER, len(HEADER)
    for p in payloads:
        chunk, pos = _chunks(p, pos)
        data += chunk
    path.write_bytes(data)


def _history(step: int, **values) -> bytes:
    import json

    from wandb.proto import wandb_internal_pb2 as pb

    rec = pb.Record()
    for k, v in {"_step": step, **values}.items():
        item = rec.history.item.add()
        item.key = k
        item.value_json = json.dumps(v)
    return rec.SerializeToString()


def test_records_reassemble_records_that_span_blocks(tmp_path):
    payloads = [b"a" * 10, b"b" * (BLOCK * 2 + 123), b"c" * (BLOCK - 7 - len(HEADER) - 20), b"d" * 5]
    _write(tmp_path / "run-x.wandb", payloads)
    assert list(records(tmp_path / "run-x.wandb")) == payloads


def test_records_stop_at_a_torn_tail_and_reject_other_damage(tmp_path):
    _write(tmp_path / "run-x.wandb", [b"one", b"two" * 100])
    data = (tmp_path / "run-x.wandb").read_bytes()
    (tmp_path / "run-t.wandb").write_bytes(data[:-50])  # killed mid-write
    assert list(records(tmp_path / "run-t.wandb")) == [b"one"]
    (tmp_path / "run-h.wandb").write_bytes(b"XXXX" + data[4:])
    with pytest.raises(WandbLogError, match="header"):
        list(records(tmp_path / "run-h.wandb"))
    bad = bytearray(data)
    bad[len(HEADER) + 6] = 9  # chunk type 9
    (tmp_path / "run-b.wandb").write_bytes(bytes(bad))
    with pytest.raises(WandbLogError, match="damaged"):
        list(records(tmp_path / "run-b.wandb"))


def test_read_run_collects_history_rows(tmp_path):
    d = tmp_path / "offline-run-1-abc"
    d.mkdir()
    _write(d / "run-abc.wandb", [_history(0, **{"train/loss": 0.5}), _history(1, **{"train/loss": 0.25, "x" * 40_000: 1})])
    run = read_run(d)
    assert run.id == "abc" and [h["train/loss"] for h in run.history] == [0.5, 0.25]


@pytest.mark.parametrize("cfg, label", [
    ({"pool": {"name": "sync"}}, "Sync"),
    ({"pool": {"name": "async"}, "algo": {"name": "dapo"}}, "Async"),
    ({"pool": {"name": "async"}, "algo": {"name": "m2po"}}, "M2PO"),
    ({"pool": {"name": "stale_k", "max_lag": 4.0}}, "Stale-4"),
    ({"pool": {"name": "pace"}, "pace": {"score": "effective", "gamma": 1.0}}, "PACE"),
    ({"pool": {"name": "pace"}, "pace": {"score": "effective", "gamma": 2.0}}, "PACE γ=2"),
    ({"pool": {"name": "pace"}, "pace": {"score": "raw", "gamma": 1.0}}, "PACE (raw)"),
])
def test_method_label(cfg, label):
    assert method_label(cfg) == label


def _run(label_cfg: dict, steps: dict, groups: pd.DataFrame | None = None, val: list[dict] | None = None) -> Run:
    n = len(next(iter(steps.values())))
    rows = [{"step": i, "train/loss": 0.0, "time/step": 1.0, **{k: v[i] for k, v in steps.items()}} for i in range(n)]
    rows += val or []
    return from_records("r", "local", rows, groups if groups is not None else pd.DataFrame(), {}, label_cfg)


def test_validation_rows_get_the_wall_time_at_which_their_weights_existed():
    r = _run({}, {"x": [0] * 4}, val=[{"val/avg": 0.1, "val/version": 0}, {"val/avg": 0.3, "val/version": 4}])
    assert r.val["wall"].tolist() == [0.0, 4.0] and r.val["version"].tolist() == [0, 4]
    assert len(r.steps) == 4  # validation rows are not steps


def test_interval_is_the_student_t_interval_over_seeds():
    iv = claims.interval([1.0, 2.0, 6.0])  # mean 3, sd √7, t(0.975, 2) = 4.3027
    half = 4.302653 * 7 ** 0.5 / 3 ** 0.5
    assert iv["n"] == 3 and iv["mean"] == 3.0 and iv["lo"] == pytest.approx(3 - half) and iv["hi"] == pytest.approx(3 + half)
    assert claims.below(iv, 10.0) == "holds" and claims.below(iv, -5.0) == "does not hold"
    assert claims.below(iv, 3.0) == "inconclusive"
    assert claims.above(iv, -5.0) == "holds" and claims.above(iv, 10.0) == "does not hold"
    one = claims.interval([1.0])
    assert claims.below(one, 10.0) == claims.above(one, -10.0) == "inconclusive"  # one seed decides nothing


def _async_pace(seed: int, backlog: float, k_wait_pace: float, pace_seconds: float = 1.0):
    asyn = _run({"pool": {"name": "async"}, "seed": seed},
                {"pool/occupancy": [10] * 10 + [10 + backlog] * 10, "staleness/k_wait_mean": [1.0] * 10 + [4.0] * 10,
                 "rollout/acc_mean": [0.5] * 20})
    pace = _run({"pool": {"name": "pace"}, "seed": seed},
                {"pool/occupancy": [10] * 20, "staleness/k_wait_mean": [k_wait_pace] * 20, "rollout/acc_mean": [0.5] * 20})
    pace.steps["time/step"] = pace_seconds
    return asyn, pace


def test_claim_b_and_c_rules_by_hand():
    runs = [_async_pace(s, backlog, kw) for s, backlog, kw in [(0, 40, 1.0), (1, 30, 1.2), (2, 50, 0.8)]]
    groups = {"Async": [a for a, _ in runs], "PACE": [p for _, p in runs]}
    b = claims.backlog(groups)
    assert b["verdict"] == "holds" and (b["occupancy_first_tenth"], b["occupancy_last_tenth"]) == (10, 50)
    assert b["interval"]["occupancy"]["values"] == [40, 30, 50] and b["interval"]["k_wait"]["mean"] == 3.0
    c = claims.pace_vs_async(groups, warmup=0)
    assert c["k_wait_mean"] == {"PACE": pytest.approx(1.0), "Async": 2.5} and c["seeds"] == [0, 1, 2]
    assert c["interval"]["k_wait"]["values"] == pytest.approx([-1.5, -1.3, -1.7])  # paired by seed
    assert c["score_metric"] == "last-tenth rollout accuracy" and c["interval"]["time_ratio"]["values"] == [1.0] * 3
    # equal scores: the interval is [0, 0], inside the margin; equal step times: within 10%
    assert c["parts"] == {"lower_k_wait": "holds", "learns_as_well": "holds", "close_wall_time": "holds"} and c["holds"]
    # a backlog in one seed only: inconclusive; PACE 30% slower in every seed: (c) does not hold
    flat = [_async_pace(s, backlog, 1.0, 1.3) for s, backlog in [(0, 40), (1, -5), (2, 0)]]
    groups = {"Async": [a for a, _ in flat], "PACE": [p for _, p in flat]}
    assert claims.backlog(groups)["verdict"] == "inconclusive"
    c = claims.pace_vs_async(groups, warmup=0)
    assert c["parts"]["close_wall_time"] == "does not hold" and c["verdict"] == "does not hold" and not c["holds"]


def _val(r: list[float]) -> list[dict]:
    return [{"val/avg": a, "val/version": 10 * i} for i, a in enumerate(r)]


def test_claim_c_scores_the_validations_after_theta_0_against_the_margin():
    def pair(seed, pace_val, async_val):
        a = _run({"pool": {"name": "async"}, "seed": seed}, {"staleness/k_wait_mean": [3.0] * 4, "rollout/acc_mean": [0.5] * 4},
                 val=_val(async_val))
        p = _run({"pool": {"name": "pace"}, "seed": seed}, {"staleness/k_wait_mean": [1.0] * 4, "rollout/acc_mean": [0.5] * 4},
                 val=_val(pace_val))
        return a, p

    # θ_0 is left out (0.9 vs 0.1 there): after it PACE is 0.05 worse in every seed, beyond the 0.02 margin
    rs = [pair(s, [0.9, 0.40 + d, 0.50 + d], [0.1, 0.45 + d, 0.55 + d]) for s, d in enumerate([0.0, 0.01, 0.02])]
    c = claims.pace_vs_async({"Async": [a for a, _ in rs], "PACE": [p for _, p in rs]}, warmup=0)
    assert c["score_metric"] == "mean validation average after θ_0"
    assert c["interval"]["score"]["values"] == pytest.approx([-0.05] * 3) and c["parts"]["learns_as_well"] == "does not hold"
    deltas = [(0.03, -0.01), (-0.02, 0.0), (0.0, -0.03)]  # PACE − Async after θ_0: +0.01, −0.01, −0.015
    rs = [pair(s, [0.1, 0.45 + d, 0.55 + e], [0.1, 0.45, 0.55]) for s, (d, e) in enumerate(deltas)]
    c = claims.pace_vs_async({"Async": [a for a, _ in rs], "PACE": [p for _, p in rs]}, warmup=0)
    assert c["parts"]["learns_as_well"] == "inconclusive" and c["parts"]["lower_k_wait"] == "holds"  # −2 in every seed


def test_claim_a_fits_a_slope_per_seed_against_log2_k():
    def run(k, seed, acc):
        return _run({"pool": {"name": "stale_k", "max_lag": k}, "seed": seed}, {"rollout/acc_mean": [acc] * 4 + [0.9] * 4})

    slow = {f"Stale-{k}": [run(k, s, 0.6 - 0.02 * i + 0.01 * s) for s in range(3)] for i, k in enumerate([1, 2, 4, 8])}
    a = claims.stale_k(slow)
    assert a["interval"]["values"] == pytest.approx([-0.02] * 3) and a["monotone"]
    assert a["early_rollout_acc"]["Stale-1"] == pytest.approx(0.61)  # the first half only
    noisy = {f"Stale-{k}": [run(k, s, 0.6 + 0.02 * (-1) ** (s + i) * i) for s in range(3)] for i, k in enumerate([1, 2, 4, 8])}
    assert claims.stale_k(noisy)["verdict"] == "inconclusive"


def test_claim_d_counts_long_rejections_against_the_run_median():
    def groups(rejected_lengths):
        kept = [10.0, 20.0, 30.0, 40.0]
        rows = [{"fate": "consumed", "len_mean": x} for x in kept]
        rows += [{"fate": "rejected", "len_mean": x} for x in rejected_lengths]
        return pd.DataFrame(rows)

    def pace(score, seed, rejected):
        return _run({"pool": {"name": "pace"}, "pace": {"score": score}, "seed": seed}, {"x": [0]}, groups(rejected))

    # effective: 1 of 2 rejected groups above the run's median (25); raw: 2 of 2 (median 35), in every seed
    eff = [pace("effective", s, [10.0, 50.0]) for s in range(3)]
    raw = [pace("raw", s, [45.0, 50.0 + s]) for s in range(3)]
    d = claims.long_rejections({"PACE": eff, "PACE (raw)": raw})
    assert d["PACE"]["share_long"] == 0.5 and d["PACE (raw)"]["share_long"] == 1.0 and d["PACE"]["rejected"] == 6
    assert d["interval"]["values"] == [-0.5] * 3 and d["verdict"] == "holds"
    raw[2] = pace("raw", 2, [10.0, 50.0])  # seed 2: as the effective run → differences −0.5, −0.5, 0
    d = claims.long_rejections({"PACE": eff, "PACE (raw)": raw})
    assert d["interval"]["mean"] == pytest.approx(-1 / 3) and d["interval"]["hi"] > 0 and d["verdict"] == "inconclusive"


def test_claims_without_their_runs_are_not_tested():
    out = claims.evaluate_claims([_run({"pool": {"name": "sync"}}, {"rollout/acc_mean": [0.5]})])
    assert all(not c["tested"] for c in out.values())


def test_the_report_says_how_many_seeds_an_undecided_claim_would_need():
    from analysis.report import _needs, seeds_to_decide

    iv = claims.interval([1.0, 2.0, 6.0])  # mean 3, sd 2.65: t(4)·sd/√5 = 3.29 > 3, t(5)·sd/√6 = 2.78 < 3
    assert seeds_to_decide(iv, 0.0) == 6 and seeds_to_decide(iv, 3.0) is None
    assert seeds_to_decide(claims.interval([1.0]), 0.0) is None
    a = {"tested": True, "verdict": "inconclusive", "interval": iv}
    assert "about 6 seeds" in _needs("a_stale_k", a) and _needs("a_stale_k", {**a, "verdict": "holds"}) == ""
    c = {"tested": True, "verdict": "inconclusive", "margin": 0.02, "time_slack": 0.1,
         "parts": {"lower_k_wait": "holds", "learns_as_well": "inconclusive", "close_wall_time": "holds"},
         "interval": {"k_wait": iv, "score": claims.interval([0.01, -0.02, 0.0]), "time_ratio": iv}}
    assert _needs("c_pace_vs_async", c).count("seeds") == 1 and "score: about" in _needs("c_pace_vs_async", c)


def test_figure_7_draws_one_method_alone_and_skips_a_run_without_groups():
    from analysis import figures

    groups = pd.DataFrame({"fate": ["consumed", "consumed", "rejected"], "k_wait": [1.0, 3.0, 9.0],
                           "k_gen": [0.5, 0.0, 1.0], "k": [1.5, 3.0, 10.0]})
    async_run = _run({"pool": {"name": "async"}}, {"reward/mean": [0.0, 0.1]}, groups)
    fig = figures.consumed_staleness([async_run])
    assert fig is not None and [ax.get_title() for ax in fig.axes][:3] == [
        "Waiting Staleness $K_{wait}$", "Generation Staleness $K_{gen}$", "Effective Staleness $S_{eff}$"]
    # no s_eff column (not recorded): the panel says so and draws nothing
    assert not fig.axes[2].patches and fig.axes[2].texts[0].get_text() == "Async: not recorded (pool.record_effective)"
    assert figures.consumed_staleness([_run({"pool": {"name": "async"}}, {"reward/mean": [0.0]})]) is None
    assert figures.consumed_staleness([_run({"pool": {"name": "sync"}}, {"reward/mean": [0.0]}, groups)]) is None


def test_the_pool_figure_draws_occupancy_with_pace_target_and_its_rejections():
    from analysis import figures

    steps = {"pool/occupancy": [30, 200, 900], "pool/rejected": [0, 0, 0]}
    async_run = _run({"pool": {"name": "async"}, "data": {"batch_prompts": 32}}, steps)
    pace = _run({"pool": {"name": "pace"}, "pace": {"score": "effective", "gamma": 1.0, "target_pool": None},
                 "data": {"batch_prompts": 32}}, {"pool/occupancy": [30, 40, 33], "pool/rejected": [0, 8, 4]})
    left, right = figures.pool_over_time([async_run, pace]).axes
    assert [line.get_label() for line in left.lines] == ["Async", "PACE", "PACE target n* = 32"]
    assert list(left.lines[2].get_ydata()) == [32, 32]
    assert [line.get_label() for line in right.lines] == ["PACE"]  # Async rejects nothing: not drawn
    assert figures.pool_over_time([_run({"pool": {"name": "sync"}}, {"pool/occupancy": [0, 0]})]) is None
    assert figures.pool_over_time([_run({"pool": {"name": "async"}}, {"reward/mean": [0.0]})]) is None


def test_every_setting_the_report_names_composes():
    """A `key=value` the report's captions tell the reader to set is a valid override of the run's
    config (e.g. `pool.record_effective` is a share of groups, not a switch)."""
    import re

    from analysis.report import CAPTIONS

    settings = {m for _, caption in CAPTIONS.values() for m in re.findall(r"`([a-z_]+\.[a-z_.]+=[^`\s]+)`", caption)}
    assert settings  # the captions do name some
    for setting in sorted(settings):
        compose_cfg([setting])


def _run_dir(tmp_path, rows: list[dict], summary: dict):
    import json

    d = tmp_path / "run"
    (d / "groups").mkdir(parents=True)
    base = {"time/step": 1.0, "train/reward_mean": 0.0, "train/acc_mean": 0.5}
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i, **base, **r}) + "\n" for i, r in enumerate(rows)))
    (d / "summary.json").write_text(json.dumps(summary))
    return d


def test_summarize_prints_the_fleet_line_of_a_run_whose_engine_failed_and_rejoined(tmp_path, capsys):
    """Two servers, one killed after step 1, restarted and joined at step 3 (12.5 s), a new one
    joined at step 4 (3.5 s); the rejoined engine's mismatch from its first measured step."""
    from analysis.summarize_run import summarize

    nan = float("nan")
    rows = [
        {"rollout/engines_alive": 2, "rollout/engine_restarts": 0, "mismatch/abs_logp_diff/engine0": 4e-7,
         "mismatch/abs_logp_diff/engine1": 3e-7},
        {"rollout/engines_alive": 1, "rollout/engine_restarts": 0, "rollout/engine_join_s": nan,
         "mismatch/abs_logp_diff/engine0": 5e-7},
        {"rollout/engines_alive": 1, "rollout/engine_restarts": 1},
        {"rollout/engines_alive": 2, "rollout/engine_restarts": 1, "rollout/engine_join_s": 12.5,
         "mismatch/abs_logp_diff/engine1": 6e-7},
        {"rollout/engines_alive": 3, "rollout/engine_restarts": 1, "rollout/engine_join_s": 3.5},
    ]
    run = _run_dir(tmp_path, rows, {"status": "finished", "rollout": {"engine_failures": 1, "failover_lost_tokens": 17}})
    summarize(str(run))
    fleet = [line for line in capsys.readouterr().out.splitlines() if line.startswith("fleet:")]
    assert fleet == ["fleet: 1 engine failures, 1 restarts, 2 joins (median 8.0 s, max 12.5 s)   engines alive 1-3"
                     "   failover lost tokens 17   on-policy mismatch max engine0 5.0e-07, engine1 6.0e-07"]
    # a run without a fleet of servers prints no fleet line
    summarize(str(_run_dir(tmp_path / "plain", [{}], {"status": "finished"})))
    assert "fleet:" not in capsys.readouterr().out
