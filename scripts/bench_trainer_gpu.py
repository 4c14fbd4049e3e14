"""The trainer's memory and speed at the paper's lengths, on one GPU (issue #17).

    python scripts/bench_trainer_gpu.py            # one H200/H100-class GPU, ≤ 8 minutes
    python scripts/bench_trainer_gpu.py --tiny     # CPU, a tiny model, seconds (the test suite runs this)

Needs only torch (2.11+), transformers (5.17+) and accelerate: no vLLM, no model hub. The model is
Qwen3-4B-shaped (36 layers, hidden 2560, vocabulary 151,936, tied embeddings), initialised at random
in bf16 from a config written here, with gradient checkpointing as the presets train it.

1. One forward+backward of one 8k / 16k / 32k-token sequence (256 prompt tokens, the rest
   response) with the new log-prob path (pace.algo.logprobs: response positions only, chunks of
   `--chunk` positions recomputed in backward) and then the old one (full-vocabulary float32 logits
   of every position, `log_softmax`, entropy from its `exp`: the trainer before issue #17), new
   first so that an out-of-memory of the old one is still a result. Peak
   `torch.cuda.max_memory_allocated` and seconds of each.
2. Tokens per second of the new path on micro-batches of 16k-token sequences, at token budgets
   32k, 64k, 128k, 256k: the largest that fits.
3. Agreement: the largest difference between the two paths' log-probs (no grad).
4. The weight sync's gather: the model under FSDP2 (`fully_shard`, a process group of one), every
   parameter cast to bf16 and gathered in full (`full_tensor`), as pace/sync.py does; seconds.

Prints one JSON object per measurement, then a Markdown table.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pace.algo.logprobs import full_logprobs, response_logprobs  # noqa: E402  (torch only)

QWEN3_4B = dict(vocab_size=151_936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, max_position_embeddings=40_960, tie_word_embeddings=True,
                rope_theta=1_000_000.0, rms_norm_eps=1e-6)
TINY = dict(QWEN3_4B, vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
PROMPT = 256


def build(tiny: bool, device: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**(TINY if tiny else QWEN3_4B))
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(torch.float32 if tiny else torch.bfloat16)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    return model


def sequences(rows: int, length: int, vocab: int, device: str) -> dict[str, torch.Tensor]:
    """``rows`` sequences of ``length`` tokens (no padding, so no attention mask: causal SDPA keeps
    its flash kernel) and the flat positions/targets of their response tokens, as `collate` lays
    them out."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (rows, length), generator=gen)
    index = torch.cat([r * length + PROMPT - 1 + torch.arange(length - PROMPT) for r in range(rows)])
    batch = {"input_ids": ids, "index": index, "targets": ids.reshape(-1)[index + 1]}
    return {k: v.to(device) for k, v in batch.items()}


