"""The vLLM engines: environment, construction and placement, prefix rescoring helpers.

`rollout.engine_process` places each engine core: ``inproc`` (in this process, stepped by the
rollout thread: the CPU default with one trainer process, ~13-24 s faster to start on 2 cores) or
``child`` (its own process, never inside the trainer's process group: required with more than
one trainer process, and the GPU default). `rollout.engines` data-parallel engines of
`rollout.tensor_parallel_size` GPUs each run on GPUs of their own (`rollout.gpus`), the trainer
on the others (pace/placement.py decides). Weights reach them through vLLM's weight-transfer API
(pace/weights/transfer.py).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

import torch

from pace import priority
from pace.placement import _LAUNCHER_ENV, Placement, backend_kind, compile_cache_root, visible_devices


def configure_environment(rollout_cfg, device: str) -> None:
    """Environment vLLM reads at import / engine start. Must run before `import vllm`.

    On CPU the engine and the trainer share the cores: by default each gets one OpenMP thread and
    no core binding (`rollout.cpu_threads_bind=nobind`), measured on 2 cores to keep ~94% / ~91% of
    their one-thread speeds when they overlap, against 60% / 49% with vLLM's default binding.
    """
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # an engine core in a child process is started fresh (never a fork of a trainer process,
    # whose torch.distributed state vLLM would find and join)
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    # backend_kind, not Placement.of: train.py calls this before its Accelerator exists, so the
    # world size Placement.of needs is not known yet (the backend does not depend on it)
    if backend_kind(rollout_cfg, device) == "ipc" and rollout_cfg.engine_process != "inproc":
        # vLLM's IPC update hands the engine CUDA IPC handles (a rebuild function and its
        # arguments) as collective_rpc arguments; between processes its msgpack encoder and the
        # engine's decoder accept them only with pickle allowed (vllm/v1/serial_utils.py), read
        # when the engine starts (vLLM caches its environment then). Both ends are this run's
        # own processes on one GPU.
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    if device == "cpu":
        os.environ.setdefault(priority.ENV, str(rollout_cfg.engine_nice))  # the rollout's processes (pace/priority.py)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(rollout_cfg.kv_cache_gib))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", rollout_cfg.cpu_threads_bind)
        if rollout_cfg.cpu_threads_bind == "nobind":
            os.environ.setdefault("OMP_NUM_THREADS", str(rollout_cfg.cpu_threads))


@contextlib.contextmanager
def _engine_process_env(mode: str, gpus: list[int] | None, cache_root: str | None = None):
    """While a child engine process starts: without the launcher's variables or the trainer's
    allocator setting (pace/allocator.py), with its GPUs (and ``cache_root`` as its VLLM_CACHE_ROOT
    if given)."""
    if mode != "child":
        yield
        return
    from pace.allocator import engine_excluded

    saved = {k: os.environ.pop(k) for k in (*_LAUNCHER_ENV, *engine_excluded(os.environ)) if k in os.environ}
    if gpus is not None:
        saved["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices(gpus, saved["CUDA_VISIBLE_DEVICES"])
    if cache_root is not None:
        saved["VLLM_CACHE_ROOT"] = os.environ.get("VLLM_CACHE_ROOT")
        os.environ["VLLM_CACHE_ROOT"] = cache_root
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def build_engine(model_path: str, rollout_cfg, dtype: str, seed: int, mode: str = "inproc",
                 backend: str | None = "auto", gpus: list[int] | None = None, routes: bool = False):
    """One vLLM engine (`LLM`). ``mode`` places its core; ``backend`` enables vLLM's weight
    transfer (a `Placement.transfer`; ``auto``: `rollout.weight_transfer` for this machine, pace's
    shared-memory backend on CPU, which `load_weights` uses, registered in the worker by
    `worker_extension_cls`; None: no weight transfer). ``routes``: it returns each token's routed
    experts (`algo.routing_replay`, pace/rollout/routes.py)."""
    if backend == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        backend = Placement(device, 1, mode, backend_kind(rollout_cfg, device), None).transfer
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if mode == "child" else "0"
    with _engine_process_env(mode, gpus):
        if mode == "child" and priority.niceness() > 0:  # its core process inherits the building thread's priority
            return _in_thread("pace-engine-build", _lowered(_new_llm), model_path, rollout_cfg, dtype, seed, backend,
                              routes).result()
        return _new_llm(model_path, rollout_cfg, dtype, seed, backend, routes)


def _lowered(fn):
    """``fn`` on a thread lowered first (`rollout.engine_nice`, pace/priority.py)."""
    def run(*args):
        priority.lower_thread()
        return fn(*args)
    return run


def _new_llm(model_path: str, rollout_cfg, dtype: str, seed: int, backend: str | None, routes: bool = False):
    import logging

    from vllm import LLM
    from vllm.config import WeightTransferConfig

    from pace.weights import transfer

    extra = {}
    if backend is not None:
        extra = dict(weight_transfer_config=WeightTransferConfig(backend=transfer.engine_backend(backend)),
                     worker_extension_cls="pace.weights.transfer.WorkerExtension")
    if routes:  # MoE routing replay: each finished request returns its tokens' routed experts
        extra["enable_return_routed_experts"] = True
    if _cpu_worker_in_core(rollout_cfg):
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        extra["distributed_executor_backend"] = UniProcExecutor
    llm = LLM(
        model=model_path,
        dtype=dtype,
        seed=seed,
        max_model_len=rollout_cfg.max_model_len,
        max_num_seqs=rollout_cfg.max_num_seqs,
        tensor_parallel_size=rollout_cfg.tensor_parallel_size,
        gpu_memory_utilization=rollout_cfg.gpu_memory_utilization,
        enforce_eager=rollout_cfg.enforce_eager,
        enable_prefix_caching=True,  # (routed experts need it too: vllm/config/vllm.py, AuxOutput)
        # Validation (VALIDATION_PRIORITY) and PACE's prefix-rescoring requests (SCORING_PRIORITY)
        # are scheduled ahead of waiting generation requests; generation requests all share
        # priority 0 (FCFS among them).
        scheduling_policy="priority",
        # Tokens returned by a step must come from the weights loaded before that step, so that
        # v_t is exact: no batch may be in flight across a weight update.
        async_scheduling=False,
        # ℓ^μ must be the log-prob of the distribution actually sampled (after temperature / top-p).
        logprobs_mode="processed_logprobs",
        **extra,
    )
    # A warning that repeats and means nothing here: vLLM's CPU worker says it ignores
    # torch.set_num_threads (it replaced the function). vLLM configures its loggers while building
    # the engine, so it is quieted after. (The reload's "Failed to load weights" warnings are
    # decided, not quieted: pace/weights/reload.py.)
    logging.getLogger("vllm.v1.worker.cpu_worker").setLevel(logging.ERROR)
    return llm


def _cpu_worker_in_core(rollout_cfg) -> bool:
    """Whether an out-of-process engine on this CPU runs its model worker in its core process, as a GPU engine at
    tensor-parallel size 1 does. vLLM-CPU otherwise moves it to a process of its own (it turns the "uni"
    executor into "mp" when multiprocessing is on: vllm/platforms/cpu.py, for OpenMP threads bound to cores),
    one more process importing torch and vLLM (~16 s of CPU, ~0.4 GB) per engine. The executor given as a
    class is left as it is; done only with the threads unbound (`rollout.cpu_threads_bind=nobind`, the default),
    where nothing binds."""
    from vllm.platforms import current_platform

    return (current_platform.is_cpu() and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1"
            and rollout_cfg.tensor_parallel_size == 1 and os.environ.get("VLLM_CPU_OMP_THREADS_BIND") == "nobind")


def build_engines(model_path: str, rollout_cfg, dtype: str, seed: int, placement: Placement,
                  transfer: bool = True, routes: bool = False) -> list:
    """`rollout.engines` engines placed as ``placement`` says (engine e seeded ``seed + e``, on
    ``placement.gpus[e]`` if given), with its weight-transfer backend (``transfer=False``: none);
    ``routes``: returning routed experts (refused first, in one line, by a vLLM that cannot).

    Out-of-process engines (``child``) on GPUs of their own are built at once, each `LLM(...)` in a
    thread of its own: nearly all of a build (loading the weights, profiling memory, compiling,
    capturing CUDA graphs) runs in the engine's core process and overlaps. Without a placement (CPU,
    or engines sharing a GPU, whose memory profiles must not overlap) they are built one after
    another: on 2 CPU cores two tiny engines took 85-100 s at once against 73 s one after another.

    What a core process inherits is read from this process's environment when vLLM spawns it (its
    GPUs, no launcher variables), so the spawns stay one at a time: each engine's environment is
    set, its build started, and restored as soon as its core process exists (`_started_core`).
    The window is not closed: engine e's thread goes on running vLLM code in this process while engine
    e+1's environment is set, and vLLM reads most of its variables lazily (`vllm.envs`, on each
    access), so a variable read there after its core process exists sees the next engine's value.
    `_engine_process_env` sets only what the core process must inherit (its GPUs, no launcher
    variables), which that code does not read. A build that spawns no core process within
    `rollout.server_start_timeout_s` fails the fleet, naming the engine (its thread, which cannot be
    stopped, is left behind; an engine it still makes is shut down).
    Engines e ≥ 1 keep their compile caches apart (VLLM_CACHE_ROOT/pace-engine-e): separate `LLM`s
    share vLLM's cache directory (rank 0 of data-parallel rank 0 each) and would write it at once.
    In-process engines share this process's vLLM state: built one after another."""
    if routes:
        from pace.rollout import routes as routes_lib

        routes_lib.check_engine()
    mode, backend = placement.mode, placement.transfer if transfer else None
    gpus = [list(ids) for ids in placement.gpus] if placement.gpus is not None else [None] * rollout_cfg.engines
    own_gpus = placement.gpus is not None and len({g for ids in gpus for g in ids}) == sum(map(len, gpus))
    if mode != "child" or len(gpus) == 1 or not own_gpus:
        return [build_engine(model_path, rollout_cfg, dtype, seed + e, mode, backend, gpus[e], routes)
                for e in range(len(gpus))]
    from concurrent.futures import wait

    import vllm  # imported once here, not by the threads at once

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    futures, error = [], None
    try:
        for e, engine_gpus_ in enumerate(gpus):
            with _engine_process_env("child", engine_gpus_, cache_root=compile_cache_root(e)):
                before = _core_processes()
                futures.append(_in_thread(f"pace-engine-build-{e}", _lowered(_new_llm), model_path, rollout_cfg, dtype,
                                          seed + e, backend, routes))
                _started_core(before, futures[-1], e, rollout_cfg.server_start_timeout_s)
    except BaseException as exc:  # noqa: BLE001 - raised below, once the builds started have ended
        error = exc
        if isinstance(exc, TimeoutError):  # the hung build is not waited for; an engine it makes is shut down
            futures.pop().add_done_callback(lambda f: f.exception() is None and shutdown(f.result()))
    wait(futures)  # every build started (but a hung one) has ended: its engine is up, or it failed
    error = error or next((f.exception() for f in futures if f.exception() is not None), None)
    if error is not None:
        for f in futures:  # no engine of a failed fleet is left running
            if f.exception() is None:
                shutdown(f.result())
        raise error
    return [f.result() for f in futures]


