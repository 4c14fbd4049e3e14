"""`+rehearsal=cpu` (pace/rehearsal/overlay.py): every paper preset composes with it into a config
that validates on a CPU, whose swaps are only what a CPU cannot have, and everything else stays the
preset's; the timeouts are scaled by the one factor; a resumed (already applied) config is not
swapped twice."""
from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from pace.config_checks import validate
from pace.rehearsal import overlay
from tests.helpers import PAPER_PRESETS, compose_cfg

pytestmark = pytest.mark.unit

# what a rehearsal may change: the keys a CPU, the tiny model or time dictate (docs/rehearsal.md)
ALLOWED = {"device", "model.path", "model.tiny", "model.tiny.experts", "model.dtype", "rollout.max_tokens",
           "rollout.overlong_buffer", "rollout.max_model_len", "eval.max_tokens", "data.source", "data.path",
           "data.template", "data.chat_template", "data.enable_thinking", "data.max_prompt_tokens",
           "eval.benchmarks", "eval.figure_sets", "eval.data_dir", "rollout.weight_transfer", "rollout.engines",
           "rollout.tensor_parallel_size", "rollout.gpus", "rollout.enforce_eager", "rollout.servers",
           "algo.routing_replay", "trainer.steps",
           "reward.workers", "tools.warm",
           *overlay.SCALED}


def _rehearsed(preset: str, *more: str):
    cfg = compose_cfg([f"+exp={preset}", "+rehearsal=cpu", *more])
    swaps = overlay.apply(cfg, world=2, say=False)
    return cfg, swaps


def test_the_settings_are_paper_presets():
    assert set(overlay.SETTINGS) <= set(PAPER_PRESETS)


@pytest.mark.parametrize("preset", overlay.SETTINGS)
def test_every_paper_setting_rehearses_on_a_cpu_with_only_what_a_cpu_cannot_have_swapped(preset):
    original = compose_cfg([f"+exp={preset}"])
    cfg, swaps = _rehearsed(preset)
    validate(cfg)
    assert cfg.device == "cpu" and cfg.model.path is None and cfg.rehearsal.applied
    assert {s.key for s in swaps} <= ALLOWED, {s.key for s in swaps} - ALLOWED
    # the preset's control flow, untouched
    for key in ("model.gradient_checkpointing", "data.batch_prompts", "data.group_size", "rollout.engine_process", "rollout.stream_interval",
                "rollout.max_inflight_groups", "rollout.max_num_seqs", "rollout.max_tool_calls", "pool", "pace",
                "eval.every", "eval.val_k", "eval.k", "eval.best_within", "eval.top_p", "trainer.save_every",
                "trainer.mini_batches", "trainer.lr", "rollout.server_start_timeout_s", "rollout.max_engine_restarts",
                "tools.workers", "tools.sandbox", "tools.wall_s", "reward.timeout_s"):
        assert OmegaConf.select(cfg, key) == OmegaConf.select(original, key), key
    if original.rollout.weight_transfer == "nccl":
        assert cfg.rollout.weight_transfer == "gloo"
    assert cfg.rollout.engines == min(original.rollout.engines, 2)
    # a periodic checkpoint, validations on both sides of it and the final ones (by hand: 20 + 10 // 2)
    assert (original.trainer.save_every, original.eval.every, cfg.trainer.steps) == (20, 10, 25)


def test_the_healing_timeouts_are_scaled_by_the_one_factor():
    original = compose_cfg(["+exp=pace_qwen3_8b_h100"])
    cfg, _ = _rehearsed("pace_qwen3_8b_h100", "rehearsal.time_scale=0.1")
    assert cfg.rollout.engine_timeout_s == 12.0 and original.rollout.engine_timeout_s == 120.0
    assert cfg.rollout.update_timeout_s == 60.0 and original.rollout.update_timeout_s == 600.0
    assert cfg.rollout.drain_timeout_s == 30.0
    assert cfg.rollout.restart_backoff_s == 0.2
    assert cfg.rollout.server_start_timeout_s == original.rollout.server_start_timeout_s  # a CPU starts no faster


