"""Effective Staleness for the record (`pool.record_effective`): any policy's groups get PACE's
Prefix Forgetting Score, u and S_eff logged per group, while the policy decides as it always does.

PACE scores the groups it might reject; the other policies (sync, async, stale_k, gate, and M2PO's
async pool) never look at the PFS, so their groups carry none and Figure 7 has no Effective
Staleness to draw for them. `RecordingPolicy` wraps such a policy:

    admits, select, the Selection's batch and removals   the wrapped policy's, untouched
    pfs_candidates   the first 2B pooled groups in completion order (what a FIFO draw takes
                     next, with a batch of slack) that have no PFS yet: the rollout scores them as it
                     does PACE's candidates, after each weight sync and as groups arrive
                     (`time/rescore`), but once each, under the weights loaded when they reached
                     the head (a score cancelled by a sync is asked again under the new weights)
    record_pfs       new scores go to the wrapper's own window (`pace.score_window`)
    after select     every sampled group the wrapped policy decided gets u (its PFS percentile in that
                     window, 1 when not rescored yet) and S_eff = K_wait + u^γ K_gen (`pace.gamma`;
                     K_kv in K_gen's place under `pace.kv_aware`, as PACE ranks then);
                     `pool/pfs_coverage` is the share of decided groups with K_gen > 0 that had a PFS;
                     the others carry no u or S_eff (not even a wrapped PACE's own, which raw and
                     generation compute with u = 1)

`pool.record_effective` is the share of groups recorded: 1 all of them, 0.125 a fixed
pseudo-random eighth (by group id; the others get no score and cost nothing), 0 off. Rescoring
takes engine time from generation (a prefill of prompt + m tokens per response), so fewer groups
arrive per second and the run's backlog differs from a run without the record: a sample keeps the
record's histogram at a fraction of that cost.

The decision cannot depend on the record: `select` runs before any score is written, and the
window the PFS feeds is the wrapper's, never the wrapped policy's.
"""
from __future__ import annotations

import numpy as np

from pace.pool import scoring
from pace.pool.base import PoolPolicy, Selection
from pace.pool.columns import PoolColumns
from pace.pool.scoring import ScoreWindow


class RecordingPolicy:
    """``policy``'s decisions, with PACE's effective score computed and recorded per decided group."""

    def __init__(self, policy: PoolPolicy, gamma: float, score_window: int, record_effective: float = 1.0,
                 head: int | None = None, kv_aware: bool = False):
        if not 0 < record_effective <= 1:
            raise ValueError(f"pool.record_effective must be in [0, 1] (0: off), got {record_effective}")
        self.policy = policy
        self.record_effective = record_effective
        self.batch_prompts = policy.batch_prompts
        self.gamma, self.kv_aware = gamma, kv_aware
        self.head = 2 * policy.batch_prompts if head is None else head
        self.window = ScoreWindow(score_window)

    def admits(self, view) -> bool:
        return self.policy.admits(view)

    def pfs_candidates(self, pooled: PoolColumns, step: int) -> np.ndarray:
        """The head's groups not scored yet: each group is scored once, under the weights loaded
        when it reached the head (PACE rescores its candidates after every update; for the record
        one score is enough, at a fraction of the engine time)."""
        slots = pooled.slots()[: self.head]
        slots = slots[np.isnan(pooled.pfs[slots])]
        if self.record_effective < 1:
            slots = slots[[self.sampled(g) for g in pooled.groups(slots)]]
        return slots

    def sampled(self, group) -> bool:
        """Whether ``group`` is in the recorded sample: a fixed pseudo-random share of group ids
        (Knuth's multiplicative hash), the same in every run."""
        return (group.id * 2654435761) % 2**32 < self.record_effective * 2**32

    def record_pfs(self, values: list[float]) -> None:
        self.window.extend(values)

    def select(self, pooled: PoolColumns, step: int) -> Selection | None:
        selection = self.policy.select(pooled, step)
        if selection is None:
            return None
        decided = selection.batch + [g for g, _, _ in selection.removed]
        for g in decided:  # a PACE policy's own u and S_eff (raw / generation: u = 1) are not the record
            if not self.sampled(g):
                g.scores.pop("u", None)
                g.scores.pop("s_eff", None)
        groups = [g for g in decided if self.sampled(g)]
        if groups:
            self._record(groups, step, selection.metrics)
        return selection

    @property
    def wraps(self) -> PoolPolicy:
        """The policy that decides (`Pool` names it in a bad selection's error)."""
        return self.policy

    def _record(self, groups: list, step: int, metrics: dict) -> None:
        pfs = np.array([np.nan if g.pfs is None else g.pfs for g in groups], dtype=np.float64)
        k_gen = np.array([g.k_kv() if self.kv_aware else g.k_gen() for g in groups], dtype=np.float64)
        k_wait = np.array([g.k_wait(step) for g in groups], dtype=np.float64)
        u = self.window.ranks(pfs)
        s_eff = scoring.score("effective", k_wait, k_gen, u, self.gamma)
        for g, ui, si in zip(groups, u, s_eff):
            g.scores.update(u=float(ui), s_eff=float(si))
        ranked = k_gen > 0
        if ranked.any():
            metrics["pfs_coverage"] = float(np.mean(~np.isnan(pfs[ranked])))

    def state_dict(self) -> dict:
        return {"policy": self.policy.state_dict(), "record_window": self.window.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.policy.load_state_dict(state["policy"])
        self.window.load_state_dict(state["record_window"])
