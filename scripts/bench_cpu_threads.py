"""Generation and training sharing a CPU in one process: each alone vs both at once, per thread-binding mode.

    python scripts/bench_cpu_threads.py [--seconds 20]

For each `rollout.cpu_threads_bind` mode (`nobind`: one OpenMP thread each, the default; `auto`:
vLLM's own core binding) a child process builds the tiny model's engine and trainer, then measures
generation tokens/s alone, training steps/s alone, and both concurrently (generation on a thread,
as the rollout does), and prints how much of its solo speed each keeps.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(mode: str, seconds: float) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = mode
    if mode == "nobind":
        os.environ["OMP_NUM_THREADS"] = "1"
    sys.path.insert(0, str(ROOT))
    import torch
    from accelerate import Accelerator
    from omegaconf import OmegaConf
    from vllm import SamplingParams

    from pace.algo.trainer import DAPOTrainer
    from pace.config import Config
    from pace.placement import Placement
    from pace.records import Batch, Group, Trajectory
    from pace.rollout.engine import build_engine
    from pace.tiny import TinySpec, build_tiny

    cfg = OmegaConf.structured(Config)
    path = str(build_tiny(TinySpec(), ROOT / cfg.model.cache_dir, progress=False))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = build_engine(path, cfg.rollout, "float32", seed=0, backend=Placement.of(cfg.rollout, device, 1).transfer)
    trainer = DAPOTrainer(path, cfg, Accelerator(cpu=True))
    prompt = llm.get_tokenizer()("12+345+67=?\n", add_special_tokens=False).input_ids
    params = SamplingParams(max_tokens=48, ignore_eos=True, temperature=1.0, logprobs=0, detokenize=False)
    gen = torch.Generator().manual_seed(0)
    groups = [Group(i, str(i), prompt, "0", 0, [
        Trajectory(torch.randint(3, 100, (40,), generator=gen).tolist(), [-1.0] * 40, [0] * 40, 0, "stop",
                   advantage=float(j % 2) - 0.5) for j in range(8)]) for i in range(32)]
    batch = Batch(0, groups)
    stop = threading.Event()
    counts = {"tokens": 0, "steps": 0}

    def generate(set_threads: bool):
        if set_threads and mode == "nobind":
            torch._C.set_num_threads(1)  # as the rollout thread does
        n = 0
        while not stop.is_set():
            for i in range(64):
                llm.llm_engine.add_request(f"b{n}-{i}", {"prompt_token_ids": prompt}, params)
            n += 1
            while llm.llm_engine.has_unfinished_requests():
                for out in llm.llm_engine.step():
                    counts["tokens"] += len(out.outputs[0].token_ids) if out.finished else 0

    def train():
        while not stop.is_set():
            trainer.step(batch)
            counts["steps"] += 1

    def timed(fns):
        stop.clear()
        counts.update(tokens=0, steps=0)
        threads = [threading.Thread(target=f) for f in fns[1:]]
        for t in threads:
            t.start()
        t0 = time.perf_counter()
        timer = threading.Timer(seconds, stop.set)
        timer.start()
        fns[0]()
        for t in threads:
            t.join()
        dt = time.perf_counter() - t0
        return counts["tokens"] / dt, counts["steps"] / dt

    timed([lambda: generate(False)])  # warm-up (kernels, caches)
    gen_alone, _ = timed([lambda: generate(False)])
    _, train_alone = timed([train])
    gen_both, train_both = timed([train, lambda: generate(True)])
    return {"mode": mode, "gen_tok_s": gen_alone, "train_steps_s": train_alone,
            "gen_tok_s_both": gen_both, "train_steps_s_both": train_both}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--child", choices=["nobind", "auto"])
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.seconds)), flush=True)
        os._exit(0)  # skip slow engine teardown
    print(f"{'binding':<8}{'gen tok/s alone':>17}{'both':>9}{'kept':>7}{'train step/s alone':>20}{'both':>9}{'kept':>7}")
    for mode in ("nobind", "auto"):
        proc = subprocess.run([sys.executable, __file__, "--child", mode, "--seconds", str(args.seconds)],
                              capture_output=True, text=True)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            print(f"{mode:<8} failed:\n{proc.stderr[-2000:]}")
            continue
        r = json.loads(line[7:])
        print(f"{mode:<8}{r['gen_tok_s']:>17.0f}{r['gen_tok_s_both']:>9.0f}{r['gen_tok_s_both'] / r['gen_tok_s']:>7.0%}"
              f"{r['train_steps_s']:>20.2f}{r['train_steps_s_both']:>9.2f}{r['train_steps_s_both'] / r['train_steps_s']:>7.0%}")


if __name__ == "__main__":
    main()
