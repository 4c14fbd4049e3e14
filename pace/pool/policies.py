"""Pool policies by name (`pool.name`). Each is a few lines over `PoolPolicy` (DESIGN §3 table)."""
from __future__ import annotations

from pace.pool.base import AdmissionView, PoolPolicy


class AsyncPolicy(PoolPolicy):
    """Unfiltered fully-async: the rollout runs up to `rollout.max_inflight_groups`; B groups FIFO."""

    name = "async"


class SyncPolicy(PoolPolicy):
    """On-policy baseline: generate exactly one batch with θ_j, train, sync, repeat; no overlap.

    A group may start only when the engine holds the weights of the batch being collected
    (engine version == batches formed so far, i.e. the previous batch's update is synced) and the
    batch is not yet covered by pooled plus in-flight groups. Filtered groups free their slot, so
    dynamic sampling regenerates until B informative groups exist, all generated with θ_j.
    """

    name = "sync"

    def admits(self, view: AdmissionView) -> bool:
        return (
            view.engine_version == view.batches_formed
            and view.pooled + view.inflight < view.batch_prompts
            and super().admits(view)
        )


POLICIES: dict[str, type[PoolPolicy]] = {p.name: p for p in (AsyncPolicy, SyncPolicy)}


def build_policy(cfg) -> PoolPolicy:
    return POLICIES[cfg.pool.name](
        batch_prompts=cfg.data.batch_prompts, max_inflight_groups=cfg.rollout.max_inflight_groups
    )