@pytest.mark.parametrize("preset, inflight", [("pace_qwen3_8b_h100", 24), ("pace_qwen3_30b_a3b", 88)])
def test_a_smaller_batch_keeps_the_presets_groups_in_flight_a_prompt(preset, inflight):
    """rehearsal.batch_prompts=8: 96 / 32 = 3 groups in flight a prompt → 24; 352 / 32 = 11 → 88 (by hand)."""
    cfg, swaps = _rehearsed(preset, "rehearsal.batch_prompts=8")
    assert (cfg.data.batch_prompts, cfg.rollout.max_inflight_groups) == (8, inflight)
    assert {"data.batch_prompts", "rollout.max_inflight_groups"} <= {s.key for s in swaps}
    validate(cfg)
    same, swaps = _rehearsed(preset)  # the default: the preset's batch
    assert same.data.batch_prompts == 32 and "data.batch_prompts" not in {s.key for s in swaps}


def test_the_moe_preset_gets_the_tiny_moe_and_no_routes():
    cfg, swaps = _rehearsed("pace_qwen3_30b_a3b")
    assert cfg.model.tiny.experts == overlay.MOE_EXPERTS
    assert cfg.algo.routing_replay is False  # vLLM's CPU build returns none
    # the reload checks stay the preset's (vLLM-CPU's MoE reload is exact with pace/weights/reload.py's repack)
    assert cfg.trainer.sync_mismatch_steps == 3 and cfg.rollout.reload_probe == "stop"
    assert {"trainer.sync_mismatch_steps", "rollout.reload_probe"}.isdisjoint(s.key for s in swaps)
    dense, _ = _rehearsed("pace_qwen3_8b")
    assert dense.model.tiny.experts == 0 and dense.trainer.sync_mismatch_steps == 3


def test_the_tool_preset_gets_the_tiny_tool_model_and_task():
    cfg, _ = _rehearsed("pace_qwen3_4b_retool")
    assert cfg.model.tiny.tool is not None and cfg.data.source == "tool_arithmetic"
    assert list(cfg.eval.benchmarks) == ["tool_arithmetic"]
    assert cfg.rollout.max_tool_calls == 8  # the preset's turns


def test_a_resumed_rehearsal_is_not_swapped_twice():
    cfg, swaps = _rehearsed("pace_qwen3_8b_h100")
    once = OmegaConf.to_container(cfg)
    assert swaps and overlay.apply(cfg, world=2, say=False) == []
    assert OmegaConf.to_container(cfg) == once  # the scaled timeouts not scaled again


def test_without_the_overlay_nothing_changes():
    cfg = compose_cfg(["+exp=pace_qwen3_8b"])
    before = OmegaConf.to_container(cfg)
    assert overlay.apply(cfg, world=2, say=False) == []
    assert OmegaConf.to_container(cfg) == before


def test_moe_models_are_told_apart(tmp_path):
    assert overlay.is_moe("Qwen/Qwen3-30B-A3B-Base") and overlay.is_moe("Qwen/Qwen3-235B-A22B")
    assert not overlay.is_moe("Qwen/Qwen3-8B-Base") and not overlay.is_moe(None)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 8}))
    assert overlay.is_moe(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert not overlay.is_moe(str(tmp_path))


def test_the_run_directory_records_the_config_that_ran(tmp_path):
    cfg, swaps = _rehearsed("pace_qwen3_8b_h100")
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("device: cuda\n")
    overlay.record(cfg, tmp_path, swaps)
    ran = OmegaConf.load(tmp_path / ".hydra" / "config.yaml")
    assert ran.device == "cpu" and ran.rehearsal.applied  # what eval.py and analysis read
    assert OmegaConf.load(tmp_path / ".hydra" / "config.preset.yaml").device == "cuda"
    listed = json.loads((tmp_path / "rehearsal.json").read_text())
    assert [s["key"] for s in listed["swaps"]] == [s.key for s in swaps]


@pytest.mark.parametrize("bf16", [True, False])
def test_the_dtype_stays_bf16_where_this_cpu_has_bf16_matmuls(bf16, monkeypatch):
    monkeypatch.setattr(overlay, "_bf16_matmuls", lambda: bf16)
    cfg, _ = _rehearsed("pace_qwen3_8b")
    assert cfg.model.dtype == ("bfloat16" if bf16 else "float32")
