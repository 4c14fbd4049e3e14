"""Time to form one batch (score every pooled group, budget, rejection, FIFO draw) vs pool size.

    python scripts/bench_pool.py [--sizes 1000 10000 100000] [--policy pace]

Each size runs the real `Pool.form_batch` (the policy plus applying every fate under the pool
lock, which the trainer waits on every step). Columns:

  median/min ms   steady state: the pool holds about n groups (pace.target_pool = n) while
                  production outruns consumption (2B arrivals per step), so PACE rejects about
                  B groups a step; the initial pool completed over the last 20 versions.
  one-age ms      the same with every initial group completed at one version: PACE's exact
                  pruning (candidates by score bounds) cannot skip any group, the worst case.
  cold ms         the first step at occupancy n with ρ already 0.1, which rejects ~19% of the
                  pool at once: the per-rejected-group cost (each rejection is a fate record).

Groups are synthetic: one 8-token trajectory, token versions up to 3 behind completion, PFS
uniform; arrivals complete at the current version.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omegaconf import OmegaConf  # noqa: E402

from pace.config import Config  # noqa: E402
from pace.pool import Pool  # noqa: E402
from pace.pool.policies import build_policy  # noqa: E402
from pace.records import Group, Trajectory  # noqa: E402


class Source:
    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self.next_id = 0

    def group(self, step: int, spread: int) -> Group:
        """A group completing at a version up to ``spread`` before ``step``."""
        rng, i = self.rng, self.next_id
        self.next_id += 1
        c = rng.randint(max(0, step - spread), step)
        versions = sorted(rng.randint(max(0, c - 3), c) for _ in range(8))
        traj = Trajectory([1] * 8, [0.0] * 8, versions, c, "stop")
        return Group(i, str(i), [1], "0", 0, [traj], pfs=rng.random(), pfs_version=c)


def fill(pool: Pool, src: Source, n: int, step: int, spread: int = 0) -> None:
    for _ in range(n):
        g = src.group(step, spread)
        pool.on_submitted(g)
        pool.add(g, step)


def make_pool(cfg, n: int, rng: random.Random) -> Pool:
    cfg = cfg.copy()
    cfg.pace.target_pool = n
    policy = build_policy(cfg)
    if hasattr(policy, "record_pfs"):
        policy.record_pfs([rng.random() for _ in range(cfg.pace.score_window)])
    return Pool(policy, informative=lambda g: True)


def steady(cfg, n: int, warmup: int, repeats: int, spread: int = 20) -> tuple[float, float, float]:
    """Median and min ms per form_batch, and groups removed per step, at occupancy ≈ n.

    The initial pool completed over the last ``spread`` versions. With spread 0 every old group has
    the same K_wait, so PACE's bound-based pruning keeps the whole pool as candidates (worst case).
    """
    b = cfg.data.batch_prompts
    src, rng = Source(), random.Random(1)
    pool = make_pool(cfg, n, rng)
    fill(pool, src, n, step=20, spread=spread)
    times, removed = [], []
    for j in range(warmup + repeats):
        step = 20 + j
        fill(pool, src, 2 * b, step)
        before = pool.counts()
        t0 = time.perf_counter()
        batch = pool.form_batch(step, timeout=0)
        dt = (time.perf_counter() - t0) * 1e3
        assert batch is not None and len(batch.groups) == b
        after = pool.counts()
        if j >= warmup:
            times.append(dt)
            removed.append(sum(after[k] - before[k] for k in ("rejected", "dropped_stale")))
        pool.drain_decided()
    pool.check_accounting()
    return statistics.median(times), min(times), statistics.mean(removed)


def cold(cfg, n: int) -> tuple[float, int]:
    """ms for the first batch at occupancy n with ρ entering at 0.1 (target B): rejects ≈ 0.19 n."""
    src = Source()
    policy = build_policy(cfg)
    if hasattr(policy, "controller"):
        policy.controller.rho = 0.1
    pool = Pool(policy, informative=lambda g: True)
    fill(pool, src, n, step=20, spread=20)
    t0 = time.perf_counter()
    pool.form_batch(20, timeout=0)
    dt = (time.perf_counter() - t0) * 1e3
    return dt, pool.counts()["rejected"] + pool.counts()["dropped_stale"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    ap.add_argument("--policy", default="pace", choices=["pace", "async", "stale_k", "gate"])
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32, help="B, prompts per step (the tiny presets' value)")
    args = ap.parse_args()
    cfg = OmegaConf.structured(Config)
    cfg.pool.name = args.policy
    cfg.data.batch_prompts = args.batch
    print(f"policy {args.policy}, B = {cfg.data.batch_prompts}; steady state: arrivals 2B per step")
    print(f"{'pooled groups':>14}{'median ms':>11}{'min ms':>9}{'removed/step':>14}"
          f"{'one-age ms':>12}{'cold ms':>10}{'cold removed':>14}")
    for n in args.sizes:
        med, lo, rem = steady(cfg, n, args.warmup, args.repeats)
        one_age = steady(cfg, n, args.warmup, args.repeats, spread=0)[0]
        cold_ms, cold_removed = cold(cfg, n)
        print(f"{n:>14,}{med:>11.2f}{lo:>9.2f}{rem:>14.1f}{one_age:>12.2f}{cold_ms:>10.1f}{cold_removed:>14,}")


if __name__ == "__main__":
    main()
