"""The one fleet interface (pace/rollout/fleet.py `Fleet`): both fleets implement all of it, the weight
update runs as one sequence for both (`update`, `end_update`), and what only servers have defaults to
harmless values for the engines in this host. Stand-in engines (no vLLM engine): the calls are recorded."""
from __future__ import annotations

import inspect
import queue
from types import SimpleNamespace

import pytest

from pace.rollout.fleet import EngineFleet, Fleet

pytestmark = pytest.mark.unit


class _LLM:
    """A stand-in out-of-process engine (`LLM`) of ``tp`` workers: its calls go to ``log``; each
    worker's reload check reports ``failure`` (None: complete)."""

    def __init__(self, index: int, log: list, tp: int = 1, failure: str | None = None, load_error: bool = False):
        self.index, self.log, self.tp, self.failure, self.load_error = index, log, tp, failure, load_error
        core = SimpleNamespace(outputs_queue=queue.Queue(),  # a child engine's client
                               call_utility=lambda name, *args: log.append((index, name)) or True)
        self.llm_engine = SimpleNamespace(
            engine_core=core, set_weight_version=lambda v: log.append((index, f"label {v}")),
            vllm_config=SimpleNamespace(device_config=SimpleNamespace(device_type="cpu"),
                                        parallel_config=SimpleNamespace(world_size=tp)))

    def collective_rpc(self, method, kwargs=None):
        self.log.append((self.index, method))
        if method == "update_weights" and self.load_error:
            raise RuntimeError(f"engine {self.index}: the load broke")
        if method == "pace_weight_update_failure":
            return [self.failure] * self.tp
        return [None] * self.tp


def _calls(log: list, index: int = 0) -> list[str]:
    return [name for i, name in log if i == index]


def test_both_fleets_implement_the_whole_interface():
    from pace.rollout.remote import RemoteFleet

    for fleet in (EngineFleet, RemoteFleet):
        assert issubclass(fleet, Fleet) and not inspect.isabstract(fleet), fleet.__name__
    assert "update" not in vars(RemoteFleet) and "end_update" not in vars(EngineFleet)  # the template is the base's


def test_an_update_pauses_loads_checks_labels_and_resumes_every_engine_in_that_order():
    log = []
    fleet = EngineFleet([_LLM(0, log), _LLM(1, log)])
    seconds = fleet.update(7, {"names": ["w"]})
    assert seconds >= 0 and fleet.version == 7
    for e in (0, 1):
        assert _calls(log, e) == ["pause_scheduler", "start_weight_update", "update_weights", "finish_weight_update",
                                  "pace_weight_update_failure", "label 7", "resume_scheduler"]


def test_with_recompute_an_update_drops_the_kv_of_the_running_requests_after_the_load():
    """rollout.kv_on_update=recompute: after the load, before the resume, each engine preempts its running
    requests (vLLM `reset_prefix_cache(reset_running_requests=True)`): they are prefilled again under
    the new weights when it resumes (an in-process engine may step between an update's calls, so not
    before the load). keep (the default): not called."""
    log = []
    fleet = EngineFleet([_LLM(0, log), _LLM(1, log)])
    fleet.reprefill_on_update = True
    fleet.update(2, {})
    for e in (0, 1):
        assert _calls(log, e)[:5] == ["pause_scheduler", "start_weight_update", "update_weights", "finish_weight_update",
                                      "reset_prefix_cache"]
    log.clear()
    fleet.reprefill_on_update = False
    fleet.update(3, {})
    assert "reset_prefix_cache" not in _calls(log)


def test_a_load_that_fails_resumes_the_engines_and_leaves_the_label():
    log = []
    fleet = EngineFleet([_LLM(0, log, load_error=True)])
    fleet.set_version(3)
    with pytest.raises(RuntimeError, match="engine 0: the load broke"):
        fleet.update(4, {})
    assert _calls(log) == ["label 3", "pause_scheduler", "start_weight_update", "update_weights", "resume_scheduler"]
    assert fleet.version == 3


def test_an_incomplete_update_fails_once_naming_the_first_worker_and_the_count():
    from pace.weights.reload import IncompleteWeightUpdate

    log = []
    fleet = EngineFleet([_LLM(0, log, tp=2, failure="layer 3 got no weights"), _LLM(1, log)])
    fleet.set_version(3)
    with pytest.raises(IncompleteWeightUpdate, match=r"^layer 3 got no weights \(and 1 more workers\)$"):
        fleet.update(4, {})
    assert fleet.version == 3 and "label 4" not in _calls(log)  # the label stays θ_3's
    assert _calls(log)[-1] == _calls(log, 1)[-1] == "resume_scheduler"  # resumed all the same


def test_patches_a_worker_does_not_trust_load_are_labelled_and_kept_for_the_weight_sync():
    """pace/weights/inplace.py: patches that loaded but wrote into no parameter (or one the whole
    update did not load) are no failure — the engines hold θ_v's patches as far as they went and are
    labelled v — but the trainer's next sync must be whole: the first worker's line, and how many more."""
    log = []
    why = "weight patches θ_3 → θ_4: 1 of 9 tensors sent were written into no parameter (scale)"
    fleet = EngineFleet([_LLM(0, log, tp=2, failure={"untrusted": why}), _LLM(1, log)])
    fleet.set_version(3)
    fleet.update(4, {})
    assert fleet.version == 4 and _calls(log)[-1] == "resume_scheduler"
    assert fleet.take_untrusted() == why + " (and 1 more workers)" and fleet.take_untrusted() is None  # taken once


def test_engines_in_this_host_have_the_servers_defaults():
    fleet = EngineFleet([_LLM(0, []), _LLM(1, [], tp=2)])
    assert fleet.alive == [0, 1] and fleet.transfer_workers() == 3  # engines × their TP workers
    assert fleet.take_failures() == [] and fleet.wait_failed({0, 1}, timeout=0.0) == []
    assert fleet.needs_regroup is False and fleet.sync_seconds() == {} and not fleet.in_process
