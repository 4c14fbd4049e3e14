"""Pool of completed groups with exact fate accounting (docs/design.md §3).

Every group ever submitted ends in exactly one fate. The pool is the only place fates change:

    on_submitted   → inflight
    add            → pooled, or filtered (dynamic sampling)
    form_batch     → consumed, or rejected / dropped_stale (by the policy)
    drop_inflight  → dropped_shutdown (a stop without `rollout.resume_inflight`: cut short, prompts returned)
    abandon        consumed → dropped_shutdown (the training step on that batch failed)
    at shutdown    whatever is left stays pooled and is counted (and checkpointed)

Invariant, checked by `check_accounting`: submitted == Σ_fate count(fate), across resumes too: a
group in flight at a checkpoint stays in flight there when the rollout kept its state (the resumed
run continues it), and is counted as dropped_shutdown otherwise, so a run resumed from it decides
each of them once.

Capacity (`pool.capacity`): no group is started while pooled + in flight ≥ capacity, so the pool
never holds more than `capacity` groups and memory stays bounded when production outruns
training. Production waits (back-pressure, nothing is discarded); `capacity_blocked` says when.

The rollout thread calls `admits`, `on_submitted`, `add`; the trainer thread calls `form_batch`,
`drain_decided`. One lock guards everything; a condition wakes the trainer when groups arrive.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pace.pool.columns import PoolColumns
from pace.records import Batch, Fate, Group


@dataclass(frozen=True)
class AdmissionView:
    """What a policy sees when the rollout asks to start a group."""

    engine_version: int  # version of the weights loaded in the engine
    trainer_version: int  # updates finished by the trainer
    batches_formed: int  # batches handed to the trainer so far
    started: int  # groups ever submitted
    inflight: int  # submitted, not yet pooled or filtered
    pooled: int
    batch_prompts: int  # B
    # started groups that will never reach a batch without a policy deciding it: filtered by dynamic
    # sampling, or dropped at a stop (their prompts are drawn again)
    discarded: int = 0


@dataclass
class Selection:
    """A policy's decision at step j: the batch, and groups removed with a fate and reason."""

    batch: list[Group]
    removed: list[tuple[Group, Fate, str]] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)  # e.g. pool/rho, pool/budget (logged per step)


