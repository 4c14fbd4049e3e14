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
With MoE routing replay a kept response keeps the routes of its finished requests (a turn ended at a
tool call, an earlier continuation) and, at a stop, those its unfinished request had computed: vLLM
returns routes on a finished output only, so they are read from its output processor just before the
stop's abort (`Fleet.partial_routes`; engines whose processor runs in this process — in process and
child engines — not servers). The continuation asks for the routes from the first unknown position
on (pace/rollout/routes.py). A periodic checkpoint, after which the requests run on, keeps only the
finished requests' routes (the running one records its own when it finishes).
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
        unlabelled = self._settle_versions(cut=False) if alive else set()
        if not alive and not self._settled:  # it stopped without making the versions exact (or never ran)
            return []
        return [p for p in self._pending.values() if p.group.id not in unlabelled] + [g for g, _ in self._grading]

    def _settle_versions(self, cut: bool) -> set[int]:
        """The tokens read so far of every unfinished request take vLLM's per-token versions (from
        its output processor). Call between engine steps. Out of process, a request's tokens that
        have no labels are cut from the response when ``cut`` (its request is about to be aborted);
        otherwise (the request runs on) its group is returned, to be left out of a snapshot."""
        unlabelled = set()
        for pending in self._pending.values():
            for idx, traj in pending.responses.items():
                if traj.completed_at >= 0 or idx in pending.tool_wait:
                    continue  # finished, or between turns: its versions are final already
                if cut and self.cfg.algo.routing_replay:  # the abort would lose the routes computed so far
                    rows = self.fleet.partial_routes(pending.request_id(idx))
                    if rows is not None:
                        traj.add_routes(rows, pending.route_start.get(idx, 0), len(pending.group.prompt_ids))
                start = pending.turn_start.get(idx, 0)
                versions = self.fleet.partial_versions(pending.request_id(idx), len(traj) - start)
                if versions is None:  # (exact stamps: nothing to do)
                    if not self.stamps_exact and len(traj) > start:
                        if not cut:
                            unlabelled.add(pending.group.id)
                            continue
                        self.stats["resume_unlabelled_tokens"] += len(traj) - start
                        traj.truncate(start)  # the response goes on from its request's start
                    continue
                if self.stamps_exact and not np.array_equal(versions, traj.versions[start:]):
                    raise VersionMismatch(f"weight versions {versions.tolist()} disagree with the rollout's stamps "
                                          f"{traj.versions[start:].tolist()} (request {pending.request_id(idx)})")
                traj.versions[start:] = versions
        return unlabelled

    # --- after a restart ---------------------------------------------------------------------
    def load_inflight(self, kept: list, version: int) -> None:
        """Before `start()`: the checkpoint's groups in flight (the pool counts them in flight). A group
        submitted under rollout.kv_on_update=recompute and continued under keep is not prefilled again at
        every update any more: its K_kv is counted as keep's, for all its tokens (an overstatement for
        those generated under recompute, which had a fresh context; never an understatement)."""
        if not self.fleet.reprefill_on_update:
            for item in kept:
                getattr(item, "group", item).kv_reprefill = False
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
                if traj is None or len(traj) == 0:  # not started
                    self._restart(item, idx)
                    continue
                if traj.completed_at >= 0:
                    continue  # finished before the checkpoint
                if idx in item.tool_wait:  # its program was running: run it again
                    self._keep(traj)
                    self.tools.submit((item.group.id, idx), traj.response_ids[item.code_from.get(idx, 0):].tolist(),
                                      self.cfg.rollout.max_tokens - len(traj))
                    continue
                self._cut_partial_stop(item, idx)
                if len(traj) == 0:  # nothing left to keep
                    self._restart(item, idx)
                    continue
                self._keep(traj)
                self._continue(item, idx)
            self.stats["resumed_groups"] += 1
        return True

    def _restart(self, pending, idx: int) -> None:
        """Response ``idx`` from its prompt, as if it had not started."""
        for state in (pending.responses, pending.turns, pending.turn_start, pending.code_from, pending.route_start):
            state.pop(idx, None)
        self._start_response(pending, idx)

    def _keep(self, traj) -> None:
        traj.resumed = len(traj)
        traj.engine = -1  # its kept tokens came from an engine of the earlier process
        self.stats["resumed_tokens"] += len(traj)

    def _cut_partial_stop(self, pending, idx: int) -> None:
        """A tool response whose kept text ends within `</code>` (say with `</co`) would never stop
        there: vLLM matches stop strings in a request's own output only. Its tokens from the one
        holding the start of that partial stop string on are dropped (generated again)."""
        traj = pending.responses[idx]
        if self.tools is None or not self.tools.turn_kwargs(traj.tool_calls):
            return  # no stop string in this turn
        from pace.tools.protocol import CODE_STOP

        start = pending.code_from.get(idx, 0)
        ids = traj.response_ids[start:].tolist()
        text = self.tokenizer.decode(ids)
        k = next((k for k in range(len(CODE_STOP) - 1, 0, -1) if text.endswith(CODE_STOP[:k])), 0)
        if k == 0:
            return
        m = len(ids)
        while m > 0 and len(self.tokenizer.decode(ids[:m])) > len(text) - k:
            m -= 1
        self.stats["resume_cut_tokens"] += len(ids) - m
        traj.truncate(start + m)
