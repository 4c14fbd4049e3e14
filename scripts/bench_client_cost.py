"""What the rollout client costs rank 0's process per token, on every engine path, at GPU token rates
— and what that does to a trainer thread sharing its GIL.

    python scripts/bench_client_cost.py [--paths inproc child servers] [--rates 10000 33000 60000 100000]
                                        [--engines 4] [--seconds 8] [--max-tokens 1024]

The engines are synthetic (scripts/client_feed.py): each emits one token per running request per
step at a set rate, in vLLM's own types, so the client side runs as in a run whatever this
machine's engine could compute: the run's `RolloutWorker` thread (admission, `Trajectory.extend`,
weight-version spans, grading, the pool) on an `EngineFleet` of in-process or child engines or a
`RemoteFleet` of servers. Per path and rate, in one window each:
- **client CPU-µs per token**: CPU time of this process's threads other than the trainer's and the
  main thread's (the rollout thread; vLLM's output-receiving thread of child engines; the HTTP
  client's event loop), over the tokens recorded; the in-process stand-in core's own work (what
  vLLM's scheduler does after a step) is left out and shown apart;
- **delivered**: tokens/s recorded over the rate set (1.00: the client keeps up);
- **trainer slowdown**: a stand-in trainer thread's time per step beside the client over alone,
  for two trainers: ``gil=1`` holds the GIL all the time (a step bound by Python dispatch, the
  worst case) and ``gil=0.1`` holds it 10% (100 µs of dispatch, then 900 µs waiting on the device
  with the GIL released: a thousand GIL hand-backs a second).
PACE scoring is measured apart: prefix-rescoring requests (prompt + ``pace.prefix_tokens``) through
the worker's own rescoring code, CPU-µs per request and per prompt log-prob position.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def _cfg(args):
    from hydra import compose, initialize_config_dir

    from pace.config import register

    register()
    inflight = -(-args.engines * args.max_running // args.group_size)  # enough groups to fill every engine
    # K through the run's own key (its requests ask for it); left out at 1, for code from before the key
    k = [f"rollout.stream_interval={args.stream_interval}"] if args.stream_interval > 1 else []
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="config", overrides=[
            "+exp=async_tiny", f"data.group_size={args.group_size}", f"rollout.max_tokens={args.max_tokens}",
            f"rollout.max_inflight_groups={inflight}", f"rollout.engines={args.engines}", "eval.every=0",
            "eval.at_start=false", *k])


class GcClock:
    """Seconds spent in the garbage collector (every thread's collections)."""

    def __init__(self):
        self.total, self._t0 = 0.0, 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase, info) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._t0


class StandInTrainer:
    """A trainer thread: periods of ``period`` s, each ``gil`` of it dispatching small torch ops (the
    GIL held) and the rest waiting with the GIL released (a device computing)."""

    def __init__(self, gil: float, period: float = 0.001):
        import torch

        self.x, self.gil, self.period = torch.zeros(4), gil, period
        n, t0 = 2000, time.perf_counter()
        self._ops(n)
        self.n = max(1, round(n * gil * period / (time.perf_counter() - t0)))  # ops per period

    def _ops(self, n: int) -> None:
        x = self.x
        for _ in range(n):
            x.add_(1.0)

    def run(self, seconds: float) -> tuple[float, int]:
        """Seconds per period, measured over ``seconds``; and the thread's native id."""
        out = {}

        def loop():
            out["tid"] = threading.get_native_id()
            t0, k = time.perf_counter(), 0
            while time.perf_counter() - t0 < seconds:
                self._ops(self.n)
                if self.gil < 1:
                    time.sleep(self.period * (1 - self.gil))
                k += 1
            out["per"] = (time.perf_counter() - t0) / k

        th = threading.Thread(target=loop, name="trainer")
        th.start()
        th.join()
        return out["per"], out["tid"]


def thread_cpu() -> dict[int, float]:
    import psutil

    return {t.id: t.user_time + t.system_time for t in psutil.Process().threads()}


