"""The constraints on a composed config that its types cannot express, checked once at start and
raised as one-line `ConfigError`s naming the key(s): `validate` before anything is built (the
entry points call it), `check_processes` once the number of trainer processes is known,
`check_model` once the model's directory is (its config.json). The typed schema itself is pace/config.py.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pace.config import Config, target_pool
from pace.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from pace.placement import Placement


_CHOICES = {
    "device": ("auto", "cpu", "cuda"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "data.source": ("arithmetic", "tool_arithmetic", "math"),
    "tools.sandbox": ("bwrap", "process"),
    "data.template": ("dapo", "retool", "plain"),
    "pool.name": ("sync", "async", "stale_k", "gate", "pace"),
    "pace.score": ("effective", "raw", "generation"),
    "pace.selection": ("pool", "draw"),
    "algo.name": ("dapo", "m2po"),
    "algo.ratio_ref": ("behavior", "proximal"),
    "algo.is_correction": ("none", "tis", "mis"),
    "algo.is_level": ("token", "sequence", "geometric"),
    "algo.m2po_variant": ("paper", "adaptive_clip"),
    "algo.filter_on": ("acc", "reward"),
    "logger.mode": ("online", "offline", "disabled"),
    "rollout.cpu_threads_bind": ("nobind", "auto"),
    "rollout.engine_process": ("auto", "inproc", "child", "server"),
    "rollout.stream_reader": ("process", "thread"),
    "rollout.on_engine_failure": ("continue", "stop"),
    "rollout.placement": ("separate", "colocate"),
    "rollout.weight_transfer": ("auto", "shm", "nccl", "ipc", "gloo"),
    "rollout.kv_on_update": ("keep", "recompute"),
    "rollout.reload_probe": ("stop", "warn", "off"),
    "trainer.grad_sync": ("auto", "every", "last"),
    "trainer.master_dtype": ("float32", "bfloat16"),
    "trainer.reduce_dtype": ("float32", "bfloat16"),
}

_POSITIVE = (
    "data.batch_prompts", "rollout.max_tokens", "rollout.max_inflight_groups", "rollout.sync_every",
    "rollout.max_model_len", "rollout.engines", "rollout.stream_interval", "trainer.steps", "trainer.mini_batches", "trainer.micro_batch_size",
    "reward.timeout_s", "reward.workers", "rollout.temperature", "tools.workers", "tools.wall_s",
    "tools.cpu_s", "tools.memory_mb", "tools.output_bytes", "tools.output_chars", "trainer.lr", "eval.k", "eval.temperature",
    "trainer.control_timeout_s",
)


def validate(cfg: DictConfig) -> None:
    """Constraints that types cannot express. Raises ConfigError naming the key(s)."""
    from omegaconf import OmegaConf

    _check_schema(cfg)
    for key, allowed in _CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if key == "pool.name" and _import_path(value):
            _check_policy(cfg)
        elif value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}")
    for key in _POSITIVE:
        if not OmegaConf.select(cfg, key) > 0:
            raise ConfigError(f"{key} must be > 0, got {OmegaConf.select(cfg, key)}")
    for key in ("trainer.max_tokens_per_micro_batch", "trainer.logprob_chunk"):
        if OmegaConf.select(cfg, key) is not None and OmegaConf.select(cfg, key) < 1:
            raise ConfigError(f"{key} must be >= 1 or null, got {OmegaConf.select(cfg, key)}")
    if cfg.trainer.packing and cfg.trainer.max_tokens_per_micro_batch is None:
        raise ConfigError("trainer.packing packs by a token budget: set trainer.max_tokens_per_micro_batch")
    if cfg.data.group_size < 2:
        raise ConfigError(f"data.group_size={cfg.data.group_size}: group-normalised advantages need G >= 2")
    if not 0 <= cfg.rollout.overlong_buffer < cfg.rollout.max_tokens:
        raise ConfigError("rollout.overlong_buffer must be >= 0 and < rollout.max_tokens")
    if not 0 < cfg.eval.top_p <= 1:
        raise ConfigError(f"eval.top_p must be in (0, 1], got {cfg.eval.top_p}")
    if cfg.rollout.top_p != 1:
        # The engine records ℓ^μ of the nucleus-renormalised distribution it samples from, while the
        # trainer's π_θ is the full softmax: the ratio π_θ/μ would be biased on every token (≈0.1
        # nats at top_p 0.9 on-policy). DAPO trains with top_p = 1; eval.top_p may differ.
        raise ConfigError(f"rollout.top_p={cfg.rollout.top_p}: training rollouts need top_p = 1 (the trainer's "
                          "log-probs are of the full distribution); set eval.top_p for evaluation")
    if cfg.eval.every < 0:
        raise ConfigError(f"eval.every must be >= 0 (0: no in-training validation), got {cfg.eval.every}")
    if cfg.eval.every > 0 and not cfg.eval.benchmarks:
        raise ConfigError("eval.every > 0 needs eval.benchmarks (the validation sets)")
    if cfg.eval.val_max_problems is not None and cfg.eval.val_max_problems < 1:
        raise ConfigError(f"eval.val_max_problems must be >= 1 or null, got {cfg.eval.val_max_problems}")
    if cfg.eval.best_within is not None and cfg.eval.best_within < 0:
        raise ConfigError(f"eval.best_within must be >= 0 or null, got {cfg.eval.best_within}")
    if cfg.trainer.mini_batches > cfg.data.batch_prompts:
        raise ConfigError("trainer.mini_batches must be <= data.batch_prompts (mini-batches split groups)")
    if cfg.pool.get("args") and not _import_path(cfg.pool.name):
        raise ConfigError(f"pool.args={dict(cfg.pool.args)} is for a policy given by import path; "
                          f"pool.name={cfg.pool.name} takes its settings from its own keys")
    if cfg.pool.name == "sync" and cfg.rollout.sync_every != 1:
        raise ConfigError("pool.name=sync trains on-policy: it needs rollout.sync_every=1")
    for key in ("device_memory_gib", "host_memory_gib"):
        if cfg.trainer[key] is not None and not cfg.trainer[key] > 0:
            raise ConfigError(f"trainer.{key} must be > 0 or null, got {cfg.trainer[key]}")
    if cfg.trainer.dist_timeout_s is not None and cfg.trainer.dist_timeout_s <= 0:
        raise ConfigError(f"trainer.dist_timeout_s must be > 0 or null, got {cfg.trainer.dist_timeout_s}")
    if cfg.rollout.placement == "colocate" and cfg.rollout.weight_transfer == "nccl":
        raise ConfigError("rollout.weight_transfer=nccl with rollout.placement=colocate: NCCL cannot pair two processes "
                          "on one GPU; use rollout.weight_transfer=ipc (or auto)")
    if cfg.data.enable_thinking is not None and not cfg.data.chat_template:
        raise ConfigError("data.enable_thinking is passed to the chat template: it needs data.chat_template=true")
    if cfg.pace.target_pool is not None and cfg.pace.target_pool < cfg.data.batch_prompts:
        raise ConfigError("pace.target_pool must be >= data.batch_prompts (the trainer needs B groups)")
    cap = cfg.pool.capacity
    if cap is not None and cap < cfg.data.batch_prompts:
        raise ConfigError(f"pool.capacity={cap} is below data.batch_prompts={cfg.data.batch_prompts}: a batch could never form")
    if cap is not None and cfg.pool.name == "pace" and target_pool(cfg) > cap:
        raise ConfigError(f"pace.target_pool={cfg.pace.target_pool} is above pool.capacity={cap}: the target is unreachable")
    if not 0 <= cfg.rollout.kv_probe <= 1:
        raise ConfigError(f"rollout.kv_probe must be in [0, 1] (a share of spanning responses; 0: off), got {cfg.rollout.kv_probe}")
    if cfg.rollout.kv_probe and cfg.rollout.temperature != 1:
        # ℓ^μ is the sampled (tempered) distribution's; vLLM's prompt log-probs are at temperature 1
        raise ConfigError(f"rollout.kv_probe compares ℓ^μ with the engine's prompt log-probs (temperature 1): it needs "
                          f"rollout.temperature=1, got {cfg.rollout.temperature}")
    if not 0 <= cfg.pool.record_effective <= 1:
        raise ConfigError(f"pool.record_effective must be in [0, 1] (a share of groups; 0: off), got {cfg.pool.record_effective}")
    if cfg.trainer.max_sync_mismatch is not None and not cfg.trainer.max_sync_mismatch > 0:
        raise ConfigError(f"trainer.max_sync_mismatch must be > 0 or null, got {cfg.trainer.max_sync_mismatch}")
    if cfg.trainer.sync_mismatch_steps < 0:
        raise ConfigError(f"trainer.sync_mismatch_steps must be >= 0 (0: warn only), got {cfg.trainer.sync_mismatch_steps}")
    if cfg.trainer.save_every < 0 or cfg.trainer.keep_checkpoints < 1:
        raise ConfigError("trainer.save_every must be >= 0 (0: only on stop/failure) and trainer.keep_checkpoints >= 1")
    if not 0 <= cfg.pace.ema < 1:
        raise ConfigError(f"pace.ema must be in [0, 1), got {cfg.pace.ema}")
    if cfg.pace.gamma < 0 or cfg.pace.score_window < 1 or cfg.pace.prefix_tokens < 1:
        raise ConfigError("pace.gamma must be >= 0, pace.score_window and pace.prefix_tokens >= 1")
    if cfg.algo.name == "m2po" and cfg.algo.ratio_ref != "behavior":
        raise ConfigError("algo.name=m2po masks against the behaviour policy: it needs algo.ratio_ref=behavior")
    _check_algo(cfg.algo)
    if cfg.data.source == "math" and not cfg.data.path:
        raise ConfigError("data.source=math needs data.path (a hub id or a local file)")
    if not 0 <= cfg.rollout.engine_nice <= 19:
        raise ConfigError(f"rollout.engine_nice must be in 0..19 (a niceness added), got {cfg.rollout.engine_nice}")
    if cfg.rollout.max_tool_calls < 0 or cfg.tools.warm < 0:
        raise ConfigError("rollout.max_tool_calls and tools.warm must be >= 0")
    if cfg.rollout.max_tokens >= cfg.rollout.max_model_len:
        raise ConfigError("rollout.max_tokens must be < rollout.max_model_len (prompt + response)")
    if cfg.eval.max_tokens is not None and not 0 < cfg.eval.max_tokens < cfg.rollout.max_model_len:
        raise ConfigError("eval.max_tokens must be > 0 and < rollout.max_model_len (prompt + response), or null")
    if cfg.data.max_prompt_tokens is not None and cfg.data.max_prompt_tokens < 1:
        raise ConfigError(f"data.max_prompt_tokens must be >= 1 or null, got {cfg.data.max_prompt_tokens}")
    if cfg.eval.val_k is not None and cfg.eval.val_k < 1:
        raise ConfigError(f"eval.val_k must be >= 1 or null (eval.k), got {cfg.eval.val_k}")
    if cfg.reward.max_failed_in_row < 0:
        raise ConfigError(f"reward.max_failed_in_row must be >= 0 (0: never stop), got {cfg.reward.max_failed_in_row}")
    if cfg.rollout.engine_process == "inproc" and cfg.rollout.engines != 1:
        raise ConfigError("rollout.engine_process=inproc runs one engine: set rollout.engines=1 or engine_process=child")
    if cfg.rollout.deterministic and cfg.rollout.engine_process in ("child", "server"):
        raise ConfigError("rollout.deterministic needs the engine stepped by the rollout thread: rollout.engine_process=inproc")
    if cfg.rollout.servers and cfg.rollout.engine_process != "server":
        raise ConfigError("rollout.servers are used with rollout.engine_process=server")
    bad = [u for u in cfg.rollout.servers if not str(u).startswith(("http://", "https://"))]
    if bad:
        raise ConfigError(f"rollout.servers: {bad[0]!r} is not a URL (http://host:port)")
    if cfg.rollout.engine_process == "server" and cfg.rollout.weight_transfer == "ipc":
        raise ConfigError("rollout.weight_transfer=ipc shares one GPU in one host's processes: not with rollout.engine_process=server")
    if cfg.rollout.full_sync_every < 0:
        raise ConfigError(f"rollout.full_sync_every must be >= 0 (0: only when the engines' weights are unknown), "
                          f"got {cfg.rollout.full_sync_every}")
    if cfg.rollout.reload_probe_tolerance is not None and not cfg.rollout.reload_probe_tolerance > 0:
        raise ConfigError(f"rollout.reload_probe_tolerance must be > 0 or null (by model.dtype), "
                          f"got {cfg.rollout.reload_probe_tolerance}")
    if cfg.rollout.delta_max_frac is not None and not 0 < cfg.rollout.delta_max_frac <= 1:
        raise ConfigError(f"rollout.delta_max_frac must be in (0, 1] or null, got {cfg.rollout.delta_max_frac}")
    if cfg.rollout.delta_chunk_mib <= 0:
        raise ConfigError(f"rollout.delta_chunk_mib must be > 0, got {cfg.rollout.delta_chunk_mib}")
    if cfg.rollout.max_engine_restarts < 0:
        raise ConfigError(f"rollout.max_engine_restarts must be >= 0, got {cfg.rollout.max_engine_restarts}")
    for key in ("restart_backoff_s", "drain_timeout_s"):
        if cfg.rollout[key] < 0:
            raise ConfigError(f"rollout.{key} must be >= 0, got {cfg.rollout[key]}")
    if cfg.rollout.control_port is not None and not 0 <= cfg.rollout.control_port <= 65535:
        raise ConfigError(f"rollout.control_port must be a TCP port (0: a free one) or null, got {cfg.rollout.control_port}")
    if cfg.rollout.engine_timeout_s <= 0:
        raise ConfigError(f"rollout.engine_timeout_s must be > 0, got {cfg.rollout.engine_timeout_s}")


def _check_algo(algo) -> None:
    if algo.clip_ratio_c is not None and not algo.clip_ratio_c > 1:
        raise ConfigError(f"algo.clip_ratio_c={algo.clip_ratio_c}: the dual clip bounds −A·r by −A·c for A < 0, so c must be > 1 "
                          "(null disables it)")
    if algo.name == "m2po" and algo.is_correction != "none":
        raise ConfigError("algo.name=m2po is its own off-policy correction: it needs algo.is_correction=none")
    if algo.is_correction != "none" and not (algo.is_threshold is not None and algo.is_threshold > 0):
        raise ConfigError(f"algo.is_correction={algo.is_correction} needs algo.is_threshold > 0, got {algo.is_threshold}")
    if algo.is_correction == "tis" and algo.is_level == "geometric":
        raise ConfigError("algo.is_level=geometric is a rejection criterion: it needs algo.is_correction=mis")
    low = algo.is_threshold_lower
    if low is not None and (algo.is_correction != "mis" or not 0 <= low < algo.is_threshold):
        raise ConfigError(f"algo.is_threshold_lower={low}: needs algo.is_correction=mis and 0 <= it < algo.is_threshold")
    if not (algo.m2_threshold > 0 and 0 <= algo.m2po_eps_low_min <= 1 and algo.m2po_eps_high_min >= 0):
        raise ConfigError("algo.m2_threshold must be > 0, algo.m2po_eps_low_min in [0, 1], algo.m2po_eps_high_min >= 0")


def _import_path(name: str) -> bool:
    from pace.policy_path import is_import_path

    return is_import_path(name)


def _check_policy(cfg: DictConfig) -> None:
    """A policy given by import path: importable, the protocol's methods, `pool.args` that fit (its
    constructor runs when the run builds the pool, where its errors are one line too)."""
    from pace import policy_path

    policy_path.check(cfg.pool.name, policy_path.args_of(cfg))  # raises PolicyError (a ConfigError) in one line


def _check_schema(cfg: DictConfig) -> None:
    """Re-merge onto the schema: catches keys added with Hydra's `+key=` that the schema lacks."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.to_container(cfg, resolve=True))
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        raise ConfigError(f"{key}: {str(exc).splitlines()[0]}" if key else str(exc).splitlines()[0]) from None


