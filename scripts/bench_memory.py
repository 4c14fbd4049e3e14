"""Host memory of the pool: bytes per pooled token, and `pool.capacity` keeping the
resident size flat when production outruns training.

    python scripts/bench_memory.py --records-only           # bytes per pooled token, seconds
    python scripts/bench_memory.py                          # and 150 steps, capacity 256 vs no capacity
    python scripts/bench_memory.py --steps 400 --capacity 128
    python scripts/bench_memory.py -- rollout.max_tokens=192   # extra overrides for both runs

Bytes per pooled token: the same groups built twice, as the per-token record was before
(a dataclass of Python lists, `ListTrajectory` below: an int, a float and an int per token;
its decoded `text` left empty, so "before" is a lower bound) and as it is now (`Trajectory`, one
NumPy structured array, streamed in engine-sized chunks and trimmed at the end), each measured by
`tracemalloc` (every allocation the groups hold, per-trajectory overhead included) and divided by
the response tokens (the groups' prompts included in the bytes). Two regimes: the tiny lab's
(G = 8, 10–120 tokens, 12-token prompts, vocabulary 128: its token ids are cached small ints) and
the 8B presets' (G = 16, log-normal lengths of median 3k capped at 20,480, 150-token prompts,
vocabulary 151,936). Each response also costs a fixed ~240 bytes (its object 120, its array's
header 120) and each group ~550 (the Group, its prompt-id list, its trajectory list and dicts): at
the tiny lab's 65 tokens a response that is ~4.8 bytes a token on top of the record's 13, which is
why the tiny regime stays above 16 where the 8B presets' lengths (which set the pool's host memory)
are at ~13.

Runs the same async tiny run twice, one after the other: with `pool.capacity=<C>` and with no cap
(`pool.capacity=null`). B = 8 groups per step, trained in micro-batches of 2 sequences (slow
training), with 128 groups in flight: generation outruns training by ~11 groups per step, so
without a cap the pool grows every step. While each run trains, the training process's resident
memory (VmRSS, and its peak VmHWM) is sampled every 0.2 s; the pool occupancy and `host/rss_mib`
(the RSS right after the per-step `malloc_trim`, pace/memory.py) come from metrics.jsonl. Printed
side by side: occupancy and sampled RSS at quarters of the run, the step at which the capped pool
filled (first admission refused by the capacity), the RSS growth after that step (least squares,
per 100 steps, of the sampled RSS and of host/rss_mib) and the peak.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BASE = ["+exp=async_tiny", "data.batch_prompts=8", "trainer.micro_batch_size=2", "rollout.max_inflight_groups=128", "eval.every=0",
        "logger.mode=disabled", "logger.progress=false"]


@dataclass
class ListTrajectory:
    """The earlier per-token record (pace/records.py at 95fa358), for comparison."""

    response_ids: list
    logprobs: list
    versions: list
    completed_at: int
    finish_reason: str
    text: str = ""
    correct: bool = False
    reward: float = 0.0
    advantage: float = 0.0
    action_mask: list | None = None
    tool_calls: int = 0
    tool_errors: int = 0


def _responses(regime: str, groups: int, seed: int = 0):
    """(ids, log-probs, versions) of every response of ``groups`` groups, as NumPy arrays: each
    build below turns them into fresh Python objects (`tolist`), as vLLM's outputs are."""
    import numpy as np

    rng = np.random.default_rng(seed)
    g, vocab = (8, 128) if regime == "tiny" else (16, 151_936)
    for _ in range(groups * g):
        n = int(rng.integers(10, 121)) if regime == "tiny" else min(20_480, int(rng.lognormal(8.0, 0.8)))
        switch = int(rng.integers(0, n + 1))  # one weight update mid-generation
        yield (rng.integers(0, vocab, n), (-3 * rng.random(n)).astype(np.float32).astype(np.float64),
               np.repeat([0, 1], [switch, n - switch]))


def _traced(build) -> tuple[int, object]:
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        obj = build()
        return tracemalloc.get_traced_memory()[0] - before, obj
    finally:
        tracemalloc.stop()


def _streamed(ids, lps, versions):
    from pace.records import Trajectory

    t, i, rng = Trajectory(), 0, random.Random(len(ids))
    while i < len(ids):  # engine deltas of 1–8 tokens, as Python lists (vLLM's CompletionOutput)
        k = rng.randint(1, 8)
        t.extend(ids[i : i + k].tolist(), lps[i : i + k].tolist(), int(versions[i]))
        i += k
    t.versions[:] = versions  # vLLM's spans, as when the request finishes
    t.finish()
    return t


