"""Typed schema of the simulator: the run's own config (`pace.config.Config`) plus a `sim` node.

`simulate.py` composes the same groups as `train.py` (pool, algo, +exp presets), so a simulated
run reads `data.batch_prompts`, `data.group_size`, `rollout.{engines, max_num_seqs, max_tokens,
max_inflight_groups, sync_every, weight_delta, full_sync_every, delta_max_frac}`, `model.dtype`,
`pool.*`, `pace.*`, `trainer.steps`, `eval.every` under their real names; `sim` holds the models of
what a simulation does not run (engines, trainer, responses, prefix drift, the weight sync's
bytes). Scenarios (`conf/sim/*.yaml`, `+sim=<name>`) set them with sources.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from pace.config import Config
from pace.config_checks import validate
from pace.errors import ConfigError
from pace.sim.sync import DTYPE_BYTES


@dataclass
class SimEngineConfig:
    """One engine's decode step: step_s + per_seq_s · running + per_ctx_token_s · Σ context (seconds)."""

    step_s: float = 0.02
    per_seq_s: float = 0.0
    per_ctx_token_s: float = 0.0
    prefill_token_s: float = 0.0  # per prompt token prefilled
    kv_tokens: Optional[int] = None  # KV cache of one engine, in tokens (null: unbounded)
    stall_s: float = 0.0  # the engine is paused this long per weight update it loads
    train_slowdown: float = 1.0  # latency factor while the trainer trains (engines sharing its processors)


@dataclass
class SimTrainerConfig:
    """One training step: step_s + per_update_s · trainer.mini_batches + per_token_s · tokens
    (prompt + response tokens of the batch)."""

    step_s: float = 1.0
    per_update_s: float = 0.0  # one optimizer update (AdamW over the sharded parameters)
    per_token_s: float = 0.0
    sync_s: float = 0.0  # the trainer's side of a weight sync (gather + send), before the engines load
    # a step that starts while the engines generate takes this × longer (they share its processors:
    # the CPU lab's 2 cores, or rollout.placement=colocate)
    colocated_slowdown: float = 1.0
    val_s: float = 0.0  # an in-training validation (eval.every) holds the next weight load this long


@dataclass
class SimClientConfig:
    """Rank 0's rollout client: the CPU each generated token costs the trainer's process (vLLM's output
    processing, the rollout thread's record, the HTTP stream: scripts/bench_client_cost.py). A training
    step that starts while the engines decode R tokens/s takes × (1 + slowdown(busy)), busy = R ·
    us_per_token · 1e-6 (the share of one core the client holds the GIL), slowdown interpolated
    linearly in ``curve``'s measured [busy, slowdown] pairs (held at its ends)."""

    us_per_token: float = 0.0  # 0: not modelled
    curve: list = field(default_factory=lambda: [[0.0, 0.0]])


@dataclass
class SimLevel:
    """One difficulty level of the prompts (responses.py)."""

    weight: float = 1.0
    p_correct: float = 0.5
    concentration: Optional[float] = None  # Beta κ of a prompt's accuracy around p_correct; null: exactly p_correct
    len_median: float = 64.0
    len_sigma: float = 0.0  # log-sd of a response's length (0: every response len_median tokens)
    wrong_len_factor: float = 1.0


@dataclass
class SimResponsesConfig:
    prompt_tokens: int = 32
    levels: list[SimLevel] = field(default_factory=lambda: [SimLevel()])
    fixed_correct: Optional[int] = None  # exactly this many of the G responses correct (deterministic tests)
    empirical: Optional[str] = None  # a run directory (or Parquet glob): draw its logged groups instead
    grade_s: float = 0.0  # from a group's last token to the pool
    length_scale: float = 1.0  # every drawn length × this (levels' medians or empirical lengths), then capped


@dataclass
class SimPfsConfig:
    """Prefix drift: a response's PFS = scale · lag^power · exp(noise · ε) (responses.PfsModel)."""

    scale: float = 0.05
    power: float = 1.0
    noise: float = 0.3


@dataclass
class SimSyncConfig:
    """A weight sync's seconds from its bytes, full or delta (`rollout.weight_delta`): pace/sim/sync.py."""

    params: Optional[float] = None  # parameters the engines receive (null: no bytes model: sim.trainer.sync_s, sim.engine.stall_s per sync)
    gb_per_s: float = 1.0  # effective bandwidth of the trainer's side of a sync (gather + send), 1e9 bytes per second
    fixed_s: float = 0.0  # seconds of a sync whatever its bytes (collectives' latency, RPCs, the diff pass)
    changed_frac: float = 0.01  # elements whose engine-dtype value changes per version (delta syncs)


