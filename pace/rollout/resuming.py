"""Groups in flight kept across a checkpoint and continued after a restart (`rollout.resume_inflight`).
A mixin of `RolloutWorker`; state: ``_pending``, ``_grading`` (pace/rollout/generation.py) and
``_resume`` (the snapshot to continue, loaded from a checkpoint).

At a checkpoint the rollout thread is held between engine steps (or has stopped). Every group in
flight is kept as it stands: its finished responses, and for each unfinished one the tokens the
rollout has read so far with their behaviour log-probs ℓ^μ and versions v_t, and its tool-turn
state. The versions are made exact first: an out-of-process engine's tokens carry the rollout's
stamps until the request finishes (its spans replace them then), so the spans of the tokens read
so far are taken from vLLM's output processor, which labels every output with the engine's
weight version (the same record `CompletionOutput.weight_versions` is built from at the end).

On `resume=`, once the engines hold the resumed weights, each kept group is re-submitted: a
response not started is generated from the prompt, an unfinished one continues as a new turn
(prompt + kept tokens, prefilled, not sampled; the rest of its budget; the cache salted by the new
version), a response whose program was running has it run again, and a group whose responses were
all done is graded. The kept tokens keep their versions and log-probs; the continuation's carry
the resumed version, so a response spans the versions before and after and K_gen stays exact.
"""
from __future__ import annotations

import numpy as np

from pace.rollout.generation import VersionMismatch, _Pending


class ResumingMixin:
    _resume: list | None = None  # [_Pending | Group]: the checkpoint's groups in flight, to continue
    _resume_version = 0  # the resumed weights' version: groups are continued once the engines hold it
    _settled = False  # the stopped thread made the versions of its unfinished responses exact

    # --- at a checkpoint ---------------------------------------------------------------------
    def inflight_state(self) -> list:
        """The groups in flight as of now (thread paused or stopped, versions made exact): a
        `_Pending` per group still generating, the `Group` of each one being graded. Live objects:
        pickle them before the thread runs again."""
        if self._resume:  # restarted, not yet continued: still the checkpoint's
            return list(self._resume)
        alive = self.is_alive()
        if alive and self._stopping.is_set():  # asked to stop and still running: stuck in an engine call
            return []
        if alive:
            self._settle_versions()
        elif not self._settled:  # it stopped without making the versions exact (or never ran)
            return []
        return list(self._pending.values()) + [group for group, _ in self._grading]

    def _settle_versions(self) -> None:
        """The tokens read so far of every unfinished request take vLLM's per-token versions (from
        its output processor). Call between engine steps, before the requests are aborted."""
        for pending in self._pending.values():
            for idx, traj in pending.responses.items():
                if traj.completed_at >= 0 or idx in pending.tool_wait:
                    continue  # finished, or between turns: its versions are final already
                start = pending.turn_start.get(idx, 0)
                versions = self.engine.partial_versions(pending.request_id(idx), len(traj) - start)
                if versions is None:  # no labels for this turn's tokens: keep the response up to the turn
                    if not self.engine.in_process and len(traj) > start:  # (in process, the stamps are exact)
                        self.stats["resume_unlabelled_tokens"] += len(traj) - start
                        traj.truncate(start)
                    continue
                if self.engine.in_process and not np.array_equal(versions, traj.versions[start:]):
                    raise VersionMismatch(f"weight versions {versions.tolist()} disagree with the rollout's stamps "
                                          f"{traj.versions[start:].tolist()} (request {pending.request_id(idx)})")
                traj.versions[start:] = versions

    # --- after a restart ---------------------------------------------------------------------
    def load_inflight(self, kept: list, version: int) -> None:
        """Before `start()`: the checkpoint's groups in flight (the pool counts them in flight)."""
        self._resume, self._resume_version = list(kept), version

    def _continue_resumed(self) -> bool:
        """Re-submit the kept groups once the engines hold the resumed weights (rollout thread)."""
        if not self._resume or self.engine_version < self._resume_version:
            return False
        kept, self._resume = self._resume, None
        for item in kept:
            if not isinstance(item, _Pending):  # all responses were done: grade it
                pending = _Pending(item, 0, {i: t for i, t in enumerate(item.trajectories)})
                self._pending[item.id] = pending
                self._finish_group(pending)
                self.stats["resumed_groups"] += 1
                continue
            self._pending[item.group.id] = item
            for idx in range(self.group_size):
                traj = item.responses.get(idx)
                if traj is None or len(traj) == 0:  # not started: from the prompt
                    item.responses.pop(idx, None)
                    item.turns.pop(idx, None)
                    item.turn_start.pop(idx, None)
                    prompt = {"prompt_token_ids": item.group.prompt_ids, "cache_salt": self._salt()}
                    self.engine.add_request(item.request_id(idx), prompt, self.params, group=f"g{item.group.id}")
                    continue
                if traj.completed_at >= 0:
                    continue  # finished before the checkpoint
                traj.resumed = len(traj)
                self.stats["resumed_tokens"] += len(traj)
                if idx in item.tool_wait:  # its program was running: run it again
                    start = item.turn_start.get(idx, 0)
                    self.tools.submit((item.group.id, idx), traj.response_ids[start:].tolist(),
                                      self.cfg.rollout.max_tokens - len(traj))
                else:
                    self._continue(item, idx)
            self.stats["resumed_groups"] += 1
        return True

    def _salt(self) -> str:
        from pace.rollout import engine as engine_lib

        return engine_lib.cache_salt(self.engine_version)
