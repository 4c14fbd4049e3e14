"""Typed records that cross stage boundaries: rollout → pool (`Group`), pool → trainer (`Batch`).

Nothing else crosses: the rollout hands the pool complete, graded groups; the pool hands the
trainer a batch and a list of fates to log.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from pace import staleness


class Fate(str, Enum):
    """Where a submitted group ended (docs/design.md §3). Every group has exactly one."""

    INFLIGHT = "inflight"  # submitted to the engine, not all responses done or graded
    POOLED = "pooled"  # complete and graded, waiting in the pool
    CONSUMED = "consumed"  # trained on
    REJECTED = "rejected"  # removed by a pool policy (with a reason)
    FILTERED = "filtered"  # dynamic sampling: all responses scored the same
    DROPPED_STALE = "dropped_stale"  # Stale-k: K above pool.max_lag at consumption
    # cut short by a stop (SIGTERM/SIGINT, a failure) or left out of a checkpoint: in flight at the
    # checkpoint, or in the batch of a training step that failed. Its prompt goes back to the sampler.
    DROPPED_SHUTDOWN = "dropped_shutdown"


# One response token as stored: 13 bytes (id, behaviour log-prob ℓ^μ_t, version v_t, action flag).
TOKEN = np.dtype([("id", np.int32), ("logprob", np.float32), ("version", np.int32), ("action", np.bool_)])


class Trajectory:
    """One response. ``logprobs[t]`` is ℓ^μ_t and ``versions[t]`` is v_t of response token t.

    The per-token record is one NumPy structured array (`TOKEN`, 13 bytes a token, where Python
    lists took ~100), trimmed to its length when the response finishes (`finish`). The engine
    streams a few tokens per request and step: those are appended to short Python lists (as cheap
    as before on the rollout thread, which holds the GIL the trainer needs) and moved into the array
    in chunks of `FLUSH` tokens (amortised doubling), or when the record is read. ``response_ids``,
    ``logprobs``, ``versions`` and ``action_mask`` are views of the array (writable).

    In a multi-turn tool rollout the response also holds tool-output tokens: context the policy
    did not choose. ``action_mask[t]`` is False for those (their log-prob and version entries are
    placeholders): they are masked out of the loss and left out of the staleness averages
    (docs/design.md §2 averages over model-generated tokens). None: every token is an action.

    ``engine`` is the index of the rollout engine that served every turn of the response, or −1
    when several did (a response continued elsewhere after its engine failed, or kept across a
    restart) or none is known: the trainer's per-engine mismatch (`mismatch/abs_logp_diff/engine<i>`)
    counts only responses served wholly by one engine.

    ``starts`` holds the token indices where a later engine request of the response began (a tool
    turn, a continuation after a restart or a failover: each prefilled anew); with them the KV
    version of every token follows (`kv_versions`, pace/staleness.py).

    MoE routing replay (`algo.routing_replay`): ``prompt_routes`` [P, layers, top-k] and ``routes``
    [m, layers, top-k] (m ≤ length) hold the experts the engine routed each prompt and response
    token to as the model's input (vLLM's `routed_experts`; uint8, uint16 above 256 experts), for the
    positions known so far from position 0 on (the last token is never an input while generating).
    `add_routes` only appends: the routes a token got in the request that computed it are kept when
    a later request (a tool turn, a continuation) computes it again. None: not recorded.
    """

    __slots__ = ("_tok", "_n", "_masked", "_stream", "completed_at", "finish_reason", "correct", "reward",
                 "advantage", "tool_calls", "tool_errors", "resumed", "engine", "starts",
                 "prompt_routes", "routes")
    FLUSH = 256  # streamed tokens held in Python lists before they move into the array

    def __init__(self, response_ids=(), logprobs=(), versions=(), completed_at: int = -1, finish_reason: str = "",
                 correct: bool = False, reward: float = 0.0, advantage: float = 0.0, action_mask=None,
                 tool_calls: int = 0, tool_errors: int = 0, resumed: int = 0, engine: int = -1):
        n = len(response_ids)
        if len(logprobs) != n or len(versions) != n or (action_mask is not None and len(action_mask) != n):
            raise ValueError(f"a trajectory needs one log-prob, version (and action flag) per token: {n} tokens, "
                             f"{len(logprobs)} log-probs, {len(versions)} versions")
        self._tok = np.empty(n, dtype=TOKEN)
        self._n = n
        self._masked = action_mask is not None
        self._stream = None  # [ids, log-probs, versions]: streamed tokens not yet in the array (all actions)
        self._tok["id"], self._tok["logprob"], self._tok["version"] = response_ids, logprobs, versions
        self._tok["action"] = True if action_mask is None else action_mask
        self.completed_at = completed_at  # c(τ): trainer version when the last token was produced
        self.finish_reason = finish_reason  # "stop" (EOS) or "length" (hit rollout.max_tokens)
        self.correct = correct
        self.reward = reward  # ±1 correctness plus overlong shaping
        self.advantage = advantage
        self.tool_calls = tool_calls  # multi-turn: programs run for this response
        self.tool_errors = tool_errors  # of which did not succeed (error, timeout, killed, no program)
        self.resumed = resumed  # tokens kept from a checkpoint and continued after a restart (0: none)
        self.engine = -1 if engine is None else engine  # the engine that served every turn; −1: several, or unknown
        self.starts: list[int] = []  # token indices where a later request of the response began
        self.prompt_routes: np.ndarray | None = None  # [P, layers, top-k]: MoE routing replay
        self.routes: np.ndarray | None = None  # [m ≤ length, layers, top-k]

    def begin_request(self) -> None:
        """A new engine request continues the response from its current length (prefilled anew)."""
        n = len(self)
        if n > 0 and (not self.starts or self.starts[-1] != n):
            self.starts.append(n)

    def add_routes(self, rows: np.ndarray, position: int, prompt_len: int) -> None:
        """The routes of sequence positions ``position`` … ``position + len(rows) − 1`` (prompt and
        response counted together, the prompt ``prompt_len`` tokens long), as an engine request
        returned them: the positions not yet recorded are appended, the others are left as they were
        (a position is recorded once, by the first request that computed it). A gap raises."""
        rows = np.asarray(rows)
        if rows.ndim != 3:
            raise ValueError(f"routes need [positions, layers, top-k] rows, got shape {rows.shape}")
        if self.prompt_routes is None:
            if position > 0:
                raise ValueError(f"routes from position {position} leave the prompt's positions 0.. unrecorded")
            self.prompt_routes = rows[:prompt_len].copy()
        elif self.prompt_routes.shape[1:] != rows.shape[1:]:
            raise ValueError(f"routes of shape {rows.shape[1:]} after {self.prompt_routes.shape[1:]} (layers, top-k)")
        known = prompt_len + (0 if self.routes is None else len(self.routes))
        if position > known:
            raise ValueError(f"routes from position {position} leave positions {known}..{position - 1} unrecorded")
        new = rows[known - position:][: max(prompt_len + len(self) - known, 0)]  # response positions not yet known
        if len(new) or self.routes is None:
            self.routes = new.copy() if self.routes is None else np.concatenate([self.routes, new])

    def served_by(self, engine: int | None) -> None:
        """An output of ``engine`` (None: unknown) was appended: a second engine makes it −1, for good."""
        if engine is None or engine != self.engine:
            self.engine = -1

    # --- growth (the rollout thread) ----------------------------------------------------------
    def extend(self, ids, logprobs, version, action: bool = True) -> None:
        """Append tokens: their ids, ℓ^μ and one version for all (or one per token)."""
        k = len(ids)
        if k == 0:
            return
        if action and isinstance(version, int):  # the engine's stream: a few tokens per step
            if self._stream is None:
                self._stream = [[], [], []]
            s_ids, s_lps, s_vs = self._stream
            s_ids.extend(ids)
            s_lps.extend(logprobs)
            s_vs.extend([version] * k)
            if len(s_ids) >= self.FLUSH:
                self._flush()
            return
        self._flush()
        self._append(ids, logprobs, version, action)

    def _append(self, ids, logprobs, version, action) -> None:
        n, k = self._n, len(ids)
        if n + k > len(self._tok):
            grown = np.empty(max(16, 2 * len(self._tok), n + k), dtype=TOKEN)
            grown[:n] = self._tok[:n]
            self._tok = grown
        new = self._tok[n : n + k]
        new["id"], new["logprob"], new["version"], new["action"] = ids, logprobs, version, action
        self._masked = self._masked or not action
        self._n = n + k

    def _flush(self) -> None:
        if self._stream is not None:
            ids, lps, vs = self._stream
            self._stream = None
            self._append(ids, lps, vs, True)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens."""
        self._flush()
        self._n = min(self._n, n)
        self.starts = [s for s in self.starts if s <= self._n]
        if self.routes is not None:
            self.routes = self.routes[: self._n]

    def finish(self) -> None:
        """Drop the spare capacity of growth (a finished response does not grow)."""
        self._flush()
        if len(self._tok) != self._n:
            self._tok = self._tok[: self._n].copy()

    # --- per-token views ----------------------------------------------------------------------
    def __len__(self) -> int:
        return self._n + (0 if self._stream is None else len(self._stream[0]))

    def _field(self, name: str) -> np.ndarray:
        self._flush()
        return self._tok[name][: self._n]

    @property
    def response_ids(self) -> np.ndarray:
        return self._field("id")

    @property
    def logprobs(self) -> np.ndarray:
        return self._field("logprob")

    @property
    def versions(self) -> np.ndarray:
        return self._field("version")

    @property
    def action_mask(self) -> np.ndarray | None:
        return self._field("action") if self._masked else None

    @property
    def num_actions(self) -> int:
        """Model-generated tokens (the loss's token count)."""
        return len(self) if not self._masked else int(self.action_mask.sum())

    @property
    def action_ids(self) -> np.ndarray:
        """The model-generated tokens (what a multi-turn response is graded on)."""
        return self.response_ids if not self._masked else self.response_ids[self.action_mask]

    @property
    def action_versions(self) -> np.ndarray:
        """v_t of the model-generated tokens (what the staleness averages run over)."""
        return self.versions if not self._masked else self.versions[self.action_mask]

    @property
    def action_starts(self) -> list[int]:
        """``starts`` counted in model-generated tokens (what the records' version spans count)."""
        if not self._masked:
            return list(self.starts)
        before = np.concatenate(([0], np.cumsum(self.action_mask)))
        return [int(before[s]) for s in self.starts]

    def kv_versions(self, reprefill: bool = False) -> np.ndarray:
        """w_t of the model-generated tokens: the oldest version in each one's context (pace/staleness.py)."""
        w = staleness.kv_versions(self.versions, self.starts, reprefill)
        return w if not self._masked else w[self.action_mask]

    @property
    def nbytes(self) -> int:
        """Host bytes of the per-token record: the array (capacity included; streamed tokens moved
        into it first) and the routes, prompt's included (MoE routing replay)."""
        self._flush()
        return self._tok.nbytes + sum(r.nbytes for r in (self.prompt_routes, self.routes) if r is not None)

    # --- pickling (checkpoints, the trainer's scatter): the record without spare capacity -----
    def __getstate__(self):
        self._flush()
        return {name: getattr(self, name) for name in self.__slots__} | {"_tok": self._tok[: self._n]}

    def __setstate__(self, state) -> None:
        if "_tok" not in state:  # a checkpoint from before the compact record (a dataclass of lists)
            state = dict(state)
            fresh = Trajectory(state.pop("response_ids"), state.pop("logprobs"), state.pop("versions"),
                               action_mask=state.pop("action_mask", None))
            state.pop("text", None)
            state |= {"_tok": fresh._tok, "_n": fresh._n, "_masked": fresh._masked}
        # (resumed: absent before in-flight resume; engine: before per-engine accounting)
        # (starts: before KV staleness; routes: before MoE routing replay)
        state = {"_stream": None, "resumed": 0, "engine": -1, "starts": [], "prompt_routes": None, "routes": None} | state
        for name, value in state.items():
            setattr(self, name, value)

    def __repr__(self) -> str:
        return (f"Trajectory({len(self)} tokens, versions {self.versions[:1].tolist()}..{self.versions[-1:].tolist()}, "
                f"completed_at={self.completed_at}, finish_reason={self.finish_reason!r}, reward={self.reward})")


