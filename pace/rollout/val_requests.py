"""In-training validation requests on the rollout engines (`eval.every`): the rollout thread's
side, which submits them and hands each finished one to the trainer thread as a `ValResult`
(the trainer's side, the logged rows and the best checkpoint: pace/validation.py). A mixin of
`RolloutWorker`; state: ``_val`` (the run in progress), ``_val_next``, ``val_results`` (the queue
to the trainer thread), ``validated_version``.

Right after θ_v loads for a due v, the validation set is submitted (one n = k request per problem,
ahead of rollout work) and further weight updates are held until it is graded, so every
validation sample comes from θ_v exactly. θ_v is validated for v = 0 (`eval.at_start`), the first
loaded version at or past each multiple of `eval.every`, and the final version (`trainer.steps`).
`val_started` is the version whose validation was last submitted: with a blocking weight transfer
(nccl, gloo, ipc) it is set before the trainer's `publish` returns, so the trainer learns from the
schedule itself, not a copy of it, that θ_v will be validated (and keeps a copy of θ_v for the best
checkpoint: pace/validation.py).
"""
from __future__ import annotations

import queue
import time
from dataclasses import dataclass

from pace.rollout import engine as engine_lib
from pace.rollout import request_ids


@dataclass
class ValResult:
    """mean@k of θ_version on the validation sets, handed to the trainer thread."""

    version: int
    results: dict[str, list[list[bool]]]  # per set, per problem, the k grades
    seconds: float  # submission to last grade; weight updates were held meanwhile
    response_len: float  # mean over all samples, tokens
    weights: list | None  # θ_version as (name, tensor); None for version 0 (the model on disk)


class ValRequestsMixin:
    val_started: int | None = None  # the version whose validation was last submitted

    @property
    def validating(self) -> int | None:
        """The version whose validation's requests are on the engines (submitted, not all graded), or None."""
        val = getattr(self, "_val", None)
        return None if val is None else val[1]

    def _maybe_validate(self, weights) -> None:
        """``weights``: a callable returning θ_v as (name, tensor) pairs (read only if v is due), or None."""
        v = self.engine_version
        if self.val_sets is None or not (v >= self._val_next or v == self.final_version):
            return
        from pace import evaluation

        every = self.cfg.eval.every
        self._val_next = (v // every + 1) * every
        params = evaluation.sampling_params(self.cfg, self.tokenizer, seeded=False, k=self.cfg.eval.val_k)
        run = evaluation.EvalRun(self.val_sets, params, self.grader,
                                 prefix=request_ids.validation_prefix(v),
                                 answer_timeout_s=self.cfg.reward.timeout_s / self.group_size,
                                 tools=evaluation.tool_runner(self.cfg, self.tokenizer, on_done=self._wake.set),
                                 tokenizer=self.tokenizer)  # token ids: no routed experts of the prompts asked for
        run.submit(self.fleet, priority=engine_lib.VALIDATION_PRIORITY, salt=engine_lib.cache_salt(v))
        self._val = (run, v, weights() if weights is not None else None, time.perf_counter())
        self.val_started = v

    def _poll_validation(self) -> bool:
        if self._val is None:
            return False
        run, version, weights, t0 = self._val
        if not run.poll():
            return False
        self._val = None
        if self.engine_version != version:  # the hold in _apply_update guarantees this
            raise RuntimeError(f"validation of θ_{version} ran into a weight update (engine at θ_{self.engine_version})")
        response_len = sum(run.lengths) / max(len(run.lengths), 1)
        self.val_results.put(ValResult(version, run.results, time.perf_counter() - t0, response_len, weights))
        self.validated_version = version
        self._wake.set()
        return True

    def drain_val_results(self) -> list[ValResult]:
        """The results of the validations finished since the last call (trainer thread)."""
        out = []
        while True:
            try:
                out.append(self.val_results.get_nowait())
            except queue.Empty:
                return out
