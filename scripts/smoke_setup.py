"""What scripts/gpu_smoke.py's cases run on, and what they are expected to take: the shapes of the
presets' models (Qwen3-8B, Qwen3-30B-A3B, and their tiny CPU stand-ins), the sequence lengths of
each case, the presets' trainer settings read from conf/ without Hydra, each case's peak memory as
pace/algo/memory_budget.py predicts it, the random models written from those shapes, and the FSDP2
plugin of conf/accelerate/fsdp.yaml as `accelerate launch` builds it.

Imports only the standard library (PyYAML, torch, transformers and accelerate inside the functions
that use them), so scripts/bench_trainer_gpu.py and the tests read the same shapes and settings.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FSDP_YAML = ROOT / "conf" / "accelerate" / "fsdp.yaml"

QWEN3_8B = dict(vocab_size=151_936, hidden_size=4096, intermediate_size=12_288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40_960,
                tie_word_embeddings=False, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
QWEN3_30B_A3B = dict(vocab_size=151_936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40_960,
                     tie_word_embeddings=False, rope_theta=1_000_000.0, rms_norm_eps=1e-6, num_experts=128,
                     num_experts_per_tok=8, moe_intermediate_size=768, decoder_sparse_step=1, norm_topk_prob=True)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
TINY_MOE = dict(TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
# (prompt, response) tokens of the step's sequence: the presets' micro-batch budget, 24,576 tokens
LENGTHS = {"fsdp": (2048, 22_528), "pure": (2048, 22_528), "moe": (1024, 7168)}
TINY_LENGTHS = {"fsdp": (64, 704), "pure": (64, 704), "moe": (32, 224)}
# the chunked = full check's row: the full path's logits of 24,576 tokens would take ~69 GB
# (pace.algo.memory_budget.full_logprobs_bytes), so it runs on a 4,096-token row
AGREE_LENGTHS, TINY_AGREE_LENGTHS = (256, 3840), (32, 224)
PEAK_LIMIT_GIB = 74.0  # an H100's ~78 GiB less the CUDA context, NCCL and the allocator's slack (tested)
PRESETS = {"fsdp": "pace_qwen3_8b", "pure": "pace_qwen3_8b", "moe": "pace_qwen3_30b_a3b"}



# --- the presets' trainer settings, without Hydra -----------------------------------------------
def preset_values(name: str) -> dict:
    """The `model`, `algo` and `trainer` keys `+exp=<name>` sets: its defaults chain of conf/exp/
    files and the `override /model` and `/algo` files they name, merged as Hydra does (a file's own
    keys after its defaults). Hydra's composition is the reference; test_gpu_smoke checks they agree."""
    import yaml

    out: dict = {}

    def merge(into: dict, new: dict) -> None:
        for key, value in new.items():
            if isinstance(value, dict) and isinstance(into.get(key), dict):
                merge(into[key], value)
            else:
                into[key] = value

    def walk(path: Path) -> None:
        node = yaml.safe_load(path.read_text()) or {}
        for entry in node.pop("defaults", []):
            if isinstance(entry, str) and entry != "_self_":
                walk(path.parent / f"{entry}.yaml")
            elif isinstance(entry, dict):
                (key, value), = entry.items()
                group = key.removeprefix("override ").strip("/")
                if group in ("model", "algo"):
                    merge(out, {group: yaml.safe_load((ROOT / "conf" / group / f"{value}.yaml").read_text()) or {}})
        merge(out, {k: v for k, v in node.items() if k in ("model", "algo", "trainer")})

    walk(ROOT / "conf" / "exp" / f"{name}.yaml")
    return {k: out.get(k, {}) for k in ("model", "algo", "trainer")}


def trainer_config(preset: str, model_path: str, tiny: bool):
    """pace.config.Config with the preset's model/algo/trainer values; warm-up off, so that the one
    step runs at the preset's lr (1e-6); on CPU the tiny model's short chunk."""
    from pace.config import Config

    cfg = Config()
    for group, values in preset_values(preset).items():
        section = getattr(cfg, group)
        for key, value in values.items():
            if not hasattr(section, key):
                raise KeyError(f"conf/exp/{preset}.yaml: {group}.{key} is not in pace.config's schema")
            setattr(section, key, value)
    cfg.model.path, cfg.trainer.warmup_steps = model_path, 0
    if tiny:
        cfg.trainer.logprob_chunk, cfg.trainer.max_tokens_per_micro_batch = 64, 1024
    return cfg


def predicted_peak(case: str, layers: int = 4, tiny: bool = False) -> dict[str, float]:
    """The case's peak GPU memory (GiB) by pace/algo/memory_budget.py for its shapes, by phase:
    the states (fp32 weights, gradients and AdamW moments; bf16 in ``pure``), a training step's
    forward and backward above them, AdamW's foreach step, and (``fsdp``) the no-grad chunked =
    full check (weights and moments; gradients freed). "peak" is the largest."""
    from pace.algo import memory_budget as mb

    arch = {**(QWEN3_30B_A3B if case == "moe" else QWEN3_8B), **((TINY_MOE if case == "moe" else TINY) if tiny else {})}
    shapes = mb.Shapes.of({**arch, "num_hidden_layers": 2 if case == "moe" or tiny else layers})
    cfg = trainer_config(PRESETS[case], "", tiny)
    compute = cfg.model.dtype
    master = mb.BYTES[compute] if case == "pure" else mb.BYTES[cfg.trainer.master_dtype]
    reduce = compute if case == "pure" else cfg.trainer.reduce_dtype
    params = shapes.params()
    prompt, response = (TINY_LENGTHS if tiny else LENGTHS)[case]
    step = mb.step_bytes(shapes, prompt + response, response, cfg.trainer.logprob_chunk, compute,
                         cfg.model.gradient_checkpointing, fsdp=True, reduce=reduce)
    states = mb.states_bytes(params, 1, master)
    out = {"states": states, "step": states + step["total"], "optimizer": mb.optimizer_bytes(params, 1, master)}
    if case == "fsdp":
        prompt, response = TINY_AGREE_LENGTHS if tiny else AGREE_LENGTHS
        out["agreement"] = states * 3 // 4 + mb.full_logprobs_bytes(shapes, prompt + response, response, compute)
    out = {k: v / mb.GIB for k, v in out.items()}
    return {**out, "peak": max(out.values())}


def write_model(path: Path, arch: dict, layers: int, tiny: bool) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    if (path / "config.json").exists():
        return path
    kind = Qwen3MoeConfig if "num_experts" in arch else Qwen3Config
    config = kind(**{**arch, "num_hidden_layers": layers})
    torch.manual_seed(0)
    device = "cpu" if tiny or not torch.cuda.is_available() else "cuda"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    return path


def fsdp_plugin(path: Path = FSDP_YAML):
    """An accelerate config file's FSDP plugin, as `accelerate launch` builds it from the file (also
    the CPU tests' way to Accelerate's FSDP2 path: tests/integration/fsdp_prepare.py)."""
    from pace.rehearsal.fsdp import plugin_from_yaml

    return plugin_from_yaml(path)