"""vLLM's token-in/token-out generate route as the rollout thread reads it (pure; no server needed).

`/inference/v1/generate` (vLLM 0.32, `--enable-scale-out`) takes token ids and `SamplingParams`
and answers, streamed or whole, with choices carrying token ids, log-probs and, on a request's
last chunk, the per-token `weight_versions` the engine stamped (and, from a server with
`--enable-return-routed-experts`, the request's `routed_experts`: base64 `.npy`, decoded here into
the array an in-process engine gives). `Output` and `Completion` carry the
fields of vLLM's `RequestOutput` / `CompletionOutput` that the rollout reads (pace/rollout/
generation.py, rescoring.py, pace/evaluation.py), so the rollout code is the same for every fleet.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pace.rollout.routes import decode as decode_routes

GENERATE = "/inference/v1/generate"
# (not `flat_logprobs`: a server turns log-probs into JSON either way, and its clamp of −inf prompt
# log-probs, entrypoints/serve/.../serving.py `clamp_prompt_logprobs`, edits dicts a flat container
# only makes up on the fly)
_PARAM_KEYS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "logprobs",
               "prompt_logprobs", "stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
               "skip_special_tokens", "spaces_between_special_tokens", "detokenize", "repetition_penalty",
               "presence_penalty", "frequency_penalty", "routed_experts_prompt_start", "stream_interval")


@dataclass
class Logprob:
    logprob: float


@dataclass
class Span:
    version: str
    start: int
    end: int


@dataclass
class Completion:
    index: int
    token_ids: list
    logprobs: list | None  # per token {token id: Logprob}
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    weight_versions: list | None = None
    routed_experts: np.ndarray | None = None  # [positions, layers, top-k] (last chunk; MoE routing replay)


@dataclass
class Output:
    request_id: str
    outputs: list
    finished: bool
    prompt_logprobs: list | None = None
    engine: int | None = None  # the index of the server that produced it (set by RemoteFleet.step)


async def post(session, url: str, body: dict, fresh=None):
    """``session.post(url, json=body)``'s response, its headers arrived (use it as `async with`). A request
    sent on a pooled connection that the server closed meanwhile (its keep-alive ended while this process
    was too busy to see it) breaks before any response: it never reached the engine, and is sent once
    more, on a new connection (``fresh``: a session that pools none; else ``session``) and under an id of
    its own, so that it cannot meet a first copy the engine may still be aborting. A break after the
    headers is the caller's: the engine had the request."""
    import aiohttp

    try:
        return await session.post(url, json=body)
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
        again = {**body, "request_id": f"{body['request_id']}.again"} if "request_id" in body else body
        return await (fresh or session).post(url, json=again)


def allow_open_files() -> int:
    """A connection a request in flight — thousands on a GPU node (192 groups × 16 responses), past the soft
    limit of 1024 open files many clusters set — so the process that holds them raises its soft limit to
    the hard one (vLLM's API server does as much for itself: `vllm.utils.system_utils.set_ulimit`). The
    soft limit after."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = max(soft, 65536) if hard == resource.RLIM_INFINITY else hard
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def fresh_session():
    """A session whose every request opens a connection of its own (`post`'s second try)."""
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=None, connect=30))


def sse_payloads(buf: bytes) -> tuple[list[bytes], bytes]:
    """The payloads of the complete server-sent events in ``buf`` (a streamed response's bytes so
    far), and what is left of it."""
    payloads = []
    while b"\n\n" in buf:
        event, buf = buf.split(b"\n\n", 1)
        event = event.strip()
        if event.startswith(b"data:"):
            payload = event[len(b"data:"):].strip()
            if payload:
                payloads.append(payload)
    return payloads, buf


def completion_from(choice: dict) -> Completion:
    ids = choice.get("token_ids") or []
    content = (choice.get("logprobs") or {}).get("content")
    lps = None if content is None else flat_logprobs(ids, [c["logprob"] for c in content], [c.get("rank") for c in content])
    return completion(choice.get("index", 0), ids, lps, choice.get("text") or "", choice.get("finish_reason"),
                      choice.get("stop_reason"), choice.get("weight_versions"), choice.get("routed_experts"))


def completion(index: int, ids: list, lps, text: str, finish_reason, stop_reason, spans: list | None,
               routes: str | None) -> Completion:
    """A chunk as the rollout reads it: ``lps`` a `FlatLogprobs` or None, ``spans`` and ``routes`` as
    the server sent them (a list of dicts; base64 `.npy`)."""
    return Completion(index, ids, lps, text, finish_reason, stop_reason,
                      None if spans is None else [Span(**s) for s in spans],
                      None if routes is None else decode_routes(routes))


def flat_logprobs(ids: list, logprobs: list, ranks: list | None = None):
    """The chunk's sampled-token log-probs as vLLM's `FlatLogprobs` (one entry a position, the form
    an engine in this process gives the rollout's requests: no dict and `Logprob` a token)."""
    from vllm.logprobs import FlatLogprobs

    n = len(ids)
    return FlatLogprobs(start_indices=list(range(n)), end_indices=list(range(1, n + 1)), token_ids=list(ids),
                        logprobs=logprobs, ranks=ranks if ranks is not None else [None] * n,
                        decoded_tokens=[None] * n)


def prompt_logprobs_from(entries: list | None) -> list | None:
    if entries is None:
        return None
    return [None if e is None else {int(t): Logprob(v["logprob"]) for t, v in e.items()} for e in entries]


def params_json(params) -> dict:
    """The request's `SamplingParams` as the generate route reads them (the server sets the output kind)."""
    return {k: getattr(params, k) for k in _PARAM_KEYS if getattr(params, k) is not None}
