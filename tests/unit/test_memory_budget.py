"""pace/algo/memory_budget.py against what torch allocates: parameter counts of real models, the
states of a real AdamW step, and the peaks torch's MemTracker measures on CPU for the tiny shapes
(the activation, log-prob and optimizer terms); then scripts/gpu_smoke.py's real shapes within an
H100's memory."""
from __future__ import annotations

import sys

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

from pace.algo import memory_budget as mb
from pace.algo.logprobs import response_logprobs
from tests.helpers import ROOT

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_hidden_layers=2, tie_word_embeddings=False)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def _model(moe: bool = False, dtype=torch.float32, **changes):
    config = (Qwen3MoeConfig(**TINY | changes, **MOE) if moe else Qwen3Config(**TINY | changes))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype), config


def _peak(fn, *track) -> int:
    """Peak bytes of the tensors alive on CPU while ``fn`` runs (those of ``track`` included)."""
    tracker = MemTracker()
    tracker.track_external(*track)
    with tracker:
        fn()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

def _logprob_step_peak(model, vocab: int, tokens: int, prompt: int, chunk: int) -> int:
    """Torch's peak of the trainer's chunked log-prob forward and backward on one random row, above
    the weights and their (preallocated) gradients."""
    ids = torch.randint(1, vocab, (1, tokens))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "index": torch.arange(prompt - 1, tokens - 1),
             "targets": ids[0, prompt:]}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    held = sum(p.nbytes + p.grad.nbytes for p in model.parameters())

    def step():
        logp, _ = response_logprobs(model, batch, 1.0, chunk)
        (-logp.sum()).backward()

    return _peak(step, model) - held



@pytest.mark.parametrize("moe, tied", [(False, False), (False, True), (True, False)])
def test_parameter_count_from_shapes_is_the_built_models(moe, tied):
    model, config = _model(moe, tie_word_embeddings=tied)
    assert mb.Shapes.of(config).params() == sum(p.numel() for p in model.parameters())


def test_parameter_count_of_the_presets_shapes_is_the_meta_built_models():
    sys.path.insert(0, str(ROOT / "scripts"))
    import smoke_setup

    for arch in (smoke_setup.QWEN3_8B, smoke_setup.QWEN3_30B_A3B):
        config = (Qwen3MoeConfig if "num_experts" in arch else Qwen3Config)(**arch)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert mb.Shapes.of(config).params() == sum(p.numel() for p in model.parameters())
    assert 8.1e9 < mb.Shapes.of(smoke_setup.QWEN3_8B).params() < 8.3e9  # Qwen3-8B: 8.2 B
    assert 30.4e9 < mb.Shapes.of(smoke_setup.QWEN3_30B_A3B).params() < 30.6e9  # Qwen3-30B-A3B: 30.5 B


def test_states_are_the_bytes_of_weights_gradients_and_adamw_moments_after_a_step():
    model, config = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 512, (1, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    held = sum(p.nbytes + p.grad.nbytes for p in model.parameters())
    held += sum(v.nbytes for s in optimizer.state.values() for k, v in s.items() if k != "step")
    assert held == mb.states_bytes(mb.Shapes.of(config).params(), shards=1, master_bytes=4)


def test_adamw_foreach_step_peaks_at_the_states_and_one_temporary():
    model, config = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)  # the CUDA default
    ids = torch.randint(0, 512, (1, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()  # the moments exist: the second step is the steady state
    measured = _peak(optimizer.step, model, optimizer)
    predicted = mb.optimizer_bytes(mb.Shapes.of(config).params(), shards=1, master_bytes=4)
    # MemTracker rounds each tensor up to 512 bytes, as CUDA's caching allocator does
    assert predicted <= measured <= predicted * 1.05


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("checkpointing", [True, False])
def test_step_peak_above_the_states_is_what_torch_allocates(moe, dtype, checkpointing):
    """The trainer's log-prob path (chunked) forward and backward on one row: the measured peak
    above the weights and gradients within 15% of the prediction (non-FSDP: no unsharded copies)."""
    model, config = _model(moe, dtype)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    tokens, prompt, chunk = 2048, 128, 256
    measured = _logprob_step_peak(model, 512, tokens, prompt, chunk)
    predicted = mb.step_bytes(mb.Shapes.of(config), tokens, tokens - prompt, chunk, DTYPES[dtype], checkpointing, fsdp=False)
    assert 0.85 < predicted["total"] / measured < 1.15, (predicted, measured)


def test_log_prob_phase_with_a_large_vocabulary_is_what_torch_allocates():
    """Vocabulary 32k on a narrow model: the [chunk, V] tensors and the head's gradient set the peak."""
    model, config = _model(vocab_size=32_768, num_hidden_layers=1)
    tokens, prompt, chunk = 1024, 64, 256
    measured = _logprob_step_peak(model, 32_768, tokens, prompt, chunk)
    predicted = mb.step_bytes(mb.Shapes.of(config), tokens, tokens - prompt, chunk, "float32", False, fsdp=False)
    assert predicted["head"] > predicted["layers"]  # this case tests the log-prob phase
    assert 0.85 < predicted["total"] / measured < 1.15, (predicted, measured)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_log_probs_without_gradients_is_what_torch_allocates(dtype):
    model, config = _model(dtype=dtype, vocab_size=8192)
    tokens, prompt = 1024, 64
    ids = torch.randint(1, 8192, (1, tokens))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "index": torch.arange(prompt - 1, tokens - 1),
             "targets": ids[0, prompt:]}
    held = sum(p.nbytes for p in model.parameters())
    with torch.no_grad():
        measured = _peak(lambda: response_logprobs(model, batch, 1.0, None), model) - held
    predicted = mb.full_logprobs_bytes(mb.Shapes.of(config), tokens, tokens - prompt, DTYPES[dtype], fsdp=False)
    assert 0.9 < predicted / measured < 1.1, (predicted, measured)


def test_gpu_smoke_fits_an_h100_for_its_real_shapes(capsys):
    """Each case of scripts/gpu_smoke.py at its real shapes (the 8B's layers with --layers 4, the
    2-layer 30B-A3B, 24,576 and 8,192 tokens) peaks within 74 GiB; the chunked = full check on the
    step's own 24,576-token row would not have. This checks the memory model's arithmetic
    (memory_budget's estimate of each case), not memory measured on a device: the real check is
    scripts/gpu_smoke.py run on an H100, which measures each case's peak."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import smoke_setup

    peaks = {case: smoke_setup.predicted_peak(case) for case in ("fsdp", "pure", "moe")}
    with capsys.disabled():
        print("\n" + "\n".join(f"gpu_smoke {case}: " + ", ".join(f"{k} {v:.1f} GiB" for k, v in p.items())
                               for case, p in peaks.items()))
    assert all(p["peak"] <= smoke_setup.PEAK_LIMIT_GIB == 74.0 for p in peaks.values())
    assert peaks["fsdp"]["states"] > 29  # 2.0 B parameters × 16 bytes: the 8B's head, embeddings and 4 layers
    shapes = mb.Shapes.of({**smoke_setup.QWEN3_8B, "num_hidden_layers": 4})
    prompt, response = smoke_setup.LENGTHS["fsdp"]
    long_row = peaks["fsdp"]["states"] * 3 / 4 + mb.full_logprobs_bytes(shapes, prompt + response, response) / mb.GIB
    assert long_row > 78  # what the check cost before: more than an H100 has
