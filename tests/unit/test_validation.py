"""In-training validation pieces without an engine: metric names and the best checkpoint (the eval
grading path fed malformed model outputs is in tests/integration/test_eval_grading.py)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from pace.checkpoint import save_weights
from pace.rollout.val_requests import ValResult
from pace.validation import BestCheckpoint, val_metrics


def _validation(version, results, weights=None):
    return ValResult(version=version, results=results, seconds=1.5, response_len=20.0, weights=weights)


def test_val_metric_names_follow_design():
    m = val_metrics(_validation(7, {"arith_l1": [[True, False]], "arith_l2": [[False, False]]}), k=2)
    assert m == {"val/arith_l1/mean@2": 0.5, "val/arith_l2/mean@2": 0.0, "val/avg": 0.25,
                 "val/version": 7, "val/response_len": 20.0, "time/validate": 1.5}


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "qwen3"}')
    (d / "tokenizer.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"original weights")
    (d / "model.safetensors.index.json").write_text("{}")
    return d


def _weights(value: float):
    return [("a.weight", torch.full((2, 3), value)), ("b.bias", torch.arange(3.0)[::2])]  # a non-contiguous view


def test_save_weights_writes_a_loadable_directory(tmp_path, model_dir):
    from safetensors.torch import load_file

    out = tmp_path / "run" / "best"
    out.parent.mkdir()
    save_weights(out, _weights(1.0), str(model_dir))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    loaded = load_file(out / "model.safetensors")
    assert torch.equal(loaded["a.weight"], torch.ones(2, 3)) and torch.equal(loaded["b.bias"], torch.tensor([0.0, 2.0]))
    save_weights(out, _weights(2.0), str(model_dir))  # replaced whole, no leftovers beside it
    assert torch.equal(load_file(out / "model.safetensors")["a.weight"], torch.full((2, 3), 2.0))
    assert sorted(p.name for p in out.parent.iterdir()) == ["best"]


def test_best_checkpoint_keeps_the_highest_average_within_n(tmp_path, model_dir):
    from safetensors.torch import load_file

    best = BestCheckpoint(tmp_path, str(model_dir), best_within=20)
    offers = [(0, 0.30, None), (10, 0.50, _weights(10.0)), (15, 0.50, _weights(15.0)),  # a tie keeps 10
              (20, 0.45, _weights(20.0)), (25, 0.90, _weights(25.0))]  # 25 is past N = 20
    kept = [best.offer(_validation(v, {}, w), avg) for v, avg, w in offers]
    assert kept == [True, True, False, False, False]
    assert best.best == {"version": 10, "val/avg": 0.50, "path": str(tmp_path / "best")}
    assert torch.equal(load_file(tmp_path / "best" / "model.safetensors")["a.weight"], torch.full((2, 3), 10.0))
    assert json.loads((tmp_path / "best.json").read_text()) == best.best
    s = best.summary()
    assert s["best_within"] == 20 and [h["version"] for h in s["validations"]] == [0, 10, 15, 20, 25]


def test_best_checkpoint_version_0_names_the_model_on_disk(tmp_path, model_dir):
    best = BestCheckpoint(tmp_path, str(model_dir), best_within=None)
    assert best.offer(_validation(0, {}), 0.4)
    assert best.offer(_validation(5, {}, _weights(5.0)), 0.3) is False
    assert best.best["path"] == str(model_dir) and not (tmp_path / "best").exists()


class _Sync:
    """Stands in for `WeightSync` with a blocking backend (nccl, gloo, ipc): publishing θ_v lets the
    engines load it, and they validate it on their own schedule (the first loaded version at or
    past each multiple of ``every``); ``weights`` reads the trainer's θ_v (a collective on every rank)."""

    backend = "nccl"

    def __init__(self, rollout, every: int):
        self.rollout, self.every, self.gathered = rollout, every, []

    def publish(self, version):
        if self.rollout is not None and version >= self.rollout.next:  # rank 0 drives the engines
            self.rollout.val_started, self.rollout.next = version, (version // self.every + 1) * self.every

    def weights(self, version):
        self.gathered.append(version)
        return _weights(float(version))


def test_a_blocking_backend_keeps_each_validated_version_until_its_validation_decides(tmp_path, model_dir):
    """No host copy reaches the validation: the trainer copies θ_v after publishing it, when the
    engines validate it; the validation promotes the copy to best/ or deletes it. Versions that are
    no checkpoint's (save_every 20, validation every 10: 10, 30, 50) still have their weights."""
    from safetensors.torch import load_file

    from pace.validation import publish

    run = tmp_path / "run"
    rollout = SimpleNamespace(val_started=None, next=10)
    sync, best = _Sync(rollout, every=10), BestCheckpoint(run, str(model_dir), best_within=40)
    avg = {10: 0.5, 20: 0.4, 30: 0.7, 40: 0.6, 50: 0.99}  # 50 is past N = 40
    decided = []

    def decide(flag):  # rank 0's flag on every rank: a collective (pace/control.py)
        decided.append(flag)
        return flag

    for v in range(1, 51):
        publish(sync, v, best, rollout, decide, best_within=40)
        if v in avg:  # the validation arrives later than the copy (here: right after)
            assert best.candidate(v).is_dir() == (v <= 40)
            best.offer(_validation(v, {}), avg[v])
            assert not best.candidates.exists() or not any(best.candidates.iterdir())
    assert sync.gathered == [10, 20, 30, 40]  # the validated versions in the window, nothing else
    assert len(decided) == 40  # every rank knows the window: no collective past it (θ_41 … θ_50)
    assert best.best == {"version": 30, "val/avg": 0.7, "path": str(run / "best")}
    assert json.loads((run / "best.json").read_text()) == best.best
    assert torch.equal(load_file(run / "best" / "model.safetensors")["a.weight"], torch.full((2, 3), 30.0))
    assert best.summary()["best_copies"]["count"] == 4
    best.keep_candidate(60, _weights(60.0))  # the run stops before θ_60's validation
    best.close()  # train.py's `finally`, however the run ends: no candidate (a full model each) is left
    assert sorted(p.name for p in run.iterdir()) == ["best", "best.json"]
    # other ranks: no best, no rollout; they gather when rank 0 decides so (pace/control.py)
    other = _Sync(None, every=10)
    publish(other, 60, None, None, decide=lambda flag: True)
    assert other.gathered == [60]


def test_shm_needs_no_candidate_and_a_validation_without_weights_keeps_the_previous_best(tmp_path, model_dir, capsys):
    """A new best with no copy of its weights is a warning and no new best (a raise would stop rank 0
    alone, between collectives), recorded in the summary."""
    from pace.validation import publish

    rollout = SimpleNamespace(val_started=None, next=10)
    sync = _Sync(rollout, every=10)
    sync.backend = "pace_shm"
    best = BestCheckpoint(tmp_path, str(model_dir), best_within=None)
    publish(sync, 10, best, rollout)
    assert sync.gathered == [] and not best.candidate(10).exists()  # θ_10 comes with its validation
    assert best.offer(_validation(10, {}, _weights(10.0)), 0.4)
    assert best.offer(_validation(20, {}), 0.5) is False
    assert "validation of θ_20: no copy of its weights" in capsys.readouterr().err
    assert best.best["version"] == 10 and json.loads((tmp_path / "best.json").read_text())["version"] == 10
    assert best.summary()["best_missed"] == [20]


def test_a_failed_write_is_a_warning_and_the_previous_best_stays(tmp_path, model_dir, monkeypatch, capsys):
    """Disk full while writing a candidate or the new best: one warning each, θ_10 stays (its
    weights too, even when it had been set aside for the checkpoint)."""
    from safetensors.torch import load_file

    from pace.checkpoint import saved_version

    run = tmp_path / "run"
    best = BestCheckpoint(run, str(model_dir), best_within=None)
    best.offer(_validation(10, {}, _weights(10.0)), 0.5)
    best.saved(10)  # θ_10 is the checkpoint's: replacing it sets it aside first

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", full)
    best.keep_candidate(20, _weights(20.0))
    assert "θ_20: its copy" in capsys.readouterr().err
    assert not best.candidates.exists() or not any(best.candidates.iterdir())
    assert best.offer(_validation(20, {}), 0.6) is False
    assert best.offer(_validation(30, {}, _weights(30.0)), 0.7) is False
    assert "validation of θ_30: its weights could not be written" in capsys.readouterr().err
    assert best.best["version"] == 10 and best.summary()["best_missed"] == [20, 30] and best.copies["count"] == 0
    assert saved_version(run / "best") == 10
    assert torch.equal(load_file(run / "best" / "model.safetensors")["a.weight"], torch.full((2, 3), 10.0))


def test_resume_finds_the_checkpoints_best_even_after_a_later_one_replaced_it(tmp_path, model_dir):
    """θ_10 is the best when step 20 is checkpointed; θ_30 replaces it; the run stops. Resumed from
    step 20, the best is θ_10 again, with its weights (set aside, not deleted)."""
    from safetensors.torch import load_file

    run = tmp_path / "run"
    best = BestCheckpoint(run, str(model_dir), best_within=None)
    best.offer(_validation(10, {}, _weights(10.0)), 0.5)
    state = best.state_dict()  # the checkpoint of step 20 records it
    best.saved(20)
    best.offer(_validation(30, {}, _weights(30.0)), 0.7)
    assert (run / "best.checkpointed").is_dir()  # θ_10, for a resume from step 20
    best.keep_candidate(40, _weights(40.0))  # written, then the run stopped before its validation
    resumed = BestCheckpoint(run, str(model_dir), best_within=None)
    assert not resumed.candidates.exists() or not any(resumed.candidates.iterdir())
    resumed.load_state_dict(state)
    assert resumed.best["version"] == 10 and json.loads((run / "best.json").read_text())["version"] == 10
    assert torch.equal(load_file(run / "best" / "model.safetensors")["a.weight"], torch.full((2, 3), 10.0))
    assert not (run / "best.checkpointed").exists()
    # a later checkpoint records its best: the one set aside for the previous one goes
    best.saved(40)
    best.offer(_validation(50, {}, _weights(50.0)), 0.9)
    assert (run / "best.checkpointed").is_dir()
    best.saved(60)
    assert not (run / "best.checkpointed").exists()
    # from an older checkpoint than the newest, its best is gone: said in one line, not guessed
    from pace.errors import ConfigError

    with pytest.raises(ConfigError, match="resume: the checkpoint's best θ_10 is neither in"):
        BestCheckpoint(run, str(model_dir), best_within=None).load_state_dict(state)


class _Killed(BaseException):
    """A kill at one line: nothing after it runs (not even `except Exception`)."""


def _killed_at(monkeypatch, target, name):
    def stop(*a, **k):
        raise _Killed

    monkeypatch.setattr(target, name, stop)


def test_a_kill_between_the_new_best_and_best_json_resumes_with_the_checkpoints_weights(tmp_path, model_dir, monkeypatch):
    """θ_10 is the checkpoint's best; θ_30's candidate becomes best/ and the run is killed before
    best.json says so. The resume must find θ_10's weights (set aside), not keep θ_30's under θ_10's name."""
    from safetensors.torch import load_file

    run = tmp_path / "run"
    best = BestCheckpoint(run, str(model_dir), best_within=None)
    best.keep_candidate(10, _weights(10.0))
    best.offer(_validation(10, {}), 0.5)
    state = best.state_dict()
    best.saved(20)
    best.keep_candidate(30, _weights(30.0))
    with monkeypatch.context() as m:
        _killed_at(m, BestCheckpoint, "_write")
        with pytest.raises(_Killed):
            best.offer(_validation(30, {}), 0.7)
    resumed = BestCheckpoint(run, str(model_dir), best_within=None)
    resumed.load_state_dict(state)
    assert torch.equal(load_file(run / "best" / "model.safetensors")["a.weight"], torch.full((2, 3), 10.0))
    assert json.loads((run / "best.json").read_text())["version"] == 10
    assert sorted(p.name for p in run.iterdir()) == ["best", "best.json"]


def test_a_kill_inside_save_weights_resumes_with_the_previous_best(tmp_path, model_dir, monkeypatch):
    """Killed between `best/` → `best.old` and `best.tmp` → `best/`: no best/ is left; the resume
    takes the checkpoint's best back from best.old and leaves no stray directory."""
    from pathlib import Path

    from safetensors.torch import load_file

    run = tmp_path / "run"
    best = BestCheckpoint(run, str(model_dir), best_within=None)
    best.offer(_validation(10, {}, _weights(10.0)), 0.5)
    state = best.state_dict()  # not `saved`: θ_10 is replaced in place, not set aside
    rename = Path.rename

    def rename_or_kill(self, target):
        if self.name == "best.tmp":
            raise _Killed
        return rename(self, target)

    with monkeypatch.context() as m:
        m.setattr(Path, "rename", rename_or_kill)
        with pytest.raises(_Killed):
            best.offer(_validation(30, {}, _weights(30.0)), 0.7)
    assert not (run / "best").exists() and (run / "best.old").is_dir()
    resumed = BestCheckpoint(run, str(model_dir), best_within=None)
    resumed.load_state_dict(state)
    assert torch.equal(load_file(run / "best" / "model.safetensors")["a.weight"], torch.full((2, 3), 10.0))
    assert sorted(p.name for p in run.iterdir()) == ["best", "best.json"]
