"""The rollout thread: owns the vLLM engines, streams groups into the pool (docs/design.md §5).

The one place that submits requests, records versions, grades, feeds the pool and rescores
prefixes. Its loop, one pass at a time:
    apply a pending weight update (vLLM weight transfer; in-flight requests continue under it)
    start new groups while the pool policy admits them           generation.py
    step the engines; record each token with v_t and ℓ^μ_t         generation.py
    continue responses whose tool call returned                   tool_turns.py
    pool the groups whose grades are in                          generation.py
    finish an in-training validation                             val_requests.py
and after each update, PACE's prefix rescoring                    rescoring.py

An exception here is stored in `error` and the trainer re-raises it within one poll interval.
A checkpoint is taken while the thread is `paused()` between engine steps, so the pool, the
sampler and the group ids it records are one consistent moment.
"""
from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
import traceback
from collections import deque

from pace.errors import RolloutError
from pace.pool import Pool
from pace.pool.plugins import reads_pfs
from pace.rollout.failover import FailoverMixin
from pace.rollout.fleet import Fleet
from pace.rollout.generation import GenerationMixin
from pace.rollout.kv_probe import KvProbeMixin, kv_probe_metrics
from pace.rollout.reload_probe import STATS as RELOAD_PROBE_STATS
from pace.rollout.reload_probe import ReloadProbeMixin
from pace.rollout.rescoring import RescoringMixin
from pace.rollout.resuming import ResumingMixin
from pace.rollout.stopping import stop_token_ids
from pace.rollout.tool_turns import ToolTurnsMixin
from pace.rollout.val_requests import ValRequestsMixin, ValResult
from pace.tasks.base import PromptSampler
from pace.weights import transfer
from pace.weights.fingerprint import SentWeights, StaleEngine
from pace.weights.update import WeightUpdate

__all__ = ["RolloutError", "RolloutWorker"]


