"""A simulated vLLM engine: continuous batching over decode steps, a KV budget, weight updates in flight.

Each decode step, every running sequence produces one token. A step costs

    latency = step_s + per_seq_s · n + per_ctx_token_s · S        n running, S = Σ context (KV in use)

(a fixed launch/sampling cost, a per-sequence cost, and attention reading the KV cache; all ×
`train_slowdown` while the trainer trains, for engines that share its processors: the CPU lab's
2 cores, or `rollout.placement=colocate`), and
prefill costs `prefill_token_s` per token, paid on the next step: a group's prompt once per
weights version (its G requests share it through prefix caching, salted by version as in the real
rollout), a preempted sequence's whole context again when it resumes (recompute), and the prefixes
PACE rescores. A sequence is admitted (first come, first served) while fewer than
`rollout.max_num_seqs` run and its context fits the KV budget (`kv_tokens`); when decoding would
overflow it, the newest sequence is preempted to the front of the queue (vLLM's recompute
preemption).

Between two events (a finish, a preemption, an arrival, an update) n is fixed and S grows by n per
step, so m steps take  P + m·(a + b·n + c·S) + c·n·m(m−1)/2  (P: pending prefill), in closed
form: the engine jumps from event to event, exact to the step, at O(log n) per event whatever the
number of decode steps in between. An arrival or an update at time t lands at the end of the step
in progress (`advance_to`), as vLLM admits requests and `pause_generation(mode="keep")` loads
weights between steps; requests in flight continue under the new weights.

Token versions: the engine logs the decode-step counter at each load, so a response's version
spans follow from the counters it ran at: a token's version is the one loaded at its step. A
sequence resumed after preemption marks where its new run began (`SimGroup.kv_starts`): its KV was
prefilled again there, under the weights of that moment (K_kv, pace/sim/records.py).

`reprefill` (`rollout.kv_on_update=recompute`): at every load the running sequences' contexts are
prefilled again under the new weights (a group's prompt once, shared through the prefix cache), paid
on the next step and counted in `reprefill_tokens` (and `prefill_tokens`); their K_kv is their K_gen.
"""
from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from typing import NamedTuple

from pace.sim.records import SimGroup


class Finished(NamedTuple):
    """Response ``index`` of ``group`` produced its last token at simulated time ``time``."""

    group: SimGroup
    index: int
    time: float


