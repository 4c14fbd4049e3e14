"""Tests for pace/sim/sync.py: a weight sync's seconds from its bytes (full vs delta, the periodic
full sync, the break-even threshold, the constant of a scenario without the bytes model), the
engines' pause scaled with it, the same numbers through the simulation's step times, and the paper
scenarios' full syncs equal to the constants they replaced."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from pace.config import register as register_run
from pace.errors import ConfigError
from pace.sim.config import SimRunConfig, register, validate_sim
from pace.sim.run import Simulation
from pace.sim.sync import SyncModel, break_even

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]

# 1e9 parameters; full in bf16 = 2e9 B, at 4 GB/s = 0.5 s + 0.25 s fixed = 0.75 s; the engines pause 0.3 s then
BYTES = ("sim.sync.params=1e9", "sim.sync.gb_per_s=4", "sim.sync.fixed_s=0.25", "sim.sync.changed_frac=0.01",
         "sim.engine.stall_s=0.3", "model.dtype=bfloat16")


def cfg(*overrides: str):
    c = OmegaConf.merge(OmegaConf.structured(SimRunConfig), OmegaConf.from_dotlist(list(overrides)))
    validate_sim(c)
    return c


def test_full_and_delta_bytes_and_seconds_by_hand():
    m = SyncModel(cfg(*BYTES, "rollout.weight_delta=true"))
    first = m.sync(1)  # the run's first sync is full: every parameter, 2 bytes each
    assert first.full and first.bytes == 2e9 and first.seconds == pytest.approx(0.75) and first.pause_s == pytest.approx(0.3)
    d = m.sync(2)  # 1% of 1e9 elements × (4 B index + 2 B value) = 6e7 B
    assert not d.full and d.bytes == pytest.approx(6e7) and d.changed_frac == pytest.approx(0.01)
    assert d.seconds == pytest.approx(0.25 + 6e7 / 4e9)
    assert d.pause_s == pytest.approx(0.3 * (0.25 + 0.015) / 0.75)  # the engines' pause scales as the trainer's side
    # three versions since the engines' weights (rollout.sync_every=3): 1 − 0.99³ of the elements
    assert m.sync(5).bytes == pytest.approx((1 - 0.99 ** 3) * 1e9 * 6)
    # fp32: 8 bytes per changed element (index + value) against 4 per element in a full sync
    f = SyncModel(cfg(*BYTES, "rollout.weight_delta=true", "model.dtype=float32"))
    assert f.sync(1).bytes == 4e9 and f.sync(2).bytes == pytest.approx(8e7)


def test_without_weight_delta_every_sync_is_full():
    m = SyncModel(cfg(*BYTES))
    assert all(s.full and s.bytes == 2e9 and s.seconds == pytest.approx(0.75) for s in map(m.sync, range(1, 6)))


def test_a_full_sync_every_n_versions_since_the_last_full_one():
    m = SyncModel(cfg(*BYTES, "rollout.weight_delta=true", "rollout.full_sync_every=3"))
    assert [m.sync(v).full for v in range(1, 9)] == [True, False, False, True, False, False, True, False]
    never = SyncModel(cfg(*BYTES, "rollout.weight_delta=true", "rollout.full_sync_every=0"))  # only the first
    assert [never.sync(v).full for v in range(1, 400, 7)] == [True] + [False] * 56


def test_a_full_sync_when_the_changed_fraction_passes_the_threshold():
    assert break_even("bfloat16") == pytest.approx(1 / 3) and break_even("float32") == pytest.approx(1 / 2)
    many = (*BYTES, "rollout.weight_delta=true", "sim.sync.changed_frac=0.2", "rollout.full_sync_every=0")
    m = SyncModel(cfg(*many))  # bf16, null threshold: break-even at 1/3
    m.sync(1)
    assert not m.sync(2).full  # 0.2 changed: 1.2 B per element < 2
    s = m.sync(4)  # two versions: 1 − 0.8² = 0.36 > 1/3, a delta would be larger than the full sync
    assert s.full and s.bytes == 2e9 and s.changed_frac == pytest.approx(0.36)
    f = SyncModel(cfg(*many, "model.dtype=float32"))  # fp32 breaks even at 1/2: 0.36 stays a delta
    f.sync(1)
    f.sync(2)
    assert not f.sync(4).full
    t = SyncModel(cfg(*many, "rollout.delta_max_frac=0.1"))  # an explicit threshold below 0.2
    assert [t.sync(v).full for v in (1, 2, 3)] == [True, True, True]


def test_without_the_bytes_model_the_constants_stay():
    c = cfg("sim.trainer.sync_s=0.7", "sim.engine.stall_s=0.2", "rollout.weight_delta=true")
    with pytest.warns(UserWarning, match="sim.sync.params is null"):
        m = SyncModel(c)
    for v in (1, 2, 3):
        s = m.sync(v)
        assert (s.seconds, s.pause_s, s.full, s.bytes) == (0.7, 0.2, True, None)


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="sim.trainer.sync_s=0.5 and sim.sync.params"):
        cfg(*BYTES, "sim.trainer.sync_s=0.5")
    with pytest.raises(ConfigError, match="sim.sync"):
        cfg(*BYTES, "sim.sync.gb_per_s=0")


# test_sim.py's deterministic model (one engine, 1/16 s a decode step, 8-token responses: a wave of
# generation is 0.5 s; training 0.875 s; B = G = 4), with the sync from bytes: 1e9 fp32 parameters
# = 4e9 B at 64 GB/s + 0.0625 s = 0.125 s full; 12.5% changed = 1e9 B = 0.078125 s a delta.
DET = ("data.batch_prompts=4", "data.group_size=4", "sim.responses.fixed_correct=2",
       "sim.responses.levels=[{len_median: 8}]", "sim.engine.step_s=0.0625", "sim.trainer.step_s=0.875",
       "rollout.max_tokens=16", "rollout.overlong_buffer=4", "pool.capacity=null", "trainer.steps=10", "pool.name=sync",
       "sim.engine.stall_s=0.25")
DET_BYTES = ("sim.sync.params=1e9", "sim.sync.gb_per_s=64", "sim.sync.fixed_s=0.0625", "sim.sync.changed_frac=0.125")


def test_the_simulation_pays_each_sync_and_pause_from_its_bytes():
    """Sync pool: step j waits for the engines' pause at θ_j's load (none before the first), one
    wave (0.5), trains (0.875), then syncs θ_{j+1}: full at versions 1, 5, 9 (every 4), else a delta
    of 0.078125 s whose pause is 0.25 × 0.078125 / 0.125 = 0.15625 s."""
    sim = Simulation(cfg(*DET, *DET_BYTES, "rollout.weight_delta=true", "rollout.full_sync_every=4"))
    sim.run()
    full = [v in (1, 5, 9) for v in range(1, 11)]
    sync = [0.125 if f else 0.078125 for f in full]
    pause = [0.0] + [0.25 if f else 0.15625 for f in full[:-1]]
    assert [r["sync/full"] for r in sim.rows] == [int(f) for f in full]
    assert [r["time/sync"] for r in sim.rows] == pytest.approx(sync)
    assert [r["sync/pause_s"] for r in sim.rows] == pytest.approx([0.25 if f else 0.15625 for f in full])
    assert [r["time/step"] for r in sim.rows] == pytest.approx([p + 0.5 + 0.875 + s for p, s in zip(pause, sync)])
    # without weight_delta the bytes model's full sync is the constant it replaces, step for step
    off = Simulation(cfg(*DET, *DET_BYTES))
    off.run()
    const = Simulation(cfg(*DET, "sim.trainer.sync_s=0.125"))
    const.run()
    assert [r["time/step"] for r in off.rows] == [r["time/step"] for r in const.rows]
    assert off.now == const.now


PAPER_FULL_S = {"qwen3_8b": 3.0, "qwen3_8b_h100": 3.0, "qwen3_4b": 1.5, "qwen3_30b_a3b": 11.2}


def composed(*overrides: str):
    register_run()
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        c = compose("simulate", overrides=list(overrides))
    validate_sim(c)
    return c


@pytest.mark.parametrize("scenario", sorted(PAPER_FULL_S))
def test_paper_scenarios_full_sync_is_the_constant_it_replaced(scenario):
    c = composed(f"+exp=async_{scenario}", f"+sim={scenario}", "rollout.weight_delta=true")
    m = SyncModel(c)
    full, delta = m.sync(1), m.sync(2)
    assert full.full and full.seconds == pytest.approx(PAPER_FULL_S[scenario], rel=1e-3)
    assert full.pause_s == c.sim.engine.stall_s and delta.seconds < 0.3 * full.seconds


def test_the_fitted_cpu_scenario_keeps_its_constant_sync():
    c = composed("+exp=async_tiny", "+sim=tiny_cpu", "rollout.weight_delta=true")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        s = SyncModel(c).sync(2)
    assert (s.seconds, s.pause_s, s.bytes) == (c.sim.trainer.sync_s, c.sim.engine.stall_s, None)