def _in_thread(name: str, fn, *args):
    """``fn(*args)`` in a daemon thread of its own; its future. (Not a ThreadPoolExecutor: its threads
    are joined at interpreter exit, and a hung build would keep the process from exiting.)"""
    import threading
    from concurrent.futures import Future

    future = Future()

    def run():
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - the caller reads it from the future
                future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def _core_processes() -> set[int]:
    import multiprocessing

    return {p.pid for p in multiprocessing.active_children() if p.name.startswith("EngineCore")}


def _started_core(before: set[int], build, engine: int, timeout_s: float, poll_s: float = 0.01) -> None:
    """Wait until the build ``build`` (a future) of engine ``engine`` has spawned its engine core
    process (vLLM names it EngineCore) or has ended; TimeoutError after ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    while not build.done() and not (_core_processes() - before):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rollout engine {engine}: no EngineCore process {timeout_s:g} s after its build "
                               f"started (rollout.server_start_timeout_s={timeout_s:g})")
        time.sleep(poll_s)


def build_fleet(model_path: str, cfg, placement: Placement, version: int = 0, tokenizer=None,
                log_dir: str | None = None):
    """The rollout engines of a run (rank 0) where ``placement`` puts them, labelled with weight
    version ``version``. Server mode: `rollout.servers`, or `rollout.engines` servers started here
    (logs in ``log_dir``). With `algo.routing_replay` every engine returns routed experts."""
    from pace.rollout.fleet import EngineFleet

    if placement.mode == "server":
        from pace.rollout import remote

        return remote.build(model_path, cfg, placement, tokenizer, log_dir, version)
    fleet = EngineFleet(build_engines(model_path, cfg.rollout, cfg.model.dtype, cfg.seed, placement,
                                      routes=cfg.algo.routing_replay))
    fleet.set_version(version)
    return fleet


def load_weights(llm, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load (name, tensor) pairs into an idle in-process engine through the same weight-transfer
    calls as a run's sync (a one-off shared-memory slot), and free its cached prefixes (tests,
    tools; a run's rollout thread goes through `RolloutWorker.post_update`)."""
    from dataclasses import asdict

    from pace.weights import transfer
    from pace.rollout.fleet import EngineFleet

    named = list(named_tensors)
    path = os.path.join(transfer.shm_dir(), f"pace-weights-load-{os.getpid()}.bin")
    fleet = EngineFleet([llm])
    try:
        info = transfer.write_slot(path, transfer.tensor_meta(named), iter(named))
        fleet.init_weight_transfer_engine({"directory": transfer.shm_dir()})
        fleet.update(None, asdict(info))
    finally:
        if os.path.exists(path):
            os.unlink(path)
    fleet.reset_prefix_cache_if_idle()


