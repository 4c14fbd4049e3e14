"""The Checkpointer as train.py builds it, with stand-ins for the trainer and rank 0's parts: what
it is given at construction (weights, barrier, on_saved) is what a save uses, and a stop's or a
failure's checkpoint treats the groups in flight and the failed batch as documented."""
from __future__ import annotations

import json
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from pace.checkpoint import STATE_FILE, Checkpointer, RunParts

pytestmark = pytest.mark.unit


class Trainer:
    def __init__(self, version=3, mid_step=False):
        self.version, self.mid_step = version, mid_step

    def save(self, path):  # Accelerate's save_state makes the directory
        path.mkdir(parents=True)
        (path / "trainer.bin").write_bytes(b"state")

    def state_dict(self):
        return {"version": self.version, "nonfinite_skipped": 0}


class Recorder:
    """Every call of any method, by name (with its arguments); returns `returns.get(name)`."""

    def __init__(self, **returns):
        self.calls, self.returns = [], returns

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return self.returns.get(name)
        return call


def parts(resume_inflight=True, stopped=True, dropped=()):
    rollout = Recorder(stop=stopped, state_dict={"inflight": []})
    rollout.paused = nullcontext
    rollout.cfg = SimpleNamespace(rollout=SimpleNamespace(resume_inflight=resume_inflight))
    pool = Recorder(drop_inflight=list(dropped), drain_decided=[], state_dict={})
    return RunParts(pool=pool, sampler=Recorder(state_dict={}), rollout=rollout, grader=Recorder(state_dict={}),
                    logger=Recorder(state_dict={}))


def accelerator(processes=1):
    return SimpleNamespace(is_main_process=True, num_processes=processes,
                           wait_for_everyone=lambda: pytest.fail("the given barrier is used, not Accelerate's"))


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "qwen3"}')
    return str(d)


def test_a_save_uses_the_weights_barrier_and_listener_it_was_built_with(tmp_path, model_dir):
    barriers, heard, asked = [], [], []

    def weights(version):
        asked.append(version)
        return [("w", torch.full((2,), float(version)))]

    ck = Checkpointer(tmp_path / "run", accelerator(), Trainer(version=3), {"seed": 0}, keep=2, model_path=model_dir,
                      weights=weights, barrier=lambda: barriers.append(1), on_saved=heard.append)
    path = ck.save("test", parts())
    assert path.name == "step-000003" and (path / STATE_FILE).exists() and ck.last == path
    assert asked == [3] and heard == [3] and len(barriers) == 3
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(path / "model" / "model.safetensors"))["w"], torch.full((2,), 3.0))
    assert json.loads((path / "meta.json").read_text())["reason"] == "test"


def test_without_weights_a_checkpoint_has_no_model_directory(tmp_path, model_dir):
    ck = Checkpointer(tmp_path / "run", accelerator(), Trainer(), {}, keep=2, model_path=model_dir, barrier=lambda: None)
    assert not (ck.save("test", parts()) / "model").exists()


@pytest.mark.parametrize("resume_inflight, stopped, drops", [(True, True, False), (False, True, True), (True, False, True)])
def test_a_stop_keeps_the_groups_in_flight_only_when_the_rollout_stopped_and_resume_inflight(
        tmp_path, resume_inflight, stopped, drops):
    p = parts(resume_inflight, stopped, dropped=[SimpleNamespace(prompt_id="p7")])
    ck = Checkpointer(tmp_path / "run", accelerator(), Trainer(version=5), {}, keep=2, barrier=lambda: None)
    assert ck.stop_and_save(p, "SIGTERM").name == "step-000005"
    drop_calls = [c for c in p.pool.calls if c[0] == "drop_inflight"]
    assert bool(drop_calls) == drops
    if drops:
        assert drop_calls[0][1] == (5,) and drop_calls[0][2] == {"reason": "stopped: SIGTERM"}
        assert ("give_back", (["p7"],), {}) in p.sampler.calls
    assert ("log_groups", ([],), {"step": -1}) in p.logger.calls


def test_after_a_failure_the_failed_batch_goes_back_and_a_checkpoint_is_written(tmp_path):
    p = parts()
    batch = SimpleNamespace(groups=[SimpleNamespace(prompt_id="a"), SimpleNamespace(prompt_id="b")])
    ck = Checkpointer(tmp_path / "run", accelerator(), Trainer(version=2), {}, keep=2, barrier=lambda: None)
    assert ck.save_after_failure(p, batch, ValueError("boom")).name == "step-000002"
    assert ("abandon", (batch,), {"reason": "training step failed: ValueError"}) in p.pool.calls
    assert ("give_back", (["a", "b"],), {}) in p.sampler.calls
    assert json.loads((ck.last / "meta.json").read_text())["reason"] == "failure: ValueError"


@pytest.mark.parametrize("processes, mid_step", [(2, False), (1, True)])
def test_no_checkpoint_after_a_failure_with_several_processes_or_between_two_versions(tmp_path, processes, mid_step):
    p = parts()
    ck = Checkpointer(tmp_path / "run", accelerator(processes), Trainer(mid_step=mid_step), {}, keep=2,
                      barrier=lambda: None)
    assert ck.save_after_failure(p, None, ValueError("boom")) is None
    assert p.pool.calls == [] and not (tmp_path / "run" / "checkpoints").exists()
