"""The pieces of train.py's loop that are not one call: waiting for batch j while watching the
rollout thread, and the metrics a step logs about its batch, the pool and the rollout (docs/design.md §6
names; the simulator logs the same ones, pace/sim/run.py).
"""
from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from pace.records import Fate
from pace.rollout.routes import route_metrics

if TYPE_CHECKING:
    from pace.signals import StopSignal


FILTERED_WARN_S = 300.0  # a wait this long in which every group completed was filtered is said, and again each as long


def wait_for_batch(pool, rollout, step: int, stop: StopSignal, warn_s: float = FILTERED_WARN_S):
    """Block until the pool policy forms batch `step`; re-raise a rollout failure within 0.5 s.
    None once a stop is requested (no batch is formed then). A wait of ``warn_s`` in which groups
    completed and every one was filtered says so in one line (a batch may never form: the policy's
    responses all right or all wrong, or an engine computing garbage), and again every ``warn_s``."""
    start, began = pool.counts(), time.monotonic()
    said = began
    while not stop.requested:
        rollout.check()  # before forming: a batch once formed is trained on (or counted as dropped)
        batch = pool.form_batch(step, timeout=0.5)
        if batch is not None:
            return batch
        if time.monotonic() - said >= warn_s:
            said = time.monotonic()
            now = pool.counts()
            moved = {k: now[k] - start[k] for k in ("filtered", "pooled", "consumed", "rejected")}
            if moved["filtered"] > 0 and not any(moved[k] for k in ("pooled", "consumed", "rejected")):
                print(f"warning: batch {step} not formed after {said - began:.0f} s: every one "
                      f"of the {moved['filtered']} groups completed meanwhile was filtered (one reward for all its "
                      "responses, DAPO's dynamic sampling): the policy is all right or all wrong on them, or its "
                      "engines compute something else (the reload probe, rollout.reload_probe)", file=sys.stderr,
                      flush=True)
    return None


def step_metrics(batch, pool, decided, t_wait: float, tools: bool = False) -> dict:
    """Staleness of the consumed groups, pool state, rollout throughput (docs/design.md §6 names).

    `train/*` describe the consumed batch, which dynamic sampling restricts to mixed groups;
    `rollout/{acc,reward}_mean` describe every group completed since the last step, filtered or
    not: the unbiased view of how good the current policy is.
    """
    ks = [g.staleness(batch.step) for g in batch.groups]
    trajs = batch.trajectories
    n = len(ks)
    arrived = pool.drain_arrived()
    produced = [t for g in arrived for t in g.trajectories]
    rollout = {"rollout/groups_completed": len(arrived)}
    if all("s_eff" in g.scores for g in batch.groups):  # PACE scored them
        # S_eff = K_wait + u^γ K_gen of the consumed groups (docs/design.md §2), as the policy scored them
        rollout["staleness/effective_mean"] = sum(g.scores["s_eff"] for g in batch.groups) / n
    if produced:
        rollout["rollout/acc_mean"] = sum(t.correct for t in produced) / len(produced)
        rollout["rollout/reward_mean"] = sum(t.reward for t in produced) / len(produced)
        if tools:
            from pace.tools.runner import usage_metrics

            rollout.update(usage_metrics(produced))
    return {
        **rollout,
        "train/reward_mean": sum(t.reward for t in trajs) / len(trajs),
        "train/acc_mean": sum(t.correct for t in trajs) / len(trajs),
        "train/response_len": sum(len(t) for t in trajs) / len(trajs),
        # model-generated tokens (tool output excluded): what the loss averages over
        "train/action_len": sum(t.num_actions for t in trajs) / len(trajs),
        "staleness/k_mean": sum(k[0] for k in ks) / n,
        "staleness/k_gen_mean": sum(k[1] for k in ks) / n,
        "staleness/k_kv_mean": sum(g.k_kv() for g in batch.groups) / n,  # KV staleness (≥ K_gen)
        "staleness/k_wait_mean": sum(k[2] for k in ks) / n,
        "staleness/k_max": max(k[0] for k in ks),
        "pool/occupancy": pool.occupancy,
        "pool/rejected": sum(g.fate == Fate.REJECTED for g in decided),
        "pool/filtered": sum(g.fate == Fate.FILTERED for g in decided),
        **{f"pool/{k}": v for k, v in pool.last_metrics.items()},
        "rollout/inflight": pool.inflight,
        "version": batch.step,
        "time/wait_data": t_wait,
        **route_metrics(trajs),  # MoE routing replay: bytes of the route record per pooled token
    }
