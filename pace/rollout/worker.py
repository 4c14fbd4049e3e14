"""The rollout thread: owns the vLLM engine, streams groups into the pool (DESIGN §5).

Loop, one engine step at a time:
    apply a pending weight update (between steps; in-flight requests continue under new weights)
    start new groups while the pool policy admits them
    step the engine; append each new token with v_t = the engine's loaded version and ℓ^μ_t
    a response that finishes gets c(τ) = the trainer's version at that moment
    a group whose G responses are done is graded (process pool, non-blocking) and then pooled
    in-training validation (`eval.every`): right after loading θ_v for a due v, submit the
    validation set (one n = k request per problem, ahead of rollout work) and hold further weight
    updates until it is graded, so every validation sample comes from θ_v exactly

Multi-turn tool use (`rollout.max_tool_calls` > 0, issue #7): a turn that stops at `</code>` hands
its program to the `ToolRunner` (sandbox calls on a thread pool, while the engine steps the other
requests); when the call returns, its interpreter text is tokenized and appended to the response
as context (action_mask False, no behaviour log-prob: placeholder 0.0 and the engine version),
and a continuation request (prompt + response so far, the rest of the `max_tokens` budget) goes
back into the engine, salted with the weights version then loaded. Weight updates can land within
a turn (in-flight requests continue) and between turns; the per-token versions record both. After
`max_tool_calls` calls the stop string is no longer set. c(τ) is set when the last turn finishes.

An exception here is stored in `error` and the trainer re-raises it within one poll interval.
A checkpoint is taken while the thread is `paused()` between engine steps, so the pool, the
sampler and the group ids it records are one consistent moment.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

from pace.algo.advantages import correctness_reward, group_advantages, overlong_penalty
from pace.pool import Pool
from pace.records import Group, Trajectory
from pace.rollout import engine as engine_lib
from pace.tasks.base import PromptSampler
from pace.tools.runner import is_tool_stop


class RolloutError(RuntimeError):
    """The rollout thread died; the message carries its traceback."""


@dataclass
class _Pending:
    group: Group
    remaining: int
    responses: dict[int, Trajectory] = field(default_factory=dict)
    turns: dict[int, int] = field(default_factory=dict)  # multi-turn: response → current turn (request id suffix)
    turn_start: dict[int, int] = field(default_factory=dict)  # response → index of its current turn's first token

    def request_id(self, i: int) -> str:
        turn = self.turns.get(i, 0)
        return f"g{self.group.id}-{i}" if turn == 0 else f"g{self.group.id}-{i}-{turn}"


@dataclass
class _Rescore:
    """A pooled group whose response prefixes are being rescored under weights ``version``."""

    group: Group
    version: int
    remaining: int
    distances: dict[int, float] = field(default_factory=dict)


@dataclass
class Validation:
    """mean@k of θ_version on the validation sets, handed to the trainer thread."""

    version: int
    results: dict[str, list[list[bool]]]  # per set, per problem, the k grades
    seconds: float  # submission to last grade; weight updates were held meanwhile
    response_len: float  # mean over all samples, tokens
    weights: list | None  # θ_version as (name, tensor); None for version 0 (the model on disk)


class RolloutWorker(threading.Thread):
    def __init__(self, llm, tokenizer, sampler: PromptSampler, pool: Pool, grader, cfg, val_sets: dict | None = None):
        super().__init__(name="rollout", daemon=True)
        from vllm.sampling_params import RequestOutputKind

        self.llm = llm
        self.engine = llm.llm_engine
        self.tokenizer = tokenizer
        self.sampler = sampler
        self.pool = pool
        self.grader = grader
        self.cfg = cfg
        self.group_size = cfg.data.group_size
        self.deterministic = cfg.rollout.deterministic
        self.cpu_threads = cfg.rollout.cpu_threads if llm.llm_engine.vllm_config.device_config.device_type == "cpu" else 0
        self.max_tool_calls = cfg.rollout.max_tool_calls
        self._sampling = dict(
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            logprobs=0,  # the sampled token's log-prob: ℓ^μ_t
            output_kind=RequestOutputKind.DELTA,
            detokenize=bool(self.max_tool_calls),  # stop strings are matched on detokenized text
        )
        self.engine_version = 0  # weights loaded in the engine
        self.trainer_version = 0  # set by the trainer thread after each update
        self.error: BaseException | None = None
        self.error_traceback = ""
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self.tools = None
        if self.max_tool_calls:
            from pace.tools.runner import ToolRunner

            self.tools = ToolRunner(cfg.tools, tokenizer, self.max_tool_calls, on_done=self._wake.set)
        self.params = self._turn_params(cfg.rollout.max_tokens, calls=0)
        self._pause_req = threading.Event()  # the trainer thread asks for a pause (checkpoint)
        self._paused = threading.Event()  # this thread acknowledges it, between engine steps
        self._update_lock = threading.Lock()
        self._update: tuple[int, list] | None = None
        self._pending: dict[int, _Pending] = {}
        self._grading: deque[tuple[Group, object]] = deque()
        self._next_group_id = 0
        self.stats = {"tokens": 0, "gen_s": 0.0, "sync_s": 0.0, "syncs": 0, "rescore_s": 0.0, "rescored": 0,
                      "rescore_seqs": 0, "rescore_skipped": 0, "rescore_cancelled": 0, "capacity_wait_s": 0.0}
        # PACE: rescore pooled prefixes after each update (only the pace policy reads PFS)
        self.prefix_tokens = cfg.pace.prefix_tokens if cfg.pool.name == "pace" else 0
        self._rescoring: dict[int, _Rescore] = {}
        self._rescore_started: float | None = None
        self._last = (time.perf_counter(), dict(self.stats))  # (time, stats) at the last metrics() call
        # In-training validation: θ_v is validated for v = 0 (`eval.at_start`), the first loaded
        # version at or past each multiple of `eval.every`, and the final version (trainer.steps).
        self.val_sets = val_sets if cfg.eval.every > 0 else None
        self.final_version = cfg.trainer.steps
        self.validations: queue.Queue[Validation] = queue.Queue()
        self._val_next = 0 if cfg.eval.at_start else cfg.eval.every
        self._val = None  # (EvalRun, version, weights, start time) while one runs
        self.validated_version: int | None = None  # the last version whose validation was handed over

    def _turn_params(self, max_tokens: int, calls: int):
        from vllm import SamplingParams

        tool = self.tools.turn_kwargs(calls) if self.tools is not None else {}
        return SamplingParams(max_tokens=max_tokens, **tool, **self._sampling)

    # --- called from the trainer thread -----------------------------------------------------
    def post_weights(self, version: int, named_tensors: list) -> None:
        """Hand over θ_version; applied before the next engine step. A newer update replaces an unapplied one."""
        with self._update_lock:
            self._update = (version, named_tensors)
        self._wake.set()

    def set_trainer_version(self, version: int) -> None:
        self.trainer_version = version
        self._wake.set()

    @contextlib.contextmanager
    def paused(self, timeout: float = 60.0):
        """Hold the thread between engine steps for the duration (a checkpoint reads the pool, the
        sampler and this worker's counters as of one moment). A dead or unstarted thread is idle."""
        self._pause_req.set()
        self._wake.set()
        try:
            deadline = time.monotonic() + timeout
            while self.is_alive() and not self._paused.wait(0.05):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rollout thread did not pause within {timeout:.0f} s")
            yield
        finally:
            self._pause_req.clear()
            self._wake.set()

    def state_dict(self) -> dict:
        """Call while `paused()`: the next group id, the validation schedule, the counters."""
        val_next = self._val_next if self._val is None else self._val[1]  # an unfinished validation is redone
        return {"next_group_id": self._next_group_id, "val_next": val_next, "stats": dict(self.stats)}

    def load_state_dict(self, state: dict) -> None:
        """Before `start()`."""
        self._next_group_id = state["next_group_id"]
        self._val_next = state["val_next"]
        self.stats.update(state["stats"])
        self._last = (time.perf_counter(), dict(self.stats))

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping.set()
        self._wake.set()
        if self.is_alive():
            self.join(timeout)

    def metrics(self) -> dict:
        """Throughput since the previous call: tokens per second of wall time, engine busy fraction,
        and the engine time (`time/generate`) and rescoring wall time (`time/rescore`) in the interval."""
        now, s = time.perf_counter(), dict(self.stats)
        if self.tools is not None:  # the runner counts calls, sandbox seconds, calls per status
            s |= {f"tools.{k}": v for k, v in self.tools.stats.items()}
        t, last = self._last
        self._last = (now, s)
        dt = max(now - t, 1e-9)
        return {
            "rollout/tokens_per_s": (s["tokens"] - last["tokens"]) / dt,
            "rollout/busy": (s["gen_s"] - last["gen_s"]) / dt,
            "time/generate": s["gen_s"] - last["gen_s"],  # overlaps training when async
            "time/rescore": s["rescore_s"] - last["rescore_s"],  # overlaps generation and training
            "rollout/engine_version": self.engine_version,
            "rollout/sync_apply_s": s["sync_s"],
            "rollout/rescored_groups": s["rescored"],
            # scoring sequences sent to the engine in the interval, and prefixes needing none
            # (generated entirely by the loaded weights: distance 0)
            "rollout/rescore_seqs": s["rescore_seqs"] - last["rescore_seqs"],
            "rollout/rescore_skipped": s["rescore_skipped"] - last["rescore_skipped"],
            # scoring requests dropped because new weights loaded before they ran (asked again under them)
            "rollout/rescore_cancelled": s["rescore_cancelled"] - last["rescore_cancelled"],
            # wall time in the interval when no group could start because the pool was full
            "rollout/capacity_wait_s": s["capacity_wait_s"] - last["capacity_wait_s"],
        } | (self._tool_metrics(s, last) if self.tools is not None else {})

    def _tool_metrics(self, s: dict, last: dict) -> dict:
        """Calls finished in the interval, their summed sandbox seconds (`time/tools`, calls overlap
        each other and generation), the calls running now, and calls per non-ok status."""
        delta = lambda key: s.get(f"tools.{key}", 0) - last.get(f"tools.{key}", 0)  # noqa: E731
        out = {"tools/calls": delta("calls"), "time/tools": delta("seconds"), "tools/running": self.tools.running}
        for status in ("error", "timeout", "killed", "truncated", "no_code"):
            out[f"tools/errors/{status}"] = delta(f"status/{status}")
        return out

    def check(self) -> None:
        """Re-raise a rollout failure in the calling thread."""
        if self.error is not None:
            raise RolloutError(f"rollout thread failed:\n{self.error_traceback}") from self.error

    # --- the thread -------------------------------------------------------------------------
    def run(self) -> None:
        try:
            if self.cpu_threads:
                # OpenMP thread counts are per thread, and the CPU attention kernels check that they
                # run with the count their metadata was built with, so this thread sets its own.
                # vLLM's CPU worker replaces torch.set_num_threads with a no-op: call the original.
                import torch

                torch._C.set_num_threads(self.cpu_threads)
            self._maybe_validate(None)  # θ_0, when `eval.at_start`
            while not self._stopping.is_set():
                if self._pause_req.is_set():
                    self._paused.set()
                    while self._pause_req.is_set() and not self._stopping.is_set():
                        self._wake.wait(0.01)
                        self._wake.clear()
                    self._paused.clear()
                    continue
                t_loop = time.perf_counter()
                busy = self._apply_update()
                busy |= self._admit()
                if self.engine.has_unfinished_requests():
                    t0 = time.perf_counter()
                    outputs = self.engine.step()
                    self.stats["gen_s"] += time.perf_counter() - t0
                    self._consume(outputs)
                    busy = True
                    if self.deterministic:  # see rollout.deterministic
                        for _, job in self._grading:
                            job.result()
                        if self.tools is not None:
                            self.tools.wait()
                if self.tools is not None:
                    busy |= self._collect_tools()
                busy |= self._collect_grades()
                busy |= self._poll_validation()
                if not busy:
                    self._wake.wait(0.01)
                    self._wake.clear()
                if self.pool.capacity_blocked and self.trainer_version < self.final_version:
                    self.stats["capacity_wait_s"] += time.perf_counter() - t_loop
        except BaseException as exc:  # noqa: BLE001 - everything must reach the trainer
            self.error, self.error_traceback = exc, traceback.format_exc()
            self.pool.wake()
        finally:
            self._abort_all()
            if self.tools is not None:
                self.tools.close()

    def _apply_update(self) -> bool:
        if self._val is not None:
            return False  # held: the validation in progress must see only its own weights
        with self._update_lock:
            update, self._update = self._update, None
        if update is None:
            return False
        version, weights = update
        self._cancel_rescoring()
        t0 = time.perf_counter()
        engine_lib.load_weights(self.llm, weights)
        self.stats["sync_s"] += time.perf_counter() - t0
        self.stats["syncs"] += 1
        self.engine_version = version
        if self.prefix_tokens:
            self._start_rescoring()
        self._maybe_validate(weights)
        return True

    # --- in-training validation -----------------------------------------------------------
    def _maybe_validate(self, weights: list | None) -> None:
        v = self.engine_version
        if self.val_sets is None or not (v >= self._val_next or v == self.final_version):
            return
        from pace import evaluation

        every = self.cfg.eval.every
        self._val_next = (v // every + 1) * every
        run = evaluation.EvalRun(self.val_sets, evaluation.sampling_params(self.cfg, seeded=False), self.grader,
                                 prefix=f"v{v}", answer_timeout_s=self.cfg.reward.timeout_s / self.group_size,
                                 tools=evaluation.tool_runner(self.cfg, self.tokenizer, on_done=self._wake.set))
        run.submit(self.engine, priority=engine_lib.VALIDATION_PRIORITY, salt=engine_lib.cache_salt(v))
        self._val = (run, v, weights, time.perf_counter())

    def _poll_validation(self) -> bool:
        if self._val is None:
            return False
        run, version, weights, t0 = self._val
        if not run.poll():
            return False
        self._val = None
        if self.engine_version != version:  # the hold in _apply_update guarantees this
            raise RuntimeError(f"validation of θ_{version} ran into a weight update (engine at θ_{self.engine_version})")
        response_len = sum(run.lengths) / max(len(run.lengths), 1)
        self.validations.put(Validation(version, run.results, time.perf_counter() - t0, response_len, weights))
        self.validated_version = version
        self._wake.set()
        return True

    def drain_validations(self) -> list[Validation]:
        """Validations finished since the last call (trainer thread)."""
        out = []
        while True:
            try:
                out.append(self.validations.get_nowait())
            except queue.Empty:
                return out

    def _cancel_rescoring(self) -> None:
        """Before new weights load: a score still pending would be computed (at least in part) by
        them but recorded as the old version's, so it is dropped; `_start_rescoring` asks again
        under the new weights (a prefix is one short prefill)."""
        if not self._rescoring:
            return
        ids = [f"s{gid}-{i}" for gid, job in self._rescoring.items()
               for i in range(len(job.group.trajectories)) if i not in job.distances]
        self.engine.abort_request(ids)
        self.stats["rescore_cancelled"] += len(ids)
        self._rescoring.clear()
        self.stats["rescore_s"] += time.perf_counter() - self._rescore_started
        self._rescore_started = None

    def _start_rescoring(self) -> None:
        """Score the pooled groups whose PFS could change the next rejections (`Pool.to_rescore`) and
        that have none under the loaded weights: after each update and as groups arrive."""
        self._rescore(self.pool.to_rescore(self.engine_version))

    def _rescore(self, groups: list[Group]) -> None:
        """Submit prompt + first m response tokens of each group under the engine's weights (PFS, DESIGN §3).

        A group is scored as soon as it becomes a rejection candidate, under the weights loaded then
        (its early tokens are already older), and again after each update while it stays one, so
        a score is in before the trainer ranks it. Scoring requests run in the same engine steps
        as generation, ahead of queued generation requests (priority −1), so rescoring overlaps
        generation and training; `rescore_s` is the wall time during which any score is pending.
        """
        params = engine_lib.scoring_params()
        salt = engine_lib.cache_salt(self.engine_version)
        v, m = self.engine_version, self.prefix_tokens
        for group in groups:
            if group.id in self._rescoring:
                continue  # still being scored under an earlier version: rescored at the next update
            # A prefix generated entirely by the loaded weights has distance 0 by definition: no request.
            todo = [i for i, t in enumerate(group.trajectories)
                    if any(x != v for x, a in zip(t.versions[:m], _actions(t, m)) if a)]
            job = self._rescoring[group.id] = _Rescore(group, v, len(todo))
            job.distances.update({i: 0.0 for i in range(len(group.trajectories)) if i not in todo})
            self.stats["rescore_skipped"] += len(group.trajectories) - len(todo)
            self.stats["rescore_seqs"] += len(todo)
            if not todo:
                self._finish_rescore(job)
            for i in todo:
                ids = group.prompt_ids + group.trajectories[i].response_ids[:m]
                self.engine.add_request(f"s{group.id}-{i}", {"prompt_token_ids": ids, "cache_salt": salt}, params,
                                        priority=engine_lib.SCORING_PRIORITY)
        if self._rescoring and self._rescore_started is None:
            self._rescore_started = time.perf_counter()

    def _consume_score(self, out) -> None:
        gid, idx = (int(x) for x in out.request_id[1:].split("-"))
        job = self._rescoring.get(gid)
        if job is None:  # cancelled by a weight update (its last output may still arrive)
            return
        traj = job.group.trajectories[idx]
        m = min(self.prefix_tokens, len(traj))
        ids = job.group.prompt_ids + traj.response_ids[:m]
        current = engine_lib.prompt_token_logprobs(out, ids, len(job.group.prompt_ids))
        # over the model's own tokens: tool output in the prefix is context, with no ℓ^μ
        diffs = [abs(a - b) for a, b, act in zip(current, traj.logprobs[:m], _actions(traj, m)) if act]
        job.distances[idx] = sum(diffs) / max(len(diffs), 1)
        job.remaining -= 1
        if job.remaining == 0:
            self._finish_rescore(job)

    def _finish_rescore(self, job: _Rescore) -> None:
        del self._rescoring[job.group.id]
        self.pool.set_pfs(job.group, sum(job.distances.values()) / len(job.distances), job.version)
        self.stats["rescored"] += 1
        if not self._rescoring and self._rescore_started is not None:
            self.stats["rescore_s"] += time.perf_counter() - self._rescore_started
            self._rescore_started = None

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
            )
            self._next_group_id += 1
            self.pool.on_submitted(group)
            self._pending[group.id] = _Pending(group, self.group_size)
            for i in range(self.group_size):
                prompt = {"prompt_token_ids": group.prompt_ids, "cache_salt": engine_lib.cache_salt(self.engine_version)}
                self.engine.add_request(f"g{group.id}-{i}", prompt, self.params)
            started = True
        return started

    def _consume(self, outputs) -> None:
        version = self.engine_version  # every token of this step came from these weights
        for out in outputs:
            if out.request_id[0] == "s":
                if out.finished:
                    self._consume_score(out)
                continue
            if out.request_id[0] == "v":
                self._val[0].on_output(out)
                continue
            gid, idx = (int(x) for x in out.request_id[1:].split("-")[:2])
            pending = self._pending[gid]
            traj = pending.responses.get(idx)
            if traj is None:
                traj = pending.responses[idx] = Trajectory([], [], [], completed_at=-1, finish_reason="")
            tool_call = False
            for comp in out.outputs:
                traj.response_ids.extend(comp.token_ids)
                traj.logprobs.extend(lp[tok].logprob for tok, lp in zip(comp.token_ids, comp.logprobs))
                traj.versions.extend([version] * len(comp.token_ids))
                if traj.action_mask is not None:
                    traj.action_mask.extend([True] * len(comp.token_ids))
                self.stats["tokens"] += len(comp.token_ids)
                if out.finished:
                    traj.finish_reason = comp.finish_reason or "stop"
                    tool_call = self.tools is not None and is_tool_stop(comp)
            left = self.cfg.rollout.max_tokens - len(traj) if tool_call else 0
            if left > 0:  # the turn ended at </code>: run the program, the response continues after it
                self.tools.submit((gid, idx), traj.response_ids[pending.turn_start.get(idx, 0):], left)
            elif out.finished:
                self._finish_response(pending, traj)

    def _finish_response(self, pending: _Pending, traj: Trajectory) -> None:
        traj.completed_at = self.trainer_version
        pending.remaining -= 1
        if pending.remaining == 0:
            self._finish_group(pending)

    def _collect_tools(self) -> bool:
        """Append each finished call's interpreter text to its response and continue generating."""
        done = self.tools.poll()
        budget = self.cfg.rollout.max_tokens
        for (gid, idx), result, ids in done:
            pending = self._pending.get(gid)
            if pending is None:  # abandoned while its call ran (a stop)
                continue
            traj = pending.responses[idx]
            traj.tool_calls += 1
            traj.tool_errors += not result.ok
            if traj.action_mask is None:
                traj.action_mask = [True] * len(traj)
            traj.response_ids.extend(ids)
            traj.logprobs.extend([0.0] * len(ids))
            traj.versions.extend([self.engine_version] * len(ids))
            traj.action_mask.extend([False] * len(ids))
            left = budget - len(traj)
            if left <= 0:  # the tool output used up the response budget
                traj.finish_reason = "length"
                self._finish_response(pending, traj)
                continue
            pending.turns[idx] = pending.turns.get(idx, 0) + 1
            pending.turn_start[idx] = len(traj)
            prompt = {"prompt_token_ids": pending.group.prompt_ids + traj.response_ids,
                      "cache_salt": engine_lib.cache_salt(self.engine_version)}
            params = self._turn_params(left, calls=traj.tool_calls)
            self.engine.add_request(pending.request_id(idx), prompt, params)
        return bool(done)

    def _finish_group(self, pending: _Pending) -> None:
        del self._pending[pending.group.id]
        group = pending.group
        group.trajectories = [pending.responses[i] for i in range(self.group_size)]
        texts = self.tokenizer.batch_decode([t.response_ids for t in group.trajectories], skip_special_tokens=True)
        for traj, text in zip(group.trajectories, texts):
            traj.text = text
        if self.tools is not None:
            # graded on the model's own tokens: a program printing "Answer: ..." must not answer for it
            texts = self.tokenizer.batch_decode([t.action_ids for t in group.trajectories], skip_special_tokens=True)
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
        for traj, adv in zip(group.trajectories, group_advantages([t.reward for t in group.trajectories], self.cfg.algo.adv_eps)):
            traj.advantage = adv

    def _abort_all(self) -> None:
        ids = [p.request_id(i) for p in self._pending.values() for i in range(self.group_size)]
        ids += [f"s{gid}-{i}" for gid, job in self._rescoring.items() for i in range(len(job.group.trajectories))]
        if self._val is not None:
            ids += self._val[0].request_ids
        try:
            if ids:
                self.engine.abort_request(ids)
        except Exception:  # noqa: BLE001 - best effort at shutdown; the groups stay counted as in flight
            pass


def _actions(traj: Trajectory, m: int) -> list[bool]:
    """Which of the first ``m`` response tokens the model generated."""
    return [True] * min(m, len(traj)) if traj.action_mask is None else traj.action_mask[:m]
