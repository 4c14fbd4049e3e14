"""The tiny Qwen3-MoE (pace/tiny_moe.py): a dense Qwen3 upcycled computes the dense model's logits
whatever its random routers pick (every expert a copy of the layer's MLP, the selected experts'
weights summing to 1), reloads as a Qwen3-MoE checkpoint, and its experts drift apart under training."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from pace.tiny_moe import upcycle
from pace.tiny_spec import TinySpec

pytestmark = pytest.mark.unit


def _dense(tied: bool = True) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, max_position_embeddings=64, tie_word_embeddings=tied,
                      dtype="float32")
    return Qwen3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("tied", [True, False])
def test_the_upcycled_moe_computes_the_dense_logits(tied):
    dense = _dense(tied)
    moe = upcycle(dense, experts=8, per_token=2, seed=0)
    ids = torch.randint(0, 64, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        d, m = dense(ids).logits, moe(ids).logits
    assert torch.allclose(d, m, atol=1e-5), (d - m).abs().max()
    assert moe.config.num_experts == 8 and moe.config.num_experts_per_tok == 2 and moe.config.tie_word_embeddings == tied
    layer = moe.model.layers[0].mlp
    experts = layer.experts.gate_up_proj
    assert torch.equal(experts[0], experts[7])  # copies
    gate_up = torch.cat([dense.model.layers[0].mlp.gate_proj.weight, dense.model.layers[0].mlp.up_proj.weight])
    assert torch.equal(experts[3], gate_up)  # the dense MLP, gate then up (transformers' fused layout)
    routers = [moe.model.layers[i].mlp.gate.weight for i in range(2)]
    assert routers[0].abs().sum() > 0 and not torch.equal(routers[0], routers[1])  # random, not the zeros of init


def test_a_random_router_routes_tokens_to_several_experts():
    moe = upcycle(_dense(), experts=8, per_token=2, seed=0)
    hidden = torch.randn(200, 32, generator=torch.Generator().manual_seed(2))
    _, _, chosen = moe.model.layers[0].mlp.gate(hidden)
    assert len(torch.unique(chosen)) >= 6  # an all-zero router would pick experts 0 and 1 for every token


def test_it_saves_and_loads_as_a_qwen3_moe_checkpoint(tmp_path):
    dense = _dense()
    moe = upcycle(dense, experts=4, per_token=2, seed=0)
    moe.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(loaded).__name__ == "Qwen3MoeForCausalLM"
    ids = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, dense(ids).logits, atol=1e-5)


def test_its_experts_drift_apart_under_training():
    moe = upcycle(_dense(), experts=4, per_token=2, seed=0).train()
    opt = torch.optim.SGD(moe.parameters(), lr=0.5)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(3))
    moe(ids, labels=ids).loss.backward()
    opt.step()
    experts = moe.model.layers[0].mlp.experts.gate_up_proj
    assert not torch.equal(experts[0], experts[1])


def test_the_moe_spec_has_its_own_cache_key_and_the_dense_keys_stay():
    dense = TinySpec()
    moe = TinySpec(experts=8)
    assert moe.key() != dense.key() and moe.dense() == dense
    assert dense.key() == "c2b4bafd5563"  # the default's cache (data/cache/tiny-c2b4bafd5563) predates the MoE variant
