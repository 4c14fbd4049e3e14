"""The rollout engines as one: `rollout.engines` data-parallel vLLM engines behind the request
interface of a single `LLMEngine` (`add_request`, `abort_request`, `step`,
`has_unfinished_requests`), used only from the rollout thread.

Each engine is a vLLM `LLM` whose engine core runs either in this process
(`rollout.engine_process=inproc`: `step()` runs the model here, between our calls) or in its own
process (`child`: the core runs its busy loop there, `step()` collects what it produced). Requests
are spread over the engines: the G requests of a group go to the engine with the fewest
unfinished requests (they share a prompt, so its prefix is computed once); a request's later
turns and its abort follow it.

Weight updates (`update`) go through vLLM's weight-transfer RPCs on every engine, each between a
`pause_scheduler(mode="keep")` and a `resume_scheduler` of that engine (in-flight requests keep
their KV and continue under the new weights), and each engine's outputs are stamped by vLLM with
the version set by `set_weight_version` (`CompletionOutput.weight_versions`).
"""
from __future__ import annotations

import queue
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait


class EngineFleet:
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

    # --- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: dict, params, priority: int = 0, group: str | None = None) -> None:
        if group is not None and group in self._group_engine:
            i = self._group_engine[group]
        else:
            i = min(range(len(self.engines)), key=self._load.__getitem__)
            if group is not None:
                self._group_engine[group] = i
        self.engines[i].add_request(request_id, prompt, params, priority=priority)
        self._owner[request_id] = i
        self._load[i] += 1

    def holds(self, request_id: str) -> bool:
        """Whether a request of that id is in an engine, unfinished."""
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
                outputs.append(out)
        return outputs

    def partial_versions(self, request_id: str, n: int):
        """The versions of the first ``n`` output tokens of an unfinished request, from its engine's
        output processor (the labels `CompletionOutput.weight_versions` is built from when the
        request finishes); None if the engine holds no state for it or has labelled fewer tokens."""
        import numpy as np

        i = self._owner.get(request_id)
        if i is None:
            return None
        processor = self.engines[i].output_processor
        internal = processor.external_req_ids.get(request_id) or [request_id]
        state = processor.request_states.get(internal[0])
        starts = getattr(state, "weight_version_starts", None)
        if not starts or state.detokenizer.num_output_tokens() != n:
            return None
        ends = [start for _, start in starts[1:]] + [n]
        return np.repeat(np.array([int(v) for v, _ in starts], dtype=np.int32),
                         np.array([e - s for (_, s), e in zip(starts, ends)], dtype=np.int64))

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

    def update(self, version: int | None, update_info: dict) -> float:
        """Load one weight update into every engine; its tokens from here on are labelled
        ``version`` (None: the label stays). Returns the seconds it took (out-of-process engines
        are paused meanwhile)."""
        t0 = time.perf_counter()
        self.begin_update()
        try:
            self.load(update_info)
        except BaseException:
            self._resume()
            raise
        self.end_update(version)
        return time.perf_counter() - t0

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

    def end_update(self, version: int | None) -> None:
        """Finish the update on every engine, then fail it (`IncompleteWeightUpdate`, the version
        label unchanged) if any worker's checks found layers without the sent weights."""
        from pace.weights.reload import IncompleteWeightUpdate

        try:
            self.collective_rpc("finish_weight_update")
            failures = [f for f in self.collective_rpc("pace_weight_update_failure") if f]
            if failures:
                more = f" (and {len(failures) - 1} more workers)" if len(failures) > 1 else ""
                raise IncompleteWeightUpdate(failures[0] + more)
            if version is not None:
                self.set_version(version)
        finally:
            self._resume()

    def _resume(self) -> None:
        for e, child in zip(self.engines, self.child):
            if child:
                e.engine_core.call_utility("resume_scheduler")

    def fingerprint_updates(self) -> None:
        """Every worker fingerprints the weights it receives from the next update on (pace/weights/fingerprint.py)."""
        self.collective_rpc("pace_fingerprint_updates")

    def fingerprints(self) -> list:
        """Each worker's fingerprints of its last update, in engine order."""
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
