"""Log-probabilities and entropy of the response tokens under the trainer's policy.

Two paths that compute the same numbers:

``full_logprobs``   the reference: float32 logits of every position at once, a full-vocabulary
                    `log_softmax`, the entropy from it. Memory ~18 bytes × V per position alive at
                    once: ≈ 57 GiB for one 22.5k-token sequence with Qwen3's V = 151,936.
``chunked_logprobs`` the default: from the final hidden states of the response positions only,
                    `chunk` positions at a time; each chunk's logits are recomputed in backward
                    (`torch.utils.checkpoint`), so the peak is set by one chunk (~12 bytes × V ×
                    chunk), not by the sequence. The entropy (a metric) is computed without a graph.

Temperature: the engine samples from softmax(logits / T) and reports that distribution's
log-probs, so the trainer divides by T too. vLLM's processed log-probs also reflect top-p/top-k
truncation, which the trainer does not apply: with `top_p < 1` the behaviour log-prob ℓ^μ of a
sampled token is the renormalised one, larger than the trainer's log π by −log(kept mass), and
every ratio π_θ/μ would be biased below 1. So training rollouts are refused unless top_p = 1
(pace/config.py; DAPO samples with top_p = 1); only evaluation may truncate.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def full_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target and the entropy of each position's distribution (float32), from logits
    of any leading shape [..., V] and targets [...]."""
    logits = logits.float() / temperature
    logp_all = F.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
           temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(hidden, weight, bias).float() / temperature
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz
    with torch.no_grad():
        entropy = logz - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy


def chunked_logprobs(hidden: torch.Tensor, head: torch.nn.Linear | torch.nn.Module, targets: torch.Tensor,
                     temperature: float, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``full_logprobs(head(hidden), targets)`` for hidden [T, H] and targets [T], ``chunk``
    positions at a time. With more than one chunk each is checkpointed: backward recomputes its
    logits instead of keeping them."""
    if chunk < 1:
        raise ValueError(f"trainer.logprob_chunk must be >= 1, got {chunk}")
    weight, bias = head.weight, getattr(head, "bias", None)
    if weight.dtype != hidden.dtype:  # fp32 master weights under autocast (DDP mixed precision): compute as the forward did
        weight = weight.to(hidden.dtype)
        bias = None if bias is None else bias.to(hidden.dtype)
    n = hidden.shape[0]
    if n <= chunk:  # one chunk: nothing to gain from recomputing it
        return _chunk(hidden, weight, bias, targets, temperature)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    parts = []
    for i in range(0, n, chunk):
        h, t = hidden[i : i + chunk], targets[i : i + chunk]
        if grad:
            parts.append(checkpoint(_chunk, h, weight, bias, t, temperature, use_reentrant=False))
        else:
            parts.append(_chunk(h, weight, bias, t, temperature))
    logp, entropy = zip(*parts)
    return torch.cat(logp), torch.cat(entropy)


def response_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float, chunk: int | None,
                      decoder: torch.nn.Module | None = None, head: torch.nn.Module | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """log π and entropy of every response token of a collated micro-batch (`pace.algo.trainer.collate`),
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
