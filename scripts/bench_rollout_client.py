"""The rollout client's cost: its tokens/s against the raw engine's on the same requests, in host and
through a server, alone and beside a training loop.

    python scripts/bench_rollout_client.py [--groups 32] [--repeats 3] [--max-tokens 96]

Ways, each on the same requests (the tiny model, G = 8 responses per prompt, `ignore_eos` so every
way generates exactly groups × G × max_tokens tokens):
- raw: vLLM's `LLMEngine` in this process, stepped in a loop, outputs read and dropped;
- inhost: the run's `EngineFleet` around the same kind of engine, every token recorded as the rollout
  thread records it (`Trajectory.extend`: id, ℓ^μ, version);
- remote: `RemoteFleet` to one vLLM server on 127.0.0.1 (its own processes), the same record.
"beside training": the way runs on a thread while the main thread trains the tiny model (forward,
backward, AdamW on a fixed batch); both sides' rates are printed against their rates alone. On a
machine with few cores the engine and the trainer share them, so "beside" mixes core contention
with the client's Python work (the GIL); compare the ways with each other, not with 1.0.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _cfg():
    from hydra import compose, initialize_config_dir

    from pace.config import register

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="config", overrides=["+exp=async_tiny"])


def _requests(tokenizer, groups: int):
    prompts = [f"Q: {a}+{b}=? A:" for a, b in zip(range(11, 11 + groups), range(50, 50 + groups))]
    return [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]


def _params(max_tokens: int):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(max_tokens=max_tokens, temperature=1.0, logprobs=0, ignore_eos=True, detokenize=False,
                          output_kind=RequestOutputKind.DELTA)


def run_raw(llm, prompts, params, g: int) -> int:
    from pace.rollout import request_ids

    engine = llm.llm_engine
    for p, ids in enumerate(prompts):
        for i in range(g):
            engine.add_request(request_ids.response(p, i), {"prompt_token_ids": ids}, params)
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += sum(len(c.token_ids) for c in out.outputs)
    return tokens


def run_fleet(fleet, prompts, params, g: int) -> int:
    from pace.records import Trajectory
    from pace.rollout import request_ids

    trajs = {}
    for p, ids in enumerate(prompts):
        for i in range(g):
            rid = request_ids.response(p, i)
            trajs[rid] = Trajectory()
            fleet.add_request(rid, {"prompt_token_ids": ids, "cache_salt": "bench"}, params,
                              group=request_ids.group_key(request_ids.RESPONSE, p))
    tokens = 0
    while fleet.has_unfinished_requests():
        for out in fleet.step():
            for comp in out.outputs:  # as GenerationMixin._consume records them
                trajs[out.request_id].extend(comp.token_ids, [lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs)], 0)
                tokens += len(comp.token_ids)
    return tokens


class Trainer:
    """The tiny model trained on a fixed batch, step after step (the trainer side of a run, minus the run)."""

    def __init__(self, model_path: str):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-6)
        self.batch = torch.randint(5, 100, (32, 128))

    def step(self) -> None:
        loss = self.model(self.batch, labels=self.batch).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def rate(self, seconds: float, stop: threading.Event | None = None) -> float:
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds and not (stop is not None and stop.is_set()):
            self.step()
            n += 1
        return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--no-training", action="store_true", help="the ways alone only")
    args = ap.parse_args()

    cfg = _cfg()
    from pace.rollout import engine as engine_lib

    engine_lib.configure_environment(cfg.rollout, "cpu")
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from pace.placement import Placement
    from pace.rollout import server
    from pace.rollout.fleet import EngineFleet
    from pace.rollout.remote import RemoteFleet
    from pace.tiny import build_tiny

    torch.set_num_threads(cfg.trainer.cpu_threads)
    path = str(build_tiny(OmegaConf.to_object(cfg.model.tiny), ROOT / cfg.model.cache_dir, progress=True))
    tok = AutoTokenizer.from_pretrained(path)
    prompts, params, g = _requests(tok, args.groups), _params(args.max_tokens), cfg.data.group_size
    expected = args.groups * g * args.max_tokens

    llm = engine_lib.build_engine(path, cfg.rollout, cfg.model.dtype, cfg.seed, mode="inproc", backend=None)
    torch._C.set_num_threads(cfg.rollout.cpu_threads)
    one = OmegaConf.merge(cfg, {"rollout": {"engines": 1}})
    local = server.launch_local(path, one, Placement.of(one.rollout, "cpu", world=1),
                                Path(os.environ.get("TMPDIR", "/tmp")) / "bench_rollout_client", transfer=False)
    remote = RemoteFleet([s.url for s in local], tok, "cpu", local)
    ways = {"raw": lambda: run_raw(llm, prompts, params, g), "inhost": lambda: run_fleet(EngineFleet([llm]), prompts, params, g),
            "remote": lambda: run_fleet(remote, prompts, params, g)}
    try:
        for fn in ways.values():  # warm-up: caches, first-call costs
            fn()
        alone = {name: [] for name in ways}
        for _ in range(args.repeats):  # interleaved, so drift affects every way alike
            for name, fn in ways.items():
                t0 = time.perf_counter()
                n = fn()
                assert n == expected, (name, n, expected)
                alone[name].append(n / (time.perf_counter() - t0))
        print(f"{expected} tokens per repeat ({args.groups} groups × G={g} × {args.max_tokens}), median of {args.repeats}")
        raw = statistics.median(alone["raw"])
        for name, rates in alone.items():
            print(f"  alone   {name:7s} {statistics.median(rates):8.0f} tokens/s   {statistics.median(rates) / raw:5.2f} × raw")
        if args.no_training:
            return
        torch._C.set_num_threads(cfg.trainer.cpu_threads)  # OpenMP threads are per thread: the trainer's here
        trainer = Trainer(path)
        trainer.rate(2.0)  # warm-up
        base = trainer.rate(10.0)
        print(f"  trainer alone {base:.2f} steps/s")
        for name, fn in ways.items():
            rates, stop = [], threading.Event()

            def client():
                torch._C.set_num_threads(cfg.rollout.cpu_threads)  # as the rollout thread sets its own
                while not stop.is_set():
                    t0 = time.perf_counter()
                    n = fn()
                    rates.append(n / (time.perf_counter() - t0))

            th = threading.Thread(target=client, daemon=True)
            th.start()
            steps = trainer.rate(15.0)
            stop.set()
            th.join()
            print(f"  beside  {name:7s} {statistics.median(rates):8.0f} tokens/s   {statistics.median(rates) / raw:5.2f} × raw alone;"
                  f"  trainer {steps:.2f} steps/s = {steps / base:.2f} × alone")
    finally:
        remote.shutdown()
        engine_lib.shutdown(llm)


if __name__ == "__main__":
    main()
