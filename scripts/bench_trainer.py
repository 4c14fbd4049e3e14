"""The trainer's host memory and time per update on CPU with a large vocabulary, old vs new
log-prob path.

    python scripts/bench_trainer.py                        # 2k, 4k, 8k tokens
    python scripts/bench_trainer.py --lengths 2048 4096

A tiny Qwen3 (2 layers, hidden 64) with Qwen3's vocabulary of 151,936, random init, float32: the
model is small, so the log-prob computation is what the memory measures. One update = forward,
backward and an AdamW step on one sequence (256 prompt tokens, the rest response), with
- new: pace.algo.logprobs (response positions only, `--chunk` positions at a time, recomputed in
  backward), as the trainer runs it now;
- old: full-vocabulary float32 logits of every position, `log_softmax`, entropy from its `exp`
  (the trainer's earlier path; `full_logprobs` is that function).
Each (path, length) runs in a process of its own, one after the other, so its peak resident
size (VmHWM) is its own; printed side by side: peak RSS, its rise over the process with the model
built, and seconds per update (median of 3 after a warm-up). A run whose rise, extrapolated
linearly from the previous length, would not fit in 90% of the available memory is not started
(the old path needs ~3 MB per token at this vocabulary). Measure with nothing else running.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def _hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("inf")


def one(path: str, tokens: int, chunk: int) -> dict:
    import bench_trainer_gpu as core
    import torch

    torch.set_num_threads(2)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**dict(core.TINY, vocab_size=151_936))  # the tiny model with Qwen3's vocabulary
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).float()
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = core.sequences(1, tokens, cfg.vocab_size, "cpu")
    base = _hwm_mib()
    times = []
    for i in range(4):
        t0 = time.perf_counter()
        logp, _ = core.logprobs(model, batch, path, chunk)
        (-(logp.sum()) / logp.numel()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i > 0:  # the first is a warm-up
            times.append(time.perf_counter() - t0)
    return {"path": path, "tokens": tokens, "base_mib": base, "peak_mib": _hwm_mib(), "seconds": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--chunk", type=int, default=1024, help="trainer.logprob_chunk of the new path")
    ap.add_argument("--one", nargs=2, metavar=("PATH", "TOKENS"), help=argparse.SUPPRESS)  # a child's job
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one[0], int(args.one[1]), args.chunk)))
        return
    results = {}
    for n in args.lengths:
        for path in ("new", "old"):
            prev = [r for (p, m), r in results.items() if p == path and r is not None]
            if prev:  # the rise grows linearly with the tokens: do not start a run the machine cannot hold
                need = (prev[-1]["peak_mib"] - prev[-1]["base_mib"]) * n / prev[-1]["tokens"] + prev[-1]["base_mib"]
                if need > 0.9 * _available_mib():
                    results[path, n] = {"skipped_mib": need}
                    print(f"{path} at {n} tokens: skipped, needs ~{need:,.0f} MiB, {_available_mib():,.0f} available",
                          file=sys.stderr)
                    continue
            proc = subprocess.run([sys.executable, __file__, "--one", path, str(n), "--chunk", str(args.chunk)],
                                  capture_output=True, text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:  # killed for memory is a result too
                results[path, n] = None
                print(f"{path} at {n} tokens: exit {proc.returncode} {proc.stderr[-300:]}", file=sys.stderr)
            else:
                results[path, n] = json.loads(line[len("RESULT "):])
            print(json.dumps({"path": path, "tokens": n, "result": results[path, n]}), file=sys.stderr)
    print(f"\nCPU, tiny Qwen3 (2 layers, hidden 64) with vocabulary 151,936, float32, one sequence per update, "
          f"logprob_chunk {args.chunk}\n")
    print("| tokens | old: peak RSS MiB (rise) | old: s/update | new: peak RSS MiB (rise) | new: s/update | peak rise old/new |")
    print("|---|---|---|---|---|---|")
    for n in args.lengths:
        old, new = results["old", n], results["new", n]
        rise = lambda r: r["peak_mib"] - r["base_mib"]  # noqa: E731

        def cell(r):
            if r is None:
                return "failed | –"
            if "skipped_mib" in r:
                return f"not run: needs ~{r['skipped_mib']:,.0f} (extrapolated) | –"
            return f"{r['peak_mib']:,.0f} ({rise(r):+,.0f}) | {r['seconds']:.2f}"

        measured = old is not None and new is not None and "peak_mib" in old and "peak_mib" in new
        ratio = f"{rise(old) / max(rise(new), 1):.1f}x" if measured else "–"
        print(f"| {n:,} | {cell(old)} | {cell(new)} | {ratio} |")


if __name__ == "__main__":
    main()
