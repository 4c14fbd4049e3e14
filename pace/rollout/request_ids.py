"""The ids of the rollout thread's engine requests, built and read here only.

Every request the rollout thread sends an engine is one of four kinds, told apart by the id's
first character:

    g<group>-<i>[-<turn>]   response i of group <group>; turn t > 0: its t-th continuation
                            (after a tool call or a restart), a request of its own
    s<group>-<i>            the prefix-scoring request of response i of pooled group <group>
    k<group>-<i>            the stale-KV probe of finished response i of group <group> (its
                            whole sequence prefilled again: pace/rollout/kv_probe.py)
    v<version>-<rest>       an in-training validation of θ_<version> (pace/evaluation.py's `EvalRun`
                            names the rest: ``<set>-<problem>[-<sample>[-<turn>]]``)

`rescore` (pace/rollout/engine.py: tests, evaluation, on an engine the caller steps itself) names
its requests ``rescore-<i>``, apart from all four: never a rollout request, so one on an engine a
rollout worker shares is never taken for the worker's (`parse` refuses it like any other id). So do
the reload probe's (pace/rollout/reload_probe.py, before the rollout starts): ``reload-probe-<phase>-<engine>``.

A group's requests are kept on one engine under its group key (``g<group>`` / ``s<group>``; a
probe, one request, has none); a server's fleet sends each request under a wire id
``<id>.<serial>`` of its own (a request sent again after a failure is a new one to the server).
"""
from __future__ import annotations

from dataclasses import dataclass

RESPONSE, SCORING, VALIDATION, KV_PROBE = "g", "s", "v", "k"


@dataclass(frozen=True)
class RequestId:
    """A parsed id: its kind, its group (a validation: the version), the response and the turn."""

    kind: str
    group: int
    index: int | None = None  # the response within the group (None for a validation)
    turn: int = 0


def response(group: int, index: int, turn: int = 0) -> str:
    return f"{RESPONSE}{group}-{index}" if turn == 0 else f"{RESPONSE}{group}-{index}-{turn}"


def scoring(group: int, index: int) -> str:
    return f"{SCORING}{group}-{index}"


def kv_probe(group: int, index: int) -> str:
    return f"{KV_PROBE}{group}-{index}"


def rescore(index: int) -> str:
    """Sequence ``index`` of a `rescore` call (not a rollout request: `parse` refuses it)."""
    return f"rescore-{index}"


def reload_probe(phase: str, engine: int) -> str:
    """The reload probe's request to engine ``engine`` (``phase``: before or after the reload; not a
    rollout request: `parse` refuses it)."""
    return f"reload-probe-{phase}-{engine}"


def group_key(kind: str, group: int) -> str:
    """The key that keeps a group's requests of ``kind`` (RESPONSE or SCORING) on one engine."""
    if kind not in (RESPONSE, SCORING):
        raise ValueError(f"no group key for request kind {kind!r}")
    return f"{kind}{group}"


def validation_prefix(version: int) -> str:
    """The id prefix of the validation requests of θ_version (`EvalRun(prefix=...)`)."""
    return f"{VALIDATION}{version}"


def evaluation(prefix: str, name: str, problem: int, sample: int | None = None, turn: int = 0) -> str:
    """An `EvalRun` request: problem ``problem`` of set ``name`` (all k samples in one request), or,
    with tools, sample ``sample`` of it (turn t > 0: its t-th continuation)."""
    rid = f"{prefix}-{name}-{problem}"
    if sample is None:
        return rid
    return f"{rid}-{sample}" + (f"-{turn}" if turn else "")


def wire(request_id: str, serial: int) -> str:
    """The id a server's fleet sends a request under (its ``serial``-th request; never read back:
    its outputs come back on the stream of the request they answer)."""
    return f"{request_id}.{serial}"


def parse(request_id: str) -> RequestId:
    """The kind, group, response and turn of a rollout request id; ValueError for any other id."""
    kind, body = request_id[:1], request_id[1:]
    if kind == VALIDATION:
        version, sep, rest = body.partition("-")
        if version.isdigit() and sep and rest:
            return RequestId(VALIDATION, int(version))
    elif kind in (RESPONSE, SCORING, KV_PROBE):
        parts = body.split("-")
        shape = len(parts) in ((2, 3) if kind == RESPONSE else (2,))
        if shape and all(p.isdigit() for p in parts) and (len(parts) == 2 or parts[2] != "0"):
            return RequestId(kind, int(parts[0]), int(parts[1]), int(parts[2]) if len(parts) == 3 else 0)
    raise ValueError(f"request id {request_id!r} is not one of the rollout's (g<group>-<i>[-<turn>], "
                     f"s<group>-<i>, k<group>-<i>, v<version>-...)")


def kind(request_id: str) -> str:
    """RESPONSE, SCORING, KV_PROBE or VALIDATION (ValueError for any other id)."""
    return parse(request_id).kind