@dataclass
class SimConfig:
    name: str = "default"  # the scenario
    engine: SimEngineConfig = field(default_factory=SimEngineConfig)
    trainer: SimTrainerConfig = field(default_factory=SimTrainerConfig)
    client: SimClientConfig = field(default_factory=SimClientConfig)
    responses: SimResponsesConfig = field(default_factory=SimResponsesConfig)
    pfs: SimPfsConfig = field(default_factory=SimPfsConfig)
    sync: SimSyncConfig = field(default_factory=SimSyncConfig)
    groups: bool = True  # write the per-group Parquet (the largest output at cluster scale)
    sources: dict = field(default_factory=dict)  # where each scenario value comes from (documentation)


@dataclass
class SimRunConfig(Config):
    sim: SimConfig = field(default_factory=SimConfig)


def register() -> None:
    ConfigStore.instance().store(name="pace_sim_schema", node=SimRunConfig)


def validate_sim(cfg: DictConfig) -> None:
    """The run keys as `pace.config_checks.validate` checks them, then the models'. Raises ConfigError."""
    validate(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "sim"]))
    s = cfg.sim
    for key in ("engine.step_s", "trainer.step_s", "engine.train_slowdown", "trainer.colocated_slowdown",
                "responses.length_scale"):
        if not OmegaConf.select(s, key) > 0:
            raise ConfigError(f"sim.{key} must be > 0, got {OmegaConf.select(s, key)}")
    for key in ("engine.per_seq_s", "engine.per_ctx_token_s", "engine.prefill_token_s", "engine.stall_s",
                "trainer.per_update_s", "trainer.per_token_s", "trainer.sync_s", "trainer.val_s", "responses.grade_s", "pfs.scale", "pfs.noise"):
        if OmegaConf.select(s, key) < 0:
            raise ConfigError(f"sim.{key} must be >= 0, got {OmegaConf.select(s, key)}")
    _validate_sync(cfg)
    curve = OmegaConf.to_object(s.client.curve)
    if s.client.us_per_token < 0 or not curve or any(len(p) != 2 or p[0] < 0 for p in curve) \
            or any(b[0] <= a[0] for a, b in zip(curve, curve[1:])):
        raise ConfigError("sim.client: us_per_token must be >= 0 and curve a list of [busy, slowdown] pairs, "
                          f"busy >= 0 and increasing; got {s.client.us_per_token}, {curve}")
    longest = s.responses.prompt_tokens + cfg.rollout.max_tokens + 1
    if s.engine.kv_tokens is not None and s.engine.kv_tokens < longest:
        raise ConfigError(f"sim.engine.kv_tokens={s.engine.kv_tokens} cannot hold one sequence of "
                          f"sim.responses.prompt_tokens + rollout.max_tokens = {longest - 1} tokens")
    fc = s.responses.fixed_correct
    if fc is not None and not 0 <= fc <= cfg.data.group_size:
        raise ConfigError(f"sim.responses.fixed_correct={fc} must be in [0, data.group_size={cfg.data.group_size}]")
    for i, lv in enumerate(s.responses.levels):
        if not (0 <= lv.p_correct <= 1 and lv.len_median > 0 and lv.len_sigma >= 0 and lv.wrong_len_factor > 0):
            raise ConfigError(f"sim.responses.levels[{i}]: need p_correct in [0, 1], len_median > 0, len_sigma >= 0, "
                              "wrong_len_factor > 0")
        if lv.concentration is not None and not lv.concentration > 0:
            raise ConfigError(f"sim.responses.levels[{i}].concentration must be > 0 or null")


def _validate_sync(cfg: DictConfig) -> None:
    """The bytes model's keys (the rollout's delta keys are pace.config_checks.validate's)."""
    y = cfg.sim.sync
    if y.params is None:
        return
    if cfg.model.dtype not in DTYPE_BYTES:
        raise ConfigError(f"model.dtype={cfg.model.dtype}: the sync's bytes model knows {sorted(DTYPE_BYTES)}")
    if not (y.params > 0 and y.gb_per_s > 0 and y.fixed_s >= 0 and 0 <= y.changed_frac <= 1):
        raise ConfigError("sim.sync: need params > 0, gb_per_s > 0, fixed_s >= 0, changed_frac in [0, 1]; got "
                          f"{OmegaConf.to_container(y)}")
    if cfg.sim.trainer.sync_s > 0:
        raise ConfigError(f"sim.trainer.sync_s={cfg.sim.trainer.sync_s} and sim.sync.params={y.params} are both set: "
                          "the bytes model replaces the constant (set sim.sync.params=null to use sim.trainer.sync_s)")
