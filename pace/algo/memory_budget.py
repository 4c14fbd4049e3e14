"""The trainer's memory per rank, from shapes and dtypes: what start-up checks (pace/algo/memory_check.py)
and what scripts/gpu_smoke.py predicts for its cases. Pure arithmetic: no torch, no model.

States. P parameters, sharded over S ranks under FSDP2 (S = 1 otherwise), master weights of m bytes
(4: fp32 under mixed precision, pace/algo/trainer.py; the model's dtype without):

    states    = ⌈P/S⌉ · m · 4     weights, gradients, AdamW's two moments
    optimizer = states + ⌈P/S⌉ · m  AdamW's foreach step (torch.optim.adam._multi_tensor_adam, the
                                     default for CUDA tensors and DTensors) allocates sqrt(v) for every
                                     parameter of a rank at once

A micro-batch of one row of T tokens, R of them response positions scored in chunks of C (c bytes a
compute element, fp32 in RMSNorm's internals as transformers computes them), adds `step_bytes`:
the activations autograd keeps (with gradient checkpointing each layer's input, [T, H], and one
layer recomputed in backward), a backward's transient gradients, the chunked log-prob path's [C, V]
tensors (pace/algo/logprobs.py) and the head's weight gradient, and under FSDP2 the unsharded
compute-dtype copies of the root module (embeddings, head, final norm: kept from the forward to the
backward) and of two decoder layers (the current one and the prefetched one) with the gradient of
one before its reduce-scatter. `full_logprobs_bytes` is the reference path without gradients
(pace.algo.logprobs.full_logprobs: c · V bytes a position and 16 · V a response position).

What is left out: the CUDA context and NCCL's buffers (outside `torch.cuda.max_memory_allocated`),
the caching allocator's fragmentation, attention kernels' workspaces. The activation terms are
checked against torch's measured peak on CPU for the tiny shapes (tests/unit/test_memory_budget.py,
torch.distributed._tools.mem_tracker.MemTracker); on a GPU not yet (scripts/gpu_smoke.py prints
its prediction beside `max_memory_allocated`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 2**30
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Shapes:
    """A Qwen3-style decoder (q/k norms, no biases; every layer dense, or every layer MoE)."""

    vocab: int
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool = False
    experts: int = 0  # 0: dense
    top_k: int = 0
    expert_intermediate: int = 0

    @classmethod
    def of(cls, config) -> Shapes:
        """From a transformers config (or its dict)."""
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        heads = get("num_attention_heads")
        return cls(vocab=get("vocab_size"), hidden=get("hidden_size"), layers=get("num_hidden_layers"),
                   intermediate=get("intermediate_size"), heads=heads, kv_heads=get("num_key_value_heads") or heads,
                   head_dim=get("head_dim") or get("hidden_size") // heads, tied=bool(get("tie_word_embeddings", False)),
                   experts=get("num_experts") or 0, top_k=get("num_experts_per_tok") or 0,
                   expert_intermediate=get("moe_intermediate_size") or 0)

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_params(self) -> int:
        h = self.hidden
        attn = 2 * h * self.q + 2 * h * self.kv + 2 * self.head_dim + 2 * h  # q, o; k, v; q/k norms; two layer norms
        if self.experts:
            return attn + self.experts * 3 * h * self.expert_intermediate + self.experts * h  # experts; router
        return attn + 3 * h * self.intermediate

    def root_params(self) -> int:
        """Embeddings, head (unless tied) and final norm: FSDP2's root unit."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def params(self) -> int:
        return self.root_params() + self.layers * self.layer_params()


def states_bytes(params: int, shards: int = 1, master_bytes: int = 4) -> int:
    """Weights, gradients and AdamW's two moments of one rank."""
    return math.ceil(params / shards) * master_bytes * 4


def optimizer_bytes(params: int, shards: int = 1, master_bytes: int = 4) -> int:
    """One rank at AdamW's foreach step: its states and the sqrt(v) it allocates."""
    return states_bytes(params, shards, master_bytes) + math.ceil(params / shards) * master_bytes


def _norm_saved(width: int, c: int, input_kept: bool = False) -> int:
    """Bytes a token that transformers' RMSNorm keeps for backward (it normalises in fp32): below
    fp32 the fp32 copy of its input and the normalised values cast back; in fp32 the normalised
    values, and its input when nothing else keeps it (``input_kept``: counted elsewhere)."""
    if c < 4:
        return width * (4 + c)
    return width * (4 if input_kept else 8)


