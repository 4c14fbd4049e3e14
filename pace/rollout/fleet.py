"""The rollout engines as one fleet: the interface the rollout thread and the weight sync use
(`Fleet`), and the fleet of engines in this host (`EngineFleet`; vLLM HTTP servers:
`RemoteFleet`, pace/rollout/remote.py).

`EngineFleet`: `rollout.engines` data-parallel vLLM engines behind the request interface of a
single `LLMEngine` (`add_request`, `abort_request`, `step`, `has_unfinished_requests`), used only
from the rollout thread.

Each engine is a vLLM `LLM` whose engine core runs either in this process
(`rollout.engine_process=inproc`: `step()` runs the model here, between our calls) or in its own
process (`child`: the core runs its busy loop there, `step()` collects what it produced). Requests
are spread over the engines: the G requests of a group go to the engine with the fewest
unfinished requests (they share a prompt, so its prefix is computed once); a request's later
turns and its abort follow it.

Weight updates (`update`) go through vLLM's weight-transfer RPCs on every engine, each between a
`pause_scheduler(mode="keep")` and a `resume_scheduler` of that engine (in-flight requests keep
their KV and continue under the new weights; with `reprefill_on_update` their KV is dropped after the
load and they are prefilled again under the new weights), and each engine's outputs are stamped by
vLLM with the version set by `set_weight_version` (`CompletionOutput.weight_versions`).
"""
from __future__ import annotations

import abc
import queue
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait


