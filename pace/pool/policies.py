"""Pool policies by name (`pool.name`). Each is a few lines over `PoolPolicy` (docs/design.md §3 table).
A `pool.name` of the form `module.path:ClassName` loads a policy from outside the package
(`pace/pool/plugins.py`, docs/pool-policies.md "Writing a pool policy")."""
from __future__ import annotations

import numpy as np

from pace import policy_path
from pace.config import target_pool
from pace.pool import plugins, scoring
from pace.pool.base import AdmissionView, PoolPolicy, Selection
from pace.pool.columns import PoolColumns
from pace.pool.recording import RecordingPolicy
from pace.pool.scoring import RejectionController, ScoreWindow
from pace.records import Fate


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


class StaleKPolicy(PoolPolicy):
    """Controlled Stale-k: at consumption, groups whose policy lag K exceeds `pool.max_lag` are dropped."""

    name = "stale_k"

    def __init__(self, batch_prompts: int, max_inflight_groups: int, max_lag: float):
        super().__init__(batch_prompts, max_inflight_groups)
        self.max_lag = max_lag

    def select(self, pooled: PoolColumns, step: int) -> Selection | None:
        slots = pooled.slots()
        lag = pooled.k_gen[slots] + (step - pooled.c_mean[slots])  # K = K_gen + K_wait (Lemma 1)
        stale = lag > self.max_lag
        removed = [(g, Fate.DROPPED_STALE, f"K > max_lag={self.max_lag}") for g in pooled.groups(slots[stale])]
        fresh = slots[~stale]
        batch = pooled.groups(fresh[: self.batch_prompts]) if len(fresh) >= self.batch_prompts else []
        return Selection(batch=batch, removed=removed) if batch or removed else None


class GatePolicy(PoolPolicy):
    """AReaL-style admission gate: a group may start only while (v + η + 1)·B > groups started
    and not discarded.

    v is the trainer version and η = `pool.max_head_offpolicyness`: generation runs at most η
    batches ahead of training. As in AReaL, the count is of groups that can still be trained on:
    groups filtered by dynamic sampling (or dropped at a stop) give their place back, or a run
    whose groups are mostly filtered could never complete a batch (a deadlock). Selection is FIFO.
    """

    name = "gate"

    def __init__(self, batch_prompts: int, max_inflight_groups: int, max_head_offpolicyness: int):
        super().__init__(batch_prompts, max_inflight_groups)
        self.max_head_offpolicyness = max_head_offpolicyness

    def admits(self, view: AdmissionView) -> bool:
        counted = view.started - view.discarded
        return (view.trainer_version + self.max_head_offpolicyness + 1) * view.batch_prompts > counted and super().admits(view)


