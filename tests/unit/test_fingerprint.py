"""pace/weights/fingerprint.py: the exact fingerprint of a tensor, the judgement of an engine's report after
a sync, and both sides' taking of them (the trainer's `CastSource`, the engine's checked reload).
The run-level proof (a bf16 engine one version behind stops the run; a correct one is silent) is
tests/integration/test_stale_engine.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pace.weights import fingerprint as fp
from tests.helpers import FULL, _Engine, _Toy, _update

pytestmark = pytest.mark.unit


def _reference(t: torch.Tensor) -> int:
    """The definition in numpy int64 (exact: |terms| < 2^30, fewer than 2^33 of them): Σ_i int16_i · ((i·A mod P) + 1)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.int16).numpy().astype(np.int64)
    i = np.arange(raw.size, dtype=np.int64)
    return int((raw * ((i * fp.A) % fp.P + 1)).sum())


def test_the_fingerprint_is_the_definition_exactly_across_chunks():
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(fp.CHUNK + 1000, generator=gen).to(torch.bfloat16)  # two chunks
    assert fp.tensor_fingerprint(big) == _reference(big)
    small = torch.randn(3, 5, generator=gen)  # float32: two int16 halves per element
    assert fp.tensor_fingerprint(small) == _reference(small)
    assert fp.tensor_fingerprint(torch.empty(0, dtype=torch.bfloat16)) == 0
    assert fp.tensor_fingerprint(torch.tensor([1, 2, 3], dtype=torch.uint8)) == 1 * 1 + 2 * (fp.A % fp.P + 1) + 3 * (2 * fp.A % fp.P + 1)


def test_one_bf16_ulp_anywhere_a_transpose_or_a_shift_changes_it_and_the_layout_does_not():
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(64, 48, generator=gen) * 0.02).to(torch.bfloat16)
    base = fp.tensor_fingerprint(w)
    assert fp.tensor_fingerprint(w.t().contiguous().t()) == base  # same values, another memory layout
    for index in [(0, 0), (17, 33), (63, 47)]:
        moved = w.clone()
        moved.view(torch.int16)[index] += 1  # the next bf16 value away from zero: one ulp
        assert moved[index] != w[index]
        assert fp.tensor_fingerprint(moved) != base, index
    assert fp.tensor_fingerprint(w.t()) != base
    assert fp.tensor_fingerprint(torch.roll(w, 1)) != base
    big = torch.zeros(fp.CHUNK + 10, dtype=torch.bfloat16)
    big[fp.CHUNK + 5] = 1.0  # in the second chunk
    assert fp.tensor_fingerprint(big) != 0


