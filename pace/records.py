"""Typed records that cross stage boundaries: rollout → pool (`Group`), pool → trainer (`Batch`).

Nothing else crosses: the rollout hands the pool complete, graded groups; the pool hands the
trainer a batch and a list of fates to log.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from pace import staleness


class Fate(str, Enum):
    """Where a submitted group ended (DESIGN §3). Every group has exactly one."""

    INFLIGHT = "inflight"  # submitted to the engine, not all responses done or graded
    POOLED = "pooled"  # complete and graded, waiting in the pool
    CONSUMED = "consumed"  # trained on
    REJECTED = "rejected"  # removed by a pool policy (with a reason)
    FILTERED = "filtered"  # dynamic sampling: all responses scored the same
    DROPPED_STALE = "dropped_stale"  # Stale-k: K above pool.max_lag at consumption
    # cut short by a stop (SIGTERM/SIGINT, a failure) or left out of a checkpoint: in flight at the
    # checkpoint, or in the batch of a training step that failed. Its prompt goes back to the sampler.
    DROPPED_SHUTDOWN = "dropped_shutdown"


@dataclass
class Trajectory:
    """One response. ``logprobs[t]`` is ℓ^μ_t and ``versions[t]`` is v_t of response token t.

    In a multi-turn tool rollout the response also holds tool-output tokens: context the policy
    did not choose. ``action_mask[t]`` is False for those (their log-prob and version entries are
    placeholders): they are masked out of the loss and left out of the staleness averages
    (DESIGN §2 averages over model-generated tokens). None: every token is an action.
    """

    response_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    completed_at: int  # c(τ): trainer version when the last token was produced
    finish_reason: str  # "stop" (EOS) or "length" (hit rollout.max_tokens)
    text: str = ""
    correct: bool = False
    reward: float = 0.0  # ±1 correctness plus overlong shaping
    advantage: float = 0.0
    action_mask: list[bool] | None = None
    tool_calls: int = 0  # multi-turn: programs run for this response
    tool_errors: int = 0  # of which did not succeed (error, timeout, killed, no program)

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def num_actions(self) -> int:
        """Model-generated tokens (the loss's token count)."""
        return len(self.response_ids) if self.action_mask is None else sum(self.action_mask)

    @property
    def action_ids(self) -> list[int]:
        """The model-generated tokens (what a multi-turn response is graded on)."""
        if self.action_mask is None:
            return self.response_ids
        return [t for t, a in zip(self.response_ids, self.action_mask) if a]

    @property
    def action_versions(self) -> list[int]:
        """v_t of the model-generated tokens (what the staleness averages run over)."""
        if self.action_mask is None:
            return self.versions
        return [v for v, a in zip(self.versions, self.action_mask) if a]


@dataclass
class Group:
    """The G responses to one prompt: the pool's unit."""

    id: int
    prompt_id: str
    prompt_ids: list[int]
    answer: str
    submitted_at: int  # trainer version when the prompt was submitted to the engine
    trajectories: list[Trajectory] = field(default_factory=list)
    fate: Fate = Fate.INFLIGHT
    reason: str = ""
    step: int | None = None  # trainer step at which the fate was decided (consumed/rejected/…)
    pfs: float | None = None  # Prefix Forgetting Score (PACE), None when not rescored
    scores: dict = field(default_factory=dict)  # policy-specific ranking values, logged per group
    pfs_version: int | None = None  # engine version the PFS was computed under
    _k_gen: float | None = field(default=None, repr=False, compare=False)
    _c_mean: float = field(default=0.0, repr=False, compare=False)

    @property
    def completed_at(self) -> int:
        """The group enters the pool at the version its last trajectory completed."""
        return max(t.completed_at for t in self.trajectories)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.trajectories)

    def staleness(self, step: int) -> tuple[float, float, float]:
        """Token-weighted (K, K_gen, K_wait) if consumed at ``step``."""
        return staleness.group_staleness(
            [t.action_versions for t in self.trajectories], [t.completed_at for t in self.trajectories], step
        )

    def k_gen(self) -> float:
        """Generation Staleness: fixed once the group is complete, so computed once."""
        if self._k_gen is None:
            # K_gen does not depend on the step; at step = c(group), K_wait = c − c̄ gives c̄ too.
            _, self._k_gen, wait = self.staleness(self.completed_at)
            self._c_mean = self.completed_at - wait
        return self._k_gen

    def k_wait(self, step: int) -> float:
        """Token-weighted Waiting Staleness at ``step`` = step − c̄ (c̄: token-weighted mean of the
        trajectories' completion versions), in O(1) for pool policies that rank every step."""
        self.k_gen()
        return step - self._c_mean


@dataclass
class Batch:
    """What the trainer consumes at step ``step``: B groups (G trajectories each)."""

    step: int
    groups: list[Group]

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]
