"""The chunked response-only log-prob path equals the full-vocabulary reference, in values and in
gradients (float32, random tiny Qwen3 models, padded and packed micro-batches, tool masks)."""
from __future__ import annotations

import pytest
import torch

from pace.algo.logprobs import chunked_logprobs, full_logprobs, response_logprobs
from pace.algo.microbatch import collate
from pace.records import Trajectory

pytestmark = pytest.mark.unit


def _model(tied: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=301, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=tied)
    return Qwen3ForCausalLM(cfg).float()


def _pairs():
    gen = torch.Generator().manual_seed(1)
    pairs = []
    for i, (n_p, n_r) in enumerate([(5, 17), (9, 3), (4, 30), (7, 11)]):
        prompt = torch.randint(1, 301, (n_p,), generator=gen).tolist()
        resp = torch.randint(1, 301, (n_r,), generator=gen).tolist()
        mask = None if i != 2 else [k not in range(10, 16) for k in range(n_r)]  # tool output at 10..15
        pairs.append((prompt, Trajectory(resp, (-torch.rand(n_r, generator=gen)).tolist(), [0] * n_r, 0, "stop",
                                         advantage=[1.0, -0.5, 0.7, -1.2][i], action_mask=mask)))
    return pairs


def _run(model, pairs, packed, chunk, temperature=0.7):
    """Values of every response token, and the gradient of a mask- and advantage-weighted sum."""
    model.zero_grad(set_to_none=True)
    b = collate([t for _, t in pairs], [p for p, _ in pairs], packed=packed)
    logp, entropy = response_logprobs(model, b, temperature, chunk)
    (logp * b["loss_mask"] * b["advantages"]).sum().backward()
    return logp.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_chunked_equals_full_in_values_and_gradients(tied, packed):
    model, pairs = _model(tied), _pairs()
    ref_lp, ref_ent, ref_grad = _run(model, pairs, packed=False, chunk=None)
    # the reference itself against a plain per-sequence forward (no padding, no packing)
    with torch.no_grad():
        per_seq = []
        for prompt, t in pairs:
            ids = torch.tensor([prompt + t.response_ids.tolist()])
            lp, _ = full_logprobs(model(ids).logits[0, :-1] / 1.0, ids[0, 1:], 0.7)
            per_seq.append(lp[len(prompt) - 1:])
    torch.testing.assert_close(ref_lp, torch.cat(per_seq), atol=1e-5, rtol=1e-5)
    for chunk in (1, 7, 64, 10_000):  # one position per chunk … a single chunk
        lp, ent, grad = _run(model, pairs, packed=packed, chunk=chunk)
        torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
        for name, g in ref_grad.items():
            torch.testing.assert_close(grad[name], g, atol=1e-6, rtol=1e-4, msg=f"chunk {chunk}: {name}")


def test_chunked_logprobs_of_a_linear_head_by_hand():
    """Against log_softmax written out and autograd through it, with a biased head and a temperature."""
    torch.manual_seed(0)
    head = torch.nn.Linear(6, 11, bias=True)
    hidden = torch.randn(9, 6, requires_grad=True)
    targets = torch.randint(0, 11, (9,))
    g = torch.randn(9)
    logp, ent = chunked_logprobs(hidden, head, targets, 2.0, chunk=4)
    (logp * g).sum().backward()
    got = [hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]
    hidden.grad = head.weight.grad = head.bias.grad = None
    logits = (hidden @ head.weight.T + head.bias) / 2.0
    p = logits.softmax(-1)
    ref = logits.log_softmax(-1)[torch.arange(9), targets]
    torch.testing.assert_close(logp, ref)
    torch.testing.assert_close(ent, -(p * p.log()).sum(-1).detach())
    assert logp.requires_grad and not ent.requires_grad
    (ref * g).sum().backward()
    for a, b in zip(got, [hidden.grad, head.weight.grad, head.bias.grad]):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="logprob_chunk"):
        chunked_logprobs(hidden, head, targets, 1.0, chunk=0)


def test_chunks_are_recomputed_in_backward_not_kept():
    """With several chunks the graph holds no chunk's logits: saved tensors of the forward are the
    hidden states and the weight, not [T, V] float32 activations."""
    head = torch.nn.Linear(8, 5000, bias=False)
    hidden = torch.randn(64, 8, requires_grad=True)
    targets = torch.randint(0, 5000, (64,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        logp, _ = chunked_logprobs(hidden, head, targets, 1.0, chunk=16)
    assert saved and max(saved) < 16 * 5000  # not one chunk's logits, let alone all of them
    logp.sum().backward()
    assert hidden.grad is not None and head.weight.grad is not None


def test_collate_packed_has_no_padding_and_restarts_positions():
    pairs = _pairs()
    padded = collate([t for _, t in pairs], [p for p, _ in pairs])
    packed = collate([t for _, t in pairs], [p for p, _ in pairs], packed=True)
    lengths = [len(p) + len(t) for p, t in pairs]
    assert packed["input_ids"].shape == (1, sum(lengths)) and packed["pad_tokens"] == 0
    assert padded["pad_tokens"] == len(pairs) * max(lengths) - sum(lengths)
    assert packed["position_ids"][0, : lengths[0] + 1].tolist() == list(range(lengths[0])) + [0]
    for key in ("targets", "loss_mask", "logp_behavior", "advantages"):
        assert torch.equal(padded[key], packed[key]), key
    assert torch.equal(packed["input_ids"].reshape(-1)[packed["index"] + 1], packed["targets"])
    assert torch.equal(padded["input_ids"].reshape(-1)[padded["index"] + 1], padded["targets"])
