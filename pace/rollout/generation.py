"""Generation on the rollout engines: groups in, graded groups out to the pool. A mixin of
`RolloutWorker`; state: ``_pending`` (group id → its responses so far), ``_grading`` (groups
being graded, in completion order), ``_next_group_id``.

Every new token gets v_t = the weights that sampled it and its ℓ^μ_t. The rollout thread stamps
each step's tokens with the version it has loaded; vLLM labels them too (`weight_versions`, the
version set with each update), and when a request finishes its spans replace the stamps. With
an in-process engine handing over every token at its step (`rollout.stream_interval=1`) the two
must agree exactly (checked: `stamps_exact`); an out-of-process engine core runs ahead of what the
rollout thread has read, and chunks (`stream_interval` > 1) arrive after some of their tokens'
steps, so there the spans are the record. ℓ^μ is read from vLLM's flat log-prob lists
(`engine.sampled_logprobs`). A response that
finishes gets c(τ) = the trainer's version at that moment; a group whose G responses are done is
graded (process pool, non-blocking) and then pooled. Each response records the engine that served
it (`Trajectory.engine`, from the fleet's `engine` on each output; −1 once a second one served it).

MoE routing replay (`algo.routing_replay`): each generation request asks for the routed experts of
the positions its response has not recorded yet, and its finished output's rows are recorded
(pace/rollout/routes.py). Scoring, stale-KV probe and validation requests are not recorded: the
first two ask for no routes (`engine.scoring_params`), validation's are returned and dropped with
the rest of its outputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pace.algo.advantages import correctness_reward, group_advantages, overlong_penalty
from pace.records import Group, Trajectory
from pace.rollout import engine as engine_lib
from pace.rollout import request_ids
from pace.rollout import routes as routes_lib
from pace.tools.runner import is_tool_stop


@dataclass
class _Pending:
    group: Group
    remaining: int
    responses: dict[int, Trajectory] = field(default_factory=dict)
    turns: dict[int, int] = field(default_factory=dict)  # multi-turn: response → current turn (its request id's)
    turn_start: dict[int, int] = field(default_factory=dict)  # response → index of its current turn's first token
    tool_wait: set[int] = field(default_factory=set)  # responses whose program is running (multi-turn)
    # response → index of the first token the model wrote after its last tool output (where the
    # program it is writing starts); a continuation after a restart leaves it, a tool turn moves it
    code_from: dict[int, int] = field(default_factory=dict)
    # MoE routing replay: response → the first sequence position its current request returns routes
    # for (its `routed_experts_prompt_start`; absent: 0, a first request)
    route_start: dict[int, int] = field(default_factory=dict)

    def __setstate__(self, state) -> None:  # (route_start: absent from checkpoints before routing replay)
        self.__dict__.update({"route_start": {}} | state)

    def request_id(self, i: int) -> str:
        return request_ids.response(self.group.id, i, self.turns.get(i, 0))

    @property
    def key(self) -> str:
        """The group key that keeps its requests on one engine."""
        return request_ids.group_key(request_ids.RESPONSE, self.group.id)


class VersionMismatch(RuntimeError):
    """vLLM's weight-version spans disagree with the rollout thread's stamps (in-process engine)."""


def span_versions(spans) -> np.ndarray:
    """Per-token versions from vLLM's `WeightVersionSpan`s (labels are the published versions)."""
    return np.repeat(np.array([int(s.version) for s in spans], dtype=np.int32),
                     np.array([s.end - s.start for s in spans], dtype=np.int64))


