"""A rollout engine that fails (server mode, pace/rollout/remote.py). A mixin of `RolloutWorker`.

`rollout.on_engine_failure=stop`, or no engine left: the rollout thread raises `EngineFailed`
naming the engine and the cause; the run stops with a checkpoint (train.py), and `resume=` goes on
from it.

`continue`: a warning, and the failed engine's work goes to the live ones (`rollout/engines_alive`
drops). Nothing is dropped and no fate changes: every group keeps its id, its prompt and its place
in flight, so the accounting adds up as if nothing happened, and no prompt is skipped or drawn
twice. What the engine held:
- a generation request: its response keeps every finished turn (their tokens carry the versions
  the engine stamped) and loses the unfinished turn's tokens, whose versions the engine had not
  yet reported (`rollout.failover_lost_tokens`); it then continues from there as a new turn on a
  live engine (prompt + kept tokens prefilled), or starts again from the prompt if nothing was kept;
  with MoE routing replay it keeps the routes of its finished turns, and the continuation asks for
  those of every later position (the unfinished turn's went with its engine: pace/rollout/routes.py);
- a prefix-scoring request: its group's scoring is dropped (`rescore_cancelled`) and asked again
  after the next update, as when new weights land while it runs;
- a validation request: sent again to a live engine (the weights are held until it is graded);
- a stale-KV probe: dropped (`kv_probe_cancelled`), not sent again (pace/rollout/kv_probe.py).

An engine that comes back, or joins (pace/rollout/healing.py), takes requests only after the update
that caught it up: judged on its own (a joiner whose weights are not the trainer's is failed, not the
run), then promoted.
"""
from __future__ import annotations

import sys

from pace.errors import EngineFailed
from pace.rollout import request_ids


class FailoverMixin:
    def _check_engines(self) -> bool:
        failures = self.fleet.take_failures()
        restarts = self.fleet.restarts  # started again (pace/rollout/healing.py), counted by the fleet
        self.stats["engine_restarts"] += restarts - self._restarts_seen
        self._restarts_seen = restarts
        for f in failures:
            if f.drained:
                print(f"rollout engine {f.index} ({f.url}) drained: {f.cause}; its {len(f.request_ids)} requests sent to "
                      f"the others", file=sys.stderr, flush=True)
                self._recover(f.request_ids)
                continue
            self.stats["engine_failures"] += 1
            alive = len(self.fleet.alive)
            if not f.serving:  # starting or catching up: it held no request, and is brought back again
                print(f"warning: rollout engine {f.index} ({f.url}) failed before it served: {f.cause}",
                      file=sys.stderr, flush=True)
                continue
            if self.cfg.rollout.on_engine_failure == "stop" or not alive:
                why = "no rollout engine is left" if not alive else "rollout.on_engine_failure=stop"
                raise EngineFailed(f"rollout engine {f.index} ({f.url}) failed: {f.cause} ({why})")
            print(f"warning: rollout engine {f.index} ({f.url}) failed: {f.cause}; going on with {alive} engine(s), "
                  f"its {len(f.request_ids)} requests sent to them", file=sys.stderr, flush=True)
            self._recover(f.request_ids)
        return bool(failures)

    def _recover(self, lost: list[str]) -> None:
        scoring = set()
        for rid in lost:
            self.stats["failover_requests"] += 1
            parsed = request_ids.parse(rid)
            if parsed.kind == request_ids.SCORING:
                scoring.add(parsed.group)
            elif parsed.kind == request_ids.VALIDATION:
                self._val[0].resubmit(self.fleet, rid)
            elif parsed.kind == request_ids.KV_PROBE:
                self._drop_kv_probes([rid])
            else:
                self._recover_response(parsed)
        for gid in scoring:
            job = self._rescoring.pop(gid, None)
            if job is not None:
                self.fleet.abort_request([request_ids.scoring(gid, i) for i in range(len(job.group.trajectories))])
                self.fleet.release_group(request_ids.group_key(request_ids.SCORING, gid))
                self.stats["rescore_cancelled"] += len(job.group.trajectories) - len(job.distances)
        if not self._rescoring and self._rescore_started is not None:
            import time

            self.stats["rescore_s"] += time.perf_counter() - self._rescore_started
            self._rescore_started = None

    def _recover_response(self, rid: request_ids.RequestId) -> None:
        gid, idx = rid.group, rid.index
        pending = self._pending[gid]
        traj = pending.responses.get(idx)
        start = pending.turn_start.get(idx, 0)
        if traj is not None and len(traj) > start:
            self.stats["failover_lost_tokens"] += len(traj) - start
            traj.truncate(start)
        if traj is None or len(traj) == 0:
            self._restart(pending, idx)
        else:
            self._continue(pending, idx)

    def _judge(self, version: int, joining: list[int]):
        """The engines' fingerprints of θ_version against the trainer's; a joiner is judged on its own
        and failed (brought back again), not the run, if its catch-up update did not take."""
        if not joining:
            return self.sent_weights.judge(version, self.fleet.fingerprints())
        prints = self.fleet.fingerprints_by_engine()
        for i in joining:
            stale = self.sent_weights.judge(version, prints.pop(i, []))
            if stale is not None:
                self.fleet.fail_engine(i, f"its catch-up update is not θ_{version}: {stale}")
        return self.sent_weights.judge(version, [p for found in prints.values() for p in found])

    def _promote(self, joining: list[int]) -> None:
        for i in joining:
            seconds = self.fleet.promote(i)
            if seconds is not None:
                self.stats["engine_joins"] += 1
                self._join_s.append(seconds)