def bytes_per_token(regime: str, groups: int) -> dict:
    from pace.records import Group

    data = list(_responses(regime, groups))
    tokens = sum(len(ids) for ids, _, _ in data)
    per_group = len(data) // groups
    # "12+34*5=?\n" in characters (ids < 128: cached small ints); a DAPO-Math prompt in Qwen3 tokens
    prompt = range(20, 32) if regime == "tiny" else range(1000, 1150)

    def pool(make):
        return [Group(k, f"p{k}", list(prompt), "0", 0,
                      [make(*data[k * per_group + j]) for j in range(per_group)]) for k in range(groups)]

    old, _ = _traced(lambda: pool(lambda i, lp, v: ListTrajectory(i.tolist(), lp.tolist(), v.tolist(), 1, "stop")))
    new, _ = _traced(lambda: pool(_streamed))
    return {"regime": regime, "groups": groups, "tokens": tokens, "before": old / tokens, "after": new / tokens}


def _status_kib(pid: int, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def _steps_done(metrics: Path) -> int:
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def run(capacity: str, steps: int, extra: list[str], run_dir: Path) -> dict:
    cmd = [sys.executable, str(ROOT / "train.py"), *BASE, f"trainer.steps={steps}", f"pool.capacity={capacity}",
           f"hydra.run.dir={run_dir}", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples = []  # (steps done, RSS MiB)
    peak = 0
    metrics = run_dir / "metrics.jsonl"
    while proc.poll() is None:
        rss, hwm = _status_kib(proc.pid, "VmRSS"), _status_kib(proc.pid, "VmHWM")
        done = _steps_done(metrics)
        if rss is not None and 0 < done < steps:  # training: after start-up, before shutdown
            samples.append((done, rss / 1024))
            peak = max(peak, (hwm or 0) / 1024)
        time.sleep(0.2)
    err = proc.stderr.read()
    if proc.returncode != 0:
        sys.exit(f"pool.capacity={capacity} failed:\n{err[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {"rows": rows, "samples": samples, "peak": peak}


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x."""
    n = len(points)
    if n < 2:
        return float("nan")
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var if var else float("nan")


def _rss_at(samples: list[tuple[int, float]], step: int) -> float:
    near = [rss for s, rss in samples if s >= step]
    return near[0] if near else samples[-1][1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--capacity", type=int, default=256)
    ap.add_argument("--records-only", action="store_true", help="only the bytes per pooled token (seconds)")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for both runs (after --)")
    args = ap.parse_args()

    print("| regime | groups | tokens | bytes per pooled token: before (lists) | after (NumPy record) | ratio |")
    print("|---|---|---|---|---|---|")
    for regime, groups in (("tiny", 2000), ("8B presets", 64)):
        r = bytes_per_token(regime, groups)
        ratio = r["before"] / r["after"]
        print(f"| {regime} | {groups} | {r['tokens']:,} | {r['before']:.1f} | {r['after']:.1f} | {ratio:.1f}x |")
    if args.records_only:
        return

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cap in (str(args.capacity), "null"):
            t0 = time.perf_counter()
            results[cap] = run(cap, args.steps, args.overrides, Path(tmp) / f"cap-{cap}")
            print(f"pool.capacity={cap}: {args.steps} steps in {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    capped, free = results[str(args.capacity)], results["null"]
    filled = next((r["step"] for r in capped["rows"] if r.get("rollout/capacity_wait_s", 0) > 0), None)
    if filled is None:
        sys.exit("the capped pool never filled: production did not outrun training (more --steps?)")
    quarters = [args.steps * q // 4 for q in (1, 2, 3, 4)]
    quarters[-1] -= 1
    print(f"\nasync tiny, B = 8, micro-batches of 2, 128 groups in flight, {args.steps} steps; the capped pool "
          f"filled at step {filled}\n")
    print("| run | " + " | ".join(f"step {s}: pool / RSS MiB" for s in quarters) + " | peak RSS MiB | RSS growth after step "
          f"{filled}, MiB per 100 steps: sampled / after trim | waited for capacity, s |")
    print("|---" * (len(quarters) + 4) + "|")
    for cap, res in ((f"capacity {args.capacity}", capped), ("no capacity", free)):
        occ = {r["step"]: r["pool/occupancy"] for r in res["rows"]}
        cells = [f"{occ[s]} / {_rss_at(res['samples'], s + 1):.0f}" for s in quarters]
        after = [(s, rss) for s, rss in res["samples"] if s > filled]
        trimmed = [(r["step"], r["host/rss_mib"]) for r in res["rows"] if r["step"] > filled]
        waited = sum(r.get("rollout/capacity_wait_s", 0) for r in res["rows"])
        print(f"| {cap} | " + " | ".join(cells) + f" | {res['peak']:.0f} | {100 * _slope(after):+.1f} / "
              f"{100 * _slope(trimmed):+.1f} | {waited:.1f} |")
    start = max(quarters[0], filled + 1)  # past the warm-up of the first steps
    grow = lambda res: _rss_at(res["samples"], args.steps) - _rss_at(res["samples"], start)  # noqa: E731
    print(f"\nRSS from step {start} to the end: {grow(capped):+.0f} MiB with capacity {args.capacity}, "
          f"{grow(free):+.0f} MiB without; final pool {capped['rows'][-1]['pool/occupancy']} vs {free['rows'][-1]['pool/occupancy']} groups")


if __name__ == "__main__":
    main()
