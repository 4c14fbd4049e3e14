"""Pool policies from outside the package: `pool.name=my_package.module:MyPolicy`.

A policy is a class with the methods of `PoolPolicy` (subclassing it is the easy way: it supplies
every method but `select`'s decision). What the pool calls, and when:

    __init__(batch_prompts, max_inflight_groups, **pool.args)   once, at start
    admits(view: AdmissionView) -> bool      may the rollout start another group? (rollout thread)
    select(pooled: PoolColumns, step) -> Selection | None
                                             batch j, and the groups removed with a fate and a
                                             reason; None waits for more groups (trainer thread)
    state_dict() -> dict, load_state_dict(dict)   the policy's own state, in every checkpoint
    pfs_candidates(pooled, step) -> slots    optional: pooled groups to rescore for their Prefix
                                             Forgetting Score (`pooled.pfs`); rescoring runs only
                                             for policies that define it

`Selection.metrics` is logged every step as `pool/<key>`. Removed groups take a fate of
`pace.records.Fate` (REJECTED or DROPPED_STALE); the reason string is logged per group. Both run
under the pool lock: keep them vectorised over `pooled`'s columns (`pace/pool/columns.py`).
"""
from __future__ import annotations

from pace.policy_path import PolicyError, check
from pace.pool.base import PoolPolicy


def build(path: str, batch_prompts: int, max_inflight_groups: int, args: dict) -> PoolPolicy:
    cls = check(path, args)
    try:
        policy = cls(batch_prompts=batch_prompts, max_inflight_groups=max_inflight_groups, **args)
    except Exception as exc:  # noqa: BLE001 - the user's constructor: say where it failed, in one line
        raise PolicyError(f"pool.name={path}: {cls.__name__}(pool.args={args}) raised {type(exc).__name__}: {exc}") from exc
    if getattr(policy, "batch_prompts", None) != batch_prompts:
        raise PolicyError(f"pool.name={path}: {cls.__name__} must keep batch_prompts={batch_prompts} as "
                          "self.batch_prompts (the pool reads it)")
    return policy


def reads_pfs(policy) -> bool:
    """Does the policy ask for Prefix Forgetting Scores (PACE ranks by them; `RecordingPolicy` records
    them), so the rollout rescores for it?"""
    return getattr(type(policy), "pfs_candidates", PoolPolicy.pfs_candidates) is not PoolPolicy.pfs_candidates
