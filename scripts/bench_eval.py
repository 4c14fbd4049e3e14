"""eval.py's throughput against plain `LLM.generate` on the same prompts and engine.

    python scripts/bench_eval.py                       # tiny model, arithmetic val split, k = 8
    python scripts/bench_eval.py --k 32 --repeats 3

One engine, one prompt list: `LLM.generate(prompts, SamplingParams(n=k))` (no grading), then
`pace.evaluation.evaluate` (the eval loop: the same requests, stepped by hand, each finished
problem graded in the process pool while generation goes on), alternating, `--repeats` times
each after a warm-up. Prints problems per second and the ratio (target: at least 0.90).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--problems", type=int, default=200, help="arithmetic val problems (all four levels)")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    from omegaconf import OmegaConf

    from pace.config import Config
    from pace.rollout import engine as engine_lib

    cfg = OmegaConf.structured(Config)
    cfg.data.arithmetic.n_val = args.problems
    engine_lib.configure_environment(cfg.rollout, "cpu")
    import torch
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from pace import evaluation
    from pace.grading import Grader
    from pace.placement import Placement
    from pace.tiny import TinySpec, build_tiny

    model = str(build_tiny(TinySpec(), ROOT / "data" / "cache", progress=True))
    sets = evaluation.load_sets(["arithmetic"], None, "dapo", OmegaConf.to_object(cfg.data.arithmetic))
    prompts = [p for ps in sets.values() for p in ps]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    placement = Placement.of(cfg.rollout, device, 1)  # the engine's weight-transfer backend, as eval.py's
    llm = engine_lib.build_engine(model, cfg.rollout, cfg.model.dtype, cfg.seed, backend=placement.transfer)
    kw = dict(n=args.k, max_tokens=cfg.rollout.max_tokens, temperature=1.0, top_p=1.0)
    plain = SamplingParams(**kw)
    final = SamplingParams(**kw, output_kind=RequestOutputKind.FINAL_ONLY)
    times: dict[str, list[float]] = {"LLM.generate": [], "evaluate (with grading)": []}
    with Grader(workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s * 8) as grader:  # as eval.py
        llm.generate([p.text for p in prompts[:20]], plain, use_tqdm=False)  # warm-up
        for r in range(args.repeats):
            t0 = time.perf_counter()
            llm.generate([p.text for p in prompts], plain, use_tqdm=False)
            times["LLM.generate"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            results = evaluation.evaluate(llm.llm_engine, sets, final, grader, progress=False, request_prefix=f"b{r}")
            times["evaluate (with grading)"].append(time.perf_counter() - t0)
    engine_lib.shutdown(llm)
    n = len(prompts)
    print(f"{n} problems × k = {args.k}, {args.repeats} repeats each, median; threads: OMP {os.environ.get('OMP_NUM_THREADS')}")
    rate = {name: n / statistics.median(ts) for name, ts in times.items()}
    for name, r in rate.items():
        print(f"{name:<26}{r:8.1f} problems/s   ({', '.join(f'{t:.1f}' for t in times[name])} s)")
    print(f"ratio evaluate / LLM.generate: {rate['evaluate (with grading)'] / rate['LLM.generate']:.3f}")
    print(f"last eval mean@{args.k}: {evaluation.summarize(results)['avg']:.3f}")


if __name__ == "__main__":
    main()
