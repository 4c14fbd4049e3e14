"""Time to form one batch (score every pooled group, budget, rejection, FIFO draw) vs pool size.

    python scripts/bench_pool.py [--sizes 1000 10000 100000] [--policy pace]

Groups are synthetic (one trajectory each, K_gen cached as after their first scoring), so this
measures the policy's own work under the pool lock, which the trainer waits on every step.
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
from pace.pool.policies import build_policy  # noqa: E402
from pace.records import Group, Trajectory  # noqa: E402


def make_groups(n: int, rng: random.Random, step: int) -> list[Group]:
    groups = []
    for i in range(n):
        c = rng.randint(max(0, step - 20), step)
        versions = sorted(rng.randint(max(0, c - 3), c) for _ in range(8))
        g = Group(i, str(i), [1], "0", 0, [Trajectory([1] * 8, [0.0] * 8, versions, c, "stop")], pfs=rng.random())
        g.k_gen()  # cached at completion in a real run
        groups.append(g)
    return groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    ap.add_argument("--policy", default="pace")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cfg = OmegaConf.structured(Config)
    cfg.pool.name = args.policy
    rng = random.Random(0)
    print(f"{'pooled groups':>14}{'median ms':>12}{'min ms':>10}")
    for n in args.sizes:
        groups = make_groups(n, rng, step=100)
        policy = build_policy(cfg)
        policy.record_pfs([rng.random() for _ in range(cfg.pace.score_window)]) if hasattr(policy, "record_pfs") else None
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            policy.select(list(groups), step=100)
            times.append((time.perf_counter() - t0) * 1e3)
        print(f"{n:>14,}{statistics.median(times):>12.2f}{min(times):>10.2f}")


if __name__ == "__main__":
    main()
