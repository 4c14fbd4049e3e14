"""The tiny Qwen3-MoE: the embedded tiny model (pace/tiny.py) upcycled into a mixture of experts, for
what only an MoE exercises on a CPU (the 30B-A3B presets' rehearsal: vLLM's MoE loader and in-place
reload, the trainer's experts under FSDP2).

Sparse upcycling (Komatsuzaki et al., 2023): every expert of a layer starts as a copy of that layer's
dense MLP, everything else is the dense model's, and each layer gets a router of small random weights.
With identical experts and `norm_topk_prob` (the selected experts' weights sum to 1) the MoE computes
exactly the dense function whatever the router picks, so it starts with the dense model's skill
(an arithmetic model RL can improve, groups whose rewards differ); the random router sends tokens to
different experts, whose gradients then differ and whose copies drift apart under training, as a
real MoE's experts are apart. Pure: no engine, no file; pace/tiny.py builds and caches it.
"""
from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

ROUTER_STD = 0.02  # the router's initial weights (transformers' initializer_range for Qwen3)


def moe_config(dense: Qwen3Config, experts: int, per_token: int) -> Qwen3MoeConfig:
    """The dense config as a Qwen3-MoE with ``experts`` experts per layer (each of the dense MLP's
    width), ``per_token`` of them routed each token, every layer sparse."""
    if not 0 < per_token <= experts:
        raise ValueError(f"upcycle: experts_per_token must be in 1..{experts}, got {per_token}")
    keep = {k: getattr(dense, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                           "num_attention_heads", "num_key_value_heads", "head_dim",
                                           "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
                                           "eos_token_id", "pad_token_id", "rms_norm_eps", "rope_parameters")}
    return Qwen3MoeConfig(**keep, num_experts=experts, num_experts_per_tok=per_token,
                          moe_intermediate_size=dense.intermediate_size, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[], dtype="float32")


@torch.no_grad()
def upcycle(dense: Qwen3ForCausalLM, experts: int, per_token: int, seed: int = 0) -> Qwen3MoeForCausalLM:
    """A Qwen3-MoE whose every expert is ``dense``'s MLP of that layer (the rest copied as is) and whose
    routers are random (std `ROUTER_STD`, from ``seed``)."""
    moe = Qwen3MoeForCausalLM(moe_config(dense.config, experts, per_token)).eval()
    target = moe.state_dict()
    source = dense.state_dict()
    for name, tensor in source.items():
        if ".mlp." not in name:
            target[name].copy_(tensor)
    generator = torch.Generator().manual_seed(seed)
    for i in range(dense.config.num_hidden_layers):
        mlp = f"model.layers.{i}.mlp"
        gate_up = torch.cat([source[f"{mlp}.gate_proj.weight"], source[f"{mlp}.up_proj.weight"]], dim=0)
        target[f"{mlp}.experts.gate_up_proj"].copy_(gate_up.expand(experts, *gate_up.shape))
        down = source[f"{mlp}.down_proj.weight"]
        target[f"{mlp}.experts.down_proj"].copy_(down.expand(experts, *down.shape))
        router = target[f"{mlp}.gate.weight"]
        router.copy_(torch.randn(router.shape, generator=generator) * ROUTER_STD)
    if dense.config.tie_word_embeddings:
        moe.tie_weights()
    moe.generation_config.update(**{k: getattr(dense.generation_config, k) for k in ("eos_token_id", "pad_token_id")})
    return moe
