"""A pool policy of one's own, loaded by import path (docs/pool-policies.md "Writing a pool policy"):

    python train.py pool.name=examples.pool_policies.freshest:FreshestPolicy +pool.args.keep=2

Each step it trains on the B freshest pooled groups (smallest policy lag K = K_gen + K_wait)
and drops the oldest beyond `keep`·B, so the pool never holds more than `keep`·B groups after a
step. A bounded pool like PACE's, with a fixed rule in place of its occupancy-driven budget.
"""
from __future__ import annotations

import numpy as np

from pace.pool import PoolPolicy, Selection
from pace.pool.columns import PoolColumns
from pace.records import Fate


class FreshestPolicy(PoolPolicy):
    name = "freshest"

    def __init__(self, batch_prompts: int, max_inflight_groups: int, keep: float = 2.0):
        super().__init__(batch_prompts, max_inflight_groups)  # admission: the in-flight cap
        if keep < 1:
            raise ValueError(f"pool.args.keep={keep}: the pool must keep at least the batch (keep >= 1)")
        self.cap = int(keep * batch_prompts)
        self.dropped = 0  # over the whole run: in the checkpoint, so a resumed run goes on counting

    def select(self, pooled: PoolColumns, step: int) -> Selection | None:
        slots = pooled.slots()  # completion order
        if len(slots) < self.batch_prompts:
            return None  # wait for more groups
        lag = pooled.k_gen[slots] + (step - pooled.c_mean[slots])  # K per group (Lemma 1)
        order = np.argsort(lag, kind="stable")  # freshest first; ties: earlier completion first
        taken, dropped = np.sort(order[: self.batch_prompts]), order[self.cap:]
        self.dropped += len(dropped)
        removed = [(g, Fate.DROPPED_STALE, f"freshest: beyond {self.cap}") for g in pooled.groups(slots[dropped])]
        return Selection(batch=pooled.groups(slots[taken]), removed=removed,
                         metrics={"dropped": len(dropped), "dropped_total": self.dropped})  # logged as pool/<key>

    def state_dict(self) -> dict:
        return {"dropped": self.dropped}

    def load_state_dict(self, state: dict) -> None:
        self.dropped = state["dropped"]