@dataclass
class Group:
    """The G responses to one prompt: the pool's unit."""

    id: int
    prompt_id: str
    prompt_ids: list[int]
    answer: str
    submitted_at: int  # trainer version when the prompt was submitted to the engine
    trajectories: list[Trajectory] = field(default_factory=list)
    fate: Fate = Fate.INFLIGHT
    reason: str = ""
    step: int | None = None  # trainer step at which the fate was decided (consumed/rejected/…)
    pfs: float | None = None  # Prefix Forgetting Score (PACE), None when not rescored
    scores: dict = field(default_factory=dict)  # policy-specific ranking values, logged per group
    pfs_version: int | None = None  # engine version the PFS was computed under
    kv_reprefill: bool = False  # submitted under rollout.kv_on_update=recompute: every update re-prefilled it
    _k_gen: float | None = field(default=None, repr=False, compare=False)
    _k_kv: float | None = field(default=None, repr=False, compare=False)
    _c_mean: float = field(default=0.0, repr=False, compare=False)

    @property
    def completed_at(self) -> int:
        """The group enters the pool at the version its last trajectory completed."""
        return max(t.completed_at for t in self.trajectories)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.trajectories)

    def staleness(self, step: int) -> tuple[float, float, float]:
        """Token-weighted (K, K_gen, K_wait) if consumed at ``step``."""
        return staleness.group_staleness(
            [t.action_versions for t in self.trajectories], [t.completed_at for t in self.trajectories], step
        )

    def k_gen(self) -> float:
        """Generation Staleness: fixed once the group is complete, so computed once."""
        if self._k_gen is None:
            # K_gen does not depend on the step; at step = c(group), K_wait = c − c̄ gives c̄ too.
            _, self._k_gen, wait = self.staleness(self.completed_at)
            self._c_mean = self.completed_at - wait
        return self._k_gen

    def k_kv(self) -> float:
        """KV staleness: token-weighted mean of c(τ) − w_t, fixed once the group is complete (≥ K_gen)."""
        if self._k_kv is None:
            self._k_kv = staleness.group_kv_staleness(
                [t.kv_versions(self.kv_reprefill) for t in self.trajectories], [t.completed_at for t in self.trajectories]
            )
        return self._k_kv

    def k_wait(self, step: int) -> float:
        """Token-weighted Waiting Staleness at ``step`` = step − c̄ (c̄: token-weighted mean of the
        trajectories' completion versions), in O(1) for pool policies that rank every step."""
        self.k_gen()
        return step - self._c_mean


@dataclass
class Batch:
    """What the trainer consumes at step ``step``: B groups (G trajectories each)."""

    step: int
    groups: list[Group]

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]