class Fleet(abc.ABC):
    """The rollout engines, as the rollout thread (requests, from its thread only) and the weight
    sync (updates) use them. A weight update is one sequence on every fleet (`update`): the engines
    paused between two steps (`begin_update`), the weights received (`load`), the load finished and
    checked, the version label set and the engines resumed (`end_update`); a backend whose trainer
    side drives the transfer (nccl, gloo, ipc) calls the three itself.

    What only a fleet of servers has (engines that fail and are taken out, a transfer group formed
    again, per-engine sync times) has harmless defaults here: an engine in this host that fails
    fails the run."""

    version: int | None = None  # the label of the weights loaded (vLLM stamps each token with it)
    _untrusted: str | None = None  # the last update's patches are no base for the next (`take_untrusted`)
    device_type: str = "cpu"  # the engines' device
    in_process = False  # every engine steps in this process (the rollout's stamps are exact at stream_interval 1)
    needs_regroup = False  # an engine was taken out: the weight-transfer group is formed again
    # rollout.kv_on_update=recompute: every update preempts the engines' running requests (their KV
    # freed, the prefix cache emptied), so each is prefilled again under the new weights when they
    # resume (vLLM's `reset_prefix_cache(reset_running_requests=True)`); keep: their KV stays
    reprefill_on_update = False

    # --- requests (the rollout thread) ------------------------------------------------------
    @abc.abstractmethod
    def add_request(self, request_id: str, prompt: dict, params, priority: int = 0, group: str | None = None,
                    engine: int | None = None) -> None:
        """Send a request; those of one ``group`` key go to one engine (pace/rollout/request_ids.py);
        ``engine``: to that engine (in service), whatever the load (the reload probe's, one an engine)."""

    @abc.abstractmethod
    def abort_request(self, request_ids: list[str]) -> None: ...

    @abc.abstractmethod
    def holds(self, request_id: str) -> bool:
        """Whether a request of that id is in an engine, unfinished."""

    @abc.abstractmethod
    def release_group(self, group: str) -> None:
        """The group's requests are done: its key no longer binds an engine."""

    @abc.abstractmethod
    def has_unfinished_requests(self) -> bool: ...

    @abc.abstractmethod
    def step(self, timeout: float = 0.01) -> list:
        """The outputs the engines produced since the last call (vLLM `RequestOutput`s, DELTA), each
        with ``engine``: the index of the engine that produced it (per-engine accounting)."""

    @abc.abstractmethod
    def partial_versions(self, request_id: str, n: int):
        """The versions of the first ``n`` output tokens of an unfinished request, or None."""

    def partial_routes(self, request_id: str):
        """The routed experts an unfinished request's engine has returned so far (rows from the
        position it asked for; MoE routing replay), or None when they cannot be read."""

    def reset_prefix_cache_if_idle(self) -> None:
        """Free the cached prefixes of idle engines: after an update, entries of earlier weights are
        unreachable (salted by version). By default nothing: the engine evicts them as needed."""

    @abc.abstractmethod
    def shutdown(self, timeout: float | None = None) -> None: ...

    # --- engines that fail ------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def alive(self) -> list[int]:
        """The indices of the engines in service."""

    def take_failures(self) -> list:
        """Engines failed since the last call, each with the requests it held (pace/rollout/failover.py)."""
        return []

    def wait_failed(self, alive_before: set[int], timeout: float = 5.0) -> list:
        """The engines of ``alive_before`` to blame for a failed weight transfer, found within ``timeout`` s
        (each with its ``index`` and ``url``); [] when none can be named."""
        return []

    def sync_seconds(self) -> dict[int, float]:
        """Seconds each engine spent in weight-update calls, summed over the run ({}: not timed)."""
        return {}

    # --- engines that come back or join (servers: pace/rollout/healing.py) --------------------
    restarts = 0  # engines started again or re-admitted so far

    def regroup_due(self, admit: bool) -> bool:
        """At the start of a weight update: whether the weight-transfer group is formed again
        (``admit``: with the engines ready to join)."""
        return self.needs_regroup

    def group_members(self) -> list[int]:
        """The engines in the weight-transfer group (those in service, and any joining or leaving)."""
        return self.alive

    def release_engines(self) -> None:
        """Before the weight-transfer group is formed again: each member's engine of the old one released."""

    def joining(self) -> list[int]:
        """Engines in the weight-transfer group that take no requests until this update is checked."""
        return []

    def promote(self, index: int) -> float | None:
        """Joiner ``index`` was caught up and checked: it takes requests (seconds since it failed or
        was registered)."""
        return None

    def fail_engine(self, index: int, cause: str) -> None:
        raise NotImplementedError

    def weights_reloaded(self) -> dict[int, bool]:
        """Each engine in service: whether its served model has begun a weight update since it loaded
        its weights from disk (pace/weights/reload.py `reloaded`; the reload probe compares only those
        that have not: pace/rollout/reload_probe.py)."""
        raise NotImplementedError

    # --- weights (the rollout thread, or the trainer before it starts) ----------------------
    @abc.abstractmethod
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        """Every engine joins the weight-transfer group (with ranks: each engine's workers after
        those of the engines before it, from ``init_info["rank_offset"]``)."""

    @abc.abstractmethod
    def transfer_workers(self) -> int:
        """The weight-transfer ranks of the engines in service (every engine's TP × PP workers)."""

    def update(self, version: int | None, update_info: dict) -> float:
        """Load one weight update into every engine; its tokens from here on are labelled
        ``version`` (None: the label stays). Returns the seconds it took (the engines are paused
        meanwhile, resumed if the load fails)."""
        t0 = time.perf_counter()
        self.begin_update()
        try:
            self.load(update_info)
        except BaseException:
            self._resume()
            raise
        self.end_update(version)
        return time.perf_counter() - t0

    @abc.abstractmethod
    def begin_update(self) -> None:
        """Pause every engine between two steps (requests kept) and start the update (resumed if that fails)."""

    @abc.abstractmethod
    def load(self, update_info: dict) -> None: ...

    def end_update(self, version: int | None) -> None:
        """Finish the update on every engine, then fail it (`IncompleteWeightUpdate`, the version
        label unchanged) if any worker's checks found layers without the sent weights; the
        engines are resumed either way. Patches that loaded but that a worker does not trust as the
        base of the next (pace/weights/inplace.py) are kept for the weight sync (`take_untrusted`)."""
        from pace.weights.reload import IncompleteWeightUpdate, split_reports

        try:
            self._finish_update()
            failures, untrusted = split_reports(self._update_failures())
            if failures:
                raise IncompleteWeightUpdate(failures[0] + _more(failures))
            self._untrusted = untrusted[0] + _more(untrusted) if untrusted else None
            if version is not None:
                self.set_version(version)
        finally:
            self._resume()

    def take_untrusted(self) -> str | None:
        """Why the last update is not the base of a delta (one line: a worker's, and how many more), or None; cleared."""
        untrusted, self._untrusted = self._untrusted, None
        return untrusted

    @abc.abstractmethod
    def _finish_update(self) -> None:
        """vLLM's `finish_weight_update` on every engine."""

    @abc.abstractmethod
    def _update_failures(self) -> list:
        """Each worker's reload check of the update (pace/weights/reload.py): a message, {"untrusted": a
        message} (`split_reports`), or None."""

    @abc.abstractmethod
    def _resume(self) -> None:
        """Resume the engines paused by `begin_update`."""

    @abc.abstractmethod
    def set_version(self, version: int) -> None: ...

    @abc.abstractmethod
    def fingerprint_updates(self) -> None:
        """Every worker fingerprints the weights it receives from the next update on (pace/weights/fingerprint.py)."""

    @abc.abstractmethod
    def fingerprints(self) -> list:
        """Each worker's fingerprints of its last update, in engine order."""


def _more(lines: list) -> str:
    return f" (and {len(lines) - 1} more workers)" if len(lines) > 1 else ""