class RolloutWorker(GenerationMixin, ToolTurnsMixin, RescoringMixin, KvProbeMixin, ResumingMixin, FailoverMixin,
                    ValRequestsMixin, ReloadProbeMixin, threading.Thread):
    def __init__(self, fleet: Fleet, tokenizer, sampler: PromptSampler, pool: Pool, grader, cfg, val_sets: dict | None = None):
        """``fleet``: the engines (`EngineFleet`, e.g. ``EngineFleet([llm])`` for one `LLM`, or `RemoteFleet`)."""
        super().__init__(name="rollout", daemon=True)
        from vllm.sampling_params import RequestOutputKind

        self.fleet = fleet
        if self.fleet.version is None:
            self.fleet.set_version(0)  # vLLM labels tokens with it: the weights loaded (θ_0 until an update)
        # recompute: in-flight requests are prefilled again at each update (docs/pool-policies.md "KV staleness")
        self.fleet.reprefill_on_update = cfg.rollout.kv_on_update == "recompute"
        self.tokenizer = tokenizer
        self.sampler = sampler
        self.pool = pool
        self.grader = grader
        self.cfg = cfg
        self.group_size = cfg.data.group_size
        self.deterministic = cfg.rollout.deterministic
        self.cpu_threads = cfg.rollout.cpu_threads if self.fleet.device_type == "cpu" and self.fleet.in_process else 0
        self.max_tool_calls = cfg.rollout.max_tool_calls
        self._sampling = dict(
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            logprobs=0,  # the sampled token's log-prob: ℓ^μ_t
            flat_logprobs=True,  # kept by vLLM in flat lists, not one dict and Logprob a token (docs/benchmarks.md)
            output_kind=RequestOutputKind.DELTA,
            detokenize=bool(self.max_tool_calls),  # stop strings are matched on detokenized text
            # a request's new tokens reach this thread every `rollout.stream_interval` tokens (and at its end)
            stream_interval=cfg.rollout.stream_interval if cfg.rollout.stream_interval > 1 else None,
        )
        # the rollout thread's stamps are every token's exact version only when each engine step's
        # tokens reach it at that step: in process, one token an output
        self.stamps_exact = self.fleet.in_process and cfg.rollout.stream_interval == 1
        # every turn's stop tokens, the same as evaluation.sampling_params' (pace/rollout/stopping.py)
        self._stop_ids = stop_token_ids(tokenizer, cfg.data)
        self.engine_version = 0  # weights loaded in the engines
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
        self._paused_at = time.perf_counter()  # when the engines paused for the update in progress (begin_update)
        self._update: WeightUpdate | None = None
        self._calls: queue.Queue = queue.Queue()  # (fn, future) run on this thread (BlockingClient)
        self._transfer_ready = False
        self._own_slot: str | None = None  # post_weights' shared-memory file
        self._pending = {}
        self._grading: deque = deque()
        self._next_group_id = 0
        self.stats = {"tokens": 0, "gen_s": 0.0, "sync_s": 0.0, "pause_s": 0.0, "syncs": 0, "rescore_s": 0.0, "rescored": 0,
                      "rescore_seqs": 0, "rescore_skipped": 0, "rescore_cancelled": 0, "capacity_wait_s": 0.0,
                      "reprefill_tokens": 0,
                      "versions_checked": 0, "resumed_groups": 0, "resumed_tokens": 0, "resume_unlabelled_tokens": 0,
                      "resume_cut_tokens": 0, "engine_failures": 0, "failover_requests": 0, "failover_lost_tokens": 0,
                      "orphaned_responses": 0, "weights_checked": 0, "engine_restarts": 0, "engine_joins": 0}
        self._init_kv_probe(cfg)  # rollout.kv_probe: its state and counters
        self.stats |= RELOAD_PROBE_STATS  # rollout.reload_probe at the start (pace/rollout/reload_probe.py)
        # rescore pooled prefixes after each update for policies that ask for the PFS (PACE, and any
        # policy under pool.record_effective: pace/pool/recording.py)
        self.prefix_tokens = cfg.pace.prefix_tokens if reads_pfs(pool.policy) else 0
        self._rescoring = {}
        self._rescore_started: float | None = None
        self._last = (time.perf_counter(), dict(self.stats))  # (time, stats) at the last metrics() call
        self._sync_last: dict[int, float] = {}  # the fleet's sync_seconds() at the last metrics() call
        self._restarts_seen = 0  # the fleet's restarts counted in stats
        self._join_s: list[float] = []  # seconds to serve of the engines that joined since the last metrics()
        self.val_sets = val_sets if cfg.eval.every > 0 else None
        self.final_version = cfg.trainer.steps
        self.val_results: queue.Queue[ValResult] = queue.Queue()
        self._val_next = 0 if cfg.eval.at_start else cfg.eval.every
        self._val = None  # (EvalRun, version, weights, start time) while one runs
        self.validated_version: int | None = None  # the last version whose validation was handed over
        # the trainer's fingerprints of what it sent (pace/weights/sync.py) and the first update found without them
        self.sent_weights = SentWeights() if cfg.trainer.sync_fingerprint else None
        self.stale: StaleEngine | None = None

    # --- called from the trainer thread (the weight-sync client of pace/weights/transfer.py) --
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        """Before `start()`: connect the engines' weight-transfer backend."""
        self.fleet.init_weight_transfer_engine(init_info)
        if self.sent_weights is not None:
            self.fleet.fingerprint_updates()
        self._transfer_ready = True

    def post_update(self, update: WeightUpdate) -> None:
        """Hand over θ_version (``update``: its version, the backend's update info and the lock of
        its slot); loaded before the next engine step. A newer update replaces one not yet loaded."""
        with self._update_lock:
            self._update = update
        self._wake.set()

    def post_weights(self, version: int, named_tensors: list) -> None:
        """`post_update` for (name, tensor) pairs at hand (tests, tools): written to this worker's
        own shared-memory slot, loaded through the same weight-transfer calls."""
        from dataclasses import asdict

        if not self._transfer_ready:
            self.init_weight_transfer_engine({"directory": transfer.shm_dir()})
        self._own_slot = self._own_slot or os.path.join(transfer.shm_dir(), f"pace-weights-post-{os.getpid()}-{id(self)}.bin")
        info = transfer.write_slot(self._own_slot, transfer.tensor_meta(named_tensors), iter(named_tensors))
        self.post_update(WeightUpdate(version, asdict(info), threading.Lock()))

    def call(self, fn):
        """Run ``fn`` on this thread between engine steps (not during a validation); a Future."""
        from concurrent.futures import Future

        future = Future()
        self._calls.put((fn, future))
        self._wake.set()
        return future

    def set_trainer_version(self, version: int) -> None:
        self.trainer_version = version
        self._wake.set()

    @contextlib.contextmanager
    def paused(self, timeout: float = 60.0):
        """Hold the thread between engine steps for the duration (a checkpoint reads the pool, the
        sampler and this worker's counters as of one moment). A dead or unstarted thread is idle; one
        asked to stop that is still running is stuck in an engine call and not waited for."""
        self._pause_req.set()
        self._wake.set()
        try:
            deadline = time.monotonic() + timeout
            while self.is_alive() and not self._stopping.is_set() and not self._paused.wait(0.05):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rollout thread did not pause within {timeout:.0f} s")
            yield
        finally:
            self._pause_req.clear()
            self._wake.set()

    def state_dict(self) -> dict:
        """Call while `paused()`: the next group id, the validation schedule, the counters, and
        (`rollout.resume_inflight`) the groups in flight (pace/rollout/resuming.py)."""
        val_next = self._val_next if self._val is None else self._val[1]  # an unfinished validation is redone
        inflight = self.inflight_state() if self.cfg.rollout.resume_inflight else []
        return {"next_group_id": self._next_group_id, "val_next": val_next, "stats": dict(self.stats),
                "inflight": inflight, "version": self.trainer_version, "engine_version": self.engine_version}

    def load_state_dict(self, state: dict) -> None:
        """Before `start()`."""
        self._next_group_id = state["next_group_id"]
        self._val_next = state["val_next"]
        self.stats.update(state["stats"])
        self._last = (time.perf_counter(), dict(self.stats))

    def stop(self, timeout: float = 30.0) -> bool:
        """Ask the thread to stop and wait up to ``timeout`` s; False if it is still running (an
        engine call that does not return: the caller goes on without it)."""
        self._stopping.set()
        self._wake.set()
        if self.is_alive():
            self.join(timeout)
        if self._own_slot is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._own_slot)
        return not self.is_alive()

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
            # in-process: the fraction of wall time in engine steps; out of process: waiting on them
            "rollout/busy": (s["gen_s"] - last["gen_s"]) / dt,
            "time/generate": s["gen_s"] - last["gen_s"],  # overlaps training when async
            "time/rescore": s["rescore_s"] - last["rescore_s"],  # overlaps generation and training
            "rollout/engine_version": self.engine_version,
            "rollout/sync_apply_s": s["sync_s"],
            # the engines paused for weight updates in the interval (paused, loaded, resumed)
            "sync/pause_s": s["pause_s"] - last["pause_s"],
            "rollout/rescored_groups": s["rescored"],
            # scoring sequences sent to the engine in the interval, and prefixes needing none
            # (generated entirely by the loaded weights: distance 0)
            "rollout/rescore_seqs": s["rescore_seqs"] - last["rescore_seqs"],
            "rollout/rescore_skipped": s["rescore_skipped"] - last["rescore_skipped"],
            # scoring requests dropped because new weights loaded before they ran (asked again under them)
            "rollout/rescore_cancelled": s["rescore_cancelled"] - last["rescore_cancelled"],
            # wall time in the interval when no group could start because the pool was full
            "rollout/capacity_wait_s": s["capacity_wait_s"] - last["capacity_wait_s"],
            # rollout.kv_on_update=recompute: tokens prefilled again at the updates in the interval
            "rollout/reprefill_tokens": s["reprefill_tokens"] - last.get("reprefill_tokens", 0),
        } | (self._tool_metrics(s, last) if self.tools is not None else {}) | self._engine_metrics() | (
            kv_probe_metrics(s, last) if self.kv_probe else {})

    def _engine_metrics(self) -> dict:
        """A fleet that times its engines' weight updates (servers): the engines alive, and each
        one's seconds in weight-update calls in the interval."""
        now, last = self.fleet.sync_seconds(), self._sync_last
        if not now:
            return {}
        self._sync_last = now
        joins, self._join_s = self._join_s, []
        return {"rollout/engines_alive": len(self.fleet.alive), "rollout/engine_restarts": self.stats["engine_restarts"],
                # seconds from its failure (or registration) to serving, the longest of the engines that joined
                "rollout/engine_join_s": max(joins) if joins else float("nan")} | {
            f"rollout/sync_s/engine{i}": sec - last.get(i, 0.0) for i, sec in now.items()}

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
                    self._hold()
                    continue
                t_loop = time.perf_counter()
                busy = self._run_calls()
                busy |= self._apply_update()
                busy |= self._continue_resumed()
                busy |= self._admit()
                if self.fleet.has_unfinished_requests():
                    t0 = time.perf_counter()
                    outputs = self.fleet.step()
                    self.stats["gen_s"] += time.perf_counter() - t0
                    self._consume(outputs)
                    busy = True
                    if self.deterministic:  # see rollout.deterministic
                        for _, job in self._grading:
                            job.result()
                        if self.tools is not None:
                            self.tools.wait()
                busy |= self._check_engines()
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

    def _hold(self) -> None:
        self._paused.set()
        while self._pause_req.is_set() and not self._stopping.is_set():
            self._wake.wait(0.01)
            self._wake.clear()
        self._paused.clear()

    def _run_calls(self) -> bool:
        if self._val is not None or self._calls.empty():
            return False  # held during a validation, as updates are
        while not self._calls.empty():
            fn, future = self._calls.get()
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - the caller gets it, and so does the run
                future.set_exception(exc)
                raise
        return True

    def _apply_update(self) -> bool:
        if self._val is not None:
            return False  # held: the validation in progress must see only its own weights
        with self._update_lock:
            update, self._update = self._update, None
        if update is None:
            return False
        with update.lock:  # the trainer does not rewrite this slot meanwhile
            self._before_update()
            seconds = self.fleet.update(update.version, update.info)
            self.stats["sync_s"] += seconds
            self.stats["pause_s"] += seconds
            self._updated(update.version, weights=lambda: transfer.read_slot(update.info))
        return True

    def _before_update(self) -> None:
        """Before new weights load: pending scores and KV probes are dropped (they would be computed by
        other weights than they are labelled with); under recompute, what will be prefilled again is counted."""
        self._cancel_rescoring()
        self._cancel_kv_probes()
        self._count_reprefill()

    # BlockingClient (nccl, ipc): the update in two halves, the trainer's broadcast between them
    def begin_update(self) -> None:
        """Before new weights load (this thread): pending scores are dropped, the engines paused."""
        self._before_update()
        self._paused_at = time.perf_counter()
        self.fleet.begin_update()

    def end_update(self, version: int) -> None:
        try:
            self.fleet.end_update(version)
        finally:
            self.stats["pause_s"] += time.perf_counter() - self._paused_at
        self._updated(version, weights=None)

    def _updated(self, version: int, weights) -> None:
        """After the weights of ``version`` loaded and were labelled: rescore, validate if due."""
        self.stats["syncs"] += 1
        self.engine_version = version
        joining = self.fleet.joining()
        if self.sent_weights is not None and self.sent_weights.expects(version) and self.stale is None:
            self.stale = self._judge(version, joining)  # the loop stops on it
            self.stats["weights_checked"] += 1
        self._promote(joining)  # caught up (and checked, if fingerprinted): they take requests from here on
        if self.fleet.in_process:
            self.fleet.reset_prefix_cache_if_idle()  # old entries are unreachable (salted); free them
        if self._reload_probe is not None and self._reload_probe_after():  # before any request under θ_version
            return  # the probe's own update (θ_0 again, before the run's first): nothing is due on it
        if self.prefix_tokens:
            self._start_rescoring()
        self._maybe_validate(weights)

    def _abort_all(self) -> None:
        # nothing lost silently: every unfinished response not waiting for its program has a request
        # in an engine (a failed engine's were sent to the others: pace/rollout/failover.py)
        self.stats["orphaned_responses"] = sum(
            1 for p in self._pending.values() for i in range(self.group_size)
            if i not in p.tool_wait and (p.responses.get(i) is None or p.responses[i].completed_at < 0)
            and not self.fleet.holds(p.request_id(i)))
        try:  # the tokens read so far keep exact versions for a checkpoint after the stop
            self._settle_versions(cut=True)
            self._settled = True
        except Exception:  # noqa: BLE001 - then the checkpoint keeps none of the groups in flight
            self._settled = False
        ids = [p.request_id(i) for p in self._pending.values() for i in range(self.group_size)]
        ids += self._rescoring_ids() + self._kv_probe_ids()
        if self._val is not None:
            ids += self._val[0].request_ids
        try:
            if ids:
                self.fleet.abort_request(ids)
        except Exception:  # noqa: BLE001 - best effort at shutdown; the groups stay counted as in flight
            pass