class SimEngine:
    def __init__(self, idx: int, cfg, max_num_seqs: int, reprefill: bool = False):
        self.idx = idx
        self.reprefill = reprefill
        self.a, self.b, self.c = cfg.step_s, cfg.per_seq_s, cfg.per_ctx_token_s
        self.prefill_s, self.stall_s = cfg.prefill_token_s, cfg.stall_s
        self.slow = 1.0  # latency factor (`train_slowdown` while a colocated trainer trains)
        self.kv = math.inf if cfg.kv_tokens is None else cfg.kv_tokens
        self.max_num_seqs = max_num_seqs
        self.version = 0
        self._vc, self._vv = [0], [0]  # version log: decode-step counter at which each version loaded
        self.counter = 0  # decode steps done
        self.clock = 0.0  # time at the end of step `counter` (or of a stall / idle time after it)
        self.n = 0  # running sequences
        self.S = 0  # their Σ context: KV tokens in use
        self._heap: list[tuple[int, int]] = []  # (finish counter, sequence id) of running sequences
        self._seqs: dict[int, list] = {}  # sequence id → [group, response, segment start, context at start]
        self._order: list[int] = []  # running sequence ids in admission order (stale ids skipped)
        self._next_sid = 0
        self.waiting: deque[tuple[SimGroup, int, int]] = deque()  # (group, response, tokens produced)
        self._prefill = 0  # tokens to prefill on the next step
        self.event_id = 0  # bumped when the next event changes (a scheduled older one is stale)
        self._next_at, self._next = -1, (0, False)  # `_steps_to_next` at event_id `_next_at`
        self.tokens = self.busy_s = self.preempted = self.prefill_tokens = self.reprefill_tokens = 0  # counters (`stats`)
        self.rescore_s = 0.0  # engine seconds of PACE's prefix prefills (`add_prefill`)

    @property
    def stats(self) -> dict:
        return {"tokens": self.tokens, "decode_steps": self.counter, "busy_s": self.busy_s,
                "preempted": self.preempted, "prefill_tokens": self.prefill_tokens, "rescore_s": self.rescore_s,
                "reprefill_tokens": self.reprefill_tokens}

    def open_tokens(self) -> dict[int, int]:
        """Tokens made so far by the running sequences and not yet in their responses' spans, per
        group id (as of this engine's last step)."""
        out: dict[int, int] = {}
        for group, _, start, _ in self._seqs.values():
            out[group.id] = out.get(group.id, 0) + self.counter - start
        return out

    @property
    def load(self) -> int:
        return self.n + len(self.waiting)

    # --- work in (at time `now`: the engine is first brought to the step boundary then) -----------
    def submit(self, group: SimGroup, now: float) -> list[Finished]:
        done = self.advance_to(now)
        group.engine = self.idx
        group.kv_reprefill = self.reprefill
        self.waiting.extend((group, i, 0) for i in range(len(group.lengths)))
        self._admit()
        return done

    def add_prefill(self, tokens: int, now: float) -> list[Finished]:
        """Prefill work not tied to a running sequence (PACE's prefix rescoring)."""
        done = self.advance_to(now)
        self._prefill += tokens
        self.rescore_s += self.slow * tokens * self.prefill_s
        self.event_id += 1  # the next step is longer: a scheduled event is stale
        return done

    def set_slowdown(self, factor: float, now: float) -> list[Finished]:
        """Steps from the end of the one in progress at ``now`` on take ``factor`` × their latency."""
        done = self.advance_to(now)
        self.slow = factor
        self.event_id += 1
        return done

    def load_weights(self, version: int, now: float, stall_s: float | None = None) -> list[Finished]:
        """Weights ``version`` load at the end of the step in progress at ``now``, then a stall of
        ``stall_s`` (default: the configured one)."""
        done = self.advance_to(now)
        self.clock += self.stall_s if stall_s is None else stall_s
        self.version = version
        self._vc.append(self.counter)
        self._vv.append(version)
        if self.reprefill:
            self._reprefill_running()
        self.event_id += 1  # the stall moves the next event
        return done

    def _reprefill_running(self) -> None:
        """`reprefill`: every running sequence's context is prefilled again under the weights just
        loaded (a group's prompt once: the sequences of a group share it through the prefix cache)."""
        cached = (self.idx, self.version)
        tokens = 0
        for group, _, start, ctx0 in self._seqs.values():
            tokens += ctx0 + (self.counter - start) - group.prompt_tokens
            if group.prefix_cached != cached:
                group.prefix_cached = cached
                tokens += group.prompt_tokens
        self._prefill += tokens
        self.reprefill_tokens += tokens

    # --- time ------------------------------------------------------------------------------------
    def token_rate(self) -> float:
        """Tokens a second the running sequences produce now (decode steps at the current n and S)."""
        return self.n / (self.slow * (self.a + self.b * self.n + self.c * self.S)) if self.n else 0.0

    def _span(self, m: int) -> float:
        """Seconds of the next m steps at the current n and S (with the pending prefill)."""
        a = self.a + self.b * self.n + self.c * self.S
        return self.slow * (self._prefill * self.prefill_s + m * a + self.c * self.n * m * (m - 1) / 2)

    def _steps_to_next(self) -> tuple[int, bool]:
        """(steps to the next internal event, whether it is a KV overflow rather than a finish);
        cached until the engine's state changes (`event_id`)."""
        if self._next_at == self.event_id:
            return self._next
        while self._heap and self._heap[0][1] not in self._seqs:
            heapq.heappop(self._heap)  # preempted: its entry is stale
        m = self._heap[0][0] - self.counter
        room = m if self.kv == math.inf else int((self.kv - self.S) // self.n)  # steps whose new tokens still fit
        self._next_at, self._next = self.event_id, ((room, True) if room < m else (m, False))
        return self._next

    def next_event(self) -> float | None:
        """Time of the next finish or preemption; None when idle."""
        if self.n == 0:
            return None
        m, _ = self._steps_to_next()
        return self.clock + self._span(m)

    def run_event(self) -> list[Finished]:
        """Advance to the next internal event (finishes at that step, or a preemption)."""
        m, _ = self._steps_to_next()  # ≥ 1: every change leaves room for the next step (`_advance`, `_admit`)
        done = self._advance(m)
        self._admit()
        return done

    def advance_to(self, t: float) -> list[Finished]:
        """Bring the engine to the end of the step in progress at time ``t`` (idle: to ``t``)."""
        d = t - self.clock
        if d <= 0:
            return []
        if self.n == 0:
            self.clock = t
            return []
        m_next, _ = self._steps_to_next()
        m = min(self._steps_within(d), m_next)
        done = self._advance(m)
        self._admit()
        return done

    def _steps_within(self, d: float) -> int:
        """The smallest m ≥ 1 whose steps end at or after ``d`` seconds from now."""
        a = self.a + self.b * self.n + self.c * self.S
        q, p = self.c * self.n / 2, self._prefill * self.prefill_s
        x = max(d / self.slow - p, 0.0)  # unscaled decode seconds to cover
        if q > 0:
            lin = a - q
            m = math.ceil((-lin + math.sqrt(lin * lin + 4 * q * x)) / (2 * q))
        else:
            m = math.ceil(x / a)
        m = max(m, 1)
        while self._span(m) < d:  # floating-point rounding of the root
            m += 1
        while m > 1 and self._span(m - 1) >= d:
            m -= 1
        return m

    def _advance(self, m: int) -> list[Finished]:
        n, prefill = self.n, self._prefill
        dt = self._span(m)
        self.tokens += n * m
        self.busy_s += dt
        self.prefill_tokens += prefill
        self._prefill = 0
        counter = self.counter = self.counter + m
        clock = self.clock = self.clock + dt
        S = self.S + n * m
        done = []
        heap, seqs = self._heap, self._seqs
        while heap and heap[0][0] <= counter:
            seq = seqs.pop(heapq.heappop(heap)[1], None)
            if seq is None:
                continue  # preempted earlier
            group, j, start, ctx0 = seq
            n -= 1
            S -= ctx0 + (counter - start)
            self._close_segment(group, j, start, counter)
            done.append(Finished(group, j, clock))
        self.n, self.S = n, S
        while self.n and self.S + self.n > self.kv:  # the next step's tokens do not fit: free the newest
            self._preempt_newest()
        self.event_id += 1
        return done

    def _admit(self) -> None:
        waiting = self.waiting
        if not waiting or self.n >= self.max_num_seqs:
            self.event_id += 1
            return
        n, S, kv, counter = self.n, self.S, self.kv, self.counter
        seqs, order, heap = self._seqs, self._order, self._heap
        cached = (self.idx, self.version)
        while waiting and n < self.max_num_seqs:
            group, j, produced = waiting[0]
            ctx = group.prompt_tokens + produced
            if n and S + n + ctx + 1 > kv:
                break  # FCFS: later requests wait behind the one that does not fit
            waiting.popleft()
            if produced:  # resumed after preemption: its whole context is recomputed
                self._prefill += ctx
                group.kv_starts.setdefault(j, []).append(produced)  # its KV from here on: this version's
            elif group.prefix_cached != cached:  # the prompt is cached per group and version
                group.prefix_cached = cached
                self._prefill += group.prompt_tokens
            sid = self._next_sid
            self._next_sid += 1
            seqs[sid] = [group, j, counter, ctx]
            order.append(sid)
            heapq.heappush(heap, (counter + group.lengths[j] - produced, sid))
            n += 1
            S += ctx
        self.n, self.S = n, S
        if len(order) > 4 * len(seqs) + 1024:  # drop the ids of finished sequences
            self._order = [i for i in order if i in seqs]
        self.event_id += 1

    def _preempt_newest(self) -> None:
        while self._order[-1] not in self._seqs:
            self._order.pop()
        sid = self._order.pop()
        group, j, start, ctx0 = self._seqs.pop(sid)
        ran = self.counter - start
        self._close_segment(group, j, start, self.counter)
        self.n -= 1
        self.S -= ctx0 + ran
        self.waiting.appendleft((group, j, ctx0 + ran - group.prompt_tokens))
        self.preempted += 1

    def _close_segment(self, group: SimGroup, j: int, start: int, end: int) -> None:
        """Append the versions of the tokens made at steps start+1 … end to response j's spans."""
        spans = group.spans[j]
        vc, vv = self._vc, self._vv
        if vc[-1] <= start:  # no load since the segment began (the common case): one span
            if spans and spans[-2] == vv[-1]:
                spans[-1] += end - start
            elif end > start:
                spans += (vv[-1], end - start)
            return
        i = bisect.bisect_right(vc, start) - 1
        while start < end:
            stop = min(end, vc[i + 1]) if i + 1 < len(vc) else end
            if stop > start:
                if spans and spans[-2] == vv[i]:
                    spans[-1] += stop - start
                else:
                    spans += (vv[i], stop - start)
                start = stop
            i += 1
