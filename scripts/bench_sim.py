"""How fast the simulator is, and how its cost grows with B·G and with the length cap.

    python scripts/bench_sim.py     # the 300-step 8B scenario (Async, PACE; PACE where it rejects), then the growth table
    python scripts/bench_sim.py --steps 300 --growth-steps 30 --policies pace

One process, one core (numpy single-threaded), nothing written to disk (`sim.groups` off and no
run directory: this times the simulation, not Parquet). Prints per run: wall seconds, events,
responses simulated, µs per event and per response; then wall per simulated step for B·G and
`rollout.max_tokens` varied one at a time, as ratios to the first row. Measure with nothing else
running.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hydra import compose, initialize_config_dir  # noqa: E402

from pace.config import register as register_run  # noqa: E402
from pace.sim.config import register, validate_sim  # noqa: E402
from pace.sim.run import Simulation  # noqa: E402

CONF = str(Path(__file__).resolve().parents[1] / "conf")


# DAPO's 512-prompt step (the *_qwen3_8b_dapo512 presets) is the large case. On the presets' node
# (qwen3_8b) it is training-bound with a small backlog (PACE rejects ~1% of the groups); on the
# Figure 8 scenario's 8 engines, at the same B, G and in-flight cap, production is ~2× consumption:
# PACE rejects about half of the completed groups and rescores many more
REJECTING = ("+sim=qwen3_8b_fig8", "data.batch_prompts=512", "rollout.max_inflight_groups=1024")


def simulate(policy: str, steps: int, *overrides: str) -> dict:
    scenario = list(REJECTING) if policy.endswith("+rejecting") else ["+sim=qwen3_8b"]
    policy = policy.removesuffix("+rejecting")
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose("simulate", overrides=[f"+exp={policy}_qwen3_8b_dapo512", *scenario, f"trainer.steps={steps}",
                                             "logger.mode=disabled", *overrides])
    validate_sim(cfg)
    sim = Simulation(cfg)
    t = time.perf_counter()
    stats = sim.run()
    wall = time.perf_counter() - t
    responses = sim.pool.counts()["submitted"] * cfg.data.group_size  # started (finished or not)
    counts = sim.pool.counts()
    return {"wall_s": wall, "events": stats["events"], "responses": responses, "sim_s": stats["sim_s"],
            "s_per_step": sum(r["time/step"] for r in sim.rows) / len(sim.rows), "preempted": stats["preempted"],
            "rejected": counts["rejected"] / max(counts["consumed"] + counts["rejected"], 1), "rescored": stats["rescored"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--growth-steps", type=int, default=30)
    ap.add_argument("--policies", nargs="+", default=["async", "pace", "pace+rejecting"],
                    help="<preset>: the qwen3_8b scenario; <preset>+rejecting: the training-bound one (REJECTING)")
    args = ap.parse_args()
    register_run()
    register()
    print(f"8B scenarios, DAPO's step (B = 512, G = 16, 16 updates), 1,024 groups in flight, {args.steps} steps (eval.every=0: no validation holds)")
    for policy in args.policies:
        r = simulate(policy, args.steps, "eval.every=0")
        print(f"  {policy:15s} wall {r['wall_s']:6.1f} s   {r['events']:>9,} events  {r['responses']:>10,} responses  "
              f"{1e6 * r['wall_s'] / r['events']:5.1f} µs/event  {1e6 * r['wall_s'] / r['responses']:5.1f} µs/response  "
              f"(simulated {r['s_per_step']:.0f} s/step, {r['preempted']:,} preemptions, {r['rejected']:.1%} rejected, "
              f"{r['rescored']:,} groups rescored)")
    print(f"\ngrowth ({args.growth_steps} steps of {args.policies[0]}; wall per simulated step, ratio to the first row):")
    rows = [("B=128 G=16 cap 20480", ["data.batch_prompts=128", "rollout.max_inflight_groups=256"]),
            ("B=256 G=16 cap 20480", ["data.batch_prompts=256", "rollout.max_inflight_groups=512"]),
            ("B=512 G=16 cap 20480", []),
            ("B=512 G=16 cap 10240", ["rollout.max_tokens=10240", "rollout.overlong_buffer=2048"]),
            ("B=512 G=16 cap  5120", ["rollout.max_tokens=5120", "rollout.overlong_buffer=1024"])]
    base = None
    for name, ov in rows:
        r = simulate(args.policies[0], args.growth_steps, "eval.every=0", *ov)
        per = r["wall_s"] / args.growth_steps
        base = base or per
        print(f"  {name}: {per:6.3f} s/step  ×{per / base:4.2f}   {r['events'] / args.growth_steps:>9,.0f} events/step  "
              f"{r['responses'] / args.growth_steps:>7,.0f} responses/step")


if __name__ == "__main__":
    main()
