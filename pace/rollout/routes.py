"""MoE routing replay, the engine side (`algo.routing_replay`): every generation engine returns the
experts it routed each token to, and the rollout records them per token (`Trajectory.prompt_routes`
/ `routes`, pace/records.py) for the trainer's forward to replay (docs/routing-replay.md).

vLLM 0.32 returns them as `CompletionOutput.routed_experts` ([positions, layers, top-k], uint8 up
to 256 experts) on a request's finished output only, with `enable_return_routed_experts` (server:
`--enable-return-routed-experts`; prefix caching on, which every rollout engine has). The rows
cover sequence positions ``routed_experts_prompt_start`` … ``len(prompt) + generated − 2`` (the
last sampled token is never an input). A request asks only for the positions its response has not
recorded yet (`prompt_start`): 0 for a first request, P + len(routes) for a continuation (a tool
turn, a restart continuation, a failover continuation: pace/rollout/tool_turns.py `_continue`),
kept per request (`_Pending.route_start`) for the rows it returns.

Only Model Runner V2 returns routes, and it needs Triton: `unsupported` says why an installed vLLM
cannot (the CPU build has no Triton CPU backend), and `check_engine` refuses the run in one line.
"""
from __future__ import annotations

import os

import numpy as np

from pace.errors import ConfigError

KEY = "algo.routing_replay"
SERVE_FLAG = "--enable-return-routed-experts"


def _vllm_line(module, needle: str) -> str:
    """``vllm/<path>:<line>`` of the first line of ``module``'s source holding ``needle`` (the
    installed vLLM's own line, not a number copied from another version)."""
    import inspect

    import vllm

    path = inspect.getsourcefile(module)
    rel = os.path.relpath(path, os.path.dirname(os.path.dirname(vllm.__file__)))
    with open(path, encoding="utf-8") as f:
        line = next((i for i, text in enumerate(f, 1) if needle in text), None)
    return rel if line is None else f"{rel}:{line}"


def unsupported() -> str | None:
    """Why the installed vLLM cannot return routed experts, decided as vLLM decides it
    (`VllmConfig.use_v2_model_runner`, `_verify_aux_output_compatibility`); None when it can.
    For the settings the rollout engines use (no speculative decoding, no pipeline parallelism)
    the runner is Model Runner V2 unless VLLM_USE_V2_MODEL_RUNNER=0 or Triton is missing; forcing
    VLLM_USE_V2_MODEL_RUNNER=1 without Triton reaches MRV2's Triton kernels, which cannot run."""
    import vllm.config.vllm as vllm_config
    import vllm.envs as envs
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if current_platform.is_tpu() or current_platform.is_out_of_tree():
        return None  # their own model runners; vLLM leaves the check to them
    needs_v2 = _vllm_line(vllm_config, "AuxOutput Connector requires Model Runner V2")
    if envs.VLLM_USE_V2_MODEL_RUNNER is False:
        return f"VLLM_USE_V2_MODEL_RUNNER=0 turns off Model Runner V2, the only runner that returns them ({needs_v2})"
    if not HAS_TRITON:
        runner = _vllm_line(vllm_config, "Model Runner V2 requires Triton")
        return (f"this vLLM build has no Triton backend (vllm.triton_utils.HAS_TRITON is False), so it runs the V1 "
                f"model runner ({runner}), and only Model Runner V2 returns them ({needs_v2})")
    return None


def check_engine() -> None:
    """Refuse routing replay, in one line, on a vLLM that cannot return routes (before an engine
    or a server of this host is built)."""
    why = unsupported()
    if why is not None:
        raise ConfigError(f"{KEY}=true: the rollout engines cannot return routed experts: {why}")


def prompt_start(traj, prompt_len: int) -> int:
    """The first sequence position of a response whose route is not recorded: what its next engine
    request asks from (`SamplingParams.routed_experts_prompt_start`). 0 while nothing is recorded
    (a first request, or one after a request whose routes were lost: see `record`)."""
    if traj is None or traj.prompt_routes is None:
        return 0
    return prompt_len + (0 if traj.routes is None else len(traj.routes))


def record(traj, rows, start: int, prompt_len: int, request: str, engine) -> None:
    """The rows of a finished request (``rows``: its `routed_experts`) into the response's record,
    from ``start``, the position the request asked for when it was sent (kept per request, not
    recomputed here: the rows stay where they belong should the record change while it runs). A
    finished output without them means an engine that does not return routes (a server started
    without `--enable-return-routed-experts`)."""
    if rows is None:
        raise ConfigError(f"{KEY}=true: rollout engine {engine} returned no routed experts for request {request} "
                          f"(a server started without {SERVE_FLAG}? pace.rollout.server adds it)")
    traj.add_routes(rows, start, prompt_len)


def route_metrics(trajs) -> dict:
    """`moe/route_bytes_per_token`: bytes of the route record (the prompt's rows, which each response
    holds, included) per response token, of ``trajs`` (a step's consumed groups: pooled groups, so
    the pool's host memory for routes is about this × its response tokens; the denominator of
    scripts/bench_memory.py's bytes per pooled token). {} when none has routes."""
    nbytes = sum(r.nbytes for t in trajs for r in (t.prompt_routes, t.routes) if r is not None)
    if not nbytes:
        return {}
    return {"moe/route_bytes_per_token": nbytes / max(sum(len(t) for t in trajs), 1)}


def decode(b64: str) -> np.ndarray:
    """A server's `routed_experts` (base64 of the array's `.npy` bytes: vLLM's `numpy2base64`,
    vllm/utils/serial_utils.py; decoded as vLLM's protocol says: np.load of the base64-decoded bytes)."""
    import base64
    import io

    return np.load(io.BytesIO(base64.b64decode(b64)), allow_pickle=False)