class GenerationMixin:
    def _turn_params(self, max_tokens: int, calls: int, routes_from: int = 0):
        """A generation request's parameters; ``routes_from``: the first sequence position whose
        routed experts it returns (`routes_lib.prompt_start`; used only by an engine that returns them)."""
        from vllm import SamplingParams

        tool = self.tools.turn_kwargs(calls) if self.tools is not None else {}
        return SamplingParams(max_tokens=max_tokens, stop_token_ids=self._stop_ids,
                              routed_experts_prompt_start=routes_from, **tool, **self._sampling)

    def _admit(self) -> bool:
        started = False
        if self.trainer_version >= self.final_version:
            return False  # training is over; only the final validation may still run
        while self.pool.admits(self.engine_version, self.trainer_version):
            prompt = self.sampler.next()
            group = Group(
                id=self._next_group_id,
                prompt_id=prompt.id,
                prompt_ids=self.tokenizer(prompt.text, add_special_tokens=False).input_ids,
                answer=prompt.answer,
                submitted_at=self.trainer_version,
                kv_reprefill=self.cfg.rollout.kv_on_update == "recompute",
            )
            self._next_group_id += 1
            self.pool.on_submitted(group)
            self._pending[group.id] = _Pending(group, self.group_size)
            for i in range(self.group_size):
                self._start_response(self._pending[group.id], i)
            started = True
        return started

    def _start_response(self, pending: _Pending, i: int) -> None:
        """Response ``i`` from the prompt, salted with the weights loaded now."""
        prompt = {"prompt_token_ids": pending.group.prompt_ids, "cache_salt": engine_lib.cache_salt(self.engine_version)}
        self.fleet.add_request(pending.request_id(i), prompt, self.params, group=pending.key)

    def _consume(self, outputs) -> None:
        version = self.engine_version  # every token of this step came from these weights (in-process)
        for out in outputs:
            rid = request_ids.parse(out.request_id)
            if rid.kind == request_ids.SCORING:
                if out.finished:
                    self._consume_score(out)
                continue
            if rid.kind == request_ids.KV_PROBE:  # not generation: no token counted
                if out.finished:
                    self._consume_kv_probe(out)
                continue
            if rid.kind == request_ids.VALIDATION:
                self._val[0].on_output(out)
                continue
            gid, idx = rid.group, rid.index
            pending = self._pending[gid]
            traj = pending.responses.get(idx)
            if traj is None:
                traj = pending.responses[idx] = Trajectory(engine=out.engine)
            else:
                traj.served_by(out.engine)
            tool_call = False
            for comp in out.outputs:  # this step's new tokens (delta outputs), appended as one chunk
                traj.extend(comp.token_ids, engine_lib.sampled_logprobs(comp), version)
                self.stats["tokens"] += len(comp.token_ids)
                if out.finished:
                    self._record_spans(traj, pending.turn_start.get(idx, 0), comp.weight_versions)
                    if self.cfg.algo.routing_replay:
                        self._record_routes(pending, idx, traj, comp, out)
                    traj.finish_reason = comp.finish_reason or "stop"
                    tool_call = self.tools is not None and is_tool_stop(comp)
            left = self.cfg.rollout.max_tokens - len(traj) if tool_call else 0
            if left > 0:  # the turn ended at </code>: run the program, the response continues after it
                pending.tool_wait.add(idx)
                self.tools.submit((gid, idx), traj.response_ids[pending.code_from.get(idx, 0):].tolist(), left)
            elif out.finished:
                self._maybe_probe_kv(pending.group, idx, traj)  # versions final: pace/rollout/kv_probe.py
                self._finish_response(pending, traj)

    def _record_spans(self, traj: Trajectory, start: int, spans) -> None:
        """The finished turn's tokens (from ``start``) take vLLM's per-token versions."""
        if spans is None:  # vLLM gives none for a turn that produced no token
            return
        versions = span_versions(spans)
        if len(versions) != len(traj) - start:
            raise VersionMismatch(f"weight_versions cover {len(versions)} tokens, the turn has {len(traj) - start}")
        if self.stamps_exact:
            if not np.array_equal(versions, traj.versions[start:]):
                raise VersionMismatch(f"weight_versions {[(s.version, s.start, s.end) for s in spans]} disagree with "
                                      f"the rollout's stamps {traj.versions[start:].tolist()}")
            self.stats["versions_checked"] += len(versions)  # tokens whose spans equalled the stamps
        traj.versions[start:] = versions

    def _record_routes(self, pending: _Pending, idx: int, traj: Trajectory, comp, out) -> None:
        """The finished request's routed experts, from the position it asked for: the positions the
        response had not recorded (those it recorded, from an earlier request, are kept). A request
        aborted at a stop delivers none (vLLM's `LLMEngine.abort_request` emits no final output):
        the rows computed so far are read from the output processor before the abort (in process
        and child engines: pace/rollout/resuming.py); a server's request closed at a stop and one
        lost with its engine (a failover) keep none: the continuation's request asks for them from
        the first unknown position (computed again by the weights loaded then). Under
        rollout.kv_on_update=recompute an update re-prefills a running request without emitting its
        rows again: its one array keeps the rows computed first, as under keep."""
        routes_lib.record(traj, getattr(comp, "routed_experts", None), pending.route_start.get(idx, 0),
                          len(pending.group.prompt_ids), out.request_id, getattr(out, "engine", None))

    def _finish_response(self, pending: _Pending, traj: Trajectory) -> None:
        traj.completed_at = self.trainer_version
        traj.finish()
        pending.remaining -= 1
        if pending.remaining == 0:
            self._finish_group(pending)

    def _finish_group(self, pending: _Pending) -> None:
        del self._pending[pending.group.id]
        self.fleet.release_group(pending.key)
        group = pending.group
        group.trajectories = [pending.responses[i] for i in range(self.group_size)]
        # graded on the model's own tokens: in a tool rollout a program printing "Answer: ..." must not answer
        # for it. The text is not kept (the pool holds token ids only).
        texts = self.tokenizer.batch_decode([t.action_ids.tolist() for t in group.trajectories], skip_special_tokens=True)
        self._grading.append((group, self.grader.submit(texts, [group.answer] * len(texts))))

    def _collect_grades(self) -> bool:
        if self.grader is not None:
            self.grader.check()  # a failed grader stops the run now, not at the next finished group
        done = False
        # Grades come back in submission order (completion order): the pool stays FIFO by completion.
        while self._grading and self._grading[0][1].done():
            group, job = self._grading.popleft()
            self._score(group, job.result())
            if self.pool.add(group, self.trainer_version) and self.prefix_tokens:
                # the arrival raises the occupancy, and so the predicted budget and the candidates
                self._start_rescoring()
            done = True
        return done

    def _score(self, group: Group, correct: list[bool]) -> None:
        r = self.cfg.rollout
        for traj, ok in zip(group.trajectories, correct):
            traj.correct = ok
            traj.reward = correctness_reward(ok) + overlong_penalty(len(traj), r.max_tokens, r.overlong_buffer)
        for traj, adv in zip(group.trajectories, group_advantages([t.reward for t in group.trajectories], self.cfg.algo.adv_eps,
                                                                       self.cfg.algo.std_unbiased)):
            traj.advantage = adv

    def _count_reprefill(self) -> None:
        """recompute: the tokens the update makes the engines prefill again, as this thread sees them:
        prompt + response so far of every response whose request has produced a token (a request
        prefilled whose first token has not reached this thread yet is not counted, nor the up to
        rollout.stream_interval − 1 tokens a request has not handed over; nor are scoring and
        validation requests, prefilled again too)."""
        if not self.fleet.reprefill_on_update:
            return
        n = 0
        for pending in self._pending.values():
            for idx, traj in pending.responses.items():
                if traj.completed_at < 0 and idx not in pending.tool_wait and len(traj) > pending.turn_start.get(idx, 0):
                    n += len(pending.group.prompt_ids) + len(traj)
        self.stats["reprefill_tokens"] += n