class PacePolicy(PoolPolicy):
    """PACE, per step j (docs/design.md §3): occupancy-driven rejection budget, staleness ranking, FIFO draw.

    1. wait for B groups; 2. ρ_j from the pool's excess over `pace.target_pool`; 3. budget R_j;
    4. score every pooled group (`pace.score`); 5. reject the R_j highest scores (ties: older
    completion first), then take B groups FIFO from the rest. With `selection="draw"` only the
    high scorers that come before the B-th kept group in completion order are rejected (the paper's
    "draws until it has formed a full batch"); the later ones stay pooled for the next step.

    With `kv_aware` the KV staleness K_kv takes K_gen's place in every score (a token written on an
    older context counts as old as that context): effective S = K_wait + u^γ K_kv, raw S = K_wait +
    K_kv (the context lag: the token-weighted mean of j − w_t), generation S = K_kv. The PFS bounds,
    the candidates it is asked for and `pool/pfs_coverage` follow the same term.
    """

    name = "pace"

    def __init__(self, batch_prompts: int, max_inflight_groups: int, score: str, gamma: float,
                 target_pool: int, ema: float, score_window: int, selection: str = "pool", kv_aware: bool = False):
        super().__init__(batch_prompts, max_inflight_groups)
        self.score, self.gamma, self.selection, self.kv_aware = score, gamma, selection, kv_aware
        self.controller = RejectionController(target_pool, ema)
        self.window = ScoreWindow(score_window)

    def pfs_candidates(self, pooled: PoolColumns, step: int) -> np.ndarray:
        """Groups whose PFS can matter at the next batch: only `effective` ranking reads it, and only
        the groups whose score bounds [K_wait, K_wait + K_gen] (K_kv under `kv_aware`) reach the r-th
        highest lower bound, r the budget predicted from the occupancy now, doubled (plus one) for the
        groups still to arrive before the batch is formed. The rollout asks again as groups arrive and
        after each sync, so the set follows the pool. Nothing while the budget would be zero."""
        slots = pooled.slots()
        n = len(slots)
        if self.score != "effective" or n == 0:
            return slots[:0]
        c = self.controller
        rho = c.ema * c.rho + (1.0 - c.ema) * max(0, n - c.target_pool) / n  # c.update(n) without the side effect
        r = c.budget(rho, n, self.batch_prompts)
        if r == 0:
            return slots[:0]
        k_wait = step - pooled.c_mean[slots]
        return slots[scoring.candidates(k_wait, k_wait + self.generation_term(pooled)[slots], 2 * r + 1)]

    def generation_term(self, pooled: PoolColumns) -> np.ndarray:
        """The column the scores use for the generation part: K_gen, or K_kv under `kv_aware`."""
        return pooled.k_kv if self.kv_aware else pooled.k_gen

    def record_pfs(self, values: list[float]) -> None:
        """New Prefix Forgetting Scores from rescoring (called under the pool lock)."""
        self.window.extend(values)

    def select(self, pooled: PoolColumns, step: int) -> Selection | None:
        slots = pooled.slots()
        n = len(slots)
        if n < self.batch_prompts:
            return None
        rho = self.controller.update(n)
        budget = self.controller.budget(rho, n, self.batch_prompts)
        # k_gen: K_gen, or K_kv under kv_aware (`generation_term`): the scores take it in K_gen's place
        k_gen, k_wait = self.generation_term(pooled)[slots], step - pooled.c_mean[slots]
        completed = pooled.completed[slots]
        metrics = {"rho": rho, "budget": budget}
        if self.score == "effective":
            # u^γ ∈ [0, 1] bounds every score in [K_wait, K_wait + K_gen]. Only groups whose upper
            # bound reaches the budget-th highest lower bound can be among the R highest scores,
            # so only they need their PFS ranked (in steady state a few per cent of the pool).
            cand = scoring.candidates(k_wait, k_wait + k_gen, budget)
            pfs = pooled.pfs[slots[cand]]
            s = self._scores(pfs, k_wait[cand], k_gen[cand])[0]
            rejected = cand[scoring.top_r(s, completed[cand], budget)]
            ranked = k_gen[cand] > 0  # candidates whose score the PFS can change
            if ranked.any():
                metrics["pfs_coverage"] = float(np.mean(~np.isnan(pfs[ranked])))
        else:  # raw / generation do not depend on the PFS
            rejected = scoring.top_r(scoring.score(self.score, k_wait, k_gen), completed, budget)
        kept = np.ones(n, dtype=bool)
        kept[rejected] = False
        taken = np.flatnonzero(kept)[: self.batch_prompts]
        if self.selection == "draw":  # the draw stops at the B-th kept group: later high scorers stay
            rejected = rejected[rejected < taken[-1]]
            metrics["spared"] = budget - len(rejected)
        # Scores are logged per group: compute them in full for the groups decided now.
        decided = np.concatenate([rejected, taken])
        s, u, s_eff = self._scores(pooled.pfs[slots[decided]], k_wait[decided], k_gen[decided])
        groups = pooled.groups(slots[decided])
        for i, g in enumerate(groups):
            g.scores.update(u=float(u[i]), score=float(s[i]), s_eff=float(s_eff[i]))
            if i < len(rejected):
                g.scores.update(rho=rho, budget=budget)
        removed = [(g, Fate.REJECTED, f"pace:{self.score}") for g in groups[: len(rejected)]]
        return Selection(batch=groups[len(rejected):], removed=removed, metrics=metrics)

    def _scores(self, pfs: np.ndarray, k_wait: np.ndarray, k_gen: np.ndarray) -> tuple[np.ndarray, ...]:
        """(score, u, effective score); a group not rescored yet has u = 1 (K_gen counts in full)."""
        u = self.window.ranks(pfs)
        s_eff = scoring.score("effective", k_wait, k_gen, u, self.gamma)
        s = s_eff if self.score == "effective" else scoring.score(self.score, k_wait, k_gen, u, self.gamma)
        return s, u, s_eff

    def state_dict(self) -> dict:
        return {"controller": self.controller.state_dict(), "window": self.window.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.controller.load_state_dict(state["controller"])
        self.window.load_state_dict(state["window"])


POLICIES: dict[str, type[PoolPolicy]] = {
    p.name: p for p in (AsyncPolicy, SyncPolicy, StaleKPolicy, GatePolicy, PacePolicy)
}


def build_policy(cfg) -> PoolPolicy:
    policy = _build_policy(cfg)
    record = cfg.pool.record_effective  # a resumed run's config is merged with the schema: always there
    if record > 0 and not (cfg.pool.name == "pace" and cfg.pace.score == "effective"):
        return RecordingPolicy(policy, gamma=cfg.pace.gamma, score_window=cfg.pace.score_window, record_effective=record,
                               kv_aware=cfg.pace.kv_aware)
    return policy


def _build_policy(cfg) -> PoolPolicy:
    common = dict(batch_prompts=cfg.data.batch_prompts, max_inflight_groups=cfg.rollout.max_inflight_groups)
    name = cfg.pool.name
    if policy_path.is_import_path(name):
        return plugins.build(name, **common, args=policy_path.args_of(cfg))
    if name == "stale_k":
        return StaleKPolicy(**common, max_lag=cfg.pool.max_lag)
    if name == "gate":
        return GatePolicy(**common, max_head_offpolicyness=cfg.pool.max_head_offpolicyness)
    if name == "pace":
        p = cfg.pace
        return PacePolicy(**common, score=p.score, gamma=p.gamma, target_pool=target_pool(cfg), ema=p.ema,
                          score_window=p.score_window, selection=p.selection, kv_aware=p.kv_aware)
    return POLICIES[name](**common)