def check_processes(cfg: DictConfig, placement: Placement) -> None:
    """What depends on the number of trainer processes and where the engines run (`placement`)."""
    check_shares(cfg, placement.world)
    if cfg.rollout.weight_delta and placement.transfer not in ("gloo", "nccl"):
        raise ConfigError(f"rollout.weight_delta sends patches over a broadcast: rollout.weight_transfer=gloo or nccl "
                          f"(here {placement.transfer}: shm and ipc move θ through this host's memory, nothing to save)")
    if cfg.rollout.deterministic and placement.mode != "inproc":
        raise ConfigError(f"rollout.deterministic needs the in-process engine, which runs with one trainer process on CPU "
                          f"(here: {placement.world} processes on {placement.device})")


def check_shares(cfg, world: int) -> None:
    """Every rank needs at least one trajectory of every mini-batch (each joins every gradient
    all-reduce): the smallest mini-batch (B split into `trainer.mini_batches` as the trainer
    splits it) must hold at least one trajectory per process."""
    b, n_mini, g = cfg.data.batch_prompts, cfg.trainer.mini_batches, cfg.data.group_size
    smallest = (b - (n_mini - 1) * math.ceil(b / n_mini)) * g
    if smallest < world:
        raise ConfigError(f"data.batch_prompts={b} in trainer.mini_batches={n_mini} leaves {max(smallest, 0)} trajectories "
                          f"in the last mini-batch, fewer than the {world} trainer processes: lower trainer.mini_batches")