def test_a_pass_reads_its_fingerprints_once_at_its_end_not_one_tensor_at_a_time():
    """Each tensor's sum stays on its device (a meta tensor has no values to read: adding it would
    fail if `add` read one); `prints` reads them all, and equals the integers one by one."""
    lazy = fp.Fingerprints()
    lazy.add("a", torch.ones(5, dtype=torch.bfloat16, device="meta"))
    lazy.add("b", torch.ones(fp.CHUNK + 3, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(NotImplementedError):
        lazy.prints  # noqa: B018 - the one read
    gen = torch.Generator().manual_seed(2)
    tensors = {"a": torch.randn(7, 3, generator=gen).to(torch.bfloat16), "b": torch.randn(fp.CHUNK + 9, generator=gen),
               "c": torch.empty(0, dtype=torch.bfloat16)}
    prints = fp.Fingerprints()
    for name, t in tensors.items():
        prints.add(name, t)
    prints.add("a", tensors["a"])  # received twice: not the whole tensor's
    expected = {name: _reference(t) for name, t in tensors.items()}
    expected["a"] = 2 * expected["a"] + 1
    assert prints.prints == expected and list(prints.prints) == ["a", "b", "c"]


def test_an_exchange_is_seen_unless_the_positions_are_a_multiple_of_p_apart():
    """The documented limit: the position weights repeat every P elements, so two elements
    exchanged between positions k·P apart leave it unchanged; at any other distance it changes."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(3 * fp.P + 10, generator=gen).to(torch.bfloat16)
    base = fp.tensor_fingerprint(w)

    def swapped(i, j):
        out = w.clone()
        out[i], out[j] = w[j], w[i]
        assert not torch.equal(out, w)
        return fp.tensor_fingerprint(out)

    assert swapped(5, 5 + fp.P) == base and swapped(7, 7 + 2 * fp.P) == base
    assert all(swapped(5, 5 + d) != base for d in (1, fp.P - 1, fp.P + 1, 2 * fp.P + 3))


def _prints(scale: float) -> dict[str, int]:
    return {"a.weight": int(100 * scale), "b.weight": int(200 * scale), "c.bias": 7}


SENT = {3: _prints(1), 4: _prints(2), 5: _prints(3)}


def _sent(versions=SENT) -> fp.SentWeights:
    sent = fp.SentWeights()
    for v, prints in versions.items():
        sent.expect(v, prints)
    return sent


def test_a_worker_with_the_sent_weights_passes_and_every_worker_is_judged():
    sent = _sent()
    assert sent.judge(5, [_prints(3), _prints(3)]) is None
    failure = sent.judge(5, [_prints(3), _prints(2)])
    assert isinstance(failure, fp.StaleEngine) and str(failure).startswith("rollout engine worker 1 ")
    assert isinstance(failure, fp.SyncMismatch) and failure.why == "engine weights are not the trainer's"


def test_an_engine_a_version_behind_is_named_with_how_far():
    assert str(_sent().judge(5, [_prints(2)])) == (
        "rollout engine worker 0 is labelled θ_5 but received other weights: 2 of 3 tensors differ from the trainer's "
        "(first: a.weight); they are θ_4's: the engine is 1 version behind (weight fingerprints after the sync "
        "of θ_5; trainer.sync_fingerprint)")
    assert "they are θ_3's: the engine is 2 versions behind" in str(_sent().judge(5, [_prints(1)]))


def test_no_update_a_problem_the_worker_found_and_missing_or_extra_tensors_are_each_named():
    sent = _sent()
    assert "is labelled θ_5 but has received no weights since it started: the label moved without a sync" in str(
        sent.judge(5, [None]))
    assert "is labelled θ_5 but loaded its updates into a X" in str(sent.judge(5, ["loaded its updates into a X"]))
    partial = {k: v for k, v in _prints(3).items() if k != "b.weight"} | {"z.weight": 1}
    text = str(sent.judge(5, [partial]))
    assert "1 were not received (first: b.weight); 1 were received that it did not send (first: z.weight)" in text
    assert "differ" not in text and "behind" not in text
    assert "no rollout engine reported" in str(sent.judge(5, []))


def test_only_the_last_versions_are_kept_and_only_sent_versions_are_judged():
    sent = fp.SentWeights(keep=2)
    for v in range(5):
        sent.expect(v, _prints(v + 1))
    assert [sent.expects(v) for v in range(6)] == [False, False, False, True, True, False]
    assert "behind" not in str(sent.judge(4, [_prints(1)]))  # θ_0's were dropped: not named
    assert "θ_3's: the engine is 1 version behind" in str(sent.judge(4, [_prints(4)]))


def test_the_trainer_side_fingerprints_what_it_yields_before_the_last_tensor_leaves():
    from pace.weights.transfer import CastSource

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    got = []
    src = CastSource(model, torch.bfloat16, on_sent=got.append)
    it = iter(src)
    pairs = [next(it) for _ in range(4)]  # the consumer never resumes the generator after the last
    assert len(got) == 1
    assert got[0] == {name: fp.tensor_fingerprint(t) for name, t in pairs}
    assert got[0]["0.weight"] == fp.tensor_fingerprint(model[0].weight.detach().to(torch.bfloat16))
    assert list(CastSource(model, torch.bfloat16)) and len(got) == 1  # without on_sent: nothing taken


def test_the_checked_engine_fingerprints_what_its_loader_received_once_asked():
    from pace.weights import reload

    engine = reload.checked(_Engine)(_Toy())
    _update(engine.model, FULL, engine)
    assert engine.fingerprint is None  # not asked
    engine.fingerprinting = True
    _update(engine.model, FULL, engine)
    assert engine.fingerprint == {name: fp.tensor_fingerprint(t) for name, t in FULL.items()}
    first = engine.fingerprint
    moved = _Listed(FULL, **{"mid.bias": FULL["mid.bias"] + 1})
    _update(engine.model, moved, engine)  # the loader given a list, as nccl's and ipc's engines give it
    assert engine.fingerprint != first and engine.fingerprint["mid.bias"] == fp.tensor_fingerprint(moved["mid.bias"])
    assert torch.equal(engine.model.mid.bias, moved["mid.bias"])  # and the list still loaded


def _first_use(monkeypatch) -> list:
    """Whether a device's position weights existed each time a tensor was fingerprinted (none made yet)."""
    seen, real = [], fp.device_fingerprint
    monkeypatch.setattr(fp, "_weights", {})

    def spy(t):
        seen.append(t.device in fp._weights)
        return real(t)

    monkeypatch.setattr(fp, "device_fingerprint", spy)
    return seen


def test_the_position_weights_are_made_up_front_not_inside_a_transfer(monkeypatch):
    """Both sides make them before the first tensor passes: the trainer's `CastSource` when it is
    built, the engine's checked reload when the update starts. On nccl the tensors pass inside vLLM's
    side-stream context, where weights made then would be written on one side stream and read on
    another (pace/weights/fingerprint.py `_position_weights`). Before: made at the first tensor."""
    from pace.weights import reload
    from pace.weights.transfer import CastSource

    seen = _first_use(monkeypatch)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    src = CastSource(model, torch.bfloat16, on_sent=lambda prints: None)
    assert list(fp._weights) == [torch.device("cpu")]  # at construction, before any pass
    list(src)
    assert seen == [True] * 4

    seen = _first_use(monkeypatch)
    engine = reload.checked(_Engine)(_Toy())
    engine.device, engine.fingerprinting = torch.device("cpu"), True  # vLLM's engines have the worker's device
    _update(engine.model, FULL, engine)
    assert seen == [True] * len(FULL) and engine.fingerprint == {n: fp.tensor_fingerprint(t) for n, t in FULL.items()}


def test_the_position_weights_are_made_once_a_device_on_its_default_stream(monkeypatch):
    """Wherever they are first asked for, they are made through `streams.on_default_stream` (on a GPU:
    on the default stream, finished before use; tests/unit/test_weight_streams.py), once a device."""
    from pace.weights import streams

    made, real = [], streams.on_default_stream
    monkeypatch.setattr(fp, "_weights", {})
    monkeypatch.setattr(fp, "on_default_stream", lambda device, make: made.append(device) or real(device, make),
                        raising=False)
    assert fp.tensor_fingerprint(torch.ones(3, dtype=torch.bfloat16)) == _reference(torch.ones(3, dtype=torch.bfloat16))
    fp.tensor_fingerprint(torch.ones(5))
    fp.prepare("cpu")
    assert made == [torch.device("cpu")]


class _Listed(dict):
    def items(self):
        return list(super().items())


def test_a_worker_reports_its_fingerprints_only_when_asked_and_only_for_the_model_it_serves():
    from types import SimpleNamespace

    from pace.weights import reload
    from pace.weights.transfer import WorkerExtension

    engine = reload.checked(_Engine)(_Toy())
    worker = SimpleNamespace(weight_transfer_engine=engine, model_runner=SimpleNamespace(get_model=lambda: engine.model))
    assert WorkerExtension.pace_weight_fingerprint(worker).startswith("does not fingerprint its updates")
    WorkerExtension.pace_fingerprint_updates(worker)
    assert WorkerExtension.pace_weight_fingerprint(worker) is None  # asked, no update yet
    _update(engine.model, FULL, engine)
    assert WorkerExtension.pace_weight_fingerprint(worker) == {n: fp.tensor_fingerprint(t) for n, t in FULL.items()}
    worker.model_runner = SimpleNamespace(get_model=lambda: torch.nn.Linear(1, 1))  # it serves another model
    assert WorkerExtension.pace_weight_fingerprint(worker) == (
        "loaded its updates into a _Toy that is not the model it serves (Linear)")


class _Rollout:
    """Rank 0's rollout for a real `WeightSync` on the gloo backend with no engine workers (a group
    of one): the calls run here (no thread), the broadcast goes nowhere, the judge's store is real."""

    ident = None

    def __init__(self):
        from types import SimpleNamespace

        self.sent_weights = fp.SentWeights()
        # a fleet of no engines (`rollout.engines=0`): nothing to load, nothing to fail
        self.fleet = SimpleNamespace(load=lambda info: None, transfer_workers=lambda: 0, alive=[], regroup_due=lambda admit: False, group_members=lambda: [],
                                     wait_failed=lambda known: [])
        self.loaded: list[int] = []

    def init_weight_transfer_engine(self, info):
        pass

    def begin_update(self):
        pass

    def end_update(self, version):
        self.loaded.append(version)


def test_only_the_sending_pass_is_fingerprinted_not_a_checkpoint_s_between_syncs():
    """`rollout.sync_every=2`: θ_1 is checkpointed (`weights`) before any sync, θ_2 synced, θ_3
    checkpointed again. The sent fingerprints are θ_2's alone: a checkpoint's pass over the source
    neither records a version (None before the first sync) nor overwrites the last synced one."""
    from types import SimpleNamespace

    from pace.config import Config
    from pace.placement import Placement
    from pace.weights.sync import WeightSync

    cfg = Config()
    cfg.model.dtype, cfg.rollout.weight_transfer, cfg.rollout.engines = "bfloat16", "gloo", 0
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    rollout = _Rollout()
    trainer = SimpleNamespace(model=model, acc=SimpleNamespace(process_index=0, is_main_process=True))
    sync = WeightSync(cfg, trainer, rollout, Placement.of(cfg.rollout, "cpu", 1))
    try:
        def step():
            with torch.no_grad():
                model[0].weight.add_(0.25)

        def prints():
            return {n: fp.tensor_fingerprint(p.detach().to(torch.bfloat16)) for n, p in model.named_parameters()}

        step()
        assert len(sync.weights(1)) == 4  # a checkpoint at a step with no sync due
        step()
        sync.prepare(2)
        sync.weights(2)  # the step's checkpoint, before the sync
        synced = prints()
        sync.publish(2)
        step()
        sync.weights(3)  # a checkpoint between syncs: newer weights
        assert rollout.loaded == [2] and rollout.sent_weights.expects(2)
        assert [v for v in range(4) if rollout.sent_weights.expects(v)] == [2]
        assert rollout.sent_weights.judge(2, [synced]) is None  # θ_2's, not θ_3's
    finally:
        sync.close()
    with pytest.raises(ValueError, match="version None"):
        fp.SentWeights().expect(None, {"a": 1})