def layer_activation_bytes(s: Shapes, c: int) -> int:
    """Bytes a token that one decoder layer keeps for backward (its input not counted), as autograd
    saves them in transformers 5's Qwen3 / Qwen3-MoE layers."""
    h, q, kv = s.hidden, s.q, s.kv
    attn = (_norm_saved(h, c, input_kept=True) + h * c  # input norm, and its output (the projections' input)
            + _norm_saved(q, c) + _norm_saved(kv, c) + kv * c  # q/k norms of the projections; v
            + (q + kv) * c + 2 * s.head_dim * c  # rotary outputs; cos, sin
            + q * c + s.heads * 4)  # attention output (o_proj's input), its logsumexp
    post = (h * c if c == 4 else 0) + _norm_saved(h, c, input_kept=True) + h * c  # residual (fp32: the norm keeps it); norm; output
    if s.experts:  # router logits and fp32 softmax; per routed token its input row, gate, up, act, act·up, output
        mlp = s.experts * (c + 4) + s.top_k * (2 * h + 4 * s.expert_intermediate) * c
    else:  # gate, up, act(gate), act·up
        mlp = 4 * s.intermediate * c
    return attn + post + mlp


def _grad_transient(s: Shapes, c: int) -> int:
    """Bytes a token of the gradients alive at once inside one layer's backward (the MLP's: the
    gradients of its product, gate, up and of the residual stream)."""
    width = s.top_k * (2 * s.expert_intermediate + s.hidden) if s.experts else 3 * s.intermediate
    return (width + 2 * s.hidden) * c


def step_bytes(s: Shapes, tokens: int, response: int, chunk: int, compute: str = "bfloat16",
               checkpointing: bool = True, fsdp: bool = True, reduce: str = "float32") -> dict[str, int]:
    """The peak of one micro-batch's forward and backward above the states (`states_bytes`). One row
    of ``tokens`` tokens, ``response`` of them scored in chunks of ``chunk``. Backward has two
    phases: through the log-probs and the head ("head": the forward's activations, the final norm's,
    a chunk's [C, V] tensors and the head's weight gradient), then through the layers ("layers": the
    activations, one layer recomputed under checkpointing, its transient gradients). Returns both
    and "total", their max; under FSDP2 each includes the unsharded copies ("unsharded")."""
    c, r = BYTES[compute], BYTES[reduce]
    t, v, h = tokens, s.vocab, s.hidden
    layer = layer_activation_bytes(s, c) * t
    kept = s.layers * t * h * c if checkpointing else s.layers * layer  # what the forward leaves for backward
    final = t * (h * c + _norm_saved(h, c)) + response * h * c  # final norm, its output, the response rows
    # a chunk's forward holds its logits, their fp32 copy (below fp32) and their exp; its backward
    # the recomputed logits, their gradient (fp32, then cast) and the head's weight gradient of the
    # chunk beside the accumulated one (under FSDP2 the unsharded head's; else the states' own)
    cc, rows = (c if c < 4 else 0), min(chunk, response)
    logprobs = max(rows * v * (cc + 8), rows * v * (2 * cc + 4) + (2 if fsdp else 1) * v * h * c)
    root, unit = s.root_params() * c, s.layer_params()
    unsharded_head = root + unit * c if fsdp else 0  # the root unit, the last layer prefetched
    unsharded_layers = root + 2 * unit * c + unit * (c + r) if fsdp else 0  # two layers, one's gradient before its reduce-scatter
    head = kept + final + logprobs + unsharded_head
    layers = kept + (layer if checkpointing else 0) + t * _grad_transient(s, c) + unsharded_layers
    return {"head": head, "layers": layers, "unsharded": max(unsharded_head, unsharded_layers), "total": max(head, layers)}


def full_logprobs_bytes(s: Shapes, tokens: int, response: int, compute: str = "bfloat16", fsdp: bool = True) -> int:
    """The reference path's peak without gradients (`response_logprobs(..., chunk=None)` under no_grad):
    every position's logits, and for the response rows their fp32 logits, log-softmax, exp and the
    entropy's product (their gathered copy is freed by then); under FSDP2 the root unit unsharded."""
    c = BYTES[compute]
    return tokens * s.vocab * c + response * s.vocab * 16 + (s.root_params() * c if fsdp else 0)
