"""The stale-KV probe (`rollout.kv_probe`): how far a spanning response's post-update log-probs are
from those of the new weights with a fresh context, measured on the rollout engines. A mixin of
`RolloutWorker`; state: ``_kv_probes`` (request id → `_Probe`), ``_kv_hold`` and the counters
``kv_probes``, ``kv_probe_cancelled``, ``kv_probe_tokens``, ``kv_probe_abs_sum`` in its stats.

A request that spans an update (its last token at a later version than its first) goes on under
θ_{v+1} but, with `rollout.kv_on_update=keep`, attends to keys and values its prompt and earlier
tokens got under θ_v: the ℓ^μ_t of its tokens labelled v+1 are not log π_{θ_{v+1}}(y_t | y_<t). The
trainer's on-policy mismatch guard cannot see it in an async run (a token is consumed a step or
more after the update that labelled it), so it is measured here. When such a response finishes
while the engines still hold the version of its last token, a share `kv_probe` of them (drawn per
response from data.seed, its group id and its index: the same responses in a repeated run) is
prefilled again whole (prompt + response, one request with prompt log-probs, ahead of generation)
under those weights; over the probed tokens

    P = {t ≥ s : y_t the model's own, v_t = v_probe, v_t > v_s}     (s: the last request's first token)

the mean |ℓ^μ_t − ℓ_fresh_t| is `mismatch/kv_abs_logp_diff` (per logged step, over the probes
returned since the last one; NaN when none did) and |P| is `mismatch/kv_tokens`. With
`recompute` it is the float floor (the running requests were prefilled again at the update). The
probe's prompt log-probs are untempered and ℓ^μ is the sampled distribution's, so it runs at
rollout.temperature = 1 only (pace/config_checks.py).

Exactness: a probe is computed by the weights it is labelled with, or dropped (counted in
`kv_probe_cancelled`): the pending ones are aborted before new weights load (`_cancel_kv_probes`,
beside `_cancel_rescoring`), none is sent between the two halves of an update, one on an engine
that fails is not sent again, and a stop aborts them (a checkpoint keeps none). A probe's tokens
are not generation: they count in no generated-token statistic.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pace.records import Group, Trajectory
from pace.rollout import engine as engine_lib
from pace.rollout import request_ids

STATS = {"kv_probes": 0, "kv_probe_cancelled": 0, "kv_probe_tokens": 0, "kv_probe_abs_sum": 0.0}


def probed_tokens(versions, start: int, action_mask, version: int) -> np.ndarray:
    """Indices of the tokens a probe under ``version`` measures: from the last request's first
    token ``start`` on, the model's own (``action_mask``; None: all), labelled ``version`` and later
    than the request's first token (generated after an update, on the KV of older weights)."""
    v = np.asarray(versions, dtype=np.int64)
    if not 0 <= start < v.size:
        return np.zeros(0, dtype=np.int64)
    keep = np.zeros(v.size, dtype=bool)
    keep[start:] = (v[start:] == version) & (v[start:] > v[start])
    if action_mask is not None:
        keep &= np.asarray(action_mask, dtype=bool)
    return np.flatnonzero(keep)


def kv_gap(versions, start: int, action_mask, behaviour, fresh, version: int) -> tuple[float, int]:
    """Σ |ℓ^μ_t − ℓ_fresh_t| over the probed tokens (float64) and their count. ``behaviour``,
    ``fresh``: per response token, the recorded ℓ^μ and the probe's log-probs."""
    idx = probed_tokens(versions, start, action_mask, version)
    diff = np.abs(np.asarray(behaviour, dtype=np.float64)[idx] - np.asarray(fresh, dtype=np.float64)[idx])
    return float(diff.sum()), int(idx.size)


def kv_probe_metrics(s: dict, last: dict) -> dict:
    """Per logged step, from the worker's stats now (``s``) and at the last step (``last``): the
    mean gap per probed token of the probes returned in the interval (NaN: none), their tokens, and
    the probes sent and dropped."""
    delta = lambda key: s[key] - last.get(key, 0)  # noqa: E731
    tokens = delta("kv_probe_tokens")
    return {"mismatch/kv_abs_logp_diff": delta("kv_probe_abs_sum") / tokens if tokens else float("nan"),
            "mismatch/kv_tokens": tokens, "rollout/kv_probes": delta("kv_probes"),
            "rollout/kv_probe_cancelled": delta("kv_probe_cancelled")}


@dataclass
class _Probe:
    """A finished response being prefilled again under ``version``: what its gap is computed from."""

    version: int
    prompt_len: int
    token_ids: list[int]  # prompt + response
    versions: np.ndarray
    start: int
    action_mask: np.ndarray | None
    logprobs: np.ndarray


class KvProbeMixin:
    def _init_kv_probe(self, cfg) -> None:
        self.kv_probe = cfg.rollout.kv_probe
        self._kv_seed = cfg.data.seed
        self._kv_probes: dict[str, _Probe] = {}
        self._kv_hold: int | None = None  # the version whose update is under way: no probe under it
        self.stats |= STATS

    def _maybe_probe_kv(self, group: Group, idx: int, traj: Trajectory) -> None:
        """A response just finished with its versions final: probe it if its last request spans an
        update to the weights loaded now (versions never go back: then its last token is theirs),
        and the draw says so."""
        v = self.engine_version
        if not self.kv_probe or v == self._kv_hold:
            return
        start = traj.starts[-1] if traj.starts else 0
        if not probed_tokens(traj.versions, start, traj.action_mask, v).size:
            return  # no update to θ_v landed in its last request (or only context after it)
        if np.random.default_rng((self._kv_seed, group.id, idx)).random() >= self.kv_probe:
            return
        ids = group.prompt_ids + traj.response_ids.tolist()
        rid = request_ids.kv_probe(group.id, idx)
        mask = None if traj.action_mask is None else traj.action_mask.copy()
        self._kv_probes[rid] = _Probe(v, len(group.prompt_ids), ids, traj.versions.copy(), start, mask,
                                      traj.logprobs.copy())
        self.fleet.add_request(rid, {"prompt_token_ids": ids, "cache_salt": engine_lib.cache_salt(v)},
                               engine_lib.scoring_params(len(ids)), priority=engine_lib.SCORING_PRIORITY)
        self.stats["kv_probes"] += 1

    def _consume_kv_probe(self, out) -> None:
        probe = self._kv_probes.pop(out.request_id, None)
        if probe is None:  # dropped at an update (its last output may still arrive)
            return
        fresh = engine_lib.prompt_token_logprobs(out, probe.token_ids, probe.prompt_len)
        total, n = kv_gap(probe.versions, probe.start, probe.action_mask, probe.logprobs, fresh, probe.version)
        self.stats["kv_probe_abs_sum"] += total
        self.stats["kv_probe_tokens"] += n

    def _cancel_kv_probes(self) -> None:
        """Before new weights load: the pending probes would run (in part) under them; dropped."""
        self._kv_hold = self.engine_version
        self._drop_kv_probes(list(self._kv_probes))

    def _drop_kv_probes(self, ids: list[str]) -> None:
        """Abort the probes ``ids`` (an engine's that failed, or all of them) and forget them."""
        ids = [rid for rid in ids if self._kv_probes.pop(rid, None) is not None]
        if ids:
            self.fleet.abort_request(ids)
            self.stats["kv_probe_cancelled"] += len(ids)

    def _kv_probe_ids(self) -> list[str]:
        return list(self._kv_probes)