SCORING_PRIORITY = -1  # lower runs first (vLLM priority scheduling); generation uses 0
VALIDATION_PRIORITY = -2  # in-training validation holds weight updates: it goes first


# A server (rollout.engine_process=server) outlives a run: another run, or this one resumed, loads
# different weights under the same version number, so the salt names this process too.
_PROCESS_SALT = f"{os.getpid():x}{int.from_bytes(os.urandom(4), 'big'):08x}"


def cache_salt(version: int) -> str:
    """Prefix-cache salt of requests served by weight version ``version`` in this process."""
    return f"{_PROCESS_SALT}-v{version}"


def shutdown(llm, timeout: float | None = None) -> None:
    """Shut an `LLM` down (``timeout``: `EngineFleet.shutdown`; a fleet has its own `shutdown`)."""
    llm.llm_engine.engine_core.shutdown(timeout=timeout)


def scoring_params(length: int = 0):
    """Rescoring a token sequence: one prefill with the log-prob of every prompt token. ``length``:
    the sequence's, whose routed experts (MoE routing replay: an engine that returns them) are then
    not asked for — a scoring request's routes are not recorded."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, routed_experts_prompt_start=length,
                          flat_logprobs=True)


def sampled_logprobs(comp) -> list[float]:
    """ℓ^μ of a completion's new tokens (requests ask for ``logprobs=0``: the sampled token's own).
    vLLM's `FlatLogprobs` (``flat_logprobs=True``, as the rollout's requests ask) keeps them in one
    flat list, one entry a position, read as it is; a list of {token: Logprob} per position (a
    request without it) is read entry by entry."""
    lps, ids = comp.logprobs, comp.token_ids
    flat = getattr(lps, "logprobs", None)
    if flat is not None and len(flat) == len(lps) == len(ids) and lps.token_ids == list(ids):
        return flat
    return [lp[tok].logprob for tok, lp in zip(ids, lps)]


def prompt_token_logprobs(output, token_ids: list[int], start: int) -> list[float]:
    """Log-probs of ``token_ids[start:]`` from a finished scoring request's ``prompt_logprobs``
    (vLLM's `FlatLogprobs` or a list of {token: Logprob} per position)."""
    plp = output.prompt_logprobs
    starts = getattr(plp, "start_indices", None)
    if starts is None:
        return [plp[t][token_ids[t]].logprob for t in range(start, len(token_ids))]
    ends, toks, vals = plp.end_indices, plp.token_ids, plp.logprobs
    out = []
    for t in range(start, len(token_ids)):
        i = next((i for i in range(starts[t], ends[t]) if toks[i] == token_ids[t]), None)
        if i is None:
            raise ValueError(f"prompt_logprobs of position {t} hold no entry for its token {token_ids[t]}")
        out.append(vals[i])
    return out


def rescore(llm, sequences: list[tuple[list[int], int]]) -> list[list[float]]:
    """Log-probs of each ``ids[start:]`` under the engine's current weights (blocking).

    Only for a caller that owns the engine exclusively (tests, evaluation); the rollout thread
    routes scoring requests through its own step loop instead.
    """
    from pace.rollout import request_ids

    engine = llm.llm_engine
    params = scoring_params()
    index = {request_ids.rescore(i): i for i in range(len(sequences))}
    for rid, i in index.items():
        engine.add_request(rid, {"prompt_token_ids": sequences[i][0]}, params)
    results: dict[int, list[float]] = {}
    while len(results) < len(sequences):
        for out in engine.step():
            i = index.get(out.request_id)
            if out.finished and i is not None:
                ids, start = sequences[i]
                results[i] = prompt_token_logprobs(out, ids, start)
    return [results[i] for i in range(len(sequences))]
