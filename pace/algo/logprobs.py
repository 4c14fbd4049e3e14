"""Log-probabilities and entropy of the response tokens under the trainer's policy.

Two paths that compute the same numbers:

``full_logprobs``   the reference: float32 logits of every position at once, a full-vocabulary
                    `log_softmax`, the entropy from it. Memory ~18 bytes × V per position alive at
                    once: ≈ 57 GiB for one 22.5k-token sequence with Qwen3's V = 151,936.
``chunked_logprobs`` the default: from the final hidden states of the response positions only,
                    `chunk` positions at a time; each chunk's logits are recomputed in backward
                    (a custom autograd function, `_ChunkLogProbs`), so the peak is set by one
                    chunk (two float32 [chunk, V] tensors: ~0.6 GB each at chunk 1024 and
                    V = 151,936), not by the sequence. The entropy (a metric) has no gradient.

Temperature: the engine samples from softmax(logits / T) and reports that distribution's
log-probs, so the trainer divides by T too. vLLM's processed log-probs also reflect top-p/top-k
truncation, which the trainer does not apply: with `top_p < 1` the behaviour log-prob ℓ^μ of a
sampled token is the renormalised one, larger than the trainer's log π by −log(kept mass), and
every ratio π_θ/μ would be biased below 1. So training rollouts are refused unless top_p = 1
(pace/config_checks.py; DAPO samples with top_p = 1); only evaluation may truncate.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def full_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target and the entropy of each position's distribution (float32), from logits
    of any leading shape [..., V] and targets [...]."""
    logits = logits.float() / temperature
    logp_all = F.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


class _ChunkLogProbs(torch.autograd.Function):
    """log π of ``targets`` and the entropy at ``chunk`` positions from their hidden states, with
    the logits recomputed in backward instead of kept (what fused linear-cross-entropy kernels do,
    in PyTorch): forward holds at most two float32 [chunk, V] tensors, backward one (the softmax,
    turned into the gradient of the logits in place)."""

    @staticmethod
    def _logits(hidden, weight, bias, temperature):
        logits = F.linear(hidden, weight, bias).float()
        return logits.div_(temperature) if temperature != 1.0 else logits

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature):
        logits = _ChunkLogProbs._logits(hidden, weight, bias, temperature)
        logz = torch.logsumexp(logits, dim=-1)
        logp_all = logits.sub_(logz.unsqueeze(-1))  # in place: log-softmax
        logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        entropy = -torch.einsum("tv,tv->t", logp_all.exp(), logp_all)  # a contraction, not a [chunk, V] product
        ctx.save_for_backward(hidden, weight, bias, targets, logz)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, bias, targets, logz = ctx.saved_tensors
        # d log p_y / d z_v = 1[v = y] − p_v; z = logits / T
        grad = _ChunkLogProbs._logits(hidden, weight, bias, ctx.temperature).sub_(logz.unsqueeze(-1)).exp_()
        grad.mul_(-grad_logp.unsqueeze(-1))
        grad.scatter_add_(-1, targets.unsqueeze(-1), grad_logp.unsqueeze(-1))
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        grad = grad.to(hidden.dtype)
        grad_hidden = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad.t() @ hidden if ctx.needs_input_grad[1] else None
        grad_bias = grad.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None


def chunked_logprobs(hidden: torch.Tensor, head: torch.nn.Linear | torch.nn.Module, targets: torch.Tensor,
                     temperature: float, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``full_logprobs(head(hidden), targets)`` for hidden [T, H] and targets [T], ``chunk``
    positions at a time, each chunk's logits recomputed in backward (`_ChunkLogProbs`)."""
    if chunk < 1:
        raise ValueError(f"trainer.logprob_chunk must be >= 1, got {chunk}")
    weight, bias = head.weight, getattr(head, "bias", None)
    if weight.dtype != hidden.dtype:  # fp32 master weights under autocast (DDP mixed precision): compute as the forward did
        weight = weight.to(hidden.dtype)
        bias = None if bias is None else bias.to(hidden.dtype)
    parts = [_ChunkLogProbs.apply(hidden[i : i + chunk], weight, bias, targets[i : i + chunk], temperature)
             for i in range(0, hidden.shape[0], chunk)]
    if len(parts) == 1:
        return parts[0]
    logp, entropy = zip(*parts)
    return torch.cat(logp), torch.cat(entropy)


def response_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float, chunk: int | None,
                      decoder: torch.nn.Module | None = None, head: torch.nn.Module | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """log π and entropy of every response token of a collated micro-batch (`pace.algo.microbatch.collate`),
    flat [T]. ``chunk`` None: the full path; else the chunked one on the final hidden states.

    ``model`` is called as prepared (under FSDP its hooks unshard and reshard the weights as usual)
    with the head applied to one position only (``logits_to_keep=1``); the decoder's output, the
    final hidden states, is kept by a forward hook. ``decoder``/``head``: the unwrapped model's
    `get_decoder()`/`get_output_embeddings()` (looked up on ``model`` when not given). The head's
    weight is read after the forward: FSDP2 keeps the root module's parameters (embeddings, final
    norm, head) unsharded from the forward until the backward has used them.
    """
    # use_cache=False: no KV cache in a training forward (and transformers detects packed sequences
    # from position_ids only without one)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch} | {"use_cache": False}
    index, targets = batch["index"], batch["targets"]
    if chunk is None:
        logits = model(**inputs).logits
        return full_logprobs(logits.reshape(-1, logits.shape[-1])[index], targets, temperature)
    decoder = decoder if decoder is not None else model.get_decoder()
    head = head if head is not None else model.get_output_embeddings()
    seen = []
    hook = decoder.register_forward_hook(lambda module, args, out: seen.append(out[0]))
    try:
        model(**inputs, logits_to_keep=1)
    finally:
        hook.remove()
    hidden = seen[0].reshape(-1, seen[0].shape[-1])[index]
    return chunked_logprobs(hidden, head, targets, temperature, chunk)
