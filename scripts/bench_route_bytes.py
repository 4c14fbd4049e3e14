"""MoE routing replay: bytes per pooled token with and without the route record, and what the
30B-A3B preset's `pool.capacity` holds with routes, in host memory and in a checkpoint.

    python scripts/bench_route_bytes.py                # the table (docs/benchmarks.md "MoE routes: bytes per token")
    python scripts/bench_route_bytes.py --groups 4     # more groups per regime

Measured on real `Trajectory` objects (pace/records.py): each response built as the rollout leaves
it (its tokens, then the routes of a finished request: the prompt's P rows and the response's
n − 1, the last token never being an input; `finish()` trims the spare capacity), once without
routes and once with them. Two sizes per response token (the prompt's rows, which each response
holds, counted in the bytes): ``record``, `Trajectory.nbytes` (the host memory of the per-token
arrays), and ``pickled``, the bytes of a whole group pickled with the highest protocol (what a
checkpoint writes, pace/checkpoint.py, and what the trainer's scatter carries; object overheads
included). Routes are random expert ids of the model's shape (uint8: at most 256 experts).

Regimes: the tiny MoE (2 layers × top-2 of 8 experts; the tiny lab's 12-token prompts and 10–120
token responses, G = 8) and Qwen3-30B-A3B (48 layers × top-8 of 128; ~200-token prompts, G = 16)
at ~1.7k-token responses (the presets' running context) and at 8k–20k (long reasoning).
Then the 30B preset's pool at `pool.capacity` groups (composed from conf/exp/async_qwen3_30b_a3b.yaml;
the cap counts pooled and in-flight groups, whose routes are partial: an upper bound) of each
30B regime's mean length: its host memory and its checkpoint, without and with routes.
"""
from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name: (layers, top-k, experts, prompt tokens, response lengths (low, high), group size)
REGIMES = {
    "tiny MoE": (2, 2, 8, 12, (10, 120), 8),
    "30B-A3B ~1.7k": (48, 8, 128, 200, (1500, 1900), 16),
    "30B-A3B 8k-20k": (48, 8, 128, 200, (8000, 20000), 16),
}
PRESET = "async_qwen3_30b_a3b"


def group(layers: int, top_k: int, experts: int, prompt: int, lengths: tuple[int, int], size: int, gid: int,
          routes: bool, seed: int):
    from pace.records import Group, Trajectory

    rng = np.random.default_rng(seed)  # the same responses with and without routes
    trajs = []
    for n in rng.integers(lengths[0], lengths[1] + 1, size).tolist():
        t = Trajectory(rng.integers(0, 151_936, n), (-3 * rng.random(n)).astype(np.float32), np.zeros(n, np.int32),
                       completed_at=1, finish_reason="stop")
        if routes:  # one finished request: positions 0 … P + n − 2
            t.add_routes(rng.integers(0, experts, (prompt + n - 1, layers, top_k), dtype=np.uint8), 0, prompt)
        t.finish()
        trajs.append(t)
    return Group(gid, f"p{gid}", list(range(1000, 1000 + prompt)), "0", 0, trajs)


def measure(name: str, groups: int) -> dict:
    from pace.rollout.routes import route_metrics

    row = {"regime": name}
    for routes in (False, True):
        gs = [group(*REGIMES[name], gid=k, routes=routes, seed=k) for k in range(groups)]
        trajs = [t for g in gs for t in g.trajectories]
        tokens = sum(len(t) for t in trajs)
        key = "routes" if routes else "plain"
        row[f"record_{key}"] = sum(t.nbytes for t in trajs) / tokens
        row[f"pickled_{key}"] = sum(len(pickle.dumps(g, protocol=pickle.HIGHEST_PROTOCOL)) for g in gs) / tokens
        row["mean_len"] = tokens / len(trajs)
        if routes:
            row["route_metric"] = route_metrics(trajs)["moe/route_bytes_per_token"]
    return row


def preset(name: str):
    from hydra import compose, initialize_config_dir

    from pace.config import register

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="config", overrides=[f"+exp={name}"])


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=2, help="groups measured per regime")
    args = parser.parse_args()
    rows = [measure(name, args.groups) for name in REGIMES]
    print("| regime | layers × top-k | mean response | record B/token (no routes → routes) | "
          "pickled B/token (no routes → routes) | moe/route_bytes_per_token |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        layers, top_k = REGIMES[r["regime"]][:2]
        print(f"| {r['regime']} | {layers} × {top_k} (uint8) | {r['mean_len']:,.0f} | {r['record_plain']:.1f} → "
              f"{r['record_routes']:.1f} | {r['pickled_plain']:.1f} → {r['pickled_routes']:.1f} | {r['route_metric']:.1f} |")
    cfg = preset(PRESET)
    cap, size = cfg.pool.capacity, cfg.data.group_size
    print(f"\n{PRESET}: pool.capacity = {cap} groups × G = {size} responses")
    for r in rows[1:]:
        tokens = cap * size * r["mean_len"]
        print(f"- {r['regime']} ({tokens / 1e6:.1f}M response tokens): host memory {gib(tokens * r['record_plain'])} → "
              f"{gib(tokens * r['record_routes'])} with routes; checkpoint {gib(tokens * r['pickled_plain'])} → "
              f"{gib(tokens * r['pickled_routes'])}")


if __name__ == "__main__":
    main()
