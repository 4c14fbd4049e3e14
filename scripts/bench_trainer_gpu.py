"""The presets' trainer at the paper's lengths, on one GPU: memory and speed.

    python scripts/bench_trainer_gpu.py              # one H200-class GPU, ≤ 8 minutes by estimate (not yet run: docs/gpu.md)
    python scripts/bench_trainer_gpu.py --layers 24  # an H100: the 36-layer 4B's AdamW step alone is ~75 of its ~78 GiB
    python scripts/bench_trainer_gpu.py --tiny       # CPU, a tiny model, ~1 minute (the test suite runs this)

Needs only torch (2.11+), transformers (5.17+) and accelerate: no vLLM, no Hydra, no model hub. The
trainer is the one `train.py` builds for `+exp=pace_qwen3_4b` (`DAPOTrainer` with that preset's model,
algo and trainer settings, read from conf/exp/ by scripts/smoke_setup.py's reader), in a process of its
own under `accelerate launch --config_file conf/accelerate/fsdp.yaml --num_processes 1`: FSDP2 from
the yaml, bf16 mixed precision with fp32 master weights and AdamW state, gradient checkpointing,
log-probs in chunks of `trainer.logprob_chunk` (pace/algo/logprobs.py). On CPU (`--tiny`) the yaml's
plugin over a gloo group of one, as gpu_smoke.py does. The model is Qwen3-4B-shaped (hidden 2560,
vocabulary 151,936, tied embeddings; `--layers` of its 36), random, saved in bf16.

1. One DAPO step (`trainer.step`: forward, backward, AdamW) on one 8k / 16k / 32k-token sequence
   (256 prompt tokens): peak `torch.cuda.max_memory_allocated` beside its prediction
   (pace/algo/memory_budget.py), and seconds. A step the prediction puts above the GPU's memory
   still runs; an out-of-memory is a result.
2. Tokens per second of DAPO steps on 16k-token sequences at micro-batch budgets of 32k / 64k /
   128k / 256k tokens (`trainer.max_tokens_per_micro_batch`, one micro-batch): the largest that fits.
3. Agreement: the largest difference between the chunked and the full-vocabulary log-probs (no
   grad) on a 4,096-token row.
4. The weight sync's gather (before the steps): every parameter cast to bf16 and gathered in full
   (pace.rollout.source, as the sync streams them), against the checkpoint's bits; seconds.

Prints one JSON object per measurement, then a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_smoke  # noqa: E402  (the launcher)
import smoke_case  # noqa: E402  (the accelerator, a random batch, a timed step, the engine's view)
import smoke_setup  # noqa: E402  (the shapes, the presets' reader, the models)

PRESET = "pace_qwen3_4b"
QWEN3_4B = dict(smoke_setup.QWEN3_8B, hidden_size=2560, intermediate_size=9728, tie_word_embeddings=True)
PROMPT = 256


def plan(tiny: bool) -> dict:
    if tiny:
        return {"lengths": [384, 768], "per_seq": 384, "budgets": [768, 1536]}
    return {"lengths": [8192, 16384, 32768], "per_seq": 16384, "budgets": [32768, 65536, 131072, 262144]}


def predicted_gib(trainer, cfg, tokens: int, response: int) -> float:
    """The step's peak by pace/algo/memory_budget.py: fp32 states and the larger of the step's
    forward/backward and AdamW's foreach step."""
    from pace.algo import memory_budget as mb

    shapes = mb.Shapes.of(trainer.acc.unwrap_model(trainer.model).config)
    params = shapes.params()
    step = mb.step_bytes(shapes, tokens, response, cfg.trainer.logprob_chunk, cfg.model.dtype,
                         cfg.model.gradient_checkpointing, fsdp=True, reduce=cfg.trainer.reduce_dtype)
    states = mb.states_bytes(params, 1, 4)
    return max(states + step["total"], mb.optimizer_bytes(params, 1, 4)) / mb.GIB


def measure(trainer, batch, cuda: bool) -> dict:
    """One DAPO step: seconds and peak memory, or an out-of-memory."""
    import torch

    if cuda:
        torch.cuda.empty_cache()
    try:
        out = smoke_case.timed_step(trainer, batch, cuda)
    except torch.OutOfMemoryError:
        trainer.optimizer.zero_grad(set_to_none=True)
        return {"oom": True}
    return {"oom": False, "seconds": out["seconds"], "finite": out["finite"], **({"peak_gib": out["peak_gib"]} if cuda else {})}