class EngineFleet(Fleet):
    def __init__(self, llms: list):
        self.llms = list(llms)
        self.engines = [llm.llm_engine for llm in self.llms]
        self.child = [_is_child(e) for e in self.engines]
        self.vllm_config = self.engines[0].vllm_config
        self.device_type = self.vllm_config.device_config.device_type
        self._owner: dict[str, int] = {}  # request id → engine index
        self._group_engine: dict[str, int] = {}  # group key → engine index (its requests stay together)
        self._load = [0] * len(self.engines)  # unfinished requests per engine
        self.version = None

    @property
    def in_process(self) -> bool:
        return not any(self.child)

    @property
    def alive(self) -> list[int]:
        """Every engine (one in this host that fails fails the run)."""
        return list(range(len(self.engines)))

    def transfer_workers(self) -> int:
        return sum(e.vllm_config.parallel_config.world_size for e in self.engines)  # TP × PP each

    # --- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: dict, params, priority: int = 0, group: str | None = None,
                    engine: int | None = None) -> None:
        if engine is not None:
            i = engine
        elif group is not None and group in self._group_engine:
            i = self._group_engine[group]
        else:
            i = min(range(len(self.engines)), key=self._load.__getitem__)
            if group is not None:
                self._group_engine[group] = i
        self.engines[i].add_request(request_id, prompt, params, priority=priority)
        self._owner[request_id] = i
        self._load[i] += 1

    def holds(self, request_id: str) -> bool:
        return request_id in self._owner

    def release_group(self, group: str) -> None:
        self._group_engine.pop(group, None)

    def abort_request(self, request_ids: list[str]) -> None:
        per: dict[int, list[str]] = {}
        for rid in request_ids:
            i = self._owner.pop(rid, None)
            if i is not None:
                per.setdefault(i, []).append(rid)
                self._load[i] -= 1
        for i, ids in per.items():
            self.engines[i].abort_request(ids)

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.engines)

    def step(self, timeout: float = 0.01) -> list:
        """Outputs of one step of every engine with work: an in-process engine runs its step here;
        for an out-of-process one, what its core has produced so far (waiting up to ``timeout``
        when none of them has anything yet)."""
        outputs = []
        ready = [i for i, e in enumerate(self.engines) if e.has_unfinished_requests()]
        if not ready:
            return outputs
        if all(self.child[i] for i in ready) and not any(_pending(self.engines[i]) for i in ready):
            _wait_any([self.engines[i] for i in ready], timeout)
        for i in ready:
            if self.child[i] and not _pending(self.engines[i]):
                continue
            for out in self.engines[i].step():
                if out.finished:
                    if self._owner.pop(out.request_id, None) is not None:
                        self._load[i] -= 1
                out.engine = i  # (a plain attribute of vLLM's `RequestOutput`, as `Output.engine` of a server's)
                outputs.append(out)
        return outputs

    def partial_versions(self, request_id: str, n: int):
        """The versions of the first ``n`` output tokens of an unfinished request, from its engine's
        output processor (the labels `CompletionOutput.weight_versions` is built from when the
        request finishes); None if the engine holds no state for it or has labelled fewer tokens.
        It may hold more: those not yet delivered (`rollout.stream_interval`)."""
        import numpy as np

        state = self._request_state(request_id)
        starts = getattr(state, "weight_version_starts", None)
        total = state.detokenizer.num_output_tokens() if starts else 0
        if not starts or total < n:
            return None
        ends = [start for _, start in starts[1:]] + [total]
        return np.repeat(np.array([int(v) for v, _ in starts], dtype=np.int32),
                         np.array([e - s for (_, s), e in zip(starts, ends)], dtype=np.int64))[:n]

    def partial_routes(self, request_id: str):
        """The rows vLLM's output processor holds for an unfinished request (one chunk per step,
        concatenated into `CompletionOutput.routed_experts` when it finishes: output_processor.py,
        `routed_experts_chunks`); what an abort would lose, read just before one."""
        import numpy as np

        chunks = getattr(self._request_state(request_id), "routed_experts_chunks", None)
        return np.concatenate(chunks) if chunks else None

    def _request_state(self, request_id: str):
        """vLLM's output-processor state of a request (in this process for in-process and child
        engines alike), or None."""
        i = self._owner.get(request_id)
        if i is None:
            return None
        processor = self.engines[i].output_processor
        internal = processor.external_req_ids.get(request_id) or [request_id]
        return processor.request_states.get(internal[0])

    def reset_prefix_cache_if_idle(self) -> None:
        for e in self.engines:
            if not e.has_unfinished_requests():
                e.reset_prefix_cache()

    # --- weights ----------------------------------------------------------------------------
    def collective_rpc(self, method: str, kwargs: dict | None = None) -> list:
        return self._each(method, [kwargs] * len(self.llms))

    def _each(self, method: str, kwargs: list) -> list:
        """``method`` on every engine's workers, engine e with ``kwargs[e]``; the workers' results in
        engine order. Out-of-process engines are called at once, each from a thread of its own:
        a call that is a collective over the engines' workers and the trainer (NCCL's rendezvous
        and broadcast) returns on none of them until it runs on all of them."""
        call = lambda i: self.llms[i].collective_rpc(method, kwargs=kwargs[i])  # noqa: E731
        if len(self.llms) == 1 or not all(self.child):  # in-process engines run here, one at a time
            return [r for i in range(len(self.llms)) for r in call(i)]
        pool = ThreadPoolExecutor(max_workers=len(self.llms), thread_name_prefix="pace-rpc")
        futures = [pool.submit(call, i) for i in range(len(self.llms))]
        try:
            # an engine that fails leaves the others waiting for it in the collective: raise its
            # error at once instead of waiting for them (they are not joined)
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            for f in futures:
                if f in done and f.exception() is not None:
                    raise f.exception()
            return [r for f in futures for r in f.result()]
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        """Every engine joins the weight-transfer group. vLLM ranks a worker within it by
        `rank_offset` + its engine's data-parallel index × the engine's workers + its own rank;
        these engines are separate `LLM`s, each with data-parallel index 0, so engine e's workers
        are given the offset after the workers of engines 0 … e − 1 (otherwise they all claim
        the trainer's `rank_offset`, and the rendezvous never completes)."""
        infos, offset = [], init_info.get("rank_offset")
        for e in self.engines:
            info = dict(init_info)
            if offset is not None:  # NCCL-style group (the shm backend has no ranks)
                info["rank_offset"] = offset
                offset += e.vllm_config.parallel_config.world_size  # TP × PP workers
            infos.append({"init_info": info})
        self._each("init_weight_transfer_engine", infos)

    def begin_update(self) -> None:
        for e, child in zip(self.engines, self.child):
            if child:  # its core steps on its own: hold it between two steps (requests kept)
                e.engine_core.call_utility("pause_scheduler", "keep", False)
        try:
            self.collective_rpc("start_weight_update")
        except BaseException:
            self._resume()
            raise

    def load(self, update_info: dict) -> None:
        self.collective_rpc("update_weights", {"update_info": update_info})

    def _finish_update(self) -> None:
        self.collective_rpc("finish_weight_update")
        if self.reprefill_on_update:  # after the load: an in-process engine may step between an update's calls
            for e, child in zip(self.engines, self.child):
                _preempt_running(e, child)

    def _update_failures(self) -> list:
        return self.collective_rpc("pace_weight_update_failure")

    def _resume(self) -> None:
        for e, child in zip(self.engines, self.child):
            if child:
                e.engine_core.call_utility("resume_scheduler")

    def fingerprint_updates(self) -> None:
        """Every worker fingerprints the weights it receives from the next update on (pace/weights/fingerprint.py)."""
        self.collective_rpc("pace_fingerprint_updates")

    def weights_reloaded(self) -> dict[int, bool]:
        return {i: any(r["reloaded"] for r in llm.collective_rpc("pace_weights_reloaded")) for i, llm in enumerate(self.llms)}

    def fingerprints(self) -> list:
        return self.collective_rpc("pace_weight_fingerprint")

    def set_version(self, version: int) -> None:
        for e in self.engines:
            e.set_weight_version(str(version))
        self.version = version

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop every engine. Out-of-process engines started deaf to SIGTERM (pace/signals.py) do not
        act on vLLM's terminate: ``timeout`` s later vLLM kills them (None: its default, 5 s each)."""
        for e in self.engines:
            e.engine_core.shutdown(timeout=timeout)


def _preempt_running(engine, child: bool) -> None:
    """Drop the KV of every running request of one engine (each goes back to the queue, its tokens
    kept, and is prefilled again when the engine resumes) and empty its prefix cache."""
    args = (True, False)  # reset_running_requests, reset_connector
    ok = engine.engine_core.call_utility("reset_prefix_cache", *args) if child else engine.reset_prefix_cache(*args)
    if not ok:
        raise RuntimeError("vLLM could not drop the KV cache of its running requests (rollout.kv_on_update=recompute)")


def _is_child(engine) -> bool:
    return hasattr(getattr(engine, "engine_core", None), "outputs_queue")  # SyncMPClient; InprocClient has none


def _pending(engine) -> bool:
    return not engine.engine_core.outputs_queue.empty()


def _wait_any(engines, timeout: float) -> None:
    """Block until one of the (out-of-process) engines has outputs, or ``timeout``."""
    if len(engines) == 1:  # wait on the queue's own condition without taking the item
        q: queue.Queue = engines[0].engine_core.outputs_queue
        with q.not_empty:
            if not q._qsize():
                q.not_empty.wait(timeout)
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not any(_pending(e) for e in engines):
        time.sleep(0.0005)
