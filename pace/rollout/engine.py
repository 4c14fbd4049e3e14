"""The in-process vLLM engine: construction, in-place weight reload, prefix rescoring.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the rollout thread can
step it and load weights between steps. With tensor parallelism vLLM still runs its workers in
their own processes; weights then travel through `collective_rpc` as a list.
"""
from __future__ import annotations

import os
from collections.abc import Iterable

import torch


def configure_environment(rollout_cfg, device: str) -> None:
    """Environment vLLM reads at import / engine start. Must run before `import vllm`.

    On CPU the engine and the trainer share the cores: by default each gets one OpenMP thread and
    no core binding (`rollout.cpu_threads_bind=nobind`), measured on 2 cores to keep ~94% / ~91% of
    their one-thread speeds when they overlap, against 60% / 49% with vLLM's default binding.
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(rollout_cfg.kv_cache_gib))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", rollout_cfg.cpu_threads_bind)
        if rollout_cfg.cpu_threads_bind == "nobind":
            os.environ.setdefault("OMP_NUM_THREADS", str(rollout_cfg.cpu_threads))


def build_engine(model_path: str, rollout_cfg, dtype: str, seed: int):
    import logging

    from vllm import LLM

    llm = LLM(
        model=model_path,
        dtype=dtype,
        seed=seed,
        max_model_len=rollout_cfg.max_model_len,
        max_num_seqs=rollout_cfg.max_num_seqs,
        tensor_parallel_size=rollout_cfg.tensor_parallel_size,
        gpu_memory_utilization=rollout_cfg.gpu_memory_utilization,
        enforce_eager=rollout_cfg.enforce_eager,
        enable_prefix_caching=True,
        # Validation (VALIDATION_PRIORITY) and PACE's prefix-rescoring requests (SCORING_PRIORITY)
        # are scheduled ahead of waiting generation requests; generation requests all share
        # priority 0 (FCFS among them).
        scheduling_policy="priority",
        # Tokens returned by a step must come from the weights loaded before that step, so that
        # v_t is exact: no batch may be in flight across a weight update.
        async_scheduling=False,
        # ℓ^μ must be the log-prob of the distribution actually sampled (after temperature / top-p).
        logprobs_mode="processed_logprobs",
    )
    # Two warnings that repeat and mean nothing here: every in-place reload says rotary embeddings
    # (a cache buffer, no checkpoint weights) loaded nothing, and vLLM's CPU worker says it ignores
    # torch.set_num_threads (it replaced the function). vLLM configures its loggers while building
    # the engine, so they are quieted after.
    for name in ("vllm.model_executor.model_loader.reload.layerwise", "vllm.v1.worker.cpu_worker"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return llm


def load_weights(llm, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Reload weights in place (between engine steps) and invalidate cached prefixes.

    `model.load_weights` is not enough on CPU: linear weights are repacked after loading, and
    vLLM's `reload_weights` redoes that processing. In-flight requests keep their KV entries and
    continue under the new weights. No new request may reuse a prefix computed under older
    weights: the rollout salts every request's prefix-cache key with the weight version
    (`cache_salt`), which holds even while requests run; vLLM's `reset_prefix_cache` refuses while
    blocks are in use, so it is called (to free the old entries) only when the engine is idle.
    """
    weights = list(named_tensors)
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    if not llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.reset_prefix_cache()


SCORING_PRIORITY = -1  # lower runs first (vLLM priority scheduling); generation uses 0
VALIDATION_PRIORITY = -2  # in-training validation holds weight updates: it goes first


def cache_salt(version: int) -> str:
    """Prefix-cache salt of requests served by weight version ``version``."""
    return f"v{version}"


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


def scoring_params():
    """Rescoring a token sequence: one prefill with the log-prob of every prompt token."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)


def prompt_token_logprobs(output, token_ids: list[int], start: int) -> list[float]:
    """Log-probs of ``token_ids[start:]`` from a finished scoring request's ``prompt_logprobs``."""
    return [output.prompt_logprobs[t][token_ids[t]].logprob for t in range(start, len(token_ids))]


def rescore(llm, sequences: list[tuple[list[int], int]]) -> list[list[float]]:
    """Log-probs of each ``ids[start:]`` under the engine's current weights (blocking).

    Only for a caller that owns the engine exclusively (tests, evaluation); the rollout thread
    routes scoring requests through its own step loop instead.
    """
    engine = llm.llm_engine
    params = scoring_params()
    for i, (ids, _) in enumerate(sequences):
        engine.add_request(f"rescore-{i}", {"prompt_token_ids": ids}, params)
    results: dict[int, list[float]] = {}
    while len(results) < len(sequences):
        for out in engine.step():
            if out.finished and out.request_id.startswith("rescore-"):
                i = int(out.request_id.split("-")[1])
                ids, start = sequences[i]
                results[i] = prompt_token_logprobs(out, ids, start)
    return [results[i] for i in range(len(sequences))]