def child(args) -> None:
    import torch

    from pace.algo.logprobs import response_logprobs
    from pace.algo.trainer import DAPOTrainer

    cuda = not args.tiny
    cfg = smoke_setup.trainer_config(PRESET, args.model, args.tiny)
    acc = smoke_case.accelerator(PRESET, cfg.model.dtype, args.tiny)
    trainer = DAPOTrainer(args.model, cfg, acc)
    unwrapped = acc.unwrap_model(trainer.model)
    vocab, p = unwrapped.config.vocab_size, plan(args.tiny)

    def emit(**values):
        print("BENCH " + json.dumps(values), flush=True)

    emit(setup={"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                "fsdp2": acc.is_fsdp2, "mixed": acc.mixed_precision, "layers": unwrapped.config.num_hidden_layers,
                "shards": sorted({str(q.dtype) for q in trainer.model.parameters()}), "chunk": cfg.trainer.logprob_chunk,
                "params_b": sum(q.numel() for q in trainer.model.parameters()) / 1e9})
    # the weight sync's gather first, while the weights are still the checkpoint's
    emit(what="source", **smoke_case.engine_view(trainer, args.model, cuda))
    for n in p["lengths"]:
        trainer.cfg.trainer.max_tokens_per_micro_batch = n  # the sequence in one micro-batch
        batch = smoke_case.batch_of(trainer, PROMPT, n - PROMPT, vocab)
        emit(tokens=n, predicted_gib=predicted_gib(trainer, cfg, n, n - PROMPT), **measure(trainer, batch, cuda))
        del batch
    for budget in p["budgets"]:
        rows = budget // p["per_seq"]
        trainer.cfg.trainer.max_tokens_per_micro_batch = budget  # one micro-batch of `rows` sequences
        batch = smoke_case.batch_of(trainer, PROMPT, p["per_seq"] - PROMPT, vocab, rows=rows)
        r = measure(trainer, batch, cuda)
        del batch
        emit(budget=budget, predicted_gib=predicted_gib(trainer, cfg, budget, budget - rows * PROMPT), **r,
             **({} if r["oom"] else {"tokens_per_s": budget / r["seconds"]}))
        if r["oom"]:
            break

    prompt, response = smoke_setup.TINY_AGREE_LENGTHS if args.tiny else smoke_setup.AGREE_LENGTHS
    row = smoke_case.batch_of(trainer, prompt, response, vocab, seed=2)
    b = trainer._collate([(g.prompt_ids, t) for g in row.groups for t in g.trajectories])
    trainer.model.eval()
    with torch.no_grad():
        chunked, _ = response_logprobs(trainer.model, b, 1.0, cfg.trainer.logprob_chunk, decoder=trainer._decoder, head=trainer._head)
        full, _ = response_logprobs(trainer.model, b, 1.0, None)
    trainer.model.train()
    emit(max_abs_logp_diff_chunked_vs_full=float((chunked.float() - full.float()).abs().max()), agreement_tokens=response)
    del chunked, full, b


def table(records: list[dict], setup: dict, tiny: bool) -> None:
    fmt = lambda r: "OOM | – | –" if r["oom"] else (  # noqa: E731
        f"{r.get('peak_gib', math.nan):.1f} | {r['predicted_gib']:.1f} | {r['seconds']:.2f}")
    print(f"\n{setup['device']}, Qwen3-{'tiny' if tiny else '4B'}-shaped ({setup['params_b']:.2f} B parameters, "
          f"{setup['layers']} layers), the {PRESET} trainer: FSDP2 {setup['fsdp2']}, mixed {setup['mixed']}, "
          f"shards {setup['shards']}, logprob_chunk {setup['chunk']}\n")
    print("| tokens | peak GiB | predicted GiB | s |\n|---|---|---|---|")
    for r in records:
        if "tokens" in r:
            print(f"| {r['tokens']:,} | {fmt(r)} |")
    fitting = [r for r in records if "budget" in r and not r["oom"]]
    if fitting:
        best = fitting[-1]
        print(f"\nDAPO steps on {plan(tiny)['per_seq']:,}-token sequences: {best['tokens_per_s']:,.0f} tokens/s at a {best['budget']:,}-token "
              f"micro-batch (peak {best.get('peak_gib', math.nan):.1f} GiB, predicted {best['predicted_gib']:.1f}; "
              f"the largest that fit of {[r['budget'] for r in records if 'budget' in r]})")
    for r in records:
        if "max_abs_logp_diff_chunked_vs_full" in r:
            print(f"chunked vs full log-probs on {r['agreement_tokens']:,} response tokens: max |difference| "
                  f"{r['max_abs_logp_diff_chunked_vs_full']:.2e}")
        if r.get("what") == "source":
            print(f"weight sync's gather (bf16, one process): {r['seconds']:.2f} s for {r['gib']:.1f} GiB, "
                  f"bits equal to the checkpoint: {r['bits_equal']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU, a tiny model and short sequences (a smoke test)")
    ap.add_argument("--layers", type=int, default=36, help="decoder layers of the Qwen3-4B-shaped model (of 36)")
    ap.add_argument("--work", help="folder for the model (default: a new temporary one)")
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model:
        return child(args)
    import torch

    if not args.tiny and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --tiny on CPU")
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_trainer_"))
    try:
        model = smoke_setup.write_model(work / "qwen3_4b", {**QWEN3_4B, **(smoke_setup.TINY if args.tiny else {})},
                                      2 if args.tiny else args.layers, args.tiny)
        t0 = time.perf_counter()
        out = gpu_smoke.run_child(Path(__file__).resolve(), ["--model", str(model)] + (["--tiny"] if args.tiny else []),
                                  args.tiny, "bf16", "BENCH ")
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    if any("failed" in r for r in out):
        sys.exit(f"the trainer's process failed ({out[-1]['failed']})")
    setup = next(r["setup"] for r in out if "setup" in r)
    table([r for r in out if "setup" not in r], setup, args.tiny)
    print(f"\n{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