def window(worker, fleet_core, seconds: float, trainer: StandInTrainer | None, gc_clock: GcClock, reader_s=lambda: 0.0) -> dict:
    """One measurement window: client CPU, tokens, GC; the trainer's time per period if one runs;
    the stream reader's process's CPU."""
    c0, tok0, g0, core0, t0 = thread_cpu(), worker.stats["tokens"], gc_clock.total, fleet_core(), time.perf_counter()
    r0 = reader_s()
    res = {}
    if trainer is not None:
        res["period"], tid = trainer.run(seconds)
    else:
        time.sleep(seconds)
        tid = None
    c1, wall = thread_cpu(), time.perf_counter() - t0
    skip = {threading.main_thread().native_id, tid}
    cpu = sum(v - c0.get(k, 0.0) for k, v in c1.items() if k not in skip)
    core = fleet_core() - core0
    tokens = worker.stats["tokens"] - tok0
    res.update(tokens=tokens, wall=wall, rate=tokens / wall, client_s=cpu - core, core_s=core,
               rollout_s=c1.get(worker.native_id, 0) - c0.get(worker.native_id, 0) - core, gc_s=gc_clock.total - g0,
               reader_s=reader_s() - r0)
    return res


def build_fleet(path: str, args, cfg, base_engine, tokenizer):
    """The fleet for ``path``, its rate setter, its stand-in core seconds, and its shutdown."""
    import requests

    import client_feed

    if path in ("inproc", "child"):
        from pace.rollout.fleet import EngineFleet

        feed = client_feed.FeedEngines(base_engine, args.engines, path, None, args.max_running, cores=args.feed_cores)
        fleet = EngineFleet(feed.llms)
        assert fleet.in_process == (path == "inproc")
        return fleet, feed.set_rate, feed.core_seconds, feed.shutdown, lambda: 0.0
    from pace.rollout.remote import RemoteFleet

    urls, procs = client_feed.start_servers(args.engines, None, args.max_running, cores=args.feed_cores)
    # the streams read in a child (rollout.stream_reader=process) or on this process's loop (thread; code
    # from before the key knows no other)
    import inspect

    if "stream_reader" in inspect.signature(RemoteFleet).parameters:
        fleet = RemoteFleet(urls, tokenizer, "cpu", None, stream_reader=args.stream_reader)
    elif args.stream_reader == "thread":
        fleet = RemoteFleet(urls, tokenizer, "cpu", None)
    else:
        raise SystemExit("--stream-reader process: this code's RemoteFleet reads its streams on its own loop only")
    reader = getattr(fleet, "_streams", None)
    if reader is not None and args.feed_cores:
        os.sched_setaffinity(reader.process.pid, args.feed_cores)  # off rank 0's core, as on a GPU node's

    def set_rate(rate):
        for u in urls:
            requests.post(u + "/pace_bench_rate", json={"rate": (rate / len(urls)) if rate else 0}, timeout=10)

    def shutdown():
        fleet.shutdown()
        for p in procs:
            p.kill()

    def reader_s():
        import psutil

        if reader is None:
            return 0.0
        t = psutil.Process(reader.process.pid).cpu_times()
        return t.user + t.system

    return fleet, set_rate, lambda: 0.0, shutdown, reader_s


def make_worker(fleet, cfg, tokenizer):
    from pace.grading import Grader
    from pace.pool import Pool, build_policy
    from pace.rollout.worker import RolloutWorker
    from pace.tasks.arithmetic import ArithmeticSpec, make_prompts
    from pace.tasks.base import PromptSampler

    pool = Pool(build_policy(cfg), informative=lambda g: True)
    sampler = PromptSampler(make_prompts(ArithmeticSpec(levels=[4]), "train"), seed=0)
    grader = Grader(workers=1)
    return RolloutWorker(fleet, tokenizer, sampler, pool, grader=grader, cfg=cfg), grader


