"""analysis/ without runs: the .wandb log reader on synthetic files, method labels from configs,
and the claim rules on hand-made step / group tables."""
from __future__ import annotations

import struct

import pandas as pd
import pytest

from analysis import claims
from analysis.runs import Run, from_records, method_label
from analysis.wandb_log import BLOCK, HEADER, WandbLogError, read_run, records


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


def test_claim_b_and_c_rules_by_hand():
    asyn = _run({"pool": {"name": "async"}}, {"pool/occupancy": [10] * 10 + [50] * 10, "staleness/k_wait_mean": [1.0] * 10 + [4.0] * 10,
                                             "rollout/acc_mean": [0.5] * 20})
    pace = _run({"pool": {"name": "pace"}}, {"pool/occupancy": [10] * 20, "staleness/k_wait_mean": [1.0] * 20,
                                            "rollout/acc_mean": [0.5] * 20})
    groups = {"Async": [asyn], "PACE": [pace]}
    b = claims.backlog(groups)
    assert b["holds"] and (b["occupancy_first_tenth"], b["occupancy_last_tenth"]) == (10, 50)
    c = claims.pace_vs_async(groups, warmup=0)
    assert c["k_wait_mean"] == {"PACE": 1.0, "Async": 2.5} and c["lower_k_wait"]
    assert c["score_metric"] == "last-tenth rollout accuracy" and c["learns_as_well"] and c["time_ratio"] == 1.0
    assert c["holds"]


def test_claim_d_counts_long_rejections_against_the_run_median():
    def groups(rejected_lengths):
        kept = [10.0, 20.0, 30.0, 40.0]
        rows = [{"fate": "consumed", "len_mean": x} for x in kept] + [{"fate": "rejected", "len_mean": x} for x in rejected_lengths]
        return pd.DataFrame(rows)

    eff = _run({"pool": {"name": "pace"}}, {"x": [0]}, groups([10.0, 50.0]))  # median of all 6: 30 → 1 of 2 long
    raw = _run({"pool": {"name": "pace"}, "pace": {"score": "raw"}}, {"x": [0]}, groups([45.0, 50.0]))  # median 35 → 2 of 2
    d = claims.long_rejections({"PACE": [eff], "PACE (raw)": [raw]})
    assert d["PACE"]["share_long"] == 0.5 and d["PACE (raw)"]["share_long"] == 1.0 and d["holds"]


def test_claims_without_their_runs_are_not_tested():
    out = claims.evaluate_claims([_run({"pool": {"name": "sync"}}, {"rollout/acc_mean": [0.5]})])
    assert all(not c["tested"] for c in out.values())