class PoolPolicy:
    """Base policy: admit while under the in-flight cap; take B groups FIFO (completion order)."""

    name = "base"

    def __init__(self, batch_prompts: int, max_inflight_groups: int):
        self.batch_prompts = batch_prompts
        self.max_inflight_groups = max_inflight_groups

    def admits(self, view: AdmissionView) -> bool:
        return view.inflight < self.max_inflight_groups

    def select(self, pooled: PoolColumns, step: int) -> Selection | None:
        """``pooled`` holds the pooled groups in completion order, with their per-group staleness
        columns. Return None (or a Selection with an empty batch, whose removals are applied) to
        wait for more groups. Called under the pool lock every step: keep it vectorised."""
        if len(pooled) < self.batch_prompts:
            return None
        return Selection(batch=pooled.first(self.batch_prompts))

    def pfs_candidates(self, pooled: PoolColumns, step: int) -> np.ndarray:
        """Slots of the pooled groups whose Prefix Forgetting Score could change the decision at
        ``step`` (PACE, and `pace/pool/recording.py` for the record: the rollout rescores just these)."""
        return np.empty(0, dtype=np.int64)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Pool:
    def __init__(self, policy: PoolPolicy, informative: Callable[[Group], bool], capacity: int | None = None):
        if capacity is not None and capacity < policy.batch_prompts:
            raise ValueError(f"Pool: capacity {capacity} is below the batch size {policy.batch_prompts}")
        self.policy = policy
        self.informative = informative
        self.capacity = capacity
        self.capacity_blocked = False  # the last admission check was refused by the capacity
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._pooled = PoolColumns()  # completion order
        self._inflight: dict[int, Group] = {}
        self._counts: Counter[Fate] = Counter()
        self._decided: list[Group] = []  # fates decided since the last drain (for logging)
        self._arrived_since: list[Group] = []  # groups completed since the last drain (pooled or filtered)
        self.submitted = 0
        self.batches_formed = 0
        self.last_metrics: dict = {}  # the policy's metrics at the last formed batch

    # --- rollout side ------------------------------------------------------------------------
    def admits(self, engine_version: int, trainer_version: int) -> bool:
        with self._lock:
            full = self.capacity is not None and len(self._pooled) + len(self._inflight) >= self.capacity
            self.capacity_blocked = full
            return not full and self.policy.admits(self._view(engine_version, trainer_version))

    def on_submitted(self, group: Group) -> None:
        with self._lock:
            self.submitted += 1
            group.fate = Fate.INFLIGHT
            self._inflight[group.id] = group

    def add(self, group: Group, version: int) -> bool:
        """A complete, graded group arrives at trainer version ``version``. Returns True if pooled."""
        with self._arrived:
            del self._inflight[group.id]
            self._arrived_since.append(group)
            if self.informative(group):
                group.fate = Fate.POOLED
                self._pooled.append(group)
                self._arrived.notify_all()
                return True
            self._decide(group, Fate.FILTERED, "all rewards equal", version)
            self._arrived.notify_all()  # admission may open up again (sync policy)
            return False

    def drop_inflight(self, step: int, reason: str = "shutdown") -> list[Group]:
        """Stop: every group in flight ends as dropped_shutdown. Returns them (their prompts go back
        to the sampler). Call once the rollout thread has stopped adding."""
        with self._lock:
            groups = list(self._inflight.values())
            self._inflight.clear()
            for g in groups:
                self._decide(g, Fate.DROPPED_SHUTDOWN, reason, step)
            return groups

    # --- trainer side ------------------------------------------------------------------------
    def form_batch(self, step: int, timeout: float | None = None) -> Batch | None:
        """Block until the policy forms batch ``step``; None if ``timeout`` passes first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._arrived:
            while True:
                selection = self.policy.select(self._pooled, step)
                if selection is not None:
                    self._apply(selection, step)
                    if selection.batch:
                        self.batches_formed += 1
                        self.last_metrics = selection.metrics
                        return Batch(step=step, groups=selection.batch)
                # Not enough groups yet (a policy may still have removed some): wait for more.
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0 or not self._arrived.wait(left):
                    return None

    def _apply(self, selection: Selection, step: int) -> None:
        self._check(selection)
        for group, fate, reason in selection.removed:
            self._pooled.remove(group)
            self._decide(group, fate, reason, step)
        for group in selection.batch:
            self._pooled.remove(group)
            self._decide(group, Fate.CONSUMED, "", step)

    def _check(self, selection: Selection) -> None:
        """A policy's decision names each pooled group at most once, with a fate a policy may give
        (policies from outside the package are held to the protocol here, in one line)."""
        groups = selection.batch + [g for g, _, _ in selection.removed]
        allowed = (Fate.REJECTED, Fate.DROPPED_STALE)
        bad = next((f for _, f, _ in selection.removed if not (isinstance(f, Fate) and f in allowed)), None)
        if len({g.id for g in groups}) != len(groups) or not all(g in self._pooled for g in groups) or bad is not None:
            what = (f"fate {bad!r} (a policy removes groups as Fate.REJECTED or Fate.DROPPED_STALE)" if bad is not None
                    else "a group twice, or one that is not pooled")
            decider = getattr(self.policy, "wraps", self.policy)  # pool.record_effective's wrapper: the wrapped one
            raise RuntimeError(f"pool policy {type(decider).__name__}.select returned {what}")

    def abandon(self, batch: Batch, reason: str) -> None:
        """The training step on ``batch`` failed: its groups were not trained on. Consumed becomes
        dropped_shutdown (their prompts go back to the sampler with the checkpoint)."""
        with self._lock:
            ids = {g.id for g in batch.groups}
            self._decided = [g for g in self._decided if g.id not in ids]  # logged once, with the final fate
            for g in batch.groups:
                if g.fate is Fate.CONSUMED:
                    self._counts[Fate.CONSUMED] -= 1
                    self._decide(g, Fate.DROPPED_SHUTDOWN, reason, batch.step)

    def drain_decided(self) -> list[Group]:
        with self._lock:
            out, self._decided = self._decided, []
            return out

    def to_rescore(self, version: int) -> list[Group]:
        """Groups to rescore under weights ``version`` (PACE): those whose PFS could change the next
        batch's rejections, with K_gen > 0 (the term u^γ multiplies; under `pace.kv_aware` K_kv's, which
        is > 0 exactly when K_gen is: w_t ≤ v_t ≤ c, and w_t = c for a request begun at c) and no PFS
        from ``version`` yet."""
        with self._lock:
            cols = self._pooled
            slots = self.policy.pfs_candidates(cols, self.batches_formed)
            return cols.groups(slots[(cols.pfs_version[slots] != version) & (cols.k_gen[slots] > 0)])

    def set_pfs(self, group: Group, pfs: float, version: int) -> None:
        """Record a group's PFS under weights ``version``; the policy's score window learns it too."""
        with self._lock:
            group.pfs, group.pfs_version = pfs, version
            self._pooled.set_pfs(group, pfs, version)
            record = getattr(self.policy, "record_pfs", None)
            if record is not None:
                record([pfs])

    def drain_arrived(self) -> list[Group]:
        """Groups completed since the last call, filtered or not: what the current policy produces."""
        with self._lock:
            out, self._arrived_since = self._arrived_since, []
            return out

    def wake(self) -> None:
        """Wake a waiting `form_batch` (e.g. so the trainer can notice a rollout failure)."""
        with self._arrived:
            self._arrived.notify_all()

    # --- checkpoint ------------------------------------------------------------------------
    def state_dict(self, keep: set[int] = frozenset()) -> dict:
        """Everything a resumed run needs. Groups in flight whose ids are in ``keep`` (the rollout
        kept their state: pace/rollout/resuming.py) stay in flight; the others are counted as
        dropped_shutdown (the resumed run logs them so, and their prompts go back to its sampler).
        Holds the live group objects: pickle it, with the rollout's state, before the rollout
        thread runs again."""
        with self._lock:
            counts = {f.value: n for f, n in self._counts.items()}
            inflight = [g for g in self._inflight.values() if g.id in keep]
            dropped = [g for g in self._inflight.values() if g.id not in keep]
            counts[Fate.DROPPED_SHUTDOWN.value] = counts.get(Fate.DROPPED_SHUTDOWN.value, 0) + len(dropped)
            return {
                "pooled": list(self._pooled),
                "inflight": inflight,
                "dropped": dropped,
                "decided": list(self._decided),  # decided since the last drain: not logged yet
                "arrived": list(self._arrived_since),
                "counts": counts,
                "submitted": self.submitted,
                "batches_formed": self.batches_formed,
                "last_metrics": dict(self.last_metrics),
                "policy": self.policy.state_dict(),
            }

    def load_state_dict(self, state: dict, keep_inflight: bool = True) -> list[Group]:
        """Restore a checkpoint's pool. Its groups in flight stay in flight (the rollout continues
        them), or with ``keep_inflight`` False are dropped like the ones it did not keep. Returns
        the groups counted as dropped_shutdown (in flight at the checkpoint), now decided so and
        queued for logging: give their prompts back. (A checkpoint from before in-flight resume
        has no "inflight": all its groups in flight were dropped.)"""
        with self._lock:
            self._pooled = PoolColumns()
            for g in state["pooled"]:
                self._pooled.append(g)
            kept = state.get("inflight", [])
            self._inflight = {g.id: g for g in kept} if keep_inflight else {}
            self._counts = Counter({Fate(k): n for k, n in state["counts"].items()})
            dropped = list(state["dropped"]) + ([] if keep_inflight else kept)
            self._counts[Fate.DROPPED_SHUTDOWN] += 0 if keep_inflight else len(kept)
            self.submitted, self.batches_formed = state["submitted"], state["batches_formed"]
            self.last_metrics = dict(state["last_metrics"])
            self._decided = list(state["decided"])
            self._arrived_since = list(state["arrived"])
            for g in dropped:
                g.fate, g.reason, g.step = Fate.DROPPED_SHUTDOWN, "checkpoint", self.batches_formed
                self._decided.append(g)
            self.policy.load_state_dict(state["policy"])
            return dropped

    # --- accounting --------------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        with self._lock:
            out = {f.value: self._counts[f] for f in Fate}
            out[Fate.POOLED.value] = len(self._pooled)
            out[Fate.INFLIGHT.value] = len(self._inflight)
            out["submitted"] = self.submitted
            return out

    def check_accounting(self) -> None:
        c = self.counts()
        total = sum(v for k, v in c.items() if k != "submitted")
        if total != c["submitted"]:
            raise AssertionError(f"fate accounting broken: submitted={c['submitted']} but fates sum to {total}: {c}")

    def remaining(self) -> list[Group]:
        """Groups still pooled or in flight (logged with those fates at shutdown)."""
        with self._lock:
            return list(self._pooled) + list(self._inflight.values())

    @property
    def occupancy(self) -> int:
        with self._lock:
            return len(self._pooled)

    @property
    def inflight(self) -> int:
        with self._lock:
            return len(self._inflight)

    def _view(self, engine_version: int, trainer_version: int) -> AdmissionView:
        return AdmissionView(
            engine_version=engine_version,
            trainer_version=trainer_version,
            batches_formed=self.batches_formed,
            started=self.submitted,
            inflight=len(self._inflight),
            pooled=len(self._pooled),
            batch_prompts=self.policy.batch_prompts,
            discarded=self._counts[Fate.FILTERED] + self._counts[Fate.DROPPED_SHUTDOWN],
        )

    def _decide(self, group: Group, fate: Fate, reason: str, step: int) -> None:
        group.fate, group.reason, group.step = fate, reason, step
        self._counts[fate] += 1
        self._decided.append(group)