# config.json keys that give a mixture-of-experts model's expert count (Qwen3-MoE / Qwen2-MoE, Mixtral, DeepSeek)
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def check_model(cfg, placement: Placement, model_path: str) -> None:
    """What depends on the model itself (every rank, once `model.path` is resolved to a directory).

    Delta sync over nccl is refused on a mixture-of-experts model: its patches index the checkpoint's
    layout (per-expert or fused `experts.*` tensors) and are applied in place through vLLM's loader
    (pace/weights/nccl_delta.py), but vLLM lays the experts out anew on load (`FusedMoE`: w13/w2 stacked
    over the experts, per expert-parallel rank), and `load_checkpoint_weight_patches` has not been
    shown to land a NaN-masked expert tensor right there (one final same-shaped copy per destination,
    its contract: vllm/model_executor/model_loader/checkpoint_weight_patch.py). Until a GPU run shows it,
    whole syncs only. gloo is not refused: its workers patch a mirror in the checkpoint's layout and
    reload every tensor whole (pace/weights/gloo.py)."""
    if not (cfg.rollout.weight_delta and placement.transfer == "nccl"):
        return
    experts = expert_count(model_path)
    if experts is not None:
        key, n = experts
        raise ConfigError(f"rollout.weight_delta=true over rollout.weight_transfer=nccl: {model_path} is a "
                          f"mixture-of-experts model ({key}={n}), whose experts vLLM lays out anew on load (FusedMoE), "
                          "while the patches index the checkpoint's layout and are not shown to apply there: "
                          "set rollout.weight_delta=false")


def expert_count(model_path: str) -> tuple[str, int] | None:
    """(the key, its value) of a mixture-of-experts model's expert count in its config.json (or its
    text_config), or None: a dense model, or no config.json to read."""
    import json
    from pathlib import Path

    path = Path(model_path) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    for part in (config, config.get("text_config") or {}):
        for key in EXPERT_KEYS:
            if isinstance(part.get(key), int) and part[key] > 0:
                return key, part[key]
    return None