def scoring_groups(n: int, g: int, prompt_tokens: int, m: int, first_id: int):
    """Pooled groups to rescore: every prefix token from an older version (each response scored)."""
    import numpy as np

    from pace.records import Group, Trajectory

    groups = []
    for k in range(n):
        group = Group(id=first_id + k, prompt_id=f"s{k}", prompt_ids=[5 + (i % 90) for i in range(prompt_tokens)], answer="0", submitted_at=0)
        group.trajectories = [Trajectory(np.arange(m) % 90 + 5, np.full(m, -0.3, np.float32), np.full(m, -1, np.int32))
                              for _ in range(g)]
        groups.append(group)
    return groups


def measure_scoring(worker, args, seconds: float) -> dict:
    """Prefix rescoring alone (before any generation): jobs kept pending through the worker's own code."""
    assert worker.pool.inflight == 0
    worker.prefix_tokens = args.prefix_tokens
    next_id = [10**7]

    def refill():
        if len(worker._rescoring) < args.score_groups:
            worker._rescore(scoring_groups(args.score_groups, args.group_size, args.prompt_tokens, args.prefix_tokens, next_id[0]))
            next_id[0] += args.score_groups

    t_end, c0, s0, t0 = time.perf_counter() + seconds, thread_cpu(), worker.stats["rescore_seqs"], time.perf_counter()
    while time.perf_counter() < t_end:
        future = worker.call(refill)
        while not future.done():
            worker.check()  # the rollout thread's error, if it failed
            time.sleep(0.01)
        future.result()
        time.sleep(0.02)
    worker.call(worker._cancel_rescoring).result(30)
    worker.prefix_tokens = 0
    c1, wall = thread_cpu(), time.perf_counter() - t0
    seqs = worker.stats["rescore_seqs"] - s0 - (len(worker._rescoring) * args.group_size)
    cpu = sum(v - c0.get(k, 0.0) for k, v in c1.items() if k != threading.main_thread().native_id)
    return dict(seqs=seqs, per_s=seqs / wall, us_per_seq=1e6 * cpu / max(seqs, 1),
                us_per_position=1e6 * cpu / max(seqs, 1) / (args.prompt_tokens + args.prefix_tokens - 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paths", nargs="+", default=["inproc", "child", "servers"])
    ap.add_argument("--rates", nargs="+", type=float, default=[10000, 33000, 60000, 100000])
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--max-running", type=int, default=384, help="requests per engine per step (the 8B presets' max_num_seqs)")
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=3400,
                    help="responses' lengths are uniform in [1, this]: mean ~1.7k tokens, the paper's 8B responses")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--gil", nargs="+", type=float, default=[1.0, 0.1], help="stand-in trainers' GIL shares")
    ap.add_argument("--prompt-tokens", type=int, default=180, help="scoring: the prompt (the 8B scenario's median)")
    ap.add_argument("--prefix-tokens", type=int, default=16, help="scoring: pace.prefix_tokens")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="rollout.stream_interval: tokens a request's outputs carry (vLLM's per-request stream_interval)")
    ap.add_argument("--stream-reader", choices=["thread", "process"], default="process",
                    help="servers: rollout.stream_reader (process: the streams read in a child process)")
    ap.add_argument("--pin", action="store_true",
                    help="this process on CPU 0, the stand-in cores and servers on the others (the slowdown without core contention)")
    ap.add_argument("--gc-freeze", action="store_true", help="every path with rank 0's heap frozen after set-up")
    ap.add_argument("--gc-threshold", type=int, default=None, help="gc.set_threshold's first generation (Python's default 700)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for this process (s; Python's default 0.005)")
    ap.add_argument("--score-groups", type=int, default=8, help="scoring: groups pending at once")
    args = ap.parse_args()

    args.feed_cores = None
    if args.pin:  # (its grading workers, started from it, stay on CPU 0 too)
        args.feed_cores = set(range(1, os.cpu_count())) or None
        os.sched_setaffinity(0, {0})
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if args.gc_threshold is not None:
        gc.set_threshold(args.gc_threshold, *gc.get_threshold()[1:])
    cfg = _cfg(args)
    from pace.rollout import engine as engine_lib

    engine_lib.configure_environment(cfg.rollout, "cpu")
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from pace.tiny import build_tiny

    torch.set_num_threads(1)
    path = str(build_tiny(OmegaConf.to_object(cfg.model.tiny), ROOT / cfg.model.cache_dir, progress=True))
    tokenizer = AutoTokenizer.from_pretrained(path)
    base = engine_lib.build_engine(path, cfg.rollout, cfg.model.dtype, cfg.seed, mode="inproc", backend=None)
    torch._C.set_num_threads(1)
    gc_clock = GcClock()
    trainers = {g: StandInTrainer(g) for g in args.gil}
    alone = {g: trainers[g].run(args.seconds)[0] for g in args.gil}
    print(f"pinned: {bool(args.pin)}; stream interval {args.stream_interval}, GC thresholds {gc.get_threshold()}, switch interval "
          f"{sys.getswitchinterval() * 1e3:g} ms; engines {args.engines} × {args.max_running} running, "
          f"responses 1-{args.max_tokens} tokens, G={args.group_size}; windows {args.seconds:.0f} s; "
          f"trainer alone: " + ", ".join(f"gil={g}: {1e3 * p:.3f} ms/period" for g, p in alone.items()), flush=True)
    print(f"servers' streams read by: {args.stream_reader}", flush=True)
    print("| path | rate set | delivered | client CPU-µs/token | (rollout thread) | GC ms/s | stand-in core µs/token | "
          "stream reader process µs/token | "
          + " | ".join(f"trainer slowdown gil={g}" for g in args.gil) + " |", flush=True)
    scoring = {}
    for p in args.paths:
        # vLLM's engine core freezes the garbage collector's heap where it starts (vllm/utils/gc_utils.py,
        # `freeze_gc_heap`): in this process for an in-process engine, in their own for the others
        gc.freeze() if p == "inproc" or args.gc_freeze else gc.unfreeze()
        print(f"| {p}: {len(gc.get_objects()):,} objects tracked by the GC, {gc.get_freeze_count():,} frozen | |", flush=True)
        fleet, set_rate, core_s, shutdown, reader_s = build_fleet(p, args, cfg, base.llm_engine, tokenizer)
        worker, grader = make_worker(fleet, cfg, tokenizer)
        try:
            set_rate(args.rates[0])
            inflight, worker.pool.policy.max_inflight_groups = worker.pool.policy.max_inflight_groups, 0
            worker.start()
            scoring[p] = measure_scoring(worker, args, args.seconds)
            worker.pool.policy.max_inflight_groups = inflight  # generation from here on
            for rate in args.rates:
                set_rate(rate)
                time.sleep(args.warmup)
                w = window(worker, core_s, args.seconds, None, gc_clock, reader_s)
                slow = [window(worker, core_s, args.seconds, trainers[g], gc_clock)["period"] / alone[g] - 1 for g in args.gil]
                worker.check()
                print(f"| {p} | {rate:,.0f} | {w['rate'] / rate:.2f} | {1e6 * w['client_s'] / w['tokens']:.1f} | "
                      f"{1e6 * w['rollout_s'] / w['tokens']:.1f} | {1e3 * w['gc_s'] / w['wall']:.0f} | "
                      f"{1e6 * w['core_s'] / w['tokens']:.1f} | {1e6 * w['reader_s'] / w['tokens']:.1f} | " + " | ".join(f"{100 * s:+.1f}%" for s in slow) + " |", flush=True)
        finally:
            worker.stop()
            grader.close()
            shutdown()
            del worker, fleet, set_rate, core_s, shutdown, reader_s  # and what they hold: each path starts from the same heap
            gc.collect()
    print(f"\nPACE scoring (prompt {args.prompt_tokens} + prefix {args.prefix_tokens} tokens a request, "
          f"{args.score_groups} groups × {args.group_size} pending, no generation; the rate of the first window):")
    for p, s in scoring.items():
        print(f"  {p:8s} {s['per_s']:8.0f} requests/s   {s['us_per_seq']:8.0f} CPU-µs a request   "
              f"{s['us_per_position']:6.2f} CPU-µs a prompt log-prob position")
    engine_lib.shutdown(base)


if __name__ == "__main__":
    main()
