"""PACE's prefix rescoring on the rollout engines (docs/design.md §3): the Prefix Forgetting Score of
pooled groups under the loaded weights. A mixin of `RolloutWorker`; state: ``_rescoring``
(group id → job), ``_rescore_started``, ``prefix_tokens``, and the worker's counters.

A group is scored as soon as it becomes a rejection candidate, under the weights loaded then (its
early tokens are already older), and again after each update while it stays one, so a score is
in before the trainer ranks it. Scoring requests (prompt + first m response tokens, one prefill
with prompt log-probs) run in the same engine steps as generation, ahead of queued generation
requests (priority −1), so rescoring overlaps generation and training; `rescore_s` is the wall
time during which any score is pending.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from pace.records import Group, Trajectory
from pace.rollout import engine as engine_lib
from pace.rollout import request_ids


@dataclass
class _Rescore:
    """A pooled group whose response prefixes are being rescored under weights ``version``."""

    group: Group
    version: int
    remaining: int
    distances: dict[int, float] = field(default_factory=dict)


class RescoringMixin:
    def _cancel_rescoring(self) -> None:
        """Before new weights load: a score still pending would be computed (at least in part) by
        them but recorded as the old version's, so it is dropped; `_start_rescoring` asks again
        under the new weights (a prefix is one short prefill)."""
        if not self._rescoring:
            return
        ids = [request_ids.scoring(gid, i) for gid, job in self._rescoring.items()
               for i in range(len(job.group.trajectories)) if i not in job.distances]
        self.fleet.abort_request(ids)
        self.stats["rescore_cancelled"] += len(ids)
        self._rescoring.clear()
        self.stats["rescore_s"] += time.perf_counter() - self._rescore_started
        self._rescore_started = None

    def _start_rescoring(self) -> None:
        """Score the pooled groups whose PFS could change the next rejections (`Pool.to_rescore`) and
        that have none under the loaded weights: after each update and as groups arrive."""
        self._rescore(self.pool.to_rescore(self.engine_version))

    def _rescore(self, groups: list[Group]) -> None:
        """Submit prompt + first m response tokens of each group under the engine's weights."""
        salt = engine_lib.cache_salt(self.engine_version)
        v, m = self.engine_version, self.prefix_tokens
        for group in groups:
            if group.id in self._rescoring:
                continue  # still being scored under an earlier version: rescored at the next update
            # A prefix generated entirely by the loaded weights has distance 0 by definition: no request.
            todo = [i for i, t in enumerate(group.trajectories) if (t.versions[:m][_actions(t, m)] != v).any()]
            job = self._rescoring[group.id] = _Rescore(group, v, len(todo))
            job.distances.update({i: 0.0 for i in range(len(group.trajectories)) if i not in todo})
            self.stats["rescore_skipped"] += len(group.trajectories) - len(todo)
            self.stats["rescore_seqs"] += len(todo)
            if not todo:
                self._finish_rescore(job)
            for i in todo:
                ids = group.prompt_ids + group.trajectories[i].response_ids[:m].tolist()
                self.fleet.add_request(request_ids.scoring(group.id, i), {"prompt_token_ids": ids, "cache_salt": salt},
                                       engine_lib.scoring_params(len(ids)), priority=engine_lib.SCORING_PRIORITY,
                                       group=request_ids.group_key(request_ids.SCORING, group.id))
        if self._rescoring and self._rescore_started is None:
            self._rescore_started = time.perf_counter()

    def _consume_score(self, out) -> None:
        rid = request_ids.parse(out.request_id)
        gid, idx = rid.group, rid.index
        job = self._rescoring.get(gid)
        if job is None:  # cancelled by a weight update (its last output may still arrive)
            return
        traj = job.group.trajectories[idx]
        m = min(self.prefix_tokens, len(traj))
        ids = job.group.prompt_ids + traj.response_ids[:m].tolist()
        current = np.asarray(engine_lib.prompt_token_logprobs(out, ids, len(job.group.prompt_ids)), dtype=np.float64)
        # over the model's own tokens: tool output in the prefix is context, with no ℓ^μ
        act = _actions(traj, m)
        diffs = np.abs(current - traj.logprobs[:m].astype(np.float64))[act]
        job.distances[idx] = float(diffs.sum()) / max(diffs.size, 1)
        job.remaining -= 1
        if job.remaining == 0:
            self._finish_rescore(job)

    def _finish_rescore(self, job: _Rescore) -> None:
        del self._rescoring[job.group.id]
        self.fleet.release_group(request_ids.group_key(request_ids.SCORING, job.group.id))
        self.pool.set_pfs(job.group, sum(job.distances.values()) / len(job.distances), job.version)
        self.stats["rescored"] += 1
        if not self._rescoring and self._rescore_started is not None:
            self.stats["rescore_s"] += time.perf_counter() - self._rescore_started
            self._rescore_started = None

    def _rescoring_ids(self) -> list[str]:
        return [request_ids.scoring(gid, i) for gid, job in self._rescoring.items()
                for i in range(len(job.group.trajectories))]


def _actions(traj: Trajectory, m: int) -> np.ndarray:
    """Which of the first ``m`` response tokens the model generated (bool)."""
    return np.ones(min(m, len(traj)), dtype=bool) if traj.action_mask is None else traj.action_mask[:m]