def logprobs(model, batch, path: str, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    if path == "new":
        logp, entropy = response_logprobs(model, batch, 1.0, chunk)
    else:  # the trainer before issue #17: every position's float32 log-softmax, then the response ones
        logits = model(input_ids=batch["input_ids"], use_cache=False).logits[:, :-1]
        logp_all, entropy = full_logprobs(logits, batch["input_ids"][:, 1:], 1.0)
        width = batch["input_ids"].shape[1]
        rows, cols = batch["index"] // width, batch["index"] % width  # [R, L−1] layout of the old path
        logp, entropy = logp_all[rows, cols], entropy[rows, cols]
    return logp, entropy


@torch.no_grad()
def agreement(model, batch, chunk: int) -> float:
    """Largest |log π| difference between the two paths over the response tokens."""
    return float((logprobs(model, batch, "new", chunk)[0] - logprobs(model, batch, "old", chunk)[0]).abs().max())


def step(model, batch, path: str, chunk: int) -> None:
    """One forward+backward of a token-level policy-gradient-shaped loss."""
    logp, _ = logprobs(model, batch, path, chunk)
    (-(logp.sum()) / logp.numel()).backward()
    model.zero_grad(set_to_none=True)


def measure(model, batch, path: str, chunk: int, device: str, reps: int = 1) -> dict:
    cuda = device == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    try:
        step(model, batch, path, chunk)  # warm-up (kernels, allocator)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            step(model, batch, path, chunk)
        if cuda:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - t0) / reps
    except torch.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        return {"path": path, "oom": True}
    out = {"path": path, "oom": False, "seconds": seconds}
    if cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["above_model_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return out


def fsdp_gather_seconds(model, device: str) -> float:
    """FSDP2-shard ``model`` (a group of one) and gather every parameter in full, cast to bf16."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    total = 0
    for _, p in model.named_parameters():
        full = p.to(torch.bfloat16).full_tensor().to("cpu")  # cast the shard first, as pace/sync.py does
        total += full.numel()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    dist.destroy_process_group()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU, a tiny model and short sequences (a smoke test)")
    ap.add_argument("--chunk", type=int, default=1024, help="trainer.logprob_chunk of the new path")
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --tiny on CPU")
    lengths = [512, 1024] if args.tiny else [8192, 16384, 32768]
    chunk = 64 if args.tiny else args.chunk
    per_seq = 512 if args.tiny else 16384
    budgets = [1024, 2048] if args.tiny else [32768, 65536, 131072, 262144]
    model = build(args.tiny, device)
    vocab = model.config.vocab_size
    info = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "params_b": sum(p.numel() for p in model.parameters()) / 1e9, "chunk": chunk}
    print(json.dumps({"setup": info}), flush=True)
    diff = agreement(model, sequences(1, lengths[0], vocab, device), chunk)
    print(json.dumps({"max_abs_logp_diff_new_vs_old": diff, "tokens": lengths[0]}), flush=True)
    rows = []
    for n in lengths:
        batch = sequences(1, n, vocab, device)
        for path in ("new", "old"):
            r = {"tokens": n, **measure(model, batch, path, chunk, device)}
            print(json.dumps(r), flush=True)
            rows.append(r)
        del batch
    throughput = []
    for budget in budgets:
        batch = sequences(budget // per_seq, per_seq, vocab, device)
        r = measure(model, batch, "new", chunk, device, reps=2)
        del batch
        if r["oom"]:
            print(json.dumps({"budget": budget, "oom": True}), flush=True)
            break
        r = {"budget": budget, **r, "tokens_per_s": budget / r["seconds"]}
        print(json.dumps(r), flush=True)
        throughput.append(r)
    gather = fsdp_gather_seconds(model, device)
    print(json.dumps({"fsdp2_full_gather_s": gather}), flush=True)

    print(f"\n{info['device']}, Qwen3-{'tiny' if args.tiny else '4B'}-shaped ({info['params_b']:.2f} B parameters), "
          f"gradient checkpointing, logprob_chunk {chunk}\n")
    print("| tokens | new: peak GiB | new: s | old: peak GiB | old: s |")
    print("|---|---|---|---|---|")
    for n in lengths:
        cell = {r["path"]: r for r in rows if r["tokens"] == n}
        fmt = lambda r: "OOM | –" if r["oom"] else f"{r.get('peak_gib', float('nan')):.1f} | {r['seconds']:.2f}"  # noqa: E731
        print(f"| {n:,} | {fmt(cell['new'])} | {fmt(cell['old'])} |")
    if throughput:
        best = throughput[-1]
        print(f"\nnew path, micro-batches of {per_seq:,}-token sequences: {best['tokens_per_s']:,.0f} tokens/s at a "
              f"{best['budget']:,}-token micro-batch (the largest that fit of {budgets})")
    print(f"FSDP2 full gather of the weights (bf16, one process): {gather:.2f} s")
    print(f"new vs old log-probs at {lengths[0]:,} tokens: max |difference| {diff:.2e}")


if __name__ == "__main__":
    main()
